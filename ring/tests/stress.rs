//! Two-thread stress tests: every item arrives exactly once and in order,
//! through a small ring with random batch sizes; and the doorbell protocol with
//! a consumer that really parks (`std::thread::park`), fed by two producers.
//!
//! Seeded: `RING_STRESS_SEED=<u64>` reproduces a run (the seed is printed).
//! A lost wake-up shows up as a hung doorbell test.

#![cfg(not(loom))]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;

use ring::{channel, Consumer, Doorbell, Producer};

/// Items per stress run: millions in release, fewer in debug, tiny under miri.
const ITEMS_COUNT: u64 = if cfg!(miri) {
    2_000
} else if cfg!(debug_assertions) {
    2_000_000
} else {
    20_000_000
};
/// Largest random batch.
const BATCH_MAX: u64 = 48;
/// Small ring so that full and empty happen constantly.
const RING_CAPACITY: usize = 16;

/// splitmix64: tiny deterministic generator (no dependency).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `1..=max`.
    fn batch(&mut self, max: u64) -> u64 {
        self.next() % max + 1
    }
}

fn seed() -> u64 {
    let seed = std::env::var("RING_STRESS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5EED_0001);
    println!("RING_STRESS_SEED={seed}");
    seed
}

/// Spin politely: the machine may have fewer cores than spinning threads.
fn backoff(spins: &mut u32) {
    *spins += 1;
    if *spins < 64 {
        std::hint::spin_loop();
    } else {
        thread::yield_now();
    }
}

/// Pushes `first..first + count` with random single pushes and batches.
/// After each publication, rings the doorbell if one is given.
fn produce(
    mut producer: Producer<u64>,
    first: u64,
    count: u64,
    mut rng: Rng,
    bell: Option<(&Doorbell, &thread::Thread, &AtomicUsize)>,
) {
    let end = first + count;
    let mut next = first;
    let mut spins = 0;
    while next < end {
        let want = rng.batch(BATCH_MAX).min(end - next);
        let pushed = if want == 1 {
            match producer.push(next) {
                Ok(()) => 1,
                Err(v) => {
                    assert_eq!(v, next, "push returns the rejected value");
                    0
                }
            }
        } else {
            let mut items = next..next + want;
            let n = producer.push_batch(&mut items) as u64;
            assert_eq!(items.start, next + n, "push_batch took only what it pushed");
            n
        };
        next += pushed;
        if pushed == 0 {
            backoff(&mut spins);
            continue;
        }
        spins = 0;
        if let Some((bell, consumer, wakes)) = bell {
            if bell.should_wake() {
                wakes.fetch_add(1, Ordering::Relaxed);
                consumer.unpark();
            }
            // Give the consumer time to drain and fall asleep now and then.
            if rng.next().is_multiple_of(16) {
                thread::yield_now();
            }
        }
    }
}

/// Pops one item or a random batch; checks the order; returns how many.
fn consume_some(consumer: &mut Consumer<u64>, expected: &mut u64, rng: &mut Rng) -> u64 {
    let max = rng.batch(BATCH_MAX);
    if max == 1 {
        match consumer.pop() {
            Some(v) => {
                assert_eq!(v, *expected, "out of order or duplicated");
                *expected += 1;
                1
            }
            None => 0,
        }
    } else {
        let n = consumer.pop_batch(max as usize, |v| {
            assert_eq!(v, *expected, "out of order or duplicated");
            *expected += 1;
        });
        assert!(n as u64 <= max);
        n as u64
    }
}

#[test]
fn spsc_stress_random_batches_in_order() {
    let seed = seed();
    let (producer, mut consumer) = channel::<u64>(RING_CAPACITY);
    let producer_rng = Rng(seed);
    let producer_thread =
        thread::spawn(move || produce(producer, 0, ITEMS_COUNT, producer_rng, None));
    let mut rng = Rng(seed ^ 0xC0FF_EE00);
    let mut expected = 0;
    let mut spins = 0;
    while expected < ITEMS_COUNT {
        if consume_some(&mut consumer, &mut expected, &mut rng) == 0 {
            backoff(&mut spins);
        } else {
            spins = 0;
        }
    }
    producer_thread.join().expect("producer panicked");
    assert!(consumer.is_abandoned());
    assert_eq!(consumer.pop(), None, "no item beyond the last one");
    assert_eq!(expected, ITEMS_COUNT);
}

#[test]
fn doorbell_stress_parking_consumer_two_producers() {
    const PRODUCERS_COUNT: u64 = 2;
    let seed = seed();
    let per_producer = ITEMS_COUNT / 4;
    let bell = Arc::new(Doorbell::new());
    let wakes = Arc::new(AtomicUsize::new(0));
    let (producers, mut consumers): (Vec<_>, Vec<_>) = (0..PRODUCERS_COUNT)
        .map(|_| channel::<u64>(RING_CAPACITY))
        .unzip();

    let consumer_bell = Arc::clone(&bell);
    let consumer_thread = thread::spawn(move || {
        let bell = consumer_bell;
        let mut rng = Rng(seed ^ 0xC0FF_EE00);
        // Producer i sends `i * per_producer ..`; check each ring's order.
        let mut expected: Vec<u64> = (0..PRODUCERS_COUNT).map(|i| i * per_producer).collect();
        let mut received = 0;
        let (mut announces, mut parks) = (0u64, 0u64);
        while received < PRODUCERS_COUNT * per_producer {
            let mut progress = 0;
            for (consumer, expected) in consumers.iter_mut().zip(expected.iter_mut()) {
                progress += consume_some(consumer, expected, &mut rng);
            }
            received += progress;
            if progress > 0 {
                continue;
            }
            bell.prepare_sleep();
            announces += 1;
            if consumers.iter().all(|c| c.is_empty()) {
                parks += 1;
                thread::park();
            }
            bell.cancel_sleep();
        }
        for (i, (consumer, expected)) in consumers.iter_mut().zip(&expected).enumerate() {
            assert_eq!(*expected, (i as u64 + 1) * per_producer);
            assert_eq!(consumer.pop(), None);
        }
        (announces, parks)
    });

    let consumer_handle = consumer_thread.thread().clone();
    let producer_threads: Vec<_> = producers
        .into_iter()
        .enumerate()
        .map(|(i, producer)| {
            let bell = Arc::clone(&bell);
            let wakes = Arc::clone(&wakes);
            let consumer_handle = consumer_handle.clone();
            let rng = Rng(seed.wrapping_add(i as u64 + 1));
            thread::spawn(move || {
                let first = i as u64 * per_producer;
                produce(
                    producer,
                    first,
                    per_producer,
                    rng,
                    Some((&bell, &consumer_handle, &wakes)),
                );
            })
        })
        .collect();
    for t in producer_threads {
        t.join().expect("producer panicked");
    }
    let (announces, parks) = consumer_thread.join().expect("consumer panicked");
    let wakes = wakes.load(Ordering::Relaxed) as u64;
    println!(
        "consumer announced sleep {announces} times, parked {parks} times, was woken {wakes} times"
    );
    assert!(wakes <= announces, "at most one wake per announced sleep");
}
