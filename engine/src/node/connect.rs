//! CONNECT admission and the activation driver.
//!
//! Admission ([`NodeShard::on_connect`]) runs in named steps: version negotiation,
//! the token check, the key agreement, the activation's timer; any failure is a
//! CONNACK with its reason, then close. Admitted, the connection's session is
//! activated by the sans-IO [`crate::activation::Activation`]; this file only
//! drives it: it feeds the machine its events ([`NodeShard::feed_activation`],
//! [`NodeShard::drain_local_events`]) and carries out its outputs
//! ([`NodeShard::run_outputs`]: authority calls, owner actions, CONNACK, close).
//!
//! What enters here: a decoded CONNECT (from [`super::conns`]); activation events:
//! the `NodeTimer::Activation` deadline, owner actions' and authority calls' replies
//! (queued by [`super::hops`] and [`super::authority_service`] and drained here), the connection's
//! `Closed` during activation.

use net::io::{ConnId, NetDriver};
use proto::crypto::{server_handshake, CryptoError, ServerHandshake};
use proto::wkproto::{self, ConnackPacket, ReasonCode};
use rand::Rng;
use shard::runtime::Context;

use crate::activation::{self, Activation, ActivationId, AuthorityRequest, Event, Output};
use crate::delivery::session_id;
use crate::registry::NewSession;
use crate::route::{DeviceLevel, SessionId, Uid};

use super::conn::ConnState;
use super::msg::Pending;
use super::msg::{Corr, Msg, OwnedConnect};
use super::shard::{NodeShard, NodeTimer};
use super::wire;
use crate::cluster::NodeId;

/// Why a CONNECT is refused: the CONNACK's reason and the log line's text.
struct Refusal {
    reason: ReasonCode,
    why: &'static str,
}

impl Refusal {
    fn new(reason: ReasonCode, why: &'static str) -> Self {
        Refusal { reason, why }
    }
}

/// An admitted CONNECT's identifiers; its activation's timer is armed.
struct Admitted {
    level: DeviceLevel,
    /// `None`: a JSON-RPC client without a key (its payloads are plaintext).
    handshake: Option<ServerHandshake>,
    session_id: SessionId,
    aid: ActivationId,
    deadline_ms: u64,
}

/// A token against this node's catalog (the uid's home): the device level, or
/// `Err` (mismatch: CONNACK 2). With `token_auth` off, the stored level or the
/// configured default.
pub(super) fn check_token(
    shared: &super::shared::NodeShared,
    uid: &str,
    device_flag: u8,
    token: &str,
) -> Result<DeviceLevel, ()> {
    let stored = shared.catalog.token(uid, device_flag);
    if !shared.config.token_auth {
        return Ok(stored.map_or(shared.config.default_device_level, |(_, l)| l));
    }
    match stored {
        Some((stored, level)) if super::catalog::token_matches(&stored, token) => Ok(level),
        _ => Err(()),
    }
}

impl NodeShard {
    /// Admits a CONNECT and starts its activation, or refuses it with a CONNACK. A
    /// uid homed on another node has its token checked there first (the hop
    /// `TokenLookup`; the connection waits `Authenticating`, bounded by the request's
    /// deadline and the connect timeout), then admission goes on in
    /// [`NodeShard::on_token_checked`].
    pub(super) fn on_connect(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        id: ConnId,
        c: OwnedConnect,
    ) {
        let now_ns = self.shared.mono_ns();
        if let Some(conn) = self.conn_mut(id) {
            conn.connect_ns = now_ns;
        }
        let checked = self.negotiate_version(id, &c).and_then(|()| {
            let home = self.token_home(&c)?;
            match home {
                Some(node) => Ok(Err(node)),
                None => self.authenticate(&c).map(Ok),
            }
        });
        match checked {
            Ok(Ok(level)) => self.admit(cx, driver, id, c, level),
            Ok(Err(home)) => self.check_token_at_home(cx, id, home, c),
            Err(r) => self.refuse_connect(driver, id, r.reason, r.why),
        }
    }

    /// The token was checked (here or at the uid's home): the key agreement, the
    /// activation's timer, the activation.
    fn admit(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        id: ConnId,
        c: OwnedConnect,
        level: DeviceLevel,
    ) {
        let admitted = self
            .agree_key(id, &c)
            .and_then(|handshake| self.arm_activation(cx, level, handshake));
        match admitted {
            Ok(admitted) => self.start_activation(cx, driver, id, c, admitted),
            Err(r) => self.refuse_connect(driver, id, r.reason, r.why),
        }
    }

