//! Connection floods past the file-descriptor limit (issue 17), on both IO backends.
//!
//! The node runs in a child process (this test binary re-executed with
//! `FLOOD_CHILD_DIR`) whose `RLIMIT_NOFILE` is set to 1024, soft and hard, before the
//! node starts. The parent holds the flood's client sockets (it needs ~1500
//! descriptors itself), reads the node's counters through the child's stdin/stdout
//! (`stats` → one `STATS {json}` line, no descriptor needed), and talks wkproto to it.

// Test configs change a few nested fields of the defaults.
#![allow(clippy::field_reassign_with_default)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, ErrorKind, Lines, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use engine::node::Node;
use net::client::{Client, Login, Received};

#[macro_use]
mod support;

const CHILD_DIR: &str = "FLOOD_CHILD_DIR";
const CHILD_BACKEND: &str = "FLOOD_CHILD_BACKEND";
const CHILD_RESERVE: &str = "FLOOD_CHILD_FD_RESERVE";
/// The node's descriptor limit, soft and hard (a login shell's usual limit).
const NODE_NOFILE: u64 = 1024;
/// Idle connections of the flood.
const FLOOD: usize = 1500;
/// Bounds every wait of a test that fails (never a synchronization).
const FAIL_AFTER: Duration = Duration::from_secs(60);
const TIMEOUT: Duration = Duration::from_secs(10);
/// How long the flood's connections are held (the CPU figure's window).
const FLOOD_HOLD: Duration = Duration::from_secs(3);

/// The child: sets its descriptor limit, runs a node, answers `stats` on stdin.
#[test]
fn flood_child() {
    let Ok(dir) = std::env::var(CHILD_DIR) else {
        return;
    };
    let backend = match std::env::var(CHILD_BACKEND).as_deref() {
        Ok("uring") => net::io::Backend::Uring,
        _ => net::io::Backend::Mio,
    };
    let lim = libc::rlimit {
        rlim_cur: NODE_NOFILE,
        rlim_max: NODE_NOFILE,
    };
    // SAFETY: setrlimit with a valid pointer to an initialized struct.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
    let mut config = support::config(std::path::Path::new(&dir), backend);
    config.token_auth = false;
    config.api.addr = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    if let Ok(r) = std::env::var(CHILD_RESERVE) {
        config.net.fd_reserve = r.parse().unwrap();
    }
    // The most connections the limit holds per shard (a start whose configured cap
    // does not fit is refused): the flood then meets that cap.
    config.net.connections_per_shard_max =
        engine::node::fd_budget(&config, NODE_NOFILE).per_shard_cap as usize;
    let node = Node::start(config).unwrap();
    let mut out = std::io::stdout();
    writeln!(
        out,
        "READY {} {}",
        node.tcp_addr().unwrap(),
        node.api_addr().unwrap()
    )
    .unwrap();
    out.flush().unwrap();
    for line in std::io::stdin().lines() {
        let Ok(line) = line else { break };
        if line.trim() == "stats" {
            let mut totals: BTreeMap<&str, u64> = BTreeMap::new();
            for m in &node.shared().shard_metrics {
                for (name, v) in m.snapshot() {
                    *totals.entry(name).or_default() += v;
                }
            }
            let ready = node.shared().not_ready().unwrap_or_default();
            writeln!(
                out,
                "STATS {} {}",
                serde_json::to_string(&totals).unwrap(),
                serde_json::to_string(&ready).unwrap()
            )
            .unwrap();
            out.flush().unwrap();
        }
    }
    node.shutdown().unwrap();
}

/// The parent's handle on a node child.
struct NodeChild {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    tcp: SocketAddr,
    api: SocketAddr,
    _dir: tempfile::TempDir,
}

