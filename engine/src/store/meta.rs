//! The metadata store: user tokens `(uid, device_flag) → (token, device_level)` and
//! group subscribers `channel_id → set of uids`, kept in memory and persisted in
//! their own directory (not the log's: each directory holds one `LOCK`).
//!
//! # Persistence
//! - `meta.journal`: a 16-byte header (magic, version, generation) then records
//!   `len u32 ‖ crc32(body) u32 ‖ body`, body = one op (SetToken, AddSubscribers,
//!   RemoveSubscribers, ResetSubscribers). Every mutating call appends its op with
//!   `pwrite` and `fdatasync`s it **before** changing memory and returning `Ok`: an `Ok`
//!   survives power loss. Metadata ops are rare (HTTP API), so one sync per op is fine.
//!   Calls that change nothing write nothing.
//! - `meta.snap`: the whole state as SetToken / ResetSubscribers records, with the
//!   journal generation it covers and a whole-file CRC; written atomically (tmp, fsync,
//!   rename, fsync dir). When the journal passes `journal_bytes_max` the store writes a
//!   snapshot covering generation `g`, then atomically replaces the journal by an empty
//!   one of generation `g + 1`. On open, a journal whose generation the snapshot covers
//!   is stale (a crash between the two steps) and is not replayed.
//! - Open replays the journal until the first invalid record (short, bad length, bad
//!   CRC, bad contents) and truncates the file there (a torn tail of an op that never
//!   returned `Ok`). A corrupt snapshot or journal header is an error, not a guess.
//! - A failed journal write is rolled back (`set_len`); if that fails too, or an fsync
//!   fails, the store is poisoned and refuses further writes until reopened.
//!
//! # Limits
//! `tokens_max` (uid, flag) pairs, `groups_max`, `subscribers_per_group_max`,
//! `field_bytes_max` per uid / channel id / token. A call that would pass a limit is
//! refused whole, with nothing written. Replay does not re-check limits (the ops were
//! accepted when written).
//!
//! Subscriber lists are kept sorted by uid (bytewise), deduplicated; a group whose
//! list becomes empty is removed.

use std::collections::HashMap;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::fsutil::{create_private_dir_all, write_atomic, DirLock};
use crate::route::{DeviceLevel, Uid};

const JOURNAL_NAME: &str = "meta.journal";
const SNAPSHOT_NAME: &str = "meta.snap";
const JOURNAL_MAGIC: u32 = u32::from_le_bytes(*b"IMMJ");
const SNAPSHOT_MAGIC: u32 = u32::from_le_bytes(*b"IMMS");
const FORMAT_VERSION: u16 = 1;
const FILE_HEADER_BYTES: usize = 16;
const RECORD_FRAME_BYTES: usize = 8;

const OP_SET_TOKEN: u8 = 1;
const OP_ADD_SUBSCRIBERS: u8 = 2;
const OP_REMOVE_SUBSCRIBERS: u8 = 3;
const OP_RESET_SUBSCRIBERS: u8 = 4;

/// Limits of the metadata store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetaConfig {
    pub tokens_max: usize,
    pub groups_max: usize,
    pub subscribers_per_group_max: usize,
    /// Longest uid, channel id or token, in bytes (at most 65535).
    pub field_bytes_max: usize,
    /// Journal size that triggers compaction into a snapshot.
    pub journal_bytes_max: u64,
}

impl Default for MetaConfig {
    fn default() -> Self {
        MetaConfig {
            tokens_max: 1_000_000,
            groups_max: 100_000,
            subscribers_per_group_max: 10_000,
            field_bytes_max: 1024,
            journal_bytes_max: 64 << 20,
        }
    }
}

