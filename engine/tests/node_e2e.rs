//! One node end to end through real sockets on loopback: activation, CONNACK
//! reasons, person and group delivery with RECVACK, sender suppression, conflicts,
//! garbage isolation, restart then messagesync.

// Test configs change a few nested fields of the defaults.
#![allow(clippy::field_reassign_with_default)]

use std::time::Duration;

use engine::node::Node;
use net::client::{Client, Login, Received, Transport};
use net::io::Backend;
use serde_json::json;

#[macro_use]
mod support;
use support::{api, config, next_recv, next_sendack, set_token};

/// Bounds every blocking read: only a failing test ever waits this long.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

fn login(node: &Node, uid: &str) -> Client {
    login_via(node, uid, Transport::Tcp)
}

fn login_via(node: &Node, uid: &str, transport: Transport) -> Client {
    let addr = match transport {
        Transport::Tcp => node.tcp_addr().unwrap(),
        Transport::WebSocket => node.ws_addr().unwrap(),
        Transport::Rpc => panic!("clients log in over tcp or ws"),
    };
    let (client, reason) = Client::connect_via(
        transport,
        addr,
        &Login::new(uid, &format!("tok-{uid}")),
        READ_TIMEOUT,
    )
    .unwrap();
    assert_eq!(reason, 1, "CONNACK for {uid}");
    client
}

fn person_and_group(backend: Backend, transport: Transport) {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path(), backend)).unwrap();
    for u in ["u1", "u2", "u3"] {
        set_token(&node, u, 1, 1);
    }
    let mut a = login_via(&node, "u1", transport);
    let mut b = login_via(&node, "u2", transport);

    // Person message, encrypted both ways.
    a.send("u2", 1, 1, "cmn-1", br#"{"type":1,"content":"hi"}"#, true)
        .unwrap();
    let (seq, id, mseq, reason) = next_sendack(&mut a);
    assert_eq!((seq, reason, mseq), (1, 1, 1));
    let m = next_recv(&mut b);
    assert!(m.msg_key_ok);
    assert_eq!(
        (m.from_uid.as_str(), m.channel_id.as_str(), m.channel_type),
        ("u1", "u1", 1)
    );
    assert_eq!((m.message_id, m.message_seq), (id, 1));
    assert_eq!(m.payload, br#"{"type":1,"content":"hi"}"#);
    b.recvack(m.message_id, m.message_seq).unwrap();

    // And back: the channel id is the other party as each side sees it.
    b.send("u1", 1, 7, "cmn-2", b"pong", false).unwrap();
    assert_eq!(next_sendack(&mut b).3, 1);
    let m = next_recv(&mut a);
    assert_eq!(
        (m.channel_id.as_str(), m.message_seq, m.payload.as_slice()),
        ("u2", 2, &b"pong"[..])
    );

    // A group of three: the sender's own session is suppressed.
    let (status, _) = api(
        &node,
        "/channel/subscriber_add",
        json!({"channel_id": "g1", "channel_type": 2, "subscribers": ["u1", "u2", "u3"]}),
    );
    assert_eq!(status, 200);
    let mut c = login_via(&node, "u3", transport);
    a.send("g1", 2, 2, "cmn-3", b"to the group", true).unwrap();
    assert_eq!(next_sendack(&mut a).3, 1);
    for client in [&mut b, &mut c] {
        let m = next_recv(client);
        assert_eq!(
            (m.channel_id.as_str(), m.channel_type, m.payload.as_slice()),
            ("g1", 2, &b"to the group"[..])
        );
        // A PONG after the RECV: the owner shard has finished the turn that wrote
        // it (its socket-write stage is recorded).
        client.ping().unwrap();
        assert_eq!(client.read().unwrap(), Received::Pong);
    }
    // Not a subscriber: SENDACK 3; unknown group: 5; the connection stays.
    set_token(&node, "u4", 1, 1);
    let mut d = login(&node, "u4");
    d.send("g1", 2, 1, "x", b"let me in", true).unwrap();
    assert_eq!(next_sendack(&mut d).3, 3);
    d.send("nope", 2, 2, "y", b"?", true).unwrap();
    assert_eq!(next_sendack(&mut d).3, 5);
    // A broken msg_key: SENDACK 8, connection stays.
    d.ping().unwrap();
    assert_eq!(d.read().unwrap(), Received::Pong);

    // The sender saw nothing of its own group message.
    a.ping().unwrap();
    assert_eq!(a.read().unwrap(), Received::Pong);

    // Catch-up: messagesync returns the person channel's messages in order.
    let (status, body) = api(
        &node,
        "/channel/messagesync",
        json!({"login_uid": "u2", "channel_id": "u1", "channel_type": 1, "start_message_seq": 0, "end_message_seq": 0, "limit": 10, "pull_mode": 1}),
    );
    assert_eq!(status, 200, "{body}");
    let seqs: Vec<u64> = body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["message_seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, vec![1, 2]);
    assert_eq!(body["messages"][0]["channel_id"], "u1");

    // /metrics: RECV latency histogram and counters reflect what happened.
    let metrics = node.api().handle("GET", "/metrics", None, b"").body;
    let value = |name: &str| -> u64 {
        let line = metrics
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} missing"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert_eq!(
        value("imrouter_recv_latency_seconds_count"),
        4,
        "u2, u1, then u2 and u3 got one RECV each"
    );
    assert_eq!(value("imrouter_recvs_total"), 4);
    assert_eq!(value("imrouter_sends_total"), 5);
    // Stage histograms: 3 commits (two person messages, one group message), one
    // lookup page each; 4 push batches (u2 and u3 may be on different shards, u1's
    // person RECV and u2's are separate messages), each timed until its socket write.
    let stage = |name: &str| value(&format!("imrouter_stage_{name}_seconds_count"));
    assert_eq!(
        stage("connect"),
        4,
        "four CONNECTs (u1 to u4), each answered"
    );
    assert_eq!(
        [
            stage("gateway_to_commit"),
            stage("commit_to_durable"),
            stage("route_lookup"),
        ],
        [3, 3, 3]
    );
    let push_batches = stage("push_hop");
    assert!(
        (3..=4).contains(&push_batches),
        "{push_batches} push batches"
    );
    assert_eq!(stage("socket_write"), push_batches, "every batch written");
    assert!(metrics.contains("imrouter_ring_queued{from=\"0\",to=\"1\"}"));
    node.shutdown().unwrap();
}

#[test]
fn person_and_group_delivery_tcp_mio() {
    person_and_group(Backend::Mio, Transport::Tcp);
}

#[test]
fn person_and_group_delivery_tcp_uring() {
    person_and_group(Backend::Uring, Transport::Tcp);
}

#[test]
fn person_and_group_delivery_websocket_mio() {
    person_and_group(Backend::Mio, Transport::WebSocket);
}

#[test]
fn person_and_group_delivery_websocket_uring() {
    person_and_group(Backend::Uring, Transport::WebSocket);
}

fn connack_reasons_for_bad_logins(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path(), backend)).unwrap();
    set_token(&node, "u1", 1, 1);
    let addr = node.tcp_addr().unwrap();
    let (_, reason) = Client::connect(addr, &Login::new("u1", "wrong"), READ_TIMEOUT).unwrap();
    assert_eq!(reason, 2, "bad token");
    let (_, reason) =
        Client::connect(addr, &Login::new("nobody", "tok-nobody"), READ_TIMEOUT).unwrap();
    assert_eq!(reason, 2, "no token stored");
    let mut old = Login::new("u1", "tok-u1");
    old.version = 1;
    let (_, reason) = Client::connect(addr, &old, READ_TIMEOUT).unwrap();
    assert_eq!(reason, 27, "unsupported version");
    node.shutdown().unwrap();
}

