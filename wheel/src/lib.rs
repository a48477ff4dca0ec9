//! Hierarchical timer wheel with exact firing (time passed in, no clock inside).
//!
//! Modelled on the Linux kernel's non-cascading timer wheel (`kernel/time/timer.c`,
//! 2016 rework): [`LEVELS`] levels of [`LVL_SIZE`] = 64 buckets, level `L` has a
//! granularity of `8^L` ticks ([`LVL_CLK_SHIFT`] = 3), and every level keeps a
//! bitmap of its occupied buckets so a pass goes straight to the due buckets
//! without scanning empty ones. Entries live in a slab (one `Vec`, grown up to
//! `timers_max`, reused through a free list); a bucket is an array of slab
//! indices and every entry knows its position in it, so insert is a push,
//! cancel and reschedule a swap-remove: O(1), without allocation once the slab
//! and the bucket arrays have reached their peak sizes. (Index arrays rather
//! than intrusive linked lists: a pass reads a due bucket sequentially and
//! the slab loads of its entries are independent, so their cache misses
//! overlap instead of being chased one after another.)
//!
//! # Contract
//!
//! - Ticks are plain `u64` values in the caller's unit (ms, s, ...). The wheel
//!   never reads a clock; `now` only moves through [`TimerWheel::advance`].
//! - **Exact firing** (unlike Linux, which fires coarse timers late):
//!   `advance(now, f)` calls `f` exactly once for every live timer whose
//!   deadline is `<= now`, and for no other timer. A timer inserted (or
//!   rescheduled) with a deadline `<= now()` is due at the next `advance`.
//!   The firing order is unspecified (not sorted by deadline).
//! - Exactness is obtained by a *lazy cascade*: a timer sits in the finest level
//!   whose 64-bucket window covers its deadline, in the bucket of its deadline
//!   rounded down to that level's granularity. When that coarse bucket comes
//!   due, its entries with `deadline <= now` fire and the others are
//!   re-inserted at the finer level that fits their remaining time. Only
//!   entries of due buckets are touched, and each entry moves down at most once
//!   per level, so the cost of a pass is `O(due buckets + fired + recascaded)`.
//! - Deadlines beyond the top level's window (`64 * 8^(LEVELS-1)` = 2^30 ticks
//!   ahead) are clamped into the last bucket of the top level's window and
//!   re-placed when that bucket comes due (one extra move per 2^30 - 2^24
//!   ticks of distance); they still fire exactly on time.
//! - A [`TimerHandle`] stays valid for [`TimerWheel::cancel`],
//!   [`TimerWheel::get`] and [`TimerWheel::reschedule`] until its timer fires or
//!   is cancelled. Afterwards it is stale: every operation on it is a no-op
//!   (`None` / `false`), even when its slab slot has been reused by a new timer
//!   (handles carry a 32-bit generation; a stale handle could only alias after
//!   2^32 reuses of the same slot).
//! - Memory: the slab never exceeds `timers_max` entries; a bucket array that
//!   empties keeps at most `max(BUCKET_RETAIN_MIN_ENTRIES, timers_max / 64)`
//!   slots of capacity.
//! - `now` never goes backward: `advance` with a smaller `now` is a caller bug
//!   (`debug_assert`); in release builds it is treated as the current `now`.

#![warn(clippy::too_many_lines)] // every function at most 80 code lines (clippy.toml)

/// log2 of the number of buckets per level.
pub const LVL_BITS: u32 = 6;
/// Buckets per level.
pub const LVL_SIZE: usize = 1 << LVL_BITS;
/// Each level is `2^LVL_CLK_SHIFT` = 8 times coarser than the one below.
pub const LVL_CLK_SHIFT: u32 = 3;
/// Number of levels. The top level's granularity is `8^(LEVELS-1)` = 2^24
/// ticks and its window `64 * 2^24` = 2^30 ticks.
pub const LEVELS: usize = 9;
/// Largest accepted `timers_max` (slab indices are `u32`, one value is the
/// free-list terminator). A larger request is clamped to this.
pub const MAX_TIMERS_LIMIT: usize = (u32::MAX - 1) as usize;
/// Slab slots reserved up front by [`TimerWheel::new`] (never more than
/// `timers_max`); the slab grows on demand beyond this, up to `timers_max`.
pub const INITIAL_SLAB_ENTRIES: usize = 1024;
/// Capacity an emptied bucket array may always keep (see the memory bound in
/// the module documentation).
pub const BUCKET_RETAIN_MIN_ENTRIES: usize = 64;

