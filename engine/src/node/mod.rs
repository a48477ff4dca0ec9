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

mod api_hop;
mod authority_service;
mod authority_side;
pub mod catalog;
pub mod config;
mod conn;
mod connect;
mod conns;
mod control;
mod dispatch;
mod hops;
pub mod metrics;
pub mod msg;
mod peers;
pub mod raft;
mod raft_hop;
pub mod send;
pub mod shard;
pub mod shared;
pub mod syncer;
pub mod wire;

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;

use ::shard::runtime::{Injector, Runtime, RuntimeHandle, ShardInit};
use ::slots::{ShardId, SlotMap};
use net::io::{bind_reuseport, NetDriver, Transport};

use crate::authority::Directory;
use crate::cluster::ClusterView;
use crate::route::BootId;
use crate::store::{log_dir, IdempotencyWindow, MessageIdGen, MessageLog};

pub use self::config::*;
pub use self::shared::{MoveRefused, NodeShared};

use self::catalog::Catalog;
use self::metrics::ShardMetrics;
use self::msg::Msg;
use self::shard::NodeShard;

/// How long a stop waits for the log syncer threads to end.
const SYNCER_STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

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
                "[net] connections_per_shard_max = {} on {} shards needs {} descriptors \
                 ({} reserved), but RLIMIT_NOFILE allows {}: raise the limit (LimitNOFILE= \
                 in the service unit) or lower connections_per_shard_max (at most {} here)",
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
    config.net.connections_per_shard_max = budget.per_shard_cap as usize;
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
        replicas: cluster.replicas,
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

/// The hash slots' placement on this node's shards: by slot id where the slot ids
/// are replicated (a slot id's channels on its replica's shard, layout version
/// 3), else `hash_slot % shard_count` (`store::layout`).
fn slot_map(config: &NodeConfig) -> Result<SlotMap, ::slots::SlotMapError> {
    let shards = config.runtime.shard_count;
    if cluster_layout(config).placement() == crate::store::layout::PLACEMENT_BY_SLOT_ID {
        SlotMap::by_slot_id(shards, config.cluster.slot_ids)
    } else {
        SlotMap::modulo(shards)
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
    let limits = s.config.commit.commit_limits(&s.config.log);
    let core = send::CommitCore::new(log, ids, idem, limits);
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

/// What [`start_shards`] started: the runtime, its handle, one injector per shard
/// and the log syncers' threads.
type StartedShards = (
    Runtime<NodeShard>,
    RuntimeHandle,
    Vec<Injector<Msg>>,
    Vec<std::thread::JoinHandle<()>>,
);

/// Starts the shards (each with its listeners, its log and its syncer's end),
/// waits until every one runs, then the log syncers' threads. Gives the error of a
/// shard that could not start.
fn start_shards(
    shared: &Arc<NodeShared>,
    listeners: Vec<Vec<net::io::Listener>>,
    logs: Vec<(MessageLog, i64)>,
) -> io::Result<StartedShards> {
    let shards = listeners.len();
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
        start_shard(&s, init, &parts)
    })?;
    let handle = runtime.handle();
    let _ = shared.runtime.set(handle.clone());
    let runtime = wait_for_shards(shared, runtime, &handle)?;
    let injectors: Vec<Injector<Msg>> = (0..shards)
        .map(|i| runtime.injector(i as ShardId))
        .collect();
    let sync_handles = spawn_syncers(sync_threads, &injectors);
    Ok((runtime, handle, injectors, sync_handles))
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
    let server = crate::http::HttpServer::start(api.clone(), addr)?;
    // Other nodes' API requests (the hop `Api`) are served on the same runtime.
    let (inbox, calls) = tokio::sync::mpsc::channel(shared.config.api.waiting_requests_max);
    server.runtime_handle().spawn(api.serve_peer_calls(calls));
    let _ = shared.api_inbox.set(inbox);
    Ok(Some(server))
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
        let slot_map = slot_map(&config).map_err(io::Error::other)?;
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
            raft_status: raft::RaftStatus::new(config.cluster.slot_ids),
            peer_boot_ids: zeroes(config.cluster.peers(config.node_id).count()),
            peer_draining: (config.cluster.peers(config.node_id))
                .map(|_| std::sync::atomic::AtomicBool::new(false))
                .collect(),
            client_tcp_addr: bound.tcp_addr,
            client_ws_addr: bound.ws_addr,
            draining: std::sync::atomic::AtomicBool::new(false),
            view_heard: std::sync::atomic::AtomicBool::new(false),
            webhooks: Arc::new(webhooks),
            api_inbox: std::sync::OnceLock::new(),
            config,
        });
        let (tcp_addr, ws_addr, rpc_addr) = (bound.tcp_addr, bound.ws_addr, bound.rpc_addr);
        let started = start_shards(&shared, bound.listeners, logs)?;
        let (runtime, handle, injectors, sync_handles) = started;
        log_listeners(tcp_addr, ws_addr, rpc_addr);
        let (http, webhook_runtime) = start_api_and_webhooks(&shared, &injectors)?;
        Ok(Node {
            http,
            webhook_runtime,
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
