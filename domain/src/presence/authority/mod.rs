//! The presence authority: the fenced, expiring route directory of the hash slots a
//! node leads (`docs/authority-rules.md`, rules 1–27). Sans-IO: every call takes `now_s`
//! (whole seconds of the authority's clock) and returns its outcome.
//!
//! - [`Directory`]: the shared, lock-free view of all 256 hash slots (identity and
//!   active endpoints per uid), created once per node.
//! - [`Authority`]: the single writer of the hash slots one shard claimed. It keeps
//!   the full records (routes, pending candidates, fence records, at most one
//!   expiry deadline per record) and publishes each uid's active endpoints to the
//!   directory.
//! - [`AuthorityReader`]: lookups from any thread, never blocking the writer.
//!
//! # Layout for speed
//! - Per slot, records live in a slab (`u32` indices, cache-aligned records),
//!   linked per uid. Deadlines (a route's expiry, a fence record's retention) sit in
//!   the slot's [`ExpiryRing`](expiry): one-second buckets of record indices, each
//!   entry visited once, when due; candidates' deadlines in a timer wheel. An expiry
//!   pass reads and writes only a record's first cache line, touches no reference
//!   count (an expired route's data stays, stale, until replaced or dropped with its
//!   record), removes the one endpoint from the published entry without reading the
//!   uid's other records, and sets the retention deadline (a push). Due entries of
//!   all slots go through one software pipeline that prefetches records and
//!   published entries ahead.
//! - The published directory is one 64-byte line per uid (see `published`);
//!   lookups copy out [`CompactEndpoint`]s (no `Arc` clone) or full [`Endpoint`]s.
//!
//! # Contract and decisions beyond the rules
//! - Every call carries the exact [`Target`]; a call for a hash slot this writer has
//!   not installed gets `NotLeader`, any other difference `StaleTarget` (rules 1, 2).
//!   A route whose uid does not hash to the target's slot is bad input: `StaleTarget`.
//! - Activity times: a route's activity second is clamped to `now_s` (a future value
//!   cannot pin a route). A touch carries its activity time in `last_active_s`
//!   (`None`: `now_s`) and never moves a route's time backward (rule 14). A route
//!   registered without activity time keeps none (rule 23), also when touched.
//! - A route with last activity `a` expires once `a + route_ttl_s < now_s`; a pending
//!   candidate registered at `t` is dropped once `t + pending_ttl_s < now_s`.
//! - Commit removes the acknowledged conflicts *and records a tombstone at their
//!   owner_seq*: the owner acknowledged closing them, so a delayed touch of such a
//!   route must not bring it back.
//! - Register below the identity's last owner_seq is accepted (the rules fence
//!   register only by the tombstone); the last owner_seq never decreases.
//! - Fence records (last owner_seq, tombstone per identity) outlive their route by
//!   `fence_retention_s` (counted from the moment the identity has neither route nor
//!   candidate, restarted by each unregister), then are dropped by the same expiry
//!   passes that expire routes. A message delayed longer than
//!   that retention is no longer fenced: a register or touch at or below the
//!   forgotten tombstone would (re)create the route. Such a route belongs to a closed session: the owner refuses pushes to
//!   it (it revalidates uid, boot_id, session_id, owner_seq) and, never touched, it
//!   expires after `route_ttl_s`. Keep `fence_retention_s` well above the longest
//!   delay an RPC can suffer.
//! - Limits (all in [`AuthorityConfig`]): a call that would pass one fails with
//!   [`AuthorityError::Full`] and changes nothing; nothing grows without bound.

mod config;
mod expiry;
mod handover;
mod huge;
mod presence;
mod published;
mod reader;
mod seqline;
mod service;
mod writer;

/// The atomics of `seqline` (the loom model, `tests/published_loom.rs`, gives it
/// loom's instead).
mod line_sync {
    pub(crate) use std::sync::atomic::{fence, AtomicU64, Ordering};

    /// In a reader's retry loop.
    #[inline(always)]
    pub(crate) fn spin() {
        std::hint::spin_loop();
    }

    /// The writer's load of a word only it stores: its last store.
    #[inline(always)]
    pub(crate) fn own_load(a: &AtomicU64) -> u64 {
        a.load(Ordering::Relaxed)
    }
}

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use slots::{hash_slot, HASH_SLOTS};
use wheel::{TimerWheel, WheelStats};

use expiry::{ExpiryRing, RingLink};

pub use config::{AuthorityConfig, ConfigError};
pub use handover::{Handover, HandoverBatch, HandoverOutcome};
pub use published::{Directory, FilterCounts, FxBuildHasher, FxHasher};
use published::{FilterLimits, SlotView, TableWriter, NIL};
pub use reader::{AuthorityReader, HashedGroup};
pub use service::{AuthorityReply, TouchAnswer};
use writer::*;

use crate::cluster::{ClusterView, HashSlot, NodeId, Revision, Target};
use crate::presence::route::{
    AuthorityError, BootId, CompactEndpoint, DeviceLevel, Endpoint, OwnerAction, OwnerActionKind,
    OwnerSeq, PendingToken, RegisterOutcome, Route, RouteIdentity, SessionId, Uid,
};

