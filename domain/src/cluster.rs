//! The cluster view and the exact target every authority operation carries.
//!
//! A node accepts an authority call for a hash slot only if the call's [`Target`] is
//! exactly the identity it has installed for that slot (rule 1). The routing
//! `revision` travels beside the target as freshness evidence, not as part of it: a
//! revision-only change keeps the directory (rule 4).
//!
//! Rule numbers refer to `docs/authority-rules.md` (each tested in
//! `domain/tests/authority_rules.rs` or `activation_rules.rs`).

use slots::{hash_slot, HASH_SLOTS};

pub use slots::HashSlot;

/// A node's configured id.
pub type NodeId = u64;
/// A slot id: a contiguous range of hash slots replicated and led together.
pub type SlotId = u32;
/// A slot leader's term; grows with every leadership change of the slot.
pub type Term = u64;
/// The cluster configuration epoch.
pub type ConfigEpoch = u64;
/// The routing revision of a cluster view.
pub type Revision = u64;

/// The exact authority identity of one hash slot: `(hash_slot, slot_id,
/// leader_node_id, leader_term, config_epoch)`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, serde::Serialize, serde::Deserialize)]
pub struct Target {
    /// The hash slot (0..256) the operation is about: the uid's `hash_slot`.
    pub hash_slot: HashSlot,
    /// The slot id the view groups `hash_slot` into ([`slot_id_of`]).
    pub slot_id: SlotId,
    /// The node the caller believes leads the slot; the authority refuses the call
    /// if it is not this node (`NotLeader`, `StaleTarget`).
    pub leader_node_id: NodeId,
    /// The leader's term the caller saw; an older one is refused (rule 2).
    pub leader_term: Term,
    /// The config epoch of the caller's view; any other epoch is refused (rule 2).
    pub config_epoch: ConfigEpoch,
}

/// Who leads one hash slot, as a cluster view says.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, serde::Serialize, serde::Deserialize)]
pub struct SlotLeader {
    /// The slot id the hash slot belongs to; fixed by `slot_id_of` for the cluster's
    /// `slot_ids` ([`ClusterView::check`] refuses a view that differs).
    pub slot_id: SlotId,
    /// The node that leads the slot: the authority of its uids.
    pub leader_node_id: NodeId,
    /// The leader's term: 1 in the initial view, raised by every move
    /// ([`next_term`]); the higher term wins in [`ClusterView::merge`].
    pub leader_term: Term,
    /// The node the move that made this term took the slot from (its leader in
    /// the mover's view; this very leader for a move to itself); 0 in the
    /// initial view. The new leader waits for that node's handover of the
    /// slot's routes (`presence::authority`'s `handover` module).
    #[serde(default)]
    pub from_node_id: NodeId,
}

/// The most slot ids a view may have: one per hash slot.
pub const MAX_SLOT_IDS: u32 = HASH_SLOTS as u32;

/// The slot id of hash slot `hash_slot` when the 256 hash slots are grouped into
/// `slot_ids` contiguous ranges: `hash_slot * slot_ids / 256`. Any count in
/// `1..=256` works: each slot id gets `256 / slot_ids` hash slots, rounded down or
/// up (the sizes differ by at most one), none gets none.
#[inline]
pub fn slot_id_of(hash_slot: HashSlot, slot_ids: u32) -> SlotId {
    u32::from(hash_slot) * slot_ids / MAX_SLOT_IDS
}

/// Why [`ClusterView::initial`] refused its inputs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ViewError {
    /// The node list is empty.
    NoNodes,
    /// The slot id count is outside `1..=256`.
    SlotIds(u32),
    /// A node id appears twice in the node list.
    DuplicateNode(NodeId),
    /// A view's node list is not the cluster's (`[[cluster.nodes]]` in order).
    OtherNodes,
    /// A view maps this hash slot to another slot id than `slot_id_of` does.
    SlotIdOf(HashSlot),
    /// A view names this node, outside the cluster, as a hash slot's leader.
    UnknownLeader(HashSlot, NodeId),
}

