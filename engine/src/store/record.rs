//! The on-disk record of the message log: a fixed 48-byte [`RecordHeader`]
//! (`#[repr(C)]`, `bytemuck::Pod`, little-endian hosts only) followed by the variable
//! fields `channel_id ‖ from_uid ‖ client_msg_no ‖ payload`, zero-padded to a multiple
//! of [`RECORD_ALIGN_BYTES`].
//!
//! A record is valid when: the magic and version match, `record_len` is exactly the
//! padded length its field lengths give and fits in the bytes that remain, and the
//! CRC-32 (IEEE, `crc32fast`) of `header[0..12] ‖ header[16..48] ‖ fields` (every byte
//! of the record but the crc itself and the padding) matches. An all-zero region is
//! never valid (magic is non-zero), which is how the end of a preallocated segment is
//! recognised.

use bytemuck::{Pod, Zeroable};

/// "IMLG" read as a little-endian u32.
pub const RECORD_MAGIC: u32 = u32::from_le_bytes(*b"IMLG");
/// Format version written into every record.
pub const RECORD_VERSION: u16 = 1;
/// Size of [`RecordHeader`].
pub const RECORD_HEADER_BYTES: usize = std::mem::size_of::<RecordHeader>();
/// Records start at offsets that are multiples of this, so headers can be read in place.
pub const RECORD_ALIGN_BYTES: usize = 8;
/// Upper bound of each of `channel_id`, `from_uid` and `client_msg_no` (their lengths are u16).
pub const MAX_FIELD_BYTES: usize = u16::MAX as usize;
/// The smallest possible record: header plus a 1-byte channel id, padded.
pub const MIN_RECORD_BYTES: usize = align_up(RECORD_HEADER_BYTES + 1);

const CRC_OFFSET: usize = 12;
const CRC_END: usize = 16;

/// The fixed header of a log record. Field order avoids any padding (Pod).
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
}

const _: () = assert!(RECORD_HEADER_BYTES == 48);
const _: () = assert!(RECORD_HEADER_BYTES.is_multiple_of(RECORD_ALIGN_BYTES));
#[cfg(target_endian = "big")]
compile_error!("the message log format is little-endian; big-endian hosts are not supported");

/// Rounds `n` up to a multiple of [`RECORD_ALIGN_BYTES`].
pub const fn align_up(n: usize) -> usize {
    (n + RECORD_ALIGN_BYTES - 1) & !(RECORD_ALIGN_BYTES - 1)
}

/// The fields of one record, borrowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
}

impl RecordFields<'_> {
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
    /// (checked: returns `false` and writes nothing otherwise).
    pub fn encode_into(&self, dst: &mut [u8]) -> bool {
        let Some(len) = self.record_len() else {
            return false;
        };
        if dst.len() != len {
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
    h.update(&head[CRC_END..RECORD_HEADER_BYTES]);
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
}

/// Decodes and fully validates the record at the start of `bytes` (which must start
/// at a multiple of 8 from a page-aligned base for the in-place header read; an
/// unaligned start is read by copy). Returns the record and its padded length.
pub fn decode(bytes: &[u8]) -> Result<(RecordFields<'_>, usize), RecordError> {
    if bytes.len() < RECORD_HEADER_BYTES {
        return Err(RecordError::Short);
    }
    let header: RecordHeader = bytemuck::pod_read_unaligned(&bytes[..RECORD_HEADER_BYTES]);
    if header.magic != RECORD_MAGIC || header.version != RECORD_VERSION {
        return Err(RecordError::BadMagic);
    }
    let body_len = header.channel_id_len as usize
        + header.from_uid_len as usize
        + header.client_msg_no_len as usize
        + header.payload_len as usize;
    let len = header.record_len as usize;
    if len != align_up(RECORD_HEADER_BYTES + body_len) || len > bytes.len() {
        return Err(RecordError::BadLength);
    }
    let fields = &bytes[RECORD_HEADER_BYTES..RECORD_HEADER_BYTES + body_len];
    if record_crc(&bytes[..RECORD_HEADER_BYTES], fields) != header.crc32 {
        return Err(RecordError::BadCrc);
    }
    let (channel_id, rest) = fields.split_at(header.channel_id_len as usize);
    let (from_uid, rest) = rest.split_at(header.from_uid_len as usize);
    let (client_msg_no, payload) = rest.split_at(header.client_msg_no_len as usize);
    Ok((
        RecordFields {
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
        },
        len,
    ))
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
        }
    }

    #[test]
    fn round_trip_and_every_single_bit_flip_is_caught() {
        let f = sample();
        let len = f.record_len().unwrap();
        assert_eq!(len % RECORD_ALIGN_BYTES, 0);
        let mut buf = vec![0u8; len];
        assert!(f.encode_into(&mut buf));
        assert_eq!(decode(&buf).unwrap(), (f, len));
        let used = RECORD_HEADER_BYTES + 7 + 5 + 3 + 6;
        for bit in 0..used * 8 {
            let mut b = buf.clone();
            b[bit / 8] ^= 1 << (bit % 8);
            assert!(decode(&b).is_err(), "bit {bit} flip not detected");
        }
    }

    #[test]
    fn zeros_and_short_input_are_invalid() {
        assert_eq!(decode(&[0u8; 64]), Err(RecordError::BadMagic));
        assert_eq!(decode(&[0u8; 10]), Err(RecordError::Short));
        let f = sample();
        let mut buf = vec![0u8; f.record_len().unwrap()];
        assert!(f.encode_into(&mut buf));
        assert_eq!(decode(&buf[..buf.len() - 8]), Err(RecordError::BadLength));
        assert!(!f.encode_into(&mut buf[..8]));
    }
}
