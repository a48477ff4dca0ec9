//! The replicated groups of one shard ("Replicated slot ids…", its first step in
//! the node): a replica of each slot id this node holds whose shard is this one
//! (`slot_id % shard_count`), each a `replica::Group` (raft-rs, sans-IO).
//!
//! - **Placement**: slot id `s` has `[cluster] replicas` voters, the nodes at
//!   `s, s + 1, …` (mod n) in config order ([`replica_nodes`]): the first is its
//!   static home, and the group's preferred leader: a leader elsewhere hands over
//!   to it at a timer run once it answers and holds the whole log
//!   (`Group::is_caught_up`), so a transfer never stalls proposals on a replica
//!   that is down or behind. An operator's choice (`POST /cluster/slots/leader`,
//!   a `CatalogOp::PreferLeader` committed in the group: every replica keeps it,
//!   a restart replays it) comes before the placement's order. A replica's raft id is its node id + 1 (raft ids start at 1,
//!   node ids at 0). The slot id's channels live on the same shard
//!   (`slots::SlotMap::by_slot_id`, layout version 3), so its channel logs and
//!   its raft log are one message log.
//! - **Time**: one timer per shard (`[cluster] raft_tick_ms`); each run ticks every
//!   group once per tick elapsed since the last run, so a shard that was paused
//!   (SIGSTOP) catches up on its ticks at once and a leader whose quorum went quiet
//!   steps down before it serves again. The ticks are counted per shard and the
//!   leaders' heartbeats phased by that count (`Group::tick_at`), so one tick in
//!   `heartbeat_ticks` carries all of them, one frame per peer.
//! - **Writes**: each drain's writes go through `store::replicated` in the
//!   contract's order: the entries into this shard's message log (each entry of
//!   messages given its seqs there), a sync of the log under `[log] fsync =
//!   "always"` (on this thread for now; under `interval` the log's own timer
//!   covers it), the term, vote and configuration into
//!   `DATA_DIR/shard-N/raft_state` (synced under every policy), then `persisted`. A write that fails
//!   takes the replica out of its group (it stops voting; logged, counted), never
//!   acknowledges.
//! - **Messages**: a drain's messages for one peer leave in one frame (`Kind::Raft`,
//!   one-way); a frame the link refuses is dropped (raft resends) and the group is
//!   told the peer is unreachable. A peer's frame is read by any shard and split by
//!   the shard of each message's group; each shard steps its part and drains the
//!   groups it reached once, so the answers to one frame leave in one frame.
//! - **Memory**: each timer run drops from each group's in-memory log the committed
//!   entries past the last `[cluster] raft_entries_retained` (`Group::compact`);
//!   they stay in the message log. A follower further behind is sent no snapshot
//!   (catch-up from the log is not built): it waits, and its group commits with
//!   the others.
//! - **Status**: each group's leader and term as this replica knows them, in
//!   [`RaftStatus`] (read by `/metrics` and tests).
//! - **SENDs**: the commit core proposes each turn's SENDs to a group as one entry
//!   ([`Replicas`]: 10 when this replica does not lead, 15 when the group
//!   refuses); the drains tell it, as [`RaftEvent`]s, the seqs each entry of
//!   messages got at its append here (with the messages' keys for an entry not of
//!   this leader's own term, which every replica applies at its commit: the
//!   idempotency window and the ids), each commit, and each leadership lost, and
//!   it answers (`domain::send::commit`, its `replicated` path).
//! - **Lease**: each serving leader starts a lease round (`Group::renew_lease`,
//!   a ReadIndex of its own) at once when it begins to serve and then on every
//!   heartbeat tick; its lease ends `LEASE_TICKS` ticks (the shortest election
//!   timeout less one) less `[cluster] raft_lease_margin_ms` after the latest
//!   round a quorum answered was started (`Group::lease_start`), published in
//!   [`RaftStatus::lease_holds`]. No other replica can have been elected before
//!   it ends, so the slot id's authority serves only under it
//!   (`AuthoritySide::leased`): a leader cut off from its quorum, or handing
//!   over, stops serving Register, Commit, Abort, Unregister and touches
//!   (`NotLeader`), and its lookups answer `Rebuilding`
//!   (`authority_side::hold_unleased`), before a new leader can serve them. The
//!   drains run on the node's clock (`NodeShared::mono_ms`), which every shard
//!   reads the leases on.
//! - **Leaders claim their slot ids**: a replica that leads, has committed an
//!   entry of its term (`Group::serving`: its predecessors' entries are all
//!   committed and applied here) and holds its lease is reported once per term
//!   ([`RaftSide::take_won`]); the node claims the slot id's hash slots in a new
//!   view (`NodeShared::claim_group_leaders`, `ClusterView::with_group_leader`),
//!   so homes and authorities follow the elections (`Homes::Leaders`). Until it
//!   serves, a leader refuses proposals (10).
//!
//! With `replicas = 1` (the default) there is no group, no timer and no traffic,
//! and SENDs take the log's own path.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use domain::send::commit::{ForeignEntry, Replicas};
use proto::wkproto::ReasonCode;
use replica::{Group, GroupConfig, GroupError, Outputs, Role};

use crate::cluster::NodeId;
use crate::node::catalog::CatalogOp;
use crate::node::msg::{CatalogRefused, SyncRefused};
use crate::store::raft_state::{GroupState, RaftStateFile};
use crate::store::replicated::{
    append, catalog_of, durable_of, encode_catalog, encode_messages, settle, AppendedEntry,
    ReplicatedError,
};
use crate::store::{AppendedMessage, MessageLog, NewMessage};

/// Each slot id's leader and term as the replica on this node last saw them.
#[derive(Debug)]
pub struct RaftStatus {
    leaders: Vec<AtomicU64>,
    terms: Vec<AtomicU64>,
    /// The end of this node's leader lease, in the shards' ms (0: none).
    leases: Vec<AtomicU64>,
    /// The preferred leader's node id + 1 (0: the placement's).
    preferred: Vec<AtomicU64>,
}