impl std::fmt::Display for ViewError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ViewError::NoNodes => write!(f, "the cluster lists no node"),
            ViewError::SlotIds(n) => write!(
                f,
                "slot_ids = {n}: must be in 1..={MAX_SLOT_IDS} (hash slot h belongs to \
                 slot id h * slot_ids / {MAX_SLOT_IDS})"
            ),
            ViewError::DuplicateNode(id) => write!(f, "node id {id} is listed twice"),
            ViewError::OtherNodes => f.write_str("the view lists other nodes than the cluster's"),
            ViewError::SlotIdOf(h) => write!(f, "hash slot {h} is in another slot id"),
            ViewError::UnknownLeader(h, n) => {
                write!(f, "hash slot {h} is led by node {n}, not in the cluster")
            }
        }
    }
}

impl std::error::Error for ViewError {}

/// Where a slot id's channels commit and are read: its **home**.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, serde::Serialize, serde::Deserialize)]
pub enum Homes {
    /// `nodes[slot_id % n]` whoever leads the slot's authority (a node alone, or a
    /// cluster without replicas: the channels' messages are on that node only).
    #[default]
    Static,
    /// The slot's leader in the view, which is its replicated group's leader
    /// (`[cluster] replicas` above 1): each group's new leader claims its hash
    /// slots at a term above its raft term ([`ClusterView::with_group_leader`]),
    /// so homes and authorities follow the groups' elections.
    Leaders,
}

/// A node's view of the cluster: the leader of every hash slot, the config epoch and
/// the routing revision, the cluster's nodes in config order, and whether homes
/// follow the leaders.
#[derive(Clone, PartialEq, Eq, Debug, serde::Serialize, serde::Deserialize)]
pub struct ClusterView {
    /// The leader of every hash slot, indexed by hash slot (sent as exactly 256
    /// entries on the inter-node wire).
    #[serde(with = "slots_wire")]
    pub slots: [SlotLeader; HASH_SLOTS],
    /// The config epoch every [`Target`] of this view carries (1 from
    /// [`ClusterView::initial`]; [`ClusterView::merge`] keeps the higher).
    pub config_epoch: ConfigEpoch,
    /// The routing revision: freshness evidence carried beside a target, not part of
    /// it (rule 4); advances once per view change and on a join neither side held.
    pub revision: Revision,
    /// The nodes in config order: slot id `i`'s static home is
    /// `nodes[i % nodes.len()]` (never empty).
    pub nodes: Vec<NodeId>,
    /// Whether a slot id's home is static or its leader: the node's own config
    /// decides ([`ClusterView::merge`] keeps this view's, whatever a peer sent).
    #[serde(default)]
    pub homes: Homes,
}

impl ClusterView {
    /// One node leads all 256 hash slots, one slot id per hash slot, term 1 (the view
    /// of a node alone: `initial(&[node_id], 256)`).
    pub fn single_node(node_id: NodeId) -> Self {
        Self::build(&[node_id], MAX_SLOT_IDS)
    }

    /// The view a cluster starts with: the 256 hash slots grouped into `slot_ids`
    /// contiguous ranges ([`slot_id_of`]), slot id `i` led by `nodes[i % n]` at term
    /// 1, config epoch 1, revision 1. Refuses an empty or repeated node list and a
    /// slot id count outside `1..=256`.
    pub fn initial(nodes: &[NodeId], slot_ids: u32) -> Result<Self, ViewError> {
        if nodes.is_empty() {
            return Err(ViewError::NoNodes);
        }
        if slot_ids == 0 || slot_ids > MAX_SLOT_IDS {
            return Err(ViewError::SlotIds(slot_ids));
        }
        for (i, id) in nodes.iter().enumerate() {
            if nodes[..i].contains(id) {
                return Err(ViewError::DuplicateNode(*id));
            }
        }
        Ok(Self::build(nodes, slot_ids))
    }

