//! The shard's side of its links: socket events of the RPC listener and the links,
//! the frames each link reads handed to [`super::super::hops`], requests and
//! replies to other nodes, the links' timers, and the turn's flush (one write per
//! link). The links' state and machines are [`super::Peers`]'s.

use net::io::{CloseReason, ConnId, NetDriver, NetEvent};
use proto::rpc::link::{
    request_shard, Inbound, InboundEvent, LinkCloseReason, LinkEvent, LinkState,
};
use proto::rpc::{Identity, Refusal};
use rand::RngCore;
use shard::runtime::Context;

use crate::cluster::NodeId;

use super::super::msg::{Msg, Remote};
use super::super::shard::{NodeShard, NodeTimer};
use super::super::wire;

use super::Clocks;

impl NodeShard {
    /// Whether `conn` is one of this shard's inter-node connections.
    pub(in crate::node) fn is_peer_conn(&self, conn: ConnId) -> bool {
        self.peers.inbound.contains_key(&conn) || self.peers.is_outbound(conn).is_some()
    }

    /// A driver event of an inter-node connection (or an RPC listener's accept).
    pub(in crate::node) fn on_peer_io(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        event: NetEvent,
    ) {
        match event {
            NetEvent::Accepted { conn, .. } => self.on_peer_accepted(cx, driver, conn),
            NetEvent::Connected { .. } => {}
            NetEvent::Readable { conn } => match self.peers.is_outbound(conn) {
                Some(i) => self.read_outbound(cx, driver, i, conn),
                None => self.read_inbound(cx, driver, conn),
            },
            NetEvent::Closed { conn, reason } => self.on_peer_closed(cx, conn, reason),
        }
    }

    fn on_peer_accepted(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        conn: ConnId,
    ) {
        let Some(key) = &self.peers.key else {
            return driver.close(conn);
        };
        let mut nonce = [0u8; proto::rpc::auth::NONCE_BYTES];
        self.rng.fill_bytes(&mut nonce);
        let p = &self.peers;
        let inbound = Inbound::new(key, p.me, &p.peer_ids, nonce, p.limits, cx.now_ms());
        self.peers.inbound.insert(conn, inbound);
    }

    fn on_peer_closed(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        conn: ConnId,
        reason: CloseReason,
    ) {
        if self.peers.inbound.remove(&conn).is_some() {
            tracing::debug!(?reason, shard = self.me, "inbound peer link closed");
            return;
        }
        let jitter = self.rng.next_u64();
        let now_ms = cx.now_ms();
        let Some(i) = self.peers.is_outbound(conn) else {
            return;
        };
        let peers = &mut self.peers;
        let l = &mut peers.links[i];
        tracing::debug!(
            node = l.node,
            ?reason,
            shard = self.me,
            "outbound peer link closed"
        );
        l.conn = None;
        l.out.clear();
        l.link.on_closed(now_ms, jitter, &mut peers.failed);
        let node = l.node;
        self.metrics.rpc_link_closes.inc();
        self.publish_peer_links();
        // Its handovers will not come on this link: the slots that wait for them
        // serve from what they have (the gateways' rebuild), now.
        self.authority.end_waits_from(node);
    }

    fn publish_peer_links(&self) {
        let mask = self.peers.up_mask();
        self.shared.peer_links_up[self.me as usize]
            .store(mask, std::sync::atomic::Ordering::Release);
    }

    /// The outbound link's input: the handshake's Challenge, Pongs, a Goodbye.
    fn read_outbound(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        i: usize,
        conn: ConnId,
    ) {
        let now_ms = cx.now_ms();
        loop {
            let l = &mut self.peers.links[i];
            let step = l.link.on_input(driver.input(conn), now_ms, &mut l.out);
            driver.consume(conn, step.consumed);
            match step.event {
                Some(LinkEvent::Up {
                    peer_boot_id,
                    restarted,
                }) => {
                    driver.mark_established(conn);
                    tracing::info!(
                        node = l.node,
                        peer_boot_id,
                        restarted,
                        shard = self.me,
                        "peer link up"
                    );
                    let node = l.node;
                    l.boot_known = Some(peer_boot_id);
                    self.shared.note_peer_boot(node, peer_boot_id);
                    self.publish_peer_links();
                    let clock = Clocks {
                        loop_ms: now_ms,
                        node_ms: self.shared.mono_ms(),
                    };
                    let released = self.peers.release_held(i, peer_boot_id, clock);
                    self.metrics.rpc_replies_released.add(released.sent);
                    self.metrics.rpc_replies_expired.add(released.expired);
                    self.metrics.rpc_replies_dropped.add(released.dropped);
                    self.on_peer_up(cx, node);
                }
                Some(LinkEvent::Refused(why)) => {
                    tracing::warn!(node = l.node, %why, "handshake with a peer refused");
                    self.count_refusal(&why);
                    return self.close_outbound(driver, i);
                }
                Some(LinkEvent::Close(why)) => {
                    if matches!(why, LinkCloseReason::Unauthentic(_)) {
                        tracing::warn!(node = l.node, %why, "closing the link to a peer");
                        self.metrics.rpc_auth_failures.inc();
                    } else {
                        tracing::info!(node = l.node, %why, "closing the link to a peer");
                    }
                    return self.close_outbound(driver, i);
                }
                None if step.consumed == 0 => return,
                None => {}
            }
        }
    }