impl RaftStatus {
    /// Nothing known of `slot_ids` slot ids.
    pub fn new(slot_ids: u32) -> RaftStatus {
        let zeros = || (0..slot_ids).map(|_| AtomicU64::new(0)).collect();
        RaftStatus {
            leaders: zeros(),
            terms: zeros(),
            leases: zeros(),
            preferred: zeros(),
        }
    }

    /// Whether this node's replica of `slot_id`'s group leads it under a lease
    /// that holds at `now_ms` (the shards' clock; module docs, "Lease"): only then
    /// does the slot id's authority here serve.
    pub fn lease_holds(&self, slot_id: u32, now_ms: u64) -> bool {
        let end = self.leases.get(slot_id as usize);
        end.is_some_and(|e| now_ms < e.load(Ordering::Relaxed))
    }

    /// The leader `slot_id`'s group prefers as this node's replica knows it
    /// (`POST /cluster/slots/leader`); `None`: the placement's (the first voter
    /// not draining), or no replica here.
    pub fn preferred_of(&self, slot_id: u32) -> Option<NodeId> {
        let p = self
            .preferred
            .get(slot_id as usize)?
            .load(Ordering::Relaxed);
        p.checked_sub(1)
    }

    /// The leader (0: none known) and term of `slot_id`'s group as this node's
    /// replica sees them; `None` for a slot id it holds no replica of, one still in
    /// term 0 (no election yet) or out of range.
    pub fn of(&self, slot_id: u32) -> Option<(NodeId, u64)> {
        let i = slot_id as usize;
        let term = self.terms.get(i)?.load(Ordering::Relaxed);
        (term > 0).then(|| (self.leaders[i].load(Ordering::Relaxed), term))
    }

    /// Groups this node's replicas lead.
    pub fn led_by(&self, me: NodeId) -> usize {
        (0..self.leaders.len())
            .filter(|&i| {
                self.terms[i].load(Ordering::Relaxed) > 0
                    && self.leaders[i].load(Ordering::Relaxed) == me
            })
            .count()
    }

    fn publish(&self, slot_id: u32, s: GroupStatus) {
        let i = slot_id as usize;
        self.leaders[i].store(s.leader.unwrap_or(0), Ordering::Relaxed);
        self.terms[i].store(s.term, Ordering::Relaxed);
        self.leases[i].store(s.lease_end_ms, Ordering::Relaxed);
        self.preferred[i].store(s.preferred.map_or(0, |n| n + 1), Ordering::Relaxed);
    }
}

/// One group as [`RaftStatus`] shows it.
#[derive(Debug, Clone, Copy, Default)]
struct GroupStatus {
    leader: Option<NodeId>,
    term: u64,
    preferred: Option<NodeId>,
    /// 0: no lease.
    lease_end_ms: u64,
}

/// The shortest election timeout, in ticks.
const ELECTION_TICKS: usize = 10;

/// Ticks between a leader's heartbeats (and its lease rounds).
const HEARTBEAT_TICKS: usize = 2;

/// A leader's lease in ticks before the margin (`[cluster] raft_lease_margin_ms`):
/// the shortest election timeout less one tick (a follower's first tick after a
/// heartbeat may come at once).
pub const LEASE_TICKS: u64 = ELECTION_TICKS as u64 - 1;

impl RaftStatus {}

/// Whether replicated groups run: `[cluster] replicas` above 1 on a cluster of more
/// than one node (the data dir's placement by slot id, `store::layout`, follows
/// the same rule).
pub fn groups_run(replicas: usize, nodes: usize) -> bool {
    replicas > 1 && nodes > 1
}

/// The nodes holding a replica of `slot_id`: `replicas` of `nodes` from
/// `slot_id`'s position in config order (module docs).
pub fn replica_nodes(slot_id: u32, nodes: &[NodeId], replicas: usize) -> Vec<NodeId> {
    let n = nodes.len();
    (0..replicas.min(n))
        .map(|k| nodes[(slot_id as usize + k) % n])
        .collect()
}

/// The raft id of `node`'s replica (raft ids start at 1).
fn raft_id(node: NodeId) -> u64 {
    node + 1
}

/// Where this shard's groups come from.
pub struct RaftPlace<'a> {
    pub me: NodeId,
    pub shard: usize,
    pub shard_count: usize,
    pub nodes: &'a [NodeId],
    pub replicas: usize,
    pub slot_ids: u32,
    pub tick_ms: u64,
    /// The shard's directory (`DATA_DIR/shard-N`), where `raft_state` lives.
    pub dir: &'a Path,
    pub seed: u64,
    /// `[log] fsync = "always"`: a drain's entries are synced before its
    /// acknowledgements leave (else the log's interval sync covers them).
    pub fsync_always: bool,
    /// `[cluster] raft_entries_retained`.
    pub entries_retained: u64,
    /// `[cluster] raft_lease_margin_ms`.
    pub lease_margin_ms: u64,
}

struct Replica {
    group: Group,
    state: GroupState,
    /// The group's nodes in placement order: the first that is not draining is
    /// the preferred leader (the slot id's home unless it drains), to which a
    /// leader hands over once it is caught up.
    voters: Vec<NodeId>,
    /// The leader an operator chose (`CatalogOp::PreferLeader`, committed in the
    /// group's log: every replica knows it, a restart replays it): it comes
    /// before the placement's order in [`hand_over_to`].
    preferred: Option<NodeId>,
    /// Whether it led at its last drain (a leader that lost office loses its
    /// proposals in flight: [`RaftEvent::Lost`]).
    led: bool,
    /// The last term this replica claimed its slot id's hash slots in
    /// ([`RaftSide::take_won`]); 0: never.
    claimed_term: u64,
    /// The last term this replica started a lease round in as soon as it served
    /// (the first round of a term does not wait for a heartbeat tick).
    lease_term: u64,
}

