//! Groups of 3 and 5 replicas in one thread, wired by a simulated network that
//! delays, drops, duplicates and reorders messages and cuts links one way or both
//! ways; each replica's writes reach its simulated disk after a random delay (an
//! fsync in flight), in order, and only then are reported durable; replicas crash
//! (a power loss: the writes not yet synced are lost, the disk stays) and restart
//! a few ticks later from their disk; leaders hand leadership over; proposals at
//! whichever replica leads. Checked at every tick:
//! - at most one leader per term (election safety);
//! - every replica commits the same entry at each index, in index order, and a
//!   committed entry never changes (log matching, leader completeness);
//! - only proposals are committed with data, each at most once, at the term and
//!   index `propose` gave it;
//! - at every crash, every committed entry is on the disks of a majority;
//! - leases (every leader starts a lease round each heartbeat): while a
//!   replica's lease holds (`lease_start + LEASE_SPAN_TICKS`, the span the node
//!   uses: `election_ticks - 1` ticks, the drift margin 0 on the simulation's
//!   one clock), no replica leads in a later term (two authorities never serve
//!   one slot at once).
//!
//! After the chaos, the network heals: a leader is elected and a proposal commits on
//! every replica within a bound. The same seed gives the same run (the trace's hash
//! is compared across two runs).
//!
//! A planted bug shows the checks bite: with `ack_before_sync`, a write is
//! reported durable as soon as it is made (a vote or an append acknowledged before
//! its fsync), and a crash loses it; the seeds catch it.
//!
//! `REPLICA_SIM_SEEDS=N` runs N seeds (default 48); a failing seed is printed and
//! replayed with `REPLICA_SIM_SEED=S`.

// A test driver: seeds come from the environment.
#![allow(clippy::disallowed_methods)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{Hash, Hasher};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::VecDeque;

use replica::{Committed, Durable, Group, GroupConfig, GroupError, Outputs, Persist, Role};

/// A lease's span in ticks (module docs): `election_ticks - 1`.
const LEASE_SPAN_TICKS: u64 = 9;

/// Ticks of chaos, then of healing.
const CHAOS_TICKS: u64 = 1_500;
const HEAL_TICKS_MAX: u64 = 400;

struct InFlight {
    at: u64,
    from: u64,
    to: u64,
    bytes: Vec<u8>,
}

/// What every replica committed, and the leaders seen per term.
#[derive(Default)]
struct Checker {
    /// The committed log: index → (term, data).
    log: BTreeMap<u64, (u64, Vec<u8>)>,
    /// Per replica, the last index it committed.
    applied: HashMap<u64, u64>,
    leaders: HashMap<u64, u64>,
    /// Proposal payloads committed so far.
    seen: HashSet<Vec<u8>>,
    /// Each proposal's term and index, as `propose` gave them.
    placed: HashMap<Vec<u8>, (u64, u64)>,
}

impl Checker {
    /// Every committed entry is on a majority of `disks` (raft commits only what a
    /// majority made durable, and never cuts a committed entry).
    fn on_a_majority(&self, disks: &[Durable]) {
        let majority = disks.len() / 2 + 1;
        for (&index, &(term, _)) in &self.log {
            let holding = (disks.iter())
                .filter(|d| {
                    d.records
                        .get(index as usize - 1)
                        .is_some_and(|r| r.term == term)
                })
                .count();
            assert!(
                holding >= majority,
                "committed entry {index} (term {term}) on {holding} disks of {}",
                disks.len()
            );
        }
    }

    fn leader(&mut self, id: u64, term: u64) {
        let first = *self.leaders.entry(term).or_insert(id);
        assert_eq!(first, id, "two leaders in term {term}: {first} and {id}");
    }

