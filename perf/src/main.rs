//! `imbench`: the imrouter latency harness. See `imbench --help` and the `perf` crate.

#![warn(clippy::too_many_lines)] // every function at most 80 code lines (clippy.toml)

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use engine::store::FsyncPolicy;
use perf::{BenchConfig, Scenario, TargetSpec};
use proto::Transport;

#[derive(Parser)]
#[command(
    name = "imbench",
    about = "End-to-end latency harness of imrouter (wkproto over TCP, WebSocket or wss; JSON-RPC over WebSocket or wss)."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Loopback TCP echo round trip: the machine's floor.
    Floor(#[command(flatten)] Common),
    /// N online pairs, each member sending to its peer.
    Person {
        #[command(flatten)]
        common: Common,
        #[arg(long, default_value_t = 1000)]
        pairs: usize,
        /// Messages per second, all senders together.
        #[arg(long, default_value_t = 5000.0)]
        rate: f64,
    },
    /// Group fan-out: every online member sends to its group.
    #[command(args_override_self = true)]
    Group {
        #[command(flatten)]
        common: Common,
        /// One of WuKongIM's published single-node workloads. The flags it stands for
        /// are set first, so explicit flags override them (`--encrypt=false` turns
        /// its encryption off); the report's header repeats them.
        #[arg(long, value_enum)]
        preset: Option<Preset>,
        /// Subscribers per group (the sender is one of them: 101 → 100 recipients).
        #[arg(long, default_value_t = 101)]
        members: usize,
        /// Share of the members connected (0..=1).
        #[arg(long, default_value_t = 1.0)]
        online: f64,
        #[arg(long, default_value_t = 1)]
        groups: usize,
        #[arg(long, default_value_t = 2000.0)]
        rate: f64,
        #[command(flatten)]
        peer: PeerArgs,
    },
    /// Connection storm: CONNACK latency and activations/s.
    Storm {
        #[command(flatten)]
        common: Common,
        #[arg(long, default_value_t = 10_000)]
        clients: usize,
        /// CONNECTs in flight at once.
        #[arg(long, default_value_t = 256)]
        concurrency: usize,
        /// New connections per second, evenly spaced (open loop: CONNACK latency runs
        /// from each client's intended start); default: as fast as --concurrency allows.
        #[arg(long)]
        rate: Option<f64>,
    },
    /// Person and group traffic at once.
    Mixed {
        #[command(flatten)]
        common: Common,
        #[arg(long, default_value_t = 500)]
        pairs: usize,
        #[arg(long, default_value_t = 2500.0)]
        person_rate: f64,
        #[arg(long, default_value_t = 101)]
        members: usize,
        #[arg(long, default_value_t = 1.0)]
        online: f64,
        #[arg(long, default_value_t = 1000.0)]
        group_rate: f64,
    },
    /// Draws runs (imbench JSON summaries or .hgrm files) as one SVG, one curve each.
    Plot(PlotArgs),
}

#[derive(Args)]
struct PlotArgs {
    files: Vec<PathBuf>,
    #[arg(short = 'o', long, default_value = "imbench.svg")]
    output: PathBuf,
    /// Curve of a JSON summary: recv, sendack, connect, floor, or e.g. group-recv.
    #[arg(long, default_value = "recv")]
    metric: String,
    #[arg(long, default_value = "latency by percentile")]
    title: String,
    /// Legend names, comma-separated, in file order (default: label and curve).
    #[arg(long, value_delimiter = ',')]
    names: Vec<String>,
}

/// The same fan-out against Redis pub/sub or NATS, beside imrouter.
#[derive(Args, Clone)]
struct PeerArgs {
    /// Also run the fan-out against a peer: `redis://HOST:PORT` (pub/sub) or
    /// `nats://HOST:PORT`. imrouter's run and the peer's alternate (`--rounds`), then
    /// a table of medians and ratios. The peer's subscribers are the recipients
    /// (members online - 1); each sender publishes on a connection of its own.
    #[arg(long)]
    peer: Option<perf::peer::PeerUrl>,
    /// The peer server's pid, for its CPU per delivered message (default: the process
    /// listening on the peer's port, found through /proc/net/tcp and /proc/*/fd).
    #[arg(long, requires = "peer")]
    peer_pid: Option<u32>,
    /// Rounds of (imrouter run, peer run) with `--peer`.
    #[arg(long, default_value_t = 1, requires = "peer")]
    rounds: usize,
    /// With `--peer`: run the peer only (no imrouter run).
    #[arg(long, requires = "peer")]
    peer_only: bool,
}

