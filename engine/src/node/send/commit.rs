//! Step 2 and 3 of a SEND, on the channel's commit shard: the driver of
//! `domain::send::commit::CommitCore` (and its delivery planner). It hands the core each
//! [`Commit`], ends each loop turn with it (group commit), runs its sync jobs on the
//! shard's syncer thread, and carries its outputs: SENDACKs to the gateways, API
//! replies, push batches to the owner shards (or to [`super::owner`] for this
//! shard's own sessions), and the planner's remote lookups
//! ([`NodeShard::send_remote_lookup`]).

use std::sync::Arc;

use net::io::NetDriver;
use proto::wkproto::ReasonCode;
use shard::runtime::Context;
use slots::ShardId;

use domain::send::commit::{CommitLog, CommitOutput, Committing, Groups, LogFault};
use domain::send::delivery::{
    link_room, EndpointLookup, Lookup, LookupReply, PlanLimits, PlanOutput, Push, PushTo,
};

use crate::authority::AuthorityReader;
use crate::channel::Subscribers;
use crate::cluster::Target;
use crate::route::{AuthorityError, Endpoint, Uid};
use crate::store::{LogError, MessageLog, NewMessage, SyncJob};

use super::super::catalog::Catalog;
use super::super::metrics::StageHistograms;
use super::super::msg::SyncRefused;
use super::super::msg::{Msg, Pending, ReplyTo, SendAck};
use super::super::raft::ReadOutcome;
use super::super::shard::{NodeShard, NodeTimer};
use super::super::wire;
use super::{ApiSendResult, Commit, MessageSyncRequest, Origin};

/// The node's message log as the commit core appends to it.
impl CommitLog for MessageLog {
    type Job = SyncJob;

    fn append(&mut self, m: &NewMessage<'_>) -> Result<u64, LogFault> {
        let appended = MessageLog::append(self, m);
        appended.map(|a| a.message_seq).map_err(fault)
    }

    fn begin_sync(&mut self) -> Result<Option<SyncJob>, LogFault> {
        MessageLog::begin_sync(self).map_err(fault)
    }

    fn end_sync(&mut self, result: std::io::Result<()>, now_ms: u64) -> Result<(), LogFault> {
        MessageLog::end_sync(self, result, now_ms).map_err(fault)
    }

    fn sync_now(&mut self, now_ms: u64) -> Result<(), LogFault> {
        MessageLog::sync(self, now_ms).map_err(fault)
    }
}

/// A log error as the core sees it: a disk error (or a log poisoned by one) makes
/// the shard unhealthy.
fn fault(err: LogError) -> LogFault {
    LogFault {
        disk: matches!(err, LogError::Io { .. } | LogError::Poisoned),
        message: err.to_string(),
    }
}

/// The groups' subscribers, read lock-free from the catalog.
impl Groups for Catalog {
    fn subscribers(&self, id: &str) -> Option<Arc<Subscribers>> {
        Catalog::subscribers(self, id)
    }
}

/// The authority's lookups, timed for the `route_lookup` stage.
struct TimedLookup<'a> {
    reader: &'a mut AuthorityReader,
    stages: &'a StageHistograms,
    clock: &'a super::super::shared::NodeShared,
    /// Where lookups held for a lapsed lease are counted.
    metrics: &'a super::super::metrics::ShardMetrics,
}

