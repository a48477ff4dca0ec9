//! The presence authority: the fenced, expiring route directory of the hash slots a
//! node leads (`authority-rules.md`, rules 1–27). Sans-IO: every call takes `now_s`
//! (whole seconds of the authority's clock) and returns its outcome.
//!
//! - [`Directory`]: the shared, lock-free view of all 256 hash slots (identity and
//!   active endpoints per uid), created once per node.
//! - [`Authority`]: the single writer of the hash slots one shard claimed. It keeps
//!   the full records (routes, pending candidates, fence records, one timer-wheel
//!   entry per record) and publishes each uid's active endpoints to the directory.
//! - [`AuthorityReader`]: lookups from any thread, never blocking the writer.
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
//!   candidate, restarted by each unregister), then are dropped by the same wheel
//!   that expires routes. A message delayed longer than that retention is no longer
//!   fenced: a register or touch at or below the forgotten tombstone would (re)create
//!   the route. Such a route belongs to a closed session: the owner refuses pushes to
//!   it (it revalidates uid, boot_id, session_id, owner_seq) and, never touched, it
//!   expires after `route_ttl_s`. Keep `fence_retention_s` well above the longest
//!   delay an RPC can suffer.
//! - Limits (all in [`AuthorityConfig`]): a call that would pass one fails with
//!   [`AuthorityError::Full`] and changes nothing; nothing grows without bound.

mod published;

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use shard::slots::{hash_slot, HASH_SLOTS};
use shard::timer::{TimerHandle, TimerWheel, WheelStats};

pub use published::{Directory, FxBuildHasher, FxHasher};

use crate::cluster::{ClusterView, HashSlot, NodeId, Revision, Target};
use crate::route::{
    AuthorityError, BootId, DeviceLevel, Endpoint, OwnerAction, OwnerActionKind, OwnerSeq,
    PendingToken, RegisterOutcome, Route, RouteIdentity, SessionId, Uid,
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
    pub max_routes_per_slot: usize,
    /// Pending candidates per hash slot.
    pub max_pending_per_slot: usize,
    /// Identity records (with or without route) per hash slot.
    pub max_fence_records_per_slot: usize,
    /// Identity records per uid (bounds the per-uid conflict scans).
    pub max_records_per_uid: usize,
    /// Uids per `endpoints_by_targets` call; groups past the limit fail with `Full`.
    pub max_lookup_uids: usize,
    /// Routes per `touch_routes` call.
    pub max_touch_batch_routes: usize,
    /// Initial bucket count of a slot's published table (it doubles as it fills).
    pub initial_buckets_per_slot: usize,
}

impl Default for AuthorityConfig {
    fn default() -> Self {
        AuthorityConfig {
            route_ttl_s: 120,
            pending_ttl_s: 30,
            fence_retention_s: 600,
            max_routes_per_slot: 1 << 16,
            max_pending_per_slot: 1 << 12,
            max_fence_records_per_slot: 1 << 18,
            max_records_per_uid: 64,
            max_lookup_uids: 1 << 16,
            max_touch_batch_routes: 4096,
            initial_buckets_per_slot: 64,
        }
    }
}

/// An [`AuthorityConfig`] that cannot work.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ConfigError {
    /// A limit or timeout that must be at least 1 is 0 (the field's name).
    Zero(&'static str),
    /// `max_fence_records_per_slot` is below `max_routes_per_slot + max_pending_per_slot`.
    FenceRecordsBelowRoutes,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConfigError::Zero(name) => write!(f, "authority config: {name} must be at least 1"),
            ConfigError::FenceRecordsBelowRoutes => f.write_str(
                "authority config: max_fence_records_per_slot must be at least max_routes_per_slot + max_pending_per_slot",
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
            ("max_routes_per_slot", self.max_routes_per_slot),
            ("max_pending_per_slot", self.max_pending_per_slot),
            ("max_records_per_uid", self.max_records_per_uid),
            ("max_lookup_uids", self.max_lookup_uids),
            ("max_touch_batch_routes", self.max_touch_batch_routes),
            ("initial_buckets_per_slot", self.initial_buckets_per_slot),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero(name));
            }
        }
        if self.max_fence_records_per_slot
            < self
                .max_routes_per_slot
                .saturating_add(self.max_pending_per_slot)
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
        Ok(Arc::new(Directory::with_limit(config.max_lookup_uids)))
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
    pub refreshed: usize,
    pub recreated: usize,
    pub ignored: usize,
    pub full: usize,
}

/// One identity's fence record (inspection).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct FenceRecord {
    pub last_owner_seq: OwnerSeq,
    pub tombstone: Option<OwnerSeq>,
    /// `Some` while the identity has neither route nor candidate: the second at
    /// which the record is dropped.
    pub retain_until_s: Option<u64>,
}

