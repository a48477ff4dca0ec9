//! Each replicated group's hard state (term, vote, commit) and configuration, for
//! the groups of one shard, in one file (`DATA_DIR/shard-N/raft_state`).
//!
//! # Layout
//! A pair of 256-byte slots per group (at `pair × 512` and `pair × 512 + 256`),
//! written alternately: each slot holds a sequence number, the group, its hard state
//! and its configuration (at most [`CONF_IDS_MAX`] replica ids in all), and a CRC-32
//! of the rest. At open the valid slot of the higher sequence wins, so a write torn
//! by a crash leaves the previous state, never a mix. A pair with no valid slot is
//! free. The file is preallocated to `groups_max` pairs.
//!
//! # Durability contract
//! [`RaftStateFile::write`] returns once the slot is written **and synced**
//! (`fdatasync`, or the [`SyncHook`] a test installs), under every `[log] fsync`
//! policy; [`RaftStateFile::stage`] writes several groups' slots and
//! [`RaftStateFile::sync_staged`] syncs them at once (one sync for a shard's groups): raft may send a vote or acknowledge an append only after the term and
//! vote it depends on are durable. A failed write or sync poisons the file (the
//! kernel may have dropped the page): every later write is refused
//! ([`RaftStateError::Poisoned`]) and the replica must stop voting until a restart.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use replica::{ConfState, HardState};

use super::fsutil::{preallocate, private_file, sync_dir};
use super::log::SyncHook;

/// The file's name in a shard's directory.
pub const RAFT_STATE_FILE: &str = "raft_state";
/// Bytes of one slot.
pub const SLOT_BYTES: usize = 256;
/// Replica ids one configuration holds, in all four of its lists.
pub const CONF_IDS_MAX: usize = 25;

const SLOT_MAGIC: u32 = u32::from_le_bytes(*b"IMRS");
const SLOT_VERSION: u16 = 1;
const PAIR_BYTES: usize = 2 * SLOT_BYTES;
const IDS_AT: usize = 56;
const CRC_AT: usize = 52;
const _: () = assert!(IDS_AT + 8 * CONF_IDS_MAX == SLOT_BYTES);

/// One group's durable state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupState {
    pub hard_state: HardState,
    pub conf_state: ConfState,
}

/// Why the file refused.
#[derive(Debug)]
pub enum RaftStateError {
    /// An IO operation failed: which one, and the OS error (a write or sync failure
    /// also poisons the file).
    Io { op: &'static str, source: io::Error },
    /// An earlier write or sync failed; restart to recover.
    Poisoned,
    /// A new group beyond `groups_max`.
    TooManyGroups { groups_max: usize },
    /// A configuration of more than [`CONF_IDS_MAX`] ids.
    ConfTooLarge { ids: usize },
    /// Two valid slots of one pair name different groups (a broken writer).
    Corrupt { pair: usize },
}

impl std::fmt::Display for RaftStateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RaftStateError::Io { op, source } => {
                write!(f, "{RAFT_STATE_FILE}: io error during {op}: {source}")
            }
            RaftStateError::Poisoned => write!(
                f,
                "{RAFT_STATE_FILE} is poisoned by an earlier write failure; restart to recover"
            ),
            RaftStateError::TooManyGroups { groups_max } => {
                write!(
                    f,
                    "{RAFT_STATE_FILE}: a new group beyond groups_max {groups_max}"
                )
            }
            RaftStateError::ConfTooLarge { ids } => write!(
                f,
                "{RAFT_STATE_FILE}: a configuration of {ids} replica ids, more than {CONF_IDS_MAX}"
            ),
            RaftStateError::Corrupt { pair } => {
                write!(
                    f,
                    "{RAFT_STATE_FILE}: the two slots of pair {pair} name different groups"
                )
            }
        }
    }
}

impl std::error::Error for RaftStateError {}

/// Where a group's state lives: its pair, the sequence of its newest slot, and
/// which slot (0 or 1) that is.
#[derive(Clone, Copy, Debug)]
struct Place {
    pair: usize,
    seq: u64,
    newest: usize,
}

/// The open file (module docs).
pub struct RaftStateFile {
    path: PathBuf,
    file: File,
    groups_max: usize,
    places: HashMap<u32, Place>,
    /// Pairs no group holds, lowest last.
    free: Vec<usize>,
    poisoned: bool,
    sync_hook: Option<Arc<dyn SyncHook>>,
    /// Groups staged since the last sync (at most `groups_max`).
    staged: Vec<u32>,
}

impl std::fmt::Debug for RaftStateFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftStateFile")
            .field("path", &self.path)
            .field("groups", &self.places.len())
            .field("poisoned", &self.poisoned)
            .finish()
    }
}

fn io_err(op: &'static str) -> impl FnOnce(io::Error) -> RaftStateError {
    move |source| RaftStateError::Io { op, source }
}

