//! The randomized activation harness, generic over the authority [`Model`]
//! (`#[path]`-included by `activation_random*.rs`; compiled on its own it is an empty
//! test crate). See `activation_random.rs` for what it checks.

// A test driver, outside the sans-IO boundary (clippy.toml): it may read seeds from
// the environment, time itself and run threads.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]
#![allow(dead_code)]

use std::collections::HashMap;

use domain::cluster::{ClusterView, Target};
use domain::presence::activation::{
    Activation, ActivationConfig, ActivationId, AuthorityRequest, Event, Outcome, Output,
    OwnerActionFailed, ReasonCode,
};
use domain::presence::registry::{Registry, SessionState, UnregisterRequest};
use domain::presence::route::{
    AuthorityError, DeviceLevel, OwnerAction, OwnerSeq, PendingToken, RegisterOutcome, Route,
    RouteIdentity,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[path = "activation_common.rs"]
pub mod common;
use common::*;

const STEPS: usize = 3_000;
const MAX_SESSIONS: u32 = 16;
/// How often the authority model checks its own invariants.
const MODEL_CHECK_EVERY_STEPS: usize = 32;

/// The authority the harness talks to.
pub trait Model {
    fn register(
        &mut self,
        target: &Target,
        route: Route,
        now_s: u64,
    ) -> Result<RegisterOutcome, AuthorityError>;
    fn commit(
        &mut self,
        target: &Target,
        token: &PendingToken,
        now_s: u64,
    ) -> Result<(), AuthorityError>;
    fn abort(
        &mut self,
        target: &Target,
        token: &PendingToken,
        now_s: u64,
    ) -> Result<(), AuthorityError>;
    fn unregister(
        &mut self,
        target: &Target,
        identity: &RouteIdentity,
        owner_seq: OwnerSeq,
        now_s: u64,
    ) -> Result<(), AuthorityError>;
    /// Applies a touch batch; returns the routes the owner should requeue.
    fn touch(&mut self, target: &Target, routes: Vec<Route>, now_s: u64) -> Vec<Route>;
    /// The owner_seq of the active route of `identity`.
    fn active_seq(&self, identity: &RouteIdentity) -> Option<OwnerSeq>;
    fn has_pending(&self, identity: &RouteIdentity) -> bool;
    fn pending_count(&self) -> usize;
    fn active_routes(&self) -> Vec<Route>;
    fn check_invariants(&self) -> Result<(), String> {
        Ok(())
    }
}

enum Msg {
    Register {
        act: usize,
        target: Target,
        route: Route,
    },
    Commit {
        act: usize,
        target: Target,
        token: PendingToken,
    },
    Abort {
        act: usize,
        target: Target,
        token: PendingToken,
    },
    Unregister(UnregisterRequest),
    Touch(Target, Vec<Route>),
    Reply {
        act: usize,
        event: Event,
    },
    OwnerAction {
        act: usize,
        index: u32,
        action: OwnerAction,
    },
}

pub struct Harness<M: Model> {
    seed: u64,
    rng: StdRng,
    reg: Registry,
    auth: M,
    view: ClusterView,
    now_ms: u64,
    acts: Vec<Activation>,
    connacks: Vec<u32>,
    running_by_session: HashMap<u64, usize>,
    inflight: Vec<Msg>,
    next_sid: u64,
    quiescing: bool,
}

impl<M: Model> Harness<M> {
    fn new(seed: u64, auth: M) -> Self {
        let mut cfg = config();
        cfg.sessions_max = MAX_SESSIONS;
        cfg.pending_unregisters_max = 1_024;
        cfg.unregister_attempts_max = 64;
        cfg.unregister_retry_base_ms = 10;
        cfg.unregister_retry_ms_max = 200;
        Harness {
            seed,
            rng: StdRng::seed_from_u64(seed),
            reg: Registry::new(cfg).unwrap(),
            auth,
            view: view(),
            now_ms: 1_000,
            acts: Vec::new(),
            connacks: Vec::new(),
            running_by_session: HashMap::new(),
            inflight: Vec::new(),
            next_sid: 1,
            quiescing: false,
        }
    }

    fn target(&self) -> Target {
        // Every test uid maps to one node's targets; the exact slot is checked by
        // comparing with the view.
        self.view.target_for_slot(0)
    }

    fn apply(&mut self, act: usize, out: Vec<Output>) {
        for o in out {
            match o {
                Output::SendToAuthority { target, request } => {
                    assert_eq!(
                        target.leader_node_id,
                        self.target().leader_node_id,
                        "seed {}",
                        self.seed
                    );
                    self.inflight.push(match request {
                        AuthorityRequest::Register { route } => {
                            assert_eq!(target, self.view.target_for_uid(&route.uid));
                            Msg::Register { act, target, route }
                        }
                        AuthorityRequest::Commit { token } => Msg::Commit { act, target, token },
                        AuthorityRequest::Abort { token } => Msg::Abort { act, target, token },
                        AuthorityRequest::Unregister { .. } => {
                            panic!("seed {}: unregisters go through the registry", self.seed)
                        }
                    });
                }
                Output::PerformOwnerAction { index, action } => {
                    self.inflight.push(Msg::OwnerAction { act, index, action })
                }
                Output::SendConnack { reason: r } => {
                    self.connacks[act] += 1;
                    let a = &self.acts[act];
                    if r == ReasonCode::SUCCESS {
                        let Some(Outcome::Active(h)) = a.outcome() else {
                            panic!("seed {}: success CONNACK without active outcome", self.seed)
                        };
                        assert_eq!(self.reg.state(h), Some(SessionState::Active));
                    } else {
                        assert!(matches!(a.outcome(), Some(Outcome::Failed { .. })));
                    }
                }
                Output::CloseConnection => {}
            }
        }
        let a = &self.acts[act];
        if a.is_finished() {
            self.running_by_session.remove(&a.identity().session_id);
        }
    }

    fn feed(&mut self, act: usize, event: Event) {
        let mut out = Vec::new();
        self.acts[act].handle_event(&mut self.reg, event, self.now_ms, &mut out);
        self.apply(act, out);
    }

    fn start(&mut self) {
        let uid = format!("u{}", self.rng.gen_range(0..4));
        let device = format!("d{}", self.rng.gen_range(0..2));
        let flag = self.rng.gen_range(0..2u8);
        let level = if self.rng.gen_bool(0.5) {
            DeviceLevel::Master
        } else {
            DeviceLevel::Slave
        };
        let sid = self.next_sid;
        self.next_sid += 1;
        let act = self.acts.len();
        let mut out = Vec::new();
        let a = Activation::start(
            ActivationId(act as u64),
            &ActivationConfig::default(),
            &mut self.reg,
            &self.view,
            session(&uid, &device, flag, level, sid),
            self.now_ms,
            &mut out,
        );
        if !a.is_finished() {
            self.running_by_session.insert(sid, act);
        }
        self.acts.push(a);
        self.connacks.push(0);
        self.apply(act, out);
    }

    fn deliver(&mut self, i: usize) {
        let msg = self.inflight.swap_remove(i);
        let now_s = self.now_ms / 1000;
        match msg {
            Msg::Register { act, target, route } => {
                let reply = if !self.quiescing && self.rng.gen_bool(0.05) {
                    Err(if self.rng.gen_bool(0.5) {
                        AuthorityError::NotLeader
                    } else {
                        AuthorityError::StaleTarget
                    })
                } else {
                    self.auth.register(&target, route, now_s)
                };
                self.inflight.push(Msg::Reply {
                    act,
                    event: Event::RegisterReply(reply),
                });
            }
            Msg::Commit { act, target, token } => {
                let reply = self.auth.commit(&target, &token, now_s);
                self.inflight.push(Msg::Reply {
                    act,
                    event: Event::CommitReply(reply),
                });
            }
            Msg::Abort { act, target, token } => {
                let reply = self.auth.abort(&target, &token, now_s);
                self.inflight.push(Msg::Reply {
                    act,
                    event: Event::AbortReply(reply),
                });
            }
            Msg::Unregister(req) => {
                assert_eq!(req.target, self.view.target_for_uid(&req.identity.uid));
                let lost = !self.quiescing && self.rng.gen_bool(0.2);
                if lost
                    || self
                        .auth
                        .unregister(&req.target, &req.identity, req.owner_seq, now_s)
                        .is_err()
                {
                    self.reg.unregister_failed(req, self.now_ms);
                }
            }
            Msg::Touch(target, routes) => {
                if !self.quiescing && self.rng.gen_bool(0.1) {
                    // Lost batch: the worker requeues what is still current.
                    self.reg.touch_failed(target, &routes);
                } else {
                    let failed = self.auth.touch(&target, routes, now_s);
                    self.reg.touch_failed(target, &failed);
                }
            }
            Msg::Reply { act, event } => self.feed(act, event),
            Msg::OwnerAction { act, index, action } => {
                let result = if self.rng.gen_bool(0.1) {
                    Err(OwnerActionFailed)
                } else {
                    if let Some(h) = self.reg.find(&action.route) {
                        if let Some(&other) = self.running_by_session.get(&action.route.session_id)
                        {
                            self.feed(other, Event::SessionClosed);
                        } else {
                            self.reg.mark_closing(h).unwrap();
                            self.reg.deactivate(h, self.now_ms).unwrap();
                        }
                        assert_eq!(self.reg.get(h), None);
                    }
                    Ok(())
                };
                self.inflight.push(Msg::Reply {
                    act,
                    event: Event::OwnerActionDone { index, result },
                });
            }
        }
    }

    fn close_random(&mut self) {
        let handles: Vec<_> = self.reg.handles().collect();
        if handles.is_empty() {
            return;
        }
        let h = handles[self.rng.gen_range(0..handles.len())];
        let sid = self.reg.get(h).unwrap().session_id;
        if let Some(&act) = self.running_by_session.get(&sid) {
            if self.rng.gen_bool(0.3) {
                // The driver removed it without telling the machine (a race the
                // machine must survive: rule 31 of docs/authority-rules.md).
                self.reg.deactivate(h, self.now_ms).unwrap();
            } else {
                self.feed(act, Event::SessionClosed);
            }
        } else {
            self.reg.deactivate(h, self.now_ms).unwrap();
        }
    }

    fn tick_all(&mut self) {
        // Sorted: HashMap order is random per process and the run must replay.
        let mut running: Vec<usize> = self.running_by_session.values().copied().collect();
        running.sort_unstable();
        for act in running {
            self.feed(act, Event::Tick);
        }
    }

    fn drain_unregisters(&mut self) {
        for req in self
            .reg
            .drain_unregisters(&self.view, self.now_ms, usize::MAX)
        {
            self.inflight.push(Msg::Unregister(req));
        }
    }

    fn drain_touches(&mut self) {
        for (t, routes) in self.reg.drain_touches(&self.view, 4) {
            for r in &routes {
                assert_eq!(t, self.view.target_for_uid(&r.uid));
            }
            self.inflight.push(Msg::Touch(t, routes));
        }
    }

    fn random_step(&mut self) {
        match self.rng.gen_range(0..100) {
            0..=9 => self.start(),
            10..=64 => {
                if !self.inflight.is_empty() {
                    let i = self.rng.gen_range(0..self.inflight.len());
                    self.deliver(i);
                }
            }
            65..=72 => self.close_random(),
            73..=82 => {
                self.now_ms += self.rng.gen_range(0..1_200);
                self.tick_all();
            }
            83..=89 => {
                let active: Vec<_> = self
                    .reg
                    .handles()
                    .filter(|&h| self.reg.state(h) == Some(SessionState::Active))
                    .collect();
                if !active.is_empty() {
                    let h = active[self.rng.gen_range(0..active.len())];
                    assert!(self.reg.mark_touched(h, self.now_ms / 1000));
                }
            }
            90..=94 => self.drain_touches(),
            _ => self.drain_unregisters(),
        }
    }

    /// The authority model's own (possibly costly) invariant check.
    fn check_model(&self) {
        if let Err(e) = self.auth.check_invariants() {
            panic!("seed {}: authority invariant: {e}", self.seed);
        }
    }

    fn check(&self) {
        let seed = self.seed;
        for (i, a) in self.acts.iter().enumerate() {
            let expected = u32::from(a.is_finished());
            assert_eq!(self.connacks[i], expected, "seed {seed}: activation {i}");
        }
        for h in self.reg.handles() {
            let info = self.reg.get(h).unwrap();
            match self.reg.state(h).unwrap() {
                SessionState::Active => {
                    assert_eq!(
                        self.auth.active_seq(&info.identity()),
                        Some(info.owner_seq),
                        "seed {seed}: session {} active locally without its route",
                        info.session_id
                    );
                }
                SessionState::Pending => assert!(
                    self.running_by_session.contains_key(&info.session_id),
                    "seed {seed}: pending session {} without a running activation",
                    info.session_id
                ),
                SessionState::Closing => panic!("seed {seed}: closing session left behind"),
            }
        }
        for &act in self.running_by_session.values() {
            let a = &self.acts[act];
            assert!(!a.is_finished());
            let state = a.handle().and_then(|h| self.reg.state(h));
            assert_ne!(state, Some(SessionState::Active), "seed {seed}");
        }
    }

    fn quiesce(&mut self) {
        self.quiescing = true;
        self.now_ms += 10_000;
        self.tick_all();
        assert!(self.running_by_session.is_empty(), "seed {}", self.seed);
        for _round in 0..1_000 {
            while !self.inflight.is_empty() {
                let i = self.rng.gen_range(0..self.inflight.len());
                self.deliver(i);
                self.check();
            }
            self.now_ms += 1_000;
            self.drain_unregisters();
            self.drain_touches();
            if self.inflight.is_empty() && self.reg.pending_unregisters() == 0 {
                break;
            }
        }
        assert!(
            self.inflight.is_empty(),
            "seed {}: did not settle",
            self.seed
        );
        assert_eq!(self.reg.pending_unregisters(), 0);
    }

    fn final_check(&self) {
        let seed = self.seed;
        self.check();
        self.check_model();
        assert!(self.acts.iter().all(Activation::is_finished), "seed {seed}");
        assert_eq!(
            self.auth.pending_count(),
            0,
            "seed {seed}: pending candidates left"
        );
        for a in &self.acts {
            assert!(!self.auth.has_pending(a.identity()), "seed {seed}");
        }
        for route in self.auth.active_routes() {
            let id = &route.identity();
            let h = self.reg.find(id);
            let ok = h.is_some_and(|h| {
                self.reg.state(h) == Some(SessionState::Active)
                    && self.reg.get(h).unwrap().owner_seq == route.owner_seq
            });
            assert!(
                ok,
                "seed {seed}: route left at the authority for gone session {id:?}"
            );
        }
        let stats = self.reg.stats();
        assert_eq!(stats.unregisters_dropped_full, 0);
        assert_eq!(stats.unregisters_abandoned, 0);
    }
}

struct SeedReport(u64);

impl Drop for SeedReport {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "activation_random failed with seed {0}; rerun with ACTIVATION_SEED={0}",
                self.0
            );
        }
    }
}

