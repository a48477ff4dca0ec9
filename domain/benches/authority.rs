//! Presence authority benches: register+commit, touch batches, lookups over 1M
//! routes (alone and beside a writer thread; full `Endpoint`s and the compact form;
//! with the routes' own uid `Arc`s and with equal strings in other allocations, as
//! a node's subscriber lists have), and an expiry pass with 1% of 1M routes due
//! against a full scan of every record.
//!
//! `cargo bench -p engine --bench authority -- --warm-up-time 1 --measurement-time 3`

// A test driver, outside the sans-IO boundary (clippy.toml): it may read seeds from
// the environment, time itself and run threads.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::hint::black_box;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use domain::cluster::{ClusterView, HashSlot, Target};
use domain::presence::authority::{
    Authority, AuthorityConfig, AuthorityReader, Directory, TouchResult,
};
use domain::presence::route::{
    AuthorityError, CompactEndpoint, DeviceLevel, Endpoint, RegisterOutcome, Route, Transport, Uid,
};
use slots::{hash_slot, HASH_SLOTS};

const ROUTES: usize = 1 << 20;

/// CPU time of the calling thread. The benches that matter time themselves with it
/// (`iter_custom`), so figures stay meaningful on a machine shared with other work.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// The minimum and the median of `v` (zero when empty).
fn min_median(v: &mut [Duration]) -> (Duration, Duration) {
    v.sort_unstable();
    (
        v.first().copied().unwrap_or_default(),
        v.get(v.len() / 2).copied().unwrap_or_default(),
    )
}

/// Times `iters` runs of `f` in thread CPU time.
fn cpu_iters(iters: u64, mut f: impl FnMut()) -> Duration {
    let start = thread_cpu();
    for _ in 0..iters {
        f();
    }
    thread_cpu() - start
}
const TTL_S: u64 = 99;
const T0: u64 = 1_000_000;

fn cfg() -> AuthorityConfig {
    AuthorityConfig {
        route_ttl_s: TTL_S,
        fence_retention_s: 300,
        lookup_uids_max: 1 << 20,
        touch_batch_routes_max: 4096,
        ..AuthorityConfig::default()
    }
}

fn authority() -> (Authority, ClusterView) {
    let dir = Directory::new(&cfg()).unwrap();
    let slots: Vec<HashSlot> = (0..HASH_SLOTS as HashSlot).collect();
    let mut a = Authority::new(cfg(), &dir, &slots).unwrap();
    let view = ClusterView::single_node(1);
    a.apply_view(&view, 1, T0);
    (a, view)
}

fn route(uid: &Uid, dev: &Arc<str>, session: u64, seq: u64, la: u64) -> Route {
    Route {
        uid: uid.clone(),
        device_id: dev.clone(),
        device_flag: 1,
        device_level: DeviceLevel::Slave,
        node_id: 2,
        boot_id: 7,
        session_id: session,
        listener: Transport::Tcp,
        owner_seq: seq,
        connected_at_ms: 0,
        last_active_s: Some(la),
    }
}

/// `n` uids grouped by hash slot.
fn uids_by_slot(n: usize) -> Vec<Vec<Uid>> {
    let mut by: Vec<Vec<Uid>> = vec![Vec::new(); HASH_SLOTS];
    for i in 0..n {
        let u = format!("user-{i:08}");
        by[hash_slot(u.as_bytes()) as usize].push(u.into());
    }
    by
}

/// Routes of one activity class, grouped by target.
type Class = Vec<(Target, Vec<Route>)>;

/// 1M routes (one per uid), activity spread over the last `TTL_S + 1` seconds; the
/// routes of each activity class (`k % (TTL_S + 1)`), grouped by target.
fn loaded() -> (Authority, ClusterView, Vec<Vec<Uid>>, Vec<Class>) {
    let (mut a, view) = authority();
    let by = uids_by_slot(ROUTES);
    let dev: Arc<str> = "d".into();
    let mut classes: Vec<Class> = vec![Vec::new(); TTL_S as usize + 1];
    let mut k = 0u64;
    for (s, us) in by.iter().enumerate() {
        let t = view.target_for_slot(s as HashSlot);
        for u in us {
            let c = k % (TTL_S + 1);
            k += 1;
            let r = route(u, &dev, 1, 1, T0 - c);
            assert_eq!(
                a.register_route(&t, r.clone(), T0),
                Ok(RegisterOutcome::Active)
            );
            let class = &mut classes[c as usize];
            match class.last_mut() {
                Some((ct, rs)) if *ct == t => rs.push(r),
                _ => class.push((t, vec![r])),
            }
        }
    }
    (a, view, by, classes)
}

