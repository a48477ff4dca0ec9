//! The on-disk record of the message log: a fixed 72-byte [`RecordHeader`]
//! (`#[repr(C)]`, `bytemuck::Pod`, little-endian hosts only) followed by the variable
//! fields `channel_id ‖ from_uid ‖ client_msg_no ‖ payload`, zero-padded to a multiple
//! of [`RECORD_ALIGN_BYTES`].
//!
//! # Versions
//! - **2** (written): the message fields, then the record's place in a replicated
//!   group's log ([`RaftPos`]: group, term, index), its [`RecordKind`] and
//!   `parts_left`. A record with index 0 is not replicated (a node alone, or
//!   a record written before replication): group, term and `parts_left` are 0 and it
//!   is a message. One raft entry is one record, or for an entry of several
//!   messages (the SENDs of one turn to one group) that many records back to back,
//!   each saying how many of the entry's records follow it (`parts_left`), so that
//!   recovery can tell a whole entry from a torn one. A kind other than a message
//!   carries its bytes in `payload` and no channel, sender or client number.
//! - **1** (read, never written): the 48-byte header of version 2 without the
//!   replication fields; it reads as a record with index 0.
//!
//! A record is valid when: the magic and a known version match, `record_len` is
//! exactly the padded length its field lengths give and fits in the bytes that remain,
//! the CRC-32 (IEEE, `crc32fast`) of `header[0..12] ‖ header[16..] ‖ fields` (every
//! byte of the record but the crc itself and the padding) matches, and its fields
//! agree with its kind (checked after the CRC: [`RecordError::BadFields`]). An
//! all-zero region is never valid (magic is non-zero), which is how the end of a
//! preallocated segment is recognised.

use bytemuck::{Pod, Zeroable};

/// "IMLG" read as a little-endian u32.
pub const RECORD_MAGIC: u32 = u32::from_le_bytes(*b"IMLG");
/// Format version written into every record.
pub const RECORD_VERSION: u16 = 2;
/// The format of records written before replication (read only).
pub const RECORD_VERSION_1: u16 = 1;
/// Size of [`RecordHeader`].
pub const RECORD_HEADER_BYTES: usize = std::mem::size_of::<RecordHeader>();
/// Size of a version 1 header ([`RecordHeaderV1`]).
pub const RECORD_HEADER_V1_BYTES: usize = std::mem::size_of::<RecordHeaderV1>();
/// The bytes every version starts with: magic, version, flags, `record_len`, crc.
pub const RECORD_PREFIX_BYTES: usize = 16;
/// Records start at offsets that are multiples of this, so headers can be read in place.
pub const RECORD_ALIGN_BYTES: usize = 8;
/// Upper bound of each of `channel_id`, `from_uid` and `client_msg_no` (their lengths are u16).
pub const MAX_FIELD_BYTES: usize = u16::MAX as usize;
/// The smallest possible record: a header alone (an empty no-op or a cut).
pub const MIN_RECORD_BYTES: usize = align_up(RECORD_HEADER_BYTES);

const CRC_OFFSET: usize = 12;
const CRC_END: usize = RECORD_PREFIX_BYTES;

/// The fixed header of a log record (version 2). Field order avoids any padding (Pod).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct RecordHeader {
    pub magic: u32,
    pub version: u16,
    /// The SEND header flags (wkproto low nibble: NoPersist, RedDot, SyncOnce, DUP).
    pub msg_flags: u16,
    /// Whole record length including header and padding; a multiple of 8.
    pub record_len: u32,
    pub crc32: u32,
    pub message_id: i64,
    pub message_seq: u64,
    /// Unix seconds.
    pub timestamp_s: u32,
    pub payload_len: u32,
    pub channel_id_len: u16,
    pub from_uid_len: u16,
    pub client_msg_no_len: u16,
    pub channel_type: u8,
    pub setting: u8,
    /// The term of the leader that appended the entry (0: not replicated).
    pub term: u64,
    /// The entry's index in its group's log (0: not replicated).
    pub index: u64,
    /// The group (0 when not replicated).
    pub group: u32,
    /// [`RecordKind`] as a byte.
    pub kind: u8,
    /// Always 0.
    pub reserved: u8,
    /// Records of the same entry after this one.
    pub parts_left: u16,
}

