//! The owner-local registry: handles, bounds, indexes, touches, revalidation and the
//! unregister queue.

// A test driver, outside the sans-IO boundary (clippy.toml): it may read seeds from
// the environment, time itself and run threads.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

#[path = "activation_common.rs"]
mod common;

use common::*;
use domain::cluster::ClusterView;
use domain::presence::registry::{
    Gone, RegisterError, Registry, RegistryConfigError, SessionHandle, SessionState,
    UnregisterQueueFull,
};
use domain::presence::route::{DeviceLevel, Route};

fn active(reg: &mut Registry, uid: &str, sid: u64) -> SessionHandle {
    let h = reg
        .register_pending(simple(uid, sid), view().target_for_uid(uid))
        .unwrap();
    reg.mark_active(h).unwrap();
    h
}

#[test]
fn config_is_validated() {
    let mut c = config();
    c.sessions_max = 0;
    assert_eq!(
        Registry::new(c).err(),
        Some(RegistryConfigError::MaxSessions)
    );
    let mut c = config();
    c.sessions_max = u32::MAX;
    assert_eq!(
        Registry::new(c).err(),
        Some(RegistryConfigError::MaxSessions)
    );
    let mut c = config();
    c.unregister_attempts_max = 0;
    assert_eq!(
        Registry::new(c).err(),
        Some(RegistryConfigError::UnregisterMaxAttempts)
    );
}

#[test]
fn a_gone_sessions_handle_never_reaches_the_next_session_in_its_slot() {
    let mut reg = registry();
    let old = active(&mut reg, "a", 1);
    assert_eq!(old.shard, SHARD);
    assert!(reg.unregister(old).is_some());
    let new = active(&mut reg, "b", 2);
    assert_eq!(new.index, old.index, "slot reused");
    assert_ne!(new.generation, old.generation);

    assert_eq!(reg.get(old), None);
    assert_eq!(reg.state(old), None);
    assert_eq!(reg.mark_active(old), Err(Gone));
    assert_eq!(reg.mark_closing(old), Err(Gone));
    assert!(!reg.mark_touched(old, 5));
    assert_eq!(reg.unregister(old), None);
    assert_eq!(reg.deactivate(old, 0), None);
    assert_eq!(reg.pending_unregisters(), 0);
    assert_eq!(reg.get(new).map(|i| &*i.uid), Some("b"));
    assert!(reg.mark_touched(new, 5));

    // A handle of another shard is refused.
    let foreign = SessionHandle {
        shard: SHARD + 1,
        ..new
    };
    assert_eq!(reg.get(foreign), None);
    assert!(!reg.mark_touched(foreign, 6));
}

#[test]
fn the_registry_is_bounded_and_refuses_duplicate_session_ids() {
    let mut c = config();
    c.sessions_max = 2;
    let mut reg = Registry::new(c).unwrap();
    let t = view().target_for_uid("a");
    let h1 = reg.register_pending(simple("a", 1), t).unwrap();
    assert_eq!(
        reg.register_pending(simple("a", 1), t),
        Err(RegisterError::DuplicateSession)
    );
    reg.register_pending(simple("a", 2), t).unwrap();
    assert_eq!(
        reg.register_pending(simple("a", 3), t),
        Err(RegisterError::Full)
    );
    assert_eq!(reg.len(), 2);
    reg.unregister(h1).unwrap();
    reg.register_pending(simple("a", 3), t).unwrap();
    assert_eq!(reg.len(), 2);
}

#[test]
fn state_transitions_pending_active_closing() {
    let mut reg = registry();
    let h = reg
        .register_pending(simple("a", 1), view().target_for_uid("a"))
        .unwrap();
    assert_eq!(reg.state(h), Some(SessionState::Pending));
    assert!(!reg.mark_touched(h, 1), "a pending session is not touched");
    reg.mark_active(h).unwrap();
    assert_eq!(reg.mark_active(h), Err(Gone), "already active");
    assert!(reg.mark_touched(h, 1));
    assert!(reg.is_dirty(h));
    reg.mark_closing(h).unwrap();
    assert_eq!(reg.state(h), Some(SessionState::Closing));
    assert!(!reg.is_dirty(h), "closing leaves the dirty set");
    assert!(!reg.mark_touched(h, 2));
    assert_eq!(reg.mark_active(h), Err(Gone));
    assert!(reg.drain_touches(&view(), 10).is_empty());
    // A closing session whose route was committed is unregistered at deactivation.
    reg.deactivate(h, 0).unwrap();
    assert_eq!(reg.pending_unregisters(), 1);
}