const LVL_MASK: u64 = (LVL_SIZE as u64) - 1;
const NUM_BUCKETS: usize = LEVELS * LVL_SIZE;
/// Location of entries whose deadline was already `<= now` when inserted.
const LOC_DUE: u16 = NUM_BUCKETS as u16;
/// Location of a free slab slot.
const LOC_FREE: u16 = u16::MAX;
/// Free list terminator.
const NIL: u32 = u32::MAX;

/// Identifies one scheduled timer: slab index plus the slot's generation, so a
/// handle of a fired or cancelled timer never reaches the timer that reused
/// its slot.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct TimerHandle {
    index: u32,
    generation: u32,
}

/// Returned by [`TimerWheel::insert`] when `timers_max` timers are live; the
/// value is handed back. (`Debug` does not require `T: Debug`, so `unwrap`
/// works for any value type.)
pub struct TimerFull<T>(pub T);

impl<T> std::fmt::Debug for TimerFull<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TimerFull(..)")
    }
}

impl<T> std::fmt::Display for TimerFull<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("timer wheel full (timers_max live timers)")
    }
}

impl<T> std::error::Error for TimerFull<T> {}

/// Cumulative work counters of [`TimerWheel::advance`] (since creation or
/// [`TimerWheel::reset_stats`]).
#[derive(Clone, Copy, Default, Debug)]
pub struct WheelStats {
    /// Due buckets emptied (including the list of timers inserted already due).
    pub buckets_visited: u64,
    /// Entries taken out of due buckets (fired + recascaded).
    pub entries_visited: u64,
    /// Timers fired.
    pub fired: u64,
    /// Entries re-inserted at a finer level because their deadline was still
    /// in the future when their coarse bucket came due.
    pub recascaded: u64,
}

struct Entry<T> {
    deadline: u64,
    /// `Some` exactly while the slot is live.
    value: Option<T>,
    /// Position in its bucket array when live, next free slot when free.
    pos: u32,
    generation: u32,
    /// Bucket index (`level * 64 + slot`), [`LOC_DUE`] or [`LOC_FREE`].
    loc: u16,
}

/// A hierarchical timer wheel holding up to `timers_max` timers with values
/// of type `T`. See the [module documentation](self) for the contract.
pub struct TimerWheel<T> {
    now: u64,
    slab: Vec<Entry<T>>,
    free_head: u32,
    len: usize,
    timers_max: usize,
    /// Slab indices per bucket: `NUM_BUCKETS` wheel buckets plus the due list.
    buckets: Box<[Vec<u32>]>,
    /// Capacity an emptied bucket array keeps.
    retain_entries: usize,
    /// Per level, bit `i` set iff bucket `i` of that level is non-empty.
    occupied: [u64; LEVELS],
    /// Lower bound of the deadlines in the due list (valid while non-empty).
    due_min: u64,
    stats: WheelStats,
}

/// How many entries ahead a pass prefetches slab entries of a due bucket.
const PREFETCH_AHEAD_ENTRIES: usize = 8;

/// Hints the CPU to load the cache line at `p` (no effect on other targets).
#[inline(always)]
fn prefetch<U>(p: *const U) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is only a hint: it never faults and never reads
    // memory architecturally, whatever the address.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[inline]
fn level_shift(level: usize) -> u32 {
    level as u32 * LVL_CLK_SHIFT
}

/// The bucket (`level * 64 + index`) for `deadline > now`: the finest level
/// whose 64-slot window ahead of `now` contains the deadline's slot, clamped to
/// the top level's last slot for deadlines beyond the window.
#[inline]
fn bucket_for(deadline: u64, now: u64) -> usize {
    debug_assert!(deadline > now);
    let delta = deadline - now;
    let bits = u64::BITS - delta.leading_zeros();
    // Smallest level with delta < 64 << shift; the slot difference there is
    // at most 64, and at the next level at most 8, so one bump suffices.
    let mut level = if bits <= LVL_BITS {
        0
    } else {
        (bits - LVL_BITS).div_ceil(LVL_CLK_SHIFT) as usize
    };
    if level < LEVELS {
        let shift = level_shift(level);
        if (deadline >> shift) - (now >> shift) > LVL_MASK {
            level += 1;
        }
    }
    if level >= LEVELS {
        let top = LEVELS - 1;
        let slot = (now >> level_shift(top)) + LVL_MASK;
        return top * LVL_SIZE + (slot & LVL_MASK) as usize;
    }
    let shift = level_shift(level);
    debug_assert!((deadline >> shift) > (now >> shift));
    debug_assert!((deadline >> shift) - (now >> shift) <= LVL_MASK);
    level * LVL_SIZE + ((deadline >> shift) & LVL_MASK) as usize
}

