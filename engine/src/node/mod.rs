//! A running imrouter node: the shard runtime with one [`shard::NodeShard`] per core,
//! its listeners, its logs and the shared lock-free tables.
//!
//! - [`shard`]: one shard: connections, activation, the authority service, touches.
//! - [`send`]: the SEND → commit → SENDACK → delivery → RECV → RECVACK flow.
//! - [`msg`]: every message between shards.
//! - [`meta`]: tokens and group subscribers, read lock-free by the shards.
//! - [`metrics`]: per-shard counters.

pub mod meta;
pub mod metrics;
pub mod msg;
pub mod send;
pub mod shard;
pub mod syncer;

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use ::shard::runtime::{Injector, Runtime, RuntimeConfig, RuntimeHandle, ShardInit};
use ::shard::slots::{ShardId, SlotMap};
use net::io::{bind_reuseport, ListenerKind, NetConfig, NetDriver};

use crate::activation::ActivationConfig;
use crate::authority::{AuthorityConfig, AuthorityReader, Directory};
use crate::cluster::{ClusterView, NodeId};
use crate::route::{BootId, DeviceLevel};
use crate::store::{
    log_dir, IdempotencyConfig, IdempotencyWindow, LogConfig, MessageIdGen, MessageLog, MetaConfig,
};

use self::meta::Meta;
use self::metrics::ShardMetrics;
use self::msg::Msg;
use self::shard::NodeShard;

/// Sessions, touches and acknowledgements: limits and intervals.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SessionConfig {
    pub max_sessions_per_shard: u32,
    /// How often the touch worker flushes dirty routes (and drains unregisters).
    pub touch_flush_interval_ms: u64,
    /// Most routes one touch flush sends.
    pub touch_batch_max_routes: usize,
    /// Most authority unregisters one flush sends.
    pub unregister_batch_max: usize,
    /// How often the authority's expiry pass runs.
    pub expiry_interval_ms: u64,
    /// Unacknowledged RECVs kept per session; past it a RECV is sent untracked.
    pub pending_acks_per_session_max: usize,
    /// A RECV without RECVACK after this long is re-sent with DUP.
    pub ack_timeout_ms: u64,
    /// Re-sends of one RECV before it is dropped (the client recovers it by sync).
    pub ack_resends_max: u8,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            max_sessions_per_shard: 1 << 20,
            touch_flush_interval_ms: 1_000,
            touch_batch_max_routes: 512,
            unregister_batch_max: 512,
            expiry_interval_ms: 1_000,
            pending_acks_per_session_max: 1_024,
            ack_timeout_ms: 10_000,
            ack_resends_max: 3,
        }
    }
}

/// `Err("section.name must be at least 1")` for each limit that is 0.
fn at_least_one(section: &str, limits: &[(&str, u64)]) -> Result<(), String> {
    match limits.iter().find(|(_, v)| *v == 0) {
        Some((name, _)) => Err(format!("{section}.{name} must be at least 1 (is 0)")),
        None => Ok(()),
    }
}

impl SessionConfig {
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
                ("unregister_batch_max", self.unregister_batch_max as u64),
                ("expiry_interval_ms", self.expiry_interval_ms),
                (
                    "pending_acks_per_session_max",
                    self.pending_acks_per_session_max as u64,
                ),
                ("ack_timeout_ms", self.ack_timeout_ms),
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
}

impl Default for DeliveryConfig {
    fn default() -> Self {
        DeliveryConfig {
            subscriber_page_max: 1_024,
            push_batch_max: 256,
            commits_unsynced_max: 65_536,
        }
    }
}

