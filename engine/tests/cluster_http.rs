//! Issue 13, "HTTP API on any node": three nodes on 127.0.0.1 in this process, each
//! with its HTTP API on its `[[cluster.nodes]] api_addr` and a bearer token (so a
//! request passed to another node must carry it). Requests homed elsewhere are
//! answered by the home, onlinestatus asks every authority, device_quit reaches
//! every node, `/route` answers the configured client addresses, `/cluster/slots`
//! names homes and node states, and a stopped home is a 503 naming it.

#[macro_use]
mod support;

use std::time::{Duration, Instant};

use base64::Engine as _;
use engine::node::{Node, NodeConfig};
use net::client::{Client, Received, RecvMessage};
use net::io::Backend;
use serde_json::{json, Value};
use support::cluster::{login_any, Cluster};

const READ_TIMEOUT: Duration = Duration::from_secs(10);
const BEARER: &str = "Bearer cluster-http-test";
/// The operator's token (slot moves, drains).
const ADMIN: &str = "Bearer cluster-http-admin";

/// Each node's API on its configured address, a bearer token, one shard, and
/// client addresses for `/route` in every `[[cluster.nodes]]` entry.
fn tune(c: &mut NodeConfig) {
    let me = c.node_id;
    for n in &mut c.cluster.nodes {
        n.tcp_addr = Some(format!("im{}.test:5100", n.id));
        n.ws_addr = Some(format!("ws://im{}.test:5200", n.id));
        n.wss_addr = Some(format!("wss://im{}.test:5210", n.id));
    }
    let entry = c.cluster.nodes.iter().find(|n| n.id == me).unwrap();
    c.api.addr = Some(entry.api_addr);
    c.api.bearer_token = Some(BEARER["Bearer ".len()..].into());
    c.api.admin_token = Some(ADMIN["Bearer ".len()..].into());
    c.runtime.shard_count = 1;
}

fn start() -> Cluster {
    Cluster::start_with(Backend::Mio, tune)
}

/// `method path` with `body` on `node`'s API (in process; a request homed on
/// another node goes there over real HTTP): the status and JSON body.
fn call(node: &Node, method: &str, path: &str, body: Value) -> (u16, Value) {
    let text = if body.is_null() {
        String::new()
    } else {
        body.to_string()
    };
    let token = if engine::http::Api::is_admin(method, path) {
        ADMIN
    } else {
        BEARER
    };
    let reply = node
        .api()
        .handle(method, path, Some(token), text.as_bytes());
    let value = serde_json::from_str(&reply.body).unwrap_or(Value::Null);
    (reply.status, value)
}

fn post(node: &Node, path: &str, body: Value) -> Value {
    let (status, reply) = call(node, "POST", path, body);
    assert_eq!(status, 200, "POST {path}: {reply}");
    reply
}

/// The home of `key` (a uid, a group id or a person channel's key).
fn home(cluster: &Cluster, key: &str) -> u64 {
    cluster.view.home_node(slots::hash_slot(key.as_bytes()))
}

/// The first `prefix{n}` that `ok` accepts.
fn find(prefix: &str, ok: impl Fn(&str) -> bool) -> String {
    (0..100_000)
        .map(|n| format!("{prefix}{n}"))
        .find(|u| ok(u))
        .expect("a name with the wanted placement")
}

/// A node other than `a` and `b`.
fn other(a: u64, b: u64) -> u64 {
    (1..=3).find(|&n| n != a && n != b).unwrap()
}

fn next_recv(c: &mut Client) -> RecvMessage {
    loop {
        match c.read().unwrap() {
            Received::Recv(m) => return m,
            Received::Pong => continue,
            other => panic!("expected RECV, got {other:?}"),
        }
    }
}

/// `imrouter_api_forwards_total` of `node`.
fn forwards(node: &Node) -> u64 {
    let text = node.api().handle("GET", "/metrics", Some(BEARER), b"").body;
    text.lines()
        .find_map(|l| l.strip_prefix("imrouter_api_forwards_total "))
        .expect("the forwards counter")
        .parse()
        .unwrap()
}

