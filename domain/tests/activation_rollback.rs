//! Every rollback path of the activation machine, and late replies.

// A test driver, outside the sans-IO boundary (clippy.toml): it may read seeds from
// the environment, time itself and run threads.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

#[path = "activation_common.rs"]
mod common;

use common::*;
use domain::presence::activation::{
    Activation, ActivationConfig, AuthorityRequest, Event, Failure, Outcome, Output,
    OwnerActionFailed, ReasonCode, Stage,
};
use domain::presence::registry::{Registry, SessionState};
use domain::presence::route::{AuthorityError, OwnerActionKind, PendingToken, RegisterOutcome};

const FAIL: [Output; 2] = [
    Output::SendConnack {
        reason: ReasonCode::SYSTEM_ERROR,
    },
    Output::CloseConnection,
];

fn abort_then_fail(a: &Activation, token: PendingToken) -> Vec<Output> {
    vec![
        Output::SendToAuthority {
            target: a.target(),
            request: AuthorityRequest::Abort { token },
        },
        FAIL[0].clone(),
        FAIL[1].clone(),
    ]
}

/// An activation of `uid` driven to `stage`; returns it and the token (if any).
fn at_stage(reg: &mut Registry, uid: &str, sid: u64, stage: Stage) -> (Activation, PendingToken) {
    let (mut a, _) = start(reg, simple(uid, sid), 0);
    let token = token_of(&a, 7);
    match stage {
        Stage::AwaitRegister => {}
        Stage::AwaitOwnerActions => {
            let out = step(
                &mut a,
                reg,
                Event::RegisterReply(Ok(RegisterOutcome::Pending {
                    token: token.clone(),
                    actions: vec![
                        action(uid, 500, OwnerActionKind::Close),
                        action(uid, 501, OwnerActionKind::KickThenClose),
                    ],
                })),
                1,
            );
            assert_eq!(out.len(), 2);
        }
        Stage::AwaitCommit => {
            step(
                &mut a,
                reg,
                Event::RegisterReply(Ok(RegisterOutcome::Pending {
                    token: token.clone(),
                    actions: vec![],
                })),
                1,
            );
        }
    }
    assert_eq!(a.stage(), Some(stage));
    (a, token)
}

fn assert_rolled_back(reg: &Registry, a: &Activation, unregister_queued: bool) {
    let h = a.handle().unwrap();
    assert_eq!(reg.get(h), None, "local session removed");
    assert_eq!(reg.handle_of(a.identity().session_id), None);
    assert_eq!(
        reg.has_pending_unregister(a.identity()),
        unregister_queued,
        "authority unregister queued?"
    );
    assert!(a.is_finished());
}

#[test]
fn registry_full_or_duplicate_session_fails_before_any_authority_call() {
    let mut cfg = config();
    cfg.sessions_max = 1;
    let mut reg = Registry::new(cfg).unwrap();
    let (first, out) = start(&mut reg, simple("a", 1), 0);
    assert_eq!(out.len(), 1);
    assert!(!first.is_finished());

    let (full, out) = start(&mut reg, simple("b", 2), 0);
    assert_eq!(out, FAIL.to_vec());
    assert_eq!(full.handle(), None);
    assert_eq!(
        full.outcome(),
        Some(Outcome::Failed {
            reason: ReasonCode::SYSTEM_ERROR,
            failure: Failure::RegistryFull
        })
    );
    assert_eq!(reg.len(), 1, "the first session is untouched");

    let mut reg = registry();
    let (_a, _) = start(&mut reg, simple("a", 1), 0);
    let (dup, out) = start(&mut reg, simple("b", 1), 0);
    assert_eq!(out, FAIL.to_vec());
    assert_eq!(
        dup.outcome().map(|o| matches!(
            o,
            Outcome::Failed {
                failure: Failure::DuplicateSession,
                ..
            }
        )),
        Some(true)
    );
    assert_eq!(reg.len(), 1);
    assert_eq!(reg.pending_unregisters(), 0);
}

#[test]
fn register_refused_not_leader_stale_tombstoned_full_rolls_back_locally_only() {
    for (err, code) in [
        (AuthorityError::NotLeader, 17),
        (AuthorityError::StaleTarget, 18),
        (AuthorityError::Tombstoned, 15),
        (AuthorityError::Full, 15),
        (AuthorityError::Unreachable, 15),
    ] {
        let mut reg = registry();
        let (mut a, _) = at_stage(&mut reg, "x", 1, Stage::AwaitRegister);
        let out = step(&mut a, &mut reg, Event::RegisterReply(Err(err)), 5);
        assert_eq!(
            out,
            vec![
                Output::SendConnack {
                    reason: ReasonCode(code)
                },
                Output::CloseConnection
            ]
        );
        assert_rolled_back(&reg, &a, false);
    }
}

