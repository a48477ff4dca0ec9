//! Loom models of the ring and the doorbell protocol. Run with:
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=/work/target-ring-loom
//! cargo test -p ring --release --test loom`
//!
//! Spin loops call `loom::thread::yield_now()` so loom can schedule the peer.

#![cfg(loom)]

use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::{Arc, Condvar, Mutex};
use loom::thread;

use ring::{channel, Consumer, Doorbell, Producer};

fn push_spin<T: Send>(producer: &mut Producer<T>, mut value: T) {
    loop {
        match producer.push(value) {
            Ok(()) => return,
            Err(v) => {
                value = v;
                thread::yield_now();
            }
        }
    }
}

fn pop_spin<T: Send>(consumer: &mut Consumer<T>) -> T {
    loop {
        if let Some(v) = consumer.pop() {
            return v;
        }
        thread::yield_now();
    }
}

#[test]
fn push_pop_in_order() {
    loom::model(|| {
        let (mut p, mut c) = channel::<u32>(2);
        let t = thread::spawn(move || {
            for i in 0..3 {
                push_spin(&mut p, i);
            }
        });
        for i in 0..3 {
            assert_eq!(pop_spin(&mut c), i);
        }
        t.join().unwrap();
        assert_eq!(c.pop(), None);
    });
}

#[test]
fn batch_push_pop_wrap_around() {
    loom::model(|| {
        // Capacity 2, 3 items: the second batch wraps around.
        let (mut p, mut c) = channel::<u32>(2);
        let t = thread::spawn(move || {
            let mut items = 0..3u32;
            while items.start < 3 {
                if p.push_batch(&mut items) == 0 {
                    thread::yield_now();
                }
            }
        });
        let mut expected = 0;
        while expected < 3 {
            let n = c.pop_batch(2, |v| {
                assert_eq!(v, expected);
                expected += 1;
            });
            if n == 0 {
                thread::yield_now();
            }
        }
        t.join().unwrap();
        assert!(c.is_empty());
    });
}

/// Counts its drops.
struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

#[test]
fn unconsumed_items_dropped_once() {
    loom::model(|| {
        let drops = Arc::new(AtomicUsize::new(0));
        let (mut p, mut c) = channel::<Counted>(2);
        let producer_drops = Arc::clone(&drops);
        let t = thread::spawn(move || {
            // The first push always fits; the second may fit or come back.
            assert!(p.push(Counted(Arc::clone(&producer_drops))).is_ok());
            let _ = p.push(Counted(Arc::clone(&producer_drops)));
            let _ = p.push(Counted(producer_drops));
            // `p` dropped here, concurrently with the consumer.
        });
        // Pop at most one, then drop the consumer concurrently.
        drop(c.pop());
        drop(c);
        t.join().unwrap();
        // Three values were created; each is dropped exactly once (popped,
        // rejected by a full ring, or left in the ring).
        assert_eq!(drops.load(Ordering::Relaxed), 3);
    });
}

/// An eventfd-like wake mechanism: a sticky flag behind a mutex.
struct Event {
    set: Mutex<bool>,
    cond: Condvar,
}

impl Event {
    fn new() -> Self {
        Self {
            set: Mutex::new(false),
            cond: Condvar::new(),
        }
    }

    fn signal(&self) {
        *self.set.lock().unwrap() = true;
        self.cond.notify_one();
    }

    /// Blocks until signalled, then clears the flag.
    fn wait(&self) {
        let mut set = self.set.lock().unwrap();
        while !*set {
            set = self.cond.wait(set).unwrap();
        }
        *set = false;
    }
}

/// Consumer side of the protocol: receive `count` items from `rings`,
/// sleeping on `event` when all are empty. A lost wake-up blocks forever,
/// which loom reports as a deadlock.
fn consume_with_sleep(rings: &mut [Consumer<u32>], bell: &Doorbell, event: &Event, count: usize) {
    let mut received = 0;
    while received < count {
        let mut progress = 0;
        for ring in rings.iter_mut() {
            progress += ring.pop_batch(usize::MAX, |_| {});
        }
        received += progress;
        if progress > 0 || received == count {
            continue;
        }
        bell.prepare_sleep();
        if rings.iter().any(|r| !r.is_empty()) {
            bell.cancel_sleep();
            continue;
        }
        event.wait();
        bell.cancel_sleep();
    }
}

fn produce_and_ring(producer: &mut Producer<u32>, value: u32, bell: &Doorbell, event: &Event) {
    push_spin(producer, value);
    if bell.should_wake() {
        event.signal();
    }
}

#[test]
fn doorbell_no_lost_wakeup_one_producer() {
    loom::model(|| {
        let bell = Arc::new(Doorbell::new());
        let event = Arc::new(Event::new());
        let (mut p, c) = channel::<u32>(2);
        let (producer_bell, producer_event) = (Arc::clone(&bell), Arc::clone(&event));
        let t = thread::spawn(move || {
            produce_and_ring(&mut p, 1, &producer_bell, &producer_event);
            produce_and_ring(&mut p, 2, &producer_bell, &producer_event);
        });
        consume_with_sleep(&mut [c], &bell, &event, 2);
        t.join().unwrap();
    });
}

#[test]
fn doorbell_no_lost_wakeup_two_producers() {
    loom::model(|| {
        let bell = Arc::new(Doorbell::new());
        let event = Arc::new(Event::new());
        let (p1, c1) = channel::<u32>(2);
        let (p2, c2) = channel::<u32>(2);
        let spawn_producer = |mut p: Producer<u32>| {
            let (bell, event) = (Arc::clone(&bell), Arc::clone(&event));
            thread::spawn(move || produce_and_ring(&mut p, 7, &bell, &event))
        };
        let t1 = spawn_producer(p1);
        let t2 = spawn_producer(p2);
        consume_with_sleep(&mut [c1, c2], &bell, &event, 2);
        t1.join().unwrap();
        t2.join().unwrap();
    });
}

#[test]
fn doorbell_at_most_one_claim_per_sleep() {
    loom::model(|| {
        let bell = Arc::new(Doorbell::new());
        bell.prepare_sleep();
        let claims = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let (bell, claims) = (Arc::clone(&bell), Arc::clone(&claims));
                thread::spawn(move || {
                    if bell.should_wake() {
                        claims.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(claims.load(Ordering::Relaxed), 1);
        assert!(!bell.is_sleeping());
    });
}