/// Errors of the metadata store.
#[derive(Debug)]
pub enum MetaError {
    Config(&'static str),
    Io {
        op: &'static str,
        source: io::Error,
    },
    Locked,
    Poisoned,
    EmptyField {
        field: &'static str,
    },
    FieldTooLong {
        field: &'static str,
        len: usize,
        field_bytes_max: usize,
    },
    TooManyTokens {
        tokens_max: usize,
    },
    TooManyGroups {
        groups_max: usize,
    },
    TooManySubscribers {
        subscribers_per_group_max: usize,
    },
    SnapshotCorrupt,
    JournalCorrupt,
}

impl fmt::Display for MetaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetaError::Config(w) => write!(f, "invalid meta config: {w}"),
            MetaError::Io { op, source } => write!(f, "meta store io error during {op}: {source}"),
            MetaError::Locked => write!(f, "meta directory is locked by another open store"),
            MetaError::Poisoned => write!(f, "meta store is poisoned by an earlier write failure"),
            MetaError::EmptyField { field } => write!(f, "{field} is empty"),
            MetaError::FieldTooLong {
                field,
                len,
                field_bytes_max,
            } => {
                write!(
                    f,
                    "{field} is {len} bytes, more than field_bytes_max {field_bytes_max}"
                )
            }
            MetaError::TooManyTokens { tokens_max } => write!(f, "tokens_max {tokens_max} reached"),
            MetaError::TooManyGroups { groups_max } => write!(f, "groups_max {groups_max} reached"),
            MetaError::TooManySubscribers {
                subscribers_per_group_max,
            } => {
                write!(
                    f,
                    "group would pass subscribers_per_group_max {subscribers_per_group_max}"
                )
            }
            MetaError::SnapshotCorrupt => write!(f, "{SNAPSHOT_NAME} is corrupt"),
            MetaError::JournalCorrupt => write!(f, "{JOURNAL_NAME} header is corrupt"),
        }
    }
}

impl std::error::Error for MetaError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            MetaError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

fn io_err(op: &'static str) -> impl FnOnce(io::Error) -> MetaError {
    move |source| MetaError::Io { op, source }
}

/// What [`MetaStore::open`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetaRecovery {
    /// Ops read from the snapshot.
    pub snapshot_ops: u64,
    /// Ops replayed from the journal.
    pub replayed_ops: u64,
    /// Bytes cut from the journal's torn tail.
    pub truncated_bytes: u64,
    /// Generation of the journal now in use.
    pub generation: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Op<'a> {
    SetToken {
        uid: &'a str,
        device_flag: u8,
        level: DeviceLevel,
        token: &'a str,
    },
    Subscribers {
        op: u8,
        channel_id: &'a str,
        uids: Vec<&'a str>,
    },
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u16).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn encode_op(out: &mut Vec<u8>, op: &Op<'_>) {
    let start = out.len();
    out.extend_from_slice(&[0; RECORD_FRAME_BYTES]);
    match op {
        Op::SetToken {
            uid,
            device_flag,
            level,
            token,
        } => {
            out.push(OP_SET_TOKEN);
            put_str(out, uid);
            out.push(*device_flag);
            out.push(*level as u8);
            put_str(out, token);
        }
        Op::Subscribers {
            op,
            channel_id,
            uids,
        } => {
            out.push(*op);
            put_str(out, channel_id);
            out.extend_from_slice(&(uids.len() as u32).to_le_bytes());
            for u in uids {
                put_str(out, u);
            }
        }
    }
    let body_len = (out.len() - start - RECORD_FRAME_BYTES) as u32;
    let crc = crc32fast::hash(&out[start + RECORD_FRAME_BYTES..]);
    out[start..start + 4].copy_from_slice(&body_len.to_le_bytes());
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.b.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(s)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|s| s[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|s| u32::from_le_bytes(s.try_into().expect("4 bytes")))
    }
    fn str(&mut self) -> Option<&'a str> {
        let n = u16::from_le_bytes(self.take(2)?.try_into().ok()?) as usize;
        std::str::from_utf8(self.take(n)?).ok()
    }
}

fn decode_body(body: &[u8]) -> Option<Op<'_>> {
    let mut r = Reader { b: body, at: 0 };
    let op = match r.u8()? {
        OP_SET_TOKEN => {
            let uid = r.str()?;
            let device_flag = r.u8()?;
            let level = match r.u8()? {
                0 => DeviceLevel::Slave,
                1 => DeviceLevel::Master,
                _ => return None,
            };
            Op::SetToken {
                uid,
                device_flag,
                level,
                token: r.str()?,
            }
        }
        op @ (OP_ADD_SUBSCRIBERS | OP_REMOVE_SUBSCRIBERS | OP_RESET_SUBSCRIBERS) => {
            let channel_id = r.str()?;
            let n = r.u32()? as usize;
            // each uid takes at least 2 bytes: bound the allocation by the input
            if n > body.len() / 2 {
                return None;
            }
            let mut uids = Vec::with_capacity(n);
            for _ in 0..n {
                uids.push(r.str()?);
            }
            Op::Subscribers {
                op,
                channel_id,
                uids,
            }
        }
        _ => return None,
    };
    (r.at == body.len()).then_some(op)
}

