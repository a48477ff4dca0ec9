//! The hops of one shard, in the words of the flows, one dispatcher per side: every
//! request ([`super::wire::Request`]) from a shard of this node (`Msg::Request`) or
//! from another node (its frame) enters [`NodeShard::on_request`], which serves it
//! or hands it to the shard that does, and answers it with [`NodeShard::answer`]
//! (over the ring or on the link, as [`ReplyTo`] says); every answer, from the ring
//! (`Msg::Reply`) or a reply frame, enters [`NodeShard::on_reply`] with the
//! [`Pending`] its request left behind. A request goes to a shard of this node with
//! [`NodeShard::request_shard`] and to another node with
//! [`NodeShard::request_remote`]. The bytes and links are [`super::peers`]'s; the
//! bodies are [`super::wire`]'s.
//!
//! A request to another node holds a [`Pending`] in this shard's link to the node
//! (its in-flight table, bounded by `rpc_requests_in_flight_max`): the reply hands it
//! back, and a request that gets no answer (link down, table full, deadline passed,
//! link lost, peer restarted) gets what `domain::hop::on_no_answer` says, the answer
//! a refusal would give, at the end of the loop turn (`fail_remote_requests`); the
//! one exception, an owner action toward a node whose link is down counting as
//! done, at once.
//!
//! A request of another node is run only while its reply could still get back
//! before the request's deadline (where it is read, and where it is served when
//! another shard serves it), and its reply is sent only then
//! (`domain::hop::serve::in_time`; [`NodeShard::remote_in_time`],
//! [`NodeShard::reply_remote`]): the requester has failed it otherwise.

use net::io::NetDriver;
use proto::wkproto::ReasonCode;
use shard::runtime::Context;

use crate::activation::{Event, OwnerActionFailed};
use crate::cluster::{NodeId, Target};
use crate::route::{AuthorityError, BootId};

use super::msg::{Msg, Pending, Remote, ReplyHop, ReplyTo, RequestHop, SendAck};
use super::shard::{NodeShard, NodeTimer};
use super::wire;
use domain::hop::{self, HopKind, NoAnswer, NoAnswerAction as Action};
use domain::send::delivery::LookupReply;
use proto::rpc::link::Refused;

/// The hop a request's [`Pending`] waits for.
fn pending_kind(pending: &Pending) -> HopKind {
    match pending {
        Pending::Authority { .. } => HopKind::Authority,
        Pending::Touch { .. } => HopKind::Touch,
        Pending::OwnerAction { .. } => HopKind::OwnerAction,
        Pending::Send { .. } => HopKind::Send,
        Pending::Lookup { .. } => HopKind::Lookup,
        Pending::Token { .. } => HopKind::Token,
        Pending::Handover => HopKind::Handover,
        Pending::Api { .. } => HopKind::Api,
    }
}

impl NodeShard {
    /// Sends `request` to `node` on this shard's link; if the link refuses it (down,
    /// in-flight table full) it fails at the end of this turn.
    pub(super) fn request_remote(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        node: NodeId,
        request: wire::Request,
        pending: Pending,
    ) {
        self.request_remote_within(cx, node, request, pending, 0)
    }

    /// [`NodeShard::request_remote`] answered within `deadline_ms` (0: `[rpc]
    /// rpc_request_deadline_ms`).
    pub(super) fn request_remote_within(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        node: NodeId,
        request: wire::Request,
        pending: Pending,
        deadline_ms: u32,
    ) {
        let now_ms = cx.now_ms();
        let Err((pending, refused)) =
            self.peers
                .request(node, &request, pending, deadline_ms, now_ms)
        else {
            return;
        };
        let why = match refused {
            None | Some(Refused::Down) => NoAnswer::LinkDown,
            Some(Refused::Breaker(_)) => {
                self.metrics.rpc_requests_refused_breaker.inc();
                NoAnswer::LinkBusy
            }
            Some(_) => NoAnswer::LinkBusy,
        };
        let action = hop::on_no_answer(pending_kind(&pending), why);
        match (pending, action) {
            // Given at once, as the activation's other owner actions are.
            (Pending::OwnerAction { activation, index }, Action::OwnerActionDoneOwnerDown) => {
                self.metrics.owner_actions_owner_down.inc();
                let event = Event::OwnerActionDone {
                    index,
                    result: Ok(()),
                };
                self.local_events.push_back((activation, event));
            }
            (pending, _) => self.remote_failures.push((pending, why)),
        }
    }

