//! The server key pairs of CONNECTs (issue 14, connect storm): each shard makes a
//! bounded pool of X25519 key pairs ahead, on idle turns (`[connect] key_pool_max`);
//! a CONNECT takes one (or makes one on the spot when the pool is empty, counted).
//! Either way the session's key agreement works (SEND and RECV decrypt), and no two
//! connections get the same server key. Key agreements run a bounded number per
//! loop turn (`key_agreements_per_turn`): CONNECTs beyond wait their turn, none lost.

// Test configs change a few nested fields of the defaults.
#![allow(clippy::field_reassign_with_default)]

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use engine::node::{Node, NodeConfig};
use net::wkproto::{decode, peek_frame_len, ConnectPacket, DeviceFlag, Frame, MAX_FRAME_BYTES};

mod support;
use support::{metric, next_recv, next_sendack, set_token};

fn node(pool_max: usize) -> (tempfile::TempDir, Node) {
    node_with(pool_max, 8)
}

fn node_with(pool_max: usize, agreements_per_turn: usize) -> (tempfile::TempDir, Node) {
    let dir = tempfile::tempdir().unwrap();
    let mut config: NodeConfig = support::config(dir.path(), net::io::Backend::Mio);
    config.connect.key_pool_max = pool_max;
    config.connect.key_pool_refill_per_turn = 2;
    config.connect.key_agreements_per_turn = agreements_per_turn;
    let node = Node::start(config).unwrap();
    (dir, node)
}

/// Waits until every shard's pool is full (a failure detector: a pool that never
/// fills fails the test after 10 s).
fn wait_pools_full(node: &Node, pairs: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(node, "imrouter_connect_key_pool_pairs") != pairs {
        assert!(Instant::now() < deadline, "the key pools never filled");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The CONNACK's `server_key` for one raw CONNECT of `uid` (success asserted).
fn server_key_of(node: &Node, uid: &str) -> String {
    let key = net::crypto::ClientKey::new([3u8; 32]);
    let mut tcp = TcpStream::connect(node.tcp_addr().unwrap()).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let token = format!("tok-{uid}");
    let connect = ConnectPacket {
        version: 4,
        device_flag: DeviceFlag(1),
        device_id: "d",
        uid,
        token: &token,
        client_key: key.client_key(),
        ..Default::default()
    };
    let mut out = Vec::new();
    connect.encode(0, &mut out).unwrap();
    tcp.write_all(&out).unwrap();
    let mut rx = Vec::new();
    let mut buf = [0u8; 512];
    loop {
        if let Some(n) = peek_frame_len(&rx, MAX_FRAME_BYTES).unwrap() {
            if n <= rx.len() {
                break;
            }
        }
        let n = tcp.read(&mut buf).unwrap();
        assert!(n > 0, "closed before CONNACK");
        rx.extend_from_slice(&buf[..n]);
    }
    match decode(&rx, 4, MAX_FRAME_BYTES).unwrap() {
        Some((Frame::Connack(c), _)) => {
            assert_eq!(c.reason_code.0, 1, "CONNACK for {uid}");
            c.server_key.to_owned()
        }
        other => panic!("expected CONNACK, got {other:?}"),
    }
}

/// Logs in `uids` at once, one thread each (CONNACK success asserted).
fn login_at_once(node: &Node, uids: &[String]) -> Vec<net::client::Client> {
    std::thread::scope(|s| {
        let handles: Vec<_> = uids
            .iter()
            .map(|u| s.spawn(move || support::login(node, u)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Logs in `uids` in turn; each sends an encrypted message to the next, which
/// reads it decrypted with a valid msg_key.
fn chat_around(node: &Node, uids: &[String]) {
    let clients: Vec<_> = uids.iter().map(|u| support::login(node, u)).collect();
    chat(clients, uids);
}

/// Each of `clients` (logged in as `uids`) sends an encrypted message to the next,
/// which reads it decrypted with a valid msg_key.
fn chat(mut clients: Vec<net::client::Client>, uids: &[String]) {
    for i in 0..clients.len() {
        let to = &uids[(i + 1) % uids.len()];
        let payload = format!("{{\"n\":{i}}}");
        clients[i]
            .send(to, 1, 1, "cmn", payload.as_bytes(), true)
            .unwrap();
        assert_eq!(next_sendack(&mut clients[i]).3, 1, "SENDACK of {}", uids[i]);
        let j = (i + 1) % clients.len();
        let m = next_recv(&mut clients[j]);
        assert!(m.msg_key_ok, "msg_key of the RECV to {to}");
        assert_eq!(m.payload, payload.as_bytes());
        clients[j].recvack(m.message_id, m.message_seq).unwrap();
    }
}

/// Pairs made ahead serve the first CONNECTs (none made on the spot) and give
/// working sessions.
#[test]
fn connects_served_from_the_pools_get_working_sessions() {
    let (_dir, node) = node(8);
    wait_pools_full(&node, 16);
    let uids: Vec<String> = (0..8).map(|i| format!("p{i}")).collect();
    for u in &uids {
        set_token(&node, u, 1, 1);
    }
    chat_around(&node, &uids);
    assert_eq!(metric(&node, "imrouter_connect_keys_made_inline_total"), 0);
    assert_eq!(metric(&node, "imrouter_activations_total"), 8);
}

/// Without a pool every CONNECT makes its own pair (each counted), and the
/// sessions work the same.
#[test]
fn without_a_pool_each_connect_makes_its_pair() {
    let (_dir, node) = node(0);
    let uids: Vec<String> = (0..6).map(|i| format!("n{i}")).collect();
    for u in &uids {
        set_token(&node, u, 1, 1);
    }
    chat_around(&node, &uids);
    assert_eq!(metric(&node, "imrouter_connect_keys_made_inline_total"), 6);
    assert_eq!(metric(&node, "imrouter_connect_key_pool_pairs"), 0);
}

/// More CONNECTs than the pools hold: pairs made ahead, then pairs made on the
/// spot; no server key is ever handed out twice.
#[test]
fn no_two_connections_get_the_same_server_key() {
    let (_dir, node) = node(4);
    wait_pools_full(&node, 8);
    let mut keys = HashSet::new();
    for i in 0..40 {
        let uid = format!("k{i}");
        set_token(&node, &uid, 1, 1);
        let key = server_key_of(&node, &uid);
        assert!(
            keys.insert(key.clone()),
            "server key {key} handed out twice"
        );
    }
}

/// One key agreement per turn and 32 CONNECTs at once: those beyond wait their turn
/// in order, none is lost, and every session works.
#[test]
fn connects_beyond_the_turns_agreements_wait_and_all_get_sessions() {
    let (_dir, node) = node_with(0, 1);
    let uids: Vec<String> = (0..32).map(|i| format!("q{i}")).collect();
    for u in &uids {
        set_token(&node, u, 1, 1);
    }
    let clients = login_at_once(&node, &uids);
    chat(clients, &uids);
    assert_eq!(metric(&node, "imrouter_activations_total"), 32);
    assert_eq!(metric(&node, "imrouter_connect_keys_made_inline_total"), 32);
}
