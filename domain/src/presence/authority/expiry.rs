//! The expiry index of one hash slot: at most one deadline per record (its active
//! route's expiry or its fence retention), in a ring of one-second buckets.
//!
//! Why not the shard's hierarchical [`TimerWheel`](wheel::TimerWheel): there a
//! fired entry costs a slab line of its own (a random access beside the record the
//! authority handles next), and a deadline more than 64 ticks ahead sits in a coarse
//! bucket and is visited twice (moved to a finer level, then fired). Route TTLs and
//! fence retentions are minutes, so most entries took that second visit. Here a
//! bucket is an array of record indices and every deadline within the window sits
//! in the bucket of its own second: a pass copies its due buckets out and touches
//! nothing per entry; the caller then handles each record, which it reads anyway.
//!
//! # Contract
//! - Whole seconds in, no clock; `now` moves only through [`ExpiryRing::advance`]
//!   and never backward (an earlier `now_s` counts as the current one).
//! - A record's [`RingLink`] lives with the record (the caller's memory, read by
//!   the caller when it handles the record) and is changed only through
//!   [`set`](ExpiryRing::set) and [`cancel`](ExpiryRing::cancel). Both may move
//!   another record within its bucket: they return that record and its new
//!   position ([`Moved`]), which the caller writes into that record's link.
//! - `advance(now_s, f)` takes out every entry of the buckets due by `now_s` and
//!   calls `f(record)` for each (order unspecified). Those links are stale: the
//!   caller clears each with [`RingLink::take`] before any other call for that
//!   record. Every reported entry is due (deadline `<= now_s`) except those whose
//!   link says [`far`](RingLink::is_far): the caller sets those again with their
//!   deadline. Every due entry is reported at the latest by the first `advance` at
//!   or after its deadline; one set with a deadline `<= now()` at the next.
//! - Window: `buckets()` one-second buckets (a power of two from
//!   [`RING_BUCKETS_MIN`] to [`RING_BUCKETS_MAX`], sized to cover the longest
//!   deadline the slot sets plus [`RING_SLACK_S`] of pass lag). A deadline beyond
//!   the window goes to the bucket that comes due last in it, marked far.
//! - O(1) set and cancel (a push, a swap-remove); memory: a bucket array that
//!   empties (drained, or by cancels) with more than twice `retain_entries` of
//!   capacity shrinks to `retain_entries`, so an empty bucket holds at most twice
//!   that; a bucket with entries holds what a `Vec` of them holds.
//! - A link that does not name its record's place (a [`Moved`] not applied) is a
//!   caller bug that would take another record out of the ring: refused with a
//!   panic in every build.

use wheel::WheelStats;

/// Fewest buckets of a ring.
pub(crate) const RING_BUCKETS_MIN: usize = 64;
/// Most buckets of a ring (68 minutes of one-second buckets); longer deadlines are
/// set again when the window's last bucket comes due.
pub(crate) const RING_BUCKETS_MAX: usize = 4096;
/// Seconds the ring's window reaches beyond the longest deadline, for calls made
/// while passes lag behind the caller's clock.
pub(crate) const RING_SLACK_S: u64 = 60;
/// Capacity an emptied bucket keeps at least.
const BUCKET_RETAIN_MIN_ENTRIES: usize = 64;
/// `RingLink::bucket` of a record without a deadline.
const UNLINKED: u16 = u16::MAX;
// Bucket numbers (the due list is number `buckets()`) fit a `u16` below UNLINKED.
const _: () = assert!(RING_BUCKETS_MAX < UNLINKED as usize);

/// Where a record's deadline sits in its slot's ring; kept in the record.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct RingLink {
    pos: u32,
    bucket: u16,
    far: bool,
}

impl RingLink {
    /// No deadline.
    pub(crate) const NONE: RingLink = RingLink {
        pos: 0,
        bucket: UNLINKED,
        far: false,
    };

    #[inline]
    pub(crate) fn is_linked(&self) -> bool {
        self.bucket != UNLINKED
    }

    /// Whether the deadline was beyond the window when set (see the module docs).
    #[inline]
    pub(crate) fn is_far(&self) -> bool {
        self.far
    }

