//! Issue 13's configuration (`[listen] rpc_addr`, `[cluster]`, `[[cluster.nodes]]`):
//! parsed through the loader, validated with one message per mistake, the initial
//! view built from it; a node of three is ready only once it reached a majority,
//! and three processes started from one file form a cluster. A node alone, listing
//! itself or nothing, starts as today.

mod support;

use std::net::{SocketAddr, TcpListener};
use std::process::Command;

use engine::cluster::ClusterView;
use engine::config::{Config, ADMIN_TOKEN_ENV, API_BEARER_TOKEN_ENV, CLUSTER_SECRET_ENV};
use engine::node::Node;

const SECRET: &str = "0123456789abcdef-file";
const API_TOKEN: &str = "cluster-config-api-token";

/// The issue's example for three nodes, with `node_id` = `me` and the client
/// addresses of node 1.
fn three_nodes(me: u64) -> String {
    format!(
        r#"
[node]
node_id = {me}
[listen]
rpc_addr = "127.0.0.1:1100{me}"
[auth]
api_bearer_token = "{API_TOKEN}"
[cluster]
secret = "{SECRET}"
slot_ids = 64
[[cluster.nodes]]
id = 1
rpc_addr = "127.0.0.1:11001"
api_addr = "127.0.0.1:5001"
tcp_addr = "im1.example.com:5100"
ws_addr = "ws://im1.example.com:5200"
wss_addr = "wss://im1.example.com:5210"
[[cluster.nodes]]
id = 2
rpc_addr = "127.0.0.1:11002"
api_addr = "127.0.0.1:5002"
[[cluster.nodes]]
id = 3
rpc_addr = "127.0.0.1:11003"
api_addr = "127.0.0.1:5003"
"#
    )
}

fn no_env(_: &str) -> Option<String> {
    None
}

/// Parses `text` (no environment) and gives the node configuration's error.
fn error_of(text: &str) -> String {
    Config::parse(text, no_env)
        .unwrap()
        .to_node_config()
        .unwrap_err()
}

#[test]
fn the_issue_keys_load_from_a_file_into_the_node_config() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("imrouter.toml");
    std::fs::write(&path, three_nodes(2)).unwrap();
    let c = Config::load(&path).unwrap().to_node_config().unwrap();
    assert_eq!(c.node_id, 2);
    assert_eq!(c.rpc_addr, Some(SocketAddr::from(([127, 0, 0, 1], 11002))));
    assert_eq!(c.cluster.slot_ids, 64);
    assert_eq!(c.cluster.id, "imrouter", "the default cluster id");
    let ids: Vec<u64> = c.cluster.nodes.iter().map(|n| n.id).collect();
    assert_eq!(ids, [1, 2, 3]);
    let n1 = &c.cluster.nodes[0];
    assert_eq!(n1.api_addr, SocketAddr::from(([127, 0, 0, 1], 5001)));
    assert_eq!(n1.tcp_addr.as_deref(), Some("im1.example.com:5100"));
    assert_eq!(n1.ws_addr.as_deref(), Some("ws://im1.example.com:5200"));
    assert_eq!(n1.wss_addr.as_deref(), Some("wss://im1.example.com:5210"));
    assert_eq!(c.cluster.nodes[1].tcp_addr, None);
    assert_eq!(c.cluster.secret.expose(), SECRET.as_bytes());
    let peers: Vec<u64> = c.cluster.peers(2).map(|n| n.id).collect();
    assert_eq!(peers, [1, 3]);
    assert_eq!(
        c.cluster.initial_view(2).unwrap(),
        ClusterView::initial(&[1, 2, 3], 64).unwrap()
    );
}

#[test]
fn the_environment_secret_wins_over_the_file() {
    let env = |k: &str| (k == CLUSTER_SECRET_ENV).then(|| "from-the-environment-0123".into());
    let c = Config::parse(&three_nodes(1), env).unwrap();
    let n = c.to_node_config().unwrap();
    assert_eq!(n.cluster.secret.expose(), b"from-the-environment-0123");
    // Without the file's secret, the environment's is enough.
    let text = three_nodes(1).replace(&format!("secret = \"{SECRET}\""), "");
    let n = Config::parse(&text, env).unwrap().to_node_config().unwrap();
    assert_eq!(n.cluster.secret.expose(), b"from-the-environment-0123");
    assert!(
        error_of(&text).contains("cluster.secret"),
        "{}",
        error_of(&text)
    );
}

