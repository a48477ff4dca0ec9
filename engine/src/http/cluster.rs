//! The API on a cluster: requests homed on another node passed to it, the
//! authority shares of `/user/onlinestatus`, `/user/device_quit` on every node,
//! the client routes (`/route`, `/route/batch`) and the nodes of `/cluster/slots`.
//!
//! Contract: a request is forwarded at most once ([`ApiRequest::forwarded_by`] set
//! = answer from local data); every hop to another node is bounded by
//! `forward_timeout_ms` and its answer by `forward_answer_bytes_max`; a node that
//! cannot be reached is a 503 whose message names it and its API address. On a
//! node alone nothing here reaches another node.

use serde_json::{json, Value};
use slots::hash_slot;

use super::forward::{self, ForwardError, Outgoing, PeerError};
use super::{parse, Api, ApiMetrics, ApiRequest, Reply};
use crate::cluster::NodeId;

impl Api {
    /// Passes `req`, with `body` instead of its own, to node `node`'s API (named
    /// `role` in errors), awaited on the runtime ([`forward::Peers::forward`]):
    /// the node's status and body; 503 naming it when it cannot be reached, does
    /// not answer in time, its breaker is open or no place to it freed; 502 when
    /// its answer is not one.
    pub(super) async fn forward(
        &self,
        node: NodeId,
        role: &str,
        req: &ApiRequest<'_>,
        body: &[u8],
    ) -> Reply {
        if !self.state.peers.knows(node) {
            return Reply::error(503, format!("{role} {node} is not in [[cluster.nodes]]"));
        }
        let metrics = &self.shared.api_metrics;
        ApiMetrics::inc(&metrics.forwards);
        let outgoing = Outgoing {
            method: req.method,
            target: req.target,
            authorization: req.authorization,
            body,
        };
        let failed = |status: u16, e: &dyn std::fmt::Display, what: &str| {
            ApiMetrics::inc(&metrics.forward_failures);
            tracing::warn!(node, %e, "HTTP API request to another node failed");
            Reply::error(status, format!("{role} {node} {what}: {e}"))
        };
        match self.state.peers.forward(node, &outgoing).await {
            Ok(a) => match String::from_utf8(a.body) {
                Ok(body) => Reply {
                    status: a.status,
                    body,
                    content_type: "application/json",
                },
                Err(e) => failed(502, &e, "answered a body that is not UTF-8"),
            },
            Err(PeerError::Unknown) => {
                Reply::error(503, format!("{role} {node} is not in [[cluster.nodes]]"))
            }
            Err(e @ (PeerError::Busy { .. } | PeerError::Open { .. })) => {
                ApiMetrics::inc(&metrics.forwards_refused);
                Reply::error(503, format!("{role} {node} {e}"))
            }
            Err(PeerError::Forward(e @ ForwardError::Busy(_))) => {
                ApiMetrics::inc(&metrics.forwards_refused);
                Reply::error(503, format!("{role} {node}: {e}"))
            }
            Err(PeerError::Forward(e @ ForwardError::TooLarge(_))) => {
                failed(502, &e, "answered badly")
            }
            Err(PeerError::Forward(
                e @ (ForwardError::Unreachable(_) | ForwardError::Timeout(_)),
            )) => failed(503, &e, "unreachable"),
        }
    }

    /// [`Api::forward`] to each `(node, body)` at once (awaited together on this
    /// task); the answers in the same order.
    pub(super) async fn fan_out(
        &self,
        role: &str,
        req: &ApiRequest<'_>,
        to: &[(NodeId, Vec<u8>)],
    ) -> Vec<Reply> {
        let calls = to
            .iter()
            .map(|(node, body)| self.forward(*node, role, req, body))
            .collect();
        forward::join_all(calls).await
    }
}

/// The first answer that is not a 200, if any.
fn first_failure(answers: Vec<Reply>) -> Result<Vec<Reply>, Reply> {
    match answers.iter().position(|r| r.status != 200) {
        Some(i) => Err(answers.into_iter().nth(i).expect("found above")),
        None => Ok(answers),
    }
}

/// The value of `name` in a query string (`a=1&uid=u%201`), percent-decoded
/// (`+` is a space); `None` when absent or not valid UTF-8 once decoded.
fn query_param(query: &str, name: &str) -> Option<String> {
    let raw = query
        .split('&')
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))?;
    let (mut out, bytes) = (Vec::with_capacity(raw.len()), raw.as_bytes());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

impl Api {
    /// This node's id.
    pub(super) fn me(&self) -> NodeId {
        self.shared.config.node_id
    }

    /// The other nodes of the cluster, in config order (none on a node alone).
    pub(super) fn peer_ids(&self) -> Vec<NodeId> {
        let me = self.me();
        self.shared.config.cluster.peers(me).map(|n| n.id).collect()
    }

