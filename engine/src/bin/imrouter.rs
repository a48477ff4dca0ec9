//! `imrouter`: one node. With no arguments it serves WuKongIM's default ports on
//! 127.0.0.1 (TCP 5100, WebSocket 5200, HTTP API 5001) with data under `./data`.
//! `imrouter check-host [flags]` judges this machine against the configuration the
//! same flags describe (engine::hostcheck) and exits 1 when it would not carry it.

#![warn(clippy::too_many_lines)] // every function at most 80 code lines (clippy.toml)

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use engine::config::{Config, IoBackend};
use engine::node::Node;

/// A node of an instant-messaging cluster (WuKongIM protocol).
#[derive(Parser, Debug)]
#[command(
    name = "imrouter",
    version,
    about = "imrouter: an instant-messaging router node (WuKongIM binary protocol and HTTP API)"
)]
struct Args {
    /// TOML configuration file; flags override it.
    #[arg(global = true, long)]
    config: Option<PathBuf>,
    /// This node's id.
    #[arg(global = true, long)]
    node_id: Option<u64>,
    /// Client TCP listener.
    #[arg(global = true, long)]
    tcp_addr: Option<std::net::SocketAddr>,
    /// Client WebSocket listener.
    #[arg(global = true, long)]
    ws_addr: Option<std::net::SocketAddr>,
    /// HTTP API listener.
    #[arg(global = true, long)]
    api_addr: Option<std::net::SocketAddr>,
    /// Where the message logs and metadata live.
    #[arg(global = true, long)]
    data_dir: Option<PathBuf>,
    /// Shard threads (default: one per core).
    #[arg(global = true, long)]
    shards: Option<u16>,
    /// IO backend.
    #[arg(global = true, long, value_enum)]
    io: Option<IoBackend>,
    /// Require the token stored with /user/token on CONNECT.
    #[arg(global = true, long, value_parser = ["on", "off"])]
    token_auth: Option<String>,
    /// Print the full configuration (defaults, the file and the flags merged) as TOML and exit.
    #[arg(long)]
    print_config: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

/// Subcommands; without one the node runs.
#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Checks this host against the configuration (exit 1: it would not carry it).
    ///
    /// The configuration is the one the same file and flags describe. Checks the
    /// open-file limit, somaxconn, io_uring, the shard cores and their isolation,
    /// governor, THP and other processes on them. Prints a table and a verdict; exit
    /// 1 when a setting would break the configured load, 2 for an invalid
    /// configuration, 0 otherwise (warnings included).
    CheckHost,
}

fn main() -> ExitCode {
    // Colours only for a terminal: a file or journald gets plain text.
    tracing_subscriber::fmt()
        .with_ansi(std::io::stdout().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let config = match load_config(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("imrouter: {e}");
            return ExitCode::from(2);
        }
    };
    if args.print_config {
        return print_config(&config);
    }
    if let Some(Command::CheckHost) = args.command {
        return check_host(&config);
    }
    let node = match start(&config) {
        Ok(n) => n,
        Err(code) => return code,
    };
    let failure = match wait_for_stop(&node) {
        Ok(f) => f,
        Err(code) => return code,
    };
    match node.shutdown() {
        Ok(()) if failure.is_none() => {
            tracing::info!("stopped");
            ExitCode::SUCCESS
        }
        Ok(()) => ExitCode::FAILURE,
        Err(e) => {
            tracing::error!(%e, "shutdown failed");
            ExitCode::FAILURE
        }
    }
}

/// The configuration: the defaults, or the `--config` file, with the flags applied
/// over it. Refuses a file that cannot be read or parsed.
fn load_config(args: &Args) -> Result<Config, String> {
    let mut config = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    if let Some(v) = args.node_id {
        config.node.node_id = v;
    }
    if let Some(v) = args.tcp_addr {
        config.listen.tcp_addr = v.to_string();
    }
    if let Some(v) = args.ws_addr {
        config.listen.ws_addr = v.to_string();
    }
    if let Some(v) = args.api_addr {
        config.listen.api_addr = v.to_string();
    }
    if let Some(v) = &args.data_dir {
        config.node.data_dir = v.clone();
    }
    if let Some(v) = args.shards {
        config.runtime.shard_count = v;
    }
    if let Some(v) = args.io {
        config.net.backend = v.into();
    }
    if let Some(v) = &args.token_auth {
        config.auth.token_auth = v == "on";
    }
    Ok(config)
}

/// `--print-config`: the configuration as TOML, then what the node computes from it
/// at start. Exit 2 when it cannot be written as TOML.
fn print_config(config: &Config) -> ExitCode {
    match config.to_toml() {
        Ok(text) => {
            print!("{text}{}", computed_limits(config));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("imrouter: {e}");
            ExitCode::from(2)
        }
    }
}

