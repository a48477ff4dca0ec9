//! The shard's doorbell wake mechanism: a non-blocking Linux `eventfd`.
//!
//! Producers write to it only when [`ring::Doorbell::should_wake`] says the shard
//! announced sleep, so a busy shard costs its peers no syscall. The IO driver waits on
//! the fd together with its sockets and drains it when it fires.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// A non-blocking, close-on-exec eventfd.
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// A new eventfd with counter 0.
    pub fn new() -> io::Result<Self> {
        // SAFETY: eventfd has no memory-safety preconditions; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a freshly created descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(EventFd { fd })
    }

    /// Adds 1 to the counter, waking a waiter. Never blocks (the counter cannot
    /// overflow in practice: it would take 2^64 - 1 writes without a drain).
    pub fn notify(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to an fd we own.
        let n = unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        debug_assert!(n == 8 || io::Error::last_os_error().kind() == io::ErrorKind::WouldBlock);
    }

    /// Resets the counter to 0; returns whether it was set.
    pub fn drain(&self) -> bool {
        let mut value: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from an fd we own.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), (&mut value as *mut u64).cast(), 8) };
        n == 8
    }

    /// Waits until the counter is non-zero or `timeout_ms` passed (`-1`: forever);
    /// then drains it. Returns whether it fired. Interrupted waits return `false`.
    pub fn wait(&self, timeout_ms: i32) -> io::Result<bool> {
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, count 1.
        let n = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        if n < 0 {
            let err = io::Error::last_os_error();
            return if err.kind() == io::ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(err)
            };
        }
        Ok(n > 0 && self.drain())
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notify_then_wait_fires_once() {
        let fd = EventFd::new().unwrap();
        assert!(!fd.wait(0).unwrap(), "a fresh eventfd is not readable");
        fd.notify();
        fd.notify();
        assert!(fd.wait(0).unwrap());
        assert!(!fd.wait(0).unwrap(), "wait drained both notifications");
        assert!(!fd.drain());
    }
}