#[test]
fn pending_reply_naming_another_identity_or_seq_fails_and_unregisters() {
    let mut reg = registry();
    let (mut a, _) = at_stage(&mut reg, "x", 1, Stage::AwaitRegister);
    let mut token = token_of(&a, 1);
    token.owner_seq += 1;
    let out = step(
        &mut a,
        &mut reg,
        Event::RegisterReply(Ok(RegisterOutcome::Pending {
            token,
            actions: vec![],
        })),
        5,
    );
    assert_eq!(out, FAIL.to_vec());
    assert_rolled_back(&reg, &a, true);
    assert!(matches!(
        a.outcome(),
        Some(Outcome::Failed {
            failure: Failure::BadRegisterReply,
            ..
        })
    ));
}

#[test]
fn too_many_owner_actions_aborts() {
    let mut reg = registry();
    let (mut a, _) = at_stage(&mut reg, "x", 1, Stage::AwaitRegister);
    let token = token_of(&a, 1);
    let actions = (0..65)
        .map(|i| action("x", 100 + i, OwnerActionKind::Close))
        .collect();
    let out = step(
        &mut a,
        &mut reg,
        Event::RegisterReply(Ok(RegisterOutcome::Pending {
            token: token.clone(),
            actions,
        })),
        5,
    );
    assert_eq!(out, abort_then_fail(&a, token));
    assert_rolled_back(&reg, &a, true);
    assert_eq!(
        a.outcome(),
        Some(Outcome::Failed {
            reason: ReasonCode::SYSTEM_ERROR,
            failure: Failure::TooManyOwnerActions
        })
    );
}

#[test]
fn exactly_max_owner_actions_are_performed() {
    // The limit is inclusive: `owner_actions_max` (64 by default) actions are asked
    // of their owners, one more fails (above).
    let mut reg = registry();
    let (mut a, _) = at_stage(&mut reg, "x", 1, Stage::AwaitRegister);
    let max = ActivationConfig::default().owner_actions_max;
    let actions: Vec<_> = (0..max as u64)
        .map(|i| action("x", 100 + i, OwnerActionKind::Close))
        .collect();
    let token = token_of(&a, 1);
    let out = step(
        &mut a,
        &mut reg,
        Event::RegisterReply(Ok(RegisterOutcome::Pending {
            token,
            actions: actions.clone(),
        })),
        5,
    );
    let expected: Vec<Output> = actions
        .into_iter()
        .enumerate()
        .map(|(i, action)| Output::PerformOwnerAction {
            index: i as u32,
            action,
        })
        .collect();
    assert_eq!(out, expected);
    assert_eq!(a.stage(), Some(Stage::AwaitOwnerActions));
}

#[test]
fn pending_without_actions_commits_at_once() {
    let mut reg = registry();
    let (mut a, _) = start(&mut reg, simple("x", 1), 0);
    let token = token_of(&a, 9);
    let out = step(
        &mut a,
        &mut reg,
        Event::RegisterReply(Ok(RegisterOutcome::Pending {
            token: token.clone(),
            actions: vec![],
        })),
        1,
    );
    assert_eq!(
        out,
        vec![Output::SendToAuthority {
            target: a.target(),
            request: AuthorityRequest::Commit { token }
        }]
    );
    assert_eq!(a.stage(), Some(Stage::AwaitCommit));
}

#[test]
fn owner_action_failed_aborts_at_the_authority_and_cleans_up_locally() {
    let mut reg = registry();
    let (mut a, token) = at_stage(&mut reg, "x", 1, Stage::AwaitOwnerActions);
    let out = step(
        &mut a,
        &mut reg,
        Event::OwnerActionDone {
            index: 0,
            result: Ok(()),
        },
        2,
    );
    assert!(out.is_empty());
    let out = step(
        &mut a,
        &mut reg,
        Event::OwnerActionDone {
            index: 1,
            result: Err(OwnerActionFailed),
        },
        3,
    );
    assert_eq!(out, abort_then_fail(&a, token));
    assert_rolled_back(&reg, &a, true);
    assert!(matches!(
        a.outcome(),
        Some(Outcome::Failed {
            failure: Failure::OwnerActionFailed,
            ..
        })
    ));
}