#[test]
fn owner_seq_is_monotonic_and_an_unregister_is_above_its_register() {
    let mut reg = registry();
    let a = active(&mut reg, "a", 1);
    let b = active(&mut reg, "a", 2);
    let sa = reg.get(a).unwrap().owner_seq;
    let sb = reg.get(b).unwrap().owner_seq;
    assert!(sa < sb);
    let info = reg.get(a).unwrap().clone();
    reg.deactivate(a, 0).unwrap();
    let req = &reg.drain_unregisters(&view(), 0, 8)[0];
    assert_eq!(req.identity, info.identity());
    assert!(req.owner_seq > sb && req.owner_seq > sa);
    // Touches carry the route owner_seq (the registration's).
    reg.mark_touched(b, 9);
    let batches = reg.drain_touches(&view(), 8);
    assert_eq!(batches[0].1[0].owner_seq, sb);
}

#[test]
fn the_uid_index_lists_the_sessions_of_a_uid_on_this_shard() {
    let mut reg = registry();
    let a1 = active(&mut reg, "a", 1);
    let b1 = active(&mut reg, "b", 2);
    let a2 = active(&mut reg, "a", 3);
    let a3 = active(&mut reg, "a", 4);
    let sorted = |reg: &Registry, uid: &str| {
        let mut v: Vec<_> = reg.sessions_of_uid(uid).collect();
        v.sort_by_key(|h| h.index);
        v
    };
    assert_eq!(sorted(&reg, "a"), vec![a1, a2, a3]);
    assert_eq!(sorted(&reg, "b"), vec![b1]);
    assert_eq!(sorted(&reg, "zz"), vec![]);
    reg.unregister(a2).unwrap(); // middle
    assert_eq!(sorted(&reg, "a"), vec![a1, a3]);
    reg.unregister(a3).unwrap(); // head (newest first)
    assert_eq!(sorted(&reg, "a"), vec![a1]);
    reg.unregister(a1).unwrap();
    assert_eq!(sorted(&reg, "a"), vec![]);
    let a4 = active(&mut reg, "a", 5);
    assert_eq!(sorted(&reg, "a"), vec![a4]);
    assert_eq!(reg.handles().count(), 2);
    // find by identity (owner actions)
    let id = reg.get(a4).unwrap().identity();
    assert_eq!(reg.find(&id), Some(a4));
    let mut other_boot = id.clone();
    other_boot.boot_id += 1;
    assert_eq!(reg.find(&other_boot), None);
}

#[test]
fn revalidation_accepts_only_the_live_active_session_with_its_route_seq() {
    let mut reg = registry();
    let h = active(&mut reg, "a", 1);
    let seq = reg.get(h).unwrap().owner_seq;
    assert_eq!(reg.revalidate("a", BOOT, 1, seq), Some(h));
    assert_eq!(reg.revalidate("a", BOOT + 1, 1, seq), None, "old process");
    assert_eq!(reg.revalidate("a", BOOT, 2, seq), None, "unknown session");
    assert_eq!(reg.revalidate("b", BOOT, 1, seq), None, "other uid");
    assert_eq!(reg.revalidate("a", BOOT, 1, seq + 1), None, "owner_seq");
    assert_eq!(reg.revalidate("a", BOOT, 1, seq - 1), None, "owner_seq");

    let p = reg
        .register_pending(simple("a", 2), view().target_for_uid("a"))
        .unwrap();
    let pseq = reg.get(p).unwrap().owner_seq;
    assert_eq!(reg.revalidate("a", BOOT, 2, pseq), None, "pending");

    reg.mark_closing(h).unwrap();
    assert_eq!(reg.revalidate("a", BOOT, 1, seq), None, "closing");
    reg.deactivate(h, 0).unwrap();
    assert_eq!(reg.revalidate("a", BOOT, 1, seq), None, "gone");
    // Same session id again (a new session in the reused slot): the old endpoint's
    // owner_seq no longer matches.
    let again = active(&mut reg, "a", 1);
    assert_eq!(again.index, h.index);
    assert_eq!(reg.revalidate("a", BOOT, 1, seq), None, "stale seq");
    let nseq = reg.get(again).unwrap().owner_seq;
    assert_eq!(reg.revalidate("a", BOOT, 1, nseq), Some(again));
}

