//! The authority side of one shard: the presence directory of the hash slots this
//! shard leads (`domain`'s [`Authority`]), owned here and reached only through the
//! calls below. It serves the gateways' calls and touches, expires routes, applies
//! views and takes and hands over slots; after each change it publishes the route
//! changes to the `user.onlinestatus` webhook and its counters to `/metrics`.
//!
//! How the calls reach it (from this shard, the ring or a link) and where the
//! answers go is [`super::authority_service`]'s; the lock-free read side that
//! delivery planning uses is the [`AuthorityReader`] [`AuthoritySide::new`] gives
//! out.

use std::sync::Arc;

use slots::{HashSlot, ShardId};

use crate::activation::AuthorityRequest;
use crate::authority::{Authority, AuthorityReader, Handover, HandoverBatch, TouchAnswer};
use crate::cluster::{ClusterView, NodeId, Target};
use crate::route::{AuthorityError, Route};

use super::metrics::ShardMetrics;
use super::msg::{AuthorityCall, AuthorityReply};
use super::shared::NodeShared;

/// Lookups answered from this node's tables for `targets` (one result each, in
/// order): a group whose slot id's lease lapsed here (`leased`, given
/// [`NodeShared::authority_leased`]) answers `Rebuilding` instead of what the
/// tables hold, which may be stale once another leader can be elected: the
/// planner waits and looks up again (`[delivery] rebuild_wait_ms_max`), at the
/// leader the view then names.
pub fn hold_unleased<'a>(
    leased: impl Fn(u32) -> bool,
    targets: impl Iterator<Item = &'a Target>,
    results: &mut [Result<std::ops::Range<usize>, AuthorityError>],
) -> u64 {
    let mut held = 0;
    for (target, result) in targets.zip(results.iter_mut()) {
        if result.is_ok() && !leased(target.slot_id) {
            *result = Err(AuthorityError::Rebuilding);
            held += 1;
        }
    }
    held
}

/// The directory of this shard's hash slots (module docs).
pub struct AuthoritySide {
    authority: Authority,
    metrics: Arc<ShardMetrics>,
    shared: Arc<NodeShared>,
}

impl AuthoritySide {
    /// Shard `me`'s directory under `view`, and its read side.
    pub fn new(
        me: ShardId,
        shared: &Arc<NodeShared>,
        view: &ClusterView,
    ) -> std::io::Result<(AuthoritySide, AuthorityReader)> {
        let cfg = &shared.config;
        let my_slots: Vec<_> = shared.slot_map.slots_of(me).collect();
        let mut authority = Authority::new(cfg.authority.clone(), &shared.directory, &my_slots)
            .map_err(|e| std::io::Error::other(format!("authority: {e:?}")))?;
        authority.apply_view(view, cfg.node_id, 0);
        // The `user.onlinestatus` webhook's route changes, from this shard's slots.
        authority.record_presence(
            shared
                .webhooks
                .enabled(domain::webhook::EventKind::OnlineStatus),
        );
        let reader = authority.reader();
        let side = AuthoritySide {
            authority,
            metrics: shared.shard_metrics[me as usize].clone(),
            shared: shared.clone(),
        };
        Ok((side, reader))
    }

    /// Whether this node may serve `target`'s slot now
    /// ([`NodeShared::authority_leased`]: only under its group leader's lease
    /// where slot ids are replicated, so two authorities never serve one slot at
    /// once). A refusal is counted.
    fn leased(&self, target: &Target) -> bool {
        let holds = self.shared.authority_leased(target.slot_id);
        if !holds {
            self.metrics.authority_lease_refusals.inc();
            self.metrics.authority_stale_refusals.inc();
        }
        holds
    }

    /// One gateway call (register, commit, abort, unregister) on `target` at
    /// `now_ms`: refused `NotLeader` without the lease ([`AuthoritySide::leased`]).
    pub fn serve(
        &mut self,
        now_ms: u64,
        target: &Target,
        request: AuthorityRequest,
    ) -> AuthorityReply {
        if !self.leased(target) {
            return AuthorityCall::of(&request).failed(AuthorityError::NotLeader);
        }
        let reply = self.authority.serve(target, request, now_ms / 1000);
        self.publish_presence();
        if reply.is_stale_refusal() {
            self.metrics.authority_stale_refusals.inc();
        }
        reply
    }

