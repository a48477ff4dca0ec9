//! `imrouter check-host`: does this machine suit the configured load?
//!
//! Two halves:
//! - [`evaluate`] is the decision, sans-IO: what the configuration asks ([`Load`],
//!   computed from a [`Config`] by [`Load::from_config`]) and what the host offers
//!   ([`HostFacts`]) in, one [`Finding`] per setting out (value, recommended value,
//!   why, [`Severity`]). It reads nothing, so its tests use hand-made facts.
//! - [`HostFacts::read`] is the thin reader of `/proc` and `/sys` (and one io_uring
//!   setup, the probe the `auto` backend makes at start). It is tolerant: a file
//!   that is missing or unparsable becomes `None` ("unknown"), never a panic or an
//!   error. The process scan is bounded by [`PROC_SCAN_MAX`].
//!
//! Guarantees: a [`Severity::Fail`] finding means the node, started with this
//! configuration on this host, would not carry the configured load (fewer
//! descriptors than the configured connections need; io_uring required by `backend
//! = "uring"` but refused). Everything that only costs latency (no isolation, a
//! power-saving governor, THP `always`, guest halt polling off, another process on a shard's core, a
//! backlog truncated by `somaxconn`) is a [`Severity::Warn`]. [`render`] prints the
//! findings as one aligned table, [`verdict`] as one line; the binary exits 1 when
//! [`failed`] is true.

use crate::config::Config;
use net::io::Backend;

/// Processes `/proc` is scanned for (the first ones in directory order); the rest
/// are not looked at (the finding says so).
pub const PROC_SCAN_MAX: usize = 4096;
/// CPUs a parsed CPU list may name; larger lists are cut there.
pub const CPU_LIST_MAX: usize = 4096;
/// Processes named in the "other processes" finding's value.
pub const PROCESSES_SHOWN_MAX: usize = 3;

/// How much a finding matters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    /// As recommended.
    Ok,
    /// Unknown or not applicable: nothing to do.
    Info,
    /// Costs latency or throughput; the node still carries the load.
    Warn,
    /// The node would not carry the configured load.
    Fail,
}

impl Severity {
    /// The word printed in the table's STATUS column.
    pub fn label(self) -> &'static str {
        match self {
            Severity::Ok => "ok",
            Severity::Info => "info",
            Severity::Warn => "WARN",
            Severity::Fail => "FAIL",
        }
    }
}

/// One setting of the host, judged against the configured load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// The setting (a sysctl name, a file, a limit).
    pub name: &'static str,
    /// Its value on this host ("unknown" when it could not be read).
    pub value: String,
    /// What the configured load wants.
    pub recommended: String,
    /// Why it matters (and what the node does about it).
    pub why: String,
    pub severity: Severity,
}

/// What the configuration asks of the host. Computed from the configuration only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Load {
    /// Shard threads.
    pub shards: u64,
    /// `[net] connections_per_shard_max`.
    pub connections_per_shard: u64,
    /// Whether the configuration sets it: a cap the limit cannot hold is then
    /// refused at start; the default one is lowered to fit, with a warning.
    pub connection_cap_set: bool,
    /// Descriptors kept besides connections: `[net] fd_reserve` + shards ×
    /// `fd_per_shard` (log segments, listeners, accepts in flight, links, rings).
    pub fd_reserve: u64,
    /// `[net] listen_backlog`.
    pub listen_backlog: u64,
    /// `[net] backend`.
    pub backend: Backend,
    /// The core of shard `i` (`[runtime] pin_cores[i % len]`); empty: not pinned.
    pub shard_cores: Vec<usize>,
    /// The `wss://` listener's certificate (`[tls] cert_file`, loaded), with
    /// `[listen] wss_addr` only.
    pub tls_cert: Option<TlsCert>,
}

/// The `wss://` certificate as the configuration loads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsCert {
    /// `[tls] cert_file`.
    pub cert_file: String,
    /// Seconds from the check until its notAfter (negative: expired).
    pub expires_in_s: i64,
}

/// A wss certificate with less than this left is a warning in `check-host`.
pub const TLS_CERT_WARN_S: i64 = 14 * 86_400;

