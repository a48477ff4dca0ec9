//! The owner-local registry: the sessions of one gateway shard, sans-IO.
//!
//! One [`Registry`] per gateway shard, written only by that shard. It holds:
//!
//! - **Sessions** in a slab addressed by an entry-independent [`SessionHandle`]
//!   `(shard, index, generation)`: a slot's generation grows every time the slot is
//!   freed, so the handle of a gone session never reaches a newer session in the same
//!   slot. States: [`SessionState::Pending`] (activation running) →
//!   [`SessionState::Active`] (route committed, visible to delivery) →
//!   [`SessionState::Closing`] (being kicked/closed, invisible to delivery).
//! - A **per-uid index** (uid → sessions of this shard), for `/user/device_quit`-style
//!   closes and owner actions.
//! - A **session-id index** for delivery revalidation ([`Registry::revalidate`], O(1),
//!   no allocation).
//! - The **dirty-touch set** (rule 33): a PING only marks its session dirty
//!   ([`Registry::mark_touched`], O(1), no allocation); the touch worker drains it in
//!   bounded batches grouped by the *current* authority target
//!   ([`Registry::drain_touches`]). At most one entry per session, so it is bounded by
//!   `sessions_max`.
//! - The **rebuild queue**: when a view moves hash slots, the active sessions of
//!   the moved slots are queued ([`Registry::queue_rebuild`]) and re-registered at
//!   the new authority at a bounded rate ([`Registry::drain_rebuild`], a token
//!   bucket of [`RebuildLimits`]) in TouchRoutes batches: the new authority's
//!   directory is rebuilt at once, not as clients ping (rule 15). At most one entry
//!   per session, so it is bounded by `sessions_max`.
//! - The **pending-unregister queue** (rule 32): [`Registry::deactivate`] removes the
//!   session first (delivery stops seeing it at once), then queues the authority
//!   unregister; [`Registry::drain_unregisters`] hands due entries out with the target
//!   current at drain time, [`Registry::unregister_failed`] requeues with backoff up to
//!   a retry limit. Bounded by `pending_unregisters_max`.
//!
//! ## owner_seq
//! One monotonic counter per registry (starting at 1) allocates every owner_seq of this
//! shard's identities. A session's **route owner_seq** is drawn when it is registered
//! pending ([`SessionInfo::owner_seq`]); the route registered at the authority, every
//! touch of it and the [`Endpoint`](crate::presence::route::Endpoint) a lookup returns carry that
//! same value, so a route rebuilt by a touch on a new authority is indistinguishable
//! from the registered one and revalidates. (Touches carry the register's seq, not a
//! higher one: the authority accepts a touch whose seq equals the identity's last seq,
//! rule 16.) An unregister draws a **fresh** seq when it is queued, so it is strictly
//! above the route owner_seq of its session (it was drawn later from the same
//! counter): its tombstone removes the route and fences a late register or touch
//! (rules 12, 16, 19). Session ids are unique per process and a session lives on one
//! shard, so one counter per shard orders everything of one identity.
//!
//! Rule numbers refer to `docs/authority-rules.md` (each tested in
//! `domain/tests/authority_rules.rs` or `activation_rules.rs`).

use std::collections::hash_map::Entry as MapEntry;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use slots::{hash_slot, HASH_SLOTS};

use crate::cluster::{ClusterView, HashSlot, NodeId, Target};
use crate::presence::route::{
    AuthorityRequest, BootId, DeviceLevel, OwnerSeq, Route, RouteIdentity, SessionId, Transport,
    Uid,
};

/// Default for [`RegistryConfig::sessions_max`].
pub const DEFAULT_MAX_SESSIONS: u32 = 1_000_000;
/// Default for [`RegistryConfig::pending_unregisters_max`].
pub const DEFAULT_MAX_PENDING_UNREGISTERS: usize = 65_536;
/// Default for [`RegistryConfig::unregister_attempts_max`].
pub const DEFAULT_UNREGISTER_MAX_ATTEMPTS: u32 = 8;
/// Default for [`RegistryConfig::unregister_retry_base_ms`].
pub const DEFAULT_UNREGISTER_RETRY_BASE_MS: u64 = 100;
/// Default for [`RegistryConfig::unregister_retry_ms_max`].
pub const DEFAULT_UNREGISTER_RETRY_MAX_MS: u64 = 5_000;

/// Slab index meaning "none" in the intrusive lists; also the exclusive upper bound of
/// `sessions_max`.
const NIL: u32 = u32::MAX;

/// Limits and identity of one registry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegistryConfig {
    /// The shard this registry belongs to; stamped into every handle.
    pub shard: u16,
    /// This node's id (the owner node of every route of this registry).
    pub node_id: NodeId,
    /// This process's boot id.
    pub boot_id: BootId,
    /// Most sessions (pending, active and closing together). `1..u32::MAX`.
    pub sessions_max: u32,
    /// Most authority unregisters waiting to be sent or retried.
    pub pending_unregisters_max: usize,
    /// Attempts of one unregister before it is abandoned (the authority's TTL then
    /// removes the route). At least 1.
    pub unregister_attempts_max: u32,
    /// Backoff before retry `n` (1-based) is `base << (n - 1)`, capped by
    /// `unregister_retry_ms_max`.
    pub unregister_retry_base_ms: u64,
    /// Cap of the retry backoff.
    pub unregister_retry_ms_max: u64,
}

impl RegistryConfig {
    /// The defaults for the given shard and process identity.
    pub fn new(shard: u16, node_id: NodeId, boot_id: BootId) -> Self {
        RegistryConfig {
            shard,
            node_id,
            boot_id,
            sessions_max: DEFAULT_MAX_SESSIONS,
            pending_unregisters_max: DEFAULT_MAX_PENDING_UNREGISTERS,
            unregister_attempts_max: DEFAULT_UNREGISTER_MAX_ATTEMPTS,
            unregister_retry_base_ms: DEFAULT_UNREGISTER_RETRY_BASE_MS,
            unregister_retry_ms_max: DEFAULT_UNREGISTER_RETRY_MAX_MS,
        }
    }
}

