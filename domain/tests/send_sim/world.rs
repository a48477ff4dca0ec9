//! The simulated world around one commit core: the groups, the owner shards with
//! their registries and sessions, the directory the planner looks endpoints up in
//! (this node's authority, and the fake remote node's, which answers `Lookup`s as
//! events), the network between the core and the owners, the clients, and the
//! events in flight. Every decision is drawn from one `StdRng`; time is virtual.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;
use std::rc::Rc;
use std::sync::Arc;

use domain::cluster::{ClusterView, NodeId, Target};
use domain::presence::registry::{NewSession, Registry, RegistryConfig, SessionHandle};
use domain::presence::route::{AuthorityError, DeviceLevel, Endpoint, SessionId, Transport, Uid};
use domain::send::acks::{AckLimits, PendingAcks, Tracked};
use domain::send::channel::{Channel, Subscribers};
use domain::send::commit::{
    CommitCore, CommitLimits, CommitOutput, CommitRequest, Committed, Committing, Groups, Now,
};
use domain::send::delivery::{
    session_id, session_shard, EndpointLookup, Lookup, LookupFailure, LookupReply, PlanLimits,
    PlanOutput, Push, PushTo,
};
use domain::send::idempotency::{IdempotencyConfig, IdempotencyWindow, SentIds};
use domain::send::idgen::MessageIdGen;
use proto::wkproto::{Flags, ReasonCode};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use slots::ShardId;

use super::log::{FakeLog, Store};

pub const NODE: NodeId = 1;
/// The fake remote node that leads part of the hash slots (the authority of their
/// uids; their sessions are still owned here).
pub const REMOTE: NodeId = 2;
/// The driver's deadline for a remote lookup: a failure is synthesized then.
const LOOKUP_DEADLINE_MS: u64 = 40;
pub const BOOT: u64 = 7;
/// Owner shards; shard `ME` is also the commit core's (its pushes skip the network).
pub const OWNERS: usize = 3;
pub const ME: ShardId = 0;
const UIDS: usize = 6;
const GROUPS: usize = 3;
/// Live sessions at most (a connect past it is skipped).
const SESSIONS_MAX: usize = 16;
/// The interval policy's sync timer.
const SYNC_INTERVAL_MS: u64 = 15;
const PAYLOAD_MAX: usize = 300;
/// The largest charge a request of this simulation can have (`commit::charge_bytes`).
pub const CHARGE_MAX: usize = 1024 + PAYLOAD_MAX + 16 + 4;
/// The wall clock at virtual time 0.
const WALL_BASE_MS: u64 = 1_800_000_000_000;
const IDEMPOTENCY: IdempotencyConfig = IdempotencyConfig {
    entries_max: 1 << 20,
    ttl_s: 1 << 30,
    budget_bytes: 1 << 30,
};

/// Planted bugs: the simulation must catch each.
#[derive(Clone, Copy, Debug, Default)]
pub struct Bugs {
    /// The log's crash also loses the newest synced record.
    pub crash_drops_synced: bool,
    /// The owner writes RECV to every pushed endpoint without `Registry::revalidate`.
    pub skip_revalidation: bool,
    /// A route becomes visible to lookups only after its session is active (and
    /// has read the log): the race of issue 18 item 2 left open.
    pub route_after_active: bool,
    /// A restarted core starts with an empty idempotency window (no refill).
    pub no_refill: bool,
    /// The network drops pushes without counting them.
    pub silent_drop: bool,
    /// A remote lookup that failed as a whole is not reported (its recipients are
    /// not counted as failed groups by the world).
    pub unreported_lookup_failure: bool,
    /// The pushes of one pump are carried newest first: a later page's (or later
    /// message's) RECVs leave before an earlier one's, as they would from a planner
    /// that emits a page before the pages ahead of it are complete and pushed.
    pub unordered_pages: bool,
}

/// One seed's configuration, drawn from the seed.
#[derive(Clone, Copy, Debug)]
pub struct Params {
    pub steps: usize,
    pub drop_permille: u32,
    pub sync_fail_permille: u32,
    pub restart_permille: u32,
    pub lookup_fail_permille: u32,
    /// Hash slots led by [`REMOTE`].
    pub remote_share_permille: u32,
    /// Remote lookups failed at the deadline (then maybe answered late).
    pub remote_fail_permille: u32,
    /// Remote lookups lost (the peer restarted): failed when the driver learns it.
    pub remote_lost_permille: u32,
    pub ring_cap: usize,
    pub commit: CommitLimits,
    pub plan: PlanLimits,
    pub acks: AckLimits,
}

impl Params {
    fn random(rng: &mut StdRng, always: Option<bool>) -> Params {
        let ring_cap = rng.gen_range(2..=8);
        let pick = |rng: &mut StdRng, v: &[u32]| v[rng.gen_range(0..v.len())];
        Params {
            steps: 300,
            drop_permille: pick(rng, &[0, 30, 150]),
            sync_fail_permille: pick(rng, &[0, 0, 40]),
            restart_permille: pick(rng, &[0, 8, 25]),
            lookup_fail_permille: pick(rng, &[0, 0, 20]),
            remote_share_permille: pick(rng, &[0, 300, 700]),
            remote_fail_permille: pick(rng, &[0, 50, 150]),
            remote_lost_permille: pick(rng, &[0, 0, 50]),
            ring_cap,
            commit: CommitLimits {
                answer_after_sync: always.unwrap_or_else(|| rng.gen_bool(0.5)),
                commits_unsynced_max: rng.gen_range(2..=16),
                delivery_backlog_max: rng.gen_range(2..=32),
                backlog_budget_bytes: rng.gen_range(CHARGE_MAX..=16 * CHARGE_MAX),
                redeliver_messages_max: 64,
            },
            plan: PlanLimits {
                local_node: NODE,
                me: ME,
                shard_count: OWNERS as ShardId,
                subscriber_page_max: rng.gen_range(1..=4),
                push_batch_max: rng.gen_range(1..=4),
                pages_per_turn_max: rng.gen_range(1..=4),
                reserved_room_per_peer: rng.gen_range(0..=(ring_cap - 1).min(2)),
                offline_uids: false,
                offline_room: true,
                lookup_retries_max: 2,
                rebuild_retry_interval_ms: 20,
                rebuild_wait_ms_max: 3_000,
                lookup_pages_in_flight_max: rng.gen_range(1..=8),
            },
            acks: AckLimits {
                per_session_max: rng.gen_range(2..=16),
                shard_budget_bytes: rng.gen_range(2_000..=40_000),
                timeout_ms: rng.gen_range(10..=60),
                resends_max: rng.gen_range(0..=2),
            },
        }
    }
}

