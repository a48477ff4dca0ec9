//! `/metrics` in the Prometheus text exposition format (0.0.4): every family has a
//! `# HELP` and a `# TYPE` line, counters end in `_total`, gauges are typed `gauge`.
//! The families come from data: [`ShardMetrics::DESCRIPTIONS`] (the fields' doc
//! comments) with [`GAUGES`], the stage histograms with [`STAGE_HELP`], and the
//! API's own counters in [`ApiMetrics`].

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::node::metrics::{
    ShardMetrics, GAUGES, LATENCY_BUCKETS_NS, MAX_GAUGES, MIN_GAUGES, STAGE_HELP,
};
use crate::node::shared::NodeShared;

use super::metrics::ApiMetrics;

/// Writes one family after another; each family's HELP and TYPE come first.
struct Exposition {
    text: String,
}

impl Exposition {
    fn family(&mut self, name: &str, ty: &str, help: &str) {
        // HELP text escapes: backslash and newline.
        let help = help.trim().replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(self.text, "# HELP {name} {help}\n# TYPE {name} {ty}");
    }

    fn sample(&mut self, name: &str, labels: &str, value: impl std::fmt::Display) {
        if labels.is_empty() {
            let _ = writeln!(self.text, "{name} {value}");
        } else {
            let _ = writeln!(self.text, "{name}{{{labels}}} {value}");
        }
    }
}

/// A shard counter exported as one series of a labelled family.
struct Labelled {
    field: &'static str,
    family: &'static str,
    ty: &'static str,
    labels: &'static str,
    help: &'static str,
}

const ACCEPTS_HELP: &str = "Client connections accepted, by listener.";
const REFUSED_HELP: &str = "Client connections accepted and reset at once, by listener and \
     reason: conn_cap (the shard was at its connection cap), fd_limit (out of descriptors: \
     accepted with the spare one), other (other accept errors).";
const PAUSES_HELP: &str =
    "Failed accept rounds that paused a client listener (backoff from [net] accept_backoff_initial_ms doubling to accept_backoff_ms_max).";
const SKIPPED_HELP: &str = "Pushes a delivery skipped, their online recipients getting the message by sync only: lookup_failed and rebuilding count target groups (a page's recipients of one hash slot) whose route lookup failed for good or whose authority was still rebuilding after [delivery] rebuild_wait_ms_max; link_down counts endpoints on a node whose link was down.";
const PAUSED_HELP: &str = "Shards whose client listener is paused after failed accepts.";

macro_rules! labelled {
    ($field:literal, $family:literal, $ty:literal, $labels:literal, $help:expr) => {
        Labelled {
            field: $field,
            family: $family,
            ty: $ty,
            labels: $labels,
            help: $help,
        }
    };
}

