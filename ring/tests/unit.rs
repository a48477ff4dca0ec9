//! Single-threaded behaviour of the ring and the doorbell (also run under
//! miri: `cargo +nightly miri test -p ring --test unit`).

#![cfg(not(loom))]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use ring::{channel, Doorbell};

/// Counts its drops in a shared counter.
#[derive(Debug)]
struct Counted {
    id: u64,
    drops: Arc<AtomicUsize>,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::Relaxed);
    }
}

fn counted(id: u64, drops: &Arc<AtomicUsize>) -> Counted {
    Counted {
        id,
        drops: Arc::clone(drops),
    }
}

#[test]
fn push_pop_full_empty() {
    let (mut p, mut c) = channel::<u32>(4);
    assert_eq!(p.capacity(), 4);
    assert_eq!(c.capacity(), 4);
    assert!(c.is_empty());
    assert_eq!(c.pop(), None);
    assert_eq!(p.free_slots(), 4);
    for i in 0..4 {
        assert_eq!(p.push(i), Ok(()));
    }
    assert_eq!(p.push(99), Err(99));
    assert_eq!(p.free_slots(), 0);
    assert_eq!(c.len(), 4);
    assert!(!c.is_empty());
    assert_eq!(c.pop(), Some(0));
    assert_eq!(p.free_slots(), 1);
    assert_eq!(p.push(4), Ok(()));
    assert_eq!(p.push(5), Err(5));
    for i in 1..=4 {
        assert_eq!(c.pop(), Some(i));
    }
    assert_eq!(c.pop(), None);
    assert!(c.is_empty());
    assert_eq!(c.len(), 0);
}

#[test]
fn wrap_around_many_times() {
    let laps: u64 = if cfg!(miri) { 50 } else { 10_000 };
    let (mut p, mut c) = channel::<u64>(2);
    let (mut pushed, mut popped) = (0u64, 0u64);
    for _ in 0..laps {
        // Fill, check full, free one slot, refill it, drain.
        for _ in 0..2 {
            assert_eq!(p.push(pushed), Ok(()));
            pushed += 1;
        }
        assert_eq!(p.push(u64::MAX), Err(u64::MAX));
        assert_eq!(c.pop(), Some(popped));
        popped += 1;
        assert_eq!(p.push(pushed), Ok(()), "slot freed by pop is reused");
        pushed += 1;
        for _ in 0..2 {
            assert_eq!(c.pop(), Some(popped));
            popped += 1;
        }
        assert_eq!(c.pop(), None);
    }
    assert_eq!(pushed, popped);
}

#[test]
fn fifo_order_across_wrap() {
    let rounds: u64 = if cfg!(miri) { 40 } else { 5_000 };
    let (mut p, mut c) = channel::<u64>(8);
    let (mut pushed, mut popped) = (0u64, 0u64);
    for round in 0..rounds {
        // Push 1..=8 items, pop 1..=8 items, in a pattern that moves the
        // positions across the wrap point at every offset.
        let push_count = round % 8 + 1;
        for _ in 0..push_count {
            if p.push(pushed).is_ok() {
                pushed += 1;
            }
        }
        let pop_count = (round * 5) % 8 + 1;
        for _ in 0..pop_count {
            match c.pop() {
                Some(v) => {
                    assert_eq!(v, popped);
                    popped += 1;
                }
                None => break,
            }
        }
        assert_eq!(c.len() as u64, pushed - popped);
    }
    while let Some(v) = c.pop() {
        assert_eq!(v, popped);
        popped += 1;
    }
    assert_eq!(popped, pushed);
}

#[test]
fn push_batch_partial_fit_keeps_rest_in_iterator() {
    let (mut p, mut c) = channel::<u32>(8);
    assert_eq!(p.push(100), Ok(()));
    assert_eq!(p.push(101), Ok(()));
    let mut items = 0..10u32;
    assert_eq!(p.push_batch(&mut items), 6);
    // Nothing taken from the iterator was lost.
    assert_eq!(items.next(), Some(6));
    assert_eq!(p.push_batch(&mut items), 0, "full ring takes nothing");
    assert_eq!(items.next(), Some(7), "full ring did not call next()");
    let mut got = Vec::new();
    assert_eq!(c.pop_batch(3, |v| got.push(v)), 3);
    assert_eq!(got, [100, 101, 0]);
    // Three slots free: the batch refreshes the stale cached head.
    let mut more = 20..22u32;
    assert_eq!(p.push_batch(&mut more), 2);
    assert_eq!(more.next(), None);
    let mut rest = Vec::new();
    assert_eq!(c.pop_batch(usize::MAX, |v| rest.push(v)), 7);
    assert_eq!(rest, [1, 2, 3, 4, 5, 20, 21]);
    assert_eq!(c.pop_batch(4, |_| unreachable!()), 0);
}

#[test]
fn push_batch_empty_iterator_and_pop_batch_zero() {
    let (mut p, mut c) = channel::<u8>(4);
    assert_eq!(p.push_batch(&mut std::iter::empty()), 0);
    assert_eq!(p.push(1), Ok(()));
    assert_eq!(c.pop_batch(0, |_| unreachable!()), 0);
    assert_eq!(c.len(), 1);
    let mut seen = Vec::new();
    assert_eq!(c.pop_batch(10, |v| seen.push(v)), 1);
    assert_eq!(seen, [1]);
}