/// What a command asks for.
enum Job {
    Load(Common, Scenario, Option<Preset>),
    Compare(Common, Scenario, Option<Preset>, PeerArgs),
    Plot(PlotArgs),
}

/// WuKongIM's published single-node workloads, as `imbench group` flags.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Preset {
    /// the send test, 40,000 SEND/s into 100 groups of 100, one member of each online:
    /// `--groups 100 --members 100 --online 0.01 --rate 40000 --encrypt --drain 15`.
    WkSend,
    /// the receive test, one 10,000-member group, 5,000 online, 40 messages/s
    /// (≈ 200,000 RECV/s): `--groups 1 --members 10000 --online 0.5 --rate 40
    /// --encrypt --duration 10 --drain 15`.
    WkRecv,
}

impl Preset {
    fn name(self) -> &'static str {
        match self {
            Preset::WkSend => "wk-send",
            Preset::WkRecv => "wk-recv",
        }
    }

    /// The `imbench group` flags the preset stands for.
    fn flags(self) -> &'static str {
        match self {
            Preset::WkSend => {
                "--groups 100 --members 100 --online 0.01 --rate 40000 --encrypt --drain 15"
            }
            Preset::WkRecv => {
                "--groups 1 --members 10000 --online 0.5 --rate 40 --encrypt --duration 10 \
                 --drain 15"
            }
        }
    }

    /// The report header's line: the name and its expansion.
    fn describe(self) -> String {
        format!(
            "{} = {} (explicit flags override)",
            self.name(),
            self.flags()
        )
    }
}

