//! Concurrent stress: reader threads look keys up while the single writer
//! inserts, replaces, updates, removes, clears and forces rebuilds (growth
//! from a tiny table, shrinking after drains). Readers check every value
//! they see:
//! - it belongs to the key it was found under and is internally consistent
//!   (a torn or freed value would break the checksum payload);
//! - its version never goes backwards for that key, as seen by one reader
//!   (the writer's versions only increase per key);
//! - a key the writer never inserts (odd keys) is never found.
//!
//! The writer runs a fixed number of operations; readers stop when it is done
//! (and after a minimum number of lookups each). Deterministic op sequence:
//! `TABLE_SEED=<n>` (default 1); thread interleavings vary by run.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use shard::table::{epoch_map, MapReader};

const WRITER_OPS: u64 = if cfg!(miri) { 150 } else { 300_000 };
const MIN_READER_LOOKUPS: u64 = if cfg!(miri) { 60 } else { 100_000 };
/// Readers keep going until the writer is done (not under Miri, where a
/// fixed number of lookups per reader keeps the run short).
const WAIT_FOR_WRITER: bool = !cfg!(miri);
const READERS: usize = if cfg!(miri) { 2 } else { 3 };
/// Even keys `0, 2, .., 2 * (KEYS - 1)` are written; odd keys never are.
const KEYS: u64 = if cfg!(miri) { 24 } else { 5000 };
const MAX_ENTRIES: usize = KEYS as usize;

/// A value that checks itself: `payload` is `1 + version % 7` copies of
/// `key ^ version`.
struct Val {
    key: u64,
    version: u64,
    payload: Vec<u64>,
}

impl Val {
    fn new(key: u64, version: u64) -> Val {
        Val {
            key,
            version,
            payload: vec![key ^ version; 1 + (version % 7) as usize],
        }
    }

    fn check(&self, key: u64) {
        assert_eq!(self.key, key, "value found under the wrong key");
        assert_eq!(
            self.payload.len(),
            1 + (self.version % 7) as usize,
            "torn value {key}"
        );
        assert!(
            self.payload.iter().all(|&p| p == key ^ self.version),
            "torn value {key}"
        );
    }
}

