//! Deterministic simulation of the presence authority: gateways (with restarts that
//! change their boot id), two authority nodes, leadership changes (new term, new
//! config epoch, revision-only, loss), register/commit/abort/touch/unregister/expire
//! and lookups, with every call and reply in flight in a queue delivered in random
//! order (or dropped), and time advancing. After every step it asserts: no two
//! committed conflicting routes; nothing created under an older identity survives
//! it; no route at or below a tombstone; no lookup answered under a stale target.
//!
//! `IMROUTER_SIM_SEEDS=N` runs N seeds (default 2000, spread over up to 4 threads:
//! ~40 s on 2 cores in a debug build); `IMROUTER_SIM_SEED=S` runs only seed S. A failure prints its seed.

// A test driver, outside the sans-IO boundary (clippy.toml): it may read seeds from
// the environment, time itself and run threads.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::collections::HashMap;

use domain::cluster::{ClusterView, HashSlot, NodeId, Target};
use domain::presence::authority::{
    Authority, AuthorityConfig, AuthorityReader, Directory, TouchResult,
};
use domain::presence::route::{
    AuthorityError, DeviceLevel, Endpoint, PendingToken, RegisterOutcome, Route, RouteIdentity,
    Transport, Uid,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use slots::hash_slot;

const SLOTS: [HashSlot; 4] = [1, 2, 3, 4];
const AUTH_NODES: [NodeId; 2] = [10, 11];
const NOBODY: NodeId = 99;
const GATEWAYS: usize = 3;
const TTL_S: u64 = 30;
const STEPS: usize = 600;

enum Msg {
    Register {
        gw: usize,
        boot: u64,
        session: u64,
        target: Target,
        route: Route,
    },
    Commit {
        gw: usize,
        boot: u64,
        session: u64,
        target: Target,
        token: PendingToken,
    },
    Abort {
        target: Target,
        token: PendingToken,
    },
    Touch {
        target: Target,
        routes: Vec<Route>,
    },
    Unregister {
        target: Target,
        id: RouteIdentity,
        seq: u64,
    },
    RegisterReply {
        gw: usize,
        boot: u64,
        session: u64,
        target: Target,
        res: Result<RegisterOutcome, AuthorityError>,
    },
    CommitReply {
        gw: usize,
        boot: u64,
        session: u64,
        res: Result<(), AuthorityError>,
    },
}

#[derive(PartialEq, Eq, Clone, Copy, Debug)]
enum State {
    Registering,
    Committing,
    Active,
}

struct Session {
    route: Route,
    state: State,
}

struct Gateway {
    node_id: NodeId,
    boot_id: u64,
    next_session: u64,
    next_seq: u64,
    view: ClusterView,
    sessions: HashMap<u64, Session>,
}

struct AuthNode {
    node_id: NodeId,
    a: Authority,
    r: AuthorityReader,
}

struct Sim {
    rng: StdRng,
    now: u64,
    view: ClusterView,
    auth: Vec<AuthNode>,
    gws: Vec<Gateway>,
    queue: Vec<Msg>,
    uids: Vec<Uid>,
    /// The target under which each (authority node, identity) route was last created.
    created_under: HashMap<(NodeId, RouteIdentity), Target>,
    boots: u64,
    seen: Seen,
}

/// What the runs exercised (asserted non-zero, so the checks cannot pass vacuously).
#[derive(Default, Debug, Clone, Copy)]
struct Seen {
    active_registers: u64,
    commits: u64,
    recreated: u64,
    ok_lookups: u64,
    stale_lookups: u64,
}

impl Sim {
    fn new(seed: u64) -> Sim {
        let cfg = AuthorityConfig {
            route_ttl_s: TTL_S,
            pending_ttl_s: 10,
            fence_retention_s: 100,
            ..AuthorityConfig::default()
        };
        let mut view = ClusterView::single_node(AUTH_NODES[0]);
        for s in SLOTS {
            view.slots[s as usize].slot_id = 1;
        }
        let now = 1000;
        let auth = AUTH_NODES
            .iter()
            .map(|&n| {
                let dir = Directory::new(&cfg).unwrap();
                let mut a = Authority::new(cfg.clone(), &dir, &SLOTS).unwrap();
                a.apply_view(&view, n, now);
                let r = a.reader();
                AuthNode { node_id: n, a, r }
            })
            .collect();
        let gws = (0..GATEWAYS)
            .map(|i| Gateway {
                node_id: i as NodeId + 1,
                boot_id: i as u64 + 100,
                next_session: 1,
                next_seq: 1,
                view: view.clone(),
                sessions: HashMap::new(),
            })
            .collect();
        let uids = SLOTS
            .iter()
            .flat_map(|&s| {
                (0..)
                    .map(|i| format!("s{i}"))
                    .filter(move |u| hash_slot(u.as_bytes()) == s)
                    .take(3)
                    .map(Uid::from)
            })
            .collect();
        Sim {
            rng: StdRng::seed_from_u64(seed),
            now,
            view,
            auth,
            gws,
            queue: Vec::new(),
            uids,
            created_under: HashMap::new(),
            boots: 1000,
            seen: Seen::default(),
        }
    }

    fn auth_mut(&mut self, node: NodeId) -> Option<&mut AuthNode> {
        self.auth.iter_mut().find(|a| a.node_id == node)
    }

    fn step(&mut self) -> Result<(), String> {
        let p = self.rng.gen_range(0..100);
        match p {
            0..=39 if !self.queue.is_empty() => {
                let i = self.rng.gen_range(0..self.queue.len());
                let m = self.queue.swap_remove(i);
                if self.rng.gen_bool(0.03) {
                    return Ok(()); // lost in transit
                }
                self.deliver(m)?;
            }
            0..=54 => self.connect(),
            55..=64 => self.touch(),
            65..=69 => self.disconnect(),
            70..=76 => {
                self.now += self.rng.gen_range(1..8);
                let now = self.now;
                for a in &mut self.auth {
                    a.a.expire(now);
                }
            }
            77..=79 => {
                // A gateway learns the current view late.
                let g = self.rng.gen_range(0..GATEWAYS);
                self.gws[g].view = self.view.clone();
            }
            80..=82 => self.leadership(),
            83 => {
                // Gateway restart: new boot id, its sessions vanish without unregister.
                let g = self.rng.gen_range(0..GATEWAYS);
                self.boots += 1;
                self.gws[g].boot_id = self.boots;
                self.gws[g].sessions.clear();
            }
            _ => self.lookup()?,
        }
        self.check()
    }

    fn connect(&mut self) {
        let g = self.rng.gen_range(0..GATEWAYS);
        let uid = self.uids[self.rng.gen_range(0..self.uids.len())].clone();
        let level = if self.rng.gen_bool(0.3) {
            DeviceLevel::Master
        } else {
            DeviceLevel::Slave
        };
        let dev = ["a", "b", "c"][self.rng.gen_range(0..3)];
        let flag = self.rng.gen_range(1..3);
        let gw = &mut self.gws[g];
        let session = gw.next_session;
        gw.next_session += 1;
        let seq = gw.next_seq;
        gw.next_seq += 1;
        let route = Route {
            uid: uid.clone(),
            device_id: dev.into(),
            device_flag: flag,
            device_level: level,
            node_id: gw.node_id,
            boot_id: gw.boot_id,
            session_id: session,
            listener: Transport::Tcp,
            owner_seq: seq,
            connected_at_ms: self.now * 1000,
            last_active_s: Some(self.now),
        };
        let target = gw.view.target_for_uid(&uid);
        gw.sessions.insert(
            session,
            Session {
                route: route.clone(),
                state: State::Registering,
            },
        );
        self.queue.push(Msg::Register {
            gw: g,
            boot: gw.boot_id,
            session,
            target,
            route,
        });
    }

    fn touch(&mut self) {
        let g = self.rng.gen_range(0..GATEWAYS);
        let now = self.now;
        let gw = &mut self.gws[g];
        let mut groups: HashMap<Target, Vec<Route>> = HashMap::new();
        let mut ids: Vec<u64> = gw.sessions.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            let s = &gw.sessions[&id];
            if s.state == State::Active {
                let mut r = s.route.clone();
                r.last_active_s = Some(now);
                groups
                    .entry(gw.view.target_for_uid(&r.uid))
                    .or_default()
                    .push(r);
            }
        }
        let mut groups: Vec<(Target, Vec<Route>)> = groups.into_iter().collect();
        groups.sort_by_key(|(t, _)| (t.hash_slot, t.leader_term));
        for (target, routes) in groups {
            self.queue.push(Msg::Touch { target, routes });
        }
    }

    fn close(&mut self, g: usize, session: u64) {
        let gw = &mut self.gws[g];
        if let Some(s) = gw.sessions.remove(&session) {
            let target = gw.view.target_for_uid(&s.route.uid);
            self.queue.push(Msg::Unregister {
                target,
                id: s.route.identity(),
                seq: s.route.owner_seq,
            });
        }
    }

    fn disconnect(&mut self) {
        let g = self.rng.gen_range(0..GATEWAYS);
        let mut ids: Vec<u64> = self.gws[g].sessions.keys().copied().collect();
        ids.sort_unstable();
        if !ids.is_empty() {
            let id = ids[self.rng.gen_range(0..ids.len())];
            self.close(g, id);
        }
    }

    fn leadership(&mut self) {
        let s = SLOTS[self.rng.gen_range(0..SLOTS.len())] as usize;
        match self.rng.gen_range(0..4) {
            0 => {
                let l = &mut self.view.slots[s];
                l.leader_term += 1;
                l.leader_node_id = AUTH_NODES[self.rng.gen_range(0..2)];
            }
            1 => self.view.config_epoch += 1,
            2 => {} // revision only
            _ => {
                let l = &mut self.view.slots[s];
                l.leader_term += 1;
                l.leader_node_id = NOBODY;
            }
        }
        self.view.revision += 1;
        let now = self.now;
        for a in &mut self.auth {
            a.a.apply_view(&self.view, a.node_id, now);
        }
    }

    fn deliver(&mut self, m: Msg) -> Result<(), String> {
        let now = self.now;
        match m {
            Msg::Register {
                gw,
                boot,
                session,
                target,
                route,
            } => {
                let res = match self.auth_mut(target.leader_node_id) {
                    None => Err(AuthorityError::NotLeader),
                    Some(a) => a.a.register_route(&target, route.clone(), now),
                };
                if res == Ok(RegisterOutcome::Active) {
                    self.seen.active_registers += 1;
                    self.created_under
                        .insert((target.leader_node_id, route.identity()), target);
                }
                self.queue.push(Msg::RegisterReply {
                    gw,
                    boot,
                    session,
                    target,
                    res,
                });
            }
            Msg::Commit {
                gw,
                boot,
                session,
                target,
                token,
            } => {
                let res = match self.auth_mut(target.leader_node_id) {
                    None => Err(AuthorityError::NotLeader),
                    Some(a) => a.a.commit_route(&target, &token, now),
                };
                if res.is_ok() {
                    self.seen.commits += 1;
                    self.created_under
                        .insert((target.leader_node_id, token.identity.clone()), target);
                }
                self.queue.push(Msg::CommitReply {
                    gw,
                    boot,
                    session,
                    res,
                });
            }
            Msg::Abort { target, token } => {
                if let Some(a) = self.auth_mut(target.leader_node_id) {
                    let _ = a.a.abort_route(&target, &token, now);
                }
            }
            Msg::Touch { target, routes } => {
                if let Some(a) = self.auth_mut(target.leader_node_id) {
                    if let Ok(res) = a.a.touch_routes(&target, &routes, now) {
                        for (r, res) in routes.iter().zip(res) {
                            if res == TouchResult::Recreated {
                                self.seen.recreated += 1;
                                self.created_under
                                    .insert((target.leader_node_id, r.identity()), target);
                            }
                        }
                    }
                }
            }
            Msg::Unregister { target, id, seq } => {
                if let Some(a) = self.auth_mut(target.leader_node_id) {
                    let _ = a.a.unregister_route(&target, &id, seq, now);
                }
            }
            Msg::RegisterReply {
                gw,
                boot,
                session,
                target,
                res,
            } => {
                if self.gws[gw].boot_id != boot {
                    return Ok(()); // the process is gone; its route expires by TTL
                }
                let alive = self.gws[gw].sessions.contains_key(&session);
                match res {
                    Ok(RegisterOutcome::Active) => {
                        if alive {
                            if let Some(s) = self.gws[gw].sessions.get_mut(&session) {
                                s.state = State::Active;
                            }
                        } else {
                            // Closed during activation: unregister (rule 30 of
                            // docs/authority-rules.md).
                            self.queue.push(Msg::Unregister {
                                target,
                                id: RouteIdentity {
                                    uid: target_uid(&self.gws[gw], session)
                                        .unwrap_or_else(|| "".into()),
                                    node_id: self.gws[gw].node_id,
                                    boot_id: boot,
                                    session_id: session,
                                },
                                seq: 0,
                            });
                        }
                    }
                    Ok(RegisterOutcome::Pending { token, actions }) => {
                        if !alive {
                            self.queue.push(Msg::Abort { target, token });
                            return Ok(());
                        }
                        // Owner actions: the owning gateways close the sessions.
                        for act in actions {
                            if let Some(og) = self.gws.iter().position(|g| {
                                g.node_id == act.route.node_id && g.boot_id == act.route.boot_id
                            }) {
                                self.close(og, act.route.session_id);
                            }
                        }
                        if let Some(s) = self.gws[gw].sessions.get_mut(&session) {
                            s.state = State::Committing;
                            self.queue.push(Msg::Commit {
                                gw,
                                boot,
                                session,
                                target,
                                token,
                            });
                        } else {
                            self.queue.push(Msg::Abort { target, token });
                        }
                    }
                    Err(_) => {
                        self.gws[gw].sessions.remove(&session);
                    }
                }
            }
            Msg::CommitReply {
                gw,
                boot,
                session,
                res,
                ..
            } => {
                if self.gws[gw].boot_id != boot {
                    return Ok(());
                }
                match res {
                    Ok(()) => {
                        // A session closed meanwhile already queued its unregister.
                        if let Some(s) = self.gws[gw].sessions.get_mut(&session) {
                            s.state = State::Active;
                        }
                    }
                    Err(_) => {
                        self.gws[gw].sessions.remove(&session);
                    }
                }
            }
        }
        Ok(())
    }

    fn lookup(&mut self) -> Result<(), String> {
        let g = self.rng.gen_range(0..GATEWAYS);
        let s = SLOTS[self.rng.gen_range(0..SLOTS.len())];
        let target = self.gws[g].view.target_for_slot(s);
        let uids: Vec<Uid> = self
            .uids
            .iter()
            .filter(|u| hash_slot(u.as_bytes()) == s)
            .cloned()
            .collect();
        for a in &self.auth {
            let res =
                a.r.endpoints_by_targets(&[(target, &uids[..])])
                    .pop()
                    .unwrap();
            if res.is_err() {
                self.seen.stale_lookups += 1;
            }
            if let Ok(eps) = res {
                self.seen.ok_lookups += 1;
                let installed = a.a.identity(s).map(|x| x.0);
                if installed != Some(target) {
                    return Err(format!(
                        "lookup answered under {target:?} by node {}, installed {installed:?}",
                        a.node_id
                    ));
                }
                let mut want: Vec<Endpoint> = Vec::new();
                let active = a.a.active_routes(s);
                for u in &uids {
                    let mut rs: Vec<&Route> = active.iter().filter(|r| r.uid == *u).collect();
                    rs.sort_by_key(|r| (r.node_id, r.boot_id, r.session_id));
                    want.extend(rs.into_iter().map(|r| Endpoint {
                        uid: r.uid.clone(),
                        device_flag: r.device_flag,
                        device_level: r.device_level,
                        node_id: r.node_id,
                        boot_id: r.boot_id,
                        session_id: r.session_id,
                        owner_seq: r.owner_seq,
                    }));
                }
                if eps != want {
                    return Err(format!(
                        "lookup differs from the directory: {eps:?} vs {want:?}"
                    ));
                }
            }
        }
        Ok(())
    }

    fn check(&self) -> Result<(), String> {
        for a in &self.auth {
            a.a.check_invariants()?;
            for s in SLOTS {
                let Some((installed, _)) = a.a.identity(s) else {
                    if a.a.counts(s) != Default::default() {
                        return Err(format!(
                            "node {} holds state of slot {s} without identity",
                            a.node_id
                        ));
                    }
                    continue;
                };
                let active = a.a.active_routes(s);
                for (i, later) in active.iter().enumerate() {
                    for earlier in &active[..i] {
                        if later.conflicts_with(earlier) {
                            return Err(format!(
                                "committed conflicting routes: {earlier:?} and {later:?}"
                            ));
                        }
                    }
                    let id = later.identity();
                    let made = self.created_under.get(&(a.node_id, id.clone()));
                    if made != Some(&installed) {
                        return Err(format!(
                            "route {id:?} on node {} was created under {made:?}, survives into {installed:?}",
                            a.node_id
                        ));
                    }
                    let f = a.a.fence(&id).ok_or("active route without fence record")?;
                    if f.tombstone.is_some_and(|t| later.owner_seq <= t) {
                        return Err(format!("route {id:?} at or below its tombstone"));
                    }
                }
            }
        }
        Ok(())
    }
}

