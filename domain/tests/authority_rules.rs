//! One test per presence-authority rule 1–27 (`docs/authority-rules.md`).

// A test driver, outside the sans-IO boundary (clippy.toml): it may read seeds from
// the environment, time itself and run threads.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use domain::cluster::{ClusterView, HashSlot, Target};
use domain::presence::authority::{
    Authority, AuthorityConfig, AuthorityReader, Directory, InstallOutcome, TouchResult,
};
use domain::presence::route::{
    AuthorityError, DeviceLevel, Endpoint, OwnerActionKind, PendingToken, RegisterOutcome, Route,
    Transport, Uid,
};
use slots::{hash_slot, HASH_SLOTS};

const NODE: u64 = 1;
const TTL_S: u64 = 60;
const T0: u64 = 1000;

fn cfg() -> AuthorityConfig {
    AuthorityConfig {
        route_ttl_s: TTL_S,
        pending_ttl_s: 30,
        fence_retention_s: 300,
        ..AuthorityConfig::default()
    }
}

/// One writer owning all 256 hash slots, installed from a single-node view.
fn setup() -> (Authority, AuthorityReader, ClusterView) {
    let dir = Directory::new(&cfg()).unwrap();
    let slots: Vec<HashSlot> = (0..HASH_SLOTS as HashSlot).collect();
    let mut a = Authority::new(cfg(), &dir, &slots).unwrap();
    let view = ClusterView::single_node(NODE);
    assert!(a.apply_view(&view, NODE, T0));
    let r = a.reader();
    (a, r, view)
}

/// The first `n` uids (of the form `u<i>`) that hash to `slot`.
fn uids_in(slot: HashSlot, n: usize) -> Vec<Uid> {
    (0..)
        .map(|i| format!("u{i}"))
        .filter(|u| hash_slot(u.as_bytes()) == slot)
        .take(n)
        .map(Uid::from)
        .collect()
}

/// The `n`-th uid (of the form `u<i>`) that hashes to `slot`.
fn uid_in(slot: HashSlot, n: usize) -> Uid {
    uids_in(slot, n + 1).pop().unwrap()
}

#[allow(clippy::too_many_arguments)]
fn route(
    uid: &Uid,
    dev: &str,
    flag: u8,
    level: DeviceLevel,
    node: u64,
    session: u64,
    seq: u64,
    la: Option<u64>,
) -> Route {
    Route {
        uid: uid.clone(),
        device_id: dev.into(),
        device_flag: flag,
        device_level: level,
        node_id: node,
        boot_id: 77,
        session_id: session,
        listener: Transport::Tcp,
        owner_seq: seq,
        connected_at_ms: 0,
        last_active_s: la,
    }
}

fn slave(uid: &Uid, dev: &str, session: u64, seq: u64) -> Route {
    route(uid, dev, 1, DeviceLevel::Slave, 2, session, seq, Some(T0))
}

fn master(uid: &Uid, dev: &str, session: u64, seq: u64) -> Route {
    route(uid, dev, 1, DeviceLevel::Master, 2, session, seq, Some(T0))
}

fn lookup(r: &AuthorityReader, t: Target, uids: &[Uid]) -> Result<Vec<Endpoint>, AuthorityError> {
    r.endpoints_by_targets(&[(t, uids)]).pop().unwrap()
}

fn sessions(r: &AuthorityReader, t: Target, uid: &Uid) -> Vec<u64> {
    lookup(r, t, std::slice::from_ref(uid))
        .unwrap()
        .iter()
        .map(|e| e.session_id)
        .collect()
}

fn pending_token(o: RegisterOutcome) -> PendingToken {
    match o {
        RegisterOutcome::Pending { token, .. } => token,
        RegisterOutcome::Active => panic!("expected a pending candidate"),
    }
}

fn ok(a: &Authority) {
    a.check_invariants().unwrap();
}

#[test]
fn rule_01_target_must_match_installed_identity_exactly() {
    let (mut a, r, view) = setup();
    let t = view.target_for_slot(5);
    let u = uid_in(5, 0);
    a.register_route(&t, slave(&u, "d", 1, 1), T0).unwrap();
    let variants = [
        Target {
            slot_id: t.slot_id + 1,
            ..t
        },
        Target {
            leader_node_id: 9,
            ..t
        },
        Target {
            leader_term: t.leader_term + 1,
            ..t
        },
        Target {
            config_epoch: t.config_epoch + 1,
            ..t
        },
    ];
    for bad in variants {
        assert_eq!(
            a.register_route(&bad, slave(&u, "d2", 2, 1), T0),
            Err(AuthorityError::StaleTarget)
        );
        assert_eq!(
            a.touch_routes(&bad, &[slave(&u, "d", 1, 1)], T0),
            Err(AuthorityError::StaleTarget)
        );
        assert_eq!(
            a.unregister_route(&bad, &slave(&u, "d", 1, 1).identity(), 1, T0),
            Err(AuthorityError::StaleTarget)
        );
        assert_eq!(
            lookup(&r, bad, std::slice::from_ref(&u)),
            Err(AuthorityError::StaleTarget)
        );
    }
    // A hash slot that differs from the uid's (or names another installed slot).
    let other = view.target_for_slot(6);
    assert_eq!(
        a.register_route(&other, slave(&u, "d2", 2, 1), T0),
        Err(AuthorityError::StaleTarget)
    );
    // No identity: NotLeader.
    assert!(a.remove(7));
    let t7 = view.target_for_slot(7);
    let u7 = uid_in(7, 0);
    assert_eq!(
        a.register_route(&t7, slave(&u7, "d", 1, 1), T0),
        Err(AuthorityError::NotLeader)
    );
    assert_eq!(
        lookup(&r, t7, std::slice::from_ref(&u7)),
        Err(AuthorityError::NotLeader)
    );
    assert_eq!(sessions(&r, t, &u), vec![1]);
    ok(&a);
}