/// The limits of the `[registry]` section of the node's configuration: those of
/// [`RegistryConfig`] that are not the process's identity (`sessions_max` is
/// `[session] sessions_per_shard_max`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RegistryLimits {
    /// Most authority unregisters waiting to be sent or retried, per shard.
    pub pending_unregisters_max: usize,
    /// Attempts of one unregister before it is abandoned. At least 1.
    pub unregister_attempts_max: u32,
    /// Backoff before retry `n` (1-based) is `base << (n - 1)`. At least 1.
    pub unregister_retry_base_ms: u64,
    /// Cap of the retry backoff; at least the base.
    pub unregister_retry_ms_max: u64,
}

impl Default for RegistryLimits {
    fn default() -> Self {
        RegistryLimits {
            pending_unregisters_max: DEFAULT_MAX_PENDING_UNREGISTERS,
            unregister_attempts_max: DEFAULT_UNREGISTER_MAX_ATTEMPTS,
            unregister_retry_base_ms: DEFAULT_UNREGISTER_RETRY_BASE_MS,
            unregister_retry_ms_max: DEFAULT_UNREGISTER_RETRY_MAX_MS,
        }
    }
}

impl RegistryLimits {
    /// Refuses limits a registry cannot run with, naming them (`registry.name`).
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [
            (
                "pending_unregisters_max",
                self.pending_unregisters_max as u64,
            ),
            (
                "unregister_attempts_max",
                u64::from(self.unregister_attempts_max),
            ),
            ("unregister_retry_base_ms", self.unregister_retry_base_ms),
        ] {
            if v == 0 {
                return Err(format!("registry.{name} must be at least 1 (is 0)"));
            }
        }
        if self.unregister_retry_ms_max < self.unregister_retry_base_ms {
            return Err("registry.unregister_retry_ms_max must be at least \
                        registry.unregister_retry_base_ms"
                .into());
        }
        Ok(())
    }
}

impl RegistryConfig {
    /// The configuration of shard `shard`'s registry: `limits` from the node's
    /// `[registry]` section, at most `sessions_max` sessions.
    pub fn with_limits(
        shard: u16,
        node_id: NodeId,
        boot_id: BootId,
        sessions_max: u32,
        limits: &RegistryLimits,
    ) -> Self {
        RegistryConfig {
            sessions_max,
            pending_unregisters_max: limits.pending_unregisters_max,
            unregister_attempts_max: limits.unregister_attempts_max,
            unregister_retry_base_ms: limits.unregister_retry_base_ms,
            unregister_retry_ms_max: limits.unregister_retry_ms_max,
            ..RegistryConfig::new(shard, node_id, boot_id)
        }
    }
}

/// A configuration the registry cannot run with.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum RegistryConfigError {
    /// `sessions_max` must be in `1..u32::MAX`.
    MaxSessions,
    /// `unregister_attempts_max` must be at least 1.
    UnregisterMaxAttempts,
}

impl std::fmt::Display for RegistryConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RegistryConfigError::MaxSessions => "sessions_max must be in 1..4294967295",
            RegistryConfigError::UnregisterMaxAttempts => {
                "unregister_attempts_max must be at least 1"
            }
        })
    }
}

impl std::error::Error for RegistryConfigError {}

/// Names one session of one shard. Copyable, independent of the slab entry: a handle
/// whose session is gone is refused by every call (never reaches a newer session).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct SessionHandle {
    /// The shard whose registry holds the session ([`RegistryConfig::shard`]).
    pub shard: u16,
    /// The session's slot in that registry's slab.
    pub index: u32,
    /// The slot's generation when the session was registered; the slot's grows when
    /// it is freed, so a stale handle no longer matches.
    pub generation: u32,
}

/// Life cycle of a session in the registry.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum SessionState {
    /// Registered locally; its activation is running. Invisible to delivery.
    Pending,
    /// Route committed at the authority; visible to delivery and touched by PINGs.
    Active,
    /// Being closed (kick, quit, shutdown). Invisible to delivery, never active again.
    Closing,
}

/// What the gateway knows of a new connection when it registers it.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct NewSession {
    /// The uid the CONNECT logged in as.
    pub uid: Uid,
    /// The CONNECT's device id.
    pub device_id: Arc<str>,
    /// The CONNECT's device flag.
    pub device_flag: u8,
    /// The level the uid's token was stored with (or the configured default).
    pub device_level: DeviceLevel,
    /// Unique within this process (boot id).
    pub session_id: SessionId,
    /// The listener the connection came in on.
    pub listener: Transport,
    /// When the connection was accepted, in milliseconds of the wall clock (Unix time).
    pub connected_at_ms: u64,
}

/// One session as the registry holds it.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct SessionInfo {
    /// As [`NewSession::uid`].
    pub uid: Uid,
    /// As [`NewSession::device_id`].
    pub device_id: Arc<str>,
    /// As [`NewSession::device_flag`].
    pub device_flag: u8,
    /// As [`NewSession::device_level`].
    pub device_level: DeviceLevel,
    /// As [`NewSession::session_id`]; indexed for [`Registry::revalidate`].
    pub session_id: SessionId,
    /// This process's boot id ([`RegistryConfig::boot_id`]).
    pub boot_id: BootId,
    /// This node's id ([`RegistryConfig::node_id`]): the route's owner node.
    pub node_id: NodeId,
    /// As [`NewSession::listener`].
    pub listener: Transport,
    /// The route owner_seq: drawn at registration, carried by the register, every
    /// touch and every endpoint of this session's route (see the module docs).
    pub owner_seq: OwnerSeq,
    /// As [`NewSession::connected_at_ms`].
    pub connected_at_ms: u64,
    /// The authority target the route was registered under (the view at activation).
    /// Touches and unregisters use the target current when they are drained.
    pub target: Target,
}

