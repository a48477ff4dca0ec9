//! How fast one uid may SEND through one gateway shard (issue 18 item 4).
//!
//! Each uid has a token bucket of `burst` SENDs refilled at `per_s` a second, kept as
//! one number, its theoretical arrival time (GCRA): `tat_ns`, the instant its bucket
//! is full again. A SEND at `now` is admitted while `max(tat, now) + interval ≤
//! now + burst × interval`, and then pushes `tat` one `interval` (1 s / `per_s`)
//! further; a refused SEND changes nothing (a client retrying at once does not delay
//! itself). Over the rate the gateway answers SENDACK 22 (RateLimit) and counts it in
//! `sends_refused_uid_rate`.
//!
//! Per uid per shard: each gateway shard keeps its own table, so a uid whose devices
//! are connected to k shards of a node may send up to k × the rate (the cluster
//! milestone may centralize it). The HTTP API's sends do not pass here.
//!
//! The table is bounded by `uids_max` entries of 16 bytes (the uid's keyed 64-bit
//! hash and its `tat`). Uids are chosen by clients, so the hash is keyed
//! (`std::hash::RandomState`, SipHash-1-3 with random keys per table): no one can
//! aim uids at one bucket; two uids whose hashes collide would share a bucket, with
//! odds of about n² / 2^65 for n tracked uids. A uid is idle once its bucket is full
//! (`tat ≤ now`); an idle entry holds exactly what a missing one means, so evicting
//! it loses nothing. When a new uid meets a full table, one pass evicts every idle
//! entry. If that pass frees fewer than `uids_max / 8` entries, the next pass waits
//! one bucket's refill time (`burst × interval`; by then every entry present now is
//! idle unless it sent again), so the passes cost O(1) per SEND amortized. While the
//! table is full of uids that are not idle, a SEND of an untracked uid is refused
//! ([`Verdict::TableFull`], answered like a SEND over the rate) until a pass frees
//! room: admitting it untracked would let whoever fills the table send without
//! limit. Tracked uids are served as usual meanwhile. To keep `uids_max` uids busy
//! takes `uids_max × per_s` SENDs/s (65 million with the defaults).
//!
//! Sans-IO: the caller passes its monotonic clock in ns.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};

use crate::presence::authority::FxBuildHasher;

/// The limits (`[session] sends_per_uid_per_s`, `sends_per_uid_burst`,
/// `send_rate_uids_per_shard_max`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendRateLimits {
    /// SENDs per second per uid; 0: no limit.
    pub per_s: u32,
    /// SENDs a full bucket admits at once (at least 1 counts).
    pub burst: u32,
    /// Uids tracked at most (at least 1 counts).
    pub uids_max: usize,
}

impl SendRateLimits {
    /// Time one token takes to refill (1 s / `per_s`, at least 1 ns).
    fn interval_ns(&self) -> u64 {
        (1_000_000_000 / u64::from(self.per_s.max(1))).max(1)
    }

    /// Time an empty bucket takes to refill.
    fn window_ns(&self) -> u64 {
        self.interval_ns()
            .saturating_mul(u64::from(self.burst.max(1)))
    }
}

/// What [`SendRate::admit`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The SEND may go (its token taken, if limited).
    Admit,
    /// The uid's bucket is empty.
    OverRate,
    /// The uid is not tracked and the table is full of uids that are not idle.
    TableFull,
}

/// One gateway shard's SEND rates by uid (see the module docs).
#[derive(Debug)]
pub struct SendRate {
    limits: SendRateLimits,
    keys: RandomState,
    /// Keyed uid hash → the instant its bucket is full again (ns).
    tat_ns: HashMap<u64, u64, FxBuildHasher>,
    /// No eviction pass before this instant (the last one freed little).
    sweep_not_before_ns: u64,
}

impl SendRate {
    /// An empty table within `limits`, with fresh random hash keys.
    pub fn new(limits: SendRateLimits) -> Self {
        SendRate {
            limits,
            keys: RandomState::new(),
            tat_ns: HashMap::default(),
            sweep_not_before_ns: 0,
        }
    }

    /// Whether a SEND of `uid` may go at `now_ns`.
    pub fn admit(&mut self, uid: &str, now_ns: u64) -> Verdict {
        if self.limits.per_s == 0 {
            return Verdict::Admit;
        }
        let interval = self.limits.interval_ns();
        let key = self.keys.hash_one(uid);
        if let Some(tat) = self.tat_ns.get_mut(&key) {
            let from = (*tat).max(now_ns);
            let limit = now_ns.saturating_add(self.limits.window_ns());
            if from.saturating_add(interval) > limit {
                return Verdict::OverRate;
            }
            *tat = from.saturating_add(interval);
            return Verdict::Admit;
        }
        if !self.make_room(now_ns) {
            return Verdict::TableFull;
        }
        // A new uid's bucket is full (burst ≥ 1): this SEND takes one token.
        self.tat_ns.insert(key, now_ns.saturating_add(interval));
        Verdict::Admit
    }