#[test]
fn rule_02_older_term_and_other_epoch_are_refused() {
    let (mut a, r, view) = setup();
    let t1 = view.target_for_slot(3);
    let t2 = Target {
        leader_term: 2,
        ..t1
    };
    assert_eq!(a.install(t2, 2, T0), Ok(InstallOutcome::Replaced));
    let u = uid_in(3, 0);
    assert_eq!(
        a.register_route(&t1, slave(&u, "d", 1, 1), T0),
        Err(AuthorityError::StaleTarget)
    );
    assert_eq!(
        lookup(&r, t1, std::slice::from_ref(&u)),
        Err(AuthorityError::StaleTarget)
    );
    // Installing the older term again is refused and changes nothing.
    assert_eq!(a.install(t1, 3, T0), Err(AuthorityError::StaleTarget));
    assert_eq!(a.identity(3).unwrap().0, t2);
    // A different config epoch (older or newer) is refused for calls.
    for epoch in [0, 2] {
        let te = Target {
            config_epoch: epoch,
            ..t2
        };
        assert_eq!(
            a.register_route(&te, slave(&u, "d", 1, 1), T0),
            Err(AuthorityError::StaleTarget)
        );
    }
    assert_eq!(
        a.register_route(&t2, slave(&u, "d", 1, 1), T0),
        Ok(RegisterOutcome::Active)
    );
}

#[test]
fn rule_03_another_identity_at_the_installed_epoch_and_term_replaces_it() {
    // Only an older (epoch, term) is refused: another slot id or leader at the
    // installed epoch and term is another identity, installed as a newer one is.
    let (mut a, _r, view) = setup();
    let t = view.target_for_slot(3);
    let u = uid_in(3, 0);
    a.register_route(&t, slave(&u, "d", 1, 1), T0).unwrap();
    for other in [
        Target {
            slot_id: t.slot_id + 1,
            ..t
        },
        Target {
            leader_node_id: NODE + 1,
            ..t
        },
    ] {
        assert_eq!(a.install(other, 1, T0), Ok(InstallOutcome::Replaced));
        assert_eq!(a.identity(3), Some((other, 1)));
        assert_eq!(a.counts(3), Default::default());
    }
    ok(&a);
}

#[test]
fn rule_03_new_identity_clears_routes_pending_fences_and_expiry() {
    let (mut a, r, view) = setup();
    let t = view.target_for_slot(9);
    let u = uid_in(9, 0);
    let v = uid_in(9, 1);
    a.register_route(&t, slave(&u, "d", 1, 1), T0).unwrap();
    let tok = pending_token(a.register_route(&t, master(&u, "m", 2, 1), T0).unwrap());
    a.register_route(&t, slave(&v, "d", 3, 5), T0).unwrap();
    a.unregister_route(&t, &slave(&v, "d", 3, 5).identity(), 5, T0)
        .unwrap();
    assert_eq!(a.counts(9).pending, 1);
    for newer in [
        Target {
            leader_term: 2,
            ..t
        },
        Target {
            leader_term: 2,
            config_epoch: 2,
            ..t
        },
    ] {
        assert!(matches!(
            a.install(newer, 1, T0),
            Ok(InstallOutcome::Replaced)
        ));
        assert_eq!(a.counts(9), Default::default());
        assert_eq!(lookup(&r, newer, &[u.clone(), v.clone()]), Ok(vec![]));
        assert_eq!(a.fence(&slave(&v, "d", 3, 5).identity()), None);
        assert_eq!(
            a.commit_route(&newer, &tok, T0),
            Err(AuthorityError::NotReady)
        );
        assert_eq!(a.wheel_stats().fired, 0);
        assert_eq!(a.expire(T0 + 10 * TTL_S), 0, "the old expiry index is gone");
        ok(&a);
        a.register_route(&newer, slave(&u, "d", 1, 1), T0 + 10 * TTL_S)
            .unwrap();
    }
    // The tombstone at 5 is gone with the old identity.
    let t3 = a.identity(9).unwrap().0;
    assert_eq!(
        a.register_route(&t3, slave(&v, "d", 3, 5), T0 + 10 * TTL_S),
        Ok(RegisterOutcome::Active)
    );
}

#[test]
fn rule_04_revision_only_update_keeps_everything() {
    let (mut a, r, view) = setup();
    let t = view.target_for_slot(11);
    let u = uid_in(11, 0);
    a.register_route(&t, slave(&u, "d", 1, 1), T0).unwrap();
    let tok = pending_token(a.register_route(&t, slave(&u, "d", 2, 1), T0).unwrap());
    let mut view2 = view.clone();
    view2.revision = 5;
    assert!(a.apply_view(&view2, NODE, T0 + 1));
    assert_eq!(a.identity(11), Some((t, 5)));
    assert_eq!(a.install(t, 5, T0 + 1), Ok(InstallOutcome::Unchanged));
    assert_eq!(
        a.install(t, 6, T0 + 1),
        Ok(InstallOutcome::RevisionAdvanced)
    );
    assert_eq!(a.identity(11), Some((t, 6)));
    // Calls carrying the same target (the previous revision's) still work.
    assert_eq!(sessions(&r, t, &u), vec![1]);
    assert_eq!(a.commit_route(&t, &tok, T0 + 1), Ok(()));
    assert_eq!(sessions(&r, t, &u), vec![2]);
    // The expiry index survived: the route expires on time.
    assert_eq!(a.expire(T0 + TTL_S), 0);
    assert_eq!(a.expire(T0 + TTL_S + 1), 1);
    ok(&a);
}

#[test]
fn rule_05_losing_authority_removes_all_state() {
    let (mut a, r, view) = setup();
    let t = view.target_for_slot(12);
    let u = uid_in(12, 0);
    a.register_route(&t, slave(&u, "d", 1, 1), T0).unwrap();
    let mut lost = view.clone();
    lost.revision = 2;
    lost.slots[12].leader_node_id = 2;
    lost.slots[12].leader_term = 2;
    assert!(a.apply_view(&lost, NODE, T0));
    assert_eq!(a.identity(12), None);
    assert_eq!(a.counts(12), Default::default());
    assert_eq!(r.identity(12), None);
    assert_eq!(
        a.register_route(&t, slave(&u, "d", 1, 1), T0),
        Err(AuthorityError::NotLeader)
    );
    assert_eq!(
        a.touch_routes(&t, &[slave(&u, "d", 1, 1)], T0),
        Err(AuthorityError::NotLeader)
    );
    assert_eq!(
        a.unregister_route(&t, &slave(&u, "d", 1, 1).identity(), 1, T0),
        Err(AuthorityError::NotLeader)
    );
    assert_eq!(
        lookup(&r, t, std::slice::from_ref(&u)),
        Err(AuthorityError::NotLeader)
    );
    assert_eq!(a.route(&slave(&u, "d", 1, 1).identity()), None);
    // Other slots are untouched.
    assert!(a.identity(13).is_some());
}