    fn committed(&mut self, id: u64, c: &Committed) {
        let last = self.applied.entry(id).or_insert(0);
        assert_eq!(
            c.index,
            *last + 1,
            "replica {id} skipped to index {}",
            c.index
        );
        *last = c.index;
        match self.log.get(&c.index) {
            Some((term, data)) => assert_eq!(
                (*term, data),
                (c.term, &c.data),
                "replica {id} committed another entry at index {}",
                c.index
            ),
            None => {
                if !c.data.is_empty() {
                    assert!(self.seen.insert(c.data.clone()), "proposal committed twice");
                    assert_eq!(
                        self.placed.get(&c.data),
                        Some(&(c.term, c.index)),
                        "a proposal committed where propose did not place it"
                    );
                }
                self.log.insert(c.index, (c.term, c.data.clone()));
            }
        }
    }
}

struct Sim {
    /// Replica `id` at `id - 1`; `None` while it is down.
    groups: Vec<Option<Group>>,
    cfgs: Vec<GroupConfig>,
    /// Per replica, the tick it restarts at while it is down.
    down_until: Vec<Option<u64>>,
    /// Per replica, its disk: what it made durable (it survives a crash).
    disks: Vec<Durable>,
    /// Per replica, its writes not yet synced, each with the tick its sync ends
    /// (in order; lost in a crash).
    syncing: Vec<VecDeque<(u64, Persist)>>,
    /// The planted bug: writes are reported durable before they are synced.
    ack_before_sync: bool,
    rng: ChaCha8Rng,
    now: u64,
    net: Vec<InFlight>,
    /// Directed links that drop everything.
    cut: HashSet<(u64, u64)>,
    checker: Checker,
    /// Crashed replicas, to restart from their disks.
    restarting: Vec<u64>,
    out: Outputs,
    trace: std::collections::hash_map::DefaultHasher,
    next_proposal: u64,
    /// The span the lease check grants (a planted bug lengthens it).
    lease_span: u64,
}

impl Sim {
    fn new(n: u64, seed: u64, ack_before_sync: bool) -> Sim {
        let voters: Vec<u64> = (1..=n).collect();
        let cfgs: Vec<GroupConfig> = (voters.iter())
            .map(|&id| GroupConfig::new(id, voters.clone(), seed.wrapping_mul(31) + id))
            .collect();
        let groups: Vec<Option<Group>> = (cfgs.iter())
            .map(|cfg| Some(Group::new(cfg).unwrap()))
            .collect();
        Sim {
            down_until: vec![None; groups.len()],
            disks: cfgs.iter().map(Group::initial).collect(),
            syncing: vec![VecDeque::new(); groups.len()],
            groups,
            cfgs,
            ack_before_sync,
            rng: ChaCha8Rng::seed_from_u64(seed),
            now: 0,
            net: Vec::new(),
            cut: HashSet::new(),
            checker: Checker::default(),
            restarting: Vec::new(),
            out: Outputs::default(),
            trace: Default::default(),
            next_proposal: 0,
            lease_span: LEASE_SPAN_TICKS,
        }
    }

    fn group(&mut self, id: u64) -> &mut Group {
        self.groups[id as usize - 1]
            .as_mut()
            .expect("replica is up")
    }

    fn up(&self, id: u64) -> bool {
        self.groups[id as usize - 1].is_some()
    }

    /// Replica `id` crashes (its writes not yet synced are lost); it restarts
    /// `down_ticks` later.
    fn crash(&mut self, id: u64, down_ticks: u64) {
        let i = id as usize - 1;
        if self.groups[i].take().is_none() {
            return;
        }
        self.syncing[i].clear();
        self.checker.on_a_majority(&self.disks);
        self.down_until[i] = Some(self.now + down_ticks);
        self.restarting.push(id);
    }

    /// Restarts the replicas whose down time is over; they replay their log.
    fn restart_due(&mut self) {
        let mut i = 0;
        while i < self.restarting.len() {
            let id = self.restarting[i];
            if self.down_until[id as usize - 1].is_some_and(|t| t > self.now) {
                i += 1;
                continue;
            }
            self.restarting.swap_remove(i);
            let (cfg, disk) = (&self.cfgs[id as usize - 1], &self.disks[id as usize - 1]);
            let g = Group::restart(cfg, disk).unwrap();
            self.groups[id as usize - 1] = Some(g);
            self.down_until[id as usize - 1] = None;
            self.checker.applied.insert(id, 0);
        }
    }