impl<T> TimerWheel<T> {
    /// An empty wheel whose current time is `now_tick`, holding at most
    /// `timers_max` live timers (clamped to [`MAX_TIMERS_LIMIT`]).
    pub fn new(now_tick: u64, timers_max: usize) -> Self {
        let timers_max = timers_max.min(MAX_TIMERS_LIMIT);
        TimerWheel {
            now: now_tick,
            slab: Vec::with_capacity(timers_max.min(INITIAL_SLAB_ENTRIES)),
            free_head: NIL,
            len: 0,
            timers_max,
            buckets: (0..=NUM_BUCKETS).map(|_| Vec::new()).collect(),
            retain_entries: BUCKET_RETAIN_MIN_ENTRIES.max(timers_max >> LVL_BITS),
            occupied: [0; LEVELS],
            due_min: u64::MAX,
            stats: WheelStats::default(),
        }
    }

    /// Reserves slab room for `additional` more timers (bounded by
    /// `timers_max`) so later inserts do not allocate.
    pub fn reserve(&mut self, additional: usize) {
        let target = self.len.saturating_add(additional).min(self.timers_max);
        if target > self.slab.len() {
            self.slab.reserve_exact(target - self.slab.len());
        }
    }

    /// Schedules `value` at `deadline_tick`. A deadline `<= now()` is due at
    /// the next [`advance`](Self::advance). O(1); allocates only when the slab
    /// or the target bucket's array grows past its peak size. Fails with the
    /// value handed back when `timers_max` timers are live.
    pub fn insert(&mut self, deadline_tick: u64, value: T) -> Result<TimerHandle, TimerFull<T>> {
        let index = if self.free_head != NIL {
            let index = self.free_head;
            let e = &mut self.slab[index as usize];
            debug_assert_eq!(e.loc, LOC_FREE);
            self.free_head = e.pos;
            e.deadline = deadline_tick;
            e.value = Some(value);
            index
        } else {
            if self.slab.len() >= self.timers_max {
                return Err(TimerFull(value));
            }
            if self.slab.len() == self.slab.capacity() {
                // Grow geometrically but never past timers_max.
                let room = self
                    .slab
                    .capacity()
                    .max(16)
                    .min(self.timers_max - self.slab.len());
                self.slab.reserve_exact(room);
            }
            let index = self.slab.len() as u32;
            self.slab.push(Entry {
                deadline: deadline_tick,
                value: Some(value),
                pos: NIL,
                generation: 0,
                loc: LOC_FREE,
            });
            index
        };
        self.len += 1;
        self.link(index, deadline_tick);
        Ok(TimerHandle {
            index,
            generation: self.slab[index as usize].generation,
        })
    }

    /// Removes the timer and returns its value; `None` if the handle is stale
    /// (already fired or cancelled). O(1).
    pub fn cancel(&mut self, handle: TimerHandle) -> Option<T> {
        self.live_index(handle)?;
        self.unlink(handle.index);
        Some(self.free(handle.index))
    }

    /// Moves a live timer to `new_deadline_tick` (due at the next `advance`
    /// if `<= now()`), keeping its handle, slot and value. O(1); a move within
    /// the same bucket only updates the deadline; otherwise it allocates only
    /// if the target bucket's array grows past its peak size.
    /// Returns `false` (and does nothing) if the handle is stale.
    pub fn reschedule(&mut self, handle: TimerHandle, new_deadline_tick: u64) -> bool {
        if self.live_index(handle).is_none() {
            return false;
        }
        let index = handle.index;
        let new_loc = if new_deadline_tick <= self.now {
            LOC_DUE
        } else {
            bucket_for(new_deadline_tick, self.now) as u16
        };
        let e = &mut self.slab[index as usize];
        if e.loc == new_loc {
            e.deadline = new_deadline_tick;
            if new_loc == LOC_DUE {
                self.due_min = self.due_min.min(new_deadline_tick);
            }
            return true;
        }
        self.unlink(index);
        self.slab[index as usize].deadline = new_deadline_tick;
        self.link(index, new_deadline_tick);
        true
    }

    /// The value of a live timer; `None` if the handle is stale.
    pub fn get(&self, handle: TimerHandle) -> Option<&T> {
        let e = self.slab.get(handle.index as usize)?;
        if e.generation != handle.generation {
            return None;
        }
        e.value.as_ref()
    }

    /// The value of a live timer; `None` if the handle is stale.
    pub fn get_mut(&mut self, handle: TimerHandle) -> Option<&mut T> {
        let e = self.slab.get_mut(handle.index as usize)?;
        if e.generation != handle.generation {
            return None;
        }
        e.value.as_mut()
    }

