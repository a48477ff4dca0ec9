//! Property tests of the timer wheel against a reference model
//! (`BTreeMap<(deadline, id), value>`), deterministic.
//!
//! Seeds: `TIMER_PROP_SEED` (default 0x7133_2026) seeds both the proptest
//! runner and the long seeded walk; `TIMER_PROP_CASES` sets the proptest case
//! count (default 256). The seed in use is printed (shown on failure).

use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, HashMap};
use wheel::{TimerHandle, TimerWheel};

const DEFAULT_SEED: u64 = 0x7133_2026;

fn seed() -> u64 {
    let seed = std::env::var("TIMER_PROP_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SEED);
    eprintln!("TIMER_PROP_SEED={seed}");
    seed
}

fn config() -> Config {
    let cases = std::env::var("TIMER_PROP_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(256);
    Config {
        cases,
        rng_seed: RngSeed::Fixed(seed()),
        failure_persistence: None,
        ..Config::default()
    }
}

/// Spreads a raw offset over scales from a few ticks to beyond the top level.
fn scaled(kind: u8, raw: u64) -> u64 {
    match kind % 6 {
        0 => raw % 8,
        1 => raw % 70,
        2 => raw % 5_000,
        3 => raw % 400_000,
        4 => raw % (1 << 31),
        _ => raw % (1 << 42),
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// Deadline `now + offset`, or `now - offset` (already due) if `past`.
    Insert {
        kind: u8,
        raw: u64,
        past: bool,
    },
    /// Index into every handle issued so far (live or stale).
    Cancel(usize),
    Reschedule {
        pick: usize,
        kind: u8,
        raw: u64,
        past: bool,
    },
    Get(usize),
    Advance {
        kind: u8,
        raw: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (any::<u8>(), any::<u64>(), prop::bool::weighted(0.1))
            .prop_map(|(kind, raw, past)| Op::Insert { kind, raw, past }),
        1 => any::<usize>().prop_map(Op::Cancel),
        2 => (any::<usize>(), any::<u8>(), any::<u64>(), prop::bool::weighted(0.1))
            .prop_map(|(pick, kind, raw, past)| Op::Reschedule { pick, kind, raw, past }),
        1 => any::<usize>().prop_map(Op::Get),
        3 => (any::<u8>(), any::<u64>()).prop_map(|(kind, raw)| Op::Advance { kind, raw }),
    ]
}

/// The wheel and the reference model side by side.
struct Harness {
    wheel: TimerWheel<u64>,
    /// Live timers: (deadline, id) -> id (the value is the id).
    model: BTreeMap<(u64, u64), u64>,
    /// id -> (handle, deadline) of live timers.
    live: HashMap<u64, (TimerHandle, u64)>,
    /// Every handle ever issued, with its id.
    issued: Vec<(TimerHandle, u64)>,
    next_id: u64,
    timers_max: usize,
}

impl Harness {
    fn new(start: u64, timers_max: usize) -> Self {
        Harness {
            wheel: TimerWheel::new(start, timers_max),
            model: BTreeMap::new(),
            live: HashMap::new(),
            issued: Vec::new(),
            next_id: 0,
            timers_max,
        }
    }

    fn deadline(&self, kind: u8, raw: u64, past: bool) -> u64 {
        let now = self.wheel.now();
        let off = scaled(kind, raw);
        if past {
            now.saturating_sub(off)
        } else {
            now.saturating_add(off)
        }
    }

    fn insert(&mut self, deadline: u64) -> Result<(), String> {
        let id = self.next_id;
        self.next_id += 1;
        match self.wheel.insert(deadline, id) {
            Ok(h) => {
                if self.live.len() >= self.timers_max {
                    return Err(format!(
                        "insert beyond timers_max {} succeeded",
                        self.timers_max
                    ));
                }
                self.model.insert((deadline, id), id);
                self.live.insert(id, (h, deadline));
                self.issued.push((h, id));
            }
            Err(full) => {
                if full.0 != id || self.live.len() < self.timers_max {
                    return Err(format!("unexpected TimerFull at len {}", self.live.len()));
                }
            }
        }
        Ok(())
    }

    fn cancel(&mut self, pick: usize) -> Result<(), String> {
        let Some(&(h, id)) = self.issued.get(pick % self.issued.len().max(1)) else {
            return Ok(());
        };
        let got = self.wheel.cancel(h);
        match self.live.remove(&id) {
            Some((_, d)) => {
                self.model.remove(&(d, id));
                if got != Some(id) {
                    return Err(format!("cancel of live {id} returned {got:?}"));
                }
            }
            None if got.is_some() => return Err(format!("cancel of stale {id} returned {got:?}")),
            None => {}
        }
        Ok(())
    }

    fn reschedule(&mut self, pick: usize, deadline: u64) -> Result<(), String> {
        let Some(&(h, id)) = self.issued.get(pick % self.issued.len().max(1)) else {
            return Ok(());
        };
        let ok = self.wheel.reschedule(h, deadline);
        match self.live.get_mut(&id) {
            Some(entry) => {
                if !ok {
                    return Err(format!("reschedule of live {id} refused"));
                }
                self.model.remove(&(entry.1, id));
                self.model.insert((deadline, id), id);
                entry.1 = deadline;
            }
            None if ok => return Err(format!("reschedule of stale {id} accepted")),
            None => {}
        }
        Ok(())
    }

    fn get(&self, pick: usize) -> Result<(), String> {
        let Some(&(h, id)) = self.issued.get(pick % self.issued.len().max(1)) else {
            return Ok(());
        };
        let want = self.live.get(&id).map(|_| id);
        let got = self.wheel.get(h).copied();
        if got != want {
            return Err(format!("get({id}) = {got:?}, want {want:?}"));
        }
        if self.wheel.deadline(h) != self.live.get(&id).map(|e| e.1) {
            return Err(format!("deadline({id}) disagrees"));
        }
        Ok(())
    }

    fn advance(&mut self, step: u64) -> Result<(), String> {
        let now = self.wheel.now().saturating_add(step);
        let mut fired: Vec<(u64, u64, TimerHandle)> = Vec::new();
        let n = self.wheel.advance(now, |h, d, v| fired.push((d, v, h)));
        if n != fired.len() {
            return Err(format!("advance returned {n}, fired {}", fired.len()));
        }
        fired.sort_by_key(|f| (f.0, f.1));
        // Exactly the model's entries with deadline <= now, each once.
        let due: Vec<(u64, u64)> = self
            .model
            .range(..=(now, u64::MAX))
            .map(|(&k, _)| k)
            .collect();
        let got: Vec<(u64, u64)> = fired.iter().map(|f| (f.0, f.1)).collect();
        if got != due {
            return Err(format!("advance to {now}: fired {got:?}, want {due:?}"));
        }
        for (d, id, h) in fired {
            self.model.remove(&(d, id));
            let (want_h, _) = self.live.remove(&id).ok_or("fired id not live")?;
            if h != want_h {
                return Err(format!("fired {id} with handle {h:?}, issued {want_h:?}"));
            }
        }
        Ok(())
    }

    fn check(&self) -> Result<(), String> {
        self.wheel.check_invariants()?;
        if self.wheel.len() != self.model.len() || self.live.len() != self.model.len() {
            return Err(format!(
                "len {} vs model {}",
                self.wheel.len(),
                self.model.len()
            ));
        }
        let first = self.model.keys().next().map(|k| k.0);
        match (self.wheel.next_deadline(), first) {
            (None, None) => {}
            (Some(lb), Some(d)) if lb <= d => {}
            (got, want) => return Err(format!("next_deadline {got:?} vs earliest {want:?}")),
        }
        Ok(())
    }

    fn apply(&mut self, op: &Op) -> Result<(), String> {
        match *op {
            Op::Insert { kind, raw, past } => self.insert(self.deadline(kind, raw, past))?,
            Op::Cancel(pick) => self.cancel(pick)?,
            Op::Reschedule {
                pick,
                kind,
                raw,
                past,
            } => self.reschedule(pick, self.deadline(kind, raw, past))?,
            Op::Get(pick) => self.get(pick)?,
            Op::Advance { kind, raw } => self.advance(scaled(kind, raw))?,
        }
        self.check()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn wheel_matches_reference_model(
        start in prop_oneof![Just(0u64), any::<u32>().prop_map(u64::from), Just(u64::MAX - (1 << 43))],
        timers_max in prop_oneof![1usize..8, Just(64usize), Just(10_000usize)],
        ops in prop::collection::vec(op(), 1..200),
    ) {
        let mut h = Harness::new(start, timers_max);
        for (i, op) in ops.iter().enumerate() {
            if let Err(e) = h.apply(op) {
                prop_assert!(false, "op #{i} {op:?}: {e}");
            }
        }
        // Drain: everything left fires exactly at its deadline.
        while let Some(&(d, _)) = h.model.keys().next() {
            let now = h.wheel.now();
            if d > now {
                if let Err(e) = h.advance(d - 1 - now) { prop_assert!(false, "drain: {e}"); }
            }
            if let Err(e) = h.advance(1).and_then(|_| h.check()) { prop_assert!(false, "drain: {e}"); }
        }
        prop_assert!(h.wheel.is_empty());
    }
}

/// A long seeded walk with many live timers (thousands), mixing all
/// operations; complements the shrinking proptest above with volume.
#[test]
fn long_seeded_walk_matches_reference_model() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut h = Harness::new(rng.gen_range(0..1u64 << 40), 5_000);
    for step in 0..40_000u32 {
        let kind: u8 = rng.gen();
        let raw: u64 = rng.gen();
        let op = match rng.gen_range(0..100) {
            0..=44 => Op::Insert {
                kind,
                raw,
                past: rng.gen_bool(0.05),
            },
            45..=59 => Op::Cancel(rng.gen()),
            60..=79 => Op::Reschedule {
                pick: rng.gen(),
                kind,
                raw,
                past: rng.gen_bool(0.05),
            },
            80..=84 => Op::Get(rng.gen()),
            // Mostly small steps so that many timers are live at once.
            _ => Op::Advance {
                kind: kind % 4,
                raw,
            },
        };
        // Full invariant checks are O(n): do them every 64 ops.
        let res = match &op {
            Op::Insert { kind, raw, past } => h.insert(h.deadline(*kind, *raw, *past)),
            Op::Cancel(p) => h.cancel(*p),
            Op::Reschedule {
                pick,
                kind,
                raw,
                past,
            } => h.reschedule(*pick, h.deadline(*kind, *raw, *past)),
            Op::Get(p) => h.get(*p),
            Op::Advance { kind, raw } => h.advance(scaled(*kind, *raw)),
        }
        .and_then(|_| if step % 64 == 0 { h.check() } else { Ok(()) });
        if let Err(e) = res {
            panic!("seed {seed} step {step} {op:?}: {e}");
        }
        if h.issued.len() > 20_000 {
            h.issued.drain(..10_000);
        }
    }
    h.check().unwrap();
    let stats = h.wheel.stats();
    assert_eq!(
        stats.entries_visited,
        stats.fired + stats.recascaded,
        "{stats:?}"
    );
    // Drain with one big jump.
    h.advance(1 << 43).unwrap();
    h.check().unwrap();
    assert!(h.wheel.is_empty(), "seed {seed}");
}
