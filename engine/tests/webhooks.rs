//! Issue 28 item 3: webhooks as WuKongIM sends them, to a receiver on 127.0.0.1 that
//! records every call (a small hyper server on a tokio runtime of the test's own).
//! `user.onlinestatus` with the right counts on connect and disconnect (cluster-wide
//! counts, from the uid's authority); one `msg.offline` per message naming exactly
//! its offline recipients; a receiver that is down and comes back loses nothing,
//! the failed requests counted; a three-node cluster sends each event once, from
//! the node that commits the message or leads the uid. `msg.notify`: every
//! committed message once per batch, and after a restart the tail the receiver did
//! not accept is sent again from the saved cursor (nothing lost, nothing accepted
//! before the cursor sent twice); a receiver down then up loses nothing. `https://`
//! receivers: trusted through `[webhook] ca_file` (a CA the test makes), an
//! untrusted certificate refused and counted as failed. A cursor file that does
//! not parse refuses the start, naming it.

#[macro_use]
mod support;

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use bytes::Bytes;
use engine::node::{Node, NodeConfig};
use hmac::{Hmac, Mac};
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use net::client::{Client, Login};
use net::io::Backend;
use serde_json::{json, Value};
use sha2::Sha256;
use support::cluster::{find_uid, Cluster};
use support::{api, next_recv, next_sendack};

/// A failure detector: every wait here ends when what it waits for happens.
const WAIT: Duration = Duration::from_secs(20);

/// One call the receiver got.
#[derive(Clone, Debug)]
struct Call {
    event: String,
    body: Value,
    raw: Vec<u8>,
    signature: Option<String>,
    /// `X-Imrouter-Batch`: `node.event.batch`.
    batch: String,
}

impl Call {
    /// The node that sent it (the batch header's first part).
    fn node(&self) -> u64 {
        self.batch.split('.').next().unwrap().parse().unwrap()
    }

    /// The node's start that sent it (the batch header's part before the batch).
    fn boot(&self) -> String {
        self.batch.rsplit('.').nth(1).unwrap().to_string()
    }
}

/// The receiver: records every call, answers 200; can go down (listener and
/// connections closed: connections refused) and come back on the same port.
struct Receiver {
    addr: SocketAddr,
    rt: tokio::runtime::Runtime,
    server: Option<tokio::task::JoinHandle<()>>,
    tx: mpsc::Sender<Call>,
    calls: mpsc::Receiver<Call>,
    tls: Option<tokio_rustls::TlsAcceptor>,
}

impl Receiver {
    fn start() -> Receiver {
        Receiver::start_with(None)
    }

    /// A receiver behind TLS with `tls`'s certificate.
    fn start_tls(tls: Arc<rustls::ServerConfig>) -> Receiver {
        Receiver::start_with(Some(tokio_rustls::TlsAcceptor::from(tls)))
    }

    fn start_with(tls: Option<tokio_rustls::TlsAcceptor>) -> Receiver {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (tx, calls) = mpsc::channel();
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let server = Some(rt.spawn(serve(listener, tx.clone(), tls.clone())));
        Receiver {
            addr,
            rt,
            server,
            tx,
            calls,
            tls,
        }
    }

    fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}/hook", self.addr)
    }

    /// Closes the listener and every connection.
    fn down(&mut self) {
        let server = self.server.take().unwrap();
        server.abort();
        let _ = self.rt.block_on(server);
    }

    /// Listens again on the same address.
    fn up(&mut self) {
        let listener = self
            .rt
            .block_on(tokio::net::TcpListener::bind(self.addr))
            .unwrap();
        self.server = Some(
            self.rt
                .spawn(serve(listener, self.tx.clone(), self.tls.clone())),
        );
    }

    fn next(&self) -> Call {
        self.calls
            .recv_timeout(WAIT)
            .expect("a webhook call within the wait")
    }

    /// Calls until one of `event` for which `done` holds (all of them kept).
    fn until(&self, seen: &mut Vec<Call>, done: impl Fn(&[Call]) -> bool) {
        let deadline = Instant::now() + WAIT;
        while !done(seen) {
            assert!(Instant::now() < deadline, "calls so far: {seen:#?}");
            seen.push(self.next());
        }
    }
}

