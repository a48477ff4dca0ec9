//! Inter-node frames: a fixed 40-byte header (a `bytemuck` Pod struct of byte
//! arrays: alignment 1, no padding, every integer little-endian), then `body_len`
//! bytes of body.
//!
//! | offset | bytes | field | meaning |
//! |---|---|---|---|
//! | 0 | 4 | magic | `b"IMRN"` |
//! | 4 | 1 | version | [`WIRE_VERSION`] (9) |
//! | 5 | 1 | kind | [`Kind`] |
//! | 6 | 2 | flags | none defined in version 4: must be 0 |
//! | 8 | 8 | sender node id | the sending node's `node_id` |
//! | 16 | 8 | sender boot id | the sending process's boot id |
//! | 24 | 8 | request id | chosen by the requester, echoed by the reply; 0 = none |
//! | 32 | 4 | deadline ms | **relative**: the time left for the request when it was sent, in ms; 0 = no deadline |
//! | 36 | 4 | body len | bytes of body after the header (after the handshake: the sealed body and its 16-byte tag, `seal`) |
//!
//! The deadline is relative because node clocks are not synchronised: the receiver
//! turns it into its own absolute deadline (`now + deadline_ms`) when the frame
//! arrives, and the transit time counts against the caller only (it is conservative
//! for the receiver, never generous).

use bytemuck::{Pod, Zeroable};

/// The 4 bytes that open every frame.
pub const MAGIC: [u8; 4] = *b"IMRN";
/// The wire version this code speaks (and the only one it accepts): 7 since the
/// replicated groups' messages travel (`Kind::Raft`); 6: API requests on the links
/// (`Kind::ApiRequest`); 5 since a view
/// names the node each move took a slot from and a moved slot's routes are handed
/// over (`Kind::Handover`); 4: every frame after the handshake is sealed (`seal`:
/// AES-256-GCM, keys per link and direction; 3: a touch batch's answer names the routes its authority
/// superseded; 2: the handshake carries the cluster id and slot-id count,
/// `auth`); a node of another version is refused with
/// [`FrameError::UnsupportedVersion`] at its first frame.
pub const WIRE_VERSION: u8 = 9;
/// Bytes of the fixed header.
pub const HEADER_BYTES: usize = std::mem::size_of::<WireHeader>();
/// Largest body of a [`Kind::Ping`] (and so of its Pong).
pub const PING_BODY_BYTES_MAX: usize = 64;
/// Default of [`FrameLimits::rpc_frame_bytes_max`]: 4 MiB.
pub const RPC_FRAME_BYTES_MAX_DEFAULT: usize = 4 << 20;

/// The frame header exactly as on the wire (alignment 1, no padding).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct WireHeader {
    magic: [u8; 4],
    version: u8,
    kind: u8,
    flags: [u8; 2],
    sender_node_id: [u8; 8],
    sender_boot_id: [u8; 8],
    request_id: [u8; 8],
    deadline_ms: [u8; 4],
    body_len: [u8; 4],
}

const _: () = assert!(HEADER_BYTES == 40);

