//! The durable message log of one commit shard.
//!
//! # Layout
//! One append-only log per commit shard holds every channel of the shard's hash
//! slots (never a file per channel). It is a directory (conventionally
//! [`log_dir`]`(data_dir, shard)`) of segment files `<id:020>.seg`, each preallocated
//! with `posix_fallocate` to `segment_bytes` and mapped with a shared
//! [`memmap2::MmapMut`]; records ([`super::record`]) are written back to back at
//! 8-byte-aligned offsets. A record's [`LogPosition`] is `segment_id << 32 | offset`.
//!
//! Why mmap for writes (not `pwrite`): an append is a `memcpy` into the page cache, no
//! syscall per message; group commit then costs one `fdatasync` of the segment per
//! batch, which writes back the pages dirtied through the shared mapping (the same
//! `vfs_fsync_range(.., datasync=1)` that `msync(MS_SYNC)` calls, including the
//! unwritten→written extent conversion the preallocation needs). Preallocating real blocks means a store can never fault with SIGBUS on a
//! full disk. Reads are slices of the same mappings (zero copy).
//!
//! # Durability contract
//! - [`MessageLog::append`] puts the record in the page cache (the shared mapping *is*
//!   the file's page cache). It is **not durable** until [`MessageLog::sync`] returns
//!   `Ok`, or a [`SyncJob`] from [`MessageLog::begin_sync`] (run by the node's syncer
//!   thread, `node/syncer.rs`) ran and [`MessageLog::end_sync`] accepted its result.
//!   Only under [`FsyncPolicy::Always`] does the engine wait for that before a
//!   SENDACK (group commit: append a batch, sync once, then acknowledge the batch);
//!   under the default [`FsyncPolicy::IntervalMs`] it acknowledges at once and syncs
//!   every interval.
//! - **Process crash** (`kill -9`, panic, abort): everything appended survives, synced
//!   or not: the stores already are in the kernel's page cache, which outlives the
//!   process and is written back by the kernel. Only a record being copied at the very
//!   instant of death can be torn; recovery drops it (it was never acknowledged, since
//!   acknowledgement comes after `append` returns). `engine/tests/store_crash.rs`
//!   checks both (with and without `sync`).
//! - **Kernel crash or power loss**: only what a successful `sync` covered survives.
//!   With [`FsyncPolicy::Always`] the engine syncs before every SENDACK batch, so every
//!   acknowledged message survives. With [`FsyncPolicy::IntervalMs`] messages
//!   acknowledged within the last interval may be lost, and their seqs are then
//!   reused by later messages of the same channel.
//! - A failed `sync` (EIO) **poisons** the log: the kernel may have dropped the dirty
//!   pages, so a later `sync` could report success for lost data (the "fsyncgate"
//!   lesson). Every later append/sync returns [`LogError::Poisoned`]; the process must
//!   restart and recover. (The node then refuses sends with SENDACK 15 and reports
//!   the shard in `/readyz` and the `log_write_failed` gauge.)
//! - Every sync goes through one function: `fdatasync`, or a [`SyncHook`] a test
//!   installs to hold, fail or record syncs (`engine/tests/store_power_cut.rs`
//!   simulates a power cut from what the syncs covered).
//! - Messages with the NoPersist flag are never given to the log (the engine skips it).
//!
//! # Recovery ([`MessageLog::open`])
//! Segments are scanned in id order; each record is validated (magic, version, length
//! within the segment, CRC, UTF-8 ids). The bytes after a segment's last valid record
//! must all be zero: a segment is sealed (synced in full) before any record is
//! written to the next one, so a zero tail is a clean end and the scan continues with
//! the next segment (an empty spare segment created ahead, see below, is such a
//! next one: it becomes the active segment). **The first invalid record ends the log** (a torn tail, or a CRC mismatch
//! in the middle): the rest of that segment is zeroed and synced, and every later
//! segment is deleted (Kafka's choice). Skipping over a bad record is not possible
//! safely (its length field is not trusted), and serving records after a hole would
//! break the per-channel seq order; the price is that mid-log media corruption loses
//! everything after it (replication, not this log, is the answer to that).
//!
//! # Per-channel index and limits
//! In memory, per channel (`channel_type`, `channel_id`): its last seq and the
//! positions of its retained messages (seqs of one channel are contiguous, so
//! `positions[seq - first_seq]`, 8 bytes per message). Bounds:
//! - `segments_max`: when a roll makes more, the oldest segment is **retired**: its
//!   messages leave the index at once and its file is deleted by the next sync job
//!   (retention). On disk a log holds up to `segments_max` + 2 segment files (one
//!   retired awaiting its job, one spare).
//! - `indexed_messages_max`: an append that would index more retires the oldest
//!   segment first (rolling first if it is the active one). So this memory budget is a
//!   second retention bound; size it above `segments_max` × messages per segment to
//!   let `segments_max` bind first.
//! - `channels_max`: channels indexed in memory. Only channels with at least one
//!   retained message are indexed; an append to a new channel beyond it retires the
//!   oldest segment(s) first, until some channel has no retained message left (so it
//!   is a third retention bound, never a refusal).
//!
//! # Retired channels (no retained message)
//! A channel whose last retained message is retired leaves the index: all it still
//! needs is its last seq, which goes to a compact **retired-seq table**: a keyed
//! 64-bit SipHash of `(channel_type, channel_id)` → last seq (16 bytes, whatever the
//! id's length), at most `retired_channels_max` entries; beyond that the oldest
//! entries fold into `seq_floor_buckets` high-water marks (`floor[hash % n] =
//! max(floor, last seq)`). A channel not in the index starts from `max(its entry, its
//! bucket's floor)`. Before a retired segment's file is deleted the table is written
//! atomically to `channel_seqs.snap` (with its hash key), which recovery loads.
//!
//! Invariant: a channel's seqs never go back or repeat, through eviction, retention
//! and restart (every merge is a `max`; a hash collision can only raise a value). They
//! do not skip either, except for a channel that was folded into a bucket, or that
//! shares a bucket with a folded one (its next seq is then above its last + 1), or
//! after a 64-bit collision (negligible). A read returns exactly the channel's
//! records still on disk: an evicted channel has none.
//!
//! # File work and threads
//! A [`SyncJob`] (run by the node's syncer thread) also carries the log's file work,
//! done after its sync has been reported: it creates and preallocates the next
//! segment ahead of its roll (the *spare*), and writes the seq snapshot then deletes
//! (and unmaps) the retired segments. A roll on the shard thread then seals the
//! active segment (one `fdatasync` of its unsynced tail: the one sync left on the
//! shard thread in steady state) and switches to the spare. Still on the caller's
//! thread: the seal; building the seq snapshot (a pass over the channel table) when
//! a segment is retired; creating a segment when no job made one ahead (counted in
//! [`LogStats::segments_created_inline`]), or waiting for a job still making it;
//! [`MessageLog::sync`] (a graceful stop: seal and delete retired files); and
//! [`MessageLog::open`] (recovery, retirement at open).

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};

use memmap2::MmapMut;

use super::fsutil::{
    create_private_dir_all, preallocate, private_file, sync_dir, write_atomic, DirLock,
};
use super::record::{
    align_up, decode, RaftPos, RecordFields, RecordKind, MAX_FIELD_BYTES, MIN_RECORD_BYTES,
    RECORD_HEADER_BYTES,
};

mod config;
mod groups;
mod retired;
mod sync;

pub use config::{FsyncPolicy, LogConfig, LogError};
use groups::*;
pub use groups::{Entry, EntryBody, GroupSpan};
use retired::*;
use sync::*;
pub use sync::{SyncHook, SyncJob};

/// Where a record lives: `segment_id << 32 | byte offset in the segment`.
pub type LogPosition = u64;

