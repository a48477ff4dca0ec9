//! The commit core's replicated path ("Replicated slot ids…", SEND): on a cluster
//! whose slot ids are replicated, a channel's SENDs go through its slot id's raft
//! group. The core gives each a message id; the SENDs of one turn to one group
//! become one entry ([`Replicas::propose`]); each replica's log gives the entry's
//! messages their seqs when it appends it ([`CommitCore::on_appended`], on the
//! leader); a SEND is answered with success once its entry is committed
//! ([`CommitCore::on_committed`]), and only then delivered.
//!
//! | event | may output |
//! |---|---|
//! | [`CommitCore::on_propose`] | `Answer` (a refusal, at once) or nothing (waits in its group's batch, or with a copy in flight) |
//! | [`CommitCore::propose_turn`] | the `Answer`s of batches that could not be proposed (10: no leader here; 15: the group refused) |
//! | [`CommitCore::on_appended`] | nothing: the seqs of an entry in flight, or what applying an entry not proposed here needs |
//! | [`CommitCore::on_committed`] | the entry's `Answer`s (success), its messages queued for delivery |
//! | [`CommitCore::on_lost`] | `Answer`s 15 for the entries in flight from an index on |
//! | [`CommitCore::redeliver`] | nothing: a predecessor's messages queued for delivery again |
//!
//! A resend of a SEND still in flight (same uid and client_msg_no) waits with it
//! and gets the same answer; one already committed is answered from the
//! idempotency window as on the log's own path.
//!
//! Every replica applies what it commits: an entry appended here that this core
//! did not propose (a follower's, or a predecessor's) is held with its messages'
//! keys and ids until it is committed in its term, then its SENDs join the
//! idempotency window and the id generator resumes after its ids, so a leader
//! that takes over answers a resend with the first copy's ids and issues ids
//! above its predecessor's. At most `commits_unsynced_max` such entries wait per
//! core (past it the oldest is dropped unapplied: a resend of one of its SENDs
//! would not be recognised).
//!
//! # Delivery after a change of leader
//!
//! A leader delivers what it commits; it may die after a commit and before (the
//! end of) its delivery. So each entry a leader proposes carries its delivery mark:
//! every entry of messages of its group at or below that index ended its delivery
//! here (handed to the gateways' links), by this leader or, through the marks it
//! saw, by its predecessors ([`Replicas::propose`]'s `mark`; a leader's mark
//! passes an entry when the planner finishes its last message). A replica holds
//! the messages of the entries it applies and did not propose while they are above
//! the highest mark it has seen (an entry's own mark is below its index, so at
//! least a group's newest entry is held); when it begins to serve as the group's
//! leader, [`CommitCore::redeliver`] delivers them again, each RECV flagged DUP
//! (at least once: recipients drop a second copy by message id), and its own mark
//! starts at the one it saw. At most `redeliver_messages_max` messages are held
//! per core (past it the oldest are dropped, counted: their recipients catch up
//! by messagesync). What a replica holds is memory only: a replica restarted
//! before it leads delivers nothing again.
//!
//! # Invariants
//!
//! - Every request gets exactly one `Answer`.
//! - Success only for an entry committed in the term it was proposed in, with the
//!   seqs its append gave (an entry whose index was committed in another term was
//!   cut: its SENDs get 15, the client resends).
//! - Per group, the entries in flight are in index order.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use proto::wkproto::{Flags, ReasonCode};

use crate::presence::route::Uid;
use crate::send::channel::CHANNEL_TYPE_GROUP;
use crate::send::idempotency::SentIds;
use crate::send::message::Committed;

use super::{CommitCore, CommitLog, CommitOutput, CommitRequest, Committing, Delivery, Groups};
use super::{NewMessage, Now};

/// The raft groups the core proposes to: the node's replicas on this shard, a
/// fake in tests.
pub trait Replicas {
    /// Proposes `messages` as one entry of `group`'s log, with this core's
    /// delivery `mark` for the group (module docs); the term and index it was
    /// given, or the SENDACK reason it could not be (10: this replica does not
    /// lead the group; 15: the group refused, e.g. its log is full).
    fn propose(
        &mut self,
        group: u32,
        mark: u64,
        messages: &[NewMessage<'_>],
    ) -> Result<(u64, u64), ReasonCode>;
}

/// A SEND waiting for its entry: its answer address, its message (seq 0 until
/// appended), and the resends that wait with it.
struct Proposed<A> {
    to: A,
    delivery: Delivery,
    resends: Vec<A>,
}

/// An entry in flight: proposed in `term` at `index`; `seqs` once appended here.
struct InFlight<A> {
    term: u64,
    index: u64,
    members: Vec<Proposed<A>>,
    seqs: Option<Vec<u64>>,
}

/// A message of an entry appended here that this core did not propose: what
/// applying it needs (its seq is the one this replica's append gave).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Foreign {
    /// The sender.
    pub from_uid: Uid,
    /// The client message number (empty: never deduplicated).
    pub client_msg_no: String,
    /// The id its leader gave it.
    pub message_id: i64,
    /// The wkproto channel type (1 person, 2 group).
    pub channel_type: u8,
    /// The stored channel key (a group's id, or a person channel's `x@y` key).
    pub channel_key: String,
    /// The RECV setting byte.
    pub setting: u8,
    /// The SEND header flags.
    pub flags: u8,
    /// When it was committed, in Unix seconds.
    pub timestamp_s: u32,
    /// The plaintext payload.
    pub payload: Vec<u8>,
}

impl Foreign {
    /// What applying `m` needs, as for an entry not proposed here.
    fn of(m: &Committed) -> Foreign {
        Foreign {
            from_uid: m.from_uid.clone(),
            client_msg_no: m.client_msg_no.clone(),
            message_id: m.message_id,
            channel_type: m.channel_type,
            channel_key: m.channel_key.clone(),
            setting: m.setting,
            flags: m.flags,
            timestamp_s: m.timestamp_s,
            payload: m.payload.clone(),
        }
    }
}

/// An entry of messages appended here that this core did not propose: the
/// delivery mark its leader gave it (module docs; 0: none) and its messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForeignEntry {
    /// Every entry of messages of its group at or below this index was delivered.
    pub mark: u64,
    /// Its messages, in order.
    pub messages: Vec<Foreign>,
}

/// The entry of messages a delivery in the planner belongs to: its group, its
/// index and whether it is the entry's last message (`None`: not replicated).
type EntryTag = Option<(u32, u64, bool)>;

/// An entry held for a delivery after a change of leader: its index, its
/// messages and their seqs.
type Held = (u64, Vec<(Foreign, u64)>);

