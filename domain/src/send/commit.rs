//! The commit core of a channel's commit shard, sans-IO: step 2 of one SEND
//! (`docs/flows.md`, flow 5) and the answers of step 3.
//!
//! It owns every decision between "a SEND arrived at its channel's shard" and "its
//! SENDACK is written and its delivery may start": permission (group membership),
//! back-pressure (unanswered commits, the delivery backlog in messages and bytes),
//! the idempotency window (flow 7, `docs/flows.md`), message id and per-channel seq assignment (the
//! append), and the sync policy (what waits for the log's fsync before it is
//! answered). The driver (`engine::node::send::commit`) decodes, calls, and carries
//! the [`CommitOutput`]s to the rings, the syncer thread and the API.
//!
//! # Events and outputs
//!
//! | event | may output |
//! |---|---|
//! | [`CommitCore::on_commit`] | `Answer` (a refusal, at once) or nothing (waits in `unsynced`) |
//! | [`CommitCore::end_turn`] | `Answer`s and backlog entries; `SubmitSync` under `always` |
//! | [`CommitCore::on_sync_timer`] | `SubmitSync` (the interval policy's fdatasync) |
//! | [`CommitCore::on_sync_done`] | the waiting batch's `Answer`s (success or 15) |
//! | [`CommitCore::stop`] | every unanswered commit's `Answer` after one final sync |
//! | [`CommitCore::pump`] | the planner's `PlanOutput`s: `Push` batches, remote `Lookup`s |
//! | [`CommitCore::on_lookup_reply`] | nothing: the next `pump` pushes the completed page |
//!
//! On a cluster whose slot ids are replicated, SENDs go through their slot id's
//! raft group instead of the log's own append ([`replicated`]: `on_propose`,
//! `propose_turn`, `on_appended`, `on_committed`, `on_lost`).
//!
//! Every error of the log comes out as a `LogFailed` beside the refusals it caused.
//!
//! # The sync policy
//!
//! - `answer_after_sync = false` (`fsync = "interval"`, the default): the turn's
//!   commits are answered at the end of the turn; the log's sync runs on a timer.
//!   Idempotent duplicates are answered in the same batch as the commits of their
//!   turn, never before their first copy's answer.
//! - `answer_after_sync = true` (`fsync = "always"`): the turn's appends become one
//!   sync job (group commit). One job is in flight at a time; the next turns' commits
//!   wait for the next job. A failed sync answers its whole batch with SENDACK 15
//!   (SystemError): nothing acknowledged is lost, the client retries.
//!
//! # Delivery
//!
//! An answered message joins the backlog of the core's planner
//! ([`crate::send::delivery::Planner`]). The driver calls [`CommitCore::pump`] every turn
//! while anything is delivering and carries its outputs: each `PlanOutput::Push` to
//! its owner (this shard, a shard's ring, another node), each `PlanOutput::Lookup`
//! (EndpointsByTargets for the page's groups led by another node) to that node,
//! answering it exactly once with [`CommitCore::on_lookup_reply`]: the node's
//! reply, or a failure the driver synthesizes (the RPC deadline passed, the peer is
//! down or restarted). A page waiting for its lookups holds every later page
//! (head-of-line, bounded by the RPC deadline) and its message keeps its charge in
//! `backlog_bytes` until its delivery ends.
//!
//! # Invariants
//!
//! - Every request gets exactly one `Answer`.
//! - Per channel, seqs come from the log: dense and increasing.
//! - A resend found in the idempotency window is answered with the first copy's ids
//!   and neither appended nor delivered again.
//! - `backlog_bytes` is the sum of the charges of the messages committed and not
//!   yet delivered (or refused); it never exceeds `backlog_budget_bytes` + one charge.

use std::sync::Arc;

use proto::wkproto::{Flags, ReasonCode};

use crate::cluster::ClusterView;
use crate::presence::route::Uid;
use crate::send::channel::{Channel, Subscribers};
use crate::send::delivery::{
    EndpointLookup, LookupReply, PlanCounts, PlanLimits, PlanOutput, Planner, PushTo, Sender,
};
use crate::send::idempotency::{FirstSend, IdempotencyWindow, SentIds};
use crate::send::idgen::MessageIdGen;
pub use crate::send::message::{Committed, Delivery};

mod replicated;
use replicated::ProposalBook;
pub use replicated::{Foreign, ForeignEntry, Replicas};

/// A message to commit, and where its answer goes (`A`: the driver's address of the
/// SENDACK or the API reply; the core only hands it back). A SEND forwarded to its
/// channel's home node travels as `CommitRequest<()>` (the home names the answer's
/// address with [`CommitRequest::answered_to`]).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct CommitRequest<A> {
    /// Where the answer goes: handed back unchanged in [`CommitOutput::Answer`].
    pub answer_to: A,
    /// The sending session: `Some` for a client's SEND (its group membership is
    /// checked, its own session gets no RECV), `None` for the HTTP API.
    pub sender: Option<Sender>,
    /// The sending uid; a group's subscribers must contain it for a client's SEND.
    pub from_uid: Uid,
    /// The channel, resolved for the sender at the gateway.
    pub channel: Channel,
    /// The client message number: with `from_uid`, the idempotency key (empty: never
    /// deduplicated).
    pub client_msg_no: String,
    /// RECV setting byte (NoEncrypt kept: such a message is delivered as it came).
    pub setting: u8,
    /// SEND header flags (NoPersist, SyncOnce, RedDot).
    pub flags: u8,
    /// The SEND's expire field, in seconds (0 before wkproto version 3); carried.
    pub expire_s: u32,
    /// The SEND's topic (empty: none).
    pub topic: String,
    /// The plaintext payload.
    pub payload: Vec<u8>,
}

impl<A> CommitRequest<A> {
    /// The same request, answered to `answer_to`.
    pub fn answered_to<B>(self, answer_to: B) -> CommitRequest<B> {
        CommitRequest {
            answer_to,
            sender: self.sender,
            from_uid: self.from_uid,
            channel: self.channel,
            client_msg_no: self.client_msg_no,
            setting: self.setting,
            flags: self.flags,
            expire_s: self.expire_s,
            topic: self.topic,
            payload: self.payload,
        }
    }
}

/// A message to append, as the core hands it to its [`CommitLog`] (and the store's
/// `MessageLog::append` takes it). The core assigns `message_id`; the log assigns
/// `message_seq`.
#[derive(Clone, Copy, Debug)]
pub struct NewMessage<'a> {
    /// The id the core assigned.
    pub message_id: i64,
    /// The wkproto channel_type (1 person, 2 group).
    pub channel_type: u8,
    /// The stored channel id (for person channels, the `x@y` key).
    pub channel_id: &'a str,
    /// The sender's uid.
    pub from_uid: &'a str,
    /// The client message number: stored, so the idempotency window is refilled
    /// from the log at start.
    pub client_msg_no: &'a str,
    /// wkproto RECV setting byte.
    pub setting: u8,
    /// SEND header flags (RedDot, SyncOnce, ...).
    pub msg_flags: u8,
    /// Unix seconds.
    pub timestamp_s: u32,
    /// The plaintext payload.
    pub payload: &'a [u8],
}

