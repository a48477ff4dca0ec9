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

pub mod commit;
pub mod gateway;
pub mod owner;

use tokio::sync::mpsc::Sender;

use net::io::ConnId;
use proto::wkproto::ReasonCode;
use slots::ShardId;

use crate::route::SessionId;
use crate::store::{PullMode, StoredMessage};

pub use commit::{
    flush_commits, flush_commits_for_stop, on_commit, on_forwarded_send, on_log_sync_timer,
    on_lookup_reply, on_message_sync, pump_deliveries, CommitSide,
};
pub use domain::send::commit::Committed;
pub use gateway::{on_send, on_sendack};
pub use owner::{
    observe_socket_writes, on_ack_timeout, on_push, on_recvack, on_remote_push, PendingAcks,
    WRITE_MARKS_MAX,
};

/// Where a commit's answer goes (the commit core hands it back with the answer).
pub enum Origin {
    /// A client's SEND: SENDACK to this connection of this gateway shard.
    Client {
        shard: ShardId,
        conn: ConnId,
        session_id: SessionId,
        client_seq: u32,
    },
    /// `POST /message/send`: the answer goes back to the HTTP API's task (awaited,
    /// holding no thread; `try_send` never blocks a shard).
    Api { reply: Sender<ApiSendResult> },
    /// A SEND forwarded by another node's gateway: the SENDACK is its reply.
    Remote(super::msg::Remote),
}

/// The answer to an API send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ApiSendResult {
    pub message_id: i64,
    pub message_seq: u64,
    pub reason: ReasonCode,
}

/// A message to commit, as the commit core takes it.
pub type CommitRequest = domain::send::commit::CommitRequest<Origin>;

/// A commit on its way to the channel's commit shard ([`super::msg::Msg::Commit`]).
pub struct Commit {
    pub request: CommitRequest,
    /// When the gateway decoded the SEND ([`super::super::shared::NodeShared::mono_ns`]): the start
    /// of the `gateway_to_commit` stage.
    pub decoded_ns: u64,
}

/// A `/channel/messagesync` read, served by the channel's commit shard.
pub struct MessageSyncRequest {
    pub channel_type: u8,
    /// The stored channel key.
    pub channel_key: String,
    pub start_seq: u64,
    pub end_seq: u64,
    pub limit: usize,
    pub pull_mode: PullMode,
    /// At most this many bytes copied (`MessageView::copy_bytes`); `more` says the rest.
    pub max_bytes: usize,
    pub reply: Sender<Result<(Vec<StoredMessage>, bool), String>>,
}