/// The delivery marks (module docs, "Delivery after a change of leader").
#[derive(Default)]
pub(super) struct Marks {
    /// Per group: every entry of messages at or below it was delivered.
    through: HashMap<u32, u64>,
    /// The tags of the planner's backlog, in its order.
    tags: VecDeque<EntryTag>,
    /// Deliveries that ended before the front of `tags`.
    ended: u64,
    /// Per group: the entries applied here and not proposed here above its mark,
    /// oldest first.
    held: BTreeMap<u32, VecDeque<Held>>,
    /// The messages in `held` (at most `redeliver_messages_max`).
    held_messages: usize,
}

impl Marks {
    /// `group`'s mark (0: none known).
    pub(super) fn of(&self, group: u32) -> u64 {
        self.through.get(&group).copied().unwrap_or(0)
    }

    /// The planner has ended `count` deliveries since it began: the marks of the
    /// entries whose last message just ended move to them.
    pub(super) fn delivered(&mut self, count: u64) {
        while self.ended < count {
            let tag = self.tags.pop_front().expect("a tag per delivery enqueued");
            self.ended += 1;
            if let Some((group, index, true)) = tag {
                self.passed(group, index);
            }
        }
    }

    /// `group`'s entries of messages at or below `index` were delivered: the ones
    /// held there are not held any more.
    fn passed(&mut self, group: u32, index: u64) {
        let through = self.through.entry(group).or_default();
        if index <= *through {
            return;
        }
        *through = index;
        let Some(entries) = self.held.get_mut(&group) else {
            return;
        };
        while entries.front().is_some_and(|e| e.0 <= index) {
            let (_, messages) = entries.pop_front().expect("a front");
            self.held_messages -= messages.len();
        }
        if entries.is_empty() {
            self.held.remove(&group);
        }
    }

    /// Holds `group`'s entry at `index` (applied, above the mark); the oldest
    /// entries (this group's first, then the lowest group's) leave past `max`
    /// messages. Returns how many messages left.
    fn hold(&mut self, group: u32, index: u64, messages: Vec<(Foreign, u64)>, max: usize) -> u64 {
        self.held_messages += messages.len();
        self.held
            .entry(group)
            .or_default()
            .push_back((index, messages));
        let mut dropped = 0;
        while self.held_messages > max {
            let from = match self.held.get(&group) {
                Some(entries) if entries.len() > 1 => group,
                _ => *self.held.keys().next().expect("a held entry"),
            };
            let entries = self.held.get_mut(&from).expect("held");
            let (_, gone) = entries.pop_front().expect("a front");
            if entries.is_empty() {
                self.held.remove(&from);
            }
            self.held_messages -= gone.len();
            dropped += gone.len() as u64;
        }
        dropped
    }
}

/// An entry waiting for its commit to be applied: its term, its messages and
/// their seqs.
type ToApply = (u64, Vec<(Foreign, u64)>);

/// The proposals of one core: per group the batch this turn forms and the entries
/// in flight; and the entries appended here, not proposed here, waiting for
/// their commit to be applied.
pub(super) struct ProposalBook<A> {
    forming: BTreeMap<u32, Vec<Proposed<A>>>,
    in_flight: BTreeMap<u32, VecDeque<InFlight<A>>>,
    /// `(group, index)` → the entry's term, its messages and their seqs.
    to_apply: BTreeMap<(u32, u64), ToApply>,
    /// What each group's delivery passed, and what is held past it.
    pub(super) marks: Marks,
    /// Requests waiting (SENDs and their resends).
    waiting: usize,
    /// How many SENDs waiting have each `(uid, client_msg_no)` hash: a resend's
    /// search runs only on a hit.
    keys: HashMap<u64, usize>,
}

impl<A> Default for ProposalBook<A> {
    fn default() -> Self {
        ProposalBook {
            forming: BTreeMap::new(),
            in_flight: BTreeMap::new(),
            to_apply: BTreeMap::new(),
            marks: Marks::default(),
            waiting: 0,
            keys: HashMap::new(),
        }
    }
}

fn key_hash(uid: &str, client_msg_no: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (uid, client_msg_no).hash(&mut h);
    h.finish()
}

impl<A> ProposalBook<A> {
    /// Requests waiting for an entry (SENDs and their resends).
    pub(super) fn waiting(&self) -> usize {
        self.waiting
    }

    /// A SEND joins `group`'s batch of this turn.
    pub(super) fn form(&mut self, group: u32, to: A, delivery: Delivery) {
        let m = &delivery.message;
        if !m.client_msg_no.is_empty() {
            *(self.keys)
                .entry(key_hash(&m.from_uid, &m.client_msg_no))
                .or_default() += 1;
        }
        self.waiting += 1;
        let p = Proposed {
            to,
            delivery,
            resends: Vec::new(),
        };
        self.forming.entry(group).or_default().push(p);
    }

    /// The SEND waiting with this uid and client_msg_no, if any.
    fn find_mut(&mut self, uid: &str, client_msg_no: &str) -> Option<&mut Proposed<A>> {
        if !self.keys.contains_key(&key_hash(uid, client_msg_no)) {
            return None;
        }
        let forming = self.forming.values_mut().flatten();
        let flying = (self.in_flight.values_mut().flatten()).flat_map(|e| e.members.iter_mut());
        forming.chain(flying).find(|p| {
            let m = &p.delivery.message;
            *m.from_uid == *uid && m.client_msg_no == client_msg_no
        })
    }

    /// A SEND answered: it and its resends wait no more.
    fn done(&mut self, p: &Proposed<A>) {
        self.waiting -= 1 + p.resends.len();
        let m = &p.delivery.message;
        if m.client_msg_no.is_empty() {
            return;
        }
        let h = key_hash(&m.from_uid, &m.client_msg_no);
        if let Some(n) = self.keys.get_mut(&h) {
            *n -= 1;
            if *n == 0 {
                self.keys.remove(&h);
            }
        }
    }
}

/// A message of a predecessor's entry as delivered again (DUP, no sender, no
/// topic or expiry: entries do not carry them); `None` for a group's message
/// whose group is gone.
fn redelivery(f: Foreign, seq: u64, groups: &impl Groups, now: Now) -> Option<Delivery> {
    let subscribers = match f.channel_type {
        CHANNEL_TYPE_GROUP => Some(groups.subscribers(&f.channel_key)?),
        _ => None,
    };
    let message = Committed {
        committed_ns: now.mono_ns,
        message_id: f.message_id,
        message_seq: seq,
        timestamp_s: f.timestamp_s,
        from_uid: f.from_uid,
        channel_key: f.channel_key,
        channel_type: f.channel_type,
        client_msg_no: f.client_msg_no,
        setting: f.setting,
        flags: f.flags | Flags::DUP.0,
        expire_s: 0,
        topic: String::new(),
        payload: f.payload,
    };
    let charge_bytes = 1024
        + message.payload.len()
        + message.client_msg_no.len()
        + message.from_uid.len()
        + message.channel_key.len();
    Some(Delivery {
        message: Arc::new(message),
        sender: None,
        subscribers,
        charge_bytes,
    })
}

