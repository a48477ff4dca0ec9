//! The WuKongIM binary client protocol ("wkproto"): a sans-IO, zero-copy,
//! incremental codec. Specification: `docs/wkproto.md`.
//!
//! # Frames
//! `header byte (type << 4 | flags)`, an MQTT-style varint remaining length
//! (1..=4 bytes; a zero length is written as no bytes), then the body.
//! PING (`0x70`) and PONG (`0x80`) are a single byte. Integers are
//! big-endian, strings are a u16 length (read as i16: at most
//! [`MAX_STRING_BYTES`]) followed by UTF-8, payloads are "the rest of the
//! body". Some fields exist only from/until a protocol version or when a
//! setting bit is set; see the predicates [`has_expire`], [`has_stream`],
//! [`has_topic`], [`message_seq_is_u64`], [`has_node_id`].
//!
//! # Text fields
//! Every string field of every packet is decoded as `&str` and must be valid
//! UTF-8 ([`DecodeError::InvalidUtf8`] names the field otherwise): the
//! fields are identifiers (uid, channel ids, client_msg_no, sub_no, device
//! id), tokens and keys (base64 / hex / alphanumeric), or human-readable
//! text (DISCONNECT reason, SUB param), and the official SDKs write them all
//! as UTF-8. Payloads are raw bytes (`&[u8]`): base64 text when encrypted,
//! arbitrary bytes with [`Setting::NO_ENCRYPT`].
//!
//! # Driving the decoder from a receive buffer (TCP or WebSocket)
//! A connection owns one receive buffer `rx: Vec<u8>` (capacity bounded by
//! `MAX_FRAME_BYTES + MAX_HEADER_BYTES` plus one read's worth) and a start
//! offset. After each read that appended bytes to `rx`:
//!
//! ```
//! use proto::wkproto::{decode, decode_connect, negotiate_version, Frame, MAX_FRAME_BYTES};
//! # fn handle(_f: Frame<'_>) {}
//! # let mut rx: Vec<u8> = vec![0x70, 0x70, 0x30]; // two PINGs and the start of a SEND
//! # let version: Option<u8> = Some(6);
//! let mut off = 0;
//! loop {
//!     // Before CONNECT: decode_connect(&rx[off..], MAX_FRAME_BYTES), then
//!     // version = negotiate_version(connect.version).
//!     match decode(&rx[off..], version.unwrap(), MAX_FRAME_BYTES) {
//!         Ok(Some((frame, consumed))) => {
//!             handle(frame); // frame borrows rx: copy out what must outlive it
//!             off += consumed;
//!         }
//!         Ok(None) => break,       // partial frame: keep rx[off..], read more
//!         Err(_e) => { /* close the connection */ break }
//!     }
//! }
//! rx.drain(..off); // or keep `off` and compact only when the buffer is full
//! # assert_eq!(rx, [0x30]);
//! ```
//!
//! - One read may hold many frames and a frame may span many reads; the
//!   decoder keeps no state between calls, the unconsumed tail of the buffer
//!   is the state. Re-decoding a partial prefix costs only the header parse
//!   (the body is parsed once, when complete).
//! - [`peek_frame_len`] tells the full length of the next frame as soon as
//!   its header (at most [`MAX_HEADER_BYTES`]) is there, and rejects an
//!   oversized frame before its body is buffered; an io_uring transport with
//!   fixed-size provided buffers can use it to decide when to copy into a
//!   larger per-connection buffer.
//! - WebSocket: each binary message carries one or more whole frames; feed
//!   message payloads into the same receive buffer (a frame split across
//!   messages is handled the same way). Text messages are a protocol error.
//! - Any `Err` is final: there is no resynchronisation point in the stream.
//!   EVENT (type 12) is [`DecodeError::UnsupportedPacket`].
//!
//! # Encoding
//! `packet.encode(version, &mut tx)` appends one frame to a reusable
//! `Vec<u8>` (no allocation once `tx` has the capacity) and returns its
//! length; errors ([`EncodeError`]) leave `tx` unchanged. For fan-out of
//! one message to many connections, [`RecvPacket`] is `Copy`: build each
//! recipient's packet from a shared base with
//! `RecvPacket { msg_key, payload, channel_id, ..base }`;
//! `crate::crypto::SessionCipher::encode_recv` does the per-connection
//! encryption, msg_key and encoding in one call without allocating. With
//! [`Setting::NO_ENCRYPT`] the frame bytes are identical for every recipient
//! of the same version and channel_id: encode once and copy the bytes.
//!
//! # Versions
//! [`negotiate_version`] gives the connection's version from CONNECT;
//! [`connack_has_server_version`] tells whether CONNACK carries it. The codec
//! accepts any version byte and applies the version predicates literally
//! (it is the gateway's decision which client versions to accept).