/// An error of the log, as the core needs to know it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogFault {
    /// A disk error (or a log poisoned by one): the shard is unhealthy (`/readyz`).
    pub disk: bool,
    /// What failed, for the driver's log line.
    pub message: String,
}

/// The channel log a commit core appends to: `engine::store::MessageLog` in the
/// node, a fake in tests.
pub trait CommitLog {
    /// A sync of the appends so far, run by the driver off the shard thread.
    type Job;
    /// Appends one record; returns its seq in its channel (the channel's previous
    /// last seq + 1).
    fn append(&mut self, record: &NewMessage<'_>) -> Result<u64, LogFault>;
    /// The appends not yet covered by a job, as one job (`None`: nothing to sync).
    fn begin_sync(&mut self) -> Result<Option<Self::Job>, LogFault>;
    /// The job begun last ended with `result`.
    fn end_sync(&mut self, result: std::io::Result<()>, now_ms: u64) -> Result<(), LogFault>;
    /// Syncs everything appended, here and now (a graceful stop).
    fn sync_now(&mut self, now_ms: u64) -> Result<(), LogFault>;
}

/// The groups' subscribers as the core reads them (`engine::node::catalog`).
pub trait Groups {
    /// The subscribers of group `id`, `None` if there is no such group.
    fn subscribers(&self, id: &str) -> Option<Arc<Subscribers>>;
}

/// The core's limits (`[delivery]`, `[storage] fsync`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommitLimits {
    /// `fsync = "always"`: answer only after the sync that covers the append.
    pub answer_after_sync: bool,
    /// Commits appended and not yet answered; more get SENDACK 15.
    pub commits_unsynced_max: usize,
    /// Committed messages not yet fully delivered (with the unanswered ones); more
    /// get SENDACK 22.
    pub delivery_backlog_max: usize,
    /// What those messages may hold in bytes ([`charge_bytes`]); more get SENDACK 22.
    pub backlog_budget_bytes: usize,
    /// Replicated: messages of other leaders' entries held on one core until
    /// their leader's delivery mark passes them ([`replicated`]); past it the
    /// oldest are dropped.
    pub redeliver_messages_max: usize,
}

/// The time of an event: the wall clock (message ids, timestamps, idempotency
/// window) and the driver's monotonic clock (latency stamps).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Now {
    /// The wall clock, in milliseconds since the Unix epoch.
    pub wall_ms: u64,
    /// The driver's monotonic clock, in nanoseconds.
    pub mono_ns: u64,
}

/// What the driver carries out.
pub enum CommitOutput<A, J> {
    /// The commit's answer: SENDACK to the gateway, or the API reply.
    Answer {
        /// The request's `answer_to`.
        to: A,
        /// The message's id (the first copy's for a resend); 0 when refused.
        message_id: i64,
        /// The message's seq in its channel; 0 when refused or NoPersist.
        message_seq: u64,
        /// `SUCCESS`, or the refusal: 15 (disk behind or a failed log), 22 (the
        /// delivery backlog), or the group's refusal (no such channel, not a
        /// subscriber).
        reason: ReasonCode,
        /// For a new message answered with success: when it was appended (the
        /// driver's `commit_to_durable` stage).
        appended_ns: Option<u64>,
    },
    /// Hand this sync job to the syncer; call [`CommitCore::on_sync_done`] with its
    /// result (at once if the syncer ran it inline).
    SubmitSync(J),
    /// The log failed: log it; `disk` marks the shard unhealthy.
    LogFailed {
        /// The log call that failed: `"append"`, `"begin sync"`, `"interval sync"`,
        /// `"sync"` or `"final sync"`.
        what: &'static str,
        /// The log's error.
        fault: LogFault,
    },
}

/// What [`CommitCore::on_commit`] did with a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Committing {
    /// Answered at once with a refusal.
    Refused,
    /// A resend found in the idempotency window: answered with its turn, with the
    /// first copy's ids.
    Duplicate,
    /// Appended (or, NoPersist, given an id): answered with its turn or its sync.
    Appended,
    /// Replicated: given an id and waiting to be proposed with its turn's batch to
    /// its group (or with a copy already proposed): answered once committed.
    Proposed,
    /// A resend of a message recovered from the log at start (its first answer is
    /// unknown): answered with the first copy's ids and delivered now.
    Recovered,
}

/// Counters the driver publishes as metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommitCounts {
    /// Resends answered from the idempotency window.
    pub deduplicated: u64,
    /// Commits refused because the delivery backlog was full (SENDACK 22).
    pub refused_backlog: u64,
    /// Replicated: SENDs (and resends waiting with them) answered 10, this
    /// replica not leading their slot id's group.
    pub refused_not_leader: u64,
    /// Replicated: SENDs (and resends waiting with them) taken and then answered
    /// 15: their group refused the entry, it was cut, its leader lost office, or
    /// the node stopped before the commit.
    pub proposals_failed: u64,
    /// Replicated: messages of a predecessor's entries delivered again (DUP) by
    /// this replica when it began to lead their group.
    pub redelivered: u64,
    /// Replicated: messages held for such a delivery and dropped unheld past
    /// `redeliver_messages_max` (their recipients catch up by messagesync), or
    /// not delivered again because their group was deleted since.
    pub redeliver_dropped: u64,
}

/// What a committed message is charged against `backlog_budget_bytes` while it
/// waits for its answer and delivery: its payload and strings, plus a fixed part for
/// the message and its bookkeeping.
pub fn charge_bytes<A>(r: &CommitRequest<A>) -> usize {
    1024 + r.payload.len() + r.topic.len() + r.client_msg_no.len() + r.from_uid.len()
}

/// An answer that waits for a sync: a commit appended this turn, or a duplicate of
/// one (whose first copy may be in the same unsynced batch).
struct Unanswered<A> {
    to: A,
    message_id: i64,
    message_seq: u64,
    /// `None` for an idempotent duplicate.
    delivery: Option<Delivery>,
}

