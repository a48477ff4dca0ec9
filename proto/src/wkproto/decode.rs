//! Incremental, zero-copy decoder.

use super::error::DecodeError;
use super::packet::{
    has_expire, has_node_id, has_stream, has_topic, message_seq_is_u64, ConnackPacket,
    ConnectPacket, DisconnectPacket, Frame, RecvPacket, RecvackPacket, SendPacket, SendackPacket,
    SubPacket, SubackPacket,
};
use super::types::{ChannelType, DeviceFlag, Flags, PacketType, ReasonCode, Setting};
use super::MAX_VARINT_BYTES;

/// A parsed fixed header.
#[derive(Clone, Copy, Debug)]
struct Header {
    kind: PacketType,
    flags: Flags,
    /// Bytes of fixed header + varint.
    header_bytes: usize,
    /// Declared body length.
    body_bytes: usize,
}

/// Parses the fixed header; `Ok(None)` when `buf` does not hold all of it
/// yet. Checks the limit before the body has arrived, so the caller never
/// buffers an oversized frame.
#[inline]
fn decode_header(buf: &[u8], frame_bytes_max: usize) -> Result<Option<Header>, DecodeError> {
    let Some(&first) = buf.first() else {
        return Ok(None);
    };
    let nibble = first >> 4;
    let flags = Flags(first & Flags::MASK);
    let kind = PacketType::from_nibble(nibble).ok_or(DecodeError::UnknownPacketType(nibble))?;
    match kind {
        PacketType::Event => return Err(DecodeError::UnsupportedPacket(kind)),
        PacketType::Ping | PacketType::Pong => {
            return Ok(Some(Header {
                kind,
                flags,
                header_bytes: 1,
                body_bytes: 0,
            }))
        }
        _ => {}
    }
    let mut len: usize = 0;
    for i in 0..MAX_VARINT_BYTES {
        let Some(&b) = buf.get(1 + i) else {
            return Ok(None);
        };
        len |= usize::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            if len > frame_bytes_max {
                return Err(DecodeError::FrameTooLarge {
                    len_bytes: len,
                    bytes_max: frame_bytes_max,
                });
            }
            return Ok(Some(Header {
                kind,
                flags,
                header_bytes: 2 + i,
                body_bytes: len,
            }));
        }
    }
    Err(DecodeError::VarintTooLong)
}

/// Total length (header + body) of the frame at the start of `buf`, as soon
/// as its header is complete; `Ok(None)` while the header is incomplete.
/// Lets a transport size its receive buffer for a large frame before the
/// body arrives. Same errors as [`decode`] for the header.
pub fn peek_frame_len(buf: &[u8], frame_bytes_max: usize) -> Result<Option<usize>, DecodeError> {
    Ok(decode_header(buf, frame_bytes_max)?.map(|h| h.header_bytes + h.body_bytes))
}

/// Decodes the first frame of `buf` for a connection speaking `version`.
///
/// - `Ok(Some((frame, consumed)))`: a whole frame; `consumed` (`<= buf.len()`)
///   bytes belong to it, the next frame starts at `buf[consumed..]`.
///   `frame` borrows string and payload fields from `buf`.
/// - `Ok(None)`: `buf` holds only a prefix of a frame (possibly empty);
///   read more bytes, append them and call again with the whole prefix.
/// - `Err(_)`: the stream is invalid; close the connection.
///
/// `frame_bytes_max` limits the remaining length (the body, not counting
/// the 1..=5 header bytes); [`MAX_FRAME_BYTES`](super::MAX_FRAME_BYTES) is
/// the protocol's 1 MiB. Bytes after the last known field of a packet that
/// has no payload are ignored (forward compatibility), but consumed.
/// CONNECT decodes the same at every version. Never panics.
pub fn decode(
    buf: &[u8],
    version: u8,
    frame_bytes_max: usize,
) -> Result<Option<(Frame<'_>, usize)>, DecodeError> {
    let Some(h) = decode_header(buf, frame_bytes_max)? else {
        return Ok(None);
    };
    let total = h.header_bytes + h.body_bytes;
    let Some(body) = buf.get(h.header_bytes..total) else {
        return Ok(None);
    };
    let frame = decode_body(h, body, version)?;
    Ok(Some((frame, total)))
}

/// Decodes the first frame of a connection, which must be CONNECT (its
/// body carries the client's version, so no version is needed yet).
/// Same contract as [`decode`]; another packet type is
/// [`DecodeError::ExpectedConnect`] as soon as its first byte is there.
pub fn decode_connect(
    buf: &[u8],
    frame_bytes_max: usize,
) -> Result<Option<(ConnectPacket<'_>, usize)>, DecodeError> {
    if let Some(&first) = buf.first() {
        if let Some(kind) = PacketType::from_nibble(first >> 4) {
            if kind != PacketType::Connect {
                return Err(DecodeError::ExpectedConnect(kind));
            }
        }
    }
    match decode(buf, 0, frame_bytes_max)? {
        Some((Frame::Connect(c), n)) => Ok(Some((c, n))),
        Some((other, _)) => Err(DecodeError::ExpectedConnect(other.packet_type())),
        None => Ok(None),
    }
}

