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

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use shard::slots::ShardId;

use crate::cluster::{ClusterView, NodeId, Target};
use crate::commit::{Committed, Delivery};
use crate::route::{AuthorityError, BootId, Endpoint, SessionId, Uid};

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

/// A push batch the planner hands to the driver: `endpoints` of `message` to their
/// owner (this shard: write at once; another shard: its ring; another node: the
/// owner-push hop, which the cluster adds).
pub struct Push {
    pub to: PushTo,
    pub message: Arc<Committed>,
    pub endpoints: Vec<Endpoint>,
}

/// Route lookups for a page's target groups (`AuthorityReader` in the node; the
/// driver may time it).
pub trait EndpointLookup {
    /// The endpoints of each `(target, uids)` group, appended to `endpoints`, and one
    /// result per group (its range in `endpoints`, or why the group failed).
    fn endpoints_by_targets_into(
        &mut self,
        lookups: &[(Target, &[Uid])],
        endpoints: &mut Vec<Endpoint>,
        results: &mut Vec<Result<Range<usize>, AuthorityError>>,
    );
}

impl EndpointLookup for crate::authority::AuthorityReader {
    fn endpoints_by_targets_into(
        &mut self,
        lookups: &[(Target, &[Uid])],
        endpoints: &mut Vec<Endpoint>,
        results: &mut Vec<Result<Range<usize>, AuthorityError>>,
    ) {
        crate::authority::AuthorityReader::endpoints_by_targets_into(
            self, lookups, endpoints, results,
        )
    }
}

/// The planner's limits (`[delivery]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanLimits {
    /// This node.
    pub local_node: NodeId,
    /// This shard: its batches are written at once, without a ring.
    pub me: ShardId,
    /// Recipients planned per lookup (one route snapshot per page).
    pub subscriber_page_max: usize,
    /// Endpoints per push batch.
    pub push_batch_max: usize,
    /// Pages planned per [`Planner::pump`].
    pub pages_per_turn_max: usize,
    /// Room kept free towards every peer shard for commits, SENDACKs and control:
    /// a batch for a peer with no more room than this waits.
    pub reserved_room_per_peer: usize,
}

/// Counters the driver publishes as metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanCounts {
    /// Target groups whose lookup failed (their recipients catch up by sync).
    pub failed_groups: u64,
    /// Batches that waited for a peer's room.
    pub stalls: u64,
}

/// Step 3's delivery: plans the backlog of answered messages, oldest first, page by
/// page, into push batches ([`Push`] outputs). At most `pages_per_turn_max` pages a
/// call; a batch for a peer without room beyond `reserved_room_per_peer` waits
/// (`stalled`), and no further page is planned until it went, so a slow peer pauses
/// delivery rather than growing a queue. Buffers are reused from page to page.
#[derive(Default)]
pub struct Planner {
    /// Answered messages whose delivery has not ended, oldest first.
    backlog: VecDeque<Delivery>,
    /// The next page of the backlog's front message.
    next_page: usize,
    /// Batches of the front message that a peer had no room for.
    stalled: Vec<(ShardId, Vec<Endpoint>)>,
    groups: TargetGroups,
    endpoints: Vec<Endpoint>,
    results: Vec<Result<Range<usize>, AuthorityError>>,
    local: Vec<Vec<Endpoint>>,
    /// Per peer shard, the batches emitted in this call (its room shrinks by as many).
    emitted: Vec<usize>,
    counts: PlanCounts,
}

impl Planner {
    /// Messages waiting for (the end of) their delivery.
    pub fn len(&self) -> usize {
        self.backlog.len()
    }

    pub fn is_empty(&self) -> bool {
        self.backlog.is_empty()
    }

    /// Queues an answered message for delivery.
    pub fn enqueue(&mut self, d: Delivery) {
        self.backlog.push_back(d);
    }

    /// The counters so far, reset.
    pub fn take_counts(&mut self) -> PlanCounts {
        std::mem::take(&mut self.counts)
    }

