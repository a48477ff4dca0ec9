//! Issue 26, items 5 and 6 (the HTTP API's side): requests that wait on a shard or
//! on another node queue (bounded) instead of being refused, and hold no thread
//! while they wait; a peer that accepts connections and never answers (its link
//! never comes up) fails only the requests that need it, each with a 503 naming
//! it, and a breaker then fails them at once. Nodes in this process, over real
//! loopback HTTP.

#[macro_use]
mod support;

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

use engine::cluster::ClusterView;
use engine::config::{ClusterNode, Secret};
use engine::node::{Node, NodeConfig};
use net::io::Backend;
use serde_json::{json, Value};
use support::cluster::{free_ports, Cluster, SLOT_IDS};
use support::processes::http;

/// One shard a node: the machine is small and the queueing is the API's.
fn tune(c: &mut NodeConfig) {
    c.runtime.shard_count = 1;
}

fn home(view: &ClusterView, key: &str) -> u64 {
    view.home_node(slots::hash_slot(key.as_bytes()))
}

/// `count` requests at once, request `i` being `make(i)` = (API address, path,
/// body), each on its own connection and thread: the answers, in order.
fn at_once(
    count: usize,
    make: impl Fn(usize) -> (SocketAddr, &'static str, String),
) -> Vec<(u16, String)> {
    let start = Arc::new(std::sync::Barrier::new(count));
    let threads: Vec<_> = (0..count)
        .map(|i| {
            let (api, path, body) = make(i);
            let start = start.clone();
            std::thread::spawn(move || {
                start.wait();
                http(api, "POST", path, &body).unwrap_or_else(|e| (0, e.to_string()))
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// Every answer that is not a 200, with its request's index.
fn failures(answers: &[(u16, String)]) -> Vec<(usize, &(u16, String))> {
    answers
        .iter()
        .enumerate()
        .filter(|(_, a)| a.0 != 200)
        .collect()
}

fn token_body(uid: &str, token: &str) -> String {
    json!({"uid": uid, "token": token, "device_flag": 1, "device_level": 1}).to_string()
}

#[test]
fn two_hundred_concurrent_token_writes_through_any_node_all_succeed() {
    let cluster = Cluster::start_with(Backend::Mio, tune);
    let apis: Vec<SocketAddr> = (1..=3)
        .map(|n| cluster.node(n).api_addr().unwrap())
        .collect();
    let uids: Vec<String> = (0..200).map(|i| format!("load{i}")).collect();
    let mut homes = BTreeMap::new();
    for u in &uids {
        *homes.entry(home(&cluster.view, u)).or_insert(0) += 1;
    }
    assert_eq!(
        homes.len(),
        3,
        "the uids are homed on every node: {homes:?}"
    );
    // All through node 1: two thirds of them are passed to the other two homes.
    let answers = at_once(200, |i| (apis[0], "/user/token", token_body(&uids[i], "a")));
    assert!(failures(&answers).is_empty(), "{:?}", failures(&answers));
    // Through every node at once.
    let answers = at_once(200, |i| {
        (apis[i % 3], "/user/token", token_body(&uids[i], "b"))
    });
    assert!(failures(&answers).is_empty(), "{:?}", failures(&answers));
    for u in &uids {
        let stored = cluster
            .node(home(&cluster.view, u))
            .shared()
            .catalog
            .token(u, 1);
        assert_eq!(stored.map(|(t, _)| t.to_string()), Some("b".into()), "{u}");
    }
}

/// A listener that accepts every connection and never reads or answers (held
/// until the test ends).
struct BlackHole {
    _held: Arc<Mutex<Vec<TcpStream>>>,
}

impl BlackHole {
    fn bind(port: u16) -> BlackHole {
        let l = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port))).unwrap();
        let held = Arc::new(Mutex::new(Vec::new()));
        let keep = held.clone();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                keep.lock().unwrap().push(s);
            }
        });
        BlackHole { _held: held }
    }
}

