//! The log as the raft log of the shard's replicated groups.
//!
//! A group's entries are records of this same log (one write per record, never a
//! second copy): an entry of messages (the SENDs of one turn to one group) is one
//! record per message, back to back in one segment, each saying how many of the
//! entry's records follow it; any other entry (a new leader's no-op, a catalog
//! operation, a configuration change) is one record. A message of an entry gets its
//! channel's next seq like any append, so replicas that hold the same entries hold
//! the same seqs.
//!
//! # Contract
//! - [`MessageLog::append_entry`] takes a group's entries in index order: the next
//!   index, or an index the log already holds for the group, which **cuts** the log
//!   there. A cut writes a [`RecordKind::Cut`] record, then voids the group's
//!   entries from that index on: their messages leave the index, and their channels'
//!   seqs go back (a cut entry was never committed, so its seqs were never
//!   acknowledged). Raft never cuts a committed entry; the log does not know the
//!   commit index and trusts the caller (`replica::Group`) for that.
//! - An entry is written whole or, after a crash, not at all: recovery drops an entry
//!   whose records end before its last one (a torn entry at the end of the log) and
//!   zeroes the log from its start.
//! - Retention retires entries with their segment, oldest first, like messages. A
//!   cut below the oldest retained entry is refused ([`LogError::CutRetired`]): the
//!   replica is then behind the retained log and is caught up by a snapshot.
//! - Not durable until synced, exactly as messages ([`super`]'s contract).

use super::*;
use crate::store::record::{RaftPos, RecordKind};

/// What one entry holds.
#[derive(Clone, Copy, Debug)]
pub enum EntryBody<'a> {
    /// Messages, one record each (at least one; at most 65,536).
    Messages(&'a [NewMessage<'a>]),
    /// A new leader's empty entry.
    Noop,
    /// A catalog operation's bytes.
    Catalog(&'a [u8]),
    /// A configuration change's bytes.
    ConfChange(&'a [u8]),
    /// A configuration change of several steps, its bytes.
    ConfChangeV2(&'a [u8]),
}

/// One entry of a group's log.
#[derive(Clone, Copy, Debug)]
pub struct Entry<'a> {
    /// The group (a slot id, or the controller's).
    pub group: u32,
    /// The term of the leader that made it (at least 1).
    pub term: u64,
    /// Its index in the group's log (at least 1).
    pub index: u64,
    pub body: EntryBody<'a>,
}

impl Entry<'_> {
    fn raft(&self) -> RaftPos {
        RaftPos {
            group: self.group,
            term: self.term,
            index: self.index,
        }
    }
}

/// One group's retained entries.
#[derive(Debug, Default)]
pub(super) struct GroupIndex {
    /// The index of `positions[0]` (when `positions` is empty: the next index).
    pub(super) first_index: u64,
    /// The position of each retained entry's first record, by index.
    pub(super) positions: VecDeque<LogPosition>,
}

impl GroupIndex {
    /// The last index held (0: none yet).
    pub(super) fn last_index(&self) -> u64 {
        (self.first_index + self.positions.len() as u64).saturating_sub(1)
    }
}

/// The groups of one log, and how many entries they index in all.
#[derive(Debug, Default)]
pub(super) struct GroupTable {
    pub(super) groups: HashMap<u32, GroupIndex>,
    pub(super) entries: usize,
}

impl GroupTable {
    /// Drops the entries below `limit` (a retired segment's end) from every group.
    pub(super) fn retire_below(&mut self, limit: LogPosition) {
        for g in self.groups.values_mut() {
            let k = g.positions.partition_point(|&p| p < limit);
            g.positions.drain(..k);
            g.first_index += k as u64;
            self.entries -= k;
        }
    }

    /// The index the group's next entry must have; `None` for a group not held.
    pub(super) fn next_index(&self, group: u32) -> Option<u64> {
        self.groups
            .get(&group)
            .map(|g| g.first_index + g.positions.len() as u64)
    }

