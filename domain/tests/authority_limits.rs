//! The authority's configured limits at and past their edge, with small limits (the
//! defaults are too large for the other tests to reach), calls that carry half a
//! token or a view of the same revision, and what the writer reports of itself
//! (counters, refused claims, its configuration, a full scan, its end).

use domain::cluster::{ClusterView, HashSlot, Target};
use domain::presence::authority::{
    Authority, AuthorityConfig, AuthorityReader, ClaimError, ConfigError, Directory, TouchCounts,
    TouchResult,
};
use domain::presence::route::{
    AuthorityError, DeviceLevel, PendingToken, RegisterOutcome, Route, Transport, Uid,
};
use slots::{hash_slot, HASH_SLOTS};

const NODE: u64 = 1;
const T0: u64 = 1000;
const SLOT: HashSlot = 7;

/// The default configuration with these route and candidate limits per slot.
fn limits(routes_max: usize, pending_max: usize) -> AuthorityConfig {
    AuthorityConfig {
        routes_per_slot_max: routes_max,
        pending_per_slot_max: pending_max,
        fence_records_per_slot_max: 64.max(routes_max + pending_max),
        ..AuthorityConfig::default()
    }
}

fn setup(routes_max: usize, pending_max: usize) -> (Authority, Target) {
    setup_with(limits(routes_max, pending_max))
}

/// A writer of every hash slot, `SLOT`'s target installed.
fn setup_with(cfg: AuthorityConfig) -> (Authority, Target) {
    let dir = Directory::new(&cfg).unwrap();
    let slots: Vec<HashSlot> = (0..HASH_SLOTS as HashSlot).collect();
    let mut a = Authority::new(cfg, &dir, &slots).unwrap();
    let view = ClusterView::single_node(NODE);
    assert!(a.apply_view(&view, NODE, T0));
    (a, view.target_for_slot(SLOT))
}

/// The `n`-th uid that hashes to `SLOT`.
fn uid(n: usize) -> Uid {
    (0..)
        .map(|i| format!("u{i}"))
        .filter(|u| hash_slot(u.as_bytes()) == SLOT)
        .nth(n)
        .map(Uid::from)
        .unwrap()
}

/// A Master route of `uid`'s device `dev` (device flag 1), session `session`.
fn master(uid: &Uid, dev: &str, session: u64, seq: u64) -> Route {
    Route {
        uid: uid.clone(),
        device_id: dev.into(),
        device_flag: 1,
        device_level: DeviceLevel::Master,
        node_id: 2,
        boot_id: 77,
        session_id: session,
        listener: Transport::Tcp,
        owner_seq: seq,
        connected_at_ms: 0,
        last_active_s: Some(T0),
    }
}

fn token(o: RegisterOutcome) -> PendingToken {
    match o {
        RegisterOutcome::Pending { token, .. } => token,
        RegisterOutcome::Active => panic!("expected a pending candidate"),
    }
}

/// Registers `uid`'s device "a" (session 1, active) and then its device "b" (session
/// 2, pending behind it); returns the candidate's token.
fn active_and_candidate(a: &mut Authority, t: &Target, uid: &Uid) -> PendingToken {
    assert_eq!(
        a.register_route(t, master(uid, "a", 1, 1), T0),
        Ok(RegisterOutcome::Active)
    );
    token(a.register_route(t, master(uid, "b", 2, 1), T0).unwrap())
}

#[test]
fn max_routes_per_slot_is_reached_and_not_passed() {
    let (mut a, t) = setup(2, 4);
    for n in 0..2 {
        assert_eq!(
            a.register_route(&t, master(&uid(n), "a", 1, 1), T0),
            Ok(RegisterOutcome::Active)
        );
    }
    assert_eq!(
        a.register_route(&t, master(&uid(2), "a", 1, 1), T0),
        Err(AuthorityError::Full)
    );
    // Nor does a touch recreate a third (its record would fit).
    assert_eq!(
        a.touch_routes(&t, &[master(&uid(2), "a", 1, 1)], T0),
        Ok(vec![TouchResult::Full])
    );
    assert_eq!(a.counts(SLOT).active_routes, 2);
    // A route that replaces its own session's route takes no new room.
    assert_eq!(
        a.register_route(&t, master(&uid(0), "a", 1, 2), T0),
        Ok(RegisterOutcome::Active)
    );
    assert_eq!(a.counts(SLOT).active_routes, 2);
    a.check_invariants().unwrap();
}