impl Load {
    /// The load `config` describes; the error of an invalid configuration.
    pub fn from_config(config: &Config) -> Result<Load, String> {
        let node = config.to_node_config()?;
        let shards = u64::from(node.runtime.shard_count.max(1));
        let pins = &node.runtime.pin_cores;
        let shard_cores = if pins.is_empty() {
            Vec::new()
        } else {
            (0..shards as usize).map(|i| pins[i % pins.len()]).collect()
        };
        Ok(Load {
            shards,
            connections_per_shard: node.net.connections_per_shard_max as u64,
            connection_cap_set: node.connection_cap_set,
            fd_reserve: node.net.fd_reserve as u64 + shards * crate::node::fd_per_shard(&node),
            listen_backlog: node.net.listen_backlog.max(0) as u64,
            backend: node.net.backend,
            shard_cores,
            tls_cert: node.tls.as_ref().map(|t| TlsCert {
                cert_file: t.config().cert_file.display().to_string(),
                expires_in_s: t.expires_in_s(crate::config::unix_now()),
            }),
        })
    }

    /// Descriptors the configured load needs: every shard's connections plus the
    /// reserve.
    pub fn fds_needed(&self) -> u64 {
        self.shards
            .saturating_mul(self.connections_per_shard)
            .saturating_add(self.fd_reserve)
    }

    /// The distinct cores the shards pin to, ascending.
    pub fn distinct_cores(&self) -> Vec<usize> {
        let mut cores = self.shard_cores.clone();
        cores.sort_unstable();
        cores.dedup();
        cores
    }
}

/// One process seen in `/proc` (its main thread).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessCpu {
    pub pid: u32,
    /// `comm`, the executable's name as the kernel keeps it.
    pub comm: String,
    /// State `R` (running or runnable).
    pub running: bool,
    /// The CPU it last ran on (`/proc/PID/stat` field 39).
    pub last_cpu: Option<usize>,
    /// `Cpus_allowed_list` of `/proc/PID/status`.
    pub allowed: Option<Vec<usize>>,
}

/// What the host offers. `None` everywhere means "could not be read".
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostFacts {
    /// `RLIMIT_NOFILE` (soft, hard); `u64::MAX` is unlimited.
    pub nofile: Option<(u64, u64)>,
    /// `fs.nr_open`: the most a hard limit can be raised to.
    pub nr_open: Option<u64>,
    /// `net.core.somaxconn`.
    pub somaxconn: Option<u64>,
    /// `kernel.io_uring_disabled` (0 allowed, 1 only for `io_uring_group`, 2 never);
    /// `None` on kernels without the sysctl.
    pub io_uring_disabled: Option<u64>,
    /// Setting up an io_uring driver with the configured `[net]` sizes: `Ok`, or the
    /// kernel's refusal. `None`: not tried.
    pub uring_probe: Option<Result<(), String>>,
    /// Online CPUs.
    pub online_cpus: Option<Vec<usize>>,
    /// CPUs this process may run on (`Cpus_allowed_list`, e.g. a cgroup cpuset).
    pub allowed_cpus: Option<Vec<usize>>,
    /// `/sys/devices/system/cpu/isolated` (`isolcpus=`).
    pub isolated: Option<Vec<usize>>,
    /// `/sys/devices/system/cpu/nohz_full`.
    pub nohz_full: Option<Vec<usize>>,
    /// `/proc/cmdline`.
    pub cmdline: Option<String>,
    /// `scaling_governor` of each shard core (`None`: no cpufreq for it).
    pub governors: Vec<(usize, Option<String>)>,
    /// The selected mode of `/sys/kernel/mm/transparent_hugepage/enabled`.
    pub thp_enabled: Option<String>,
    /// `/sys/devices/system/cpu/cpuidle/current_driver` (`haltpoll` in a KVM guest
    /// with guest halt polling, `intel_idle`, `acpi_idle`, …).
    pub cpuidle_driver: Option<String>,
    /// `/sys/module/haltpoll/parameters/guest_halt_poll_ns`: how long an idle vCPU
    /// polls before it halts into the hypervisor.
    pub guest_halt_poll_ns: Option<u64>,
    /// Other processes (not this one); `None` when `/proc` could not be listed.
    pub processes: Option<Vec<ProcessCpu>>,
    /// Whether the scan stopped at [`PROC_SCAN_MAX`].
    pub processes_truncated: bool,
}

/// Every finding for `load` on a host with `facts`, in table order.
pub fn evaluate(load: &Load, facts: &HostFacts) -> Vec<Finding> {
    let mut findings = vec![
        open_files(load, facts),
        nr_open(load, facts),
        somaxconn(load, facts),
        io_uring(load, facts),
        shard_cores(load, facts),
        isolation(load, facts),
        governor(load, facts),
        transparent_huge_pages(facts),
        idle_wakeups(facts),
        other_processes(load, facts),
    ];
    findings.extend(load.tls_cert.as_ref().map(tls_certificate));
    findings
}