impl Replica {
    /// A leader that began to serve in a term starts its first lease round of
    /// the term at once (module docs, "Lease"), not at the next heartbeat tick.
    fn first_lease_round(&mut self, now_ms: u64) {
        if self.group.serving() && self.lease_term != self.group.term() {
            self.lease_term = self.group.term();
            self.group.renew_lease(now_ms);
        }
    }
}

/// A read asked here whose ReadIndex `ctx` is in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ReadWait {
    group: u32,
    ctx: u64,
    waiter: u64,
}

/// What became of a read asked with [`RaftSide::ask_read`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadOutcome {
    /// A quorum confirmed this replica as `group`'s leader after the read was
    /// asked: read the group's committed state here now.
    Ready { waiter: u64, group: u32 },
    /// Not confirmed: this replica lost office (or its group refused the
    /// ReadIndex); the caller answers "no leader here, retry".
    Lost { waiter: u64 },
}

/// `group`'s ReadIndex `ctx` was confirmed: its reads, and the group's earlier
/// ones (a later confirmation covers them), are ready.
fn read_confirmed(waiting: &mut Vec<ReadWait>, out: &mut Vec<ReadOutcome>, group: u32, ctx: u64) {
    waiting.retain(|w| {
        let ready = w.group == group && w.ctx <= ctx;
        if ready {
            out.push(ReadOutcome::Ready {
                waiter: w.waiter,
                group,
            });
        }
        !ready
    });
}

/// `group`'s leadership here was lost: its reads in flight are lost.
fn read_lost(waiting: &mut Vec<ReadWait>, out: &mut Vec<ReadOutcome>, group: u32) {
    waiting.retain(|w| {
        if w.group == group {
            out.push(ReadOutcome::Lost { waiter: w.waiter });
        }
        w.group != group
    });
}

/// A catalog change proposed here: `waiter` names it to the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CatalogWait {
    group: u32,
    term: u64,
    index: u64,
    waiter: u64,
}

/// What the drains give out of the catalog ([`RaftSide::take_catalog`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CatalogOutcome {
    /// A catalog entry committed in `group`: its op's bytes, to apply on this
    /// node in this order; `waiter` when it is the change proposed here.
    Apply { op: Vec<u8>, waiter: Option<u64> },
    /// The change proposed here as `waiter` will not be answered by its commit
    /// (cut, or this replica lost office: it may still commit elsewhere).
    Lost { waiter: u64 },
}

/// What a drain tells the commit core about its proposals.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RaftEvent {
    /// This replica appended the entry of messages at `index` in `term`, its
    /// messages given `seqs`; with their keys when it was not proposed here
    /// (to apply at its commit).
    Appended {
        group: u32,
        term: u64,
        index: u64,
        seqs: Vec<u64>,
        foreign: Option<ForeignEntry>,
    },
    /// The entry at `index` was committed in `term`.
    Committed { group: u32, term: u64, index: u64 },
    /// This replica no longer leads `group` (or left it): its proposals in
    /// flight will not be answered by their commit.
    Lost { group: u32 },
}

/// One shard's groups (module docs).
pub struct RaftSide {
    groups: BTreeMap<u32, Replica>,
    file: Option<RaftStateFile>,
    tick_ms: u64,
    last_tick_ms: Option<u64>,
    /// Ticks run: the shared count the groups' heartbeats are phased by, so the
    /// heartbeats of all the groups this shard leads leave together.
    ticks: u64,
    out: Outputs,
    appended: Vec<AppendedMessage>,
    entries: Vec<AppendedEntry>,
    /// Per peer: `(slot id, raft message)` to send.
    outbox: BTreeMap<NodeId, Vec<(u32, Vec<u8>)>>,
    /// Groups proposed to since their last drain.
    proposed: Vec<u32>,
    /// For the commit core, in order ([`RaftSide::take_events`]).
    events: Vec<RaftEvent>,
    /// `(slot id, raft term)` of each group this shard's replica began to serve
    /// as leader since the last [`RaftSide::take_won`].
    won: Vec<(u32, u64)>,
    /// Catalog changes proposed here, waiting for their commit (bounded by the
    /// caller: `[commit] catalog_changes_waiting_max`).
    catalog_waiting: Vec<CatalogWait>,
    /// What the drains committed or lost of the catalog, in order
    /// ([`RaftSide::take_catalog`]).
    catalog_out: Vec<CatalogOutcome>,
    /// Reads asked this turn, `(group, waiter)`: one ReadIndex per group at the
    /// turn's drain.
    reads_asked: Vec<(u32, u64)>,
    /// Reads whose ReadIndex is in flight (bounded by the caller: `[commit]
    /// reads_waiting_max`).
    reads_waiting: Vec<ReadWait>,
    /// The last ReadIndex's context (a counter).
    read_ctx: u64,
    /// What became of the reads, in order ([`RaftSide::take_reads`]).
    reads_out: Vec<ReadOutcome>,
    /// A leader lease's length (module docs, "Lease").
    lease_ms: u64,
    /// Whether this node's slot ids are replicated (SENDs go through the groups),
    /// even if this shard holds no group or its groups did not open.
    replicated: bool,
    fsync_always: bool,
    /// Replicas taken out of their group by a failed write.
    pub failed: u64,
    /// Snapshots the groups' leaders here did not send (a follower waits).
    pub snapshots_refused: u64,
}

impl RaftSide {
    /// No group (`replicas = 1`, or a node alone).
    pub fn off() -> RaftSide {
        RaftSide {
            groups: BTreeMap::new(),
            file: None,
            tick_ms: 0,
            last_tick_ms: None,
            ticks: 0,
            out: Outputs::default(),
            appended: Vec::new(),
            entries: Vec::new(),
            outbox: BTreeMap::new(),
            proposed: Vec::new(),
            events: Vec::new(),
            won: Vec::new(),
            catalog_waiting: Vec::new(),
            catalog_out: Vec::new(),
            reads_asked: Vec::new(),
            reads_waiting: Vec::new(),
            read_ctx: 0,
            reads_out: Vec::new(),
            lease_ms: 0,
            replicated: false,
            fsync_always: false,
            failed: 0,
            snapshots_refused: 0,
        }
    }

