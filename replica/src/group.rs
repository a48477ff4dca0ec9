//! One replicated group, sans-IO: raft-rs's `RawNode` driven by ticks, peers'
//! bytes and proposals, giving out the bytes to send and the entries committed.
//!
//! # Contract
//! - Time is ticks: the caller calls [`Group::tick`] at its own interval; the
//!   election timeout is `election_ticks` to `2 × election_ticks - 1` ticks, the
//!   heartbeat every `heartbeat_ticks`.
//! - Every randomized election timeout comes from the group's seeded RNG, never
//!   from raft-rs's `thread_rng`: after each call that may have reset raft's
//!   timers (a changed term, role or leader, or a timeout raft drew itself) a new
//!   one is drawn from the seed's stream and set. The same seed and the same
//!   inputs give the same outputs.
//! - Pre-vote and check-quorum are on: a partitioned replica does not raise the
//!   term when it comes back, and a leader that lost its quorum steps down.
//! - Only the leader proposes ([`GroupError::NotLeader`] names the leader it
//!   knows); peers' proposals are refused by the wire ([`crate::wire`]).
//! - After any input, [`Group::drain`] hands out what to send, what was committed,
//!   and what to make durable ([`Persist`], in our own types: the contract is in
//!   [`crate::durable`]). The messages that depend on a write (a vote, an
//!   append's acknowledgement) are held until the caller says it is durable
//!   ([`Group::persisted`]); a leader's appends leave at once. Raft reads its log
//!   from memory here, bounded by `log_entries_max` (proposals past it are refused
//!   with [`GroupError::LogFull`]) and compacted by [`Group::compact`] to
//!   `log_entries_retained` committed entries; a snapshot raft would send to a
//!   follower behind them is not sent (catch-up is the caller's, not built): the
//!   follower is reported failed, probed again later, and counted
//!   ([`Group::take_snapshots_refused`]).
//! - A restart ([`Group::restart`]) starts from what the caller made durable
//!   ([`Durable`]), handing its committed entries out again from the first (the
//!   state machine replays them).
//! - **Lease**: a serving leader starts rounds of heartbeats at the caller's time
//!   `now` ([`Group::renew_lease`], a ReadIndex of the group's own, never given
//!   out in [`Outputs::read_states`]); once a quorum answered a round,
//!   [`Group::lease_start`] is its `now`. No replica can have been elected since
//!   that round left less than the shortest election timeout ago: a follower
//!   that answered it waits `election_ticks` ticks of its own clock from then
//!   before it campaigns, and pre-vote and check-quorum keep the others from
//!   electing without it. So the caller may treat this replica as the only
//!   leader until `lease_start + span`, `span` shorter than `election_ticks - 1`
//!   ticks (a follower's first tick after a heartbeat may come at once) less a
//!   margin for the clocks' drift. The lease is lost with the term or the role
//!   and while a transfer is under way (the target campaigns at once), and
//!   starts again only from rounds started after.

use std::collections::VecDeque;

use raft::prelude::{ConfChange, ConfChangeV2, Entry, EntryType, Message, MessageType};
use raft::storage::MemStorage;
use raft::{Config, RawNode, StateRole};
use rand::Rng;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::durable::{self, ConfState, Durable, Persist};
use crate::wire::{self, WireError};

/// How a group runs (the node's config gives each field).
#[derive(Debug, Clone)]
pub struct GroupConfig {
    /// This replica's id (its node's id; not 0).
    pub id: u64,
    /// The voters at creation (this replica among them or among the learners).
    pub voters: Vec<u64>,
    /// The learners at creation (they replicate, they do not vote).
    pub learners: Vec<u64>,
    /// The shortest election timeout, in ticks (the longest is twice it, less one).
    pub election_ticks: usize,
    /// Ticks between a leader's heartbeats (less than `election_ticks`).
    pub heartbeat_ticks: usize,
    /// The seed of the election timeouts.
    pub seed: u64,
    /// The most entry bytes in one append message.
    pub msg_bytes_max: u64,
    /// The most append messages in flight to one follower.
    pub inflight_msgs_max: usize,
    /// The most entries the in-memory log holds.
    pub log_entries_max: u64,
    /// Entries kept in memory below the last one handed out as committed, for
    /// followers that lag ([`Group::compact`]; at least 1).
    pub log_entries_retained: u64,
    /// The most steps handed out to make durable and not yet reported durable
    /// ([`Group::persisted`]); past it [`Group::drain`] hands out nothing more
    /// (raft keeps the work) until some are.
    pub unsynced_steps_max: usize,
}

impl GroupConfig {
    /// Defaults for a group of `voters`, replica `id`, seeded with `seed`.
    pub fn new(id: u64, voters: Vec<u64>, seed: u64) -> GroupConfig {
        GroupConfig {
            id,
            voters,
            learners: Vec::new(),
            election_ticks: 10,
            heartbeat_ticks: 2,
            seed,
            msg_bytes_max: 1 << 20,
            inflight_msgs_max: 256,
            log_entries_max: 1 << 20,
            log_entries_retained: 4096,
            unsynced_steps_max: 64,
        }
    }
}

/// Why a call was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupError {
    /// The config does not make a group (raft-rs's check, or ours).
    #[error("bad group config: {0}")]
    Config(String),
    /// Only the leader proposes.
    #[error("not the leader (leader: {leader:?})")]
    NotLeader {
        /// The leader this replica knows of, if any.
        leader: Option<u64>,
    },
    /// The in-memory log holds `log_entries_max` entries.
    #[error("the log holds its limit of {0} entries")]
    LogFull(u64),
    /// The leader dropped the proposal: it is handing leadership over (retry at
    /// the next leader).
    #[error("the proposal was dropped: leadership is being handed over")]
    Dropped,
    /// A peer's bytes were refused.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// raft-rs refused the input (a step from a replica it does not know).
    #[error("raft refused: {0}")]
    Raft(String),
}

/// A replica's role in its group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Follows a leader (or waits for one).
    Follower,
    /// Asks whether it could win an election (pre-vote), term unchanged.
    PreCandidate,
    /// Runs an election in a new term.
    Candidate,
    /// Leads the group: proposes, replicates, commits.
    Leader,
}

/// An entry committed in the group, in log order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Committed {
    /// Its log index.
    pub index: u64,
    /// The term it was proposed in.
    pub term: u64,
    /// A proposal's bytes; empty for raft's own entries (a new leader's no-op, a
    /// conf change, applied here).
    pub data: Vec<u8>,
}

/// What one [`Group::drain`] (or [`Group::persisted`]) gives out.
#[derive(Debug, Default)]
pub struct Outputs {
    /// `(to, bytes)`: messages for peers, in our encoding, in order.
    pub messages: Vec<(u64, Vec<u8>)>,
    /// Entries committed since the last drain, in log order.
    pub committed: Vec<Committed>,
    /// What to make durable, in order (module docs).
    pub persist: Vec<Persist>,
    /// `(ctx, index)` of each [`Group::read_index`] confirmed: a quorum
    /// acknowledged this replica as leader after it was asked, so a read of the
    /// state machine once it applied `index` is linearizable.
    pub read_states: Vec<(u64, u64)>,
}

