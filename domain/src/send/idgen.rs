//! Cluster-unique message ids: positive `i64` snowflakes. Time is passed in; the
//! generator never reads a clock.
//!
//! # Bit layout (most significant first)
//!
//! ```text
//!  63   62 ........ 22   21 ...... 12   11 ........... 0
//! [ 0 ][ ms, 41 bits ][ node, 10 bits ][ shard | seq, 12 bits ]
//! ```
//!
//! - bit 63 is 0: ids are positive `i64`s (WuKongIM's type);
//! - 41 bits of milliseconds since [`ID_EPOCH_MS`] (2024-01-01), enough until 2093;
//! - 10 bits of node id: up to [`MAX_NODE_IDS`] = 1024 nodes per cluster;
//! - 12 bits shared by the shard index and a per-millisecond sequence: the shard
//!   takes the top `shard_bits = ceil(log2(shard_count))` of them (0 for one shard,
//!   8 for [`MAX_SHARDS`] = 256 shards), the sequence the other `12 - shard_bits`.
//!   A node therefore issues up to 4096 ids per millisecond whatever its shard
//!   count (2048 per shard with 2 shards, 16 per shard with 256).
//!
//! Ids of two generators with different `(node, shard)` differ in the node or the
//! shard bits, so they never collide (one node uses one `shard_count`: the data dir
//! records it, see `store::layout`). Ids of one generator strictly increase: when
//! the clock steps back or a millisecond's sequence is used up, the generator keeps
//! counting from its own last millisecond (it borrows the next one). A restart
//! resumes after the newest id in the log ([`MessageIdGen::resume_after`]), so ids of
//! a channel (which lives on one shard) increase across restarts too, even when the
//! wall clock went backwards meanwhile.

/// 2024-01-01T00:00:00Z in Unix milliseconds: ids count from here.
pub const ID_EPOCH_MS: u64 = 1_704_067_200_000;
/// Node ids must be below this (10 bits).
pub const MAX_NODE_IDS: u64 = 1 << NODE_BITS;
/// Shard counts up to this are supported (8 of the 12 low bits); the hash slots
/// (256) bound the useful shard count anyway.
pub const MAX_SHARDS: usize = 1 << 8;
const NODE_BITS: u32 = 10;
const LOW_BITS: u32 = 12;
const TIME_BITS: u32 = 63 - NODE_BITS - LOW_BITS;

/// Makes strictly increasing, positive message ids for one shard of one node.
/// Contract:
/// - ids from one generator strictly increase, even when `now_ms` goes backwards
///   or more ids are asked within one millisecond than its sequence holds;
/// - ids of generators with different `(node_id, shard)` (same `shard_count`) never
///   collide;
/// - the top bit is never set until 2^41 ms (~69 years) after [`ID_EPOCH_MS`]; past
///   that, [`MessageIdGen::next_id`] returns `None`.
#[derive(Clone, Debug)]
pub struct MessageIdGen {
    /// `node << 12 | shard << seq_bits`: the fixed low bits of every id.
    fixed: u64,
    seq_bits: u32,
    last_ms: u64,
    seq: u64,
}

/// `ceil(log2(n))` for `n >= 1`.
fn bits_for(n: usize) -> u32 {
    usize::BITS - (n.max(1) - 1).leading_zeros()
}

impl MessageIdGen {
    /// The generator of shard `shard` of `shard_count` on node `node_id`. `None` when
    /// `node_id >= MAX_NODE_IDS`, `shard_count` is 0 or above [`MAX_SHARDS`], or
    /// `shard >= shard_count`.
    pub fn new(node_id: u64, shard: usize, shard_count: usize) -> Option<MessageIdGen> {
        if node_id >= MAX_NODE_IDS || shard_count == 0 || shard_count > MAX_SHARDS {
            return None;
        }
        if shard >= shard_count {
            return None;
        }
        let seq_bits = LOW_BITS - bits_for(shard_count);
        Some(MessageIdGen {
            fixed: (node_id << LOW_BITS) | ((shard as u64) << seq_bits),
            seq_bits,
            last_ms: 0,
            seq: 0,
        })
    }

    /// Continues after `last_id` (the newest id this shard ever issued, e.g. found
    /// in its log at start): every later id is greater, whatever the clock says.
    pub fn resume_after(&mut self, last_id: i64) {
        if last_id <= 0 {
            return;
        }
        let id = last_id as u64;
        let ms = id >> (NODE_BITS + LOW_BITS);
        let seq = id & ((1 << self.seq_bits) - 1);
        if (ms, seq) > (self.last_ms, self.seq) {
            self.last_ms = ms;
            self.seq = seq;
        }
    }

    /// The next id at Unix time `now_ms`.
    pub fn next_id(&mut self, now_ms: u64) -> Option<i64> {
        let now = now_ms.saturating_sub(ID_EPOCH_MS);
        let seq_max = (1u64 << self.seq_bits) - 1;
        if now > self.last_ms {
            self.last_ms = now;
            self.seq = 0;
        } else if self.seq < seq_max {
            self.seq += 1;
        } else {
            self.last_ms += 1;
            self.seq = 0;
        }
        if self.last_ms >> TIME_BITS != 0 {
            return None;
        }
        let id = (self.last_ms << (NODE_BITS + LOW_BITS)) | self.fixed | self.seq;
        Some(id as i64)
    }

    /// The node id an id was made by.
    pub fn node_of(id: i64) -> u64 {
        ((id as u64) >> LOW_BITS) & (MAX_NODE_IDS - 1)
    }

