//! The inter-node handshake (`proto::rpc::auth`): both sides established with the
//! same secret; a wrong secret refused on both sides; replayed and reflected
//! messages refused; a peer claiming other ids refused; nothing but the handshake
//! before authentication; a peer of another cluster id or slot-id count refused
//! by name on both sides, and terms rewritten on the way refused by the MAC. The
//! transcript documented in `auth.rs` is recomputed here independently with `hmac`.
//!
//! Seeds: `RPC_TEST_SEED=<u64>` replays a run; every failure message names its seed.

use hmac::{Hmac, Mac};
use proto::rpc::auth::{HANDSHAKE_FRAME_BYTES_MAX, HELLO_BODY_BYTES, NONCE_BYTES};
use proto::rpc::frame::{decode, encode, FrameError, FrameLimits, Header, Kind, HEADER_BYTES};
use proto::rpc::{
    check_sender, ClusterId, ClusterKey, ClusterSecret, Handshake, Identity, Outcome, Refusal,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sha2::Sha256;

const SECRET: &[u8] = b"the cluster secret, 32 bytes ok.";
const CLUSTER: &str = "test-cluster";
const SLOT_IDS: u32 = 64;
const D: Identity = Identity {
    node_id: 1,
    boot_id: 0xd1d1,
};
const L: Identity = Identity {
    node_id: 2,
    boot_id: 0x1212,
};
/// The peers node L accepts.
const PEERS_OF_L: &[u64] = &[1, 3];

fn seed() -> u64 {
    std::env::var("RPC_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x1313_2026)
}

/// The key of the test cluster with the secret `bytes`.
fn secret(bytes: &[u8]) -> ClusterKey {
    key(bytes, CLUSTER, SLOT_IDS)
}

fn key(bytes: &[u8], cluster: &str, slot_ids: u32) -> ClusterKey {
    let id = ClusterId::new(cluster).unwrap();
    ClusterKey::new(ClusterSecret::new(bytes).unwrap(), id, slot_ids)
}

/// One side's terms as documented: the cluster id zero-padded to 32 bytes, the
/// slot-id count in 4 bytes little-endian.
fn terms(cluster: &str, slot_ids: u32) -> Vec<u8> {
    let mut t = cluster.as_bytes().to_vec();
    t.resize(32, 0);
    t.extend_from_slice(&slot_ids.to_le_bytes());
    t
}

/// A Hello body as documented: the nonce, then the terms.
fn hello_body(nonce_d: &[u8], cluster: &str, slot_ids: u32) -> Vec<u8> {
    [nonce_d, &terms(cluster, slot_ids)].concat()
}

/// A Hello of the test cluster from D.
fn hello_of_d(nonce_d: &[u8]) -> Vec<u8> {
    frame(
        header(Kind::Hello, D),
        &hello_body(nonce_d, CLUSTER, SLOT_IDS),
    )
}

fn nonce(rng: &mut StdRng) -> [u8; NONCE_BYTES] {
    rng.gen()
}

fn limits() -> FrameLimits {
    FrameLimits::default()
}

/// The one frame in `bytes`.
fn only_frame(bytes: &[u8]) -> (Header, Vec<u8>) {
    let f = decode(bytes, limits()).unwrap().expect("a whole frame");
    assert_eq!(f.wire_len(), bytes.len(), "exactly one frame");
    (f.header, f.body.to_vec())
}

fn frame(header: Header, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    encode(&header, body, limits(), &mut out).unwrap();
    out
}

/// The frame in `bytes` with its header changed by `f`.
fn rewrite(bytes: &[u8], f: impl FnOnce(&mut Header)) -> Vec<u8> {
    let (mut header, body) = only_frame(bytes);
    f(&mut header);
    frame(header, &body)
}

fn established(peer: Identity) -> Outcome {
    Outcome::Established {
        peer_node_id: peer.node_id,
        peer_boot_id: peer.boot_id,
    }
}

/// Moves bytes both ways until neither side moves; returns both outcomes.
fn exchange(
    dialer: &mut Handshake,
    to_listener: &mut Vec<u8>,
    listener: &mut Handshake,
) -> (Outcome, Outcome) {
    let mut to_dialer = Vec::new();
    for _ in 0..8 {
        let step = listener.receive(to_listener, &mut to_dialer);
        to_listener.drain(..step.consumed);
        let step = dialer.receive(&to_dialer, to_listener);
        to_dialer.drain(..step.consumed);
    }
    (dialer.outcome(), listener.outcome())
}

/// HMAC-SHA256 of the documented transcript (both sides of the test cluster's
/// terms), computed here independently.
fn documented_mac(
    key: &[u8],
    label: &str,
    d: Identity,
    l: Identity,
    nonce_d: &[u8],
    nonce_l: &[u8],
) -> Vec<u8> {
    let terms = terms(CLUSTER, SLOT_IDS);
    documented_mac_of_terms(key, label, (d, l), (nonce_d, nonce_l), (&terms, &terms))
}

/// The documented dialer or listener MAC over the given terms of D and L.
fn documented_mac_of_terms(
    key: &[u8],
    label: &str,
    (d, l): (Identity, Identity),
    (nonce_d, nonce_l): (&[u8], &[u8]),
    (terms_d, terms_l): (&[u8], &[u8]),
) -> Vec<u8> {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).unwrap();
    mac.update(label.as_bytes());
    for id in [d.node_id, d.boot_id, l.node_id, l.boot_id] {
        mac.update(&id.to_le_bytes());
    }
    mac.update(nonce_d);
    mac.update(nonce_l);
    mac.update(terms_d);
    mac.update(terms_l);
    mac.finalize().into_bytes().to_vec()
}

fn header(kind: Kind, me: Identity) -> Header {
    Header {
        kind,
        flags: 0,
        sender_node_id: me.node_id,
        sender_boot_id: me.boot_id,
        request_id: 0,
        deadline_ms: 0,
    }
}

#[test]
fn both_sides_are_established_with_the_same_secret() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for round in 0..50 {
        let mut wire = Vec::new();
        let mut dialer =
            Handshake::dialer(&secret(SECRET), D, L.node_id, nonce(&mut rng), &mut wire);
        let mut listener = Handshake::listener(&secret(SECRET), L, PEERS_OF_L, nonce(&mut rng));
        let (d, l) = exchange(&mut dialer, &mut wire, &mut listener);
        assert_eq!(
            (d, l),
            (established(L), established(D)),
            "seed {seed} round {round}"
        );
        assert!(wire.is_empty(), "seed {seed}: nothing left over");
    }
}

