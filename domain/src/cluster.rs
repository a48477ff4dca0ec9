//! The cluster view and the exact target every authority operation carries.
//!
//! A node accepts an authority call for a hash slot only if the call's [`Target`] is
//! exactly the identity it has installed for that slot (rule 1). The routing
//! `revision` travels beside the target as freshness evidence, not as part of it: a
//! revision-only change keeps the directory (rule 4).
//!
//! Rule numbers refer to `docs/authority-rules.md` (each tested in
//! `domain/tests/authority_rules.rs` or `activation_rules.rs`).

use shard::slots::{hash_slot, HASH_SLOTS};

pub use shard::slots::HashSlot;

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
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Target {
    pub hash_slot: HashSlot,
    pub slot_id: SlotId,
    pub leader_node_id: NodeId,
    pub leader_term: Term,
    pub config_epoch: ConfigEpoch,
}

/// Who leads one hash slot, as a cluster view says.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct SlotLeader {
    pub slot_id: SlotId,
    pub leader_node_id: NodeId,
    pub leader_term: Term,
}

/// A node's view of the cluster: the leader of every hash slot, the config epoch and
/// the routing revision.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ClusterView {
    pub slots: [SlotLeader; HASH_SLOTS],
    pub config_epoch: ConfigEpoch,
    pub revision: Revision,
}

impl ClusterView {
    /// One node leads all 256 hash slots, one slot id per hash slot, term 1.
    pub fn single_node(node_id: NodeId) -> Self {
        let mut slots = [SlotLeader {
            slot_id: 0,
            leader_node_id: node_id,
            leader_term: 1,
        }; HASH_SLOTS];
        for (i, s) in slots.iter_mut().enumerate() {
            s.slot_id = i as SlotId;
        }
        ClusterView {
            slots,
            config_epoch: 1,
            revision: 1,
        }
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

#[cfg(test)]
mod tests {
    use super::*;

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