/// Sizes of one slot's directory (inspection).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct SlotCounts {
    pub active_routes: usize,
    pub pending: usize,
    pub fence_records: usize,
}

/// Cumulative counters of one writer.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct AuthorityStats {
    pub routes_expired: u64,
    pub pending_expired: u64,
    pub fence_records_dropped: u64,
    /// Wheel buckets emptied by expiry passes.
    pub expiry_buckets_visited: u64,
    /// Wheel entries examined by expiry passes (fired or moved to a finer level).
    pub expiry_entries_visited: u64,
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
    timer: TimerHandle,
}

/// Everything the slot knows about one identity.
struct Record {
    sess: Sess,
    last_owner_seq: OwnerSeq,
    tombstone: Option<OwnerSeq>,
    /// Nonce of the newest registration of this identity (supersedes older tokens).
    last_nonce: u64,
    active: Option<Active>,
    pending: Option<Box<Pending>>,
    /// The record's one wheel entry: the active route's expiry (when it has an
    /// activity time) or the retention deadline (when it has neither route nor
    /// candidate); `None` otherwise.
    timer: Option<TimerHandle>,
    retain_until_s: Option<u64>,
}

impl Record {
    fn new(sess: Sess) -> Record {
        Record {
            sess,
            last_owner_seq: 0,
            tombstone: None,
            last_nonce: 0,
            active: None,
            pending: None,
            timer: None,
            retain_until_s: None,
        }
    }
    #[inline]
    fn tombstoned(&self, owner_seq: OwnerSeq) -> bool {
        self.tombstone.is_some_and(|t| owner_seq <= t)
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum TimerKind {
    Record,
    Pending(u64),
}

struct TimerKey {
    uid: Uid,
    sess: Sess,
    kind: TimerKind,
}

/// The writer state of one installed hash slot.
struct SlotWriter {
    target: Target,
    revision: Revision,
    uids: HashMap<Uid, Vec<Record>, FxBuildHasher>,
    wheel: TimerWheel<TimerKey>,
    active: usize,
    pending: usize,
    records: usize,
    published_uids: usize,
    next_nonce: u64,
    next_activation: u64,
}

#[inline]
fn route_deadline(last_active_s: Option<u64>, ttl_s: u64) -> Option<u64> {
    last_active_s.map(|a| a.saturating_add(ttl_s).saturating_add(1))
}

#[inline]
fn endpoint_of(r: &Route) -> Endpoint {
    Endpoint {
        uid: r.uid.clone(),
        device_flag: r.device_flag,
        device_level: r.device_level,
        node_id: r.node_id,
        boot_id: r.boot_id,
        session_id: r.session_id,
        owner_seq: r.owner_seq,
    }
}

/// Points `rec.timer` at the deadline its state asks for (see [`Record::timer`]).
/// `reset_retention` restarts a running retention period.
fn settle(
    wheel: &mut TimerWheel<TimerKey>,
    rec: &mut Record,
    uid: &Uid,
    now_s: u64,
    cfg: &AuthorityConfig,
    reset_retention: bool,
) {
    let desired = if let Some(a) = &rec.active {
        rec.retain_until_s = None;
        route_deadline(a.route.last_active_s, cfg.route_ttl_s)
    } else if rec.pending.is_some() {
        rec.retain_until_s = None;
        None
    } else {
        let d = match rec.retain_until_s {
            Some(d) if !reset_retention => d,
            _ => now_s.saturating_add(cfg.fence_retention_s),
        };
        rec.retain_until_s = Some(d);
        Some(d)
    };
    match desired {
        None => {
            if let Some(h) = rec.timer.take() {
                wheel.cancel(h);
            }
        }
        Some(d) => {
            if let Some(h) = rec.timer {
                if wheel.deadline(h) == Some(d) || wheel.reschedule(h, d) {
                    return;
                }
            }
            rec.timer = match wheel.insert(
                d,
                TimerKey {
                    uid: uid.clone(),
                    sess: rec.sess,
                    kind: TimerKind::Record,
                },
            ) {
                Ok(h) => Some(h),
                Err(_) => {
                    // The wheel holds one entry per record plus one per candidate and
                    // its limit covers both maxima (checked by `validate`).
                    debug_assert!(false, "timer wheel full");
                    None
                }
            };
        }
    }
}

impl SlotWriter {
    fn new(
        target: Target,
        revision: Revision,
        now_s: u64,
        cfg: &AuthorityConfig,
        next_nonce: u64,
    ) -> SlotWriter {
        SlotWriter {
            target,
            revision,
            uids: HashMap::default(),
            wheel: TimerWheel::new(
                now_s,
                cfg.max_fence_records_per_slot
                    .saturating_add(cfg.max_pending_per_slot)
                    .saturating_add(1),
            ),
            active: 0,
            pending: 0,
            records: 0,
            published_uids: 0,
            next_nonce,
            next_activation: 0,
        }
    }

    /// Publishes the active endpoints of `uid`, ordered by (node_id, boot_id,
    /// session_id) (rule 25).
    fn publish(&mut self, dir: &Directory, cfg: &AuthorityConfig, uid: &Uid) {
        let mut eps: Vec<Endpoint> = Vec::new();
        if let Some(recs) = self.uids.get(uid) {
            let n = recs.iter().filter(|r| r.active.is_some()).count();
            if n > 0 {
                eps.reserve_exact(n);
                eps.extend(
                    recs.iter()
                        .filter_map(|r| r.active.as_ref().map(|a| endpoint_of(&a.route))),
                );
                eps.sort_unstable_by_key(|e| (e.node_id, e.boot_id, e.session_id));
            }
        }
        dir.publish(
            self.target.hash_slot as usize,
            uid,
            eps,
            &mut self.published_uids,
            cfg.max_routes_per_slot,
        );
    }

    /// Index of the record of `sess` under `uid`, creating it within the limits.
    fn record_index_or_create(
        &mut self,
        uid: &Uid,
        sess: Sess,
        cfg: &AuthorityConfig,
    ) -> Result<usize, AuthorityError> {
        if let Some(recs) = self.uids.get(uid) {
            if let Some(i) = recs.iter().position(|r| r.sess == sess) {
                return Ok(i);
            }
            if recs.len() >= cfg.max_records_per_uid {
                return Err(AuthorityError::Full);
            }
        }
        if self.records >= cfg.max_fence_records_per_slot {
            return Err(AuthorityError::Full);
        }
        let recs = self.uids.entry(uid.clone()).or_default();
        recs.push(Record::new(sess));
        self.records += 1;
        Ok(recs.len() - 1)
    }

    /// Room for a new record of `sess` under `uid` (without creating it).
    fn can_create(&self, uid: &Uid, sess: Sess, cfg: &AuthorityConfig) -> bool {
        match self.uids.get(uid) {
            Some(recs) if recs.iter().any(|r| r.sess == sess) => true,
            Some(recs) if recs.len() >= cfg.max_records_per_uid => false,
            _ => self.records < cfg.max_fence_records_per_slot,
        }
    }

    fn drop_record(&mut self, uid: &Uid, i: usize) {
        let Some(recs) = self.uids.get_mut(uid) else {
            return;
        };
        let rec = recs.swap_remove(i);
        debug_assert!(rec.active.is_none() && rec.pending.is_none());
        if let Some(h) = rec.timer {
            self.wheel.cancel(h);
        }
        self.records -= 1;
        if recs.is_empty() {
            self.uids.remove(uid);
        }
    }

    fn register(
        &mut self,
        dir: &Directory,
        cfg: &AuthorityConfig,
        mut route: Route,
        now_s: u64,
    ) -> Result<RegisterOutcome, AuthorityError> {
        route.last_active_s = route.last_active_s.map(|t| t.min(now_s));
        let sess = Sess::of_route(&route);
        let mut conflicts: Vec<(Sess, OwnerSeq, bool)> = Vec::new();
        let mut own: Option<&Record> = None;
        if let Some(recs) = self.uids.get(&route.uid) {
            for r in recs {
                if r.sess == sess {
                    own = Some(r);
                } else if let Some(a) = &r.active {
                    if route.conflicts_with(&a.route) {
                        let kick = route.device_level == DeviceLevel::Master
                            && a.route.device_id != route.device_id;
                        conflicts.push((r.sess, a.route.owner_seq, kick));
                    }
                }
            }
        }
        if own.is_some_and(|r| r.tombstoned(route.owner_seq)) {
            return Err(AuthorityError::Tombstoned);
        }
        let had_active = own.is_some_and(|r| r.active.is_some());
        let had_pending = own.is_some_and(|r| r.pending.is_some());
        if !self.can_create(&route.uid, sess, cfg) {
            return Err(AuthorityError::Full);
        }
        if conflicts.is_empty() {
            if !had_active && self.active >= cfg.max_routes_per_slot {
                return Err(AuthorityError::Full);
            }
            let uid = route.uid.clone();
            let i = self.record_index_or_create(&uid, sess, cfg)?;
            self.next_nonce += 1;
            self.next_activation += 1;
            let (nonce, activation) = (self.next_nonce, self.next_activation);
            let Some(rec) = self.uids.get_mut(&uid).and_then(|v| v.get_mut(i)) else {
                return Err(AuthorityError::NotReady);
            };
            rec.last_owner_seq = rec.last_owner_seq.max(route.owner_seq);
            rec.last_nonce = nonce;
            if let Some(p) = rec.pending.take() {
                self.wheel.cancel(p.timer);
                self.pending -= 1;
            }
            rec.active = Some(Active { route, activation });
            if !had_active {
                self.active += 1;
            }
            settle(&mut self.wheel, rec, &uid, now_s, cfg, false);
            self.publish(dir, cfg, &uid);
            Ok(RegisterOutcome::Active)
        } else {
            if !had_pending && self.pending >= cfg.max_pending_per_slot {
                return Err(AuthorityError::Full);
            }
            let uid = route.uid.clone();
            self.next_nonce += 1;
            let nonce = self.next_nonce;
            let timer = self
                .wheel
                .insert(
                    now_s.saturating_add(cfg.pending_ttl_s).saturating_add(1),
                    TimerKey {
                        uid: uid.clone(),
                        sess,
                        kind: TimerKind::Pending(nonce),
                    },
                )
                .map_err(|_| AuthorityError::Full)?;
            let i = match self.record_index_or_create(&uid, sess, cfg) {
                Ok(i) => i,
                Err(e) => {
                    self.wheel.cancel(timer);
                    return Err(e);
                }
            };
            let Some(rec) = self.uids.get_mut(&uid).and_then(|v| v.get_mut(i)) else {
                self.wheel.cancel(timer);
                return Err(AuthorityError::NotReady);
            };
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
            settle(&mut self.wheel, rec, &uid, now_s, cfg, false);
            Ok(RegisterOutcome::Pending { token, actions })
        }
    }

    fn commit(
        &mut self,
        dir: &Directory,
        cfg: &AuthorityConfig,
        token: &PendingToken,
        now_s: u64,
    ) -> Result<(), AuthorityError> {
        let uid = token.identity.uid.clone();
        let sess = Sess::of_identity(&token.identity);
        let Some(recs) = self.uids.get_mut(&uid) else {
            return Err(AuthorityError::NotReady);
        };
        let Some(i) = recs.iter().position(|r| r.sess == sess) else {
            return Err(AuthorityError::NotReady);
        };
        if token.nonce < recs[i].last_nonce {
            return Err(AuthorityError::Superseded);
        }
        let Some(p) = recs[i]
            .pending
            .as_ref()
            .filter(|p| p.nonce == token.nonce && p.route.owner_seq == token.owner_seq)
        else {
            return Err(AuthorityError::NotReady);
        };
        let mut remove: Vec<usize> = Vec::new();
        for (j, r) in recs.iter().enumerate() {
            if j == i {
                continue;
            }
            if let Some(a) = &r.active {
                if p.route.conflicts_with(&a.route) {
                    if !p.acks.contains(&(r.sess, a.route.owner_seq)) {
                        return Err(AuthorityError::NotReady);
                    }
                    remove.push(j);
                }
            }
        }
        let had_active = recs[i].active.is_some();
        if self.active - remove.len() + usize::from(!had_active) > cfg.max_routes_per_slot {
            return Err(AuthorityError::Full);
        }
        for &j in &remove {
            let r = &mut recs[j];
            if let Some(a) = r.active.take() {
                r.tombstone = Some(
                    r.tombstone
                        .map_or(a.route.owner_seq, |t| t.max(a.route.owner_seq)),
                );
                self.active -= 1;
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
            settle(&mut self.wheel, r, &uid, now_s, cfg, false);
        }
        self.next_activation += 1;
        let rec = &mut recs[i];
        let Some(p) = rec.pending.take() else {
            return Err(AuthorityError::NotReady);
        };
        self.wheel.cancel(p.timer);
        self.pending -= 1;
        rec.active = Some(Active {
            route: p.route,
            activation: self.next_activation,
        });
        if !had_active {
            self.active += 1;
        }
        settle(&mut self.wheel, rec, &uid, now_s, cfg, false);
        self.publish(dir, cfg, &uid);
        Ok(())
    }

    fn abort(
        &mut self,
        cfg: &AuthorityConfig,
        token: &PendingToken,
        now_s: u64,
    ) -> Result<(), AuthorityError> {
        let uid = &token.identity.uid;
        let sess = Sess::of_identity(&token.identity);
        let Some(rec) = self
            .uids
            .get_mut(uid)
            .and_then(|v| v.iter_mut().find(|r| r.sess == sess))
        else {
            return Ok(());
        };
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
            settle(&mut self.wheel, rec, uid, now_s, cfg, false);
        }
        Ok(())
    }

    fn unregister(
        &mut self,
        dir: &Directory,
        cfg: &AuthorityConfig,
        identity: &RouteIdentity,
        owner_seq: OwnerSeq,
        now_s: u64,
    ) -> Result<bool, AuthorityError> {
        let uid = &identity.uid;
        let i = self.record_index_or_create(uid, Sess::of_identity(identity), cfg)?;
        let Some(rec) = self.uids.get_mut(uid).and_then(|v| v.get_mut(i)) else {
            return Err(AuthorityError::NotReady);
        };
        let tomb = rec.tombstone.map_or(owner_seq, |t| t.max(owner_seq));
        rec.tombstone = Some(tomb);
        rec.last_owner_seq = rec.last_owner_seq.max(owner_seq);
        let mut removed = false;
        if rec
            .active
            .as_ref()
            .is_some_and(|a| a.route.owner_seq <= tomb)
        {
            rec.active = None;
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
        settle(&mut self.wheel, rec, uid, now_s, cfg, true);
        if removed {
            let uid = uid.clone();
            self.publish(dir, cfg, &uid);
        }
        Ok(removed)
    }

    /// One touched route. Hot path: no allocation unless the route is recreated.
    #[inline]
    fn touch_one(
        &mut self,
        dir: &Directory,
        cfg: &AuthorityConfig,
        r: &Route,
        now_s: u64,
    ) -> TouchResult {
        let activity = r.last_active_s.unwrap_or(now_s).min(now_s);
        let sess = Sess::of_route(r);
        let mut missing_conflicts = false;
        if let Some(recs) = self.uids.get_mut(&r.uid) {
            let mut found = None;
            for (j, rec) in recs.iter().enumerate() {
                if rec.sess == sess {
                    found = Some(j);
                } else if let Some(a) = &rec.active {
                    if r.conflicts_with(&a.route) {
                        missing_conflicts = true;
                    }
                }
            }
            if let Some(j) = found {
                let rec = &mut recs[j];
                if r.owner_seq < rec.last_owner_seq {
                    return TouchResult::IgnoredStaleSeq;
                }
                if rec.tombstoned(r.owner_seq) {
                    return TouchResult::IgnoredTombstoned;
                }
                if let Some(a) = &mut rec.active {
                    rec.last_owner_seq = r.owner_seq;
                    if let Some(old) = a.route.last_active_s {
                        if activity > old {
                            a.route.last_active_s = Some(activity);
                            let d = activity.saturating_add(cfg.route_ttl_s).saturating_add(1);
                            let ok = rec.timer.is_some_and(|h| self.wheel.reschedule(h, d));
                            debug_assert!(ok, "active timed route without a live wheel entry");
                        }
                    }
                    if r.owner_seq > a.route.owner_seq {
                        a.route.owner_seq = r.owner_seq;
                        let uid = r.uid.clone();
                        self.publish(dir, cfg, &uid);
                    }
                    return TouchResult::Refreshed;
                }
            }
        }
        // Missing: recreate if it conflicts with nothing (rule 15).
        if missing_conflicts {
            return TouchResult::IgnoredConflict;
        }
        if self.active >= cfg.max_routes_per_slot || !self.can_create(&r.uid, sess, cfg) {
            return TouchResult::Full;
        }
        let uid = r.uid.clone();
        let Ok(i) = self.record_index_or_create(&uid, sess, cfg) else {
            return TouchResult::Full;
        };
        self.next_activation += 1;
        let activation = self.next_activation;
        let Some(rec) = self.uids.get_mut(&uid).and_then(|v| v.get_mut(i)) else {
            return TouchResult::Full;
        };
        rec.last_owner_seq = rec.last_owner_seq.max(r.owner_seq);
        let mut route = r.clone();
        route.last_active_s = Some(activity);
        rec.active = Some(Active { route, activation });
        self.active += 1;
        settle(&mut self.wheel, rec, &uid, now_s, cfg, false);
        self.publish(dir, cfg, &uid);
        TouchResult::Recreated
    }

    /// Handles one fired wheel entry (see `Authority::expire`).
    fn fired(
        &mut self,
        dir: &Directory,
        cfg: &AuthorityConfig,
        key: TimerKey,
        now_s: u64,
        stats: &mut AuthorityStats,
    ) {
        let Some(i) = self
            .uids
            .get(&key.uid)
            .and_then(|v| v.iter().position(|r| r.sess == key.sess))
        else {
            debug_assert!(false, "fired timer of a dropped record");
            return;
        };
        let Some(rec) = self.uids.get_mut(&key.uid).and_then(|v| v.get_mut(i)) else {
            return;
        };
        match key.kind {
            TimerKind::Pending(nonce) => {
                if rec.pending.as_ref().is_some_and(|p| p.nonce == nonce) {
                    rec.pending = None;
                    self.pending -= 1;
                    stats.pending_expired += 1;
                    settle(&mut self.wheel, rec, &key.uid, now_s, cfg, false);
                } else {
                    debug_assert!(false, "fired timer of a replaced candidate");
                }
            }
            TimerKind::Record => {
                // The fired handle is stale; a handler earlier in this pass may have
                // set a fresh one: drop it and decide from the record's state.
                if let Some(h) = rec.timer.take() {
                    self.wheel.cancel(h);
                }
                let route_due = rec
                    .active
                    .as_ref()
                    .and_then(|a| route_deadline(a.route.last_active_s, cfg.route_ttl_s))
                    .is_some_and(|d| d <= now_s);
                if route_due {
                    rec.active = None;
                    self.active -= 1;
                    stats.routes_expired += 1;
                    settle(&mut self.wheel, rec, &key.uid, now_s, cfg, false);
                    self.publish(dir, cfg, &key.uid);
                } else if rec.active.is_none()
                    && rec.pending.is_none()
                    && rec.retain_until_s.is_some_and(|d| d <= now_s)
                {
                    stats.fence_records_dropped += 1;
                    self.drop_record(&key.uid, i);
                } else {
                    settle(&mut self.wheel, rec, &key.uid, now_s, cfg, false);
                }
            }
        }
    }

    fn check_invariants(&self, dir: &Directory, cfg: &AuthorityConfig) -> Result<(), String> {
        self.wheel.check_invariants()?;
        let (mut active, mut pending, mut records, mut timers) = (0, 0, 0, 0);
        for (uid, recs) in &self.uids {
            if recs.is_empty() {
                return Err(format!("uid {uid}: empty record list"));
            }
            if hash_slot(uid.as_bytes()) != self.target.hash_slot {
                return Err(format!("uid {uid} in the wrong slot"));
            }
            for r in recs {
                records += 1;
                if let Some(t) = r.tombstone {
                    if t > r.last_owner_seq {
                        return Err(format!("{uid}: tombstone above last owner_seq"));
                    }
                }
                let desired = if let Some(a) = &r.active {
                    active += 1;
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
                    pending += 1;
                    timers += 1;
                    if self.wheel.get(p.timer).is_none() {
                        return Err(format!("{uid}: candidate without a wheel entry"));
                    }
                }
                match (desired, r.timer) {
                    (None, None) => {}
                    (Some(d), Some(h)) if self.wheel.deadline(h) == Some(d) => timers += 1,
                    _ => return Err(format!("{uid}: record timer does not match its state")),
                }
            }
        }
        if (active, pending, records) != (self.active, self.pending, self.records) {
            return Err(format!(
                "counts: counted {active}/{pending}/{records}, kept {}/{}/{}",
                self.active, self.pending, self.records
            ));
        }
        if timers != self.wheel.len() {
            return Err(format!(
                "wheel holds {} entries, records need {timers}",
                self.wheel.len()
            ));
        }
        // The published view equals the writer's active routes.
        let guard = crossbeam_epoch::pin();
        let Some(view) = dir.state(self.target.hash_slot as usize, &guard) else {
            return Err("installed slot not published".into());
        };
        if view.target != self.target {
            return Err("published target differs".into());
        }
        let mut published = 0usize;
        let mut err = None;
        view.for_each(|uid, eps| {
            published += eps.len();
            let mut expect: Vec<&Route> = self
                .uids
                .get(uid)
                .map(|v| {
                    v.iter()
                        .filter_map(|r| r.active.as_ref().map(|a| &a.route))
                        .collect()
                })
                .unwrap_or_default();
            expect.sort_unstable_by_key(|r| Sess::of_route(r));
            let expect: Vec<Endpoint> = expect.into_iter().map(endpoint_of).collect();
            if expect.as_slice() != eps {
                err = Some(format!("published endpoints of {uid} differ"));
            }
        });
        if let Some(e) = err {
            return Err(e);
        }
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
    fired: Vec<(usize, TimerKey)>,
    /// Registration nonces of each slot, kept across identities so a token of an
    /// older identity never names a candidate of a newer one.
    next_nonce: Box<[u64]>,
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
            fired: Vec::new(),
            next_nonce: vec![0; HASH_SLOTS].into_boxed_slice(),
        })
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
        let w = SlotWriter::new(target, revision, now_s, &self.cfg, self.next_nonce[s]);
        self.slots[s] = Some(Box::new(w));
        self.dir
            .install(s, target, self.cfg.initial_buckets_per_slot);
        Ok(outcome)
    }

    /// Drops all state of `hash_slot` (rule 5); later calls get `NotLeader`.
    /// Returns whether an identity was installed.
    pub fn remove(&mut self, hash_slot: HashSlot) -> bool {
        let s = hash_slot as usize;
        if !self.owned.get(s).copied().unwrap_or(false) {
            return false;
        }
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
    pub fn apply_view(&mut self, view: &ClusterView, local_node_id: NodeId, now_s: u64) -> bool {
        if self.view_revision.is_some_and(|r| view.revision < r) {
            return false;
        }
        self.view_revision = Some(view.revision);
        for s in 0..HASH_SLOTS {
            if !self.owned[s] {
                continue;
            }
            let target = view.target_for_slot(s as HashSlot);
            if target.leader_node_id == local_node_id {
                // An older identity than installed is refused inside; keep ours.
                let _ = self.install(target, view.revision, now_s);
            } else {
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
    ) -> Result<(&mut SlotWriter, &Directory, &AuthorityConfig), AuthorityError> {
        let w = self
            .slots
            .get_mut(target.hash_slot as usize)
            .and_then(|s| s.as_deref_mut())
            .ok_or(AuthorityError::NotLeader)?;
        if w.target != *target {
            return Err(AuthorityError::StaleTarget);
        }
        Ok((w, &self.dir, &self.cfg))
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
        let (w, dir, cfg) = self.slot_mut(target)?;
        if hash_slot(route.uid.as_bytes()) != target.hash_slot {
            return Err(AuthorityError::StaleTarget);
        }
        w.register(dir, cfg, route, now_s)
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
        let (w, dir, cfg) = self.slot_mut(target)?;
        w.commit(dir, cfg, token, now_s)
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
        let (w, _, cfg) = self.slot_mut(target)?;
        w.abort(cfg, token, now_s)
    }

    /// Records an unregister tombstone at `owner_seq` for the exact identity (rules
    /// 18, 19) and removes its route and candidate if the tombstone is at least as
    /// new. Returns whether an active route was removed. `Full` when a new fence
    /// record would pass `max_fence_records_per_slot` (retry later).
    pub fn unregister_route(
        &mut self,
        target: &Target,
        identity: &RouteIdentity,
        owner_seq: OwnerSeq,
        now_s: u64,
    ) -> Result<bool, AuthorityError> {
        let (w, dir, cfg) = self.slot_mut(target)?;
        if hash_slot(identity.uid.as_bytes()) != target.hash_slot {
            return Err(AuthorityError::StaleTarget);
        }
        w.unregister(dir, cfg, identity, owner_seq, now_s)
    }

    /// Touches the owner's current routes (rules 14–17), appending one
    /// [`TouchResult`] per route to `out` in input order. The whole call fails on a
    /// fence error or when `routes` passes `max_touch_batch_routes`.
    pub fn touch_routes_into(
        &mut self,
        target: &Target,
        routes: &[Route],
        now_s: u64,
        out: &mut Vec<TouchResult>,
    ) -> Result<TouchCounts, AuthorityError> {
        let (w, dir, cfg) = self.slot_mut(target)?;
        if routes.len() > cfg.max_touch_batch_routes {
            return Err(AuthorityError::Full);
        }
        let mut counts = TouchCounts::default();
        out.reserve(routes.len());
        for r in routes {
            let res = if hash_slot(r.uid.as_bytes()) != target.hash_slot {
                TouchResult::WrongSlot
            } else {
                w.touch_one(dir, cfg, r, now_s)
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
    /// due wheel buckets; removes routes whose activity plus TTL is before `now_s`,
    /// candidates past `pending_ttl_s` and fence records past their retention.
    /// Returns the number of routes expired. A `now_s` below an earlier pass's is
    /// treated as that earlier time.
    pub fn expire(&mut self, now_s: u64) -> usize {
        let mut expired = 0u64;
        let before = self.stats.routes_expired;
        for s in 0..HASH_SLOTS {
            let Some(w) = self.slots[s].as_deref_mut() else {
                continue;
            };
            let st0 = w.wheel.stats();
            let fired = &mut self.fired;
            fired.clear();
            w.wheel.advance(now_s, |_, _, key| fired.push((s, key)));
            let st1 = w.wheel.stats();
            self.stats.expiry_buckets_visited += st1.buckets_visited - st0.buckets_visited;
            self.stats.expiry_entries_visited += st1.entries_visited - st0.entries_visited;
            let now = w.wheel.now();
            for (_, key) in self.fired.drain(..) {
                w.fired(&self.dir, &self.cfg, key, now, &mut self.stats);
            }
        }
        expired += self.stats.routes_expired - before;
        expired as usize
    }

    /// Cumulative counters.
    pub fn stats(&self) -> AuthorityStats {
        self.stats
    }

    /// Summed work counters of the slots' current wheels.
    pub fn wheel_stats(&self) -> WheelStats {
        let mut t = WheelStats::default();
        for w in self.slots.iter().flatten() {
            let s = w.wheel.stats();
            t.buckets_visited += s.buckets_visited;
            t.entries_visited += s.entries_visited;
            t.fired += s.fired;
            t.recascaded += s.recascaded;
        }
        t
    }

    /// The active route of `identity` as the writer keeps it (with its activity time).
    pub fn route(&self, identity: &RouteIdentity) -> Option<Route> {
        let w = self.slots[hash_slot(identity.uid.as_bytes()) as usize].as_ref()?;
        let sess = Sess::of_identity(identity);
        w.uids
            .get(&identity.uid)?
            .iter()
            .find(|r| r.sess == sess)?
            .active
            .as_ref()
            .map(|a| a.route.clone())
    }

    /// The fence record of `identity`, if kept.
    pub fn fence(&self, identity: &RouteIdentity) -> Option<FenceRecord> {
        let w = self.slots[hash_slot(identity.uid.as_bytes()) as usize].as_ref()?;
        let sess = Sess::of_identity(identity);
        let r = w.uids.get(&identity.uid)?.iter().find(|r| r.sess == sess)?;
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
        let sess = Sess::of_identity(identity);
        w.uids
            .get(&identity.uid)
            .and_then(|v| v.iter().find(|r| r.sess == sess))
            .is_some_and(|r| r.pending.is_some())
    }

    /// The active routes of `hash_slot` in activation order (oldest first).
    pub fn active_routes(&self, hash_slot: HashSlot) -> Vec<Route> {
        let Some(w) = self.slots.get(hash_slot as usize).and_then(|s| s.as_ref()) else {
            return Vec::new();
        };
        let mut v: Vec<(u64, Route)> = w
            .uids
            .values()
            .flatten()
            .filter_map(|r| r.active.as_ref().map(|a| (a.activation, a.route.clone())))
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
                fence_records: w.records,
            },
            None => SlotCounts::default(),
        }
    }

    /// Counts the routes a full scan would expire at `now_s` (the cost baseline the
    /// wheel avoids; benches only).
    #[doc(hidden)]
    pub fn full_scan_due(&self, now_s: u64) -> usize {
        let ttl = self.cfg.route_ttl_s;
        self.slots
            .iter()
            .flatten()
            .flat_map(|w| w.uids.values().flatten())
            .filter(|r| {
                r.active
                    .as_ref()
                    .and_then(|a| route_deadline(a.route.last_active_s, ttl))
                    .is_some_and(|d| d <= now_s)
            })
            .count()
    }

    /// Checks every invariant of every installed slot (O(size); for tests): counts,
    /// exactly one wheel entry per timed route, per candidate and per orphan fence
    /// record with the deadline its state asks for, no route at or below its
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

/// Lock-free lookups of the directory, from any thread. Cheap to clone.
#[derive(Clone)]
pub struct AuthorityReader {
    dir: Arc<Directory>,
}

impl AuthorityReader {
    /// A reader of `dir`.
    pub fn new(dir: &Arc<Directory>) -> AuthorityReader {
        AuthorityReader { dir: dir.clone() }
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
    /// `max_lookup_uids` for this call). Endpoints come in the order of the input
    /// uids, and within a uid ordered by (node_id, boot_id, session_id). One pin
    /// for the whole call; never blocks or waits for the writers.
    pub fn endpoints_by_targets_into(
        &self,
        groups: &[(Target, &[Uid])],
        out: &mut Vec<Endpoint>,
        results: &mut Vec<Result<Range<usize>, AuthorityError>>,
    ) {
        let guard = crossbeam_epoch::pin();
        let mut budget = self.dir.max_lookup_uids;
        results.reserve(groups.len());
        for (target, uids) in groups {
            if uids.len() > budget {
                results.push(Err(AuthorityError::Full));
                continue;
            }
            budget -= uids.len();
            let Some(view) = self.dir.state(target.hash_slot as usize, &guard) else {
                results.push(Err(AuthorityError::NotLeader));
                continue;
            };
            if view.target != *target {
                results.push(Err(AuthorityError::StaleTarget));
                continue;
            }
            let start = out.len();
            view.append_endpoints(uids, out);
            results.push(Ok(start..out.len()));
        }
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
}
