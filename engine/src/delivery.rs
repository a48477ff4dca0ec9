//! Post-commit delivery planning, sans-IO.
//!
//! 1. One page of recipient uids (at most `subscriber_page_max`) is hashed to the 256
//!    hash slots and grouped by exact authority target, using one cluster view
//!    snapshot for the whole page ([`group_by_target`]).
//! 2. The caller looks the groups up (`endpoints_by_targets`: a stale group fails
//!    alone; its siblings succeed).
//! 3. The endpoints found are coalesced by owner into bounded push batches
//!    ([`plan_pushes`]): one per owner shard of this node, one per remote owner node.
//!    Only the sender's exact SEND session is suppressed; its other devices receive.
//!
//! The owner revalidates every endpoint `(uid, boot_id, session_id, owner_seq)` before
//! writing, so a plan made from a slightly old snapshot can never reach a stale session.

use crate::cluster::{ClusterView, NodeId, Target};
use crate::route::{AuthorityError, BootId, Endpoint, SessionId, Uid};
use shard::slots::ShardId;

/// Bits of a session id below the owner shard: `session_id = shard << 48 | counter`.
/// The owner shard of an endpoint is read from its session id, so push batches go
/// straight to the shard that holds the connection.
pub const SESSION_SHARD_SHIFT: u32 = 48;

/// The session id of the `counter`-th session of `shard`.
pub fn session_id(shard: ShardId, counter: u64) -> SessionId {
    debug_assert!(counter < 1 << SESSION_SHARD_SHIFT);
    ((shard as u64) << SESSION_SHARD_SHIFT) | (counter & ((1 << SESSION_SHARD_SHIFT) - 1))
}

/// The shard that owns session `session_id` on its node.
pub fn session_shard(session_id: SessionId) -> ShardId {
    (session_id >> SESSION_SHARD_SHIFT) as ShardId
}

/// Groups `uids` by the exact target of their hash slot in `view`, appending to
/// `groups` (cleared first). Groups come out in order of first appearance; uids keep
/// their order inside a group. Duplicates are kept (duplicate recipient rows keep
/// duplicate-write semantics).
pub fn group_by_target(view: &ClusterView, uids: &[Uid], groups: &mut Vec<(Target, Vec<Uid>)>) {
    groups.clear();
    // At most 256 distinct targets: a slot-indexed table finds a uid's group in O(1).
    let mut group_of_slot = [u16::MAX; shard::slots::HASH_SLOTS];
    for uid in uids {
        let target = view.target_for_uid(uid);
        let g = &mut group_of_slot[target.hash_slot as usize];
        if *g == u16::MAX {
            *g = groups.len() as u16;
            groups.push((target, Vec::new()));
        }
        groups[*g as usize].1.push(uid.clone());
    }
}

/// The exact session that sent a message, whose own echo is suppressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sender {
    pub node_id: NodeId,
    pub boot_id: BootId,
    pub session_id: SessionId,
}

/// Where a push batch goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PushTo {
    /// A shard of this node.
    Shard(ShardId),
    /// Another node (owner-push RPC; the cluster milestone).
    Node(NodeId),
}

/// The outcome of planning one page.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PushPlan {
    /// Bounded batches, at most `push_batch_max` endpoints each.
    pub batches: Vec<(PushTo, Vec<Endpoint>)>,
    /// Groups whose lookup failed (stale target, not leader): those recipients are
    /// offline for this message and catch up by sync.
    pub failed_groups: usize,
    /// Endpoints dropped because they are the sending session itself.
    pub suppressed: usize,
}

