//! Unit tests of the hierarchical timer wheel (`wheel`).

use std::cell::Cell;
use std::rc::Rc;
use wheel::{TimerFull, TimerHandle, TimerWheel, LEVELS, LVL_CLK_SHIFT, LVL_SIZE};

/// Advances and returns the fired `(deadline, value)` pairs, sorted.
fn advance_collect<T: Ord>(w: &mut TimerWheel<T>, now: u64) -> Vec<(u64, T)> {
    let mut out = Vec::new();
    let n = w.advance(now, |_, d, v| out.push((d, v)));
    assert_eq!(n, out.len());
    w.check_invariants().unwrap();
    out.sort();
    out
}

/// Window of level `level`: deadlines up to `64 * 8^level` ticks ahead fit.
fn level_range(level: usize) -> u64 {
    (LVL_SIZE as u64) << (level as u32 * LVL_CLK_SHIFT)
}

#[test]
fn insert_advance_fires_at_deadline_not_before() {
    let mut w = TimerWheel::new(100, 16);
    let a = w.insert(105, 'a').unwrap();
    let b = w.insert(110, 'b').unwrap();
    assert_eq!(w.len(), 2);
    assert_eq!(w.get(a), Some(&'a'));
    assert!(advance_collect(&mut w, 104).is_empty());
    assert_eq!(advance_collect(&mut w, 105), vec![(105, 'a')]);
    assert_eq!(w.get(a), None);
    assert_eq!(w.get(b), Some(&'b'));
    assert!(advance_collect(&mut w, 109).is_empty());
    assert_eq!(advance_collect(&mut w, 200), vec![(110, 'b')]);
    assert!(w.is_empty());
    assert_eq!(w.now(), 200);
    assert_eq!(w.stats().fired, 2);
}

#[test]
fn fire_callback_gets_the_handle_and_deadline() {
    let mut w = TimerWheel::new(0, 16);
    let h = w.insert(7, 70u32).unwrap();
    let mut got: Vec<(TimerHandle, u64, u32)> = Vec::new();
    w.advance(7, |h, d, v| got.push((h, d, v)));
    assert_eq!(got, vec![(h, 7, 70)]);
    // The handle given to fire is already stale.
    assert_eq!(w.cancel(h), None);
}

#[test]
fn deadline_equal_to_or_before_now_fires_at_next_advance() {
    let mut w = TimerWheel::new(1000, 16);
    w.insert(1000, "eq").unwrap();
    w.insert(3, "past").unwrap();
    w.insert(0, "zero").unwrap();
    assert_eq!(w.next_deadline(), Some(0));
    // Even an advance that does not move time fires them.
    assert_eq!(
        advance_collect(&mut w, 1000),
        vec![(0, "zero"), (3, "past"), (1000, "eq")]
    );
    assert!(w.is_empty());
    assert_eq!(w.next_deadline(), None);
    // Deadline == now + 1 fires exactly one tick later.
    w.insert(1001, "next").unwrap();
    assert!(advance_collect(&mut w, 1000).is_empty());
    assert_eq!(advance_collect(&mut w, 1001), vec![(1001, "next")]);
}

#[test]
fn far_deadlines_across_every_level_fire_exactly() {
    let start = 12_345u64;
    for level in 0..=LEVELS {
        // Deadlines around the boundaries of this level's window (the
        // level == LEVELS case is beyond the top window: clamped).
        let range = if level < LEVELS {
            level_range(level)
        } else {
            level_range(LEVELS - 1) * 5
        };
        let mut offsets = vec![range - 1, range, range + 1, range / 2 + 3];
        if level > 0 {
            offsets.push(level_range(level - 1) + 1);
        }
        for off in offsets {
            let deadline = start + off;
            let mut w = TimerWheel::new(start, 4);
            w.insert(deadline, off).unwrap();
            // next_deadline is a lower bound that never passes the deadline.
            let mut now = start;
            let mut hops = 0;
            while let Some(next) = w.next_deadline() {
                assert!(
                    next <= deadline,
                    "level {level} off {off}: next {next} > {deadline}"
                );
                assert!(next > now || next == deadline);
                // Stop one tick short, then hit the deadline exactly.
                let target = next.min(deadline - 1);
                if target <= now {
                    break;
                }
                assert!(
                    advance_collect(&mut w, target).is_empty(),
                    "fired early at {target}"
                );
                now = target;
                hops += 1;
                assert!(hops < 64, "next_deadline does not converge");
            }
            assert!(advance_collect(&mut w, deadline - 1).is_empty());
            assert_eq!(advance_collect(&mut w, deadline), vec![(deadline, off)]);
        }
    }
}

