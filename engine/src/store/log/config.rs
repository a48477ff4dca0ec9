//! The log's configuration (`[log]`: segment size, retention bounds, the fsync
//! policy) and its errors.

use super::*;

/// When the engine syncs the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FsyncPolicy {
    /// Sync before acknowledging every SENDACK batch: acknowledged means durable
    /// against power loss.
    Always,
    /// Sync when [`MessageLog::sync_due`] says so (at most this many ms after the
    /// previous sync): acknowledged means durable against a process crash only, until
    /// the next sync.
    IntervalMs(u64),
}

/// Limits and policy of one log. Every bound is named with its unit.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// Size of each segment file; a multiple of 4096, at most `u32::MAX`, and large
    /// enough for the largest record `payload_bytes_max` allows.
    pub segment_bytes: u32,
    /// Segments kept on disk; older ones are retired (deleted) on roll. At least 1.
    pub segments_max: u32,
    /// Channels with retained messages held in the in-memory index (~120 bytes each
    /// plus the channel id; ids are bounded by the retained log bytes). A new channel
    /// beyond it retires the oldest segment first.
    pub channels_max: usize,
    /// Channels whose messages were all retired, remembered exactly by last seq
    /// (~48 bytes each in memory, 16 in `channel_seqs.snap`, which every segment
    /// retirement rewrites in full); older ones fold into `seq_floor_buckets`.
    pub retired_channels_max: usize,
    /// High-water seqs (8 bytes each) of retired channels beyond
    /// `retired_channels_max`. At least 1.
    pub seq_floor_buckets: usize,
    /// Message positions held in the in-memory index (8 bytes each, up to 16 with
    /// growth slack), and as many entry positions of replicated groups. See [`LogConfig::memory_worst_case_bytes`] for the whole log.
    pub indexed_messages_max: usize,
    /// Largest payload an append accepts.
    pub payload_bytes_max: u32,
    /// Most messages one read returns (a `limit` of 0 or above it means this).
    pub read_messages_max: usize,
    /// When the engine syncs: every `interval_ms` (the default; a SENDACK does not
    /// wait for the disk, the node's syncer thread syncs in the background) or
    /// `"always"` (every SENDACK waits for the sync that covers its message).
    pub fsync: FsyncPolicy,
    /// Replicated groups whose entries this log holds (a shard's slot ids, and the
    /// controller's on shard 0); an entry of a new group beyond it is refused.
    pub groups_max: usize,
    /// The largest entry of a group (all of its records: the SENDs of one turn to
    /// one group). An entry never spans two segments, so the bound in force is the
    /// smaller of this and `segment_bytes` ([`LogConfig::entry_bytes_bound`]).
    pub entry_bytes_max: u32,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            segment_bytes: 64 << 20,
            segments_max: 16,
            channels_max: 1_000_000,
            retired_channels_max: 1_000_000,
            seq_floor_buckets: 65_536,
            indexed_messages_max: 16_000_000,
            payload_bytes_max: 1 << 20,
            read_messages_max: 10_000,
            fsync: FsyncPolicy::IntervalMs(1000),
            groups_max: 1024,
            entry_bytes_max: 8 << 20,
        }
    }
}

impl LogConfig {
    /// The largest record this config can produce.
    pub fn record_bytes_max(&self) -> u64 {
        align_up(RECORD_HEADER_BYTES + 3 * MAX_FIELD_BYTES) as u64
            + u64::from(self.payload_bytes_max)
    }

    /// The largest entry [`MessageLog::append_entry`] takes.
    pub fn entry_bytes_bound(&self) -> u32 {
        self.entry_bytes_max.min(self.segment_bytes)
    }

    pub fn validate(&self) -> Result<(), LogError> {
        let bad = |what| Err(LogError::Config(what));
        if !(self.segment_bytes as usize).is_multiple_of(PAGE_BYTES) || self.segment_bytes == 0 {
            return bad("segment_bytes must be a non-zero multiple of 4096");
        }
        if u64::from(self.segment_bytes) < self.record_bytes_max() {
            return bad("segment_bytes must hold the largest record (header + 3 x 65535 + payload_bytes_max)");
        }
        if self.segments_max == 0 {
            return bad("segments_max must be at least 1");
        }
        if self.channels_max == 0 || self.indexed_messages_max == 0 || self.read_messages_max == 0 {
            return bad(
                "channels_max, indexed_messages_max and read_messages_max must be at least 1",
            );
        }
        if self.seq_floor_buckets == 0 {
            return bad("seq_floor_buckets must be at least 1");
        }
        if self.groups_max == 0 || self.entry_bytes_max == 0 {
            return bad("groups_max and entry_bytes_max must be at least 1");
        }
        Ok(())
    }