/// One replica of one group (module docs).
pub struct Group {
    node: RawNode<MemStorage>,
    /// Per step not yet durable: its number and the messages that wait for it
    /// (at most `unsynced_steps_max`).
    held: VecDeque<(u64, Vec<Message>)>,
    unsynced_steps_max: usize,
    rng: ChaCha8Rng,
    /// `(term, role, leader)` when the timeout was last drawn, and the timeout.
    drawn: ((u64, Role, u64), usize),
    election_ticks: usize,
    heartbeat_ticks: usize,
    log_entries_max: u64,
    log_entries_retained: u64,
    /// Followers a snapshot was due to and not sent (reported after the drain).
    snapshots_refused: Vec<u64>,
    /// Snapshots not sent since the last [`Group::take_snapshots_refused`].
    snapshots_refused_count: u64,
    /// The leader lease (module docs).
    lease: Lease,
}

/// A leader's lease rounds: the context of a round is `LEASE_CTX | n`, apart from
/// the caller's reads (whose contexts are below `LEASE_CTX`).
#[derive(Debug, Default)]
struct Lease {
    /// The term the rounds and `start` belong to.
    term: u64,
    /// Rounds not yet confirmed, `(n, now)`, oldest first, at most
    /// [`LEASE_ROUNDS_MAX`] (past it the oldest is forgotten: it grants nothing).
    rounds: VecDeque<(u64, u64)>,
    /// The last round's number.
    next: u64,
    /// The `now` of the latest round a quorum confirmed.
    start: Option<u64>,
}

/// The bit that marks a lease round's context.
const LEASE_CTX: u64 = 1 << 63;

/// Lease rounds waiting for a quorum at once (a leader cut off from its quorum
/// starts one per renewal until it steps down).
const LEASE_ROUNDS_MAX: usize = 32;

impl Lease {
    /// Forgets the rounds and the start (a new term, a transfer).
    fn reset(&mut self, term: u64) {
        self.term = term;
        self.rounds.clear();
        self.start = None;
    }

    /// Round `n` confirmed: the lease starts at its `now` (rounds before it are
    /// confirmed by it too: raft answers in order).
    fn confirmed(&mut self, n: u64) {
        while let Some(&(m, at)) = self.rounds.front() {
            if m > n {
                break;
            }
            self.rounds.pop_front();
            if m == n {
                self.start = Some(self.start.map_or(at, |s| s.max(at)));
            }
        }
    }
}

fn role(r: StateRole) -> Role {
    match r {
        StateRole::Follower => Role::Follower,
        StateRole::PreCandidate => Role::PreCandidate,
        StateRole::Candidate => Role::Candidate,
        StateRole::Leader => Role::Leader,
    }
}

impl Group {
    /// A new replica with an empty log and `cfg`'s voters and learners (its
    /// durable state is [`Group::initial`]).
    pub fn new(cfg: &GroupConfig) -> Result<Group, GroupError> {
        Group::open(cfg, &Group::initial(cfg))
    }

    /// The durable state of a new replica of `cfg`: no record, `cfg`'s members.
    pub fn initial(cfg: &GroupConfig) -> Durable {
        Durable::new(cfg.voters.clone(), cfg.learners.clone())
    }

    /// A replica restarted from what it made durable (its configuration is the
    /// durable one; `cfg`'s voters and learners are not read). Its committed
    /// entries are handed out again from the first.
    pub fn restart(cfg: &GroupConfig, durable: &Durable) -> Result<Group, GroupError> {
        Group::open(cfg, durable)
    }

    fn open(cfg: &GroupConfig, durable: &Durable) -> Result<Group, GroupError> {
        let config = Config {
            id: cfg.id,
            election_tick: cfg.election_ticks,
            heartbeat_tick: cfg.heartbeat_ticks,
            max_size_per_msg: cfg.msg_bytes_max,
            max_inflight_msgs: cfg.inflight_msgs_max,
            pre_vote: true,
            check_quorum: true,
            // A commit is not broadcast on its own: followers learn it with the
            // next append or heartbeat (half the messages of a SEND; a follower
            // applies later, and a new leader commits all before it serves).
            skip_bcast_commit: true,
            ..Config::default()
        };
        config
            .validate()
            .map_err(|e| GroupError::Config(e.to_string()))?;
        if cfg.log_entries_max == 0 || cfg.unsynced_steps_max == 0 || cfg.log_entries_retained == 0
        {
            return Err(GroupError::Config(
                "log_entries_max, log_entries_retained and unsynced_steps_max must be at least 1"
                    .into(),
            ));
        }
        let storage = MemStorage::new();
        {
            let mut w = storage.wl();
            w.set_hardstate(durable::raft_hard_state(&durable.hard_state));
            w.set_conf_state(durable::raft_conf_state(&durable.conf_state));
            let entries: Vec<Entry> = durable.records.iter().map(durable::entry_of).collect();
            w.append(&entries)
                .map_err(|e| GroupError::Config(format!("the durable log: {e}")))?;
        }
        let logger = slog::Logger::root(slog::Discard, slog::o!());
        let node = RawNode::new(&config, storage, &logger)
            .map_err(|e| GroupError::Config(e.to_string()))?;
        let mut g = Group {
            node,
            held: VecDeque::new(),
            unsynced_steps_max: cfg.unsynced_steps_max,
            rng: ChaCha8Rng::seed_from_u64(cfg.seed),
            drawn: ((0, Role::Follower, 0), 0),
            election_ticks: cfg.election_ticks,
            heartbeat_ticks: cfg.heartbeat_ticks,
            log_entries_max: cfg.log_entries_max,
            log_entries_retained: cfg.log_entries_retained,
            snapshots_refused: Vec::new(),
            snapshots_refused_count: 0,
            lease: Lease::default(),
        };
        g.draw_timeout();
        Ok(g)
    }

    /// This replica's id.
    pub fn id(&self) -> u64 {
        self.node.raft.id
    }

    /// The current term.
    pub fn term(&self) -> u64 {
        self.node.raft.term
    }

    /// This replica's role.
    pub fn role(&self) -> Role {
        role(self.node.raft.state)
    }

    /// The leader this replica knows of.
    pub fn leader(&self) -> Option<u64> {
        Some(self.node.raft.leader_id).filter(|&l| l != raft::INVALID_ID)
    }

    /// Whether this replica leads and has committed an entry of its own term (the
    /// empty entry raft appends at election): every entry of an earlier term is
    /// then committed here too, so what its predecessors committed is known before
    /// it serves.
    pub fn serving(&self) -> bool {
        self.role() == Role::Leader && self.node.raft.commit_to_current_term()
    }

    /// The highest index known committed.
    pub fn commit_index(&self) -> u64 {
        self.node.raft.raft_log.committed
    }

    /// The election timeout now in force, in ticks.
    pub fn election_timeout_ticks(&self) -> usize {
        self.node.raft.randomized_election_timeout()
    }

    /// One tick of the caller's clock.
    pub fn tick(&mut self) {
        self.node.tick();
        self.redraw_if_reset();
    }

