//! A running imrouter node: the shard runtime with one [`shard::NodeShard`] per core,
//! its listeners, its logs and the shared lock-free tables.
//!
//! One shard's work, one concern per module:
//! - [`shard`]: `NodeShard`, its timers and the loop glue (`impl Handler`) that hands
//!   each message, timer and socket event to the module below that owns it.
//! - `conns`: the connection table and its frames (accept, decode, dispatch, write,
//!   close).
//! - `connect`: CONNECT admission (version, token, key agreement) and the activation
//!   driver (events in, outputs carried out, CONNACK).
//! - `authority_service`: authority calls and their service on the slot's shard,
//!   owner actions (kick/close), the touch worker, the expiry pass.
//! - `control`: gauges, device quit, view changes, shutdown, injected panics.
//! - [`send`]: the SEND → commit → SENDACK → delivery → RECV → RECVACK flow, one file
//!   per side (gateway, commit, owner), driving the machines of `domain`.
//! - [`syncer`]: each shard's log syncer thread (`fdatasync` off the shard thread).
//!
//! Shared by the shards:
//! - [`msg`]: every message between shards.
//! - [`catalog`]: tokens and group subscribers, read lock-free by the shards.
//! - [`metrics`]: per-shard counters and stage histograms.

mod authority_service;
pub mod catalog;
mod connect;
mod conns;
mod control;
mod hops;
pub mod metrics;
pub mod msg;
mod peers;
pub mod send;
pub mod shard;
pub mod syncer;
pub mod wire;

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use ::shard::runtime::{Injector, Runtime, RuntimeConfig, RuntimeHandle, ShardInit};
use ::slots::{ShardId, SlotMap};
use net::io::{bind_reuseport, NetConfig, NetDriver, Transport};

use crate::activation::ActivationConfig;
use crate::authority::{AuthorityConfig, AuthorityReader, Directory};
use crate::cluster::{ClusterView, NodeId};
use crate::route::{BootId, DeviceLevel};
use crate::store::{
    log_dir, IdempotencyConfig, IdempotencyWindow, LogConfig, MessageIdGen, MessageLog, MetaConfig,
};

use self::catalog::Catalog;
use self::metrics::ShardMetrics;
use self::msg::Msg;
use self::shard::NodeShard;

/// Sessions, touches and acknowledgements: limits and intervals.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SessionConfig {
    pub max_sessions_per_shard: u32,
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
    pub touch_batch_max_routes: usize,
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
    /// it the worst case is `pending_acks_per_session_max` × `max_payload_bytes` per
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
    /// `touch_batch_max_routes` routes is bounded in bytes (checked against `[rpc]
    /// rpc_frame_bytes_max` at start).
    pub uid_bytes_max: usize,
    /// Longest device id a CONNECT may carry (CONNACK 2 past it).
    pub device_id_bytes_max: usize,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            max_sessions_per_shard: 1 << 20,
            new_channels_per_conn_per_s: 10,
            new_channels_per_conn_burst: 64,
            recent_channels_per_conn: 32,
            touch_flush_interval_ms: 1_000,
            touch_batch_max_routes: 512,
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

/// `Err("section.name must be at least 1")` for each limit that is 0.
pub(crate) fn at_least_one(section: &str, limits: &[(&str, u64)]) -> Result<(), String> {
    match limits.iter().find(|(_, v)| *v == 0) {
        Some((name, _)) => Err(format!("{section}.{name} must be at least 1 (is 0)")),
        None => Ok(()),
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
    /// at once, batches of `touch_batch_max_routes`.
    pub fn rebuild_limits(&self) -> domain::presence::registry::RebuildLimits {
        let burst = u64::from(self.rebuild_routes_per_s) * self.touch_flush_interval_ms / 1000;
        domain::presence::registry::RebuildLimits {
            routes_per_s: self.rebuild_routes_per_s,
            burst_routes: burst.clamp(1, u64::from(u32::MAX)) as u32,
            batch_max_routes: self.touch_batch_max_routes,
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
                    "max_sessions_per_shard",
                    u64::from(self.max_sessions_per_shard),
                ),
                ("touch_flush_interval_ms", self.touch_flush_interval_ms),
                ("touch_batch_max_routes", self.touch_batch_max_routes as u64),
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
    /// Commits appended on one shard and not yet answered (waiting for their sync
    /// under `fsync = "always"`); more are refused with SENDACK 15 until the disk
    /// catches up.
    pub commits_unsynced_max: usize,
    /// SENDs one gateway shard may have in flight to one commit shard (each
    /// reserves room for its SENDACK on the way back); more are answered at once with
    /// SENDACK 22 (RateLimit).
    pub commit_credits_per_peer: usize,
    /// Room each shard keeps free towards every peer for control messages
    /// (activations, touches, owner actions, replies): pushes pause before it.
    pub control_room_per_peer: usize,
    /// Committed messages waiting on one shard for their delivery (paused while a
    /// peer's queue is full); past it new commits are answered with SENDACK 22.
    pub delivery_backlog_max: usize,
    /// What the messages committed on one shard and not yet delivered may hold (each
    /// charged its payload and strings plus 1 KiB); past it new commits are answered
    /// with SENDACK 22.
    pub backlog_budget_bytes: usize,
    /// Subscriber pages one shard plans per loop turn (the rest waits for the next
    /// turn, so sockets and rings are served in between).
    pub pages_per_turn_max: usize,
    /// Subscriber pages one shard has looked up and not yet pushed: while a page
    /// waits for another node's EndpointsByTargets reply, the next ones are looked
    /// up (pushed in order, after it). 1: one page at a time, each remote round
    /// trip holding the shard's deliveries. Their endpoints are held meanwhile: at
    /// most this × `subscriber_page_max` uids'.
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
            commits_unsynced_max: 65_536,
            commit_credits_per_peer: 1_024,
            control_room_per_peer: 1_024,
            delivery_backlog_max: 8_192,
            backlog_budget_bytes: 256 << 20,
            pages_per_turn_max: 64,
            lookup_pages_in_flight_max: 32,
            lookup_retries_max: 2,
            rebuild_retry_interval_ms: 20,
            rebuild_wait_ms_max: 4_000,
        }
    }
}