#[test]
fn duplicate_and_unknown_owner_acks_are_ignored() {
    let mut reg = registry();
    let (mut a, token) = at_stage(&mut reg, "x", 1, Stage::AwaitOwnerActions);
    let ok = |index| Event::OwnerActionDone {
        index,
        result: Ok(()),
    };
    assert!(step(&mut a, &mut reg, ok(0), 2).is_empty());
    assert!(step(&mut a, &mut reg, ok(0), 2).is_empty(), "duplicate");
    assert!(
        step(&mut a, &mut reg, ok(7), 2).is_empty(),
        "no such action"
    );
    assert_eq!(a.stage(), Some(Stage::AwaitOwnerActions));
    let out = step(&mut a, &mut reg, ok(1), 3);
    assert_eq!(
        out,
        vec![Output::SendToAuthority {
            target: a.target(),
            request: AuthorityRequest::Commit { token }
        }]
    );
}

#[test]
fn commit_not_ready_aborts_the_candidate_without_unregister() {
    let mut reg = registry();
    let (mut a, token) = at_stage(&mut reg, "x", 1, Stage::AwaitCommit);
    let out = step(
        &mut a,
        &mut reg,
        Event::CommitReply(Err(AuthorityError::NotReady)),
        5,
    );
    assert_eq!(out, abort_then_fail(&a, token));
    assert_rolled_back(&reg, &a, false);
}

/// Issue "Cluster defects…", item 8: a register whose answer was lost may have
/// made the route active at the authority; left alone it would be a ghost route
/// (online for its TTL, so the app skips its offline push).
#[test]
fn register_answer_lost_rolls_back_locally_and_unregisters_at_the_authority() {
    let mut reg = registry();
    let (mut a, _) = at_stage(&mut reg, "x", 1, Stage::AwaitRegister);
    let out = step(
        &mut a,
        &mut reg,
        Event::RegisterReply(Err(AuthorityError::Lost)),
        5,
    );
    assert_eq!(out, FAIL.to_vec());
    assert_rolled_back(&reg, &a, true);
}

/// Item 8: a commit whose answer was lost may have made the route active, or
/// left the candidate pending: both are undone.
#[test]
fn commit_answer_lost_aborts_the_candidate_and_unregisters_the_route() {
    let mut reg = registry();
    let (mut a, token) = at_stage(&mut reg, "x", 1, Stage::AwaitCommit);
    let out = step(
        &mut a,
        &mut reg,
        Event::CommitReply(Err(AuthorityError::Lost)),
        5,
    );
    assert_eq!(out, abort_then_fail(&a, token));
    assert_rolled_back(&reg, &a, true);
}

#[test]
fn commit_refused_superseded_or_stale_fails_without_abort() {
    for err in [
        AuthorityError::Superseded,
        AuthorityError::StaleTarget,
        AuthorityError::NotLeader,
        AuthorityError::Unreachable,
    ] {
        let mut reg = registry();
        let (mut a, _) = at_stage(&mut reg, "x", 1, Stage::AwaitCommit);
        let out = step(&mut a, &mut reg, Event::CommitReply(Err(err)), 5);
        assert_eq!(out, FAIL.to_vec(), "{err:?}");
        assert_rolled_back(&reg, &a, false);
        assert_eq!(
            a.outcome(),
            Some(Outcome::Failed {
                reason: ReasonCode::SYSTEM_ERROR,
                failure: Failure::CommitRefused(err)
            })
        );
    }
}

#[test]
fn timeout_at_each_stage_rolls_back_both_sides() {
    for stage in [
        Stage::AwaitRegister,
        Stage::AwaitOwnerActions,
        Stage::AwaitCommit,
    ] {
        let mut reg = registry();
        let (mut a, token) = at_stage(&mut reg, "x", 1, stage);
        assert_eq!(a.deadline_ms(), 3_000);
        assert!(step(&mut a, &mut reg, Event::Tick, 2_999).is_empty());
        assert_eq!(a.stage(), Some(stage));
        assert_eq!(reg.state(a.handle().unwrap()), Some(SessionState::Pending));
        let out = step(&mut a, &mut reg, Event::Tick, 3_000);
        let expected = if stage == Stage::AwaitRegister {
            FAIL.to_vec()
        } else {
            abort_then_fail(&a, token)
        };
        assert_eq!(out, expected, "{stage:?}");
        assert_rolled_back(&reg, &a, true);
        assert_eq!(
            a.outcome(),
            Some(Outcome::Failed {
                reason: ReasonCode::SYSTEM_ERROR,
                failure: Failure::Timeout(stage)
            })
        );
    }
}

#[test]
fn session_closed_at_each_stage_rolls_back_both_sides() {
    for stage in [
        Stage::AwaitRegister,
        Stage::AwaitOwnerActions,
        Stage::AwaitCommit,
    ] {
        let mut reg = registry();
        let (mut a, token) = at_stage(&mut reg, "x", 1, stage);
        let out = step(&mut a, &mut reg, Event::SessionClosed, 10);
        let expected = if stage == Stage::AwaitRegister {
            FAIL.to_vec()
        } else {
            abort_then_fail(&a, token)
        };
        assert_eq!(out, expected, "{stage:?}");
        assert_rolled_back(&reg, &a, true);
        assert_eq!(
            a.outcome(),
            Some(Outcome::Failed {
                reason: ReasonCode::SYSTEM_ERROR,
                failure: Failure::SessionClosed(stage)
            })
        );
    }
}

