//! CPU and memory of processes and threads, read from `/proc` (Linux).

use std::time::Duration;

fn clk_tck() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// `(comm, utime + stime seconds)` from a `stat` file's text.
fn parse_stat(text: &str) -> Option<(String, f64)> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text.get(open + 1..close)?.to_string();
    let rest: Vec<&str> = text.get(close + 2..)?.split_whitespace().collect();
    // Fields after comm start at field 3 (state); utime is field 14, stime 15.
    let utime: f64 = rest.get(11)?.parse().ok()?;
    let stime: f64 = rest.get(12)?.parse().ok()?;
    Some((comm, (utime + stime) / clk_tck()))
}

/// CPU seconds (user + system) of process `pid`, all its threads.
pub fn process_cpu_s(pid: u32) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&text).map(|(_, s)| s)
}

/// Resident set size of process `pid` in bytes.
pub fn process_rss_bytes(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = text.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// CPU seconds of this process's threads whose name starts with `prefix` (e.g. the
/// embedded node's `imrouter-*` shard threads).
pub fn own_threads_cpu_s(prefix: &str) -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter_map(|t| parse_stat(&t))
        .filter(|(comm, _)| comm.starts_with(prefix))
        .map(|(_, s)| s)
        .sum()
}

/// CPU time of this whole process (getrusage, user + system).
pub fn self_cpu() -> Duration {
    // SAFETY: an all-zero rusage is a valid value of this plain C struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid `who` and a valid out pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Raises the soft open-files limit to the hard limit; returns the soft limit now.
pub fn raise_nofile() -> u64 {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: valid resource id and out pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } != 0 {
        return 1024;
    }
    if l.rlim_cur < l.rlim_max {
        let want = libc::rlimit {
            rlim_cur: l.rlim_max,
            rlim_max: l.rlim_max,
        };
        // SAFETY: valid resource id and a valid rlimit.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } == 0 {
            return want.rlim_cur;
        }
    }
    l.rlim_cur
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_spaces_in_comm() {
        let t = "123 (a b) c) S 1 2 3 4 5 6 7 8 9 10 200 100 0 0 20 0 1 0";
        let (comm, s) = parse_stat(t).unwrap();
        assert_eq!(comm, "a b) c");
        assert!((s - 300.0 / clk_tck()).abs() < 1e-9);
    }

    #[test]
    fn reads_own_process() {
        let pid = std::process::id();
        assert!(process_rss_bytes(pid).unwrap() > 0);
        assert!(process_cpu_s(pid).is_some());
    }
}
