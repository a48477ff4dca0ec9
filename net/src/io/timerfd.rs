//! A CLOCK_MONOTONIC timerfd: ends an epoll wait at a deadline to the microsecond
//! (epoll's own timeout has millisecond granularity, which mio rounds up). Used by
//! the mio backend's [`NetDriver::poll_until`](super::NetDriver::poll_until) only;
//! the node's polls never create one.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// A non-blocking one-shot timer descriptor.
pub(crate) struct TimerFd(OwnedFd);

impl TimerFd {
    /// A disarmed timer.
    pub(crate) fn new() -> io::Result<TimerFd> {
        // SAFETY: a plain syscall without pointers; the result is checked below and
        // then owned.
        let fd = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        Ok(TimerFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Fires once `after` from now (zero is rounded up to 1 ns: zero would disarm).
    pub(crate) fn arm(&self, after: Duration) -> io::Result<()> {
        let after = after.max(Duration::from_nanos(1));
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: after.as_secs().min(libc::time_t::MAX as u64) as libc::time_t,
                tv_nsec: after.subsec_nanos() as libc::c_long,
            },
        };
        // SAFETY: a valid descriptor and a valid `itimerspec` that outlives the call;
        // the old value is not asked for (null).
        let r =
            unsafe { libc::timerfd_settime(self.0.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Reads the expiration count, so the descriptor stops being readable (nothing
    /// to read is fine).
    pub(crate) fn clear(&self) {
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into an 8-byte buffer that outlives the call;
        // EAGAIN (not expired) is ignored.
        unsafe { libc::read(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    }

    pub(crate) fn raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}
