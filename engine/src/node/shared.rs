//! What every shard and the HTTP API share: the node's configuration, the lock-free
//! tables (directory, catalog), the newest cluster view, the metrics, the links'
//! states, and the node's clocks.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use ::shard::runtime::RuntimeHandle;
use ::slots::SlotMap;

use crate::authority::{AuthorityReader, Directory};
use crate::cluster::{ClusterView, NodeId};
use crate::route::BootId;

use super::catalog::Catalog;
use super::config::NodeConfig;
use super::metrics::{self, ShardMetrics};

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
    pub(super) view: std::sync::Mutex<Arc<ClusterView>>,
    pub shard_metrics: Vec<Arc<ShardMetrics>>,
    /// Per shard: the stage latencies of the message path (`/metrics`).
    pub stages: Vec<Arc<metrics::StageHistograms>>,
    /// The origin of [`NodeShared::mono_ns`].
    pub(super) epoch: std::time::Instant,
    /// Active routes per hash slot, refreshed by each slot's shard every expiry pass.
    pub routes_per_slot: Vec<AtomicU64>,
    /// `[from * shards + to]`: messages queued from shard `from` to shard `to`,
    /// sampled every expiry pass.
    pub ring_occupancy: Vec<AtomicU64>,
    pub(super) started_shards: AtomicUsize,
    /// The runtime, once started: a shard that ended on its own is fatal.
    pub(super) runtime: std::sync::OnceLock<RuntimeHandle>,
    /// The HTTP API's own counters (`imrouter_api_*`).
    pub api_metrics: crate::http::metrics::ApiMetrics,
    /// The descriptor budget the connection caps came from (`imrouter_fd_limit` is
    /// its `limit`; `imrouter_open_fds` is [`NodeShared::open_fds`]).
    pub fd_budget: net::io::fd::FdBudget,
    /// Per shard: the peers (bit i = the i-th peer in config order) its outbound
    /// link to is up, published by the shard as links come and go.
    pub peer_links_up: Vec<AtomicU64>,
    /// Each slot id's raft leader and term as this node's replica sees them
    /// (`[cluster] replicas` above 1).
    pub raft_status: super::raft::RaftStatus,
    /// Per peer (config order, like `peer_links_up`'s bits): the boot id its link
    /// last reported, 0 before any ([`NodeShared::note_peer_boot`]).
    pub(super) peer_boot_ids: Vec<AtomicU64>,
    /// Per peer (config order): whether its last raft frame said it is draining
    /// (a restarted peer's frames say it is not).
    pub(super) peer_draining: Vec<std::sync::atomic::AtomicBool>,
    /// The client listeners' bound addresses (port 0 resolved): what `GET /route`
    /// answers for this node when its `[[cluster.nodes]]` entry names none.
    pub client_tcp_addr: Option<SocketAddr>,
    pub client_ws_addr: Option<SocketAddr>,
    /// Set by the first `POST /node/drain`, never cleared (a drained node is
    /// stopped next): `/readyz` is 503, `/route` no longer names this node.
    pub(super) draining: std::sync::atomic::AtomicBool,
    /// Set by the first view a peer sent (every link that comes up carries one): a
    /// node of a cluster serves its configured view, maybe long stale after a
    /// restart, until then, so `/readyz` waits for it.
    pub(super) view_heard: std::sync::atomic::AtomicBool,
    /// The webhooks' hand-off and counters (does nothing without `[webhook] url`).
    pub webhooks: Arc<crate::webhook::WebhookSink>,
    /// The HTTP API's queue of other nodes' requests (the hop `Api`), set once its
    /// server runs; bounded by `[api] waiting_requests_max`.
    pub(crate) api_inbox: std::sync::OnceLock<tokio::sync::mpsc::Sender<super::msg::PeerApiCall>>,
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

    /// Whether this node may answer for slot id `slot_id`'s authority now: always
    /// where slot ids are not replicated; else only while its group's leader here
    /// holds its lease (`RaftStatus::lease_holds`, on [`NodeShared::mono_ms`]: a
    /// leader cut off from its quorum stops before another can be elected).
    pub fn authority_leased(&self, slot_id: u32) -> bool {
        let c = &self.config.cluster;
        !super::raft::groups_run(c.replicas as usize, c.nodes.len())
            || self.raft_status.lease_holds(slot_id, self.mono_ms())
    }

    /// Milliseconds since the node started, comparable across shards: the clock of
    /// other nodes' request deadlines ([`msg::Remote`]), read where a request is
    /// read, served and answered (a shard's loop clock has its own start).
    pub fn mono_ms(&self) -> u64 {
        self.mono_ns() / 1_000_000
    }

    pub(super) fn shard_started(&self) {
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

    /// Records whether peer `node`'s last raft frame said it is draining.
    pub fn note_peer_draining(&self, node: NodeId, draining: bool) {
        let me = self.config.node_id;
        if let Some(i) = self.config.cluster.peers(me).position(|n| n.id == node) {
            self.peer_draining[i].store(draining, Ordering::Relaxed);
        }
    }

    /// Whether `node` is draining: this node since `POST /node/drain`, a peer as
    /// its last raft frame said. The replicated groups' leaders hand over to
    /// no draining node, and a draining leader hands over to another replica.
    pub fn is_node_draining(&self, node: NodeId) -> bool {
        let me = self.config.node_id;
        if node == me {
            return self.is_draining();
        }
        (self.config.cluster.peers(me).position(|n| n.id == node))
            .is_some_and(|i| self.peer_draining[i].load(Ordering::Relaxed))
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
        movable(&guard)?;
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
        movable(&guard)?;
        let next = guard.with_leaders(self.config.node_id, moves);
        self.save_moved(&mut guard, next)
    }

    /// Whether slots may be moved by hand: not when homes follow the groups'
    /// leaders ([`MoveRefused::Elected`]).
    pub fn check_movable(&self) -> Result<(), MoveRefused> {
        movable(&self.view())
    }

    /// Claims for this node the slot ids whose groups its replicas were just
    /// elected to lead (`(slot_id, raft term)`, `ClusterView::with_group_leader`):
    /// one view change for all of them, saved in the data dir first (a failed save
    /// is logged, the view installed anyway: the next election claims again).
    /// `None` when no claim is newer than the view.
    pub fn claim_group_leaders(&self, won: &[(u32, u64)]) -> Option<Arc<ClusterView>> {
        let mut guard = self.view.lock().unwrap_or_else(|e| e.into_inner());
        let mut next: Option<ClusterView> = None;
        for &(slot_id, raft_term) in won {
            let base = next.as_ref().unwrap_or(&guard);
            if let Some(mut v) = base.with_group_leader(slot_id, self.config.node_id, raft_term) {
                // One view change: the revision advances once for all the claims.
                v.revision = guard.revision + 1;
                next = Some(v);
            }
        }
        let next = next?;
        if let Err(e) = crate::store::view::save(&self.config.data_dir, &next) {
            tracing::error!(error = %e, revision = next.revision, "saving a claimed cluster view failed");
        }
        *guard = Arc::new(next);
        Some(guard.clone())
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

/// `Err(MoveRefused::Elected)` when `view`'s homes follow the groups' leaders.
fn movable(view: &ClusterView) -> Result<(), MoveRefused> {
    match view.homes {
        crate::cluster::Homes::Static => Ok(()),
        crate::cluster::Homes::Leaders => Err(MoveRefused::Elected),
    }
}

/// Why a slot move ([`NodeShared::move_leaders`]) moved nothing.
#[derive(Debug)]
pub enum MoveRefused {
    /// Slot leaders are elected by their groups (`[cluster] replicas` above 1):
    /// a move by hand would fight the elections (HTTP 409; a drain hands a node's
    /// groups over, `POST /node/drain`).
    Elected,
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
            MoveRefused::Elected => f.write_str(
                "slot leaders follow their replicated groups' elections ([cluster] replicas \
                 above 1): the view is not moved by hand (POST /cluster/slots/leader \
                 transfers a group's leadership, POST /node/drain hands a node's groups \
                 over to their other replicas)",
            ),
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
            MoveRefused::Revision { .. } | MoveRefused::Elected => 409,
            MoveRefused::Save(_) => 500,
        }
    }
}
