//! `POST /cluster/slots/leader` where slot ids are replicated (`[cluster] replicas`
//! above 1): leadership transfers. Without replicas the request moves the named
//! hash slots in the view (`NodeShared::move_leaders`); with them a slot id's
//! leader is elected, so the request records the operator's choice in each
//! group and waits for the group to follow it.
//!
//! Contract:
//! - Each named hash slot's **slot id** moves, whole (its hash slots share one
//!   group). The new leader must be one of the slot id's replicas (400 naming
//!   them otherwise).
//! - The choice is a `CatalogOp::PreferLeader` committed in the slot id's own
//!   group, proposed at its leader (the request is passed to each leader this
//!   node's view names, one call per leader, at once): every replica knows it and
//!   a restart replays it, so the group's leader hands over to it once it is
//!   caught up, and a leader elected after a crash hands back to it
//!   (`node::raft`, `hand_over_to`). A draining node is skipped as ever.
//! - **200 only once the target leads**: each leader answers once its replicas
//!   name the target leader of its slot ids, this node once its view names the
//!   target for every hash slot moved (the new leader's claim reached it); the
//!   answer is `GET /cluster/slots` of that view. Each wait is bounded by half of
//!   `forward_timeout_ms`: past it 504, the choice stays committed (the group
//!   hands over once the target is caught up: read `GET /cluster/slots`). 503
//!   (retry) when the leader this node's view names cannot be reached, no longer
//!   leads, or changed before the commit; the other refusals as for a catalog
//!   change.
//! - `revision`, when given, must be the view's (409 otherwise), as without
//!   replicas.

use serde_json::json;

use super::drain::wait_until;
use super::{Api, ApiRequest, Reply};
use crate::cluster::{slot_id_of, NodeId};
use crate::node::catalog::CatalogOp;
use crate::node::raft::replica_nodes;

impl Api {
    /// The transfer of `hash_slots`' slot ids to `to` (module docs).
    pub(super) async fn transfer_leaders(
        &self,
        req: &ApiRequest<'_>,
        hash_slots: &[u16],
        to: NodeId,
    ) -> Result<Reply, Reply> {
        let slot_ids = self.slot_ids_to_move(hash_slots, to)?;
        let c = &self.shared.config.cluster;
        if req.forwarded_by.is_some() {
            self.prefer_here(&slot_ids, to).await?;
            return Ok(Reply::json(200, json!({ "slot_ids": slot_ids })));
        }
        // One call per leader this view names, at once; this node's share here.
        let view = self.shared.view();
        let mut legs: Vec<(NodeId, Vec<u32>)> = Vec::new();
        for &slot_id in &slot_ids {
            let slot = hash_slot_of(slot_id, c.slot_ids);
            let leader = view.target_for_slot(slot).leader_node_id;
            match legs.iter_mut().find(|(n, _)| *n == leader) {
                Some((_, ids)) => ids.push(slot_id),
                None => legs.push((leader, vec![slot_id])),
            }
        }
        let me = self.me();
        let mine = match legs.iter().position(|(n, _)| *n == me) {
            Some(i) => legs.swap_remove(i).1,
            None => Vec::new(),
        };
        let bodies: Vec<(NodeId, Vec<u8>)> = (legs.iter())
            .map(|(leader, ids)| {
                let slots: Vec<u16> = ids.iter().map(|&s| hash_slot_of(s, c.slot_ids)).collect();
                let body = json!({"hash_slots": slots, "leader_node_id": to});
                (*leader, body.to_string().into_bytes())
            })
            .collect();
        let (here, there) = tokio::join!(
            self.prefer_here(&mine, to),
            self.fan_out("slot id leader", req, &bodies)
        );
        here?;
        if let Some(failed) = there.into_iter().find(|r| r.status != 200) {
            return Err(failed);
        }
        let moved: Vec<u16> = (0..slots::HASH_SLOTS as u16)
            .filter(|&h| slot_ids.contains(&slot_id_of(h, c.slot_ids)))
            .collect();
        let timeout_ms = self.config.forward_timeout_ms / 2;
        let named = || {
            let view = self.shared.view();
            moved
                .iter()
                .all(|&h| view.target_for_slot(h).leader_node_id == to)
        };
        if !wait_until(timeout_ms, named).await {
            return Err(Reply::error(
                504,
                format!(
                    "node {to} leads slot ids {slot_ids:?}, and this node's view does not name \
                     it yet after {timeout_ms} ms: read GET /cluster/slots"
                ),
            ));
        }
        Ok(self.cluster_slots())
    }

    /// The slot ids of `hash_slots`, each checked to have a replica on `to` (400
    /// naming its replicas otherwise).
    fn slot_ids_to_move(&self, hash_slots: &[u16], to: NodeId) -> Result<Vec<u32>, Reply> {
        let c = &self.shared.config.cluster;
        let nodes: Vec<NodeId> = c.nodes.iter().map(|n| n.id).collect();
        let mut slot_ids: Vec<u32> = (hash_slots.iter())
            .map(|&h| slot_id_of(h, c.slot_ids))
            .collect();
        slot_ids.sort_unstable();
        slot_ids.dedup();
        for &slot_id in &slot_ids {
            let replicas = replica_nodes(slot_id, &nodes, c.replicas as usize);
            if !replicas.contains(&to) {
                return Err(Reply::error(
                    400,
                    format!(
                        "node {to} holds no replica of slot id {slot_id} (its replicas: \
                         {replicas:?}): a group's leader is one of its replicas"
                    ),
                ));
            }
        }
        Ok(slot_ids)
    }

    /// `slot_ids`' groups, led here, told to prefer `to` (each change committed),
    /// then awaited until this node's replicas name `to` their leader.
    async fn prefer_here(&self, slot_ids: &[u32], to: NodeId) -> Result<(), Reply> {
        if slot_ids.is_empty() {
            return Ok(());
        }
        let calls = (slot_ids.iter())
            .map(|&slot_id| {
                self.propose_catalog(CatalogOp::PreferLeader {
                    slot_id,
                    node_id: to,
                })
            })
            .collect();
        for result in super::forward::join_all(calls).await {
            result?;
        }
        let status = &self.shared.raft_status;
        let timeout_ms = self.config.forward_timeout_ms / 2;
        let led =
            || (slot_ids.iter()).all(|&s| status.of(s).is_some_and(|(leader, _)| leader == to));
        if !wait_until(timeout_ms, led).await {
            let behind: Vec<u32> = (slot_ids.iter().copied())
                .filter(|&s| status.of(s).is_none_or(|(leader, _)| leader != to))
                .collect();
            return Err(Reply::error(
                504,
                format!(
                    "slot ids {behind:?} prefer node {to} now, and it does not lead them after \
                     {timeout_ms} ms (it is behind, unreachable or draining): each hands over \
                     once it is caught up; read GET /cluster/slots"
                ),
            ));
        }
        Ok(())
    }
}

/// The first hash slot of `slot_id` among `slot_ids` (slot ids are contiguous
/// ranges of hash slots, `cluster::slot_id_of`); `None` for one out of range.
pub(super) fn first_hash_slot(slot_id: u32, slot_ids: u32) -> Option<u16> {
    (0..slots::HASH_SLOTS as u16).find(|&h| slot_id_of(h, slot_ids) == slot_id)
}

/// [`first_hash_slot`] of a slot id taken from a hash slot (so in range).
fn hash_slot_of(slot_id: u32, slot_ids: u32) -> u16 {
    first_hash_slot(slot_id, slot_ids).expect("a slot id of a hash slot has one")
}
