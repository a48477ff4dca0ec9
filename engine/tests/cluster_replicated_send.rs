//! SENDs through the replicated groups (`[cluster] replicas = 3`, three nodes, two
//! shards each): once every slot id's home leads its group (a leader elsewhere
//! hands over to it), a SEND is proposed to its slot id's group and answered only
//! after the entry is committed on a majority, with the seq the replicas' logs
//! gave it; the messages then reach the recipient, and a resend (same
//! client_msg_no) is answered with the first copy's ids and not delivered again. After the nodes stop, each
//! node's log is read back: a majority holds every acknowledged message with its
//! id and seq, and no node holds another message at those seqs. With both other
//! replicas of a channel's group stopped, a SEND is refused (15, once the leader
//! steps down), never acknowledged.
//! Waits are bounded polls (no sleeps).

use std::time::{Duration, Instant};

use base64::Engine as _;
use net::io::Backend;
use serde_json::{json, Value};
use support::cluster::{login_any, Cluster, SLOT_IDS};

#[macro_use]
mod support;

const WAIT: Duration = Duration::from_secs(20);

fn start() -> Cluster {
    Cluster::start_with(Backend::Mio, |cfg| {
        cfg.cluster.replicas = 3;
        cfg.runtime.shard_count = 2;
    })
}

/// Waits (bounded) until every node sees every slot id's home (`nodes[s % 3]`,
/// ids 1..=3) lead its group.
fn homes_lead(c: &Cluster) {
    let deadline = Instant::now() + WAIT;
    'wait: loop {
        assert!(Instant::now() < deadline, "the homes did not all lead");
        std::thread::yield_now();
        for node in &c.nodes {
            for s in 0..SLOT_IDS {
                let home = u64::from(s % 3) + 1;
                if node.shared().raft_status.of(s).map(|(l, _)| l) != Some(home) {
                    continue 'wait;
                }
            }
        }
        return;
    }
}

fn send(node: &engine::node::Node, to: &str, text: &str) -> (u16, Value) {
    send_numbered(node, to, text, "")
}

fn send_numbered(
    node: &engine::node::Node,
    to: &str,
    text: &str,
    client_msg_no: &str,
) -> (u16, Value) {
    let payload = base64::engine::general_purpose::STANDARD.encode(text.as_bytes());
    support::api(
        node,
        "/message/send",
        json!({"from_uid": "sys", "channel_id": to, "channel_type": 1, "payload": payload,
               "client_msg_no": client_msg_no}),
    )
}

/// `(seq, message id)` of every message of `channel` in the log of `shard` of
/// the data dir `dir`.
fn logged(
    dir: &std::path::Path,
    shard: usize,
    log: &engine::store::LogConfig,
    channel: &str,
) -> Vec<(u64, i64)> {
    let (log, _) =
        engine::store::MessageLog::open(&engine::store::log_dir(dir, shard), log.clone())
            .expect("the log opens");
    let mut found = Vec::new();
    log.scan(|m| {
        if m.channel_id == channel {
            found.push((m.message_seq, m.message_id));
        }
    })
    .unwrap();
    found
}

#[test]
fn a_send_is_answered_after_its_commit_on_a_majority_with_the_replicas_seq() {
    let mut c = start();
    homes_lead(&c);
    let to = "replicated-rcpt";
    let key = engine::channel::person_channel_key("sys", to);
    let slot = slots::hash_slot(key.as_bytes());
    let slot_id = domain::cluster::slot_id_of(slot, SLOT_IDS);
    let mut client = login_any(c.node(2), to);
    let mut sent = Vec::new();
    for (i, n) in [1, 2, 3].into_iter().enumerate() {
        let (status, reply) = send(c.node(n), to, &format!("m{i}"));
        assert_eq!(status, 200, "{reply}");
        assert_eq!(reply["message_seq"], i + 1, "{reply}");
        sent.push((i as u64 + 1, reply["message_id"].as_i64().unwrap()));
        let m = support::next_recv(&mut client);
        assert_eq!(m.message_id, sent[i].1);
    }
    // A resend (same client_msg_no) gets the first copy's ids and no RECV.
    let (status, first) = send_numbered(c.node(1), to, "once", "n-1");
    assert_eq!(status, 200, "{first}");
    let (status, again) = send_numbered(c.node(3), to, "once", "n-1");
    assert_eq!(status, 200, "{again}");
    assert_eq!(
        (&again["message_id"], &again["message_seq"]),
        (&first["message_id"], &first["message_seq"])
    );
    assert_eq!(first["message_seq"], 4, "{first}");
    sent.push((4, first["message_id"].as_i64().unwrap()));
    assert_eq!(support::next_recv(&mut client).message_id, sent[3].1);
    support::cluster::nothing_more(&mut client);
    let shard = slot_id as usize % 2;
    let dirs: Vec<(std::path::PathBuf, engine::store::LogConfig)> = (c.nodes.iter())
        .map(|n| {
            (
                n.shared().config.data_dir.clone(),
                n.shared().config.log.clone(),
            )
        })
        .collect();
    drop(client);
    for node in c.nodes.drain(..) {
        node.shutdown().unwrap();
    }
    let mut holding = 0;
    for (dir, log) in &dirs {
        let found = logged(dir, shard, log, &key);
        assert!(
            sent.starts_with(&found),
            "{}: {found:?} against {sent:?}",
            dir.display()
        );
        holding += usize::from(found == sent);
    }
    assert!(
        holding >= 2,
        "{holding} of 3 logs hold every acknowledged message"
    );
}

#[test]
fn with_the_other_replicas_stopped_a_send_is_refused_never_acknowledged() {
    let mut c = start();
    homes_lead(&c);
    let to = "replicated-alone";
    let key = engine::channel::person_channel_key("sys", to);
    let home = c.view.home_node(slots::hash_slot(key.as_bytes()));
    let (status, reply) = send(c.node(home), to, "before");
    assert_eq!(status, 200, "{reply}");
    let others: Vec<u64> = [1, 2, 3].into_iter().filter(|&n| n != home).collect();
    for &n in others.iter().rev() {
        let node = c.nodes.remove(n as usize - 1);
        node.shutdown().unwrap();
    }
    let (status, reply) = send(&c.nodes[0], to, "alone");
    assert_ne!(status, 200, "acknowledged without a majority: {reply}");
    assert_eq!(reply["reason"], 15, "{reply}");
    // Counted (the shard publishes its counts just after the answer left).
    let deadline = Instant::now() + WAIT;
    while support::metric(&c.nodes[0], "imrouter_commits_proposals_failed_total") != 1 {
        assert!(Instant::now() < deadline, "the refusal was not counted");
        std::thread::yield_now();
    }
}