    /// Drains replica `id`: its messages onto the network, its commits checked,
    /// its writes onto its disk's queue; again while a sync ended released more.
    fn drain(&mut self, id: u64, chaos: bool) {
        loop {
            let mut out = std::mem::take(&mut self.out);
            self.group(id).drain(&mut out);
            self.queue_writes(id, &mut out, chaos);
            self.carry(id, &mut out, chaos);
            self.out = out;
            if !self.sync_due(id, chaos) {
                return;
            }
        }
    }

    /// Replica `id`'s writes, queued for its disk: each synced after a random
    /// delay during the chaos, in order. With the planted bug each is reported
    /// durable at once.
    fn queue_writes(&mut self, id: u64, out: &mut Outputs, chaos: bool) {
        let i = id as usize - 1;
        for p in std::mem::take(&mut out.persist) {
            let after = self.syncing[i].back().map_or(self.now, |(at, _)| *at);
            let delay = if chaos { self.rng.gen_range(0..3) } else { 0 };
            if self.ack_before_sync {
                self.group(id).persisted(p.number, out);
            }
            self.syncing[i].push_back((after.max(self.now + delay), p));
        }
    }

    /// Replica `id`'s writes whose sync ended: applied to its disk and reported
    /// durable; whether any was.
    fn sync_due(&mut self, id: u64, chaos: bool) -> bool {
        let i = id as usize - 1;
        let mut out = std::mem::take(&mut self.out);
        let mut any = false;
        while self.syncing[i]
            .front()
            .is_some_and(|(at, _)| *at <= self.now)
        {
            let Some((_, p)) = self.syncing[i].pop_front() else {
                break;
            };
            self.disks[i].apply(&p);
            if !self.ack_before_sync {
                self.group(id).persisted(p.number, &mut out);
            }
            any = true;
        }
        self.carry(id, &mut out, chaos);
        self.out = out;
        any
    }

    /// Replica `id`'s outputs: commits checked, messages onto the network.
    fn carry(&mut self, id: u64, out: &mut Outputs, chaos: bool) {
        for c in out.committed.drain(..) {
            c.index.hash(&mut self.trace);
            self.checker.committed(id, &c);
        }
        for (to, bytes) in out.messages.drain(..) {
            bytes.hash(&mut self.trace);
            if self.cut.contains(&(id, to)) || (chaos && self.rng.gen_bool(0.05)) {
                continue;
            }
            let copies = if chaos && self.rng.gen_bool(0.02) {
                2
            } else {
                1
            };
            for _ in 0..copies {
                let delay = if chaos { self.rng.gen_range(0..4) } else { 0 };
                let at = self.now + delay;
                let bytes = bytes.clone();
                self.net.push(InFlight {
                    at,
                    from: id,
                    to,
                    bytes,
                });
            }
        }
    }

    /// One tick: every replica ticks and drains; the messages due are delivered in
    /// a random order; leaders are checked.
    fn tick(&mut self, chaos: bool) {
        self.now += 1;
        self.restart_due();
        let n = self.groups.len() as u64;
        for id in 1..=n {
            if !self.up(id) {
                continue;
            }
            self.group(id).tick();
            if self.now.is_multiple_of(2) {
                let now = self.now;
                self.group(id).renew_lease(now);
            }
            self.drain(id, chaos);
        }
        let mut due = Vec::new();
        let mut i = 0;
        while i < self.net.len() {
            if self.net[i].at <= self.now {
                due.push(self.net.swap_remove(i));
            } else {
                i += 1;
            }
        }
        // Reordered: delivered in a shuffled order.
        for k in (1..due.len()).rev() {
            let j = self.rng.gen_range(0..=k);
            due.swap(k, j);
        }
        for m in due {
            if self.cut.contains(&(m.from, m.to)) || !self.up(m.to) {
                continue;
            }
            match self.group(m.to).step(m.from, &m.bytes) {
                Ok(()) | Err(GroupError::Raft(_)) => {}
                Err(e) => panic!("replica {} refused {}'s message: {e}", m.to, m.from),
            }
            self.drain(m.to, chaos);
        }
        for g in self.groups.iter().flatten() {
            if g.role() == Role::Leader {
                self.checker.leader(g.id(), g.term());
            }
        }
        self.check_leases();
    }

