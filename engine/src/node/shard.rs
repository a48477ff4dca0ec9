//! One shard of a node: the gateway for the connections it accepted, the presence
//! authority for its hash slots, the commit core for its channels, and the owner
//! that writes RECV to its sessions. Every decision is made by the sans-IO pieces
//! (activation, registry, authority, delivery planner); the shard's files only move
//! their inputs and outputs between sockets, shards and timers.
//!
//! This file is the loop glue: [`NodeShard`] (the node's state on one shard),
//! [`NodeTimer`], the ring lanes of `NodeShard::send_msg`, the periodic timers, and
//! `impl Handler for NodeShard`, whose callbacks each hand their input to the
//! concern that owns it:
//! - `node/conns.rs`: the connection table and its frames (`on_io`);
//! - `node/hops.rs`: every hop's request and reply, from a shard of this node
//!   (`Msg::Request`, `Msg::Reply`) or from another node (`Msg::PeerReply`, and the
//!   frames `node/peers.rs` reads), one dispatcher per side;
//! - `node/connect.rs`: CONNECT admission and the activation driver
//!   (`NodeTimer::Activation`, the owner actions' and authority calls' replies);
//! - `node/authority_service.rs`: authority calls and their service, owner actions,
//!   the touch worker, the expiry pass (`NodeTimer::TouchFlush`, `NodeTimer::Expiry`);
//! - `node/control.rs`: gauges, device quit, view changes, shutdown, injected panics
//!   (`Msg::DeviceQuit`, `Msg::View`, `Msg::Drain`, `Msg::Shutdown`,
//!   `Msg::InjectPanic`);
//! - [`super::send`]: the SEND → RECV path, in flow order (`Msg::Commit`,
//!   `Msg::SendAck`, `Msg::Push`, `Msg::MessageSync`, `NodeTimer::LogSync`,
//!   `NodeTimer::Ack`, and the end of each loop turn).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use net::io::{ConnId, NetDriver, NetEvent};
use rand::rngs::StdRng;
use rand::SeedableRng;
use shard::runtime::{Context, Handler};
use slots::ShardId;
use wheel::TimerHandle;

use crate::activation::{Activation, ActivationId, Event, Output};
use crate::authority::{Authority, AuthorityReader};
use crate::cluster::ClusterView;
use crate::registry::Registry;
use crate::route::SessionId;

use super::msg::Msg;
use super::send::CommitSide;
use super::shared::NodeShared;

pub(crate) use super::conns::{Conn, ConnState};

/// What a shard's timers carry.
#[derive(Clone, Copy, Debug)]
pub enum NodeTimer {
    /// An activation's deadline.
    Activation(ActivationId),
    /// The touch worker's flush (and the unregister queue's drain).
    TouchFlush,
    /// The authority's expiry pass.
    Expiry,
    /// The ack timeout of a connection's oldest unacknowledged RECV.
    Ack { conn: ConnId },
    /// The interval fsync policy's sync of the log.
    LogSync,
    /// The inter-node links' timers (dials, deadlines, heartbeats, silence).
    Peers,
}

/// One shard's state.
pub struct NodeShard {
    pub(crate) me: ShardId,
    pub(crate) shared: Arc<NodeShared>,
    pub(crate) metrics: Arc<super::metrics::ShardMetrics>,
    /// This shard's stage latency histograms.
    pub(crate) stages: Arc<super::metrics::StageHistograms>,
    /// Push batches queued this turn, waiting for the poll that writes them
    /// (bounded by `send::WRITE_MARKS_MAX`).
    pub(crate) write_marks_ns: Vec<u64>,
    pub(crate) view: ClusterView,
    pub(crate) registry: Registry,
    pub(crate) authority: Authority,
    pub(crate) reader: AuthorityReader,
    /// Connections by `ConnId::index`.
    pub(crate) conns: Vec<Option<Conn>>,
    /// This shard's sessions (pending and active) → their connection; node-assigned
    /// ids, so the fast unkeyed hasher (looked up once per RECV).
    pub(crate) session_conns:
        HashMap<SessionId, ConnId, domain::presence::authority::FxBuildHasher>,
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
    /// This gateway's credits of SENDs in flight (`domain::send::gateway`).
    pub(crate) credits: domain::send::gateway::SendCredits,
    /// This gateway's SEND rates by uid (`domain::send::send_rate`).
    pub(crate) send_rate: domain::send::send_rate::SendRate,
    /// What this shard's pending-ACK entries are charged (bounded by
    /// `pending_acks_budget_bytes_per_shard`; see `send::PendingAcks`).
    pub(crate) pending_ack_bytes: usize,
    /// RECVs an ack timeout re-sends (reused).
    pub(crate) ack_resend_buf: Vec<Arc<super::send::Committed>>,
    /// Shut down or drained: new client connections are closed at once.
    pub(super) stopping: bool,
    /// The links to the other nodes (none on a node alone).
    pub(super) peers: super::peers::Peers,
    /// Requests to other nodes that failed, answered at the end of the turn.
    pub(super) remote_failures: Vec<(super::msg::Pending, domain::hop::NoAnswer)>,
}