impl RaftStateFile {
    /// Opens (creating and preallocating if needed) `dir/raft_state` for up to
    /// `groups_max` groups; every group's newest valid state. Refuses an IO failure
    /// and a pair whose two valid slots name different groups.
    pub fn open(
        dir: &Path,
        groups_max: usize,
    ) -> Result<(RaftStateFile, HashMap<u32, GroupState>), RaftStateError> {
        let path = dir.join(RAFT_STATE_FILE);
        let existed = path.exists();
        let file = private_file()
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io_err("open"))?;
        let want = (groups_max * PAIR_BYTES) as u64;
        let len = file.metadata().map_err(io_err("stat"))?.len();
        if len < want {
            preallocate(&file, want).map_err(io_err("preallocate"))?;
            file.sync_all().map_err(io_err("sync"))?;
            if !existed {
                sync_dir(dir).map_err(io_err("sync dir"))?;
            }
        }
        let pairs = (len.max(want) as usize) / PAIR_BYTES;
        let mut out = RaftStateFile {
            path,
            file,
            groups_max,
            places: HashMap::new(),
            free: Vec::new(),
            poisoned: false,
            sync_hook: None,
            staged: Vec::new(),
        };
        let mut states = HashMap::new();
        let mut pair_bytes = [0u8; PAIR_BYTES];
        for pair in (0..pairs).rev() {
            out.file
                .read_exact_at(&mut pair_bytes, (pair * PAIR_BYTES) as u64)
                .map_err(io_err("read"))?;
            let a = decode_slot(&pair_bytes[..SLOT_BYTES]);
            let b = decode_slot(&pair_bytes[SLOT_BYTES..]);
            let newest = match (&a, &b) {
                (None, None) => {
                    out.free.push(pair);
                    continue;
                }
                (Some(x), Some(y)) if x.1 != y.1 => return Err(RaftStateError::Corrupt { pair }),
                (Some(x), Some(y)) => usize::from(y.0 > x.0),
                (Some(_), None) => 0,
                (None, Some(_)) => 1,
            };
            let (seq, group, state) = [a, b][newest].take().expect("valid");
            out.places.insert(group, Place { pair, seq, newest });
            states.insert(group, state);
        }
        Ok((out, states))
    }

    /// Runs every sync through `hook` instead of `fdatasync` (tests).
    pub fn set_sync_hook(&mut self, hook: Arc<dyn SyncHook>) {
        self.sync_hook = Some(hook);
    }

    /// Writes `group`'s state to the slot of its pair not holding its newest, and
    /// syncs it (module docs): [`RaftStateFile::stage`] then
    /// [`RaftStateFile::sync_staged`].
    pub fn write(&mut self, group: u32, state: &GroupState) -> Result<(), RaftStateError> {
        self.stage(group, state)?;
        self.sync_staged()
    }

    /// Writes `group`'s state without syncing it: to the slot not holding its
    /// newest synced state (a group staged again before the sync rewrites the same
    /// slot, so the synced copy is never overwritten). Not durable, and not to be
    /// relied on, until [`RaftStateFile::sync_staged`] returns: one sync covers every
    /// group staged. Refuses a poisoned file, a new group beyond `groups_max`, a
    /// configuration over [`CONF_IDS_MAX`] ids, and an IO failure (which poisons).
    pub fn stage(&mut self, group: u32, state: &GroupState) -> Result<(), RaftStateError> {
        if self.poisoned {
            return Err(RaftStateError::Poisoned);
        }
        let ids = conf_ids(&state.conf_state);
        if ids > CONF_IDS_MAX {
            return Err(RaftStateError::ConfTooLarge { ids });
        }
        let place = match self.places.get(&group) {
            Some(&p) => p,
            None if self.places.len() >= self.groups_max => {
                return Err(RaftStateError::TooManyGroups {
                    groups_max: self.groups_max,
                })
            }
            None => Place {
                pair: self.free.pop().ok_or(RaftStateError::TooManyGroups {
                    groups_max: self.groups_max,
                })?,
                seq: 0,
                newest: 1,
            },
        };
        // Staged since the last sync: that slot again, same sequence.
        let next = if self.staged.contains(&group) {
            place
        } else {
            Place {
                pair: place.pair,
                seq: place.seq + 1,
                newest: 1 - place.newest,
            }
        };
        let slot = encode_slot(next.seq, group, state);
        let at = (next.pair * PAIR_BYTES + next.newest * SLOT_BYTES) as u64;
        if let Err(e) = self.file.write_all_at(&slot, at).map_err(io_err("write")) {
            self.poisoned = true;
            return Err(e);
        }
        self.places.insert(group, next);
        if !self.staged.contains(&group) {
            self.staged.push(group);
        }
        Ok(())
    }

    /// Makes every staged write durable (one `fdatasync`); nothing to do when
    /// none is staged. A failure poisons the file.
    pub fn sync_staged(&mut self) -> Result<(), RaftStateError> {
        if self.poisoned {
            return Err(RaftStateError::Poisoned);
        }
        if self.staged.is_empty() {
            return Ok(());
        }
        if let Err(e) = self.sync().map_err(io_err("fdatasync")) {
            self.poisoned = true;
            return Err(e);
        }
        self.staged.clear();
        Ok(())
    }

    /// Groups held.
    pub fn groups(&self) -> usize {
        self.places.len()
    }

    fn sync(&self) -> io::Result<()> {
        match &self.sync_hook {
            Some(h) => h.sync(&self.file, &self.path, u32::MAX),
            None => self.file.sync_data(),
        }
    }
}