    /// No replica leads in a later term than a replica whose lease holds.
    fn check_leases(&self) {
        let up = || self.groups.iter().flatten();
        for g in up() {
            let Some(start) = g.lease_start() else {
                continue;
            };
            if self.now >= start + self.lease_span {
                continue;
            }
            if let Some(newer) = up().find(|n| n.role() == Role::Leader && n.term() > g.term()) {
                panic!(
                    "two authorities at tick {}: {} holds its lease of term {} from tick \
                     {start}, {} leads term {}",
                    self.now,
                    g.id(),
                    g.term(),
                    newer.id(),
                    newer.term()
                );
            }
        }
    }

    fn leader(&self) -> Option<u64> {
        let max_term = self.groups.iter().flatten().map(Group::term).max()?;
        (self.groups.iter().flatten())
            .find(|g| g.role() == Role::Leader && g.term() == max_term)
            .map(Group::id)
    }

    /// Proposes a new payload at every replica that thinks it leads.
    fn propose(&mut self) {
        let n = self.groups.len() as u64;
        for id in 1..=n {
            if !self.up(id) || self.group(id).role() != Role::Leader {
                continue;
            }
            self.next_proposal += 1;
            let data = format!("p{}", self.next_proposal).into_bytes();
            match self.group(id).propose(data.clone()) {
                Ok(placed) => {
                    self.checker.placed.insert(data, placed);
                }
                Err(GroupError::Dropped) => {}
                Err(e) => panic!("leader {id} refused a proposal: {e}"),
            }
            self.drain(id, true);
        }
    }

    /// A planned leader change: the leader hands leadership to a random replica.
    fn transfer(&mut self) {
        let Some(leader) = self.leader() else {
            return;
        };
        let to = self.rng.gen_range(1..=self.groups.len() as u64);
        self.group(leader).transfer_leader(to);
        self.drain(leader, true);
    }

    /// Cuts or heals links at random: one node off both ways, one way, or healed.
    fn weather(&mut self) {
        let n = self.groups.len() as u64;
        match self.rng.gen_range(0..3) {
            0 => self.cut.clear(),
            1 => {
                let x = self.rng.gen_range(1..=n);
                for y in (1..=n).filter(|&y| y != x) {
                    self.cut.insert((x, y));
                    self.cut.insert((y, x));
                }
            }
            _ => {
                let (x, y) = (self.rng.gen_range(1..=n), self.rng.gen_range(1..=n));
                if x != y {
                    self.cut.insert((x, y));
                }
            }
        }
    }

    /// The whole run; returns the trace's hash.
    fn run(mut self) -> u64 {
        for _ in 0..CHAOS_TICKS {
            self.tick(true);
            if self.rng.gen_bool(0.2) {
                self.propose();
            }
            if self.rng.gen_bool(0.01) {
                self.weather();
            }
            if self.rng.gen_bool(0.005) {
                self.transfer();
            }
            if self.rng.gen_bool(0.004) {
                let id = self.rng.gen_range(1..=self.groups.len() as u64);
                let down_ticks = self.rng.gen_range(0..30);
                self.crash(id, down_ticks);
            }
        }
        // Healed: every replica up, a leader within the bound, then one proposal
        // on every replica.
        self.cut.clear();
        for until in self.down_until.iter_mut().flatten() {
            *until = self.now;
        }
        let mut leader = None;
        for _ in 0..HEAL_TICKS_MAX {
            self.tick(false);
            leader = self.leader();
            if leader.is_some() {
                break;
            }
        }
        let leader = leader.expect("a leader within the bound after healing");
        let want = format!("final{}", self.next_proposal).into_bytes();
        let mut proposed = false;
        for _ in 0..HEAL_TICKS_MAX {
            if !proposed {
                // A leader handing over drops proposals: asked again each tick.
                let leader = self.leader().unwrap_or(leader);
                match self.group(leader).propose(want.clone()) {
                    Ok(placed) => {
                        self.checker.placed.insert(want.clone(), placed);
                        proposed = true;
                    }
                    Err(GroupError::Dropped | GroupError::NotLeader { .. }) => {}
                    Err(e) => panic!("the final proposal was refused: {e}"),
                }
                self.drain(leader, false);
            }
            self.tick(false);
            let everywhere = (self.checker.log.values()).any(|(_, d)| *d == want)
                && (self.checker.applied.values().copied().min())
                    >= self.checker.log.keys().last().copied()
                && self.checker.applied.len() == self.groups.len();
            if everywhere {
                return self.trace.finish();
            }
        }
        panic!("the final proposal did not commit on every replica");
    }
}

