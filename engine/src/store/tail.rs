//! A reader of a message log's files that follows the log from outside its shard
//! (the `msg.notify` webhook): [`LogTail::read`] reads the records between a
//! position and an end the shard published ([`super::MessageLog::end_position`]),
//! with `pread` on the segment files, never touching the shard's [`super::MessageLog`].
//!
//! Why this is safe while the shard appends: a record below a published end was
//! completely written (into the shared mapping, which is the file's page cache) before
//! the end was published, and segments only grow at their end; the reader never reads
//! at or past the end. A segment the shard retires (deletes) under the reader is
//! skipped: the reader goes on at the oldest segment still there and says what it
//! skipped ([`TailRead::skipped`]). A record that does not validate below the end
//! (media corruption) is skipped the same way, with the rest of its segment.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::log::{list_segment_ids, position, segment_path, LogPosition, StoredMessage};
use super::record::{decode, prefix_of, RecordKind, RECORD_MAGIC, RECORD_PREFIX_BYTES};

/// One record read: where it starts, where the next one does, and the message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TailMessage {
    pub position: LogPosition,
    pub next: LogPosition,
    pub message: StoredMessage,
}

/// What one [`LogTail::read`] gave.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TailRead {
    /// The records, in log order.
    pub messages: Vec<TailMessage>,
    /// Where the next read starts (the end given, once caught up).
    pub next: LogPosition,
    /// Positions jumped over: `(from, to)` when segments were gone (retired before
    /// they were read) or a record did not validate.
    pub skipped: Option<(LogPosition, LogPosition)>,
}

/// A follower of one log directory (`DATA_DIR/shard-N/log`); keeps the segment it
/// reads open.
#[derive(Debug)]
pub struct LogTail {
    dir: PathBuf,
    open: Option<(u32, File)>,
    buf: Vec<u8>,
}

fn segment_of(pos: LogPosition) -> u32 {
    (pos >> 32) as u32
}

fn offset_of(pos: LogPosition) -> u32 {
    (pos & 0xffff_ffff) as u32
}

impl LogTail {
    pub fn new(dir: &Path) -> LogTail {
        LogTail {
            dir: dir.to_path_buf(),
            open: None,
            buf: Vec::new(),
        }
    }

    /// Reads the records in `[from, end)`, at most `messages_max` of them and, past
    /// the first, at most about `bytes_max` of records. `end` must be a position the
    /// log's owner published (every record below it is complete).
    pub fn read(
        &mut self,
        from: LogPosition,
        end: LogPosition,
        messages_max: usize,
        bytes_max: usize,
    ) -> io::Result<TailRead> {
        let mut out = TailRead {
            next: from,
            ..TailRead::default()
        };
        let mut bytes = 0usize;
        let mut pos = from;
        while pos < end && out.messages.len() < messages_max.max(1) && bytes < bytes_max.max(1) {
            let seg = segment_of(pos);
            let Some(file) = open_segment(&self.dir, &mut self.open, seg)? else {
                // Retired (deleted) before it was read: on at the oldest one left.
                match self.oldest_after(seg)? {
                    Some(next) => {
                        let to = position(next, 0);
                        skip(&mut out, pos, to);
                        pos = to;
                        continue;
                    }
                    None => break,
                }
            };
            match read_record(file, offset_of(pos), &mut self.buf)? {
                Some(len) => match decode(&self.buf[..len]) {
                    // A replicated group's other records (no-ops, catalog
                    // operations, configuration changes, cuts) are no messages.
                    Ok((f, len)) if f.kind != RecordKind::Message => pos += len as u64,
                    Ok((f, len)) => {
                        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
                        let next = pos + len as u64;
                        out.messages.push(TailMessage {
                            position: pos,
                            next,
                            message: StoredMessage {
                                message_id: f.message_id,
                                message_seq: f.message_seq,
                                channel_type: f.channel_type,
                                channel_id: text(f.channel_id),
                                from_uid: text(f.from_uid),
                                client_msg_no: text(f.client_msg_no),
                                setting: f.setting,
                                msg_flags: f.msg_flags as u8,
                                timestamp_s: f.timestamp_s,
                                payload: f.payload.to_vec(),
                            },
                        });
                        bytes += len;
                        pos = next;
                    }
                    Err(_) => {
                        // Below the published end, so not a torn append: skip the
                        // rest of the segment.
                        let to = position(seg.saturating_add(1), 0);
                        skip(&mut out, pos, to);
                        pos = to;
                    }
                },
                // The segment's records end here: the log rolled to the next one
                // (or, when `end` is in this segment, nothing more is there yet).
                None if segment_of(end) > seg => pos = position(seg + 1, 0),
                None => break,
            }
        }
        out.next = pos;
        Ok(out)
    }

