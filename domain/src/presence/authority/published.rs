//! The lock-free, epoch-reclaimed view of the directory that lookups read.
//!
//! A [`Directory`] holds one [`crossbeam_epoch::Atomic`] per hash slot, pointing to
//! that slot's [`SlotState`]: its installed [`Target`] plus an open-addressing table
//! from uid to the uid's active endpoints. Only the shard that claimed a hash slot
//! writes its state ([`TableWriter`]); any thread reads it without locks.
//!
//! # One cache line per uid
//! An entry of a table is a 64-byte line of eight words: a version, the key (high
//! half of the uid's hash and the uid's length), a pointer to the uid's bytes (the
//! entry owns one count of the uid's `Arc`), and the uid's endpoints: the only one
//! inline when the uid has exactly one, else a pointer to an immutable list. A lookup
//! of a uid with one device reads one line of the table, plus the uid's bytes when
//! the caller's `Arc` is not the published one. Linear probing; at most 3/4 of the
//! entries are ever used. An entry is never emptied: a uid without endpoints keeps
//! its entry with count 0 (readers find "no endpoint"), and once the writer forgets
//! the uid the entry may be reused for another uid, so probe chains never break.
//! When the used entries reach the limit, the writer builds a new table (sized for
//! the uids that have endpoints) and swaps it in.
//!
//! # Writing in place, lock-free for readers
//! The writer updates an entry in place: it first copies the entry's current value
//! into the table's single *backup line* (tagged with the entry and its version),
//! then makes the entry's version odd, writes the value, and makes the version even
//! again. A reader that sees an even version reads the value and checks the version
//! did not move (a seqlock read); a reader that sees an odd version (a write in
//! progress) takes the previous value from the backup line instead of waiting. So a
//! reader never waits for the writer, even for one preempted in the middle of a
//! write, and it retries only when the writer completed a write meanwhile
//! (lock-free). Every word is an atomic: a torn read is detected, never undefined.
//! The protocol is `seqline` (a version and a backup line per table), checked by
//! loom models (`tests/published_loom.rs`) and, with the reclamation, by miri
//! (`.ci/run`).
//!
//! Contract for readers:
//! - A lookup under one pin sees one `SlotState` per hash slot: routes are never
//!   mixed with another identity (an identity change swaps the whole state).
//! - The endpoints of one uid are one value: a reader sees the whole old value or
//!   the whole new one. Lookups copy them out (owned snapshots).
//! - Nothing a reader may still see (tables, uid `Arc`s, endpoint lists) is freed
//!   before the reader unpins (crossbeam-epoch deferred destruction).

use std::hash::{BuildHasherDefault, Hasher};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned, Shared};
use slots::HASH_SLOTS;

use super::huge::{HugeBox, HugePages};
use super::presence::{filter_key, Filter};
use super::seqline::{Line, Lines};
use crate::cluster::Target;
use crate::presence::route::{CompactEndpoint, DeviceLevel, Uid};

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
    uid_hash_bytes(uid.as_bytes())
}

#[inline]
fn uid_hash_bytes(uid: &[u8]) -> u64 {
    let mut h = FxHasher::default();
    h.write(uid);
    h.finish()
}

/// "No entry" / "no user" in the writer's index maps.
pub(crate) const NIL: u32 = u32::MAX;

/// Longest uid a table can hold (the key keeps its length in 32 bits). Uids are
/// bounded far below this by the protocol's frame limit.
pub(crate) const UID_BYTES_MAX: usize = u32::MAX as usize;

/// Entries of the smallest table (used limit 3).
const TABLE_ENTRIES_MIN: usize = 4;

/// Words of an entry (one 64-byte cache line): word 0 is the version (odd while
/// the writer writes the entry, see `seqline`), then the value.
const WORDS: usize = 8;
/// High 32 bits of the uid's hash, uid length in the low 32 bits.
const W_KEY: usize = 1;
/// Address of the uid's bytes (of an `Arc<str>` the entry owns one count of); 0 in
/// an entry never used.
const W_UID: usize = 2;
/// Endpoint count (low 32 bits); with one endpoint also its device_flag (bits
/// 32..40) and device_level (bits 40..48).
const W_META: usize = 3;
/// node_id with one endpoint, else the address of the endpoint list (count > 1).
const W_NODE: usize = 4;
const W_BOOT: usize = 5;
const W_SESSION: usize = 6;
const W_OWNER_SEQ: usize = 7;
/// Words of an entry's value (all but the version).
const VALUE_WORDS: usize = WORDS - 1;

/// An entry's value: words `W_KEY..`, word `w` at index `w - 1`.
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug)]
struct Value([u64; VALUE_WORDS]);

impl Value {
    #[inline]
    fn word(&self, w: usize) -> u64 {
        self.0[w - 1]
    }
    #[inline]
    fn set(&mut self, w: usize, x: u64) {
        self.0[w - 1] = x;
    }
    #[inline]
    fn uid_addr(&self) -> u64 {
        self.word(W_UID)
    }
    #[inline]
    fn uid_len(&self) -> usize {
        (self.word(W_KEY) & 0xffff_ffff) as usize
    }
    #[inline]
    fn count(&self) -> usize {
        (self.word(W_META) & 0xffff_ffff) as usize
    }
    /// The address of the endpoint list (meaningful when `count() > 1`).
    #[inline]
    fn list_addr(&self) -> u64 {
        self.word(W_NODE)
    }
    /// The single endpoint (meaningful when `count() == 1`).
    #[inline]
    fn inline_endpoint(&self, uid_index: u32) -> CompactEndpoint {
        let meta = self.word(W_META);
        CompactEndpoint {
            uid_index,
            device_flag: (meta >> 32) as u8,
            device_level: if (meta >> 40) as u8 == DeviceLevel::Master as u8 {
                DeviceLevel::Master
            } else {
                DeviceLevel::Slave
            },
            node_id: self.word(W_NODE),
            boot_id: self.word(W_BOOT),
            session_id: self.word(W_SESSION),
            owner_seq: self.word(W_OWNER_SEQ),
        }
    }
    /// `key`, `uid_addr` and endpoints `eps`; `list_addr` is the list holding `eps`
    /// when there are more than one.
    fn encode(key: u64, uid_addr: u64, eps: &[CompactEndpoint], list_addr: u64) -> Value {
        let mut v = Value::default();
        v.set(W_KEY, key);
        v.set(W_UID, uid_addr);
        let count = eps.len() as u64;
        debug_assert!(count <= u64::from(u32::MAX));
        match eps {
            [e] => {
                v.set(
                    W_META,
                    count | u64::from(e.device_flag) << 32 | (e.device_level as u64) << 40,
                );
                v.set(W_NODE, e.node_id);
                v.set(W_BOOT, e.boot_id);
                v.set(W_SESSION, e.session_id);
                v.set(W_OWNER_SEQ, e.owner_seq);
            }
            _ => {
                debug_assert!(eps.is_empty() || list_addr != 0);
                v.set(W_META, count);
                v.set(W_NODE, list_addr);
            }
        }
        v
    }
}

#[inline]
fn key_word(hash: u64, uid_len: usize) -> u64 {
    (hash & !0xffff_ffff) | (uid_len as u64 & 0xffff_ffff)
}

/// One uid's entry: a cache line of a version and the value's atomic words.
type Entry = Line<VALUE_WORDS>;
const _: () = assert!(std::mem::size_of::<Entry>() == 64 && std::mem::align_of::<Entry>() == 64);

/// An open-addressing table of entries; replaced, never resized in place.
pub(crate) struct Table {
    mask: usize,
    /// In [`HugePages`] memory (see `huge`), with the table's backup line; written
    /// in place with the `seqline` protocol (see the module docs).
    lines: Lines<HugeBox<[Entry]>, VALUE_WORDS>,
}

impl Table {
    fn with_entries(n: usize) -> Table {
        let n = n.next_power_of_two().max(TABLE_ENTRIES_MIN);
        Table {
            mask: n - 1,
            // SAFETY: all-zero bytes are a valid, unused entry (`Line::new`: atomic
            // integers, version 0, every word 0).
            lines: Lines::new(unsafe { HugeBox::new_zeroed_slice_in(n, HugePages).assume_init() }),
        }
    }

