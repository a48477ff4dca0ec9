//! What a node needs to start: its sections (`[session]`, `[delivery]`, and the
//! [`NodeConfig`] that holds every section), their checks against each other, and
//! the descriptor arithmetic the connection caps come from.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;

use ::shard::runtime::RuntimeConfig;
use net::io::NetConfig;

use crate::activation::ActivationConfig;
use crate::authority::AuthorityConfig;
use crate::cluster::NodeId;
use crate::config::values::at_least_one;
use crate::route::DeviceLevel;
use crate::store::{IdempotencyConfig, LogConfig, MetaConfig};

/// Sessions, touches and acknowledgements: limits and intervals.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SessionConfig {
    pub sessions_per_shard_max: u32,
    /// Sends one connection may make per second to channels it has not sent to
    /// recently (token bucket; 0: no limit). Over it: SENDACK 22 (RateLimit). Bounds
    /// how fast one client creates channels.
    pub new_channels_per_conn_per_s: u32,
    /// The bucket's size: new channels a connection may start at once.
    pub new_channels_per_conn_burst: u32,
    /// Channels a connection sent to recently (8 bytes each, per connection) whose
    /// sends take no token.
    pub recent_channels_per_conn: usize,
    /// How often the touch worker flushes dirty routes (and drains unregisters).
    pub touch_flush_interval_ms: u64,
    /// Most routes one touch flush sends.
    pub touch_batch_routes_max: usize,
    /// Most authority unregisters one flush sends.
    pub unregister_batch_max: usize,
    /// Routes one shard re-registers per second at the new authority after a view
    /// moved their hash slots (failover; `domain::presence::registry::Registry::drain_rebuild`):
    /// a token bucket of `rebuild_routes_per_s × touch_flush_interval_ms` routes,
    /// drained when the view arrives and at every touch flush.
    pub rebuild_routes_per_s: u32,
    /// How often the authority's expiry pass runs.
    pub expiry_interval_ms: u64,
    /// Unacknowledged RECVs kept per session; past it a RECV is sent untracked.
    pub pending_acks_per_session_max: usize,
    /// A RECV without RECVACK after this long is re-sent with DUP.
    pub ack_timeout_ms: u64,
    /// Re-sends of one RECV before it is dropped (the client recovers it by sync).
    pub ack_resends_max: u8,
    /// What the unacknowledged RECVs of one shard may be charged (each: its message's
    /// payload and strings, whether or not other sessions share the message, plus 192
    /// bytes); past it a RECV is sent untracked (counted in `acks_dropped`). Without
    /// it the worst case is `pending_acks_per_session_max` × `payload_bytes_max` per
    /// session.
    pub pending_acks_budget_bytes_per_shard: usize,
    /// SENDs of one connection waiting for their SENDACK; more are answered at once
    /// with SENDACK 22 (RateLimit), which clients retry.
    pub sends_in_flight_per_conn_max: u32,
    /// SENDs one uid may make per second through one gateway shard (token bucket,
    /// `domain::send::send_rate`; 0: no limit). Over it: SENDACK 22 (RateLimit), counted in
    /// `sends_refused_uid_rate`. Kept per shard: a uid with devices on k shards may
    /// send up to k times this. HTTP API sends are not limited. The default is above
    /// WuKongIM's published load tests (400 SENDs/s per sending uid).
    pub sends_per_uid_per_s: u32,
    /// The bucket's size: SENDs a uid may make at once.
    pub sends_per_uid_burst: u32,
    /// Uids whose rate one shard tracks (16 bytes each). Idle uids (full bucket) are
    /// evicted when it is full; while it is full of uids that are not idle, SENDs of
    /// untracked uids are refused like SENDs over the rate.
    pub send_rate_uids_per_shard_max: usize,
    /// Longest uid a CONNECT or `/user/token` may carry (CONNACK 2, HTTP 400 past
    /// it): with `device_id_bytes_max` it bounds a route's size, so a touch batch of
    /// `touch_batch_routes_max` routes is bounded in bytes (checked against `[rpc]
    /// rpc_frame_bytes_max` at start).
    pub uid_bytes_max: usize,
    /// Longest device id a CONNECT may carry (CONNACK 2 past it).
    pub device_id_bytes_max: usize,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            sessions_per_shard_max: 1 << 20,
            new_channels_per_conn_per_s: 10,
            new_channels_per_conn_burst: 64,
            recent_channels_per_conn: 32,
            touch_flush_interval_ms: 1_000,
            touch_batch_routes_max: 512,
            unregister_batch_max: 512,
            rebuild_routes_per_s: 50_000,
            expiry_interval_ms: 1_000,
            pending_acks_per_session_max: 1_024,
            ack_timeout_ms: 10_000,
            ack_resends_max: 3,
            sends_in_flight_per_conn_max: 1_024,
            pending_acks_budget_bytes_per_shard: 128 << 20,
            sends_per_uid_per_s: 1_000,
            sends_per_uid_burst: 1_000,
            send_rate_uids_per_shard_max: 65_536,
            uid_bytes_max: 256,
            device_id_bytes_max: 256,
        }
    }
}