/// What the runs exercised (summed over seeds; each must be non-zero over a full
/// run, so no check passes vacuously).
#[derive(Clone, Copy, Debug, Default)]
pub struct Seen {
    pub committed: u64,
    pub deduplicated: u64,
    pub refused_backlog: u64,
    pub refused_system: u64,
    pub sync_failures: u64,
    pub restarts: u64,
    pub recvs: u64,
    pub dup_recvs: u64,
    pub acked: u64,
    pub expired: u64,
    pub untracked: u64,
    pub dropped: u64,
    pub stale: u64,
    pub stalls: u64,
    pub failed_lookups: u64,
    pub crash_lost: u64,
    /// Sessions activated while a message committed that found it by reading the log.
    pub race_synced: u64,
    /// ... and that got its RECV.
    pub race_recv: u64,
    /// (message, session) pairs checked by invariants 5 and 6.
    pub pairs: u64,
    /// Resends of a message recovered from the log at start, delivered with them
    /// (`Committing::Recovered`).
    pub recovered: u64,
    /// Lookups sent to the remote authority.
    pub remote_lookups: u64,
    /// ... that failed as a whole (deadline, restarted peer).
    pub remote_failed: u64,
    /// ... whose reply came after the deadline's failure (ignored).
    pub late_replies: u64,
    /// Lookup replies (or failures) that reached the core while an older lookup
    /// of the same core still waited.
    pub reordered_replies: u64,
    /// Pumps that left two pages or more in flight.
    pub pipelined: u64,
    /// (session, channel) pushes checked by invariant 8.
    pub ordered_pushes: u64,
}

impl Seen {
    pub fn add(&mut self, o: &Seen) {
        let (a, b) = (self.fields_mut(), o.fields());
        for (x, y) in a.into_iter().zip(b) {
            *x += y;
        }
    }

    fn fields(&self) -> [u64; 26] {
        let mut c = *self;
        c.fields_mut().map(|x| *x)
    }

    fn fields_mut(&mut self) -> [&mut u64; 26] {
        [
            &mut self.committed,
            &mut self.deduplicated,
            &mut self.refused_backlog,
            &mut self.refused_system,
            &mut self.sync_failures,
            &mut self.restarts,
            &mut self.recvs,
            &mut self.dup_recvs,
            &mut self.acked,
            &mut self.expired,
            &mut self.untracked,
            &mut self.dropped,
            &mut self.stale,
            &mut self.stalls,
            &mut self.failed_lookups,
            &mut self.crash_lost,
            &mut self.race_synced,
            &mut self.race_recv,
            &mut self.pairs,
            &mut self.recovered,
            &mut self.remote_lookups,
            &mut self.remote_failed,
            &mut self.late_replies,
            &mut self.reordered_replies,
            &mut self.pipelined,
            &mut self.ordered_pushes,
        ]
    }

    /// The counters that stayed zero.
    pub fn zeros(&self) -> Vec<&'static str> {
        const NAMES: [&str; 26] = [
            "committed",
            "deduplicated",
            "refused_backlog",
            "refused_system",
            "sync_failures",
            "restarts",
            "recvs",
            "dup_recvs",
            "acked",
            "expired",
            "untracked",
            "dropped",
            "stale",
            "stalls",
            "failed_lookups",
            "crash_lost",
            "race_synced",
            "race_recv",
            "pairs",
            "recovered",
            "remote_lookups",
            "remote_failed",
            "late_replies",
            "reordered_replies",
            "pipelined",
            "ordered_pushes",
        ];
        NAMES
            .iter()
            .zip(self.fields())
            .filter(|(_, v)| *v == 0)
            .map(|(n, _)| *n)
            .collect()
    }
}

struct SimGroups(HashMap<String, Arc<Subscribers>>);

impl Groups for SimGroups {
    fn subscribers(&self, id: &str) -> Option<Arc<Subscribers>> {
        self.0.get(id).cloned()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Life {
    Pending,
    Active,
    Gone,
}

pub struct Session {
    pub uid: Uid,
    pub shard: usize,
    pub id: SessionId,
    handle: SessionHandle,
    pub life: Life,
    pub active_at: u64,
    /// When its route became visible to lookups (the authority's commit).
    pub routed_at: u64,
    /// The log ordinal its `messagesync` read up to when it became active.
    pub sync_ordinal: u64,
    ack_permille: u32,
    pub pending: PendingAcks<Arc<Committed>>,
    /// RECVs tracked, RECVACKs matched, entries expired or cleared.
    pub tracked: u64,
    pub acked: u64,
    pub expired: u64,
}

/// A route as the directory (the authority's published table) shows it.
struct DirEntry {
    ep: Endpoint,
    visible_at: u64,
    hidden_at: u64,
}

/// The planner's lookups, answered from the directory at `now`: a route shows from
/// its authority commit (before the owner marks its session active) until its
/// unregister lands (after the owner forgot the session): deactivation lags.
///
/// A group's lookup fails now and then, for good (refused `Full`: the authority's
/// lookup budget): its recipients are reported (`PlanCounts::failed_groups`) and
/// recover by sync. (A stale target or not-leader refusal is asked again while
/// views converge; the cluster simulation moves slots, this one does not.)
struct DirLookup<'a> {
    dir: &'a [DirEntry],
    now: u64,
    rng: &'a mut StdRng,
    fail_permille: u32,
    /// The uids of the groups failed in this call.
    failed: Vec<Uid>,
    failed_groups: u64,
}

impl EndpointLookup for DirLookup<'_> {
    fn endpoints_by_targets_into(
        &mut self,
        lookups: &[(Target, &[Uid])],
        endpoints: &mut Vec<Endpoint>,
        results: &mut Vec<Result<Range<usize>, AuthorityError>>,
    ) {
        for (_, uids) in lookups {
            if self.rng.gen_range(0..1000) < self.fail_permille {
                self.failed.extend(uids.iter().cloned());
                self.failed_groups += 1;
                results.push(Err(AuthorityError::Full));
                continue;
            }
            let start = endpoints.len();
            for uid in *uids {
                endpoints.extend(
                    self.dir
                        .iter()
                        .filter(|e| e.ep.uid == *uid)
                        .filter(|e| e.visible_at <= self.now && self.now < e.hidden_at)
                        .map(|e| e.ep.clone()),
                );
            }
            results.push(Ok(start..endpoints.len()));
        }
    }
}

/// One SEND (or API send) and what became of it.
#[derive(Clone)]
pub struct Req {
    pub from_uid: Uid,
    /// The sending session (`None`: the HTTP API).
    pub sender: Option<usize>,
    pub channel: Channel,
    pub client_msg_no: String,
    pub flags: u8,
    payload_len: usize,
    pub epoch: u32,
    pub kind: Option<Committing>,
    pub appended_at: u64,
    pub ordinal: Option<u64>,
    pub answers: u32,
    pub answer: Option<(ReasonCode, i64, u64)>,
    /// Unanswered when its core crashed or stopped (the client saw its connection
    /// to the commit shard fail).
    pub lost: bool,
}

