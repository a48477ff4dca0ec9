//! Issue 18 item 4 through the node: a per-uid SEND rate limit. One uid sending a
//! burst from two devices past `sends_per_uid_per_s` gets SENDACK 22 for the excess,
//! each counted in `imrouter_sends_refused_uid_rate_total`; another uid is not
//! affected, and the HTTP API's sends are not limited. (The bucket's arithmetic,
//! eviction and the full table are tested with a hand-driven clock in
//! `domain::send::send_rate`.)

// Test configs change a few nested fields of the defaults.
#![allow(clippy::field_reassign_with_default)]

use std::collections::HashSet;
use std::time::{Duration, Instant};

use engine::node::Node;
use net::client::{Client, Login, Received};
use net::io::Backend;
use serde_json::json;

#[macro_use]
mod support;
use support::{api, config, login, metric, set_token};

const PER_S: u32 = 1;
const BURST: u32 = 5;
/// SENDs per device of the limited uid.
const SENDS: u32 = 20;

fn login_flag(node: &Node, uid: &str, device_flag: u8) -> Client {
    let mut l = Login::new(uid, &format!("tok-{uid}"));
    l.device_flag = device_flag;
    l.device_id = format!("{uid}-{device_flag}");
    let (c, reason) =
        Client::connect(node.tcp_addr().unwrap(), &l, Duration::from_secs(10)).unwrap();
    assert_eq!(reason, 1, "CONNACK for {uid} flag {device_flag}");
    c
}

/// The reasons of the SENDACKs of client_seqs `1..=n`, in client_seq order.
fn sendacks(c: &mut Client, n: u32) -> Vec<u8> {
    let mut reasons = vec![0u8; n as usize];
    let mut seen = HashSet::new();
    while seen.len() < n as usize {
        match c.read().unwrap() {
            Received::Sendack {
                client_seq, reason, ..
            } => {
                assert!(seen.insert(client_seq), "one SENDACK per SEND");
                reasons[client_seq as usize - 1] = reason;
            }
            Received::Pong | Received::Recv(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    reasons
}

/// alice sends 2 × 20 SENDs back to back from two devices with a limit of 1/s, burst
/// 5: each gateway shard admits at most 5 + 1 per second elapsed, so with her
/// devices on at most 2 shards at least 40 − 2 × (5 + elapsed) are refused with 22
/// (however slow the machine), every refusal is counted, and nothing else refuses.
/// bob's 5 SENDs right after all succeed, and so do 20 API sends from alice.
fn one_uid_past_its_rate_gets_sendack_22(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), backend);
    cfg.session.sends_per_uid_per_s = PER_S;
    cfg.session.sends_per_uid_burst = BURST;
    let node = Node::start(cfg).unwrap();
    for flag in [1, 2] {
        set_token(&node, "alice", flag, 1);
    }
    set_token(&node, "bob", 1, 1);
    let mut devices = [login_flag(&node, "alice", 1), login_flag(&node, "alice", 2)];
    let mut bob = login(&node, "bob");

    let started = Instant::now();
    for s in 1..=SENDS {
        for d in &mut devices {
            d.send("bob", 1, s, "", b"burst", false).unwrap();
        }
    }
    let mut ok = 0u64;
    let mut refused = 0u64;
    for d in &mut devices {
        for (i, reason) in sendacks(d, SENDS).into_iter().enumerate() {
            match reason {
                1 => ok += 1,
                22 => refused += 1,
                r => panic!("SEND {}: reason {r}", i + 1),
            }
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let bound = f64::from(2 * SENDS) - 2.0 * (f64::from(BURST) + f64::from(PER_S) * elapsed);
    eprintln!("{ok} admitted, {refused} refused in {elapsed:.3} s ({backend:?})");
    assert!(
        ok >= u64::from(BURST),
        "a full bucket admits its burst: {ok}"
    );
    assert!(
        refused as f64 >= bound,
        "{refused} refused, at least {bound:.1} expected ({ok} admitted in {elapsed:.3} s)"
    );
    assert_eq!(
        metric(&node, "imrouter_sends_refused_uid_rate_total"),
        refused
    );
    assert_eq!(metric(&node, "imrouter_sends_refused_credit_total"), 0);
    assert_eq!(metric(&node, "imrouter_sends_rate_limited_total"), 0);

    // Another uid is not affected.
    for s in 1..=BURST {
        bob.send("alice", 1, s, "", b"hi", false).unwrap();
    }
    assert_eq!(sendacks(&mut bob, BURST), vec![1; BURST as usize]);
    // The HTTP API's sends are not limited.
    for _ in 0..SENDS {
        let (status, body) = api(
            &node,
            "/message/send",
            json!({"from_uid": "alice", "channel_id": "bob", "channel_type": 1, "payload": "aGk="}),
        );
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(
        metric(&node, "imrouter_sends_refused_uid_rate_total"),
        refused
    );
    node.shutdown().unwrap();
}

on_both_drivers!(one_uid_past_its_rate_gets_sendack_22);

/// `sends_per_uid_burst` and `send_rate_uids_per_shard_max` must be at least 1 (a
/// rate of 0 is the way to turn the limit off); 0 is refused at start, named.
#[test]
fn a_zero_burst_or_uid_table_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), Backend::Mio);
    c.session.sends_per_uid_burst = 0;
    let err = Node::start(c).err().expect("refused at start");
    assert!(
        err.to_string().contains("session.sends_per_uid_burst"),
        "{err}"
    );
    let mut c = config(dir.path(), Backend::Mio);
    c.session.send_rate_uids_per_shard_max = 0;
    let err = Node::start(c).err().expect("refused at start");
    assert!(
        err.to_string()
            .contains("session.send_rate_uids_per_shard_max"),
        "{err}"
    );
}
