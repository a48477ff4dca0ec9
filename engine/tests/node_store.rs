//! The node's storage through real sockets and restarts: message ids unique across
//! shards, the data dir's recorded layout, the idempotency window after a restart,
//! file modes, and what a disk error does.

// Test configs change a few nested fields of the defaults.
#![allow(clippy::field_reassign_with_default)]

use std::collections::HashSet;
use std::time::Duration;

use domain::send::idgen::ID_EPOCH_MS;
use engine::node::{id_generator, Node};
use net::client::{Client, Received};
use net::io::Backend;
use serde_json::json;

#[macro_use]
mod support;
use support::{api, config, login, set_token};

/// Bounds every blocking read: only a failing test ever waits this long.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

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
    let map = slots::SlotMap::modulo(shards).unwrap();
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

fn messagesync(node: &Node, login_uid: &str, channel_id: &str) -> Vec<serde_json::Value> {
    let (status, body) = api(
        node,
        "/channel/messagesync",
        json!({"login_uid": login_uid, "channel_id": channel_id, "channel_type": 1,
               "start_message_seq": 0, "end_message_seq": 0, "limit": 1000, "pull_mode": 1}),
    );
    assert_eq!(status, 200, "{body}");
    body["messages"].as_array().unwrap().clone()
}

/// SEND with a client_msg_no, restart on the same data dir, resend it: the first
/// answer comes back and the log holds one copy.
fn idempotent_resend_after_a_restart_gets_the_first_answer(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let c = config(dir.path(), backend);
    let node = Node::start(c.clone()).unwrap();
    set_token(&node, "u1", 1, 1);
    let mut a = login(&node, "u1");
    a.send("u2", 1, 1, "once-1", b"first", true).unwrap();
    let (_, first_id, first_seq, reason) = next_sendack(&mut a);
    assert_eq!((first_seq, reason), (1, 1));
    drop(a);
    node.shutdown().unwrap();

    let node = Node::start(c).unwrap();
    let mut a = login(&node, "u1");
    a.send("u2", 1, 7, "once-1", b"first", true).unwrap();
    let (client_seq, id, seq, reason) = next_sendack(&mut a);
    assert_eq!(
        (client_seq, id, seq, reason),
        (7, first_id, first_seq, 1),
        "the resend after the restart gets the first answer"
    );
    // A new message continues the channel: next seq, a larger id.
    a.send("u2", 1, 8, "once-2", b"second", true).unwrap();
    let (_, id2, seq2, reason) = next_sendack(&mut a);
    assert_eq!((seq2, reason), (2, 1));
    assert!(id2 > first_id);
    let messages = messagesync(&node, "u2", "u1");
    let seqs: Vec<u64> = messages
        .iter()
        .map(|m| m["message_seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, vec![1, 2], "one copy of the resent message");
    node.shutdown().unwrap();
}

on_both_drivers!(idempotent_resend_after_a_restart_gets_the_first_answer);

fn start_err(c: &engine::node::NodeConfig) -> String {
    match Node::start(c.clone()) {
        Ok(_) => panic!("the node started with {} shards", c.runtime.shard_count),
        Err(e) => e.to_string(),
    }
}

/// The data dir records its shard count: a start with another count is refused with
/// what to do; the same count serves every message and continues the seqs.
fn a_changed_shard_count_is_refused_and_the_same_one_keeps_history(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), backend);
    let mut peers = peers_on_shard("u1", 0, 2, 2);
    peers.extend(peers_on_shard("u1", 1, 2, 2));
    {
        let node = Node::start(c.clone()).unwrap();
        set_token(&node, "u1", 1, 1);
        let mut a = login(&node, "u1");
        for (i, p) in peers.iter().enumerate() {
            for k in 0..3u32 {
                a.send(p, 1, i as u32 * 10 + k, "", b"x", true).unwrap();
                assert_eq!(next_sendack(&mut a).3, 1);
            }
        }
        drop(a);
        node.shutdown().unwrap();
    }
    let expected = format!(
        "data dir {} was written with 2 shards; start with --shards 2 (or [runtime] shard_count = 2)",
        dir.path().display()
    );
    for shards in [1u16, 3] {
        c.runtime.shard_count = shards;
        let err = start_err(&c);
        assert!(err.contains(&expected), "{shards} shards: {err}");
    }
    c.runtime.shard_count = 2;
    let node = Node::start(c.clone()).unwrap();
    let mut a = login(&node, "u1");
    for (i, p) in peers.iter().enumerate() {
        let seqs: Vec<u64> = messagesync(&node, p, "u1")
            .iter()
            .map(|m| m["message_seq"].as_u64().unwrap())
            .collect();
        assert_eq!(seqs, vec![1, 2, 3], "history of {p}");
        a.send(p, 1, 100 + i as u32, "", b"y", true).unwrap();
        let (_, _, seq, reason) = next_sendack(&mut a);
        assert_eq!((seq, reason), (4, 1), "the seqs of {p} continue");
    }
    drop(a);
    node.shutdown().unwrap();

    // A layout version newer than this binary knows is refused too.
    let path = dir.path().join("layout.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("layout_version = 3"), "{text}");
    std::fs::write(
        &path,
        text.replace("layout_version = 3", "layout_version = 99"),
    )
    .unwrap();
    let err = start_err(&c);
    assert!(err.contains("layout version 99"), "{err}");
}

/// A data dir written before layout.toml existed: its shard-N directories tell.
#[test]
fn a_data_dir_without_layout_file_is_checked_by_its_shard_directories() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), Backend::Mio);
    Node::start(c.clone()).unwrap().shutdown().unwrap();
    std::fs::remove_file(dir.path().join("layout.toml")).unwrap();
    c.runtime.shard_count = 1;
    let err = start_err(&c);
    assert!(err.contains("was written with 2 shards"), "{err}");
    c.runtime.shard_count = 2;
    Node::start(c).unwrap().shutdown().unwrap();
    assert!(dir.path().join("layout.toml").exists(), "recorded now");
}

