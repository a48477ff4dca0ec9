//! `imrouter check-host`: the evaluator on hand-made facts (one test per finding,
//! each changing one fact of a host where everything is as recommended), the
//! parsers of the reader, and the binary on this machine (exit 0 for a load that
//! fits its descriptor limit, 1 for one that does not, 2 for an invalid file).

use std::path::Path;
use std::process::{Command, Output};

use engine::config::Config;
use engine::hostcheck::{
    evaluate, failed, parse_cpu_list, parse_stat, render, selected_mode, show_cpu_list, verdict,
    Finding, HostFacts, Load, ProcessCpu, Severity,
};
use net::io::Backend;

/// Two shards on cores 1 and 2 of four, 1,000 connections each (set by the user).
fn load() -> Load {
    Load {
        shards: 2,
        connections_per_shard: 1000,
        connection_cap_set: true,
        fd_reserve: 300,
        listen_backlog: 4096,
        backend: Backend::Auto,
        shard_cores: vec![1, 2],
        tls_cert: None,
    }
}

/// A host tuned as recommended for [`load`].
fn tuned() -> HostFacts {
    HostFacts {
        nofile: Some((1024, 1 << 20)),
        nr_open: Some(1 << 20),
        somaxconn: Some(4096),
        io_uring_disabled: Some(0),
        uring_probe: Some(Ok(())),
        online_cpus: Some(vec![0, 1, 2, 3]),
        allowed_cpus: Some(vec![0, 1, 2, 3]),
        isolated: Some(vec![1, 2]),
        nohz_full: Some(vec![1, 2]),
        cmdline: Some("quiet isolcpus=1-2 nohz_full=1-2".into()),
        governors: vec![
            (1, Some("performance".into())),
            (2, Some("performance".into())),
        ],
        thp_enabled: Some("madvise".into()),
        cpuidle_driver: Some("haltpoll".into()),
        guest_halt_poll_ns: Some(200_000),
        processes: Some(vec![process(
            1,
            "init",
            false,
            Some(0),
            Some(vec![0, 1, 2, 3]),
        )]),
        processes_truncated: false,
    }
}

fn process(
    pid: u32,
    comm: &str,
    running: bool,
    last_cpu: Option<usize>,
    allowed: Option<Vec<usize>>,
) -> ProcessCpu {
    ProcessCpu {
        pid,
        comm: comm.into(),
        running,
        last_cpu,
        allowed,
    }
}

/// The finding whose name starts with `prefix`.
fn find(findings: &[Finding], prefix: &str) -> Finding {
    findings
        .iter()
        .find(|f| f.name.starts_with(prefix))
        .unwrap_or_else(|| panic!("no finding {prefix}: {findings:#?}"))
        .clone()
}

fn judge(load: &Load, facts: &HostFacts, prefix: &str) -> Finding {
    find(&evaluate(load, facts), prefix)
}

#[test]
fn a_tuned_host_has_only_ok_findings() {
    let findings = evaluate(&load(), &tuned());
    assert_eq!(findings.len(), 10);
    for f in &findings {
        assert_eq!(f.severity, Severity::Ok, "{f:#?}");
    }
    assert!(!failed(&findings));
    assert_eq!(
        verdict(&findings),
        "verdict: OK, this host carries the configured load (no warnings)"
    );
}

#[test]
fn fewer_descriptors_than_the_connections_need_fail() {
    let l = load();
    assert_eq!(l.fds_needed(), 2300);
    let mut facts = tuned();
    facts.nofile = Some((1024, 2299));
    let f = judge(&l, &facts, "open files");
    assert_eq!(f.severity, Severity::Fail, "{f:#?}");
    assert_eq!(f.value, "soft 1024, hard 2299");
    assert_eq!(f.recommended, "hard >= 2300 (LimitNOFILE=2300)");
    assert!(f.why.contains("= 2300 > 2299"), "{}", f.why);
    assert!(
        f.why.contains("refuses to start") && f.why.contains("at most 999)"),
        "{}",
        f.why
    );
    let findings = evaluate(&l, &facts);
    assert!(failed(&findings));
    assert!(verdict(&findings).starts_with("verdict: FAIL"));
    assert!(verdict(&findings).contains("open files (RLIMIT_NOFILE)"));

    facts.nofile = Some((1024, 2300));
    let f = judge(&l, &facts, "open files");
    assert_eq!(f.severity, Severity::Ok, "exactly enough: {f:#?}");
    assert!(f.why.contains("raises the soft limit to 2300"), "{}", f.why);
}

