//! Raft messages on the wire, in our own postcard encoding.
//!
//! No protobuf is parsed from a peer (protobuf 2.28: RUSTSEC-2024-0437): a
//! `Message` of raft-rs is turned into a `WireMessage` (plain data, postcard)
//! before it leaves, and a peer's bytes are decoded into a `WireMessage`,
//! checked, then built into a `Message` field by field. A conf-change entry, whose
//! data raft-rs writes in protobuf, travels decoded (as `WireConfChange` or
//! `WireConfChangeV2`) and is re-encoded here, locally, before raft-rs reads it.
//!
//! [`decode`] refuses, with a named [`WireError`]:
//! - the kinds only a node gives itself (`MsgHup`, `MsgBeat`, `MsgUnreachable`,
//!   `MsgSnapStatus`, `MsgCheckQuorum`) and `MsgPropose`: only leaders propose,
//!   and raft-rs 0.7 has no switch to refuse a follower's forwarded proposal;
//! - a message not addressed to this replica, or whose sender is not the peer
//!   the bytes came from;
//! - bytes that are not one whole message, and enum values out of range.

use raft::prelude::{
    ConfChange, ConfChangeSingle, ConfChangeTransition, ConfChangeType, ConfChangeV2, ConfState,
    Entry, EntryType, Message, MessageType, Snapshot, SnapshotMetadata,
};
use serde::{Deserialize, Serialize};

/// Why a peer's bytes were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Not one whole message of our encoding (truncated, trailing bytes, a value
    /// out of range).
    #[error("not one raft message: {0}")]
    Malformed(String),
    /// A kind a peer may not send (raft-rs's number).
    #[error("message kind {0} is not accepted from a peer")]
    RefusedKind(i32),
    /// Addressed to replica `to`, not to this one (`me`).
    #[error("message for replica {to}, not this one ({me})")]
    WrongReplica {
        /// The replica it names.
        to: u64,
        /// This replica.
        me: u64,
    },
    /// Sent as replica `from` on the link of replica `peer`.
    #[error("message from replica {from} on the link of replica {peer}")]
    WrongSender {
        /// The sender it names.
        from: u64,
        /// The replica at the other end of the link.
        peer: u64,
    },
}

/// The message kinds a peer may send (raft-rs's numbering).
const FROM_PEERS: &[MessageType] = &[
    MessageType::MsgAppend,
    MessageType::MsgAppendResponse,
    MessageType::MsgRequestVote,
    MessageType::MsgRequestVoteResponse,
    MessageType::MsgSnapshot,
    MessageType::MsgHeartbeat,
    MessageType::MsgHeartbeatResponse,
    MessageType::MsgTransferLeader,
    MessageType::MsgTimeoutNow,
    MessageType::MsgReadIndex,
    MessageType::MsgReadIndexResp,
    MessageType::MsgRequestPreVote,
    MessageType::MsgRequestPreVoteResponse,
];

/// One raft message as it travels.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct WireMessage {
    kind: i32,
    to: u64,
    from: u64,
    term: u64,
    log_term: u64,
    index: u64,
    entries: Vec<WireEntry>,
    commit: u64,
    commit_term: u64,
    snapshot: Option<WireSnapshot>,
    request_snapshot: u64,
    reject: bool,
    reject_hint: u64,
    context: Vec<u8>,
    priority: i64,
}

/// One log entry as it travels.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct WireEntry {
    term: u64,
    index: u64,
    data: WireData,
    context: Vec<u8>,
}

/// An entry's data by its kind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum WireData {
    /// The state machine's bytes (ours, opaque to raft).
    Normal(Vec<u8>),
    ConfChange(WireConfChange),
    ConfChangeV2(WireConfChangeV2),
}

/// raft-rs's `ConfChange`, decoded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct WireConfChange {
    id: u64,
    change_type: i32,
    node_id: u64,
    context: Vec<u8>,
}

/// raft-rs's `ConfChangeV2`, decoded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct WireConfChangeV2 {
    transition: i32,
    /// `(change_type, node_id)` of each single change.
    changes: Vec<(i32, u64)>,
    context: Vec<u8>,
}

/// A snapshot as it travels.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct WireSnapshot {
    data: Vec<u8>,
    index: u64,
    term: u64,
    voters: Vec<u64>,
    learners: Vec<u64>,
    voters_outgoing: Vec<u64>,
    learners_next: Vec<u64>,
    auto_leave: bool,
}