    /// The deadline of a live timer; `None` if the handle is stale.
    pub fn deadline(&self, handle: TimerHandle) -> Option<u64> {
        self.live_index(handle)?;
        Some(self.slab[handle.index as usize].deadline)
    }

    /// Moves time to `now_tick` and calls `fire(handle, deadline, value)`
    /// exactly once for every timer with `deadline <= now_tick` (in no
    /// particular order); returns how many fired. The handle passed to `fire`
    /// is already stale. Work is proportional to the due buckets and the
    /// entries in them, never to the number of live timers. A `now_tick`
    /// smaller than [`now`](Self::now) is a caller bug (debug assertion) and
    /// is treated as `now()`. `fire` cannot reach the wheel; if it panics,
    /// the wheel is left inconsistent and must be dropped.
    pub fn advance<F: FnMut(TimerHandle, u64, T)>(&mut self, now_tick: u64, mut fire: F) -> usize {
        debug_assert!(
            now_tick >= self.now,
            "timer wheel time went backward: {} < {}",
            now_tick,
            self.now
        );
        let old = self.now;
        let now = now_tick.max(old);
        self.now = now;
        let mut fired = 0usize;

        // Timers inserted already due.
        if !self.buckets[NUM_BUCKETS].is_empty() {
            self.due_min = u64::MAX;
            fired += self.drain_bucket(NUM_BUCKETS, &mut fire);
        }

        // Levels from fine to coarse: a recascaded entry only moves to a finer
        // level (already processed, and into a slot after `now`), or, when
        // clamped beyond the top window, to the top level's last slot
        // `now_slot + 63`, whose bucket is drained first if it is due.
        for level in 0..LEVELS {
            let shift = level_shift(level);
            let old_slot = old >> shift;
            let new_slot = now >> shift;
            if new_slot == old_slot {
                break; // Coarser levels did not move either.
            }
            let elapsed = new_slot - old_slot;
            let window = if elapsed > LVL_MASK {
                u64::MAX
            } else {
                ((1u64 << elapsed) - 1).rotate_left(((old_slot + 1) & LVL_MASK) as u32)
            };
            let mut due = self.occupied[level] & window;
            if due == 0 {
                continue;
            }
            self.occupied[level] &= !due;
            if level == LEVELS - 1 {
                let clamp_bit = (new_slot + LVL_MASK) & LVL_MASK;
                if due & (1 << clamp_bit) != 0 {
                    due &= !(1 << clamp_bit);
                    fired += self.drain_bucket(level * LVL_SIZE + clamp_bit as usize, &mut fire);
                }
            }
            while due != 0 {
                let bit = due.trailing_zeros() as usize;
                due &= due - 1;
                fired += self.drain_bucket(level * LVL_SIZE + bit, &mut fire);
            }
        }
        fired
    }

    /// A lower bound of the earliest live deadline (never later than it):
    /// exact for timers within 64 ticks, the start of the bucket's granule
    /// for coarser ones (advancing to it recascades them and the next call is
    /// closer). `None` if the wheel is empty. Cost: one bitmap scan per level.
    pub fn next_deadline(&self) -> Option<u64> {
        let mut best = if !self.buckets[NUM_BUCKETS].is_empty() {
            Some(self.due_min)
        } else {
            None
        };
        for level in 0..LEVELS {
            let bits = self.occupied[level];
            if bits == 0 {
                continue;
            }
            let shift = level_shift(level);
            let cur = self.now >> shift;
            // Occupied slots are in (cur, cur + 63]; find the first after cur.
            let rotated = bits.rotate_right(((cur + 1) & LVL_MASK) as u32);
            let slot = cur + 1 + u64::from(rotated.trailing_zeros());
            let start = slot << shift;
            best = Some(best.map_or(start, |b: u64| b.min(start)));
        }
        best
    }

    /// Number of live timers.
    pub fn len(&self) -> usize {
        self.len
    }

    /// `true` if no timer is live.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The current time (the largest `now_tick` passed to `advance`, or the
    /// one given to `new`).
    pub fn now(&self) -> u64 {
        self.now
    }

    /// The configured limit of live timers.
    pub fn timers_max(&self) -> usize {
        self.timers_max
    }

    /// Work counters accumulated by `advance`.
    pub fn stats(&self) -> WheelStats {
        self.stats
    }

    /// Zeroes the work counters.
    pub fn reset_stats(&mut self) {
        self.stats = WheelStats::default();
    }