async fn serve(
    listener: tokio::net::TcpListener,
    tx: mpsc::Sender<Call>,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let (tx, tls) = (tx.clone(), tls.clone());
        conns.spawn(async move {
            let svc = service_fn(move |req| record(req, tx.clone()));
            let http = hyper::server::conn::http1::Builder::new();
            match tls {
                None => {
                    let _ = http.serve_connection(TokioIo::new(stream), svc).await;
                }
                // A handshake the client refuses ends here: no call is recorded.
                Some(tls) => {
                    if let Ok(stream) = tls.accept(stream).await {
                        let _ = http.serve_connection(TokioIo::new(stream), svc).await;
                    }
                }
            }
        });
    }
}

async fn record(
    req: hyper::Request<hyper::body::Incoming>,
    tx: mpsc::Sender<Call>,
) -> Result<hyper::Response<Full<Bytes>>, hyper::Error> {
    assert_eq!(req.method(), hyper::Method::POST);
    let query = req.uri().query().unwrap_or("").to_string();
    let event = query
        .split('&')
        .find_map(|kv| kv.strip_prefix("event="))
        .unwrap_or("")
        .to_string();
    let header = |name: &str| {
        req.headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_string())
    };
    assert_eq!(header("content-type").as_deref(), Some("application/json"));
    let (signature, batch) = (header("x-imrouter-signature"), header("x-imrouter-batch"));
    let raw = req.into_body().collect().await?.to_bytes().to_vec();
    let body = serde_json::from_slice(&raw).expect("a JSON body");
    let _ = tx.send(Call {
        event,
        body,
        raw,
        signature,
        batch: batch.expect("a batch header"),
    });
    Ok(hyper::Response::new(Full::new(Bytes::new())))
}

/// A node sending its webhooks to `url`, logins without tokens.
fn webhook_config(dir: &std::path::Path, url: &str) -> NodeConfig {
    let mut c = support::config(dir, Backend::Mio);
    c.token_auth = false;
    c.webhook.url = url.to_string();
    c.webhook.batch_delay_ms = 5;
    c.webhook.backoff_min_ms = 20;
    c.webhook.backoff_ms_max = 100;
    // Unregisters of closed sessions reach the authority at the next touch flush.
    c.session.touch_flush_interval_ms = 50;
    c
}

fn login(node: &Node, uid: &str, device_flag: u8) -> Client {
    let mut login = Login::new(uid, "any");
    login.device_flag = device_flag;
    let (client, reason) = Client::connect(node.tcp_addr().unwrap(), &login, WAIT).unwrap();
    assert_eq!(reason, 1, "CONNACK for {uid}");
    client
}

/// A `user.onlinestatus` string split: (uid, flag, online, connid, devices, total).
fn status(s: &Value) -> (String, u8, u8, u64, u32, u32) {
    let s = s.as_str().expect("a string");
    let mut parts: Vec<&str> = s.rsplitn(6, '-').collect();
    parts.reverse();
    let n = |i: usize| parts[i].parse::<u64>().unwrap();
    let uid = parts[0].to_string();
    (uid, n(1) as u8, n(2) as u8, n(3), n(4) as u32, n(5) as u32)
}

/// Every status string of the `user.onlinestatus` calls in `calls`, in order.
fn statuses(calls: &[Call]) -> Vec<(String, u8, u8, u64, u32, u32)> {
    calls
        .iter()
        .filter(|c| c.event == "user.onlinestatus")
        .flat_map(|c| c.body.as_array().expect("an array").iter().map(status))
        .collect()
}

