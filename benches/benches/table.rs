//! `shard::table` (epoch map) vs `papaya::HashMap`: lookups/s of hits and
//! misses over 1M keys, string keys like `"user-1234567"` and random `u64`
//! keys, one reader thread; then the same hits with a concurrent writer
//! thread doing inserts and removes.
//!
//! Both maps use the same hasher (`foldhash::fast::RandomState`, re-exported
//! as `shard::table::DefaultHashBuilder`) and the same shuffled lookup order;
//! each iteration is a batch of `BATCH_LOOKUPS` lookups under one pin
//! (`ReadGuard` / `papaya::HashMap::pin`); `epoch_get_with` pins per lookup.
//!
//! `cargo bench -p benches --bench table -- --warm-up-time 1 --measurement-time 3`

use std::borrow::Borrow;
use std::hash::Hash;
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use shard::table::{epoch_map_with_hasher, DefaultHashBuilder, MapReader, MapWriter};

/// Keys in every map.
const KEYS: usize = 1_000_000;
/// Lookups per measured iteration.
const BATCH_LOOKUPS: usize = 1000;
/// Keys the concurrent writer keeps inserted beyond `KEYS` (it inserts one
/// and removes the one inserted `CHURN_WINDOW` operations earlier).
const CHURN_WINDOW: u64 = 1000;

type Papaya<K> = papaya::HashMap<K, u64, DefaultHashBuilder>;

fn pin_core(index: usize) {
    if let Some(ids) = core_affinity::get_core_ids() {
        if let Some(id) = ids.get(index % ids.len()) {
            core_affinity::set_for_current(*id);
        }
    }
}

fn string_key(i: u64) -> String {
    format!("user-{i}")
}

/// Present keys, absent keys (disjoint), both in shuffled order.
fn string_keys() -> (Vec<String>, Vec<String>) {
    let mut rng = StdRng::seed_from_u64(1);
    let mut hits: Vec<String> = (0..KEYS as u64)
        .map(|i| string_key(1_000_000 + i))
        .collect();
    let mut misses: Vec<String> = (0..KEYS as u64)
        .map(|i| string_key(3_000_000 + i))
        .collect();
    hits.shuffle(&mut rng);
    misses.shuffle(&mut rng);
    (hits, misses)
}

fn u64_keys() -> (Vec<u64>, Vec<u64>) {
    let mut rng = StdRng::seed_from_u64(2);
    // Even keys are present, odd keys absent: disjoint by construction.
    let hits: Vec<u64> = (0..KEYS).map(|_| rng.gen::<u64>() & !1).collect();
    let misses: Vec<u64> = (0..KEYS).map(|_| rng.gen::<u64>() | 1).collect();
    (hits, misses)
}

fn build_epoch<K: Hash + Eq + Clone + Send + Sync + 'static>(
    keys: &[K],
    hasher: &DefaultHashBuilder,
) -> (MapWriter<K, u64>, MapReader<K, u64>) {
    let (mut w, r) = epoch_map_with_hasher(KEYS, KEYS + 2 * CHURN_WINDOW as usize, hasher.clone());
    for (i, k) in keys.iter().enumerate() {
        w.insert(k.clone(), i as u64).expect("below entries_max");
    }
    (w, r)
}

fn build_papaya<K: Hash + Eq + Clone + Send + Sync + 'static>(
    keys: &[K],
    hasher: &DefaultHashBuilder,
) -> Papaya<K> {
    let map = papaya::HashMap::builder()
        .hasher(hasher.clone())
        .capacity(KEYS)
        .build();
    {
        let m = map.pin();
        for (i, k) in keys.iter().enumerate() {
            m.insert(k.clone(), i as u64);
        }
    }
    map
}

/// Cycles through `probe` in batches of `BATCH_LOOKUPS`.
fn batches<'a, Q: ?Sized>(probe: &'a [&'a Q]) -> impl FnMut() -> &'a [&'a Q] + 'a {
    let mut cursor = 0;
    move || {
        if cursor + BATCH_LOOKUPS > probe.len() {
            cursor = 0;
        }
        let batch = &probe[cursor..cursor + BATCH_LOOKUPS];
        cursor += BATCH_LOOKUPS;
        batch
    }
}

/// Epoch map lookups: a batch under one `ReadGuard`, and `get_with` (one pin
/// per lookup). `want` = expected hits per batch.
fn epoch_lookups<K, Q>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    reader: &MapReader<K, u64>,
    probe: &[&Q],
    want: usize,
) where
    K: Hash + Eq + Borrow<Q> + Send + Sync + 'static,
    Q: ?Sized + Hash + Eq,
{
    let mut next = batches(probe);
    group.bench_function("epoch_guard_batch", |b| {
        b.iter(|| {
            let g = reader.pin();
            let mut found = 0usize;
            for k in next() {
                if let Some(v) = g.get(*k) {
                    found += 1;
                    black_box(v);
                }
            }
            assert_eq!(found, want);
            found
        })
    });
    let mut next = batches(probe);
    group.bench_function("epoch_get_with", |b| {
        b.iter(|| {
            let mut found = 0usize;
            for k in next() {
                if let Some(v) = reader.get_with(*k, |v| *v) {
                    found += 1;
                    black_box(v);
                }
            }
            assert_eq!(found, want);
            found
        })
    });
}

/// papaya lookups: a batch under one `pin()`.
fn papaya_lookups<K, Q>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    map: &Papaya<K>,
    probe: &[&Q],
    want: usize,
) where
    K: Hash + Eq + Send + Sync + 'static,
    Q: ?Sized + Hash + Eq + papaya::Equivalent<K>,
{
    let mut next = batches(probe);
    group.bench_function("papaya_pinned_batch", |b| {
        b.iter(|| {
            let m = map.pin();
            let mut found = 0usize;
            for k in next() {
                if let Some(v) = m.get(*k) {
                    found += 1;
                    black_box(v);
                }
            }
            assert_eq!(found, want);
            found
        })
    });
}