/// The message as the log stores it (its seq comes from the append).
fn new_message(d: &Delivery) -> NewMessage<'_> {
    let m = &d.message;
    NewMessage {
        message_id: m.message_id,
        channel_type: m.channel_type,
        channel_id: &m.channel_key,
        from_uid: &m.from_uid,
        client_msg_no: &m.client_msg_no,
        setting: m.setting,
        msg_flags: m.flags,
        timestamp_s: m.timestamp_s,
        payload: &m.payload,
    }
}

impl<L: CommitLog, A> CommitCore<L, A> {
    /// Step 2 on a replicated cluster: [`on_commit`](Self::on_commit)'s checks and
    /// id, then the SEND waits in `group`'s batch for [`propose_turn`](Self::propose_turn)
    /// (a NoPersist message, never stored, takes the log's path).
    pub fn on_propose(
        &mut self,
        r: CommitRequest<A>,
        group: u32,
        groups: &impl Groups,
        now: Now,
        out: &mut Vec<CommitOutput<A, L::Job>>,
    ) -> Committing {
        self.commit_to(r, Some(group), groups, now, out)
    }

    /// A resend of a SEND still waiting joins it (answered with it; 15 past
    /// `commits_unsynced_max`); anything else is handed back.
    pub(super) fn join_in_flight(
        &mut self,
        r: CommitRequest<A>,
        out: &mut Vec<CommitOutput<A, L::Job>>,
    ) -> Result<CommitRequest<A>, Committing> {
        if r.client_msg_no.is_empty() || self.proposals.waiting == 0 {
            return Ok(r);
        }
        let full = self.unanswered() >= self.limits.commits_unsynced_max;
        let Some(first) = self.proposals.find_mut(&r.from_uid, &r.client_msg_no) else {
            return Ok(r);
        };
        if full {
            return Err(super::refuse(out, r.answer_to, ReasonCode::SYSTEM_ERROR));
        }
        first.resends.push(r.answer_to);
        self.proposals.waiting += 1;
        self.counts.deduplicated += 1;
        Err(Committing::Duplicate)
    }

    /// The end of a turn: each group's batch proposed as one entry; a batch its
    /// group refuses is answered with the reason (every SEND of it, and their
    /// resends).
    pub fn propose_turn(
        &mut self,
        replicas: &mut impl Replicas,
        out: &mut Vec<CommitOutput<A, L::Job>>,
    ) {
        if self.proposals.forming.is_empty() {
            return;
        }
        for (group, members) in std::mem::take(&mut self.proposals.forming) {
            let proposed = {
                let messages: Vec<NewMessage<'_>> =
                    members.iter().map(|p| new_message(&p.delivery)).collect();
                replicas.propose(group, self.proposals.marks.of(group), &messages)
            };
            match proposed {
                Ok((term, index)) => {
                    let entries = self.proposals.in_flight.entry(group).or_default();
                    debug_assert!(entries.back().is_none_or(|e| e.index < index));
                    entries.push_back(InFlight {
                        term,
                        index,
                        members,
                        seqs: None,
                    });
                }
                Err(reason) => {
                    for p in members {
                        self.refuse_proposed(p, reason, out);
                    }
                }
            }
        }
    }

    /// This replica appended `group`'s entry at `index` in `term`, its messages
    /// given `seqs` (in order). An entry of another term at the index of one in
    /// flight means that one was cut: it and the later ones are answered 15
    /// ([`on_lost`](Self::on_lost)). An entry not proposed here, given with its
    /// messages (`foreign`), waits for its commit to be applied (its mark is
    /// taken at once); one it replaces (the same index or later) is dropped.
    pub fn on_appended(
        &mut self,
        group: u32,
        term: u64,
        index: u64,
        seqs: &[u64],
        foreign: Option<ForeignEntry>,
        out: &mut Vec<CommitOutput<A, L::Job>>,
    ) {
        let book = &mut self.proposals;
        if let Some(entry) = &foreign {
            book.marks.passed(group, entry.mark);
        }
        let replaced: Vec<(u32, u64)> = (book.to_apply.range((group, index)..=(group, u64::MAX)))
            .map(|(k, _)| *k)
            .collect();
        for k in replaced {
            book.to_apply.remove(&k);
        }
        let flying = (book.in_flight.get_mut(&group))
            .and_then(|entries| entries.iter_mut().find(|e| e.index == index));
        if let Some(e) = flying {
            if e.term == term && e.members.len() == seqs.len() {
                e.seqs = Some(seqs.to_vec());
                return;
            }
            debug_assert!(term > e.term, "only a later term's entry replaces one");
            // Cut: answered 15; the entry that replaces it is applied as below.
            self.on_lost(group, index, out);
        }
        if let Some(messages) = foreign
            .map(|e| e.messages)
            .filter(|m| m.len() == seqs.len())
        {
            let messages = messages.into_iter().zip(seqs.iter().copied()).collect();
            self.hold_to_apply(group, index, (term, messages));
        }
    }

    /// `group`'s entry at `index` waits for its commit in its term to be applied
    /// (bounded: past `commits_unsynced_max` the oldest is dropped unapplied).
    fn hold_to_apply(&mut self, group: u32, index: u64, entry: ToApply) {
        let book = &mut self.proposals.to_apply;
        book.insert((group, index), entry);
        if book.len() > self.limits.commits_unsynced_max {
            book.pop_first();
        }
    }

    /// `group`'s entry at `index` was committed in `term`: the entries in flight
    /// up to it are answered, success for the one of `term` at `index` (its SENDs
    /// queued for delivery), 15 for the ones it replaced.
    pub fn on_committed(
        &mut self,
        group: u32,
        term: u64,
        index: u64,
        now: Now,
        out: &mut Vec<CommitOutput<A, L::Job>>,
    ) {
        let now_s = now.wall_ms / 1000;
        self.apply_foreign(group, term, index, now_s);
        loop {
            let Some(entries) = self.proposals.in_flight.get_mut(&group) else {
                return;
            };
            let Some(front) = entries.front() else {
                self.proposals.in_flight.remove(&group);
                return;
            };
            if front.index > index {
                return;
            }
            let e = entries.pop_front().expect("a front");
            match e.seqs.filter(|_| e.index == index && e.term == term) {
                Some(seqs) => {
                    let last = e.members.len() - 1;
                    for (i, (p, seq)) in e.members.into_iter().zip(seqs).enumerate() {
                        let tag = Some((group, index, i == last));
                        self.answer_proposed(p, seq, tag, now_s, out);
                    }
                }
                None => {
                    for p in e.members {
                        self.refuse_proposed(p, ReasonCode::SYSTEM_ERROR, out);
                    }
                }
            }
        }
    }