/// Coalesces lookup results into push batches by owner (see the module docs).
pub fn plan_pushes(
    local_node: NodeId,
    results: Vec<Result<Vec<Endpoint>, AuthorityError>>,
    sender: Option<Sender>,
    push_batch_max: usize,
) -> PushPlan {
    assert!(push_batch_max > 0, "push_batch_max must be at least 1");
    let mut plan = PushPlan::default();
    // Index of the open (not yet full) batch per destination.
    let mut open: Vec<(PushTo, usize)> = Vec::new();
    for result in results {
        let endpoints = match result {
            Ok(endpoints) => endpoints,
            Err(_) => {
                plan.failed_groups += 1;
                continue;
            }
        };
        for ep in endpoints {
            if let Some(s) = sender {
                if ep.node_id == s.node_id
                    && ep.boot_id == s.boot_id
                    && ep.session_id == s.session_id
                {
                    plan.suppressed += 1;
                    continue;
                }
            }
            let to = if ep.node_id == local_node {
                PushTo::Shard(session_shard(ep.session_id))
            } else {
                PushTo::Node(ep.node_id)
            };
            let slot = match open.iter().position(|(d, _)| *d == to) {
                Some(i) if plan.batches[open[i].1].1.len() < push_batch_max => open[i].1,
                found => {
                    plan.batches.push((to, Vec::new()));
                    let b = plan.batches.len() - 1;
                    match found {
                        Some(i) => open[i].1 = b,
                        None => open.push((to, b)),
                    }
                    b
                }
            };
            plan.batches[slot].1.push(ep);
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::DeviceLevel;

    fn ep(uid: &str, node_id: NodeId, shard: ShardId, n: u64) -> Endpoint {
        Endpoint {
            uid: uid.into(),
            device_flag: 1,
            device_level: DeviceLevel::Master,
            node_id,
            boot_id: 7,
            session_id: session_id(shard, n),
            owner_seq: 1,
        }
    }

    #[test]
    fn session_ids_carry_their_shard() {
        let id = session_id(3, 12345);
        assert_eq!(session_shard(id), 3);
        assert_eq!(id & 0xffff_ffff, 12345);
    }

    #[test]
    fn uids_group_by_target_in_first_seen_order() {
        let view = ClusterView::single_node(1);
        let uids: Vec<Uid> = ["a", "b", "a", "c"].iter().map(|u| Uid::from(*u)).collect();
        let mut groups = Vec::new();
        group_by_target(&view, &uids, &mut groups);
        let total: usize = groups.iter().map(|g| g.1.len()).sum();
        assert_eq!(total, 4, "duplicates are kept");
        for (target, members) in &groups {
            for uid in members {
                assert_eq!(view.target_for_uid(uid), *target);
            }
        }
        assert_eq!(groups[0].1[0].as_ref(), "a");
    }

    #[test]
    fn pushes_coalesce_by_owner_bounded_and_suppress_only_the_sending_session() {
        let results = vec![
            Ok(vec![ep("a", 1, 0, 1), ep("a", 1, 1, 2), ep("b", 2, 0, 3)]),
            Err(AuthorityError::StaleTarget),
            Ok(vec![ep("c", 1, 0, 4), ep("d", 1, 0, 5), ep("e", 1, 0, 6)]),
        ];
        let sender = Sender {
            node_id: 1,
            boot_id: 7,
            session_id: session_id(1, 2),
        };
        let plan = plan_pushes(1, results, Some(sender), 2);
        assert_eq!(plan.failed_groups, 1);
        assert_eq!(plan.suppressed, 1);
        let dests: Vec<(PushTo, usize)> = plan.batches.iter().map(|(d, b)| (*d, b.len())).collect();
        assert_eq!(
            dests,
            vec![
                (PushTo::Shard(0), 2),
                (PushTo::Node(2), 1),
                (PushTo::Shard(0), 2)
            ],
            "shard 0 gets a+c, then d+e in a second bounded batch; node 2 gets b"
        );
        let shard0: Vec<&str> = plan
            .batches
            .iter()
            .filter(|b| b.0 == PushTo::Shard(0))
            .flat_map(|b| b.1.iter().map(|e| &*e.uid))
            .collect();
        assert_eq!(shard0, vec!["a", "c", "d", "e"]);
    }
}
