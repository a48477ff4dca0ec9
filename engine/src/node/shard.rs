//! One shard of a node: the gateway for the connections it accepted, the presence
//! authority for its hash slots, the delivery core for its channels, and the owner
//! that writes RECV to its sessions. Every decision is made by the sans-IO pieces
//! (activation, registry, authority, delivery planner); this file only moves their
//! inputs and outputs between sockets, shards and timers.
//!
//! The SEND → RECV path lives in [`super::send`], in flow order.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use net::crypto::{server_handshake, CryptoError, SessionCipher};
use net::io::{CloseReason, ConnId, ListenerKind, NetDriver, NetEvent};
use net::wkproto::{self, ConnackPacket, ConnectPacket, DisconnectPacket, Frame, ReasonCode};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use shard::runtime::{Context, Handler};
use shard::slots::ShardId;
use shard::timer::TimerHandle;

use crate::activation::{self, Activation, ActivationId, AuthorityRequest, Event, Output};
use crate::authority::{Authority, AuthorityReader};
use crate::cluster::{ClusterView, Target};
use crate::delivery::{session_id, session_shard};
use crate::registry::{NewSession, Registry, SessionHandle};
use crate::route::{Listener, OwnerAction, OwnerActionKind, SessionId, Uid};

use super::msg::{AuthorityReply, Corr, Msg};
use super::send::{DeliveryCore, PendingAcks};
use super::NodeShared;

/// What a shard's timers carry.
#[derive(Clone, Copy, Debug)]
pub enum NodeTimer {
    /// An activation's deadline.
    Activation(ActivationId),
    /// The touch worker's flush (and the unregister queue's drain).
    TouchFlush,
    /// The authority's expiry pass.
    Expiry,
    /// The ack timeout of a connection's oldest unacknowledged RECV.
    Ack { conn: ConnId },
    /// The interval fsync policy's sync of the log.
    LogSync,
}

/// Where a connection is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ConnState {
    /// Accepted; waiting for CONNECT.
    AwaitConnect,
    /// CONNECT received; activation running.
    Activating(ActivationId),
    /// CONNACK success sent; the session receives messages.
    Active,
    /// Closing (kicked, refused, shut down): input is ignored.
    Closing,
}

/// One client connection of this shard.
pub(crate) struct Conn {
    pub id: ConnId,
    pub listener: ListenerKind,
    pub state: ConnState,
    /// Negotiated protocol version.
    pub version: u8,
    /// The CONNACK's server_version field (`wkproto::negotiate`).
    pub connack_server_version: Option<u8>,
    pub cipher: Option<SessionCipher>,
    /// CONNACK strings of the key agreement, kept until CONNACK is written.
    pub server_key: Box<str>,
    pub salt: Box<str>,
    pub client_timestamp_ms: i64,
    pub uid: Uid,
    pub session_id: SessionId,
    pub handle: Option<SessionHandle>,
    /// Unacknowledged RECVs of this session.
    pub acks: PendingAcks,
    /// The session's ack timer, while armed (the machine in `acks` says when).
    pub ack_timer: Option<TimerHandle>,
    /// SENDs waiting for their SENDACK (bounded by `sends_in_flight_per_conn_max`).
    pub sends_in_flight: u32,
    /// How fast this connection may start sending to new channels.
    pub new_channels: domain::new_channels::NewChannelGate,
}

/// One shard's state.
pub struct NodeShard {
    pub(crate) me: ShardId,
    pub(crate) shared: Arc<NodeShared>,
    pub(crate) metrics: Arc<super::metrics::ShardMetrics>,
    /// This shard's stage latency histograms.
    pub(crate) stages: Arc<super::metrics::StageHistograms>,
    /// Push batches queued this turn, waiting for the poll that writes them
    /// (bounded by `send::WRITE_MARKS_MAX`).
    pub(crate) write_marks_ns: Vec<u64>,
    pub(crate) view: ClusterView,
    pub(crate) registry: Registry,
    pub(crate) authority: Authority,
    pub(crate) reader: AuthorityReader,
    /// Connections by `ConnId::index`.
    pub(crate) conns: Vec<Option<Conn>>,
    /// This shard's sessions (pending and active) → their connection.
    pub(crate) session_conns: HashMap<SessionId, ConnId>,
    activations: HashMap<ActivationId, (Activation, ConnId)>,
    /// Replies of authority calls served on this shard itself, fed back in order.
    local_events: VecDeque<(ActivationId, Event)>,
    next_activation: u64,
    next_session: u64,
    /// Server key pairs and salts: a CSPRNG seeded from the OS.
    rng: StdRng,
    /// One frame copied out of the driver's input while it is handled.
    rx_frame: Vec<u8>,
    outputs: Vec<Output>,
    /// Scratch buffer for encoding frames.
    pub(crate) frame_buf: Vec<u8>,
    pub(crate) delivery: DeliveryCore,
    /// Per delivery shard: this gateway's SENDs in flight there (bounded by
    /// `commit_credits_per_peer`; each returns with its SENDACK).
    pub(crate) commit_credits: Vec<usize>,
    /// What this shard's pending-ACK entries are charged (bounded by
    /// `pending_acks_budget_bytes_per_shard`; see `send::PendingAcks`).
    pub(crate) pending_ack_bytes: usize,
    /// RECVs an ack timeout re-sends (reused).
    pub(crate) ack_resend_buf: Vec<Arc<super::send::Committed>>,
    stopping: bool,
}

