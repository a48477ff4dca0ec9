//! The shard's connection table and its frames: [`Conn`] and [`ConnState`], accept,
//! reading and decoding frames and dispatching them (CONNECT to [`super::connect`],
//! SEND and RECVACK to [`super::send`]), writing frames, DISCONNECT, close, and the
//! `Closed` clean-up (pending ACKs, local removal of the session).
//!
//! A WebSocket connection whose first message is text speaks JSON-RPC
//! ([`proto::jsonrpc`]): its messages are translated to the same packets here, at the
//! edge ([`NodeShard::on_readable`], [`NodeShard::write_frame`], and RECV in
//! [`super::send`]), so everything behind sees one protocol.
//!
//! What enters here: the driver's `NetEvent`s (`Accepted`, `Readable`, `Closed`) from
//! `NodeShard::on_io`. No timer enters here (a session's ack timer belongs to
//! [`super::send`]; `Closed` only cancels it).
//!
//! Rule numbers: `docs/authority-rules.md`.

use net::io::{CloseReason, ConnId, NetDriver, Transport};
use proto::jsonrpc::{self, Inbound, JsonRpc};
use proto::wkproto::{self, DisconnectPacket, Frame, ReasonCode};
use shard::runtime::Context;

use crate::activation::Event;
use crate::route::Uid;
use domain::presence::connection::{self, FrameAction, FrameKind};

use super::conn::{Conn, ConnState, PendingAcks};
use super::msg::Msg;
use super::msg::OwnedConnect;
use super::shard::{NodeShard, NodeTimer};

/// What handling one frame asks of the connection.
enum FrameOutcome {
    Continue,
    Close(ReasonCode, &'static str),
}

impl NodeShard {
    pub(crate) fn conn(&self, id: ConnId) -> Option<&Conn> {
        self.conns.get(id)
    }

    pub(crate) fn conn_mut(&mut self, id: ConnId) -> Option<&mut Conn> {
        self.conns.get_mut(id)
    }

    /// A new connection waits for CONNECT (or is closed at once while stopping).
    pub(super) fn on_accepted(
        &mut self,
        driver: &mut NetDriver,
        conn: ConnId,
        listener: Transport,
    ) {
        if self.stopping {
            driver.close(conn);
            return;
        }
        self.conns.insert(Conn {
            id: conn,
            listener,
            state: ConnState::AwaitConnect,
            version: wkproto::LATEST_VERSION,
            connack_server_version: None,
            cipher: None,
            server_key: Box::from(""),
            salt: Box::from(""),
            client_timestamp_ms: 0,
            connect_ns: 0,
            uid: Uid::from(""),
            session_id: 0,
            handle: None,
            acks: PendingAcks::default(),
            ack_timer: None,
            sends_in_flight: 0,
            new_channels: Default::default(),
            jsonrpc: None,
        });
        self.metrics.connections.inc();
    }

    /// Decodes and handles every whole frame in the connection's input.
    pub(super) fn on_readable(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        id: ConnId,
    ) {
        let max = self.shared.config.net.frame_bytes_max;
        self.detect_jsonrpc(driver, id);
        loop {
            let Some(conn) = self.conn(id) else { return };
            let (state, version, json) = (conn.state, conn.version, conn.is_jsonrpc());
            if state == ConnState::Closing {
                let n = driver.input(id).len();
                driver.consume(id, n);
                return;
            }
            if driver.input(id).is_empty() {
                return;
            }
            let more = if json {
                self.read_json(cx, driver, id)
            } else if state == ConnState::AwaitConnect {
                self.read_connect(cx, driver, id, max)
            } else {
                self.read_frame(cx, driver, id, version, max)
            };
            if !more {
                return;
            }
        }
    }

    /// A WebSocket connection still waiting for CONNECT whose first message was text
    /// gets its JSON-RPC codec. It keeps the ids of one more `send` than the
    /// connection's credits: the SEND past them is answered at once (SENDACK 22), as
    /// on the binary protocol, before the codec's own bound could refuse it.
    fn detect_jsonrpc(&mut self, driver: &NetDriver, id: ConnId) {
        let credits = self.shared.config.session.sends_in_flight_per_conn_max as usize;
        let pending_max = credits.saturating_add(1);
        if let Some(conn) = self.conn_mut(id) {
            if conn.listener == Transport::WebSocket
                && conn.state == ConnState::AwaitConnect
                && conn.jsonrpc.is_none()
                && driver.text_messages(id)
            {
                conn.jsonrpc = Some(Box::new(JsonRpc::new(pending_max)));
            }
        }
    }