impl EndpointLookup for TimedLookup<'_> {
    fn endpoints_by_targets_into(
        &mut self,
        lookups: &[(Target, &[Uid])],
        endpoints: &mut Vec<Endpoint>,
        results: &mut Vec<Result<std::ops::Range<usize>, AuthorityError>>,
    ) {
        let start_ns = self.clock.mono_ns();
        self.reader
            .endpoints_by_targets_into(lookups, endpoints, results);
        let targets = lookups.iter().map(|(t, _)| t);
        let leased = |s| self.clock.authority_leased(s);
        let held = crate::node::authority_side::hold_unleased(leased, targets, results);
        self.metrics.authority_lease_refusals.add(held);
        let end_ns = self.clock.mono_ns();
        self.stages
            .route_lookup
            .observe_ns(end_ns.saturating_sub(start_ns));
    }

    fn endpoints_by_hashed_groups_into(
        &mut self,
        lookups: &[domain::send::delivery::HashedGroup<'_>],
        endpoints: &mut Vec<Endpoint>,
        results: &mut Vec<Result<std::ops::Range<usize>, AuthorityError>>,
    ) {
        let start_ns = self.clock.mono_ns();
        self.reader
            .endpoints_by_hashed_groups_into(lookups, endpoints, results);
        let targets = lookups.iter().map(|g| &g.target);
        let leased = |s| self.clock.authority_leased(s);
        let held = crate::node::authority_side::hold_unleased(leased, targets, results);
        self.metrics.authority_lease_refusals.add(held);
        let end_ns = self.clock.mono_ns();
        self.stages
            .route_lookup
            .observe_ns(end_ns.saturating_sub(start_ns));
    }
}

impl NodeShard {
    /// Step 2: a commit arrives (from a gateway's ring, this shard's own gateway, or the
    /// API); a refusal is answered at once, a commit with its turn.
    pub(crate) fn on_commit(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        c: Commit,
    ) {
        let now = self.turn_now();
        if let Origin::Remote(from) = &c.request.answer_to {
            // A SEND another node forwarded, handed here by the shard that read it: not
            // committed once its SENDACK could not get back in time (that gateway has
            // answered its client already).
            if !self.remote_in_time(from) {
                return;
            }
        }
        let mut out = std::mem::take(&mut self.commit.outputs);
        let catalog = &self.shared.catalog;
        let core = &mut self.commit.core;
        let committing = match self.raft.replicated() {
            true => {
                let key = c.request.channel.key();
                let slot = slots::hash_slot(key.as_bytes());
                let slot_id =
                    domain::cluster::slot_id_of(slot, self.shared.config.cluster.slot_ids);
                core.on_propose(c.request, slot_id, catalog, now, &mut out)
            }
            false => core.on_commit(c.request, catalog, now, &mut out),
        };
        if matches!(committing, Committing::Appended | Committing::Proposed) {
            self.stages
                .gateway_to_commit
                .observe_ns(now.mono_ns.saturating_sub(c.decoded_ns));
        }
        self.carry_outputs(cx, driver, &mut out);
        self.commit.outputs = out;
    }

    /// Step 3, once per loop turn: the end of a sync job (if one ended), then the turn's
    /// group commit. Returns the work done (commits completed or handed to a job).
    pub(crate) fn flush_commits(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
    ) -> usize {
        // Outputs queued by the sync timer come first.
        let mut out = std::mem::take(&mut self.commit.outputs);
        let mut work = 0;
        if let Some(result) = self.commit.syncer.poll_done() {
            work += 1 + self.commit.core.unanswered();
            self.sync_done(result, &mut out);
        }
        work += self.commit.core.end_turn(&mut out);
        // Replicated: the turn's SENDs, one entry per group (a group that refuses
        // is answered here).
        self.commit.core.propose_turn(&mut self.raft, &mut out);
        self.carry_outputs(cx, driver, &mut out);
        self.commit.outputs = out;
        if self.raft.replicated() {
            self.drain_proposed(cx, driver);
        }
        work
    }

    /// What the groups' drains told of the proposals (appends, commits, lost
    /// leaderships), handed to the commit core; its answers carried.
    pub(crate) fn feed_raft_events(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
    ) {
        use super::super::raft::RaftEvent;
        if !self.raft.has_events() {
            // A heartbeat or an idle tick: nothing for the core to answer.
            return;
        }
        let now = self.turn_now();
        let mut out = std::mem::take(&mut self.commit.outputs);
        let core = &mut self.commit.core;
        for event in self.raft.take_events() {
            match event {
                RaftEvent::Appended {
                    group,
                    term,
                    index,
                    seqs,
                    foreign,
                } => core.on_appended(group, term, index, &seqs, foreign, &mut out),
                RaftEvent::Committed { group, term, index } => {
                    core.on_committed(group, term, index, now, &mut out)
                }
                RaftEvent::Lost { group } => core.on_lost(group, 0, &mut out),
            }
        }
        self.carry_outputs(cx, driver, &mut out);
        self.commit.outputs = out;
    }

