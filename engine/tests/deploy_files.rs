//! `deploy/` is what an operator installs (README, "Deploying"); these tests keep it
//! consistent with the node and with the README:
//! - the sample cluster configs parse, refuse to start without the cluster secret or
//!   the API's bearer token and validate with both (from the environment), describe one cluster (the same node list and view on every
//!   node, each node's own `rpc_addr` listed), and use loopback addresses only;
//! - the unit runs the binary where the README installs it, with the config path the
//!   README names, stops with SIGTERM, filters no io_uring system call, and its
//!   `LimitNOFILE` (within the drop-in's `fs.nr_open`) covers the descriptors every
//!   sample's connections need, as the node computes them (`fd_budget`);
//! - the drop-in's `somaxconn` is at least every sample's listen backlog;
//! - the commented `CPUAffinity=` example contains the samples' `pin_cores`;
//! - every metric the "Deploying" section names is a row of the README's metrics
//!   table (which `readme_metrics.rs` ties to what `/metrics` exports).
//!
//! `scripts/check-deploy` checks the same files with `systemd-analyze verify` and
//! `sysctl --dry-run`.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use engine::config::{Config, API_BEARER_TOKEN_ENV, CLUSTER_SECRET_ENV};
use engine::node::NodeConfig;

const UNIT: &str = "deploy/imrouter.service";
const SYSCTL: &str = "deploy/sysctl.d/60-imrouter.conf";
const BINARY: &str = "/usr/local/bin/imrouter";
const CONFIG_PATH: &str = "/etc/imrouter/imrouter.toml";
const DATA_DIR: &str = "/var/lib/imrouter";
const SECRET: &str = "a-sample-secret-of-32-bytes-0000";
const API_TOKEN: &str = "a-sample-api-token";

fn read(rel: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The values of `key` on the active (not commented) lines of a unit file.
fn unit_values(unit: &str, key: &str) -> Vec<String> {
    unit.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#') && !l.starts_with(';'))
        .filter_map(|l| l.split_once('='))
        .filter(|(k, _)| k.trim() == key)
        .map(|(_, v)| v.trim().to_string())
        .collect()
}

/// The one value of `key` in the unit.
fn unit_value(unit: &str, key: &str) -> String {
    let v = unit_values(unit, key);
    assert_eq!(v.len(), 1, "{UNIT}: {key}= set once: {v:?}");
    v[0].clone()
}

/// The value of `key` in a sysctl drop-in.
fn sysctl_value(conf: &str, key: &str) -> String {
    conf.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .find(|(k, _)| k.trim() == key)
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_else(|| panic!("{SYSCTL}: no {key}"))
}

/// (node id, config text, the config parsed with the secret in the environment)
/// of each sample.
fn samples() -> Vec<(u64, String, Config)> {
    (1..=3)
        .map(|n| {
            let text = read(&format!("deploy/cluster/node{n}.toml"));
            let env = |k: &str| match k {
                CLUSTER_SECRET_ENV => Some(SECRET.to_string()),
                API_BEARER_TOKEN_ENV => Some(API_TOKEN.to_string()),
                _ => None,
            };
            let config = Config::parse(&text, env)
                .unwrap_or_else(|e| panic!("deploy/cluster/node{n}.toml: {e}"));
            (n, text, config)
        })
        .collect()
}

fn node_config(n: u64, config: &Config) -> NodeConfig {
    config
        .to_node_config()
        .unwrap_or_else(|e| panic!("deploy/cluster/node{n}.toml: {e}"))
}

/// The section of the README from `## Deploying` to the next `## `.
fn deploying_section(readme: &str) -> &str {
    let start = readme
        .find("\n## Deploying\n")
        .expect("README has ## Deploying");
    let rest = &readme[start + 1..];
    let end = rest[3..].find("\n## ").map_or(rest.len(), |i| i + 3);
    &rest[..end]
}

#[test]
fn the_samples_refuse_to_start_without_the_secret_and_validate_with_it() {
    for (n, text, config) in samples() {
        let bare = Config::parse(&text, |_| None).unwrap();
        let e = bare.to_node_config().unwrap_err();
        assert!(e.contains("cluster.secret"), "node{n}.toml: {e}");
        let secret_only = |k: &str| (k == CLUSTER_SECRET_ENV).then(|| SECRET.to_string());
        let e = Config::parse(&text, secret_only)
            .unwrap()
            .to_node_config()
            .unwrap_err();
        assert!(e.contains("auth.api_bearer_token"), "node{n}.toml: {e}");
        let c = node_config(n, &config);
        let token = c.api.bearer_token.as_ref().map(|t| t.expose());
        assert_eq!(token, Some(API_TOKEN.as_bytes()));
        assert_eq!(c.node_id, n);
        let me = c.cluster.nodes.iter().find(|m| m.id == n).unwrap();
        assert_eq!(c.rpc_addr, Some(me.rpc_addr), "node{n}.toml");
        assert_eq!(c.api.addr, Some(me.api_addr), "node{n}.toml");
        assert_eq!(c.data_dir, PathBuf::from(DATA_DIR), "node{n}.toml");
        assert_eq!(c.cluster.secret.expose(), SECRET.as_bytes());
    }
}

#[test]
fn the_three_samples_describe_one_cluster_on_loopback() {
    let samples = samples();
    let (_, _, first) = &samples[0];
    let ids: Vec<u64> = first.cluster.nodes.iter().map(|m| m.id).collect();
    assert_eq!(ids, [1, 2, 3]);
    let mut listen = Vec::new();
    for (n, _, config) in &samples {
        assert_eq!(
            config.cluster, first.cluster,
            "node{n}.toml: the same [cluster]"
        );
        assert_eq!(config.runtime.shard_count, first.runtime.shard_count);
        assert_eq!(
            config.cluster.initial_view(*n).unwrap(),
            first.cluster.initial_view(1).unwrap(),
            "node{n}.toml: the same initial view"
        );
        let l = &config.listen;
        for a in [&l.tcp_addr, &l.ws_addr, &l.api_addr, &l.rpc_addr] {
            let a: SocketAddr = a.parse().unwrap();
            assert!(a.ip().is_loopback(), "node{n}.toml: {a} is not loopback");
            listen.push(a);
        }
    }
    for m in &first.cluster.nodes {
        let client = [m.tcp_addr.as_deref(), m.ws_addr.as_deref()];
        for a in client.into_iter().flatten() {
            let a = a.trim_start_matches("ws://");
            let ip: IpAddr = a.parse::<SocketAddr>().unwrap().ip();
            assert!(ip.is_loopback(), "node {}: {a} is not loopback", m.id);
        }
        assert!(m.rpc_addr.ip().is_loopback() && m.api_addr.ip().is_loopback());
    }
    let mut distinct = listen.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        listen.len(),
        "the samples fit on one machine"
    );
}