impl Directory {
    /// A directory with no identity installed, for writers and readers configured by
    /// `config` (validated).
    pub fn new(config: &AuthorityConfig) -> Result<Arc<Directory>, ConfigError> {
        config.validate()?;
        Ok(Arc::new(Directory::with_limit(config.lookup_uids_max)))
    }
}

/// Why a writer could not be created.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ClaimError {
    /// The hash slot is out of range.
    BadSlot(HashSlot),
    /// Another writer already claimed the hash slot.
    AlreadyClaimed(HashSlot),
    /// The configuration is invalid.
    Config(ConfigError),
}

impl std::fmt::Display for ClaimError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClaimError::BadSlot(s) => write!(f, "hash slot {s} out of range"),
            ClaimError::AlreadyClaimed(s) => write!(f, "hash slot {s} already has a writer"),
            ClaimError::Config(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for ClaimError {}

/// What [`Authority::install`] did.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum InstallOutcome {
    /// No identity was installed: a fresh, empty one now is.
    Fresh,
    /// A different identity (new term, epoch, leader or slot id) replaced the old
    /// one; all state of the slot was cleared (rule 3).
    Replaced,
    /// Same identity: everything kept, observed revision advanced (rule 4).
    RevisionAdvanced,
    /// Same identity and no newer revision: nothing changed.
    Unchanged,
}

/// Per-entry result of a touch, in the order of the touched routes. The owner
/// requeues only [`TouchResult::Full`] entries (if the route is still current).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum TouchResult {
    /// The exact active route's activity was refreshed (or was already newer).
    Refreshed,
    /// The route was missing and conflicted with nothing: recreated active (rule 15).
    Recreated,
    /// Below the identity's last owner_seq (rule 16).
    IgnoredStaleSeq,
    /// At or below the identity's unregister tombstone (rule 16).
    IgnoredTombstoned,
    /// Missing and would conflict with an active route: only registration resolves it.
    IgnoredConflict,
    /// The uid does not hash to the target's slot (bad input).
    WrongSlot,
    /// Recreating it would pass a limit; retry later.
    Full,
}

/// Per-call counts of a touch batch.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct TouchCounts {
    /// Routes found active and refreshed ([`TouchResult::Refreshed`]).
    pub refreshed: usize,
    /// Missing routes recreated active ([`TouchResult::Recreated`]).
    pub recreated: usize,
    /// Routes ignored: stale seq, tombstoned, conflicting or in the wrong slot.
    pub ignored: usize,
    /// Routes not recreated because a limit was reached ([`TouchResult::Full`]).
    pub full: usize,
}

/// One identity's fence record (inspection).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct FenceRecord {
    /// The highest owner_seq registered, touched or unregistered for the identity; a
    /// touch below it is ignored (rule 16).
    pub last_owner_seq: OwnerSeq,
    /// The identity's unregister tombstone: a register or touch at or below it is
    /// refused or ignored (rules 12, 16). `None` before any unregister.
    pub tombstone: Option<OwnerSeq>,
    /// `Some` while the identity has neither route nor candidate: the second at
    /// which the record is dropped.
    pub retain_until_s: Option<u64>,
}

/// Sizes of one slot's directory (inspection).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct SlotCounts {
    /// Routes active (visible to lookups).
    pub active_routes: usize,
    /// Pending candidates waiting for commit or abort.
    pub pending: usize,
    /// Identity records kept: those with a route or candidate, and those retained
    /// for their fence.
    pub fence_records: usize,
}

/// Cumulative counters of one writer.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct AuthorityStats {
    /// Active routes removed by expiry passes: no activity for `route_ttl_s`.
    pub routes_expired: u64,
    /// Candidates dropped by expiry passes: not committed or aborted within
    /// `pending_ttl_s`.
    pub pending_expired: u64,
    /// Identity records dropped after `fence_retention_s` without route or candidate.
    pub fence_records_dropped: u64,
    /// Buckets emptied by expiry passes (expiry rings and candidate wheels).
    pub expiry_buckets_visited: u64,
    /// Entries examined by expiry passes (fired, or placed again: a deadline beyond
    /// the ring's window, a wheel entry moved to a finer level).
    pub expiry_entries_visited: u64,
    /// Presence filters rebuilt from their table (grown, or past
    /// `presence_filter_stale_percent` of stale bits).
    pub filter_rebuilds: u64,
    /// Routes applied from handovers of hash slots this writer gained.
    pub handover_routes: u64,
    /// Waits for a handover ended by `handover_wait_s`, or because its old
    /// leader was unreachable (`Authority::end_waits_from`), rather than by the
    /// handover (its lookups then answered from the gateways' rebuild alone).
    pub handover_waits_expired: u64,
    /// Handovers of slots lost while they waited for their own, sent once it
    /// came (or its wait ran out).
    pub handovers_relayed: u64,
    /// Handover batches that came when their slot no longer waited for them
    /// (their routes are not applied).
    pub handovers_ignored: u64,
}

