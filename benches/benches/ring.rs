//! `ring` vs `rtrb`: two-thread transfer throughput (single push/pop and
//! batches of 32) and one-way hand-off latency (ping-pong round trip / 2).
//! Producer/pinger on core 0, consumer/ponger on core 1 (when available).
//!
//! `cargo bench -p benches --bench ring -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

/// Slots of every ring in the throughput benches.
const RING_CAPACITY: usize = 1024;
/// Items per batch in the batched benches.
const BATCH_ITEMS: usize = 32;

fn pin(index: usize) {
    if let Some(ids) = core_affinity::get_core_ids() {
        if let Some(id) = ids.get(index % ids.len()) {
            core_affinity::set_for_current(*id);
        }
    }
}

/// Runs `produce(count)` on core 0 (this thread) and `consume(count)` on core
/// 1; returns the time until the consumer has received everything.
fn two_threads<P, C>(count: u64, produce: P, consume: C) -> Duration
where
    P: FnOnce(u64),
    C: FnOnce(u64) -> u64 + Send + 'static,
{
    pin(0);
    let ready = Arc::new(Barrier::new(2));
    let consumer_ready = Arc::clone(&ready);
    let consumer = thread::spawn(move || {
        pin(1);
        consumer_ready.wait();
        let sum = consume(count);
        (Instant::now(), sum)
    });
    ready.wait();
    let start = Instant::now();
    produce(count);
    let (end, sum) = consumer.join().expect("consumer panicked");
    assert_eq!(
        sum,
        count * count.saturating_sub(1) / 2,
        "lost or duplicated items"
    );
    end.duration_since(start)
}

fn ring_single(count: u64) -> Duration {
    let (mut p, mut c) = ring::channel::<u64>(RING_CAPACITY);
    two_threads(
        count,
        move |count| {
            for i in 0..count {
                while p.push(i).is_err() {
                    std::hint::spin_loop();
                }
            }
        },
        move |count| {
            let mut sum = 0u64;
            let mut received = 0;
            while received < count {
                if let Some(v) = c.pop() {
                    sum = sum.wrapping_add(v);
                    received += 1;
                } else {
                    std::hint::spin_loop();
                }
            }
            sum
        },
    )
}

fn ring_batch(count: u64) -> Duration {
    let (mut p, mut c) = ring::channel::<u64>(RING_CAPACITY);
    two_threads(
        count,
        move |count| {
            let mut next = 0;
            while next < count {
                let mut items = next..(next + BATCH_ITEMS as u64).min(count);
                let n = p.push_batch(&mut items);
                if n == 0 {
                    std::hint::spin_loop();
                }
                next += n as u64;
            }
        },
        move |count| {
            let mut sum = 0u64;
            let mut received = 0;
            while received < count {
                let n = c.pop_batch(BATCH_ITEMS, |v| sum = sum.wrapping_add(v));
                if n == 0 {
                    std::hint::spin_loop();
                }
                received += n as u64;
            }
            sum
        },
    )
}

fn rtrb_single(count: u64) -> Duration {
    let (mut p, mut c) = rtrb::RingBuffer::<u64>::new(RING_CAPACITY);
    two_threads(
        count,
        move |count| {
            for i in 0..count {
                while p.push(i).is_err() {
                    std::hint::spin_loop();
                }
            }
        },
        move |count| {
            let mut sum = 0u64;
            let mut received = 0;
            while received < count {
                if let Ok(v) = c.pop() {
                    sum = sum.wrapping_add(v);
                    received += 1;
                } else {
                    std::hint::spin_loop();
                }
            }
            sum
        },
    )
}

fn rtrb_chunk(count: u64) -> Duration {
    let (mut p, mut c) = rtrb::RingBuffer::<u64>::new(RING_CAPACITY);
    two_threads(
        count,
        move |count| {
            let mut next = 0;
            while next < count {
                let n = p.slots().min(BATCH_ITEMS).min((count - next) as usize);
                if n == 0 {
                    std::hint::spin_loop();
                    continue;
                }
                let chunk = p.write_chunk_uninit(n).expect("n <= slots");
                let written = chunk.fill_from_iter(next..next + n as u64);
                next += written as u64;
            }
        },
        move |count| {
            let mut sum = 0u64;
            let mut received = 0;
            while received < count {
                let n = c.slots().min(BATCH_ITEMS);
                if n == 0 {
                    std::hint::spin_loop();
                    continue;
                }
                let chunk = c.read_chunk(n).expect("n <= slots");
                for v in chunk {
                    sum = sum.wrapping_add(v);
                }
                received += n as u64;
            }
            sum
        },
    )
}

/// Smallest run: amortizes the thread spawn and pinning of each sample.
const MIN_TRANSFER_ITEMS: u64 = 20_000;
/// Smallest ping-pong run.
const MIN_ROUND_TRIPS: u64 = 200;

/// Runs `run` on at least `min` iterations and scales the time to `iters`.
fn scaled(iters: u64, min: u64, run: fn(u64) -> Duration) -> Duration {
    let n = iters.max(min);
    run(n).mul_f64(iters as f64 / n as f64)
}

fn throughput(c: &mut Criterion) {
    let mut group = c.benchmark_group("spsc_transfer_u64");
    group.throughput(Throughput::Elements(1));
    type Run = fn(u64) -> Duration;
    let cases: [(&str, &str, Run); 4] = [
        ("ring", "single", ring_single),
        ("rtrb", "single", rtrb_single),
        ("ring", "batch32", ring_batch),
        ("rtrb", "chunk32", rtrb_chunk),
    ];
    for (name, mode, run) in cases {
        group.bench_function(BenchmarkId::new(name, mode), |b| {
            b.iter_custom(|iters| scaled(iters, MIN_TRANSFER_ITEMS, run))
        });
    }
    group.finish();
}

