//! Small value types of the protocol: packet type, header flags, setting
//! bits, reason codes, device flags, channel types.
//!
//! Every wire byte that carries an open set of values (reason code, device
//! flag, channel type) is a transparent newtype over `u8` with named
//! constants, so any value read from the wire survives a decode/encode round
//! trip unchanged; `name()` tells whether the value is a known one.

use core::fmt;

/// Packet type: the high nibble of the fixed header byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum PacketType {
    /// 1: client asks to connect (first frame of a connection).
    Connect = 1,
    /// 2: server answers CONNECT.
    Connack = 2,
    /// 3: client sends a message.
    Send = 3,
    /// 4: server acknowledges a SEND.
    Sendack = 4,
    /// 5: server delivers a message.
    Recv = 5,
    /// 6: client acknowledges a RECV.
    Recvack = 6,
    /// 7: client keep-alive (one byte, `0x70`).
    Ping = 7,
    /// 8: server answer to PING (one byte, `0x80`).
    Pong = 8,
    /// 9: either side announces it closes the connection.
    Disconnect = 9,
    /// 10: client subscribes to / unsubscribes from a channel.
    Sub = 10,
    /// 11: server answers SUB.
    Suback = 11,
    /// 12: event packet; recognised but not supported by this codec.
    Event = 12,
}

impl PacketType {
    /// The packet type for a header nibble; `None` for 0 (reserved) and
    /// 13..=15 (unassigned).
    #[inline]
    pub const fn from_nibble(nibble: u8) -> Option<Self> {
        Some(match nibble {
            1 => Self::Connect,
            2 => Self::Connack,
            3 => Self::Send,
            4 => Self::Sendack,
            5 => Self::Recv,
            6 => Self::Recvack,
            7 => Self::Ping,
            8 => Self::Pong,
            9 => Self::Disconnect,
            10 => Self::Sub,
            11 => Self::Suback,
            12 => Self::Event,
            _ => return None,
        })
    }

    /// The value in the high nibble of the fixed header.
    #[inline]
    pub const fn as_u8(self) -> u8 {
        self as u8
    }
}

impl fmt::Display for PacketType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Self::Connect => "CONNECT",
            Self::Connack => "CONNACK",
            Self::Send => "SEND",
            Self::Sendack => "SENDACK",
            Self::Recv => "RECV",
            Self::Recvack => "RECVACK",
            Self::Ping => "PING",
            Self::Pong => "PONG",
            Self::Disconnect => "DISCONNECT",
            Self::Sub => "SUB",
            Self::Suback => "SUBACK",
            Self::Event => "EVENT",
        };
        f.write_str(s)
    }
}

/// Header flags: the low nibble of the fixed header byte.
///
/// On CONNACK bit 0 means [`Flags::HAS_SERVER_VERSION`] instead of
/// [`Flags::NO_PERSIST`]; the codec derives that bit from
/// `ConnackPacket::server_version` and never stores it in
/// `ConnackPacket::flags`.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Flags(pub u8);

impl Flags {
    /// No flag set.
    pub const NONE: Self = Self(0);
    /// Bit 3: retransmission.
    pub const DUP: Self = Self(0x08);
    /// Bit 2: sync once.
    pub const SYNC_ONCE: Self = Self(0x04);
    /// Bit 1: show a red dot (unread badge).
    pub const RED_DOT: Self = Self(0x02);
    /// Bit 0 (not CONNACK): do not persist.
    pub const NO_PERSIST: Self = Self(0x01);
    /// Bit 0 of CONNACK: the body starts with the server version byte.
    pub const HAS_SERVER_VERSION: Self = Self(0x01);
    /// All four bits.
    pub const MASK: u8 = 0x0f;

    /// True when every bit of `other` is set in `self`.
    #[inline]
    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// `self` with the bits of `other` set.
    #[inline]
    pub const fn with(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    /// `self` with the bits of `other` cleared.
    #[inline]
    pub const fn without(self, other: Self) -> Self {
        Self(self.0 & !other.0)
    }
}

impl fmt::Debug for Flags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Flags({:#06b})", self.0)
    }
}

/// Setting byte of SEND and RECV (bit set).
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Setting(pub u8);

impl Setting {
    /// No bit set.
    pub const NONE: Self = Self(0);
    /// 0x80: the sender wants a read receipt.
    pub const RECEIPT: Self = Self(0x80);
    /// 0x20: signal message.
    pub const SIGNAL: Self = Self(0x20);
    /// 0x10: payload is plaintext; no msg_key check, no per-recipient
    /// encryption.
    pub const NO_ENCRYPT: Self = Self(0x10);
    /// 0x08: a `topic` string is present.
    pub const TOPIC: Self = Self(0x08);
    /// 0x02: stream fields are present (versions 2..=4 only).
    pub const STREAM: Self = Self(0x02);