impl DeliveryConfig {
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
        }
    }

    /// Room a shard keeps towards each peer beyond pushes: the commits it may have in
    /// flight there, the SENDACKs it may owe there (the peer's credits), and control.
    pub fn reserved_room_per_peer(&self) -> usize {
        2 * self.commit_credits_per_peer + self.control_room_per_peer
    }

    /// Checks the delivery limits against the runtime's ring and peer queue: the
    /// reserved room plus one page must fit, or pushes could never be sent.
    pub fn check_room(&self, runtime: &RuntimeConfig) -> Result<(), String> {
        let room = runtime.ring_capacity + runtime.peer_queue_max;
        let need = self.reserved_room_per_peer() + self.subscriber_page_max;
        if need > room {
            return Err(format!(
                "[delivery] 2 × commit_credits_per_peer + control_room_per_peer + \
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
                ("commits_unsynced_max", self.commits_unsynced_max as u64),
                (
                    "commit_credits_per_peer",
                    self.commit_credits_per_peer as u64,
                ),
                ("delivery_backlog_max", self.delivery_backlog_max as u64),
                ("pages_per_turn_max", self.pages_per_turn_max as u64),
                (
                    "lookup_pages_in_flight_max",
                    self.lookup_pages_in_flight_max as u64,
                ),
                ("backlog_budget_bytes", self.backlog_budget_bytes as u64),
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

/// How long a stop waits for the log syncer threads to end.
const SYNCER_STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

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
    pub cluster: crate::config::ClusterConfig,
    /// The inter-node links' limits (`[rpc]`).
    pub rpc: proto::rpc::link::LinkLimits,
    /// CONNECT must carry the token stored with `/user/token`.
    pub token_auth: bool,
    /// The level of sessions without a token record when `token_auth` is off.
    pub default_device_level: DeviceLevel,
    pub runtime: RuntimeConfig,
    pub net: NetConfig,
    /// Whether the user set `[net] max_connections_per_shard`: a cap the
    /// descriptor limit cannot hold is then refused at start; otherwise (the
    /// default cap) it is lowered to what the limit holds, with a warning.
    pub connection_cap_set: bool,
    pub authority: AuthorityConfig,
    pub activation: ActivationConfig,
    /// `[registry]`: each shard's registry (its unregister queue).
    pub registry: crate::registry::RegistryLimits,
    pub session: SessionConfig,
    pub delivery: DeliveryConfig,
    pub log: LogConfig,
    pub idempotency: IdempotencyConfig,
    pub meta: MetaConfig,
    pub api: crate::http::ApiConfig,
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
            cluster: crate::config::ClusterConfig::default(),
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
            delivery: DeliveryConfig::default(),
            log: LogConfig::default(),
            idempotency: IdempotencyConfig::default(),
            meta: MetaConfig::default(),
            api: crate::http::ApiConfig::default(),
            webhook: crate::webhook::WebhookConfig::default(),
        }
    }
}

/// What every shard (and the HTTP API) shares.
pub struct NodeShared {
    pub config: NodeConfig,
    pub boot_id: BootId,
    pub slot_map: SlotMap,
    pub directory: Arc<Directory>,
    pub catalog: Catalog,
    /// The view the node started with.
    pub initial_view: ClusterView,
    /// The newest view (the control path replaces it and sends it to every shard).
    view: std::sync::Mutex<Arc<ClusterView>>,
    pub shard_metrics: Vec<Arc<ShardMetrics>>,
    /// Per shard: the stage latencies of the message path (`/metrics`).
    pub stages: Vec<Arc<metrics::StageHistograms>>,
    /// The origin of [`NodeShared::mono_ns`].
    epoch: std::time::Instant,
    /// Active routes per hash slot, refreshed by each slot's shard every expiry pass.
    pub routes_per_slot: Vec<AtomicU64>,
    /// `[from * shards + to]`: messages queued from shard `from` to shard `to`,
    /// sampled every expiry pass.
    pub ring_occupancy: Vec<AtomicU64>,
    started_shards: AtomicUsize,
    /// The runtime, once started: a shard that ended on its own is fatal.
    runtime: std::sync::OnceLock<RuntimeHandle>,
    /// The HTTP API's own counters (`imrouter_api_*`).
    pub api_metrics: crate::http::ApiMetrics,
    /// The descriptor budget the connection caps came from (`imrouter_fd_limit` is
    /// its `limit`; `imrouter_open_fds` is [`NodeShared::open_fds`]).
    pub fd_budget: net::io::fd::FdBudget,
    /// Per shard: the peers (bit i = the i-th peer in config order) its outbound
    /// link to is up, published by the shard as links come and go.
    pub peer_links_up: Vec<AtomicU64>,
    /// Per peer (config order, like `peer_links_up`'s bits): the boot id its link
    /// last reported, 0 before any ([`NodeShared::note_peer_boot`]).
    peer_boot_ids: Vec<AtomicU64>,
    /// The client listeners' bound addresses (port 0 resolved): what `GET /route`
    /// answers for this node when its `[[cluster.nodes]]` entry names none.
    pub client_tcp_addr: Option<SocketAddr>,
    pub client_ws_addr: Option<SocketAddr>,
    /// Set by the first `POST /node/drain`, never cleared (a drained node is
    /// stopped next): `/readyz` is 503, `/route` no longer names this node.
    draining: std::sync::atomic::AtomicBool,
    /// Set by the first view a peer sent (every link that comes up carries one): a
    /// node of a cluster serves its configured view, maybe long stale after a
    /// restart, until then, so `/readyz` waits for it.
    view_heard: std::sync::atomic::AtomicBool,
    /// The webhooks' hand-off and counters (does nothing without `[webhook] url`).
    pub webhooks: Arc<crate::webhook::WebhookSink>,
}

impl NodeShared {
    /// Wall-clock milliseconds (message ids, timestamps, CONNACK time_diff).
    pub fn wall_ms(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    }

    /// Monotonic nanoseconds since the node started, comparable across shards: the
    /// timestamps of the stage histograms.
    #[inline]
    pub fn mono_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Milliseconds since the node started, comparable across shards: the clock of
    /// other nodes' request deadlines ([`msg::Remote`]), read where a request is
    /// read, served and answered (a shard's loop clock has its own start).
    pub fn mono_ms(&self) -> u64 {
        self.mono_ns() / 1_000_000
    }

    fn shard_started(&self) {
        self.started_shards.fetch_add(1, Ordering::SeqCst);
    }

    /// Whether every shard has started its loop.
    pub fn all_shards_started(&self) -> bool {
        self.started_shards.load(Ordering::SeqCst) == self.slot_map.shard_count() as usize
    }

    /// The peers every shard has an up link to, in config order (bit i = i-th peer).
    pub fn peers_reached_mask(&self) -> u64 {
        self.peer_links_up
            .iter()
            .fold(u64::MAX, |m, s| m & s.load(Ordering::Acquire))
    }

    /// Records that a link to peer `node` came up with `boot_id` (shown by `GET
    /// /cluster/slots`). Any shard may call it; an unknown node is ignored.
    pub fn note_peer_boot(&self, node: NodeId, boot_id: BootId) {
        let me = self.config.node_id;
        if let Some(i) = self.config.cluster.peers(me).position(|n| n.id == node) {
            self.peer_boot_ids[i].store(boot_id, Ordering::Release);
        }
    }

    /// The boot id a link to peer `node` last reported; `None` before any.
    pub fn peer_boot_id(&self, node: NodeId) -> Option<BootId> {
        let me = self.config.node_id;
        let i = self.config.cluster.peers(me).position(|n| n.id == node)?;
        Some(self.peer_boot_ids[i].load(Ordering::Acquire)).filter(|&b| b != 0)
    }

    /// How many peers every shard has an up link to.
    pub fn peers_reached(&self) -> usize {
        let peers = self.config.cluster.peers(self.config.node_id).count();
        (self.peers_reached_mask().count_ones() as usize).min(peers)
    }

    /// Why the node should not get traffic now (`/readyz` answers 503 with it), or
    /// `None` when it is ready. Every condition that makes the node unfit to serve
    /// is checked here, in one place.
    pub fn not_ready(&self) -> Option<String> {
        if let Some(failure) = self.runtime.get().and_then(|r| r.failure()) {
            return Some(format!("a shard failed ({failure}); the node is stopping"));
        }
        if !self.all_shards_started() {
            return Some("shards are starting".into());
        }
        if self.is_draining() {
            return Some(
                "draining: this node takes no new client connections and will stop".into(),
            );
        }
        let peers = self.config.cluster.peers(self.config.node_id).count();
        let (reached, nodes) = (self.peers_reached(), peers + 1);
        if peers > 0 && (reached + 1) * 2 <= nodes {
            return Some(format!(
                "reached {reached} of {peers} peers: a majority of the {nodes} nodes is needed"
            ));
        }
        if peers > 0 && !self.view_heard.load(Ordering::Acquire) {
            return Some(
                "waiting for the cluster view from a peer: the configured one may be stale \
                 (slots moved while this node was down)"
                    .into(),
            );
        }
        if let Some(shard) = self
            .shard_metrics
            .iter()
            .position(|m| m.log_write_failed.get() > 0)
        {
            return Some(format!(
                "shard {shard}: message log failed (disk I/O error); sends are refused \
                 until the node restarts"
            ));
        }
        if let Some(shard) = self
            .shard_metrics
            .iter()
            .position(|m| m.listener_paused_tcp.get() + m.listener_paused_ws.get() > 0)
        {
            return Some(format!(
                "client listener of shard {shard} paused: accept failed (out of file \
                 descriptors or memory)"
            ));
        }
        None
    }

    /// Descriptors the process has open now (the `imrouter_open_fds` gauge; `None`
    /// when `/proc/self/fd` cannot be read, e.g. out of descriptors).
    pub fn open_fds(&self) -> Option<u64> {
        net::io::fd::open_fds()
    }

    /// The newest cluster view.
    pub fn view(&self) -> Arc<ClusterView> {
        self.view.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Moves the leadership of `hash_slots` to `leader_node_id` (a failover drill),
    /// if the view is still at revision `expected` (when given): each moved slot's
    /// term advances, and so does the routing revision. The new view is saved in
    /// the data dir before it is installed ([`crate::store::view`]). Returns it,
    /// which the caller sends to every shard, or why nothing moved: the current
    /// revision when it is not the expected one, or the save's error.
    pub fn move_leaders(
        &self,
        hash_slots: &[u16],
        leader_node_id: NodeId,
        expected: Option<crate::cluster::Revision>,
    ) -> Result<Arc<ClusterView>, MoveRefused> {
        let moves: Vec<(u16, NodeId)> = hash_slots.iter().map(|&s| (s, leader_node_id)).collect();
        let mut guard = self.view.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(expected) = expected.filter(|&r| r != guard.revision) {
            return Err(MoveRefused::Revision {
                expected,
                current: guard.revision,
            });
        }
        let next = guard.with_leaders(self.config.node_id, &moves);
        self.save_moved(&mut guard, next)
    }

    /// [`NodeShared::move_leaders`] with a new leader per hash slot, in one view
    /// change (one revision), whatever the revision.
    pub fn move_leaders_each(
        &self,
        moves: &[(u16, NodeId)],
    ) -> Result<Arc<ClusterView>, MoveRefused> {
        let mut guard = self.view.lock().unwrap_or_else(|e| e.into_inner());
        let next = guard.with_leaders(self.config.node_id, moves);
        self.save_moved(&mut guard, next)
    }

    /// Saves a moved view in the data dir, then installs it in `current`; nothing
    /// moves when the save fails (logged: the operator's call gets 500).
    fn save_moved(
        &self,
        current: &mut Arc<ClusterView>,
        next: ClusterView,
    ) -> Result<Arc<ClusterView>, MoveRefused> {
        if let Err(e) = crate::store::view::save(&self.config.data_dir, &next) {
            tracing::error!(error = %e, revision = next.revision, "saving a moved cluster view failed: nothing moved");
            return Err(MoveRefused::Save(e));
        }
        *current = Arc::new(next);
        Ok(current.clone())
    }

    /// Marks the node draining (`POST /node/drain`): from now on `/readyz` is 503
    /// and `/route` sends clients elsewhere. The shards refuse new client
    /// connections once each got `Msg::Drain`. Never undone: a drained node is
    /// stopped next (a restart serves again).
    pub fn begin_drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Whether `POST /node/drain` was called.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// The hash slots this node leads in the newest view, each with the peer it
    /// moves to when drained: slot ids (and all their hash slots) round robin over
    /// `to`, in slot id order. Empty when it leads none or `to` is empty.
    pub fn drain_moves(&self, to: &[NodeId]) -> Vec<(u16, NodeId)> {
        self.view().drain_moves(self.config.node_id, to)
    }

    /// Notes that a peer sent its view (the node may now report ready).
    pub fn note_view_heard(&self) {
        self.view_heard.store(true, Ordering::Release);
    }

    /// Joins `view` (from another node) with the current one (`ClusterView::merge`:
    /// slot by slot the higher term, so moves made through different nodes are all
    /// kept and no term goes back); gives the joined view back installed, or `None`
    /// when `view` brought nothing new.
    ///
    /// The joined view is saved in the data dir first ([`crate::store::view`]; a
    /// rare, small fsync on the shard that got it). A failed save is logged and the
    /// view installed anyway: it came from a peer, which holds it.
    pub fn install_view(&self, view: ClusterView) -> Option<Arc<ClusterView>> {
        let mut guard = self.view.lock().unwrap_or_else(|e| e.into_inner());
        let merged = guard.merge(&view)?;
        if let Err(e) = crate::store::view::save(&self.config.data_dir, &merged) {
            tracing::error!(error = %e, revision = merged.revision, "saving the cluster view failed");
        }
        *guard = Arc::new(merged);
        Some(guard.clone())
    }

    /// A lock-free reader of every hash slot's routes.
    pub fn authority_reader(&self) -> AuthorityReader {
        AuthorityReader::new(&self.directory)
    }
}

/// Why a slot move ([`NodeShared::move_leaders`]) moved nothing.
#[derive(Debug)]
pub enum MoveRefused {
    /// The view is not at the revision the move expected (HTTP 409).
    Revision {
        expected: crate::cluster::Revision,
        current: crate::cluster::Revision,
    },
    /// The new view could not be saved in the data dir (HTTP 500): a move answered
    /// 200 must survive this node's crash.
    Save(io::Error),
}

impl std::fmt::Display for MoveRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MoveRefused::Revision { expected, current } => write!(
                f,
                "the view is at revision {current}, not {expected}: read GET /cluster/slots \
                 and move again"
            ),
            MoveRefused::Save(e) => write!(f, "the moved view could not be saved: {e}"),
        }
    }
}