    /// The node that stores `c.uid`'s tokens when it is another one and the token
    /// must be checked (`token_auth`); an empty uid, or a uid or device id past its
    /// `[session]` limit, is refused here.
    fn token_home(&self, c: &OwnedConnect) -> Result<Option<NodeId>, Refusal> {
        if c.uid.is_empty() {
            return Err(Refusal::new(ReasonCode::AUTH_FAIL, "empty uid"));
        }
        let cfg = &self.shared.config;
        if c.uid.len() > cfg.session.uid_bytes_max {
            return Err(Refusal::new(
                ReasonCode::AUTH_FAIL,
                "uid longer than [session] uid_bytes_max",
            ));
        }
        if c.device_id.len() > cfg.session.device_id_bytes_max {
            return Err(Refusal::new(
                ReasonCode::AUTH_FAIL,
                "device id longer than [session] device_id_bytes_max",
            ));
        }
        let home = self.view.home_node(slots::hash_slot(c.uid.as_bytes()));
        Ok((cfg.token_auth && home != cfg.node_id).then_some(home))
    }

    fn check_token_at_home(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        id: ConnId,
        home: NodeId,
        c: OwnedConnect,
    ) {
        if let Some(conn) = self.conn_mut(id) {
            conn.state = ConnState::Authenticating;
        }
        let request = wire::Request::Token {
            uid: c.uid.clone(),
            device_flag: c.device_flag,
            token: c.token.clone(),
        };
        let pending = Pending::Token {
            conn: id,
            connect: Box::new(c),
        };
        self.request_remote(cx, home, request, pending);
    }

    /// The uid's home answered (`Ok(level)`, or the CONNACK reason: 2 a token
    /// mismatch, 14 the home did not answer). A connection closed meanwhile is
    /// left alone.
    pub(super) fn on_token_checked(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        id: ConnId,
        c: OwnedConnect,
        checked: Result<DeviceLevel, ReasonCode>,
    ) {
        match self.conn_mut(id) {
            Some(conn) if conn.state == ConnState::Authenticating => {
                conn.state = ConnState::AwaitConnect;
            }
            _ => return,
        }
        match checked {
            Ok(level) => self.admit(cx, driver, id, c, level),
            Err(reason) => self.refuse_connect(driver, id, reason, "token check at the uid's home"),
        }
    }

    /// One negotiation for the connection's version and the CONNACK's encoding.
    fn negotiate_version(&mut self, id: ConnId, c: &OwnedConnect) -> Result<(), Refusal> {
        let negotiated = proto::wkproto::negotiate(c.version);
        let version = negotiated.version;
        if let Some(conn) = self.conn_mut(id) {
            conn.version = version.max(wkproto::OLDEST_VERSION);
            conn.connack_server_version = negotiated.connack_server_version;
            conn.client_timestamp_ms = c.client_timestamp_ms;
        }
        if version < wkproto::OLDEST_VERSION {
            return Err(Refusal::new(
                ReasonCode::PROTOCOL_UPGRADE_REQUIRED,
                "protocol version too old",
            ));
        }
        Ok(())
    }

    /// The uid's token (when `token_auth` is on) against this node's catalog; the
    /// device level.
    fn authenticate(&self, c: &OwnedConnect) -> Result<DeviceLevel, Refusal> {
        check_token(&self.shared, &c.uid, c.device_flag, &c.token)
            .map_err(|_| Refusal::new(ReasonCode::AUTH_FAIL, "token mismatch"))
    }

    /// The key agreement: a fresh server key pair and salt against the client's key.
    /// A JSON-RPC client may give none (`None`: its payloads are plaintext, and
    /// CONNACK's `serverKey` and `salt` are empty).
    fn agree_key(
        &mut self,
        id: ConnId,
        c: &OwnedConnect,
    ) -> Result<Option<ServerHandshake>, Refusal> {
        let empty_key = || Refusal::new(ReasonCode::CLIENT_KEY_IS_EMPTY, "empty client key");
        if c.client_key.is_empty() {
            if self.conn(id).is_some_and(|conn| conn.is_jsonrpc()) {
                return Ok(None);
            }
            return Err(empty_key());
        }
        let seed: [u8; 32] = self.rng.gen();
        let salt: [u8; 16] = self.rng.gen();
        match server_handshake(&c.client_key, seed, salt) {
            Ok(hs) => Ok(Some(hs)),
            Err(CryptoError::EmptyClientKey) => Err(empty_key()),
            Err(err) => {
                tracing::info!(?id, %err, "bad client key");
                Err(Refusal::new(ReasonCode::AUTH_FAIL, "bad client key"))
            }
        }
    }

