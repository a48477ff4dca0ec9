//! The activation state machine: CONNECT → CONNACK, sans-IO, one [`Activation`] per
//! connecting session.
//!
//! Order (rule 28): register the session pending in the owner-local [`Registry`] →
//! `Register{route}` at the exact authority target → the owner actions the authority
//! asked for, if it answered `Pending` → `Commit{token}` → [`Registry::mark_active`] →
//! `CONNACK(Success)`.
//!
//! The driver feeds [`Event`]s (authority replies, owner-action results, the session's
//! close, timer ticks) with `now_ms` and a `&mut Registry` (the registry is local and
//! sans-IO too; the machine calls it directly), and executes the [`Output`]s it gets
//! back, in order. Each activation is named by an [`ActivationId`] the driver chooses,
//! **unique per process** (a counter): the driver tags every request it sends for the
//! activation with it and routes the reply back by it. Each request kind is sent at
//! most once per activation (owner actions carry their index), so `(id, kind, index)`
//! names a reply exactly.
//!
//! ## What every activation ends with
//! Exactly one [`Output::SendConnack`]: `ReasonCode::SUCCESS` once the session is active,
//! or a failure reason followed by [`Output::CloseConnection`] (also when the client
//! already closed: the driver drops what it cannot send). Every failure rolls back
//! both sides:
//!
//! - the local session is removed ([`Registry::unregister`]; rule 29);
//! - after a `Register` the authority did not refuse, the route may exist there
//!   (answered Active, answer still in flight, or a commit sent): an authority
//!   unregister is queued in the registry ([`Registry::queue_unregister`], drained
//!   with retries by [`Registry::drain_unregisters`]). Its owner_seq is above the
//!   route's, so its tombstone also fences a register or commit that arrives late
//!   (rules 12, 19, 30, 31). A refused `Register` or `Commit` skips it (the route
//!   never became active there; the abort below suffices), unless the refusal is
//!   [`AuthorityError::Lost`]: the call was sent and its answer lost, so it may
//!   have been applied, and the rollback is the one of an answered call;
//! - if the authority holds our pending candidate (we hold its token and did not get
//!   a commit success), `Abort{token}` is sent at once so the candidate goes now and
//!   the conflicting old routes stay (rule 11). Its reply is ignored.
//!
//! A `Register` the authority refused (any [`AuthorityError`] but `Lost`) changed
//! nothing there: only the local session is removed (rule 29). A refused `Commit` with `NotReady`
//! leaves the candidate pending, so it is aborted; `NotLeader`/`StaleTarget` mean the
//! authority's state for the slot is gone.
//!
//! Replies that arrive after the activation finished are ignored, except a late
//! `Pending` answer to our register: its candidate is aborted at once (the queued
//! unregister would also remove it).
//!
//! ## CONNACK reasons (WuKongIM codes, see `docs/wkproto.md`)
//! - register refused `NotLeader` → 17 NodeMatchError (this view names a node that
//!   does not lead the uid's slot); `StaleTarget` → 18 NodeNotMatch (the leader
//!   changed since the view); both tell the client to reconnect.
//! - everything else (registry full, duplicate session, `Tombstoned`, `Full`, owner
//!   action failed, commit refused, timeout, session gone or closed) → 15 SystemError.
//!
//! ## Timeout
//! One deadline per activation, `start + activation_timeout_ms` (default 3 s,
//! [`deadline_ms_for`]), checked on [`Event::Tick`] only: a reply that the driver
//! delivers is processed even if its tick is late. The driver arms the deadline's
//! timer before it starts the activation and refuses the CONNECT (CONNACK 15,
//! nothing registered) when it cannot: an activation without its tick would never
//! time out.
//!
//! Rule numbers refer to `docs/authority-rules.md` (each tested in
//! `domain/tests/authority_rules.rs` or `activation_rules.rs`).

use crate::cluster::{ClusterView, Target};
use crate::presence::registry::{NewSession, RegisterError, Registry, SessionHandle};
use crate::presence::route::{
    AuthorityError, OwnerAction, OwnerSeq, PendingToken, RegisterOutcome, RouteIdentity,
};

pub use proto::wkproto::ReasonCode;

/// Default for [`ActivationConfig::activation_timeout_ms`].
pub const DEFAULT_ACTIVATION_TIMEOUT_MS: u64 = 3_000;
/// Default for [`ActivationConfig::owner_actions_max`].
pub const DEFAULT_MAX_OWNER_ACTIONS: usize = 64;

