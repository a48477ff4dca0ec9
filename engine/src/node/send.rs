//! One SEND, from the gateway to every RECV, in flow order (architecture.md, flow 5):
//!
//! 1. [`on_send`] (gateway shard): resolve the channel, verify msg_key and decrypt,
//!    hand a [`CommitRequest`] to the channel's delivery shard over the ring.
//! 2. [`on_commit`] (delivery shard): may the sender send? idempotent resend?
//!    append to the shard's log (message_id, message_seq).
//! 3. [`flush_commits`] (delivery shard, once per loop turn): one sync for all
//!    appends of the turn (group commit), then SENDACK to each gateway and delivery:
//!    subscriber pages grouped by target, one lookup per page, push batches by owner.
//! 4. [`on_push`] (owner shard): revalidate each endpoint, encrypt for its session,
//!    write RECV, keep pending-ACK state.
//! 5. [`on_recvack`] / [`on_ack_timeout`] (owner shard): clear the ACK, or re-send
//!    with DUP a bounded number of times, then drop it (the client recovers by sync).

use std::sync::mpsc::SyncSender;
use std::sync::Arc;

use net::io::{ConnId, NetDriver};
use net::wkproto::{
    ChannelType, Flags, ReasonCode, RecvPacket, SendPacket, SendackPacket, Setting,
};
use shard::runtime::Context;

use crate::channel::{recv_channel_id, Channel};
use crate::delivery::{group_by_target, plan_pushes, PushTo, Sender, TargetGroups};
use crate::route::{Endpoint, SessionId, Uid};
use crate::store::{
    IdempotencyWindow, MessageIdGen, MessageLog, NewMessage, PullMode, SentIds, StoredMessage,
};
pub use domain::commit::Committed;

use super::msg::{Msg, SendAck};
use super::shard::{ConnState, NodeShard, NodeTimer};
use super::syncer::LogSyncer;

/// Who asked for a commit, and where its answer goes.
pub enum Origin {
    /// A client's SEND: SENDACK to this connection of this gateway shard.
    Client {
        shard: shard::slots::ShardId,
        conn: ConnId,
        session_id: SessionId,
        client_seq: u32,
        sender: Sender,
    },
    /// `POST /message/send`: the answer goes back to the HTTP thread.
    Api { reply: SyncSender<ApiSendResult> },
}

/// The answer to an API send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ApiSendResult {
    pub message_id: i64,
    pub message_seq: u64,
    pub reason: ReasonCode,
}

/// A message to commit on its channel's delivery shard.
pub struct CommitRequest {
    pub origin: Origin,
    pub from_uid: Uid,
    pub channel: Channel,
    pub client_msg_no: String,
    /// RECV setting byte (NoEncrypt kept: such a message is delivered as it came).
    pub setting: u8,
    /// SEND header flags (NoPersist, SyncOnce, RedDot).
    pub flags: u8,
    pub expire_s: u32,
    pub topic: String,
    /// The plaintext payload.
    pub payload: Vec<u8>,
    /// When the gateway decoded the SEND ([`crate::node::NodeShared::mono_ns`]).
    pub decoded_ns: u64,
}

/// A `/channel/messagesync` read, served by the channel's delivery shard.
pub struct MessageSyncRequest {
    pub channel_type: u8,
    /// The stored channel key.
    pub channel_key: String,
    pub start_seq: u64,
    pub end_seq: u64,
    pub limit: usize,
    pub pull_mode: PullMode,
    /// At most this many bytes copied (`MessageView::copy_bytes`); `more` says the rest.
    pub max_bytes: usize,
    pub reply: SyncSender<Result<(Vec<StoredMessage>, bool), String>>,
}

/// An answer that waits for the turn's sync: a commit appended this turn, or a
/// duplicate of one (whose first copy may be in the same unsynced batch).
struct Unsynced {
    origin: Origin,
    message_id: i64,
    message_seq: u64,
    /// `None` for an idempotent duplicate.
    delivery: Option<Delivery>,
}

/// What a new commit delivers after the sync: the message, who sent it (for
/// suppression) and the group's subscribers at commit time.
struct Delivery {
    message: Arc<Committed>,
    sender: Option<Sender>,
    subscribers: Option<Arc<crate::node::catalog::Subscribers>>,
    /// What it is charged against `backlog_budget_bytes` until delivered.
    charge_bytes: usize,
}

/// What a committed message is charged against `[delivery] backlog_budget_bytes`
/// while it waits for its answer and delivery: its payload and strings, plus a fixed
/// part for the message and its bookkeeping.
fn delivery_charge_bytes(r: &CommitRequest) -> usize {
    1024 + r.payload.len() + r.topic.len() + r.client_msg_no.len() + r.from_uid.len()
}