impl Req {
    pub fn persisted(&self) -> bool {
        self.flags & Flags::NO_PERSIST.0 == 0
    }
}

/// A message answered with success.
pub struct MsgInfo {
    pub req: usize,
    pub appended_at: u64,
    pub ordinal: Option<u64>,
    pub recipients: Vec<Uid>,
    pub sender: Option<usize>,
    /// Its delivery was still in the core when the core crashed or stopped.
    pub crash_lost: bool,
    /// Lost from the log by a crash (only under the interval policy).
    pub lost: bool,
    /// First answered with success to a resend, from the idempotency window a
    /// restart refilled: its first copy was never answered with success (refused
    /// by a failed sync, or in flight at a crash) and its record survived.
    pub resend_only: bool,
}

pub enum Ev {
    Activate(usize),
    Push {
        shard: usize,
        message: Arc<Committed>,
        endpoints: Vec<Endpoint>,
    },
    AckTimer(usize),
    ClientAck(usize, i64),
    SyncDone {
        epoch: u32,
        ok: bool,
    },
    SyncTimer,
    /// The remote authority's reply to a lookup (`None`: found, evaluated on the
    /// directory now), or the driver's failure for it; `late`: a reply after that
    /// failure, which the planner must ignore.
    LookupReply {
        epoch: u32,
        lookup: Lookup,
        failure: Option<LookupFailure>,
        late: bool,
    },
}

pub struct Sim {
    pub rng: StdRng,
    pub p: Params,
    pub bugs: Bugs,
    pub now: u64,
    pub chaos: bool,
    view: ClusterView,
    groups: SimGroups,
    uids: Vec<Uid>,
    pub store: Rc<RefCell<Store>>,
    pub core: CommitCore<FakeLog, usize>,
    pub epoch: u32,
    registries: Vec<Registry>,
    owner_bytes: Vec<usize>,
    in_flight: Vec<usize>,
    pub sessions: Vec<Session>,
    by_id: HashMap<SessionId, usize>,
    directory: Vec<DirEntry>,
    events: BTreeMap<(u64, u64), Ev>,
    event_seq: u64,
    pub reqs: Vec<Req>,
    pub msgs: HashMap<i64, MsgInfo>,
    /// This epoch's new messages in the order they were queued for delivery.
    delivery_order: Vec<i64>,
    next_cmn: u64,
    pub recv: HashSet<(i64, usize)>,
    pub acked: HashSet<(i64, usize)>,
    pub untracked: HashSet<(i64, usize)>,
    pub dropped: HashSet<(i64, usize)>,
    /// Pairs whose lookup may have failed (any of the messages a failing call planned).
    pub failed_lookup: HashSet<(i64, usize)>,
    /// Invariant 8: per (session, channel), the seq of the last message this core
    /// pushed there.
    pushed_seq: HashMap<(usize, u8, String), u64>,
    /// Messages this core delivers again with a resend (`Committing::Recovered`):
    /// older than its new ones, outside invariant 8.
    recovered_ids: HashSet<i64>,
    /// This core's lookups not yet answered (or failed).
    awaited_lookups: std::collections::BTreeSet<u64>,
    /// Per channel, the epoch and seq of the last new message answered.
    answered_seq: HashMap<String, (u32, u64)>,
    /// Group failures the world injected (local and remote) and lookup replies it
    /// expects ignored; the planner's counts must match them.
    expected: PlanTally,
    counted: PlanTally,
    pub seen: Seen,
}

/// The planner's failure counts, as the world expects or the planner reported them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct PlanTally {
    failed_groups: u64,
    ignored_replies: u64,
}

fn err<T>(msg: String) -> Result<T, String> {
    Err(msg)
}

impl Sim {
    pub fn new(seed: u64, bugs: Bugs, always: Option<bool>) -> Sim {
        let mut rng = StdRng::seed_from_u64(seed);
        let p = Params::random(&mut rng, always);
        let uids: Vec<Uid> = (0..UIDS).map(|i| Uid::from(format!("u{i}"))).collect();
        let mut groups = HashMap::new();
        for g in 0..GROUPS {
            let mut members: Vec<Uid> =
                uids.iter().filter(|_| rng.gen_bool(0.6)).cloned().collect();
            if members.is_empty() {
                members.push(uids[g].clone());
            }
            members.sort();
            groups.insert(format!("g{g}"), Arc::new(Subscribers::new(members)));
        }
        let registries = (0..OWNERS)
            .map(|s| Registry::new(RegistryConfig::new(s as u16, NODE, BOOT)).unwrap())
            .collect();
        let store = Rc::new(RefCell::new(Store {
            bug_crash_drops_synced: bugs.crash_drops_synced,
            ..Store::default()
        }));
        let core = CommitCore::new(FakeLog(store.clone()), new_ids(), window(), p.commit);
        let view = view(&mut rng, p.remote_share_permille);
        let mut sim = Sim {
            rng,
            p,
            bugs,
            now: 0,
            chaos: true,
            view,
            groups: SimGroups(groups),
            uids,
            store,
            core,
            epoch: 0,
            registries,
            owner_bytes: vec![0; OWNERS],
            in_flight: vec![0; OWNERS],
            sessions: Vec::new(),
            by_id: HashMap::new(),
            directory: Vec::new(),
            events: BTreeMap::new(),
            event_seq: 0,
            reqs: Vec::new(),
            msgs: HashMap::new(),
            delivery_order: Vec::new(),
            next_cmn: 0,
            recv: HashSet::new(),
            acked: HashSet::new(),
            untracked: HashSet::new(),
            dropped: HashSet::new(),
            failed_lookup: HashSet::new(),
            pushed_seq: HashMap::new(),
            recovered_ids: HashSet::new(),
            awaited_lookups: std::collections::BTreeSet::new(),
            answered_seq: HashMap::new(),
            expected: PlanTally::default(),
            counted: PlanTally::default(),
            seen: Seen::default(),
        };
        if !p.commit.answer_after_sync {
            sim.schedule(SYNC_INTERVAL_MS, Ev::SyncTimer);
        }
        sim
    }

    pub fn always(&self) -> bool {
        self.p.commit.answer_after_sync
    }

    fn time(&self) -> Now {
        Now {
            wall_ms: WALL_BASE_MS + self.now,
            mono_ns: self.now * 1_000_000,
        }
    }

    fn schedule(&mut self, after_ms: u64, ev: Ev) {
        self.event_seq += 1;
        self.events
            .insert((self.now + after_ms, self.event_seq), ev);
    }

    fn roll(&mut self, permille: u32) -> bool {
        self.rng.gen_range(0..1000) < permille
    }

