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

mod expiry;
mod handover;
mod huge;
mod presence;
mod published;
mod seqline;
mod service;

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

pub use handover::{Handover, HandoverBatch, HandoverOutcome};
pub use published::{Directory, FilterCounts, FxBuildHasher, FxHasher};
use published::{FilterLimits, SlotView, TableWriter, NIL};
pub use service::{AuthorityReply, TouchAnswer};

use crate::cluster::{ClusterView, HashSlot, NodeId, Revision, Target};
use crate::presence::route::{
    AuthorityError, BootId, CompactEndpoint, DeviceLevel, Endpoint, OwnerAction, OwnerActionKind,
    OwnerSeq, PendingToken, RegisterOutcome, Route, RouteIdentity, SessionId, Uid,
};

/// The limits and timeouts of the authority. Units are in the names.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthorityConfig {
    /// A route expires when its last activity second plus this is before `now_s`.
    pub route_ttl_s: u64,
    /// A pending candidate not committed or aborted within this is dropped.
    pub pending_ttl_s: u64,
    /// How long an identity's fence record (last owner_seq, tombstone) is kept once
    /// it has neither route nor candidate. At least 1.
    pub fence_retention_s: u64,
    /// Active routes per hash slot.
    pub routes_per_slot_max: usize,
    /// Pending candidates per hash slot.
    pub pending_per_slot_max: usize,
    /// Identity records (with or without route) per hash slot.
    pub fence_records_per_slot_max: usize,
    /// Identity records per uid (bounds the per-uid conflict scans).
    pub records_per_uid_max: usize,
    /// Uids per `endpoints_by_targets` call; groups past the limit fail with `Full`.
    pub lookup_uids_max: usize,
    /// Routes per `touch_routes` call.
    pub touch_batch_routes_max: usize,
    /// Initial entry count of a slot's published table (one cache line per uid with
    /// routes; a new table is built as uids come, up to twice `routes_per_slot_max`
    /// entries).
    pub initial_buckets_per_slot: usize,
    /// Bits per route of each slot's presence filter (a lookup skips a uid the
    /// filter says is absent, without probing the table): sized for the slot's
    /// routes at this many bits (up to twice as many), 4 bits set per uid in one
    /// 64-bit word. 16: about 0.5% false positives at worst.
    pub presence_filter_bits_per_route: usize,
    /// Bits of one slot's presence filter at most (past its routes × bits per
    /// route, false positives rise; the lookup stays exact).
    pub presence_filter_bits_per_slot_max: usize,
    /// Uids that lost their last endpoint since a slot's filter was built (their
    /// bits stay set), in percent of the routes it was sized for, that make its
    /// writer rebuild it from the table.
    pub presence_filter_stale_percent: usize,
    /// How long a hash slot gained from another node waits for that node's
    /// handover of its routes, its lookups answering `Rebuilding` meanwhile
    /// (`handover` module). 0: no wait (lookups answer from the table at once,
    /// "offline" until the gateways' rebuild reaches it), and a move of a slot to
    /// the node that leads it starts it empty: the node before handovers.
    pub handover_wait_s: u64,
    /// Routes and tombstones of handover batches kept for identities not
    /// installed yet.
    pub handover_stash_routes_max: usize,
}

impl Default for AuthorityConfig {
    fn default() -> Self {
        AuthorityConfig {
            route_ttl_s: 120,
            pending_ttl_s: 30,
            fence_retention_s: 600,
            routes_per_slot_max: 1 << 16,
            pending_per_slot_max: 1 << 12,
            fence_records_per_slot_max: 1 << 18,
            records_per_uid_max: 64,
            lookup_uids_max: 1 << 16,
            touch_batch_routes_max: 4096,
            initial_buckets_per_slot: 64,
            presence_filter_bits_per_route: 16,
            presence_filter_bits_per_slot_max: 1 << 21,
            presence_filter_stale_percent: 50,
            handover_wait_s: 2,
            handover_stash_routes_max: 1 << 16,
        }
    }
}

/// An [`AuthorityConfig`] that cannot work.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ConfigError {
    /// A limit or timeout that must be at least 1 is 0 (the field's name).
    Zero(&'static str),
    /// `fence_records_per_slot_max` is below `routes_per_slot_max + pending_per_slot_max`.
    FenceRecordsBelowRoutes,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConfigError::Zero(name) => write!(f, "authority config: {name} must be at least 1"),
            ConfigError::FenceRecordsBelowRoutes => f.write_str(
                "authority config: fence_records_per_slot_max must be at least routes_per_slot_max + pending_per_slot_max",
            ),
        }
    }
}

impl std::error::Error for ConfigError {}

impl AuthorityConfig {
    /// Checks that the limits can work together.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (name, v) in [
            ("route_ttl_s", self.route_ttl_s as usize),
            ("pending_ttl_s", self.pending_ttl_s as usize),
            ("fence_retention_s", self.fence_retention_s as usize),
            ("routes_per_slot_max", self.routes_per_slot_max),
            ("pending_per_slot_max", self.pending_per_slot_max),
            ("records_per_uid_max", self.records_per_uid_max),
            ("lookup_uids_max", self.lookup_uids_max),
            ("touch_batch_routes_max", self.touch_batch_routes_max),
            ("initial_buckets_per_slot", self.initial_buckets_per_slot),
            (
                "presence_filter_bits_per_route",
                self.presence_filter_bits_per_route,
            ),
            (
                "presence_filter_bits_per_slot_max",
                self.presence_filter_bits_per_slot_max,
            ),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero(name));
            }
        }
        if self.fence_records_per_slot_max
            < self
                .routes_per_slot_max
                .saturating_add(self.pending_per_slot_max)
        {
            return Err(ConfigError::FenceRecordsBelowRoutes);
        }
        Ok(())
    }
}

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