    /// The entry not proposed here at `index`, committed in `term`: its SENDs
    /// into the idempotency window, the id generator past its ids, its messages
    /// held for a delivery after a change of leader while above the group's
    /// mark. Entries waiting at or below `index` leave (one of another term was
    /// cut).
    fn apply_foreign(&mut self, group: u32, term: u64, index: u64, now_s: u64) {
        let book = &mut self.proposals.to_apply;
        if book.is_empty() {
            return;
        }
        let done: Vec<(u32, u64)> = (book.range((group, 0)..=(group, index)))
            .map(|(k, _)| *k)
            .collect();
        for k in done {
            let Some((held_term, messages)) = book.remove(&k) else {
                continue;
            };
            if k.1 != index || held_term != term {
                continue;
            }
            for (m, seq) in &messages {
                self.ids.resume_after(m.message_id);
                if m.client_msg_no.is_empty() {
                    continue;
                }
                if let Some(w) = self.idempotency.as_mut() {
                    let ids = SentIds {
                        message_id: m.message_id,
                        message_seq: *seq,
                    };
                    w.insert(&m.from_uid, &m.client_msg_no, ids, now_s);
                }
            }
            let marks = &mut self.proposals.marks;
            if index > marks.of(group) {
                let max = self.limits.redeliver_messages_max;
                self.counts.redeliver_dropped += marks.hold(group, index, messages, max);
            }
        }
    }

    /// This replica began to serve as `group`'s leader: the messages of its
    /// predecessors' entries held above the group's mark (committed, their
    /// delivery perhaps not ended) are queued for delivery again, each RECV
    /// flagged DUP and from no sending session (the sender's own devices get it
    /// too); a group's message whose group is gone is skipped. Returns how many.
    pub fn redeliver(&mut self, group: u32, groups: &impl Groups, now: Now) -> usize {
        let Some(entries) = self.proposals.marks.held.remove(&group) else {
            return 0;
        };
        let mut queued = 0;
        for (index, messages) in entries {
            let held = messages.len();
            self.proposals.marks.held_messages -= held;
            let deliveries: Vec<Delivery> = (messages.into_iter())
                .filter_map(|(f, seq)| redelivery(f, seq, groups, now))
                .collect();
            // A group deleted since: nobody to deliver to; counted dropped.
            self.counts.redeliver_dropped += (held - deliveries.len()) as u64;
            let last = deliveries.len().saturating_sub(1);
            for (i, d) in deliveries.into_iter().enumerate() {
                self.backlog_bytes += d.charge_bytes;
                self.enqueue(d, Some((group, index, i == last)));
                queued += 1;
            }
        }
        self.counts.redelivered += queued as u64;
        queued
    }

    /// Queues `d` for delivery, `tag` naming its entry (module docs).
    pub(super) fn enqueue(&mut self, d: Delivery, tag: EntryTag) {
        self.proposals.marks.tags.push_back(tag);
        self.planner.enqueue(d);
    }

    /// `group`'s entries in flight from `index` on will not be answered by their
    /// commit here (cut by a later leader, or this replica lost office: `index`
    /// 0): answered 15; the client resends. An entry appended here may still
    /// commit in its term under the next leader: it waits to be applied at that
    /// commit like an entry not proposed here, so that a resend is answered from
    /// the window rather than stored twice.
    pub fn on_lost(&mut self, group: u32, index: u64, out: &mut Vec<CommitOutput<A, L::Job>>) {
        let Some(entries) = self.proposals.in_flight.get_mut(&group) else {
            return;
        };
        let keep = entries.iter().take_while(|e| e.index < index).count();
        let lost: Vec<InFlight<A>> = entries.drain(keep..).collect();
        if entries.is_empty() {
            self.proposals.in_flight.remove(&group);
        }
        for e in lost {
            if let Some(seqs) = &e.seqs {
                let messages = (e.members.iter().zip(seqs))
                    .map(|(p, &seq)| (Foreign::of(&p.delivery.message), seq))
                    .collect();
                self.hold_to_apply(group, e.index, (e.term, messages));
            }
            for p in e.members {
                self.refuse_proposed(p, ReasonCode::SYSTEM_ERROR, out);
            }
        }
    }

    /// Every proposal forming or in flight answered 15 (a stop).
    pub(super) fn refuse_all_proposals(&mut self, out: &mut Vec<CommitOutput<A, L::Job>>) {
        let forming = std::mem::take(&mut self.proposals.forming);
        let flying = std::mem::take(&mut self.proposals.in_flight);
        let members = (forming.into_values().flatten())
            .chain(flying.into_values().flatten().flat_map(|e| e.members));
        for p in members {
            self.refuse_proposed(p, ReasonCode::SYSTEM_ERROR, out);
        }
    }

    /// A committed SEND: its seq set, answered with success (and its resends),
    /// remembered in the idempotency window, queued for delivery.
    fn answer_proposed(
        &mut self,
        mut p: Proposed<A>,
        seq: u64,
        tag: EntryTag,
        now_s: u64,
        out: &mut Vec<CommitOutput<A, L::Job>>,
    ) {
        self.proposals.done(&p);
        let m = Arc::get_mut(&mut p.delivery.message).expect("unshared until delivered");
        m.message_seq = seq;
        let ids = SentIds {
            message_id: m.message_id,
            message_seq: seq,
        };
        if !m.client_msg_no.is_empty() {
            if let Some(w) = self.idempotency.as_mut() {
                w.insert(&m.from_uid, &m.client_msg_no, ids, now_s);
            }
        }
        let appended_ns = Some(m.committed_ns);
        for to in std::iter::once(p.to).chain(p.resends) {
            out.push(CommitOutput::Answer {
                to,
                message_id: ids.message_id,
                message_seq: ids.message_seq,
                reason: ReasonCode::SUCCESS,
                appended_ns,
            });
        }
        self.unanswered_deliveries -= 1;
        self.enqueue(p.delivery, tag);
    }

    /// A SEND refused after it was taken: answered `reason` (and its resends), its
    /// charge released.
    fn refuse_proposed(
        &mut self,
        p: Proposed<A>,
        reason: ReasonCode,
        out: &mut Vec<CommitOutput<A, L::Job>>,
    ) {
        self.proposals.done(&p);
        let answers = 1 + p.resends.len() as u64;
        if reason == ReasonCode::FORWARD_SEND_PACKET_ERROR {
            self.counts.refused_not_leader += answers;
        } else {
            self.counts.proposals_failed += answers;
        }
        for to in std::iter::once(p.to).chain(p.resends) {
            super::refuse(out, to, reason);
        }
        self.unanswered_deliveries -= 1;
        self.backlog_bytes -= p.delivery.charge_bytes;
    }
}

#[cfg(test)]
mod tests {
    use proto::wkproto::Flags;

    use super::super::tests::{
        answers, core, groups, limits, plan_limits, request, Online, Out, T0,
    };
    use super::*;
    use crate::send::idempotency::IdempotencyConfig;

    /// Records each proposal's group and message ids; answers the next index in
    /// term 2, or refuses with `refuse`.
    #[derive(Default)]
    struct FakeReplicas {
        proposed: Vec<(u32, Vec<i64>)>,
        marks: Vec<u64>,
        index: u64,
        refuse: Option<ReasonCode>,
    }