impl SessionInfo {
    /// The route identity `(uid, node_id, boot_id, session_id)`.
    pub fn identity(&self) -> RouteIdentity {
        RouteIdentity {
            uid: self.uid.clone(),
            node_id: self.node_id,
            boot_id: self.boot_id,
            session_id: self.session_id,
        }
    }

    /// This session's route, with activity `last_active_s`.
    pub fn route(&self, last_active_s: Option<u64>) -> Route {
        Route {
            uid: self.uid.clone(),
            device_id: self.device_id.clone(),
            device_flag: self.device_flag,
            device_level: self.device_level,
            node_id: self.node_id,
            boot_id: self.boot_id,
            session_id: self.session_id,
            listener: self.listener,
            owner_seq: self.owner_seq,
            connected_at_ms: self.connected_at_ms,
            last_active_s,
        }
    }
}

/// Why [`Registry::register_pending`] refused a session.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum RegisterError {
    /// The registry holds `sessions_max` sessions.
    Full,
    /// Another live session of this registry has the same session id.
    DuplicateSession,
}

impl std::fmt::Display for RegisterError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RegisterError::Full => "session registry full",
            RegisterError::DuplicateSession => "duplicate session id",
        })
    }
}

impl std::error::Error for RegisterError {}

/// The session is gone, closing, or (for [`Registry::mark_active`]) not pending.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Gone;

impl std::fmt::Display for Gone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("session gone")
    }
}

impl std::error::Error for Gone {}

/// The pending-unregister queue is at `pending_unregisters_max`; the unregister was
/// dropped (counted in [`RegistryStats::unregisters_dropped_full`]); the authority's
/// TTL removes the route instead.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct UnregisterQueueFull;

/// One authority unregister to send, drained from the pending queue.
#[derive(Clone, PartialEq, Eq, Debug, serde::Serialize, serde::Deserialize)]
pub struct UnregisterRequest {
    /// The target current when drained.
    pub target: Target,
    /// The exact route to remove at the authority.
    pub identity: RouteIdentity,
    /// The tombstone seq: above the route owner_seq of the session.
    pub owner_seq: OwnerSeq,
    /// Attempts made before this one (0 on the first send).
    pub attempt: u32,
}

impl UnregisterRequest {
    /// The authority request to send to [`UnregisterRequest::target`].
    pub fn request(&self) -> AuthorityRequest {
        AuthorityRequest::Unregister {
            identity: self.identity.clone(),
            owner_seq: self.owner_seq,
        }
    }
}

/// Counters, for metrics and tests.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct RegistryStats {
    /// Sessions held, in any state (pending, active, closing).
    pub sessions: u32,
    /// Sessions in the dirty-touch set, waiting for the next touch drain.
    pub dirty: u32,
    /// Authority unregisters waiting to be sent or retried.
    pub pending_unregisters: usize,
    /// Unregisters dropped because the queue was full.
    pub unregisters_dropped_full: u64,
    /// Unregisters dropped after `unregister_attempts_max` failures.
    pub unregisters_abandoned: u64,
    /// Failed touches put back into the dirty set.
    pub touches_requeued: u64,
    /// Failed touches dropped because their route was no longer current.
    pub touches_dropped_stale: u64,
    /// Current sessions whose route their authority refused for good
    /// ([`Registry::superseded`]): told and closed by the driver.
    pub sessions_superseded: u64,
    /// Routes waiting in the rebuild queue.
    pub rebuild_queued: u32,
    /// Routes handed out by [`Registry::drain_rebuild`] (resends included).
    pub routes_rebuilt: u64,
    /// Failed rebuild touches put back into the rebuild queue.
    pub rebuild_requeued: u64,
    /// The last closed rebuild round's duration: from the view's arrival to the
    /// drain that found the queue empty (`None` before the first).
    pub rebuild_last_ms: Option<u64>,
}

/// How fast one registry re-registers routes after a view change
/// ([`Registry::drain_rebuild`]): a token bucket.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct RebuildLimits {
    /// Routes re-registered per second (the bucket's refill). At least 1.
    pub routes_per_s: u32,
    /// The bucket's size: most routes one drain takes after a pause. At least 1.
    pub burst_routes: u32,
    /// Most routes in one TouchRoutes batch (at most the authority's
    /// `touch_batch_routes_max`).
    pub batch_routes_max: usize,
}

/// The rebuild round and its token bucket.
#[derive(Clone, Copy, Debug, Default)]
struct RebuildState {
    /// Numbers the views that queued something (0: none yet).
    round: u32,
    /// When the open round's view arrived; `None` while no round is open.
    since_ms: Option<u64>,
    /// When the latest view arrived (a requeue after the round closed reopens it
    /// from there).
    view_ms: u64,
    last_duration_ms: Option<u64>,
    /// Tokens in thousandths of a route.
    tokens_milli: u64,
    /// When the bucket was last refilled; `None`: it is full.
    refilled_ms: Option<u64>,
}

impl RebuildState {
    /// Refills the bucket to `now_ms` and takes at most `queued` whole tokens.
    fn take_tokens(&mut self, now_ms: u64, limits: &RebuildLimits, queued: u32) -> u32 {
        let cap = u64::from(limits.burst_routes.max(1)) * 1000;
        let per_ms = u64::from(limits.routes_per_s.max(1));
        self.tokens_milli = match self.refilled_ms {
            None => cap,
            Some(t) => cap.min(
                self.tokens_milli
                    .saturating_add(now_ms.saturating_sub(t).saturating_mul(per_ms)),
            ),
        };
        self.refilled_ms = Some(now_ms.max(self.refilled_ms.unwrap_or(0)));
        let n = (self.tokens_milli / 1000).min(u64::from(queued)) as u32;
        self.tokens_milli -= u64::from(n) * 1000;
        n
    }
}

/// TouchRoutes batches under construction: one open batch per hash slot (its
/// target), a new one when it holds `max` routes; batches in order of creation.
struct Batches {
    out: Vec<(Target, Vec<Route>)>,
    open: [u32; HASH_SLOTS],
    max: usize,
}

impl Batches {
    fn new(max: usize) -> Self {
        Batches {
            out: Vec::new(),
            open: [u32::MAX; HASH_SLOTS],
            max,
        }
    }