/// A candidate's wheel entry: its record and nonce.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct PendingKey {
    rec: u32,
    nonce: u64,
}

/// The writer state of one installed hash slot.
struct SlotWriter {
    target: Target,
    revision: Revision,
    /// The user of each uid.
    by_uid: HashMap<Uid, u32, FxBuildHasher>,
    users: Slab<User>,
    /// Every record (at most `fence_records_per_slot_max`).
    recs: Slab<Record>,
    table: TableWriter,
    /// The records' deadlines (see [`Record::link`]), by record index.
    ring: ExpiryRing,
    /// The candidates' deadlines.
    wheel: TimerWheel<PendingKey>,
    active: usize,
    pending: usize,
    next_nonce: u64,
    next_activation: u64,
    /// The endpoints of the uid being published (at most `records_per_uid_max`).
    scratch: Vec<CompactEndpoint>,
}

/// Entries of a slot's published table at most: room for every uid with a route
/// (at most `routes_per_slot_max`) at a load of at most one half after a rebuild.
fn table_entries_max(cfg: &AuthorityConfig) -> usize {
    cfg.routes_per_slot_max
        .saturating_add(1)
        .saturating_mul(2)
        .next_power_of_two()
}

/// How many due entries ahead an expiry pass prefetches published entries
/// (records: twice as far).
const EXPIRE_PREFETCH_DISTANCE: usize = 8;

#[inline]
fn route_deadline(last_active_s: Option<u64>, ttl_s: u64) -> Option<u64> {
    last_active_s.map(|a| a.saturating_add(ttl_s).saturating_add(1))
}

#[inline]
fn compact_of(r: &Route) -> CompactEndpoint {
    CompactEndpoint {
        uid_index: 0,
        device_flag: r.device_flag,
        device_level: r.device_level,
        node_id: r.node_id,
        boot_id: r.boot_id,
        session_id: r.session_id,
        owner_seq: r.owner_seq,
    }
}

/// The deadline record `rec`'s state asks for in the expiry ring: its active
/// route's expiry, none while it has a candidate, else its retention deadline.
#[inline]
fn wanted_deadline(rec: &Record, cfg: &AuthorityConfig) -> Option<u64> {
    if let Some(a) = rec.active() {
        route_deadline(a.route.last_active_s, cfg.route_ttl_s)
    } else if rec.pending.is_some() {
        None
    } else {
        rec.retain_until_s
    }
}

/// Brings `rec.retain_until_s` in line with its state: none while it has a route
/// or candidate; else kept, or started at `now_s` when none ran or
/// `reset_retention`.
#[inline]
fn settle_retention(rec: &mut Record, now_s: u64, cfg: &AuthorityConfig, reset_retention: bool) {
    rec.retain_until_s = if rec.is_active || rec.pending.is_some() {
        None
    } else {
        match rec.retain_until_s {
            Some(d) if !reset_retention => Some(d),
            _ => Some(now_s.saturating_add(cfg.fence_retention_s)),
        }
    };
}

impl SlotWriter {
    fn new(
        target: Target,
        revision: Revision,
        now_s: u64,
        cfg: &AuthorityConfig,
        next_nonce: u64,
        table: TableWriter,
    ) -> SlotWriter {
        SlotWriter {
            target,
            revision,
            by_uid: HashMap::default(),
            users: Slab::new(),
            recs: Slab::new(),
            table,
            ring: ExpiryRing::new(
                now_s,
                cfg.route_ttl_s.max(cfg.fence_retention_s).saturating_add(1),
                cfg.fence_records_per_slot_max,
            ),
            wheel: TimerWheel::new(now_s, cfg.pending_per_slot_max.saturating_add(1)),
            active: 0,
            pending: 0,
            next_nonce,
            next_activation: 0,
            scratch: Vec::new(),
        }
    }

    /// Gives record `i` the retention and the ring deadline its state asks for
    /// (see [`settle_retention`], [`wanted_deadline`]).
    #[inline]
    fn settle(&mut self, i: u32, now_s: u64, cfg: &AuthorityConfig, reset_retention: bool) {
        let rec = &mut self.recs[i];
        settle_retention(rec, now_s, cfg, reset_retention);
        let moved = match wanted_deadline(rec, cfg) {
            None => self.ring.cancel(i, &mut rec.link),
            Some(d) => self.ring.set(i, &mut rec.link, d),
        };
        if let Some(m) = moved {
            m.apply(&mut self.recs[m.rec].link);
        }
    }