impl DeliveryConfig {
    /// Refuses limits the node cannot run with, naming them.
    pub fn validate(&self) -> Result<(), String> {
        at_least_one(
            "delivery",
            &[
                ("subscriber_page_max", self.subscriber_page_max as u64),
                ("push_batch_max", self.push_batch_max as u64),
                ("commits_unsynced_max", self.commits_unsynced_max as u64),
            ],
        )
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
    /// CONNECT must carry the token stored with `/user/token`.
    pub token_auth: bool,
    /// The level of sessions without a token record when `token_auth` is off.
    pub default_device_level: DeviceLevel,
    pub runtime: RuntimeConfig,
    pub net: NetConfig,
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
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            node_id: 1,
            data_dir: PathBuf::from("./data"),
            tcp_addr: Some(SocketAddr::from(([127, 0, 0, 1], 5100))),
            ws_addr: Some(SocketAddr::from(([127, 0, 0, 1], 5200))),
            token_auth: true,
            default_device_level: DeviceLevel::Master,
            runtime: RuntimeConfig {
                thread_name: "imrouter".into(),
                ..RuntimeConfig::default()
            },
            net: NetConfig::default(),
            authority: AuthorityConfig::default(),
            activation: ActivationConfig::default(),
            registry: crate::registry::RegistryLimits::default(),
            session: SessionConfig::default(),
            delivery: DeliveryConfig::default(),
            log: LogConfig::default(),
            idempotency: IdempotencyConfig::default(),
            meta: MetaConfig::default(),
            api: crate::http::ApiConfig::default(),
        }
    }
}

/// What every shard (and the HTTP API) shares.
pub struct NodeShared {
    pub config: NodeConfig,
    pub boot_id: BootId,
    pub slot_map: SlotMap,
    pub directory: Arc<Directory>,
    pub meta: Meta,
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

    fn shard_started(&self) {
        self.started_shards.fetch_add(1, Ordering::SeqCst);
    }

    /// Whether every shard has started its loop.
    pub fn all_shards_started(&self) -> bool {
        self.started_shards.load(Ordering::SeqCst) == self.slot_map.shard_count() as usize
    }

    /// Why the node should not get traffic now (`/readyz` answers 503 with it), or
    /// `None` when it is ready. Every condition that makes the node unfit to serve
    /// is checked here, in one place.
    pub fn not_ready(&self) -> Option<String> {
        if !self.all_shards_started() {
            return Some("shards are starting".into());
        }
        None
    }

