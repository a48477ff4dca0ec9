//! The HTTP API (WuKongIM's server API subset, `http-api.md`): JSON in, JSON out;
//! errors are a non-2xx status with `{"status": <code>, "msg": "<reason>"}`.
//!
//! Requests are parsed and validated here ([`Api::handle`] is independent of the
//! HTTP server, so it is tested without sockets); what touches shard state goes to
//! the owning shard through its injector and waits for the answer with a bound.

use std::io::Read;
use std::net::SocketAddr;
use std::sync::mpsc::sync_channel;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use base64::Engine as _;
use serde::Deserialize;
use serde_json::{json, Value};
use shard::runtime::Injector;

use crate::channel::{person_channel_key, Channel, CHANNEL_TYPE_GROUP, CHANNEL_TYPE_PERSON};
use crate::delivery::{group_by_target, TargetGroups};
use crate::node::msg::Msg;
use crate::node::send::{ApiSendResult, CommitRequest, Origin, SyncRequest};
use crate::node::NodeShared;
use crate::route::{DeviceLevel, Uid};
use crate::store::PullMode;

/// Limits of the HTTP API.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApiConfig {
    /// Set from `[listen] api_addr`.
    #[serde(skip)]
    pub addr: Option<SocketAddr>,
    /// Required as `Authorization: Bearer <token>` on every route but /healthz and
    /// /readyz when set. Set from `[auth] api_bearer_token`.
    #[serde(skip)]
    pub bearer_token: Option<String>,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Most uids in one request (onlinestatus, subscribers).
    pub max_uids_per_request: usize,
    /// How long a request waits for a shard's answer.
    pub shard_reply_timeout_ms: u64,
    /// Worker threads serving requests.
    pub worker_threads: usize,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            addr: Some(SocketAddr::from(([127, 0, 0, 1], 5001))),
            bearer_token: None,
            max_body_bytes: 1 << 20,
            max_uids_per_request: 10_000,
            shard_reply_timeout_ms: 5_000,
            worker_threads: 2,
        }
    }
}

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

