//! The HTTP API (WuKongIM's server API subset, `docs/http-api.md`): JSON in, JSON out;
//! errors are a non-2xx status with `{"status": <code>, "msg": "<reason>"}`.
//!
//! Requests are parsed and validated here ([`Api::serve`] is independent of the
//! HTTP server, and [`Api::handle`] runs it without sockets for tests); what
//! touches shard state goes to the owning shard through its injector and its
//! answer is awaited (a tokio channel, with a bound), holding no thread; only the
//! metadata store's writes (journal and fsync) run on the blocking pool. A request
//! that may wait holds a place in a bounded queue ([`Api::admit`],
//! `waiting_requests_max`) and is refused (503) only past it or a deadline.
//! The server itself (hyper through axum, on its own small tokio runtime) is in
//! [`server`]; the `/metrics` text in [`prom`].
//!
//! # On a cluster (issue 13)
//! Every route works on every node ([`cluster`]):
//! - the routes whose data lives on a **home** node (`/user/token` by uid,
//!   `/channel/subscriber_add|remove` by group, `/message/send` and
//!   `/channel/messagesync` by the channel key the node computes: a person
//!   channel's sorted pair, a group's id) are validated here, then, on a node that
//!   is not the key's home (`view.home_node(hash_slot(key))`), passed as they are
//!   (method, path and query, body, bearer token) to the home on the inter-node
//!   link (the hop `Api`: authenticated and sealed, [`forward`]), whose API
//!   answers it as if it had arrived there ([`Api::serve_peer_calls`]); the home's
//!   status and body are the answer;
//! - `/user/onlinestatus` asks each uid's authority node for its share and merges;
//!   `/user/device_quit` closes the local sessions and asks every other node to;
//! - a request passed on by another node is answered from this node's data only
//!   and never passed on again ([`ApiRequest::forwarded_by`]), behind the bearer
//!   token as any request;
//! - a node that does not answer within `forward_timeout_ms` makes the request
//!   503, with the node named; forwards are awaited on the API's runtime
//!   ([`forward`]), at most
//!   `forward_connections_per_peer` in flight per node, and after
//!   `forward_breaker_failures` in a row without an answer the node's breaker
//!   fails them at once (503 naming it) for `forward_breaker_cooldown_ms`;
//! - `GET /route?uid=U` and `POST /route/batch` tell clients which node to connect
//!   to; `GET /cluster/slots` adds each hash slot's home and the nodes' states;
//! - `POST /node/drain` ([`drain`]) moves the hash slots this node leads to the
//!   other nodes and disconnects its sessions, before a restart.

pub mod client;
mod cluster;
pub mod config;
mod drain;
pub mod forward;
pub mod metrics;
mod prom;
mod server;
mod transfer;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use serde::Deserialize;
use serde_json::{json, Value};
use shard::runtime::Injector;
use subtle::ConstantTimeEq as _;
use tokio::sync::mpsc::{channel as reply_channel, Receiver};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub use config::ApiConfig;
pub use metrics::ApiMetrics;
pub use server::HttpServer;

use crate::channel::{person_channel_key, Channel, CHANNEL_TYPE_GROUP, CHANNEL_TYPE_PERSON};
use crate::cluster::NodeId;
use crate::delivery::{group_by_target, TargetGroups};
use crate::node::catalog::CatalogOp;
use crate::node::msg::Msg;
use crate::node::msg::SyncRefused;
use crate::node::msg::{ApiAnswered, CatalogPropose, CatalogRefused, PeerApiCall};
use crate::node::send::{ApiSendResult, Commit, CommitRequest, MessageSyncRequest, Origin};
use crate::node::shared::NodeShared;
use crate::route::{DeviceLevel, Uid};
use crate::store::{PullMode, StoredMessage};

/// Bytes of a `messagesync` answer around its messages (two seqs, `more`, keys).
const SYNC_ENVELOPE_BYTES: usize = 128;

/// What an API answer's frame adds to its body on the link: the frame's header
/// and seal, the reply's variant, status and length (a few bytes), with room.
const API_REPLY_OVERHEAD_BYTES: usize = 256;

/// An HTTP answer: status and JSON body (or Prometheus text for /metrics).
#[derive(Debug, PartialEq)]
pub struct Reply {
    pub status: u16,
    pub body: String,
    pub content_type: &'static str,
}

impl Reply {
    fn json(status: u16, v: Value) -> Reply {
        Reply {
            status,
            body: v.to_string(),
            content_type: "application/json",
        }
    }
    fn ok() -> Reply {
        Reply::json(200, json!({"status": 200}))
    }
    fn error(status: u16, msg: impl Into<String>) -> Reply {
        Reply::json(status, json!({"status": status, "msg": msg.into()}))
    }
}

/// One request as the API sees it.
#[derive(Debug, Clone, Copy)]
pub struct ApiRequest<'a> {
    pub method: &'a str,
    /// The path, with the query if any (`/route?uid=u1`).
    pub target: &'a str,
    /// The `Authorization` header, if any (passed on when forwarded).
    pub authorization: Option<&'a str>,
    /// The node that passed the request on (read from its link, the hop `Api`):
    /// it is answered from this node's data only.
    pub forwarded_by: Option<NodeId>,
    pub body: &'a [u8],
}

impl<'a> ApiRequest<'a> {
    /// The path without the query.
    pub fn path(&self) -> &'a str {
        self.target.split('?').next().unwrap_or(self.target)
    }

    /// The query (after `?`), empty when none.
    pub fn query(&self) -> &'a str {
        self.target.split_once('?').map_or("", |(_, q)| q)
    }
}

/// The API's view of a node.
#[derive(Clone)]
pub struct Api {
    config: ApiConfig,
    shared: Arc<NodeShared>,
    injectors: Vec<Injector<Msg>>,
    /// Whether the listeners are up (for /readyz).
    listeners_up: bool,
    state: Arc<ApiState>,
}