#[test]
fn rule_06_route_without_conflicts_is_active_at_once() {
    let (mut a, r, view) = setup();
    let t = view.target_for_slot(20);
    let u = uid_in(20, 0);
    assert_eq!(
        a.register_route(&t, slave(&u, "d1", 1, 1), T0),
        Ok(RegisterOutcome::Active)
    );
    assert_eq!(
        a.register_route(&t, slave(&u, "d2", 2, 1), T0),
        Ok(RegisterOutcome::Active)
    );
    let other_flag = route(&u, "d1", 2, DeviceLevel::Master, 2, 3, 1, Some(T0));
    assert_eq!(
        a.register_route(&t, other_flag, T0),
        Ok(RegisterOutcome::Active)
    );
    assert_eq!(sessions(&r, t, &u), vec![1, 2, 3]);
    ok(&a);
}

#[test]
fn rule_07_slave_conflicts_only_same_device_id() {
    let (mut a, r, view) = setup();
    let t = view.target_for_slot(21);
    let u = uid_in(21, 0);
    a.register_route(&t, slave(&u, "d1", 1, 1), T0).unwrap();
    a.register_route(&t, slave(&u, "d2", 2, 1), T0).unwrap();
    // Slave, same device id: conflicts with session 1 only.
    match a.register_route(&t, slave(&u, "d1", 3, 1), T0).unwrap() {
        RegisterOutcome::Pending { actions, .. } => {
            assert_eq!(actions.len(), 1);
            assert_eq!(actions[0].route.session_id, 1);
        }
        RegisterOutcome::Active => panic!("expected conflict"),
    }
    // Master: conflicts with every device of the same flag.
    match a.register_route(&t, master(&u, "d9", 4, 1), T0).unwrap() {
        RegisterOutcome::Pending { actions, .. } => {
            let mut s: Vec<u64> = actions.iter().map(|a| a.route.session_id).collect();
            s.sort();
            assert_eq!(s, vec![1, 2]);
        }
        RegisterOutcome::Active => panic!("expected conflict"),
    }
    // The candidates are pending: the conflicting routes stay active and visible.
    assert_eq!(sessions(&r, t, &u), vec![1, 2]);
    assert_eq!(a.counts(21).pending, 2);
    ok(&a);
}

#[test]
fn rule_08_owner_actions_kick_master_other_device_else_close() {
    let (mut a, _r, view) = setup();
    let t = view.target_for_slot(22);
    let u = uid_in(22, 0);
    a.register_route(&t, slave(&u, "d1", 1, 1), T0).unwrap();
    a.register_route(&t, slave(&u, "d2", 2, 7), T0).unwrap();
    let RegisterOutcome::Pending { actions, .. } =
        a.register_route(&t, master(&u, "d2", 3, 1), T0).unwrap()
    else {
        panic!("expected conflict")
    };
    let mut got: Vec<(u64, OwnerActionKind, u64)> = actions
        .iter()
        .map(|a| (a.route.session_id, a.kind, a.owner_seq))
        .collect();
    got.sort_by_key(|g| g.0);
    assert_eq!(
        got,
        vec![
            (1, OwnerActionKind::KickThenClose, 1),
            (2, OwnerActionKind::Close, 7)
        ]
    );
    let RegisterOutcome::Pending { actions, .. } =
        a.register_route(&t, slave(&u, "d1", 4, 1), T0).unwrap()
    else {
        panic!("expected conflict")
    };
    assert_eq!(actions.len(), 1);
    assert_eq!(actions[0].kind, OwnerActionKind::Close);
    assert_eq!(actions[0].route, slave(&u, "d1", 1, 1).identity());
}

#[test]
fn rule_09_commit_removes_exactly_acknowledged_conflicts() {
    let (mut a, r, view) = setup();
    let t = view.target_for_slot(23);
    let u = uid_in(23, 0);
    a.register_route(&t, slave(&u, "d0", 1, 1), T0).unwrap();
    let other_flag = route(&u, "d0", 2, DeviceLevel::Slave, 2, 5, 1, Some(T0));
    a.register_route(&t, other_flag, T0).unwrap();
    let tok = pending_token(a.register_route(&t, master(&u, "d1", 2, 1), T0).unwrap());
    // A new conflicting route appears (a Slave of another device conflicts with nothing).
    assert_eq!(
        a.register_route(&t, slave(&u, "d2", 3, 1), T0),
        Ok(RegisterOutcome::Active)
    );
    assert_eq!(a.commit_route(&t, &tok, T0), Err(AuthorityError::NotReady));
    assert_eq!(
        sessions(&r, t, &u),
        vec![1, 3, 5],
        "a refused commit changes nothing"
    );
    assert!(a.has_pending(&master(&u, "d1", 2, 1).identity()));
    ok(&a);
    // Registering again acknowledges both; commit removes exactly them.
    let tok = pending_token(a.register_route(&t, master(&u, "d1", 2, 2), T0).unwrap());
    assert_eq!(a.commit_route(&t, &tok, T0), Ok(()));
    assert_eq!(sessions(&r, t, &u), vec![2, 5]);
    ok(&a);
}

#[test]
fn rule_10_commit_of_superseded_candidate_fails() {
    let (mut a, r, view) = setup();
    let t = view.target_for_slot(24);
    let u = uid_in(24, 0);
    a.register_route(&t, slave(&u, "d", 1, 1), T0).unwrap();
    let old = pending_token(a.register_route(&t, slave(&u, "d", 2, 1), T0).unwrap());
    let new = pending_token(a.register_route(&t, slave(&u, "d", 2, 2), T0).unwrap());
    assert_eq!(
        a.commit_route(&t, &old, T0),
        Err(AuthorityError::Superseded)
    );
    assert_eq!(a.abort_route(&t, &old, T0), Err(AuthorityError::Superseded));
    assert_eq!(sessions(&r, t, &u), vec![1]);
    assert_eq!(a.commit_route(&t, &new, T0), Ok(()));
    assert_eq!(sessions(&r, t, &u), vec![2]);
    assert_eq!(
        lookup(&r, t, std::slice::from_ref(&u)).unwrap()[0].owner_seq,
        2
    );
    ok(&a);
}

