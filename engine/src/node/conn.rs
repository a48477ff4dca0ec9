//! One client connection of a shard, as the connection table holds it: where it is
//! in its life ([`ConnState`]) and what it carries ([`Conn`]: its protocol version
//! and cipher, its session, its unacknowledged RECVs, its SEND credits), and the
//! table of them ([`ConnTable`]). What each frame does is `conns.rs`'s.

use std::collections::HashMap;
use std::sync::Arc;

use net::io::{ConnId, Transport};
use proto::crypto::SessionCipher;
use proto::jsonrpc::JsonRpc;
use wheel::TimerHandle;

use domain::presence::authority::FxBuildHasher;
use domain::presence::connection::ConnPhase;
use domain::send::commit::Committed;

use crate::activation::ActivationId;
use crate::registry::SessionHandle;
use crate::route::{SessionId, Uid};

/// The unacknowledged RECVs of one session (`domain::send::acks`).
pub type PendingAcks = domain::send::acks::PendingAcks<Arc<Committed>>;

/// Where a connection is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ConnState {
    /// Accepted; waiting for CONNECT.
    AwaitConnect,
    /// CONNECT received; its token is being checked at the uid's home node.
    Authenticating,
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
    pub listener: Transport,
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
    /// When its CONNECT was decoded (`NodeShared::mono_ns`), until CONNACK: the start
    /// of the connect stage; 0 otherwise.
    pub connect_ns: u64,
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
    pub new_channels: domain::send::new_channels::NewChannelGate,
    /// The JSON-RPC codec of a WebSocket connection whose first message was text;
    /// `None`: binary wkproto.
    pub jsonrpc: Option<Box<JsonRpc>>,
}

impl ConnState {
    /// The phase the frame table ([`domain::presence::connection::on_frame`]) decides by.
    pub(crate) fn phase(self) -> ConnPhase {
        match self {
            ConnState::AwaitConnect => ConnPhase::AwaitConnect,
            ConnState::Authenticating => ConnPhase::Authenticating,
            ConnState::Activating(_) => ConnPhase::Activating,
            ConnState::Active => ConnPhase::Active,
            ConnState::Closing => ConnPhase::Closing,
        }
    }
}

impl Conn {
    /// Whether the connection speaks JSON-RPC (plaintext payloads, text messages).
    pub fn is_jsonrpc(&self) -> bool {
        self.jsonrpc.is_some()
    }
}

/// A shard's connections: by [`ConnId::index`] (the driver's slot, reused after a
/// close, so an entry is checked against the whole id), and its sessions (pending
/// and active) to their connection. Bounded by the driver's connection cap (`[net]
/// connections_per_shard_max`): an entry exists only for a connection it accepted.
#[derive(Default)]
pub(crate) struct ConnTable {
    by_index: Vec<Option<Conn>>,
    /// Node-assigned session ids, so the fast unkeyed hasher (looked up once per
    /// RECV).
    by_session: HashMap<SessionId, ConnId, FxBuildHasher>,
}

impl ConnTable {
    /// Connection `id`, if it is still the one in its slot.
    pub(crate) fn get(&self, id: ConnId) -> Option<&Conn> {
        self.by_index
            .get(id.index())
            .and_then(Option::as_ref)
            .filter(|c| c.id == id)
    }

    pub(crate) fn get_mut(&mut self, id: ConnId) -> Option<&mut Conn> {
        self.by_index
            .get_mut(id.index())
            .and_then(Option::as_mut)
            .filter(|c| c.id == id)
    }

    /// A new connection, in the slot of its id (a closed one's place).
    pub(crate) fn insert(&mut self, conn: Conn) {
        let idx = conn.id.index();
        if self.by_index.len() <= idx {
            self.by_index.resize_with(idx + 1, || None);
        }
        self.by_index[idx] = Some(conn);
    }

    /// Takes connection `id` out of the table (its session stays bound until
    /// [`Self::unbind_session`]).
    pub(crate) fn take(&mut self, id: ConnId) -> Option<Conn> {
        self.by_index
            .get_mut(id.index())
            .and_then(|c| c.take_if(|c| c.id == id))
    }

    /// Every connection.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Conn> {
        self.by_index.iter().flatten()
    }

    /// The connection of session `session_id`.
    pub(crate) fn of_session(&self, session_id: SessionId) -> Option<ConnId> {
        self.by_session.get(&session_id).copied()
    }

    pub(crate) fn bind_session(&mut self, session_id: SessionId, id: ConnId) {
        self.by_session.insert(session_id, id);
    }

    pub(crate) fn unbind_session(&mut self, session_id: SessionId) {
        self.by_session.remove(&session_id);
    }
}