impl MoveRefused {
    /// The HTTP status of this refusal.
    pub fn status(&self) -> u16 {
        match self {
            MoveRefused::Revision { .. } => 409,
            MoveRefused::Save(_) => 500,
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
    u64::from(config.log.max_segments)
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
        config.net.max_connections_per_shard as u64,
    )
}

/// A running node.
pub struct Node {
    shared: Arc<NodeShared>,
    runtime: Option<Runtime<NodeShard>>,
    handle: RuntimeHandle,
    injectors: Vec<Injector<Msg>>,
    sync_handles: Vec<std::thread::JoinHandle<()>>,
    tcp_addr: Option<SocketAddr>,
    ws_addr: Option<SocketAddr>,
    http: Option<crate::http::HttpServer>,
    /// The webhooks' runtime when the node has no HTTP API (whose runtime they use
    /// otherwise).
    webhook_runtime: Option<tokio::runtime::Runtime>,
}

/// `n` atomic counters at 0.
fn zeroes(n: usize) -> Vec<AtomicU64> {
    (0..n).map(|_| AtomicU64::new(0)).collect()
}

/// Binds `addr` once per shard with SO_REUSEPORT (the kernel spreads connections over
/// the shards); port 0 is resolved by the first bind.
fn bind_per_shard(
    addr: SocketAddr,
    shards: usize,
    backlog: i32,
) -> io::Result<(SocketAddr, Vec<TcpListener>)> {
    let first = bind_reuseport(addr, backlog)?;
    let actual = first.local_addr()?;
    let mut all = vec![first];
    for _ in 1..shards {
        all.push(bind_reuseport(actual, backlog)?);
    }
    Ok((actual, all))
}

/// The message id generator of shard `shard`: distinct node and shard bits
/// (`store::idgen` documents the layout).
pub fn id_generator(config: &NodeConfig, shard: usize) -> io::Result<MessageIdGen> {
    MessageIdGen::new(
        config.node_id,
        shard,
        usize::from(config.runtime.shard_count),
    )
    .ok_or_else(|| {
        io::Error::other(format!(
            "message ids need node_id < {} and at most {} shards",
            domain::send::idgen::MAX_NODE_IDS,
            domain::send::idgen::MAX_SHARDS
        ))
    })
}

/// Checks the configuration's sections and that the delivery limits fit the rings.
/// Refuses (`InvalidInput`) the first that does not hold.
fn validate_node_config(config: &NodeConfig) -> io::Result<()> {
    config
        .session
        .validate()
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
        .check_room(&config.runtime)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
}

/// Most bytes a route takes in a TouchRoutes body besides its uid and device id:
/// its integers as the longest varints, its flags and both strings' lengths
/// (pinned by a test against the encoder).
pub const ROUTE_WIRE_FIXED_BYTES_MAX: usize = 96;

/// The most bytes a TouchRoutes body of `touch_batch_max_routes` routes takes:
/// every route with the longest uid and device id, plus the target.
pub fn touch_batch_bytes_max(session: &SessionConfig) -> usize {
    let route = ROUTE_WIRE_FIXED_BYTES_MAX + session.uid_bytes_max + session.device_id_bytes_max;
    session.touch_batch_max_routes.saturating_mul(route) + ROUTE_WIRE_FIXED_BYTES_MAX
}

/// The frame limits against each other: an inter-node link's input buffer holds a
/// whole frame of `[rpc] rpc_frame_bytes_max` and one read, or a large frame would
/// stall its link for good; and the largest touch batch fits in a frame, or the
/// batch would be refused and requeued for ever.
fn check_frame_limits(config: &NodeConfig) -> Result<(), String> {
    let (frame, net) = (config.rpc.rpc_frame_bytes_max, &config.net);
    let touch = touch_batch_bytes_max(&config.session);
    if touch > frame {
        return Err(format!(
            "[session] touch_batch_max_routes = {} routes of at most {} bytes (uid_bytes_max \
             {} + device_id_bytes_max {} + {ROUTE_WIRE_FIXED_BYTES_MAX}) need [rpc] \
             rpc_frame_bytes_max >= {touch}, not {frame}",
            config.session.touch_batch_max_routes,
            touch / config.session.touch_batch_max_routes.max(1),
            config.session.uid_bytes_max,
            config.session.device_id_bytes_max,
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

/// The descriptor budget: raises the soft limit to the hard one (a warning when it
/// cannot), keeps the reserve, and checks that every shard's configured connection
/// cap fits in its share of the rest; refuses the start (`InvalidInput`, one line
/// with the numbers) when it does not. Gives the error of reading the limit.
fn apply_fd_budget(config: &mut NodeConfig) -> io::Result<net::io::fd::FdBudget> {
    let fd_limit = match net::io::fd::raise_nofile_limit() {
        Ok((_, soft)) => soft,
        Err(err) => {
            tracing::warn!(%err, "could not raise RLIMIT_NOFILE");
            net::io::fd::nofile_limit()?.0
        }
    };
    let budget = fd_budget(config, fd_limit);
    if budget.over_committed() && config.connection_cap_set {
        // Refused at start rather than failing later under load (issue 15).
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "[net] max_connections_per_shard = {} on {} shards needs {} descriptors \
                 ({} reserved), but RLIMIT_NOFILE allows {}: raise the limit (LimitNOFILE= \
                 in the service unit) or lower max_connections_per_shard (at most {} here)",
                budget.configured_cap,
                budget.shards,
                budget.configured_cap * budget.shards + budget.reserve,
                budget.reserve,
                budget.limit,
                budget.per_shard_cap
            ),
        ));
    }
    budget.log();
    config.net.max_connections_per_shard = budget.per_shard_cap as usize;
    // The descriptor table sized for the whole budget now, not grown (with a stall of
    // every shard) while connections arrive: see `reserve_fd_table`.
    let want = budget.per_shard_cap * budget.shards + budget.reserve;
    match net::io::fd::reserve_fd_table(want) {
        Ok(size) => tracing::debug!(want, ?size, "descriptor table reserved"),
        Err(err) => tracing::warn!(%err, want, "could not reserve the descriptor table"),
    }
    Ok(budget)
}

/// The cluster this node's data dir belongs to: `[[cluster.nodes]]` (ids and RPC
/// addresses, config order) and `[cluster] slot_ids`; none for a node alone (no
/// peers), whose homes are all itself.
fn cluster_layout(config: &NodeConfig) -> crate::store::layout::ClusterLayout {
    let cluster = &config.cluster;
    if cluster.peers(config.node_id).next().is_none() {
        return crate::store::layout::ClusterLayout::alone();
    }
    crate::store::layout::ClusterLayout {
        slot_ids: cluster.slot_ids,
        nodes: cluster
            .nodes
            .iter()
            .map(|n| crate::store::layout::RecordedNode {
                id: n.id,
                rpc_addr: n.rpc_addr,
            })
            .collect(),
    }
}

/// Creates the data directory (private), checks its recorded layout (shard and slot
/// counts, the cluster's nodes: [`cluster_layout`]) and opens the metadata store. Gives the error of each, with its path.
fn open_data_dir(config: &NodeConfig) -> io::Result<Catalog> {
    crate::store::create_private_dir_all(&config.data_dir)
        .map_err(|e| io::Error::other(format!("data dir {}: {e}", config.data_dir.display())))?;
    crate::store::layout::check_or_record(
        &config.data_dir,
        config.runtime.shard_count,
        ::slots::HASH_SLOTS as u16,
        &cluster_layout(config),
    )
    .map_err(io::Error::other)?;
    let meta_dir = config.data_dir.join("meta");
    let (catalog, recovery) = Catalog::open(&meta_dir, config.meta)
        .map_err(|e| io::Error::other(format!("metadata store {}: {e}", meta_dir.display())))?;
    tracing::info!(?recovery, "metadata store opened");
    Ok(catalog)
}

/// `configured` (the view of the config) joined with the view this node saved in
/// its data dir ([`crate::store::view`]): slot moves made before a restart hold.
/// A saved view of another cluster cannot be (the layout record refuses another
/// node list or slot id count first); one that does not fit anyway is refused.
fn with_saved_view(config: &NodeConfig, configured: ClusterView) -> io::Result<ClusterView> {
    let Some(saved) = crate::store::view::load(&config.data_dir)? else {
        return Ok(configured);
    };
    let slot_ids = if configured.nodes.len() > 1 {
        config.cluster.slot_ids
    } else {
        crate::cluster::MAX_SLOT_IDS
    };
    saved.check(&configured.nodes, slot_ids).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{}: {e}",
                config
                    .data_dir
                    .join(crate::store::view::VIEW_FILE)
                    .display()
            ),
        )
    })?;
    let view = configured.merge(&saved).unwrap_or(configured);
    tracing::info!(revision = view.revision, "saved cluster view loaded");
    Ok(view)
}