/// Nodes 1 and 2 running; node 3 in their `[[cluster.nodes]]` with its RPC
/// address on a black hole (its API address on none). `tune` runs on each node's
/// config.
fn start_with_black_hole(
    tune: impl Fn(&mut NodeConfig),
) -> (Vec<Node>, BlackHole, Vec<tempfile::TempDir>) {
    let ports = free_ports(6);
    let members: Vec<ClusterNode> = (0..3)
        .map(|i| ClusterNode {
            id: i as u64 + 1,
            rpc_addr: SocketAddr::from(([127, 0, 0, 1], ports[i])),
            api_addr: SocketAddr::from(([127, 0, 0, 1], ports[3 + i])),
            tcp_addr: None,
            ws_addr: None,
            wss_addr: None,
        })
        .collect();
    let hole = BlackHole::bind(ports[2]);
    let (mut nodes, mut dirs) = (Vec::new(), Vec::new());
    for member in &members[..2] {
        let dir = tempfile::tempdir().unwrap();
        let mut c: NodeConfig = support::config(dir.path(), Backend::Mio);
        c.node_id = member.id;
        c.rpc_addr = Some(member.rpc_addr);
        c.cluster.nodes = members.clone();
        c.cluster.slot_ids = SLOT_IDS;
        c.cluster.secret = Secret::new("cluster-api-load-test-secret".into());
        c.token_auth = false;
        c.api.addr = Some(member.api_addr);
        tune(&mut c);
        nodes.push(Node::start(c).unwrap());
        dirs.push(dir);
    }
    (nodes, hole, dirs)
}

#[test]
fn a_black_holed_home_fails_only_its_requests_by_name_and_then_at_once() {
    let (nodes, _hole, _dirs) = start_with_black_hole(|c| {
        tune(c);
        // The breaker stays open for the rest of the test once it opened.
        c.api.forward_breaker_cooldown_ms = 600_000;
    });
    let view = ClusterView::initial(&[1, 2, 3], SLOT_IDS).unwrap();
    let apis: Vec<SocketAddr> = nodes.iter().map(|n| n.api_addr().unwrap()).collect();
    let far: Vec<String> = (0..)
        .map(|i| format!("far{i}"))
        .filter(|u| home(&view, u) == 3)
        .take(60)
        .collect();
    let near: Vec<String> = (0..)
        .map(|i| format!("near{i}"))
        .filter(|u| home(&view, u) != 3)
        .take(60)
        .collect();
    // Through both live nodes at once: each uid homed on node 3 needs it, the rest
    // (homed on node 1 or 2) do not.
    let answers = at_once(120, |i| {
        let uid = if i % 2 == 0 {
            &far[i / 2]
        } else {
            &near[i / 2]
        };
        (apis[i / 2 % 2], "/user/token", token_body(uid, "t"))
    });
    let named = "home node 3";
    for (i, (status, body)) in answers.iter().enumerate() {
        if i % 2 == 0 {
            assert_eq!(*status, 503, "request {i} (homed on node 3): {body}");
            assert!(body.contains(named), "request {i}: {body}");
        } else {
            assert_eq!(*status, 200, "request {i} (not homed on node 3): {body}");
        }
    }
    // The breaker is open: the next request that needs node 3 is refused without
    // asking it, naming it and why; the others still pass.
    for api in &apis {
        let (status, body) = http(*api, "POST", "/user/token", &token_body(&far[0], "u")).unwrap();
        assert_eq!(status, 503, "{body}");
        assert!(body.contains(named), "{body}");
        assert!(body.contains("in a row"), "{body}");
        let (status, body) = http(*api, "POST", "/user/token", &token_body(&near[0], "u")).unwrap();
        assert_eq!(status, 200, "{body}");
    }
    // onlinestatus of uids led by the live nodes, and message sends homed there,
    // still answer while node 3's share cannot be asked.
    let led_here: Vec<&String> = near
        .iter()
        .filter(|u| view.target_for_uid(u).leader_node_id != 3)
        .take(5)
        .collect();
    let (status, body) = http(
        apis[0],
        "POST",
        "/user/onlinestatus",
        &json!(led_here).to_string(),
    )
    .unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap(), json!([]));
    // What needs node 3's share (a uid it leads, a quit on every node) is a 503
    // naming it, at once: its breaker is open.
    let led_there = near
        .iter()
        .chain(&far)
        .find(|u| view.target_for_uid(u).leader_node_id == 3)
        .unwrap();
    let (status, body) = http(
        apis[0],
        "POST",
        "/user/onlinestatus",
        &json!([led_there]).to_string(),
    )
    .unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("authority node 3 is not asked"), "{body}");
    let quit = json!({"uid": near[0], "device_flag": 1}).to_string();
    let (status, body) = http(apis[1], "POST", "/user/device_quit", &quit).unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("node 3 is not asked"), "{body}");
    for n in nodes {
        n.shutdown().unwrap();
    }
}