const SEGMENT_SUFFIX: &str = ".seg";
const SEQ_SNAPSHOT_NAME: &str = "channel_seqs.snap";
const SEQ_SNAPSHOT_MAGIC: u32 = u32::from_le_bytes(*b"ICSQ");
const PAGE_BYTES: usize = 4096;
/// Snapshot format 2: the retired-seq table (format 1, `ICSQ`, listed ids).
const RETIRED_SNAPSHOT_MAGIC: u32 = u32::from_le_bytes(*b"ICS2");
/// Memory of one indexed channel besides its id and positions: map slot (boxed id
/// pointer + state, load factor), allocation headers.
const CHANNEL_ENTRY_BYTES: u64 = 120;
/// Memory of one retired-seq entry: map slot (hash, seq, control byte, load factor)
/// and its place in the eviction order.
const RETIRED_ENTRY_BYTES: u64 = 48;

/// `<data_dir>/shard-<n>/log`: the conventional directory of shard `n`'s log.
pub fn log_dir(data_dir: &Path, shard: usize) -> PathBuf {
    data_dir.join(format!("shard-{shard}")).join("log")
}

fn io_err(op: &'static str) -> impl FnOnce(io::Error) -> LogError {
    move |source| LogError::Io { op, source }
}

pub use domain::send::commit::NewMessage;

/// What [`MessageLog::append`] assigned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppendedMessage {
    /// The channel's previous last seq + 1 (the first message of a channel gets 1).
    pub message_seq: u64,
    pub position: LogPosition,
}

/// A stored message, borrowed from the log's mapping (valid until the next `&mut` call).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MessageView<'a> {
    pub message_id: i64,
    pub message_seq: u64,
    pub channel_type: u8,
    pub channel_id: &'a str,
    pub from_uid: &'a str,
    pub client_msg_no: &'a str,
    pub setting: u8,
    pub msg_flags: u8,
    pub timestamp_s: u32,
    pub payload: &'a [u8],
    pub position: LogPosition,
}

/// An owned copy of a [`MessageView`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredMessage {
    pub message_id: i64,
    pub message_seq: u64,
    pub channel_type: u8,
    pub channel_id: String,
    pub from_uid: String,
    pub client_msg_no: String,
    pub setting: u8,
    pub msg_flags: u8,
    pub timestamp_s: u32,
    pub payload: Vec<u8>,
}

impl MessageView<'_> {
    /// The bytes [`MessageView::to_stored`] copies (payload and strings).
    pub fn copy_bytes(&self) -> usize {
        self.payload.len() + self.channel_id.len() + self.from_uid.len() + self.client_msg_no.len()
    }

    pub fn to_stored(&self) -> StoredMessage {
        StoredMessage {
            message_id: self.message_id,
            message_seq: self.message_seq,
            channel_type: self.channel_type,
            channel_id: self.channel_id.to_owned(),
            from_uid: self.from_uid.to_owned(),
            client_msg_no: self.client_msg_no.to_owned(),
            setting: self.setting,
            msg_flags: self.msg_flags,
            timestamp_s: self.timestamp_s,
            payload: self.payload.to_vec(),
        }
    }
}

/// `/channel/messagesync` pull mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PullMode {
    /// 0: towards older messages.
    Down,
    /// 1: towards newer messages.
    Up,
}

impl PullMode {
    /// 1 is Up; anything else is Down (WuKongIM's reading of the field).
    pub fn from_wire(v: u8) -> PullMode {
        if v == 1 {
            PullMode::Up
        } else {
            PullMode::Down
        }
    }
}

/// The answer to a read: messages in ascending seq order and whether the requested
/// range holds more retained messages beyond them (in the pull direction).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadResult<'a> {
    pub messages: Vec<MessageView<'a>>,
    pub more: bool,
}

/// What [`MessageLog::open`] found and repaired.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Segments retained after recovery.
    pub segments: u32,
    /// Valid records found and indexed (before any retirement at open).
    pub records: u64,
    /// Channels in the index after recovery (with retained messages).
    pub channels: usize,
    /// Bytes after the last valid record that were not zero and have been zeroed
    /// (a torn tail, or the rest of a segment after a corrupt record).
    pub truncated_bytes: u64,
    /// Segments after the end of the log that were deleted.
    pub dropped_segments: u32,
    /// Records whose seq did not follow their channel's previous one, plus snapshot
    /// entries that disagreed with the scan (both should be 0).
    pub seq_discontinuities: u64,
    /// Entries of the retired-seq table loaded from `channel_seqs.snap`.
    pub snapshot_channels: usize,
    /// Segments retired at open to satisfy `segments_max` / `indexed_messages_max`.
    pub retired_segments: u32,
    /// Entries of replicated groups found (before any retirement at open).
    pub entries: u64,
    /// Cut records found: each voided a group's entries from its index on.
    pub cuts: u64,
    /// Entries whose records ended before their last one (a torn append): dropped,
    /// and the log zeroed from their start.
    pub torn_entries: u32,
    /// The largest message id of the scanned records (0: none): the shard's id
    /// generator resumes after it ([`super::MessageIdGen::resume_after`]).
    pub max_message_id: i64,
}

/// Counters of a running log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogStats {
    pub segments: u32,
    /// Channels in the index (with retained messages).
    pub channels: usize,
    /// Entries of the retired-seq table.
    pub retired_channels: usize,
    /// Retired-seq entries folded into the floors since open (beyond
    /// `retired_channels_max`).
    pub folded_channels: u64,
    pub indexed_messages: usize,
    pub unsynced_bytes: u64,
    pub retired_segments: u64,
    pub retired_messages: u64,
    /// Rolls that had to create the next segment on the calling (shard) thread
    /// because no sync job had created it ahead.
    pub segments_created_inline: u64,
}

struct Segment {
    id: u32,
    path: Arc<Path>,
    map: MmapMut,
    /// Bytes of valid records (the write offset).
    end: u32,
    /// Pages below this offset were populated by [`MessageLog::prefault`].
    prefaulted_to: u32,
    /// Shared with in-flight [`SyncJob`]s (a retired segment's job still syncs it).
    file: Arc<File>,
}

impl Segment {
    /// A segment mapped from `file`, with nothing written or prefaulted yet.
    fn mapped(id: u32, path: PathBuf, file: File, map: MmapMut) -> Segment {
        Segment {
            id,
            path: path.into(),
            map,
            end: 0,
            prefaulted_to: 0,
            file: Arc::new(file),
        }
    }

    fn capacity(&self) -> u32 {
        self.map.len() as u32
    }
}

#[derive(Debug, Default)]
struct ChannelState {
    last_seq: u64,
    /// Seq of `positions[0]` (when `positions` is empty: `last_seq + 1`).
    first_seq: u64,
    positions: Vec<LogPosition>,
}

/// Channel table: one map per channel type, so lookups by `&str` need no allocation.
#[derive(Default)]
struct ChannelTable {
    by_type: Vec<(u8, HashMap<Box<str>, ChannelState>)>,
    channels: usize,
    indexed: usize,
}

impl ChannelTable {
    fn get(&self, channel_type: u8, channel_id: &str) -> Option<&ChannelState> {
        self.by_type
            .iter()
            .find(|(t, _)| *t == channel_type)
            .and_then(|(_, m)| m.get(channel_id))
    }

    fn get_or_insert(&mut self, channel_type: u8, channel_id: &str) -> &mut ChannelState {
        let idx = match self.by_type.iter().position(|(t, _)| *t == channel_type) {
            Some(i) => i,
            None => {
                self.by_type.push((channel_type, HashMap::new()));
                self.by_type.len() - 1
            }
        };
        let map = &mut self.by_type[idx].1;
        if !map.contains_key(channel_id) {
            self.channels += 1;
            map.insert(
                channel_id.into(),
                ChannelState {
                    last_seq: 0,
                    first_seq: 1,
                    positions: Vec::new(),
                },
            );
        }
        map.get_mut(channel_id).expect("inserted above")
    }

    fn get_mut(&mut self, channel_type: u8, channel_id: &str) -> Option<&mut ChannelState> {
        self.by_type
            .iter_mut()
            .find(|(t, _)| *t == channel_type)
            .and_then(|(_, m)| m.get_mut(channel_id))
    }

    /// Adds the message at `pos` with `seq` (its channel's next) to its channel.
    fn index(&mut self, channel_type: u8, channel_id: &str, seq: u64, pos: LogPosition) {
        let st = self.get_or_insert(channel_type, channel_id);
        if st.positions.is_empty() {
            st.first_seq = seq;
        }
        debug_assert!(st.positions.is_empty() || seq == st.last_seq + 1);
        st.positions.push(pos);
        st.last_seq = seq;
        self.indexed += 1;
    }

