//! The registry's route rebuild after a view change (issue 13, failover): which
//! sessions are queued, the token bucket that bounds the drain, the batches by new
//! target, failed rebuild touches, and the round's duration.

// A test driver, outside the sans-IO boundary (clippy.toml).
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

#[path = "activation_common.rs"]
mod common;

use common::*;
use domain::cluster::{ClusterView, Target};
use domain::presence::registry::{RebuildLimits, Registry, SessionHandle};
use domain::presence::route::Route;
use slots::hash_slot;

fn active(reg: &mut Registry, v: &ClusterView, uid: &str, sid: u64) -> SessionHandle {
    let h = reg
        .register_pending(simple(uid, sid), v.target_for_uid(uid))
        .unwrap();
    reg.mark_active(h).unwrap();
    h
}

/// A three-node view (slot ids 64, term 1) and the same view with the hash slots
/// of `moved_uids` led by node 3 at the next term (revision + 1).
fn views(moved_uids: &[&str]) -> (ClusterView, ClusterView) {
    let v1 = ClusterView::initial(&[1, 2, 3], 64).unwrap();
    let mut v2 = v1.clone();
    for uid in moved_uids {
        let s = &mut v2.slots[hash_slot(uid.as_bytes()) as usize];
        if s.leader_term == 1 {
            s.leader_node_id = if s.leader_node_id == 3 { 2 } else { 3 };
            s.leader_term = 2;
        }
    }
    v2.revision += 1;
    (v1, v2)
}

fn limits(per_s: u32, burst: u32, batch: usize) -> RebuildLimits {
    RebuildLimits {
        routes_per_s: per_s,
        burst_routes: burst,
        batch_routes_max: batch,
    }
}

fn sids(batches: &[(Target, Vec<Route>)]) -> Vec<u64> {
    batches
        .iter()
        .flat_map(|(_, rs)| rs.iter().map(|r| r.session_id))
        .collect()
}

/// Uids `{prefix}{n}` whose hash slots differ from each other and from `avoid`'s.
fn uids_in_distinct_slots(prefix: &str, n: usize, avoid: &[&str]) -> Vec<String> {
    let mut seen: Vec<u16> = avoid.iter().map(|u| hash_slot(u.as_bytes())).collect();
    let mut out = Vec::new();
    for i in 0.. {
        let u = format!("{prefix}{i}");
        let s = hash_slot(u.as_bytes());
        if !seen.contains(&s) {
            seen.push(s);
            out.push(u);
            if out.len() == n {
                break;
            }
        }
    }
    out
}

#[test]
fn only_active_sessions_of_moved_slots_are_queued_once() {
    let u = uids_in_distinct_slots("q", 4, &[]);
    let (moving, staying, closing, pending) = (&u[0], &u[1], &u[2], &u[3]);
    let (v1, v2) = views(&[moving, closing, pending]);
    let mut reg = registry();
    let a = active(&mut reg, &v1, moving, 1);
    let a2 = active(&mut reg, &v1, moving, 2);
    let b = active(&mut reg, &v1, staying, 3);
    let c = active(&mut reg, &v1, closing, 4);
    reg.mark_closing(c).unwrap();
    let p = reg
        .register_pending(simple(pending, 5), v1.target_for_uid(pending))
        .unwrap();

    // A revision-only change moves nothing.
    let mut same = v1.clone();
    same.revision += 1;
    assert_eq!(reg.queue_rebuild(&v1, &same, 10), 0);
    assert_eq!(reg.stats().rebuild_queued, 0);

    assert_eq!(reg.queue_rebuild(&v1, &v2, 1_000), 2);
    assert!(reg.is_queued_for_rebuild(a) && reg.is_queued_for_rebuild(a2));
    assert!(!reg.is_queued_for_rebuild(b) && !reg.is_queued_for_rebuild(c));
    assert!(!reg.is_queued_for_rebuild(p), "pending: queued when active");
    // The same move seen again (or a later view) does not queue twice.
    let mut v3 = v2.clone();
    v3.revision += 1;
    v3.slots[hash_slot(moving.as_bytes()) as usize].leader_term += 1;
    assert_eq!(reg.queue_rebuild(&v2, &v3, 1_100), 0);
    assert_eq!(reg.rebuild_queued(), 2);
}

#[test]
fn a_session_pending_under_the_old_target_is_queued_when_it_becomes_active() {
    let u = uids_in_distinct_slots("p", 2, &[]);
    let (v1, v2) = views(&[&u[0], &u[1]]);
    let mut reg = registry();
    let old = reg
        .register_pending(simple(&u[0], 1), v1.target_for_uid(&u[0]))
        .unwrap();
    // Registered under the new view's target already: nothing to rebuild.
    let new = reg
        .register_pending(simple(&u[1], 2), v2.target_for_uid(&u[1]))
        .unwrap();
    assert_eq!(reg.queue_rebuild(&v1, &v2, 500), 0);
    assert_eq!(reg.stats().rebuild_queued, 0);
    reg.mark_active(old).unwrap();
    reg.mark_active(new).unwrap();
    assert!(reg.is_queued_for_rebuild(old));
    assert!(!reg.is_queued_for_rebuild(new));
    // The round runs from the view's arrival.
    let l = limits(100, 100, 16);
    let out = reg.drain_rebuild(&v2, 800, &l);
    assert_eq!(sids(&out), vec![1]);
    assert_eq!(out[0].0, v2.target_for_uid(&u[0]));
    assert_eq!(reg.stats().rebuild_last_ms, Some(300));
}

