//! Channel ids and channel types, as WuKongIM clients see them.
//!
//! A person channel between `a` and `b` is stored under one key for both sides,
//! `x@y`: `x` is the uid with the larger crc32 (IEEE) of its bytes, `y` the other
//! (equal checksums: `x` is the larger uid string). A SEND names the peer's uid, or the
//! full `x@y` key, which must contain the sender. In a RECV, a person channel's id is
//! the other party's uid, not the stored key.

use std::ops::Range;

use proto::wkproto::ReasonCode;
use slots::hash_slot;

use crate::cluster::HashSlot;
use crate::presence::route::Uid;

/// channel_type of a person (one-to-one) channel.
pub const CHANNEL_TYPE_PERSON: u8 = 1;
/// channel_type of a group channel.
pub const CHANNEL_TYPE_GROUP: u8 = 2;

/// Longest channel id accepted (bytes); longer ids get reason 16 ChannelIDError.
pub const MAX_CHANNEL_ID_BYTES: usize = 256;

/// The channel a SEND addresses, resolved for the sender.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Channel {
    /// A person channel: its stored key and the peer (the uid that is not the sender;
    /// the sender itself for a note-to-self).
    Person {
        /// The stored key `x@y` of both sides ([`person_channel_key`]): its hash slot
        /// names the commit shard.
        key: String,
        /// The uid that is not the sender (the sender for a note-to-self).
        peer: String,
    },
    /// A group channel by id.
    Group {
        /// The group's channel id as the SEND named it (at most
        /// [`MAX_CHANNEL_ID_BYTES`]); also its stored key.
        id: String,
    },
}

/// Why a SEND's channel is refused, as a wkproto reason code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChannelError {
    /// 16 ChannelIDError: empty, too long, or an `x@y` key that does not contain the sender.
    ChannelIdError,
    /// 23 NotSupportChannelType.
    NotSupportedType,
}

impl ChannelError {
    /// The wkproto reason code.
    pub fn reason_code(self) -> ReasonCode {
        match self {
            ChannelError::ChannelIdError => ReasonCode::CHANNEL_ID_ERROR,
            ChannelError::NotSupportedType => ReasonCode::NOT_SUPPORT_CHANNEL_TYPE,
        }
    }
}

/// The stored key of the person channel between `a` and `b`.
pub fn person_channel_key(a: &str, b: &str) -> String {
    let (ca, cb) = (crc32fast::hash(a.as_bytes()), crc32fast::hash(b.as_bytes()));
    let a_first = ca > cb || (ca == cb && a >= b);
    let (x, y) = if a_first { (a, b) } else { (b, a) };
    let mut key = String::with_capacity(x.len() + 1 + y.len());
    key.push_str(x);
    key.push('@');
    key.push_str(y);
    key
}

impl Channel {
    /// Resolves the channel a SEND from `sender` names.
    pub fn resolve(
        sender: &str,
        channel_id: &str,
        channel_type: u8,
    ) -> Result<Channel, ChannelError> {
        if channel_id.is_empty() || channel_id.len() > MAX_CHANNEL_ID_BYTES {
            return Err(ChannelError::ChannelIdError);
        }
        match channel_type {
            CHANNEL_TYPE_PERSON => {
                // The full `x@y` key, if it is one that contains the sender.
                if let Some((x, y)) = channel_id.split_once('@') {
                    if channel_id == person_channel_key(x, y) && (x == sender || y == sender) {
                        let peer = if x == sender { y } else { x };
                        return Ok(Channel::Person {
                            key: channel_id.to_owned(),
                            peer: peer.to_owned(),
                        });
                    }
                    if x == sender || y == sender {
                        // Names the sender but in the wrong order: not a stored key.
                        return Err(ChannelError::ChannelIdError);
                    }
                }
                Ok(Channel::Person {
                    key: person_channel_key(sender, channel_id),
                    peer: channel_id.to_owned(),
                })
            }
            CHANNEL_TYPE_GROUP => Ok(Channel::Group {
                id: channel_id.to_owned(),
            }),
            _ => Err(ChannelError::NotSupportedType),
        }
    }

    /// The key the channel is stored and placed (hashed to a hash slot) under.
    pub fn key(&self) -> &str {
        match self {
            Channel::Person { key, .. } => key,
            Channel::Group { id } => id,
        }
    }

    /// The wkproto channel_type.
    pub fn channel_type(&self) -> u8 {
        match self {
            Channel::Person { .. } => CHANNEL_TYPE_PERSON,
            Channel::Group { .. } => CHANNEL_TYPE_GROUP,
        }
    }
}

/// The channel id a RECV to `recipient` carries for a message stored under `key`:
/// for a person channel the other party's uid, for a group its id.
pub fn recv_channel_id<'a>(key: &'a str, channel_type: u8, recipient: &str) -> &'a str {
    if channel_type != CHANNEL_TYPE_PERSON {
        return key;
    }
    match key.split_once('@') {
        Some((x, y)) if x == recipient => y,
        Some((x, _)) => x,
        None => key,
    }
}