#[test]
fn byte_by_byte_delivery_and_a_pipelined_request_after_the_proof() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut to_l = Vec::new();
    let mut dialer = Handshake::dialer(&secret(SECRET), D, L.node_id, nonce(&mut rng), &mut to_l);
    let mut listener = Handshake::listener(&secret(SECRET), L, PEERS_OF_L, nonce(&mut rng));
    let mut to_d = Vec::new();
    for len in 0..=to_l.len() {
        let step = listener.receive(&to_l[..len], &mut to_d);
        assert_eq!(step.outcome, Outcome::Pending, "seed {seed}");
        if len < to_l.len() {
            assert_eq!(
                (step.consumed, to_d.len()),
                (0, 0),
                "seed {seed}: prefix {len}"
            );
        }
    }
    to_l.clear();
    for len in 0..to_d.len() {
        assert_eq!(
            dialer.receive(&to_d[..len], &mut to_l).outcome,
            Outcome::Pending
        );
    }
    assert_eq!(dialer.receive(&to_d, &mut to_l).outcome, established(L));
    // The dialer's first request goes right behind its Proof.
    let request = Header {
        request_id: 7,
        deadline_ms: 250,
        ..header(Kind::Push, D)
    };
    encode(&request, b"hello", limits(), &mut to_l).unwrap();
    let step = listener.receive(&to_l, &mut Vec::new());
    assert_eq!(step.outcome, established(D), "seed {seed}");
    let rest = decode(&to_l[step.consumed..], limits()).unwrap().unwrap();
    assert_eq!((rest.header, rest.body), (request, &b"hello"[..]));
    assert_eq!(check_sender(&rest.header, D), Ok(()));
    assert!(check_sender(&header(Kind::Push, Identity { boot_id: 9, ..D }), D).is_err());
    assert_eq!(
        listener
            .receive(&to_l[step.consumed..], &mut Vec::new())
            .consumed,
        0
    );
}