    fn push(&mut self, view: &ClusterView, hs: HashSlot, route: Route) {
        let g = &mut self.open[hs as usize];
        if *g == u32::MAX || self.out[*g as usize].1.len() >= self.max {
            *g = self.out.len() as u32;
            self.out.push((view.target_for_slot(hs), Vec::new()));
        }
        self.out[*g as usize].1.push(route);
    }
}

/// A multiplicative hasher for integer keys (session ids): one 64×64→128 multiply.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(self.0 ^ u64::from(b));
        }
    }
    #[inline]
    fn write_u64(&mut self, n: u64) {
        let p = u128::from(n ^ self.0).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
        self.0 = (p as u64) ^ ((p >> 64) as u64);
    }
}

type IdMap<V> = HashMap<SessionId, V, BuildHasherDefault<IdHasher>>;

struct Entry {
    info: SessionInfo,
    state: SessionState,
    /// `mark_active` succeeded: the authority holds the committed route, so a
    /// deactivation must unregister it.
    committed: bool,
    hash_slot: HashSlot,
    uid_prev: u32,
    uid_next: u32,
    /// Links in the dirty set (`Queue::Dirty`) and the rebuild queue
    /// (`Queue::Rebuild`).
    links: [Link; 2],
    /// Last activity second seen by `mark_touched`.
    touched_s: u64,
    /// Registered (pending) under a target a later view moved: queued for rebuild
    /// when it becomes active.
    rebuild_on_active: bool,
    /// The rebuild round whose drain last sent this route (0: none since its last
    /// ordinary touch): a failure of it goes back to the rebuild queue.
    rebuild_round_sent: u32,
}

/// The intrusive FIFO lists an entry can be on (index into `Entry::links`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Queue {
    /// Touched since the last flush (rule 33).
    Dirty = 0,
    /// Waiting to be re-registered at the target a new view gave its hash slot.
    Rebuild = 1,
}

/// An entry's place in one [`Queue`].
#[derive(Clone, Copy, Debug)]
struct Link {
    on: bool,
    prev: u32,
    next: u32,
}

const UNLINKED: Link = Link {
    on: false,
    prev: NIL,
    next: NIL,
};

/// Head, tail and length of one [`Queue`].
#[derive(Clone, Copy, Debug)]
struct Ends {
    head: u32,
    tail: u32,
    len: u32,
}

const EMPTY: Ends = Ends {
    head: NIL,
    tail: NIL,
    len: 0,
};

enum Body {
    Vacant { next_free: u32 },
    Occupied(Entry),
}

struct Slot {
    generation: u32,
    body: Body,
}

struct PendingUnregister {
    identity: RouteIdentity,
    hash_slot: HashSlot,
    owner_seq: OwnerSeq,
    attempt: u32,
    due_ms: u64,
}