#[test]
fn a_default_cap_the_limit_cannot_hold_is_lowered_with_a_warning() {
    let l = Load {
        connection_cap_set: false,
        ..load()
    };
    let mut facts = tuned();
    facts.nofile = Some((1024, 2299));
    let f = judge(&l, &facts, "open files");
    assert_eq!(f.severity, Severity::Warn, "{f:#?}");
    assert!(
        f.why
            .contains("lowers each shard's connection cap (default 1000) to 999"),
        "{}",
        f.why
    );
    assert!(!failed(&evaluate(&l, &facts)));
}

#[test]
fn an_unlimited_hard_limit_is_bounded_by_nr_open() {
    let mut facts = tuned();
    facts.nofile = Some((1024, u64::MAX));
    facts.nr_open = Some(2000);
    let findings = evaluate(&load(), &facts);
    assert_eq!(find(&findings, "open files").severity, Severity::Fail);
    assert_eq!(
        find(&findings, "open files").value,
        "soft 1024, hard unlimited"
    );
    assert_eq!(find(&findings, "fs.nr_open").severity, Severity::Warn);
    facts.nr_open = Some(1 << 20);
    assert_eq!(judge(&load(), &facts, "open files").severity, Severity::Ok);
}

#[test]
fn an_unreadable_limit_warns() {
    let mut facts = tuned();
    facts.nofile = None;
    facts.nr_open = None;
    let findings = evaluate(&load(), &facts);
    assert_eq!(find(&findings, "open files").severity, Severity::Warn);
    assert_eq!(find(&findings, "open files").value, "unknown");
    assert_eq!(find(&findings, "fs.nr_open").severity, Severity::Info);
    assert!(!failed(&findings));
}

#[test]
fn nr_open_below_the_need_warns() {
    let mut facts = tuned();
    facts.nr_open = Some(2299);
    let f = judge(&load(), &facts, "fs.nr_open");
    assert_eq!(f.severity, Severity::Warn);
    assert_eq!(f.recommended, ">= 2300");
}

#[test]
fn a_somaxconn_below_the_backlog_warns() {
    let mut facts = tuned();
    facts.somaxconn = Some(128);
    let f = judge(&load(), &facts, "net.core.somaxconn");
    assert_eq!(f.severity, Severity::Warn);
    assert!(
        f.why.contains("cuts the listen backlog to 128"),
        "{}",
        f.why
    );
    facts.somaxconn = None;
    assert_eq!(
        judge(&load(), &facts, "net.core.somaxconn").severity,
        Severity::Info
    );
}

#[test]
fn io_uring_refused_fails_only_when_the_backend_requires_it() {
    let mut facts = tuned();
    facts.io_uring_disabled = Some(2);
    facts.uring_probe = Some(Err("Operation not permitted (os error 1)".into()));
    let mut l = load();
    for (backend, severity) in [
        (Backend::Uring, Severity::Fail),
        (Backend::Auto, Severity::Warn),
        (Backend::Mio, Severity::Info),
    ] {
        l.backend = backend;
        let f = judge(&l, &facts, "io_uring");
        assert_eq!(f.severity, severity, "{backend:?}: {f:#?}");
        assert_eq!(
            f.value,
            "io_uring_disabled=2; refused: Operation not permitted (os error 1)"
        );
    }
    // Without a probe the sysctl decides.
    facts.uring_probe = None;
    l.backend = Backend::Uring;
    assert_eq!(judge(&l, &facts, "io_uring").severity, Severity::Fail);
    facts.io_uring_disabled = Some(0);
    assert_eq!(judge(&l, &facts, "io_uring").severity, Severity::Warn);
    // The probe wins over the sysctl (1: allowed for io_uring_group members).
    facts.io_uring_disabled = Some(1);
    facts.uring_probe = Some(Ok(()));
    assert_eq!(judge(&l, &facts, "io_uring").severity, Severity::Ok);
}

#[test]
fn shard_cores_warn_when_unpinned_shared_missing_or_all_taken() {
    let facts = tuned();
    let mut l = load();
    l.shard_cores = Vec::new();
    let f = judge(&l, &facts, "shard cores");
    assert_eq!(
        (f.severity, f.value.as_str()),
        (Severity::Warn, "not pinned (2 shards)")
    );

    l.shard_cores = vec![1, 5];
    let f = judge(&l, &facts, "shard cores");
    assert_eq!(f.severity, Severity::Warn);
    assert!(f.why.starts_with("cores 5 are offline"), "{}", f.why);

    l.shard_cores = vec![1, 1];
    let f = judge(&l, &facts, "shard cores");
    assert_eq!(f.severity, Severity::Warn);
    assert!(f.why.contains("share a core"), "{}", f.why);

    l.shards = 4;
    l.shard_cores = vec![0, 1, 2, 3];
    let f = judge(&l, &facts, "shard cores");
    assert_eq!(f.severity, Severity::Warn);
    assert_eq!(f.value, "0-3 (4 shards)");
    assert!(f.why.contains("every online core"), "{}", f.why);
}