    /// The side of a node whose slot ids are replicated but whose groups on this
    /// shard could not open: SENDs are refused (10), never taken past the groups.
    pub fn without_groups() -> RaftSide {
        RaftSide {
            replicated: true,
            ..RaftSide::off()
        }
    }

    /// Whether SENDs go through the groups (module docs).
    pub fn replicated(&self) -> bool {
        self.replicated
    }

    /// The replicas `place` gives this shard, restarted from `log` and the shard's
    /// `raft_state` (a new replica starts with an empty log and the placement's
    /// voters). Refuses what the stores refuse (a group that needs a snapshot
    /// included).
    pub fn open(place: &RaftPlace<'_>, log: &MessageLog) -> Result<RaftSide, String> {
        let mut side = RaftSide::off();
        if !groups_run(place.replicas, place.nodes.len()) {
            return Ok(side);
        }
        side.replicated = true;
        side.fsync_always = place.fsync_always;
        let (file, mut states) =
            RaftStateFile::open(place.dir, place.slot_ids as usize).map_err(|e| e.to_string())?;
        for slot_id in 0..place.slot_ids {
            let voters = replica_nodes(slot_id, place.nodes, place.replicas);
            if slot_id as usize % place.shard_count != place.shard || !voters.contains(&place.me) {
                continue;
            }
            let cfg = GroupConfig {
                heartbeat_ticks: HEARTBEAT_TICKS,
                election_ticks: ELECTION_TICKS,
                log_entries_retained: place.entries_retained,
                ..GroupConfig::new(
                    raft_id(place.me),
                    voters.iter().map(|&n| raft_id(n)).collect(),
                    place.seed ^ u64::from(slot_id),
                )
            };
            let state = states.remove(&slot_id).unwrap_or_else(|| GroupState {
                conf_state: Group::initial(&cfg).conf_state,
                ..GroupState::default()
            });
            let durable = durable_of(log, slot_id, &state).map_err(|e| e.to_string())?;
            let group = Group::restart(&cfg, &durable).map_err(|e| e.to_string())?;
            let r = Replica {
                group,
                state,
                voters,
                preferred: None,
                led: false,
                claimed_term: 0,
                lease_term: 0,
            };
            side.groups.insert(slot_id, r);
        }
        side.file = Some(file);
        side.tick_ms = place.tick_ms.max(1);
        side.lease_ms = (LEASE_TICKS * side.tick_ms).saturating_sub(place.lease_margin_ms);
        Ok(side)
    }

    /// The replicas this shard holds, and how many of them lead their group.
    pub fn counts(&self) -> (usize, usize) {
        let led = (self.groups.values())
            .filter(|r| r.group.role() == Role::Leader)
            .count();
        (self.groups.len(), led)
    }

    /// Whether this shard holds any group (its timer runs only then).
    pub fn is_on(&self) -> bool {
        !self.groups.is_empty()
    }

    /// The tick interval.
    pub fn tick_ms(&self) -> u64 {
        self.tick_ms
    }

    /// The timer's run at `now_ms`: every group ticked once per tick elapsed (at
    /// most 20) on the shard's shared count (`Group::tick_at`: the leaders beat on
    /// the same ticks), each leader's hand-over decided ([`hand_over_to`], with
    /// `draining` telling which nodes drain), then all drained as one batch.
    pub fn on_timer(
        &mut self,
        now_ms: u64,
        log: &mut MessageLog,
        status: &RaftStatus,
        draining: impl Fn(NodeId) -> bool,
    ) {
        let last = *self.last_tick_ms.get_or_insert(now_ms);
        let ticks = (now_ms.saturating_sub(last) / self.tick_ms).min(20);
        self.last_tick_ms = Some(last + ticks * self.tick_ms);
        let ids: Vec<u32> = self.groups.keys().copied().collect();
        let beats_before = self.ticks / HEARTBEAT_TICKS as u64;
        for _ in 0..ticks {
            self.ticks += 1;
            for r in self.groups.values_mut() {
                r.group.tick_at(self.ticks);
            }
        }
        let beat = self.ticks / HEARTBEAT_TICKS as u64 != beats_before;
        for r in self.groups.values_mut() {
            // A lease round on each heartbeat tick (serving leaders only).
            if beat {
                r.group.renew_lease(now_ms);
            }
            // Memory: the committed entries past those retained are in the log.
            r.group.compact();
            if r.group.role() != Role::Leader || r.group.transferring() {
                continue;
            }
            let me = r.group.id() - 1;
            let caught_up = |n: NodeId| r.group.is_caught_up(raft_id(n));
            if let Some(to) = hand_over_to(me, &r.voters, r.preferred, &draining, caught_up) {
                r.group.transfer_leader(raft_id(to));
            }
        }
        self.drain(&ids, now_ms, log, status);
    }

    /// Drains the groups proposed to since their last drain (the end of a turn):
    /// the leader's entries written and sent.
    pub fn drain_proposed(&mut self, now_ms: u64, log: &mut MessageLog, status: &RaftStatus) {
        if self.proposed.is_empty() {
            return;
        }
        self.ask_read_indexes();
        let mut ids = std::mem::take(&mut self.proposed);
        ids.sort_unstable();
        ids.dedup();
        self.drain(&ids, now_ms, log, status);
        ids.clear();
        self.proposed = ids;
    }

    /// Whether the drains told anything since the last [`RaftSide::take_events`].
    pub fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// `(slot id, raft term)` of each group whose replica here began to serve as
    /// leader (elected, and an entry of its term committed) since the last call:
    /// the node claims their hash slots (`NodeShared::claim_group_leaders`).
    pub fn take_won(&mut self) -> Vec<(u32, u64)> {
        std::mem::take(&mut self.won)
    }