/// The client listeners of a node: one TCP and one WebSocket listener per shard (each
/// optional) and the addresses they are bound to.
struct BoundListeners {
    /// `listeners[shard]`: that shard's listeners and their transports.
    listeners: Vec<Vec<net::io::Listener>>,
    tcp_addr: Option<SocketAddr>,
    ws_addr: Option<SocketAddr>,
    rpc_addr: Option<SocketAddr>,
}

/// Binds the configured TCP and WebSocket addresses, and the RPC address when the
/// cluster has peers, once per shard
/// ([`bind_per_shard`]). Gives the error of a bind.
fn bind_listeners(config: &mut NodeConfig) -> io::Result<BoundListeners> {
    let shards = config.runtime.shard_count as usize;
    let mut listeners: Vec<Vec<net::io::Listener>> = (0..shards).map(|_| Vec::new()).collect();
    let mut tcp_addr = None;
    let mut ws_addr = None;
    let mut rpc_addr = None;
    let has_peers = config.cluster.peers(config.node_id).next().is_some();
    for (addr, kind, out) in [
        (config.tcp_addr, Transport::Tcp, &mut tcp_addr),
        (config.ws_addr, Transport::WebSocket, &mut ws_addr),
        (
            config.rpc_addr.filter(|_| has_peers),
            Transport::Rpc,
            &mut rpc_addr,
        ),
    ] {
        if let Some(addr) = addr {
            let (actual, ls) = bind_per_shard(addr, shards, config.net.listen_backlog)?;
            *out = Some(actual);
            for (i, l) in ls.into_iter().enumerate() {
                listeners[i].push((kind, l).into());
            }
        }
    }
    if let (Some(addr), Some(tls)) = (config.wss_addr, &config.tls) {
        let (actual, ls) = bind_per_shard(addr, shards, config.net.listen_backlog)?;
        config.wss_addr = Some(actual);
        for (i, l) in ls.into_iter().enumerate() {
            listeners[i].push(net::io::Listener::wss(l, tls.clone()));
        }
    }
    Ok(BoundListeners {
        listeners,
        tcp_addr,
        ws_addr,
        rpc_addr,
    })
}

