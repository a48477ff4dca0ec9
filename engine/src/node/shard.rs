//! One shard of a node: the gateway for the connections it accepted, the presence
//! authority for its hash slots, the commit core for its channels, and the owner
//! that writes RECV to its sessions. Every decision is made by the sans-IO pieces
//! (activation, registry, authority, delivery planner); the shard's files only move
//! their inputs and outputs between sockets, shards and timers.
//!
//! This file holds [`NodeShard`] (the node's state on one shard), [`NodeTimer`], the
//! turn's clock, and the ring lanes of `NodeShard::send_msg` and `NodeShard::hand`.
//! The loop itself (`impl Handler for NodeShard`, each input handed to the concern
//! that owns it) is `dispatch.rs`, above every concern's file; this one is below
//! them (it takes only the types the shard holds), so no file of a concern and
//! this one import each other.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use net::io::{ConnId, NetDriver};
use rand::rngs::StdRng;
use rand::SeedableRng;
use shard::runtime::{Context, Handler};
use slots::ShardId;

use domain::send::commit::Now;

use crate::activation::{Activation, ActivationId, Event, Output};
use crate::authority::AuthorityReader;
use crate::cluster::ClusterView;
use crate::registry::Registry;

use super::authority_side::AuthoritySide;
use super::msg::Msg;
pub use super::msg::NodeTimer;
use super::send::owner::{OwnerIo, OwnerSide};
use super::send::{CommitSide, GatewaySide};
use super::shared::NodeShared;

pub(crate) use super::conn::{ConnState, ConnTable};

/// One shard's state.
pub struct NodeShard {
    pub(crate) me: ShardId,
    pub(crate) shared: Arc<NodeShared>,
    pub(crate) metrics: Arc<super::metrics::ShardMetrics>,
    /// This shard's stage latency histograms.
    pub(crate) stages: Arc<super::metrics::StageHistograms>,
    pub(crate) view: ClusterView,
    pub(crate) registry: Registry,
    /// The directory of this shard's hash slots.
    pub(crate) authority: AuthoritySide,
    pub(crate) reader: AuthorityReader,
    /// The connections and their sessions.
    pub(crate) conns: ConnTable,
    /// Activations running on this shard, with their connection.
    pub(super) activations: HashMap<ActivationId, (Activation, ConnId)>,
    /// Replies of authority calls served on this shard itself, fed back in order.
    pub(super) local_events: VecDeque<(ActivationId, Event)>,
    /// The next activation's and session's numbers on this shard.
    pub(super) next_activation: u64,
    pub(super) next_session: u64,
    /// Server key pairs and salts: a CSPRNG seeded from the OS.
    pub(super) rng: StdRng,
    /// One frame copied out of the driver's input while it is handled.
    pub(super) rx_frame: Vec<u8>,
    /// An activation's outputs (reused).
    pub(super) outputs: Vec<Output>,
    /// Scratch buffer for encoding frames.
    pub(crate) frame_buf: Vec<u8>,
    /// Scratch buffer for a frame translated to JSON-RPC (`conns::write_json`).
    pub(super) json_buf: Vec<u8>,
    pub(crate) commit: CommitSide,
    /// The owner side: RECVs to this shard's sessions and their acknowledgements.
    pub(crate) owner: OwnerSide,
    /// The gateway side: this shard's clients' SENDs (`send/gateway.rs`).
    pub(crate) gateway: GatewaySide,
    /// Shut down or drained: new client connections are closed at once.
    pub(super) stopping: bool,
    /// The links to the other nodes (none on a node alone).
    pub(super) peers: super::peers::Peers,
    /// Requests to other nodes that failed, answered at the end of the turn.
    pub(super) remote_failures: Vec<(super::msg::Pending, domain::hop::NoAnswer)>,
    /// The replicated groups of this shard (none unless `[cluster] replicas` > 1).
    pub(super) raft: super::raft::RaftSide,
    /// Catalog changes proposed to this shard's groups, by waiter number, each
    /// answered at its commit (at most `[commit] commits_unsynced_max`).
    pub(super) catalog_waiters: std::collections::BTreeMap<u64, super::msg::CatalogDone>,
    /// The next waiter number.
    pub(super) next_catalog_waiter: u64,
    /// Replicated: messagesync reads waiting for their group's ReadIndex
    /// (`RaftSide::ask_read`), by waiter (at most `[commit] commits_unsynced_max`).
    pub(super) read_waiters: std::collections::BTreeMap<u64, Box<super::msg::MessageSyncRequest>>,
    pub(super) next_read_waiter: u64,
    /// This loop turn's clock ([`NodeShard::turn_now`]), read by the turn's first
    /// SEND or commit and forgotten when the turn flushes its commits.
    turn_now: Option<Now>,
}

