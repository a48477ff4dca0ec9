//! Replies between nodes that used to be lost (issue 26, item 8): a reply to a peer
//! that asked before this node could dial it back, and the deadlines of requests
//! served for other nodes.
//!
//! Replies travel on the replier's own link to the requester (the link the request
//! came on carries nothing back). A node that restarts dials its peers and asks at
//! once (token checks of reconnecting clients), before they have dialed it back:
//! those replies used to be dropped, and their requests failed at their deadline.
//! Now they are held (`[rpc] rpc_replies_held_max`, `rpc_replies_held_bytes_max`)
//! until the link back comes up with the process that asked, or until the
//! request's deadline.
//!
//! A request frame carries its deadline (relative, the time it had left when
//! sent): a request read with no time left to answer is not run, and a reply
//! whose request's deadline passed while it was served is not sent.
//!
//! A peer that answers Pings but no request (issue 26, item 5) opens the breaker of
//! the link to it once `[rpc] rpc_breaker_failures` requests in a row went
//! unanswered: later requests to it are refused at once, not left to their
//! deadline.
//!
//! Another node's HTTP API request (the hop `Api`, issue 26 item 3) is served on
//! the link as one that arrived here, its answer on the link back; one to a peer
//! that answers nothing is a 503 at its deadline.
//!
//! The test is node 2 of a two-node cluster whose node 1 (one shard) runs in the
//! process: it dials node 1's RPC listener with the cluster secret as node 2 would
//! and asks on that link; node 1's replies come on node 1's own dial to node 2's
//! `rpc_addr`, which the test listens on (or not yet) and answers as node 2's
//! listener would.

#[macro_use]
mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use engine::activation::AuthorityRequest;
use engine::channel::Channel;
use engine::cluster::{ClusterView, Target};
use engine::node::wire::{self, Body, Reply, Request};
use engine::node::{Node, NodeConfig};
use engine::route::{DeviceLevel, Route, Transport, Uid};
use net::io::Backend;
use proto::rpc::auth::Identity;
use proto::rpc::link::{Inbound, InboundEvent, LinkLimits, Outbound};
use proto::rpc::{Header, Kind};

const SECRET: &str = "lost-replies-test-secret-0123456789";
const SLOT_IDS: u32 = 64;
const TIMEOUT: Duration = Duration::from_secs(10);
/// Node 2's process, as the test plays it.
const NODE_2: Identity = Identity {
    node_id: 2,
    boot_id: 0x2222,
};
/// The deadline of the requests that must be answered: far beyond anything the
/// test waits for (a failure detector, not a wait).
const LONG_DEADLINE_MS: u32 = 10_000;

/// Node 1 of the cluster {1: in this process, 2: the test}, one shard, its data in
/// `dir`, on `ports` (RPC of nodes 1 and 2, then API of nodes 1 and 2). Node 1
/// redials soon (node 2 listens only when the test says so).
fn node_1_config(backend: Backend, ports: &[u16], dir: &Path) -> NodeConfig {
    let mut c = support::cluster::node_1_of_2(backend, ports, dir, SECRET, SLOT_IDS);
    c.rpc.rpc_backoff_min_ms = 5;
    c.rpc.rpc_backoff_ms_max = 50;
    c
}

struct Node1 {
    node: Node,
    rpc_addr: SocketAddr,
    /// Node 2's RPC port: node 1 dials it.
    node_2_port: u16,
    _dir: tempfile::TempDir,
}

fn node_1(backend: Backend, tune: impl FnOnce(&mut NodeConfig)) -> Node1 {
    node_1_hooked(backend, tune, engine::node::syncer::NodeHooks::default())
}