/// The `wss://` certificate's expiry: expired fails (every wss handshake is refused
/// by the clients), less than [`TLS_CERT_WARN_S`] left warns.
pub fn tls_certificate(cert: &TlsCert) -> Finding {
    const NAME: &str = "wss certificate ([tls] cert_file)";
    let left = cert.expires_in_s;
    let value = if left < 0 {
        format!("{}: expired {} days ago", cert.cert_file, -left / 86_400)
    } else {
        format!("{}: expires in {} days", cert.cert_file, left / 86_400)
    };
    let recommended = format!("more than {} days left", TLS_CERT_WARN_S / 86_400);
    let renew = "renew it, write the files, then `kill -HUP` the node (connections stay)";
    if left <= 0 {
        finding(
            NAME,
            value,
            recommended,
            Severity::Fail,
            format!("clients refuse an expired certificate: no wss client can connect; {renew}"),
        )
    } else if left < TLS_CERT_WARN_S {
        finding(
            NAME,
            value,
            recommended,
            Severity::Warn,
            format!("the certificate expires soon; {renew}"),
        )
    } else {
        finding(
            NAME,
            value,
            recommended,
            Severity::Ok,
            "valid (imrouter_tls_cert_expiry_seconds tracks it)",
        )
    }
}

/// Whether any finding says the configured load would not be carried.
pub fn failed(findings: &[Finding]) -> bool {
    findings.iter().any(|f| f.severity == Severity::Fail)
}

fn finding(
    name: &'static str,
    value: impl Into<String>,
    recommended: impl Into<String>,
    severity: Severity,
    why: impl Into<String>,
) -> Finding {
    Finding {
        name,
        value: value.into(),
        recommended: recommended.into(),
        why: why.into(),
        severity,
    }
}

fn show_limit(v: u64) -> String {
    if v == u64::MAX {
        "unlimited".into()
    } else {
        v.to_string()
    }
}

/// What the node raises its soft limit to at start: the hard limit, or `fs.nr_open`
/// when the hard limit is unlimited (as `net::io::fd::raisable_limit`).
fn raisable(soft: u64, hard: u64, nr_open: Option<u64>) -> u64 {
    let raised = if hard == u64::MAX {
        nr_open.unwrap_or(1 << 20)
    } else {
        hard
    };
    raised.max(soft)
}

fn open_files(load: &Load, facts: &HostFacts) -> Finding {
    const NAME: &str = "open files (RLIMIT_NOFILE)";
    let need = load.fds_needed();
    let recommended = format!("hard >= {need} (LimitNOFILE={need})");
    let Some((soft, hard)) = facts.nofile else {
        return finding(
            NAME,
            "unknown",
            recommended,
            Severity::Warn,
            "getrlimit failed: the connections the limit allows are unknown",
        );
    };
    let value = format!("soft {}, hard {}", show_limit(soft), show_limit(hard));
    let limit = raisable(soft, hard, facts.nr_open);
    let b = net::io::fd::plan(
        limit,
        load.fd_reserve,
        load.shards,
        load.connections_per_shard,
    );
    let sizing = format!(
        "{} shards x {} connections + {} reserved",
        load.shards, load.connections_per_shard, load.fd_reserve
    );
    if b.over_committed() && load.connection_cap_set {
        let why = format!(
            "{sizing} = {need} > {limit}: the node refuses to start (raise the hard \
             limit, or lower [net] connections_per_shard_max to at most {})",
            b.per_shard_cap
        );
        return finding(NAME, value, recommended, Severity::Fail, why);
    }
    if b.over_committed() {
        let why = format!(
            "{sizing} = {need} > {limit}: the node lowers each shard's connection cap \
             (default {}) to {} (raise the hard limit to keep the default)",
            load.connections_per_shard, b.per_shard_cap
        );
        return finding(NAME, value, recommended, Severity::Warn, why);
    }
    let raised = if soft < need {
        format!("; the node raises the soft limit to {limit} at start")
    } else {
        String::new()
    };
    let why = format!("{sizing} = {need} fit{raised}");
    finding(NAME, value, recommended, Severity::Ok, why)
}

fn nr_open(load: &Load, facts: &HostFacts) -> Finding {
    const NAME: &str = "fs.nr_open";
    let need = load.fds_needed();
    let recommended = format!(">= {need}");
    match facts.nr_open {
        None => finding(
            NAME,
            "unknown",
            recommended,
            Severity::Info,
            "the ceiling of any hard RLIMIT_NOFILE; could not be read",
        ),
        Some(v) if v < need => finding(
            NAME,
            v.to_string(),
            recommended,
            Severity::Warn,
            "the ceiling of any hard RLIMIT_NOFILE: LimitNOFILE cannot be raised to what \
             the configured connections need without raising it (sysctl drop-in)",
        ),
        Some(v) => finding(
            NAME,
            v.to_string(),
            recommended,
            Severity::Ok,
            "the ceiling of any hard RLIMIT_NOFILE: high enough for LimitNOFILE",
        ),
    }
}