/// Limits of activation.
#[derive(Clone, Copy, PartialEq, Eq, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ActivationConfig {
    /// From start to CONNACK, at most.
    pub activation_timeout_ms: u64,
    /// Most owner actions one `Pending` answer may ask for; more fails the activation.
    pub owner_actions_max: usize,
}

impl Default for ActivationConfig {
    fn default() -> Self {
        ActivationConfig {
            activation_timeout_ms: DEFAULT_ACTIVATION_TIMEOUT_MS,
            owner_actions_max: DEFAULT_MAX_OWNER_ACTIONS,
        }
    }
}

/// Correlation id of one activation, chosen by the driver, unique per process.
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, serde::Serialize, serde::Deserialize,
)]
pub struct ActivationId(pub u64);

pub use crate::presence::route::AuthorityRequest;

/// A command for the driver, to execute in order.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Output {
    /// Send `request` to the authority at `target`; route its reply back as an
    /// [`Event`].
    SendToAuthority {
        /// The exact authority identity of the uid's slot, fixed at start.
        target: Target,
        /// The call to make.
        request: AuthorityRequest,
    },
    /// Have the owner of `action.route` (its node `action.route.node_id`, maybe this
    /// one) perform `action`; report with [`Event::OwnerActionDone`] and this `index`.
    PerformOwnerAction {
        /// The action's place in the `Pending` answer's list, from 0.
        index: u32,
        /// What the owner does to which session.
        action: OwnerAction,
    },
    /// Send CONNACK with `reason` (exactly once per activation).
    SendConnack {
        /// `SUCCESS`, or the failure's code (17, 18 or 15; see the module docs).
        reason: ReasonCode,
    },
    /// Close the connection (after the failure CONNACK).
    CloseConnection,
}

/// The owner could not perform an owner action.
#[derive(Clone, Copy, PartialEq, Eq, Debug, serde::Serialize, serde::Deserialize)]
pub struct OwnerActionFailed;

/// An input of the machine.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Event {
    /// The authority's answer to `Register`.
    RegisterReply(Result<RegisterOutcome, AuthorityError>),
    /// The result of owner action `index`.
    OwnerActionDone {
        /// The `index` of the [`Output::PerformOwnerAction`] it answers; an unknown or
        /// repeated index is ignored.
        index: u32,
        /// Done (a session already gone counts), or failed: the activation aborts.
        result: Result<(), OwnerActionFailed>,
    },
    /// The authority's answer to `Commit`.
    CommitReply(Result<(), AuthorityError>),
    /// The authority's answer to `Abort` (ignored).
    AbortReply(Result<(), AuthorityError>),
    /// The connection closed (or was closed by an owner action) before CONNACK.
    SessionClosed,
    /// Timer tick: times the activation out at its deadline.
    Tick,
}

/// Where a running activation waits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Stage {
    /// `Register` sent, its answer not yet in.
    AwaitRegister,
    /// The authority answered `Pending`; some owner actions are not yet done.
    AwaitOwnerActions,
    /// `Commit` sent, its answer not yet in.
    AwaitCommit,
}

/// Why an activation failed.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Failure {
    /// The registry held `sessions_max` sessions.
    RegistryFull,
    /// The session id is already registered.
    DuplicateSession,
    /// The authority refused the register.
    RegisterRefused(AuthorityError),
    /// The `Pending` answer named another identity or owner_seq.
    BadRegisterReply,
    /// The `Pending` answer asked for more than `owner_actions_max` actions.
    TooManyOwnerActions,
    /// An owner could not perform its action.
    OwnerActionFailed,
    /// The authority refused the commit.
    CommitRefused(AuthorityError),
    /// The session was gone locally when it was to be committed or marked active.
    SessionGone,
    /// The connection closed while waiting at this stage.
    SessionClosed(Stage),
    /// The deadline passed while waiting at this stage.
    Timeout(Stage),
}

/// How a finished activation ended.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Outcome {
    /// The session is active; CONNACK Success was sent.
    Active(SessionHandle),
    /// Rolled back; CONNACK `reason` was sent and the connection closed.
    Failed {
        /// The CONNACK reason sent.
        reason: ReasonCode,
        /// Why it failed.
        failure: Failure,
    },
}