    #[inline]
    fn records_of(&self, user: u32) -> UserRecords<'_> {
        records_from(&self.recs, self.users[user].first)
    }

    /// The record of `sess` under `user`.
    #[inline]
    fn find_record(&self, user: u32, sess: Sess) -> Option<u32> {
        self.records_of(user)
            .find(|(_, r)| r.sess == sess)
            .map(|(i, _)| i)
    }

    /// The record of `sess` under `uid`.
    #[inline]
    fn record_of(&self, uid: &Uid, sess: Sess) -> Option<u32> {
        let u = *self.by_uid.get(uid)?;
        self.find_record(u, sess)
    }

    /// Records (when on) that record `i`'s route became active or ended, with its
    /// uid's counts now.
    fn note_presence(&self, log: &mut PresenceLog, i: u32, online: bool) {
        if !log.on {
            return;
        }
        let rec = &self.recs[i];
        let Some(route) = rec.route.as_ref().map(|a| &a.route) else {
            return;
        };
        let (mut device_online, mut total_online) = (0, 0);
        for (_, r) in self.records_of(rec.user) {
            if let Some(a) = r.active() {
                total_online += 1;
                device_online += u32::from(a.route.device_flag == route.device_flag);
            }
        }
        log.changes.push(PresenceChange {
            uid: route.uid.clone(),
            device_flag: route.device_flag,
            online,
            session_id: route.session_id,
            device_online,
            total_online,
        });
    }

    /// Publishes the active endpoints of `user`, ordered by (node_id, boot_id,
    /// session_id) (rule 25).
    fn publish(&mut self, dir: &Directory, user: u32) {
        let mut eps = std::mem::take(&mut self.scratch);
        eps.clear();
        eps.extend(
            self.records_of(user)
                .filter_map(|(_, r)| r.active().map(|a| compact_of(&a.route))),
        );
        if eps.len() > 1 {
            eps.sort_unstable_by_key(|e| (e.node_id, e.boot_id, e.session_id));
        }
        self.table.publish(dir, user, &self.users[user].uid, &eps);
        self.scratch = eps;
    }

    /// Index of the record of `sess` under `uid`, creating it within the limits.
    fn record_index_or_create(
        &mut self,
        uid: &Uid,
        sess: Sess,
        cfg: &AuthorityConfig,
    ) -> Result<u32, AuthorityError> {
        let user = self.by_uid.get(uid).copied();
        if let Some(u) = user {
            if let Some(i) = self.find_record(u, sess) {
                return Ok(i);
            }
            if self.users[u].records as usize >= cfg.records_per_uid_max {
                return Err(AuthorityError::Full);
            }
        }
        if self.recs.len >= cfg.fence_records_per_slot_max {
            return Err(AuthorityError::Full);
        }
        let u = match user {
            Some(u) => u,
            None => {
                let u = self.users.insert(User {
                    uid: uid.clone(),
                    first: NIL,
                    records: 0,
                });
                self.by_uid.insert(uid.clone(), u);
                u
            }
        };
        let i = self.recs.insert(Record::new(u, self.users[u].first, sess));
        let usr = &mut self.users[u];
        usr.first = i;
        usr.records += 1;
        Ok(i)
    }

    /// Room for a new record of `sess` under `uid` (without creating it).
    fn can_create(&self, uid: &Uid, sess: Sess, cfg: &AuthorityConfig) -> bool {
        match self.by_uid.get(uid) {
            Some(&u) if self.find_record(u, sess).is_some() => true,
            Some(&u) if self.users[u].records as usize >= cfg.records_per_uid_max => false,
            _ => self.recs.len < cfg.fence_records_per_slot_max,
        }
    }

    /// Drops record `i` (neither route nor candidate), and its user with its last
    /// record.
    fn drop_record(&mut self, dir: &Directory, i: u32) {
        let Some(rec) = self.recs.remove(i) else {
            debug_assert!(false, "drop of a vacant record");
            return;
        };
        debug_assert!(!rec.is_active && rec.pending.is_none());
        let mut link = rec.link;
        if let Some(m) = self.ring.cancel(i, &mut link) {
            m.apply(&mut self.recs[m.rec].link);
        }
        let u = rec.user;
        if self.users[u].first == i {
            self.users[u].first = rec.next;
        } else {
            let mut j = self.users[u].first;
            while j != NIL {
                let next = self.recs[j].next;
                if next == i {
                    self.recs[j].next = rec.next;
                    break;
                }
                j = next;
            }
        }
        self.users[u].records -= 1;
        if self.users[u].records == 0 {
            if let Some(user) = self.users.remove(u) {
                self.by_uid.remove(&user.uid);
            }
            self.table.release(dir, u);
        }
    }

    /// Registers `route` (rules 6-8): active at once when no live route of its uid
    /// conflicts, else a candidate pending until the conflicting owners close. Refuses
    /// a route at or below its record's tombstone (`Tombstoned`) and one beyond the
    /// slot's record, route or candidate limits (`Full`).
    fn register(
        &mut self,
        dir: &Directory,
        cfg: &AuthorityConfig,
        log: &mut PresenceLog,
        mut route: Route,
        now_s: u64,
    ) -> Result<RegisterOutcome, AuthorityError> {
        route.last_active_s = route.last_active_s.map(|t| t.min(now_s));
        let sess = Sess::of_route(&route);
        let found = self.find_for_register(&route, sess);
        if found.tombstoned {
            return Err(AuthorityError::Tombstoned);
        }
        if !self.can_create(&route.uid, sess, cfg) {
            return Err(AuthorityError::Full);
        }
        if found.conflicts.is_empty() {
            self.register_active(dir, cfg, log, route, sess, found.had_active, now_s)
        } else {
            self.register_pending(cfg, route, sess, found, now_s)
        }
    }

    /// What `register` needs to know of `route`'s uid: the active routes of its other
    /// sessions that `route` conflicts with (and whether each is kicked), and the state
    /// of `route`'s own record. Refuses nothing.
    #[inline]
    fn find_for_register(&self, route: &Route, sess: Sess) -> RegisterFound {
        let mut conflicts: Vec<(Sess, OwnerSeq, bool)> = Vec::new();
        let mut own: Option<&Record> = None;
        if let Some(&u) = self.by_uid.get(&route.uid) {
            for (_, r) in self.records_of(u) {
                if r.sess == sess {
                    own = Some(r);
                } else if let Some(a) = r.active() {
                    if route.conflicts_with(&a.route) {
                        let kick = route.device_level == DeviceLevel::Master
                            && a.route.device_id != route.device_id;
                        conflicts.push((r.sess, a.route.owner_seq, kick));
                    }
                }
            }
        }
        RegisterFound {
            conflicts,
            tombstoned: own.is_some_and(|r| r.tombstoned(route.owner_seq)),
            had_active: own.is_some_and(|r| r.is_active),
            had_pending: own.is_some_and(|r| r.pending.is_some()),
        }
    }

    /// Makes `route` its record's active route at once (rule 6; no conflict): replaces
    /// a candidate of the record, settles its deadline and publishes the uid. Refuses
    /// (`Full`) a new active route beyond `routes_per_slot_max`.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn register_active(
        &mut self,
        dir: &Directory,
        cfg: &AuthorityConfig,
        log: &mut PresenceLog,
        route: Route,
        sess: Sess,
        had_active: bool,
        now_s: u64,
    ) -> Result<RegisterOutcome, AuthorityError> {
        if !had_active && self.active >= cfg.routes_per_slot_max {
            return Err(AuthorityError::Full);
        }
        let uid = route.uid.clone();
        let i = self.record_index_or_create(&uid, sess, cfg)?;
        self.next_nonce += 1;
        self.next_activation += 1;
        let (nonce, activation) = (self.next_nonce, self.next_activation);
        let rec = &mut self.recs[i];
        rec.last_owner_seq = rec.last_owner_seq.max(route.owner_seq);
        rec.last_nonce = nonce;
        if let Some(p) = rec.pending.take() {
            self.wheel.cancel(p.timer);
            self.pending -= 1;
        }
        rec.activate(Active { route, activation });
        if !had_active {
            self.active += 1;
        }
        self.settle(i, now_s, cfg, false);
        let u = self.recs[i].user;
        self.publish(dir, u);
        if !had_active {
            self.note_presence(log, i, true);
        }
        Ok(RegisterOutcome::Active)
    }

    /// Makes `route` its record's candidate (rules 7, 8): pending until the owners of
    /// `found.conflicts` close them (the returned actions) and commit, or until
    /// `pending_ttl_s` passes. Refuses (`Full`) a new candidate beyond
    /// `pending_per_slot_max` or a full timer wheel.
    #[inline]
    fn register_pending(
        &mut self,
        cfg: &AuthorityConfig,
        route: Route,
        sess: Sess,
        found: RegisterFound,
        now_s: u64,
    ) -> Result<RegisterOutcome, AuthorityError> {
        let conflicts = found.conflicts;
        if !found.had_pending && self.pending >= cfg.pending_per_slot_max {
            return Err(AuthorityError::Full);
        }
        let uid = route.uid.clone();
        let i = self.record_index_or_create(&uid, sess, cfg)?;
        self.next_nonce += 1;
        let nonce = self.next_nonce;
        // The wheel holds `pending_per_slot_max + 1` timers: every candidate (at
        // most that limit, checked above) and the one this registration replaces,
        // cancelled below once its successor is in.
        let Ok(timer) = self.wheel.insert(
            now_s.saturating_add(cfg.pending_ttl_s).saturating_add(1),
            PendingKey { rec: i, nonce },
        ) else {
            unreachable!("the pending wheel is sized for every candidate and one more");
        };
        let rec = &mut self.recs[i];
        rec.last_owner_seq = rec.last_owner_seq.max(route.owner_seq);
        rec.last_nonce = nonce;
        if let Some(p) = rec.pending.take() {
            self.wheel.cancel(p.timer);
        } else {
            self.pending += 1;
        }
        let token = PendingToken {
            identity: route.identity(),
            owner_seq: route.owner_seq,
            nonce,
        };
        let actions = conflicts
            .iter()
            .map(|&(s, seq, kick)| OwnerAction {
                kind: if kick {
                    OwnerActionKind::KickThenClose
                } else {
                    OwnerActionKind::Close
                },
                route: s.identity(&uid),
                owner_seq: seq,
            })
            .collect();
        rec.pending = Some(Box::new(Pending {
            route,
            nonce,
            acks: conflicts.iter().map(|&(s, seq, _)| (s, seq)).collect(),
            timer,
        }));
        self.settle(i, now_s, cfg, false);
        Ok(RegisterOutcome::Pending { token, actions })
    }

    fn commit(
        &mut self,
        dir: &Directory,
        cfg: &AuthorityConfig,
        log: &mut PresenceLog,
        token: &PendingToken,
        now_s: u64,
    ) -> Result<(), AuthorityError> {
        let sess = Sess::of_identity(&token.identity);
        let Some(&u) = self.by_uid.get(&token.identity.uid) else {
            return Err(AuthorityError::NotReady);
        };
        let Some(i) = self.find_record(u, sess) else {
            return Err(AuthorityError::NotReady);
        };
        if token.nonce < self.recs[i].last_nonce {
            return Err(AuthorityError::Superseded);
        }
        let Some(p) = self.recs[i]
            .pending
            .as_ref()
            .filter(|p| p.nonce == token.nonce && p.route.owner_seq == token.owner_seq)
        else {
            return Err(AuthorityError::NotReady);
        };
        let remove = self.replaced_by(u, i, p)?;
        let had_active = self.recs[i].is_active;
        if self.active - remove.len() + usize::from(!had_active) > cfg.routes_per_slot_max {
            return Err(AuthorityError::Full);
        }
        let ended = self.end_replaced(&remove, cfg, now_s);
        self.next_activation += 1;
        let rec = &mut self.recs[i];
        let Some(p) = rec.pending.take() else {
            return Err(AuthorityError::NotReady);
        };
        self.wheel.cancel(p.timer);
        self.pending -= 1;
        rec.activate(Active {
            route: p.route,
            activation: self.next_activation,
        });
        if !had_active {
            self.active += 1;
        }
        self.settle(i, now_s, cfg, false);
        self.publish(dir, u);
        for j in ended {
            self.note_presence(log, j, false);
        }
        if !had_active {
            self.note_presence(log, i, true);
        }
        Ok(())
    }

    /// The active routes of user `u` that the candidate `p` of record `i` replaces
    /// (those it conflicts with); `NotReady` while one of them has not been
    /// acknowledged by its owner.
    fn replaced_by(&self, u: u32, i: u32, p: &Pending) -> Result<Vec<u32>, AuthorityError> {
        let mut remove: Vec<u32> = Vec::new();
        for (j, r) in self.records_of(u) {
            if j == i {
                continue;
            }
            if let Some(a) = r.active() {
                if p.route.conflicts_with(&a.route) {
                    if !p.acks.contains(&(r.sess, a.route.owner_seq)) {
                        return Err(AuthorityError::NotReady);
                    }
                    remove.push(j);
                }
            }
        }
        Ok(remove)
    }

    /// Ends the routes a commit replaces, each tombstoned at its owner_seq (a
    /// candidate of the same identity at or below it goes too); returns the
    /// records whose route was active.
    fn end_replaced(&mut self, remove: &[u32], cfg: &AuthorityConfig, now_s: u64) -> Vec<u32> {
        let mut ended = Vec::new();
        for &j in remove {
            let r = &mut self.recs[j];
            if let Some(seq) = r.deactivate() {
                r.tombstone = Some(r.tombstone.map_or(seq, |t| t.max(seq)));
                self.active -= 1;
                ended.push(j);
            }
            // Like an unregister: a candidate of the removed identity at or below
            // the new tombstone goes too.
            if r.pending
                .as_ref()
                .is_some_and(|p| r.tombstoned(p.route.owner_seq))
            {
                if let Some(p) = r.pending.take() {
                    self.wheel.cancel(p.timer);
                    self.pending -= 1;
                }
            }
            self.settle(j, now_s, cfg, false);
        }
        ended
    }

    fn abort(
        &mut self,
        cfg: &AuthorityConfig,
        token: &PendingToken,
        now_s: u64,
    ) -> Result<(), AuthorityError> {
        let sess = Sess::of_identity(&token.identity);
        let Some(i) = self.record_of(&token.identity.uid, sess) else {
            return Ok(());
        };
        let rec = &mut self.recs[i];
        if token.nonce < rec.last_nonce {
            return Err(AuthorityError::Superseded);
        }
        if rec
            .pending
            .as_ref()
            .is_some_and(|p| p.nonce == token.nonce && p.route.owner_seq == token.owner_seq)
        {
            if let Some(p) = rec.pending.take() {
                self.wheel.cancel(p.timer);
                self.pending -= 1;
            }
            self.settle(i, now_s, cfg, false);
        }
        Ok(())
    }

    fn unregister(
        &mut self,
        dir: &Directory,
        cfg: &AuthorityConfig,
        log: &mut PresenceLog,
        identity: &RouteIdentity,
        owner_seq: OwnerSeq,
        now_s: u64,
    ) -> Result<bool, AuthorityError> {
        let i = self.record_index_or_create(&identity.uid, Sess::of_identity(identity), cfg)?;
        let rec = &mut self.recs[i];
        let tomb = rec.tombstone.map_or(owner_seq, |t| t.max(owner_seq));
        rec.tombstone = Some(tomb);
        rec.last_owner_seq = rec.last_owner_seq.max(owner_seq);
        let mut removed = false;
        if rec.active().is_some_and(|a| a.route.owner_seq <= tomb) {
            rec.deactivate();
            self.active -= 1;
            removed = true;
        }
        if rec
            .pending
            .as_ref()
            .is_some_and(|p| p.route.owner_seq <= tomb)
        {
            if let Some(p) = rec.pending.take() {
                self.wheel.cancel(p.timer);
                self.pending -= 1;
            }
        }
        self.settle(i, now_s, cfg, true);
        if removed {
            let u = self.recs[i].user;
            self.publish(dir, u);
            self.note_presence(log, i, false);
        }
        Ok(removed)
    }

    /// A touch of record `j` of user `u`: refused when stale or tombstoned; an
    /// active route's activity and owner_seq move forward (republished when the
    /// owner_seq did). `None` when the record holds no active route (the touch
    /// may recreate it).
    #[inline]
    fn refresh(
        &mut self,
        dir: &Directory,
        cfg: &AuthorityConfig,
        (u, j): (u32, u32),
        r: &Route,
        activity: u64,
    ) -> Option<TouchResult> {
        let rec = &mut self.recs[j];
        if r.owner_seq < rec.last_owner_seq {
            return Some(TouchResult::IgnoredStaleSeq);
        }
        if rec.tombstoned(r.owner_seq) {
            return Some(TouchResult::IgnoredTombstoned);
        }
        let a = rec.active_mut()?;
        let mut deadline = None;
        if let Some(old) = a.route.last_active_s {
            if activity > old {
                a.route.last_active_s = Some(activity);
                deadline = route_deadline(Some(activity), cfg.route_ttl_s);
            }
        }
        let republish = r.owner_seq > a.route.owner_seq;
        if republish {
            a.route.owner_seq = r.owner_seq;
        }
        rec.last_owner_seq = r.owner_seq;
        if let Some(d) = deadline {
            debug_assert!(
                rec.link.is_linked(),
                "active timed route without a deadline"
            );
            if let Some(m) = self.ring.set(j, &mut rec.link, d) {
                m.apply(&mut self.recs[m.rec].link);
            }
        }
        if republish {
            self.publish(dir, u);
        }
        Some(TouchResult::Refreshed)
    }

    /// One touched route. Hot path: no allocation unless the route is recreated.
    #[inline]
    fn touch_one(
        &mut self,
        dir: &Directory,
        cfg: &AuthorityConfig,
        log: &mut PresenceLog,
        r: &Route,
        now_s: u64,
    ) -> TouchResult {
        let activity = r.last_active_s.unwrap_or(now_s).min(now_s);
        let sess = Sess::of_route(r);
        let mut missing_conflicts = false;
        if let Some(&u) = self.by_uid.get(&r.uid) {
            let mut found = None;
            for (j, rec) in self.records_of(u) {
                if rec.sess == sess {
                    found = Some(j);
                } else if let Some(a) = rec.active() {
                    if r.conflicts_with(&a.route) {
                        missing_conflicts = true;
                    }
                }
            }
            if let Some(result) = found.and_then(|j| self.refresh(dir, cfg, (u, j), r, activity)) {
                return result;
            }
        }
        // Missing: recreate if it conflicts with nothing (rule 15).
        if missing_conflicts {
            return TouchResult::IgnoredConflict;
        }
        if self.active >= cfg.routes_per_slot_max || !self.can_create(&r.uid, sess, cfg) {
            return TouchResult::Full;
        }
        let Ok(i) = self.record_index_or_create(&r.uid, sess, cfg) else {
            return TouchResult::Full;
        };
        self.next_activation += 1;
        let activation = self.next_activation;
        let rec = &mut self.recs[i];
        rec.last_owner_seq = rec.last_owner_seq.max(r.owner_seq);
        let mut route = r.clone();
        route.last_active_s = Some(activity);
        rec.activate(Active { route, activation });
        self.active += 1;
        self.settle(i, now_s, cfg, false);
        let u = self.recs[i].user;
        self.publish(dir, u);
        self.note_presence(log, i, true);
        TouchResult::Recreated
    }

    /// Hints the CPU to load what handling `due` will touch next: its record.
    #[inline(always)]
    fn prefetch_record(&self, due: Due) {
        self.recs.prefetch(due.rec());
    }

    /// Hints the CPU to load what handling `due` touches after its record (loaded
    /// by now): its published entry.
    #[inline(always)]
    fn prefetch_entry(&self, dir: &Directory, due: Due) {
        if let Some(r) = self.recs.get(due.rec()) {
            self.table.prefetch(dir, r.user);
        }
    }

    /// Handles one due entry of an expiry pass at `now_s` (see `Authority::expire`);
    /// the ring or the wheel already removed it.
    fn fired(
        &mut self,
        dir: &Directory,
        cfg: &AuthorityConfig,
        due: Due,
        now_s: u64,
        stats: &mut AuthorityStats,
        log: &mut PresenceLog,
    ) {
        let i = due.rec();
        let Some(rec) = self.recs.get_mut(i) else {
            debug_assert!(false, "due entry of a dropped record");
            return;
        };
        match due {
            Due::Pending(_, nonce) => {
                if rec.pending.as_ref().is_some_and(|p| p.nonce == nonce) {
                    rec.pending = None;
                    self.pending -= 1;
                    stats.pending_expired += 1;
                    self.settle(i, now_s, cfg, false);
                } else {
                    debug_assert!(false, "due entry of a replaced candidate");
                }
            }
            Due::Record(_) => {
                // The ring took the entry out; its link is stale.
                let far = rec.link.take().is_far();
                if far && wanted_deadline(rec, cfg).is_some_and(|d| d > now_s) {
                    // Set beyond the ring's window: not due yet.
                    self.ring.note_far_again();
                    self.settle(i, now_s, cfg, false);
                    return;
                }
                // An active record's deadline is its route's expiry (the ring keeps
                // the deadline its state asks for; `check_invariants`): the route is
                // due. Decided from the first line alone.
                if rec.is_active {
                    debug_assert!(
                        wanted_deadline(rec, cfg).is_some_and(|d| d <= now_s),
                        "an active record's deadline came before its route's"
                    );
                    rec.deactivate();
                    self.active -= 1;
                    stats.routes_expired += 1;
                    let u = rec.user;
                    // Orphaned (or waiting for its candidate): the retention deadline
                    // or none, a push into the ring.
                    self.settle(i, now_s, cfg, false);
                    // The identity (the record's second line) is read only when the
                    // uid has other endpoints.
                    let recs = &self.recs;
                    self.table.unpublish_one(dir, u, |e| {
                        let sess = &recs[i].sess;
                        (e.node_id, e.boot_id, e.session_id)
                            == (sess.node_id, sess.boot_id, sess.session_id)
                    });
                    self.note_presence(log, i, false);
                } else if rec.pending.is_none() && rec.retain_until_s.is_some_and(|d| d <= now_s) {
                    stats.fence_records_dropped += 1;
                    self.drop_record(dir, i);
                } else {
                    debug_assert!(false, "a record's deadline that its state did not ask for");
                    self.settle(i, now_s, cfg, false);
                }
            }
        }
    }

    /// Checks every invariant of this slot (tests and the simulation call it): the
    /// wheel and the ring, each user and record, the counts, and that the published
    /// view equals the active routes. Gives the first broken one, described.
    fn check_invariants(&self, dir: &Directory, cfg: &AuthorityConfig) -> Result<(), String> {
        self.wheel.check_invariants()?;
        self.ring.check_invariants()?;
        if self.by_uid.len() != self.users.len {
            return Err(format!(
                "{} uids mapped, {} users",
                self.by_uid.len(),
                self.users.len
            ));
        }
        let mut tally = Tally::default();
        for (u, user) in self.users.iter() {
            self.check_user(u, user, cfg, &mut tally)?;
        }
        self.check_counts(&tally)?;
        self.check_published(dir, tally.active)
    }

    /// Checks user `u`: its uid maps to it and hashes to this slot, and its record list
    /// is as long as counted, each record checked and tallied; an active user is
    /// published. Gives the first broken invariant.
    fn check_user(
        &self,
        u: u32,
        user: &User,
        cfg: &AuthorityConfig,
        tally: &mut Tally,
    ) -> Result<(), String> {
        let uid = &user.uid;
        if self.by_uid.get(uid) != Some(&u) {
            return Err(format!("uid {uid}: mapped to another user"));
        }
        if user.records == 0 {
            return Err(format!("uid {uid}: no record"));
        }
        if hash_slot(uid.as_bytes()) != self.target.hash_slot {
            return Err(format!("uid {uid} in the wrong slot"));
        }
        let mut listed = 0u32;
        let mut has_active = false;
        for (i, r) in self.records_of(u) {
            listed += 1;
            if listed > user.records {
                return Err(format!("uid {uid}: record list longer than counted"));
            }
            if r.user != u {
                return Err(format!("uid {uid}: record of another user listed"));
            }
            has_active |= r.active().is_some();
            self.check_record(i, r, uid, cfg, tally)?;
        }
        if listed != user.records {
            return Err(format!("uid {uid}: record list shorter than counted"));
        }
        if has_active && !self.table.has_entry(u) {
            return Err(format!("uid {uid}: active but not published"));
        }
        Ok(())
    }

    /// Checks record `i` of `uid` and adds it to `tally`: its tombstone, its active
    /// route's identity and owner_seq, its candidate's wheel entry, its retention, and
    /// the ring's deadline for its state. Gives the first broken invariant.
    fn check_record(
        &self,
        i: u32,
        r: &Record,
        uid: &Uid,
        cfg: &AuthorityConfig,
        tally: &mut Tally,
    ) -> Result<(), String> {
        tally.records += 1;
        if let Some(t) = r.tombstone {
            if t > r.last_owner_seq {
                return Err(format!("{uid}: tombstone above last owner_seq"));
            }
        }
        let desired = if let Some(a) = r.active() {
            tally.active += 1;
            if a.route.uid != *uid || Sess::of_route(&a.route) != r.sess {
                return Err(format!("{uid}: route of another identity"));
            }
            if r.tombstoned(a.route.owner_seq) {
                return Err(format!("{uid}: active route at or below its tombstone"));
            }
            if a.route.owner_seq > r.last_owner_seq {
                return Err(format!("{uid}: route owner_seq above last owner_seq"));
            }
            route_deadline(a.route.last_active_s, cfg.route_ttl_s)
        } else if r.pending.is_some() {
            None
        } else {
            if r.retain_until_s.is_none() {
                return Err(format!("{uid}: orphan record without retention"));
            }
            r.retain_until_s
        };
        if let Some(p) = &r.pending {
            tally.pending += 1;
            tally.timers += 1;
            match self.wheel.get(p.timer) {
                Some(k)
                    if *k
                        == (PendingKey {
                            rec: i,
                            nonce: p.nonce,
                        }) => {}
                _ => return Err(format!("{uid}: candidate without its wheel entry")),
            }
        }
        if (r.is_active || r.pending.is_some()) && r.retain_until_s.is_some() {
            return Err(format!("{uid}: retention running while in use"));
        }
        if let Err(e) = self.ring.check_link(i, &r.link, desired) {
            return Err(format!("{uid}: {e}"));
        }
        tally.deadlines += usize::from(desired.is_some());
        Ok(())
    }

    /// Checks the slot's kept counts (records, active routes, candidates, wheel and
    /// ring entries) against `tally`. Gives the first that differs.
    fn check_counts(&self, tally: &Tally) -> Result<(), String> {
        let Tally {
            active,
            pending,
            records,
            timers,
            deadlines,
        } = *tally;
        if records != self.recs.len {
            return Err(format!("{records} records listed, {} kept", self.recs.len));
        }
        if (active, pending) != (self.active, self.pending) {
            return Err(format!(
                "counts: counted {active}/{pending}, kept {}/{}",
                self.active, self.pending
            ));
        }
        if timers != self.wheel.len() {
            return Err(format!(
                "wheel holds {} entries, candidates need {timers}",
                self.wheel.len()
            ));
        }
        if deadlines != self.ring.len() {
            return Err(format!(
                "ring holds {} entries, records need {deadlines}",
                self.ring.len()
            ));
        }
        Ok(())
    }

    /// Checks that the published view of this slot is installed with its target and
    /// lists exactly each user's `active` routes, sorted. Gives the first difference.
    fn check_published(&self, dir: &Directory, active: usize) -> Result<(), String> {
        // The published view equals the writer's active routes.
        let guard = crossbeam_epoch::pin();
        let Some(view) = dir.state(self.target.hash_slot as usize, &guard) else {
            return Err("installed slot not published".into());
        };
        if view.target != self.target {
            return Err("published target differs".into());
        }
        let mut published = 0usize;
        self.table.check(dir, |u, uid, eps| {
            let Some(user) = self.users.get(u) else {
                return Err(format!("published entry of {uid} owned by no user"));
            };
            if *user.uid != *uid {
                return Err(format!("published entry of {uid} owned by {}", user.uid));
            }
            let mut expect: Vec<&Route> = self
                .records_of(u)
                .filter_map(|(_, r)| r.active().map(|a| &a.route))
                .collect();
            expect.sort_unstable_by_key(|r| Sess::of_route(r));
            let expect: Vec<CompactEndpoint> = expect.into_iter().map(compact_of).collect();
            if expect.as_slice() != eps {
                return Err(format!("published endpoints of {uid} differ"));
            }
            published += eps.len();
            Ok(())
        })?;
        if published != active {
            return Err(format!(
                "published {published} endpoints, {active} active routes"
            ));
        }
        Ok(())
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

/// A lookup group whose uids' hashes ([`uid_hash`]) were computed ahead (a
/// group's subscriber list keeps them): `hashes[i]` is the hash of `uids[i]`.
#[derive(Clone, Copy, Debug)]
pub struct HashedGroup<'a> {
    /// The exact target of the hash slot all of `uids` hash to.
    pub target: Target,
    /// The uids to look up; their endpoints come back in this order (rule 25).
    pub uids: &'a [Uid],
    /// `uid_hash(uids[i])` for each `i`; as long as `uids`.
    pub hashes: &'a [u64],
}