#[test]
fn far_deadlines_fire_exactly_with_one_big_jump_and_irregular_steps() {
    let mut w = TimerWheel::new(0, 1024);
    let mut deadlines = Vec::new();
    for level in 0..LEVELS {
        for k in [1u64, 7, 63] {
            deadlines.push(k * (level_range(level) / 64) + level as u64);
        }
    }
    deadlines.push(1 << 40);
    deadlines.push((1 << 50) + 17);
    for &d in &deadlines {
        w.insert(d, d).unwrap();
    }
    deadlines.sort();
    // Irregular steps: every step must fire exactly those now due.
    let mut now = 0u64;
    let mut fired = Vec::new();
    let mut step = 1u64;
    while now < 1 << 31 {
        now += step;
        step = step * 3 + 1;
        let got = advance_collect(&mut w, now);
        let want: Vec<u64> = deadlines
            .iter()
            .copied()
            .filter(|&d| d <= now && !fired.contains(&d))
            .collect();
        assert_eq!(
            got.iter().map(|p| p.0).collect::<Vec<_>>(),
            want,
            "now {now}"
        );
        fired.extend(want);
    }
    // One big jump to exactly the farthest but one.
    let got = advance_collect(&mut w, 1 << 40);
    assert_eq!(got, vec![(1 << 40, 1 << 40)]);
    assert_eq!(w.len(), 1);
    assert!(advance_collect(&mut w, (1 << 50) + 16).is_empty());
    assert_eq!(
        advance_collect(&mut w, u64::MAX),
        vec![((1 << 50) + 17, (1 << 50) + 17)]
    );
}

#[test]
fn extreme_ticks_near_u64_max() {
    let mut w = TimerWheel::new(u64::MAX - 100, 8);
    w.insert(u64::MAX, 1).unwrap();
    w.insert(u64::MAX - 50, 2).unwrap();
    assert!(w.next_deadline().unwrap() <= u64::MAX - 50);
    assert!(advance_collect(&mut w, u64::MAX - 51).is_empty());
    assert_eq!(
        advance_collect(&mut w, u64::MAX - 50),
        vec![(u64::MAX - 50, 2)]
    );
    assert_eq!(advance_collect(&mut w, u64::MAX), vec![(u64::MAX, 1)]);

    let mut w = TimerWheel::new(0, 8);
    w.insert(u64::MAX, 9).unwrap();
    assert!(advance_collect(&mut w, u64::MAX - 1).is_empty());
    assert_eq!(advance_collect(&mut w, u64::MAX), vec![(u64::MAX, 9)]);
}

#[test]
fn cancel_returns_the_value_once() {
    let mut w = TimerWheel::new(0, 8);
    let a = w.insert(50, "a").unwrap();
    let b = w.insert(5000, "b").unwrap();
    assert_eq!(w.cancel(a), Some("a"));
    assert_eq!(w.cancel(a), None);
    assert_eq!(w.len(), 1);
    assert!(advance_collect(&mut w, 4999).is_empty());
    assert_eq!(w.cancel(b), Some("b"));
    assert!(advance_collect(&mut w, 1 << 20).is_empty());
    assert!(w.is_empty());
    assert_eq!(w.next_deadline(), None);
}

#[test]
fn cancel_of_an_already_due_timer() {
    let mut w = TimerWheel::new(10, 8);
    let a = w.insert(3, 'a').unwrap();
    let b = w.insert(10, 'b').unwrap();
    assert_eq!(w.cancel(a), Some('a'));
    assert_eq!(advance_collect(&mut w, 10), vec![(10, 'b')]);
    assert_eq!(w.cancel(b), None);
}

#[test]
fn reschedule_earlier_and_later() {
    let mut w = TimerWheel::new(0, 8);
    let a = w.insert(100_000, 'a').unwrap();
    let b = w.insert(10, 'b').unwrap();
    assert!(w.reschedule(a, 20)); // much earlier (coarse -> level 0)
    assert!(w.reschedule(b, 300_000)); // much later
    assert_eq!(w.deadline(a), Some(20));
    assert_eq!(w.deadline(b), Some(300_000));
    assert!(advance_collect(&mut w, 19).is_empty());
    assert_eq!(advance_collect(&mut w, 20), vec![(20, 'a')]);
    assert!(!w.reschedule(a, 30), "fired timer cannot be rescheduled");
    // Reschedule after partial progress, within the same bucket and across.
    assert!(w.reschedule(b, 299_999));
    assert!(advance_collect(&mut w, 299_998).is_empty());
    assert!(w.reschedule(b, 300_500));
    assert!(advance_collect(&mut w, 300_499).is_empty());
    assert_eq!(advance_collect(&mut w, 300_500), vec![(300_500, 'b')]);
}

