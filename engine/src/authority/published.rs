//! The lock-free, epoch-reclaimed view of the directory that lookups read.
//!
//! A [`Directory`] holds one [`crossbeam_epoch::Atomic`] per hash slot, pointing to
//! that slot's [`SlotState`]: its installed [`Target`] plus a hash table from uid to
//! the uid's active endpoints. Only the shard that claimed a hash slot writes its
//! state; any thread reads it without locks.
//!
//! Contract for readers:
//! - A lookup under one pin sees one `SlotState` per hash slot: routes are never
//!   mixed with another identity (an identity change swaps the whole state).
//! - The endpoints of one uid are one immutable, published list: a reader sees the
//!   whole old list or the whole new one. Lookups copy them out (owned snapshots).
//! - Nothing a reader may still see is freed before the reader unpins
//!   (crossbeam-epoch deferred destruction).

use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};

use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned, Shared};
use shard::slots::HASH_SLOTS;

use crate::cluster::Target;
use crate::route::{Endpoint, Uid};

/// FxHash (rustc's hasher): fast for short keys such as uids. Not DoS resistant:
/// uids are authenticated before they reach the authority, and per-uid and per-slot
/// limits bound the damage of collisions.
#[derive(Default, Clone, Copy)]
pub struct FxHasher {
    hash: u64,
}

const FX_SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(FX_SEED);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 56));
        }
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
    /// Mixed (fmix64 of murmur3) so that the low bits, which hash tables use as
    /// the index, depend on every input bit: plain Fx leaves them constant for keys
    /// that differ only in high bytes of their last word.
    #[inline]
    fn finish(&self) -> u64 {
        let mut x = self.hash;
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 33;
        x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        x ^ (x >> 33)
    }
}

/// `BuildHasher` of [`FxHasher`].
pub type FxBuildHasher = BuildHasherDefault<FxHasher>;

/// The well-mixed 64-bit hash of a uid used by the published tables.
#[inline]
pub(crate) fn uid_hash(uid: &str) -> u64 {
    let mut h = FxHasher::default();
    h.write(uid.as_bytes());
    h.finish()
}

/// The active endpoints of one uid, immutable once published.
pub(crate) struct UidRoutes {
    pub(crate) hash: u64,
    pub(crate) uid: Uid,
    pub(crate) endpoints: Box<[Endpoint]>,
}

impl Clone for UidRoutes {
    fn clone(&self) -> Self {
        UidRoutes {
            hash: self.hash,
            uid: self.uid.clone(),
            endpoints: self.endpoints.clone(),
        }
    }
}

/// The uids of one bucket: the first inline (the common case), the rest beside it.
struct Chain {
    first: UidRoutes,
    rest: Box<[UidRoutes]>,
}

impl Chain {
    fn from_vec(mut entries: Vec<UidRoutes>) -> Option<Chain> {
        if entries.is_empty() {
            return None;
        }
        let first = entries.swap_remove(0);
        Some(Chain {
            first,
            rest: entries.into_boxed_slice(),
        })
    }

    fn iter(&self) -> impl Iterator<Item = &UidRoutes> {
        std::iter::once(&self.first).chain(self.rest.iter())
    }
}

/// An open hash table of chains; the bucket array is replaced (not resized in place)
/// when it grows.
struct Table {
    mask: u64,
    buckets: Box<[Atomic<Chain>]>,
}

impl Table {
    fn with_buckets(buckets: usize) -> Table {
        let n = buckets.next_power_of_two().max(1);
        Table {
            mask: n as u64 - 1,
            buckets: (0..n).map(|_| Atomic::null()).collect(),
        }
    }