    /// The newest cluster view.
    pub fn view(&self) -> Arc<ClusterView> {
        self.view.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Moves the leadership of `hash_slots` to `leader_node_id` (a failover drill):
    /// each moved slot's term advances, and so does the routing revision. Returns the
    /// new view, which the caller sends to every shard.
    pub fn move_leaders(&self, hash_slots: &[u16], leader_node_id: NodeId) -> Arc<ClusterView> {
        let mut guard = self.view.lock().unwrap_or_else(|e| e.into_inner());
        let mut view = (**guard).clone();
        for &s in hash_slots {
            let slot = &mut view.slots[s as usize];
            slot.leader_node_id = leader_node_id;
            slot.leader_term += 1;
        }
        view.revision += 1;
        *guard = Arc::new(view);
        guard.clone()
    }

    /// A lock-free reader of every hash slot's routes.
    pub fn authority_reader(&self) -> AuthorityReader {
        AuthorityReader::new(&self.directory)
    }
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

impl Node {
    /// Starts a node: opens the logs, binds the listeners, starts the shards.
    pub fn start(config: NodeConfig) -> io::Result<Node> {
        config
            .session
            .validate()
            .and_then(|()| config.delivery.validate())
            .and_then(|()| config.registry.validate())
            .map_err(|e| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("invalid configuration: {e}"),
                )
            })?;
        let shards = config.runtime.shard_count as usize;
        let boot_id: BootId = rand::random();
        let slot_map = SlotMap::modulo(config.runtime.shard_count).map_err(io::Error::other)?;
        let directory =
            Directory::new(&config.authority).map_err(|e| io::Error::other(format!("{e:?}")))?;
        let meta_dir = config.data_dir.join("meta");
        let (meta, recovery) = Meta::open(&meta_dir, config.meta)
            .map_err(|e| io::Error::other(format!("metadata store {}: {e}", meta_dir.display())))?;
        tracing::info!(?recovery, "metadata store opened");
        let shard_metrics = (0..shards)
            .map(|_| Arc::new(ShardMetrics::default()))
            .collect();
        let initial_view = ClusterView::single_node(config.node_id);

        let mut listeners: Vec<Vec<(ListenerKind, TcpListener)>> =
            (0..shards).map(|_| Vec::new()).collect();
        let mut tcp_addr = None;
        let mut ws_addr = None;
        for (addr, kind, out) in [
            (config.tcp_addr, ListenerKind::Tcp, &mut tcp_addr),
            (config.ws_addr, ListenerKind::WebSocket, &mut ws_addr),
        ] {
            if let Some(addr) = addr {
                let (actual, ls) = bind_per_shard(addr, shards, config.net.listen_backlog)?;
                *out = Some(actual);
                for (i, l) in ls.into_iter().enumerate() {
                    listeners[i].push((kind, l));
                }
            }
        }
        let mut logs = Vec::with_capacity(shards);
        for i in 0..shards {
            let dir = log_dir(&config.data_dir, i);
            let (log, report) = MessageLog::open(&dir, config.log.clone())
                .map_err(|e| io::Error::other(format!("log {}: {e}", dir.display())))?;
            tracing::info!(shard = i, records = report.records, "message log opened");
            logs.push(log);
        }

        let shared = Arc::new(NodeShared {
            boot_id,
            slot_map,
            directory,
            meta,
            view: std::sync::Mutex::new(Arc::new(initial_view.clone())),
            initial_view,
            shard_metrics,
            stages: (0..shards)
                .map(|_| Arc::new(metrics::StageHistograms::default()))
                .collect(),
            epoch: std::time::Instant::now(),
            routes_per_slot: (0..::shard::slots::HASH_SLOTS)
                .map(|_| AtomicU64::new(0))
                .collect(),
            ring_occupancy: (0..shards * shards).map(|_| AtomicU64::new(0)).collect(),
            started_shards: AtomicUsize::new(0),
            config,
        });
        let (syncers, sync_threads): (Vec<_>, Vec<_>) = (0..shards).map(|_| syncer::pair()).unzip();
        let parts: Vec<_> = listeners
            .into_iter()
            .zip(logs)
            .zip(syncers)
            .map(|((l, log), syncer)| Some((l, log, syncer)))
            .collect();
        let parts = Arc::new(std::sync::Mutex::new(parts));
        let s = shared.clone();
        let runtime = Runtime::start(shared.config.runtime.clone(), move |init: &ShardInit| {
            let me = init.shard as usize;
            let (listeners, log, syncer) = parts.lock().unwrap_or_else(|e| e.into_inner())[me]
                .take()
                .ok_or_else(|| io::Error::other("shard started twice"))?;
            let driver = NetDriver::new(&s.config.net, init.doorbell.clone(), listeners)?;
            let ids = MessageIdGen::new(s.config.node_id)
                .ok_or_else(|| io::Error::other("node_id out of range for message ids"))?;
            let idem = IdempotencyWindow::new(s.config.idempotency);
            let delivery = send::DeliveryCore::new(log, ids, idem, syncer);
            let shard = NodeShard::new(init.shard as ShardId, s.clone(), delivery)?;
            Ok((shard, driver))
        })?;
        let handle = runtime.handle();
        // Serve only once every shard runs its loop (readiness; a shard whose factory
        // failed never starts, so the wait is bounded).
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
        let injectors: Vec<Injector<Msg>> = (0..shards)
            .map(|i| runtime.injector(i as ShardId))
            .collect();
        // Each shard's log syncer; it ends when its shard drops the sending side.
        let mut sync_handles = Vec::with_capacity(shards);
        for (i, thread) in sync_threads.into_iter().enumerate() {
            match thread.spawn(i, injectors[i].clone()) {
                Ok(h) => sync_handles.push(h),
                Err(err) => {
                    // Without the thread a shard syncs on its own thread (slower).
                    tracing::warn!(%err, shard = i, "no log syncer thread");
                }
            }
        }
        if let Some(a) = tcp_addr {
            tracing::info!(%a, "TCP listener up");
        }
        if let Some(a) = ws_addr {
            tracing::info!(%a, "WebSocket listener up");
        }
        let http = match shared.config.api.addr {
            Some(addr) => {
                let api = crate::http::Api::new(
                    shared.config.api.clone(),
                    shared.clone(),
                    injectors.clone(),
                    true,
                );
                Some(crate::http::HttpServer::start(api, addr)?)
            }
            None => None,
        };
        Ok(Node {
            http,
            shared,
            runtime: Some(runtime),
            handle,
            injectors,
            sync_handles,
            tcp_addr,
            ws_addr,
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