/// Lock-free lookups of the directory, from any thread. Cheap to clone (a clone
/// starts its own filter counts).
#[derive(Clone)]
pub struct AuthorityReader {
    dir: Arc<Directory>,
    /// What this reader's lookups' presence filters saved, so far.
    counts: std::cell::Cell<FilterCounts>,
}

impl AuthorityReader {
    /// A reader of `dir`.
    pub fn new(dir: &Arc<Directory>) -> AuthorityReader {
        AuthorityReader {
            dir: dir.clone(),
            counts: std::cell::Cell::default(),
        }
    }

    /// The presence filter counts of this reader's lookups so far (cumulative).
    pub fn filter_counts(&self) -> FilterCounts {
        self.counts.get()
    }

    /// The identity currently published for `hash_slot`.
    pub fn identity(&self, hash_slot: HashSlot) -> Option<Target> {
        let guard = crossbeam_epoch::pin();
        self.dir.state(hash_slot as usize, &guard).map(|v| v.target)
    }

    /// Looks up the active endpoints of each group's uids (rules 24–26), appending
    /// them to `out` and one entry per group to `results`, in input order: the range
    /// of `out` holding the group's endpoints, or the group's error (`NotLeader`: no
    /// identity; `StaleTarget`: a different one; `Full`: the group would pass
    /// `lookup_uids_max` for this call). Endpoints come in the order of the input
    /// uids, and within a uid ordered by (node_id, boot_id, session_id); each names
    /// its uid by `uid_index`, the uid's position in the group's slice. One pin for
    /// the whole call; never blocks or waits for the writers; allocates only when
    /// `out` or `results` grows. The fast form: no uid reference count touched.
    /// A uid its slot's presence filter says is absent is not probed.
    pub fn endpoints_by_targets_compact_into(
        &self,
        groups: &[(Target, &[Uid])],
        out: &mut Vec<CompactEndpoint>,
        results: &mut Vec<Result<Range<usize>, AuthorityError>>,
    ) {
        self.for_each_group(
            groups,
            |g| (g.0, g.1.len()),
            results,
            |view, g| {
                let start = out.len();
                let c = view.lookup(g.1, |e| out.push(e));
                (start..out.len(), c)
            },
        );
    }