#[test]
fn rule_11_abort_removes_candidate_and_keeps_existing_route() {
    let (mut a, r, view) = setup();
    let t = view.target_for_slot(25);
    let u = uid_in(25, 0);
    a.register_route(&t, slave(&u, "d", 1, 1), T0).unwrap();
    let tok = pending_token(a.register_route(&t, slave(&u, "d", 2, 1), T0).unwrap());
    assert_eq!(a.abort_route(&t, &tok, T0), Ok(()));
    assert!(!a.has_pending(&tok.identity));
    assert_eq!(a.counts(25).pending, 0);
    assert_eq!(sessions(&r, t, &u), vec![1]);
    assert_eq!(a.commit_route(&t, &tok, T0), Err(AuthorityError::NotReady));
    assert_eq!(a.abort_route(&t, &tok, T0), Ok(()), "abort is idempotent");
    ok(&a);
}

#[test]
fn rule_12_register_at_or_below_tombstone_is_refused() {
    let (mut a, r, view) = setup();
    let t = view.target_for_slot(26);
    let u = uid_in(26, 0);
    let id = slave(&u, "d", 1, 5).identity();
    a.unregister_route(&t, &id, 5, T0).unwrap();
    assert_eq!(
        a.register_route(&t, slave(&u, "d", 1, 5), T0),
        Err(AuthorityError::Tombstoned)
    );
    assert_eq!(
        a.register_route(&t, slave(&u, "d", 1, 4), T0),
        Err(AuthorityError::Tombstoned)
    );
    assert_eq!(sessions(&r, t, &u), Vec::<u64>::new());
    assert_eq!(
        a.register_route(&t, slave(&u, "d", 1, 6), T0),
        Ok(RegisterOutcome::Active)
    );
    ok(&a);
}

#[test]
fn rule_13_replaced_route_leaves_the_expiry_index() {
    let (mut a, _r, view) = setup();
    let t = view.target_for_slot(27);
    let u = uid_in(27, 0);
    // Old route active since T0; the replacement is active from T0 + 50.
    a.register_route(&t, slave(&u, "d", 1, 1), T0).unwrap();
    let mut newer = slave(&u, "d", 2, 1);
    newer.last_active_s = Some(T0 + 50);
    let tok = pending_token(a.register_route(&t, newer, T0 + 50).unwrap());
    a.commit_route(&t, &tok, T0 + 50).unwrap();
    ok(&a); // exactly one expiry deadline per timed route / orphan fence record
    let fired0 = a.wheel_stats().fired;
    assert_eq!(
        a.expire(T0 + TTL_S + 1),
        0,
        "the replaced route's deadline fires nothing"
    );
    assert_eq!(a.wheel_stats().fired, fired0, "its expiry entry is gone");
    assert_eq!(a.expire(T0 + 50 + TTL_S + 1), 1);
    // Re-registering the same identity replaces its own route's entry too.
    let s = slave(&u, "d", 3, 1);
    a.register_route(&t, s.clone(), T0 + 200).unwrap();
    let mut s2 = s;
    s2.owner_seq = 2;
    s2.last_active_s = Some(T0 + 220);
    a.register_route(&t, s2, T0 + 220).unwrap();
    ok(&a);
    assert_eq!(a.expire(T0 + 200 + TTL_S + 1), 0);
    ok(&a);
}

#[test]
fn rule_14_touch_refreshes_exact_route_never_backward() {
    let (mut a, _r, view) = setup();
    let t = view.target_for_slot(30);
    let u = uid_in(30, 0);
    let s = slave(&u, "d", 1, 1);
    a.register_route(&t, s.clone(), T0).unwrap();
    let mut touch = s.clone();
    touch.last_active_s = Some(T0 + 30);
    assert_eq!(
        a.touch_routes(&t, &[touch.clone()], T0 + 40).unwrap(),
        vec![TouchResult::Refreshed]
    );
    assert_eq!(a.route(&s.identity()).unwrap().last_active_s, Some(T0 + 30));
    touch.last_active_s = Some(T0 + 10);
    assert_eq!(
        a.touch_routes(&t, &[touch.clone()], T0 + 41).unwrap(),
        vec![TouchResult::Refreshed]
    );
    assert_eq!(
        a.route(&s.identity()).unwrap().last_active_s,
        Some(T0 + 30),
        "never backward"
    );
    // No activity time in the touch: now.
    touch.last_active_s = None;
    a.touch_routes(&t, &[touch], T0 + 45).unwrap();
    assert_eq!(a.route(&s.identity()).unwrap().last_active_s, Some(T0 + 45));
    ok(&a);
}

#[test]
fn rule_15_touch_recreates_missing_non_conflicting_route_only() {
    let (mut a, r, view) = setup();
    let t = view.target_for_slot(31);
    let u = uid_in(31, 0);
    // A new authority (new term) rebuilt from touches.
    let t2 = Target {
        leader_term: 2,
        ..t
    };
    a.install(t2, 2, T0).unwrap();
    let s1 = slave(&u, "d1", 1, 1);
    let m2 = master(&u, "d2", 2, 1);
    assert_eq!(
        a.touch_routes(&t2, std::slice::from_ref(&s1), T0).unwrap(),
        vec![TouchResult::Recreated]
    );
    assert_eq!(sessions(&r, t2, &u), vec![1]);
    // The Master would conflict with session 1: ignored, and no candidate created.
    assert_eq!(
        a.touch_routes(&t2, std::slice::from_ref(&m2), T0).unwrap(),
        vec![TouchResult::IgnoredConflict]
    );
    assert!(!a.has_pending(&m2.identity()));
    assert_eq!(a.counts(31).pending, 0);
    assert_eq!(sessions(&r, t2, &u), vec![1]);
    ok(&a);
}