/// Decodes framed records from `bytes` until the first invalid one; returns the ops
/// and the length of the valid prefix.
fn decode_records(bytes: &[u8]) -> (Vec<Op<'_>>, usize) {
    let mut ops = Vec::new();
    let mut at = 0usize;
    while let Some(frame) = bytes.get(at..at + RECORD_FRAME_BYTES) {
        let len = u32::from_le_bytes(frame[..4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(frame[4..].try_into().expect("4 bytes"));
        let Some(body) = bytes.get(at + RECORD_FRAME_BYTES..at + RECORD_FRAME_BYTES + len) else {
            break;
        };
        if crc32fast::hash(body) != crc {
            break;
        }
        let Some(op) = decode_body(body) else { break };
        ops.push(op);
        at += RECORD_FRAME_BYTES + len;
    }
    (ops, at)
}

fn file_header(magic: u32, generation: u64) -> [u8; FILE_HEADER_BYTES] {
    let mut h = [0u8; FILE_HEADER_BYTES];
    h[..4].copy_from_slice(&magic.to_le_bytes());
    h[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h[8..].copy_from_slice(&generation.to_le_bytes());
    h
}

fn parse_header(bytes: &[u8], magic: u32) -> Option<u64> {
    let h = bytes.get(..FILE_HEADER_BYTES)?;
    (u32::from_le_bytes(h[..4].try_into().ok()?) == magic
        && u16::from_le_bytes(h[4..6].try_into().ok()?) == FORMAT_VERSION)
        .then(|| u64::from_le_bytes(h[8..].try_into().expect("8 bytes")))
}

#[derive(Debug)]
struct TokenEntry {
    device_flag: u8,
    level: DeviceLevel,
    token: Box<str>,
}

/// Refuses a `field_bytes_max` outside 1..=65535 and a `subscribers_per_group_max`
/// beyond `u32` (the journal's length fields).
fn check_config(config: &MetaConfig) -> Result<(), MetaError> {
    if config.field_bytes_max == 0 || config.field_bytes_max > u16::MAX as usize {
        return Err(MetaError::Config("field_bytes_max must be in 1..=65535"));
    }
    if config.subscribers_per_group_max > u32::MAX as usize {
        return Err(MetaError::Config(
            "subscribers_per_group_max must fit in u32",
        ));
    }
    Ok(())
}

/// Creates `dir` (private) if needed and takes its lock. Refuses a directory another
/// open store holds ([`MetaError::Locked`]) and any IO failure.
fn create_and_lock(dir: &Path) -> Result<DirLock, MetaError> {
    create_private_dir_all(dir).map_err(io_err("create meta dir"))?;
    DirLock::acquire(dir).map_err(|e| {
        if e.kind() == io::ErrorKind::WouldBlock {
            MetaError::Locked
        } else {
            MetaError::Io {
                op: "lock meta dir",
                source: e,
            }
        }
    })
}

/// Applies `meta.snap` to `state` and returns the journal generation it covers (0:
/// no snapshot). Refuses a snapshot that fails its CRC, header or record checks, and
/// a failed read.
fn load_snapshot(
    dir: &Path,
    state: &mut State,
    report: &mut MetaRecovery,
) -> Result<u64, MetaError> {
    let bytes = match std::fs::read(dir.join(SNAPSHOT_NAME)) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => {
            return Err(MetaError::Io {
                op: "read meta snapshot",
                source: e,
            })
        }
    };
    let body_end = bytes
        .len()
        .checked_sub(4)
        .ok_or(MetaError::SnapshotCorrupt)?;
    let crc = u32::from_le_bytes(bytes[body_end..].try_into().expect("4 bytes"));
    if crc32fast::hash(&bytes[..body_end]) != crc {
        return Err(MetaError::SnapshotCorrupt);
    }
    let covered = parse_header(&bytes, SNAPSHOT_MAGIC).ok_or(MetaError::SnapshotCorrupt)?;
    let recs = &bytes[FILE_HEADER_BYTES..body_end];
    let (ops, valid) = decode_records(recs);
    if valid != recs.len() {
        return Err(MetaError::SnapshotCorrupt);
    }
    report.snapshot_ops = ops.len() as u64;
    for op in &ops {
        state.apply(op);
    }
    Ok(covered)
}

/// Replays `meta.journal` into `state` up to its first invalid record, unless it is
/// missing or of a generation the snapshot covers (`covered`: stale). Returns the
/// journal's generation and valid length when it was replayed. Refuses a corrupt
/// header and a failed read.
fn replay_journal(
    dir: &Path,
    covered: u64,
    state: &mut State,
    report: &mut MetaRecovery,
) -> Result<Option<(u64, u64)>, MetaError> {
    let bytes = match std::fs::read(dir.join(JOURNAL_NAME)) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(MetaError::Io {
                op: "read meta journal",
                source: e,
            })
        }
    };
    let g = parse_header(&bytes, JOURNAL_MAGIC).ok_or(MetaError::JournalCorrupt)?;
    if g <= covered {
        return Ok(None);
    }
    let recs = &bytes[FILE_HEADER_BYTES..];
    let (ops, valid) = decode_records(recs);
    report.replayed_ops = ops.len() as u64;
    report.truncated_bytes = (recs.len() - valid) as u64;
    for op in &ops {
        state.apply(op);
    }
    Ok(Some((g, (FILE_HEADER_BYTES + valid) as u64)))
}