    /// Takes the message at `pos` with `seq`, its channel's newest, out of its
    /// channel (a cut): the channel's last seq goes back. Refuses (as corrupt) a
    /// message that is not its channel's newest.
    fn unindex(
        &mut self,
        channel_type: u8,
        channel_id: &str,
        seq: u64,
        pos: LogPosition,
    ) -> Result<(), LogError> {
        let st = self
            .get_mut(channel_type, channel_id)
            .filter(|st| st.positions.last() == Some(&pos) && st.last_seq == seq)
            .ok_or(LogError::Corrupt { position: pos })?;
        st.positions.pop();
        st.last_seq = seq - 1;
        if st.positions.is_empty() {
            st.first_seq = seq;
        }
        self.indexed -= 1;
        Ok(())
    }

    /// Whether the message at `pos` with `seq` is indexed (not voided by a cut,
    /// not retired).
    fn holds(&self, channel_type: u8, channel_id: &str, seq: u64, pos: LogPosition) -> bool {
        self.get(channel_type, channel_id).is_some_and(|st| {
            seq.checked_sub(st.first_seq)
                .and_then(|i| st.positions.get(i as usize))
                == Some(&pos)
        })
    }

    /// Indexes a message read at recovery, restarting its channel's positions at
    /// a seq that does not follow (counted); `false` for a record that is no
    /// message or whose ids are not UTF-8 (the log ends there).
    fn scanned(
        &mut self,
        fields: RecordFields<'_>,
        pos: LogPosition,
        report: &mut RecoveryReport,
    ) -> bool {
        let Some(view) = view_of(fields, pos) else {
            return false;
        };
        let st = self.get_or_insert(view.channel_type, view.channel_id);
        let mut dropped = 0;
        if st.positions.is_empty() {
            // The channel's oldest retained record (older ones may be retired).
            st.first_seq = view.message_seq;
        } else if view.message_seq != st.last_seq + 1 || view.message_seq == 0 {
            report.seq_discontinuities += 1;
            dropped = st.positions.len();
            st.positions.clear();
            st.first_seq = view.message_seq;
        }
        st.positions.push(pos);
        st.last_seq = view.message_seq;
        self.indexed = self.indexed - dropped + 1;
        report.max_message_id = report.max_message_id.max(view.message_id);
        true
    }

    fn iter(&self) -> impl Iterator<Item = (u8, &str, &ChannelState)> {
        self.by_type
            .iter()
            .flat_map(|(t, m)| m.iter().map(move |(k, v)| (*t, &**k, v)))
    }
}

/// The seqs a read returns before its byte bound (see [`MessageLog::read`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ReadSpan {
    from: u64,
    to: u64,
    /// Pulling towards older messages: read from `to` down.
    down: bool,
    /// The requested range holds retained messages beyond `from..=to`.
    more: bool,
}

impl ReadSpan {
    /// The span of a read of channel `st` (which retains at least one message),
    /// clipped to its retained seqs and to `limit` (at least 1) in the pull
    /// direction; `None` for an empty range.
    fn of(
        st: &ChannelState,
        start_seq: u64,
        end_seq: u64,
        limit: u64,
        mode: PullMode,
    ) -> Option<ReadSpan> {
        let (first, last) = (st.first_seq, st.last_seq);
        let down = mode == PullMode::Down || (start_seq == 0 && end_seq == 0);
        let (lo, hi) = if down {
            let hi = if start_seq == 0 {
                last
            } else {
                start_seq.min(last)
            };
            (first.max(end_seq.saturating_add(1)), hi)
        } else {
            let hi = if end_seq == 0 {
                last
            } else {
                (end_seq - 1).min(last)
            };
            (first.max(start_seq).max(1), hi)
        };
        if lo > hi {
            return None;
        }
        Some(if down {
            let from = lo.max(hi.saturating_sub(limit - 1));
            ReadSpan {
                from,
                to: hi,
                down,
                more: from > lo,
            }
        } else {
            let to = hi.min(lo.saturating_add(limit - 1));
            ReadSpan {
                from: lo,
                to,
                down,
                more: to < hi,
            }
        })
    }

    /// The seqs in read order: from the oldest (up) or from the newest (down).
    fn seqs(&self) -> Box<dyn Iterator<Item = u64>> {
        if self.down {
            Box::new((self.from..=self.to).rev())
        } else {
            Box::new(self.from..=self.to)
        }
    }
}

/// The append-only message log of one commit shard. Single-threaded by design
/// (owned by its shard); no internal locking.
pub struct MessageLog {
    dir: PathBuf,
    config: LogConfig,
    segments: VecDeque<Segment>,
    table: ChannelTable,
    /// The replicated groups' entries ([`groups`]).
    groups: GroupTable,
    retired: RetiredSeqs,
    /// Offset in the active segment of the first unsynced byte.
    dirty_from: Option<u32>,
    last_sync_ms: u64,
    /// [`SyncJob`]s handed out and not yet ended.
    jobs_in_flight: u32,
    poisoned: bool,
    retired_segments: u64,
    retired_messages: u64,
    /// Runs every sync instead of `fdatasync` (tests).
    sync_hook: Option<Arc<dyn SyncHook>>,
    /// The spare segment and retirement errors, shared with jobs' file work.
    files: Arc<FileShared>,
    /// Retired segments whose files the next job deletes.
    pending_retired: Vec<Segment>,
    /// The seq snapshot the next job writes before deleting them.
    pending_snapshot: Option<Vec<u8>>,
    segments_created_inline: u64,
    _lock: DirLock,
}

impl fmt::Debug for MessageLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MessageLog")
            .field("dir", &self.dir)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Drop for MessageLog {
    fn drop(&mut self) {
        // Retired segments no job deleted yet (best effort: a reopen retires them
        // again).
        if let Err(err) = self.retire_files_now() {
            tracing::warn!(%err, dir = %self.dir.display(), "deleting retired segments at close");
        }
    }
}

pub(super) fn segment_path(dir: &Path, id: u32) -> PathBuf {
    dir.join(format!("{id:020}{SEGMENT_SUFFIX}"))
}

fn parse_segment_name(name: &str) -> Option<u32> {
    let stem = name.strip_suffix(SEGMENT_SUFFIX)?;
    if stem.len() != 20 || !stem.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    stem.parse::<u64>().ok().and_then(|v| u32::try_from(v).ok())
}

fn map_segment(file: &File) -> io::Result<MmapMut> {
    // SAFETY: the mapping is of a segment file of this log's directory, which this
    // process holds the `flock`ed directory lock for; nothing else truncates or writes
    // it while mapped (an outside writer would break the log's contract anyway, and
    // every record read through the map is CRC-checked before it is used).
    unsafe { MmapMut::map_mut(file) }
}

pub(super) fn position(segment_id: u32, offset: u32) -> LogPosition {
    (u64::from(segment_id) << 32) | u64::from(offset)
}

/// The message a record holds; `None` for a record of another kind or with ids that
/// are not UTF-8.
fn view_of(fields: RecordFields<'_>, position: LogPosition) -> Option<MessageView<'_>> {
    if fields.kind != RecordKind::Message {
        return None;
    }
    Some(MessageView {
        message_id: fields.message_id,
        message_seq: fields.message_seq,
        channel_type: fields.channel_type,
        channel_id: std::str::from_utf8(fields.channel_id).ok()?,
        from_uid: std::str::from_utf8(fields.from_uid).ok()?,
        client_msg_no: std::str::from_utf8(fields.client_msg_no).ok()?,
        setting: fields.setting,
        msg_flags: fields.msg_flags as u8,
        timestamp_s: fields.timestamp_s,
        payload: fields.payload,
        position,
    })
}

/// Creates `dir` (private) if needed and takes its lock. Refuses a directory another
/// open log holds ([`LogError::Locked`]) and any IO failure.
fn create_and_lock(dir: &Path) -> Result<DirLock, LogError> {
    create_private_dir_all(dir).map_err(io_err("create log dir"))?;
    DirLock::acquire(dir).map_err(|e| {
        if e.kind() == io::ErrorKind::WouldBlock {
            LogError::Locked
        } else {
            LogError::Io {
                op: "lock log dir",
                source: e,
            }
        }
    })
}

/// The ids of the segment files in `dir`, ascending (other files are ignored).
/// Refuses a directory that cannot be listed.
pub(super) fn list_segment_ids(dir: &Path) -> Result<Vec<u32>, LogError> {
    let mut ids = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err("list log dir"))? {
        let entry = entry.map_err(io_err("list log dir"))?;
        if let Some(id) = entry.file_name().to_str().and_then(parse_segment_name) {
            ids.push(id);
        }
    }
    ids.sort_unstable();
    Ok(ids)
}

