//! imbench, the end-to-end latency harness of imrouter.
//!
//! - [`conn`]: a sans-IO client connection (wkproto over TCP, ws or wss; JSON-RPC;
//!   a peer's codec) whose bytes the load loop moves on `net::io::NetDriver`.
//! - [`load`]: pinned event loops (one `net::io::NetDriver` each), open-loop
//!   schedules, per-message accounting.
//! - [`target`]: the embedded node or external nodes, and the HTTP control path.
//! - [`floor`]: the loopback echo round trip every report states.
//! - [`report`]: percentiles, JSON summary, `.hgrm` files, the terminal table.
//! - [`plot`]: the SVG "latency by percentile" chart.
//! - [`proc`]: CPU and RSS from `/proc`.
//!
//! [`run_scenario`] is what the `imbench` binary and the smoke test call: it returns a
//! [`report::Summary`] whose accounting ([`report::Summary::clean`]) says whether every
//! expected RECV was counted.

#![warn(clippy::too_many_lines)] // every function at most 80 code lines (clippy.toml)

pub mod conn;
pub mod floor;
pub mod jsonrpc;
pub mod load;
pub mod peer;
pub mod plot;
pub mod proc;
pub mod report;
pub mod target;
pub mod tls;

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hdrhistogram::Histogram;

use crate::conn::Transport;
use crate::load::{Class, ClientSpec, LoadConfig, Plan, Route, Schedule, CLASSES};
use crate::report::{ClassSummary, Pcts, ServerUse, Summary};
use crate::target::Target;

/// File descriptors kept free for everything but client sockets (logs, epoll, HTTP).
pub const RESERVED_FDS: u64 = 512;

/// Which node(s) a run drives.
#[derive(Clone, Debug)]
pub enum TargetSpec {
    /// Start a node in this process (`shards` = 0: one per core) with this log sync
    /// policy (the `imrouter` binary's default is `Always`).
    Embedded {
        shards: u16,
        fsync: engine::store::FsyncPolicy,
        /// A wss listener with this certificate and key.
        tls: Option<net::io::TlsConfig>,
    },
    /// Nodes started elsewhere.
    External {
        tcp: Vec<SocketAddr>,
        ws: Vec<SocketAddr>,
        wss: Vec<SocketAddr>,
        api: Vec<SocketAddr>,
        bearer: Option<String>,
    },
    /// A peer server (Redis pub/sub, NATS) driven with the same load: group scenario
    /// only, plain TCP ([`peer`]).
    Peer(peer::PeerUrl),
}

/// A scenario and its parameters.
#[derive(Clone, Debug)]
pub enum Scenario {
    /// Only the loopback echo floor.
    Floor,
    /// `pairs` online pairs; each member sends to its peer; `rate` messages/s in total.
    Person { pairs: usize, rate: f64 },
    /// `groups` groups of `members`, `online_share` of them connected; every online
    /// member sends to its group; `rate` messages/s in total.
    Group {
        members: usize,
        online_share: f64,
        groups: usize,
        rate: f64,
    },
    /// `clients` connect with `concurrency` CONNECTs in flight (and `rate` new ones
    /// per second when set); no messages.
    Storm {
        clients: usize,
        concurrency: usize,
        rate: Option<f64>,
    },
    /// Person and group traffic at once.
    Mixed {
        pairs: usize,
        person_rate: f64,
        members: usize,
        online_share: f64,
        group_rate: f64,
    },
}

impl Scenario {
    pub fn name(&self) -> &'static str {
        match self {
            Scenario::Floor => "floor",
            Scenario::Person { .. } => "person",
            Scenario::Group { .. } => "group",
            Scenario::Storm { .. } => "storm",
            Scenario::Mixed { .. } => "mixed",
        }
    }
}

/// Everything about a run but the scenario.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    pub label: String,
    /// The preset the run's flags came from and its expansion, for the report header.
    pub preset: Option<String>,
    pub target: TargetSpec,
    /// The server's pid (external node): CPU seconds and RSS from /proc.
    pub pid: Option<u32>,
    pub load: LoadConfig,
    /// How long the floor is measured before the run (zero: not measured).
    pub floor: Duration,
    /// Where the JSON summary and `.hgrm` files go.
    pub out: Option<PathBuf>,
    /// Store the clients' tokens through the API first (off for nodes without auth).
    pub set_tokens: bool,
}

