//! Rules 28–33 of `docs/authority-rules.md`: activation and the owner-local registry.

// A test driver, outside the sans-IO boundary (clippy.toml): it may read seeds from
// the environment, time itself and run threads.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

#[path = "activation_common.rs"]
mod common;

use common::*;
use domain::presence::activation::{
    AuthorityRequest, Event, Failure, Outcome, Output, ReasonCode, Stage,
};
use domain::presence::registry::SessionState;
use domain::presence::route::{AuthorityError, OwnerActionKind, RegisterOutcome};

#[test]
fn rule_28_order_local_pending_then_register_then_owner_actions_then_commit_then_active_then_connack(
) {
    let mut reg = registry();
    let (mut a, out) = start(&mut reg, simple("alice", 10), 5_000);
    let h = a.handle().expect("registered");

    // 1. Registered pending locally before anything is sent; invisible to delivery.
    assert_eq!(reg.state(h), Some(SessionState::Pending));
    let info = reg.get(h).unwrap().clone();
    assert_eq!(reg.revalidate("alice", BOOT, 10, info.owner_seq), None);

    // 2. Register at the exact target of the uid, carrying the route owner_seq.
    let target = view().target_for_uid("alice");
    assert_eq!(out.len(), 1);
    match &out[0] {
        Output::SendToAuthority {
            target: t,
            request: AuthorityRequest::Register { route },
        } => {
            assert_eq!(*t, target);
            assert_eq!(route.identity(), info.identity());
            assert_eq!(route.owner_seq, info.owner_seq);
            assert_eq!(route.last_active_s, Some(5));
        }
        o => panic!("expected Register, got {o:?}"),
    }
    assert_eq!(info.target, target);

    // 3. Pending with owner actions: the actions go out, nothing else.
    let token = token_of(&a, 42);
    let acts = vec![
        action("alice", 900, OwnerActionKind::KickThenClose),
        action("alice", 901, OwnerActionKind::Close),
    ];
    let out = step(
        &mut a,
        &mut reg,
        Event::RegisterReply(Ok(RegisterOutcome::Pending {
            token: token.clone(),
            actions: acts.clone(),
        })),
        5_010,
    );
    assert_eq!(
        out,
        vec![
            Output::PerformOwnerAction {
                index: 0,
                action: acts[0].clone()
            },
            Output::PerformOwnerAction {
                index: 1,
                action: acts[1].clone()
            },
        ]
    );
    assert_eq!(a.stage(), Some(Stage::AwaitOwnerActions));

    // 4. Commit only after every action is acknowledged.
    let out = step(
        &mut a,
        &mut reg,
        Event::OwnerActionDone {
            index: 1,
            result: Ok(()),
        },
        5_020,
    );
    assert!(out.is_empty());
    let out = step(
        &mut a,
        &mut reg,
        Event::OwnerActionDone {
            index: 0,
            result: Ok(()),
        },
        5_030,
    );
    assert_eq!(
        out,
        vec![Output::SendToAuthority {
            target,
            request: AuthorityRequest::Commit { token }
        }]
    );
    assert_eq!(reg.state(h), Some(SessionState::Pending));

    // 5. Commit succeeds → mark active → CONNACK Success, in that order.
    let out = step(&mut a, &mut reg, Event::CommitReply(Ok(())), 5_040);
    assert_eq!(
        out,
        vec![Output::SendConnack {
            reason: ReasonCode::SUCCESS
        }]
    );
    assert_eq!(reg.state(h), Some(SessionState::Active));
    assert_eq!(reg.revalidate("alice", BOOT, 10, info.owner_seq), Some(h));
    assert_eq!(a.outcome(), Some(Outcome::Active(h)));
    assert_eq!(reg.pending_unregisters(), 0);
}