    /// Tick number `count` of a clock the caller shares among its groups: one
    /// tick, and a leader whose heartbeats are out of phase with `count` is ticked
    /// ahead until they fall on the ticks where `count % heartbeat_ticks == 0`
    /// (at most `heartbeat_ticks - 1` extra ticks, once per term). So all the
    /// groups led behind one clock beat on the same ticks, and their heartbeats
    /// to a peer share one frame.
    pub fn tick_at(&mut self, count: u64) {
        self.tick();
        let phase = (count % self.heartbeat_ticks as u64) as usize;
        for _ in 1..self.heartbeat_ticks {
            if self.role() != Role::Leader || self.node.raft.heartbeat_elapsed() == phase {
                break;
            }
            self.tick();
        }
    }

    /// Bytes from the link of replica `peer`.
    pub fn step(&mut self, peer: u64, bytes: &[u8]) -> Result<(), GroupError> {
        let m = wire::decode(bytes, self.id(), peer)?;
        let result = self.node.step(m);
        self.redraw_if_reset();
        result.map_err(|e| GroupError::Raft(e.to_string()))
    }

    /// Proposes `data` (the leader only; module docs): the term and index of its
    /// entry (it commits there in that term, or is cut).
    pub fn propose(&mut self, data: Vec<u8>) -> Result<(u64, u64), GroupError> {
        if self.role() != Role::Leader {
            return Err(GroupError::NotLeader {
                leader: self.leader(),
            });
        }
        let log = &self.node.raft.raft_log;
        let held = log.last_index() + 1 - log.first_index();
        if held >= self.log_entries_max {
            return Err(GroupError::LogFull(self.log_entries_max));
        }
        let result = self.node.propose(Vec::new(), data);
        self.redraw_if_reset();
        result.map_err(|e| match e {
            raft::Error::ProposalDropped => GroupError::Dropped,
            e => GroupError::Raft(e.to_string()),
        })?;
        Ok((self.term(), self.node.raft.raft_log.last_index()))
    }

    /// Starts an election now (a planned leader change, or a test).
    pub fn campaign(&mut self) -> Result<(), GroupError> {
        let result = self.node.campaign();
        self.redraw_if_reset();
        result.map_err(|e| GroupError::Raft(e.to_string()))
    }

    /// Hands leadership to `to` (the leader only; others ignore it). The lease is
    /// lost (module docs).
    pub fn transfer_leader(&mut self, to: u64) {
        self.node.transfer_leader(to);
        if self.transferring() {
            self.lease.reset(self.term());
        }
        self.redraw_if_reset();
    }

    /// Starts a lease round at the caller's time `now` (module docs): a serving
    /// leader that is not handing over sends a round of heartbeats; any other
    /// replica does nothing.
    pub fn renew_lease(&mut self, now: u64) {
        if !self.serving() || self.transferring() {
            return;
        }
        if self.lease.term != self.term() {
            self.lease.reset(self.term());
        }
        if self.lease.rounds.len() == LEASE_ROUNDS_MAX {
            self.lease.rounds.pop_front();
        }
        self.lease.next += 1;
        self.lease.rounds.push_back((self.lease.next, now));
        let ctx = LEASE_CTX | self.lease.next;
        self.node.read_index(ctx.to_be_bytes().to_vec());
    }

    /// The `now` of the latest lease round a quorum confirmed in this term, while
    /// this replica leads and is not handing over; `None` otherwise (module docs:
    /// the caller's lease runs to `lease_start + span`).
    pub fn lease_start(&self) -> Option<u64> {
        let holds =
            self.role() == Role::Leader && !self.transferring() && self.lease.term == self.term();
        self.lease.start.filter(|_| holds)
    }

    /// Whether this replica leads and `peer` answered it within the last election
    /// timeout and holds every entry it has: a transfer to `peer` would end at
    /// once rather than stall the proposals (a leader handing over drops them).
    pub fn is_caught_up(&self, peer: u64) -> bool {
        let raft = &self.node.raft;
        self.role() == Role::Leader
            && (raft.prs().get(peer))
                .is_some_and(|p| p.recent_active && p.matched >= raft.raft_log.last_index())
    }

    /// Asks for a linearizable read (raft's ReadIndex, read-only "safe": the
    /// leader confirms its office with a round of heartbeats): once a quorum
    /// answered, a drain gives `(ctx, index)` in [`Outputs::read_states`]. Only a
    /// serving leader answers; a leader that loses office first never does (the
    /// caller fails its reads when the group reports the loss). `ctx` names the
    /// request (the caller's counter).
    pub fn read_index(&mut self, ctx: u64) -> Result<(), GroupError> {
        debug_assert!(ctx & LEASE_CTX == 0, "the lease's contexts are the group's");
        if !self.serving() {
            return Err(GroupError::NotLeader {
                leader: self.leader(),
            });
        }
        self.node.read_index(ctx.to_be_bytes().to_vec());
        Ok(())
    }

    /// Whether this leader is handing leadership over (it drops proposals until
    /// the transfer ends or times out).
    pub fn transferring(&self) -> bool {
        self.node.raft.lead_transferee.is_some()
    }

    /// The link to `peer` is down: the leader stops streaming appends to it.
    pub fn report_unreachable(&mut self, peer: u64) {
        self.node.report_unreachable(peer);
    }

    /// Hands out the messages to send, the entries committed and what to make
    /// durable since the last call (module docs). The messages that depend on
    /// a write wait for [`Group::persisted`]; with `unsynced_steps_max` steps not
    /// yet durable, nothing more is handed out.
    pub fn drain(&mut self, out: &mut Outputs) {
        while self.held.len() < self.unsynced_steps_max && self.node.has_ready() {
            let mut ready = self.node.ready();
            // A leader's appends depend on nothing it writes (raft thesis 10.2.1).
            self.send(ready.take_messages(), out);
            if !ready.snapshot().is_empty() {
                let snap = ready.snapshot().clone();
                if let Err(e) = self.node.mut_store().wl().apply_snapshot(snap) {
                    unreachable!("a snapshot raft handed out applies: {e}");
                }
            }
            for rs in ready.take_read_states() {
                if let Ok(ctx) = <[u8; 8]>::try_from(&rs.request_ctx[..]) {
                    match u64::from_be_bytes(ctx) {
                        ctx if ctx & LEASE_CTX != 0 => self.lease.confirmed(ctx & !LEASE_CTX),
                        ctx => out.read_states.push((ctx, rs.index)),
                    }
                }
            }
            let conf_state = self.apply(ready.take_committed_entries(), out);
            // Raft reads its log from memory; the caller makes the same durable.
            if let Err(e) = self.node.mut_store().wl().append(ready.entries()) {
                unreachable!("entries raft handed out append: {e}");
            }
            if let Some(hs) = ready.hs() {
                self.node.mut_store().wl().set_hardstate(hs.clone());
            }
            out.persist.push(Persist {
                number: ready.number(),
                records: ready.entries().iter().map(durable::record_of).collect(),
                hard_state: ready.hs().map(durable::hard_state_of),
                conf_state,
                sync: ready.must_sync(),
            });
            self.held
                .push_back((ready.number(), ready.take_persisted_messages()));
            self.node.advance_append_async(ready);
            self.node.advance_apply();
        }
        self.report_refused_snapshots();
        self.redraw_if_reset();
    }