    /// True when every bit of `other` is set in `self`.
    #[inline]
    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// `self` with the bits of `other` set.
    #[inline]
    pub const fn with(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    /// `self` with the bits of `other` cleared.
    #[inline]
    pub const fn without(self, other: Self) -> Self {
        Self(self.0 & !other.0)
    }
}

impl fmt::Debug for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Setting({:#010b})", self.0)
    }
}

macro_rules! named_u8 {
    (
        $(#[$meta:meta])*
        $name:ident { $( $(#[$cmeta:meta])* $konst:ident = $val:expr ),* $(,)? }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub u8);

        impl $name {
            $( $(#[$cmeta])* pub const $konst: Self = Self($val); )*

            /// The constant's name for a known value, `None` otherwise.
            pub const fn name(self) -> Option<&'static str> {
                match self.0 {
                    $( $val => Some(stringify!($konst)), )*
                    _ => None,
                }
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self.name() {
                    Some(n) => write!(f, "{}::{}", stringify!($name), n),
                    None => write!(f, "{}({})", stringify!($name), self.0),
                }
            }
        }

        impl From<u8> for $name {
            fn from(v: u8) -> Self {
                Self(v)
            }
        }

        impl From<$name> for u8 {
            fn from(v: $name) -> u8 {
                v.0
            }
        }
    };
}

named_u8! {
    /// Reason code of CONNACK, SENDACK, DISCONNECT and SUBACK.
    ReasonCode {
        /// 0
        UNKNOWN = 0,
        /// 1
        SUCCESS = 1,
        /// 2: authentication failed (also: undecodable client key).
        AUTH_FAIL = 2,
        /// 3
        SUBSCRIBER_NOT_EXIST = 3,
        /// 4
        IN_BLACKLIST = 4,
        /// 5
        CHANNEL_NOT_EXIST = 5,
        /// 6
        USER_NOT_ON_NODE = 6,
        /// 7
        SENDER_OFFLINE = 7,
        /// 8: SEND msg_key does not match.
        MSG_KEY_ERROR = 8,
        /// 9: SEND payload cannot be decrypted.
        PAYLOAD_DECODE_ERROR = 9,
        /// 10
        FORWARD_SEND_PACKET_ERROR = 10,
        /// 11
        NOT_ALLOW_SEND = 11,
        /// 12: the session was kicked by another login.
        CONNECT_KICK = 12,
        /// 13
        NOT_IN_WHITELIST = 13,
        /// 14
        QUERY_TOKEN_ERROR = 14,
        /// 15
        SYSTEM_ERROR = 15,
        /// 16
        CHANNEL_ID_ERROR = 16,
        /// 17
        NODE_MATCH_ERROR = 17,
        /// 18
        NODE_NOT_MATCH = 18,
        /// 19
        BAN = 19,
        /// 20
        NOT_SUPPORT_HEADER = 20,
        /// 21: CONNECT carried an empty client key.
        CLIENT_KEY_IS_EMPTY = 21,
        /// 22
        RATE_LIMIT = 22,
        /// 23
        NOT_SUPPORT_CHANNEL_TYPE = 23,
        /// 24
        DISBAND = 24,
        /// 25
        SEND_BAN = 25,
        /// 26
        CHANNEL_DELETING = 26,
        /// 27
        PROTOCOL_UPGRADE_REQUIRED = 27,
        /// 28
        IDEMPOTENCY_CONFLICT = 28,
        /// 29
        MESSAGE_SEQ_EXHAUSTED = 29,
    }
}

named_u8! {
    /// Device flag of CONNECT. Other values are allowed and compared as
    /// numbers.
    DeviceFlag {
        /// 0: mobile app.
        APP = 0,
        /// 1: web (the JS SDK's default).
        WEB = 1,
        /// 2: desktop.
        PC = 2,
        /// 99: server-side system sender.
        SYSTEM = 99,
    }
}

named_u8! {
    /// Channel type. Other values pass through the codec unchanged.
    ChannelType {
        /// 1: one-to-one channel.
        PERSON = 1,
        /// 2: group channel.
        GROUP = 2,
    }
}