/// What the copies of one [`Api`] share: the queue's places and the peers.
struct ApiState {
    /// `waiting_requests_max` places: a request that may wait holds one.
    waiting: Arc<Semaphore>,
    /// `blocking_threads` places: a metadata store call holds one.
    pool: Arc<Semaphore>,
    peers: forward::Peers,
}

/// A place in the waiting queue ([`Api::admit`]); counted while held.
pub struct Waiting {
    _permit: OwnedSemaphorePermit,
    shared: Arc<NodeShared>,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let m = &self.shared.api_metrics;
        m.requests_waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

#[derive(Deserialize)]
struct TokenReq {
    uid: String,
    token: String,
    #[serde(default)]
    device_flag: u8,
    #[serde(default)]
    device_level: u8,
}

#[derive(Deserialize)]
struct DeviceQuitReq {
    uid: String,
    #[serde(default = "minus_one")]
    device_flag: i32,
}

fn minus_one() -> i32 {
    -1
}

#[derive(Deserialize)]
struct SubscribersReq {
    channel_id: String,
    #[serde(default = "group")]
    channel_type: u8,
    #[serde(default)]
    reset: u8,
    #[serde(default)]
    subscribers: Vec<String>,
}

fn group() -> u8 {
    CHANNEL_TYPE_GROUP
}

#[derive(Deserialize, Default)]
struct Header {
    #[serde(default)]
    no_persist: u8,
    #[serde(default)]
    sync_once: u8,
    #[serde(default)]
    red_dot: u8,
}

#[derive(Deserialize)]
struct SendReq {
    from_uid: String,
    channel_id: String,
    channel_type: u8,
    #[serde(default)]
    client_msg_no: String,
    payload: String,
    #[serde(default)]
    header: Header,
}

#[derive(Deserialize)]
struct SyncReq {
    login_uid: String,
    channel_id: String,
    channel_type: u8,
    #[serde(default)]
    start_message_seq: u64,
    #[serde(default)]
    end_message_seq: u64,
    #[serde(default)]
    limit: usize,
    #[serde(default)]
    pull_mode: u8,
}

/// Bad input or a limit is the caller's (400); the store failing is ours (503).
fn meta_error(e: crate::store::MetaError) -> Reply {
    use crate::store::MetaError as E;
    match e {
        E::Io { .. }
        | E::Poisoned
        | E::Locked
        | E::SnapshotCorrupt
        | E::JournalCorrupt
        | E::Config(_) => {
            tracing::error!(%e, "metadata store failed");
            Reply::error(503, e.to_string())
        }
        _ => Reply::error(400, e.to_string()),
    }
}

fn parse<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, Reply> {
    serde_json::from_slice(body).map_err(|e| Reply::error(400, format!("bad request body: {e}")))
}

impl Api {
    /// The API of the node whose shared state and injectors are given.
    pub fn new(
        config: ApiConfig,
        shared: Arc<NodeShared>,
        injectors: Vec<Injector<Msg>>,
        listeners_up: bool,
    ) -> Api {
        let ms = Duration::from_millis;
        let limits = forward::PeerLimits {
            places: config.forward_connections_per_peer,
            place_wait: ms(config.queue_timeout_ms),
            timeout: ms(config.forward_timeout_ms),
            breaker_failures: config.forward_breaker_failures,
            breaker_cooldown: ms(config.forward_breaker_cooldown_ms),
        };
        let client =
            forward::ForwardClient::new(injectors.clone(), config.forward_answer_bytes_max);
        let me = shared.config.node_id;
        let peers = shared
            .config
            .cluster
            .peers(me)
            .map(|n| n.id)
            .collect::<Vec<_>>();
        let state = Arc::new(ApiState {
            waiting: Arc::new(Semaphore::new(config.waiting_requests_max)),
            pool: Arc::new(Semaphore::new(config.blocking_threads)),
            peers: forward::Peers::new(client, limits, peers),
        });
        Api {
            config,
            shared,
            injectors,
            listeners_up,
            state,
        }
    }

    /// Serves other nodes' API requests (the hop `Api`, read by the shards' links)
    /// until the node stops, each on a task of its own.
    pub async fn serve_peer_calls(self, mut calls: Receiver<PeerApiCall>) {
        while let Some(call) = calls.recv().await {
            let api = self.clone();
            tokio::spawn(async move { api.serve_peer_call(call).await });
        }
    }

    /// One request of another node, checked as one that arrived here (the bearer
    /// token, the body limit, a place in the waiting queue), answered from this
    /// node's data only, and handed back to the shard whose link read it. An answer
    /// larger than an inter-node frame allows becomes a 502 naming the limit.
    async fn serve_peer_call(&self, c: PeerApiCall) {
        let req = ApiRequest {
            method: &c.call.method,
            target: &c.call.target,
            authorization: c.call.authorization.as_deref(),
            forwarded_by: Some(c.from.node),
            body: &c.call.body,
        };
        let mut reply =
            if let Err(reply) = self.authorize(req.method, req.path(), req.authorization) {
                reply
            } else if req.body.len() > self.config.body_bytes_max {
                Reply::error(413, "request body too large")
            } else {
                self.serve_admitted(&req).await
            };
        let frame_bytes_max = self.shared.config.rpc.rpc_frame_bytes_max;
        if reply.body.len() > frame_bytes_max.saturating_sub(API_REPLY_OVERHEAD_BYTES) {
            let why = format!(
                "the answer ({} bytes) does not fit an inter-node frame ([rpc] \
                 rpc_frame_bytes_max = {frame_bytes_max})",
                reply.body.len()
            );
            reply = Reply::error(502, why);
        }
        let answered = ApiAnswered {
            to: c.from,
            status: reply.status,
            body: reply.body,
        };
        let shard = usize::from(c.shard);
        let sent = self.injectors[shard].send(Msg::ApiAnswered(Box::new(answered)));
        if sent.is_err() {
            // The asking node fails the request at its deadline.
            ApiMetrics::inc(&self.shared.api_metrics.peer_answers_dropped);
            tracing::warn!(
                shard,
                "an answer to another node's API request dropped: the shard's queue is full"
            );
        }
    }

