//! `wheel::TimerWheel`: insert, cancel and reschedule cost with 1M live
//! timers, and the expiry pass: 1M timers spread over a range, each pass
//! advances by 1% of the range (so ~1% are due), compared with a full scan of
//! 1M deadlines. Fired timers are re-armed one range ahead outside the timed
//! region, so the population stays at 1M with uniform deadlines.
//!
//! `cargo bench -p benches --bench timer -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use wheel::{TimerHandle, TimerWheel};

/// Live timers in every bench.
const LIVE_TIMERS: usize = 1_000_000;
/// Slab limit of the benched wheels.
const MAX_TIMERS: usize = 2 * LIVE_TIMERS;
/// Operations timed per `Instant` pair in the per-op benches.
const CHUNK_OPS: usize = 4096;
/// Deadline range in ms-like ticks (~16.7 min) for the per-op benches.
const RANGE_TICKS: u64 = 1_000_000;
/// Pregenerated random operands (cycled).
const RANDOM_OPS: usize = 1 << 16;
const SEED: u64 = 0x7133_2026;

/// A wheel at `now` with `LIVE_TIMERS` timers uniform in (now, now + range].
fn populated(now: u64, range: u64, rng: &mut StdRng) -> (TimerWheel<u32>, Vec<TimerHandle>) {
    let mut w = TimerWheel::new(now, MAX_TIMERS);
    w.reserve(LIVE_TIMERS);
    let handles = (0..LIVE_TIMERS as u32)
        .map(|i| w.insert(now + rng.gen_range(1..=range), i).unwrap())
        .collect();
    (w, handles)
}

fn ops(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(SEED);
    let (mut w, handles) = populated(0, RANGE_TICKS, &mut rng);
    let offsets: Vec<u64> = (0..RANDOM_OPS)
        .map(|_| rng.gen_range(1..=RANGE_TICKS))
        .collect();
    let picks: Vec<usize> = (0..RANDOM_OPS)
        .map(|_| rng.gen_range(0..LIVE_TIMERS))
        .collect();
    let mut g = c.benchmark_group("timer");
    g.throughput(Throughput::Elements(1));

    let mut chunk: Vec<TimerHandle> = Vec::with_capacity(CHUNK_OPS);
    let mut k = 0usize;
    g.bench_function("insert_1M_live", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters as usize;
            while left > 0 {
                let n = left.min(CHUNK_OPS);
                let t = Instant::now();
                for _ in 0..n {
                    k = (k + 1) & (RANDOM_OPS - 1);
                    chunk.push(w.insert(black_box(offsets[k]), k as u32).unwrap());
                }
                total += t.elapsed();
                for h in chunk.drain(..) {
                    w.cancel(h);
                }
                left -= n;
            }
            total
        })
    });

    g.bench_function("cancel_1M_live", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters as usize;
            while left > 0 {
                let n = left.min(CHUNK_OPS);
                for _ in 0..n {
                    k = (k + 1) & (RANDOM_OPS - 1);
                    chunk.push(w.insert(offsets[k], k as u32).unwrap());
                }
                // Cancel in an order unrelated to insertion.
                let len = chunk.len();
                for i in 0..len {
                    chunk.swap(i, picks[(k + i) & (RANDOM_OPS - 1)] % len);
                }
                let t = Instant::now();
                for h in chunk.drain(..) {
                    black_box(w.cancel(black_box(h)));
                }
                total += t.elapsed();
                left -= n;
            }
            total
        })
    });

    g.bench_function("reschedule_1M_live", |b| {
        b.iter(|| {
            k = (k + 1) & (RANDOM_OPS - 1);
            let h = handles[picks[k]];
            black_box(w.reschedule(h, black_box(offsets[k])))
        })
    });
    g.finish();
    assert_eq!(w.len(), LIVE_TIMERS);
}

/// One expiry pass per iteration: advance by `range / 100`, fired timers
/// collected; re-arming them at `now + range` is untimed.
fn expire(c: &mut Criterion) {
    let mut g = c.benchmark_group("timer_expire_1pct");
    for range in [1_000_000u64, 300] {
        let step = range / 100;
        g.throughput(Throughput::Elements(LIVE_TIMERS as u64 / 100));
        let mut rng = StdRng::seed_from_u64(SEED);
        let (mut w, _) = populated(0, range, &mut rng);
        let mut fired: Vec<u32> = Vec::with_capacity(LIVE_TIMERS);
        let (mut passes, mut fired_total) = (0u64, 0u64);
        g.bench_function(BenchmarkId::new("wheel_1M_over_ticks", range), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let now = w.now() + step;
                    let t = Instant::now();
                    w.advance(now, |_, _, v| fired.push(v));
                    total += t.elapsed();
                    passes += 1;
                    fired_total += fired.len() as u64;
                    for v in fired.drain(..) {
                        let d = now + range - rng.gen_range(0..step);
                        w.insert(d, v).unwrap();
                    }
                }
                total
            })
        });
        let s = w.stats();
        eprintln!(
            "wheel range {range}: {passes} passes, {:.0} fired/pass, per pass: {:.0} buckets, {:.0} entries visited, {:.0} recascaded",
            fired_total as f64 / passes as f64,
            s.buckets_visited as f64 / passes as f64,
            s.entries_visited as f64 / passes as f64,
            s.recascaded as f64 / passes as f64,
        );

        // Baseline: a full scan of 1M deadlines finding the due ones.
        let mut rng = StdRng::seed_from_u64(SEED);
        let mut deadlines: Vec<u64> = (0..LIVE_TIMERS).map(|_| rng.gen_range(1..=range)).collect();
        let mut due: Vec<u32> = Vec::with_capacity(LIVE_TIMERS);
        let mut now = 0u64;
        g.bench_function(BenchmarkId::new("full_scan_1M_over_ticks", range), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    now += step;
                    let t = Instant::now();
                    for (i, &d) in deadlines.iter().enumerate() {
                        if d <= now {
                            due.push(i as u32);
                        }
                    }
                    total += t.elapsed();
                    for i in due.drain(..) {
                        deadlines[i as usize] = now + range - rng.gen_range(0..step);
                    }
                }
                total
            })
        });
    }
    g.finish();
}

criterion_group!(benches, ops, expire);
criterion_main!(benches);
