//! What a replica makes durable, in our own types: the records of its log, its
//! hard state (term, vote, commit) and its configuration. The engine's log stores
//! these; raft-rs's types stay inside this crate.
//!
//! # Contract
//! [`crate::Group::drain`] hands out one [`Persist`] per step of raft, in order.
//! The caller applies each to its durable copy of the group (as [`Durable::apply`]
//! does in memory), makes it durable (an fdatasync when [`Persist::sync`] says so;
//! one sync may cover many), and only then calls [`crate::Group::persisted`] with
//! its number: the messages that depend on it (a vote, an append's
//! acknowledgement) leave only then, in order. A leader's appends leave before its
//! own write (they depend on nothing of it). A crash keeps what was made durable; a
//! restart ([`crate::Group::restart`]) starts from it.

use raft::prelude::{ConfState as RaftConfState, Entry, EntryType, HardState as RaftHardState};

/// What one log record holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecordKind {
    /// A proposal's bytes, or a new leader's empty no-op.
    Normal,
    /// A configuration change (raft's own encoding, made by this node: our wire
    /// re-encodes a peer's before raft reads it).
    ConfChange,
    /// A configuration change of several steps (joint consensus), likewise.
    ConfChangeV2,
}

/// One record of a group's log.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Record {
    /// Its index in the log (from 1, dense).
    pub index: u64,
    /// The term of the leader that appended it.
    pub term: u64,
    /// What it holds.
    pub kind: RecordKind,
    /// Its bytes.
    pub data: Vec<u8>,
}

/// A replica's term, its vote in that term, and the highest index it knows
/// committed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct HardState {
    /// The term.
    pub term: u64,
    /// The replica voted for in `term` (0: none).
    pub vote: u64,
    /// The highest index known committed.
    pub commit: u64,
}

/// The group's members as this replica last applied them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct ConfState {
    /// The voters.
    pub voters: Vec<u64>,
    /// The learners.
    pub learners: Vec<u64>,
    /// During a joint change: the voters of the outgoing configuration.
    pub voters_outgoing: Vec<u64>,
    /// During a joint change: voters that become learners when it ends.
    pub learners_next: Vec<u64>,
    /// Whether a joint change ends by itself once applied.
    pub auto_leave: bool,
}

/// One step's writes, to make durable in order (module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Persist {
    /// Its number: [`crate::Group::persisted`] with it once it is durable.
    pub number: u64,
    /// Records to append: a record at an index the log already holds replaces it
    /// and every record after it (a deposed leader's uncommitted tail).
    pub records: Vec<Record>,
    /// The new hard state, if it changed.
    pub hard_state: Option<HardState>,
    /// The new configuration, if a committed change was applied.
    pub conf_state: Option<ConfState>,
    /// It must be synced before [`crate::Group::persisted`] (a record, or a new term
    /// or vote); without it a commit index alone changed, or nothing did.
    pub sync: bool,
}

impl Persist {
    /// Whether it writes nothing (its messages may be released at once, in order).
    pub fn is_empty(&self) -> bool {
        self.records.is_empty() && self.hard_state.is_none() && self.conf_state.is_none()
    }
}

/// A replica's durable state (kept in memory here; the engine's log on disk).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Durable {
    /// The hard state.
    pub hard_state: HardState,
    /// The configuration.
    pub conf_state: ConfState,
    /// The log, from index 1.
    pub records: Vec<Record>,
}

impl Durable {
    /// A new group's: no record, term 0, `voters` and `learners`.
    pub fn new(voters: Vec<u64>, learners: Vec<u64>) -> Durable {
        Durable {
            conf_state: ConfState {
                voters,
                learners,
                ..ConfState::default()
            },
            ..Durable::default()
        }
    }

    /// Applies one step's writes (a record at a held index cuts the log there).
    pub fn apply(&mut self, p: &Persist) {
        if let Some(first) = p.records.first() {
            debug_assert!(first.index >= 1, "records start at index 1");
            let keep = (first.index - 1) as usize;
            assert!(
                keep <= self.records.len(),
                "a gap: record {} after {} held",
                first.index,
                self.records.len()
            );
            self.records.truncate(keep);
            self.records.extend(p.records.iter().cloned());
        }
        if let Some(hs) = p.hard_state {
            self.hard_state = hs;
        }
        if let Some(cs) = &p.conf_state {
            self.conf_state = cs.clone();
        }
    }
}

pub(crate) fn record_of(e: &Entry) -> Record {
    let kind = match e.entry_type {
        EntryType::EntryNormal => RecordKind::Normal,
        EntryType::EntryConfChange => RecordKind::ConfChange,
        EntryType::EntryConfChangeV2 => RecordKind::ConfChangeV2,
    };
    Record {
        index: e.index,
        term: e.term,
        kind,
        data: e.data.to_vec(),
    }
}