#[test]
fn a_commit_that_replaces_its_conflicts_fits_at_the_route_limit() {
    // Two routes at a limit of two: a candidate that replaces one of them commits
    // (2 - 1 + 1 routes).
    let (mut a, t) = setup(2, 4);
    let u0 = uid(0);
    assert_eq!(
        a.register_route(&t, master(&uid(1), "a", 1, 1), T0),
        Ok(RegisterOutcome::Active)
    );
    let tok = active_and_candidate(&mut a, &t, &u0);
    assert_eq!(a.counts(SLOT).active_routes, 2);
    assert_eq!(a.commit_route(&t, &tok, T0), Ok(()));
    assert_eq!(a.counts(SLOT).active_routes, 2);
    assert_eq!(a.route(&tok.identity).map(|r| r.session_id), Some(2));
    a.check_invariants().unwrap();
}

#[test]
fn a_commit_that_adds_a_route_past_the_limit_is_refused_and_changes_nothing() {
    // The candidate's conflict went away (unregistered) and two other routes filled
    // the slot: its commit would make a third route.
    let (mut a, t) = setup(2, 4);
    let u0 = uid(0);
    let tok = active_and_candidate(&mut a, &t, &u0);
    let old = master(&u0, "a", 1, 1).identity();
    assert_eq!(a.unregister_route(&t, &old, 1, T0), Ok(true));
    for n in 1..3 {
        assert_eq!(
            a.register_route(&t, master(&uid(n), "a", 1, 1), T0),
            Ok(RegisterOutcome::Active)
        );
    }
    assert_eq!(a.commit_route(&t, &tok, T0), Err(AuthorityError::Full));
    assert_eq!(a.counts(SLOT).active_routes, 2);
    assert!(a.has_pending(&tok.identity), "the candidate stays");
    a.check_invariants().unwrap();
}

#[test]
fn max_pending_per_slot_is_reached_and_not_passed() {
    let (mut a, t) = setup(8, 2);
    let tokens: Vec<PendingToken> = (0..2)
        .map(|n| active_and_candidate(&mut a, &t, &uid(n)))
        .collect();
    assert_eq!(a.counts(SLOT).pending, 2);
    // A third candidate does not fit.
    let u2 = uid(2);
    assert_eq!(
        a.register_route(&t, master(&u2, "a", 1, 1), T0),
        Ok(RegisterOutcome::Active)
    );
    assert_eq!(
        a.register_route(&t, master(&u2, "b", 2, 1), T0),
        Err(AuthorityError::Full)
    );
    // A newer registration of an identity that has a candidate replaces it: no new
    // room needed.
    let renewed = token(
        a.register_route(&t, master(&uid(0), "b", 2, 2), T0)
            .unwrap(),
    );
    assert!(renewed.nonce > tokens[0].nonce);
    assert_eq!(a.counts(SLOT).pending, 2);
    assert_eq!(a.commit_route(&t, &renewed, T0), Ok(()));
    assert_eq!(a.counts(SLOT).pending, 1);
    a.check_invariants().unwrap();
}

/// Two tokens that match half of `tok`: its nonce with another owner_seq, and its
/// owner_seq with a later nonce. Neither names `tok`'s candidate.
fn halves(tok: &PendingToken) -> [PendingToken; 2] {
    let mut other_seq = tok.clone();
    other_seq.owner_seq += 1;
    let mut other_nonce = tok.clone();
    other_nonce.nonce += 1;
    [other_seq, other_nonce]
}

#[test]
fn an_abort_must_match_the_whole_token() {
    let (mut a, t) = setup(8, 4);
    let tok = active_and_candidate(&mut a, &t, &uid(0));
    for half in halves(&tok) {
        assert_eq!(a.abort_route(&t, &half, T0), Ok(()));
        assert!(
            a.has_pending(&tok.identity),
            "{half:?} aborted the candidate"
        );
    }
    assert_eq!(a.abort_route(&t, &tok, T0), Ok(()));
    assert!(!a.has_pending(&tok.identity));
    a.check_invariants().unwrap();
}

