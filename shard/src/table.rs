//! Epoch-reclaimed single-writer / multi-reader hash table.
//!
//! [`epoch_map`] returns one [`MapWriter`] (owned by one thread, typically the
//! shard that owns the data) and a [`MapReader`] that can be cloned to any
//! number of threads.
//!
//! # Contract
//!
//! - **Readers never lock and never wait**, and never make the writer wait:
//!   a lookup is a few atomic loads under a `crossbeam-epoch` pin.
//! - **Values are immutable once published.** An insert of an existing key,
//!   an [`MapWriter::update`] or a remove publishes a new entry (or a
//!   tombstone) with a single pointer store; a reader sees either the whole
//!   old value or the whole new one, never a torn mix.
//! - **Per-key linearizability.** Every write is visible to lookups that start
//!   after it returns; a reader that sees version `n` of a key never sees an
//!   older version afterwards (its later lookups reload the newest table).
//! - **Reclamation.** A replaced or removed entry, and an old slot array after
//!   a rebuild, is freed only after every reader that could have seen it has
//!   unpinned (`crossbeam-epoch` deferred destruction). Values may therefore be
//!   dropped on any thread that collects garbage, hence `K, V: Send`.
//! - **Bounded.** At most `entries_max` live keys: inserting a new key beyond
//!   that returns [`TableFull`] (replacing an existing key always works). The
//!   slot array never exceeds `slots_for(entries_max)` slots.
//! - Dropping the writer and every reader frees every remaining entry (entries
//!   already retired are freed by the epoch collector as usual).
//!
//! # Layout
//!
//! Open addressing with linear probing over a power-of-two number of slots,
//! kept as two arrays: one tag byte per slot (empty, tombstone, or 7 bits of
//! the hash) and one pointer per slot to the boxed `Entry {hash, key, value}`.
//! A probe scans tag bytes (a miss usually reads one cache line of tags and
//! nothing else); only a tag match loads the pointer and compares the cached
//! full hash, then the key. A removed key leaves a tombstone so probe chains
//! stay intact; tombstones ending a run (followed by an empty slot) are turned
//! back into empty slots at once. When live entries plus tombstones would pass
//! 3/4 of the slots, the writer builds new arrays sized for a load of at most
//! 1/2 (dropping tombstones, growing or shrinking), publishes them with one
//! pointer store, and retires the old arrays (the entries themselves move over).

use core::borrow::Borrow;
use core::cell::Cell;
use core::fmt;
use core::hash::{BuildHasher, Hash};
use core::marker::PhantomData;
use core::sync::atomic::{AtomicPtr, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam_epoch::{self as epoch, Guard};

/// Hasher used by [`epoch_map`]: `foldhash`'s fast, per-map randomly seeded
/// hasher (minimally DoS resistant; keys come from clients).
pub type DefaultHashBuilder = foldhash::fast::RandomState;

/// Smallest slot array (slots).
pub const MIN_SLOTS: usize = 8;
/// Largest slot array (slots); `entries_max` is clamped to half of it.
pub const MAX_SLOTS_LIMIT: usize = 1 << (usize::BITS - 6);
/// Rebuild when `(live + tombstones) / slots` would exceed
/// `MAX_LOAD_NUM / MAX_LOAD_DEN`.
const MAX_LOAD_NUM: usize = 3;
const MAX_LOAD_DEN: usize = 4;

/// Returned by [`MapWriter::insert`] when inserting a new key while
/// `entries_max` keys are live.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub struct TableFull;

impl fmt::Display for TableFull {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("table full (entries_max reached)")
    }
}

impl std::error::Error for TableFull {}

/// Number of slots allocated for `entries` entries (load at most 1/2), a power
/// of two in `MIN_SLOTS..=MAX_SLOTS_LIMIT`.
pub fn slots_for(entries: usize) -> usize {
    entries
        .saturating_mul(2)
        .max(MIN_SLOTS)
        .checked_next_power_of_two()
        .unwrap_or(MAX_SLOTS_LIMIT)
        .min(MAX_SLOTS_LIMIT)
}

/// One published key/value pair with its cached hash. Never mutated after
/// publication.
struct Entry<K, V> {
    hash: usize,
    key: K,
    value: V,
}

/// Tag of an empty slot (ends every probe).
const TAG_EMPTY: u8 = 0;
/// Tag of a removed entry's slot (probes continue past it).
const TAG_TOMBSTONE: u8 = 1;

/// Tag of a live slot: the top 7 bits of the hash (the index uses the low
/// bits), with the high bit set so it differs from the two markers.
#[inline(always)]
fn tag_of(hash: usize) -> u8 {
    0x80 | (hash >> (usize::BITS - 7)) as u8
}

/// A slot array: one tag byte per slot (compact, so a probe, and a miss in
/// particular, touches few cache lines) and one entry pointer per slot
/// (non-null exactly when the tag is a live tag, once published). Dropping it
/// does not drop the entries (see [`free_table`]).
struct Table<K, V> {
    tags: Box<[AtomicU8]>,
    entries: Box<[AtomicPtr<Entry<K, V>>]>,
    /// `tags.len() - 1` (the length is a power of two; `entries` has the
    /// same length).
    mask: usize,
}