    /// One loop turn of the world: time passes, due events run, clients connect,
    /// leave and send, the core may restart, then the core's turn ends and it
    /// delivers. Invariant 7 is checked after every turn.
    pub fn step(&mut self) -> Result<(), String> {
        self.now += self.rng.gen_range(1..=5);
        self.run_due_events()?;
        if self.store.borrow().poisoned {
            // The shard reports itself unhealthy; the operator restarts it.
            let graceful = self.rng.gen_bool(0.5);
            self.restart(graceful)?;
        }
        if self.chaos {
            self.chaos_step()?;
            for _ in 0..self.rng.gen_range(0..=3) {
                self.send_one()?;
            }
        }
        let mut out = Vec::new();
        self.core.end_turn(&mut out);
        self.carry(out)?;
        self.pump()?;
        self.check_bounds()
    }

    fn chaos_step(&mut self) -> Result<(), String> {
        let live = self
            .sessions
            .iter()
            .filter(|s| s.life != Life::Gone)
            .count();
        let roll = self.rng.gen_range(0..1000);
        if roll < 60 && live < SESSIONS_MAX {
            self.connect()
        } else if (60..90).contains(&roll) && live > 0 {
            let pick = self.rng.gen_range(0..live);
            let s = (0..self.sessions.len())
                .filter(|&s| self.sessions[s].life != Life::Gone)
                .nth(pick)
                .unwrap();
            self.disconnect(s);
            Ok(())
        } else if roll >= 1000 - self.p.restart_permille {
            let graceful = self.rng.gen_bool(0.5);
            self.restart(graceful)
        } else {
            Ok(())
        }
    }

    /// Invariant 7: the core's bounds.
    fn check_bounds(&self) -> Result<(), String> {
        let (c, l) = (&self.core, &self.p.commit);
        if c.backlog_len() > l.delivery_backlog_max {
            return err(format!(
                "inv7: backlog_len {} > delivery_backlog_max {}",
                c.backlog_len(),
                l.delivery_backlog_max
            ));
        }
        if c.backlog_bytes() > l.backlog_budget_bytes + CHARGE_MAX {
            return err(format!(
                "inv7: backlog_bytes {} > budget {} + a charge",
                c.backlog_bytes(),
                l.backlog_budget_bytes
            ));
        }
        if c.unanswered() > l.commits_unsynced_max {
            return err(format!(
                "inv7: {} unanswered > commits_unsynced_max {}",
                c.unanswered(),
                l.commits_unsynced_max
            ));
        }
        match self
            .owner_bytes
            .iter()
            .find(|&&b| b > self.p.acks.shard_budget_bytes)
        {
            Some(b) => err(format!("inv7: pending-ack bytes {b} over the shard budget")),
            None => Ok(()),
        }
    }

    fn run_due_events(&mut self) -> Result<(), String> {
        while let Some(entry) = self.events.first_entry() {
            if entry.key().0 > self.now {
                break;
            }
            let ev = entry.remove();
            self.on_event(ev)?;
        }
        Ok(())
    }

    fn on_event(&mut self, ev: Ev) -> Result<(), String> {
        match ev {
            Ev::Activate(s) => self.activate(s),
            Ev::Push {
                shard,
                message,
                endpoints,
            } => {
                self.in_flight[shard] -= 1;
                return self.owner_push(shard, &message, &endpoints);
            }
            Ev::AckTimer(s) => self.ack_timer(s),
            Ev::ClientAck(s, id) => {
                let sess = &mut self.sessions[s];
                if sess.life == Life::Active
                    && sess.pending.ack(id, &mut self.owner_bytes[sess.shard])
                {
                    sess.acked += 1;
                    self.seen.acked += 1;
                    self.acked.insert((id, s));
                }
            }
            Ev::SyncDone { epoch, ok } => {
                if epoch == self.epoch {
                    let result = if ok {
                        Ok(())
                    } else {
                        Err(std::io::Error::other("injected EIO"))
                    };
                    let mut out = Vec::new();
                    self.core.on_sync_done(result, self.time(), &mut out);
                    return self.carry(out);
                }
            }
            Ev::SyncTimer => {
                let mut out = Vec::new();
                self.core.on_sync_timer(&mut out);
                self.schedule(SYNC_INTERVAL_MS, Ev::SyncTimer);
                return self.carry(out);
            }
            Ev::LookupReply {
                epoch,
                lookup,
                failure,
                late,
            } => {
                // A new core's lookups are not the old one's: the driver drops them.
                if epoch == self.epoch {
                    return self.lookup_reply(&lookup, failure, late);
                }
            }
        }
        Ok(())
    }

    // ---- sessions ------------------------------------------------------------

    /// A device connects: registered pending at its owner; its route becomes
    /// visible at the authority, then the owner marks it active.
    fn connect(&mut self) -> Result<(), String> {
        let uid = self.uids[self.rng.gen_range(0..UIDS)].clone();
        let shard = self.rng.gen_range(0..OWNERS);
        let s = self.sessions.len();
        let id = session_id(shard as ShardId, s as u64 + 1);
        let new = NewSession {
            uid: uid.clone(),
            device_id: Arc::from(format!("d{s}")),
            device_flag: 1,
            device_level: DeviceLevel::Master,
            session_id: id,
            listener: Transport::Tcp,
            connected_at_ms: self.now,
        };
        let target = self.view.target_for_uid(&uid);
        let registry = &mut self.registries[shard];
        let handle = registry
            .register_pending(new, target)
            .map_err(|e| format!("register_pending: {e:?}"))?;
        let owner_seq = registry.get(handle).unwrap().owner_seq;
        let ack_permille = [0, 500, 900, 1000][self.rng.gen_range(0..4)];
        let commit_at = self.rng.gen_range(0..=20);
        let visible_at = if self.bugs.route_after_active {
            u64::MAX
        } else {
            self.now + commit_at
        };
        self.sessions.push(Session {
            uid: uid.clone(),
            shard,
            id,
            handle,
            life: Life::Pending,
            active_at: 0,
            routed_at: visible_at,
            sync_ordinal: 0,
            ack_permille,
            pending: PendingAcks::default(),
            tracked: 0,
            acked: 0,
            expired: 0,
        });
        self.by_id.insert(id, s);
        self.directory.push(DirEntry {
            ep: Endpoint {
                uid,
                device_flag: 1,
                device_level: DeviceLevel::Master,
                node_id: NODE,
                boot_id: BOOT,
                session_id: id,
                owner_seq,
            },
            visible_at,
            hidden_at: u64::MAX,
        });
        let after = commit_at + self.rng.gen_range(0..=20);
        self.schedule(after, Ev::Activate(s));
        Ok(())
    }

    /// The owner marks the session active (CONNACK); the client then reads the
    /// log (`messagesync`): it sees every record appended so far.
    fn activate(&mut self, s: usize) {
        if self.sessions[s].life != Life::Pending {
            return;
        }
        let sess = &mut self.sessions[s];
        self.registries[sess.shard]
            .mark_active(sess.handle)
            .expect("a pending session activates");
        sess.life = Life::Active;
        sess.active_at = self.now;
        sess.sync_ordinal = self.store.borrow().next_ordinal;
        if self.bugs.route_after_active {
            let at = self.now + self.rng.gen_range(1..=20);
            self.sessions[s].routed_at = at;
            let id = self.sessions[s].id;
            if let Some(e) = self.directory.iter_mut().find(|e| e.ep.session_id == id) {
                e.visible_at = at;
            }
        }
    }