    /// Answers a request of another node while in time for its deadline (held
    /// while the link to it is not up with the requesting process, see
    /// `peers/mod.rs`). A reply not sent fails at the requester's deadline there.
    pub(super) fn reply_remote(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        to: Remote,
        reply: wire::Reply,
    ) {
        use super::peers::ReplyOutcome as O;
        let latest_boot = self.shared.peer_boot_id(to.node);
        let clock = super::peers::Clocks {
            loop_ms: cx.now_ms(),
            node_ms: self.shared.mono_ms(),
        };
        let counter = match self.peers.reply(to, &reply, clock, latest_boot) {
            O::Sent => return,
            O::Held => &self.metrics.rpc_replies_held,
            O::Expired => &self.metrics.rpc_replies_expired,
            O::Full => &self.metrics.rpc_replies_held_full,
            O::Dropped => &self.metrics.rpc_replies_dropped,
        };
        counter.inc();
    }

    /// Whether a request of another node is still in time to be run (its reply
    /// could get back before its deadline); counted when it is not.
    pub(super) fn remote_in_time(&self, from: &Remote) -> bool {
        let margin = self.peers.reply_margin_ms();
        let now_ms = self.shared.mono_ms();
        let in_time = hop::serve::in_time(from.deadline_at_ms, now_ms, margin);
        if !in_time {
            self.metrics.rpc_requests_expired.inc();
        }
        in_time
    }

    /// A reply to one of this shard's requests (forwarded here by the shard whose
    /// inbound link read it). A reply whose request already failed, or from another
    /// process than the one asked, is dropped (counted by the link set).
    pub(super) fn on_remote_reply(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        from: (NodeId, BootId),
        request_id: u64,
        reply: wire::Reply,
    ) {
        let Some(pending) = self.peers.complete(from, request_id) else {
            return;
        };
        self.on_reply(cx, driver, pending, reply);
    }

    /// The answer to one of this shard's requests, from a shard of this node (over
    /// the ring) or from another node (its reply frame), with what the request left
    /// behind.
    pub(super) fn on_reply(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        pending: Pending,
        reply: wire::Reply,
    ) {
        use wire::Reply as R;
        match (pending, reply) {
            (Pending::Authority { corr, .. }, R::Authority(reply)) => {
                self.on_authority_reply(cx, corr, reply);
                self.drain_local_events(cx, driver);
            }
            (Pending::Touch { target, .. }, R::Touch(answer)) => {
                self.on_touch_answer(cx, driver, target, &answer)
            }
            (Pending::OwnerAction { activation, index }, R::OwnerAction(result)) => {
                let event = Event::OwnerActionDone { index, result };
                self.feed_activation(cx, driver, activation, event);
            }
            (
                Pending::Send {
                    conn,
                    session_id,
                    client_seq,
                },
                R::SendAck {
                    message_id,
                    message_seq,
                    reason,
                },
            ) => {
                let reason = ReasonCode(reason);
                let ack = SendAck {
                    conn,
                    session_id,
                    client_seq,
                    message_id,
                    message_seq,
                    reason,
                };
                self.on_sendack(driver, ack);
            }
            (Pending::Lookup { lookup_id }, R::Lookup { endpoints, results }) => {
                let reply = LookupReply::Found { endpoints, results };
                self.on_lookup_reply(lookup_id, reply);
            }
            (Pending::Token { conn, connect }, R::Token(level)) => {
                let checked = level.map_err(|()| ReasonCode::AUTH_FAIL);
                self.on_token_checked(cx, driver, conn, *connect, checked);
            }
            (Pending::Handover, R::Handover(result)) => {
                if let Err(e) = result {
                    self.metrics.handover_batches_refused.inc();
                    tracing::debug!(error = %e, "a handover batch refused by the new leader");
                }
            }
            (Pending::Api { answer }, R::Api { status, body }) => {
                // The API may have given up (its own timeout): nothing waits then.
                let _ = answer.send(Ok((status, body)));
            }
            (pending, reply) => {
                tracing::warn!(
                    ?reply,
                    "reply of another kind than its request: treated as failed"
                );
                self.remote_failures.push((pending, NoAnswer::Lost));
            }
        }
    }