impl SessionConfig {
    /// The gateway's new-channel budget per connection (`domain::send::new_channels`).
    pub fn new_channel_limits(&self) -> domain::send::new_channels::NewChannelLimits {
        domain::send::new_channels::NewChannelLimits {
            per_s: self.new_channels_per_conn_per_s,
            burst: self.new_channels_per_conn_burst,
            recent: self.recent_channels_per_conn,
        }
    }

    /// The rebuild's token bucket: `rebuild_routes_per_s`, a flush interval's worth
    /// at once, batches of `touch_batch_routes_max`.
    pub fn rebuild_limits(&self) -> domain::presence::registry::RebuildLimits {
        let burst = u64::from(self.rebuild_routes_per_s) * self.touch_flush_interval_ms / 1000;
        domain::presence::registry::RebuildLimits {
            routes_per_s: self.rebuild_routes_per_s,
            burst_routes: burst.clamp(1, u64::from(u32::MAX)) as u32,
            batch_routes_max: self.touch_batch_routes_max,
        }
    }

    /// The gateway's SEND rate per uid (`domain::send::send_rate`).
    pub fn send_rate_limits(&self) -> domain::send::send_rate::SendRateLimits {
        domain::send::send_rate::SendRateLimits {
            per_s: self.sends_per_uid_per_s,
            burst: self.sends_per_uid_burst,
            uids_max: self.send_rate_uids_per_shard_max,
        }
    }

    /// Refuses limits the node cannot run with, naming them (`ack_resends_max`
    /// may be 0: no re-send).
    pub fn validate(&self) -> Result<(), String> {
        at_least_one(
            "session",
            &[
                (
                    "sessions_per_shard_max",
                    u64::from(self.sessions_per_shard_max),
                ),
                ("touch_flush_interval_ms", self.touch_flush_interval_ms),
                ("touch_batch_routes_max", self.touch_batch_routes_max as u64),
                ("uid_bytes_max", self.uid_bytes_max as u64),
                ("device_id_bytes_max", self.device_id_bytes_max as u64),
                ("unregister_batch_max", self.unregister_batch_max as u64),
                ("rebuild_routes_per_s", u64::from(self.rebuild_routes_per_s)),
                ("expiry_interval_ms", self.expiry_interval_ms),
                (
                    "pending_acks_per_session_max",
                    self.pending_acks_per_session_max as u64,
                ),
                ("ack_timeout_ms", self.ack_timeout_ms),
                (
                    "pending_acks_budget_bytes_per_shard",
                    self.pending_acks_budget_bytes_per_shard as u64,
                ),
                (
                    "sends_in_flight_per_conn_max",
                    u64::from(self.sends_in_flight_per_conn_max),
                ),
                ("sends_per_uid_burst", u64::from(self.sends_per_uid_burst)),
                (
                    "send_rate_uids_per_shard_max",
                    self.send_rate_uids_per_shard_max as u64,
                ),
            ],
        )
    }
}