fn node_1_hooked(
    backend: Backend,
    tune: impl FnOnce(&mut NodeConfig),
    hooks: engine::node::syncer::NodeHooks,
) -> Node1 {
    let ports = support::cluster::free_ports(4);
    let dir = tempfile::tempdir().unwrap();
    let mut c = node_1_config(backend, &ports, dir.path());
    tune(&mut c);
    let rpc_addr = c.rpc_addr.unwrap();
    Node1 {
        node: Node::start_with(c, hooks).unwrap(),
        rpc_addr,
        node_2_port: ports[1],
        _dir: dir,
    }
}

/// A metric's value; 0 when the node does not export it.
fn metric(node: &Node, name: &str) -> u64 {
    let text = node.api().handle("GET", "/metrics", None, b"").body;
    text.lines()
        .find(|l| l.starts_with(&format!("{name} ")))
        .map_or(0, |l| l.rsplit(' ').next().unwrap().parse().unwrap())
}

fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    while !ok() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::yield_now();
    }
}

/// Node 2's link to node 1 (the requests' way), handshake done.
struct Asker {
    stream: TcpStream,
    link: Outbound<()>,
}

impl Asker {
    fn dial(rpc_addr: SocketAddr) -> Asker {
        let key = support::cluster::rpc_key(SECRET.as_bytes(), SLOT_IDS);
        let (stream, link, _) = support::cluster::dial_as(rpc_addr, &key, NODE_2);
        Asker { stream, link }
    }

    /// Sends `request` with `deadline_ms` left; its request id.
    fn ask(&mut self, request: &Request, deadline_ms: u32) -> u64 {
        let mut body = Vec::new();
        wire::encode(request, &mut body);
        let mut out = Vec::new();
        let id = self
            .link
            .request(request.kind(), &body, deadline_ms, (), 0, &mut out)
            .unwrap();
        self.stream.write_all(&out).unwrap();
        id
    }
}

/// Node 2's RPC listener with node 1's dial accepted (the replies' way): the
/// handshake answered, then node 1's frames one at a time.
struct Back {
    stream: TcpStream,
    inbound: Inbound,
    input: Vec<u8>,
}

impl Back {
    /// Accepts node 1's next dial on `listener`.
    fn accept(listener: &TcpListener) -> Back {
        let key = support::cluster::rpc_key(SECRET.as_bytes(), SLOT_IDS);
        let (stream, _) = listener.accept().unwrap();
        let nonce = [9; proto::rpc::auth::NONCE_BYTES];
        let inbound = Inbound::new(&key, NODE_2, &[1], nonce, LinkLimits::default(), 0);
        let mut back = Back {
            stream,
            inbound,
            input: Vec::new(),
        };
        back.handshake();
        back
    }

    /// Answers node 1's handshake until it is established.
    fn handshake(&mut self) {
        let (mut out, mut buf) = (Vec::new(), [0u8; 4096]);
        self.stream.set_read_timeout(Some(TIMEOUT)).unwrap();
        loop {
            out.clear();
            let step = self.inbound.on_input(&self.input, 0, &mut out);
            self.input.drain(..step.consumed);
            self.stream.write_all(&out).unwrap();
            match step.event {
                Some(InboundEvent::Established(_)) => return,
                Some(other) => panic!("node 1's handshake: {other:?}"),
                None if step.consumed > 0 => continue,
                None => {}
            }
            let n = self.stream.read(&mut buf).expect("node 1's handshake");
            assert!(n > 0, "node 1 closed its link during the handshake");
            self.input.extend_from_slice(&buf[..n]);
        }
    }