    /// The interval fsync policy's timer: the core's sync job, if any, goes to the
    /// syncer with this turn's [`flush_commits`] (which carries what is queued here).
    pub(crate) fn on_log_sync_timer(&mut self) {
        self.commit.core.on_sync_timer(&mut self.commit.outputs);
    }

    /// A graceful stop: everything appended is made durable here and now, then
    /// answered and delivered.
    pub(crate) fn flush_commits_for_stop(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
    ) {
        let mut out = std::mem::take(&mut self.commit.outputs);
        self.commit.core.stop(self.now(), &mut out);
        self.carry_outputs(cx, driver, &mut out);
        self.commit.outputs = out;
    }

    /// Carries the core's outputs: answers, sync jobs, log failures; then plans
    /// deliveries if any commit was answered.
    fn carry_outputs(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        out: &mut Vec<CommitOutput<Origin, SyncJob>>,
    ) {
        let mut answered = false;
        let mut answered_ns: Option<u64> = None;
        let mut batch = std::mem::take(&mut self.commit.carrying);
        // A sync the syncer ran inline answers more: carry until nothing is left.
        while !out.is_empty() {
            std::mem::swap(out, &mut batch);
            for output in batch.drain(..) {
                match output {
                    CommitOutput::Answer {
                        to,
                        message_id,
                        message_seq,
                        reason,
                        appended_ns,
                    } => {
                        if let Some(appended_ns) = appended_ns {
                            // One clock read per batch of answers, not one per answer.
                            let durable_ns =
                                *answered_ns.get_or_insert_with(|| self.shared.mono_ns());
                            self.stages
                                .commit_to_durable
                                .observe_ns(durable_ns.saturating_sub(appended_ns));
                        }
                        answered |= reason == ReasonCode::SUCCESS;
                        self.answer_commit(cx, driver, to, message_id, message_seq, reason);
                    }
                    CommitOutput::SubmitSync(job) => {
                        if let Some(ran_here) = self.commit.syncer.submit(job) {
                            self.sync_done(ran_here, out);
                        }
                    }
                    CommitOutput::LogFailed { what, fault } => self.log_failed(what, &fault),
                }
            }
        }
        self.commit.carrying = batch;
        self.publish_commit_counts();
        if answered {
            // The `msg.notify` webhook reads the log up to here (when it is on).
            let end = self.commit.core.log().end_position();
            self.shared.webhooks.committed(self.me as usize, end);
            self.pump_deliveries(cx, driver);
        }
    }

    /// The core's counters and the log's inline segment creations, as metrics.
    pub(crate) fn publish_commit_counts(&mut self) {
        let counts = self.commit.core.take_counts();
        if counts != domain::send::commit::CommitCounts::default() {
            self.metrics.sends_deduplicated.add(counts.deduplicated);
            self.metrics
                .commits_refused_backlog
                .add(counts.refused_backlog);
            let m = &self.metrics;
            m.commits_refused_not_leader.add(counts.refused_not_leader);
            m.commits_proposals_failed.add(counts.proposals_failed);
            m.redelivered.add(counts.redelivered);
            m.redeliver_dropped.add(counts.redeliver_dropped);
        }
    }

    /// A sync job ended: the core answers what it covered; the log's inline segment
    /// creations (a roll the syncer did not prepare ahead) become the metric.
    fn sync_done(
        &mut self,
        result: std::io::Result<()>,
        out: &mut Vec<CommitOutput<Origin, SyncJob>>,
    ) {
        let now = self.now();
        self.commit.core.on_sync_done(result, now, out);
        let inline = self.commit.core.log().stats().segments_created_inline;
        let m = &self.metrics.log_segments_created_inline;
        m.add(inline.saturating_sub(m.get()));
    }