impl NodeChild {
    fn start(backend: net::io::Backend, fd_reserve: Option<usize>) -> NodeChild {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", "flood_child", "--nocapture", "--test-threads=1"])
            .env(CHILD_DIR, dir.path())
            .env(
                CHILD_BACKEND,
                match backend {
                    net::io::Backend::Uring => "uring",
                    _ => "mio",
                },
            )
            .env("RUST_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(r) = fd_reserve {
            cmd.env(CHILD_RESERVE, r.to_string());
        }
        let mut child = cmd.spawn().unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let (tcp, api) = loop {
            let line = lines.next().expect("child printed its addresses").unwrap();
            if let Some((_, rest)) = line.split_once("READY ") {
                let mut it = rest.split_whitespace();
                break (
                    it.next().unwrap().parse().unwrap(),
                    it.next().unwrap().parse().unwrap(),
                );
            }
        };
        NodeChild {
            child,
            stdin,
            lines,
            tcp,
            api,
            _dir: dir,
        }
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// The node's counters summed over shards, and its /readyz reason ("" = ready).
    fn stats(&mut self) -> (BTreeMap<String, u64>, String) {
        writeln!(self.stdin, "stats").unwrap();
        self.stdin.flush().unwrap();
        loop {
            let line = self.lines.next().expect("child answers stats").unwrap();
            if let Some((_, rest)) = line.split_once("STATS ") {
                let (json, ready) = rest.split_once("} ").unwrap();
                let map: BTreeMap<String, u64> =
                    serde_json::from_str(&format!("{json}}}")).unwrap();
                let ready: String = serde_json::from_str(ready).unwrap();
                return (map, ready);
            }
        }
    }

    fn stat(&mut self, name: &str) -> u64 {
        self.stats().0.get(name).copied().unwrap_or(0)
    }

    /// Polls the counters until `pred` holds (bounded by [`FAIL_AFTER`]).
    fn wait_stats(
        &mut self,
        what: &str,
        pred: impl Fn(&BTreeMap<String, u64>) -> bool,
    ) -> BTreeMap<String, u64> {
        let deadline = Instant::now() + FAIL_AFTER;
        loop {
            let (s, _) = self.stats();
            if pred(&s) {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {s:?}"
            );
            std::thread::sleep(Duration::from_millis(20)); // Polling interval, not a sync.
        }
    }

    /// utime + stime of the node process, in clock ticks.
    fn cpu_ticks(&self) -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap();
        let after_comm = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = after_comm.split_whitespace().collect();
        // Fields 14 and 15 of stat(5); after_comm starts at field 3.
        f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
    }

    /// Sets the node's soft descriptor limit (the hard one stays).
    fn set_soft_nofile(&self, soft: u64) {
        let new = libc::rlimit {
            rlim_cur: soft,
            rlim_max: NODE_NOFILE,
        };
        // SAFETY: prlimit on our child with valid pointers.
        let rc =
            unsafe { libc::prlimit(self.pid(), libc::RLIMIT_NOFILE, &new, std::ptr::null_mut()) };
        assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
    }
}

impl Drop for NodeChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tcp_stat(s: &BTreeMap<String, u64>, name: &str) -> u64 {
    s.get(&format!("{name}_tcp")).copied().unwrap_or(0)
}

/// Every TCP arrival the node handled: kept, or refused for any reason.
fn tcp_handled(s: &BTreeMap<String, u64>) -> u64 {
    tcp_stat(s, "accepts")
        + tcp_stat(s, "accept_refused_conn_cap")
        + tcp_stat(s, "accept_refused_fd_limit")
        + tcp_stat(s, "accept_refused_other")
}

fn login(addr: SocketAddr, uid: &str) -> Client {
    let (client, reason) = Client::connect(addr, &Login::new(uid, "any"), TIMEOUT).unwrap();
    assert_eq!(reason, 1, "CONNACK for {uid}");
    client
}

/// `from` sends one message to `to`, which must receive it.
fn exchange(from: &mut Client, to: &mut Client, to_uid: &str, seq: u32) {
    let no = format!("flood-{seq}");
    from.send(to_uid, 1, seq, &no, no.as_bytes(), true).unwrap();
    loop {
        match to.read().unwrap() {
            Received::Recv(m) if m.client_msg_no == no => {
                to.recvack(m.message_id, m.message_seq).unwrap();
                break;
            }
            _ => {}
        }
    }
    loop {
        if let Received::Sendack {
            client_seq, reason, ..
        } = from.read().unwrap()
        {
            if client_seq == seq {
                assert_eq!(reason, 1);
                break;
            }
        }
    }
}

