//! The 256 hash slots and their placement on shards.
//!
//! `hash_slot(key) = crc32_ieee(key) % 256` places every uid and channel key on one of
//! [`HASH_SLOTS`] hash slots. A [`SlotMap`] pins each hash slot to one shard (by default
//! `slot % shard_count`); the authority state and the channel log of a hash slot are
//! written only by that shard.

#![warn(clippy::too_many_lines)] // every function at most 80 code lines (clippy.toml)

/// Number of hash slots. Fixed: it is part of the cluster's placement contract.
pub const HASH_SLOTS: usize = 256;

/// A hash slot number, `0..HASH_SLOTS`.
pub type HashSlot = u16;

/// Index of a shard (core) inside one node's runtime.
pub type ShardId = u16;

/// `crc32_ieee(key) % 256`.
#[inline]
pub fn hash_slot(key: &[u8]) -> HashSlot {
    (crc32fast::hash(key) % HASH_SLOTS as u32) as HashSlot
}

/// Placement of the hash slots on the shards of one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotMap {
    shard_count: u16,
    shard_of: [ShardId; HASH_SLOTS],
}

/// A slot assignment that does not fit the runtime.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SlotMapError {
    /// `shard_count` must be at least 1.
    NoShards,
    /// The assignment names a shard at or above `shard_count`.
    ShardOutOfRange { hash_slot: HashSlot, shard: ShardId },
}

impl std::fmt::Display for SlotMapError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SlotMapError::NoShards => write!(f, "shard count must be at least 1"),
            SlotMapError::ShardOutOfRange { hash_slot, shard } => {
                write!(
                    f,
                    "hash slot {hash_slot} assigned to shard {shard}, which does not exist"
                )
            }
        }
    }
}

impl std::error::Error for SlotMapError {}

impl SlotMap {
    /// The default placement: hash slot `s` on shard `s % shard_count`.
    pub fn modulo(shard_count: u16) -> Result<Self, SlotMapError> {
        if shard_count == 0 {
            return Err(SlotMapError::NoShards);
        }
        let mut shard_of = [0; HASH_SLOTS];
        for (slot, shard) in shard_of.iter_mut().enumerate() {
            *shard = (slot % shard_count as usize) as ShardId;
        }
        Ok(SlotMap {
            shard_count,
            shard_of,
        })
    }

    /// The placement of a cluster whose slot ids are replicated (layout version 3):
    /// hash slot `h` on the shard of its slot id, `(h * slot_ids / 256) %
    /// shard_count`, so a slot id's channels and its replica's raft log share one
    /// shard. `slot_ids` is at least 1 and at most 256.
    pub fn by_slot_id(shard_count: u16, slot_ids: u32) -> Result<Self, SlotMapError> {
        assert!(
            (1..=HASH_SLOTS as u32).contains(&slot_ids),
            "slot ids {slot_ids} out of 1..={HASH_SLOTS}"
        );
        if shard_count == 0 {
            return Err(SlotMapError::NoShards);
        }
        let mut shard_of = [0; HASH_SLOTS];
        for (slot, shard) in shard_of.iter_mut().enumerate() {
            let slot_id = slot as u32 * slot_ids / HASH_SLOTS as u32;
            *shard = (slot_id % u32::from(shard_count)) as ShardId;
        }
        Self::from_assignment(shard_count, shard_of)
    }

    /// An explicit placement (from configuration).
    pub fn from_assignment(
        shard_count: u16,
        shard_of: [ShardId; HASH_SLOTS],
    ) -> Result<Self, SlotMapError> {
        if shard_count == 0 {
            return Err(SlotMapError::NoShards);
        }
        if let Some((slot, &shard)) = shard_of.iter().enumerate().find(|(_, &s)| s >= shard_count) {
            return Err(SlotMapError::ShardOutOfRange {
                hash_slot: slot as HashSlot,
                shard,
            });
        }
        Ok(SlotMap {
            shard_count,
            shard_of,
        })
    }

    /// The shard that owns `slot`.
    #[inline]
    pub fn shard_of(&self, slot: HashSlot) -> ShardId {
        self.shard_of[slot as usize]
    }