/// Named histograms of a run (for `.hgrm` files).
pub type Hists = Vec<(String, Histogram<u64>)>;

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn machine() -> String {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{cores} cores, {cpu}, Linux {}", kernel.trim())
}

/// The plan of a scenario: clients, their groups, schedules.
struct Built {
    plan: Plan,
    groups: Vec<(String, Vec<String>)>,
    rates: [f64; CLASSES],
}

fn token_of(uid: &str) -> String {
    format!("t-{uid}")
}

/// Plans a scenario's clients (round robin over `addrs`) and schedules; refuses
/// more clients than `cap_clients`.
fn build(
    sc: &Scenario,
    prefix: &str,
    addrs: &[SocketAddr],
    cap_clients: usize,
) -> io::Result<Built> {
    let mut p = Planner {
        prefix,
        addrs,
        clients: Vec::new(),
        groups: Vec::new(),
    };
    let mut schedules = Vec::new();
    let mut rates = [0.0; CLASSES];
    match *sc {
        Scenario::Floor => {}
        Scenario::Person { pairs, rate } => schedules.push(p.person(pairs, rate)),
        Scenario::Group {
            members,
            online_share,
            groups,
            rate,
        } => schedules.push(p.group(groups, members, online_share, rate)),
        Scenario::Storm { clients, .. } => {
            for i in 0..clients {
                p.add(format!("{prefix}-s{i}"));
            }
        }
        Scenario::Mixed {
            pairs,
            person_rate,
            members,
            online_share,
            group_rate,
        } => {
            schedules.push(p.person(pairs, person_rate));
            schedules.push(p.group(1, members, online_share, group_rate));
        }
    }
    for s in &schedules {
        rates[s.class as usize] = s.rate_per_s;
    }
    if p.clients.len() > cap_clients {
        return Err(io::Error::other(format!(
            "the scenario needs {} client connections, but the open-files limit allows {cap_clients} \
             here (an embedded node holds the other end of each in this process: use an external \
             node, or fewer clients)",
            p.clients.len()
        )));
    }
    Ok(Built {
        plan: Plan {
            clients: p.clients,
            schedules,
        },
        groups: p.groups,
        rates,
    })
}

/// The clients and groups of a plan being built; uids start with `prefix`.
struct Planner<'a> {
    prefix: &'a str,
    addrs: &'a [SocketAddr],
    clients: Vec<ClientSpec>,
    groups: Vec<(String, Vec<String>)>,
}

