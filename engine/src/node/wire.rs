//! The hops between nodes as frame bodies (`proto::rpc::frame`: the fixed header says
//! the [`Kind`], the sender's node and boot id, the request id and the deadline; the
//! body is one of the enums below in `postcard`, a compact serde format).
//!
//! Three shapes, one per direction of a hop:
//! - [`Request`]: asks the receiving node for something and is answered by exactly one
//!   [`Reply`] frame carrying the same request id (or failed by the requester's link:
//!   deadline, link lost, peer restarted). A request carries no correlation of the
//!   requester's own (activation ids, connections): the requester keeps those with
//!   the request in its link's in-flight table and gets them back with the reply.
//! - [`OneWay`]: needs no answer (owner push, a new cluster view).
//! - [`Reply`]: the answer, sent on the replier's own link to the requester's node
//!   (a link is written by its dialer only); the request id's top 16 bits name the
//!   requesting shard, which the receiving shard forwards it to.
//!
//! Everything here is plain data of `domain` (routes, targets, endpoints, messages):
//! never a session key (the owner encrypts per session).

use std::ops::Range;

use serde::{Deserialize, Serialize};

use proto::rpc::Kind;

use crate::activation::{AuthorityRequest, OwnerActionFailed};
use crate::cluster::{ClusterView, NodeId, Target};
use crate::route::{AuthorityError, BootId, DeviceLevel, Endpoint, OwnerAction, Route, Uid};

use crate::authority::{AuthorityReply, HandoverBatch, TouchAnswer};
use domain::send::commit::Committed;

/// A request to another node.
#[derive(Debug, Serialize, Deserialize)]
pub enum Request {
    /// An authority call at the exact target (its leader is the receiving node).
    Authority {
        target: Target,
        request: AuthorityRequest,
    },
    /// A TouchRoutes batch for one target.
    Touch { target: Target, routes: Vec<Route> },
    /// Kick or close a session owned by the receiving node; answered once done.
    OwnerAction { action: OwnerAction },
    /// A client's SEND, forwarded to its channel's home; answered with the SENDACK.
    Send(Box<ForwardedSend>),
    /// A CONNECT's token, checked at the uid's home (the token never comes back).
    Token {
        uid: String,
        device_flag: u8,
        token: String,
    },
    /// EndpointsByTargets: the endpoints of each group's uids at its exact target
    /// (each group fenced alone); a group is its target and the range of its uids
    /// in `uids`.
    Lookup {
        groups: Vec<(Target, Range<usize>)>,
        uids: Vec<Uid>,
    },
    /// A batch of the routes of a hash slot the sender lost, for its new leader
    /// (the receiving node).
    Handover(HandoverBatch),
    /// An HTTP API request homed on the receiving node, answered by its API as
    /// if it had arrived there, from this node's data only (never passed on).
    Api(Box<ApiCall>),
}

/// An HTTP API request passed to another node (`crate::http::forward`): what the
/// caller sent, its bearer token included (the link is sealed).
#[derive(Debug, Serialize, Deserialize)]
pub struct ApiCall {
    pub method: String,
    /// The path and query, as the caller sent them.
    pub target: String,
    /// The caller's `Authorization` header, checked at the home as anywhere.
    pub authorization: Option<String>,
    pub body: Vec<u8>,
}

/// A SEND forwarded from the gateway's node to the channel's home: the commit
/// request the home's commit core takes (the sending session in `sender`), its
/// answer's address named there.
pub type ForwardedSend = domain::send::commit::CommitRequest<()>;

/// A message that needs no answer (decoded; [`OneWayRef`] encodes it without a
/// copy).
#[derive(Serialize, Deserialize)]
pub enum OneWay {
    /// Owner push: the plaintext message and the exact endpoints (revalidated by the
    /// owner: uid, boot id, session id, owner_seq).
    Push {
        message: Committed,
        endpoints: Vec<Endpoint>,
    },
    /// A cluster view (a node applies only a higher revision).
    View(Box<ClusterView>),
    /// Raft messages of replicated groups: `(slot id, message)`, in order, and
    /// whether the sending node is draining (`POST /node/drain`: its groups'
    /// leaders hand over to other replicas, never to it).
    Raft {
        draining: bool,
        messages: Vec<(u32, Vec<u8>)>,
    },
}

/// [`OneWay`] by reference, for encoding (the same bytes: same variants in the same
/// order).
#[derive(Serialize)]
pub enum OneWayRef<'a> {
    Push {
        message: &'a Committed,
        endpoints: &'a [Endpoint],
    },
    View(&'a ClusterView),
    Raft {
        draining: bool,
        messages: &'a [(u32, Vec<u8>)],
    },
}

