//! Post-commit delivery planning, sans-IO.
//!
//! 1. One page of recipient uids (at most `subscriber_page_max`) is hashed to the 256
//!    hash slots and grouped by exact authority target, using one cluster view
//!    snapshot for the whole page ([`group_by_target`]).
//! 2. The groups are looked up (`endpoints_by_targets`: a stale group fails alone;
//!    its siblings succeed): those this node leads synchronously ([`EndpointLookup`],
//!    the node's lock-free `AuthorityReader`), those led by other nodes by one
//!    EndpointsByTargets RPC per node and page ([`Lookup`], answered by
//!    [`Planner::on_lookup_reply`]; each group is pushed once its lookup ended,
//!    unless an earlier page still has a group of its hash slot to push: see
//!    [`Planner`]).
//! 3. The endpoints found are coalesced by owner into bounded push batches
//!    ([`plan_pushes`]): one per owner shard of this node, one per remote owner node.
//!    Only the sender's exact SEND session is suppressed; its other devices receive.
//!
//! 4. With `offline_uids` on, the recipients a page's lookups found no endpoint for
//!    (the sender's uid left out, groups whose lookup failed left out: unknown, not
//!    offline) are gathered per message and handed out once all its pages are pushed
//!    ([`PlanOutput::Offline`], the `msg.offline` webhook): the same lookups, no
//!    second one.
//!
//! The owner revalidates every endpoint `(uid, boot_id, session_id, owner_seq)` before
//! writing, so a plan made from a slightly old snapshot (or a remote reply that took
//! a while) can never reach a stale session.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use slots::ShardId;

use crate::cluster::{ClusterView, Homes, NodeId, Target};
use crate::presence::authority::uid_hash;
pub use crate::presence::authority::HashedGroup;
use crate::presence::route::{AuthorityError, Endpoint, SessionId, Uid};
pub use crate::send::message::{Committed, Delivery, Sender};

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
    /// The page's uids, group after group, each group in input order (duplicates
    /// kept).
    pub uids: Vec<Uid>,
    /// Each group's exact target and the range of its uids in `uids`, in order of
    /// first appearance.
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
    let mut group_of_slot = [u16::MAX; slots::HASH_SLOTS];
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

/// Where a push batch goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PushTo {
    /// A shard of this node.
    Shard(ShardId),
    /// Another node (the owner-push hop).
    Node(NodeId),
}

/// The room of the link to another node, in push batches, for the planner's `room`:
/// none while `queued_bytes` (what the link holds unwritten) is at `limit_bytes` or
/// more, so the page waits (a stall) until the peer reads; unlimited otherwise. A
/// link that is down (`None`) takes everything: its pushes are dropped and counted
/// by the driver and their recipients catch up by sync, so a dead node never stalls
/// everyone else's delivery.
pub fn link_room(queued_bytes: Option<usize>, limit_bytes: usize) -> usize {
    match queued_bytes {
        Some(queued) if queued >= limit_bytes => 0,
        _ => usize::MAX,
    }
}

/// The outcome of planning one page.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PushPlan {
    /// Bounded batches, at most `push_batch_max` endpoints each.
    pub batches: Vec<(PushTo, Vec<Endpoint>)>,
    /// Endpoints dropped because they are the sending session itself.
    pub suppressed: usize,
    /// Endpoints of this node on a shard it does not have: dropped.
    pub stale: usize,
}

/// Coalesces the endpoints a page's lookup found into push batches by owner (see the
/// module docs). An endpoint of `local_node` on a shard past `shard_count` is stale (no gateway of
/// this process made it): dropped and counted.
pub fn plan_pushes(
    local_node: NodeId,
    shard_count: ShardId,
    found: impl IntoIterator<Item = Endpoint>,
    sender: Option<Sender>,
    push_batch_max: usize,
) -> PushPlan {
    assert!(push_batch_max > 0, "push_batch_max must be at least 1");
    let mut plan = PushPlan::default();
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
            let shard = session_shard(ep.session_id);
            if shard >= shard_count {
                plan.stale += 1;
                continue;
            }
            PushTo::Shard(shard)
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
    /// The owner the batch goes to: a shard of this node or another node.
    pub to: PushTo,
    /// The message, shared with the other batches of its fan-out.
    pub message: Arc<Committed>,
    /// The recipients' exact endpoints, all of `to`, at most `push_batch_max`; the
    /// owner revalidates each before it writes the RECV.
    pub endpoints: Vec<Endpoint>,
}

/// An EndpointsByTargets request for the groups of one page whose authority is
/// another node (`target.leader_node_id == node`): one per remote node per page.
/// That node validates each group against its fence; a stale group fails alone.
///
/// The driver must answer it exactly once with [`Planner::on_lookup_reply`]: the
/// node's reply, or a [`LookupReply::Failed`] it synthesizes (the RPC deadline
/// passed, the peer is down, the peer restarted). Until then its groups wait, and
/// so do the groups of the same hash slots of the pages behind it; their other
/// groups are pushed meanwhile (see [`Planner`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lookup {
    /// Unique among this planner's lookups (a counter from 0).
    pub lookup_id: u64,
    /// The authority node asked.
    pub node: NodeId,
    /// The message whose page this is (for logs).
    pub message_id: i64,
    /// Each group's exact target and the range of its uids in `uids`, in the order
    /// the reply's results must follow.
    pub groups: Vec<(Target, Range<usize>)>,
    /// The groups' uids, group after group (duplicates kept).
    pub uids: Vec<Uid>,
}

impl Lookup {
    /// `(target, uids)` of each group, in request order (the shape
    /// `endpoints_by_targets_into` takes at the authority node).
    pub fn groups(&self) -> impl Iterator<Item = (Target, &[Uid])> + '_ {
        self.groups.iter().map(|(t, r)| (*t, &self.uids[r.clone()]))
    }
}

/// Why a remote lookup failed as a whole. The driver synthesizes it; every group of
/// the lookup counts as failed (`PlanCounts::failed_groups`): those recipients
/// catch up by messagesync.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LookupFailure {
    /// No reply within the RPC deadline.
    Deadline,
    /// The peer is down or unreachable (no link, or it closed).
    PeerDown,
    /// The peer restarted (a new boot id): every request in flight to it failed.
    PeerRestarted,
}

/// A remote node's answer to a [`Lookup`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LookupReply {
    /// The shape of [`EndpointLookup::endpoints_by_targets_into`]: one result per
    /// group, in request order, each the range of its endpoints in `endpoints`
    /// (ranges in increasing order, disjoint) or why that group alone failed. A
    /// reply of another shape (a count or range that does not fit) fails every
    /// group of the lookup.
    Found {
        /// Every group's endpoints, group after group.
        endpoints: Vec<Endpoint>,
        /// One per group of the [`Lookup`], in its order: the group's range in
        /// `endpoints`, or the authority's refusal of that group.
        results: Vec<Result<Range<usize>, AuthorityError>>,
    },
    /// The lookup failed as a whole (see [`LookupFailure`]).
    Failed(LookupFailure),
}

/// A message's recipients that had no route when it was planned (every page's
/// lookups done): the `msg.offline` webhook's `to_uids`. Each uid once (a group's
/// subscribers are unique, each in one page), in no particular order (sorting
/// 10,000 uids per message cost a group of that size most of a core at 2,000
/// messages a second), the sender's uid never; recipients of a group whose lookup failed (stale target,
/// not leader, a remote lookup that failed) are unknown and not in it.
#[derive(Clone)]
pub struct Offline {
    /// The message the recipients missed.
    pub message: Arc<Committed>,
    /// The recipients without a route: each once, never the sender, unordered.
    pub uids: Vec<Uid>,
}

/// What [`Planner::pump`] hands to the driver.
pub enum PlanOutput {
    /// A push batch to carry to its owner.
    Push(Push),
    /// An EndpointsByTargets RPC to send; answer it with
    /// [`Planner::on_lookup_reply`].
    Lookup(Lookup),
    /// A message's offline recipients, after its last push (only with
    /// `PlanLimits::offline_uids`, never for a NoPersist message or when none was
    /// offline).
    Offline(Offline),
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

    /// The same for groups whose uids' hashes are given (what the planner asks;
    /// `AuthorityReader` skips the uids its presence filters rule out without
    /// reading them). By default the plain lookup, hashes unused.
    fn endpoints_by_hashed_groups_into(
        &mut self,
        lookups: &[HashedGroup<'_>],
        endpoints: &mut Vec<Endpoint>,
        results: &mut Vec<Result<Range<usize>, AuthorityError>>,
    ) {
        let plain: Vec<(Target, &[Uid])> = lookups.iter().map(|g| (g.target, g.uids)).collect();
        self.endpoints_by_targets_into(&plain, endpoints, results);
    }
}

impl EndpointLookup for crate::presence::authority::AuthorityReader {
    fn endpoints_by_targets_into(
        &mut self,
        lookups: &[(Target, &[Uid])],
        endpoints: &mut Vec<Endpoint>,
        results: &mut Vec<Result<Range<usize>, AuthorityError>>,
    ) {
        crate::presence::authority::AuthorityReader::endpoints_by_targets_into(
            self, lookups, endpoints, results,
        )
    }

    fn endpoints_by_hashed_groups_into(
        &mut self,
        lookups: &[HashedGroup<'_>],
        endpoints: &mut Vec<Endpoint>,
        results: &mut Vec<Result<Range<usize>, AuthorityError>>,
    ) {
        crate::presence::authority::AuthorityReader::endpoints_by_hashed_groups_into(
            self, lookups, endpoints, results,
        )
    }
}

/// The planner's limits (`[delivery]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanLimits {
    /// This node: groups whose target it leads are looked up synchronously; the
    /// others become [`Lookup`]s.
    pub local_node: NodeId,
    /// This shard: its batches are written at once, without a ring.
    pub me: ShardId,
    /// This node's shards: an endpoint of this node on a shard it does not have (a
    /// route no gateway of this process made) is stale, never pushed.
    pub shard_count: ShardId,
    /// Recipients planned per lookup (one route snapshot per page).
    pub subscriber_page_max: usize,
    /// Endpoints per push batch.
    pub push_batch_max: usize,
    /// Pages planned per [`Planner::pump`].
    pub pages_per_turn_max: usize,
    /// Pages looked up and not yet wholly pushed at once (groups waiting for
    /// their lookups, or held behind an earlier page's group of their slot): the
    /// pipeline's depth, and the bound of the endpoints held, see [`Planner`]. 1:
    /// one page at a time (a page led elsewhere holds everything behind it for a
    /// round trip). 0 counts as 1.
    pub lookup_pages_in_flight_max: usize,
    /// Room kept free towards every peer (shard or node) for commits, SENDACKs and
    /// control: a batch for a peer with no more room than this waits.
    pub reserved_room_per_peer: usize,
    /// Whether each message's offline recipients are gathered and handed out
    /// ([`PlanOutput::Offline`]; the `msg.offline` webhook). Off: no cost.
    pub offline_uids: bool,
    /// With `offline_uids`: whether the `msg.offline` queue has room now. Decided
    /// for a whole message when its first page opens: a message that starts
    /// without room gathers nothing (no cost: a full queue would drop its set) and
    /// is counted in [`PlanCounts::offline_skipped`].
    pub offline_room: bool,
    /// Times a page's failed target groups are looked up again on the current view
    /// (see [`Planner`], "A failed group"). 0: a failed group fails at once.
    pub lookup_retries_max: u8,
    /// How often a group answered [`AuthorityError::Rebuilding`] is looked up
    /// again (see [`Planner`], "A rebuilding authority").
    pub rebuild_retry_interval_ms: u64,
    /// How long a page waits for a rebuilding authority at most; its groups still
    /// rebuilding then fail (`rebuild_timeouts`).
    pub rebuild_wait_ms_max: u64,
}

/// Counters the driver publishes as metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanCounts {
    /// Target groups whose lookup failed, local or remote, and was not retried or
    /// failed its retries (their recipients catch up by sync).
    pub failed_groups: u64,
    /// Failed target groups looked up again because the current view names
    /// another target for their hash slot (a slot moved meanwhile).
    pub retried_groups: u64,
    /// Batches that waited for a peer's room.
    pub stalls: u64,
    /// [`Lookup`]s emitted (remote authorities asked).
    pub lookups: u64,
    /// Lookups that failed as a whole ([`LookupReply::Failed`], or a malformed
    /// reply); their groups are in `failed_groups` too.
    pub failed_lookups: u64,
    /// Endpoints of this node on a shard it does not have: dropped, not pushed.
    pub stale_endpoints: u64,
    /// Rebuilding groups looked up again (see [`Planner`], "A rebuilding
    /// authority").
    pub rebuild_retries: u64,
    /// Rebuilding groups that failed after `rebuild_wait_ms_max` (also in
    /// `failed_groups`).
    pub rebuild_timeouts: u64,
    /// Replies for a lookup id that is not awaited (unknown, or already answered:
    /// a reply after the driver's deadline failure): ignored.
    pub ignored_replies: u64,
    /// Stored messages whose offline recipients were not gathered: their first
    /// page opened while the `msg.offline` queue had no room
    /// ([`PlanLimits::offline_room`]). The driver counts each as a dropped event.
    pub offline_skipped: u64,
}

/// The batches emitted in one [`Planner::pump`] per peer (each one's room shrinks
/// by as many).
#[derive(Default)]
struct Emitted {
    /// Indexed by shard.
    shards: Vec<usize>,
    /// The few nodes a call pushed to.
    nodes: Vec<(NodeId, usize)>,
}

impl Emitted {
    fn clear(&mut self) {
        self.shards.clear();
        self.nodes.clear();
    }

    fn of(&mut self, to: PushTo) -> &mut usize {
        match to {
            PushTo::Shard(s) => {
                let i = s as usize;
                if self.shards.len() <= i {
                    self.shards.resize(i + 1, 0);
                }
                &mut self.shards[i]
            }
            PushTo::Node(n) => {
                let i = match self.nodes.iter().position(|(m, _)| *m == n) {
                    Some(i) => i,
                    None => {
                        self.nodes.push((n, 0));
                        self.nodes.len() - 1
                    }
                };
                &mut self.nodes[i].1
            }
        }
    }

    /// Takes one slot of room towards `to` if it has more than the reserve
    /// (counting the batches this call already emitted there).
    fn take_room(
        &mut self,
        room: &mut impl FnMut(PushTo) -> usize,
        to: PushTo,
        limits: &PlanLimits,
    ) -> bool {
        let n = self.of(to);
        if room(to).saturating_sub(*n) <= limits.reserved_room_per_peer {
            return false;
        }
        *n += 1;
        true
    }
}

