//! Issue 15: `POST /node/drain` under load. Three nodes in this process; nine
//! clients spread over them (three per node), each sending person messages to the
//! next client and group messages to a group of all nine (homed on node 2, the
//! node drained: homes do not move, so it keeps serving them). While messages flow,
//! node 2 is drained; its clients get DISCONNECT (reason 0) and reconnect to node 1
//! or 3, resending the SEND whose SENDACK they had not read (same client_msg_no).
//! Then: every SENDACKed (success) message is readable by messagesync at its home,
//! as its recipient reads it; every RECV is such a message; every client ends on
//! node 1 or 3; no node's `/cluster/slots` shows a hash slot led by node 2; node
//! 2's `/readyz` is 503 "draining" and new connections to it are closed; a second
//! drain answers again with nothing left to do; a node alone answers 409.

#[macro_use]
mod support;

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use engine::node::Node;
use net::client::{Client, Login, Received};
use net::io::Backend;
use serde_json::{json, Value};
use support::cluster::{find_uid, home_of, Cluster};
use support::processes::http;
use support::{api, http_get};

const READ_TIMEOUT: Duration = Duration::from_secs(10);
const CLIENTS: usize = 9;
/// Most SENDs one client makes before the drain answered (it keeps PINGing after,
/// until the drain raises its budget or the test stops it).
const SENDS_PER_CLIENT_MAX: u32 = 200;
/// SENDs each client may make more once the drain answered.
const SENDS_AFTER_DRAIN_MAX: u32 = 20;
/// SENDACKed messages (all clients) before the drain starts.
const ACKED_BEFORE_DRAIN: usize = 90;
/// SENDACKed messages each client gets after the drain answered.
const ACKED_AFTER_DRAIN_PER_CLIENT: usize = 5;
/// Attempts of one SEND refused (not SUCCESS) or of one reconnect.
const ATTEMPTS_MAX: u32 = 200;

/// One SENDACKed message.
#[derive(Clone, Debug)]
struct Acked {
    from: String,
    channel_id: String,
    channel_type: u8,
    client_msg_no: String,
    message_id: i64,
    message_seq: u64,
}

/// What one client saw.
#[derive(Debug, Default)]
struct Outcome {
    acked: Vec<Acked>,
    /// Message ids of every RECV.
    received: Vec<i64>,
    /// `(node, reason)` of each DISCONNECT.
    disconnects: Vec<(u64, u8)>,
    /// The node it was connected to at the end.
    final_node: u64,
}

/// What the clients' threads share with the test.
struct Shared {
    addrs: Vec<std::net::SocketAddr>,
    group: String,
    uids: Vec<String>,
    stop: AtomicBool,
    /// How many SENDs each client may make (raised once the drain answered, so a
    /// client that used its budget before still sends after it).
    sends_allowed: std::sync::atomic::AtomicU32,
    acked_total: AtomicUsize,
    acked: Vec<AtomicUsize>,
}

fn connect(shared: &Shared, node: u64, uid: &str) -> Client {
    let addr = shared.addrs[node as usize - 1];
    for _ in 0..ATTEMPTS_MAX {
        if let Ok((c, 1)) = Client::connect(addr, &Login::new(uid, "any"), READ_TIMEOUT) {
            return c;
        }
        std::thread::yield_now();
    }
    panic!("{uid} could not log in on node {node}");
}

/// One client's life: SENDs (person to the next client, then the group, in turn)
/// until `stop`, reading RECVs (acknowledged) and answering a DISCONNECT by
/// reconnecting to `elsewhere`.
struct ClientRun<'a> {
    shared: &'a Shared,
    me: usize,
    node: u64,
    elsewhere: u64,
    client: Client,
    out: Outcome,
    client_seq: u32,
}

enum Answer {
    Acked(i64, u64),
    Refused,
    Lost,
}