/// Opens (recovers) each shard's message log, with the test hooks' sync hook; gives
/// each log with the largest message id it holds. Gives the error of a log, with its
/// directory.
fn open_logs(config: &NodeConfig, hooks: &syncer::NodeHooks) -> io::Result<Vec<(MessageLog, i64)>> {
    let shards = config.runtime.shard_count as usize;
    let mut logs = Vec::with_capacity(shards);
    for i in 0..shards {
        let dir = log_dir(&config.data_dir, i);
        let (mut log, report) = MessageLog::open(&dir, config.log.clone())
            .map_err(|e| io::Error::other(format!("log {}: {e}", dir.display())))?;
        if let Some(h) = &hooks.log_sync {
            log.set_sync_hook(h.clone());
        }
        tracing::info!(shard = i, records = report.records, "message log opened");
        logs.push((log, report.max_message_id));
    }
    Ok(logs)
}

/// The webhooks' sink; with `msg.notify`, following the just opened `logs` from
/// its saved cursor (a first start: from where they end now, saved before any
/// SEND).
fn webhook_sink(
    config: &NodeConfig,
    logs: &[(MessageLog, i64)],
) -> io::Result<crate::webhook::WebhookSink> {
    let ends: Vec<_> = logs.iter().map(|(log, _)| log.end_position()).collect();
    crate::webhook::WebhookSink::new(&config.webhook).with_logs(&config.data_dir, &ends)
}