#[test]
fn the_unit_runs_the_binary_and_config_the_readme_installs() {
    let unit = read(UNIT);
    let exec = unit_value(&unit, "ExecStart");
    assert_eq!(exec, format!("{BINARY} --config {CONFIG_PATH}"));
    let readme = read("README.md");
    let section = deploying_section(&readme);
    for named in [
        "cargo install --locked --path engine",
        BINARY,
        CONFIG_PATH,
        UNIT,
        SYSCTL,
        "imrouter check-host",
        "/node/drain",
    ] {
        assert!(section.contains(named), "README's Deploying lacks {named}");
    }
    let order = ["## A cluster of nodes", "## Deploying", "## Durability"];
    let at: Vec<usize> = order.iter().map(|h| readme.find(h).unwrap()).collect();
    assert!(
        at.windows(2).all(|w| w[0] < w[1]),
        "{order:?} in this order"
    );

    assert_ne!(
        unit_value(&unit, "Type"),
        "notify",
        "the binary has no sd_notify"
    );
    assert_eq!(unit_value(&unit, "KillSignal"), "SIGTERM");
    assert_eq!(unit_value(&unit, "Restart"), "on-failure");
    assert_eq!(unit_value(&unit, "StateDirectory"), "imrouter");
    assert_eq!(unit_value(&unit, "ReadWritePaths"), DATA_DIR);
    assert_eq!(unit_value(&unit, "ProtectSystem"), "strict");
    assert_eq!(unit_value(&unit, "NoNewPrivileges"), "yes");
}

/// io_uring_setup, io_uring_enter and io_uring_register must stay callable: only
/// deny lists, naming neither them, nor `@aio` (their group), nor `@resources`
/// (sched_setaffinity for pinning, setrlimit for the descriptor limit).
#[test]
fn the_unit_filters_no_io_uring_call() {
    let unit = read(UNIT);
    for filter in unit_values(&unit, "SystemCallFilter") {
        assert!(
            filter.starts_with('~'),
            "an allow list may lack io_uring: {filter}"
        );
        for kept in ["io_uring", "@aio", "@resources", "@default", "@known"] {
            assert!(!filter.contains(kept), "{filter} denies {kept}");
        }
    }
}