/// Delivery planning limits.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeliveryConfig {
    /// Recipients planned per lookup (one route snapshot per page).
    pub subscriber_page_max: usize,
    /// Endpoints per push batch to one owner.
    pub push_batch_max: usize,
    /// Room each shard keeps free towards every peer for control messages
    /// (activations, touches, owner actions, replies): pushes pause before it.
    pub control_room_per_peer: usize,
    /// Subscriber pages one shard plans per loop turn (the rest waits for the next
    /// turn, so sockets and rings are served in between).
    pub pages_per_turn_max: usize,
    /// Subscriber pages one shard has looked up and not yet wholly pushed: while a
    /// page waits for another node's EndpointsByTargets reply, the next ones are
    /// looked up (each group pushed once its lookup ended, after the groups of its
    /// hash slot in earlier pages). 1: one page at a time, each remote round trip
    /// holding the shard's deliveries. Their endpoints are held meanwhile: at most
    /// this × `subscriber_page_max` uids'.
    pub lookup_pages_in_flight_max: usize,
    /// Times a page's failed route lookup groups are looked up again, each time at
    /// the leader the node's current view names for their hash slot when that is
    /// another one (a slot moved while the page was planned); 0: never. Without
    /// it the online recipients of a slot moved in that window miss the push.
    pub lookup_retries_max: u8,
    /// How often a page looks up again a hash slot whose authority answered
    /// "rebuilding" (just moved there, waiting for the old leader's routes), or
    /// that its new leader does not lead yet (its view is behind this node's).
    pub rebuild_retry_interval_ms: u64,
    /// How long a page waits for such a slot at most; its recipients there then
    /// miss the push (`imrouter_pushes_skipped_total{reason="rebuilding"}`) and
    /// catch up by sync. Longer than `[authority] handover_wait_s` plus `[session]
    /// expiry_interval_ms` (the new leader's wait ends by then).
    pub rebuild_wait_ms_max: u64,
}

impl Default for DeliveryConfig {
    fn default() -> Self {
        DeliveryConfig {
            subscriber_page_max: 1_024,
            push_batch_max: 256,
            control_room_per_peer: 1_024,
            pages_per_turn_max: 64,
            lookup_pages_in_flight_max: 32,
            lookup_retries_max: 2,
            rebuild_retry_interval_ms: 20,
            rebuild_wait_ms_max: 4_000,
        }
    }
}

impl DeliveryConfig {
    /// Room a shard keeps towards each peer beyond pushes: the commits it may have in
    /// flight there, the SENDACKs it may owe there (the peer's credits), and control.
    pub fn reserved_room_per_peer(&self, commit: &CommitConfig) -> usize {
        2 * commit.commit_credits_per_peer + self.control_room_per_peer
    }

    /// Checks the delivery limits against the runtime's ring and peer queue: the
    /// reserved room plus one page must fit, or pushes could never be sent.
    pub fn check_room(&self, commit: &CommitConfig, runtime: &RuntimeConfig) -> Result<(), String> {
        let room = runtime.ring_capacity + runtime.peer_queue_max;
        let need = self.reserved_room_per_peer(commit) + self.subscriber_page_max;
        if need > room {
            return Err(format!(
                "2 × [commit] commit_credits_per_peer + [delivery] control_room_per_peer + \
                 subscriber_page_max = {need} must fit in [runtime] ring_capacity + \
                 peer_queue_max = {room}"
            ));
        }
        Ok(())
    }

    /// Refuses limits the node cannot run with, naming them.
    pub fn validate(&self) -> Result<(), String> {
        at_least_one(
            "delivery",
            &[
                ("subscriber_page_max", self.subscriber_page_max as u64),
                ("push_batch_max", self.push_batch_max as u64),
                ("pages_per_turn_max", self.pages_per_turn_max as u64),
                (
                    "lookup_pages_in_flight_max",
                    self.lookup_pages_in_flight_max as u64,
                ),
                ("rebuild_retry_interval_ms", self.rebuild_retry_interval_ms),
            ],
        )
    }

    /// A page waits for a rebuilding authority longer than the authority waits
    /// for its handover (checked at every expiry pass), or its recipients would
    /// miss the push whenever a handover is slow.
    pub fn check_rebuild_wait(
        &self,
        authority: &AuthorityConfig,
        session: &SessionConfig,
    ) -> Result<(), String> {
        let need = (authority.handover_wait_s.saturating_mul(1_000))
            .saturating_add(session.expiry_interval_ms);
        if authority.handover_wait_s > 0 && self.rebuild_wait_ms_max <= need {
            return Err(format!(
                "[delivery] rebuild_wait_ms_max = {} must be above [authority] \
                 handover_wait_s × 1000 + [session] expiry_interval_ms = {need}",
                self.rebuild_wait_ms_max
            ));
        }
        Ok(())
    }
}