on_both_drivers!(a_changed_shard_count_is_refused_and_the_same_one_keeps_history);

/// The data dir and its subdirectories are 0700, every file in them 0600.
#[test]
fn data_files_are_private() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let c = config(&data, Backend::Mio);
    let node = Node::start(c).unwrap();
    set_token(&node, "u1", 1, 1);
    let mut a = login(&node, "u1");
    a.send("u2", 1, 1, "", b"x", true).unwrap();
    assert_eq!(next_sendack(&mut a).3, 1);
    drop(a);
    node.shutdown().unwrap();
    let mut stack = vec![data];
    let (mut dirs, mut files) = (0, 0);
    while let Some(d) = stack.pop() {
        let mode = std::fs::metadata(&d).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "{}", d.display());
        dirs += 1;
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                let mode = e.metadata().unwrap().permissions().mode() & 0o777;
                assert_eq!(mode, 0o600, "{}", e.path().display());
                files += 1;
            }
        }
    }
    // data, meta, shard-0, shard-0/log, shard-1, shard-1/log
    assert!(dirs >= 6 && files >= 4, "{dirs} dirs, {files} files");
}

/// A sync hook that fails every sync once armed (a disk returning EIO).
#[derive(Default)]
struct FailingDisk {
    armed: std::sync::atomic::AtomicBool,
}

impl engine::node::syncer::SyncHook for FailingDisk {
    fn sync(&self, file: &std::fs::File, _: &std::path::Path, _: u32) -> std::io::Result<()> {
        if self.armed.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        file.sync_data()
    }
}

fn get(node: &Node, path: &str) -> (u16, String) {
    let r = node.api().handle("GET", path, None, b"");
    (r.status, r.body)
}

/// A disk I/O error: sends are refused (SENDACK 15), `/readyz` says why, and
/// `/metrics` shows it; nothing acknowledged before is lost.
fn a_disk_error_stops_sends_and_shows_in_readyz_and_metrics(policy: engine::store::FsyncPolicy) {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), Backend::Mio);
    c.log.fsync = policy;
    let disk = std::sync::Arc::new(FailingDisk::default());
    let hooks = engine::node::syncer::NodeHooks {
        log_sync: Some(disk.clone()),
    };
    let node = Node::start_with(c.clone(), hooks).unwrap();
    set_token(&node, "u1", 1, 1);
    let mut a = login(&node, "u1");
    a.send("u2", 1, 1, "", b"before", true).unwrap();
    assert_eq!(next_sendack(&mut a).3, 1);
    assert_eq!(get(&node, "/readyz").0, 200);
    assert!(get(&node, "/metrics")
        .1
        .contains("\nimrouter_log_write_failed 0\n"));

    disk.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    // The failing sync: under "always" it refuses its batch; under the interval
    // policy it comes with the next timer. Either way, sends are refused once it
    // failed (bounded: the deadline only ends a failing test).
    let deadline = std::time::Instant::now() + READ_TIMEOUT;
    let mut client_seq = 1;
    loop {
        client_seq += 1;
        a.send("u2", 1, client_seq, "", b"after", true).unwrap();
        let (_, _, _, reason) = next_sendack(&mut a);
        if reason == 15 {
            break;
        }
        assert_eq!(reason, 1);
        assert!(
            std::time::Instant::now() < deadline,
            "sends still accepted on a failing disk"
        );
    }
    a.send("u2", 1, client_seq + 1, "", b"refused", true)
        .unwrap();
    assert_eq!(next_sendack(&mut a).3, 15, "the log stays failed");
    let (status, body) = get(&node, "/readyz");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("disk I/O error"), "{body}");
    let metrics = get(&node, "/metrics").1;
    assert!(
        metrics.contains("\nimrouter_log_write_failed 1\n"),
        "{metrics}"
    );
    drop(a);
    // The stop's final sync fails too; what was acknowledged before is on disk.
    let _ = node.shutdown();
    disk.armed.store(false, std::sync::atomic::Ordering::SeqCst);
    let node = Node::start(c).unwrap();
    let payloads: Vec<String> = messagesync(&node, "u2", "u1")
        .iter()
        .map(|m| m["payload"].as_str().unwrap().to_owned())
        .collect();
    assert!(!payloads.is_empty());
    node.shutdown().unwrap();
}