    #[inline]
    fn len(&self) -> usize {
        self.mask + 1
    }

    #[inline]
    fn home(&self, hash: u64) -> usize {
        hash as usize & self.mask
    }

    /// A consistent copy of entry `i`'s value. Never waits for the writer: retries
    /// only when a write of this entry completed while reading.
    #[inline]
    fn read(&self, i: usize) -> Value {
        Value(self.lines.read(i))
    }

    /// Version `version` of entry `i`, if the backup line holds it (consistently).
    #[cfg(test)]
    fn read_backup(&self, i: usize, version: u64) -> Option<Value> {
        self.lines.read_backup(i, version).map(Value)
    }

    /// The current value of entry `i` (writer only).
    #[inline]
    fn current(&self, i: usize) -> Value {
        Value(self.lines.current(i))
    }

    /// Replaces the value of entry `i` (writer only).
    #[inline]
    fn write(&self, i: usize, v: &Value) {
        self.lines.write(i, &v.0);
    }

    /// First half of [`write`](Self::write) (tests look between the halves).
    #[cfg(test)]
    fn begin_write(&self, i: usize) {
        self.lines.begin_write(i);
    }

    /// Second half of [`write`](Self::write).
    #[cfg(test)]
    fn finish_write(&self, i: usize, v: &Value) {
        self.lines.finish_write(i, &v.0);
    }

    /// The first entry keyed with `uid` (hash `hash`) on its probe path, stopping at
    /// an entry never used.
    #[inline]
    fn find(&self, hash: u64, uid: &str) -> Option<(usize, Value)> {
        let key = key_word(hash, uid.len());
        let mut i = self.home(hash);
        // At most 3/4 of the entries are used: the loop ends at an unused one.
        for _ in 0..self.len() {
            let v = self.read(i);
            if v.uid_addr() == 0 {
                return None;
            }
            if v.word(W_KEY) == key
                && (v.uid_addr() == uid.as_ptr() as u64
                    // SAFETY: `v` is a consistent value of a table reachable under the
                    // caller's pin; the uid it names is released only through
                    // deferred destruction after it left the table, so its bytes are
                    // live while the pin is held.
                    || unsafe { uid_bytes(&v) } == uid.as_bytes())
            {
                return Some((i, v));
            }
            i = (i + 1) & self.mask;
        }
        debug_assert!(false, "table without an unused entry");
        None
    }

    /// Hints the CPU to load entry `i`'s line.
    #[inline(always)]
    fn prefetch_entry(&self, i: usize) {
        prefetch(self.lines.as_ptr().wrapping_add(i));
    }

    /// Hints the CPU to load what a lookup of `uid` at entry `i` dereferences next:
    /// the published uid bytes (when not the caller's own) and the endpoint list.
    /// Reads the entry without validation: only addresses for prefetches come out.
    #[inline(always)]
    fn prefetch_payload(&self, i: usize, uid: &str) {
        let e = self.lines.line(i);
        let word = |w: usize| e.word(w - 1).load(Ordering::Relaxed);
        let addr = word(W_UID);
        if addr != 0 && addr != uid.as_ptr() as u64 {
            prefetch(addr as *const u8);
        }
        if word(W_META) & 0xffff_ffff > 1 {
            prefetch(word(W_NODE) as *const u8);
        }
    }
}

/// The bytes of the uid a value names.
///
/// # Safety
/// `v` must be a consistent value read under a pin that is still held, of a table
/// reachable when it was read (or owned by the caller).
#[inline]
unsafe fn uid_bytes<'a>(v: &Value) -> &'a [u8] {
    // SAFETY: per the contract, the uid's `Arc` is live: published values own a
    // count of it, released only after unpinning readers.
    unsafe { std::slice::from_raw_parts(v.uid_addr() as *const u8, v.uid_len()) }
}

/// The endpoint list a value names.
///
/// # Safety
/// As for [`uid_bytes`], and `v.count() > 1`.
#[inline]
unsafe fn list_of<'a>(v: &Value) -> &'a [CompactEndpoint] {
    // SAFETY: per the contract, the list is live and holds `count` endpoints.
    unsafe { std::slice::from_raw_parts(v.list_addr() as *const CompactEndpoint, v.count()) }
}

/// The `*const str` an `Arc::into_raw` of a uid returned.
#[inline]
fn uid_raw(addr: u64, len: usize) -> *const str {
    ptr::slice_from_raw_parts(addr as *const u8, len) as *const str
}

/// Releases the uid count and the list a value owns.
///
/// # Safety
/// `v` is a value of an unreachable table (or one the caller alone can reach) that
/// still owns its uid count and list.
unsafe fn release_value(v: &Value) {
    if v.uid_addr() != 0 {
        // SAFETY: the entry owns one count of this `Arc`, taken by `Arc::into_raw`.
        drop(unsafe { Arc::from_raw(uid_raw(v.uid_addr(), v.uid_len())) });
    }
    if v.count() > 1 {
        // SAFETY: the entry owns the list, made by `Box::into_raw` with `count` items.
        drop(unsafe { release_list(v.list_addr(), v.count()) });
    }
}

/// # Safety
/// `addr` and `count` come from [`new_list`] and the list is released once.
unsafe fn release_list(addr: u64, count: usize) -> Box<[CompactEndpoint]> {
    // SAFETY: per the contract.
    unsafe {
        Box::from_raw(ptr::slice_from_raw_parts_mut(
            addr as *mut CompactEndpoint,
            count,
        ))
    }
}

/// A list holding `eps` when there are more than one (its address), else 0.
fn new_list(eps: &[CompactEndpoint]) -> u64 {
    if eps.len() > 1 {
        let b: Box<[CompactEndpoint]> = eps.into();
        Box::into_raw(b).cast::<CompactEndpoint>() as u64
    } else {
        0
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        for i in 0..self.len() {
            // SAFETY: a table is dropped only when unreachable: by deferred destruction
            // after every reader that could see it unpinned, or by its sole owner. It
            // owns the uid counts and lists of its entries.
            unsafe { release_value(&self.current(i)) };
        }
    }
}

/// The published state of one hash slot: its identity, its routes and their
/// presence filter (see `presence`).
pub(crate) struct SlotState {
    target: Target,
    table: Atomic<Table>,
    filter: Atomic<Filter>,
    /// The identity waits for its previous leader's routes (a handover): lookups
    /// answer `Rebuilding`. Set at install, only ever cleared.
    rebuilding: AtomicBool,
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
        let f = self.filter.load(Ordering::Relaxed, guard);
        if !f.is_null() {
            // SAFETY: the filter is owned by this (unreachable) state alone.
            drop(unsafe { f.into_owned() });
        }
    }
}

/// The presence filters' limits (`AuthorityConfig`) and the writer's counter of
/// rebuilds (shared by the slots of one `Authority`).
#[derive(Clone, Debug)]
pub(crate) struct FilterLimits {
    /// Bits per route a filter is sized with.
    pub(crate) bits_per_route: usize,
    /// Bits of one slot's filter at most.
    pub(crate) bits_max: usize,
    /// Removals since the last rebuild, in percent of the routes the filter was
    /// sized for, that make the writer rebuild it.
    pub(crate) stale_percent: usize,
    /// Filter rebuilds (written by the one writer that owns it, read by metrics).
    pub(crate) rebuilds: Arc<AtomicU64>,
}

