//! Step 4 and 5 of a SEND, on the shard holding the recipient's connection: each
//! pushed endpoint is revalidated against this shard's registry (a stale endpoint
//! never reaches a newer session), the RECV encrypted for its session and queued on
//! the socket; the pending RECVACKs (`domain::send::acks::PendingAcks`) re-send with DUP
//! on their timer, a bounded number of times, then drop (the client recovers by
//! sync).
//!
//! [`OwnerSide`] owns what only this step uses (the shard's pending-ACK charge, the
//! socket-write marks, its buffers); each call borrows the rest from its shard
//! ([`OwnerIo`]: the connection table, the registry, the counters, the clock, the
//! timers and the driver).

use std::sync::Arc;

use net::io::{ConnId, NetDriver};
use proto::wkproto::{ChannelType, Flags, RecvPacket, Setting};
use shard::runtime::Context;

use domain::send::acks::{AckLimits, Tracked};

use crate::channel::recv_channel_id;
use crate::registry::Registry;
use crate::route::Endpoint;

use super::super::config::SessionConfig;
use super::super::conn::{Conn, ConnState, ConnTable};
use super::super::metrics::{ShardMetrics, StageHistograms};
use super::super::msg::{Msg, NodeTimer};
use super::super::shared::NodeShared;
use super::{Committed, WRITE_MARKS_MAX};

/// The owner side of one shard.
pub(crate) struct OwnerSide {
    limits: AckLimits,
    /// What this shard's pending-ACK entries are charged (bounded by
    /// `pending_acks_budget_bytes_per_shard`; exported as a gauge).
    pending_ack_bytes: usize,
    /// Push batches queued this turn, waiting for the poll that writes them
    /// (bounded by [`WRITE_MARKS_MAX`]).
    write_marks_ns: Vec<u64>,
    /// RECVs an ack timeout re-sends (reused).
    resend_buf: Vec<Arc<Committed>>,
    /// One RECV being encoded (reused).
    frame_buf: Vec<u8>,
}

/// What one call of the owner side borrows from its shard.
pub(crate) struct OwnerIo<'a> {
    pub(crate) conns: &'a mut ConnTable,
    pub(crate) registry: &'a Registry,
    pub(crate) metrics: &'a ShardMetrics,
    pub(crate) stages: &'a StageHistograms,
    pub(crate) clock: &'a NodeShared,
    pub(crate) cx: &'a mut Context<Msg, NodeTimer>,
    pub(crate) driver: &'a mut NetDriver,
}

/// The pending-ACK limits of `[session]`.
fn ack_limits(s: &SessionConfig) -> AckLimits {
    AckLimits {
        per_session_max: s.pending_acks_per_session_max,
        shard_budget_bytes: s.pending_acks_budget_bytes_per_shard,
        timeout_ms: s.ack_timeout_ms,
        resends_max: s.ack_resends_max,
    }
}

impl OwnerSide {
    pub(crate) fn new(session: &SessionConfig) -> OwnerSide {
        OwnerSide {
            limits: ack_limits(session),
            pending_ack_bytes: 0,
            write_marks_ns: Vec::with_capacity(WRITE_MARKS_MAX),
            resend_buf: Vec::new(),
            frame_buf: Vec::with_capacity(4096),
        }
    }

    /// Writes RECV to each endpoint that is still this shard's live session.
    pub(crate) fn on_push(
        &mut self,
        io: &mut OwnerIo<'_>,
        message: &Arc<Committed>,
        endpoints: &[Endpoint],
        handed_ns: u64,
    ) {
        // One clock read per batch for the stage histograms, not one per RECV.
        let now_ns = io.clock.mono_ns();
        io.stages
            .push_hop
            .observe_ns(now_ns.saturating_sub(handed_ns));
        let recv_latency_ns = now_ns.saturating_sub(message.committed_ns);
        let mut written = 0usize;
        for ep in endpoints {
            // The owner revalidates (uid, boot_id, session_id, owner_seq): a stale
            // endpoint never reaches a newer session.
            if io
                .registry
                .revalidate(&ep.uid, ep.boot_id, ep.session_id, ep.owner_seq)
                .is_none()
            {
                io.metrics.push_stale.inc();
                continue;
            }
            let Some(conn) = io.conns.of_session(ep.session_id) else {
                continue;
            };
            if self.write_recv(io, conn, &ep.uid, message, false) {
                io.stages.recv_latency.observe_ns(recv_latency_ns);
                written += 1;
            }
            self.track_ack(io, conn, message);
        }
        // The socket-write stage ends when the next driver poll has submitted these
        // sends: see `observe_socket_writes`.
        if written > 0 && self.write_marks_ns.len() < WRITE_MARKS_MAX {
            self.write_marks_ns.push(now_ns);
        }
    }

    /// Closes the socket-write stage of the push batches queued before this turn's
    /// driver poll (called first thing in the shard's `on_turn`, after the poll).
    pub(crate) fn observe_socket_writes(&mut self, stages: &StageHistograms, clock: &NodeShared) {
        if self.write_marks_ns.is_empty() {
            return;
        }
        let now_ns = clock.mono_ns();
        for &mark in &self.write_marks_ns {
            stages.socket_write.observe_ns(now_ns.saturating_sub(mark));
        }
        self.write_marks_ns.clear();
    }

