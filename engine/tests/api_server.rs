//! The HTTP API as a server on the open network: idle and stalled connections,
//! the bearer check before the body, `messagesync` bounded by bytes, and the
//! `/metrics` exposition format.
//!
//! Client read timeouts here are failure detectors (a hung server fails the test
//! instead of hanging it), never synchronization.

// Test configs change a few nested fields of the defaults.
#![allow(clippy::field_reassign_with_default)]

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use base64::Engine as _;
use engine::node::{Node, NodeConfig};
use serde_json::{json, Value};

#[macro_use]
mod support;
use support::config;

/// Only a failing (hung) server makes a read wait this long.
const FAILURE_TIMEOUT: Duration = Duration::from_secs(5);

fn node_with_api(dir: &std::path::Path, edit: impl FnOnce(&mut NodeConfig)) -> Node {
    let mut c = config(dir, net::io::Backend::Mio);
    c.api.addr = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    edit(&mut c);
    Node::start(c).unwrap()
}

/// Sends `request` on a fresh connection and reads the whole answer (the request
/// asks for `Connection: close`). Returns the status code and the body.
fn raw(addr: SocketAddr, request: &[u8]) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(FAILURE_TIMEOUT))?;
    s.write_all(request)?;
    read_response(&mut s)
}

fn read_response(s: &mut TcpStream) -> std::io::Result<(u16, String)> {
    let mut reply = Vec::new();
    s.read_to_end(&mut reply)?;
    let reply = String::from_utf8_lossy(&reply).into_owned();
    let status = reply
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad reply {reply:?}")))?;
    let body = reply
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    Ok((status, body))
}

fn get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    raw(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").as_bytes(),
    )
}

#[test]
fn healthz_answers_with_200_idle_connections_open() {
    let dir = tempfile::tempdir().unwrap();
    let node = node_with_api(dir.path(), |_| {});
    let addr = node.api_addr().unwrap();
    let idle: Vec<TcpStream> = (0..200)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    let (status, _) = get(addr, "/healthz").expect("/healthz on a fresh connection");
    assert_eq!(status, 200);
    drop(idle);
    node.shutdown().unwrap();
}

fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics"))
}

#[test]
fn idle_connections_over_the_cap_make_room_for_new_ones() {
    let dir = tempfile::tempdir().unwrap();
    let node = node_with_api(dir.path(), |c| c.api.connections_max = 16);
    let addr = node.api_addr().unwrap();
    let idle: Vec<TcpStream> = (0..50).map(|_| TcpStream::connect(addr).unwrap()).collect();
    let (status, _) = get(addr, "/healthz").expect("/healthz on a fresh connection");
    assert_eq!(status, 200);
    let (status, text) = get(addr, "/metrics").unwrap();
    assert_eq!(status, 200);
    // 50 idle + /healthz + /metrics through 16 places: the oldest idle made room.
    assert!(metric(&text, "imrouter_api_connections_evicted_total") >= 35);
    assert!(metric(&text, "imrouter_api_connections") <= 16);
    assert_eq!(metric(&text, "imrouter_api_connections_refused_total"), 0);
    drop(idle);
    node.shutdown().unwrap();
}

#[test]
fn busy_connections_at_the_cap_refuse_new_ones_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let node = node_with_api(dir.path(), |c| c.api.connections_max = 2);
    let addr = node.api_addr().unwrap();
    // Two requests whose bodies never finish: both connections are busy.
    let mut busy = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"POST /user/token HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            .unwrap();
        busy.push(s);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let in_progress = || {
        let text = node.api().handle("GET", "/metrics", None, b"").body;
        metric(&text, "imrouter_api_requests_in_progress")
    };
    while in_progress() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the heads were never read"
        );
        std::thread::yield_now();
    }
    // Refused at once: a 503, or the reset that follows it when it overtakes it.
    match get(addr, "/healthz") {
        Ok((status, _)) => assert_eq!(status, 503),
        Err(e) => assert!(
            matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
            ),
            "{e}"
        ),
    }
    let text = node.api().handle("GET", "/metrics", None, b"").body;
    assert!(metric(&text, "imrouter_api_connections_refused_total") >= 1);
    // The busy ones go away: new connections are served again.
    drop(busy);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while get(addr, "/healthz").map(|r| r.0).ok() != Some(200) {
        assert!(std::time::Instant::now() < deadline, "never served again");
    }
    node.shutdown().unwrap();
}