impl FilterLimits {
    fn filter_for(&self, routes: usize) -> Filter {
        Filter::for_routes(routes, self.bits_per_route, self.bits_max)
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
    pub(crate) lookup_uids_max: usize,
}

impl Directory {
    pub(crate) fn with_limit(lookup_uids_max: usize) -> Directory {
        Directory {
            slots: (0..HASH_SLOTS).map(|_| Atomic::null()).collect(),
            claimed: (0..HASH_SLOTS).map(|_| AtomicBool::new(false)).collect(),
            lookup_uids_max,
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
        let f = state.filter.load(Ordering::Acquire, guard);
        // SAFETY: as for the table: published with the state, replaced (and retired
        // through `defer_destroy`), never nulled.
        let filter = unsafe { f.as_ref() }?;
        Some(SlotView {
            target: state.target,
            rebuilding: state.rebuilding.load(Ordering::Acquire),
            table,
            filter,
        })
    }

    /// Installs a fresh, empty state with identity `target` for `slot` (writer only)
    /// and returns its writer bookkeeping. `rebuilding`: lookups answer
    /// `Rebuilding` until [`end_rebuilding`](Self::end_rebuilding).
    pub(crate) fn install(
        &self,
        slot: usize,
        target: Target,
        rebuilding: bool,
        sizes: (usize, usize),
        filter: FilterLimits,
    ) -> TableWriter {
        let (min_entries, entries_max) = sizes;
        let tw = TableWriter::new(slot, min_entries, entries_max, filter);
        let guard = epoch::pin();
        let new = Owned::new(SlotState {
            target,
            table: Atomic::new(Table::with_entries(tw.min_entries)),
            filter: Atomic::new(tw.filter.filter_for(0)),
            rebuilding: AtomicBool::new(rebuilding),
        });
        let old = self.slots[slot].swap(new, Ordering::AcqRel, &guard);
        retire(old, &guard);
        tw
    }

    /// Lookups of `slot`'s installed identity are answered from its table from now
    /// on (writer only; Release: a reader that sees it also sees the routes the
    /// handover wrote before).
    pub(crate) fn end_rebuilding(&self, slot: usize) {
        let guard = epoch::pin();
        let p = self.slots[slot].load(Ordering::Acquire, &guard);
        // SAFETY: `guard` keeps the published state alive; only this writer
        // retires it.
        if let Some(state) = unsafe { p.as_ref() } {
            state.rebuilding.store(false, Ordering::Release);
        }
    }

    /// Removes the state of `slot` (writer only).
    pub(crate) fn remove(&self, slot: usize) {
        let guard = epoch::pin();
        let old = self.slots[slot].swap(Shared::null(), Ordering::AcqRel, &guard);
        retire(old, &guard);
    }

    /// The current table of `slot` (writer only), `None` when not installed.
    #[inline]
    fn writer_table(&self, slot: usize) -> Option<&Table> {
        // SAFETY: only the writer of `slot`, our caller, replaces or retires the
        // slot's state and table, and it does not use the reference past its next
        // replacement (`TableWriter` methods, which take `&mut self`, are the only
        // callers and hold the reference within one call, dropping it before the
        // swap in `rebuild`). So the pointers stay valid without a pin.
        let guard = unsafe { epoch::unprotected() };
        let p = self.slots[slot].load(Ordering::Acquire, guard);
        // SAFETY: see above.
        let state = unsafe { p.as_ref() }?;
        // SAFETY: see above.
        unsafe { state.table.load(Ordering::Acquire, guard).as_ref() }
    }

    /// The current presence filter of `slot` (writer only), `None` when not
    /// installed. Same contract as [`writer_table`](Self::writer_table).
    #[inline]
    fn writer_filter(&self, slot: usize) -> Option<&Filter> {
        // SAFETY: as in `writer_table`: only this writer replaces the slot's state
        // and filter, and the reference does not outlive the calling method.
        let guard = unsafe { epoch::unprotected() };
        let p = self.slots[slot].load(Ordering::Acquire, guard);
        // SAFETY: see above.
        let state = unsafe { p.as_ref() }?;
        // SAFETY: see above.
        unsafe { state.filter.load(Ordering::Acquire, guard).as_ref() }
    }

    /// Publishes `new` as the presence filter of `slot` (writer only; Release:
    /// a reader that loads it sees its bits).
    fn swap_filter(&self, slot: usize, new: Filter) {
        let guard = epoch::pin();
        let p = self.slots[slot].load(Ordering::Acquire, &guard);
        // SAFETY: pinned, and only this writer retires the slot's state.
        let Some(state) = (unsafe { p.as_ref() }) else {
            debug_assert!(false, "filter swap in an uninstalled slot");
            return;
        };
        let old = state.filter.swap(Owned::new(new), Ordering::AcqRel, &guard);
        retire(old, &guard);
    }

    /// Replaces the table of `slot` with `new` (writer only).
    fn swap_table(&self, slot: usize, new: Table) {
        let guard = epoch::pin();
        let p = self.slots[slot].load(Ordering::Acquire, &guard);
        // SAFETY: pinned, and only this writer retires the slot's state.
        let Some(state) = (unsafe { p.as_ref() }) else {
            debug_assert!(false, "table swap in an uninstalled slot");
            return;
        };
        let old = state.table.swap(Owned::new(new), Ordering::AcqRel, &guard);
        retire(old, &guard);
    }
}

/// Defers destruction of an unlinked pointer until no reader can hold it.
fn retire<T>(p: Shared<'_, T>, guard: &Guard) {
    if !p.is_null() {
        // SAFETY: `p` was just unlinked from the only place that published it, so no
        // new reader can load it; readers pinned before may still use it, and
        // `defer_destroy` waits for them. `T: Send` is not required by the API but
        // holds for every type retired here (tables, states).
        unsafe { guard.defer_destroy(p) };
    }
}

/// Releases the uid count of an entry that no longer names it, once no reader can
/// hold it.
fn retire_uid(addr: u64, len: usize) {
    let guard = epoch::pin();
    // SAFETY: the entry that owned this count was rewritten (so no new reader can
    // find it); readers pinned before may still compare its bytes, and the deferred
    // drop waits for them. An `Arc<str>` may be dropped on any thread.
    unsafe {
        guard.defer_unchecked(move || drop(Arc::from_raw(uid_raw(addr, len))));
    }
}

/// Frees an endpoint list an entry no longer names, once no reader can hold it.
fn retire_list(addr: u64, count: usize) {
    let guard = epoch::pin();
    // SAFETY: as in `retire_uid`; the list came from `new_list` and only this entry
    // owned it.
    unsafe {
        guard.defer_unchecked(move || drop(release_list(addr, count)));
    }
}

/// Uids looked up together, their cache misses overlapped by prefetching (and
/// checked against the filter together).
pub(crate) const LOOKUP_LANES: usize = 16;
/// Blocks of [`LOOKUP_LANES`] uids whose filter words are prefetched ahead of
/// the block being checked (a word is an L2 or L3 miss with many routes).
const FILTER_AHEAD_BLOCKS: usize = 3;
/// Lanes in flight in a lookup's table probes (prefetch, peek, read).
const LOOKUP_PIPELINE_LANES: usize = 3;

/// Hints the CPU to load the cache line at `p`. Never faults, whatever `p` is.
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
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
    /// Waiting for a handover: lookups answer `Rebuilding`.
    pub(crate) rebuilding: bool,
    table: &'g Table,
    filter: &'g Filter,
}

/// What the presence filter saved (and cost) in lookups.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FilterCounts {
    /// Uids the filter said were certainly absent: no table probe.
    pub skipped: u64,
    /// Uids the filter let through that had no endpoints (false positives).
    pub false_positives: u64,
}

impl FilterCounts {
    pub(crate) fn add(&mut self, o: FilterCounts) {
        self.skipped += o.skipped;
        self.false_positives += o.false_positives;
    }
}

/// Uids of a lookup that passed the filter: their positions in the input and
/// their hashes.
#[derive(Clone, Copy)]
struct Lane {
    n: usize,
    at: [u32; LOOKUP_LANES],
    hash: [u64; LOOKUP_LANES],
}

impl Lane {
    const EMPTY: Lane = Lane {
        n: 0,
        at: [0; LOOKUP_LANES],
        hash: [0; LOOKUP_LANES],
    };

    #[inline(always)]
    fn items(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.at[..self.n]
            .iter()
            .copied()
            .zip(self.hash[..self.n].iter().copied())
    }
}

/// The table probes of a lookup: a software pipeline over lanes of uids that
/// passed the filter, one step per lane: lane L's entries are prefetched, lane
/// L - 1's are peeked for what they point to (published uid bytes, endpoint lists:
/// also prefetched), lane L - 2 is read; so each miss has a lane's work to arrive.
struct Probes<'a, 'g, P> {
    view: &'a SlotView<'g>,
    uids: &'a [Uid],
    push: P,
    lanes: [Lane; LOOKUP_PIPELINE_LANES],
    step: usize,
    false_positives: u64,
}

impl<P: FnMut(CompactEndpoint)> Probes<'_, '_, P> {
    /// The lane being filled: the one the next step takes.
    #[inline(always)]
    fn filling(&mut self) -> &mut Lane {
        &mut self.lanes[self.step % LOOKUP_PIPELINE_LANES]
    }

