//! Every message that crosses between the shards of a node. The hops of the flows
//! that are requests and replies (authority calls, touch batches, owner actions,
//! …) are one vocabulary with the hops between nodes: a [`super::wire::Request`]
//! with a [`ReplyTo`], answered by a [`super::wire::Reply`] with the request's
//! [`Pending`], whether the ring or a link carries them.
//!
//! Each message enters the receiving shard's `on_message` ([`super::shard`]), which
//! hands it to the module that owns it (the list is in that module's doc).

use std::sync::Arc;

use net::io::ConnId;
use slots::ShardId;

use crate::activation::{ActivationId, AuthorityRequest};
use crate::cluster::Target;
use crate::registry::UnregisterRequest;
use crate::route::{AuthorityError, Endpoint, Route, SessionId};

use domain::send::commit::Committed;
use proto::wkproto::{ConnectPacket, ReasonCode};
use tokio::sync::mpsc::Sender;

use crate::store::{PullMode, StoredMessage};

/// A message between shards.
pub enum Msg {
    /// A hop's request (`wire::Request`: an authority call, a touch batch, an owner
    /// action, …) to the shard that serves it, from a shard of this node or handed
    /// on by the shard whose link read it from another node; answered by
    /// [`Msg::Reply`] on the ring or a reply frame on the link ([`ReplyTo`]).
    Request(Box<RequestHop>),
    /// The answer to a request of this shard, with what the request left behind:
    /// the same [`Pending`] and [`super::wire::Reply`] a reply frame from another
    /// node brings, handled by the same code.
    Reply(Box<ReplyHop>),
    /// Gateway (or the HTTP API) → the channel's commit shard: commit a SEND.
    Commit(Box<Commit>),
    /// Commit shard → gateway: write SENDACK to the sending connection.
    SendAck(SendAck),
    /// Commit shard → owner shard: write RECV to these endpoints (revalidated first).
    Push {
        message: Arc<Committed>,
        endpoints: Vec<Endpoint>,
        /// When the commit shard handed this batch over ([`super::shared::NodeShared::mono_ns`]).
        handed_ns: u64,
    },
    /// Control (HTTP API) → every shard: close the sessions of `uid` with
    /// `device_flag` (`None`: every flag); answered on `done`.
    DeviceQuit {
        uid: String,
        device_flag: Option<u8>,
        done: tokio::sync::mpsc::Sender<usize>,
    },
    /// Control → a commit shard: read committed messages of a channel.
    MessageSync(Box<MessageSyncRequest>),
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
        done: tokio::sync::mpsc::Sender<usize>,
    },
    /// Control → every shard: send DISCONNECT to every session, unregister them, stop.
    Shutdown,
    /// The HTTP API → any shard: pass an API request to another node on this
    /// shard's link to it (the hop `Api`, `crate::http::forward`); its answer, or
    /// why none came, on the call's `answer`.
    ApiForward(Box<ApiForward>),
    /// The HTTP API → the shard whose link read another node's API request: the
    /// answer to send back ([`super::wire::Reply::Api`]).
    ApiAnswered(Box<ApiAnswered>),
    /// Fault injection (tests): the shard panics.
    InjectPanic,
    /// A peer's raft message for a group of this shard (read by another shard).
    Raft(Box<RaftIn>),
    /// The HTTP API → the shard of a slot id's group (replicas above 1): propose a
    /// catalog change; answered on `done` once applied here at its commit.
    CatalogPropose(Box<CatalogPropose>),
}

/// A catalog change for a replicated group ([`Msg::CatalogPropose`]).
pub struct CatalogPropose {
    pub slot_id: u32,
    pub op: super::catalog::CatalogOp,
    pub done: CatalogDone,
}

/// Where a catalog change's outcome goes.
pub type CatalogDone = tokio::sync::mpsc::Sender<Result<(), CatalogRefused>>;