    /// Adds the entry at `index` (its first record at `pos`) to its group.
    pub(super) fn push(&mut self, group: u32, index: u64, pos: LogPosition) {
        let g = self.groups.entry(group).or_default();
        if g.positions.is_empty() {
            g.first_index = index;
        }
        debug_assert_eq!(index, g.first_index + g.positions.len() as u64);
        g.positions.push_back(pos);
        self.entries += 1;
    }

    /// Voids the group's entries at `index` and after, newest first: their messages
    /// leave their channels (whose last seqs go back). Refuses (as corrupt) a record
    /// that does not read back or a message that is not its channel's newest.
    pub(super) fn void_from(
        &mut self,
        segments: &VecDeque<Segment>,
        table: &mut ChannelTable,
        group: u32,
        index: u64,
    ) -> Result<(), LogError> {
        let Some(g) = self.groups.get_mut(&group) else {
            return Ok(());
        };
        let keep = (index.saturating_sub(g.first_index) as usize).min(g.positions.len());
        let voided: Vec<LogPosition> = g.positions.drain(keep..).collect();
        self.entries -= voided.len();
        for &first in voided.iter().rev() {
            let mut messages = Vec::new();
            walk_entry(segments, first, |f, pos| {
                if f.kind == RecordKind::Message {
                    messages.push((f, pos));
                }
            })?;
            for (f, pos) in messages.into_iter().rev() {
                let id = std::str::from_utf8(f.channel_id)
                    .map_err(|_| LogError::Corrupt { position: pos })?;
                table.unindex(f.channel_type, id, f.message_seq, pos)?;
            }
        }
        Ok(())
    }
}

/// Calls `f` with each record of the entry whose first record is at `first`.
pub(super) fn walk_entry<'s>(
    segments: &'s VecDeque<Segment>,
    first: LogPosition,
    mut f: impl FnMut(RecordFields<'s>, LogPosition),
) -> Result<(), LogError> {
    let mut pos = first;
    loop {
        let (fields, len) = record_at(segments, pos)?;
        let last = fields.parts_left == 0;
        f(fields, pos);
        if last {
            return Ok(());
        }
        pos += len as u64;
    }
}

/// The record at `pos` and its length, validated.
pub(super) fn record_at(
    segments: &VecDeque<Segment>,
    pos: LogPosition,
) -> Result<(RecordFields<'_>, usize), LogError> {
    let id = (pos >> 32) as u32;
    let off = (pos & 0xffff_ffff) as usize;
    let i = segments
        .binary_search_by_key(&id, |s| s.id)
        .map_err(|_| LogError::NoSuchPosition { position: pos })?;
    let seg = &segments[i];
    if off >= seg.end as usize {
        return Err(LogError::NoSuchPosition { position: pos });
    }
    decode(&seg.map[off..seg.end as usize]).map_err(|_| LogError::Corrupt { position: pos })
}

/// The retained entries of a group.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupSpan {
    /// The oldest retained index (the next index when none is retained).
    pub first_index: u64,
    /// The last index written (0: none).
    pub last_index: u64,
}