#[test]
fn reschedule_to_now_or_past_fires_at_next_advance() {
    let mut w = TimerWheel::new(500, 8);
    let a = w.insert(900, 'a').unwrap();
    let b = w.insert(1 << 33, 'b').unwrap();
    assert!(w.reschedule(a, 500));
    assert!(w.reschedule(b, 1));
    assert_eq!(w.next_deadline(), Some(1));
    // Moving back out of the due list works too.
    assert!(w.reschedule(b, 501));
    assert_eq!(advance_collect(&mut w, 500), vec![(500, 'a')]);
    assert_eq!(advance_collect(&mut w, 501), vec![(501, 'b')]);
}

#[test]
fn reschedule_keeps_the_handle_and_value() {
    let mut w = TimerWheel::new(0, 8);
    let h = w.insert(1_000, String::from("route")).unwrap();
    for d in [2_000u64, 40, 1 << 35, 999, 70_000] {
        assert!(w.reschedule(h, d));
        assert_eq!(w.get(h).map(String::as_str), Some("route"));
        w.check_invariants().unwrap();
    }
    w.get_mut(h).unwrap().push_str("-touched");
    assert_eq!(w.cancel(h).as_deref(), Some("route-touched"));
}

#[test]
fn stale_handles_never_touch_a_reused_slot() {
    let mut w = TimerWheel::new(0, 1);
    let old = w.insert(5, 1u32).unwrap();
    assert_eq!(advance_collect(&mut w, 5), vec![(5, 1)]);
    // The single slot is reused by the next timer.
    let new = w.insert(50, 2u32).unwrap();
    assert_ne!(old, new);
    assert_eq!(w.get(old), None);
    assert_eq!(w.get_mut(old), None);
    assert_eq!(w.deadline(old), None);
    assert!(!w.reschedule(old, 6));
    assert_eq!(w.cancel(old), None);
    assert_eq!(w.get(new), Some(&2));
    assert_eq!(w.len(), 1);
    // Cancelled handles are stale too.
    assert_eq!(w.cancel(new), Some(2));
    let newer = w.insert(60, 3u32).unwrap();
    assert_eq!(w.cancel(new), None);
    assert!(!w.reschedule(new, 1));
    assert_eq!(advance_collect(&mut w, 60), vec![(60, 3)]);
    assert_eq!(w.get(newer), None);
}

#[test]
fn capacity_full_hands_the_value_back() {
    let mut w = TimerWheel::new(0, 3);
    assert_eq!(w.timers_max(), 3);
    let hs: Vec<_> = (0..3)
        .map(|i| w.insert(10 + i, format!("t{i}")).unwrap())
        .collect();
    match w.insert(99, String::from("overflow")) {
        Err(TimerFull(v)) => assert_eq!(v, "overflow"),
        Ok(_) => panic!("insert beyond timers_max succeeded"),
    }
    assert_eq!(w.len(), 3);
    // Room comes back after a cancel or a fire.
    assert!(w.cancel(hs[1]).is_some());
    w.insert(99, String::from("again")).unwrap();
    assert!(w.insert(99, String::from("full")).is_err());
    assert_eq!(advance_collect(&mut w, 10).len(), 1);
    w.insert(99, String::from("third")).unwrap();
    assert_eq!(w.len(), 3);

    let mut zero: TimerWheel<u8> = TimerWheel::new(0, 0);
    assert!(matches!(zero.insert(1, 7), Err(TimerFull(7))));
}

#[test]
fn a_pass_visits_only_due_buckets() {
    let mut w = TimerWheel::new(0, 20_000);
    // 10,000 timers far in the future, spread over a wide range.
    for i in 0..10_000u64 {
        w.insert(1_000_000 + i * 997, i).unwrap();
    }
    for i in 0..10u64 {
        w.insert(100 + i * 5, 1_000_000 + i).unwrap();
    }
    w.reset_stats();
    let fired = advance_collect(&mut w, 150);
    assert_eq!(fired.len(), 10);
    let s = w.stats();
    assert_eq!(s.fired, 10);
    assert!(s.entries_visited <= s.fired + s.recascaded, "{s:?}");
    assert!(s.entries_visited < 100, "{s:?}");
    assert!(s.buckets_visited <= 20, "{s:?}");

    // Same with due timers parked in coarse levels: inserted far ahead, they
    // recascade on the way down, each at most once per level.
    let mut w = TimerWheel::new(0, 20_000);
    for i in 0..10_000u64 {
        w.insert(100_000_000 + i * 13, i).unwrap();
    }
    for i in 0..10u64 {
        w.insert(70_000 + i * 1_000, i).unwrap();
    }
    w.reset_stats();
    let mut fired = 0;
    for now in (0..=80_000u64).step_by(250) {
        fired += advance_collect(&mut w, now).len();
    }
    assert_eq!(fired, 10);
    let s = w.stats();
    assert_eq!(s.entries_visited, s.fired + s.recascaded, "{s:?}");
    assert!(s.recascaded <= 10 * LEVELS as u64, "{s:?}");
    assert!(s.entries_visited < 200, "{s:?}");
    assert_eq!(w.len(), 10_000);
}

