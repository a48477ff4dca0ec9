//! Ring backpressure end to end (issue "Group SEND under load", item 1, and the
//! review's "full rings drop pushes"): with tiny rings and peer queues, a burst of
//! group SENDs from many connections is answered in full, every message answered with
//! success reaches every online recipient, and no inter-shard message is dropped.

// Test configs change a few nested fields of the defaults.
#![allow(clippy::field_reassign_with_default)]

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use engine::node::Node;
use net::client::{Client, Received};
use net::io::Backend;
use serde_json::json;

#[macro_use]
mod support;
use support::{api, config, login, set_token};

/// Bounds every blocking read: only a failing test ever waits this long.
const READ_TIMEOUT: Duration = Duration::from_secs(20);
const MEMBERS: usize = 24;
const SENDS_PER_MEMBER: u32 = 60;

/// The group member `i` sends its SEND `client_seq` to.
fn group_of(i: usize, client_seq: u32) -> &'static str {
    ["ga", "gb", "gc", "gd"][(i + client_seq as usize) % 4]
}

fn burst_through_tiny_rings(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), backend);
    cfg.runtime.ring_capacity = 4;
    cfg.runtime.outbox_batch_max = 2;
    cfg.runtime.peer_queue_max = 48;
    cfg.commit.commit_credits_per_peer = 8;
    cfg.delivery.control_room_per_peer = 8;
    cfg.delivery.subscriber_page_max = 8;
    cfg.delivery.push_batch_max = 2;
    cfg.session.sends_in_flight_per_conn_max = 16;
    let node = Node::start(cfg).unwrap();
    let uids: Vec<String> = (0..MEMBERS).map(|i| format!("m{i}")).collect();
    for u in &uids {
        set_token(&node, u, 1, 1);
    }
    // Two groups, so commits land on both shards' delivery cores.
    for g in ["ga", "gb", "gc", "gd"] {
        let (status, _) = api(
            &node,
            "/channel/subscriber_add",
            json!({"channel_id": g, "channel_type": 2, "subscribers": uids}),
        );
        assert_eq!(status, 200);
    }
    let mut clients: Vec<Client> = uids.iter().map(|u| login(&node, u)).collect();

    // The burst: every member sends all its SENDs without waiting.
    for (i, c) in clients.iter_mut().enumerate() {
        for s in 1..=SENDS_PER_MEMBER {
            c.send(group_of(i, s), 2, s, &format!("m{i}-{s}"), b"burst", false)
                .unwrap();
        }
    }

    // Every SEND is answered: success (1) or RateLimit (22), nothing else, none missing.
    // (group, message_seq) -> sender
    let mut ok: HashMap<(String, u64), usize> = HashMap::new();
    let mut got: Vec<HashSet<(String, u64)>> = vec![HashSet::new(); MEMBERS];
    let mut refused = 0usize;
    for (i, c) in clients.iter_mut().enumerate() {
        let mut answered = HashSet::new();
        while answered.len() < SENDS_PER_MEMBER as usize {
            match c.read().unwrap_or_else(|e| {
                panic!(
                    "member {i}: {} of {SENDS_PER_MEMBER} SENDs answered, then: {e}",
                    answered.len()
                )
            }) {
                Received::Sendack {
                    client_seq,
                    message_seq,
                    reason,
                    ..
                } => {
                    assert!(answered.insert(client_seq), "one SENDACK per SEND");
                    let key = (group_of(i, client_seq).to_string(), message_seq);
                    match reason {
                        1 => assert!(ok.insert(key, i).is_none(), "one seq per message"),
                        22 => refused += 1,
                        r => panic!("member {i} SEND {client_seq}: reason {r}"),
                    }
                }
                Received::Recv(m) => {
                    c.recvack(m.message_id, m.message_seq).unwrap();
                    got[i].insert((m.channel_id, m.message_seq));
                }
                Received::Pong => {}
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    assert!(!ok.is_empty(), "some SENDs succeeded");

    // Every message answered with success reaches every member but its sender.
    for (i, c) in clients.iter_mut().enumerate() {
        let want = ok.iter().filter(|(_, &from)| from != i).count();
        while got[i].len() < want {
            match c.read().unwrap_or_else(|e| {
                panic!(
                    "member {i}: {} of {want} RECVs, then: {e} ({} SENDs refused)",
                    got[i].len(),
                    refused
                )
            }) {
                Received::Recv(m) => {
                    c.recvack(m.message_id, m.message_seq).unwrap();
                    let key = (m.channel_id, m.message_seq);
                    assert!(ok.contains_key(&key), "RECV of an answered message {key:?}");
                    got[i].insert(key);
                }
                Received::Pong => {}
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    let drops: u64 = node
        .shared()
        .shard_metrics
        .iter()
        .map(|m| m.ring_full_drops.get())
        .sum();
    assert_eq!(drops, 0, "no message between shards was dropped");
    let stalls: u64 = node
        .shared()
        .shard_metrics
        .iter()
        .map(|m| m.delivery_stalls.get())
        .sum();
    eprintln!("delivery stalls: {stalls}");
    eprintln!(
        "{} SENDs succeeded, {refused} refused with 22 ({backend:?})",
        ok.len()
    );
}

on_both_drivers!(burst_through_tiny_rings);

/// A shard that dies is fatal: the node reports it (not ready, the cause) instead of
/// serving half a node.
fn a_dead_shard_is_reported(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path(), backend)).unwrap();
    assert_eq!(node.shared().not_ready(), None);
    assert_eq!(node.wait_failure(Duration::ZERO), None);
    node.inject_shard_panic(1);
    let cause = node
        .wait_failure(READ_TIMEOUT)
        .expect("the shard's end is reported");
    assert!(
        cause.contains("shard 1") && cause.contains("injected fault"),
        "{cause}"
    );
    let why = node.shared().not_ready().expect("/readyz is false");
    assert!(why.contains("shard 1"), "{why}");
    let status = node.api().handle("GET", "/readyz", None, b"").status;
    assert_eq!(status, 503);
    assert!(node.shutdown().is_err(), "the stop reports the dead shard");
}

on_both_drivers!(a_dead_shard_is_reported);

/// Unacknowledged RECVs are bounded by bytes per shard: a recipient that never acks
/// still gets every RECV, but past the budget they are sent untracked (counted), and
/// the shard's charge never passes the budget.
fn pending_acks_stay_within_their_byte_budget(backend: Backend) {
    const BUDGET: usize = 8 << 10;
    const MESSAGES: u32 = 40;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), backend);
    cfg.session.pending_acks_budget_bytes_per_shard = BUDGET;
    let node = Node::start(cfg).unwrap();
    for u in ["s", "r"] {
        set_token(&node, u, 1, 1);
    }
    let (mut s, mut r) = (login(&node, "s"), login(&node, "r"));
    let payload = vec![b'x'; 1000];
    for i in 1..=MESSAGES {
        s.send("r", 1, i, &format!("p{i}"), &payload, false)
            .unwrap();
    }
    let mut got = 0;
    while got < MESSAGES {
        match r.read().unwrap() {
            Received::Recv(m) => {
                assert_eq!(m.payload, payload);
                got += 1;
            }
            Received::Pong => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    // The owner shard has finished the turn that wrote them.
    r.ping().unwrap();
    while r.read().unwrap() != Received::Pong {}
    let metrics = &node.shared().shard_metrics;
    let charged: u64 = metrics.iter().map(|m| m.pending_ack_bytes.get()).sum();
    let untracked: u64 = metrics.iter().map(|m| m.acks_dropped.get()).sum();
    assert!(charged > 0 && charged <= BUDGET as u64, "charged {charged}");
    assert!(untracked > 0, "RECVs past the budget went untracked");
    // Closing the connection gives the charge back.
    drop(r);
    let deadline = std::time::Instant::now() + READ_TIMEOUT;
    while metrics
        .iter()
        .map(|m| m.pending_ack_bytes.get())
        .sum::<u64>()
        > 0
    {
        assert!(
            std::time::Instant::now() < deadline,
            "charge returned on close"
        );
        std::thread::yield_now();
    }
}

on_both_drivers!(pending_acks_stay_within_their_byte_budget);

/// Messages committed and not yet delivered are bounded by bytes: a commit that
/// would pass `backlog_budget_bytes` is answered with SENDACK 22 and counted.
fn commits_past_the_backlog_byte_budget_get_22(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), backend);
    cfg.commit.backlog_budget_bytes = 4 << 10;
    let node = Node::start(cfg).unwrap();
    for u in ["s", "r"] {
        set_token(&node, u, 1, 1);
    }
    let mut s = login(&node, "s");
    // Small: within the budget. Larger than the whole budget: refused, every time.
    s.send("r", 1, 1, "small", b"hi", false).unwrap();
    s.send("r", 1, 2, "big", &vec![b'x'; 8 << 10], false)
        .unwrap();
    let mut reasons = std::collections::BTreeMap::new();
    while reasons.len() < 2 {
        if let Received::Sendack {
            client_seq, reason, ..
        } = s.read().unwrap()
        {
            reasons.insert(client_seq, reason);
        }
    }
    assert_eq!(reasons[&1], 1);
    assert_eq!(reasons[&2], 22, "past backlog_budget_bytes: RateLimit");
    let refused: u64 = node
        .shared()
        .shard_metrics
        .iter()
        .map(|m| m.commits_refused_backlog.get())
        .sum();
    assert_eq!(refused, 1);
}

on_both_drivers!(commits_past_the_backlog_byte_budget_get_22);