/// `m` (made by this node's raft-rs) in our encoding. Its conf-change entries
/// are decoded from the protobuf raft-rs wrote them in (local bytes, never a
/// peer's).
pub fn encode(m: &Message) -> Vec<u8> {
    let wire = WireMessage {
        kind: m.msg_type as i32,
        to: m.to,
        from: m.from,
        term: m.term,
        log_term: m.log_term,
        index: m.index,
        entries: m.entries.iter().map(wire_entry).collect(),
        commit: m.commit,
        commit_term: m.commit_term,
        snapshot: m.snapshot.as_ref().map(wire_snapshot),
        request_snapshot: m.request_snapshot,
        reject: m.reject,
        reject_hint: m.reject_hint,
        context: m.context.to_vec(),
        priority: m.priority,
    };
    postcard::to_stdvec(&wire).expect("a message of plain fields serializes")
}

/// A peer's bytes, from the link of replica `peer` to replica `me`, as a message
/// for raft-rs (module docs: what is refused).
pub fn decode(bytes: &[u8], me: u64, peer: u64) -> Result<Message, WireError> {
    let w: WireMessage = match postcard::take_from_bytes(bytes) {
        Ok((w, [])) => w,
        Ok((_, rest)) => {
            let e = format!("{} bytes after the message", rest.len());
            return Err(WireError::Malformed(e));
        }
        Err(e) => return Err(WireError::Malformed(e.to_string())),
    };
    let kind = FROM_PEERS
        .iter()
        .find(|k| **k as i32 == w.kind)
        .ok_or(WireError::RefusedKind(w.kind))?;
    if w.to != me {
        return Err(WireError::WrongReplica { to: w.to, me });
    }
    if w.from != peer {
        return Err(WireError::WrongSender { from: w.from, peer });
    }
    let mut m = Message {
        msg_type: *kind,
        to: w.to,
        from: w.from,
        term: w.term,
        log_term: w.log_term,
        index: w.index,
        commit: w.commit,
        commit_term: w.commit_term,
        request_snapshot: w.request_snapshot,
        reject: w.reject,
        reject_hint: w.reject_hint,
        context: w.context.into(),
        priority: w.priority,
        ..Message::default()
    };
    for e in w.entries {
        m.entries.push(entry(e)?);
    }
    if let Some(s) = w.snapshot {
        m.snapshot = protobuf::SingularPtrField::some(snapshot(s));
    }
    Ok(m)
}

fn wire_entry(e: &Entry) -> WireEntry {
    let data = match e.entry_type {
        EntryType::EntryNormal => WireData::Normal(e.data.to_vec()),
        EntryType::EntryConfChange => {
            let cc: ConfChange = protobuf::Message::parse_from_bytes(&e.data)
                .expect("raft-rs wrote this conf change");
            WireData::ConfChange(WireConfChange {
                id: cc.id,
                change_type: cc.change_type as i32,
                node_id: cc.node_id,
                context: cc.context.to_vec(),
            })
        }
        EntryType::EntryConfChangeV2 => {
            let cc: ConfChangeV2 = protobuf::Message::parse_from_bytes(&e.data)
                .expect("raft-rs wrote this conf change");
            WireData::ConfChangeV2(WireConfChangeV2 {
                transition: cc.transition as i32,
                changes: (cc.changes.iter())
                    .map(|c| (c.change_type as i32, c.node_id))
                    .collect(),
                context: cc.context.to_vec(),
            })
        }
    };
    WireEntry {
        term: e.term,
        index: e.index,
        data,
        context: e.context.to_vec(),
    }
}

fn change_type(v: i32) -> Result<ConfChangeType, WireError> {
    [
        ConfChangeType::AddNode,
        ConfChangeType::RemoveNode,
        ConfChangeType::AddLearnerNode,
    ]
    .into_iter()
    .find(|t| *t as i32 == v)
    .ok_or_else(|| WireError::Malformed(format!("conf change type {v}")))
}

