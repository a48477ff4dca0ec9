//! The node's TOML configuration: every limit with its unit in its name, defaults for
//! all of it (`imrouter --print-config` prints them), overridable by flags.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::activation::ActivationConfig;
use crate::authority::AuthorityConfig;
use crate::http::ApiConfig;
use crate::node::config::{CommitConfig, DeliveryConfig, NodeConfig, SessionConfig};
use crate::registry::RegistryLimits;
use crate::route::DeviceLevel;
use crate::store::{IdempotencyConfig, LogConfig, MetaConfig};

pub mod values;
pub use values::*;

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
    /// WebSocket behind TLS (`wss://`) with `[tls]`'s certificate; empty (the
    /// default): none.
    pub wss_addr: String,
    pub api_addr: String,
    /// The inter-node listener (issue 13); used only when `[[cluster.nodes]]` lists
    /// peers (empty or no peers: a node alone, no RPC listener).
    pub rpc_addr: String,
}

impl Default for ListenSection {
    fn default() -> Self {
        ListenSection {
            tcp_addr: "127.0.0.1:5100".into(),
            ws_addr: "127.0.0.1:5200".into(),
            wss_addr: String::new(),
            api_addr: "127.0.0.1:5001".into(),
            rpc_addr: String::new(),
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
    pub api_bearer_token: Secret,
    /// Bearer token of the operator's routes, slot moves
    /// (`POST /cluster/slots/leader`) and drains (`POST /node/drain`), instead of
    /// `api_bearer_token` (an application server cannot move slots). Empty: none,
    /// and behind an API bearer token those routes answer 403.
    pub admin_token: Secret,
}

impl Default for AuthSection {
    fn default() -> Self {
        AuthSection {
            token_auth: true,
            default_device_level: DeviceLevel::Master,
            api_bearer_token: Secret::default(),
            admin_token: Secret::default(),
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
    pub cluster: ClusterConfig,
    /// `[rpc]`: the inter-node links' limits (in flight, deadlines, heartbeats,
    /// backoff, frame size).
    pub rpc: proto::rpc::link::LinkLimits,
    pub runtime: shard::runtime::RuntimeConfig,
    pub net: net::io::NetConfig,
    pub authority: AuthorityConfig,
    pub activation: ActivationConfig,
    pub registry: RegistryLimits,
    pub session: SessionConfig,
    /// `[commit]`: the commit core's back-pressure and the gateways' credits.
    pub commit: CommitConfig,
    pub delivery: DeliveryConfig,
    pub log: LogConfig,
    pub idempotency: IdempotencyConfig,
    pub meta: MetaConfig,
    pub api: ApiConfig,
    /// `[webhook]`: the application's receiver of `msg.offline` and
    /// `user.onlinestatus` (none while `url` is empty).
    pub webhook: crate::webhook::WebhookConfig,
    /// `[tls]`: the certificate of `[listen] wss_addr` (PEM files, reloaded on
    /// SIGHUP) and the TLS connections' limits.
    pub tls: net::io::TlsConfig,
    /// Whether the file sets `[net] connections_per_shard_max` (see
    /// [`NodeConfig::connection_cap_set`]).
    #[serde(skip)]
    pub connection_cap_set: bool,
}

/// Keys that moved to another section or were renamed, as (old section, old key,
/// new section, new key). A file that still uses the old place is read as if it
/// used the new one, with a warning naming both; one that sets both is refused
/// (which one was meant is not ours to guess).
pub const RENAMED_KEYS: &[(&str, &str, &str, &str)] = &[
    // The commit core's limits, `[delivery]`'s before `[commit]` held them.
    (
        "delivery",
        "commits_unsynced_max",
        "commit",
        "commits_unsynced_max",
    ),
    (
        "delivery",
        "commit_credits_per_peer",
        "commit",
        "commit_credits_per_peer",
    ),
    (
        "delivery",
        "delivery_backlog_max",
        "commit",
        "delivery_backlog_max",
    ),
    (
        "delivery",
        "backlog_budget_bytes",
        "commit",
        "backlog_budget_bytes",
    ),
    // The `max_` prefix became a `_max` suffix, after the unit (`_ms_max`).
    ("runtime", "max_timers", "runtime", "timers_max"),
    (
        "net",
        "max_connections_per_shard",
        "net",
        "connections_per_shard_max",
    ),
    ("net", "max_frame_bytes", "net", "frame_bytes_max"),
    (
        "net",
        "accept_backoff_max_ms",
        "net",
        "accept_backoff_ms_max",
    ),
    (
        "authority",
        "max_routes_per_slot",
        "authority",
        "routes_per_slot_max",
    ),
    (
        "authority",
        "max_pending_per_slot",
        "authority",
        "pending_per_slot_max",
    ),
    (
        "authority",
        "max_fence_records_per_slot",
        "authority",
        "fence_records_per_slot_max",
    ),
    (
        "authority",
        "max_records_per_uid",
        "authority",
        "records_per_uid_max",
    ),
    (
        "authority",
        "max_lookup_uids",
        "authority",
        "lookup_uids_max",
    ),
    (
        "authority",
        "max_touch_batch_routes",
        "authority",
        "touch_batch_routes_max",
    ),
    (
        "authority",
        "presence_filter_bits_max_per_slot",
        "authority",
        "presence_filter_bits_per_slot_max",
    ),
    (
        "activation",
        "max_owner_actions",
        "activation",
        "owner_actions_max",
    ),
    (
        "registry",
        "max_pending_unregisters",
        "registry",
        "pending_unregisters_max",
    ),
    (
        "registry",
        "unregister_max_attempts",
        "registry",
        "unregister_attempts_max",
    ),
    (
        "registry",
        "unregister_retry_max_ms",
        "registry",
        "unregister_retry_ms_max",
    ),
    (
        "session",
        "max_sessions_per_shard",
        "session",
        "sessions_per_shard_max",
    ),
    (
        "session",
        "touch_batch_max_routes",
        "session",
        "touch_batch_routes_max",
    ),
    ("log", "max_segments", "log", "segments_max"),
    ("log", "max_channels", "log", "channels_max"),
    ("log", "max_retired_channels", "log", "retired_channels_max"),
    ("log", "max_indexed_messages", "log", "indexed_messages_max"),
    ("log", "max_payload_bytes", "log", "payload_bytes_max"),
    ("log", "max_read_messages", "log", "read_messages_max"),
    ("idempotency", "max_entries", "idempotency", "entries_max"),
    ("meta", "max_tokens", "meta", "tokens_max"),
    ("meta", "max_groups", "meta", "groups_max"),
    (
        "meta",
        "max_subscribers_per_group",
        "meta",
        "subscribers_per_group_max",
    ),
    ("meta", "max_field_bytes", "meta", "field_bytes_max"),
    ("meta", "max_journal_bytes", "meta", "journal_bytes_max"),
    ("api", "max_body_bytes", "api", "body_bytes_max"),
    ("api", "max_uids_per_request", "api", "uids_per_request_max"),
    ("api", "max_waiting_requests", "api", "waiting_requests_max"),
    ("api", "max_connections", "api", "connections_max"),
    (
        "api",
        "max_sync_response_bytes",
        "api",
        "sync_response_bytes_max",
    ),
    ("rpc", "rpc_backoff_max_ms", "rpc", "rpc_backoff_ms_max"),
    ("webhook", "backoff_max_ms", "webhook", "backoff_ms_max"),
];

/// Moves every key of [`RENAMED_KEYS`] found at its old place to its new one.
fn apply_renamed_keys(table: &mut toml::Table) -> Result<(), String> {
    for &(old_section, old_key, new_section, new_key) in RENAMED_KEYS {
        let old = match table.get_mut(old_section) {
            Some(toml::Value::Table(section)) => section.remove(old_key),
            _ => None,
        };
        let Some(value) = old else { continue };
        let section = table
            .entry(new_section)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        let toml::Value::Table(section) = section else {
            return Err(format!("{new_section} must be a table ([{new_section}])"));
        };
        if section.contains_key(new_key) {
            return Err(format!(
                "{old_section}.{old_key} and {new_section}.{new_key} are both set: \
                 [{new_section}] {new_key} is its name now, remove the other"
            ));
        }
        tracing::warn!(
            "[{old_section}] {old_key} is deprecated: it is [{new_section}] {new_key} now \
             (read as such)"
        );
        section.insert(new_key.to_owned(), value);
    }
    Ok(())
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
    /// Reads a TOML file, then the environment ([`CLUSTER_SECRET_ENV`]); unknown
    /// keys are errors.
    pub fn load(path: &Path) -> Result<Config, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Config::parse(&text, |k| std::env::var(k).ok())
            .map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Parses TOML, then applies the environment as `env` gives it: the cluster
    /// secret of [`CLUSTER_SECRET_ENV`], when set and not empty, wins over the file's.
    pub fn parse(text: &str, env: impl Fn(&str) -> Option<String>) -> Result<Config, String> {
        let mut table: toml::Table = toml::from_str(text).map_err(|e| e.to_string())?;
        apply_renamed_keys(&mut table)?;
        let mut config: Config = table.clone().try_into().map_err(|e| e.to_string())?;
        config.connection_cap_set = table
            .get("net")
            .and_then(|net| net.get("connections_per_shard_max"))
            .is_some();
        if let Some(secret) = env(CLUSTER_SECRET_ENV).filter(|s| !s.is_empty()) {
            config.cluster.secret = Secret::new(secret);
        }
        if let Some(token) = env(API_BEARER_TOKEN_ENV).filter(|s| !s.is_empty()) {
            config.auth.api_bearer_token = Secret::new(token);
        }
        if let Some(token) = env(ADMIN_TOKEN_ENV).filter(|s| !s.is_empty()) {
            config.auth.admin_token = Secret::new(token);
        }
        Ok(config)
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
        let recent = (self.net.connections_per_shard_max as u64)
            * (self.session.recent_channels_per_conn as u64)
            * 8;
        let acks = self.session.pending_acks_budget_bytes_per_shard as u64;
        let peers = u64::from(self.runtime.shard_count.max(1)) - 1;
        let queued = peers * (self.runtime.ring_capacity + self.runtime.peer_queue_max) as u64;
        let waiting = self.commit.backlog_budget_bytes as u64;
        let peer_nodes = self.cluster.nodes.len().saturating_sub(1) as u64;
        let held = peer_nodes * self.rpc.rpc_replies_held_bytes_max as u64;
        format!(
            "# Worst-case memory per shard (bytes):\n\
             #   [log] index + retired seqs: {log} ({:.1} MiB)\n\
             #   [idempotency] window (budget_bytes): {idem} ({:.1} MiB)\n\
             #   [session] recent channels of every connection: {recent} ({:.1} MiB)\n\
             #   [session] unacknowledged RECVs (pending_acks_budget_bytes_per_shard): \
             {acks} ({:.1} MiB)\n\
             #   [commit] messages committed and not yet delivered \
             (backlog_budget_bytes): {waiting} ({:.1} MiB)\n\
             #   [runtime] messages queued towards other shards: at most {queued} \
             ((shard_count - 1) x (ring_capacity + peer_queue_max)); a push or commit \
             shares its message, the rest are small\n\
             #   [rpc] replies held for peers whose link is not up: {held} ({:.1} MiB; \
             peer nodes x rpc_replies_held_bytes_max)\n",
            mib(log),
            mib(idem),
            mib(recent),
            mib(acks),
            mib(waiting),
            mib(held),
        )
    }

    /// The `wss://` listener's address and certificate: none without `[listen]
    /// wss_addr`; with it, `[tls]`'s files loaded (refused with the file and the
    /// reason when they do not load).
    pub fn tls_listener(&self) -> Result<(Option<SocketAddr>, Option<net::io::TlsServer>), String> {
        let Some(wss) = addr("wss_addr", &self.listen.wss_addr)? else {
            return Ok((None, None));
        };
        let tls = &self.tls;
        if !tls.is_set() {
            return Err(format!(
                "listen.wss_addr = \"{wss}\" needs [tls] cert_file and key_file (PEM)"
            ));
        }
        if tls.handshake_bytes_max == 0 || tls.handshakes_per_poll_max == 0 {
            return Err(
                "tls.handshake_bytes_max and tls.handshakes_per_poll_max must be at least 1".into(),
            );
        }
        let server = net::io::TlsServer::load(tls).map_err(|e| e.to_string())?;
        let left = server.expires_in_s(unix_now());
        if left <= 0 {
            tracing::warn!(cert_file = %tls.cert_file.display(), "the TLS certificate has expired");
        }
        Ok((Some(wss), Some(server)))
    }

    /// A node with peers serves its HTTP API (the peers' forwards included) only
    /// behind a bearer token: refused without one, with the way to set it.
    fn validate_cluster_api(&self) -> Result<(), String> {
        let has_peers = self.cluster.peers(self.node.node_id).next().is_some();
        let api = !self.listen.api_addr.is_empty();
        for (key, token) in [
            ("auth.api_bearer_token", &self.auth.api_bearer_token),
            ("auth.admin_token", &self.auth.admin_token),
        ] {
            if token.expose() == SECRET_SHOWN.as_bytes() {
                return Err(format!(
                    "{key} is {SECRET_SHOWN:?}, the placeholder --print-config shows: \
                     put the token itself back"
                ));
            }
        }
        if has_peers && api && !self.auth.api_bearer_token.is_set() {
            return Err(format!(
                "auth.api_bearer_token is empty: a node with peers (cluster.nodes) serves \
                 its HTTP API, and its peers' forwards, only behind a bearer token; set \
                 the same token on every node, in [auth] or {API_BEARER_TOKEN_ENV}"
            ));
        }
        let admin = &self.auth.admin_token;
        if admin.is_set() && *admin == self.auth.api_bearer_token {
            return Err(
                "auth.admin_token is auth.api_bearer_token: the operator's token \
                        (slot moves, drains) must differ from the applications'"
                    .into(),
            );
        }
        if has_peers && api && !admin.is_set() {
            tracing::warn!(
                "auth.admin_token is empty: POST /cluster/slots/leader and POST /node/drain \
                 answer 403 until it is set (in [auth] or {ADMIN_TOKEN_ENV})"
            );
        }
        Ok(())
    }

    /// The node configuration this file describes.
    pub fn to_node_config(&self) -> Result<NodeConfig, String> {
        self.session.validate()?;
        self.commit.validate()?;
        self.delivery.validate()?;
        self.registry.validate()?;
        self.webhook.validate()?;
        let rpc_addr = addr("rpc_addr", &self.listen.rpc_addr)?;
        self.cluster.validate(self.node.node_id, rpc_addr)?;
        self.rpc.validate().map_err(|e| format!("rpc.{e}"))?;
        self.validate_cluster_api()?;
        let runtime = self.runtime.clone();
        let net = self.net.clone();
        let mut api = self.api.clone();
        api.addr = addr("api_addr", &self.listen.api_addr)?;
        api.bearer_token = self.auth.api_bearer_token.to_token();
        api.admin_token = self.auth.admin_token.to_token();
        let (wss_addr, tls) = self.tls_listener()?;
        Ok(NodeConfig {
            node_id: self.node.node_id,
            data_dir: self.node.data_dir.clone(),
            tcp_addr: addr("tcp_addr", &self.listen.tcp_addr)?,
            ws_addr: addr("ws_addr", &self.listen.ws_addr)?,
            wss_addr,
            tls,
            rpc_addr,
            cluster: self.cluster.clone(),
            rpc: self.rpc,
            token_auth: self.auth.token_auth,
            default_device_level: self.auth.default_device_level,
            runtime,
            net,
            connection_cap_set: self.connection_cap_set,
            authority: self.authority.clone(),
            activation: self.activation,
            registry: self.registry,
            session: self.session.clone(),
            commit: self.commit.clone(),
            delivery: self.delivery.clone(),
            log: self.log.clone(),
            idempotency: self.idempotency,
            meta: self.meta,
            api,
            webhook: self.webhook.clone(),
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
            "pending_unregisters_max",
            "unregister_attempts_max",
            "unregister_retry_base_ms",
            "unregister_retry_ms_max",
        ] {
            assert!(text.contains(key), "{key} missing:\n{text}");
        }
        let text = text.replace("unregister_attempts_max = 8", "unregister_attempts_max = 3");
        let c: Config = toml::from_str(&text).unwrap();
        assert_eq!(
            c.to_node_config().unwrap().registry.unregister_attempts_max,
            3
        );
        assert!(c.to_toml().unwrap().contains("unregister_attempts_max = 3"));
        let c: Config = toml::from_str("[registry]\nunregister_attempts_max = 0\n").unwrap();
        let e = c.to_node_config().unwrap_err();
        assert!(e.contains("registry.unregister_attempts_max"), "{e}");
    }

    /// `[listen] rpc_addr` and `[cluster]` are printed with their defaults (no RPC
    /// listener, 64 slot ids, no nodes) and parse back to a node alone.
    #[test]
    fn the_cluster_defaults_are_printed_and_describe_a_node_alone() {
        let text = Config::default().to_toml().unwrap();
        assert!(text.contains("rpc_addr = \"\""), "{text}");
        assert!(text.contains("[cluster]"), "{text}");
        assert!(text.contains("slot_ids = 64"), "{text}");
        assert!(text.contains("id = \"imrouter\""), "{text}");
        let c = Config::parse(&text, |_| None)
            .unwrap()
            .to_node_config()
            .unwrap();
        assert_eq!(c.rpc_addr, None);
        assert!(c.cluster.nodes.is_empty() && !c.cluster.secret.is_set());
        assert_eq!(
            c.cluster.initial_view(c.node_id).unwrap(),
            crate::cluster::ClusterView::single_node(c.node_id)
        );
    }

    #[test]
    fn limits_that_must_be_at_least_one_are_refused_by_name() {
        let c: Config = toml::from_str("[delivery]\nsubscriber_page_max = 0\n").unwrap();
        let e = c.to_node_config().unwrap_err();
        assert!(e.contains("delivery.subscriber_page_max"), "{e}");
        let c: Config = toml::from_str("[session]\nexpiry_interval_ms = 0\n").unwrap();
        let e = c.to_node_config().unwrap_err();
        assert!(e.contains("session.expiry_interval_ms"), "{e}");
        let c: Config = toml::from_str("[commit]\nbacklog_budget_bytes = 0\n").unwrap();
        let e = c.to_node_config().unwrap_err();
        assert!(e.contains("commit.backlog_budget_bytes"), "{e}");
    }

    /// The commit core's keys moved from `[delivery]` to `[commit]`: a file that
    /// still sets them in `[delivery]` is read as if `[commit]` did; one that sets a
    /// key in both is refused naming it; `--print-config` writes only the new
    /// places of [`RENAMED_KEYS`].
    #[test]
    fn commit_keys_in_delivery_are_read_as_commit_keys() {
        let no_env = |_: &str| None;
        let old = "[delivery]\ncommits_unsynced_max = 7\nbacklog_budget_bytes = 9\n\
                   subscriber_page_max = 5\n";
        let c = Config::parse(old, no_env).unwrap();
        assert_eq!(c.commit.commits_unsynced_max, 7);
        assert_eq!(c.commit.backlog_budget_bytes, 9);
        assert_eq!(
            c.commit.delivery_backlog_max,
            CommitConfig::default().delivery_backlog_max
        );
        assert_eq!(c.delivery.subscriber_page_max, 5);
        let node = c.to_node_config().unwrap();
        assert_eq!(node.commit.commits_unsynced_max, 7);
        let both =
            "[delivery]\ncommit_credits_per_peer = 7\n[commit]\ncommit_credits_per_peer = 8\n";
        let e = Config::parse(both, no_env).unwrap_err();
        assert!(e.contains("delivery.commit_credits_per_peer"), "{e}");
        let printed = Config::parse("", no_env).unwrap().to_toml().unwrap();
        let table: toml::Table = toml::from_str(&printed).unwrap();
        for &(old_section, old_key, new_section, new_key) in RENAMED_KEYS {
            assert!(
                table[new_section].get(new_key).is_some(),
                "{new_key} printed"
            );
            assert!(
                table[old_section].get(old_key).is_none(),
                "[{old_section}] {old_key} not printed"
            );
        }
    }

    /// Every `max_`-prefixed key of the old names is still read, at its new
    /// `_max`-suffixed name; the old name of the connection cap still counts as
    /// setting it; old and new together are refused; no printed key starts with
    /// `max_` or holds `_max_`.
    #[test]
    fn max_prefixed_keys_are_read_at_their_suffixed_names() {
        let no_env = |_: &str| None;
        let old = "[api]\nmax_connections = 7\n[net]\nmax_connections_per_shard = 9\n\
                   accept_backoff_max_ms = 11\n[session]\ntouch_batch_max_routes = 13\n";
        let c = Config::parse(old, no_env).unwrap();
        assert_eq!(c.api.connections_max, 7);
        assert_eq!(c.net.connections_per_shard_max, 9);
        assert_eq!(c.net.accept_backoff_ms_max, 11);
        assert!(c.connection_cap_set);
        assert!(!Config::parse("", no_env).unwrap().connection_cap_set);
        let node = c.to_node_config().unwrap();
        assert_eq!(node.session.touch_batch_routes_max, 13);
        let both = "[log]\nmax_segments = 3\nsegments_max = 4\n";
        let e = Config::parse(both, no_env).unwrap_err();
        assert!(e.contains("log.max_segments"), "{e}");
        let printed = Config::parse("", no_env).unwrap().to_toml().unwrap();
        for line in printed.lines().filter(|l| !l.starts_with('#')) {
            let key = line.split('=').next().unwrap_or("").trim();
            assert!(
                !key.starts_with("max_") && !key.contains("_max_"),
                "{key}: the limit's `_max` goes last"
            );
        }
    }

    /// `[listen] wss_addr` (off) and `[tls]` (no files, the limits) are printed and
    /// parse back; a bad wss address is refused by its key.
    #[test]
    fn the_tls_defaults_are_printed_and_turn_nothing_on() {
        let text = Config::default().to_toml().unwrap();
        assert!(text.contains("wss_addr = \"\""), "{text}");
        for key in [
            "[tls]",
            "cert_file",
            "key_file",
            "handshake_bytes_max",
            "handshakes_per_poll_max",
            "session_cache_entries",
        ] {
            assert!(text.contains(key), "{key} missing:\n{text}");
        }
        let c = Config::parse(&text, |_| None)
            .unwrap()
            .to_node_config()
            .unwrap();
        assert!(c.wss_addr.is_none() && c.tls.is_none());
        let mut c = Config::default();
        c.listen.wss_addr = "nowhere".into();
        assert!(c.to_node_config().unwrap_err().contains("listen.wss_addr"));
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