fn routes_of(batches: &[(domain::cluster::Target, Vec<Route>)]) -> Vec<u64> {
    batches
        .iter()
        .flat_map(|(_, rs)| rs.iter().map(|r| r.session_id))
        .collect()
}

#[test]
fn touch_failures_are_requeued_only_if_the_route_is_still_current() {
    let mut reg = registry();
    let v = view();
    let a = active(&mut reg, "a", 1);
    let b = active(&mut reg, "b", 2);
    let c = active(&mut reg, "c", 3);
    let d = active(&mut reg, "d", 4);
    let e = active(&mut reg, "e", 5);
    for h in [a, b, c, d, e] {
        reg.mark_touched(h, 50);
    }
    let batches = reg.drain_touches(&v, 16);
    let failed: Vec<Route> = batches.into_iter().flat_map(|(_, rs)| rs).collect();
    assert_eq!(failed.len(), 5);

    // a: still current (and touched again meanwhile at 60: the newer time wins).
    reg.mark_touched(a, 60);
    // b: gone. c: closing. d: replaced by a new session with the same session id.
    reg.deactivate(b, 0);
    reg.mark_closing(c).unwrap();
    reg.unregister(d);
    let d2 = active(&mut reg, "d", 4);
    // e: current, not touched since.
    let target = v.target_for_uid("a");
    reg.touch_failed(target, &failed);
    let stats = reg.stats();
    assert_eq!(stats.touches_requeued, 2);
    assert_eq!(stats.touches_dropped_stale, 3);
    assert!(reg.is_dirty(a) && reg.is_dirty(e) && !reg.is_dirty(d2));

    let again = reg.drain_touches(&v, 16);
    let mut got: Vec<(u64, Option<u64>)> = again
        .iter()
        .flat_map(|(_, rs)| rs.iter().map(|r| (r.session_id, r.last_active_s)))
        .collect();
    got.sort();
    assert_eq!(got, vec![(1, Some(60)), (5, Some(50))]);

    // A route of another process is never current.
    let mut foreign = failed[4].clone();
    foreign.boot_id += 1;
    reg.touch_failed(target, &[foreign]);
    assert!(!reg.is_dirty(e));
}

/// Routes their authority superseded name the sessions to close: only those still
/// current (live, active, same owner_seq, this process), each counted once.
#[test]
fn superseded_routes_name_only_current_sessions() {
    let mut reg = registry();
    let v = view();
    let a = active(&mut reg, "a", 1);
    let b = active(&mut reg, "b", 2);
    let c = active(&mut reg, "c", 3);
    let d = active(&mut reg, "d", 4);
    let e = active(&mut reg, "e", 5);
    for h in [a, b, c, d, e] {
        reg.mark_touched(h, 50);
    }
    let sent: Vec<Route> = (reg.drain_touches(&v, 16).into_iter())
        .flat_map(|(_, rs)| rs)
        .collect();
    let mut sent_by_sid = sent.clone();
    sent_by_sid.sort_by_key(|r| r.session_id);
    // b: gone; c: closing; d: another session now has its id.
    reg.deactivate(b, 0);
    reg.mark_closing(c).unwrap();
    reg.unregister(d);
    let d2 = active(&mut reg, "d", 4);
    // e's route is of another process.
    let mut foreign = sent_by_sid[4].clone();
    foreign.boot_id += 1;
    let routes = [&sent_by_sid[..4], &[foreign]].concat();
    assert_eq!(reg.superseded(&routes), vec![a]);
    assert_eq!(reg.stats().sessions_superseded, 1);
    // Nothing was changed: the driver ends the session itself.
    assert_eq!(reg.state(a), Some(SessionState::Active));
    assert_eq!(reg.state(d2), Some(SessionState::Active));
    assert_eq!(reg.superseded(&[]), Vec::<SessionHandle>::new());
}

