//! The seeds of the `rpc` fuzz target (`proto/fuzz/fuzz_targets/rpc.rs`), made
//! here from the real encoders so the fuzzer starts past the handshake and inside
//! every body kind: each seed is the target's selector byte, then the bytes a peer
//! would send in that mode. This test checks that every seed is what the node
//! accepts today (each frame decodes, from the authenticated peer, and each body
//! decodes and passes `wire::Bounds`), and that the committed seeds in
//! `proto/fuzz/seeds/rpc/` are these; `IMROUTER_WRITE_FUZZ_SEEDS=1` rewrites them
//! after a change of the wire. After the handshake the peer's frames are sealed
//! (`proto::rpc::seal`): the handshake seed carries them sealed with the keys the
//! target's fixed nonces give; the established seeds carry them in plaintext and
//! ask the target to seal them (its selector's bit 3).
//!
//! The constants mirror the fuzz target's (its node, peer, key, nonces, bounds).

use engine::activation::AuthorityRequest;
use engine::authority::{HandoverBatch, TouchAnswer};
use engine::channel::Channel;
use engine::cluster::ClusterView;
use engine::node::wire::{self, Bounds, OneWayRef, Reply, Request};
use engine::route::{
    DeviceLevel, OwnerAction, OwnerActionKind, PendingToken, Route, RouteIdentity, Transport, Uid,
};
use proto::rpc::frame::{self, FrameLimits, Header, Kind};
use proto::rpc::{ClusterId, ClusterKey, ClusterSecret, Handshake, Identity};

const ME: Identity = Identity {
    node_id: 1,
    boot_id: 0x0b00_7111,
};
const PEER: Identity = Identity {
    node_id: 2,
    boot_id: 0x0b00_7222,
};
const SLOT_IDS: u32 = 64;
const NONCE_ME: [u8; 32] = [0x11; 32];
const NONCE_PEER: [u8; 32] = [0x22; 32];
const SEEDS_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../proto/fuzz/seeds/rpc");

fn key() -> ClusterKey {
    let secret = ClusterSecret::new(b"the fuzzed cluster's secret.....").unwrap();
    ClusterKey::new(secret, ClusterId::new("fuzz").unwrap(), SLOT_IDS)
}

fn bounds() -> Bounds {
    Bounds {
        node_id: ME.node_id,
        boot_id: ME.boot_id,
        shard_count: 2,
        nodes: vec![1, 2, 3],
        slot_ids: SLOT_IDS,
    }
}

/// A route of `of`'s session (a node registers and touches only its own).
fn route(of: Identity, session_id: u64) -> Route {
    Route {
        uid: "u1".into(),
        device_id: "d".into(),
        device_flag: 1,
        device_level: DeviceLevel::Master,
        node_id: of.node_id,
        boot_id: of.boot_id,
        session_id,
        listener: Transport::Tcp,
        owner_seq: 3,
        connected_at_ms: 1234,
        last_active_s: Some(2),
    }
}

fn identity(of: Identity) -> RouteIdentity {
    RouteIdentity {
        uid: Uid::from("u1"),
        node_id: of.node_id,
        boot_id: of.boot_id,
        session_id: engine::delivery::session_id(1, 7),
    }
}

fn encoded<T: serde::Serialize>(value: &T) -> Vec<u8> {
    let mut body = Vec::new();
    wire::encode(value, &mut body);
    body
}