/// Why a catalog change proposed to a group was not applied.
#[derive(Debug)]
pub enum CatalogRefused {
    /// This node's replica does not serve as the group's leader (not elected, its
    /// first entry not committed yet, or no replica here): ask the leader.
    NotLeader,
    /// Proposed, then cut or its leader lost office before the commit: it may
    /// still commit; the caller retries (the op sets values: a second copy is
    /// harmless).
    Lost,
    /// Proposals waiting for their commit on this shard are at their limit
    /// (`[commit] commits_unsynced_max`).
    Busy,
    /// Committed, and this node's store refused it (a limit, a disk error).
    Store(crate::store::MetaError),
}

/// Where an API request passed to another node gets its answer: the status and
/// body its API gave, or why none came.
pub type ApiAnswerTo = tokio::sync::oneshot::Sender<Result<(u16, String), domain::hop::NoAnswer>>;

/// An API request for another node ([`Msg::ApiForward`]).
pub struct ApiForward {
    pub node: crate::cluster::NodeId,
    pub call: super::wire::ApiCall,
    /// How long the other node has to answer (the frame's deadline).
    pub deadline_ms: u32,
    pub answer: ApiAnswerTo,
}

/// The answer of this node's API to another node's request ([`Msg::ApiAnswered`]).
pub struct ApiAnswered {
    pub to: Remote,
    pub status: u16,
    pub body: String,
}

/// Another node's API request, read by shard `shard`'s link, for this node's API
/// (its runtime serves it and hands the answer back to `shard`).
pub struct PeerApiCall {
    pub from: Remote,
    pub shard: ShardId,
    pub call: Box<super::wire::ApiCall>,
}

/// A hop's request on the ring. Boxed, like the other rare messages, so that a
/// ring slot stays the size of the SEND path's messages (`Msg` is moved by value
/// through the rings).
pub struct RequestHop {
    pub reply_to: ReplyTo,
    pub request: super::wire::Request,
}

/// A hop's answer on the ring (boxed: see [`RequestHop`]).
pub struct ReplyHop {
    pub pending: Pending,
    pub reply: super::wire::Reply,
}

/// Where a request's answer goes: the requesting shard of this node over the ring,
/// with what the request left behind ([`Pending`]) handed back in [`Msg::Reply`];
/// or a request of another node, answered by a reply frame on this shard's link to
/// that node (the requester keeps its [`Pending`] in its link's in-flight table).
pub enum ReplyTo {
    Shard(ShardId, Pending),
    Node(Remote),
}

/// A request of another node: answer `request_id` to `node` (its top 16 bits name
/// the requesting shard there), to its process `boot` (the frame's checked sender),
/// while in time for `deadline_at_ms` (on the node's clock, `NodeShared::mono_ms`,
/// from the frame's relative deadline when it was read:
/// `domain::hop::serve::in_time`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Remote {
    pub node: crate::cluster::NodeId,
    pub boot: crate::route::BootId,
    pub request_id: u64,
    pub deadline_at_ms: Option<u64>,
}

/// Names the activation or unregister an authority reply belongs to.
#[derive(Clone, Debug)]
pub enum Corr {
    Activation(ActivationId),
    Unregister(Box<UnregisterRequest>),
}

/// What a request leaves behind until its reply (or failure): in the ring message
/// when it goes to a shard of this node, in the link's in-flight table when it goes
/// to another node. The reply, or the failure, hands it back.
pub enum Pending {
    /// An activation's or an unregister's authority call.
    Authority { corr: Corr, kind: AuthorityCall },
    /// A TouchRoutes batch (requeued if it fails; kept only for another node: a
    /// ring message is not lost but dropped with a count, and the touch flush
    /// requeues by timer).
    Touch { target: Target, routes: Vec<Route> },
    /// An activation's owner action.
    OwnerAction {
        activation: ActivationId,
        index: u32,
    },
    /// A SEND forwarded to its channel's home: the SENDACK goes to this connection.
    Send {
        conn: ConnId,
        session_id: SessionId,
        client_seq: u32,
    },
    /// A delivery page's endpoint lookup.
    Lookup { lookup_id: u64 },
    /// A CONNECT waiting for its token's check at the uid's home.
    Token {
        conn: ConnId,
        connect: Box<OwnedConnect>,
    },
    /// A batch of a lost hash slot's routes, to its new leader.
    Handover,
    /// An HTTP API request passed to another node.
    Api { answer: ApiAnswerTo },
}