#[derive(Args, Clone)]
struct Common {
    /// Node TCP addresses, comma-separated (one per node): the clients are spread
    /// over them round robin (a cluster: `perf/cluster.sh`).
    #[arg(long, value_delimiter = ',')]
    tcp: Vec<SocketAddr>,
    /// Node WebSocket addresses, comma-separated.
    #[arg(long, value_delimiter = ',')]
    ws: Vec<SocketAddr>,
    /// Node wss (WebSocket over TLS) addresses, comma-separated (`--transport wss`).
    #[arg(long, value_delimiter = ',')]
    wss: Vec<SocketAddr>,
    /// Node HTTP API addresses, comma-separated (the first one is used for setup).
    #[arg(long, value_delimiter = ',')]
    api: Vec<SocketAddr>,
    /// Bearer token of the HTTP API.
    #[arg(long)]
    api_token: Option<String>,
    /// Start a node in this process (the default when no address is given).
    #[arg(long)]
    embedded: bool,
    /// Embedded node: the log's fsync policy: `always` (sync before every SENDACK
    /// batch) or a number of ms between syncs. Default: the node's default.
    #[arg(long, value_parser = parse_fsync)]
    fsync: Option<FsyncPolicy>,
    /// Shards of the embedded node (0: one per core).
    #[arg(long, default_value_t = 0)]
    shards: u16,
    /// Backend of the harness's event loops (`net::io::NetDriver`, connect and send
    /// phases): `uring` (io_uring; epoll where the kernel refuses it) or `epoll`
    /// (mio).
    #[arg(long, value_enum, default_value = "uring")]
    io: IoArg,
    /// How the clients connect: `tcp`, `ws` (WebSocket) or `wss` (WebSocket over TLS:
    /// needs `--ca` or `--tls-insecure`).
    #[arg(long, value_enum, default_value = "tcp")]
    transport: TransportArg,
    /// Speak JSON-RPC in WebSocket text messages (WuKongIM's EasySDKs' protocol)
    /// instead of binary wkproto (`--transport ws` or `wss`; no `--encrypt`).
    #[arg(long)]
    jsonrpc: bool,
    /// wss: trust the CA certificate(s) of this PEM file (the node's certificate must
    /// name the address's IP, or `--tls-name`).
    #[arg(long, value_name = "FILE")]
    ca: Option<PathBuf>,
    /// wss: accept any certificate (a node on loopback only; the handshake is the
    /// same full one).
    #[arg(long, conflicts_with = "ca")]
    tls_insecure: bool,
    /// wss: the server name checked against the certificate (default: the address's IP).
    #[arg(long, value_name = "NAME")]
    tls_name: Option<String>,
    /// Encrypted SENDs and RECVs (full per-message cost) and client-side key agreement
    /// (`--encrypt=false`: off, e.g. over a preset's `--encrypt`).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true",
          action = clap::ArgAction::Set, default_value_t = false)]
    encrypt: bool,
    /// Load threads (event loops), one per core by default.
    #[arg(long)]
    threads: Option<usize>,
    /// Do not pin the load threads.
    #[arg(long)]
    no_pin: bool,
    /// Send phase length, seconds (floor: measurement length).
    #[arg(long, default_value_t = 5.0)]
    duration: f64,
    /// Longest wait for stragglers after the send phase, seconds.
    #[arg(long, default_value_t = 2.0)]
    drain: f64,
    #[arg(long, default_value_t = 64)]
    payload: usize,
    /// CONNECTs in flight at once while setting up (storm: --concurrency).
    #[arg(long, default_value_t = 256)]
    connect_concurrency: usize,
    /// Wake this many µs before each intended send and spin until it is due.
    #[arg(long, default_value_t = 100)]
    spin_us: u64,
    /// Floor measured before each run, milliseconds (0: skip).
    #[arg(long, default_value_t = 300)]
    floor_ms: u64,
    /// Server pid (external node): CPU seconds and RSS from /proc.
    #[arg(long)]
    pid: Option<u32>,
    /// Directory for the JSON summary and .hgrm files.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Name of this run (file names, plot legend).
    #[arg(long)]
    label: Option<String>,
    /// Do not set tokens through the API (node without token auth).
    #[arg(long)]
    no_tokens: bool,
}

#[derive(clap::ValueEnum, Clone, Copy, PartialEq, Eq)]
enum TransportArg {
    Tcp,
    Ws,
    Wss,
}

#[derive(clap::ValueEnum, Clone, Copy)]
enum IoArg {
    Uring,
    Epoll,
}

/// `always`, or the ms between syncs.
fn parse_fsync(s: &str) -> Result<FsyncPolicy, String> {
    match s {
        "always" => Ok(FsyncPolicy::Always),
        ms => ms
            .parse()
            .map(FsyncPolicy::IntervalMs)
            .map_err(|_| format!("--fsync takes `always` or a number of ms, not {ms:?}")),
    }
}