#[derive(Clone, Debug)]
enum State {
    AwaitRegister,
    AwaitOwnerActions {
        token: PendingToken,
        acked: Vec<bool>,
        remaining: usize,
    },
    AwaitCommit {
        token: PendingToken,
    },
    Done(Outcome),
}

/// One activation. See the module docs.
#[derive(Clone, Debug)]
pub struct Activation {
    id: ActivationId,
    handle: Option<SessionHandle>,
    identity: RouteIdentity,
    owner_seq: OwnerSeq,
    target: Target,
    deadline_ms: u64,
    owner_actions_max: usize,
    state: State,
}

/// The deadline of an activation started at `start_ms`.
pub fn deadline_ms_for(config: &ActivationConfig, start_ms: u64) -> u64 {
    start_ms.saturating_add(config.activation_timeout_ms)
}

/// CONNACK reason for a refused register.
pub fn register_refused_reason(error: AuthorityError) -> ReasonCode {
    match error {
        AuthorityError::NotLeader => ReasonCode::NODE_MATCH_ERROR,
        AuthorityError::StaleTarget => ReasonCode::NODE_NOT_MATCH,
        _ => ReasonCode::SYSTEM_ERROR,
    }
}

impl Activation {
    /// Starts the activation of `new` at `now_ms`: registers it pending in `registry`
    /// and sends `Register` to the target of its uid in `view`. If the registry
    /// refuses it, the activation is finished at once (CONNACK 15, close).
    pub fn start(
        id: ActivationId,
        config: &ActivationConfig,
        registry: &mut Registry,
        view: &ClusterView,
        new: NewSession,
        now_ms: u64,
        out: &mut Vec<Output>,
    ) -> Activation {
        let target = view.target_for_uid(&new.uid);
        let identity = RouteIdentity {
            uid: new.uid.clone(),
            node_id: registry.config().node_id,
            boot_id: registry.config().boot_id,
            session_id: new.session_id,
        };
        let mut activation = Activation {
            id,
            handle: None,
            identity,
            owner_seq: 0,
            target,
            deadline_ms: deadline_ms_for(config, now_ms),
            owner_actions_max: config.owner_actions_max,
            state: State::AwaitRegister,
        };
        match registry.register_pending(new, target) {
            Ok(handle) => {
                let Some(info) = registry.get(handle) else {
                    unreachable!("a just registered handle is live");
                };
                let route = info.route(Some(now_ms / 1000));
                activation.owner_seq = info.owner_seq;
                activation.handle = Some(handle);
                out.push(Output::SendToAuthority {
                    target,
                    request: AuthorityRequest::Register { route },
                });
            }
            Err(e) => {
                let failure = match e {
                    RegisterError::Full => Failure::RegistryFull,
                    RegisterError::DuplicateSession => Failure::DuplicateSession,
                };
                activation.fail(
                    registry,
                    failure,
                    ReasonCode::SYSTEM_ERROR,
                    None,
                    false,
                    now_ms,
                    out,
                );
            }
        }
        activation
    }

    /// This activation's id.
    pub fn id(&self) -> ActivationId {
        self.id
    }

    /// The local session, `None` if the registry refused it.
    pub fn handle(&self) -> Option<SessionHandle> {
        self.handle
    }

    /// The identity of the route being activated.
    pub fn identity(&self) -> &RouteIdentity {
        &self.identity
    }

    /// The route owner_seq (0 if the registry refused the session).
    pub fn owner_seq(&self) -> OwnerSeq {
        self.owner_seq
    }

    /// The exact authority target of register, commit and abort.
    pub fn target(&self) -> Target {
        self.target
    }

    /// When the activation times out.
    pub fn deadline_ms(&self) -> u64 {
        self.deadline_ms
    }

    /// Where it waits; `None` once finished.
    pub fn stage(&self) -> Option<Stage> {
        match self.state {
            State::AwaitRegister => Some(Stage::AwaitRegister),
            State::AwaitOwnerActions { .. } => Some(Stage::AwaitOwnerActions),
            State::AwaitCommit { .. } => Some(Stage::AwaitCommit),
            State::Done(_) => None,
        }
    }

    /// How it ended; `None` while running.
    pub fn outcome(&self) -> Option<Outcome> {
        match self.state {
            State::Done(o) => Some(o),
            _ => None,
        }
    }

    /// Whether it has ended (CONNACK emitted).
    pub fn is_finished(&self) -> bool {
        matches!(self.state, State::Done(_))
    }

