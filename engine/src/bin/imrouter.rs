//! `imrouter`: one node. With no arguments it serves WuKongIM's default ports on
//! 127.0.0.1 (TCP 5100, WebSocket 5200, HTTP API 5001) with data under `./data`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use engine::config::{Config, IoBackend};
use engine::node::Node;

/// A node of an instant-messaging cluster (WuKongIM protocol).
#[derive(Parser, Debug)]
#[command(name = "imrouter", version, about)]
struct Args {
    /// TOML configuration file; flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// This node's id.
    #[arg(long)]
    node_id: Option<u64>,
    /// Client TCP listener.
    #[arg(long)]
    tcp_addr: Option<std::net::SocketAddr>,
    /// Client WebSocket listener.
    #[arg(long)]
    ws_addr: Option<std::net::SocketAddr>,
    /// HTTP API listener.
    #[arg(long)]
    api_addr: Option<std::net::SocketAddr>,
    /// Where the message logs and metadata live.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Shard threads (default: one per core).
    #[arg(long)]
    shards: Option<u16>,
    /// IO backend.
    #[arg(long, value_enum)]
    io: Option<IoBackend>,
    /// Require the token stored with /user/token on CONNECT.
    #[arg(long, value_parser = ["on", "off"])]
    token_auth: Option<String>,
    /// Print the full configuration (defaults, the file and the flags merged) as TOML and exit.
    #[arg(long)]
    print_config: bool,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let mut config = match &args.config {
        Some(path) => match Config::load(path) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("imrouter: {e}");
                return ExitCode::from(2);
            }
        },
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
    if let Some(v) = args.data_dir {
        config.node.data_dir = v;
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
    if args.print_config {
        match config.to_toml() {
            Ok(text) => {
                print!("{text}");
                return ExitCode::SUCCESS;
            }
            Err(e) => {
                eprintln!("imrouter: {e}");
                return ExitCode::from(2);
            }
        }
    }
    let node_config = match config.to_node_config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("imrouter: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    let node = match Node::start(node_config) {
        Ok(n) => n,
        Err(e) => {
            tracing::error!(%e, "could not start");
            return ExitCode::FAILURE;
        }
    };
    tracing::info!(
        tcp = ?node.tcp_addr(),
        ws = ?node.ws_addr(),
        api = ?node.api_addr(),
        "imrouter node {} serving",
        config.node.node_id
    );
    // Wait for SIGTERM or SIGINT, then shut down gracefully.
    let mut signals = match signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
    ]) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(%e, "could not install signal handlers");
            return ExitCode::FAILURE;
        }
    };
    // A shard that ends on its own (panic, driver error) is fatal: the node stops
    // and exits non-zero so the service manager restarts it.
    let mut failure = None;
    loop {
        if let Some(sig) = signals.pending().next() {
            tracing::info!(
                signal = sig,
                "shutting down: disconnecting sessions, flushing logs"
            );
            break;
        }
        if let Some(cause) = node.wait_failure(std::time::Duration::from_millis(100)) {
            tracing::error!(%cause, "a shard failed: stopping the node");
            failure = Some(cause);
            break;
        }
    }
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