    #[inline]
    fn bucket(&self, hash: u64) -> &Atomic<Chain> {
        &self.buckets[(hash & self.mask) as usize]
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        for b in self.buckets.iter() {
            // SAFETY: a table is dropped only when unreachable: by deferred destruction
            // after every reader that could see it unpinned, or by its sole owner.
            let guard = unsafe { epoch::unprotected() };
            let p = b.load(Ordering::Relaxed, guard);
            if !p.is_null() {
                // SAFETY: the chain is owned by this (unreachable) table alone.
                drop(unsafe { p.into_owned() });
            }
        }
    }
}

/// The published state of one hash slot: its identity and its routes.
pub(crate) struct SlotState {
    target: Target,
    table: Atomic<Table>,
}

impl Drop for SlotState {
    fn drop(&mut self) {
        // SAFETY: as for `Table::drop`: the state is unreachable when dropped.
        let guard = unsafe { epoch::unprotected() };
        let p = self.table.load(Ordering::Relaxed, guard);
        if !p.is_null() {
            // SAFETY: the table is owned by this (unreachable) state alone.
            drop(unsafe { p.into_owned() });
        }
    }
}

/// The shared, lock-free route directory of all 256 hash slots of one node.
///
/// Written by the [`Authority`](super::Authority) writers that claimed its hash slots
/// (each hash slot by at most one writer), read through
/// [`AuthorityReader`](super::AuthorityReader)s on any thread.
pub struct Directory {
    slots: Box<[Atomic<SlotState>]>,
    claimed: Box<[AtomicBool]>,
    pub(crate) max_lookup_uids: usize,
}

impl Directory {
    pub(crate) fn with_limit(max_lookup_uids: usize) -> Directory {
        Directory {
            slots: (0..HASH_SLOTS).map(|_| Atomic::null()).collect(),
            claimed: (0..HASH_SLOTS).map(|_| AtomicBool::new(false)).collect(),
            max_lookup_uids,
        }
    }

    /// Claims `slot` for one writer; `false` if already claimed.
    pub(crate) fn claim(&self, slot: usize) -> bool {
        !self.claimed[slot].swap(true, Ordering::AcqRel)
    }

    pub(crate) fn release(&self, slot: usize) {
        self.claimed[slot].store(false, Ordering::Release);
    }