fn bench_register_commit(c: &mut Criterion) {
    let (mut a, view) = authority();
    let by = uids_by_slot(16_384);
    let dev: Arc<str> = "d".into();
    let flat: Vec<(Target, Uid)> = by
        .iter()
        .enumerate()
        .flat_map(|(s, us)| us.iter().map(move |u| (s, u.clone())))
        .map(|(s, u)| (view.target_for_slot(s as HashSlot), u))
        .collect();
    for (t, u) in &flat {
        a.register_route(t, route(u, &dev, 0, 1, T0), T0).unwrap();
    }
    let mut i = 0usize;
    let mut seq = 1u64;
    let mut g = c.benchmark_group("authority");
    g.throughput(Throughput::Elements(1));
    g.bench_function("register_conflict_then_commit_cpu", |b| {
        b.iter_custom(|iters| {
            cpu_iters(iters, || {
                // A new session of the same device replaces the uid's current one.
                let (t, u) = &flat[i % flat.len()];
                if i.is_multiple_of(flat.len()) {
                    seq += 1;
                }
                i += 1;
                let session = seq % 4;
                match a.register_route(t, route(u, &dev, session, seq, T0), T0) {
                    Ok(RegisterOutcome::Pending { token, .. }) => {
                        a.commit_route(t, &token, T0).unwrap()
                    }
                    Ok(RegisterOutcome::Active) => {}
                    Err(e) => panic!("{e}"),
                }
            })
        })
    });
    g.finish();
}

fn bench_touch(c: &mut Criterion) {
    let (mut a, view) = authority();
    let us: Vec<Uid> = uids_by_slot(1 << 20)
        .swap_remove(7)
        .into_iter()
        .take(4096)
        .collect();
    let t = view.target_for_slot(7);
    let dev: Arc<str> = "d".into();
    for u in &us {
        a.register_route(&t, route(u, &dev, 1, 1, T0), T0).unwrap();
    }
    let mut batches: Vec<Vec<Route>> = us
        .chunks(512)
        .map(|c| c.iter().map(|u| route(u, &dev, 1, 1, T0)).collect())
        .collect();
    let mut out: Vec<TouchResult> = Vec::with_capacity(512);
    let mut now = T0;
    let mut i = 0usize;
    let mut g = c.benchmark_group("authority");
    g.throughput(Throughput::Elements(512));
    g.bench_function("touch_batch_512_new_second_cpu", |b| {
        b.iter_custom(|iters| {
            cpu_iters(iters, || {
                // Every batch carries a newer activity second: each route moves bucket.
                let n = batches.len();
                let batch = &mut batches[i % n];
                i += 1;
                now += 1;
                for r in batch.iter_mut() {
                    r.last_active_s = Some(now);
                }
                out.clear();
                let counts = a.touch_routes_into(&t, batch, now, &mut out).unwrap();
                debug_assert_eq!(counts.refreshed, 512);
                black_box(&out);
            })
        })
    });
    g.bench_function("touch_batch_512_same_second_cpu", |b| {
        b.iter_custom(|iters| {
            cpu_iters(iters, || {
                let batch = &batches[i % batches.len()];
                i += 1;
                out.clear();
                a.touch_routes_into(&t, batch, now, &mut out).unwrap();
                black_box(&out);
            })
        })
    });
    g.finish();
}

/// Lookup calls of 256 groups (one per slot) × `per_group` uids, covering all uids.
fn lookup_calls(
    view: &ClusterView,
    by: &[Vec<Uid>],
    per_group: usize,
) -> Vec<Vec<(Target, Range<usize>)>> {
    let max_len = by.iter().map(|v| v.len()).max().unwrap_or(0);
    (0..max_len.div_ceil(per_group))
        .map(|k| {
            (0..HASH_SLOTS)
                .map(|s| {
                    let lo = (k * per_group).min(by[s].len());
                    let hi = ((k + 1) * per_group).min(by[s].len());
                    (view.target_for_slot(s as HashSlot), lo..hi)
                })
                .collect()
        })
        .collect()
}