/// Step 3's delivery: plans the backlog of answered messages, oldest first, page by
/// page, into push batches ([`PlanOutput::Push`]). At most `pages_per_turn_max`
/// pages are looked up a call.
///
/// # A page
///
/// Its uids are grouped by exact target ([`group_by_target`], one view snapshot).
/// The groups this node leads (`limits.local_node`) are looked up synchronously
/// (`EndpointLookup`); the groups led by other nodes become one
/// [`PlanOutput::Lookup`] per node. A group is *resolved* once its lookup ended:
/// looked up here, answered ([`on_lookup_reply`](Self::on_lookup_reply)), or
/// failed for good. The resolved groups' endpoints are pushed as soon as they may
/// be (see "Order" below), those that go together coalesced by owner into bounded
/// batches ([`plan_pushes`]), the sender's own session suppressed; so a page's
/// local groups go at once and each remote node's when it answers. A failed
/// remote lookup fails its groups alone: the page's other endpoints are pushed.
/// A page leaves the pipeline once all its groups are pushed.
///
/// # A failed group
///
/// A group refused (stale target, not leader) or lost with its lookup (deadline,
/// peer down or restarted) is looked up again, up to `lookup_retries_max` times
/// per page, when the view the planner is pumped with names another target for its
/// hash slot: the slot moved while the page was planned, and its recipients are
/// found at the new leader instead of being skipped. The group waits for the
/// retry (its order kept). A group refused as not-leader or stale at the very target the
/// current view names (the authority has not applied that view yet, or has a
/// newer one) waits as a rebuilding one does (below). Any other failure whose
/// target did not change, or past the retries, fails for good (`failed_groups`):
/// its recipients catch up by messagesync; except where authorities follow their
/// groups' elections (the view's homes are [`Homes::Leaders`]): a group lost with
/// its lookup at the target the view still names waits as a rebuilding one does,
/// since an election moves a dead node's slots within about a second.
///
/// # A rebuilding authority
///
/// A group answered [`AuthorityError::Rebuilding`] (its authority was just moved
/// there and waits for the old leader's routes, the handover) is not offline: it is
/// looked up again every `rebuild_retry_interval_ms` (at the target the current
/// view names) while it waits, up to `rebuild_wait_ms_max` from the first such
/// answer; then it fails (`rebuild_timeouts`, and `failed_groups`). The group, and
/// the groups of its slot in the pages behind it, wait meanwhile: order is kept. The wait is for
/// time, not work: [`Planner::pump`] reports none for it, and the driver pumps
/// again by [`Planner::next_retry_at_ms`].
///
/// # The pipeline, and why it keeps order
///
/// Up to `lookup_pages_in_flight_max` pages are *in flight* (looked up, not yet
/// wholly pushed) at once, across the messages of the backlog: while one waits
/// for a round trip, the next pages (of the same message or of later ones) are
/// looked up and their lookups sent, so one channel's delivery is no longer bounded
/// by one round trip per page.
///
/// Pages are opened in backlog order (message after message, page after page of
/// each) and kept in that order. Order matters per recipient session only, and a
/// session's uid always falls in one hash slot, whose group in a page is looked
/// up, pushed or held as one. So a resolved group is pushed unless an earlier page
/// in flight still has a group of the same hash slot to push (*pending*:
/// unresolved, or itself held); then it is *held* and goes right after that one.
/// Each page keeps the set of its slots pending and of those unresolved (256 bits
/// each), and `pump` pushes, page after page, each page's resolved slots that no
/// earlier page has pending. So a node that answers lookups slowly holds only the
/// groups of the slots it leads; every other group of every page (local ones,
/// other nodes') goes as soon as it is known. Messages join the backlog in the
/// order their commits were answered, which per channel is seq order; a carrier
/// that keeps each peer's order (a ring, a link) therefore hands a session message
/// N before N+1, and never a later page's RECVs before an earlier page's of the
/// same message. `lookup_pages_in_flight_max = 1` is the unpipelined planner:
/// nothing behind a waiting page is looked up.
///
/// Pages may so end out of order; a message's delivery ends when all its pages
/// were opened and wholly pushed, and messages leave the backlog (their charge
/// returned) in order, the front first. Its offline recipients are handed out
/// when its last page to end was pushed.
///
/// # Waiting, and its bounds
///
/// - While every page in flight waits (for lookups, a rebuilding authority, or an
///   earlier page's group of its slot) and no further page may be opened (the
///   limit reached, or nothing left to open), `pump` reports no work for that
///   wait (the shard may sleep); the reply's arrival makes the driver pump again.
///   The wait is bounded by the RPC deadline, since the driver answers every
///   lookup (at the latest with [`LookupFailure::Deadline`]).
/// - Memory: the pages in flight hold at most `lookup_pages_in_flight_max ×
///   subscriber_page_max` uids' endpoints, held ones included (each uid's
///   sessions: the authority's `records_per_uid_max` at most; a remote reply is
///   also bounded by the RPC frame), and their lookups in flight are at most
///   `lookup_pages_in_flight_max` × the number of other nodes in the view. The
///   offline recipients gathered are at most one list per page in flight. The
///   [`Lookup`]s themselves are the driver's once emitted.
/// - A batch for a peer (a shard of this node, or another node) without room
///   beyond `reserved_room_per_peer` waits (`stalled`, with its message), and
///   nothing more is pushed until it went (pages may still complete meanwhile,
///   within the limit), so a slow peer pauses delivery rather than growing a
///   queue, and order holds.
///
/// Buffers are reused from page to page.
#[derive(Default)]
pub struct Planner {
    /// Answered messages whose delivery has not ended, oldest first.
    backlog: VecDeque<Delivery>,
    /// The number of the backlog's front message (messages are numbered from 0 as
    /// they are enqueued).
    front_message: u64,
    /// The next page to open: a message's number and the page's index in it.
    cursor: (u64, usize),
    /// Pages opened and not yet wholly pushed, in the order they were opened.
    pages: VecDeque<Page>,
    /// The number of the next page opened (pages are numbered from 0).
    next_page_number: u64,
    /// Batches that a peer had no room for, with their message.
    stalled: Vec<(PushTo, Arc<Committed>, Vec<Endpoint>)>,
    /// Lookups not yet answered: `(lookup_id, page number, the targets of its
    /// groups in request order, the request's copy when its page gathers offline
    /// uids)`.
    awaiting: Vec<(u64, u64, Vec<Target>, Option<Lookup>)>,
    /// The offline recipients of the wholly pushed pages of the messages that
    /// gather them and still have a page in flight: `(message number, uids,
    /// whether its last page was pushed)`; at most one per page in flight.
    offline: Vec<(u64, Vec<Uid>, bool)>,
    /// Whether the pages of the message being opened gather its offline
    /// recipients (decided at its first page, [`PlanLimits::offline_room`]).
    opening_gathers: bool,
    next_lookup_id: u64,
    /// Endpoint buffers of pushed pages, for the next pages (at most
    /// `lookup_pages_in_flight_max`).
    spare: Vec<Vec<Endpoint>>,
    /// A person channel's page grouped by target, and its uids' hashes.
    groups: TargetGroups,
    hashes: Vec<u64>,
    /// The page's groups: target and range of their uids (in the subscriber list,
    /// or in `groups.uids` for a person channel).
    page_groups: Vec<(Target, Range<usize>)>,
    /// The page's local groups, as looked up (its allocation reused).
    local_groups: Vec<HashedGroup<'static>>,
    results: Vec<Result<Range<usize>, AuthorityError>>,
    local: Vec<Vec<Endpoint>>,
    emitted: Emitted,
    counts: PlanCounts,
}

impl Page {
    /// A group of this page at `target` was answered `result`: found, its slot is
    /// resolved; failed, a rebuilding authority is asked again later, any other
    /// failure is retried on the current view (see [`Planner`]).
    fn note_result<T>(&mut self, result: &Result<T, AuthorityError>, target: Target) {
        match result {
            Ok(_) => self.unresolved.remove(target.hash_slot),
            Err(AuthorityError::Rebuilding) => self.rebuilding.push(target),
            Err(e) => self.retry.push((target, disagrees(*e))),
        }
    }
}

/// A set of hash slots (`0..HASH_SLOTS`), one bit each.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct SlotSet([u64; slots::HASH_SLOTS / 64]);

impl SlotSet {
    fn insert(&mut self, slot: slots::HashSlot) {
        self.0[usize::from(slot) / 64] |= 1 << (slot % 64);
    }

    fn remove(&mut self, slot: slots::HashSlot) {
        self.0[usize::from(slot) / 64] &= !(1 << (slot % 64));
    }

    fn contains(&self, slot: slots::HashSlot) -> bool {
        self.0[usize::from(slot) / 64] & (1 << (slot % 64)) != 0
    }

    fn is_empty(&self) -> bool {
        self.0 == [0; slots::HASH_SLOTS / 64]
    }

    /// The slots of `self` or `other`.
    fn union(mut self, other: SlotSet) -> SlotSet {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a |= b;
        }
        self
    }

    /// The slots of `self` not in `other`.
    fn minus(mut self, other: SlotSet) -> SlotSet {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a &= !b;
        }
        self
    }
}

/// Whether an authority's refusal of a lookup means that its view and the
/// requester's disagree on the slot's leader (one of them has not applied the
/// latest move yet): worth asking again once views converge.
fn disagrees(e: AuthorityError) -> bool {
    matches!(e, AuthorityError::NotLeader | AuthorityError::StaleTarget)
}

/// The page [`Planner::start_page`] took: its message (backlog index and number),
/// its recipients, whether it is the message's last, and the sender whose offline
/// recipients it gathers (`None`: not gathered).
struct PageStart {
    i: usize,
    range: Range<usize>,
    number: u64,
    last: bool,
    from_uid: Option<Uid>,
}

/// A page looked up and not yet pushed.
struct Page {
    /// Its number (pages are numbered as they are opened).
    number: u64,
    /// The number of its message.
    message: u64,
    /// The hash slots of its groups not yet pushed (resolved or not).
    pending: SlotSet,
    /// The hash slots of its groups whose lookup has not ended: awaiting a
    /// reply, a retry or a rebuilding authority.
    unresolved: SlotSet,
    /// The endpoints found and not yet pushed, local and remote (the held ones
    /// among them: of a slot an earlier page has pending).
    endpoints: Vec<Endpoint>,
    /// Its recipients' range in its message's recipients.
    range: Range<usize>,
    /// The targets of its groups that failed and may be retried on the current
    /// view (the page is not complete while any is left), each with whether its
    /// authority refused it as not its own ([`disagrees`]).
    retry: Vec<(Target, bool)>,
    /// Retries left (from `lookup_retries_max`).
    retries_left: u8,
    /// The targets of its groups answered `Rebuilding`, looked up again at
    /// `rebuild_retry_at_ms` (the page is not complete while any is left).
    rebuilding: Vec<Target>,
    /// When its rebuilding groups are looked up again.
    rebuild_retry_at_ms: u64,
    /// When its rebuilding groups fail: `rebuild_wait_ms_max` after the first
    /// `Rebuilding` answer (`None` before one).
    rebuild_until_ms: Option<u64>,
    /// The sender's uid when the page gathers offline recipients (into `offline`).
    from_uid: Option<Uid>,
    /// Its recipients with no endpoint so far (local groups; remote ones as their
    /// replies come).
    offline: Vec<Uid>,
    /// The last page of its message.
    last: bool,
}

impl Planner {
    /// Messages waiting for (the end of) their delivery.
    pub fn len(&self) -> usize {
        self.backlog.len()
    }

    /// Messages whose delivery ended since the planner began (they leave the
    /// backlog in the order they were enqueued).
    pub fn delivered_count(&self) -> u64 {
        self.front_message
    }

    /// Whether no message waits for delivery.
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

    /// Lookups of the pages in flight not yet answered.
    pub fn awaiting_lookups(&self) -> usize {
        self.awaiting.len()
    }

    /// Pages looked up and not yet pushed (at most `lookup_pages_in_flight_max`).
    pub fn pages_in_flight(&self) -> usize {
        self.pages.len()
    }

    /// Failed groups of the pages in flight that the next [`Planner::pump`] looks
    /// up again or counts in `failed_groups`: every failure is in one or the other.
    pub fn groups_awaiting_retry(&self) -> usize {
        self.pages
            .iter()
            .map(|p| p.retry.len() + p.rebuilding.len())
            .sum()
    }

    /// When a page waiting for a rebuilding authority looks it up again: the
    /// driver pumps at that time (or earlier) even without other work. `None`
    /// while no page waits for one.
    pub fn next_retry_at_ms(&self) -> Option<u64> {
        (self.pages.iter())
            .filter(|p| !p.rebuilding.is_empty())
            .map(|p| p.rebuild_retry_at_ms)
            .min()
    }

    /// Plans into `out`: pushes the resolved groups of the pages in flight that no
    /// earlier page holds (see the type's docs) and opens up to
    /// `pages_per_turn_max` new pages while fewer than `lookup_pages_in_flight_max`
    /// are in flight. `room(to)` is the room towards peer `to` now, a shard or a
    /// node (the planner subtracts its own batches; this shard's own batches take
    /// none). Returns the bytes charged to the messages whose delivery ended (the
    /// commit core's budget) and the work done: 1 at least while anything waits for
    /// room or could be planned now, so the shard keeps turning until it is
    /// delivered; nothing more while the pages in flight only wait for lookup
    /// replies, a rebuilding authority or an earlier page (see the type's docs). `now_ms`: the driver's monotonic clock.
    pub fn pump(
        &mut self,
        now_ms: u64,
        view: &ClusterView,
        lookup: &mut impl EndpointLookup,
        room: &mut impl FnMut(PushTo) -> usize,
        limits: &PlanLimits,
        out: &mut Vec<PlanOutput>,
    ) -> (usize, usize) {
        if self.backlog.is_empty() {
            return (0, 0);
        }
        self.emitted.clear();
        let (mut work, mut freed_bytes) = (self.retry_stalled(room, limits, out), 0);
        let mut pages = 0;
        loop {
            freed_bytes += self.finish_delivered(limits);
            if !self.stalled.is_empty() {
                break;
            }
            work += self.retry_failed(view, lookup, limits, out);
            work += self.retry_rebuilding(now_ms, view, lookup, limits, out);
            let pushed = self.push_ready(room, limits, out);
            if pushed > 0 {
                work += pushed;
                continue;
            }
            if !self.may_open(limits) || pages == limits.pages_per_turn_max {
                break;
            }
            work += self.open_page(now_ms, view, lookup, limits, out);
            pages += 1;
        }
        let retry = self.pages.iter().any(|p| !p.retry.is_empty());
        // Nothing is left ready here: the loop ends on a stall or after a call of
        // `push_ready` that found nothing.
        let more = !self.stalled.is_empty() || self.may_open(limits) || retry;
        (freed_bytes, work + usize::from(more))
    }

