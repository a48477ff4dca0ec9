//! A cluster of three real `imrouter` processes on 127.0.0.1, for the tests that
//! kill them: each node has its own config file, data directory and log file in one
//! temporary directory, on free loopback ports that stay the same across restarts.
//!
//! Contract: [`Processes::start_all`] gives three running processes (not yet
//! ready: call [`Processes::wait_ready`]); [`Processes::kill9`] sends SIGKILL and
//! reaps the process; [`Processes::restart`] starts it again with the same file,
//! data directory and ports. Every process still running is killed when the value
//! drops; when the test is failing, the tail of each node's log and its non-zero
//! cluster metrics are printed first, and the directory is kept (its path printed).
//! Token authentication is off (`[auth] token_auth = false`): any token logs in; the
//! per-uid SEND rate is off (the tests pipeline SENDs). Ports are fixed below the
//! kernel's ephemeral range, so no outgoing connection takes one while its node is
//! down. Waits are bounded: they fail the test (naming what) past their bound.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use engine::cluster::ClusterView;

use super::cluster::SLOT_IDS;

/// The nodes of the test cluster.
pub const NODES: usize = 3;
/// Shard threads of each node.
pub const SHARDS: usize = 2;
/// The longest wait for a node to become ready (a failure detector).
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Lines of each log printed when a test fails.
const LOG_TAIL_LINES_MAX: usize = 60;
/// The nodes' `RUST_LOG` when the test's is not set: the links and the hops at
/// debug level (a request refused by its link, a link closed, a dial), the rest
/// at info.
const NODE_LOG_DEFAULT: &str = "info,engine::node::peers=debug,engine::node::hops=debug";
/// The secret the three nodes share.
pub const SECRET: &str = "processes-test-cluster-secret";
/// The API's bearer token on the three nodes (a node with peers requires one);
/// [`http`] sends it on every request (a node without a token ignores it).
pub const API_TOKEN: &str = "processes-test-api-token";
/// The operator's token (slot moves, drains).
pub const ADMIN_TOKEN: &str = "processes-test-admin-token";

/// Three `imrouter` processes (node ids 1..=3) and their files.
pub struct Processes {
    dir: tempfile::TempDir,
    rpc: Vec<SocketAddr>,
    api: Vec<SocketAddr>,
    tcp: Vec<SocketAddr>,
    children: Vec<Option<Child>>,
    /// The initial view every node starts from.
    pub view: ClusterView,
}

/// An HTTP answer: the status and the body.
pub type HttpReply = (u16, String);

impl Processes {
    /// Writes the three config files and starts the three processes.
    pub fn start_all() -> Processes {
        Processes::start_all_with("")
    }

    /// [`Processes::start_all`] with `extra` (TOML tables the harness does not
    /// write, e.g. `[rpc]`) appended to every node's file.
    pub fn start_all_with(extra: &str) -> Processes {
        let ports = free_fixed_ports(3 * NODES);
        let addr = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
        let mut p = Processes {
            dir: tempfile::tempdir().unwrap(),
            rpc: ports[..NODES].iter().map(|&x| addr(x)).collect(),
            api: ports[NODES..2 * NODES].iter().map(|&x| addr(x)).collect(),
            tcp: ports[2 * NODES..].iter().map(|&x| addr(x)).collect(),
            children: (0..NODES).map(|_| None).collect(),
            view: ClusterView::initial(&[1, 2, 3], SLOT_IDS).unwrap(),
        };
        for id in 1..=NODES as u64 {
            let text = p.config_text(id) + extra;
            std::fs::write(p.config_path(id), text).unwrap();
        }
        for id in 1..=NODES as u64 {
            p.start(id);
        }
        p
    }

    /// Node `id`'s configuration file: its ids and listeners, the shared
    /// `[cluster]`, token authentication off.
    fn config_text(&self, id: u64) -> String {
        let i = id as usize - 1;
        let mut text = format!(
            "[node]\nnode_id = {id}\ndata_dir = {:?}\n\
             [listen]\nrpc_addr = \"{}\"\ntcp_addr = \"{}\"\nws_addr = \"127.0.0.1:0\"\n\
             api_addr = \"{}\"\n[auth]\ntoken_auth = false\napi_bearer_token = \"{API_TOKEN}\"\n\
             admin_token = \"{ADMIN_TOKEN}\"\n\
             [runtime]\nshard_count = {SHARDS}\npin_cores = []\n\
             [session]\nsends_per_uid_per_s = 0\n\
             [cluster]\nsecret = \"{SECRET}\"\nslot_ids = {SLOT_IDS}\n",
            self.dir.path().join(format!("data{id}")),
            self.rpc[i],
            self.tcp[i],
            self.api[i],
        );
        for n in 0..NODES {
            text.push_str(&format!(
                "[[cluster.nodes]]\nid = {}\nrpc_addr = \"{}\"\napi_addr = \"{}\"\n",
                n + 1,
                self.rpc[n],
                self.api[n]
            ));
        }
        text
    }