/// One valid body of every request kind, one-way message and reply shape.
fn bodies() -> Vec<(Kind, Vec<u8>)> {
    let view = ClusterView::initial(&[1, 2, 3], SLOT_IDS).unwrap();
    let target = view.target_for_uid("u1");
    let session = engine::delivery::session_id(1, 7);
    let authority = |request| Request::Authority { target, request };
    let token = PendingToken {
        identity: identity(PEER),
        owner_seq: 3,
        nonce: 9,
    };
    let send = wire::ForwardedSend {
        answer_to: (),
        sender: None,
        from_uid: Uid::from("u1"),
        channel: Channel::resolve("u1", "u2", 1).unwrap(),
        client_msg_no: "n1".into(),
        setting: 0,
        flags: 0,
        expire_s: 0,
        topic: String::new(),
        payload: b"hello".to_vec(),
    };
    let requests = [
        authority(AuthorityRequest::Register {
            route: route(PEER, session),
        }),
        authority(AuthorityRequest::Commit {
            token: token.clone(),
        }),
        authority(AuthorityRequest::Abort { token }),
        authority(AuthorityRequest::Unregister {
            identity: identity(PEER),
            owner_seq: 3,
        }),
        Request::Touch {
            target,
            routes: vec![route(PEER, session)],
        },
        Request::OwnerAction {
            action: OwnerAction {
                kind: OwnerActionKind::KickThenClose,
                route: identity(ME),
                owner_seq: 3,
            },
        },
        Request::Send(Box::new(send)),
        Request::Token {
            uid: "u1".into(),
            device_flag: 1,
            token: "t".into(),
        },
        Request::Lookup {
            groups: vec![(target, 0..2)],
            uids: vec![Uid::from("u1"), Uid::from("u2")],
        },
        Request::Handover(HandoverBatch {
            target: engine::cluster::Target {
                leader_node_id: ME.node_id,
                ..target
            },
            routes: vec![route(PEER, session)],
            tombstones: vec![(identity(PEER), 3)],
            batch: 0,
            batches: 1,
        }),
        Request::Api(Box::new(wire::ApiCall {
            method: "POST".into(),
            target: "/user/token".into(),
            authorization: Some("Bearer t".into()),
            body: br#"{"uid":"u1","token":"t"}"#.to_vec(),
        })),
    ];
    let mut bodies: Vec<(Kind, Vec<u8>)> =
        requests.iter().map(|r| (r.kind(), encoded(r))).collect();
    bodies.push((Kind::View, encoded(&OneWayRef::View(&view))));
    let raft = [(0, vec![1, 2, 3]), (63, Vec::new())];
    let frame = OneWayRef::Raft {
        draining: false,
        messages: &raft,
    };
    bodies.push((Kind::Raft, encoded(&frame)));
    let replies = [
        Reply::Touch(TouchAnswer {
            requeue: vec![route(ME, session)],
            superseded: vec![route(ME, session + 1)],
        }),
        Reply::OwnerAction(Ok(())),
        Reply::SendAck {
            message_id: 77,
            message_seq: 5,
            reason: 1,
        },
        Reply::Token(Ok(DeviceLevel::Master)),
        Reply::Lookup {
            endpoints: Vec::new(),
            results: vec![Ok(0..0)],
        },
        Reply::Handover(Ok(())),
        Reply::Api {
            status: 200,
            body: r#"{"status":200}"#.into(),
        },
    ];
    bodies.extend(replies.iter().map(|r| (Kind::Reply, encoded(r))));
    bodies
}

/// A frame from `from`.
fn frame_of(from: Identity, kind: Kind, request_id: u64, body: &[u8]) -> Vec<u8> {
    let header = Header {
        kind,
        flags: 0,
        sender_node_id: from.node_id,
        sender_boot_id: from.boot_id,
        request_id,
        deadline_ms: if request_id == 0 { 0 } else { 500 },
    };
    let mut out = Vec::new();
    frame::encode(&header, body, FrameLimits::default(), &mut out).unwrap();
    out
}

/// The peer's established stream: a Ping, then every body as a frame.
fn stream() -> Vec<u8> {
    let mut out = frame_of(PEER, Kind::Ping, 0, &7u64.to_le_bytes());
    for (i, (kind, body)) in bodies().into_iter().enumerate() {
        let request_id = if kind == Kind::View { 0 } else { i as u64 + 1 };
        out.extend(frame_of(PEER, kind, request_id, &body));
    }
    out
}

/// The peer's handshake toward this node listening (Hello, Proof) and node 2's
/// Challenge toward this node dialing: the target's fixed key and nonces.
fn handshakes() -> (Vec<u8>, Vec<u8>) {
    let mut hello = Vec::new();
    let mut peer = Handshake::dialer(&key(), PEER, ME.node_id, NONCE_PEER, &mut hello);
    let mut me = Handshake::listener(&key(), ME, &[2, 3], NONCE_ME);
    let mut challenge = Vec::new();
    me.receive(&hello, &mut challenge);
    let mut proof = Vec::new();
    peer.receive(&challenge, &mut proof);
    let mut to_listener = hello;
    to_listener.extend(proof);
    let mut my_hello = Vec::new();
    let _me = Handshake::dialer(&key(), ME, PEER.node_id, NONCE_ME, &mut my_hello);
    let mut node2 = Handshake::listener(&key(), PEER, &[1, 2, 3], NONCE_PEER);
    let mut to_dialer = Vec::new();
    node2.receive(&my_hello, &mut to_dialer);
    (to_listener, to_dialer)
}