    /// Adds a uid that passed the filter; a full lane enters the pipeline.
    #[inline(always)]
    fn add(&mut self, at: u32, hash: u64) {
        let lane = self.filling();
        lane.at[lane.n] = at;
        lane.hash[lane.n] = hash;
        lane.n += 1;
        if lane.n == LOOKUP_LANES {
            self.step();
        }
    }

    /// Lets every lane through (the last one partly filled).
    #[inline(always)]
    fn finish(&mut self) {
        if self.filling().n > 0 {
            self.step();
        }
        for _ in 1..LOOKUP_PIPELINE_LANES {
            self.filling().n = 0;
            self.step();
        }
    }

    /// One step: the filling lane enters the pipeline (its entries prefetched),
    /// the previous one is peeked, the one before it read; the next lane fills the
    /// read one's place.
    #[inline(always)]
    fn step(&mut self) {
        let t = self.view.table;
        let s = self.step;
        self.step += 1;
        for (_, h) in self.lanes[s % LOOKUP_PIPELINE_LANES].items() {
            t.prefetch_entry(t.home(h));
        }
        if s >= 1 {
            for (at, h) in self.lanes[(s - 1) % LOOKUP_PIPELINE_LANES].items() {
                t.prefetch_payload(t.home(h), &self.uids[at as usize]);
            }
        }
        let read = (s + 1) % LOOKUP_PIPELINE_LANES;
        if s >= 2 {
            let lane = self.lanes[read];
            self.read(&lane);
        }
        self.lanes[read].n = 0;
    }

    /// Reads the entries of `lane` and passes their endpoints on.
    #[inline(always)]
    fn read(&mut self, lane: &Lane) {
        for (at, h) in lane.items() {
            if !self.view.read_entry(self.uids, at, h, &mut self.push) {
                self.false_positives += 1;
            }
        }
    }
}

impl SlotView<'_> {
    /// Passes the endpoints of every uid in `uids` to `push`, in input order, each
    /// with `uid_index` = the uid's position in `uids` (readers write nothing to
    /// published lines and touch no reference count). Hashes each uid.
    #[inline]
    pub(crate) fn lookup(&self, uids: &[Uid], push: impl FnMut(CompactEndpoint)) -> FilterCounts {
        self.lookup_with(uids, true, |i| uid_hash(&uids[i]), push)
    }

    /// [`lookup`](Self::lookup) with each uid's hash given (`hashes[i]` is
    /// `uid_hash(uids[i])`): an absent uid's bytes are never read.
    #[inline]
    pub(crate) fn lookup_hashed(
        &self,
        uids: &[Uid],
        hashes: &[u64],
        push: impl FnMut(CompactEndpoint),
    ) -> FilterCounts {
        debug_assert_eq!(uids.len(), hashes.len());
        self.lookup_with(uids, false, |i| hashes[i], push)
    }

    /// The lookup: blocks of [`LOOKUP_LANES`] uids are hashed (`hash_of`) and
    /// their filter words prefetched one block ahead of the check; the uids the
    /// filter lets through go to the table probes ([`Probes`]) lane by lane.
    /// `prefetch_uids`: the hashing reads the uids' bytes (prefetched a block
    /// further ahead).
    #[inline(always)]
    fn lookup_with(
        &self,
        uids: &[Uid],
        prefetch_uids: bool,
        hash_of: impl Fn(usize) -> u64,
        push: impl FnMut(CompactEndpoint),
    ) -> FilterCounts {
        debug_assert!(uids.len() <= u32::MAX as usize);
        if uids.len() <= LOOKUP_LANES {
            return self.lookup_small(uids, hash_of, push);
        }
        let f = self.filter;
        let n = uids.len();
        let blocks = n.div_ceil(LOOKUP_LANES);
        let block = |b: usize| b * LOOKUP_LANES..n.min((b + 1) * LOOKUP_LANES);
        // The hashes of the blocks in flight, by block number modulo the depth.
        let mut hashes = [[0u64; LOOKUP_LANES]; FILTER_AHEAD_BLOCKS + 1];
        let fill = |b: usize, hs: &mut [u64; LOOKUP_LANES]| {
            if prefetch_uids && b + 1 < blocks {
                for u in &uids[block(b + 1)] {
                    prefetch(u.as_ptr());
                }
            }
            for (h, i) in hs.iter_mut().zip(block(b)) {
                *h = hash_of(i);
                prefetch(f.word_ptr(filter_key(*h)));
            }
        };
        if prefetch_uids {
            for u in &uids[block(0)] {
                prefetch(u.as_ptr());
            }
        }
        for (b, hs) in hashes
            .iter_mut()
            .enumerate()
            .take(blocks.min(FILTER_AHEAD_BLOCKS))
        {
            fill(b, hs);
        }
        let mut probes = Probes {
            view: self,
            uids,
            push,
            lanes: [Lane::EMPTY; LOOKUP_PIPELINE_LANES],
            step: 0,
            false_positives: 0,
        };
        let mut skipped = 0;
        for b in 0..blocks {
            let ahead = b + FILTER_AHEAD_BLOCKS;
            if ahead < blocks {
                fill(ahead, &mut hashes[ahead % (FILTER_AHEAD_BLOCKS + 1)]);
            }
            for (&h, i) in hashes[b % (FILTER_AHEAD_BLOCKS + 1)].iter().zip(block(b)) {
                if f.may_contain(filter_key(h)) {
                    probes.add(i as u32, h);
                } else {
                    skipped += 1;
                }
            }
        }
        probes.finish();
        FilterCounts {
            skipped,
            false_positives: probes.false_positives,
        }
    }

    /// [`lookup_with`](Self::lookup_with) of at most one block of uids (a hash
    /// slot's share of a page is most often one or two uids): the filter words are
    /// prefetched, the entries of the uids that pass are prefetched, then read in
    /// input order. A group whose uids are all absent costs their filter words and
    /// nothing else: no pipeline is set up (its lanes are 600 bytes to initialize
    /// and three steps to drain, which dominated pages spread over many slots).
    #[inline(always)]
    fn lookup_small(
        &self,
        uids: &[Uid],
        hash_of: impl Fn(usize) -> u64,
        mut push: impl FnMut(CompactEndpoint),
    ) -> FilterCounts {
        let (f, t, n) = (self.filter, self.table, uids.len());
        debug_assert!(n <= LOOKUP_LANES);
        let mut hashes = [0u64; LOOKUP_LANES];
        for (i, h) in hashes[..n].iter_mut().enumerate() {
            *h = hash_of(i);
            prefetch(f.word_ptr(filter_key(*h)));
        }
        let mut passed = false;
        for &h in &hashes[..n] {
            if f.may_contain(filter_key(h)) {
                t.prefetch_entry(t.home(h));
                passed = true;
            }
        }
        let mut counts = FilterCounts::default();
        if !passed {
            counts.skipped = n as u64;
            return counts;
        }
        // Bits are only ever set between the two passes (cleared only by a rebuild,
        // which publishes a new filter), so a uid skipped here had no endpoints
        // when its word was read: the same answer the first pass would give.
        for (at, &h) in hashes[..n].iter().enumerate() {
            if !f.may_contain(filter_key(h)) {
                counts.skipped += 1;
            } else if !self.read_entry(uids, at as u32, h, &mut push) {
                counts.false_positives += 1;
            }
        }
        counts
    }

    /// Reads the entry of `uids[at]` (hash `h`) and passes its endpoints to `push`;
    /// false when it has none (a filter false positive).
    #[inline(always)]
    fn read_entry(
        &self,
        uids: &[Uid],
        at: u32,
        h: u64,
        push: &mut impl FnMut(CompactEndpoint),
    ) -> bool {
        let v = match self.table.find(h, &uids[at as usize]) {
            Some((_, v)) if v.count() > 0 => v,
            _ => return false,
        };
        if v.count() == 1 {
            push(v.inline_endpoint(at));
            return true;
        }
        // SAFETY: `v` is a consistent value read under the pin that `'g` borrows,
        // and it has more than one endpoint.
        for e in unsafe { list_of(&v) } {
            push(CompactEndpoint {
                uid_index: at,
                ..*e
            });
        }
        true
    }
}