    /// Checks every internal invariant (list links, bitmaps, slot placement,
    /// free list, len). O(slab size): a diagnostic for tests, not for hot
    /// paths. Returns a description of the first violation found.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut seen = vec![false; self.slab.len()];
        let mut live = 0usize;
        for (b, bucket) in self.buckets.iter().enumerate() {
            if b < NUM_BUCKETS {
                let level = b / LVL_SIZE;
                let bit = (self.occupied[level] >> (b % LVL_SIZE)) & 1 == 1;
                if bit == bucket.is_empty() {
                    return Err(format!(
                        "bucket {b}: bitmap bit {bit} disagrees with its array"
                    ));
                }
            }
            for (pos, &index) in bucket.iter().enumerate() {
                let e = self
                    .slab
                    .get(index as usize)
                    .ok_or_else(|| format!("bucket {b}: index {index} out of slab"))?;
                if std::mem::replace(&mut seen[index as usize], true) {
                    return Err(format!("entry {index} linked twice"));
                }
                if e.pos as usize != pos || usize::from(e.loc) != b || e.value.is_none() {
                    return Err(format!("entry {index}: bad pos/loc/value in bucket {b}"));
                }
                self.check_placement(index, b, e.deadline)?;
                live += 1;
            }
        }
        if live != self.len {
            return Err(format!("len {} but {live} linked entries", self.len));
        }
        let free = self.check_free_list(&mut seen)?;
        if free + live != self.slab.len() {
            return Err(format!(
                "{} slots, {live} live, {free} free",
                self.slab.len()
            ));
        }
        Ok(())
    }

    /// [`Self::check_invariants`]: an entry of bucket `b` (the due list at
    /// `NUM_BUCKETS`) sits where its deadline puts it.
    fn check_placement(&self, index: u32, b: usize, deadline: u64) -> Result<(), String> {
        if b == NUM_BUCKETS {
            if deadline > self.now || deadline < self.due_min {
                return Err(format!("entry {index}: due list holds deadline {deadline}"));
            }
            return Ok(());
        }
        // The bucket's slot is the unique one in (cur, cur + 63] with its index; it
        // must be the deadline's slot (or, in the top level, any slot not after it:
        // clamped entries).
        let level = b / LVL_SIZE;
        let shift = level_shift(level);
        let cur_slot = self.now >> shift;
        let ahead = ((b % LVL_SIZE) as u64).wrapping_sub(cur_slot) & LVL_MASK;
        let ahead = if ahead == 0 { LVL_SIZE as u64 } else { ahead };
        let slot = cur_slot + ahead;
        let d_slot = deadline >> shift;
        let placed_ok = deadline > self.now
            && ahead <= LVL_MASK
            && (slot == d_slot || (level == LEVELS - 1 && slot < d_slot));
        if !placed_ok {
            return Err(format!(
                "entry {index}: deadline {deadline} misplaced in bucket {b} at now {}",
                self.now
            ));
        }
        Ok(())
    }

    /// [`Self::check_invariants`]: the free list links free, empty entries no
    /// bucket holds (marked in `seen`); returns how many.
    fn check_free_list(&self, seen: &mut [bool]) -> Result<usize, String> {
        let mut cur = self.free_head;
        let mut free = 0usize;
        while cur != NIL {
            let e = self
                .slab
                .get(cur as usize)
                .ok_or_else(|| format!("free index {cur} out of slab"))?;
            if std::mem::replace(&mut seen[cur as usize], true)
                || e.loc != LOC_FREE
                || e.value.is_some()
            {
                return Err(format!("free entry {cur} corrupt"));
            }
            free += 1;
            cur = e.pos;
        }
        Ok(free)
    }

    #[inline]
    fn live_index(&self, handle: TimerHandle) -> Option<usize> {
        let e = self.slab.get(handle.index as usize)?;
        (e.generation == handle.generation && e.loc != LOC_FREE).then_some(handle.index as usize)
    }

    /// Links slab entry `index` (in no bucket) into the bucket for `deadline`.
    #[inline]
    fn link(&mut self, index: u32, deadline: u64) {
        let loc = if deadline <= self.now {
            self.due_min = self.due_min.min(deadline);
            NUM_BUCKETS
        } else {
            let b = bucket_for(deadline, self.now);
            self.occupied[b / LVL_SIZE] |= 1u64 << (b % LVL_SIZE);
            b
        };
        let bucket = &mut self.buckets[loc];
        let e = &mut self.slab[index as usize];
        e.pos = bucket.len() as u32;
        e.loc = loc as u16;
        bucket.push(index);
    }

    /// Removes live slab entry `index` from its bucket (swap-remove).
    #[inline]
    fn unlink(&mut self, index: u32) {
        let e = &self.slab[index as usize];
        let (pos, loc) = (e.pos as usize, usize::from(e.loc));
        debug_assert!(loc <= NUM_BUCKETS);
        let bucket = &mut self.buckets[loc];
        debug_assert_eq!(bucket.get(pos), Some(&index));
        bucket.swap_remove(pos);
        if let Some(&moved) = bucket.get(pos) {
            self.slab[moved as usize].pos = pos as u32;
        } else if bucket.is_empty() {
            if bucket.capacity() > self.retain_entries {
                bucket.shrink_to(self.retain_entries);
            }
            if loc < NUM_BUCKETS {
                self.occupied[loc / LVL_SIZE] &= !(1u64 << (loc % LVL_SIZE));
            }
        }
    }

    /// Releases unlinked live slot `index`, returning its value.
    #[inline]
    fn free(&mut self, index: u32) -> T {
        let e = &mut self.slab[index as usize];
        e.loc = LOC_FREE;
        e.generation = e.generation.wrapping_add(1);
        e.pos = self.free_head;
        self.free_head = index;
        self.len -= 1;
        match e.value.take() {
            Some(v) => v,
            // Live slots always hold a value (checked by check_invariants).
            None => unreachable!("live timer slot without a value"),
        }
    }

    /// Empties bucket `b` (its occupied bit already cleared by the caller),
    /// firing or recascading every entry; returns how many fired. An entry
    /// recascaded into `b` itself (clamped top-level timers) stays in it.
    fn drain_bucket<F: FnMut(TimerHandle, u64, T)>(&mut self, b: usize, fire: &mut F) -> usize {
        let mut list = std::mem::take(&mut self.buckets[b]);
        self.stats.buckets_visited += 1;
        self.stats.entries_visited += list.len() as u64;
        let mut fired = 0;
        for (i, &index) in list.iter().enumerate() {
            if let Some(&ahead) = list.get(i + PREFETCH_AHEAD_ENTRIES) {
                prefetch(self.slab.as_ptr().wrapping_add(ahead as usize));
            }
            fired += self.fire_or_recascade(index, fire);
        }
        // Give the array (and its capacity) back. Entries recascaded into `b`
        // meanwhile sit in a fresh array at positions 0.., which are kept.
        list.clear();
        let added = std::mem::take(&mut self.buckets[b]);
        list.extend_from_slice(&added);
        if list.is_empty() && list.capacity() > self.retain_entries {
            list.shrink_to(self.retain_entries);
        }
        self.buckets[b] = list;
        fired
    }

    /// Handles entry `index` taken out of a due bucket: fires it if due,
    /// otherwise re-links it for its remaining time. Returns 1 if fired.
    #[inline]
    fn fire_or_recascade<F: FnMut(TimerHandle, u64, T)>(
        &mut self,
        index: u32,
        fire: &mut F,
    ) -> usize {
        let e = &self.slab[index as usize];
        let deadline = e.deadline;
        if deadline <= self.now {
            let handle = TimerHandle {
                index,
                generation: e.generation,
            };
            let value = self.free(index);
            self.stats.fired += 1;
            fire(handle, deadline, value);
            1
        } else {
            self.stats.recascaded += 1;
            self.link(index, deadline);
            0
        }
    }
}