    /// Uids tracked now.
    pub fn len(&self) -> usize {
        self.tat_ns.len()
    }

    /// Whether no uid is tracked.
    pub fn is_empty(&self) -> bool {
        self.tat_ns.is_empty()
    }

    /// Whether the table can take one more uid, after evicting the idle ones if it
    /// is full (at most one pass per refill time when passes free little).
    fn make_room(&mut self, now_ns: u64) -> bool {
        let max = self.limits.uids_max.max(1);
        if self.tat_ns.len() < max {
            return true;
        }
        if now_ns < self.sweep_not_before_ns {
            return false;
        }
        let before = self.tat_ns.len();
        self.tat_ns.retain(|_, tat| *tat > now_ns);
        if before - self.tat_ns.len() < (max / 8).max(1) {
            self.sweep_not_before_ns = now_ns.saturating_add(self.limits.window_ns());
        }
        self.tat_ns.len() < max
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const MS: u64 = 1_000_000;
    const S: u64 = 1_000 * MS;
    const LIMITS: SendRateLimits = SendRateLimits {
        per_s: 2,
        burst: 3,
        uids_max: 4,
    };

    #[test]
    fn burst_then_rate_and_refusals_cost_nothing() {
        let mut r = SendRate::new(LIMITS);
        assert!(r.is_empty());
        let t = 10 * S;
        for _ in 0..3 {
            assert_eq!(r.admit("a", t), Verdict::Admit);
        }
        assert!(!r.is_empty(), "the uid's bucket is kept");
        // hammering while empty delays nothing
        for _ in 0..100 {
            assert_eq!(r.admit("a", t), Verdict::OverRate);
        }
        // 2 per second: one token after 500 ms, not before
        assert_eq!(r.admit("a", t + 500 * MS - 1), Verdict::OverRate);
        assert_eq!(r.admit("a", t + 500 * MS), Verdict::Admit);
        assert_eq!(r.admit("a", t + 500 * MS), Verdict::OverRate);
        // another uid has its own bucket
        for _ in 0..3 {
            assert_eq!(r.admit("b", t), Verdict::Admit);
        }
        assert_eq!(r.admit("b", t), Verdict::OverRate);
        // a long pause refills up to the burst only
        let later = t + 1_000 * S;
        for _ in 0..3 {
            assert_eq!(r.admit("a", later), Verdict::Admit);
        }
        assert_eq!(r.admit("a", later), Verdict::OverRate);
        // a clock going back gives nothing
        assert_eq!(r.admit("a", t), Verdict::OverRate);
        assert_eq!(r.len(), 2);
    }

    #[test]
    fn zero_rate_means_no_limit_and_tracks_nothing() {
        let mut r = SendRate::new(SendRateLimits { per_s: 0, ..LIMITS });
        for i in 0..1_000 {
            assert_eq!(r.admit(&format!("u{i}"), 0), Verdict::Admit);
            assert_eq!(r.admit("a", 0), Verdict::Admit);
        }
        assert!(r.is_empty());
    }

    #[test]
    fn extreme_limits_neither_overflow_nor_pass_the_burst() {
        let wide = SendRateLimits {
            per_s: u32::MAX,
            burst: u32::MAX,
            uids_max: 1,
        };
        let mut r = SendRate::new(wide);
        assert_eq!(r.admit("a", u64::MAX - 1), Verdict::Admit);
        let slow = SendRateLimits {
            per_s: 1,
            burst: 0, // counts as 1
            uids_max: 0,
        };
        let mut r = SendRate::new(slow);
        assert_eq!(r.admit("a", 5 * S), Verdict::Admit);
        assert_eq!(r.admit("a", 6 * S - 1), Verdict::OverRate);
        assert_eq!(r.admit("a", 6 * S), Verdict::Admit);
        assert_eq!(r.len(), 1);
    }

    /// The table never passes `uids_max`; full of busy uids it refuses untracked ones
    /// (tracked ones go on), sweeps again only after one refill time, and then
    /// evicts the idle uids, which lose nothing (a full bucket again).
    #[test]
    fn a_full_table_refuses_new_uids_until_its_uids_are_idle() {
        let mut r = SendRate::new(LIMITS);
        let t = 10 * S;
        for u in ["a", "b", "c", "d"] {
            assert_eq!(r.admit(u, t), Verdict::Admit);
        }
        assert_eq!(r.admit("e", t), Verdict::TableFull);
        assert_eq!(r.len(), 4);
        // tracked uids are served as usual
        assert_eq!(r.admit("a", t), Verdict::Admit);
        assert_eq!(r.admit("a", t), Verdict::Admit);
        assert_eq!(r.admit("a", t), Verdict::OverRate);
        // b, c, d are idle after one interval, but the failed pass backs off for one
        // refill time (3 tokens × 500 ms)
        assert_eq!(r.admit("e", t + 500 * MS), Verdict::TableFull);
        assert_eq!(r.admit("e", t + 1_500 * MS - 1), Verdict::TableFull);
        assert_eq!(r.admit("e", t + 1_500 * MS), Verdict::Admit);
        assert!(r.len() <= 4);
        // a was busy until t + 1.5 s and has just refilled too: evicted, it gets a
        // full bucket back
        for _ in 0..3 {
            assert_eq!(r.admit("a", t + 1_500 * MS), Verdict::Admit);
        }
        assert_eq!(r.admit("a", t + 1_500 * MS), Verdict::OverRate);
        assert!(r.len() <= 4);
    }

    /// A uid is idle the instant its bucket is full again (`tat == now`): a full
    /// table evicts it for a new uid then.
    #[test]
    fn a_uid_is_idle_the_instant_its_bucket_is_full() {
        let mut r = SendRate::new(SendRateLimits {
            uids_max: 1,
            ..LIMITS
        });
        assert_eq!(r.admit("a", S), Verdict::Admit);
        assert_eq!(r.admit("b", S + 500 * MS), Verdict::Admit);
        assert_eq!(r.len(), 1);
    }

    /// With `uids_max` 16 a pass must free 16 / 8 = 2 entries not to back off:
    /// freeing 1 backs off for one refill time (1.5 s), freeing 2 does not.
    #[test]
    fn a_pass_backs_off_when_it_frees_fewer_than_an_eighth() {
        let limits = SendRateLimits {
            uids_max: 16,
            ..LIMITS
        };
        for (idle, z) in [(1, Verdict::TableFull), (2, Verdict::Admit)] {
            let mut r = SendRate::new(limits);
            for i in 0..16 {
                // the first `idle` uids send once (busy until S + 0.5 s), the others
                // three times (busy until S + 1.5 s)
                for _ in 0..if i < idle { 1 } else { 3 } {
                    assert_eq!(r.admit(&format!("u{i}"), S), Verdict::Admit);
                }
            }
            assert_eq!(r.admit("x", S + 600 * MS), Verdict::Admit);
            assert_eq!(r.len(), 16 - idle + 1);
            for k in 1..idle {
                assert_eq!(r.admit(&format!("y{k}"), S + 600 * MS), Verdict::Admit);
            }
            assert_eq!(r.len(), 16);
            // at S + 1.5 s every uid is idle: swept at once, unless the pass at
            // S + 0.6 s backed off (until S + 2.1 s)
            assert_eq!(r.admit("z", S + 1_500 * MS), z, "{idle} freed");
        }
    }

    /// A pass that frees at least `uids_max / 8` entries does not back off: the next
    /// full table is swept at once.
    #[test]
    fn a_pass_that_frees_enough_does_not_back_off() {
        let limits = SendRateLimits {
            uids_max: 16,
            ..LIMITS
        };
        let mut r = SendRate::new(limits);
        for i in 0..16 {
            assert_eq!(r.admit(&format!("u{i}"), S), Verdict::Admit);
        }
        // all idle a second later: one pass frees all 16
        for i in 16..32 {
            assert_eq!(r.admit(&format!("u{i}"), 2 * S), Verdict::Admit);
        }
        assert_eq!(r.len(), 16);
        assert_eq!(r.admit("u99", 3 * S), Verdict::Admit);
        assert_eq!(r.len(), 1);
    }

    /// The bounded table decides as an unbounded table of buckets would, except that
    /// it refuses untracked uids while it is full (and those refusals change no
    /// bucket): seeded random uids and clock steps.
    #[test]
    fn the_bounded_table_matches_an_unbounded_model() {
        use rand::{Rng, SeedableRng};
        for seed in 0..200u64 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let limits = SendRateLimits {
                per_s: rng.gen_range(1..=20),
                burst: rng.gen_range(1..=5),
                uids_max: rng.gen_range(1..=6),
            };
            let interval = limits.interval_ns();
            let window = interval * u64::from(limits.burst);
            let mut r = SendRate::new(limits);
            let mut model: HashMap<String, u64> = HashMap::new();
            let mut now = rng.gen_range(0..S);
            for step in 0..2_000 {
                now += rng.gen_range(0..interval);
                let uid = format!("u{}", rng.gen_range(0..10));
                let tat = model.get(&uid).copied().unwrap_or(0);
                let from = tat.max(now);
                let fits = from + interval <= now + window;
                let got = r.admit(&uid, now);
                let ctx = format!("seed {seed} step {step} {limits:?} {uid} at {now}");
                match got {
                    Verdict::Admit => {
                        assert!(fits, "admitted past the rate: {ctx}");
                        model.insert(uid, from + interval);
                    }
                    Verdict::OverRate => assert!(!fits, "refused within the rate: {ctx}"),
                    Verdict::TableFull => {
                        assert!(tat <= now, "a tracked uid refused: {ctx}");
                        assert_eq!(r.len(), limits.uids_max, "refused with room: {ctx}");
                    }
                }
                assert!(r.len() <= limits.uids_max, "table past its bound: {ctx}");
            }
        }
    }
}
