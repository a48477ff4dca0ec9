//! The node's storage through real sockets and restarts: message ids unique across
//! shards, the data dir's recorded layout, the idempotency window after a restart,
//! file modes, and what a disk error does.

// Test configs change a few nested fields of the defaults.
#![allow(clippy::field_reassign_with_default)]

use std::collections::HashSet;
use std::time::Duration;

use engine::node::{id_generator, Node};
use engine::store::idgen::ID_EPOCH_MS;
use net::client::{Client, Login, Received};
use net::io::Backend;
use serde_json::json;

#[macro_use]
mod support;
use support::{api, config, set_token};

/// Bounds every blocking read: only a failing test ever waits this long.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

fn login(node: &Node, uid: &str) -> Client {
    let (client, reason) = Client::connect(
        node.tcp_addr().unwrap(),
        &Login::new(uid, &format!("tok-{uid}")),
        READ_TIMEOUT,
    )
    .unwrap();
    assert_eq!(reason, 1, "CONNACK for {uid}");
    client
}

fn next_sendack(c: &mut Client) -> (u32, i64, u64, u8) {
    loop {
        match c.read().unwrap() {
            Received::Sendack {
                client_seq,
                message_id,
                message_seq,
                reason,
            } => return (client_seq, message_id, message_seq, reason),
            Received::Pong | Received::Recv(_) => continue,
            other => panic!("expected SENDACK, got {other:?}"),
        }
    }
}

/// Recipients `r<i>` whose person channel with `from` lives on shard `shard` of
/// `shards`.
fn peers_on_shard(from: &str, shard: u16, shards: u16, n: usize) -> Vec<String> {
    let map = shard::slots::SlotMap::modulo(shards).unwrap();
    (0..)
        .map(|i| format!("r{i}"))
        .filter(|r| {
            let key = engine::channel::person_channel_key(from, r);
            map.shard_of_key(key.as_bytes()) == shard
        })
        .take(n)
        .collect()
}

#[test]
fn generators_of_two_shards_never_share_an_id_in_the_same_millisecond() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(dir.path(), Backend::Mio);
    let mut a = id_generator(&c, 0).unwrap();
    let mut b = id_generator(&c, 1).unwrap();
    let mut seen = HashSet::new();
    let now = ID_EPOCH_MS + 86_400_000;
    for _ in 0..10_000 {
        assert!(seen.insert(a.next_id(now).unwrap()), "shard 0 id repeated");
        assert!(seen.insert(b.next_id(now).unwrap()), "shard 1 id repeated");
    }
}

/// Many SENDs, pipelined, to channels on both shards: every message_id is distinct.
fn message_ids_are_distinct_across_shards(backend: Backend) {
    const PER_SHARD: usize = 8;
    const ROUNDS: u32 = 100;
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path(), backend)).unwrap();
    set_token(&node, "u1", 1, 1);
    let mut peers = peers_on_shard("u1", 0, 2, PER_SHARD);
    peers.extend(peers_on_shard("u1", 1, 2, PER_SHARD));
    let mut a = login(&node, "u1");
    let mut client_seq = 0u32;
    for _ in 0..ROUNDS {
        for p in &peers {
            client_seq += 1;
            a.send(p, 1, client_seq, "", b"x", true).unwrap();
        }
    }
    let mut ids = HashSet::new();
    for _ in 0..client_seq {
        let (seq, id, _, reason) = next_sendack(&mut a);
        assert_eq!(reason, 1, "SENDACK of client_seq {seq}");
        assert!(id > 0);
        assert!(ids.insert(id), "message_id {id} given twice");
    }
    node.shutdown().unwrap();
}

on_both_drivers!(message_ids_are_distinct_across_shards);