impl Planner<'_> {
    /// Adds a client; returns its index.
    fn add(&mut self, uid: String) -> usize {
        let addr = self.addrs[self.clients.len() % self.addrs.len()];
        self.clients.push(ClientSpec {
            token: token_of(&uid),
            uid,
            addr,
            peer: None,
        });
        self.clients.len() - 1
    }

    /// `pairs` pairs, each member sending to the other, `rate` messages/s in all.
    fn person(&mut self, pairs: usize, rate: f64) -> Schedule {
        let prefix = self.prefix;
        let mut routes = Vec::with_capacity(2 * pairs);
        for i in 0..pairs {
            let a = self.add(format!("{prefix}-a{i}"));
            let b = self.add(format!("{prefix}-b{i}"));
            for (from, to) in [(a, b), (b, a)] {
                routes.push(Route {
                    client: from,
                    channel_id: self.clients[to].uid.clone(),
                    channel_type: 1,
                    fanout: 1,
                });
            }
        }
        Schedule {
            class: Class::Person,
            rate_per_s: rate,
            routes,
        }
    }

    /// A peer's group: per group, `online - 1` subscribers of the group's channel
    /// (the recipients: as many as imrouter's, whose sender is no recipient) and
    /// `online` publishers (the senders, a connection each: a Redis subscriber
    /// connection cannot PUBLISH), `rate` messages/s in all.
    fn peer_group(
        &mut self,
        proto: peer::PeerProto,
        count: usize,
        members: usize,
        share: f64,
        rate: f64,
    ) -> Schedule {
        let prefix = self.prefix;
        let online = ((members as f64 * share.clamp(0.0, 1.0)).round() as usize).min(members);
        let mut routes = Vec::new();
        for g in 0..count {
            let gid = format!("{prefix}-grp{g}");
            for j in 1..online {
                let c = self.add(format!("{prefix}-g{g}s{j}"));
                self.clients[c].peer = Some(peer::PeerRole {
                    proto,
                    subscribe: Some(gid.clone()),
                });
            }
            for j in 0..online {
                let c = self.add(format!("{prefix}-g{g}p{j}"));
                self.clients[c].peer = Some(peer::PeerRole {
                    proto,
                    subscribe: None,
                });
                routes.push(Route {
                    client: c,
                    channel_id: gid.clone(),
                    channel_type: 2,
                    fanout: online.saturating_sub(1) as u32,
                });
            }
        }
        Schedule {
            class: Class::Group,
            rate_per_s: rate,
            routes,
        }
    }

    /// `count` groups of `members`, `share` of them online and sending to their
    /// group, `rate` messages/s in all.
    fn group(&mut self, count: usize, members: usize, share: f64, rate: f64) -> Schedule {
        let prefix = self.prefix;
        let online = ((members as f64 * share.clamp(0.0, 1.0)).round() as usize).min(members);
        let mut routes = Vec::new();
        for g in 0..count {
            let gid = format!("{prefix}-grp{g}");
            let uids: Vec<String> = (0..members).map(|j| format!("{prefix}-g{g}m{j}")).collect();
            for uid in uids.iter().take(online) {
                let c = self.add(uid.clone());
                routes.push(Route {
                    client: c,
                    channel_id: gid.clone(),
                    channel_type: 2,
                    fanout: online.saturating_sub(1) as u32,
                });
            }
            self.groups.push((gid, uids));
        }
        Schedule {
            class: Class::Group,
            rate_per_s: rate,
            routes,
        }
    }
}

/// Measures the server around the phases of a run.
struct Meter {
    pid: Option<u32>,
    embedded: bool,
    rss_connected: Option<u64>,
    /// Before the first CONNECT, and once every client connected.
    cpu_at_start: Option<f64>,
    cpu_at_connected: Option<f64>,
    cpu_at_send: Option<f64>,
    cpu_at_done: Option<f64>,
}

impl Meter {
    fn rss(&self) -> Option<u64> {
        if self.embedded {
            proc::process_rss_bytes(std::process::id())
        } else {
            self.pid.and_then(proc::process_rss_bytes)
        }
    }
    fn cpu(&self) -> Option<f64> {
        if self.embedded {
            Some(proc::own_threads_cpu_s("imrouter"))
        } else {
            self.pid.and_then(proc::process_cpu_s)
        }
    }
}

impl load::PhaseHook for Meter {
    fn connected(&mut self) {
        self.cpu_at_connected = self.cpu();
        self.rss_connected = self.rss();
    }
    fn sending(&mut self) {
        self.cpu_at_send = self.cpu();
    }
    fn done(&mut self) {
        self.cpu_at_done = self.cpu();
    }
}

/// The client wire of a load configuration, as reports name it.
fn wire_name(load: &LoadConfig) -> String {
    conn::Wire {
        transport: load.transport,
        tls: load.tls.clone(),
        jsonrpc: load.jsonrpc,
    }
    .name()
}

/// Refuses the combinations the clients cannot speak.
fn check_wire(load: &LoadConfig) -> io::Result<()> {
    let ws = load.transport == Transport::WebSocket;
    if (load.tls.is_some() || load.jsonrpc) && !ws {
        return Err(io::Error::other(
            "TLS and JSON-RPC are spoken over WebSocket only",
        ));
    }
    if load.jsonrpc && load.encrypt {
        return Err(io::Error::other(
            "JSON-RPC has no message encryption: no --encrypt with --jsonrpc",
        ));
    }
    Ok(())
}

