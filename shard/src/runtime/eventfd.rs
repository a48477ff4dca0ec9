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
pub(super) mod tests {
    use super::*;

    /// The timeout argument of the `poll` that thread `tid` of this process is in, read
    /// from its `/proc` syscall line (the syscall number, then its arguments); `None`
    /// while it is in no `poll`. Lets a test see how a thread waits without timing it.
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn poll_timeout_of(tid: libc::pid_t) -> Option<i32> {
        let line = std::fs::read_to_string(format!("/proc/self/task/{tid}/syscall")).ok()?;
        let mut fields = line.split_whitespace();
        if fields.next()? != libc::SYS_poll.to_string() {
            return None;
        }
        let timeout = fields.nth(2)?.trim_start_matches("0x");
        // An int argument: its low 32 bits (-1 is 0xffffffffffffffff).
        Some(u64::from_str_radix(timeout, 16).ok()? as u32 as i32)
    }

    /// This thread's kernel id (for [`poll_timeout_of`]).
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn thread_id() -> libc::pid_t {
        // SAFETY: gettid has no preconditions.
        unsafe { libc::syscall(libc::SYS_gettid) as libc::pid_t }
    }

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

    #[test]
    fn its_fd_is_the_eventfd() {
        let fd = EventFd::new().unwrap();
        let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
        assert_eq!(link.to_str(), Some("anon_inode:[eventfd]"));
    }

    /// A signal that interrupts a wait ends it as "not fired", not as an error.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn an_interrupted_wait_returns_not_fired() {
        use std::os::unix::thread::JoinHandleExt;
        extern "C" fn ignore(_: libc::c_int) {}
        // SAFETY: installs a handler that does nothing for SIGUSR1 (which nothing
        // else here uses); the sigaction struct is zeroed and then filled.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = ignore as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigemptyset(&mut sa.sa_mask);
            assert_eq!(libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()), 0);
        }
        let fd = std::sync::Arc::new(EventFd::new().unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = {
            let fd = fd.clone();
            std::thread::spawn(move || {
                tx.send(thread_id()).unwrap();
                fd.wait(-1)
            })
        };
        let tid = rx.recv().unwrap();
        // Wait for the waiter to be in its poll (the condition, not a duration).
        while poll_timeout_of(tid).is_none() {
            std::thread::yield_now();
        }
        // SAFETY: the thread is alive (it is blocked in poll until a signal or a
        // notify, and nothing notifies).
        let sent = unsafe { libc::pthread_kill(waiter.as_pthread_t(), libc::SIGUSR1) };
        assert_eq!(sent, 0);
        assert!(!waiter.join().unwrap().unwrap());
    }
}