    /// A reply to lookup `lookup_id` (or the driver's failure for it). Its found
    /// endpoints join its page's; its failed groups are counted. Returns whether it
    /// was awaited: a reply for an unknown lookup, or one already answered (a late
    /// reply after a deadline failure), is ignored and counted
    /// (`ignored_replies`). Lookup ids are unique per planner only: a driver must
    /// not hand a planner the replies of another planner's lookups. Pump again
    /// afterwards: the reply's groups may be pushed.
    pub fn on_lookup_reply(&mut self, lookup_id: u64, reply: LookupReply) -> bool {
        let Some(i) = self.awaiting.iter().position(|(id, ..)| *id == lookup_id) else {
            self.counts.ignored_replies += 1;
            return false;
        };
        let (_, number, targets, copy) = self.awaiting.swap_remove(i);
        let Some(page) = self.pages.iter_mut().find(|p| p.number == number) else {
            unreachable!("an awaited lookup's page is in flight until it is pushed");
        };
        let groups = targets.len();
        match reply {
            LookupReply::Found { endpoints, results } => {
                if !reply_fits(endpoints.len(), &results, groups) {
                    // A peer that answers another shape is not asked again.
                    self.counts.failed_lookups += 1;
                    self.counts.failed_groups += groups as u64;
                    for t in &targets {
                        page.unresolved.remove(t.hash_slot);
                    }
                    return true;
                }
                if let (Some(l), Some(from)) = (&copy, &page.from_uid) {
                    for ((_, r), found) in l.groups.iter().zip(&results) {
                        if let Ok(found) = found {
                            let (uids, found) = (&l.uids[r.clone()], &endpoints[found.clone()]);
                            offline_of(uids, found, from, &mut page.offline);
                        }
                    }
                }
                for (r, t) in results.iter().zip(&targets) {
                    page.note_result(r, *t);
                }
                let _ = take_found(endpoints, &results, groups, &mut page.endpoints);
            }
            LookupReply::Failed(_) => {
                self.counts.failed_lookups += 1;
                page.retry.extend(targets.into_iter().map(|t| (t, false)));
            }
        }
        true
    }

    /// The failed groups of the pages in flight, each looked up again at the target
    /// the current `view` names for its hash slot, while the page has retries left
    /// and that target is another than the one that failed (a slot moved: the old
    /// leader refused, or its node was lost); any other fails now (counted in
    /// `failed_groups`). A retried local group is looked up at once, remote ones
    /// become new [`Lookup`]s of the page. Returns the groups retried.
    fn retry_failed(
        &mut self,
        view: &ClusterView,
        lookup: &mut impl EndpointLookup,
        limits: &PlanLimits,
        out: &mut Vec<PlanOutput>,
    ) -> usize {
        let mut retried = 0;
        for i in 0..self.pages.len() {
            if self.pages[i].retry.is_empty() {
                continue;
            }
            let page = &mut self.pages[i];
            let mut moved: Vec<Target> = Vec::new();
            for (t, disagreed) in std::mem::take(&mut page.retry) {
                let now = view.target_for_slot(t.hash_slot);
                if now != t && page.retries_left > 0 {
                    moved.push(now);
                } else if now == t && (disagreed || view.homes == Homes::Leaders) {
                    // The authority has not applied the view that makes it the
                    // slot's leader (or has a newer one), or it was lost where
                    // leaders are elected (its node died: an election moves the
                    // slot soon): asked again as a rebuilding one is, within the
                    // same bound.
                    page.rebuilding.push(t);
                } else {
                    self.counts.failed_groups += 1;
                    page.unresolved.remove(t.hash_slot);
                }
            }
            if moved.is_empty() {
                continue;
            }
            page.retries_left -= 1;
            retried += moved.len();
            self.counts.retried_groups += moved.len() as u64;
            self.lookup_again(i, &moved, lookup, limits, out);
        }
        retried
    }

    /// The rebuilding groups of the pages in flight (see the type's docs, "A
    /// rebuilding authority"): each page's, once its retry time came, looked up
    /// again at the target the current `view` names; past the page's wait, failed.
    /// Returns the groups looked up again.
    fn retry_rebuilding(
        &mut self,
        now_ms: u64,
        view: &ClusterView,
        lookup: &mut impl EndpointLookup,
        limits: &PlanLimits,
        out: &mut Vec<PlanOutput>,
    ) -> usize {
        let mut retried = 0;
        for i in 0..self.pages.len() {
            let page = &mut self.pages[i];
            if page.rebuilding.is_empty() || now_ms < page.rebuild_retry_at_ms {
                continue;
            }
            let until_ms = *page
                .rebuild_until_ms
                .get_or_insert(now_ms.saturating_add(limits.rebuild_wait_ms_max));
            let targets = std::mem::take(&mut page.rebuilding);
            if now_ms >= until_ms {
                self.counts.rebuild_timeouts += targets.len() as u64;
                self.counts.failed_groups += targets.len() as u64;
                for t in &targets {
                    page.unresolved.remove(t.hash_slot);
                }
                continue;
            }
            page.rebuild_retry_at_ms = now_ms.saturating_add(limits.rebuild_retry_interval_ms);
            let targets: Vec<Target> = (targets.iter())
                .map(|t| view.target_for_slot(t.hash_slot))
                .collect();
            retried += targets.len();
            self.counts.rebuild_retries += targets.len() as u64;
            self.lookup_again(i, &targets, lookup, limits, out);
        }
        retried
    }

    /// Looks the groups of `targets` (one hash slot each) of the page at `at` in
    /// `pages` up again: this node's at once, the others as new lookups.
    fn lookup_again(
        &mut self,
        at: usize,
        targets: &[Target],
        lookup: &mut impl EndpointLookup,
        limits: &PlanLimits,
        out: &mut Vec<PlanOutput>,
    ) {
        let page = &self.pages[at];
        let number = page.number;
        let d = &self.backlog[(page.message - self.front_message) as usize];
        let message_id = d.message.message_id;
        let recipients: Vec<Uid> = match &d.subscribers {
            Some(s) => s.uids()[page.range.clone()].to_vec(),
            None => d.message.person_recipients()[page.range.clone()].to_vec(),
        };
        let mut uids: Vec<Uid> = Vec::new();
        let mut groups: Vec<(Target, Range<usize>)> = Vec::new();
        for t in targets {
            let start = uids.len();
            let of_slot = |u: &&Uid| slots::hash_slot(u.as_bytes()) == t.hash_slot;
            uids.extend(recipients.iter().filter(of_slot).cloned());
            groups.push((*t, start..uids.len()));
        }
        let local: Vec<(Target, &[Uid])> = (groups.iter())
            .filter(|(t, _)| t.leader_node_id == limits.local_node)
            .map(|(t, r)| (*t, &uids[r.clone()]))
            .collect();
        let page = &mut self.pages[at];
        if !local.is_empty() {
            let (mut found, mut results) = (Vec::new(), Vec::new());
            lookup.endpoints_by_targets_into(&local, &mut found, &mut results);
            for ((t, group), r) in local.iter().zip(&results) {
                if let Ok(r) = r {
                    if let Some(from) = &page.from_uid {
                        offline_of(group, &found[r.clone()], from, &mut page.offline);
                    }
                    page.endpoints.extend_from_slice(&found[r.clone()]);
                }
                page.note_result(r, *t);
            }
        }
        let lookups = remote_lookups(
            &groups,
            &uids,
            limits.local_node,
            message_id,
            &mut self.next_lookup_id,
        );
        let copies = page.from_uid.is_some();
        self.emit_lookups(number, lookups, copies, out);
    }

    /// Hands page `number`'s `lookups` to the driver and awaits them (with a copy
    /// each when `copies`: the page gathers offline uids).
    fn emit_lookups(
        &mut self,
        number: u64,
        lookups: Vec<Lookup>,
        copies: bool,
        out: &mut Vec<PlanOutput>,
    ) {
        self.counts.lookups += lookups.len() as u64;
        for l in lookups {
            let copy = copies.then(|| l.clone());
            let targets = l.groups.iter().map(|(t, _)| *t).collect();
            self.awaiting.push((l.lookup_id, number, targets, copy));
            out.push(PlanOutput::Lookup(l));
        }
    }

    /// Sends the stalled batches to the peers that have room now.
    fn retry_stalled(
        &mut self,
        room: &mut impl FnMut(PushTo) -> usize,
        limits: &PlanLimits,
        out: &mut Vec<PlanOutput>,
    ) -> usize {
        if self.stalled.is_empty() {
            return 0;
        }
        let mut stalled = std::mem::take(&mut self.stalled);
        let before = stalled.len();
        stalled.retain_mut(|(to, message, endpoints)| {
            if !self.emitted.take_room(room, *to, limits) {
                return true;
            }
            out.push(PlanOutput::Push(Push {
                to: *to,
                message: message.clone(),
                endpoints: std::mem::take(endpoints),
            }));
            false
        });
        let sent = before - stalled.len();
        self.stalled = stalled;
        sent.max(usize::from(!self.stalled.is_empty()))
    }

    /// Whether another page may be opened now: one is left and the pipeline has
    /// room.
    fn may_open(&mut self, limits: &PlanLimits) -> bool {
        self.pages.len() < limits.lookup_pages_in_flight_max.max(1)
            && self.next_page(limits).is_some()
    }

    /// The next page to open, `(backlog index, its uids' range)`, the cursor moved
    /// past messages whose pages are all open; `None` if none is left.
    fn next_page(&mut self, limits: &PlanLimits) -> Option<(usize, Range<usize>)> {
        loop {
            let (message, page) = self.cursor;
            let i = (message - self.front_message) as usize;
            let n = recipient_count(self.backlog.get(i)?);
            let start = page * limits.subscriber_page_max;
            if start < n {
                return Some((i, start..n.min(start + limits.subscriber_page_max)));
            }
            self.cursor = (message + 1, 0);
        }
    }

    /// The front messages whose pages are all open and pushed leave, while
    /// nothing is stalled (a stall pauses every message); returns their charge.
    fn finish_delivered(&mut self, limits: &PlanLimits) -> usize {
        let _ = self.next_page(limits); // moves the cursor past opened messages
        let mut freed_bytes = 0;
        while self.stalled.is_empty()
            && self.cursor.0 > self.front_message
            && self
                .pages
                .front()
                .is_none_or(|p| p.message != self.front_message)
        {
            let Some(d) = self.backlog.pop_front() else {
                break;
            };
            self.front_message += 1;
            freed_bytes += d.charge_bytes;
        }
        freed_bytes
    }

    /// Takes the next page (there is one: `may_open`) past the cursor; at a
    /// message's first page, decides whether its offline recipients are gathered.
    fn start_page(&mut self, limits: &PlanLimits) -> PageStart {
        let Some((i, range)) = self.next_page(limits) else {
            unreachable!("a page is opened only when one is left");
        };
        self.cursor.1 += 1;
        let d = &self.backlog[i];
        if range.start == 0 {
            let wanted = gathers_offline(d, limits);
            self.opening_gathers = wanted && limits.offline_room;
            self.counts.offline_skipped += u64::from(wanted && !limits.offline_room);
        }
        PageStart {
            number: self.front_message + i as u64,
            last: range.end == recipient_count(d),
            from_uid: self.opening_gathers.then(|| d.message.from_uid.clone()),
            i,
            range,
        }
    }

    /// Opens the next page (there is one: `may_open`): its groups by target (a
    /// subscriber list's runs of one hash slot, pre-grouped and pre-hashed; a
    /// person channel's one or two uids grouped and hashed here), one synchronous
    /// lookup of the groups this node leads, one [`Lookup`] per other node (nodes
    /// in order of first appearance); queues it. Returns 1 if it emitted lookups
    /// (the page waits), else 0 (the page is complete).
    fn open_page(
        &mut self,
        now_ms: u64,
        view: &ClusterView,
        lookup: &mut impl EndpointLookup,
        limits: &PlanLimits,
        out: &mut Vec<PlanOutput>,
    ) -> usize {
        let start = self.start_page(limits);
        let d = &self.backlog[start.i];
        let (message_id, subscribers) = (d.message.message_id, d.subscribers.clone());
        self.page_groups.clear();
        let (uids, hashes): (&[Uid], &[u64]) = match &subscribers {
            Some(s) => {
                let runs = s.slot_runs(start.range.clone());
                let groups = runs.map(|(slot, r)| (view.target_for_slot(slot), r));
                self.page_groups.extend(groups);
                (s.uids(), s.hashes())
            }
            None => {
                let person = d.message.person_recipients();
                group_by_target(view, &person[start.range.clone()], &mut self.groups);
                self.hashes.clear();
                self.hashes
                    .extend(self.groups.uids.iter().map(|u| uid_hash(u)));
                self.page_groups.extend(self.groups.groups.iter().cloned());
                (&self.groups.uids, &self.hashes)
            }
        };
        let mut endpoints = self.spare.pop().unwrap_or_default();
        self.results.clear();
        let local_node = limits.local_node;
        let mut local = recycle(std::mem::take(&mut self.local_groups));
        local.extend(
            self.page_groups
                .iter()
                .filter(|(t, _)| t.leader_node_id == local_node)
                .map(|(t, r)| HashedGroup {
                    target: *t,
                    uids: &uids[r.clone()],
                    hashes: &hashes[r.clone()],
                }),
        );
        if !local.is_empty() {
            lookup.endpoints_by_hashed_groups_into(&local, &mut endpoints, &mut self.results);
        }
        let offline = local_offline(&local, &self.results, &endpoints, start.from_uid.as_ref());
        let (retry, rebuilding) = failed_local(&local, &self.results);
        self.local_groups = recycle(local);
        let (pending, unresolved) = page_slots(&self.page_groups, local_node, &retry, &rebuilding);
        let lookups = remote_lookups(
            &self.page_groups,
            uids,
            local_node,
            message_id,
            &mut self.next_lookup_id,
        );
        let (page, copies) = (self.next_page_number, start.from_uid.is_some());
        let work = usize::from(!lookups.is_empty() || !retry.is_empty());
        self.next_page_number += 1;
        self.pages.push_back(Page {
            number: page,
            message: start.number,
            pending,
            unresolved,
            endpoints,
            range: start.range,
            retry,
            retries_left: limits.lookup_retries_max,
            rebuilding,
            rebuild_retry_at_ms: now_ms.saturating_add(limits.rebuild_retry_interval_ms),
            rebuild_until_ms: None,
            from_uid: start.from_uid,
            offline,
            last: start.last,
        });
        self.emit_lookups(page, lookups, copies, out);
        work
    }

    /// Pushes every group whose lookup ended and whose hash slot no earlier page
    /// has pending (a uid's recipients get its pages in the order they were
    /// opened), page after page, until a batch stalls; returns the pages pushed
    /// from.
    fn push_ready(
        &mut self,
        room: &mut impl FnMut(PushTo) -> usize,
        limits: &PlanLimits,
        out: &mut Vec<PlanOutput>,
    ) -> usize {
        let (mut blocked, mut pushed, mut i) = (SlotSet::default(), 0, 0);
        while i < self.pages.len() && self.stalled.is_empty() {
            let page = &self.pages[i];
            let ready = page.pending.minus(page.unresolved).minus(blocked);
            blocked = blocked.union(page.pending.minus(ready));
            if ready.is_empty() {
                i += 1;
                continue;
            }
            pushed += 1;
            if !self.push_slots(i, ready, room, limits, out) {
                i += 1;
            }
        }
        pushed
    }