    /// Refuses (400) a request said to be forwarded by a node that is no peer.
    pub(super) fn check_forwarded(&self, req: &ApiRequest<'_>) -> Result<(), Reply> {
        match req.forwarded_by {
            Some(n) if !self.peer_ids().contains(&n) => Err(Reply::error(
                400,
                format!("forwarded by {n}, which is not a peer node"),
            )),
            _ => Ok(()),
        }
    }

    /// `Ok(())` when this node answers a request about `key` (a uid, a channel key)
    /// itself: it is the key's home (`ClusterView::home_node`: its leader when
    /// homes follow the groups), or the request was forwarded here.
    /// Otherwise the request goes to the home and `Err` carries the home's answer
    /// (or the 503 naming it).
    pub(super) async fn answer_at_home(
        &self,
        key: &[u8],
        req: &ApiRequest<'_>,
    ) -> Result<(), Reply> {
        if req.forwarded_by.is_some() {
            return Ok(());
        }
        let home = self.shared.view().home_node(hash_slot(key));
        if home == self.me() {
            return Ok(());
        }
        Err(self.forward(home, "home node", req, req.body).await)
    }

    /// `/user/onlinestatus`: the uids split by their authority node (this view's
    /// slot leader); this node answers its share from its tables, each other
    /// authority is asked for its share (forwarded: answered from its tables
    /// only), and the lists are merged. An authority that cannot be asked fails the
    /// request (503 naming it): its uids' presence is unknown.
    pub(super) async fn online_status(&self, req: &ApiRequest<'_>) -> Result<Reply, Reply> {
        let uids: Vec<String> = parse(req.body)?;
        if uids.len() > self.config.uids_per_request_max {
            return Err(Reply::error(413, "too many uids"));
        }
        if req.forwarded_by.is_some() {
            return Ok(Reply::json(200, Value::Array(self.local_online(&uids))));
        }
        let view = self.shared.view();
        let mut shares: Vec<(NodeId, Vec<String>)> = Vec::new();
        for uid in uids {
            let node = view.target_for_uid(&uid).leader_node_id;
            match shares.iter_mut().find(|(n, _)| *n == node) {
                Some((_, list)) => list.push(uid),
                None => shares.push((node, vec![uid])),
            }
        }
        let me = self.me();
        let mut out = Vec::new();
        if let Some(i) = shares.iter().position(|(n, _)| *n == me) {
            out = self.local_online(&shares.swap_remove(i).1);
        }
        // A view naming a node that is not in `[[cluster.nodes]]` (a drill on a node
        // alone): nothing is known of those uids here, and there is no one to ask.
        let peers = self.peer_ids();
        shares.retain(|(n, _)| peers.contains(n));
        let to: Vec<(NodeId, Vec<u8>)> = shares
            .into_iter()
            .map(|(n, list)| (n, json!(list).to_string().into_bytes()))
            .collect();
        let answers = first_failure(self.fan_out("authority node", req, &to).await)?;
        for (answer, (node, _)) in answers.into_iter().zip(&to) {
            match serde_json::from_str::<Value>(&answer.body) {
                Ok(Value::Array(list)) => out.extend(list),
                _ => {
                    return Err(Reply::error(
                        502,
                        format!("authority node {node} answered onlinestatus with no list"),
                    ))
                }
            }
        }
        Ok(Reply::json(200, Value::Array(out)))
    }

    /// `/user/device_quit` after this node closed its own sessions: unless the
    /// request was forwarded here, every other node is asked to close its own (the
    /// same body); 200 when every node did, else the first failure in config order
    /// (a 503 naming a node that could not be asked: retry, the quit is idempotent).
    pub(super) async fn quit_elsewhere(&self, req: &ApiRequest<'_>) -> Result<Reply, Reply> {
        if req.forwarded_by.is_none() {
            let to: Vec<(NodeId, Vec<u8>)> = self
                .peer_ids()
                .into_iter()
                .map(|n| (n, req.body.to_vec()))
                .collect();
            first_failure(self.fan_out("node", req, &to).await)?;
        }
        Ok(Reply::ok())
    }

    /// The peers every shard has an up link to, in config order.
    pub(super) fn reachable_peers(&self) -> Vec<NodeId> {
        let me = self.me();
        self.up_nodes_with_me()
            .into_iter()
            .filter(|&n| n != me)
            .collect()
    }

    /// The nodes a client may be sent to now: this node (unless it is draining)
    /// and each peer every shard has an up link to, in config order (a node alone,
    /// or a draining node that reaches no peer: itself).
    fn up_nodes(&self) -> Vec<NodeId> {
        let me = self.me();
        let mut up = self.up_nodes_with_me();
        if self.shared.is_draining() && up.len() > 1 {
            up.retain(|&n| n != me);
        }
        up
    }