/// The answer to a [`Request`].
#[derive(Debug, Serialize, Deserialize)]
pub enum Reply {
    Authority(AuthorityReply),
    /// What the owner does with the batch's routes.
    Touch(TouchAnswer),
    OwnerAction(Result<(), OwnerActionFailed>),
    SendAck {
        message_id: i64,
        message_seq: u64,
        /// The SENDACK reason code.
        reason: u8,
    },
    /// The token matched: the device level it was stored with; `Err`: it did not.
    Token(Result<DeviceLevel, ()>),
    /// One result per group, in request order: the range of its endpoints in
    /// `endpoints`, or why that group alone failed.
    Lookup {
        endpoints: Vec<Endpoint>,
        results: Vec<Result<Range<usize>, AuthorityError>>,
    },
    /// The handover batch was applied (or kept for its view), or why not.
    Handover(Result<(), AuthorityError>),
    /// The API's answer to an [`ApiCall`]: HTTP status and JSON body.
    Api {
        status: u16,
        body: String,
    },
}

impl Request {
    /// The frame kind that carries it.
    pub fn kind(&self) -> Kind {
        match self {
            Request::Authority { request, .. } => match request {
                AuthorityRequest::Register { .. } => Kind::AuthorityRegister,
                AuthorityRequest::Commit { .. } => Kind::AuthorityCommit,
                AuthorityRequest::Abort { .. } => Kind::AuthorityAbort,
                AuthorityRequest::Unregister { .. } => Kind::AuthorityUnregister,
            },
            Request::Touch { .. } => Kind::TouchBatch,
            Request::OwnerAction { .. } => Kind::OwnerAction,
            Request::Send(_) => Kind::ForwardedSend,
            Request::Lookup { .. } => Kind::EndpointLookup,
            Request::Token { .. } => Kind::TokenLookup,
            Request::Handover(_) => Kind::Handover,
            Request::Api(_) => Kind::ApiRequest,
        }
    }
}

impl OneWayRef<'_> {
    /// The frame kind that carries it.
    pub fn kind(&self) -> Kind {
        match self {
            OneWayRef::Push { .. } => Kind::Push,
            OneWayRef::View(_) => Kind::View,
            OneWayRef::Raft { .. } => Kind::Raft,
        }
    }
}

/// What a received frame's body is, by its kind.
pub enum Body {
    Request(Request),
    OneWay(OneWay),
    Reply(Reply),
}

/// A body that does not decode as its kind says, or holds a field no node of this
/// cluster sends ([`Bounds`]).
#[derive(Debug, thiserror::Error)]
#[error("{kind:?} body {error}")]
pub struct BadBody {
    pub kind: Kind,
    pub error: BodyError,
}

/// Why a body was refused.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("does not decode: {0}")]
    Decode(postcard::Error),
    #[error("is invalid: {0}")]
    Invalid(String),
}

/// What a peer's frame is checked against where it is decoded: this process and
/// its cluster. Every field a handler would index with, divide by or route on is
/// checked here, so no frame of a peer (buggy, of another version, or forging on a
/// link it authenticated) can crash the node: a bad one closes its link.
#[derive(Clone, Debug)]
pub struct Bounds {
    /// This node and process: an owner action for one of its sessions must name a
    /// shard it has.
    pub node_id: NodeId,
    pub boot_id: BootId,
    pub shard_count: usize,
    /// The cluster's nodes in config order and its slot id count: a view must fit
    /// them ([`ClusterView::check`]).
    pub nodes: Vec<NodeId>,
    pub slot_ids: u32,
}