#[test]
fn a_wrong_secret_is_refused_on_both_sides() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let other = b"another secret, also 32 bytes...";
    // Both machines: the dialer refuses the Challenge and says why; the listener
    // reads the Goodbye.
    let mut wire = Vec::new();
    let mut dialer = Handshake::dialer(&secret(other), D, L.node_id, nonce(&mut rng), &mut wire);
    let mut listener = Handshake::listener(&secret(SECRET), L, PEERS_OF_L, nonce(&mut rng));
    let (d, l) = exchange(&mut dialer, &mut wire, &mut listener);
    assert_eq!(d, Outcome::Refused(Refusal::BadMac), "seed {seed}");
    assert_eq!(l, Outcome::Refused(Refusal::PeerGoodbye), "seed {seed}");
    // A dialer that ignores the Challenge and sends a Proof made with its own
    // (wrong) secret is refused by the listener itself; the right secret, per the
    // documented transcript, is accepted.
    for (key, want) in [
        (&other[..], Outcome::Refused(Refusal::BadMac)),
        (SECRET, established(D)),
    ] {
        let nonce_d = nonce(&mut rng);
        let mut listener = Handshake::listener(&secret(SECRET), L, PEERS_OF_L, nonce(&mut rng));
        let mut challenge = Vec::new();
        listener.receive(&hello_of_d(&nonce_d), &mut challenge);
        let (_, body) = only_frame(&challenge);
        let mac_d = documented_mac(key, "imrouter rpc v2 dialer", D, L, &nonce_d, &body[..32]);
        let mut goodbye = Vec::new();
        let step = listener.receive(&frame(header(Kind::Proof, D), &mac_d), &mut goodbye);
        assert_eq!(step.outcome, want, "seed {seed}");
        if want != established(D) {
            let (h, reason) = only_frame(&goodbye);
            assert_eq!(h.kind, Kind::Goodbye);
            assert!(String::from_utf8(reason).unwrap().contains("MAC"));
        }
    }
}

#[test]
fn the_documented_listener_mac_is_the_one_sent() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let (nonce_d, nonce_l) = (nonce(&mut rng), nonce(&mut rng));
    let mut listener = Handshake::listener(&secret(SECRET), L, PEERS_OF_L, nonce_l);
    let mut out = Vec::new();
    listener.receive(&hello_of_d(&nonce_d), &mut out);
    let (h, body) = only_frame(&out);
    assert_eq!(
        (h.kind, h.sender_node_id, h.sender_boot_id),
        (Kind::Challenge, L.node_id, L.boot_id)
    );
    assert_eq!(&body[..32], &nonce_l);
    assert_eq!(&body[32..68], &terms(CLUSTER, SLOT_IDS)[..]);
    let want = documented_mac(SECRET, "imrouter rpc v2 listener", D, L, &nonce_d, &nonce_l);
    assert_eq!(&body[68..], &want[..], "seed {seed}");
}

