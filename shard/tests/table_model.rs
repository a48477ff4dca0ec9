//! Random operation sequences on `shard::table` checked against
//! `std::collections::HashMap` (writer view, reader view, `len`, `iter`).
//!
//! Deterministic: seeds `1..=SEEDS`, or only `TABLE_SEED=<n>` when set. A
//! failure names its seed and step.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use shard::table::{epoch_map, TableFull};

const SEEDS: u64 = if cfg!(miri) { 1 } else { 8 };
const STEPS: usize = if cfg!(miri) { 400 } else { 50_000 };
const KEY_SPACE: u32 = if cfg!(miri) { 60 } else { 3000 };
const MAX_ENTRIES: usize = if cfg!(miri) { 40 } else { 2000 };

fn seeds() -> Vec<u64> {
    match std::env::var("TABLE_SEED") {
        Ok(s) => vec![s.parse().expect("TABLE_SEED must be a u64")],
        Err(_) => (1..=SEEDS).collect(),
    }
}

#[test]
fn random_ops_match_std_hashmap() {
    for seed in seeds() {
        println!("TABLE_SEED={seed}");
        run(seed);
    }
}

fn run(seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut w, r) = epoch_map::<String, u64>(rng.gen_range(0..64), MAX_ENTRIES);
    let mut model: HashMap<String, u64> = HashMap::new();
    // Phases bias the mix so the table fills up to the limit, drains, churns.
    let mut insert_weight = 6;
    for step in 0..STEPS {
        if step % 5000 == 0 {
            insert_weight = rng.gen_range(2..10);
        }
        let k = format!("user-{}", rng.gen_range(0..KEY_SPACE));
        let ctx = || format!("seed {seed} step {step} key {k}");
        match rng.gen_range(0..12) {
            op if op < insert_weight => {
                let v: u64 = rng.gen();
                let want = if model.contains_key(&k) {
                    Ok(Some(()))
                } else if model.len() >= MAX_ENTRIES {
                    Err(TableFull)
                } else {
                    Ok(None)
                };
                assert_eq!(w.insert(k.clone(), v), want, "{}", ctx());
                if want.is_ok() {
                    model.insert(k.clone(), v);
                }
            }
            10 => {
                let got = w.update(k.as_str(), |v| v.rotate_left(1));
                let want = model.get_mut(&k).map(|v| *v = v.rotate_left(1));
                assert_eq!(got, want.is_some(), "{}", ctx());
            }
            11 if rng.gen_range(0..400) == 0 => {
                w.clear();
                model.clear();
            }
            _ => assert_eq!(
                w.remove(k.as_str()),
                model.remove(&k).is_some(),
                "{}",
                ctx()
            ),
        }
        let want = model.get(&k).copied();
        assert_eq!(w.get(k.as_str()).copied(), want, "{}", ctx());
        assert_eq!(r.get_with(k.as_str(), |v| *v), want, "{}", ctx());
        assert_eq!(r.pin().get(k.as_str()).copied(), want, "{}", ctx());
        assert_eq!(w.len(), model.len(), "{}", ctx());
        assert_eq!(r.len(), model.len(), "{}", ctx());
        assert!(
            w.capacity_slots() <= shard::table::slots_for(MAX_ENTRIES),
            "{}",
            ctx()
        );
        if step % 997 == 0 {
            compare_all(&w, &model, seed, step);
        }
    }
    compare_all(&w, &model, seed, STEPS);
}

fn compare_all(
    w: &shard::table::MapWriter<String, u64>,
    model: &HashMap<String, u64>,
    seed: u64,
    step: usize,
) {
    let mut got: Vec<(&str, u64)> = w.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    got.sort_unstable();
    let mut want: Vec<(&str, u64)> = model.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    want.sort_unstable();
    assert_eq!(got, want, "seed {seed} step {step}");
    let g = w.reader();
    let g = g.pin();
    for (k, v) in model {
        assert_eq!(g.get(k.as_str()), Some(v), "seed {seed} step {step}");
    }
}