#[test]
fn the_drain_is_bounded_by_its_token_bucket_and_batched_by_new_target() {
    // 12 sessions in three moved hash slots (4 each), 3 in a slot that stays.
    let u = uids_in_distinct_slots("t", 4, &[]);
    let (v1, v2) = views(&[&u[0], &u[1], &u[2]]);
    let mut reg = registry();
    let mut sid = 0;
    for uid in &u {
        for _ in 0..4 {
            sid += 1;
            active(&mut reg, &v1, uid, sid);
        }
    }
    assert_eq!(reg.queue_rebuild(&v1, &v2, 10_000), 12);
    // 1000 routes/s, a burst of 5, batches of at most 3 routes.
    let l = limits(1_000, 5, 3);
    let first = reg.drain_rebuild(&v2, 10_000, &l);
    assert_eq!(
        sids(&first),
        vec![1, 2, 3, 4, 5],
        "the full bucket, oldest first"
    );
    let sizes: Vec<usize> = first.iter().map(|(_, rs)| rs.len()).collect();
    assert_eq!(
        sizes,
        vec![3, 1, 1],
        "at most 3 a batch, one open batch per slot"
    );
    for (t, rs) in &first {
        for r in rs {
            assert_eq!(*t, v2.target_for_uid(&r.uid), "the new target");
            assert_eq!(r.last_active_s, Some(10), "activity: the drain's second");
        }
    }
    // 1 ms later: one token.
    assert_eq!(sids(&reg.drain_rebuild(&v2, 10_001, &l)), vec![6]);
    // The same instant again: none.
    assert!(reg.drain_rebuild(&v2, 10_001, &l).is_empty());
    // A long pause refills the bucket to its size only.
    assert_eq!(sids(&reg.drain_rebuild(&v2, 60_000, &l)).len(), 5);
    assert_eq!(reg.stats().rebuild_queued, 1);
    assert_eq!(reg.stats().rebuild_last_ms, None, "the round is still open");
    assert_eq!(sids(&reg.drain_rebuild(&v2, 60_001, &l)), vec![12]);
    let s = reg.stats();
    assert_eq!((s.rebuild_queued, s.routes_rebuilt), (0, 12));
    assert_eq!(s.rebuild_last_ms, Some(50_001));
}

#[test]
fn failed_rebuild_touches_are_requeued_only_if_still_current() {
    let u = uids_in_distinct_slots("f", 3, &[]);
    let (v1, v2) = views(&[&u[0], &u[1], &u[2]]);
    let mut reg = registry();
    let a = active(&mut reg, &v1, &u[0], 1);
    let b = active(&mut reg, &v1, &u[1], 2);
    let c = active(&mut reg, &v1, &u[2], 3);
    reg.queue_rebuild(&v1, &v2, 0);
    let l = limits(50_000, 50_000, 512);
    let sent = reg.drain_rebuild(&v2, 5, &l);
    assert_eq!(
        reg.stats().rebuild_last_ms,
        Some(5),
        "drained: round closed"
    );
    // b closed meanwhile; c reconnected (new session, same id: another owner_seq).
    reg.deactivate(b, 6);
    reg.unregister(c);
    let c2 = active(&mut reg, &v2, &u[2], 3);
    for (t, routes) in &sent {
        reg.touch_failed(*t, routes); // e.g. the new authority had not the view yet
    }
    let s = reg.stats();
    assert_eq!((s.rebuild_requeued, s.touches_dropped_stale), (1, 2));
    assert!(reg.is_queued_for_rebuild(a) && !reg.is_dirty(a));
    assert!(!reg.is_queued_for_rebuild(c2));
    // The reopened round is measured from the view's arrival.
    assert_eq!(sids(&reg.drain_rebuild(&v2, 1_005, &l)), vec![1]);
    assert_eq!(reg.stats().rebuild_last_ms, Some(1_005));

    // Once an ordinary touch carried the route, its failure goes to the dirty set.
    reg.mark_touched(a, 2);
    let touched = reg.drain_touches(&v2, 16);
    for (t, routes) in &touched {
        reg.touch_failed(*t, routes);
    }
    assert!(reg.is_dirty(a) && !reg.is_queued_for_rebuild(a));
    assert_eq!(reg.stats().rebuild_requeued, 1);
}

#[test]
fn a_session_leaving_takes_its_place_in_the_queue_with_it() {
    let u = uids_in_distinct_slots("l", 1, &[]);
    let (v1, v2) = views(&[&u[0]]);
    let mut reg = registry();
    let hs: Vec<_> = (1..=4)
        .map(|sid| active(&mut reg, &v1, &u[0], sid))
        .collect();
    reg.queue_rebuild(&v1, &v2, 0);
    reg.mark_closing(hs[0]).unwrap();
    reg.deactivate(hs[1], 0);
    reg.unregister(hs[3]);
    assert_eq!(reg.rebuild_queued(), 1);
    let out = reg.drain_rebuild(&v2, 0, &limits(10, 10, 10));
    assert_eq!(sids(&out), vec![3]);
    assert_eq!(reg.rebuild_queued(), 0);
}

#[test]
fn a_view_that_moves_none_of_the_shards_sessions_reports_no_round() {
    let u = uids_in_distinct_slots("n", 1, &[]);
    let (v1, v2) = views(&[&u[0]]);
    let mut reg = registry();
    assert_eq!(reg.queue_rebuild(&v1, &v2, 100), 0);
    assert!(reg
        .drain_rebuild(&v2, 5_000, &limits(10, 10, 10))
        .is_empty());
    assert_eq!(
        reg.stats().rebuild_last_ms,
        None,
        "no rebuild round happened: none is reported"
    );
}
