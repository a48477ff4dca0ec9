//! The authority's side of the hops it serves: one [`AuthorityRequest`] in, its
//! [`AuthorityReply`] out; one touch batch in, its [`TouchAnswer`] out. The driver
//! only carries them (a ring on one node, a link between nodes), so a simulation
//! and the node answer every call with the same code.

use crate::cluster::Target;
use crate::presence::activation::AuthorityRequest;
use crate::presence::route::{AuthorityError, RegisterOutcome, Route};

use super::{Authority, TouchResult};

/// An authority's answer to one [`AuthorityRequest`].
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum AuthorityReply {
    /// The answer to `Register`: active at once, pending with owner actions, or refused.
    Register(Result<RegisterOutcome, AuthorityError>),
    /// The answer to `Commit`: the candidate is active, or the refusal.
    Commit(Result<(), AuthorityError>),
    /// The answer to `Abort` (the activation ignores it).
    Abort(Result<(), AuthorityError>),
    /// The answer to `Unregister`; a refusal is retried by the registry's queue.
    Unregister(Result<(), AuthorityError>),
}

impl AuthorityReply {
    /// Whether the authority refused the call because it does not hold the exact
    /// target (`NotLeader`, `StaleTarget`: the caller's view is behind or ahead).
    pub fn is_stale_refusal(&self) -> bool {
        use AuthorityError::{NotLeader, StaleTarget};
        matches!(
            self,
            AuthorityReply::Register(Err(NotLeader | StaleTarget))
                | AuthorityReply::Commit(Err(NotLeader | StaleTarget))
                | AuthorityReply::Abort(Err(NotLeader | StaleTarget))
                | AuthorityReply::Unregister(Err(NotLeader | StaleTarget))
        )
    }
}

/// What the owner of a touch batch's routes learns from the authority, route by
/// route (the routes it sent, not copied when the answer goes back over the ring).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TouchAnswer {
    /// Not recorded now (the slot's route limit, or the whole batch refused):
    /// requeue them (`Registry::touch_failed`).
    pub requeue: Vec<Route>,
    /// Refused for good: the authority holds a newer registration of the identity
    /// (a conflicting active route, a higher owner_seq) or an unregister at or
    /// above it. Their sessions are no longer routed and never will be: the owner
    /// tells and closes them (`Registry::superseded`), or they would stay
    /// connected and receive nothing (a zombie).
    pub superseded: Vec<Route>,
}

impl TouchAnswer {
    /// Whether the owner has nothing to do with it (a shard of the same node is
    /// not answered then).
    pub fn is_empty(&self) -> bool {
        self.requeue.is_empty() && self.superseded.is_empty()
    }
}

impl Authority {
    /// Serves one authority call at `now_s` (rules 1–13 and 18–19 of
    /// `docs/authority-rules.md`).
    pub fn serve(
        &mut self,
        target: &Target,
        request: AuthorityRequest,
        now_s: u64,
    ) -> AuthorityReply {
        match request {
            AuthorityRequest::Register { route } => {
                AuthorityReply::Register(self.register_route(target, route, now_s))
            }
            AuthorityRequest::Commit { token } => {
                AuthorityReply::Commit(self.commit_route(target, &token, now_s))
            }
            AuthorityRequest::Abort { token } => {
                AuthorityReply::Abort(self.abort_route(target, &token, now_s))
            }
            AuthorityRequest::Unregister {
                identity,
                owner_seq,
            } => AuthorityReply::Unregister(
                self.unregister_route(target, &identity, owner_seq, now_s)
                    .map(|_| ()),
            ),
        }
    }

    /// Serves one touch batch at `now_s` (rules 14–17): what the owner must requeue.
    /// A batch refused as a whole (a fence error, too many routes) is requeued whole.
    pub fn serve_touch(&mut self, target: &Target, routes: Vec<Route>, now_s: u64) -> TouchAnswer {
        let results = match self.touch_routes(target, &routes, now_s) {
            Ok(results) => results,
            Err(_) => {
                return TouchAnswer {
                    requeue: routes,
                    superseded: Vec::new(),
                }
            }
        };
        let mut answer = TouchAnswer::default();
        for (route, result) in routes.into_iter().zip(results) {
            match result {
                TouchResult::Full => answer.requeue.push(route),
                TouchResult::IgnoredConflict
                | TouchResult::IgnoredStaleSeq
                | TouchResult::IgnoredTombstoned => answer.superseded.push(route),
                // Bad input (the uid is not of this slot): nothing the owner can do.
                TouchResult::WrongSlot | TouchResult::Refreshed | TouchResult::Recreated => {}
            }
        }
        answer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refusal for the target (the caller's view is off) is told apart from every
    /// other answer: the node counts them (`authority_stale_refusals`).
    #[test]
    fn only_target_refusals_are_stale() {
        use AuthorityError::*;
        let of = |r: Result<(), AuthorityError>| {
            [
                AuthorityReply::Register(r.map(|()| RegisterOutcome::Active)),
                AuthorityReply::Commit(r),
                AuthorityReply::Abort(r),
                AuthorityReply::Unregister(r),
            ]
        };
        for stale in [NotLeader, StaleTarget] {
            assert!(of(Err(stale)).iter().all(AuthorityReply::is_stale_refusal));
        }
        for other in [
            Ok(()),
            Err(Tombstoned),
            Err(NotReady),
            Err(Full),
            Err(Unreachable),
        ] {
            assert!(
                !of(other).iter().any(AuthorityReply::is_stale_refusal),
                "{other:?}"
            );
        }
    }
}
