//! What the node tests share: a loopback test config and HTTP API calls without HTTP.
#![allow(dead_code, unused_macros)] // each test binary uses a part of it

use std::net::SocketAddr;

/// Runs each scenario `fn name(backend: Backend)` on both io drivers, as the tests
/// `name::mio` and `name::uring`.
macro_rules! on_both_drivers {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn mio() {
                super::$name(net::io::Backend::Mio);
            }
            #[test]
            fn uring() {
                super::$name(net::io::Backend::Uring);
            }
        }
    )*};
}
use std::path::Path;

pub mod cluster;
pub mod jsonrpc;
pub mod processes;

use engine::node::{Node, NodeConfig};
use serde_json::{json, Value};

/// A node on 127.0.0.1 port 0 (TCP and WebSocket), 2 unpinned shards, the given IO
/// backend, data in `dir`, small log segments, no HTTP listener (tests call
/// [`api`] in process).
pub fn config(dir: &Path, backend: net::io::Backend) -> NodeConfig {
    let mut c = NodeConfig {
        data_dir: dir.to_path_buf(),
        tcp_addr: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        ws_addr: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        ..NodeConfig::default()
    };
    c.api.addr = None;
    c.runtime.shard_count = 2;
    c.runtime.pin_cores = Vec::new();
    c.net.backend = backend;
    c.log.segment_bytes = 4 << 20;
    // Tests pipeline hundreds of SENDs on one connection without reading: room for
    // them in flight, past the uid's rate (the credit and rate limits have tests of
    // their own).
    c.session.sends_in_flight_per_conn_max = 1 << 20;
    c.session.sends_per_uid_per_s = 0;
    c.commit.commit_credits_per_peer = 4_096;
    // Up to 4 shards fit this machine's 20,000 descriptors (a start whose connection
    // caps do not fit the limit is refused).
    c.net.connections_per_shard_max = 4_096;
    c
}

/// POSTs `body` to `path` through the node's API; returns the status and JSON body.
pub fn api(node: &Node, path: &str, body: Value) -> (u16, Value) {
    let reply = node
        .api()
        .handle("POST", path, None, body.to_string().as_bytes());
    (
        reply.status,
        serde_json::from_str(&reply.body).unwrap_or(Value::Null),
    )
}

/// Stores token `tok-{uid}` for `(uid, flag)` with `level` (0 Slave, 1 Master).
pub fn set_token(node: &Node, uid: &str, flag: u8, level: u8) {
    let body = json!({"uid": uid, "token": format!("tok-{uid}"), "device_flag": flag, "device_level": level});
    let (status, reply) = api(node, "/user/token", body);
    assert_eq!(status, 200, "{reply}");
}

/// A client of `uid` logged in over TCP with token `tok-{uid}` (CONNACK success
/// asserted); reads time out after 10 s (a failure detector, not a wait).
pub fn login(node: &Node, uid: &str) -> net::client::Client {
    let (client, reason) = net::client::Client::connect(
        node.tcp_addr().unwrap(),
        &net::client::Login::new(uid, &format!("tok-{uid}")),
        std::time::Duration::from_secs(10),
    )
    .unwrap();
    assert_eq!(reason, 1, "CONNACK for {uid}");
    client
}

/// The value of metric `name` (an unlabelled series) in the node's `/metrics`.
pub fn metric(node: &Node, name: &str) -> u64 {
    let text = node.api().handle("GET", "/metrics", None, b"").body;
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("{name} ")))
        .unwrap_or_else(|| panic!("{name} missing"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// `GET path` on an HTTP API at `api` (one connection, `Connection: close`): the
/// status and body.
pub fn http_get(api: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    processes::http(api, "GET", path, "")
}

/// Polls `GET path` until it answers `status` or `timeout` passes (a failure
/// detector: a node that never gets there fails the test); gives the last answer.
pub fn wait_http(
    api: SocketAddr,
    path: &str,
    status: u16,
    timeout: std::time::Duration,
) -> (u16, String) {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let last = http_get(api, path).unwrap_or((0, String::new()));
        if last.0 == status || std::time::Instant::now() > deadline {
            return last;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Reads until a RECV arrives (skipping PONGs; anything else fails the test).
pub fn next_recv(c: &mut net::client::Client) -> net::client::RecvMessage {
    use net::client::Received;
    loop {
        match c.read().unwrap() {
            Received::Recv(m) => return m,
            Received::Pong => continue,
            other => panic!("expected RECV, got {other:?}"),
        }
    }
}

/// Reads until a SENDACK arrives (skipping PONGs): `(client_seq, message_id,
/// message_seq, reason)`.
pub fn next_sendack(c: &mut net::client::Client) -> (u32, i64, u64, u8) {
    use net::client::Received;
    loop {
        match c.read().unwrap() {
            Received::Sendack {
                client_seq,
                message_id,
                message_seq,
                reason,
            } => return (client_seq, message_id, message_seq, reason),
            Received::Pong => continue,
            other => panic!("expected SENDACK, got {other:?}"),
        }
    }
}

/// The JSON lines an SDK driver process prints on stdout, as events (lines that are
/// not JSON are echoed to stderr, prefixed with `name`).
pub struct SdkEvents {
    name: String,
    events: std::sync::mpsc::Receiver<Value>,
}

impl SdkEvents {
    /// Reads `stdout` on a thread of its own until it ends.
    pub fn read(name: &str, stdout: std::process::ChildStdout) -> SdkEvents {
        use std::io::BufRead;
        let (tx, events) = std::sync::mpsc::channel();
        let prefix = name.to_owned();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                match serde_json::from_str::<Value>(&line) {
                    Ok(v) => {
                        if tx.send(v).is_err() {
                            break;
                        }
                    }
                    Err(_) => eprintln!("[{prefix}] {line}"),
                }
            }
        });
        SdkEvents {
            name: name.to_owned(),
            events,
        }
    }

    /// Waits up to `timeout` for the first event matching `pred`, skipping others.
    pub fn expect(
        &self,
        what: &str,
        timeout: std::time::Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        loop {
            let ev = self
                .events
                .recv_timeout(timeout)
                .unwrap_or_else(|_| panic!("{}: no {what} event", self.name));
            if pred(&ev) {
                return ev;
            }
        }
    }
}