    /// The published state of `slot`, `None` when no identity is installed.
    #[inline]
    pub(crate) fn state<'g>(&self, slot: usize, guard: &'g Guard) -> Option<SlotView<'g>> {
        let p = self.slots.get(slot)?.load(Ordering::Acquire, guard);
        // SAFETY: states are published with Release and retired only through
        // `defer_destroy` after being unlinked; `guard` keeps them alive for `'g`.
        let state = unsafe { p.as_ref() }?;
        let t = state.table.load(Ordering::Acquire, guard);
        // SAFETY: same as above for the state's table; it is never null while the
        // state is published (installed with a table; replaced, never nulled).
        let table = unsafe { t.as_ref() }?;
        Some(SlotView {
            target: state.target,
            table,
            guard,
        })
    }

    /// Installs a fresh, empty state with identity `target` for `slot` (writer only).
    pub(crate) fn install(&self, slot: usize, target: Target, initial_buckets: usize) {
        let guard = epoch::pin();
        let new = Owned::new(SlotState {
            target,
            table: Atomic::new(Table::with_buckets(initial_buckets)),
        });
        let old = self.slots[slot].swap(new, Ordering::AcqRel, &guard);
        retire(old, &guard);
    }

    /// Removes the state of `slot` (writer only).
    pub(crate) fn remove(&self, slot: usize) {
        let guard = epoch::pin();
        let old = self.slots[slot].swap(Shared::null(), Ordering::AcqRel, &guard);
        retire(old, &guard);
    }

    /// Publishes `endpoints` as the active endpoints of `uid` in `slot`, or removes
    /// the uid when empty (writer only). `published_uids` is the writer's count of
    /// uids in the slot's table; the table's bucket array doubles when the count
    /// passes twice the bucket count, up to `max_buckets`.
    pub(crate) fn publish(
        &self,
        slot: usize,
        uid: &Uid,
        endpoints: Vec<Endpoint>,
        published_uids: &mut usize,
        max_buckets: usize,
    ) {
        let guard = epoch::pin();
        let sp = self.slots[slot].load(Ordering::Acquire, &guard);
        // SAFETY: the writer that owns `slot` is the only one to replace or retire its
        // state, and it is calling us, so the state is live; the pin keeps it anyway.
        let Some(state) = (unsafe { sp.as_ref() }) else {
            debug_assert!(false, "publish into an uninstalled slot");
            return;
        };
        let tp = state.table.load(Ordering::Acquire, &guard);
        // SAFETY: a published state always holds a live table (see `state`).
        let Some(table) = (unsafe { tp.as_ref() }) else {
            return;
        };
        let hash = uid_hash(uid);
        let bucket = table.bucket(hash);
        let old = bucket.load(Ordering::Acquire, &guard);
        let mut entries: Vec<UidRoutes> = Vec::new();
        let mut existed = false;
        // SAFETY: pinned, and only this writer retires chains of this table.
        if let Some(chain) = unsafe { old.as_ref() } {
            for e in chain.iter() {
                if e.hash == hash && e.uid == *uid {
                    existed = true;
                } else {
                    entries.push(e.clone());
                }
            }
        }
        let inserting = !endpoints.is_empty();
        if inserting {
            entries.push(UidRoutes {
                hash,
                uid: uid.clone(),
                endpoints: endpoints.into_boxed_slice(),
            });
        }
        let new = match Chain::from_vec(entries) {
            Some(c) => Owned::new(c).into_shared(&guard),
            None => Shared::null(),
        };
        bucket.store(new, Ordering::Release);
        retire(old, &guard);
        match (existed, inserting) {
            (false, true) => *published_uids += 1,
            (true, false) => *published_uids -= 1,
            _ => {}
        }
        let n = table.buckets.len();
        if *published_uids > 2 * n && n < max_buckets {
            let bigger = Table::with_buckets((n * 2).min(max_buckets.next_power_of_two()));
            for b in table.buckets.iter() {
                // SAFETY: pinned; only this writer retires these chains.
                if let Some(chain) = unsafe { b.load(Ordering::Acquire, &guard).as_ref() } {
                    for e in chain.iter() {
                        let nb = bigger.bucket(e.hash);
                        let prev = nb.load(Ordering::Relaxed, &guard);
                        let mut v: Vec<UidRoutes> = Vec::new();
                        // SAFETY: `bigger` is not yet published: its chains are ours.
                        if let Some(c) = unsafe { prev.as_ref() } {
                            v.extend(c.iter().cloned());
                        }
                        v.push(e.clone());
                        if let Some(c) = Chain::from_vec(v) {
                            nb.store(Owned::new(c), Ordering::Relaxed);
                        }
                        if !prev.is_null() {
                            // SAFETY: unpublished chain, replaced above, owned by us.
                            drop(unsafe { prev.into_owned() });
                        }
                    }
                }
            }
            let old_table = state
                .table
                .swap(Owned::new(bigger), Ordering::AcqRel, &guard);
            retire(old_table, &guard);
        }
    }
}

/// Uids looked up together, their cache misses overlapped by prefetching.
pub(crate) const LOOKUP_LANES: usize = 16;

/// Hints the CPU to load the cache line at `p`. Never faults, whatever `p` is.
#[inline(always)]
fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: SSE is part of the x86_64 baseline, and a prefetch is only a hint:
        // it does not dereference `p` architecturally and never faults.
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p.cast())
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Defers destruction of an unlinked pointer until no reader can hold it.
fn retire<T>(p: Shared<'_, T>, guard: &Guard) {
    if !p.is_null() {
        // SAFETY: `p` was just unlinked from the only place that published it, so no
        // new reader can load it; readers pinned before may still use it, and
        // `defer_destroy` waits for them. `T: Send` is not required by the API but
        // holds for every type retired here (chains, tables, states).
        unsafe { guard.defer_destroy(p) };
    }
}