#[test]
fn a_commit_must_match_the_whole_token() {
    let (mut a, t) = setup(8, 4);
    let tok = active_and_candidate(&mut a, &t, &uid(0));
    // Neither half is this candidate, and neither commits it.
    for half in halves(&tok) {
        assert_eq!(
            a.commit_route(&t, &half, T0),
            Err(AuthorityError::NotReady),
            "{half:?}"
        );
        assert!(a.has_pending(&tok.identity), "{half:?} took the candidate");
        assert_eq!(a.route(&tok.identity), None, "{half:?} committed it");
    }
    assert_eq!(a.commit_route(&t, &tok, T0), Ok(()));
    assert_eq!(a.route(&tok.identity).map(|r| r.session_id), Some(2));
    a.check_invariants().unwrap();
}

#[test]
fn a_view_of_the_same_revision_is_applied() {
    // Two views of one revision can differ (the cluster breaks the tie between them
    // and hands the winner to every shard): the authority applies what it is given
    // unless it is older.
    let (mut a, _) = setup(8, 4);
    let mut view = ClusterView::single_node(NODE);
    view.slots[SLOT as usize].leader_node_id = 2;
    assert_eq!(view.revision, ClusterView::single_node(NODE).revision);
    assert!(a.apply_view(&view, NODE, T0));
    assert_eq!(a.identity(SLOT), None, "the slot moved away");
    assert!(a.identity(SLOT + 1).is_some(), "the others stay");
    let mut older = ClusterView::single_node(NODE);
    view.revision += 1;
    assert!(a.apply_view(&view, NODE, T0));
    older.revision = view.revision - 1;
    assert!(!a.apply_view(&older, NODE, T0), "an older view is refused");
    assert_eq!(a.identity(SLOT), None);
}

#[test]
fn expiry_counters_count_what_expired_and_what_was_visited() {
    // The counters /metrics exports: one candidate expires at its pending TTL, then
    // two routes at their route TTL, then their fence records at their retention.
    let (mut a, t) = setup(8, 4);
    let cfg = AuthorityConfig::default();
    let tok = active_and_candidate(&mut a, &t, &uid(0));
    assert_eq!(
        a.register_route(&t, master(&uid(1), "a", 1, 1), T0),
        Ok(RegisterOutcome::Active)
    );
    let zero = a.stats();
    assert_eq!(
        (
            zero.pending_expired,
            zero.routes_expired,
            zero.expiry_entries_visited
        ),
        (0, 0, 0)
    );

    let pending_due = T0 + cfg.pending_ttl_s + 1;
    assert_eq!(a.expire(pending_due - 1), 0);
    assert_eq!(a.stats().pending_expired, 0, "not before its deadline");
    assert_eq!(a.wheel_stats().fired, 0);
    assert_eq!(a.expire(pending_due), 0);
    let s = a.stats();
    assert_eq!((s.pending_expired, s.routes_expired), (1, 0));
    assert!(!a.has_pending(&tok.identity));
    assert_eq!(a.wheel_stats().fired, 1, "the candidate's timer");
    assert!(s.expiry_buckets_visited >= 1 && s.expiry_entries_visited >= 1);
    // A pass with nothing due visits nothing.
    assert_eq!(a.expire(pending_due), 0);
    assert_eq!(a.stats(), s);

    let route_due = T0 + cfg.route_ttl_s + 1;
    assert_eq!(a.expire(route_due), 2);
    let s2 = a.stats();
    assert_eq!(
        (
            s2.pending_expired,
            s2.routes_expired,
            s2.fence_records_dropped
        ),
        (1, 2, 0)
    );
    assert!(s2.expiry_entries_visited >= s.expiry_entries_visited + 2);
    assert!(s2.expiry_buckets_visited > s.expiry_buckets_visited);
    assert_eq!(a.wheel_stats().fired, 3, "the candidate's and both routes'");

    // Three identities' fence records (the expired candidate's too) go at the end
    // of their retention.
    assert_eq!(a.expire(route_due + cfg.fence_retention_s + 1), 0);
    assert_eq!(a.stats().fence_records_dropped, 3);
    assert_eq!(a.counts(SLOT), Default::default());
    a.check_invariants().unwrap();
}