    /// Node 1's next hop frame (a reply or a one-way message; Pings are answered),
    /// read before `deadline`.
    fn next(&mut self, deadline: Instant) -> (Header, Body) {
        let bounds = wire::Bounds {
            node_id: NODE_2.node_id,
            boot_id: NODE_2.boot_id,
            shard_count: 1,
            nodes: vec![1, 2],
            slot_ids: SLOT_IDS,
        };
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            out.clear();
            let step = self.inbound.on_input(&self.input, 0, &mut out);
            self.input.drain(..step.consumed);
            self.stream.write_all(&out).unwrap();
            match step.event {
                Some(InboundEvent::Frame { header }) => {
                    let body = wire::decode(header.kind, self.inbound.body(), &bounds, 1);
                    if let Some(body) = body {
                        return (header, body.expect("node 1's frame decodes"));
                    }
                    continue;
                }
                Some(other) => panic!("node 1's link: {other:?}"),
                None if step.consumed > 0 => continue,
                None => {}
            }
            let left = deadline
                .checked_duration_since(Instant::now())
                .filter(|d| !d.is_zero())
                .expect("node 1's frame before the deadline");
            self.stream.set_read_timeout(Some(left)).unwrap();
            match self.stream.read(&mut buf) {
                Ok(0) => panic!("node 1 closed its link"),
                Ok(n) => self.input.extend_from_slice(&buf[..n]),
                Err(e) => panic!("no frame from node 1 before the deadline: {e}"),
            }
        }
    }

    /// The replies node 1 sends until its next view (shard 0 sends the view right
    /// after a link comes up, after the replies held for it), by request id.
    fn replies_until_view(&mut self, deadline: Instant) -> Vec<(u64, Reply)> {
        let mut replies = Vec::new();
        loop {
            match self.next(deadline) {
                (header, Body::Reply(reply)) => replies.push((header.request_id, reply)),
                (_, Body::OneWay(wire::OneWay::View(_))) => return replies,
                // Node 1's own requests (delivery lookups) and pushes: not answered.
                (_, Body::Request(_) | Body::OneWay(_)) => {}
            }
        }
    }
}

fn token_request(uid: &str) -> Request {
    Request::Token {
        uid: uid.into(),
        device_flag: 1,
        token: "any".into(),
    }
}

/// Node 2's route of `uid` (its session `session_id` of shard 0).
fn route(uid: &str, session_id: u64) -> Route {
    Route {
        uid: Uid::from(uid),
        device_id: "d".into(),
        device_flag: 1,
        device_level: DeviceLevel::Master,
        node_id: NODE_2.node_id,
        boot_id: NODE_2.boot_id,
        session_id: engine::delivery::session_id(0, session_id),
        listener: Transport::Tcp,
        owner_seq: 1,
        connected_at_ms: 0,
        last_active_s: Some(1),
    }
}

fn view() -> ClusterView {
    ClusterView::initial(&[1, 2], SLOT_IDS).unwrap()
}

/// A uid whose authority is node 1, and its target.
fn led_by_node_1(prefix: &str) -> (String, Target) {
    let view = view();
    let uid = support::cluster::find_uid(prefix, |u| support::cluster::authority_of(&view, u) == 1);
    let target = view.target_for_uid(&uid);
    (uid, target)
}

/// Node 1 answers `requests` (token checks) while node 2 does not listen yet, so
/// the link its replies travel on cannot come up; then node 2 listens and accepts
/// node 1's dial. Returns the request ids and the replies that came on it.
fn answered_while_the_link_back_was_down(
    n1: &Node1,
    requests: usize,
    deadline_ms: u32,
) -> (Vec<u64>, Vec<(u64, Reply)>) {
    let mut asker = Asker::dial(n1.rpc_addr);
    let sent_at = Instant::now();
    let ids: Vec<u64> = (0..requests)
        .map(|i| asker.ask(&token_request(&format!("u{i}")), deadline_ms))
        .collect();
    // Each reply was made while node 1's link to node 2 could not come up: held
    // (or, before the fix, dropped), or refused past the limits.
    let node = &n1.node;
    wait_for("node 1 answered every request", || {
        let outcomes = [
            "imrouter_rpc_replies_held_total",
            "imrouter_rpc_replies_held_full_total",
            "imrouter_rpc_replies_dropped_total",
        ];
        outcomes.iter().map(|m| metric(node, m)).sum::<u64>() == requests as u64
    });
    assert_eq!(node.shared().peers_reached(), 0, "the link back is down");
    let listener = TcpListener::bind(("127.0.0.1", n1.node_2_port)).unwrap();
    let mut back = Back::accept(&listener);
    let deadline = sent_at + Duration::from_millis(u64::from(deadline_ms));
    let replies = back.replies_until_view(deadline.max(Instant::now() + TIMEOUT));
    drop(asker);
    (ids, replies)
}