fn conf_ids(cs: &ConfState) -> usize {
    cs.voters.len() + cs.learners.len() + cs.voters_outgoing.len() + cs.learners_next.len()
}

fn encode_slot(seq: u64, group: u32, s: &GroupState) -> [u8; SLOT_BYTES] {
    let mut b = [0u8; SLOT_BYTES];
    b[0..4].copy_from_slice(&SLOT_MAGIC.to_le_bytes());
    b[4..6].copy_from_slice(&SLOT_VERSION.to_le_bytes());
    b[8..16].copy_from_slice(&seq.to_le_bytes());
    b[16..20].copy_from_slice(&group.to_le_bytes());
    b[20..24].copy_from_slice(&u32::from(s.conf_state.auto_leave).to_le_bytes());
    b[24..32].copy_from_slice(&s.hard_state.term.to_le_bytes());
    b[32..40].copy_from_slice(&s.hard_state.vote.to_le_bytes());
    b[40..48].copy_from_slice(&s.hard_state.commit.to_le_bytes());
    let cs = &s.conf_state;
    let lists = [
        &cs.voters,
        &cs.learners,
        &cs.voters_outgoing,
        &cs.learners_next,
    ];
    let mut at = IDS_AT;
    for (k, list) in lists.iter().enumerate() {
        b[48 + k] = list.len() as u8;
        for id in list.iter() {
            b[at..at + 8].copy_from_slice(&id.to_le_bytes());
            at += 8;
        }
    }
    let crc = slot_crc(&b);
    b[CRC_AT..CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
    b
}

fn slot_crc(b: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&b[..CRC_AT]);
    h.update(&b[CRC_AT + 4..SLOT_BYTES]);
    h.finalize()
}

/// A valid slot's (sequence, group, state); `None` for zeros, a torn or corrupt
/// slot, or one of another version.
fn decode_slot(b: &[u8]) -> Option<(u64, u32, GroupState)> {
    let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4"));
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8"));
    if u32_at(0) != SLOT_MAGIC
        || u16::from_le_bytes([b[4], b[5]]) != SLOT_VERSION
        || u32_at(CRC_AT) != slot_crc(b)
    {
        return None;
    }
    let counts = [b[48], b[49], b[50], b[51]].map(usize::from);
    if counts.iter().sum::<usize>() > CONF_IDS_MAX || u32_at(20) > 1 {
        return None;
    }
    let mut at = IDS_AT;
    let mut lists = counts.map(|n| {
        let list: Vec<u64> = (0..n).map(|k| u64_at(at + 8 * k)).collect();
        at += 8 * n;
        list
    });
    let take = |l: &mut Vec<u64>| std::mem::take(l);
    let state = GroupState {
        hard_state: HardState {
            term: u64_at(24),
            vote: u64_at(32),
            commit: u64_at(40),
        },
        conf_state: ConfState {
            voters: take(&mut lists[0]),
            learners: take(&mut lists[1]),
            voters_outgoing: take(&mut lists[2]),
            learners_next: take(&mut lists[3]),
            auto_leave: u32_at(20) == 1,
        },
    };
    Some((u64_at(8), u32_at(16), state))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(term: u64, vote: u64) -> GroupState {
        GroupState {
            hard_state: HardState {
                term,
                vote,
                commit: term * 10,
            },
            conf_state: ConfState {
                voters: vec![1, 2, 3],
                learners: vec![4],
                voters_outgoing: vec![1, 2, 5],
                learners_next: vec![5],
                auto_leave: true,
            },
        }
    }

    /// A slot reads back what was written; any single bit flip makes it invalid.
    #[test]
    fn a_slot_round_trips_and_every_bit_flip_is_caught() {
        let s = state(7, 2);
        let b = encode_slot(9, 42, &s);
        assert_eq!(decode_slot(&b), Some((9, 42, s)));
        for bit in 0..SLOT_BYTES * 8 {
            let mut c = b;
            c[bit / 8] ^= 1 << (bit % 8);
            assert_eq!(decode_slot(&c), None, "bit {bit}");
        }
        assert_eq!(decode_slot(&[0u8; SLOT_BYTES]), None);
    }
}
