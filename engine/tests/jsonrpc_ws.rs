//! JSON-RPC over the WebSocket listener (`proto::jsonrpc`), through real sockets: a
//! JSON-RPC client and a binary client exchange messages both ways with the same
//! payload bytes, messagesync returns them; ping and disconnect; bad input (wrong
//! token, garbage, oversize, requests before `connect`, a binary message on a text
//! connection); the pre-CONNECT deadline; a Master conflict across the protocols.

// Test configs change a few nested fields of the defaults.
#![allow(clippy::field_reassign_with_default)]

use std::time::Duration;

use base64::Engine as _;
use engine::node::{Node, NodeConfig};
use net::client::{Client, Login, Received, RecvMessage, Transport};
use net::io::Backend;
use serde_json::{json, Value};

#[macro_use]
mod support;
use support::jsonrpc::RpcClient;
use support::{api, login, set_token};

/// Bounds every blocking wait: only a failing test ever waits this long.
const TIMEOUT: Duration = Duration::from_secs(10);
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

fn config(dir: &std::path::Path, backend: Backend) -> NodeConfig {
    support::config(dir, backend)
}

fn rpc(node: &Node) -> RpcClient {
    RpcClient::open(node.ws_addr().unwrap(), TIMEOUT)
}

fn rpc_login(node: &Node, uid: &str) -> RpcClient {
    let mut c = rpc(node);
    let answer = c.connect(uid, &format!("tok-{uid}"));
    assert_eq!(answer["result"]["reasonCode"], 1, "{answer}");
    c
}

fn next_recv(c: &mut Client) -> RecvMessage {
    loop {
        match c.read().unwrap() {
            Received::Recv(m) => return m,
            Received::Pong | Received::Sendack { .. } => continue,
            other => panic!("expected RECV, got {other:?}"),
        }
    }
}

fn next_sendack(c: &mut Client) -> (i64, u64, u8) {
    loop {
        match c.read().unwrap() {
            Received::Sendack {
                message_id,
                message_seq,
                reason,
                ..
            } => return (message_id, message_seq, reason),
            Received::Pong | Received::Recv(_) => continue,
            other => panic!("expected SENDACK, got {other:?}"),
        }
    }
}