    /// Clears the link of an entry `advance` reported, returning what it was.
    #[inline]
    pub(crate) fn take(&mut self) -> RingLink {
        std::mem::replace(self, RingLink::NONE)
    }
}

/// A record `set` or `cancel` moved within its bucket: its link's new position.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Moved {
    pub(crate) rec: u32,
    pub(crate) pos: u32,
}

impl Moved {
    /// Writes the new position into the moved record's link.
    #[inline]
    pub(crate) fn apply(self, link: &mut RingLink) {
        debug_assert!(link.is_linked());
        link.pos = self.pos;
    }
}

/// See the module docs.
pub(crate) struct ExpiryRing {
    now_s: u64,
    /// `buckets() - 1`.
    mask: u64,
    /// One array of record indices per second of the window, then the due list
    /// (deadlines already passed when set).
    buckets: Box<[Vec<u32>]>,
    len: usize,
    retain_entries: usize,
    stats: WheelStats,
}

impl ExpiryRing {
    /// An empty ring at `now_s` whose window covers deadlines up to `horizon_s`
    /// seconds ahead (plus [`RING_SLACK_S`], within the bucket limits), for about
    /// `entries_max` entries.
    pub(crate) fn new(now_s: u64, horizon_s: u64, entries_max: usize) -> ExpiryRing {
        let n = usize::try_from(horizon_s.saturating_add(RING_SLACK_S + 2))
            .unwrap_or(usize::MAX)
            .min(RING_BUCKETS_MAX)
            .next_power_of_two()
            .clamp(RING_BUCKETS_MIN, RING_BUCKETS_MAX);
        ExpiryRing {
            now_s,
            mask: n as u64 - 1,
            buckets: (0..=n).map(|_| Vec::new()).collect(),
            len: 0,
            retain_entries: BUCKET_RETAIN_MIN_ENTRIES.max(entries_max / n),
            stats: WheelStats::default(),
        }
    }

    /// Entries of capacity of all buckets (memory bound tests).
    #[cfg(test)]
    fn capacity_entries(&self) -> usize {
        self.buckets.iter().map(Vec::capacity).sum()
    }

    /// Buckets of the window (seconds covered).
    #[cfg(test)]
    pub(crate) fn buckets(&self) -> usize {
        self.buckets.len() - 1
    }

    #[inline]
    fn due_list(&self) -> u16 {
        self.mask as u16 + 1
    }

    pub(crate) fn now(&self) -> u64 {
        self.now_s
    }

    /// Entries in the ring (reported ones excluded).
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn stats(&self) -> WheelStats {
        self.stats
    }

    /// The bucket a deadline set now goes to, and whether it is beyond the window.
    #[inline]
    fn bucket_for(&self, deadline_s: u64) -> (u16, bool) {
        if deadline_s <= self.now_s {
            (self.due_list(), false)
        } else if deadline_s - self.now_s <= self.mask {
            ((deadline_s & self.mask) as u16, false)
        } else {
            // The window's last second.
            (
                (self.now_s.wrapping_add(self.mask) & self.mask) as u16,
                true,
            )
        }
    }

    /// The time at which bucket `b` (not the due list) is next drained.
    fn next_drain_s(&self, b: u16) -> u64 {
        let ahead = (u64::from(b).wrapping_sub(self.now_s).wrapping_sub(1)) & self.mask;
        self.now_s.wrapping_add(ahead).wrapping_add(1)
    }

    /// Sets the deadline of record `rec`, whose link is `link`. The caller applies
    /// the returned [`Moved`] to that record's link.
    #[inline]
    #[must_use = "a moved record's link must be updated"]
    pub(crate) fn set(&mut self, rec: u32, link: &mut RingLink, deadline_s: u64) -> Option<Moved> {
        let (b, far) = self.bucket_for(deadline_s);
        let mut moved = None;
        if link.is_linked() {
            if link.bucket == b && !far && !link.far {
                // Within the window a bucket holds one second: same deadline.
                return None;
            }
            moved = self.unlink(rec, link);
        } else {
            self.len += 1;
        }
        let list = &mut self.buckets[b as usize];
        *link = RingLink {
            pos: list.len() as u32,
            bucket: b,
            far,
        };
        list.push(rec);
        moved
    }