fn config(c: &Common, scenario: &str, preset: Option<Preset>) -> Result<BenchConfig, String> {
    let any_addr = !(c.tcp.is_empty() && c.ws.is_empty() && c.wss.is_empty() && c.api.is_empty());
    let external = any_addr && !c.embedded;
    let target = if external {
        TargetSpec::External {
            tcp: c.tcp.clone(),
            ws: c.ws.clone(),
            wss: c.wss.clone(),
            api: c.api.clone(),
            bearer: c.api_token.clone(),
        }
    } else {
        TargetSpec::Embedded {
            shards: c.shards,
            fsync: c.fsync.unwrap_or(engine::store::LogConfig::default().fsync),
            tls: None,
        }
    };
    let mut load = perf::default_load();
    load.transport = match c.transport {
        TransportArg::Tcp => Transport::Tcp,
        TransportArg::Ws | TransportArg::Wss => Transport::WebSocket,
    };
    load.jsonrpc = c.jsonrpc;
    let tls_flags = c.ca.is_some() || c.tls_insecure || c.tls_name.is_some();
    if tls_flags && c.transport != TransportArg::Wss {
        return Err("--ca, --tls-insecure and --tls-name go with --transport wss".into());
    }
    if c.transport == TransportArg::Wss {
        if c.ca.is_none() && !c.tls_insecure {
            return Err("--transport wss needs --ca FILE or --tls-insecure".into());
        }
        let tls = perf::tls::ClientTls::new(c.ca.as_deref(), c.tls_name.as_deref());
        load.tls = Some(tls.map_err(|e| e.to_string())?);
    }
    load.io = match c.io {
        IoArg::Uring => perf::load::IoMode::Uring,
        IoArg::Epoll => perf::load::IoMode::Epoll,
    };
    load.encrypt = c.encrypt;
    if let Some(t) = c.threads {
        load.threads = t.max(1);
    }
    load.pin = !c.no_pin;
    load.duration = Duration::from_secs_f64(c.duration.max(0.0));
    load.drain = Duration::from_secs_f64(c.drain.max(0.0));
    load.payload_bytes = c.payload;
    load.connect_concurrency = c.connect_concurrency.max(1);
    load.spin = Duration::from_micros(c.spin_us);
    load.progress = c.duration >= 3.0;
    let name = preset.map_or(scenario, |p| p.name());
    Ok(BenchConfig {
        label: c.label.clone().unwrap_or_else(|| name.to_string()),
        preset: preset.map(Preset::describe),
        target,
        pid: c.pid,
        load,
        floor: Duration::from_millis(c.floor_ms),
        out: c.out.clone(),
        set_tokens: !c.no_tokens,
    })
}

/// Parses the command line. `group --preset P` is parsed again with P's flags
/// inserted right after `group`, ahead of the user's own: the group command lets a
/// later occurrence of a flag override an earlier one, so explicit flags win.
fn parse_cli(argv: Vec<std::ffi::OsString>) -> Result<Cli, clap::Error> {
    let cli = Cli::try_parse_from(&argv)?;
    let Cmd::Group {
        preset: Some(preset),
        ..
    } = &cli.cmd
    else {
        return Ok(cli);
    };
    // The first `group` after the program name is the subcommand: `Cli` itself takes
    // no option with a value.
    let at = argv
        .iter()
        .skip(1)
        .position(|a| a == "group")
        .map_or(argv.len(), |i| i + 2);
    let mut expanded = argv[..at].to_vec();
    expanded.extend(preset.flags().split_whitespace().map(Into::into));
    expanded.extend_from_slice(&argv[at..]);
    Cli::try_parse_from(expanded)
}

fn main() -> ExitCode {
    let cli = parse_cli(std::env::args_os().collect()).unwrap_or_else(|e| e.exit());
    let configured = |common: &Common, scenario: &Scenario, preset| {
        config(common, scenario.name(), preset).map_err(|e| {
            eprintln!("imbench: {e}");
            ExitCode::FAILURE
        })
    };
    match job(cli.cmd) {
        Job::Load(common, scenario, preset) => match configured(&common, &scenario, preset) {
            Ok(cfg) => run(&cfg, &scenario),
            Err(code) => code,
        },
        Job::Plot(args) => plot(&args),
        Job::Compare(common, scenario, preset, peer) => {
            match configured(&common, &scenario, preset) {
                Ok(cfg) => compare(&cfg, &scenario, &peer),
                Err(code) => code,
            }
        }
    }
}