    /// The requests that got no answer this turn get the answer the policy gives
    /// (`domain::hop::on_no_answer`: the answer a refusal would give).
    pub(super) fn fail_remote_requests(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
    ) -> usize {
        let mut lost = Vec::new();
        self.peers.take_failed(&mut lost);
        let mut failures = std::mem::take(&mut self.remote_failures);
        failures.extend(lost.into_iter().map(|p| (p, NoAnswer::Lost)));
        let n = failures.len();
        self.metrics.rpc_request_failures.add(n as u64);
        for (pending, why) in failures {
            let action = hop::on_no_answer(pending_kind(&pending), why);
            self.on_no_answer(cx, driver, pending, action);
        }
        n
    }

    /// Carries out the policy's action for a request that got no answer.
    fn on_no_answer(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        pending: Pending,
        action: Action,
    ) {
        match (pending, action) {
            (Pending::Authority { corr, kind }, Action::AuthorityFailed(error)) => {
                let reply = kind.failed(error);
                self.on_authority_reply(cx, corr, reply);
                self.drain_local_events(cx, driver);
            }
            (Pending::Touch { target, routes }, Action::RequeueTouch) => {
                self.registry.touch_failed(target, &routes)
            }
            (Pending::OwnerAction { activation, index }, action) => {
                let result = if action == Action::OwnerActionDoneOwnerDown {
                    self.metrics.owner_actions_owner_down.inc();
                    Ok(())
                } else {
                    Err(OwnerActionFailed)
                };
                let event = Event::OwnerActionDone { index, result };
                self.feed_activation(cx, driver, activation, event);
            }
            (
                Pending::Send {
                    conn,
                    session_id,
                    client_seq,
                },
                Action::SendAck(reason),
            ) => {
                let ack = SendAck {
                    conn,
                    session_id,
                    client_seq,
                    message_id: 0,
                    message_seq: 0,
                    reason,
                };
                self.on_sendack(driver, ack);
            }
            (Pending::Lookup { lookup_id }, Action::LookupFailed(failure)) => {
                let reply = LookupReply::Failed(failure);
                self.on_lookup_reply(lookup_id, reply);
            }
            (Pending::Token { conn, connect }, Action::Connack(reason)) => {
                self.on_token_checked(cx, driver, conn, *connect, Err(reason));
            }
            (Pending::Handover, Action::HandoverLost) => {
                self.metrics.handover_batches_lost.inc();
            }
            (Pending::Api { answer }, Action::ApiFailed(why)) => {
                let _ = answer.send(Err(why));
            }
            (pending, action) => {
                // The policy answers each kind with its own action (domain::hop's test).
                tracing::error!(kind = ?pending_kind(&pending), ?action, "no-answer action of another kind: dropped");
            }
        }
    }

    /// A request of another node, read by this shard's inbound link from it.
    pub(super) fn on_remote_request(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        from: Remote,
        request: wire::Request,
    ) {
        self.on_request(cx, driver, ReplyTo::Node(from), request);
    }

