//! Interoperability with WuKongIM's Python EasySDK (`wukong-easy-sdk` 0.1.0: JSON-RPC
//! over WebSocket, `proto::jsonrpc`) beside a binary client: each SDK client is a child
//! process (`interop/py_sdk_client.py`) driven by JSON lines. `scripts/test` installs
//! the SDK into a virtual environment at `target/py-sdk` first
//! (`interop/requirements-py.txt`).

// Test configs change a few nested fields of the defaults.
#![allow(clippy::field_reassign_with_default)]

use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

use engine::node::{Node, NodeConfig};
use net::client::{Client, Login, Received};
use net::io::Backend;
use serde_json::{json, Value};

#[macro_use]
mod support;
use support::{api, metric, set_token};

/// Bounds every wait for an event: only a failing test waits this long.
const EVENT_TIMEOUT: Duration = Duration::from_secs(20);

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

struct PySdk {
    uid: String,
    child: Child,
    stdin: ChildStdin,
    events: support::SdkEvents,
}

impl PySdk {
    fn start(node: &Node, uid: &str, token: &str) -> PySdk {
        let python = repo().join("target/py-sdk/bin/python");
        assert!(
            python.exists(),
            "the Python EasySDK is not installed: run scripts/test (it makes target/py-sdk)"
        );
        let mut child = Command::new(python)
            .arg(repo().join("interop/py_sdk_client.py"))
            .env("WS_ADDR", format!("ws://{}", node.ws_addr().unwrap()))
            .env("UID", uid)
            .env("TOKEN", token)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let events = support::SdkEvents::read(uid, stdout);
        PySdk {
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

    fn connected(&self) -> Value {
        let ev = self.expect("connected", |e| {
            e["event"] == "connected" || e["event"] == "connect_failed"
        });
        assert_eq!(ev["event"], "connected", "{}: {ev}", self.uid);
        ev["result"].clone()
    }

    fn command(&mut self, cmd: Value) {
        writeln!(self.stdin, "{cmd}").unwrap();
    }

    /// Sends `payload` and returns the SENDACK's result.
    fn send(&mut self, channel_id: &str, channel_type: u8, payload: Value) -> Value {
        self.command(json!({"cmd": "send", "channel_id": channel_id,
                            "channel_type": channel_type, "payload": payload}));
        let ack = self.expect("sendack", |e| {
            e["event"] == "sendack" || e["event"] == "send_failed"
        });
        assert_eq!(ack["event"], "sendack", "{}: {ack}", self.uid);
        assert_eq!(ack["reasonCode"], 1, "{}: {ack}", self.uid);
        ack
    }

    fn message(&self, payload: &Value) -> Value {
        self.expect(&format!("message {payload}"), |e| {
            e["event"] == "message" && &e["payload"] == payload
        })
    }
}

impl Drop for PySdk {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn next_recv(c: &mut Client) -> net::client::RecvMessage {
    loop {
        match c.read().unwrap() {
            Received::Recv(m) => return m,
            Received::Pong | Received::Sendack { .. } => continue,
            other => panic!("expected RECV, got {other:?}"),
        }
    }
}

fn start_node(dir: &std::path::Path) -> Node {
    let c: NodeConfig = support::config(dir, Backend::Auto);
    let node = Node::start(c).unwrap();
    for uid in ["p1", "p2", "b1"] {
        set_token(&node, uid, 1, 1);
    }
    let body = json!({"channel_id": "g1", "channel_type": 2, "subscribers": ["p1", "p2", "b1"]});
    assert_eq!(api(&node, "/channel/subscriber_add", body).0, 200);
    node
}

#[test]
fn python_easy_sdk_beside_a_binary_client() {
    let dir = tempfile::tempdir().unwrap();
    let node = start_node(dir.path());
    let mut p1 = PySdk::start(&node, "p1", "tok-p1");
    let mut p2 = PySdk::start(&node, "p2", "tok-p2");
    let connack = p1.connected();
    assert_eq!(connack["reasonCode"], 1, "{connack}");
    p2.connected();
    let mut b1 = support::login(&node, "b1");

    // Person: SDK to SDK; the SENDACK's message id is the RECV's, as a string.
    let hello = json!({"type": 1, "content": "hello p2"});
    let ack = p1.send("p2", 1, hello.clone());
    let m = p2.message(&hello);
    assert_eq!((&m["from"], &m["channel_id"]), (&json!("p1"), &json!("p1")));
    assert_eq!(m["message_id"], ack["messageId"]);
    assert!(ack["messageId"].as_str().unwrap().parse::<i64>().is_ok());

    // Group: to the other SDK and to the binary client, which gets the JSON text.
    let group = json!({"type": 1, "content": "hello group"});
    p1.send("g1", 2, group.clone());
    let m = p2.message(&group);
    assert_eq!((&m["from"], &m["channel_id"]), (&json!("p1"), &json!("g1")));
    let r = next_recv(&mut b1);
    // (The SDK's JSON text, keys in its order.)
    assert_eq!(serde_json::from_slice::<Value>(&r.payload).unwrap(), group);
    assert_eq!((r.from_uid.as_str(), r.channel_id.as_str()), ("p1", "g1"));

    // Binary to SDK: the JSON bytes arrive as the object.
    let text = br#"{"type":1,"content":"from binary"}"#;
    b1.send("p2", 1, 1, "b-1", text, true).unwrap();
    let back = serde_json::from_slice::<Value>(text).unwrap();
    assert_eq!(p2.message(&back)["from"], "b1");

    // The SDK acknowledged each RECV: its RECVACKs precede its next SEND on the
    // connection, so they are counted by the time that SEND is answered.
    p2.send("p1", 1, json!({"type": 1, "content": "ack check"}));
    assert!(
        metric(&node, "imrouter_recvacks_total") >= 3,
        "p2's RECVACKs for three messages"
    );

    // Reconnect: a new connection, and messages flow again.
    p2.command(json!({"cmd": "reconnect"}));
    p2.connected();
    let again = json!({"type": 1, "content": "after reconnect"});
    p1.send("p2", 1, again.clone());
    p2.message(&again);

    // A wrong token: the SDK's connect fails with the CONNACK's reason (2).
    let bad = PySdk::start(&node, "p1", "wrong");
    let ev = bad.expect("connect_failed", |e| e["event"] == "connect_failed");
    assert_eq!(ev["code"], 2, "{ev}");

    drop((p1, p2, bad));
    node.shutdown().unwrap();
}

/// The binary client with the same device flag logs in after the SDK: the SDK is
/// told (disconnect, reason 12) and does not reconnect.
#[test]
fn a_binary_master_login_kicks_the_python_sdk() {
    let dir = tempfile::tempdir().unwrap();
    let node = start_node(dir.path());
    let p1 = PySdk::start(&node, "p1", "tok-p1");
    p1.connected();
    let mut login = Login::new("p1", "tok-p1");
    login.device_id = "another".into();
    let (_b, reason) = Client::connect(node.tcp_addr().unwrap(), &login, EVENT_TIMEOUT).unwrap();
    assert_eq!(reason, 1);
    let ev = p1.expect("disconnect", |e| e["event"] == "disconnect");
    assert_eq!(ev["reasonCode"], 12, "{ev}");
    drop(p1);
    node.shutdown().unwrap();
}
