//! `kill -9` right after SENDACKs loses nothing acknowledged: a child process runs a
//! node (this test binary re-executed with `IMROUTER_CRASH_CHILD_DIR`), the parent
//! sends through it and collects SENDACKs, kills it with SIGKILL mid-stream, restarts
//! a node on the same data directory and syncs every acknowledged message back.
//!
//! SIGKILL keeps the kernel's page cache, so this passes even if nothing is ever
//! synced: `store_power_cut.rs` is the test that needs the syncs (it keeps only what
//! they covered).

// Test configs change a few nested fields of the defaults.
#![allow(clippy::field_reassign_with_default)]

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use engine::node::{Node, NodeConfig};

mod support;
use net::client::{Client, Login, Received};
use serde_json::{json, Value};

const TIMEOUT: Duration = Duration::from_secs(10);
const CHILD_ENV: &str = "IMROUTER_CRASH_CHILD_DIR";

fn config(dir: &std::path::Path) -> NodeConfig {
    let mut c = NodeConfig {
        token_auth: false,
        ..support::config(dir, net::io::Backend::Mio)
    };
    // The test pipelines all its SENDs: let them all in flight.
    c.session.sends_in_flight_per_conn_max = 1024;
    c
}

/// The child node process, killed when the test ends however it ends (a failing
/// assertion must not leave it running and the test harness waiting on its output).
struct ChildGuard(std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The child: runs a node until it is killed, printing its TCP address.
#[test]
fn crash_child() {
    let Ok(dir) = std::env::var(CHILD_ENV) else {
        return;
    };
    let node = Node::start(config(std::path::Path::new(&dir))).unwrap();
    // Straight to the process's stdout: the test harness captures `println!`.
    let mut out = std::io::stdout();
    writeln!(out, "ADDR {}", node.tcp_addr().unwrap()).unwrap();
    out.flush().unwrap();
    // Park until SIGKILL; the node's threads do the work.
    loop {
        std::thread::park();
    }
}

#[test]
fn kill_9_after_sendack_loses_nothing_acknowledged() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut child = ChildGuard(child);
    let addr: SocketAddr = loop {
        let line = lines.next().expect("child printed its address").unwrap();
        // The harness prints "test crash_child ... " before it on the same line.
        if let Some((_, a)) = line.split_once("ADDR ") {
            break a.trim().parse().unwrap();
        }
    };
    let (mut client, reason) = Client::connect(addr, &Login::new("u1", "any"), TIMEOUT).unwrap();
    assert_eq!(reason, 1);
    // Pipeline SENDs; kill the node after 200 acknowledgements, with more in flight.
    for i in 0..400u32 {
        client
            .send(
                "u2",
                1,
                i,
                &format!("m{i}"),
                format!("payload {i}").as_bytes(),
                true,
            )
            .unwrap();
    }
    let mut acked = Vec::new();
    while acked.len() < 200 {
        match client.read().unwrap() {
            Received::Sendack {
                message_seq,
                reason: 1,
                ..
            } => acked.push(message_seq),
            other => panic!("unexpected {other:?}"),
        }
    }
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    // Whatever else was acknowledged before the kill was read into the socket buffer.
    while let Ok(Received::Sendack {
        message_seq,
        reason: 1,
        ..
    }) = client.read()
    {
        acked.push(message_seq);
    }

    let node = Node::start(config(dir.path())).unwrap();
    let body = json!({"login_uid": "u2", "channel_id": "u1", "channel_type": 1, "limit": 1000, "pull_mode": 1});
    let reply = node.api().handle(
        "POST",
        "/channel/messagesync",
        None,
        body.to_string().as_bytes(),
    );
    assert_eq!(reply.status, 200, "{}", reply.body);
    let body: Value = serde_json::from_str(&reply.body).unwrap();
    let stored: Vec<u64> = body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["message_seq"].as_u64().unwrap())
        .collect();
    for seq in &acked {
        assert!(
            stored.contains(seq),
            "acknowledged seq {seq} lost; stored {} messages",
            stored.len()
        );
    }
    // Stored messages are exactly a prefix 1..=n of the channel, each intact.
    let n = stored.len() as u64;
    assert_eq!(stored, (1..=n).collect::<Vec<_>>());
    for m in body["messages"].as_array().unwrap() {
        let seq = m["message_seq"].as_u64().unwrap();
        let payload = base64_decode(m["payload"].as_str().unwrap());
        assert_eq!(payload, format!("payload {}", seq - 1).into_bytes());
    }
    node.shutdown().unwrap();
}

fn base64_decode(s: &str) -> Vec<u8> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.decode(s).unwrap()
}