/// What a frame is. Numbering: 0 is reserved (a zeroed buffer is never a frame);
/// 1..=15 the handshake and connection control (see [`Kind::is_control`]);
/// 16..=63 requests between nodes
/// (the hops of the cluster); 64 the generic reply, matched to its request by
/// request id. Numbers are never reused for another meaning; a new hop takes the
/// next free number and old nodes refuse it as [`FrameError::UnknownKind`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// Dialer → listener: the dialer's nonce (handshake step 1).
    Hello = 1,
    /// Listener → dialer: the listener's nonce and its MAC (handshake step 2).
    Challenge = 2,
    /// Dialer → listener: the dialer's MAC (handshake step 3).
    Proof = 3,
    /// Either side, before closing: why (a UTF-8 reason in the body).
    Goodbye = 4,
    /// Dialer → listener on an established link: a heartbeat. The body (at most
    /// [`PING_BODY_BYTES_MAX`] bytes; the dialer puts its `now_ms` there) is echoed by
    /// the Pong.
    Ping = 5,
    /// Listener → dialer: the answer to a Ping, with the Ping's body.
    Pong = 6,
    /// Authority: register a route.
    AuthorityRegister = 16,
    /// Authority: commit a registered route.
    AuthorityCommit = 17,
    /// Authority: abort a registration.
    AuthorityAbort = 18,
    /// Authority: unregister a route.
    AuthorityUnregister = 19,
    /// A batch of route touches.
    TouchBatch = 20,
    /// Endpoints-by-targets lookups, grouped per target.
    EndpointLookup = 21,
    /// Owner actions: kick with DISCONNECT 12, close.
    OwnerAction = 22,
    /// A SEND forwarded to its channel's home; its SENDACK comes back as a reply.
    ForwardedSend = 23,
    /// Owner push: plaintext messages and their exact endpoints.
    Push = 24,
    /// A cluster view.
    View = 25,
    /// A token lookup at the uid's home during CONNECT.
    TokenLookup = 26,
    /// A moved hash slot's routes, from its old authority to its new one.
    Handover = 27,
    /// An HTTP API request homed on the receiving node (method, path and query, the
    /// caller's bearer token, body); its answer (status, body) is the reply.
    ApiRequest = 28,
    /// One-way: raft messages of replicated groups (each tagged with its group),
    /// all of one sender's turn for the receiving node.
    Raft = 29,
    /// The reply to any request, matched by request id.
    Reply = 64,
}

impl Kind {
    /// Every kind, in numbering order.
    pub const ALL: [Kind; 21] = [
        Kind::Hello,
        Kind::Challenge,
        Kind::Proof,
        Kind::Goodbye,
        Kind::Ping,
        Kind::Pong,
        Kind::AuthorityRegister,
        Kind::AuthorityCommit,
        Kind::AuthorityAbort,
        Kind::AuthorityUnregister,
        Kind::TouchBatch,
        Kind::EndpointLookup,
        Kind::OwnerAction,
        Kind::ForwardedSend,
        Kind::Push,
        Kind::View,
        Kind::TokenLookup,
        Kind::Handover,
        Kind::ApiRequest,
        Kind::Raft,
        Kind::Reply,
    ];

    /// The kind of a wire byte, if assigned.
    pub fn from_u8(byte: u8) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| *k as u8 == byte)
    }

    /// Whether this kind belongs to the handshake (the only kinds served before
    /// authentication).
    pub const fn is_handshake(self) -> bool {
        matches!(
            self,
            Kind::Hello | Kind::Challenge | Kind::Proof | Kind::Goodbye
        )
    }

    /// Whether this kind is connection control (1..=15: the handshake, Goodbye,
    /// Ping, Pong), handled by the link machines and never handed to a caller.
    pub const fn is_control(self) -> bool {
        (self as u8) <= 15
    }

    /// Whether this kind is a request or a one-way message between nodes
    /// (16..=63): what [`crate::rpc::link::Outbound::request`] and `oneway` send.
    pub const fn is_hop(self) -> bool {
        matches!(self as u8, 16..=63)
    }
}

/// A decoded header, in native integers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// What the frame is.
    pub kind: Kind,
    /// Flag bits; none are defined in version 4 (must be 0).
    pub flags: u16,
    /// The sender's node id.
    pub sender_node_id: u64,
    /// The sender's boot id.
    pub sender_boot_id: u64,
    /// Request id (0 = none).
    pub request_id: u64,
    /// Time left for the request when sent, in ms (0 = no deadline).
    pub deadline_ms: u32,
}

/// One frame borrowed from the receive buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame<'a> {
    /// The header.
    pub header: Header,
    /// The body (`body_len` bytes).
    pub body: &'a [u8],
}

impl Frame<'_> {
    /// Bytes this frame takes in the buffer (header and body).
    pub fn wire_len(&self) -> usize {
        HEADER_BYTES + self.body.len()
    }
}

/// The limits of the codec.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest frame (header and body) sent or accepted, in bytes.
    pub rpc_frame_bytes_max: usize,
}

impl Default for FrameLimits {
    fn default() -> Self {
        FrameLimits {
            rpc_frame_bytes_max: RPC_FRAME_BYTES_MAX_DEFAULT,
        }
    }
}