/// The expiry counters of `stats` (cumulative) against the work counters of the
/// slots' current rings and wheels (`wheel_stats`): `(buckets, entries)` of each.
fn visits(a: &Authority) -> [(u64, u64); 2] {
    let (s, w) = (a.stats(), a.wheel_stats());
    [
        (s.expiry_buckets_visited, s.expiry_entries_visited),
        (w.buckets_visited, w.entries_visited),
    ]
}

#[test]
fn the_expiry_counters_add_up_the_work_of_every_ring_and_wheel() {
    // No slot is installed again, so the writer's cumulative counters are the sum
    // of its rings' and wheels' own: after each pass, with ring entries (routes,
    // fence records) and wheel entries (candidates) due in one pass, on counts
    // that are no longer zero, and with only ring entries due.
    let (mut a, t) = setup(8, 4);
    let cfg = AuthorityConfig::default();
    let mut now = T0;
    for n in 0..3 {
        let u = uid(n);
        let mut first = master(&u, "a", 1, 1);
        first.last_active_s = Some(now);
        assert_eq!(
            a.register_route(&t, first, now),
            Ok(RegisterOutcome::Active)
        );
        let mut second = master(&u, "b", 2, 1);
        second.last_active_s = Some(now);
        token(a.register_route(&t, second, now).unwrap());
        let [before, _] = visits(&a);
        now += cfg.route_ttl_s + 1;
        assert_eq!(a.expire(now), 1, "round {n}: the route");
        let s = a.stats();
        assert_eq!(s.pending_expired, n as u64 + 1, "round {n}: the candidate");
        let [after, parts] = visits(&a);
        assert_eq!(after, parts, "round {n}");
        assert!(
            after.0 >= before.0 + 2 && after.1 >= before.1 + 2,
            "round {n}"
        );
    }
    // The fence records' retention: ring entries only.
    let [before, _] = visits(&a);
    assert_eq!(a.expire(now + cfg.fence_retention_s + 1), 0);
    assert_eq!(a.stats().fence_records_dropped, 6);
    let [after, parts] = visits(&a);
    assert_eq!(after, parts);
    assert!(after.1 >= before.1 + 6);
    a.check_invariants().unwrap();
}

/// A Slave route of `uid`'s device `dev` (device flag 1): it conflicts only with
/// routes of the same device.
fn slave(uid: &Uid, dev: &str, session: u64, seq: u64) -> Route {
    Route {
        device_level: DeviceLevel::Slave,
        ..master(uid, dev, session, seq)
    }
}

#[test]
fn an_existing_record_takes_its_route_again_at_the_record_limits() {
    // A registration or touch that needs a new record is refused at the uid's and
    // at the slot's record limit; one of a session that already has its record
    // needs no room, at either limit.
    let cfg = AuthorityConfig {
        routes_per_slot_max: 4,
        pending_per_slot_max: 2,
        fence_records_per_slot_max: 6,
        records_per_uid_max: 2,
        ..AuthorityConfig::default()
    };
    let dir = Directory::new(&cfg).unwrap();
    let mut a = Authority::new(cfg, &dir, &[SLOT]).unwrap();
    let view = ClusterView::single_node(NODE);
    assert!(a.apply_view(&view, NODE, T0));
    let t = view.target_for_slot(SLOT);

    // The uid's limit: two records of uid 0.
    let u0 = uid(0);
    for (dev, session) in [("a", 1), ("b", 2)] {
        assert_eq!(
            a.register_route(&t, slave(&u0, dev, session, 1), T0),
            Ok(RegisterOutcome::Active)
        );
    }
    assert_eq!(
        a.register_route(&t, slave(&u0, "c", 3, 1), T0),
        Err(AuthorityError::Full)
    );
    assert_eq!(
        a.touch_routes(&t, &[slave(&u0, "c", 3, 1)], T0),
        Ok(vec![TouchResult::Full])
    );
    assert_eq!(
        a.register_route(&t, slave(&u0, "a", 1, 2), T0),
        Ok(RegisterOutcome::Active),
        "session 1 has its record"
    );

    // The slot's limit: six records (uid 0's two, uids 1 and 2 unregistered, uids
    // 3 and 4 active), four routes.
    for n in 1..5 {
        let r = slave(&uid(n), "a", 1, 1);
        assert_eq!(
            a.register_route(&t, r.clone(), T0),
            Ok(RegisterOutcome::Active)
        );
        if n < 3 {
            assert_eq!(a.unregister_route(&t, &r.identity(), 1, T0), Ok(true));
        }
    }
    assert_eq!(a.counts(SLOT).fence_records, 6);
    assert_eq!(a.counts(SLOT).active_routes, 4);
    assert_eq!(
        a.register_route(&t, slave(&uid(5), "a", 1, 1), T0),
        Err(AuthorityError::Full)
    );
    assert_eq!(
        a.register_route(&t, slave(&uid(4), "a", 1, 2), T0),
        Ok(RegisterOutcome::Active),
        "uid 4's session 1 has its record"
    );
    assert_eq!(a.counts(SLOT).fence_records, 6);
    a.check_invariants().unwrap();
}