/// Prints the seed of a failing run.
struct SeedGuard(u64, u64);

impl Drop for SeedGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "failing run: {} replicas, REPLICA_SIM_SEED={} cargo test -p replica --test sim",
                self.0, self.1
            );
        }
    }
}

fn seeds() -> Vec<u64> {
    if let Ok(s) = std::env::var("REPLICA_SIM_SEED") {
        return vec![s.parse().expect("REPLICA_SIM_SEED is a number")];
    }
    let n = std::env::var("REPLICA_SIM_SEEDS").map_or(48, |s| s.parse().expect("a number"));
    (1..=n).collect()
}

#[test]
fn groups_of_three_and_five_stay_safe_and_recover_under_a_bad_network() {
    for seed in seeds() {
        for n in [3, 5] {
            let _guard = SeedGuard(n, seed);
            Sim::new(n, seed, false).run();
        }
    }
}

/// The same seed replays the same run: no randomness but the seed's (raft-rs's own
/// `thread_rng` draws are overridden).
#[test]
fn a_seed_replays_its_run() {
    for seed in [7, 8] {
        let _guard = SeedGuard(3, seed);
        assert_eq!(
            Sim::new(3, seed, false).run(),
            Sim::new(3, seed, false).run()
        );
    }
}

/// The planted bug (writes reported durable before their sync, lost in a crash)
/// is caught within the seeds: raft-rs's own assertions (a follower whose log
/// went back below what it acknowledged) or our checks (two leaders in a term, a
/// committed entry changed or skipped, one on a minority of disks). Today 43 of
/// 96 seeds, 15 of them by our checks (commits are not broadcast on their own,
/// so fewer messages meet the plant than when they were: 11 of the first 48).
#[test]
fn acks_before_sync_are_caught() {
    let (mut caught, mut by_our_checks) = (0, 0);
    for seed in 1..=96u64 {
        let Err(e) = std::panic::catch_unwind(|| Sim::new(3, seed, true).run()) else {
            continue;
        };
        caught += 1;
        let text = (e.downcast_ref::<String>().map(String::as_str))
            .or_else(|| e.downcast_ref::<&str>().copied())
            .unwrap_or("");
        eprintln!("seed {seed}: {}", text.lines().next().unwrap_or(""));
        by_our_checks += usize::from(
            text.contains("two leaders in term")
                || text.contains("committed another entry")
                || text.contains("skipped to index")
                || text.contains("disks of"),
        );
    }
    eprintln!("caught {caught} of 96, {by_our_checks} by our checks");
    assert!(
        caught >= 12,
        "only {caught} of 96 seeds caught acks before sync"
    );
    assert!(by_our_checks > 0, "the checks caught none of the {caught}");
}