/// Opens and maps an existing segment file, its scan not done yet (`end` 0). A file
/// shorter than `segment_bytes` (a crash between create and preallocate, or an older
/// config) is preallocated to it; a longer one keeps its size. Refuses a file over
/// 4 GiB and any IO failure.
fn open_segment(path: PathBuf, id: u32, segment_bytes: u32) -> Result<Segment, LogError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(io_err("open segment"))?;
    let len = file.metadata().map_err(io_err("stat segment"))?.len();
    if len > u64::from(u32::MAX) {
        return Err(LogError::Config("segment file larger than 4 GiB"));
    }
    if len < u64::from(segment_bytes) {
        preallocate(&file, u64::from(segment_bytes)).map_err(io_err("preallocate segment"))?;
    }
    let map = map_segment(&file).map_err(io_err("map segment"))?;
    Ok(Segment::mapped(id, path, file, map))
}

/// Zeroes everything after the segment's last valid record (`seg.end`), so nothing
/// stale is ever read as a continuation, and syncs it. Returns how many bytes up to
/// the last non-zero one were zeroed. Refuses a failed sync.
fn zero_tail(seg: &mut Segment) -> Result<u64, LogError> {
    let tail = &mut seg.map[seg.end as usize..];
    let mut last_nonzero = 0usize;
    for (k, page) in tail.chunks_mut(PAGE_BYTES).enumerate() {
        if page.iter().any(|&b| b != 0) {
            last_nonzero = k * PAGE_BYTES + page.iter().rposition(|&b| b != 0).unwrap_or(0) + 1;
            page.fill(0);
        }
    }
    seg.map.flush().map_err(io_err("sync zeroed tail"))?;
    Ok(last_nonzero as u64)
}

impl MessageLog {
    /// Opens (creating if needed) the log in `dir`, recovering as described in the
    /// module docs. The directory is locked for the life of the value.
    ///
    /// Refuses an invalid config, a directory another log holds ([`LogError::Locked`]),
    /// a segment file over 4 GiB, a corrupt `channel_seqs.snap`, and any IO failure.
    pub fn open(dir: &Path, config: LogConfig) -> Result<(MessageLog, RecoveryReport), LogError> {
        config.validate()?;
        let lock = create_and_lock(dir)?;
        let ids = list_segment_ids(dir)?;
        let mut log = MessageLog::unrecovered(dir, config, lock);
        let mut report = RecoveryReport::default();
        log.recover_segments(&ids, &mut report)?;
        report.records = log.table.indexed as u64;
        report.entries = log.groups.entries as u64;
        log.load_seq_snapshot(&mut report)?;
        log.count_snapshot_conflicts(&mut report);
        log.retire_to_bounds(&mut report)?;
        report.segments = log.segments.len() as u32;
        report.channels = log.table.channels;
        if report.truncated_bytes > 0
            || report.dropped_segments > 0
            || report.seq_discontinuities > 0
        {
            tracing::warn!(dir = %dir.display(), ?report, "message log recovered with truncation");
        } else {
            tracing::info!(dir = %dir.display(), ?report, "message log opened");
        }
        Ok((log, report))
    }

    /// A log of no segment and an empty index over `dir` (whose `lock` it keeps), a
    /// fresh random key for its retired-seq table: the state recovery starts from.
    fn unrecovered(dir: &Path, config: LogConfig, lock: DirLock) -> MessageLog {
        let retired = RetiredSeqs::new(
            (rand::random(), rand::random()),
            config.retired_channels_max,
            config.seq_floor_buckets,
        );
        MessageLog {
            dir: dir.to_path_buf(),
            config,
            segments: VecDeque::new(),
            table: ChannelTable::default(),
            groups: GroupTable::default(),
            retired,
            dirty_from: None,
            last_sync_ms: 0,
            jobs_in_flight: 0,
            poisoned: false,
            retired_segments: 0,
            retired_messages: 0,
            sync_hook: None,
            files: Arc::new(FileShared {
                state: Mutex::new(FileState {
                    spare: SpareState::Idle,
                    retire_error: None,
                    work_in_flight: 0,
                }),
                changed: Condvar::new(),
            }),
            pending_retired: Vec::new(),
            pending_snapshot: None,
            segments_created_inline: 0,
            _lock: lock,
        }
    }

    /// Opens and scans the segments `ids` (ascending) into the index. The first one
    /// that ends unclean ends the log: its tail is zeroed and synced, and every later
    /// segment is deleted. Refuses on any IO failure or a segment over 4 GiB.
    fn recover_segments(
        &mut self,
        ids: &[u32],
        report: &mut RecoveryReport,
    ) -> Result<(), LogError> {
        let mut ended = false;
        let mut dir_changed = false;
        for (i, &id) in ids.iter().enumerate() {
            let path = segment_path(&self.dir, id);
            if ended {
                std::fs::remove_file(&path).map_err(io_err("delete segment after log end"))?;
                report.dropped_segments += 1;
                dir_changed = true;
                continue;
            }
            let mut seg = open_segment(path, id, self.config.segment_bytes)?;
            // Readable in full while it is scanned (a cut reads back the entries it
            // voids, some in this segment); its end is set by the scan.
            seg.end = seg.capacity();
            self.segments.push_back(seg);
            let (end, clean) = self.scan_last_segment(report);
            let seg = self.segments.back_mut().expect("pushed above");
            seg.end = end;
            if !clean {
                report.truncated_bytes += zero_tail(seg)?;
                ended = i + 1 < ids.len();
            }
        }
        if dir_changed {
            sync_dir(&self.dir).map_err(io_err("sync log dir"))?;
        }
        Ok(())
    }