/// Opens the journal for appending: the one `replayed` (generation, valid length),
/// its torn tail cut and synced, or else a new empty one of generation `covered + 1`
/// written atomically. Returns it with its length and generation. Refuses any IO
/// failure.
fn open_journal(
    dir: &Path,
    covered: u64,
    replayed: Option<(u64, u64)>,
    report: &MetaRecovery,
) -> Result<(File, u64, u64), MetaError> {
    let (generation, journal_len) = match replayed {
        Some(r) => r,
        None => {
            let generation = covered + 1;
            write_atomic(dir, JOURNAL_NAME, &file_header(JOURNAL_MAGIC, generation))
                .map_err(io_err("create meta journal"))?;
            (generation, FILE_HEADER_BYTES as u64)
        }
    };
    let journal = OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join(JOURNAL_NAME))
        .map_err(io_err("open meta journal"))?;
    if report.truncated_bytes > 0 {
        journal
            .set_len(journal_len)
            .map_err(io_err("truncate meta journal"))?;
        journal.sync_all().map_err(io_err("sync meta journal"))?;
    }
    Ok((journal, journal_len, generation))
}

/// See the module docs. Owned by one thread (the HTTP/API side); not internally locked.
pub struct MetaStore {
    dir: PathBuf,
    config: MetaConfig,
    journal: File,
    journal_len: u64,
    generation: u64,
    tokens: HashMap<Box<str>, Vec<TokenEntry>>,
    token_count: usize,
    groups: HashMap<Box<str>, Vec<Uid>>,
    poisoned: bool,
    compactions: u64,
    _lock: DirLock,
}

impl fmt::Debug for MetaStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MetaStore")
            .field("dir", &self.dir)
            .field("tokens", &self.token_count)
            .field("groups", &self.groups.len())
            .field("journal_len", &self.journal_len)
            .finish()
    }
}

impl MetaStore {
    /// Opens (creating if needed) the store in `dir`, recovering as in the module docs.
    ///
    /// Refuses an invalid config, a directory another store holds
    /// ([`MetaError::Locked`]), a corrupt snapshot or journal header, and any IO
    /// failure.
    pub fn open(dir: &Path, config: MetaConfig) -> Result<(MetaStore, MetaRecovery), MetaError> {
        check_config(&config)?;
        let lock = create_and_lock(dir)?;
        let mut report = MetaRecovery::default();
        let mut state = State::default();
        let covered = load_snapshot(dir, &mut state, &mut report)?;
        let replayed = replay_journal(dir, covered, &mut state, &mut report)?;
        let (journal, journal_len, generation) = open_journal(dir, covered, replayed, &report)?;
        report.generation = generation;
        if report.truncated_bytes > 0 {
            tracing::warn!(dir = %dir.display(), ?report, "meta journal had a torn tail");
        }
        let store = MetaStore {
            dir: dir.to_path_buf(),
            config,
            journal,
            journal_len,
            generation,
            tokens: state.tokens,
            token_count: state.token_count,
            groups: state.groups,
            poisoned: false,
            compactions: 0,
            _lock: lock,
        };
        Ok((store, report))
    }

    fn check_field(&self, field: &'static str, s: &str) -> Result<(), MetaError> {
        if s.is_empty() {
            return Err(MetaError::EmptyField { field });
        }
        if s.len() > self.config.field_bytes_max {
            return Err(MetaError::FieldTooLong {
                field,
                len: s.len(),
                field_bytes_max: self.config.field_bytes_max,
            });
        }
        Ok(())
    }

