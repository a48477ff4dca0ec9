//! One client connection of a shard, as the connection table holds it: where it is
//! in its life ([`ConnState`]) and what it carries ([`Conn`]: its protocol version
//! and cipher, its session, its unacknowledged RECVs, its SEND credits). The table
//! and its frames are `conns.rs`'s.

use std::sync::Arc;

use net::io::{ConnId, Transport};
use proto::crypto::SessionCipher;
use proto::jsonrpc::JsonRpc;
use wheel::TimerHandle;

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