/// A route that became active or ended at its authority, with its uid's active
/// routes after the change (every node's: the authority sees them all): what the
/// `user.onlinestatus` webhook reports, as WuKongIM's
/// `uid-device_flag-online-session_id-device_online-total_online`. Recorded only
/// when switched on ([`Authority::record_presence`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PresenceChange {
    /// The route's uid.
    pub uid: Uid,
    /// The route's device flag.
    pub device_flag: u8,
    /// Became active (`true`) or ended: unregistered, expired, replaced by a
    /// conflicting login's commit.
    pub online: bool,
    /// The route's session (WuKongIM's connection id).
    pub session_id: SessionId,
    /// The uid's active routes with this device flag, after the change.
    pub device_online: u32,
    /// The uid's active routes, after the change.
    pub total_online: u32,
}

/// The changes recorded since the driver last took them.
#[derive(Default)]
struct PresenceLog {
    on: bool,
    changes: Vec<PresenceChange>,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
struct Sess {
    node_id: NodeId,
    boot_id: BootId,
    session_id: SessionId,
}

impl Sess {
    #[inline]
    fn of_route(r: &Route) -> Sess {
        Sess {
            node_id: r.node_id,
            boot_id: r.boot_id,
            session_id: r.session_id,
        }
    }
    #[inline]
    fn of_identity(r: &RouteIdentity) -> Sess {
        Sess {
            node_id: r.node_id,
            boot_id: r.boot_id,
            session_id: r.session_id,
        }
    }
    fn identity(&self, uid: &Uid) -> RouteIdentity {
        RouteIdentity {
            uid: uid.clone(),
            node_id: self.node_id,
            boot_id: self.boot_id,
            session_id: self.session_id,
        }
    }
}

struct Active {
    route: Route,
    activation: u64,
}

struct Pending {
    route: Route,
    nonce: u64,
    acks: Vec<(Sess, OwnerSeq)>,
    timer: wheel::TimerHandle,
}

/// What [`SlotWriter::check_invariants`] counted while walking the records.
#[derive(Clone, Copy, Default)]
struct Tally {
    active: usize,
    pending: usize,
    records: usize,
    timers: usize,
    deadlines: usize,
}

/// What [`SlotWriter::register`] found of a route's uid before deciding.
struct RegisterFound {
    /// The active routes of the uid's other sessions that the route conflicts with:
    /// their session, owner_seq, and whether the owner kicks before closing.
    conflicts: Vec<(Sess, OwnerSeq, bool)>,
    /// The route's own record is tombstoned at or above its owner_seq.
    tombstoned: bool,
    /// The route's own record has an active route.
    had_active: bool,
    /// The route's own record has a candidate.
    had_pending: bool,
}

/// Everything the slot knows about one identity. Cache-line aligned, and laid out
/// (`repr(C)`) so that an expiry pass reads and writes only the first line.
#[repr(C, align(64))]
struct Record {
    /// The user (uid) of this record, and the user's next record (`NIL`: last).
    user: u32,
    next: u32,
    /// The record's place in the slot's expiry ring: its active route's expiry
    /// (when it has an activity time) or its retention deadline (when it has
    /// neither route nor candidate); none otherwise (see [`wanted_deadline`]).
    link: RingLink,
    /// Whether `route` is the active route. Expiry and unregister clear it without
    /// dropping the route (a pass touches no reference count: the uid's and device
    /// id's `Arc`s live on other lines); a stale route is dropped when replaced or
    /// with its record.
    is_active: bool,
    retain_until_s: Option<u64>,
    pending: Option<Box<Pending>>,
    tombstone: Option<OwnerSeq>,
    // Second line on.
    sess: Sess,
    last_owner_seq: OwnerSeq,
    /// Nonce of the newest registration of this identity (supersedes older tokens).
    last_nonce: u64,
    route: Option<Active>,
}

// A vacant slab slot costs no more than a record (the niche of `is_active`), and
// what an expiry pass reads and writes is on the record's first cache line.
const _: () = assert!(std::mem::size_of::<Option<Record>>() == std::mem::size_of::<Record>());
const _: () = assert!(std::mem::offset_of!(Record, sess) <= 64);

impl Record {
    fn new(user: u32, next: u32, sess: Sess) -> Record {
        Record {
            user,
            next,
            link: RingLink::NONE,
            is_active: false,
            retain_until_s: None,
            pending: None,
            tombstone: None,
            sess,
            last_owner_seq: 0,
            last_nonce: 0,
            route: None,
        }
    }
    #[inline]
    fn tombstoned(&self, owner_seq: OwnerSeq) -> bool {
        self.tombstone.is_some_and(|t| owner_seq <= t)
    }
    /// The active route.
    #[inline]
    fn active(&self) -> Option<&Active> {
        if self.is_active {
            self.route.as_ref()
        } else {
            None
        }
    }
    #[inline]
    fn active_mut(&mut self) -> Option<&mut Active> {
        if self.is_active {
            self.route.as_mut()
        } else {
            None
        }
    }
    /// Makes `a` the active route (a stale one is dropped).
    #[inline]
    fn activate(&mut self, a: Active) {
        self.route = Some(a);
        self.is_active = true;
    }
    /// Ends the active route, keeping its data (stale, see `is_active`); returns
    /// its owner_seq.
    #[inline]
    fn deactivate(&mut self) -> Option<OwnerSeq> {
        if !self.is_active {
            return None;
        }
        self.is_active = false;
        self.route.as_ref().map(|a| a.route.owner_seq)
    }
}

/// One uid of a slot: its records, linked from `first` through [`Record::next`].
struct User {
    uid: Uid,
    first: u32,
    /// Length of the list (at most `records_per_uid_max`).
    records: u32,
}

/// Items with stable `u32` indices; vacated indices are reused first. Holds at most
/// the peak number of live items, which the callers bound by their limits.
struct Slab<T> {
    items: Vec<Option<T>>,
    free: Vec<u32>,
    len: usize,
}

impl<T> Slab<T> {
    fn new() -> Self {
        Slab {
            items: Vec::new(),
            free: Vec::new(),
            len: 0,
        }
    }