/// `[commit]`: the commit core's limits on each shard (back-pressure of appends
/// not yet durable and of messages not yet delivered) and the gateways' credits
/// towards it. These keys were `[delivery]`'s before: read there still, with a
/// warning (`config::RENAMED_KEYS`).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CommitConfig {
    /// Commits appended on one shard and not yet answered (waiting for their sync
    /// under `fsync = "always"`); more are refused with SENDACK 15 until the disk
    /// catches up.
    pub commits_unsynced_max: usize,
    /// SENDs one gateway shard may have in flight to one commit shard (each
    /// reserves room for its SENDACK on the way back); more are answered at once with
    /// SENDACK 22 (RateLimit).
    pub commit_credits_per_peer: usize,
    /// Committed messages waiting on one shard for their delivery (paused while a
    /// peer's queue is full); past it new commits are answered with SENDACK 22.
    pub delivery_backlog_max: usize,
    /// What the messages committed on one shard and not yet delivered may hold (each
    /// charged its payload and strings plus 1 KiB); past it new commits are answered
    /// with SENDACK 22.
    pub backlog_budget_bytes: usize,
    /// With `[cluster] replicas`: messages of other leaders' entries one shard
    /// holds until their leader's delivery mark passes them, to deliver them again
    /// (DUP) should it lead their slot id next; past it the oldest are dropped
    /// (`imrouter_redeliver_dropped_total`; their recipients catch up by
    /// messagesync).
    pub redeliver_messages_max: usize,
    /// With `[cluster] replicas`: `/channel/messagesync` reads waiting on one
    /// shard for their ReadIndex; past it a read is answered 503 (retry).
    pub reads_waiting_max: usize,
    /// With `[cluster] replicas`: catalog changes (tokens, subscribers, leader
    /// choices) proposed on one shard and waiting for their commit; past it a
    /// change is answered 503 (retry).
    pub catalog_changes_waiting_max: usize,
}

impl Default for CommitConfig {
    fn default() -> Self {
        CommitConfig {
            commits_unsynced_max: 65_536,
            commit_credits_per_peer: 1_024,
            delivery_backlog_max: 8_192,
            backlog_budget_bytes: 256 << 20,
            redeliver_messages_max: 4_096,
            reads_waiting_max: 4_096,
            catalog_changes_waiting_max: 1_024,
        }
    }
}

impl CommitConfig {
    /// The commit core's limits, with the log's fsync policy.
    pub fn commit_limits(
        &self,
        log: &crate::store::LogConfig,
    ) -> domain::send::commit::CommitLimits {
        domain::send::commit::CommitLimits {
            answer_after_sync: matches!(log.fsync, crate::store::FsyncPolicy::Always),
            commits_unsynced_max: self.commits_unsynced_max,
            delivery_backlog_max: self.delivery_backlog_max,
            backlog_budget_bytes: self.backlog_budget_bytes,
            redeliver_messages_max: self.redeliver_messages_max,
        }
    }

    /// Refuses limits the node cannot run with, naming them.
    pub fn validate(&self) -> Result<(), String> {
        at_least_one(
            "commit",
            &[
                ("commits_unsynced_max", self.commits_unsynced_max as u64),
                (
                    "commit_credits_per_peer",
                    self.commit_credits_per_peer as u64,
                ),
                ("delivery_backlog_max", self.delivery_backlog_max as u64),
                ("backlog_budget_bytes", self.backlog_budget_bytes as u64),
                ("redeliver_messages_max", self.redeliver_messages_max as u64),
                ("reads_waiting_max", self.reads_waiting_max as u64),
                (
                    "catalog_changes_waiting_max",
                    self.catalog_changes_waiting_max as u64,
                ),
            ],
        )
    }
}