/// One complete session; returns the bytes each side sent.
fn recorded_session(rng: &mut StdRng) -> (Vec<u8>, Vec<u8>) {
    let mut hello = Vec::new();
    let mut dialer = Handshake::dialer(&secret(SECRET), D, L.node_id, nonce(rng), &mut hello);
    let mut listener = Handshake::listener(&secret(SECRET), L, PEERS_OF_L, nonce(rng));
    let mut challenge = Vec::new();
    listener.receive(&hello, &mut challenge);
    let mut proof = Vec::new();
    dialer.receive(&challenge, &mut proof);
    assert_eq!(
        listener.receive(&proof, &mut Vec::new()).outcome,
        established(D)
    );
    hello.extend_from_slice(&proof);
    (hello, challenge)
}

#[test]
fn a_replayed_transcript_is_refused_by_either_side() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let (dialer_bytes, listener_bytes) = recorded_session(&mut rng);
    // The dialer's Hello and Proof replayed to a new listener session.
    let mut listener = Handshake::listener(&secret(SECRET), L, PEERS_OF_L, nonce(&mut rng));
    let step = listener.receive(&dialer_bytes, &mut Vec::new());
    assert_eq!(
        step.outcome,
        Outcome::Refused(Refusal::BadMac),
        "seed {seed}"
    );
    // The listener's Challenge replayed to a new dialer session.
    let mut out = Vec::new();
    let mut dialer = Handshake::dialer(&secret(SECRET), D, L.node_id, nonce(&mut rng), &mut out);
    let step = dialer.receive(&listener_bytes, &mut out);
    assert_eq!(
        step.outcome,
        Outcome::Refused(Refusal::BadMac),
        "seed {seed}"
    );
}

#[test]
fn reflected_messages_are_refused() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    // A dialer's own Hello sent back to it.
    let mut hello = Vec::new();
    let mut dialer = Handshake::dialer(&secret(SECRET), D, L.node_id, nonce(&mut rng), &mut hello);
    let step = dialer.receive(&hello, &mut Vec::new());
    let unexpected = Refusal::Unexpected {
        got: Kind::Hello,
        expected: Kind::Challenge,
    };
    assert_eq!(step.outcome, Outcome::Refused(unexpected), "seed {seed}");
    // A listener's own Challenge sent back to it, then its MAC relabelled a Proof.
    let nonce_l = nonce(&mut rng);
    let hello = hello_of_d(&nonce(&mut rng));
    for relabel in [false, true] {
        let mut listener = Handshake::listener(&secret(SECRET), L, PEERS_OF_L, nonce_l);
        let mut challenge = Vec::new();
        listener.receive(&hello, &mut challenge);
        let (_, body) = only_frame(&challenge);
        let (reflected, want) = if relabel {
            (frame(header(Kind::Proof, D), &body[68..]), Refusal::BadMac)
        } else {
            (
                challenge.clone(),
                Refusal::Unexpected {
                    got: Kind::Challenge,
                    expected: Kind::Proof,
                },
            )
        };
        let step = listener.receive(&reflected, &mut Vec::new());
        assert_eq!(
            step.outcome,
            Outcome::Refused(want),
            "seed {seed} relabel {relabel}"
        );
    }
    // A Hello carrying the listener's own nonce.
    let mut listener = Handshake::listener(&secret(SECRET), L, PEERS_OF_L, nonce_l);
    let step = listener.receive(&hello_of_d(&nonce_l), &mut Vec::new());
    assert_eq!(
        step.outcome,
        Outcome::Refused(Refusal::ReflectedNonce),
        "seed {seed}"
    );
}