    fn insert(&mut self, v: T) -> u32 {
        self.len += 1;
        if let Some(i) = self.free.pop() {
            debug_assert!(self.items[i as usize].is_none());
            self.items[i as usize] = Some(v);
            i
        } else {
            assert!(
                self.items.len() < NIL as usize,
                "slab index space exhausted"
            );
            self.items.push(Some(v));
            (self.items.len() - 1) as u32
        }
    }

    fn remove(&mut self, i: u32) -> Option<T> {
        let v = self.items.get_mut(i as usize)?.take()?;
        self.free.push(i);
        self.len -= 1;
        Some(v)
    }

    #[inline]
    fn get(&self, i: u32) -> Option<&T> {
        self.items.get(i as usize)?.as_ref()
    }

    #[inline]
    fn get_mut(&mut self, i: u32) -> Option<&mut T> {
        self.items.get_mut(i as usize)?.as_mut()
    }

    fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.items
            .iter()
            .enumerate()
            .filter_map(|(i, v)| v.as_ref().map(|v| (i as u32, v)))
    }

    #[inline(always)]
    fn prefetch(&self, i: u32) {
        published::prefetch(self.items.as_ptr().wrapping_add(i as usize));
    }
}

impl<T> std::ops::Index<u32> for Slab<T> {
    type Output = T;
    /// Panics on a vacant index: every index the writer keeps names a live item.
    #[inline]
    fn index(&self, i: u32) -> &T {
        self.get(i).expect("slab index of a vacant item")
    }
}

impl<T> std::ops::IndexMut<u32> for Slab<T> {
    #[inline]
    fn index_mut(&mut self, i: u32) -> &mut T {
        self.get_mut(i).expect("slab index of a vacant item")
    }
}

/// The records of one user, from its first.
struct UserRecords<'a> {
    recs: &'a Slab<Record>,
    next: u32,
}

impl<'a> Iterator for UserRecords<'a> {
    type Item = (u32, &'a Record);
    #[inline]
    fn next(&mut self) -> Option<(u32, &'a Record)> {
        if self.next == NIL {
            return None;
        }
        let i = self.next;
        let r = &self.recs[i];
        self.next = r.next;
        Some((i, r))
    }
}

#[inline]
fn records_from(recs: &Slab<Record>, first: u32) -> UserRecords<'_> {
    UserRecords { recs, next: first }
}

/// A due entry of an expiry pass: a record's deadline (from the slot's ring) or a
/// candidate's (from the slot's wheel: the record and the candidate's nonce).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Due {
    Record(u32),
    Pending(u32, u64),
}

impl Due {
    #[inline]
    fn rec(self) -> u32 {
        match self {
            Due::Record(i) | Due::Pending(i, _) => i,
        }
    }
}

/// The single writer of the hash slots one shard claimed. See the module docs.
pub struct Authority {
    cfg: AuthorityConfig,
    dir: Arc<Directory>,
    owned: Box<[bool]>,
    slots: Vec<Option<Box<SlotWriter>>>,
    view_revision: Option<Revision>,
    stats: AuthorityStats,
    /// Presence filter rebuilds of this writer's slots (`AuthorityStats`).
    filter_rebuilds: Arc<std::sync::atomic::AtomicU64>,
    /// The due entries of an expiry pass, with their slot (at most the rings' and
    /// wheels' limits; capacity kept across passes).
    fired: Vec<(HashSlot, Due)>,
    /// Registration nonces of each slot, kept across identities so a token of an
    /// older identity never names a candidate of a newer one.
    next_nonce: Box<[u64]>,
    /// Route changes since the driver took them (when switched on).
    presence: PresenceLog,
    /// Slots installed waiting for their handover (`handover` module).
    waiting: Box<[Option<handover::Waiting>]>,
    /// Handover batches for identities not installed yet.
    kept: handover::Kept,
    /// Handovers of slots this writer lost, until the driver takes them (one per
    /// slot at most).
    handovers: Vec<Handover>,
    /// Slots lost while waiting for their own handover (one per slot at most).
    relays: Vec<handover::Relay>,
}

impl Drop for Authority {
    fn drop(&mut self) {
        for (s, &owned) in self.owned.iter().enumerate() {
            if owned {
                if self.slots[s].is_some() {
                    self.dir.remove(s);
                }
                self.dir.release(s);
            }
        }
    }
}