    impl Replicas for FakeReplicas {
        fn propose(
            &mut self,
            group: u32,
            mark: u64,
            messages: &[NewMessage<'_>],
        ) -> Result<(u64, u64), ReasonCode> {
            if let Some(reason) = self.refuse {
                return Err(reason);
            }
            self.marks.push(mark);
            self.proposed
                .push((group, messages.iter().map(|m| m.message_id).collect()));
            self.index += 1;
            Ok((2, self.index))
        }
    }

    /// The SENDs of a turn to one group are one entry, answered only once that
    /// entry is committed, with the seqs its append gave; then delivered.
    #[test]
    fn a_turns_sends_to_a_group_are_one_entry_answered_at_its_commit() {
        let (mut c, g, mut out) = (core(limits(false)), groups(), Out::new());
        let mut r = FakeReplicas::default();
        for (to, group) in [(1, 3), (2, 5), (3, 3)] {
            let req = request(to, "a", "g1", "");
            assert_eq!(
                c.on_propose(req, group, &g, T0, &mut out),
                Committing::Proposed
            );
        }
        assert_eq!(c.end_turn(&mut out), 0, "nothing for the log's path");
        c.propose_turn(&mut r, &mut out);
        assert!(out.is_empty(), "nothing answered before a commit");
        let groups_proposed: Vec<(u32, usize)> =
            r.proposed.iter().map(|(g, ids)| (*g, ids.len())).collect();
        assert_eq!(groups_proposed, vec![(3, 2), (5, 1)]);
        let ids = &r.proposed[0].1;
        assert!(ids[0] < ids[1], "ids increase in the entry");
        assert_eq!((c.unanswered(), c.backlog_len(), c.delivering()), (3, 3, 0));
        c.propose_turn(&mut r, &mut out);
        assert_eq!(r.proposed.len(), 2, "a batch is proposed once");
        c.on_appended(3, 2, 1, &[7, 8], None, &mut out);
        c.on_appended(5, 2, 2, &[4], None, &mut out);
        assert!(out.is_empty(), "appended is not committed");
        c.on_committed(3, 2, 1, T0, &mut out);
        assert_eq!(answers(&mut out), vec![(1, 7, 1), (3, 8, 1)]);
        assert_eq!((c.unanswered(), c.delivering()), (1, 2));
        c.on_committed(5, 2, 2, T0, &mut out);
        assert_eq!(answers(&mut out), vec![(2, 4, 1)]);
        assert_eq!((c.unanswered(), c.backlog_len(), c.delivering()), (0, 3, 3));
        c.on_committed(5, 2, 2, T0, &mut out);
        assert!(out.is_empty(), "an entry is answered once");
    }