/// Runs one scenario end to end: floor, target, setup, load, summary (and files when
/// `cfg.out` is set). The embedded node is stopped before returning.
pub fn run_scenario(cfg: &BenchConfig, sc: &Scenario) -> io::Result<(Summary, Hists)> {
    check_wire(&cfg.load)?;
    let nofile = proc::raise_nofile();
    let mut summary = new_summary(cfg, sc);
    let mut hists: Hists = Vec::new();
    measure_floor(cfg, sc, &mut summary, &mut hists)?;
    if let TargetSpec::Peer(url) = &cfg.target {
        run_peer(cfg, sc, *url, nofile, &mut summary, &mut hists)?;
        finish(cfg, &summary, &hists)?;
        return Ok((summary, hists));
    }
    if matches!(sc, Scenario::Floor) {
        summary.target = "none".into();
        finish(cfg, &summary, &hists)?;
        return Ok((summary, hists));
    }
    let target = start_target(cfg)?;
    summary.target = describe_target(cfg, &target);
    let built = set_up(cfg, sc, &target, nofile)?;
    let measured = load_phase(cfg, sc, target, &built)?;
    summarize_load(&mut summary, &built, &measured.out);
    summarize_server(&mut summary, cfg, &measured);
    add_load_hists(&mut hists, measured.out);
    finish(cfg, &summary, &hists)?;
    Ok((summary, hists))
}

/// The peer server's process, for its CPU and memory: `--peer-pid`, or the process
/// listening on the peer's port; with a line saying which.
fn peer_pid(cfg: &BenchConfig, url: &peer::PeerUrl) -> (Option<u32>, String) {
    match cfg.pid {
        Some(pid) => (Some(pid), format!("pid {pid} (--peer-pid)")),
        None => match peer::pid_listening_on(url.addr) {
            Some(pid) => (
                Some(pid),
                format!("pid {pid} (listening on port {})", url.addr.port()),
            ),
            None => (
                None,
                "unknown (no --peer-pid, no process found on the port)".into(),
            ),
        },
    }
}

/// The group scenario against a peer server: its plan, the load, the client-side
/// figures, and the server's CPU from `cfg.pid` or else from the process found
/// listening on the peer's port.
fn run_peer(
    cfg: &BenchConfig,
    sc: &Scenario,
    url: peer::PeerUrl,
    nofile: u64,
    summary: &mut Summary,
    hists: &mut Hists,
) -> io::Result<()> {
    let Scenario::Group {
        members,
        online_share,
        groups,
        rate,
    } = *sc
    else {
        return Err(io::Error::other("a peer runs the group scenario only"));
    };
    if cfg.load.encrypt || cfg.load.transport != Transport::Tcp || cfg.load.jsonrpc {
        return Err(io::Error::other(
            "a peer is driven over plain TCP: no --encrypt, no --transport ws or wss, no --jsonrpc",
        ));
    }
    summary.target = url.to_string();
    let prefix = format!("ib{}x{}", std::process::id(), unix_ms() % 100_000_000);
    let mut p = Planner {
        prefix: &prefix,
        addrs: &[url.addr],
        clients: Vec::new(),
        groups: Vec::new(),
    };
    let schedule = p.peer_group(url.proto, groups, members, online_share, rate);
    let cap = nofile.saturating_sub(RESERVED_FDS) as usize;
    if p.clients.len() > cap {
        return Err(io::Error::other(format!(
            "the peer run needs {} connections, the open-files limit allows {cap}",
            p.clients.len()
        )));
    }
    let mut rates = [0.0; CLASSES];
    rates[schedule.class as usize] = schedule.rate_per_s;
    let built = Built {
        plan: Plan {
            clients: p.clients,
            schedules: vec![schedule],
        },
        groups: Vec::new(),
        rates,
    };
    let (pid, source) = peer_pid(cfg, &url);
    let mut meter = Meter {
        pid,
        embedded: false,
        rss_connected: None,
        cpu_at_start: None,
        cpu_at_connected: None,
        cpu_at_send: None,
        cpu_at_done: None,
    };
    let rss_before = meter.rss();
    meter.cpu_at_start = meter.cpu();
    let out = load::run(&built.plan, &cfg.load, &mut meter)?;
    summarize_load(summary, &built, &out);
    let m = Measured {
        out,
        meter,
        rss_before,
        text_before: String::new(),
        text_after: String::new(),
    };
    summarize_server(summary, cfg, &m);
    summary.server.source = source;
    add_load_hists(hists, m.out);
    Ok(())
}