#[test]
fn rule_29_authority_register_failure_removes_the_local_pending_session() {
    for (err, code) in [
        (AuthorityError::NotLeader, ReasonCode::NODE_MATCH_ERROR),
        (AuthorityError::StaleTarget, ReasonCode::NODE_NOT_MATCH),
        (AuthorityError::Tombstoned, ReasonCode::SYSTEM_ERROR),
        (AuthorityError::Full, ReasonCode::SYSTEM_ERROR),
    ] {
        let mut reg = registry();
        let (mut a, _) = start(&mut reg, simple("bob", 11), 0);
        let h = a.handle().unwrap();
        let out = step(&mut a, &mut reg, Event::RegisterReply(Err(err)), 1);
        assert_eq!(
            out,
            vec![
                Output::SendConnack { reason: code },
                Output::CloseConnection
            ],
            "{err:?}"
        );
        assert_eq!(reg.get(h), None, "local pending session removed");
        assert!(reg.is_empty());
        assert_eq!(reg.handle_of(11), None);
        assert_eq!(
            reg.pending_unregisters(),
            0,
            "a refused register changed nothing at the authority"
        );
        assert_eq!(
            a.outcome(),
            Some(Outcome::Failed {
                reason: code,
                failure: Failure::RegisterRefused(err)
            })
        );
    }
}

#[test]
fn rule_30_session_closing_during_activation_unregisters_its_authority_route() {
    let mut reg = registry();
    let (mut a, _) = start(&mut reg, simple("carol", 12), 0);
    let h = a.handle().unwrap();
    let route_seq = a.owner_seq();

    let out = step(&mut a, &mut reg, Event::SessionClosed, 10);
    assert_eq!(
        out,
        vec![
            Output::SendConnack {
                reason: ReasonCode::SYSTEM_ERROR
            },
            Output::CloseConnection
        ]
    );
    assert_eq!(reg.get(h), None);
    assert!(reg.has_pending_unregister(a.identity()));

    // The queued unregister goes to the current target, with a seq above the route's
    // (its tombstone also fences the register still in flight).
    let reqs = reg.drain_unregisters(&view(), 10, 16);
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].target, view().target_for_uid("carol"));
    assert_eq!(reqs[0].identity, *a.identity());
    assert!(reqs[0].owner_seq > route_seq);
    assert_eq!(
        reqs[0].request(),
        AuthorityRequest::Unregister {
            identity: a.identity().clone(),
            owner_seq: reqs[0].owner_seq
        }
    );

    // The register's late answer is ignored.
    let out = step(
        &mut a,
        &mut reg,
        Event::RegisterReply(Ok(RegisterOutcome::Active)),
        20,
    );
    assert!(out.is_empty());
    assert!(reg.is_empty());
    assert_eq!(
        a.outcome(),
        Some(Outcome::Failed {
            reason: ReasonCode::SYSTEM_ERROR,
            failure: Failure::SessionClosed(Stage::AwaitRegister)
        })
    );
}

#[test]
fn rule_31_mark_active_failing_queues_the_authority_unregister_and_cleans_local_state() {
    let mut reg = registry();
    let (mut a, _) = start(&mut reg, simple("dave", 13), 0);
    let h = a.handle().unwrap();
    // The connection vanished locally without the machine being told.
    assert!(reg.deactivate(h, 5).is_some());
    assert_eq!(
        reg.pending_unregisters(),
        0,
        "a pending session's authority side belongs to its activation"
    );

    let out = step(
        &mut a,
        &mut reg,
        Event::RegisterReply(Ok(RegisterOutcome::Active)),
        10,
    );
    assert_eq!(
        out,
        vec![
            Output::SendConnack {
                reason: ReasonCode::SYSTEM_ERROR
            },
            Output::CloseConnection
        ]
    );
    assert!(reg.is_empty());
    assert!(reg.has_pending_unregister(a.identity()));
    let reqs = reg.drain_unregisters(&view(), 10, 16);
    assert_eq!(reqs.len(), 1);
    assert!(reqs[0].owner_seq > a.owner_seq());
    assert_eq!(
        a.outcome(),
        Some(Outcome::Failed {
            reason: ReasonCode::SYSTEM_ERROR,
            failure: Failure::SessionGone
        })
    );

    // Same after a commit: the session was marked closing meanwhile.
    let (mut b, _) = start(&mut reg, simple("dave", 14), 20);
    let hb = b.handle().unwrap();
    let token = token_of(&b, 1);
    step(
        &mut b,
        &mut reg,
        Event::RegisterReply(Ok(RegisterOutcome::Pending {
            token,
            actions: vec![],
        })),
        21,
    );
    assert_eq!(b.stage(), Some(Stage::AwaitCommit));
    reg.mark_closing(hb).unwrap();
    let out = step(&mut b, &mut reg, Event::CommitReply(Ok(())), 22);
    assert_eq!(connacks(&out), 1);
    assert_eq!(reg.get(hb), None, "local state cleaned");
    assert!(reg.has_pending_unregister(b.identity()));
}

