//! The hop of the replicated groups' messages (`Kind::Raft`, one-way): a shard's
//! timer and a peer's frame enter its [`super::raft::RaftSide`] here, and the
//! messages it gives out leave on this shard's links, one frame per peer.

use net::io::NetDriver;
use shard::runtime::Context;

use crate::cluster::NodeId;

use super::catalog::CatalogOp;
use super::msg::{CatalogPropose, CatalogRefused, Msg, RaftIn};
use super::raft::{CatalogOutcome, RaftPlace, RaftSide};
use super::shard::{NodeShard, NodeTimer};
use super::wire;

impl NodeShard {
    /// Opens this shard's groups (at start): none unless `[cluster] replicas` is
    /// above 1 in a cluster. A store that refuses is fatal for the groups only:
    /// logged, and the shard runs without them.
    pub(super) fn open_raft(&mut self) {
        let c = &self.shared.config;
        let nodes: Vec<NodeId> = c.cluster.nodes.iter().map(|n| n.id).collect();
        let dir = crate::store::log_dir(&c.data_dir, self.me as usize);
        let dir = dir.parent().expect("a log dir has its shard's dir");
        let place = RaftPlace {
            me: c.node_id,
            shard: self.me as usize,
            shard_count: usize::from(self.shared.slot_map.shard_count()),
            nodes: &nodes,
            replicas: c.cluster.replicas as usize,
            slot_ids: c.cluster.slot_ids,
            tick_ms: c.cluster.raft_tick_ms,
            dir,
            seed: self.shared.boot_id ^ (self.me as u64) << 48,
            fsync_always: matches!(c.log.fsync, crate::store::FsyncPolicy::Always),
            entries_retained: c.cluster.raft_entries_retained,
            lease_margin_ms: c.cluster.raft_lease_margin_ms,
        };
        match RaftSide::open(&place, self.commit.core.log()) {
            Ok(side) => self.raft = side,
            Err(e) => {
                tracing::error!(shard = self.me, error = %e, "the replicated groups did not open: this shard's SENDs are refused");
                self.raft = RaftSide::without_groups();
            }
        }
    }

    /// The groups' timer: ticks, writes, messages out.
    pub(super) fn on_raft_timer(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
    ) {
        // The node's clock, not the shard's: leases are read on every shard.
        let now_ms = self.shared.mono_ms();
        let shared = &self.shared;
        let draining = |n| shared.is_node_draining(n);
        let log = self.commit.core.log_mut();
        (self.raft).on_timer(now_ms, log, &shared.raft_status, draining);
        let (groups, led) = self.raft.counts();
        self.metrics.raft_groups.set(groups as u64);
        self.metrics.raft_groups_led.set(led as u64);
        self.metrics.raft_replicas_failed.set(self.raft.failed);
        self.metrics
            .raft_snapshots_refused
            .set(self.raft.snapshots_refused);
        self.flush_raft(cx, driver);
    }

    /// The end of a turn on a replicated node, after the turn's SENDs were
    /// proposed: the groups proposed to written and their appends sent.
    pub(super) fn drain_proposed(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
    ) {
        let status = &self.shared.raft_status;
        let log = self.commit.core.log_mut();
        self.raft.drain_proposed(self.shared.mono_ms(), log, status);
        self.flush_raft(cx, driver);
    }

    /// A peer's frame of raft messages: split by the shard of each message's
    /// group (in the frame's order), this shard's stepped and drained as one
    /// batch, each other shard's passed on in one message.
    pub(super) fn on_remote_raft(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        from: NodeId,
        messages: Vec<(u32, Vec<u8>)>,
    ) {
        let shards = usize::from(self.shared.slot_map.shard_count());
        let mut by_shard: Vec<Vec<(u32, Vec<u8>)>> = vec![Vec::new(); shards];
        for (slot_id, bytes) in messages {
            by_shard[slot_id as usize % shards].push((slot_id, bytes));
        }
        for (shard, messages) in by_shard.into_iter().enumerate() {
            if messages.is_empty() {
                continue;
            }
            let m = RaftIn { from, messages };
            if shard == self.me as usize {
                self.on_raft_in(cx, driver, m);
            } else {
                self.send_msg(cx, shard as slots::ShardId, Msg::Raft(Box::new(m)));
            }
        }
    }

    /// A peer's messages for groups of this shard.
    pub(super) fn on_raft_in(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        m: RaftIn,
    ) {
        let now_ms = self.shared.mono_ms();
        let status = &self.shared.raft_status;
        let log = self.commit.core.log_mut();
        let dropped = self
            .raft
            .on_messages(now_ms, m.from, &m.messages, log, status);
        self.metrics.raft_messages_dropped.add(dropped as u64);
        self.flush_raft(cx, driver);
    }

