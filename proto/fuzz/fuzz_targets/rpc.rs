//! Feeds arbitrary bytes through everything a peer node's bytes reach before the
//! node acts on them: the frame decoder (headers, `FrameLimits`), the link machines
//! (the listener's `Inbound` with its handshake, and the dialer's `Outbound`), and
//! the body decoder with its bounds check (`engine::node::wire::decode` against
//! `wire::Bounds`), then the uses a checked body is trusted for (a view's homes and
//! targets, an owner action's session shard).
//!
//! The first byte picks what and how:
//! - bits 0-1, the mode: 0 frames alone (`frame::decode` over the buffer, the limit
//!   from bits 2-3); 1 a link from its first byte (the bytes are the peer's
//!   handshake); 2 a link after a valid handshake this target makes itself from a
//!   fixed secret and fixed nonces (the bytes are the peer's established stream,
//!   which must be sealed with the link's keys: see bit 3);
//!   3 one body (the next byte is its kind, the rest the body);
//! - bit 2 (modes 1 and 2): the dialer's side (`Outbound`) instead of the listener's;
//! - bit 3 (mode 2): the bytes are the peer's frames in plaintext, which the target
//!   seals with the peer's session keys before feeding them (so that mutations reach
//!   past the authentication, into the link machine and the body decoder); the
//!   bytes after the last whole frame follow as they are. Without it the bytes go
//!   in as they are (mostly frames that fail authentication);
//! - bits 4-7 (modes 1 and 2): the bytes arrive in chunks of that many bytes (0: all
//!   at once), fed as a connection does (the whole unconsumed input each time).
//!
//! Invariants: no panic; every step consumes at most its input; a frame's body is
//! within its limit; nothing allocates past libFuzzer's `-malloc_limit_mb` (bodies
//! are bounded by `FrameLimits`, decoded lengths by the body's bytes).
#![no_main]

use engine::node::wire::{self, Body, Bounds, OneWay, Request};
use libfuzzer_sys::fuzz_target;
use proto::rpc::frame::{self, FrameLimits, Kind, HEADER_BYTES};
use proto::rpc::link::{Inbound, InboundEvent, LinkEvent, LinkLimits, Outbound};
use proto::rpc::{ClusterId, ClusterKey, ClusterSecret, Handshake, Identity, Outcome, SessionKeys};

/// This node (node 1 of the cluster {1, 2, 3}) and its peer, node 2.
const ME: Identity = Identity {
    node_id: 1,
    boot_id: 0x0b00_7111,
};
const PEER: Identity = Identity {
    node_id: 2,
    boot_id: 0x0b00_7222,
};
const NODES: [u64; 3] = [1, 2, 3];
const SLOT_IDS: u32 = 64;
/// A small frame limit, so a fuzzed length reaches it.
const FRAME_BYTES_MAX: usize = 64 << 10;
const NONCE_ME: [u8; 32] = [0x11; 32];
const NONCE_PEER: [u8; 32] = [0x22; 32];

fn key() -> ClusterKey {
    let secret = ClusterSecret::new(b"the fuzzed cluster's secret.....").unwrap();
    ClusterKey::new(secret, ClusterId::new("fuzz").unwrap(), SLOT_IDS)
}

fn limits() -> LinkLimits {
    LinkLimits {
        rpc_frame_bytes_max: FRAME_BYTES_MAX,
        ..LinkLimits::default()
    }
}

fn bounds() -> Bounds {
    Bounds {
        node_id: ME.node_id,
        boot_id: ME.boot_id,
        shard_count: 2,
        nodes: NODES.to_vec(),
        slot_ids: SLOT_IDS,
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let chunk = usize::from(sel >> 4);
    match sel & 0b11 {
        0 => frames(rest, sel),
        1 | 2 if sel & 0b100 == 0 => listener(rest, sel & 0b11 == 2, sel & 0b1000 != 0, chunk),
        1 | 2 => dialer(rest, sel & 0b11 == 2, sel & 0b1000 != 0, chunk),
        _ => {
            if let Some((&kind, body)) = rest.split_first() {
                if let Some(kind) = Kind::from_u8(kind) {
                    body_of(kind, body);
                }
            }
        }
    }
});

/// The frame decoder alone, frame after frame.
fn frames(buf: &[u8], sel: u8) {
    let max = [HEADER_BYTES, 296, 4096, FRAME_BYTES_MAX][usize::from(sel >> 2) & 3];
    let limits = FrameLimits {
        rpc_frame_bytes_max: max,
    };
    let mut off = 0;
    while let Ok(Some(f)) = frame::decode(&buf[off..], limits) {
        assert!(f.wire_len() <= max && f.wire_len() <= buf.len() - off);
        assert_eq!(f.body.len(), f.wire_len() - HEADER_BYTES);
        off += f.wire_len();
    }
}

/// Decodes and checks a body as the node does, then uses it as the node would.
fn body_of(kind: Kind, body: &[u8]) {
    let Some(Ok(body)) = wire::decode(kind, body, &bounds(), PEER.node_id) else {
        return;
    };
    match body {
        Body::OneWay(OneWay::View(view)) => {
            for s in 0..slots::HASH_SLOTS as u16 {
                let home = view.home_node(s);
                assert!(NODES.contains(&home), "a checked view homes on a node");
                assert!(NODES.contains(&view.target_for_slot(s).leader_node_id));
            }
        }
        Body::Request(Request::OwnerAction { action }) => {
            let r = &action.route;
            if (r.node_id, r.boot_id) == (ME.node_id, ME.boot_id) {
                let shard = engine::delivery::session_shard(r.session_id) as usize;
                assert!(shard < 2, "a checked owner action names a shard of ours");
            }
        }
        Body::Request(Request::Authority { target, .. } | Request::Touch { target, .. }) => {
            assert!(usize::from(target.hash_slot) < slots::HASH_SLOTS);
        }
        _ => {}
    }
}