    /// [`ClusterView::initial`] of inputs already checked.
    fn build(nodes: &[NodeId], slot_ids: u32) -> Self {
        let mut slots = [SlotLeader {
            slot_id: 0,
            leader_node_id: nodes[0],
            leader_term: 1,
            from_node_id: 0,
        }; HASH_SLOTS];
        for (h, s) in slots.iter_mut().enumerate() {
            s.slot_id = slot_id_of(h as HashSlot, slot_ids);
            s.leader_node_id = nodes[s.slot_id as usize % nodes.len()];
        }
        ClusterView {
            slots,
            config_epoch: 1,
            revision: 1,
            nodes: nodes.to_vec(),
            homes: Homes::Static,
        }
    }

    /// This view with its homes following the leaders ([`Homes::Leaders`]).
    pub fn with_homes(mut self, homes: Homes) -> Self {
        self.homes = homes;
        self
    }

    /// Whether this view (from a peer) fits the cluster of `nodes` (config order)
    /// and `slot_ids`: the same node list, every hash slot in its slot id, every
    /// leader a node of the cluster. Only such a view may be installed: the homes,
    /// targets and leaders of every other are meaningless here (an empty node list
    /// has no home at all).
    pub fn check(&self, nodes: &[NodeId], slot_ids: u32) -> Result<(), ViewError> {
        if self.nodes != nodes {
            return Err(ViewError::OtherNodes);
        }
        for (h, s) in self.slots.iter().enumerate() {
            let h = h as HashSlot;
            if s.slot_id != slot_id_of(h, slot_ids) {
                return Err(ViewError::SlotIdOf(h));
            }
            if !nodes.contains(&s.leader_node_id) {
                return Err(ViewError::UnknownLeader(h, s.leader_node_id));
            }
            if s.from_node_id != 0 && !nodes.contains(&s.from_node_id) {
                return Err(ViewError::UnknownLeader(h, s.from_node_id));
            }
        }
        Ok(())
    }

    /// The static home of slot id `slot_id`: `nodes[slot_id % n]` in config order,
    /// whoever leads its authority now: the home under [`Homes::Static`], and the
    /// group's preferred leader under [`Homes::Leaders`].
    #[inline]
    pub fn home_of(&self, slot_id: SlotId) -> NodeId {
        self.nodes[slot_id as usize % self.nodes.len()]
    }

    /// The home of hash slot `hash_slot`: the node that stores its durable data
    /// (its uids' tokens, its channels' subscribers and messages), where its SENDs
    /// commit and its data is read and written: its static home
    /// ([`ClusterView::home_of`] its slot id), or under [`Homes::Leaders`] its
    /// leader in this view.
    #[inline]
    pub fn home_node(&self, hash_slot: HashSlot) -> NodeId {
        let slot = &self.slots[hash_slot as usize];
        match self.homes {
            Homes::Static => self.home_of(slot.slot_id),
            Homes::Leaders => slot.leader_node_id,
        }
    }

    /// This view joined with `other`, a view of the same cluster (checked against
    /// the config where it was decoded): `None` when `other` brings nothing this
    /// view lacks.
    ///
    /// Hash slot by hash slot the leader of the higher term wins (at one term, the
    /// higher node id: two moves of one slot from one term are a race that one
    /// loses, the same one everywhere), so a term never goes back and moves made on
    /// different nodes at once are all kept; the config epoch is the higher. The
    /// revision is the higher of the two, plus one when the join is a view neither
    /// held, so every node that learns both ends on the same view at the same
    /// revision. The join is commutative, associative and idempotent on the slots:
    /// views spread in any order converge.
    pub fn merge(&self, other: &ClusterView) -> Option<ClusterView> {
        let mut joined = self.clone();
        for (mine, theirs) in joined.slots.iter_mut().zip(&other.slots) {
            if (theirs.leader_term, theirs.leader_node_id) > (mine.leader_term, mine.leader_node_id)
            {
                *mine = *theirs;
            }
        }
        joined.config_epoch = self.config_epoch.max(other.config_epoch);
        let content = |v: &ClusterView| (v.slots, v.config_epoch);
        let new_content = content(&joined) != content(self) && content(&joined) != content(other);
        joined.revision = self.revision.max(other.revision) + Revision::from(new_content);
        (joined != *self).then_some(joined)
    }

