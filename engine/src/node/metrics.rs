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

    /// Sets a counter mirrored from another owner's count (the IO driver's); no
    /// store when it did not change.
    #[inline]
    pub fn set(&self, v: u64) {
        if self.0.load(Ordering::Relaxed) != v {
            self.0.store(v, Ordering::Relaxed);
        }
    }
}

/// The counters that go down as well as up.
pub const GAUGES: &[&str] = &[
    "connections",
    "log_write_failed",
    "listener_paused_tcp",
    "listener_paused_ws",
    "outbound_bytes",
    "pending_ack_bytes",
    "raft_groups",
    "raft_groups_led",
    "route_rebuild_queued",
    "route_rebuild_last_ms",
    "view_revision",
];

/// The gauges whose node series is the largest shard's value, not the sum.
pub const MAX_GAUGES: &[&str] = &["route_rebuild_last_ms"];

/// The gauges whose node series is the smallest shard's value, not the sum.
pub const MIN_GAUGES: &[&str] = &["view_revision"];

macro_rules! shard_metrics {
    ($($(#[doc = $doc:literal])* $name:ident),* $(,)?) => {
        /// The counters of one shard.
        #[derive(Debug, Default)]
        pub struct ShardMetrics { $($(#[doc = $doc])* pub $name: Counter,)* }

        impl ShardMetrics {
            /// `(name, help)` of every counter, in [`ShardMetrics::snapshot`] order: the
            /// help is the field's doc comment (the `# HELP` line of `/metrics`).
            pub const DESCRIPTIONS: &'static [(&'static str, &'static str)] =
                &[$((stringify!($name), concat!($($doc),*)),)*];

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
    /// Sessions told (DISCONNECT 12) and closed because their authority refused
    /// their route for good on a touch (a newer login of the device elsewhere, or
    /// an unregister): without it they would stay connected and receive nothing.
    sessions_superseded,
    /// Frames that could not be decoded (connection closed).
    bad_frames,
    /// Routes sent in touch batches.
    touches,
    /// Routes expired by the authority.
    expiries,
    /// SENDs accepted by the gateway.
    sends,
    /// SENDs refused by the gateway (channel id or type, msg_key, payload).
    send_refused,
    /// SENDs refused with RateLimit: over `new_channels_per_conn_per_s`.
    sends_rate_limited,
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
    /// What the shard's unacknowledged RECVs are charged against
    /// `pending_acks_budget_bytes_per_shard` (gauge).
    pending_ack_bytes,
    /// Raft messages of peers dropped: for a group this shard does not hold, or
    /// refused by it.
    raft_messages_dropped,
    /// Replicas of slot ids' groups on this shard (`[cluster] replicas` above 1;
    /// gauge).
    raft_groups,
    /// Of `raft_groups`, those whose group this replica leads (gauge).
    raft_groups_led,
    /// Replicas that left their group because a write of theirs failed (a disk
    /// error): they no longer vote.
    raft_replicas_failed,
    /// Snapshots a leader here was due to send to a follower behind the entries
    /// it keeps (`[cluster] raft_entries_retained`) and did not (catch-up is not
    /// built): that follower waits.
    raft_snapshots_refused,
    /// Slot ids this node's replicas claimed as their groups' new serving leaders
    /// (an election or a hand-over: each moves the slot id's hash slots here).
    raft_claims,
    /// Committed catalog changes (tokens, subscribers) this node's store refused
    /// to apply (a limit of this node's `[meta]` below the leader's, a disk error):
    /// this replica's catalog differs from its group's until a later change.
    catalog_applies_failed,
    /// Endpoints not written: their owner's revalidation failed, or they name a
    /// shard this node does not have (dropped when planned).
    push_stale,
    /// Endpoints on other nodes whose owner push could not be sent (the link to that
    /// node was down).
    push_remote_dropped,
    /// Route lookup groups that failed for good (refused as stale or not-leader,
    /// or their remote lookup failed) after any retry: their online recipients
    /// get the message by sync only.
    stale_lookups,
    /// Route lookup groups looked up again at the leader the current view names
    /// (a slot moved while their page was planned; `[delivery]
    /// lookup_retries_max`).
    lookup_groups_retried,
    /// Route lookup groups looked up again because their authority was
    /// rebuilding (waiting for a moved slot's handover) or did not lead the slot
    /// yet (`[delivery] rebuild_retry_interval_ms`).
    lookup_rebuild_retries,
    /// `imrouter_pushes_skipped_total{reason="lookup_failed"}`: target groups
    /// (a page's recipients of one hash slot) whose route lookup failed for good.
    pushes_skipped_lookup_failed,
    /// `imrouter_pushes_skipped_total{reason="rebuilding"}`: target groups whose
    /// authority was still rebuilding after `[delivery] rebuild_wait_ms_max`.
    pushes_skipped_rebuilding,
    /// `imrouter_pushes_skipped_total{reason="link_down"}`: endpoints on another
    /// node whose push could not be sent (the link to it was down).
    pushes_skipped_link_down,
    /// Handover batches sent: the routes of a hash slot this node lost, to its
    /// new leader.
    handover_batches_sent,
    /// Handover batches that got no answer (link down, deadline, peer
    /// restarted): the new leader serves after `[authority] handover_wait_s`.
    handover_batches_lost,
    /// Handover batches the new leader refused (it leads a newer identity of the
    /// slot, or had no room to keep a batch that came before its view).
    handover_batches_refused,
    /// Routes applied from handovers of hash slots this node gained.
    handover_routes,
    /// Waits for a handover that ended at `[authority] handover_wait_s`, or at
    /// once because the old leader was unreachable, rather than with the
    /// handover.
    handover_waits_expired,
    /// Handovers of slots lost while they still waited for their own, sent once
    /// it came (or the wait ran out).
    handovers_relayed,
    /// Handover batches that came when their slot no longer waited (not applied).
    handovers_ignored,
    /// Inter-node connections refused or closed for a protocol fault: a failed
    /// handshake (wrong secret, unknown node), bytes that are not frames.
    rpc_refused,
    /// Of `rpc_refused`, handshakes refused because the peer is of another cluster
    /// (`[cluster] id`); the log line names both ids.
    rpc_refused_other_cluster,
    /// Of `rpc_refused`, handshakes refused because the peer groups the hash slots
    /// into another number of slot ids (`[cluster] slot_ids`); the log line names
    /// both counts.
    rpc_refused_other_slot_ids,
    /// Inter-node links closed for a frame whose body does not decode as its kind,
    /// or holds a field no node of this cluster sends (a hash slot past 255, a route
    /// of another node than the sender registered or touched, an owner action for
    /// a shard this process does not have, a view that does not fit the cluster's
    /// config).
    rpc_bad_frames,
    /// Inter-node links closed because a frame after the handshake failed
    /// authentication (altered on the way, replayed, reordered, or not sealed with
    /// the link's key); the log line names the frame's kind and counter.
    rpc_auth_failures,
    /// Outbound inter-node links that closed (each fails its requests in flight).
    rpc_link_closes,
    /// Replies to another node's requests not sent because the requesting process
    /// is gone (the peer restarted since it asked) or the link refused the frame
    /// (the request fails at its deadline there).
    rpc_replies_dropped,
    /// Replies held because the link to their requester was not up (a peer that
    /// restarted and asked before this node dialed it back): each is then sent
    /// (`rpc_replies_released`), dropped at its request's deadline
    /// (`rpc_replies_expired`) or dropped for a requesting process that is gone.
    rpc_replies_held,
    /// Held replies sent once the link to their requester came up.
    rpc_replies_released,
    /// Replies not held because the link's held replies were at `[rpc]
    /// rpc_replies_held_max` or `rpc_replies_held_bytes_max` (the request fails at
    /// its deadline there).
    rpc_replies_held_full,
    /// Replies to another node's requests not sent because the request's deadline
    /// had passed (or would before the reply got back, `[rpc] rpc_reply_margin_ms`):
    /// answered late, or held until then.
    rpc_replies_expired,
    /// Requests of another node not run because their deadline had passed (or
    /// would before the reply got back) when they were read or reached the shard
    /// that serves them: the requester has given them up.
    rpc_requests_expired,
    /// Owner actions (kick, close) toward a node whose link was down, taken as done:
    /// its sessions cannot be reached while it is down, so a new login replaces the
    /// old route (a client of a dead node logs in elsewhere at once).
    owner_actions_owner_down,
    /// Requests to other nodes that failed: link down, in-flight table full,
    /// deadline passed, link lost, peer restarted.
    rpc_request_failures,
    /// Of those, requests refused at once because the peer answered none of the
    /// last `[rpc] rpc_breaker_failures` requests (its link's breaker is open; one
    /// probe every `rpc_breaker_cooldown_ms`).
    rpc_requests_refused_breaker,
    /// Cross-shard messages dropped because the peer's queue was at
    /// `peer_queue_max` (admission keeps it below: should stay 0).
    ring_full_drops,
    /// SENDs answered with 22 (RateLimit) at the gateway: the connection's or the
    /// shard's SENDs in flight were at their limit.
    sends_refused_credit,
    /// SENDs answered with 22 (RateLimit) at the gateway: their uid was over
    /// `sends_per_uid_per_s` on this shard (or its table of uids was full of uids
    /// that were not idle).
    sends_refused_uid_rate,
    /// Commits answered with 22 (RateLimit): the delivery backlog was full.
    commits_refused_backlog,
    /// Replicated slot ids: SENDs answered 10, this node's replica not leading
    /// their slot id's group (at start, until the home leads).
    commits_refused_not_leader,
    /// Replicated slot ids: SENDs proposed and then answered 15: the group refused
    /// the entry, it was cut, its leader lost office, or the node stopped first.
    commits_proposals_failed,
    /// Replicated slot ids: messages of a predecessor's entries this node
    /// delivered again (RECV flagged DUP) when its replica began to lead their
    /// group: their leader's delivery mark had not passed them.
    redelivered,
    /// Replicated slot ids: messages held for such a delivery and dropped past
    /// `[commit] redeliver_messages_max` (their recipients catch up by
    /// messagesync), or not delivered again because their group was deleted.
    redeliver_dropped,
    /// Push batches held back because their owner shard's queue had no room (the
    /// delivery resumes as the owner drains).
    delivery_stalls,
    /// Uids this shard's route lookups skipped: their hash slot's presence filter
    /// said they have no endpoint (no table probe).
    lookups_filter_skipped,
    /// Uids this shard's route lookups probed because the presence filter said
    /// "maybe", that had no endpoint (false positives; with the skipped ones, the
    /// filter's false-positive rate).
    lookups_filter_false_positives,
    /// Presence filters this shard's authority rebuilt from their table (grown with
    /// their routes, or past `presence_filter_stale_percent` of stale bits).
    presence_filter_rebuilds,
    /// Authority calls refused as stale-target or not-leader.
    authority_stale_refusals,
    /// Authority calls and touch batches refused (counted among the stale
    /// refusals too), and lookup groups held as rebuilding, because the slot
    /// id's group leader here held no lease (replicated slot ids: cut off from
    /// its quorum, handing over, or not yet confirmed since its election).
    authority_lease_refusals,
    /// The routing revision of the view this shard applies (gauge; the node series
    /// is the shard furthest behind). Every shard follows `GET /cluster/slots`'s
    /// revision within `[session] expiry_interval_ms`.
    view_revision,
    /// Views this shard took from the node's own on its expiry timer because the
    /// message carrying them never reached it (its queue was full): without the
    /// re-read it would serve an older view until the next move.
    views_reread,
    /// 1 once this shard's message log failed a write or sync (a disk I/O error):
    /// the shard refuses sends (SENDACK 15) and `/readyz` is 503 until a restart
    /// (gauge).
    log_write_failed,
    /// Log segments this shard's thread had to create itself at a roll, because no
    /// sync job had created one ahead (normally 0).
    log_segments_created_inline,
    /// Connections accepted on the TCP listener (`imrouter_accepts_total{listener="tcp"}`).
    accepts_tcp,
    /// Connections accepted on the WebSocket listener (`imrouter_accepts_total{listener="ws"}`).
    accepts_ws,
    /// TCP connections reset at once: the shard was at its connection cap
    /// (`imrouter_accept_refused_total{listener="tcp",reason="conn_cap"}`).
    accept_refused_conn_cap_tcp,
    /// WebSocket connections reset at once: the shard was at its connection cap
    /// (`imrouter_accept_refused_total{listener="ws",reason="conn_cap"}`).
    accept_refused_conn_cap_ws,
    /// Inter-node links refused at the shard's link cap (`[net]`'s
    /// `rpc_links_per_shard_max`, set from the cluster): accepted and reset, or a
    /// dial refused. Should stay 0 (more links than the cluster's nodes make).
    rpc_links_refused_cap,
    /// TCP connections reset while out of descriptors (accepted with the spare one)
    /// (`imrouter_accept_refused_total{listener="tcp",reason="fd_limit"}`).
    accept_refused_fd_limit_tcp,
    /// WebSocket connections reset while out of descriptors
    /// (`imrouter_accept_refused_total{listener="ws",reason="fd_limit"}`).
    accept_refused_fd_limit_ws,
    /// TCP connections lost to other accept errors
    /// (`imrouter_accept_refused_total{listener="tcp",reason="other"}`).
    accept_refused_other_tcp,
    /// WebSocket connections lost to other accept errors
    /// (`imrouter_accept_refused_total{listener="ws",reason="other"}`).
    accept_refused_other_ws,
    /// Failed accept rounds that paused the TCP listener (backoff)
    /// (`imrouter_accept_pauses_total{listener="tcp"}`).
    accept_pauses_tcp,
    /// Failed accept rounds that paused the WebSocket listener
    /// (`imrouter_accept_pauses_total{listener="ws"}`).
    accept_pauses_ws,
    /// 1 while this shard's TCP listener is paused after failed accepts (gauge,
    /// `imrouter_listener_paused{listener="tcp"}`).
    listener_paused_tcp,
    /// 1 while this shard's WebSocket listener is paused (gauge,
    /// `imrouter_listener_paused{listener="ws"}`).
    listener_paused_ws,
    /// Connections closed for not completing CONNECT within `connect_timeout_ms`.
    connect_timeouts,
    /// Connections closed because their own output queue passed
    /// `outbound_queue_bytes_max`.
    outbound_overflow_closes,
    /// Connections closed as slow readers: the shard's output passed
    /// `outbound_budget_bytes_per_shard` and theirs was the largest queue.
    slow_reader_closes,
    /// Queued, unwritten client output of the shard (gauge).
    outbound_bytes,
    /// Routes waiting to be re-registered at the new authority after a view moved
    /// their hash slots (gauge; 0 when the rebuild is done). Sampled at each touch
    /// flush.
    route_rebuild_queued,
    /// Routes re-registered at a new authority after a view moved their hash slots
    /// (sent in TouchRoutes batches at `[session] rebuild_routes_per_s`; resends of
    /// failed ones included).
    routes_rebuilt,
    /// The last route rebuild's duration in ms: from the view's arrival on the shard
    /// to its rebuild queue drained (gauge; the node series is the slowest shard's).
    route_rebuild_last_ms,
}

impl ShardMetrics {
    /// Mirrors the IO driver's counters (called once per loop turn; stores only
    /// what changed).
    /// Mirrors the presence filter counts of this shard's reader and authority.
    pub fn record_presence_filter(
        &self,
        lookups: domain::presence::authority::FilterCounts,
        rebuilds: u64,
    ) {
        self.lookups_filter_skipped.set(lookups.skipped);
        self.lookups_filter_false_positives
            .set(lookups.false_positives);
        self.presence_filter_rebuilds.set(rebuilds);
    }

    pub fn record_net(&self, s: &net::io::NetStats) {
        self.accepts_tcp.set(s.tcp.accepted);
        self.accepts_ws.set(s.ws.accepted);
        self.accept_refused_conn_cap_tcp.set(s.tcp.refused_conn_cap);
        self.accept_refused_conn_cap_ws.set(s.ws.refused_conn_cap);
        self.rpc_links_refused_cap
            .set(s.rpc.refused_conn_cap + s.dials.refused_conn_cap);
        self.accept_refused_fd_limit_tcp.set(s.tcp.refused_fd_limit);
        self.accept_refused_fd_limit_ws.set(s.ws.refused_fd_limit);
        self.accept_refused_other_tcp.set(s.tcp.refused_other);
        self.accept_refused_other_ws.set(s.ws.refused_other);
        self.accept_pauses_tcp.set(s.tcp.accept_pauses);
        self.accept_pauses_ws.set(s.ws.accept_pauses);
        self.listener_paused_tcp.set(s.tcp.paused);
        self.listener_paused_ws.set(s.ws.paused);
        self.connect_timeouts.set(s.connect_timeouts);
        self.outbound_overflow_closes
            .set(s.outbound_overflow_closes);
        self.slow_reader_closes.set(s.slow_reader_closes);
        self.outbound_bytes.set(s.outbound_bytes);
    }
}

/// Upper bounds (ns) of the latency histogram buckets; the last bucket is +Inf.
/// From 0.5 µs (a route lookup, a ring hop on a busy shard) to 250 ms.
pub const LATENCY_BUCKETS_NS: [u64; 17] = [
    500,
    1_000,
    2_000,
    5_000,
    10_000,
    20_000,
    50_000,
    100_000,
    200_000,
    500_000,
    1_000_000,
    2_000_000,
    5_000_000,
    10_000_000,
    20_000_000,
    50_000_000,
    250_000_000,
];

/// One latency histogram written by one shard; Prometheus-style cumulative buckets
/// are derived when exported.
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    /// `buckets[i]` counts observations in `(bound[i-1], bound[i]]`; the last is +Inf.
    pub buckets: [Counter; LATENCY_BUCKETS_NS.len() + 1],
    pub sum_ns: Counter,
    pub count: Counter,
}

impl LatencyHistogram {
    /// Records one observation.
    #[inline]
    pub fn observe_ns(&self, ns: u64) {
        let i = LATENCY_BUCKETS_NS.partition_point(|&b| b < ns);
        self.buckets[i].inc();
        self.sum_ns.add(ns);
        self.count.inc();
    }
}

/// The stages of one message's path through the node (one set per shard, written by
/// that shard only). Each message contributes to each stage at most once per push
/// batch; timestamps are nanoseconds of the node's monotonic clock
/// ([`super::shared::NodeShared::mono_ns`]), read once per message or per batch.
#[derive(Debug, Default)]
pub struct StageHistograms {
    /// CONNECT decoded → CONNACK queued: the token check, the key agreement and the
    /// activation (with the answer of the uid's authority shard or node), or the
    /// refusal.
    pub connect: LatencyHistogram,
    /// SEND decoded on the gateway shard → appended to the commit shard's log
    /// (includes the ring hop between the two shards).
    pub gateway_to_commit: LatencyHistogram,
    /// Appended → answered: the end of the turn under the default interval fsync
    /// policy; under `fsync = "always"` the wait for the sync job that makes it durable.
    pub commit_to_durable: LatencyHistogram,
    /// Route lookup of one subscriber page (the published route tables).
    pub route_lookup: LatencyHistogram,
    /// Push batch handed over by the commit shard → received by the owner shard (ring
    /// hop, zero when the owner is the commit shard itself; a batch that waited for
    /// room is handed over when it goes).
    pub push_hop: LatencyHistogram,
    /// RECVs queued by the owner shard → handed to the kernel (the next driver poll
    /// submitted their sends), per push batch.
    pub socket_write: LatencyHistogram,
    /// Commit → RECV queued on the socket, per RECV (`imrouter_recv_latency_seconds`).
    pub recv_latency: LatencyHistogram,
}

/// `(name, help)` of each stage in [`StageHistograms::named`] (the `# HELP` lines).
pub const STAGE_HELP: [(&str, &str); 7] = [
    (
        "stage_connect",
        "CONNECT decoded to CONNACK queued (token, key agreement, activation).",
    ),
    (
        "stage_gateway_to_commit",
        "SEND decoded on the gateway shard to appended to the commit shard's log.",
    ),
    (
        "stage_commit_to_durable",
        "Appended to answered (end of turn; under fsync=always, its sync).",
    ),
    ("stage_route_lookup", "Route lookup of one subscriber page."),
    (
        "stage_push_hop",
        "Push batch handed over by the commit shard to received by the owner shard.",
    ),
    (
        "stage_socket_write",
        "RECVs queued by the owner shard to handed to the kernel, per push batch.",
    ),
    (
        "recv_latency",
        "Commit to RECV queued on the socket, per RECV.",
    ),
];

impl StageHistograms {
    /// `(metric name, histogram)` in path order; exported as `imrouter_<name>_seconds`.
    pub fn named(&self) -> [(&'static str, &LatencyHistogram); 7] {
        [
            ("stage_connect", &self.connect),
            ("stage_gateway_to_commit", &self.gateway_to_commit),
            ("stage_commit_to_durable", &self.commit_to_durable),
            ("stage_route_lookup", &self.route_lookup),
            ("stage_push_hop", &self.push_hop),
            ("stage_socket_write", &self.socket_write),
            ("recv_latency", &self.recv_latency),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_the_bucket_of_their_upper_bound() {
        let h = LatencyHistogram::default();
        for ns in [
            0,
            500,
            501,
            1_000,
            249_999_999,
            250_000_000,
            250_000_001,
            u64::MAX / 2,
        ] {
            h.observe_ns(ns);
        }
        let counts: Vec<u64> = h.buckets.iter().map(Counter::get).collect();
        assert_eq!(counts[0], 2, "0 and 500 ns are in (.., 0.5 µs]");
        assert_eq!(counts[1], 2, "501 and 1000 ns are in (0.5, 1] µs");
        assert_eq!(counts[LATENCY_BUCKETS_NS.len() - 1], 2);
        assert_eq!(counts[LATENCY_BUCKETS_NS.len()], 2, "+Inf");
        assert_eq!(h.count.get(), 8);
    }
}