    /// Plans up to `pages_per_turn_max` pages into `out`. `room(s)` is the room
    /// towards peer shard `s` now (the planner subtracts its own batches). Returns
    /// the bytes charged to the messages whose delivery ended (the commit core's
    /// budget) and the work done: 1 at least while anything waits, so the shard
    /// keeps turning until it is delivered.
    pub fn pump(
        &mut self,
        view: &ClusterView,
        lookup: &mut impl EndpointLookup,
        room: &mut impl FnMut(ShardId) -> usize,
        limits: &PlanLimits,
        out: &mut Vec<Push>,
    ) -> (usize, usize) {
        if self.backlog.is_empty() {
            return (0, 0);
        }
        self.emitted.clear();
        let (mut work, mut freed_bytes) = (self.retry_stalled(room, limits, out), 0);
        let mut pages = 0;
        while pages < limits.pages_per_turn_max && self.stalled.is_empty() {
            let Some(front) = self.backlog.front() else {
                break;
            };
            let (message, sender) = (front.message.clone(), front.sender);
            let subscribers = front.subscribers.clone();
            let person;
            let recipients: &[Uid] = match &subscribers {
                Some(s) => &s.uids,
                None => {
                    person = message.person_recipients();
                    &person
                }
            };
            let start = self.next_page * limits.subscriber_page_max;
            if start < recipients.len() {
                self.next_page += 1;
                let end = recipients.len().min(start + limits.subscriber_page_max);
                let page = &recipients[start..end];
                self.plan_page(view, lookup, room, limits, &message, sender, page, out);
                pages += 1;
                work += 1;
                if end < recipients.len() || !self.stalled.is_empty() {
                    continue;
                }
            }
            // Its last page is planned and nothing of it waits: it leaves now.
            freed_bytes += self.finish_front();
        }
        (freed_bytes, work + usize::from(!self.backlog.is_empty()))
    }

    /// Sends the front message's stalled batches to the peers that have room now.
    fn retry_stalled(
        &mut self,
        room: &mut impl FnMut(ShardId) -> usize,
        limits: &PlanLimits,
        out: &mut Vec<Push>,
    ) -> usize {
        if self.stalled.is_empty() {
            return 0;
        }
        let Some(front) = self.backlog.front() else {
            unreachable!("stalled batches belong to the backlog's front message");
        };
        let message = &front.message;
        let mut stalled = std::mem::take(&mut self.stalled);
        let before = stalled.len();
        stalled.retain_mut(|(to, endpoints)| {
            if !take_room(&mut self.emitted, room, *to, limits) {
                return true;
            }
            out.push(Push {
                to: PushTo::Shard(*to),
                message: message.clone(),
                endpoints: std::mem::take(endpoints),
            });
            false
        });
        let sent = before - stalled.len();
        self.stalled = stalled;
        sent.max(usize::from(!self.stalled.is_empty()))
    }

    /// Plans one page: groups by target, one lookup, batches by owner; this shard's
    /// batches come last (other shards write their sockets meanwhile).
    #[allow(clippy::too_many_arguments)]
    fn plan_page(
        &mut self,
        view: &ClusterView,
        lookup: &mut impl EndpointLookup,
        room: &mut impl FnMut(ShardId) -> usize,
        limits: &PlanLimits,
        message: &Arc<Committed>,
        sender: Option<Sender>,
        page: &[Uid],
        out: &mut Vec<Push>,
    ) {
        group_by_target(view, page, &mut self.groups);
        let lookups: Vec<(Target, &[Uid])> = self.groups.lookups().collect();
        self.endpoints.clear();
        self.results.clear();
        lookup.endpoints_by_targets_into(&lookups, &mut self.endpoints, &mut self.results);
        let failed_groups = self.results.iter().filter(|r| r.is_err()).count();
        let plan = plan_pushes(
            limits.local_node,
            self.endpoints.drain(..),
            failed_groups,
            sender,
            limits.push_batch_max,
        );
        self.counts.failed_groups += plan.failed_groups as u64;
        for (to, endpoints) in plan.batches {
            match to {
                PushTo::Shard(s) if s == limits.me => self.local.push(endpoints),
                PushTo::Shard(s) if !take_room(&mut self.emitted, room, s, limits) => {
                    self.counts.stalls += 1;
                    self.stalled.push((s, endpoints));
                }
                to => out.push(Push {
                    to,
                    message: message.clone(),
                    endpoints,
                }),
            }
        }
        for endpoints in self.local.drain(..) {
            out.push(Push {
                to: PushTo::Shard(limits.me),
                message: message.clone(),
                endpoints,
            });
        }
    }

    /// The front message is delivered: it leaves; returns its charge.
    fn finish_front(&mut self) -> usize {
        self.next_page = 0;
        self.backlog.pop_front().map_or(0, |d| d.charge_bytes)
    }
}

/// Takes one slot of room towards `to` if it has more than the reserve (counting
/// the batches this call already emitted there).
fn take_room(
    emitted: &mut Vec<usize>,
    room: &mut impl FnMut(ShardId) -> usize,
    to: ShardId,
    limits: &PlanLimits,
) -> bool {
    let i = to as usize;
    if emitted.len() <= i {
        emitted.resize(i + 1, 0);
    }
    if room(to).saturating_sub(emitted[i]) <= limits.reserved_room_per_peer {
        return false;
    }
    emitted[i] += 1;
    true
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