fn a_second_master_login_kicks_the_first_with_disconnect_12(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path(), backend)).unwrap();
    set_token(&node, "u1", 1, 1);
    set_token(&node, "u2", 1, 1);
    let mut first = login(&node, "u1");
    let mut second_login = Login::new("u1", "tok-u1");
    second_login.device_id = "another-device".into();
    let (mut second, reason) =
        Client::connect(node.tcp_addr().unwrap(), &second_login, READ_TIMEOUT).unwrap();
    assert_eq!(reason, 1);
    let seen = first.wait_closed().unwrap();
    assert_eq!(
        seen.first(),
        Some(&Received::Disconnect {
            reason: 12,
            text: "login on another device".into()
        })
    );
    // Only the second receives now.
    let mut u2 = login(&node, "u2");
    u2.send("u1", 1, 1, "m", b"hello", true).unwrap();
    assert_eq!(next_sendack(&mut u2).3, 1);
    assert_eq!(next_recv(&mut second).payload, b"hello");
    node.shutdown().unwrap();
}

fn garbage_on_one_connection_leaves_the_others_working(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path(), backend)).unwrap();
    set_token(&node, "u1", 1, 1);
    set_token(&node, "u2", 1, 1);
    set_token(&node, "u3", 1, 1);
    let mut a = login(&node, "u1");
    let mut b = login(&node, "u2");
    let mut bad = login(&node, "u3");
    bad.send_raw(&[0xF0, 0xFF, 0xFF, 0xFF, 0xFF, 0x01]).unwrap();
    bad.wait_closed().unwrap();
    a.send("u2", 1, 1, "m", b"still here", true).unwrap();
    assert_eq!(next_sendack(&mut a).3, 1);
    assert_eq!(next_recv(&mut b).payload, b"still here");
    node.shutdown().unwrap();
}

