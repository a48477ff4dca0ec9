//! Three nodes on 127.0.0.1 in the test's process (each with its own shards,
//! links and data directory; they talk over real loopback sockets only).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use engine::channel::Channel;
use engine::cluster::ClusterView;
use engine::config::{ClusterNode, Secret};
use engine::node::{Node, NodeConfig};
use net::io::Backend;

const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// The test clusters' `[cluster] slot_ids`.
pub const SLOT_IDS: u32 = 64;

/// The handshake key a test dialing a node as its peer uses: the node's secret,
/// the default `[cluster] id` and `slot_ids`.
pub fn rpc_key(secret: &[u8], slot_ids: u32) -> proto::rpc::ClusterKey {
    let id = proto::rpc::ClusterId::new(engine::config::CLUSTER_ID_DEFAULT).unwrap();
    proto::rpc::ClusterKey::new(
        proto::rpc::ClusterSecret::new(secret).unwrap(),
        id,
        slot_ids,
    )
}

/// Free loopback ports for the nodes to bind, below the kernel's ephemeral range
/// (no outgoing connection or port-0 bind takes one meanwhile).
pub fn free_ports(n: usize) -> Vec<u16> {
    super::processes::free_fixed_ports(n)
}

/// A link dialed to `rpc_addr` as process `me` of a peer (the test playing a
/// node) with the cluster's `key`, handshake done; the dialed node's boot id.
/// Reads time out after 10 s (a failure detector, not a wait).
pub fn dial_as(
    rpc_addr: SocketAddr,
    key: &proto::rpc::ClusterKey,
    me: proto::rpc::auth::Identity,
) -> (std::net::TcpStream, proto::rpc::link::Outbound<()>, u64) {
    use proto::rpc::link::{LinkEvent, LinkLimits, Outbound};
    use std::io::{Read, Write};
    let mut link = Outbound::new(key, me, 1, 0, LinkLimits::default());
    let mut stream = std::net::TcpStream::connect(rpc_addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut out = Vec::new();
    assert!(link.on_dial([7; proto::rpc::auth::NONCE_BYTES], 0, &mut out));
    stream.write_all(&out).unwrap();
    let (mut input, mut buf) = (Vec::new(), [0u8; 4096]);
    loop {
        let n = stream
            .read(&mut buf)
            .expect("the node answers the handshake");
        assert!(n > 0, "the node closed the link during the handshake");
        input.extend_from_slice(&buf[..n]);
        out.clear();
        let step = link.on_input(&input, 0, &mut out);
        input.drain(..step.consumed);
        stream.write_all(&out).unwrap();
        match step.event {
            Some(LinkEvent::Up { peer_boot_id, .. }) => return (stream, link, peer_boot_id),
            None => {}
            Some(other) => panic!("handshake: {other:?}"),
        }
    }
}

/// Node 1's config in the cluster {1: in this process, 2: played by the test},
/// one shard, token authentication off, its data in `dir`: `ports` are the RPC
/// ports of nodes 1 and 2, then their API ports.
pub fn node_1_of_2(
    backend: Backend,
    ports: &[u16],
    dir: &std::path::Path,
    secret: &str,
    slot_ids: u32,
) -> NodeConfig {
    let member = |id: u64, i: usize| ClusterNode {
        id,
        rpc_addr: SocketAddr::from(([127, 0, 0, 1], ports[i])),
        api_addr: SocketAddr::from(([127, 0, 0, 1], ports[2 + i])),
        tcp_addr: None,
        ws_addr: None,
        wss_addr: None,
    };
    let members = vec![member(1, 0), member(2, 1)];
    let mut c = super::config(dir, backend);
    c.node_id = 1;
    c.runtime.shard_count = 1;
    c.rpc_addr = Some(members[0].rpc_addr);
    c.cluster.nodes = members;
    c.cluster.slot_ids = slot_ids;
    c.cluster.secret = Secret::new(secret.into());
    c.token_auth = false;
    c
}

pub struct Cluster {
    pub nodes: Vec<Node>,
    pub view: ClusterView,
    _dirs: Vec<tempfile::TempDir>,
}

impl Cluster {
    /// Three nodes, ids 1..=3 in config order, each API on its `api_addr`, no token
    /// authentication (CONNECT takes any token: the token hop is tested on its
    /// own), all peers reached.
    pub fn start(backend: Backend) -> Cluster {
        Cluster::start_with(backend, |_| {})
    }

    /// [`Cluster::start`], each node's config changed by `tune` first. The ports
    /// are picked free, then bound by the nodes: if another test took one in
    /// between (`AddrInUse`), the nodes started are stopped and the cluster starts
    /// again on other ports (a few attempts).
    pub fn start_with(backend: Backend, tune: impl Fn(&mut NodeConfig)) -> Cluster {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        for _attempt in 0..5 {
            match Cluster::try_start(backend, &tune) {
                Ok(cluster) => {
                    cluster.wait_linked();
                    return cluster;
                }
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => continue,
                Err(e) => panic!("cluster start: {e}"),
            }
        }
        panic!("cluster start: every attempt met a port taken meanwhile");
    }

    fn try_start(backend: Backend, tune: &impl Fn(&mut NodeConfig)) -> std::io::Result<Cluster> {
        let ports = free_ports(6);
        let members: Vec<ClusterNode> = (0..3)
            .map(|i| ClusterNode {
                id: i as u64 + 1,
                rpc_addr: SocketAddr::from(([127, 0, 0, 1], ports[i])),
                api_addr: SocketAddr::from(([127, 0, 0, 1], ports[3 + i])),
                tcp_addr: None,
                ws_addr: None,
                wss_addr: None,
            })
            .collect();
        let mut dirs = Vec::new();
        let mut nodes = Vec::new();
        for member in &members {
            let dir = tempfile::tempdir().unwrap();
            let mut c: NodeConfig = super::config(dir.path(), backend);
            c.node_id = member.id;
            c.rpc_addr = Some(member.rpc_addr);
            c.cluster.nodes = members.clone();
            c.cluster.slot_ids = SLOT_IDS;
            c.cluster.secret = Secret::new("cluster-routing-test-secret".into());
            c.token_auth = false;
            // Each node's HTTP API on its `api_addr`: the nodes pass requests homed
            // elsewhere (and onlinestatus, device_quit) to each other's API.
            c.api.addr = Some(member.api_addr);
            tune(&mut c);
            nodes.push(Node::start(c)?);
            dirs.push(dir);
        }
        Ok(Cluster {
            nodes,
            view: ClusterView::initial(&[1, 2, 3], SLOT_IDS).unwrap(),
            _dirs: dirs,
        })
    }

    /// Waits (bounded) until every node's every shard has an up link to both peers.
    pub fn wait_linked(&self) {
        let deadline = Instant::now() + READ_TIMEOUT;
        for (i, n) in self.nodes.iter().enumerate() {
            while n.shared().peers_reached() < 2 {
                assert!(
                    Instant::now() < deadline,
                    "node {} reached {} of 2 peers",
                    i + 1,
                    n.shared().peers_reached()
                );
                std::thread::yield_now();
            }
        }
    }

    pub fn node(&self, id: u64) -> &Node {
        &self.nodes[id as usize - 1]
    }

    /// The authority (slot leader) of `uid` in the initial view.
    pub fn authority_of(&self, uid: &str) -> u64 {
        authority_of(&self.view, uid)
    }

    /// The home of the channel `channel_id` as `sender` addresses it.
    pub fn home_of(&self, sender: &str, channel_id: &str, channel_type: u8) -> u64 {
        home_of(&self.view, sender, channel_id, channel_type)
    }
}

/// The authority (slot leader) of `uid` in `view`.
pub fn authority_of(view: &ClusterView, uid: &str) -> u64 {
    view.target_for_uid(uid).leader_node_id
}

/// The home in `view` of the channel `channel_id` as `sender` addresses it.
pub fn home_of(view: &ClusterView, sender: &str, channel_id: &str, channel_type: u8) -> u64 {
    let c = Channel::resolve(sender, channel_id, channel_type).unwrap();
    view.home_node(slots::hash_slot(c.key().as_bytes()))
}

/// The first uid `prefix{n}` whose placement `ok` accepts.
pub fn find_uid(prefix: &str, ok: impl Fn(&str) -> bool) -> String {
    (0..100_000)
        .map(|n| format!("{prefix}{n}"))
        .find(|u| ok(u))
        .expect("a uid with the wanted placement")
}

/// A PING answered: everything the node wrote before it has been read.
pub fn nothing_more(c: &mut net::client::Client) {
    c.ping().unwrap();
    assert_eq!(
        c.read().unwrap(),
        net::client::Received::Pong,
        "nothing but the PONG"
    );
}

/// A client of `uid` (device flag 1, any token: the clusters run without token
/// authentication) logged in on `node` over TCP, CONNACK success asserted.
pub fn login_any(node: &Node, uid: &str) -> net::client::Client {
    let login = net::client::Login::new(uid, "any");
    let addr = node.tcp_addr().unwrap();
    let (client, reason) = net::client::Client::connect(addr, &login, READ_TIMEOUT).unwrap();
    assert_eq!(reason, 1, "CONNACK for {uid}");
    client
}