impl ClientRun<'_> {
    fn uid(&self) -> &str {
        &self.shared.uids[self.me]
    }

    /// Reads until the SENDACK of `client_seq` (`Lost`: the connection ended
    /// first, after a DISCONNECT or not).
    fn await_sendack(&mut self, client_seq: u32) -> Answer {
        loop {
            match self.client.read() {
                Ok(Received::Recv(m)) => {
                    self.out.received.push(m.message_id);
                    let _ = self.client.recvack(m.message_id, m.message_seq);
                }
                Ok(Received::Sendack {
                    client_seq: s,
                    message_id,
                    message_seq,
                    reason,
                }) if s == client_seq => {
                    return if reason == 1 {
                        Answer::Acked(message_id, message_seq)
                    } else {
                        Answer::Refused
                    };
                }
                Ok(Received::Disconnect { reason, .. }) => {
                    self.out.disconnects.push((self.node, reason));
                    return Answer::Lost;
                }
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    panic!("{}: no SENDACK within {READ_TIMEOUT:?}", self.uid())
                }
                Err(_) => return Answer::Lost,
            }
        }
    }

    /// Moves to `elsewhere` (the connection to `node` ended).
    fn reconnect(&mut self) {
        let _ = self.client.wait_closed();
        assert_ne!(
            self.node, self.elsewhere,
            "{} lost its connection to node {}, which was not drained",
            self.shared.uids[self.me], self.node
        );
        self.node = self.elsewhere;
        self.client = connect(self.shared, self.node, &self.shared.uids[self.me]);
    }

    /// Sends message `k` until it is SENDACKed (success), across reconnects; a
    /// refused SEND is retried (bounded).
    fn send(&mut self, k: u32) {
        let (channel_id, channel_type) = if k.is_multiple_of(2) {
            (self.shared.uids[(self.me + 1) % CLIENTS].clone(), 1)
        } else {
            (self.shared.group.clone(), 2)
        };
        let client_msg_no = format!("{}-{k}", self.uid());
        for _ in 0..ATTEMPTS_MAX {
            self.client_seq += 1;
            let seq = self.client_seq;
            let payload = client_msg_no.as_bytes();
            let sent = self.client.send(
                &channel_id,
                channel_type,
                seq,
                &client_msg_no,
                payload,
                true,
            );
            let answer = match sent {
                Ok(()) => self.await_sendack(seq),
                Err(_) => Answer::Lost,
            };
            match answer {
                Answer::Acked(message_id, message_seq) => {
                    self.out.acked.push(Acked {
                        from: self.uid().to_string(),
                        channel_id,
                        channel_type,
                        client_msg_no,
                        message_id,
                        message_seq,
                    });
                    self.shared.acked[self.me].fetch_add(1, Ordering::SeqCst);
                    self.shared.acked_total.fetch_add(1, Ordering::SeqCst);
                    return;
                }
                Answer::Refused => std::thread::yield_now(),
                Answer::Lost => self.reconnect(),
            }
        }
        panic!("{client_msg_no} refused {ATTEMPTS_MAX} times");
    }

    /// A PING answered (RECVs read meanwhile), or the connection moved.
    fn idle(&mut self) {
        if self.client.ping().is_err() {
            return self.reconnect();
        }
        loop {
            match self.client.read() {
                Ok(Received::Pong) => return,
                Ok(Received::Recv(m)) => {
                    self.out.received.push(m.message_id);
                    let _ = self.client.recvack(m.message_id, m.message_seq);
                }
                Ok(Received::Disconnect { reason, .. }) => {
                    self.out.disconnects.push((self.node, reason));
                    return self.reconnect();
                }
                Ok(_) => {}
                Err(_) => return self.reconnect(),
            }
        }
    }

    fn run(mut self) -> Outcome {
        let mut k = 0;
        while !self.shared.stop.load(Ordering::SeqCst) {
            if k < self.shared.sends_allowed.load(Ordering::SeqCst) {
                self.send(k);
                k += 1;
            } else {
                self.idle();
            }
        }
        // Last: what was pushed before the stop is read (a PING answered after it).
        self.idle();
        self.out.final_node = self.node;
        self.out
    }
}

fn post(node: &Node, path: &str, body: &str) -> (u16, Value) {
    let (status, text) = http(node.api_addr().unwrap(), "POST", path, body).unwrap();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// Every message of a channel as `login_uid` reads it (through node 1: passed
/// to the home), by message id.
fn synced(
    node: &Node,
    login_uid: &str,
    channel_id: &str,
    channel_type: u8,
) -> BTreeMap<i64, Value> {
    let (status, body) = api(
        node,
        "/channel/messagesync",
        json!({"login_uid": login_uid, "channel_id": channel_id, "channel_type": channel_type,
               "start_message_seq": 0, "end_message_seq": 0, "limit": 10_000, "pull_mode": 1}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["more"], 0, "one page holds the channel");
    body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["message_id"].as_i64().unwrap(), m.clone()))
        .collect()
}