    /// Proposes catalog change `op` (its bytes, `CatalogOp::encode`) to `group`,
    /// named `waiter` in its outcome ([`RaftSide::take_catalog`]); drained with the
    /// turn's proposals. Refused when this replica does not serve as the group's
    /// leader (or holds no replica of it).
    pub fn propose_catalog(
        &mut self,
        group: u32,
        op: &[u8],
        waiter: u64,
    ) -> Result<(), CatalogRefused> {
        let r = (self.groups.get_mut(&group))
            .filter(|r| r.group.serving())
            .ok_or(CatalogRefused::NotLeader)?;
        let (term, index) =
            (r.group.propose(encode_catalog(op))).map_err(|_| CatalogRefused::NotLeader)?;
        self.proposed.push(group);
        self.catalog_waiting.push(CatalogWait {
            group,
            term,
            index,
            waiter,
        });
        Ok(())
    }

    /// Catalog changes proposed here and waiting for their commit.
    pub fn catalog_waiting(&self) -> usize {
        self.catalog_waiting.len()
    }

    /// The catalog entries committed and the changes lost since the last call, in
    /// order: each committed op is applied on this node in this order.
    pub fn take_catalog(&mut self) -> Vec<CatalogOutcome> {
        std::mem::take(&mut self.catalog_out)
    }

    /// Asks for a linearizable read of `group`'s state here, named `waiter` in
    /// its outcome ([`RaftSide::take_reads`]): the reads of one turn to one
    /// group share one ReadIndex (`Group::read_index`, asked at the turn's drain).
    /// Refused when this replica does not serve as the group's leader.
    pub fn ask_read(&mut self, group: u32, waiter: u64) -> Result<(), SyncRefused> {
        self.groups
            .get(&group)
            .filter(|r| r.group.serving())
            .ok_or(SyncRefused::NotLeader)?;
        self.reads_asked.push((group, waiter));
        self.proposed.push(group);
        Ok(())
    }

    /// Reads whose ReadIndex is asked or in flight.
    pub fn reads_waiting(&self) -> usize {
        self.reads_asked.len() + self.reads_waiting.len()
    }

    /// The reads confirmed (their group's commit index here covers the read
    /// index: read it now, bounded by [`RaftSide::commit_index`]) or lost since
    /// the last call.
    pub fn take_reads(&mut self) -> Vec<ReadOutcome> {
        std::mem::take(&mut self.reads_out)
    }

    /// `group`'s commit index here (0 for a group this shard does not hold).
    pub fn commit_index(&self, group: u32) -> u64 {
        self.groups
            .get(&group)
            .map_or(0, |r| r.group.commit_index())
    }

    /// The turn's reads asked of their groups, one ReadIndex per group; a group
    /// that refuses loses them.
    fn ask_read_indexes(&mut self) {
        if self.reads_asked.is_empty() {
            return;
        }
        let mut asked = std::mem::take(&mut self.reads_asked);
        asked.sort_by_key(|&(group, _)| group);
        let mut ctx = None;
        for (i, &(group, waiter)) in asked.iter().enumerate() {
            if i == 0 || asked[i - 1].0 != group {
                self.read_ctx += 1;
                let r = self.groups.get_mut(&group);
                ctx = r
                    .and_then(|r| r.group.read_index(self.read_ctx).ok())
                    .map(|()| self.read_ctx);
            }
            match ctx {
                Some(ctx) => self.reads_waiting.push(ReadWait { group, ctx, waiter }),
                None => self.reads_out.push(ReadOutcome::Lost { waiter }),
            }
        }
    }