#[test]
fn a_token_set_on_a_non_home_node_is_stored_at_the_home() {
    let cluster = start();
    let uid = find("tok", |u| home(&cluster, u) == 3);
    let before = forwards(cluster.node(1));
    post(
        cluster.node(1),
        "/user/token",
        json!({"uid": uid, "token": "t-1", "device_flag": 1, "device_level": 1}),
    );
    assert_eq!(forwards(cluster.node(1)), before + 1);
    let stored = |n: u64| cluster.node(n).shared().catalog.token(&uid, 1);
    assert_eq!(stored(3).map(|(t, _)| t.to_string()), Some("t-1".into()));
    assert_eq!(stored(1), None, "nothing stored on the node asked");
    // Set again through node 2: the home has the new one.
    post(
        cluster.node(2),
        "/user/token",
        json!({"uid": uid, "token": "t-2", "device_flag": 1}),
    );
    assert_eq!(stored(3).map(|(t, _)| t.to_string()), Some("t-2".into()));
    assert_eq!((stored(1), stored(2)), (None, None));
    // A bad body is refused where it arrives, before any hop.
    let (status, _) = call(cluster.node(1), "POST", "/user/token", json!({"uid": uid}));
    assert_eq!(status, 400);
    assert_eq!(forwards(cluster.node(1)), before + 1);
}

#[test]
fn subscribers_added_on_a_non_home_node_let_a_group_send_through() {
    let cluster = start();
    let group = find("grp", |g| home(&cluster, g) == 2);
    let members = ["gm-1", "gm-2", "gm-3"];
    post(
        cluster.node(1),
        "/channel/subscriber_add",
        json!({"channel_id": group, "channel_type": 2, "subscribers": members}),
    );
    assert!(cluster
        .node(1)
        .shared()
        .catalog
        .subscribers(&group)
        .is_none());
    let mut m1 = login_any(cluster.node(1), "gm-1");
    let mut m2 = login_any(cluster.node(2), "gm-2");
    let mut m3 = login_any(cluster.node(3), "gm-3");
    m1.send(&group, 2, 1, "g-1", b"to the group", true).unwrap();
    for c in [&mut m2, &mut m3] {
        let m = next_recv(c);
        assert_eq!(
            (m.channel_id.as_str(), m.payload.as_slice()),
            (group.as_str(), &b"to the group"[..])
        );
    }
    // Removed through node 3: the home no longer lists gm-3.
    post(
        cluster.node(3),
        "/channel/subscriber_remove",
        json!({"channel_id": group, "channel_type": 2, "subscribers": ["gm-3"]}),
    );
    let subs = cluster
        .node(2)
        .shared()
        .catalog
        .subscribers(&group)
        .unwrap();
    assert!(subs.contains("gm-2") && !subs.contains("gm-3"));
}

#[test]
fn message_send_on_a_non_home_node_delivers_and_every_node_syncs_it() {
    let cluster = start();
    let to = find("rcpt", |u| {
        home(&cluster, &engine::channel::person_channel_key("sys", u)) == 3
    });
    let mut client = login_any(cluster.node(2), &to);
    let payload = base64::engine::general_purpose::STANDARD.encode(b"from the server");
    let sent = post(
        cluster.node(1),
        "/message/send",
        json!({"from_uid": "sys", "channel_id": to, "channel_type": 1, "payload": payload}),
    );
    let id = sent["message_id"].as_i64().expect("a message id");
    assert_eq!(sent["message_seq"], 1, "{sent}");
    let m = next_recv(&mut client);
    assert_eq!(
        (m.message_id, m.payload.as_slice()),
        (id, &b"from the server"[..])
    );
    for n in 1..=3 {
        let sync = post(
            cluster.node(n),
            "/channel/messagesync",
            json!({"login_uid": to, "channel_id": "sys", "channel_type": 1, "limit": 10}),
        );
        let messages = sync["messages"].as_array().expect("messages");
        assert_eq!(messages.len(), 1, "node {n}: {sync}");
        assert_eq!(messages[0]["message_id"], id, "node {n}");
        assert_eq!(messages[0]["channel_id"], "sys", "node {n}");
    }
}