#[test]
fn the_secret_is_never_printed() {
    let c = Config::parse(&three_nodes(1), no_env).unwrap();
    let text = c.to_toml().unwrap();
    assert!(!text.contains(SECRET), "{text}");
    assert!(text.contains("secret = \"<set>\""), "{text}");
    let debug = format!("{:?} {:?}", c, c.to_node_config().unwrap());
    assert!(!debug.contains(SECRET), "{debug}");
    assert!(!debug.contains(API_TOKEN), "the API token: {debug}");
    // The placeholder pasted back is refused, by name.
    let back = Config::parse(&text, no_env).unwrap();
    let e = back.to_node_config().unwrap_err();
    assert!(e.contains("cluster.secret") && e.contains("<set>"), "{e}");
}

/// `imrouter --print-config` with the secret in the file and in the environment
/// prints neither.
#[test]
fn print_config_shows_set_for_the_secret() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("imrouter.toml");
    std::fs::write(&path, three_nodes(1)).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_imrouter"))
        .arg("--config")
        .arg(&path)
        .arg("--print-config")
        .env(CLUSTER_SECRET_ENV, "from-the-environment-0123")
        .env(ADMIN_TOKEN_ENV, "admin-from-the-environment")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("secret = \"<set>\""), "{text}");
    assert!(
        !text.contains(SECRET) && !text.contains("from-the-environment"),
        "{text}"
    );
    // The API's and the operator's tokens are secrets too (issue 26, item 3).
    assert!(!text.contains(API_TOKEN), "{text}");
    assert!(text.contains("api_bearer_token = \"<set>\""), "{text}");
    assert!(text.contains("admin_token = \"<set>\""), "{text}");
    // Pasted back, the placeholder is refused by name.
    let back = text.replace("secret = \"<set>\"", &format!("secret = \"{SECRET}\""));
    let e = Config::parse(&back, no_env)
        .unwrap()
        .to_node_config()
        .unwrap_err();
    assert!(e.contains("auth.api_bearer_token is \"<set>\""), "{e}");
    assert!(text.contains("[[cluster.nodes]]"), "{text}");
}

#[test]
fn each_mistake_gets_its_own_message() {
    let base = three_nodes(1);
    let cases = [
        (
            base.replace("id = 3", "id = 2"),
            "cluster.nodes: node id 2 is listed twice",
        ),
        (
            base.replace("node_id = 1", "node_id = 9")
                .replace("127.0.0.1:11009", "127.0.0.1:11001"),
            "cluster.nodes does not list this node (node.node_id = 9)",
        ),
        (
            base.replace(
                "rpc_addr = \"127.0.0.1:11001\"\n[auth]",
                "rpc_addr = \"127.0.0.1:12001\"\n[auth]",
            ),
            "this node's rpc_addr 127.0.0.1:11001 differs from listen.rpc_addr 127.0.0.1:12001",
        ),
        (
            base.replace(SECRET, "short"),
            "cluster.secret is 5 bytes: a cluster with peers needs at least 16",
        ),
        (
            base.replace("id = 3", "id = 1024"),
            "cluster.nodes: node id 1024 is outside the message ids' node bits (0..=1023)",
        ),
        (
            base.replace("slot_ids = 64", "id = \"prod eu\"\nslot_ids = 64"),
            "cluster.id \"prod eu\": a cluster id is 1 to 32 bytes of ASCII letters, digits",
        ),
        (
            base.replace("slot_ids = 64", "id = \"\"\nslot_ids = 64"),
            "cluster.id \"\": a cluster id is 1 to 32 bytes",
        ),
        (
            base.replace("slot_ids = 64", "slot_ids = 0"),
            "cluster.slot_ids = 0: must be in 1..=256",
        ),
        (
            base.replace("slot_ids = 64", "slot_ids = 300"),
            "cluster.slot_ids = 300: must be in 1..=256",
        ),
        (
            base.replace(
                "api_addr = \"127.0.0.1:5003\"",
                "api_addr = \"127.0.0.1:5003\"\nhome = 2",
            ),
            "unknown field `home`",
        ),
        (
            base.replace(
                "rpc_addr = \"127.0.0.1:11003\"",
                "rpc_addr = \"node3:11003\"",
            ),
            "invalid socket address",
        ),
    ];
    for (text, want) in cases {
        let e = match Config::parse(&text, no_env) {
            Err(e) => e,
            Ok(c) => c.to_node_config().unwrap_err(),
        };
        assert!(e.contains(want), "want {want:?}, got: {e}");
    }
}

