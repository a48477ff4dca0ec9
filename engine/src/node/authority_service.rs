//! The presence authority as a service between shards: the calls a gateway makes
//! (register, commit, abort, unregister), their service on the shard that leads the
//! target's hash slot, and the replies; owner actions (the kick or close an
//! activation asks of the shard that owns the old session, requested and
//! performed); the touch worker (dirty routes flushed in bounded TouchRoutes
//! batches, queued unregisters drained) and its service; the expiry pass.
//!
//! What enters here: the authority, touch and owner-action hops (`wire::Request`s
//! served, `wire::Reply`s answered, through [`super::hops`]'s one dispatcher per
//! side); an activation's `SendToAuthority` and `PerformOwnerAction`
//! outputs (from [`super::connect`]); the `NodeTimer::TouchFlush` and
//! `NodeTimer::Expiry` timers. Replies for activations are queued in
//! `local_events` for [`super::connect`] to drain.
//!
//! Rule numbers: `docs/authority-rules.md`.

use net::io::NetDriver;
use proto::wkproto::ReasonCode;
use shard::runtime::Context;

use crate::activation::{ActivationId, AuthorityRequest, Event};
use crate::authority::TouchAnswer;
use crate::cluster::Target;
use crate::delivery::session_shard;
use crate::route::{OwnerAction, OwnerActionKind, Route, SessionId};

use super::msg::{AuthorityCall, AuthorityReply, Corr, Msg, Pending, ReplyTo};
use super::shard::{NodeShard, NodeTimer};
use super::wire;
use crate::route::AuthorityError;

impl NodeShard {
    /// Sends an authority call to the shard that leads `target`'s hash slot: on this
    /// node over the ring (or served here), on another node as a request to it.
    pub(super) fn call_authority(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        corr: Corr,
        target: Target,
        request: AuthorityRequest,
    ) {
        if target.leader_node_id != self.shared.config.node_id {
            if !self.peers.knows(target.leader_node_id) {
                // A view naming a node this one has no link to (not in
                // `[[cluster.nodes]]`): answered as not-leader, as a node would.
                let reply = AuthorityCall::of(&request).failed(AuthorityError::NotLeader);
                return self.on_authority_reply(cx, corr, reply);
            }
            let pending = Pending::Authority {
                corr,
                kind: AuthorityCall::of(&request),
            };
            let node = target.leader_node_id;
            return self.request_remote(
                cx,
                node,
                wire::Request::Authority { target, request },
                pending,
            );
        }
        let to = self.shared.slot_map.shard_of(target.hash_slot);
        if to == self.me {
            let reply = self.authority.serve(cx.now_ms(), &target, request);
            self.on_authority_reply(cx, corr, reply);
        } else {
            let pending = Pending::Authority {
                corr,
                kind: AuthorityCall::of(&request),
            };
            self.request_shard(
                cx,
                to,
                wire::Request::Authority { target, request },
                pending,
            );
        }
    }

    /// An authority reply: an activation's is queued as its event (the caller
    /// drains the queue); a failed unregister is retried later.
    pub(super) fn on_authority_reply(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        corr: Corr,
        reply: AuthorityReply,
    ) {
        match corr {
            Corr::Activation(aid) => {
                let event = match reply {
                    AuthorityReply::Register(r) => Event::RegisterReply(r),
                    AuthorityReply::Commit(r) => Event::CommitReply(r),
                    AuthorityReply::Abort(r) => Event::AbortReply(r),
                    AuthorityReply::Unregister(_) => return,
                };
                self.local_events.push_back((aid, event));
            }
            Corr::Unregister(request) => {
                if let AuthorityReply::Unregister(Err(err)) = reply {
                    tracing::debug!(%err, uid = %request.identity.uid, "authority unregister failed; retrying later");
                    self.registry.unregister_failed(*request, cx.now_ms());
                }
            }
        }
    }

    // ---------------------------------------------------------------- owner actions

