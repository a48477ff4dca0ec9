//! Channel ids and channel types, as WuKongIM clients see them.
//!
//! A person channel between `a` and `b` is stored under one key for both sides,
//! `x@y`: `x` is the uid with the larger crc32 (IEEE) of its bytes, `y` the other
//! (equal checksums: `x` is the larger uid string). A SEND names the peer's uid, or the
//! full `x@y` key, which must contain the sender. In a RECV, a person channel's id is
//! the other party's uid, not the stored key.

use net::wkproto::ReasonCode;

use crate::route::Uid;

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
    Person { key: String, peer: String },
    /// A group channel by id.
    Group { id: String },
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

/// A group's subscribers: sorted, without duplicates.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Subscribers {
    pub uids: Vec<Uid>,
}

impl Subscribers {
    /// Whether `uid` subscribes.
    pub fn contains(&self, uid: &str) -> bool {
        self.uids.binary_search_by(|u| (**u).cmp(uid)).is_ok()
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
}