/// The delivery core of one shard: its log and what it committed this turn.
pub struct DeliveryCore {
    pub log: MessageLog,
    pub ids: MessageIdGen,
    pub idempotency: Option<IdempotencyWindow>,
    /// Runs the log's syncs off this thread.
    syncer: LogSyncer,
    /// Appended and not yet part of a sync job (answered at the end of the turn under
    /// the interval policy; under `always`, by the next job).
    unsynced: Vec<Unsynced>,
    /// Under `always`: the commits the job in flight makes durable.
    awaiting_sync: Vec<Unsynced>,
    /// Delivery planning buffers, reused from page to page.
    scratch: PlanScratch,
    /// Answered messages whose delivery is not fully planned yet, oldest first
    /// (bounded by `delivery_backlog_max`, with the unanswered commits).
    backlog: std::collections::VecDeque<Backlogged>,
    /// Push batches of the backlog's front message that a peer had no room for;
    /// sent before any further page is planned.
    stalled: Vec<(shard::slots::ShardId, Vec<Endpoint>, u64)>,
    /// What the messages committed and not yet delivered are charged (bounded by
    /// `backlog_budget_bytes`).
    backlog_bytes: usize,
}

/// A message in the delivery backlog and how far its delivery got.
struct Backlogged {
    delivery: Delivery,
    /// The next subscriber page to plan.
    next_page: usize,
}

/// Buffers of one page's delivery planning (reused: no allocation per recipient).
#[derive(Default)]
struct PlanScratch {
    groups: TargetGroups,
    endpoints: Vec<Endpoint>,
    results: Vec<Result<std::ops::Range<usize>, crate::route::AuthorityError>>,
    local: Vec<Vec<Endpoint>>,
}

impl DeliveryCore {
    pub fn new(
        log: MessageLog,
        ids: MessageIdGen,
        idempotency: Option<IdempotencyWindow>,
        syncer: LogSyncer,
    ) -> Self {
        DeliveryCore {
            log,
            ids,
            idempotency,
            syncer,
            unsynced: Vec::new(),
            awaiting_sync: Vec::new(),
            scratch: PlanScratch::default(),
            backlog: std::collections::VecDeque::new(),
            stalled: Vec::new(),
            backlog_bytes: 0,
        }
    }

    /// Messages committed on this shard and not yet fully delivered or answered
    /// (bounded by `delivery_backlog_max`).
    fn backlog_len(&self) -> usize {
        self.backlog.len() + self.unanswered()
    }

    /// Commits appended and not yet answered (bounded by `commits_unsynced_max`).
    fn unanswered(&self) -> usize {
        self.unsynced.len() + self.awaiting_sync.len()
    }
}

/// The unacknowledged RECVs of one session (`node/acks.rs`).
pub type PendingAcks = domain::acks::PendingAcks<Arc<Committed>>;

/// The pending-ACK limits of `[session]`.
fn ack_limits(s: &super::SessionConfig) -> domain::acks::AckLimits {
    domain::acks::AckLimits {
        per_session_max: s.pending_acks_per_session_max,
        shard_budget_bytes: s.pending_acks_budget_bytes_per_shard,
        timeout_ms: s.ack_timeout_ms,
        resends_max: s.ack_resends_max,
    }
}

// ------------------------------------------------------------------ 1. gateway