/// Issue 26, item 3: a node with peers refuses the README's example secret by
/// name, and refuses to serve its API without a bearer token (the file's or the
/// environment's); a node alone still starts without one.
#[test]
fn a_cluster_refuses_the_example_secret_and_an_api_without_a_token() {
    let example = three_nodes(1).replace(SECRET, "at-least-16-bytes");
    let e = error_of(&example);
    assert!(
        e.contains("cluster.secret is \"at-least-16-bytes\", the README's example"),
        "{e}"
    );
    let env_example = |k: &str| (k == CLUSTER_SECRET_ENV).then(|| "at-least-16-bytes".into());
    let e = Config::parse(&three_nodes(1), env_example)
        .unwrap()
        .to_node_config()
        .unwrap_err();
    assert!(e.contains("the README's example"), "{e}");
    let no_token = three_nodes(1).replace(&format!("api_bearer_token = \"{API_TOKEN}\""), "");
    let e = error_of(&no_token);
    assert!(
        e.contains("auth.api_bearer_token is empty: a node with peers"),
        "{e}"
    );
    assert!(e.contains(API_BEARER_TOKEN_ENV), "{e}");
    let env_token = |k: &str| (k == API_BEARER_TOKEN_ENV).then(|| "from-the-env".into());
    let c = Config::parse(&no_token, env_token).unwrap();
    assert_eq!(c.auth.api_bearer_token.expose(), b"from-the-env");
    let node = c.to_node_config().unwrap();
    let token = node.api.bearer_token.as_ref().map(|t| t.expose());
    assert_eq!(token, Some(&b"from-the-env"[..]));
    // Without an API there is nothing to protect.
    let no_api = format!("{no_token}\n").replace(
        "rpc_addr = \"127.0.0.1:11001\"\n[auth]",
        "rpc_addr = \"127.0.0.1:11001\"\napi_addr = \"\"\n[auth]",
    );
    assert!(Config::parse(&no_api, no_env)
        .unwrap()
        .to_node_config()
        .is_ok());
    // A node alone needs neither.
    let alone = "[auth]\napi_bearer_token = \"\"\n[cluster]\nsecret = \"at-least-16-bytes\"\n";
    assert!(Config::parse(alone, no_env)
        .unwrap()
        .to_node_config()
        .is_ok());
}

/// Issue 26, item 3: the operator's admin token (slot moves, drains) comes from
/// `[auth] admin_token` or the environment, and may not be the applications' token.
#[test]
fn the_admin_token_is_read_and_must_differ_from_the_api_token() {
    let c = Config::parse(&three_nodes(1), no_env).unwrap();
    assert!(c.to_node_config().unwrap().api.admin_token.is_none());
    let env_admin = |k: &str| (k == ADMIN_TOKEN_ENV).then(|| "operator-only".into());
    let c = Config::parse(&three_nodes(1), env_admin).unwrap();
    let node = c.to_node_config().unwrap();
    let admin = node.api.admin_token.as_ref().map(|t| t.expose());
    assert_eq!(admin, Some(&b"operator-only"[..]));
    let same = three_nodes(1).replace(
        &format!("api_bearer_token = \"{API_TOKEN}\""),
        &format!("api_bearer_token = \"{API_TOKEN}\"\nadmin_token = \"{API_TOKEN}\""),
    );
    let e = error_of(&same);
    assert!(
        e.contains("auth.admin_token is auth.api_bearer_token"),
        "{e}"
    );
}

/// A node of three started alone is up but not ready: `/readyz` is 503 and says
/// how many peers it reached (none) and that a majority of the nodes is needed.
#[test]
fn a_node_without_its_peers_is_not_ready() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = Config::parse(&three_nodes(1), no_env)
        .unwrap()
        .to_node_config()
        .unwrap();
    let free = TcpListener::bind("127.0.0.1:0").unwrap();
    c.rpc_addr = Some(free.local_addr().unwrap());
    c.cluster.nodes[0].rpc_addr = free.local_addr().unwrap();
    drop(free);
    c.data_dir = dir.path().join("data");
    c.tcp_addr = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    c.ws_addr = None;
    c.api.addr = None;
    let node = Node::start(c).unwrap();
    let reply = node.api().handle("GET", "/readyz", None, b"");
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert!(
        reply
            .body
            .contains("reached 0 of 2 peers: a majority of the 3 nodes is needed"),
        "{}",
        reply.body
    );
    node.shutdown().unwrap();
}

