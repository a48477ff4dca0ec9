//! `POST /node/drain`: the first step of a rolling restart of one cluster node.
//!
//! Contract: called on the node to drain, with an optional body `{"move_to": [node
//! ids]}` (default: every peer every shard reaches, in config order). In order:
//! 1. the node is marked draining ([`NodeShared::begin_drain`]): `/readyz` answers
//!    503 "draining…" and `/route` stops naming it;
//! 2. every hash slot it leads moves to the targets, whole slot ids round robin in
//!    slot id order ([`NodeShared::drain_moves`]), in one view change like `POST
//!    /cluster/slots/leader` (each moved slot's term and the revision advance; the
//!    view goes to every shard, shard 0 sends it to every peer, gateways rebuild
//!    their routes at the new authorities);
//! 3. it waits, up to `forward_timeout_ms`, until every target's `GET
//!    /cluster/slots` shows that revision (or a later one), so clients reconnecting
//!    there register at the new authorities; a target that does not is named in
//!    `peers_without_view` (it gets the view when its link comes back);
//! 4. every shard closes new client connections at once from then on and sends
//!    DISCONNECT (reason 0: reconnect; not 12) to each of its sessions, which are
//!    unregistered at their authorities.
//!
//! The answer (200) is `{"moved_hash_slots", "disconnected", "revision",
//! "moved_to", "peers_without_view", "homes"}`. **Homes do not move**: the uids
//! and channels homed on this node (tokens, subscribers, message logs) stay served
//! by it, through the other nodes, until it stops; while it is down they are
//! unavailable (no replication). A second drain answers again, with what was
//! left to do (usually 0 slots and 0 sessions: new connections are closed since
//! the first). Refusals: 409 on a node alone (nowhere to move), 400
//! for a `move_to` naming this node or a node that is not a peer, 503 when a
//! target (or every peer) is unreachable or a shard's queue is full.
//!
//! **With `[cluster] replicas` above 1** leaders are elected, so a drain hands
//! the groups over instead of moving hash slots: (1) as above; (2) each group
//! this node leads hands its leadership to its first other replica that is caught
//! up and not draining, and the other nodes' leaders stop handing over to it (its
//! raft frames say it drains: `RaftSide::on_timer`'s hand-over); each new leader
//! claims its slot id's hash slots as after an election, so authorities and homes
//! move with it; (3) it waits, up to `forward_timeout_ms`, until this node leads no
//! group and its view names it leader of no hash slot, else 504 (the hand-overs go
//! on: drain again; nothing is disconnected yet); (4) as above. The answer is
//! `{"handed_over_slot_ids", "disconnected", "revision", "homes"}`; `move_to` is
//! refused (400). A restarted node says it no longer drains, and its groups hand
//! their leadership back to it once it is caught up.

use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::{json, Value};

use super::{parse, Api, ApiRequest, Reply};
use crate::cluster::NodeId;
use crate::node::msg::Msg;

/// How often a target's view is asked for while the drain waits for it.
const VIEW_POLL_INTERVAL_MS: u64 = 20;