/// A SEND from an active connection.
pub fn on_send(
    node: &mut NodeShard,
    cx: &mut Context<Msg, NodeTimer>,
    driver: &mut NetDriver,
    id: ConnId,
    p: &SendPacket<'_>,
) {
    let decoded_ns = node.shared.mono_ns();
    let Some(conn) = node.conn(id) else { return };
    let (uid, session_id) = (conn.uid.clone(), conn.session_id);
    let sendack = |node: &mut NodeShard, driver: &mut NetDriver, reason: ReasonCode| {
        let ack = SendackPacket {
            client_seq: p.client_seq,
            reason_code: reason,
            ..Default::default()
        };
        node.write_frame(driver, id, |v, out| ack.encode(v, out));
    };
    let channel = match Channel::resolve(&uid, p.channel_id, p.channel_type.0) {
        Ok(c) => c,
        Err(e) => return sendack(node, driver, e.reason_code()),
    };
    // How fast this connection starts new channels (node/new_channels.rs).
    let limits = node.shared.config.session.new_channel_limits();
    let hash = domain::new_channels::channel_hash(channel.channel_type(), channel.key());
    let now_ms = decoded_ns / 1_000_000;
    if !node
        .conn_mut(id)
        .is_some_and(|c| c.new_channels.admit(limits, hash, now_ms))
    {
        node.metrics.sends_rate_limited.inc();
        return sendack(node, driver, ReasonCode::RATE_LIMIT);
    }
    let Some(conn) = node.conn(id) else { return };
    let payload = if p.setting.contains(Setting::NO_ENCRYPT) {
        p.payload.to_vec()
    } else {
        let Some(cipher) = conn.cipher.as_ref() else {
            return sendack(node, driver, ReasonCode::SYSTEM_ERROR);
        };
        if !cipher.send_msg_key_ok(p) {
            node.metrics.send_refused.inc();
            return sendack(node, driver, ReasonCode::MSG_KEY_ERROR);
        }
        let mut plain = Vec::with_capacity(p.payload.len());
        if cipher.open_send(p, &mut plain).is_err() {
            node.metrics.send_refused.inc();
            return sendack(node, driver, ReasonCode::PAYLOAD_DECODE_ERROR);
        }
        plain
    };
    let to = node.shared.slot_map.shard_of_key(channel.key().as_bytes());
    // Credits: a connection's SENDs in flight, and this shard's towards `to` (each
    // reserves room for its SENDACK on the way back). Out of credit: retry later.
    let per_conn_max = node.shared.config.session.sends_in_flight_per_conn_max;
    let per_peer_max = node.shared.config.delivery.commit_credits_per_peer;
    let out_of_credit = conn.sends_in_flight >= per_conn_max
        || (to != node.me && node.commit_credits[to as usize] >= per_peer_max);
    if out_of_credit {
        node.metrics.sends_refused_credit.inc();
        return sendack(node, driver, ReasonCode::RATE_LIMIT);
    }
    if let Some(conn) = node.conn_mut(id) {
        conn.sends_in_flight += 1;
    }
    if to != node.me {
        node.commit_credits[to as usize] += 1;
    }
    node.metrics.sends.inc();
    let request = CommitRequest {
        origin: Origin::Client {
            shard: node.me,
            conn: id,
            session_id,
            client_seq: p.client_seq,
            sender: Sender {
                node_id: node.shared.config.node_id,
                boot_id: node.shared.boot_id,
                session_id,
            },
        },
        from_uid: uid,
        client_msg_no: p.client_msg_no.to_owned(),
        setting: p.setting.0,
        flags: p.flags.0 & (Flags::NO_PERSIST.0 | Flags::SYNC_ONCE.0 | Flags::RED_DOT.0),
        expire_s: p.expire_s,
        topic: p.topic.to_owned(),
        payload,
        channel,
        decoded_ns,
    };
    if to == node.me {
        on_commit(node, cx, driver, request);
    } else {
        node.send_msg(cx, to, Msg::Commit(Box::new(request)));
    }
}

// -------------------------------------------------------------- 2. delivery core

/// Commits one message on this (its channel's delivery) shard.
pub fn on_commit(
    node: &mut NodeShard,
    cx: &mut Context<Msg, NodeTimer>,
    driver: &mut NetDriver,
    r: CommitRequest,
) {
    let subscribers = match &r.channel {
        Channel::Group { id } => match node.shared.catalog.subscribers(id) {
            None => {
                return answer(
                    node,
                    cx,
                    driver,
                    r.origin,
                    0,
                    0,
                    ReasonCode::CHANNEL_NOT_EXIST,
                )
            }
            Some(s) if matches!(r.origin, Origin::Client { .. }) && !s.contains(&r.from_uid) => {
                return answer(
                    node,
                    cx,
                    driver,
                    r.origin,
                    0,
                    0,
                    ReasonCode::SUBSCRIBER_NOT_EXIST,
                );
            }
            Some(s) => Some(s),
        },
        Channel::Person { .. } => None,
    };
    if node.delivery.unanswered() >= node.shared.config.delivery.commits_unsynced_max {
        // The disk is behind: refuse (the client retries) rather than queue without
        // bound.
        return answer(node, cx, driver, r.origin, 0, 0, ReasonCode::SYSTEM_ERROR);
    }
    let charge_bytes = delivery_charge_bytes(&r);
    let cfg = &node.shared.config.delivery;
    if node.delivery.backlog_len() >= cfg.delivery_backlog_max
        || node.delivery.backlog_bytes + charge_bytes > cfg.backlog_budget_bytes
    {
        // Deliveries are behind (a slow owner shard): refuse until they catch up.
        node.metrics.commits_refused_backlog.inc();
        return answer(node, cx, driver, r.origin, 0, 0, ReasonCode::RATE_LIMIT);
    }
    let now_ms = node.shared.wall_ms();
    let now_s = now_ms / 1000;
    // Flow 7: a resend of a SEND we already acknowledged gets the first answer.
    if !r.client_msg_no.is_empty() {
        if let Some(first) = node
            .delivery
            .idempotency
            .as_mut()
            .and_then(|w| w.get(&r.from_uid, &r.client_msg_no, now_s))
        {
            node.metrics.sends_deduplicated.inc();
            // Answered after this turn's sync: the first copy may not be durable yet.
            node.delivery.unsynced.push(Unsynced {
                origin: r.origin,
                message_id: first.message_id,
                message_seq: first.message_seq,
                delivery: None,
            });
            return;
        }
    }
    let Some(message_id) = node.delivery.ids.next_id(now_ms) else {
        return answer(node, cx, driver, r.origin, 0, 0, ReasonCode::SYSTEM_ERROR);
    };
    let no_persist = r.flags & Flags::NO_PERSIST.0 != 0;
    let message_seq = if no_persist {
        0
    } else {
        let appended = node.delivery.log.append(&NewMessage {
            message_id,
            channel_type: r.channel.channel_type(),
            channel_id: r.channel.key(),
            from_uid: &r.from_uid,
            client_msg_no: &r.client_msg_no,
            setting: r.setting,
            msg_flags: r.flags,
            timestamp_s: now_s as u32,
            payload: &r.payload,
        });
        match appended {
            Ok(a) => a.message_seq,
            Err(err) => {
                log_failed(node, &err);
                tracing::warn!(%err, channel = r.channel.key(), "append failed");
                return answer(node, cx, driver, r.origin, 0, 0, ReasonCode::SYSTEM_ERROR);
            }
        }
    };
    if !r.client_msg_no.is_empty() {
        if let Some(w) = node.delivery.idempotency.as_mut() {
            w.insert(
                &r.from_uid,
                &r.client_msg_no,
                SentIds {
                    message_id,
                    message_seq,
                },
                now_s,
            );
        }
    }
    let sender = match &r.origin {
        Origin::Client { sender, .. } => Some(*sender),
        Origin::Api { .. } => None,
    };
    let committed_ns = node.shared.mono_ns();
    node.stages
        .gateway_to_commit
        .observe_ns(committed_ns.saturating_sub(r.decoded_ns));
    let committed = Arc::new(Committed {
        committed_ns,
        message_id,
        message_seq,
        timestamp_s: now_s as u32,
        from_uid: r.from_uid,
        channel_key: r.channel.key().to_owned(),
        channel_type: r.channel.channel_type(),
        client_msg_no: r.client_msg_no,
        setting: r.setting,
        flags: r.flags,
        expire_s: r.expire_s,
        topic: r.topic,
        payload: r.payload,
    });
    node.delivery.unsynced.push(Unsynced {
        origin: r.origin,
        message_id,
        message_seq,
        delivery: Some(Delivery {
            message: committed,
            sender,
            subscribers,
            charge_bytes,
        }),
    });
    node.delivery.backlog_bytes += charge_bytes;
}