/// The sessions of one gateway shard. See the module docs.
pub struct Registry {
    config: RegistryConfig,
    slots: Vec<Slot>,
    free_head: u32,
    len: u32,
    by_session: IdMap<u32>,
    /// uid → head of the intrusive list of that uid's sessions.
    by_uid: HashMap<Uid, u32>,
    /// The dirty set and the rebuild queue, by [`Queue`].
    queues: [Ends; 2],
    rebuild: RebuildState,
    next_owner_seq: OwnerSeq,
    unregisters: VecDeque<PendingUnregister>,
    stats: RegistryStats,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl Registry {
    /// An empty registry. Memory grows with use up to the configured bounds.
    pub fn new(config: RegistryConfig) -> Result<Self, RegistryConfigError> {
        if config.sessions_max == 0 || config.sessions_max == NIL {
            return Err(RegistryConfigError::MaxSessions);
        }
        if config.unregister_attempts_max == 0 {
            return Err(RegistryConfigError::UnregisterMaxAttempts);
        }
        Ok(Registry {
            config,
            slots: Vec::new(),
            free_head: NIL,
            len: 0,
            by_session: IdMap::default(),
            by_uid: HashMap::new(),
            queues: [EMPTY; 2],
            rebuild: RebuildState::default(),
            next_owner_seq: 1,
            unregisters: VecDeque::new(),
            stats: RegistryStats::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RegistryConfig {
        &self.config
    }

    /// Number of sessions (any state).
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// Whether no session is registered.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Counters.
    pub fn stats(&self) -> RegistryStats {
        RegistryStats {
            sessions: self.len,
            dirty: self.queues[Queue::Dirty as usize].len,
            rebuild_queued: self.queues[Queue::Rebuild as usize].len,
            rebuild_last_ms: self.rebuild.last_duration_ms,
            pending_unregisters: self.unregisters.len(),
            ..self.stats
        }
    }

    /// Draws the next owner_seq (monotonic per registry).
    pub fn next_owner_seq(&mut self) -> OwnerSeq {
        let seq = self.next_owner_seq;
        self.next_owner_seq += 1;
        seq
    }

    // ---- sessions -------------------------------------------------------------

    /// Registers a new session as pending, drawing its route owner_seq; `target` is
    /// the authority target its route will be registered under.
    pub fn register_pending(
        &mut self,
        new: NewSession,
        target: Target,
    ) -> Result<SessionHandle, RegisterError> {
        if self.len >= self.config.sessions_max {
            return Err(RegisterError::Full);
        }
        if self.by_session.contains_key(&new.session_id) {
            return Err(RegisterError::DuplicateSession);
        }
        let index = if self.free_head != NIL {
            self.free_head
        } else {
            debug_assert!(self.slots.len() < NIL as usize);
            self.slots.push(Slot {
                generation: 0,
                body: Body::Vacant { next_free: NIL },
            });
            (self.slots.len() - 1) as u32
        };
        let owner_seq = self.next_owner_seq();
        let hash_slot = hash_slot(new.uid.as_bytes());
        let info = SessionInfo {
            uid: new.uid,
            device_id: new.device_id,
            device_flag: new.device_flag,
            device_level: new.device_level,
            session_id: new.session_id,
            boot_id: self.config.boot_id,
            node_id: self.config.node_id,
            listener: new.listener,
            owner_seq,
            connected_at_ms: new.connected_at_ms,
            target,
        };
        // Link at the head of the uid's list.
        let uid_next = match self.by_uid.entry(info.uid.clone()) {
            MapEntry::Occupied(mut e) => std::mem::replace(e.get_mut(), index),
            MapEntry::Vacant(e) => {
                e.insert(index);
                NIL
            }
        };
        if uid_next != NIL {
            if let Some(next) = self.entry_mut(uid_next) {
                next.uid_prev = index;
            }
        }
        let slot = &mut self.slots[index as usize];
        if let Body::Vacant { next_free } = slot.body {
            self.free_head = next_free;
        }
        slot.body = Body::Occupied(Entry {
            info,
            state: SessionState::Pending,
            committed: false,
            hash_slot,
            uid_prev: NIL,
            uid_next,
            links: [UNLINKED; 2],
            touched_s: 0,
            rebuild_on_active: false,
            rebuild_round_sent: 0,
        });
        let generation = slot.generation;
        self.by_session.insert(new.session_id, index);
        self.len += 1;
        Ok(SessionHandle {
            shard: self.config.shard,
            index,
            generation,
        })
    }

    /// Pending → Active: the route is committed at the authority. Fails if the
    /// session is gone or closing (the activation must then unregister the route,
    /// rule 31) or already active. A session whose slot moved while it was pending
    /// ([`Registry::queue_rebuild`]) joins the rebuild queue.
    pub fn mark_active(&mut self, handle: SessionHandle) -> Result<(), Gone> {
        let e = self.get_entry_mut(handle).ok_or(Gone)?;
        if e.state != SessionState::Pending {
            return Err(Gone);
        }
        e.state = SessionState::Active;
        e.committed = true;
        if std::mem::take(&mut e.rebuild_on_active) {
            self.queue_for_rebuild(handle.index);
        }
        Ok(())
    }

    /// Marks the session closing: delivery and touches stop seeing it at once; it
    /// can never become active. The driver then closes it and calls
    /// [`Registry::deactivate`].
    pub fn mark_closing(&mut self, handle: SessionHandle) -> Result<(), Gone> {
        let e = self.get_entry_mut(handle).ok_or(Gone)?;
        e.state = SessionState::Closing;
        let index = handle.index;
        self.unlink(Queue::Dirty, index);
        self.unlink(Queue::Rebuild, index);
        Ok(())
    }

    /// Removes the session locally, nothing else (no authority unregister). Returns
    /// its info, `None` if the handle is stale.
    pub fn unregister(&mut self, handle: SessionHandle) -> Option<SessionInfo> {
        self.remove(handle).map(|(info, _)| info)
    }

    /// Deactivation (rule 32): removes the session locally first (delivery stops
    /// seeing it at once), then, if its route was committed at the authority, queues
    /// the authority unregister with a fresh owner_seq. A pending session's
    /// authority side belongs to its activation (see [`crate::presence::activation`]).
    pub fn deactivate(&mut self, handle: SessionHandle, now_ms: u64) -> Option<SessionInfo> {
        let (info, committed) = self.remove(handle)?;
        if committed {
            // A full queue drops it (counted); the route then expires by TTL.
            let _ = self.queue_unregister(info.identity(), now_ms);
        }
        Some(info)
    }

    /// The session's info, if the handle is live.
    pub fn get(&self, handle: SessionHandle) -> Option<&SessionInfo> {
        self.get_entry(handle).map(|e| &e.info)
    }

    /// The session's state, if the handle is live.
    pub fn state(&self, handle: SessionHandle) -> Option<SessionState> {
        self.get_entry(handle).map(|e| e.state)
    }

    /// Every live session's handle (any state), in slab order.
    pub fn handles(&self) -> impl Iterator<Item = SessionHandle> + '_ {
        let shard = self.config.shard;
        self.slots
            .iter()
            .enumerate()
            .filter_map(move |(i, slot)| match slot.body {
                Body::Occupied(_) => Some(SessionHandle {
                    shard,
                    index: i as u32,
                    generation: slot.generation,
                }),
                Body::Vacant { .. } => None,
            })
    }

    /// The live handle of session `session_id` of this registry.
    pub fn handle_of(&self, session_id: SessionId) -> Option<SessionHandle> {
        let &index = self.by_session.get(&session_id)?;
        Some(SessionHandle {
            shard: self.config.shard,
            index,
            generation: self.slots[index as usize].generation,
        })
    }

    /// The live handle of the route identity `identity`, if it is a session of this
    /// registry (same node, boot id and uid). For owner actions.
    pub fn find(&self, identity: &RouteIdentity) -> Option<SessionHandle> {
        if identity.node_id != self.config.node_id || identity.boot_id != self.config.boot_id {
            return None;
        }
        let handle = self.handle_of(identity.session_id)?;
        let e = self.get_entry(handle)?;
        (*e.info.uid == *identity.uid).then_some(handle)
    }

    /// The sessions of `uid` on this shard (any state), newest first.
    pub fn sessions_of_uid<'a>(&'a self, uid: &str) -> impl Iterator<Item = SessionHandle> + 'a {
        let mut index = self.by_uid.get(uid).copied().unwrap_or(NIL);
        std::iter::from_fn(move || {
            if index == NIL {
                return None;
            }
            let slot = &self.slots[index as usize];
            let Body::Occupied(e) = &slot.body else {
                debug_assert!(false, "uid list reaches a vacant slot");
                return None;
            };
            let handle = SessionHandle {
                shard: self.config.shard,
                index,
                generation: slot.generation,
            };
            index = e.uid_next;
            Some(handle)
        })
    }

    /// Delivery revalidation of an endpoint `(uid, boot_id, session_id, owner_seq)`:
    /// the live **active** session it names, or `None` if stale: another process
    /// (`boot_id`), an unknown, pending or closing session, another uid, or an
    /// `owner_seq` other than the session's route owner_seq (the seq of its
    /// registration, which every endpoint of its route carries). O(1), no allocation.
    #[inline]
    pub fn revalidate(
        &self,
        uid: &str,
        boot_id: BootId,
        session_id: SessionId,
        owner_seq: OwnerSeq,
    ) -> Option<SessionHandle> {
        if boot_id != self.config.boot_id {
            return None;
        }
        let &index = self.by_session.get(&session_id)?;
        let slot = &self.slots[index as usize];
        let Body::Occupied(e) = &slot.body else {
            return None;
        };
        if e.state != SessionState::Active || e.info.owner_seq != owner_seq || *e.info.uid != *uid {
            return None;
        }
        Some(SessionHandle {
            shard: self.config.shard,
            index,
            generation: slot.generation,
        })
    }

    // ---- touches --------------------------------------------------------------

    /// A PING (or any client frame) on an active session: records activity second
    /// `now_s` and marks the session dirty (rule 33: no RPC, no output). Returns
    /// whether the session is active (a pending, closing or gone session is not
    /// touched). O(1), no allocation.
    #[inline]
    pub fn mark_touched(&mut self, handle: SessionHandle, now_s: u64) -> bool {
        let Some(e) = self.get_entry_mut(handle) else {
            return false;
        };
        if e.state != SessionState::Active {
            return false;
        }
        e.touched_s = e.touched_s.max(now_s);
        if !e.links[Queue::Dirty as usize].on {
            self.link(Queue::Dirty, handle.index);
        }
        true
    }

    /// Whether the session is in the dirty set.
    pub fn is_dirty(&self, handle: SessionHandle) -> bool {
        self.get_entry(handle)
            .is_some_and(|e| e.links[Queue::Dirty as usize].on)
    }

    /// Takes up to `batch_routes_max` dirty sessions (oldest first) and groups their
    /// routes by the target **current in `view`** (after a leadership change the
    /// touches go to the new authority and rebuild it, rule 15), in order of first
    /// appearance. The drained sessions are clean afterwards; give failures back with
    /// [`Registry::touch_failed`].
    pub fn drain_touches(
        &mut self,
        view: &ClusterView,
        batch_routes_max: usize,
    ) -> Vec<(Target, Vec<Route>)> {
        let mut batches = Batches::new(usize::MAX);
        let mut taken = 0;
        while taken < batch_routes_max && self.queues[Queue::Dirty as usize].head != NIL {
            let index = self.queues[Queue::Dirty as usize].head;
            self.unlink(Queue::Dirty, index);
            let Some(e) = self.entry_mut(index) else {
                debug_assert!(false, "dirty list reaches a vacant slot");
                break;
            };
            debug_assert_eq!(e.state, SessionState::Active);
            // An ordinary touch carries the route from now on: its failure goes
            // back to the dirty set.
            e.rebuild_round_sent = 0;
            let route = e.info.route(Some(e.touched_s));
            batches.push(view, e.hash_slot, route);
            taken += 1;
        }
        batches.out
    }

    /// Touches of `routes` sent to `target` failed: each is put back only if it is
    /// still **current**: the session it names (node id, boot id, session id, uid)
    /// is live and active and its route owner_seq equals the route's. Others are
    /// dropped. A route last sent by the latest rebuild round
    /// ([`Registry::drain_rebuild`]) goes back to the rebuild queue (the round is
    /// open again until it is drained), any other to the dirty set. The requeued
    /// activity is the newer of the failed one and any touch since.
    pub fn touch_failed(&mut self, target: Target, routes: &[Route]) {
        for route in routes {
            let current = self.current_index(route);
            let Some(index) = current else {
                self.stats.touches_dropped_stale += 1;
                tracing::trace!(
                    ?target,
                    session_id = route.session_id,
                    "stale touch dropped"
                );
                continue;
            };
            let round = self.rebuild.round;
            let Some(e) = self.entry_mut(index) else {
                continue;
            };
            e.touched_s = e.touched_s.max(route.last_active_s.unwrap_or(0));
            if round != 0 && e.rebuild_round_sent == round {
                e.rebuild_round_sent = 0;
                self.queue_for_rebuild(index);
                self.stats.rebuild_requeued += 1;
                continue;
            }
            if !e.links[Queue::Dirty as usize].on {
                self.link(Queue::Dirty, index);
            }
            self.stats.touches_requeued += 1;
        }
    }

    /// The authority refused `routes` for good (a newer registration of the
    /// identity, or an unregister at or above it: `TouchAnswer::superseded`).
    /// Returns the sessions among them that are still **current** (as in
    /// [`Registry::touch_failed`]): no longer routed, they would stay connected and
    /// receive nothing, so the driver deactivates each, sends DISCONNECT and closes
    /// it. Routes of sessions gone or changed since are ignored.
    pub fn superseded(&mut self, routes: &[Route]) -> Vec<SessionHandle> {
        let mut out = Vec::new();
        for route in routes {
            if let Some(index) = self.current_index(route) {
                self.stats.sessions_superseded += 1;
                out.push(SessionHandle {
                    shard: self.config.shard,
                    index,
                    generation: self.slots[index as usize].generation,
                });
            }
        }
        out
    }

    fn current_index(&self, route: &Route) -> Option<u32> {
        if route.node_id != self.config.node_id || route.boot_id != self.config.boot_id {
            return None;
        }
        let &index = self.by_session.get(&route.session_id)?;
        let e = self.entry(index)?;
        (e.state == SessionState::Active
            && e.info.owner_seq == route.owner_seq
            && e.info.uid == route.uid)
            .then_some(index)
    }

    // ---- route rebuild after a view change ---------------------------------------

    /// A new cluster view arrived at `now_ms` (the shard's clock); `old` is the view
    /// this shard held before. Every **active** session whose hash slot's target
    /// differs between the two (leader node, term, slot id or config epoch: the slot
    /// moved, and the new authority's directory does not hold its route) is queued
    /// for re-registration at the new target ([`Registry::drain_rebuild`]); a session
    /// already queued keeps its place. A **pending** session registered under a
    /// target other than the new one is queued when it becomes active
    /// ([`Registry::mark_active`]): its activation may still commit at the old
    /// authority, which has dropped the slot. Returns how many were queued now.
    ///
    /// A rebuild round opens here (if one is not open yet): its duration runs from
    /// this `now_ms` until a drain finds the queue empty
    /// ([`RegistryStats::rebuild_last_ms`]). Costs one pass over the sessions (no
    /// allocation) when a slot moved, nothing otherwise.
    pub fn queue_rebuild(&mut self, old: &ClusterView, new: &ClusterView, now_ms: u64) -> usize {
        let mut moved = [false; HASH_SLOTS];
        let mut any = false;
        for (hs, m) in moved.iter_mut().enumerate() {
            *m = old.target_for_slot(hs as HashSlot) != new.target_for_slot(hs as HashSlot);
            any |= *m;
        }
        if !any {
            return 0;
        }
        self.rebuild.round = self.rebuild.round.wrapping_add(1).max(1);
        let mut queued = 0;
        for index in 0..self.slots.len() as u32 {
            let Some(e) = self.entry_mut(index) else {
                continue;
            };
            match e.state {
                SessionState::Active
                    if moved[e.hash_slot as usize] && !e.links[Queue::Rebuild as usize].on =>
                {
                    self.link(Queue::Rebuild, index);
                    queued += 1;
                }
                SessionState::Pending if e.info.target != new.target_for_slot(e.hash_slot) => {
                    e.rebuild_on_active = true;
                }
                _ => {}
            }
        }
        if self.rebuild.since_ms.is_none() {
            self.rebuild.view_ms = now_ms;
            if self.queues[Queue::Rebuild as usize].len > 0 {
                self.rebuild.since_ms = Some(now_ms);
            }
        }
        queued
    }

    /// Takes the routes to re-register now, at most what the token bucket of
    /// `limits` allows at `now_ms` (`routes_per_s`, up to `burst_routes` at once;
    /// full when the first drain comes), oldest first, grouped by the target
    /// **current in `view`** into TouchRoutes batches of at most
    /// `batch_routes_max` (the authority recreates a missing route that conflicts
    /// with nothing, rule 15). Each route carries activity `now_ms / 1000`: its
    /// session is live on this shard, so the route's TTL at the new authority starts
    /// now. Give failures back with [`Registry::touch_failed`]. A drain that finds
    /// the queue empty closes the open round (its duration is recorded).
    pub fn drain_rebuild(
        &mut self,
        view: &ClusterView,
        now_ms: u64,
        limits: &RebuildLimits,
    ) -> Vec<(Target, Vec<Route>)> {
        let allowed =
            self.rebuild
                .take_tokens(now_ms, limits, self.queues[Queue::Rebuild as usize].len);
        let mut batches = Batches::new(limits.batch_routes_max.max(1));
        let round = self.rebuild.round;
        for _ in 0..allowed {
            let index = self.queues[Queue::Rebuild as usize].head;
            self.unlink(Queue::Rebuild, index);
            let Some(e) = self.entry_mut(index) else {
                debug_assert!(false, "rebuild queue reaches a vacant slot");
                break;
            };
            debug_assert_eq!(e.state, SessionState::Active);
            e.rebuild_round_sent = round;
            let route = e.info.route(Some(now_ms / 1000));
            batches.push(view, e.hash_slot, route);
        }
        self.stats.routes_rebuilt += u64::from(allowed);
        if self.queues[Queue::Rebuild as usize].len == 0 {
            if let Some(since) = self.rebuild.since_ms.take() {
                self.rebuild.last_duration_ms = Some(now_ms.saturating_sub(since));
            }
        }
        batches.out
    }

    /// Routes waiting in the rebuild queue.
    pub fn rebuild_queued(&self) -> usize {
        self.queues[Queue::Rebuild as usize].len as usize
    }

    /// Whether the session waits in the rebuild queue.
    pub fn is_queued_for_rebuild(&self, handle: SessionHandle) -> bool {
        self.get_entry(handle)
            .is_some_and(|e| e.links[Queue::Rebuild as usize].on)
    }

    /// Puts entry `index` (active) on the rebuild queue if it is not on it, and
    /// reopens the round of the latest view if it was closed.
    fn queue_for_rebuild(&mut self, index: u32) {
        let on = self
            .entry(index)
            .is_some_and(|e| e.links[Queue::Rebuild as usize].on);
        if !on {
            self.link(Queue::Rebuild, index);
        }
        if self.rebuild.since_ms.is_none() {
            self.rebuild.since_ms = Some(self.rebuild.view_ms);
        }
    }

    // ---- authority unregisters ------------------------------------------------

    /// Queues an authority unregister of `identity` with a fresh owner_seq (above the
    /// route owner_seq of every session registered so far), due at once. Returns the
    /// seq, or [`UnregisterQueueFull`] (dropped, counted).
    pub fn queue_unregister(
        &mut self,
        identity: RouteIdentity,
        now_ms: u64,
    ) -> Result<OwnerSeq, UnregisterQueueFull> {
        if self.unregisters.len() >= self.config.pending_unregisters_max {
            self.stats.unregisters_dropped_full += 1;
            tracing::warn!(uid = %identity.uid, "pending-unregister queue full, dropped");
            return Err(UnregisterQueueFull);
        }
        let owner_seq = self.next_owner_seq();
        let hash_slot = hash_slot(identity.uid.as_bytes());
        self.unregisters.push_back(PendingUnregister {
            identity,
            hash_slot,
            owner_seq,
            attempt: 0,
            due_ms: now_ms,
        });
        Ok(owner_seq)
    }

    /// Number of unregisters waiting (due or backing off).
    pub fn pending_unregisters(&self) -> usize {
        self.unregisters.len()
    }

    /// Whether an unregister of `identity` is waiting in the queue.
    pub fn has_pending_unregister(&self, identity: &RouteIdentity) -> bool {
        self.unregisters.iter().any(|u| u.identity == *identity)
    }

    /// Takes up to `requests_max` unregisters due at `now_ms` (queue order), each with
    /// the target current in `view`. Report a failed send with
    /// [`Registry::unregister_failed`]; a success needs no call.
    pub fn drain_unregisters(
        &mut self,
        view: &ClusterView,
        now_ms: u64,
        requests_max: usize,
    ) -> Vec<UnregisterRequest> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.unregisters.len() && out.len() < requests_max {
            if self.unregisters[i].due_ms > now_ms {
                i += 1;
                continue;
            }
            let Some(u) = self.unregisters.remove(i) else {
                break;
            };
            out.push(UnregisterRequest {
                target: view.target_for_slot(u.hash_slot),
                identity: u.identity,
                owner_seq: u.owner_seq,
                attempt: u.attempt,
            });
        }
        out
    }