/// `bytes` with each whole frame at its start sealed by the played peer, the rest
/// as it is.
fn sealed(bytes: &[u8], keys: &mut SessionKeys) -> Vec<u8> {
    let mut out = Vec::new();
    let mut off = 0;
    while let Ok(Some(f)) = frame::decode(&bytes[off..], limits().frame()) {
        if keys
            .send
            .seal(&f.header, f.body, limits().frame(), &mut out)
            .is_err()
        {
            break;
        }
        off += f.wire_len();
    }
    out.extend_from_slice(&bytes[off..]);
    out
}

/// Splits `bytes` into the arrivals of a connection.
fn arrivals(bytes: &[u8], chunk: usize) -> impl Iterator<Item = &[u8]> {
    bytes.chunks(if chunk == 0 {
        bytes.len().max(1)
    } else {
        chunk
    })
}

/// An inbound link (this node listening); `established`: after the peer's valid
/// Hello and Proof; `seal`: the peer's frames sealed by the target.
fn listener(bytes: &[u8], established: bool, seal: bool, chunk: usize) {
    let mut inbound = Inbound::new(&key(), ME, &[2, 3], NONCE_ME, limits(), 0);
    let mut out = Vec::new();
    let mut resealed = None;
    if established {
        let mut hello = Vec::new();
        let mut peer = Handshake::dialer(&key(), PEER, ME.node_id, NONCE_PEER, &mut hello);
        let step = inbound.on_input(&hello, 0, &mut out);
        assert_eq!((step.consumed, step.event), (hello.len(), None));
        let mut proof = Vec::new();
        assert!(matches!(
            peer.receive(&out, &mut proof).outcome,
            Outcome::Established { .. }
        ));
        let step = inbound.on_input(&proof, 0, &mut out);
        assert_eq!(step.event, Some(InboundEvent::Established(PEER)));
        if seal {
            let mut keys = peer.take_keys().expect("the peer is established");
            resealed = Some(sealed(bytes, &mut keys));
        }
    }
    let bytes = resealed.as_deref().unwrap_or(bytes);
    let mut input = Vec::new();
    for (now, arrival) in arrivals(bytes, chunk).enumerate() {
        input.extend_from_slice(arrival);
        loop {
            out.clear();
            let step = inbound.on_input(&input, now as u64, &mut out);
            assert!(step.consumed <= input.len());
            let done = match &step.event {
                Some(InboundEvent::Frame { header }) => {
                    assert!(inbound.body().len() <= FRAME_BYTES_MAX);
                    assert!(header.kind.is_hop() || header.kind == Kind::Reply);
                    body_of(header.kind, inbound.body());
                    false
                }
                Some(InboundEvent::Established(_)) => false,
                Some(InboundEvent::Refused(_) | InboundEvent::Close(_)) => true,
                None => step.consumed == 0,
            };
            input.drain(..step.consumed);
            if done {
                break;
            }
        }
        if inbound.on_tick(now as u64, &mut out).is_some() || inbound.is_closed() {
            return;
        }
    }
}

/// An outbound link (this node dialing node 2); `established`: after node 2's
/// valid Challenge; `seal`: node 2's frames sealed by the target.
fn dialer(bytes: &[u8], established: bool, seal: bool, chunk: usize) {
    let mut link: Outbound<u32> = Outbound::new(&key(), ME, PEER.node_id, 0, limits());
    let mut out = Vec::new();
    let mut resealed = None;
    assert!(link.on_dial(NONCE_ME, 0, &mut out));
    if established {
        let mut peer = Handshake::listener(&key(), PEER, &NODES, NONCE_PEER);
        let mut challenge = Vec::new();
        peer.receive(&out, &mut challenge);
        out.clear();
        let step = link.on_input(&challenge, 0, &mut out);
        assert!(matches!(step.event, Some(LinkEvent::Up { .. })), "{step:?}");
        // The Proof: node 2 is established too.
        peer.receive(&out, &mut Vec::new());
        out.clear();
        assert!(link
            .request(Kind::TouchBatch, b"x", 0, 7, 0, &mut out)
            .is_ok());
        if seal {
            let mut keys = peer.take_keys().expect("node 2 is established");
            resealed = Some(sealed(bytes, &mut keys));
        }
    }
    let bytes = resealed.as_deref().unwrap_or(bytes);
    let mut input = Vec::new();
    for (now, arrival) in arrivals(bytes, chunk).enumerate() {
        input.extend_from_slice(arrival);
        loop {
            out.clear();
            let step = link.on_input(&input, now as u64, &mut out);
            assert!(step.consumed <= input.len());
            let done = match &step.event {
                Some(LinkEvent::Up { .. }) => false,
                Some(LinkEvent::Refused(_) | LinkEvent::Close(_)) => true,
                None => step.consumed == 0,
            };
            input.drain(..step.consumed);
            if done {
                break;
            }
        }
        let mut failed = Vec::new();
        let _ = link.on_tick(now as u64, &mut out, &mut failed);
        if matches!(link.state(), proto::rpc::link::LinkState::Closing) {
            return;
        }
    }
}