#[test]
fn drain_is_bounded_fifo_and_groups_by_the_current_target_after_a_view_change() {
    let mut reg = registry();
    let uids = ["a", "b", "c", "d", "e", "f"];
    let mut hs = Vec::new();
    for (i, uid) in uids.iter().enumerate() {
        hs.push(active(&mut reg, uid, i as u64 + 1));
    }
    // A second session of "b" guarantees two routes in one group.
    let b2 = active(&mut reg, "b", 100);
    for &h in &hs {
        reg.mark_touched(h, 10);
    }
    reg.mark_touched(b2, 10);
    assert_eq!(reg.stats().dirty, 7);

    let v1 = view();
    let first = reg.drain_touches(&v1, 3);
    assert_eq!(routes_of(&first), vec![1, 2, 3], "oldest first, bounded");
    assert_eq!(reg.stats().dirty, 4);

    // Leadership of b's slot moves: its touches go to the new authority.
    let mut v2: ClusterView = view();
    let slot = v2.target_for_uid("b").hash_slot as usize;
    v2.slots[slot].leader_node_id = 9;
    v2.slots[slot].leader_term = 7;
    reg.mark_touched(hs[1], 11); // b again
    let rest = reg.drain_touches(&v2, 100);
    assert_eq!(routes_of(&rest).len(), 5);
    for (t, rs) in &rest {
        for r in rs {
            assert_eq!(*t, v2.target_for_uid(&r.uid));
        }
    }
    // Exactly one group per target; both b sessions in the new leader's group.
    let targets: std::collections::HashSet<_> = rest.iter().map(|(t, _)| *t).collect();
    assert_eq!(targets.len(), rest.len());
    let b_group = rest
        .iter()
        .find(|(t, _)| *t == v2.target_for_uid("b"))
        .unwrap();
    assert_eq!(b_group.0.leader_node_id, 9);
    let mut b_sids: Vec<_> = b_group.1.iter().map(|r| r.session_id).collect();
    b_sids.sort();
    assert_eq!(b_sids, vec![2, 100]);
    assert_eq!(reg.stats().dirty, 0);
    assert!(reg.drain_touches(&v2, 0).is_empty());
}

#[test]
fn the_unregister_queue_is_bounded_and_drains_due_entries_in_order() {
    let mut c = config();
    c.pending_unregisters_max = 2;
    let mut reg = Registry::new(c).unwrap();
    let a = active(&mut reg, "a", 1);
    let b = active(&mut reg, "b", 2);
    let ida = reg.get(a).unwrap().identity();
    let idb = reg.get(b).unwrap().identity();
    let s1 = reg.queue_unregister(ida.clone(), 100).unwrap();
    let s2 = reg.queue_unregister(idb.clone(), 200).unwrap();
    assert!(s2 > s1);
    assert_eq!(
        reg.queue_unregister(ida.clone(), 0),
        Err(UnregisterQueueFull)
    );
    // Deactivating with a full queue still removes the session locally.
    assert!(reg.deactivate(a, 0).is_some());
    assert_eq!(reg.stats().unregisters_dropped_full, 2);

    assert!(reg.drain_unregisters(&view(), 99, 8).is_empty(), "not due");
    let r = reg.drain_unregisters(&view(), 1_000, 1);
    assert_eq!(r.len(), 1, "bounded by requests_max");
    assert_eq!(r[0].identity, ida);
    let r = reg.drain_unregisters(&view(), 1_000, 8);
    assert_eq!(r[0].identity, idb);
    assert_eq!(reg.pending_unregisters(), 0);
}

#[test]
fn a_master_and_slave_of_other_devices_share_the_uid_index() {
    let mut reg = registry();
    let t = view().target_for_uid("u");
    let m = reg
        .register_pending(session("u", "d1", 1, DeviceLevel::Master, 1), t)
        .unwrap();
    let s = reg
        .register_pending(session("u", "d2", 2, DeviceLevel::Slave, 2), t)
        .unwrap();
    assert_eq!(reg.sessions_of_uid("u").count(), 2);
    assert_eq!(reg.get(m).unwrap().device_level, DeviceLevel::Master);
    assert_eq!(reg.get(s).unwrap().device_id.as_ref(), "d2");
    assert_eq!(reg.get(s).unwrap().node_id, NODE);
    assert_eq!(reg.get(s).unwrap().boot_id, BOOT);
}