impl Authority {
    /// The writer of `hash_slots` in `dir` (each hash slot has at most one writer;
    /// dropping the writer removes its slots' state and releases them).
    pub fn new(
        cfg: AuthorityConfig,
        dir: &Arc<Directory>,
        hash_slots: &[HashSlot],
    ) -> Result<Authority, ClaimError> {
        cfg.validate().map_err(ClaimError::Config)?;
        let mut owned = vec![false; HASH_SLOTS].into_boxed_slice();
        for &s in hash_slots {
            if s as usize >= HASH_SLOTS {
                return Err(ClaimError::BadSlot(s));
            }
            if owned[s as usize] {
                continue;
            }
            if !dir.claim(s as usize) {
                for (i, o) in owned.iter().enumerate() {
                    if *o {
                        dir.release(i);
                    }
                }
                return Err(ClaimError::AlreadyClaimed(s));
            }
            owned[s as usize] = true;
        }
        Ok(Authority {
            cfg,
            dir: dir.clone(),
            owned,
            slots: (0..HASH_SLOTS).map(|_| None).collect(),
            view_revision: None,
            stats: AuthorityStats::default(),
            filter_rebuilds: Arc::default(),
            fired: Vec::new(),
            next_nonce: vec![0; HASH_SLOTS].into_boxed_slice(),
            presence: PresenceLog::default(),
            waiting: (0..HASH_SLOTS).map(|_| None).collect(),
            kept: handover::Kept::default(),
            handovers: Vec::new(),
            relays: Vec::new(),
        })
    }

    /// Records every route that becomes active or ends from now on (`on`), or
    /// stops recording: each register, commit, unregister, touch and expiry pass
    /// adds its [`PresenceChange`]s for [`take_presence`](Self::take_presence).
    /// A slot dropped with its identity (a view that moved it) records nothing:
    /// its routes live on at the new authority.
    pub fn record_presence(&mut self, on: bool) {
        self.presence.on = on;
        if !on {
            self.presence.changes.clear();
        }
    }

    /// Moves the recorded changes, oldest first, to the end of `out`.
    pub fn take_presence(&mut self, out: &mut Vec<PresenceChange>) {
        out.append(&mut self.presence.changes);
    }

    /// A reader of the same directory (readers see every writer's slots).
    pub fn reader(&self) -> AuthorityReader {
        AuthorityReader::new(&self.dir)
    }

    /// The configuration.
    pub fn config(&self) -> &AuthorityConfig {
        &self.cfg
    }

    /// Installs `target` as the identity of its hash slot (see [`InstallOutcome`]).
    /// Refused with `NotLeader` for a hash slot this writer does not own, and with
    /// `StaleTarget` for an identity older than the installed one (lower config
    /// epoch, or same epoch and lower term): leadership never moves backward.
    pub fn install(
        &mut self,
        target: Target,
        revision: Revision,
        now_s: u64,
    ) -> Result<InstallOutcome, AuthorityError> {
        self.install_as(target, revision, now_s, false)
    }

    /// [`install`](Self::install); a new identity's lookups answer `Rebuilding`
    /// while `waiting` (its handover is awaited).
    fn install_as(
        &mut self,
        target: Target,
        revision: Revision,
        now_s: u64,
        waiting: bool,
    ) -> Result<InstallOutcome, AuthorityError> {
        let s = target.hash_slot as usize;
        if !self.owned.get(s).copied().unwrap_or(false) {
            return Err(AuthorityError::NotLeader);
        }
        let outcome = match &mut self.slots[s] {
            Some(w) if w.target == target => {
                if revision > w.revision {
                    w.revision = revision;
                    return Ok(InstallOutcome::RevisionAdvanced);
                }
                return Ok(InstallOutcome::Unchanged);
            }
            Some(w) => {
                let old = (w.target.config_epoch, w.target.leader_term);
                if (target.config_epoch, target.leader_term) < old {
                    return Err(AuthorityError::StaleTarget);
                }
                InstallOutcome::Replaced
            }
            None => InstallOutcome::Fresh,
        };
        if let Some(old) = &self.slots[s] {
            self.next_nonce[s] = old.next_nonce;
        }
        // Dropping the old writer first: its table bookkeeping names the old state.
        self.slots[s] = None;
        self.waiting[s] = None;
        let filter = FilterLimits {
            bits_per_route: self.cfg.presence_filter_bits_per_route,
            bits_max: self.cfg.presence_filter_bits_per_slot_max,
            stale_percent: self.cfg.presence_filter_stale_percent,
            rebuilds: self.filter_rebuilds.clone(),
        };
        let sizes = (
            self.cfg.initial_buckets_per_slot,
            table_entries_max(&self.cfg),
        );
        let table = self.dir.install(s, target, waiting, sizes, filter);
        let w = SlotWriter::new(
            target,
            revision,
            now_s,
            &self.cfg,
            self.next_nonce[s],
            table,
        );
        self.slots[s] = Some(Box::new(w));
        Ok(outcome)
    }

    /// Drops all state of `hash_slot` (rule 5); later calls get `NotLeader`.
    /// Returns whether an identity was installed.
    pub fn remove(&mut self, hash_slot: HashSlot) -> bool {
        let s = hash_slot as usize;
        if !self.owned.get(s).copied().unwrap_or(false) {
            return false;
        }
        self.waiting[s] = None;
        if let Some(old) = self.slots[s].take() {
            self.next_nonce[s] = old.next_nonce;
            self.dir.remove(s);
            true
        } else {
            false
        }
    }

