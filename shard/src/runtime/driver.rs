//! The IO driver contract, and the plain driver for shards without sockets.
//!
//! A shard's loop never blocks anywhere but in [`Driver::poll`]: parking is one wait
//! in the driver (`io_uring_enter` for io_uring, `epoll_wait` for mio, `poll` for
//! [`PlainDriver`]) that covers the driver's sockets, the shard's doorbell eventfd
//! (messages from peer shards) and the next timer (the timeout). The `net` crate
//! implements this trait for its io_uring and mio backends.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::eventfd::EventFd;

/// One IO backend of one shard. Contract:
/// - [`Driver::poll`] with `Some(Duration::ZERO)` must not block; it collects what is
///   ready (and submits what was queued) and returns.
/// - With any other timeout it may block until IO is ready, the doorbell given at
///   construction fires, or the timeout passes (`None`: no timeout). It must wake
///   when the doorbell fires and must drain the doorbell (reset the eventfd counter)
///   when it saw it fire, so the next wait blocks again.
/// - Completed IO is appended to `events` as [`Driver::Event`]s, which the runtime
///   hands to the shard's handler after `poll` returns.
/// - Spurious returns (nothing ready) are allowed.
pub trait Driver {
    /// What completed IO looks like to the handler.
    type Event;

    /// Collects ready IO into `events`, waiting at most `timeout` (see the trait docs).
    fn poll(&mut self, timeout: Option<Duration>, events: &mut Vec<Self::Event>) -> io::Result<()>;

    /// `poll(Some(Duration::ZERO), events)` where `now` is the caller's clock reading
    /// from this turn: a driver that needs the time (to stamp arrivals, fire its own
    /// timers) uses it instead of reading the clock again. The runtime reads the
    /// clock once per turn and passes it here.
    fn poll_now(&mut self, now: Instant, events: &mut Vec<Self::Event>) -> io::Result<()> {
        let _ = now;
        self.poll(Some(Duration::ZERO), events)
    }
}

/// A driver without sockets: blocking polls wait on the doorbell alone.
#[derive(Debug)]
pub struct PlainDriver {
    doorbell: Arc<EventFd>,
    /// Blocking waits that returned because the doorbell fired.
    pub doorbell_wakes: u64,
}

impl PlainDriver {
    /// A driver that waits on `doorbell`.
    pub fn new(doorbell: Arc<EventFd>) -> Self {
        PlainDriver {
            doorbell,
            doorbell_wakes: 0,
        }
    }
}

impl Driver for PlainDriver {
    type Event = ();

    fn poll(&mut self, timeout: Option<Duration>, _events: &mut Vec<()>) -> io::Result<()> {
        let timeout_ms = match timeout {
            Some(d) if d.is_zero() => return Ok(()),
            // Round up, so a wait never ends before the timer it waits for is due.
            Some(d) => d.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32,
            None => -1,
        };
        debug_assert!(self.doorbell.as_raw_fd() >= 0);
        if self.doorbell.wait(timeout_ms)? {
            self.doorbell_wakes += 1;
        }
        Ok(())
    }
}