    /// A log failure: logged; a disk error marks the shard failed (its gauge
    /// `log_write_failed` turns `/readyz` to 503, `NodeShared::not_ready`).
    fn log_failed(&self, what: &str, fault: &LogFault) {
        tracing::error!(err = %fault.message, shard = self.me, what, "log failed: refusing");
        if fault.disk && self.metrics.log_write_failed.get() == 0 {
            self.metrics.log_write_failed.inc();
        }
    }

    /// Sends a commit's answer: SENDACK to the gateway, or the API reply.
    fn answer_commit(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        to: Origin,
        message_id: i64,
        message_seq: u64,
        reason: ReasonCode,
    ) {
        match to {
            Origin::Client {
                shard,
                conn,
                session_id,
                client_seq,
            } => {
                let ack = SendAck {
                    conn,
                    session_id,
                    client_seq,
                    message_id,
                    message_seq,
                    reason,
                };
                self.hand(cx, driver, shard, Msg::SendAck(ack));
            }
            Origin::Api { reply } => {
                let _ = reply.try_send(ApiSendResult {
                    message_id,
                    message_seq,
                    reason,
                });
            }
            Origin::Remote(remote) => {
                let reply = wire::Reply::SendAck {
                    message_id,
                    message_seq,
                    reason: reason.0,
                };
                self.reply_remote(cx, remote, reply);
            }
        }
    }

    /// Delivers from the backlog (the core's planner): push batches to the owner
    /// shards that have room, this shard's own last, and lookups of the groups another
    /// node leads. Returns the work done (1 at least while anything waits for room, so
    /// the shard keeps turning until it is delivered; nothing for a page that waits for
    /// lookup replies, whose arrival wakes the shard; 1 more if a reply came at once,
    /// so the next turn pushes its page).
    pub(crate) fn pump_deliveries(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
    ) -> usize {
        if self.commit.core.delivering() == 0 {
            return 0;
        }
        let limits = self.plan_limits();
        let now_ms = cx.now_ms();
        let mut planned = std::mem::take(&mut self.commit.planned);
        let mut lookup = TimedLookup {
            reader: &mut self.reader,
            stages: &self.stages,
            clock: &self.shared,
            metrics: &self.metrics,
        };
        let peers = &self.peers;
        let link_limit_bytes = self.shared.config.net.rpc_outbound_queue_bytes_max / 2;
        let mut room = |to: PushTo| match to {
            PushTo::Shard(s) => cx.send_capacity(s),
            // A link's room: none with half its connection's outbound queue unwritten.
            PushTo::Node(n) => link_room(peers.queued_bytes(n, driver), link_limit_bytes),
        };
        let work = self.commit.core.pump(
            now_ms,
            &self.view,
            &mut lookup,
            &mut room,
            &limits,
            &mut planned,
        );
        self.publish_plan_counts();
        // The push-hop stage starts when the batches are handed over (one clock read).
        let handed_ns = self.shared.mono_ns();
        let mut lookups_sent = false;
        for output in planned.drain(..) {
            match output {
                PlanOutput::Push(push) => self.carry_push(cx, driver, push, handed_ns),
                PlanOutput::Lookup(lookup) => {
                    lookups_sent = true;
                    self.send_remote_lookup(cx, lookup);
                }
                // The `msg.offline` webhook: this node committed the message.
                PlanOutput::Offline(o) => self.shared.webhooks.offline(&o.message, o.uids),
            }
        }
        self.commit.planned = planned;
        let answered_at_once = lookups_sent && self.commit.core.awaiting_lookups() == 0;
        work + usize::from(answered_at_once)
    }

    /// The planner's limits from `[delivery]`.
    fn plan_limits(&self) -> PlanLimits {
        let cfg = &self.shared.config.delivery;
        PlanLimits {
            local_node: self.shared.config.node_id,
            me: self.me,
            shard_count: self.shared.slot_map.shard_count() as ShardId,
            subscriber_page_max: cfg.subscriber_page_max,
            push_batch_max: cfg.push_batch_max,
            pages_per_turn_max: cfg.pages_per_turn_max,
            lookup_pages_in_flight_max: cfg.lookup_pages_in_flight_max,
            lookup_retries_max: cfg.lookup_retries_max,
            rebuild_retry_interval_ms: cfg.rebuild_retry_interval_ms,
            rebuild_wait_ms_max: cfg.rebuild_wait_ms_max,
            reserved_room_per_peer: cfg.reserved_room_per_peer(&self.shared.config.commit),
            offline_uids: self
                .shared
                .webhooks
                .enabled(domain::webhook::EventKind::Offline),
            offline_room: self
                .shared
                .webhooks
                .has_room(domain::webhook::EventKind::Offline),
        }
    }