#[test]
fn rule_16_touch_below_last_seq_or_at_tombstone_is_ignored() {
    let (mut a, r, view) = setup();
    let t = view.target_for_slot(32);
    let u = uid_in(32, 0);
    let s = slave(&u, "d", 1, 5);
    a.register_route(&t, s.clone(), T0).unwrap();
    let mut old = s.clone();
    old.owner_seq = 4;
    old.last_active_s = Some(T0 + 20);
    assert_eq!(
        a.touch_routes(&t, &[old], T0 + 20).unwrap(),
        vec![TouchResult::IgnoredStaleSeq]
    );
    assert_eq!(a.route(&s.identity()).unwrap().last_active_s, Some(T0));
    // Unregister at 7: a touch at 7 (or below) is ignored and recreates nothing.
    a.unregister_route(&t, &s.identity(), 7, T0).unwrap();
    let mut at = s.clone();
    at.owner_seq = 7;
    assert_eq!(
        a.touch_routes(&t, &[at], T0 + 21).unwrap(),
        vec![TouchResult::IgnoredTombstoned]
    );
    assert_eq!(sessions(&r, t, &u), Vec::<u64>::new());
    let mut newer = s;
    newer.owner_seq = 8;
    assert_eq!(
        a.touch_routes(&t, &[newer], T0 + 22).unwrap(),
        vec![TouchResult::Recreated]
    );
    ok(&a);
}

#[test]
fn rule_17_touch_moves_route_to_its_new_bucket() {
    let (mut a, _r, view) = setup();
    let t = view.target_for_slot(33);
    let u = uid_in(33, 0);
    let s = slave(&u, "d", 1, 1);
    a.register_route(&t, s.clone(), T0).unwrap();
    let mut touch = s.clone();
    touch.last_active_s = Some(T0 + 500);
    a.touch_routes(&t, &[touch], T0 + 500).unwrap();
    ok(&a); // the record's single expiry entry holds the new deadline
    let before = a.wheel_stats().fired;
    assert_eq!(a.expire(T0 + TTL_S + 1), 0);
    assert_eq!(
        a.wheel_stats().fired,
        before,
        "nothing left in the old bucket"
    );
    assert_eq!(a.expire(T0 + 500 + TTL_S), 0);
    assert_eq!(a.expire(T0 + 500 + TTL_S + 1), 1);
    ok(&a);
}

#[test]
fn rule_18_unregister_needs_exact_identity() {
    let (mut a, r, view) = setup();
    let t = view.target_for_slot(34);
    let u = uid_in(34, 0);
    let s1 = slave(&u, "d1", 1, 1);
    let s2 = slave(&u, "d2", 2, 1);
    a.register_route(&t, s1.clone(), T0).unwrap();
    a.register_route(&t, s2.clone(), T0).unwrap();
    let mut wrong_boot = s1.identity();
    wrong_boot.boot_id += 1;
    let mut wrong_node = s1.identity();
    wrong_node.node_id += 1;
    for id in [wrong_boot, wrong_node] {
        assert_eq!(a.unregister_route(&t, &id, 9, T0), Ok(false));
    }
    assert_eq!(sessions(&r, t, &u), vec![1, 2]);
    assert_eq!(a.unregister_route(&t, &s1.identity(), 1, T0), Ok(true));
    assert_eq!(
        sessions(&r, t, &u),
        vec![2],
        "another session of the same uid is untouched"
    );
    ok(&a);
}

#[test]
fn rule_19_unregister_tombstone_removes_only_not_newer_routes() {
    let (mut a, r, view) = setup();
    let t = view.target_for_slot(35);
    let u = uid_in(35, 0);
    let s = slave(&u, "d", 1, 5);
    a.register_route(&t, s.clone(), T0).unwrap();
    assert_eq!(a.unregister_route(&t, &s.identity(), 4, T0), Ok(false));
    assert_eq!(a.fence(&s.identity()).unwrap().tombstone, Some(4));
    assert_eq!(sessions(&r, t, &u), vec![1]);
    assert_eq!(a.unregister_route(&t, &s.identity(), 5, T0), Ok(true));
    assert_eq!(a.fence(&s.identity()).unwrap().tombstone, Some(5));
    assert_eq!(sessions(&r, t, &u), Vec::<u64>::new());
    ok(&a); // the expiry entry now holds the fence retention, not the route
    let fired = a.wheel_stats().fired;
    assert_eq!(a.expire(T0 + TTL_S + 1), 0);
    assert_eq!(
        a.wheel_stats().fired,
        fired,
        "the route left the expiry index"
    );
    assert_eq!(a.stats().routes_expired, 0);
}

#[test]
fn rule_20_expiry_is_strictly_after_deadline() {
    let (mut a, r, view) = setup();
    let t = view.target_for_slot(40);
    let u = uid_in(40, 0);
    a.register_route(&t, slave(&u, "d", 1, 1), T0).unwrap();
    assert_eq!(
        a.expire(T0 + TTL_S),
        0,
        "last_active + ttl == now: still active"
    );
    assert_eq!(sessions(&r, t, &u), vec![1]);
    assert_eq!(a.expire(T0 + TTL_S + 1), 1);
    assert_eq!(sessions(&r, t, &u), Vec::<u64>::new());
    ok(&a);
}

#[test]
fn rule_21_expiry_examines_only_due_buckets() {
    let (mut a, _r, view) = setup();
    let t = view.target_for_slot(41);
    let (total, due) = (10_000, 100);
    for (i, u) in uids_in(41, total).iter().enumerate() {
        let la = if i < due { T0 - 10 } else { T0 };
        let s = route(u, "d", 1, DeviceLevel::Slave, 2, i as u64, 1, Some(la));
        a.register_route(&t, s, T0).unwrap();
    }
    let before = a.stats();
    assert_eq!(a.expire(T0 - 10 + TTL_S + 1), due);
    let after = a.stats();
    let examined = after.expiry_entries_visited - before.expiry_entries_visited;
    assert!(examined >= due as u64);
    assert!(
        examined <= 2 * due as u64,
        "examined {examined} entries for {due} due of {total}"
    );
    assert_eq!(a.counts(41).active_routes, total - due);
    ok(&a);
}