    /// The next view with the leadership of each hash slot of `moves` given to its
    /// node, a slot move or a drain made through node `by` (one view change): each
    /// moved hash slot's term advances to [`next_term`], and the routing revision
    /// advances once. Moving a slot to its own leader still advances its term (the
    /// authority rebuilds it).
    ///
    /// `by` must be one of the view's nodes: the term names the node that made the
    /// move, so moves of one slot made at once through two nodes never reach the
    /// same term, and [`ClusterView::merge`] keeps the one of the higher term
    /// everywhere instead of dropping one of two equal ones.
    pub fn with_leaders(&self, by: NodeId, moves: &[(HashSlot, NodeId)]) -> ClusterView {
        let rank = self.nodes.iter().position(|&n| n == by);
        assert!(rank.is_some(), "node {by} moves slots of a view without it");
        let (rank, n) = (rank.unwrap_or(0) as Term, self.nodes.len() as Term);
        let mut view = self.clone();
        for &(h, leader_node_id) in moves {
            let slot = &mut view.slots[h as usize];
            slot.from_node_id = slot.leader_node_id;
            slot.leader_node_id = leader_node_id;
            slot.leader_term = next_term(slot.leader_term, rank, n);
        }
        view.revision += 1;
        view
    }

    /// This view with slot id `slot_id` claimed by `leader`, elected leader of its
    /// replicated group in raft term `raft_term` (under [`Homes::Leaders`]): each of
    /// its hash slots at a term below [`group_term`]`(raft_term)` gets `leader` at
    /// that term (moved from its leader here) and the revision advances once;
    /// `None` when no hash slot changes (an older or repeated claim). Raft elects
    /// at most one leader per term, so two claims never meet at one term, and
    /// [`ClusterView::merge`] spreads the newest everywhere.
    pub fn with_group_leader(
        &self,
        slot_id: SlotId,
        leader: NodeId,
        raft_term: Term,
    ) -> Option<ClusterView> {
        let term = group_term(raft_term);
        let mut view = self.clone();
        let mut changed = false;
        for slot in view.slots.iter_mut() {
            if slot.slot_id == slot_id && slot.leader_term < term {
                slot.from_node_id = slot.leader_node_id;
                slot.leader_node_id = leader;
                slot.leader_term = term;
                changed = true;
            }
        }
        view.revision += Revision::from(changed);
        changed.then_some(view)
    }

    /// The moves that drain node `me`: every hash slot it leads, each slot id (with
    /// all its hash slots) given to the next node of `to` round robin, in slot id
    /// order of first appearance. Empty when `me` leads nothing or `to` is empty.
    pub fn drain_moves(&self, me: NodeId, to: &[NodeId]) -> Vec<(HashSlot, NodeId)> {
        let mut slot_ids: Vec<SlotId> = Vec::new();
        let mut moves = Vec::new();
        if to.is_empty() {
            return moves;
        }
        for (h, s) in self.slots.iter().enumerate() {
            if s.leader_node_id != me {
                continue;
            }
            let i = match slot_ids.iter().position(|&id| id == s.slot_id) {
                Some(i) => i,
                None => {
                    slot_ids.push(s.slot_id);
                    slot_ids.len() - 1
                }
            };
            moves.push((h as HashSlot, to[i % to.len()]));
        }
        moves
    }

    /// The exact target of hash slot `hash_slot` in this view.
    #[inline]
    pub fn target_for_slot(&self, hash_slot: HashSlot) -> Target {
        let s = &self.slots[hash_slot as usize];
        Target {
            hash_slot,
            slot_id: s.slot_id,
            leader_node_id: s.leader_node_id,
            leader_term: s.leader_term,
            config_epoch: self.config_epoch,
        }
    }

    /// The exact target of `uid`'s hash slot in this view.
    #[inline]
    pub fn target_for_uid(&self, uid: &str) -> Target {
        self.target_for_slot(hash_slot(uid.as_bytes()))
    }
}

/// The view term of a slot whose replicated group elected its leader in raft term
/// `raft_term`: one above it, so every election is above the initial view's term 1
/// (raft's first term is 1). Under [`Homes::Leaders`] only elections make terms (no
/// manual move), so the view's terms follow raft's one for one.
pub fn group_term(raft_term: Term) -> Term {
    raft_term + 1
}