/// The listener counters of [`ShardMetrics`], as Prometheus families with labels.
const LISTENER_FAMILIES: &[Labelled] = &[
    labelled!(
        "accepts_tcp",
        "imrouter_accepts_total",
        "counter",
        "listener=\"tcp\"",
        ACCEPTS_HELP
    ),
    labelled!(
        "accepts_ws",
        "imrouter_accepts_total",
        "counter",
        "listener=\"ws\"",
        ACCEPTS_HELP
    ),
    labelled!(
        "accept_refused_conn_cap_tcp",
        "imrouter_accept_refused_total",
        "counter",
        "listener=\"tcp\",reason=\"conn_cap\"",
        REFUSED_HELP
    ),
    labelled!(
        "accept_refused_conn_cap_ws",
        "imrouter_accept_refused_total",
        "counter",
        "listener=\"ws\",reason=\"conn_cap\"",
        REFUSED_HELP
    ),
    labelled!(
        "accept_refused_fd_limit_tcp",
        "imrouter_accept_refused_total",
        "counter",
        "listener=\"tcp\",reason=\"fd_limit\"",
        REFUSED_HELP
    ),
    labelled!(
        "accept_refused_fd_limit_ws",
        "imrouter_accept_refused_total",
        "counter",
        "listener=\"ws\",reason=\"fd_limit\"",
        REFUSED_HELP
    ),
    labelled!(
        "accept_refused_other_tcp",
        "imrouter_accept_refused_total",
        "counter",
        "listener=\"tcp\",reason=\"other\"",
        REFUSED_HELP
    ),
    labelled!(
        "accept_refused_other_ws",
        "imrouter_accept_refused_total",
        "counter",
        "listener=\"ws\",reason=\"other\"",
        REFUSED_HELP
    ),
    labelled!(
        "accept_pauses_tcp",
        "imrouter_accept_pauses_total",
        "counter",
        "listener=\"tcp\"",
        PAUSES_HELP
    ),
    labelled!(
        "accept_pauses_ws",
        "imrouter_accept_pauses_total",
        "counter",
        "listener=\"ws\"",
        PAUSES_HELP
    ),
    labelled!(
        "listener_paused_tcp",
        "imrouter_listener_paused",
        "gauge",
        "listener=\"tcp\"",
        PAUSED_HELP
    ),
    labelled!(
        "listener_paused_ws",
        "imrouter_listener_paused",
        "gauge",
        "listener=\"ws\"",
        PAUSED_HELP
    ),
    labelled!(
        "pushes_skipped_lookup_failed",
        "imrouter_pushes_skipped_total",
        "counter",
        "reason=\"lookup_failed\"",
        SKIPPED_HELP
    ),
    labelled!(
        "pushes_skipped_rebuilding",
        "imrouter_pushes_skipped_total",
        "counter",
        "reason=\"rebuilding\"",
        SKIPPED_HELP
    ),
    labelled!(
        "pushes_skipped_link_down",
        "imrouter_pushes_skipped_total",
        "counter",
        "reason=\"link_down\"",
        SKIPPED_HELP
    ),
];

/// The exported name of a shard metric: gauges as they are, counters with `_total`.
fn shard_metric_name(prefix: &str, name: &str) -> (String, &'static str) {
    if GAUGES.contains(&name) {
        (format!("{prefix}{name}"), "gauge")
    } else {
        (format!("{prefix}{name}_total"), "counter")
    }
}

/// The API's single-series families: name, type, help and the counter or gauge.
type ApiFamily = (
    &'static str,
    &'static str,
    &'static str,
    fn(&ApiMetrics) -> &AtomicU64,
);

/// [`ApiMetrics`] besides `requests`, in the order they are exported.
const API_FAMILIES: &[ApiFamily] = &[
    (
        "imrouter_api_accept_errors_total",
        "counter",
        "HTTP API accept failures; those of the process (EMFILE, ENFILE, ENOBUFS, ENOMEM, ...) pause accepting (5 ms doubling to 1 s).",
        |a| &a.accept_errors,
    ),
    (
        "imrouter_api_connections_refused_total",
        "counter",
        "HTTP API connections refused at connections_max with none idle (503, closed).",
        |a| &a.connections_refused,
    ),
    (
        "imrouter_api_connections_evicted_total",
        "counter",
        "Idle HTTP API connections closed to admit a new one at connections_max.",
        |a| &a.connections_evicted,
    ),
    (
        "imrouter_api_panics_total",
        "counter",
        "HTTP API handlers that panicked (answered 500).",
        |a| &a.panics,
    ),
    (
        "imrouter_api_pool_refusals_total",
        "counter",
        "HTTP API requests refused (503) because waiting_requests_max were waiting already or no thread of the blocking pool freed within queue_timeout_ms.",
        |a| &a.pool_refusals,
    ),
    (
        "imrouter_api_write_timeouts_total",
        "counter",
        "HTTP API connections closed because their client accepted no byte of an answer for answer_write_timeout_ms.",
        |a| &a.write_timeouts,
    ),
    (
        "imrouter_api_forwards_total",
        "counter",
        "HTTP API requests (or a node's share of one) passed to another node's API: homed there, its authority's onlinestatus share, device_quit on every node.",
        |a| &a.forwards,
    ),
    (
        "imrouter_api_forward_failures_total",
        "counter",
        "Of imrouter_api_forwards_total, those that got no usable answer (unreachable or silent for forward_timeout_ms: 503; a bad answer: 502).",
        |a| &a.forward_failures,
    ),
    (
        "imrouter_api_forwards_refused_total",
        "counter",
        "HTTP API forwards refused (503) without asking the node: its breaker was open (forward_breaker_failures in a row got no answer), or no place to it (forward_connections_per_peer) freed within queue_timeout_ms.",
        |a| &a.forwards_refused,
    ),
    (
        "imrouter_api_peer_requests_refused_total",
        "counter",
        "Other nodes' API requests (passed on the link) answered 503 at once: this node's queue of them (waiting_requests_max) was full, or it runs no API.",
        |a| &a.peer_requests_refused,
    ),
    (
        "imrouter_api_peer_answers_dropped_total",
        "counter",
        "Answers to other nodes' API requests dropped before the link: the shard that read the request had no room in its queue (the asking node fails it at its deadline).",
        |a| &a.peer_answers_dropped,
    ),
    (
        "imrouter_api_reads_not_leader_total",
        "counter",
        "messagesync reads answered 503: no leader of the channel's replicated group served here (an election, a hand-over, a leader cut off from its quorum).",
        |a| &a.reads_not_leader,
    ),
    (
        "imrouter_api_reads_busy_total",
        "counter",
        "messagesync reads answered 503: [commit] reads_waiting_max reads waited for their ReadIndex on the channel's shard.",
        |a| &a.reads_busy,
    ),
    (
        "imrouter_api_connections",
        "gauge",
        "Open HTTP API connections.",
        |a| &a.connections,
    ),
    (
        "imrouter_api_requests_in_progress",
        "gauge",
        "HTTP API requests whose answer is not yet fully written.",
        |a| &a.requests_in_progress,
    ),
    (
        "imrouter_api_blocking_in_use",
        "gauge",
        "HTTP API requests holding a place of the blocking pool (blocking_threads).",
        |a| &a.blocking_in_use,
    ),
    (
        "imrouter_api_requests_waiting",
        "gauge",
        "HTTP API requests waiting on a shard, the metadata store, a place or another node (at most waiting_requests_max).",
        |a| &a.requests_waiting,
    ),
];

