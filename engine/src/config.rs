//! The node's TOML configuration: every limit with its unit in its name, defaults for
//! all of it (`imrouter --print-config` prints them), overridable by flags.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::activation::ActivationConfig;
use crate::authority::AuthorityConfig;
use crate::http::ApiConfig;
use crate::node::{DeliveryConfig, NodeConfig, SessionConfig};
use crate::registry::RegistryLimits;
use crate::route::DeviceLevel;
use crate::store::{IdempotencyConfig, LogConfig, MetaConfig};

/// The IO backend, as `--io` names it (`[net] backend` in the file).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum IoBackend {
    /// io_uring, falling back to mio with a warning when the kernel refuses it.
    Auto,
    /// io_uring only.
    Uring,
    /// mio (epoll) only.
    Mio,
}

impl From<IoBackend> for net::io::Backend {
    fn from(b: IoBackend) -> Self {
        match b {
            IoBackend::Auto => net::io::Backend::Auto,
            IoBackend::Uring => net::io::Backend::Uring,
            IoBackend::Mio => net::io::Backend::Mio,
        }
    }
}

/// `[node]`
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeSection {
    pub node_id: u64,
    pub data_dir: PathBuf,
}

impl Default for NodeSection {
    fn default() -> Self {
        NodeSection {
            node_id: 1,
            data_dir: PathBuf::from("./data"),
        }
    }
}

/// `[listen]`: an empty address disables that listener.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ListenSection {
    pub tcp_addr: String,
    pub ws_addr: String,
    pub api_addr: String,
}

impl Default for ListenSection {
    fn default() -> Self {
        ListenSection {
            tcp_addr: "127.0.0.1:5100".into(),
            ws_addr: "127.0.0.1:5200".into(),
            api_addr: "127.0.0.1:5001".into(),
        }
    }
}

/// `[auth]`
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthSection {
    /// CONNECT must carry the token stored with `/user/token`.
    pub token_auth: bool,
    /// Level of sessions without a token record when `token_auth` is off.
    pub default_device_level: DeviceLevel,
    /// Bearer token the HTTP API requires (empty: none).
    pub api_bearer_token: String,
}

impl Default for AuthSection {
    fn default() -> Self {
        AuthSection {
            token_auth: true,
            default_device_level: DeviceLevel::Master,
            api_bearer_token: String::new(),
        }
    }
}

/// The whole file.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub node: NodeSection,
    pub listen: ListenSection,
    pub auth: AuthSection,
    pub runtime: shard::runtime::RuntimeConfig,
    pub net: net::io::NetConfig,
    pub authority: AuthorityConfig,
    pub activation: ActivationConfig,
    pub registry: RegistryLimits,
    pub session: SessionConfig,
    pub delivery: DeliveryConfig,
    pub log: LogConfig,
    pub idempotency: IdempotencyConfig,
    pub meta: MetaConfig,
    pub api: ApiConfig,
}

fn addr(name: &str, s: &str) -> Result<Option<SocketAddr>, String> {
    if s.is_empty() {
        return Ok(None);
    }
    s.parse()
        .map(Some)
        .map_err(|e| format!("listen.{name} = {s:?}: {e}"))
}

impl Config {
    /// Reads a TOML file; unknown keys are errors.
    pub fn load(path: &Path) -> Result<Config, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The configuration as TOML, after comment lines with the worst-case memory of
    /// the byte-bounded tables.
    pub fn to_toml(&self) -> Result<String, String> {
        let body = toml::to_string_pretty(self).map_err(|e| e.to_string())?;
        Ok(format!("{}{body}", self.worst_case_comments()))
    }

    /// `# ...` lines: the most memory each bounded table can take, per shard.
    pub fn worst_case_comments(&self) -> String {
        let mib = |b: u64| b as f64 / f64::from(1 << 20);
        let log = self.log.memory_worst_case_bytes();
        let idem = self.idempotency.budget_bytes as u64;
        let recent = (self.net.max_connections_per_shard as u64)
            * (self.session.recent_channels_per_conn as u64)
            * 8;
        let acks = self.session.pending_acks_budget_bytes_per_shard as u64;
        let peers = u64::from(self.runtime.shard_count.max(1)) - 1;
        let queued = peers * (self.runtime.ring_capacity + self.runtime.peer_queue_max) as u64;
        let waiting = self.delivery.backlog_budget_bytes as u64;
        format!(
            "# Worst-case memory per shard (bytes):\n\
             #   [log] index + retired seqs: {log} ({:.1} MiB)\n\
             #   [idempotency] window (budget_bytes): {idem} ({:.1} MiB)\n\
             #   [session] recent channels of every connection: {recent} ({:.1} MiB)\n\
             #   [session] unacknowledged RECVs (pending_acks_budget_bytes_per_shard): \
             {acks} ({:.1} MiB)\n\
             #   [delivery] messages committed and not yet delivered \
             (backlog_budget_bytes): {waiting} ({:.1} MiB)\n\
             #   [runtime] messages queued towards other shards: at most {queued} \
             ((shard_count - 1) x (ring_capacity + peer_queue_max)); a push or commit \
             shares its message, the rest are small\n",
            mib(log),
            mib(idem),
            mib(recent),
            mib(acks),
            mib(waiting),
        )
    }