    fn config_path(&self, id: u64) -> PathBuf {
        self.dir.path().join(format!("node{id}.toml"))
    }

    /// Node `id`'s log file (stdout and stderr of every run, appended).
    pub fn log_path(&self, id: u64) -> PathBuf {
        self.dir.path().join(format!("node{id}.log"))
    }

    /// Starts node `id` (which must not be running); its output is appended to its
    /// log file after a line that marks the start.
    pub fn start(&mut self, id: u64) {
        let i = id as usize - 1;
        assert!(self.children[i].is_none(), "node {id} is running");
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path(id))
            .unwrap();
        writeln!(log, "===== test harness: starting node {id} =====").unwrap();
        let err: File = log.try_clone().unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_imrouter"))
            .arg("--config")
            .arg(self.config_path(id))
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| NODE_LOG_DEFAULT.into()),
            )
            .env("NO_COLOR", "1")
            .env_remove(engine::config::CLUSTER_SECRET_ENV)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(err))
            .spawn()
            .unwrap_or_else(|e| panic!("spawning node {id}: {e}"));
        self.children[i] = Some(child);
    }

    /// `kill -9` of node `id`, then reaps it: once this returns the process is gone
    /// and the kernel has closed its sockets.
    pub fn kill9(&mut self, id: u64) {
        let mut child = self.children[id as usize - 1]
            .take()
            .unwrap_or_else(|| panic!("node {id} is not running"));
        // `Child::kill` is SIGKILL on Unix.
        child.kill().unwrap();
        let status = child.wait().unwrap();
        assert!(!status.success(), "node {id} ended by SIGKILL: {status:?}");
    }

    /// Starts node `id` again with the same file, data directory and ports.
    pub fn restart(&mut self, id: u64) {
        self.start(id);
    }

    /// Waits (bounded by [`READY_TIMEOUT`]) until node `id`'s `/readyz` answers 200;
    /// fails the test with its last answer otherwise, or if the process ended.
    pub fn wait_ready(&mut self, id: u64) {
        self.wait_until(id, "/readyz answers 200", |p| {
            p.get(id, "/readyz").is_some_and(|(s, _)| s == 200)
        });
    }

    /// Polls `ok` until it holds, bounded by [`READY_TIMEOUT`] (a failure detector:
    /// the test fails naming `what`); fails at once if node `id` has exited.
    pub fn wait_until(&mut self, id: u64, what: &str, mut ok: impl FnMut(&Self) -> bool) {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if ok(self) {
                return;
            }
            if let Some(child) = self.children[id as usize - 1].as_mut() {
                if let Some(status) = child.try_wait().unwrap() {
                    panic!("node {id} exited ({status}) while waiting until {what}");
                }
            }
            assert!(
                Instant::now() < deadline,
                "node {id}: not true within {READY_TIMEOUT:?}: {what}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `method path` with `body` (JSON, may be empty) on node `id`'s HTTP API: the
    /// status and the body; `None` if the node does not answer.
    pub fn api(&self, id: u64, method: &str, path: &str, body: &str) -> Option<HttpReply> {
        http(self.api[id as usize - 1], method, path, body).ok()
    }

    /// `GET path` on node `id`.
    pub fn get(&self, id: u64, path: &str) -> Option<HttpReply> {
        self.api(id, "GET", path, "")
    }

    /// `GET /cluster/slots` on node `id`, parsed.
    pub fn slots(&self, id: u64) -> Option<serde_json::Value> {
        let (status, body) = self.get(id, "/cluster/slots")?;
        (status == 200).then(|| serde_json::from_str(&body).unwrap())
    }

    /// The value of the counter or gauge `name` (summed over its series) in node
    /// `id`'s `/metrics`.
    pub fn metric(&self, id: u64, name: &str) -> u64 {
        let (status, text) = self.get(id, "/metrics").expect("node answers /metrics");
        assert_eq!(status, 200, "{text}");
        let values: Vec<u64> = text
            .lines()
            .filter(|l| l.starts_with(name) && !l.starts_with('#'))
            .filter(|l| l[name.len()..].starts_with([' ', '{']))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64)
            .collect();
        assert!(!values.is_empty(), "node {id}: {name} missing");
        values.iter().sum()
    }

    /// Node `id`'s client TCP address.
    pub fn tcp_addr(&self, id: u64) -> SocketAddr {
        self.tcp[id as usize - 1]
    }

    /// Node `id`'s inter-node listener.
    pub fn rpc_addr(&self, id: u64) -> SocketAddr {
        self.rpc[id as usize - 1]
    }

    /// Node `id`'s log so far, every run.
    pub fn log(&self, id: u64) -> String {
        std::fs::read_to_string(self.log_path(id)).unwrap_or_default()
    }

    /// The authority (slot leader) of `uid` in the initial view.
    pub fn authority_of(&self, uid: &str) -> u64 {
        super::cluster::authority_of(&self.view, uid)
    }

    /// The home of the channel `channel_id` as `sender` addresses it.
    pub fn home_of(&self, sender: &str, channel_id: &str, channel_type: u8) -> u64 {
        super::cluster::home_of(&self.view, sender, channel_id, channel_type)
    }

    /// The hash slots node `leader` leads in the initial view.
    pub fn slots_led_by(&self, leader: u64) -> Vec<u16> {
        (0..slots::HASH_SLOTS as u16)
            .filter(|&h| self.view.target_for_slot(h).leader_node_id == leader)
            .collect()
    }

    fn print_log_tails(&self) {
        for id in 1..=NODES as u64 {
            self.print_log_tail(id);
        }
    }

    /// The last [`LOG_TAIL_LINES_MAX`] lines of node `id`'s log, then its
    /// non-zero cluster metrics.
    pub fn print_log_tail(&self, id: u64) {
        let log = self.log(id);
        let lines: Vec<&str> = log.lines().collect();
        let from = lines.len().saturating_sub(LOG_TAIL_LINES_MAX);
        eprintln!(
            "----- node {id}: last {} lines of {} -----",
            lines.len() - from,
            self.log_path(id).display()
        );
        for l in &lines[from..] {
            eprintln!("{l}");
        }
        self.print_cluster_metrics(id);
    }

    /// The non-zero inter-node, delivery and authority series of node `id`'s
    /// `/metrics`, if it answers.
    fn print_cluster_metrics(&self, id: u64) {
        let Some((200, text)) = self.get(id, "/metrics") else {
            return;
        };
        eprintln!("----- node {id}: non-zero cluster metrics -----");
        let words = [
            "rpc", "push", "lookup", "stale", "deliver", "touch", "fence",
        ];
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let zero = l.ends_with(" 0");
            if !zero && words.iter().any(|w| l.contains(w)) {
                eprintln!("{l}");
            }
        }
    }
}

