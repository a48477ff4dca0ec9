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

#[cfg(test)]
mod tests {
    use super::*;

    fn poll(d: &mut PlainDriver, timeout: Option<Duration>) {
        d.poll(timeout, &mut Vec::new()).unwrap();
    }

    #[test]
    fn a_zero_timeout_never_waits_and_any_other_wakes_on_the_doorbell() {
        let bell = Arc::new(EventFd::new().unwrap());
        let mut d = PlainDriver::new(bell.clone());
        bell.notify();
        poll(&mut d, Some(Duration::ZERO));
        assert_eq!(
            d.doorbell_wakes, 0,
            "a zero timeout does not look at the doorbell"
        );
        // Rung: a wait of an hour returns at once, and drains it.
        poll(&mut d, Some(Duration::from_secs(3600)));
        assert_eq!(d.doorbell_wakes, 1);
        assert!(!bell.drain(), "the wait drained the doorbell");
        bell.notify();
        poll(&mut d, None);
        assert_eq!(d.doorbell_wakes, 2);
    }

    /// `poll(None)` waits with no timeout at all: the thread is seen in its `poll`
    /// with timeout -1, and it returns once the doorbell rings.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn a_poll_without_timeout_waits_until_the_doorbell() {
        use crate::runtime::eventfd::tests::{poll_timeout_of, thread_id};
        let bell = Arc::new(EventFd::new().unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        let parked = {
            let bell = bell.clone();
            std::thread::spawn(move || {
                let mut d = PlainDriver::new(bell);
                tx.send(thread_id()).unwrap();
                poll(&mut d, None);
                d.doorbell_wakes
            })
        };
        let tid = rx.recv().unwrap();
        // Wait for the condition (the thread in its poll), not for a duration.
        let timeout = loop {
            if let Some(t) = poll_timeout_of(tid) {
                break t;
            }
            assert!(
                !parked.is_finished(),
                "poll(None) returned without the doorbell"
            );
            std::thread::yield_now();
        };
        assert_eq!(timeout, -1);
        bell.notify();
        assert_eq!(parked.join().unwrap(), 1);
    }

    /// A driver that records its polls' timeouts and reports one event per poll.
    #[derive(Default)]
    struct Recorder {
        timeouts: Vec<Option<Duration>>,
    }

    impl Driver for Recorder {
        type Event = u8;

        fn poll(&mut self, timeout: Option<Duration>, events: &mut Vec<u8>) -> io::Result<()> {
            self.timeouts.push(timeout);
            events.push(7);
            Ok(())
        }
    }

    #[test]
    fn poll_now_is_a_poll_that_does_not_wait() {
        let mut r = Recorder::default();
        let mut events = Vec::new();
        r.poll_now(Instant::now(), &mut events).unwrap();
        assert_eq!(r.timeouts, [Some(Duration::ZERO)]);
        assert_eq!(events, [7]);
    }
}