/// `stream` sealed as the peer seals it after its handshake with this node
/// listening (the target's fixed key and nonces make the same keys).
fn sealed_stream(stream: &[u8]) -> Vec<u8> {
    let mut hello = Vec::new();
    let mut peer = Handshake::dialer(&key(), PEER, ME.node_id, NONCE_PEER, &mut hello);
    let mut me = Handshake::listener(&key(), ME, &[2, 3], NONCE_ME);
    let mut challenge = Vec::new();
    me.receive(&hello, &mut challenge);
    peer.receive(&challenge, &mut Vec::new());
    let mut keys = peer.take_keys().expect("the peer is established");
    let mut out = Vec::new();
    let mut off = 0;
    while let Some(f) = frame::decode(&stream[off..], FrameLimits::default()).unwrap() {
        keys.send
            .seal(&f.header, f.body, FrameLimits::default(), &mut out)
            .unwrap();
        off += f.wire_len();
    }
    out
}

/// Every seed: (file name, selector byte ‖ bytes).
fn seeds() -> Vec<(String, Vec<u8>)> {
    let with = |sel: u8, bytes: &[u8]| [&[sel][..], bytes].concat();
    let (to_listener, to_dialer) = handshakes();
    let stream = stream();
    let mut seeds = vec![
        ("frames".to_string(), with(0b1100, &stream)),
        (
            "listener-handshake".into(),
            with(1, &[to_listener.clone(), sealed_stream(&stream)].concat()),
        ),
        // Modes 2 with bit 3: the stream in plaintext, sealed by the target.
        ("listener-established".into(), with(0b1010, &stream)),
        ("listener-established-chunked".into(), with(0x7a, &stream)),
        // Without bit 3: the plaintext stream as it is (fails authentication).
        ("listener-established-unsealed".into(), with(2, &stream)),
        ("dialer-handshake".into(), with(0b101, &to_dialer)),
        (
            "dialer-established".into(),
            with(0b1110, &frame_of(PEER, Kind::Pong, 0, &7u64.to_le_bytes())),
        ),
    ];
    for (i, (kind, body)) in bodies().into_iter().enumerate() {
        seeds.push((
            format!("body-{i:02}-{kind:?}"),
            with(3, &[&[kind as u8][..], &body].concat()),
        ));
    }
    seeds
}

#[test]
fn every_seed_is_accepted_by_the_node_today() {
    for (kind, body) in bodies() {
        let decoded = wire::decode(kind, &body, &bounds(), PEER.node_id);
        assert!(matches!(decoded, Some(Ok(_))), "{kind:?} body refused");
    }
    let stream = stream();
    let mut off = 0;
    while off < stream.len() {
        let f = frame::decode(&stream[off..], FrameLimits::default())
            .unwrap()
            .expect("whole frames");
        assert_eq!(proto::rpc::check_sender(&f.header, PEER), Ok(()));
        off += f.wire_len();
    }
    let (to_listener, to_dialer) = handshakes();
    let mut listener = Handshake::listener(&key(), ME, &[2, 3], NONCE_ME);
    let step = listener.receive(&to_listener, &mut Vec::new());
    assert!(matches!(
        step.outcome,
        proto::rpc::Outcome::Established { .. }
    ));
    let mut dialer = Handshake::dialer(&key(), ME, PEER.node_id, NONCE_ME, &mut Vec::new());
    let step = dialer.receive(&to_dialer, &mut Vec::new());
    assert!(matches!(
        step.outcome,
        proto::rpc::Outcome::Established { .. }
    ));
}

#[test]
fn the_committed_seeds_are_the_generated_ones() {
    let seeds = seeds();
    if std::env::var_os("IMROUTER_WRITE_FUZZ_SEEDS").is_some() {
        std::fs::create_dir_all(SEEDS_DIR).unwrap();
        for (name, bytes) in &seeds {
            std::fs::write(format!("{SEEDS_DIR}/{name}"), bytes).unwrap();
        }
    }
    for (name, bytes) in &seeds {
        let committed = std::fs::read(format!("{SEEDS_DIR}/{name}")).unwrap_or_else(|e| {
            panic!("seed {name}: {e} (IMROUTER_WRITE_FUZZ_SEEDS=1 writes them)")
        });
        assert!(
            committed == *bytes,
            "seed {name} is stale: IMROUTER_WRITE_FUZZ_SEEDS=1 rewrites the seeds"
        );
    }
    let files = std::fs::read_dir(SEEDS_DIR).unwrap().count();
    assert_eq!(files, seeds.len(), "no seed the generator does not make");
}