#[test]
fn cores_without_isolation_or_nohz_full_warn() {
    let mut facts = tuned();
    facts.isolated = Some(Vec::new());
    facts.nohz_full = None;
    facts.cmdline = Some("quiet".into());
    let f = judge(&load(), &facts, "core isolation");
    assert_eq!(f.severity, Severity::Warn);
    assert_eq!(f.value, "isolated none; nohz_full none");
    assert_eq!(f.recommended, "isolcpus=1-2 nohz_full=1-2");
    assert!(
        f.why.starts_with("cores 1-2 not isolated, 1-2 with"),
        "{}",
        f.why
    );

    // isolcpus= with flags on the command line counts too.
    facts.cmdline = Some("isolcpus=nohz,domain,managed_irq,1-2 nohz_full=1,2".into());
    assert_eq!(
        judge(&load(), &facts, "core isolation").severity,
        Severity::Ok
    );

    let mut l = load();
    l.shard_cores = Vec::new();
    assert_eq!(judge(&l, &facts, "core isolation").severity, Severity::Info);
}

#[test]
fn a_power_saving_governor_warns_and_an_absent_one_informs() {
    let mut facts = tuned();
    facts.governors[1].1 = Some("powersave".into());
    let f = judge(&load(), &facts, "cpu frequency governor");
    assert_eq!(f.severity, Severity::Warn);
    assert_eq!(f.value, "cpu1 performance, cpu2 powersave");
    assert!(f.why.starts_with("cores 2 scale"), "{}", f.why);

    facts.governors = vec![(1, None), (2, None)];
    let f = judge(&load(), &facts, "cpu frequency governor");
    assert_eq!(f.severity, Severity::Info);
    assert_eq!(f.value, "cpu1 absent, cpu2 absent");
}

#[test]
fn transparent_huge_pages_always_warns() {
    let mut facts = tuned();
    for (mode, severity) in [
        (Some("always"), Severity::Warn),
        (Some("never"), Severity::Ok),
        (Some("madvise"), Severity::Ok),
        (None, Severity::Info),
    ] {
        facts.thp_enabled = mode.map(String::from);
        let f = judge(&load(), &facts, "transparent huge pages");
        assert_eq!(f.severity, severity, "{mode:?}");
    }
}

#[test]
fn guest_halt_polling_off_warns() {
    let mut facts = tuned();
    for (driver, poll_ns, severity) in [
        (Some("haltpoll"), Some(0), Severity::Warn),
        (Some("haltpoll"), Some(200_000), Severity::Ok),
        (Some("intel_idle"), None, Severity::Info),
        (None, None, Severity::Info),
    ] {
        facts.cpuidle_driver = driver.map(String::from);
        facts.guest_halt_poll_ns = poll_ns;
        let f = judge(&load(), &facts, "idle vCPU wake-ups");
        assert_eq!(f.severity, severity, "{driver:?} {poll_ns:?}");
    }
}

#[test]
fn another_process_pinned_to_or_running_on_a_shard_core_warns() {
    let mut facts = tuned();
    let mut procs = facts.processes.clone().unwrap();
    // Running on a core that is not a shard's, or allowed everywhere and asleep: fine.
    procs.push(process(7, "sshd", true, Some(0), Some(vec![0, 1, 2, 3])));
    procs.push(process(
        8,
        "irqbalance",
        false,
        Some(2),
        Some(vec![0, 1, 2, 3]),
    ));
    procs.push(process(9, "pinned0", false, Some(0), Some(vec![0])));
    facts.processes = Some(procs.clone());
    assert_eq!(
        judge(&load(), &facts, "other processes").severity,
        Severity::Ok
    );

    procs.push(process(10, "batch job", false, Some(0), Some(vec![0, 1])));
    procs.push(process(11, "spinner", true, Some(2), None));
    facts.processes = Some(procs);
    facts.processes_truncated = true;
    let f = judge(&load(), &facts, "other processes");
    assert_eq!(f.severity, Severity::Warn);
    assert_eq!(
        f.value,
        "10 (batch job) pinned to 0-1; 11 (spinner) running on 2"
    );
    assert!(f.why.contains("first 4096 processes scanned"), "{}", f.why);

    facts.processes = None;
    assert_eq!(
        judge(&load(), &facts, "other processes").severity,
        Severity::Info
    );
}