#[test]
fn rule_22_expiry_keeps_owner_seq_and_tombstones() {
    let (mut a, r, view) = setup();
    let t = view.target_for_slot(42);
    let u = uid_in(42, 0);
    let s = slave(&u, "d", 1, 5);
    a.register_route(&t, s.clone(), T0).unwrap();
    let v = slave(&u, "d2", 2, 9);
    a.register_route(&t, v.clone(), T0).unwrap();
    a.unregister_route(&t, &v.identity(), 3, T0).unwrap(); // tombstone below the route
    let now = T0 + TTL_S + 1;
    assert_eq!(a.expire(now), 2);
    let f = a.fence(&s.identity()).unwrap();
    assert_eq!(
        (f.last_owner_seq, f.tombstone),
        (5, None),
        "expiry writes no tombstone"
    );
    let f = a.fence(&v.identity()).unwrap();
    assert_eq!(
        (f.last_owner_seq, f.tombstone),
        (9, Some(3)),
        "tombstone kept"
    );
    let mut lower = s.clone();
    lower.owner_seq = 4;
    assert_eq!(
        a.touch_routes(&t, &[lower], now).unwrap(),
        vec![TouchResult::IgnoredStaleSeq]
    );
    assert_eq!(
        a.touch_routes(&t, std::slice::from_ref(&s), now).unwrap(),
        vec![TouchResult::Recreated]
    );
    let mut higher = v.clone();
    higher.owner_seq = 10;
    assert_eq!(
        a.touch_routes(&t, &[higher], now).unwrap(),
        vec![TouchResult::Recreated]
    );
    assert_eq!(sessions(&r, t, &u), vec![1, 2]);
    ok(&a);
}

/// Rules 20 and 22 with deadlines beyond the expiry ring's window (at most 4096
/// one-second buckets): a retention longer than the window, and a route touched
/// long after the last pass. Both fire exactly on time, not before.
#[test]
fn rule_22_deadlines_beyond_the_expiry_window_fire_on_time() {
    let long = AuthorityConfig {
        fence_retention_s: 10_000,
        ..cfg()
    };
    let dir = Directory::new(&long).unwrap();
    let mut a = Authority::new(long, &dir, &[44]).unwrap();
    let view = ClusterView::single_node(NODE);
    assert!(a.apply_view(&view, NODE, T0));
    let t = view.target_for_slot(44);
    let u = uid_in(44, 0);
    let s = slave(&u, "d", 1, 1);
    a.register_route(&t, s.clone(), T0).unwrap();
    // No pass since T0: the new deadline is 5061 s past the ring's time.
    let mut touch = s.clone();
    touch.last_active_s = Some(T0 + 5000);
    a.touch_routes(&t, &[touch], T0 + 5000).unwrap();
    ok(&a);
    let expired_at = T0 + 5000 + TTL_S + 1;
    for now in (T0..expired_at).step_by(97).chain([expired_at - 1]) {
        assert_eq!(a.expire(now), 0, "expired early at {now}");
        ok(&a);
    }
    assert_eq!(a.expire(expired_at), 1);
    let retained_until = expired_at + 10_000;
    for now in (expired_at..retained_until)
        .step_by(499)
        .chain([retained_until - 1])
    {
        a.expire(now);
        assert!(
            a.fence(&s.identity()).is_some(),
            "fence dropped early at {now}"
        );
        ok(&a);
    }
    a.expire(retained_until);
    assert_eq!(a.fence(&s.identity()), None);
    assert_eq!(a.stats().fence_records_dropped, 1);
    assert!(a.wheel_stats().recascaded > 0, "went through the far path");
    ok(&a);
}

/// Rules 20 and 22: a deadline beyond the expiry ring's window that one pass jumps
/// past (no pass between the touch that set it and its deadline) fires in that
/// pass, not in the next one.
#[test]
fn rule_22_a_deadline_beyond_the_window_fires_in_the_pass_that_jumps_past_it() {
    let (mut a, r, view) = setup();
    let t = view.target_for_slot(44);
    let u = uid_in(44, 0);
    let s = slave(&u, "d", 1, 1);
    a.register_route(&t, s.clone(), T0).unwrap();
    // No pass since T0: the new deadline is beyond the ring's window.
    let mut touch = s;
    touch.last_active_s = Some(T0 + 5000);
    a.touch_routes(&t, &[touch], T0 + 5000).unwrap();
    let expired_at = T0 + 5000 + TTL_S + 1;
    assert_eq!(
        a.expire(expired_at),
        1,
        "expired in the pass that reached it"
    );
    assert_eq!(sessions(&r, t, &u), Vec::<u64>::new());
    assert_eq!(a.wheel_stats().recascaded, 0, "fired, not set again");
    ok(&a);
}

/// Rules 20–21 with a clock below the install time (a pass run with an older
/// `now`, e.g. a view installed from a later clock reading): no panic, nothing
/// expires early, and later passes fire on time.
#[test]
fn rule_20_a_pass_before_the_install_time_expires_nothing() {
    let (mut a, r, view) = setup();
    let t = view.target_for_slot(45);
    let [u, c] = [uid_in(45, 0), uid_in(45, 1)];
    a.register_route(&t, slave(&u, "d", 1, 1), T0).unwrap();
    // A candidate too (a Slave of the same device): the slot's wheel holds it.
    a.register_route(&t, slave(&c, "d", 2, 1), T0).unwrap();
    let tok = pending_token(a.register_route(&t, slave(&c, "d", 3, 1), T0).unwrap());
    assert_eq!(a.expire(T0 - 5), 0);
    assert_eq!(sessions(&r, t, &u), vec![1]);
    assert!(a.has_pending(&tok.identity), "nothing expired early");
    ok(&a);
    assert_eq!(a.expire(T0 + TTL_S), 0);
    assert_eq!(a.expire(T0 + TTL_S + 1), 2);
    assert!(
        !a.has_pending(&tok.identity),
        "the candidate expired on time"
    );
    ok(&a);
}

