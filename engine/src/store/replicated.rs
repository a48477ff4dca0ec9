//! A replica's writes ([`replica::Persist`]) applied to its shard's stores, and its
//! durable state ([`replica::Durable`]) read back from them at a restart.
//!
//! The entries go to the shard's [`MessageLog`] (its `groups`: one record per
//! message, never a second copy), the term, vote and configuration to the
//! [`RaftStateFile`]. A proposal's bytes (raft's entry data) are our own encoding
//! ([`encode_messages`], [`encode_catalog`]; empty: a new leader's no-op), decoded
//! here into what the log stores and encoded again from it at a restart.
//!
//! # Contract (per [`Persist`], in order)
//! 1. [`append`]: its records into the log (a held index cuts there); returns
//!    whether the log must be synced before step 2 (a record was written).
//! 2. Sync the log when step 1 said so, under every fsync policy (one sync may
//!    cover the persists of every group of the shard).
//! 3. [`settle`]: a new term, vote or configuration, then written and synced to
//!    the raft state file (a commit index alone is not written: it may lag, and a
//!    restart clamps it to the log; one sync may cover every group of the shard).
//! 4. Only then `Group::persisted(number)`: the messages that depend on it leave.

use domain::send::commit::{Foreign, ForeignEntry};
use replica::{Durable, Persist, Record, RecordKind as RaftKind};
use serde::{Deserialize, Serialize};

use super::log::{AppendedMessage, Entry, EntryBody, LogError, MessageLog, NewMessage};
#[cfg(doc)]
use super::raft_state::RaftStateFile;
use super::raft_state::{GroupState, RaftStateError};
use super::record::{RecordFields, RecordKind};

/// The first byte of a proposal of messages.
const TAG_MESSAGES: u8 = 1;
/// The first byte of a proposal of a catalog operation.
const TAG_CATALOG: u8 = 2;
/// The first byte of a proposal of messages with its leader's delivery mark
/// (`domain::send::commit`, "Delivery after a change of leader").
const TAG_MARKED: u8 = 3;

/// One message of a proposal, as it travels in raft's entry data.
#[derive(Serialize, Deserialize)]
struct WireMessage<'a> {
    message_id: i64,
    channel_type: u8,
    #[serde(borrow)]
    channel_id: &'a str,
    #[serde(borrow)]
    from_uid: &'a str,
    #[serde(borrow)]
    client_msg_no: &'a str,
    setting: u8,
    msg_flags: u8,
    timestamp_s: u32,
    #[serde(borrow)]
    payload: &'a [u8],
}

impl<'a> From<&NewMessage<'a>> for WireMessage<'a> {
    fn from(m: &NewMessage<'a>) -> WireMessage<'a> {
        WireMessage {
            message_id: m.message_id,
            channel_type: m.channel_type,
            channel_id: m.channel_id,
            from_uid: m.from_uid,
            client_msg_no: m.client_msg_no,
            setting: m.setting,
            msg_flags: m.msg_flags,
            timestamp_s: m.timestamp_s,
            payload: m.payload,
        }
    }
}

impl<'a> From<WireMessage<'a>> for NewMessage<'a> {
    fn from(m: WireMessage<'a>) -> NewMessage<'a> {
        NewMessage {
            message_id: m.message_id,
            channel_type: m.channel_type,
            channel_id: m.channel_id,
            from_uid: m.from_uid,
            client_msg_no: m.client_msg_no,
            setting: m.setting,
            msg_flags: m.msg_flags,
            timestamp_s: m.timestamp_s,
            payload: m.payload,
        }
    }
}