/// Three `imrouter` processes started from the issue's file (ports made free)
/// reach each other: each `/readyz` turns 200 (a node alone stays 503 until then).
#[test]
fn three_processes_from_one_file_form_a_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let ports = support::cluster::free_ports(6);
    let mut text = three_nodes(1);
    for i in 0..3 {
        text = text
            .replace(
                &format!("127.0.0.1:1100{}", i + 1),
                &format!("127.0.0.1:{}", ports[i]),
            )
            .replace(
                &format!("127.0.0.1:500{}", i + 1),
                &format!("127.0.0.1:{}", ports[3 + i]),
            );
    }
    let mut children = Vec::new();
    for id in 1..=3u64 {
        let file = text
            .replace("node_id = 1", &format!("node_id = {id}"))
            .replacen(
                &format!("rpc_addr = \"127.0.0.1:{}\"", ports[0]),
                &format!("rpc_addr = \"127.0.0.1:{}\"", ports[id as usize - 1]),
                1,
            );
        let path = dir.path().join(format!("node{id}.toml"));
        std::fs::write(&path, file).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_imrouter"))
            .arg("--config")
            .arg(&path)
            .args([
                "--tcp-addr",
                "127.0.0.1:0",
                "--ws-addr",
                "127.0.0.1:0",
                "--shards",
                "2",
            ])
            .arg("--api-addr")
            .arg(format!("127.0.0.1:{}", ports[3 + id as usize - 1]))
            .arg("--data-dir")
            .arg(dir.path().join(format!("data{id}")))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        children.push(KillOnDrop(child));
    }
    for id in 1..=3usize {
        let api = SocketAddr::from(([127, 0, 0, 1], ports[3 + id - 1]));
        let (status, body) =
            support::wait_http(api, "/readyz", 200, std::time::Duration::from_secs(30));
        assert_eq!(status, 200, "node {id}: {body}");
    }
}

/// Kills the process when the test ends, whatever its outcome.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Validation also holds for a configuration built in code: `Node::start` refuses
/// it before opening anything.
#[test]
fn node_start_validates_a_config_built_in_code() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = support::config(dir.path(), net::io::Backend::Mio);
    let mut n = Config::parse(&three_nodes(1), no_env)
        .unwrap()
        .to_node_config()
        .unwrap()
        .cluster;
    n.nodes[2].id = 2;
    c.rpc_addr = Some(SocketAddr::from(([127, 0, 0, 1], 11001)));
    c.cluster = n;
    let e = Node::start(c).err().expect("refused");
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    assert!(e.to_string().contains("node id 2 is listed twice"), "{e}");
}

/// The frame limits fit each other (issue 26, item 2): a link's input buffer must
/// hold a whole frame of `rpc_frame_bytes_max` and one read, or the start is refused
/// naming both keys; the defaults fit.
#[test]
fn an_rpc_frame_limit_past_the_links_input_buffer_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = support::config(dir.path(), net::io::Backend::Mio);
    c.rpc.rpc_frame_bytes_max = c.net.rpc_inbound_buffer_bytes_max;
    let e = Node::start(c).err().expect("refused");
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    let text = e.to_string();
    assert!(
        text.contains("rpc_frame_bytes_max") && text.contains("rpc_inbound_buffer_bytes_max"),
        "{text}"
    );
    let dir = tempfile::tempdir().unwrap();
    let c = support::config(dir.path(), net::io::Backend::Mio);
    Node::start(c).unwrap().shutdown().unwrap();
}

/// Every touch batch fits in a frame (issue 26, item 2): `touch_batch_routes_max`
/// routes with the longest uid and device id must fit `rpc_frame_bytes_max`, or
/// the start is refused naming the keys (a batch past it would be refused by its
/// link and requeued for ever).
#[test]
fn a_touch_batch_larger_than_a_frame_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = support::config(dir.path(), net::io::Backend::Mio);
    c.session.device_id_bytes_max = 64 << 10;
    let e = Node::start(c).err().expect("refused");
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    let text = e.to_string();
    assert!(
        text.contains("touch_batch_routes_max") && text.contains("rpc_frame_bytes_max"),
        "{text}"
    );
    let dir = tempfile::tempdir().unwrap();
    let mut c = support::config(dir.path(), net::io::Backend::Mio);
    c.session.device_id_bytes_max = 64 << 10;
    c.session.touch_batch_routes_max = 32;
    Node::start(c).unwrap().shutdown().unwrap();
}