/// What each shard takes when it starts: its listeners, its log (with the largest
/// message id in it) and its log syncer; `None` once taken.
type ShardStartParts =
    std::sync::Mutex<Vec<Option<(Vec<net::io::Listener>, (MessageLog, i64), syncer::LogSyncer)>>>;

/// Builds shard `init.shard` on its own thread: takes its parts, makes its network
/// driver, resumes its message ids after its log, rebuilds its idempotency window
/// from the log, and makes its [`NodeShard`]. Gives the error of each (a shard
/// started twice included).
fn start_shard(
    s: &Arc<NodeShared>,
    init: &ShardInit,
    parts: &ShardStartParts,
) -> io::Result<(NodeShard, NetDriver)> {
    let me = init.shard as usize;
    let (listeners, (log, max_message_id), syncer) =
        parts.lock().unwrap_or_else(|e| e.into_inner())[me]
            .take()
            .ok_or_else(|| io::Error::other("shard started twice"))?;
    let driver = NetDriver::with_listeners(&s.config.net, init.doorbell.clone(), listeners)?;
    let mut ids = id_generator(&s.config, me)?;
    ids.resume_after(max_message_id);
    let mut idem = IdempotencyWindow::new(s.config.idempotency);
    if let Some(w) = idem.as_mut() {
        // A resend after a restart gets the first answer (flow 7, `docs/flows.md`).
        let entries = crate::store::refill_idempotency(w, &log, s.wall_ms() / 1000)
            .map_err(|e| io::Error::other(format!("idempotency window of shard {me}: {e}")))?;
        tracing::info!(
            shard = me,
            entries,
            "idempotency window rebuilt from the log"
        );
    }
    let limits = s.config.delivery.commit_limits(&s.config.log);
    let core = send::commit::CommitCore::new(log, ids, idem, limits);
    let commit = send::CommitSide::new(core, syncer);
    let shard = NodeShard::new(init.shard as ShardId, s.clone(), commit)?;
    Ok((shard, driver))
}