/// A proposal's bytes: these messages (the SENDs of one turn to one group), with
/// the proposing leader's delivery `mark` (0: none, the older form).
pub fn encode_messages(mark: u64, msgs: &[NewMessage<'_>]) -> Vec<u8> {
    let wire: Vec<WireMessage<'_>> = msgs.iter().map(WireMessage::from).collect();
    let mut out = if mark == 0 {
        vec![TAG_MESSAGES]
    } else {
        let mut out = vec![TAG_MARKED];
        out.extend(postcard::to_stdvec(&mark).expect("a u64 serializes"));
        out
    };
    out.extend(postcard::to_stdvec(&wire).expect("a Vec of plain fields serializes"));
    out
}

/// A proposal's bytes: one catalog operation.
pub fn encode_catalog(op: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + op.len());
    out.push(TAG_CATALOG);
    out.extend_from_slice(op);
    out
}

/// The catalog op of a proposal's bytes, if it is one (its tag alone read: a
/// proposal of messages is not decoded).
pub fn catalog_of(data: &[u8]) -> Option<&[u8]> {
    match data.split_first() {
        Some((&TAG_CATALOG, op)) => Some(op),
        _ => None,
    }
}

/// What a proposal's bytes hold.
#[derive(Debug)]
pub enum Proposal<'a> {
    /// A new leader's empty entry.
    Noop,
    /// Messages, at least one, and their leader's delivery mark (0: none).
    Messages(u64, Vec<NewMessage<'a>>),
    /// A catalog operation.
    Catalog(&'a [u8]),
}

/// Why a replica's writes could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum ReplicatedError {
    /// The log refused an entry (or a read back failed).
    #[error("log: {0}")]
    Log(#[from] LogError),
    /// The raft state file refused.
    #[error("raft state: {0}")]
    State(#[from] RaftStateError),
    /// A proposal's bytes are not ours (an unknown tag, bad postcard, no message):
    /// a replica never proposes such bytes, so another node's writer is broken.
    #[error("group {group} entry {index}: {what}")]
    Proposal {
        group: u32,
        index: u64,
        what: &'static str,
    },
    /// The group's retained log does not start at index 1: a restart needs a
    /// snapshot ("Snapshots and catch-up", not built yet).
    #[error("group {group}: its retained log starts at {first_index}, a snapshot is needed")]
    NeedsSnapshot { group: u32, first_index: u64 },
}

/// Decodes a proposal's bytes (module docs).
pub fn decode_proposal(data: &[u8]) -> Result<Proposal<'_>, &'static str> {
    match data.split_first() {
        None => Ok(Proposal::Noop),
        Some((&TAG_CATALOG, op)) => Ok(Proposal::Catalog(op)),
        Some((&tag @ (TAG_MESSAGES | TAG_MARKED), rest)) => {
            let (mark, rest) = match tag {
                TAG_MARKED => postcard::take_from_bytes::<u64>(rest)
                    .map_err(|_| "a delivery mark that does not decode")?,
                _ => (0, rest),
            };
            let wire: Vec<WireMessage<'_>> =
                postcard::from_bytes(rest).map_err(|_| "messages that do not decode")?;
            if wire.is_empty() {
                return Err("a proposal of no message");
            }
            Ok(Proposal::Messages(
                mark,
                wire.into_iter().map(NewMessage::from).collect(),
            ))
        }
        Some(_) => Err("an unknown proposal tag"),
    }
}

/// An entry of messages as [`append`] wrote it: its term, its index and how many
/// of the messages pushed to `appended` are its (they follow the previous
/// entry's, in order); with its delivery mark and its messages when the caller
/// asked for them (an entry it did not propose, to apply at its commit).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppendedEntry {
    pub term: u64,
    pub index: u64,
    pub messages: usize,
    pub foreign: Option<ForeignEntry>,
}

/// Step 1 of the contract: `p`'s records into `log` as `group`'s entries, the
/// messages' seqs and positions pushed to `appended`, each entry of messages to
/// `entries` (with its messages' keys when `foreign(term)` says so). Returns
/// whether the log must be synced before [`settle`].
pub fn append(
    log: &mut MessageLog,
    group: u32,
    p: &Persist,
    appended: &mut Vec<AppendedMessage>,
    entries: &mut Vec<AppendedEntry>,
    foreign: impl Fn(u64) -> bool,
) -> Result<bool, ReplicatedError> {
    for r in &p.records {
        let bad = |what| ReplicatedError::Proposal {
            group,
            index: r.index,
            what,
        };
        let proposal;
        let mut mark = 0;
        let body = match r.kind {
            RaftKind::ConfChange => EntryBody::ConfChange(&r.data),
            RaftKind::ConfChangeV2 => EntryBody::ConfChangeV2(&r.data),
            RaftKind::Normal => {
                proposal = decode_proposal(&r.data).map_err(bad)?;
                match &proposal {
                    Proposal::Noop => EntryBody::Noop,
                    Proposal::Catalog(op) => EntryBody::Catalog(op),
                    Proposal::Messages(m, msgs) => {
                        mark = *m;
                        EntryBody::Messages(msgs)
                    }
                }
            }
        };
        let entry = Entry {
            group,
            term: r.term,
            index: r.index,
            body,
        };
        let before = appended.len();
        log.append_entry(&entry, appended)?;
        if let EntryBody::Messages(msgs) = entry.body {
            debug_assert_eq!(appended.len() - before, msgs.len());
            let keys = foreign(r.term).then(|| ForeignEntry {
                mark,
                messages: msgs.iter().map(foreign_of).collect(),
            });
            entries.push(AppendedEntry {
                term: r.term,
                index: r.index,
                messages: msgs.len(),
                foreign: keys,
            });
        }
    }
    Ok(!p.records.is_empty())
}

/// What applying (and perhaps delivering again) a message not proposed here needs.
fn foreign_of(m: &NewMessage<'_>) -> Foreign {
    Foreign {
        from_uid: m.from_uid.into(),
        client_msg_no: m.client_msg_no.into(),
        message_id: m.message_id,
        channel_type: m.channel_type,
        channel_key: m.channel_id.into(),
        setting: m.setting,
        flags: m.msg_flags,
        timestamp_s: m.timestamp_s,
        payload: m.payload.to_vec(),
    }
}

/// Step 3 of the contract: `p`'s new term, vote or configuration into `state`;
/// whether any of them changed, and then the caller writes `state` to the raft
/// state file, synced, before step 4 ([`RaftStateFile::write`], or
/// [`RaftStateFile::stage`] for each group of a batch and one
/// [`RaftStateFile::sync_staged`]). The commit index is kept in `state` and
/// written with the next change of the others.
pub fn settle(state: &mut GroupState, p: &Persist) -> bool {
    let mut next = state.clone();
    if let Some(hs) = p.hard_state {
        next.hard_state = hs;
    }
    if let Some(cs) = &p.conf_state {
        next.conf_state = cs.clone();
    }
    let changed = (next.hard_state.term, next.hard_state.vote, &next.conf_state)
        != (
            state.hard_state.term,
            state.hard_state.vote,
            &state.conf_state,
        );
    *state = next;
    changed
}

/// The durable state of `group` for [`replica::Group::restart`]: `state` (its
/// commit clamped to the log's last index: a commit may have been written before
/// the records it covers were synced) and its entries from the log, their bytes
/// encoded again.
pub fn durable_of(
    log: &MessageLog,
    group: u32,
    state: &GroupState,
) -> Result<Durable, ReplicatedError> {
    let mut durable = Durable {
        hard_state: state.hard_state,
        conf_state: state.conf_state.clone(),
        records: Vec::new(),
    };
    let Some(span) = log.group_span(group) else {
        durable.hard_state.commit = 0;
        return Ok(durable);
    };
    if span.first_index != 1 && span.last_index >= span.first_index {
        return Err(ReplicatedError::NeedsSnapshot {
            group,
            first_index: span.first_index,
        });
    }
    for index in span.first_index..=span.last_index {
        let records = log.entry_records(group, index)?;
        durable.records.push(record_of(group, index, &records)?);
    }
    durable.hard_state.commit = durable.hard_state.commit.min(span.last_index);
    Ok(durable)
}

/// The raft record of one entry read back from the log.
fn record_of(
    group: u32,
    index: u64,
    records: &[RecordFields<'_>],
) -> Result<Record, ReplicatedError> {
    let first = records[0];
    let (kind, data) = match first.kind {
        RecordKind::Noop => (RaftKind::Normal, Vec::new()),
        RecordKind::Catalog => (RaftKind::Normal, encode_catalog(first.payload)),
        RecordKind::ConfChange => (RaftKind::ConfChange, first.payload.to_vec()),
        RecordKind::ConfChangeV2 => (RaftKind::ConfChangeV2, first.payload.to_vec()),
        RecordKind::Message => {
            fn text(b: &[u8]) -> Option<&str> {
                std::str::from_utf8(b).ok()
            }
            let mut msgs = Vec::with_capacity(records.len());
            for f in records {
                let (Some(channel_id), Some(from_uid), Some(client_msg_no)) =
                    (text(f.channel_id), text(f.from_uid), text(f.client_msg_no))
                else {
                    return Err(ReplicatedError::Proposal {
                        group,
                        index,
                        what: "a stored message whose ids are not UTF-8",
                    });
                };
                msgs.push(NewMessage {
                    message_id: f.message_id,
                    channel_type: f.channel_type,
                    channel_id,
                    from_uid,
                    client_msg_no,
                    setting: f.setting,
                    msg_flags: f.msg_flags as u8,
                    timestamp_s: f.timestamp_s,
                    payload: f.payload,
                });
            }
            (RaftKind::Normal, encode_messages(0, &msgs))
        }
        RecordKind::Cut => unreachable!("a group's entries never index a cut"),
    };
    Ok(Record {
        index,
        term: first.raft.term,
        kind,
        data,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m<'a>(channel: &'a str, payload: &'a [u8]) -> NewMessage<'a> {
        NewMessage {
            message_id: 9,
            channel_type: 2,
            channel_id: channel,
            from_uid: "u",
            client_msg_no: "c1",
            setting: 3,
            msg_flags: 1,
            timestamp_s: 77,
            payload,
        }
    }

    /// Each kind of proposal decodes to what was encoded; bytes that are not
    /// ours are refused by name.
    #[test]
    fn proposals_round_trip_and_foreign_bytes_are_refused() {
        let msgs = [m("a", b"x"), m("b", b"")];
        let bytes = encode_messages(0, &msgs);
        let shown = |r: Result<Proposal<'_>, &str>| format!("{r:?}");
        assert_eq!(
            shown(decode_proposal(&bytes)),
            shown(Ok(Proposal::Messages(0, msgs.to_vec())))
        );
        assert_eq!(
            shown(decode_proposal(&encode_messages(300, &msgs))),
            shown(Ok(Proposal::Messages(300, msgs.to_vec()))),
            "with the leader's delivery mark"
        );
        assert_eq!(bytes[0], TAG_MESSAGES, "no mark: the older form");
        assert!(matches!(
            decode_proposal(&encode_catalog(b"op")),
            Ok(Proposal::Catalog(b"op"))
        ));
        assert!(matches!(decode_proposal(b""), Ok(Proposal::Noop)));
        let refused = |b: &[u8]| decode_proposal(b).err();
        assert_eq!(refused(&[9, 1]), Some("an unknown proposal tag"));
        assert_eq!(
            refused(&encode_messages(7, &[])),
            Some("a proposal of no message")
        );
        assert_eq!(
            refused(&bytes[..bytes.len() - 1]),
            Some("messages that do not decode")
        );
        assert_eq!(
            refused(&[TAG_MARKED, 0xff]),
            Some("a delivery mark that does not decode")
        );
    }
}
