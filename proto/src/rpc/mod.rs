//! The inter-node wire, sans-IO like [`crate::wkproto`]:
//! no sockets, no clocks, no randomness of its own.
//!
//! - [`frame`]: fixed 40-byte `bytemuck` headers (magic, wire version, kind,
//!   flags, sender node id and boot id, request id, relative deadline in ms, body
//!   length), an incremental decoder over the receive buffer and an encoder into
//!   a reused `Vec`, bounded by [`FrameLimits::rpc_frame_bytes_max`].
//! - [`auth`]: the challenge-response that opens every connection (HMAC-SHA256
//!   over the cluster secret, nonces both ways, node ids, boot ids and both sides'
//!   cluster id and slot-id count bound in: a peer of another cluster is refused by
//!   name), one [`Handshake`] machine per side.
//! - [`seal`]: every frame after the handshake sealed with AES-256-GCM under the
//!   link's keys for its direction, a counter nonce per direction (a replayed,
//!   reordered or altered frame closes the link by name).
//! - [`link`]: the connection machines built on both. [`Outbound`] (one per
//!   shard and peer node, the dialer): reconnection with backoff, handshake,
//!   heartbeat Pings, requests in flight with deadlines and a bound, replies matched
//!   by request id and peer boot id. [`Inbound`] (one per accepted connection, the
//!   listener): handshake, then one checked frame at a time to the caller, Pongs,
//!   silence detection. Both close with a [`LinkCloseReason`] and a Goodbye.
//!
//! Typical use: a shard keeps an [`Outbound`] per peer node and an [`Inbound`] per
//! connection its listener accepted. A request goes out on the requester's
//! outbound link; the peer's inbound link hands it up as
//! [`InboundEvent::Frame`]; the peer answers with [`Outbound::send_reply`] on its
//! own outbound link back; the reply arrives on one of the requester node's inbound
//! links, goes to the shard [`request_shard`] names, and
//! [`Outbound::complete`] there returns the request's token.

pub mod auth;
pub mod frame;
pub mod link;
pub mod seal;

pub use auth::{
    ClusterId, ClusterKey, ClusterSecret, Handshake, Identity, Outcome, Refusal, SessionKeys, Step,
};
pub use frame::{decode, encode, Frame, FrameError, FrameLimits, Header, Kind};
pub use link::{
    request_shard, Failure, Inbound, InboundEvent, InboundStep, LinkCloseReason, LinkEvent,
    LinkLimits, LinkState, LinkStep, Outbound, Refused,
};
pub use seal::{Opener, SealError, Sealer, Unauthentic};

/// A frame on an established connection sent with ids other than the peer's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("frame from node {got_node_id} boot {got_boot_id} on the connection of node {peer_node_id} boot {peer_boot_id}")]
pub struct SenderMismatch {
    /// The authenticated peer's node id.
    pub peer_node_id: u64,
    /// The authenticated peer's boot id.
    pub peer_boot_id: u64,
    /// The node id in the frame.
    pub got_node_id: u64,
    /// The boot id in the frame.
    pub got_boot_id: u64,
}

/// Checks that a frame on an established connection carries the authenticated
/// peer's node id and boot id (a peer that restarted has a new boot id and a new connection).
pub fn check_sender(header: &Header, peer: Identity) -> Result<(), SenderMismatch> {
    if header.sender_node_id == peer.node_id && header.sender_boot_id == peer.boot_id {
        return Ok(());
    }
    Err(SenderMismatch {
        peer_node_id: peer.node_id,
        peer_boot_id: peer.boot_id,
        got_node_id: header.sender_node_id,
        got_boot_id: header.sender_boot_id,
    })
}