/// Writer-private bookkeeping of one slot's published table: which writer user
/// (uid) holds which entry. Entries are written only through it.
pub(crate) struct TableWriter {
    slot: usize,
    /// Per entry of the current table: the user whose uid it holds, `NIL` when never
    /// used or reusable (its uid forgotten by the writer).
    owner: Vec<u32>,
    /// Per user: its entry, `NIL` when it has none.
    entry_of: Vec<u32>,
    /// Entries used at least once (never unused again in this table).
    used: usize,
    /// Entries with at least one endpoint.
    live: usize,
    min_entries: usize,
    entries_max: usize,
    /// Endpoints of the uid being changed (at most `records_per_uid_max`).
    scratch: Vec<CompactEndpoint>,
    /// The presence filter's limits.
    filter: FilterLimits,
    /// Routes the current filter was sized for: past it, a larger one is built.
    filter_capacity: usize,
    /// Uids that lost their last endpoint since the filter was built (their bits
    /// are stale).
    filter_removed: usize,
    /// Whether the filter is below `bits_max` (past its capacity at the limit, it
    /// is not rebuilt: false positives rise, lookups stay exact).
    filter_can_grow: bool,
}

impl TableWriter {
    fn new(
        slot: usize,
        min_entries: usize,
        entries_max: usize,
        filter: FilterLimits,
    ) -> TableWriter {
        let entries_max = entries_max.next_power_of_two().max(TABLE_ENTRIES_MIN);
        let min_entries = min_entries
            .next_power_of_two()
            .clamp(TABLE_ENTRIES_MIN, entries_max);
        TableWriter {
            slot,
            owner: vec![NIL; min_entries],
            entry_of: Vec::new(),
            used: 0,
            live: 0,
            min_entries,
            entries_max,
            filter_capacity: filter.filter_for(0).capacity(filter.bits_per_route),
            filter,
            filter_removed: 0,
            filter_can_grow: true,
            scratch: Vec::new(),
        }
    }

    /// Sets the filter bits of the uid keyed `key_word` (before the entry that
    /// gives it endpoints is written: see `presence`).
    #[inline]
    fn cover(&self, dir: &Directory, key_word: u64) {
        if let Some(f) = dir.writer_filter(self.slot) {
            f.insert(filter_key(key_word));
        }
    }

    /// After the live count changed (`removed`: a uid lost its last endpoint):
    /// rebuilds the filter once it is past its capacity or its stale bits pass
    /// `stale_percent` of it.
    #[inline]
    fn filter_upkeep(&mut self, dir: &Directory, removed: bool) {
        self.filter_removed += usize::from(removed);
        if (self.live > self.filter_capacity && self.filter_can_grow)
            || self.filter_removed * 100 > self.filter.stale_percent * self.filter_capacity
        {
            self.rebuild_filter(dir);
        }
    }