/// The summary's description of the run, before anything is measured.
fn new_summary(cfg: &BenchConfig, sc: &Scenario) -> Summary {
    Summary {
        imbench_version: env!("CARGO_PKG_VERSION").into(),
        label: cfg.label.clone(),
        preset: cfg.preset.clone(),
        scenario: sc.name().into(),
        unix_time_s: unix_ms() / 1000,
        machine: machine(),
        transport: wire_name(&cfg.load),
        encrypt: cfg.load.encrypt,
        threads: cfg.load.threads,
        duration_s: cfg.load.duration.as_secs_f64(),
        payload_bytes: cfg.load.payload_bytes,
        ..Summary::default()
    }
}

/// The loopback echo floor: for the whole run (`floor` scenario) or `cfg.floor`
/// before it (not at all when zero).
fn measure_floor(
    cfg: &BenchConfig,
    sc: &Scenario,
    summary: &mut Summary,
    hists: &mut Hists,
) -> io::Result<()> {
    let floor_for = if matches!(sc, Scenario::Floor) {
        cfg.load.duration
    } else {
        cfg.floor
    };
    if !floor_for.is_zero() {
        let h = floor::measure(floor_for, cfg.load.payload_bytes)?;
        summary.floor_rtt = Some(Pcts::of(&h));
        summary.curves.push(("floor".into(), report::curve(&h)));
        hists.push(("floor".into(), h));
    }
    Ok(())
}

fn start_target(cfg: &BenchConfig) -> io::Result<Target> {
    match &cfg.target {
        TargetSpec::Embedded { shards, fsync, tls } => {
            Target::embedded(*shards, *fsync, tls.as_ref())
        }
        TargetSpec::External {
            tcp,
            ws,
            wss,
            api,
            bearer,
        } => Target::external(tcp, ws, wss, api, bearer.clone()),
        TargetSpec::Peer(url) => Err(io::Error::other(format!("{url} is no imrouter node"))),
    }
}

fn describe_target(cfg: &BenchConfig, target: &Target) -> String {
    if let TargetSpec::Embedded { fsync, .. } = &cfg.target {
        return format!("embedded (fsync {fsync:?})");
    }
    let list: Vec<String> = target
        .nodes
        .iter()
        .map(|n| {
            n.client_addr(cfg.load.transport, cfg.load.tls.is_some())
                .map_or_else(|_| "?".into(), |a| a.to_string())
        })
        .collect();
    format!("external {}", list.join(","))
}

/// Plans the scenario's clients within the open-files limit `nofile`, and stores
/// their tokens and groups through the target's API.
fn set_up(cfg: &BenchConfig, sc: &Scenario, target: &Target, nofile: u64) -> io::Result<Built> {
    let per_client_fds = if target.embedded.is_some() { 2 } else { 1 };
    let cap = (nofile.saturating_sub(RESERVED_FDS) / per_client_fds) as usize;
    let addrs = target
        .nodes
        .iter()
        .map(|n| n.client_addr(cfg.load.transport, cfg.load.tls.is_some()))
        .collect::<io::Result<Vec<_>>>()?;
    let prefix = format!("ib{}x{}", std::process::id(), unix_ms() % 100_000_000);
    let built = build(sc, &prefix, &addrs, cap)?;
    // The clients' descriptors reserved before the timed phases: growing the table
    // under load stalls every thread taking a descriptor (`reserve_fd_table`).
    let want = built.plan.clients.len() as u64 * per_client_fds + RESERVED_FDS;
    if let Err(e) = net::io::fd::reserve_fd_table(want) {
        eprintln!("imbench: could not reserve {want} descriptors: {e}");
    }
    if cfg.set_tokens {
        let uids: Vec<String> = built.plan.clients.iter().map(|c| c.uid.clone()).collect();
        target.control.set_tokens(&uids, token_of)?;
    }
    for (gid, members) in &built.groups {
        target.control.set_group(gid, members)?;
    }
    Ok(built)
}

