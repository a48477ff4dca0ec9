//! The node's control of one shard: the gauges only this shard can read, device
//! quit (the HTTP API's `/user/device_quit`), cluster view changes, drain (`POST
//! /node/drain`), shutdown, and the injected panic of the crash tests.
//!
//! What enters here: `Msg::DeviceQuit`, `Msg::View`, `Msg::Drain`, `Msg::Shutdown`
//! (and `on_stop` when no shutdown came first), `Msg::InjectPanic`; the gauges are
//! sampled after each expiry pass (`NodeTimer::Expiry`).

use std::sync::Arc;

use net::io::{ConnId, NetDriver};
use proto::wkproto::ReasonCode;
use shard::runtime::Context;

use crate::cluster::ClusterView;
use crate::registry::SessionHandle;
use crate::route::{OwnerAction, OwnerActionKind};

use super::msg::Msg;
use super::shard::{ConnState, NodeShard, NodeTimer};
use super::wire;

impl NodeShard {
    /// Samples the gauges only this shard can read: routes of its slots, its rings.
    pub(super) fn publish_gauges(&mut self, cx: &mut Context<Msg, NodeTimer>) {
        let shared = self.shared.clone();
        for slot in shared.slot_map.slots_of(self.me) {
            let n = self.authority.active_routes(slot);
            shared.routes_per_slot[slot as usize].store(n, std::sync::atomic::Ordering::Relaxed);
        }
        let shards = shared.slot_map.shard_count();
        for peer in 0..shards {
            let n = cx.queued_for(peer) as u64;
            let i = self.me as usize * shards as usize + peer as usize;
            shared.ring_occupancy[i].store(n, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Closes this shard's sessions of `uid` (and `device_flag`); returns how many.
    pub(super) fn device_quit(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        uid: &str,
        flag: Option<u8>,
    ) -> usize {
        let handles: Vec<SessionHandle> = self.registry.sessions_of_uid(uid).collect();
        let mut closed = 0;
        for handle in handles {
            let Some(info) = self.registry.get(handle) else {
                continue;
            };
            if flag.is_some_and(|f| f != info.device_flag) {
                continue;
            }
            let action = OwnerAction {
                kind: OwnerActionKind::KickThenClose,
                route: info.identity(),
                owner_seq: info.owner_seq,
            };
            self.perform_owner_action(cx, driver, &action);
            closed += 1;
        }
        closed
    }

    /// A cluster view, joined with this shard's (`ClusterView::merge`: slot by
    /// slot the higher term; one that brings nothing new is ignored): slots this
    /// node gained get a fresh identity, lost ones drop
    /// their state; touches drained from now on go to the new targets. This shard's
    /// live sessions whose hash slot moved are queued for re-registration at their
    /// new authority and the first rebuild batches leave at once
    /// ([`NodeShard::flush_rebuild`]); the touch flush sends the rest at
    /// `[session] rebuild_routes_per_s`.
    pub(super) fn apply_view(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        view: &ClusterView,
    ) {
        // Joined, not replaced: views from several senders may arrive in any order.
        let Some(view) = self.view.merge(view) else {
            return;
        };
        let view = &view;
        // A slot taken from a node this shard cannot reach waits for no handover.
        let down = self.peers.down_nodes();
        (self.authority).apply_view(view, cx.now_ms() / 1000, down);
        self.send_handovers(cx);
        let old = std::mem::replace(&mut self.view, view.clone());
        let queued = self.registry.queue_rebuild(&old, view, cx.now_ms());
        if queued > 0 {
            tracing::debug!(
                shard = self.me,
                revision = view.revision,
                queued,
                "routes queued for rebuild at their new authority"
            );
        }
        self.flush_rebuild(cx, driver);
        // Shard 0 spreads it to the other nodes (each applies only a higher revision).
        if self.me == 0 && self.peers.is_cluster() {
            let now_ms = cx.now_ms();
            for node in view.nodes.clone() {
                if node != self.shared.config.node_id {
                    self.peers
                        .oneway(node, &wire::OneWayRef::View(view), now_ms);
                }
            }
        }
    }

    /// The node's view re-read (on the expiry timer): a `Msg::View` lost to a full
    /// queue (counted in `ring_full_drops`) would otherwise leave this shard on an
    /// older view until the next move.
    pub(super) fn reread_view(&mut self, cx: &mut Context<Msg, NodeTimer>, driver: &mut NetDriver) {
        let view = self.shared.view();
        if self.view.merge(&view).is_some() {
            self.metrics.views_reread.inc();
            tracing::warn!(
                shard = self.me,
                revision = view.revision,
                "a view missed by this shard taken from the node's"
            );
            self.apply_view(cx, driver, &view);
        }
    }

    /// A view from another node: joined with this node's (installed if it brings
    /// anything new), then applied by every shard.
    pub(super) fn on_remote_view(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        view: ClusterView,
    ) {
        self.shared.note_view_heard();
        let Some(view) = self.shared.install_view(view) else {
            return;
        };
        tracing::info!(
            revision = view.revision,
            "cluster view from a peer installed"
        );
        self.spread_view(cx, driver, &view);
    }

    /// A view the node just installed, applied by this shard and sent to every
    /// other (shard 0 sends it on to the peers).
    pub(super) fn spread_view(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        view: &Arc<ClusterView>,
    ) {
        for shard in 0..self.shared.slot_map.shard_count() {
            if shard == self.me {
                self.apply_view(cx, driver, view);
            } else {
                self.send_msg(cx, shard, Msg::View(view.clone()));
            }
        }
    }

    /// DISCONNECT to every session, each removed locally (its authority unregister
    /// queued), then one last touch flush sends what is queued. Connections
    /// accepted from now on are closed at once.
    pub(super) fn shutdown(&mut self, cx: &mut Context<Msg, NodeTimer>, driver: &mut NetDriver) {
        self.disconnect_all(cx, driver, "server shutting down");
    }

    /// A drain (`POST /node/drain`, after the view that moved this node's hash
    /// slots away was applied: it came first on the same queue): new client
    /// connections are closed at once from now on (the listening sockets stay
    /// bound until the node stops), and every client connection gets DISCONNECT
    /// with reason 0 (Unknown: not 12, which tells clients another login kicked
    /// them and they should not reconnect) and is closed, its session unregistered
    /// at its authority. Returns how many connections were disconnected (those not closing already: about 0 on
    /// a second drain). Inter-node links are untouched.
    pub(super) fn drain(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
    ) -> usize {
        self.disconnect_all(cx, driver, "node draining: reconnect to another node")
    }

    /// Refuses new client connections from now on; DISCONNECT (reason 0, `text`)
    /// to every client connection, each session removed locally (its authority
    /// unregister queued); then one touch flush sends what is queued. Returns how
    /// many of them were not closing already.
    fn disconnect_all(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        text: &str,
    ) -> usize {
        self.stopping = true;
        let ids: Vec<(ConnId, bool)> = self
            .conns
            .iter()
            .map(|c| (c.id, c.state != ConnState::Closing))
            .collect();
        for &(id, _) in &ids {
            if let Some(handle) = self.conn(id).and_then(|c| c.handle) {
                self.registry.deactivate(handle, cx.now_ms());
            }
            self.disconnect(driver, id, ReasonCode::UNKNOWN, text);
        }
        self.flush_touches(cx, driver);
        ids.iter().filter(|(_, open)| *open).count()
    }

    /// The crash tests' fault: this shard panics, and the runtime reports it.
    pub(super) fn inject_panic(&self) -> ! {
        panic!("injected fault")
    }
}