impl<K, V> Table<K, V> {
    fn new_boxed(n_slots: usize) -> *mut Self {
        debug_assert!(n_slots.is_power_of_two() && n_slots >= MIN_SLOTS);
        let tags = (0..n_slots).map(|_| AtomicU8::new(TAG_EMPTY)).collect();
        let entries = (0..n_slots)
            .map(|_| AtomicPtr::new(core::ptr::null_mut()))
            .collect();
        Box::into_raw(Box::new(Table {
            tags,
            entries,
            mask: n_slots - 1,
        }))
    }

    #[inline(always)]
    fn tag(&self, i: usize) -> &AtomicU8 {
        // SAFETY: `i & mask < tags.len()` because `tags.len() == mask + 1`.
        unsafe { self.tags.get_unchecked(i & self.mask) }
    }

    #[inline(always)]
    fn entry(&self, i: usize) -> &AtomicPtr<Entry<K, V>> {
        // SAFETY: `i & mask < entries.len()` because `entries.len() == mask + 1`.
        unsafe { self.entries.get_unchecked(i & self.mask) }
    }

    /// Publishes `entry` (hash `hash`) in slot `i`: pointer first, then the
    /// tag (Release), so a reader that sees the tag sees the pointer.
    #[inline(always)]
    fn publish(&self, i: usize, hash: usize, entry: *mut Entry<K, V>) {
        self.entry(i).store(entry, Ordering::Release);
        self.tag(i).store(tag_of(hash), Ordering::Release);
    }
}

/// Frees a table and, if `with_entries`, every live entry in it.
///
/// # Safety
/// `table` came from [`Table::new_boxed`], is unreachable for every thread
/// that could still use it, and is freed once; if `with_entries`, so are its
/// live entries (they are not referenced by any other table).
unsafe fn free_table<K, V>(table: *mut Table<K, V>, with_entries: bool) {
    // SAFETY: per the contract, we own the table.
    let table = unsafe { Box::from_raw(table) };
    if with_entries {
        for e in table.entries.iter() {
            let p = e.load(Ordering::Relaxed);
            if !p.is_null() {
                // SAFETY: per the contract, we own the live entries.
                drop(unsafe { Box::from_raw(p) });
            }
        }
    }
}

/// Finds `key` in `table`.
///
/// # Safety
/// Every entry reachable from `table` stays allocated for `'t` (the caller
/// is pinned for `'t`, or is the writer borrowing itself for `'t`).
#[inline(always)]
unsafe fn lookup<'t, K, V, Q>(
    table: &'t Table<K, V>,
    hash: usize,
    key: &Q,
) -> Option<&'t Entry<K, V>>
where
    K: Borrow<Q>,
    Q: ?Sized + Eq,
{
    let tag = tag_of(hash);
    let mut i = hash;
    // At most one pass: the writer always keeps an empty slot, the bound only
    // guards against a reader racing through a stale array forever.
    for _ in 0..=table.mask {
        let t = table.tag(i).load(Ordering::Acquire);
        if t == TAG_EMPTY {
            return None;
        }
        if t == tag {
            // The slot may have changed since the tag load (removed: null;
            // reused: another key): the entry's own hash and key decide.
            let p = table.entry(i).load(Ordering::Acquire);
            if !p.is_null() {
                // SAFETY: `p` was published with a Release store that our
                // Acquire load synchronizes with; it stays allocated for `'t`
                // per this function's contract.
                let entry = unsafe { &*p };
                if entry.hash == hash && entry.key.borrow() == key {
                    return Some(entry);
                }
            }
        }
        i = i.wrapping_add(1);
    }
    None
}

/// State shared by the writer and the readers.
struct Inner<K, V, S> {
    table: AtomicPtr<Table<K, V>>,
    /// Live entries, published by the writer after each change.
    len: AtomicUsize,
    hasher: S,
    /// The map owns boxed entries (drives `Send`/`Sync` and drop check).
    _owns: PhantomData<Box<Entry<K, V>>>,
}

impl<K, V, S: BuildHasher> Inner<K, V, S> {
    #[inline(always)]
    fn hash<Q: ?Sized + Hash>(&self, key: &Q) -> usize {
        self.hasher.hash_one(key) as usize
    }
}

impl<K, V, S> Drop for Inner<K, V, S> {
    fn drop(&mut self) {
        let table = *self.table.get_mut();
        // SAFETY: the last handle is going away (no writer, no reader, no
        // guard borrowing one), so nobody can reach the current table or its
        // entries; retired tables/entries are owned by the epoch collector and
        // are not reachable from here.
        unsafe { free_table(table, true) };
    }
}