/// Node 2 restarted: it dials node 1 and asks (a token check) before node 1 has
/// dialed it back. The reply is held and comes on node 1's dial once node 2
/// listens, before the request's deadline (before: dropped, and the request
/// failed at its deadline).
fn a_reply_waits_for_the_link_back_to_the_process_that_asked(backend: Backend) {
    let n1 = node_1(backend, |_| {});
    let mut asker = Asker::dial(n1.rpc_addr);
    let sent_at = Instant::now();
    let id = asker.ask(&token_request("u1"), LONG_DEADLINE_MS);
    let node = &n1.node;
    wait_for("node 1 answered while its link back was down", || {
        metric(node, "imrouter_rpc_replies_held_total")
            + metric(node, "imrouter_rpc_replies_dropped_total")
            == 1
    });
    assert_eq!(node.shared().peers_reached(), 0, "the link back is down");
    let listener = TcpListener::bind(("127.0.0.1", n1.node_2_port)).unwrap();
    let mut back = Back::accept(&listener);
    let deadline = sent_at + Duration::from_millis(u64::from(LONG_DEADLINE_MS));
    let (header, body) = back.next(deadline);
    assert_eq!(header.kind, Kind::Reply, "the held reply comes first");
    assert_eq!(header.request_id, id);
    match body {
        Body::Reply(Reply::Token(Ok(_))) => {}
        Body::Reply(other) => panic!("{other:?}"),
        _ => panic!("not a reply"),
    }
    assert_eq!(metric(node, "imrouter_rpc_replies_held_total"), 1);
    assert_eq!(metric(node, "imrouter_rpc_replies_released_total"), 1);
    assert_eq!(metric(node, "imrouter_rpc_replies_dropped_total"), 0);
    // Later replies go straight on the link, now up.
    let id = asker.ask(&token_request("u2"), LONG_DEADLINE_MS);
    let replies = back.replies_until_view_or(id, deadline);
    assert_eq!(replies, vec![id]);
    assert_eq!(metric(node, "imrouter_rpc_replies_held_total"), 1);
    n1.node.shutdown().unwrap();
}

impl Back {
    /// The request ids of the replies read until node 1's first lookup request.
    fn replies_until_lookup(&mut self, deadline: Instant) -> Vec<u64> {
        let mut ids = Vec::new();
        loop {
            match self.next(deadline) {
                (header, Body::Reply(_)) => ids.push(header.request_id),
                (_, Body::Request(Request::Lookup { .. })) => return ids,
                _ => {}
            }
        }
    }

    /// The request ids of the replies read until the one to `id` (views skipped).
    fn replies_until_view_or(&mut self, id: u64, deadline: Instant) -> Vec<u64> {
        let mut ids = Vec::new();
        loop {
            match self.next(deadline) {
                (header, Body::Reply(_)) => {
                    ids.push(header.request_id);
                    if header.request_id == id {
                        return ids;
                    }
                }
                // Views, node 1's own requests (delivery lookups) and pushes.
                (_, Body::Request(_) | Body::OneWay(_)) => {}
            }
        }
    }
}