/// Waits until every shard runs its loop, so the node serves only then (readiness; a
/// shard whose factory failed never starts, so the wait is bounded). Refuses after 10
/// s: stops the runtime and gives the shards' errors.
fn wait_for_shards(
    shared: &NodeShared,
    runtime: Runtime<NodeShard>,
    handle: &RuntimeHandle,
) -> io::Result<Runtime<NodeShard>> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !shared.all_shards_started() {
        if std::time::Instant::now() > deadline {
            handle.stop();
            let errors: Vec<String> = runtime
                .join()
                .into_iter()
                .filter_map(|r| r.err().map(|e| e.to_string()))
                .collect();
            return Err(io::Error::other(format!(
                "shards did not start: {}",
                errors.join("; ")
            )));
        }
        std::thread::yield_now();
    }
    Ok(runtime)
}

/// Starts each shard's log syncer thread; it ends when its shard drops the sending
/// side. A thread that cannot start is a warning: that shard syncs on its own thread
/// (slower).
fn spawn_syncers(
    sync_threads: Vec<syncer::SyncThread>,
    injectors: &[Injector<Msg>],
) -> Vec<std::thread::JoinHandle<()>> {
    let mut sync_handles = Vec::with_capacity(sync_threads.len());
    for (i, thread) in sync_threads.into_iter().enumerate() {
        match thread.spawn(i, injectors[i].clone()) {
            Ok(h) => sync_handles.push(h),
            Err(err) => {
                tracing::warn!(%err, shard = i, "no log syncer thread");
            }
        }
    }
    sync_handles
}

/// Logs the listeners that are up (TCP, WebSocket, inter-node).
fn log_listeners(tcp: Option<SocketAddr>, ws: Option<SocketAddr>, rpc: Option<SocketAddr>) {
    if let Some(a) = tcp {
        tracing::info!(%a, "TCP listener up");
    }
    if let Some(a) = ws {
        tracing::info!(%a, "WebSocket listener up");
    }
    if let Some(a) = rpc {
        tracing::info!(%a, "inter-node listener up");
    }
}

/// Starts the HTTP API server when `api.addr` is configured. Gives the error of its
/// bind.
fn start_http(
    shared: &Arc<NodeShared>,
    injectors: &[Injector<Msg>],
) -> io::Result<Option<crate::http::HttpServer>> {
    let Some(addr) = shared.config.api.addr else {
        return Ok(None);
    };
    let api = crate::http::Api::new(
        shared.config.api.clone(),
        shared.clone(),
        injectors.to_vec(),
        true,
    );
    Ok(Some(crate::http::HttpServer::start(api, addr)?))
}

/// The HTTP API (with `[listen] api_addr`) and the webhooks' driver, on its
/// runtime or one of their own.
#[allow(clippy::type_complexity)]
fn start_api_and_webhooks(
    shared: &Arc<NodeShared>,
    injectors: &[Injector<Msg>],
) -> io::Result<(
    Option<crate::http::HttpServer>,
    Option<tokio::runtime::Runtime>,
)> {
    let http = start_http(shared, injectors)?;
    let webhooks = start_webhooks(shared, http.as_ref())?;
    Ok((http, webhooks))
}