#[test]
fn the_descriptor_limit_and_backlog_fit_every_sample() {
    let unit = read(UNIT);
    let conf = read(SYSCTL);
    let limit: u64 = unit_value(&unit, "LimitNOFILE").parse().unwrap();
    let nr_open: u64 = sysctl_value(&conf, "fs.nr_open").parse().unwrap();
    assert!(
        limit <= nr_open,
        "LimitNOFILE {limit} > fs.nr_open {nr_open}"
    );
    let somaxconn: i32 = sysctl_value(&conf, "net.core.somaxconn").parse().unwrap();
    let syn: i32 = sysctl_value(&conf, "net.ipv4.tcp_max_syn_backlog")
        .parse()
        .unwrap();
    assert!(syn >= somaxconn);
    for (n, _, config) in samples() {
        let c = node_config(n, &config);
        let b = engine::node::fd_budget(&c, limit);
        assert!(
            !b.over_committed(),
            "node{n}.toml needs more than LimitNOFILE={limit}: {b:?}"
        );
        assert!(
            c.net.listen_backlog <= somaxconn,
            "node{n}.toml: listen_backlog {} > somaxconn {somaxconn}",
            c.net.listen_backlog
        );
    }
}

/// The commented example `#CPUAffinity=A-B` holds every core of the samples'
/// `pin_cores` (a shard pinned outside the process's mask runs unpinned).
#[test]
fn the_cpu_affinity_example_holds_the_pinned_cores() {
    let unit = read(UNIT);
    let example = unit
        .lines()
        .find_map(|l| l.strip_prefix("#CPUAffinity="))
        .expect("a commented CPUAffinity= example");
    let (lo, hi) = example.trim().split_once('-').unwrap();
    let mask = lo.parse::<usize>().unwrap()..=hi.parse::<usize>().unwrap();
    for (n, _, config) in samples() {
        let cores = &config.runtime.pin_cores;
        assert_eq!(cores.len(), usize::from(config.runtime.shard_count));
        assert!(
            cores.iter().all(|c| mask.contains(c)),
            "node{n}.toml: pin_cores {cores:?} outside CPUAffinity={example}"
        );
        assert!(!cores.contains(mask.start()), "core {} is housekeeping", lo);
    }
}

/// The metric names in `text`: `imrouter_` and what follows of `[a-z0-9_]`, with a
/// trailing `*` kept (a family prefix).
fn metric_names(text: &str) -> Vec<&str> {
    text.match_indices("imrouter_")
        .filter(|(i, _)| {
            !text[..*i]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_alphanumeric() || c == '_')
        })
        .map(|(i, _)| {
            let rest = &text[i..];
            let end = rest
                .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
                .unwrap_or(rest.len());
            let star = rest[end..].starts_with('*');
            &rest[..end + usize::from(star)]
        })
        .collect()
}

#[test]
fn the_deploying_section_names_only_metrics_of_the_table() {
    let readme = read("README.md");
    let section = deploying_section(&readme);
    let names = metric_names(section);
    assert!(names.len() > 20, "found the section's metrics: {names:?}");
    let mut unknown = Vec::new();
    for name in &names {
        if *name == "imrouter_shard_" {
            continue; // `imrouter_shard_<name>`: the per-shard series of a family
        }
        let found = match name.strip_suffix('*') {
            Some(prefix) => readme.contains(&format!("| `{prefix}")),
            None => readme.contains(&format!("| `{name}` |")),
        };
        if !found {
            unknown.push(*name);
        }
    }
    assert!(unknown.is_empty(), "not in the metrics table: {unknown:?}");
    for required in [
        "imrouter_authority_stale_refusals_total",
        "imrouter_routes_rebuilt_total",
        "imrouter_route_rebuild_last_ms",
        "imrouter_ring_full_drops_total",
        "imrouter_delivery_stalls_total",
        "imrouter_slow_reader_closes_total",
        "imrouter_stage_*",
        "imrouter_rpc_*",
    ] {
        assert!(names.contains(&required), "the section explains {required}");
    }
}

#[test]
fn metric_names_are_read_whole() {
    assert_eq!(
        metric_names("`imrouter_a_total`, imrouter_stage_* and x_imrouter_b."),
        vec!["imrouter_a_total", "imrouter_stage_*"]
    );
}