/// Sends the commit's answer: SENDACK to the gateway, or the API reply.
fn answer(
    node: &mut NodeShard,
    cx: &mut Context<Msg, NodeTimer>,
    driver: &mut NetDriver,
    origin: Origin,
    message_id: i64,
    message_seq: u64,
    reason: ReasonCode,
) {
    match origin {
        Origin::Client {
            shard,
            conn,
            session_id,
            client_seq,
            ..
        } => {
            let ack = SendAck {
                conn,
                session_id,
                client_seq,
                message_id,
                message_seq,
                reason,
            };
            if shard == node.me {
                on_sendack(node, driver, ack);
            } else {
                node.send_msg(cx, shard, Msg::SendAck(ack));
            }
        }
        Origin::Api { reply } => {
            let _ = reply.try_send(ApiSendResult {
                message_id,
                message_seq,
                reason,
            });
        }
    }
}

/// Step 3, group commit, once per loop turn: under the interval policy the turn's
/// commits are answered and delivered now (their sync runs on the `LogSync` timer);
/// under `always` they become the next sync job, handed to the syncer thread as soon
/// as none is in flight, and are answered and delivered when it ends.
/// Returns how many commits it completed (work for the shard loop).
pub fn flush_commits(
    node: &mut NodeShard,
    cx: &mut Context<Msg, NodeTimer>,
    driver: &mut NetDriver,
) -> usize {
    let mut work = 0;
    if let Some(result) = node.delivery.syncer.poll_done() {
        work += 1 + node.delivery.awaiting_sync.len();
        let durable = end_sync(node, result);
        let batch = std::mem::take(&mut node.delivery.awaiting_sync);
        release(node, cx, driver, batch, durable);
    }
    if node.delivery.unsynced.is_empty() {
        return work;
    }
    let always = matches!(
        node.delivery.log.config().fsync,
        crate::store::FsyncPolicy::Always
    );
    if always && node.delivery.syncer.busy() {
        // The next job starts when this one ends and covers these too.
        return work;
    }
    let batch = std::mem::take(&mut node.delivery.unsynced);
    work += batch.len();
    if !always {
        release(node, cx, driver, batch, true);
        return work;
    }
    match node.delivery.log.begin_sync() {
        // Nothing appended (NoPersist, duplicates): every earlier job has ended.
        Ok(None) => release(node, cx, driver, batch, true),
        Ok(Some(job)) => match node.delivery.syncer.submit(job) {
            None => node.delivery.awaiting_sync = batch,
            Some(ran_here) => {
                let durable = end_sync(node, ran_here);
                release(node, cx, driver, batch, durable);
            }
        },
        Err(err) => {
            log_failed(node, &err);
            tracing::error!(%err, "log sync failed: refusing the batch");
            release(node, cx, driver, batch, false);
        }
    }
    work
}

