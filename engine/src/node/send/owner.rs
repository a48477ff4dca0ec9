//! Step 4 and 5 of a SEND, on the shard holding the recipient's connection: each
//! pushed endpoint is revalidated against this shard's registry (a stale endpoint
//! never reaches a newer session), the RECV encrypted for its session and queued on
//! the socket; the pending RECVACKs (`domain::send::acks::PendingAcks`) re-send with DUP
//! on their timer, a bounded number of times, then drop (the client recovers by
//! sync).

use std::sync::Arc;

use net::io::{ConnId, NetDriver};
use proto::wkproto::{ChannelType, Flags, RecvPacket, Setting};
use shard::runtime::Context;

use crate::channel::recv_channel_id;
use crate::route::Endpoint;

use super::super::msg::Msg;
use super::super::shard::{ConnState, NodeShard, NodeTimer};
use super::{Committed, WRITE_MARKS_MAX};

/// The pending-ACK limits of `[session]`.
fn ack_limits(s: &super::super::config::SessionConfig) -> domain::send::acks::AckLimits {
    domain::send::acks::AckLimits {
        per_session_max: s.pending_acks_per_session_max,
        shard_budget_bytes: s.pending_acks_budget_bytes_per_shard,
        timeout_ms: s.ack_timeout_ms,
        resends_max: s.ack_resends_max,
    }
}

/// Writes RECV to each endpoint that is still this shard's live session.
pub fn on_push(
    node: &mut NodeShard,
    cx: &mut Context<Msg, NodeTimer>,
    driver: &mut NetDriver,
    message: &Arc<Committed>,
    endpoints: &[Endpoint],
    handed_ns: u64,
) {
    // One clock read per batch for the stage histograms, not one per RECV.
    let now_ns = node.shared.mono_ns();
    node.stages
        .push_hop
        .observe_ns(now_ns.saturating_sub(handed_ns));
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

/// An owner push from another node (the hop `Push`): the plaintext message and the
/// exact endpoints, split by the shard that owns each session; each endpoint is
/// revalidated there as any push is (an endpoint of another node or an earlier
/// process of this one fails revalidation: counted stale, never written).
pub fn on_remote_push(
    node: &mut NodeShard,
    cx: &mut Context<Msg, NodeTimer>,
    driver: &mut NetDriver,
    message: Committed,
    mut endpoints: Vec<Endpoint>,
) {
    let (me_node, handed_ns) = (node.shared.config.node_id, message.committed_ns);
    let before = endpoints.len();
    let shards = node.shared.slot_map.shard_count();
    endpoints.retain(|ep| {
        ep.node_id == me_node && crate::delivery::session_shard(ep.session_id) < shards
    });
    node.metrics
        .push_stale
        .add((before - endpoints.len()) as u64);
    let message = Arc::new(message);
    endpoints.sort_by_key(|ep| crate::delivery::session_shard(ep.session_id));
    for batch in endpoints.chunk_by(|a, b| {
        crate::delivery::session_shard(a.session_id) == crate::delivery::session_shard(b.session_id)
    }) {
        let owner = crate::delivery::session_shard(batch[0].session_id);
        if owner == node.me {
            on_push(node, cx, driver, &message, batch, handed_ns);
        } else {
            let msg = Msg::Push {
                message: message.clone(),
                endpoints: batch.to_vec(),
                handed_ns,
            };
            node.send_msg(cx, owner, msg);
        }
    }
}

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
    let written = match encode_recv_for(node, id, uid, m, dup, &mut buf) {
        Some(Wire::Binary) => driver.send(id, &buf).is_ok(),
        Some(Wire::JsonRpc) => driver.send_text(id, &buf).is_ok(),
        None => false,
    };
    if written {
        node.metrics.recvs.inc();
    }
    node.frame_buf = buf;
    written
}

/// How an encoded RECV goes out.
enum Wire {
    /// A wkproto frame (binary WebSocket message on WebSocket).
    Binary,
    /// A JSON-RPC `recv` notification (a text message).
    JsonRpc,
}

/// Appends the RECV of `m` for connection `id` to `buf`; `None` if it has no session.
fn encode_recv_for(
    node: &NodeShard,
    id: ConnId,
    uid: &str,
    m: &Committed,
    dup: bool,
    buf: &mut Vec<u8>,
) -> Option<Wire> {
    let conn = node.conn(id)?;
    if conn.state != ConnState::Active {
        return None;
    }
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
    if conn.is_jsonrpc() {
        let plain = RecvPacket {
            payload: &m.payload,
            ..base
        };
        proto::jsonrpc::encode_recv(&plain, buf);
        return Some(Wire::JsonRpc);
    }
    let cipher = conn.cipher.as_ref()?;
    match cipher.encode_recv(&base, &m.payload, conn.version, buf) {
        Ok(_) => Some(Wire::Binary),
        Err(err) => {
            tracing::warn!(?err, "RECV could not be encoded");
            None
        }
    }
}

fn track_ack(
    node: &mut NodeShard,
    cx: &mut Context<Msg, NodeTimer>,
    id: ConnId,
    message: &Arc<Committed>,
) {
    use domain::send::acks::Tracked;
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
        node.ack_resend_buf = resend;
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