/// The whole `/metrics` text of a node.
pub fn render(shared: &NodeShared) -> String {
    let mut out = Exposition {
        text: String::with_capacity(16 << 10),
    };
    let snapshots: Vec<Vec<(&'static str, u64)>> =
        shared.shard_metrics.iter().map(|m| m.snapshot()).collect();
    out.shard_counters(&snapshots);
    out.listener_counters(&snapshots);
    out.descriptors(shared);
    out.stage_histograms(shared);
    out.routes_and_rings(shared);
    out.api(&shared.api_metrics);
    out.webhooks(&shared.webhooks);
    if let Some(tls) = &shared.config.tls {
        out.tls(tls);
    }
    out.text
}

impl Exposition {
    /// Shard counters: the node's total, then one series per shard (the listener
    /// counters are exported by [`Exposition::listener_counters`] instead).
    fn shard_counters(&mut self, snapshots: &[Vec<(&'static str, u64)>]) {
        let labelled = |name: &str| LISTENER_FAMILIES.iter().any(|f| f.field == name);
        for (i, (name, help)) in ShardMetrics::DESCRIPTIONS.iter().enumerate() {
            if labelled(name) {
                continue;
            }
            let (full, ty) = shard_metric_name("imrouter_", name);
            self.family(&full, ty, help);
            let shards = snapshots.iter().map(|s| s[i].1);
            let total: u64 = if MAX_GAUGES.contains(name) {
                shards.max().unwrap_or(0)
            } else if MIN_GAUGES.contains(name) {
                shards.min().unwrap_or(0)
            } else {
                shards.sum()
            };
            self.sample(&full, "", total);
        }
        for (i, (name, help)) in ShardMetrics::DESCRIPTIONS.iter().enumerate() {
            if labelled(name) {
                continue;
            }
            let (full, ty) = shard_metric_name("imrouter_shard_", name);
            self.family(&full, ty, &format!("{} Per shard.", help.trim()));
            for (shard, s) in snapshots.iter().enumerate() {
                self.sample(&full, &format!("shard=\"{shard}\""), s[i].1);
            }
        }
    }

    /// Accepts by listener (and refusals by reason), summed over shards.
    fn listener_counters(&mut self, snapshots: &[Vec<(&'static str, u64)>]) {
        let mut family_done: Vec<&str> = Vec::new();
        for f in LISTENER_FAMILIES {
            let Some(i) = ShardMetrics::DESCRIPTIONS
                .iter()
                .position(|(n, _)| *n == f.field)
            else {
                continue;
            };
            if !family_done.contains(&f.family) {
                family_done.push(f.family);
                self.family(f.family, f.ty, f.help);
            }
            let total: u64 = snapshots.iter().map(|s| s[i].1).sum();
            self.sample(f.family, f.labels, total);
        }
    }

    /// The descriptor limit the connection caps came from, and the descriptors open
    /// (left out where `/proc/self/fd` cannot be read).
    fn descriptors(&mut self, shared: &NodeShared) {
        self.family(
            "imrouter_fd_limit",
            "gauge",
            "The process's soft RLIMIT_NOFILE, which the connection caps were computed from.",
        );
        self.sample("imrouter_fd_limit", "", shared.fd_budget.limit);
        if let Some(open) = shared.open_fds() {
            self.family(
                "imrouter_open_fds",
                "gauge",
                "File descriptors the process has open.",
            );
            self.sample("imrouter_open_fds", "", open);
        }
    }

    /// The message path's stage latencies, all shards together, as histograms in
    /// seconds.
    fn stage_histograms(&mut self, shared: &NodeShared) {
        let buckets = LATENCY_BUCKETS_NS;
        let names = shared.stages[0].named().map(|(name, _)| name);
        for (k, name) in names.iter().enumerate() {
            let mut counts = vec![0u64; buckets.len() + 1];
            let (mut sum_ns, mut count) = (0u64, 0u64);
            for stages in &shared.stages {
                let h = stages.named()[k].1;
                for (i, c) in h.buckets.iter().enumerate() {
                    counts[i] += c.get();
                }
                sum_ns += h.sum_ns.get();
                count += h.count.get();
            }
            let help = STAGE_HELP
                .iter()
                .find(|(n, _)| n == name)
                .map_or("A stage of the message path.", |(_, h)| h);
            let family = format!("imrouter_{name}_seconds");
            self.family(&family, "histogram", help);
            let mut cumulative = 0;
            for (i, n) in counts.iter().enumerate() {
                cumulative += n;
                let le = buckets
                    .get(i)
                    .map_or("+Inf".to_string(), |ns| format!("{}", *ns as f64 / 1e9));
                self.sample(
                    &format!("{family}_bucket"),
                    &format!("le=\"{le}\""),
                    cumulative,
                );
            }
            self.sample(&format!("{family}_sum"), "", sum_ns as f64 / 1e9);
            self.sample(&format!("{family}_count"), "", count);
        }
    }

    /// Active routes per hash slot (slots with none left out) and the occupancy of
    /// every shard-to-shard ring.
    fn routes_and_rings(&mut self, shared: &NodeShared) {
        self.family(
            "imrouter_routes",
            "gauge",
            "Active routes per hash slot (slots with none are left out).",
        );
        for (slot, n) in shared.routes_per_slot.iter().enumerate() {
            let n = n.load(Ordering::Relaxed);
            if n > 0 {
                self.sample("imrouter_routes", &format!("hash_slot=\"{slot}\""), n);
            }
        }
        self.family(
            "imrouter_ring_queued",
            "gauge",
            "Messages queued on the ring from one shard to another, sampled every expiry pass.",
        );
        let shards = shared.slot_map.shard_count() as usize;
        for (i, n) in shared.ring_occupancy.iter().enumerate() {
            let (from, to) = (i / shards, i % shards);
            let n = n.load(Ordering::Relaxed);
            self.sample(
                "imrouter_ring_queued",
                &format!("from=\"{from}\",to=\"{to}\""),
                n,
            );
        }
    }

    /// The webhooks' counters and queue gauges, by event (every event, sent or
    /// not: the series stay put when the configuration changes).
    fn webhooks(&mut self, sink: &crate::webhook::WebhookSink) {
        type Read = fn(&crate::webhook::KindStats) -> u64;
        let families: [(&str, &str, &str, Read); 6] = [
            ("imrouter_webhook_sent_total", "counter", "Webhook events the receiver accepted (2xx), by event.", |s| s.sent.load(Ordering::Relaxed)),
            ("imrouter_webhook_failed_total", "counter", "Webhook requests that failed (no 2xx in [webhook] timeout_ms, or no connection), by event; each is retried after a capped exponential backoff.", |s| s.failed.load(Ordering::Relaxed)),
            ("imrouter_webhook_dropped_total", "counter", "Webhook events dropped, by event: their queue was at [webhook] queue_bytes_max (a slow or unreachable receiver).", |s| s.dropped.load(Ordering::Relaxed)),
            ("imrouter_webhook_deduplicated_total", "counter", "Webhook events not queued, by event: their message id was accepted before.", |s| s.deduplicated.load(Ordering::Relaxed)),
            ("imrouter_webhook_queued", "gauge", "Webhook events queued or in flight (retries included), by event.", |s| s.queued.load(Ordering::Relaxed)),
            ("imrouter_webhook_queued_bytes", "gauge", "Bytes of webhook events queued, in flight or on their way from the shards, by event (bounded by [webhook] queue_bytes_max).", |s| s.bytes() as u64),
        ];
        for (name, ty, help, read) in families {
            self.family(name, ty, help);
            for kind in domain::webhook::EventKind::ALL {
                let labels = format!("event=\"{}\"", kind.name());
                self.sample(name, &labels, read(&sink.stats[kind.index()]));
            }
        }
        // msg.notify's cursor over the message logs (0 while it is not sent).
        type ReadNotify = fn(&crate::webhook::notify::NotifyStats) -> u64;
        let notify: [(&str, &str, &str, ReadNotify); 3] = [
            ("imrouter_webhook_notify_cursor_writes_total", "counter", "msg.notify cursor files written (DATA_DIR/webhook_notify_cursor.json, at most every [webhook] notify_cursor_interval_ms).", |s| s.cursor_writes.load(Ordering::Relaxed)),
            ("imrouter_webhook_notify_saved", "gauge", "msg.notify messages read since the start that the cursor last written has passed (accepted, or dropped): a restart does not send them again.", |s| s.saved.load(Ordering::Relaxed)),
            ("imrouter_webhook_notify_skipped_total", "counter", "Ranges of a message log msg.notify skipped: deleted by the log's retention before they were sent (their messages are not sent).", |s| s.skipped.load(Ordering::Relaxed)),
        ];
        let zero = crate::webhook::notify::NotifyStats::default();
        let stats = sink.notify().map_or(&zero, |n| &n.stats);
        for (name, ty, help, read) in notify {
            self.family(name, ty, help);
            self.sample(name, "", read(stats));
        }
    }

    /// The `wss://` listener's certificate expiry and counters (with `[listen]
    /// wss_addr` only).
    fn tls(&mut self, tls: &net::io::TlsServer) {
        let c = tls.counters();
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let name = "imrouter_tls_cert_expiry_seconds";
        self.family(name, "gauge", "Seconds until the presented wss certificate's notAfter (negative once expired); a SIGHUP reload resets it.");
        self.sample(
            name,
            "",
            tls.expires_in_s(crate::config::values::unix_now()),
        );
        let name = "imrouter_tls_handshakes_total";
        self.family(
            name,
            "counter",
            "TLS handshakes completed on the wss listener.",
        );
        self.sample(name, "", get(&c.handshakes));
        let name = "imrouter_tls_failures_total";
        self.family(name, "counter", "wss connections closed for bad TLS input (garbage records, a failed handshake, a handshake over [tls] handshake_bytes_max).");
        self.sample(name, "", get(&c.failures));
        let name = "imrouter_tls_reloads_total";
        self.family(name, "counter", "Certificate reloads (SIGHUP), by result: ok, or failed (the files did not load; the old certificate stays).");
        self.sample(name, "result=\"ok\"", get(&c.reloads));
        self.sample(name, "result=\"failed\"", get(&c.reload_failures));
    }

    /// The HTTP API's own counters and gauges.
    fn api(&mut self, api: &ApiMetrics) {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        self.family(
            "imrouter_api_requests_total",
            "counter",
            "HTTP API answers by status class.",
        );
        for (i, c) in api.requests.iter().enumerate() {
            self.sample(
                "imrouter_api_requests_total",
                &format!("class=\"{}xx\"", i + 1),
                get(c),
            );
        }
        for (name, ty, help, counter) in API_FAMILIES {
            self.family(name, ty, help);
            self.sample(name, "", get(counter(api)));
        }
    }
}