/// GET `path` on a fresh connection to the API; the status code.
fn http_get(api: SocketAddr, path: &str) -> std::io::Result<u16> {
    http_get_text(api, path).map(|(status, _)| status)
}

/// One GET on a fresh connection: the status and the whole response text.
fn http_get_text(api: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&api, TIMEOUT)?;
    s.set_read_timeout(Some(TIMEOUT))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad response {text:?}")))?;
    Ok((status, text))
}

/// The flood's connections: those still open, and those the node reset before
/// `connect` returned (a reset can overtake the handshake's last step on loopback).
struct Flood {
    socks: Vec<TcpStream>,
    reset_at_connect: usize,
}

fn open_flood(addr: SocketAddr, n: usize) -> Flood {
    let mut flood = Flood {
        socks: Vec::with_capacity(n),
        reset_at_connect: 0,
    };
    for _ in 0..n {
        match TcpStream::connect(addr) {
            Ok(s) => {
                s.set_nonblocking(true).unwrap();
                flood.socks.push(s);
            }
            Err(e) if e.kind() == ErrorKind::ConnectionReset => flood.reset_at_connect += 1,
            Err(e) => panic!("flood connect: {e}"),
        }
    }
    flood
}

/// How many of the flood's connections were reset by the node.
fn count_resets(flood: &mut Flood) -> usize {
    let mut buf = [0u8; 16];
    flood.reset_at_connect
        + flood
            .socks
            .iter_mut()
            .filter(|s| {
                matches!((&**s).read(&mut buf), Err(e) if e.kind() == ErrorKind::ConnectionReset)
            })
            .count()
}

/// 1500 idle connections against a node with 1024 descriptors: the ones over the
/// shards' caps are reset and counted as `conn_cap`, connected clients keep
/// exchanging messages, `/healthz` answers on a fresh connection throughout, and a
/// new client connects once the flood is gone.
fn flood_past_the_connection_cap(backend: net::io::Backend) {
    let mut node = NodeChild::start(backend, None);
    let (mut a, mut b) = (login(node.tcp, "u1"), login(node.tcp, "u2"));
    exchange(&mut a, &mut b, "u2", 1);
    let cpu_before = node.cpu_ticks();
    let started = Instant::now();
    let mut flood = open_flood(node.tcp, FLOOD);
    assert_eq!(
        http_get(node.api, "/healthz").unwrap(),
        200,
        "during the flood"
    );
    exchange(&mut b, &mut a, "u1", 2);
    let s = node.wait_stats("every flood connection handled", |s| {
        tcp_handled(s) >= (FLOOD + 2) as u64
    });
    let refused = tcp_stat(&s, "accept_refused_conn_cap");
    assert!(refused > 0, "conn_cap refusals counted: {s:?}");
    let (_, metrics) = http_get_text(node.api, "/metrics").unwrap();
    let line = format!(
        "imrouter_accept_refused_total{{listener=\"tcp\",reason=\"conn_cap\"}} {refused}\n"
    );
    assert!(metrics.contains(&line), "/metrics has {line}");
    assert!(
        metrics.contains("\nimrouter_fd_limit 1024\n"),
        "the limit in /metrics"
    );
    assert_eq!(tcp_stat(&s, "accept_refused_fd_limit"), 0, "{s:?}");
    assert_eq!(
        count_resets(&mut flood),
        refused as usize,
        "each refusal is a reset"
    );
    // The flood is held (idle connections, as in the report): the node's CPU
    // over this time is the figure.
    let mut seq = 3;
    while started.elapsed() < FLOOD_HOLD {
        exchange(&mut a, &mut b, "u2", seq);
        assert_eq!(
            http_get(node.api, "/healthz").unwrap(),
            200,
            "during the flood"
        );
        seq += 1;
        std::thread::sleep(Duration::from_millis(200)); // The clients' pace.
    }
    let ticks = node.cpu_ticks() - cpu_before;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let secs = started.elapsed().as_secs_f64();
    println!(
        "FIGURE {backend:?}: node CPU during the flood: {:.3} s over {secs:.2} s = {:.0}% of a core; \
         accepted {} refused conn_cap {refused}",
        ticks as f64 / hz,
        100.0 * ticks as f64 / hz / secs,
        tcp_stat(&s, "accepts"),
    );
    drop(flood);
    node.wait_stats("the flood's connections closed", |s| {
        s.get("connections").copied().unwrap_or(0) <= 2
    });
    let mut c = login(node.tcp, "u3");
    exchange(&mut c, &mut a, "u1", seq);
    assert_eq!(
        http_get(node.api, "/healthz").unwrap(),
        200,
        "after the flood"
    );
}