#[test]
fn push_batch_fills_exactly_capacity_across_wrap() {
    let (mut p, mut c) = channel::<u64>(4);
    let mut expected = 0u64;
    let mut source = 0u64..;
    for _ in 0..(if cfg!(miri) { 20 } else { 1_000 }) {
        assert_eq!(p.push_batch(&mut source), 4);
        assert_eq!(p.free_slots(), 0);
        let n = c.pop_batch(3, |v| {
            assert_eq!(v, expected);
            expected += 1;
        });
        assert_eq!(n, 3);
        assert_eq!(p.push_batch(&mut source), 3);
        let n = c.pop_batch(4, |v| {
            assert_eq!(v, expected);
            expected += 1;
        });
        assert_eq!(n, 4);
        assert!(c.is_empty());
    }
}

#[test]
fn abandoned_flags() {
    let (mut p, c) = channel::<u8>(2);
    assert!(!p.is_abandoned());
    assert!(!c.is_abandoned());
    drop(c);
    assert!(p.is_abandoned());
    // Pushing into an abandoned ring still works (bounded) and leaks nothing.
    assert_eq!(p.push(1), Ok(()));

    let (mut p, mut c) = channel::<u8>(2);
    assert_eq!(p.push(7), Ok(()));
    drop(p);
    assert!(c.is_abandoned());
    assert_eq!(
        c.pop(),
        Some(7),
        "items pushed before the drop stay poppable"
    );
    assert_eq!(c.pop(), None);
}

#[test]
fn leftover_items_dropped_exactly_once() {
    for consumer_first in [false, true] {
        let drops = Arc::new(AtomicUsize::new(0));
        let (mut p, mut c) = channel::<Counted>(4);
        // Advance the positions so the leftovers straddle the wrap point.
        for id in 0..3 {
            assert!(p.push(counted(id, &drops)).is_ok());
        }
        for id in 0..3 {
            assert_eq!(c.pop().map(|v| v.id), Some(id));
        }
        assert_eq!(drops.load(Ordering::Relaxed), 3);
        for id in 3..7 {
            assert!(p.push(counted(id, &drops)).is_ok());
        }
        let rejected = p.push(counted(7, &drops)).unwrap_err();
        assert_eq!(rejected.id, 7);
        drop(rejected);
        assert_eq!(c.pop().map(|v| v.id), Some(3));
        assert_eq!(drops.load(Ordering::Relaxed), 5);
        // Items 4, 5, 6 remain.
        if consumer_first {
            drop(c);
            assert_eq!(drops.load(Ordering::Relaxed), 5, "producer still alive");
            drop(p);
        } else {
            drop(p);
            assert_eq!(drops.load(Ordering::Relaxed), 5, "consumer still alive");
            drop(c);
        }
        assert_eq!(drops.load(Ordering::Relaxed), 8);
    }
}

#[test]
fn panicking_pop_batch_callback_does_not_duplicate() {
    let drops = Arc::new(AtomicUsize::new(0));
    let (mut p, mut c) = channel::<Counted>(8);
    for id in 0..5 {
        assert!(p.push(counted(id, &drops)).is_ok());
    }
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        c.pop_batch(5, |v| {
            if v.id == 2 {
                panic!("callback fails on item 2");
            }
        })
    }));
    assert!(result.is_err());
    // Items 0, 1, 2 were handed out (and dropped); 3 and 4 remain.
    assert_eq!(drops.load(Ordering::Relaxed), 3);
    assert_eq!(c.pop().map(|v| v.id), Some(3));
    assert_eq!(c.len(), 1);
    drop((p, c));
    assert_eq!(drops.load(Ordering::Relaxed), 5);
}

#[test]
fn panicking_push_batch_iterator_publishes_written_items() {
    let (mut p, mut c) = channel::<u32>(8);
    let mut items = (0..5u32).inspect(|&v| {
        if v == 3 {
            panic!("iterator fails on item 3");
        }
    });
    let result =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| p.push_batch(&mut items)));
    assert!(result.is_err());
    let mut got = Vec::new();
    c.pop_batch(8, |v| got.push(v));
    assert_eq!(got, [0, 1, 2]);
}

#[test]
fn zero_sized_items() {
    let (mut p, mut c) = channel::<()>(2);
    assert_eq!(p.push(()), Ok(()));
    assert_eq!(p.push(()), Ok(()));
    assert_eq!(p.push(()), Err(()));
    assert_eq!(c.pop_batch(8, |()| {}), 2);
    assert_eq!(c.pop(), None);
}

#[test]
#[should_panic(expected = "power of two >= 2")]
fn capacity_not_power_of_two_panics() {
    let _ = channel::<u8>(6);
}

#[test]
#[should_panic(expected = "power of two >= 2")]
fn capacity_one_panics() {
    let _ = channel::<u8>(1);
}

#[test]
fn doorbell_single_thread_protocol() {
    static BELL: Doorbell = Doorbell::new();
    assert!(!BELL.is_sleeping());
    assert!(!BELL.should_wake(), "awake consumer: no wake");
    BELL.prepare_sleep();
    assert!(BELL.is_sleeping());
    assert!(BELL.should_wake(), "first producer claims the wake");
    assert!(!BELL.should_wake(), "only one producer per announced sleep");
    assert!(!BELL.is_sleeping());
    BELL.cancel_sleep();
    BELL.prepare_sleep();
    BELL.cancel_sleep();
    assert!(!BELL.should_wake(), "cancelled sleep needs no wake");
}

#[test]
fn endpoints_are_send_and_doorbell_is_sync() {
    fn assert_send<T: Send>() {}
    fn assert_sync<T: Sync>() {}
    assert_send::<ring::Producer<Box<u8>>>();
    assert_send::<ring::Consumer<Box<u8>>>();
    assert_sync::<Doorbell>();
    assert_send::<Doorbell>();
}