    /// One touch batch at `now_ms`: what the owner does with its routes (all
    /// requeued without the lease, as for a fence error).
    pub fn serve_touch(&mut self, now_ms: u64, target: &Target, routes: Vec<Route>) -> TouchAnswer {
        if !self.leased(target) {
            return TouchAnswer {
                requeue: routes,
                superseded: Vec::new(),
            };
        }
        let answer = self.authority.serve_touch(target, routes, now_ms / 1000);
        self.publish_presence();
        answer
    }

    /// The expiry pass: routes not touched in time expire; the handover counters
    /// are published.
    pub fn expire(&mut self, now_s: u64) {
        let expired = self.authority.expire(now_s);
        self.metrics.expiries.add(expired as u64);
        let stats = self.authority.stats();
        self.metrics.handover_routes.set(stats.handover_routes);
        (self.metrics.handover_waits_expired).set(stats.handover_waits_expired);
        self.metrics.handovers_relayed.set(stats.handovers_relayed);
        self.metrics.handovers_ignored.set(stats.handovers_ignored);
        self.publish_presence();
    }

    /// Applies `view` (merged by the caller); a slot taken from a node in `down`
    /// waits for no handover from it, except where leaders are elected
    /// (`Homes::Leaders`): there a slot taken from a node that is down is a
    /// failover, and its wait (at most `[authority] handover_wait_s`) is the
    /// window in which the gateways register its sessions here again, so
    /// deliveries meanwhile wait for them (lookups answer "rebuilding") rather
    /// than find no route.
    pub fn apply_view(
        &mut self,
        view: &ClusterView,
        now_s: u64,
        down: impl Iterator<Item = NodeId>,
    ) {
        self.metrics.view_revision.set(view.revision);
        let node_id = self.shared.config.node_id;
        self.authority.apply_view(view, node_id, now_s);
        if view.homes == crate::cluster::Homes::Leaders {
            return;
        }
        for node in down {
            self.authority.end_waits_from(node);
        }
    }

    /// `node`'s link went down: the slots waiting for its handovers serve from what
    /// they have (the gateways' rebuild), now.
    pub fn end_waits_from(&mut self, node: NodeId) {
        self.authority.end_waits_from(node);
    }

    /// The handovers of the slots this shard lost (by a view, or relayed by an
    /// expiry pass), to send.
    pub fn take_handovers(&mut self, out: &mut Vec<Handover>) {
        self.authority.take_handovers(out);
    }

    /// A handover batch from the old leader of one of this shard's slots.
    pub fn take_handover(
        &mut self,
        now_s: u64,
        batch: HandoverBatch,
    ) -> Result<(), AuthorityError> {
        self.authority.take_handover(batch, now_s).map(|_| ())
    }

    /// Active routes of `slot` (a gauge).
    pub fn active_routes(&self, slot: HashSlot) -> u64 {
        self.authority.counts(slot).active_routes as u64
    }

    /// Rebuilds of the presence filter so far (a counter).
    pub fn filter_rebuilds(&self) -> u64 {
        self.authority.stats().filter_rebuilds
    }

    /// Hands the route changes since the last call to the `user.onlinestatus`
    /// webhook (recorded only when it is on). This node leads their hash slots: the
    /// one node that sends them.
    fn publish_presence(&mut self) {
        let mut changes = Vec::new();
        self.authority.take_presence(&mut changes);
        for change in changes {
            self.shared.webhooks.status(change);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A found group of a slot id without a lease answers `Rebuilding`; a leased
    /// one keeps its endpoints, and a refusal stays what it was.
    #[test]
    fn lookups_of_a_slot_id_without_its_lease_wait() {
        let target = |slot_id| Target {
            hash_slot: 0,
            slot_id,
            leader_node_id: 1,
            leader_term: 2,
            config_epoch: 1,
        };
        let targets = [target(1), target(2), target(2)];
        let mut results = vec![Ok(0..2), Ok(2..3), Err(AuthorityError::StaleTarget)];
        assert_eq!(hold_unleased(|s| s == 1, targets.iter(), &mut results), 1);
        let want = [
            Ok(0..2),
            Err(AuthorityError::Rebuilding),
            Err(AuthorityError::StaleTarget),
        ];
        assert_eq!(results, want);
    }
}
