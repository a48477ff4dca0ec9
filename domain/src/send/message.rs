//! A committed message and what its delivery carries: the message as every push
//! batch shares it ([`Committed`]), the session that sent it ([`Sender`], whose own
//! echo is suppressed) and the delivery the commit core hands the planner
//! ([`Delivery`]). Below both the commit core (`send::commit`) and the planner
//! (`send::delivery`), which each take them from here.

use std::sync::Arc;

use crate::cluster::NodeId;
use crate::presence::route::{BootId, SessionId, Uid};
use crate::send::channel::{recv_channel_id, Subscribers};

/// A committed message, shared by every push batch of its fan-out (and carried by
/// the owner-push hop to other nodes: plaintext, never a session key).
#[derive(serde::Serialize, serde::Deserialize)]
pub struct Committed {
    /// When the commit was appended (the driver's monotonic clock, ns): the start
    /// of the RECV latency. Not on the wire (clocks differ between nodes): a
    /// receiving node sets its own arrival time.
    #[serde(skip)]
    pub committed_ns: u64,
    /// The message id the core assigned (`MessageIdGen`): unique in the cluster, what
    /// clients drop a second RECV by.
    pub message_id: i64,
    /// The message's seq in its channel, from the log's append (0 for a NoPersist
    /// message, which is not stored).
    pub message_seq: u64,
    /// When it was committed, in Unix seconds of the commit shard's wall clock (the
    /// RECV's timestamp).
    pub timestamp_s: u32,
    /// The sender's uid (the API request's `from_uid` for the HTTP API).
    pub from_uid: Uid,
    /// The stored channel key: a group's id, or a person channel's `x@y` key (a RECV
    /// names the other party instead, `recv_channel_id`).
    pub channel_key: String,
    /// The wkproto channel_type (1 person, 2 group).
    pub channel_type: u8,
    /// The sender's client message number, echoed in the RECV; the idempotency key
    /// (empty: not deduplicated).
    pub client_msg_no: String,
    /// The RECV setting byte, as the SEND set it.
    pub setting: u8,
    /// The SEND header flags (NoPersist, SyncOnce, RedDot).
    pub flags: u8,
    /// The SEND's expire field, in seconds; carried to the RECV and the webhook, not
    /// enforced here.
    pub expire_s: u32,
    /// The SEND's topic (empty: none).
    pub topic: String,
    /// The plaintext payload (each owner encrypts it per session).
    pub payload: Vec<u8>,
}

/// A RECV's message as the pending-ACK machine sees it.
impl crate::send::acks::AckMessage for Arc<Committed> {
    fn message_id(&self) -> i64 {
        self.message_id
    }

    /// Its payload and strings, whether or not other sessions share the message.
    fn charge_bytes(&self) -> usize {
        self.payload.len()
            + self.topic.len()
            + self.client_msg_no.len()
            + self.from_uid.len()
            + self.channel_key.len()
    }
}

impl Committed {
    /// A person channel's recipients: the peer, and the sender's other devices.
    pub fn person_recipients(&self) -> Vec<Uid> {
        let peer = recv_channel_id(&self.channel_key, self.channel_type, &self.from_uid);
        if *peer == *self.from_uid {
            vec![self.from_uid.clone()]
        } else {
            vec![Uid::from(peer), self.from_uid.clone()]
        }
    }

    /// How many uids [`person_recipients`](Self::person_recipients) gives, without
    /// building them (the planner asks it for every page it considers).
    pub fn person_recipient_count(&self) -> usize {
        let peer = recv_channel_id(&self.channel_key, self.channel_type, &self.from_uid);
        if *peer == *self.from_uid {
            1
        } else {
            2
        }
    }
}

/// The exact session that sent a message, whose own echo is suppressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Sender {
    /// The gateway node of the sending session.
    pub node_id: NodeId,
    /// That node's process (boot id) when the SEND came in.
    pub boot_id: BootId,
    /// The sending session's id; an endpoint equal in all three fields gets no push.
    pub session_id: SessionId,
}

/// A committed message ready for delivery: the message, who sent it (for
/// suppression), the group's subscribers at commit time, and its byte charge.
pub struct Delivery {
    /// The committed message, shared by every push batch.
    pub message: Arc<Committed>,
    /// The sending session, whose own RECV is suppressed (`None`: the HTTP API).
    pub sender: Option<Sender>,
    /// A group's subscribers at commit time; `None` for a person channel, whose
    /// recipients come from the message ([`Committed::person_recipients`]).
    pub subscribers: Option<Arc<Subscribers>>,
    /// What it is charged against `backlog_budget_bytes` until delivered.
    pub charge_bytes: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::send::acks::AckMessage;

    fn message(channel_key: &str, channel_type: u8, from_uid: &str) -> Committed {
        Committed {
            committed_ns: 0,
            message_id: 42,
            message_seq: 7,
            timestamp_s: 0,
            from_uid: Uid::from(from_uid),
            channel_key: channel_key.to_owned(),
            channel_type,
            client_msg_no: "n".repeat(3),
            setting: 0,
            flags: 0,
            expire_s: 0,
            topic: "t".repeat(5),
            payload: vec![0; 100],
        }
    }

    /// A pending RECVACK is charged the message's payload and strings (the
    /// pending-ACK budget counts these bytes), and named by its message id.
    #[test]
    fn an_unacknowledged_recv_is_charged_its_payload_and_strings() {
        let m = Arc::new(message("alice@bob", 1, "alice"));
        assert_eq!(m.message_id(), 42);
        assert_eq!(m.charge_bytes(), 100 + 5 + 3 + 5 + 9);
    }

    /// A person channel's recipients: the peer and the sender (its other devices);
    /// a note to oneself has one recipient. The count agrees without building them.
    #[test]
    fn a_person_channel_reaches_the_peer_and_the_sender() {
        let key = crate::send::channel::person_channel_key("alice", "bob");
        let to_bob = message(&key, 1, "alice");
        let recipients = to_bob.person_recipients();
        let uids: Vec<&str> = recipients.iter().map(|u| &**u).collect();
        assert_eq!(uids, ["bob", "alice"]);
        assert_eq!(to_bob.person_recipient_count(), 2);
        let to_self = message(
            &crate::send::channel::person_channel_key("alice", "alice"),
            1,
            "alice",
        );
        assert_eq!(to_self.person_recipients().len(), 1);
        assert_eq!(&*to_self.person_recipients()[0], "alice");
        assert_eq!(to_self.person_recipient_count(), 1);
    }
}
