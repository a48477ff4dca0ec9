//! One SEND, from the gateway to every RECV (`docs/flows.md`, flow 5), one file per
//! side, each reading top-down; every decision is a sans-IO machine of `domain`, and
//! these files only decode, call the machine and carry its outputs to the ring, the
//! log's syncer, the socket or the API:
//!
//! 1. [`gateway`] (the sender's shard): resolve the channel, the uid's SEND rate
//!    (`domain::send::send_rate`), the connection's
//!    new-channel budget (`domain::send::new_channels`), msg_key and decryption
//!    (`proto::crypto`), the credits of SENDs in flight; a [`Commit`] to the channel's
//!    commit shard. Later the SENDACK back to the connection.
//! 2. [`commit`] (the channel's commit shard, `hash_slot(channel key) % shards`): the
//!    commit core (`domain::send::commit::CommitCore`: permission, back-pressure,
//!    idempotency, ids and seqs, the sync policy) and its delivery planner
//!    (`domain::send::delivery::Planner`: subscriber pages, one lookup each, push batches
//!    by owner), driven once per loop turn.
//! 3. [`owner`] (the shard holding the recipient's connection): revalidate each
//!    endpoint, encrypt for its session, write RECV, and the pending RECVACKs
//!    (`domain::send::acks::PendingAcks`: re-sends with DUP, then drop; the client
//!    recovers by sync).
//!
//! Each side's state is a part of the shard that owns it, declared here below the
//! shard ([`GatewaySide`], [`CommitSide`]; [`owner::OwnerSide`] in its file): the
//! shard holds them, and each side's file adds its decisions and the shard's
//! glue that carries them.

pub mod commit;
pub mod gateway;
pub mod owner;

use domain::send::commit::CommitOutput;
use domain::send::delivery::PlanOutput;
use domain::send::gateway::SendCredits;
use domain::send::new_channels::NewChannelLimits;
use domain::send::send_rate::SendRate;
use slots::ShardId;

use crate::cluster::NodeId;
use crate::route::BootId;

use crate::store::{MessageLog, SyncJob};

use super::shared::NodeShared;
use super::syncer::LogSyncer;

pub use super::msg::{ApiSendResult, Commit, CommitRequest, MessageSyncRequest, Origin};

pub use domain::send::commit::Committed;

/// Most push batches whose socket write is timed per loop turn (more are not timed).
pub const WRITE_MARKS_MAX: usize = 4_096;

/// The gateway side of one shard (its decisions are `gateway.rs`'s): this gateway's
/// credits of SENDs in flight towards each commit shard, its uids' SEND rates, and
/// what its commits name (this shard, node and process; the connections'
/// new-channel budget).
pub struct GatewaySide {
    me: ShardId,
    node_id: NodeId,
    boot_id: BootId,
    credits: SendCredits,
    send_rate: SendRate,
    new_channel_limits: NewChannelLimits,
}

impl GatewaySide {
    pub fn new(me: ShardId, shared: &NodeShared) -> GatewaySide {
        let cfg = &shared.config;
        GatewaySide {
            me,
            node_id: cfg.node_id,
            boot_id: shared.boot_id,
            credits: SendCredits::new(
                me,
                shared.slot_map.shard_count() as usize,
                cfg.commit.commit_credits_per_peer,
                cfg.session.sends_in_flight_per_conn_max,
            ),
            send_rate: SendRate::new(cfg.session.send_rate_limits()),
            new_channel_limits: cfg.session.new_channel_limits(),
        }
    }
}

/// The commit core of this shard, over its message log.
pub type CommitCore = domain::send::commit::CommitCore<MessageLog, Origin>;

/// The commit side of one shard: the core, the syncer that runs its log's syncs, and
/// the buffers its outputs go through (reused: nothing allocated per message here).
pub struct CommitSide {
    pub core: CommitCore,
    /// Runs the log's syncs off this thread.
    syncer: LogSyncer,
    outputs: Vec<CommitOutput<Origin, SyncJob>>,
    /// The outputs being carried while the core adds more (an inline sync).
    carrying: Vec<CommitOutput<Origin, SyncJob>>,
    /// The planner's outputs: push batches and remote lookups.
    planned: Vec<PlanOutput>,
}

impl CommitSide {
    pub fn new(core: CommitCore, syncer: LogSyncer) -> Self {
        CommitSide {
            core,
            syncer,
            outputs: Vec::new(),
            carrying: Vec::new(),
            planned: Vec::new(),
        }
    }
}
