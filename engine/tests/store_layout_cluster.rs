//! Issue 15: the data dir records the cluster it belongs to (`layout.toml`: the
//! `[[cluster.nodes]]` ids and RPC addresses in config order, and `[cluster]
//! slot_ids`); a node started on it with another cluster, or alone, is refused
//! with one line naming both, before it binds anything. A node alone's data dir is
//! refused in a cluster the same way (the homes of its data would move).

mod support;

use std::net::SocketAddr;

use engine::config::{ClusterNode, Secret};
use engine::node::{Node, NodeConfig};
use net::io::Backend;

fn member(id: u64, port: u16) -> ClusterNode {
    ClusterNode {
        id,
        rpc_addr: SocketAddr::from(([127, 0, 0, 1], port)),
        // Never bound: the API is off in these nodes.
        api_addr: SocketAddr::from(([127, 0, 0, 1], 9)),
        tcp_addr: None,
        ws_addr: None,
        wss_addr: None,
    }
}

/// Node 1 of `members` on `dir` (peers need not run: the links keep dialing).
fn node_1(dir: &std::path::Path, members: &[ClusterNode]) -> NodeConfig {
    let mut c = support::config(dir, Backend::Mio);
    c.node_id = 1;
    if !members.is_empty() {
        c.rpc_addr = Some(members[0].rpc_addr);
        c.cluster.nodes = members.to_vec();
        c.cluster.slot_ids = 64;
        c.cluster.secret = Secret::new("store-layout-cluster-secret".into());
    }
    c
}

fn start_err(c: &NodeConfig) -> String {
    match Node::start(c.clone()) {
        Ok(_) => panic!("the node started with {:?}", c.cluster.nodes),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_start_with_another_cluster_is_refused_naming_both_lists() {
    let ports = support::processes::free_fixed_ports(4);
    let three = [
        member(1, ports[0]),
        member(2, ports[1]),
        member(3, ports[2]),
    ];
    let dir = tempfile::tempdir().unwrap();
    Node::start(node_1(dir.path(), &three))
        .unwrap()
        .shutdown()
        .unwrap();
    let recorded = format!(
        "the cluster [1@127.0.0.1:{}, 2@127.0.0.1:{}, 3@127.0.0.1:{}] over 64 slot ids, 1 replica",
        ports[0], ports[1], ports[2]
    );

    // Node 3 moved to another address: the homes' list changed.
    let moved = [three[0].clone(), three[1].clone(), member(3, ports[3])];
    let err = start_err(&node_1(dir.path(), &moved));
    assert!(!err.contains('\n'), "one line: {err}");
    assert!(err.contains(&recorded), "names the recorded list: {err}");
    let now = format!("3@127.0.0.1:{}] over 64 slot ids, 1 replica", ports[3]);
    assert!(err.contains(&now), "names the configured list: {err}");

    // A node alone on a cluster node's data dir.
    let err = start_err(&node_1(dir.path(), &[]));
    assert!(err.contains(&recorded), "{err}");
    assert!(err.contains("now give a node alone"), "{err}");

    // The recorded cluster starts again.
    Node::start(node_1(dir.path(), &three))
        .unwrap()
        .shutdown()
        .unwrap();
}

#[test]
fn a_node_alone_data_dir_is_refused_in_a_cluster() {
    let ports = support::processes::free_fixed_ports(3);
    let dir = tempfile::tempdir().unwrap();
    Node::start(node_1(dir.path(), &[]))
        .unwrap()
        .shutdown()
        .unwrap();
    let three = [
        member(1, ports[0]),
        member(2, ports[1]),
        member(3, ports[2]),
    ];
    let err = start_err(&node_1(dir.path(), &three));
    assert!(
        err.contains("was written by a node alone (no [[cluster.nodes]])"),
        "{err}"
    );
    assert!(err.contains("the homes of its data would move"), "{err}");
    Node::start(node_1(dir.path(), &[]))
        .unwrap()
        .shutdown()
        .unwrap();
}