impl MessageLog {
    /// Appends one entry of `entry.group` (module docs: the next index, or a held
    /// index, which cuts the log there). Each message's assigned seq and position is
    /// pushed to `appended`, in order. Refuses, changing nothing but retirements the
    /// room needed: a poisoned log, an index or term of 0, a gap
    /// ([`LogError::EntryGap`]), a cut below the retained entries
    /// ([`LogError::CutRetired`]), an entry of no message or more than 65,536, a
    /// message [`MessageLog::append`] would refuse, an entry over `entry_bytes_max`,
    /// and a new group beyond `groups_max`.
    pub fn append_entry(
        &mut self,
        entry: &Entry<'_>,
        appended: &mut Vec<AppendedMessage>,
    ) -> Result<(), LogError> {
        let mut bytes = self.check_entry(entry)?;
        let cuts = self
            .groups
            .next_index(entry.group)
            .is_some_and(|next| entry.index < next);
        if cuts {
            bytes += MIN_RECORD_BYTES as u64;
        }
        self.make_room_for_entry(entry, bytes)?;
        if cuts {
            // The room made may have retired the entries to cut.
            self.check_cut(entry)?;
            let fields = RecordFields::entry(entry.raft(), RecordKind::Cut, b"");
            self.write_record(&fields, MIN_RECORD_BYTES as u32);
            self.groups
                .void_from(&self.segments, &mut self.table, entry.group, entry.index)?;
        }
        let first = match entry.body {
            EntryBody::Messages(msgs) => self.write_messages(entry.raft(), msgs, appended),
            other => {
                let (kind, data) = match other {
                    EntryBody::Noop => (RecordKind::Noop, &b""[..]),
                    EntryBody::Catalog(d) => (RecordKind::Catalog, d),
                    EntryBody::ConfChange(d) => (RecordKind::ConfChange, d),
                    EntryBody::ConfChangeV2(d) => (RecordKind::ConfChangeV2, d),
                    EntryBody::Messages(_) => unreachable!("matched above"),
                };
                let fields = RecordFields::entry(entry.raft(), kind, data);
                let len = fields.record_len().expect("checked") as u32;
                self.write_record(&fields, len)
            }
        };
        self.groups.push(entry.group, entry.index, first);
        Ok(())
    }

    /// The group's retained span; `None` for a group this log never held.
    pub fn group_span(&self, group: u32) -> Option<GroupSpan> {
        self.groups.groups.get(&group).map(|g| GroupSpan {
            first_index: g.first_index,
            last_index: g.last_index(),
        })
    }