    /// Sends the groups' messages, one frame per peer; a peer whose link refuses
    /// is reported unreachable to the groups (raft resends). Then the drains'
    /// news of the proposals goes to the commit core, and its answers out.
    fn flush_raft(&mut self, cx: &mut Context<Msg, NodeTimer>, driver: &mut NetDriver) {
        let now_ms = cx.now_ms();
        let draining = self.shared.is_draining();
        for (node, messages) in self.raft.take_outbox() {
            let frame = wire::OneWayRef::Raft {
                draining,
                messages: &messages,
            };
            if !self.peers.oneway(node, &frame, now_ms) {
                self.raft.unreachable(node);
            }
        }
        self.feed_raft_events(cx, driver);
        self.apply_catalog();
        self.serve_reads();
        let won = self.raft.take_won();
        if !won.is_empty() {
            self.claim_group_leaders(cx, driver, &won);
            self.redeliver(cx, driver, &won);
        }
    }

    /// Groups this shard's replicas began to serve as leaders: what their
    /// predecessors committed and may not have delivered (above the delivery mark
    /// this replica saw) is delivered again, flagged DUP
    /// (`domain::send::commit`, "Delivery after a change of leader").
    fn redeliver(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        won: &[(u32, u64)],
    ) {
        let now = self.turn_now();
        let catalog = &self.shared.catalog;
        let queued: usize = (won.iter())
            .map(|&(slot_id, _)| self.commit.core.redeliver(slot_id, catalog, now))
            .sum();
        if queued > 0 {
            tracing::info!(
                shard = self.me,
                messages = queued,
                "a predecessor's last messages delivered again (DUP)"
            );
            self.publish_commit_counts();
            self.pump_deliveries(cx, driver);
        }
    }

    /// A catalog change from the HTTP API: proposed to its group here (drained
    /// with the turn's proposals), answered at its commit; refused at once when
    /// this replica does not serve as leader or too many wait.
    pub(super) fn on_catalog_propose(&mut self, m: CatalogPropose) {
        let limit = self.shared.config.commit.catalog_changes_waiting_max;
        if self.raft.catalog_waiting() >= limit {
            let _ = m.done.try_send(Err(CatalogRefused::Busy));
            return;
        }
        let waiter = self.next_catalog_waiter;
        self.next_catalog_waiter += 1;
        match self.raft.propose_catalog(m.slot_id, &m.op.encode(), waiter) {
            Ok(()) => {
                self.catalog_waiters.insert(waiter, m.done);
            }
            Err(refused) => {
                let _ = m.done.try_send(Err(refused));
            }
        }
    }

    /// The catalog entries the drains committed, applied on this node in log
    /// order (every replica does), each change proposed here answered with its
    /// outcome; the changes lost answered `Lost`.
    fn apply_catalog(&mut self) {
        for outcome in self.raft.take_catalog() {
            let (waiter, result) = match outcome {
                CatalogOutcome::Apply { op, waiter } => {
                    let result = match CatalogOp::decode(&op) {
                        Some(op) => self.shared.catalog.apply(&op).map_err(|e| {
                            tracing::error!(shard = self.me, error = %e, ?op, "a committed catalog change was refused by this node's store");
                            self.metrics.catalog_applies_failed.inc();
                            CatalogRefused::Store(e)
                        }),
                        None => {
                            tracing::error!(shard = self.me, "a committed catalog entry does not decode: skipped");
                            self.metrics.catalog_applies_failed.inc();
                            Err(CatalogRefused::Lost)
                        }
                    };
                    (waiter, result)
                }
                CatalogOutcome::Lost { waiter } => (Some(waiter), Err(CatalogRefused::Lost)),
            };
            if let Some(done) = waiter.and_then(|w| self.catalog_waiters.remove(&w)) {
                let _ = done.try_send(result);
            }
        }
    }

    /// Groups this shard's replicas began to serve as leaders: their hash slots
    /// claimed for this node in one view change, which every shard applies (homes
    /// and authorities follow) and shard 0 sends to every peer.
    fn claim_group_leaders(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        won: &[(u32, u64)],
    ) {
        self.metrics.raft_claims.add(won.len() as u64);
        let Some(view) = self.shared.claim_group_leaders(won) else {
            return;
        };
        tracing::info!(
            shard = self.me,
            revision = view.revision,
            groups = won.len(),
            "slot ids claimed by their groups' new leader"
        );
        self.spread_view(cx, driver, &view);
    }
}