    /// Names the session and its activation and arms the activation's timeout
    /// timer: without it the activation could wait forever, so no timer, no
    /// activation (nothing registered yet).
    fn arm_activation(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        level: DeviceLevel,
        handshake: Option<ServerHandshake>,
    ) -> Result<Admitted, Refusal> {
        let session_id = session_id(self.me, self.next_session);
        self.next_session += 1;
        let aid = ActivationId(((self.me as u64) << 48) | self.next_activation);
        self.next_activation += 1;
        let deadline_ms =
            crate::activation::deadline_ms_for(&self.shared.config.activation, cx.now_ms());
        if cx
            .set_timer(deadline_ms, NodeTimer::Activation(aid))
            .is_err()
        {
            return Err(Refusal::new(
                ReasonCode::SYSTEM_ERROR,
                "timer wheel full (runtime.timers_max)",
            ));
        }
        Ok(Admitted {
            level,
            handshake,
            session_id,
            aid,
            deadline_ms,
        })
    }

    /// Binds the admitted session to its connection and starts its activation.
    fn start_activation(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        id: ConnId,
        c: OwnedConnect,
        a: Admitted,
    ) {
        let uid = Uid::from(c.uid.as_str());
        let Some(conn) = self.conn_mut(id) else {
            return;
        };
        if let Some(handshake) = a.handshake {
            conn.server_key = handshake.server_key().into();
            conn.salt = handshake.salt().into();
            conn.cipher = Some(handshake.cipher);
        }
        conn.uid = uid.clone();
        conn.session_id = a.session_id;
        conn.state = ConnState::Activating(a.aid);
        let listener = conn.listener;
        self.conns.bind_session(a.session_id, id);
        let new = NewSession {
            uid,
            device_id: c.device_id.as_str().into(),
            device_flag: c.device_flag,
            device_level: a.level,
            session_id: a.session_id,
            listener,
            connected_at_ms: self.shared.wall_ms(),
        };
        let mut out = std::mem::take(&mut self.outputs);
        let activation = Activation::start(
            a.aid,
            &self.shared.config.activation,
            &mut self.registry,
            &self.view,
            new,
            cx.now_ms(),
            &mut out,
        );
        if let Some(handle) = activation.handle() {
            if let Some(conn) = self.conn_mut(id) {
                conn.handle = Some(handle);
            }
        }
        debug_assert_eq!(activation.deadline_ms(), a.deadline_ms);
        self.activations.insert(a.aid, (activation, id));
        self.run_outputs(cx, driver, a.aid, &mut out);
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
        let Some(conn) = self.conn_mut(id) else {
            return;
        };
        let started_ns = std::mem::take(&mut conn.connect_ns);
        if started_ns != 0 {
            let waited_ns = self.shared.mono_ns().saturating_sub(started_ns);
            self.stages.connect.observe_ns(waited_ns);
        }
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
    pub(super) fn feed_activation(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        aid: ActivationId,
        event: Event,
    ) {
        self.local_events.push_back((aid, event));
        self.drain_local_events(cx, driver);
    }

    /// Feeds the queued events (authority replies served on this shard, owner
    /// actions done here) to their activations, in order.
    pub(super) fn drain_local_events(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
    ) {
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

    /// Carries out an activation's outputs, then forgets it once it has finished.
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
                    self.send_connack(driver, id, reason);
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
        self.forget_if_finished(aid);
    }

    /// The activation's CONNACK; success makes the session active.
    fn send_connack(&mut self, driver: &mut NetDriver, id: ConnId, reason: ReasonCode) {
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

    /// Drops a finished activation; a failed one's session leaves the table.
    fn forget_if_finished(&mut self, aid: ActivationId) {
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
                        self.conns.unbind_session(sid);
                    }
                }
            }
        }
    }
}
