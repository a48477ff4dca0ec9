//! The SEND path in the simulated cluster: a client's SEND goes from its gateway to
//! its channel's home (`ClusterView::home_node`, the commit shard `hash_slot %
//! shards`) as the node forwards it, is committed there by the real [`CommitCore`]
//! over a log that survives kill -9 and keeps its synced records through a power
//! loss (`send_sim/log.rs`; the policy "answer after the sync": the interval
//! policy's windows are `send_sim`'s), and is answered with a SENDACK; the core's [`Planner`] looks its
//! recipients up at their authorities (this node's through the real
//! `AuthorityReader` of its published tables, another node's by a lookup request
//! over the link, served by that node's reader) and pushes RECVs to their owners,
//! which revalidate each endpoint against their `Registry` before writing.
//!
//! Invariants:
//! - **no RECV after close**: a RECV is written only to a session active at its
//!   gateway (its client connected to that process, CONNACK 0 given, not closed,
//!   kicked or superseded), never to the session that sent it (checked as written);
//! - **one RECV**: at most one per (message, session) (no resend here: no RECVACK
//!   timer runs);
//! - **push order**: a commit shard's planner hands each session a channel's
//!   messages in seq order (checked as its outputs are carried; the links reorder
//!   on purpose);
//! - **acknowledged in log**: every SENDACK 1 names a record of its home's log, with
//!   its message id and seq, through kill -9 and power losses;
//! - **every online recipient**: in the quiet phase (links up, no move, crash or
//!   pause), every message answered SENDACK 1 reaches every session of its
//!   recipients that was active before it was sent and still is (the sending
//!   session excepted).
//!
//! [`Planner`]: domain::send::delivery::Planner

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::Arc;

use domain::presence::route::{Endpoint, Uid};
use domain::send::channel::{Channel, Subscribers};
use domain::send::commit::{
    CommitCore, CommitLimits, CommitOutput, CommitRequest, Committed, Groups, Now,
};
use domain::send::delivery::{
    session_shard, Lookup, LookupReply, PlanLimits, PlanOutput, PushTo, Sender,
};
use domain::send::idgen::MessageIdGen;
use proto::wkproto::ReasonCode;
use rand::rngs::StdRng;
use rand::Rng;
use slots::{hash_slot, ShardId};

use super::{Addr, Body, Pending, Request, World};
use crate::log::{FakeLog, Store};

/// Groups `g0`.. with members drawn among the uids.
const GROUPS: usize = 3;
/// The wall clock at virtual time 0 (message ids carry it).
const WALL_BASE_MS: u64 = 1_800_000_000_000;
/// How long a commit shard's sync job takes.
const SYNC_MS: std::ops::Range<u64> = 1..6;
/// A shard's pump turns per advance (each plans what is ready; unlimited room).
const PUMP_TURNS_MAX: usize = 8;
const COMMIT_LIMITS: CommitLimits = CommitLimits {
    answer_after_sync: true,
    commits_unsynced_max: 64,
    delivery_backlog_max: 64,
    backlog_budget_bytes: 1 << 20,
    redeliver_messages_max: 64,
};

/// Where a commit's answer goes: the gateway's request.
#[derive(Debug)]
pub(super) struct Answer {
    pub to: Addr,
    pub to_boot: domain::presence::route::BootId,
    pub id: u64,
}

pub(super) type Core = CommitCore<FakeLog, Answer>;

/// A committed message in a push flight (shown by its id).
pub(super) struct Message(pub Arc<Committed>);

impl std::fmt::Debug for Message {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "message {}", self.0.message_id)
    }
}

#[derive(Default)]
pub(super) struct SimGroups(BTreeMap<String, Arc<Subscribers>>);

impl Groups for SimGroups {
    fn subscribers(&self, id: &str) -> Option<Arc<Subscribers>> {
        self.0.get(id).cloned()
    }
}

/// Groups of members drawn among uids `u0..u{uids}` (never empty).
pub(super) fn draw_groups(rng: &mut StdRng, uids: usize) -> SimGroups {
    let mut groups = BTreeMap::new();
    for g in 0..GROUPS {
        let mut members: Vec<Uid> = (0..uids)
            .filter(|_| rng.gen_bool(0.6))
            .map(|u| Uid::from(format!("u{u}")))
            .collect();
        if members.is_empty() {
            members.push(Uid::from(format!("u{}", g % uids)));
        }
        groups.insert(format!("g{g}"), Arc::new(Subscribers::new(members)));
    }
    SimGroups(groups)
}

