//! Every key and value put into an epoch map is dropped exactly once, after
//! the writer and all readers are gone and the epoch collector has run, even
//! with readers holding pins across replaces, removes, rebuilds and a clear.

use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};

use shard::table::epoch_map;

const VALUES: usize = if cfg!(miri) { 300 } else { 20_000 };
const KEY_SPACE: u64 = if cfg!(miri) { 40 } else { 1500 };
const READERS: usize = 2;
/// Upper bound on `pin().flush()` rounds while waiting for deferred drops.
const MAX_FLUSH_ROUNDS: usize = 1_000_000;

/// Counts its drops in `drops[id]`.
struct Value {
    id: usize,
    drops: Arc<Vec<AtomicU8>>,
}

impl Drop for Value {
    fn drop(&mut self) {
        self.drops[self.id].fetch_add(1, Ordering::Relaxed);
    }
}

/// A key that counts creations (incl. clones) and drops.
struct Key {
    k: u64,
    live: Arc<AtomicUsize>,
}

impl Key {
    fn new(k: u64, live: &Arc<AtomicUsize>) -> Key {
        live.fetch_add(1, Ordering::Relaxed);
        Key {
            k,
            live: Arc::clone(live),
        }
    }
}

impl Clone for Key {
    fn clone(&self) -> Key {
        Key::new(self.k, &self.live)
    }
}

impl Drop for Key {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::Relaxed);
    }
}

impl PartialEq for Key {
    fn eq(&self, other: &Key) -> bool {
        self.k == other.k
    }
}

impl Eq for Key {}

impl Hash for Key {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.k.hash(h);
    }
}

/// xorshift64*, deterministic.
fn next(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

#[test]
fn every_value_dropped_exactly_once() {
    let drops: Arc<Vec<AtomicU8>> = Arc::new((0..VALUES).map(|_| AtomicU8::new(0)).collect());
    let live_keys = Arc::new(AtomicUsize::new(0));
    let (mut w, r) = epoch_map::<Key, Value>(4, KEY_SPACE as usize);
    let done = Arc::new(AtomicBool::new(false));
    let start = Arc::new(Barrier::new(READERS + 1));

    let readers: Vec<_> = (0..READERS)
        .map(|t| {
            let r = r.clone();
            let done = Arc::clone(&done);
            let start = Arc::clone(&start);
            let live_keys = Arc::clone(&live_keys);
            std::thread::spawn(move || {
                let mut rng = 0x9E37_79B9_7F4A_7C15 ^ (t as u64 + 1);
                start.wait();
                let mut seen = 0usize;
                // Long pins: every value seen stays readable while pinned.
                while !done.load(Ordering::Acquire) {
                    let g = r.pin();
                    let mut held = Vec::new();
                    for _ in 0..16 {
                        let probe = Key::new(next(&mut rng) % KEY_SPACE, &live_keys);
                        if let Some(v) = g.get(&probe) {
                            held.push(v);
                            seen += 1;
                        }
                    }
                    for v in held {
                        assert!(v.id < VALUES);
                        assert_eq!(
                            v.drops[v.id].load(Ordering::Relaxed),
                            0,
                            "value {} freed while pinned",
                            v.id
                        );
                    }
                }
                seen
            })
        })
        .collect();

    start.wait();
    let mut rng = 42u64;
    for id in 0..VALUES {
        let k = next(&mut rng) % KEY_SPACE;
        let value = Value {
            id,
            drops: Arc::clone(&drops),
        };
        match next(&mut rng) % 8 {
            0 => {
                // Consumes `value` through update when the key is present.
                let mut slot = Some(value);
                let present = w.update(&Key::new(k, &live_keys), |_| {
                    slot.take().expect("called once")
                });
                if !present {
                    drop(slot);
                }
            }
            1 | 2 => {
                w.remove(&Key::new(k, &live_keys));
                drop(value);
            }
            _ => {
                w.insert(Key::new(k, &live_keys), value)
                    .expect("entries_max = key space");
            }
        }
        if id == VALUES / 2 {
            w.clear();
        }
    }
    done.store(true, Ordering::Release);
    for h in readers {
        h.join().expect("reader panicked");
    }
    let extra_reader = w.reader();
    assert!(!w.is_empty());
    drop(w);
    assert!(!extra_reader.is_empty(), "readers keep the map alive");
    drop(extra_reader);
    drop(r);

    let dropped = || {
        drops
            .iter()
            .filter(|d| d.load(Ordering::Relaxed) > 0)
            .count()
    };
    let mut rounds = 0;
    while (dropped() < VALUES || live_keys.load(Ordering::Relaxed) > 0) && rounds < MAX_FLUSH_ROUNDS
    {
        crossbeam_epoch::pin().flush();
        rounds += 1;
    }
    println!("deferred drops done after {rounds} flush rounds");
    for (id, d) in drops.iter().enumerate() {
        assert_eq!(
            d.load(Ordering::Relaxed),
            1,
            "value {id} dropped wrong number of times"
        );
    }
    assert_eq!(live_keys.load(Ordering::Relaxed), 0, "keys leaked");
}