/// A reply held past its request's deadline is dropped and counted: when the link
/// back comes up, it is not sent.
fn a_held_reply_is_dropped_at_its_requests_deadline(backend: Backend) {
    let n1 = node_1(backend, |_| {});
    let mut asker = Asker::dial(n1.rpc_addr);
    asker.ask(&token_request("u1"), 200);
    let node = &n1.node;
    wait_for("the held reply expired", || {
        metric(node, "imrouter_rpc_replies_expired_total") == 1
    });
    assert_eq!(metric(node, "imrouter_rpc_replies_held_total"), 1);
    let listener = TcpListener::bind(("127.0.0.1", n1.node_2_port)).unwrap();
    let mut back = Back::accept(&listener);
    let replies = back.replies_until_view(Instant::now() + TIMEOUT);
    assert!(replies.is_empty(), "no reply past its deadline");
    assert_eq!(metric(node, "imrouter_rpc_replies_released_total"), 0);
    n1.node.shutdown().unwrap();
}

/// The held replies are bounded per link by `[rpc] rpc_replies_held_max` and
/// `rpc_replies_held_bytes_max`: past either a reply is not held (counted), the
/// ones held are sent.
fn held_replies_are_bounded_in_count_and_bytes(backend: Backend) {
    // By count: 2 of 3.
    let n1 = node_1(backend, |c| c.rpc.rpc_replies_held_max = 2);
    let (ids, replies) = answered_while_the_link_back_was_down(&n1, 3, LONG_DEADLINE_MS);
    let got: Vec<u64> = replies.iter().map(|(id, _)| *id).collect();
    assert_eq!(got, ids[..2].to_vec());
    assert_eq!(metric(&n1.node, "imrouter_rpc_replies_held_full_total"), 1);
    assert_eq!(metric(&n1.node, "imrouter_rpc_replies_released_total"), 2);
    n1.node.shutdown().unwrap();

    // By bytes: room for one token reply and a half.
    let mut one = Vec::new();
    wire::encode(&Reply::Token(Ok(DeviceLevel::Master)), &mut one);
    let n1 = node_1(backend, |c| {
        c.default_device_level = DeviceLevel::Master;
        c.rpc.rpc_replies_held_bytes_max = one.len() * 3 / 2;
    });
    let (ids, replies) = answered_while_the_link_back_was_down(&n1, 2, LONG_DEADLINE_MS);
    let got: Vec<u64> = replies.iter().map(|(id, _)| *id).collect();
    assert_eq!(got, ids[..1].to_vec());
    assert_eq!(metric(&n1.node, "imrouter_rpc_replies_held_full_total"), 1);
    n1.node.shutdown().unwrap();
}

/// A request read with no time left to answer it (its deadline no more than
/// `[rpc] rpc_reply_margin_ms` away) is not run: the Register does not register
/// and gets no reply, counted; the next request, in time, is served.
fn a_request_past_its_deadline_is_not_run(backend: Backend) {
    let n1 = node_1(backend, |_| {});
    let listener = TcpListener::bind(("127.0.0.1", n1.node_2_port)).unwrap();
    let mut asker = Asker::dial(n1.rpc_addr);
    let mut back = Back::accept(&listener);
    let node = &n1.node;
    wait_for("node 1 reaches node 2", || {
        node.shared().peers_reached() == 1
    });
    let (late_uid, late_target) = led_by_node_1("late");
    let (uid, target) = led_by_node_1("in-time");
    let register = |uid: &str, target: Target, session: u64| Request::Authority {
        target,
        request: AuthorityRequest::Register {
            route: route(uid, session),
        },
    };
    // 1 ms left when sent: no more than the default margin (1 ms).
    let late = asker.ask(&register(&late_uid, late_target, 1), 1);
    let in_time = asker.ask(&register(&uid, target, 2), LONG_DEADLINE_MS);
    let deadline = Instant::now() + TIMEOUT;
    assert_eq!(back.replies_until_view_or(in_time, deadline), vec![in_time]);
    assert_ne!(late, in_time);
    assert_eq!(metric(node, "imrouter_rpc_requests_expired_total"), 1);
    // The late uid has no route at its authority; the other has.
    let lookup = Request::Lookup {
        groups: vec![(late_target, 0..1), (target, 1..2)],
        uids: vec![Uid::from(late_uid.as_str()), Uid::from(uid.as_str())],
    };
    let id = asker.ask(&lookup, LONG_DEADLINE_MS);
    let reply = loop {
        match back.next(deadline) {
            (h, Body::Reply(reply)) if h.request_id == id => break reply,
            (h, Body::Reply(_)) => panic!("a reply to request {:#x}", h.request_id),
            _ => {}
        }
    };
    let Reply::Lookup { endpoints, results } = reply else {
        panic!("{reply:?}");
    };
    let found = |i: usize| results[i].clone().unwrap().len();
    assert_eq!((found(0), found(1)), (0, 1), "{endpoints:?}");
    n1.node.shutdown().unwrap();
}