/// The term a move through the node of rank `rank` (its place in the view's node
/// list of `nodes` nodes) gives a slot at term `term`: the lowest term above it that
/// is `rank` modulo `nodes`. A term then names its mover, so two nodes never give
/// one slot the same term, and one node's own moves of a slot only go up. (No move
/// makes term 1, every slot's first: moves make terms above 1.)
pub fn next_term(term: Term, rank: Term, nodes: Term) -> Term {
    debug_assert!(rank < nodes, "rank {rank} of {nodes} nodes");
    let above = term + 1;
    above + (rank + nodes - above % nodes) % nodes
}

/// The 256 slot leaders on the inter-node wire: a sequence of exactly 256.
mod slots_wire {
    use super::{SlotLeader, HASH_SLOTS};
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(
        slots: &[SlotLeader; HASH_SLOTS],
        s: S,
    ) -> Result<S::Ok, S::Error> {
        slots.as_slice().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<[SlotLeader; HASH_SLOTS], D::Error> {
        let v = Vec::<SlotLeader>::deserialize(d)?;
        let n = v.len();
        v.try_into()
            .map_err(|_| serde::de::Error::custom(format!("{n} slot leaders, not {HASH_SLOTS}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_view_is_checked_against_the_cluster() {
        let nodes = [1, 2, 3];
        let view = ClusterView::initial(&nodes, 64).unwrap();
        assert_eq!(view.check(&nodes, 64), Ok(()));
        let mut moved = view.clone();
        moved.slots[9].leader_node_id = 3;
        moved.slots[9].leader_term = 2;
        assert_eq!(moved.check(&nodes, 64), Ok(()), "a move fits");
        assert_eq!(view.check(&nodes, 32), Err(ViewError::SlotIdOf(4)));
        assert_eq!(view.check(&[1, 2], 64), Err(ViewError::OtherNodes));
        assert_eq!(view.check(&[1, 3, 2], 64), Err(ViewError::OtherNodes));
        let mut empty = view.clone();
        empty.nodes.clear();
        assert_eq!(empty.check(&nodes, 64), Err(ViewError::OtherNodes));
        let mut stranger = view.clone();
        stranger.slots[255].leader_node_id = 9;
        assert_eq!(
            stranger.check(&nodes, 64),
            Err(ViewError::UnknownLeader(255, 9))
        );
        let mut shifted = view.clone();
        shifted.slots[255].slot_id = 62;
        assert_eq!(shifted.check(&nodes, 64), Err(ViewError::SlotIdOf(255)));
        // The node a move took the slot from is a node of the cluster too (0: none).
        let from_member = view.with_leaders(1, &[(9, 1)]);
        assert_eq!(from_member.slots[9].from_node_id, 3);
        assert_eq!(from_member.check(&nodes, 64), Ok(()), "moved from node 3");
        let mut from_stranger = from_member;
        from_stranger.slots[9].from_node_id = 9;
        assert_eq!(
            from_stranger.check(&nodes, 64),
            Err(ViewError::UnknownLeader(9, 9))
        );
        for e in [
            ViewError::OtherNodes,
            ViewError::SlotIdOf(4),
            ViewError::UnknownLeader(4, 9),
        ] {
            assert!(!e.to_string().is_empty());
        }
    }

    #[test]
    fn single_node_view_targets_every_slot_on_the_node() {
        let view = ClusterView::single_node(7);
        let t = view.target_for_uid("123456789");
        assert_eq!(
            t,
            Target {
                hash_slot: 0x26,
                slot_id: 0x26,
                leader_node_id: 7,
                leader_term: 1,
                config_epoch: 1
            }
        );
    }
}

#[cfg(test)]
mod initial_view_tests {
    use super::*;

    #[test]
    fn three_nodes_lead_slot_ids_round_robin_in_config_order() {
        let view = ClusterView::initial(&[3, 1, 2], 64).unwrap();
        assert_eq!((view.config_epoch, view.revision), (1, 1));
        for h in 0..HASH_SLOTS as HashSlot {
            let t = view.target_for_slot(h);
            let slot_id = u32::from(h) * 64 / 256;
            assert_eq!(t.slot_id, slot_id, "hash slot {h}");
            assert_eq!(t.leader_node_id, [3, 1, 2][slot_id as usize % 3]);
            assert_eq!(t.leader_term, 1);
            assert_eq!(view.home_node(h), [3, 1, 2][slot_id as usize % 3]);
        }
        assert_eq!(view.home_of(0), 3);
        assert_eq!(view.home_of(4), 1);
        assert_eq!(view.home_of(63), 3);
    }

    /// Any count in 1..=256 gives contiguous, non-empty ranges whose sizes differ by at
    /// most one (`h * slot_ids / 256`).
    #[test]
    fn every_slot_id_count_gives_contiguous_nonempty_ranges() {
        for slot_ids in 1..=256u32 {
            let view = ClusterView::initial(&[1], slot_ids).unwrap();
            let mut sizes = vec![0u32; slot_ids as usize];
            let mut last = 0;
            for s in &view.slots {
                assert!(s.slot_id == last || s.slot_id == last + 1, "{slot_ids}");
                last = s.slot_id;
                sizes[s.slot_id as usize] += 1;
            }
            let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            assert!(*lo >= 1 && hi - lo <= 1, "slot_ids {slot_ids}: {sizes:?}");
        }
    }

    #[test]
    fn one_node_with_256_slot_ids_is_the_single_node_view() {
        assert_eq!(
            ClusterView::initial(&[7], 256).unwrap(),
            ClusterView::single_node(7)
        );
        let one = ClusterView::initial(&[7], 64).unwrap();
        assert!((0..256u16).all(|h| one.target_for_slot(h).leader_node_id == 7));
        assert!((0..256u16).all(|h| one.home_node(h) == 7));
    }

    /// Under `Homes::Leaders` a group's election moves its hash slots' leader and
    /// home; an older or repeated claim
    /// changes nothing; under `Homes::Static` the home stays put.
    #[test]
    fn a_group_leader_claims_its_hash_slots_and_homes_follow_it() {
        let fixed = ClusterView::initial(&[3, 1, 2], 64).unwrap();
        let view = fixed.clone().with_homes(Homes::Leaders);
        // Slot id 4 (hash slots 16..20) is node 1's; node 2 wins raft term 5.
        let won = view.with_group_leader(4, 2, 5).unwrap();
        assert_eq!(won.revision, view.revision + 1);
        for h in 0..HASH_SLOTS as HashSlot {
            let (before, after) = (view.slots[h as usize], won.slots[h as usize]);
            if (16..20).contains(&h) {
                assert_eq!(after.leader_node_id, 2, "hash slot {h}");
                assert_eq!(after.leader_term, group_term(5));
                assert_eq!(after.from_node_id, 1);
                assert_eq!(won.home_node(h), 2);
            } else {
                assert_eq!(after, before, "hash slot {h} is another group's");
                assert_eq!(won.home_node(h), before.leader_node_id);
            }
        }
        assert_eq!(group_term(5), 6, "one above the raft term");
        assert_eq!(won.with_group_leader(4, 2, 5), None, "repeated");
        assert_eq!(won.with_group_leader(4, 3, 4), None, "older");
        let back = won.with_group_leader(4, 1, 6).unwrap();
        assert_eq!(back.slots[16].leader_node_id, 1);
        assert_eq!(back.slots[16].from_node_id, 2);
        // Raft's first term is 1: its claim is above the initial view's term 1.
        let first = view.with_group_leader(0, 3, 1).unwrap();
        assert_eq!(first.slots[0].leader_term, 2);
        assert_eq!(
            first.slots[0].from_node_id, 3,
            "a claim by the leader itself"
        );
        // Static homes stay with the configured order whoever leads.
        let moved = fixed.with_group_leader(4, 2, 5).unwrap();
        assert_eq!(moved.home_node(16), 1);
        assert_eq!(moved.homes, Homes::Static);
        // A view joined with a peer's keeps its own homes.
        assert_eq!(view.merge(&moved).unwrap().homes, Homes::Leaders);
        assert_eq!(fixed.merge(&won).unwrap().homes, Homes::Static);
    }

    #[test]
    fn bad_inputs_are_refused_with_a_reason() {
        let e = ClusterView::initial(&[], 64).unwrap_err();
        assert_eq!(e, ViewError::NoNodes);
        let e = ClusterView::initial(&[1], 0).unwrap_err();
        assert!(e.to_string().contains("slot_ids = 0"), "{e}");
        let e = ClusterView::initial(&[1], 257).unwrap_err();
        assert!(e.to_string().contains("1..=256"), "{e}");
        let e = ClusterView::initial(&[1, 2, 1], 64).unwrap_err();
        assert_eq!(e, ViewError::DuplicateNode(1));
        assert!(e.to_string().contains("node id 1 is listed twice"), "{e}");
    }
}

#[cfg(test)]
mod move_tests {
    use super::*;

    #[test]
    fn a_move_advances_the_moved_terms_and_the_revision_once() {
        let view = ClusterView::initial(&[1, 2, 3], 3).unwrap();
        let moved = view.with_leaders(1, &[(0, 2), (200, 2), (201, 1)]);
        assert_eq!(moved.revision, view.revision + 1);
        assert_eq!(moved.config_epoch, view.config_epoch);
        for h in 0..HASH_SLOTS {
            let (before, after) = (view.slots[h], moved.slots[h]);
            assert_eq!(after.slot_id, before.slot_id, "hash slot {h}");
            match h {
                // Node 1, first of three, moves: the term above 1 that is 0 mod 3.
                0 | 200 => assert_eq!((after.leader_node_id, after.leader_term), (2, 3)),
                201 => assert_eq!((after.leader_node_id, after.leader_term), (1, 3)),
                _ => assert_eq!(after, before, "hash slot {h} did not move"),
            }
        }
        assert_eq!(view.merge(&moved), Some(moved.clone()), "a move spreads");
        // A move to the current leader is a move too: its term advances.
        let again = moved.with_leaders(1, &[(0, 2)]);
        assert_eq!(again.slots[0].leader_term, 6);
        assert_eq!(again.revision, view.revision + 2);
    }

    #[test]
    fn a_drain_gives_each_slot_id_whole_to_the_next_peer_round_robin() {
        // 6 slot ids over 2 nodes: node 1 leads slot ids 0, 2, 4.
        let view = ClusterView::initial(&[1, 2], 6).unwrap();
        let moves = view.drain_moves(1, &[2, 5, 7]);
        let led: Vec<HashSlot> = (0..HASH_SLOTS as HashSlot)
            .filter(|&h| view.slots[h as usize].leader_node_id == 1)
            .collect();
        assert_eq!(moves.iter().map(|m| m.0).collect::<Vec<_>>(), led);
        for &(h, to) in &moves {
            let slot_id = view.slots[h as usize].slot_id;
            let expected = match slot_id {
                0 => 2,
                2 => 5,
                4 => 7,
                other => panic!("slot id {other} is not node 1's"),
            };
            assert_eq!(to, expected, "hash slot {h} of slot id {slot_id}");
        }
        assert!(view.drain_moves(1, &[]).is_empty());
        assert!(view.drain_moves(7, &[2]).is_empty(), "node 7 leads nothing");
        let drained = view.with_leaders(1, &moves);
        assert!(drained.slots.iter().all(|s| s.leader_node_id != 1));
    }
}

#[cfg(test)]
mod merge_tests {
    use super::*;

    fn base() -> ClusterView {
        ClusterView::initial(&[1, 2, 3], 8).unwrap()
    }

    #[test]
    fn two_moves_made_at_one_revision_through_two_nodes_both_survive() {
        let (a, b) = (
            base().with_leaders(1, &[(1, 2)]),
            base().with_leaders(1, &[(100, 3)]),
        );
        assert_eq!(a.revision, b.revision);
        let at_a = a.merge(&b).expect("b brings its move");
        let at_b = b.merge(&a).expect("a brings its move");
        for m in [&at_a, &at_b] {
            assert_eq!(m.slots[1], a.slots[1]);
            assert_eq!(m.slots[100], b.slots[100]);
            assert!(m.revision > a.revision, "a new view: both moves");
        }
        assert_eq!(at_a, at_b, "both nodes end on the same view");
        assert_eq!(at_a.merge(&at_b), None, "nothing more to learn");
        assert_eq!(at_a.merge(&a), None);
    }

    #[test]
    fn a_term_never_goes_back_whatever_the_revision() {
        // Node A moved hash slot 1 twice (term 3); node B, which missed that, moved
        // hash slot 2 three times: a higher revision with an older term for slot 1.
        let a = base().with_leaders(1, &[(1, 2)]).with_leaders(1, &[(1, 3)]);
        let b = base()
            .with_leaders(1, &[(2, 2)])
            .with_leaders(1, &[(2, 3)])
            .with_leaders(1, &[(2, 1)]);
        assert!(b.revision > a.revision);
        let m = a.merge(&b).expect("b brings slot 2's moves");
        assert_eq!((m.slots[1].leader_node_id, m.slots[1].leader_term), (3, 6));
        assert_eq!((m.slots[2].leader_node_id, m.slots[2].leader_term), (1, 9));
        assert!(m.revision >= b.revision);
        let back = b.merge(&a).expect("a brings slot 1's moves");
        assert_eq!(back.slots, m.slots);
        // Slot by slot, every term of the merge is the higher of the two.
        for h in 0..HASH_SLOTS {
            let top = a.slots[h].leader_term.max(b.slots[h].leader_term);
            assert_eq!(m.slots[h].leader_term, top, "hash slot {h}");
        }
    }

    #[test]
    fn an_older_view_brings_nothing_and_a_newer_revision_of_the_same_slots_is_taken() {
        let a = base().with_leaders(1, &[(1, 2)]);
        assert_eq!(a.merge(&base()), None, "older: nothing new");
        let mut same = a.clone();
        same.revision += 3;
        let m = a.merge(&same).expect("the revision moves on");
        assert_eq!((m.slots, m.revision), (a.slots, same.revision));
    }

    /// Issue "Cluster defects found in a review…", item 10 (the drill's finding):
    /// two moves of one slot made at once through two nodes reached the same term,
    /// and the merge dropped one of them after its call had answered 200. Now the
    /// term names the mover: the two differ, the higher wins everywhere, and the
    /// other is superseded (a lower term), never tied.
    #[test]
    fn two_moves_of_one_slot_through_two_nodes_never_share_a_term() {
        for (by_x, by_y) in [(1, 2), (2, 3), (3, 1)] {
            let x = base().with_leaders(by_x, &[(5, 2)]);
            let y = base().with_leaders(by_y, &[(5, 3)]);
            let (tx, ty) = (x.slots[5].leader_term, y.slots[5].leader_term);
            assert_ne!(tx, ty, "moves through nodes {by_x} and {by_y}");
            let at_x = x.merge(&y).unwrap_or_else(|| x.clone());
            let at_y = y.merge(&x).unwrap_or_else(|| y.clone());
            assert_eq!(at_x.slots[5], at_y.slots[5], "one answer everywhere");
            let won = if tx > ty { x.slots[5] } else { y.slots[5] };
            assert_eq!(at_x.slots[5], won, "the higher term wins");
        }
        // Node 2 had already seen node 1's move when node 3 moved from the base:
        // still distinct terms.
        let x = base().with_leaders(1, &[(5, 2)]).with_leaders(2, &[(5, 1)]);
        let y = base().with_leaders(3, &[(5, 3)]);
        assert_ne!(x.slots[5].leader_term, y.slots[5].leader_term);
    }

    #[test]
    fn the_next_term_is_the_lowest_above_that_names_the_mover() {
        for nodes in 1..=7 {
            for term in 0..40 {
                for rank in 0..nodes {
                    let t = next_term(term, rank, nodes);
                    assert!(t > term, "a move's term goes up ({term} -> {t})");
                    assert!(t <= term + nodes, "and by at most the node count");
                    assert_eq!(t % nodes, rank, "the term names its mover");
                }
            }
        }
        // A node alone keeps counting one by one.
        assert_eq!(next_term(1, 0, 1), 2);
        assert_eq!(next_term(2, 0, 1), 3);
    }
}