/// Starts the webhooks' driver (with `[webhook] url`): on the HTTP API's runtime,
/// or on a one-thread runtime of its own (returned) when the node has no API.
fn start_webhooks(
    shared: &Arc<NodeShared>,
    http: Option<&crate::http::HttpServer>,
) -> io::Result<Option<tokio::runtime::Runtime>> {
    if !shared.config.webhook.enabled() {
        return Ok(None);
    }
    let (node_id, boot) = (shared.config.node_id, shared.boot_id);
    if let Some(http) = http {
        crate::webhook::start(&shared.webhooks, node_id, boot, &http.runtime_handle());
        return Ok(None);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("imrouter-webhook")
        .enable_all()
        .build()?;
    crate::webhook::start(&shared.webhooks, node_id, boot, runtime.handle());
    Ok(Some(runtime))
}

impl Node {
    /// Starts a node: opens the logs, binds the listeners, starts the shards.
    pub fn start(config: NodeConfig) -> io::Result<Node> {
        Node::start_with(config, syncer::NodeHooks::default())
    }

    /// [`Node::start`] with test hooks. Refuses (`InvalidInput`) an invalid
    /// configuration; gives the error of a data directory, metadata store, log,
    /// listener, shard or HTTP server that cannot be opened or started.
    pub fn start_with(mut config: NodeConfig, hooks: syncer::NodeHooks) -> io::Result<Node> {
        validate_node_config(&config)?;
        let initial_view = config
            .cluster
            .initial_view(config.node_id)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let shards = config.runtime.shard_count as usize;
        config.net.rpc_links_per_shard_max = rpc_links_per_shard_max(&config);
        let fd_budget = apply_fd_budget(&mut config)?;
        let boot_id: BootId = rand::random();
        let slot_map = SlotMap::modulo(config.runtime.shard_count).map_err(io::Error::other)?;
        let directory =
            Directory::new(&config.authority).map_err(|e| io::Error::other(format!("{e:?}")))?;
        let catalog = open_data_dir(&config)?;
        let initial_view = with_saved_view(&config, initial_view)?;
        let shard_metrics = (0..shards)
            .map(|_| Arc::new(ShardMetrics::default()))
            .collect();
        let bound = bind_listeners(&mut config)?;
        let logs = open_logs(&config, &hooks)?;
        let webhooks = webhook_sink(&config, &logs)?;

        let shared = Arc::new(NodeShared {
            boot_id,
            slot_map,
            directory,
            catalog,
            view: std::sync::Mutex::new(Arc::new(initial_view.clone())),
            initial_view,
            shard_metrics,
            stages: (0..shards)
                .map(|_| Arc::new(metrics::StageHistograms::default()))
                .collect(),
            epoch: std::time::Instant::now(),
            routes_per_slot: zeroes(::slots::HASH_SLOTS),
            ring_occupancy: zeroes(shards * shards),
            started_shards: AtomicUsize::new(0),
            runtime: std::sync::OnceLock::new(),
            api_metrics: Default::default(),
            fd_budget,
            peer_links_up: zeroes(shards),
            peer_boot_ids: zeroes(config.cluster.peers(config.node_id).count()),
            client_tcp_addr: bound.tcp_addr,
            client_ws_addr: bound.ws_addr,
            draining: std::sync::atomic::AtomicBool::new(false),
            view_heard: std::sync::atomic::AtomicBool::new(false),
            webhooks: Arc::new(webhooks),
            config,
        });
        let (syncers, sync_threads): (Vec<_>, Vec<_>) = (0..shards).map(|_| syncer::pair()).unzip();
        let parts: Vec<_> = bound
            .listeners
            .into_iter()
            .zip(logs)
            .zip(syncers)
            .map(|((l, log), syncer)| Some((l, log, syncer)))
            .collect();
        let parts = Arc::new(std::sync::Mutex::new(parts));
        let s = shared.clone();
        let runtime = Runtime::start(shared.config.runtime.clone(), move |init: &ShardInit| {
            start_shard(&s, init, &parts)
        })?;
        let handle = runtime.handle();
        let _ = shared.runtime.set(handle.clone());
        let runtime = wait_for_shards(&shared, runtime, &handle)?;
        let injectors: Vec<Injector<Msg>> = (0..shards)
            .map(|i| runtime.injector(i as ShardId))
            .collect();
        let sync_handles = spawn_syncers(sync_threads, &injectors);
        log_listeners(bound.tcp_addr, bound.ws_addr, bound.rpc_addr);
        let (http, webhook_runtime) = start_api_and_webhooks(&shared, &injectors)?;
        Ok(Node {
            http,
            webhook_runtime,
            shared,
            runtime: Some(runtime),
            handle,
            injectors,
            sync_handles,
            tcp_addr: bound.tcp_addr,
            ws_addr: bound.ws_addr,
        })
    }

    /// The bound TCP address (port 0 resolved).
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp_addr
    }

    /// The bound WebSocket address (port 0 resolved).
    pub fn ws_addr(&self) -> Option<SocketAddr> {
        self.ws_addr
    }

    /// The bound `wss://` address (port 0 resolved).
    pub fn wss_addr(&self) -> Option<SocketAddr> {
        self.shared.config.wss_addr
    }

    /// The bound HTTP API address (port 0 resolved).
    pub fn api_addr(&self) -> Option<SocketAddr> {
        self.http.as_ref().map(|h| h.addr())
    }

    /// An API handle answering requests without HTTP (tests, embedding).
    pub fn api(&self) -> crate::http::Api {
        crate::http::Api::new(
            self.shared.config.api.clone(),
            self.shared.clone(),
            self.injectors.clone(),
            true,
        )
    }

    /// What the shards share (the HTTP API reads it).
    pub fn shared(&self) -> &Arc<NodeShared> {
        &self.shared
    }

    /// Waits up to `timeout` for a shard to end on its own (a panic, a driver error);
    /// returns the cause if one has. A node with a shard missing must stop: the
    /// binary exits non-zero so the service manager restarts it.
    pub fn wait_failure(&self, timeout: std::time::Duration) -> Option<String> {
        self.handle.wait_failure(timeout)
    }

    /// Makes shard `shard` panic (fault injection for tests of the failure path).
    #[doc(hidden)]
    pub fn inject_shard_panic(&self, shard: ShardId) {
        let _ = self.injectors[shard as usize].send(Msg::InjectPanic);
    }

    /// The injector of each shard, in shard order.
    pub fn injectors(&self) -> &[Injector<Msg>] {
        &self.injectors
    }

    /// Disconnects every session (DISCONNECT, then close), unregisters them, flushes
    /// the logs and stops the shards.
    pub fn shutdown(mut self) -> io::Result<()> {
        self.stop()
    }

    fn stop(&mut self) -> io::Result<()> {
        let Some(runtime) = self.runtime.take() else {
            return Ok(());
        };
        self.handle.stop();
        if let Some(rt) = self.webhook_runtime.take() {
            rt.shutdown_background();
        }
        // Dropping the shards closes their syncers' job queues: the threads end.
        let results: Vec<io::Result<()>> =
            runtime.join().into_iter().map(|r| r.map(drop)).collect();
        // Bounded: a syncer stuck in a sync on a failing disk is left behind (logged)
        // rather than hanging the stop.
        let deadline = std::time::Instant::now() + SYNCER_STOP_WAIT;
        while self.sync_handles.iter().any(|h| !h.is_finished())
            && std::time::Instant::now() < deadline
        {
            std::thread::yield_now();
        }
        for h in self.sync_handles.drain(..) {
            if h.is_finished() {
                let _ = h.join();
            } else {
                tracing::warn!("a log syncer thread is still in a sync; not waiting for it");
            }
        }
        results.into_iter().collect()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}