#[test]
fn rule_32_deactivation_removes_the_local_session_first_then_queues_the_unregister_with_retry() {
    let mut cfg = config();
    cfg.unregister_attempts_max = 3;
    cfg.unregister_retry_base_ms = 100;
    cfg.unregister_retry_ms_max = 150;
    let mut reg = domain::presence::registry::Registry::new(cfg).unwrap();
    let (mut a, _) = start(&mut reg, simple("erin", 15), 0);
    let h = a.handle().unwrap();
    step(
        &mut a,
        &mut reg,
        Event::RegisterReply(Ok(RegisterOutcome::Active)),
        1,
    );
    let seq = a.owner_seq();
    assert_eq!(reg.revalidate("erin", BOOT, 15, seq), Some(h));

    let info = reg.deactivate(h, 1_000).expect("live");
    // Delivery stops seeing it at once, before any authority round trip.
    assert_eq!(reg.revalidate("erin", BOOT, 15, seq), None);
    assert_eq!(reg.get(h), None);
    assert_eq!(reg.sessions_of_uid("erin").count(), 0);
    assert!(reg.has_pending_unregister(&info.identity()));

    // The target is the one current at drain time: the slot changed leader meanwhile.
    let mut v2 = view();
    let hs = v2.target_for_uid("erin").hash_slot as usize;
    v2.slots[hs].leader_node_id = 2;
    v2.slots[hs].leader_term += 1;
    let reqs = reg.drain_unregisters(&v2, 1_000, 16);
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].target, v2.target_for_uid("erin"));
    assert!(reqs[0].owner_seq > seq);
    assert_eq!(reqs[0].attempt, 0);
    let tomb = reqs[0].owner_seq;

    // Failure: retried after the backoff, same seq.
    reg.unregister_failed(reqs[0].clone(), 1_000);
    assert!(reg.drain_unregisters(&v2, 1_099, 16).is_empty());
    let reqs = reg.drain_unregisters(&v2, 1_100, 16);
    assert_eq!(reqs.len(), 1);
    assert_eq!((reqs[0].owner_seq, reqs[0].attempt), (tomb, 1));
    reg.unregister_failed(reqs[0].clone(), 2_000);
    assert!(reg.drain_unregisters(&v2, 2_149, 16).is_empty());
    let reqs = reg.drain_unregisters(&v2, 2_150, 16);
    assert_eq!(reqs[0].attempt, 2, "backoff capped at 150 ms");
    // The retry limit: abandoned after 3 attempts.
    reg.unregister_failed(reqs[0].clone(), 3_000);
    assert_eq!(reg.pending_unregisters(), 0);
    assert_eq!(reg.stats().unregisters_abandoned, 1);
}

#[test]
fn rule_33_ping_only_marks_the_session_touched_and_the_touch_worker_sends_batches() {
    let mut reg = registry();
    let v = view();
    let mut handles = Vec::new();
    for (i, uid) in ["u1", "u2", "u3"].iter().enumerate() {
        let (mut a, _) = start(&mut reg, simple(uid, 20 + i as u64), 0);
        let out = step(
            &mut a,
            &mut reg,
            Event::RegisterReply(Ok(RegisterOutcome::Active)),
            0,
        );
        assert_eq!(connacks(&out), 1);
        handles.push(a.handle().unwrap());
    }
    // PINGs: only the local dirty mark; repeated pings keep one entry per session.
    for s in 100..110 {
        for &h in &handles {
            assert!(reg.mark_touched(h, s));
        }
    }
    assert_eq!(reg.stats().dirty, 3);
    assert_eq!(reg.pending_unregisters(), 0);

    let batches = reg.drain_touches(&v, 64);
    let mut routes = Vec::new();
    for (t, rs) in &batches {
        for r in rs {
            assert_eq!(*t, v.target_for_uid(&r.uid));
            routes.push(r.clone());
        }
    }
    routes.sort_by_key(|r| r.session_id);
    assert_eq!(routes.len(), 3);
    for (r, &h) in routes.iter().zip(&handles) {
        let info = reg.get(h).unwrap();
        assert_eq!(r.identity(), info.identity());
        assert_eq!(r.owner_seq, info.owner_seq);
        assert_eq!(r.last_active_s, Some(109));
    }
    assert_eq!(reg.stats().dirty, 0);
    assert!(reg.drain_touches(&v, 64).is_empty(), "nothing new to send");
}