/// Holds the syncs of node 1's log while armed: the test sees one start and
/// releases it when it wants.
#[derive(Default)]
struct HeldSync {
    armed: Mutex<Option<(mpsc::Sender<()>, mpsc::Receiver<()>)>>,
}

impl engine::node::syncer::SyncHook for HeldSync {
    fn sync(&self, file: &std::fs::File, _: &Path, _: u32) -> std::io::Result<()> {
        let armed = self.armed.lock().unwrap().take();
        if let Some((started, release)) = armed {
            started.send(()).unwrap();
            release.recv().unwrap();
        }
        file.sync_data()
    }
}

/// A SEND node 2 forwarded whose commit waits on the disk past the request's
/// deadline: its SENDACK reply is not sent (counted), the message being committed
/// all the same; the replies after it are.
fn a_reply_made_after_its_requests_deadline_is_not_sent(backend: Backend) {
    let hook = Arc::new(HeldSync::default());
    let hooks = engine::node::syncer::NodeHooks {
        log_sync: Some(hook.clone()),
    };
    let n1 = node_1_hooked(
        backend,
        |c| c.log.fsync = engine::store::FsyncPolicy::Always,
        hooks,
    );
    let listener = TcpListener::bind(("127.0.0.1", n1.node_2_port)).unwrap();
    let mut asker = Asker::dial(n1.rpc_addr);
    let mut back = Back::accept(&listener);
    let node = &n1.node;
    wait_for("node 1 reaches node 2", || {
        node.shared().peers_reached() == 1
    });
    let view = view();
    // Homed on node 1, the recipient led by node 2: once the SEND is answered,
    // its delivery asks node 2 for the recipient's routes (on the same link, after
    // the answer).
    let peer = support::cluster::find_uid("to", |p| {
        support::cluster::home_of(&view, "from", p, 1) == 1
            && support::cluster::authority_of(&view, p) == 2
    });
    let send = wire::ForwardedSend {
        answer_to: (),
        sender: None,
        from_uid: Uid::from("from"),
        channel: Channel::resolve("from", &peer, 1).unwrap(),
        client_msg_no: "n1".into(),
        setting: 0,
        flags: 0,
        expire_s: 0,
        topic: String::new(),
        payload: b"hello".to_vec(),
    };
    let (started_tx, started) = mpsc::channel();
    let (release, release_rx) = mpsc::channel();
    *hook.armed.lock().unwrap() = Some((started_tx, release_rx));
    let deadline_ms = 50;
    asker.ask(&Request::Send(Box::new(send)), deadline_ms);
    started
        .recv_timeout(TIMEOUT)
        .expect("the commit's sync started");
    // Node 1 read the SEND before its sync started: once this much has passed
    // since, the request's deadline has on node 1's clock (ms, plus one for its
    // rounding). The deadline passing is what is tested, not a synchronisation.
    let passed = Instant::now() + Duration::from_millis(u64::from(deadline_ms) + 2);
    while Instant::now() < passed {
        std::thread::sleep(passed - Instant::now());
    }
    release.send(()).unwrap();
    let deadline = Instant::now() + TIMEOUT;
    let replies = back.replies_until_lookup(deadline);
    assert!(
        replies.is_empty(),
        "replies before the delivery: {replies:x?}"
    );
    assert_eq!(metric(node, "imrouter_rpc_replies_expired_total"), 1);
    assert_eq!(metric(node, "imrouter_rpc_requests_expired_total"), 0);
    // The replies after it come.
    let id = asker.ask(&token_request("u1"), LONG_DEADLINE_MS);
    assert_eq!(back.replies_until_view_or(id, deadline), vec![id]);
    n1.node.shutdown().unwrap();
}