/// Creates a table with `initial_capacity` entries' worth of slots (clamped to
/// `entries_max`) that never holds more than `entries_max` keys.
///
/// `entries_max` is clamped to `MAX_SLOTS_LIMIT / 2`; `0` means every new key
/// is refused.
pub fn epoch_map<K, V>(
    initial_capacity: usize,
    entries_max: usize,
) -> (MapWriter<K, V>, MapReader<K, V>)
where
    K: Hash + Eq + Send + Sync + 'static,
    V: Send + Sync + 'static,
{
    epoch_map_with_hasher(initial_capacity, entries_max, DefaultHashBuilder::default())
}

/// [`epoch_map`] with a caller-chosen hasher.
pub fn epoch_map_with_hasher<K, V, S>(
    initial_capacity: usize,
    entries_max: usize,
    hasher: S,
) -> (MapWriter<K, V, S>, MapReader<K, V, S>)
where
    K: Hash + Eq + Send + Sync + 'static,
    V: Send + Sync + 'static,
    S: BuildHasher + Send + Sync + 'static,
{
    let entries_max = entries_max.min(MAX_SLOTS_LIMIT / 2);
    let slots_max = slots_for(entries_max);
    let initial_slots = slots_for(initial_capacity.min(entries_max));
    let inner = Arc::new(Inner {
        table: AtomicPtr::new(Table::new_boxed(initial_slots)),
        len: AtomicUsize::new(0),
        hasher,
        _owns: PhantomData,
    });
    let reader = MapReader {
        inner: Arc::clone(&inner),
    };
    let writer = MapWriter {
        inner,
        live: 0,
        used: 0,
        initial_slots,
        slots_max,
        entries_max,
        _not_sync: PhantomData,
    };
    (writer, reader)
}

/// Where the writer's probe for a key ended.
enum Probe {
    /// The key is in this slot.
    Found(usize),
    /// The key is absent; insert it at `index` (the first tombstone of the
    /// chain if `tombstone`, else the empty slot that ended it).
    Vacant { index: usize, tombstone: bool },
}

/// The single writer of an [`epoch_map`]. `Send` but neither `Sync` nor
/// `Clone`: exactly one thread writes.
pub struct MapWriter<K, V, S = DefaultHashBuilder> {
    inner: Arc<Inner<K, V, S>>,
    /// Live entries.
    live: usize,
    /// Live entries plus tombstones in the current table.
    used: usize,
    initial_slots: usize,
    slots_max: usize,
    entries_max: usize,
    _not_sync: PhantomData<Cell<()>>,
}