    /// A request whose token and body were checked: at once when
    /// [`Api::is_immediate`], else with a place in the waiting queue.
    pub async fn serve_admitted(&self, req: &ApiRequest<'_>) -> Reply {
        if Api::is_immediate(req.method, req.path()) {
            return self.serve(req).await;
        }
        let _waiting = match self.admit() {
            Ok(w) => w,
            Err(reply) => return reply,
        };
        self.serve(req).await
    }

    /// A place in the waiting queue for a request that may wait (not
    /// [`Api::is_immediate`]); 503 when `waiting_requests_max` wait already.
    pub fn admit(&self) -> Result<Waiting, Reply> {
        let metrics = &self.shared.api_metrics;
        let Ok(permit) = self.state.waiting.clone().try_acquire_owned() else {
            ApiMetrics::inc(&metrics.pool_refusals);
            return Err(Reply::error(
                503,
                format!(
                    "the API is busy: {} requests are waiting already; retry",
                    self.config.waiting_requests_max
                ),
            ));
        };
        ApiMetrics::inc(&metrics.requests_waiting);
        Ok(Waiting {
            _permit: permit,
            shared: self.shared.clone(),
        })
    }

    /// Runs `f` (a metadata store call: a journal write and its fsync) on the
    /// blocking pool, once one of its `blocking_threads` places is free: 503 when
    /// none freed within `queue_timeout_ms`, 500 when `f` panics (counted).
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Api) -> Result<T, Reply> + Send + 'static,
    ) -> Result<T, Reply> {
        let metrics = &self.shared.api_metrics;
        let wait = Duration::from_millis(self.config.queue_timeout_ms);
        let place = tokio::time::timeout(wait, self.state.pool.clone().acquire_owned()).await;
        let Ok(Ok(permit)) = place else {
            ApiMetrics::inc(&metrics.pool_refusals);
            return Err(Reply::error(
                503,
                format!(
                    "the API is busy: none of the {} blocking threads freed within {} ms; retry",
                    self.config.blocking_threads, self.config.queue_timeout_ms
                ),
            ));
        };
        /// Gives the place back however `f` ends.
        struct Place {
            _permit: OwnedSemaphorePermit,
            api: Api,
        }
        impl Drop for Place {
            fn drop(&mut self) {
                let m = &self.api.shared.api_metrics;
                m.blocking_in_use.fetch_sub(1, Ordering::Relaxed);
            }
        }
        ApiMetrics::inc(&metrics.blocking_in_use);
        let place = Place {
            _permit: permit,
            api: self.clone(),
        };
        match tokio::task::spawn_blocking(move || f(&place.api)).await {
            Ok(r) => r,
            Err(e) => {
                if e.is_panic() {
                    ApiMetrics::inc(&metrics.panics);
                    tracing::error!("an HTTP API handler panicked");
                }
                Err(Reply::error(500, "internal error"))
            }
        }
    }

    /// Awaits `n` answers on `rx` within `shard_reply_timeout_ms` (all together);
    /// `None` when they did not all come in time (or a shard dropped the request).
    async fn shard_replies<T>(&self, rx: &mut Receiver<T>, n: usize) -> Option<Vec<T>> {
        let deadline = tokio::time::Instant::now() + self.timeout();
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(v)) => out.push(v),
                _ => return None,
            }
        }
        Some(out)
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.config.shard_reply_timeout_ms)
    }

    /// Answers one request (not forwarded by another node). `path` may carry a
    /// query; `authorization` is the Authorization header, if any.
    pub fn handle(
        &self,
        method: &str,
        path: &str,
        authorization: Option<&str>,
        body: &[u8],
    ) -> Reply {
        self.handle_request(&ApiRequest {
            method,
            target: path,
            authorization,
            forwarded_by: None,
            body,
        })
    }

    /// Answers one request: the open routes, then the token, the body limit and
    /// [`Api::handle_authorized`].
    pub fn handle_request(&self, req: &ApiRequest<'_>) -> Reply {
        if let Some(reply) = self.handle_open(req.method, req.path()) {
            return reply;
        }
        if let Err(reply) = self.authorize(req.method, req.path(), req.authorization) {
            return reply;
        }
        if req.body.len() > self.config.body_bytes_max {
            return Reply::error(413, "request body too large");
        }
        self.handle_authorized(req)
    }

    /// The routes open without a token (`/healthz`, `/readyz`); `None` for the rest.
    /// Never waits.
    pub fn handle_open(&self, method: &str, path: &str) -> Option<Reply> {
        match (method, path) {
            ("GET", "/healthz") => Some(Reply::ok()),
            ("GET", "/readyz") => Some(if !self.listeners_up {
                Reply::error(503, "listeners are not up")
            } else if let Some(why) = self.shared.not_ready() {
                Reply::error(503, why)
            } else {
                Reply::ok()
            }),
            _ => None,
        }
    }

    /// The operator's routes: slot moves and drains, behind `admin_token`.
    pub fn is_admin(method: &str, path: &str) -> bool {
        matches!(
            (method, path),
            ("POST", "/cluster/slots/leader") | ("POST", "/node/drain")
        )
    }

    /// Checks the request's bearer token, in constant time (for tokens of the
    /// same length): the admin token on [`Api::is_admin`] routes (403 without one
    /// configured behind an API token), the API's on the others; open where none is
    /// configured.
    pub fn authorize(
        &self,
        method: &str,
        path: &str,
        authorization: Option<&str>,
    ) -> Result<(), Reply> {
        let given = authorization
            .and_then(|a| a.strip_prefix("Bearer "))
            .unwrap_or("");
        let matches = |token: &crate::config::values::Secret| {
            bool::from(given.as_bytes().ct_eq(token.expose())) && !given.is_empty()
        };
        if Api::is_admin(method, path) {
            return match (&self.config.admin_token, &self.config.bearer_token) {
                (Some(admin), _) if matches(admin) => Ok(()),
                (Some(_), _) => Err(Reply::error(401, "missing or wrong admin token")),
                (None, Some(_)) => Err(Reply::error(
                    403,
                    "slot moves and drains need the admin token, and none is set: set \
                     auth.admin_token (or IMROUTER_ADMIN_TOKEN) and send it as the bearer token",
                )),
                (None, None) => Ok(()),
            };
        }
        match &self.config.bearer_token {
            Some(token) if !matches(token) => {
                Err(Reply::error(401, "missing or wrong bearer token"))
            }
            _ => Ok(()),
        }
    }

    /// Whether the route answers from memory at once (no shard, no disk, no other
    /// node): served on the API's runtime, outside the waiting queue.
    pub fn is_immediate(method: &str, path: &str) -> bool {
        matches!(
            (method, path),
            ("GET", "/metrics")
                | ("GET", "/cluster/slots")
                | ("GET", "/route")
                | ("POST", "/route/batch")
        )
    }

    /// The answer of a forwarded header naming no peer (400) or of an
    /// [`Api::is_immediate`] route, at once; `None` for the rest.
    fn answer_from_memory(&self, req: &ApiRequest<'_>) -> Option<Reply> {
        if let Err(reply) = self.check_forwarded(req) {
            return Some(reply);
        }
        let result = match (req.method, req.path()) {
            ("GET", "/metrics") => Ok(self.metrics()),
            ("GET", "/cluster/slots") => Ok(self.cluster_slots()),
            ("GET", "/route") => self.route_one(req),
            ("POST", "/route/batch") => self.route_batch(req),
            _ => return None,
        };
        Some(result.unwrap_or_else(|e| e))
    }

    /// [`Api::serve`] from a thread outside any tokio runtime (tests, the
    /// embedded benchmark): on a runtime of its own for the call.
    pub fn handle_authorized(&self, req: &ApiRequest<'_>) -> Reply {
        // Without a runtime: they must answer when descriptors run out too.
        if let Some(reply) = self.answer_from_memory(req) {
            return reply;
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build();
        match runtime {
            Ok(rt) => rt.block_on(self.serve(req)),
            Err(e) => Reply::error(500, format!("no runtime for the request: {e}")),
        }
    }

    /// Answers a request whose token has been checked and whose body is within
    /// `body_bytes_max`. Unless [`Api::is_immediate`], may wait (holding no thread)
    /// on a shard (up to `shard_reply_timeout_ms`), another node (up to
    /// `forward_timeout_ms`), or a place in the queue (up to `queue_timeout_ms`),
    /// and run a metadata store call on the blocking pool. Refuses (400) a
    /// forwarded header naming no peer.
    pub async fn serve(&self, req: &ApiRequest<'_>) -> Reply {
        if let Some(reply) = self.answer_from_memory(req) {
            return reply;
        }
        let (method, path) = (req.method, req.path());
        let result = match (method, path) {
            ("POST", "/user/token") => self.user_token(req).await,
            ("POST", "/user/device_quit") => self.device_quit(req).await,
            ("POST", "/user/onlinestatus") => self.online_status(req).await,
            ("POST", "/channel/subscriber_add") => self.subscriber_add(req).await,
            ("POST", "/channel/subscriber_remove") => self.subscriber_remove(req).await,
            ("POST", "/message/send") => self.message_send(req).await,
            ("POST", "/channel/messagesync") => self.message_sync(req).await,
            ("POST", "/cluster/slots/leader") => self.move_leaders(req).await,
            ("POST", "/node/drain") => self.drain(req).await,
            #[cfg(test)]
            ("GET", "/test/panic") => panic!("a test handler panics"),
            #[cfg(test)]
            ("POST", "/test/wait") => {
                self.blocking(|_| {
                    let (open, cv) = &tests::GATE;
                    let mut g = open.lock().unwrap();
                    while !*g {
                        g = cv.wait(g).unwrap();
                    }
                    Ok(Reply::ok())
                })
                .await
            }
            #[cfg(test)]
            ("POST", "/test/hold") => {
                // Waits on the runtime, holding no thread, until the test opens it.
                let _ = tests::HOLD.acquire().await;
                Ok(Reply::ok())
            }
            _ => Err(Reply::error(404, format!("no route {method} {path}"))),
        };
        result.unwrap_or_else(|e| e)
    }

    async fn user_token(&self, req: &ApiRequest<'_>) -> Result<Reply, Reply> {
        let r: TokenReq = parse(req.body)?;
        if r.uid.is_empty() || r.token.is_empty() {
            return Err(Reply::error(400, "uid and token must not be empty"));
        }
        let uid_bytes_max = self.shared.config.session.uid_bytes_max;
        if r.uid.len() > uid_bytes_max {
            return Err(Reply::error(
                400,
                format!("uid longer than [session] uid_bytes_max ({uid_bytes_max} bytes)"),
            ));
        }
        let level = match r.device_level {
            0 => DeviceLevel::Slave,
            1 => DeviceLevel::Master,
            l => {
                return Err(Reply::error(
                    400,
                    format!("device_level must be 0 or 1, not {l}"),
                ))
            }
        };
        self.answer_at_home(r.uid.as_bytes(), req).await?;
        if self.replicated() {
            let op = CatalogOp::SetToken {
                uid: r.uid,
                device_flag: r.device_flag,
                token: r.token,
                level: r.device_level,
            };
            return self.propose_catalog(op).await.map(|()| Reply::ok());
        }
        self.blocking(move |api| {
            api.shared
                .catalog
                .set_token(&r.uid, r.device_flag, &r.token, level)
                .map_err(meta_error)
        })
        .await?;
        Ok(Reply::ok())
    }

    /// Closes the sessions of the uid and flag on this node's shards, then (unless
    /// forwarded here) asks every other node to ([`Api::quit_elsewhere`]).
    async fn device_quit(&self, req: &ApiRequest<'_>) -> Result<Reply, Reply> {
        let r: DeviceQuitReq = parse(req.body)?;
        let flag = match r.device_flag {
            -1 => None,
            f @ 0..=255 => Some(f as u8),
            f => return Err(Reply::error(400, format!("bad device_flag {f}"))),
        };
        self.quit_local(&r.uid, flag).await?;
        self.quit_elsewhere(req).await
    }

    /// Closes the sessions of `uid` (and `flag`, `None`: all) on every shard of
    /// this node; 503 when a shard's queue is full, 504 when one does not answer.
    async fn quit_local(&self, uid: &str, flag: Option<u8>) -> Result<(), Reply> {
        let (tx, mut rx) = reply_channel(self.injectors.len());
        for inj in &self.injectors {
            let msg = Msg::DeviceQuit {
                uid: uid.to_owned(),
                device_flag: flag,
                done: tx.clone(),
            };
            if inj.send(msg).is_err() {
                return Err(Reply::error(503, "a shard's control queue is full; retry"));
            }
        }
        drop(tx);
        self.shard_replies(&mut rx, self.injectors.len())
            .await
            .ok_or_else(|| Reply::error(504, "a shard did not answer in time"))?;
        Ok(())
    }

    /// The online devices of `uids` in this node's authority tables (a uid whose
    /// slot this node does not lead, or whose group is stale, is reported offline).
    fn local_online(&self, uids: &[String]) -> Vec<Value> {
        let uids: Vec<Uid> = uids.iter().map(|u| Uid::from(u.as_str())).collect();
        let mut groups = TargetGroups::default();
        group_by_target(&self.shared.view(), &uids, &mut groups);
        let lookups: Vec<_> = groups.lookups().collect();
        let reader = self.shared.authority_reader();
        let mut out = Vec::new();
        for result in reader.endpoints_by_targets(&lookups) {
            // A stale group is unknown right now: those uids are reported offline.
            for ep in result.unwrap_or_default() {
                out.push(json!({"uid": &*ep.uid, "device_flag": ep.device_flag, "online": 1}));
            }
        }
        out
    }

    async fn subscriber_add(&self, req: &ApiRequest<'_>) -> Result<Reply, Reply> {
        let r: SubscribersReq = parse(req.body)?;
        self.check_group(&r)?;
        let uid_bytes_max = self.shared.config.session.uid_bytes_max;
        if r.subscribers.iter().any(|u| u.len() > uid_bytes_max) {
            return Err(Reply::error(
                400,
                format!("a subscriber uid is longer than [session] uid_bytes_max ({uid_bytes_max} bytes)"),
            ));
        }
        self.answer_at_home(r.channel_id.as_bytes(), req).await?;
        if self.replicated() {
            let op = CatalogOp::AddSubscribers {
                channel_id: r.channel_id,
                uids: r.subscribers,
                reset: r.reset == 1,
            };
            return self.propose_catalog(op).await.map(|()| Reply::ok());
        }
        self.blocking(move |api| {
            api.shared
                .catalog
                .add_subscribers(&r.channel_id, &r.subscribers, r.reset == 1)
                .map_err(meta_error)
        })
        .await?;
        Ok(Reply::ok())
    }

    async fn subscriber_remove(&self, req: &ApiRequest<'_>) -> Result<Reply, Reply> {
        let r: SubscribersReq = parse(req.body)?;
        self.check_group(&r)?;
        self.answer_at_home(r.channel_id.as_bytes(), req).await?;
        if self.replicated() {
            let op = CatalogOp::RemoveSubscribers {
                channel_id: r.channel_id,
                uids: r.subscribers,
            };
            return self.propose_catalog(op).await.map(|()| Reply::ok());
        }
        self.blocking(move |api| {
            api.shared
                .catalog
                .remove_subscribers(&r.channel_id, &r.subscribers)
                .map_err(meta_error)
        })
        .await?;
        Ok(Reply::ok())
    }

    /// Whether the catalog is replicated: homes follow the groups' leaders and each
    /// change goes through the key's group ([`Api::propose_catalog`]).
    fn replicated(&self) -> bool {
        self.shared.view().homes == crate::cluster::Homes::Leaders
    }

    /// A catalog change on a replicated cluster, at the key's home (its group's
    /// leader: the request was passed here): proposed to the group on its shard,
    /// answered once committed on a majority and applied here (every replica
    /// applies it at its commit). 503 when this node does not serve as the group's
    /// leader (an election, or a view not yet spread), when the leader changed
    /// before the commit or too many changes wait (retry: a change sets values, a
    /// second copy is harmless); 504 when the commit took too long; the store's
    /// refusal (a limit: 400) as for a node alone.
    async fn propose_catalog(&self, op: CatalogOp) -> Result<(), Reply> {
        let slot_ids = self.shared.config.cluster.slot_ids;
        let slot_id = op.slot_id(slot_ids);
        // Every hash slot of a slot id is on its group's shard.
        let slot = transfer::first_hash_slot(slot_id, slot_ids)
            .ok_or_else(|| Reply::error(400, format!("slot id {slot_id} does not exist")))?;
        let shard = self.shared.slot_map.shard_of(slot);
        let (tx, mut rx) = reply_channel(1);
        let propose = CatalogPropose {
            slot_id,
            op,
            done: tx,
        };
        self.injectors[shard as usize]
            .send(Msg::CatalogPropose(Box::new(propose)))
            .map_err(|_| Reply::error(503, "the group's shard is busy; retry"))?;
        let outcome = (self.shard_replies(&mut rx, 1).await)
            .and_then(|mut r| r.pop())
            .ok_or_else(|| {
                Reply::error(
                    504,
                    "the change was not committed in time (it may still be): retry",
                )
            })?;
        outcome.map_err(|refused| match refused {
            CatalogRefused::NotLeader => Reply::error(
                503,
                "this node does not serve as the key's group leader (an election is under \
                 way): retry",
            ),
            CatalogRefused::Lost => Reply::error(
                503,
                "the key's group changed leader before the change was committed: retry",
            ),
            CatalogRefused::Busy => Reply::error(
                503,
                "too many changes wait for their commit on this shard: retry",
            ),
            CatalogRefused::Store(e) => meta_error(e),
        })
    }

    fn check_group(&self, r: &SubscribersReq) -> Result<(), Reply> {
        if r.channel_type != CHANNEL_TYPE_GROUP {
            return Err(Reply::error(
                400,
                "only group channels (channel_type 2) have subscribers",
            ));
        }
        if r.channel_id.is_empty() {
            return Err(Reply::error(400, "channel_id must not be empty"));
        }
        if r.subscribers.len() > self.config.uids_per_request_max {
            return Err(Reply::error(413, "too many subscribers in one request"));
        }
        Ok(())
    }

    async fn message_send(&self, req: &ApiRequest<'_>) -> Result<Reply, Reply> {
        let r: SendReq = parse(req.body)?;
        if r.from_uid.is_empty() {
            return Err(Reply::error(400, "from_uid must not be empty"));
        }
        let payload = base64::engine::general_purpose::STANDARD
            .decode(r.payload.as_bytes())
            .map_err(|e| Reply::error(400, format!("payload is not base64: {e}")))?;
        let channel =
            Channel::resolve(&r.from_uid, &r.channel_id, r.channel_type).map_err(|e| {
                Reply::error(400, format!("bad channel (reason {})", e.reason_code().0))
            })?;
        self.answer_at_home(channel.key().as_bytes(), req).await?;
        let mut flags = 0u8;
        if r.header.no_persist == 1 {
            flags |= 0x01;
        }
        if r.header.red_dot == 1 {
            flags |= 0x02;
        }
        if r.header.sync_once == 1 {
            flags |= 0x04;
        }
        let (tx, mut rx) = reply_channel::<ApiSendResult>(1);
        let shard = self.shared.slot_map.shard_of_key(channel.key().as_bytes());
        let request = CommitRequest {
            answer_to: Origin::Api { reply: tx },
            sender: None,
            from_uid: Uid::from(r.from_uid.as_str()),
            channel,
            client_msg_no: r.client_msg_no,
            // Server-side sends are delivered encrypted per session (no NoEncrypt bit).
            setting: 0,
            flags,
            expire_s: 0,
            topic: String::new(),
            payload,
        };
        let commit = Commit {
            request,
            decoded_ns: self.shared.mono_ns(),
        };
        self.injectors[shard as usize]
            .send(Msg::Commit(Box::new(commit)))
            .map_err(|_| Reply::error(503, "the channel's shard is busy; retry"))?;
        let res = self
            .shard_replies(&mut rx, 1)
            .await
            .and_then(|mut r| r.pop())
            .ok_or_else(|| Reply::error(504, "commit did not finish in time"))?;
        let reason = res.reason.0;
        if res.reason != proto::wkproto::ReasonCode::SUCCESS {
            return Err(Reply::json(
                400,
                json!({"status": 400, "msg": format!("send refused, reason {reason}"), "reason": reason}),
            ));
        }
        Ok(Reply::json(
            200,
            json!({"message_id": res.message_id, "message_seq": res.message_seq, "reason": reason}),
        ))
    }

    async fn message_sync(&self, req: &ApiRequest<'_>) -> Result<Reply, Reply> {
        let r: SyncReq = parse(req.body)?;
        let key = sync_channel_key(&r)?;
        self.answer_at_home(key.as_bytes(), req).await?;
        self.check_member(&r)?;
        let bytes_max = self.sync_bytes_max(req);
        let (messages, more) = self.read_channel(&r, key, bytes_max).await?;
        Ok(self.sync_answer(&r, &messages, more, bytes_max))
    }

    /// The `messagesync` answer's size: `sync_response_bytes_max`, and for another
    /// node at most half an inter-node frame (`[rpc] rpc_frame_bytes_max`; the
    /// answer goes back on the link in one, and `more` says the rest is there).
    fn sync_bytes_max(&self, req: &ApiRequest<'_>) -> usize {
        let configured = self.config.sync_response_bytes_max;
        match req.forwarded_by {
            Some(_) => configured.min(self.shared.config.rpc.rpc_frame_bytes_max / 2),
            None => configured,
        }
    }

    /// Refuses (403) a group read by a login uid that does not subscribe to it
    /// (the subscribers are the home's: call it on the channel's home).
    fn check_member(&self, r: &SyncReq) -> Result<(), Reply> {
        if r.channel_type != CHANNEL_TYPE_GROUP {
            return Ok(());
        }
        let members = self.shared.catalog.subscribers(&r.channel_id);
        if !members.is_some_and(|m| m.contains(&r.login_uid)) {
            return Err(Reply::error(
                403,
                "login_uid is not a subscriber of the channel",
            ));
        }
        Ok(())
    }

    /// Reads the channel `key` on its commit shard: the messages (ascending, at
    /// most `bytes_max` copied) and whether more are in range. Refuses
    /// (503) when the shard's injector is full, (504) when no answer came in time and
    /// (500) when the log failed the read.
    async fn read_channel(
        &self,
        r: &SyncReq,
        key: String,
        bytes_max: usize,
    ) -> Result<(Vec<StoredMessage>, bool), Reply> {
        let (tx, mut rx) = reply_channel(1);
        let shard = self.shared.slot_map.shard_of_key(key.as_bytes());
        let request = MessageSyncRequest {
            channel_type: r.channel_type,
            channel_key: key,
            start_seq: r.start_message_seq,
            end_seq: r.end_message_seq,
            limit: r.limit,
            pull_mode: PullMode::from_wire(r.pull_mode),
            bytes_max,
            reply: tx,
        };
        self.injectors[shard as usize]
            .send(Msg::MessageSync(Box::new(request)))
            .map_err(|_| Reply::error(503, "the channel's shard is busy; retry"))?;
        self.shard_replies(&mut rx, 1)
            .await
            .and_then(|mut r| r.pop())
            .ok_or_else(|| Reply::error(504, "read did not finish in time"))?
            .map_err(|e| match e {
                SyncRefused::NotLeader => {
                    ApiMetrics::inc(&self.shared.api_metrics.reads_not_leader);
                    Reply::error(
                        503,
                        "no leader of the channel's replicated group serves here (an \
                         election or a hand-over is under way): retry",
                    )
                }
                SyncRefused::Busy => {
                    ApiMetrics::inc(&self.shared.api_metrics.reads_busy);
                    Reply::error(503, "too many reads wait on the channel's shard; retry")
                }
                SyncRefused::Log(e) => Reply::error(500, e),
            })
    }

    /// The `messagesync` answer, within `bytes_max`: messages nearest
    /// the start of the pull first (the oldest going up, the newest going down), the
    /// first always, then each only if it fits (`more` set when one did not).
    fn sync_answer(
        &self,
        r: &SyncReq,
        messages: &[StoredMessage],
        more: bool,
        bytes_max: usize,
    ) -> Reply {
        let budget = bytes_max.saturating_sub(SYNC_ENVELOPE_BYTES);
        let down = PullMode::from_wire(r.pull_mode) == PullMode::Down
            || (r.start_message_seq == 0 && r.end_message_seq == 0);
        let order: Box<dyn Iterator<Item = &StoredMessage>> = if down {
            Box::new(messages.iter().rev())
        } else {
            Box::new(messages.iter())
        };
        let (mut list, mut used, mut more) = (Vec::new(), 0usize, more);
        for m in order {
            let text = sync_message_json(m, &r.login_uid);
            if !list.is_empty() && used + text.len() + 1 > budget {
                more = true;
                break;
            }
            used += text.len() + 1;
            list.push(text);
        }
        if down {
            list.reverse();
        }
        let body = format!(
            "{{\"start_message_seq\":{},\"end_message_seq\":{},\"more\":{},\"messages\":[{}]}}",
            r.start_message_seq,
            r.end_message_seq,
            u8::from(more),
            list.join(",")
        );
        Reply {
            status: 200,
            body,
            content_type: "application/json",
        }
    }

    fn metrics(&self) -> Reply {
        Reply {
            status: 200,
            body: prom::render(&self.shared),
            content_type: "text/plain; version=0.0.4; charset=utf-8",
        }
    }

    async fn move_leaders(&self, req: &ApiRequest<'_>) -> Result<Reply, Reply> {
        #[derive(Deserialize)]
        struct Req {
            hash_slots: Vec<u16>,
            leader_node_id: u64,
            /// The revision the move expects the view at (optional): 409 otherwise.
            #[serde(default)]
            revision: Option<u64>,
        }
        let r: Req = parse(req.body)?;
        let nodes = self.shared.view().nodes.clone();
        if !nodes.contains(&r.leader_node_id) {
            return Err(Reply::error(
                400,
                format!(
                    "node {} is not a node of this cluster (nodes {nodes:?})",
                    r.leader_node_id
                ),
            ));
        }
        if let Some(bad) = r
            .hash_slots
            .iter()
            .find(|&&s| s as usize >= slots::HASH_SLOTS)
        {
            return Err(Reply::error(
                400,
                format!("hash slot {bad} does not exist (0..256)"),
            ));
        }
        if self.replicated() {
            let current = self.shared.view().revision;
            if let Some(expected) = r.revision.filter(|&e| e != current) {
                let refused = crate::node::shared::MoveRefused::Revision { expected, current };
                return Err(Reply::error(refused.status(), refused.to_string()));
            }
            return (self.transfer_leaders(req, &r.hash_slots, r.leader_node_id)).await;
        }
        let view = self
            .shared
            .move_leaders(&r.hash_slots, r.leader_node_id, r.revision)
            .map_err(|refused| Reply::error(refused.status(), refused.to_string()))?;
        for inj in &self.injectors {
            inj.send(Msg::View(view.clone())).map_err(|_| {
                Reply::error(
                    503,
                    "a shard's control queue is full; the view will be resent",
                )
            })?;
        }
        Ok(self.cluster_slots_of(&view))
    }
}