fn entry(w: WireEntry) -> Result<Entry, WireError> {
    let (entry_type, data) = match w.data {
        WireData::Normal(d) => (EntryType::EntryNormal, d),
        WireData::ConfChange(c) => {
            let cc = ConfChange {
                id: c.id,
                change_type: change_type(c.change_type)?,
                node_id: c.node_id,
                context: c.context.into(),
                ..ConfChange::default()
            };
            (EntryType::EntryConfChange, to_protobuf(&cc))
        }
        WireData::ConfChangeV2(c) => {
            let transition = [
                ConfChangeTransition::Auto,
                ConfChangeTransition::Implicit,
                ConfChangeTransition::Explicit,
            ]
            .into_iter()
            .find(|t| *t as i32 == c.transition)
            .ok_or_else(|| WireError::Malformed(format!("transition {}", c.transition)))?;
            let mut cc = ConfChangeV2 {
                transition,
                context: c.context.into(),
                ..ConfChangeV2::default()
            };
            for (t, node_id) in c.changes {
                cc.changes.push(ConfChangeSingle {
                    change_type: change_type(t)?,
                    node_id,
                    ..ConfChangeSingle::default()
                });
            }
            (EntryType::EntryConfChangeV2, to_protobuf(&cc))
        }
    };
    Ok(Entry {
        entry_type,
        term: w.term,
        index: w.index,
        data: data.into(),
        context: w.context.into(),
        ..Entry::default()
    })
}

/// `m` in protobuf, for raft-rs to read (our own value: it always encodes).
fn to_protobuf(m: &impl protobuf::Message) -> Vec<u8> {
    m.write_to_bytes()
        .expect("a conf change of plain fields encodes")
}

fn wire_snapshot(s: &Snapshot) -> WireSnapshot {
    let meta = s.get_metadata();
    let cs = meta.get_conf_state();
    WireSnapshot {
        data: s.data.to_vec(),
        index: meta.index,
        term: meta.term,
        voters: cs.voters.clone(),
        learners: cs.learners.clone(),
        voters_outgoing: cs.voters_outgoing.clone(),
        learners_next: cs.learners_next.clone(),
        auto_leave: cs.auto_leave,
    }
}