/// The phases of a run, as SENDs are made in them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Phase {
    /// Faults of every kind.
    #[default]
    Chaos,
    /// No fault, no move: logins, closes and SENDs.
    Quiet,
    /// Planned slot moves only (no cut, crash or pause): SENDs meanwhile.
    Moves,
}

/// A client's SEND and its SENDACK.
struct SendRec {
    client: usize,
    session: domain::presence::route::SessionId,
    sent_ms: u64,
    /// The phase it was sent in.
    phase: Phase,
    /// The channel's commit shard.
    home: Addr,
    recipients: Vec<Uid>,
    /// The SENDACK: reason, message id, seq.
    ack: Option<(ReasonCode, i64, u64)>,
}

/// The SEND path's state in the world.
#[derive(Default)]
pub(super) struct Messaging {
    pub groups: SimGroups,
    /// The uids are `u0..u{uids}`.
    pub uids: usize,
    /// Each commit shard's log: it survives the process.
    stores: BTreeMap<Addr, Rc<RefCell<Store>>>,
    sends: Vec<SendRec>,
    /// RECVs written per (message id, session).
    recvs: BTreeMap<(i64, domain::presence::route::SessionId), u32>,
    /// "Push order": per (commit shard, its process's boot, endpoint, channel),
    /// the seq of the last message that shard's planner handed out for it.
    pushed_seq: BTreeMap<PushKey, u64>,
}

/// A commit shard and its boot, an endpoint (node, boot, session), a channel.
type PushKey = (
    Addr,
    domain::presence::route::BootId,
    (
        domain::cluster::NodeId,
        domain::presence::route::BootId,
        domain::presence::route::SessionId,
    ),
    (u8, String),
);

fn plan_limits(node: domain::cluster::NodeId, me: ShardId, shards: usize) -> PlanLimits {
    PlanLimits {
        local_node: node,
        me,
        shard_count: shards as ShardId,
        subscriber_page_max: 3,
        push_batch_max: 4,
        pages_per_turn_max: 2,
        lookup_pages_in_flight_max: 4,
        reserved_room_per_peer: 0,
        offline_uids: false,
        offline_room: true,
        lookup_retries_max: 2,
        rebuild_retry_interval_ms: 20,
        rebuild_wait_ms_max: 3_000,
    }
}

impl World {
    fn wall(&self) -> Now {
        Now {
            wall_ms: WALL_BASE_MS + self.now_ms,
            mono_ns: self.now_ms * 1_000_000,
        }
    }

    /// A commit core over the shard's log (new, or what a crash left): message ids
    /// resume after the log's newest.
    pub(super) fn new_commit_core(
        &mut self,
        node: domain::cluster::NodeId,
        shard: ShardId,
    ) -> Core {
        let bug = self.bugs.crash_drops_synced;
        let store = (self.msg.stores.entry((node, shard)))
            .or_insert_with(|| {
                Rc::new(RefCell::new(Store {
                    bug_crash_drops_synced: bug,
                    ..Store::default()
                }))
            })
            .clone();
        let mut ids = MessageIdGen::new(node, shard as usize, self.shape.shards).expect("ids");
        if let Some(max) = store.borrow().records.iter().map(|r| r.message_id).max() {
            ids.resume_after(max);
        }
        CommitCore::new(FakeLog(store), ids, None, COMMIT_LIMITS)
    }

    /// A crash of `node`: after kill -9 its logs keep every record written (the
    /// page cache survives), after a power loss only what their syncs covered and
    /// any part of the rest; a sync job in flight dies with the process. Under this
    /// policy (SENDACK after the sync) neither loses an acknowledged message.
    pub(super) fn crash_logs(&mut self, node: domain::cluster::NodeId) {
        let power_loss = self.rng.gen_bool(0.5);
        for (_, store) in self.msg.stores.range((node, 0)..=(node, ShardId::MAX)) {
            let unsynced = store.borrow().unsynced();
            let keep = if power_loss {
                self.rng.gen_range(0..=unsynced)
            } else {
                unsynced
            };
            store.borrow_mut().crash(keep);
        }
    }