impl Bounds {
    /// Checks a decoded body from node `from` (the link's authenticated peer).
    pub fn check(&self, body: &Body, from: NodeId) -> Result<(), String> {
        match body {
            Body::Request(Request::Authority { target, request }) => {
                check_target(target)?;
                let node = match request {
                    AuthorityRequest::Register { route } => route.node_id,
                    AuthorityRequest::Commit { token } | AuthorityRequest::Abort { token } => {
                        token.identity.node_id
                    }
                    AuthorityRequest::Unregister { identity, .. } => identity.node_id,
                };
                check_own_route(node, from)
            }
            Body::Request(Request::Touch { target, routes }) => {
                check_target(target)?;
                routes
                    .iter()
                    .try_for_each(|r| check_own_route(r.node_id, from))
            }
            Body::Request(Request::Lookup { groups, .. }) => {
                groups.iter().try_for_each(|(t, _)| check_target(t))
            }
            Body::Request(Request::Handover(b)) => {
                check_target(&b.target)?;
                if b.target.leader_node_id != self.node_id {
                    return Err(format!(
                        "a handover for node {}'s slot",
                        b.target.leader_node_id
                    ));
                }
                if b.batch >= b.batches || b.batches > HANDOVER_BATCHES_MAX {
                    return Err(format!(
                        "handover batch {} of {} (at most {HANDOVER_BATCHES_MAX})",
                        b.batch, b.batches
                    ));
                }
                Ok(())
            }
            Body::Request(Request::OwnerAction { action }) => {
                let r = &action.route;
                let shard = crate::delivery::session_shard(r.session_id) as usize;
                let ours = r.node_id == self.node_id && r.boot_id == self.boot_id;
                if ours && shard >= self.shard_count {
                    return Err(format!(
                        "owner action for a session of shard {shard} ({} shards here)",
                        self.shard_count
                    ));
                }
                Ok(())
            }
            Body::OneWay(OneWay::View(view)) => view
                .check(&self.nodes, self.slot_ids)
                .map_err(|e| format!("view: {e}")),
            Body::OneWay(OneWay::Raft { messages, .. }) => check_raft(messages, self.slot_ids),
            // A push's endpoints are revalidated by the owner (which drops those of
            // another node, process or shard); a reply's content is checked by the
            // machine it answers; a SEND's, a token check's and an API request's
            // fields are data (the API checks a request as any it receives).
            Body::Request(Request::Send(_) | Request::Token { .. } | Request::Api(_))
            | Body::OneWay(OneWay::Push { .. })
            | Body::Reply(_) => Ok(()),
        }
    }
}

/// A frame of raft messages holds at most [`RAFT_MESSAGES_MAX`], each of a slot id
/// the cluster has.
fn check_raft(messages: &[(u32, Vec<u8>)], slot_ids: u32) -> Result<(), String> {
    if messages.len() > RAFT_MESSAGES_MAX {
        return Err(format!(
            "{} raft messages in one frame (at most {RAFT_MESSAGES_MAX})",
            messages.len()
        ));
    }
    match messages.iter().find(|(s, _)| *s >= slot_ids) {
        Some((s, _)) => Err(format!(
            "a raft message of slot id {s} ({slot_ids} slot ids)"
        )),
        None => Ok(()),
    }
}

/// Raft messages in one frame at most.
pub const RAFT_MESSAGES_MAX: usize = 1 << 16;

/// Batches of one handover at most: a slot's routes (at most
/// `routes_per_slot_max`, 65,536 by default) one per batch.
pub const HANDOVER_BATCHES_MAX: u32 = 1 << 20;

/// A node registers, commits, aborts, unregisters and touches the routes of its own
/// sessions only.
fn check_own_route(node: NodeId, from: NodeId) -> Result<(), String> {
    if node != from {
        return Err(format!("a route of node {node} sent by node {from}"));
    }
    Ok(())
}

fn check_target(target: &Target) -> Result<(), String> {
    if usize::from(target.hash_slot) >= slots::HASH_SLOTS {
        return Err(format!("hash slot {} (at most 255)", target.hash_slot));
    }
    Ok(())
}

/// Appends `value`'s body to `out` (cleared first).
pub fn encode<T: Serialize>(value: &T, out: &mut Vec<u8>) {
    out.clear();
    let taken = std::mem::take(out);
    // Serializing plain data into a Vec cannot fail.
    *out = postcard::to_extend(value, taken).unwrap_or_default();
}

/// Decodes a frame body of `kind` from node `from` and checks it against `bounds`
/// (`None`: a control kind, which is not a hop).
pub fn decode(
    kind: Kind,
    body: &[u8],
    bounds: &Bounds,
    from: NodeId,
) -> Option<Result<Body, BadBody>> {
    let decoded = decode_unchecked(kind, body)?;
    Some(
        decoded.and_then(|body| match body_kind(&body).filter(|k| *k != kind) {
            // A body of another kind than its frame says (a variant of the same enum).
            Some(other) => Err(BadBody {
                kind,
                error: BodyError::Invalid(format!("a {other:?} body")),
            }),
            None => Ok(body),
        }),
    )
    .map(|decoded| {
        decoded.and_then(|body| match bounds.check(&body, from) {
            Ok(()) => Ok(body),
            Err(why) => Err(BadBody {
                kind,
                error: BodyError::Invalid(why),
            }),
        })
    })
}