/// The value of `name{event="<event>"}` in the node's `/metrics`.
fn metric(node: &Node, name: &str, event: &str) -> u64 {
    let text = node.api().handle("GET", "/metrics", None, b"").body;
    let series = format!("{name}{{event=\"{event}\"}} ");
    let line = text
        .lines()
        .find(|l| l.starts_with(&series))
        .unwrap_or_else(|| panic!("{series} missing"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// Polls `/metrics` until `ok` holds for the series (a failure detector).
fn wait_metric(node: &Node, name: &str, event: &str, ok: impl Fn(u64) -> bool) -> u64 {
    let deadline = Instant::now() + WAIT;
    loop {
        let v = metric(node, name, event);
        if ok(v) {
            return v;
        }
        assert!(Instant::now() < deadline, "{name}{{{event}}} = {v}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn connect_and_disconnect_give_onlinestatus_with_the_counts() {
    let receiver = Receiver::start();
    let dir = tempfile::tempdir().unwrap();
    let mut c = webhook_config(dir.path(), &receiver.url());
    c.webhook.secret = engine::config::Secret::new("hook-secret".into());
    let node = Node::start(c).unwrap();
    let mut seen = Vec::new();
    let web = login(&node, "ann", 1);
    receiver.until(&mut seen, |c| statuses(c).len() == 1);
    let pc = login(&node, "ann", 2);
    receiver.until(&mut seen, |c| statuses(c).len() == 2);
    drop(web);
    receiver.until(&mut seen, |c| statuses(c).len() == 3);
    drop(pc);
    receiver.until(&mut seen, |c| statuses(c).len() == 4);
    let s = statuses(&seen);
    let (web_conn, pc_conn) = (s[0].3, s[1].3);
    assert_ne!(web_conn, pc_conn);
    let ann = |flag, online, conn, devices, total| {
        ("ann".to_string(), flag, online, conn, devices, total)
    };
    assert_eq!(
        s,
        [
            ann(1, 1, web_conn, 1, 1),
            ann(2, 1, pc_conn, 1, 2),
            ann(1, 0, web_conn, 0, 1),
            ann(2, 0, pc_conn, 0, 0),
        ]
    );
    // Signed: HMAC-SHA256 of the body with [webhook] secret.
    for call in &seen {
        let mut mac = Hmac::<Sha256>::new_from_slice(b"hook-secret").unwrap();
        mac.update(&call.raw);
        let hex: String = mac
            .finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(call.signature, Some(format!("sha256={hex}")));
    }
    // Counted once the receiver's answer is back.
    wait_metric(
        &node,
        "imrouter_webhook_sent_total",
        "user.onlinestatus",
        |v| v == 4,
    );
}

#[test]
fn a_group_send_gives_one_msg_offline_naming_exactly_its_offline_members() {
    let receiver = Receiver::start();
    let dir = tempfile::tempdir().unwrap();
    let mut c = webhook_config(dir.path(), &receiver.url());
    c.webhook.events = vec!["msg.offline".into()];
    let node = Node::start(c).unwrap();
    let members = ["sam", "on1", "off1", "off2", "off3"];
    let (status, reply) = api(
        &node,
        "/channel/subscriber_add",
        json!({"channel_id": "team", "channel_type": 2, "subscribers": members}),
    );
    assert_eq!(status, 200, "{reply}");
    let mut sam = login(&node, "sam", 1);
    let mut on1 = login(&node, "on1", 1);
    sam.send("team", 2, 1, "m1", b"hello team", true).unwrap();
    let (_, team_id, _, reason) = next_sendack(&mut sam);
    assert_eq!(reason, 1);
    assert_eq!(next_recv(&mut on1).message_id, team_id);
    // Then a person message to an offline uid: its event comes after the group's.
    sam.send("off1", 1, 2, "m2", b"hello off1", true).unwrap();
    let (_, person_id, _, _) = next_sendack(&mut sam);
    let mut seen = Vec::new();
    let has = |id: i64| move |c: &[Call]| c.iter().any(|c| c.body["message_id"] == json!(id));
    receiver.until(&mut seen, has(team_id));
    receiver.until(&mut seen, has(person_id));
    assert!(
        seen.iter().all(|c| c.event == "msg.offline"),
        "only msg.offline: {seen:#?}"
    );
    let team: Vec<&Call> = seen
        .iter()
        .filter(|c| c.body["message_id"] == json!(team_id))
        .collect();
    assert_eq!(team.len(), 1, "one call for the group message");
    let body = &team[0].body;
    assert_eq!(sorted_uids(&body["to_uids"]), ["off1", "off2", "off3"]);
    assert_eq!(body["message_idstr"], json!(team_id.to_string()));
    assert_eq!(
        (
            &body["from_uid"],
            &body["channel_id"],
            &body["channel_type"]
        ),
        (&json!("sam"), &json!("team"), &json!(2))
    );
    assert_eq!(body["payload"], json!("aGVsbG8gdGVhbQ=="));
    let person = seen
        .iter()
        .find(|c| c.body["message_id"] == json!(person_id));
    let person = &person.unwrap().body;
    assert_eq!(
        (&person["channel_id"], &person["to_uids"]),
        (&json!("off1"), &json!(["off1"])),
        "a person channel as its sender named it"
    );
    wait_metric(&node, "imrouter_webhook_sent_total", "msg.offline", |v| {
        v == 2
    });
    assert_eq!(
        metric(&node, "imrouter_webhook_sent_total", "user.onlinestatus"),
        0
    );
}

#[test]
fn a_receiver_down_then_up_loses_nothing_and_the_failures_are_counted() {
    let mut receiver = Receiver::start();
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(webhook_config(dir.path(), &receiver.url())).unwrap();
    let mut seen = Vec::new();
    let first = login(&node, "u0", 1);
    receiver.until(&mut seen, |c| statuses(c).len() == 1);
    receiver.down();
    let clients: Vec<Client> = (1..=10)
        .map(|i| login(&node, &format!("u{i}"), 1))
        .collect();
    let failed = wait_metric(
        &node,
        "imrouter_webhook_failed_total",
        "user.onlinestatus",
        |v| v >= 3,
    );
    assert!(failed >= 3);
    receiver.up();
    receiver.until(&mut seen, |c| statuses(c).len() >= 11);
    let mut uids: Vec<String> = statuses(&seen).into_iter().map(|s| s.0).collect();
    uids.sort();
    let mut want: Vec<String> = (0..=10).map(|i| format!("u{i}")).collect();
    want.sort();
    assert_eq!(uids, want, "each once: nothing lost, none twice");
    wait_metric(
        &node,
        "imrouter_webhook_sent_total",
        "user.onlinestatus",
        |v| v == 11,
    );
    assert_eq!(
        metric(&node, "imrouter_webhook_dropped_total", "user.onlinestatus"),
        0
    );
    assert_eq!(
        metric(&node, "imrouter_webhook_queued", "user.onlinestatus"),
        0
    );
    drop((first, clients));
}

/// Each node's `(sent, queued, queued bytes)` of `event` once nothing is queued.
fn drained(cluster: &Cluster, event: &str) -> Vec<u64> {
    cluster
        .nodes
        .iter()
        .map(|n| {
            wait_metric(n, "imrouter_webhook_queued_bytes", event, |v| v == 0);
            assert_eq!(metric(n, "imrouter_webhook_queued", event), 0);
            metric(n, "imrouter_webhook_sent_total", event)
        })
        .collect()
}

#[test]
fn a_three_node_cluster_sends_each_event_once_from_its_node() {
    let receiver = Receiver::start();
    let url = receiver.url();
    let cluster = Cluster::start_with(Backend::Mio, |c| {
        c.webhook.url = url.clone();
        c.webhook.batch_delay_ms = 5;
        c.webhook.events = ["msg.offline", "user.onlinestatus", "msg.notify"]
            .map(String::from)
            .to_vec();
    });
    // ann's authority is node 3; her devices on nodes 1 and 2.
    let ann = find_uid("ann", |u| cluster.authority_of(u) == 3);
    let _web = login(cluster.node(1), &ann, 1);
    let mut seen = Vec::new();
    receiver.until(&mut seen, |c| statuses(c).len() == 1);
    let _pc = login(cluster.node(2), &ann, 2);
    receiver.until(&mut seen, |c| statuses(c).len() == 2);
    let s = statuses(&seen);
    assert_eq!((s[0].1, s[0].2, s[0].4, s[0].5), (1, 1, 1, 1));
    assert_eq!(
        (s[1].1, s[1].2, s[1].4, s[1].5),
        (2, 1, 1, 2),
        "counts of both nodes"
    );
    // A group homed on node 1, its offline members led by every node.
    let home_team = find_uid("team", |g| cluster.home_of("x", g, 2) == 1);
    let offline: Vec<String> = (1..=3)
        .map(|n| find_uid(&format!("off{n}-"), |u| cluster.authority_of(u) == n))
        .collect();
    let mut members = offline.clone();
    members.push(ann.clone());
    let (status, reply) = api(
        cluster.node(1),
        "/channel/subscriber_add",
        json!({"channel_id": home_team, "channel_type": 2, "subscribers": members}),
    );
    assert_eq!(status, 200, "{reply}");
    let mut sender = login(cluster.node(2), &ann, 3);
    receiver.until(&mut seen, |c| statuses(c).len() == 3);
    sender
        .send(&home_team, 2, 1, "c1", b"to all", true)
        .unwrap();
    let (_, id, _, reason) = next_sendack(&mut sender);
    assert_eq!(reason, 1);
    receiver.until(&mut seen, |c| c.iter().any(|c| c.event == "msg.offline"));
    let mut want = offline.clone();
    want.sort();
    let off: Vec<&Call> = seen.iter().filter(|c| c.event == "msg.offline").collect();
    assert_eq!(off[0].body["message_id"], json!(id));
    assert_eq!(sorted_uids(&off[0].body["to_uids"]), want);
    assert_eq!(
        off[0].node(),
        1,
        "sent by the channel's home, which committed it"
    );
    for c in seen.iter().filter(|c| c.event == "user.onlinestatus") {
        assert_eq!(c.node(), 3, "sent by ann's authority");
    }
    // msg.notify: from the log of the node that committed it.
    receiver.until(&mut seen, |c| c.iter().any(|c| c.event == "msg.notify"));
    let notify: Vec<&Call> = seen.iter().filter(|c| c.event == "msg.notify").collect();
    assert_eq!(notify[0].body[0]["message_id"], json!(id));
    assert_eq!(notify[0].node(), 1, "sent by the node that committed it");
    // Once: every event emitted is sent or still counted queued; nothing is queued
    // now and the nodes' sent counts add up to what the receiver got.
    let by_event = |e: &str| drained(&cluster, e).iter().sum::<u64>();
    assert_eq!(by_event("msg.offline"), 1);
    assert_eq!(by_event("user.onlinestatus"), 3);
    assert_eq!(by_event("msg.notify"), 1);
    let mut per_event: BTreeMap<&str, usize> = BTreeMap::new();
    for c in &seen {
        let n = c.body.as_array().map_or(1, Vec::len);
        *per_event.entry(c.event.as_str()).or_default() += n;
    }
    assert_eq!(
        per_event,
        BTreeMap::from([
            ("msg.notify", 1),
            ("msg.offline", 1),
            ("user.onlinestatus", 3)
        ])
    );
}

/// The value of the unlabelled series `name` in the node's `/metrics`.
fn gauge(node: &Node, name: &str) -> u64 {
    let text = node.api().handle("GET", "/metrics", None, b"").body;
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("{name} ")))
        .unwrap_or_else(|| panic!("{name} missing"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// Polls `/metrics` until `ok` holds for the unlabelled series (a failure detector).
fn wait_gauge(node: &Node, name: &str, ok: impl Fn(u64) -> bool) -> u64 {
    let deadline = Instant::now() + WAIT;
    loop {
        let v = gauge(node, name);
        if ok(v) {
            return v;
        }
        assert!(Instant::now() < deadline, "{name} = {v}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A node sending `msg.notify` only, in batches of at most 4, its cursor written
/// as soon as it moves.
fn notify_config(dir: &Path, url: &str) -> NodeConfig {
    let mut c = webhook_config(dir, url);
    c.webhook.events = vec!["msg.notify".into()];
    c.webhook.batch_max = 4;
    c.webhook.notify_cursor_interval_ms = 1;
    c
}

/// `(message_id, batch header)` of every message in the `msg.notify` calls, in the
/// order received.
fn notified(calls: &[Call]) -> Vec<(i64, String)> {
    calls
        .iter()
        .filter(|c| c.event == "msg.notify")
        .flat_map(|c| {
            let batch = c.batch.clone();
            c.body
                .as_array()
                .expect("an array of messages")
                .iter()
                .map(move |m| {
                    (
                        m.as_object().unwrap()["message_id"].as_i64().unwrap(),
                        batch.clone(),
                    )
                })
        })
        .collect()
}

/// Whether every id of `ids` was notified.
fn all_notified(ids: &[i64]) -> impl Fn(&[Call]) -> bool + '_ {
    move |calls| {
        let got: BTreeSet<i64> = notified(calls).into_iter().map(|(id, _)| id).collect();
        ids.iter().all(|id| got.contains(id))
    }
}

/// Sends `n` person messages from `client` to bob (offline: committed all the
/// same); their message ids.
fn send_to_bob(client: &mut Client, first: u32, n: u32) -> Vec<i64> {
    (first..first + n)
        .map(|i| {
            let text = format!("m{i}");
            client
                .send("bob", 1, i, &text, text.as_bytes(), true)
                .unwrap();
            let (_, id, _, reason) = next_sendack(client);
            assert_eq!(reason, 1, "SENDACK of {text}");
            id
        })
        .collect()
}

/// Each batch header names one body (its retries send the same bytes), and no
/// message is in two batches of one start.
fn check_batches(calls: &[Call]) {
    let mut bodies: BTreeMap<&str, &[u8]> = BTreeMap::new();
    for c in calls.iter().filter(|c| c.event == "msg.notify") {
        let body = bodies.entry(&c.batch).or_insert(&c.raw);
        assert_eq!(
            *body,
            &c.raw[..],
            "batch {} sent with another body",
            c.batch
        );
        assert!(c.body.as_array().unwrap().len() <= 4, "batch_max");
    }
    let mut batch_of: BTreeMap<(String, i64), &str> = BTreeMap::new();
    for c in calls.iter().filter(|c| c.event == "msg.notify") {
        for m in c.body.as_array().unwrap() {
            let key = (c.boot(), m["message_id"].as_i64().unwrap());
            let first = *batch_of.entry(key).or_insert(&c.batch);
            assert_eq!(first, c.batch, "a message in two batches of one start");
        }
    }
}

#[test]
fn msg_notify_resends_from_the_cursor_what_the_receiver_missed_before_a_restart() {
    let mut receiver = Receiver::start();
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(notify_config(dir.path(), &receiver.url())).unwrap();
    let mut sam = login(&node, "sam", 1);
    let accepted = send_to_bob(&mut sam, 1, 10);
    let mut seen = Vec::new();
    receiver.until(&mut seen, all_notified(&accepted));
    // The cursor written past all ten: a restart does not send them again.
    wait_gauge(&node, "imrouter_webhook_notify_saved", |v| v == 10);
    // The receiver misses the tail: refused, retried, never accepted.
    receiver.down();
    let tail = send_to_bob(&mut sam, 11, 5);
    wait_metric(&node, "imrouter_webhook_failed_total", "msg.notify", |v| {
        v >= 2
    });
    assert_eq!(
        metric(&node, "imrouter_webhook_sent_total", "msg.notify"),
        10
    );
    drop(sam);
    node.shutdown().unwrap();

    receiver.up();
    let node = Node::start(notify_config(dir.path(), &receiver.url())).unwrap();
    receiver.until(&mut seen, all_notified(&tail));
    wait_metric(&node, "imrouter_webhook_sent_total", "msg.notify", |v| {
        v == 5
    });
    wait_gauge(&node, "imrouter_webhook_notify_saved", |v| v == 5);
    check_batches(&seen);
    let got = notified(&seen);
    let first_boot = seen[0].boot();
    for id in &accepted {
        let sends: Vec<&String> = got
            .iter()
            .filter(|(m, _)| m == id)
            .map(|(_, b)| b)
            .collect();
        assert_eq!(
            sends.len(),
            1,
            "accepted before the cursor: sent once ({id}: {sends:?})"
        );
    }
    for id in &tail {
        let sends: Vec<&String> = got
            .iter()
            .filter(|(m, _)| m == id)
            .map(|(_, b)| b)
            .collect();
        assert!(!sends.is_empty(), "the tail is resent ({id})");
        for c in seen.iter().filter(|c| sends.contains(&&c.batch)) {
            assert_ne!(c.boot(), first_boot, "by the restarted node");
        }
    }
    let mut all: Vec<i64> = accepted.iter().chain(&tail).copied().collect();
    all.sort();
    let mut distinct: Vec<i64> = got.iter().map(|(id, _)| *id).collect();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct, all, "nothing else");
    // The messages as WuKongIM shows them, from the log.
    let m = seen
        .iter()
        .flat_map(|c| c.body.as_array().unwrap())
        .find(|m| m["message_id"] == json!(tail[0]))
        .unwrap();
    assert_eq!(
        (&m["from_uid"], &m["channel_id"], &m["channel_type"]),
        (&json!("sam"), &json!("bob"), &json!(1))
    );
    assert_eq!(m["client_msg_no"], json!("m11"));
    assert_eq!(m["message_seq"], json!(11));
    assert_eq!(m["message_idstr"], json!(tail[0].to_string()));
    assert_eq!(m["payload"], json!("bTEx"), "base64 of m11");
    assert_eq!(gauge(&node, "imrouter_webhook_notify_skipped_total"), 0);
    assert_eq!(
        metric(&node, "imrouter_webhook_dropped_total", "msg.notify"),
        0
    );
}

#[test]
fn msg_notify_loses_nothing_while_the_receiver_is_down() {
    let mut receiver = Receiver::start();
    receiver.down();
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(notify_config(dir.path(), &receiver.url())).unwrap();
    let mut sam = login(&node, "sam", 1);
    let ids = send_to_bob(&mut sam, 1, 12);
    wait_metric(&node, "imrouter_webhook_failed_total", "msg.notify", |v| {
        v >= 3
    });
    assert_eq!(
        metric(&node, "imrouter_webhook_sent_total", "msg.notify"),
        0
    );
    receiver.up();
    let mut seen = Vec::new();
    receiver.until(&mut seen, all_notified(&ids));
    check_batches(&seen);
    let mut got: Vec<i64> = notified(&seen).into_iter().map(|(id, _)| id).collect();
    got.sort();
    assert_eq!(got, ids, "each once: nothing lost, none twice");
    wait_metric(&node, "imrouter_webhook_sent_total", "msg.notify", |v| {
        v == 12
    });
    wait_metric(&node, "imrouter_webhook_queued", "msg.notify", |v| v == 0);
    assert_eq!(
        metric(&node, "imrouter_webhook_dropped_total", "msg.notify"),
        0
    );
    wait_gauge(&node, "imrouter_webhook_notify_saved", |v| v == 12);
}

/// A CA and a certificate for 127.0.0.1 it signs, as PEM files in `dir`; the
/// server side's TLS configuration and the CA's file.
fn make_pki(dir: &Path) -> (Arc<rustls::ServerConfig>, PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "imrouter webhook test CA");
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, ca.pem()).unwrap();
    let chain = vec![
        CertificateDer::from_pem_slice(leaf.pem().as_bytes()).unwrap(),
        CertificateDer::from_pem_slice(ca.pem().as_bytes()).unwrap(),
    ];
    let key = PrivateKeyDer::from_pem_slice(key.serialize_pem().as_bytes()).unwrap();
    let mut config =
        rustls::ServerConfig::builder_with_provider(Arc::new(net::io::tls::provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    (Arc::new(config), ca_file)
}

#[test]
fn an_https_receiver_is_trusted_through_ca_file_and_an_untrusted_one_refused() {
    let pki = tempfile::tempdir().unwrap();
    let (tls, ca_file) = make_pki(pki.path());
    let receiver = Receiver::start_tls(tls);
    assert!(receiver.url().starts_with("https://127.0.0.1:"));

    // Trusted: the receiver's CA is [webhook] ca_file.
    let dir = tempfile::tempdir().unwrap();
    let mut c = webhook_config(dir.path(), &receiver.url());
    c.webhook.ca_file = ca_file;
    let node = Node::start(c).unwrap();
    let ann = login(&node, "ann", 1);
    let mut seen = Vec::new();
    receiver.until(&mut seen, |c| statuses(c).len() == 1);
    assert_eq!(statuses(&seen)[0].0, "ann");
    wait_metric(
        &node,
        "imrouter_webhook_sent_total",
        "user.onlinestatus",
        |v| v == 1,
    );
    assert_eq!(
        metric(&node, "imrouter_webhook_failed_total", "user.onlinestatus"),
        0
    );
    drop(ann);
    node.shutdown().unwrap();

    // Untrusted: without ca_file only Mozilla's roots are, and the test CA is not
    // one of them: every attempt is refused in the handshake, counted as failed.
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(webhook_config(dir.path(), &receiver.url())).unwrap();
    let _bob = login(&node, "bob", 1);
    wait_metric(
        &node,
        "imrouter_webhook_failed_total",
        "user.onlinestatus",
        |v| v >= 2,
    );
    assert_eq!(
        metric(&node, "imrouter_webhook_sent_total", "user.onlinestatus"),
        0
    );
    // (The first node's last calls, ann's, may still come in.)
    let leaked: Vec<Call> = receiver.calls.try_iter().collect();
    assert!(
        statuses(&leaked).iter().all(|s| s.0 == "ann"),
        "no request of the second node got through: {leaked:#?}"
    );
}

#[test]
fn a_cursor_file_that_does_not_parse_refuses_the_start_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let c = notify_config(dir.path(), "http://127.0.0.1:9/hook");
    // A first start saves the cursor at the logs' ends.
    Node::start(c.clone()).unwrap().shutdown().unwrap();
    let file = dir.path().join(engine::webhook::notify::CURSOR_FILE);
    assert!(std::fs::read_to_string(&file)
        .unwrap()
        .contains("positions"));
    std::fs::write(&file, b"{\"cursor_version\":1").unwrap();
    let err = Node::start(c).err().expect("refused").to_string();
    assert!(err.contains("webhook_notify_cursor.json"), "{err}");
}

/// `to_uids` (in no particular order), sorted.
fn sorted_uids(v: &Value) -> Vec<String> {
    let mut uids: Vec<String> = (v.as_array().expect("to_uids is an array").iter())
        .map(|u| u.as_str().expect("a uid").to_owned())
        .collect();
    uids.sort();
    uids
}
