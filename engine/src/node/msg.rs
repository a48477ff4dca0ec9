//! Every message that crosses between the shards of a node, one variant per hop of
//! the flows. Each names who answers and how the answer finds its way back.
//! (Between nodes, the same hops will travel as inter-node RPCs.)
//!
//! Each message enters the receiving shard's `on_message` ([`super::shard`]), which
//! hands it to the module that owns it (the list is in that module's doc).

use std::sync::Arc;

use net::io::ConnId;
use slots::ShardId;

use crate::activation::{ActivationId, AuthorityRequest, OwnerActionFailed};
use crate::authority::TouchResult;
use crate::cluster::Target;
use crate::registry::UnregisterRequest;
use crate::route::{AuthorityError, Endpoint, OwnerAction, RegisterOutcome, Route, SessionId};

use super::send::{Commit, Committed};

/// A message between shards.
pub enum Msg {
    /// Gateway → authority shard: one authority call for an activation or an
    /// unregister; answered by [`Msg::AuthorityReply`] (or a reply frame to the
    /// requesting node).
    Authority {
        reply_to: ReplyTo<Corr>,
        target: Target,
        request: AuthorityRequest,
    },
    /// Authority shard → gateway.
    AuthorityReply { corr: Corr, reply: AuthorityReply },
    /// Gateway touch worker → authority shard: a TouchRoutes batch.
    Touch {
        reply_to: ReplyTo<()>,
        target: Target,
        routes: Vec<Route>,
    },
    /// Authority shard → gateway: the routes to requeue (those that failed).
    TouchReply { target: Target, failed: Vec<Route> },
    /// New session's gateway → old session's owner: kick or close it.
    OwnerAction {
        reply_to: ReplyTo<(ActivationId, u32)>,
        action: OwnerAction,
    },
    /// Owner → gateway of the activation.
    OwnerActionDone {
        activation: ActivationId,
        index: u32,
        result: Result<(), OwnerActionFailed>,
    },
    /// Gateway (or the HTTP API) → the channel's commit shard: commit a SEND.
    Commit(Box<Commit>),
    /// Commit shard → gateway: write SENDACK to the sending connection.
    SendAck(SendAck),
    /// Commit shard → owner shard: write RECV to these endpoints (revalidated first).
    Push {
        message: Arc<Committed>,
        endpoints: Vec<Endpoint>,
        /// When the commit shard handed this batch over ([`super::NodeShared::mono_ns`]).
        handed_ns: u64,
    },
    /// Control (HTTP API) → every shard: close the sessions of `uid` with
    /// `device_flag` (`None`: every flag); answered on `done`.
    DeviceQuit {
        uid: String,
        device_flag: Option<u8>,
        done: std::sync::mpsc::SyncSender<usize>,
    },
    /// Control → a commit shard: read committed messages of a channel.
    MessageSync(Box<super::send::MessageSyncRequest>),
    /// Control → every shard: a new cluster view (slot leadership moved).
    View(Arc<crate::cluster::ClusterView>),
    /// The shard whose inbound link read a reply → the shard that made the request
    /// (the request id's top 16 bits).
    PeerReply {
        from: (crate::cluster::NodeId, crate::route::BootId),
        request_id: u64,
        reply: Box<super::wire::Reply>,
    },
    /// The shard's log syncer thread → the shard: a sync job ended (a wake-up; the
    /// result is collected by the next `flush_commits`).
    LogSynced,
    /// Control (`POST /node/drain`) → every shard: refuse new client connections,
    /// DISCONNECT every session (unregistered); answered on `done` with how many
    /// connections were disconnected.
    Drain {
        done: std::sync::mpsc::SyncSender<usize>,
    },
    /// Control → every shard: send DISCONNECT to every session, unregister them, stop.
    Shutdown,
    /// Fault injection (tests): the shard panics.
    InjectPanic,
}

/// Where a request's answer goes: the requesting shard of this node over the ring,
/// with the requester's correlation `C` handed back in the reply message; or a
/// request of another node, answered by a reply frame on this shard's link to that
/// node (the requester kept its correlation in its link's in-flight table).
#[derive(Clone, Debug)]
pub enum ReplyTo<C> {
    Shard(ShardId, C),
    Node(Remote),
}

/// A request of another node: answer `request_id` to `node` (its top 16 bits name
/// the requesting shard there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Remote {
    pub node: crate::cluster::NodeId,
    pub request_id: u64,
}

/// Names the activation or unregister an authority reply belongs to.
#[derive(Clone, Debug)]
pub enum Corr {
    Activation(ActivationId),
    Unregister(Box<UnregisterRequest>),
}

/// An authority shard's answer.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub enum AuthorityReply {
    Register(Result<RegisterOutcome, AuthorityError>),
    Commit(Result<(), AuthorityError>),
    Abort(Result<(), AuthorityError>),
    Unregister(Result<(), AuthorityError>),
}

/// SENDACK for one connection of the gateway shard.
#[derive(Clone, Copy, Debug)]
pub struct SendAck {
    pub conn: ConnId,
    pub session_id: SessionId,
    pub client_seq: u32,
    pub message_id: i64,
    pub message_seq: u64,
    pub reason: proto::wkproto::ReasonCode,
}

/// What a touch result means for the owner: requeue `Full` only.
pub fn touch_failed(result: &TouchResult) -> bool {
    matches!(result, TouchResult::Full)
}