/// The groups of each lookup call, built once (a node reuses its buffers too).
fn call_groups<'a>(
    by: &'a [Vec<Uid>],
    calls: &[Vec<(Target, Range<usize>)>],
) -> Vec<Vec<(Target, &'a [Uid])>> {
    calls
        .iter()
        .map(|call| {
            call.iter()
                .enumerate()
                .map(|(s, (t, range))| (*t, &by[s][range.clone()]))
                .collect()
        })
        .collect()
}

/// Full endpoints (each clones its uid's `Arc`), into reused buffers.
fn run_lookups(
    r: &AuthorityReader,
    calls: &[Vec<(Target, &[Uid])>],
    out: &mut Vec<Endpoint>,
    res: &mut Vec<Result<Range<usize>, AuthorityError>>,
) -> usize {
    let mut n = 0;
    for groups in calls {
        out.clear();
        res.clear();
        r.endpoints_by_targets_into(groups, out, res);
        n += out.len();
        black_box(&out);
    }
    n
}

/// Compact endpoints, into reused buffers.
fn run_lookups_compact(
    r: &AuthorityReader,
    calls: &[Vec<(Target, &[Uid])>],
    out: &mut Vec<CompactEndpoint>,
    res: &mut Vec<Result<Range<usize>, AuthorityError>>,
) -> usize {
    let mut n = 0;
    for groups in calls {
        out.clear();
        res.clear();
        r.endpoints_by_targets_compact_into(groups, out, res);
        n += out.len();
        black_box(&out);
    }
    n
}