/// The payloads messagesync gives for the person channel of `a` and `b`, as `a`.
fn synced_payloads(node: &Node, a: &str, b: &str) -> Vec<Vec<u8>> {
    let body = json!({"login_uid": a, "channel_id": b, "channel_type": 1,
                      "start_message_seq": 0, "end_message_seq": 0, "limit": 100,
                      "pull_mode": 1});
    let (status, v) = api(node, "/channel/messagesync", body);
    assert_eq!(status, 200, "{v}");
    v["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| B64.decode(m["payload"].as_str().unwrap()).unwrap())
        .collect()
}

fn jsonrpc_and_binary_clients_exchange_messages(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path(), backend)).unwrap();
    set_token(&node, "u1", 1, 1);
    set_token(&node, "u2", 1, 1);
    let mut j = rpc_login(&node, "u1");
    let (mut b, reason) = Client::connect_via(
        Transport::WebSocket,
        node.ws_addr().unwrap(),
        &Login::new("u2", "tok-u2"),
        TIMEOUT,
    )
    .unwrap();
    assert_eq!(reason, 1);

    // JSON-RPC → binary: base64 of bytes that are not UTF-8 arrive as those bytes.
    let bytes: Vec<u8> = (0..=255u8).rev().collect();
    let id = j.request(
        "send",
        json!({"clientMsgNo": "m1", "channelId": "u2", "channelType": 1,
               "payload": B64.encode(&bytes)}),
    );
    let (ack, _) = j.answer(&id);
    let result = &ack["result"];
    assert_eq!(result["reasonCode"], 1, "{ack}");
    let m = next_recv(&mut b);
    assert_eq!(m.payload, bytes);
    assert_eq!((m.from_uid.as_str(), m.channel_id.as_str()), ("u1", "u1"));
    assert_eq!(
        result["messageId"].as_str(),
        Some(m.message_id.to_string().as_str()),
        "messageId goes out as the decimal string of the int64"
    );
    assert_eq!(result["messageSeq"].as_u64(), Some(m.message_seq));

    // An object payload arrives as its JSON text.
    let id = j.request(
        "send",
        json!({"clientMsgNo": "m2", "channelId": "u2", "channelType": 1,
               "payload": {"content": "hi", "type": 1}}),
    );
    assert_eq!(j.answer(&id).0["result"]["reasonCode"], 1);
    let object_bytes = br#"{"content":"hi","type":1}"#.to_vec();
    assert_eq!(next_recv(&mut b).payload, object_bytes);

    // Binary → JSON-RPC: the recv notification carries base64 of the same bytes,
    // the header fields, and the message id as a string; recvack is taken.
    let back = b"\x00\xffback to u1".to_vec();
    b.send("u1", 1, 7, "m3", &back, true).unwrap();
    let (message_id, message_seq, reason) = next_sendack(&mut b);
    assert_eq!(reason, 1);
    let r = j.recv();
    assert_eq!(B64.decode(r["payload"].as_str().unwrap()).unwrap(), back);
    assert_eq!(r["messageId"], message_id.to_string());
    assert_eq!(r["messageSeq"], message_seq);
    assert_eq!(
        (
            &r["fromUid"],
            &r["channelId"],
            &r["channelType"],
            &r["clientMsgNo"]
        ),
        (&json!("u2"), &json!("u2"), &json!(1), &json!("m3"))
    );
    assert!(r["header"].is_object() && r["timestamp"].as_i64().unwrap() > 0);
    j.send_json(&json!({"method": "recvack",
                        "params": {"messageId": r["messageId"], "messageSeq": message_seq}}));

    // messagesync gives the same bytes, in order.
    assert_eq!(
        synced_payloads(&node, "u1", "u2"),
        vec![bytes, object_bytes, back]
    );

    // ping as a request (answered with result null) and as a notification (pong).
    let id = j.request("ping", json!({}));
    let (pong, _) = j.answer(&id);
    assert!(pong.get("result").is_some_and(Value::is_null), "{pong}");
    j.send_json(&json!({"method": "ping"}));
    assert_eq!(j.message()["method"], "pong");

    // The client's disconnect closes the connection.
    j.send_json(&json!({"method": "disconnect", "params": {"reasonCode": 0}}));
    let (_, code) = j.until_closed();
    assert_eq!(code, Some(1000));
    node.shutdown().unwrap();
}

fn a_recv_not_acknowledged_is_resent_with_dup(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), backend);
    c.session.ack_timeout_ms = 100;
    let node = Node::start(c).unwrap();
    set_token(&node, "u1", 1, 1);
    set_token(&node, "u2", 1, 1);
    let mut j = rpc_login(&node, "u1");
    let mut b = login(&node, "u2");
    b.send("u1", 1, 1, "m", b"again", true).unwrap();
    assert_eq!(next_sendack(&mut b).2, 1);
    let first = j.recv();
    assert!(first["header"].get("dup").is_none(), "{first}");
    let again = j.recv();
    assert_eq!(again["header"]["dup"], true, "{again}");
    assert_eq!(again["messageId"], first["messageId"]);
    node.shutdown().unwrap();
}

fn a_send_over_the_rate_is_answered_with_reason_22(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), backend);
    c.session.sends_per_uid_per_s = 1;
    c.session.sends_per_uid_burst = 1;
    let node = Node::start(c).unwrap();
    set_token(&node, "u1", 1, 1);
    set_token(&node, "u2", 1, 1);
    let mut j = rpc_login(&node, "u1");
    let send = json!({"channelId": "u2", "channelType": 1, "payload": "aGk="});
    j.requests_at_once(&[("a", "send", send.clone()), ("b", "send", send)]);
    // (The refusal is answered at once, the first SEND once it is committed.)
    let (mut first, mut second) = (j.message(), j.message());
    if first["id"] == "b" {
        std::mem::swap(&mut first, &mut second);
    }
    assert_eq!(first["result"]["reasonCode"], 1, "{first}");
    assert_eq!(second["id"], "b");
    assert_eq!(second["result"]["reasonCode"], 22, "{second}");
    // A refusal is an answer, not bad input: the connection goes on.
    let id = j.request("ping", Value::Null);
    assert!(j.answer(&id).0["result"].is_null());
    node.shutdown().unwrap();
}

