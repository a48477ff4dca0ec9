//! The randomized activation harness of `activation_random.rs` against the real
//! `domain::presence::authority` (one writer leading all 256 hash slots of a single-node view),
//! with the authority's own invariant check every few steps.
//!
//! Seeds: `ACTIVATION_SEED=n` runs only seed `n`; `ACTIVATION_SEEDS=k` runs seeds
//! `0..k` (default 8). A failure prints its seed.

// A test driver, outside the sans-IO boundary (clippy.toml): it may read seeds from
// the environment, time itself and run threads.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

#[path = "activation_harness.rs"]
mod harness;

use domain::cluster::{HashSlot, Target};
use domain::presence::authority::{Authority, AuthorityConfig, Directory, TouchResult};
use domain::presence::route::{
    AuthorityError, OwnerSeq, PendingToken, RegisterOutcome, Route, RouteIdentity,
};
use harness::common::{view, NODE};
use harness::Model;

struct Real(Authority);

impl Real {
    fn new() -> Self {
        // Every identity of a run keeps its fence record (no expiry pass runs), so
        // the per-uid record limit must hold a whole run's sessions of one uid.
        let cfg = AuthorityConfig {
            records_per_uid_max: 1 << 12,
            ..AuthorityConfig::default()
        };
        let dir = Directory::new(&cfg).expect("valid config");
        let slots: Vec<HashSlot> = (0..256).collect();
        let mut a = Authority::new(cfg, &dir, &slots).expect("claim");
        assert!(a.apply_view(&view(), NODE, 0));
        Real(a)
    }
}

impl Model for Real {
    fn register(
        &mut self,
        target: &Target,
        route: Route,
        now_s: u64,
    ) -> Result<RegisterOutcome, AuthorityError> {
        self.0.register_route(target, route, now_s)
    }
    fn commit(
        &mut self,
        target: &Target,
        token: &PendingToken,
        now_s: u64,
    ) -> Result<(), AuthorityError> {
        self.0.commit_route(target, token, now_s)
    }
    fn abort(
        &mut self,
        target: &Target,
        token: &PendingToken,
        now_s: u64,
    ) -> Result<(), AuthorityError> {
        self.0.abort_route(target, token, now_s)
    }
    fn unregister(
        &mut self,
        target: &Target,
        identity: &RouteIdentity,
        owner_seq: OwnerSeq,
        now_s: u64,
    ) -> Result<(), AuthorityError> {
        self.0
            .unregister_route(target, identity, owner_seq, now_s)
            .map(|_| ())
    }
    fn touch(&mut self, target: &Target, routes: Vec<Route>, now_s: u64) -> Vec<Route> {
        match self.0.touch_routes(target, &routes, now_s) {
            Ok(results) => routes
                .into_iter()
                .zip(results)
                .filter(|(_, r)| *r == TouchResult::Full)
                .map(|(route, _)| route)
                .collect(),
            Err(_) => routes,
        }
    }
    fn active_seq(&self, identity: &RouteIdentity) -> Option<OwnerSeq> {
        self.0.route(identity).map(|r| r.owner_seq)
    }
    fn has_pending(&self, identity: &RouteIdentity) -> bool {
        self.0.has_pending(identity)
    }
    fn pending_count(&self) -> usize {
        (0..256).map(|s| self.0.counts(s).pending).sum()
    }
    fn active_routes(&self) -> Vec<Route> {
        (0..256).flat_map(|s| self.0.active_routes(s)).collect()
    }
    fn check_invariants(&self) -> Result<(), String> {
        self.0.check_invariants()
    }
}

#[test]
fn random_interleavings_against_the_real_authority_stay_consistent() {
    let mut total = 0;
    let mut succeeded = 0;
    let mut kinds = std::collections::BTreeMap::new();
    for seed in harness::seeds(8) {
        let (n, ok) = harness::run(seed, Real::new(), &mut kinds);
        total += n;
        succeeded += ok;
    }
    println!("{total} activations, {succeeded} succeeded; outcomes: {kinds:?}");
    assert!(succeeded > 0 && succeeded < total);
}