/// The stored key of the channel `r` reads (its home is the key's). Refuses (400)
/// a channel type other than person or group.
fn sync_channel_key(r: &SyncReq) -> Result<String, Reply> {
    match r.channel_type {
        CHANNEL_TYPE_PERSON => Ok(person_channel_key(&r.login_uid, &r.channel_id)),
        CHANNEL_TYPE_GROUP => Ok(r.channel_id.clone()),
        t => Err(Reply::error(400, format!("unsupported channel_type {t}"))),
    }
}

/// One message of a `messagesync` answer as JSON, its channel id as `login_uid` sees
/// it (a person channel names the other party).
fn sync_message_json(m: &StoredMessage, login_uid: &str) -> String {
    let channel_id = crate::channel::recv_channel_id(&m.channel_id, m.channel_type, login_uid);
    json!({
        "message_id": m.message_id,
        "message_idstr": m.message_id.to_string(),
        "message_seq": m.message_seq,
        "client_msg_no": m.client_msg_no,
        "from_uid": m.from_uid,
        "channel_id": channel_id,
        "channel_type": m.channel_type,
        "timestamp": m.timestamp_s,
        "setting": m.setting,
        "payload": base64::engine::general_purpose::STANDARD.encode(&m.payload),
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpStream};
    use std::sync::{Condvar, Mutex};
    use std::time::Duration;

    use crate::node::{Node, NodeConfig};

    fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        request(
            addr,
            &format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
        )
    }

    /// Holds `POST /test/wait` (on a thread of the blocking pool) until opened.
    pub(super) static GATE: (Mutex<bool>, Condvar) = (Mutex::new(false), Condvar::new());
    /// Holds `POST /test/hold` (awaiting, on no thread) until given permits.
    pub(super) static HOLD: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(0);

    fn metric(text: &str, name: &str) -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} in /metrics"))
    }

    fn panics_counted(text: &str) -> u64 {
        metric(text, "imrouter_api_panics_total")
    }

    fn post(addr: SocketAddr, path: &str) -> (u16, String) {
        request(
            addr,
            &format!(
                "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            ),
        )
    }

    fn request(addr: SocketAddr, text: &str) -> (u16, String) {
        let mut s = TcpStream::connect(addr).unwrap();
        // A failure detector only: a hung server fails the test.
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(text.as_bytes()).unwrap();
        let mut reply = String::new();
        s.read_to_string(&mut reply).unwrap();
        let status = reply.split(' ').nth(1).and_then(|c| c.parse().ok());
        let body = reply
            .split_once("\r\n\r\n")
            .map_or("", |(_, b)| b)
            .to_string();
        (
            status.unwrap_or_else(|| panic!("bad reply {reply:?}")),
            body,
        )
    }

    fn start(edit: impl FnOnce(&mut NodeConfig)) -> (tempfile::TempDir, Node) {
        let dir = tempfile::tempdir().unwrap();
        let mut c = NodeConfig {
            data_dir: dir.path().to_path_buf(),
            tcp_addr: None,
            ws_addr: None,
            ..NodeConfig::default()
        };
        c.api.addr = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
        c.runtime.shard_count = 1;
        c.runtime.pin_cores = Vec::new();
        c.log.segment_bytes = 4 << 20;
        edit(&mut c);
        let node = Node::start(c).unwrap();
        (dir, node)
    }

    /// Polls `name` in the node's /metrics until it is `want` (bounded).
    fn wait_metric(api: &super::Api, name: &str, want: u64) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let got = metric(&api.handle("GET", "/metrics", None, b"").body, name);
            if got == want {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{name}: {got}, not {want}"
            );
            std::thread::yield_now();
        }
    }

    #[test]
    fn requests_queue_up_to_the_bound_and_the_deadline_then_503_and_health_still_answers() {
        let (_dir, node) = start(|c| {
            c.api.blocking_threads = 1;
            c.api.waiting_requests_max = 3;
            c.api.queue_timeout_ms = 1;
        });
        let addr = node.api_addr().unwrap();
        let api = node.api();
        let holder = std::thread::spawn(move || post(addr, "/test/wait"));
        wait_metric(&api, "imrouter_api_blocking_in_use", 1);
        // The one blocking thread stays taken: a second call waits for it past
        // queue_timeout_ms.
        let (status, body) = post(addr, "/test/wait");
        assert_eq!(status, 503, "{body}");
        assert!(
            body.contains("none of the 1 blocking threads freed within 1 ms"),
            "{body}"
        );
        // Requests waiting on no thread fill the queue's other two places.
        let awaiting: Vec<_> = (0..2)
            .map(|_| std::thread::spawn(move || post(addr, "/test/hold")))
            .collect();
        wait_metric(&api, "imrouter_api_requests_waiting", 3);
        let (status, body) = post(addr, "/user/token");
        assert_eq!(status, 503, "{body}");
        assert!(body.contains("3 requests are waiting already"), "{body}");
        for path in ["/healthz", "/readyz", "/metrics", "/cluster/slots"] {
            assert_eq!(get(addr, path).0, 200, "{path} while the queue is full");
        }
        let text = get(addr, "/metrics").1;
        assert_eq!(metric(&text, "imrouter_api_pool_refusals_total"), 2);
        HOLD.add_permits(2);
        *GATE.0.lock().unwrap() = true;
        GATE.1.notify_all();
        for w in awaiting.into_iter().chain([holder]) {
            assert_eq!(w.join().unwrap().0, 200);
        }
        wait_metric(&api, "imrouter_api_requests_waiting", 0);
        wait_metric(&api, "imrouter_api_blocking_in_use", 0);
        node.shutdown().unwrap();
    }

    #[test]
    fn a_panicking_handler_answers_500_and_is_counted() {
        let (_dir, node) = start(|_| {});
        let addr = node.api_addr().unwrap();
        assert_eq!(get(addr, "/test/panic").0, 500);
        let before = panics_counted(&get(addr, "/metrics").1);
        for _ in 0..3 {
            assert_eq!(get(addr, "/test/panic").0, 500);
        }
        assert_eq!(get(addr, "/healthz").0, 200);
        assert_eq!(panics_counted(&get(addr, "/metrics").1), before + 3);
        node.shutdown().unwrap();
    }
}