/// The commit core of one shard. `L` is its log, `A` the answer address.
pub struct CommitCore<L: CommitLog, A> {
    log: L,
    ids: MessageIdGen,
    idempotency: Option<IdempotencyWindow>,
    limits: CommitLimits,
    /// Appended and not yet part of a sync job.
    unsynced: Vec<Unanswered<A>>,
    /// Under `answer_after_sync`: the commits the job in flight makes durable.
    awaiting_sync: Vec<Unanswered<A>>,
    /// An empty batch with its capacity, swapped in for `unsynced` when a batch is
    /// answered or handed to a job (nothing allocated per turn once warm).
    spare: Vec<Unanswered<A>>,
    /// Whether a job is in flight (submitted, its end not yet reported).
    job_in_flight: bool,
    /// The unanswered commits that will be delivered (not the plain duplicates).
    unanswered_deliveries: usize,
    /// Answered messages whose delivery has not ended, and their planning.
    planner: Planner,
    /// The charges of the committed and not yet delivered messages.
    backlog_bytes: usize,
    counts: CommitCounts,
    /// The replicated path's proposals, forming and in flight ([`replicated`]).
    proposals: ProposalBook<A>,
}

impl<L: CommitLog, A> CommitCore<L, A> {
    /// A core appending to `log`, drawing ids from `ids`, deduplicating resends with
    /// `idempotency` (`None`: no window, every SEND is new), within `limits`; nothing
    /// waits yet.
    pub fn new(
        log: L,
        ids: MessageIdGen,
        idempotency: Option<IdempotencyWindow>,
        limits: CommitLimits,
    ) -> Self {
        CommitCore {
            log,
            ids,
            idempotency,
            limits,
            unsynced: Vec::new(),
            awaiting_sync: Vec::new(),
            spare: Vec::new(),
            job_in_flight: false,
            unanswered_deliveries: 0,
            planner: Planner::default(),
            backlog_bytes: 0,
            counts: CommitCounts::default(),
            proposals: ProposalBook::default(),
        }
    }

    /// The log, to write beside the core (the replicated groups' entries go to
    /// the same log).
    pub fn log_mut(&mut self) -> &mut L {
        &mut self.log
    }

    /// The log (reads: `/channel/messagesync`, stats).
    pub fn log(&self) -> &L {
        &self.log
    }

    /// Commits appended or proposed and not yet answered (bounded by
    /// `commits_unsynced_max`).
    pub fn unanswered(&self) -> usize {
        self.unsynced.len() + self.awaiting_sync.len() + self.proposals.waiting()
    }

    /// Messages committed and not yet fully delivered or answered (bounded by
    /// `delivery_backlog_max`; resends answered from the window do not count).
    pub fn backlog_len(&self) -> usize {
        self.planner.len() + self.unanswered_deliveries
    }

    /// Answered messages whose delivery has not ended (in the planner).
    pub fn delivering(&self) -> usize {
        self.planner.len()
    }

    /// The byte charge of the messages committed and not yet delivered.
    pub fn backlog_bytes(&self) -> usize {
        self.backlog_bytes
    }

    /// Whether a sync job is in flight.
    pub fn sync_in_flight(&self) -> bool {
        self.job_in_flight
    }

    /// The counters so far, reset (the driver adds them to its metrics).
    pub fn take_counts(&mut self) -> CommitCounts {
        std::mem::take(&mut self.counts)
    }

    /// Delivers from the backlog ([`Planner::pump`]): push batches and remote
    /// lookups into `out`; `room(to)` is the room towards a peer shard or node.
    /// Returns the work done (1 at least while anything waits for delivery, except
    /// while the pages in flight only wait for lookup replies: then nothing, a
    /// reply's arrival is the next event, or for a rebuilding authority: then
    /// [`next_retry_at_ms`](Self::next_retry_at_ms) is the next pump's time).
    /// `now_ms`: the driver's monotonic clock.
    pub fn pump(
        &mut self,
        now_ms: u64,
        view: &ClusterView,
        lookup: &mut impl EndpointLookup,
        room: &mut impl FnMut(PushTo) -> usize,
        limits: &PlanLimits,
        out: &mut Vec<PlanOutput>,
    ) -> usize {
        let (freed_bytes, work) = self.planner.pump(now_ms, view, lookup, room, limits, out);
        self.backlog_bytes -= freed_bytes;
        self.proposals
            .marks
            .delivered(self.planner.delivered_count());
        work
    }

    /// A reply to one of the planner's [`Lookup`](crate::send::delivery::Lookup)s, or the
    /// driver's failure for it ([`Planner::on_lookup_reply`]): returns whether it
    /// was awaited (else it is ignored and counted). Pump again afterwards: the
    /// page may be complete.
    pub fn on_lookup_reply(&mut self, lookup_id: u64, reply: LookupReply) -> bool {
        self.planner.on_lookup_reply(lookup_id, reply)
    }

    /// When the planner looks a rebuilding authority up again ([`Planner::next_retry_at_ms`]).
    pub fn next_retry_at_ms(&self) -> Option<u64> {
        self.planner.next_retry_at_ms()
    }

    /// Lookups of the pages in delivery that await their replies.
    pub fn awaiting_lookups(&self) -> usize {
        self.planner.awaiting_lookups()
    }

    /// Pages looked up and not yet pushed ([`Planner::pages_in_flight`]).
    pub fn pages_in_flight(&self) -> usize {
        self.planner.pages_in_flight()
    }

    /// Failed groups not yet retried nor counted
    /// ([`Planner::groups_awaiting_retry`]).
    pub fn groups_awaiting_retry(&self) -> usize {
        self.planner.groups_awaiting_retry()
    }

    /// The planner's counters so far, reset.
    pub fn take_plan_counts(&mut self) -> PlanCounts {
        self.planner.take_counts()
    }

    /// Step 2: commits one message, or refuses it at once. A commit is answered by
    /// a later [`end_turn`](Self::end_turn) or [`on_sync_done`](Self::on_sync_done).
    pub fn on_commit(
        &mut self,
        r: CommitRequest<A>,
        groups: &impl Groups,
        now: Now,
        out: &mut Vec<CommitOutput<A, L::Job>>,
    ) -> Committing {
        self.commit_to(r, None, groups, now, out)
    }