/// Which authority call a pending one is (the shape of its failure).
#[derive(Clone, Copy, Debug)]
pub enum AuthorityCall {
    Register,
    Commit,
    Abort,
    Unregister,
}

impl AuthorityCall {
    pub fn of(request: &AuthorityRequest) -> AuthorityCall {
        match request {
            AuthorityRequest::Register { .. } => AuthorityCall::Register,
            AuthorityRequest::Commit { .. } => AuthorityCall::Commit,
            AuthorityRequest::Abort { .. } => AuthorityCall::Abort,
            AuthorityRequest::Unregister { .. } => AuthorityCall::Unregister,
        }
    }

    pub fn failed(self, err: AuthorityError) -> AuthorityReply {
        match self {
            AuthorityCall::Register => AuthorityReply::Register(Err(err)),
            AuthorityCall::Commit => AuthorityReply::Commit(Err(err)),
            AuthorityCall::Abort => AuthorityReply::Abort(Err(err)),
            AuthorityCall::Unregister => AuthorityReply::Unregister(Err(err)),
        }
    }
}

pub use crate::authority::AuthorityReply;

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

#[cfg(test)]
mod tests {
    /// Every message is moved by value through the rings, so a ring slot is as
    /// large as the largest variant: rare large messages are boxed to keep the SEND
    /// path's slots small (a hop with a route inline made it 152 bytes).
    #[test]
    fn a_ring_slot_stays_small() {
        assert!(
            std::mem::size_of::<super::Msg>() <= 48,
            "Msg is {} bytes: box the variant that grew",
            std::mem::size_of::<super::Msg>()
        );
    }
}

/// CONNECT fields copied out of the input buffer.
pub struct OwnedConnect {
    pub(super) version: u8,
    pub(super) device_flag: u8,
    pub(super) device_id: String,
    pub(super) uid: String,
    pub(super) token: String,
    pub(super) client_timestamp_ms: i64,
    pub(super) client_key: String,
}

impl From<&ConnectPacket<'_>> for OwnedConnect {
    fn from(c: &ConnectPacket<'_>) -> Self {
        OwnedConnect {
            version: c.version,
            device_flag: c.device_flag.0,
            device_id: c.device_id.to_owned(),
            uid: c.uid.to_owned(),
            token: c.token.to_owned(),
            client_timestamp_ms: c.client_timestamp_ms,
            client_key: c.client_key.to_owned(),
        }
    }
}

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
    Remote(Remote),
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

/// A commit on its way to the channel's commit shard ([`Msg::Commit`]).
pub struct Commit {
    pub request: CommitRequest,
    /// When the gateway decoded the SEND ([`super::shared::NodeShared::mono_ns`]): the start
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
    pub bytes_max: usize,
    pub reply: Sender<Result<(Vec<StoredMessage>, bool), SyncRefused>>,
}

/// Why a `/channel/messagesync` read was not answered.
#[derive(Debug)]
pub enum SyncRefused {
    /// Replicated: this replica does not serve as the channel's group leader, or
    /// lost office before its ReadIndex was confirmed (503: retry).
    NotLeader,
    /// Replicated: too many reads wait for their ReadIndex on this shard (503).
    Busy,
    /// The log failed the read (500).
    Log(String),
}

/// What a shard's timers carry.
#[derive(Clone, Copy, Debug)]
pub enum NodeTimer {
    /// An activation's deadline.
    Activation(ActivationId),
    /// The touch worker's flush (and the unregister queue's drain).
    TouchFlush,
    /// The authority's expiry pass.
    Expiry,
    /// The ack timeout of a connection's oldest unacknowledged RECV.
    Ack { conn: ConnId },
    /// The interval fsync policy's sync of the log.
    LogSync,
    /// The inter-node links' timers (dials, deadlines, heartbeats, silence).
    Peers,
    /// The replicated groups' ticks (`[cluster] raft_tick_ms`).
    Raft,
}

/// A peer's raft messages for groups of one shard of this node, `(slot id,
/// bytes)` each, in the order the peer's frame held them.
#[derive(Debug)]
pub struct RaftIn {
    pub from: crate::cluster::NodeId,
    pub messages: Vec<(u32, Vec<u8>)>,
}
