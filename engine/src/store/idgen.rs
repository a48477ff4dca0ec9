//! Cluster-unique message ids: a snowflake-like `i64` made of milliseconds since
//! [`ID_EPOCH_MS`] (41 bits), the node id (10 bits) and a per-millisecond sequence
//! (12 bits). Time is passed in; the generator never reads a clock.

/// 2024-01-01T00:00:00Z in Unix milliseconds: ids count from here.
pub const ID_EPOCH_MS: u64 = 1_704_067_200_000;
/// Node ids must be below this (10 bits).
pub const MAX_NODE_IDS: u64 = 1 << NODE_BITS;
const NODE_BITS: u32 = 10;
const SEQ_BITS: u32 = 12;
const SEQ_MAX: u16 = (1 << SEQ_BITS) - 1;
const TIME_BITS: u32 = 63 - NODE_BITS - SEQ_BITS;

/// Makes strictly increasing, positive message ids for one node (one generator per
/// node, or per shard with distinct node ids). Contract:
/// - ids from one generator strictly increase, even when `now_ms` goes backwards
///   (the generator keeps using its own last millisecond) or more than 4096 ids are
///   asked within one millisecond (it borrows the next millisecond);
/// - ids of generators with different node ids never collide;
/// - the top bit is never set (ids are positive `i64`s) until 2^41 ms (~69 years)
///   after [`ID_EPOCH_MS`]; past that, [`MessageIdGen::next_id`] returns `None`.
#[derive(Clone, Debug)]
pub struct MessageIdGen {
    node_id: u64,
    last_ms: u64,
    seq: u16,
}

impl MessageIdGen {
    /// `None` when `node_id >= MAX_NODE_IDS`.
    pub fn new(node_id: u64) -> Option<MessageIdGen> {
        (node_id < MAX_NODE_IDS).then_some(MessageIdGen {
            node_id,
            last_ms: 0,
            seq: 0,
        })
    }

    /// The next id at Unix time `now_ms`.
    pub fn next_id(&mut self, now_ms: u64) -> Option<i64> {
        let now = now_ms.saturating_sub(ID_EPOCH_MS);
        if now > self.last_ms {
            self.last_ms = now;
            self.seq = 0;
        } else if self.seq < SEQ_MAX {
            self.seq += 1;
        } else {
            self.last_ms += 1;
            self.seq = 0;
        }
        if self.last_ms >> TIME_BITS != 0 {
            return None;
        }
        let id = (self.last_ms << (NODE_BITS + SEQ_BITS))
            | (self.node_id << SEQ_BITS)
            | u64::from(self.seq);
        Some(id as i64)
    }

    /// The node id an id was made by.
    pub fn node_of(id: i64) -> u64 {
        ((id as u64) >> SEQ_BITS) & (MAX_NODE_IDS - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_increase_across_bursts_and_clock_steps_back() {
        let mut g = MessageIdGen::new(7).unwrap();
        let t = ID_EPOCH_MS + 1_000;
        let mut last = 0i64;
        for i in 0..10_000u64 {
            // a burst of >4096 in one ms, then the clock steps back
            let now = if i < 9_000 { t } else { t - 500 };
            let id = g.next_id(now).unwrap();
            assert!(id > last, "i={i}");
            assert_eq!(MessageIdGen::node_of(id), 7);
            last = id;
        }
        let mut other = MessageIdGen::new(8).unwrap();
        assert_ne!(
            other.next_id(t).unwrap(),
            MessageIdGen::new(7).unwrap().next_id(t).unwrap()
        );
        assert!(MessageIdGen::new(MAX_NODE_IDS).is_none());
        let mut end = MessageIdGen::new(1).unwrap();
        assert!(end.next_id(ID_EPOCH_MS + (1 << TIME_BITS)).is_none());
        assert!(end.next_id(ID_EPOCH_MS + (1 << TIME_BITS) - 1).is_none());
        let mut ok = MessageIdGen::new(1).unwrap();
        assert!(ok.next_id(ID_EPOCH_MS + (1 << TIME_BITS) - 1).unwrap() > 0);
    }
}