#[test]
fn session_gone_locally_before_commit_aborts_instead_of_committing() {
    let mut reg = registry();
    let (mut a, token) = at_stage(&mut reg, "x", 1, Stage::AwaitOwnerActions);
    reg.deactivate(a.handle().unwrap(), 2).unwrap();
    step(
        &mut a,
        &mut reg,
        Event::OwnerActionDone {
            index: 0,
            result: Ok(()),
        },
        3,
    );
    let out = step(
        &mut a,
        &mut reg,
        Event::OwnerActionDone {
            index: 1,
            result: Ok(()),
        },
        3,
    );
    assert_eq!(out, abort_then_fail(&a, token), "no Commit is sent");
    assert_rolled_back(&reg, &a, true);
    assert!(matches!(
        a.outcome(),
        Some(Outcome::Failed {
            failure: Failure::SessionGone,
            ..
        })
    ));
}

#[test]
fn late_replies_after_the_end_are_ignored() {
    // After a success.
    let mut reg = registry();
    let (mut a, _) = at_stage(&mut reg, "x", 1, Stage::AwaitCommit);
    let out = step(&mut a, &mut reg, Event::CommitReply(Ok(())), 5);
    assert_eq!(
        out,
        vec![Output::SendConnack {
            reason: ReasonCode::SUCCESS
        }]
    );
    let h = a.handle().unwrap();
    for ev in [
        Event::CommitReply(Ok(())),
        Event::CommitReply(Err(AuthorityError::NotReady)),
        Event::RegisterReply(Ok(RegisterOutcome::Active)),
        Event::RegisterReply(Err(AuthorityError::StaleTarget)),
        Event::OwnerActionDone {
            index: 0,
            result: Err(OwnerActionFailed),
        },
        Event::AbortReply(Ok(())),
        Event::SessionClosed,
        Event::Tick,
    ] {
        assert!(step(&mut a, &mut reg, ev, 1_000_000).is_empty());
    }
    assert_eq!(reg.state(h), Some(SessionState::Active), "untouched");
    assert_eq!(a.outcome(), Some(Outcome::Active(h)));

    // After a timeout: a late Pending answer gets its candidate aborted; the rest is
    // ignored.
    let mut reg = registry();
    let (mut a, _) = at_stage(&mut reg, "x", 1, Stage::AwaitRegister);
    assert_eq!(connacks(&step(&mut a, &mut reg, Event::Tick, 3_000)), 1);
    let queued = reg.pending_unregisters();
    let token = token_of(&a, 3);
    let out = step(
        &mut a,
        &mut reg,
        Event::RegisterReply(Ok(RegisterOutcome::Pending {
            token: token.clone(),
            actions: vec![action("x", 9, OwnerActionKind::Close)],
        })),
        3_001,
    );
    assert_eq!(
        out,
        vec![Output::SendToAuthority {
            target: a.target(),
            request: AuthorityRequest::Abort { token }
        }]
    );
    // A late Pending answer that carries another session's token (another identity,
    // or this identity at another owner_seq) is not ours to abort.
    let mut other_identity = token_of(&a, 4);
    other_identity.identity.session_id += 1;
    let mut other_seq = token_of(&a, 5);
    other_seq.owner_seq += 1;
    for token in [other_identity, other_seq] {
        let pending = Event::RegisterReply(Ok(RegisterOutcome::Pending {
            token,
            actions: vec![],
        }));
        assert!(step(&mut a, &mut reg, pending, 3_002).is_empty());
    }
    for ev in [
        Event::RegisterReply(Ok(RegisterOutcome::Active)),
        Event::CommitReply(Ok(())),
        Event::Tick,
        Event::SessionClosed,
    ] {
        assert!(step(&mut a, &mut reg, ev, 3_002).is_empty());
    }
    assert!(reg.is_empty());
    assert_eq!(reg.pending_unregisters(), queued);
}

#[test]
fn an_abort_reply_changes_nothing_while_running() {
    let mut reg = registry();
    let (mut a, _) = at_stage(&mut reg, "x", 1, Stage::AwaitCommit);
    assert!(step(
        &mut a,
        &mut reg,
        Event::AbortReply(Err(AuthorityError::Superseded)),
        5
    )
    .is_empty());
    assert_eq!(a.stage(), Some(Stage::AwaitCommit));
}