/// `check-host`: the findings for `config` on this host as a table, then the
/// verdict. Exit 1 when one would break the configured load, 2 for an invalid
/// configuration.
fn check_host(config: &Config) -> ExitCode {
    use engine::hostcheck;
    let load = match hostcheck::Load::from_config(config) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("imrouter: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    let facts = hostcheck::HostFacts::read(&load, &config.net);
    let findings = hostcheck::evaluate(&load, &facts);
    print!("{}", hostcheck::render(&findings));
    println!("{}", hostcheck::verdict(&findings));
    if hostcheck::failed(&findings) {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// Starts the node and logs its addresses. Refuses an invalid configuration (exit 2)
/// and a node that cannot start (exit 1), each with its error.
fn start(config: &Config) -> Result<Node, ExitCode> {
    let node_config = config.to_node_config().map_err(|e| {
        eprintln!("imrouter: invalid configuration: {e}");
        ExitCode::from(2)
    })?;
    let node = Node::start(node_config).map_err(|e| {
        tracing::error!(%e, "could not start");
        ExitCode::FAILURE
    })?;
    tracing::info!(
        tcp = ?node.tcp_addr(),
        ws = ?node.ws_addr(),
        wss = ?node.wss_addr(),
        api = ?node.api_addr(),
        "imrouter node {} serving",
        config.node.node_id
    );
    Ok(node)
}

/// Waits for SIGTERM or SIGINT (then `None`) or for a shard that ends on its own, a
/// panic or a driver error (then its cause: fatal, the node stops and exits non-zero
/// so the service manager restarts it). SIGHUP reloads the `wss://` certificate
/// ([`reload_tls`]). Exit 1 when the signal handlers cannot be installed.
fn wait_for_stop(node: &Node) -> Result<Option<String>, ExitCode> {
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGHUP,
    ])
    .map_err(|e| {
        tracing::error!(%e, "could not install signal handlers");
        ExitCode::FAILURE
    })?;
    loop {
        if let Some(sig) = signals.pending().next() {
            if sig == signal_hook::consts::SIGHUP {
                reload_tls(node);
                continue;
            }
            tracing::info!(
                signal = sig,
                "shutting down: disconnecting sessions, flushing logs"
            );
            return Ok(None);
        }
        if let Some(cause) = node.wait_failure(std::time::Duration::from_millis(100)) {
            tracing::error!(%cause, "a shard failed: stopping the node");
            return Ok(Some(cause));
        }
    }
}

/// SIGHUP: loads `[tls] cert_file` and `key_file` again; the next handshakes present
/// them, connections already up keep theirs. A pair that does not load is logged
/// with its file and reason, and the certificate in use stays.
fn reload_tls(node: &Node) {
    let Some(tls) = node.shared().config.tls.as_ref() else {
        tracing::info!("SIGHUP: no [tls] certificate to reload");
        return;
    };
    match tls.reload() {
        Ok(()) => tracing::info!(
            cert_file = %tls.config().cert_file.display(),
            expires_in_s = tls.expires_in_s(engine::config::unix_now()),
            "SIGHUP: TLS certificate reloaded"
        ),
        Err(e) => tracing::error!(%e, "SIGHUP: TLS certificate not reloaded; the old one stays"),
    }
}

/// What the node computes at start from the configuration and the machine, as TOML
/// comments for `--print-config`: the descriptor budget and the worst cases of the
/// byte budgets.
fn computed_limits(config: &Config) -> String {
    let net = &config.net;
    let shards = u64::from(config.runtime.shard_count.max(1));
    let mut out = String::from("\n# Computed at start (not settings):\n");
    let mut cap = net.connections_per_shard_max as u64;
    match (net::io::fd::nofile_limit(), config.to_node_config()) {
        (Ok((soft, hard)), Ok(node_config)) => {
            let limit = net::io::fd::raisable_limit(hard).max(soft);
            let b = engine::node::fd_budget(&node_config, limit);
            cap = b.per_shard_cap;
            out.push_str(&format!(
                "# RLIMIT_NOFILE: soft {soft}, hard {hard}; raised at start to {limit}.\n\
                 # Reserved descriptors: {} (fd_reserve {} + {} per shard for log segments, \
                 listeners, accepts in flight, rings).\n\
                 # Each of the {shards} shards accepts at most {} connections (TCP and \
                 WebSocket together).\n",
                b.reserve,
                net.fd_reserve,
                engine::node::fd_per_shard(&node_config),
                b.per_shard_cap
            ));
            if b.over_committed() {
                let outcome = if node_config.connection_cap_set {
                    "the node refuses to start (raise the hard limit, e.g. LimitNOFILE=, or \
                     lower connections_per_shard_max)"
                } else {
                    "the node lowers the default cap to fit (raise the hard limit, e.g. \
                     LimitNOFILE=, to keep it)"
                };
                out.push_str(&format!(
                    "# WARNING: connections_per_shard_max = {} needs {} descriptors; the limit \
                     allows {} per shard: {outcome}.\n",
                    b.configured_cap,
                    b.configured_cap * shards + b.reserve,
                    b.per_shard_cap
                ));
            }
        }
        (Err(e), _) => out.push_str(&format!("# RLIMIT_NOFILE unreadable: {e}\n")),
        (_, Err(e)) => out.push_str(&format!("# invalid configuration: {e}\n")),
    }
    let keep = 2 * 4096u64; // Both output buffers' kept capacity per connection.
    out.push_str(&format!(
        "# Client output memory, worst case per shard: outbound_budget_bytes_per_shard {} \
         + {cap} connections x {keep} B of kept buffers = {} MiB.\n",
        net.outbound_budget_bytes_per_shard,
        (net.outbound_budget_bytes_per_shard as u64 + cap * keep) >> 20
    ));
    out
}