    /// This node and each peer every shard has an up link to, in config order.
    fn up_nodes_with_me(&self) -> Vec<NodeId> {
        let me = self.me();
        let cluster = &self.shared.config.cluster;
        if cluster.nodes.is_empty() {
            return vec![me];
        }
        let mask = self.shared.peers_reached_mask();
        let mut peer = 0;
        let mut up = Vec::with_capacity(cluster.nodes.len());
        for n in &cluster.nodes {
            if n.id == me {
                up.push(me);
            } else {
                if peer < 64 && mask & (1 << peer) != 0 {
                    up.push(n.id);
                }
                peer += 1;
            }
        }
        up
    }

    /// The node `uid`'s client should connect to: spread over `up` by the uid's
    /// hash (crc32, so the same uid gets the same node while `up` stays).
    fn connect_node(uid: &str, up: &[NodeId]) -> NodeId {
        up[crc32fast::hash(uid.as_bytes()) as usize % up.len()]
    }

    /// `{"tcp_addr", "ws_addr", "wss_addr"}` of `node`: its `[[cluster.nodes]]`
    /// keys; for this node, a key left out is its own bound listener (`ws://` for
    /// WebSocket, `wss://` for `[listen] wss_addr`, empty without one); for another
    /// node, an empty string.
    fn client_addrs(&self, node: NodeId) -> serde_json::Map<String, Value> {
        let entry = self
            .shared
            .config
            .cluster
            .nodes
            .iter()
            .find(|n| n.id == node);
        let own = node == self.me();
        let pick = |configured: Option<&String>, own_addr: Option<String>| -> Value {
            match (configured, own) {
                (Some(a), _) => Value::from(a.as_str()),
                (None, true) => Value::from(own_addr.unwrap_or_default()),
                (None, false) => Value::from(""),
            }
        };
        let mut m = serde_json::Map::new();
        let tcp = self.shared.client_tcp_addr.map(|a| a.to_string());
        let ws = self.shared.client_ws_addr.map(|a| format!("ws://{a}"));
        let wss = self.shared.config.wss_addr.map(|a| format!("wss://{a}"));
        m.insert(
            "tcp_addr".into(),
            pick(entry.and_then(|e| e.tcp_addr.as_ref()), tcp),
        );
        m.insert(
            "ws_addr".into(),
            pick(entry.and_then(|e| e.ws_addr.as_ref()), ws),
        );
        m.insert(
            "wss_addr".into(),
            pick(entry.and_then(|e| e.wss_addr.as_ref()), wss),
        );
        m
    }

    /// `GET /route?uid=U`: where `U`'s client should connect (400 without a uid).
    pub(super) fn route_one(&self, req: &ApiRequest<'_>) -> Result<Reply, Reply> {
        let uid = query_param(req.query(), "uid")
            .filter(|u| !u.is_empty())
            .ok_or_else(|| Reply::error(400, "the query must give uid (GET /route?uid=U)"))?;
        let node = Self::connect_node(&uid, &self.up_nodes());
        Ok(Reply::json(200, Value::Object(self.client_addrs(node))))
    }

    /// `POST /route/batch` with a list of uids: one entry per node they are sent
    /// to, `{"uids": [...], "tcp_addr", "ws_addr", "wss_addr"}` (WuKongIM's shape),
    /// in the order the nodes first appear.
    pub(super) fn route_batch(&self, req: &ApiRequest<'_>) -> Result<Reply, Reply> {
        let uids: Vec<String> = parse(req.body)?;
        if uids.len() > self.config.uids_per_request_max {
            return Err(Reply::error(413, "too many uids"));
        }
        let up = self.up_nodes();
        let mut groups: Vec<(NodeId, Vec<String>)> = Vec::new();
        for uid in uids {
            let node = Self::connect_node(&uid, &up);
            match groups.iter_mut().find(|(n, _)| *n == node) {
                Some((_, list)) => list.push(uid),
                None => groups.push((node, vec![uid])),
            }
        }
        let list: Vec<Value> = groups
            .into_iter()
            .map(|(node, uids)| {
                let mut m = self.client_addrs(node);
                m.insert("uids".into(), json!(uids));
                Value::Object(m)
            })
            .collect();
        Ok(Reply::json(200, Value::Array(list)))
    }