    /// The node configuration this file describes.
    pub fn to_node_config(&self) -> Result<NodeConfig, String> {
        self.session.validate()?;
        self.delivery.validate()?;
        self.registry.validate()?;
        let runtime = self.runtime.clone();
        let net = self.net.clone();
        let mut api = self.api.clone();
        api.addr = addr("api_addr", &self.listen.api_addr)?;
        api.bearer_token =
            (!self.auth.api_bearer_token.is_empty()).then(|| self.auth.api_bearer_token.clone());
        Ok(NodeConfig {
            node_id: self.node.node_id,
            data_dir: self.node.data_dir.clone(),
            tcp_addr: addr("tcp_addr", &self.listen.tcp_addr)?,
            ws_addr: addr("ws_addr", &self.listen.ws_addr)?,
            token_auth: self.auth.token_auth,
            default_device_level: self.auth.default_device_level,
            runtime,
            net,
            authority: self.authority.clone(),
            activation: self.activation,
            registry: self.registry,
            session: self.session.clone(),
            delivery: self.delivery.clone(),
            log: self.log.clone(),
            idempotency: self.idempotency,
            meta: self.meta,
            api,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_printed_defaults_parse_back_to_the_same_config() {
        let text = Config::default().to_toml().unwrap();
        let back: Config = toml::from_str(&text).unwrap();
        assert_eq!(back.to_toml().unwrap(), text);
        assert!(
            text.contains("route_ttl_s"),
            "limits carry their units:\n{text}"
        );
    }

    /// `[registry]` (the unregister queue's limits) is in the printed TOML, and a
    /// changed value goes through the file into the node configuration and back.
    #[test]
    fn the_registry_section_round_trips_through_the_printed_toml() {
        let text = Config::default().to_toml().unwrap();
        assert!(text.contains("[registry]"), "{text}");
        for key in [
            "max_pending_unregisters",
            "unregister_max_attempts",
            "unregister_retry_base_ms",
            "unregister_retry_max_ms",
        ] {
            assert!(text.contains(key), "{key} missing:\n{text}");
        }
        let text = text.replace("unregister_max_attempts = 8", "unregister_max_attempts = 3");
        let c: Config = toml::from_str(&text).unwrap();
        assert_eq!(
            c.to_node_config().unwrap().registry.unregister_max_attempts,
            3
        );
        assert!(c.to_toml().unwrap().contains("unregister_max_attempts = 3"));
        let c: Config = toml::from_str("[registry]\nunregister_max_attempts = 0\n").unwrap();
        let e = c.to_node_config().unwrap_err();
        assert!(e.contains("registry.unregister_max_attempts"), "{e}");
    }

    #[test]
    fn limits_that_must_be_at_least_one_are_refused_by_name() {
        let c: Config = toml::from_str("[delivery]\nsubscriber_page_max = 0\n").unwrap();
        let e = c.to_node_config().unwrap_err();
        assert!(e.contains("delivery.subscriber_page_max"), "{e}");
        let c: Config = toml::from_str("[session]\nexpiry_interval_ms = 0\n").unwrap();
        let e = c.to_node_config().unwrap_err();
        assert!(e.contains("session.expiry_interval_ms"), "{e}");
    }

    #[test]
    fn unknown_keys_and_bad_addresses_are_errors() {
        assert!(toml::from_str::<Config>("[node]\nnode_idd = 3\n").is_err());
        let mut c = Config::default();
        c.listen.tcp_addr = "not an address".into();
        assert!(c.to_node_config().unwrap_err().contains("listen.tcp_addr"));
        c.listen.tcp_addr = String::new();
        assert_eq!(
            c.to_node_config().unwrap().tcp_addr,
            None,
            "empty disables the listener"
        );
    }
}