fn somaxconn(load: &Load, facts: &HostFacts) -> Finding {
    const NAME: &str = "net.core.somaxconn";
    let recommended = format!(">= {} ([net] listen_backlog)", load.listen_backlog);
    match facts.somaxconn {
        None => finding(
            NAME,
            "unknown",
            recommended,
            Severity::Info,
            "the kernel caps every listen backlog at it; could not be read",
        ),
        Some(v) if v < load.listen_backlog => finding(
            NAME,
            v.to_string(),
            recommended,
            Severity::Warn,
            format!(
                "the kernel cuts the listen backlog to {v}: a reconnect storm \
                     (clients of a drained node) overflows the accept queue, SYNs are \
                     dropped and clients retry seconds later"
            ),
        ),
        Some(v) => finding(
            NAME,
            v.to_string(),
            recommended,
            Severity::Ok,
            "the listen backlog is used in full",
        ),
    }
}

fn io_uring(load: &Load, facts: &HostFacts) -> Finding {
    const NAME: &str = "io_uring";
    let disabled = facts
        .io_uring_disabled
        .map_or("io_uring_disabled unknown".to_string(), |v| {
            format!("io_uring_disabled={v}")
        });
    let (works, probe) = match &facts.uring_probe {
        Some(Ok(())) => (Some(true), "ring set up".to_string()),
        Some(Err(e)) => (Some(false), format!("refused: {e}")),
        None => (None, "not probed".to_string()),
    };
    // The sysctl alone decides only when the probe was not made.
    let works = works.or(match facts.io_uring_disabled {
        Some(2) => Some(false),
        _ => None,
    });
    let value = format!("{disabled}; {probe}");
    let recommended = "io_uring_disabled=0 and a ring sets up";
    let (severity, why) = match (load.backend, works) {
        (_, Some(true)) => (
            Severity::Ok,
            "the io_uring backend runs (one submit per loop turn)",
        ),
        (Backend::Uring, Some(false)) => (
            Severity::Fail,
            "[net] backend = \"uring\" (--io uring) needs it: the shards would not start",
        ),
        (Backend::Auto, Some(false)) => (
            Severity::Warn,
            "backend auto falls back to mio (epoll): a syscall per read and write",
        ),
        (Backend::Mio, Some(false)) => (Severity::Info, "not used: backend mio"),
        (_, None) => (
            Severity::Warn,
            "could not tell whether a ring can be set up",
        ),
    };
    finding(NAME, value, recommended, severity, why)
}

/// `0-3,8,10-11` → `[0, 1, 2, 3, 8, 10, 11]`; tokens that are not numbers or ranges
/// (the flags of `isolcpus=`) are skipped. At most [`CPU_LIST_MAX`] CPUs.
pub fn parse_cpu_list(text: &str) -> Vec<usize> {
    let mut cpus = Vec::new();
    for token in text.trim().split(',') {
        let token = token.split(':').next().unwrap_or("");
        let (lo, hi) = match token.split_once('-') {
            Some((a, b)) => (a.trim().parse::<usize>(), b.trim().parse::<usize>()),
            None => (token.trim().parse(), token.trim().parse()),
        };
        if let (Ok(lo), Ok(hi)) = (lo, hi) {
            for cpu in lo..=hi.min(lo + CPU_LIST_MAX) {
                if cpus.len() == CPU_LIST_MAX {
                    return cpus;
                }
                cpus.push(cpu);
            }
        }
    }
    cpus.sort_unstable();
    cpus.dedup();
    cpus
}

/// `[0, 1, 2, 5]` → `0-2,5`.
pub fn show_cpu_list(cpus: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(",")
    }
}

/// The CPU list of kernel parameter `key` (`isolcpus`, `nohz_full`) in `cmdline`.
fn cmdline_cpus(cmdline: Option<&str>, key: &str) -> Vec<usize> {
    cmdline
        .into_iter()
        .flat_map(str::split_whitespace)
        .filter_map(|arg| arg.strip_prefix(key)?.strip_prefix('='))
        .flat_map(parse_cpu_list)
        .collect()
}