fn restart_then_messagesync_returns_every_acknowledged_message(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let mut acked = Vec::new();
    {
        let node = Node::start(config(dir.path(), backend)).unwrap();
        set_token(&node, "u1", 1, 1);
        let mut a = login(&node, "u1");
        for i in 0..20u32 {
            a.send(
                "u2",
                1,
                i,
                &format!("m{i}"),
                format!("msg {i}").as_bytes(),
                true,
            )
            .unwrap();
            let (_, _, seq, reason) = next_sendack(&mut a);
            assert_eq!(reason, 1);
            acked.push(seq);
        }
        node.shutdown().unwrap();
    }
    let node = Node::start(config(dir.path(), backend)).unwrap();
    let (status, body) = api(
        &node,
        "/channel/messagesync",
        json!({"login_uid": "u2", "channel_id": "u1", "channel_type": 1, "limit": 100, "pull_mode": 1}),
    );
    assert_eq!(status, 200, "{body}");
    let msgs = body["messages"].as_array().unwrap();
    let seqs: Vec<u64> = msgs
        .iter()
        .map(|m| m["message_seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, acked);
    node.shutdown().unwrap();
}

on_both_drivers!(
    connack_reasons_for_bad_logins,
    a_second_master_login_kicks_the_first_with_disconnect_12,
    garbage_on_one_connection_leaves_the_others_working,
    restart_then_messagesync_returns_every_acknowledged_message,
);

/// CONNECT with an empty client key: CONNACK 21 and close.
fn empty_client_key_gets_connack_21(backend: Backend) {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path(), backend)).unwrap();
    set_token(&node, "u1", 1, 1);
    let connect = proto::wkproto::ConnectPacket {
        version: 6,
        device_flag: proto::wkproto::DeviceFlag(1),
        device_id: "d",
        uid: "u1",
        token: "tok-u1",
        client_key: "",
        ..Default::default()
    };
    let mut frame = Vec::new();
    connect.encode(0, &mut frame).unwrap();
    let mut s = std::net::TcpStream::connect(node.tcp_addr().unwrap()).unwrap();
    s.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
    s.write_all(&frame).unwrap();
    let mut got = Vec::new();
    s.read_to_end(&mut got).unwrap();
    match proto::wkproto::decode(&got, 6, proto::wkproto::MAX_FRAME_BYTES).unwrap() {
        Some((proto::wkproto::Frame::Connack(c), _)) => assert_eq!(c.reason_code.0, 21),
        other => panic!("expected CONNACK, got {other:?}"),
    }
    node.shutdown().unwrap();
}

/// An unexpected packet type from a client (here a CONNACK) gets DISCONNECT with a
/// reason, then the connection closes.
fn unexpected_packet_gets_disconnect(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path(), backend)).unwrap();
    set_token(&node, "u1", 1, 1);
    let mut a = login(&node, "u1");
    let connack = proto::wkproto::ConnackPacket {
        server_version: Some(6),
        ..Default::default()
    };
    let mut frame = Vec::new();
    connack.encode(6, &mut frame).unwrap();
    a.send_raw(&frame).unwrap();
    let seen = a.wait_closed().unwrap();
    assert!(
        matches!(seen.first(), Some(Received::Disconnect { reason: 20, .. })),
        "{seen:?}"
    );
    node.shutdown().unwrap();
}

/// A NoPersist message is delivered to online recipients and never stored.
fn no_persist_is_delivered_not_stored(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path(), backend)).unwrap();
    set_token(&node, "u2", 1, 1);
    let mut b = login(&node, "u2");
    let (status, body) = api(
        &node,
        "/message/send",
        json!({"from_uid": "u1", "channel_id": "u2", "channel_type": 1, "payload": "aGk=", "header": {"no_persist": 1}}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["message_seq"], 0, "not stored: no sequence");
    let m = next_recv(&mut b);
    assert_eq!((m.payload.as_slice(), m.message_seq), (&b"hi"[..], 0));
    let (_, body) = api(
        &node,
        "/channel/messagesync",
        json!({"login_uid": "u2", "channel_id": "u1", "channel_type": 1, "limit": 10, "pull_mode": 1}),
    );
    assert_eq!(body["messages"].as_array().unwrap().len(), 0);
    node.shutdown().unwrap();
}

on_both_drivers!(
    empty_client_key_gets_connack_21,
    unexpected_packet_gets_disconnect,
    no_persist_is_delivered_not_stored,
);

#[test]
fn the_api_requires_its_bearer_token_except_on_health_checks() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), Backend::Mio);
    c.api.bearer_token = Some("s3cret".into());
    let node = Node::start(c).unwrap();
    let api = node.api();
    let body = json!({"uid": "u1", "token": "t", "device_flag": 1, "device_level": 1}).to_string();
    assert_eq!(
        api.handle("POST", "/user/token", None, body.as_bytes())
            .status,
        401
    );
    assert_eq!(
        api.handle("POST", "/user/token", Some("Bearer wrong"), body.as_bytes())
            .status,
        401
    );
    assert_eq!(
        api.handle(
            "POST",
            "/user/token",
            Some("Bearer s3cret"),
            body.as_bytes()
        )
        .status,
        200
    );
    assert_eq!(api.handle("GET", "/healthz", None, b"").status, 200);
    assert_eq!(api.handle("GET", "/readyz", None, b"").status, 200);
    assert_eq!(api.handle("GET", "/metrics", None, b"").status, 401);
    node.shutdown().unwrap();
}
