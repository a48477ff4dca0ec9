//! Deterministic randomized activations: many concurrent activations, with replies,
//! owner actions, closes (told to the machine or not), timeouts, touches and
//! unregisters (some lost and retried) interleaved at random, against an in-memory
//! model of the authority. Checked after every step:
//!
//! - no session is active locally without its route active at the authority (same
//!   owner_seq), no pending session without its running activation, and no running
//!   activation has an active session;
//! - every finished activation emitted exactly one CONNACK, a running one none; a
//!   success CONNACK only with the session active;
//!
//! and, once every message is delivered and every queue drained: no route or pending
//! candidate is left at the authority for a session that is gone, and every local
//! session is active with its route.
//!
//! `activation_random_authority.rs` runs the same harness against the real
//! `domain::presence::authority`.
//!
//! Seeds: `ACTIVATION_SEED=n` runs only seed `n`; `ACTIVATION_SEEDS=k` runs seeds
//! `0..k` (default 48). A failure prints its seed.

// A test driver, outside the sans-IO boundary (clippy.toml): it may read seeds from
// the environment, time itself and run threads.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

#[path = "activation_harness.rs"]
mod harness;

use std::collections::HashMap;

use domain::cluster::Target;
use domain::presence::route::{
    AuthorityError, DeviceLevel, OwnerAction, OwnerActionKind, OwnerSeq, PendingToken,
    RegisterOutcome, Route, RouteIdentity,
};
use harness::Model;

struct Candidate {
    route: Route,
    nonce: u64,
    acked: Vec<RouteIdentity>,
}

/// A model of the authority (rules 6–19 of `docs/authority-rules.md`, as far as
/// activation needs them).
#[derive(Default)]
struct FakeAuthority {
    active: HashMap<RouteIdentity, Route>,
    candidates: HashMap<RouteIdentity, Candidate>,
    tombstones: HashMap<RouteIdentity, OwnerSeq>,
    next_nonce: u64,
}

impl FakeAuthority {
    fn tombstoned(&self, id: &RouteIdentity, seq: OwnerSeq) -> bool {
        self.tombstones.get(id).is_some_and(|&t| seq <= t)
    }

    fn conflicts(&self, route: &Route) -> Vec<Route> {
        let mut v: Vec<Route> = self
            .active
            .values()
            .filter(|r| route.conflicts_with(r))
            .cloned()
            .collect();
        v.sort_by_key(|r| r.session_id);
        v
    }

    fn register_route(&mut self, route: Route) -> Result<RegisterOutcome, AuthorityError> {
        let id = route.identity();
        if self.tombstoned(&id, route.owner_seq) {
            return Err(AuthorityError::Tombstoned);
        }
        let conflicts = self.conflicts(&route);
        if conflicts.is_empty() {
            self.candidates.remove(&id);
            self.active.insert(id, route);
            return Ok(RegisterOutcome::Active);
        }
        self.next_nonce += 1;
        let token = PendingToken {
            identity: id.clone(),
            owner_seq: route.owner_seq,
            nonce: self.next_nonce,
        };
        let actions = conflicts
            .iter()
            .map(|r| OwnerAction {
                kind: if route.device_level == DeviceLevel::Master && r.device_id != route.device_id
                {
                    OwnerActionKind::KickThenClose
                } else {
                    OwnerActionKind::Close
                },
                route: r.identity(),
                owner_seq: r.owner_seq,
            })
            .collect();
        self.candidates.insert(
            id,
            Candidate {
                route,
                nonce: self.next_nonce,
                acked: conflicts.iter().map(Route::identity).collect(),
            },
        );
        Ok(RegisterOutcome::Pending { token, actions })
    }

    fn commit_route(&mut self, token: &PendingToken) -> Result<(), AuthorityError> {
        let Some(c) = self.candidates.get(&token.identity) else {
            return Err(AuthorityError::NotReady);
        };
        if c.nonce != token.nonce {
            return Err(AuthorityError::Superseded);
        }
        if self
            .conflicts(&c.route)
            .iter()
            .any(|r| !c.acked.contains(&r.identity()))
        {
            return Err(AuthorityError::NotReady);
        }
        let c = self.candidates.remove(&token.identity).expect("present");
        for id in &c.acked {
            self.active.remove(id);
        }
        self.active.insert(token.identity.clone(), c.route);
        Ok(())
    }

