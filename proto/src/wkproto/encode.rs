//! Encoder: appends whole frames to a caller-owned `Vec<u8>`.
//!
//! Every packet computes (and validates) its body length first, reserves
//! exactly one frame's worth of space, then writes header, varint and body
//! in one pass: no allocation when the vector already has the capacity
//! (the steady state of a reused output buffer), no backpatching. On error
//! nothing has been written.

use super::error::EncodeError;
use super::packet::{
    has_expire, has_node_id, has_stream, has_topic, message_seq_is_u64, ConnackPacket,
    ConnectPacket, DisconnectPacket, Frame, RecvPacket, RecvackPacket, SendPacket, SendackPacket,
    SubPacket, SubackPacket,
};
use super::types::{Flags, PacketType};
use super::{MAX_STRING_BYTES, MAX_VARINT_VALUE};

/// Bytes the varint of `n` takes (0 for `n == 0`: length 0 is written as no
/// bytes at all).
#[inline]
pub const fn varint_len(n: usize) -> usize {
    match n {
        0 => 0,
        1..=0x7f => 1,
        0x80..=0x3fff => 2,
        0x4000..=0x1f_ffff => 3,
        _ => 4,
    }
}

#[inline]
fn put_varint(out: &mut Vec<u8>, mut n: usize) {
    debug_assert!(n <= MAX_VARINT_VALUE);
    while n > 0 {
        let mut b = (n & 0x7f) as u8;
        n >>= 7;
        if n > 0 {
            b |= 0x80;
        }
        out.push(b);
    }
}

/// `2 + s.len()`, or an error when `s` is too long for the i16 length.
#[inline]
fn str_len(packet: PacketType, field: &'static str, s: &str) -> Result<usize, EncodeError> {
    if s.len() > MAX_STRING_BYTES {
        return Err(EncodeError::StringTooLong {
            packet,
            field,
            len_bytes: s.len(),
        });
    }
    Ok(2 + s.len())
}

