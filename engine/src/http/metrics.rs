//! The HTTP API's own counters (`imrouter_api_*` in `/metrics`).

use std::sync::atomic::{AtomicU64, Ordering};

/// The HTTP API's counters, written by any of its threads.
#[derive(Debug, Default)]
pub struct ApiMetrics {
    /// Answers by status class: `[1xx, 2xx, 3xx, 4xx, 5xx]`.
    pub requests: [AtomicU64; 5],
    /// `accept` failures; those of the process (EMFILE, ENFILE, ENOBUFS, ENOMEM, …)
    /// are each followed by a backoff.
    pub accept_errors: AtomicU64,
    /// New connections refused (503, closed) at `connections_max` with none idle.
    pub connections_refused: AtomicU64,
    /// Idle connections closed to make room for a new one at `connections_max`.
    pub connections_evicted: AtomicU64,
    /// Handlers that panicked (answered 500).
    pub panics: AtomicU64,
    /// Requests refused (503) because `waiting_requests_max` were waiting already
    /// or no thread of the blocking pool freed within `queue_timeout_ms`.
    pub pool_refusals: AtomicU64,
    /// Connections closed because their client accepted no byte of an answer for
    /// `answer_write_timeout_ms`.
    pub write_timeouts: AtomicU64,
    /// Open API connections.
    pub connections: AtomicU64,
    /// Requests whose answer is not yet fully written.
    pub requests_in_progress: AtomicU64,
    /// Requests holding a place of the blocking pool.
    pub blocking_in_use: AtomicU64,
    /// Requests (or shares of one) passed to another node's API.
    pub forwards: AtomicU64,
    /// Of those, the ones that got no usable answer (unreachable, timed out, a bad
    /// answer).
    pub forward_failures: AtomicU64,
    /// Forwards refused without asking the node: its breaker was open, or no
    /// place to it freed within `queue_timeout_ms`.
    pub forwards_refused: AtomicU64,
    /// Requests waiting (on a shard, the metadata store, a place or another node).
    pub requests_waiting: AtomicU64,
    /// Other nodes' API requests (the hop `Api`) answered 503 at once: this node's
    /// queue of them (`waiting_requests_max`) was full, or it runs no API.
    pub peer_requests_refused: AtomicU64,
    /// Answers to other nodes' API requests dropped: the shard whose link read the
    /// request had no room in its queue (the asker fails it at its deadline).
    pub peer_answers_dropped: AtomicU64,
    /// `/channel/messagesync` reads answered 503 because no leader of the
    /// channel's replicated group served here (an election, a hand-over, a
    /// leader cut off from its quorum).
    pub reads_not_leader: AtomicU64,
    /// `/channel/messagesync` reads answered 503 because `[commit]
    /// reads_waiting_max` reads waited on the channel's shard.
    pub reads_busy: AtomicU64,
}

impl ApiMetrics {
    /// Counts one answer of `status`.
    pub fn count_status(&self, status: u16) {
        let class = (status / 100).clamp(1, 5) as usize - 1;
        self.requests[class].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}
