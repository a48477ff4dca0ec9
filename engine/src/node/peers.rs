//! The inter-node links of one shard, on the shard's own io driver (io_uring or
//! mio, like its clients): one **outbound** link per peer node, dialed by this shard
//! and written only by it (its requests, its replies to the peer's requests, its
//! one-way messages), and the **inbound** links peers' shards dialed to this node's
//! RPC listener, which this shard reads (their frames) and answers only with Pongs.
//! The machines are `proto::rpc::link`'s (handshake, heartbeats, silence, backoff,
//! request ids, deadlines, the bounded in-flight table): this file moves their
//! bytes, gives them the time, nonces and jitter, and hands what they read to
//! [`super::hops`].
//!
//! A peer that comes up is dialed back at once: when any link of this node (an
//! inbound one, or another shard's outbound one) reports a boot id of the peer that
//! a down outbound link has not dialed yet, that link dials without waiting for its
//! backoff (`dial_due`). Replies travel on the outbound link, so until it is up
//! the peer's replies are held (`domain::hop::serve::HeldReplies`, `[rpc]
//! rpc_replies_held_max` and `_bytes_max` per link, each until its request's
//! deadline) and sent when it comes up with the process that asked: a restarted
//! node's first requests are answered, not failed at their deadline.
//!
//! Output to a link is appended to its buffer as it is produced and handed to the
//! driver once per loop turn ([`NodeShard::flush_peers`]): one write carries every
//! frame of the turn. The buffer is bounded by the driver's outbound queue limit
//! (a link past it is closed, and its requests fail).

use std::collections::HashMap;
use std::net::SocketAddr;

use net::io::{CloseReason, ConnId, NetDriver, NetEvent, Transport};
use proto::rpc::link::{
    request_shard, Failure, Inbound, InboundEvent, LinkCloseReason, LinkEvent, LinkLimits,
    LinkState, Outbound,
};
use proto::rpc::{ClusterId, ClusterKey, ClusterSecret, Identity, Refusal};
use rand::RngCore;
use shard::runtime::Context;
use slots::ShardId;

use domain::hop::serve::{self, HeldLimits, HeldReplies, NotHeld, ReplyWay};

use crate::cluster::NodeId;
use crate::route::BootId;

use super::msg::Pending;
use super::msg::{Msg, Remote};
use super::shard::{NodeShard, NodeTimer};
use super::wire;

/// One peer node as this shard dials it.
struct PeerLink {
    node: NodeId,
    addr: SocketAddr,
    conn: Option<ConnId>,
    link: Outbound<Pending>,
    /// Frames written since the last flush.
    out: Vec<u8>,
    /// The peer process this link was last up with or dialed for (a boot id
    /// reported since, by any link of the node, makes a down link dial at once).
    boot_known: Option<BootId>,
    /// Replies to the peer while this link is not up with the process that asked.
    held: HeldReplies,
}

/// What became of a reply to another node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyOutcome {
    /// Written to the link.
    Sent,
    /// Held until the link to its requester comes up.
    Held,
    /// Not sent: its request's deadline has passed (or would before it got back).
    Expired,
    /// Not sent: the link is not up and its held replies are at their limit.
    Full,
    /// Not sent: no such peer, or the requesting process is gone (the peer
    /// restarted since), or the link refused the frame.
    Dropped,
}

/// The time now on the shard's loop clock (`Context::now_ms`: the links' timers)
/// and on the node's (`NodeShared::mono_ms`: other nodes' request deadlines, which
/// cross shards).
#[derive(Clone, Copy, Debug)]
pub struct Clocks {
    pub loop_ms: u64,
    pub node_ms: u64,
}

/// What became of the replies held for a link that came up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReleaseCounts {
    pub sent: u64,
    pub expired: u64,
    pub dropped: u64,
}

/// This shard's links (empty on a node alone).
pub struct Peers {
    me: Identity,
    key: Option<ClusterKey>,
    limits: LinkLimits,
    peer_ids: Vec<u64>,
    links: Vec<PeerLink>,
    inbound: HashMap<ConnId, Inbound>,
    /// Requests that failed in the machines (deadline, link lost), for the shard.
    failed: Vec<(Pending, Failure)>,
    /// A body being encoded (reused).
    body: Vec<u8>,
    /// Bytes an inbound machine writes (Challenge, Pong, Goodbye; reused).
    scratch: Vec<u8>,
    /// What every frame read is checked against.
    bounds: wire::Bounds,
}