impl Drop for Processes {
    fn drop(&mut self) {
        let failing = std::thread::panicking();
        if failing {
            self.print_log_tails();
        }
        for child in self.children.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if failing {
            let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap());
            eprintln!("logs and data kept in {}", dir.keep().display());
        }
    }
}

/// Lowest port [`free_fixed_ports`] considers.
const FIXED_PORT_MIN: u16 = 10_000;

/// `n` loopback ports free now, below the kernel's ephemeral range: the nodes bind
/// them (again after a restart) while other connections come and go, and a port
/// the kernel may hand out to an outgoing connection (or to a bind of port 0)
/// could be taken in between. The search starts at an offset derived from the
/// process id, and each call in the process further on, so concurrent tests rarely
/// probe the same ports.
pub fn free_fixed_ports(n: usize) -> Vec<u16> {
    let ephemeral_min = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    assert!(
        ephemeral_min > FIXED_PORT_MIN + 1_000,
        "no room below {ephemeral_min}"
    );
    let span = u32::from(ephemeral_min - FIXED_PORT_MIN);
    static CALLS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let start = std::process::id()
        .wrapping_mul(2_654_435_761)
        .wrapping_add(call * 1_009)
        % span;
    let mut held = Vec::new();
    for k in 0..span {
        let port = FIXED_PORT_MIN + ((start + k) % span) as u16;
        if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            held.push(l);
            if held.len() == n {
                break;
            }
        }
    }
    assert_eq!(held.len(), n, "free loopback ports below {ephemeral_min}");
    held.iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

/// One HTTP/1.1 request on its own connection (`Connection: close`); reads the
/// answer to the end (a 10 s read timeout as failure detector).
pub fn http(api: SocketAddr, method: &str, path: &str, body: &str) -> std::io::Result<HttpReply> {
    let mut s = TcpStream::connect(api)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let token = if engine::http::Api::is_admin(method, path) {
        ADMIN_TOKEN
    } else {
        API_TOKEN
    };
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Authorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP answer: {text:?}")))?;
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    Ok((status, body))
}