/// Nine uids, client i on node i % 3 + 1; a group of all nine homed on node 2.
fn placement(cluster: &Cluster) -> (Vec<String>, String) {
    let uids: Vec<String> = (0..CLIENTS).map(|i| format!("drain-u{i}")).collect();
    let group = find_uid("drain-g", |g| home_of(&cluster.view, g, g, 2) == 2);
    let (status, body) = api(
        cluster.node(1),
        "/channel/subscriber_add",
        json!({"channel_id": group, "channel_type": 2, "subscribers": uids}),
    );
    assert_eq!(status, 200, "{body}");
    (uids, group)
}

fn start_clients(shared: &Arc<Shared>) -> Vec<std::thread::JoinHandle<Outcome>> {
    (0..CLIENTS)
        .map(|i| {
            let shared = shared.clone();
            let node = (i % 3) as u64 + 1;
            // Node 2's clients move to node 1 or 3; the others stay.
            let elsewhere = if node == 2 { [1, 3][i % 2] } else { node };
            let client = connect(&shared, node, &shared.uids[i]);
            std::thread::spawn(move || {
                ClientRun {
                    shared: &shared,
                    me: i,
                    node,
                    elsewhere,
                    client,
                    out: Outcome::default(),
                    client_seq: 0,
                }
                .run()
            })
        })
        .collect()
}

/// Waits (bounded: a failure detector) until `done` holds.
fn wait_until(what: &str, done: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        std::thread::yield_now();
    }
}

/// The drain's answers and node 2's state afterwards.
fn drain_node_2(cluster: &Cluster) {
    let led_by_2 = (0..256u16)
        .filter(|&h| cluster.view.target_for_slot(h).leader_node_id == 2)
        .count();
    let (status, answer) = post(cluster.node(2), "/node/drain", "");
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["moved_hash_slots"], led_by_2, "{answer}");
    assert_eq!(
        answer["disconnected"], 3,
        "node 2's three clients: {answer}"
    );
    assert_eq!(answer["moved_to"], json!([1, 3]), "{answer}");
    assert_eq!(answer["peers_without_view"], json!([]), "{answer}");
    let revision = answer["revision"].as_u64().unwrap();
    assert!(revision > cluster.view.revision, "{answer}");
    for id in 1..=3 {
        let (status, text) =
            http_get(cluster.node(id).api_addr().unwrap(), "/cluster/slots").unwrap();
        assert_eq!(status, 200);
        let slots: Value = serde_json::from_str(&text).unwrap();
        assert!(slots["revision"].as_u64().unwrap() >= revision, "node {id}");
        let led: Vec<u64> = slots["slots"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["leader_node_id"] == 2)
            .map(|s| s["hash_slot"].as_u64().unwrap())
            .collect();
        assert!(
            led.is_empty(),
            "node {id} shows hash slots led by node 2: {led:?}"
        );
    }
}