    /// The device leaves: the owner forgets it at once (its pending RECVs go); the
    /// route's unregister reaches the directory later.
    fn disconnect(&mut self, s: usize) {
        let sess = &mut self.sessions[s];
        self.registries[sess.shard].deactivate(sess.handle, self.now);
        sess.pending.clear(&mut self.owner_bytes[sess.shard]);
        sess.life = Life::Gone;
        let (id, now) = (sess.id, self.now);
        let hidden_at = now + self.rng.gen_range(0..=30);
        self.directory
            .retain(|e| e.hidden_at > now || e.ep.session_id == id);
        if let Some(e) = self.directory.iter_mut().find(|e| e.ep.session_id == id) {
            e.hidden_at = hidden_at;
        }
    }

    // ---- sends -----------------------------------------------------------------

    /// A client's SEND (or an API send), new or a resend of an earlier one.
    fn send_one(&mut self) -> Result<(), String> {
        let resendable = self.reqs.iter().filter(|r| !r.client_msg_no.is_empty());
        let n = resendable.count();
        let r = if n > 0 && self.rng.gen_bool(0.2) {
            let pick = self.rng.gen_range(0..n);
            let first = self
                .reqs
                .iter()
                .filter(|r| !r.client_msg_no.is_empty())
                .nth(pick)
                .unwrap();
            fresh(first.clone(), self.epoch)
        } else {
            self.new_request()
        };
        let idx = self.reqs.len();
        let sender = r.sender.map(|s| domain::send::delivery::Sender {
            node_id: NODE,
            boot_id: BOOT,
            session_id: self.sessions[s].id,
        });
        let request = CommitRequest {
            answer_to: idx,
            sender,
            from_uid: r.from_uid.clone(),
            channel: r.channel.clone(),
            client_msg_no: r.client_msg_no.clone(),
            setting: 0,
            flags: r.flags,
            expire_s: 0,
            topic: String::new(),
            payload: vec![7; r.payload_len],
        };
        self.reqs.push(r);
        let before = self.store.borrow().next_ordinal;
        let mut out = Vec::new();
        let c = self
            .core
            .on_commit(request, &self.groups, self.time(), &mut out);
        let after = self.store.borrow().next_ordinal;
        let r = &mut self.reqs[idx];
        r.kind = Some(c);
        r.appended_at = self.now;
        r.ordinal = (after > before).then_some(before);
        self.carry(out)
    }

    fn new_request(&mut self) -> Req {
        let active: Vec<usize> = (0..self.sessions.len())
            .filter(|&s| self.sessions[s].life == Life::Active)
            .collect();
        let sender = (!active.is_empty() && self.rng.gen_bool(0.8))
            .then(|| active[self.rng.gen_range(0..active.len())]);
        let from_uid = match sender {
            Some(s) => self.sessions[s].uid.clone(),
            None => self.uids[self.rng.gen_range(0..UIDS)].clone(),
        };
        let channel = match self.rng.gen_range(0..20) {
            0 => Channel::Group { id: "gone".into() },
            1..=11 => Channel::Group {
                id: format!("g{}", self.rng.gen_range(0..GROUPS)),
            },
            _ => {
                let peer = &self.uids[self.rng.gen_range(0..UIDS)];
                Channel::resolve(&from_uid, peer, 1).unwrap()
            }
        };
        self.next_cmn += 1;
        let client_msg_no = if self.rng.gen_bool(0.9) {
            format!("m{}", self.next_cmn)
        } else {
            String::new()
        };
        Req {
            from_uid,
            sender,
            channel,
            client_msg_no,
            flags: if self.rng.gen_bool(0.1) {
                Flags::NO_PERSIST.0
            } else {
                0
            },
            payload_len: self.rng.gen_range(0..=PAYLOAD_MAX),
            epoch: self.epoch,
            kind: None,
            appended_at: 0,
            ordinal: None,
            answers: 0,
            answer: None,
            lost: false,
        }
    }

    // ---- the core's outputs ----------------------------------------------------

    fn carry(&mut self, out: Vec<CommitOutput<usize, usize>>) -> Result<(), String> {
        for o in out {
            match o {
                CommitOutput::Answer {
                    to,
                    message_id,
                    message_seq,
                    reason,
                    ..
                } => self.on_answer(to, message_id, message_seq, reason)?,
                CommitOutput::SubmitSync(_job) => {
                    let ok = !(self.chaos && self.roll(self.p.sync_fail_permille));
                    let after = self.rng.gen_range(0..=10);
                    self.schedule(
                        after,
                        Ev::SyncDone {
                            epoch: self.epoch,
                            ok,
                        },
                    );
                }
                CommitOutput::LogFailed { .. } => self.seen.sync_failures += 1,
            }
        }
        Ok(())
    }

    /// An answer: invariants 1 (once; success only for a record in the log, durable
    /// under `always`) and 3 (a resend carries its record's ids).
    fn on_answer(
        &mut self,
        to: usize,
        id: i64,
        seq: u64,
        reason: ReasonCode,
    ) -> Result<(), String> {
        let r = &mut self.reqs[to];
        r.answers += 1;
        if r.answers > 1 || r.lost {
            return err(format!("inv1: request {to} answered again ({reason:?})"));
        }
        r.answer = Some((reason, id, seq));
        match reason {
            ReasonCode::SUCCESS => {}
            ReasonCode::RATE_LIMIT => self.seen.refused_backlog += 1,
            ReasonCode::SYSTEM_ERROR => self.seen.refused_system += 1,
            _ => {}
        }
        if reason != ReasonCode::SUCCESS {
            return Ok(());
        }
        let r = self.reqs[to].clone();
        if r.persisted() {
            let store = self.store.borrow();
            let Some((pos, rec)) = store.by_id(id) else {
                return err(format!(
                    "inv1: request {to} answered success with message {id}, not in the log"
                ));
            };
            if rec.seq != seq
                || rec.channel_key != r.channel.key()
                || *rec.from_uid != *r.from_uid
                || rec.client_msg_no != r.client_msg_no
            {
                return err(format!(
                    "inv3: request {to} answered ({id}, {seq}) but that record is {rec:?}"
                ));
            }
            if self.always() && pos >= store.durable {
                return err(format!(
                    "inv1: request {to} answered success before its record was durable"
                ));
            }
        } else if seq != 0 {
            return err(format!("NoPersist request {to} answered with seq {seq}"));
        }
        match r.kind {
            Some(Committing::Appended) => self.new_message(to, id, seq),
            Some(Committing::Duplicate) => self.duplicate_answered(to, id, seq),
            Some(Committing::Recovered) => self.recovered_answered(to, id, seq),
            _ => err(format!(
                "request {to} refused at once but answered success later"
            )),
        }
    }