/// In a cluster every API request fits in a frame (issue 26, item 3): a request
/// homed on another node travels there on the link in one frame, so a
/// `body_bytes_max` that with a request's head does not fit `rpc_frame_bytes_max`
/// is refused at start naming both keys; a node alone takes it.
#[test]
fn an_api_body_limit_past_a_frame_is_refused_in_a_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let ports = support::cluster::free_ports(4);
    let mut c =
        support::cluster::node_1_of_2(net::io::Backend::Mio, &ports, dir.path(), SECRET, 64);
    c.api.body_bytes_max = c.rpc.rpc_frame_bytes_max;
    let e = Node::start(c).err().expect("refused");
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    let text = e.to_string();
    assert!(
        text.contains("body_bytes_max") && text.contains("rpc_frame_bytes_max"),
        "{text}"
    );
    let dir = tempfile::tempdir().unwrap();
    let mut c = support::config(dir.path(), net::io::Backend::Mio);
    c.api.body_bytes_max = c.rpc.rpc_frame_bytes_max;
    Node::start(c).unwrap().shutdown().unwrap();
}

/// A node whose `[[cluster.nodes]]` lists only itself starts as today: the
/// single-node view (one slot id per hash slot, whatever `slot_ids` says) and no RPC
/// listener: its `rpc_addr` is held by the test, and the start still succeeds.
#[test]
fn a_node_listing_only_itself_starts_alone_without_an_rpc_listener() {
    let dir = tempfile::tempdir().unwrap();
    let held = TcpListener::bind("127.0.0.1:0").unwrap();
    let rpc = held.local_addr().unwrap();
    let mut c = support::config(dir.path(), net::io::Backend::Mio);
    c.node_id = 4;
    c.rpc_addr = Some(rpc);
    c.cluster.slot_ids = 16;
    c.cluster.nodes = vec![engine::config::ClusterNode {
        id: 4,
        rpc_addr: rpc,
        api_addr: SocketAddr::from(([127, 0, 0, 1], 5001)),
        tcp_addr: None,
        ws_addr: None,
        wss_addr: None,
    }];
    let node = Node::start(c).unwrap();
    assert_eq!(node.shared().initial_view, ClusterView::single_node(4));
    assert_eq!(*node.shared().view(), ClusterView::single_node(4));
    node.shutdown().unwrap();
    drop(held);
}

/// No `[cluster]` at all: the defaults (64 slot ids, no nodes, no secret) and the
/// single-node view.
#[test]
fn no_cluster_section_is_a_node_alone() {
    let c = Config::parse("[node]\nnode_id = 5\n", no_env)
        .unwrap()
        .to_node_config()
        .unwrap();
    assert_eq!(c.rpc_addr, None);
    assert_eq!(c.cluster.slot_ids, 64);
    assert!(c.cluster.nodes.is_empty());
    assert_eq!(c.cluster.peers(5).count(), 0);
    assert_eq!(
        c.cluster.initial_view(5).unwrap(),
        ClusterView::single_node(5)
    );
}

/// `[cluster] replicas` is 1 (the default) to the node count; `raft_tick_ms` and
/// `raft_entries_retained` at least 1; `raft_lease_margin_ms` below the lease's
/// 9 ticks; all read from the file.
#[test]
fn replicas_and_the_raft_tick_are_read_and_checked() {
    let c = Config::parse(&three_nodes(1), no_env)
        .unwrap()
        .to_node_config()
        .unwrap();
    assert_eq!((c.cluster.replicas, c.cluster.raft_tick_ms), (1, 50));
    assert_eq!(c.cluster.raft_entries_retained, 4096);
    assert_eq!(c.cluster.raft_lease_margin_ms, 50);
    let with =
        |extra: &str| three_nodes(1).replace("slot_ids = 64", &format!("slot_ids = 64\n{extra}"));
    let c = Config::parse(
        &with("replicas = 3\nraft_tick_ms = 20\nraft_entries_retained = 7\nraft_lease_margin_ms = 179"),
        no_env,
    )
    .unwrap()
    .to_node_config()
    .unwrap();
    assert_eq!((c.cluster.replicas, c.cluster.raft_tick_ms), (3, 20));
    assert_eq!(c.cluster.raft_entries_retained, 7);
    assert_eq!(c.cluster.raft_lease_margin_ms, 179);
    for (extra, says) in [
        (
            "replicas = 4",
            "cluster.replicas = 4 must be 1 to the node count (3)",
        ),
        ("replicas = 0", "cluster.replicas = 0"),
        (
            "raft_tick_ms = 0",
            "cluster.raft_tick_ms must be at least 1",
        ),
        (
            "raft_entries_retained = 0",
            "cluster.raft_entries_retained must be at least 1",
        ),
        (
            "raft_tick_ms = 20\nraft_lease_margin_ms = 180",
            "cluster.raft_lease_margin_ms = 180 must be below 9 × raft_tick_ms (180 ms)",
        ),
    ] {
        let e = error_of(&with(extra));
        assert!(e.contains(says), "{extra}: {e}");
    }
}