    /// Builds a filter from the table's entries that have endpoints and publishes
    /// it (the single writer writes nothing meanwhile: it covers the table when it
    /// becomes visible).
    fn rebuild_filter(&mut self, dir: &Directory) {
        let Some(t) = dir.writer_table(self.slot) else {
            return;
        };
        let f = self.filter.filter_for(self.live + self.live / 4 + 1);
        for (i, &user) in self.owner.iter().enumerate() {
            if user != NIL {
                let v = t.current(i);
                if v.count() > 0 {
                    f.insert(filter_key(v.word(W_KEY)));
                }
            }
        }
        self.filter_capacity = f.capacity(self.filter.bits_per_route);
        self.filter_can_grow = 2 * f.bits() <= self.filter.bits_max;
        self.filter_removed = 0;
        let n = &self.filter.rebuilds;
        n.store(n.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        dir.swap_filter(self.slot, f);
    }

    /// Used entries that make the writer build a new table: 3/4.
    #[inline]
    fn used_limit(&self) -> usize {
        self.owner.len() - self.owner.len() / 4
    }

    #[inline]
    fn entry(&self, user: u32) -> u32 {
        self.entry_of.get(user as usize).copied().unwrap_or(NIL)
    }

    /// Hints the CPU to load the entry of `user` (before a `publish`).
    #[inline(always)]
    pub(crate) fn prefetch(&self, dir: &Directory, user: u32) {
        let i = self.entry(user);
        if i != NIL {
            if let Some(t) = dir.writer_table(self.slot) {
                t.prefetch_entry(i as usize);
            }
        }
    }

    /// Publishes `eps` (ordered) as the endpoints of `uid`, the uid of writer user
    /// `user` (one user per uid). O(1) but for a new uid's probe and, rarely, a new
    /// table.
    pub(crate) fn publish(
        &mut self,
        dir: &Directory,
        user: u32,
        uid: &Uid,
        eps: &[CompactEndpoint],
    ) {
        let i = self.entry(user);
        if i == NIL {
            if !eps.is_empty() {
                self.insert(dir, user, uid, eps);
            }
            return;
        }
        let Some(t) = dir.writer_table(self.slot) else {
            debug_assert!(false, "publish into an uninstalled slot");
            return;
        };
        let i = i as usize;
        let old = t.current(i);
        debug_assert_eq!(old.uid_len(), uid.len());
        let change = (old.count() > 0, !eps.is_empty());
        if change == (false, true) {
            self.cover(dir, old.word(W_KEY));
        }
        let v = Value::encode(old.word(W_KEY), old.uid_addr(), eps, new_list(eps));
        t.write(i, &v);
        if old.count() > 1 {
            retire_list(old.list_addr(), old.count());
        }
        match change {
            (false, true) => self.live += 1,
            (true, false) => self.live -= 1,
            _ => return,
        }
        self.filter_upkeep(dir, change.0);
    }

    /// Removes from `user`'s published endpoints the one `is_it` names: the route
    /// of one of its records ended, no other changed. Cheaper than `publish` for an
    /// expiry pass: it reads neither the user nor its other records, only the
    /// entry (and with several endpoints, their list).
    pub(crate) fn unpublish_one(
        &mut self,
        dir: &Directory,
        user: u32,
        is_it: impl Fn(&CompactEndpoint) -> bool,
    ) {
        let i = self.entry(user);
        let Some(t) = dir.writer_table(self.slot) else {
            debug_assert!(false, "unpublish in an uninstalled slot");
            return;
        };
        if i == NIL {
            debug_assert!(false, "unpublish of an unpublished uid");
            return;
        }
        let i = i as usize;
        let old = t.current(i);
        match old.count() {
            0 => debug_assert!(false, "unpublish of a uid without endpoints"),
            1 => {
                debug_assert!(is_it(&old.inline_endpoint(0)));
                t.write(i, &Value::encode(old.word(W_KEY), old.uid_addr(), &[], 0));
                self.live -= 1;
                self.filter_upkeep(dir, true);
            }
            n => {
                let mut eps = std::mem::take(&mut self.scratch);
                eps.clear();
                // SAFETY: the writer's own current value, with more than one endpoint.
                eps.extend(unsafe { list_of(&old) }.iter().filter(|e| !is_it(e)));
                debug_assert_eq!(eps.len(), n - 1, "exactly one endpoint named");
                let v = Value::encode(old.word(W_KEY), old.uid_addr(), &eps, new_list(&eps));
                t.write(i, &v);
                retire_list(old.list_addr(), n);
                self.scratch = eps;
            }
        }
    }

    /// Gives up the entry of `user`, whose uid the writer forgot (it has no
    /// endpoints left). The entry keeps naming the uid, with count 0, until reused.
    pub(crate) fn release(&mut self, dir: &Directory, user: u32) {
        let i = self.entry(user);
        if i == NIL {
            return;
        }
        debug_assert!(dir
            .writer_table(self.slot)
            .is_none_or(|t| t.current(i as usize).count() == 0));
        self.owner[i as usize] = NIL;
        self.entry_of[user as usize] = NIL;
    }

    fn insert(&mut self, dir: &Directory, user: u32, uid: &Uid, eps: &[CompactEndpoint]) {
        assert!(uid.len() <= UID_BYTES_MAX, "uid longer than UID_BYTES_MAX");
        if self.used >= self.used_limit() {
            self.rebuild(dir, self.live + 1);
        }
        let Some(t) = dir.writer_table(self.slot) else {
            debug_assert!(false, "publish into an uninstalled slot");
            return;
        };
        let hash = uid_hash(uid);
        // The first unowned entry on the probe path: readers pass owned entries
        // (other uids) and stop at the first never used, which is not before it;
        // a stale entry of the same uid (reusable) is not before it either.
        let mut i = t.home(hash);
        while self.owner[i] != NIL {
            i = (i + 1) & t.mask;
        }
        let old = t.current(i);
        debug_assert_eq!(old.count(), 0, "a reusable entry has no endpoints");
        let addr = Arc::into_raw(uid.clone()).cast::<u8>() as u64;
        let key = key_word(hash, uid.len());
        self.cover(dir, key);
        let v = Value::encode(key, addr, eps, new_list(eps));
        t.write(i, &v);
        if old.uid_addr() == 0 {
            self.used += 1;
        } else {
            retire_uid(old.uid_addr(), old.uid_len());
        }
        self.live += 1;
        self.owner[i] = user;
        let u = user as usize;
        if self.entry_of.len() <= u {
            self.entry_of.resize(u + 1, NIL);
        }
        self.entry_of[u] = i as u32;
        self.filter_upkeep(dir, false);
    }

    /// Builds a table sized for `live` uids with endpoints from the current one
    /// (leaving out entries without endpoints) and swaps it in.
    fn rebuild(&mut self, dir: &Directory, live: usize) {
        let Some(old) = dir.writer_table(self.slot) else {
            return;
        };
        let n = live
            .saturating_mul(2)
            .next_power_of_two()
            .clamp(self.min_entries, self.entries_max);
        debug_assert!(2 * live <= n, "entries_max below twice the route limit");
        let new = Table::with_entries(n);
        let mut owner = vec![NIL; n];
        let mut used = 0;
        for (i, &user) in self.owner.iter().enumerate() {
            if user == NIL {
                continue;
            }
            let mut v = old.current(i);
            if v.count() == 0 {
                self.entry_of[user as usize] = NIL;
                continue;
            }
            // The new table owns its own uid count and list.
            // SAFETY: the entry owns a count of this uid, so it is live.
            unsafe { Arc::increment_strong_count(uid_raw(v.uid_addr(), v.uid_len())) };
            if v.count() > 1 {
                // SAFETY: the writer's own current value, with more than one endpoint.
                let list = unsafe { list_of(&v) };
                v.set(W_NODE, new_list(list));
            }
            // SAFETY: the writer's own current value: its uid is live.
            let hash = uid_hash_bytes(unsafe { uid_bytes(&v) });
            let mut j = new.home(hash);
            while owner[j] != NIL {
                j = (j + 1) & new.mask;
            }
            new.lines.init(j, &v.0);
            owner[j] = user;
            self.entry_of[user as usize] = j as u32;
            used += 1;
        }
        self.owner = owner;
        self.used = used;
        self.live = used;
        dir.swap_table(self.slot, new);
        // The stale bits of the uids left out go with a new filter.
        self.rebuild_filter(dir);
    }

    /// Checks the bookkeeping against the published table (O(table); tests) and
    /// passes each owned entry's user and endpoints to `f`.
    pub(crate) fn check(
        &self,
        dir: &Directory,
        mut f: impl FnMut(u32, &str, &[CompactEndpoint]) -> Result<(), String>,
    ) -> Result<(), String> {
        let Some(t) = dir.writer_table(self.slot) else {
            return Err("no table".into());
        };
        if t.len() != self.owner.len() {
            return Err("table size differs from the writer's".into());
        }
        let (mut used, mut live) = (0, 0);
        let mut eps = Vec::new();
        for i in 0..t.len() {
            let v = t.current(i);
            if v.uid_addr() != 0 {
                used += 1;
            }
            let user = self.owner[i];
            if user == NIL {
                if v.count() != 0 {
                    return Err(format!("entry {i}: endpoints without an owner"));
                }
                continue;
            }
            if v.uid_addr() == 0 {
                return Err(format!("entry {i}: owned but never used"));
            }
            if self.entry(user) != i as u32 {
                return Err(format!("entry {i}: owner {user} points elsewhere"));
            }
            // SAFETY: the writer's own current value: its uid is live.
            let uid = std::str::from_utf8(unsafe { uid_bytes(&v) })
                .map_err(|_| format!("entry {i}: uid not utf-8"))?;
            if t.find(uid_hash(uid), uid).map(|(j, _)| j) != Some(i) {
                return Err(format!("entry {i}: {uid} not found by a lookup"));
            }
            eps.clear();
            match v.count() {
                0 => {}
                1 => eps.push(v.inline_endpoint(0)),
                _ => {
                    // SAFETY: the writer's own current value, more than one endpoint.
                    eps.extend_from_slice(unsafe { list_of(&v) });
                }
            }
            if !eps.is_empty() {
                live += 1;
            }
            f(user, uid, &eps)?;
        }
        for (user, &i) in self.entry_of.iter().enumerate() {
            if i != NIL && self.owner.get(i as usize) != Some(&(user as u32)) {
                return Err(format!("user {user}: entry {i} owned by another"));
            }
        }
        if (used, live) != (self.used, self.live) {
            return Err(format!(
                "counted {used} used / {live} live entries, kept {} / {}",
                self.used, self.live
            ));
        }
        if used > self.used_limit() {
            return Err("table past its used limit".into());
        }
        Ok(())
    }

    /// Whether `user` has an entry.
    pub(crate) fn has_entry(&self, user: u32) -> bool {
        self.entry(user) != NIL
    }
}

#[cfg(test)]
// The concurrency tests run readers on threads.
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn ep(session_id: u64) -> CompactEndpoint {
        CompactEndpoint {
            uid_index: 0,
            device_flag: 1,
            device_level: DeviceLevel::Slave,
            node_id: session_id,
            boot_id: session_id,
            session_id,
            owner_seq: session_id,
        }
    }

    // Sizes: miri (`.ci/run`) interprets these tests some 10,000 times slower, so
    // it runs them small; every path (growth, rebuilds, reuse, lists, backup reads)
    // is still taken.
    /// Seeds of `table_writer_matches_a_reference_map`.
    const SEEDS: u64 = if cfg!(miri) { 1 } else { 24 };
    /// Steps of one seed.
    const STEPS: usize = if cfg!(miri) { 60 } else { 1500 };
    /// Lookup batches of each reader of `concurrent_lookups_see_whole_values_...`.
    const LOOKUPS: u64 = if cfg!(miri) { 12 } else { 3_000 };
    /// Reads of each reader of `concurrent_readers_never_see_a_torn_value`.
    const READS: u64 = if cfg!(miri) { 300 } else { 2_000_000 };

    /// Small filters, rebuilt after few removals: the tests take every path.
    fn filter_limits() -> FilterLimits {
        FilterLimits {
            bits_per_route: 16,
            bits_max: 1 << 16,
            stale_percent: 10,
            rebuilds: Arc::default(),
        }
    }

    fn target(hash_slot: u8) -> Target {
        Target {
            hash_slot: hash_slot.into(),
            slot_id: 1,
            leader_node_id: 1,
            leader_term: 1,
            config_epoch: 1,
        }
    }

    /// A uid the filter rules out is not probed (counted as skipped); one it lets
    /// through without endpoints is a false positive (counted) and finds nothing;
    /// a uid with endpoints is found whatever the filter's other bits.
    #[test]
    fn the_filter_skips_absent_uids_and_false_positives_fall_through() {
        const N: usize = if cfg!(miri) { 40 } else { 400 };
        let dir = Directory::with_limit(1 << 16);
        let mut tw = dir.install(5, target(5), false, (4, 4 * N), filter_limits());
        let uids: Vec<Uid> = (0..N).map(|i| format!("f{i}").into()).collect();
        for (u, uid) in uids.iter().enumerate().filter(|(u, _)| u % 10 == 0) {
            tw.publish(&dir, u as u32, uid, &[ep(u as u64)]);
        }
        let hashes: Vec<u64> = uids.iter().map(|u| uid_hash(u)).collect();
        let guard = epoch::pin();
        let view = dir.state(5, &guard).unwrap();
        let mut found = Vec::new();
        let c = view.lookup_hashed(&uids, &hashes, |e| found.push(e.uid_index));
        let online: Vec<u32> = (0..N as u32).filter(|u| u % 10 == 0).collect();
        assert_eq!(found, online, "every uid with endpoints, in order");
        let absent = (N - online.len()) as u64;
        assert_eq!(c.skipped + c.false_positives, absent);
        assert!(
            c.skipped > absent * 9 / 10,
            "{c:?}: the filter rules out most"
        );
        // A filter saying "maybe" to everything: every absent uid is a false
        // positive, found through the table's full lookup; the answer is the same.
        view.filter.fill();
        found.clear();
        let c = view.lookup(&uids, |e| found.push(e.uid_index));
        assert_eq!(found, online);
        assert_eq!(
            c,
            FilterCounts {
                skipped: 0,
                false_positives: absent
            }
        );
    }