#[test]
fn a_disk_error_under_always_fsync() {
    a_disk_error_stops_sends_and_shows_in_readyz_and_metrics(engine::store::FsyncPolicy::Always);
}

#[test]
fn a_disk_error_under_the_interval_policy() {
    a_disk_error_stops_sends_and_shows_in_readyz_and_metrics(
        engine::store::FsyncPolicy::IntervalMs(20),
    );
}

/// Rolling under load, with retention: small segments fill many times over while
/// SENDs are pipelined to channels on both shards; every SEND is acknowledged, each
/// channel reads back contiguous up to its last seq, the disk holds at most
/// `segments_max` + 2 segments per shard (one retired awaiting its job, one spare),
/// and after a restart the seqs continue.
fn rolling_under_load_keeps_the_seqs_and_the_segment_budget(backend: Backend) {
    const PER_PEER: u32 = 300;
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), backend);
    c.log.fsync = engine::store::FsyncPolicy::Always;
    c.log.payload_bytes_max = 4096;
    c.log.segment_bytes = 256 << 10;
    c.log.segments_max = 3;
    let mut peers = peers_on_shard("u1", 0, 2, 2);
    peers.extend(peers_on_shard("u1", 1, 2, 2));
    let node = Node::start(c.clone()).unwrap();
    set_token(&node, "u1", 1, 1);
    let mut a = login(&node, "u1");
    let payload = vec![b'x'; 1500];
    let mut client_seq = 0;
    for _ in 0..PER_PEER {
        for p in &peers {
            client_seq += 1;
            a.send(p, 1, client_seq, "", &payload, true).unwrap();
        }
    }
    for _ in 0..client_seq {
        assert_eq!(next_sendack(&mut a).3, 1);
    }
    for p in &peers {
        let seqs: Vec<u64> = messagesync(&node, p, "u1")
            .iter()
            .map(|m| m["message_seq"].as_u64().unwrap())
            .collect();
        assert_eq!(seqs.last().copied(), Some(u64::from(PER_PEER)), "{p}");
        assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{p}: {seqs:?}");
        assert!(seqs[0] > 1, "{p}: retention deleted the oldest");
    }
    for shard in 0..2 {
        let segs = std::fs::read_dir(engine::store::log_dir(dir.path(), shard))
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_str()
                    .unwrap()
                    .ends_with(".seg")
            })
            .count();
        assert!(segs <= 5, "shard {shard}: {segs} segment files");
    }
    // Whether each roll found its segment made ahead depends on the syncer thread's
    // timing (a roll may come before the job that makes it): store_segments tests the
    // make-ahead itself, deterministically.
    drop(a);
    node.shutdown().unwrap();
    let node = Node::start(c).unwrap();
    let mut a = login(&node, "u1");
    for p in &peers {
        client_seq += 1;
        a.send(p, 1, client_seq, "", b"after", true).unwrap();
        let (_, _, seq, reason) = next_sendack(&mut a);
        assert_eq!((seq, reason), (u64::from(PER_PEER) + 1, 1), "{p}");
    }
    drop(a);
    node.shutdown().unwrap();
}

on_both_drivers!(rolling_under_load_keeps_the_seqs_and_the_segment_budget);

/// Ids continue after the newest one in the log, even when the wall clock is behind
/// it at the restart (here: the log holds an id from an hour ahead).
#[test]
fn ids_continue_after_the_logs_newest_id_when_the_clock_is_behind() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(dir.path(), Backend::Mio);
    Node::start(c.clone()).unwrap().shutdown().unwrap();
    let key = engine::channel::person_channel_key("u1", "u2");
    let map = slots::SlotMap::modulo(2).unwrap();
    let shard = map.shard_of_key(key.as_bytes()) as usize;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let mut ahead = engine::store::MessageIdGen::new(c.node_id, shard, 2).unwrap();
    let future_id = ahead.next_id(now_ms + 3_600_000).unwrap();
    {
        let (mut log, _) = engine::store::MessageLog::open(
            &engine::store::log_dir(dir.path(), shard),
            c.log.clone(),
        )
        .unwrap();
        log.append(&engine::store::NewMessage {
            message_id: future_id,
            channel_type: 1,
            channel_id: &key,
            from_uid: "u1",
            client_msg_no: "",
            setting: 0,
            msg_flags: 0,
            timestamp_s: (now_ms / 1000) as u32,
            payload: b"from the future",
        })
        .unwrap();
        log.sync(now_ms).unwrap();
    }
    let node = Node::start(c).unwrap();
    set_token(&node, "u1", 1, 1);
    let mut a = login(&node, "u1");
    a.send("u2", 1, 1, "", b"now", true).unwrap();
    let (_, id, seq, reason) = next_sendack(&mut a);
    assert_eq!((seq, reason), (2, 1));
    assert!(id > future_id, "{id} after {future_id}");
    drop(a);
    node.shutdown().unwrap();
}