    /// The planner's counters, as metrics.
    fn publish_plan_counts(&mut self) {
        let counts = self.commit.core.take_plan_counts();
        self.metrics.stale_lookups.add(counts.failed_groups);
        let lookup_failed = counts.failed_groups - counts.rebuild_timeouts;
        self.metrics.pushes_skipped_lookup_failed.add(lookup_failed);
        self.metrics
            .pushes_skipped_rebuilding
            .add(counts.rebuild_timeouts);
        self.metrics
            .lookup_rebuild_retries
            .add(counts.rebuild_retries);
        if counts.offline_skipped > 0 {
            // Their msg.offline events: not gathered, the queue had no room.
            let offline = domain::webhook::EventKind::Offline;
            self.shared
                .webhooks
                .dropped(offline, counts.offline_skipped);
        }
        self.metrics
            .lookup_groups_retried
            .add(counts.retried_groups);
        self.metrics.delivery_stalls.add(counts.stalls);
        self.metrics.push_stale.add(counts.stale_endpoints);
        // TODO(issue 13): metrics for remote lookups (sent, failed, ignored replies).
        if counts.ignored_replies > 0 {
            tracing::debug!(
                ignored = counts.ignored_replies,
                "lookup replies for no awaited lookup"
            );
        }
    }

    /// Sends one remote lookup (EndpointsByTargets to `lookup.node`) and answers it
    /// exactly once through `CommitCore::on_lookup_reply`: the node's reply, or a
    /// failure at the RPC deadline or when the peer is down or restarted (a failed
    /// lookup's groups are counted failed; their recipients catch up by
    /// messagesync). A node alone never gets here: it leads every target.
    pub(crate) fn send_remote_lookup(&mut self, cx: &mut Context<Msg, NodeTimer>, lookup: Lookup) {
        let request = wire::Request::Lookup {
            groups: lookup.groups,
            uids: lookup.uids,
        };
        let pending = Pending::Lookup {
            lookup_id: lookup.lookup_id,
        };
        self.request_remote(cx, lookup.node, request, pending);
    }

    /// One push batch: to this shard's sessions at once, to another shard over its ring.
    fn carry_push(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        push: Push,
        handed_ns: u64,
    ) {
        match push.to {
            PushTo::Shard(s) if s == self.me => {
                let (owner, mut io) = self.owner_io(cx, driver);
                owner.on_push(&mut io, &push.message, &push.endpoints, handed_ns);
            }
            PushTo::Shard(s) => {
                let msg = Msg::Push {
                    message: push.message,
                    endpoints: push.endpoints,
                    handed_ns,
                };
                self.send_msg(cx, s, msg);
                cx.flush_to(s);
            }
            PushTo::Node(n) => {
                // Owner push: the plaintext message and the exact endpoints; the owner
                // revalidates and encrypts per session.
                let message = wire::OneWayRef::Push {
                    message: &push.message,
                    endpoints: &push.endpoints,
                };
                if !self.peers.oneway(n, &message, cx.now_ms()) {
                    let n = push.endpoints.len() as u64;
                    self.metrics.push_remote_dropped.add(n);
                    self.metrics.pushes_skipped_link_down.add(n);
                }
            }
        }
    }

