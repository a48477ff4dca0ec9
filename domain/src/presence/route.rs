//! Routes, their identity, the owner actions conflicts ask for, and the errors of the
//! authority. Shared by the authority directory (the slot leader's side) and the
//! owner-local registry and activation machine (the gateway's side), which may be on
//! different nodes: everything here is plain data that an RPC can carry.
//!
//! Rule numbers refer to `docs/authority-rules.md` (each tested in
//! `domain/tests/authority_rules.rs` or `activation_rules.rs`).

use std::sync::Arc;

use crate::cluster::NodeId;

/// A user id. Shared, since one uid appears in many routes, lookups and frames.
pub type Uid = Arc<str>;

/// A random 64-bit id drawn at each process start: separates processes that reuse a node id.
pub type BootId = u64;
/// A connection's id, unique within one process (one `boot_id`).
pub type SessionId = u64;
/// A per-owner monotonic sequence: orders register, touch and unregister of one identity.
pub type OwnerSeq = u64;

/// WuKongIM device level: a Master replaces every route of the same uid and device
/// flag; a Slave replaces only the route of the same device id.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceLevel {
    /// Conflicts only with a route of the same uid, device flag and device id.
    Slave = 0,
    /// Conflicts with every route of the same uid and device flag: another device id
    /// is kicked (DISCONNECT 12) before the newcomer commits.
    Master = 1,
}

/// The listener (transport) a session came in on.
pub use proto::Transport;

/// The identity of a route: `(uid, node_id, boot_id, session_id)`. UID plus node id
/// alone could deliver into a restarted or replaced connection.
#[derive(Clone, PartialEq, Eq, Hash, Debug, serde::Serialize, serde::Deserialize)]
pub struct RouteIdentity {
    /// The user the session logged in as; its hash slot names the authority.
    pub uid: Uid,
    /// The owner (gateway) node of the session.
    pub node_id: NodeId,
    /// The owner process's boot id: a route of an earlier process of the node never
    /// matches one of the current process.
    pub boot_id: BootId,
    /// The owner's connection id, unique within `boot_id`; its top 16 bits name the
    /// owner shard (`send::delivery::session_shard`).
    pub session_id: SessionId,
}

/// One online device of a user, as the authority records it.
#[derive(Clone, PartialEq, Eq, Debug, serde::Serialize, serde::Deserialize)]
pub struct Route {
    /// The user the session logged in as; its hash slot names the authority.
    pub uid: Uid,
    /// The client's device id from CONNECT; a Slave newcomer conflicts only with a
    /// route of the same device id.
    pub device_id: Arc<str>,
    /// The client's device flag from CONNECT (0 APP, 1 WEB, 2 PC, 99 SYSTEM; any other
    /// value compared as a number): routes conflict only within one flag.
    pub device_flag: u8,
    /// Which routes of the same uid and flag this one replaces ([`DeviceLevel`]).
    pub device_level: DeviceLevel,
    /// Owner (gateway) node.
    pub node_id: NodeId,
    /// The owner process's boot id (see [`RouteIdentity::boot_id`]).
    pub boot_id: BootId,
    /// The owner's connection id, unique within `boot_id`.
    pub session_id: SessionId,
    /// The listener the session connected on: TCP or WebSocket, never `Rpc` (one
    /// byte on the inter-node wire).
    #[serde(with = "transport_wire")]
    pub listener: Transport,
    /// The route owner_seq its registry drew at registration; the register, every
    /// touch and every endpoint of the route carry it, and the authority fences
    /// touches below the identity's last seq and anything at or below its
    /// unregister tombstone (rules 12, 16).
    pub owner_seq: OwnerSeq,
    /// When the gateway accepted the session, in milliseconds of its wall clock
    /// (Unix time); carried, never compared.
    pub connected_at_ms: u64,
    /// Last activity, in whole seconds of the authority's clock. `None`: registered
    /// without an activity time; such a route never expires by TTL (rule 23).
    pub last_active_s: Option<u64>,
}