    /// Decodes and handles one JSON-RPC message: `connect` first, then the packets
    /// it stands for, as [`Self::read_frame`] does. False when no whole message is
    /// there yet, or the connection was closed.
    fn read_json(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        id: ConnId,
    ) -> bool {
        let Some((text, used)) = proto::ws::next_text_message(driver.input(id)) else {
            return false;
        };
        let decoded = match self.conn_mut(id).and_then(|c| c.jsonrpc.as_mut()) {
            Some(rpc) => rpc.decode(text),
            None => return false,
        };
        driver.consume(id, used);
        let inbound = match decoded {
            Ok(inbound) => inbound,
            Err(rejection) => {
                tracing::info!(?id, why = %rejection.message, "bad JSON-RPC message: closing");
                self.metrics.bad_frames.inc();
                self.frame_buf.clear();
                jsonrpc::encode_rejection(&rejection, &mut self.frame_buf);
                let _ = driver.send_text(id, &self.frame_buf);
                self.close(driver, id);
                return false;
            }
        };
        let state = self.conn(id).map(|c| c.state);
        match (&inbound, state) {
            (Inbound::Connect(_), Some(ConnState::AwaitConnect)) => {
                let Frame::Connect(p) = inbound.frame() else {
                    return false;
                };
                let connect = OwnedConnect::from(&p);
                self.on_connect(cx, driver, id, connect);
                true
            }
            _ => match self.on_frame(cx, driver, id, inbound.frame()) {
                FrameOutcome::Continue => true,
                FrameOutcome::Close(reason, text) => {
                    self.disconnect(driver, id, reason, text);
                    false
                }
            },
        }
    }

    /// Decodes the first frame, which must be CONNECT, and hands it to admission.
    /// False when it is incomplete, or bad (then the connection is closed).
    fn read_connect(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        id: ConnId,
        max: usize,
    ) -> bool {
        match wkproto::decode_connect(driver.input(id), max) {
            Ok(None) => false,
            Ok(Some((connect, used))) => {
                let connect = OwnedConnect::from(&connect);
                driver.consume(id, used);
                self.on_connect(cx, driver, id, connect);
                true
            }
            Err(err) => {
                tracing::info!(?id, %err, "bad first frame: closing");
                self.metrics.bad_frames.inc();
                self.close(driver, id);
                false
            }
        }
    }

    /// Decodes and handles one frame after CONNECT. False when no whole frame is
    /// there yet, or the connection was closed.
    fn read_frame(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        id: ConnId,
        version: u8,
        max: usize,
    ) -> bool {
        // Copy one whole frame out of the driver's buffer, so handling it can
        // write to the driver.
        let input = driver.input(id);
        let frame_len = match wkproto::peek_frame_len(input, max) {
            Ok(None) => return false,
            Ok(Some(n)) if n <= input.len() => n,
            Ok(Some(_)) => return false,
            Err(err) => {
                tracing::info!(?id, %err, "undecodable frame: closing");
                self.metrics.bad_frames.inc();
                self.disconnect(driver, id, ReasonCode::UNKNOWN, "undecodable frame");
                return false;
            }
        };
        let mut frame_bytes = std::mem::take(&mut self.rx_frame);
        frame_bytes.clear();
        frame_bytes.extend_from_slice(&input[..frame_len]);
        driver.consume(id, frame_len);
        let result = match wkproto::decode(&frame_bytes, version, max) {
            Ok(Some((frame, _))) => self.on_frame(cx, driver, id, frame),
            Ok(None) => FrameOutcome::Close(ReasonCode::UNKNOWN, "truncated frame"),
            Err(err) => {
                tracing::info!(?id, %err, "undecodable frame: closing");
                self.metrics.bad_frames.inc();
                FrameOutcome::Close(ReasonCode::UNKNOWN, "undecodable frame")
            }
        };
        self.rx_frame = frame_bytes;
        if let FrameOutcome::Close(reason, text) = result {
            self.disconnect(driver, id, reason, text);
            return false;
        }
        true
    }

    /// One decoded frame of connection `id` after its CONNECT: the table
    /// (`domain::presence::connection::on_frame`) says what it does in the connection's
    /// phase; this carries it out.
    fn on_frame(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        id: ConnId,
        frame: Frame<'_>,
    ) -> FrameOutcome {
        let phase = self.conn(id).map(|c| c.state.phase());
        match (connection::on_frame(phase, FrameKind::of(&frame)), frame) {
            (FrameAction::Pong, _) => {
                if let Some(handle) = self.conn(id).and_then(|c| c.handle) {
                    self.registry.mark_touched(handle, cx.now_ms() / 1000);
                }
                self.write_frame(driver, id, |v, out| Frame::Pong.encode(v, out));
            }
            (FrameAction::Send, Frame::Send(p)) => {
                self.touch_on_activity(cx, id);
                self.on_send(cx, driver, id, &p);
            }
            (FrameAction::Recvack, Frame::Recvack(p)) => {
                self.touch_on_activity(cx, id);
                (self.owner).on_recvack(&mut self.conns, &self.metrics, id, p.message_id);
            }
            (FrameAction::RefuseSub(reason_code), Frame::Sub(p)) => {
                let ack = wkproto::SubackPacket {
                    sub_no: p.sub_no,
                    channel_id: p.channel_id,
                    channel_type: p.channel_type,
                    action: p.action,
                    reason_code,
                    ..Default::default()
                };
                self.write_frame(driver, id, |v, out| ack.encode(v, out));
            }
            (FrameAction::Close, _) => self.close(driver, id),
            (FrameAction::Refuse(reason, text), frame) => {
                tracing::info!(?id, kind = ?frame.packet_type(), text, "refused packet: closing");
                return FrameOutcome::Close(reason, text);
            }
            (action, frame) => {
                // The table answers each frame kind with its own action (its test).
                tracing::error!(?id, ?action, kind = ?frame.packet_type(), "action for another frame kind: closing");
                return FrameOutcome::Close(ReasonCode::SYSTEM_ERROR, "internal error");
            }
        }
        FrameOutcome::Continue
    }