    /// `/channel/messagesync` on the channel's commit shard. Replicated: read on
    /// the group's leader only, after a ReadIndex (asked with the turn's other
    /// reads of the group, answered in `serve_reads`), so no deposed leader
    /// answers from a stale log.
    pub(crate) fn on_message_sync(&mut self, r: Box<MessageSyncRequest>) {
        if !self.raft.replicated() {
            let result = self.read_messages(&r, None);
            let _ = r.reply.try_send(result);
            return;
        }
        let limit = self.shared.config.commit.reads_waiting_max;
        if self.raft.reads_waiting() >= limit {
            let _ = r.reply.try_send(Err(SyncRefused::Busy));
            return;
        }
        let hash_slot = slots::hash_slot(r.channel_key.as_bytes());
        let group = domain::cluster::slot_id_of(hash_slot, self.shared.config.cluster.slot_ids);
        let waiter = self.next_read_waiter;
        self.next_read_waiter += 1;
        match self.raft.ask_read(group, waiter) {
            Ok(()) => {
                self.read_waiters.insert(waiter, r);
            }
            Err(refused) => {
                let _ = r.reply.try_send(Err(refused));
            }
        }
    }

    /// The reads whose ReadIndex was confirmed, answered from the log up to the
    /// group's commit (a message appended here and not yet committed is left out:
    /// it may still be cut); the lost ones answered "no leader here".
    pub(crate) fn serve_reads(&mut self) {
        for outcome in self.raft.take_reads() {
            let (ReadOutcome::Ready { waiter, .. } | ReadOutcome::Lost { waiter }) = outcome;
            let Some(r) = self.read_waiters.remove(&waiter) else {
                continue;
            };
            let result = match outcome {
                ReadOutcome::Ready { group, .. } => {
                    let commit = self.raft.commit_index(group);
                    let end = self.commit.core.log().entry_start(group, commit + 1);
                    self.read_messages(&r, end)
                }
                ReadOutcome::Lost { .. } => Err(SyncRefused::NotLeader),
            };
            let _ = r.reply.try_send(result);
        }
    }

    /// `r`'s messages in the log, those at or past `end` (uncommitted) left out.
    fn read_messages(
        &self,
        r: &MessageSyncRequest,
        end: Option<crate::store::LogPosition>,
    ) -> Result<(Vec<crate::store::StoredMessage>, bool), SyncRefused> {
        let res = (self.commit.core.log())
            .read_within(
                r.channel_type,
                &r.channel_key,
                r.start_seq,
                r.end_seq,
                r.limit,
                r.pull_mode,
                r.bytes_max,
            )
            .map_err(|e| SyncRefused::Log(e.to_string()))?;
        let committed = |m: &&crate::store::MessageView<'_>| end.is_none_or(|end| m.position < end);
        let messages = res.messages.iter().filter(committed).map(|m| m.to_stored());
        Ok((messages.collect(), res.more))
    }

    /// Step 2 for a SEND another node's gateway forwarded to this home (the hop
    /// `ForwardedSend`): a commit like any other, its SENDACK the reply.
    pub(crate) fn on_forwarded_send(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        reply_to: ReplyTo,
        send: wire::ForwardedSend,
    ) {
        let origin = match reply_to {
            ReplyTo::Node(remote) => Origin::Remote(remote),
            ReplyTo::Shard(
                shard,
                Pending::Send {
                    conn,
                    session_id,
                    client_seq,
                },
            ) => Origin::Client {
                shard,
                conn,
                session_id,
                client_seq,
            },
            ReplyTo::Shard(..) => {
                tracing::error!("a forwarded SEND from a shard without its connection: dropped");
                return;
            }
        };
        let to = self
            .shared
            .slot_map
            .shard_of_key(send.channel.key().as_bytes());
        let commit = Commit {
            request: send.answered_to(origin),
            decoded_ns: self.turn_now().mono_ns,
        };
        if to == self.me {
            self.on_commit(cx, driver, commit);
        } else {
            self.send_msg(cx, to, Msg::Commit(Box::new(commit)));
        }
    }

    /// The reply to a delivery page's endpoint lookup at another node (or its
    /// failure: deadline, link lost, peer restarted): the page goes on, and the next
    /// turn's `pump_deliveries` pushes it.
    pub(crate) fn on_lookup_reply(&mut self, lookup_id: u64, reply: LookupReply) {
        if !self.commit.core.on_lookup_reply(lookup_id, reply) {
            tracing::debug!(lookup_id, "lookup reply for no waiting page: ignored");
        }
    }
}