    /// [`endpoints_by_targets_compact_into`](Self::endpoints_by_targets_compact_into)
    /// with full [`Endpoint`]s (each clones its uid's `Arc`).
    pub fn endpoints_by_targets_into(
        &self,
        groups: &[(Target, &[Uid])],
        out: &mut Vec<Endpoint>,
        results: &mut Vec<Result<Range<usize>, AuthorityError>>,
    ) {
        self.for_each_group(
            groups,
            |g| (g.0, g.1.len()),
            results,
            |view, g| {
                let uids = g.1;
                let start = out.len();
                let c = view.lookup(uids, |e| out.push(e.endpoint(&uids[e.uid_index as usize])));
                (start..out.len(), c)
            },
        );
    }

    /// [`endpoints_by_targets_into`](Self::endpoints_by_targets_into) of groups
    /// whose uids' hashes are given: a uid its filter says is absent costs its
    /// hash's filter word, its bytes are not read.
    pub fn endpoints_by_hashed_groups_into(
        &self,
        groups: &[HashedGroup<'_>],
        out: &mut Vec<Endpoint>,
        results: &mut Vec<Result<Range<usize>, AuthorityError>>,
    ) {
        self.for_each_group(
            groups,
            |g| (g.target, g.uids.len()),
            results,
            |view, g| {
                let uids = g.uids;
                let start = out.len();
                let push = |e: CompactEndpoint| out.push(e.endpoint(&uids[e.uid_index as usize]));
                let c = view.lookup_hashed(uids, g.hashes, push);
                (start..out.len(), c)
            },
        );
    }

    /// [`endpoints_by_targets_into`](Self::endpoints_by_targets_into) with one owned
    /// vector per group.
    pub fn endpoints_by_targets(
        &self,
        groups: &[(Target, &[Uid])],
    ) -> Vec<Result<Vec<Endpoint>, AuthorityError>> {
        let mut out = Vec::new();
        let mut results = Vec::with_capacity(groups.len());
        self.endpoints_by_targets_into(groups, &mut out, &mut results);
        results
            .into_iter()
            .map(|r| r.map(|range| out[range].to_vec()))
            .collect()
    }

    /// Checks each group's budget and target under one pin (`shape`: a group's
    /// target and uid count), pushing its error or the range `lookup` returns for
    /// it; adds up the filter counts.
    #[inline]
    fn for_each_group<G>(
        &self,
        groups: &[G],
        shape: impl Fn(&G) -> (Target, usize),
        results: &mut Vec<Result<Range<usize>, AuthorityError>>,
        mut lookup: impl FnMut(&SlotView<'_>, &G) -> (Range<usize>, FilterCounts),
    ) {
        let guard = crossbeam_epoch::pin();
        let mut budget = self.dir.lookup_uids_max;
        let mut counts = self.counts.get();
        results.reserve(groups.len());
        for g in groups {
            let (target, n) = shape(g);
            // `uid_index` is a u32: a larger group cannot be named (and would pass
            // any sane `lookup_uids_max`).
            if n > budget || n > u32::MAX as usize {
                results.push(Err(AuthorityError::Full));
                continue;
            }
            budget -= n;
            let Some(view) = self.dir.state(target.hash_slot as usize, &guard) else {
                results.push(Err(AuthorityError::NotLeader));
                continue;
            };
            if view.target != target {
                results.push(Err(AuthorityError::StaleTarget));
                continue;
            }
            if view.rebuilding {
                results.push(Err(AuthorityError::Rebuilding));
                continue;
            }
            let (range, c) = lookup(&view, g);
            counts.add(c);
            results.push(Ok(range));
        }
        self.counts.set(counts);
    }
}
