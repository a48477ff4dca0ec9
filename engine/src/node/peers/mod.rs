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
//! driver once per loop turn (`NodeShard::flush_peers`, in `io.rs`): one write carries every
//! frame of the turn. The buffer is bounded by the driver's outbound queue limit
//! (a link past it is closed, and its requests fail).

use std::collections::HashMap;
use std::net::SocketAddr;

use net::io::{ConnId, NetDriver, Transport};
use proto::rpc::link::{Failure, Inbound, LinkLimits, LinkState, Outbound, Refused};
use proto::rpc::{ClusterId, ClusterKey, ClusterSecret, Identity};
use slots::ShardId;

use domain::hop::serve::{self, HeldLimits, HeldReplies, NotHeld, ReplyWay};

use crate::cluster::NodeId;
use crate::route::BootId;

use super::msg::Pending;
use super::msg::Remote;
use super::wire;

mod io;

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

    /// Sends `request` to `node`, to be answered within `deadline_ms` (0: `[rpc]
    /// rpc_request_deadline_ms`); gives the pending back if the link refuses it,
    /// with why (`None`: no link to that node).
    pub fn request(
        &mut self,
        node: NodeId,
        request: &wire::Request,
        pending: Pending,
        deadline_ms: u32,
        now_ms: u64,
    ) -> Result<(), (Pending, Option<Refused>)> {
        wire::encode(request, &mut self.body);
        let body = std::mem::take(&mut self.body);
        let result = match self.link_mut(node) {
            Some(l) => l
                .link
                .request(
                    request.kind(),
                    &body,
                    deadline_ms,
                    pending,
                    now_ms,
                    &mut l.out,
                )
                .map(|_| ())
                .map_err(|(why, pending)| {
                    tracing::debug!(node, %why, "request to peer refused");
                    (pending, Some(why))
                }),
            None => Err((pending, None)),
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