#[test]
fn a_challenge_from_the_dialers_own_listener_is_refused() {
    // An attacker answering D's dial to L takes D's Hello to D's own listener,
    // claiming to be L, and returns D's Challenge to D's dialer as L's.
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut hello = Vec::new();
    let mut dialer = Handshake::dialer(&secret(SECRET), D, L.node_id, nonce(&mut rng), &mut hello);
    let mut own_listener = Handshake::listener(&secret(SECRET), D, &[2, 3], nonce(&mut rng));
    let as_l = rewrite(&hello, |h| {
        (h.sender_node_id, h.sender_boot_id) = (L.node_id, L.boot_id)
    });
    let mut challenge = Vec::new();
    assert_eq!(
        own_listener.receive(&as_l, &mut challenge).outcome,
        Outcome::Pending
    );
    let wrong_peer = Refusal::WrongPeer {
        expected: L.node_id,
        got: D.node_id,
    };
    let step = dialer.receive(&challenge, &mut Vec::new());
    assert_eq!(step.outcome, Outcome::Refused(wrong_peer), "seed {seed}");
    // Same, with the Challenge's header rewritten to name L.
    let mut hello = Vec::new();
    let mut dialer = Handshake::dialer(&secret(SECRET), D, L.node_id, nonce(&mut rng), &mut hello);
    let mut own_listener = Handshake::listener(&secret(SECRET), D, &[2, 3], nonce(&mut rng));
    let as_l = rewrite(&hello, |h| {
        (h.sender_node_id, h.sender_boot_id) = (L.node_id, L.boot_id)
    });
    let mut challenge = Vec::new();
    own_listener.receive(&as_l, &mut challenge);
    let challenge = rewrite(&challenge, |h| {
        (h.sender_node_id, h.sender_boot_id) = (L.node_id, L.boot_id)
    });
    let step = dialer.receive(&challenge, &mut Vec::new());
    assert_eq!(
        step.outcome,
        Outcome::Refused(Refusal::BadMac),
        "seed {seed}"
    );
}

#[test]
fn a_peer_claiming_other_ids_is_refused() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    // Not a peer of L, or L itself.
    for id in [4, L.node_id] {
        let mut listener = Handshake::listener(&secret(SECRET), L, PEERS_OF_L, nonce(&mut rng));
        let hello = frame(
            header(Kind::Hello, Identity { node_id: id, ..D }),
            &hello_body(&nonce(&mut rng), CLUSTER, SLOT_IDS),
        );
        let step = listener.receive(&hello, &mut Vec::new());
        assert_eq!(
            step.outcome,
            Outcome::Refused(Refusal::UnknownPeer(id)),
            "seed {seed}"
        );
    }
    // Node 3 answers a dial to node 2.
    let mut wire = Vec::new();
    let mut dialer = Handshake::dialer(&secret(SECRET), D, L.node_id, nonce(&mut rng), &mut wire);
    let node3 = Identity {
        node_id: 3,
        boot_id: 33,
    };
    let mut listener = Handshake::listener(&secret(SECRET), node3, &[1, 2], nonce(&mut rng));
    let (d, _) = exchange(&mut dialer, &mut wire, &mut listener);
    let wrong_peer = Refusal::WrongPeer {
        expected: L.node_id,
        got: 3,
    };
    assert_eq!(d, Outcome::Refused(wrong_peer), "seed {seed}");
    // A man in the middle rewriting the Hello's node id (to another peer) or boot
    // id: the MACs bind the ids, the dialer refuses the Challenge.
    let rewrites: [fn(&mut Header); 2] = [|h| h.sender_node_id = 3, |h| h.sender_boot_id += 1];
    for (i, f) in rewrites.into_iter().enumerate() {
        let mut hello = Vec::new();
        let mut dialer =
            Handshake::dialer(&secret(SECRET), D, L.node_id, nonce(&mut rng), &mut hello);
        let mut listener = Handshake::listener(&secret(SECRET), L, PEERS_OF_L, nonce(&mut rng));
        let mut challenge = Vec::new();
        listener.receive(&rewrite(&hello, f), &mut challenge);
        let step = dialer.receive(&challenge, &mut Vec::new());
        assert_eq!(
            step.outcome,
            Outcome::Refused(Refusal::BadMac),
            "seed {seed} rewrite {i}"
        );
    }
    // A Proof sent under other ids than the Hello's.
    let mut hello = Vec::new();
    let mut dialer = Handshake::dialer(&secret(SECRET), D, L.node_id, nonce(&mut rng), &mut hello);
    let mut listener = Handshake::listener(&secret(SECRET), L, PEERS_OF_L, nonce(&mut rng));
    let mut challenge = Vec::new();
    listener.receive(&hello, &mut challenge);
    let mut proof = Vec::new();
    dialer.receive(&challenge, &mut proof);
    let step = listener.receive(&rewrite(&proof, |h| h.sender_node_id = 3), &mut Vec::new());
    assert_eq!(
        step.outcome,
        Outcome::Refused(Refusal::SenderChanged),
        "seed {seed}"
    );
}

