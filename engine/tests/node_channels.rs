//! Issue 11.3 through the node: `channels_max` is not a permanent cap, and one
//! connection cannot create channels faster than its named limit.

// Test configs change a few nested fields of the defaults.
#![allow(clippy::field_reassign_with_default)]

use engine::node::Node;
use net::client::{Client, Received};
use net::io::Backend;

#[macro_use]
mod support;
use support::{config, login, metric, set_token};

/// `(client_seq, message_seq, reason)` of the next SENDACK.
fn next_sendack(c: &mut Client) -> (u32, u64, u8) {
    loop {
        match c.read().unwrap() {
            Received::Sendack {
                client_seq,
                message_seq,
                reason,
                ..
            } => return (client_seq, message_seq, reason),
            Received::Pong => continue,
            other => panic!("expected SENDACK, got {other:?}"),
        }
    }
}

/// Every shard indexes at most 2 channels; one sender writes to 12 made-up users,
/// twice: every SEND is acknowledged with success and the second round's seqs
/// continue at 2 (each channel was evicted in between).
fn more_channels_than_max_channels_all_work(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), backend);
    c.log.channels_max = 2;
    c.log.segment_bytes = 2 << 20;
    let node = Node::start(c).unwrap();
    set_token(&node, "alice", 1, 1);
    let mut a = login(&node, "alice");
    let mut client_seq = 0;
    for round in 1..=2u64 {
        for i in 0..12 {
            client_seq += 1;
            a.send(&format!("made-up-{i}"), 1, client_seq, "", b"hello", false)
                .unwrap();
            let (s, seq, reason) = next_sendack(&mut a);
            assert_eq!((s, reason), (client_seq, 1), "SEND to made-up-{i}");
            assert_eq!(seq, round, "seq of made-up-{i} in round {round}");
        }
    }
    node.shutdown().unwrap();
}

/// One connection sends to 60 channels it never sent to, at once: the first
/// `burst` are accepted, the rest beyond what the rate refilled meanwhile get SENDACK
/// 22 (RateLimit), each counted in `sends_rate_limited`; a channel it sent to
/// recently still takes sends.
fn sends_to_new_channels_beyond_the_rate_get_sendack_22(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), backend);
    c.session.new_channels_per_conn_per_s = 1;
    c.session.new_channels_per_conn_burst = 3;
    c.session.recent_channels_per_conn = 4;
    let node = Node::start(c).unwrap();
    set_token(&node, "alice", 1, 1);
    let mut a = login(&node, "alice");
    let started = std::time::Instant::now();
    for i in 0..60u32 {
        a.send(&format!("u-{i}"), 1, i + 1, "", b"hi", false)
            .unwrap();
    }
    // (channels on different commit shards answer in any order)
    let mut acks: Vec<_> = (0..60).map(|_| next_sendack(&mut a)).collect();
    acks.sort_unstable();
    let mut accepted = Vec::new();
    let mut limited = 0;
    for (i, (s, seq, reason)) in (0..60u32).zip(acks) {
        assert_eq!(s, i + 1, "one SENDACK per SEND");
        match reason {
            1 => {
                assert_eq!(seq, 1);
                accepted.push(i);
            }
            22 => {
                assert_eq!(seq, 0);
                limited += 1;
            }
            r => panic!("SENDACK reason {r} for u-{i}"),
        }
    }
    // The rate refills at most one token per second elapsed (plus the one started).
    let refilled = started.elapsed().as_secs() + 1;
    assert_eq!(&accepted[..3], &[0, 1, 2], "the burst");
    assert!(
        accepted.len() as u64 <= 3 + refilled,
        "{} accepted in {refilled} s",
        accepted.len()
    );
    assert_eq!(metric(&node, "imrouter_sends_rate_limited_total"), limited);
    // the last accepted channel is remembered: its sends take no token
    let last = *accepted.last().unwrap();
    for k in 0..5 {
        a.send(&format!("u-{last}"), 1, 100 + k, "", b"again", false)
            .unwrap();
        let (s, seq, reason) = next_sendack(&mut a);
        assert_eq!((s, seq, reason), (100 + k, 2 + u64::from(k), 1));
    }
    node.shutdown().unwrap();
}

on_both_drivers!(
    more_channels_than_max_channels_all_work,
    sends_to_new_channels_beyond_the_rate_get_sendack_22
);

/// A SEND to an unknown channel type (23) or an invalid channel id (16) is refused at
/// the gateway and counted in `imrouter_send_refused_total`.
fn bad_channels_are_refused_and_counted(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path(), backend)).unwrap();
    set_token(&node, "alice", 1, 1);
    let mut a = login(&node, "alice");
    a.send("g", 3, 1, "", b"hello", false).unwrap();
    assert_eq!(next_sendack(&mut a), (1, 0, 23));
    a.send("", 1, 2, "", b"hello", false).unwrap();
    assert_eq!(next_sendack(&mut a), (2, 0, 16));
    assert_eq!(metric(&node, "imrouter_send_refused_total"), 2);
    node.shutdown().unwrap();
}

on_both_drivers!(bad_channels_are_refused_and_counted);