/// Decodes the body of a frame whose fixed header is `h`, for a connection speaking
/// `version`. Refuses a body shorter than its fields or with invalid UTF-8
/// ([`DecodeError`] naming the field) and EVENT ([`DecodeError::UnsupportedPacket`]).
fn decode_body(h: Header, body: &[u8], version: u8) -> Result<Frame<'_>, DecodeError> {
    let mut r = Reader {
        rest: body,
        packet: h.kind,
    };
    let flags = h.flags;
    Ok(match h.kind {
        PacketType::Connect => Frame::Connect(connect_body(&mut r, flags)?),
        PacketType::Connack => Frame::Connack(connack_body(&mut r, flags, version)?),
        PacketType::Send => Frame::Send(send_body(&mut r, flags, version)?),
        PacketType::Sendack => Frame::Sendack(SendackPacket {
            flags,
            message_id: r.i64("message_id")?,
            client_seq: r.u32("client_seq")?,
            message_seq: r.message_seq(version)?,
            reason_code: ReasonCode(r.u8("reason_code")?),
        }),
        PacketType::Recv => Frame::Recv(recv_body(&mut r, flags, version)?),
        PacketType::Recvack => Frame::Recvack(RecvackPacket {
            flags,
            message_id: r.i64("message_id")?,
            message_seq: r.message_seq(version)?,
        }),
        PacketType::Ping => Frame::Ping,
        PacketType::Pong => Frame::Pong,
        PacketType::Disconnect => Frame::Disconnect(DisconnectPacket {
            flags,
            reason_code: ReasonCode(r.u8("reason_code")?),
            reason: r.str("reason")?,
        }),
        PacketType::Sub => Frame::Sub(SubPacket {
            flags,
            setting: r.u8("setting")?,
            sub_no: r.str("sub_no")?,
            channel_id: r.str("channel_id")?,
            channel_type: ChannelType(r.u8("channel_type")?),
            action: r.u8("action")?,
            param: r.str("param")?,
        }),
        PacketType::Suback => Frame::Suback(SubackPacket {
            flags,
            sub_no: r.str("sub_no")?,
            channel_id: r.str("channel_id")?,
            channel_type: ChannelType(r.u8("channel_type")?),
            action: r.u8("action")?,
            reason_code: ReasonCode(r.u8("reason_code")?),
        }),
        // decode_header rejects EVENT before we get here; keep the error
        // rather than an unreachable!() so no input can panic.
        PacketType::Event => return Err(DecodeError::UnsupportedPacket(h.kind)),
    })
}

/// The fields of a CONNECT body (the same at every version). Refuses a missing
/// field or a string that is not UTF-8.
#[inline]
fn connect_body<'a>(r: &mut Reader<'a>, flags: Flags) -> Result<ConnectPacket<'a>, DecodeError> {
    Ok(ConnectPacket {
        flags,
        version: r.u8("version")?,
        device_flag: DeviceFlag(r.u8("device_flag")?),
        device_id: r.str("device_id")?,
        uid: r.str("uid")?,
        token: r.str("token")?,
        client_timestamp_ms: r.i64("client_timestamp")?,
        client_key: r.str("client_key")?,
    })
}

/// The fields of a CONNACK body: the server version when its flag is set, and the
/// node id from the version that has it (the server's, else `version`). Refuses a
/// missing field or a string that is not UTF-8.
#[inline]
fn connack_body<'a>(
    r: &mut Reader<'a>,
    flags: Flags,
    version: u8,
) -> Result<ConnackPacket<'a>, DecodeError> {
    let server_version = if flags.contains(Flags::HAS_SERVER_VERSION) {
        Some(r.u8("server_version")?)
    } else {
        None
    };
    let effective = server_version.unwrap_or(version);
    Ok(ConnackPacket {
        flags: flags.without(Flags::HAS_SERVER_VERSION),
        server_version,
        time_diff_ms: r.i64("time_diff")?,
        reason_code: ReasonCode(r.u8("reason_code")?),
        server_key: r.str("server_key")?,
        salt: r.str("salt")?,
        node_id: if has_node_id(effective) {
            r.u64("node_id")?
        } else {
            0
        },
    })
}

