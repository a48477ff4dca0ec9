//! The HTTP API's section of the configuration (`[api]`, and the tokens of
//! `[auth]`).

use std::net::SocketAddr;

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
    pub bearer_token: Option<crate::config::values::Secret>,
    /// Required as `Authorization: Bearer <token>` on the operator's routes
    /// ([`Api::is_admin`]) instead of `bearer_token`. Without one those routes
    /// answer 403 when `bearer_token` is set (open when neither is: a node in
    /// development). Set from `[auth] admin_token`.
    #[serde(skip)]
    pub admin_token: Option<crate::config::values::Secret>,
    /// Largest request body (413 over it, checked after the bearer token).
    pub body_bytes_max: usize,
    /// Most uids in one request (onlinestatus, subscribers).
    pub uids_per_request_max: usize,
    /// How long a request waits for a shard's answer.
    pub shard_reply_timeout_ms: u64,
    /// Threads of the API's async runtime (accepting, parsing, /healthz, /readyz,
    /// /metrics).
    pub worker_threads: usize,
    /// Threads that run the metadata store's writes (journal and fsync: tokens,
    /// subscribers) for the API. A request waits for one in the queue (up to
    /// `queue_timeout_ms`); waits on a shard or another node hold no thread.
    pub blocking_threads: usize,
    /// Requests that may be waiting at once (on a shard, the metadata store, a
    /// place on the blocking pool or another node); over it a request gets 503 at
    /// once. Routes that answer from memory do not count.
    pub waiting_requests_max: usize,
    /// How long a request waits in the queue for a place (a thread of the blocking
    /// pool, a connection to the node it is passed to); past it 503.
    pub queue_timeout_ms: u64,
    /// Open API connections; at the cap the oldest idle one is closed for a new one,
    /// and with none idle the new one gets 503 and is closed.
    pub connections_max: usize,
    /// A connection must send a whole request head within this long of being accepted
    /// or of its previous answer (the idle keep-alive timeout too).
    pub header_read_timeout_ms: u64,
    /// A request's body read and its answer produced within this long (else 408).
    pub request_timeout_ms: u64,
    /// A connection whose client accepts no byte of its answer for this long is
    /// closed (a client that does not read holds no place for ever).
    pub answer_write_timeout_ms: u64,
    /// Largest `/channel/messagesync` answer: messages stop before the one that would
    /// pass it (`more` is then 1). A single larger message is still sent alone.
    pub sync_response_bytes_max: usize,
    /// A request homed on another node (or a share of one asked of another node) is
    /// passed to that node's API on the inter-node link and must be answered within
    /// this long (the request's deadline on the link); else 503 naming the node.
    /// Above `shard_reply_timeout_ms` (the home's own wait on its shards), so a
    /// slow commit at the home is answered by the home, not taken for an
    /// unreachable node.
    pub forward_timeout_ms: u64,
    /// Largest answer body taken from another node's API (502 over it). An answer
    /// comes back in one inter-node frame, so `[rpc] rpc_frame_bytes_max` bounds it
    /// too (a `messagesync` for another node stops at half a frame, `more` set).
    pub forward_answer_bytes_max: usize,
    /// Requests in flight to one other node's API at once; more wait for a place
    /// (up to `queue_timeout_ms`).
    pub forward_connections_per_peer: usize,
    /// Forwards in a row to one node that got no answer (unreachable, timed out)
    /// before forwards to it fail at once (503 naming it) for
    /// `forward_breaker_cooldown_ms`; then one is let through, and its answer
    /// closes the breaker.
    pub forward_breaker_failures: u32,
    /// How long forwards to a node fail at once once its breaker opened.
    pub forward_breaker_cooldown_ms: u64,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            addr: Some(SocketAddr::from(([127, 0, 0, 1], 5001))),
            bearer_token: None,
            admin_token: None,
            body_bytes_max: 1 << 20,
            uids_per_request_max: 10_000,
            shard_reply_timeout_ms: 5_000,
            worker_threads: 1,
            blocking_threads: 8,
            waiting_requests_max: 4_096,
            queue_timeout_ms: 5_000,
            connections_max: 256,
            header_read_timeout_ms: 10_000,
            request_timeout_ms: 15_000,
            answer_write_timeout_ms: 15_000,
            sync_response_bytes_max: 8 << 20,
            forward_timeout_ms: 6_000,
            forward_answer_bytes_max: 16 << 20,
            forward_connections_per_peer: 64,
            forward_breaker_failures: 5,
            forward_breaker_cooldown_ms: 5_000,
        }
    }
}

impl ApiConfig {
    /// Refuses limits that cannot work.
    pub fn validate(&self) -> Result<(), String> {
        if self.worker_threads == 0
            || self.blocking_threads == 0
            || self.connections_max == 0
            || self.header_read_timeout_ms == 0
            || self.request_timeout_ms == 0
            || self.answer_write_timeout_ms == 0
            || self.sync_response_bytes_max == 0
            || self.forward_timeout_ms == 0
            || self.forward_answer_bytes_max == 0
            || self.waiting_requests_max == 0
            || self.queue_timeout_ms == 0
            || self.forward_connections_per_peer == 0
            || self.forward_breaker_failures == 0
            || self.forward_breaker_cooldown_ms == 0
        {
            return Err("api: worker_threads, blocking_threads, connections_max, \
                 header_read_timeout_ms, request_timeout_ms, answer_write_timeout_ms, \
                 sync_response_bytes_max, forward_timeout_ms, forward_answer_bytes_max, \
                 waiting_requests_max, queue_timeout_ms, forward_connections_per_peer, \
                 forward_breaker_failures and forward_breaker_cooldown_ms must be at least 1"
                .into());
        }
        Ok(())
    }
}