    fn abort_route(&mut self, token: &PendingToken) -> Result<(), AuthorityError> {
        match self.candidates.get(&token.identity) {
            Some(c) if c.nonce == token.nonce => {
                self.candidates.remove(&token.identity);
                Ok(())
            }
            _ => Err(AuthorityError::Superseded),
        }
    }

    fn unregister_route(&mut self, id: &RouteIdentity, seq: OwnerSeq) {
        let t = self.tombstones.entry(id.clone()).or_insert(0);
        *t = (*t).max(seq);
        if self.active.get(id).is_some_and(|r| r.owner_seq <= seq) {
            self.active.remove(id);
        }
        if self
            .candidates
            .get(id)
            .is_some_and(|c| c.route.owner_seq <= seq)
        {
            self.candidates.remove(id);
        }
    }

    fn touch_route(&mut self, route: Route) {
        let id = route.identity();
        if self.tombstoned(&id, route.owner_seq) {
            return;
        }
        if let Some(r) = self.active.get_mut(&id) {
            if route.owner_seq >= r.owner_seq {
                r.last_active_s = r.last_active_s.max(route.last_active_s);
            }
        } else if self.conflicts(&route).is_empty() {
            self.active.insert(id, route);
        }
    }
}

impl Model for FakeAuthority {
    fn register(
        &mut self,
        _target: &Target,
        route: Route,
        _now_s: u64,
    ) -> Result<RegisterOutcome, AuthorityError> {
        self.register_route(route)
    }
    fn commit(
        &mut self,
        _target: &Target,
        token: &PendingToken,
        _now_s: u64,
    ) -> Result<(), AuthorityError> {
        self.commit_route(token)
    }
    fn abort(
        &mut self,
        _target: &Target,
        token: &PendingToken,
        _now_s: u64,
    ) -> Result<(), AuthorityError> {
        self.abort_route(token)
    }
    fn unregister(
        &mut self,
        _target: &Target,
        identity: &RouteIdentity,
        owner_seq: OwnerSeq,
        _now_s: u64,
    ) -> Result<(), AuthorityError> {
        self.unregister_route(identity, owner_seq);
        Ok(())
    }
    fn touch(&mut self, _target: &Target, routes: Vec<Route>, _now_s: u64) -> Vec<Route> {
        for r in routes {
            self.touch_route(r);
        }
        Vec::new()
    }
    fn active_seq(&self, identity: &RouteIdentity) -> Option<OwnerSeq> {
        self.active.get(identity).map(|r| r.owner_seq)
    }
    fn has_pending(&self, identity: &RouteIdentity) -> bool {
        self.candidates.contains_key(identity)
    }
    fn pending_count(&self) -> usize {
        self.candidates.len()
    }
    fn active_routes(&self) -> Vec<Route> {
        self.active.values().cloned().collect()
    }
}

#[test]
fn random_interleavings_keep_local_and_authority_state_consistent() {
    let mut total = 0;
    let mut succeeded = 0;
    let mut kinds = std::collections::BTreeMap::new();
    for seed in harness::seeds(48) {
        let (n, ok) = harness::run(seed, FakeAuthority::default(), &mut kinds);
        total += n;
        succeeded += ok;
    }
    println!("{total} activations, {succeeded} succeeded; outcomes: {kinds:?}");
    // The mix must exercise both outcomes and every failure kind, or it proves little.
    assert!(succeeded > 0 && succeeded < total);
    if harness::seeds(48).len() > 1 {
        for k in [
            "OwnerActionFailed",
            "CommitRefused(NotReady)",
            "SessionGone",
            "SessionClosed(AwaitRegister)",
            "SessionClosed(AwaitOwnerActions)",
            "SessionClosed(AwaitCommit)",
            "Timeout(AwaitRegister)",
            "Timeout(AwaitOwnerActions)",
            "Timeout(AwaitCommit)",
            "RegisterRefused(NotLeader)",
        ] {
            assert!(kinds.contains_key(k), "never exercised: {k}");
        }
    }
}
