//! `ring` vs `rtrb`: two-thread transfer throughput (single push/pop and
//! batches of 32) and one-way hand-off latency (ping-pong round trip / 2).
//! Producer/pinger on core 0, consumer/ponger on core 1 (when available), plus
//! windowed figures (a low quantile of timed windows) that hold on a shared VM.
//!
//! `cargo bench -p benches --bench ring -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::sync::{Arc, Barrier, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

/// Slots of every ring in the throughput benches.
const RING_CAPACITY: usize = 1024;
/// Items per batch in the batched benches.
const BATCH_ITEMS: usize = 32;

/// Pins the calling thread to core `index` of the machine. The core list is read
/// once, before any pinning: `core_affinity::get_core_ids` lists the *calling
/// thread's* allowed cores, so a thread spawned by a pinned one would see only its
/// parent's core and pin itself there too (both "pinned" threads on one core, each
/// hand-off costing a scheduler time slice).
fn pin(index: usize) {
    static CORES: OnceLock<Vec<core_affinity::CoreId>> = OnceLock::new();
    let ids = CORES.get_or_init(|| core_affinity::get_core_ids().unwrap_or_default());
    if let Some(id) = ids.get(index % ids.len().max(1)) {
        core_affinity::set_for_current(*id);
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

/// Items per timed window of the windowed transfer.
const WINDOW_ITEMS: u64 = 4096;
/// Windows per windowed transfer run.
const WINDOWS: usize = 512;
/// Round trips per timed window of the windowed ping-pong.
const WINDOW_ROUND_TRIPS: u64 = 64;
/// Windows per windowed ping-pong run (a hand-off to a descheduled thread costs a
/// time slice: kept short so that a loaded machine still ends the run).
const PING_PONG_WINDOWS: usize = 64;

/// The time of the window at quantile `q` of `windows` (sorted here).
fn quantile(windows: &mut [Duration], q: f64) -> Duration {
    windows.sort_unstable();
    windows[((windows.len() - 1) as f64 * q) as usize]
}

/// Windowed cross-core transfer, meaningful on a VM shared with other work: two
/// spinning threads pinned to two cores only measure the ring while both run at
/// once, so the consumer times every `WINDOW_ITEMS` items and the figure is a low
/// quantile of the windows (the ones both threads ran through), not the total.
/// `pop` returns whether it popped an item.
fn windowed_transfer<P, C>(mut push: P, mut pop: C) -> Vec<Duration>
where
    P: FnMut(u64) -> bool + Send + 'static,
    C: FnMut(&mut u64) -> bool,
{
    let count = WINDOW_ITEMS * (WINDOWS as u64 + 1);
    pin(1);
    let ready = Arc::new(Barrier::new(2));
    let producer_ready = Arc::clone(&ready);
    let producer = thread::spawn(move || {
        pin(0);
        producer_ready.wait();
        for i in 0..count {
            while !push(i) {
                std::hint::spin_loop();
            }
        }
    });
    ready.wait();
    let mut windows = Vec::with_capacity(WINDOWS);
    let (mut sum, mut received, mut v) = (0u64, 0u64, 0u64);
    let mut start = Instant::now();
    while received < count {
        if pop(&mut v) {
            sum = sum.wrapping_add(v);
            received += 1;
            if received % WINDOW_ITEMS == 0 {
                let now = Instant::now();
                // The first window includes the start-up: not kept.
                if received > WINDOW_ITEMS {
                    windows.push(now - start);
                }
                start = now;
            }
        } else {
            std::hint::spin_loop();
        }
    }
    producer.join().expect("producer panicked");
    assert_eq!(sum, count * (count - 1) / 2, "lost or duplicated items");
    windows
}

fn ring_windowed() -> Vec<Duration> {
    let (mut p, mut c) = ring::channel::<u64>(RING_CAPACITY);
    windowed_transfer(
        move |i| p.push(i).is_ok(),
        move |v| c.pop().map(|x| *v = x).is_some(),
    )
}

fn rtrb_windowed() -> Vec<Duration> {
    let (mut p, mut c) = rtrb::RingBuffer::<u64>::new(RING_CAPACITY);
    windowed_transfer(
        move |i| p.push(i).is_ok(),
        move |v| c.pop().map(|x| *v = x).is_ok(),
    )
}

/// Windowed ping-pong on two pinned cores: times every `WINDOW_ROUND_TRIPS`
/// round trips; returns the windows' one-way time per hand-off.
fn windowed_ping_pong<Send1, Recv1, Send2, Recv2>(
    mut to_echo: Send1,
    mut from_echo: Recv1,
    mut to_ping: Send2,
    mut from_ping: Recv2,
) -> Vec<Duration>
where
    Send1: FnMut(u64) -> bool,
    Recv1: FnMut() -> Option<u64>,
    Send2: FnMut(u64) -> bool + Send + 'static,
    Recv2: FnMut() -> Option<u64> + Send + 'static,
{
    let trips = WINDOW_ROUND_TRIPS * (PING_PONG_WINDOWS as u64 + 1);
    pin(0);
    let echo = thread::spawn(move || {
        pin(1);
        for _ in 0..trips {
            let v = loop {
                if let Some(v) = from_ping() {
                    break v;
                }
                std::hint::spin_loop();
            };
            assert!(to_ping(v), "one item in flight");
        }
    });
    let mut windows = Vec::with_capacity(PING_PONG_WINDOWS);
    let mut start = Instant::now();
    for i in 0..trips {
        assert!(to_echo(i), "one item in flight");
        loop {
            if let Some(v) = from_echo() {
                assert_eq!(v, i);
                break;
            }
            std::hint::spin_loop();
        }
        if (i + 1) % WINDOW_ROUND_TRIPS == 0 {
            let now = Instant::now();
            if i + 1 > WINDOW_ROUND_TRIPS {
                windows.push((now - start) / (2 * WINDOW_ROUND_TRIPS as u32));
            }
            start = now;
        }
    }
    echo.join().expect("echo panicked");
    windows
}

fn ring_windowed_ping_pong() -> Vec<Duration> {
    let (mut a, mut b) = ring::channel::<u64>(2);
    let (mut c, mut d) = ring::channel::<u64>(2);
    windowed_ping_pong(
        move |v| a.push(v).is_ok(),
        move || d.pop(),
        move |v| c.push(v).is_ok(),
        move || b.pop(),
    )
}

fn rtrb_windowed_ping_pong() -> Vec<Duration> {
    let (mut a, mut b) = rtrb::RingBuffer::<u64>::new(2);
    let (mut c, mut d) = rtrb::RingBuffer::<u64>::new(2);
    windowed_ping_pong(
        move |v| a.push(v).is_ok(),
        move || d.pop().ok(),
        move |v| c.push(v).is_ok(),
        move || b.pop().ok(),
    )
}

/// Interleaved rounds (ring, rtrb, ring, rtrb, …) of the windowed runs, printed as
/// min / p10 / p50 of all windows of each: the A/B figure on a shared machine.
/// Runs only with `CROSS_CORE_ROUNDS=N` set (N rounds; slow on a loaded machine).
fn interleaved_cross_core() {
    let rounds: usize = std::env::var("CROSS_CORE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if rounds == 0 {
        return;
    }
    type Run = fn() -> Vec<Duration>;
    let pairs: [(&str, Run, Run, f64); 2] = [
        (
            "transfer ns/item",
            ring_windowed,
            rtrb_windowed,
            WINDOW_ITEMS as f64,
        ),
        (
            "one-way hand-off ns",
            ring_windowed_ping_pong,
            rtrb_windowed_ping_pong,
            1.0,
        ),
    ];
    for (what, a, b, per) in pairs {
        let (mut wa, mut wb) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            wa.extend(a());
            wb.extend(b());
        }
        let ns = |w: &mut Vec<Duration>, q: f64| quantile(w, q).as_nanos() as f64 / per;
        println!(
            "cross-core {what}, {rounds} interleaved rounds: ring min {:.1} p10 {:.1} p50 {:.1} | \
             rtrb min {:.1} p10 {:.1} p50 {:.1} | ring/rtrb p10 {:.2}",
            ns(&mut wa, 0.0),
            ns(&mut wa, 0.1),
            ns(&mut wa, 0.5),
            ns(&mut wb, 0.0),
            ns(&mut wb, 0.1),
            ns(&mut wb, 0.5),
            ns(&mut wa, 0.1) / ns(&mut wb, 0.1),
        );
    }
}

/// The cross-core figures that hold on a shared VM: each criterion iteration is
/// one transfer (or hand-off) at the 10th percentile of a run's windows, i.e. the
/// speed while both pinned threads actually ran (see [`windowed_transfer`]).
/// Criterion's time is per item (transfer) or per one-way hand-off (ping-pong).
fn cross_core(c: &mut Criterion) {
    type Run = fn() -> Vec<Duration>;
    interleaved_cross_core();
    let mut group = c.benchmark_group("spsc_cross_core_p10_window");
    group.sample_size(10);
    let cases: [(&str, &str, Run, u64); 4] = [
        ("ring", "transfer_single", ring_windowed, WINDOW_ITEMS),
        ("rtrb", "transfer_single", rtrb_windowed, WINDOW_ITEMS),
        ("ring", "one_way_latency", ring_windowed_ping_pong, 1),
        ("rtrb", "one_way_latency", rtrb_windowed_ping_pong, 1),
    ];
    for (name, mode, run, per_window) in cases {
        group.bench_function(BenchmarkId::new(name, mode), |b| {
            b.iter_custom(|iters| {
                let mut windows = run();
                quantile(&mut windows, 0.10).mul_f64(iters as f64 / per_window as f64)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, same_thread, throughput, latency, cross_core);
criterion_main!(benches);