#[test]
fn onlinestatus_on_any_node_lists_uids_online_on_other_nodes() {
    let cluster = start();
    // u3's authority is node 3, its session on node 2; u1's authority node 1,
    // its session on node 3.
    let u3 = find("on3-", |u| cluster.authority_of(u) == 3);
    let u1 = find("on1-", |u| cluster.authority_of(u) == 1);
    let _c3 = login_any(cluster.node(2), &u3);
    let _c1 = login_any(cluster.node(3), &u1);
    for n in 1..=3 {
        let (status, list) = call(
            cluster.node(n),
            "POST",
            "/user/onlinestatus",
            json!([u3, u1, "nobody-online"]),
        );
        assert_eq!(status, 200, "node {n}: {list}");
        let mut online: Vec<&str> = list
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["uid"].as_str().unwrap())
            .collect();
        online.sort_unstable();
        let mut want = vec![u1.as_str(), u3.as_str()];
        want.sort_unstable();
        assert_eq!(online, want, "node {n}: {list}");
    }
}

#[test]
fn device_quit_on_node_1_closes_a_session_on_node_2() {
    let cluster = start();
    let mut far = login_any(cluster.node(2), "quitter");
    let mut near = login_any(cluster.node(1), "quitter");
    post(
        cluster.node(1),
        "/user/device_quit",
        json!({"uid": "quitter", "device_flag": -1}),
    );
    far.wait_closed().unwrap();
    near.wait_closed().unwrap();
}

#[test]
fn route_answers_the_configured_addresses_the_same_on_every_node() {
    let cluster = start();
    let uids: Vec<String> = (0..60).map(|i| format!("ru{i}")).collect();
    let mut used = std::collections::BTreeSet::new();
    for uid in &uids {
        let answers: Vec<Value> = (1..=3)
            .map(|n| {
                let api = cluster.node(n).api_addr().unwrap();
                let path = format!("/route?uid={uid}");
                // GET /route over real HTTP: the query reaches the handler.
                let (status, body) = http_get_auth(api, &path);
                assert_eq!(status, 200, "{body}");
                serde_json::from_str(&body).unwrap()
            })
            .collect();
        assert!(answers.iter().all(|a| *a == answers[0]), "{answers:?}");
        let tcp = answers[0]["tcp_addr"].as_str().unwrap().to_string();
        let id = tcp.strip_prefix("im").unwrap().split('.').next().unwrap();
        assert_eq!(answers[0]["ws_addr"], format!("ws://im{id}.test:5200"));
        assert_eq!(answers[0]["wss_addr"], format!("wss://im{id}.test:5210"));
        used.insert(tcp);
    }
    assert_eq!(
        used.len(),
        3,
        "60 uids spread over the three nodes: {used:?}"
    );
    // The batch groups the same uids the same way.
    let batch = post(cluster.node(2), "/route/batch", json!(uids));
    let mut seen = 0;
    for group in batch.as_array().unwrap() {
        for uid in group["uids"].as_array().unwrap() {
            let (_, single) = call(
                cluster.node(1),
                "GET",
                &format!("/route?uid={}", uid.as_str().unwrap()),
                Value::Null,
            );
            assert_eq!(single["tcp_addr"], group["tcp_addr"]);
            seen += 1;
        }
    }
    assert_eq!(seen, uids.len());
}