/// Node 2's listener with node 1's link to it up (its handshake answered), then
/// silent: the test reads nothing more, so node 1's requests get no answer.
fn silent_node_2(n1: &Node1) -> Back {
    let listener = TcpListener::bind(("127.0.0.1", n1.node_2_port)).unwrap();
    let back = Back::accept(&listener);
    wait_for("node 1 reached node 2", || {
        n1.node.shared().peers_reached() == 1
    });
    back
}

/// Node 2 answers Pings but no request. Logins on node 1 whose authority is node
/// 2 are refused once their call's deadline passed; after `rpc_breaker_failures`
/// of node 1's requests went unanswered in a row, its link's breaker opens and the
/// next calls to node 2 are refused at once, counted, and their logins refused.
fn a_peer_that_answers_no_request_opens_the_links_breaker(backend: Backend) {
    let n1 = node_1(backend, |c| {
        c.rpc.rpc_breaker_failures = 2;
        c.rpc.rpc_breaker_cooldown_ms = 600_000;
        c.rpc.rpc_request_deadline_ms = 200;
        // Node 2 here reads nothing while the logins wait: no silence close.
        c.rpc.rpc_heartbeat_ms = 60_000;
        c.rpc.rpc_peer_silence_ms = 120_000;
    });
    let _back = silent_node_2(&n1);
    let node = &n1.node;
    let view = view();
    let addr = node.tcp_addr().unwrap();
    let refused = metric(node, "imrouter_rpc_requests_refused_breaker_total");
    assert_eq!(refused, 0);
    for i in 0..4 {
        let uid = support::cluster::find_uid(&format!("brk{i}-"), |u| {
            support::cluster::authority_of(&view, u) == 2
        });
        let login = net::client::Login::new(&uid, "any");
        let (_client, reason) = net::client::Client::connect(addr, &login, TIMEOUT).unwrap();
        assert_ne!(reason, 1, "{uid}'s authority (node 2) answered nothing");
    }
    wait_for("the breaker refused a request to node 2", || {
        metric(node, "imrouter_rpc_requests_refused_breaker_total") > 0
    });
    assert!(metric(node, "imrouter_rpc_request_failures_total") >= 2);
    n1.node.shutdown().unwrap();
}

/// The bearer token node 1's API takes in the `Api` hop's tests.
const API_TOKEN: &str = "api-link-token";