#[inline]
fn put_str(out: &mut Vec<u8>, s: &str) {
    debug_assert!(s.len() <= MAX_STRING_BYTES);
    out.extend_from_slice(&(s.len() as u16).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

#[inline]
fn seq_len(packet: PacketType, version: u8, message_seq: u64) -> Result<usize, EncodeError> {
    if message_seq_is_u64(version) {
        Ok(8)
    } else if message_seq > u64::from(u32::MAX) {
        Err(EncodeError::MessageSeqTooLarge {
            packet,
            message_seq,
            version,
        })
    } else {
        Ok(4)
    }
}

#[inline]
fn put_seq(out: &mut Vec<u8>, version: u8, message_seq: u64) {
    if message_seq_is_u64(version) {
        out.extend_from_slice(&message_seq.to_be_bytes());
    } else {
        out.extend_from_slice(&(message_seq as u32).to_be_bytes());
    }
}

/// One packet's body layout.
trait Body {
    const KIND: PacketType;
    /// Low nibble of the fixed header.
    fn header_flags(&self) -> Flags;
    /// Validated body length.
    fn body_len(&self, version: u8) -> Result<usize, EncodeError>;
    /// Writes exactly `body_len(version)` bytes (already validated).
    fn write_body(&self, version: u8, out: &mut Vec<u8>);
}

#[inline]
fn frame_len<B: Body>(b: &B, version: u8) -> Result<(usize, usize), EncodeError> {
    let body = b.body_len(version)?;
    if body > MAX_VARINT_VALUE {
        return Err(EncodeError::FrameTooLarge {
            packet: B::KIND,
            len_bytes: body,
        });
    }
    Ok((body, 1 + varint_len(body) + body))
}

#[inline]
fn encode_body<B: Body>(b: &B, version: u8, out: &mut Vec<u8>) -> Result<usize, EncodeError> {
    let (body, total) = frame_len(b, version)?;
    out.reserve(total);
    let start = out.len();
    out.push((B::KIND.as_u8() << 4) | (b.header_flags().0 & Flags::MASK));
    put_varint(out, body);
    b.write_body(version, out);
    debug_assert_eq!(out.len() - start, total, "{} body length mismatch", B::KIND);
    Ok(total)
}

macro_rules! encode_methods {
    ($ty:ty) => {
        impl $ty {
            /// Appends this packet as one frame for a connection speaking
            /// `version`; returns the bytes appended. On error `out` is
            /// unchanged.
            #[inline]
            pub fn encode(&self, version: u8, out: &mut Vec<u8>) -> Result<usize, EncodeError> {
                encode_body(self, version, out)
            }

            /// Length of the whole frame [`encode`](Self::encode) would
            /// append (header + varint + body).
            #[inline]
            pub fn encoded_len(&self, version: u8) -> Result<usize, EncodeError> {
                Ok(frame_len(self, version)?.1)
            }
        }
    };
}

impl Body for ConnectPacket<'_> {
    const KIND: PacketType = PacketType::Connect;
    fn header_flags(&self) -> Flags {
        self.flags
    }
    fn body_len(&self, _version: u8) -> Result<usize, EncodeError> {
        let k = Self::KIND;
        Ok(1 + 1
            + str_len(k, "device_id", self.device_id)?
            + str_len(k, "uid", self.uid)?
            + str_len(k, "token", self.token)?
            + 8
            + str_len(k, "client_key", self.client_key)?)
    }
    fn write_body(&self, _version: u8, out: &mut Vec<u8>) {
        out.push(self.version);
        out.push(self.device_flag.0);
        put_str(out, self.device_id);
        put_str(out, self.uid);
        put_str(out, self.token);
        out.extend_from_slice(&self.client_timestamp_ms.to_be_bytes());
        put_str(out, self.client_key);
    }
}
encode_methods!(ConnectPacket<'_>);

impl Body for ConnackPacket<'_> {
    const KIND: PacketType = PacketType::Connack;
    fn header_flags(&self) -> Flags {
        let f = self.flags.without(Flags::HAS_SERVER_VERSION);
        if self.server_version.is_some() {
            f.with(Flags::HAS_SERVER_VERSION)
        } else {
            f
        }
    }
    fn body_len(&self, version: u8) -> Result<usize, EncodeError> {
        let k = Self::KIND;
        let effective = self.server_version.unwrap_or(version);
        Ok(usize::from(self.server_version.is_some())
            + 8
            + 1
            + str_len(k, "server_key", self.server_key)?
            + str_len(k, "salt", self.salt)?
            + if has_node_id(effective) { 8 } else { 0 })
    }
    fn write_body(&self, version: u8, out: &mut Vec<u8>) {
        if let Some(v) = self.server_version {
            out.push(v);
        }
        out.extend_from_slice(&self.time_diff_ms.to_be_bytes());
        out.push(self.reason_code.0);
        put_str(out, self.server_key);
        put_str(out, self.salt);
        if has_node_id(self.server_version.unwrap_or(version)) {
            out.extend_from_slice(&self.node_id.to_be_bytes());
        }
    }
}
encode_methods!(ConnackPacket<'_>);

impl Body for SendPacket<'_> {
    const KIND: PacketType = PacketType::Send;
    fn header_flags(&self) -> Flags {
        self.flags
    }
    fn body_len(&self, version: u8) -> Result<usize, EncodeError> {
        let k = Self::KIND;
        let mut n = 1 + 4 + str_len(k, "client_msg_no", self.client_msg_no)?;
        if has_stream(version, self.setting) {
            n += str_len(k, "stream_no", self.stream_no)?;
        }
        n += str_len(k, "channel_id", self.channel_id)? + 1;
        if has_expire(version) {
            n += 4;
        }
        n += str_len(k, "msg_key", self.msg_key)?;
        if has_topic(self.setting) {
            n += str_len(k, "topic", self.topic)?;
        }
        Ok(n + self.payload.len())
    }
    fn write_body(&self, version: u8, out: &mut Vec<u8>) {
        out.push(self.setting.0);
        out.extend_from_slice(&self.client_seq.to_be_bytes());
        put_str(out, self.client_msg_no);
        if has_stream(version, self.setting) {
            put_str(out, self.stream_no);
        }
        put_str(out, self.channel_id);
        out.push(self.channel_type.0);
        if has_expire(version) {
            out.extend_from_slice(&self.expire_s.to_be_bytes());
        }
        put_str(out, self.msg_key);
        if has_topic(self.setting) {
            put_str(out, self.topic);
        }
        out.extend_from_slice(self.payload);
    }
}
encode_methods!(SendPacket<'_>);

impl Body for SendackPacket {
    const KIND: PacketType = PacketType::Sendack;
    fn header_flags(&self) -> Flags {
        self.flags
    }
    fn body_len(&self, version: u8) -> Result<usize, EncodeError> {
        Ok(8 + 4 + seq_len(Self::KIND, version, self.message_seq)? + 1)
    }
    fn write_body(&self, version: u8, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.message_id.to_be_bytes());
        out.extend_from_slice(&self.client_seq.to_be_bytes());
        put_seq(out, version, self.message_seq);
        out.push(self.reason_code.0);
    }
}
encode_methods!(SendackPacket);

impl Body for RecvPacket<'_> {
    const KIND: PacketType = PacketType::Recv;
    fn header_flags(&self) -> Flags {
        self.flags
    }
    fn body_len(&self, version: u8) -> Result<usize, EncodeError> {
        let k = Self::KIND;
        let mut n = 1
            + str_len(k, "msg_key", self.msg_key)?
            + str_len(k, "from_uid", self.from_uid)?
            + str_len(k, "channel_id", self.channel_id)?
            + 1;
        if has_expire(version) {
            n += 4;
        }
        n += str_len(k, "client_msg_no", self.client_msg_no)?;
        if has_stream(version, self.setting) {
            n += 1 + str_len(k, "stream_no", self.stream_no)? + 8;
        }
        n += 8 + seq_len(k, version, self.message_seq)? + 4;
        if has_topic(self.setting) {
            n += str_len(k, "topic", self.topic)?;
        }
        Ok(n + self.payload.len())
    }
    fn write_body(&self, version: u8, out: &mut Vec<u8>) {
        out.push(self.setting.0);
        put_str(out, self.msg_key);
        put_str(out, self.from_uid);
        put_str(out, self.channel_id);
        out.push(self.channel_type.0);
        if has_expire(version) {
            out.extend_from_slice(&self.expire_s.to_be_bytes());
        }
        put_str(out, self.client_msg_no);
        if has_stream(version, self.setting) {
            out.push(self.stream_flag);
            put_str(out, self.stream_no);
            out.extend_from_slice(&self.stream_id.to_be_bytes());
        }
        out.extend_from_slice(&self.message_id.to_be_bytes());
        put_seq(out, version, self.message_seq);
        out.extend_from_slice(&self.timestamp_s.to_be_bytes());
        if has_topic(self.setting) {
            put_str(out, self.topic);
        }
        out.extend_from_slice(self.payload);
    }
}
encode_methods!(RecvPacket<'_>);

impl Body for RecvackPacket {
    const KIND: PacketType = PacketType::Recvack;
    fn header_flags(&self) -> Flags {
        self.flags
    }
    fn body_len(&self, version: u8) -> Result<usize, EncodeError> {
        Ok(8 + seq_len(Self::KIND, version, self.message_seq)?)
    }
    fn write_body(&self, version: u8, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.message_id.to_be_bytes());
        put_seq(out, version, self.message_seq);
    }
}
encode_methods!(RecvackPacket);