    /// Applies a cluster view to this writer's hash slots: installs (or keeps) the
    /// identity of each slot `local_node_id` leads, removes the others. A view with
    /// a revision older than the last applied one is ignored (returns `false`).
    ///
    /// A slot this node loses is handed over: its active routes and tombstones
    /// wait in [`take_handovers`](Self::take_handovers) for the driver to carry
    /// them to the new leader. A slot gained from another node (the view's
    /// `from_node_id`) waits for that handover, up to `handover_wait_s`
    /// (`handover` module); one installed by the first view applied (start-up)
    /// does not; one moved to the node that led it keeps its routes.
    pub fn apply_view(&mut self, view: &ClusterView, local_node_id: NodeId, now_s: u64) -> bool {
        if self.view_revision.is_some_and(|r| view.revision < r) {
            return false;
        }
        let first = self.view_revision.is_none();
        self.view_revision = Some(view.revision);
        for s in 0..HASH_SLOTS {
            if !self.owned[s] {
                continue;
            }
            let target = view.target_for_slot(s as HashSlot);
            let from = view.slots[s].from_node_id;
            if target.leader_node_id == local_node_id {
                // Taken from another node: its routes are awaited (not at start-up,
                // where the view may be an old one saved before a crash).
                // Taken from this node without its having installed the term it
                // was taken at (it missed that move): that term's leader's routes
                // are awaited as well.
                let held = self.slots[s].is_some();
                let wait = !first && from != 0 && (from != local_node_id || !held);
                let wait = wait && self.cfg.handover_wait_s > 0;
                // A move to itself: the new identity starts with the old one's
                // routes (taken from another node, they are that node's to give),
                // and goes on waiting if the old one still did.
                let old = self.slots[s].as_ref().map(|w| w.target);
                let handovers = self.cfg.handover_wait_s > 0;
                let old = old.filter(|t| *t != target && from == local_node_id && handovers);
                let kept = old.map(|_| self.active_routes(s as HashSlot));
                let inherited = old.and_then(|o| Some((o, self.take_wait(s)?)));
                let wait = wait || inherited.is_some();
                // An older identity than installed is refused inside; keep ours.
                let installed = self.install_as(target, view.revision, now_s, wait);
                let fresh = matches!(
                    installed,
                    Ok(InstallOutcome::Fresh | InstallOutcome::Replaced)
                );
                match inherited {
                    Some((old, waiting)) if fresh => self.inherit_wait(old, waiting),
                    _ if fresh && wait => self.begin_waiting(target, from, now_s),
                    _ => {}
                }
                if let (true, Some(routes)) = (fresh, kept) {
                    self.carry_over(target, &routes, now_s);
                }
                self.drop_relay(s as HashSlot);
            } else {
                match self.slots[s].as_ref().map(|w| w.target) {
                    Some(from) => self.lose(from, target),
                    None => self.moved_on(target, now_s),
                }
                self.remove(s as HashSlot);
            }
        }
        true
    }

    /// The installed identity of `hash_slot` and its observed revision.
    pub fn identity(&self, hash_slot: HashSlot) -> Option<(Target, Revision)> {
        let w = self.slots.get(hash_slot as usize)?.as_ref()?;
        Some((w.target, w.revision))
    }

    #[inline]
    fn slot_mut(
        &mut self,
        target: &Target,
    ) -> Result<
        (
            &mut SlotWriter,
            &Directory,
            &AuthorityConfig,
            &mut PresenceLog,
        ),
        AuthorityError,
    > {
        let w = self
            .slots
            .get_mut(target.hash_slot as usize)
            .and_then(|s| s.as_deref_mut())
            .ok_or(AuthorityError::NotLeader)?;
        if w.target != *target {
            return Err(AuthorityError::StaleTarget);
        }
        Ok((w, &self.dir, &self.cfg, &mut self.presence))
    }

    /// Registers `route` (rules 6–8, 12): active at once without conflicts, else a
    /// pending candidate with the owner actions its commit waits for. A newer
    /// registration of the same identity supersedes an older candidate.
    pub fn register_route(
        &mut self,
        target: &Target,
        route: Route,
        now_s: u64,
    ) -> Result<RegisterOutcome, AuthorityError> {
        let (w, dir, cfg, log) = self.slot_mut(target)?;
        if hash_slot(route.uid.as_bytes()) != target.hash_slot {
            return Err(AuthorityError::StaleTarget);
        }
        w.register(dir, cfg, log, route, now_s)
    }

    /// Commits a candidate (rules 9, 10): removes exactly the acknowledged conflicts
    /// (tombstoned at their owner_seq) and makes the candidate active. `NotReady` if
    /// a conflict appeared since or the candidate is gone (aborted, expired,
    /// unregistered); `Superseded` if a newer registration of the identity exists.
    /// A refused commit changes nothing.
    pub fn commit_route(
        &mut self,
        target: &Target,
        token: &PendingToken,
        now_s: u64,
    ) -> Result<(), AuthorityError> {
        let (w, dir, cfg, log) = self.slot_mut(target)?;
        w.commit(dir, cfg, log, token, now_s)
    }