    /// The shard (of `shard_count`) an id was made by.
    pub fn shard_of(id: i64, shard_count: usize) -> usize {
        let shard_bits = bits_for(shard_count);
        ((id as u64 & ((1 << LOW_BITS) - 1)) >> (LOW_BITS - shard_bits)) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_increase_across_bursts_and_clock_steps_back() {
        for shards in [1usize, 2, 3, 256] {
            let mut g = MessageIdGen::new(7, shards - 1, shards).unwrap();
            let t = ID_EPOCH_MS + 1_000;
            let mut last = 0i64;
            for i in 0..10_000u64 {
                // a burst of more than a millisecond's sequence, then the clock
                // steps back
                let now = if i < 9_000 { t } else { t - 500 };
                let id = g.next_id(now).unwrap();
                assert!(id > last, "shards={shards} i={i}");
                assert_eq!(MessageIdGen::node_of(id), 7);
                assert_eq!(MessageIdGen::shard_of(id, shards), shards - 1);
                last = id;
            }
        }
        assert!(MessageIdGen::new(MAX_NODE_IDS, 0, 1).is_none());
        assert!(MessageIdGen::new(1, 0, 0).is_none());
        assert!(MessageIdGen::new(1, 2, 2).is_none());
        assert!(MessageIdGen::new(1, 0, MAX_SHARDS + 1).is_none());
        let mut end = MessageIdGen::new(1, 0, 1).unwrap();
        assert!(end.next_id(ID_EPOCH_MS + (1 << TIME_BITS)).is_none());
        assert!(end.next_id(ID_EPOCH_MS + (1 << TIME_BITS) - 1).is_none());
        let mut ok = MessageIdGen::new(MAX_NODE_IDS - 1, 255, 256).unwrap();
        assert!(ok.next_id(ID_EPOCH_MS + (1 << TIME_BITS) - 1).unwrap() > 0);
    }

    /// Every (node, shard) pair of a cluster, all in the same milliseconds, bursts
    /// past their sequences included: no id twice.
    #[test]
    fn no_two_generators_share_an_id() {
        let t = ID_EPOCH_MS + 5_000;
        for shards in [1usize, 2, 5, 256] {
            let mut seen = std::collections::HashSet::new();
            for node in [0u64, 1, 512, MAX_NODE_IDS - 1] {
                for shard in 0..shards {
                    let mut g = MessageIdGen::new(node, shard, shards).unwrap();
                    for k in 0..40u64 {
                        let id = g.next_id(t + k / 20).unwrap();
                        assert!(seen.insert(id), "node {node} shard {shard}/{shards}");
                    }
                }
            }
        }
    }

    /// A millisecond holds 2^(12 - ceil(log2(shard_count))) ids of one shard; the
    /// next one borrows the next millisecond. The fields sit where the layout says.
    #[test]
    fn a_millisecond_holds_the_sequence_its_shard_bits_leave() {
        let t = ID_EPOCH_MS + 77;
        let ms = |id: i64| (id as u64) >> (NODE_BITS + LOW_BITS);
        for (shards, per_ms) in [(1usize, 4096), (2, 2048), (3, 1024), (4, 1024), (5, 512)] {
            let mut g = MessageIdGen::new(5, shards - 1, shards).unwrap();
            let ids: Vec<i64> = (0..=per_ms).map(|_| g.next_id(t).unwrap()).collect();
            assert!(ids[..per_ms].iter().all(|&id| ms(id) == 77), "{shards}");
            assert_eq!(ids[per_ms - 1] - ids[0], per_ms as i64 - 1, "{shards}");
            assert_eq!(ms(ids[per_ms]), 78, "{shards}: borrows the next ms");
        }
        let mut g = MessageIdGen::new(5, 1, 2).unwrap();
        assert_eq!(g.next_id(t), Some((77 << 22) | (5 << 12) | (1 << 11)));
        let mut g = MessageIdGen::new(5, 255, 256).unwrap();
        assert_eq!(g.next_id(t), Some((77 << 22) | (5 << 12) | (255 << 4)));
        assert_eq!(g.next_id(t), Some((77 << 22) | (5 << 12) | (255 << 4) | 1));
    }

    /// A restarted generator continues at the very next id of the one it resumes
    /// after (same millisecond, next sequence), the clock being behind.
    #[test]
    fn resuming_continues_at_the_next_sequence_number() {
        let t = ID_EPOCH_MS + 10_000;
        for (shard, shards) in [(0usize, 1usize), (1, 2), (2, 3)] {
            let mut before = MessageIdGen::new(9, shard, shards).unwrap();
            let mut last = 0;
            for _ in 0..100 {
                last = before.next_id(t).unwrap();
            }
            let mut after = MessageIdGen::new(9, shard, shards).unwrap();
            after.resume_after(last);
            assert_eq!(after.next_id(t - 1_000), Some(last + 1), "{shard}/{shards}");
        }
    }

    #[test]
    fn resuming_after_a_restart_with_the_clock_behind_keeps_ids_increasing() {
        let t = ID_EPOCH_MS + 10_000_000;
        let mut before = MessageIdGen::new(3, 1, 2).unwrap();
        let mut last = 0;
        for _ in 0..5_000 {
            last = before.next_id(t).unwrap();
        }
        // restart; the wall clock is now an hour behind
        let mut after = MessageIdGen::new(3, 1, 2).unwrap();
        after.resume_after(last);
        let next = after.next_id(t - 3_600_000).unwrap();
        assert!(next > last);
        assert_eq!(MessageIdGen::shard_of(next, 2), 1);
        // an id from the past does not move it back
        after.resume_after(1);
        assert!(after.next_id(t - 3_600_000).unwrap() > next);
    }
}