impl Route {
    /// This route's identity.
    pub fn identity(&self) -> RouteIdentity {
        RouteIdentity {
            uid: self.uid.clone(),
            node_id: self.node_id,
            boot_id: self.boot_id,
            session_id: self.session_id,
        }
    }

    /// Whether `self` and `other` (another identity) conflict: same uid and device
    /// flag, and (`self` Master) any device id or (`self` Slave) the same device id.
    /// `self` is the newcomer whose level decides.
    pub fn conflicts_with(&self, other: &Route) -> bool {
        self.uid == other.uid
            && self.device_flag == other.device_flag
            && (self.device_level == DeviceLevel::Master || self.device_id == other.device_id)
            && !(self.node_id == other.node_id
                && self.boot_id == other.boot_id
                && self.session_id == other.session_id)
    }
}

/// What a lookup returns for one online device: enough to push to its owner and for
/// the owner to revalidate `(uid, boot_id, session_id, owner_seq)`.
#[derive(Clone, PartialEq, Eq, Debug, serde::Serialize, serde::Deserialize)]
pub struct Endpoint {
    /// The user the device belongs to.
    pub uid: Uid,
    /// The route's device flag (reported by `/user/onlinestatus`).
    pub device_flag: u8,
    /// The route's device level.
    pub device_level: DeviceLevel,
    /// The owner node: where a push for this device goes.
    pub node_id: NodeId,
    /// The owner process's boot id; a push to another process of the node is dropped
    /// by revalidation.
    pub boot_id: BootId,
    /// The owner's connection id; its top 16 bits name the owner shard.
    pub session_id: SessionId,
    /// The route owner_seq; the owner delivers only while its session's seq equals it
    /// (`Registry::revalidate`).
    pub owner_seq: OwnerSeq,
}

/// An [`Endpoint`] without its uid, as the fast lookup
/// (`AuthorityReader::endpoints_by_targets_compact_into`) returns it: `Copy`, 40
/// bytes, no reference count to touch. `uid_index` is the position of its uid in the
/// uid slice of the looked-up group (the caller already holds that uid).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct CompactEndpoint {
    /// The position of the endpoint's uid in the looked-up group's uid slice.
    pub uid_index: u32,
    /// As [`Endpoint::device_flag`].
    pub device_flag: u8,
    /// As [`Endpoint::device_level`].
    pub device_level: DeviceLevel,
    /// As [`Endpoint::node_id`]: the owner node.
    pub node_id: NodeId,
    /// As [`Endpoint::boot_id`].
    pub boot_id: BootId,
    /// As [`Endpoint::session_id`].
    pub session_id: SessionId,
    /// As [`Endpoint::owner_seq`]: what the owner revalidates against.
    pub owner_seq: OwnerSeq,
}

impl CompactEndpoint {
    /// The full endpoint, given the uid it belongs to (`group_uids[uid_index]`).
    #[inline]
    pub fn endpoint(&self, uid: &Uid) -> Endpoint {
        Endpoint {
            uid: uid.clone(),
            device_flag: self.device_flag,
            device_level: self.device_level,
            node_id: self.node_id,
            boot_id: self.boot_id,
            session_id: self.session_id,
            owner_seq: self.owner_seq,
        }
    }
}

/// What the owner of a conflicting route must do before the newcomer commits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, serde::Serialize, serde::Deserialize)]
pub enum OwnerActionKind {
    /// Send DISCONNECT(12 ConnectKick), then close: a Master replacing another device id.
    KickThenClose,
    /// Close the connection.
    Close,
}