    /// Routes an owner action to the shard that owns the old session: on this node
    /// over the ring, on another node as a request answered once it happened. An
    /// earlier process of this node (its connections died with it) needs nothing.
    pub(super) fn request_owner_action(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        aid: ActivationId,
        index: u32,
        action: OwnerAction,
    ) {
        let node = action.route.node_id;
        if node != self.shared.config.node_id {
            let pending = Pending::OwnerAction {
                activation: aid,
                index,
            };
            return self.request_remote(cx, node, wire::Request::OwnerAction { action }, pending);
        }
        if action.route.boot_id != self.shared.boot_id {
            let event = Event::OwnerActionDone {
                index,
                result: Ok(()),
            };
            return self.local_events.push_back((aid, event));
        }
        let owner = session_shard(action.route.session_id);
        if owner == self.me {
            self.perform_owner_action(cx, driver, &action);
            self.local_events.push_back((
                aid,
                Event::OwnerActionDone {
                    index,
                    result: Ok(()),
                },
            ));
        } else {
            let pending = Pending::OwnerAction {
                activation: aid,
                index,
            };
            self.request_shard(cx, owner, wire::Request::OwnerAction { action }, pending);
        }
    }

    /// An owner action (from a shard of this node or another node): performed on
    /// this node's session (this shard's, or handed to its shard) and answered.
    pub(super) fn on_owner_action(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        reply_to: ReplyTo,
        action: OwnerAction,
    ) {
        let local_process = action.route.boot_id == self.shared.boot_id;
        let owner = session_shard(action.route.session_id);
        if local_process && owner != self.me {
            let request = wire::Request::OwnerAction { action };
            return self.hand_request(cx, owner, reply_to, request);
        }
        if local_process {
            self.perform_owner_action(cx, driver, &action);
        }
        self.answer(cx, driver, reply_to, wire::Reply::OwnerAction(Ok(())));
    }

    /// Kicks (DISCONNECT 12, then close) or closes one of this shard's sessions.
    /// A session that is already gone counts as done.
    pub(crate) fn perform_owner_action(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        action: &OwnerAction,
    ) {
        self.end_session(cx, driver, action.route.session_id, action.kind);
        self.metrics.kicks.inc();
    }

    /// Ends one of this shard's sessions, if it is still connected: removed locally
    /// first (rule 32: delivery stops seeing it now, its authority unregister
    /// queued), then DISCONNECT 12 and close, or a close.
    fn end_session(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        session_id: SessionId,
        kind: OwnerActionKind,
    ) {
        let Some(id) = self.conns.of_session(session_id) else {
            return;
        };
        if let Some(handle) = self.conn(id).and_then(|c| c.handle) {
            self.registry.deactivate(handle, cx.now_ms());
        }
        self.conns.unbind_session(session_id);
        if let Some(c) = self.conn_mut(id) {
            c.handle = None;
        }
        match kind {
            OwnerActionKind::KickThenClose => {
                self.disconnect(
                    driver,
                    id,
                    ReasonCode::CONNECT_KICK,
                    "login on another device",
                );
            }
            OwnerActionKind::Close => self.close(driver, id),
        }
    }

    /// The answer to one of this shard's touch batches: its failures requeued;
    /// the sessions whose route the authority refused for good (a newer login of
    /// the device, an unregister) told with DISCONNECT 12 and closed: no longer
    /// routed, they would stay connected and receive nothing.
    pub(super) fn on_touch_answer(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        target: Target,
        answer: &TouchAnswer,
    ) {
        self.registry.touch_failed(target, &answer.requeue);
        for handle in self.registry.superseded(&answer.superseded) {
            let Some(session_id) = self.registry.get(handle).map(|i| i.session_id) else {
                continue;
            };
            tracing::debug!(
                session_id,
                ?target,
                "route superseded at its authority: closing"
            );
            self.end_session(cx, driver, session_id, OwnerActionKind::KickThenClose);
            self.metrics.sessions_superseded.inc();
        }
    }

    // ------------------------------------------------------- touch, unregister, expiry