    /// The most memory the log's in-memory state can take, in bytes: the index
    /// (positions, channel entries, channel ids; the ids are copies of ids in retained
    /// records, so they are bounded by the retained log bytes too), the retired-seq
    /// table and its floors. The segment mappings are page cache, not counted here.
    pub fn memory_worst_case_bytes(&self) -> u64 {
        let retained_log = u64::from(self.segment_bytes) * u64::from(self.segments_max);
        let ids = (self.channels_max as u64 * MAX_FIELD_BYTES as u64).min(retained_log);
        // positions: 8 bytes each, up to twice that in Vec capacity; as many
        // group entries (a replicated group's entry positions, likewise), and
        // their groups' map entries
        self.indexed_messages_max as u64 * 16 * 2
            + self.groups_max as u64 * GROUP_ENTRY_BYTES
            + self.channels_max as u64 * CHANNEL_ENTRY_BYTES
            + ids
            + self.retired_channels_max as u64 * RETIRED_ENTRY_BYTES
            + self.seq_floor_buckets as u64 * 8
    }
}

/// Memory of one group's index besides its entry positions: map slot, deque header.
const GROUP_ENTRY_BYTES: u64 = 64;

/// Errors of the message log.
#[derive(Debug)]
pub enum LogError {
    /// An invalid [`LogConfig`]: what is wrong.
    Config(&'static str),
    /// An IO operation failed: which one, and the OS error.
    Io { op: &'static str, source: io::Error },
    /// Another `MessageLog` (in this or another process) has the directory open.
    Locked,
    /// A previous `sync` failed; the log refuses further work until reopened.
    Poisoned,
    /// `channel_id` is empty.
    EmptyChannelId,
    /// A string field is longer than 65535 bytes.
    FieldTooLong { field: &'static str, len: usize },
    /// The payload exceeds `payload_bytes_max`.
    PayloadTooLarge { len: usize, payload_bytes_max: u32 },
    /// The segment id space (u32) is exhausted.
    SegmentIdsExhausted,
    /// A record read back failed validation (media corruption after recovery).
    Corrupt { position: LogPosition },
    /// [`MessageLog::get`] of a position outside the retained records.
    NoSuchPosition { position: LogPosition },
    /// `channel_seqs.snap` failed its checksum or is malformed.
    SnapshotCorrupt,
    /// An entry of index or term 0 (both start at 1).
    EntryZero,
    /// An entry past its group's next index.
    EntryGap {
        group: u32,
        index: u64,
        next_index: u64,
    },
    /// A cut below the group's oldest retained entry (the replica is behind the
    /// retained log: a snapshot catches it up).
    CutRetired {
        group: u32,
        index: u64,
        first_index: u64,
    },
    /// An entry of messages holds none, or more than 65,536.
    EntryMessages { len: usize },
    /// An entry's records exceed `entry_bytes_max`.
    EntryTooLarge { bytes: u64, entry_bytes_max: u32 },
    /// An entry of a new group beyond `groups_max`.
    TooManyGroups { groups_max: usize },
    /// No retained entry of the group at that index.
    NoSuchEntry { group: u32, index: u64 },
}

impl fmt::Display for LogError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LogError::Config(what) => write!(f, "invalid log config: {what}"),
            LogError::Io { op, source } => write!(f, "log io error during {op}: {source}"),
            LogError::Locked => write!(f, "log directory is locked by another open log"),
            LogError::Poisoned => write!(
                f,
                "log is poisoned by an earlier sync failure; restart to recover"
            ),
            LogError::EmptyChannelId => write!(f, "channel_id is empty"),
            LogError::FieldTooLong { field, len } => {
                write!(f, "{field} is {len} bytes, more than 65535")
            }
            LogError::PayloadTooLarge {
                len,
                payload_bytes_max,
            } => {
                write!(
                    f,
                    "payload is {len} bytes, more than payload_bytes_max {payload_bytes_max}"
                )
            }
            LogError::SegmentIdsExhausted => write!(f, "segment ids exhausted"),
            LogError::Corrupt { position } => {
                write!(f, "corrupt record at log position {position:#x}")
            }
            LogError::NoSuchPosition { position } => {
                write!(f, "no retained record at log position {position:#x}")
            }
            LogError::SnapshotCorrupt => write!(f, "{SEQ_SNAPSHOT_NAME} is corrupt"),
            LogError::EntryZero => write!(f, "an entry's index and term start at 1"),
            LogError::EntryGap {
                group,
                index,
                next_index,
            } => write!(
                f,
                "entry {index} of group {group} leaves a gap: the next index is {next_index}"
            ),
            LogError::CutRetired {
                group,
                index,
                first_index,
            } => write!(
                f,
                "entry {index} of group {group} would cut below its oldest retained entry {first_index}"
            ),
            LogError::EntryMessages { len } => {
                write!(f, "an entry holds 1 to 65,536 messages, not {len}")
            }
            LogError::EntryTooLarge {
                bytes,
                entry_bytes_max,
            } => write!(
                f,
                "entry is {bytes} bytes, more than entry_bytes_max {entry_bytes_max}"
            ),
            LogError::TooManyGroups { groups_max } => {
                write!(f, "a new group beyond groups_max {groups_max}")
            }
            LogError::NoSuchEntry { group, index } => {
                write!(f, "no retained entry {index} of group {group}")
            }
        }
    }
}

impl std::error::Error for LogError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LogError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}