/// The API's view of a node.
#[derive(Clone)]
pub struct Api {
    config: ApiConfig,
    shared: Arc<NodeShared>,
    injectors: Vec<Injector<Msg>>,
    /// Whether the listeners are up (for /readyz).
    listeners_up: bool,
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
        Api {
            config,
            shared,
            injectors,
            listeners_up,
        }
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.config.shard_reply_timeout_ms)
    }

    /// Answers one request. `authorization` is the Authorization header, if any.
    pub fn handle(
        &self,
        method: &str,
        path: &str,
        authorization: Option<&str>,
        body: &[u8],
    ) -> Reply {
        let path = path.split('?').next().unwrap_or(path);
        match (method, path) {
            ("GET", "/healthz") => return Reply::ok(),
            ("GET", "/readyz") => {
                return if !self.listeners_up {
                    Reply::error(503, "listeners are not up")
                } else if let Some(why) = self.shared.not_ready() {
                    Reply::error(503, why)
                } else {
                    Reply::ok()
                };
            }
            _ => {}
        }
        if let Some(token) = &self.config.bearer_token {
            let expected = format!("Bearer {token}");
            if authorization != Some(expected.as_str()) {
                return Reply::error(401, "missing or wrong bearer token");
            }
        }
        if body.len() > self.config.max_body_bytes {
            return Reply::error(413, "request body too large");
        }
        let result = match (method, path) {
            ("POST", "/user/token") => self.user_token(body),
            ("POST", "/user/device_quit") => self.device_quit(body),
            ("POST", "/user/onlinestatus") => self.online_status(body),
            ("POST", "/channel/subscriber_add") => self.subscriber_add(body),
            ("POST", "/channel/subscriber_remove") => self.subscriber_remove(body),
            ("POST", "/message/send") => self.message_send(body),
            ("POST", "/channel/messagesync") => self.message_sync(body),
            ("GET", "/metrics") => Ok(self.metrics()),
            ("GET", "/cluster/slots") => Ok(self.cluster_slots()),
            ("POST", "/cluster/slots/leader") => self.move_leaders(body),
            _ => Err(Reply::error(404, format!("no route {method} {path}"))),
        };
        result.unwrap_or_else(|e| e)
    }

    fn user_token(&self, body: &[u8]) -> Result<Reply, Reply> {
        let r: TokenReq = parse(body)?;
        if r.uid.is_empty() || r.token.is_empty() {
            return Err(Reply::error(400, "uid and token must not be empty"));
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
        self.shared
            .meta
            .set_token(&r.uid, r.device_flag, &r.token, level)
            .map_err(meta_error)?;
        Ok(Reply::ok())
    }

    fn device_quit(&self, body: &[u8]) -> Result<Reply, Reply> {
        let r: DeviceQuitReq = parse(body)?;
        let flag = match r.device_flag {
            -1 => None,
            f @ 0..=255 => Some(f as u8),
            f => return Err(Reply::error(400, format!("bad device_flag {f}"))),
        };
        let (tx, rx) = sync_channel(self.injectors.len());
        for inj in &self.injectors {
            let msg = Msg::DeviceQuit {
                uid: r.uid.clone(),
                device_flag: flag,
                done: tx.clone(),
            };
            if inj.send(msg).is_err() {
                return Err(Reply::error(503, "a shard's control queue is full; retry"));
            }
        }
        for _ in 0..self.injectors.len() {
            rx.recv_timeout(self.timeout())
                .map_err(|_| Reply::error(504, "a shard did not answer in time"))?;
        }
        Ok(Reply::ok())
    }

    fn online_status(&self, body: &[u8]) -> Result<Reply, Reply> {
        let uids: Vec<String> = parse(body)?;
        if uids.len() > self.config.max_uids_per_request {
            return Err(Reply::error(413, "too many uids"));
        }
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
        Ok(Reply::json(200, Value::Array(out)))
    }

    fn subscriber_add(&self, body: &[u8]) -> Result<Reply, Reply> {
        let r: SubscribersReq = parse(body)?;
        self.check_group(&r)?;
        self.shared
            .meta
            .add_subscribers(&r.channel_id, &r.subscribers, r.reset == 1)
            .map_err(meta_error)?;
        Ok(Reply::ok())
    }

    fn subscriber_remove(&self, body: &[u8]) -> Result<Reply, Reply> {
        let r: SubscribersReq = parse(body)?;
        self.check_group(&r)?;
        self.shared
            .meta
            .remove_subscribers(&r.channel_id, &r.subscribers)
            .map_err(meta_error)?;
        Ok(Reply::ok())
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
        if r.subscribers.len() > self.config.max_uids_per_request {
            return Err(Reply::error(413, "too many subscribers in one request"));
        }
        Ok(())
    }

    fn message_send(&self, body: &[u8]) -> Result<Reply, Reply> {
        let r: SendReq = parse(body)?;
        if r.from_uid.is_empty() {
            return Err(Reply::error(400, "from_uid must not be empty"));
        }
        let payload = base64::engine::general_purpose::STANDARD
            .decode(r.payload.as_bytes())
            .map_err(|e| Reply::error(400, format!("payload is not base64: {e}")))?;
        let channel = Channel::resolve(&r.from_uid, &r.channel_id, r.channel_type)
            .map_err(|e| Reply::error(400, format!("bad channel (reason {})", e.reason_code())))?;
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
        let (tx, rx) = sync_channel::<ApiSendResult>(1);
        let shard = self.shared.slot_map.shard_of_key(channel.key().as_bytes());
        let request = CommitRequest {
            origin: Origin::Api { reply: tx },
            from_uid: Uid::from(r.from_uid.as_str()),
            channel,
            client_msg_no: r.client_msg_no,
            // Server-side sends are delivered encrypted per session (no NoEncrypt bit).
            setting: 0,
            flags,
            expire_s: 0,
            topic: String::new(),
            payload,
            decoded_ns: self.shared.mono_ns(),
        };
        self.injectors[shard as usize]
            .send(Msg::Commit(Box::new(request)))
            .map_err(|_| Reply::error(503, "the channel's shard is busy; retry"))?;
        let res = rx
            .recv_timeout(self.timeout())
            .map_err(|_| Reply::error(504, "commit did not finish in time"))?;
        if res.reason != 1 {
            return Err(Reply::json(
                400,
                json!({"status": 400, "msg": format!("send refused, reason {}", res.reason), "reason": res.reason}),
            ));
        }
        Ok(Reply::json(
            200,
            json!({"message_id": res.message_id, "message_seq": res.message_seq, "reason": res.reason}),
        ))
    }

    fn message_sync(&self, body: &[u8]) -> Result<Reply, Reply> {
        let r: SyncReq = parse(body)?;
        let key = match r.channel_type {
            CHANNEL_TYPE_PERSON => person_channel_key(&r.login_uid, &r.channel_id),
            CHANNEL_TYPE_GROUP => {
                let members = self.shared.meta.subscribers(&r.channel_id);
                if !members.is_some_and(|m| m.contains(&r.login_uid)) {
                    return Err(Reply::error(
                        403,
                        "login_uid is not a subscriber of the channel",
                    ));
                }
                r.channel_id.clone()
            }
            t => return Err(Reply::error(400, format!("unsupported channel_type {t}"))),
        };
        let (tx, rx) = sync_channel(1);
        let shard = self.shared.slot_map.shard_of_key(key.as_bytes());
        let request = SyncRequest {
            channel_type: r.channel_type,
            channel_key: key,
            start_seq: r.start_message_seq,
            end_seq: r.end_message_seq,
            limit: r.limit,
            pull_mode: PullMode::from_wire(r.pull_mode),
            reply: tx,
        };
        self.injectors[shard as usize]
            .send(Msg::Sync(Box::new(request)))
            .map_err(|_| Reply::error(503, "the channel's shard is busy; retry"))?;
        let (messages, more) = rx
            .recv_timeout(self.timeout())
            .map_err(|_| Reply::error(504, "read did not finish in time"))?
            .map_err(|e| Reply::error(500, e))?;
        let b64 = base64::engine::general_purpose::STANDARD;
        let list: Vec<Value> = messages
            .iter()
            .map(|m| {
                let channel_id =
                    crate::channel::recv_channel_id(&m.channel_id, m.channel_type, &r.login_uid);
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
                    "payload": b64.encode(&m.payload),
                })
            })
            .collect();
        Ok(Reply::json(
            200,
            json!({
                "start_message_seq": r.start_message_seq,
                "end_message_seq": r.end_message_seq,
                "more": u8::from(more),
                "messages": list,
            }),
        ))
    }

    fn metrics(&self) -> Reply {
        let mut text = String::new();
        let mut totals: Vec<(&'static str, u64)> = Vec::new();
        for m in &self.shared.shard_metrics {
            for (i, (name, v)) in m.snapshot().into_iter().enumerate() {
                if totals.len() <= i {
                    totals.push((name, 0));
                }
                totals[i].1 += v;
            }
        }
        for (name, v) in totals {
            text.push_str(&format!(
                "# TYPE imrouter_{name} counter\nimrouter_{name} {v}\n"
            ));
        }
        for (shard, m) in self.shared.shard_metrics.iter().enumerate() {
            for (name, v) in m.snapshot() {
                text.push_str(&format!("imrouter_shard_{name}{{shard=\"{shard}\"}} {v}\n"));
            }
        }
        // The message path's stage latencies, all shards together.
        let buckets = crate::node::metrics::LATENCY_BUCKETS_NS;
        let names = self.shared.stages[0].named().map(|(name, _)| name);
        for (k, name) in names.iter().enumerate() {
            let mut counts = vec![0u64; buckets.len() + 1];
            let (mut sum_ns, mut count) = (0u64, 0u64);
            for stages in &self.shared.stages {
                let h = stages.named()[k].1;
                for (i, c) in h.buckets.iter().enumerate() {
                    counts[i] += c.get();
                }
                sum_ns += h.sum_ns.get();
                count += h.count.get();
            }
            text.push_str(&format!("# TYPE imrouter_{name}_seconds histogram\n"));
            let mut cumulative = 0;
            for (i, n) in counts.iter().enumerate() {
                cumulative += n;
                let le = buckets
                    .get(i)
                    .map_or("+Inf".to_string(), |ns| format!("{}", *ns as f64 / 1e9));
                text.push_str(&format!(
                    "imrouter_{name}_seconds_bucket{{le=\"{le}\"}} {cumulative}\n"
                ));
            }
            text.push_str(&format!(
                "imrouter_{name}_seconds_sum {}\n",
                sum_ns as f64 / 1e9
            ));
            text.push_str(&format!("imrouter_{name}_seconds_count {count}\n"));
        }
        text.push_str("# TYPE imrouter_routes gauge\n");
        for (slot, n) in self.shared.routes_per_slot.iter().enumerate() {
            let n = n.load(std::sync::atomic::Ordering::Relaxed);
            if n > 0 {
                text.push_str(&format!("imrouter_routes{{hash_slot=\"{slot}\"}} {n}\n"));
            }
        }
        text.push_str("# TYPE imrouter_ring_queued gauge\n");
        let shards = self.shared.slot_map.shard_count() as usize;
        for (i, n) in self.shared.ring_occupancy.iter().enumerate() {
            let (from, to) = (i / shards, i % shards);
            let n = n.load(std::sync::atomic::Ordering::Relaxed);
            text.push_str(&format!(
                "imrouter_ring_queued{{from=\"{from}\",to=\"{to}\"}} {n}\n"
            ));
        }
        Reply {
            status: 200,
            body: text,
            content_type: "text/plain; version=0.0.4",
        }
    }

    fn move_leaders(&self, body: &[u8]) -> Result<Reply, Reply> {
        #[derive(Deserialize)]
        struct Req {
            hash_slots: Vec<u16>,
            leader_node_id: u64,
        }
        let r: Req = parse(body)?;
        if let Some(bad) = r
            .hash_slots
            .iter()
            .find(|&&s| s as usize >= shard::slots::HASH_SLOTS)
        {
            return Err(Reply::error(
                400,
                format!("hash slot {bad} does not exist (0..256)"),
            ));
        }
        let view = self.shared.move_leaders(&r.hash_slots, r.leader_node_id);
        for inj in &self.injectors {
            inj.send(Msg::View(view.clone())).map_err(|_| {
                Reply::error(
                    503,
                    "a shard's control queue is full; the view will be resent",
                )
            })?;
        }
        Ok(self.cluster_slots())
    }

    fn cluster_slots(&self) -> Reply {
        let view = self.shared.view();
        let slots: Vec<Value> = (0..shard::slots::HASH_SLOTS as u16)
            .map(|s| {
                let t = view.target_for_slot(s);
                json!({"hash_slot": s, "slot_id": t.slot_id, "leader_node_id": t.leader_node_id,
                       "leader_term": t.leader_term, "config_epoch": t.config_epoch})
            })
            .collect();
        Reply::json(
            200,
            json!({"config_epoch": view.config_epoch, "revision": view.revision, "slots": slots}),
        )
    }
}