#[test]
fn many_processes_are_counted_not_listed() {
    let mut facts = tuned();
    facts.processes = Some(
        (100..110)
            .map(|pid| process(pid, "w", true, Some(1), None))
            .collect(),
    );
    let f = judge(&load(), &facts, "other processes");
    assert!(f.value.ends_with("; 7 more"), "{}", f.value);
}

#[test]
fn cpu_lists_parse_and_print() {
    assert_eq!(parse_cpu_list("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
    assert_eq!(parse_cpu_list(""), Vec::<usize>::new());
    assert_eq!(parse_cpu_list("\n"), Vec::<usize>::new());
    assert_eq!(parse_cpu_list("domain,managed_irq,2-3"), vec![2, 3]);
    assert_eq!(parse_cpu_list("3,1,1"), vec![1, 3]);
    assert_eq!(parse_cpu_list("0-1000000").len(), 4096, "bounded");
    assert_eq!(show_cpu_list(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
    assert_eq!(show_cpu_list(&[]), "none");
}

#[test]
fn proc_stat_lines_parse_whatever_the_command_name() {
    let mut fields: Vec<String> = (4..=52).map(|n| n.to_string()).collect();
    fields[9 - 4] = "4194304".into(); // flags: PF_RANDOMIZE only
    fields[39 - 4] = "1".into(); // processor
    let line = format!("42 (a (b) c) R {}", fields.join(" "));
    let stat = parse_stat(&line).unwrap();
    assert_eq!(stat.comm, "a (b) c");
    assert!(stat.running);
    assert_eq!(stat.last_cpu, Some(1));
    assert!(!stat.kernel_thread);
    fields[9 - 4] = "2129984".into(); // PF_KTHREAD | ...
    let stat = parse_stat(&format!("2 (kthreadd) S {}", fields.join(" "))).unwrap();
    assert!(stat.kernel_thread && !stat.running);
    assert_eq!(parse_stat("garbage"), None);
    assert_eq!(
        selected_mode("always [madvise] never\n").as_deref(),
        Some("madvise")
    );
    assert_eq!(selected_mode("weird"), None);
}

#[test]
fn the_table_is_aligned() {
    let mut facts = tuned();
    facts.nofile = Some((10, 20));
    let text = render(&evaluate(&load(), &facts));
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 11, "a header and ten findings");
    let column = lines[0].find("STATUS").unwrap();
    for line in &lines[1..] {
        let status = &line[column..column + 4];
        assert!(["ok  ", "info", "WARN", "FAIL"].contains(&status), "{line}");
    }
    assert!(lines[1].starts_with("open files (RLIMIT_NOFILE)"));
    assert_eq!(&lines[1][column..column + 4], "FAIL");
}

#[test]
fn the_load_comes_from_the_configuration() {
    let config = Config::parse(
        "[runtime]\nshard_count = 3\npin_cores = [4, 5]\n\
         [net]\nconnections_per_shard_max = 500\nlisten_backlog = 1024\nbackend = \"mio\"\n",
        |_| None,
    )
    .unwrap();
    let l = Load::from_config(&config).unwrap();
    assert_eq!(l.shards, 3);
    assert_eq!(l.shard_cores, vec![4, 5, 4], "pin_cores[i % len]");
    assert_eq!(l.distinct_cores(), vec![4, 5]);
    assert_eq!((l.connections_per_shard, l.listen_backlog), (500, 1024));
    assert_eq!(l.backend, Backend::Mio);
    // The need is exactly where the node's own budget stops over-committing.
    let node = config.to_node_config().unwrap();
    assert!(!engine::node::fd_budget(&node, l.fds_needed()).over_committed());
    assert!(engine::node::fd_budget(&node, l.fds_needed() - 1).over_committed());
}

// The binary on this machine.

fn check_host(dir: &Path, toml: &str, flags: &[&str]) -> (Output, String) {
    let path = dir.join("imrouter.toml");
    std::fs::write(&path, toml).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_imrouter"))
        .arg("check-host")
        .arg("--config")
        .arg(&path)
        .args(flags)
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    println!(
        "imrouter check-host --config ({toml:?}) {flags:?}: {:?}\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    (out, stdout)
}

/// The table's line for `prefix`.
fn line<'a>(stdout: &'a str, prefix: &str) -> &'a str {
    stdout
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line {prefix} in:\n{stdout}"))
}

/// A `connections_per_shard_max` for two shards that fits this machine's hard
/// descriptor limit (2,000, or less on a machine with a lower limit).
fn fitting_connections() -> u64 {
    let (_, hard) = net::io::fd::nofile_limit().unwrap();
    let text = "[runtime]\nshard_count = 2\n[net]\nconnections_per_shard_max = 1\n";
    let reserve = Load::from_config(&Config::parse(text, |_| None).unwrap())
        .unwrap()
        .fd_reserve;
    let share = (net::io::fd::raisable_limit(hard).saturating_sub(reserve)) / 2;
    assert!(
        share >= 100,
        "hard limit {hard} leaves no room for connections"
    );
    share.min(2000)
}

#[test]
fn a_load_that_fits_the_descriptor_limit_passes() {
    let dir = tempfile::tempdir().unwrap();
    let conns = fitting_connections();
    let toml = format!("[net]\nconnections_per_shard_max = {conns}\n");
    let (out, stdout) = check_host(dir.path(), &toml, &["--shards", "2"]);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    let open = line(&stdout, "open files (RLIMIT_NOFILE)");
    assert!(open.contains(" ok "), "{open}");
    assert!(
        open.contains(&format!("2 shards x {conns} connections")),
        "{open}"
    );
    assert!(line(&stdout, "verdict:").starts_with("verdict: OK"));
    assert_eq!(stdout.lines().count(), 12, "header, ten findings, verdict");
}

#[test]
fn a_load_beyond_the_hard_limit_fails_on_the_open_files_line() {
    let dir = tempfile::tempdir().unwrap();
    // 2 x 2^24 connections (the most the configuration allows per shard): more
    // than any hard limit short of an unlimited one with fs.nr_open above 2^25.
    let toml = "[net]\nconnections_per_shard_max = 16777216\n";
    let (out, stdout) = check_host(dir.path(), toml, &["--shards", "2"]);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    let open = line(&stdout, "open files (RLIMIT_NOFILE)");
    assert!(open.contains(" FAIL "), "{open}");
    assert!(open.contains("2 shards x 16777216 connections"), "{open}");
    let verdict = line(&stdout, "verdict:");
    assert!(
        verdict.starts_with("verdict: FAIL, this host would not carry the configured load: open files (RLIMIT_NOFILE)"),
        "{verdict}"
    );
}

#[test]
fn io_uring_required_fails_exactly_when_the_ring_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "[net]\nconnections_per_shard_max = {}\n",
        fitting_connections()
    );
    let (out, stdout) = check_host(dir.path(), &toml, &["--shards", "2", "--io", "uring"]);
    let uring = line(&stdout, "io_uring ");
    if uring.contains("ring set up") {
        assert!(uring.contains(" ok "), "{uring}");
        assert_eq!(out.status.code(), Some(0), "{stdout}");
    } else {
        assert!(uring.contains(" FAIL "), "{uring}");
        assert_eq!(out.status.code(), Some(1), "{stdout}");
    }
}