impl Drop for Directory {
    fn drop(&mut self) {
        for s in self.slots.iter() {
            // SAFETY: the directory is dropped by its last owner: nothing else can
            // reach its states.
            let guard = unsafe { epoch::unprotected() };
            let p = s.load(Ordering::Relaxed, guard);
            if !p.is_null() {
                // SAFETY: owned by this directory alone (see above).
                drop(unsafe { p.into_owned() });
            }
        }
    }
}

/// One slot's published state, borrowed under a pin.
pub(crate) struct SlotView<'g> {
    pub(crate) target: Target,
    table: &'g Table,
    guard: &'g Guard,
}

impl<'g> SlotView<'g> {
    /// Appends the endpoints of every uid in `uids` to `out`, in input order, each
    /// carrying the caller's `uid` (so readers never write to published cache
    /// lines). Works in lanes of [`LOOKUP_LANES`] uids and prefetches each stage
    /// (bucket, chain, uid bytes and endpoints) for the whole lane before using it,
    /// so the cache misses of different uids overlap.
    pub(crate) fn append_endpoints(&self, uids: &[Uid], out: &mut Vec<Endpoint>) {
        for lane in uids.chunks(LOOKUP_LANES) {
            let mut hashes = [0u64; LOOKUP_LANES];
            let mut chains: [Shared<'g, Chain>; LOOKUP_LANES] = [Shared::null(); LOOKUP_LANES];
            for (k, u) in lane.iter().enumerate() {
                let h = uid_hash(u);
                hashes[k] = h;
                prefetch(self.table.bucket(h) as *const Atomic<Chain>);
            }
            for (k, c) in chains.iter_mut().enumerate().take(lane.len()) {
                *c = self
                    .table
                    .bucket(hashes[k])
                    .load(Ordering::Acquire, self.guard);
                prefetch(c.as_raw());
            }
            for c in chains.iter().take(lane.len()) {
                // SAFETY: chains are published with Release, retired only through
                // `defer_destroy` after being unlinked, and `self.guard` pins the
                // epoch, so a non-null chain loaded under it is valid for `'g`.
                if let Some(chain) = unsafe { c.as_ref() } {
                    prefetch(chain.first.uid.as_ptr());
                    prefetch(chain.first.endpoints.as_ptr());
                }
            }
            for (k, u) in lane.iter().enumerate() {
                // SAFETY: chains are published with Release, retired only through
                // `defer_destroy` after being unlinked, and `self.guard` pins the
                // epoch, so a non-null chain loaded under it is valid for `'g`.
                let Some(chain) = (unsafe { chains[k].as_ref() }) else {
                    continue;
                };
                let h = hashes[k];
                let Some(e) = chain.iter().find(|e| e.hash == h && *e.uid == **u) else {
                    continue;
                };
                out.extend(e.endpoints.iter().map(|e| Endpoint {
                    uid: u.clone(),
                    device_flag: e.device_flag,
                    device_level: e.device_level,
                    node_id: e.node_id,
                    boot_id: e.boot_id,
                    session_id: e.session_id,
                    owner_seq: e.owner_seq,
                }));
            }
        }
    }

    /// Every published uid with its endpoints (diagnostics and tests).
    pub(crate) fn for_each(&self, mut f: impl FnMut(&Uid, &[Endpoint])) {
        for b in self.table.buckets.iter() {
            let c = b.load(Ordering::Acquire, self.guard);
            // SAFETY: as in `append_endpoints`: loaded under `self.guard`, retired
            // only through `defer_destroy`.
            if let Some(chain) = unsafe { c.as_ref() } {
                for e in chain.iter() {
                    f(&e.uid, &e.endpoints);
                }
            }
        }
    }
}