/// The kind a decoded request or one-way body is sent as (a reply's is `Reply`).
fn body_kind(body: &Body) -> Option<Kind> {
    match body {
        Body::Request(r) => Some(r.kind()),
        Body::OneWay(OneWay::Push { .. }) => Some(Kind::Push),
        Body::OneWay(OneWay::View(_)) => Some(Kind::View),
        Body::OneWay(OneWay::Raft { .. }) => Some(Kind::Raft),
        Body::Reply(_) => None,
    }
}

fn decode_unchecked(kind: Kind, body: &[u8]) -> Option<Result<Body, BadBody>> {
    let bad = |error| BadBody {
        kind,
        error: BodyError::Decode(error),
    };
    Some(match kind {
        Kind::Push | Kind::View | Kind::Raft => {
            postcard::from_bytes(body).map(Body::OneWay).map_err(bad)
        }
        Kind::Reply => postcard::from_bytes(body).map(Body::Reply).map_err(bad),
        Kind::AuthorityRegister
        | Kind::AuthorityCommit
        | Kind::AuthorityAbort
        | Kind::AuthorityUnregister
        | Kind::TouchBatch
        | Kind::EndpointLookup
        | Kind::OwnerAction
        | Kind::ForwardedSend
        | Kind::TokenLookup
        | Kind::Handover
        | Kind::ApiRequest => postcard::from_bytes(body).map(Body::Request).map_err(bad),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::Transport;

    fn route() -> Route {
        Route {
            uid: "u1".into(),
            device_id: "d".into(),
            device_flag: 1,
            device_level: DeviceLevel::Master,
            node_id: 2,
            boot_id: 77,
            session_id: 5,
            listener: Transport::WebSocket,
            owner_seq: 9,
            connected_at_ms: 1234,
            last_active_s: Some(3),
        }
    }

    /// `touch_batch_bytes_max` bounds a TouchRoutes body: every integer at its
    /// largest, both strings at their limits.
    #[test]
    fn a_routes_fixed_part_fits_its_bound() {
        let (uid, device) = ("u".repeat(300), "d".repeat(70_000));
        let route = Route {
            uid: uid.as_str().into(),
            device_id: device.as_str().into(),
            device_flag: u8::MAX,
            node_id: u64::MAX,
            boot_id: u64::MAX,
            session_id: u64::MAX,
            owner_seq: u64::MAX,
            connected_at_ms: u64::MAX,
            last_active_s: Some(u64::MAX),
            ..route()
        };
        let target = crate::cluster::Target {
            hash_slot: u16::MAX,
            slot_id: u32::MAX,
            leader_node_id: u64::MAX,
            leader_term: u64::MAX,
            config_epoch: u64::MAX,
        };
        let mut body = Vec::new();
        encode(
            &Request::Touch {
                target,
                routes: vec![route.clone(), route.clone()],
            },
            &mut body,
        );
        let config = crate::node::SessionConfig {
            touch_batch_routes_max: 2,
            uid_bytes_max: uid.len(),
            device_id_bytes_max: device.len(),
            ..Default::default()
        };
        assert!(body.len() <= crate::node::touch_batch_bytes_max(&config));
        // A handover batch of as many items (routes, or tombstones: smaller) and
        // its numbers fits the same bound.
        let batch = HandoverBatch {
            target,
            routes: vec![route.clone(), route],
            tombstones: vec![],
            batch: u32::MAX - 1,
            batches: u32::MAX,
        };
        encode(&Request::Handover(batch), &mut body);
        assert!(body.len() <= crate::node::touch_batch_bytes_max(&config));
    }

    /// A handover batch for another node's identity, or with numbers that do not
    /// fit, closes the link (it is not applied).
    #[test]
    fn a_handover_batch_is_checked_where_it_is_decoded() {
        let view = ClusterView::initial(&[1, 2, 3], 64).unwrap();
        let mine = (0..=255u16)
            .map(|h| view.target_for_slot(h))
            .find(|t| t.leader_node_id == 1)
            .unwrap();
        let batch = |target, batch, batches| {
            let mut body = Vec::new();
            encode(
                &Request::Handover(HandoverBatch {
                    target,
                    routes: vec![route()],
                    tombstones: vec![],
                    batch,
                    batches,
                }),
                &mut body,
            );
            decode(Kind::Handover, &body)
        };
        assert!(matches!(
            batch(mine, 0, 1),
            Some(Ok(Body::Request(Request::Handover(_))))
        ));
        let theirs = Target {
            leader_node_id: 2,
            ..mine
        };
        assert!(matches!(batch(theirs, 0, 1), Some(Err(_))), "node 2's slot");
        assert!(
            matches!(batch(mine, 1, 1), Some(Err(_))),
            "batch past the count"
        );
        let too_many = HANDOVER_BATCHES_MAX + 1;
        assert!(matches!(batch(mine, 0, too_many), Some(Err(_))));
        let bad_slot = Target {
            hash_slot: 300,
            ..mine
        };
        assert!(matches!(batch(bad_slot, 0, 1), Some(Err(_))));
    }

    fn bounds() -> Bounds {
        Bounds {
            node_id: 1,
            boot_id: 0xb0,
            shard_count: 2,
            nodes: vec![1, 2, 3],
            slot_ids: 64,
        }
    }

    fn decode(kind: Kind, body: &[u8]) -> Option<Result<Body, BadBody>> {
        super::decode(kind, body, &bounds(), 2)
    }

    #[test]
    fn a_request_survives_the_wire_and_names_its_kind() {
        let target = ClusterView::initial(&[1, 2, 3], 64)
            .unwrap()
            .target_for_uid("u1");
        let request = Request::Authority {
            target,
            request: AuthorityRequest::Register { route: route() },
        };
        assert_eq!(request.kind(), Kind::AuthorityRegister);
        let mut body = Vec::new();
        encode(&request, &mut body);
        let Some(Ok(Body::Request(Request::Authority { target: t, request }))) =
            decode(Kind::AuthorityRegister, &body)
        else {
            panic!("not an authority request");
        };
        assert_eq!(t, target);
        assert_eq!(request, AuthorityRequest::Register { route: route() });
    }

    /// A frame of raft messages names slot ids the cluster has, and holds at most
    /// `RAFT_MESSAGES_MAX`.
    #[test]
    fn raft_messages_are_bounded() {
        let b = bounds();
        let check = |messages: Vec<(u32, Vec<u8>)>| {
            let draining = false;
            b.check(&Body::OneWay(OneWay::Raft { draining, messages }), 2)
        };
        assert_eq!(check(vec![(0, vec![1]), (b.slot_ids - 1, vec![])]), Ok(()));
        let e = check(vec![(0, vec![]), (b.slot_ids, vec![])]).unwrap_err();
        assert!(e.contains(&format!("slot id {}", b.slot_ids)), "{e}");
        assert_eq!(check(vec![(0, vec![]); RAFT_MESSAGES_MAX]), Ok(()));
        let e = check(vec![(0, vec![]); RAFT_MESSAGES_MAX + 1]).unwrap_err();
        assert!(e.contains("raft messages in one frame"), "{e}");
    }

    #[test]
    fn a_view_survives_the_wire() {
        let mut view = ClusterView::initial(&[1, 2, 3], 64).unwrap();
        view.revision = 7;
        view.slots[3].leader_node_id = 2;
        let mut body = Vec::new();
        encode(&OneWayRef::View(&view), &mut body);
        let Some(Ok(Body::OneWay(OneWay::View(got)))) = decode(Kind::View, &body) else {
            panic!("not a view");
        };
        assert_eq!(*got, view);
    }

    #[test]
    fn a_body_of_another_kind_or_garbage_is_refused() {
        let mut body = Vec::new();
        encode(&Reply::OwnerAction(Ok(())), &mut body);
        assert!(matches!(decode(Kind::View, &body), Some(Err(_))));
        assert!(matches!(decode(Kind::Reply, &[0xff; 3]), Some(Err(_))));
        // A body of another variant of the frame's enum: a raft frame in a view's.
        let messages = &[(1, vec![7])];
        encode(
            &OneWayRef::Raft {
                draining: true,
                messages,
            },
            &mut body,
        );
        let Some(Ok(Body::OneWay(OneWay::Raft { draining, messages }))) = decode(Kind::Raft, &body)
        else {
            panic!("a raft body");
        };
        assert!(draining, "the sender's draining flag survives the wire");
        assert_eq!(messages, vec![(1, vec![7])]);
        let Some(Err(e)) = decode(Kind::View, &body) else {
            panic!("a raft body taken as a view");
        };
        assert!(e.to_string().contains("a Raft body"), "{e}");
        let mut request = Vec::new();
        let token = Request::Token {
            uid: "u".into(),
            device_flag: 1,
            token: "t".into(),
        };
        encode(&token, &mut request);
        assert!(matches!(decode(Kind::TokenLookup, &request), Some(Ok(_))));
        assert!(matches!(decode(Kind::OwnerAction, &request), Some(Err(_))));
        assert!(decode(Kind::Hello, &body).is_none());
    }
}
