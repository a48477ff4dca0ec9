//! Durable state of a node: the message log of each delivery shard and the metadata
//! store (tokens, group subscribers).
//!
//! - [`log`]: [`MessageLog`], one append-only, mmap'd, segmented log per delivery shard
//!   for all channels of its hash slots; group commit via [`MessageLog::sync`]; per-channel
//!   seq index; `/channel/messagesync` reads; crash recovery; retention. Its module docs
//!   state exactly what survives a process crash and what survives power loss.
//! - [`record`]: the on-disk record format (fixed `bytemuck` header + fields, CRC-32).
//! - [`idgen`]: [`MessageIdGen`], cluster-unique snowflake-like message ids.
//! - [`layout`]: `DATA_DIR/layout.toml`, the shard count the data was written with;
//!   a start with another one is refused.
//! - [`idempotency`]: [`IdempotencyWindow`], the bounded `(uid, client_msg_no)` window
//!   of Flow 7.
//! - [`meta`]: [`MetaStore`], tokens and subscribers with a fsynced journal and snapshots.
//!
//! Everything here is single-threaded (owned by one shard or the API thread) and
//! takes time as an argument; the only IO is to its own directory.

mod fsutil;
pub mod idempotency;
pub mod idgen;
pub mod layout;
pub mod log;
pub mod meta;
pub mod record;

pub use fsutil::create_private_dir_all;
pub use idempotency::{IdempotencyConfig, IdempotencyWindow, SentIds};
pub use idgen::MessageIdGen;
pub use log::{
    log_dir, AppendedMessage, FsyncPolicy, LogConfig, LogError, LogPosition, LogStats, MessageLog,
    MessageView, NewMessage, PullMode, ReadResult, RecoveryReport, StoredMessage, SyncJob,
};
pub use meta::{MetaConfig, MetaError, MetaRecovery, MetaStore};