/// The HTTP server: `worker_threads` threads answering with [`Api::handle`].
pub struct HttpServer {
    server: Arc<tiny_http::Server>,
    addr: SocketAddr,
    workers: Vec<JoinHandle<()>>,
}

impl HttpServer {
    /// Binds `addr` and starts the workers.
    pub fn start(api: Api, addr: SocketAddr) -> std::io::Result<HttpServer> {
        let server = tiny_http::Server::http(addr).map_err(std::io::Error::other)?;
        let addr = server
            .server_addr()
            .to_ip()
            .ok_or_else(|| std::io::Error::other("API address is not IP"))?;
        let server = Arc::new(server);
        let workers = (0..api.config.worker_threads.max(1))
            .map(|i| {
                let server = server.clone();
                let api = api.clone();
                std::thread::Builder::new()
                    .name(format!("imrouter-http-{i}"))
                    .spawn(move || serve(&server, &api))
            })
            .collect::<std::io::Result<_>>()?;
        tracing::info!(%addr, "HTTP API up");
        Ok(HttpServer {
            server,
            addr,
            workers,
        })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting and joins the workers.
    pub fn stop(self) {
        self.server.unblock();
        for _ in 1..self.workers.len() {
            self.server.unblock();
        }
        for w in self.workers {
            let _ = w.join();
        }
    }
}

fn serve(server: &tiny_http::Server, api: &Api) {
    while let Ok(mut request) = server.recv() {
        let limit = api.config.max_body_bytes;
        let mut body = Vec::new();
        let read = request
            .as_reader()
            .take(limit as u64 + 1)
            .read_to_end(&mut body);
        let auth = request
            .headers()
            .iter()
            .find(|h| h.field.equiv("Authorization"))
            .map(|h| h.value.as_str().to_owned());
        let reply = match read {
            Err(e) => Reply::error(400, format!("could not read the body: {e}")),
            Ok(_) => api.handle(
                request.method().as_str(),
                request.url(),
                auth.as_deref(),
                &body,
            ),
        };
        if reply.status >= 400 {
            tracing::info!(method = %request.method(), url = request.url(), status = reply.status, body = %reply.body, "API request refused");
        }
        let header =
            tiny_http::Header::from_bytes(&b"Content-Type"[..], reply.content_type.as_bytes())
                .expect("static header is valid");
        let response = tiny_http::Response::from_string(reply.body)
            .with_status_code(reply.status)
            .with_header(header);
        let _ = request.respond(response);
    }
}