/// `timers_max` of [`TimerWheel::default`].
pub const DEFAULT_MAX_TIMERS: usize = 1 << 20;

impl<T> Default for TimerWheel<T> {
    /// A wheel at tick 0 with a limit of [`DEFAULT_MAX_TIMERS`] timers.
    fn default() -> Self {
        Self::new(0, DEFAULT_MAX_TIMERS)
    }
}

impl<T> std::fmt::Debug for TimerWheel<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TimerWheel")
            .field("now", &self.now)
            .field("len", &self.len)
            .field("timers_max", &self.timers_max)
            .field("stats", &self.stats)
            .finish()
    }
}

/// The checker against corrupted wheels: each part it covers, broken by hand, is
/// reported (the tests that lean on `check_invariants` are only as strong as this).
#[cfg(test)]
mod check_invariants_tests {
    use super::*;

    const NOW: u64 = 100;

    /// Handles of: a level-0 timer, a level-1 timer, one inserted already due,
    /// one clamped past the top level's window; and one cancelled (a free slot).
    struct Rig {
        w: TimerWheel<u32>,
        near: usize,
        due: usize,
        freed: usize,
    }

    fn rig() -> Rig {
        let mut w = TimerWheel::new(NOW, 64);
        let near = w.insert(NOW + 5, 1).unwrap().index as usize;
        w.insert(NOW + 1_000, 2).unwrap();
        let due = w.insert(NOW - 50, 3).unwrap().index as usize;
        w.insert(u64::MAX / 2, 4).unwrap();
        let gone = w.insert(NOW + 7, 5).unwrap();
        assert_eq!(w.cancel(gone), Some(5));
        w.check_invariants().unwrap();
        Rig {
            w,
            near,
            due,
            freed: gone.index as usize,
        }
    }