fn shard_cores(load: &Load, facts: &HostFacts) -> Finding {
    const NAME: &str = "shard cores ([runtime] pin_cores)";
    let recommended = "one core per shard, no interrupts on it";
    if load.shard_cores.is_empty() {
        return finding(
            NAME,
            format!("not pinned ({} shards)", load.shards),
            recommended,
            Severity::Warn,
            "pin_cores is empty: the scheduler moves shard threads between \
             cores (cold caches, a shard queued behind other work)",
        );
    }
    let cores = load.distinct_cores();
    let value = format!("{} ({} shards)", show_cpu_list(&cores), load.shards);
    let usable = facts.allowed_cpus.as_ref().or(facts.online_cpus.as_ref());
    let missing: Vec<usize> = match usable {
        Some(ok) => cores.iter().copied().filter(|c| !ok.contains(c)).collect(),
        None => Vec::new(),
    };
    if !missing.is_empty() {
        let why = format!(
            "cores {} are offline or outside this process's cpuset: those \
            shards run unpinned",
            show_cpu_list(&missing)
        );
        return finding(NAME, value, recommended, Severity::Warn, why);
    }
    if cores.len() < load.shard_cores.len() {
        return finding(
            NAME,
            value,
            recommended,
            Severity::Warn,
            "more shards than pin_cores: shards share a core and wait for each other",
        );
    }
    if let Some(online) = facts.online_cpus.as_ref().filter(|o| o.len() > 1) {
        if online.iter().all(|c| cores.contains(c)) {
            return finding(
                NAME,
                value,
                recommended,
                Severity::Warn,
                "the shards take every online core: interrupts and housekeeping run on \
                 them too; leave one out (e.g. pin_cores without core 0, shards one fewer)",
            );
        }
    }
    let why = match usable {
        Some(_) => {
            "each shard has a core of its own; keep interrupts off them \
                    (irqaffinity=, /proc/irq/*/smp_affinity)"
        }
        None => "each shard has a core of its own (online CPUs unknown)",
    };
    finding(NAME, value, recommended, Severity::Ok, why)
}

fn isolation(load: &Load, facts: &HostFacts) -> Finding {
    const NAME: &str = "core isolation (isolcpus, nohz_full)";
    let cores = load.distinct_cores();
    let mut isolated = facts.isolated.clone().unwrap_or_default();
    isolated.extend(cmdline_cpus(facts.cmdline.as_deref(), "isolcpus"));
    let mut nohz = facts.nohz_full.clone().unwrap_or_default();
    nohz.extend(cmdline_cpus(facts.cmdline.as_deref(), "nohz_full"));
    isolated.sort_unstable();
    isolated.dedup();
    nohz.sort_unstable();
    nohz.dedup();
    let value = format!(
        "isolated {}; nohz_full {}",
        show_cpu_list(&isolated),
        show_cpu_list(&nohz)
    );
    if cores.is_empty() {
        return finding(
            NAME,
            value,
            "pin the shards first",
            Severity::Info,
            "the shards are not pinned, so isolation does not apply",
        );
    }
    let list = show_cpu_list(&cores);
    let recommended = format!("isolcpus={list} nohz_full={list}");
    if facts.isolated.is_none() && facts.cmdline.is_none() {
        return finding(
            NAME,
            "unknown",
            recommended,
            Severity::Info,
            "neither /sys/devices/system/cpu/isolated nor /proc/cmdline could be read",
        );
    }
    let not_isolated: Vec<usize> = cores
        .iter()
        .copied()
        .filter(|c| !isolated.contains(c))
        .collect();
    let ticking: Vec<usize> = cores
        .iter()
        .copied()
        .filter(|c| !nohz.contains(c))
        .collect();
    if not_isolated.is_empty() && ticking.is_empty() {
        return finding(
            NAME,
            value,
            recommended,
            Severity::Ok,
            "the scheduler keeps other work off the shard cores and their tick stops",
        );
    }
    let why = format!(
        "cores {} not isolated, {} with a scheduler tick: other threads and the tick \
         interrupt a shard mid-turn (tail latency)",
        show_cpu_list(&not_isolated),
        show_cpu_list(&ticking)
    );
    finding(NAME, value, recommended, Severity::Warn, why)
}

