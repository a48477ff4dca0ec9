//! Two in-process nodes that share the cluster secret but not the cluster's terms:
//! another `[cluster] id` (two clusters keyed alike by mistake), or another
//! `slot_ids` (every uid homed elsewhere). Each node refuses the other's handshake
//! by name, on both links (its own dial and the other's), so neither ever links:
//! `/metrics` counts the refusal by its reason on both nodes, `/readyz` stays 503
//! and `/cluster/slots` shows the peer unreachable. Nodes of equal terms link
//! (the other cluster tests).

#[macro_use]
mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use engine::config::{ClusterNode, Secret};
use engine::node::Node;
use net::io::Backend;

/// A failure detector: the refusals are counted long before.
const TIMEOUT: Duration = Duration::from_secs(10);

/// Nodes 1 and 2 of a two-node cluster, node 1 with `terms[0]` (cluster id, slot
/// ids), node 2 with `terms[1]`; one shard each.
fn two_nodes(backend: Backend, terms: [(&str, u32); 2]) -> (Vec<Node>, Vec<tempfile::TempDir>) {
    let ports = support::cluster::free_ports(4);
    let members: Vec<ClusterNode> = (0..2)
        .map(|i| ClusterNode {
            id: i as u64 + 1,
            rpc_addr: SocketAddr::from(([127, 0, 0, 1], ports[i])),
            api_addr: SocketAddr::from(([127, 0, 0, 1], ports[2 + i])),
            tcp_addr: None,
            ws_addr: None,
            wss_addr: None,
        })
        .collect();
    let (mut nodes, mut dirs) = (Vec::new(), Vec::new());
    for (member, (id, slot_ids)) in members.iter().zip(terms) {
        let dir = tempfile::tempdir().unwrap();
        let mut c = support::config(dir.path(), backend);
        c.node_id = member.id;
        c.runtime.shard_count = 1;
        c.rpc_addr = Some(member.rpc_addr);
        c.cluster.nodes = members.clone();
        c.cluster.id = id.to_string();
        c.cluster.slot_ids = slot_ids;
        c.cluster.secret = Secret::new("peer-terms-test-secret-0123456789".into());
        c.token_auth = false;
        nodes.push(Node::start(c).unwrap());
        dirs.push(dir);
    }
    (nodes, dirs)
}

/// The node total of the counter `name` in `/metrics`.
fn metric(node: &Node, name: &str) -> u64 {
    let text = node.api().handle("GET", "/metrics", None, b"").body;
    let line = text.lines().find(|l| l.split(' ').next() == Some(name));
    line.and_then(|l| l.split(' ').nth(1)?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics"))
}

/// Waits (bounded) until both nodes counted `name` at least twice: its refusals
/// of its own dial and of the peer's (each handshake is refused by name on both
/// nodes; which of them come first is the scheduler's choice).
fn both_refuse(nodes: &[Node], name: &str) {
    let deadline = Instant::now() + TIMEOUT;
    for (i, node) in nodes.iter().enumerate() {
        while metric(node, name) < 2 {
            assert!(
                Instant::now() < deadline,
                "node {}: {name} = {}",
                i + 1,
                metric(node, name)
            );
            std::thread::yield_now();
        }
    }
}

/// What the operator sees besides the counter: never linked, not ready.
fn never_linked(nodes: &[Node]) {
    for (i, node) in nodes.iter().enumerate() {
        assert_eq!(node.shared().peers_reached(), 0, "node {}", i + 1);
        let ready = node.api().handle("GET", "/readyz", None, b"");
        assert_eq!(ready.status, 503, "node {}: {}", i + 1, ready.body);
        assert!(
            ready.body.contains("reached 0 of 1 peers"),
            "{}",
            ready.body
        );
        let slots = node.api().handle("GET", "/cluster/slots", None, b"").body;
        let v: serde_json::Value = serde_json::from_str(&slots).unwrap();
        let peer = &v["nodes"][1 - i];
        assert_eq!(peer["state"], "unreachable", "node {}: {peer}", i + 1);
        assert_eq!(
            peer["boot_id"],
            serde_json::Value::Null,
            "never authenticated"
        );
    }
}

fn nodes_of_two_clusters_refuse_each_other_by_name(backend: Backend) {
    let (nodes, _dirs) = two_nodes(backend, [("blue", 64), ("green", 64)]);
    both_refuse(&nodes, "imrouter_rpc_refused_other_cluster_total");
    never_linked(&nodes);
    for node in &nodes {
        assert_eq!(metric(node, "imrouter_rpc_refused_other_slot_ids_total"), 0);
    }
    for node in nodes {
        node.shutdown().unwrap();
    }
}

fn nodes_of_two_slot_id_counts_refuse_each_other_by_name(backend: Backend) {
    let (nodes, _dirs) = two_nodes(backend, [("blue", 64), ("blue", 32)]);
    both_refuse(&nodes, "imrouter_rpc_refused_other_slot_ids_total");
    never_linked(&nodes);
    for node in &nodes {
        assert_eq!(metric(node, "imrouter_rpc_refused_other_cluster_total"), 0);
    }
    for node in nodes {
        node.shutdown().unwrap();
    }
}

on_both_drivers!(
    nodes_of_two_clusters_refuse_each_other_by_name,
    nodes_of_two_slot_id_counts_refuse_each_other_by_name,
);