impl NodeShard {
    /// A shard of the node described by `shared`.
    pub fn new(
        me: ShardId,
        shared: Arc<NodeShared>,
        delivery: DeliveryCore,
    ) -> std::io::Result<NodeShard> {
        let cfg = &shared.config;
        let view = shared.initial_view.clone();
        let rcfg = crate::registry::RegistryConfig::with_limits(
            me,
            cfg.node_id,
            shared.boot_id,
            cfg.session.max_sessions_per_shard,
            &cfg.registry,
        );
        let registry = Registry::new(rcfg)
            .map_err(|e| std::io::Error::other(format!("registry config: {e:?}")))?;
        let my_slots: Vec<_> = shared.slot_map.slots_of(me).collect();
        let mut authority = Authority::new(cfg.authority.clone(), &shared.directory, &my_slots)
            .map_err(|e| std::io::Error::other(format!("authority: {e:?}")))?;
        authority.apply_view(&view, cfg.node_id, 0);
        let reader = authority.reader();
        let commit_credits = vec![0; shared.slot_map.shard_count() as usize];
        Ok(NodeShard {
            commit_credits,
            pending_ack_bytes: 0,
            ack_resend_buf: Vec::new(),
            me,
            rng: StdRng::from_entropy(),
            rx_frame: Vec::new(),
            metrics: shared.shard_metrics[me as usize].clone(),
            stages: shared.stages[me as usize].clone(),
            write_marks_ns: Vec::with_capacity(super::send::WRITE_MARKS_MAX),
            shared,
            view,
            registry,
            authority,
            reader,
            conns: Vec::new(),
            session_conns: HashMap::new(),
            activations: HashMap::new(),
            local_events: VecDeque::new(),
            next_activation: 1,
            next_session: 1,
            outputs: Vec::new(),
            frame_buf: Vec::with_capacity(4096),
            delivery,
            stopping: false,
        })
    }

    pub(crate) fn conn(&self, id: ConnId) -> Option<&Conn> {
        self.conns
            .get(id.index())
            .and_then(|c| c.as_ref())
            .filter(|c| c.id == id)
    }

    /// Records the shard's pending-ACK charge (and its gauge).
    pub(crate) fn set_pending_ack_bytes(&mut self, bytes: usize) {
        self.pending_ack_bytes = bytes;
        self.metrics.pending_ack_bytes.set(bytes as u64);
    }

    pub(crate) fn conn_mut(&mut self, id: ConnId) -> Option<&mut Conn> {
        self.conns
            .get_mut(id.index())
            .and_then(|c| c.as_mut())
            .filter(|c| c.id == id)
    }

    /// Sends `msg` to shard `to`: control on the urgent lane, commits, SENDACKs and
    /// pushes on the data lane. What the ring cannot take waits in the peer's queue.
    /// Commits and SENDACKs are never refused (their number is bounded by the
    /// gateway's credits, which a lost one would leak); pushes are admitted by the
    /// delivery core against the peer's room beyond the reserve. So only control can
    /// meet a full queue (more than `control_room_per_peer` of it while the peer does
    /// not drain): it is counted and logged at a bounded rate, and what it drops has a
    /// timeout behind it (activation, touch, unregister retry).
    pub(crate) fn send_msg(&mut self, cx: &mut Context<Msg, NodeTimer>, to: ShardId, msg: Msg) {
        let sent = match msg {
            // Bounded by the gateway's credits, and holding credits: never refused
            // (a lost one would leak its credit for good).
            Msg::Commit(_) | Msg::SendAck(_) => {
                cx.send_reserved(to, msg);
                Ok(())
            }
            // Admitted by the delivery core against the peer's room.
            Msg::Push { .. } => cx.send_to(to, msg),
            _ => cx.send_urgent(to, msg),
        };
        if sent.is_err() {
            self.metrics.ring_full_drops.inc();
            let n = self.metrics.ring_full_drops.get();
            if n.is_power_of_two() {
                tracing::warn!(
                    from = self.me,
                    to,
                    dropped_total = n,
                    "peer queue full: message dropped"
                );
            }
        }
    }

    // ---------------------------------------------------------------- connections

    fn on_accepted(&mut self, conn: ConnId, listener: ListenerKind) {
        let idx = conn.index();
        if self.conns.len() <= idx {
            self.conns.resize_with(idx + 1, || None);
        }
        self.conns[idx] = Some(Conn {
            id: conn,
            listener,
            state: ConnState::AwaitConnect,
            version: wkproto::LATEST_VERSION,
            connack_server_version: None,
            cipher: None,
            server_key: Box::from(""),
            salt: Box::from(""),
            client_timestamp_ms: 0,
            uid: Uid::from(""),
            session_id: 0,
            handle: None,
            acks: PendingAcks::default(),
            ack_timer: None,
            sends_in_flight: 0,
            new_channels: Default::default(),
        });
        self.metrics.connections.inc();
    }