    /// The filter is rebuilt as routes come (past its capacity) and as removals
    /// leave stale bits (past `stale_percent`), each rebuild counted; it covers the
    /// uids with endpoints throughout (`table_run` checks it at every step).
    #[test]
    fn the_filter_grows_with_its_routes_and_is_rebuilt_as_stale_bits_accumulate() {
        const N: usize = if cfg!(miri) { 80 } else { 1000 };
        let dir = Directory::with_limit(1 << 16);
        let limits = filter_limits();
        let rebuilds = limits.rebuilds.clone();
        let mut tw = dir.install(7, target(7), false, (4, 4 * N), limits);
        let uids: Vec<Uid> = (0..N).map(|i| format!("g{i}").into()).collect();
        let initial = tw.filter_capacity;
        for (u, uid) in uids.iter().enumerate() {
            tw.publish(&dir, u as u32, uid, &[ep(u as u64)]);
        }
        let grown = rebuilds.load(Ordering::Relaxed);
        assert!(grown >= 1 && tw.filter_capacity >= N, "grew from {initial}");
        for (u, uid) in uids.iter().enumerate().skip(N / 10) {
            tw.unpublish_one(&dir, u as u32, |_| true);
            tw.publish(&dir, u as u32, uid, &[]);
            tw.release(&dir, u as u32);
        }
        assert!(
            rebuilds.load(Ordering::Relaxed) > grown,
            "stale bits rebuilt"
        );
        assert!(tw.filter_removed * 100 <= 10 * tw.filter_capacity);
        let guard = epoch::pin();
        let view = dir.state(7, &guard).unwrap();
        let mut found = 0;
        let c = view.lookup(&uids, |_| found += 1);
        assert_eq!(found, N / 10);
        assert!(
            c.skipped > (N as u64 * 9 / 10) * 9 / 10,
            "{c:?}: stale bits were cleared"
        );
    }

    #[test]
    fn a_reader_of_an_entry_in_mid_write_gets_the_previous_value_from_the_backup() {
        let t = Table::with_entries(4);
        // No uid address (0): the table has nothing to release, even on a failure.
        let key = key_word(uid_hash("u"), 1);
        let a = Value::encode(key, 0, &[ep(1)], 0);
        let b = Value::encode(key, 0, &[ep(2)], 0);
        t.write(1, &a);
        assert_eq!(t.read(1), a);
        t.begin_write(1);
        assert_eq!(t.read(1), a, "odd version: the backup answers, no waiting");
        t.finish_write(1, &b);
        assert_eq!(t.read(1), b);
        // The backup of entry 1 does not answer for entry 2 (never written).
        t.begin_write(2);
        assert_eq!(t.read_backup(1, 0), None);
        assert_eq!(t.read(2), Value::default());
        t.finish_write(2, &a);
        assert_eq!(t.read(2), a);
    }

    /// The published table against a plain map, through growth, rebuilds, entry
    /// reuse by other uids, multi-device uids and lookups by equal but distinct
    /// `Arc`s. Deterministic seeds; a failure names its seed.
    #[test]
    fn table_writer_matches_a_reference_map() {
        for seed in 1..=SEEDS {
            if let Err(e) = table_run(seed) {
                panic!("seed {seed}: {e}");
            }
        }
    }