    /// The oldest segment after `id` still in the directory.
    fn oldest_after(&self, id: u32) -> io::Result<Option<u32>> {
        let ids = list_segment_ids(&self.dir).map_err(io::Error::other)?;
        Ok(ids.into_iter().find(|&s| s > id))
    }
}

/// The file of segment `id` of `dir`, kept in `open` (`None`: it is not there).
fn open_segment<'a>(
    dir: &Path,
    open: &'a mut Option<(u32, File)>,
    id: u32,
) -> io::Result<Option<&'a File>> {
    if open.as_ref().is_none_or(|(have, _)| *have != id) {
        *open = None;
        match File::open(segment_path(dir, id)) {
            Ok(f) => *open = Some((id, f)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        }
    }
    Ok(open.as_ref().map(|(_, f)| f))
}

fn skip(out: &mut TailRead, from: LogPosition, to: LogPosition) {
    let start = out.skipped.map_or(from, |(f, _)| f);
    out.skipped = Some((start, to));
}

/// Reads the record at `off` of `file` into `buf`; its length, or `None` when no
/// record starts there (zeros, or the end of the file).
fn read_record(file: &File, off: u32, buf: &mut Vec<u8>) -> io::Result<Option<usize>> {
    // The bytes every version starts with (a version 1 record may end the file
    // closer than a version 2 header).
    let mut head = [0u8; RECORD_PREFIX_BYTES];
    match file.read_exact_at(&mut head, u64::from(off)) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let (magic, _, record_len) = prefix_of(&head);
    if magic != RECORD_MAGIC {
        return Ok(None);
    }
    let len = (record_len as usize).max(RECORD_PREFIX_BYTES);
    buf.clear();
    buf.resize(len, 0);
    match file.read_exact_at(buf, u64::from(off)) {
        Ok(()) => Ok(Some(len)),
        // A length past the file: left for decode to refuse.
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            buf.truncate(RECORD_PREFIX_BYTES);
            buf.copy_from_slice(&head);
            Ok(Some(RECORD_PREFIX_BYTES))
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{LogConfig, MessageLog, NewMessage};

    fn append(log: &mut MessageLog, i: u32) {
        let payload = vec![i as u8; 10_000 + i as usize];
        log.append(&NewMessage {
            message_id: 1000 + i64::from(i),
            channel_type: 2,
            channel_id: "g",
            from_uid: "u",
            client_msg_no: &format!("c{i}"),
            setting: 0,
            msg_flags: 0,
            timestamp_s: i,
            payload: &payload,
        })
        .unwrap();
    }

    fn small() -> LogConfig {
        LogConfig {
            // About 26 records of 10 kB a segment.
            segment_bytes: 64 * 4096,
            payload_bytes_max: 16 << 10,
            segments_max: 3,
            ..LogConfig::default()
        }
    }

    #[test]
    fn reads_what_the_log_wrote_across_rolls_in_bounded_steps() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, _) = MessageLog::open(dir.path(), small()).unwrap();
        let start = log.end_position();
        for i in 0..40 {
            append(&mut log, i);
        }
        assert!(log.segment_ids().len() > 1, "rolled");
        let end = log.end_position();
        let mut tail = LogTail::new(dir.path());
        let mut got = Vec::new();
        let mut pos = start;
        loop {
            let r = tail.read(pos, end, 7, usize::MAX).unwrap();
            assert!(r.messages.len() <= 7);
            assert_eq!(r.skipped, None);
            if r.messages.is_empty() {
                assert_eq!(r.next, end);
                break;
            }
            pos = r.next;
            got.extend(r.messages);
        }
        let ids: Vec<i64> = got.iter().map(|m| m.message.message_id).collect();
        assert_eq!(ids, (1000..1040).collect::<Vec<_>>());
        for m in &got {
            let v = log.get(m.position).unwrap();
            assert_eq!(v.to_stored(), m.message);
        }
        // A byte bound stops after the first record past it.
        let r = tail.read(start, end, 100, 1).unwrap();
        assert_eq!(r.messages.len(), 1);
        assert_eq!(r.next, got[1].position);
    }

    #[test]
    fn a_retired_segment_is_skipped_and_said() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, _) = MessageLog::open(dir.path(), small()).unwrap();
        let start = log.end_position();
        for i in 0..100 {
            append(&mut log, i);
        }
        log.sync(0).unwrap();
        let first_kept = log.segment_ids()[0];
        assert!(first_kept > 0, "retired some");
        let end = log.end_position();
        let mut tail = LogTail::new(dir.path());
        let r = tail.read(start, end, 1000, usize::MAX).unwrap();
        assert_eq!(r.skipped, Some((start, position(first_kept, 0))));
        assert_eq!(r.next, end);
        let last = r.messages.last().unwrap();
        assert_eq!(last.message.message_id, 1099);
        assert_eq!(r.messages[0].position, position(first_kept, 0));
    }
}