/// The header of version 1: version 2's first 48 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct RecordHeaderV1 {
    pub magic: u32,
    pub version: u16,
    pub msg_flags: u16,
    pub record_len: u32,
    pub crc32: u32,
    pub message_id: i64,
    pub message_seq: u64,
    pub timestamp_s: u32,
    pub payload_len: u32,
    pub channel_id_len: u16,
    pub from_uid_len: u16,
    pub client_msg_no_len: u16,
    pub channel_type: u8,
    pub setting: u8,
}

const _: () = assert!(RECORD_HEADER_BYTES == 72);
const _: () = assert!(RECORD_HEADER_V1_BYTES == 48);
const _: () = assert!(RECORD_HEADER_BYTES.is_multiple_of(RECORD_ALIGN_BYTES));
#[cfg(target_endian = "big")]
compile_error!("the message log format is little-endian; big-endian hosts are not supported");

/// Rounds `n` up to a multiple of [`RECORD_ALIGN_BYTES`].
pub const fn align_up(n: usize) -> usize {
    (n + RECORD_ALIGN_BYTES - 1) & !(RECORD_ALIGN_BYTES - 1)
}

/// What a record holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum RecordKind {
    /// A message (one of an entry's messages when replicated).
    #[default]
    Message = 0,
    /// A new leader's empty entry (or any entry that changes no state).
    Noop = 1,
    /// A catalog operation (tokens, subscribers): its bytes in `payload`.
    Catalog = 2,
    /// A configuration change, its bytes in `payload`.
    ConfChange = 3,
    /// A configuration change of several steps (joint consensus), likewise.
    ConfChangeV2 = 4,
    /// A cut: the group's records at `index` and after, written before this one,
    /// were never applied and are void (a deposed leader's uncommitted tail, replaced
    /// by the entries written after the cut). Its term is the term of the entry
    /// that replaces the cut one.
    Cut = 5,
}

impl RecordKind {
    /// The kind of a byte; `None` for a byte no version defines.
    pub fn from_byte(b: u8) -> Option<RecordKind> {
        Some(match b {
            0 => RecordKind::Message,
            1 => RecordKind::Noop,
            2 => RecordKind::Catalog,
            3 => RecordKind::ConfChange,
            4 => RecordKind::ConfChangeV2,
            5 => RecordKind::Cut,
            _ => return None,
        })
    }
}

/// A record's place in a replicated group's log; index 0: not replicated.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RaftPos {
    pub group: u32,
    pub term: u64,
    pub index: u64,
}

impl RaftPos {
    /// Not replicated (a node alone).
    pub const NONE: RaftPos = RaftPos {
        group: 0,
        term: 0,
        index: 0,
    };

    /// Whether the record is part of a group's log.
    pub fn is_replicated(&self) -> bool {
        self.index != 0
    }
}

/// The fields of one record, borrowed (`Default`: an empty message, not replicated).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecordFields<'a> {
    pub message_id: i64,
    pub message_seq: u64,
    pub timestamp_s: u32,
    pub channel_type: u8,
    pub setting: u8,
    pub msg_flags: u16,
    pub channel_id: &'a [u8],
    pub from_uid: &'a [u8],
    pub client_msg_no: &'a [u8],
    pub payload: &'a [u8],
    pub raft: RaftPos,
    pub kind: RecordKind,
    /// Records of the same entry after this one (0 when not replicated).
    pub parts_left: u16,
}