fn bad_input_is_answered_then_closed(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path(), backend)).unwrap();
    set_token(&node, "u1", 1, 1);

    // Wrong token: an error object with the CONNACK's reason (2), then the close.
    let mut c = rpc(&node);
    let answer = c.connect("u1", "wrong");
    assert_eq!(answer["error"]["code"], 2, "{answer}");
    assert_eq!(c.until_closed().1, Some(1000));

    // Garbage: it cannot be answered: a disconnect notification with the reason.
    let mut c = rpc(&node);
    c.send_text(b"{not json").unwrap();
    let (seen, _) = c.until_closed();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0]["method"], "disconnect");
    assert!(seen[0]["params"]["reason"]
        .as_str()
        .unwrap()
        .contains("not a JSON object"));

    // ping before connect: its id is answered with an error, then the close.
    let mut c = rpc(&node);
    let id = c.request("ping", json!({}));
    let (seen, _) = c.until_closed();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0]["id"], id);
    assert_eq!(seen[0]["error"]["code"], proto::jsonrpc::INVALID_REQUEST);

    // An unknown method after connect: method not found.
    let mut c = rpc_login(&node, "u1");
    let id = c.request("subscribe", json!({"channelId": "g", "channelType": 2}));
    let (seen, _) = c.until_closed();
    assert_eq!(seen[0]["id"], id, "{seen:?}");
    assert_eq!(seen[0]["error"]["code"], proto::jsonrpc::METHOD_NOT_FOUND);

    // A text message over the limit: WebSocket close 1009, like a binary one.
    let mut c = rpc_login(&node, "u1");
    let big = format!(
        r#"{{"method":"ping","params":{{"pad":"{}"}}}}"#,
        "x".repeat(2 << 20)
    );
    let _ = c.send_text(big.as_bytes());
    assert_eq!(c.until_closed().1, Some(1009));

    // A binary message on a JSON-RPC connection: close 1003.
    let mut c = rpc_login(&node, "u1");
    c.send_binary(&[proto::wkproto::PING_BYTE]).unwrap();
    assert_eq!(c.until_closed().1, Some(1003));

    // Each bad connection was only its own: a new one works.
    let mut c = rpc_login(&node, "u1");
    let id = c.request("ping", Value::Null);
    assert!(c.answer(&id).0["result"].is_null());
    node.shutdown().unwrap();
}

fn connect_must_come_within_the_deadline(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), backend);
    c.net.connect_timeout_ms = 200;
    let node = Node::start(c).unwrap();
    let mut c = rpc(&node);
    // A text message begins (JSON-RPC) and is never finished: no connect comes.
    c.send_text_fragment(br#"{"method":"connect","#).unwrap();
    let (seen, code) = c.until_closed();
    assert!(
        seen.is_empty(),
        "closed by the deadline, not as bad input: {seen:?}"
    );
    assert_eq!(code, Some(1000));
    node.shutdown().unwrap();
}

fn a_master_login_kicks_across_the_protocols(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path(), backend)).unwrap();
    set_token(&node, "u1", 1, 1);
    // Binary first, then JSON-RPC: the binary session gets DISCONNECT 12.
    let mut first = login(&node, "u1");
    let mut j = rpc_login(&node, "u1");
    let seen = first.wait_closed().unwrap();
    assert!(
        matches!(seen.first(), Some(Received::Disconnect { reason: 12, .. })),
        "{seen:?}"
    );
    // JSON-RPC first, then binary: the JSON-RPC session gets disconnect 12.
    let _second = login(&node, "u1");
    let (seen, _) = j.until_closed();
    let note = seen
        .iter()
        .find(|v| v["method"] == "disconnect")
        .unwrap_or_else(|| panic!("no disconnect in {seen:?}"));
    assert_eq!(note["params"]["reasonCode"], 12, "{note}");
    assert_eq!(note["params"]["reason"], "login on another device");
    node.shutdown().unwrap();
}

on_both_drivers!(
    jsonrpc_and_binary_clients_exchange_messages,
    a_recv_not_acknowledged_is_resent_with_dup,
    a_send_over_the_rate_is_answered_with_reason_22,
    bad_input_is_answered_then_closed,
    connect_must_come_within_the_deadline,
    a_master_login_kicks_across_the_protocols,
);