#[test]
fn nothing_but_the_handshake_is_served_before_authentication() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let new_listener =
        |rng: &mut StdRng| Handshake::listener(&secret(SECRET), L, PEERS_OF_L, nonce(rng));
    for kind in Kind::ALL
        .into_iter()
        .filter(|k| !matches!(k, Kind::Hello | Kind::Goodbye))
    {
        let mut out = Vec::new();
        let step = new_listener(&mut rng).receive(&frame(header(kind, D), &[0; 32]), &mut out);
        let want = Refusal::Unexpected {
            got: kind,
            expected: Kind::Hello,
        };
        assert_eq!(step.outcome, Outcome::Refused(want), "seed {seed}");
        assert_eq!(only_frame(&out).0.kind, Kind::Goodbye);
    }
    // A Hello too large to be one: refused from its header, before the body.
    let mut big = frame(header(Kind::Hello, D), &vec![0; HANDSHAKE_FRAME_BYTES_MAX]);
    big.truncate(HEADER_BYTES);
    let step = new_listener(&mut rng).receive(&big, &mut Vec::new());
    let too_large = FrameError::TooLarge {
        frame_bytes: HEADER_BYTES + HANDSHAKE_FRAME_BYTES_MAX,
        bytes_max: HANDSHAKE_FRAME_BYTES_MAX,
    };
    assert_eq!(
        step.outcome,
        Outcome::Refused(Refusal::Frame(too_large)),
        "seed {seed}"
    );
    // A Hello of the wrong size.
    let step =
        new_listener(&mut rng).receive(&frame(header(Kind::Hello, D), &[1; 31]), &mut Vec::new());
    let bad_body = Refusal::BadBody {
        kind: Kind::Hello,
        body_bytes: 31,
        expected_bytes: HELLO_BODY_BYTES,
    };
    assert_eq!(step.outcome, Outcome::Refused(bad_body), "seed {seed}");
    // Garbage: never established, never a panic; refused once a header's worth arrived.
    for i in 0..5_000 {
        let garbage: Vec<u8> = (0..rng.gen_range(0..200)).map(|_| rng.gen()).collect();
        let step = new_listener(&mut rng).receive(&garbage, &mut Vec::new());
        match step.outcome {
            Outcome::Refused(_) => {}
            Outcome::Pending => assert!(garbage.len() < HEADER_BYTES, "seed {seed} input {i}"),
            Outcome::Established { .. } => panic!("seed {seed} input {i}: garbage established"),
        }
    }
}

#[test]
fn a_short_secret_is_refused_and_never_printed() {
    assert!(ClusterSecret::new(b"short").is_err());
    let s = secret(SECRET);
    assert!(!format!("{s:?}").contains("cluster secret"), "{s:?}");
}