    /// Loads the seqs of channels whose messages were all retired earlier from
    /// `channel_seqs.snap` (format 2, or format 1 of earlier versions); none when the
    /// file does not exist. Refuses a corrupt snapshot and a failed read.
    fn load_seq_snapshot(&mut self, report: &mut RecoveryReport) -> Result<(), LogError> {
        let bytes = match std::fs::read(self.dir.join(SEQ_SNAPSHOT_NAME)) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => {
                return Err(LogError::Io {
                    op: "read seq snapshot",
                    source: e,
                })
            }
        };
        let (max, buckets) = (
            self.config.retired_channels_max,
            self.config.seq_floor_buckets,
        );
        if let Some(t) = RetiredSeqs::decode(&bytes, max, buckets) {
            self.retired = t;
        } else {
            // Format 1 (listed ids), written by earlier versions.
            let entries = decode_seq_snapshot(&bytes).ok_or(LogError::SnapshotCorrupt)?;
            for (t, id, last) in entries {
                let h = self.retired.hash(t, id);
                self.retired.record(h, last);
            }
        }
        report.snapshot_channels = self.retired.exact.len();
        Ok(())
    }

    /// Counts in `seq_discontinuities` the indexed channels whose retired-seq entry is
    /// above their scanned last seq. Cannot happen with this log's own files (a
    /// channel's entry is written when its last retained record is retired, and only
    /// grows). Refuses nothing.
    fn count_snapshot_conflicts(&self, report: &mut RecoveryReport) {
        for (t, id, st) in self.table.iter() {
            let h = self.retired.hash(t, id);
            if self
                .retired
                .exact
                .get(&h)
                .is_some_and(|&last| last > st.last_seq)
            {
                report.seq_discontinuities += 1;
            }
        }
    }

    /// Gives an empty log its first segment, then retires the oldest segments until
    /// `segments_max`, `indexed_messages_max` and `channels_max` hold, and deletes
    /// their files now. Refuses on an IO failure (creating, syncing, deleting).
    fn retire_to_bounds(&mut self, report: &mut RecoveryReport) -> Result<(), LogError> {
        if self.segments.is_empty() {
            self.create_segment(0)?;
        }
        let before = self.retired_segments;
        while self.segments.len() > self.config.segments_max as usize
            || self.table.indexed > self.config.indexed_messages_max
            || self.table.channels > self.config.channels_max
        {
            self.retire_oldest()?;
        }
        report.retired_segments = (self.retired_segments - before) as u32;
        self.retire_files_now()
    }

    /// Scans the last segment's records into the index: messages of no group at
    /// once, an entry once its last record is read, a cut by voiding what it cuts.
    /// Returns the end of the last valid record of a whole entry and whether the
    /// segment ended cleanly there (all zero after it, no entry torn and no record
    /// out of its group's order).
    fn scan_last_segment(&mut self, report: &mut RecoveryReport) -> (u32, bool) {
        let i = self.segments.len() - 1;
        let id = self.segments[i].id;
        let mut off = 0usize;
        // The entry being read: its first record's offset and its records' offsets.
        let mut open: Option<(usize, Vec<usize>)> = None;
        loop {
            let seg = &self.segments[i];
            let Ok((fields, len)) = decode(&seg.map[off..]) else {
                break;
            };
            let pos = position(id, off as u32);
            if !fields.raft.is_replicated() {
                if open.is_some() || !self.table.scanned(fields, pos, report) {
                    break;
                }
            } else if fields.kind == RecordKind::Cut {
                if open.is_some() || !self.scanned_cut(fields.raft, report) {
                    break;
                }
            } else {
                let first = open.as_ref().map(|(at, _)| *at);
                if !self.scanned_part(first.unwrap_or(off), fields, &mut open) {
                    break;
                }
                let (_, offs) = open.as_mut().expect("opened");
                offs.push(off);
                if fields.parts_left == 0 {
                    let (at, offs) = open.take().expect("opened");
                    self.scanned_entry(i, at, &offs, report);
                }
            }
            off += len;
        }
        if let Some((at, _)) = open {
            report.torn_entries += 1;
            return (at as u32, false);
        }
        let clean = self.segments[i].map[off..].iter().all(|&b| b == 0);
        (off as u32, clean)
    }

    /// Voids what a cut read at recovery cuts: the group's entries at its index and
    /// after, read before it (none when the group's entries before it were all
    /// retired); `false` (the log ends here) when they do not read back.
    fn scanned_cut(&mut self, raft: RaftPos, report: &mut RecoveryReport) -> bool {
        report.cuts += 1;
        self.groups
            .void_from(&self.segments, &mut self.table, raft.group, raft.index)
            .is_ok()
    }

    /// Checks one record of a replicated entry against the entry being read (or,
    /// for a first record, its group's next index) and opens the entry at `at`;
    /// `false` (the log ends here) when it does not follow.
    fn scanned_part(
        &self,
        at: usize,
        fields: RecordFields<'_>,
        open: &mut Option<(usize, Vec<usize>)>,
    ) -> bool {
        if let Some((_, offs)) = open.as_ref() {
            let prev = &self.segments.back().expect("scanning").map[offs[offs.len() - 1]..];
            let Ok((p, _)) = decode(prev) else {
                return false;
            };
            return p.raft == fields.raft
                && p.kind == RecordKind::Message
                && view_of(fields, 0).is_some()
                && p.parts_left == fields.parts_left + 1;
        }
        if fields.kind == RecordKind::Message && view_of(fields, 0).is_none() {
            return false;
        }
        let follows = self
            .groups
            .next_index(fields.raft.group)
            .is_none_or(|next| next == fields.raft.index);
        if follows {
            *open = Some((at, Vec::new()));
        }
        follows
    }

    /// Indexes a whole entry read at recovery (its records at `offs` of segment
    /// `i`, the first at `at`).
    fn scanned_entry(&mut self, i: usize, at: usize, offs: &[usize], report: &mut RecoveryReport) {
        let id = self.segments[i].id;
        let mut raft = RaftPos::NONE;
        for &off in offs {
            let (fields, _) = decode(&self.segments[i].map[off..]).expect("read before");
            raft = fields.raft;
            if fields.kind == RecordKind::Message {
                self.table.scanned(fields, position(id, off as u32), report);
            }
        }
        self.groups
            .push(raft.group, raft.index, position(id, at as u32));
    }

    fn create_segment(&mut self, id: u32) -> Result<(), LogError> {
        let (path, file, map) = new_segment_file(&self.dir, id, self.config.segment_bytes)
            .map_err(io_err("create segment"))?;
        self.segments
            .push_back(Segment::mapped(id, path, file, map));
        Ok(())
    }

    /// The spare segment a job made, waiting for a job still making it (`None`:
    /// none was asked for, or making it failed).
    fn take_spare(&mut self) -> Option<Spare> {
        let mut st = self.files.lock();
        loop {
            match std::mem::replace(&mut st.spare, SpareState::Idle) {
                SpareState::Ready(spare) => return Some(spare),
                SpareState::Preparing => {
                    st.spare = SpareState::Preparing;
                    st = self
                        .files
                        .changed
                        .wait(st)
                        .unwrap_or_else(|e| e.into_inner());
                }
                SpareState::Failed(err) => {
                    tracing::warn!(%err, dir = %self.dir.display(), "creating the next segment ahead failed");
                    return None;
                }
                SpareState::Idle => return None,
            }
        }
    }

    /// The file work for the next job: the next segment if none is made or being
    /// made, and the retired segments to delete.
    fn take_file_work(&mut self) -> Option<FileWork> {
        let prepare = match self.active().id.checked_add(1) {
            // (exhausted: the roll reports it)
            None => None,
            Some(next) => {
                let mut st = self.files.lock();
                if matches!(st.spare, SpareState::Idle) {
                    st.spare = SpareState::Preparing;
                    Some((next, self.config.segment_bytes))
                } else {
                    None
                }
            }
        };
        if prepare.is_none() && self.pending_retired.is_empty() {
            return None;
        }
        self.files.lock().work_in_flight += 1;
        Some(FileWork {
            dir: self.dir.clone().into(),
            prepare,
            snapshot: self.pending_snapshot.take(),
            retired: std::mem::take(&mut self.pending_retired),
            shared: self.files.clone(),
        })
    }

    /// A retirement a job could not finish poisons the log (a disk error).
    fn check_file_errors(&mut self) -> Result<(), LogError> {
        if let Some(source) = self.files.lock().retire_error.take() {
            self.poisoned = true;
            return Err(LogError::Io {
                op: "retire segment",
                source,
            });
        }
        Ok(())
    }

    /// Deletes the retired segments here and now (open, a full sync, close), after
    /// the file work handed to jobs has run (it may write an older seq snapshot).
    fn retire_files_now(&mut self) -> Result<(), LogError> {
        {
            let mut st = self.files.lock();
            while st.work_in_flight > 0 {
                st = self
                    .files
                    .changed
                    .wait(st)
                    .unwrap_or_else(|e| e.into_inner());
            }
        }
        retire_files(
            &self.dir,
            self.pending_snapshot.take(),
            &mut self.pending_retired,
        )
        .map_err(io_err("retire segment"))
    }

    fn active(&self) -> &Segment {
        self.segments
            .back()
            .expect("a log always has an active segment")
    }

    /// Seals the active segment (syncs it in full) and starts the next one; retires
    /// the oldest segments beyond `segments_max`.
    fn roll(&mut self) -> Result<(), LogError> {
        self.seal_active()?;
        let next = self
            .active()
            .id
            .checked_add(1)
            .ok_or(LogError::SegmentIdsExhausted)?;
        match self.take_spare() {
            Some(spare) if spare.id == next => self.segments.push_back(Segment {
                id: spare.id,
                path: spare.path,
                map: spare.map,
                end: 0,
                prefaulted_to: 0,
                file: Arc::new(spare.file),
            }),
            other => {
                if let Some(stale) = other {
                    // Cannot happen (only rolls advance ids); never leave it around.
                    let _ = std::fs::remove_file(&stale.path);
                }
                if let Err(e) = self.create_segment(next) {
                    // No room for the next segment (ENOSPC, EIO): a disk error like
                    // a failed sync; the log takes nothing more until a restart.
                    self.poisoned = true;
                    return Err(e);
                }
                self.segments_created_inline += 1;
            }
        }
        while self.segments.len() > self.config.segments_max as usize {
            self.retire_oldest()?;
        }
        Ok(())
    }

    /// Deletes the oldest segment and drops its messages from the index, first
    /// persisting the last seqs of channels left with no retained message.
    fn retire_oldest(&mut self) -> Result<(), LogError> {
        if self.segments.len() == 1 {
            self.roll()?;
            if self.segments.len() == 1 {
                // segments_max == 1: the roll already retired the old segment.
                return Ok(());
            }
        }
        let oldest = self.segments.front().expect("checked above");
        let limit = position(oldest.id, 0) + (1u64 << 32);
        // Channels left with no retained message leave the index; their last seq
        // goes to the retired-seq table, persisted before the segment goes.
        for (t, id, st) in self.table.iter() {
            if st.positions.last().is_none_or(|&p| p < limit) {
                let h = self.retired.hash(t, id);
                self.retired.record(h, st.last_seq);
            }
        }
        // Written (durably) by the next job's file work before it deletes the
        // segment; a later retirement's snapshot supersedes this one (the table only
        // grows or folds, every merge a max).
        self.pending_snapshot = Some(self.retired.encode());
        let oldest = self.segments.pop_front().expect("checked above");
        self.pending_retired.push(oldest);
        let mut dropped = 0usize;
        let mut gone = 0usize;
        for (_, map) in &mut self.table.by_type {
            map.retain(|_, st| {
                let k = st.positions.partition_point(|&p| p < limit);
                if k == st.positions.len() {
                    dropped += k;
                    gone += 1;
                    return false;
                }
                if k > 0 {
                    st.positions.drain(..k);
                    st.first_seq += k as u64;
                    dropped += k;
                    if st.positions.capacity() > 2 * st.positions.len() + 8 {
                        st.positions.shrink_to_fit();
                    }
                }
                true
            });
        }
        self.table.channels -= gone;
        self.table.indexed -= dropped;
        self.groups.retire_below(limit);
        self.retired_segments += 1;
        self.retired_messages += dropped as u64;
        Ok(())
    }

    /// Syncs the active segment in full (its unsynced appends, and whatever a job
    /// still running on another thread covers). A failure poisons the log.
    fn seal_active(&mut self) -> Result<(), LogError> {
        if self.poisoned {
            return Err(LogError::Poisoned);
        }
        if self.dirty_from.is_none() && self.jobs_in_flight == 0 {
            return Ok(());
        }
        let seg = self.active();
        if let Err(source) = sync_file(self.sync_hook.as_ref(), &seg.file, &seg.path, seg.end) {
            self.poisoned = true;
            return Err(LogError::Io {
                op: "fdatasync",
                source,
            });
        }
        self.dirty_from = None;
        Ok(())
    }

    /// Every later sync runs `hook` instead of `fdatasync` (tests: hold, fail or
    /// record syncs). Jobs already handed out keep the previous one.
    pub fn set_sync_hook(&mut self, hook: Arc<dyn SyncHook>) {
        self.sync_hook = Some(hook);
    }

    /// Appends one message to its channel: `message_seq` = the channel's last seq + 1.
    /// Not durable until [`MessageLog::sync`]. Errors leave the log unchanged (except
    /// that a roll or retirement the append needed may have happened).
    pub fn append(&mut self, msg: &NewMessage<'_>) -> Result<AppendedMessage, LogError> {
        self.check_appendable(msg)?;
        let last_seq = self.last_seq_making_room(msg.channel_type, msg.channel_id)?;
        let fields = message_fields(msg, last_seq + 1);
        let len = fields.record_len().expect("lengths checked above") as u32;
        while self.table.indexed >= self.config.indexed_messages_max {
            self.retire_oldest()?;
        }
        if self.active().capacity() - self.active().end < len {
            self.roll()?;
        }
        let pos = self.write_record(&fields, len);
        // (A retirement above may have taken the channel out of the index.)
        self.table
            .index(msg.channel_type, msg.channel_id, last_seq + 1, pos);
        Ok(AppendedMessage {
            message_seq: last_seq + 1,
            position: pos,
        })
    }

    /// Whether `msg` may be appended at all. Refuses a poisoned log, an empty
    /// channel id, a string field over 65535 bytes and a payload over
    /// `payload_bytes_max`; changes nothing.
    fn check_appendable(&self, msg: &NewMessage<'_>) -> Result<(), LogError> {
        if self.poisoned {
            return Err(LogError::Poisoned);
        }
        if msg.channel_id.is_empty() {
            return Err(LogError::EmptyChannelId);
        }
        for (field, s) in [
            ("channel_id", msg.channel_id),
            ("from_uid", msg.from_uid),
            ("client_msg_no", msg.client_msg_no),
        ] {
            if s.len() > MAX_FIELD_BYTES {
                return Err(LogError::FieldTooLong {
                    field,
                    len: s.len(),
                });
            }
        }
        if msg.payload.len() > self.config.payload_bytes_max as usize {
            return Err(LogError::PayloadTooLarge {
                len: msg.payload.len(),
                payload_bytes_max: self.config.payload_bytes_max,
            });
        }
        Ok(())
    }

    /// The seq the channel's next message gets: its last + 1, from the index or, for
    /// a channel outside it, its retired-seq entry.
    fn next_seq(&self, channel_type: u8, channel_id: &str) -> u64 {
        let last = match self.table.get(channel_type, channel_id) {
            Some(st) => st.last_seq,
            None => self
                .retired
                .last_seq(self.retired.hash(channel_type, channel_id)),
        };
        last + 1
    }

    /// The channel's last seq. A channel outside the index continues from its
    /// retired-seq entry, and first gets room in the index: the oldest segments are
    /// retired until fewer than `channels_max` are indexed. Refuses what a retirement
    /// refuses (an IO failure of its roll).
    fn last_seq_making_room(
        &mut self,
        channel_type: u8,
        channel_id: &str,
    ) -> Result<u64, LogError> {
        if let Some(st) = self.table.get(channel_type, channel_id) {
            return Ok(st.last_seq);
        }
        while self.table.channels >= self.config.channels_max {
            self.retire_oldest()?;
        }
        let h = self.retired.hash(channel_type, channel_id);
        Ok(self.retired.last_seq(h))
    }

    /// Copies the record (`len` bytes, already known to fit) to the active segment's
    /// end and marks it unsynced; returns its position. Refuses nothing.
    fn write_record(&mut self, fields: &RecordFields<'_>, len: u32) -> LogPosition {
        let seg = self
            .segments
            .back_mut()
            .expect("a log always has an active segment");
        let off = seg.end;
        debug_assert!((off as usize).is_multiple_of(8) && off + len <= seg.capacity());
        let ok = fields.encode_into(&mut seg.map[off as usize..(off + len) as usize]);
        debug_assert!(ok);
        seg.end += len;
        let pos = position(seg.id, off);
        if self.dirty_from.is_none() {
            self.dirty_from = Some(off);
        }
        pos
    }

    /// Makes every append so far durable (`fdatasync` of the active segment); `now_ms` is
    /// remembered for [`MessageLog::sync_due`]. A failure poisons the log.
    ///
    /// Also covers the appends of a [`SyncJob`] still running elsewhere (both sync
    /// the same file), so a caller that needs everything durable now (a graceful
    /// stop) does not wait for the job.
    pub fn sync(&mut self, now_ms: u64) -> Result<(), LogError> {
        self.seal_active()?;
        self.check_file_errors()?;
        if let Err(e) = self.retire_files_now() {
            self.poisoned = true;
            return Err(e);
        }
        self.last_sync_ms = now_ms;
        Ok(())
    }

    /// Hands out the sync of every append so far as a job to run off the shard
    /// thread (`None`: nothing to sync). The appends are durable once the job ran
    /// and [`MessageLog::end_sync`] accepted its result. On Linux an `fdatasync` of
    /// the file writes back the pages dirtied through the shared mapping (the same
    /// `vfs_fsync_range` that `msync(MS_SYNC)` calls).
    pub fn begin_sync(&mut self) -> Result<Option<SyncJob>, LogError> {
        if self.poisoned {
            return Err(LogError::Poisoned);
        }
        self.check_file_errors()?;
        if self.dirty_from.take().is_none() {
            return Ok(None);
        }
        self.jobs_in_flight += 1;
        let work = self.take_file_work();
        let seg = self.active();
        Ok(Some(SyncJob {
            file: seg.file.clone(),
            path: seg.path.clone(),
            len: seg.end,
            hook: self.sync_hook.clone(),
            work,
        }))
    }

    /// The result of a [`SyncJob`] from [`MessageLog::begin_sync`]; a failure poisons
    /// the log (nothing after it is acknowledged as durable).
    pub fn end_sync(&mut self, result: std::io::Result<()>, now_ms: u64) -> Result<(), LogError> {
        debug_assert!(self.jobs_in_flight > 0, "end_sync without begin_sync");
        self.jobs_in_flight = self.jobs_in_flight.saturating_sub(1);
        match result {
            Ok(()) => {
                self.last_sync_ms = now_ms;
                Ok(())
            }
            Err(source) => {
                self.poisoned = true;
                Err(LogError::Io {
                    op: "fdatasync",
                    source,
                })
            }
        }
    }

    /// Whether the engine should call `sync` now: under `Always`, whenever appends are
    /// unsynced; under `IntervalMs(i)`, when appends are unsynced and `i` ms have
    /// passed since the last sync.
    pub fn sync_due(&self, now_ms: u64) -> bool {
        self.dirty_from.is_some()
            && match self.config.fsync {
                FsyncPolicy::Always => true,
                FsyncPolicy::IntervalMs(i) => now_ms >= self.last_sync_ms.saturating_add(i),
            }
    }

    /// The channel's last seq (0: no message yet); its next append gets this + 1.
    pub fn last_seq(&self, channel_type: u8, channel_id: &str) -> u64 {
        match self.table.get(channel_type, channel_id) {
            Some(s) => s.last_seq,
            None => self
                .retired
                .last_seq(self.retired.hash(channel_type, channel_id)),
        }
    }

    /// The channel's oldest retained seq, if any message is retained.
    pub fn first_retained_seq(&self, channel_type: u8, channel_id: &str) -> Option<u64> {
        self.table
            .get(channel_type, channel_id)
            .filter(|s| !s.positions.is_empty())
            .map(|s| s.first_seq)
    }

    /// The record at `pos`, fully validated. [`LogError::NoSuchPosition`] when `pos` is
    /// not in a retained segment (retired, or never written); a record start is not
    /// checked, so a position that did not come from this log may read as `Corrupt`.
    pub fn get(&self, pos: LogPosition) -> Result<MessageView<'_>, LogError> {
        let id = (pos >> 32) as u32;
        let off = (pos & 0xffff_ffff) as usize;
        let corrupt = || LogError::Corrupt { position: pos };
        let not_found = || LogError::NoSuchPosition { position: pos };
        let i = self
            .segments
            .binary_search_by_key(&id, |s| s.id)
            .map_err(|_| not_found())?;
        let seg = &self.segments[i];
        if off >= seg.end as usize {
            return Err(not_found());
        }
        let (fields, _) = decode(&seg.map[off..seg.end as usize]).map_err(|_| corrupt())?;
        view_of(fields, pos).ok_or_else(corrupt)
    }

    /// Reads a channel's retained messages with `/channel/messagesync` semantics.
    /// `limit` 0 or above `read_messages_max` means `read_messages_max`. With `F` the
    /// oldest retained and `L` the last seq of the channel:
    /// - `start_seq == 0 && end_seq == 0` (either mode): the newest `limit` messages.
    /// - [`PullMode::Down`]: seqs in `(end_seq, start_seq]` (`end_seq` exclusive, 0 =
    ///   no lower bound; `start_seq` inclusive, 0 = up to `L`), the newest `limit` of them.
    /// - [`PullMode::Up`]: seqs in `[start_seq, end_seq)` (`end_seq` 0 = up to `L`), the
    ///   oldest `limit` of them.
    ///
    /// Always clipped to `[F, L]`, returned ascending; `more` is true when the range
    /// holds retained messages beyond those returned, in the pull direction (exact,
    /// not WuKongIM's "returned == limit" guess). An empty range gives no messages.
    pub fn read(
        &self,
        channel_type: u8,
        channel_id: &str,
        start_seq: u64,
        end_seq: u64,
        limit: usize,
        mode: PullMode,
    ) -> Result<ReadResult<'_>, LogError> {
        self.read_within(
            channel_type,
            channel_id,
            start_seq,
            end_seq,
            limit,
            mode,
            usize::MAX,
        )
    }

    /// [`MessageLog::read`] bounded by bytes as well: stops before the message whose
    /// [`MessageView::copy_bytes`] would take the total past `bytes_max` (then `more`
    /// is set), keeping the messages nearest the start of the pull. At least one
    /// message is returned when any is in range, so paging always advances.
    #[allow(clippy::too_many_arguments)]
    pub fn read_within(
        &self,
        channel_type: u8,
        channel_id: &str,
        start_seq: u64,
        end_seq: u64,
        limit: usize,
        mode: PullMode,
        bytes_max: usize,
    ) -> Result<ReadResult<'_>, LogError> {
        let limit = if limit == 0 {
            self.config.read_messages_max
        } else {
            limit.min(self.config.read_messages_max)
        } as u64;
        let empty = ReadResult {
            messages: Vec::new(),
            more: false,
        };
        let Some(st) = self.table.get(channel_type, channel_id) else {
            return Ok(empty);
        };
        if st.positions.is_empty() {
            return Ok(empty);
        }
        debug_assert_eq!(st.positions.len() as u64, st.last_seq - st.first_seq + 1);
        let Some(span) = ReadSpan::of(st, start_seq, end_seq, limit, mode) else {
            return Ok(empty);
        };
        let mut messages = Vec::with_capacity((span.to - span.from + 1) as usize);
        let (mut bytes, mut cut) = (0usize, false);
        for seq in span.seqs() {
            let pos = st.positions[(seq - st.first_seq) as usize];
            let v = self.get(pos)?;
            if v.message_seq != seq || v.channel_type != channel_type || v.channel_id != channel_id
            {
                return Err(LogError::Corrupt { position: pos });
            }
            bytes = bytes.saturating_add(v.copy_bytes());
            if bytes > bytes_max && !messages.is_empty() {
                cut = true;
                break;
            }
            messages.push(v);
        }
        if span.down {
            messages.reverse();
        }
        Ok(ReadResult {
            messages,
            more: span.more || cut,
        })
    }

    /// Calls `f` with every retained message in log order (oldest first), not those
    /// a cut voided ([`groups`]). O(log size): for rebuilding derived state (e.g. the
    /// idempotency window) after open.
    pub fn scan(&self, mut f: impl FnMut(MessageView<'_>)) -> Result<(), LogError> {
        for seg in &self.segments {
            let mut off = 0usize;
            while off < seg.end as usize {
                let pos = position(seg.id, off as u32);
                let (fields, len) = decode(&seg.map[off..seg.end as usize])
                    .map_err(|_| LogError::Corrupt { position: pos })?;
                off += len;
                if fields.kind != RecordKind::Message {
                    continue;
                }
                let view = view_of(fields, pos).ok_or(LogError::Corrupt { position: pos })?;
                let live = !fields.raft.is_replicated()
                    || self
                        .table
                        .holds(view.channel_type, view.channel_id, view.message_seq, pos);
                if live {
                    f(view);
                }
            }
        }
        Ok(())
    }

    /// Populates (maps writable and zero-filled, `MADV_POPULATE_WRITE`) the active
    /// segment's pages up to `bytes_ahead` bytes past the write position, so the next
    /// appends take no page faults (a first store to a fresh page of a file mapping
    /// costs a fault and a 4 KiB zero fill). Call it off the latency path, e.g. after a
    /// batch's SENDACKs are written. Best effort: on a kernel without the advice (before
    /// Linux 5.14) nothing happens. Returns the bytes newly populated.
    pub fn prefault(&mut self, bytes_ahead: usize) -> usize {
        let seg = self
            .segments
            .back_mut()
            .expect("a log always has an active segment");
        let page = |n: usize| n / PAGE_BYTES * PAGE_BYTES;
        let from = page(seg.end as usize).max(seg.prefaulted_to as usize);
        let to = page((seg.end as usize).saturating_add(bytes_ahead) + PAGE_BYTES - 1)
            .min(seg.capacity() as usize);
        if to <= from {
            return 0;
        }
        match seg
            .map
            .advise_range(memmap2::Advice::PopulateWrite, from, to - from)
        {
            Ok(()) => {
                seg.prefaulted_to = to as u32;
                to - from
            }
            Err(_) => 0,
        }
    }

    pub fn stats(&self) -> LogStats {
        let unsynced = self
            .dirty_from
            .map_or(0, |f| u64::from(self.active().end - f));
        LogStats {
            segments: self.segments.len() as u32,
            channels: self.table.channels,
            retired_channels: self.retired.exact.len(),
            folded_channels: self.retired.folded,
            indexed_messages: self.table.indexed,
            unsynced_bytes: unsynced,
            retired_segments: self.retired_segments,
            retired_messages: self.retired_messages,
            segments_created_inline: self.segments_created_inline,
        }
    }

    pub fn config(&self) -> &LogConfig {
        &self.config
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the next record goes: the position just past the last one appended
    /// (the active segment's write offset). Only grows while the log is open; a
    /// reader of the files ([`super::tail::LogTail`]) may read every record below it.
    pub fn end_position(&self) -> LogPosition {
        let seg = self.active();
        position(seg.id, seg.end)
    }

    /// Ids of the retained segments, oldest first (for tests and operations).
    pub fn segment_ids(&self) -> Vec<u32> {
        self.segments.iter().map(|s| s.id).collect()
    }
}

/// Snapshot format 1 (read at open for logs of earlier versions): `magic u32 ‖ count
/// u64 ‖ count × (type u8 ‖ id_len u16 ‖ id ‖ last_seq u64) ‖ crc32`, little-endian;
/// the crc covers everything before it.
#[cfg(test)]
fn encode_seq_snapshot(entries: &[(u8, &str, u64)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + entries.iter().map(|e| 11 + e.1.len()).sum::<usize>());
    out.extend_from_slice(&SEQ_SNAPSHOT_MAGIC.to_le_bytes());
    out.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    for (t, id, last) in entries {
        out.push(*t);
        out.extend_from_slice(&(id.len() as u16).to_le_bytes());
        out.extend_from_slice(id.as_bytes());
        out.extend_from_slice(&last.to_le_bytes());
    }
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

fn decode_seq_snapshot(bytes: &[u8]) -> Option<Vec<(u8, &str, u64)>> {
    let (body, crc) = bytes.split_at(bytes.len().checked_sub(4)?);
    if crc32fast::hash(body) != u32::from_le_bytes(crc.try_into().ok()?) {
        return None;
    }
    let magic = u32::from_le_bytes(body.get(..4)?.try_into().ok()?);
    let count = u64::from_le_bytes(body.get(4..12)?.try_into().ok()?);
    if magic != SEQ_SNAPSHOT_MAGIC {
        return None;
    }
    let mut at = 12usize;
    let mut out = Vec::new();
    for _ in 0..count {
        let t = *body.get(at)?;
        let n = u16::from_le_bytes(body.get(at + 1..at + 3)?.try_into().ok()?) as usize;
        let id = std::str::from_utf8(body.get(at + 3..at + 3 + n)?).ok()?;
        let last = u64::from_le_bytes(body.get(at + 3 + n..at + 11 + n)?.try_into().ok()?);
        out.push((t, id, last));
        at += 11 + n;
    }
    (at == body.len()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seq_snapshot_round_trip_and_corruption() {
        let entries = vec![(1u8, "a@b", 7u64), (2, "g", u64::MAX)];
        let bytes = encode_seq_snapshot(&entries);
        assert_eq!(decode_seq_snapshot(&bytes).unwrap(), entries);
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x40;
            assert!(decode_seq_snapshot(&b).is_none(), "byte {i}");
        }
        assert!(decode_seq_snapshot(&bytes[..bytes.len() - 1]).is_none());
        assert!(decode_seq_snapshot(&[]).is_none());
    }

    #[test]
    fn retired_seqs_round_trip_fold_and_corruption() {
        let mut t = RetiredSeqs::new((1, 2), 2, 4);
        for (h, seq) in [(10u64, 5u64), (11, 7), (10, 3), (12, 9)] {
            t.record(h, seq);
        }
        // 10 (max 5) was the oldest: folded into bucket 10 % 4
        assert_eq!(t.exact.len(), 2);
        assert_eq!(t.last_seq(10), 5);
        assert_eq!(t.last_seq(14), 5, "same bucket: raised, never lowered");
        assert_eq!(t.last_seq(11), 7);
        assert_eq!(t.last_seq(13), 0);
        let bytes = t.encode();
        let back = RetiredSeqs::decode(&bytes, 2, 4).unwrap();
        assert_eq!(
            (back.key, back.exact.clone(), back.order.clone()),
            (t.key, t.exact.clone(), t.order.clone())
        );
        assert_eq!(back.floors, t.floors);
        let fewer = RetiredSeqs::decode(&bytes, 1, 3).unwrap();
        for h in [10, 11, 12, 13, 14] {
            assert!(fewer.last_seq(h) >= t.last_seq(h), "hash {h}");
        }
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x40;
            assert!(RetiredSeqs::decode(&b, 2, 4).is_none(), "byte {i}");
        }
        assert!(RetiredSeqs::decode(&[], 2, 4).is_none());
    }

    #[test]
    fn read_spans_clip_to_the_retained_seqs_and_the_limit() {
        // Seqs 5..=9 retained.
        let st = ChannelState {
            last_seq: 9,
            first_seq: 5,
            positions: vec![0; 5],
        };
        let span = |start, end, limit, mode| {
            ReadSpan::of(&st, start, end, limit, mode).map(|s| (s.from, s.to, s.more))
        };
        // 0/0: the newest `limit`, whatever the mode.
        assert_eq!(span(0, 0, 2, PullMode::Up), Some((8, 9, true)));
        assert_eq!(span(0, 0, 10, PullMode::Down), Some((5, 9, false)));
        // Down: (end, start], the newest of them.
        assert_eq!(span(8, 6, 10, PullMode::Down), Some((7, 8, false)));
        assert_eq!(span(100, 0, 2, PullMode::Down), Some((8, 9, true)));
        // Up: [start, end), the oldest of them.
        assert_eq!(span(6, 9, 10, PullMode::Up), Some((6, 8, false)));
        assert_eq!(span(1, 0, 2, PullMode::Up), Some((5, 6, true)));
        // Empty ranges.
        assert_eq!(span(10, 0, 5, PullMode::Up), None);
        assert_eq!(span(3, 0, 5, PullMode::Down), None);
        assert_eq!(span(6, 6, 5, PullMode::Up), None);
        let down: Vec<u64> = ReadSpan::of(&st, 0, 0, 3, PullMode::Down)
            .unwrap()
            .seqs()
            .collect();
        assert_eq!(down, [9, 8, 7], "down reads from the newest");
    }

    #[test]
    fn segment_names() {
        assert_eq!(parse_segment_name("00000000000000000007.seg"), Some(7));
        assert_eq!(parse_segment_name("7.seg"), None);
        assert_eq!(parse_segment_name("00000000000000000007.seg.tmp"), None);
        assert_eq!(parse_segment_name("99999999999999999999.seg"), None);
    }
}