/// What the load phase measured, client side and server side.
struct Measured {
    out: load::Outcome,
    meter: Meter,
    rss_before: Option<u64>,
    text_before: String,
    text_after: String,
}

/// Runs the load between two reads of the node's metrics, the meter measuring the
/// server around its phases; stops the target.
fn load_phase(
    cfg: &BenchConfig,
    sc: &Scenario,
    target: Target,
    built: &Built,
) -> io::Result<Measured> {
    let text_before = target.control.metrics_text();
    let mut meter = Meter {
        pid: cfg.pid,
        embedded: target.embedded.is_some(),
        rss_connected: None,
        cpu_at_start: None,
        cpu_at_connected: None,
        cpu_at_send: None,
        cpu_at_done: None,
    };
    let rss_before = meter.rss();
    meter.cpu_at_start = meter.cpu();
    let mut load_cfg = cfg.load.clone();
    if let Scenario::Storm {
        concurrency, rate, ..
    } = sc
    {
        load_cfg.connect_concurrency = *concurrency;
        load_cfg.connect_rate = *rate;
    }
    let out = load::run(&built.plan, &load_cfg, &mut meter)?;
    let text_after = target.control.metrics_text();
    target.shutdown()?;
    Ok(Measured {
        out,
        meter,
        rss_before,
        text_before,
        text_after,
    })
}

/// The client side's figures: connects, per class sends, RECVs and latencies,
/// errors, the harness's own cost.
fn summarize_load(summary: &mut Summary, built: &Built, out: &load::Outcome) {
    summary.clients = out.clients;
    summary.connected = out.connected;
    summary.connect = Pcts::of(&out.connect);
    summary.send_lag = Pcts::of(&out.send_lag);
    summary.connect_phase_s = out.connect_phase.as_secs_f64();
    if summary.connect_phase_s > 0.0 {
        summary.activations_per_s = out.connected as f64 / summary.connect_phase_s;
    }
    summary
        .curves
        .push(("connect".into(), report::curve(&out.connect)));
    let send_s = out.send_phase.as_secs_f64().max(1e-9);
    for class in [Class::Person, Class::Group] {
        if built.plan.schedules.iter().any(|s| s.class == class) {
            summarize_class(summary, class, built.rates[class as usize], out, send_s);
        }
    }
    let has_load = !built.plan.schedules.is_empty();
    summary.send_phase_s = if has_load { send_s } else { 0.0 };
    summary.drained = out.drained;
    summary.errors_total = out.errors.total();
    summary.errors = serde_json::to_value(&out.errors).unwrap_or_default();
    summary.dup_flagged_recvs = out.dup_flagged;
    summary.harness_cpu_s_connect = out.harness_cpu_connect_s;
    summary.harness_cpu_s_send_phase = out.harness_cpu_send_s;
    if has_load {
        summary.harness_cpu_share_send_phase = out.harness_cpu_send_s / send_s;
        let recvs: u64 = out.delivered.iter().sum();
        if recvs > 0 {
            summary.harness_cpu_us_per_recv = out.harness_cpu_send_s * 1e6 / recvs as f64;
        }
    }
    summary.harness_reads = out.send_phase_reads;
    summary.harness_writes = out.send_phase_writes;
    summary.io = match out.uring_workers {
        0 => "epoll".into(),
        n if n == out.workers => "uring".into(),
        n => format!("uring ({n} of {} workers)", out.workers),
    };
}

/// One class's row and curves (`send_s`: the send phase's length).
fn summarize_class(
    summary: &mut Summary,
    class: Class,
    rate_per_s: f64,
    out: &load::Outcome,
    send_s: f64,
) {
    let c = class as usize;
    summary.classes.push(ClassSummary {
        class: class.name().into(),
        rate_per_s,
        sent: out.sent[c],
        expected_recvs: out.expected[c],
        delivered_recvs: out.delivered[c],
        missing_recvs: out.missing[c],
        extra_recvs: out.extra[c],
        delivered_per_s: out.delivered[c] as f64 / send_s,
        sendack: Pcts::of(&out.sendack[c]),
        recv: Pcts::of(&out.recv[c]),
    });
    let n = class.name();
    summary
        .curves
        .push((format!("{n}-recv"), report::curve(&out.recv[c])));
    summary
        .curves
        .push((format!("{n}-sendack"), report::curve(&out.sendack[c])));
}