    #[allow(clippy::too_many_lines)] // one scenario, read top-down
    fn table_run(seed: u64) -> Result<(), String> {
        const UIDS: usize = if cfg!(miri) { 12 } else { 40 };
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut rng = move |n: usize| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n as u64) as usize
        };
        let dir = Directory::with_limit(1 << 16);
        let target = Target {
            hash_slot: 0,
            slot_id: 1,
            leader_node_id: 1,
            leader_term: 1,
            config_epoch: 1,
        };
        let mut tw = dir.install(0, target, false, (4, 2 * (UIDS + 1)), filter_limits());
        let uids: Vec<Uid> = (0..UIDS).map(|i| format!("t{i}").into()).collect();
        // Equal strings in other allocations: lookups compare bytes.
        let copies: Vec<Uid> = uids.iter().map(|u| Uid::from(&**u)).collect();
        // Per uid: its user while the writer knows it, and its endpoints.
        let mut user_of: Vec<Option<u32>> = vec![None; UIDS];
        let mut eps_of: Vec<Vec<CompactEndpoint>> = vec![Vec::new(); UIDS];
        let mut free_users: Vec<u32> = (0..UIDS as u32).rev().collect();
        for step in 0..STEPS {
            let k = rng(UIDS);
            if rng(4) == 0 {
                // Forget the uid (only without endpoints, as the writer does).
                if let Some(u) = user_of[k] {
                    tw.publish(&dir, u, &uids[k], &[]);
                    tw.release(&dir, u);
                    eps_of[k].clear();
                    user_of[k] = None;
                    free_users.push(u);
                }
            } else {
                let u = match user_of[k] {
                    Some(u) => u,
                    None => free_users.pop().ok_or("no free user")?,
                };
                user_of[k] = Some(u);
                let eps: Vec<CompactEndpoint> =
                    (0..rng(4)).map(|j| ep((step * 4 + j) as u64)).collect();
                tw.publish(&dir, u, &uids[k], &eps);
                eps_of[k] = eps;
            }
            tw.check(&dir, |u, uid, eps| {
                let k = user_of
                    .iter()
                    .position(|&o| o == Some(u))
                    .ok_or(format!("step {step}: entry of unknown user {u}"))?;
                if *uids[k] != *uid || eps_of[k] != eps {
                    return Err(format!("step {step}: entry of {uid} differs"));
                }
                Ok(())
            })?;
            let guard = epoch::pin();
            let view = dir.state(0, &guard).ok_or("not installed")?;
            // The filter's invariant: every uid with endpoints is covered.
            for (k, eps) in eps_of.iter().enumerate() {
                if !eps.is_empty() && !view.filter.may_contain(filter_key(uid_hash(&uids[k]))) {
                    return Err(format!(
                        "step {step}: {} has endpoints, not in the filter",
                        uids[k]
                    ));
                }
            }
            if tw.filter_removed * 100 > tw.filter.stale_percent * tw.filter_capacity {
                return Err(format!(
                    "step {step}: stale bits past the limit, no rebuild"
                ));
            }
            for look in [&uids, &copies] {
                lookups_in_chunks_match(&view, look, &eps_of)
                    .map_err(|e| format!("step {step}: {e}"))?;
            }
        }
        Ok(())
    }

    /// Groups of one block or less take the small lookup, longer ones the pipeline:
    /// looked up whole and in chunks of either size, `uids` answer as `eps_of` says.
    fn lookups_in_chunks_match(
        view: &SlotView<'_>,
        uids: &[Uid],
        eps_of: &[Vec<CompactEndpoint>],
    ) -> Result<(), String> {
        for chunk in [uids.len().max(1), 1, 7, LOOKUP_LANES, LOOKUP_LANES + 1] {
            let mut got: Vec<Vec<CompactEndpoint>> = vec![Vec::new(); uids.len()];
            for (c, part) in uids.chunks(chunk).enumerate() {
                view.lookup(part, |e| {
                    let at = c * chunk + e.uid_index as usize;
                    got[at].push(CompactEndpoint { uid_index: 0, ..e })
                });
            }
            if got != eps_of {
                return Err(format!("lookups of {chunk} differ from the map"));
            }
        }
        Ok(())
    }

    /// Readers on other threads look up uids while the writer publishes lists of
    /// several endpoints, releases and reuses entries and builds new tables: each
    /// value a reader gets is one the writer published whole (its endpoints carry
    /// one `owner_seq` and sessions 0..n, in order).
    #[test]
    #[allow(clippy::too_many_lines)] // one scenario, read top-down
    fn concurrent_lookups_see_whole_values_through_rebuilds_and_reuse() {
        const UIDS: usize = 48;
        const READERS: usize = 2;
        let dir = Arc::new(Directory::with_limit(1 << 16));
        let target = Target {
            hash_slot: 3,
            slot_id: 1,
            leader_node_id: 1,
            leader_term: 1,
            config_epoch: 1,
        };
        let mut tw = dir.install(3, target, false, (4, 2 * (UIDS + 1)), filter_limits());
        let uids: Arc<Vec<Uid>> = Arc::new((0..UIDS).map(|i| format!("c{i}").into()).collect());
        let readers: Vec<_> = (0..READERS)
            .map(|_| {
                let (dir, uids) = (dir.clone(), uids.clone());
                std::thread::spawn(move || {
                    let mut got: Vec<CompactEndpoint> = Vec::new();
                    for _ in 0..LOOKUPS {
                        let guard = epoch::pin();
                        let view = dir.state(3, &guard).expect("installed");
                        got.clear();
                        view.lookup(&uids, |e| got.push(e));
                        for run in got.chunk_by(|a, b| a.uid_index == b.uid_index) {
                            for (j, e) in run.iter().enumerate() {
                                assert_eq!(e.session_id, j as u64, "endpoints of two values");
                                assert_eq!(e.owner_seq, run[0].owner_seq, "torn list");
                            }
                        }
                    }
                })
            })
            .collect();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rng = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let mut user_of: Vec<Option<u32>> = vec![None; UIDS];
        let mut free_users: Vec<u32> = (0..UIDS as u32).rev().collect();
        let mut step = 0u64;
        while !readers.iter().all(|r| r.is_finished()) {
            step += 1;
            let k = rng(UIDS as u64) as usize;
            if rng(5) == 0 {
                if let Some(u) = user_of[k].take() {
                    tw.publish(&dir, u, &uids[k], &[]);
                    tw.release(&dir, u);
                    free_users.push(u);
                }
                continue;
            }
            let u = match user_of[k] {
                Some(u) => u,
                None => free_users.pop().expect("a user per uid"),
            };
            user_of[k] = Some(u);
            let eps: Vec<CompactEndpoint> = (0..rng(4))
                .map(|j| CompactEndpoint {
                    session_id: j,
                    owner_seq: step,
                    ..ep(0)
                })
                .collect();
            tw.publish(&dir, u, &uids[k], &eps);
        }
        for r in readers {
            r.join().expect("a reader saw a mixed value");
        }
        tw.check(&dir, |_, _, _| Ok(())).unwrap();
    }

    /// A writer rewrites entries whose every word derives from one number; readers
    /// on other threads must never see words of two numbers (a torn value). The
    /// writer writes until every reader has read `READS` values or failed (no
    /// clock).
    #[test]
    fn concurrent_readers_never_see_a_torn_value() {
        const ENTRIES: usize = 2;
        const READERS: usize = 2;
        let t = Arc::new(Table::with_entries(ENTRIES));
        // Every word but the uid address (0: nothing to release) derives from `x`;
        // count 1: no list.
        let value = |x: u64| {
            let mut v = Value(std::array::from_fn(|k| x.wrapping_mul(k as u64 + 1)));
            v.set(W_UID, 0);
            v.set(W_META, x << 32 | 1);
            v
        };
        // Every entry holds a value of that form before any reader starts (a zeroed
        // entry is not one: reading it is no torn read).
        for i in 0..t.len() {
            t.write(i, &value(0));
        }
        let readers: Vec<_> = (0..READERS)
            .map(|_| {
                let t = t.clone();
                std::thread::spawn(move || {
                    for n in 0..READS {
                        let i = (n % t.len() as u64) as usize;
                        let v = t.read(i);
                        assert_eq!(v, value(v.0[0]), "torn read of entry {i}");
                    }
                })
            })
            .collect();
        let mut x = 0u64;
        while !readers.iter().all(|r| r.is_finished()) {
            x += 1;
            t.write((x % t.len() as u64) as usize, &value(x));
        }
        for r in readers {
            r.join().expect("a reader saw a torn value");
        }
        assert!(x > 0);
    }

    /// A filter's words are the power of two its routes need (at least
    /// `FILTER_ROUTES_MIN` routes), capped at the largest power of two within
    /// `bits_max` (one word at least); `capacity` and `bits` report that size.
    #[test]
    fn a_filter_is_sized_in_powers_of_two_within_its_bound() {
        use super::super::presence::FILTER_ROUTES_MIN;
        // (routes, bits per route, bits_max) -> words
        for (routes, per, max, words) in [
            (0, 16, 1 << 10, 16), // FILTER_ROUTES_MIN routes × 16 bits
            (FILTER_ROUTES_MIN + 1, 16, 1 << 20, 32),
            (1_000, 16, 1 << 20, 256), // 16,000 bits: 250 words, rounded up
            (10_000, 16, 100 * 64, 64), // capped: 100 words, 64 the power of two
            (10_000, 16, 127 * 64 + 63, 64),
            (10_000, 16, 128 * 64, 128),
            (10_000, 16, 63, 1), // less than a word: one word
            (0, 0, 1 << 20, 1),  // 0 bits per route counts as 1: 64 bits
        ] {
            let f = Filter::for_routes(routes, per, max);
            let ctx = format!("{routes} routes × {per} bits within {max}");
            assert_eq!(f.bits(), words * 64, "{ctx}");
            assert_eq!(f.capacity(per), (words * 64 / per.max(1)).max(1), "{ctx}");
        }
        let f = Filter::for_routes(0, 16, 1 << 10);
        assert_eq!((f.bits(), f.capacity(16), f.capacity(0)), (1024, 64, 1024));
        assert_eq!(f.capacity(10_000), 1, "at least one route");
    }

    /// The bits of one key in a filter of one word (as `insert` leaves them).
    fn bits_of_key(key: u32) -> u64 {
        let f = Filter::for_routes(0, 0, 0);
        assert_eq!(f.bits(), 64);
        f.insert(key);
        // SAFETY: `word_ptr` points into `f`'s words, alive until the end of this
        // function.
        unsafe { &*f.word_ptr(key) }.load(Ordering::Relaxed)
    }

    /// A uid sets `FILTER_BITS_PER_UID` bits of its word (fewer only where its
    /// positions coincide), spread over the whole word: no position is taken by
    /// many uids, so the filter rules out most absent uids.
    #[test]
    #[cfg_attr(miri, ignore = "a statistic over 4,096 uids: too slow under miri")]
    fn a_uid_sets_its_own_four_bits_spread_over_the_word() {
        use super::super::presence::FILTER_BITS_PER_UID;
        const KEYS: usize = 4096;
        let (mut four, mut two_or_fewer) = (0, 0);
        let mut by_bit = [0usize; 64];
        for i in 0..KEYS {
            let key = filter_key(uid_hash(&format!("u{i}")));
            let bits = bits_of_key(key);
            let n = bits.count_ones();
            assert!(
                (1..=FILTER_BITS_PER_UID).contains(&n),
                "{key:#x}: {bits:#x}"
            );
            four += usize::from(n == FILTER_BITS_PER_UID);
            two_or_fewer += usize::from(n <= 2);
            for (b, count) in by_bit.iter_mut().enumerate() {
                *count += usize::from(bits >> b & 1 == 1);
            }
        }
        // 4 distinct positions of 64: 91% of the uids
        assert!(four * 100 >= KEYS * 85, "{four} of {KEYS} set 4 bits");
        // Coinciding positions give one bit, never cancel out: 2 distinct positions
        // of 4 are 0.17% of the uids (two that cancelled would make it 1.6%).
        assert!(
            two_or_fewer * 100 <= KEYS / 2,
            "{two_or_fewer} of {KEYS} set 2 bits or fewer"
        );
        // each position: 4/64 of the uids expected, 256 of 4096
        for (b, &count) in by_bit.iter().enumerate() {
            assert!((128..=512).contains(&count), "bit {b} set by {count} uids");
        }
    }
}