/// On a quiet network, a leader holding a lease is cut off from both others
/// `offset` ticks after its lease began, and ticks on (it steps down at its next
/// check-quorum) while the others elect a new leader; the lease check runs at
/// every tick. Whether it caught two authorities.
fn isolate_a_leased_leader(seed: u64, offset: u64, lease_span: u64) -> bool {
    let mut sim = Sim::new(3, seed, false);
    sim.lease_span = lease_span;
    let mut leased = None;
    for _ in 0..HEAL_TICKS_MAX {
        sim.tick(false);
        leased = sim
            .leader()
            .filter(|&l| sim.group(l).lease_start().is_some());
        if leased.is_some() {
            break;
        }
    }
    let l = leased.expect("a leader with a lease on a quiet network");
    for _ in 0..offset {
        sim.tick(false);
    }
    for y in (1..=3).filter(|&y| y != l) {
        sim.cut.insert((l, y));
        sim.cut.insert((y, l));
    }
    let run = std::panic::AssertUnwindSafe(|| {
        for _ in 0..HEAL_TICKS_MAX {
            sim.tick(false);
            if sim.leader().is_some_and(|n| n != l) {
                return;
            }
        }
        panic!("the others elected no leader");
    });
    match std::panic::catch_unwind(run) {
        Ok(()) => false,
        Err(e) => {
            let text = (e.downcast_ref::<String>().map(String::as_str))
                .or_else(|| e.downcast_ref::<&str>().copied())
                .unwrap_or("");
            assert!(text.contains("two authorities"), "seed {seed}: {text}");
            true
        }
    }
}

/// A leader cut off at every phase of its lease and of its check-quorum: with
/// the node's span, its lease always ends before the others elect a leader;
/// with the planted bug (a span of two election timeouts) the check catches a
/// leader still holding its lease after the others elected one.
#[test]
fn a_leader_cut_off_loses_its_lease_before_another_is_elected() {
    let mut planted = 0;
    for seed in 1..=4u64 {
        for offset in 0..12 {
            let _guard = SeedGuard(3, seed);
            assert!(!isolate_a_leased_leader(seed, offset, LEASE_SPAN_TICKS));
            planted += usize::from(isolate_a_leased_leader(seed, offset, 20));
        }
    }
    eprintln!("the planted span caught in {planted} of 48 cuts");
    assert!(
        planted > 0,
        "the lease check never caught a span of 20 ticks"
    );
}

/// The checker is not vacuous: two leaders in one term, and another entry at a
/// committed index, are caught.
#[test]
#[should_panic(expected = "two leaders in term 4")]
fn two_leaders_in_one_term_are_caught() {
    let mut c = Checker::default();
    c.leader(1, 4);
    c.leader(2, 4);
}

#[test]
#[should_panic(expected = "committed entry 1 (term 2) on 1 disks of 3")]
fn a_committed_entry_on_a_minority_of_disks_is_caught() {
    let mut c = Checker::default();
    c.log.insert(1, (2, Vec::new()));
    let disk = |term| Durable {
        records: vec![replica::Record {
            index: 1,
            term,
            kind: replica::RecordKind::Normal,
            data: Vec::new(),
        }],
        ..Durable::default()
    };
    c.on_a_majority(&[disk(2), disk(1), Durable::default()]);
}

#[test]
#[should_panic(expected = "committed another entry at index 1")]
fn a_changed_committed_entry_is_caught() {
    let mut c = Checker::default();
    let e = |term, data: &[u8]| Committed {
        index: 1,
        term,
        data: data.to_vec(),
    };
    c.placed.insert(b"a".to_vec(), (1, 1));
    c.committed(1, &e(1, b"a"));
    c.committed(2, &e(1, b"b"));
}

#[test]
#[should_panic(expected = "committed where propose did not place it")]
fn a_proposal_committed_elsewhere_is_caught() {
    let mut c = Checker::default();
    c.placed.insert(b"a".to_vec(), (1, 2));
    c.committed(
        1,
        &Committed {
            index: 1,
            term: 1,
            data: b"a".to_vec(),
        },
    );
}

#[test]
#[should_panic(expected = "skipped to index 3")]
fn a_skipped_index_is_caught() {
    let mut c = Checker::default();
    let e = |index| Committed {
        index,
        term: 1,
        data: Vec::new(),
    };
    c.committed(1, &e(1));
    c.committed(1, &e(3));
}