/// EMFILE forced after start: the node's soft limit drops below its open descriptors
/// (`prlimit`), then 1500 connections arrive. The failed accept rounds stay within
/// shards × listeners × (backoff steps + seconds of flood), the listener is reported
/// paused, and once descriptors free up every queued connection is handled without
/// a new arrival.
fn accept_backs_off_on_emfile(backend: net::io::Backend) {
    let mut node = NodeChild::start(backend, None);
    let (mut a, mut b) = (login(node.tcp, "u1"), login(node.tcp, "u2"));
    exchange(&mut a, &mut b, "u2", 1);
    node.set_soft_nofile(16);
    let cpu_before = node.cpu_ticks();
    let started = Instant::now();
    let mut flood = open_flood(node.tcp, FLOOD);
    let s = node.wait_stats("a paused listener", |s| tcp_stat(s, "listener_paused") > 0);
    let (_, ready) = node.stats();
    assert!(
        ready.contains("paused"),
        "/readyz says why: {ready:?} {s:?}"
    );
    // Let the flood last (its seconds enter the bound).
    std::thread::sleep(Duration::from_secs(2)); // The flood's duration, not a sync.
    let s = node.stats().0;
    let secs = started.elapsed().as_secs_f64();
    let rounds = tcp_stat(&s, "accept_pauses");
    let shards = 2;
    let listeners = 2;
    let bound =
        shards * listeners * (net::io::AcceptBackoff::steps() as u64 + secs.ceil() as u64 + 1);
    let ticks = node.cpu_ticks() - cpu_before;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    println!(
        "FIGURE {backend:?}: EMFILE flood: {rounds} failed accept rounds in {secs:.2} s \
         (bound {bound}), node CPU {:.3} s = {:.0}% of a core; {s:?}",
        ticks as f64 / hz,
        100.0 * ticks as f64 / hz / secs
    );
    assert!(
        rounds >= 1 && rounds <= bound,
        "{rounds} failed accepts, bound {bound}"
    );
    // Descriptors free up: the limit is restored and some flood connections close.
    node.set_soft_nofile(NODE_NOFILE);
    for s in flood.socks.iter_mut().take(200) {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
    flood.socks.drain(..200);
    // Every queued connection is handled without a new arrival.
    let s = node.wait_stats("the backlog drained", |s| {
        tcp_handled(s) >= (FLOOD + 2) as u64 && tcp_stat(s, "listener_paused") == 0
    });
    println!("after the drain: {s:?}");
    drop(flood);
    node.wait_stats("the flood's connections closed", |s| {
        s.get("connections").copied().unwrap_or(0) <= 2
    });
    exchange(&mut a, &mut b, "u2", 2);
    let mut c = login(node.tcp, "u3");
    exchange(&mut c, &mut a, "u1", 3);
    let _ = node.stat("connections");
}

/// `/healthz` on a fresh connection answers while the node is out of descriptors
/// and after. Fails with tiny_http (it stops serving after an accept error); passes
/// with the axum API server that replaces it.
fn healthz_answers_through_fd_exhaustion(backend: net::io::Backend) {
    let mut node = NodeChild::start(backend, None);
    assert_eq!(http_get(node.api, "/healthz").unwrap(), 200);
    node.set_soft_nofile(16);
    let flood = open_flood(node.tcp, FLOOD);
    node.wait_stats("a paused listener", |s| tcp_stat(s, "listener_paused") > 0);
    // The API may refuse while out of descriptors; it must serve again after.
    let _ = http_get(node.api, "/healthz");
    node.set_soft_nofile(NODE_NOFILE);
    drop(flood);
    node.wait_stats("the flood's connections closed", |s| {
        s.get("connections").copied().unwrap_or(0) == 0 && tcp_stat(s, "listener_paused") == 0
    });
    let deadline = Instant::now() + FAIL_AFTER;
    loop {
        match http_get(node.api, "/healthz") {
            Ok(200) => break,
            other => assert!(
                Instant::now() < deadline,
                "/healthz never answered again: {other:?}"
            ),
        }
        std::thread::sleep(Duration::from_millis(50)); // Polling interval.
    }
}

/// At the descriptor limit with the spare descriptor still usable, every arrival is
/// accepted (while a descriptor is free) or accepted with the spare and reset
/// (`fd_limit`): nothing waits in the queue and the listener never pauses.
fn spare_descriptor_resets_connections_at_the_limit(backend: net::io::Backend) {
    let mut node = NodeChild::start(backend, None);
    let (mut a, mut b) = (login(node.tcp, "u1"), login(node.tcp, "u2"));
    exchange(&mut a, &mut b, "u2", 1);
    // The limit at the lowest free descriptor: the next accept fails with EMFILE,
    // and the spare (opened when the driver started, below it) is what frees one.
    let used: std::collections::BTreeSet<u64> =
        std::fs::read_dir(format!("/proc/{}/fd", node.pid()))
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u64>().ok())
            .collect();
    let lowest_free = (0..).find(|k| !used.contains(k)).unwrap();
    node.set_soft_nofile(lowest_free);
    const N: usize = 200;
    let mut flood = open_flood(node.tcp, N);
    let s = node.wait_stats("every flood connection handled", |s| {
        tcp_handled(s) >= (N + 2) as u64
    });
    println!("{backend:?}: {s:?}");
    let reset = tcp_stat(&s, "accept_refused_fd_limit");
    assert!(reset > 0, "{s:?}");
    // Pauses may still happen: any other thread of the process (an accept in flight
    // on io_uring, the syncer, the API) can take the descriptor the spare frees at
    // this exact limit; the listener then backs off and resumes by itself.
    assert_eq!(
        count_resets(&mut flood),
        reset as usize,
        "each refusal is a reset"
    );
    node.set_soft_nofile(NODE_NOFILE);
    drop(flood);
    exchange(&mut b, &mut a, "u1", 2);
}