    /// The send of `request` failed at `now_ms`: requeued with backoff (same
    /// owner_seq; the target is taken afresh at the next drain), or abandoned after
    /// `unregister_attempts_max` attempts (counted; the route then expires by TTL).
    pub fn unregister_failed(&mut self, request: UnregisterRequest, now_ms: u64) {
        let attempts = request.attempt.saturating_add(1);
        if attempts >= self.config.unregister_attempts_max {
            self.stats.unregisters_abandoned += 1;
            tracing::warn!(uid = %request.identity.uid, attempts, "authority unregister abandoned");
            return;
        }
        if self.unregisters.len() >= self.config.pending_unregisters_max {
            self.stats.unregisters_dropped_full += 1;
            return;
        }
        let shift = (attempts - 1).min(32);
        let backoff_ms = self
            .config
            .unregister_retry_base_ms
            .saturating_mul(1u64 << shift)
            .min(self.config.unregister_retry_ms_max);
        self.unregisters.push_back(PendingUnregister {
            hash_slot: request.target.hash_slot,
            identity: request.identity,
            owner_seq: request.owner_seq,
            attempt: attempts,
            due_ms: now_ms.saturating_add(backoff_ms),
        });
    }

    // ---- internals ------------------------------------------------------------

    #[inline]
    fn get_entry(&self, handle: SessionHandle) -> Option<&Entry> {
        if handle.shard != self.config.shard {
            return None;
        }
        let slot = self.slots.get(handle.index as usize)?;
        match &slot.body {
            Body::Occupied(e) if slot.generation == handle.generation => Some(e),
            _ => None,
        }
    }