/// Accepts a sync job's result; false (and an error log) if the appends are not
/// durable.
fn end_sync(node: &mut NodeShard, result: std::io::Result<()>) -> bool {
    let now_ms = node.shared.wall_ms();
    let inline = node.delivery.log.stats().segments_created_inline;
    let m = &node.metrics.log_segments_created_inline;
    m.add(inline.saturating_sub(m.get()));
    match node.delivery.log.end_sync(result, now_ms) {
        Ok(()) => true,
        Err(err) => {
            log_failed(node, &err);
            tracing::error!(%err, shard = node.me, "log sync failed: refusing the batch");
            false
        }
    }
}

/// A disk I/O error (or a log poisoned by one) marks the shard failed: its gauge
/// `log_write_failed` turns `/readyz` to 503 (`NodeShared::not_ready`).
fn log_failed(node: &NodeShard, err: &crate::store::LogError) {
    use crate::store::LogError;
    if matches!(err, LogError::Io { .. } | LogError::Poisoned)
        && node.metrics.log_write_failed.get() == 0
    {
        node.metrics.log_write_failed.inc();
    }
}

/// Answers a batch of commits: SENDACK success and delivery if `durable`, else a
/// refusal (nothing acknowledged is lost).
fn release(
    node: &mut NodeShard,
    cx: &mut Context<Msg, NodeTimer>,
    driver: &mut NetDriver,
    batch: Vec<Unsynced>,
    durable: bool,
) {
    if !durable {
        for u in batch {
            if let Some(d) = &u.delivery {
                node.delivery.backlog_bytes -= d.charge_bytes;
            }
            answer(node, cx, driver, u.origin, 0, 0, ReasonCode::SYSTEM_ERROR);
        }
        return;
    }
    let durable_ns = node.shared.mono_ns();
    for u in batch {
        if let Some(d) = &u.delivery {
            node.stages
                .commit_to_durable
                .observe_ns(durable_ns.saturating_sub(d.message.committed_ns));
        }
        answer(
            node,
            cx,
            driver,
            u.origin,
            u.message_id,
            u.message_seq,
            ReasonCode::SUCCESS,
        );
        if let Some(delivery) = u.delivery {
            node.delivery.backlog.push_back(Backlogged {
                delivery,
                next_page: 0,
            });
        }
    }
    pump_deliveries(node, cx, driver);
}

/// A graceful stop: everything appended is made durable here and now (the job in
/// flight included), then answered and delivered.
pub fn flush_commits_for_stop(
    node: &mut NodeShard,
    cx: &mut Context<Msg, NodeTimer>,
    driver: &mut NetDriver,
) {
    let durable = match node.delivery.log.sync(node.shared.wall_ms()) {
        Ok(()) => true,
        Err(err) => {
            log_failed(node, &err);
            tracing::error!(%err, shard = node.me, "final log sync failed");
            false
        }
    };
    let mut batch = std::mem::take(&mut node.delivery.awaiting_sync);
    batch.append(&mut node.delivery.unsynced);
    release(node, cx, driver, batch, durable);
}

/// Delivers from the backlog, oldest message first, page by page: at most
/// `pages_per_turn_max` pages per call, and none while a batch waits for a full peer
/// (delivery pauses; the peer drains its ring meanwhile). Returns the work done (1 at
/// least while anything waits, so the shard keeps turning until it is delivered).
pub fn pump_deliveries(
    node: &mut NodeShard,
    cx: &mut Context<Msg, NodeTimer>,
    driver: &mut NetDriver,
) -> usize {
    if node.delivery.backlog.is_empty() {
        return 0;
    }
    let cfg = &node.shared.config.delivery;
    let (reserve, page_max, pages_max) = (
        cfg.reserved_room_per_peer(),
        cfg.subscriber_page_max,
        cfg.pages_per_turn_max,
    );
    let mut work = 0;
    if !node.delivery.stalled.is_empty() {
        let Some(front) = node.delivery.backlog.front() else {
            unreachable!("stalled batches belong to the backlog's front message");
        };
        let message = front.delivery.message.clone();
        let mut stalled = std::mem::take(&mut node.delivery.stalled);
        stalled.retain_mut(|(to, endpoints, planned_ns)| {
            if cx.send_capacity(*to) <= reserve {
                return true;
            }
            let endpoints = std::mem::take(endpoints);
            node.send_msg(
                cx,
                *to,
                Msg::Push {
                    message: message.clone(),
                    endpoints,
                    planned_ns: *planned_ns,
                },
            );
            cx.flush_to(*to);
            work += 1;
            false
        });
        node.delivery.stalled = stalled;
        if !node.delivery.stalled.is_empty() {
            return work.max(1);
        }
    }
    let mut pages = 0;
    while pages < pages_max && node.delivery.stalled.is_empty() {
        let Some(front) = node.delivery.backlog.front_mut() else {
            break;
        };
        let start = front.next_page * page_max;
        let d = &front.delivery;
        let (message, sender, subscribers) = (d.message.clone(), d.sender, d.subscribers.clone());
        let person;
        let recipients: &[Uid] = match &subscribers {
            Some(s) => &s.uids,
            None => {
                person = person_recipients(&message);
                &person
            }
        };
        if start >= recipients.len() {
            // Its last page's batches were stalled; they have gone since.
            finish_front(&mut node.delivery);
            continue;
        }
        front.next_page += 1;
        let end = recipients.len().min(start + page_max);
        deliver_page(
            node,
            cx,
            driver,
            &message,
            sender,
            &recipients[start..end],
            reserve,
        );
        pages += 1;
        work += 1;
        // Done with its last page: leave the backlog now (not on another pass), unless
        // batches of it wait for room (they belong to the front message).
        if end == recipients.len() && node.delivery.stalled.is_empty() {
            finish_front(&mut node.delivery);
        }
    }
    work + usize::from(!node.delivery.backlog.is_empty())
}

