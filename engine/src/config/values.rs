//! The configuration's values that every layer reads (the API, the webhooks, the
//! node): secrets, the cluster's members, the check of a section's limits, the
//! clock of certificate expiry. Below the sections that use them: this file takes
//! nothing from the node, the API or the webhooks.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::cluster::{ClusterView, NodeId};

/// The environment variable that sets `[cluster] secret` (it wins over the file when
/// set and not empty).
pub const CLUSTER_SECRET_ENV: &str = "IMROUTER_CLUSTER_SECRET";

/// The shortest `[cluster] secret` a cluster with peers accepts, in bytes.
pub const CLUSTER_SECRET_MIN_BYTES: usize = 16;

/// The environment variable that sets `[auth] api_bearer_token` (it wins over the
/// file when set and not empty), so a token can stay out of the config file as the
/// cluster secret does.
pub const API_BEARER_TOKEN_ENV: &str = "IMROUTER_API_BEARER_TOKEN";

/// The environment variable that sets `[auth] admin_token` (it wins over the file
/// when set and not empty).
pub const ADMIN_TOKEN_ENV: &str = "IMROUTER_ADMIN_TOKEN";

/// Secrets printed in the README's examples: long enough, and known to everyone
/// who read it. A cluster with peers refuses them by name.
pub const EXAMPLE_SECRETS: &[&str] = &["at-least-16-bytes"];

/// What `--print-config` (and `Debug`) show for a secret that is set.
pub(crate) const SECRET_SHOWN: &str = "<set>";

/// A secret of the configuration (`[cluster] secret`, `[webhook] secret`, the
/// `[auth]` tokens): never
/// shown (`--print-config` and `Debug` write `<set>`), zeroized when dropped.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(secret: String) -> Self {
        Secret(secret)
    }

    /// The secret's bytes (a key: the nodes' authentication, the webhooks'
    /// signature).
    pub fn expose(&self) -> &[u8] {
        self.0.as_bytes()
    }

    pub fn is_set(&self) -> bool {
        !self.0.is_empty()
    }

    /// A bearer token for the HTTP API (`None`: not set).
    pub fn to_token(&self) -> Option<Secret> {
        self.is_set().then(|| self.clone())
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Self {
        Secret(s.to_owned())
    }
}

impl From<String> for Secret {
    fn from(s: String) -> Self {
        Secret(s)
    }
}

/// A secret's bytes are wiped when it is dropped (a copy made by `Clone` too).
impl Drop for Secret {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.0);
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_set() {
            SECRET_SHOWN
        } else {
            "<unset>"
        })
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(if self.is_set() { SECRET_SHOWN } else { "" })
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(Secret)
    }
}

/// One `[[cluster.nodes]]` entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterNode {
    pub id: NodeId,
    /// Its inter-node listener (`[listen] rpc_addr` on that node).
    pub rpc_addr: SocketAddr,
    /// Its HTTP API.
    pub api_addr: SocketAddr,
    /// The addresses clients reach it at (may differ from its listen addresses:
    /// host names, `ws://…`, `wss://…`), for the route API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_addr: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ws_addr: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wss_addr: Option<String>,
}

/// The default `[cluster] id`: nodes configured before the key existed all have
/// it, so they keep linking to each other.
pub const CLUSTER_ID_DEFAULT: &str = "imrouter";

/// `[cluster]`: the cluster's id, the nodes in config order (every node, this one
/// included; none or only this one: a node alone, as before issue 13), how the 256
/// hash slots group into slot ids, and the secret the nodes authenticate each
/// other with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// The cluster's name, 1 to 32 bytes of ASCII letters, digits, `.`, `_`, `-`
    /// (default [`CLUSTER_ID_DEFAULT`]). Every node of a cluster has the same; the
    /// handshake refuses a peer of another id (or another `slot_ids`) by name, so
    /// two clusters that share a secret by mistake never link.
    pub id: String,
    /// Required (at least 16 bytes) when there are peers; `IMROUTER_CLUSTER_SECRET`
    /// wins over it.
    pub secret: Secret,
    /// Contiguous ranges of the 256 hash slots, 1..=256: hash slot h belongs to slot
    /// id h * slot_ids / 256 (a count that does not divide 256 gives ranges whose
    /// sizes differ by one). Slot id i is led by, and homed on, nodes[i % n]. A node
    /// alone keeps one slot id per hash slot.
    pub slot_ids: u32,
    pub nodes: Vec<ClusterNode>,
    /// Voters of each slot id's replicated group, 1 (the default: no group) to the
    /// node count. Above 1 the groups run and elect leaders ("Replicated slot
    /// ids…"), and SENDs are committed through them; homes do not follow their
    /// leaders yet.
    pub replicas: u32,
    /// The replicated groups' tick, in ms (election after 10 to 19 ticks without a
    /// leader, heartbeats every 2).
    pub raft_tick_ms: u64,
    /// Committed entries each group keeps in memory for followers that lag (at
    /// least 1): a follower further behind waits for catch-up, which is not built
    /// yet.
    pub raft_entries_retained: u64,
    /// What a leader's lease leaves for the clocks' drift and a late timer, in ms:
    /// a slot id's authority serves only while its group's leader holds a lease of
    /// 9 ticks (the shortest election timeout less the one a follower may tick at
    /// once) less this margin, counted from the sending of a round of heartbeats a
    /// quorum answered (`node::raft`, "Lease"). Below `9 × raft_tick_ms`.
    pub raft_lease_margin_ms: u64,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            id: CLUSTER_ID_DEFAULT.to_string(),
            secret: Secret::default(),
            slot_ids: 64,
            nodes: Vec::new(),
            replicas: 1,
            raft_tick_ms: 50,
            raft_entries_retained: 4096,
            raft_lease_margin_ms: 50,
        }
    }
}