    /// Counts a refused handshake; one of another cluster or slot-id count also by
    /// its own name (the log line says both values).
    fn count_refusal(&self, why: &Refusal) {
        self.metrics.rpc_refused.inc();
        match why {
            Refusal::OtherCluster { .. } => self.metrics.rpc_refused_other_cluster.inc(),
            Refusal::OtherSlotIds { .. } => self.metrics.rpc_refused_other_slot_ids.inc(),
            _ => {}
        }
    }

    /// Counts an inbound link closed for a protocol fault: a frame that failed
    /// authentication by its own name, the rest as refused.
    fn count_close(&self, why: &LinkCloseReason) {
        if matches!(why, LinkCloseReason::Unauthentic(_)) {
            self.metrics.rpc_auth_failures.inc();
        } else {
            self.metrics.rpc_refused.inc();
        }
    }

    fn close_outbound(&mut self, driver: &mut NetDriver, i: usize) {
        let l = &mut self.peers.links[i];
        if let Some(conn) = l.conn {
            let _ = driver.send(conn, &l.out);
            l.out.clear();
            driver.close(conn);
        }
    }

    /// An inbound link's input: the handshake, then one frame at a time, each
    /// decoded and handed to [`super::hops`] (a reply to the shard that asked).
    fn read_inbound(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        conn: ConnId,
    ) {
        let now_ms = cx.now_ms();
        loop {
            let Some(inbound) = self.peers.inbound.get_mut(&conn) else {
                return;
            };
            let scratch = &mut self.peers.scratch;
            scratch.clear();
            let step = inbound.on_input(driver.input(conn), now_ms, scratch);
            let bounds = &self.peers.bounds;
            let frame = match &step.event {
                Some(InboundEvent::Frame { header }) => Some((
                    *header,
                    wire::decode(header.kind, inbound.body(), bounds, header.sender_node_id),
                )),
                _ => None,
            };
            driver.consume(conn, step.consumed);
            if !self.peers.scratch.is_empty() {
                let _ = driver.send(conn, &self.peers.scratch);
            }
            match step.event {
                Some(InboundEvent::Established(peer)) => {
                    driver.mark_established(conn);
                    self.on_peer_boot(driver, peer);
                    tracing::debug!(
                        node = peer.node_id,
                        boot = peer.boot_id,
                        "inbound peer link up"
                    );
                }
                Some(InboundEvent::Refused(why)) => {
                    tracing::warn!(%why, "inter-node connection refused");
                    self.count_refusal(&why);
                    return driver.close(conn);
                }
                Some(InboundEvent::Close(why)) => {
                    tracing::warn!(%why, "inter-node connection closed");
                    self.count_close(&why);
                    return driver.close(conn);
                }
                Some(InboundEvent::Frame { .. }) => {
                    if let Some((header, body)) = frame {
                        self.on_peer_frame(cx, driver, conn, header, body);
                    }
                }
                None if step.consumed == 0 => return,
                None => {}
            }
        }
    }

    fn on_peer_frame(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        conn: ConnId,
        header: proto::rpc::Header,
        body: Option<Result<wire::Body, wire::BadBody>>,
    ) {
        let body = match body {
            Some(Ok(body)) => body,
            Some(Err(err)) => {
                let node = header.sender_node_id;
                tracing::warn!(node, %err, "bad frame from a peer: link closed");
                self.metrics.rpc_bad_frames.inc();
                self.peers.inbound.remove(&conn);
                return driver.close(conn);
            }
            None => return,
        };
        match body {
            wire::Body::Request(request) => {
                let from = Remote {
                    node: header.sender_node_id,
                    boot: header.sender_boot_id,
                    request_id: header.request_id,
                    // The frame's relative deadline, on the node's clock from now.
                    deadline_at_ms: proto::rpc::link::deadline_at_ms(
                        &header,
                        self.shared.mono_ms(),
                    ),
                };
                self.on_remote_request(cx, driver, from, request)
            }
            wire::Body::OneWay(wire::OneWay::Raft { draining, messages }) => {
                let from = header.sender_node_id;
                self.shared.note_peer_draining(from, draining);
                self.on_remote_raft(cx, driver, from, messages)
            }
            wire::Body::OneWay(message) => self.on_remote_oneway(cx, driver, message),
            wire::Body::Reply(reply) => {
                let sender = (header.sender_node_id, header.sender_boot_id);
                let shard = request_shard(header.request_id);
                if shard == self.me {
                    self.on_remote_reply(cx, driver, sender, header.request_id, reply);
                } else if shard < self.shared.slot_map.shard_count() {
                    let msg = Msg::PeerReply {
                        from: sender,
                        request_id: header.request_id,
                        reply: Box::new(reply),
                    };
                    self.send_msg(cx, shard, msg);
                }
            }
        }
    }