on_both_drivers!(
    flood_past_the_connection_cap,
    accept_backs_off_on_emfile,
    spare_descriptor_resets_connections_at_the_limit,
    healthz_answers_through_fd_exhaustion
);

/// `imrouter --print-config` under a 1024-descriptor limit shows the computed budget
/// (as TOML comments: the output still parses) and warns that the configured cap
/// does not fit.
#[test]
fn print_config_shows_the_descriptor_budget() {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_imrouter"));
    cmd.arg("--print-config");
    // SAFETY: only setrlimit (async-signal-safe) between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: NODE_NOFILE,
                rlim_max: NODE_NOFILE,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let config: engine::config::Config = toml::from_str(&text).unwrap();
    let budget = engine::node::fd_budget(&config.to_node_config().unwrap(), NODE_NOFILE);
    assert!(budget.over_committed());
    assert!(
        text.contains(&format!(
            "accepts at most {} connections",
            budget.per_shard_cap
        )),
        "{text}"
    );
    assert!(
        text.contains("# WARNING: connections_per_shard_max"),
        "{text}"
    );
}

/// A start whose configured connections (a cap the user set) need more
/// descriptors than the limit allows is refused at once, with one line naming the
/// numbers and the two fixes (issue 15), before the data dir is touched; a cap that
/// fits starts. (The default cap is lowered instead: `node_defaults.rs`.)
#[test]
fn a_start_whose_connections_do_not_fit_the_descriptor_limit_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = support::config(&dir.path().join("data"), net::io::Backend::Mio);
    c.net.connections_per_shard_max = 1 << 30;
    c.connection_cap_set = true;
    let e = Node::start(c.clone()).err().expect("refused");
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    let line = e.to_string();
    assert!(
        line.contains("connections_per_shard_max = 1073741824 on 2 shards needs")
            && line.contains("LimitNOFILE")
            && !line.contains('\n'),
        "{line}"
    );
    assert!(
        !dir.path().join("data").exists(),
        "refused before the data dir"
    );
    c.net.connections_per_shard_max = 100;
    Node::start(c).unwrap().shutdown().unwrap();
}