#[test]
fn a_refused_claim_says_why() {
    // The three ways `Authority::new` refuses its hash slots, and what a log of the
    // error prints.
    let cfg = AuthorityConfig::default();
    let dir = Directory::new(&cfg).unwrap();
    let _first = Authority::new(cfg.clone(), &dir, &[SLOT]).unwrap();
    let e = Authority::new(cfg.clone(), &dir, &[SLOT]).err().unwrap();
    assert_eq!(e, ClaimError::AlreadyClaimed(SLOT));
    assert_eq!(
        e.to_string(),
        format!("hash slot {SLOT} already has a writer")
    );
    let bad = HASH_SLOTS as HashSlot;
    let e = Authority::new(cfg.clone(), &dir, &[bad]).err().unwrap();
    assert_eq!(e, ClaimError::BadSlot(bad));
    assert_eq!(e.to_string(), format!("hash slot {bad} out of range"));
    let zero = AuthorityConfig {
        route_ttl_s: 0,
        ..cfg
    };
    let e = Authority::new(zero, &dir, &[SLOT + 1]).err().unwrap();
    assert_eq!(e, ClaimError::Config(ConfigError::Zero("route_ttl_s")));
    assert_eq!(
        e.to_string(),
        "authority config: route_ttl_s must be at least 1"
    );
}

/// A route of `uid` (device "a", session `session`) last active at `at`.
fn active_at(uid: &Uid, session: u64, at: Option<u64>) -> Route {
    Route {
        last_active_s: at,
        ..master(uid, "a", session, 1)
    }
}

#[test]
fn a_touch_batch_counts_each_answer_and_is_bounded_by_its_limit() {
    let cfg = AuthorityConfig {
        touch_batch_routes_max: 5,
        ..limits(2, 4)
    };
    let (mut a, t) = setup_with(cfg);
    let known = master(&uid(0), "a", 1, 2);
    assert_eq!(
        a.register_route(&t, known.clone(), T0),
        Ok(RegisterOutcome::Active)
    );
    let stale = Route {
        owner_seq: 1,
        ..known.clone()
    };
    let elsewhere = (0..)
        .map(|i| Uid::from(format!("w{i}")))
        .find(|u| hash_slot(u.as_bytes()) != SLOT)
        .unwrap();
    // At the limit (5 routes): refreshed, recreated, full (the slot holds 2 routes
    // by then), and two ignored (a stale owner_seq, another slot's uid).
    let batch = [
        known.clone(),
        master(&uid(1), "a", 3, 1),
        master(&uid(2), "a", 4, 1),
        stale,
        master(&elsewhere, "a", 5, 1),
    ];
    let mut out = Vec::new();
    let counts = a.touch_routes_into(&t, &batch, T0 + 1, &mut out);
    use TouchResult::*;
    assert_eq!(
        out,
        [Refreshed, Recreated, Full, IgnoredStaleSeq, WrongSlot]
    );
    assert_eq!(
        counts,
        Ok(TouchCounts {
            refreshed: 1,
            recreated: 1,
            ignored: 2,
            full: 1,
        })
    );
    // One route past the limit: the whole call is refused, nothing is touched.
    let mut past = batch.to_vec();
    past[0].last_active_s = Some(T0 + 2);
    past.push(master(&uid(3), "a", 6, 1));
    out.clear();
    assert_eq!(
        a.touch_routes_into(&t, &past, T0 + 2, &mut out),
        Err(AuthorityError::Full)
    );
    assert!(out.is_empty());
    assert_eq!(a.route(&known.identity()).unwrap().last_active_s, Some(T0));
    a.check_invariants().unwrap();
}