impl Body for DisconnectPacket<'_> {
    const KIND: PacketType = PacketType::Disconnect;
    fn header_flags(&self) -> Flags {
        self.flags
    }
    fn body_len(&self, _version: u8) -> Result<usize, EncodeError> {
        Ok(1 + str_len(Self::KIND, "reason", self.reason)?)
    }
    fn write_body(&self, _version: u8, out: &mut Vec<u8>) {
        out.push(self.reason_code.0);
        put_str(out, self.reason);
    }
}
encode_methods!(DisconnectPacket<'_>);

impl Body for SubPacket<'_> {
    const KIND: PacketType = PacketType::Sub;
    fn header_flags(&self) -> Flags {
        self.flags
    }
    fn body_len(&self, _version: u8) -> Result<usize, EncodeError> {
        let k = Self::KIND;
        Ok(1 + str_len(k, "sub_no", self.sub_no)?
            + str_len(k, "channel_id", self.channel_id)?
            + 1
            + 1
            + str_len(k, "param", self.param)?)
    }
    fn write_body(&self, _version: u8, out: &mut Vec<u8>) {
        out.push(self.setting);
        put_str(out, self.sub_no);
        put_str(out, self.channel_id);
        out.push(self.channel_type.0);
        out.push(self.action);
        put_str(out, self.param);
    }
}
encode_methods!(SubPacket<'_>);

impl Body for SubackPacket<'_> {
    const KIND: PacketType = PacketType::Suback;
    fn header_flags(&self) -> Flags {
        self.flags
    }
    fn body_len(&self, _version: u8) -> Result<usize, EncodeError> {
        let k = Self::KIND;
        Ok(str_len(k, "sub_no", self.sub_no)? + str_len(k, "channel_id", self.channel_id)? + 3)
    }
    fn write_body(&self, _version: u8, out: &mut Vec<u8>) {
        put_str(out, self.sub_no);
        put_str(out, self.channel_id);
        out.push(self.channel_type.0);
        out.push(self.action);
        out.push(self.reason_code.0);
    }
}
encode_methods!(SubackPacket<'_>);

/// The one-byte PING frame.
pub const PING_BYTE: u8 = 0x70;
/// The one-byte PONG frame.
pub const PONG_BYTE: u8 = 0x80;

impl Frame<'_> {
    /// Appends this frame for a connection speaking `version`; returns the
    /// bytes appended. On error `out` is unchanged.
    pub fn encode(&self, version: u8, out: &mut Vec<u8>) -> Result<usize, EncodeError> {
        match self {
            Frame::Connect(p) => p.encode(version, out),
            Frame::Connack(p) => p.encode(version, out),
            Frame::Send(p) => p.encode(version, out),
            Frame::Sendack(p) => p.encode(version, out),
            Frame::Recv(p) => p.encode(version, out),
            Frame::Recvack(p) => p.encode(version, out),
            Frame::Ping => {
                out.push(PING_BYTE);
                Ok(1)
            }
            Frame::Pong => {
                out.push(PONG_BYTE);
                Ok(1)
            }
            Frame::Disconnect(p) => p.encode(version, out),
            Frame::Sub(p) => p.encode(version, out),
            Frame::Suback(p) => p.encode(version, out),
        }
    }

    /// Length of the whole frame [`encode`](Self::encode) would append.
    pub fn encoded_len(&self, version: u8) -> Result<usize, EncodeError> {
        match self {
            Frame::Connect(p) => p.encoded_len(version),
            Frame::Connack(p) => p.encoded_len(version),
            Frame::Send(p) => p.encoded_len(version),
            Frame::Sendack(p) => p.encoded_len(version),
            Frame::Recv(p) => p.encoded_len(version),
            Frame::Recvack(p) => p.encoded_len(version),
            Frame::Ping | Frame::Pong => Ok(1),
            Frame::Disconnect(p) => p.encoded_len(version),
            Frame::Sub(p) => p.encoded_len(version),
            Frame::Suback(p) => p.encoded_len(version),
        }
    }
}

/// Appends a RECV frame's header and body up to (not including) a payload
/// of `payload_len` bytes that the caller appends right after; `p.payload`
/// must be empty. Returns the offset in `out` of the `msg_key` bytes, so
/// the caller can patch a msg_key of the same length computed over the
/// payload. On error `out` is unchanged.
pub(crate) fn encode_recv_head(
    p: &RecvPacket<'_>,
    version: u8,
    payload_len: usize,
    out: &mut Vec<u8>,
) -> Result<usize, EncodeError> {
    debug_assert!(p.payload.is_empty());
    let body = p.body_len(version)?.saturating_add(payload_len);
    if body > MAX_VARINT_VALUE {
        return Err(EncodeError::FrameTooLarge {
            packet: PacketType::Recv,
            len_bytes: body,
        });
    }
    out.reserve(1 + varint_len(body) + body);
    out.push((PacketType::Recv.as_u8() << 4) | (p.flags.0 & Flags::MASK));
    put_varint(out, body);
    // RECV body: setting u8, then msg_key's u16 length, then its bytes.
    let msg_key_at = out.len() + 1 + 2;
    p.write_body(version, out);
    Ok(msg_key_at)
}
