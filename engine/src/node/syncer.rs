//! The log syncer: one thread per shard that runs the shard's `fdatasync`s, so the
//! shard thread never blocks on the disk (a sync costs milliseconds on a virtual
//! disk; a blocked shard stops every connection and delivery it serves).
//!
//! Contract: at most one [`SyncJob`] is in flight per shard. The shard submits a job
//! ([`LogSyncer::submit`]), keeps running, and collects the result with
//! [`LogSyncer::poll_done`] on a later turn; the thread wakes the shard through its
//! injector when a job ends. Under `fsync = "always"` the commits appended before
//! the job wait for it (group commit, pipelined: appends of the following turns
//! form the next job); under the interval policy nothing waits for it.
//!
//! A job also carries the log's file work (creating the next segment ahead,
//! deleting retired ones: `store::log`, "File work and threads"); the thread does
//! it after it has handed back the sync's result, so no commit waits for it.
//!
//! [`NodeHooks`] is the test-only injection point: a [`SyncHook`] replaces the
//! `fdatasync` of every sync (hold it, fail it, record what it covered).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};

use shard::runtime::Injector;

use super::msg::Msg;
use crate::store::SyncJob;

pub use crate::store::log::SyncHook;

/// Test-only injection points of a node ([`super::Node::start_with`]). Production
/// passes none: each costs one `Option` check per sync job.
#[derive(Clone, Default)]
pub struct NodeHooks {
    /// Runs every sync of every shard's log instead of `fdatasync` (it is given the
    /// segment file, its path and the length the sync must cover): a test holds a
    /// sync to observe that nothing is acknowledged meanwhile, fails it to see a
    /// disk error, or records it to simulate a power cut.
    pub log_sync: Option<Arc<dyn SyncHook>>,
}

/// Jobs queued per shard: one in flight, by contract.
const JOBS_IN_FLIGHT_MAX: usize = 1;

/// What the thread hands back: the ticket of the job that ended and its result.
struct Done {
    ticket: AtomicU64,
    result: Mutex<Option<(u64, std::io::Result<()>)>>,
}

/// The shard's side.
pub struct LogSyncer {
    jobs: SyncSender<(u64, SyncJob)>,
    done: Arc<Done>,
    next_ticket: u64,
    in_flight: Option<u64>,
}

/// The thread's side, until [`SyncThread::spawn`] starts it.
pub struct SyncThread {
    jobs: Receiver<(u64, SyncJob)>,
    done: Arc<Done>,
}

/// A syncer pair for one shard.
pub fn pair() -> (LogSyncer, SyncThread) {
    let (tx, rx) = std::sync::mpsc::sync_channel(JOBS_IN_FLIGHT_MAX);
    let done = Arc::new(Done {
        ticket: AtomicU64::new(0),
        result: Mutex::new(None),
    });
    (
        LogSyncer {
            jobs: tx,
            done: done.clone(),
            next_ticket: 1,
            in_flight: None,
        },
        SyncThread { jobs: rx, done },
    )
}

impl LogSyncer {
    /// Whether a job is in flight (no other may be submitted).
    pub fn busy(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Hands `job` to the thread; if the thread is gone, runs it here and returns
    /// its result at once (`Some`).
    pub fn submit(&mut self, job: SyncJob) -> Option<std::io::Result<()>> {
        assert!(self.in_flight.is_none(), "one sync job in flight per shard");
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        match self.jobs.try_send((ticket, job)) {
            Ok(()) => {
                self.in_flight = Some(ticket);
                None
            }
            Err(TrySendError::Full((_, job)) | TrySendError::Disconnected((_, job))) => {
                Some(job.run())
            }
        }
    }

    /// The result of the job in flight, once it ended.
    pub fn poll_done(&mut self) -> Option<std::io::Result<()>> {
        let ticket = self.in_flight?;
        if self.done.ticket.load(Ordering::Acquire) < ticket {
            return None;
        }
        let (done_ticket, result) = self
            .done
            .result
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()?;
        debug_assert_eq!(done_ticket, ticket);
        self.in_flight = None;
        Some(result)
    }
}

impl SyncThread {
    /// Starts the thread; it ends when the shard drops its [`LogSyncer`].
    pub fn spawn(
        self,
        shard: usize,
        wake: Injector<Msg>,
    ) -> std::io::Result<std::thread::JoinHandle<()>> {
        std::thread::Builder::new()
            .name(format!("imrouter-sync-{shard}"))
            .spawn(move || {
                for (ticket, job) in self.jobs {
                    // The result is handed back as soon as the sync ended; the job's
                    // file work (the next segment, retired segments) follows here.
                    job.run_then(|result| {
                        *self.done.result.lock().unwrap_or_else(|e| e.into_inner()) =
                            Some((ticket, result));
                        self.done.ticket.store(ticket, Ordering::Release);
                        // Only a wake-up: the shard also checks `done` on every turn, so
                        // a full injector queue (the shard is awake then) loses nothing.
                        let _ = wake.send(Msg::LogSynced);
                    });
                }
            })
    }
}