pub fn run<M: Model>(
    seed: u64,
    auth: M,
    kinds: &mut std::collections::BTreeMap<String, usize>,
) -> (usize, usize) {
    let _report = SeedReport(seed);
    let mut h = Harness::new(seed, auth);
    for i in 0..STEPS {
        h.random_step();
        h.check();
        if i % MODEL_CHECK_EVERY_STEPS == 0 {
            h.check_model();
        }
    }
    h.quiesce();
    h.final_check();
    for a in &h.acts {
        let key = match a.outcome() {
            Some(Outcome::Failed { failure, .. }) => format!("{failure:?}"),
            Some(Outcome::Active(_)) => "Active".to_string(),
            None => "Running".to_string(),
        };
        *kinds.entry(key).or_default() += 1;
    }
    let ok = h
        .acts
        .iter()
        .filter(|a| matches!(a.outcome(), Some(Outcome::Active(_))))
        .count();
    (h.acts.len(), ok)
}

/// The seeds to run: `ACTIVATION_SEED`, else `0..ACTIVATION_SEEDS`, else `0..default`.
pub fn seeds(default: u64) -> Vec<u64> {
    if let Ok(s) = std::env::var("ACTIVATION_SEED") {
        return vec![s.parse().expect("ACTIVATION_SEED is a u64")];
    }
    let n = std::env::var("ACTIVATION_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    (0..n).collect()
}