#[test]
fn stalled_heads_idle_keep_alive_and_slow_bodies_are_ended_by_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let node = node_with_api(dir.path(), |c| {
        c.api.header_read_timeout_ms = 200;
        c.api.request_timeout_ms = 400;
    });
    let addr = node.api_addr().unwrap();
    // Half a head: closed by the server (EOF, no answer).
    let mut half = TcpStream::connect(addr).unwrap();
    half.set_read_timeout(Some(FAILURE_TIMEOUT)).unwrap();
    half.write_all(b"GET /healthz HTTP/1.1\r\nHo").unwrap();
    let mut rest = Vec::new();
    half.read_to_end(&mut rest).expect("closed by the server");
    // An idle keep-alive connection after one answer: closed too.
    let mut keep = TcpStream::connect(addr).unwrap();
    keep.set_read_timeout(Some(FAILURE_TIMEOUT)).unwrap();
    keep.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut all = Vec::new();
    keep.read_to_end(&mut all)
        .expect("closed by the server after its idle time");
    assert!(String::from_utf8_lossy(&all).starts_with("HTTP/1.1 200"));
    // A body that never completes: 408.
    let (status, _) = raw(
        addr,
        b"POST /user/token HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",
    )
    .expect("408 for the slow body");
    assert_eq!(status, 408);
    node.shutdown().unwrap();
}

#[test]
fn stalled_clients_do_not_stop_healthz() {
    let dir = tempfile::tempdir().unwrap();
    let node = node_with_api(dir.path(), |_| {});
    let addr = node.api_addr().unwrap();
    // Two clients announce a body and send half of it; two more send half a head.
    let mut stalled = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(
            b"POST /user/token HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{\"uid\":",
        )
        .unwrap();
        stalled.push(s);
    }
    for _ in 0..2 {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: 12").unwrap();
        stalled.push(s);
    }
    for _ in 0..3 {
        let (status, _) = get(addr, "/healthz").expect("/healthz beside stalled clients");
        assert_eq!(status, 200);
    }
    drop(stalled);
    node.shutdown().unwrap();
}

#[test]
fn bearer_token_is_checked_before_the_body() {
    let dir = tempfile::tempdir().unwrap();
    let node = node_with_api(dir.path(), |c| {
        c.api.bearer_token = Some("s3cret".into());
        c.api.body_bytes_max = 1024;
    });
    let addr = node.api_addr().unwrap();
    let big = "x".repeat(4096);
    let request = |token: &str, len: usize, body: &str| {
        format!(
            "POST /user/token HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n\
             Content-Length: {len}\r\nConnection: close\r\n\r\n{body}"
        )
    };
    // Wrong token, body over the limit: the token decides (401, not 413).
    let (status, _) = raw(addr, request("wrong", big.len(), &big).as_bytes()).unwrap();
    assert_eq!(status, 401);
    // Wrong token, a body that never arrives: 401 at once.
    let (status, _) =
        raw(addr, request("wrong", 100, "").as_bytes()).expect("401 without waiting for the body");
    assert_eq!(status, 401);
    // No token at all: 401 too.
    let (status, _) = raw(
        addr,
        b"POST /user/token HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\nConnection: close\r\n\r\n",
    )
    .expect("401 without waiting for the body");
    assert_eq!(status, 401);
    // The right token: the body limit applies (413), and a good body is served.
    let (status, _) = raw(addr, request("s3cret", big.len(), &big).as_bytes()).unwrap();
    assert_eq!(status, 413);
    let ok = json!({"uid": "u1", "token": "t1", "device_flag": 1, "device_level": 1}).to_string();
    let (status, body) = raw(addr, request("s3cret", ok.len(), &ok).as_bytes()).unwrap();
    assert_eq!(status, 200, "{body}");
    node.shutdown().unwrap();
}

