//! The replicated groups' hard state and configuration (`store::raft_state`):
//! read back after a reopen, durable only through its sync (a simulated power cut
//! keeps only what the syncs covered), a torn write leaving the previous state, and
//! every refusal named.

use std::fs::File;
use std::io;
use std::path::Path;
use std::sync::{Arc, Mutex};

use engine::store::log::SyncHook;
use engine::store::raft_state::{
    GroupState, RaftStateError, RaftStateFile, CONF_IDS_MAX, RAFT_STATE_FILE, SLOT_BYTES,
};
use replica::{ConfState, HardState};

fn state(term: u64, vote: u64, commit: u64) -> GroupState {
    GroupState {
        hard_state: HardState { term, vote, commit },
        conf_state: ConfState {
            voters: vec![1, 2, 3],
            ..ConfState::default()
        },
    }
}

/// The disk as a power cut leaves it: the file's bytes as of its last sync.
#[derive(Default)]
struct Disk {
    image: Mutex<Option<Vec<u8>>>,
    fail: Mutex<bool>,
}

impl SyncHook for Disk {
    fn sync(&self, file: &File, path: &Path, _len: u32) -> io::Result<()> {
        if *self.fail.lock().unwrap() {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        file.sync_data()?;
        *self.image.lock().unwrap() = Some(std::fs::read(path)?);
        Ok(())
    }
}

/// States of several groups read back after a reopen, the newest of each (writes
/// alternate between a group's two slots).
#[test]
fn the_newest_state_of_each_group_reads_back() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut f, states) = RaftStateFile::open(tmp.path(), 8).unwrap();
    assert!(states.is_empty());
    for term in 1..=5 {
        f.write(1, &state(term, 2, term * 3)).unwrap();
        f.write(70_000, &state(term + 10, 1, 0)).unwrap();
    }
    let joint = GroupState {
        hard_state: HardState {
            term: 9,
            vote: 0,
            commit: 4,
        },
        conf_state: ConfState {
            voters: vec![1, 2, 4],
            learners: vec![5],
            voters_outgoing: vec![1, 2, 3],
            learners_next: vec![3],
            auto_leave: true,
        },
    };
    f.write(3, &joint).unwrap();
    assert_eq!(f.groups(), 3);
    drop(f);
    let (mut f, states) = RaftStateFile::open(tmp.path(), 8).unwrap();
    assert_eq!(states.len(), 3);
    assert_eq!(states[&1], state(5, 2, 15));
    assert_eq!(states[&70_000], state(15, 1, 0));
    assert_eq!(states[&3], joint);
    // The next write of a reopened group lands in its other slot.
    f.write(1, &state(6, 3, 18)).unwrap();
    drop(f);
    let (_, states) = RaftStateFile::open(tmp.path(), 8).unwrap();
    assert_eq!(states[&1], state(6, 3, 18));
}

/// A write returns only once synced: a power cut right after it keeps it. (With
/// a write that skipped its sync the image would hold the older state.)
#[test]
fn a_power_cut_keeps_every_write_that_returned() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut f, _) = RaftStateFile::open(tmp.path(), 4).unwrap();
    let disk = Arc::new(Disk::default());
    f.set_sync_hook(disk.clone());
    for term in 1..=3 {
        f.write(5, &state(term, term, 0)).unwrap();
        let cut = tempfile::tempdir().unwrap();
        let image = disk.image.lock().unwrap().clone().expect("synced");
        std::fs::write(cut.path().join(RAFT_STATE_FILE), image).unwrap();
        let (_, states) = RaftStateFile::open(cut.path(), 4).unwrap();
        assert_eq!(states[&5], state(term, term, 0), "term {term}");
    }
}

/// A write torn by a crash (its slot half written) leaves the state before it.
#[test]
fn a_torn_write_leaves_the_previous_state() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut f, _) = RaftStateFile::open(tmp.path(), 4).unwrap();
    f.write(2, &state(1, 1, 0)).unwrap(); // pair 0, slot 0
    f.write(2, &state(2, 3, 0)).unwrap(); // pair 0, slot 1
    drop(f);
    let path = tmp.path().join(RAFT_STATE_FILE);
    let mut bytes = std::fs::read(&path).unwrap();
    // Its first 64 bytes (header, sequence, hard state) never reached the disk.
    bytes[SLOT_BYTES..SLOT_BYTES + 64].fill(0);
    std::fs::write(&path, &bytes).unwrap();
    let (mut f, states) = RaftStateFile::open(tmp.path(), 4).unwrap();
    assert_eq!(states[&2], state(1, 1, 0));
    // Writing again goes on from the surviving slot.
    f.write(2, &state(3, 2, 0)).unwrap();
    drop(f);
    assert_eq!(
        RaftStateFile::open(tmp.path(), 4).unwrap().1[&2],
        state(3, 2, 0)
    );
}