fn governor(load: &Load, facts: &HostFacts) -> Finding {
    const NAME: &str = "cpu frequency governor";
    let recommended = "performance";
    if load.shard_cores.is_empty() || facts.governors.is_empty() {
        return finding(
            NAME,
            "not read",
            recommended,
            Severity::Info,
            "read for the shard cores only; the shards are not pinned",
        );
    }
    let value = facts
        .governors
        .iter()
        .map(|(cpu, g)| format!("cpu{cpu} {}", g.as_deref().unwrap_or("absent")))
        .collect::<Vec<_>>()
        .join(", ");
    let slow: Vec<usize> = facts
        .governors
        .iter()
        .filter(|(_, g)| g.as_deref().is_some_and(|g| g != "performance"))
        .map(|(cpu, _)| *cpu)
        .collect();
    if !slow.is_empty() {
        let why = format!(
            "cores {} scale their clock down when idle: the first \
            messages after a pause are slow (cpupower frequency-set -g performance)",
            show_cpu_list(&slow)
        );
        return finding(NAME, value, recommended, Severity::Warn, why);
    }
    if facts.governors.iter().all(|(_, g)| g.is_some()) {
        return finding(
            NAME,
            value,
            recommended,
            Severity::Ok,
            "the shard cores run at full clock",
        );
    }
    finding(
        NAME,
        value,
        recommended,
        Severity::Info,
        "no cpufreq for some shard cores (a VM, or no driver): the firmware or hypervisor \
         sets the clock",
    )
}

fn transparent_huge_pages(facts: &HostFacts) -> Finding {
    const NAME: &str = "transparent huge pages";
    let recommended = "madvise or never";
    match facts.thp_enabled.as_deref() {
        None => finding(
            NAME,
            "unknown",
            recommended,
            Severity::Info,
            "/sys/kernel/mm/transparent_hugepage/enabled could not be read",
        ),
        Some("always") => finding(
            NAME,
            "always",
            recommended,
            Severity::Warn,
            "every allocation may stall on compaction and khugepaged rewrites memory \
             behind the shards: latency spikes",
        ),
        Some(mode) => finding(
            NAME,
            mode,
            recommended,
            Severity::Ok,
            "huge pages only where asked for: no compaction stalls",
        ),
    }
}

/// How an idle CPU waits for work: each message for a parked shard (and each reply
/// for a parked client) wakes one. In a KVM guest whose cpuidle driver is `haltpoll`
/// with `guest_halt_poll_ns` 0, an idle vCPU halts into the hypervisor at once and
/// every wake-up pays the exit and re-entry. On the project's VM (2026-12-03) 200 µs
/// of polling moved the loopback echo floor p50 from 63 to 13 µs and person RECV
/// p50 from 74 to 51 µs (`--shards 1`; 93 to 62 µs with 2 shards), at the cost of
/// host CPU spent polling while idle.
fn idle_wakeups(facts: &HostFacts) -> Finding {
    const NAME: &str = "idle vCPU wake-ups";
    match (facts.cpuidle_driver.as_deref(), facts.guest_halt_poll_ns) {
        (Some("haltpoll"), Some(0)) => finding(
            NAME,
            "haltpoll, guest_halt_poll_ns 0",
            "guest_halt_poll_ns 200000",
            Severity::Warn,
            "an idle vCPU halts into the hypervisor at once: every wake of a parked \
             shard pays a VM exit (echo floor p50 63 µs against 13 µs with polling, \
             measured): echo 200000 > /sys/module/haltpoll/parameters/guest_halt_poll_ns \
             (costs host CPU while idle)",
        ),
        (Some("haltpoll"), Some(ns)) => finding(
            NAME,
            format!("haltpoll, guest_halt_poll_ns {ns}"),
            "guest_halt_poll_ns 200000",
            Severity::Ok,
            "an idle vCPU polls before it halts: a wake-up soon after a park is cheap",
        ),
        (Some(driver), _) => finding(
            NAME,
            driver,
            "shallow idle states",
            Severity::Info,
            "deep C-states add exit latency to every wake-up of a parked shard; for the \
             lowest latency limit them (`cpupower idle-set -D 10`, or tuned's \
             latency-performance profile)",
        ),
        (None, _) => finding(
            NAME,
            "unknown",
            "shallow idle states",
            Severity::Info,
            "/sys/devices/system/cpu/cpuidle/current_driver could not be read",
        ),
    }
}

/// Whether `p` is pinned (allowed on fewer CPUs than are online) to a shard core, or
/// running on one now.
fn shares_core(p: &ProcessCpu, cores: &[usize], online: Option<&Vec<usize>>) -> Option<String> {
    let pinned = p.allowed.as_ref().filter(|a| {
        online.is_some_and(|o| a.len() < o.len()) && a.iter().any(|c| cores.contains(c))
    });
    if let Some(allowed) = pinned {
        return Some(format!(
            "{} ({}) pinned to {}",
            p.pid,
            p.comm,
            show_cpu_list(allowed)
        ));
    }
    match p.last_cpu {
        Some(cpu) if p.running && cores.contains(&cpu) => {
            Some(format!("{} ({}) running on {cpu}", p.pid, p.comm))
        }
        _ => None,
    }
}