/// Per-operation cost without any cache-line transfer: one thread pushes
/// `BATCH_ITEMS` items then pops them (single ops, or one batch each way).
fn same_thread(c: &mut Criterion) {
    let mut group = c.benchmark_group("spsc_same_thread_u64");
    group.throughput(Throughput::Elements(BATCH_ITEMS as u64));
    let n = BATCH_ITEMS as u64;
    let (mut p, mut c_) = ring::channel::<u64>(RING_CAPACITY);
    group.bench_function(BenchmarkId::new("ring", "single"), |b| {
        b.iter(|| {
            for i in 0..n {
                p.push(black_box(i)).expect("room");
            }
            let mut sum = 0u64;
            while let Some(v) = c_.pop() {
                sum = sum.wrapping_add(v);
            }
            black_box(sum)
        })
    });
    group.bench_function(BenchmarkId::new("ring", "batch32"), |b| {
        b.iter(|| {
            let mut items = 0..black_box(n);
            assert_eq!(p.push_batch(&mut items), BATCH_ITEMS);
            let mut sum = 0u64;
            c_.pop_batch(BATCH_ITEMS, |v| sum = sum.wrapping_add(v));
            black_box(sum)
        })
    });
    let (mut p, mut c_) = rtrb::RingBuffer::<u64>::new(RING_CAPACITY);
    group.bench_function(BenchmarkId::new("rtrb", "single"), |b| {
        b.iter(|| {
            for i in 0..n {
                p.push(black_box(i)).expect("room");
            }
            let mut sum = 0u64;
            while let Ok(v) = c_.pop() {
                sum = sum.wrapping_add(v);
            }
            black_box(sum)
        })
    });
    group.bench_function(BenchmarkId::new("rtrb", "chunk32"), |b| {
        b.iter(|| {
            let chunk = p.write_chunk_uninit(BATCH_ITEMS).expect("room");
            assert_eq!(chunk.fill_from_iter(0..black_box(n)), BATCH_ITEMS);
            let mut sum = 0u64;
            for v in c_.read_chunk(BATCH_ITEMS).expect("items") {
                sum = sum.wrapping_add(v);
            }
            black_box(sum)
        })
    });
    group.finish();
}

/// Ping-pong: this thread (core 0) sends `i` and waits for it back; the other
/// (core 1) echoes. Round trip 0 is a warm-up (both threads running and
/// pinned); returns the time of the next `iters` round trips / 2 (one-way).
fn ping_pong<Ping, Pong>(iters: u64, ping: Ping, pong: Pong) -> Duration
where
    Ping: FnOnce(u64) -> Duration,
    Pong: FnOnce(u64) + Send + 'static,
{
    pin(0);
    let echo = thread::spawn(move || {
        pin(1);
        pong(iters + 1);
    });
    let elapsed = ping(iters + 1);
    echo.join().expect("echo panicked");
    elapsed / 2
}

fn ring_ping_pong(iters: u64) -> Duration {
    let (mut to_echo, mut from_ping) = ring::channel::<u64>(2);
    let (mut to_ping, mut from_echo) = ring::channel::<u64>(2);
    ping_pong(
        iters,
        move |iters| {
            let mut start = Instant::now();
            for i in 0..iters {
                if i == 1 {
                    start = Instant::now();
                }
                to_echo.push(i).expect("one item in flight");
                loop {
                    if let Some(v) = from_echo.pop() {
                        assert_eq!(v, i);
                        break;
                    }
                    std::hint::spin_loop();
                }
            }
            start.elapsed()
        },
        move |iters| {
            for _ in 0..iters {
                let v = loop {
                    if let Some(v) = from_ping.pop() {
                        break v;
                    }
                    std::hint::spin_loop();
                };
                to_ping.push(black_box(v)).expect("one item in flight");
            }
        },
    )
}

fn rtrb_ping_pong(iters: u64) -> Duration {
    let (mut to_echo, mut from_ping) = rtrb::RingBuffer::<u64>::new(2);
    let (mut to_ping, mut from_echo) = rtrb::RingBuffer::<u64>::new(2);
    ping_pong(
        iters,
        move |iters| {
            let mut start = Instant::now();
            for i in 0..iters {
                if i == 1 {
                    start = Instant::now();
                }
                to_echo.push(i).expect("one item in flight");
                loop {
                    if let Ok(v) = from_echo.pop() {
                        assert_eq!(v, i);
                        break;
                    }
                    std::hint::spin_loop();
                }
            }
            start.elapsed()
        },
        move |iters| {
            for _ in 0..iters {
                let v = loop {
                    if let Ok(v) = from_ping.pop() {
                        break v;
                    }
                    std::hint::spin_loop();
                };
                to_ping.push(black_box(v)).expect("one item in flight");
            }
        },
    )
}

fn latency(c: &mut Criterion) {
    let mut group = c.benchmark_group("spsc_one_way_latency");
    group.bench_function("ring", |b| {
        b.iter_custom(|iters| scaled(iters, MIN_ROUND_TRIPS, ring_ping_pong))
    });
    group.bench_function("rtrb", |b| {
        b.iter_custom(|iters| scaled(iters, MIN_ROUND_TRIPS, rtrb_ping_pong))
    });
    group.finish();
}

criterion_group!(benches, same_thread, throughput, latency);
criterion_main!(benches);