    /// The shard that owns `key`'s hash slot.
    #[inline]
    pub fn shard_of_key(&self, key: &[u8]) -> ShardId {
        self.shard_of(hash_slot(key))
    }

    /// Number of shards this map places slots on.
    pub fn shard_count(&self) -> u16 {
        self.shard_count
    }

    /// The hash slots pinned to `shard`, ascending.
    pub fn slots_of(&self, shard: ShardId) -> impl Iterator<Item = HashSlot> + '_ {
        (0..HASH_SLOTS as HashSlot).filter(move |&s| self.shard_of(s) == shard)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_slot_is_crc32_ieee_mod_256() {
        // crc32("123456789") = 0xCBF43926, the standard IEEE check value.
        assert_eq!(crc32fast::hash(b"123456789"), 0xCBF4_3926);
        assert_eq!(hash_slot(b"123456789"), 0x26);
        assert_eq!(hash_slot(b""), 0);
    }

    #[test]
    fn modulo_placement_spreads_slots_evenly() {
        let map = SlotMap::modulo(3).unwrap();
        assert_eq!(map.shard_count(), 3);
        assert_eq!(map.shard_of(0), 0);
        // hash_slot(b"123456789") is 0x26 = 38, on shard 38 % 3.
        assert_eq!(map.shard_of_key(b"123456789"), 2);
        assert_eq!(map.shard_of(4), 1);
        assert_eq!(map.shard_of(255), 0);
        let counts: Vec<usize> = (0..3).map(|s| map.slots_of(s).count()).collect();
        assert_eq!(counts, vec![86, 85, 85]);
    }

    /// By slot id: a slot id's hash slots share one shard, `slot_id %
    /// shard_count`; the slot ids' ranges are contiguous.
    #[test]
    fn slot_id_placement_keeps_a_slot_ids_hash_slots_together() {
        let map = SlotMap::by_slot_id(3, 64).unwrap();
        assert_eq!(map.shard_count(), 3);
        // Slot id 0 holds hash slots 0..4 (shard 0), slot id 1 holds 4..8
        // (shard 1), slot id 2 holds 8..12 (shard 2), slot id 3 holds 12..16
        // (shard 0 again); slot id 63 holds 252..256 (shard 0).
        let shards: Vec<ShardId> = [0, 3, 4, 7, 8, 11, 12, 15, 252, 255]
            .iter()
            .map(|&h| map.shard_of(h))
            .collect();
        assert_eq!(shards, vec![0, 0, 1, 1, 2, 2, 0, 0, 0, 0]);
        let counts: Vec<usize> = (0..3).map(|s| map.slots_of(s).count()).collect();
        assert_eq!(counts, vec![88, 84, 84]);
        // A count that does not divide 256: slot id h * 5 / 256.
        let five = SlotMap::by_slot_id(2, 5).unwrap();
        assert_eq!((five.shard_of(51), five.shard_of(52)), (0, 1));
        assert_eq!(five.shard_of(255), 0);
        assert_eq!(SlotMap::by_slot_id(0, 64), Err(SlotMapError::NoShards));
    }

    /// The errors name the fault (a config check prints them).
    #[test]
    fn errors_display_the_fault() {
        assert_eq!(
            SlotMapError::NoShards.to_string(),
            "shard count must be at least 1"
        );
        assert_eq!(
            SlotMapError::ShardOutOfRange {
                hash_slot: 7,
                shard: 2
            }
            .to_string(),
            "hash slot 7 assigned to shard 2, which does not exist"
        );
    }

    #[test]
    fn bad_assignments_are_refused() {
        assert_eq!(SlotMap::modulo(0), Err(SlotMapError::NoShards));
        let mut a = [0; HASH_SLOTS];
        a[7] = 2;
        assert_eq!(
            SlotMap::from_assignment(2, a),
            Err(SlotMapError::ShardOutOfRange {
                hash_slot: 7,
                shard: 2
            })
        );
        a[7] = 1;
        assert_eq!(SlotMap::from_assignment(2, a).unwrap().shard_of(7), 1);
    }
}