impl<'a> RecordFields<'a> {
    /// A record of `kind` other than a message at `raft`, carrying `payload`.
    pub fn entry(raft: RaftPos, kind: RecordKind, payload: &'a [u8]) -> RecordFields<'a> {
        RecordFields {
            message_id: 0,
            message_seq: 0,
            timestamp_s: 0,
            channel_type: 0,
            setting: 0,
            msg_flags: 0,
            channel_id: b"",
            from_uid: b"",
            client_msg_no: b"",
            payload,
            raft,
            kind,
            parts_left: 0,
        }
    }

    /// Whether the fields agree with the kind and the replication fields: a
    /// message has a channel; any other kind has no channel, sender, client
    /// number, id, seq or flags, is replicated, and is one record; a record that is
    /// not replicated is a message of no group, term or parts; a cut has no bytes.
    pub fn is_consistent(&self) -> bool {
        if !self.raft.is_replicated()
            && (self.raft != RaftPos::NONE
                || self.kind != RecordKind::Message
                || self.parts_left != 0)
        {
            return false;
        }
        match self.kind {
            RecordKind::Message => !self.channel_id.is_empty(),
            other => {
                self.raft.is_replicated()
                    && self.parts_left == 0
                    && self.channel_id.is_empty()
                    && self.from_uid.is_empty()
                    && self.client_msg_no.is_empty()
                    && (self.message_id, self.message_seq, self.timestamp_s) == (0, 0, 0)
                    && (self.channel_type, self.setting, self.msg_flags) == (0, 0, 0)
                    && (other != RecordKind::Cut || self.payload.is_empty())
            }
        }
    }

    /// Padded length of this record, or `None` when a field is too long for the format.
    pub fn record_len(&self) -> Option<usize> {
        if self.channel_id.len() > MAX_FIELD_BYTES
            || self.from_uid.len() > MAX_FIELD_BYTES
            || self.client_msg_no.len() > MAX_FIELD_BYTES
            || self.payload.len() > u32::MAX as usize
        {
            return None;
        }
        let body = self.channel_id.len()
            + self.from_uid.len()
            + self.client_msg_no.len()
            + self.payload.len();
        let len = align_up(RECORD_HEADER_BYTES.checked_add(body)?);
        u32::try_from(len).ok().map(|l| l as usize)
    }

    /// Writes the record into `dst`, which must be exactly `record_len()` bytes long
    /// and the fields consistent ([`RecordFields::is_consistent`]) (checked: returns
    /// `false` and writes nothing otherwise).
    pub fn encode_into(&self, dst: &mut [u8]) -> bool {
        let Some(len) = self.record_len() else {
            return false;
        };
        if dst.len() != len || !self.is_consistent() {
            return false;
        }
        let header = RecordHeader {
            magic: RECORD_MAGIC,
            version: RECORD_VERSION,
            msg_flags: self.msg_flags,
            record_len: len as u32,
            crc32: 0,
            message_id: self.message_id,
            message_seq: self.message_seq,
            timestamp_s: self.timestamp_s,
            payload_len: self.payload.len() as u32,
            channel_id_len: self.channel_id.len() as u16,
            from_uid_len: self.from_uid.len() as u16,
            client_msg_no_len: self.client_msg_no.len() as u16,
            channel_type: self.channel_type,
            setting: self.setting,
            term: self.raft.term,
            index: self.raft.index,
            group: self.raft.group,
            kind: self.kind as u8,
            reserved: 0,
            parts_left: self.parts_left,
        };
        let (head, body) = dst.split_at_mut(RECORD_HEADER_BYTES);
        head.copy_from_slice(bytemuck::bytes_of(&header));
        let mut at = 0;
        for field in [
            self.channel_id,
            self.from_uid,
            self.client_msg_no,
            self.payload,
        ] {
            body[at..at + field.len()].copy_from_slice(field);
            at += field.len();
        }
        body[at..].fill(0);
        let crc = record_crc(head, &body[..at]);
        head[CRC_OFFSET..CRC_END].copy_from_slice(&crc.to_le_bytes());
        true
    }
}

fn record_crc(head: &[u8], fields: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&head[..CRC_OFFSET]);
    h.update(&head[CRC_END..]);
    h.update(fields);
    h.finalize()
}

/// Why bytes are not a valid record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordError {
    /// Fewer bytes than a header remain.
    Short,
    /// Magic or version mismatch (an all-zero region lands here).
    BadMagic,
    /// `record_len` disagrees with the field lengths or exceeds the bytes that remain.
    BadLength,
    /// Checksum mismatch.
    BadCrc,
    /// The checksum matches but the fields disagree with the kind (an unknown kind,
    /// a message without a channel, replication fields on a record of no group,
    /// a non-zero reserved byte): written by a broken writer.
    BadFields,
}

/// The magic, version and `record_len` of the bytes at the start of `prefix` (the
/// bytes every version starts with).
pub fn prefix_of(prefix: &[u8; RECORD_PREFIX_BYTES]) -> (u32, u16, u32) {
    let word = |i: usize| u32::from_le_bytes(prefix[i..i + 4].try_into().expect("4 bytes"));
    (word(0), u16::from_le_bytes([prefix[4], prefix[5]]), word(8))
}