/// Everything a node needs to start.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub node_id: NodeId,
    pub data_dir: PathBuf,
    pub tcp_addr: Option<SocketAddr>,
    pub ws_addr: Option<SocketAddr>,
    /// `[listen] wss_addr`: WebSocket behind TLS with `tls`'s certificate; once
    /// started, the bound address (port 0 resolved).
    pub wss_addr: Option<SocketAddr>,
    pub tls: Option<net::io::TlsServer>,
    /// `[listen] rpc_addr`: the inter-node listener, only with peers.
    pub rpc_addr: Option<SocketAddr>,
    /// `[cluster]`: the nodes, slot ids and secret (no nodes, or only this one: a
    /// node alone).
    pub cluster: crate::config::values::ClusterConfig,
    /// The inter-node links' limits (`[rpc]`).
    pub rpc: proto::rpc::link::LinkLimits,
    /// CONNECT must carry the token stored with `/user/token`.
    pub token_auth: bool,
    /// The level of sessions without a token record when `token_auth` is off.
    pub default_device_level: DeviceLevel,
    pub runtime: RuntimeConfig,
    pub net: NetConfig,
    /// Whether the user set `[net] connections_per_shard_max`: a cap the
    /// descriptor limit cannot hold is then refused at start; otherwise (the
    /// default cap) it is lowered to what the limit holds, with a warning.
    pub connection_cap_set: bool,
    pub authority: AuthorityConfig,
    pub activation: ActivationConfig,
    /// `[registry]`: each shard's registry (its unregister queue).
    pub registry: crate::registry::RegistryLimits,
    pub session: SessionConfig,
    pub commit: CommitConfig,
    pub delivery: DeliveryConfig,
    pub log: LogConfig,
    pub idempotency: IdempotencyConfig,
    pub meta: MetaConfig,
    pub api: crate::http::config::ApiConfig,
    /// `[webhook]`: the application's webhook receiver (none by default).
    pub webhook: crate::webhook::WebhookConfig,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            node_id: 1,
            data_dir: PathBuf::from("./data"),
            tcp_addr: Some(SocketAddr::from(([127, 0, 0, 1], 5100))),
            ws_addr: Some(SocketAddr::from(([127, 0, 0, 1], 5200))),
            wss_addr: None,
            tls: None,
            rpc_addr: None,
            cluster: crate::config::values::ClusterConfig::default(),
            rpc: proto::rpc::link::LinkLimits::default(),
            token_auth: true,
            default_device_level: DeviceLevel::Master,
            runtime: RuntimeConfig {
                thread_name: "imrouter".into(),
                ..RuntimeConfig::default()
            },
            net: NetConfig::default(),
            connection_cap_set: false,
            authority: AuthorityConfig::default(),
            activation: ActivationConfig::default(),
            registry: crate::registry::RegistryLimits::default(),
            session: SessionConfig::default(),
            commit: CommitConfig::default(),
            delivery: DeliveryConfig::default(),
            log: LogConfig::default(),
            idempotency: IdempotencyConfig::default(),
            meta: MetaConfig::default(),
            api: crate::http::config::ApiConfig::default(),
            webhook: crate::webhook::WebhookConfig::default(),
        }
    }
}

/// Descriptors each shard holds besides its client connections: its log's segment
/// files, per listener (TCP, WebSocket, RPC) the socket and the accepts in flight
/// (io_uring), its inter-node links, the ring or epoll instance, the doorbell
/// eventfd, the spare descriptor and a margin.
pub fn fd_per_shard(config: &NodeConfig) -> u64 {
    let peers = config.cluster.peers(config.node_id).count() as u64;
    let rpc_listener = u64::from(config.rpc_addr.is_some() && peers > 0);
    let listeners = u64::from(config.tcp_addr.is_some())
        + u64::from(config.ws_addr.is_some())
        + u64::from(config.wss_addr.is_some())
        + rpc_listener;
    u64::from(config.log.segments_max)
        + listeners * (1 + u64::from(config.net.uring_accepts_inflight))
        + rpc_links_per_shard_max(config) as u64
        + 8
}

/// The inter-node links a shard may hold (`[net]`'s `rpc_links_per_shard_max`, set
/// from the cluster at start): one outbound per peer, and at worst an inbound link
/// from every shard of every peer (as many as ours), twice over for a peer that
/// restarted before its old links were found closed.
pub fn rpc_links_per_shard_max(config: &NodeConfig) -> usize {
    let peers = config.cluster.peers(config.node_id).count();
    peers * (1 + 2 * usize::from(config.runtime.shard_count.max(1)))
}

