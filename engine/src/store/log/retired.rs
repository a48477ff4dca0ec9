//! The retired-seq table: the last seqs of channels with no retained message
//! (see the log's module docs, "Retired channels").

use super::*;

/// The retired-seq table (see the module docs): last seqs of channels with no
/// retained message, keyed by a keyed hash, bounded, with high-water floors for what
/// it forgets.
pub(super) struct RetiredSeqs {
    /// SipHash-1-3 key, random per log (kept in the snapshot).
    pub(super) key: (u64, u64),
    pub(super) exact: HashMap<u64, u64>,
    /// The hashes of `exact`, oldest first (its eviction order).
    pub(super) order: VecDeque<u64>,
    pub(super) floors: Vec<u64>,
    pub(super) entries_max: usize,
    /// Entries folded into the floors (their channels' seqs may skip).
    pub(super) folded: u64,
}

impl RetiredSeqs {
    pub(super) fn new(key: (u64, u64), entries_max: usize, buckets: usize) -> Self {
        RetiredSeqs {
            key,
            exact: HashMap::new(),
            order: VecDeque::new(),
            floors: vec![0; buckets],
            entries_max,
            folded: 0,
        }
    }

    pub(super) fn hash(&self, channel_type: u8, channel_id: &str) -> u64 {
        use std::hash::Hasher;
        let mut h = siphasher::sip::SipHasher13::new_with_keys(self.key.0, self.key.1);
        h.write_u8(channel_type);
        h.write(channel_id.as_bytes());
        h.finish()
    }

    pub(super) fn bucket(&self, hash: u64) -> usize {
        (hash % self.floors.len() as u64) as usize
    }

    /// The last seq a channel outside the index continues from (0: none known).
    pub(super) fn last_seq(&self, hash: u64) -> u64 {
        let exact = self.exact.get(&hash).copied().unwrap_or(0);
        exact.max(self.floors[self.bucket(hash)])
    }

    /// Remembers a channel's last seq (keeping the larger one), folding the oldest
    /// entries beyond `entries_max` into the floors.
    pub(super) fn record(&mut self, hash: u64, last_seq: u64) {
        match self.exact.entry(hash) {
            std::collections::hash_map::Entry::Occupied(mut e) => {
                let v = e.get_mut();
                *v = (*v).max(last_seq);
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(last_seq);
                self.order.push_back(hash);
            }
        }
        while self.exact.len() > self.entries_max {
            let old = self.order.pop_front().expect("order lists every entry");
            let seq = self.exact.remove(&old).expect("order lists only entries");
            let b = self.bucket(old);
            self.floors[b] = self.floors[b].max(seq);
            self.folded += 1;
        }
        debug_assert_eq!(self.exact.len(), self.order.len());
    }

    /// `magic ‖ key 2×u64 ‖ count u64 ‖ count × (hash u64 ‖ last_seq u64), oldest
    /// first ‖ buckets u64 ‖ buckets × floor u64 ‖ crc32`, little-endian.
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(40 + 16 * self.order.len() + 8 * self.floors.len());
        out.extend_from_slice(&RETIRED_SNAPSHOT_MAGIC.to_le_bytes());
        for v in [self.key.0, self.key.1, self.order.len() as u64] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for h in &self.order {
            out.extend_from_slice(&h.to_le_bytes());
            out.extend_from_slice(&self.exact[h].to_le_bytes());
        }
        out.extend_from_slice(&(self.floors.len() as u64).to_le_bytes());
        for f in &self.floors {
            out.extend_from_slice(&f.to_le_bytes());
        }
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// Loads a format-2 snapshot under this config's bounds. When the bucket count
    /// changed, every floor becomes the largest old floor (safe: nothing goes back).
    pub(super) fn decode(bytes: &[u8], entries_max: usize, buckets: usize) -> Option<RetiredSeqs> {
        let (body, crc) = bytes.split_at(bytes.len().checked_sub(4)?);
        if crc32fast::hash(body) != u32::from_le_bytes(crc.try_into().ok()?) {
            return None;
        }
        let u64_at = |at: usize| -> Option<u64> {
            Some(u64::from_le_bytes(body.get(at..at + 8)?.try_into().ok()?))
        };
        if u32::from_le_bytes(body.get(..4)?.try_into().ok()?) != RETIRED_SNAPSHOT_MAGIC {
            return None;
        }
        let mut t = RetiredSeqs::new((u64_at(4)?, u64_at(12)?), entries_max, buckets);
        let count = usize::try_from(u64_at(20)?).ok()?;
        let mut at = 28usize;
        if count > body.len() / 16 {
            return None;
        }
        let mut entries = Vec::with_capacity(count);
        for _ in 0..count {
            entries.push((u64_at(at)?, u64_at(at + 8)?));
            at += 16;
        }
        let n = usize::try_from(u64_at(at)?).ok()?;
        at += 8;
        if n == 0 || body.len() != at.checked_add(n.checked_mul(8)?)? {
            return None;
        }
        let old: Vec<u64> = (0..n).map(|i| u64_at(at + 8 * i)).collect::<Option<_>>()?;
        if n == buckets {
            t.floors = old;
        } else {
            let top = old.iter().copied().max().unwrap_or(0);
            t.floors.fill(top);
        }
        for (h, seq) in entries {
            t.record(h, seq);
        }
        Some(t)
    }
}