    fn new_message(&mut self, req: usize, id: i64, seq: u64) -> Result<(), String> {
        if self.msgs.contains_key(&id) {
            return err(format!("inv3: message id {id} issued twice"));
        }
        let r = &self.reqs[req];
        if r.persisted() {
            let key = r.channel.key().to_owned();
            let last = self.answered_seq.insert(key, (self.epoch, seq));
            if last.is_some_and(|(e, last)| e == self.epoch && seq <= last) {
                return err(format!(
                    "inv2: request {req} answered seq {seq} after {last:?}"
                ));
            }
        }
        let recipients = self.recipients(r);
        self.msgs.insert(
            id,
            MsgInfo {
                req,
                appended_at: r.appended_at,
                ordinal: r.ordinal,
                recipients,
                sender: r.sender,
                crash_lost: false,
                lost: false,
                resend_only: false,
            },
        );
        self.delivery_order.push(id);
        self.seen.committed += 1;
        Ok(())
    }

    /// A resend answered from the idempotency window. If its first copy was never
    /// answered with success (it was in flight when the core crashed, its record
    /// survived and refilled the window), it is a message of its own from now on.
    fn duplicate_answered(&mut self, req: usize, id: i64, seq: u64) -> Result<(), String> {
        self.seen.deduplicated += 1;
        if self.msgs.contains_key(&id) {
            return Ok(());
        }
        let r = &self.reqs[req];
        let ordinal = self.store.borrow().by_id(id).map(|(_, rec)| rec.ordinal);
        let (Some(ordinal), true) = (ordinal, r.persisted()) else {
            return err(format!(
                "inv3: resend {req} answered with ids ({id}, {seq}) no copy had"
            ));
        };
        let first = self.reqs.iter().position(|q| q.ordinal == Some(ordinal));
        let first = first.ok_or_else(|| format!("no request appended record {ordinal}"))?;
        let recipients = self.recipients(r);
        self.msgs.insert(
            id,
            MsgInfo {
                req: first,
                appended_at: self.reqs[first].appended_at,
                ordinal: Some(ordinal),
                recipients,
                sender: self.reqs[first].sender,
                crash_lost: false,
                lost: false,
                resend_only: true,
            },
        );
        Ok(())
    }

    /// A resend of a message recovered from the log at start: answered with the
    /// record's ids and delivered now (a message of its own if its first copy was
    /// never answered with success; delivered once more if it was).
    fn recovered_answered(&mut self, req: usize, id: i64, seq: u64) -> Result<(), String> {
        self.seen.recovered += 1;
        self.recovered_ids.insert(id);
        if !self.msgs.contains_key(&id) {
            self.duplicate_answered(req, id, seq)?;
            self.seen.deduplicated -= 1;
            if let Some(m) = self.msgs.get_mut(&id) {
                m.resend_only = false;
            }
        }
        self.delivery_order.push(id);
        Ok(())
    }

    fn recipients(&self, r: &Req) -> Vec<Uid> {
        match &r.channel {
            Channel::Group { id } => self.groups.0[id].uids().to_vec(),
            Channel::Person { peer, .. } if **peer == *r.from_uid => vec![r.from_uid.clone()],
            Channel::Person { peer, .. } => vec![Uid::from(peer.as_str()), r.from_uid.clone()],
        }
    }

    // ---- delivery ------------------------------------------------------------

    /// The core's delivery turn: room per peer is the ring's capacity less what is
    /// in flight and other traffic (sometimes all of it: a stall); the remote node's
    /// room is unbounded (its sessions are owned here: no push goes there).
    pub fn pump(&mut self) -> Result<(), String> {
        let mut room = [0usize; OWNERS];
        for (s, r) in room.iter_mut().enumerate() {
            let cap = self.p.ring_cap;
            let busy = if self.rng.gen_bool(0.2) {
                cap
            } else {
                self.rng.gen_range(0..=cap / 2)
            };
            *r = cap.saturating_sub(self.in_flight[s] + busy);
        }
        // The messages this call may look up (locally): any of the backlog's. A
        // page in flight may belong to a message far past the front (pages leave
        // as they are pushed, messages only in order), so the whole backlog is
        // reached; a failed group exempts its uids' sessions for each (only under
        // chaos lookup failures: a weaker inv5 for those pairs, never a false one).
        let planned = self.core.delivering();
        let front = self.delivery_order.len() - planned..self.delivery_order.len();
        let mut lookup = DirLookup {
            dir: &self.directory,
            now: self.now,
            rng: &mut self.rng,
            fail_permille: if self.chaos {
                self.p.lookup_fail_permille
            } else {
                0
            },
            failed: Vec::new(),
            failed_groups: 0,
        };
        let mut outputs = Vec::new();
        self.core.pump(
            self.now,
            &self.view,
            &mut lookup,
            &mut |to: PushTo| match to {
                PushTo::Shard(s) => room[s as usize],
                PushTo::Node(_) => usize::MAX,
            },
            &self.p.plan,
            &mut outputs,
        );
        let (failed, failed_groups) = (lookup.failed, lookup.failed_groups);
        self.expected.failed_groups += failed_groups;
        self.check_plan_counts()?;
        self.seen.failed_lookups += failed_groups;
        for i in front {
            self.report_failed(self.delivery_order[i], &failed);
        }
        self.seen.pipelined += u64::from(self.core.pages_in_flight() >= 2);
        if self.bugs.unordered_pages {
            outputs.reverse();
        }
        for output in outputs {
            match output {
                PlanOutput::Push(push) => self.carry_push(push)?,
                PlanOutput::Lookup(lookup) => self.send_lookup(lookup)?,
                PlanOutput::Offline(_) => unreachable!("offline uids not asked for"),
            }
        }
        Ok(())
    }

    /// The planner's counts so far against what the world injected.
    fn check_plan_counts(&mut self) -> Result<(), String> {
        let counts = self.core.take_plan_counts();
        self.seen.stalls += counts.stalls;
        self.counted.failed_groups += counts.failed_groups;
        self.counted.ignored_replies += counts.ignored_replies;
        // The view never moves here: a failed group is counted by the next pump
        // (the planner retries only a group whose slot moved).
        let mut counted = self.counted;
        counted.failed_groups += self.core.groups_awaiting_retry() as u64;
        if counted != self.expected || counts.retried_groups != 0 {
            return err(format!(
                "the planner counted {:?} ({} retried), the world injected {:?}",
                counted, counts.retried_groups, self.expected
            ));
        }
        Ok(())
    }

    /// The pairs of message `id` and the sessions of `uids` are reported: their
    /// lookup failed (they catch up by sync).
    fn report_failed(&mut self, id: i64, uids: &[Uid]) {
        for uid in uids {
            for s in (0..self.sessions.len()).filter(|&s| self.sessions[s].uid == *uid) {
                self.failed_lookup.insert((id, s));
            }
        }
    }