    /// Appends one op durably; memory is changed by the caller only after `Ok`.
    fn write_op(&mut self, op: &Op<'_>) -> Result<(), MetaError> {
        if self.poisoned {
            return Err(MetaError::Poisoned);
        }
        let mut rec = Vec::new();
        encode_op(&mut rec, op);
        if let Err(e) = self.journal.write_all_at(&rec, self.journal_len) {
            // cut the partial record so later records do not land behind garbage
            if self.journal.set_len(self.journal_len).is_err() {
                self.poisoned = true;
            }
            return Err(MetaError::Io {
                op: "write meta journal",
                source: e,
            });
        }
        if let Err(e) = self.journal.sync_data() {
            // an fsync failure may have dropped dirty pages: never trust the file again
            self.poisoned = true;
            return Err(MetaError::Io {
                op: "sync meta journal",
                source: e,
            });
        }
        self.journal_len += rec.len() as u64;
        Ok(())
    }

    /// After a successful op: compact when the journal passed its limit. A failed
    /// compaction is logged and retried after the next op; the op itself is durable.
    fn maybe_compact(&mut self) {
        if self.journal_len > self.config.journal_bytes_max {
            if let Err(e) = self.compact() {
                tracing::warn!(error = %e, "meta store compaction failed; will retry");
            }
        }
    }

    /// Writes a snapshot of the whole state and starts a new, empty journal generation.
    pub fn compact(&mut self) -> Result<(), MetaError> {
        if self.poisoned {
            return Err(MetaError::Poisoned);
        }
        let mut out = file_header(SNAPSHOT_MAGIC, self.generation).to_vec();
        for (uid, entries) in &self.tokens {
            for t in entries {
                let op = Op::SetToken {
                    uid,
                    device_flag: t.device_flag,
                    level: t.level,
                    token: &t.token,
                };
                encode_op(&mut out, &op);
            }
        }
        for (channel_id, uids) in &self.groups {
            let op = Op::Subscribers {
                op: OP_RESET_SUBSCRIBERS,
                channel_id,
                uids: uids.iter().map(|u| &**u).collect(),
            };
            encode_op(&mut out, &op);
        }
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        write_atomic(&self.dir, SNAPSHOT_NAME, &out).map_err(io_err("write meta snapshot"))?;
        let next = self.generation + 1;
        write_atomic(&self.dir, JOURNAL_NAME, &file_header(JOURNAL_MAGIC, next))
            .map_err(io_err("create meta journal"))?;
        self.journal = OpenOptions::new()
            .read(true)
            .write(true)
            .open(self.dir.join(JOURNAL_NAME))
            .map_err(io_err("open meta journal"))?;
        self.generation = next;
        self.journal_len = FILE_HEADER_BYTES as u64;
        self.compactions += 1;
        Ok(())
    }

    /// Stores the token and device level for `(uid, device_flag)` (replacing any).
    pub fn set_token(
        &mut self,
        uid: &str,
        device_flag: u8,
        token: &str,
        level: DeviceLevel,
    ) -> Result<(), MetaError> {
        self.check_field("uid", uid)?;
        if token.len() > self.config.field_bytes_max {
            return Err(MetaError::FieldTooLong {
                field: "token",
                len: token.len(),
                field_bytes_max: self.config.field_bytes_max,
            });
        }
        match self.token(uid, device_flag) {
            Some((t, l)) if t == token && l == level => return Ok(()),
            Some(_) => {}
            None if self.token_count >= self.config.tokens_max => {
                return Err(MetaError::TooManyTokens {
                    tokens_max: self.config.tokens_max,
                })
            }
            None => {}
        }
        let op = Op::SetToken {
            uid,
            device_flag,
            level,
            token,
        };
        self.write_op(&op)?;
        apply_set_token(
            &mut self.tokens,
            &mut self.token_count,
            uid,
            device_flag,
            level,
            token,
        );
        self.maybe_compact();
        Ok(())
    }