    /// The `Peers` timer and every loop turn: dials what is due, runs the links'
    /// timers (deadlines, heartbeats, silence), and hands each link's output to the
    /// driver. Returns the work done.
    pub(in crate::node) fn flush_peers(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
    ) -> usize {
        if !self.peers.is_cluster() {
            return 0;
        }
        let now_ms = cx.now_ms();
        self.dial_due(driver, now_ms);
        if self.peers.holds_replies() {
            let expired = self.peers.expire_held(self.shared.mono_ms());
            self.metrics.rpc_replies_expired.add(expired);
        }
        let mut work = 0;
        for i in 0..self.peers.links.len() {
            let peers = &mut self.peers;
            let l = &mut peers.links[i];
            if let Some(LinkEvent::Close(why)) =
                l.link.on_tick(now_ms, &mut l.out, &mut peers.failed)
            {
                tracing::info!(node = l.node, %why, "closing a silent link to a peer");
                self.close_outbound(driver, i);
                continue;
            }
            let l = &mut self.peers.links[i];
            if let (Some(conn), false) = (l.conn, l.out.is_empty()) {
                work += 1;
                if driver.send(conn, &l.out).is_err() {
                    tracing::warn!(
                        node = l.node,
                        "link output refused by the driver: closing it"
                    );
                }
                l.out.clear();
            }
        }
        self.tick_inbound(driver, now_ms);
        work + self.fail_remote_requests(cx, driver)
    }

    /// Dials each link whose retry time has come, and each down link whose peer
    /// has a process it has not dialed yet (see the module docs: a peer that comes
    /// up is dialed back at once).
    fn dial_due(&mut self, driver: &mut NetDriver, now_ms: u64) {
        for i in 0..self.peers.links.len() {
            let l = &self.peers.links[i];
            let back = self
                .shared
                .peer_boot_id(l.node)
                .filter(|&boot| Some(boot) != l.boot_known);
            let dial_back = back.is_some() && matches!(l.link.state(), LinkState::Down { .. });
            if !(dial_back || l.link.due_to_dial(now_ms)) {
                continue;
            }
            if let Some(boot) = back {
                tracing::debug!(node = l.node, boot, shard = self.me, "dialing a peer back");
                self.peers.links[i].boot_known = Some(boot);
            }
            let mut nonce = [0u8; proto::rpc::auth::NONCE_BYTES];
            self.rng.fill_bytes(&mut nonce);
            let jitter = self.rng.next_u64();
            let peers = &mut self.peers;
            let l = &mut peers.links[i];
            match driver.connect_from(l.addr, self.shared.config.rpc_addr.map(|a| a.ip())) {
                Ok(conn) => {
                    l.conn = Some(conn);
                    l.out.clear();
                    l.link.on_dial(nonce, now_ms, &mut l.out);
                }
                Err(err) => {
                    tracing::debug!(node = l.node, %err, "dialing a peer failed");
                    // on_closed needs the link out of Down: run a dial without a
                    // connection so the backoff advances.
                    l.link.on_dial(nonce, now_ms, &mut l.out);
                    l.out.clear();
                    l.link.on_closed(now_ms, jitter, &mut peers.failed);
                }
            }
        }
    }

    fn tick_inbound(&mut self, driver: &mut NetDriver, now_ms: u64) {
        let mut closed = Vec::new();
        for (&conn, inbound) in self.peers.inbound.iter_mut() {
            self.peers.scratch.clear();
            if let Some(event) = inbound.on_tick(now_ms, &mut self.peers.scratch) {
                tracing::info!(?event, "inbound peer link silent: closed");
                let _ = driver.send(conn, &self.peers.scratch);
                closed.push(conn);
            }
        }
        for conn in closed {
            driver.close(conn);
        }
    }

    /// A peer authenticated on an inbound link: its boot id is noted for the node
    /// (every shard's down link to it dials back at once), and if this shard's
    /// outbound link to it is up with another boot id, that peer restarted and the
    /// link is stale.
    fn on_peer_boot(&mut self, driver: &mut NetDriver, peer: Identity) {
        self.shared.note_peer_boot(peer.node_id, peer.boot_id);
        let Some(i) = self.peers.links.iter().position(|l| l.node == peer.node_id) else {
            return;
        };
        let l = &mut self.peers.links[i];
        if let Some(LinkEvent::Close(why)) = l.link.on_peer_boot(peer.boot_id, &mut l.out) {
            tracing::info!(node = peer.node_id, %why, "peer restarted: closing the stale link");
            self.close_outbound(driver, i);
        }
    }

    /// A link to `node` came up: it gets this node's view (a node that was
    /// unreachable learns the latest view when it reconnects).
    fn on_peer_up(&mut self, cx: &mut Context<Msg, NodeTimer>, node: NodeId) {
        if self.me == 0 {
            let view = self.shared.view();
            self.peers
                .oneway(node, &wire::OneWayRef::View(&view), cx.now_ms());
        }
    }
}