    /// A lookup to the remote authority: answered after a while, or (chaos) failed
    /// at the deadline and maybe answered late, or lost with a restarted peer (the
    /// driver fails it when it learns of the restart).
    fn send_lookup(&mut self, lookup: Lookup) -> Result<(), String> {
        if lookup.node != REMOTE {
            return err(format!("a lookup to node {}", lookup.node));
        }
        self.seen.remote_lookups += 1;
        self.awaited_lookups.insert(lookup.lookup_id);
        let epoch = self.epoch;
        let roll = self.rng.gen_range(0..1000);
        let (fail, lost) = (self.p.remote_fail_permille, self.p.remote_lost_permille);
        let (after, failure) = if self.chaos && roll < fail {
            if self.rng.gen_bool(0.5) {
                let late = Ev::LookupReply {
                    epoch,
                    lookup: lookup.clone(),
                    failure: None,
                    late: true,
                };
                let after = LOOKUP_DEADLINE_MS + self.rng.gen_range(1..=20);
                self.schedule(after, late);
            }
            (LOOKUP_DEADLINE_MS, Some(LookupFailure::Deadline))
        } else if self.chaos && roll < fail + lost {
            let after = self.rng.gen_range(1..=LOOKUP_DEADLINE_MS);
            (after, Some(LookupFailure::PeerRestarted))
        } else {
            (self.rng.gen_range(1..=30), None)
        };
        let ev = Ev::LookupReply {
            epoch,
            lookup,
            failure,
            late: false,
        };
        self.schedule(after, ev);
        Ok(())
    }

    /// A lookup's reply (or failure) reaches the core: the remote authority looks
    /// its groups up in the directory now (a group may be stale); a late reply must
    /// be ignored.
    fn lookup_reply(
        &mut self,
        lookup: &Lookup,
        failure: Option<LookupFailure>,
        late: bool,
    ) -> Result<(), String> {
        let (reply, failed, failed_groups) = match failure {
            Some(f) => {
                self.seen.remote_failed += 1;
                let uids = if self.bugs.unreported_lookup_failure {
                    Vec::new()
                } else {
                    lookup.uids.clone()
                };
                (LookupReply::Failed(f), uids, lookup.groups.len() as u64)
            }
            None => self.remote_found(lookup),
        };
        if late {
            self.seen.late_replies += 1;
            self.expected.ignored_replies += 1;
        } else {
            let oldest = self.awaited_lookups.pop_first();
            if oldest != Some(lookup.lookup_id) {
                self.seen.reordered_replies += 1;
                oldest.map(|id| self.awaited_lookups.insert(id));
                self.awaited_lookups.remove(&lookup.lookup_id);
            }
            self.expected.failed_groups += failed_groups;
            self.report_failed(lookup.message_id, &failed);
        }
        let awaited = self.core.on_lookup_reply(lookup.lookup_id, reply);
        if awaited == late {
            return err(format!(
                "lookup {} (late {late}): the planner said awaited {awaited}",
                lookup.lookup_id
            ));
        }
        self.check_plan_counts()
    }

    /// The remote authority's answer, from the directory now; the uids of its
    /// stale groups and their count.
    fn remote_found(&mut self, lookup: &Lookup) -> (LookupReply, Vec<Uid>, u64) {
        let mut dir = DirLookup {
            dir: &self.directory,
            now: self.now,
            rng: &mut self.rng,
            fail_permille: if self.chaos {
                self.p.lookup_fail_permille
            } else {
                0
            },
            failed: Vec::new(),
            failed_groups: 0,
        };
        let groups: Vec<(Target, &[Uid])> = lookup.groups().collect();
        let (mut endpoints, mut results) = (Vec::new(), Vec::new());
        dir.endpoints_by_targets_into(&groups, &mut endpoints, &mut results);
        let failed_groups = dir.failed_groups;
        let reply = LookupReply::Found { endpoints, results };
        (reply, dir.failed, failed_groups)
    }

    /// A push batch: to this shard's own sessions at once; to another shard over
    /// the network, which delays (reorders) and sometimes drops it (counted).
    fn carry_push(&mut self, push: Push) -> Result<(), String> {
        let shard = match push.to {
            PushTo::Shard(s) => s as usize,
            PushTo::Node(n) => return err(format!("a push to node {n} in a one-node world")),
        };
        self.check_push_order(&push)?;
        if shard == ME as usize {
            return self.owner_push(shard, &push.message, &push.endpoints);
        }
        if self.chaos && self.roll(self.p.drop_permille) {
            if self.bugs.silent_drop {
                return Ok(());
            }
            for ep in &push.endpoints {
                if let Some(&s) = self.by_id.get(&ep.session_id) {
                    self.dropped.insert((push.message.message_id, s));
                }
            }
            self.seen.dropped += 1;
            return Ok(());
        }
        self.in_flight[shard] += 1;
        let after = self.rng.gen_range(1..=30);
        self.schedule(
            after,
            Ev::Push {
                shard,
                message: push.message,
                endpoints: push.endpoints,
            },
        );
        Ok(())
    }

    /// Invariant 8: the pushes a core hands over reach each session in the seq order
    /// of their channel (its new messages; NoPersist ones have no seq, resends of
    /// recovered messages are older than its new ones). Checked as the driver
    /// carries them: every carrier between shards (a ring) and nodes (a link) keeps
    /// its order, and this world's network reorders (and drops) on purpose, so a
    /// session's RECVs arrive in that order whenever nothing is dropped.
    fn check_push_order(&mut self, push: &Push) -> Result<(), String> {
        let m = &push.message;
        if m.message_seq == 0 || self.recovered_ids.contains(&m.message_id) {
            return Ok(());
        }
        for ep in &push.endpoints {
            let Some(&s) = self.by_id.get(&ep.session_id) else {
                continue;
            };
            self.seen.ordered_pushes += 1;
            let key = (s, m.channel_type, m.channel_key.clone());
            let last = self.pushed_seq.insert(key, m.message_seq);
            if let Some(last) = last.filter(|&last| last >= m.message_seq) {
                return err(format!(
                    "inv8: message {} (seq {}) of channel {} pushed to session {s} after seq {last}",
                    m.message_id, m.message_seq, m.channel_key
                ));
            }
        }
        Ok(())
    }

