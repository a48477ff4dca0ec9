//! Codec errors. Every decode error means the byte stream cannot be trusted
//! any more: the caller closes the connection (there is no resynchronisation
//! point in the protocol).

use super::types::PacketType;

/// Why a byte sequence is not a valid frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Header nibble 0 (reserved) or 13..=15 (unassigned).
    #[error("unknown packet type {0} (0 is reserved, 13..=15 are unassigned)")]
    UnknownPacketType(u8),
    /// A recognised packet type this codec does not handle (EVENT).
    #[error("{0} packets are not supported by this server")]
    UnsupportedPacket(PacketType),
    /// The remaining-length varint has a continuation bit in its 4th byte.
    #[error("remaining length varint is longer than 4 bytes")]
    VarintTooLong,
    /// The remaining length exceeds the caller's `frame_bytes_max`.
    #[error("remaining length of {len_bytes} bytes exceeds the limit of {bytes_max} bytes")]
    FrameTooLarge {
        /// Declared body length.
        len_bytes: usize,
        /// The caller's limit.
        bytes_max: usize,
    },
    /// A fixed-size field lies (partly) past the declared body length.
    #[error(
        "{packet} body truncated: field `{field}` needs {need_bytes} bytes, {left_bytes} left"
    )]
    Truncated {
        /// Packet being decoded.
        packet: PacketType,
        /// Field being read.
        field: &'static str,
        /// Bytes the field needs.
        need_bytes: usize,
        /// Bytes left in the body.
        left_bytes: usize,
    },
    /// A string's u16 length, read as i16, is negative (> 32767).
    #[error("{packet} field `{field}`: string length {len} is negative (read as i16)")]
    NegativeStringLength {
        /// Packet being decoded.
        packet: PacketType,
        /// Field being read.
        field: &'static str,
        /// The length as read.
        len: i16,
    },
    /// A string's bytes run past the declared body length.
    #[error(
        "{packet} field `{field}`: string of {len_bytes} bytes runs past the body ({left_bytes} left)"
    )]
    StringPastBody {
        /// Packet being decoded.
        packet: PacketType,
        /// Field being read.
        field: &'static str,
        /// Declared string length.
        len_bytes: usize,
        /// Bytes left in the body.
        left_bytes: usize,
    },
    /// A text field is not valid UTF-8.
    #[error("{packet} field `{field}` is not valid UTF-8")]
    InvalidUtf8 {
        /// Packet being decoded.
        packet: PacketType,
        /// Field being read.
        field: &'static str,
    },
    /// [`decode_connect`](super::decode_connect) saw another packet type first.
    #[error("expected CONNECT as the first frame, got {0}")]
    ExpectedConnect(PacketType),
}

/// Why a packet cannot be encoded. The output buffer is left as it was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// A string field is longer than [`MAX_STRING_BYTES`](super::MAX_STRING_BYTES).
    #[error("{packet} field `{field}` is {len_bytes} bytes; strings are at most 32767 bytes")]
    StringTooLong {
        /// Packet being encoded.
        packet: PacketType,
        /// Offending field.
        field: &'static str,
        /// Its length.
        len_bytes: usize,
    },
    /// `message_seq` does not fit the u32 of versions before 6.
    #[error(
        "{packet}: message_seq {message_seq} does not fit in u32 at protocol version {version}"
    )]
    MessageSeqTooLarge {
        /// Packet being encoded.
        packet: PacketType,
        /// The value.
        message_seq: u64,
        /// The version asked for.
        version: u8,
    },
    /// The body is longer than a 4-byte varint can express.
    #[error("{packet} body of {len_bytes} bytes exceeds the varint maximum of 268435455 bytes")]
    FrameTooLarge {
        /// Packet being encoded.
        packet: PacketType,
        /// Body length.
        len_bytes: usize,
    },
}
