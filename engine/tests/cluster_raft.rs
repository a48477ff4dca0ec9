//! The replicated groups in a running three-node cluster (`[cluster] replicas =
//! 3`): every slot id's group elects one leader, every node agrees on it and its
//! term; with its leader's node stopped each group it led elects another among the
//! two left, in a higher term.
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

#[test]
fn every_group_elects_one_leader_and_another_when_its_node_stops() {
    let mut c = Cluster::start_with(Backend::Mio, |cfg| {
        cfg.cluster.replicas = 3;
    });
    let first = agreed(&c, &[1, 2, 3], "three nodes");
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