    /// Pushes the endpoints of the `ready` slots of the page at `i`: batches by
    /// owner; a batch for a peer without room stalls; this shard's batches come
    /// last (other shards write their sockets meanwhile). A page left with nothing
    /// pending leaves (returns true), with its offline recipients.
    fn push_slots(
        &mut self,
        i: usize,
        ready: SlotSet,
        room: &mut impl FnMut(PushTo) -> usize,
        limits: &PlanLimits,
        out: &mut Vec<PlanOutput>,
    ) -> bool {
        let page = &mut self.pages[i];
        let d = &self.backlog[(page.message - self.front_message) as usize];
        let (message, sender) = (d.message.clone(), d.sender);
        page.pending = page.pending.minus(ready);
        let done = page.pending.is_empty();
        let endpoints = if done {
            std::mem::take(&mut page.endpoints)
        } else {
            let slot_of = |e: &Endpoint| slots::hash_slot(e.uid.as_bytes());
            let (go, held) = (page.endpoints.drain(..)).partition(|e| ready.contains(slot_of(e)));
            page.endpoints = held;
            go
        };
        self.push_endpoints(&message, sender, endpoints, room, limits, out);
        if !done {
            return false;
        }
        let Some(page) = self.pages.remove(i) else {
            unreachable!("pushed from the pages in flight");
        };
        self.gather_offline(page, &message, out);
        true
    }

    /// Pushes `endpoints` of `message` (see [`Planner::push_slots`]); keeps the
    /// buffer for the next pages.
    fn push_endpoints(
        &mut self,
        message: &Arc<Committed>,
        sender: Option<Sender>,
        mut endpoints: Vec<Endpoint>,
        room: &mut impl FnMut(PushTo) -> usize,
        limits: &PlanLimits,
        out: &mut Vec<PlanOutput>,
    ) {
        let plan = plan_pushes(
            limits.local_node,
            limits.shard_count,
            endpoints.drain(..),
            sender,
            limits.push_batch_max,
        );
        self.counts.stale_endpoints += plan.stale as u64;
        if self.spare.len() < limits.lookup_pages_in_flight_max {
            self.spare.push(endpoints);
        }
        for (to, endpoints) in plan.batches {
            match to {
                PushTo::Shard(s) if s == limits.me => self.local.push(endpoints),
                to if !self.emitted.take_room(room, to, limits) => {
                    self.counts.stalls += 1;
                    self.stalled.push((to, message.clone(), endpoints));
                }
                to => out.push(PlanOutput::Push(Push {
                    to,
                    message: message.clone(),
                    endpoints,
                })),
            }
        }
        for endpoints in self.local.drain(..) {
            out.push(PlanOutput::Push(Push {
                to: PushTo::Shard(limits.me),
                message: message.clone(),
                endpoints,
            }));
        }
    }

    /// A wholly pushed `page`'s offline recipients join its message's; once every
    /// page of the message is pushed (its last was, and no other is in flight),
    /// they are handed out.
    fn gather_offline(
        &mut self,
        mut page: Page,
        message: &Arc<Committed>,
        out: &mut Vec<PlanOutput>,
    ) {
        if page.from_uid.is_none() {
            return;
        }
        let at = match self.offline.iter().position(|g| g.0 == page.message) {
            Some(at) => at,
            None => {
                self.offline.push((page.message, Vec::new(), false));
                self.offline.len() - 1
            }
        };
        let gathered = &mut self.offline[at];
        gathered.1.append(&mut page.offline);
        gathered.2 |= page.last;
        if !gathered.2 || self.pages.iter().any(|p| p.message == page.message) {
            return;
        }
        let (_, uids, _) = self.offline.swap_remove(at);
        if uids.is_empty() {
            return;
        }
        debug_assert!(
            {
                let mut u: Vec<&Uid> = uids.iter().collect();
                u.sort_unstable();
                u.windows(2).all(|w| w[0] != w[1])
            },
            "an offline uid twice"
        );
        out.push(PlanOutput::Offline(Offline {
            message: message.clone(),
            uids,
        }));
    }
}