/// Runs one handshake between a dialer D and a listener L with the given terms
/// (the listener's bytes, then the dialer's answer); returns both outcomes and the
/// listener's Goodbye reason, if it sent one.
fn handshake_of(
    seed: u64,
    (d_cluster, d_slot_ids): (&str, u32),
    (l_cluster, l_slot_ids): (&str, u32),
) -> (Outcome, Outcome, Option<String>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (dk, lk) = (
        key(SECRET, d_cluster, d_slot_ids),
        key(SECRET, l_cluster, l_slot_ids),
    );
    let mut hello = Vec::new();
    let mut dialer = Handshake::dialer(&dk, D, L.node_id, nonce(&mut rng), &mut hello);
    let mut listener = Handshake::listener(&lk, L, PEERS_OF_L, nonce(&mut rng));
    let mut to_d = Vec::new();
    assert_eq!(listener.receive(&hello, &mut to_d).consumed, hello.len());
    let mut to_l = Vec::new();
    let d = dialer.receive(&to_d, &mut to_l);
    let goodbye = decode(&to_d[d.consumed..], limits())
        .unwrap()
        .map(|f| (f.header.kind, String::from_utf8_lossy(f.body).into_owned()));
    let goodbye = goodbye.and_then(|(kind, why)| (kind == Kind::Goodbye).then_some(why));
    listener.receive(&to_l, &mut Vec::new());
    (d.outcome, listener.outcome(), goodbye)
}

#[test]
fn a_peer_of_another_cluster_is_refused_by_name_on_both_sides() {
    let seed = seed();
    let (blue, green) = (
        ClusterId::new("blue").unwrap(),
        ClusterId::new("green").unwrap(),
    );
    let (d, l, goodbye) = handshake_of(seed, ("blue", SLOT_IDS), ("green", SLOT_IDS));
    let refused = |peer, ours| Outcome::Refused(Refusal::OtherCluster { peer, ours });
    assert_eq!(
        d,
        refused(green, blue),
        "seed {seed}: the dialer names both"
    );
    assert_eq!(
        l,
        refused(blue, green),
        "seed {seed}: the listener names both"
    );
    let Outcome::Refused(why) = l else {
        unreachable!()
    };
    let text = r#"peer is of cluster "blue", this node of cluster "green""#;
    assert_eq!(why.to_string(), text);
    assert_eq!(
        goodbye.as_deref(),
        Some(text),
        "seed {seed}: the Goodbye says why"
    );
}

#[test]
fn a_peer_with_another_slot_id_count_is_refused_by_name_on_both_sides() {
    let seed = seed();
    let (d, l, goodbye) = handshake_of(seed, (CLUSTER, 64), (CLUSTER, 128));
    let refused = |peer, ours| Outcome::Refused(Refusal::OtherSlotIds { peer, ours });
    assert_eq!(d, refused(128, 64), "seed {seed}: the dialer names both");
    assert_eq!(l, refused(64, 128), "seed {seed}: the listener names both");
    let text = "peer has 64 slot ids, this node 128";
    assert_eq!(goodbye.as_deref(), Some(text), "seed {seed}");
    // The cluster id is compared first; equal terms are established.
    let (d, l, _) = handshake_of(seed, ("blue", 64), ("green", 128));
    assert!(
        matches!(d, Outcome::Refused(Refusal::OtherCluster { .. })),
        "{d:?}"
    );
    assert!(
        matches!(l, Outcome::Refused(Refusal::OtherCluster { .. })),
        "{l:?}"
    );
    let (d, l, goodbye) = handshake_of(seed, ("blue", 128), ("blue", 128));
    assert_eq!((d, l, goodbye), (established(L), established(D), None));
}

/// The frame in `bytes` with the terms at `at` in its body replaced.
fn rewrite_terms(bytes: &[u8], at: usize, cluster: &str, slot_ids: u32) -> Vec<u8> {
    let (header, mut body) = only_frame(bytes);
    body[at..at + 36].copy_from_slice(&terms(cluster, slot_ids));
    frame(header, &body)
}

