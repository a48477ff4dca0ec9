//! Interoperability with the official WuKongIM JS SDK (`wukongimjssdk` 1.0.4, protocol
//! version 2, encryption on) under Node.js: each SDK client is a child process
//! (`interop/sdk_client.mjs`) driven by JSON lines. `scripts/test` installs the SDK
//! with `npm ci --prefix interop` first.

// Test configs change a few nested fields of the defaults.
#![allow(clippy::field_reassign_with_default)]

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

use engine::node::{Node, NodeConfig};
use serde_json::{json, Value};

mod support;
use support::cluster::Cluster;

/// Bounds every wait for an event: only a failing test waits this long.
const EVENT_TIMEOUT: Duration = Duration::from_secs(20);

fn interop_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../interop")
}

struct SdkClient {
    uid: String,
    child: Child,
    stdin: ChildStdin,
    events: support::SdkEvents,
}

impl SdkClient {
    fn start(node: &Node, uid: &str) -> SdkClient {
        let dir = interop_dir();
        assert!(
            dir.join("node_modules/wukongimjssdk").exists(),
            "the JS SDK is not installed: run scripts/test (it runs `npm ci --prefix interop`)"
        );
        let mut child = Command::new("node")
            .current_dir(&dir)
            .args(["--import", "./register.mjs", "sdk_client.mjs"])
            .env("WS_ADDR", format!("ws://{}", node.ws_addr().unwrap()))
            .env("UID", uid)
            .env("TOKEN", format!("tok-{uid}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("node (Node.js) must be installed");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let events = support::SdkEvents::read(uid, stdout);
        SdkClient {
            uid: uid.into(),
            child,
            stdin,
            events,
        }
    }

    /// Waits for the first event matching `pred`, skipping others.
    fn expect(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        self.events.expect(what, EVENT_TIMEOUT, pred)
    }

    fn connected(&self) {
        self.expect("connected", |e| e["event"] == "status" && e["status"] == 1);
    }

    fn send(&mut self, channel_id: &str, channel_type: u8, text: &str) {
        let cmd = json!({"cmd": "send", "channel_id": channel_id, "channel_type": channel_type, "text": text});
        writeln!(self.stdin, "{cmd}").unwrap();
        let ack = self.expect("sendack", |e| e["event"] == "sendack");
        assert_eq!(ack["reason"], 1, "{}: SENDACK {ack}", self.uid);
    }

    fn message(&self, text: &str) -> Value {
        self.expect(&format!("message {text:?}"), |e| {
            e["event"] == "message" && e["text"] == text
        })
    }
}

impl Drop for SdkClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// POSTs JSON to the node's HTTP listener (a real HTTP/1.1 request); returns the
/// status line's code.
fn http_post(addr: SocketAddr, path: &str, body: &Value) -> u16 {
    use std::io::Read;
    let body = body.to_string();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(EVENT_TIMEOUT)).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    reply
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("bad reply {reply:?}"))
}

fn start_node(dir: &std::path::Path) -> Node {
    let mut c = NodeConfig {
        data_dir: dir.to_path_buf(),
        tcp_addr: None,
        ws_addr: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        ..NodeConfig::default()
    };
    c.api.addr = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    c.runtime.shard_count = 2;
    c.runtime.pin_cores = Vec::new();
    c.log.segment_bytes = 4 << 20;
    let node = Node::start(c).unwrap();
    // Tokens and the group through the HTTP API, as an application server would.
    let api = node.api_addr().unwrap();
    for uid in ["u1", "u2", "u3", "u4"] {
        let body =
            json!({"uid": uid, "token": format!("tok-{uid}"), "device_flag": 1, "device_level": 1});
        assert_eq!(http_post(api, "/user/token", &body), 200);
    }
    let body =
        json!({"channel_id": "g1", "channel_type": 2, "subscribers": ["u1", "u2", "u3", "u4"]});
    assert_eq!(http_post(api, "/channel/subscriber_add", &body), 200);
    assert_eq!(
        http_post(api, "/user/token", &json!({"uid": ""})),
        400,
        "bad input gets a clear error"
    );
    node
}

#[test]
fn js_sdk_person_group_and_kick() {
    let dir = tempfile::tempdir().unwrap();
    let node = start_node(dir.path());
    let mut a = SdkClient::start(&node, "u1");
    let mut b = SdkClient::start(&node, "u2");
    let c = SdkClient::start(&node, "u3");
    let d = SdkClient::start(&node, "u4");
    for client in [&a, &b, &c, &d] {
        client.connected();
    }

    // Person messages both ways, encrypted by the SDK.
    a.send("u2", 1, "hello u2");
    let m = b.message("hello u2");
    assert_eq!(
        (
            m["from"].as_str(),
            m["channel_id"].as_str(),
            m["channel_type"].as_u64()
        ),
        (Some("u1"), Some("u1"), Some(1))
    );
    b.send("u1", 1, "hello u1");
    let m = a.message("hello u1");
    assert_eq!(m["channel_id"], "u2");

    // A group message reaches the three other members.
    a.send("g1", 2, "hello group");
    for client in [&b, &c, &d] {
        let m = client.message("hello group");
        assert_eq!(
            (
                m["from"].as_str(),
                m["channel_id"].as_str(),
                m["channel_type"].as_u64()
            ),
            (Some("u1"), Some("g1"), Some(2))
        );
    }

    // A second login of u1 with the same device flag kicks the first (ConnectKick).
    let second = SdkClient::start(&node, "u1");
    second.connected();
    a.expect("kick", |e| {
        e["event"] == "status" && (e["status"] == 4 || e["reason"] == 12)
    });
    b.send("u1", 1, "after the kick");
    second.message("after the kick");
    drop((a, b, c, d, second));
    node.shutdown().unwrap();
}

/// Two SDK clients on different nodes of a three-node cluster (token authentication
/// on: each token stored at its uid's home, checked there when the client connects
/// elsewhere): person messages both ways and a group message with a member on the
/// third node.
#[test]
fn js_sdk_on_a_three_node_cluster() {
    let cluster = Cluster::start_with(net::io::Backend::Auto, |c| c.token_auth = true);
    let home = |key: &str| cluster.view.home_node(slots::hash_slot(key.as_bytes()));
    for uid in ["c1", "c2", "c3"] {
        let body =
            json!({"uid": uid, "token": format!("tok-{uid}"), "device_flag": 1, "device_level": 1});
        let (status, reply) = support::api(cluster.node(home(uid)), "/user/token", body);
        assert_eq!(status, 200, "{reply}");
    }
    let body = json!({"channel_id": "cg", "channel_type": 2, "subscribers": ["c1", "c2", "c3"]});
    let (status, reply) = support::api(cluster.node(home("cg")), "/channel/subscriber_add", body);
    assert_eq!(status, 200, "{reply}");
    let mut a = SdkClient::start(cluster.node(1), "c1");
    let mut b = SdkClient::start(cluster.node(2), "c2");
    let c = SdkClient::start(cluster.node(3), "c3");
    for client in [&a, &b, &c] {
        client.connected();
    }
    a.send("c2", 1, "from node 1");
    assert_eq!(b.message("from node 1")["channel_id"], "c1");
    b.send("c1", 1, "from node 2");
    assert_eq!(a.message("from node 2")["channel_id"], "c2");
    a.send("cg", 2, "to the group");
    for client in [&b, &c] {
        let m = client.message("to the group");
        assert_eq!(
            (m["from"].as_str(), m["channel_id"].as_str()),
            (Some("c1"), Some("cg"))
        );
    }
}