#[test]
fn a_full_scan_counts_the_routes_an_expiry_pass_would_expire() {
    // The bench baseline the expiry rings avoid: routes last active at T0 and
    // T0 + 10, and one without activity time (never due).
    let (mut a, t) = setup(8, 4);
    let ttl = a.config().route_ttl_s;
    for (n, at) in [Some(T0), Some(T0 + 10), None].into_iter().enumerate() {
        assert_eq!(
            a.register_route(&t, active_at(&uid(n), 1, at), T0 + 10),
            Ok(RegisterOutcome::Active)
        );
    }
    // Due once the activity plus the TTL is before now.
    let due = T0 + ttl + 1;
    assert_eq!(a.full_scan_due(due - 1), 0);
    assert_eq!(a.full_scan_due(due), 1);
    assert_eq!(a.full_scan_due(due + 9), 1);
    assert_eq!(a.full_scan_due(due + 10), 2);
    assert_eq!(a.expire(due), 1, "the pass agrees");
    assert_eq!(a.full_scan_due(due + 10), 1, "what is left");
}

#[test]
fn the_writer_answers_with_its_configuration() {
    let cfg = AuthorityConfig {
        route_ttl_s: 77,
        touch_batch_routes_max: 9,
        ..limits(8, 4)
    };
    let (a, _) = setup_with(cfg.clone());
    assert_eq!(a.config(), &cfg);
}

#[test]
fn presence_filter_rebuilds_are_counted_in_the_stats() {
    // A slot's filter sized for few routes is rebuilt as routes come.
    let cfg = AuthorityConfig {
        initial_buckets_per_slot: 4,
        ..limits(256, 4)
    };
    let (mut a, t) = setup_with(cfg);
    let before = a.stats().filter_rebuilds;
    let uids = (0..)
        .map(|i| Uid::from(format!("u{i}")))
        .filter(|u| hash_slot(u.as_bytes()) == SLOT)
        .take(200);
    for u in uids {
        assert_eq!(
            a.register_route(&t, master(&u, "a", 1, 1), T0),
            Ok(RegisterOutcome::Active)
        );
    }
    assert!(a.stats().filter_rebuilds > before, "{:?}", a.stats());
}

#[test]
fn a_dropped_writer_releases_its_slots_and_unpublishes_them() {
    let cfg = limits(8, 4);
    let dir = Directory::new(&cfg).unwrap();
    let view = ClusterView::single_node(NODE);
    let t = view.target_for_slot(SLOT);
    let mut a = Authority::new(cfg.clone(), &dir, &[SLOT, SLOT + 1]).unwrap();
    assert!(a.apply_view(&view, NODE, T0));
    assert_eq!(
        a.register_route(&t, master(&uid(0), "a", 1, 1), T0),
        Ok(RegisterOutcome::Active)
    );
    let r = a.reader();
    assert_eq!(r.identity(SLOT), Some(t));
    let found = |r: &AuthorityReader| {
        r.endpoints_by_targets(&[(t, &[uid(0)])])[0]
            .as_ref()
            .map(|e| e.len())
            .map_err(|e| *e)
    };
    assert_eq!(found(&r), Ok(1));
    drop(a);
    assert_eq!(
        r.identity(SLOT),
        None,
        "the slot's state went with its writer"
    );
    assert!(found(&r).is_err());
    // Its slots can be claimed again, the one never installed too.
    let mut b = Authority::new(cfg, &dir, &[SLOT, SLOT + 1]).unwrap();
    assert!(b.apply_view(&view, NODE, T0));
    assert_eq!(b.identity(SLOT).map(|(t, _)| t), Some(t));
    assert_eq!(b.active_routes(SLOT), []);
}