    /// The caller made every [`Persist`] up to `number` durable: the messages that
    /// waited for them leave, in order (more may follow at the next drain).
    pub fn persisted(&mut self, number: u64, out: &mut Outputs) {
        self.node.on_persist_ready(number);
        while self.held.front().is_some_and(|(n, _)| *n <= number) {
            if let Some((_, messages)) = self.held.pop_front() {
                self.send(messages, out);
            }
        }
        self.report_refused_snapshots();
    }

    /// Encodes `messages` for their peers. A snapshot is not sent (catch-up from
    /// the message log is not built): its follower is reported failed after the
    /// drain and probed again later, so it waits rather than breaks. A plain
    /// heartbeat to a peer that a heartbeat with a context (a lease round or a
    /// read) of the same batch also reaches is not sent: the other one does all
    /// it does (the commit, the follower's timer, the leader's quorum check), so a
    /// lease round started on a heartbeat tick costs no message.
    fn send(&mut self, messages: Vec<Message>, out: &mut Outputs) {
        let is_beat = |m: &Message| m.msg_type == MessageType::MsgHeartbeat;
        let with_ctx: Vec<u64> = (messages.iter())
            .filter(|m| is_beat(m) && !m.context.is_empty())
            .map(|m| m.to)
            .collect();
        for m in &messages {
            if m.msg_type == MessageType::MsgSnapshot {
                self.snapshots_refused.push(m.to);
            } else if is_beat(m) && m.context.is_empty() && with_ctx.contains(&m.to) {
                continue;
            } else {
                out.messages.push((m.to, wire::encode(m)));
            }
        }
    }

    /// The snapshots not sent, reported failed (outside a ready): the leader
    /// probes the follower again later (and is due to send one again).
    fn report_refused_snapshots(&mut self) {
        for to in std::mem::take(&mut self.snapshots_refused) {
            self.snapshots_refused_count += 1;
            self.node.report_snapshot(to, raft::SnapshotStatus::Failure);
        }
    }

    /// Snapshots this leader was due to send and did not since the last call: a
    /// follower behind the retained entries, waiting for catch-up.
    pub fn take_snapshots_refused(&mut self) -> u64 {
        std::mem::take(&mut self.snapshots_refused_count)
    }

    /// Drops the committed entries handed out more than `log_entries_retained`
    /// below the last one from memory (they are in the caller's log): memory is
    /// bounded by the entries not yet committed plus those retained. A follower
    /// behind what is kept is not sent a snapshot ([`Group::drain`]) and waits.
    pub fn compact(&mut self) {
        let raft_log = &self.node.raft.raft_log;
        let keep_from = raft_log.applied.saturating_sub(self.log_entries_retained) + 1;
        if keep_from > raft_log.first_index() {
            let compacted = self.node.mut_store().wl().compact(keep_from);
            compacted.expect("compacting below the applied index");
        }
    }

    /// The first index held in memory.
    pub fn first_index(&self) -> u64 {
        self.node.raft.raft_log.first_index()
    }

    /// Committed entries: conf changes applied here (the new configuration, if
    /// any, to make durable), the rest handed out.
    fn apply(&mut self, entries: Vec<Entry>, out: &mut Outputs) -> Option<ConfState> {
        let mut changed = None;
        for e in entries {
            let cs = match e.entry_type {
                EntryType::EntryNormal => None,
                EntryType::EntryConfChange => {
                    let cc: ConfChange = protobuf::Message::parse_from_bytes(&e.data)
                        .expect("a committed conf change was re-encoded by us");
                    Some(self.node.apply_conf_change(&cc))
                }
                EntryType::EntryConfChangeV2 => {
                    let cc: ConfChangeV2 = protobuf::Message::parse_from_bytes(&e.data)
                        .expect("a committed conf change was re-encoded by us");
                    Some(self.node.apply_conf_change(&cc))
                }
            };
            match cs {
                Some(Ok(cs)) => {
                    changed = Some(durable::conf_state_of(&cs));
                    self.node.mut_store().wl().set_conf_state(cs);
                }
                Some(Err(err)) => unreachable!("raft refused its own conf change: {err}"),
                None => {}
            }
            let data = match e.entry_type {
                EntryType::EntryNormal => e.data.to_vec(),
                _ => Vec::new(),
            };
            out.committed.push(Committed {
                index: e.index,
                term: e.term,
                data,
            });
        }
        changed
    }

    /// Draws a new election timeout from the seed when raft may have reset its
    /// timers (module docs).
    fn redraw_if_reset(&mut self) {
        let key = (self.term(), self.role(), self.node.raft.leader_id);
        if key != self.drawn.0 || self.election_timeout_ticks() != self.drawn.1 {
            self.draw_timeout();
        }
    }