    /// The nodes with their addresses, state (`self`, `up`: every shard has an up
    /// link to it, `unreachable`) and boot id (a decimal string: a JSON number
    /// would lose bits in JavaScript; a peer's is `null` until a link reported it).
    fn cluster_nodes(&self) -> Vec<Value> {
        let me = self.me();
        let cluster = &self.shared.config.cluster;
        let boot = |b: u64| Value::from(b.to_string());
        if cluster.nodes.is_empty() {
            return vec![
                json!({"id": me, "api_addr": self.config.addr.map(|a| a.to_string()),
                "rpc_addr": null, "state": "self", "boot_id": boot(self.shared.boot_id)}),
            ];
        }
        let mask = self.shared.peers_reached_mask();
        let mut peer = 0usize;
        cluster
            .nodes
            .iter()
            .map(|n| {
                let (state, boot_id) = if n.id == me {
                    ("self", boot(self.shared.boot_id))
                } else {
                    let up = peer < 64 && mask & (1 << peer) != 0;
                    peer += 1;
                    let b = self.shared.peer_boot_id(n.id).map_or(Value::Null, boot);
                    (if up { "up" } else { "unreachable" }, b)
                };
                json!({"id": n.id, "api_addr": n.api_addr.to_string(),
                    "rpc_addr": n.rpc_addr.to_string(), "state": state, "boot_id": boot_id})
            })
            .collect()
    }

    /// `GET /cluster/slots`: the view (each hash slot's slot id, leader, term,
    /// config epoch and home node), whether homes follow the leaders, the nodes ([`Api::cluster_nodes`]) and, with
    /// `[cluster] replicas` above 1, the replicated groups
    /// ([`Api::replica_groups`]).
    pub(super) fn cluster_slots(&self) -> Reply {
        self.cluster_slots_of(&self.shared.view())
    }

    /// [`Api::cluster_slots`] of `view` (a slot move answers with the view it made,
    /// not one a peer's move may have superseded since).
    pub(super) fn cluster_slots_of(&self, view: &crate::cluster::ClusterView) -> Reply {
        let slots: Vec<Value> = (0..slots::HASH_SLOTS as u16)
            .map(|s| {
                let t = view.target_for_slot(s);
                json!({"hash_slot": s, "slot_id": t.slot_id, "leader_node_id": t.leader_node_id,
                       "leader_term": t.leader_term, "config_epoch": t.config_epoch,
                       "from_node_id": view.slots[s as usize].from_node_id,
                       "home_node_id": view.home_node(s)})
            })
            .collect();
        let homes = match view.homes {
            crate::cluster::Homes::Static => "static",
            crate::cluster::Homes::Leaders => "leaders",
        };
        let mut body = json!({"config_epoch": view.config_epoch, "revision": view.revision,
                   "homes": homes, "slots": slots, "nodes": self.cluster_nodes()});
        if let Some(groups) = self.replica_groups() {
            body["replica_groups"] = groups;
        }
        Reply::json(200, body)
    }

    /// Each slot id's group as this node sees it: its replicas (node ids, config
    /// order from the slot id) and, where this node holds a replica that has seen
    /// an election, the leader (`null`: none known) and term, and the leader an
    /// operator chose (`POST /cluster/slots/leader`; `null`: the placement's);
    /// `None` when no group runs (`replicas = 1`, or a node alone).
    fn replica_groups(&self) -> Option<Value> {
        let c = &self.shared.config.cluster;
        let nodes: Vec<NodeId> = c.nodes.iter().map(|n| n.id).collect();
        if !crate::node::raft::groups_run(c.replicas as usize, nodes.len()) {
            return None;
        }
        let groups = (0..c.slot_ids)
            .map(|slot_id| {
                let replicas =
                    crate::node::raft::replica_nodes(slot_id, &nodes, c.replicas as usize);
                let (leader, term) = match self.shared.raft_status.of(slot_id) {
                    Some((0, term)) => (Value::Null, json!(term)),
                    Some((leader, term)) => (json!(leader), json!(term)),
                    None => (Value::Null, Value::Null),
                };
                let preferred = self.shared.raft_status.preferred_of(slot_id);
                json!({"slot_id": slot_id, "replicas": replicas, "leader_node_id": leader,
                       "term": term, "preferred_leader_node_id": preferred})
            })
            .collect();
        Some(Value::Array(groups))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_params_are_found_and_percent_decoded() {
        assert_eq!(query_param("uid=u1", "uid").as_deref(), Some("u1"));
        assert_eq!(
            query_param("x=1&uid=a%20b+c%2", "uid").as_deref(),
            Some("a b c%2")
        );
        assert_eq!(query_param("uids=1", "uid"), None);
        assert_eq!(query_param("", "uid"), None);
        assert_eq!(query_param("uid=%ff", "uid"), None);
    }

    #[test]
    fn a_uid_keeps_its_node_while_the_up_set_stays_and_uids_spread() {
        let up = [1, 2, 3];
        let seen: std::collections::BTreeSet<NodeId> = (0..300)
            .map(|i| Api::connect_node(&format!("u{i}"), &up))
            .collect();
        assert_eq!(seen.len(), 3, "300 uids use every node");
        assert_eq!(Api::connect_node("u7", &up), Api::connect_node("u7", &up));
        assert_eq!(Api::connect_node("u7", &[2]), 2);
    }
}