/// A group's subscribers, without duplicates, kept as the delivery planner reads
/// them: grouped by hash slot (ascending; uids sorted within a slot), each with
/// its hash slot and its table hash ([`uid_hash`](crate::presence::authority::uid_hash))
/// computed once, when the list is built (the catalog builds it when the list is
/// published), so planning a page hashes nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Subscribers {
    uids: Vec<Uid>,
    /// `uid_hash` of each uid.
    hashes: Vec<u64>,
    /// The runs of one hash slot, in order: the slot and the end of its run.
    runs: Vec<(HashSlot, u32)>,
}

impl Subscribers {
    /// The list of `uids` (duplicates dropped). The hash slot is the cluster's
    /// (`slots::hash_slot`, as `ClusterView::target_for_uid`).
    pub fn new(uids: impl IntoIterator<Item = Uid>) -> Subscribers {
        let mut by_slot: Vec<(HashSlot, Uid)> = uids
            .into_iter()
            .map(|u| (hash_slot(u.as_bytes()), u))
            .collect();
        by_slot.sort_unstable();
        by_slot.dedup();
        assert!(
            by_slot.len() <= u32::MAX as usize,
            "subscriber list too long"
        );
        let mut s = Subscribers {
            uids: Vec::with_capacity(by_slot.len()),
            hashes: Vec::with_capacity(by_slot.len()),
            runs: Vec::new(),
        };
        for (slot, uid) in by_slot {
            if s.runs.last().is_none_or(|r| r.0 != slot) {
                s.runs.push((slot, s.uids.len() as u32));
            }
            s.hashes.push(crate::presence::authority::uid_hash(&uid));
            s.uids.push(uid);
            s.runs.last_mut().expect("pushed").1 += 1;
        }
        s
    }

    /// The uids, grouped by hash slot.
    pub fn uids(&self) -> &[Uid] {
        &self.uids
    }

    /// The table hash of each uid of [`uids`](Self::uids).
    pub fn hashes(&self) -> &[u64] {
        &self.hashes
    }

    /// How many distinct uids subscribe.
    pub fn len(&self) -> usize {
        self.uids.len()
    }

    /// Whether no uid subscribes.
    pub fn is_empty(&self) -> bool {
        self.uids.is_empty()
    }

    /// Whether `uid` subscribes.
    pub fn contains(&self, uid: &str) -> bool {
        let slot = hash_slot(uid.as_bytes());
        let run = self.runs.partition_point(|r| r.0 < slot);
        match self.runs.get(run) {
            Some(&(s, end)) if s == slot => {
                let start = run.checked_sub(1).map_or(0, |p| self.runs[p].1) as usize;
                self.uids[start..end as usize]
                    .binary_search_by(|u| (**u).cmp(uid))
                    .is_ok()
            }
            _ => false,
        }
    }