#[test]
fn next_deadline_is_a_lower_bound() {
    let mut w = TimerWheel::new(1_000, 64);
    assert_eq!(w.next_deadline(), None);
    w.insert(1_030, ()).unwrap();
    assert_eq!(w.next_deadline(), Some(1_030)); // level 0 is exact
    w.insert(1_010, ()).unwrap();
    assert_eq!(w.next_deadline(), Some(1_010));
    let mut w = TimerWheel::new(0, 64);
    let d = 1_000_003u64;
    w.insert(d, ()).unwrap();
    let mut now = 0;
    // Following next_deadline converges to the deadline, never passing it.
    while let Some(next) = w.next_deadline() {
        assert!(next <= d && next > now);
        now = next;
        let n = w.advance(now, |_, _, _| {});
        assert_eq!(n == 1, now == d);
    }
    assert_eq!(now, d);
}

#[test]
fn values_are_dropped_exactly_once() {
    struct Counted(Rc<Cell<u32>>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.set(self.0.get() + 1);
        }
    }
    let drops = Rc::new(Cell::new(0));
    {
        let mut w = TimerWheel::new(0, 16);
        for d in [1u64, 100, 10_000, 1 << 40] {
            w.insert(d, Counted(drops.clone())).unwrap();
        }
        let h = w.insert(5, Counted(drops.clone())).unwrap();
        drop(w.cancel(h));
        assert_eq!(drops.get(), 1);
        w.advance(100, |_, _, v| drop(v));
        assert_eq!(drops.get(), 3);
    }
    assert_eq!(drops.get(), 5, "live values are dropped with the wheel");
}

#[test]
fn huge_max_timers_is_clamped_and_does_not_preallocate() {
    let mut w: TimerWheel<u64> = TimerWheel::new(0, usize::MAX);
    assert!(w.timers_max() <= u32::MAX as usize);
    for i in 0..5_000 {
        w.insert(i, i).unwrap();
    }
    assert_eq!(w.advance(5_000, |_, _, _| {}), 5_000);
}

#[test]
fn cancel_and_reschedule_within_one_crowded_bucket() {
    let mut w = TimerWheel::new(0, 64);
    // All in the same level-0 bucket, then removed from the middle, the end
    // and the front, each removal checked against the survivors.
    let hs: Vec<_> = (0..10u32).map(|i| w.insert(40, i).unwrap()).collect();
    for &i in &[4usize, 9, 0, 5, 8] {
        assert_eq!(w.cancel(hs[i]), Some(i as u32));
        w.check_invariants().unwrap();
    }
    assert!(w.reschedule(hs[1], 41));
    assert!(w.reschedule(hs[7], 39));
    for &i in &[2usize, 3, 6] {
        assert_eq!(w.get(hs[i]), Some(&(i as u32)));
    }
    assert_eq!(w.cancel(hs[3]), Some(3));
    assert_eq!(advance_collect(&mut w, 39), vec![(39, 7)]);
    assert_eq!(advance_collect(&mut w, 41), vec![(40, 2), (40, 6), (41, 1)]);
}

#[test]
fn clamped_timer_recascaded_into_its_own_bucket_survives() {
    let top_granule = 1u64 << ((LEVELS as u32 - 1) * LVL_CLK_SHIFT);
    let mut w = TimerWheel::new(0, 4);
    // Beyond the top window: clamped into the top level's slot 63.
    let far = 1u64 << 40;
    w.insert(far, 'f').unwrap();
    // Slot 64: the clamp target `64 + 63` maps to the bucket being drained.
    assert!(advance_collect(&mut w, 64 * top_granule).is_empty());
    assert_eq!(w.len(), 1);
    assert!(advance_collect(&mut w, 200 * top_granule + 5).is_empty());
    assert!(advance_collect(&mut w, far - 1).is_empty());
    assert_eq!(advance_collect(&mut w, far), vec![(far, 'f')]);
}