    /// Encodes RECV for one connection (its version, its key) and queues it;
    /// returns whether it was queued.
    fn write_recv(
        &mut self,
        io: &mut OwnerIo<'_>,
        id: ConnId,
        uid: &str,
        m: &Committed,
        dup: bool,
    ) -> bool {
        let buf = &mut self.frame_buf;
        buf.clear();
        let wire = (io.conns.get(id)).and_then(|c| encode_recv_for(c, uid, m, dup, buf));
        let written = match wire {
            Some(Wire::Binary) => io.driver.send(id, buf).is_ok(),
            Some(Wire::JsonRpc) => io.driver.send_text(id, buf).is_ok(),
            None => false,
        };
        if written {
            io.metrics.recvs.inc();
        }
        written
    }

    fn track_ack(&mut self, io: &mut OwnerIo<'_>, id: ConnId, message: &Arc<Committed>) {
        let now_ms = io.cx.now_ms();
        let mut shard_bytes = self.pending_ack_bytes;
        let Some(conn) = io.conns.get_mut(id) else {
            return;
        };
        match conn
            .acks
            .track(message.clone(), now_ms, &self.limits, &mut shard_bytes)
        {
            // Past a limit the RECV goes untracked: the client recovers it by sync.
            Tracked::SessionFull | Tracked::OverBudget => io.metrics.acks_dropped.inc(),
            Tracked::Yes { arm_timer_at } => {
                if let Some(deadline_ms) = arm_timer_at {
                    arm_ack_timer(io, id, deadline_ms, &mut shard_bytes);
                }
                self.set_pending_ack_bytes(io.metrics, shard_bytes);
            }
        }
    }

    /// RECVACK: the session has the message.
    pub(crate) fn on_recvack(
        &mut self,
        conns: &mut ConnTable,
        metrics: &ShardMetrics,
        id: ConnId,
        message_id: i64,
    ) {
        let mut shard_bytes = self.pending_ack_bytes;
        let Some(conn) = conns.get_mut(id) else {
            return;
        };
        if conn.acks.ack(message_id, &mut shard_bytes) {
            self.set_pending_ack_bytes(metrics, shard_bytes);
            metrics.recvacks.inc();
        }
    }

    /// The session's ack timer: every RECV now due is re-sent with DUP, up to
    /// `ack_resends_max` times, then dropped (the client recovers by sync).
    pub(crate) fn on_ack_timeout(&mut self, io: &mut OwnerIo<'_>, id: ConnId) {
        let now_ms = io.cx.now_ms();
        let mut shard_bytes = self.pending_ack_bytes;
        let mut resend = std::mem::take(&mut self.resend_buf);
        let Some(conn) = io.conns.get_mut(id) else {
            self.resend_buf = resend;
            return;
        };
        conn.ack_timer = None;
        let uid = conn.uid.clone();
        let out = conn
            .acks
            .on_timeout(now_ms, &self.limits, &mut shard_bytes, &mut resend);
        io.metrics.acks_expired.add(out.expired);
        if let Some(deadline_ms) = out.next_deadline_ms {
            arm_ack_timer(io, id, deadline_ms, &mut shard_bytes);
        }
        self.set_pending_ack_bytes(io.metrics, shard_bytes);
        for message in resend.drain(..) {
            let _ = self.write_recv(io, id, &uid, &message, true);
        }
        self.resend_buf = resend;
    }

    /// A closed connection's pending RECVs are forgotten (its timer is the
    /// caller's to cancel).
    pub(crate) fn forget_acks(&mut self, conn: &mut Conn, metrics: &ShardMetrics) {
        let mut shard_bytes = self.pending_ack_bytes;
        conn.acks.clear(&mut shard_bytes);
        self.set_pending_ack_bytes(metrics, shard_bytes);
    }

    /// Records the shard's pending-ACK charge (and its gauge).
    fn set_pending_ack_bytes(&mut self, metrics: &ShardMetrics, bytes: usize) {
        self.pending_ack_bytes = bytes;
        metrics.pending_ack_bytes.set(bytes as u64);
    }
}

/// How an encoded RECV goes out.
enum Wire {
    /// A wkproto frame (binary WebSocket message on WebSocket).
    Binary,
    /// A JSON-RPC `recv` notification (a text message).
    JsonRpc,
}

/// Appends the RECV of `m` for `conn` to `buf`; `None` if it has no active session.
fn encode_recv_for(
    conn: &Conn,
    uid: &str,
    m: &Committed,
    dup: bool,
    buf: &mut Vec<u8>,
) -> Option<Wire> {
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

/// Arms connection `id`'s ack timer for `deadline_ms`; without a timer nothing could
/// time out, so its pending RECVs are forgotten (counted; the client recovers by sync).
fn arm_ack_timer(io: &mut OwnerIo<'_>, id: ConnId, deadline_ms: u64, shard_bytes: &mut usize) {
    let armed = io.cx.set_timer(deadline_ms, NodeTimer::Ack { conn: id });
    let Some(conn) = io.conns.get_mut(id) else {
        return;
    };
    match armed {
        Ok(timer) => conn.ack_timer = Some(timer),
        Err(_) => {
            conn.ack_timer = None;
            let n = conn.acks.timer_refused(shard_bytes) as u64;
            io.metrics.acks_dropped.add(n);
        }
    }
}