/// Pages through the channel with `pull_mode`, returning every seq seen and the
/// number of pages; every page's body stays within `bound` bytes.
/// Issue 26, item 3: slot moves and drains take the operator's admin token, not the
/// applications' bearer token; behind an API token without an admin token they are
/// refused (403) naming the key to set.
#[test]
fn slot_moves_and_drains_take_the_admin_token() {
    let call = |addr: SocketAddr, path: &str, token: &str, body: &str| {
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        raw(addr, request.as_bytes()).unwrap()
    };
    let moves = json!({"hash_slots": [7], "leader_node_id": 1}).to_string();
    let token =
        json!({"uid": "u1", "token": "t1", "device_flag": 1, "device_level": 1}).to_string();

    let dir = tempfile::tempdir().unwrap();
    let node = node_with_api(dir.path(), |c| c.api.bearer_token = Some("s3cret".into()));
    let addr = node.api_addr().unwrap();
    let (status, body) = call(addr, "/cluster/slots/leader", "s3cret", &moves);
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("auth.admin_token"), "{body}");
    let (status, body) = call(addr, "/node/drain", "s3cret", "");
    assert_eq!(status, 403, "{body}");
    node.shutdown().unwrap();

    let dir = tempfile::tempdir().unwrap();
    let node = node_with_api(dir.path(), |c| {
        c.api.bearer_token = Some("s3cret".into());
        c.api.admin_token = Some("adm1n".into());
    });
    let addr = node.api_addr().unwrap();
    let revision = node.shared().view().revision;
    for wrong in ["s3cret", "", "adm1"] {
        let (status, body) = call(addr, "/cluster/slots/leader", wrong, &moves);
        assert_eq!(status, 401, "{wrong:?}: {body}");
        let (status, body) = call(addr, "/node/drain", wrong, "");
        assert_eq!(status, 401, "{wrong:?}: {body}");
    }
    assert_eq!(node.shared().view().revision, revision, "nothing moved");
    let (status, body) = call(addr, "/cluster/slots/leader", "adm1n", &moves);
    assert_eq!(status, 200, "{body}");
    assert!(node.shared().view().revision > revision);
    // A node alone has nothing to drain to: 409, past the token.
    let (status, body) = call(addr, "/node/drain", "adm1n", "");
    assert_eq!(status, 409, "{body}");
    // The admin token opens only the operator's routes.
    let (status, _) = call(addr, "/user/token", "adm1n", &token);
    assert_eq!(status, 401);
    let (status, body) = call(addr, "/user/token", "s3cret", &token);
    assert_eq!(status, 200, "{body}");
    node.shutdown().unwrap();
}

