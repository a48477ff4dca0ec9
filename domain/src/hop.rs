//! The hops between the roles of the cluster (gateway, authority, owner, home) as
//! the decisions see them: which hop a request is, and what it becomes when no
//! answer comes. The answer to a request that got none is the answer a refusal
//! would give, so that every requester machine has exactly one way to go on; the
//! whole policy is [`on_no_answer`], one table.
//!
//! A hop to a shard of the same node is carried by its ring, which never loses a
//! request silently (a full queue drops with a count, and each dropped hop has a
//! timer behind it); a hop to another node is carried by a link, which can refuse it
//! (the link is down, or its in-flight table is full) or lose it (the deadline
//! passed, the link closed, the peer restarted). The serving side of a hop from
//! another node (its deadline, replies held for a link not up) is [`serve`].

pub mod serve;

use proto::wkproto::ReasonCode;

use crate::presence::route::AuthorityError;
use crate::send::delivery::LookupFailure;

/// The kinds of request a hop carries (the replies mirror them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HopKind {
    /// Gateway → the target's authority: register, commit, abort or unregister.
    Authority,
    /// Gateway → authority: a TouchRoutes batch.
    Touch,
    /// New session's gateway → the old session's owner: kick or close it.
    OwnerAction,
    /// Gateway → the channel's home: a SEND; answered with its SENDACK.
    Send,
    /// Commit shard → an authority: EndpointsByTargets for a delivery page.
    Lookup,
    /// Gateway → the uid's home: check a CONNECT's token.
    Token,
    /// A hash slot's old authority → its new one: a batch of the routes it had
    /// (`presence::authority::HandoverBatch`).
    Handover,
    /// The HTTP API → another node's API: a request homed there (a token, a
    /// channel's messages or subscribers) or a share of one (online status, device
    /// quit); answered with the status and body its API gives.
    Api,
}

/// Why a request got no answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoAnswer {
    /// Not sent: the link to the node is down (or there is none).
    LinkDown,
    /// Not sent: the link's in-flight table is full.
    LinkBusy,
    /// Sent, and the answer will not come: the deadline passed, the link closed or
    /// the peer restarted.
    Lost,
}

/// What the requester does with a request that got no answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoAnswerAction {
    /// The authority call failed with this error: `Unreachable` when it was not
    /// sent (nothing changed there), `Lost` when it was (it may have been applied).
    /// An activation answers CONNACK 15 and rolls back what may exist; an unregister
    /// is retried later.
    AuthorityFailed(AuthorityError),
    /// The touch batch's routes are requeued.
    RequeueTouch,
    /// The owner action failed (the activation answers CONNACK 15).
    OwnerActionFailed,
    /// The owner action counts as done: the owner's node is down, and its
    /// sessions cannot be reached from this cluster while it is, so the new session
    /// replaces the old route (a client of a dead node logs in elsewhere at once, not
    /// after the old route's TTL). The one exception to rule 11; counted.
    OwnerActionDoneOwnerDown,
    /// The SEND is answered with this SENDACK reason.
    SendAck(ReasonCode),
    /// The lookup's groups fail (their recipients catch up by messagesync).
    LookupFailed(LookupFailure),
    /// The CONNECT is answered with this CONNACK reason.
    Connack(ReasonCode),
    /// The handover batch is not sent again: the new authority's wait for it ends
    /// at its deadline, its routes then come from the gateways' rebuild; counted.
    HandoverLost,
    /// The API request is answered 503 naming the node and why: no link to it
    /// (`LinkDown`), no room on the link (`LinkBusy`: retry), or the answer will
    /// not come (`Lost`: it may have been applied there).
    ApiFailed(NoAnswer),
}

/// The policy: what a request of `kind` that got no answer (`why`) becomes.
pub fn on_no_answer(kind: HopKind, why: NoAnswer) -> NoAnswerAction {
    match (kind, why) {
        (HopKind::Authority, NoAnswer::LinkDown | NoAnswer::LinkBusy) => {
            NoAnswerAction::AuthorityFailed(AuthorityError::Unreachable)
        }
        (HopKind::Authority, NoAnswer::Lost) => {
            NoAnswerAction::AuthorityFailed(AuthorityError::Lost)
        }
        (HopKind::Touch, _) => NoAnswerAction::RequeueTouch,
        (HopKind::OwnerAction, NoAnswer::LinkDown) => NoAnswerAction::OwnerActionDoneOwnerDown,
        (HopKind::OwnerAction, NoAnswer::LinkBusy | NoAnswer::Lost) => {
            NoAnswerAction::OwnerActionFailed
        }
        (HopKind::Send, _) => NoAnswerAction::SendAck(ReasonCode::FORWARD_SEND_PACKET_ERROR),
        (HopKind::Lookup, _) => NoAnswerAction::LookupFailed(LookupFailure::PeerDown),
        (HopKind::Token, _) => NoAnswerAction::Connack(ReasonCode::QUERY_TOKEN_ERROR),
        (HopKind::Handover, _) => NoAnswerAction::HandoverLost,
        (HopKind::Api, why) => NoAnswerAction::ApiFailed(why),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KINDS: [HopKind; 8] = [
        HopKind::Authority,
        HopKind::Touch,
        HopKind::OwnerAction,
        HopKind::Send,
        HopKind::Lookup,
        HopKind::Token,
        HopKind::Handover,
        HopKind::Api,
    ];

    #[test]
    fn every_request_without_an_answer_gets_the_answer_a_refusal_would() {
        use NoAnswerAction as A;
        for why in [NoAnswer::LinkDown, NoAnswer::LinkBusy, NoAnswer::Lost] {
            let got: Vec<NoAnswerAction> = KINDS.iter().map(|&k| on_no_answer(k, why)).collect();
            let owner = if why == NoAnswer::LinkDown {
                A::OwnerActionDoneOwnerDown
            } else {
                A::OwnerActionFailed
            };
            let authority = if why == NoAnswer::Lost {
                AuthorityError::Lost
            } else {
                AuthorityError::Unreachable
            };
            assert_eq!(
                got,
                vec![
                    A::AuthorityFailed(authority),
                    A::RequeueTouch,
                    owner,
                    A::SendAck(ReasonCode::FORWARD_SEND_PACKET_ERROR),
                    A::LookupFailed(LookupFailure::PeerDown),
                    A::Connack(ReasonCode::QUERY_TOKEN_ERROR),
                    A::HandoverLost,
                    A::ApiFailed(why),
                ],
                "{why:?}"
            );
        }
    }
}
