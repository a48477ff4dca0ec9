//! How long an idle shard spins before it parks: a pure decision (durations in,
//! a budget out; no clock), driven by the shard loop.
//!
//! Spinning buys latency (work that arrives while the shard spins is handled without
//! a park and a wake-up) with CPU that, on a machine shared with other processes,
//! they need. Fixed (`idle_spin_adaptive = false`): every idle spell spins
//! `idle_spin_us`, then parks. Adaptive (the default), two rules:
//! - **It pays:** the spell's budget follows how spells end. Work that arrived
//!   after `spun` of spinning raises it to at least `2 × spun`; a park whose wait
//!   ended soon (spun + slept under `idle_spin_us`: spinning longer would have
//!   caught that work) raises it to `2 × (spun + slept)`; a longer park halves it
//!   (under 1 µs: no spin at all). Always at most `idle_spin_us`.
//! - **It is bounded by the work:** spinning spends a credit earned at
//!   `idle_spin_busy_percent` of the time the shard was busy (turns that found
//!   work), held up to `idle_spin_us`. Spin CPU is then at most that fraction of the
//!   work's own CPU (plus one budget), whatever the traffic's shape.

/// Below this a halved budget becomes 0 (park at once).
const BUDGET_FLOOR_NS: u64 = 1_000;

/// The spin decision of one shard.
#[derive(Clone, Debug)]
pub struct SpinPolicy {
    max_ns: u64,
    adaptive: bool,
    busy_percent: u64,
    /// What the next spell may spin by the "it pays" rule.
    budget_ns: u64,
    /// Spin time earned by busy time, at most `max_ns`.
    credit_ns: u64,
}

impl SpinPolicy {
    /// A policy spinning at most `max_ns`; `adaptive == false` spins exactly
    /// `max_ns` on every idle spell (the fixed policy). Starts with a full budget
    /// and credit.
    pub fn new(max_ns: u64, adaptive: bool, busy_percent: u64) -> Self {
        SpinPolicy {
            max_ns,
            adaptive,
            busy_percent,
            budget_ns: max_ns,
            credit_ns: max_ns,
        }
    }

    /// How long the idle spell starting now may spin before the shard parks.
    pub fn allowed_ns(&self) -> u64 {
        if self.adaptive {
            self.budget_ns.min(self.credit_ns)
        } else {
            self.max_ns
        }
    }

    /// The shard was busy (a turn that found work) for `busy_ns`: earns credit.
    pub fn on_busy(&mut self, busy_ns: u64) {
        let earned = busy_ns.saturating_mul(self.busy_percent) / 100;
        self.credit_ns = self.credit_ns.saturating_add(earned).min(self.max_ns);
    }

    /// The idle spell ended with work found after spinning `spun_ns` (no park).
    pub fn on_work(&mut self, spun_ns: u64) {
        self.spend(spun_ns);
        self.budget_ns = self
            .budget_ns
            .max(spun_ns.saturating_mul(2))
            .min(self.max_ns);
    }

    /// The idle spell spun `spun_ns`, then parked for `slept_ns` (until its wake-up).
    pub fn on_park(&mut self, spun_ns: u64, slept_ns: u64) {
        self.spend(spun_ns);
        let gap_ns = spun_ns.saturating_add(slept_ns);
        self.budget_ns = if gap_ns < self.max_ns {
            self.budget_ns
                .max(gap_ns.saturating_mul(2))
                .min(self.max_ns)
        } else if self.budget_ns / 2 < BUDGET_FLOOR_NS {
            0
        } else {
            self.budget_ns / 2
        };
    }

    fn spend(&mut self, spun_ns: u64) {
        self.credit_ns = self.credit_ns.saturating_sub(spun_ns);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1_000;

    #[test]
    fn fixed_spins_the_maximum_whatever_happens() {
        let mut p = SpinPolicy::new(50 * US, false, 10);
        for _ in 0..10 {
            p.on_park(50 * US, 10_000 * US);
        }
        assert_eq!(p.allowed_ns(), 50 * US);
    }

    #[test]
    fn long_parks_halve_the_budget_down_to_no_spin() {
        // Plenty of busy time: only the "it pays" rule limits.
        let mut p = SpinPolicy::new(50 * US, true, 100);
        let mut seen = vec![p.allowed_ns()];
        for _ in 0..7 {
            let spun = p.allowed_ns();
            p.on_park(spun, 400 * US);
            p.on_busy(100 * US);
            seen.push(p.allowed_ns());
        }
        assert_eq!(
            seen,
            [50_000, 25_000, 12_500, 6_250, 3_125, 1_562, 0, 0],
            "halves per long park, then parks at once"
        );
    }

    #[test]
    fn a_short_park_or_work_found_spinning_raises_the_budget_again() {
        let mut p = SpinPolicy::new(50 * US, true, 100);
        for _ in 0..8 {
            p.on_park(p.allowed_ns(), 400 * US);
        }
        p.on_busy(1_000 * US);
        assert_eq!(p.allowed_ns(), 0);
        // Parked at once, woken 6 µs later: 12 µs of spinning would have caught it.
        p.on_park(0, 6 * US);
        assert_eq!(p.allowed_ns(), 12 * US);
        // Work found after 10 µs of spinning: the next spell may spin 20 µs.
        p.on_work(10 * US);
        p.on_busy(1_000 * US);
        assert_eq!(p.allowed_ns(), 20 * US);
        // Never beyond the maximum.
        p.on_work(40 * US);
        p.on_busy(1_000 * US);
        assert_eq!(p.allowed_ns(), 50 * US);
    }

    #[test]
    fn spin_time_is_bounded_by_a_fraction_of_busy_time() {
        // Work of 10 µs per 1 ms, each gap just short enough to look worth spinning:
        // the credit, not the budget, decides.
        let mut p = SpinPolicy::new(50 * US, true, 20);
        let (mut spun_total, mut busy_total) = (0, 0);
        for _ in 0..1_000 {
            p.on_busy(10 * US);
            busy_total += 10 * US;
            let spun = p.allowed_ns();
            spun_total += spun;
            p.on_park(spun, 5 * US);
        }
        assert!(
            spun_total <= busy_total * 20 / 100 + 50 * US,
            "spun {spun_total} ns for {busy_total} ns of work"
        );
        assert_eq!(p.allowed_ns(), 0, "credit spent: park at once");
    }

    #[test]
    fn a_gap_of_exactly_the_maximum_halves_and_a_half_of_exactly_the_floor_stays() {
        // A park whose spun + slept equals the maximum is a long one: it halves.
        let mut p = SpinPolicy::new(50 * US, true, 100);
        p.on_park(0, 50 * US);
        assert_eq!(p.allowed_ns(), 25 * US);
        // A budget of twice the floor halves to the floor itself, not to 0.
        let mut p = SpinPolicy::new(2 * BUDGET_FLOOR_NS, true, 100);
        p.on_park(0, 10 * US);
        assert_eq!(p.allowed_ns(), BUDGET_FLOOR_NS);
        p.on_park(0, 10 * US);
        assert_eq!(p.allowed_ns(), 0, "half the floor is under it");
    }

    #[test]
    fn busy_time_earns_its_percentage_of_credit() {
        // Credit spent to 0 (work found after a whole spell), then earned back at
        // 30% of 100 µs of work.
        let mut p = SpinPolicy::new(50 * US, true, 30);
        p.on_work(50 * US);
        assert_eq!(p.allowed_ns(), 0);
        p.on_busy(100 * US);
        assert_eq!(p.allowed_ns(), 30 * US);
    }
}