/// `imbench group --peer URL`: imrouter's run then the peer's, `--rounds` times,
/// each report printed as it ends, then the side-by-side table.
fn compare(base: &BenchConfig, scenario: &Scenario, args: &PeerArgs) -> ExitCode {
    let Some(url) = args.peer else {
        return run(base, scenario);
    };
    let (mut node, mut peer) = (Vec::new(), Vec::new());
    let mut clean = true;
    for r in 1..=args.rounds.max(1) {
        let mut runs = vec![];
        if !args.peer_only {
            let mut cfg = base.clone();
            cfg.label = format!("{}-imrouter-r{r}", base.label);
            runs.push((cfg, false));
        }
        let mut cfg = base.clone();
        cfg.label = format!("{}-{}-r{r}", base.label, url.proto.name());
        cfg.target = TargetSpec::Peer(url);
        cfg.pid = args.peer_pid;
        cfg.set_tokens = false;
        runs.push((cfg, true));
        for (cfg, is_peer) in runs {
            match perf::run_scenario(&cfg, scenario) {
                Ok((summary, _)) => {
                    print!("{}", perf::report::table(&summary));
                    clean &= summary.clean();
                    if is_peer { &mut peer } else { &mut node }.push(summary);
                }
                Err(e) => {
                    eprintln!("imbench: {}: {e}", cfg.label);
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    if !node.is_empty() {
        print!("{}", perf::report::compare(&node, &peer, url.proto.name()));
    }
    if clean {
        ExitCode::SUCCESS
    } else {
        eprintln!("imbench: accounting not clean (errors or missing RECVs), see above");
        ExitCode::from(2)
    }
}

/// `imbench plot`: one curve per file, named by `--names` in file order.
fn plot(args: &PlotArgs) -> ExitCode {
    let mut curves = Vec::new();
    for (i, f) in args.files.iter().enumerate() {
        match perf::plot::read_curve(f, &args.metric) {
            Ok(mut c) => {
                if let Some(n) = args.names.get(i) {
                    c.name = n.clone();
                }
                curves.push(c)
            }
            Err(e) => {
                eprintln!("imbench plot: {}: {e}", f.display());
                return ExitCode::FAILURE;
            }
        }
    }
    let output = &args.output;
    if let Err(e) = std::fs::write(output, perf::plot::svg(&curves, &args.title)) {
        eprintln!("imbench plot: {}: {e}", output.display());
        return ExitCode::FAILURE;
    }
    println!("wrote {}", output.display());
    ExitCode::SUCCESS
}

/// The job of a command: a load scenario with its common options, or a plot.
fn job(cmd: Cmd) -> Job {
    let mut preset = None;
    let (common, scenario) = match cmd {
        Cmd::Plot(args) => return Job::Plot(args),
        Cmd::Floor(c) => (c, Scenario::Floor),
        Cmd::Person {
            common,
            pairs,
            rate,
        } => (common, Scenario::Person { pairs, rate }),
        Cmd::Group {
            common,
            preset: p,
            members,
            online,
            groups,
            rate,
            peer,
        } => {
            let scenario = Scenario::Group {
                members,
                online_share: online,
                groups,
                rate,
            };
            if peer.peer.is_some() {
                return Job::Compare(common, scenario, p, peer);
            }
            preset = p;
            (common, scenario)
        }
        Cmd::Storm {
            common,
            clients,
            concurrency,
            rate,
        } => (
            common,
            Scenario::Storm {
                clients,
                concurrency,
                rate,
            },
        ),
        Cmd::Mixed {
            common,
            pairs,
            person_rate,
            members,
            online,
            group_rate,
        } => (
            common,
            Scenario::Mixed {
                pairs,
                person_rate,
                members,
                online_share: online,
                group_rate,
            },
        ),
    };
    Job::Load(common, scenario, preset)
}

/// Runs a scenario and prints its report; exit 2 when the accounting is not clean.
fn run(cfg: &BenchConfig, scenario: &Scenario) -> ExitCode {
    match perf::run_scenario(cfg, scenario) {
        Ok((summary, _)) => {
            print!("{}", perf::report::table(&summary));
            if let Some(dir) = &cfg.out {
                println!(
                    "wrote {}/{}.json and .hgrm files",
                    dir.display(),
                    summary.label
                );
            }
            if summary.clean() || matches!(scenario, Scenario::Floor) {
                ExitCode::SUCCESS
            } else {
                eprintln!("imbench: accounting not clean (errors or missing RECVs), see above");
                ExitCode::from(2)
            }
        }
        Err(e) => {
            eprintln!("imbench: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The common options and group parameters `argv` asks for.
    fn group_of(argv: &str) -> (Common, usize, usize, f64, f64) {
        let cli = parse_cli(argv.split_whitespace().map(Into::into).collect())
            .unwrap_or_else(|e| panic!("{argv}: {e}"));
        let Job::Load(
            common,
            Scenario::Group {
                members,
                online_share,
                groups,
                rate,
            },
            _,
        ) = job(cli.cmd)
        else {
            panic!("{argv}: not a group run");
        };
        (common, groups, members, online_share, rate)
    }

    #[test]
    fn presets_set_defaults_that_explicit_flags_override() {
        let (c, groups, members, online, rate) = group_of("imbench group --preset wk-send");
        assert_eq!((groups, members, online, rate), (100, 100, 0.01, 40_000.0));
        assert!(c.encrypt);
        assert_eq!((c.duration, c.drain), (5.0, 15.0));

        let (c, groups, members, online, rate) = group_of("imbench group --preset wk-recv");
        assert_eq!((groups, members, online, rate), (1, 10_000, 0.5, 40.0));
        assert!(c.encrypt);
        assert_eq!((c.duration, c.drain), (10.0, 15.0));

        // Explicit flags win, before or after --preset; the rest of the preset stays.
        let (c, groups, members, online, rate) = group_of(
            "imbench group --rate 20000 --preset wk-send --encrypt=false --drain 3 --pid 7",
        );
        assert_eq!((groups, members, online, rate), (100, 100, 0.01, 20_000.0));
        assert!(!c.encrypt);
        assert_eq!((c.duration, c.drain, c.pid), (5.0, 3.0, Some(7)));

        // No preset: the plain defaults, and a bare --encrypt still means on.
        let (c, groups, members, online, rate) = group_of("imbench group --encrypt");
        assert_eq!((groups, members, online, rate), (1, 101, 1.0, 2000.0));
        assert!(c.encrypt);
        assert_eq!((c.duration, c.drain), (5.0, 2.0));
    }

    /// `--transport wss` needs a trust choice, and the TLS flags need wss; the wire
    /// flags reach the load configuration.
    #[test]
    fn wire_flags_are_checked_and_carried() {
        let cfg = |argv: &str| {
            let cli = parse_cli(argv.split_whitespace().map(Into::into).collect()).unwrap();
            let Job::Load(common, scenario, preset) = job(cli.cmd) else {
                panic!("{argv}: not a load run");
            };
            config(&common, scenario.name(), preset)
        };
        let e = cfg("imbench storm --transport wss").err().unwrap();
        assert!(e.contains("--ca FILE or --tls-insecure"), "{e}");
        let e = cfg("imbench storm --transport ws --tls-insecure")
            .err()
            .unwrap();
        assert!(e.contains("go with --transport wss"), "{e}");
        let e = cfg("imbench storm --transport wss --ca /nonexistent/ca.pem")
            .err()
            .unwrap();
        assert!(e.contains("/nonexistent/ca.pem"), "{e}");
        let c = cfg("imbench storm --transport wss --tls-insecure --wss 127.0.0.1:1 --rate 50")
            .unwrap();
        assert!(c.load.tls.is_some() && !c.load.jsonrpc);
        assert_eq!(c.load.transport, Transport::WebSocket);
        let c = cfg("imbench person --transport ws --jsonrpc").unwrap();
        assert!(c.load.tls.is_none() && c.load.jsonrpc);
    }

    /// `imbench group --help` shows each preset's expansion, word for word.
    #[test]
    fn group_help_lists_each_presets_flags() {
        use clap::CommandFactory;
        let mut cmd = Cli::command();
        let help = cmd
            .find_subcommand_mut("group")
            .unwrap()
            .render_long_help()
            .to_string();
        let words: Vec<&str> = help.split_whitespace().collect();
        for p in [Preset::WkSend, Preset::WkRecv] {
            let flags: Vec<&str> = p.flags().split_whitespace().collect();
            assert!(
                words
                    .windows(flags.len())
                    .any(|w| w.iter().zip(&flags).all(|(a, b)| a.trim_matches('`') == *b)),
                "{}: {help}",
                p.name()
            );
        }
    }
}