impl Peers {
    /// The links of shard `shard` of node `me` towards `peers` (node id, RPC address).
    pub fn new(
        me: Identity,
        shard: ShardId,
        key: Option<ClusterKey>,
        limits: LinkLimits,
        peers: &[(NodeId, SocketAddr)],
        bounds: wire::Bounds,
    ) -> Peers {
        let links = match &key {
            Some(key) => peers
                .iter()
                .map(|&(node, addr)| PeerLink {
                    node,
                    addr,
                    conn: None,
                    link: Outbound::new(key, me, node, shard, limits),
                    out: Vec::new(),
                    boot_known: None,
                    held: HeldReplies::new(HeldLimits {
                        replies_max: limits.rpc_replies_held_max,
                        bytes_max: limits.rpc_replies_held_bytes_max,
                    }),
                })
                .collect(),
            None => Vec::new(),
        };
        Peers {
            me,
            key,
            limits,
            peer_ids: peers.iter().map(|p| p.0).collect(),
            links,
            inbound: HashMap::new(),
            failed: Vec::new(),
            body: Vec::new(),
            scratch: Vec::new(),
            bounds,
        }
    }

    /// Whether this node has peers.
    pub fn is_cluster(&self) -> bool {
        !self.links.is_empty()
    }

    /// Whether `node` is a peer this shard has a link to.
    pub fn knows(&self, node: NodeId) -> bool {
        self.links.iter().any(|l| l.node == node)
    }

    fn link_mut(&mut self, node: NodeId) -> Option<&mut PeerLink> {
        self.links.iter_mut().find(|l| l.node == node)
    }

    /// Sends `request` to `node`; gives the pending back if the link refuses it,
    /// with whether the link is down (no connection to that node) rather than full.
    pub fn request(
        &mut self,
        node: NodeId,
        request: &wire::Request,
        pending: Pending,
        now_ms: u64,
    ) -> Result<(), (Pending, bool)> {
        wire::encode(request, &mut self.body);
        let body = std::mem::take(&mut self.body);
        let result = match self.link_mut(node) {
            Some(l) => l
                .link
                .request(request.kind(), &body, 0, pending, now_ms, &mut l.out)
                .map(|_| ())
                .map_err(|(why, pending)| {
                    tracing::debug!(node, %why, "request to peer refused");
                    (pending, why == proto::rpc::link::Refused::Down)
                }),
            None => Err((pending, true)),
        };
        self.body = body;
        result
    }

    /// Sends a one-way message to `node`; false if the link refused it.
    pub fn oneway(&mut self, node: NodeId, message: &wire::OneWayRef<'_>, now_ms: u64) -> bool {
        wire::encode(message, &mut self.body);
        let body = std::mem::take(&mut self.body);
        let sent = self.link_mut(node).is_some_and(|l| {
            l.link
                .oneway(message.kind(), &body, now_ms, &mut l.out)
                .is_ok()
        });
        self.body = body;
        sent
    }

    /// The time a reply needs to get back to its requester (`[rpc]
    /// rpc_reply_margin_ms`).
    pub fn reply_margin_ms(&self) -> u64 {
        u64::from(self.limits.rpc_reply_margin_ms)
    }

    /// Answers a request of another node while in time: on the link to it when
    /// that is up with the requesting process; held when the link is not up (or
    /// still up with an older process of the peer, about to close as stale), within
    /// the held replies' limits. `latest_boot` is the peer's newest process this
    /// node knows: a reply to another one is dropped. `clock` is the time on the
    /// shard's loop clock and on the node's (that of the request's deadline).
    pub fn reply(
        &mut self,
        to: Remote,
        reply: &wire::Reply,
        clock: Clocks,
        latest_boot: Option<BootId>,
    ) -> ReplyOutcome {
        let margin = self.reply_margin_ms();
        let now_ms = clock.node_ms;
        if !serve::in_time(to.deadline_at_ms, now_ms, margin) {
            return ReplyOutcome::Expired;
        }
        wire::encode(reply, &mut self.body);
        let Some(l) = self.links.iter_mut().find(|l| l.node == to.node) else {
            return ReplyOutcome::Dropped;
        };
        let up_with = match l.link.state() {
            LinkState::Up { peer_boot_id } => Some(peer_boot_id),
            _ => None,
        };
        match serve::reply_way(up_with, to.boot, latest_boot) {
            ReplyWay::Send => {
                match l
                    .link
                    .send_reply(to.request_id, &self.body, clock.loop_ms, &mut l.out)
                {
                    Ok(()) => ReplyOutcome::Sent,
                    Err(_) => ReplyOutcome::Dropped,
                }
            }
            ReplyWay::Drop => ReplyOutcome::Dropped,
            ReplyWay::Hold => {
                let send_by = serve::send_by_ms(to.deadline_at_ms, margin);
                match l
                    .held
                    .hold(to.boot, to.request_id, &self.body, send_by, now_ms)
                {
                    Ok(()) => ReplyOutcome::Held,
                    Err(NotHeld::Expired) => ReplyOutcome::Expired,
                    Err(NotHeld::Full) => ReplyOutcome::Full,
                }
            }
        }
    }

