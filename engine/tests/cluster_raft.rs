//! The replicated groups in a running three-node cluster (`[cluster] replicas =
//! 3`): every slot id's group elects one leader, every node agrees on it and its
//! term; with its leader's node stopped each group it led elects another among the
//! two left, in a higher term.
//! Each node's `GET /cluster/slots` lists every group with its replicas and the
//! leader and term it agreed on; each node places a slot id's hash slots on the
//! shard of its replica (`slot_id % shard_count`, layout version 3).
//! Waits are bounded polls of each node's `raft_status` (no sleeps).

use std::time::{Duration, Instant};

use net::io::Backend;
use support::cluster::Cluster;

#[macro_use]
mod support;

const WAIT: Duration = Duration::from_secs(20);

/// `(leader, term)` of every slot id as each running node's replica sees it, once
/// they all agree on a leader among `alive`; panics past [`WAIT`].
fn agreed(c: &Cluster, alive: &[u64], what: &str) -> Vec<(u64, u64)> {
    let slot_ids = c.nodes[0].shared().config.cluster.slot_ids;
    let deadline = Instant::now() + WAIT;
    loop {
        let seen: Vec<Vec<Option<(u64, u64)>>> = alive
            .iter()
            .map(|&id| {
                let s = &c.node(id).shared().raft_status;
                (0..slot_ids).map(|slot| s.of(slot)).collect()
            })
            .collect();
        let all = (0..slot_ids as usize).all(|slot| {
            let first = seen[0][slot];
            first.is_some_and(|(leader, _)| alive.contains(&leader))
                && seen.iter().all(|n| n[slot] == first)
        });
        if all {
            return seen[0].iter().map(|s| s.expect("agreed")).collect();
        }
        assert!(Instant::now() < deadline, "{what}: no agreement: {seen:?}");
        std::thread::yield_now();
    }
}

/// Node `id`'s `GET /cluster/slots` lists `slot_ids` groups, each with its three
/// replicas from the slot id on and the leader and term its replica knows (polled
/// until the answer and `raft_status` read right after it agree, within [`WAIT`]).
fn slots_show_the_groups(c: &Cluster, id: u64, slot_ids: usize) {
    let node = c.node(id);
    let deadline = Instant::now() + WAIT;
    loop {
        let (status, text) = support::http_get(node.api_addr().unwrap(), "/cluster/slots").unwrap();
        assert_eq!(status, 200, "{text}");
        let body: serde_json::Value = serde_json::from_str(&text).unwrap();
        let groups = body["replica_groups"].as_array().expect("replica_groups");
        assert_eq!(groups.len(), slot_ids, "node {id}");
        let mut agree = true;
        for (slot_id, g) in groups.iter().enumerate() {
            let replicas: Vec<u64> = (0..3).map(|k| [1, 2, 3][(slot_id + k) % 3]).collect();
            assert_eq!(g["slot_id"].as_u64(), Some(slot_id as u64), "{g}");
            assert_eq!(g["replicas"], serde_json::json!(replicas), "node {id}: {g}");
            let shown = g["leader_node_id"].as_u64().zip(g["term"].as_u64());
            agree &= shown == node.shared().raft_status.of(slot_id as u32);
        }
        if agree {
            return;
        }
        assert!(Instant::now() < deadline, "node {id}: {text}");
        std::thread::yield_now();
    }
}

#[test]
fn every_group_elects_one_leader_and_another_when_its_node_stops() {
    let mut c = Cluster::start_with(Backend::Mio, |cfg| {
        cfg.cluster.replicas = 3;
        cfg.runtime.shard_count = 2;
    });
    let first = agreed(&c, &[1, 2, 3], "three nodes");
    for id in 1..=3 {
        slots_show_the_groups(&c, id, first.len());
    }
    for node in &c.nodes {
        let map = &node.shared().slot_map;
        let shards = u32::from(map.shard_count());
        assert!(shards > 1, "the placement is seen across shards");
        for h in 0..256u16 {
            let slot_id = u32::from(h) * first.len() as u32 / 256;
            assert_eq!(
                u32::from(map.shard_of(h)),
                slot_id % shards,
                "hash slot {h}"
            );
        }
    }
    // Stop the leader of slot id 0 (node ids are 1..=3, nodes[id - 1]).
    let gone = first[0].0;
    let node = c.nodes.remove(gone as usize - 1);
    node.shutdown().unwrap();
    // (Indexes shift: look nodes up by id from here on.)
    let alive: Vec<u64> = [1, 2, 3].into_iter().filter(|&id| id != gone).collect();
    let left = |id: u64| {
        c.nodes
            .iter()
            .find(|n| n.shared().config.node_id == id)
            .unwrap()
    };
    let slot_ids = first.len() as u32;
    let deadline = Instant::now() + WAIT;
    'wait: loop {
        assert!(
            Instant::now() < deadline,
            "no new leaders after node {gone} stopped"
        );
        std::thread::yield_now();
        for slot in 0..slot_ids {
            let a = left(alive[0]).shared().raft_status.of(slot);
            let b = left(alive[1]).shared().raft_status.of(slot);
            let (old_leader, old_term) = first[slot as usize];
            let ok = a == b
                && a.is_some_and(|(leader, term)| {
                    alive.contains(&leader) && (old_leader != gone || term > old_term)
                });
            if !ok {
                continue 'wait;
            }
        }
        break;
    }
}
