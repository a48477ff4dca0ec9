//! The process's descriptor budget: `RLIMIT_NOFILE` raised to its hard limit, a
//! reserve kept for everything but client connections, the rest split between the
//! shards as their connection cap. [`plan`] is the decision (sans-IO); the other
//! functions read and set the limit.

use std::io;

/// How the descriptor limit is shared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FdBudget {
    /// The soft `RLIMIT_NOFILE` the budget is computed from.
    pub limit: u64,
    /// Descriptors kept out of the connection caps (`fd_reserve`).
    pub reserve: u64,
    /// Shards sharing the rest.
    pub shards: u64,
    /// The configured `connections_per_shard_max`.
    pub configured_cap: u64,
    /// The configured cap, or the shard's share of `limit - reserve` when that is
    /// lower (at least 1): the most the limit holds. The node refuses a start where
    /// it is lower than configured ([`FdBudget::over_committed`]).
    pub per_shard_cap: u64,
}

impl FdBudget {
    /// Whether the configuration asks for more connections than the limit allows.
    pub fn over_committed(&self) -> bool {
        self.per_shard_cap < self.configured_cap
    }

    /// Logs the budget at start; a warning with the numbers when the configured cap
    /// does not fit.
    pub fn log(&self) {
        if self.over_committed() {
            tracing::warn!(
                fd_limit = self.limit,
                fd_reserve = self.reserve,
                shards = self.shards,
                configured_connections_per_shard_max = self.configured_cap,
                per_shard_cap = self.per_shard_cap,
                "the descriptor limit allows fewer connections than configured: \
                 {} shards x {} + reserve {} > RLIMIT_NOFILE {}; each shard accepts {} \
                 (raise the hard limit, e.g. LimitNOFILE= in the service unit)",
                self.shards,
                self.configured_cap,
                self.reserve,
                self.limit,
                self.per_shard_cap,
            );
        } else {
            tracing::info!(
                fd_limit = self.limit,
                fd_reserve = self.reserve,
                shards = self.shards,
                per_shard_cap = self.per_shard_cap,
                "descriptor budget"
            );
        }
    }
}

/// The budget for `shards` shards under descriptor limit `limit`.
pub fn plan(limit: u64, reserve: u64, shards: u64, configured_cap: u64) -> FdBudget {
    let shards = shards.max(1);
    let share = limit.saturating_sub(reserve) / shards;
    FdBudget {
        limit,
        reserve,
        shards,
        configured_cap,
        per_shard_cap: configured_cap.min(share).max(1),
    }
}

/// The soft and hard `RLIMIT_NOFILE`.
pub fn nofile_limit() -> io::Result<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((lim.rlim_cur, lim.rlim_max))
}

/// What the soft limit can be raised to: the hard limit, or `fs.nr_open` when the
/// hard limit is unlimited.
pub fn raisable_limit(hard: u64) -> u64 {
    if hard == libc::RLIM_INFINITY {
        std::fs::read_to_string("/proc/sys/fs/nr_open")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(1 << 20)
    } else {
        hard
    }
}

/// Raises the soft `RLIMIT_NOFILE` to [`raisable_limit`]; returns the soft limit
/// before and after.
pub fn raise_nofile_limit() -> io::Result<(u64, u64)> {
    let (soft, hard) = nofile_limit()?;
    let target = raisable_limit(hard);
    if target <= soft {
        return Ok((soft, soft));
    }
    let lim = libc::rlimit {
        rlim_cur: target,
        rlim_max: hard,
    };
    // SAFETY: setrlimit reads the struct we pass.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((soft, target))
}

/// Grows the process's descriptor table now so that it holds descriptors below `n`
/// (at most the soft `RLIMIT_NOFILE`), instead of under load. The kernel grows the
/// table by doubling as descriptors are allocated, and in a multi-threaded process
/// each growth waits for an RCU grace period (`expand_files` → `synchronize_rcu`)
/// while every other thread allocating a descriptor (an accept, a socket) sleeps
/// with it: ~10 ms on the project's VM, seven times on the way to 10,000
/// connections, in the middle of a connect storm. The table never shrinks; it costs
/// 8 bytes per descriptor (rounded up to a power of two). Returns the table's size
/// afterwards ([`fd_table_size`]; `None` where `/proc` is not readable).
pub fn reserve_fd_table(n: u64) -> io::Result<Option<u64>> {
    let limit = nofile_limit()?.0;
    let highest = n.min(limit).min(i32::MAX as u64).saturating_sub(1);
    if highest > 0 && fd_table_size().is_none_or(|size| size <= highest) {
        // SAFETY: eventfd has no memory-safety preconditions; the result is checked.
        let probe = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if probe < 0 {
            return Err(io::Error::last_os_error());
        }
        // F_DUPFD takes the lowest free descriptor at or above `highest`: allocating
        // it grows the table to hold it.
        // SAFETY: fcntl on a descriptor we own; the result is checked.
        let dup = unsafe { libc::fcntl(probe, libc::F_DUPFD_CLOEXEC, highest as libc::c_int) };
        let err = io::Error::last_os_error();
        // SAFETY: closing the descriptors opened just above, which nothing else uses.
        unsafe {
            if dup >= 0 {
                libc::close(dup);
            }
            libc::close(probe);
        }
        if dup < 0 {
            return Err(err);
        }
    }
    Ok(fd_table_size())
}

/// The size of the process's descriptor table (`FDSize` in `/proc/self/status`).
pub fn fd_table_size() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("FDSize:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Descriptors the process has open now (`/proc/self/fd`, less the one reading it);
/// `None` if it cannot be read (e.g. out of descriptors).
pub fn open_fds() -> Option<u64> {
    let n = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
    Some(n.saturating_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserving_grows_the_descriptor_table_and_leaves_nothing_open() {
        let before = fd_table_size().expect("FDSize in /proc/self/status");
        let want = (before * 4).min(nofile_limit().unwrap().0);
        assert!(want > before, "the limit leaves no room to grow the table");
        let after = reserve_fd_table(want).unwrap().unwrap();
        assert!(after >= want, "table {after} < {want}");
        // The descriptor that grew the table is closed again.
        // SAFETY: F_GETFD only reads the descriptor's flags.
        let flags = unsafe { libc::fcntl((want - 1) as libc::c_int, libc::F_GETFD) };
        assert_eq!(flags, -1, "descriptor {} left open", want - 1);
        // Asking again, or for more than the limit, is harmless.
        assert_eq!(reserve_fd_table(want).unwrap(), Some(after));
        assert!(reserve_fd_table(u64::MAX).is_ok());
    }

    #[test]
    fn the_rest_of_the_limit_is_split_between_the_shards() {
        let b = plan(1024, 256, 2, 65_536);
        assert_eq!(b.per_shard_cap, 384);
        assert!(b.over_committed());
        let b = plan(1 << 20, 256, 2, 65_536);
        assert_eq!(b.per_shard_cap, 65_536, "never above the configured cap");
        assert!(!b.over_committed());
        assert_eq!(plan(100, 256, 2, 10).per_shard_cap, 1, "at least one");
        assert_eq!(plan(1000, 0, 0, 10_000).per_shard_cap, 1000);
    }

    #[test]
    fn the_soft_limit_rises_to_the_hard_one() {
        let (_, after) = raise_nofile_limit().unwrap();
        let (soft, hard) = nofile_limit().unwrap();
        assert_eq!(soft, after);
        assert_eq!(soft, raisable_limit(hard));
        assert!(open_fds().unwrap() >= 3);
    }
}