/// The backlog's front message is delivered: it leaves, with its byte charge.
fn finish_front(delivery: &mut DeliveryCore) {
    let done = delivery.backlog.pop_front();
    delivery.backlog_bytes -= done.map_or(0, |b| b.delivery.charge_bytes);
}

/// A person channel's recipients: the peer, and the sender's other devices.
fn person_recipients(message: &Committed) -> Vec<Uid> {
    let peer = recv_channel_id(
        &message.channel_key,
        message.channel_type,
        &message.from_uid,
    );
    if *peer == *message.from_uid {
        vec![message.from_uid.clone()]
    } else {
        vec![Uid::from(peer), message.from_uid.clone()]
    }
}

/// Plans and sends the pushes of one subscriber page of a committed message; a batch
/// for a peer without room beyond `reserve` waits in `stalled`.
fn deliver_page(
    node: &mut NodeShard,
    cx: &mut Context<Msg, NodeTimer>,
    driver: &mut NetDriver,
    message: &Arc<Committed>,
    sender: Option<Sender>,
    page: &[Uid],
    reserve: usize,
) {
    let cfg = &node.shared.config.delivery;
    let (batch_max, local_node) = (cfg.push_batch_max, node.shared.config.node_id);
    let mut scratch = std::mem::take(&mut node.delivery.scratch);
    let lookup_ns = node.shared.mono_ns();
    group_by_target(&node.view, page, &mut scratch.groups);
    let lookups: Vec<(crate::cluster::Target, &[Uid])> = scratch.groups.lookups().collect();
    scratch.endpoints.clear();
    scratch.results.clear();
    node.reader
        .endpoints_by_targets_into(&lookups, &mut scratch.endpoints, &mut scratch.results);
    let failed_groups = scratch.results.iter().filter(|r| r.is_err()).count();
    let plan = plan_pushes(
        local_node,
        scratch.endpoints.drain(..),
        failed_groups,
        sender,
        batch_max,
    );
    let planned_ns = node.shared.mono_ns();
    node.stages
        .route_lookup
        .observe_ns(planned_ns.saturating_sub(lookup_ns));
    node.metrics.stale_lookups.add(plan.failed_groups as u64);
    // Other shards' batches first, handed over at once so those shards write their
    // sockets while this one writes its own. A peer without room beyond what is
    // reserved for SENDACKs, commits and control gets its batch later.
    for (to, endpoints) in plan.batches {
        match to {
            PushTo::Shard(s) if s == node.me => scratch.local.push(endpoints),
            PushTo::Shard(s) if cx.send_capacity(s) <= reserve => {
                node.metrics.delivery_stalls.inc();
                node.delivery.stalled.push((s, endpoints, planned_ns));
            }
            PushTo::Shard(s) => {
                node.send_msg(
                    cx,
                    s,
                    Msg::Push {
                        message: message.clone(),
                        endpoints,
                        planned_ns,
                    },
                );
                cx.flush_to(s);
            }
            PushTo::Node(n) => {
                // Remote owners come with the cluster (owner-push RPC).
                tracing::debug!(node = n, "remote owner: push not delivered (single node)");
                node.metrics.push_remote_dropped.add(endpoints.len() as u64);
            }
        }
    }
    for endpoints in scratch.local.drain(..) {
        on_push(node, cx, driver, message, &endpoints, planned_ns);
    }
    node.delivery.scratch = scratch;
}

// ------------------------------------------------------------------ 4. owner