    /// Removes the deadline of record `rec`, whose link is `link` (nothing if none).
    /// The caller applies the returned [`Moved`] to that record's link.
    #[inline]
    #[must_use = "a moved record's link must be updated"]
    pub(crate) fn cancel(&mut self, rec: u32, link: &mut RingLink) -> Option<Moved> {
        if !link.is_linked() {
            return None;
        }
        let moved = self.unlink(rec, link);
        *link = RingLink::NONE;
        self.len -= 1;
        moved
    }

    /// Takes `rec` out of its bucket (its link left as it was).
    #[inline]
    fn unlink(&mut self, rec: u32, link: &RingLink) -> Option<Moved> {
        let list = &mut self.buckets[link.bucket as usize];
        let pos = link.pos as usize;
        assert_eq!(list.get(pos), Some(&rec), "ring link out of date");
        list.swap_remove(pos);
        if list.is_empty() {
            shrink_emptied(list, self.retain_entries);
            return None;
        }
        list.get(pos).map(|&moved| Moved {
            rec: moved,
            pos: link.pos,
        })
    }

    /// Moves time to `now_s` and reports every entry of the buckets due by then
    /// (see the module docs). Returns the number reported.
    pub(crate) fn advance(&mut self, now_s: u64, mut report: impl FnMut(u32)) -> usize {
        let old = self.now_s;
        let now = now_s.max(old);
        self.now_s = now;
        let mut n = self.drain(self.due_list(), &mut report);
        // Each second of (old, now] once; a jump of a whole window or more visits
        // every bucket once.
        let steps = (now - old).min(self.mask + 1);
        for k in 1..=steps {
            n += self.drain((old.wrapping_add(k) & self.mask) as u16, &mut report);
        }
        n
    }

    #[inline]
    fn drain(&mut self, b: u16, report: &mut impl FnMut(u32)) -> usize {
        let list = &mut self.buckets[b as usize];
        let n = list.len();
        if n == 0 {
            return 0;
        }
        for &rec in list.iter() {
            report(rec);
        }
        list.clear();
        shrink_emptied(list, self.retain_entries);
        self.len -= n;
        self.stats.buckets_visited += 1;
        self.stats.entries_visited += n as u64;
        self.stats.fired += n as u64;
        n
    }

    /// Counts a reported far entry the caller set again (see the module docs).
    pub(crate) fn note_far_again(&mut self) {
        self.stats.fired -= 1;
        self.stats.recascaded += 1;
    }

    /// Checks that record `rec` with link `link` sits where its deadline
    /// `deadline_s` (`None`: it has none) asks.
    pub(crate) fn check_link(
        &self,
        rec: u32,
        link: &RingLink,
        deadline_s: Option<u64>,
    ) -> Result<(), String> {
        let Some(d) = deadline_s else {
            return match link.is_linked() {
                false => Ok(()),
                true => Err(format!("ring: record {rec} linked without a deadline")),
            };
        };
        let Some(&at) = self
            .buckets
            .get(link.bucket as usize)
            .and_then(|l| l.get(link.pos as usize))
        else {
            return Err(format!("ring: record {rec} with a deadline is not linked"));
        };
        if at != rec {
            return Err(format!("ring: link of record {rec} out of date"));
        }
        let placed = if link.bucket == self.due_list() {
            d <= self.now_s
        } else if link.far {
            d > self.now_s && self.next_drain_s(link.bucket) <= d
        } else {
            d > self.now_s && self.next_drain_s(link.bucket) == d
        };
        match placed {
            true => Ok(()),
            false => Err(format!("ring: record {rec} in the wrong bucket for {d}")),
        }
    }

    /// Checks the entry count.
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        let count: usize = self.buckets.iter().map(Vec::len).sum();
        match count == self.len {
            true => Ok(()),
            false => Err(format!("ring: {count} entries, len {}", self.len)),
        }
    }
}

/// Gives an emptied bucket's peak capacity back beyond twice `retain` (twice:
/// a bucket that fills and empties around `retain` does not reallocate each time).
#[inline]
fn shrink_emptied(list: &mut Vec<u32>, retain: usize) {
    if list.capacity() > 2 * retain {
        list.shrink_to(retain);
    }
}