    /// An active client sends to one of the groups or to a uid (itself included:
    /// a note to self reaches its other devices).
    pub(super) fn send(&mut self, client: usize) {
        let Some(k) = self.clients[client].conn.filter(|k| k.active) else {
            return;
        };
        if !self.usable(k.node) {
            return;
        }
        let uid = self.clients[client].uid.clone();
        let (channel, recipients) = if self.rng.gen_bool(0.5) {
            let id = format!("g{}", self.rng.gen_range(0..GROUPS));
            let members = self.msg.groups.0[&id].uids().to_vec();
            (Channel::Group { id }, members)
        } else {
            let peer = format!("u{}", self.rng.gen_range(0..self.msg.uids));
            let channel = Channel::resolve(&uid, &peer, 1).expect("a person channel");
            let mut recipients = vec![Uid::from(peer.as_str()), Uid::from(uid.as_str())];
            recipients.dedup();
            (channel, recipients)
        };
        let h = hash_slot(channel.key().as_bytes());
        let home = (self.node(k.node).view.home_node(h), self.slot_shard(h));
        let send = self.msg.sends.len();
        self.msg.sends.push(SendRec {
            client,
            session: k.session_id,
            sent_ms: self.now_ms,
            phase: self.phase,
            home,
            recipients,
            ack: None,
        });
        self.stats.sends += 1;
        let request = CommitRequest {
            answer_to: (),
            sender: Some(Sender {
                node_id: k.node,
                boot_id: k.boot,
                session_id: k.session_id,
            }),
            from_uid: uid.as_str().into(),
            channel,
            client_msg_no: String::new(),
            setting: 0,
            flags: 0,
            expire_s: 0,
            topic: String::new(),
            // The SEND's index: the owner finds the sending session by it.
            payload: (send as u64).to_le_bytes().to_vec(),
        };
        let at = (k.node, k.shard);
        let pending = Pending::Send { send };
        self.request(at, home, Request::Send(Box::new(request)), pending);
    }

    /// The home's commit shard takes a SEND.
    pub(super) fn commit_at(&mut self, at: Addr, request: CommitRequest<()>, answer: Answer) {
        let now = self.wall();
        let shard = &mut self.nodes[at.0 as usize - 1].shards[at.1 as usize];
        let mut out = Vec::new();
        (shard.commit).on_commit(request.answered_to(answer), &self.msg.groups, now, &mut out);
        shard.commit.end_turn(&mut out);
        self.carry_commit(at, out);
    }

    /// A commit shard's sync job ended.
    pub(super) fn sync_done(&mut self, at: Addr) {
        let now = self.wall();
        let mut out = Vec::new();
        (self.shard_mut(at).commit).on_sync_done(Ok(()), now, &mut out);
        self.carry_commit(at, out);
    }

    fn carry_commit(&mut self, at: Addr, out: Vec<CommitOutput<Answer, usize>>) {
        for o in out {
            match o {
                CommitOutput::Answer {
                    to,
                    message_id,
                    message_seq,
                    reason,
                    ..
                } => {
                    let reply = super::Reply::Send {
                        message_id,
                        message_seq,
                        reason,
                    };
                    self.reply(at.0, to.to, to.to_boot, to.id, reply);
                }
                CommitOutput::SubmitSync(_job) => {
                    let delay = self.rng.gen_range(SYNC_MS);
                    self.carry(at.0, at.0, delay, Body::SyncDone { shard: at.1 });
                }
                CommitOutput::LogFailed { what, fault } => {
                    (self.violations).push(format!("the log failed: {what}: {}", fault.message));
                }
            }
        }
    }

    /// A SENDACK reached the gateway (or the request got none: `on_no_answer`).
    pub(super) fn on_sendack(&mut self, send: usize, reason: ReasonCode, id: i64, seq: u64) {
        let rec = &mut self.msg.sends[send];
        if rec.ack.is_some() {
            let v = format!("one SENDACK: SEND {send} answered twice");
            return self.violations.push(v);
        }
        rec.ack = Some((reason, id, seq));
        if reason == ReasonCode::SUCCESS {
            self.stats.sendacks_ok += 1;
        }
    }

    /// Every running commit shard plans what it can: pushes and lookups.
    pub(super) fn pump_commits(&mut self) {
        for n in 0..self.nodes.len() {
            let id = self.nodes[n].id;
            if !self.usable(id) {
                continue;
            }
            for s in 0..self.shape.shards {
                for _ in 0..PUMP_TURNS_MAX {
                    if !self.pump_once((id, s as ShardId)) {
                        break;
                    }
                }
            }
        }
    }