    #[inline]
    fn get_entry_mut(&mut self, handle: SessionHandle) -> Option<&mut Entry> {
        if handle.shard != self.config.shard {
            return None;
        }
        let slot = self.slots.get_mut(handle.index as usize)?;
        match &mut slot.body {
            Body::Occupied(e) if slot.generation == handle.generation => Some(e),
            _ => None,
        }
    }

    #[inline]
    fn entry(&self, index: u32) -> Option<&Entry> {
        match &self.slots.get(index as usize)?.body {
            Body::Occupied(e) => Some(e),
            Body::Vacant { .. } => None,
        }
    }

    #[inline]
    fn entry_mut(&mut self, index: u32) -> Option<&mut Entry> {
        match &mut self.slots.get_mut(index as usize)?.body {
            Body::Occupied(e) => Some(e),
            Body::Vacant { .. } => None,
        }
    }

    fn remove(&mut self, handle: SessionHandle) -> Option<(SessionInfo, bool)> {
        self.get_entry(handle)?;
        let index = handle.index;
        self.unlink(Queue::Dirty, index);
        self.unlink(Queue::Rebuild, index);
        let slot = &mut self.slots[index as usize];
        let body = std::mem::replace(
            &mut slot.body,
            Body::Vacant {
                next_free: self.free_head,
            },
        );
        slot.generation = slot.generation.wrapping_add(1);
        self.free_head = index;
        self.len -= 1;
        let Body::Occupied(e) = body else {
            unreachable!("checked occupied above");
        };
        // Unlink from the uid list.
        if e.uid_prev != NIL {
            if let Some(p) = self.entry_mut(e.uid_prev) {
                p.uid_next = e.uid_next;
            }
        } else if e.uid_next != NIL {
            if let Some(h) = self.by_uid.get_mut(&*e.info.uid) {
                *h = e.uid_next;
            }
        } else {
            self.by_uid.remove(&*e.info.uid);
        }
        if e.uid_next != NIL {
            if let Some(n) = self.entry_mut(e.uid_next) {
                n.uid_prev = e.uid_prev;
            }
        }
        self.by_session.remove(&e.info.session_id);
        Some((e.info, e.committed))
    }