#[test]
fn terms_rewritten_on_the_way_fail_the_mac() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    // D of cluster "blue" dials L of cluster "green" (or of another slot-id
    // count); a man in the middle rewrites the Hello's terms to L's, and the
    // Challenge's to D's: each side sees its own terms, the dialer's MAC check
    // fails. The same for a rewritten Challenge alone (same terms on both sides):
    // a claim the MAC does not vouch for is never named.
    let cases = [
        (("blue", 64), ("green", 64), true),
        (("blue", 64), ("blue", 32), true),
        ((CLUSTER, SLOT_IDS), ("other", SLOT_IDS), false),
        ((CLUSTER, SLOT_IDS), (CLUSTER, 8), false),
    ];
    for (i, ((dc, ds), (lc, ls), rewrite_hello)) in cases.into_iter().enumerate() {
        let lk = if rewrite_hello {
            key(SECRET, lc, ls)
        } else {
            secret(SECRET)
        };
        let mut hello = Vec::new();
        let mut dialer = Handshake::dialer(
            &key(SECRET, dc, ds),
            D,
            L.node_id,
            nonce(&mut rng),
            &mut hello,
        );
        let mut listener = Handshake::listener(&lk, L, PEERS_OF_L, nonce(&mut rng));
        if rewrite_hello {
            hello = rewrite_terms(&hello, 32, lc, ls);
        }
        let mut challenge = Vec::new();
        let step = listener.receive(&hello, &mut challenge);
        assert_eq!(step.outcome, Outcome::Pending, "seed {seed} case {i}");
        let (dc, ds) = if rewrite_hello { (dc, ds) } else { (lc, ls) };
        let challenge = rewrite_terms(&challenge, 32, dc, ds);
        let step = dialer.receive(&challenge, &mut Vec::new());
        assert_eq!(
            step.outcome,
            Outcome::Refused(Refusal::BadMac),
            "seed {seed} case {i}"
        );
    }
    // The listener's side: a Hello of cluster "blue" rewritten to claim "green"
    // (L's), then a Proof MACed over what D really sent: refused. Over what L saw:
    // accepted (the documented MAC).
    let blue = terms("blue", SLOT_IDS);
    let green = terms("green", SLOT_IDS);
    for (terms_d, want) in [
        (&blue, Outcome::Refused(Refusal::BadMac)),
        (&green, established(D)),
    ] {
        let nonce_d = nonce(&mut rng);
        let nonce_l = nonce(&mut rng);
        let mut listener =
            Handshake::listener(&key(SECRET, "green", SLOT_IDS), L, PEERS_OF_L, nonce_l);
        let hello = frame(
            header(Kind::Hello, D),
            &hello_body(&nonce_d, "green", SLOT_IDS),
        );
        listener.receive(&hello, &mut Vec::new());
        let label = "imrouter rpc v2 dialer";
        let mac_d = documented_mac_of_terms(
            SECRET,
            label,
            (D, L),
            (&nonce_d, &nonce_l),
            (terms_d, &green),
        );
        let step = listener.receive(&frame(header(Kind::Proof, D), &mac_d), &mut Vec::new());
        assert_eq!(step.outcome, want, "seed {seed}");
    }
}

#[test]
fn a_malformed_cluster_id_is_refused() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut bad = terms("a b", SLOT_IDS);
    let padding_not_zero = {
        let mut t = terms("blue", SLOT_IDS);
        t[10] = b'x';
        t
    };
    for (i, t) in [
        std::mem::take(&mut bad),
        padding_not_zero,
        terms("", SLOT_IDS),
    ]
    .iter()
    .enumerate()
    {
        let mut listener = Handshake::listener(&secret(SECRET), L, PEERS_OF_L, nonce(&mut rng));
        let body = [&nonce(&mut rng)[..], t].concat();
        let step = listener.receive(&frame(header(Kind::Hello, D), &body), &mut Vec::new());
        let want = Outcome::Refused(Refusal::BadClusterId(Kind::Hello));
        assert_eq!(step.outcome, want, "seed {seed} case {i}");
    }
    for ok in ["a", "prod-eu.1_B", &"x".repeat(32)] {
        assert_eq!(
            ClusterId::new(ok).map(|id| id.to_string()).as_deref(),
            Ok(ok)
        );
    }
    for no in ["", "a b", "ü", "a\n", &"x".repeat(33)] {
        assert!(ClusterId::new(no).is_err(), "{no:?}");
    }
}