impl<K, V, S> MapWriter<K, V, S>
where
    K: Hash + Eq + Send + Sync + 'static,
    V: Send + Sync + 'static,
    S: BuildHasher + Send + Sync + 'static,
{
    #[inline(always)]
    fn table(&self) -> &Table<K, V> {
        // SAFETY: only this writer stores or frees the table pointer, and it
        // frees the current table only through `&mut self`, so the table
        // outlives this `&self` borrow.
        unsafe { &*self.inner.table.load(Ordering::Relaxed) }
    }

    fn probe<Q>(&self, hash: usize, key: &Q) -> Probe
    where
        K: Borrow<Q>,
        Q: ?Sized + Eq,
    {
        let table = self.table();
        let tag = tag_of(hash);
        let mut first_tombstone = None;
        let mut i = hash & table.mask;
        loop {
            let t = table.tag(i).load(Ordering::Relaxed);
            if t == TAG_EMPTY {
                return match first_tombstone {
                    Some(index) => Probe::Vacant {
                        index,
                        tombstone: true,
                    },
                    None => Probe::Vacant {
                        index: i,
                        tombstone: false,
                    },
                };
            }
            if t == TAG_TOMBSTONE {
                first_tombstone.get_or_insert(i);
            } else if t == tag {
                let p = table.entry(i).load(Ordering::Relaxed);
                debug_assert!(!p.is_null());
                // SAFETY: a live entry of the current table (live tag); only
                // this writer frees entries, through `&mut self`.
                let entry = unsafe { &*p };
                if entry.hash == hash && entry.key.borrow() == key {
                    return Probe::Found(i);
                }
            }
            // Terminates: the writer keeps `used <= 3/4` of the slots.
            i = (i + 1) & table.mask;
        }
    }

    /// Inserts or replaces `key`. `Ok(Some(()))` if it replaced a value,
    /// `Ok(None)` if the key is new, `Err(TableFull)` if the key is new and
    /// `entries_max` keys are live (the table is unchanged).
    pub fn insert(&mut self, key: K, value: V) -> Result<Option<()>, TableFull> {
        let hash = self.inner.hash(&key);
        match self.probe(hash, &key) {
            Probe::Found(index) => {
                let new = Box::into_raw(Box::new(Entry { hash, key, value }));
                // Same key, same hash: the tag stays, only the pointer moves.
                let slot = self.table().entry(index);
                let old = slot.load(Ordering::Relaxed);
                slot.store(new, Ordering::Release);
                retire_entry(old);
                Ok(Some(()))
            }
            Probe::Vacant { index, tombstone } => {
                if self.live >= self.entries_max {
                    return Err(TableFull);
                }
                let index = if tombstone {
                    index
                } else {
                    let slots = self.table().mask + 1;
                    let index = if (self.used + 1) * MAX_LOAD_DEN > slots * MAX_LOAD_NUM {
                        self.rebuild(self.live + 1);
                        self.empty_slot(hash)
                    } else {
                        index
                    };
                    self.used += 1;
                    index
                };
                let new = Box::into_raw(Box::new(Entry { hash, key, value }));
                self.table().publish(index, hash, new);
                self.live += 1;
                self.publish_len();
                Ok(None)
            }
        }
    }

    /// Removes `key`; `true` if it was present. The entry is freed after the
    /// readers that could see it have unpinned.
    pub fn remove<Q>(&mut self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: ?Sized + Hash + Eq,
    {
        let hash = self.inner.hash(key);
        let Probe::Found(index) = self.probe(hash, key) else {
            return false;
        };
        let table = self.table();
        let old = table.entry(index).load(Ordering::Relaxed);
        table.tag(index).store(TAG_TOMBSTONE, Ordering::Release);
        table
            .entry(index)
            .store(core::ptr::null_mut(), Ordering::Release);
        // If the next slot is empty, no probe chain runs through `index`: the
        // run of tombstones ending here can become empty slots (a reader that
        // stops at one of them would not have found anything further on).
        let mut freed = 0;
        if table.tag(index + 1).load(Ordering::Relaxed) == TAG_EMPTY {
            let mut i = index;
            while table.tag(i).load(Ordering::Relaxed) == TAG_TOMBSTONE {
                table.tag(i).store(TAG_EMPTY, Ordering::Release);
                freed += 1;
                i = i.wrapping_sub(1);
            }
        }
        self.used -= freed;
        self.live -= 1;
        self.publish_len();
        retire_entry(old);
        true
    }

    /// Replaces the value of `key` by `f(&old)` (copy-on-write: readers keep
    /// seeing the old value until the new one is published). `false` (and `f`
    /// not called) if the key is absent. The key is cloned into the new entry.
    pub fn update<Q, F>(&mut self, key: &Q, f: F) -> bool
    where
        K: Borrow<Q> + Clone,
        Q: ?Sized + Hash + Eq,
        F: FnOnce(&V) -> V,
    {
        let hash = self.inner.hash(key);
        let Probe::Found(index) = self.probe(hash, key) else {
            return false;
        };
        let slot = self.table().entry(index);
        let old = slot.load(Ordering::Relaxed);
        // SAFETY: a live entry of the current table, freed only by this writer.
        let old_entry = unsafe { &*old };
        let new = Box::into_raw(Box::new(Entry {
            hash,
            value: f(&old_entry.value),
            key: old_entry.key.clone(),
        }));
        slot.store(new, Ordering::Release);
        retire_entry(old);
        true
    }

    /// Writer-side lookup (no pin: only this writer frees entries).
    #[inline]
    pub fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: ?Sized + Hash + Eq,
    {
        let hash = self.inner.hash(key);
        // SAFETY: entries of the current table are freed only through
        // `&mut self`, so they outlive this `&self` borrow.
        unsafe { lookup(self.table(), hash, key) }.map(|e| &e.value)
    }

    /// Whether `key` is present (writer side).
    pub fn contains_key<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: ?Sized + Hash + Eq,
    {
        self.get(key).is_some()
    }

    /// Live entries.
    pub fn len(&self) -> usize {
        self.live
    }

    /// Whether no entry is live.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Current number of slots.
    pub fn capacity_slots(&self) -> usize {
        self.table().mask + 1
    }

    /// The configured limit on live entries (after clamping).
    pub fn entries_max(&self) -> usize {
        self.entries_max
    }

    /// Removes every entry: a fresh array of the initial size is published
    /// and the old one with its entries is freed after readers have left.
    pub fn clear(&mut self) {
        let new = Table::new_boxed(self.initial_slots);
        let old = self.inner.table.swap(new, Ordering::AcqRel);
        self.live = 0;
        self.used = 0;
        self.publish_len();
        let old = SendPtr(old);
        let guard = epoch::pin();
        // SAFETY: `old` is no longer reachable from the map; readers that
        // loaded it are pinned and the epoch defers this until they unpin.
        // Its entries are referenced by no other table. `K, V: Send`.
        unsafe { guard.defer_unchecked(move || free_table(old.into_inner(), true)) };
    }

    /// A new reader handle.
    pub fn reader(&self) -> MapReader<K, V, S> {
        MapReader {
            inner: Arc::clone(&self.inner),
        }
    }

    /// Writer-side iteration over live entries, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> + '_ {
        self.table().entries.iter().filter_map(move |slot| {
            let p = slot.load(Ordering::Relaxed);
            if p.is_null() {
                None
            } else {
                // SAFETY: a live entry of the current table, freed only
                // through `&mut self`, which this iterator's borrow excludes.
                let entry = unsafe { &*p };
                Some((&entry.key, &entry.value))
            }
        })
    }

    fn publish_len(&self) {
        self.inner.len.store(self.live, Ordering::Relaxed);
    }

    /// The empty slot where `hash` goes in a table without tombstones in its
    /// chain (right after a rebuild).
    fn empty_slot(&self, hash: usize) -> usize {
        let table = self.table();
        let mut i = hash & table.mask;
        while table.tag(i).load(Ordering::Relaxed) != TAG_EMPTY {
            i = (i + 1) & table.mask;
        }
        i
    }

    /// Moves every live entry into a new array sized for `entries` entries,
    /// publishes it, and retires the old array.
    fn rebuild(&mut self, entries: usize) {
        let n_slots = slots_for(entries)
            .max(self.initial_slots)
            .min(self.slots_max);
        let old_ptr = self.inner.table.load(Ordering::Relaxed);
        let new_ptr = Table::new_boxed(n_slots);
        {
            // SAFETY: the current table, freed only by this writer (below).
            let old = unsafe { &*old_ptr };
            // SAFETY: freshly allocated, not yet shared.
            let new = unsafe { &*new_ptr };
            let mut moved = 0;
            for slot in old.entries.iter() {
                let p = slot.load(Ordering::Relaxed);
                if p.is_null() {
                    continue;
                }
                // SAFETY: a live entry of the current table.
                let hash = unsafe { (*p).hash };
                let mut i = hash & new.mask;
                while new.tag(i).load(Ordering::Relaxed) != TAG_EMPTY {
                    i = (i + 1) & new.mask;
                }
                // Relaxed: the Release store of the table pointer publishes it.
                new.entry(i).store(p, Ordering::Relaxed);
                new.tag(i).store(tag_of(hash), Ordering::Relaxed);
                moved += 1;
            }
            debug_assert_eq!(moved, self.live);
            debug_assert!((self.live + 1) * MAX_LOAD_DEN <= n_slots * MAX_LOAD_NUM);
        }
        self.inner.table.store(new_ptr, Ordering::Release);
        self.used = self.live;
        let old = SendPtr(old_ptr);
        let guard = epoch::pin();
        // SAFETY: the old array is unreachable for new lookups; readers that
        // loaded it are pinned and the epoch defers this until they unpin. Its
        // entries moved to the new array, so only the array is freed.
        unsafe { guard.defer_unchecked(move || free_table(old.into_inner(), false)) };
    }
}