impl NodeShard {
    /// A shard of the node described by `shared`.
    pub fn new(
        me: ShardId,
        shared: Arc<NodeShared>,
        commit: CommitSide,
    ) -> std::io::Result<NodeShard> {
        let cfg = &shared.config;
        let view = shared.initial_view.clone();
        let rcfg = crate::registry::RegistryConfig::with_limits(
            me,
            cfg.node_id,
            shared.boot_id,
            cfg.session.sessions_per_shard_max,
            &cfg.registry,
        );
        let registry = Registry::new(rcfg)
            .map_err(|e| std::io::Error::other(format!("registry config: {e:?}")))?;
        let (authority, reader) = AuthoritySide::new(me, &shared, &view)?;
        shared.shard_metrics[me as usize]
            .view_revision
            .set(view.revision);
        let peers = super::peers::new_for_shard(&shared, me);
        let owner = OwnerSide::new(&cfg.session);
        let gateway = GatewaySide::new(me, &shared);
        Ok(NodeShard {
            gateway,
            me,
            rng: StdRng::from_entropy(),
            rx_frame: Vec::new(),
            metrics: shared.shard_metrics[me as usize].clone(),
            stages: shared.stages[me as usize].clone(),
            shared,
            view,
            registry,
            authority,
            reader,
            conns: ConnTable::default(),
            activations: HashMap::new(),
            local_events: VecDeque::new(),
            next_activation: 1,
            next_session: 1,
            outputs: Vec::new(),
            frame_buf: Vec::with_capacity(4096),
            json_buf: Vec::new(),
            commit,
            owner,
            stopping: false,
            peers,
            remote_failures: Vec::new(),
            raft: super::raft::RaftSide::off(),
            catalog_waiters: std::collections::BTreeMap::new(),
            next_catalog_waiter: 1,
            read_waiters: std::collections::BTreeMap::new(),
            next_read_waiter: 1,
            turn_now: None,
        })
    }

    /// The owner side, with what one of its calls borrows from the shard.
    pub(crate) fn owner_io<'a>(
        &'a mut self,
        cx: &'a mut Context<Msg, NodeTimer>,
        driver: &'a mut NetDriver,
    ) -> (&'a mut OwnerSide, OwnerIo<'a>) {
        let io = OwnerIo {
            conns: &mut self.conns,
            registry: &self.registry,
            metrics: &self.metrics,
            stages: &self.stages,
            clock: &self.shared,
            cx,
            driver,
        };
        (&mut self.owner, io)
    }

    /// The clock now: wall and monotonic, one read each.
    pub(crate) fn now(&self) -> Now {
        Now {
            wall_ms: self.shared.wall_ms(),
            mono_ns: self.shared.mono_ns(),
        }
    }

    /// The clock of this loop turn: one read (wall and monotonic) for every SEND
    /// decoded and every commit of the turn, not two or three per SEND. Message ids
    /// and timestamps, the SEND rate and the `gateway_to_commit` stage see the
    /// turn's start, at most one turn early; the turn's end (`on_turn`, before it
    /// flushes the commits) forgets it.
    pub(crate) fn turn_now(&mut self) -> Now {
        if let Some(now) = self.turn_now {
            return now;
        }
        let now = self.now();
        self.turn_now = Some(now);
        now
    }

    /// The turn's SENDs and commits are in: the next turn reads the clock afresh.
    pub(super) fn forget_turn_clock(&mut self) {
        self.turn_now = None;
    }

    /// Hands `msg` to shard `to`: handled here and now when `to` is this shard, as
    /// if it had come off the ring; otherwise sent on the ring ([`Self::send_msg`]).
    /// One step of a flow names its next shard and does not care which it is.
    pub(crate) fn hand(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        to: ShardId,
        msg: Msg,
    ) {
        if to == self.me {
            self.on_message(cx, driver, to, msg);
        } else {
            self.send_msg(cx, to, msg);
        }
    }

    /// Sends `msg` to shard `to`: control on the urgent lane, commits, SENDACKs and
    /// pushes on the data lane. What the ring cannot take waits in the peer's queue.
    /// Commits and SENDACKs are never refused (their number is bounded by the
    /// gateway's credits, which a lost one would leak); pushes are admitted by the
    /// planner against the peer's room beyond the reserve. So only control can
    /// meet a full queue (more than `control_room_per_peer` of it while the peer does
    /// not drain): it is counted and logged at a bounded rate, and what it drops has a
    /// timeout behind it (activation, touch, unregister retry).
    pub(crate) fn send_msg(&mut self, cx: &mut Context<Msg, NodeTimer>, to: ShardId, msg: Msg) {
        let sent = match msg {
            // Bounded by the gateway's credits, and holding credits: never refused
            // (a lost one would leak its credit for good).
            Msg::Commit(_) | Msg::SendAck(_) => {
                cx.send_reserved(to, msg);
                Ok(())
            }
            // Admitted by the planner against the peer's room.
            Msg::Push { .. } => cx.send_to(to, msg),
            _ => cx.send_urgent(to, msg),
        };
        if sent.is_err() {
            self.metrics.ring_full_drops.inc();
            let n = self.metrics.ring_full_drops.get();
            if n.is_power_of_two() {
                tracing::warn!(
                    from = self.me,
                    to,
                    dropped_total = n,
                    "peer queue full: message dropped"
                );
            }
        }
    }
}