/// Why bytes are not a frame (the stream cannot be trusted any more: close it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The first 4 bytes are not `IMRN`.
    #[error("bad magic {0:02x?} (expected \"IMRN\")")]
    BadMagic([u8; 4]),
    /// A wire version this node does not speak.
    #[error("wire version {0} is not supported (this node speaks {WIRE_VERSION})")]
    UnsupportedVersion(u8),
    /// A kind byte with no assigned meaning.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Flag bits set that this version does not define.
    #[error("unknown flag bits {0:#06x}")]
    UnknownFlags(u16),
    /// The frame is larger than `rpc_frame_bytes_max`.
    #[error("frame of {frame_bytes} bytes exceeds rpc_frame_bytes_max ({bytes_max} bytes)")]
    TooLarge {
        /// Header and declared body.
        frame_bytes: usize,
        /// The limit.
        bytes_max: usize,
    },
}

impl WireHeader {
    fn parse(&self) -> Result<Header, FrameError> {
        if self.magic != MAGIC {
            return Err(FrameError::BadMagic(self.magic));
        }
        if self.version != WIRE_VERSION {
            return Err(FrameError::UnsupportedVersion(self.version));
        }
        let kind = Kind::from_u8(self.kind).ok_or(FrameError::UnknownKind(self.kind))?;
        let flags = u16::from_le_bytes(self.flags);
        if flags != 0 {
            return Err(FrameError::UnknownFlags(flags));
        }
        Ok(Header {
            kind,
            flags,
            sender_node_id: u64::from_le_bytes(self.sender_node_id),
            sender_boot_id: u64::from_le_bytes(self.sender_boot_id),
            request_id: u64::from_le_bytes(self.request_id),
            deadline_ms: u32::from_le_bytes(self.deadline_ms),
        })
    }

    fn of(header: &Header, body_len: u32) -> WireHeader {
        WireHeader {
            magic: MAGIC,
            version: WIRE_VERSION,
            kind: header.kind as u8,
            flags: header.flags.to_le_bytes(),
            sender_node_id: header.sender_node_id.to_le_bytes(),
            sender_boot_id: header.sender_boot_id.to_le_bytes(),
            request_id: header.request_id.to_le_bytes(),
            deadline_ms: header.deadline_ms.to_le_bytes(),
            body_len: body_len.to_le_bytes(),
        }
    }
}

/// Decodes the frame at the start of `buf`:
/// - `Ok(Some(frame))`: a whole frame; `frame.wire_len()` bytes are consumed;
/// - `Ok(None)`: `buf` holds only a prefix of a frame (possibly empty): read more;
/// - `Err`: bad magic, version, kind or flags, or a frame over the limit (checked
///   as soon as the header is complete, before any of the body is waited for).
///
/// Never allocates: the body borrows `buf`.
pub fn decode(buf: &[u8], limits: FrameLimits) -> Result<Option<Frame<'_>>, FrameError> {
    let Some(head) = buf.get(..HEADER_BYTES) else {
        return Ok(None);
    };
    let wire: &WireHeader = bytemuck::from_bytes(head);
    let header = wire.parse()?;
    let body_len = u32::from_le_bytes(wire.body_len) as usize;
    let frame_bytes = HEADER_BYTES + body_len;
    if frame_bytes > limits.rpc_frame_bytes_max {
        return Err(FrameError::TooLarge {
            frame_bytes,
            bytes_max: limits.rpc_frame_bytes_max,
        });
    }
    Ok(buf
        .get(HEADER_BYTES..frame_bytes)
        .map(|body| Frame { header, body }))
}

/// Appends one frame (`header`, then `body`) to `out`, a reused buffer; returns
/// the bytes written. Refuses a frame over `rpc_frame_bytes_max` (the peer would
/// refuse it) and a header with undefined flags, writing nothing.
pub fn encode(
    header: &Header,
    body: &[u8],
    limits: FrameLimits,
    out: &mut Vec<u8>,
) -> Result<usize, FrameError> {
    let frame_bytes = encode_header(header, body.len(), limits, out)?;
    out.extend_from_slice(body);
    Ok(frame_bytes)
}