    /// [`on_commit`](Self::on_commit) appending to the log (`group` `None`), or
    /// proposing to `group` ([`replicated`]; a NoPersist message, never stored, is
    /// not replicated).
    fn commit_to(
        &mut self,
        r: CommitRequest<A>,
        group: Option<u32>,
        groups: &impl Groups,
        now: Now,
        out: &mut Vec<CommitOutput<A, L::Job>>,
    ) -> Committing {
        let subscribers = match self.permission(&r, groups) {
            Ok(s) => s,
            Err(reason) => return refuse(out, r.answer_to, reason),
        };
        let group = group.filter(|_| r.flags & Flags::NO_PERSIST.0 == 0);
        let r = match group {
            Some(_) => match self.join_in_flight(r, out) {
                Ok(r) => r,
                Err(answered) => return answered,
            },
            None => r,
        };
        let now_s = now.wall_ms / 1000;
        let first = self.first_send(&r, now_s);
        if let Some(first) = first.filter(|f| !f.recovered) {
            // A resend of a SEND committed here: its first answer, whatever the
            // backlog (it costs no delivery). Answered with its turn: the first copy
            // may not be durable yet.
            if self.unanswered() >= self.limits.commits_unsynced_max {
                return refuse(out, r.answer_to, ReasonCode::SYSTEM_ERROR);
            }
            self.counts.deduplicated += 1;
            self.unsynced.push(Unanswered {
                to: r.answer_to,
                message_id: first.ids.message_id,
                message_seq: first.ids.message_seq,
                delivery: None,
            });
            return Committing::Duplicate;
        }
        let charge = charge_bytes(&r);
        if let Err(reason) = self.admission(charge) {
            return refuse(out, r.answer_to, reason);
        }
        let (ids, committing) = match first {
            // Recovered from the log at start, its first answer unknown: answered
            // with its ids and delivered now, with the resend's content (clients
            // drop a second RECV by message_id).
            Some(f) => {
                self.counts.deduplicated += 1;
                if let Some(w) = self.idempotency.as_mut() {
                    w.delivered(&r.from_uid, &r.client_msg_no);
                }
                (f.ids, Committing::Recovered)
            }
            None => match self.new_ids(&r, group.is_some(), now, out) {
                Ok(taken) => taken,
                Err(reason) => return refuse(out, r.answer_to, reason),
            },
        };
        self.backlog_bytes += charge;
        self.unanswered_deliveries += 1;
        let sender = r.sender;
        let (to, message) = into_committed(r, ids, now);
        let delivery = Delivery {
            message: Arc::new(message),
            sender,
            subscribers,
            charge_bytes: charge,
        };
        match group.filter(|_| committing == Committing::Proposed) {
            Some(group) => self.proposals.form(group, to, delivery),
            None => self.unsynced.push(Unanswered {
                to,
                message_id: ids.message_id,
                message_seq: ids.message_seq,
                delivery: Some(delivery),
            }),
        }
        committing
    }

    /// A new message's ids: appended (`append_new`), or, to be proposed, its id
    /// alone (its seq comes from the replicas' append).
    fn new_ids(
        &mut self,
        r: &CommitRequest<A>,
        proposed: bool,
        now: Now,
        out: &mut Vec<CommitOutput<A, L::Job>>,
    ) -> Result<(SentIds, Committing), ReasonCode> {
        if !proposed {
            return Ok((self.append_new(r, now, out)?, Committing::Appended));
        }
        let message_id = self
            .ids
            .next_id(now.wall_ms)
            .ok_or(ReasonCode::SYSTEM_ERROR)?;
        let ids = SentIds {
            message_id,
            message_seq: 0,
        };
        Ok((ids, Committing::Proposed))
    }

    /// A new message: its id, its append (its seq), its place in the idempotency
    /// window; or why it is refused (a log failure is also reported).
    fn append_new(
        &mut self,
        r: &CommitRequest<A>,
        now: Now,
        out: &mut Vec<CommitOutput<A, L::Job>>,
    ) -> Result<SentIds, ReasonCode> {
        let now_s = now.wall_ms / 1000;
        let message_id = self
            .ids
            .next_id(now.wall_ms)
            .ok_or(ReasonCode::SYSTEM_ERROR)?;
        let message_seq = self.append(r, message_id, now_s as u32).map_err(|fault| {
            out.push(CommitOutput::LogFailed {
                what: "append",
                fault,
            });
            ReasonCode::SYSTEM_ERROR
        })?;
        self.remember(r, message_id, message_seq, now_s);
        Ok(SentIds {
            message_id,
            message_seq,
        })
    }

    /// May the sender send to this channel? A group must exist and, for a client's
    /// SEND, have the sender among its subscribers. Returns the group's subscribers.
    fn permission(
        &self,
        r: &CommitRequest<A>,
        groups: &impl Groups,
    ) -> Result<Option<Arc<Subscribers>>, ReasonCode> {
        let Channel::Group { id } = &r.channel else {
            return Ok(None);
        };
        match groups.subscribers(id) {
            None => Err(ReasonCode::CHANNEL_NOT_EXIST),
            Some(s) if r.sender.is_some() && !s.contains(&r.from_uid) => {
                Err(ReasonCode::SUBSCRIBER_NOT_EXIST)
            }
            Some(s) => Ok(Some(s)),
        }
    }

    /// Back-pressure: the disk behind (15), or the deliveries behind (22).
    fn admission(&mut self, charge: usize) -> Result<(), ReasonCode> {
        if self.unanswered() >= self.limits.commits_unsynced_max {
            return Err(ReasonCode::SYSTEM_ERROR);
        }
        if self.backlog_len() >= self.limits.delivery_backlog_max
            || self.backlog_bytes + charge > self.limits.backlog_budget_bytes
        {
            self.counts.refused_backlog += 1;
            return Err(ReasonCode::RATE_LIMIT);
        }
        Ok(())
    }

    /// Flow 7 (`docs/flows.md`): what the window knows of an earlier copy of this SEND.
    fn first_send(&mut self, r: &CommitRequest<A>, now_s: u64) -> Option<FirstSend> {
        if r.client_msg_no.is_empty() {
            return None;
        }
        self.idempotency
            .as_mut()?
            .first_send(&r.from_uid, &r.client_msg_no, now_s)
    }

    /// Appends the message (a NoPersist message is not stored: seq 0).
    fn append(
        &mut self,
        r: &CommitRequest<A>,
        message_id: i64,
        timestamp_s: u32,
    ) -> Result<u64, LogFault> {
        if r.flags & Flags::NO_PERSIST.0 != 0 {
            return Ok(0);
        }
        self.log.append(&NewMessage {
            message_id,
            channel_type: r.channel.channel_type(),
            channel_id: r.channel.key(),
            from_uid: &r.from_uid,
            client_msg_no: &r.client_msg_no,
            setting: r.setting,
            msg_flags: r.flags,
            timestamp_s,
            payload: &r.payload,
        })
    }

    /// Records the commit in the idempotency window.
    fn remember(&mut self, r: &CommitRequest<A>, message_id: i64, message_seq: u64, now_s: u64) {
        if r.client_msg_no.is_empty() {
            return;
        }
        if let Some(w) = self.idempotency.as_mut() {
            let ids = SentIds {
                message_id,
                message_seq,
            };
            w.insert(&r.from_uid, &r.client_msg_no, ids, now_s);
        }
    }