/// Frees an unlinked entry once the readers that could see it have unpinned.
fn retire_entry<K: Send, V: Send>(p: *mut Entry<K, V>) {
    let p = SendPtr(p);
    let guard = epoch::pin();
    // SAFETY: `p` was just unlinked from the table by the only writer, so it is
    // freed exactly once; readers that loaded it are pinned and the epoch
    // defers the free until they unpin. `K, V: Send` (may run on any thread).
    unsafe { guard.defer_unchecked(move || drop(Box::from_raw(p.into_inner()))) };
}

/// A raw pointer moved into a deferred closure.
struct SendPtr<T>(*mut T);

impl<T> SendPtr<T> {
    /// Taking `self` by value makes closures capture the whole wrapper.
    fn into_inner(self) -> *mut T {
        self.0
    }
}

impl<K, V, S> fmt::Debug for MapWriter<K, V, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MapWriter")
            .field("len", &self.live)
            .field("entries_max", &self.entries_max)
            .finish_non_exhaustive()
    }
}

/// A lock-free reader of an [`epoch_map`]. `Clone + Send + Sync`.
pub struct MapReader<K, V, S = DefaultHashBuilder> {
    inner: Arc<Inner<K, V, S>>,
}

impl<K, V, S> Clone for MapReader<K, V, S> {
    fn clone(&self) -> Self {
        MapReader {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<K, V, S> fmt::Debug for MapReader<K, V, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MapReader")
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

impl<K, V, S> MapReader<K, V, S> {
    /// Number of live entries as last published by the writer (approximate
    /// while writes run).
    pub fn len(&self) -> usize {
        self.inner.len.load(Ordering::Relaxed)
    }

    /// Whether [`MapReader::len`] is zero.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<K, V, S> MapReader<K, V, S>
where
    K: Hash + Eq,
    S: BuildHasher,
{
    /// Looks `key` up and applies `f` to its value under a pin (one pin per
    /// call; use [`MapReader::pin`] for batches).
    #[inline]
    pub fn get_with<Q, R, F>(&self, key: &Q, f: F) -> Option<R>
    where
        K: Borrow<Q>,
        Q: ?Sized + Hash + Eq,
        F: FnOnce(&V) -> R,
    {
        let guard = self.pin();
        guard.get(key).map(f)
    }

    /// Whether `key` is present.
    pub fn contains_key<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: ?Sized + Hash + Eq,
    {
        self.get_with(key, |_| ()).is_some()
    }

    /// Pins the current thread for a batch of lookups. Hold it briefly: while
    /// it lives, nothing retired since it was taken can be freed (by any map).
    #[inline]
    pub fn pin(&self) -> ReadGuard<'_, K, V, S> {
        ReadGuard {
            inner: &self.inner,
            guard: epoch::pin(),
        }
    }
}

/// A pinned view for batched lookups; see [`MapReader::pin`]. Every lookup
/// sees the newest published table.
pub struct ReadGuard<'a, K, V, S = DefaultHashBuilder> {
    inner: &'a Inner<K, V, S>,
    guard: Guard,
}

impl<K, V, S> ReadGuard<'_, K, V, S>
where
    K: Hash + Eq,
    S: BuildHasher,
{
    /// Looks `key` up; the value stays valid while this guard lives.
    #[inline]
    pub fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: ?Sized + Hash + Eq,
    {
        let _ = &self.guard;
        let hash = self.inner.hash(key);
        let table = self.inner.table.load(Ordering::Acquire);
        // SAFETY: we are pinned (self.guard) since before this load, so the
        // table and the entries reachable from it are freed (deferred by the
        // writer after unlinking them) only after this guard is dropped, which
        // the `&self` borrow of the result prevents.
        unsafe { lookup(&*table, hash, key) }.map(|e| &e.value)
    }
}

impl<K, V, S> fmt::Debug for ReadGuard<'_, K, V, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadGuard").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Checks the writer's counters against the table and that every live
    /// entry is reachable from its home slot without crossing an empty slot.
    fn check_invariants<K, V, S>(w: &MapWriter<K, V, S>)
    where
        K: Hash + Eq + Send + Sync + 'static,
        V: Send + Sync + 'static,
        S: BuildHasher + Send + Sync + 'static,
    {
        let table = w.table();
        let (mut live, mut tombs) = (0, 0);
        for i in 0..=table.mask {
            let t = table.tag(i).load(Ordering::Relaxed);
            let p = table.entry(i).load(Ordering::Relaxed);
            if t == TAG_EMPTY || t == TAG_TOMBSTONE {
                assert!(p.is_null(), "slot {i}: tag {t} with an entry");
                tombs += usize::from(t == TAG_TOMBSTONE);
                continue;
            }
            live += 1;
            assert!(!p.is_null(), "slot {i}: live tag without entry");
            // SAFETY: live entry of the writer's table.
            let e = unsafe { &*p };
            let hash = w.inner.hash(&e.key);
            assert_eq!(e.hash, hash);
            assert_eq!(t, tag_of(hash));
            let mut j = hash & table.mask;
            while j != i {
                assert_ne!(table.tag(j).load(Ordering::Relaxed), TAG_EMPTY);
                j = (j + 1) & table.mask;
            }
        }
        assert_eq!(live, w.len());
        assert_eq!(live + tombs, w.used);
        assert!(w.used * MAX_LOAD_DEN <= (table.mask + 1) * MAX_LOAD_NUM);
        assert_eq!(w.reader().len(), live);
    }

    /// A hasher that sends every key to the same home slot, to build long
    /// probe chains on purpose.
    #[derive(Clone, Default)]
    struct Collide;
    struct CollideHasher;
    impl core::hash::Hasher for CollideHasher {
        fn finish(&self) -> u64 {
            0
        }
        fn write(&mut self, _: &[u8]) {}
    }
    impl BuildHasher for Collide {
        type Hasher = CollideHasher;
        fn build_hasher(&self) -> CollideHasher {
            CollideHasher
        }
    }

    #[test]
    fn insert_replace_remove_get() {
        let (mut w, r) = epoch_map::<String, u32>(4, 100);
        assert!(w.is_empty());
        assert_eq!(w.insert("a".into(), 1), Ok(None));
        assert_eq!(w.insert("b".into(), 2), Ok(None));
        assert_eq!(w.get("a"), Some(&1));
        assert_eq!(r.get_with("b", |v| *v), Some(2));
        assert_eq!(w.insert("a".into(), 10), Ok(Some(())));
        assert_eq!(w.get("a"), Some(&10));
        assert_eq!(r.get_with("a", |v| *v), Some(10));
        assert_eq!(w.len(), 2);
        assert_eq!(r.len(), 2);
        assert!(w.remove("a"));
        assert!(!w.remove("a"));
        assert!(!w.remove("zzz"));
        assert_eq!(w.get("a"), None);
        assert_eq!(r.get_with("a", |v| *v), None);
        assert!(!r.contains_key("a"));
        assert!(r.contains_key("b"));
        assert_eq!(w.len(), 1);
        let g = r.pin();
        assert_eq!(g.get("b"), Some(&2));
        assert_eq!(g.get("c"), None);
        drop(g);
        check_invariants(&w);
    }

    #[test]
    fn tombstones_keep_probe_chains() {
        let (mut w, r) = epoch_map_with_hasher::<u32, u32, _>(16, 16, Collide);
        for k in 0..10 {
            assert_eq!(w.insert(k, k * 10), Ok(None));
        }
        // Remove from the middle of the single chain: later keys stay reachable.
        for k in [2, 5, 7] {
            assert!(w.remove(&k));
            check_invariants(&w);
        }
        for k in 0..10 {
            let want = if [2, 5, 7].contains(&k) {
                None
            } else {
                Some(k * 10)
            };
            assert_eq!(w.get(&k).copied(), want);
            assert_eq!(r.get_with(&k, |v| *v), want);
        }
        assert_eq!(w.used, 10, "3 tombstones inside the chain");
        // A re-insert reuses the first tombstone of the chain.
        assert_eq!(w.insert(42, 420), Ok(None));
        assert_eq!(w.used, 10);
        // Removing the tail of the chain turns the trailing tombstones empty.
        assert!(w.remove(&9));
        assert!(w.remove(&8));
        assert_eq!(
            w.used, 7,
            "9, 8 and 7's tombstone (then last of its run) freed"
        );
        check_invariants(&w);
        // Remove everything: all slots end up empty.
        for k in [0, 1, 3, 4, 6, 42] {
            assert!(w.remove(&k));
            check_invariants(&w);
        }
        assert_eq!(w.used, 0);
        assert!(w.is_empty());
    }

    #[test]
    fn grows_through_several_resizes() {
        let n: u64 = if cfg!(miri) { 200 } else { 20_000 };
        let (mut w, r) = epoch_map::<u64, u64>(1, n as usize);
        assert_eq!(w.capacity_slots(), MIN_SLOTS);
        let mut resizes = 0;
        let mut slots = w.capacity_slots();
        for k in 0..n {
            assert_eq!(w.insert(k, k + 1), Ok(None));
            if w.capacity_slots() != slots {
                slots = w.capacity_slots();
                resizes += 1;
            }
        }
        assert!(resizes >= 4, "{resizes}");
        check_invariants(&w);
        let g = r.pin();
        for k in 0..n {
            assert_eq!(w.get(&k), Some(&(k + 1)));
            assert_eq!(g.get(&k), Some(&(k + 1)));
        }
        assert_eq!(g.get(&n), None);
        drop(g);
        assert_eq!(w.iter().count(), n as usize);
        let sum: u64 = w.iter().map(|(k, v)| v - k).sum();
        assert_eq!(sum, n);
    }

    #[test]
    fn churn_rebuild_drops_tombstones() {
        let n = if cfg!(miri) { 64 } else { 4096 };
        let (mut w, _r) = epoch_map_with_hasher::<u32, u32, _>(
            8,
            2 * n,
            foldhash::fast::FixedState::with_seed(1),
        );
        for k in 0..n as u32 {
            w.insert(k, k).unwrap();
        }
        for k in 0..n as u32 - 4 {
            assert!(w.remove(&k));
        }
        check_invariants(&w);
        assert_eq!(w.len(), 4);
        assert!(w.used > w.len(), "some tombstones stay inside runs");
        // New keys fill empty slots until the load (tombstones included)
        // triggers a rebuild, which leaves no tombstone.
        let slots = w.capacity_slots();
        let mut k = 1_000_000;
        while w.used != w.len() {
            assert!(
                k < 1_000_000 + slots as u32,
                "no rebuild after {slots} inserts"
            );
            w.insert(k, k).unwrap();
            k += 1;
        }
        assert_eq!(w.capacity_slots(), slots_for(w.len()).max(slots_for(8)));
        check_invariants(&w);
        for k in n as u32 - 4..n as u32 {
            assert_eq!(w.get(&k), Some(&k));
        }
        // Churn never grows the array: live stays small.
        let slots = w.capacity_slots();
        for k in 0..4 * n as u32 {
            w.insert(k + 2_000_000, k).unwrap();
            assert!(w.remove(&(k + 2_000_000)));
        }
        assert!(w.capacity_slots() <= slots);
        check_invariants(&w);
    }

    #[test]
    fn clear_then_reuse() {
        let (mut w, r) = epoch_map::<u32, String>(4, 1000);
        for k in 0..100 {
            w.insert(k, k.to_string()).unwrap();
        }
        let g = r.pin();
        let held = g.get(&7).unwrap();
        w.clear();
        // A value seen before the clear stays valid while pinned.
        assert_eq!(held, "7");
        drop(g);
        assert!(w.is_empty());
        assert_eq!(r.len(), 0);
        assert_eq!(w.get(&7), None);
        assert_eq!(r.get_with(&7, |v| v.clone()), None);
        assert_eq!(w.capacity_slots(), slots_for(4));
        w.insert(7, "seven".into()).unwrap();
        assert_eq!(r.get_with(&7, |v| v.clone()).as_deref(), Some("seven"));
        check_invariants(&w);
    }

    /// A tag is the hash's top 7 bits with the high bit set: independent of the
    /// low bits the index uses (else a probe's tags would all match) and never a
    /// marker.
    #[test]
    fn tags_are_the_top_seven_bits_of_the_hash() {
        assert_eq!(tag_of(usize::MAX), 0xFF);
        assert_eq!(tag_of(1 << (usize::BITS - 1)), 0xC0);
        assert_eq!(tag_of(1 << (usize::BITS - 7)), 0x81);
        assert_eq!(tag_of(usize::MAX >> 7), 0x80, "the low bits do not count");
        for h in [0, 1, usize::MAX] {
            assert!(tag_of(h) != TAG_EMPTY && tag_of(h) != TAG_TOMBSTONE);
        }
    }

    /// The table grows when an insert would take its slots in use past 3/4:
    /// 8 slots hold 6 entries and the 7th rebuilds to 16, which hold 12 and the
    /// 13th rebuilds to 32 (each rebuild sized for the entries it holds, load at
    /// most 1/2).
    #[test]
    fn the_table_grows_past_three_quarters_in_use() {
        let (mut w, _r) = epoch_map::<u32, u32>(0, 1 << 10);
        let mut capacity = Vec::new();
        for k in 0..13 {
            assert_eq!(w.insert(k, k), Ok(None));
            capacity.push(w.capacity_slots());
        }
        let want: Vec<usize> = (1..=13)
            .map(|n| match n {
                1..=6 => 8,
                7..=12 => 16,
                _ => 32,
            })
            .collect();
        assert_eq!(capacity, want);
        check_invariants(&w);
    }

    #[test]
    fn max_entries_gives_table_full() {
        let (mut w, r) = epoch_map::<u32, u32>(2, 5);
        for k in 0..5 {
            assert_eq!(w.insert(k, k), Ok(None));
        }
        assert_eq!(w.insert(5, 5), Err(TableFull));
        // The error names the limit (it reaches logs and refusals as text).
        assert_eq!(TableFull.to_string(), "table full (entries_max reached)");
        assert_eq!(w.len(), 5);
        assert_eq!(w.get(&5), None);
        // Replacing an existing key still works at the limit.
        assert_eq!(w.insert(4, 40), Ok(Some(())));
        assert_eq!(r.get_with(&4, |v| *v), Some(40));
        assert!(w.remove(&0));
        assert_eq!(w.insert(5, 5), Ok(None));
        assert!(w.capacity_slots() <= slots_for(5));
        check_invariants(&w);

        let (mut zero, _) = epoch_map::<u32, u32>(10, 0);
        assert_eq!(zero.insert(1, 1), Err(TableFull));
        assert_eq!(zero.entries_max(), 0);

        let (huge, _) = epoch_map::<u32, u32>(0, usize::MAX);
        assert_eq!(huge.entries_max(), MAX_SLOTS_LIMIT / 2);
        assert_eq!(huge.capacity_slots(), MIN_SLOTS);
    }

    #[test]
    fn update_is_copy_on_write() {
        let (mut w, r) = epoch_map::<String, Vec<u32>>(4, 10);
        w.insert("k".into(), vec![1]).unwrap();
        let g = r.pin();
        let before = g.get("k").unwrap();
        assert!(w.update("k", |v| {
            let mut v = v.clone();
            v.push(2);
            v
        }));
        // The pinned reader still holds the old value, intact.
        assert_eq!(before, &[1]);
        assert_eq!(g.get("k").unwrap(), &[1, 2]);
        drop(g);
        assert_eq!(w.get("k").unwrap(), &[1, 2]);
        let mut called = false;
        assert!(!w.update("missing", |v| {
            called = true;
            v.clone()
        }));
        assert!(!called);
        assert_eq!(w.len(), 1);
        check_invariants(&w);
    }

    #[test]
    fn small_random_ops_match_std_hashmap() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = std::env::var("TABLE_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(7);
        println!("TABLE_SEED={seed}");
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let ops = if cfg!(miri) { 300 } else { 20_000 };
        let max = 64;
        let (mut w, r) = epoch_map_with_hasher::<u16, u32, _>(
            2,
            max,
            foldhash::fast::FixedState::with_seed(seed),
        );
        let mut model = HashMap::new();
        for step in 0..ops {
            let k: u16 = rng.gen_range(0..100);
            match rng.gen_range(0..10) {
                0..=4 => {
                    let v: u32 = rng.gen();
                    let got = w.insert(k, v);
                    let want = if model.contains_key(&k) {
                        Ok(Some(()))
                    } else if model.len() >= max {
                        Err(TableFull)
                    } else {
                        Ok(None)
                    };
                    assert_eq!(got, want, "seed {seed} step {step}");
                    if got.is_ok() {
                        model.insert(k, v);
                    }
                }
                5..=7 => assert_eq!(
                    w.remove(&k),
                    model.remove(&k).is_some(),
                    "seed {seed} step {step}"
                ),
                8 => {
                    let got = w.update(&k, |v| v.wrapping_add(1));
                    let want = model.get_mut(&k).map(|v| *v = v.wrapping_add(1)).is_some();
                    assert_eq!(got, want, "seed {seed} step {step}");
                }
                _ => {
                    if rng.gen_range(0..50) == 0 {
                        w.clear();
                        model.clear();
                    }
                }
            }
            assert_eq!(w.get(&k), model.get(&k), "seed {seed} step {step}");
            assert_eq!(
                r.get_with(&k, |v| *v),
                model.get(&k).copied(),
                "seed {seed} step {step}"
            );
            assert_eq!(w.len(), model.len(), "seed {seed} step {step}");
        }
        check_invariants(&w);
        let mut all: Vec<_> = w.iter().map(|(k, v)| (*k, *v)).collect();
        all.sort_unstable();
        let mut want: Vec<_> = model.into_iter().collect();
        want.sort_unstable();
        assert_eq!(all, want, "seed {seed}");
    }
}