/// An owner action: done by the gateway that owns `route`, acknowledged back to the
/// activation that asked for it.
#[derive(Clone, PartialEq, Eq, Debug, serde::Serialize, serde::Deserialize)]
pub struct OwnerAction {
    /// Kick then close, or close only.
    pub kind: OwnerActionKind,
    /// The conflicting route: its node and boot id name the owner process, its
    /// session id the session to end (already gone, or a process gone, counts as done).
    pub route: RouteIdentity,
    /// The conflicting route's owner_seq as the authority holds it; the commit removes
    /// exactly the conflicts acknowledged at this seq (rule 9).
    pub owner_seq: OwnerSeq,
}

/// Names one pending registration at the authority. Returned by register, presented
/// by commit and abort; a newer registration of the same identity supersedes it.
#[derive(Clone, PartialEq, Eq, Hash, Debug, serde::Serialize, serde::Deserialize)]
pub struct PendingToken {
    /// The identity of the pending route.
    pub identity: RouteIdentity,
    /// The route owner_seq of the registration; commit and abort match it exactly.
    pub owner_seq: OwnerSeq,
    /// Unique per registration within one authority slot.
    pub nonce: u64,
}

/// Why the authority refused a call. Never carries data: a refused call learned nothing.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, serde::Serialize, serde::Deserialize)]
pub enum AuthorityError {
    /// This node holds no authority identity for the hash slot.
    NotLeader,
    /// The call's target differs from the installed identity.
    StaleTarget,
    /// Register at or below the identity's unregister tombstone.
    Tombstoned,
    /// Commit: a conflict appeared since registration, or the candidate is gone.
    NotReady,
    /// Commit or abort of a candidate that a newer registration superseded.
    Superseded,
    /// The slot's directory is at its configured route limit.
    Full,
    /// The call was not sent: the link to the authority's node is down or busy
    /// (reported by the requester's side, never by an authority). Nothing changed
    /// there.
    Unreachable,
    /// The call was sent and its answer will not come: the deadline passed, the
    /// link closed or the peer restarted (reported by the requester's side, never
    /// by an authority). It may have been applied: the caller rolls back as if it
    /// had been.
    Lost,
    /// A lookup of a hash slot whose authority was just installed by a move and
    /// still waits for its previous leader's routes (the handover), up to a
    /// deadline: its empty table would say "offline" of recipients who are online.
    /// Nothing changed; look up again a little later.
    Rebuilding,
}

impl std::fmt::Display for AuthorityError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AuthorityError::NotLeader => "not leader of this hash slot",
            AuthorityError::StaleTarget => "stale target",
            AuthorityError::Tombstoned => "at or below the unregister tombstone",
            AuthorityError::NotReady => "conflicts changed since registration",
            AuthorityError::Superseded => "superseded by a newer registration",
            AuthorityError::Full => "route directory full",
            AuthorityError::Unreachable => "the authority's node could not be reached",
            AuthorityError::Lost => "the authority's answer was lost",
            AuthorityError::Rebuilding => "awaiting the previous leader's routes",
        })
    }
}

impl std::error::Error for AuthorityError {}

/// A call to the authority of one hash slot (sent to an exact [`Target`](crate::cluster::Target)).
#[derive(Clone, PartialEq, Eq, Debug, serde::Serialize, serde::Deserialize)]
pub enum AuthorityRequest {
    /// Register a route; answered `Result<RegisterOutcome, AuthorityError>`.
    Register {
        /// The session's route, with its route owner_seq and activity second.
        route: Route,
    },
    /// Commit a pending candidate; answered `Result<(), AuthorityError>`.
    Commit {
        /// The token the `Pending` answer to the register returned.
        token: PendingToken,
    },
    /// Abort a pending candidate; answered `Result<(), AuthorityError>`.
    Abort {
        /// The token of the candidate to remove.
        token: PendingToken,
    },
    /// Remove the route of `identity`, tombstone at `owner_seq`; answered
    /// `Result<(), AuthorityError>`. Sent from the registry's unregister queue.
    Unregister {
        /// The exact route to remove; another session of the uid is untouched.
        identity: RouteIdentity,
        /// The tombstone seq, drawn fresh when queued: above the route's owner_seq.
        owner_seq: OwnerSeq,
    },
}