fn target_uid(gw: &Gateway, session: u64) -> Option<Uid> {
    gw.sessions.get(&session).map(|s| s.route.uid.clone())
}

fn run(seed: u64) -> Result<Seen, String> {
    let mut sim = Sim::new(seed);
    for step in 0..STEPS {
        sim.step().map_err(|e| format!("step {step}: {e}"))?;
    }
    // Everything still in flight lands, then time passes: the directory drains.
    while !sim.queue.is_empty() {
        let m = sim.queue.swap_remove(0);
        sim.deliver(m)?;
        sim.check()?;
    }
    Ok(sim.seen)
}

#[test]
fn authority_simulation() {
    let seeds: Vec<u64> = match std::env::var("IMROUTER_SIM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        Some(s) => vec![s],
        None => {
            let n = std::env::var("IMROUTER_SIM_SEEDS")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(2000);
            (0..n).collect()
        }
    };
    let n = seeds.len();
    // Seeds in parallel (each run is independent and deterministic); the lowest
    // failing seed is reported.
    let threads = std::thread::available_parallelism()
        .map_or(1, |p| p.get())
        .min(4);
    let results: Vec<(u64, Result<Seen, String>)> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..threads)
            .map(|k| {
                let mine: Vec<u64> = seeds.iter().copied().skip(k).step_by(threads).collect();
                sc.spawn(move || mine.into_iter().map(|s| (s, run(s))).collect::<Vec<_>>())
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("simulation thread panicked"))
            .collect()
    });
    let mut total = Seen::default();
    let mut failed: Option<(u64, String)> = None;
    for (seed, r) in results {
        match r {
            Ok(s) => {
                total.active_registers += s.active_registers;
                total.commits += s.commits;
                total.recreated += s.recreated;
                total.ok_lookups += s.ok_lookups;
                total.stale_lookups += s.stale_lookups;
            }
            Err(e) => {
                if failed.as_ref().is_none_or(|(f, _)| seed < *f) {
                    failed = Some((seed, e));
                }
            }
        }
    }
    if let Some((seed, e)) = failed {
        panic!("simulation failed, seed {seed} (rerun with IMROUTER_SIM_SEED={seed}): {e}");
    }
    if n >= 10 {
        let t = total;
        assert!(
            t.active_registers > 0
                && t.commits > 0
                && t.recreated > 0
                && t.ok_lookups > 0
                && t.stale_lookups > 0,
            "the simulation did not exercise every path: {t:?}"
        );
    }
    eprintln!("simulation exercised {total:?}");
}