    /// Step 3, group commit, at the end of each loop turn: under the interval policy
    /// the turn's commits are answered now; under `answer_after_sync` they become the
    /// next sync job as soon as none is in flight. Returns how many commits it
    /// completed or handed to a job.
    pub fn end_turn(&mut self, out: &mut Vec<CommitOutput<A, L::Job>>) -> usize {
        if self.unsynced.is_empty() || (self.limits.answer_after_sync && self.job_in_flight) {
            // Nothing new, or the next job starts when this one ends and covers these.
            return 0;
        }
        let spare = std::mem::take(&mut self.spare);
        let mut batch = std::mem::replace(&mut self.unsynced, spare);
        let n = batch.len();
        if !self.limits.answer_after_sync {
            self.release(&mut batch, true, out);
            return n;
        }
        match self.log.begin_sync() {
            // Nothing appended (NoPersist, duplicates): every earlier job has ended.
            Ok(None) => self.release(&mut batch, true, out),
            Ok(Some(job)) => {
                self.job_in_flight = true;
                // (`awaiting_sync` is empty here: no job was in flight.)
                self.spare = std::mem::replace(&mut self.awaiting_sync, batch);
                out.push(CommitOutput::SubmitSync(job));
            }
            Err(fault) => {
                out.push(CommitOutput::LogFailed {
                    what: "begin sync",
                    fault,
                });
                self.release(&mut batch, false, out);
            }
        }
        n
    }

    /// The interval policy's timer: a sync job for the appends not yet synced,
    /// unless one is still in flight (it covers part of what follows).
    pub fn on_sync_timer(&mut self, out: &mut Vec<CommitOutput<A, L::Job>>) {
        if self.job_in_flight {
            return;
        }
        match self.log.begin_sync() {
            Ok(None) => {}
            Ok(Some(job)) => {
                self.job_in_flight = true;
                out.push(CommitOutput::SubmitSync(job));
            }
            Err(fault) => out.push(CommitOutput::LogFailed {
                what: "interval sync",
                fault,
            }),
        }
    }

    /// The job in flight ended with `result`: the commits it covered are answered
    /// (success if durable, else SENDACK 15).
    pub fn on_sync_done(
        &mut self,
        result: std::io::Result<()>,
        now: Now,
        out: &mut Vec<CommitOutput<A, L::Job>>,
    ) {
        debug_assert!(self.job_in_flight, "a sync ended that was not submitted");
        self.job_in_flight = false;
        let durable = match self.log.end_sync(result, now.wall_ms) {
            Ok(()) => true,
            Err(fault) => {
                out.push(CommitOutput::LogFailed {
                    what: "sync",
                    fault,
                });
                false
            }
        };
        let mut batch = std::mem::take(&mut self.awaiting_sync);
        self.release(&mut batch, durable, out);
    }

    /// A graceful stop: everything appended is made durable here and now (the job in
    /// flight included), then answered and queued for delivery; the proposals not
    /// yet committed are answered 15 (the client resends).
    pub fn stop(&mut self, now: Now, out: &mut Vec<CommitOutput<A, L::Job>>) {
        let durable = match self.log.sync_now(now.wall_ms) {
            Ok(()) => true,
            Err(fault) => {
                out.push(CommitOutput::LogFailed {
                    what: "final sync",
                    fault,
                });
                false
            }
        };
        let mut batch = std::mem::take(&mut self.awaiting_sync);
        batch.append(&mut self.unsynced);
        self.release(&mut batch, durable, out);
        self.refuse_all_proposals(out);
    }

    /// Answers a batch, drained: success and delivery if `durable`, else SENDACK 15
    /// (nothing acknowledged is lost; the client retries). The emptied batch is kept
    /// as the next turn's `unsynced` (its capacity reused).
    fn release(
        &mut self,
        batch: &mut Vec<Unanswered<A>>,
        durable: bool,
        out: &mut Vec<CommitOutput<A, L::Job>>,
    ) {
        for u in batch.drain(..) {
            let (reason, ids) = if durable {
                (ReasonCode::SUCCESS, (u.message_id, u.message_seq))
            } else {
                (ReasonCode::SYSTEM_ERROR, (0, 0))
            };
            out.push(CommitOutput::Answer {
                to: u.to,
                message_id: ids.0,
                message_seq: ids.1,
                reason,
                appended_ns: u
                    .delivery
                    .as_ref()
                    .filter(|_| durable)
                    .map(|d| d.message.committed_ns),
            });
            if u.delivery.is_some() {
                self.unanswered_deliveries -= 1;
            }
            match u.delivery {
                Some(d) if durable => self.enqueue(d, None),
                Some(d) => self.backlog_bytes -= d.charge_bytes,
                None => {}
            }
        }
        if batch.capacity() > self.spare.capacity() {
            std::mem::swap(batch, &mut self.spare);
        }
    }
}

/// The request's answer address and its message as committed with `ids` at `now`.
fn into_committed<A>(r: CommitRequest<A>, ids: SentIds, now: Now) -> (A, Committed) {
    let channel_type = r.channel.channel_type();
    // The request's own key string moves into the message (no copy).
    let channel_key = match r.channel {
        Channel::Person { key, .. } => key,
        Channel::Group { id } => id,
    };
    let message = Committed {
        committed_ns: now.mono_ns,
        message_id: ids.message_id,
        message_seq: ids.message_seq,
        timestamp_s: (now.wall_ms / 1000) as u32,
        from_uid: r.from_uid,
        channel_key,
        channel_type,
        client_msg_no: r.client_msg_no,
        setting: r.setting,
        flags: r.flags,
        expire_s: r.expire_s,
        topic: r.topic,
        payload: r.payload,
    };
    (r.answer_to, message)
}