    /// Aborts a candidate (rule 11): the candidate is removed, existing routes stay.
    /// Idempotent: aborting a candidate that is already gone is `Ok`; a superseded
    /// token gets `Superseded` and removes nothing.
    pub fn abort_route(
        &mut self,
        target: &Target,
        token: &PendingToken,
        now_s: u64,
    ) -> Result<(), AuthorityError> {
        let (w, _, cfg, _) = self.slot_mut(target)?;
        w.abort(cfg, token, now_s)
    }

    /// Records an unregister tombstone at `owner_seq` for the exact identity (rules
    /// 18, 19) and removes its route and candidate if the tombstone is at least as
    /// new. Returns whether an active route was removed. `Full` when a new fence
    /// record would pass `fence_records_per_slot_max` (retry later).
    pub fn unregister_route(
        &mut self,
        target: &Target,
        identity: &RouteIdentity,
        owner_seq: OwnerSeq,
        now_s: u64,
    ) -> Result<bool, AuthorityError> {
        let (w, dir, cfg, log) = self.slot_mut(target)?;
        if hash_slot(identity.uid.as_bytes()) != target.hash_slot {
            return Err(AuthorityError::StaleTarget);
        }
        w.unregister(dir, cfg, log, identity, owner_seq, now_s)
    }

    /// Touches the owner's current routes (rules 14–17), appending one
    /// [`TouchResult`] per route to `out` in input order. The whole call fails on a
    /// fence error or when `routes` passes `touch_batch_routes_max`.
    pub fn touch_routes_into(
        &mut self,
        target: &Target,
        routes: &[Route],
        now_s: u64,
        out: &mut Vec<TouchResult>,
    ) -> Result<TouchCounts, AuthorityError> {
        let (w, dir, cfg, log) = self.slot_mut(target)?;
        if routes.len() > cfg.touch_batch_routes_max {
            return Err(AuthorityError::Full);
        }
        let mut counts = TouchCounts::default();
        out.reserve(routes.len());
        for r in routes {
            let res = if hash_slot(r.uid.as_bytes()) != target.hash_slot {
                TouchResult::WrongSlot
            } else {
                w.touch_one(dir, cfg, log, r, now_s)
            };
            match res {
                TouchResult::Refreshed => counts.refreshed += 1,
                TouchResult::Recreated => counts.recreated += 1,
                TouchResult::Full => counts.full += 1,
                _ => counts.ignored += 1,
            }
            out.push(res);
        }
        Ok(counts)
    }

    /// [`touch_routes_into`](Self::touch_routes_into) returning a fresh vector.
    pub fn touch_routes(
        &mut self,
        target: &Target,
        routes: &[Route],
        now_s: u64,
    ) -> Result<Vec<TouchResult>, AuthorityError> {
        let mut out = Vec::with_capacity(routes.len());
        self.touch_routes_into(target, routes, now_s, &mut out)?;
        Ok(out)
    }

    /// Expiry pass at `now_s` over this writer's slots (rules 20–23): visits only
    /// due buckets; removes routes whose activity plus TTL is before `now_s`,
    /// candidates past `pending_ttl_s` and fence records past their retention.
    /// Returns the number of routes expired. A `now_s` below an earlier pass's is
    /// treated as that earlier time.
    pub fn expire(&mut self, now_s: u64) -> usize {
        self.expire_handovers(now_s);
        let before = self.stats.routes_expired;
        // First every slot's ring and wheel give their due entries, then one
        // software pipeline handles them all: the record of entry k + 2D and the
        // published entry of entry k + D are on their way while entry k is handled.
        let fired = &mut self.fired;
        fired.clear();
        for (s, w) in self.slots.iter_mut().enumerate() {
            let Some(w) = w.as_deref_mut() else {
                continue;
            };
            let s = s as HashSlot;
            let (r0, w0) = (w.ring.stats(), w.wheel.stats());
            // Never backward (the wheel asserts it): a pass below the install time
            // or an earlier pass's counts as that time.
            let now = now_s.max(w.ring.now()).max(w.wheel.now());
            // Order matters: the slot's ring entries go into `fired` before its wheel
            // entries, so a record due in both is handled as a ring entry first (its
            // stale link taken) before its candidate's expiry sets its deadline
            // again. The other order would set it through the stale link (rule test
            // `rule_20_a_route_and_its_candidate_due_in_the_same_pass`).
            w.ring.advance(now, |i| fired.push((s, Due::Record(i))));
            w.wheel
                .advance(now, |_, _, k| fired.push((s, Due::Pending(k.rec, k.nonce))));
            let (r1, w1) = (w.ring.stats(), w.wheel.stats());
            self.stats.expiry_buckets_visited +=
                r1.buckets_visited - r0.buckets_visited + w1.buckets_visited - w0.buckets_visited;
            self.stats.expiry_entries_visited +=
                r1.entries_visited - r0.entries_visited + w1.entries_visited - w0.entries_visited;
        }
        for k in 0..self.fired.len() {
            if let Some(&(s, due)) = self.fired.get(k + 2 * EXPIRE_PREFETCH_DISTANCE) {
                if let Some(w) = self.slots[s as usize].as_deref() {
                    w.prefetch_record(due);
                }
            }
            if let Some(&(s, due)) = self.fired.get(k + EXPIRE_PREFETCH_DISTANCE) {
                if let Some(w) = self.slots[s as usize].as_deref() {
                    w.prefetch_entry(&self.dir, due);
                }
            }
            let (s, due) = self.fired[k];
            if let Some(w) = self.slots[s as usize].as_deref_mut() {
                let now = w.ring.now();
                w.fired(
                    &self.dir,
                    &self.cfg,
                    due,
                    now,
                    &mut self.stats,
                    &mut self.presence,
                );
            }
        }
        (self.stats.routes_expired - before) as usize
    }