/// The server side's figures: CPU in the send phase, RSS per connection, the change
/// of each node counter, the node's stage histograms.
fn summarize_server(summary: &mut Summary, cfg: &BenchConfig, m: &Measured) {
    let has_load = summary.send_phase_s > 0.0;
    let cpu = match (m.meter.cpu_at_send, m.meter.cpu_at_done) {
        (Some(a), Some(b)) if has_load => Some(b - a),
        _ => None,
    };
    let cpu_connect = match (m.meter.cpu_at_start, m.meter.cpu_at_connected) {
        (Some(a), Some(b)) => Some(b - a),
        _ => None,
    };
    let answered: u64 = summary.classes.iter().map(|c| c.sendack.count).sum();
    let delivered: u64 = summary.classes.iter().map(|c| c.delivered_recvs).sum();
    summary.server = ServerUse {
        source: if m.meter.embedded {
            "embedded: shard threads' CPU, whole-process RSS (node + harness)".into()
        } else if let Some(p) = cfg.pid {
            format!("pid {p}")
        } else {
            "unknown (no --pid)".into()
        },
        cpu_s_send_phase: cpu,
        cpu_share_send_phase: cpu.map(|c| c / m.out.send_phase.as_secs_f64().max(1e-9)),
        cpu_s_connect_phase: cpu_connect,
        cpu_us_per_connect: report::cpu_us_per(cpu_connect, m.out.connected),
        answered_sends: answered,
        cpu_us_per_send: report::cpu_us_per(cpu, answered),
        cpu_us_per_recv: report::cpu_us_per(cpu, delivered),
        rss_bytes_before_connect: m.rss_before,
        rss_bytes_connected: m.meter.rss_connected,
        rss_bytes_per_connection: match (m.rss_before, m.meter.rss_connected) {
            (Some(a), Some(b)) if m.out.connected > 0 => {
                Some((b as f64 - a as f64) / m.out.connected as f64)
            }
            _ => None,
        },
    };
    let before = target::Control::counters(&m.text_before);
    summary.node_metrics_delta = target::Control::counters(&m.text_after)
        .iter()
        .map(|(k, v)| {
            let b = before.iter().find(|(kb, _)| kb == k).map_or(0, |(_, b)| *b);
            (k.clone(), *v as i64 - b as i64)
        })
        .filter(|(_, d)| *d != 0)
        .collect();
    summary.node_stages = report::node_stages(&m.text_before, &m.text_after);
}

/// The load's histograms, for `.hgrm` files (classes without traffic left out).
fn add_load_hists(hists: &mut Hists, out: load::Outcome) {
    hists.push(("connect".into(), out.connect));
    hists.push(("send-lag".into(), out.send_lag));
    for (c, (s, r)) in out.sendack.into_iter().zip(out.recv).enumerate() {
        let name = if c == Class::Person as usize {
            "person"
        } else {
            "group"
        };
        if !s.is_empty() || !r.is_empty() {
            hists.push((format!("{name}-sendack"), s));
            hists.push((format!("{name}-recv"), r));
        }
    }
}

fn finish(cfg: &BenchConfig, summary: &Summary, hists: &Hists) -> io::Result<()> {
    if let Some(dir) = &cfg.out {
        let refs: Vec<(String, &Histogram<u64>)> =
            hists.iter().map(|(n, h)| (n.clone(), h)).collect();
        report::write_files(dir, summary, &refs)?;
    }
    Ok(())
}

/// A default load configuration (overridden by the CLI and the tests).
pub fn default_load() -> LoadConfig {
    LoadConfig {
        transport: Transport::Tcp,
        tls: None,
        jsonrpc: false,
        io: load::IoMode::Uring,
        encrypt: false,
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        pin: true,
        duration: Duration::from_secs(5),
        drain: Duration::from_secs(2),
        payload_bytes: 64,
        connect_concurrency: 256,
        connect_rate: None,
        connect_timeout: Duration::from_secs(30),
        spin: Duration::from_micros(100),
        progress: false,
    }
}