    /// What the drains told of the proposals since the last call, in order.
    pub fn take_events(&mut self) -> std::vec::Drain<'_, RaftEvent> {
        self.events.drain(..)
    }

    /// A peer's messages for this shard's groups at `now_ms`, `(slot id, bytes)`
    /// each: every one stepped, then the groups they reached drained as one batch
    /// (one log sync, one `raft_state` sync, one frame per peer for all their
    /// answers). A message for a group this shard does not hold, or bytes the group
    /// refuses, is dropped; returns how many were.
    pub fn on_messages(
        &mut self,
        now_ms: u64,
        from: NodeId,
        messages: &[(u32, Vec<u8>)],
        log: &mut MessageLog,
        status: &RaftStatus,
    ) -> usize {
        let mut dropped = 0;
        let mut ids: Vec<u32> = Vec::with_capacity(messages.len());
        for (slot_id, bytes) in messages {
            let Some(r) = self.groups.get_mut(slot_id) else {
                dropped += 1;
                continue;
            };
            if r.group.step(raft_id(from), bytes).is_err() {
                dropped += 1;
            }
            ids.push(*slot_id);
        }
        ids.sort_unstable();
        ids.dedup();
        if !ids.is_empty() {
            self.drain(&ids, now_ms, log, status);
        }
        dropped
    }

    /// The messages to send, per peer; the caller sends each peer's in one frame
    /// and reports the peers whose link refused ([`RaftSide::unreachable`]).
    pub fn take_outbox(&mut self) -> BTreeMap<NodeId, Vec<(u32, Vec<u8>)>> {
        std::mem::take(&mut self.outbox)
    }

    /// `peer`'s link refused its frame: every group stops streaming to it until it
    /// answers again.
    pub fn unreachable(&mut self, peer: NodeId) {
        for r in self.groups.values_mut() {
            r.group.report_unreachable(raft_id(peer));
        }
    }

    /// A write failed: every replica of this shard leaves its group (the log or
    /// the file is poisoned for all of them): logged, counted, unpublished.
    fn leave_all(&mut self, e: &ReplicatedError, status: &RaftStatus) {
        tracing::error!(error = %e, "a replica's write failed: this shard's replicas leave their groups");
        self.failed += self.groups.len() as u64;
        for &slot_id in self.groups.keys() {
            status.publish(slot_id, GroupStatus::default());
            self.events.push(RaftEvent::Lost { group: slot_id });
            catalog_lost(&mut self.catalog_waiting, &mut self.catalog_out, slot_id);
            read_lost(&mut self.reads_waiting, &mut self.reads_out, slot_id);
        }
        for (_, waiter) in self.reads_asked.drain(..) {
            self.reads_out.push(ReadOutcome::Lost { waiter });
        }
        self.groups.clear();
        self.outbox.clear();
        self.out = Outputs::default();
    }

    /// The outputs of the groups `ids`, as one batch: their entries into the log,
    /// one sync of the log, their new terms, votes and configurations staged and
    /// synced at once, then each told its writes are durable and its messages
    /// queued. A failed write takes every group of the shard out (module docs):
    /// the log or the file is poisoned for all of them.
    fn drain(&mut self, ids: &[u32], now_ms: u64, log: &mut MessageLog, status: &RaftStatus) {
        let file = self
            .file
            .as_mut()
            .expect("a shard with groups has its file");
        let mut batch: Vec<(u32, u64)> = Vec::with_capacity(ids.len());
        let mut log_sync = false;
        let mut written: Result<(), ReplicatedError> = Ok(());
        for &slot_id in ids {
            let Some(r) = self.groups.get_mut(&slot_id) else {
                continue;
            };
            r.first_lease_round(now_ms);
            r.group.drain(&mut self.out);
            for (ctx, _index) in self.out.read_states.drain(..) {
                read_confirmed(&mut self.reads_waiting, &mut self.reads_out, slot_id, ctx);
            }
            // An entry of this leader's own term is its own proposal; any other
            // one is applied at its commit.
            let own_term = (r.group.role() == Role::Leader).then(|| r.group.term());
            let mut last = None;
            for p in self.out.persist.drain(..) {
                self.appended.clear();
                self.entries.clear();
                written = written.and_then(|()| {
                    let (appended, entries) = (&mut self.appended, &mut self.entries);
                    let foreign = |term| own_term != Some(term);
                    log_sync |= append(log, slot_id, &p, appended, entries, foreign)?;
                    if settle(&mut r.state, &p) {
                        file.stage(slot_id, &r.state)?;
                    }
                    Ok(())
                });
                let mut seqs = self.appended.iter().map(|a| a.message_seq);
                for e in self.entries.drain(..) {
                    self.events.push(RaftEvent::Appended {
                        group: slot_id,
                        term: e.term,
                        index: e.index,
                        seqs: seqs.by_ref().take(e.messages).collect(),
                        foreign: e.foreign,
                    });
                }
                last = Some(p.number);
            }
            queue_messages(&mut self.out, &mut self.outbox, slot_id);
            // Committed entries answer the proposals made here and apply the
            // others (the commit core), and the catalog's on this node.
            note_committed(
                &mut self.out,
                &mut self.events,
                &mut self.catalog_waiting,
                &mut self.catalog_out,
                (slot_id, &r.voters, &mut r.preferred),
            );
            if let Some(number) = last {
                batch.push((slot_id, number));
            }
        }
        let written = written.and_then(|()| {
            if log_sync && self.fsync_always {
                log.sync(now_ms)?;
            }
            Ok(file.sync_staged()?)
        });
        if let Err(e) = written {
            self.leave_all(&e, status);
            return;
        }
        for (slot_id, number) in batch {
            let r = self.groups.get_mut(&slot_id).expect("drained above");
            r.group.persisted(number, &mut self.out);
            queue_messages(&mut self.out, &mut self.outbox, slot_id);
        }
        self.publish(ids, status);
    }

    /// Each of the groups `ids`: its leader and term published, and a leader
    /// that lost office told to the commit core ([`RaftEvent::Lost`]).
    fn publish(&mut self, ids: &[u32], status: &RaftStatus) {
        for &slot_id in ids {
            if let Some(r) = self.groups.get_mut(&slot_id) {
                self.snapshots_refused += r.group.take_snapshots_refused();
                let leads = r.group.role() == Role::Leader;
                if r.led && !leads {
                    self.events.push(RaftEvent::Lost { group: slot_id });
                    catalog_lost(&mut self.catalog_waiting, &mut self.catalog_out, slot_id);
                    read_lost(&mut self.reads_waiting, &mut self.reads_out, slot_id);
                }
                r.led = leads;
                let term = r.group.term();
                // A leader claims once it serves under a lease: every authority
                // call the claim brings here finds the lease.
                let leased = r.group.lease_start().is_some();
                if r.group.serving() && leased && term > r.claimed_term {
                    r.claimed_term = term;
                    self.won.push((slot_id, term));
                }
                let leader = match leads {
                    true => Some(r.group.id()),
                    false => r.group.leader(),
                }
                .map(|id| id - 1);
                let lease_end_ms = (r.group.lease_start()).map_or(0, |s| s + self.lease_ms);
                let s = GroupStatus {
                    leader,
                    term: r.group.term(),
                    preferred: r.preferred,
                    lease_end_ms,
                };
                status.publish(slot_id, s);
            }
        }
    }
}

/// The entries `slot_id`'s drain committed (`out.committed`): told to the commit
/// core ([`RaftEvent::Committed`]), each catalog entry given out to apply (with
/// the change proposed here it answers), the changes cut answered lost; a
/// leader preference for this group naming one of its `voters` kept in
/// `preferred` (one naming another node is ignored: the API refuses it).
fn note_committed(
    out: &mut Outputs,
    events: &mut Vec<RaftEvent>,
    waiting: &mut Vec<CatalogWait>,
    catalog_out: &mut Vec<CatalogOutcome>,
    (slot_id, voters, preferred): (u32, &[NodeId], &mut Option<NodeId>),
) {
    for c in out.committed.drain(..) {
        events.push(RaftEvent::Committed {
            group: slot_id,
            term: c.term,
            index: c.index,
        });
        let waiter = catalog_committed(waiting, catalog_out, slot_id, c.term, c.index);
        if let Some(op) = catalog_of(&c.data) {
            if let Some(CatalogOp::PreferLeader {
                slot_id: s,
                node_id,
            }) = CatalogOp::decode(op)
            {
                if s == slot_id && voters.contains(&node_id) {
                    *preferred = Some(node_id);
                }
            }
            catalog_out.push(CatalogOutcome::Apply {
                op: op.to_vec(),
                waiter,
            });
        }
    }
}