    /// The runs of one hash slot within `range` of [`uids`](Self::uids): each
    /// slot and its part of `range`, in order.
    pub fn slot_runs(
        &self,
        range: Range<usize>,
    ) -> impl Iterator<Item = (HashSlot, Range<usize>)> + '_ {
        let first = self.runs.partition_point(|r| (r.1 as usize) <= range.start);
        let mut start = range.start;
        self.runs[first..].iter().map_while(move |&(slot, end)| {
            let end = (end as usize).min(range.end);
            if start >= end {
                return None;
            }
            let r = start..end;
            start = end;
            Some((slot, r))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn person_key_is_the_same_for_both_sides_and_ordered_by_crc32() {
        let k1 = person_channel_key("u1", "u2");
        let k2 = person_channel_key("u2", "u1");
        assert_eq!(k1, k2);
        let (x, y) = k1.split_once('@').unwrap();
        assert!(crc32fast::hash(x.as_bytes()) >= crc32fast::hash(y.as_bytes()));
        assert_eq!(person_channel_key("a", "a"), "a@a");
    }

    /// The uid with the larger crc32 goes first whatever the string order; equal
    /// checksums (a real collision) put the larger string first.
    #[test]
    fn person_key_orders_by_crc32_then_by_the_larger_uid() {
        // crc32("a") = 0xe8b7be43 > crc32("b") = 0x71beeff9, though "a" < "b"
        assert_eq!(person_channel_key("a", "b"), "a@b");
        assert_eq!(person_channel_key("b", "a"), "a@b");
        // "u9990985" and "u16400040" share the crc32 0xa99072e8
        assert_eq!(crc32fast::hash(b"u9990985"), 0xa990_72e8);
        assert_eq!(crc32fast::hash(b"u16400040"), 0xa990_72e8);
        assert_eq!(
            person_channel_key("u9990985", "u16400040"),
            "u9990985@u16400040"
        );
        assert_eq!(
            person_channel_key("u16400040", "u9990985"),
            "u9990985@u16400040"
        );
    }

    /// Ids up to [`MAX_CHANNEL_ID_BYTES`] are taken; a group is resolved by its id.
    #[test]
    fn groups_and_the_longest_ids_resolve() {
        let longest = "g".repeat(MAX_CHANNEL_ID_BYTES);
        let group = Channel::resolve("u1", &longest, CHANNEL_TYPE_GROUP).unwrap();
        assert_eq!(
            group,
            Channel::Group {
                id: longest.clone()
            }
        );
        assert_eq!(
            (group.key(), group.channel_type()),
            (&*longest, CHANNEL_TYPE_GROUP)
        );
        assert_eq!(recv_channel_id(&longest, CHANNEL_TYPE_GROUP, "u1"), longest);
        let peer = "p".repeat(MAX_CHANNEL_ID_BYTES);
        let person = Channel::resolve("u1", &peer, CHANNEL_TYPE_PERSON).unwrap();
        assert_eq!(person.key(), person_channel_key("u1", &peer));
        assert_eq!(person.channel_type(), CHANNEL_TYPE_PERSON);
        assert_eq!(
            Channel::resolve("u1", &format!("{longest}g"), CHANNEL_TYPE_GROUP),
            Err(ChannelError::ChannelIdError)
        );
    }

    #[test]
    fn a_send_names_the_peer_or_the_full_key() {
        let by_peer = Channel::resolve("u1", "u2", CHANNEL_TYPE_PERSON).unwrap();
        let key = person_channel_key("u1", "u2");
        assert_eq!(
            by_peer,
            Channel::Person {
                key: key.clone(),
                peer: "u2".into()
            }
        );
        let by_key = Channel::resolve("u1", &key, CHANNEL_TYPE_PERSON).unwrap();
        assert_eq!(by_key, by_peer);
        // The peer sees the sender as the channel id, the sender's devices see the peer.
        assert_eq!(recv_channel_id(&key, CHANNEL_TYPE_PERSON, "u2"), "u1");
        assert_eq!(recv_channel_id(&key, CHANNEL_TYPE_PERSON, "u1"), "u2");
    }

    #[test]
    fn bad_channels_get_their_reason_codes() {
        assert_eq!(
            Channel::resolve("u1", "", 1),
            Err(ChannelError::ChannelIdError)
        );
        assert_eq!(
            Channel::resolve("u1", &"x".repeat(300), 2),
            Err(ChannelError::ChannelIdError)
        );
        assert_eq!(
            Channel::resolve("u1", "g", 3).map_err(|e| e.reason_code()),
            Err(ReasonCode::NOT_SUPPORT_CHANNEL_TYPE)
        );
        // A reversed key that names the sender is not its stored key.
        let key = person_channel_key("u1", "u2");
        let (x, y) = key.split_once('@').unwrap();
        let reversed = format!("{y}@{x}");
        assert_eq!(
            Channel::resolve("u1", &reversed, 1),
            Err(ChannelError::ChannelIdError)
        );
        // A uid that contains '@' but not the sender is a plain peer uid.
        assert_eq!(
            Channel::resolve("u1", "bob@example", 1),
            Ok(Channel::Person {
                key: person_channel_key("u1", "bob@example"),
                peer: "bob@example".into()
            })
        );
    }

    /// Pre-grouped lists against the plain sorted set: membership, every uid once
    /// in its own slot's run, precomputed hashes, and runs cut by any page range.
    #[test]
    fn subscribers_are_grouped_by_hash_slot_with_their_hashes() {
        let uids: Vec<Uid> = (0..600)
            .map(|i| Uid::from(format!("m{}", i % 500)))
            .collect();
        let s = Subscribers::new(uids);
        assert_eq!((s.len(), s.is_empty()), (500, false), "duplicates dropped");
        assert!(Subscribers::new(Vec::new()).is_empty());
        for (u, h) in s.uids().iter().zip(s.hashes()) {
            assert_eq!(*h, crate::presence::authority::uid_hash(u));
        }
        for i in 0..520 {
            assert_eq!(s.contains(&format!("m{i}")), i < 500, "m{i}");
        }
        for page in [1, 7, 64, 500] {
            let mut seen = 0;
            for start in (0..s.len()).step_by(page) {
                let range = start..s.len().min(start + page);
                let mut at = range.start;
                let mut last_slot = None;
                for (slot, r) in s.slot_runs(range.clone()) {
                    assert_eq!(r.start, at, "runs cover the page in order");
                    assert!(last_slot < Some(slot));
                    last_slot = Some(slot);
                    for u in &s.uids()[r.clone()] {
                        assert_eq!(hash_slot(u.as_bytes()), slot);
                    }
                    at = r.end;
                }
                assert_eq!(at, range.end);
                seen += range.len();
            }
            assert_eq!(seen, 500);
        }
        assert!(!Subscribers::new(Vec::new()).contains("m1"));
        assert_eq!(Subscribers::new(Vec::new()).slot_runs(0..0).count(), 0);
    }
}