    /// Feeds one event at `now_ms`; appends the resulting commands to `out`.
    pub fn handle_event(
        &mut self,
        registry: &mut Registry,
        event: Event,
        now_ms: u64,
        out: &mut Vec<Output>,
    ) {
        match event {
            Event::RegisterReply(reply) => self.on_register_reply(registry, reply, now_ms, out),
            Event::OwnerActionDone { index, result } => {
                self.on_owner_action_done(registry, index, result, now_ms, out)
            }
            Event::CommitReply(reply) => self.on_commit_reply(registry, reply, now_ms, out),
            Event::AbortReply(_) => {}
            Event::SessionClosed => self.on_interrupt(registry, false, now_ms, out),
            Event::Tick => {
                if now_ms >= self.deadline_ms {
                    self.on_interrupt(registry, true, now_ms, out)
                }
            }
        }
    }

    fn on_register_reply(
        &mut self,
        registry: &mut Registry,
        reply: Result<RegisterOutcome, AuthorityError>,
        now_ms: u64,
        out: &mut Vec<Output>,
    ) {
        match (&self.state, reply) {
            (State::AwaitRegister, Err(e)) => {
                // Rule 29: refused, nothing changed at the authority; but a lost
                // answer may hide a route made active there.
                self.fail(
                    registry,
                    Failure::RegisterRefused(e),
                    register_refused_reason(e),
                    None,
                    e == AuthorityError::Lost,
                    now_ms,
                    out,
                );
            }
            (State::AwaitRegister, Ok(RegisterOutcome::Active)) => {
                self.activate(registry, now_ms, out)
            }
            (State::AwaitRegister, Ok(RegisterOutcome::Pending { token, actions })) => {
                if !self.owns(&token) {
                    self.fail(
                        registry,
                        Failure::BadRegisterReply,
                        ReasonCode::SYSTEM_ERROR,
                        None,
                        true,
                        now_ms,
                        out,
                    );
                } else if actions.len() > self.owner_actions_max {
                    self.fail(
                        registry,
                        Failure::TooManyOwnerActions,
                        ReasonCode::SYSTEM_ERROR,
                        Some(token),
                        true,
                        now_ms,
                        out,
                    );
                } else if actions.is_empty() {
                    self.commit(registry, token, now_ms, out);
                } else {
                    let n = actions.len();
                    for (i, action) in actions.into_iter().enumerate() {
                        out.push(Output::PerformOwnerAction {
                            index: i as u32,
                            action,
                        });
                    }
                    self.state = State::AwaitOwnerActions {
                        token,
                        acked: vec![false; n],
                        remaining: n,
                    };
                }
            }
            (State::Done(Outcome::Failed { .. }), Ok(RegisterOutcome::Pending { token, .. }))
                if self.owns(&token) =>
            {
                // Late answer: drop the candidate now.
                out.push(Output::SendToAuthority {
                    target: self.target,
                    request: AuthorityRequest::Abort { token },
                });
            }
            _ => {} // duplicate or late: ignored
        }
    }

    fn on_owner_action_done(
        &mut self,
        registry: &mut Registry,
        index: u32,
        result: Result<(), OwnerActionFailed>,
        now_ms: u64,
        out: &mut Vec<Output>,
    ) {
        let State::AwaitOwnerActions {
            token,
            acked,
            remaining,
        } = &mut self.state
        else {
            return;
        };
        let Some(done) = acked.get_mut(index as usize) else {
            return; // no such action: ignored
        };
        if *done {
            return;
        }
        match result {
            Ok(()) => {
                *done = true;
                *remaining -= 1;
                if *remaining == 0 {
                    let token = token.clone();
                    self.commit(registry, token, now_ms, out);
                }
            }
            Err(OwnerActionFailed) => {
                // Rule 11 (owner side): abort, the old route stays.
                let token = token.clone();
                self.fail(
                    registry,
                    Failure::OwnerActionFailed,
                    ReasonCode::SYSTEM_ERROR,
                    Some(token),
                    true,
                    now_ms,
                    out,
                );
            }
        }
    }