/// `group`'s entry at `index` committed in `term`: the change proposed here at
/// that index and term is its `waiter` (returned); any other waiting at or below
/// `index` was cut (lost).
fn catalog_committed(
    waiting: &mut Vec<CatalogWait>,
    out: &mut Vec<CatalogOutcome>,
    group: u32,
    term: u64,
    index: u64,
) -> Option<u64> {
    let mut answered = None;
    waiting.retain(|w| {
        if w.group != group || w.index > index {
            return true;
        }
        if w.index == index && w.term == term {
            answered = Some(w.waiter);
        } else {
            out.push(CatalogOutcome::Lost { waiter: w.waiter });
        }
        false
    });
    answered
}

/// Every change proposed here to `group` lost (its replica left office).
fn catalog_lost(waiting: &mut Vec<CatalogWait>, out: &mut Vec<CatalogOutcome>, group: u32) {
    waiting.retain(|w| {
        let lost = w.group == group;
        if lost {
            out.push(CatalogOutcome::Lost { waiter: w.waiter });
        }
        !lost
    });
}

/// The messages of `slot_id`'s group drained into `out`, queued per peer.
fn queue_messages(
    out: &mut Outputs,
    outbox: &mut BTreeMap<NodeId, Vec<(u32, Vec<u8>)>>,
    slot_id: u32,
) {
    for (to, bytes) in out.messages.drain(..) {
        outbox.entry(to - 1).or_default().push((slot_id, bytes));
    }
}

/// Where the leader on node `me` of a group of `voters` (placement order) hands
/// its leadership over, if anywhere: the preferred leader is the first voter that
/// is not draining, in the order `preferred` (an operator's choice) then the
/// placement's (the slot id's home first), taken once it holds the whole log and
/// answers (no proposal stalls on a transfer to a replica that is down or
/// behind); a draining leader hands over to the first voter in that order that
/// is not draining and is caught up.
fn hand_over_to(
    me: NodeId,
    voters: &[NodeId],
    preferred: Option<NodeId>,
    draining: impl Fn(NodeId) -> bool,
    caught_up: impl Fn(NodeId) -> bool,
) -> Option<NodeId> {
    let first = preferred.filter(|p| voters.contains(p));
    let rest = voters.iter().copied().filter(|&n| Some(n) != first);
    let mut others = first.into_iter().chain(rest).filter(|&n| !draining(n));
    if draining(me) {
        return others.find(|&n| caught_up(n));
    }
    others.next().filter(|&n| n != me && caught_up(n))
}