    /// Appends entry `index` to queue `q` (it must not be on it).
    fn link(&mut self, q: Queue, index: u32) {
        let k = q as usize;
        let tail = self.queues[k].tail;
        if let Some(e) = self.entry_mut(index) {
            debug_assert!(!e.links[k].on);
            e.links[k] = Link {
                on: true,
                prev: tail,
                next: NIL,
            };
        } else {
            return;
        }
        if tail == NIL {
            self.queues[k].head = index;
        } else if let Some(t) = self.entry_mut(tail) {
            t.links[k].next = index;
        }
        self.queues[k].tail = index;
        self.queues[k].len += 1;
        debug_assert!(self.queues[k].len <= self.len);
    }

    /// Takes entry `index` off queue `q` (nothing if it is not on it).
    fn unlink(&mut self, q: Queue, index: u32) {
        let k = q as usize;
        let (prev, next) = match self.entry_mut(index) {
            Some(e) if e.links[k].on => {
                let l = std::mem::replace(&mut e.links[k], UNLINKED);
                (l.prev, l.next)
            }
            _ => return,
        };
        if prev == NIL {
            self.queues[k].head = next;
        } else if let Some(p) = self.entry_mut(prev) {
            p.links[k].next = next;
        }
        if next == NIL {
            self.queues[k].tail = prev;
        } else if let Some(n) = self.entry_mut(next) {
            n.links[k].prev = prev;
        }
        self.queues[k].len -= 1;
    }
}