/// `GET path` with the bearer token over real HTTP: status and body.
fn http_get_auth(api: std::net::SocketAddr, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(api).unwrap();
    s.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: {BEARER}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let status = text.split(' ').nth(1).unwrap().parse().unwrap();
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

#[test]
fn cluster_slots_names_each_slots_home_and_the_nodes_states() {
    let cluster = start();
    let (status, slots) = call(cluster.node(2), "GET", "/cluster/slots", Value::Null);
    assert_eq!(status, 200);
    for s in slots["slots"].as_array().unwrap() {
        let h = s["hash_slot"].as_u64().unwrap() as u16;
        assert_eq!(s["home_node_id"], cluster.view.home_node(h), "{s}");
    }
    let nodes = slots["nodes"].as_array().unwrap();
    let states: Vec<(u64, &str)> = nodes
        .iter()
        .map(|n| (n["id"].as_u64().unwrap(), n["state"].as_str().unwrap()))
        .collect();
    assert_eq!(states, [(1, "up"), (2, "self"), (3, "up")]);
    let me = cluster.node(2).shared();
    assert_eq!(nodes[1]["boot_id"], me.boot_id.to_string());
    let api = me.config.cluster.nodes[2].api_addr.to_string();
    assert_eq!(nodes[2]["api_addr"], api);
    // A peer's boot id shows once a link reported it.
    let peer_boot = cluster.node(3).shared().boot_id;
    me.note_peer_boot(3, peer_boot);
    let (_, slots) = call(cluster.node(2), "GET", "/cluster/slots", Value::Null);
    assert_eq!(slots["nodes"][2]["boot_id"], peer_boot.to_string());
}

#[test]
fn a_node_alone_routes_every_uid_to_its_own_listeners() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(support::config(dir.path(), Backend::Mio)).unwrap();
    let reply = node.api().handle("GET", "/route?uid=u%201", None, b"");
    let r: Value = serde_json::from_str(&reply.body).unwrap();
    let tcp = node.tcp_addr().unwrap().to_string();
    let ws = format!("ws://{}", node.ws_addr().unwrap());
    assert_eq!(r, json!({"tcp_addr": tcp, "ws_addr": ws, "wss_addr": ""}));
    let reply = node
        .api()
        .handle("POST", "/route/batch", None, br#"["a","b"]"#);
    let r: Value = serde_json::from_str(&reply.body).unwrap();
    assert_eq!(
        r,
        json!([{"uids": ["a", "b"], "tcp_addr": tcp, "ws_addr": ws, "wss_addr": ""}])
    );
    let reply = node.api().handle("GET", "/route", None, b"");
    assert_eq!(reply.status, 400, "{}", reply.body);
    let slots: Value =
        serde_json::from_str(&node.api().handle("GET", "/cluster/slots", None, b"").body).unwrap();
    assert_eq!(slots["nodes"][0]["state"], "self");
    assert_eq!(slots["slots"][7]["home_node_id"], 1);
    node.shutdown().unwrap();
}

#[test]
fn a_stopped_home_is_a_503_naming_it_and_leaves_the_routes() {
    let mut cluster = start();
    let uid = find("gone", |u| home(&cluster, u) == 3);
    cluster.nodes.pop().unwrap().shutdown().unwrap();
    let (status, reply) = call(
        cluster.node(1),
        "POST",
        "/user/token",
        json!({"uid": uid, "token": "t"}),
    );
    assert_eq!(status, 503, "{reply}");
    let msg = reply["msg"].as_str().unwrap();
    // No link to it, or (its link not yet seen closed) no answer on it.
    assert!(msg.starts_with("home node 3 unreachable: "), "{msg}");
    // Once the links saw it go, it is unreachable and no client is sent there.
    let deadline = Instant::now() + READ_TIMEOUT;
    loop {
        let (_, slots) = call(cluster.node(1), "GET", "/cluster/slots", Value::Null);
        if slots["nodes"][2]["state"] == "unreachable" {
            break;
        }
        assert!(Instant::now() < deadline, "node 3 still up: {slots}");
        std::thread::yield_now();
    }
    for i in 0..30 {
        let (_, r) = call(
            cluster.node(1),
            "GET",
            &format!("/route?uid=r{i}"),
            Value::Null,
        );
        assert_ne!(r["tcp_addr"], "im3.test:5100");
    }
    let other_uid = find("kept", |u| home(&cluster, u) == other(1, 3));
    post(
        cluster.node(1),
        "/user/token",
        json!({"uid": other_uid, "token": "t"}),
    );
}

/// Issue 26 item 3: a request homed elsewhere travels on the inter-node link
/// (authenticated, sealed), never as plain HTTP to the home's API address: node 1
/// is given API addresses for its peers where nothing listens, and its token set,
/// its message send and sync, its onlinestatus and its device_quit, all homed on
/// or asked of the other nodes, are still answered by them.
#[test]
fn a_request_homed_elsewhere_travels_on_the_link_not_to_the_homes_api_address() {
    let cluster = Cluster::start_with(Backend::Mio, |c| {
        tune(c);
        if c.node_id == 1 {
            for n in c.cluster.nodes.iter_mut().filter(|n| n.id != 1) {
                n.api_addr = "127.0.0.1:1".parse().unwrap();
            }
        }
    });
    let uid = find("link", |u| home(&cluster, u) == 3);
    let before = forwards(cluster.node(1));
    post(
        cluster.node(1),
        "/user/token",
        json!({"uid": uid, "token": "t-link", "device_flag": 1}),
    );
    assert_eq!(forwards(cluster.node(1)), before + 1);
    let stored = cluster.node(3).shared().catalog.token(&uid, 1);
    assert_eq!(stored.map(|(t, _)| t.to_string()), Some("t-link".into()));

    let to = find("lrcpt", |u| {
        home(&cluster, &engine::channel::person_channel_key("sys", u)) == 2
    });
    let u3 = find("lon3-", |u| cluster.authority_of(u) == 3);
    let mut client = login_any(cluster.node(3), &to);
    let _online = login_any(cluster.node(2), &u3);
    let payload = base64::engine::general_purpose::STANDARD.encode(b"over the link");
    let sent = post(
        cluster.node(1),
        "/message/send",
        json!({"from_uid": "sys", "channel_id": to, "channel_type": 1, "payload": payload}),
    );
    let id = sent["message_id"].as_i64().expect("a message id");
    assert_eq!(next_recv(&mut client).message_id, id);
    let sync = post(
        cluster.node(1),
        "/channel/messagesync",
        json!({"login_uid": to, "channel_id": "sys", "channel_type": 1, "limit": 10}),
    );
    assert_eq!(sync["messages"][0]["message_id"], id, "{sync}");
    let (status, list) = call(cluster.node(1), "POST", "/user/onlinestatus", json!([u3]));
    assert_eq!(
        (status, list[0]["uid"].as_str()),
        (200, Some(u3.as_str())),
        "{list}"
    );
    post(
        cluster.node(1),
        "/user/device_quit",
        json!({"uid": to, "device_flag": -1}),
    );
    client.wait_closed().unwrap();
}

#[test]
fn a_forwarded_request_is_answered_where_it_arrives_and_never_passed_on() {
    let cluster = start();
    let uid = find("fwd", |u| home(&cluster, u) == 3);
    let body = json!({"uid": uid, "token": "t", "device_flag": 1}).to_string();
    let request = |forwarded_by| engine::http::ApiRequest {
        method: "POST",
        target: "/user/token",
        authorization: Some(BEARER),
        forwarded_by,
        body: body.as_bytes(),
    };
    let before = forwards(cluster.node(1));
    let reply = cluster.node(1).api().handle_request(&request(Some(2)));
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(forwards(cluster.node(1)), before, "not passed on");
    assert!(cluster.node(1).shared().catalog.token(&uid, 1).is_some());
    // The header must name a peer.
    for bad in [Some(1), Some(9)] {
        let reply = cluster.node(1).api().handle_request(&request(bad));
        assert_eq!(reply.status, 400, "{bad:?}: {}", reply.body);
    }
}

/// A slot move is checked before it is made (issue 26, item 10): a leader outside
/// the cluster is refused (400) and nothing moves; a move naming the revision it
/// expects is refused (409, naming the current one) when the view moved on, and made
/// when it did not.
#[test]
fn a_slot_move_names_a_node_of_the_cluster_and_may_name_its_revision() {
    let cluster = start();
    let node = cluster.node(1);
    let before = node.shared().view().as_ref().clone();
    let (status, reply) = call(
        node,
        "POST",
        "/cluster/slots/leader",
        json!({"hash_slots": [7], "leader_node_id": 9}),
    );
    assert_eq!(status, 400, "{reply}");
    assert!(reply.to_string().contains("node 9"), "{reply}");
    assert_eq!(*node.shared().view(), before, "nothing moved");
    let stale = before.revision;
    let to = other(before.slots[7].leader_node_id, 0);
    let (status, reply) = call(
        node,
        "POST",
        "/cluster/slots/leader",
        json!({"hash_slots": [7], "leader_node_id": to, "revision": stale}),
    );
    assert_eq!(status, 200, "the expected revision: {reply}");
    let (status, reply) = call(
        node,
        "POST",
        "/cluster/slots/leader",
        json!({"hash_slots": [8], "leader_node_id": to, "revision": stale}),
    );
    assert_eq!(status, 409, "{reply}");
    let now = node.shared().view().revision;
    assert!(
        reply.to_string().contains(&format!("revision {now}")),
        "names the current revision: {reply}"
    );
    assert_eq!(node.shared().view().slots[8], before.slots[8], "not moved");
}