/// The outcome of a successful register.
#[derive(Clone, PartialEq, Eq, Debug, serde::Serialize, serde::Deserialize)]
pub enum RegisterOutcome {
    /// No conflict: the route is active at once (rule 6).
    Active,
    /// Conflicts: the route is pending until commit; the owners of the conflicting
    /// routes must first perform `actions` (rules 7, 8).
    Pending {
        /// Names the candidate to commit or abort.
        token: PendingToken,
        /// One action per conflicting route, to perform before the commit.
        actions: Vec<OwnerAction>,
    },
}

/// `Transport` on the inter-node wire: one byte (0 TCP, 1 WebSocket, 2 RPC: never a
/// route's).
mod transport_wire {
    use super::Transport;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(t: &Transport, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u8(match t {
            Transport::Tcp => 0,
            Transport::WebSocket => 1,
            Transport::Rpc => 2,
        })
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Transport, D::Error> {
        match u8::deserialize(d)? {
            0 => Ok(Transport::Tcp),
            1 => Ok(Transport::WebSocket),
            2 => Ok(Transport::Rpc),
            n => Err(serde::de::Error::custom(format!("unknown transport {n}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(uid: &str, device_id: &str, flag: u8, level: DeviceLevel, session_id: u64) -> Route {
        Route {
            uid: uid.into(),
            device_id: device_id.into(),
            device_flag: flag,
            device_level: level,
            node_id: 1,
            boot_id: 9,
            session_id,
            listener: Transport::Tcp,
            owner_seq: session_id,
            connected_at_ms: 0,
            last_active_s: Some(0),
        }
    }

    /// Only the whole identity (node, boot, session) makes a route itself: a route
    /// with the same session id on another node or of another boot conflicts.
    #[test]
    fn a_route_is_itself_only_by_node_boot_and_session_together() {
        let old = route("u", "d1", 1, DeviceLevel::Slave, 1);
        let other_node = Route {
            node_id: 2,
            ..old.clone()
        };
        let other_boot = Route {
            boot_id: 10,
            ..old.clone()
        };
        let other_session = Route {
            session_id: 2,
            ..old.clone()
        };
        for newcomer in [&other_node, &other_boot, &other_session] {
            assert!(newcomer.conflicts_with(&old), "{newcomer:?}");
            assert_ne!(newcomer.identity(), old.identity());
        }
        assert_eq!(
            old.identity(),
            RouteIdentity {
                uid: "u".into(),
                node_id: 1,
                boot_id: 9,
                session_id: 1
            }
        );
    }

    /// The errors read as what they mean (logs and API answers show them).
    #[test]
    fn authority_errors_display_their_meaning() {
        assert_eq!(AuthorityError::Full.to_string(), "route directory full");
        assert_eq!(
            AuthorityError::NotLeader.to_string(),
            "not leader of this hash slot"
        );
        assert_eq!(
            AuthorityError::Lost.to_string(),
            "the authority's answer was lost"
        );
    }

    #[test]
    fn conflict_policy_follows_the_newcomers_level() {
        let old = route("u", "d1", 1, DeviceLevel::Slave, 1);
        let master_other_device = route("u", "d2", 1, DeviceLevel::Master, 2);
        let slave_other_device = route("u", "d2", 1, DeviceLevel::Slave, 3);
        let slave_same_device = route("u", "d1", 1, DeviceLevel::Slave, 4);
        let other_flag = route("u", "d1", 2, DeviceLevel::Master, 5);
        assert!(master_other_device.conflicts_with(&old));
        assert!(!slave_other_device.conflicts_with(&old));
        assert!(slave_same_device.conflicts_with(&old));
        assert!(!other_flag.conflicts_with(&old));
        assert!(
            !old.conflicts_with(&old),
            "a route never conflicts with its own identity"
        );
    }
}