fn page_all(node: &Node, pull_mode: u8, bound: usize) -> (Vec<u64>, usize) {
    let api = node.api();
    let (mut start, mut seqs, mut pages) = (0u64, Vec::new(), 0);
    if pull_mode == 1 {
        start = 1;
    }
    loop {
        let body = json!({"login_uid": "u2", "channel_id": "u1", "channel_type": 1,
                          "start_message_seq": start, "end_message_seq": 0, "limit": 0,
                          "pull_mode": pull_mode});
        let r = api.handle(
            "POST",
            "/channel/messagesync",
            None,
            body.to_string().as_bytes(),
        );
        assert_eq!(r.status, 200, "{}", &r.body[..r.body.len().min(200)]);
        assert!(
            r.body.len() <= bound,
            "a page of {} bytes over the {bound}-byte bound",
            r.body.len()
        );
        pages += 1;
        let v: Value = serde_json::from_str(&r.body).unwrap();
        let page: Vec<u64> = v["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["message_seq"].as_u64().unwrap())
            .collect();
        assert!(!page.is_empty(), "an empty page with more set");
        seqs.extend(&page);
        if v["more"] == 0 {
            return (seqs, pages);
        }
        start = if pull_mode == 1 {
            page.iter().max().unwrap() + 1
        } else {
            page.iter().min().unwrap() - 1
        };
        assert!(pages < 100, "paging does not end");
    }
}

#[test]
fn messagesync_is_bounded_by_bytes_and_pages() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path(), net::io::Backend::Mio)).unwrap();
    let bound = NodeConfig::default().api.sync_response_bytes_max;
    // 20 messages of 512 KiB: ~13.7 MB of JSON, more than the default 8 MiB bound.
    let count = 20u64;
    let payload = base64::engine::general_purpose::STANDARD.encode(vec![b'm'; 512 << 10]);
    for i in 0..count {
        let body = json!({"from_uid": "u1", "channel_id": "u2", "channel_type": 1,
                          "client_msg_no": format!("big-{i}"), "payload": payload});
        let r = node
            .api()
            .handle("POST", "/message/send", None, body.to_string().as_bytes());
        assert_eq!(r.status, 200, "{}", r.body);
    }
    for pull_mode in [1u8, 0] {
        let (mut seqs, pages) = page_all(&node, pull_mode, bound);
        assert!(pages > 1, "pull_mode {pull_mode}: one page held everything");
        seqs.sort_unstable();
        assert_eq!(
            seqs,
            (1..=count).collect::<Vec<_>>(),
            "pull_mode {pull_mode}"
        );
    }
    node.shutdown().unwrap();
}

/// A small checker of the Prometheus text exposition format (0.0.4): every sample
/// belongs to a family announced by `# HELP` and `# TYPE` before it, counters end in
/// `_total`, histograms have `_bucket` (with `le`), `_sum` and `_count`, values are
/// numbers, families are not split.
fn check_exposition(text: &str) -> HashMap<String, String> {
    let mut help: HashSet<String> = HashSet::new();
    let mut types: HashMap<String, String> = HashMap::new();
    let mut finished: HashSet<String> = HashSet::new();
    let mut current: Option<String> = None;
    let valid_name =
        |n: &str| !n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    for (i, line) in text.lines().enumerate() {
        let at = format!("line {}: {line:?}", i + 1);
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, doc) = rest.split_once(' ').expect(&at);
            assert!(valid_name(name) && !doc.trim().is_empty(), "{at}");
            assert!(help.insert(name.to_string()), "second HELP, {at}");
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, ty) = rest.split_once(' ').expect(&at);
            assert!(help.contains(name), "TYPE before HELP, {at}");
            assert!(
                ["counter", "gauge", "histogram"].contains(&ty),
                "unknown type, {at}"
            );
            if ty == "counter" {
                assert!(
                    name.ends_with("_total"),
                    "a counter not ending in _total, {at}"
                );
            } else {
                assert!(!name.ends_with("_total"), "a {ty} ending in _total, {at}");
            }
            assert!(
                types.insert(name.to_string(), ty.to_string()).is_none(),
                "second TYPE, {at}"
            );
            if let Some(prev) = current.replace(name.to_string()) {
                finished.insert(prev);
            }
            continue;
        }
        assert!(!line.starts_with('#'), "unknown comment, {at}");
        assert!(!line.trim().is_empty(), "empty line, {at}");
        let (series, value) = line.rsplit_once(' ').expect(&at);
        assert!(
            value.parse::<f64>().is_ok() || ["+Inf", "-Inf", "NaN"].contains(&value),
            "bad value, {at}"
        );
        let (name, labels) = match series.split_once('{') {
            Some((n, l)) => (n, Some(l.strip_suffix('}').expect(&at))),
            None => (series, None),
        };
        assert!(valid_name(name), "{at}");
        if let Some(labels) = labels {
            for pair in labels.split(',') {
                let (k, v) = pair.split_once('=').expect(&at);
                assert!(valid_name(k), "bad label name, {at}");
                assert!(
                    v.len() >= 2 && v.starts_with('"') && v.ends_with('"'),
                    "{at}"
                );
            }
        }
        let family = current.clone().expect("a sample before any TYPE");
        let ty = &types[&family];
        let ok = match ty.as_str() {
            "histogram" => {
                (name == format!("{family}_bucket") && labels.is_some_and(|l| l.contains("le=\"")))
                    || name == format!("{family}_sum")
                    || name == format!("{family}_count")
            }
            _ => name == family,
        };
        assert!(ok, "sample outside its family {family} ({ty}), {at}");
        assert!(!finished.contains(name), "family split, {at}");
    }
    assert!(!types.is_empty(), "no metric at all");
    types
}