    /// The touch worker: sends the routes due for rebuild
    /// ([`NodeShard::flush_rebuild`]) and the dirty routes in bounded TouchRoutes
    /// batches, and drains the queued authority unregisters.
    pub(super) fn flush_touches(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
    ) {
        self.flush_rebuild(cx, driver);
        let shared = self.shared.clone();
        let cfg = &shared.config.session;
        let batches = self
            .registry
            .drain_touches(&self.view, cfg.touch_batch_routes_max);
        for (target, routes) in batches {
            self.metrics.touches.add(routes.len() as u64);
            self.send_touch_batch(cx, driver, target, routes);
        }
        let requests =
            self.registry
                .drain_unregisters(&self.view, cx.now_ms(), cfg.unregister_batch_max);
        for request in requests {
            let target = request.target;
            let call = request.request();
            self.call_authority(cx, Corr::Unregister(Box::new(request)), target, call);
        }
    }

    /// The failover rebuild: the routes the registry's token bucket lets go now
    /// (`[session] rebuild_routes_per_s`), re-registered at the target current in
    /// this shard's view as TouchRoutes batches (the authority recreates a missing
    /// route that conflicts with nothing, rule 15; failures come back through
    /// `Registry::touch_failed`). Updates the rebuild gauges.
    pub(super) fn flush_rebuild(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
    ) {
        // Also when the queue is empty: that drain closes a round whose sessions
        // all left before their turn.
        let limits = self.shared.config.session.rebuild_limits();
        let batches = self
            .registry
            .drain_rebuild(&self.view, cx.now_ms(), &limits);
        for (target, routes) in batches {
            self.metrics.routes_rebuilt.add(routes.len() as u64);
            self.send_touch_batch(cx, driver, target, routes);
        }
        let stats = self.registry.stats();
        self.metrics
            .route_rebuild_queued
            .set(u64::from(stats.rebuild_queued));
        if let Some(ms) = stats.rebuild_last_ms {
            self.metrics.route_rebuild_last_ms.set(ms);
        }
    }

    /// Sends one TouchRoutes batch to the shard that leads `target`'s hash slot: to
    /// another node as a request, over the ring, or served here (its failures
    /// requeued at once).
    fn send_touch_batch(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        target: Target,
        routes: Vec<Route>,
    ) {
        if target.leader_node_id != self.shared.config.node_id {
            let pending = Pending::Touch {
                target,
                routes: routes.clone(),
            };
            let node = target.leader_node_id;
            self.request_remote(cx, node, wire::Request::Touch { target, routes }, pending);
            return;
        }
        let to = self.shared.slot_map.shard_of(target.hash_slot);
        if to == self.me {
            let answer = self.authority.serve_touch(cx.now_ms(), &target, routes);
            self.on_touch_answer(cx, driver, target, &answer);
        } else {
            // Over the ring only the failures come back (a dropped batch is requeued by
            // the next rebuild or touch): nothing to keep.
            let pending = Pending::Touch {
                target,
                routes: Vec::new(),
            };
            self.request_shard(cx, to, wire::Request::Touch { target, routes }, pending);
        }
    }

    /// The expiry pass: routes of this shard's slots not touched in time expire.
    pub(super) fn expire_routes(&mut self, cx: &mut Context<Msg, NodeTimer>) {
        self.authority.expire(cx.now_ms() / 1000);
        // Relays whose wait ran out are handed over by the pass.
        self.send_handovers(cx);
    }

    /// The handovers of the hash slots this shard's authority lost (by a view, or
    /// relayed by an expiry pass), in batches of at most `touch_batch_routes_max`
    /// routes (so a body within `touch_batch_bytes_max`, checked against the
    /// frame limit at start) to each new leader (`domain`'s `handover` module).
    pub(super) fn send_handovers(&mut self, cx: &mut Context<Msg, NodeTimer>) {
        let mut handovers = Vec::new();
        self.authority.take_handovers(&mut handovers);
        let routes_max = self.shared.config.session.touch_batch_routes_max;
        for h in handovers {
            let node = h.target.leader_node_id;
            for batch in h.into_batches(routes_max) {
                self.metrics.handover_batches_sent.inc();
                let request = super::wire::Request::Handover(batch);
                self.request_remote(cx, node, request, Pending::Handover);
            }
        }
    }
}
