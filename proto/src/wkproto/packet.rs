//! Packet structs (borrowed: every string and payload field points into the
//! receive buffer or into caller-owned data) and the [`Frame`] enum.
//!
//! Version-dependent and setting-dependent fields are plain fields with a
//! neutral default; the codec writes them only when the version/setting says
//! they are on the wire and decodes them as the default (`0`, `""`)
//! otherwise. The predicates below are the single source of truth for that.

use super::types::{ChannelType, DeviceFlag, Flags, PacketType, ReasonCode, Setting};

/// `expire_s` (SEND, RECV) is on the wire from version 3 on.
#[inline]
pub const fn has_expire(version: u8) -> bool {
    version >= 3
}

/// The stream fields (SEND `stream_no`; RECV `stream_flag`, `stream_no`,
/// `stream_id`) are on the wire for versions 2..=4 when the setting has
/// [`Setting::STREAM`].
#[inline]
pub const fn has_stream(version: u8, setting: Setting) -> bool {
    version >= 2 && version < 5 && setting.contains(Setting::STREAM)
}

/// `topic` (SEND, RECV) is on the wire when the setting has
/// [`Setting::TOPIC`].
#[inline]
pub const fn has_topic(setting: Setting) -> bool {
    setting.contains(Setting::TOPIC)
}

/// `message_seq` (SENDACK, RECV, RECVACK) is a u64 from version 6 on, a u32
/// before.
#[inline]
pub const fn message_seq_is_u64(version: u8) -> bool {
    version >= 6
}

/// CONNACK `node_id` is on the wire from version 4 on (the version being
/// the CONNACK's `server_version` when present, else the connection's).
#[inline]
pub const fn has_node_id(version: u8) -> bool {
    version >= 4
}

/// CONNECT: the first frame a client sends. Its body does not depend on the
/// negotiated version (it carries the client's version).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnectPacket<'a> {
    /// Header flags (normally none).
    pub flags: Flags,
    /// Client protocol version (0 = "latest").
    pub version: u8,
    /// Device kind.
    pub device_flag: DeviceFlag,
    /// Client-chosen device id.
    pub device_id: &'a str,
    /// User id.
    pub uid: &'a str,
    /// Token to check.
    pub token: &'a str,
    /// Client clock, unix milliseconds.
    pub client_timestamp_ms: i64,
    /// Base64 of the client's 32-byte X25519 public key (may be empty).
    pub client_key: &'a str,
}

/// CONNACK: the server's answer to CONNECT.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnackPacket<'a> {
    /// Header flags other than HasServerVersion (that bit is derived from
    /// `server_version`; the decoder clears it here).
    pub flags: Flags,
    /// Negotiated version, on the wire (and HasServerVersion set) iff `Some`.
    pub server_version: Option<u8>,
    /// Server clock minus the CONNECT's `client_timestamp_ms`.
    pub time_diff_ms: i64,
    /// 1 = success.
    pub reason_code: ReasonCode,
    /// Base64 of the server's X25519 public key.
    pub server_key: &'a str,
    /// 16 alphanumeric characters: the AES IV of the connection.
    pub salt: &'a str,
    /// Serving node; on the wire iff [`has_node_id`] of the effective version.
    pub node_id: u64,
}

/// SEND: a message from the client.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendPacket<'a> {
    /// Header flags (DUP, SyncOnce, RedDot, NoPersist).
    pub flags: Flags,
    /// Setting bits.
    pub setting: Setting,
    /// Client sequence number, echoed in SENDACK.
    pub client_seq: u32,
    /// Client message number (idempotency key).
    pub client_msg_no: &'a str,
    /// Only on the wire when [`has_stream`]; decoded as `""` otherwise.
    pub stream_no: &'a str,
    /// Target channel (a peer uid for person channels).
    pub channel_id: &'a str,
    /// Target channel type.
    pub channel_type: ChannelType,
    /// Only on the wire when [`has_expire`]; decoded as 0 otherwise.
    pub expire_s: u32,
    /// Hex MD5 message key (empty or ignored with NoEncrypt).
    pub msg_key: &'a str,
    /// Only on the wire when [`has_topic`]; decoded as `""` otherwise.
    pub topic: &'a str,
    /// The rest of the body: base64 ciphertext, or plaintext with NoEncrypt.
    pub payload: &'a [u8],
}

/// SENDACK: the server's answer to SEND.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendackPacket {
    /// Header flags (normally none).
    pub flags: Flags,
    /// Server-assigned message id.
    pub message_id: i64,
    /// The SEND's `client_seq`.
    pub client_seq: u32,
    /// Channel sequence number; u32 on the wire before version 6.
    pub message_seq: u64,
    /// 1 = success.
    pub reason_code: ReasonCode,
}