/// The local groups of a page that failed, as the page keeps them: to retry on
/// the current view (with whether the authority disagreed, [`disagrees`]), and
/// rebuilding.
#[allow(clippy::type_complexity)]
fn failed_local(
    local: &[HashedGroup<'_>],
    results: &[Result<Range<usize>, AuthorityError>],
) -> (Vec<(Target, bool)>, Vec<Target>) {
    let (mut retry, mut rebuilding) = (Vec::new(), Vec::new());
    for (g, r) in local.iter().zip(results) {
        match r {
            Ok(_) => {}
            Err(AuthorityError::Rebuilding) => rebuilding.push(g.target),
            Err(e) => retry.push((g.target, disagrees(*e))),
        }
    }
    (retry, rebuilding)
}

/// A new page's slot sets: every group's slot pending; the slots of its remote
/// groups (`page_groups` led by another node than `local_node`) and of its
/// failed local ones (`retry`, `rebuilding`) unresolved.
fn page_slots(
    page_groups: &[(Target, Range<usize>)],
    local_node: NodeId,
    retry: &[(Target, bool)],
    rebuilding: &[Target],
) -> (SlotSet, SlotSet) {
    let (mut pending, mut unresolved) = (SlotSet::default(), SlotSet::default());
    for (t, _) in page_groups {
        pending.insert(t.hash_slot);
        if t.leader_node_id != local_node {
            unresolved.insert(t.hash_slot);
        }
    }
    for t in retry.iter().map(|(t, _)| t).chain(rebuilding) {
        unresolved.insert(t.hash_slot);
    }
    (pending, unresolved)
}

/// How many recipients `d` has (a group's subscribers, or a person channel's one
/// or two uids).
fn recipient_count(d: &Delivery) -> usize {
    match &d.subscribers {
        Some(s) => s.len(),
        None => d.message.person_recipient_count(),
    }
}

/// Whether `d`'s pages gather its offline recipients: asked for, and a message
/// that is stored (a NoPersist message is not, as WuKongIM does).
fn gathers_offline(d: &Delivery, limits: &PlanLimits) -> bool {
    limits.offline_uids && d.message.flags & proto::wkproto::Flags::NO_PERSIST.0 == 0
}

/// The offline recipients of a page's local groups (none when `from`, the sender,
/// is `None`: the page gathers none).
fn local_offline(
    local: &[HashedGroup<'_>],
    results: &[Result<Range<usize>, AuthorityError>],
    endpoints: &[Endpoint],
    from: Option<&Uid>,
) -> Vec<Uid> {
    let mut offline = Vec::new();
    if let Some(from) = from {
        for (g, found) in local.iter().zip(results) {
            if let Ok(found) = found {
                offline_of(g.uids, &endpoints[found.clone()], from, &mut offline);
            }
        }
    }
    offline
}

/// Appends the uids of `uids` that no endpoint of `found` (their lookup's) names,
/// except `from` (the sender), to `out`.
fn offline_of(uids: &[Uid], found: &[Endpoint], from: &Uid, out: &mut Vec<Uid>) {
    let offline = |u: &&Uid| **u != *from;
    if found.is_empty() {
        out.extend(uids.iter().filter(offline).cloned());
    } else if found.len() <= 16 {
        let missing = |u: &&Uid| !found.iter().any(|e| e.uid == **u);
        out.extend(uids.iter().filter(offline).filter(missing).cloned());
    } else {
        let online: std::collections::HashSet<&str> = found.iter().map(|e| &*e.uid).collect();
        let missing = |u: &&Uid| !online.contains(&***u);
        out.extend(uids.iter().filter(offline).filter(missing).cloned());
    }
}

/// An empty vector with `v`'s allocation, for borrows of another lifetime (the
/// page's groups borrow its subscriber list only while it is looked up).
fn recycle<'a, 'b>(mut v: Vec<HashedGroup<'a>>) -> Vec<HashedGroup<'b>> {
    v.clear();
    // Same size and alignment, no element left: the in-place collect reuses the
    // allocation.
    v.into_iter().map(|_| unreachable!("cleared")).collect()
}

/// The page's groups led by other nodes than `local_node`, one lookup per node
/// (their uids copied: the request carries them).
fn remote_lookups(
    page_groups: &[(Target, Range<usize>)],
    uids: &[Uid],
    local_node: NodeId,
    message_id: i64,
    next_lookup_id: &mut u64,
) -> Vec<Lookup> {
    let mut lookups: Vec<Lookup> = Vec::new();
    for (target, range) in page_groups {
        let node = target.leader_node_id;
        if node == local_node {
            continue;
        }
        let i = match lookups.iter().position(|l| l.node == node) {
            Some(i) => i,
            None => {
                lookups.push(Lookup {
                    lookup_id: *next_lookup_id,
                    node,
                    message_id,
                    groups: Vec::new(),
                    uids: Vec::new(),
                });
                *next_lookup_id += 1;
                lookups.len() - 1
            }
        };
        let l = &mut lookups[i];
        let start = l.uids.len();
        l.uids.extend_from_slice(&uids[range.clone()]);
        l.groups.push((*target, start..l.uids.len()));
    }
    lookups
}

/// Whether a reply's `results` fit a request of `groups` groups and `endpoints`
/// endpoints: one per group, ranges in bounds, increasing and disjoint.
fn reply_fits(
    endpoints: usize,
    results: &[Result<Range<usize>, AuthorityError>],
    groups: usize,
) -> bool {
    if results.len() != groups {
        return false;
    }
    let mut end = 0;
    for r in results.iter().flatten() {
        if r.start < end || r.start > r.end || r.end > endpoints {
            return false;
        }
        end = r.end;
    }
    true
}

/// Moves the endpoints of a reply's successful groups into `into`; returns how
/// many of its `groups` failed, or `None` if the reply does not fit the request
/// (a result count other than `groups`, ranges out of bounds or out of order).
fn take_found(
    endpoints: Vec<Endpoint>,
    results: &[Result<Range<usize>, AuthorityError>],
    groups: usize,
    into: &mut Vec<Endpoint>,
) -> Option<usize> {
    if !reply_fits(endpoints.len(), results, groups) {
        return None;
    }
    let mut found = endpoints.into_iter();
    let mut at = 0;
    for r in results.iter().flatten().filter(|r| !r.is_empty()) {
        into.extend(found.by_ref().skip(r.start - at).take(r.len()));
        at = r.end;
    }
    Some(results.iter().filter(|r| r.is_err()).count())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presence::route::DeviceLevel;

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
        let plan = plan_pushes(1, 4, found, Some(sender), 2);
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

#[cfg(test)]
mod link_room_tests {
    use super::link_room;

    #[test]
    fn a_link_has_room_below_its_limit_and_a_down_link_takes_everything() {
        assert_eq!(link_room(Some(0), 100), usize::MAX);
        assert_eq!(link_room(Some(99), 100), usize::MAX);
        assert_eq!(link_room(Some(100), 100), 0, "at the limit: the page waits");
        assert_eq!(link_room(Some(500), 100), 0);
        assert_eq!(
            link_room(None, 100),
            usize::MAX,
            "down: dropped and counted"
        );
    }
}

#[cfg(test)]
mod planner_tests {
    use super::*;
    use crate::presence::route::DeviceLevel;
    use crate::send::channel::Subscribers;

    /// This node; hash slot `h` is led by node `h % 3 + 1` (see [`view`]).
    const ME: NodeId = 1;
    const CHARGE: usize = 100;

    fn view() -> ClusterView {
        ClusterView::initial(&[1, 2, 3], 256).unwrap()
    }

    fn limits() -> PlanLimits {
        PlanLimits {
            local_node: ME,
            me: 0,
            shard_count: 2,
            subscriber_page_max: 16,
            push_batch_max: 16,
            pages_per_turn_max: 4,
            // The unpipelined planner: the tests above the pipeline's, written for
            // it, pass unchanged (limit 1 = the old behaviour).
            lookup_pages_in_flight_max: 1,
            reserved_room_per_peer: 1,
            offline_uids: false,
            offline_room: true,
            lookup_retries_max: 2,
            rebuild_retry_interval_ms: 20,
            rebuild_wait_ms_max: 100,
        }
    }

    /// `n` uids whose authority is `node`, named `{tag}…`.
    fn led_by(node: NodeId, tag: &str, n: usize) -> Vec<Uid> {
        let v = view();
        (0..)
            .map(|i| Uid::from(format!("{tag}{i}")))
            .filter(|u| v.target_for_uid(u).leader_node_id == node)
            .take(n)
            .collect()
    }

    /// The one session of `uid` (a uid starting with 'z' has none: offline):
    /// owned by node 2 if the uid starts with 'r'
    /// (a remote owner), else by shard 1 of this node.
    fn endpoint(uid: &Uid) -> Endpoint {
        let node_id = if uid.starts_with('r') { 2 } else { ME };
        Endpoint {
            uid: uid.clone(),
            device_flag: 1,
            device_level: DeviceLevel::Master,
            node_id,
            boot_id: 7,
            session_id: session_id(1, uid.len() as u64),
            owner_seq: 1,
        }
    }

    /// This node's authority: every uid online once; records what it was asked.
    #[derive(Default)]
    struct Local {
        asked: Vec<Uid>,
        /// Lookups answered `Rebuilding` before the authority serves.
        rebuilding: usize,
    }

    impl EndpointLookup for Local {
        fn endpoints_by_targets_into(
            &mut self,
            lookups: &[(Target, &[Uid])],
            endpoints: &mut Vec<Endpoint>,
            results: &mut Vec<Result<Range<usize>, AuthorityError>>,
        ) {
            for (target, uids) in lookups {
                assert_eq!(target.leader_node_id, ME, "only local groups here");
                if self.rebuilding > 0 {
                    self.rebuilding -= 1;
                    results.push(Err(AuthorityError::Rebuilding));
                    continue;
                }
                let start = endpoints.len();
                for uid in *uids {
                    self.asked.push(uid.clone());
                    if !uid.starts_with('z') {
                        endpoints.push(endpoint(uid));
                    }
                }
                results.push(Ok(start..endpoints.len()));
            }
        }
    }

    /// The authority node's reply to `l`: every uid online once, except the groups
    /// at the indexes in `stale`.
    fn found(l: &Lookup, stale: &[usize]) -> LookupReply {
        let (mut endpoints, mut results) = (Vec::new(), Vec::new());
        for (g, (_, uids)) in l.groups().enumerate() {
            if stale.contains(&g) {
                results.push(Err(AuthorityError::StaleTarget));
                continue;
            }
            let start = endpoints.len();
            let online = uids.iter().filter(|u| !u.starts_with('z'));
            endpoints.extend(online.map(endpoint));
            results.push(Ok(start..endpoints.len()));
        }
        LookupReply::Found { endpoints, results }
    }

    fn delivery(id: i64, uids: Vec<Uid>) -> Delivery {
        let message = Committed {
            committed_ns: 0,
            message_id: id,
            message_seq: id as u64,
            timestamp_s: 0,
            from_uid: "sender".into(),
            channel_key: "g".into(),
            channel_type: 2,
            client_msg_no: String::new(),
            setting: 0,
            flags: 0,
            expire_s: 0,
            topic: String::new(),
            payload: Vec::new(),
        };
        Delivery {
            message: Arc::new(message),
            sender: None,
            subscribers: Some(Arc::new(Subscribers::new(uids))),
            charge_bytes: CHARGE,
        }
    }

    /// A planner, its local authority, and the room of every peer (`room_max`
    /// unless set in `room`).
    struct Rig {
        p: Planner,
        /// The view the planner is pumped with (`view()` unless a test moves slots).
        view: ClusterView,
        local: Local,
        limits: PlanLimits,
        room: Vec<(PushTo, usize)>,
        /// Every `PlanOutput::Offline`: (message id, uids).
        offline: Vec<(i64, Vec<Uid>)>,
        /// The clock the planner is pumped at.
        now_ms: u64,
    }

    /// What one `pump` did: freed bytes, work, the pushes as (to, message, uids),
    /// the lookups.
    type Pumped = (usize, usize, Vec<(PushTo, i64, Vec<Uid>)>, Vec<Lookup>);

    impl Rig {
        fn new(deliveries: Vec<Delivery>) -> Rig {
            let mut p = Planner::default();
            for d in deliveries {
                p.enqueue(d);
            }
            Rig {
                p,
                view: view(),
                local: Local::default(),
                limits: limits(),
                room: Vec::new(),
                offline: Vec::new(),
                now_ms: 0,
            }
        }

        fn pump(&mut self) -> Pumped {
            let table = self.room.clone();
            let mut room = |to: PushTo| {
                let set = table.iter().find(|(t, _)| *t == to);
                set.map_or(usize::MAX, |(_, r)| *r)
            };
            let mut out = Vec::new();
            // Each pump is 10 ms after the last (a rebuilding group is asked
            // again every other pump, and given up after ten).
            self.now_ms += 10;
            let (freed, work) = self.p.pump(
                self.now_ms,
                &self.view,
                &mut self.local,
                &mut room,
                &self.limits,
                &mut out,
            );
            let (mut pushes, mut lookups) = (Vec::new(), Vec::new());
            for o in out {
                match o {
                    PlanOutput::Push(p) => {
                        let uids = p.endpoints.iter().map(|e| e.uid.clone()).collect();
                        pushes.push((p.to, p.message.message_id, uids));
                    }
                    PlanOutput::Lookup(l) => lookups.push(l),
                    // Unordered: compared sorted.
                    PlanOutput::Offline(o) => {
                        self.offline.push((o.message.message_id, sorted(o.uids)))
                    }
                }
            }
            (freed, work, pushes, lookups)
        }
    }

    /// `uids` in the order a subscriber list pages them (by hash slot).
    fn in_page_order(uids: Vec<Uid>) -> Vec<Uid> {
        Subscribers::new(uids).uids().to_vec()
    }

    fn sorted(mut uids: Vec<Uid>) -> Vec<Uid> {
        uids.sort();
        uids
    }

    /// Every uid pushed, sorted.
    fn all_pushed(pushes: &[(PushTo, i64, Vec<Uid>)]) -> Vec<Uid> {
        sorted(pushes.iter().flat_map(|p| p.2.iter().cloned()).collect())
    }

    #[test]
    fn a_pages_remote_groups_are_pushed_only_when_their_lookup_is_answered() {
        let (local, remote) = (led_by(1, "a", 2), led_by(2, "b", 2));
        let recipients = [local.clone(), remote.clone()].concat();
        let mut rig = Rig::new(vec![delivery(1, recipients.clone())]);
        let (freed, work, pushes, lookups) = rig.pump();
        assert_eq!(
            pushed_pages(&pushes),
            vec![(1, sorted(local.clone()))],
            "the local groups do not wait for the remote ones"
        );
        assert_eq!(
            (freed, work),
            (0, 2),
            "the lookup and the push were work; no more is asked"
        );
        assert_eq!(sorted(rig.local.asked.clone()), sorted(local));
        let [l] = lookups.as_slice() else {
            panic!("one lookup, to node 2: {lookups:?}");
        };
        assert_eq!((l.node, l.message_id), (2, 1));
        let asked: Vec<Uid> = l.groups().flat_map(|g| g.1.to_vec()).collect();
        assert_eq!(sorted(asked), sorted(remote.clone()));
        for (target, uids) in l.groups() {
            assert!(uids.iter().all(|u| view().target_for_uid(u) == target));
        }
        assert_eq!(rig.pump(), (0, 0, vec![], vec![]), "waiting: nothing to do");
        assert_eq!(rig.p.len(), 1);
        assert!(rig.p.on_lookup_reply(l.lookup_id, found(l, &[])));
        let (freed, work, pushes, lookups) = rig.pump();
        assert!(lookups.is_empty());
        assert_eq!(
            (freed, work),
            (CHARGE, 1),
            "pushed, and the message is done"
        );
        assert_eq!(all_pushed(&pushes), sorted(remote));
        assert!(pushes.iter().all(|p| p.0 == PushTo::Shard(1)));
        assert_eq!(pushes.len(), 1, "a reply's endpoints coalesce by owner");
        assert!(rig.p.is_empty());
        let counts = rig.p.take_counts();
        assert_eq!((counts.lookups, counts.failed_groups), (1, 0));
    }

    #[test]
    fn an_endpoint_of_this_node_on_a_shard_it_does_not_have_is_never_pushed() {
        // A remote authority answers with a route of this node on shard 9 (2 here):
        // no gateway of this process made it (a peer's bug, or another process).
        let (local, remote) = (led_by(1, "a", 2), led_by(2, "b", 2));
        let mut rig = Rig::new(vec![delivery(1, [local.clone(), remote].concat())]);
        let (_, _, first, lookups) = rig.pump();
        assert_eq!(all_pushed(&first), sorted(local.clone()));
        let [l] = lookups.as_slice() else {
            panic!("one lookup: {lookups:?}");
        };
        let LookupReply::Found {
            mut endpoints,
            results,
        } = found(l, &[])
        else {
            unreachable!()
        };
        endpoints[0].session_id = session_id(9, 1);
        let stale = endpoints[0].uid.clone();
        assert!(rig
            .p
            .on_lookup_reply(l.lookup_id, LookupReply::Found { endpoints, results }));
        let (_, _, pushes, _) = rig.pump();
        assert!(
            pushes
                .iter()
                .all(|p| matches!(p.0, PushTo::Shard(s) if s < rig.limits.shard_count)),
            "{pushes:?}"
        );
        assert!(!all_pushed(&pushes).contains(&stale));
        assert_eq!(all_pushed(&pushes).len(), 1, "the other is pushed");
        assert_eq!(rig.p.take_counts().stale_endpoints, 1);
    }

    #[test]
    fn two_remote_nodes_get_one_lookup_each_and_each_ones_groups_go_when_answered() {
        let recipients = [led_by(2, "b", 2), led_by(3, "c", 2)].concat();
        let mut rig = Rig::new(vec![delivery(1, recipients.clone())]);
        let (_, _, pushes, lookups) = rig.pump();
        assert!(pushes.is_empty() && rig.local.asked.is_empty());
        let nodes: Vec<NodeId> = lookups.iter().map(|l| l.node).collect();
        assert_eq!(sorted_nodes(nodes), vec![2, 3]);
        assert_ne!(lookups[0].lookup_id, lookups[1].lookup_id);
        assert_eq!(rig.p.awaiting_lookups(), 2);
        assert!(rig
            .p
            .on_lookup_reply(lookups[1].lookup_id, found(&lookups[1], &[])));
        let (freed, work, pushes, _) = rig.pump();
        assert_eq!(all_pushed(&pushes), sorted(lookups[1].uids.clone()));
        assert_eq!((freed, work), (0, 1), "one reply of two: the page waits");
        assert_eq!(rig.pump(), (0, 0, vec![], vec![]));
        assert!(rig
            .p
            .on_lookup_reply(lookups[0].lookup_id, found(&lookups[0], &[])));
        let (freed, _, second, _) = rig.pump();
        assert_eq!(all_pushed(&[pushes, second].concat()), sorted(recipients));
        assert_eq!(freed, CHARGE);
    }

    fn sorted_nodes(mut nodes: Vec<NodeId>) -> Vec<NodeId> {
        nodes.sort_unstable();
        nodes
    }

    #[test]
    fn a_failed_lookup_fails_its_groups_and_the_rest_is_delivered() {
        let (local, node2, node3) = (led_by(1, "a", 2), led_by(2, "b", 3), led_by(3, "c", 1));
        let recipients = [local.clone(), node2, node3.clone()].concat();
        let mut rig = Rig::new(vec![delivery(1, recipients)]);
        let (_, _, first, lookups) = rig.pump();
        let (to2, to3) = match lookups.as_slice() {
            [a, b] if a.node == 2 => (a, b),
            [a, b] => (b, a),
            _ => panic!("two lookups: {lookups:?}"),
        };
        let failed = LookupReply::Failed(LookupFailure::Deadline);
        assert!(rig.p.on_lookup_reply(to2.lookup_id, failed));
        assert!(rig.p.on_lookup_reply(to3.lookup_id, found(to3, &[])));
        let (freed, _, pushes, _) = rig.pump();
        let pushes = [first, pushes].concat();
        assert_eq!(all_pushed(&pushes), sorted([local, node3].concat()));
        assert_eq!(freed, CHARGE, "a failed group does not hold the message");
        let counts = rig.p.take_counts();
        assert_eq!(
            (counts.failed_groups, counts.failed_lookups),
            (to2.groups.len() as u64, 1),
            "every group of the failed lookup is counted"
        );
    }

    /// A group refused as stale at the target the view still names (the
    /// authority's view and this one disagree) is asked again every
    /// `rebuild_retry_interval_ms` and fails alone after `rebuild_wait_ms_max`;
    /// the page waits meanwhile.
    #[test]
    fn a_stale_group_in_a_reply_is_asked_again_then_fails_alone() {
        let mut rig = Rig::new(vec![delivery(1, led_by(2, "b", 4))]);
        let (_, _, _, lookups) = rig.pump();
        let l = &lookups[0];
        assert!(l.groups.len() >= 2, "the uids span several hash slots");
        assert!(rig.p.on_lookup_reply(l.lookup_id, found(l, &[0])));
        let stale_uids = l.groups().next().unwrap().1.to_vec();
        let start_ms = rig.now_ms;
        let survivors: Vec<Uid> = l.groups().skip(1).flat_map(|g| g.1.to_vec()).collect();
        let (_, _, pushes, _) = rig.pump();
        assert_eq!(
            all_pushed(&pushes),
            sorted(survivors),
            "the other groups go at once"
        );
        let mut asked_again = 0;
        loop {
            let (freed, _, pushes, again) = rig.pump();
            assert!(pushes.is_empty(), "the stale group is never pushed");
            if freed > 0 {
                break;
            }
            for l in &again {
                assert_eq!(l.uids, stale_uids, "only the stale group is asked again");
                assert!(rig.p.on_lookup_reply(l.lookup_id, found(l, &[0])));
                asked_again += 1;
            }
            assert!(rig.now_ms - start_ms <= 2 * rig.limits.rebuild_wait_ms_max);
        }
        assert!(rig.now_ms - start_ms >= rig.limits.rebuild_wait_ms_max);
        let counts = rig.p.take_counts();
        assert_eq!((counts.failed_groups, counts.failed_lookups), (1, 0));
        assert_eq!(counts.rebuild_timeouts, 1);
        assert_eq!(counts.rebuild_retries, asked_again);
        assert!(asked_again >= 2);
        assert_eq!(counts.retried_groups, 0, "its slot did not move");
    }

    /// Where authorities follow elections, a group lost with its lookup (its
    /// node died) at the target the view still names waits as a rebuilding one
    /// does and is looked up at the leader the next view names; with static
    /// homes it fails at once.
    #[test]
    fn a_group_lost_with_its_node_waits_for_the_election_where_leaders_are_elected() {
        for homes in [Homes::Static, Homes::Leaders] {
            let uids = led_by(2, "b", 1);
            let mut rig = Rig::new(vec![delivery(1, uids.clone())]);
            rig.view.homes = homes;
            let (_, _, _, lookups) = rig.pump();
            let lost = LookupReply::Failed(LookupFailure::PeerDown);
            assert!(rig.p.on_lookup_reply(lookups[0].lookup_id, lost));
            let (freed, _, pushes, again) = rig.pump();
            assert!(pushes.is_empty() && again.is_empty(), "{homes:?}");
            if homes == Homes::Static {
                assert_eq!(freed, CHARGE, "failed at once");
                assert_eq!(rig.p.take_counts().failed_groups, 1);
                continue;
            }
            assert_eq!(freed, 0, "the page waits for the election");
            let h = slots::hash_slot(uids[0].as_bytes()) as usize;
            rig.view.slots[h].leader_node_id = 3;
            rig.view.slots[h].leader_term += 1;
            let mut at_three = None;
            for _ in 0..10 {
                let (_, _, _, again) = rig.pump();
                at_three = again.into_iter().find(|l| l.node == 3);
                if at_three.is_some() {
                    break;
                }
            }
            let l = at_three.expect("looked up at the new leader");
            assert!(rig.p.on_lookup_reply(l.lookup_id, found(&l, &[])));
            let (freed, _, pushes, _) = rig.pump();
            assert_eq!(all_pushed(&pushes), sorted(uids));
            assert_eq!(freed, CHARGE);
            assert_eq!(rig.p.take_counts().failed_groups, 0);
        }
    }

    /// A group answered `Rebuilding` (its authority waits for a moved slot's
    /// handover) is not offline: its page waits, the group is asked again after
    /// `rebuild_retry_interval_ms` (no work reported meanwhile, the next retry's
    /// time given), and its recipients are pushed once the authority serves.
    #[test]
    fn a_rebuilding_group_is_asked_again_and_its_recipients_pushed() {
        let mut rig = Rig::new(vec![delivery(1, led_by(2, "b", 1))]);
        let (_, _, _, lookups) = rig.pump();
        let l = &lookups[0];
        let rebuilding = LookupReply::Found {
            endpoints: vec![],
            results: vec![Err(AuthorityError::Rebuilding)],
        };
        assert!(rig.p.on_lookup_reply(l.lookup_id, rebuilding));
        let opened_ms = rig.now_ms;
        let (_, work, pushes, again) = rig.pump();
        assert!(
            pushes.is_empty() && again.is_empty(),
            "not before the interval"
        );
        assert_eq!(work, 0, "waiting for time is no work");
        let due = rig.p.next_retry_at_ms().expect("a retry is due");
        assert_eq!(due, opened_ms + rig.limits.rebuild_retry_interval_ms);
        assert_eq!(rig.p.groups_awaiting_retry(), 1);
        let (_, work, pushes, again) = rig.pump();
        assert!(pushes.is_empty());
        assert_eq!(work, 1, "a group asked again is work");
        assert_eq!(again.len(), 1, "asked again at its time");
        assert_eq!(again[0].uids, l.uids);
        assert!(rig
            .p
            .on_lookup_reply(again[0].lookup_id, found(&again[0], &[])));
        let (freed, _, pushes, _) = rig.pump();
        assert_eq!(all_pushed(&pushes), sorted(led_by(2, "b", 1)));
        assert_eq!(freed, CHARGE);
        assert_eq!(rig.p.next_retry_at_ms(), None);
        let counts = rig.p.take_counts();
        assert_eq!(
            (
                counts.rebuild_retries,
                counts.rebuild_timeouts,
                counts.failed_groups
            ),
            (1, 0, 0)
        );
    }

    /// A page behind the head asks its own rebuilding group again (its own
    /// recipients) while the head still waits for its reply; pushes keep page
    /// order.
    #[test]
    fn a_rebuilding_page_behind_the_head_asks_again_for_its_own_recipients() {
        let first = delivery(1, led_by(2, "b", 1));
        let second = delivery(2, led_by(3, "c", 1));
        let mut rig = Rig::new(vec![first, second]);
        rig.limits.lookup_pages_in_flight_max = 2;
        let (_, _, _, lookups) = rig.pump();
        let (head, behind) = (&lookups[0], &lookups[1]);
        assert_eq!((head.message_id, behind.message_id), (1, 2));
        let rebuilding = LookupReply::Found {
            endpoints: vec![],
            results: vec![Err(AuthorityError::Rebuilding)],
        };
        assert!(rig.p.on_lookup_reply(behind.lookup_id, rebuilding));
        rig.pump();
        let (_, _, pushes, again) = rig.pump();
        assert!(pushes.is_empty(), "the head still waits");
        assert_eq!(
            (again.len(), again[0].message_id, again[0].uids.clone()),
            (1, 2, led_by(3, "c", 1))
        );
        assert!(rig.p.on_lookup_reply(head.lookup_id, found(head, &[])));
        assert!(rig
            .p
            .on_lookup_reply(again[0].lookup_id, found(&again[0], &[])));
        let (_, _, pushes, _) = rig.pump();
        let order: Vec<i64> = pushes.iter().map(|p| p.1).collect();
        assert_eq!(order, vec![1, 2]);
    }

    /// A local group whose authority rebuilds waits the same way (the local
    /// lookup answers `Rebuilding`).
    #[test]
    fn a_rebuilding_local_group_is_looked_up_again_at_its_time() {
        let uids = in_page_order(led_by(ME, "a", 2));
        let mut rig = Rig::new(vec![delivery(1, uids.clone())]);
        rig.local.rebuilding = 1;
        let (_, work, pushes, _) = rig.pump();
        assert_eq!(
            (work, pushed_pages(&pushes)),
            (1, vec![(1, vec![uids[1].clone()])]),
            "the other group goes; the page waits for time"
        );
        assert!(rig.p.next_retry_at_ms().is_some());
        let (_, work, pushes, _) = rig.pump();
        assert_eq!((work, pushes.len()), (0, 0), "not yet");
        let (freed, _, pushes, _) = rig.pump();
        assert_eq!(all_pushed(&pushes), vec![uids[0].clone()]);
        assert_eq!(freed, CHARGE);
    }

    /// Issue "Cluster defects found in a review…", item 7: a group refused because
    /// its slot moved while the page was planned is looked up again at the leader
    /// the current view names; the page waits for it, then its recipients are
    /// pushed (before: they were skipped).
    #[test]
    fn a_group_refused_after_its_slot_moved_is_looked_up_at_the_new_leader() {
        let mut rig = Rig::new(vec![delivery(1, led_by(2, "b", 4))]);
        let (_, _, _, lookups) = rig.pump();
        let l = &lookups[0];
        let (moved, uids) = (l.groups[0].0, l.groups().next().unwrap().1.to_vec());
        rig.view = rig.view.with_leaders(1, &[(moved.hash_slot, 3)]);
        assert!(rig.p.on_lookup_reply(l.lookup_id, found(l, &[0])));
        let (_, work, first, retried) = rig.pump();
        assert!(
            !all_pushed(&first).iter().any(|u| uids.contains(u)),
            "the page waits for its retried group: {first:?}"
        );
        assert!(work > 0);
        let r = match retried.as_slice() {
            [r] => r,
            _ => panic!("one new lookup: {retried:?}"),
        };
        assert_eq!(r.node, 3);
        assert_eq!(r.groups.len(), 1);
        assert_eq!(r.groups[0].0, rig.view.target_for_slot(moved.hash_slot));
        assert_eq!(sorted(r.uids.clone()), sorted(uids.clone()));
        assert!(rig.p.on_lookup_reply(r.lookup_id, found(r, &[])));
        let (freed, _, pushes, _) = rig.pump();
        assert_eq!(all_pushed(&pushes), sorted(uids));
        assert_eq!(
            all_pushed(&[first, pushes].concat()),
            sorted(led_by(2, "b", 4))
        );
        assert_eq!(freed, CHARGE);
        let counts = rig.p.take_counts();
        assert_eq!((counts.retried_groups, counts.failed_groups), (1, 0));
        assert_eq!(counts.lookups, 2);
    }

    /// Item 7: a remote lookup lost with its node (peer down) whose slots now
    /// belong to this node is looked up here at once, in the same pump.
    #[test]
    fn a_lost_lookup_whose_slots_moved_here_is_looked_up_here() {
        let mut rig = Rig::new(vec![delivery(1, led_by(2, "b", 3))]);
        let (_, _, _, lookups) = rig.pump();
        let l = &lookups[0];
        let moves: Vec<(crate::cluster::HashSlot, NodeId)> =
            l.groups.iter().map(|(t, _)| (t.hash_slot, ME)).collect();
        rig.view = rig.view.with_leaders(1, &moves);
        let lost = LookupReply::Failed(LookupFailure::PeerDown);
        assert!(rig.p.on_lookup_reply(l.lookup_id, lost));
        let (freed, _, pushes, more) = rig.pump();
        assert!(more.is_empty(), "no new lookup: {more:?}");
        assert_eq!(all_pushed(&pushes), sorted(led_by(2, "b", 3)));
        assert_eq!(freed, CHARGE);
        let counts = rig.p.take_counts();
        assert_eq!(counts.retried_groups, l.groups.len() as u64);
        assert_eq!((counts.failed_groups, counts.failed_lookups), (0, 1));
    }

    /// Item 7: a retry of a later message's page (the first one delivered and
    /// gone) looks up that page's own recipients.
    #[test]
    fn a_retry_of_a_later_messages_page_looks_up_its_own_recipients() {
        let first = delivery(1, led_by(ME, "a", 2));
        let second = delivery(2, led_by(2, "b", 3));
        let mut rig = Rig::new(vec![first, second]);
        let (freed, _, pushes, lookups) = rig.pump();
        assert_eq!((freed, pushes.len()), (CHARGE, 1), "the first message went");
        let l = &lookups[0];
        let (slot, uids) = (
            l.groups[0].0.hash_slot,
            l.groups().next().unwrap().1.to_vec(),
        );
        rig.view = rig.view.with_leaders(1, &[(slot, 3)]);
        assert!(rig.p.on_lookup_reply(l.lookup_id, found(l, &[0])));
        let (_, _, first, retried) = rig.pump();
        assert!(!all_pushed(&first).iter().any(|u| uids.contains(u)));
        assert_eq!(sorted(retried[0].uids.clone()), sorted(uids.clone()));
        assert!(rig
            .p
            .on_lookup_reply(retried[0].lookup_id, found(&retried[0], &[])));
        let (freed, _, pushes, _) = rig.pump();
        assert_eq!(all_pushed(&pushes), sorted(uids));
        let pushes = [first, pushes].concat();
        assert_eq!(all_pushed(&pushes), sorted(led_by(2, "b", 3)));
        assert!(pushes.iter().all(|p| p.1 == 2));
        assert_eq!(freed, CHARGE);
    }

    /// Item 7: a page behind the head retries its own groups while the head still
    /// waits; pushes keep page order.
    #[test]
    fn a_page_behind_the_head_retries_its_own_groups() {
        let first = delivery(1, led_by(2, "b", 1));
        let second = delivery(2, led_by(2, "c", 1));
        let mut rig = Rig::new(vec![first, second]);
        rig.limits.lookup_pages_in_flight_max = 2;
        let (_, _, _, lookups) = rig.pump();
        let (head, behind) = (&lookups[0], &lookups[1]);
        assert_eq!((head.message_id, behind.message_id), (1, 2));
        let slot = behind.groups[0].0.hash_slot;
        rig.view = rig.view.with_leaders(1, &[(slot, 3)]);
        assert!(rig.p.on_lookup_reply(behind.lookup_id, found(behind, &[0])));
        let (_, _, pushes, retried) = rig.pump();
        assert!(pushes.is_empty(), "the head still waits");
        assert_eq!(
            (retried[0].node, retried[0].uids.clone()),
            (3, led_by(2, "c", 1))
        );
        assert!(rig
            .p
            .on_lookup_reply(retried[0].lookup_id, found(&retried[0], &[])));
        assert!(rig.p.on_lookup_reply(head.lookup_id, found(head, &[])));
        let (_, _, pushes, _) = rig.pump();
        let order: Vec<i64> = pushes.iter().map(|p| p.1).collect();
        assert_eq!(order, vec![1, 2]);
        assert_eq!(
            all_pushed(&pushes),
            sorted([led_by(2, "b", 1), led_by(2, "c", 1)].concat())
        );
    }

    /// Item 7, bounded: a page retries its failed groups `lookup_retries_max`
    /// times; a group that fails again after that fails for good, though its slot
    /// moved once more.
    #[test]
    fn retries_are_bounded_by_lookup_retries_max() {
        let mut rig = Rig::new(vec![delivery(1, led_by(2, "b", 1))]);
        rig.limits.lookup_retries_max = 1;
        let (_, _, _, lookups) = rig.pump();
        let l = &lookups[0];
        let slot = l.groups[0].0.hash_slot;
        rig.view = rig.view.with_leaders(1, &[(slot, 3)]);
        assert!(rig.p.on_lookup_reply(l.lookup_id, found(l, &[0])));
        let (_, _, _, retried) = rig.pump();
        let r = &retried[0];
        rig.view = rig.view.with_leaders(1, &[(slot, 2)]);
        assert!(rig.p.on_lookup_reply(r.lookup_id, found(r, &[0])));
        let (freed, _, pushes, more) = rig.pump();
        assert!(more.is_empty() && pushes.is_empty(), "{more:?} {pushes:?}");
        assert_eq!(freed, CHARGE, "the failed group does not hold the message");
        let counts = rig.p.take_counts();
        assert_eq!((counts.retried_groups, counts.failed_groups), (1, 1));
    }

    #[test]
    fn a_late_or_unknown_reply_is_ignored() {
        let first = delivery(1, led_by(2, "b", 2));
        let second = delivery(2, led_by(2, "d", 2));
        let mut rig = Rig::new(vec![first, second]);
        let (_, _, _, lookups) = rig.pump();
        let l1 = lookups[0].clone();
        // The driver's deadline fails it; the node's reply arrives after.
        assert!(rig
            .p
            .on_lookup_reply(l1.lookup_id, LookupReply::Failed(LookupFailure::Deadline)));
        let (_, _, pushes, lookups) = rig.pump();
        assert!(pushes.is_empty(), "message 1's only groups failed");
        let l2 = lookups[0].clone();
        assert_eq!(l2.message_id, 2);
        assert!(
            !rig.p.on_lookup_reply(l1.lookup_id, found(&l1, &[])),
            "late"
        );
        assert!(!rig.p.on_lookup_reply(99, found(&l1, &[])), "unknown");
        assert_eq!(rig.p.awaiting_lookups(), 1, "message 2 still waits");
        assert!(rig.p.on_lookup_reply(l2.lookup_id, found(&l2, &[])));
        let (freed, _, pushes, _) = rig.pump();
        assert_eq!(all_pushed(&pushes), sorted(l2.uids.clone()), "none of l1's");
        assert_eq!(freed, CHARGE);
        assert_eq!(rig.p.take_counts().ignored_replies, 2);
    }

    #[test]
    fn the_next_message_waits_behind_a_waiting_page() {
        let (remote, local) = (led_by(2, "b", 2), led_by(1, "a", 2));
        let mut rig = Rig::new(vec![delivery(1, remote), delivery(2, local.clone())]);
        let (_, _, pushes, lookups) = rig.pump();
        assert!(pushes.is_empty(), "message 2 is not planned meanwhile");
        assert!(rig.local.asked.is_empty(), "not even looked up");
        assert_eq!(rig.pump().1, 0);
        assert!(rig
            .p
            .on_lookup_reply(lookups[0].lookup_id, found(&lookups[0], &[])));
        let (freed, _, pushes, _) = rig.pump();
        let order: Vec<i64> = pushes.iter().map(|p| p.1).collect();
        assert_eq!(order, vec![1, 2], "in order, once the reply came");
        assert_eq!(freed, 2 * CHARGE);
        assert_eq!(sorted(rig.local.asked.clone()), sorted(local));
    }

    #[test]
    fn a_batch_for_a_node_without_room_stalls_until_it_has_room() {
        // Local authority, sessions owned by node 2 ('r…') and by shard 1 ('a…').
        let (remote_owned, here) = (led_by(1, "r", 2), led_by(1, "a", 1));
        let mut rig = Rig::new(vec![delivery(1, [remote_owned.clone(), here].concat())]);
        rig.room = vec![(PushTo::Node(2), 1)]; // no more than the reserve
        let (freed, work, pushes, _) = rig.pump();
        let to: Vec<PushTo> = pushes.iter().map(|p| p.0).collect();
        assert_eq!(
            to,
            vec![PushTo::Shard(1)],
            "the shard's batch goes; node 2's waits"
        );
        assert_eq!((freed, work), (0, 2), "busy while stalled");
        assert_eq!(rig.p.take_counts().stalls, 1);
        assert_eq!(rig.pump().2, vec![], "still no room");
        rig.room = vec![(PushTo::Node(2), 2)];
        let (freed, _, pushes, _) = rig.pump();
        assert_eq!(pushes, vec![(PushTo::Node(2), 1, remote_owned)]);
        assert_eq!(freed, CHARGE);
    }

    #[test]
    #[allow(clippy::too_many_lines)] // one scenario, read top-down
    fn planning_through_the_authority_reader_finds_every_registered_route() {
        // The node's own lookup (`AuthorityReader`, not a fake): 40 subscribers over
        // many hash slots, 25 of them online with one session each, on shards 0
        // and 1; every online one is pushed to its session's shard, no one else.
        use crate::cluster::HashSlot;
        use crate::presence::authority::{Authority, AuthorityConfig, Directory};
        use crate::presence::route::{RegisterOutcome, Route, Transport};
        use slots::HASH_SLOTS;

        let cfg = AuthorityConfig::default();
        let dir = Directory::new(&cfg).unwrap();
        let slots: Vec<HashSlot> = (0..HASH_SLOTS as HashSlot).collect();
        let mut authority = Authority::new(cfg, &dir, &slots).unwrap();
        let view = ClusterView::single_node(ME);
        assert!(authority.apply_view(&view, ME, 0));
        let uids: Vec<Uid> = (0..40).map(|i| Uid::from(format!("m{i}"))).collect();
        let mut online = Vec::new();
        for (i, uid) in uids.iter().enumerate().filter(|(i, _)| i % 8 < 5) {
            let route = Route {
                uid: uid.clone(),
                device_id: "d".into(),
                device_flag: 1,
                device_level: DeviceLevel::Master,
                node_id: ME,
                boot_id: 7,
                session_id: session_id((i % 2) as ShardId, i as u64),
                listener: Transport::Tcp,
                owner_seq: 1,
                connected_at_ms: 0,
                last_active_s: Some(0),
            };
            let target = view.target_for_uid(uid);
            assert_eq!(
                authority.register_route(&target, route.clone(), 0),
                Ok(RegisterOutcome::Active)
            );
            online.push((route.uid, route.session_id));
        }
        online.sort();
        let mut reader = authority.reader();

        let mut p = Planner::default();
        p.enqueue(delivery(1, uids.clone()));
        let mut limits = limits();
        limits.subscriber_page_max = 64;
        let (mut out, mut room) = (Vec::new(), |_| usize::MAX);
        let (freed, _) = p.pump(0, &view, &mut reader, &mut room, &limits, &mut out);
        assert_eq!(freed, CHARGE);
        let mut pushed = Vec::new();
        for o in out {
            let PlanOutput::Push(push) = o else {
                panic!("every group is local: no lookup");
            };
            for e in push.endpoints {
                assert_eq!(push.to, PushTo::Shard(session_shard(e.session_id)));
                pushed.push((e.uid, e.session_id));
            }
        }
        pushed.sort();
        assert_eq!(pushed, online);

        // The plain lookup (by target, without hashes) finds the same.
        let groups: Vec<(Target, Vec<Uid>)> = uids
            .iter()
            .map(|u| (view.target_for_uid(u), vec![u.clone()]))
            .collect();
        let lookups: Vec<(Target, &[Uid])> =
            groups.iter().map(|(t, u)| (*t, u.as_slice())).collect();
        let (mut endpoints, mut results) = (Vec::new(), Vec::new());
        EndpointLookup::endpoints_by_targets_into(
            &mut reader,
            &lookups,
            &mut endpoints,
            &mut results,
        );
        assert_eq!(results.len(), uids.len());
        assert!(results.iter().all(|r| r.is_ok()));
        let mut plain: Vec<(Uid, SessionId)> = endpoints
            .into_iter()
            .map(|e| (e.uid, e.session_id))
            .collect();
        plain.sort();
        assert_eq!(plain, online);
    }

    #[test]
    fn every_batch_to_one_node_takes_its_room() {
        // Three one-endpoint batches for node 2, whose room takes two past the
        // reserve: the third waits, and goes once room is back.
        let remote_owned = in_page_order(led_by(1, "r", 3));
        let mut rig = Rig::new(vec![delivery(1, remote_owned.clone())]);
        rig.limits.push_batch_max = 1;
        rig.room = vec![(PushTo::Node(2), 3)];
        let (freed, _, pushes, _) = rig.pump();
        assert_eq!(pushes.len(), 2, "{pushes:?}");
        assert!(pushes.iter().all(|p| p.0 == PushTo::Node(2)));
        assert_eq!(freed, 0);
        assert_eq!(rig.p.take_counts().stalls, 1);
        assert!(!rig.p.is_empty(), "the message waits for its last batch");
        let (freed, _, last, _) = rig.pump();
        assert_eq!(last.len(), 1, "room is per call: a new call has it again");
        let mut all: Vec<Uid> = pushes.into_iter().chain(last).flat_map(|p| p.2).collect();
        all.sort();
        assert_eq!(all, sorted(remote_owned));
        assert_eq!(freed, CHARGE);
        assert!(rig.p.is_empty());
    }

    #[test]
    fn a_call_that_stops_at_pages_per_turn_max_asks_for_another() {
        // Two local pages, one page a call: the first call pushes one page and says
        // there is more; the second pushes the other and the message is done.
        let here = in_page_order(led_by(1, "a", 4));
        let mut rig = Rig::new(vec![delivery(1, here.clone())]);
        rig.limits.subscriber_page_max = 2;
        rig.limits.pages_per_turn_max = 1;
        let (freed, work, pushes, _) = rig.pump();
        assert_eq!(pushes.len(), 1);
        assert_eq!((freed, work), (0, 2), "one push, and more to do");
        assert_eq!((rig.p.len(), rig.p.is_empty()), (1, false));
        let (freed, work, more, _) = rig.pump();
        assert_eq!(more.len(), 1);
        assert_eq!((freed, work), (CHARGE, 1), "the last page: nothing more");
        let mut all: Vec<Uid> = pushes.into_iter().chain(more).flat_map(|p| p.2).collect();
        all.sort();
        assert_eq!(all, sorted(here));
        assert_eq!(rig.pump(), (0, 0, vec![], vec![]));
    }

    #[test]
    fn a_reply_that_does_not_fit_its_request_fails_every_group() {
        let mut rig = Rig::new(vec![delivery(1, led_by(2, "b", 4))]);
        let (_, _, _, lookups) = rig.pump();
        let l = &lookups[0];
        let LookupReply::Found {
            endpoints,
            mut results,
        } = found(l, &[])
        else {
            unreachable!()
        };
        results.pop();
        let short = LookupReply::Found { endpoints, results };
        assert!(rig.p.on_lookup_reply(l.lookup_id, short));
        assert!(rig.pump().2.is_empty());
        let counts = rig.p.take_counts();
        assert_eq!(
            (counts.failed_groups, counts.failed_lookups),
            (l.groups.len() as u64, 1)
        );
    }

    #[test]
    fn found_endpoints_are_moved_by_range_and_bad_ranges_refused() {
        let eps: Vec<Endpoint> = ["x", "y", "z"].map(|u| endpoint(&Uid::from(u))).to_vec();
        let mut into = Vec::new();
        let results = [
            Ok(0..1),
            Err(AuthorityError::StaleTarget),
            Ok(1..1),
            Ok(2..3),
        ];
        assert_eq!(take_found(eps.clone(), &results, 4, &mut into), Some(1));
        let uids: Vec<&str> = into.iter().map(|e| &*e.uid).collect();
        assert_eq!(
            uids,
            vec!["x", "z"],
            "only the successful groups' endpoints"
        );
        for bad in [
            [Ok(1..2), Ok(0..1)],
            [Ok(0..4), Ok(4..4)],
            [Ok(Range { start: 2, end: 1 }), Ok(2..2)],
        ] {
            assert_eq!(take_found(eps.clone(), &bad, 2, &mut into), None, "{bad:?}");
        }
        assert_eq!(take_found(eps, &[Ok(0..3)], 2, &mut into), None, "count");
    }

    // ---- the pipeline (lookup_pages_in_flight_max > 1) ----

    /// A rig whose planner opens pages of two uids, up to `in_flight` of them in
    /// flight (and up to 8 a call).
    fn pipelined(deliveries: Vec<Delivery>, in_flight: usize) -> Rig {
        let mut rig = Rig::new(deliveries);
        rig.limits.subscriber_page_max = 2;
        rig.limits.pages_per_turn_max = 8;
        rig.limits.lookup_pages_in_flight_max = in_flight;
        rig
    }

    /// Each push as (message, its uids sorted), in push order.
    fn pushed_pages(pushes: &[(PushTo, i64, Vec<Uid>)]) -> Vec<(i64, Vec<Uid>)> {
        pushes.iter().map(|p| (p.1, sorted(p.2.clone()))).collect()
    }

    fn answer(rig: &mut Rig, l: &Lookup) {
        assert!(rig.p.on_lookup_reply(l.lookup_id, found(l, &[])));
    }

    const IDLE: Pumped = (0, 0, Vec::new(), Vec::new());

    #[test]
    fn pages_in_flight_are_pushed_as_their_replies_come() {
        // Four pages toward node 2 (uids of distinct slots), then a local page.
        let remote = in_page_order(one_per_slot(led_by(2, "b", 32), 8));
        let local = led_by(1, "a", 2);
        let deliveries = vec![delivery(1, remote.clone()), delivery(2, local.clone())];
        let mut rig = pipelined(deliveries, 5);
        let (freed, work, pushes, lookups) = rig.pump();
        assert_eq!(
            pushed_pages(&pushes),
            vec![(2, sorted(local))],
            "message 2's local page does not wait for message 1's"
        );
        assert_eq!(
            (freed, work),
            (0, 5),
            "four pages sent lookups, one was pushed; then only waiting"
        );
        assert_eq!(
            lookups.len(),
            4,
            "one lookup per page of message 1, all at once"
        );
        for (l, page) in lookups.iter().zip(remote.chunks(2)) {
            assert_eq!(
                (l.message_id, sorted(l.uids.clone())),
                (1, sorted(page.to_vec()))
            );
        }
        assert_eq!(rig.p.pages_in_flight(), 4);
        for l in lookups[1..].iter().rev() {
            answer(&mut rig, l);
            let (freed, _, pushes, _) = rig.pump();
            assert_eq!(
                (freed, pushed_pages(&pushes)),
                (0, vec![(1, sorted(l.uids.clone()))]),
                "a page whose slots no earlier page waits for goes as answered"
            );
        }
        answer(&mut rig, &lookups[0]);
        let (freed, _, pushes, lookups) = rig.pump();
        assert!(lookups.is_empty());
        assert_eq!(
            pushed_pages(&pushes),
            vec![(1, sorted(remote[..2].to_vec()))]
        );
        assert_eq!(freed, 2 * CHARGE);
        assert!(rig.p.is_empty() && rig.p.pages_in_flight() == 0);
    }

    /// The first `n` of `uids` whose hash slots differ.
    fn one_per_slot(uids: Vec<Uid>, n: usize) -> Vec<Uid> {
        let mut seen = SlotSet::default();
        let mut first = |u: &Uid| {
            let slot = slots::hash_slot(u.as_bytes());
            let new = !seen.contains(slot);
            seen.insert(slot);
            new
        };
        let uids: Vec<Uid> = uids.into_iter().filter(|u| first(u)).take(n).collect();
        assert_eq!(uids.len(), n, "not enough slots");
        uids
    }

    #[test]
    fn a_failed_lookup_in_the_middle_fails_its_page_alone() {
        let uids = one_per_slot(led_by(2, "b", 32), 6);
        let mut rig = pipelined(vec![delivery(1, uids)], 8);
        let (_, _, _, lookups) = rig.pump();
        let [l0, l1, l2] = lookups.as_slice() else {
            panic!("three pages, three lookups: {lookups:?}");
        };
        answer(&mut rig, l2);
        let failed = LookupReply::Failed(LookupFailure::PeerDown);
        assert!(rig.p.on_lookup_reply(l1.lookup_id, failed));
        let (freed, _, pushes, _) = rig.pump();
        assert_eq!(pushed_pages(&pushes), vec![(1, sorted(l2.uids.clone()))]);
        assert_eq!(freed, 0, "the first page still waits");
        answer(&mut rig, l0);
        let (freed, _, pushes, _) = rig.pump();
        assert_eq!(pushed_pages(&pushes), vec![(1, sorted(l0.uids.clone()))]);
        assert_eq!(freed, CHARGE, "a failed page does not hold the message");
        let counts = rig.p.take_counts();
        assert_eq!(
            (counts.failed_groups, counts.failed_lookups, counts.lookups),
            (l1.groups.len() as u64, 1, 3)
        );
    }

    #[test]
    fn at_the_limit_nothing_more_is_looked_up_until_a_page_is_pushed() {
        let remote = in_page_order(one_per_slot(led_by(2, "b", 32), 8));
        let mut rig = pipelined(vec![delivery(1, remote.clone())], 2);
        let (_, work, _, first) = rig.pump();
        assert_eq!((first.len(), work), (2, 2));
        assert_eq!(rig.p.pages_in_flight(), 2);
        assert_eq!(rig.pump(), IDLE, "full and waiting: the shard may sleep");
        answer(&mut rig, &first[1]);
        let (freed, _, pushes, next) = rig.pump();
        assert_eq!(
            pushed_pages(&pushes),
            vec![(1, sorted(first[1].uids.clone()))]
        );
        let [third] = next.as_slice() else {
            panic!("the freed slot is filled at once: {next:?}");
        };
        assert_eq!(sorted(third.uids.clone()), sorted(remote[4..6].to_vec()));
        assert_eq!((freed, rig.p.pages_in_flight()), (0, 2));
        assert_eq!(rig.pump(), IDLE, "full again");
        answer(&mut rig, &first[0]);
        let (_, _, pushes, next) = rig.pump();
        assert_eq!(
            pushed_pages(&pushes),
            vec![(1, sorted(first[0].uids.clone()))]
        );
        let [fourth] = next.as_slice() else {
            panic!("the last page: {next:?}");
        };
        assert_eq!(sorted(fourth.uids.clone()), sorted(remote[6..].to_vec()));
        assert_eq!(rig.p.awaiting_lookups(), 2);
        answer(&mut rig, third);
        answer(&mut rig, fourth);
        let (freed, _, pushes, _) = rig.pump();
        assert_eq!(pushes.len(), 2);
        assert_eq!(freed, CHARGE);
        assert!(rig.p.is_empty());
    }

    #[test]
    fn limit_one_looks_up_one_page_at_a_time() {
        let (remote, local) = (in_page_order(led_by(2, "b", 4)), led_by(1, "a", 2));
        let deliveries = vec![delivery(1, remote.clone()), delivery(2, local.clone())];
        let mut rig = pipelined(deliveries, 1);
        let (mut pushed, mut round_trips) = (Vec::new(), 0);
        loop {
            let (_, _, pushes, lookups) = rig.pump();
            pushed.extend(pushed_pages(&pushes));
            let l = match lookups.as_slice() {
                [] => break,
                [l] => l.clone(),
                more => panic!("one lookup at a time: {more:?}"),
            };
            round_trips += 1;
            assert_eq!(rig.p.pages_in_flight(), 1);
            assert!(rig.local.asked.is_empty(), "nothing behind a waiting page");
            assert_eq!(rig.pump(), IDLE);
            answer(&mut rig, &l);
        }
        assert_eq!(round_trips, 2, "one per page");
        let expected = vec![
            (1, sorted(remote[..2].to_vec())),
            (1, sorted(remote[2..].to_vec())),
            (2, sorted(local)),
        ];
        assert_eq!(pushed, expected);
        assert!(rig.p.is_empty());
    }

    #[test]
    fn a_stalled_batch_holds_the_complete_pages_behind_it() {
        // Message 1: led by node 2, its sessions owned by node 2 ('r…'); message 2:
        // led by node 3, its sessions owned by shard 1.
        let (theirs, here) = (
            in_page_order(led_by(2, "r", 2)),
            in_page_order(led_by(3, "a", 2)),
        );
        let deliveries = vec![delivery(1, theirs.clone()), delivery(2, here.clone())];
        let mut rig = pipelined(deliveries, 4);
        rig.room = vec![(PushTo::Node(2), 1)]; // no more than the reserve
        let (_, _, pushes, lookups) = rig.pump();
        assert!(pushes.is_empty());
        lookups.iter().for_each(|l| answer(&mut rig, l));
        let (freed, work, pushes, _) = rig.pump();
        assert!(
            pushes.is_empty(),
            "node 2's batch stalls; message 2, complete, waits behind it"
        );
        assert_eq!((freed, work), (0, 2), "busy while stalled");
        assert_eq!(rig.p.take_counts().stalls, 1);
        assert_eq!(rig.pump().2, vec![], "still no room");
        rig.room = vec![(PushTo::Node(2), 2)];
        let (freed, _, pushes, _) = rig.pump();
        assert_eq!(
            pushes,
            vec![(PushTo::Node(2), 1, theirs), (PushTo::Shard(1), 2, here)]
        );
        assert_eq!(freed, 2 * CHARGE);
    }

    /// The offline rig: offline uids gathered, pages of 4.
    fn gathering(deliveries: Vec<Delivery>, in_flight: usize) -> Rig {
        let mut rig = pipelined(deliveries, in_flight);
        rig.limits.offline_uids = true;
        rig.limits.subscriber_page_max = 4;
        rig
    }

    #[test]
    fn a_group_message_names_its_offline_members_once_after_its_last_page() {
        // 3 pages of 4 (local and remote groups): 5 offline ('z'), the sender
        // offline too but never named, a failed group unknown (not offline).
        let zs = [led_by(1, "za", 2), led_by(2, "zb", 2), led_by(3, "zc", 1)].concat();
        let online = [led_by(1, "a", 2), led_by(2, "b", 2)].concat();
        let stale = led_by(3, "zs", 1);
        let mut uids = [zs.clone(), online, stale.clone()].concat();
        uids.push("zsender".into());
        let mut d = delivery(1, uids);
        Arc::get_mut(&mut d.message).unwrap().from_uid = "zsender".into();
        let mut rig = gathering(vec![d, delivery(2, led_by(1, "a", 1))], 8);
        let mut answered = 0;
        loop {
            let (_, _, _, lookups) = rig.pump();
            for l in &lookups {
                // The group of the stale uid fails; the rest answers.
                let bad: Vec<usize> = l
                    .groups()
                    .enumerate()
                    .filter(|(_, (_, u))| u.iter().any(|u| stale.contains(u)))
                    .map(|(g, _)| g)
                    .collect();
                assert!(rig.p.on_lookup_reply(l.lookup_id, found(l, &bad)));
                answered += 1;
            }
            if lookups.is_empty() && rig.p.is_empty() {
                break;
            }
        }
        assert!(answered >= 2, "remote groups were asked");
        let failed = rig.p.take_counts().failed_groups;
        assert_eq!(failed, 1);
        let stale_target = view().target_for_uid(&stale[0]);
        assert!(
            zs.iter().all(|u| view().target_for_uid(u) != stale_target),
            "no offline member shares the failed group"
        );
        assert_eq!(
            rig.offline,
            vec![(1, sorted(zs))],
            "one event for message 1 (all online in message 2)"
        );
    }

    #[test]
    fn a_large_group_of_one_slot_names_exactly_its_offline_members() {
        // More than 16 endpoints found in one group: the set-based comparison.
        let slot = |u: &Uid| view().target_for_uid(u).hash_slot;
        let first: Uid = led_by(1, "a", 1).pop().unwrap();
        let same = |tag: &'static str, n: usize| -> Vec<Uid> {
            (0..)
                .map(move |i| Uid::from(format!("{tag}{i}")))
                .filter(|u| slot(u) == slot(&first))
                .take(n)
                .collect()
        };
        let (online, zs) = (same("a", 20), same("z", 3));
        let mut rig = gathering(vec![delivery(1, [online, zs.clone()].concat())], 4);
        rig.limits.subscriber_page_max = 64;
        let (_, _, pushes, lookups) = rig.pump();
        assert!(lookups.is_empty(), "a local group");
        assert_eq!(all_pushed(&pushes).len(), 20);
        assert_eq!(rig.offline, vec![(1, sorted(zs))]);
    }

    #[test]
    fn a_message_gathers_its_offline_members_as_its_first_page_decided() {
        // 3 messages of 3 pages (9 local uids, none online). Room in the msg.offline
        // queue is read as each page opens: message 0 starts with room and keeps
        // gathering without; message 1 starts without (skipped, counted, nothing
        // left behind for the next); message 2 starts with room again.
        let zs = led_by(1, "z", 9);
        let ds = (0..3).map(|id| delivery(id, zs.clone())).collect();
        let mut rig = gathering(ds, 1);
        rig.limits.pages_per_turn_max = 1;
        for _ in 0..30 {
            // One page opens per pump: the cursor names it.
            rig.limits.offline_room = match rig.p.cursor {
                (0, 0) => true,
                (0, _) | (1, 0) => false,
                _ => true,
            };
            rig.pump();
        }
        assert!(rig.p.is_empty(), "every message delivered");
        assert_eq!(rig.offline, vec![(0, sorted(zs.clone())), (2, sorted(zs))]);
        assert_eq!(rig.p.take_counts().offline_skipped, 1);
    }

    #[test]
    fn no_offline_event_when_not_asked_for_or_not_stored() {
        let zs = led_by(1, "z", 3);
        let mut rig = pipelined(vec![delivery(1, zs.clone())], 4);
        rig.pump();
        assert!(rig.offline.is_empty() && rig.p.is_empty(), "off by default");
        let mut no_persist = delivery(2, zs.clone());
        Arc::get_mut(&mut no_persist.message).unwrap().flags = proto::wkproto::Flags::NO_PERSIST.0;
        let mut rig = gathering(vec![no_persist, delivery(3, zs.clone())], 4);
        rig.pump();
        assert_eq!(rig.offline, vec![(3, sorted(zs))]);
    }

    #[test]
    fn a_person_message_names_the_peer_when_offline_never_the_sender() {
        let peer = led_by(2, "zp", 1).pop().unwrap();
        let mut d = delivery(1, Vec::new());
        d.subscribers = None;
        let m = Arc::get_mut(&mut d.message).unwrap();
        m.channel_type = 1;
        m.channel_key = crate::send::channel::person_channel_key("zsender", &peer);
        m.from_uid = "zsender".into();
        let mut rig = gathering(vec![d], 4);
        let (_, _, _, lookups) = rig.pump();
        for l in &lookups {
            rig.p.on_lookup_reply(l.lookup_id, found(l, &[]));
        }
        rig.pump();
        assert_eq!(rig.offline, vec![(1, vec![peer])]);
    }

    #[test]
    fn a_page_toward_a_slow_authority_does_not_hold_the_next_pages_pushes() {
        // Message 1's page waits for node 2 (slow); message 2's page for node 3,
        // which answers at once: its pushes go before node 2 answers.
        let (slow, healthy) = (led_by(2, "b", 2), led_by(3, "c", 2));
        let deliveries = vec![delivery(1, slow.clone()), delivery(2, healthy.clone())];
        let mut rig = pipelined(deliveries, 4);
        let (_, _, pushes, lookups) = rig.pump();
        assert!(pushes.is_empty());
        let [to_slow, to_healthy] = lookups.as_slice() else {
            panic!("one lookup per page: {lookups:?}");
        };
        assert_eq!((to_slow.node, to_healthy.node), (2, 3));
        answer(&mut rig, to_healthy);
        let (freed, work, pushes, _) = rig.pump();
        assert_eq!(
            pushed_pages(&pushes),
            vec![(2, sorted(healthy))],
            "node 3's groups do not wait for node 2's"
        );
        assert_eq!(
            (freed, work),
            (0, 1),
            "messages leave the backlog in order: message 2 with message 1"
        );
        assert_eq!(
            rig.p.pages_in_flight(),
            1,
            "the pushed page left the pipeline"
        );
        assert_eq!(rig.pump(), IDLE, "only node 2's reply is awaited");
        answer(&mut rig, to_slow);
        let (freed, _, pushes, _) = rig.pump();
        assert_eq!(pushed_pages(&pushes), vec![(1, sorted(slow))]);
        assert_eq!(freed, 2 * CHARGE);
        assert!(rig.p.is_empty() && rig.p.pages_in_flight() == 0);
    }

    #[test]
    fn a_group_of_a_slot_an_earlier_page_waits_for_is_held_behind_it() {
        // u (node 2's slot) is a recipient of both messages: message 2's u waits
        // for message 1's u; its v (node 3) goes at once.
        let (u, v) = (led_by(2, "b", 1), led_by(3, "c", 1));
        let deliveries = vec![
            delivery(1, u.clone()),
            delivery(2, [u.clone(), v.clone()].concat()),
        ];
        let mut rig = pipelined(deliveries, 4);
        let (_, _, pushes, lookups) = rig.pump();
        assert!(pushes.is_empty());
        let [first, second @ ..] = lookups.as_slice() else {
            panic!("lookups: {lookups:?}");
        };
        assert_eq!((first.message_id, second.len()), (1, 2));
        second.iter().for_each(|l| answer(&mut rig, l));
        let (freed, _, pushes, _) = rig.pump();
        assert_eq!(
            pushed_pages(&pushes),
            vec![(2, v.clone())],
            "v goes; message 2's u is held behind message 1's"
        );
        assert_eq!(freed, 0);
        assert_eq!(rig.p.pages_in_flight(), 2, "message 2's page holds u");
        assert_eq!(
            rig.pump(),
            IDLE,
            "a held group is no work until its slot frees"
        );
        answer(&mut rig, first);
        let (freed, _, pushes, _) = rig.pump();
        assert_eq!(
            pushed_pages(&pushes),
            vec![(1, u.clone()), (2, u)],
            "u gets message 1, then message 2"
        );
        assert_eq!(freed, 2 * CHARGE);
        assert_eq!(rig.p.pages_in_flight(), 0);
    }

    #[test]
    fn pages_behind_a_waiting_one_free_their_slots_and_the_limit_holds() {
        // Limit 2: message 1 waits for node 2; messages 2..=4 (node 3) each take
        // the second slot in turn, one at a time.
        let slow = led_by(2, "b", 1);
        let healthy = led_by(3, "c", 3);
        let mut deliveries = vec![delivery(1, slow.clone())];
        deliveries.extend((0..3).map(|i| delivery(2 + i as i64, vec![healthy[i].clone()])));
        let mut rig = pipelined(deliveries, 2);
        let (_, _, _, mut lookups) = rig.pump();
        assert_eq!(lookups.len(), 2, "two pages at the limit");
        assert_eq!(rig.p.pages_in_flight(), 2);
        let to_slow = lookups.remove(0);
        for (i, uid) in healthy.iter().enumerate() {
            let [l] = lookups.as_slice() else {
                panic!("one page past the slow one: {lookups:?}");
            };
            assert_eq!((l.message_id, l.node), (2 + i as i64, 3));
            answer(&mut rig, &lookups[0]);
            let (_, _, pushes, next) = rig.pump();
            assert_eq!(
                pushed_pages(&pushes),
                vec![(2 + i as i64, vec![uid.clone()])]
            );
            assert_eq!(rig.p.pages_in_flight(), 1 + usize::from(i < 2));
            lookups = next;
        }
        assert!(lookups.is_empty());
        assert_eq!(rig.p.len(), 4, "none leaves before message 1");
        answer(&mut rig, &to_slow);
        let (freed, _, pushes, _) = rig.pump();
        assert_eq!(pushed_pages(&pushes), vec![(1, slow)]);
        assert_eq!(freed, 4 * CHARGE);
    }

    #[test]
    fn a_message_whose_pages_end_out_of_order_names_its_offline_members_once_all_did() {
        // Message 1: page 1 waits for node 2 (one offline member), page 2 is local
        // (one offline member) and ends first; message 2 (one offline member)
        // ends before message 1 too.
        let low = |u: &Uid| slots::hash_slot(u.as_bytes()) < 128;
        let (zb, za) = (led_by(2, "zb", 64), led_by(1, "za", 64));
        let (b, a) = (led_by(2, "b", 64), led_by(1, "a", 64));
        let zb: Vec<Uid> = zb.into_iter().filter(low).take(1).collect();
        let za: Vec<Uid> = za.into_iter().filter(|u| !low(u)).take(1).collect();
        let first = [zb.clone(), b.into_iter().filter(low).take(3).collect()].concat();
        let second = [
            za.clone(),
            a.into_iter().filter(|u| !low(u)).take(3).collect(),
        ]
        .concat();
        let mut rig = gathering(vec![delivery(1, [first, second].concat())], 8);
        rig.p.enqueue(delivery(2, led_by(1, "zc", 1)));
        let (_, _, pushes, lookups) = rig.pump();
        let pages: Vec<i64> = pushes.iter().map(|p| p.1).collect();
        assert_eq!(
            pages,
            vec![1],
            "message 1's page 2 (message 2's uid is offline)"
        );
        assert_eq!(
            rig.offline,
            vec![(2, led_by(1, "zc", 1))],
            "message 2 ended; message 1 has a page in flight"
        );
        let [l] = lookups.as_slice() else {
            panic!("one lookup: {lookups:?}");
        };
        answer(&mut rig, l);
        let (freed, _, _, _) = rig.pump();
        assert_eq!(freed, 2 * CHARGE);
        let expected = sorted([zb, za].concat());
        assert_eq!(rig.offline[1..], [(1, expected)], "once, with both pages'");
    }

    #[test]
    fn a_slot_pending_in_two_earlier_pages_holds_the_third() {
        // u in three messages: message 1's waits for node 2; message 2's and 3's,
        // answered, wait behind it (and behind each other), in message order.
        let (u, v) = (led_by(2, "b", 1), led_by(3, "c", 1));
        let deliveries = vec![
            delivery(1, u.clone()),
            delivery(2, [u.clone(), v.clone()].concat()),
            delivery(3, u.clone()),
        ];
        let mut rig = pipelined(deliveries, 4);
        let (_, _, _, lookups) = rig.pump();
        let [first, rest @ ..] = lookups.as_slice() else {
            panic!("lookups: {lookups:?}");
        };
        assert_eq!((first.message_id, rest.len()), (1, 3));
        rest.iter().for_each(|l| answer(&mut rig, l));
        let (_, _, pushes, _) = rig.pump();
        assert_eq!(pushed_pages(&pushes), vec![(2, v)], "only v goes");
        answer(&mut rig, first);
        let (freed, _, pushes, _) = rig.pump();
        let order: Vec<(i64, Vec<Uid>)> = (1..=3).map(|m| (m, u.clone())).collect();
        assert_eq!(pushed_pages(&pushes), order);
        assert_eq!(freed, 3 * CHARGE);
    }
}