    /// One pump of one commit shard; whether it planned anything.
    fn pump_once(&mut self, at: Addr) -> bool {
        let limits = plan_limits(at.0, at.1, self.shape.shards);
        let now_ms = self.now_ms;
        let shard = &mut self.nodes[at.0 as usize - 1].shards[at.1 as usize];
        if shard.commit.backlog_len() == 0 {
            return false;
        }
        let mut reader = shard.auth.reader();
        let mut out = Vec::new();
        let mut room = |_: PushTo| usize::MAX;
        (shard.commit).pump(
            now_ms,
            &shard.view,
            &mut reader,
            &mut room,
            &limits,
            &mut out,
        );
        let planned = !out.is_empty();
        if self.bugs.reversed_plan_outputs {
            out.reverse();
        }
        for o in out {
            match o {
                PlanOutput::Push(push) => match push.to {
                    _ if !self.check_push_order(at, &push.message, &push.endpoints) => {}
                    PushTo::Shard(s) if s == at.1 => {
                        self.owner_push(at.0, &push.message, &push.endpoints);
                    }
                    PushTo::Shard(_) => self.carry_push(at.0, at.0, push.message, push.endpoints),
                    PushTo::Node(n) => {
                        self.stats.remote_pushes += 1;
                        if self.bugs.drop_remote_pushes {
                            continue;
                        }
                        if self.bugs.duplicate_pushes {
                            let (m, e) = (push.message.clone(), push.endpoints.clone());
                            self.carry_push(at.0, n, m, e);
                        }
                        self.carry_push(at.0, n, push.message, push.endpoints);
                    }
                },
                PlanOutput::Lookup(lookup) => {
                    self.stats.lookups += 1;
                    let to = (lookup.node, 0);
                    let pending = Pending::Lookup {
                        lookup_id: lookup.lookup_id,
                    };
                    self.request(at, to, Request::Lookup(lookup), pending);
                }
                PlanOutput::Offline(_) => unreachable!("offline uids not asked for"),
            }
        }
        planned
    }

    /// **Push order**: a commit shard's planner hands each session a channel's
    /// messages in seq order (its new ones: NoPersist messages have no seq).
    /// Checked where the pushes leave the planner: rings keep their order, the
    /// simulated links reorder on purpose, so a session's RECVs of one channel
    /// arrive in that order whenever its links do. Records a violation and returns
    /// false on the first push out of order.
    fn check_push_order(
        &mut self,
        at: Addr,
        message: &Arc<Committed>,
        endpoints: &[Endpoint],
    ) -> bool {
        let boot = self.node(at.0).boot;
        let seq = message.message_seq;
        if seq == 0 {
            return true;
        }
        let channel = (message.channel_type, message.channel_key.clone());
        for ep in endpoints {
            let session = (ep.node_id, ep.boot_id, ep.session_id);
            let key = (at, boot, session, channel.clone());
            if let Some(last) = self.msg.pushed_seq.insert(key, seq).filter(|&l| l >= seq) {
                self.violations.push(format!(
                    "push order: {at:?} pushed seq {seq} of {channel:?} to session {session:?} \
                     after seq {last}"
                ));
                return false;
            }
        }
        self.stats.ordered_pushes += endpoints.len() as u64;
        true
    }

    /// A push batch over the ring (same node) or the link; a link that is cut or a
    /// restarted receiver loses it (the node counts such drops; recipients catch
    /// up by messagesync).
    fn carry_push(
        &mut self,
        from: domain::cluster::NodeId,
        to: domain::cluster::NodeId,
        message: Arc<Committed>,
        endpoints: Vec<Endpoint>,
    ) {
        let delay = self.delay(from, to);
        let body = Body::Push {
            message: Message(message),
            endpoints,
        };
        self.carry(from, to, delay, body);
    }

    /// Another node's lookup, answered from this node's published tables.
    pub(super) fn serve_lookup(&mut self, at: Addr, lookup: &Lookup) -> LookupReply {
        let reader = self.shard_mut(at).auth.reader();
        let groups: Vec<_> = lookup.groups().collect();
        let (mut endpoints, mut results) = (Vec::new(), Vec::new());
        reader.endpoints_by_targets_into(&groups, &mut endpoints, &mut results);
        for ((t, uids), r) in groups.iter().zip(&results) {
            for u in uids.iter() {
                self.trace(u, || {
                    format!("lookup {} at {at:?} of {t:?}: {r:?}", lookup.lookup_id)
                });
            }
        }
        LookupReply::Found { endpoints, results }
    }