/// How often the inter-node links' timers run (dials, deadlines, heartbeats).
const PEERS_TICK_MS: u64 = 20;

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
            cfg.session.max_sessions_per_shard,
            &cfg.registry,
        );
        let registry = Registry::new(rcfg)
            .map_err(|e| std::io::Error::other(format!("registry config: {e:?}")))?;
        let my_slots: Vec<_> = shared.slot_map.slots_of(me).collect();
        let mut authority = Authority::new(cfg.authority.clone(), &shared.directory, &my_slots)
            .map_err(|e| std::io::Error::other(format!("authority: {e:?}")))?;
        authority.apply_view(&view, cfg.node_id, 0);
        shared.shard_metrics[me as usize]
            .view_revision
            .set(view.revision);
        // The `user.onlinestatus` webhook's route changes, from this shard's slots.
        authority.record_presence(
            shared
                .webhooks
                .enabled(domain::webhook::EventKind::OnlineStatus),
        );
        let reader = authority.reader();
        let peers = super::peers::new_for_shard(&shared, me);
        let credits = domain::send::gateway::SendCredits::new(
            me,
            shared.slot_map.shard_count() as usize,
            cfg.delivery.commit_credits_per_peer,
            cfg.session.sends_in_flight_per_conn_max,
        );
        Ok(NodeShard {
            credits,
            send_rate: domain::send::send_rate::SendRate::new(cfg.session.send_rate_limits()),
            pending_ack_bytes: 0,
            ack_resend_buf: Vec::new(),
            me,
            rng: StdRng::from_entropy(),
            rx_frame: Vec::new(),
            metrics: shared.shard_metrics[me as usize].clone(),
            stages: shared.stages[me as usize].clone(),
            write_marks_ns: Vec::with_capacity(super::send::WRITE_MARKS_MAX),
            shared,
            view,
            registry,
            authority,
            reader,
            conns: Vec::new(),
            session_conns: HashMap::default(),
            activations: HashMap::new(),
            local_events: VecDeque::new(),
            next_activation: 1,
            next_session: 1,
            outputs: Vec::new(),
            frame_buf: Vec::with_capacity(4096),
            json_buf: Vec::new(),
            commit,
            stopping: false,
            peers,
            remote_failures: Vec::new(),
        })
    }

    /// Records the shard's pending-ACK charge (and its gauge).
    pub(crate) fn set_pending_ack_bytes(&mut self, bytes: usize) {
        self.pending_ack_bytes = bytes;
        self.metrics.pending_ack_bytes.set(bytes as u64);
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

    /// Arms the next run of a periodic timer: `TouchFlush`, `Expiry`, and `LogSync`
    /// under the interval fsync policy. The others are armed by their concern.
    fn arm_periodic(&self, cx: &mut Context<Msg, NodeTimer>, timer: NodeTimer) {
        let s = &self.shared.config.session;
        let interval_ms = match timer {
            NodeTimer::TouchFlush => s.touch_flush_interval_ms,
            NodeTimer::Expiry => s.expiry_interval_ms,
            NodeTimer::LogSync => match self.commit.core.log().config().fsync {
                crate::store::FsyncPolicy::IntervalMs(ms) => ms.max(1),
                _ => return,
            },
            NodeTimer::Peers if self.peers.is_cluster() => PEERS_TICK_MS,
            NodeTimer::Activation(_) | NodeTimer::Ack { .. } | NodeTimer::Peers => return,
        };
        let _ = cx.set_timer(cx.now_ms() + interval_ms, timer);
    }
}

impl Handler for NodeShard {
    type Msg = Msg;
    type Timer = NodeTimer;
    type Driver = NetDriver;

    fn on_start(&mut self, cx: &mut Context<Msg, NodeTimer>, _driver: &mut NetDriver) {
        self.arm_periodic(cx, NodeTimer::TouchFlush);
        self.arm_periodic(cx, NodeTimer::Expiry);
        self.arm_periodic(cx, NodeTimer::LogSync);
        self.arm_periodic(cx, NodeTimer::Peers);
        self.shared.shard_started();
    }

