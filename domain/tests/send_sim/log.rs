//! The simulation's message log: an in-memory [`CommitLog`] with a durable prefix, as
//! `engine::store::MessageLog` behaves for the commit core: seqs per channel are the
//! channel's last + 1; a sync job covers every append before its `begin_sync`; a
//! failed sync poisons the log (appends and syncs fail until a restart); a crash
//! keeps the durable prefix and any prefix of the rest (a process crash may leave
//! pages the kernel had already written), and what survives is durable.

use std::cell::RefCell;
use std::rc::Rc;

use domain::send::commit::{CommitLog, LogFault, NewMessage};

/// One stored record.
#[derive(Clone, Debug)]
pub struct Record {
    /// Its rank among every append of the run (never reused, across crashes): a
    /// client's read of the log at ordinal `o` sees every record below `o`.
    pub ordinal: u64,
    pub message_id: i64,
    pub channel_type: u8,
    pub channel_key: String,
    pub seq: u64,
    pub from_uid: String,
    pub client_msg_no: String,
    pub timestamp_s: u32,
}

/// The log's state, shared by the commit core's handle and the simulation (which
/// reads it as clients' `messagesync` would, and crashes it).
#[derive(Default)]
pub struct Store {
    pub records: Vec<Record>,
    /// `records[..durable]` survive any crash.
    pub durable: usize,
    /// Appends covered by the last begun job.
    pub begun: usize,
    /// The length the job in flight makes durable.
    pub in_flight: Option<usize>,
    pub poisoned: bool,
    pub next_ordinal: u64,
    /// Planted bug: a crash also loses the newest durable record.
    pub bug_crash_drops_synced: bool,
}

impl Store {
    /// The channel's last seq (0: none).
    pub fn last_seq(&self, channel_type: u8, key: &str) -> u64 {
        self.records
            .iter()
            .rev()
            .find(|r| r.channel_type == channel_type && r.channel_key == key)
            .map_or(0, |r| r.seq)
    }

    /// The record of message `id`.
    pub fn by_id(&self, id: i64) -> Option<(usize, &Record)> {
        self.records
            .iter()
            .enumerate()
            .rev()
            .find(|(_, r)| r.message_id == id)
    }

    /// Appends not yet durable.
    pub fn unsynced(&self) -> usize {
        self.records.len() - self.durable
    }

    /// A crash: keeps the durable prefix and `keep_unsynced` more records; returns
    /// the records lost. The job in flight dies with the process.
    pub fn crash(&mut self, keep_unsynced: usize) -> Vec<Record> {
        let mut keep = (self.durable + keep_unsynced).min(self.records.len());
        if self.bug_crash_drops_synced && self.durable > 0 {
            keep = self.durable - 1;
        }
        let lost = self.records.split_off(keep);
        self.durable = keep;
        self.begun = keep;
        self.in_flight = None;
        self.poisoned = false;
        lost
    }
}

/// The core's handle on the shared [`Store`].
#[derive(Clone, Default)]
pub struct FakeLog(pub Rc<RefCell<Store>>);

fn fault(message: &str) -> LogFault {
    LogFault {
        disk: true,
        message: message.to_owned(),
    }
}

impl CommitLog for FakeLog {
    /// The length of the log the job makes durable.
    type Job = usize;

    fn append(&mut self, a: &NewMessage<'_>) -> Result<u64, LogFault> {
        let mut s = self.0.borrow_mut();
        if s.poisoned {
            return Err(fault("poisoned"));
        }
        let seq = s.last_seq(a.channel_type, a.channel_id) + 1;
        let ordinal = s.next_ordinal;
        s.next_ordinal += 1;
        s.records.push(Record {
            ordinal,
            message_id: a.message_id,
            channel_type: a.channel_type,
            channel_key: a.channel_id.to_owned(),
            seq,
            from_uid: a.from_uid.to_owned(),
            client_msg_no: a.client_msg_no.to_owned(),
            timestamp_s: a.timestamp_s,
        });
        Ok(seq)
    }

    fn begin_sync(&mut self) -> Result<Option<usize>, LogFault> {
        let mut s = self.0.borrow_mut();
        if s.poisoned {
            return Err(fault("poisoned"));
        }
        assert!(s.in_flight.is_none(), "a second sync job while one runs");
        if s.records.len() == s.begun {
            return Ok(None);
        }
        s.begun = s.records.len();
        s.in_flight = Some(s.begun);
        Ok(Some(s.begun))
    }

    fn end_sync(&mut self, result: std::io::Result<()>, _now_ms: u64) -> Result<(), LogFault> {
        let mut s = self.0.borrow_mut();
        let job = s.in_flight.take().expect("end_sync without a job");
        match result {
            Ok(()) => {
                s.durable = s.durable.max(job);
                Ok(())
            }
            Err(e) => {
                s.poisoned = true;
                Err(fault(&e.to_string()))
            }
        }
    }

    fn sync_now(&mut self, _now_ms: u64) -> Result<(), LogFault> {
        let mut s = self.0.borrow_mut();
        if s.poisoned {
            return Err(fault("poisoned"));
        }
        s.durable = s.records.len();
        s.begun = s.durable;
        Ok(())
    }
}