impl ClusterConfig {
    /// The listed nodes other than `me`, in config order.
    pub fn peers(&self, me: NodeId) -> impl Iterator<Item = &ClusterNode> {
        self.nodes.iter().filter(move |n| n.id != me)
    }

    /// Checks the cluster of node `me` whose `[listen] rpc_addr` is `rpc_addr`: the
    /// cluster id, the slot id count, the ids (within the message ids' node bits,
    /// each once), this node listed with that `rpc_addr`, and a secret when there
    /// are peers. Gives the first mistake, by its key.
    pub fn validate(&self, me: NodeId, rpc_addr: Option<SocketAddr>) -> Result<(), String> {
        if let Err(e) = proto::rpc::ClusterId::new(&self.id) {
            return Err(format!("cluster.id {:?}: {e}", self.id));
        }
        if self.slot_ids == 0 || self.slot_ids > crate::cluster::MAX_SLOT_IDS {
            let e = crate::cluster::ViewError::SlotIds(self.slot_ids);
            return Err(format!("cluster.{e}"));
        }
        let max = domain::send::idgen::MAX_NODE_IDS;
        for (i, n) in self.nodes.iter().enumerate() {
            if n.id >= max {
                return Err(format!(
                    "cluster.nodes: node id {} is outside the message ids' node bits \
                     (0..={})",
                    n.id,
                    max - 1
                ));
            }
            if self.nodes[..i].iter().any(|m| m.id == n.id) {
                return Err(format!("cluster.nodes: node id {} is listed twice", n.id));
            }
        }
        let nodes = self.nodes.len().max(1) as u32;
        if self.replicas == 0 || self.replicas > nodes {
            return Err(format!(
                "cluster.replicas = {} must be 1 to the node count ({nodes})",
                self.replicas
            ));
        }
        if self.raft_tick_ms == 0 {
            return Err("cluster.raft_tick_ms must be at least 1".into());
        }
        if self.raft_entries_retained == 0 {
            return Err("cluster.raft_entries_retained must be at least 1".into());
        }
        if self.raft_lease_margin_ms >= crate::node::raft::LEASE_TICKS * self.raft_tick_ms {
            return Err(format!(
                "cluster.raft_lease_margin_ms = {} must be below {} × raft_tick_ms ({} ms): \
                 the lease would be empty",
                self.raft_lease_margin_ms,
                crate::node::raft::LEASE_TICKS,
                crate::node::raft::LEASE_TICKS * self.raft_tick_ms
            ));
        }
        if self.nodes.is_empty() {
            return Ok(());
        }
        let Some(this) = self.nodes.iter().find(|n| n.id == me) else {
            return Err(format!(
                "cluster.nodes does not list this node (node.node_id = {me}); list \
                 every node, this one included"
            ));
        };
        if Some(this.rpc_addr) != rpc_addr {
            let listen = rpc_addr.map_or_else(|| "(empty)".to_string(), |a| a.to_string());
            return Err(format!(
                "cluster.nodes: this node's rpc_addr {} differs from listen.rpc_addr \
                 {listen}",
                this.rpc_addr
            ));
        }
        self.validate_secret(me)
    }

    /// With peers: a secret of at least [`CLUSTER_SECRET_MIN_BYTES`], not the
    /// placeholder `--print-config` shows.
    fn validate_secret(&self, me: NodeId) -> Result<(), String> {
        if self.peers(me).next().is_none() {
            return Ok(());
        }
        if self.secret.expose() == SECRET_SHOWN.as_bytes() {
            return Err(format!(
                "cluster.secret is {SECRET_SHOWN:?}, the placeholder --print-config shows: \
                 write the secret itself, or set {CLUSTER_SECRET_ENV}"
            ));
        }
        if let Some(example) = EXAMPLE_SECRETS
            .iter()
            .find(|e| e.as_bytes() == self.secret.expose())
        {
            return Err(format!(
                "cluster.secret is {example:?}, the README's example: make one of your own \
                 (e.g. `openssl rand -hex 32`), the same on every node, in [cluster] or \
                 {CLUSTER_SECRET_ENV}"
            ));
        }
        let len = self.secret.expose().len();
        if len < CLUSTER_SECRET_MIN_BYTES {
            return Err(format!(
                "cluster.secret is {len} bytes: a cluster with peers needs at least \
                 {CLUSTER_SECRET_MIN_BYTES} (in [cluster] or {CLUSTER_SECRET_ENV})"
            ));
        }
        Ok(())
    }

    /// The view node `me` starts with: alone (no peers) the single-node view of
    /// today (one slot id per hash slot); with peers [`ClusterView::initial`] of the
    /// nodes in config order, whose homes follow the leaders when replicated
    /// groups run (`Homes::Leaders`).
    pub fn initial_view(&self, me: NodeId) -> Result<ClusterView, String> {
        if self.peers(me).next().is_none() {
            return Ok(ClusterView::single_node(me));
        }
        let ids: Vec<NodeId> = self.nodes.iter().map(|n| n.id).collect();
        let view =
            ClusterView::initial(&ids, self.slot_ids).map_err(|e| format!("cluster: {e}"))?;
        Ok(
            match crate::node::raft::groups_run(self.replicas as usize, ids.len()) {
                true => view.with_homes(crate::cluster::Homes::Leaders),
                false => view,
            },
        )
    }
}

/// Seconds since the Unix epoch now.
pub fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// `Err("section.name must be at least 1")` for each limit that is 0.
pub fn at_least_one(section: &str, limits: &[(&str, u64)]) -> Result<(), String> {
    match limits.iter().find(|(_, v)| *v == 0) {
        Some((name, _)) => Err(format!("{section}.{name} must be at least 1 (is 0)")),
        None => Ok(()),
    }
}
