//! CONNECT through the node: the CONNACK's version negotiation (issue 11, item 11:
//! the HasServerVersion flag and the server_version byte follow
//! `connack_has_server_version` of the client's version byte, 0 ("latest")
//! included, and the rest of the CONNACK is encoded at the negotiated version), and
//! the connect deadline (issue 11, item 7).

// Test configs change a few nested fields of the defaults.
#![allow(clippy::field_reassign_with_default)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use base64::Engine as _;
use engine::node::{Node, NodeConfig};
use net::client::{Client, Login, Received};
use proto::wkproto::{
    connack_has_server_version, decode, peek_frame_len, ConnectPacket, DeviceFlag, Frame,
    MAX_FRAME_BYTES,
};

mod support;

/// The raw CONNACK frame a node sends for a CONNECT with `version`.
fn connack_bytes(node: &Node, version: u8) -> Vec<u8> {
    let key = proto::crypto::public_key([9; 32]);
    let client_key = base64::engine::general_purpose::STANDARD.encode(key);
    let connect = ConnectPacket {
        version,
        device_flag: DeviceFlag(1),
        device_id: "d",
        uid: "u1",
        token: "any",
        client_key: &client_key,
        ..Default::default()
    };
    let mut frame = Vec::new();
    connect.encode(0, &mut frame).unwrap();
    let mut s = TcpStream::connect(node.tcp_addr().unwrap()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(&frame).unwrap();
    let mut rx = Vec::new();
    let mut buf = [0u8; 512];
    loop {
        if let Some(n) = peek_frame_len(&rx, MAX_FRAME_BYTES).unwrap() {
            if n <= rx.len() {
                rx.truncate(n);
                return rx;
            }
        }
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "closed before CONNACK");
        rx.extend_from_slice(&buf[..n]);
    }
}

#[test]
fn connack_server_version_follows_the_client_version_byte() {
    let dir = tempfile::tempdir().unwrap();
    let config = NodeConfig {
        token_auth: false,
        ..support::config(dir.path(), net::io::Backend::Mio)
    };
    let node = Node::start(config).unwrap();
    for version in [0u8, 3, 4, 5, 6, 9] {
        let bytes = connack_bytes(&node, version);
        let has_flag = bytes[0] & 0x01 != 0;
        assert_eq!(
            has_flag,
            connack_has_server_version(version),
            "HasServerVersion for a CONNECT with version {version}"
        );
        let negotiated = proto::wkproto::negotiate_version(version);
        let (frame, _) = decode(&bytes, negotiated, MAX_FRAME_BYTES)
            .unwrap()
            .unwrap();
        let Frame::Connack(c) = frame else {
            panic!("expected CONNACK, got {frame:?}")
        };
        assert_eq!(c.reason_code.0, 1, "version {version}");
        assert_eq!(
            c.server_version,
            connack_has_server_version(version).then_some(negotiated),
            "version {version}"
        );
        let node_id = if proto::wkproto::has_node_id(negotiated) {
            1
        } else {
            0
        };
        assert_eq!(
            c.node_id, node_id,
            "node_id on the wire from v4 on (version {version})"
        );
    }
    node.shutdown().unwrap();
}

#[test]
fn connections_without_connect_close_at_the_connect_deadline_and_sessions_stay() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = NodeConfig {
        token_auth: false,
        ..support::config(dir.path(), net::io::Backend::Mio)
    };
    config.net.connect_timeout_ms = 300;
    let idle_ms = config.net.idle_timeout_ms;
    let node = Node::start(config).unwrap();
    let addr = node.tcp_addr().unwrap();
    let timeout = Duration::from_secs(10);
    // Sessions that completed CONNECT before the silent connection was accepted.
    let (mut a, ra) = Client::connect(addr, &Login::new("u1", "any"), timeout).unwrap();
    let (mut b, rb) = Client::connect(addr, &Login::new("u2", "any"), timeout).unwrap();
    assert_eq!((ra, rb), (1, 1));
    // Never sends CONNECT: closed at the connect deadline, long before the idle one.
    let started = std::time::Instant::now();
    let mut silent = TcpStream::connect(addr).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_millis(idle_ms / 3)))
        .unwrap();
    let mut buf = [0u8; 16];
    match silent.read(&mut buf) {
        Ok(0) => {}
        other => panic!("expected the node to close the silent connection, got {other:?}"),
    }
    println!("silent connection closed after {:?}", started.elapsed());
    // The authenticated sessions, older than the silent one, are still served.
    a.send("u2", 1, 1, "m1", b"still here", true).unwrap();
    loop {
        if let Received::Recv(m) = b.read().unwrap() {
            assert_eq!(m.payload, b"still here");
            break;
        }
    }
    node.shutdown().unwrap();
}