    /// Decodes and handles every whole frame in the connection's input.
    fn on_readable(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        id: ConnId,
    ) {
        let max = self.shared.config.net.max_frame_bytes;
        loop {
            let Some(conn) = self.conn(id) else { return };
            let (state, version) = (conn.state, conn.version);
            if state == ConnState::Closing {
                let n = driver.input(id).len();
                driver.consume(id, n);
                return;
            }
            let input = driver.input(id);
            if input.is_empty() {
                return;
            }
            if state == ConnState::AwaitConnect {
                match wkproto::decode_connect(input, max) {
                    Ok(None) => return,
                    Ok(Some((connect, used))) => {
                        let connect = OwnedConnect::from(&connect);
                        driver.consume(id, used);
                        self.on_connect(cx, driver, id, connect);
                    }
                    Err(err) => {
                        tracing::info!(?id, %err, "bad first frame: closing");
                        self.metrics.bad_frames.inc();
                        self.close(driver, id);
                        return;
                    }
                }
                continue;
            }
            // Copy one whole frame out of the driver's buffer, so handling it can
            // write to the driver.
            let frame_len = match wkproto::peek_frame_len(input, max) {
                Ok(None) => return,
                Ok(Some(n)) if n <= input.len() => n,
                Ok(Some(_)) => return,
                Err(err) => {
                    tracing::info!(?id, %err, "undecodable frame: closing");
                    self.metrics.bad_frames.inc();
                    self.disconnect(driver, id, ReasonCode(0), "undecodable frame");
                    return;
                }
            };
            let mut frame_bytes = std::mem::take(&mut self.rx_frame);
            frame_bytes.clear();
            frame_bytes.extend_from_slice(&input[..frame_len]);
            driver.consume(id, frame_len);
            let result = match wkproto::decode(&frame_bytes, version, max) {
                Ok(Some((frame, _))) => self.on_frame(cx, driver, id, frame),
                Ok(None) => FrameOutcome::Close(ReasonCode(0), "truncated frame"),
                Err(err) => {
                    tracing::info!(?id, %err, "undecodable frame: closing");
                    self.metrics.bad_frames.inc();
                    FrameOutcome::Close(ReasonCode(0), "undecodable frame")
                }
            };
            self.rx_frame = frame_bytes;
            if let FrameOutcome::Close(reason, text) = result {
                self.disconnect(driver, id, reason, text);
                return;
            }
        }
    }

    fn on_frame(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        id: ConnId,
        frame: Frame<'_>,
    ) -> FrameOutcome {
        let state = self.conn(id).map(|c| c.state);
        match (frame, state) {
            (Frame::Ping, _) => {
                // Rule 33: a PING only marks the session touched; the touch worker batches.
                if let Some(handle) = self.conn(id).and_then(|c| c.handle) {
                    self.registry.mark_touched(handle, cx.now_ms() / 1000);
                }
                let _ = driver.send(id, &[wkproto::PONG_BYTE]);
                FrameOutcome::Continue
            }
            (Frame::Send(p), Some(ConnState::Active)) => {
                self.touch_on_activity(cx, id);
                super::send::on_send(self, cx, driver, id, &p);
                FrameOutcome::Continue
            }
            (Frame::Recvack(p), Some(ConnState::Active)) => {
                self.touch_on_activity(cx, id);
                super::send::on_recvack(self, id, p.message_id);
                FrameOutcome::Continue
            }
            (Frame::Sub(p), Some(ConnState::Active)) => {
                // No subscribable channel type yet: SUBACK 23 NotSupportChannelType.
                let ack = wkproto::SubackPacket {
                    sub_no: p.sub_no,
                    channel_id: p.channel_id,
                    channel_type: p.channel_type,
                    action: p.action,
                    reason_code: ReasonCode(23),
                    ..Default::default()
                };
                self.write_frame(driver, id, |v, out| ack.encode(v, out));
                FrameOutcome::Continue
            }
            (Frame::Disconnect(_), _) => {
                self.close(driver, id);
                FrameOutcome::Continue
            }
            (
                Frame::Send(_) | Frame::Recvack(_) | Frame::Sub(_),
                Some(ConnState::Activating(_)),
            ) => FrameOutcome::Close(ReasonCode(15), "frame before CONNACK"),
            (other, _) => {
                tracing::info!(?id, kind = ?other.packet_type(), "unexpected packet: closing");
                FrameOutcome::Close(ReasonCode(20), "unexpected packet type")
            }
        }
    }

    /// Any client frame is activity for the route (the spec's Liveness section).
    fn touch_on_activity(&mut self, cx: &Context<Msg, NodeTimer>, id: ConnId) {
        if let Some(handle) = self.conn(id).and_then(|c| c.handle) {
            self.registry.mark_touched(handle, cx.now_ms() / 1000);
        }
    }