    /// Every `(device_flag, token, level)` stored for `uid`.
    pub fn tokens_of<'a>(
        &'a self,
        uid: &str,
    ) -> impl Iterator<Item = (u8, &'a str, DeviceLevel)> + 'a {
        self.tokens
            .get(uid)
            .into_iter()
            .flatten()
            .map(|t| (t.device_flag, &*t.token, t.level))
    }

    /// Every uid that has a token.
    pub fn token_uids(&self) -> impl Iterator<Item = &str> + '_ {
        self.tokens.keys().map(|k| &**k)
    }

    /// Every group with its subscribers (sorted).
    pub fn groups(&self) -> impl Iterator<Item = (&str, &[Uid])> + '_ {
        self.groups.iter().map(|(k, v)| (&**k, v.as_slice()))
    }

    /// The token and device level stored for `(uid, device_flag)`.
    pub fn token(&self, uid: &str, device_flag: u8) -> Option<(&str, DeviceLevel)> {
        self.tokens
            .get(uid)?
            .iter()
            .find(|t| t.device_flag == device_flag)
            .map(|t| (&*t.token, t.level))
    }

    /// Adds `uids` to the group (with `reset`, replaces its list by `uids`). Returns
    /// the group's size afterwards. Refused whole if a uid is invalid or a limit would
    /// be passed.
    pub fn add_subscribers(
        &mut self,
        channel_id: &str,
        uids: &[&str],
        reset: bool,
    ) -> Result<usize, MetaError> {
        self.check_field("channel_id", channel_id)?;
        for u in uids {
            self.check_field("uid", u)?;
        }
        let mut wanted: Vec<&str> = uids.to_vec();
        wanted.sort_unstable();
        wanted.dedup();
        let current = self.groups.get(channel_id);
        let new_size = match (current, reset) {
            (_, true) => wanted.len(),
            (None, false) => wanted.len(),
            (Some(cur), false) => {
                cur.len()
                    + wanted
                        .iter()
                        .filter(|u| cur.binary_search_by(|c| (**c).cmp(u)).is_err())
                        .count()
            }
        };
        let unchanged = match current {
            Some(cur) if reset => {
                cur.len() == wanted.len() && cur.iter().zip(&wanted).all(|(a, b)| &**a == *b)
            }
            Some(cur) => new_size == cur.len(),
            None => wanted.is_empty(),
        };
        if unchanged {
            return Ok(new_size);
        }
        if new_size > self.config.subscribers_per_group_max {
            return Err(MetaError::TooManySubscribers {
                subscribers_per_group_max: self.config.subscribers_per_group_max,
            });
        }
        if current.is_none() && self.groups.len() >= self.config.groups_max {
            return Err(MetaError::TooManyGroups {
                groups_max: self.config.groups_max,
            });
        }
        let op = if reset {
            OP_RESET_SUBSCRIBERS
        } else {
            OP_ADD_SUBSCRIBERS
        };
        let op = Op::Subscribers {
            op,
            channel_id,
            uids: wanted,
        };
        self.write_op(&op)?;
        apply_subscribers(&mut self.groups, &op);
        self.maybe_compact();
        Ok(self.groups.get(channel_id).map_or(0, Vec::len))
    }

    /// Removes `uids` from the group; returns its size afterwards (0: the group is gone).
    pub fn remove_subscribers(
        &mut self,
        channel_id: &str,
        uids: &[&str],
    ) -> Result<usize, MetaError> {
        self.check_field("channel_id", channel_id)?;
        let Some(cur) = self.groups.get(channel_id) else {
            return Ok(0);
        };
        let mut present: Vec<&str> = uids
            .iter()
            .copied()
            .filter(|u| cur.binary_search_by(|c| (**c).cmp(u)).is_ok())
            .collect();
        if present.is_empty() {
            return Ok(cur.len());
        }
        present.sort_unstable();
        present.dedup();
        let op = Op::Subscribers {
            op: OP_REMOVE_SUBSCRIBERS,
            channel_id,
            uids: present,
        };
        self.write_op(&op)?;
        apply_subscribers(&mut self.groups, &op);
        self.maybe_compact();
        Ok(self.groups.get(channel_id).map_or(0, Vec::len))
    }

    /// The group's subscribers, sorted bytewise by uid.
    pub fn subscribers(&self, channel_id: &str) -> Option<&[Uid]> {
        self.groups.get(channel_id).map(Vec::as_slice)
    }

    pub fn is_subscriber(&self, channel_id: &str, uid: &str) -> bool {
        self.groups
            .get(channel_id)
            .is_some_and(|g| g.binary_search_by(|c| (**c).cmp(uid)).is_ok())
    }

    pub fn token_count(&self) -> usize {
        self.token_count
    }

    pub fn group_count(&self) -> usize {
        self.groups.len()
    }

    /// Current journal size in bytes (header included).
    pub fn journal_bytes(&self) -> u64 {
        self.journal_len
    }

    /// Compactions done since open.
    pub fn compactions(&self) -> u64 {
        self.compactions
    }
}