    /// Any client frame is activity for the route (`docs/wkproto.md`, Liveness).
    fn touch_on_activity(&mut self, cx: &Context<Msg, NodeTimer>, id: ConnId) {
        if let Some(handle) = self.conn(id).and_then(|c| c.handle) {
            self.registry.mark_touched(handle, cx.now_ms() / 1000);
        }
    }

    /// Encodes one frame with the connection's version and queues it (a JSON-RPC
    /// connection's: translated, [`Self::write_json`]).
    pub(crate) fn write_frame(
        &mut self,
        driver: &mut NetDriver,
        id: ConnId,
        encode: impl FnOnce(u8, &mut Vec<u8>) -> Result<usize, wkproto::EncodeError>,
    ) {
        let Some((version, json)) = self.conn(id).map(|c| (c.version, c.is_jsonrpc())) else {
            return;
        };
        self.frame_buf.clear();
        match encode(version, &mut self.frame_buf) {
            Ok(_) if json => self.write_json(driver, id, version),
            Ok(_) => {
                if let Err(err) = driver.send(id, &self.frame_buf) {
                    tracing::debug!(?id, %err, "write to a closed or overflowing connection");
                }
            }
            Err(err) => tracing::warn!(?id, ?err, "frame could not be encoded"),
        }
    }

    /// The wkproto frame in `frame_buf`, as the JSON-RPC message answering or
    /// carrying it (none for an answer whose request is unknown).
    fn write_json(&mut self, driver: &mut NetDriver, id: ConnId, version: u8) {
        let frame_bytes = std::mem::take(&mut self.frame_buf);
        let mut text = std::mem::take(&mut self.json_buf);
        text.clear();
        let encoded = match (
            wkproto::decode(&frame_bytes, version, usize::MAX),
            self.conn_mut(id).and_then(|c| c.jsonrpc.as_mut()),
        ) {
            (Ok(Some((frame, _))), Some(rpc)) => rpc.encode(&frame, &mut text),
            _ => false,
        };
        if encoded {
            if let Err(err) = driver.send_text(id, &text) {
                tracing::debug!(?id, %err, "write to a closed or overflowing connection");
            }
        }
        self.frame_buf = frame_bytes;
        self.json_buf = text;
    }

    /// DISCONNECT with `reason`, then close.
    pub(crate) fn disconnect(
        &mut self,
        driver: &mut NetDriver,
        id: ConnId,
        reason: ReasonCode,
        text: &str,
    ) {
        let p = DisconnectPacket {
            reason_code: reason,
            reason: text,
            ..Default::default()
        };
        self.write_frame(driver, id, |v, out| p.encode(v, out));
        self.close(driver, id);
    }

    /// Closes the connection gracefully; its session is deactivated when the driver
    /// reports `Closed`.
    pub(crate) fn close(&mut self, driver: &mut NetDriver, id: ConnId) {
        if let Some(conn) = self.conn_mut(id) {
            if conn.state == ConnState::Active {
                conn.state = ConnState::Closing;
            } else if let ConnState::AwaitConnect | ConnState::Authenticating = conn.state {
                conn.state = ConnState::Closing;
            }
            // An activating connection stays Activating until `Closed` arrives, so
            // its activation learns of it (rule 30).
        }
        driver.close(id);
    }

    /// The driver closed the connection: its pending ACKs go, and its session is
    /// removed locally (or its activation learns of it).
    pub(super) fn on_closed(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        id: ConnId,
        reason: CloseReason,
    ) {
        let Some(conn) = self.conns.take(id) else {
            return;
        };
        self.metrics.connections.dec();
        tracing::debug!(?id, ?reason, uid = %conn.uid, "connection closed");
        if let Some(timer) = conn.ack_timer {
            cx.cancel_timer(timer);
        }
        let mut conn = conn;
        self.owner.forget_acks(&mut conn, &self.metrics);
        match conn.state {
            ConnState::Activating(aid) => {
                self.conns.unbind_session(conn.session_id);
                self.feed_activation(cx, driver, aid, Event::SessionClosed);
            }
            _ => {
                if let Some(handle) = conn.handle {
                    // Rule 32: local removal first, then the queued authority unregister.
                    self.registry.deactivate(handle, cx.now_ms());
                }
                self.conns.unbind_session(conn.session_id);
            }
        }
    }
}