/// RECV: a message delivered to the client. `Copy`, so a fan-out builds
/// each recipient's packet from a shared base with struct-update syntax
/// (`RecvPacket { msg_key, payload, ..base }`), no allocation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecvPacket<'a> {
    /// Header flags (DUP, SyncOnce, RedDot, NoPersist).
    pub flags: Flags,
    /// Setting bits.
    pub setting: Setting,
    /// Hex MD5 message key for this recipient's connection.
    pub msg_key: &'a str,
    /// Sender uid.
    pub from_uid: &'a str,
    /// Channel id as the recipient sees it (the peer for person channels).
    pub channel_id: &'a str,
    /// Channel type.
    pub channel_type: ChannelType,
    /// Only on the wire when [`has_expire`]; decoded as 0 otherwise.
    pub expire_s: u32,
    /// Client message number of the SEND.
    pub client_msg_no: &'a str,
    /// Only on the wire when [`has_stream`]; decoded as 0 otherwise.
    pub stream_flag: u8,
    /// Only on the wire when [`has_stream`]; decoded as `""` otherwise.
    pub stream_no: &'a str,
    /// Only on the wire when [`has_stream`]; decoded as 0 otherwise.
    pub stream_id: u64,
    /// Server-assigned message id.
    pub message_id: i64,
    /// Channel sequence number; u32 on the wire before version 6.
    pub message_seq: u64,
    /// Server time of the message, unix seconds.
    pub timestamp_s: i32,
    /// Only on the wire when [`has_topic`]; decoded as `""` otherwise.
    pub topic: &'a str,
    /// The rest of the body: base64 ciphertext, or plaintext with NoEncrypt.
    pub payload: &'a [u8],
}

/// RECVACK: the client acknowledges a RECV.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecvackPacket {
    /// Header flags (normally none).
    pub flags: Flags,
    /// The RECV's message id.
    pub message_id: i64,
    /// The RECV's message_seq; u32 on the wire before version 6.
    pub message_seq: u64,
}

/// DISCONNECT: either side announces that it closes the connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DisconnectPacket<'a> {
    /// Header flags (normally none).
    pub flags: Flags,
    /// Why (e.g. [`ReasonCode::CONNECT_KICK`]).
    pub reason_code: ReasonCode,
    /// Human-readable reason.
    pub reason: &'a str,
}

/// SUB `action`: subscribe.
pub const SUB_ACTION_SUBSCRIBE: u8 = 0;
/// SUB `action`: unsubscribe.
pub const SUB_ACTION_UNSUBSCRIBE: u8 = 1;

/// SUB: the client subscribes to or unsubscribes from a channel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SubPacket<'a> {
    /// Header flags (normally none).
    pub flags: Flags,
    /// Setting byte (opaque to the codec).
    pub setting: u8,
    /// Client subscription number, echoed in SUBACK.
    pub sub_no: &'a str,
    /// Channel.
    pub channel_id: &'a str,
    /// Channel type.
    pub channel_type: ChannelType,
    /// [`SUB_ACTION_SUBSCRIBE`] or [`SUB_ACTION_UNSUBSCRIBE`] (others pass
    /// through).
    pub action: u8,
    /// Free-form parameter.
    pub param: &'a str,
}

/// SUBACK: the server's answer to SUB.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SubackPacket<'a> {
    /// Header flags (normally none).
    pub flags: Flags,
    /// The SUB's `sub_no`.
    pub sub_no: &'a str,
    /// Channel.
    pub channel_id: &'a str,
    /// Channel type.
    pub channel_type: ChannelType,
    /// The SUB's action.
    pub action: u8,
    /// 1 = success.
    pub reason_code: ReasonCode,
}

/// One decoded frame, borrowing from the buffer it was decoded from.
///
/// PING and PONG carry no flags: the decoder ignores the low nibble of their
/// header byte and the encoder writes exactly `0x70` / `0x80`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frame<'a> {
    /// CONNECT.
    Connect(ConnectPacket<'a>),
    /// CONNACK.
    Connack(ConnackPacket<'a>),
    /// SEND.
    Send(SendPacket<'a>),
    /// SENDACK.
    Sendack(SendackPacket),
    /// RECV.
    Recv(RecvPacket<'a>),
    /// RECVACK.
    Recvack(RecvackPacket),
    /// PING (one byte).
    Ping,
    /// PONG (one byte).
    Pong,
    /// DISCONNECT.
    Disconnect(DisconnectPacket<'a>),
    /// SUB.
    Sub(SubPacket<'a>),
    /// SUBACK.
    Suback(SubackPacket<'a>),
}

impl Frame<'_> {
    /// The frame's packet type.
    pub const fn packet_type(&self) -> PacketType {
        match self {
            Frame::Connect(_) => PacketType::Connect,
            Frame::Connack(_) => PacketType::Connack,
            Frame::Send(_) => PacketType::Send,
            Frame::Sendack(_) => PacketType::Sendack,
            Frame::Recv(_) => PacketType::Recv,
            Frame::Recvack(_) => PacketType::Recvack,
            Frame::Ping => PacketType::Ping,
            Frame::Pong => PacketType::Pong,
            Frame::Disconnect(_) => PacketType::Disconnect,
            Frame::Sub(_) => PacketType::Sub,
            Frame::Suback(_) => PacketType::Suback,
        }
    }
}