    fn on_message(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        from: ShardId,
        msg: Msg,
    ) {
        match msg {
            Msg::Request(hop) => self.on_request(cx, driver, hop.reply_to, hop.request),
            Msg::Reply(hop) => self.on_reply(cx, driver, hop.pending, hop.reply),
            Msg::Commit(request) => super::send::on_commit(self, cx, driver, *request),
            Msg::SendAck(ack) => {
                // The SEND's credit towards that commit shard comes back.
                self.credits.returned_from(from);
                super::send::on_sendack(self, driver, ack)
            }
            Msg::Push {
                message,
                endpoints,
                handed_ns,
            } => super::send::on_push(self, cx, driver, &message, &endpoints, handed_ns),
            Msg::DeviceQuit {
                uid,
                device_flag,
                done,
            } => {
                let n = self.device_quit(cx, driver, &uid, device_flag);
                let _ = done.try_send(n);
            }
            Msg::MessageSync(request) => super::send::on_message_sync(self, *request),
            Msg::View(view) => self.apply_view(cx, driver, &view),
            Msg::PeerReply {
                from,
                request_id,
                reply,
            } => self.on_remote_reply(cx, driver, from, request_id, *reply),
            Msg::LogSynced => {}
            Msg::Drain { done } => {
                let n = self.drain(cx, driver);
                let _ = done.try_send(n);
            }
            Msg::Shutdown => self.shutdown(cx, driver),
            Msg::InjectPanic => self.inject_panic(),
        }
    }

    fn on_timer(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        _handle: TimerHandle,
        timer: NodeTimer,
    ) {
        match timer {
            NodeTimer::Activation(aid) => self.feed_activation(cx, driver, aid, Event::Tick),
            NodeTimer::TouchFlush => {
                self.flush_touches(cx, driver);
                self.drain_local_events(cx, driver);
            }
            NodeTimer::Expiry => {
                self.reread_view(cx, driver);
                self.expire_routes(cx);
                self.publish_gauges(cx);
            }
            NodeTimer::LogSync => super::send::on_log_sync_timer(self),
            NodeTimer::Ack { conn } => super::send::on_ack_timeout(self, cx, driver, conn),
            NodeTimer::Peers => {
                self.flush_peers(cx, driver);
            }
        }
        self.arm_periodic(cx, timer);
    }

    fn on_io(&mut self, cx: &mut Context<Msg, NodeTimer>, driver: &mut NetDriver, event: NetEvent) {
        let peer = match &event {
            NetEvent::Accepted { listener, .. } => super::peers::is_rpc_listener(*listener),
            NetEvent::Connected { .. } => true,
            NetEvent::Readable { conn } | NetEvent::Closed { conn, .. } => self.is_peer_conn(*conn),
        };
        if peer {
            return self.on_peer_io(cx, driver, event);
        }
        match event {
            NetEvent::Accepted { conn, listener, .. } => self.on_accepted(driver, conn, listener),
            NetEvent::Readable { conn } => self.on_readable(cx, driver, conn),
            NetEvent::Closed { conn, reason } => self.on_closed(cx, driver, conn, reason),
            NetEvent::Connected { .. } => {}
        }
    }

    fn on_turn(&mut self, cx: &mut Context<Msg, NodeTimer>, driver: &mut NetDriver) -> usize {
        self.metrics.record_net(&driver.stats());
        let rebuilds = self.authority.stats().filter_rebuilds;
        (self.metrics).record_presence_filter(self.reader.filter_counts(), rebuilds);
        // This turn's driver poll has handed earlier RECVs to the kernel.
        super::send::observe_socket_writes(self);
        // The turn's commits: under the default `interval` fsync policy they are
        // answered (SENDACK) and queued for delivery at once, and the `LogSync` timer
        // hands an fdatasync to the syncer; only `fsync = "always"` makes the turn's
        // appends one sync job, answered when it ends. Then deliveries go on where
        // peers have room.
        let work = super::send::flush_commits(self, cx, driver)
            + super::send::pump_deliveries(self, cx, driver);
        // Last: the turn's frames to other nodes, one write per link.
        work + self.flush_peers(cx, driver)
    }

    fn on_stop(&mut self, cx: &mut Context<Msg, NodeTimer>, driver: &mut NetDriver) {
        if !self.stopping {
            self.shutdown(cx, driver);
        }
        // A graceful stop makes everything appended durable, whatever the fsync
        // policy, and answers what waited for it.
        super::send::flush_commits_for_stop(self, cx, driver);
        super::send::pump_deliveries(self, cx, driver);
        // Flush queued output (DISCONNECTs) before the sockets go.
        let _ =
            shard::runtime::Driver::poll(driver, Some(std::time::Duration::ZERO), &mut Vec::new());
    }
}