#[test]
fn the_counters_an_operator_reads_count_sessions_and_queued_unregisters() {
    let mut reg = registry();
    assert!(reg.is_empty());
    assert_eq!(reg.stats().sessions, 0);
    let a = active(&mut reg, "a", 1);
    active(&mut reg, "b", 2);
    assert!(!reg.is_empty());
    assert_eq!((reg.len(), reg.stats().sessions), (2, 2));
    let identity = reg.get(a).unwrap().identity();
    assert!(reg.unregister(a).is_some());
    reg.queue_unregister(identity, 0).unwrap();
    let stats = reg.stats();
    assert_eq!((stats.sessions, stats.pending_unregisters), (1, 1));
    assert_eq!(reg.pending_unregisters(), 1);
}

#[test]
fn the_registry_section_is_validated_key_by_key() {
    use domain::presence::registry::RegistryLimits;
    assert_eq!(RegistryLimits::default().validate(), Ok(()));
    let zero = |f: fn(&mut RegistryLimits)| {
        let mut l = RegistryLimits::default();
        f(&mut l);
        l.validate().unwrap_err()
    };
    assert!(zero(|l| l.pending_unregisters_max = 0).contains("pending_unregisters_max"));
    assert!(zero(|l| l.unregister_attempts_max = 0).contains("unregister_attempts_max"));
    assert!(zero(|l| l.unregister_retry_base_ms = 0).contains("unregister_retry_base_ms"));
    let mut l = RegistryLimits {
        unregister_retry_base_ms: 100,
        unregister_retry_ms_max: 99,
        ..RegistryLimits::default()
    };
    assert!(l
        .validate()
        .unwrap_err()
        .contains("unregister_retry_ms_max"));
    l.unregister_retry_ms_max = 100;
    assert_eq!(l.validate(), Ok(()), "the cap may equal the base");
    l.unregister_retry_ms_max = 101;
    assert_eq!(l.validate(), Ok(()));
}

#[test]
fn a_shards_registry_takes_every_limit_of_the_section() {
    use domain::presence::registry::{RegistryConfig, RegistryLimits};
    let limits = RegistryLimits {
        pending_unregisters_max: 11,
        unregister_attempts_max: 12,
        unregister_retry_base_ms: 13,
        unregister_retry_ms_max: 14,
    };
    let c = RegistryConfig::with_limits(3, 7, 9, 10, &limits);
    assert_eq!(
        (
            c.sessions_max,
            c.pending_unregisters_max,
            c.unregister_attempts_max,
            c.unregister_retry_base_ms,
            c.unregister_retry_ms_max
        ),
        (10, 11, 12, 13, 14)
    );
}

#[test]
fn the_registrys_errors_say_what_went_wrong() {
    assert!(RegistryConfigError::MaxSessions
        .to_string()
        .contains("sessions_max"));
    assert!(RegistryConfigError::UnregisterMaxAttempts
        .to_string()
        .contains("unregister_attempts_max"));
    assert_eq!(RegisterError::Full.to_string(), "session registry full");
    assert_eq!(
        RegisterError::DuplicateSession.to_string(),
        "duplicate session id"
    );
    assert_eq!(Gone.to_string(), "session gone");
}

#[test]
fn a_failed_unregister_meeting_a_full_queue_is_dropped_and_counted() {
    let mut c = config();
    c.pending_unregisters_max = 1;
    let mut reg = Registry::new(c).unwrap();
    let a = active(&mut reg, "a", 1);
    let b = active(&mut reg, "b", 2);
    let ida = reg.get(a).unwrap().identity();
    let idb = reg.get(b).unwrap().identity();
    reg.queue_unregister(ida, 0).unwrap();
    let failed = reg.drain_unregisters(&view(), 1_000, 8).pop().unwrap();
    reg.queue_unregister(idb, 1_000).unwrap();
    let before = reg.stats().unregisters_dropped_full;
    reg.unregister_failed(failed, 1_000);
    assert_eq!(reg.stats().unregisters_dropped_full, before + 1);
    assert_eq!(reg.pending_unregisters(), 1, "the queue keeps its bound");
}