    /// A hop's request, from a shard of this node or from another node: served here,
    /// or handed to the shard of this node that serves it; answered to `reply_to`.
    pub(super) fn on_request(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        reply_to: ReplyTo,
        request: wire::Request,
    ) {
        // Read from a link, or handed here by the shard that read it: not run once
        // its answer could not get back in time (the requester gave it up).
        if let ReplyTo::Node(from) = &reply_to {
            if !self.remote_in_time(from) {
                return;
            }
        }
        let served_by = match &request {
            wire::Request::Authority { target, .. } | wire::Request::Touch { target, .. } => {
                self.shared.slot_map.shard_of(target.hash_slot)
            }
            wire::Request::Handover(b) => self.shared.slot_map.shard_of(b.target.hash_slot),
            _ => self.me,
        };
        if served_by != self.me {
            return self.hand_request(cx, served_by, reply_to, request);
        }
        match request {
            wire::Request::Authority { target, request } => {
                let reply = self.authority.serve(cx.now_ms(), &target, request);
                self.answer(cx, driver, reply_to, wire::Reply::Authority(reply));
            }
            wire::Request::Touch { target, routes } => {
                let answer = self.authority.serve_touch(cx.now_ms(), &target, routes);
                // A shard of this node needs an answer only if there is work in it.
                if !(answer.is_empty() && matches!(reply_to, ReplyTo::Shard(..))) {
                    self.answer(cx, driver, reply_to, wire::Reply::Touch(answer));
                }
            }
            wire::Request::OwnerAction { action } => {
                self.on_owner_action(cx, driver, reply_to, action)
            }
            wire::Request::Send(send) => self.on_forwarded_send(cx, driver, reply_to, *send),
            wire::Request::Token {
                uid,
                device_flag,
                token,
            } => {
                let level = super::connect::check_token(&self.shared, &uid, device_flag, &token);
                self.answer(cx, driver, reply_to, wire::Reply::Token(level));
            }
            wire::Request::Lookup { groups, uids } => {
                let reply = self.lookup_for_peer(&groups, &uids);
                self.answer(cx, driver, reply_to, reply);
            }
            wire::Request::Handover(batch) => {
                let result = self.authority.take_handover(cx.now_ms() / 1000, batch);
                self.answer(cx, driver, reply_to, wire::Reply::Handover(result));
            }
            wire::Request::Api(call) => self.on_api_request(cx, driver, reply_to, call),
        }
    }

    /// Answers a request: handled here if this shard asked it, over the ring to the
    /// shard of this node that asked it, or on the link to the node that asked it.
    pub(super) fn answer(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        reply_to: ReplyTo,
        reply: wire::Reply,
    ) {
        match reply_to {
            ReplyTo::Shard(shard, pending) if shard == self.me => {
                self.on_reply(cx, driver, pending, reply)
            }
            ReplyTo::Shard(shard, pending) => {
                let urgent = matches!(reply, wire::Reply::Authority(_));
                self.send_msg(cx, shard, Msg::Reply(Box::new(ReplyHop { pending, reply })));
                if urgent {
                    // A CONNACK waits for this answer (see `on_request`).
                    cx.flush_to(shard);
                }
            }
            ReplyTo::Node(remote) => self.reply_remote(cx, remote, reply),
        }
    }

    /// Sends a hop's request to shard `to` of this node, over the ring; its answer
    /// comes back as [`Msg::Reply`] with `pending`.
    pub(super) fn request_shard(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        to: slots::ShardId,
        request: wire::Request,
        pending: Pending,
    ) {
        let reply_to = ReplyTo::Shard(self.me, pending);
        self.hand_request(cx, to, reply_to, request);
    }