#[derive(Default)]
struct State {
    tokens: HashMap<Box<str>, Vec<TokenEntry>>,
    token_count: usize,
    groups: HashMap<Box<str>, Vec<Uid>>,
}

impl State {
    fn apply(&mut self, op: &Op<'_>) {
        match op {
            Op::SetToken {
                uid,
                device_flag,
                level,
                token,
            } => apply_set_token(
                &mut self.tokens,
                &mut self.token_count,
                uid,
                *device_flag,
                *level,
                token,
            ),
            Op::Subscribers { .. } => apply_subscribers(&mut self.groups, op),
        }
    }
}

fn apply_set_token(
    tokens: &mut HashMap<Box<str>, Vec<TokenEntry>>,
    count: &mut usize,
    uid: &str,
    device_flag: u8,
    level: DeviceLevel,
    token: &str,
) {
    let entries = match tokens.get_mut(uid) {
        Some(e) => e,
        None => tokens.entry(uid.into()).or_default(),
    };
    match entries.iter_mut().find(|t| t.device_flag == device_flag) {
        Some(t) => {
            t.level = level;
            t.token = token.into();
        }
        None => {
            entries.push(TokenEntry {
                device_flag,
                level,
                token: token.into(),
            });
            *count += 1;
        }
    }
}

/// Applies a subscriber op; `uids` need not be sorted (replayed input is not trusted).
fn apply_subscribers(groups: &mut HashMap<Box<str>, Vec<Uid>>, op: &Op<'_>) {
    let Op::Subscribers {
        op,
        channel_id,
        uids,
    } = op
    else {
        return;
    };
    let list = match groups.get_mut(*channel_id) {
        Some(l) => l,
        None => groups.entry((*channel_id).into()).or_default(),
    };
    match *op {
        OP_RESET_SUBSCRIBERS => {
            list.clear();
            list.extend(uids.iter().map(|u| Uid::from(*u)));
            list.sort_unstable();
            list.dedup();
        }
        OP_ADD_SUBSCRIBERS => {
            for u in uids {
                if let Err(i) = list.binary_search_by(|c| (**c).cmp(u)) {
                    list.insert(i, Uid::from(*u));
                }
            }
        }
        _ => {
            list.retain(|c| !uids.contains(&&**c));
        }
    }
    if list.is_empty() {
        groups.remove(*channel_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_codec_round_trip_and_rejects_garbage() {
        let ops = [
            Op::SetToken {
                uid: "u1",
                device_flag: 1,
                level: DeviceLevel::Master,
                token: "tk",
            },
            Op::Subscribers {
                op: OP_RESET_SUBSCRIBERS,
                channel_id: "g",
                uids: vec!["a", "b"],
            },
            Op::Subscribers {
                op: OP_REMOVE_SUBSCRIBERS,
                channel_id: "g",
                uids: vec![],
            },
        ];
        let mut buf = Vec::new();
        for op in &ops {
            encode_op(&mut buf, op);
        }
        let (got, valid) = decode_records(&buf);
        assert_eq!(got, ops);
        assert_eq!(valid, buf.len());
        // cut anywhere inside the last record: the first two survive
        let second_end = {
            let mut b = Vec::new();
            encode_op(&mut b, &ops[0]);
            encode_op(&mut b, &ops[1]);
            b.len()
        };
        for cut in second_end..buf.len() {
            let (got, valid) = decode_records(&buf[..cut]);
            assert_eq!(got.len(), 2);
            assert_eq!(valid, second_end);
        }
        // an invalid level byte inside a crc-valid record is rejected
        let mut b = Vec::new();
        encode_op(
            &mut b,
            &Op::SetToken {
                uid: "u",
                device_flag: 0,
                level: DeviceLevel::Slave,
                token: "",
            },
        );
        let level_at = RECORD_FRAME_BYTES + 1 + 2 + 1 + 1;
        b[level_at] = 9;
        let crc = crc32fast::hash(&b[RECORD_FRAME_BYTES..]);
        b[4..8].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(decode_records(&b).0.len(), 0);
    }
}