    /// A resend of a SEND in flight waits with it and gets its answer; once
    /// committed, a resend is answered from the idempotency window with the same
    /// ids (and is not proposed again).
    #[test]
    fn a_resend_waits_with_its_first_copy_then_comes_from_the_window() {
        let (mut c, g, mut out) = (core(limits(false)), groups(), Out::new());
        let mut r = FakeReplicas::default();
        c.on_propose(request(1, "a", "g1", "n1"), 3, &g, T0, &mut out);
        let dup = c.on_propose(request(2, "a", "g1", "n1"), 3, &g, T0, &mut out);
        assert_eq!(dup, Committing::Duplicate);
        c.propose_turn(&mut r, &mut out);
        let dup = c.on_propose(request(3, "a", "g1", "n1"), 3, &g, T0, &mut out);
        assert_eq!(dup, Committing::Duplicate, "in flight too");
        let other = c.on_propose(request(4, "b", "g1", "n1"), 3, &g, T0, &mut out);
        assert_eq!(other, Committing::Proposed, "another uid's number");
        assert_eq!((c.unanswered(), c.backlog_len()), (4, 2));
        assert_eq!(r.proposed[0].1.len(), 1);
        c.on_appended(3, 2, 1, &[9], None, &mut out);
        c.on_committed(3, 2, 1, T0, &mut out);
        let mut first = Vec::new();
        for o in out.drain(..) {
            let CommitOutput::Answer {
                to,
                message_id,
                message_seq,
                ..
            } = o
            else {
                panic!("an answer");
            };
            first.push((to, message_id, message_seq));
        }
        assert_eq!(first.iter().map(|a| a.0).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert!(first.iter().all(|a| (a.1, a.2) == (r.proposed[0].1[0], 9)));
        assert_eq!(c.proposals.keys.len(), 1, "only uid b's number waits");
        let again = c.on_propose(request(5, "a", "g1", "n1"), 3, &g, T0, &mut out);
        assert_eq!(again, Committing::Duplicate);
        c.end_turn(&mut out);
        assert_eq!(answers(&mut out), vec![(5, 9, 1)]);
        c.propose_turn(&mut r, &mut out);
        assert_eq!(r.proposed.len(), 2, "only uid b's SEND proposed next");
        assert_eq!(c.take_counts().deduplicated, 3);
        c.stop(T0, &mut out);
        assert_eq!(answers(&mut out), vec![(4, 0, 15)]);
        assert!(c.proposals.keys.is_empty() && c.proposals.waiting() == 0);
    }

    /// A SEND committed here, and one applied from another leader's entry, are
    /// remembered for the window's `ttl_s` from their commit.
    #[test]
    fn a_committed_send_is_remembered_for_the_windows_ttl_from_its_commit() {
        let (mut c, g, mut out) = (core(limits(false)), groups(), Out::new());
        let mut r = FakeReplicas::default();
        let at = |s: u64| Now {
            wall_ms: T0.wall_ms + s * 1000,
            mono_ns: T0.mono_ns,
        };
        c.on_propose(request(1, "a", "g1", "here"), 3, &g, T0, &mut out);
        c.propose_turn(&mut r, &mut out);
        c.on_appended(3, 2, 1, &[1], None, &mut out);
        c.on_committed(3, 2, 1, T0, &mut out);
        c.on_appended(
            3,
            2,
            2,
            &[2],
            entry(vec![foreign("a", "there", 5)]),
            &mut out,
        );
        c.on_committed(3, 2, 2, T0, &mut out);
        out.clear();
        let ttl_s = IdempotencyConfig::default().ttl_s;
        for (to, number) in [(2, "here"), (3, "there")] {
            let dup = c.on_propose(
                request(to, "a", "g1", number),
                3,
                &g,
                at(ttl_s - 1),
                &mut out,
            );
            assert_eq!(dup, Committing::Duplicate, "{number}");
        }
        c.end_turn(&mut out);
        assert_eq!(answers(&mut out), vec![(2, 1, 1), (3, 2, 1)]);
        for (to, number) in [(4, "here"), (5, "there")] {
            let new = c.on_propose(request(to, "a", "g1", number), 3, &g, at(ttl_s), &mut out);
            assert_eq!(new, Committing::Proposed, "{number} forgotten");
        }
    }

    /// An entry cut by a later leader's entry, one committed in another term at its
    /// index, and the entries of a replica that lost office: answered 15, with
    /// their resends, their charges released; the entries before the cut stand.
    #[test]
    fn cut_replaced_and_lost_entries_are_answered_15() {
        let (mut c, g, mut out) = (core(limits(false)), groups(), Out::new());
        let mut r = FakeReplicas::default();
        for to in 1..=4u32 {
            c.on_propose(
                request(to, "a", "g1", &format!("n{to}")),
                3,
                &g,
                T0,
                &mut out,
            );
            c.propose_turn(&mut r, &mut out);
        }
        c.on_propose(request(5, "a", "g1", "n2"), 3, &g, T0, &mut out);
        c.on_appended(3, 2, 1, &[1], None, &mut out);
        c.on_appended(3, 3, 2, &[2], None, &mut out);
        assert_eq!(
            answers(&mut out),
            vec![(2, 0, 15), (5, 0, 15), (3, 0, 15), (4, 0, 15)]
        );
        c.on_committed(3, 2, 1, T0, &mut out);
        assert_eq!(answers(&mut out), vec![(1, 1, 1)]);
        for to in 6..=7u32 {
            c.on_propose(request(to, "a", "g1", ""), 3, &g, T0, &mut out);
            c.propose_turn(&mut r, &mut out);
        }
        c.on_appended(3, 2, 5, &[2], None, &mut out);
        c.on_committed(3, 4, 5, T0, &mut out);
        assert_eq!(
            answers(&mut out),
            vec![(6, 0, 15)],
            "committed in another term"
        );
        c.on_lost(3, 0, &mut out);
        assert_eq!(answers(&mut out), vec![(7, 0, 15)]);
        assert_eq!((c.unanswered(), c.backlog_len()), (0, 1));
        let delivering = c.backlog_bytes();
        assert!(
            delivering > 1024 && delivering < 2 * 1024,
            "only the committed SEND's charge"
        );
        c.on_lost(3, 0, &mut out);
        c.on_committed(3, 2, 9, T0, &mut out);
        assert!(out.is_empty());
        let counts = c.take_counts();
        assert_eq!((counts.proposals_failed, counts.refused_not_leader), (6, 0));
    }

    /// An entry committed before this replica appended it (no seqs known) is not
    /// answered with success.
    #[test]
    fn an_entry_without_its_append_is_not_a_success() {
        let (mut c, g, mut out) = (core(limits(false)), groups(), Out::new());
        let mut r = FakeReplicas::default();
        c.on_propose(request(1, "a", "g1", ""), 3, &g, T0, &mut out);
        c.propose_turn(&mut r, &mut out);
        c.on_committed(3, 2, 1, T0, &mut out);
        assert_eq!(answers(&mut out), vec![(1, 0, 15)]);
    }

    /// A group that refuses the proposal: its batch answered with the reason (10:
    /// no leader here), resends included; NoPersist SENDs take the log's path.
    #[test]
    fn a_refused_batch_gets_the_reason_and_no_persist_is_not_proposed() {
        let (mut c, g, mut out) = (core(limits(false)), groups(), Out::new());
        let mut r = FakeReplicas {
            refuse: Some(ReasonCode::FORWARD_SEND_PACKET_ERROR),
            ..FakeReplicas::default()
        };
        c.on_propose(request(1, "a", "g1", "n"), 3, &g, T0, &mut out);
        c.on_propose(request(2, "a", "g1", "n"), 3, &g, T0, &mut out);
        let mut quiet = request(3, "a", "g1", "q");
        quiet.flags = Flags::NO_PERSIST.0;
        assert_eq!(
            c.on_propose(quiet, 3, &g, T0, &mut out),
            Committing::Appended
        );
        c.propose_turn(&mut r, &mut out);
        assert_eq!(answers(&mut out), vec![(1, 0, 10), (2, 0, 10)]);
        let counts = c.take_counts();
        assert_eq!((counts.refused_not_leader, counts.proposals_failed), (2, 0));
        c.end_turn(&mut out);
        assert_eq!(answers(&mut out), vec![(3, 0, 1)]);
        assert_eq!((c.unanswered(), c.backlog_len()), (0, 1));
    }

    /// Proposals count against `commits_unsynced_max` (15 past it, a resend
    /// included); a stop answers the ones forming and in flight 15.
    #[test]
    fn proposals_are_bounded_and_a_stop_answers_them() {
        let mut l = limits(false);
        l.commits_unsynced_max = 2;
        let (mut c, g, mut out) = (core(l), groups(), Out::new());
        let mut r = FakeReplicas::default();
        c.on_propose(request(1, "a", "g1", "n"), 3, &g, T0, &mut out);
        c.propose_turn(&mut r, &mut out);
        c.on_propose(request(2, "a", "g1", ""), 4, &g, T0, &mut out);
        assert!(out.is_empty());
        c.on_propose(request(3, "a", "g1", ""), 4, &g, T0, &mut out);
        c.on_propose(request(4, "a", "g1", "n"), 4, &g, T0, &mut out);
        assert_eq!(answers(&mut out), vec![(3, 0, 15), (4, 0, 15)]);
        c.stop(T0, &mut out);
        assert_eq!(answers(&mut out), vec![(2, 0, 15), (1, 0, 15)]);
        assert_eq!(
            (c.unanswered(), c.backlog_len(), c.backlog_bytes()),
            (0, 0, 0)
        );
    }

    fn foreign(uid: &str, client_msg_no: &str, message_id: i64) -> Foreign {
        Foreign {
            from_uid: Uid::from(uid),
            client_msg_no: client_msg_no.into(),
            message_id,
            channel_type: 2,
            channel_key: "g1".into(),
            setting: 0,
            flags: 0,
            timestamp_s: 7,
            payload: b"hi".to_vec(),
        }
    }

    /// An entry of `messages` with no delivery mark.
    fn entry(messages: Vec<Foreign>) -> Option<ForeignEntry> {
        Some(ForeignEntry { mark: 0, messages })
    }

    /// An entry appended here and not proposed here is applied at its commit: a
    /// resend of one of its SENDs is answered with its ids (not proposed again),
    /// and the ids this core issues next are above its ids. An entry replaced by a
    /// later term's at its index, or committed in another term, is not applied.
    #[test]
    fn entries_not_proposed_here_are_applied_at_their_commit() {
        let (mut c, g, mut out) = (core(limits(false)), groups(), Out::new());
        let mut r = FakeReplicas::default();
        let later = (T0.wall_ms + 60_000 - crate::send::idgen::ID_EPOCH_MS) << 22;
        let later = later as i64;
        let ab = vec![foreign("a", "n1", later), foreign("b", "", later + 1)];
        c.on_appended(3, 2, 5, &[7, 8], entry(ab), &mut out);
        c.on_appended(
            3,
            2,
            6,
            &[9],
            entry(vec![foreign("a", "cut", 11)]),
            &mut out,
        );
        c.on_appended(
            3,
            3,
            6,
            &[9],
            entry(vec![foreign("a", "kept", 12)]),
            &mut out,
        );
        c.on_appended(
            3,
            3,
            7,
            &[10],
            entry(vec![foreign("a", "other", 13)]),
            &mut out,
        );
        c.on_committed(3, 2, 5, T0, &mut out);
        c.on_committed(3, 3, 6, T0, &mut out);
        c.on_committed(3, 4, 7, T0, &mut out);
        assert!(out.is_empty());
        for (to, number) in [(1, "n1"), (2, "cut"), (3, "kept"), (4, "other")] {
            c.on_propose(request(to, "a", "g1", number), 3, &g, T0, &mut out);
        }
        c.end_turn(&mut out);
        assert_eq!(answers(&mut out), vec![(1, 7, 1), (3, 9, 1)]);
        c.propose_turn(&mut r, &mut out);
        let ids: Vec<i64> = r.proposed.iter().flat_map(|(_, ids)| ids.clone()).collect();
        assert_eq!(ids.len(), 2, "the cut and the other term's SENDs are new");
        assert!(
            ids.iter().all(|&id| id > later + 1),
            "{ids:?} after {later}"
        );
    }

    /// A SEND whose entry was in flight when this replica lost the lead is
    /// answered 15, but its entry may still commit under the next leader: once it
    /// commits in its term, a resend is answered from the window with its seq
    /// (not proposed again: it would be stored twice), and a resend of one whose
    /// index another term committed is proposed again.
    #[test]
    fn a_send_lost_with_the_lead_and_committed_after_is_not_proposed_again() {
        let (mut c, g, mut out) = (core(limits(false)), groups(), Out::new());
        let mut r = FakeReplicas::default();
        for (to, number) in [(1, "kept"), (2, "cut")] {
            c.on_propose(request(to, "a", "g1", number), 3, &g, T0, &mut out);
            c.propose_turn(&mut r, &mut out);
        }
        c.on_appended(3, 2, 1, &[1], None, &mut out);
        c.on_appended(3, 2, 2, &[2], None, &mut out);
        c.on_lost(3, 0, &mut out);
        assert_eq!(answers(&mut out), vec![(1, 0, 15), (2, 0, 15)]);
        c.on_committed(3, 2, 1, T0, &mut out);
        c.on_committed(3, 3, 2, T0, &mut out);
        assert!(out.is_empty());
        for (to, number) in [(3, "kept"), (4, "cut")] {
            c.on_propose(request(to, "a", "g1", number), 3, &g, T0, &mut out);
        }
        c.end_turn(&mut out);
        assert_eq!(
            answers(&mut out),
            vec![(3, 1, 1)],
            "answered from the window"
        );
        c.propose_turn(&mut r, &mut out);
        assert_eq!(r.proposed.len(), 3, "only the cut one is proposed again");
    }

    /// An entry of another term that replaces one in flight here (cut) is applied
    /// at its commit like any entry not proposed here: a resend of its SEND is
    /// answered with its ids.
    #[test]
    fn an_entry_that_cuts_one_in_flight_is_applied_at_its_commit() {
        let (mut c, g, mut out) = (core(limits(false)), groups(), Out::new());
        let mut r = FakeReplicas::default();
        c.on_propose(request(1, "a", "g1", "mine"), 3, &g, T0, &mut out);
        c.propose_turn(&mut r, &mut out);
        let theirs = entry(vec![foreign("b", "theirs", 5)]);
        c.on_appended(3, 3, 1, &[1], theirs, &mut out);
        assert_eq!(answers(&mut out), vec![(1, 0, 15)]);
        c.on_committed(3, 3, 1, T0, &mut out);
        c.on_propose(request(2, "b", "g1", "theirs"), 3, &g, T0, &mut out);
        c.end_turn(&mut out);
        assert_eq!(answers(&mut out), vec![(2, 1, 1)]);
    }

    /// At most `commits_unsynced_max` entries wait to be applied: past it the
    /// oldest is dropped unapplied; an entry whose messages and seqs disagree is
    /// not held.
    #[test]
    fn entries_waiting_to_be_applied_are_bounded() {
        let mut l = limits(false);
        l.commits_unsynced_max = 2;
        let (mut c, g, mut out) = (core(l), groups(), Out::new());
        for index in 1..=3u64 {
            let m = vec![foreign("a", &format!("n{index}"), index as i64)];
            c.on_appended(3, 2, index, &[index], entry(m), &mut out);
        }
        c.on_appended(
            3,
            2,
            4,
            &[4, 5],
            entry(vec![foreign("a", "n4", 4)]),
            &mut out,
        );
        for index in 1..=4 {
            c.on_committed(3, 2, index, T0, &mut out);
        }
        for index in [2, 3] {
            let dup = c.on_propose(
                request(index, "a", "g1", &format!("n{index}")),
                3,
                &g,
                T0,
                &mut out,
            );
            assert_eq!(dup, Committing::Duplicate);
        }
        c.end_turn(&mut out);
        assert_eq!(answers(&mut out), vec![(2, 2, 1), (3, 3, 1)]);
        for index in [1, 4] {
            let new = c.on_propose(
                request(index, "a", "g1", &format!("n{index}")),
                3,
                &g,
                T0,
                &mut out,
            );
            assert_eq!(new, Committing::Proposed, "n{index} was not applied");
        }
    }

    /// Pumps `c` once with room everywhere: each message pushed as (message id,
    /// flags, recipients).
    fn delivered(c: &mut super::super::tests::Core) -> Vec<(i64, u8, usize)> {
        let view = crate::cluster::ClusterView::single_node(1);
        let mut room = |_| usize::MAX;
        let mut pushes = Vec::new();
        c.pump(
            0,
            &view,
            &mut Online,
            &mut room,
            &plan_limits(),
            &mut pushes,
        );
        let mut messages: Vec<(i64, u8, usize)> = Vec::new();
        for o in pushes {
            let crate::send::delivery::PlanOutput::Push(p) = o else {
                panic!("only pushes");
            };
            let m = &p.message;
            match messages.last_mut() {
                Some(last) if last.0 == m.message_id => last.2 += p.endpoints.len(),
                _ => messages.push((m.message_id, m.flags, p.endpoints.len())),
            }
        }
        messages
    }

    /// A new leader delivers again the messages of its predecessor's entries that
    /// the predecessor's delivery mark did not pass (the last entries it
    /// proposed), each flagged DUP and to every subscriber (no sending session
    /// spared); an entry below the mark, another group's entries and an entry
    /// whose group is gone are not; its own mark then passes them.
    #[test]
    fn a_new_leader_delivers_again_what_its_predecessors_mark_did_not_pass() {
        let (mut c, g, mut out) = (core(limits(false)), groups(), Out::new());
        let marked = |mark, messages| Some(ForeignEntry { mark, messages });
        let gone = Foreign {
            channel_key: "g9".into(),
            ..foreign("a", "", 4)
        };
        c.on_appended(
            3,
            2,
            1,
            &[1],
            marked(0, vec![foreign("a", "", 1)]),
            &mut out,
        );
        let two = vec![foreign("a", "", 2), foreign("b", "n3", 3), gone];
        c.on_appended(3, 2, 2, &[2, 3, 4], marked(1, two), &mut out);
        c.on_appended(
            3,
            2,
            3,
            &[5],
            marked(1, vec![foreign("c", "", 5)]),
            &mut out,
        );
        c.on_appended(
            5,
            2,
            1,
            &[1],
            marked(0, vec![foreign("c", "", 6)]),
            &mut out,
        );
        for (group, index) in [(3, 1), (3, 2), (3, 3), (5, 1)] {
            c.on_committed(group, 2, index, T0, &mut out);
        }
        assert!(out.is_empty());
        assert_eq!(delivered(&mut c), vec![], "a follower delivers nothing");
        assert_eq!(c.redeliver(3, &g, T0), 3);
        assert_eq!(c.redeliver(3, &g, T0), 0, "once");
        // Each charged its payload and strings ("hi", uid "a"/"b"/"c", "g1", and
        // one client_msg_no "n3").
        assert_eq!(c.backlog_bytes(), 3 * (1024 + 2 + 1 + 2) + 2);
        let dup = Flags::DUP.0;
        assert_eq!(
            delivered(&mut c),
            vec![(2, dup, 3), (3, dup, 3), (5, dup, 3)],
            "g1's three subscribers each, the senders included"
        );
        let counts = c.take_counts();
        let dropped = "the message of the deleted group is counted dropped";
        assert_eq!(
            (counts.redelivered, counts.redeliver_dropped),
            (3, 1),
            "{dropped}"
        );
        let mut r = FakeReplicas::default();
        c.on_propose(request(1, "a", "g1", ""), 3, &g, T0, &mut out);
        c.on_propose(request(2, "a", "g1", ""), 5, &g, T0, &mut out);
        c.propose_turn(&mut r, &mut out);
        assert_eq!(r.marks, vec![3, 0], "group 3's mark passed its entries");
        assert_eq!(c.redeliver(5, &g, T0), 1, "group 5's entry is still held");
    }

    /// A leader's mark passes an entry once the last message of it was delivered
    /// (not at its commit), and its next proposal carries it.
    #[test]
    fn a_leaders_mark_passes_an_entry_when_its_delivery_ends() {
        let (mut c, g, mut out) = (core(limits(false)), groups(), Out::new());
        let mut r = FakeReplicas::default();
        c.on_propose(request(1, "a", "g1", ""), 3, &g, T0, &mut out);
        c.on_propose(request(2, "b", "g1", ""), 3, &g, T0, &mut out);
        c.propose_turn(&mut r, &mut out);
        c.on_appended(3, 2, 1, &[1, 2], None, &mut out);
        c.on_committed(3, 2, 1, T0, &mut out);
        assert_eq!(answers(&mut out).len(), 2);
        let tags: Vec<EntryTag> = c.proposals.marks.tags.iter().copied().collect();
        assert_eq!(
            tags,
            vec![Some((3, 1, false)), Some((3, 1, true))],
            "the entry's last message is its second"
        );
        c.on_propose(request(3, "a", "g1", ""), 3, &g, T0, &mut out);
        c.propose_turn(&mut r, &mut out);
        assert_eq!(delivered(&mut c).len(), 2);
        c.on_propose(request(4, "a", "g1", ""), 3, &g, T0, &mut out);
        c.propose_turn(&mut r, &mut out);
        assert_eq!(r.marks, vec![0, 0, 1], "committed is not delivered");
        let mut marks = Marks::default();
        marks
            .tags
            .extend([Some((3, 4, false)), None, Some((3, 4, true))]);
        marks.delivered(2);
        assert_eq!(marks.of(3), 0, "the entry's last message is not delivered");
        marks.delivered(3);
        assert_eq!(marks.of(3), 4);
    }

    /// At most `redeliver_messages_max` messages are held: past it the group's
    /// own oldest entry leaves, or, when it holds one entry only, the lowest
    /// group's; the drops are counted.
    #[test]
    fn messages_held_for_a_new_leader_are_bounded() {
        let mut l = limits(false);
        l.redeliver_messages_max = 2;
        let (mut c, g, mut out) = (core(l), groups(), Out::new());
        let one = |n: i64| entry(vec![foreign("a", "", n)]);
        c.on_appended(3, 2, 1, &[1], one(1), &mut out);
        c.on_appended(5, 2, 1, &[1], one(2), &mut out);
        c.on_appended(5, 2, 2, &[2], one(3), &mut out);
        c.on_appended(3, 2, 2, &[2], one(4), &mut out);
        for (group, index) in [(3, 1), (5, 1), (5, 2), (3, 2)] {
            c.on_committed(group, 2, index, T0, &mut out);
        }
        assert_eq!(c.take_counts().redeliver_dropped, 2);
        assert_eq!(c.redeliver(3, &g, T0) + c.redeliver(5, &g, T0), 2);
        let ids: Vec<i64> = delivered(&mut c).iter().map(|d| d.0).collect();
        assert_eq!(
            ids,
            vec![4, 3],
            "5 dropped its own oldest (2), 3 then held one entry: the lowest group's went (1)"
        );
    }

    /// A mark that passes entries already held releases them (and their place
    /// under `redeliver_messages_max`): only the entries above the newest mark
    /// are delivered again.
    #[test]
    fn a_later_mark_releases_the_entries_it_passes() {
        let mut l = limits(false);
        l.redeliver_messages_max = 2;
        let (mut c, g, mut out) = (core(l), groups(), Out::new());
        let marked = |mark, n| {
            Some(ForeignEntry {
                mark,
                messages: vec![foreign("a", "", n)],
            })
        };
        for (index, mark) in [(1, 0), (2, 0)] {
            c.on_appended(3, 2, index, &[index], marked(mark, index as i64), &mut out);
            c.on_committed(3, 2, index, T0, &mut out);
        }
        c.on_appended(3, 2, 3, &[3], marked(1, 3), &mut out);
        c.on_committed(3, 2, 3, T0, &mut out);
        assert_eq!(c.take_counts().redeliver_dropped, 0, "entry 1 left for 3");
        assert_eq!(c.redeliver(3, &g, T0), 2);
        let ids: Vec<i64> = delivered(&mut c).iter().map(|d| d.0).collect();
        assert_eq!(ids, vec![2, 3]);
        // Delivered again, they hold no place: two more are held, none dropped.
        for index in 1..=2 {
            c.on_appended(5, 2, index, &[index], marked(0, 9), &mut out);
            c.on_committed(5, 2, index, T0, &mut out);
        }
        assert_eq!(c.take_counts().redeliver_dropped, 0);
    }
}