/// Polls `holds` every [`VIEW_POLL_INTERVAL_MS`] (on the runtime, holding no
/// thread) until it holds (`true`) or `timeout_ms` passed (`false`).
pub(super) async fn wait_until(timeout_ms: u64, mut holds: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_millis(timeout_ms);
    loop {
        if holds() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(VIEW_POLL_INTERVAL_MS)).await;
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct DrainReq {
    #[serde(default)]
    move_to: Option<Vec<NodeId>>,
}

impl Api {
    /// `POST /node/drain` (module docs).
    pub(super) async fn drain(&self, req: &ApiRequest<'_>) -> Result<Reply, Reply> {
        let r: DrainReq = if req.body.iter().all(u8::is_ascii_whitespace) {
            DrainReq::default()
        } else {
            parse(req.body)?
        };
        if self.shared.view().homes == crate::cluster::Homes::Leaders {
            return self.drain_replicated(r).await;
        }
        let targets = self.drain_targets(r.move_to)?;
        (self.shared.check_movable())
            .map_err(|refused| Reply::error(refused.status(), refused.to_string()))?;
        self.shared.begin_drain();
        let moves = self.shared.drain_moves(&targets);
        let revision = if moves.is_empty() {
            self.shared.view().revision
        } else {
            let view = (self.shared.move_leaders_each(&moves))
                .map_err(|refused| Reply::error(refused.status(), refused.to_string()))?;
            self.send_to_shards(|| Msg::View(view.clone()))?;
            view.revision
        };
        tracing::info!(
            moved_hash_slots = moves.len(),
            revision,
            ?targets,
            "draining: hash slots moved"
        );
        let behind = self.await_view(&targets, revision, req).await;
        let disconnected = self.drain_shards().await?;
        tracing::info!(disconnected, "draining: sessions disconnected");
        Ok(Reply::json(
            200,
            json!({
                "moved_hash_slots": moves.len(),
                "disconnected": disconnected,
                "revision": revision,
                "moved_to": targets,
                "peers_without_view": behind,
                "homes": "not moved: the uids and channels homed on this node stay served \
                          by it until it stops",
            }),
        ))
    }

    /// The drain of a node whose slot ids are replicated (module docs): marked
    /// draining, its groups' leaders here hand over to other replicas, the others
    /// stop handing over to it; once it leads no group and its view names it
    /// leader of no hash slot (the new leaders' claims reached it), its sessions
    /// are disconnected.
    async fn drain_replicated(&self, r: DrainReq) -> Result<Reply, Reply> {
        if r.move_to.is_some() {
            return Err(Reply::error(
                400,
                "move_to is not taken with [cluster] replicas above 1: each group hands \
                 over to its next replica that is caught up and not draining",
            ));
        }
        if self.peer_ids().is_empty() {
            return Err(Reply::error(
                409,
                "a node alone has nowhere to move its groups or sessions: stop it instead",
            ));
        }
        let me = self.me();
        let status = &self.shared.raft_status;
        let led_at_start = status.led_by(me);
        self.shared.begin_drain();
        let timeout_ms = self.config.forward_timeout_ms;
        let slots_led = || {
            let view = self.shared.view();
            (view.slots.iter())
                .filter(|s| s.leader_node_id == me)
                .count()
        };
        if !wait_until(timeout_ms, || status.led_by(me) == 0 && slots_led() == 0).await {
            let (led, slots_led) = (status.led_by(me), slots_led());
            return Err(Reply::error(
                504,
                format!(
                    "{led} slot ids are still led here after {timeout_ms} ms (their other \
                         replicas are behind, unreachable or draining) and {slots_led} hash \
                         slots in this node's view: the hand-overs go on; drain again"
                ),
            ));
        }
        let view = self.shared.view();
        tracing::info!(
            handed_over = led_at_start,
            revision = view.revision,
            "draining: every group led here handed over"
        );
        let disconnected = self.drain_shards().await?;
        tracing::info!(disconnected, "draining: sessions disconnected");
        Ok(Reply::json(
            200,
            json!({
                "handed_over_slot_ids": led_at_start,
                "disconnected": disconnected,
                "revision": view.revision,
                "homes": "moved with the leaders: the groups' new leaders serve this node's \
                          channels and uids",
            }),
        ))
    }

    /// The peers the hash slots move to: `move_to` (each a peer, each reachable)
    /// or every reachable peer in config order. Refuses 409 on a node alone, 400 a
    /// `move_to` that is empty or names no peer, 503 an unreachable target or no
    /// reachable peer.
    fn drain_targets(&self, move_to: Option<Vec<NodeId>>) -> Result<Vec<NodeId>, Reply> {
        let peers = self.peer_ids();
        if peers.is_empty() {
            return Err(Reply::error(
                409,
                "a node alone has nowhere to move its hash slots or sessions: stop it instead",
            ));
        }
        let reachable = self.reachable_peers();
        let Some(list) = move_to else {
            if reachable.is_empty() {
                return Err(Reply::error(
                    503,
                    "no peer is reachable: nowhere to move the hash slots",
                ));
            }
            return Ok(reachable);
        };
        if list.is_empty() {
            return Err(Reply::error(400, "move_to must name at least one peer"));
        }
        for n in &list {
            if !peers.contains(n) {
                return Err(Reply::error(
                    400,
                    format!("move_to: node {n} is not a peer of node {}", self.me()),
                ));
            }
            if !reachable.contains(n) {
                return Err(Reply::error(
                    503,
                    format!("move_to: node {n} is unreachable"),
                ));
            }
        }
        Ok(list)
    }

    /// Sends `msg()` to every shard; 503 when a shard's control queue is full.
    fn send_to_shards(&self, msg: impl Fn() -> Msg) -> Result<(), Reply> {
        for inj in &self.injectors {
            inj.send(msg()).map_err(|_| {
                Reply::error(503, "a shard's control queue is full; retry the drain")
            })?;
        }
        Ok(())
    }

    /// `Msg::Drain` to every shard; the connections they disconnected, summed. 503
    /// when a shard's queue is full, 504 when one does not answer in time.
    async fn drain_shards(&self) -> Result<usize, Reply> {
        let (tx, mut rx) = tokio::sync::mpsc::channel(self.injectors.len());
        self.send_to_shards(|| Msg::Drain { done: tx.clone() })?;
        drop(tx);
        let counts = self
            .shard_replies(&mut rx, self.injectors.len())
            .await
            .ok_or_else(|| Reply::error(504, "a shard did not answer the drain in time"))?;
        Ok(counts.into_iter().sum())
    }

    /// Waits up to `forward_timeout_ms` until each of `targets` shows view
    /// `revision` or a later one in its `GET /cluster/slots`; gives those that did
    /// not.
    async fn await_view(
        &self,
        targets: &[NodeId],
        revision: u64,
        req: &ApiRequest<'_>,
    ) -> Vec<NodeId> {
        let deadline = Instant::now() + Duration::from_millis(self.config.forward_timeout_ms);
        let ask = ApiRequest {
            method: "GET",
            target: "/cluster/slots",
            authorization: req.authorization,
            forwarded_by: None,
            body: b"",
        };
        let mut behind: Vec<NodeId> = targets.to_vec();
        loop {
            let calls = behind
                .iter()
                .map(|&n| self.forward(n, "node", &ask, b""))
                .collect();
            let answers = super::forward::join_all(calls).await;
            let mut answers = answers.into_iter();
            behind.retain(|_| {
                let answer = answers.next().expect("one answer per target");
                let seen = serde_json::from_str::<Value>(&answer.body)
                    .ok()
                    .and_then(|v| v["revision"].as_u64());
                !(answer.status == 200 && seen.is_some_and(|r| r >= revision))
            });
            if behind.is_empty() || Instant::now() >= deadline {
                return behind;
            }
            tokio::time::sleep(Duration::from_millis(VIEW_POLL_INTERVAL_MS)).await;
        }
    }
}