/// A refusal, answered at once.
fn refuse<A, J>(out: &mut Vec<CommitOutput<A, J>>, to: A, reason: ReasonCode) -> Committing {
    out.push(CommitOutput::Answer {
        to,
        message_id: 0,
        message_seq: 0,
        reason,
        appended_ns: None,
    });
    Committing::Refused
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::cluster::ClusterView;
    use crate::presence::route::{AuthorityError, Endpoint};
    use crate::send::delivery::{PushTo, SESSION_SHARD_SHIFT};
    use crate::send::idempotency::IdempotencyConfig;

    /// An in-memory log: records per channel key, a durable prefix, failures on demand.
    #[derive(Default)]
    pub(super) struct FakeLog {
        /// (channel key, seq, message id), in append order.
        records: Vec<(String, u64, i64)>,
        durable: usize,
        /// The end of the job in flight.
        job: Option<usize>,
        fail_append: bool,
        fail_sync: bool,
    }

    impl CommitLog for FakeLog {
        type Job = usize;

        fn append(&mut self, r: &NewMessage<'_>) -> Result<u64, LogFault> {
            if self.fail_append {
                return Err(LogFault {
                    disk: true,
                    message: "injected".into(),
                });
            }
            let last = self.records.iter().rev().find(|x| x.0 == r.channel_id);
            let seq = last.map_or(1, |x| x.1 + 1);
            self.records
                .push((r.channel_id.to_owned(), seq, r.message_id));
            Ok(seq)
        }

        fn begin_sync(&mut self) -> Result<Option<usize>, LogFault> {
            if self.durable == self.records.len() {
                return Ok(None);
            }
            assert!(self.job.is_none(), "one job in flight");
            self.job = Some(self.records.len());
            Ok(self.job)
        }

        fn end_sync(&mut self, result: std::io::Result<()>, _now_ms: u64) -> Result<(), LogFault> {
            let end = self.job.take().expect("a job in flight");
            match result {
                Ok(()) if !self.fail_sync => {
                    self.durable = end;
                    Ok(())
                }
                _ => Err(LogFault {
                    disk: true,
                    message: "sync failed".into(),
                }),
            }
        }

        fn sync_now(&mut self, _now_ms: u64) -> Result<(), LogFault> {
            self.job = None;
            self.durable = self.records.len();
            Ok(())
        }
    }

    #[derive(Default)]
    pub(super) struct FakeGroups(HashMap<String, Arc<Subscribers>>);

    impl Groups for FakeGroups {
        fn subscribers(&self, id: &str) -> Option<Arc<Subscribers>> {
            self.0.get(id).cloned()
        }
    }

    pub(super) fn groups() -> FakeGroups {
        let mut g = FakeGroups::default();
        let uids = ["a", "b", "c"].map(Uid::from).to_vec();
        g.0.insert("g1".into(), Arc::new(Subscribers::new(uids)));
        g
    }

    pub(super) fn limits(answer_after_sync: bool) -> CommitLimits {
        CommitLimits {
            answer_after_sync,
            commits_unsynced_max: 100,
            delivery_backlog_max: 100,
            backlog_budget_bytes: 1 << 20,
            redeliver_messages_max: 100,
        }
    }

    pub(super) type Core = CommitCore<FakeLog, u32>;
    pub(super) type Out = Vec<CommitOutput<u32, usize>>;

    pub(super) fn core(l: CommitLimits) -> Core {
        let window = IdempotencyWindow::new(IdempotencyConfig::default());
        CommitCore::new(
            FakeLog::default(),
            MessageIdGen::new(1, 0, 1).unwrap(),
            window,
            l,
        )
    }

    fn sender() -> Sender {
        Sender {
            node_id: 1,
            boot_id: 7,
            session_id: 1,
        }
    }

    /// Request `to` from uid `from` to `channel` ("g…" a group, else a person).
    pub(super) fn request(
        to: u32,
        from: &str,
        channel: &str,
        client_msg_no: &str,
    ) -> CommitRequest<u32> {
        let channel = if channel.starts_with('g') {
            Channel::Group { id: channel.into() }
        } else {
            Channel::resolve(from, channel, crate::send::channel::CHANNEL_TYPE_PERSON).unwrap()
        };
        CommitRequest {
            answer_to: to,
            sender: Some(sender()),
            from_uid: Uid::from(from),
            channel,
            client_msg_no: client_msg_no.into(),
            setting: 0,
            flags: 0,
            expire_s: 0,
            topic: String::new(),
            payload: b"hi".to_vec(),
        }
    }

    pub(super) const T0: Now = Now {
        wall_ms: 1_800_000_000_000,
        mono_ns: 5_000,
    };

    /// The answers in `out` as (to, seq, reason), and whether anything else was there.
    pub(super) fn answers(out: &mut Out) -> Vec<(u32, u64, u8)> {
        out.drain(..)
            .map(|o| match o {
                CommitOutput::Answer {
                    to,
                    message_seq,
                    reason,
                    ..
                } => (to, message_seq, reason.0),
                CommitOutput::SubmitSync(job) => panic!("unexpected sync job {job}"),
                CommitOutput::LogFailed { what, .. } => panic!("unexpected failure: {what}"),
            })
            .collect()
    }

    #[test]
    fn interval_policy_answers_the_turns_commits_at_its_end_with_dense_seqs() {
        let (mut c, g, mut out) = (core(limits(false)), groups(), Out::new());
        assert_eq!(
            c.on_commit(request(1, "a", "g1", ""), &g, T0, &mut out),
            Committing::Appended
        );
        assert_eq!(
            c.on_commit(request(2, "b", "g1", ""), &g, T0, &mut out),
            Committing::Appended
        );
        assert_eq!(
            c.on_commit(request(3, "a", "b", ""), &g, T0, &mut out),
            Committing::Appended
        );
        assert!(
            out.is_empty(),
            "nothing answered before the end of the turn"
        );
        assert_eq!(c.unanswered(), 3);
        assert_eq!(c.end_turn(&mut out), 3);
        assert_eq!(answers(&mut out), vec![(1, 1, 1), (2, 2, 1), (3, 1, 1)]);
        assert_eq!((c.unanswered(), c.backlog_len()), (0, 3));
        assert!(c.backlog_bytes() > 3 * 1024);
        // The sync runs on the timer, one job at a time.
        c.on_sync_timer(&mut out);
        assert!(matches!(out.as_slice(), [CommitOutput::SubmitSync(3)]));
        out.clear();
        c.on_sync_timer(&mut out);
        assert!(out.is_empty(), "a job is in flight");
        c.on_sync_done(Ok(()), T0, &mut out);
        assert!(out.is_empty(), "nothing waited for it");
        assert_eq!(c.log().durable, 3);
    }

    /// The turn's batch of unanswered commits keeps its buffer from turn to turn
    /// (nothing allocated per SEND once warm), under both policies.
    #[test]
    fn the_turns_batches_reuse_their_buffers() {
        for answer_after_sync in [false, true] {
            let (mut c, g, mut out) = (core(limits(answer_after_sync)), groups(), Out::new());
            for turn in 0..3u32 {
                for to in 0..4 {
                    c.on_commit(request(turn * 4 + to, "a", "g1", ""), &g, T0, &mut out);
                }
                c.end_turn(&mut out);
                if answer_after_sync {
                    c.on_sync_done(Ok(()), T0, &mut out);
                }
                out.clear();
            }
            assert!(
                c.unsynced.capacity() >= 4,
                "answer_after_sync {answer_after_sync}: the next turn's batch starts empty \
                 with capacity {}",
                c.unsynced.capacity()
            );
        }
    }

    #[test]
    fn always_policy_answers_only_after_the_sync_and_one_job_at_a_time() {
        let (mut c, g, mut out) = (core(limits(true)), groups(), Out::new());
        c.on_commit(request(1, "a", "g1", ""), &g, T0, &mut out);
        assert_eq!(c.end_turn(&mut out), 1);
        assert!(matches!(out.as_slice(), [CommitOutput::SubmitSync(1)]));
        out.clear();
        // The next turn's commit waits for the next job.
        c.on_commit(request(2, "a", "g1", ""), &g, T0, &mut out);
        assert_eq!(c.end_turn(&mut out), 0);
        assert!(out.is_empty());
        c.on_sync_done(Ok(()), T0, &mut out);
        assert_eq!(answers(&mut out), vec![(1, 1, 1)]);
        assert_eq!(c.end_turn(&mut out), 1);
        assert!(matches!(out.as_slice(), [CommitOutput::SubmitSync(2)]));
        out.clear();
        // A failed sync refuses its batch (SENDACK 15); its charge is returned.
        c.on_sync_done(Err(std::io::Error::other("EIO")), T0, &mut out);
        assert!(matches!(&out[0], CommitOutput::LogFailed { fault, .. } if fault.disk));
        out.remove(0);
        assert_eq!(answers(&mut out), vec![(2, 0, 15)]);
        assert_eq!(c.backlog_len(), 1, "only the durable message is delivered");
    }

    #[test]
    fn an_idempotent_resend_gets_the_first_answer_and_no_second_record() {
        let (mut c, g, mut out) = (core(limits(false)), groups(), Out::new());
        c.on_commit(request(1, "a", "g1", "m1"), &g, T0, &mut out);
        // The resend comes in the same turn as the first copy: answered with it.
        let later = Now {
            wall_ms: T0.wall_ms + 1_000,
            ..T0
        };
        assert_eq!(
            c.on_commit(request(2, "a", "g1", "m1"), &g, later, &mut out),
            Committing::Duplicate
        );
        c.end_turn(&mut out);
        let mut ids = Vec::new();
        for o in out.drain(..) {
            if let CommitOutput::Answer {
                message_id,
                message_seq,
                ..
            } = o
            {
                ids.push((message_id, message_seq));
            }
        }
        assert_eq!(ids.len(), 2);
        assert_eq!(ids[0], ids[1]);
        assert_eq!(c.log().records.len(), 1);
        assert_eq!(c.backlog_len(), 1, "delivered once");
        assert_eq!(c.take_counts().deduplicated, 1);
    }

    #[test]
    fn a_resend_of_a_message_recovered_from_the_log_is_delivered_once_more() {
        let (mut c, g, mut out) = (core(limits(false)), groups(), Out::new());
        // After a restart the window was refilled from the log: the first copy's
        // answer is unknown (a failed sync, a crash before it).
        let ids = SentIds {
            message_id: 77,
            message_seq: 4,
        };
        let w = c.idempotency.as_mut().unwrap();
        w.refill(
            "a",
            "m1",
            ids,
            (T0.wall_ms / 1000) as u32,
            T0.wall_ms / 1000,
        );
        let r = request(1, "a", "g1", "m1");
        assert_eq!(c.on_commit(r, &g, T0, &mut out), Committing::Recovered);
        let r = request(2, "a", "g1", "m1");
        assert_eq!(c.on_commit(r, &g, T0, &mut out), Committing::Duplicate);
        c.end_turn(&mut out);
        assert_eq!(answers(&mut out), vec![(1, 4, 1), (2, 4, 1)]);
        assert!(c.log().records.is_empty(), "no second record");
        assert_eq!(c.backlog_len(), 1, "delivered once, with the first resend");
    }

    #[test]
    fn a_plain_resend_is_answered_even_when_the_backlog_is_full() {
        let g = groups();
        let mut out = Out::new();
        let mut c = core(CommitLimits {
            delivery_backlog_max: 1,
            ..limits(false)
        });
        c.on_commit(request(1, "a", "g1", "m1"), &g, T0, &mut out);
        c.end_turn(&mut out);
        out.clear();
        assert_eq!(c.backlog_len(), 1, "full");
        let r = request(2, "a", "g1", "m1");
        assert_eq!(c.on_commit(r, &g, T0, &mut out), Committing::Duplicate);
        c.on_commit(request(3, "a", "g1", "m2"), &g, T0, &mut out);
        c.end_turn(&mut out);
        assert_eq!(answers(&mut out), vec![(3, 0, 22), (2, 1, 1)]);
    }

    #[test]
    fn permission_refuses_unknown_groups_and_non_members_but_not_the_api() {
        let (mut c, g, mut out) = (core(limits(false)), groups(), Out::new());
        assert_eq!(
            c.on_commit(request(1, "a", "g2", ""), &g, T0, &mut out),
            Committing::Refused
        );
        assert_eq!(
            c.on_commit(request(2, "z", "g1", ""), &g, T0, &mut out),
            Committing::Refused
        );
        let mut api = request(3, "z", "g1", "");
        api.sender = None;
        assert_eq!(c.on_commit(api, &g, T0, &mut out), Committing::Appended);
        assert_eq!(answers(&mut out), vec![(1, 0, 5), (2, 0, 3)]);
        assert!(c.log().records.len() == 1);
    }

    #[test]
    fn back_pressure_refuses_past_the_backlog_and_the_unanswered_bounds() {
        let g = groups();
        let mut out = Out::new();
        let mut c = core(CommitLimits {
            delivery_backlog_max: 2,
            ..limits(false)
        });
        for to in 1..=3 {
            c.on_commit(request(to, "a", "g1", ""), &g, T0, &mut out);
        }
        assert_eq!(answers(&mut out), vec![(3, 0, 22)]);
        assert_eq!(c.take_counts().refused_backlog, 1);
        let mut c = core(CommitLimits {
            commits_unsynced_max: 1,
            ..limits(false)
        });
        c.on_commit(request(1, "a", "g1", ""), &g, T0, &mut out);
        c.on_commit(request(2, "a", "g1", ""), &g, T0, &mut out);
        assert_eq!(answers(&mut out), vec![(2, 0, 15)]);
        let mut c = core(CommitLimits {
            backlog_budget_bytes: 1500,
            ..limits(false)
        });
        c.on_commit(request(1, "a", "g1", ""), &g, T0, &mut out);
        c.on_commit(request(2, "a", "g1", ""), &g, T0, &mut out);
        assert_eq!(
            answers(&mut out),
            vec![(2, 0, 22)],
            "one charge fits, two do not"
        );
    }

    #[test]
    fn a_failed_append_is_reported_and_refused() {
        let (mut c, g, mut out) = (core(limits(false)), groups(), Out::new());
        c.log.fail_append = true;
        assert_eq!(
            c.on_commit(request(1, "a", "g1", ""), &g, T0, &mut out),
            Committing::Refused
        );
        assert!(matches!(&out[0], CommitOutput::LogFailed { what: "append", fault } if fault.disk));
        out.remove(0);
        assert_eq!(answers(&mut out), vec![(1, 0, 15)]);
        assert_eq!(c.backlog_bytes(), 0);
    }

    #[test]
    fn stop_syncs_and_answers_everything_unanswered() {
        let (mut c, g, mut out) = (core(limits(true)), groups(), Out::new());
        c.on_commit(request(1, "a", "g1", ""), &g, T0, &mut out);
        c.end_turn(&mut out);
        out.clear();
        c.on_commit(request(2, "a", "g1", ""), &g, T0, &mut out);
        c.stop(T0, &mut out);
        assert_eq!(answers(&mut out), vec![(1, 1, 1), (2, 2, 1)]);
        assert_eq!(c.log().durable, 2);
    }

    /// Every uid is online once, on shard 0 or 1 by its first byte.
    pub(super) struct Online;

    impl EndpointLookup for Online {
        fn endpoints_by_targets_into(
            &mut self,
            lookups: &[(crate::cluster::Target, &[Uid])],
            endpoints: &mut Vec<Endpoint>,
            results: &mut Vec<Result<std::ops::Range<usize>, AuthorityError>>,
        ) {
            for (_, uids) in lookups {
                let start = endpoints.len();
                for uid in *uids {
                    let shard = u64::from(uid.as_bytes()[0] & 1);
                    endpoints.push(Endpoint {
                        uid: uid.clone(),
                        device_flag: 0,
                        device_level: crate::presence::route::DeviceLevel::Master,
                        node_id: 1,
                        boot_id: 7,
                        session_id: (shard << SESSION_SHARD_SHIFT) | 100,
                        owner_seq: 1,
                    });
                }
                results.push(Ok(start..endpoints.len()));
            }
        }
    }

    /// The push batches in `out` as (destination, endpoints), drained; a lookup
    /// there is a failure.
    fn pushed(out: &mut Vec<PlanOutput>) -> Vec<(PushTo, usize)> {
        out.drain(..)
            .map(|o| match o {
                PlanOutput::Push(p) => (p.to, p.endpoints.len()),
                PlanOutput::Lookup(l) => panic!("unexpected lookup {l:?}"),
                PlanOutput::Offline(o) => panic!("offline uids not asked for: {:?}", o.uids),
            })
            .collect()
    }

    pub(super) fn plan_limits() -> PlanLimits {
        PlanLimits {
            local_node: 1,
            me: 0,
            shard_count: 2,
            subscriber_page_max: 2,
            push_batch_max: 8,
            pages_per_turn_max: 8,
            lookup_pages_in_flight_max: 4,
            reserved_room_per_peer: 4,
            offline_uids: false,
            offline_room: true,
            lookup_retries_max: 2,
            rebuild_retry_interval_ms: 20,
            rebuild_wait_ms_max: 3_000,
        }
    }

    #[test]
    fn delivery_pauses_while_a_peer_has_no_room_and_frees_the_charge_when_done() {
        let (mut c, g, mut out) = (core(limits(false)), groups(), Out::new());
        c.on_commit(request(1, "a", "g1", ""), &g, T0, &mut out);
        c.end_turn(&mut out);
        out.clear();
        let view = ClusterView::single_node(1);
        let plan = plan_limits();
        let mut pushes = Vec::new();
        // Shard 1 ("a", "c": odd first bytes) has no room beyond the reserve; pages of
        // two, in hash slot order (a 67, c 111, b 249): ["a", "c"], ["b"].
        let mut room = |_to: PushTo| 4;
        assert_eq!(
            c.pump(0, &view, &mut Online, &mut room, &plan, &mut pushes),
            2
        );
        assert_eq!(pushed(&mut pushes), vec![], "the first page's batch waits");
        assert_eq!(c.take_plan_counts().stalls, 1);
        assert_eq!(
            c.backlog_len(),
            1,
            "the message waits for its stalled batch"
        );
        let mut room = |_to: PushTo| 5;
        c.pump(0, &view, &mut Online, &mut room, &plan, &mut pushes);
        assert_eq!(
            pushed(&mut pushes),
            vec![(PushTo::Shard(1), 2), (PushTo::Shard(0), 1)],
            "the stalled batch ('a', 'c'), then the second page ('b', this shard)"
        );
        assert_eq!(
            c.pump(0, &view, &mut Online, &mut room, &plan, &mut pushes),
            0
        );
        assert_eq!((c.backlog_len(), c.backlog_bytes()), (0, 0));
    }

    #[test]
    fn a_page_led_by_another_node_waits_for_its_lookup_and_keeps_its_charge() {
        let (mut c, g, mut out) = (core(limits(false)), groups(), Out::new());
        c.on_commit(request(1, "a", "g1", ""), &g, T0, &mut out);
        c.end_turn(&mut out);
        out.clear();
        // Node 2 leads every hash slot: all of g1's groups are remote.
        let view = ClusterView::single_node(2);
        let plan = PlanLimits {
            subscriber_page_max: 8,
            ..plan_limits()
        };
        let mut room = |_to: PushTo| usize::MAX;
        let mut planned = Vec::new();
        c.pump(0, &view, &mut Online, &mut room, &plan, &mut planned);
        let [PlanOutput::Lookup(lookup)] = planned.as_slice() else {
            panic!("one lookup to node 2, nothing pushed");
        };
        assert_eq!((lookup.node, lookup.uids.len()), (2, 3));
        let (id, groups) = (lookup.lookup_id, lookup.groups.len());
        planned.clear();
        assert_eq!(c.awaiting_lookups(), 1);
        assert_eq!(
            c.pump(0, &view, &mut Online, &mut room, &plan, &mut planned),
            0,
            "nothing to do until the reply: the shard may sleep"
        );
        assert!(planned.is_empty());
        let charged = c.backlog_bytes();
        assert!(charged > 0, "the waiting message keeps its charge");
        let reply = LookupReply::Failed(crate::send::delivery::LookupFailure::PeerDown);
        assert!(c.on_lookup_reply(id, reply.clone()));
        assert!(!c.on_lookup_reply(id, reply), "a second reply is ignored");
        assert_eq!(
            c.pump(0, &view, &mut Online, &mut room, &plan, &mut planned),
            1
        );
        assert!(planned.is_empty(), "every group failed: nothing to push");
        assert_eq!(
            c.pump(0, &view, &mut Online, &mut room, &plan, &mut planned),
            0
        );
        let counts = c.take_plan_counts();
        assert_eq!(
            (
                counts.failed_groups,
                counts.failed_lookups,
                counts.ignored_replies
            ),
            (groups as u64, 1, 1)
        );
        assert_eq!((c.backlog_len(), c.backlog_bytes()), (0, 0));
    }
}