/// Rules 20–22: one record whose route and candidate come due in the same pass
/// (the ring's entry and the wheel's). The pass handles the ring's entries of a
/// slot before its wheel's: handling the candidate first would set the record's
/// deadline through its stale ring link.
#[test]
fn rule_20_a_route_and_its_candidate_due_in_the_same_pass() {
    let (mut a, r, view) = setup();
    let t = view.target_for_slot(46);
    let u = uid_in(46, 0);
    a.register_route(&t, slave(&u, "d1", 1, 1), T0).unwrap();
    a.register_route(&t, slave(&u, "d2", 2, 1), T0).unwrap();
    // Session 1 again, as Master: it conflicts with d2, so session 1's record keeps
    // its active route (deadline T0 + TTL + 1) and gets a candidate (deadline
    // now + pending TTL + 1): the same second.
    let now = T0 + TTL_S - cfg().pending_ttl_s;
    let mut m = master(&u, "d1", 1, 2);
    m.last_active_s = Some(T0);
    let tok = pending_token(a.register_route(&t, m, now).unwrap());
    ok(&a);
    let due = T0 + TTL_S + 1;
    assert_eq!(a.expire(due - 1), 0);
    assert_eq!(a.expire(due), 2, "both routes expired");
    assert!(!a.has_pending(&tok.identity), "the candidate expired");
    assert_eq!(sessions(&r, t, &u), Vec::<u64>::new());
    ok(&a);
    let f = a.fence(&tok.identity).expect("retained");
    assert_eq!(f.last_owner_seq, 2);
    // The record's retention deadline is in the ring: it goes on time.
    a.expire(due + cfg().fence_retention_s - 1);
    assert!(a.fence(&tok.identity).is_some());
    a.expire(due + cfg().fence_retention_s);
    assert_eq!(a.fence(&tok.identity), None);
    assert_eq!(a.counts(46).fence_records, 0);
    ok(&a);
}

#[test]
fn rule_23_route_without_activity_time_never_expires() {
    let (mut a, r, view) = setup();
    let t = view.target_for_slot(43);
    let u = uid_in(43, 0);
    let s = route(&u, "d", 1, DeviceLevel::Slave, 2, 1, 1, None);
    a.register_route(&t, s.clone(), T0).unwrap();
    a.touch_routes(&t, std::slice::from_ref(&s), T0 + 5)
        .unwrap();
    assert_eq!(a.expire(T0 + 1_000_000), 0);
    assert_eq!(sessions(&r, t, &u), vec![1]);
    assert_eq!(a.route(&s.identity()).unwrap().last_active_s, None);
    ok(&a);
}

#[test]
fn rule_24_one_result_per_group_stale_group_fails_alone() {
    let (mut a, r, view) = setup();
    let (ta, tb) = (view.target_for_slot(50), view.target_for_slot(51));
    let (ua, ub) = (uid_in(50, 0), uid_in(51, 0));
    a.register_route(&ta, slave(&ua, "d", 1, 1), T0).unwrap();
    a.register_route(&tb, slave(&ub, "d", 2, 1), T0).unwrap();
    a.remove(52);
    let stale = Target {
        leader_term: 9,
        ..ta
    };
    let (ga, gb) = ([ua.clone()], [ub.clone()]);
    let res = r.endpoints_by_targets(&[
        (ta, &ga[..]),
        (stale, &ga[..]),
        (view.target_for_slot(52), &ga[..]),
        (tb, &gb[..]),
    ]);
    assert_eq!(res.len(), 4);
    assert_eq!(res[0].as_ref().unwrap()[0].session_id, 1);
    assert_eq!(res[1], Err(AuthorityError::StaleTarget));
    assert_eq!(res[2], Err(AuthorityError::NotLeader));
    assert_eq!(res[3].as_ref().unwrap()[0].session_id, 2);
}

#[test]
fn rule_25_routes_in_input_uid_order_deterministic_within_uid() {
    let (mut a, r, view) = setup();
    let t = view.target_for_slot(53);
    let us = uids_in(53, 3);
    // Register in a scrambled order.
    for (k, sess) in [(2, 30), (0, 12), (1, 20), (0, 10), (2, 31), (0, 11)] {
        a.register_route(&t, slave(&us[k], &format!("d{sess}"), sess, 1), T0)
            .unwrap();
    }
    let order = [us[2].clone(), us[0].clone(), us[1].clone()];
    let got: Vec<(Uid, u64)> = lookup(&r, t, &order)
        .unwrap()
        .into_iter()
        .map(|e| (e.uid, e.session_id))
        .collect();
    let want: Vec<(Uid, u64)> = [(2, 30), (2, 31), (0, 10), (0, 11), (0, 12), (1, 20)]
        .iter()
        .map(|&(k, s)| (us[k].clone(), s))
        .collect();
    assert_eq!(got, want);
    assert_eq!(
        lookup(&r, t, &order).unwrap(),
        lookup(&r, t, &order).unwrap()
    );
}

#[test]
fn rule_26_results_are_owned_snapshots() {
    let (mut a, r, view) = setup();
    let t = view.target_for_slot(54);
    let u = uid_in(54, 0);
    let s = slave(&u, "d", 1, 1);
    a.register_route(&t, s.clone(), T0).unwrap();
    let snap = lookup(&r, t, std::slice::from_ref(&u)).unwrap();
    let copy = snap.clone();
    a.unregister_route(&t, &s.identity(), 1, T0).unwrap();
    a.register_route(&t, slave(&u, "d", 2, 1), T0).unwrap();
    a.install(
        Target {
            leader_term: 3,
            ..t
        },
        3,
        T0,
    )
    .unwrap();
    a.expire(T0 + 10 * TTL_S);
    assert_eq!(snap, copy);
    assert_eq!(snap[0].session_id, 1);
}