    /// The owner: revalidates each endpoint against its registry and writes RECV
    /// only to its live active sessions (invariant 4), tracking each for its ACK.
    fn owner_push(
        &mut self,
        shard: usize,
        message: &Arc<Committed>,
        endpoints: &[Endpoint],
    ) -> Result<(), String> {
        let id = message.message_id;
        for ep in endpoints {
            if session_shard(ep.session_id) as usize != shard {
                return err(format!(
                    "a push for session {:x} reached shard {shard}",
                    ep.session_id
                ));
            }
            let live = self.bugs.skip_revalidation
                || self.registries[shard]
                    .revalidate(&ep.uid, ep.boot_id, ep.session_id, ep.owner_seq)
                    .is_some();
            if !live {
                self.seen.stale += 1;
                continue;
            }
            let s = self.by_id[&ep.session_id];
            if self.sessions[s].life != Life::Active {
                return err(format!(
                    "inv4: RECV of message {id} written to session {s}, {:?} at its owner",
                    self.sessions[s].life
                ));
            }
            if self.msgs.get(&id).and_then(|m| m.sender) == Some(s) {
                return err(format!(
                    "inv4: RECV of message {id} to its own sending session {s}"
                ));
            }
            self.write_recv(s, message, false);
            let sess = &mut self.sessions[s];
            let tracked = sess.pending.track(
                message.clone(),
                self.now,
                &self.p.acks,
                &mut self.owner_bytes[shard],
            );
            match tracked {
                Tracked::Yes { arm_timer_at } => {
                    sess.tracked += 1;
                    if let Some(at) = arm_timer_at {
                        self.schedule(at - self.now, Ev::AckTimer(s));
                    }
                }
                Tracked::SessionFull | Tracked::OverBudget => {
                    self.seen.untracked += 1;
                    self.untracked.insert((id, s));
                }
            }
        }
        Ok(())
    }

    /// A RECV reaches the client, which acknowledges it (after a while) or not.
    fn write_recv(&mut self, s: usize, message: &Arc<Committed>, dup: bool) {
        self.recv.insert((message.message_id, s));
        self.seen.recvs += 1;
        if dup {
            self.seen.dup_recvs += 1;
        }
        if self.roll(self.sessions[s].ack_permille) {
            let after = self.rng.gen_range(1..=2 * self.p.acks.timeout_ms);
            self.schedule(after, Ev::ClientAck(s, message.message_id));
        }
    }

    /// A session's ack timer: due RECVs re-sent with DUP, or expired (counted).
    fn ack_timer(&mut self, s: usize) {
        if self.sessions[s].life != Life::Active {
            return;
        }
        let mut resend = Vec::new();
        let sess = &mut self.sessions[s];
        let t = sess.pending.on_timeout(
            self.now,
            &self.p.acks,
            &mut self.owner_bytes[sess.shard],
            &mut resend,
        );
        sess.expired += t.expired;
        self.seen.expired += t.expired;
        if let Some(at) = t.next_deadline_ms {
            self.schedule(at.saturating_sub(self.now), Ev::AckTimer(s));
        }
        for m in resend {
            self.write_recv(s, &m, true);
        }
    }

    // ---- restarts ----------------------------------------------------------------

    /// The commit core stops (gracefully: `stop` syncs and answers everything) or
    /// crashes (unanswered requests get no answer; the log keeps its durable
    /// prefix and maybe more), and a new core starts from the log.
    pub fn restart(&mut self, graceful: bool) -> Result<(), String> {
        self.seen.restarts += 1;
        if graceful {
            let mut out = Vec::new();
            self.core.stop(self.time(), &mut out);
            self.carry(out)?;
            self.pump()?;
        }
        // The deliveries still in the core's planner die with it: the newest ones,
        // and the failed groups it had not yet retried or counted.
        self.counted.failed_groups += self.core.groups_awaiting_retry() as u64;
        let planned = self.core.delivering();
        let n = self.delivery_order.len();
        for id in &self.delivery_order[n - planned..] {
            self.msgs.get_mut(id).unwrap().crash_lost = true;
            self.seen.crash_lost += 1;
        }
        for (i, r) in self.reqs.iter_mut().enumerate() {
            if r.answers == 0 && !r.lost {
                if graceful {
                    return err(format!(
                        "inv1: request {i} unanswered after a graceful stop"
                    ));
                }
                r.lost = true;
            }
        }
        let unsynced = self.store.borrow().unsynced();
        let keep = if graceful {
            unsynced
        } else {
            self.rng.gen_range(0..=unsynced)
        };
        let lost = self.store.borrow_mut().crash(keep);
        for rec in lost {
            if let Some(m) = self.msgs.get_mut(&rec.message_id) {
                if self.p.commit.answer_after_sync {
                    return err(format!(
                        "inv1: message {} (request {}) was answered with success and lost in a crash",
                        rec.message_id, m.req
                    ));
                }
                m.lost = true;
            }
        }
        super::check_log(&self.store.borrow())?;
        self.rebuild();
        Ok(())
    }

    /// A new core over the surviving log: ids resume after the newest, the
    /// idempotency window is refilled from the records.
    fn rebuild(&mut self) {
        self.epoch += 1;
        self.pushed_seq.clear();
        self.recovered_ids.clear();
        self.awaited_lookups.clear();
        self.delivery_order.clear();
        let store = self.store.borrow();
        let mut ids = new_ids();
        if let Some(max) = store.records.iter().map(|r| r.message_id).max() {
            ids.resume_after(max);
        }
        let mut w = window().unwrap();
        let now_s = self.time().wall_ms / 1000;
        for r in store.records.iter().filter(|_| !self.bugs.no_refill) {
            let sent = SentIds {
                message_id: r.message_id,
                message_seq: r.seq,
            };
            w.refill(&r.from_uid, &r.client_msg_no, sent, r.timestamp_s, now_s);
        }
        w.refill_done(now_s);
        drop(store);
        let log = FakeLog(self.store.clone());
        self.core = CommitCore::new(log, ids, Some(w), self.p.commit);
    }

    /// Whether everything in flight has ended: deliveries, syncs, pushes, ACKs.
    pub fn quiet(&self) -> bool {
        self.core.backlog_len() == 0
            && !self.core.sync_in_flight()
            && self.events.values().all(|e| matches!(e, Ev::SyncTimer))
            && self
                .sessions
                .iter()
                .all(|s| s.life != Life::Active || s.pending.is_empty())
    }
}

/// This node leads every hash slot but a share that [`REMOTE`] leads.
fn view(rng: &mut StdRng, remote_share_permille: u32) -> ClusterView {
    let mut view = ClusterView::single_node(NODE);
    for slot in view.slots.iter_mut() {
        if rng.gen_range(0..1000) < remote_share_permille {
            slot.leader_node_id = REMOTE;
        }
    }
    view
}

fn new_ids() -> MessageIdGen {
    MessageIdGen::new(NODE, ME as usize, OWNERS).unwrap()
}

fn window() -> Option<IdempotencyWindow> {
    IdempotencyWindow::new(IDEMPOTENCY)
}

/// A resend of `first`: the same message, a new request.
fn fresh(first: Req, epoch: u32) -> Req {
    Req {
        epoch,
        kind: None,
        appended_at: 0,
        ordinal: None,
        answers: 0,
        answer: None,
        lost: false,
        ..first
    }
}
