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
use crate::route::{BootId, Endpoint, SessionId, Uid};
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

/// A page of recipients grouped by exact target, in buffers reused from page to
/// page: `uids` holds the page's uids ordered by group, `groups[i]` is a target and
/// the range of its uids in `uids`.
#[derive(Debug, Default)]
pub struct TargetGroups {
    pub uids: Vec<Uid>,
    pub groups: Vec<(Target, std::ops::Range<usize>)>,
    /// Scratch: each input uid's group.
    group_of: Vec<u16>,
    /// Scratch: the input index of each position of `uids`.
    order: Vec<u32>,
}

impl TargetGroups {
    /// `(target, uids)` of each group, the shape `endpoints_by_targets*` take.
    pub fn lookups(&self) -> impl Iterator<Item = (Target, &[Uid])> + '_ {
        self.groups.iter().map(|(t, r)| (*t, &self.uids[r.clone()]))
    }
}

/// Groups `uids` by the exact target of their hash slot in `view` into `out`
/// (cleared first). Groups come out in order of first appearance; uids keep their
/// order inside a group. Duplicates are kept (duplicate recipient rows keep
/// duplicate-write semantics). No allocation once `out`'s buffers have grown to the
/// page size.
pub fn group_by_target(view: &ClusterView, uids: &[Uid], out: &mut TargetGroups) {
    out.uids.clear();
    out.groups.clear();
    out.group_of.clear();
    // At most 256 distinct targets: a slot-indexed table finds a uid's group in O(1).
    let mut group_of_slot = [u16::MAX; shard::slots::HASH_SLOTS];
    for uid in uids {
        let target = view.target_for_uid(uid);
        let g = &mut group_of_slot[target.hash_slot as usize];
        if *g == u16::MAX {
            *g = out.groups.len() as u16;
            out.groups.push((target, 0..0));
        }
        let g = *g;
        out.groups[g as usize].1.end += 1; // a count until the ranges are laid out
        out.group_of.push(g);
    }
    // Counts → ranges; then each uid's slot in the grouped order (stable), reusing
    // `group_of` for the inverse permutation.
    let mut start = 0;
    for (_, r) in out.groups.iter_mut() {
        let n = r.end;
        *r = start..start;
        start += n;
    }
    out.order.clear();
    out.order.resize(uids.len(), 0);
    for (i, &g) in out.group_of.iter().enumerate() {
        let r = &mut out.groups[g as usize].1;
        out.order[r.end] = i as u32;
        r.end += 1;
    }
    out.uids
        .extend(out.order.iter().map(|&i| uids[i as usize].clone()));
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

/// Coalesces the endpoints a page's lookup found into push batches by owner (see the
/// module docs); `failed_groups` is how many groups of the page failed (reported).
pub fn plan_pushes(
    local_node: NodeId,
    found: impl IntoIterator<Item = Endpoint>,
    failed_groups: usize,
    sender: Option<Sender>,
    push_batch_max: usize,
) -> PushPlan {
    assert!(push_batch_max > 0, "push_batch_max must be at least 1");
    let mut plan = PushPlan {
        failed_groups,
        ..PushPlan::default()
    };
    // Index of the open (not yet full) batch per destination.
    let mut open: Vec<(PushTo, usize)> = Vec::new();
    for ep in found {
        if let Some(s) = sender {
            if ep.node_id == s.node_id && ep.boot_id == s.boot_id && ep.session_id == s.session_id {
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
        let mut groups = TargetGroups::default();
        group_by_target(&view, &uids, &mut groups);
        let total: usize = groups.lookups().map(|g| g.1.len()).sum();
        assert_eq!(total, 4, "duplicates are kept");
        for (target, members) in groups.lookups() {
            for uid in members {
                assert_eq!(view.target_for_uid(uid), target);
            }
        }
        let first: Vec<&str> = groups
            .lookups()
            .next()
            .unwrap()
            .1
            .iter()
            .map(|u| &**u)
            .collect();
        assert_eq!(
            first,
            vec!["a", "a"],
            "a's group first, both rows kept in order"
        );

        // Many uids over many slots: every uid lands once in its own target's group,
        // input order kept inside each group, and a reused buffer holds no leftovers.
        let many: Vec<Uid> = (0..1000).map(|i| Uid::from(format!("u{i}"))).collect();
        group_by_target(&view, &many, &mut groups);
        let mut seen = Vec::new();
        for (target, members) in groups.lookups() {
            let mut last = None;
            for uid in members {
                assert_eq!(view.target_for_uid(uid), target);
                let i: usize = uid[1..].parse().unwrap();
                assert!(last < Some(i), "order kept inside a group");
                last = Some(i);
                seen.push(i);
            }
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..1000).collect::<Vec<_>>());
    }

    #[test]
    fn pushes_coalesce_by_owner_bounded_and_suppress_only_the_sending_session() {
        // Two groups found these endpoints; a third group failed.
        let found = vec![
            ep("a", 1, 0, 1),
            ep("a", 1, 1, 2),
            ep("b", 2, 0, 3),
            ep("c", 1, 0, 4),
            ep("d", 1, 0, 5),
            ep("e", 1, 0, 6),
        ];
        let sender = Sender {
            node_id: 1,
            boot_id: 7,
            session_id: session_id(1, 2),
        };
        let plan = plan_pushes(1, found, 1, Some(sender), 2);
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