/// Decodes and fully validates the record at the start of `bytes` (either version;
/// module docs). Returns the record and its padded length.
pub fn decode(bytes: &[u8]) -> Result<(RecordFields<'_>, usize), RecordError> {
    if bytes.len() < RECORD_PREFIX_BYTES {
        return Err(RecordError::Short);
    }
    let (magic, version, _) = prefix_of(bytes[..RECORD_PREFIX_BYTES].try_into().expect("16"));
    let (header, header_bytes, reserved) = match (magic, version) {
        (RECORD_MAGIC, RECORD_VERSION) if bytes.len() >= RECORD_HEADER_BYTES => {
            let h: RecordHeader = bytemuck::pod_read_unaligned(&bytes[..RECORD_HEADER_BYTES]);
            (h, RECORD_HEADER_BYTES, h.reserved)
        }
        (RECORD_MAGIC, RECORD_VERSION_1) if bytes.len() >= RECORD_HEADER_V1_BYTES => {
            let h: RecordHeaderV1 = bytemuck::pod_read_unaligned(&bytes[..RECORD_HEADER_V1_BYTES]);
            (upgraded(&h), RECORD_HEADER_V1_BYTES, 0)
        }
        (RECORD_MAGIC, RECORD_VERSION | RECORD_VERSION_1) => return Err(RecordError::Short),
        _ => return Err(RecordError::BadMagic),
    };
    let body_len = header.channel_id_len as usize
        + header.from_uid_len as usize
        + header.client_msg_no_len as usize
        + header.payload_len as usize;
    let len = header.record_len as usize;
    if len != align_up(header_bytes + body_len) || len > bytes.len() {
        return Err(RecordError::BadLength);
    }
    let fields = &bytes[header_bytes..header_bytes + body_len];
    if record_crc(&bytes[..header_bytes], fields) != header.crc32 {
        return Err(RecordError::BadCrc);
    }
    let (channel_id, rest) = fields.split_at(header.channel_id_len as usize);
    let (from_uid, rest) = rest.split_at(header.from_uid_len as usize);
    let (client_msg_no, payload) = rest.split_at(header.client_msg_no_len as usize);
    let kind = RecordKind::from_byte(header.kind).ok_or(RecordError::BadFields)?;
    let record = RecordFields {
        message_id: header.message_id,
        message_seq: header.message_seq,
        timestamp_s: header.timestamp_s,
        channel_type: header.channel_type,
        setting: header.setting,
        msg_flags: header.msg_flags,
        channel_id,
        from_uid,
        client_msg_no,
        payload,
        raft: RaftPos {
            group: header.group,
            term: header.term,
            index: header.index,
        },
        kind,
        parts_left: header.parts_left,
    };
    if reserved != 0 || !record.is_consistent() {
        return Err(RecordError::BadFields);
    }
    Ok((record, len))
}

