//! The shard loop: `impl Handler for NodeShard`, whose callbacks each hand their
//! input to the concern that owns it:
//! - `node/conns.rs`: the connection table and its frames (`on_io`);
//! - `node/hops.rs`: every hop's request and reply, from a shard of this node
//!   (`Msg::Request`, `Msg::Reply`) or from another node (`Msg::PeerReply`, and the
//!   frames `node/peers/io.rs` reads), one dispatcher per side;
//! - `node/api_hop.rs`: the HTTP API's requests to and from other nodes on the
//!   links (`Msg::ApiForward`, `Msg::ApiAnswered`);
//! - `node/connect.rs`: CONNECT admission and the activation driver
//!   (`NodeTimer::Activation`, the owner actions' and authority calls' replies);
//! - `node/authority_service.rs`: authority calls and their service, owner actions,
//!   the touch worker, the expiry pass (`NodeTimer::TouchFlush`, `NodeTimer::Expiry`);
//! - `node/control.rs`: gauges, device quit, view changes, shutdown, injected panics
//!   (`Msg::DeviceQuit`, `Msg::View`, `Msg::Drain`, `Msg::Shutdown`,
//!   `Msg::InjectPanic`);
//! - [`super::send`]: the SEND → RECV path, in flow order (`Msg::Commit`,
//!   `Msg::SendAck`, `Msg::Push`, `Msg::MessageSync`, `NodeTimer::LogSync`,
//!   `NodeTimer::Ack`, and the end of each loop turn);
//! - `node/peers/io.rs`: the inter-node links' sockets and timers (`NodeTimer::Peers`).
//!
//! Nothing imports this file: it is the top of a shard.

use net::io::{NetDriver, NetEvent};
use shard::runtime::{Context, Handler};
use slots::ShardId;
use wheel::TimerHandle;

use crate::activation::Event;

use super::msg::Msg;
use super::shard::{NodeShard, NodeTimer};

/// How often the inter-node links' timers run (dials, deadlines, heartbeats).
const PEERS_TICK_MS: u64 = 20;

impl NodeShard {
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
            NodeTimer::Raft if self.raft.is_on() => self.raft.tick_ms(),
            NodeTimer::Activation(_)
            | NodeTimer::Ack { .. }
            | NodeTimer::Peers
            | NodeTimer::Raft => return,
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
        self.open_raft();
        self.arm_periodic(cx, NodeTimer::Raft);
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
            Msg::Commit(request) => self.on_commit(cx, driver, *request),
            Msg::SendAck(ack) => {
                // The SEND's credit towards that commit shard comes back.
                self.gateway.returned_from(from);
                self.on_sendack(driver, ack)
            }
            Msg::Push {
                message,
                endpoints,
                handed_ns,
            } => {
                let (owner, mut io) = self.owner_io(cx, driver);
                owner.on_push(&mut io, &message, &endpoints, handed_ns);
            }
            Msg::DeviceQuit {
                uid,
                device_flag,
                done,
            } => {
                let n = self.device_quit(cx, driver, &uid, device_flag);
                let _ = done.try_send(n);
            }
            Msg::MessageSync(request) => self.on_message_sync(request),
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
            Msg::ApiForward(forward) => self.on_api_forward(cx, *forward),
            Msg::ApiAnswered(answered) => self.on_api_answered(cx, *answered),
            Msg::InjectPanic => self.inject_panic(),
            Msg::Raft(m) => self.on_raft_in(cx, driver, *m),
            Msg::CatalogPropose(m) => self.on_catalog_propose(*m),
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
            NodeTimer::LogSync => self.on_log_sync_timer(),
            NodeTimer::Ack { conn } => {
                let (owner, mut io) = self.owner_io(cx, driver);
                owner.on_ack_timeout(&mut io, conn);
            }
            NodeTimer::Peers => {
                self.flush_peers(cx, driver);
            }
            NodeTimer::Raft => self.on_raft_timer(cx, driver),
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
        let rebuilds = self.authority.filter_rebuilds();
        (self.metrics).record_presence_filter(self.reader.filter_counts(), rebuilds);
        // This turn's driver poll has handed earlier RECVs to the kernel.
        (self.owner).observe_socket_writes(&self.stages, &self.shared);
        // The turn's commits: under the default `interval` fsync policy they are
        // answered (SENDACK) and queued for delivery at once, and the `LogSync` timer
        // hands an fdatasync to the syncer; only `fsync = "always"` makes the turn's
        // appends one sync job, answered when it ends. Then deliveries go on where
        // peers have room. The turn's SENDs and commits are in: the next turn reads
        // the clock afresh.
        self.forget_turn_clock();
        let work = self.flush_commits(cx, driver) + self.pump_deliveries(cx, driver);
        // Last: the turn's frames to other nodes, one write per link.
        work + self.flush_peers(cx, driver)
    }

    fn on_stop(&mut self, cx: &mut Context<Msg, NodeTimer>, driver: &mut NetDriver) {
        if !self.stopping {
            self.shutdown(cx, driver);
        }
        // A graceful stop makes everything appended durable, whatever the fsync
        // policy, and answers what waited for it.
        self.flush_commits_for_stop(cx, driver);
        self.pump_deliveries(cx, driver);
        // Flush queued output (DISCONNECTs) before the sockets go.
        let _ =
            shard::runtime::Driver::poll(driver, Some(std::time::Duration::ZERO), &mut Vec::new());
    }
}