    fn broken(what: &str, corrupt: impl FnOnce(&mut Rig), expect: &str) {
        let mut r = rig();
        corrupt(&mut r);
        match r.w.check_invariants() {
            Ok(()) => panic!("{what}: not reported"),
            Err(e) => assert!(e.contains(expect), "{what}: {e:?} lacks {expect:?}"),
        }
    }

    #[test]
    fn every_corruption_of_a_bucket_is_reported() {
        let bucket = |r: &Rig| r.w.slab[r.near].loc as usize;
        broken(
            "bit cleared",
            |r| r.w.occupied[0] &= !(1 << bucket(r)),
            "bitmap",
        );
        broken(
            "bit set for an empty bucket",
            |r| r.w.occupied[0] |= 1 << ((bucket(r) + 1) % LVL_SIZE),
            "bitmap",
        );
        broken("pos", |r| r.w.slab[r.near].pos += 1, "bad pos/loc/value");
        broken(
            "loc",
            |r| {
                let b = bucket(r);
                let i = r.w.buckets[b].pop().unwrap();
                r.w.buckets[b + 1].push(i);
                r.w.occupied[0] ^= (1 << b) | (1 << (b + 1));
            },
            "bad pos/loc/value",
        );
        broken(
            "value",
            |r| r.w.slab[r.near].value = None,
            "bad pos/loc/value",
        );
        broken(
            "linked twice",
            |r| {
                let b = bucket(r);
                r.w.buckets[b].push(r.near as u32);
            },
            "linked twice",
        );
        broken(
            "index out of the slab",
            |r| {
                let b = bucket(r);
                r.w.buckets[b].push(999);
            },
            "out of slab",
        );
        broken(
            "misplaced deadline",
            |r| r.w.slab[r.near].deadline = NOW + 6,
            "misplaced",
        );
        broken(
            "deadline not after now",
            |r| r.w.slab[r.near].deadline = NOW,
            "misplaced",
        );
        broken(
            "a future deadline in the due list",
            |r| r.w.slab[r.due].deadline = NOW + 1,
            "due list",
        );
        broken(
            "below the due list's bound",
            |r| r.w.due_min = NOW - 10,
            "due list",
        );
    }

    #[test]
    fn every_corruption_of_the_counts_and_free_list_is_reported() {
        broken("len", |r| r.w.len += 1, "len");
        broken(
            "a free slot holding a value",
            |r| r.w.slab[r.freed].value = Some(9),
            "free entry",
        );
        broken(
            "a free slot in a bucket",
            |r| r.w.slab[r.freed].loc = 0,
            "free entry",
        );
        broken(
            "a live entry on the free list",
            |r| r.w.free_head = r.near as u32,
            "free entry",
        );
        broken(
            "free list out of the slab",
            |r| r.w.free_head = 999,
            "out of slab",
        );
        broken(
            "a slot neither live nor free",
            |r| r.w.free_head = NIL,
            "slots",
        );
    }
}

/// Limits, placement edges and messages.
#[cfg(test)]
mod tests {
    use super::*;

    /// One `u32` index value is left for the free list's terminator.
    #[test]
    fn max_timers_leaves_the_free_list_terminator_out() {
        assert_eq!(MAX_TIMERS_LIMIT, NIL as usize - 1);
        let w = TimerWheel::<u8>::new(0, usize::MAX);
        assert_eq!(w.timers_max(), u32::MAX as usize - 1);
    }

    /// A timer 63 ticks ahead sits in level 0 (its window covers it), so the
    /// next deadline is exact.
    #[test]
    fn a_timer_63_ticks_ahead_is_placed_exactly() {
        for now in [0, 5, 1_000] {
            let mut w = TimerWheel::new(now, 4);
            w.insert(now + 63, ()).unwrap();
            assert_eq!(w.next_deadline(), Some(now + 63), "{now}");
            w.advance(now + 63, |_, _, ()| {});
            assert_eq!((w.stats().fired, w.stats().recascaded), (1, 0));
        }
    }

    /// Reserving on a wheel whose slab holds free slots (more slots than live
    /// timers) asks for nothing and breaks nothing.
    #[test]
    fn reserve_with_free_slots_in_the_slab() {
        let mut w = TimerWheel::new(0, 8);
        let hs: Vec<_> = (0..4).map(|i| w.insert(10 + i, i).unwrap()).collect();
        for &h in &hs[1..] {
            w.cancel(h);
        }
        w.reserve(0);
        w.reserve(2);
        w.insert(20, 9).unwrap();
        w.check_invariants().unwrap();
        assert_eq!(w.len(), 2);
    }