#[cfg(test)]
// Tests may read their seed count from the environment.
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn rng(seed: u64) -> impl FnMut(u64) -> u64 {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        move |n| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        }
    }

    /// A ring with the records' links and deadlines, as the authority keeps them.
    struct Harness {
        ring: ExpiryRing,
        links: Vec<RingLink>,
        deadlines: Vec<Option<u64>>,
    }

    impl Harness {
        fn new(now_s: u64, horizon_s: u64, records: usize) -> Harness {
            Harness {
                ring: ExpiryRing::new(now_s, horizon_s, records),
                links: vec![RingLink::NONE; records],
                deadlines: vec![None; records],
            }
        }
        fn fix(&mut self, m: Option<Moved>) {
            if let Some(m) = m {
                m.apply(&mut self.links[m.rec as usize]);
            }
        }
        fn set(&mut self, rec: u32, d: u64) {
            let m = self.ring.set(rec, &mut self.links[rec as usize], d);
            self.fix(m);
            self.deadlines[rec as usize] = Some(d);
        }
        fn cancel(&mut self, rec: u32) -> bool {
            let had = self.links[rec as usize].is_linked();
            let m = self.ring.cancel(rec, &mut self.links[rec as usize]);
            self.fix(m);
            self.deadlines[rec as usize] = None;
            had
        }
        /// Advances and handles the reported entries as the authority does: due
        /// ones fire, far ones are set again. Returns the fired records, sorted.
        fn advance(&mut self, now_s: u64) -> Vec<u32> {
            let mut reported = Vec::new();
            let n = self.ring.advance(now_s, |r| reported.push(r));
            assert_eq!(n, reported.len(), "advance returns the number reported");
            let mut fired = Vec::new();
            for r in reported {
                let link = self.links[r as usize].take();
                let d = self.deadlines[r as usize].expect("reported without deadline");
                if link.is_far() && d > self.ring.now() {
                    self.ring.note_far_again();
                    self.set(r, d);
                } else {
                    assert!(d <= self.ring.now(), "record {r} reported before {d}");
                    self.deadlines[r as usize] = None;
                    fired.push(r);
                }
            }
            fired.sort_unstable();
            fired
        }
        fn check(&self) -> Result<(), String> {
            self.ring.check_invariants()?;
            for (r, (l, d)) in self.links.iter().zip(&self.deadlines).enumerate() {
                self.ring.check_link(r as u32, l, *d)?;
            }
            Ok(())
        }
    }

    #[test]
    fn sizes_its_window_to_the_horizon_within_limits() {
        assert_eq!(ExpiryRing::new(0, 0, 0).buckets(), 64);
        assert_eq!(ExpiryRing::new(0, 600, 0).buckets(), 1024);
        assert_eq!(ExpiryRing::new(0, u64::MAX, 0).buckets(), RING_BUCKETS_MAX);
    }

    #[test]
    fn fires_exactly_at_the_deadline_and_visits_each_entry_once() {
        let mut h = Harness::new(100, 600, 8);
        for (rec, d) in [(0, 101), (1, 160), (2, 700), (3, 700), (4, 99)] {
            h.set(rec, d);
        }
        h.check().unwrap();
        // The passed deadline is due at the next advance, even at the same time.
        assert_eq!(h.advance(100), [4]);
        assert_eq!(h.advance(101), [0]);
        assert_eq!(h.advance(159), [] as [u32; 0]);
        assert_eq!(h.advance(160), [1]);
        assert_eq!(h.advance(699), [] as [u32; 0]);
        assert_eq!(h.advance(700), [2, 3]);
        let s = h.ring.stats();
        assert_eq!((s.fired, s.entries_visited, s.recascaded), (5, 5, 0));
        assert_eq!(h.ring.len(), 0);
        h.check().unwrap();
    }

    /// The contract's far mark: only a deadline beyond the window is marked far
    /// (the one kind of entry reported before its deadline); a passed one, or one
    /// within the window to its last second, is not.
    #[test]
    fn only_a_deadline_beyond_the_window_is_marked_far() {
        let mut h = Harness::new(100, 0, 8);
        let last = 100 + h.ring.buckets() as u64 - 1;
        for (rec, d, far) in [(0, 99, false), (1, 101, false), (2, last, false)] {
            h.set(rec, d);
            assert_eq!(h.links[rec as usize].is_far(), far, "deadline {d}");
        }
        h.set(3, last + 1);
        assert!(h.links[3].is_far(), "one second beyond the window");
        // Set again within the window it is no longer far, even in the very
        // bucket it sat in (the window's last second).
        h.set(3, last);
        assert!(!h.links[3].is_far(), "the window's last second");
        h.check().unwrap();
        // ... and from the window's last second to beyond it (the same bucket
        // again) it is far once more: not reported as due at that second.
        h.set(3, last + 1);
        assert!(
            h.links[3].is_far(),
            "beyond the window, from its last second"
        );
        h.check().unwrap();
        h.set(3, 150);
        assert!(!h.links[3].is_far());
        h.check().unwrap();
    }

    #[test]
    fn far_deadlines_are_reported_again_until_due() {
        let mut h = Harness::new(0, 0, 8);
        h.set(7, 1000);
        h.check().unwrap();
        for t in (0..1000).step_by(7) {
            assert!(h.advance(t).is_empty());
            h.check().unwrap();
        }
        assert_eq!(h.advance(1000), [7]);
        let s = h.ring.stats();
        assert!(s.recascaded >= 1000 / 64 - 1);
        // Each early report counts as re-set, not as fired: it fired once.
        assert_eq!(s.fired, 1);
        assert_eq!(s.entries_visited, s.fired + s.recascaded);
    }

    /// The checker the authority's `check_invariants` relies on refuses a link
    /// that is not where its record's deadline asks.
    #[test]
    fn check_link_refuses_a_record_out_of_place() {
        let mut h = Harness::new(100, 0, 4);
        h.set(0, 150);
        // Beyond the window: far, in the bucket drained at 163 (the last second).
        h.set(1, 164);
        h.set(2, 90);
        h.check().unwrap();
        let (r, l) = (&h.ring, &h.links);
        assert!(l[1].is_far());
        assert_eq!(r.check_link(0, &l[0], Some(150)), Ok(()));
        assert!(r.check_link(0, &l[0], Some(151)).is_err(), "another second");
        assert!(
            r.check_link(0, &l[0], Some(100)).is_err(),
            "a passed deadline"
        );
        assert_eq!(r.check_link(1, &l[1], Some(1_000)), Ok(()), "far");
        assert_eq!(
            r.check_link(1, &l[1], Some(163)),
            Ok(()),
            "far, due at the drain"
        );
        assert!(
            r.check_link(1, &l[1], Some(162)).is_err(),
            "marked far, but its bucket drains after the deadline"
        );
        assert!(r.check_link(1, &l[1], Some(100)).is_err(), "far, passed");
        assert_eq!(r.check_link(2, &l[2], Some(100)), Ok(()), "the due list");
        assert!(r.check_link(2, &l[2], Some(101)).is_err(), "not passed");
        assert!(r.check_link(0, &l[0], None).is_err(), "linked, no deadline");
        assert!(
            r.check_link(3, &l[3], Some(150)).is_err(),
            "deadline, no link"
        );
        assert_eq!(r.check_link(3, &l[3], None), Ok(()));
        assert!(
            r.check_link(3, &l[0], Some(150)).is_err(),
            "record 0's place"
        );
    }

    /// ... and its entry count check refuses a count that is not the buckets'.
    #[test]
    fn check_invariants_refuses_a_wrong_count() {
        let mut h = Harness::new(100, 0, 4);
        h.set(0, 150);
        h.set(1, 90);
        assert_eq!(h.ring.check_invariants(), Ok(()));
        h.ring.len += 1;
        assert!(h.ring.check_invariants().is_err(), "one more than held");
        h.ring.len -= 2;
        assert!(h.ring.check_invariants().is_err(), "one fewer");
    }

    #[test]
    fn cancel_and_set_move_the_last_entry_into_the_gap() {
        let mut h = Harness::new(0, 100, 8);
        for rec in 0..4 {
            h.set(rec, 50);
        }
        assert!(h.cancel(1));
        assert!(!h.cancel(1));
        h.set(0, 60);
        h.set(2, 60);
        h.set(2, 60);
        h.check().unwrap();
        assert_eq!(h.ring.len(), 3);
        assert_eq!(h.advance(50), [3]);
        assert_eq!(h.advance(1_000_000), [0, 2]);
        h.check().unwrap();
    }

    /// A link the caller failed to update (a `Moved` not applied) is refused with a
    /// panic in every build: it would otherwise take another record out of the ring
    /// (that record then never expires).
    #[test]
    #[should_panic(expected = "ring link out of date")]
    fn a_stale_link_is_refused_in_every_build() {
        let mut ring = ExpiryRing::new(0, 100, 8);
        let mut links = [RingLink::NONE; 4];
        for (rec, link) in links.iter_mut().enumerate().take(3) {
            assert_eq!(ring.set(rec as u32, link, 50), None);
        }
        // Record 2 moves into record 0's place; its `Moved` is dropped here, so its
        // link still names position 2, which record 3 takes next.
        assert!(ring.cancel(0, &mut links[0]).is_some());
        assert_eq!(ring.set(3, &mut links[3], 50), None);
        let _ = ring.cancel(2, &mut links[2]);
    }

    /// A bucket emptied by cancels gives its peak capacity back, as a drained one
    /// does (beyond twice `retain_entries`): empty buckets hold a bounded amount.
    #[test]
    fn buckets_emptied_by_cancel_shrink_like_drained_ones() {
        let mut h = Harness::new(0, 100, 8);
        let retain = h.ring.retain_entries;
        let n = 20 * retain as u32;
        h.links.resize(n as usize, RingLink::NONE);
        h.deadlines.resize(n as usize, None);
        for rec in 0..n {
            h.set(rec, 50);
        }
        assert!(h.ring.capacity_entries() >= n as usize);
        for rec in 0..n {
            assert!(h.cancel(rec));
        }
        h.check().unwrap();
        assert!(
            h.ring.capacity_entries() <= 2 * retain,
            "{} entries of capacity kept, retain {retain}",
            h.ring.capacity_entries()
        );
        for rec in 0..n {
            h.set(rec, 60);
        }
        assert_eq!(h.advance(60).len(), n as usize);
        assert!(h.ring.capacity_entries() <= 2 * retain);
    }

    /// Random sets, cancels and advances (jumps within and beyond a window, far
    /// deadlines) against a map of deadlines. `IMROUTER_RING_SEEDS=N` runs more.
    #[test]
    fn matches_a_reference_map() {
        let seeds: u64 = std::env::var("IMROUTER_RING_SEEDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(64);
        for seed in 0..seeds {
            let mut rnd = rng(seed);
            let mut h = Harness::new(1000, 40, 300);
            let mut model: BTreeMap<u32, u64> = BTreeMap::new();
            let mut now = 1000u64;
            for step in 0..2000 {
                match rnd(10) {
                    0..=4 => {
                        let rec = rnd(300) as u32;
                        let span = if rnd(8) == 0 { 1000 } else { 150 };
                        let d = now - 5 + rnd(span);
                        h.set(rec, d);
                        model.insert(rec, d);
                    }
                    5..=6 => {
                        let rec = rnd(300) as u32;
                        assert_eq!(h.cancel(rec), model.remove(&rec).is_some(), "seed {seed}");
                    }
                    _ => {
                        now += match rnd(10) {
                            0 => 0,
                            1 => 64 + rnd(300),
                            _ => rnd(5),
                        };
                        let got = h.advance(now);
                        let due: Vec<u32> = model
                            .iter()
                            .filter(|&(_, &d)| d <= now)
                            .map(|(&k, _)| k)
                            .collect();
                        model.retain(|_, d| *d > now);
                        assert_eq!(got, due, "seed {seed} step {step} (IMROUTER_RING_SEEDS)");
                    }
                }
                assert_eq!(h.ring.len(), model.len(), "seed {seed} step {step}");
                if let Err(e) = h.check() {
                    panic!("seed {seed} step {step}: {e}");
                }
            }
        }
    }
}