/// Each refusal is named; a failed sync poisons the file.
#[test]
fn refusals_are_named_and_a_failed_sync_poisons() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut f, _) = RaftStateFile::open(tmp.path(), 2).unwrap();
    f.write(1, &state(1, 1, 0)).unwrap();
    f.write(2, &state(1, 1, 0)).unwrap();
    let err = f.write(3, &state(1, 1, 0)).unwrap_err();
    assert!(
        matches!(err, RaftStateError::TooManyGroups { groups_max: 2 }),
        "{err}"
    );
    let big = GroupState {
        conf_state: ConfState {
            voters: (0..CONF_IDS_MAX as u64 + 1).collect(),
            ..ConfState::default()
        },
        ..GroupState::default()
    };
    let err = f.write(1, &big).unwrap_err();
    assert!(
        matches!(err, RaftStateError::ConfTooLarge { ids: 26 }),
        "{err}"
    );
    let disk = Arc::new(Disk::default());
    *disk.fail.lock().unwrap() = true;
    f.set_sync_hook(disk);
    let err = f.write(1, &state(2, 2, 0)).unwrap_err();
    assert!(
        matches!(
            err,
            RaftStateError::Io {
                op: "fdatasync",
                ..
            }
        ),
        "{err}"
    );
    assert!(matches!(
        f.write(1, &state(2, 2, 0)),
        Err(RaftStateError::Poisoned)
    ));
    for e in [
        err,
        RaftStateError::Poisoned,
        RaftStateError::Corrupt { pair: 0 },
    ] {
        assert!(e.to_string().contains(RAFT_STATE_FILE), "{e}");
    }
}

/// Two valid slots of one pair that name different groups (a broken writer) are
/// refused at open, not read as either.
#[test]
fn a_pair_naming_two_groups_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut f, _) = RaftStateFile::open(tmp.path(), 4).unwrap();
    f.write(1, &state(1, 1, 0)).unwrap(); // pair 0, slot 0
    f.write(2, &state(1, 1, 0)).unwrap(); // pair 1, slot 0
    drop(f);
    let path = tmp.path().join(RAFT_STATE_FILE);
    let mut bytes = std::fs::read(&path).unwrap();
    let other = bytes[2 * SLOT_BYTES..3 * SLOT_BYTES].to_vec();
    bytes[SLOT_BYTES..2 * SLOT_BYTES].copy_from_slice(&other);
    std::fs::write(&path, &bytes).unwrap();
    let err = RaftStateFile::open(tmp.path(), 4).unwrap_err();
    assert!(matches!(err, RaftStateError::Corrupt { pair: 0 }), "{err}");
}

/// Staged writes of several groups are made durable by one sync; a group staged
/// twice before it rewrites its staged slot, so the synced copy survives a torn
/// staged slot.
#[test]
fn one_sync_covers_staged_groups_and_never_overwrites_a_synced_copy() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut f, _) = RaftStateFile::open(tmp.path(), 4).unwrap();
    let disk = Arc::new(Disk::default());
    f.set_sync_hook(disk.clone());
    f.write(1, &state(1, 1, 0)).unwrap(); // pair 0, slot 0, synced
    f.stage(1, &state(2, 2, 0)).unwrap(); // pair 0, slot 1
    f.stage(1, &state(3, 3, 0)).unwrap(); // slot 1 again
    f.stage(2, &state(7, 1, 0)).unwrap();
    // Before the sync, the disk holds the first write only.
    let image = |disk: &Disk| {
        let cut = tempfile::tempdir().unwrap();
        let bytes = disk.image.lock().unwrap().clone().expect("synced");
        std::fs::write(cut.path().join(RAFT_STATE_FILE), bytes).unwrap();
        RaftStateFile::open(cut.path(), 4).unwrap().1
    };
    let before = image(&disk);
    assert_eq!((before[&1].clone(), before.get(&2)), (state(1, 1, 0), None));
    // A crash that tore the staged slot leaves the synced copy.
    let path = tmp.path().join(RAFT_STATE_FILE);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[SLOT_BYTES..SLOT_BYTES + 64].fill(0);
    let torn = tempfile::tempdir().unwrap();
    std::fs::write(torn.path().join(RAFT_STATE_FILE), &bytes).unwrap();
    assert_eq!(
        RaftStateFile::open(torn.path(), 4).unwrap().1[&1],
        state(1, 1, 0)
    );
    f.sync_staged().unwrap();
    let after = image(&disk);
    assert_eq!(
        (after[&1].clone(), after[&2].clone()),
        (state(3, 3, 0), state(7, 1, 0))
    );
    // Nothing staged: no sync needed, none made.
    *disk.image.lock().unwrap() = None;
    f.sync_staged().unwrap();
    assert!(disk.image.lock().unwrap().is_none());
}