mod decode;
mod encode;
mod error;
mod packet;
mod types;

pub use decode::{decode, decode_connect, peek_frame_len};
pub(crate) use encode::encode_recv_head;
pub use encode::{varint_len, PING_BYTE, PONG_BYTE};
pub use error::{DecodeError, EncodeError};
pub use packet::{
    has_expire, has_node_id, has_stream, has_topic, message_seq_is_u64, ConnackPacket,
    ConnectPacket, DisconnectPacket, Frame, RecvPacket, RecvackPacket, SendPacket, SendackPacket,
    SubPacket, SubackPacket, SUB_ACTION_SUBSCRIBE, SUB_ACTION_UNSUBSCRIBE,
};
pub use types::{ChannelType, DeviceFlag, Flags, PacketType, ReasonCode, Setting};

/// The protocol's limit on a frame's remaining length (body bytes): 1 MiB.
pub const MAX_FRAME_BYTES: usize = 1 << 20;

/// Longest fixed header: the type byte plus a 4-byte varint.
pub const MAX_HEADER_BYTES: usize = 1 + MAX_VARINT_BYTES;

/// A remaining-length varint has at most 4 bytes.
pub const MAX_VARINT_BYTES: usize = 4;

/// Largest value a 4-byte varint can hold (2^28 - 1).
pub const MAX_VARINT_VALUE: usize = (1 << 28) - 1;

/// Longest string: the u16 length is read as i16.
pub const MAX_STRING_BYTES: usize = i16::MAX as usize;

/// The server's latest protocol version.
pub const LATEST_VERSION: u8 = 6;
/// The oldest protocol version the server accepts: a CONNECT below it is refused
/// with CONNACK 27 (ProtocolUpgradeRequired).
pub const OLDEST_VERSION: u8 = 2;

/// The connection's version for a CONNECT `version` byte:
/// `min(client_version, LATEST_VERSION)`, with 0 meaning latest.
#[inline]
pub const fn negotiate_version(client_version: u8) -> u8 {
    if client_version == 0 || client_version > LATEST_VERSION {
        LATEST_VERSION
    } else {
        client_version
    }
}

/// Whether the CONNACK to a client that sent `client_version` carries the
/// negotiated version (header flag HasServerVersion): exactly when
/// `client_version > 3`.
#[inline]
pub const fn connack_has_server_version(client_version: u8) -> bool {
    client_version > 3
}

/// What a CONNECT's version byte negotiates: the one decision used both for the
/// connection's version and for the CONNACK's encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Negotiated {
    /// The connection's version ([`negotiate_version`]): every later frame, and the
    /// CONNACK's body, are encoded at it.
    pub version: u8,
    /// `ConnackPacket::server_version`: `Some(version)` exactly when
    /// [`connack_has_server_version`] of the client's byte (so a client that sent 0,
    /// "latest", gets no server_version byte).
    pub connack_server_version: Option<u8>,
}

/// Negotiates a CONNECT's `client_version`.
#[inline]
pub const fn negotiate(client_version: u8) -> Negotiated {
    let version = negotiate_version(client_version);
    Negotiated {
        version,
        connack_server_version: if connack_has_server_version(client_version) {
            Some(version)
        } else {
            None
        },
    }
}

#[cfg(test)]
mod negotiation_tests {
    use super::*;

    #[test]
    fn version_zero_means_latest_without_a_server_version_byte() {
        assert_eq!(
            negotiate(0),
            Negotiated {
                version: LATEST_VERSION,
                connack_server_version: None
            }
        );
        assert_eq!(negotiate(3).connack_server_version, None);
        assert_eq!(negotiate(4).connack_server_version, Some(4));
        assert_eq!(negotiate(200).connack_server_version, Some(LATEST_VERSION));
    }
}