/// Runs `churn(i)` for i = 0, 1, .. on core 1 until dropped.
struct Churn {
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<u64>>,
}

impl Churn {
    fn start<F: FnMut(u64) + Send + 'static>(mut churn: F) -> Churn {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = thread::spawn(move || {
            pin_core(1);
            let mut i = 0;
            while !flag.load(Ordering::Relaxed) {
                churn(i);
                i += 1;
            }
            i
        });
        Churn {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Churn {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let ops = t.join().expect("writer thread panicked");
            eprintln!("  (concurrent writer did {ops} insert+remove pairs)");
        }
    }
}

fn string_benches(c: &mut Criterion) {
    pin_core(0);
    let hasher = DefaultHashBuilder::default();
    let (hits, misses) = string_keys();
    let (w, r) = build_epoch(&hits, &hasher);
    let papaya = Arc::new(build_papaya(&hits, &hasher));
    let hit_refs: Vec<&str> = hits.iter().map(String::as_str).collect();
    let miss_refs: Vec<&str> = misses.iter().map(String::as_str).collect();

    let mut g = c.benchmark_group("table_string_hit");
    g.throughput(Throughput::Elements(BATCH_LOOKUPS as u64));
    epoch_lookups(&mut g, &r, &hit_refs, BATCH_LOOKUPS);
    papaya_lookups(&mut g, &papaya, &hit_refs, BATCH_LOOKUPS);
    g.finish();

    let mut g = c.benchmark_group("table_string_miss");
    g.throughput(Throughput::Elements(BATCH_LOOKUPS as u64));
    epoch_lookups(&mut g, &r, &miss_refs, 0);
    papaya_lookups(&mut g, &papaya, &miss_refs, 0);
    g.finish();

    // Concurrent writer: inserts "churn-i" and removes "churn-(i - WINDOW)".
    let mut g = c.benchmark_group("table_string_hit_with_writer");
    g.throughput(Throughput::Elements(BATCH_LOOKUPS as u64));
    {
        let mut w = w;
        let _churn = Churn::start(move |i| {
            w.insert(format!("churn-{i}"), i)
                .expect("below entries_max");
            if i >= CHURN_WINDOW {
                w.remove(format!("churn-{}", i - CHURN_WINDOW).as_str());
            }
        });
        epoch_lookups(&mut g, &r, &hit_refs, BATCH_LOOKUPS);
    }
    {
        let papaya_w = Arc::clone(&papaya);
        let _churn_papaya = Churn::start(move |i| {
            let m = papaya_w.pin();
            m.insert(format!("churn-{i}"), i);
            if i >= CHURN_WINDOW {
                m.remove(format!("churn-{}", i - CHURN_WINDOW).as_str());
            }
        });
        papaya_lookups(&mut g, &papaya, &hit_refs, BATCH_LOOKUPS);
    }
    g.finish();
}

fn u64_benches(c: &mut Criterion) {
    pin_core(0);
    let hasher = DefaultHashBuilder::default();
    let (hits, misses) = u64_keys();
    let (w, r) = build_epoch(&hits, &hasher);
    let papaya = Arc::new(build_papaya(&hits, &hasher));
    let hit_refs: Vec<&u64> = hits.iter().collect();
    let miss_refs: Vec<&u64> = misses.iter().collect();

    let mut g = c.benchmark_group("table_u64_hit");
    g.throughput(Throughput::Elements(BATCH_LOOKUPS as u64));
    epoch_lookups(&mut g, &r, &hit_refs, BATCH_LOOKUPS);
    papaya_lookups(&mut g, &papaya, &hit_refs, BATCH_LOOKUPS);
    g.finish();

    let mut g = c.benchmark_group("table_u64_miss");
    g.throughput(Throughput::Elements(BATCH_LOOKUPS as u64));
    epoch_lookups(&mut g, &r, &miss_refs, 0);
    papaya_lookups(&mut g, &papaya, &miss_refs, 0);
    g.finish();

    let mut g = c.benchmark_group("table_u64_hit_with_writer");
    g.throughput(Throughput::Elements(BATCH_LOOKUPS as u64));
    {
        let mut w = w;
        // Odd keys never collide with the even probe keys.
        let _churn = Churn::start(move |i| {
            w.insert(2 * i + 1, i).expect("below entries_max");
            if i >= CHURN_WINDOW {
                w.remove(&(2 * (i - CHURN_WINDOW) + 1));
            }
        });
        epoch_lookups(&mut g, &r, &hit_refs, BATCH_LOOKUPS);
    }
    {
        let papaya_w = Arc::clone(&papaya);
        let _churn_papaya = Churn::start(move |i| {
            let m = papaya_w.pin();
            m.insert(2 * i + 1, i);
            if i >= CHURN_WINDOW {
                m.remove(&(2 * (i - CHURN_WINDOW) + 1));
            }
        });
        papaya_lookups(&mut g, &papaya, &hit_refs, BATCH_LOOKUPS);
    }
    g.finish();
}

criterion_group!(benches, string_benches, u64_benches);
criterion_main!(benches);