    /// Cumulative counters.
    pub fn stats(&self) -> AuthorityStats {
        AuthorityStats {
            filter_rebuilds: self
                .filter_rebuilds
                .load(std::sync::atomic::Ordering::Relaxed),
            ..self.stats
        }
    }

    /// Summed work counters of the slots' current expiry rings and candidate wheels.
    pub fn wheel_stats(&self) -> WheelStats {
        let mut t = WheelStats::default();
        for w in self.slots.iter().flatten() {
            for s in [w.ring.stats(), w.wheel.stats()] {
                t.buckets_visited += s.buckets_visited;
                t.entries_visited += s.entries_visited;
                t.fired += s.fired;
                t.recascaded += s.recascaded;
            }
        }
        t
    }

    /// The active route of `identity` as the writer keeps it (with its activity time).
    pub fn route(&self, identity: &RouteIdentity) -> Option<Route> {
        let w = self.slots[hash_slot(identity.uid.as_bytes()) as usize].as_ref()?;
        let i = w.record_of(&identity.uid, Sess::of_identity(identity))?;
        w.recs[i].active().map(|a| a.route.clone())
    }

    /// The fence record of `identity`, if kept.
    pub fn fence(&self, identity: &RouteIdentity) -> Option<FenceRecord> {
        let w = self.slots[hash_slot(identity.uid.as_bytes()) as usize].as_ref()?;
        let r = &w.recs[w.record_of(&identity.uid, Sess::of_identity(identity))?];
        Some(FenceRecord {
            last_owner_seq: r.last_owner_seq,
            tombstone: r.tombstone,
            retain_until_s: r.retain_until_s,
        })
    }

    /// Whether `identity` has a pending candidate.
    pub fn has_pending(&self, identity: &RouteIdentity) -> bool {
        let Some(w) = self.slots[hash_slot(identity.uid.as_bytes()) as usize].as_ref() else {
            return false;
        };
        w.record_of(&identity.uid, Sess::of_identity(identity))
            .is_some_and(|i| w.recs[i].pending.is_some())
    }

    /// The active routes of `hash_slot` in activation order (oldest first).
    pub fn active_routes(&self, hash_slot: HashSlot) -> Vec<Route> {
        let Some(w) = self.slots.get(hash_slot as usize).and_then(|s| s.as_ref()) else {
            return Vec::new();
        };
        let mut v: Vec<(u64, Route)> = w
            .recs
            .iter()
            .filter_map(|(_, r)| r.active().map(|a| (a.activation, a.route.clone())))
            .collect();
        v.sort_unstable_by_key(|(a, _)| *a);
        v.into_iter().map(|(_, r)| r).collect()
    }

    /// Sizes of one slot's directory (zero when not installed).
    pub fn counts(&self, hash_slot: HashSlot) -> SlotCounts {
        match self.slots.get(hash_slot as usize).and_then(|s| s.as_ref()) {
            Some(w) => SlotCounts {
                active_routes: w.active,
                pending: w.pending,
                fence_records: w.recs.len,
            },
            None => SlotCounts::default(),
        }
    }

    /// Counts the routes a full scan would expire at `now_s`: visits every record
    /// of every slot and reads its route's activity (the cost baseline the wheel
    /// avoids; benches only).
    #[doc(hidden)]
    pub fn full_scan_due(&self, now_s: u64) -> usize {
        let ttl = self.cfg.route_ttl_s;
        self.slots
            .iter()
            .flatten()
            .flat_map(|w| w.recs.iter())
            .filter(|(_, r)| {
                r.active()
                    .and_then(|a| route_deadline(a.route.last_active_s, ttl))
                    .is_some_and(|d| d <= now_s)
            })
            .count()
    }

    /// Checks every invariant of every installed slot (O(size); for tests): counts,
    /// exactly one expiry-ring entry per timed route and per orphan fence record
    /// and one wheel entry per candidate, each with the deadline its state asks
    /// for, no route at or below its
    /// tombstone, and the published view equal to the writer's active routes.
    pub fn check_invariants(&self) -> Result<(), String> {
        for (s, w) in self.slots.iter().enumerate() {
            if let Some(w) = w {
                w.check_invariants(&self.dir, &self.cfg)
                    .map_err(|e| format!("hash slot {s}: {e}"))?;
            }
        }
        Ok(())
    }
}

/// The well-mixed 64-bit hash of a uid that the published tables and their
/// presence filters use: a subscriber list computes it once per uid
/// ([`HashedGroup`]).
#[inline]
pub fn uid_hash(uid: &str) -> u64 {
    published::uid_hash(uid)
}