/// Writes RECV to each endpoint that is still this shard's live session.
pub fn on_push(
    node: &mut NodeShard,
    cx: &mut Context<Msg, NodeTimer>,
    driver: &mut NetDriver,
    message: &Arc<Committed>,
    endpoints: &[Endpoint],
    planned_ns: u64,
) {
    // One clock read per batch for the stage histograms, not one per RECV.
    let now_ns = node.shared.mono_ns();
    node.stages
        .push_hop
        .observe_ns(now_ns.saturating_sub(planned_ns));
    let recv_latency_ns = now_ns.saturating_sub(message.committed_ns);
    let mut written = 0usize;
    for ep in endpoints {
        // The owner revalidates (uid, boot_id, session_id, owner_seq): a stale
        // endpoint never reaches a newer session.
        if node
            .registry
            .revalidate(&ep.uid, ep.boot_id, ep.session_id, ep.owner_seq)
            .is_none()
        {
            node.metrics.push_stale.inc();
            continue;
        }
        let Some(&conn) = node.session_conns.get(&ep.session_id) else {
            continue;
        };
        if write_recv(node, driver, conn, &ep.uid, message, false) {
            node.stages.recv_latency.observe_ns(recv_latency_ns);
            written += 1;
        }
        track_ack(node, cx, conn, message);
    }
    // The socket-write stage ends when the next driver poll has submitted these
    // sends: see `observe_socket_writes`.
    if written > 0 && node.write_marks_ns.len() < WRITE_MARKS_MAX {
        node.write_marks_ns.push(now_ns);
    }
}

/// Most push batches whose socket write is timed per loop turn (more are not timed).
pub const WRITE_MARKS_MAX: usize = 4_096;

/// Closes the socket-write stage of the push batches queued before this turn's
/// driver poll (called first thing in the shard's `on_turn`, after the poll).
pub fn observe_socket_writes(node: &mut NodeShard) {
    if node.write_marks_ns.is_empty() {
        return;
    }
    let now_ns = node.shared.mono_ns();
    for &mark in &node.write_marks_ns {
        node.stages
            .socket_write
            .observe_ns(now_ns.saturating_sub(mark));
    }
    node.write_marks_ns.clear();
}

/// Encodes RECV for one connection (its version, its key) and queues it; returns
/// whether it was queued.
fn write_recv(
    node: &mut NodeShard,
    driver: &mut NetDriver,
    id: ConnId,
    uid: &str,
    m: &Committed,
    dup: bool,
) -> bool {
    let mut buf = std::mem::take(&mut node.frame_buf);
    buf.clear();
    let written = encode_recv_for(node, id, uid, m, dup, &mut buf) && driver.send(id, &buf).is_ok();
    if written {
        node.metrics.recvs.inc();
    }
    node.frame_buf = buf;
    written
}

/// Appends the RECV of `m` for connection `id` to `buf`; false if it has no session.
fn encode_recv_for(
    node: &NodeShard,
    id: ConnId,
    uid: &str,
    m: &Committed,
    dup: bool,
    buf: &mut Vec<u8>,
) -> bool {
    let Some(conn) = node.conn(id) else {
        return false;
    };
    if conn.state != ConnState::Active {
        return false;
    }
    let Some(cipher) = conn.cipher.as_ref() else {
        return false;
    };
    let mut flags = Flags(m.flags);
    if dup {
        flags = flags.with(Flags::DUP);
    }
    let base = RecvPacket {
        flags,
        setting: Setting(m.setting),
        msg_key: "",
        from_uid: &m.from_uid,
        channel_id: recv_channel_id(&m.channel_key, m.channel_type, uid),
        channel_type: ChannelType(m.channel_type),
        expire_s: m.expire_s,
        client_msg_no: &m.client_msg_no,
        message_id: m.message_id,
        message_seq: m.message_seq,
        timestamp_s: m.timestamp_s as i32,
        topic: &m.topic,
        payload: &[],
        ..Default::default()
    };
    match cipher.encode_recv(&base, &m.payload, conn.version, buf) {
        Ok(_) => true,
        Err(err) => {
            tracing::warn!(?err, "RECV could not be encoded");
            false
        }
    }
}

fn track_ack(
    node: &mut NodeShard,
    cx: &mut Context<Msg, NodeTimer>,
    id: ConnId,
    message: &Arc<Committed>,
) {
    use domain::acks::Tracked;
    let limits = ack_limits(&node.shared.config.session);
    let now_ms = cx.now_ms();
    let mut shard_bytes = node.pending_ack_bytes;
    let Some(conn) = node.conn_mut(id) else {
        return;
    };
    match conn
        .acks
        .track(message.clone(), now_ms, &limits, &mut shard_bytes)
    {
        // Past a limit the RECV goes untracked: the client recovers it by sync.
        Tracked::SessionFull | Tracked::OverBudget => node.metrics.acks_dropped.inc(),
        Tracked::Yes { arm_timer_at } => {
            if let Some(deadline_ms) = arm_timer_at {
                arm_ack_timer(node, cx, id, deadline_ms, &mut shard_bytes);
            }
            node.set_pending_ack_bytes(shard_bytes);
        }
    }
}