    /// The records of the group's entry at `index`, in order (one, or one per
    /// message). [`LogError::NoSuchEntry`] outside the retained entries.
    pub fn entry_records(&self, group: u32, index: u64) -> Result<Vec<RecordFields<'_>>, LogError> {
        let mut out = Vec::new();
        walk_entry(
            &self.segments,
            self.entry_position(group, index)?,
            |f, _| out.push(f),
        )?;
        Ok(out)
    }

    /// Where the group's entry at `index` starts, if the log holds it: every
    /// record at or past it was written after the entries before `index`.
    pub fn entry_start(&self, group: u32, index: u64) -> Option<LogPosition> {
        self.entry_position(group, index).ok()
    }

    /// The term of the group's entry at `index`.
    pub fn entry_term(&self, group: u32, index: u64) -> Result<u64, LogError> {
        let (first, _) = record_at(&self.segments, self.entry_position(group, index)?)?;
        Ok(first.raft.term)
    }

    /// Where the group's entry at `index` starts.
    fn entry_position(&self, group: u32, index: u64) -> Result<LogPosition, LogError> {
        let no_such = || LogError::NoSuchEntry { group, index };
        let g = self.groups.groups.get(&group).ok_or_else(no_such)?;
        let i = index.checked_sub(g.first_index).ok_or_else(no_such)?;
        g.positions.get(i as usize).copied().ok_or_else(no_such)
    }

    /// Checks `entry` against the log and the limits; its bytes (every record).
    fn check_entry(&self, entry: &Entry<'_>) -> Result<u64, LogError> {
        if self.poisoned {
            return Err(LogError::Poisoned);
        }
        if entry.index == 0 || entry.term == 0 {
            return Err(LogError::EntryZero);
        }
        match self.groups.next_index(entry.group) {
            None if self.groups.groups.len() >= self.config.groups_max => {
                return Err(LogError::TooManyGroups {
                    groups_max: self.config.groups_max,
                })
            }
            Some(next) if entry.index > next => {
                return Err(LogError::EntryGap {
                    group: entry.group,
                    index: entry.index,
                    next_index: next,
                })
            }
            _ => self.check_cut(entry)?,
        }
        let bytes = match entry.body {
            EntryBody::Messages(msgs) => {
                if msgs.is_empty() || msgs.len() > usize::from(u16::MAX) + 1 {
                    return Err(LogError::EntryMessages { len: msgs.len() });
                }
                let mut bytes = 0u64;
                for m in msgs {
                    self.check_appendable(m)?;
                    bytes += message_fields(m, 0).record_len().expect("checked") as u64;
                }
                bytes
            }
            EntryBody::Noop => MIN_RECORD_BYTES as u64,
            EntryBody::Catalog(d) | EntryBody::ConfChange(d) | EntryBody::ConfChangeV2(d) => {
                align_up(RECORD_HEADER_BYTES + d.len()) as u64
            }
        };
        if bytes + MIN_RECORD_BYTES as u64 > u64::from(self.config.entry_bytes_bound()) {
            return Err(LogError::EntryTooLarge {
                bytes,
                entry_bytes_max: self.config.entry_bytes_bound(),
            });
        }
        Ok(bytes)
    }

    /// Refuses an entry below the group's retained entries (a cut there).
    fn check_cut(&self, entry: &Entry<'_>) -> Result<(), LogError> {
        match self.groups.groups.get(&entry.group) {
            Some(g) if entry.index < g.first_index => Err(LogError::CutRetired {
                group: entry.group,
                index: entry.index,
                first_index: g.first_index,
            }),
            _ => Ok(()),
        }
    }

    /// Retires until the entry's records and channels fit the index, then rolls if
    /// its `bytes` do not fit the active segment (an entry never spans two).
    fn make_room_for_entry(&mut self, entry: &Entry<'_>, bytes: u64) -> Result<(), LogError> {
        let records = match entry.body {
            EntryBody::Messages(msgs) => msgs.len(),
            _ => 1,
        };
        while self.table.indexed + records > self.config.indexed_messages_max
            || self.groups.entries >= self.config.indexed_messages_max
            || self.table.channels + self.new_channels(entry) > self.config.channels_max
        {
            self.retire_oldest()?;
        }
        if u64::from(self.active().capacity() - self.active().end) < bytes {
            self.roll()?;
        }
        Ok(())
    }

    /// The channels of `entry`'s messages that the index does not hold yet.
    fn new_channels(&self, entry: &Entry<'_>) -> usize {
        let EntryBody::Messages(msgs) = entry.body else {
            return 0;
        };
        let mut seen: Vec<(u8, &str)> = Vec::new();
        for m in msgs {
            let key = (m.channel_type, m.channel_id);
            if self.table.get(key.0, key.1).is_none() && !seen.contains(&key) {
                seen.push(key);
            }
        }
        seen.len()
    }

    /// Writes an entry's messages (room made), each indexed in its channel with the
    /// channel's next seq; the position of the first.
    fn write_messages(
        &mut self,
        raft: RaftPos,
        msgs: &[NewMessage<'_>],
        appended: &mut Vec<AppendedMessage>,
    ) -> LogPosition {
        let mut first = None;
        for (i, m) in msgs.iter().enumerate() {
            let seq = self.next_seq(m.channel_type, m.channel_id);
            let fields = RecordFields {
                raft,
                parts_left: (msgs.len() - 1 - i) as u16,
                ..message_fields(m, seq)
            };
            let len = fields.record_len().expect("checked") as u32;
            let pos = self.write_record(&fields, len);
            first.get_or_insert(pos);
            self.table.index(m.channel_type, m.channel_id, seq, pos);
            appended.push(AppendedMessage {
                message_seq: seq,
                position: pos,
            });
        }
        first.expect("at least one message")
    }
}

/// A not-yet-replicated record of `m` with `seq`.
pub(super) fn message_fields<'a>(m: &NewMessage<'a>, seq: u64) -> RecordFields<'a> {
    RecordFields {
        message_id: m.message_id,
        message_seq: seq,
        timestamp_s: m.timestamp_s,
        channel_type: m.channel_type,
        setting: m.setting,
        msg_flags: u16::from(m.msg_flags),
        channel_id: m.channel_id.as_bytes(),
        from_uid: m.from_uid.as_bytes(),
        client_msg_no: m.client_msg_no.as_bytes(),
        payload: m.payload,
        ..RecordFields::default()
    }
}