    /// The owner side of a push: each endpoint revalidated against its shard's
    /// registry (this process, the session active at the route's owner_seq), then
    /// its RECV written.
    pub(super) fn owner_push(
        &mut self,
        node: domain::cluster::NodeId,
        message: &Arc<Committed>,
        endpoints: &[Endpoint],
    ) {
        for ep in endpoints {
            let s = session_shard(ep.session_id) as usize;
            if s >= self.shape.shards || ep.node_id != node {
                self.stats.stale_pushes += 1;
                continue;
            }
            let reg = &self.nodes[node as usize - 1].shards[s].reg;
            let live = self.bugs.skip_revalidation
                || (reg.revalidate(&ep.uid, ep.boot_id, ep.session_id, ep.owner_seq)).is_some();
            if !live {
                self.stats.stale_pushes += 1;
                continue;
            }
            self.write_recv(node, s as ShardId, ep, message);
        }
    }

    /// A RECV written to a session's connection: checks "no RECV after close" and
    /// "one RECV".
    fn write_recv(
        &mut self,
        node: domain::cluster::NodeId,
        shard: ShardId,
        ep: &Endpoint,
        message: &Arc<Committed>,
    ) {
        let id = message.message_id;
        let n = self.node(node);
        let client = n.shards[shard as usize].conns.get(&ep.session_id).copied();
        let active = client.and_then(|c| self.clients[c].conn).is_some_and(|k| {
            k.session_id == ep.session_id && k.node == node && k.boot == n.boot && k.active
        });
        if !active {
            self.violations.push(format!(
                "no RECV after close: message {id} written to session {} on node {node}, \
                 not active at its gateway (client {client:?})",
                ep.session_id
            ));
        }
        let send = u64::from_le_bytes(message.payload[..8].try_into().expect("8 bytes"));
        if self.msg.sends[send as usize].session == ep.session_id {
            self.violations.push(format!(
                "no RECV after close: message {id} written to its own sending session {}",
                ep.session_id
            ));
        }
        let count = self.msg.recvs.entry((id, ep.session_id)).or_insert(0);
        *count += 1;
        if *count > 1 {
            self.violations.push(format!(
                "one RECV: message {id} written {count} times to session {}",
                ep.session_id
            ));
        }
        self.stats.recvs += 1;
    }

    /// **Acknowledged in log**: every SENDACK 1 names a record of its home's log.
    pub fn check_acknowledged_in_log(&self) -> Result<(), String> {
        for (i, r) in self.msg.sends.iter().enumerate() {
            let Some((ReasonCode::SUCCESS, id, seq)) = r.ack else {
                continue;
            };
            let store = self.msg.stores[&r.home].borrow();
            let found = store.by_id(id).map(|(_, rec)| rec.seq);
            if found != Some(seq) {
                return Err(format!(
                    "acknowledged in log: SEND {i} got SENDACK 1 with message {id} seq {seq}, \
                     its home {:?} has {found:?}",
                    r.home
                ));
            }
        }
        Ok(())
    }

    /// **Every online recipient**: each message of `phase` answered SENDACK 1
    /// reached every session of its recipients active since before it was sent
    /// (and still active). The failure names the phase: "every online recipient
    /// (Quiet)".
    pub fn check_every_online_recipient(&self, phase: Phase) -> Result<(), String> {
        for (i, r) in self.msg.sends.iter().enumerate() {
            let Some((ReasonCode::SUCCESS, id, _)) = r.ack.filter(|_| r.phase == phase) else {
                continue;
            };
            for (c, client) in self.clients.iter().enumerate() {
                let Some(k) = client.conn.filter(|k| k.active) else {
                    continue;
                };
                let recipient = r.recipients.iter().any(|u| **u == *client.uid);
                if !recipient || k.session_id == r.session || k.active_since_ms > r.sent_ms {
                    continue;
                }
                if !self.msg.recvs.contains_key(&(id, k.session_id)) {
                    return Err(format!(
                        "every online recipient ({phase:?}): message {id} (SEND {i} of client {} to {:?}) \
                         never reached client {c} (uid {}, session {} on node {}, active \
                         since {} ms, sent at {} ms)",
                        r.client,
                        r.recipients,
                        client.uid,
                        k.session_id,
                        k.node,
                        k.active_since_ms,
                        r.sent_ms
                    ));
                }
            }
        }
        Ok(())
    }
}