/// The commit core proposes each turn's SENDs to a group here
/// (`domain::send::commit::Replicas`).
impl Replicas for RaftSide {
    fn propose(
        &mut self,
        group: u32,
        mark: u64,
        messages: &[NewMessage<'_>],
    ) -> Result<(u64, u64), ReasonCode> {
        let Some(r) = self.groups.get_mut(&group) else {
            return Err(ReasonCode::FORWARD_SEND_PACKET_ERROR);
        };
        // A new leader serves once it committed an entry of its term: until then
        // an entry of its predecessor may hold this very SEND, not yet applied.
        if !r.group.serving() {
            return Err(ReasonCode::FORWARD_SEND_PACKET_ERROR);
        }
        let placed = r.group.propose(encode_messages(mark, messages));
        if placed.is_ok() {
            self.proposed.push(group);
        }
        placed.map_err(|e| match e {
            GroupError::NotLeader { .. } => ReasonCode::FORWARD_SEND_PACKET_ERROR,
            _ => ReasonCode::SYSTEM_ERROR,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A leader hands over to the first voter that does not drain once it is
    /// caught up (the home, unless it drains); a draining leader to the first
    /// other voter that is caught up and does not drain.
    #[test]
    fn a_leader_hands_over_to_the_first_voter_not_draining() {
        let voters = [1, 2, 3];
        let none = |_: NodeId| false;
        let all = |_: NodeId| true;
        assert_eq!(
            hand_over_to(1, &voters, None, none, all),
            None,
            "the home leads"
        );
        assert_eq!(hand_over_to(2, &voters, None, none, all), Some(1));
        assert_eq!(
            hand_over_to(2, &voters, None, none, none),
            None,
            "1 is behind"
        );
        let one = |n: NodeId| n == 1;
        assert_eq!(
            hand_over_to(2, &voters, None, one, all),
            None,
            "1 drains: 2 leads"
        );
        assert_eq!(hand_over_to(3, &voters, None, one, all), Some(2));
        assert_eq!(
            hand_over_to(1, &voters, None, one, all),
            Some(2),
            "1 leaves"
        );
        let three = |n: NodeId| n == 3;
        assert_eq!(
            hand_over_to(1, &voters, None, one, three),
            Some(3),
            "2 is behind"
        );
        assert_eq!(
            hand_over_to(1, &voters, None, one, none),
            None,
            "nobody caught up"
        );
        assert_eq!(hand_over_to(1, &voters, None, all, all), None, "all drain");
    }

    /// An operator's preferred leader comes before the placement's order: the
    /// home hands over to it once it is caught up, it keeps the group, and a
    /// draining one hands over to the placement's first; a preference naming no
    /// voter is ignored.
    #[test]
    fn a_preferred_leader_comes_before_the_placements_order() {
        let voters = [1, 2, 3];
        let none = |_: NodeId| false;
        let all = |_: NodeId| true;
        let three = Some(3);
        assert_eq!(hand_over_to(1, &voters, three, none, all), Some(3));
        assert_eq!(hand_over_to(2, &voters, three, none, all), Some(3));
        assert_eq!(
            hand_over_to(3, &voters, three, none, all),
            None,
            "3 keeps it"
        );
        assert_eq!(
            hand_over_to(1, &voters, three, none, none),
            None,
            "3 is behind"
        );
        let drains = |n: NodeId| n == 3;
        assert_eq!(hand_over_to(3, &voters, three, drains, all), Some(1));
        assert_eq!(hand_over_to(1, &voters, three, drains, all), None);
        assert_eq!(
            hand_over_to(2, &voters, Some(9), none, all),
            Some(1),
            "9 is no voter"
        );
    }

    /// Replicas start at the slot id's position and wrap; never more than the
    /// nodes.
    #[test]
    fn replicas_follow_the_config_order_from_the_slot_id() {
        let nodes = [10, 20, 30, 40];
        assert_eq!(replica_nodes(0, &nodes, 3), vec![10, 20, 30]);
        assert_eq!(replica_nodes(3, &nodes, 3), vec![40, 10, 20]);
        assert_eq!(replica_nodes(6, &nodes, 2), vec![30, 40]);
        assert_eq!(replica_nodes(1, &nodes, 9), vec![20, 30, 40, 10]);
    }

    /// Status: nothing known is `None`; a published leader and term read back and
    /// count for their node.
    #[test]
    fn status_reads_back_what_was_published() {
        let s = RaftStatus::new(4);
        assert_eq!(s.of(1), None);
        assert_eq!(s.of(9), None);
        let status = |leader, term, preferred, lease_end_ms| GroupStatus {
            leader,
            term,
            preferred,
            lease_end_ms,
        };
        s.publish(1, status(Some(20), 3, None, 0));
        s.publish(2, status(None, 4, Some(0), 0));
        s.publish(3, status(Some(20), 5, Some(30), 700));
        assert!(!s.lease_holds(1, 0), "no lease");
        assert!(s.lease_holds(3, 699));
        assert!(!s.lease_holds(3, 700), "ended");
        assert!(!s.lease_holds(9, 0), "no such slot id");
        assert_eq!((s.of(1), s.of(2)), (Some((20, 3)), Some((0, 4))));
        assert_eq!((s.led_by(20), s.led_by(10)), (2, 0));
        assert_eq!(
            (s.preferred_of(1), s.preferred_of(2), s.preferred_of(3)),
            (None, Some(0), Some(30))
        );
        assert_eq!(s.preferred_of(9), None);
    }

    /// A change proposed here is answered by the commit of its own index and term;
    /// a commit at or past its index in another term, or a commit further on,
    /// cuts it (lost); its group's leadership lost loses the rest; other groups'
    /// changes wait on. Catalog entries are given out to apply, others are not.
    #[test]
    fn catalog_changes_are_answered_by_their_own_commit_or_lost() {
        let wait = |group, term, index, waiter| CatalogWait {
            group,
            term,
            index,
            waiter,
        };
        let mut waiting = vec![
            wait(1, 2, 5, 10),
            wait(1, 2, 6, 11),
            wait(1, 2, 7, 12),
            wait(2, 2, 5, 13),
        ];
        let mut out = Vec::new();
        assert_eq!(catalog_committed(&mut waiting, &mut out, 1, 2, 4), None);
        assert_eq!(catalog_committed(&mut waiting, &mut out, 1, 2, 5), Some(10));
        assert_eq!(catalog_committed(&mut waiting, &mut out, 1, 3, 6), None);
        assert_eq!(out, vec![CatalogOutcome::Lost { waiter: 11 }]);
        catalog_lost(&mut waiting, &mut out, 1);
        assert_eq!(out[1..], [CatalogOutcome::Lost { waiter: 12 }]);
        assert_eq!(waiting, vec![wait(2, 2, 5, 13)]);
        out.clear();
        let mut committed = Outputs {
            committed: vec![
                replica::Committed {
                    index: 5,
                    term: 2,
                    data: encode_catalog(b"op"),
                },
                replica::Committed {
                    index: 6,
                    term: 2,
                    data: Vec::new(),
                },
            ],
            ..Outputs::default()
        };
        let mut events = Vec::new();
        let mut preferred = None;
        let group = (2, &[1, 2, 3][..], &mut preferred);
        note_committed(&mut committed, &mut events, &mut waiting, &mut out, group);
        assert_eq!(
            out,
            vec![CatalogOutcome::Apply {
                op: b"op".to_vec(),
                waiter: Some(13)
            }]
        );
        assert_eq!(events.len(), 2);
        assert!(waiting.is_empty());
        assert_eq!(preferred, None);
    }

    /// A committed leader preference for the group naming one of its voters is
    /// kept (the last one wins); one for another group or naming no voter is not.
    #[test]
    fn a_committed_leader_preference_is_kept_by_its_groups_replicas() {
        let prefer = |index, slot_id, node_id| replica::Committed {
            index,
            term: 1,
            data: encode_catalog(&CatalogOp::PreferLeader { slot_id, node_id }.encode()),
        };
        let mut committed = Outputs {
            committed: vec![prefer(1, 2, 3), prefer(2, 7, 1), prefer(3, 2, 9)],
            ..Outputs::default()
        };
        let (mut events, mut waiting, mut out, mut preferred) = (vec![], vec![], vec![], None);
        let group = (2, &[1, 2, 3][..], &mut preferred);
        note_committed(&mut committed, &mut events, &mut waiting, &mut out, group);
        assert_eq!(preferred, Some(3), "the other group's and node 9's ignored");
        assert_eq!(
            out.len(),
            3,
            "each applied as a catalog entry (answers its waiter)"
        );
        committed.committed = vec![prefer(4, 2, 1)];
        let group = (2, &[1, 2, 3][..], &mut preferred);
        note_committed(&mut committed, &mut events, &mut waiting, &mut out, group);
        assert_eq!(preferred, Some(1));
    }
}
