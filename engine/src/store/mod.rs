//! Durable state of a node: the message log of each commit shard and the metadata
//! store (tokens, group subscribers).
//!
//! - [`log`]: [`MessageLog`], one append-only, mmap'd, segmented log per commit shard
//!   for all channels of its hash slots; syncs as [`SyncJob`]s (`begin_sync`, run on the
//!   shard's syncer thread, `end_sync`) or at once ([`MessageLog::sync`]); per-channel
//!   seq index; `/channel/messagesync` reads; crash recovery; retention. Its module docs
//!   state exactly what survives a process crash and what survives power loss.
//! - [`record`]: the on-disk record format (fixed `bytemuck` header + fields, CRC-32).
//! - [`layout`]: `DATA_DIR/layout.toml`, the shard count the data was written with;
//!   a start with another one is refused.
//! - [`refill_idempotency`]: the idempotency window (`domain::send::idempotency`) refilled
//!   from a log at start.
//! - [`meta`]: [`MetaStore`], tokens and subscribers with a fsynced journal and snapshots.
//! - [`raft_state`]: each replicated group's hard state and configuration, synced
//!   before anything that depends on them leaves (the groups' entries are the
//!   log's: [`log`]'s `groups`).
//! - [`replicated`]: a replica's writes applied to those two in order, and its
//!   durable state read back from them at a restart.
//! - [`tail`]: [`tail::LogTail`], a reader of a log's files from outside its shard
//!   (the `msg.notify` webhook follows each log with one).
//! - [`view`]: `DATA_DIR/view.json`, the cluster view last installed (slot moves
//!   survive a restart).
//!
//! Everything here is owned by one thread (a shard or the API), except the
//! [`SyncJob`]s a shard hands to its syncer thread and the [`tail::LogTail`]s that
//! read a log's files beside its shard; it takes time as an argument; the only IO is
//! to its own directory.

mod fsutil;
pub mod layout;
pub mod log;
pub mod meta;
pub mod raft_state;
pub mod record;
pub mod replicated;
pub mod tail;
pub mod view;

pub use domain::send::idempotency::{IdempotencyConfig, IdempotencyWindow, SentIds};
pub use domain::send::idgen::MessageIdGen;
pub use fsutil::create_private_dir_all;
pub(crate) use fsutil::write_atomic;
pub use log::{
    log_dir, AppendedMessage, FsyncPolicy, LogConfig, LogError, LogPosition, LogStats, MessageLog,
    MessageView, NewMessage, PullMode, ReadResult, RecoveryReport, StoredMessage, SyncJob,
};
pub use meta::{MetaConfig, MetaError, MetaRecovery, MetaStore};

/// Refills `window` from the records still in `log`, oldest first (each record's
/// `timestamp_s` standing for its insertion time); returns how many entries it holds.
pub fn refill_idempotency(
    window: &mut IdempotencyWindow,
    log: &MessageLog,
    now_s: u64,
) -> Result<usize, LogError> {
    log.scan(|m| {
        let ids = SentIds {
            message_id: m.message_id,
            message_seq: m.message_seq,
        };
        window.refill(m.from_uid, m.client_msg_no, ids, m.timestamp_s, now_s);
    })?;
    Ok(window.refill_done(now_s))
}