#[test]
fn rule_27_lookups_are_lock_free_and_safe_during_writes() {
    const READERS: usize = 3;
    const LOOKUPS_PER_READER: usize = 3_000;
    const SLOTS: [HashSlot; 4] = [60, 61, 62, 63];
    let (mut a, r, view) = setup();
    let uids: Arc<Vec<(HashSlot, Vec<Uid>)>> =
        Arc::new(SLOTS.iter().map(|&s| (s, uids_in(s, 32))).collect());
    let done = Arc::new(AtomicUsize::new(0));
    let ok_groups = Arc::new(AtomicUsize::new(0));
    let mut handles = Vec::new();
    for k in 0..READERS {
        let (r, uids, done, ok_groups, view) = (
            r.clone(),
            uids.clone(),
            done.clone(),
            ok_groups.clone(),
            view.clone(),
        );
        handles.push(std::thread::spawn(move || {
            for i in 0..LOOKUPS_PER_READER {
                // Targets of terms 1..=4: only the installed one answers.
                let term = ((i + k) % 4) as u64 + 1;
                let groups: Vec<(Target, &[Uid])> = uids
                    .iter()
                    .map(|(s, us)| {
                        (
                            Target {
                                leader_term: term,
                                ..view.target_for_slot(*s)
                            },
                            &us[..],
                        )
                    })
                    .collect();
                let res = r.endpoints_by_targets(&groups);
                assert_eq!(res.len(), groups.len());
                for ((t, us), res) in groups.iter().zip(res) {
                    match res {
                        Ok(eps) => {
                            ok_groups.fetch_add(1, Ordering::Relaxed);
                            let mut pos = 0;
                            for e in &eps {
                                // Routes are written with boot_id = the term they were written under:
                                // a lookup never mixes an identity with another's routes.
                                assert_eq!(e.boot_id, t.leader_term);
                                assert_eq!(hash_slot(e.uid.as_bytes()), t.hash_slot);
                                let p = us.iter().position(|u| *u == e.uid).unwrap();
                                assert!(p >= pos, "input uid order");
                                pos = p;
                            }
                        }
                        Err(e) => assert!(matches!(
                            e,
                            AuthorityError::StaleTarget | AuthorityError::NotLeader
                        )),
                    }
                }
            }
            done.fetch_add(1, Ordering::Release);
        }));
    }
    let mut now = T0;
    let mut term = 1u64;
    let mut round = 0u64;
    while done.load(Ordering::Acquire) < READERS || round < 200 {
        round += 1;
        now += 1;
        for (s, us) in uids.iter() {
            let t = Target {
                leader_term: term,
                ..view.target_for_slot(*s)
            };
            for (i, u) in us.iter().enumerate() {
                let mut rt = route(
                    u,
                    "d",
                    1,
                    DeviceLevel::Slave,
                    2,
                    (i as u64) % 3,
                    round,
                    Some(now),
                );
                rt.boot_id = term;
                match round % 4 {
                    0 => {
                        let _ = a.unregister_route(&t, &rt.identity(), round, now);
                    }
                    1 => {
                        let _ = a.touch_routes(&t, &[rt], now);
                    }
                    _ => {
                        if let Ok(RegisterOutcome::Pending { token, .. }) =
                            a.register_route(&t, rt, now)
                        {
                            let _ = a.commit_route(&t, &token, now);
                        }
                    }
                }
            }
        }
        a.expire(now);
        if round.is_multiple_of(25) {
            term = term % 4 + 1;
            for s in SLOTS {
                let t = Target {
                    leader_term: term,
                    ..view.target_for_slot(s)
                };
                if a.install(t, round, now).is_err() {
                    // Going back to term 1 needs a fresh identity: remove, then install.
                    a.remove(s);
                    a.install(t, round, now).unwrap();
                }
            }
        }
        if round.is_multiple_of(50) {
            ok(&a);
        }
    }
    for h in handles {
        h.join().unwrap();
    }
    assert!(ok_groups.load(Ordering::Relaxed) > 0);
    ok(&a);
}

/// The owner's side of rules 14–17 (`Authority::serve_touch`): what each touch
/// result asks of the owner. Refreshed and recreated routes need nothing; a route
/// the slot's limit kept out, or a batch refused whole, is requeued; a route
/// refused for good (a conflicting active route, a newer owner_seq, a tombstone)
/// is superseded: its session is no longer routed and must be told and closed; a
/// route of another slot (bad input) gets nothing.
#[test]
fn touch_answer_sorts_each_route_for_its_owner() {
    let (mut a, _r, view) = setup();
    let t = view.target_for_slot(33);
    let [u0, u1, u2, u3] = [0, 1, 2, 3].map(|n| uid_in(33, n));
    let active = master(&u0, "d", 1, 5);
    a.register_route(&t, active.clone(), T0).unwrap();
    let missing = slave(&u1, "d", 2, 1);
    let conflicting = master(&u0, "other", 3, 9);
    let mut stale = active.clone();
    stale.owner_seq = 4;
    let gone = slave(&u2, "d", 4, 3);
    a.register_route(&t, gone.clone(), T0).unwrap();
    a.unregister_route(&t, &gone.identity(), 6, T0).unwrap();
    let other_slot = master(&uid_in(34, 0), "d", 5, 1);
    let batch = vec![
        active.clone(),
        missing.clone(),
        conflicting.clone(),
        stale.clone(),
        gone.clone(),
        other_slot,
    ];
    let answer = a.serve_touch(&t, batch, T0 + 1);
    assert_eq!(answer.requeue, Vec::<Route>::new());
    assert_eq!(answer.superseded, vec![conflicting, stale, gone]);
    assert!(!answer.is_empty());
    // A stale target refuses the batch whole: every route is requeued.
    let stale_target = Target {
        leader_term: t.leader_term + 1,
        ..t
    };
    let refused = a.serve_touch(&stale_target, vec![master(&u3, "d", 6, 1)], T0 + 1);
    assert_eq!(refused.requeue.len(), 1);
    assert!(refused.superseded.is_empty());
    // Nothing to do: empty.
    let fine = a.serve_touch(&t, vec![active], T0 + 2);
    assert!(fine.is_empty());
    ok(&a);

    // At the slot's route limit a missing route is requeued (retry later).
    let small = AuthorityConfig {
        routes_per_slot_max: 1,
        ..cfg()
    };
    let dir = Directory::new(&small).unwrap();
    let mut b = Authority::new(small, &dir, &[33]).unwrap();
    assert!(b.apply_view(&view, NODE, T0));
    b.register_route(&t, master(&u0, "d", 1, 1), T0).unwrap();
    let full = b.serve_touch(&t, vec![slave(&u1, "d", 2, 1)], T0);
    assert_eq!(full.requeue.len(), 1);
    assert!(full.superseded.is_empty() && !full.is_empty());
}