    fn on_commit_reply(
        &mut self,
        registry: &mut Registry,
        reply: Result<(), AuthorityError>,
        now_ms: u64,
        out: &mut Vec<Output>,
    ) {
        let State::AwaitCommit { token } = &self.state else {
            return;
        };
        match reply {
            Ok(()) => self.activate(registry, now_ms, out),
            Err(e) => {
                // A refused commit changed nothing; NotReady leaves the candidate
                // pending (abort it); NotLeader/StaleTarget: the slot's state is gone;
                // Superseded: the candidate is gone. A lost answer may hide either
                // outcome: abort the candidate and unregister the route.
                let lost = e == AuthorityError::Lost;
                let abort = (e == AuthorityError::NotReady || lost).then(|| token.clone());
                self.fail(
                    registry,
                    Failure::CommitRefused(e),
                    ReasonCode::SYSTEM_ERROR,
                    abort,
                    lost,
                    now_ms,
                    out,
                );
            }
        }
    }

    /// Session closed (`timeout == false`) or deadline passed (`timeout == true`).
    fn on_interrupt(
        &mut self,
        registry: &mut Registry,
        timeout: bool,
        now_ms: u64,
        out: &mut Vec<Output>,
    ) {
        let (stage, abort) = match &self.state {
            State::AwaitRegister => (Stage::AwaitRegister, None),
            State::AwaitOwnerActions { token, .. } => {
                (Stage::AwaitOwnerActions, Some(token.clone()))
            }
            State::AwaitCommit { token } => (Stage::AwaitCommit, Some(token.clone())),
            State::Done(_) => return,
        };
        let failure = if timeout {
            Failure::Timeout(stage)
        } else {
            Failure::SessionClosed(stage)
        };
        // The register was sent and not refused: the route may exist (rule 30).
        self.fail(
            registry,
            failure,
            ReasonCode::SYSTEM_ERROR,
            abort,
            true,
            now_ms,
            out,
        );
    }

    fn commit(
        &mut self,
        registry: &mut Registry,
        token: PendingToken,
        now_ms: u64,
        out: &mut Vec<Output>,
    ) {
        let live = self
            .handle
            .and_then(|h| registry.state(h))
            .is_some_and(|s| s == crate::presence::registry::SessionState::Pending);
        if !live {
            // Do not make a route active for a session that is gone.
            self.fail(
                registry,
                Failure::SessionGone,
                ReasonCode::SYSTEM_ERROR,
                Some(token),
                true,
                now_ms,
                out,
            );
            return;
        }
        out.push(Output::SendToAuthority {
            target: self.target,
            request: AuthorityRequest::Commit {
                token: token.clone(),
            },
        });
        self.state = State::AwaitCommit { token };
    }

    /// The route is active at the authority: mark the session active (rule 31 if gone).
    fn activate(&mut self, registry: &mut Registry, now_ms: u64, out: &mut Vec<Output>) {
        let Some(handle) = self.handle else {
            return;
        };
        match registry.mark_active(handle) {
            Ok(()) => {
                out.push(Output::SendConnack {
                    reason: ReasonCode::SUCCESS,
                });
                self.state = State::Done(Outcome::Active(handle));
            }
            Err(_) => {
                self.fail(
                    registry,
                    Failure::SessionGone,
                    ReasonCode::SYSTEM_ERROR,
                    None,
                    true,
                    now_ms,
                    out,
                );
            }
        }
    }

    /// Rolls back and finishes: local session first, then the authority side, then
    /// CONNACK `reason` and close.
    #[allow(clippy::too_many_arguments)]
    fn fail(
        &mut self,
        registry: &mut Registry,
        failure: Failure,
        reason: ReasonCode,
        abort: Option<PendingToken>,
        unregister_authority: bool,
        now_ms: u64,
        out: &mut Vec<Output>,
    ) {
        debug_assert!(!self.is_finished());
        if let Some(handle) = self.handle {
            let _ = registry.unregister(handle);
        }
        if let Some(token) = abort {
            out.push(Output::SendToAuthority {
                target: self.target,
                request: AuthorityRequest::Abort { token },
            });
        }
        if unregister_authority {
            // A full queue drops it (counted): the route then expires by TTL.
            let _ = registry.queue_unregister(self.identity.clone(), now_ms);
        }
        tracing::debug!(
            activation = self.id.0,
            ?failure,
            reason = reason.0,
            "activation failed"
        );
        out.push(Output::SendConnack { reason });
        out.push(Output::CloseConnection);
        self.state = State::Done(Outcome::Failed { reason, failure });
    }

    fn owns(&self, token: &PendingToken) -> bool {
        token.identity == self.identity && token.owner_seq == self.owner_seq
    }
}