fn other_processes(load: &Load, facts: &HostFacts) -> Finding {
    const NAME: &str = "other processes on shard cores";
    let recommended = "none";
    let cores = load.distinct_cores();
    if cores.is_empty() {
        return finding(
            NAME,
            "not checked",
            recommended,
            Severity::Info,
            "the shards are not pinned",
        );
    }
    let Some(processes) = &facts.processes else {
        return finding(
            NAME,
            "unknown",
            recommended,
            Severity::Info,
            "/proc could not be listed",
        );
    };
    let seen: Vec<String> = processes
        .iter()
        .filter_map(|p| shares_core(p, &cores, facts.online_cpus.as_ref()))
        .collect();
    let scanned = if facts.processes_truncated {
        format!(" (first {PROC_SCAN_MAX} processes scanned)")
    } else {
        String::new()
    };
    if seen.is_empty() {
        return finding(
            NAME,
            "none",
            recommended,
            Severity::Ok,
            format!("no other process is pinned to or running on them{scanned}"),
        );
    }
    let mut value = seen
        .iter()
        .take(PROCESSES_SHOWN_MAX)
        .cloned()
        .collect::<Vec<_>>()
        .join("; ");
    if seen.len() > PROCESSES_SHOWN_MAX {
        value.push_str(&format!("; {} more", seen.len() - PROCESSES_SHOWN_MAX));
    }
    finding(
        NAME,
        value,
        recommended,
        Severity::Warn,
        format!(
            "they take turns with a shard on its core (isolcpus= or a cpuset keeps them \
         off){scanned}"
        ),
    )
}

/// The findings as one table: SETTING, VALUE, RECOMMENDED, STATUS aligned, WHY last.
pub fn render(findings: &[Finding]) -> String {
    let head = ["SETTING", "VALUE", "RECOMMENDED", "STATUS"];
    let rows: Vec<[&str; 4]> = findings
        .iter()
        .map(|f| {
            [
                f.name,
                f.value.as_str(),
                f.recommended.as_str(),
                f.severity.label(),
            ]
        })
        .collect();
    let mut width = head.map(str::len);
    for row in &rows {
        for (w, cell) in width.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: [&str; 4], why: &str| {
        let mut out = String::new();
        for (cell, w) in cells.iter().zip(width) {
            out.push_str(&format!("{cell:<w$}  "));
        }
        out.push_str(why);
        out.push('\n');
        out
    };
    let mut out = line(head, "WHY");
    for (row, f) in rows.into_iter().zip(findings) {
        out.push_str(&line(row, &f.why));
    }
    out
}

/// One line: `FAIL` with the settings that break the load, or `OK`; the warnings
/// counted and named.
pub fn verdict(findings: &[Finding]) -> String {
    let names = |s: Severity| -> Vec<&str> {
        findings
            .iter()
            .filter(|f| f.severity == s)
            .map(|f| f.name)
            .collect()
    };
    let (fails, warns) = (names(Severity::Fail), names(Severity::Warn));
    let warnings = if warns.is_empty() {
        "no warnings".to_string()
    } else {
        format!("{} warning(s): {}", warns.len(), warns.join(", "))
    };
    if fails.is_empty() {
        format!("verdict: OK, this host carries the configured load ({warnings})")
    } else {
        format!(
            "verdict: FAIL, this host would not carry the configured load: {} ({warnings})",
            fails.join(", ")
        )
    }
}

/// The reader: `/proc`, `/sys`, `getrlimit` and one io_uring setup. Nothing here
/// fails: what cannot be read is `None`.
impl HostFacts {
    /// The facts [`evaluate`] needs for `load`; `net` sizes the io_uring probe (the
    /// configured `[net]`, as a shard would set up its driver).
    pub fn read(load: &Load, net: &net::io::NetConfig) -> HostFacts {
        let (processes, processes_truncated) = match read_processes() {
            Some((p, t)) => (Some(p), t),
            None => (None, false),
        };
        HostFacts {
            nofile: net::io::fd::nofile_limit().ok(),
            nr_open: read_number("/proc/sys/fs/nr_open"),
            somaxconn: read_number("/proc/sys/net/core/somaxconn"),
            io_uring_disabled: read_number("/proc/sys/kernel/io_uring_disabled"),
            uring_probe: Some(probe_uring(net)),
            online_cpus: read_cpus("/sys/devices/system/cpu/online"),
            allowed_cpus: read_text("/proc/self/status")
                .and_then(|s| status_field(&s, "Cpus_allowed_list").map(parse_cpu_list)),
            isolated: read_cpus("/sys/devices/system/cpu/isolated"),
            nohz_full: read_cpus("/sys/devices/system/cpu/nohz_full"),
            cmdline: read_text("/proc/cmdline").map(|s| s.trim().to_string()),
            governors: load
                .distinct_cores()
                .into_iter()
                .map(|cpu| {
                    let path = format!("/sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_governor");
                    (cpu, read_text(&path).map(|s| s.trim().to_string()))
                })
                .collect(),
            thp_enabled: read_text("/sys/kernel/mm/transparent_hugepage/enabled")
                .and_then(|s| selected_mode(&s)),
            cpuidle_driver: read_text("/sys/devices/system/cpu/cpuidle/current_driver")
                .map(|s| s.trim().to_string()),
            guest_halt_poll_ns: read_number("/sys/module/haltpoll/parameters/guest_halt_poll_ns"),
            processes,
            processes_truncated,
        }
    }
}

fn read_text(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

fn read_number(path: &str) -> Option<u64> {
    read_text(path)?.trim().parse().ok()
}

fn read_cpus(path: &str) -> Option<Vec<usize>> {
    read_text(path).map(|s| parse_cpu_list(&s))
}

/// The value of `key:` in a `/proc/PID/status` text.
fn status_field<'a>(status: &'a str, key: &str) -> Option<&'a str> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(str::trim)
}