    #[test]
    fn the_default_wheel_starts_at_tick_0_with_2_pow_20_timers() {
        let mut w = TimerWheel::default();
        assert_eq!((w.now(), w.timers_max()), (0, 1 << 20));
        assert!(w.insert(1, ()).is_ok());
    }

    /// Debug shows the clock, the count and the limit (panics and logs print it).
    #[test]
    fn debug_shows_the_clock_and_the_counts() {
        let mut w = TimerWheel::new(5, 9);
        w.insert(7, ()).unwrap();
        let shown = format!("{w:?}");
        assert!(shown.starts_with("TimerWheel {"), "{shown}");
        assert!(shown.contains("now: 5, len: 1, timers_max: 9"), "{shown}");
    }

    #[test]
    fn a_full_wheel_says_so() {
        assert_eq!(format!("{:?}", TimerFull(String::new())), "TimerFull(..)");
        assert_eq!(
            TimerFull(()).to_string(),
            "timer wheel full (timers_max live timers)"
        );
    }
}

/// The work counters `/metrics` exports (through the authority's expiry passes).
#[cfg(test)]
mod stats_tests {
    use super::*;

    fn counts(w: &TimerWheel<u64>) -> (u64, u64, u64, u64) {
        let s = w.stats();
        (s.buckets_visited, s.entries_visited, s.fired, s.recascaded)
    }

    #[test]
    fn stats_count_the_work_of_advance() {
        let mut w = TimerWheel::new(0, 16);
        assert!(w.is_empty());
        for d in [5, 5, 100] {
            w.insert(d, d).unwrap();
        }
        assert!(!w.is_empty());
        let mut fired = Vec::new();
        w.advance(4, |_, _, v| fired.push(v));
        assert_eq!(counts(&w), (0, 0, 0, 0), "nothing due");
        w.advance(5, |_, _, v| fired.push(v));
        assert_eq!(counts(&w), (1, 2, 2, 0), "one bucket, both fired");
        // At 99 the level-1 bucket of ticks 96..=103 is due: its entry is not, and
        // goes down a level.
        w.advance(99, |_, _, v| fired.push(v));
        assert_eq!(counts(&w), (2, 3, 2, 1));
        w.advance(100, |_, _, v| fired.push(v));
        assert_eq!(counts(&w), (3, 4, 3, 1));
        assert_eq!(fired, vec![5, 5, 100]);
        // A timer inserted already due waits in the due list: one more bucket.
        w.insert(50, 50).unwrap();
        w.advance(100, |_, _, v| fired.push(v));
        assert_eq!(counts(&w), (4, 5, 4, 1));
        w.reset_stats();
        assert_eq!(counts(&w), (0, 0, 0, 0));
    }

    /// A top-level pass drains the clamp bucket (`now_slot + 63`) first: a clamped
    /// timer recascaded into it from another due bucket is not visited twice.
    #[test]
    fn a_top_level_pass_drains_the_clamp_bucket_first() {
        const TOP: u64 = 1 << 24; // the top level's granularity
        let mut w = TimerWheel::new(TOP, 16);
        // Beyond the window: clamped into slot 1 + 63 = 64, bucket 0.
        let far = w.insert(1 << 40, 1 << 40).unwrap();
        w.advance(2 * TOP, |_, _, _| panic!("nothing is due"));
        // Slot 65 (bucket 1), within the window at slot 2.
        w.insert(65 * TOP, 65 * TOP).unwrap();
        w.reset_stats();
        let mut fired = Vec::new();
        // At slot 66 every top bucket is due; the clamp bucket is 66 + 63 = 129,
        // bucket 1: drained first, it fires 65 * TOP; then bucket 0's clamped timer
        // moves into it, and stays.
        w.advance(66 * TOP, |_, _, v| fired.push(v));
        assert_eq!(fired, vec![65 * TOP]);
        assert_eq!(counts(&w), (2, 2, 1, 1));
        assert_eq!(w.deadline(far), Some(1 << 40));
        w.check_invariants().unwrap();
    }

    /// A top-level pass whose clamp bucket is not due leaves it alone.
    #[test]
    fn a_top_level_pass_visits_the_clamp_bucket_only_when_due() {
        const TOP: u64 = 1 << 24;
        let mut w = TimerWheel::new(2 * TOP, 16);
        // 8 top slots ahead: level 8, bucket 10; the clamp bucket at slot 10 is 9.
        w.insert(10 * TOP, 10).unwrap();
        let mut fired = Vec::new();
        w.advance(10 * TOP, |_, _, v| fired.push(v));
        assert_eq!(fired, vec![10]);
        assert_eq!(counts(&w), (1, 1, 1, 0));
    }
}