    /// Encodes one frame with the connection's version and queues it.
    pub(crate) fn write_frame(
        &mut self,
        driver: &mut NetDriver,
        id: ConnId,
        encode: impl FnOnce(u8, &mut Vec<u8>) -> Result<usize, wkproto::EncodeError>,
    ) {
        let Some(version) = self.conn(id).map(|c| c.version) else {
            return;
        };
        self.frame_buf.clear();
        match encode(version, &mut self.frame_buf) {
            Ok(_) => {
                if let Err(err) = driver.send(id, &self.frame_buf) {
                    tracing::debug!(?id, %err, "write to a closed or overflowing connection");
                }
            }
            Err(err) => tracing::warn!(?id, ?err, "frame could not be encoded"),
        }
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
            } else if let ConnState::AwaitConnect = conn.state {
                conn.state = ConnState::Closing;
            }
            // An activating connection stays Activating until `Closed` arrives, so
            // its activation learns of it (rule 30).
        }
        driver.close(id);
    }

    fn on_closed(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        id: ConnId,
        reason: CloseReason,
    ) {
        let Some(conn) = self
            .conns
            .get_mut(id.index())
            .and_then(|c| c.take_if(|c| c.id == id))
        else {
            return;
        };
        self.metrics.connections.dec();
        tracing::debug!(?id, ?reason, uid = %conn.uid, "connection closed");
        if let Some(timer) = conn.ack_timer {
            cx.cancel_timer(timer);
        }
        let mut conn = conn;
        let mut shard_bytes = self.pending_ack_bytes;
        conn.acks.clear(&mut shard_bytes);
        self.set_pending_ack_bytes(shard_bytes);
        match conn.state {
            ConnState::Activating(aid) => {
                self.session_conns.remove(&conn.session_id);
                self.feed_activation(cx, driver, aid, Event::SessionClosed);
            }
            _ => {
                if let Some(handle) = conn.handle {
                    // Rule 32: local removal first, then the queued authority unregister.
                    self.registry.deactivate(handle, cx.now_ms());
                }
                self.session_conns.remove(&conn.session_id);
            }
        }
    }

    // ----------------------------------------------------------------- activation

    fn on_connect(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        id: ConnId,
        c: OwnedConnect,
    ) {
        let shared = self.shared.clone();
        let cfg = &shared.config;
        // One negotiation for the connection's version and the CONNACK's encoding.
        let negotiated = net::wkproto::negotiate(c.version);
        let version = negotiated.version;
        if let Some(conn) = self.conn_mut(id) {
            conn.version = version.max(wkproto::OLDEST_VERSION);
            conn.connack_server_version = negotiated.connack_server_version;
            conn.client_timestamp_ms = c.client_timestamp_ms;
        }
        if version < wkproto::OLDEST_VERSION {
            return self.refuse_connect(
                driver,
                id,
                ReasonCode::PROTOCOL_UPGRADE_REQUIRED,
                "protocol version too old",
            );
        }
        if c.uid.is_empty() {
            return self.refuse_connect(driver, id, ReasonCode::AUTH_FAIL, "empty uid");
        }
        let level = if cfg.token_auth {
            match self.shared.catalog.token(&c.uid, c.device_flag) {
                Some((token, level)) if super::catalog::token_matches(&token, &c.token) => level,
                _ => {
                    return self.refuse_connect(driver, id, ReasonCode::AUTH_FAIL, "token mismatch")
                }
            }
        } else {
            self.shared
                .catalog
                .token(&c.uid, c.device_flag)
                .map_or(cfg.default_device_level, |(_, l)| l)
        };
        if c.client_key.is_empty() {
            return self.refuse_connect(
                driver,
                id,
                ReasonCode::CLIENT_KEY_IS_EMPTY,
                "empty client key",
            );
        }
        let seed: [u8; 32] = self.rng.gen();
        let salt: [u8; 16] = self.rng.gen();
        let hs = match server_handshake(&c.client_key, seed, salt) {
            Ok(hs) => hs,
            Err(CryptoError::EmptyClientKey) => {
                return self.refuse_connect(
                    driver,
                    id,
                    ReasonCode::CLIENT_KEY_IS_EMPTY,
                    "empty client key",
                )
            }
            Err(err) => {
                tracing::info!(?id, %err, "bad client key");
                return self.refuse_connect(driver, id, ReasonCode::AUTH_FAIL, "bad client key");
            }
        };
        let session_id = session_id(self.me, self.next_session);
        self.next_session += 1;
        let aid = ActivationId(((self.me as u64) << 48) | self.next_activation);
        self.next_activation += 1;
        // The activation's timeout timer first: without it the activation could
        // wait forever, so no timer, no activation (nothing registered yet).
        let now_ms = cx.now_ms();
        let deadline = crate::activation::deadline_ms_for(&cfg.activation, now_ms);
        if cx.set_timer(deadline, NodeTimer::Activation(aid)).is_err() {
            return self.refuse_connect(
                driver,
                id,
                ReasonCode::SYSTEM_ERROR,
                "timer wheel full (runtime.max_timers)",
            );
        }
        let uid = Uid::from(c.uid.as_str());
        let Some(conn) = self.conn_mut(id) else {
            return;
        };
        conn.server_key = hs.server_key().into();
        conn.salt = hs.salt().into();
        conn.cipher = Some(hs.cipher);
        conn.uid = uid.clone();
        conn.session_id = session_id;
        conn.state = ConnState::Activating(aid);
        let listener = match conn.listener {
            ListenerKind::Tcp => Listener::Tcp,
            ListenerKind::WebSocket => Listener::WebSocket,
        };
        self.session_conns.insert(session_id, id);
        let new = NewSession {
            uid,
            device_id: c.device_id.as_str().into(),
            device_flag: c.device_flag,
            device_level: level,
            session_id,
            listener,
            connected_at_ms: self.shared.wall_ms(),
        };
        let mut out = std::mem::take(&mut self.outputs);
        let activation = Activation::start(
            aid,
            &self.shared.config.activation,
            &mut self.registry,
            &self.view,
            new,
            now_ms,
            &mut out,
        );
        if let Some(handle) = activation.handle() {
            if let Some(conn) = self.conn_mut(id) {
                conn.handle = Some(handle);
            }
        }
        debug_assert_eq!(activation.deadline_ms(), deadline);
        self.activations.insert(aid, (activation, id));
        self.run_outputs(cx, driver, aid, &mut out);
        self.outputs = out;
        self.drain_local_events(cx, driver);
    }

    fn refuse_connect(
        &mut self,
        driver: &mut NetDriver,
        id: ConnId,
        reason: ReasonCode,
        why: &str,
    ) {
        tracing::info!(?id, reason = reason.0, why, "CONNECT refused");
        self.metrics.connect_refused.inc();
        self.write_connack(driver, id, reason);
        if let Some(conn) = self.conn_mut(id) {
            conn.state = ConnState::Closing;
        }
        driver.close(id);
    }

    fn write_connack(&mut self, driver: &mut NetDriver, id: ConnId, reason: ReasonCode) {
        let Some(conn) = self.conn(id) else { return };
        let server_version = conn.connack_server_version;
        let time_diff_ms = self.shared.wall_ms() as i64 - conn.client_timestamp_ms;
        let (server_key, salt) = (conn.server_key.clone(), conn.salt.clone());
        let p = ConnackPacket {
            server_version,
            time_diff_ms,
            reason_code: reason,
            server_key: &server_key,
            salt: &salt,
            node_id: self.shared.config.node_id,
            ..Default::default()
        };
        self.write_frame(driver, id, |v, out| p.encode(v, out));
    }

    /// Feeds one event to an activation and carries out what it asks for.
    fn feed_activation(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        aid: ActivationId,
        event: Event,
    ) {
        self.local_events.push_back((aid, event));
        self.drain_local_events(cx, driver);
    }

    fn drain_local_events(&mut self, cx: &mut Context<Msg, NodeTimer>, driver: &mut NetDriver) {
        while let Some((aid, event)) = self.local_events.pop_front() {
            let mut out = std::mem::take(&mut self.outputs);
            let now_ms = cx.now_ms();
            match self.activations.get_mut(&aid) {
                Some((activation, _)) => {
                    activation.handle_event(&mut self.registry, event, now_ms, &mut out)
                }
                None => {
                    // Finished already: only a late Pending register matters (abort it).
                    if let Event::RegisterReply(Ok(crate::route::RegisterOutcome::Pending {
                        token,
                        ..
                    })) = event
                    {
                        let target = self.view.target_for_uid(&token.identity.uid);
                        out.push(Output::SendToAuthority {
                            target,
                            request: AuthorityRequest::Abort { token },
                        });
                    }
                }
            }
            self.run_outputs(cx, driver, aid, &mut out);
            self.outputs = out;
        }
    }

    fn run_outputs(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        aid: ActivationId,
        out: &mut Vec<Output>,
    ) {
        let conn = self.activations.get(&aid).map(|(_, c)| *c);
        for output in out.drain(..) {
            match output {
                Output::SendToAuthority { target, request } => {
                    self.call_authority(cx, Corr::Activation(aid), target, request);
                }
                Output::PerformOwnerAction { index, action } => {
                    self.request_owner_action(cx, driver, aid, index, action);
                }
                Output::SendConnack { reason } => {
                    let Some(id) = conn else { continue };
                    self.write_connack(driver, id, reason);
                    if reason == ReasonCode::SUCCESS {
                        // Authenticated: only the idle timer applies from now on.
                        driver.mark_established(id);
                        if let Some(c) = self.conn_mut(id) {
                            c.state = ConnState::Active;
                            c.server_key = Box::from("");
                            c.salt = Box::from("");
                        }
                        self.metrics.activations.inc();
                    } else {
                        self.metrics.connect_refused.inc();
                    }
                }
                Output::CloseConnection => {
                    if let Some(id) = conn {
                        if let Some(c) = self.conn_mut(id) {
                            c.state = ConnState::Closing;
                            c.handle = None;
                        }
                        driver.close(id);
                    }
                }
            }
        }
        if let Some((activation, id)) = self.activations.get(&aid) {
            if activation.is_finished() {
                let (id, failed) = (
                    *id,
                    !matches!(activation.outcome(), Some(activation::Outcome::Active(_))),
                );
                self.activations.remove(&aid);
                if failed {
                    if let Some(c) = self.conn(id) {
                        let sid = c.session_id;
                        self.session_conns.remove(&sid);
                    }
                }
            }
        }
    }

    /// Sends an authority call to the shard that leads `target`'s hash slot (or
    /// serves it here).
    fn call_authority(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        corr: Corr,
        target: Target,
        request: AuthorityRequest,
    ) {
        if target.leader_node_id != self.shared.config.node_id {
            // Remote authorities come with the cluster; until then this node's view
            // only names itself, and anything else is answered as not-leader.
            let reply = reply_error(&request, crate::route::AuthorityError::NotLeader);
            return self.on_authority_reply(cx, corr, reply);
        }
        let to = self.shared.slot_map.shard_of(target.hash_slot);
        if to == self.me {
            let reply = self.serve_authority(cx.now_ms() / 1000, &target, request);
            self.on_authority_reply(cx, corr, reply);
        } else {
            self.send_msg(
                cx,
                to,
                Msg::Authority {
                    reply_to: self.me,
                    corr,
                    target,
                    request,
                },
            );
        }
    }

    /// The authority side: one call on this shard's directory.
    pub(crate) fn serve_authority(
        &mut self,
        now_s: u64,
        target: &Target,
        request: AuthorityRequest,
    ) -> AuthorityReply {
        let reply = self.serve_authority_inner(now_s, target, request);
        use crate::route::AuthorityError::{NotLeader, StaleTarget};
        if matches!(
            reply,
            AuthorityReply::Register(Err(NotLeader | StaleTarget))
                | AuthorityReply::Commit(Err(NotLeader | StaleTarget))
                | AuthorityReply::Abort(Err(NotLeader | StaleTarget))
                | AuthorityReply::Unregister(Err(NotLeader | StaleTarget))
        ) {
            self.metrics.authority_stale_refusals.inc();
        }
        reply
    }

    fn serve_authority_inner(
        &mut self,
        now_s: u64,
        target: &Target,
        request: AuthorityRequest,
    ) -> AuthorityReply {
        let a = &mut self.authority;
        match request {
            AuthorityRequest::Register { route } => {
                AuthorityReply::Register(a.register_route(target, route, now_s))
            }
            AuthorityRequest::Commit { token } => {
                AuthorityReply::Commit(a.commit_route(target, &token, now_s))
            }
            AuthorityRequest::Abort { token } => {
                AuthorityReply::Abort(a.abort_route(target, &token, now_s))
            }
            AuthorityRequest::Unregister {
                identity,
                owner_seq,
            } => AuthorityReply::Unregister(
                a.unregister_route(target, &identity, owner_seq, now_s)
                    .map(|_| ()),
            ),
        }
    }

    fn on_authority_reply(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        corr: Corr,
        reply: AuthorityReply,
    ) {
        match corr {
            Corr::Activation(aid) => {
                let event = match reply {
                    AuthorityReply::Register(r) => Event::RegisterReply(r),
                    AuthorityReply::Commit(r) => Event::CommitReply(r),
                    AuthorityReply::Abort(r) => Event::AbortReply(r),
                    AuthorityReply::Unregister(_) => return,
                };
                self.local_events.push_back((aid, event));
            }
            Corr::Unregister(request) => {
                if let AuthorityReply::Unregister(Err(err)) = reply {
                    tracing::debug!(%err, uid = %request.identity.uid, "authority unregister failed; retrying later");
                    self.registry.unregister_failed(*request, cx.now_ms());
                }
            }
        }
    }

    /// Routes an owner action to the shard that owns the old session.
    fn request_owner_action(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        aid: ActivationId,
        index: u32,
        action: OwnerAction,
    ) {
        let local_process = action.route.node_id == self.shared.config.node_id
            && action.route.boot_id == self.shared.boot_id;
        if !local_process {
            // The owner is an earlier process of this node (its connections died with
            // it) or another node (the cluster milestone): nothing here to close.
            self.local_events.push_back((
                aid,
                Event::OwnerActionDone {
                    index,
                    result: Ok(()),
                },
            ));
            return;
        }
        let owner = session_shard(action.route.session_id);
        if owner == self.me {
            self.perform_owner_action(cx, driver, &action);
            self.local_events.push_back((
                aid,
                Event::OwnerActionDone {
                    index,
                    result: Ok(()),
                },
            ));
        } else {
            self.send_msg(
                cx,
                owner,
                Msg::OwnerAction {
                    reply_to: self.me,
                    activation: aid,
                    index,
                    action,
                },
            );
        }
    }

    /// Kicks (DISCONNECT 12, then close) or closes one of this shard's sessions.
    /// A session that is already gone counts as done.
    pub(crate) fn perform_owner_action(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        action: &OwnerAction,
    ) {
        let Some(&id) = self.session_conns.get(&action.route.session_id) else {
            return;
        };
        if let Some(handle) = self.conn(id).and_then(|c| c.handle) {
            // Local removal first (rule 32): delivery stops seeing it now.
            self.registry.deactivate(handle, cx.now_ms());
        }
        self.session_conns.remove(&action.route.session_id);
        if let Some(c) = self.conn_mut(id) {
            c.handle = None;
        }
        match action.kind {
            OwnerActionKind::KickThenClose => {
                self.disconnect(
                    driver,
                    id,
                    ReasonCode::CONNECT_KICK,
                    "login on another device",
                );
            }
            OwnerActionKind::Close => self.close(driver, id),
        }
        self.metrics.kicks.inc();
    }

    // ------------------------------------------------------- touch, unregister, expiry

    fn flush_touches(&mut self, cx: &mut Context<Msg, NodeTimer>) {
        let shared = self.shared.clone();
        let cfg = &shared.config.session;
        let batches = self
            .registry
            .drain_touches(&self.view, cfg.touch_batch_max_routes);
        for (target, routes) in batches {
            self.metrics.touches.add(routes.len() as u64);
            let to = self.shared.slot_map.shard_of(target.hash_slot);
            if to == self.me {
                let failed = self.serve_touch(cx.now_ms() / 1000, &target, routes);
                self.registry.touch_failed(target, &failed);
            } else {
                self.send_msg(
                    cx,
                    to,
                    Msg::Touch {
                        reply_to: self.me,
                        target,
                        routes,
                    },
                );
            }
        }
        let requests =
            self.registry
                .drain_unregisters(&self.view, cx.now_ms(), cfg.unregister_batch_max);
        for request in requests {
            let target = request.target;
            let call = request.request();
            self.call_authority(cx, Corr::Unregister(Box::new(request)), target, call);
        }
    }

    /// The authority side of a touch batch; returns the routes the owner should requeue.
    pub(crate) fn serve_touch(
        &mut self,
        now_s: u64,
        target: &Target,
        routes: Vec<crate::route::Route>,
    ) -> Vec<crate::route::Route> {
        match self.authority.touch_routes(target, &routes, now_s) {
            Ok(results) => routes
                .into_iter()
                .zip(results)
                .filter(|(_, r)| super::msg::touch_failed(r))
                .map(|(route, _)| route)
                .collect(),
            Err(err) => {
                tracing::debug!(%err, "touch batch refused");
                routes
            }
        }
    }

    /// Samples the gauges only this shard can read: routes of its slots, its rings.
    fn publish_gauges(&mut self, cx: &mut Context<Msg, NodeTimer>) {
        let shared = self.shared.clone();
        for slot in shared.slot_map.slots_of(self.me) {
            let n = self.authority.counts(slot).active_routes as u64;
            shared.routes_per_slot[slot as usize].store(n, std::sync::atomic::Ordering::Relaxed);
        }
        let shards = shared.slot_map.shard_count();
        for peer in 0..shards {
            let n = cx.queued_for(peer) as u64;
            let i = self.me as usize * shards as usize + peer as usize;
            shared.ring_occupancy[i].store(n, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Closes this shard's sessions of `uid` (and `device_flag`); returns how many.
    fn device_quit(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        uid: &str,
        flag: Option<u8>,
    ) -> usize {
        let handles: Vec<SessionHandle> = self.registry.sessions_of_uid(uid).collect();
        let mut closed = 0;
        for handle in handles {
            let Some(info) = self.registry.get(handle) else {
                continue;
            };
            if flag.is_some_and(|f| f != info.device_flag) {
                continue;
            }
            let action = OwnerAction {
                kind: OwnerActionKind::KickThenClose,
                route: info.identity(),
                owner_seq: info.owner_seq,
            };
            self.perform_owner_action(cx, driver, &action);
            closed += 1;
        }
        closed
    }

    fn shutdown(&mut self, cx: &mut Context<Msg, NodeTimer>, driver: &mut NetDriver) {
        self.stopping = true;
        let ids: Vec<ConnId> = self.conns.iter().flatten().map(|c| c.id).collect();
        for id in ids {
            if let Some(handle) = self.conn(id).and_then(|c| c.handle) {
                self.registry.deactivate(handle, cx.now_ms());
            }
            self.disconnect(driver, id, ReasonCode(0), "server shutting down");
        }
        self.flush_touches(cx);
    }
}

/// What handling one frame asks of the connection.
enum FrameOutcome {
    Continue,
    Close(ReasonCode, &'static str),
}

/// CONNECT fields copied out of the input buffer.
struct OwnedConnect {
    version: u8,
    device_flag: u8,
    device_id: String,
    uid: String,
    token: String,
    client_timestamp_ms: i64,
    client_key: String,
}

impl From<&ConnectPacket<'_>> for OwnedConnect {
    fn from(c: &ConnectPacket<'_>) -> Self {
        OwnedConnect {
            version: c.version,
            device_flag: c.device_flag.0,
            device_id: c.device_id.to_owned(),
            uid: c.uid.to_owned(),
            token: c.token.to_owned(),
            client_timestamp_ms: c.client_timestamp_ms,
            client_key: c.client_key.to_owned(),
        }
    }
}

fn reply_error(request: &AuthorityRequest, err: crate::route::AuthorityError) -> AuthorityReply {
    match request {
        AuthorityRequest::Register { .. } => AuthorityReply::Register(Err(err)),
        AuthorityRequest::Commit { .. } => AuthorityReply::Commit(Err(err)),
        AuthorityRequest::Abort { .. } => AuthorityReply::Abort(Err(err)),
        AuthorityRequest::Unregister { .. } => AuthorityReply::Unregister(Err(err)),
    }
}

impl Handler for NodeShard {
    type Msg = Msg;
    type Timer = NodeTimer;
    type Driver = NetDriver;

    fn on_start(&mut self, cx: &mut Context<Msg, NodeTimer>, _driver: &mut NetDriver) {
        let s = &self.shared.config.session;
        let _ = cx.set_timer(
            cx.now_ms() + s.touch_flush_interval_ms,
            NodeTimer::TouchFlush,
        );
        let _ = cx.set_timer(cx.now_ms() + s.expiry_interval_ms, NodeTimer::Expiry);
        if let crate::store::FsyncPolicy::IntervalMs(ms) = self.delivery.core.log().config().fsync {
            let _ = cx.set_timer(cx.now_ms() + ms.max(1), NodeTimer::LogSync);
        }
        self.shared.shard_started();
    }

    fn on_message(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        from: ShardId,
        msg: Msg,
    ) {
        match msg {
            Msg::Authority {
                reply_to,
                corr,
                target,
                request,
            } => {
                let reply = self.serve_authority(cx.now_ms() / 1000, &target, request);
                self.send_msg(cx, reply_to, Msg::AuthorityReply { corr, reply });
            }
            Msg::AuthorityReply { corr, reply } => {
                self.on_authority_reply(cx, corr, reply);
                self.drain_local_events(cx, driver);
            }
            Msg::Touch {
                reply_to,
                target,
                routes,
            } => {
                let failed = self.serve_touch(cx.now_ms() / 1000, &target, routes);
                if !failed.is_empty() {
                    self.send_msg(cx, reply_to, Msg::TouchReply { target, failed });
                }
            }
            Msg::TouchReply { target, failed } => self.registry.touch_failed(target, &failed),
            Msg::OwnerAction {
                reply_to,
                activation,
                index,
                action,
            } => {
                self.perform_owner_action(cx, driver, &action);
                self.send_msg(
                    cx,
                    reply_to,
                    Msg::OwnerActionDone {
                        activation,
                        index,
                        result: Ok(()),
                    },
                );
            }
            Msg::OwnerActionDone {
                activation,
                index,
                result,
            } => {
                self.feed_activation(
                    cx,
                    driver,
                    activation,
                    Event::OwnerActionDone { index, result },
                );
            }
            Msg::Commit(request) => super::send::on_commit(self, cx, driver, *request),
            Msg::SendAck(ack) => {
                // The SEND's credit towards that delivery shard comes back.
                if let Some(c) = self.commit_credits.get_mut(from as usize) {
                    *c = c.saturating_sub(1);
                }
                super::send::on_sendack(self, driver, ack)
            }
            Msg::Push {
                message,
                endpoints,
                planned_ns,
            } => super::send::on_push(self, cx, driver, &message, &endpoints, planned_ns),
            Msg::DeviceQuit {
                uid,
                device_flag,
                done,
            } => {
                let n = self.device_quit(cx, driver, &uid, device_flag);
                let _ = done.try_send(n);
            }
            Msg::MessageSync(request) => super::send::on_message_sync(self, *request),
            Msg::View(view) => {
                // Slots this node gained get a fresh identity, lost ones drop their
                // state; touches drained from now on go to the new targets.
                self.authority
                    .apply_view(&view, self.shared.config.node_id, cx.now_ms() / 1000);
                self.view = (*view).clone();
            }
            Msg::LogSynced => {}
            Msg::Shutdown => self.shutdown(cx, driver),
            Msg::InjectPanic => panic!("injected fault"),
        }
    }

    fn on_timer(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        _handle: TimerHandle,
        timer: NodeTimer,
    ) {
        let s = self.shared.config.session.clone();
        match timer {
            NodeTimer::Activation(aid) => self.feed_activation(cx, driver, aid, Event::Tick),
            NodeTimer::TouchFlush => {
                self.flush_touches(cx);
                self.drain_local_events(cx, driver);
                let _ = cx.set_timer(
                    cx.now_ms() + s.touch_flush_interval_ms,
                    NodeTimer::TouchFlush,
                );
            }
            NodeTimer::Expiry => {
                let expired = self.authority.expire(cx.now_ms() / 1000);
                self.metrics.expiries.add(expired as u64);
                self.publish_gauges(cx);
                let _ = cx.set_timer(cx.now_ms() + s.expiry_interval_ms, NodeTimer::Expiry);
            }
            NodeTimer::LogSync => {
                super::send::on_log_sync_timer(self);
                if let crate::store::FsyncPolicy::IntervalMs(ms) =
                    self.delivery.core.log().config().fsync
                {
                    let _ = cx.set_timer(cx.now_ms() + ms.max(1), NodeTimer::LogSync);
                }
            }
            NodeTimer::Ack { conn } => super::send::on_ack_timeout(self, cx, driver, conn),
        }
    }

    fn on_io(&mut self, cx: &mut Context<Msg, NodeTimer>, driver: &mut NetDriver, event: NetEvent) {
        match event {
            NetEvent::Accepted { conn, listener, .. } => {
                if self.stopping {
                    driver.close(conn);
                } else {
                    self.on_accepted(conn, listener);
                }
            }
            NetEvent::Readable { conn } => self.on_readable(cx, driver, conn),
            NetEvent::Closed { conn, reason } => self.on_closed(cx, driver, conn, reason),
        }
    }

    fn on_turn(&mut self, cx: &mut Context<Msg, NodeTimer>, driver: &mut NetDriver) -> usize {
        self.metrics.record_net(&driver.stats());
        // This turn's driver poll has handed earlier RECVs to the kernel.
        super::send::observe_socket_writes(self);
        // Group commit: everything appended this turn is synced once, then acknowledged
        // and queued for delivery; then deliveries go on where peers have room.
        super::send::flush_commits(self, cx, driver)
            + super::send::pump_deliveries(self, cx, driver)
    }

    fn on_stop(&mut self, cx: &mut Context<Msg, NodeTimer>, driver: &mut NetDriver) {
        if !self.stopping {
            self.shutdown(cx, driver);
        }
        // A graceful stop makes everything appended durable, whatever the fsync
        // policy, and answers what waited for it.
        super::send::flush_commits_for_stop(self, cx, driver);
        super::send::pump_deliveries(self, cx, driver);
        // Flush queued output (DISCONNECTs) before the sockets go.
        let _ =
            shard::runtime::Driver::poll(driver, Some(std::time::Duration::ZERO), &mut Vec::new());
    }
}