/// The fields of a SEND body; the stream number, expiry and topic only where
/// `version` and the setting carry them; the payload is the rest. Refuses a missing
/// field or a string that is not UTF-8.
#[inline]
fn send_body<'a>(
    r: &mut Reader<'a>,
    flags: Flags,
    version: u8,
) -> Result<SendPacket<'a>, DecodeError> {
    let setting = Setting(r.u8("setting")?);
    let client_seq = r.u32("client_seq")?;
    let client_msg_no = r.str("client_msg_no")?;
    let stream_no = if has_stream(version, setting) {
        r.str("stream_no")?
    } else {
        ""
    };
    let channel_id = r.str("channel_id")?;
    let channel_type = ChannelType(r.u8("channel_type")?);
    let expire_s = if has_expire(version) {
        r.u32("expire")?
    } else {
        0
    };
    let msg_key = r.str("msg_key")?;
    let topic = if has_topic(setting) {
        r.str("topic")?
    } else {
        ""
    };
    Ok(SendPacket {
        flags,
        setting,
        client_seq,
        client_msg_no,
        stream_no,
        channel_id,
        channel_type,
        expire_s,
        msg_key,
        topic,
        payload: r.rest,
    })
}

/// The fields of a RECV body; the expiry, stream fields and topic only where
/// `version` and the setting carry them; the payload is the rest. Refuses a missing
/// field or a string that is not UTF-8.
#[inline]
fn recv_body<'a>(
    r: &mut Reader<'a>,
    flags: Flags,
    version: u8,
) -> Result<RecvPacket<'a>, DecodeError> {
    let setting = Setting(r.u8("setting")?);
    let msg_key = r.str("msg_key")?;
    let from_uid = r.str("from_uid")?;
    let channel_id = r.str("channel_id")?;
    let channel_type = ChannelType(r.u8("channel_type")?);
    let expire_s = if has_expire(version) {
        r.u32("expire")?
    } else {
        0
    };
    let client_msg_no = r.str("client_msg_no")?;
    let (stream_flag, stream_no, stream_id) = if has_stream(version, setting) {
        (
            r.u8("stream_flag")?,
            r.str("stream_no")?,
            r.u64("stream_id")?,
        )
    } else {
        (0, "", 0)
    };
    let message_id = r.i64("message_id")?;
    let message_seq = r.message_seq(version)?;
    let timestamp_s = r.i32("timestamp")?;
    let topic = if has_topic(setting) {
        r.str("topic")?
    } else {
        ""
    };
    Ok(RecvPacket {
        flags,
        setting,
        msg_key,
        from_uid,
        channel_id,
        channel_type,
        expire_s,
        client_msg_no,
        stream_flag,
        stream_no,
        stream_id,
        message_id,
        message_seq,
        timestamp_s,
        topic,
        payload: r.rest,
    })
}

/// Bounds-checked big-endian reader over one frame body.
struct Reader<'a> {
    rest: &'a [u8],
    packet: PacketType,
}

impl<'a> Reader<'a> {
    #[inline]
    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], DecodeError> {
        match self.rest.split_first_chunk::<N>() {
            Some((head, tail)) => {
                self.rest = tail;
                Ok(*head)
            }
            None => Err(DecodeError::Truncated {
                packet: self.packet,
                field,
                need_bytes: N,
                left_bytes: self.rest.len(),
            }),
        }
    }

    #[inline]
    fn u8(&mut self, field: &'static str) -> Result<u8, DecodeError> {
        Ok(self.array::<1>(field)?[0])
    }

    #[inline]
    fn u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.array(field)?))
    }

    #[inline]
    fn i32(&mut self, field: &'static str) -> Result<i32, DecodeError> {
        Ok(i32::from_be_bytes(self.array(field)?))
    }

    #[inline]
    fn u64(&mut self, field: &'static str) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.array(field)?))
    }

    #[inline]
    fn i64(&mut self, field: &'static str) -> Result<i64, DecodeError> {
        Ok(i64::from_be_bytes(self.array(field)?))
    }

    #[inline]
    fn message_seq(&mut self, version: u8) -> Result<u64, DecodeError> {
        if message_seq_is_u64(version) {
            self.u64("message_seq")
        } else {
            Ok(u64::from(self.u32("message_seq")?))
        }
    }

    /// A u16-length-prefixed UTF-8 string; the length is read as i16 like
    /// the reference decoder, so lengths over 32767 are rejected.
    #[inline]
    fn str(&mut self, field: &'static str) -> Result<&'a str, DecodeError> {
        let len = i16::from_be_bytes(self.array(field)?);
        let Ok(n) = usize::try_from(len) else {
            return Err(DecodeError::NegativeStringLength {
                packet: self.packet,
                field,
                len,
            });
        };
        let Some((bytes, tail)) = self.rest.split_at_checked(n) else {
            return Err(DecodeError::StringPastBody {
                packet: self.packet,
                field,
                len_bytes: n,
                left_bytes: self.rest.len(),
            });
        };
        self.rest = tail;
        core::str::from_utf8(bytes).map_err(|_| DecodeError::InvalidUtf8 {
            packet: self.packet,
            field,
        })
    }
}