#[test]
fn metrics_text_is_prometheus_exposition() {
    let dir = tempfile::tempdir().unwrap();
    let node = node_with_api(dir.path(), |_| {});
    let addr = node.api_addr().unwrap();
    // Some traffic first, so that API counters have moved.
    assert_eq!(get(addr, "/healthz").unwrap().0, 200);
    assert_eq!(get(addr, "/nope").unwrap().0, 404);
    let (status, text) = get(addr, "/metrics").unwrap();
    assert_eq!(status, 200);
    let types = check_exposition(&text);
    assert_eq!(types["imrouter_connections"], "gauge");
    assert_eq!(types["imrouter_recvs_total"], "counter");
    assert_eq!(types["imrouter_recv_latency_seconds"], "histogram");
    assert_eq!(types["imrouter_api_requests_total"], "counter");
    assert!(
        text.contains("imrouter_api_requests_total{class=\"2xx\"}"),
        "{text}"
    );
    assert!(text.contains("imrouter_api_requests_total{class=\"4xx\"}"));
    for name in [
        "imrouter_api_accept_errors_total",
        "imrouter_api_connections_refused_total",
        "imrouter_api_panics_total",
        "imrouter_api_pool_refusals_total",
    ] {
        assert_eq!(types[name], "counter", "{name}");
    }
    // The in-process text is the same format.
    check_exposition(&node.api().handle("GET", "/metrics", None, b"").body);
    node.shutdown().unwrap();
}

#[test]
fn a_client_that_never_reads_its_answer_is_closed() {
    let dir = tempfile::tempdir().unwrap();
    let node = node_with_api(dir.path(), |c| {
        c.api.answer_write_timeout_ms = 300;
        c.api.sync_response_bytes_max = 64 << 20;
    });
    let addr = node.api_addr().unwrap();
    // ~19 MB of JSON: more than the loopback socket buffers hold.
    let payload = base64::engine::general_purpose::STANDARD.encode(vec![b'r'; 700 << 10]);
    for i in 0..20 {
        let body = json!({"from_uid": "u1", "channel_id": "u2", "channel_type": 1,
                          "client_msg_no": format!("r-{i}"), "payload": payload});
        let r = node
            .api()
            .handle("POST", "/message/send", None, body.to_string().as_bytes());
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let sync = json!({"login_uid": "u2", "channel_id": "u1", "channel_type": 1,
                      "start_message_seq": 1, "limit": 0, "pull_mode": 1})
    .to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST /channel/messagesync HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{sync}",
        sync.len()
    )
    .unwrap();
    // Never read. The server gives up on the answer and closes the connection.
    let api = node.api();
    let gauge = |name: &str| metric(&api.handle("GET", "/metrics", None, b"").body, name);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while gauge("imrouter_api_requests_total{class=\"2xx\"}") == 0 {
        assert!(std::time::Instant::now() < deadline, "no answer started");
        std::thread::yield_now();
    }
    while gauge("imrouter_api_connections") > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the connection of a client that never reads stays open"
        );
        std::thread::yield_now();
    }
    assert_eq!(gauge("imrouter_api_requests_in_progress"), 0);
    assert!(gauge("imrouter_api_write_timeouts_total") >= 1);
    drop(s);
    node.shutdown().unwrap();
}