/// Arms connection `id`'s ack timer for `deadline_ms`; without a timer nothing could
/// time out, so its pending RECVs are forgotten (counted; the client recovers by sync).
fn arm_ack_timer(
    node: &mut NodeShard,
    cx: &mut Context<Msg, NodeTimer>,
    id: ConnId,
    deadline_ms: u64,
    shard_bytes: &mut usize,
) {
    let armed = cx.set_timer(deadline_ms, NodeTimer::Ack { conn: id });
    let Some(conn) = node.conn_mut(id) else {
        return;
    };
    match armed {
        Ok(timer) => conn.ack_timer = Some(timer),
        Err(_) => {
            conn.ack_timer = None;
            let n = conn.acks.timer_refused(shard_bytes) as u64;
            node.metrics.acks_dropped.add(n);
        }
    }
}

// --------------------------------------------------------------- 5. acknowledgement

/// RECVACK: the session has the message.
pub fn on_recvack(node: &mut NodeShard, id: ConnId, message_id: i64) {
    let mut shard_bytes = node.pending_ack_bytes;
    let Some(conn) = node.conn_mut(id) else {
        return;
    };
    if conn.acks.ack(message_id, &mut shard_bytes) {
        node.set_pending_ack_bytes(shard_bytes);
        node.metrics.recvacks.inc();
    }
}

/// The session's ack timer: every RECV now due is re-sent with DUP, up to
/// `ack_resends_max` times, then dropped (the client recovers by sync).
pub fn on_ack_timeout(
    node: &mut NodeShard,
    cx: &mut Context<Msg, NodeTimer>,
    driver: &mut NetDriver,
    id: ConnId,
) {
    let limits = ack_limits(&node.shared.config.session);
    let now_ms = cx.now_ms();
    let mut shard_bytes = node.pending_ack_bytes;
    let mut resend = std::mem::take(&mut node.ack_resend_buf);
    let Some(conn) = node.conn_mut(id) else {
        return;
    };
    conn.ack_timer = None;
    let uid = conn.uid.clone();
    let out = conn
        .acks
        .on_timeout(now_ms, &limits, &mut shard_bytes, &mut resend);
    node.metrics.acks_expired.add(out.expired);
    if let Some(deadline_ms) = out.next_deadline_ms {
        arm_ack_timer(node, cx, id, deadline_ms, &mut shard_bytes);
    }
    node.set_pending_ack_bytes(shard_bytes);
    for message in resend.drain(..) {
        let _ = write_recv(node, driver, id, &uid, &message, true);
    }
    node.ack_resend_buf = resend;
}

/// SENDACK back on the gateway shard, if the sending session is still there (its
/// SEND's shard credit returns when the SENDACK arrives, in `NodeShard::on_message`).
pub fn on_sendack(node: &mut NodeShard, driver: &mut NetDriver, ack: SendAck) {
    let Some(conn) = node.conn_mut(ack.conn) else {
        return;
    };
    if conn.session_id != ack.session_id {
        return;
    }
    conn.sends_in_flight = conn.sends_in_flight.saturating_sub(1);
    let p = SendackPacket {
        message_id: ack.message_id,
        client_seq: ack.client_seq,
        message_seq: ack.message_seq,
        reason_code: ack.reason,
        ..Default::default()
    };
    node.write_frame(driver, ack.conn, |v, out| p.encode(v, out));
}

/// The interval fsync policy's timer: a sync job for the appends not yet synced,
/// unless one is still in flight (its end is collected by `flush_commits`).
pub fn on_log_sync_timer(node: &mut NodeShard) {
    // The timer paces the syncs; a job still running covers part of what follows.
    if node.delivery.syncer.busy() {
        return;
    }
    match node.delivery.log.begin_sync() {
        Ok(None) => {}
        Ok(Some(job)) => {
            if let Some(ran_here) = node.delivery.syncer.submit(job) {
                end_sync(node, ran_here);
            }
        }
        Err(err) => {
            log_failed(node, &err);
            tracing::error!(%err, shard = node.me, "interval log sync failed");
        }
    }
}

/// `/channel/messagesync` on the channel's delivery shard.
pub fn on_message_sync(node: &mut NodeShard, r: MessageSyncRequest) {
    let result = node
        .delivery
        .log
        .read_within(
            r.channel_type,
            &r.channel_key,
            r.start_seq,
            r.end_seq,
            r.limit,
            r.pull_mode,
            r.max_bytes,
        )
        .map(|res| {
            (
                res.messages.iter().map(|m| m.to_stored()).collect(),
                res.more,
            )
        })
        .map_err(|e| e.to_string());
    let _ = r.reply.try_send(result);
}
