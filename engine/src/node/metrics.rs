//! Per-shard counters: each shard writes only its own (no shared cache line on the
//! data path); `/metrics` sums them.

use std::sync::atomic::{AtomicU64, Ordering};

/// A monotonic counter (or a gauge with `dec`) written by one shard.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    #[inline]
    pub fn inc(&self) {
        self.add(1);
    }

    #[inline]
    pub fn add(&self, n: u64) {
        // One writer per counter: a load and a store, no locked instruction.
        self.0.store(
            self.0.load(Ordering::Relaxed).wrapping_add(n),
            Ordering::Relaxed,
        );
    }

    #[inline]
    pub fn dec(&self) {
        self.0.store(
            self.0.load(Ordering::Relaxed).wrapping_sub(1),
            Ordering::Relaxed,
        );
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// The counters that go down as well as up.
pub const GAUGES: &[&str] = &["connections"];

macro_rules! shard_metrics {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        /// The counters of one shard.
        #[derive(Debug, Default)]
        pub struct ShardMetrics { $($(#[$doc])* pub $name: Counter,)* }

        impl ShardMetrics {
            /// `(name, value)` of every counter.
            pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name.get()),)*]
            }
        }
    };
}

shard_metrics! {
    /// Open client connections (gauge).
    connections,
    /// Sessions activated (CONNACK success).
    activations,
    /// CONNECTs refused (bad token, key, version, activation failure).
    connect_refused,
    /// Sessions kicked or closed by owner actions and device_quit.
    kicks,
    /// Frames that could not be decoded (connection closed).
    bad_frames,
    /// Routes sent in touch batches.
    touches,
    /// Routes expired by the authority.
    expiries,
    /// SENDs accepted by the gateway.
    sends,
    /// SENDs refused by the gateway (msg_key, payload).
    send_refused,
    /// SENDs answered from the idempotency window.
    sends_deduplicated,
    /// RECV frames written.
    recvs,
    /// RECVACKs matched.
    recvacks,
    /// RECVs not tracked for ACK (pending-ACK table full).
    acks_dropped,
    /// RECVs dropped after their last re-send.
    acks_expired,
    /// Endpoints whose owner revalidation failed.
    push_stale,
    /// Endpoints on other nodes (not delivered until the cluster milestone).
    push_remote_dropped,
    /// Lookup groups refused as stale or not-leader.
    stale_lookups,
    /// Cross-shard messages dropped on a full ring.
    ring_full_drops,
    /// Authority calls refused as stale-target or not-leader.
    authority_stale_refusals,
}

/// Upper bounds (µs) of the RECV latency histogram buckets; the last bucket is +Inf.
pub const RECV_LATENCY_BUCKETS_US: [u64; 12] = [
    10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 50_000, 250_000,
];

/// Commit → RECV written (queued on the socket), per shard, Prometheus-style
/// cumulative buckets are derived when exported.
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    /// `buckets[i]` counts observations in `(bound[i-1], bound[i]]`; the last is +Inf.
    pub buckets: [Counter; RECV_LATENCY_BUCKETS_US.len() + 1],
    pub sum_us: Counter,
    pub count: Counter,
}

impl LatencyHistogram {
    /// Records one observation.
    #[inline]
    pub fn observe_us(&self, us: u64) {
        let i = RECV_LATENCY_BUCKETS_US
            .iter()
            .position(|&b| us <= b)
            .unwrap_or(RECV_LATENCY_BUCKETS_US.len());
        self.buckets[i].inc();
        self.sum_us.add(us);
        self.count.inc();
    }
}