fn bench_lookup_and_expiry(c: &mut Criterion) {
    let (mut a, view, by, mut classes) = loaded();
    let r = a.reader();
    let call_ranges = lookup_calls(&view, &by, 64);
    let calls = call_groups(&by, &call_ranges);
    // Equal uids in other allocations (allocated in lookup order).
    let by_copies: Vec<Vec<Uid>> = by
        .iter()
        .map(|us| us.iter().map(|u| Uid::from(&**u)).collect())
        .collect();
    let calls_copies = call_groups(&by_copies, &call_ranges);
    let mut out = Vec::with_capacity(1 << 15);
    let mut out_compact = Vec::with_capacity(1 << 15);
    let mut res = Vec::new();
    let mut g = c.benchmark_group("authority");
    g.sample_size(10);
    g.throughput(Throughput::Elements(ROUTES as u64));
    g.bench_function("endpoints_by_targets_1m_routes_cpu", |b| {
        b.iter_custom(|iters| {
            cpu_iters(iters, || {
                assert_eq!(run_lookups(&r, &calls, &mut out, &mut res), ROUTES)
            })
        })
    });
    g.bench_function("endpoints_by_targets_compact_1m_routes_cpu", |b| {
        b.iter_custom(|iters| {
            cpu_iters(iters, || {
                assert_eq!(
                    run_lookups_compact(&r, &calls, &mut out_compact, &mut res),
                    ROUTES
                )
            })
        })
    });
    g.bench_function(
        "endpoints_by_targets_compact_1m_routes_other_uid_arcs_cpu",
        |b| {
            b.iter_custom(|iters| {
                cpu_iters(iters, || {
                    assert_eq!(
                        run_lookups_compact(&r, &calls_copies, &mut out_compact, &mut res),
                        ROUTES
                    )
                })
            })
        },
    );

    // Expiry: activity is spread over TTL_S + 1 seconds, so each second ~1% is due.
    // Timed: the pass alone; untimed: touching the expired routes back to life.
    let mut now = T0;
    let mut expired_total = 0usize;
    let mut passes = 0u64;
    // Every pass's CPU time: the minimum and median resist a machine shared with
    // other work better than a mean.
    let mut pass_times: Vec<Duration> = Vec::with_capacity(1 << 12);
    let stats0 = a.stats();
    g.bench_function("expire_pass_1pct_due_of_1m_cpu", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                now += 1;
                let start = thread_cpu();
                let n = a.expire(now);
                let took = thread_cpu() - start;
                total += took;
                if pass_times.len() < pass_times.capacity() {
                    pass_times.push(took);
                }
                passes += 1;
                expired_total += n;
                // The class due at `now` expired; recreate it with activity `now`
                // (its fence allows it): it is due again in TTL_S + 1 seconds.
                let c = ((TTL_S + 1) - (now - T0) % (TTL_S + 1)) % (TTL_S + 1);
                let class = &mut classes[c as usize];
                assert_eq!(n, class.iter().map(|(_, rs)| rs.len()).sum::<usize>());
                for (t, rs) in class.iter_mut() {
                    for r in rs.iter_mut() {
                        r.last_active_s = Some(now);
                    }
                    for chunk in rs.chunks(4096) {
                        a.touch_routes(t, chunk, now).unwrap();
                    }
                }
            }
            total
        })
    });
    let st = a.stats();
    let examined = (st.expiry_entries_visited - stats0.expiry_entries_visited) / passes.max(1);
    eprintln!(
        "expiry: {passes} passes, {} routes expired per pass, {examined} expiry entries examined per pass ({:.2}% of {ROUTES} routes)",
        expired_total as u64 / passes.max(1),
        examined as f64 * 100.0 / ROUTES as f64
    );
    let mut scan_times: Vec<Duration> = Vec::with_capacity(1 << 10);
    g.bench_function("full_scan_1m_baseline_cpu", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let start = thread_cpu();
                black_box(a.full_scan_due(now + 1));
                let took = thread_cpu() - start;
                total += took;
                if scan_times.len() < scan_times.capacity() {
                    scan_times.push(took);
                }
            }
            total
        })
    });
    let (pass_min, pass_med) = min_median(&mut pass_times);
    let (scan_min, scan_med) = min_median(&mut scan_times);
    eprintln!(
        "expiry pass vs full scan: min {pass_min:?} / {scan_min:?} = {:.1}%, median {pass_med:?} / {scan_med:?} = {:.1}%",
        pass_min.as_secs_f64() * 100.0 / scan_min.as_secs_f64(),
        pass_med.as_secs_f64() * 100.0 / scan_med.as_secs_f64(),
    );
    g.finish();

    // Lookups beside a writer thread that keeps touching and re-registering.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        let by = by.clone();
        let view = view.clone();
        std::thread::spawn(move || {
            let dev: Arc<str> = "d".into();
            let mut now = now;
            let mut seq = 2u64;
            while !stop.load(Ordering::Relaxed) {
                now += 1;
                seq += 1;
                for (s, us) in by.iter().enumerate().take(64) {
                    let t = view.target_for_slot(s as HashSlot);
                    let batch: Vec<Route> = us
                        .iter()
                        .take(256)
                        .map(|u| route(u, &dev, 1, seq, now))
                        .collect();
                    a.touch_routes(&t, &batch, now).unwrap();
                    for u in us.iter().take(8) {
                        let _ = a.register_route(&t, route(u, &dev, 2 + seq % 2, seq, now), now);
                    }
                }
                a.expire(now);
            }
            a
        })
    };
    let mut g = c.benchmark_group("authority");
    g.sample_size(10);
    g.throughput(Throughput::Elements(ROUTES as u64));
    g.bench_function("endpoints_by_targets_1m_routes_with_writer_cpu", |b| {
        b.iter_custom(|iters| {
            cpu_iters(iters, || {
                black_box(run_lookups(&r, &calls, &mut out, &mut res));
            })
        })
    });
    g.bench_function(
        "endpoints_by_targets_compact_1m_routes_with_writer_cpu",
        |b| {
            b.iter_custom(|iters| {
                cpu_iters(iters, || {
                    black_box(run_lookups_compact(&r, &calls, &mut out_compact, &mut res));
                })
            })
        },
    );
    g.finish();
    stop.store(true, Ordering::Relaxed);
    drop(writer.join().unwrap());
}

criterion_group!(
    benches,
    bench_register_commit,
    bench_touch,
    bench_lookup_and_expiry
);
criterion_main!(benches);