/// The descriptor budget of `config` under a soft limit of `limit`: `[net]
/// fd_reserve` plus [`fd_per_shard`] for every shard are kept, the rest is split
/// between the shards as their connection cap.
pub fn fd_budget(config: &NodeConfig, limit: u64) -> net::io::fd::FdBudget {
    let shards = u64::from(config.runtime.shard_count.max(1));
    net::io::fd::plan(
        limit,
        config.net.fd_reserve as u64 + shards * fd_per_shard(config),
        shards,
        config.net.connections_per_shard_max as u64,
    )
}

/// Checks the configuration's sections and that the delivery limits fit the rings.
/// Refuses (`InvalidInput`) the first that does not hold.
pub(super) fn validate_node_config(config: &NodeConfig) -> io::Result<()> {
    config
        .session
        .validate()
        .and_then(|()| config.commit.validate())
        .and_then(|()| config.delivery.validate())
        .and_then(|()| config.registry.validate())
        .and_then(|()| config.cluster.validate(config.node_id, config.rpc_addr))
        .and_then(|()| config.webhook.validate())
        .and_then(|()| check_frame_limits(config))
        .and_then(|()| (config.delivery).check_rebuild_wait(&config.authority, &config.session))
        .map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("invalid configuration: {e}"),
            )
        })?;
    config
        .delivery
        .check_room(&config.commit, &config.runtime)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
}

/// Most bytes a route takes in a TouchRoutes body besides its uid and device id:
/// its integers as the longest varints, its flags and both strings' lengths
/// (pinned by a test against the encoder).
pub const ROUTE_WIRE_FIXED_BYTES_MAX: usize = 96;

/// The most bytes a TouchRoutes body of `touch_batch_routes_max` routes takes:
/// every route with the longest uid and device id, plus the target.
pub fn touch_batch_bytes_max(session: &SessionConfig) -> usize {
    let route = ROUTE_WIRE_FIXED_BYTES_MAX + session.uid_bytes_max + session.device_id_bytes_max;
    session.touch_batch_routes_max.saturating_mul(route) + ROUTE_WIRE_FIXED_BYTES_MAX
}

/// The most bytes an API request adds to its body on the link (the hop `Api`):
/// its method, path and query and `Authorization` header, which the HTTP server
/// bounds with the head (hyper's read buffer, 408 KiB), and the frame's own.
pub const API_CALL_HEAD_BYTES_MAX: usize = 512 << 10;

/// The frame limits against each other: an inter-node link's input buffer holds a
/// whole frame of `[rpc] rpc_frame_bytes_max` and one read, or a large frame would
/// stall its link for good; the largest touch batch fits in a frame, or the
/// batch would be refused and requeued for ever; and in a cluster the largest API
/// request fits in one, or a request homed elsewhere could not be passed on.
fn check_frame_limits(config: &NodeConfig) -> Result<(), String> {
    let (frame, net) = (config.rpc.rpc_frame_bytes_max, &config.net);
    let touch = touch_batch_bytes_max(&config.session);
    if touch > frame {
        return Err(format!(
            "[session] touch_batch_routes_max = {} routes of at most {} bytes (uid_bytes_max \
             {} + device_id_bytes_max {} + {ROUTE_WIRE_FIXED_BYTES_MAX}) need [rpc] \
             rpc_frame_bytes_max >= {touch}, not {frame}",
            config.session.touch_batch_routes_max,
            touch / config.session.touch_batch_routes_max.max(1),
            config.session.uid_bytes_max,
            config.session.device_id_bytes_max,
        ));
    }
    let api = config
        .api
        .body_bytes_max
        .saturating_add(API_CALL_HEAD_BYTES_MAX);
    if config.cluster.peers(config.node_id).next().is_some() && api > frame {
        return Err(format!(
            "[api] body_bytes_max = {} plus a request's path and headers (up to \
             {API_CALL_HEAD_BYTES_MAX} bytes) need [rpc] rpc_frame_bytes_max >= {api}, not \
             {frame}: a request homed on another node travels there in one frame",
            config.api.body_bytes_max
        ));
    }
    let need = frame.saturating_add(net.read_chunk_bytes.max(net.uring_buf_bytes as usize));
    if need > net.rpc_inbound_buffer_bytes_max {
        return Err(format!(
            "[rpc] rpc_frame_bytes_max = {frame} plus one read needs [net] \
             rpc_inbound_buffer_bytes_max >= {need}, not {}",
            net.rpc_inbound_buffer_bytes_max
        ));
    }
    Ok(())
}