    /// The replies held for link `i`, now up with process `boot`: those for that
    /// process within their deadline are sent, the others dropped.
    fn release_held(&mut self, i: usize, boot: BootId, clock: Clocks) -> ReleaseCounts {
        let l = &mut self.links[i];
        let released = l.held.release(boot, clock.node_ms);
        let mut counts = ReleaseCounts {
            expired: released.expired,
            dropped: released.gone,
            ..ReleaseCounts::default()
        };
        for r in released.send {
            match l
                .link
                .send_reply(r.request_id, &r.body, clock.loop_ms, &mut l.out)
            {
                Ok(()) => counts.sent += 1,
                Err(_) => counts.dropped += 1,
            }
        }
        counts
    }

    /// Whether any link holds replies.
    fn holds_replies(&self) -> bool {
        self.links.iter().any(|l| !l.held.is_empty())
    }

    /// Drops the held replies past their deadline (`now_ms` on the node's clock);
    /// returns how many.
    fn expire_held(&mut self, now_ms: u64) -> u64 {
        self.links.iter_mut().map(|l| l.held.expire(now_ms)).sum()
    }

    /// A reply to `request_id` from `(node, boot)`: its pending, if still in flight
    /// and sent to that very process.
    pub fn complete(&mut self, (node, boot): (NodeId, BootId), request_id: u64) -> Option<Pending> {
        self.link_mut(node)?.link.complete(request_id, boot)
    }

    /// Moves the requests the machines failed into `into`.
    pub fn take_failed(&mut self, into: &mut Vec<Pending>) {
        into.extend(self.failed.drain(..).map(|(p, _)| p));
    }

    /// Bytes written to the up link to `node` and not yet on the wire (this turn's
    /// frames and the driver's queue); `None` when the link is not up.
    pub fn queued_bytes(&self, node: NodeId, driver: &NetDriver) -> Option<usize> {
        let l = self.links.iter().find(|l| l.node == node)?;
        let up = matches!(l.link.state(), proto::rpc::link::LinkState::Up { .. });
        let conn = l.conn.filter(|_| up)?;
        Some(l.out.len() + driver.outbound_bytes(conn))
    }

    /// Bit i set: the link to the i-th peer (config order) is up.
    pub fn up_mask(&self) -> u64 {
        self.links.iter().enumerate().fold(0, |m, (i, l)| {
            let up = matches!(l.link.state(), proto::rpc::link::LinkState::Up { .. });
            m | (u64::from(up) << i)
        })
    }

    /// The peers this shard's link to is not up.
    pub fn down_nodes(&self) -> impl Iterator<Item = NodeId> + '_ {
        (self.links.iter())
            .filter(|l| !matches!(l.link.state(), proto::rpc::link::LinkState::Up { .. }))
            .map(|l| l.node)
    }

    fn is_outbound(&self, conn: ConnId) -> Option<usize> {
        self.links.iter().position(|l| l.conn == Some(conn))
    }
}

impl NodeShard {
    /// Whether `conn` is one of this shard's inter-node connections.
    pub(super) fn is_peer_conn(&self, conn: ConnId) -> bool {
        self.peers.inbound.contains_key(&conn) || self.peers.is_outbound(conn).is_some()
    }

    /// A driver event of an inter-node connection (or an RPC listener's accept).
    pub(super) fn on_peer_io(
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
    pub(super) fn flush_peers(
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

/// The links of shard `me` of the node `shared` describes: none on a node alone.
pub fn new_for_shard(shared: &super::shared::NodeShared, me: ShardId) -> Peers {
    let cfg = &shared.config;
    let peers: Vec<(NodeId, SocketAddr)> = cfg
        .cluster
        .peers(cfg.node_id)
        .map(|n| (n.id, n.rpc_addr))
        .collect();
    // Both were validated with the config.
    let secret = ClusterSecret::new(cfg.cluster.secret.expose()).ok();
    let id = ClusterId::new(&cfg.cluster.id).ok();
    let key = match (secret, id) {
        (Some(secret), Some(id)) if !peers.is_empty() => {
            Some(ClusterKey::new(secret, id, cfg.cluster.slot_ids))
        }
        _ => None,
    };
    let me_id = Identity {
        node_id: cfg.node_id,
        boot_id: shared.boot_id,
    };
    let bounds = wire::Bounds {
        node_id: cfg.node_id,
        boot_id: shared.boot_id,
        shard_count: usize::from(shared.slot_map.shard_count()),
        nodes: cfg.cluster.nodes.iter().map(|n| n.id).collect(),
        slot_ids: cfg.cluster.slot_ids,
    };
    Peers::new(me_id, me, key, cfg.rpc, &peers, bounds)
}

/// Whether an accepted connection is an inter-node one.
pub fn is_rpc_listener(listener: Transport) -> bool {
    listener == Transport::Rpc
}