fn seed() -> u64 {
    let seed = std::env::var("TABLE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    println!("TABLE_SEED={seed}");
    seed
}

fn reader_loop(r: MapReader<u64, Val>, done: &AtomicBool, id: u64, seen_total: &AtomicU64) {
    let mut rng = StdRng::seed_from_u64(id);
    let mut last = vec![0u64; 2 * KEYS as usize];
    let mut lookups = 0u64;
    let mut hits = 0u64;
    while lookups < MIN_READER_LOOKUPS || (WAIT_FOR_WRITER && !done.load(Ordering::Acquire)) {
        if rng.gen_bool(0.5) {
            // One pin per lookup.
            let k = rng.gen_range(0..2 * KEYS);
            if let Some((version, ok_key)) = r.get_with(&k, |v| {
                v.check(k);
                (v.version, v.key)
            }) {
                assert_eq!(ok_key, k);
                assert_eq!(k % 2, 0, "never-inserted key {k} found");
                assert!(
                    version >= last[k as usize],
                    "key {k}: version {version} after {}",
                    last[k as usize]
                );
                last[k as usize] = version;
                hits += 1;
            }
            lookups += 1;
        } else {
            // A batch under one pin; hold the references to the end of the
            // batch and re-check them (they must stay intact while pinned).
            let g = r.pin();
            let mut held = Vec::with_capacity(32);
            for _ in 0..32 {
                let k = rng.gen_range(0..2 * KEYS);
                if let Some(v) = g.get(&k) {
                    v.check(k);
                    assert_eq!(k % 2, 0, "never-inserted key {k} found");
                    assert!(
                        v.version >= last[k as usize],
                        "key {k}: version {} after {}",
                        v.version,
                        last[k as usize]
                    );
                    last[k as usize] = v.version;
                    held.push((k, v));
                    hits += 1;
                }
                lookups += 1;
            }
            for (k, v) in held {
                v.check(k);
            }
        }
        assert!(r.len() <= MAX_ENTRIES);
    }
    seen_total.fetch_add(hits, Ordering::Relaxed);
}

#[test]
fn readers_see_consistent_values_under_writes_and_rebuilds() {
    let seed = seed();
    let (mut w, r) = epoch_map::<u64, Val>(1, MAX_ENTRIES);
    let done = Arc::new(AtomicBool::new(false));
    let hits = Arc::new(AtomicU64::new(0));
    let start = Arc::new(Barrier::new(READERS + 1));
    let readers: Vec<_> = (0..READERS)
        .map(|i| {
            let (r, done, hits, start) = (
                r.clone(),
                Arc::clone(&done),
                Arc::clone(&hits),
                Arc::clone(&start),
            );
            std::thread::spawn(move || {
                start.wait();
                reader_loop(
                    r,
                    &done,
                    seed.wrapping_mul(31).wrapping_add(i as u64),
                    &hits,
                );
            })
        })
        .collect();

    start.wait();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut version = 0u64;
    let mut slots_max = 0;
    let mut min_slots_after_growth = usize::MAX;
    // Phases: fill (mostly inserts), churn, drain (mostly removes).
    for op in 0..WRITER_OPS {
        let phase = (op / (WRITER_OPS / 12).max(1)) % 3;
        let insert_pct = [85, 50, 15][phase as usize];
        let k = 2 * rng.gen_range(0..KEYS);
        version += 1;
        let roll = rng.gen_range(0..100);
        if roll < insert_pct {
            w.insert(k, Val::new(k, version))
                .expect("MAX_ENTRIES = KEYS");
            assert_eq!(w.get(&k).map(|v| v.version), Some(version));
        } else if roll < insert_pct + 5 {
            let v = version;
            if w.update(&k, |old| {
                assert!(old.version < v);
                Val::new(k, v)
            }) {
                assert_eq!(w.get(&k).map(|v| v.version), Some(version));
            }
        } else {
            w.remove(&k);
            assert!(w.get(&k).is_none());
        }
        if rng.gen_range(0..(WRITER_OPS / 3).max(1)) == 0 {
            w.clear();
        }
        slots_max = slots_max.max(w.capacity_slots());
        if slots_max > 64 {
            min_slots_after_growth = min_slots_after_growth.min(w.capacity_slots());
        }
    }
    done.store(true, Ordering::Release);
    for h in readers {
        h.join().expect("reader failed");
    }
    println!(
        "writer ops {WRITER_OPS}, reader hits {}, slots max {slots_max} min-after-growth {min_slots_after_growth}",
        hits.load(Ordering::Relaxed)
    );
    assert!(
        slots_max >= shard::table::slots_for(KEYS as usize / 2),
        "the table grew"
    );
    assert!(hits.load(Ordering::Relaxed) > 0, "readers found values");
}

/// Many readers hammer a few hot keys that the writer replaces continuously
/// (every replace retires the previous entry while readers hold it).
#[test]
fn hot_key_replacement() {
    let seed = seed();
    let (mut w, r) = epoch_map::<u64, Val>(4, 16);
    let done = Arc::new(AtomicBool::new(false));
    let hits = Arc::new(AtomicU64::new(0));
    let start = Arc::new(Barrier::new(READERS + 1));
    let readers: Vec<_> = (0..READERS)
        .map(|i| {
            let (r, done, hits, start) = (
                r.clone(),
                Arc::clone(&done),
                Arc::clone(&hits),
                Arc::clone(&start),
            );
            std::thread::spawn(move || {
                start.wait();
                let mut last = [0u64; 8];
                let mut rng = StdRng::seed_from_u64(seed ^ i as u64);
                let mut lookups = 0u64;
                while lookups < MIN_READER_LOOKUPS
                    || (WAIT_FOR_WRITER && !done.load(Ordering::Acquire))
                {
                    let k = 2 * rng.gen_range(0..4u64);
                    if let Some(v) = r.get_with(&k, |v| {
                        v.check(k);
                        v.version
                    }) {
                        assert!(v >= last[k as usize]);
                        last[k as usize] = v;
                        hits.fetch_add(1, Ordering::Relaxed);
                    }
                    lookups += 1;
                }
            })
        })
        .collect();
    start.wait();
    let mut rng = StdRng::seed_from_u64(seed);
    for version in 1..=WRITER_OPS {
        let k = 2 * rng.gen_range(0..4u64);
        if version % 64 == 0 {
            w.remove(&k);
        } else {
            w.insert(k, Val::new(k, version)).expect("4 keys < 16");
        }
    }
    done.store(true, Ordering::Release);
    for h in readers {
        h.join().expect("reader failed");
    }
    assert!(hits.load(Ordering::Relaxed) > 0);
}