#[test]
fn an_invalid_configuration_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let (out, _) = check_host(dir.path(), "[net]\nno_such_key = 1\n", &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no_such_key"));
}

/// The wss certificate is a finding only with `[listen] wss_addr`: expired fails,
/// under two weeks warns, else ok; the value names the file.
#[test]
fn the_wss_certificate_expiry_is_judged() {
    assert!(
        evaluate(&load(), &tuned())
            .iter()
            .all(|f| !f.name.starts_with("wss certificate")),
        "no finding without a wss listener"
    );
    let with = |expires_in_s: i64| Load {
        tls_cert: Some(engine::hostcheck::TlsCert {
            cert_file: "/etc/imrouter/cert.pem".into(),
            expires_in_s,
        }),
        ..load()
    };
    let f = judge(&with(90 * 86_400), &tuned(), "wss certificate");
    assert_eq!(f.severity, Severity::Ok, "{f:#?}");
    assert!(
        f.value
            .contains("/etc/imrouter/cert.pem: expires in 90 days"),
        "{}",
        f.value
    );
    let f = judge(&with(3 * 86_400), &tuned(), "wss certificate");
    assert_eq!(f.severity, Severity::Warn, "{f:#?}");
    let l = with(-86_400);
    let f = judge(&l, &tuned(), "wss certificate");
    assert_eq!(f.severity, Severity::Fail, "{f:#?}");
    assert!(f.value.contains("expired 1 days ago"), "{}", f.value);
    assert!(failed(&evaluate(&l, &tuned())));
}