    fn draw_timeout(&mut self) {
        let t = self
            .rng
            .gen_range(self.election_ticks..2 * self.election_ticks);
        self.node.raft.set_randomized_election_timeout(t);
        let key = (self.term(), self.role(), self.node.raft.leader_id);
        self.drawn = (key, t);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drains `g`, every write reported durable at once, until quiet.
    fn drained(g: &mut Group) -> Outputs {
        drained_into(g, None)
    }

    /// Drains `g`, each write applied to `disk` and reported durable, until quiet.
    fn drained_to(g: &mut Group, disk: &mut Durable) -> Outputs {
        drained_into(g, Some(disk))
    }

    fn drained_into(g: &mut Group, mut disk: Option<&mut Durable>) -> Outputs {
        let mut all = Outputs::default();
        loop {
            let mut out = Outputs::default();
            g.drain(&mut out);
            all.messages.append(&mut out.messages);
            all.committed.append(&mut out.committed);
            all.read_states.append(&mut out.read_states);
            if out.persist.is_empty() {
                return all;
            }
            for p in &out.persist {
                if let Some(d) = disk.as_deref_mut() {
                    d.apply(p);
                }
                g.persisted(p.number, &mut all);
            }
        }
    }

    /// A group of one elects itself, commits its no-op, then each proposal; a
    /// proposal past `log_entries_max` is refused and nothing is lost before it.
    #[test]
    fn a_lone_replica_leads_commits_and_refuses_past_its_log_limit() {
        let mut cfg = GroupConfig::new(1, vec![1], 5);
        cfg.log_entries_max = 3;
        let mut g = Group::new(&cfg).unwrap();
        assert_eq!(
            g.propose(b"early".to_vec()),
            Err(GroupError::NotLeader { leader: None })
        );
        g.campaign().unwrap();
        assert_eq!((g.role(), g.leader(), g.term()), (Role::Leader, Some(1), 1));
        let noop = drained(&mut g).committed;
        assert_eq!(
            noop,
            vec![Committed {
                index: 1,
                term: 1,
                data: Vec::new()
            }]
        );
        assert_eq!(g.propose(b"a".to_vec()), Ok((1, 2)), "term and index");
        assert_eq!(g.propose(b"b".to_vec()), Ok((1, 3)));
        assert_eq!(g.propose(b"c".to_vec()), Err(GroupError::LogFull(3)));
        let data: Vec<Vec<u8>> = drained(&mut g)
            .committed
            .into_iter()
            .map(|c| c.data)
            .collect();
        assert_eq!(data, vec![b"a".to_vec(), b"b".to_vec()]);
        assert_eq!(g.commit_index(), 3);
    }

    /// A restart keeps the term, the vote and the log, and hands the committed
    /// entries out again from the first; a disk that missed the later writes does
    /// not have them.
    #[test]
    fn a_restart_keeps_term_vote_and_log_and_replays_commits() {
        let cfg = GroupConfig::new(1, vec![1], 5);
        let mut g = Group::new(&cfg).unwrap();
        let mut disk = Group::initial(&cfg);
        g.campaign().unwrap();
        let _ = drained_to(&mut g, &mut disk);
        let early = disk.clone();
        g.propose(b"a".to_vec()).unwrap();
        let before = drained_to(&mut g, &mut disk).committed;
        assert_eq!(before.last().map(|c| c.data.clone()), Some(b"a".to_vec()));
        assert_eq!((disk.hard_state.term, disk.hard_state.vote), (1, 1));
        let mut g = Group::restart(&cfg, &disk).unwrap();
        assert_eq!(g.term(), 1);
        g.campaign().unwrap();
        let replayed: Vec<Vec<u8>> = drained_to(&mut g, &mut disk)
            .committed
            .into_iter()
            .map(|c| c.data)
            .collect();
        assert_eq!(&replayed[..2], &[Vec::new(), b"a".to_vec()]);
        assert_eq!(g.term(), 2, "a new election after the restart");
        let mut e = Group::restart(&cfg, &early).unwrap();
        e.campaign().unwrap();
        let seen: Vec<Vec<u8>> = drained(&mut e)
            .committed
            .into_iter()
            .map(|c| c.data)
            .collect();
        assert!(!seen.contains(&b"a".to_vec()), "{seen:?}");
    }

    /// `g`'s next drain: nothing leaves before its writes are durable, and one of
    /// them is the vote for replica 1, synced. Then they are reported durable: the
    /// messages that left.
    fn vote_waits_for_its_write(g: &mut Group) -> Vec<(u64, Vec<u8>)> {
        let mut out = Outputs::default();
        g.drain(&mut out);
        assert!(out.messages.is_empty(), "before the vote is durable");
        let vote = out
            .persist
            .iter()
            .find(|p| p.hard_state.is_some_and(|hs| hs.vote == 1));
        assert!(vote.is_some_and(|p| p.sync), "{:?}", out.persist);
        let last = out.persist.last().map_or(0, |p| p.number);
        g.persisted(last, &mut out);
        out.messages
    }

    /// A candidate's vote requests, and a voter's answer, wait for the vote to be
    /// durable: nothing leaves before [`Group::persisted`], and the write of the
    /// vote asks for a sync.
    #[test]
    fn votes_leave_only_once_the_vote_is_durable() {
        let mut groups = three();
        groups[0].campaign().unwrap();
        // Pre-vote: the term does not change, nothing to wait for but the order.
        for (to, b) in drained(&mut groups[0]).messages {
            groups[to as usize - 1].step(1, &b).unwrap();
        }
        for i in [1, 2] {
            for (to, b) in drained(&mut groups[i]).messages {
                assert_eq!(to, 1);
                groups[0].step(i as u64 + 1, &b).unwrap();
            }
        }
        let asks = vote_waits_for_its_write(&mut groups[0]);
        assert_eq!(asks.iter().map(|(to, _)| *to).collect::<Vec<_>>(), [2, 3]);
        groups[1].step(1, &asks[0].1).unwrap();
        let answer = vote_waits_for_its_write(&mut groups[1]);
        assert_eq!(answer.iter().map(|(to, _)| *to).collect::<Vec<_>>(), [1]);
    }

    /// With `unsynced_steps_max` steps handed out and not reported durable, a
    /// drain hands out nothing more; once they are, the rest follows, nothing lost.
    #[test]
    fn steps_not_yet_durable_are_bounded() {
        let mut cfg = GroupConfig::new(1, vec![1], 5);
        cfg.unsynced_steps_max = 2;
        let mut g = Group::new(&cfg).unwrap();
        g.campaign().unwrap();
        let _ = drained(&mut g);
        let mut out = Outputs::default();
        for i in 0..5u8 {
            g.propose(vec![i]).unwrap();
            g.drain(&mut out);
        }
        assert_eq!(out.persist.len(), 2, "{:?}", out.persist);
        let last = out.persist.last().map_or(0, |p| p.number);
        g.persisted(last, &mut out);
        let rest = drained(&mut g);
        let data: Vec<Vec<u8>> = (out.committed.into_iter().chain(rest.committed))
            .map(|c| c.data)
            .collect();
        assert_eq!(data, (0..5u8).map(|i| vec![i]).collect::<Vec<_>>());
    }

    /// Three replicas on a perfect network; every message delivered until quiet.
    fn three() -> Vec<Group> {
        three_with(|_| {})
    }

    fn three_with(tune: impl Fn(&mut GroupConfig)) -> Vec<Group> {
        let voters = vec![1, 2, 3];
        (1..=3)
            .map(|id| {
                let mut cfg = GroupConfig::new(id, voters.clone(), id);
                tune(&mut cfg);
                Group::new(&cfg).unwrap()
            })
            .collect()
    }

    /// Whether `bytes` from `from` to `to` is a heartbeat.
    fn is_heartbeat(bytes: &[u8], to: u64, from: u64) -> bool {
        let m = wire::decode(bytes, to, from).unwrap();
        m.get_msg_type() == raft::prelude::MessageType::MsgHeartbeat
    }

    /// Leaders elected at different phases of a shared clock beat on the same
    /// ticks (`count % heartbeat_ticks == 0`), each still every
    /// `heartbeat_ticks`; plain ticks (the control) keep the phase of the
    /// election.
    #[test]
    fn leaders_ticked_at_a_shared_count_beat_on_the_same_ticks() {
        for heartbeat_ticks in [2, 3] {
            for elected_at in 0..heartbeat_ticks as u64 {
                for aligned in [true, false] {
                    let mut groups =
                        led_by_one(three_with(|c| c.heartbeat_ticks = heartbeat_ticks));
                    let mut beats = Vec::new();
                    for count in elected_at + 1..elected_at + 13 {
                        if aligned {
                            groups[0].tick_at(count);
                        } else {
                            groups[0].tick();
                        }
                        let out = drained(&mut groups[0]);
                        if out.messages.iter().any(|(to, b)| is_heartbeat(b, *to, 1)) {
                            beats.push(count);
                        }
                    }
                    let gaps: Vec<u64> = beats.windows(2).map(|w| w[1] - w[0]).collect();
                    let h = heartbeat_ticks as u64;
                    assert!(gaps.iter().all(|&g| g == h), "{beats:?}");
                    assert!(beats.len() >= 3, "{beats:?}");
                    let on_phase = beats.iter().all(|c| c % h == 0);
                    assert_eq!(
                        on_phase,
                        aligned || elected_at == 0,
                        "heartbeat_ticks {h}, elected at {elected_at}, aligned {aligned}: {beats:?}"
                    );
                }
            }
        }
    }

    /// Replica 1 elected and every message delivered.
    fn led_by_one(mut groups: Vec<Group>) -> Vec<Group> {
        groups[0].campaign().unwrap();
        settle(&mut groups);
        assert_eq!(groups[0].role(), Role::Leader);
        groups
    }

    /// The entries of each append the leader sends to replica 2 while `n`
    /// proposals are made one by one and nothing is delivered.
    fn appends_to_two(leader: &mut Group, n: usize) -> Vec<usize> {
        let mut appends = Vec::new();
        for i in 0..n {
            leader.propose(vec![i as u8]).unwrap();
            for (to, bytes) in drained(leader).messages {
                let m = wire::decode(&bytes, to, 1).unwrap();
                if to == 2 && m.msg_type == raft::prelude::MessageType::MsgAppend {
                    appends.push(m.entries.len());
                }
            }
        }
        appends
    }

    /// A follower that answered and holds the leader's whole log is caught up;
    /// one behind (cut off while the leader appended) or silent for an election
    /// timeout is not; only a leader answers yes. A transfer to a caught-up
    /// follower is under way until the follower's election ends it.
    #[test]
    fn caught_up_needs_the_whole_log_and_a_recent_answer() {
        let mut groups = led_by_one(three());
        assert!(groups[0].is_caught_up(2) && groups[0].is_caught_up(3));
        assert!(!groups[1].is_caught_up(3), "a follower answers no");
        assert!(!groups[0].is_caught_up(9), "no such replica");
        groups[0].propose(b"x".to_vec()).unwrap();
        let out = drained(&mut groups[0]);
        for (to, b) in &out.messages {
            if *to == 2 {
                groups[1].step(1, b).unwrap();
            }
        }
        for (to, b) in drained(&mut groups[1]).messages {
            if to == 1 {
                groups[0].step(2, &b).unwrap();
            }
        }
        let _ = drained(&mut groups[0]);
        assert!(groups[0].is_caught_up(2), "2 took the append");
        assert!(!groups[0].is_caught_up(3), "3 missed it");
        for _ in 0..groups[0].election_timeout_ticks() {
            groups[0].tick();
            let _ = drained(&mut groups[0]);
        }
        assert!(
            !groups[0].is_caught_up(2),
            "2 went silent for an election timeout"
        );
        let mut groups = led_by_one(three());
        assert!(!groups[0].transferring());
        groups[0].transfer_leader(2);
        assert!(groups[0].transferring());
        settle(&mut groups);
        assert_eq!(groups[1].role(), Role::Leader);
        assert!(!groups[0].transferring());
    }

    /// With pre-vote, a replica cut off from the others does not raise its term
    /// however long it waits, so it does not depose the leader when it is back.
    #[test]
    fn a_cut_off_replica_keeps_its_term() {
        let mut groups = led_by_one(three());
        let term = groups[2].term();
        for _ in 0..100 {
            groups[2].tick();
            let _ = drained(&mut groups[2]);
        }
        assert_eq!(groups[2].term(), term);
        assert_ne!(groups[2].role(), Role::Leader);
    }

    /// With check-quorum, a leader that hears from no follower steps down.
    #[test]
    fn a_leader_cut_off_from_its_quorum_steps_down() {
        let mut groups = led_by_one(three());
        for _ in 0..100 {
            groups[0].tick();
            let _ = drained(&mut groups[0]);
        }
        assert_ne!(groups[0].role(), Role::Leader);
    }

    /// The entries of the append that catches replica 2 up: it was probed (one
    /// append of the first of three proposals), answers it, and the leader sends
    /// what is left.
    fn catch_up_append(mut groups: Vec<Group>) -> Vec<usize> {
        groups[0].report_unreachable(2);
        let mut to_two = Vec::new();
        for i in 0..3u8 {
            groups[0].propose(vec![i]).unwrap();
            let out = drained(&mut groups[0]).messages;
            to_two.extend(out.into_iter().filter(|(to, _)| *to == 2).map(|(_, b)| b));
        }
        for b in &to_two {
            groups[1].step(1, b).unwrap();
        }
        for (to, b) in drained(&mut groups[1]).messages {
            if to == 1 {
                groups[0].step(2, &b).unwrap();
            }
        }
        let out = drained(&mut groups[0]).messages;
        (out.iter().filter(|(to, _)| *to == 2))
            .map(|(_, b)| wire::decode(b, 2, 1).unwrap())
            .filter(|m| m.msg_type == raft::prelude::MessageType::MsgAppend)
            .map(|m| m.entries.len())
            .collect()
    }

    /// A lagging follower is caught up with several entries in one append, within
    /// `msg_bytes_max` (a limit of one byte: one entry per append, in two).
    #[test]
    fn appends_carry_several_entries_within_the_byte_limit() {
        assert_eq!(catch_up_append(led_by_one(three())), vec![2]);
        let small = three_with(|c| c.msg_bytes_max = 1);
        assert_eq!(catch_up_append(led_by_one(small)), vec![1, 1]);
    }

    /// A follower that answers nothing gets at most `inflight_msgs_max` appends.
    #[test]
    fn unanswered_appends_stop_at_the_inflight_limit() {
        let mut groups = led_by_one(three_with(|c| c.inflight_msgs_max = 2));
        assert_eq!(appends_to_two(&mut groups[0], 5), vec![1, 1]);
        let mut groups = led_by_one(three());
        assert_eq!(appends_to_two(&mut groups[0], 5), vec![1; 5]);
    }

    /// A follower reported unreachable is probed: one append, then none until it
    /// answers.
    #[test]
    fn an_unreachable_follower_is_probed_with_one_append() {
        let mut groups = led_by_one(three());
        groups[0].report_unreachable(2);
        assert_eq!(appends_to_two(&mut groups[0], 5), vec![1]);
    }

    fn settle(groups: &mut [Group]) {
        for _ in 0..20 {
            for i in 0..groups.len() {
                for (to, bytes) in drained(&mut groups[i]).messages {
                    let from = groups[i].id();
                    let _ = groups[to as usize - 1].step(from, &bytes);
                }
            }
        }
    }

    /// [`settle`] with replica `cut`'s messages, both ways, dropped; whether any
    /// message for `cut` was a snapshot.
    fn settle_without(groups: &mut [Group], cut: u64) -> bool {
        let mut snapshot = false;
        for _ in 0..20 {
            for i in 0..groups.len() {
                let from = groups[i].id();
                for (to, bytes) in drained(&mut groups[i]).messages {
                    let m = wire::decode(&bytes, to, from).unwrap();
                    snapshot |= m.msg_type == MessageType::MsgSnapshot;
                    if to != cut && from != cut {
                        let _ = groups[to as usize - 1].step(from, &bytes);
                    }
                }
            }
        }
        snapshot
    }

    /// Four rounds of every replica drained and its messages delivered; the read
    /// states they gave, in order.
    fn exchange(groups: &mut [Group]) -> Vec<(u64, u64)> {
        let mut states = Vec::new();
        for _ in 0..4 {
            for i in 0..groups.len() {
                let out = drained(&mut groups[i]);
                states.extend(out.read_states);
                for (to, bytes) in out.messages {
                    let _ = groups[to as usize - 1].step(i as u64 + 1, &bytes);
                }
            }
        }
        states
    }

    /// A serving leader's read is confirmed by a quorum's answers to a round of
    /// heartbeats carrying it: its read state comes out at the commit index it
    /// had. A leader whose heartbeats are lost gives none (the read waits, and is
    /// confirmed with the next one answered); a follower refuses to ask.
    #[test]
    fn a_read_is_confirmed_by_a_quorum_answering_its_heartbeats() {
        let mut groups = led_by_one(three());
        groups[0].propose(b"a".to_vec()).unwrap();
        settle(&mut groups);
        let commit = groups[0].commit_index();
        assert!(matches!(
            groups[1].read_index(1),
            Err(GroupError::NotLeader { leader: Some(1) })
        ));
        groups[0].read_index(7).unwrap();
        let lost = drained(&mut groups[0]);
        let beats: Vec<u64> = (lost.messages.iter())
            .filter(|(to, b)| is_heartbeat(b, *to, 1))
            .map(|(to, _)| *to)
            .collect();
        assert_eq!(beats, vec![2, 3], "a heartbeat to each follower");
        assert!(lost.read_states.is_empty(), "nobody answered");
        groups[0].read_index(8).unwrap();
        let states = exchange(&mut groups);
        assert_eq!(states, vec![(7, commit), (8, commit)]);
    }

    /// A serving leader's lease starts at the `now` of the latest round a quorum
    /// answered: none before an answer, the older start while a newer round goes
    /// unanswered, the newer once answered; its rounds are not the caller's reads.
    /// A follower starts none; a transfer loses it, and only rounds started after
    /// count; a newer leader's election loses it.
    #[test]
    fn a_leaders_lease_starts_at_the_round_a_quorum_answered() {
        let mut groups = led_by_one(three());
        assert_eq!(groups[0].lease_start(), None, "no round yet");
        groups[0].renew_lease(100);
        let lost = drained(&mut groups[0]);
        let beats = (lost.messages.iter()).filter(|(to, b)| is_heartbeat(b, *to, 1));
        assert_eq!(beats.count(), 2, "a heartbeat to each follower");
        assert_eq!(groups[0].lease_start(), None, "nobody answered");
        groups[0].renew_lease(200);
        let reads = exchange(&mut groups);
        assert_eq!(groups[0].lease_start(), Some(200));
        assert!(reads.is_empty(), "lease rounds are not reads");
        groups[0].renew_lease(300);
        let _ = drained(&mut groups[0]);
        assert_eq!(groups[0].lease_start(), Some(200), "300 unanswered");
        groups[1].renew_lease(400);
        assert!(
            drained(&mut groups[1]).messages.is_empty(),
            "a follower starts none"
        );
        assert_eq!(groups[1].lease_start(), None);
        groups[0].transfer_leader(2);
        assert_eq!(groups[0].lease_start(), None, "handing over");
        groups[0].renew_lease(500);
        assert_eq!(groups[0].lease_start(), None);
        settle(&mut groups);
        assert_eq!(
            (groups[1].role(), groups[0].role()),
            (Role::Leader, Role::Follower)
        );
        assert_eq!(groups[0].lease_start(), None);
        assert_eq!(
            groups[1].lease_start(),
            None,
            "a new leader has no round yet"
        );
        groups[1].renew_lease(600);
        settle(&mut groups);
        assert_eq!(groups[1].lease_start(), Some(600));
        // Cut off, 2 keeps its role (it is not ticked) while 1 and 3 elect a
        // leader; given the lead back in a later term, its old round counts for
        // nothing.
        for _ in 0..groups[0].election_timeout_ticks() * 3 {
            groups[0].tick();
            groups[2].tick();
            settle_without(&mut groups, 2);
        }
        let new = (groups.iter()).position(|g| g.role() == Role::Leader && g.id() != 2);
        let new = new.expect("1 and 3 elected a leader");
        assert_eq!(groups[1].lease_start(), Some(600), "2 does not know yet");
        groups[new].transfer_leader(2);
        for _ in 0..20 {
            // Heartbeats reach 2: it catches up and takes the lead.
            groups[new].tick();
            settle(&mut groups);
        }
        assert_eq!(groups[1].role(), Role::Leader);
        assert!(groups[1].term() > 2);
        assert_eq!(groups[1].lease_start(), None, "lost with the term");
    }

    /// A lease round started on the tick a heartbeat is due goes out as the only
    /// heartbeat to each follower (the plain one merged into it), and its answers
    /// confirm it.
    #[test]
    fn a_lease_round_on_a_heartbeat_tick_is_the_only_heartbeat() {
        let mut groups = led_by_one(three());
        let mut count = 0;
        loop {
            count += 1;
            groups[0].tick_at(count);
            if count % 2 == 0 {
                break;
            }
            let _ = drained(&mut groups[0]);
        }
        groups[0].renew_lease(count);
        let out = drained(&mut groups[0]);
        let beats: Vec<u64> = (out.messages.iter())
            .filter(|(to, b)| is_heartbeat(b, *to, 1))
            .map(|(to, _)| *to)
            .collect();
        assert_eq!(beats, vec![2, 3], "one heartbeat to each follower");
        for (to, bytes) in out.messages {
            let _ = groups[to as usize - 1].step(1, &bytes);
        }
        settle(&mut groups);
        assert_eq!(groups[0].lease_start(), Some(count));
    }

    /// Lease rounds waiting for a quorum are bounded: past the bound the oldest
    /// is forgotten, and an answer to a later round starts the lease at its `now`.
    #[test]
    fn unanswered_lease_rounds_are_bounded() {
        let mut groups = led_by_one(three());
        for now in 0..LEASE_ROUNDS_MAX as u64 + 5 {
            groups[0].renew_lease(now);
            let _ = drained(&mut groups[0]);
        }
        assert_eq!(groups[0].lease.rounds.len(), LEASE_ROUNDS_MAX);
        groups[0].renew_lease(1000);
        settle(&mut groups);
        assert_eq!(groups[0].lease_start(), Some(1000));
        assert!(groups[0].lease.rounds.is_empty());
    }

    /// Compaction keeps `log_entries_retained` committed entries in memory; a
    /// follower that fell behind them is never sent a snapshot (it waits), and the
    /// group goes on committing with the others. A follower within what is kept
    /// catches up from memory.
    #[test]
    fn compaction_bounds_memory_and_a_follower_behind_gets_no_snapshot() {
        let mut groups = led_by_one(three_with(|c| c.log_entries_retained = 2));
        for i in 0..6u8 {
            groups[0].propose(vec![i]).unwrap();
            assert!(!settle_without(&mut groups, 3));
        }
        groups[0].compact();
        let last = groups[0].commit_index();
        assert_eq!(last, 7, "the leader's no-op and six proposals");
        assert_eq!(groups[0].first_index(), last - 1, "two entries kept");
        assert_eq!(groups[0].take_snapshots_refused(), 0);
        for _ in 0..groups[0].election_timeout_ticks() * 3 {
            groups[0].tick();
            assert!(!settle_without(&mut groups, 0), "no snapshot for 3");
        }
        // Reported failed each time, the leader probes 3 again and is due to send
        // one again: refused more than once.
        assert!(groups[0].take_snapshots_refused() > 1);
        assert_eq!(groups[0].take_snapshots_refused(), 0, "taken");
        assert_eq!(groups[0].role(), Role::Leader);
        assert!(groups[2].commit_index() < groups[0].first_index());
        groups[0].propose(b"on".to_vec()).unwrap();
        assert!(!settle_without(&mut groups, 0));
        assert_eq!(groups[0].commit_index(), 8, "committed without 3");
        // Replica 2 lags by one entry, within what is kept: it catches up.
        groups[0].propose(b"more".to_vec()).unwrap();
        assert!(!settle_without(&mut groups, 2));
        groups[0].compact();
        assert!(groups[0].first_index() <= groups[1].commit_index() + 1);
        for _ in 0..groups[0].election_timeout_ticks() {
            groups[0].tick();
            assert!(!settle_without(&mut groups, 3));
        }
        assert_eq!(groups[1].commit_index(), 9);
        let mut cfg = GroupConfig::new(1, vec![1], 1);
        cfg.log_entries_retained = 0;
        assert!(matches!(Group::new(&cfg), Err(GroupError::Config(_))));
    }

    /// A commit is not broadcast on its own: once the followers' answers commit an
    /// entry, the leader sends nothing until its next append or heartbeat (which
    /// carry the commit index), so a SEND costs one append and one answer per
    /// follower.
    #[test]
    fn a_commit_is_not_broadcast_on_its_own() {
        let mut groups = led_by_one(three());
        groups[0].propose(b"m".to_vec()).unwrap();
        let before = groups[0].commit_index();
        for (to, bytes) in drained(&mut groups[0]).messages {
            groups[to as usize - 1].step(1, &bytes).unwrap();
        }
        for i in 1..3 {
            for (to, bytes) in drained(&mut groups[i]).messages {
                assert_eq!(to, 1);
                groups[0].step(i as u64 + 1, &bytes).unwrap();
            }
        }
        let out = drained(&mut groups[0]);
        assert_eq!(groups[0].commit_index(), before + 1, "committed");
        assert_eq!(out.committed.len(), 1);
        assert!(out.messages.is_empty(), "{} messages", out.messages.len());
        assert_eq!(
            groups[1].commit_index(),
            before,
            "a follower learns it later"
        );
    }

    /// A new leader serves only once an entry of its own term (raft's no-op) is
    /// committed: elected, its appends not yet answered, it does not; a follower
    /// never does; after the round trip it does.
    #[test]
    fn a_new_leader_serves_once_an_entry_of_its_term_is_committed() {
        let mut groups = three();
        assert!(!groups[0].serving(), "before any election");
        groups[0].campaign().unwrap();
        // Rounds of delivery, the leader's messages held once it leads.
        for _ in 0..10 {
            if groups[0].role() == Role::Leader {
                break;
            }
            for i in 0..3 {
                for (to, bytes) in drained(&mut groups[i]).messages {
                    let from = groups[i].id();
                    let _ = groups[to as usize - 1].step(from, &bytes);
                }
            }
        }
        assert_eq!(groups[0].role(), Role::Leader);
        assert!(!groups[0].serving(), "its no-op is not committed yet");
        settle(&mut groups);
        assert!(groups[0].serving());
        assert!(!groups[1].serving() && !groups[2].serving(), "followers");
    }

    /// A leader hands leadership to a follower: it leads in a later term, and the
    /// old leader follows it.
    #[test]
    fn leadership_moves_by_transfer() {
        let mut groups = led_by_one(three());
        let term = groups[0].term();
        groups[0].transfer_leader(2);
        settle(&mut groups);
        assert_eq!(groups[1].role(), Role::Leader);
        assert!(groups[1].term() > term);
        assert_eq!(
            (groups[0].role(), groups[0].leader()),
            (Role::Follower, Some(2))
        );
    }

    /// A follower names the leader it knows when it refuses a proposal; bytes from
    /// a peer that are a proposal are refused by the wire.
    #[test]
    fn followers_refuse_proposals_and_name_their_leader() {
        let mut groups = led_by_one(three());
        let e = groups[1].propose(b"x".to_vec()).unwrap_err();
        assert_eq!(e, GroupError::NotLeader { leader: Some(1) });
        let mut propose = raft::prelude::Message {
            msg_type: raft::prelude::MessageType::MsgPropose,
            from: 2,
            to: 1,
            ..Default::default()
        };
        propose.entries.push(Entry::default());
        let e = groups[0].step(2, &wire::encode(&propose)).unwrap_err();
        assert_eq!(e, GroupError::Wire(WireError::RefusedKind(2)));
    }

    /// A timeout raft-rs drew itself (its `thread_rng`) never stays in force: the
    /// next call draws one from the seed.
    #[test]
    fn a_timeout_raft_drew_itself_is_replaced_from_the_seed() {
        let mut g = Group::new(&GroupConfig::new(1, vec![1, 2, 3], 3)).unwrap();
        let ours = g.election_timeout_ticks();
        while g.election_timeout_ticks() == ours {
            g.node.raft.reset_randomized_election_timeout();
        }
        g.tick();
        assert_eq!(g.election_timeout_ticks(), g.drawn.1);
        assert_ne!(g.drawn.1, 0);
    }

    /// Configs that do not make a group are refused with the reason; every
    /// election timeout drawn lies in `[election_ticks, 2 × election_ticks)`.
    #[test]
    fn bad_configs_are_refused_and_timeouts_stay_in_range() {
        let mut cfg = GroupConfig::new(1, vec![1, 2, 3], 9);
        cfg.log_entries_max = 0;
        assert!(matches!(Group::new(&cfg), Err(GroupError::Config(_))));
        let mut cfg = GroupConfig::new(1, vec![1, 2, 3], 9);
        cfg.unsynced_steps_max = 0;
        assert!(matches!(Group::new(&cfg), Err(GroupError::Config(_))));
        let mut cfg = GroupConfig::new(1, vec![1, 2, 3], 9);
        cfg.heartbeat_ticks = cfg.election_ticks;
        assert!(matches!(Group::new(&cfg), Err(GroupError::Config(_))));
        let cfg = GroupConfig::new(1, vec![1, 2, 3], 9);
        let mut g = Group::new(&cfg).unwrap();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..2_000 {
            g.tick();
            let _ = drained(&mut g);
            let t = g.election_timeout_ticks();
            assert!((10..20).contains(&t), "{t}");
            seen.insert(t);
        }
        assert!(seen.len() > 1, "one timeout drawn only: {seen:?}");
    }
}