/// Appends the header of a frame whose body will be `body_bytes` long (the caller
/// appends the body: [`super::seal::Sealer`] seals it there); returns the frame's
/// bytes. Refuses as [`encode`] does, writing nothing.
pub fn encode_header(
    header: &Header,
    body_bytes: usize,
    limits: FrameLimits,
    out: &mut Vec<u8>,
) -> Result<usize, FrameError> {
    if header.flags != 0 {
        return Err(FrameError::UnknownFlags(header.flags));
    }
    let frame_bytes = HEADER_BYTES + body_bytes;
    let body_len = u32::try_from(body_bytes)
        .ok()
        .filter(|_| frame_bytes <= limits.rpc_frame_bytes_max);
    let Some(body_len) = body_len else {
        return Err(FrameError::TooLarge {
            frame_bytes,
            bytes_max: limits.rpc_frame_bytes_max,
        });
    };
    out.reserve(frame_bytes);
    out.extend_from_slice(bytemuck::bytes_of(&WireHeader::of(header, body_len)));
    Ok(frame_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(kind: Kind) -> Header {
        Header {
            kind,
            flags: 0,
            sender_node_id: 0x0102_0304_0506_0708,
            sender_boot_id: u64::MAX - 1,
            request_id: 0xdead_beef_cafe,
            deadline_ms: 1500,
        }
    }

    #[test]
    fn header_is_little_endian_at_documented_offsets() {
        let mut out = Vec::new();
        encode(
            &header(Kind::Proof),
            b"xy",
            FrameLimits::default(),
            &mut out,
        )
        .unwrap();
        assert_eq!(&out[0..4], b"IMRN");
        assert_eq!(out[4], WIRE_VERSION);
        assert_eq!(out[5], 3);
        assert_eq!(&out[6..8], &[0, 0]);
        assert_eq!(&out[8..16], &0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(&out[16..24], &(u64::MAX - 1).to_le_bytes());
        assert_eq!(&out[24..32], &0xdead_beef_cafeu64.to_le_bytes());
        assert_eq!(&out[32..36], &1500u32.to_le_bytes());
        assert_eq!(&out[36..40], &2u32.to_le_bytes());
        assert_eq!(&out[40..], b"xy");
    }

    #[test]
    fn every_kind_round_trips_and_numbers_are_unique() {
        for kind in Kind::ALL {
            assert_eq!(Kind::from_u8(kind as u8), Some(kind));
        }
        assert_eq!(Kind::from_u8(0), None);
        assert_eq!(Kind::from_u8(7), None);
        assert_eq!(Kind::from_u8(15), None);
    }

    #[test]
    fn control_hop_and_reply_ranges_partition_the_kinds() {
        for kind in Kind::ALL {
            let n = kind as u8;
            assert_eq!(kind.is_control(), (1..=15).contains(&n), "{kind:?}");
            assert_eq!(kind.is_hop(), (16..=63).contains(&n), "{kind:?}");
            assert!(!kind.is_handshake() || kind.is_control(), "{kind:?}");
        }
        assert_eq!(Kind::from_u8(5), Some(Kind::Ping));
        assert_eq!(Kind::from_u8(6), Some(Kind::Pong));
        assert!(!Kind::Reply.is_control() && !Kind::Reply.is_hop());
    }

    #[test]
    fn encode_refuses_flags_and_oversized_bodies_writing_nothing() {
        let mut out = Vec::new();
        let mut h = header(Kind::Reply);
        h.flags = 1;
        let limits = FrameLimits {
            rpc_frame_bytes_max: 50,
        };
        assert_eq!(
            encode(&h, b"", limits, &mut out),
            Err(FrameError::UnknownFlags(1))
        );
        let big = [0u8; 11];
        assert_eq!(
            encode(&header(Kind::Reply), &big, limits, &mut out),
            Err(FrameError::TooLarge {
                frame_bytes: 51,
                bytes_max: 50
            })
        );
        assert!(out.is_empty());
        assert_eq!(
            encode(&header(Kind::Reply), &big[..10], limits, &mut out),
            Ok(50)
        );
    }
}