fn snapshot(w: WireSnapshot) -> Snapshot {
    let conf_state = ConfState {
        voters: w.voters,
        learners: w.learners,
        voters_outgoing: w.voters_outgoing,
        learners_next: w.learners_next,
        auto_leave: w.auto_leave,
        ..ConfState::default()
    };
    let metadata = SnapshotMetadata {
        conf_state: protobuf::SingularPtrField::some(conf_state),
        index: w.index,
        term: w.term,
        ..SnapshotMetadata::default()
    };
    Snapshot {
        data: w.data.into(),
        metadata: protobuf::SingularPtrField::some(metadata),
        ..Snapshot::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn append(from: u64, to: u64) -> Message {
        // Every field set to something other than its default, so a field the
        // codec forgot would not come back equal.
        let mut m = Message {
            msg_type: MessageType::MsgAppend,
            from,
            to,
            term: 3,
            log_term: 2,
            index: 7,
            commit: 6,
            commit_term: 2,
            request_snapshot: 5,
            reject: true,
            reject_hint: 4,
            context: b"mctx".to_vec().into(),
            priority: -3,
            ..Message::default()
        };
        m.entries.push(Entry {
            entry_type: EntryType::EntryNormal,
            term: 3,
            index: 8,
            data: b"hello".to_vec().into(),
            context: b"ectx".to_vec().into(),
            ..Entry::default()
        });
        let mut cc = ConfChangeV2 {
            transition: ConfChangeTransition::Explicit,
            context: b"ctx".to_vec().into(),
            ..ConfChangeV2::default()
        };
        cc.changes.push(ConfChangeSingle {
            change_type: ConfChangeType::AddLearnerNode,
            node_id: 4,
            ..ConfChangeSingle::default()
        });
        m.entries.push(Entry {
            entry_type: EntryType::EntryConfChangeV2,
            term: 3,
            index: 9,
            data: to_protobuf(&cc).into(),
            ..Entry::default()
        });
        let v1 = ConfChange {
            id: 11,
            change_type: ConfChangeType::RemoveNode,
            node_id: 5,
            context: b"v1ctx".to_vec().into(),
            ..ConfChange::default()
        };
        m.entries.push(Entry {
            entry_type: EntryType::EntryConfChange,
            term: 3,
            index: 10,
            data: to_protobuf(&v1).into(),
            ..Entry::default()
        });
        m
    }

    /// A message with a normal and a conf-change entry comes back equal, the conf
    /// change's protobuf bytes re-encoded to the same bytes.
    #[test]
    fn a_message_round_trips_with_its_entries() {
        let m = append(1, 2);
        let back = decode(&encode(&m), 2, 1).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.entries[1].data, m.entries[1].data);
        assert_eq!(back.entries[2].data, m.entries[2].data);
    }

    /// A snapshot's metadata and data come back equal (built with raft-rs's own
    /// types, not with the decoder's helper).
    #[test]
    fn a_snapshot_round_trips() {
        let mut m = Message {
            msg_type: MessageType::MsgSnapshot,
            from: 1,
            to: 2,
            term: 5,
            ..Message::default()
        };
        let conf_state = ConfState {
            voters: vec![1, 2],
            learners: vec![4],
            voters_outgoing: vec![1, 3],
            learners_next: vec![3],
            auto_leave: true,
            ..ConfState::default()
        };
        let metadata = SnapshotMetadata {
            conf_state: protobuf::SingularPtrField::some(conf_state),
            index: 40,
            term: 4,
            ..SnapshotMetadata::default()
        };
        m.snapshot = protobuf::SingularPtrField::some(Snapshot {
            data: b"state".to_vec().into(),
            metadata: protobuf::SingularPtrField::some(metadata),
            ..Snapshot::default()
        });
        assert_eq!(decode(&encode(&m), 2, 1).unwrap(), m);
    }

    /// A proposal and the kinds a node gives itself are refused by name; so is a
    /// message for another replica or from another peer than the link's.
    #[test]
    fn proposals_local_kinds_and_misaddressed_messages_are_refused() {
        for kind in [
            MessageType::MsgPropose,
            MessageType::MsgHup,
            MessageType::MsgBeat,
            MessageType::MsgUnreachable,
            MessageType::MsgSnapStatus,
            MessageType::MsgCheckQuorum,
        ] {
            let mut m = append(1, 2);
            m.msg_type = kind;
            let e = decode(&encode(&m), 2, 1).unwrap_err();
            assert_eq!(e, WireError::RefusedKind(kind as i32));
        }
        let bytes = encode(&append(1, 2));
        assert_eq!(
            decode(&bytes, 3, 1).unwrap_err(),
            WireError::WrongReplica { to: 2, me: 3 }
        );
        assert_eq!(
            decode(&bytes, 2, 3).unwrap_err(),
            WireError::WrongSender { from: 1, peer: 3 }
        );
    }

    /// Corrupted encodings (bytes flipped, cut, repeated) never panic the decoder,
    /// and whatever it accepts is addressed to this replica from the link's peer
    /// and of a kind a peer may send.
    #[test]
    fn corrupted_bytes_never_panic_and_what_passes_is_checked() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(26);
        let valid = encode(&append(1, 2));
        let (mut accepted, mut refused) = (0, 0);
        for _ in 0..20_000 {
            let mut b = valid.clone();
            for _ in 0..rng.gen_range(1..4) {
                match rng.gen_range(0..3) {
                    0 => {
                        let i = rng.gen_range(0..b.len());
                        b[i] = rng.gen();
                    }
                    1 => b.truncate(rng.gen_range(0..b.len().max(1))),
                    _ => {
                        let i = rng.gen_range(0..b.len().max(1));
                        let tail = b[i..].to_vec();
                        b.extend_from_slice(&tail);
                    }
                }
                if b.is_empty() {
                    b.push(rng.gen());
                }
            }
            match decode(&b, 2, 1) {
                Ok(m) => {
                    accepted += 1;
                    assert_eq!((m.to, m.from), (2, 1));
                    assert!(FROM_PEERS.contains(&m.msg_type), "{:?}", m.msg_type);
                }
                Err(_) => refused += 1,
            }
        }
        assert!(
            accepted > 0 && refused > 0,
            "{accepted} accepted, {refused} refused"
        );
    }

    /// Truncated bytes, trailing bytes and out-of-range enum values are malformed.
    #[test]
    fn broken_bytes_are_malformed() {
        let bytes = encode(&append(1, 2));
        for cut in [0, 1, bytes.len() / 2, bytes.len() - 1] {
            let e = decode(&bytes[..cut], 2, 1).unwrap_err();
            assert!(matches!(e, WireError::Malformed(_)), "cut at {cut}: {e:?}");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(matches!(decode(&long, 2, 1), Err(WireError::Malformed(_))));
        let mut w: WireMessage = postcard::from_bytes(&bytes).unwrap();
        if let WireData::ConfChangeV2(c) = &mut w.entries[1].data {
            c.changes[0].0 = 9;
        }
        let e = decode(&postcard::to_stdvec(&w).unwrap(), 2, 1).unwrap_err();
        assert!(matches!(e, WireError::Malformed(_)), "{e:?}");
    }
}