    /// Puts a hop's request on the ring to shard `to`, answered to `reply_to`. An
    /// authority call is handed over at once: it is on a CONNECT's critical path,
    /// and the rest of the turn may be a batch of key agreements.
    pub(super) fn hand_request(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        to: slots::ShardId,
        reply_to: ReplyTo,
        request: wire::Request,
    ) {
        let urgent = matches!(request, wire::Request::Authority { .. });
        self.send_msg(
            cx,
            to,
            Msg::Request(Box::new(RequestHop { reply_to, request })),
        );
        if urgent {
            cx.flush_to(to);
        }
    }

    /// EndpointsByTargets for another node: each group at its exact target, read
    /// lock-free from this node's tables (a stale group fails alone; one whose
    /// slot id's lease lapsed here answers `Rebuilding`). Groups whose range does
    /// not lie in `uids` (a peer's bad input) fail alone too.
    fn lookup_for_peer(
        &mut self,
        groups: &[(Target, std::ops::Range<usize>)],
        uids: &[crate::route::Uid],
    ) -> wire::Reply {
        let valid = |r: &std::ops::Range<usize>| r.start <= r.end && r.end <= uids.len();
        let lookups: Vec<(Target, &[crate::route::Uid])> = groups
            .iter()
            .map(|(t, r)| (*t, if valid(r) { &uids[r.clone()] } else { &[][..] }))
            .collect();
        let (mut endpoints, mut results) = (Vec::new(), Vec::new());
        self.reader
            .endpoints_by_targets_into(&lookups, &mut endpoints, &mut results);
        let targets = groups.iter().map(|(t, _)| t);
        let leased = |s| self.shared.authority_leased(s);
        let held = super::authority_side::hold_unleased(leased, targets, &mut results);
        self.metrics.authority_lease_refusals.add(held);
        for (result, (_, r)) in results.iter_mut().zip(groups) {
            if !valid(r) {
                *result = Err(AuthorityError::StaleTarget);
            }
        }
        wire::Reply::Lookup { endpoints, results }
    }

    /// A message of another node that needs no answer.
    pub(super) fn on_remote_oneway(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        message: wire::OneWay,
    ) {
        match message {
            wire::OneWay::Push {
                mut message,
                endpoints,
            } => {
                message.committed_ns = self.shared.mono_ns();
                self.on_remote_push(cx, driver, message, endpoints);
            }
            wire::OneWay::View(view) => self.on_remote_view(cx, driver, *view),
            // Taken by the link's reader before (`on_remote_raft`).
            wire::OneWay::Raft { .. } => {}
        }
    }

    /// An owner push from another node (the hop `Push`): the plaintext message and the
    /// exact endpoints, split by the shard that owns each session; each endpoint is
    /// revalidated there as any push is (an endpoint of another node or an earlier
    /// process of this one fails revalidation: counted stale, never written).
    fn on_remote_push(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        message: domain::send::commit::Committed,
        mut endpoints: Vec<crate::route::Endpoint>,
    ) {
        let (me_node, handed_ns) = (self.shared.config.node_id, message.committed_ns);
        let before = endpoints.len();
        let shards = self.shared.slot_map.shard_count();
        endpoints.retain(|ep| {
            ep.node_id == me_node && crate::delivery::session_shard(ep.session_id) < shards
        });
        self.metrics
            .push_stale
            .add((before - endpoints.len()) as u64);
        let message = std::sync::Arc::new(message);
        endpoints.sort_by_key(|ep| crate::delivery::session_shard(ep.session_id));
        for batch in endpoints.chunk_by(|a, b| {
            crate::delivery::session_shard(a.session_id)
                == crate::delivery::session_shard(b.session_id)
        }) {
            let owner = crate::delivery::session_shard(batch[0].session_id);
            if owner == self.me {
                let (owner, mut io) = self.owner_io(cx, driver);
                owner.on_push(&mut io, &message, batch, handed_ns);
            } else {
                let msg = Msg::Push {
                    message: message.clone(),
                    endpoints: batch.to_vec(),
                    handed_ns,
                };
                self.send_msg(cx, owner, msg);
            }
        }
    }
}
