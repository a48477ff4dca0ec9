//! The presence filter of one hash slot: a bit array beside the slot's published
//! table that answers "certainly absent" or "maybe" for a uid, so a lookup of a uid
//! with no endpoints (an offline group member) is skipped without probing the table.
//! The table stays the only truth: "maybe" always falls through to the full lookup
//! (a "maybe" that finds nothing is a false positive, counted).
//!
//! # Layout
//! Register-blocked: a uid's [`FILTER_BITS_PER_UID`] bits all lie in one 64-bit
//! word, so a check is one load (one cache line) and an insert one store. The word
//! and the bits come from the high half of the uid's table hash ([`filter_key`]),
//! which every table entry keeps in its key word: the filter is rebuilt from the
//! table without reading any uid's bytes.
//!
//! # Invariant
//! Every uid that has endpoints in the slot's table is covered by the slot's
//! current filter at every instant:
//! - the writer sets a uid's bits (a Release store) *before* it writes the entry
//!   that gives the uid its first endpoint, so a reader that sees the endpoints
//!   sees the bits (the entry write's Release fence orders the bit store before
//!   it; checked by the loom models in `domain/tests/published_loom.rs`);
//! - bits are never cleared in a published filter; a uid that loses its endpoints
//!   keeps its (stale) bits until the filter is rebuilt;
//! - a rebuild (one writer per slot, see `published.rs`) builds a new filter from
//!   the table's entries that have endpoints, then publishes it in place of the old
//!   one (Release); later inserts set bits in the new filter. Between the build and
//!   the swap nothing is written (the single writer is busy building), so the new
//!   filter covers the table when it becomes visible.
//!
//! A reader that loaded the old filter before the swap may miss a uid inserted
//! after it: that lookup began before the insert (the swap precedes the insert in
//! the writer), so not finding it is as if it had read the entry first. A lookup
//! that happens after an insert (any chain of Release/Acquire from the writer's
//! entry write, e.g. the CONNACK that the client answers with a SEND) loads the new
//! filter and its bits.
//!
//! Atomics come from `super::line_sync` (loom's in the loom model, which includes
//! this file).

use super::line_sync::{own_load, AtomicU64, Ordering};

/// Bits set per uid, all in one 64-bit word.
pub(crate) const FILTER_BITS_PER_UID: u32 = 4;

/// Routes the smallest filter is sized for: a slot with few routes is not rebuilt
/// at every second disconnect.
pub(crate) const FILTER_ROUTES_MIN: usize = 64;

/// The part of a uid's table hash the filter uses: its high 32 bits.
#[inline(always)]
pub(crate) fn filter_key(uid_hash: u64) -> u32 {
    (uid_hash >> 32) as u32
}

/// The uid's bits in its word: [`FILTER_BITS_PER_UID`] positions from a
/// multiplicative remix of the key (its high bits depend on every key bit; the
/// word index uses the key's low bits).
#[inline(always)]
fn bits_of(key: u32) -> u64 {
    let m = u64::from(key).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let bits = (1u64 << (m >> 58))
        | (1u64 << ((m >> 52) & 63))
        | (1u64 << ((m >> 46) & 63))
        | (1u64 << ((m >> 40) & 63));
    debug_assert!(bits.count_ones() <= FILTER_BITS_PER_UID);
    bits
}

/// A fixed-size bit array of atomic words; written by the slot's writer only, read
/// by any thread.
pub(crate) struct Filter {
    mask: usize,
    words: Box<[AtomicU64]>,
}

impl Filter {
    /// An empty filter for `routes` routes at `bits_per_route` bits each (at least
    /// [`FILTER_ROUTES_MIN`] routes), its words a power of two, at most
    /// `bits_max / 64` words (at least one).
    pub(crate) fn for_routes(routes: usize, bits_per_route: usize, bits_max: usize) -> Filter {
        let bits = routes
            .max(FILTER_ROUTES_MIN)
            .saturating_mul(bits_per_route.max(1));
        let words_max = (bits_max / 64).max(1);
        // The largest power of two not above `words_max`.
        let words_cap = 1usize << (usize::BITS - 1 - words_max.leading_zeros());
        let words = bits.div_ceil(64).next_power_of_two().min(words_cap);
        Filter {
            mask: words - 1,
            words: (0..words).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Routes this filter was sized for at `bits_per_route` (past it the writer
    /// builds a larger one).
    pub(crate) fn capacity(&self, bits_per_route: usize) -> usize {
        (self.words.len() * 64 / bits_per_route.max(1)).max(1)
    }

    /// Its size in bits.
    pub(crate) fn bits(&self) -> usize {
        self.words.len() * 64
    }

    #[inline(always)]
    fn word(&self, key: u32) -> &AtomicU64 {
        &self.words[key as usize & self.mask]
    }

    /// Sets `key`'s bits (writer only; a Release store, before the table entry
    /// that gives the uid endpoints is written).
    #[inline]
    pub(crate) fn insert(&self, key: u32) {
        let w = self.word(key);
        let bits = bits_of(key);
        let old = own_load(w);
        if old & bits != bits {
            w.store(old | bits, Ordering::Release);
        }
    }

    /// Whether `key` may have endpoints: `false` means certainly none.
    #[inline(always)]
    pub(crate) fn may_contain(&self, key: u32) -> bool {
        let bits = bits_of(key);
        self.word(key).load(Ordering::Relaxed) & bits == bits
    }

    /// The address of `key`'s word, for a prefetch.
    #[inline(always)]
    #[allow(dead_code)]
    pub(crate) fn word_ptr(&self, key: u32) -> *const AtomicU64 {
        self.word(key)
    }

    /// Sets every bit: a filter that says "maybe" to every uid (tests of the
    /// fall-through).
    #[cfg(test)]
    pub(crate) fn fill(&self) {
        for w in self.words.iter() {
            w.store(u64::MAX, Ordering::Relaxed);
        }
    }
}