/// `always [madvise] never` → `madvise`.
pub fn selected_mode(text: &str) -> Option<String> {
    let start = text.find('[')?;
    let end = start + text[start..].find(']')?;
    Some(text[start + 1..end].to_string())
}

/// Sets up (and drops) an io_uring driver as a shard with backend `uring` would:
/// the same ring flags and provided buffers, no listeners.
fn probe_uring(net: &net::io::NetConfig) -> Result<(), String> {
    let doorbell = shard::runtime::EventFd::new().map_err(|e| format!("eventfd: {e}"))?;
    let mut config = net.clone();
    config.backend = Backend::Uring;
    net::io::NetDriver::new(&config, std::sync::Arc::new(doorbell), Vec::new())
        .map(drop)
        .map_err(|e| e.to_string())
}

/// The fields of a `/proc/PID/stat` line that [`evaluate`] uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatLine {
    pub comm: String,
    /// State `R`.
    pub running: bool,
    /// Field 39: the CPU it last ran on.
    pub last_cpu: Option<usize>,
    /// `PF_KTHREAD` in field 9: a kernel thread (per-CPU ones are pinned by design).
    pub kernel_thread: bool,
}

/// Parses a `/proc/PID/stat` line after the `comm` field (which may hold spaces and
/// parentheses); `None` when it is not one.
pub fn parse_stat(stat: &str) -> Option<StatLine> {
    const PF_KTHREAD: u64 = 0x0020_0000;
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?.to_string();
    let rest: Vec<&str> = stat.get(close + 1..)?.split_whitespace().collect();
    // rest[0] is field 3 (state); field N is rest[N - 3].
    let flags: u64 = rest.get(6)?.parse().ok()?;
    Some(StatLine {
        comm,
        running: rest.first() == Some(&"R"),
        last_cpu: rest.get(36).and_then(|s| s.parse().ok()),
        kernel_thread: flags & PF_KTHREAD != 0,
    })
}

/// Every user-space process but this one (kernel threads are left out: the per-CPU
/// ones are pinned by design and the rest float), up to [`PROC_SCAN_MAX`] (and whether the scan
/// stopped there); `None` when `/proc` cannot be listed. Processes that exit during
/// the scan are skipped.
fn read_processes() -> Option<(Vec<ProcessCpu>, bool)> {
    let me = std::process::id();
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        if out.len() == PROC_SCAN_MAX {
            return Some((out, true));
        }
        let Some(stat) = read_text(&format!("/proc/{pid}/stat")).and_then(|s| parse_stat(&s))
        else {
            continue;
        };
        if stat.kernel_thread {
            continue;
        }
        let allowed = read_text(&format!("/proc/{pid}/status"))
            .and_then(|s| status_field(&s, "Cpus_allowed_list").map(parse_cpu_list));
        out.push(ProcessCpu {
            pid,
            comm: stat.comm,
            running: stat.running,
            last_cpu: stat.last_cpu,
            allowed,
        });
    }
    Some((out, false))
}