pub(crate) fn entry_of(r: &Record) -> Entry {
    let entry_type = match r.kind {
        RecordKind::Normal => EntryType::EntryNormal,
        RecordKind::ConfChange => EntryType::EntryConfChange,
        RecordKind::ConfChangeV2 => EntryType::EntryConfChangeV2,
    };
    Entry {
        entry_type,
        term: r.term,
        index: r.index,
        data: r.data.clone().into(),
        ..Entry::default()
    }
}

pub(crate) fn hard_state_of(hs: &RaftHardState) -> HardState {
    HardState {
        term: hs.term,
        vote: hs.vote,
        commit: hs.commit,
    }
}

pub(crate) fn raft_hard_state(hs: &HardState) -> RaftHardState {
    RaftHardState {
        term: hs.term,
        vote: hs.vote,
        commit: hs.commit,
        ..RaftHardState::default()
    }
}

pub(crate) fn conf_state_of(cs: &RaftConfState) -> ConfState {
    ConfState {
        voters: cs.voters.clone(),
        learners: cs.learners.clone(),
        voters_outgoing: cs.voters_outgoing.clone(),
        learners_next: cs.learners_next.clone(),
        auto_leave: cs.auto_leave,
    }
}

pub(crate) fn raft_conf_state(cs: &ConfState) -> RaftConfState {
    RaftConfState {
        voters: cs.voters.clone(),
        learners: cs.learners.clone(),
        voters_outgoing: cs.voters_outgoing.clone(),
        learners_next: cs.learners_next.clone(),
        auto_leave: cs.auto_leave,
        ..RaftConfState::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(index: u64, term: u64) -> Record {
        Record {
            index,
            term,
            kind: RecordKind::Normal,
            data: vec![index as u8],
        }
    }

    /// Records append; one at a held index cuts the log there; the hard state and
    /// the configuration are replaced only when given.
    #[test]
    fn writes_append_cut_and_replace() {
        let mut d = Durable::new(vec![1, 2, 3], vec![]);
        let hs = HardState {
            term: 2,
            vote: 1,
            commit: 0,
        };
        d.apply(&Persist {
            number: 1,
            records: vec![rec(1, 1), rec(2, 1), rec(3, 1)],
            hard_state: Some(hs),
            conf_state: None,
            sync: true,
        });
        d.apply(&Persist {
            number: 2,
            records: vec![rec(2, 2)],
            ..Persist::default()
        });
        assert_eq!(d.records, vec![rec(1, 1), rec(2, 2)]);
        assert_eq!((d.hard_state, d.conf_state.voters.len()), (hs, 3));
        let cs = ConfState {
            voters: vec![1, 2],
            ..ConfState::default()
        };
        d.apply(&Persist {
            number: 3,
            conf_state: Some(cs.clone()),
            ..Persist::default()
        });
        assert_eq!((d.hard_state, d.conf_state), (hs, cs.clone()));
        // Empty only when it writes nothing of the three.
        assert!(Persist::default().is_empty());
        let records = Persist {
            records: vec![rec(1, 1)],
            ..Persist::default()
        };
        let hard_state = Persist {
            hard_state: Some(hs),
            ..Persist::default()
        };
        let conf_state = Persist {
            conf_state: Some(cs),
            ..Persist::default()
        };
        for p in [records, hard_state, conf_state] {
            assert!(!p.is_empty(), "{p:?}");
        }
    }

    /// A record past the end of the log (a gap) is refused.
    #[test]
    #[should_panic(expected = "a gap: record 3 after 1 held")]
    fn a_gap_is_refused() {
        let mut d = Durable::default();
        d.apply(&Persist {
            records: vec![rec(1, 1)],
            ..Persist::default()
        });
        d.apply(&Persist {
            records: vec![rec(3, 1)],
            ..Persist::default()
        });
    }

    /// Our types and raft's carry the same fields both ways.
    #[test]
    fn conversions_round_trip() {
        let r = Record {
            index: 7,
            term: 3,
            kind: RecordKind::ConfChangeV2,
            data: b"cc".to_vec(),
        };
        assert_eq!(record_of(&entry_of(&r)), r);
        for kind in [RecordKind::Normal, RecordKind::ConfChange] {
            let r = Record { kind, ..r.clone() };
            assert_eq!(record_of(&entry_of(&r)), r);
        }
        let hs = HardState {
            term: 4,
            vote: 2,
            commit: 9,
        };
        assert_eq!(hard_state_of(&raft_hard_state(&hs)), hs);
        let cs = ConfState {
            voters: vec![1, 2],
            learners: vec![3],
            voters_outgoing: vec![1, 4],
            learners_next: vec![4],
            auto_leave: true,
        };
        assert_eq!(conf_state_of(&raft_conf_state(&cs)), cs);
    }
}