/// A version 1 header as version 2's: not replicated, a message.
fn upgraded(h: &RecordHeaderV1) -> RecordHeader {
    RecordHeader {
        magic: h.magic,
        version: h.version,
        msg_flags: h.msg_flags,
        record_len: h.record_len,
        crc32: h.crc32,
        message_id: h.message_id,
        message_seq: h.message_seq,
        timestamp_s: h.timestamp_s,
        payload_len: h.payload_len,
        channel_id_len: h.channel_id_len,
        from_uid_len: h.from_uid_len,
        client_msg_no_len: h.client_msg_no_len,
        channel_type: h.channel_type,
        setting: h.setting,
        term: 0,
        index: 0,
        group: 0,
        kind: RecordKind::Message as u8,
        reserved: 0,
        parts_left: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> RecordFields<'static> {
        RecordFields {
            message_id: -5,
            message_seq: 9,
            timestamp_s: 1_700_000_000,
            channel_type: 2,
            setting: 0x10,
            msg_flags: 4,
            channel_id: b"group-1",
            from_uid: b"alice",
            client_msg_no: b"c-1",
            payload: b"hello!",
            ..RecordFields::default()
        }
    }

    fn encoded(f: &RecordFields<'_>) -> Vec<u8> {
        let mut buf = vec![0u8; f.record_len().unwrap()];
        assert!(f.encode_into(&mut buf), "{f:?}");
        buf
    }

    /// Every byte of the header and fields is covered: each single bit flip fails.
    fn every_bit_flip_is_caught(buf: &[u8], used: usize) {
        for bit in 0..used * 8 {
            let mut b = buf.to_vec();
            b[bit / 8] ^= 1 << (bit % 8);
            assert!(decode(&b).is_err(), "bit {bit} flip not detected");
        }
    }

    #[test]
    fn round_trip_and_every_single_bit_flip_is_caught() {
        let f = sample();
        let buf = encoded(&f);
        assert_eq!(buf.len() % RECORD_ALIGN_BYTES, 0);
        assert_eq!(decode(&buf).unwrap(), (f, buf.len()));
        every_bit_flip_is_caught(&buf, RECORD_HEADER_BYTES + 7 + 5 + 3 + 6);
    }

    /// A replicated message (one part of an entry of three) and an entry of every
    /// other kind carry their group, term, index and parts through.
    #[test]
    fn replicated_records_round_trip() {
        let raft = RaftPos {
            group: 7,
            term: 3,
            index: 41,
        };
        let part = RecordFields {
            raft,
            parts_left: 2,
            ..sample()
        };
        let buf = encoded(&part);
        assert_eq!(decode(&buf).unwrap(), (part, buf.len()));
        every_bit_flip_is_caught(&buf, RECORD_HEADER_BYTES + 7 + 5 + 3 + 6);
        for kind in [
            RecordKind::Noop,
            RecordKind::Catalog,
            RecordKind::ConfChange,
            RecordKind::ConfChangeV2,
            RecordKind::Cut,
        ] {
            let data: &[u8] = if kind == RecordKind::Cut { b"" } else { b"xyz" };
            let e = RecordFields::entry(raft, kind, data);
            let buf = encoded(&e);
            assert_eq!(decode(&buf).unwrap(), (e, buf.len()));
            assert_eq!(RecordKind::from_byte(kind as u8), Some(kind));
        }
        assert_eq!(RecordKind::from_byte(6), None);
        assert_eq!(
            MIN_RECORD_BYTES,
            encoded(&RecordFields::entry(raft, RecordKind::Cut, b"")).len()
        );
    }

    /// Bytes written by version 1 (a 48-byte header) read as a message of no group.
    #[test]
    fn version_1_records_are_read() {
        let f = sample();
        let body = [f.channel_id, f.from_uid, f.client_msg_no, f.payload].concat();
        let len = align_up(RECORD_HEADER_V1_BYTES + body.len());
        let h = RecordHeaderV1 {
            magic: RECORD_MAGIC,
            version: RECORD_VERSION_1,
            msg_flags: f.msg_flags,
            record_len: len as u32,
            crc32: 0,
            message_id: f.message_id,
            message_seq: f.message_seq,
            timestamp_s: f.timestamp_s,
            payload_len: f.payload.len() as u32,
            channel_id_len: 7,
            from_uid_len: 5,
            client_msg_no_len: 3,
            channel_type: f.channel_type,
            setting: f.setting,
        };
        let mut buf = bytemuck::bytes_of(&h).to_vec();
        buf.extend_from_slice(&body);
        buf.resize(len, 0);
        let crc = record_crc(&buf[..RECORD_HEADER_V1_BYTES], &body);
        buf[CRC_OFFSET..CRC_END].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(decode(&buf).unwrap(), (f, len));
        every_bit_flip_is_caught(&buf, RECORD_HEADER_V1_BYTES + body.len());
        // A record of version 1 that ends a file shorter than a version 2 header.
        assert_eq!(decode(&buf[..len]).unwrap().1, len);
        assert_eq!(decode(&buf[..40]), Err(RecordError::Short));
    }

    /// Fields that disagree with their kind are never written, and read as
    /// `BadFields` even under a matching checksum.
    #[test]
    fn inconsistent_fields_are_refused() {
        let raft = RaftPos {
            group: 1,
            term: 1,
            index: 1,
        };
        let bad = [
            RecordFields {
                channel_id: b"",
                ..sample()
            },
            RecordFields {
                raft: RaftPos { index: 0, ..raft },
                ..sample()
            },
            RecordFields {
                parts_left: 1,
                ..sample()
            },
            RecordFields {
                kind: RecordKind::Noop,
                ..sample()
            },
            RecordFields::entry(RaftPos::NONE, RecordKind::Noop, b""),
            RecordFields::entry(raft, RecordKind::Cut, b"x"),
            RecordFields {
                parts_left: 1,
                ..RecordFields::entry(raft, RecordKind::Catalog, b"")
            },
            RecordFields {
                message_id: 1,
                ..RecordFields::entry(raft, RecordKind::Catalog, b"")
            },
            RecordFields {
                msg_flags: 1,
                ..RecordFields::entry(raft, RecordKind::Catalog, b"")
            },
            RecordFields {
                channel_type: 1,
                ..RecordFields::entry(raft, RecordKind::Catalog, b"")
            },
            RecordFields {
                from_uid: b"u",
                ..RecordFields::entry(raft, RecordKind::Catalog, b"")
            },
        ];
        for f in bad {
            assert!(!f.is_consistent(), "{f:?}");
            let mut buf = vec![0u8; f.record_len().unwrap()];
            assert!(!f.encode_into(&mut buf), "{f:?}");
            // Written anyway (a broken writer), with a checksum that matches.
            let buf = forged(&f, 0);
            assert_eq!(decode(&buf), Err(RecordError::BadFields), "{f:?}");
        }
    }

    /// `f` encoded as `encode_into` would, without its consistency check, with
    /// `reserved` in the reserved byte.
    fn forged(f: &RecordFields<'_>, reserved: u8) -> Vec<u8> {
        let body = [f.channel_id, f.from_uid, f.client_msg_no, f.payload].concat();
        let len = align_up(RECORD_HEADER_BYTES + body.len());
        let h = RecordHeader {
            magic: RECORD_MAGIC,
            version: RECORD_VERSION,
            msg_flags: f.msg_flags,
            record_len: len as u32,
            crc32: 0,
            message_id: f.message_id,
            message_seq: f.message_seq,
            timestamp_s: f.timestamp_s,
            payload_len: f.payload.len() as u32,
            channel_id_len: f.channel_id.len() as u16,
            from_uid_len: f.from_uid.len() as u16,
            client_msg_no_len: f.client_msg_no.len() as u16,
            channel_type: f.channel_type,
            setting: f.setting,
            term: f.raft.term,
            index: f.raft.index,
            group: f.raft.group,
            kind: f.kind as u8,
            reserved,
            parts_left: f.parts_left,
        };
        let mut buf = bytemuck::bytes_of(&h).to_vec();
        buf.extend_from_slice(&body);
        buf.resize(len, 0);
        let crc = record_crc(&buf[..RECORD_HEADER_BYTES], &body);
        buf[CRC_OFFSET..CRC_END].copy_from_slice(&crc.to_le_bytes());
        buf
    }

    /// The reserved byte and an unknown kind are refused like the rest.
    #[test]
    fn reserved_byte_and_unknown_kind_are_refused() {
        let f = sample();
        assert_eq!(decode(&forged(&f, 0)).unwrap().0, f);
        assert_eq!(decode(&forged(&f, 1)), Err(RecordError::BadFields));
        let mut buf = forged(&f, 0);
        buf[68] = 6; // the kind byte
        let body_at = RECORD_HEADER_BYTES;
        let crc = record_crc(&buf[..RECORD_HEADER_BYTES], &buf[body_at..body_at + 21]);
        buf[CRC_OFFSET..CRC_END].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(decode(&buf), Err(RecordError::BadFields));
    }

    #[test]
    fn zeros_and_short_input_are_invalid() {
        assert_eq!(decode(&[0u8; 80]), Err(RecordError::BadMagic));
        assert_eq!(decode(&[0u8; 10]), Err(RecordError::Short));
        let f = sample();
        let mut buf = encoded(&f);
        assert_eq!(decode(&buf[..buf.len() - 8]), Err(RecordError::BadLength));
        assert_eq!(
            decode(&buf[..RECORD_HEADER_BYTES - 8]),
            Err(RecordError::Short)
        );
        assert!(!f.encode_into(&mut buf[..8]));
    }
}