/// After the drain: node 2 is not ready, refuses clients, and a second drain has
/// nothing left to do.
fn node_2_stays_drained(cluster: &Cluster, uids: &[String]) {
    let (status, text) = http_get(cluster.node(2).api_addr().unwrap(), "/readyz").unwrap();
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("draining"), "{text}");
    for id in [1, 3] {
        let (status, text) = http_get(cluster.node(id).api_addr().unwrap(), "/readyz").unwrap();
        assert_eq!(status, 200, "node {id}: {text}");
    }
    let login = Login::new(&uids[1], "any");
    let refused = Client::connect(cluster.node(2).tcp_addr().unwrap(), &login, READ_TIMEOUT);
    assert!(refused.is_err(), "node 2 closes new client connections");
    let (status, again) = post(cluster.node(2), "/node/drain", r#"{"move_to": [3]}"#);
    assert_eq!(status, 200, "{again}");
    assert_eq!(
        (&again["moved_hash_slots"], &again["disconnected"]),
        (&json!(0), &json!(0)),
        "{again}"
    );
    let (status, _) = post(cluster.node(2), "/node/drain", r#"{"move_to": [2]}"#);
    assert_eq!(status, 400, "a node cannot move its slots to itself");
}

/// No SENDACKed message lost: each is in its channel's log at its home, as its
/// recipient reads it; every RECV is one of the logged messages.
fn nothing_acked_is_lost(cluster: &Cluster, shared: &Shared, outcomes: &[Outcome]) {
    let node1 = cluster.node(1);
    let group = synced(node1, &shared.uids[0], &shared.group, 2);
    let mut logged: HashSet<i64> = group.keys().copied().collect();
    let mut checked = 0;
    for (i, out) in outcomes.iter().enumerate() {
        let next = &shared.uids[(i + 1) % CLIENTS];
        let person = synced(node1, next, &shared.uids[i], 1);
        logged.extend(person.keys().copied());
        for a in &out.acked {
            let log = if a.channel_type == 2 { &group } else { &person };
            let m = log
                .get(&a.message_id)
                .unwrap_or_else(|| panic!("{a:?} was SENDACKed but its channel's log lacks it"));
            assert_eq!(m["message_seq"], a.message_seq, "{a:?}");
            assert_eq!(m["client_msg_no"], a.client_msg_no.as_str(), "{a:?}");
            assert_eq!(m["from_uid"], a.from.as_str(), "{a:?}");
            // As the recipient reads it: a person channel names the sender.
            let seen = if a.channel_type == 2 {
                &a.channel_id
            } else {
                &a.from
            };
            assert_eq!(m["channel_id"], seen.as_str(), "{a:?}");
            checked += 1;
        }
    }
    assert!(checked >= ACKED_BEFORE_DRAIN + CLIENTS * ACKED_AFTER_DRAIN_PER_CLIENT);
    for (i, out) in outcomes.iter().enumerate() {
        for id in &out.received {
            assert!(logged.contains(id), "client {i} got RECV {id}, in no log");
        }
        assert!(!out.received.is_empty(), "client {i} got RECVs");
    }
}

fn drain_under_load_loses_no_acknowledged_message(backend: Backend) {
    let cluster = Cluster::start(backend);
    let (uids, group) = placement(&cluster);
    let shared = Arc::new(Shared {
        addrs: cluster
            .nodes
            .iter()
            .map(|n| n.tcp_addr().unwrap())
            .collect(),
        group,
        uids,
        stop: AtomicBool::new(false),
        sends_allowed: std::sync::atomic::AtomicU32::new(SENDS_PER_CLIENT_MAX),
        acked_total: AtomicUsize::new(0),
        acked: (0..CLIENTS).map(|_| AtomicUsize::new(0)).collect(),
    });
    let threads = start_clients(&shared);
    wait_until("messages flow before the drain", || {
        shared.acked_total.load(Ordering::SeqCst) >= ACKED_BEFORE_DRAIN
    });
    drain_node_2(&cluster);
    let after: Vec<usize> = shared
        .acked
        .iter()
        .map(|a| a.load(Ordering::SeqCst))
        .collect();
    shared.sends_allowed.store(
        SENDS_PER_CLIENT_MAX + SENDS_AFTER_DRAIN_MAX,
        Ordering::SeqCst,
    );
    wait_until("every client sends after the drain", || {
        (0..CLIENTS).all(|i| {
            shared.acked[i].load(Ordering::SeqCst) >= after[i] + ACKED_AFTER_DRAIN_PER_CLIENT
        })
    });
    shared.stop.store(true, Ordering::SeqCst);
    let outcomes: Vec<Outcome> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    for (i, out) in outcomes.iter().enumerate() {
        let first = (i % 3) as u64 + 1;
        assert_ne!(out.final_node, 2, "client {i} ends on node 1 or 3");
        let expected: Vec<(u64, u8)> = if first == 2 { vec![(2, 0)] } else { vec![] };
        assert_eq!(
            out.disconnects, expected,
            "client {i}: DISCONNECT 0 from node 2 only"
        );
    }
    node_2_stays_drained(&cluster, &shared.uids);
    nothing_acked_is_lost(&cluster, &shared, &outcomes);
}

on_both_drivers!(drain_under_load_loses_no_acknowledged_message);

#[test]
fn a_node_alone_has_nowhere_to_drain() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(support::config(dir.path(), Backend::Mio)).unwrap();
    let reply = node.api().handle("POST", "/node/drain", None, b"");
    assert_eq!(reply.status, 409, "{}", reply.body);
    assert!(reply.body.contains("nowhere to move"), "{}", reply.body);
    let ready = node.api().handle("GET", "/readyz", None, b"");
    assert_eq!(ready.status, 200, "a refused drain leaves the node serving");
    node.shutdown().unwrap();
}