/// Node 2's API request for `/user/token` of `uid` (the hop `Api`), with
/// `authorization`.
fn api_token_call(uid: &str, authorization: &str) -> Request {
    let body = format!(r#"{{"uid":"{uid}","token":"t-api","device_flag":1}}"#);
    Request::Api(Box::new(wire::ApiCall {
        method: "POST".into(),
        target: "/user/token".into(),
        authorization: Some(authorization.into()),
        body: body.into_bytes(),
    }))
}

/// Another node's API request (the hop `Api`, issue 26 item 3) is served as one
/// that arrived here: checked against the bearer token (401 without it), answered
/// from this node's data only (a token whose home is node 2 is stored here, not
/// passed back), the answer on node 1's own link back.
fn a_peers_api_request_is_checked_and_answered_on_the_link(backend: Backend) {
    let n1 = node_1(backend, |c| {
        c.api.addr = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
        c.api.bearer_token = Some(API_TOKEN.into());
    });
    let listener = TcpListener::bind(("127.0.0.1", n1.node_2_port)).unwrap();
    let mut asker = Asker::dial(n1.rpc_addr);
    let mut back = Back::accept(&listener);
    let view = view();
    let uid = support::cluster::find_uid("api2-", |u| {
        view.home_node(slots::hash_slot(u.as_bytes())) == 2
    });
    let wrong = asker.ask(&api_token_call(&uid, "Bearer wrong"), LONG_DEADLINE_MS);
    let right = asker.ask(
        &api_token_call(&uid, &format!("Bearer {API_TOKEN}")),
        LONG_DEADLINE_MS,
    );
    let deadline = Instant::now() + TIMEOUT;
    let mut answers = std::collections::BTreeMap::new();
    while answers.len() < 2 {
        if let (header, Body::Reply(Reply::Api { status, body })) = back.next(deadline) {
            answers.insert(header.request_id, (status, body));
        }
    }
    assert_eq!(answers[&wrong].0, 401, "{:?}", answers[&wrong]);
    assert_eq!(answers[&right].0, 200, "{:?}", answers[&right]);
    let stored = n1.node.shared().catalog.token(&uid, 1);
    assert_eq!(stored.map(|(t, _)| t.to_string()), Some("t-api".into()));
    n1.node.shutdown().unwrap();
}

/// Another node's API request to a node that runs no HTTP API is answered 503 at
/// once, naming why, and counted.
fn a_peers_api_request_to_a_node_without_an_api_is_refused_and_counted(backend: Backend) {
    let n1 = node_1(backend, |_| {});
    let listener = TcpListener::bind(("127.0.0.1", n1.node_2_port)).unwrap();
    let mut asker = Asker::dial(n1.rpc_addr);
    let mut back = Back::accept(&listener);
    let refused = "imrouter_api_peer_requests_refused_total";
    assert_eq!(metric(&n1.node, refused), 0);
    let id = asker.ask(&api_token_call("u1", "Bearer t"), LONG_DEADLINE_MS);
    let deadline = Instant::now() + TIMEOUT;
    let (status, body) = loop {
        if let (h, Body::Reply(Reply::Api { status, body })) = back.next(deadline) {
            assert_eq!(h.request_id, id);
            break (status, body);
        }
    };
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("runs no HTTP API"), "{body}");
    assert_eq!(metric(&n1.node, refused), 1);
    n1.node.shutdown().unwrap();
}

/// A request homed on node 2, which answers Pings but no request, is a 503 naming
/// it once `[api] forward_timeout_ms` (the hop's deadline) passed.
fn an_api_request_to_a_silent_peer_is_a_503_at_its_deadline(backend: Backend) {
    let n1 = node_1(backend, |c| {
        c.api.addr = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
        c.api.forward_timeout_ms = 300;
    });
    let _back = silent_node_2(&n1);
    let node = &n1.node;
    let view = view();
    let uid = support::cluster::find_uid("mute2-", |u| {
        view.home_node(slots::hash_slot(u.as_bytes())) == 2
    });
    let body = format!(r#"{{"uid":"{uid}","token":"t"}}"#);
    let reply = node
        .api()
        .handle("POST", "/user/token", None, body.as_bytes());
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert!(
        reply
            .body
            .contains("home node 2 unreachable: no answer within 300 ms"),
        "{}",
        reply.body
    );
    n1.node.shutdown().unwrap();
}

on_both_drivers!(
    a_peers_api_request_is_checked_and_answered_on_the_link,
    a_peers_api_request_to_a_node_without_an_api_is_refused_and_counted,
    an_api_request_to_a_silent_peer_is_a_503_at_its_deadline,
    a_peer_that_answers_no_request_opens_the_links_breaker,
    a_reply_waits_for_the_link_back_to_the_process_that_asked,
    a_held_reply_is_dropped_at_its_requests_deadline,
    held_replies_are_bounded_in_count_and_bytes,
    a_request_past_its_deadline_is_not_run,
    a_reply_made_after_its_requests_deadline_is_not_sent
);
