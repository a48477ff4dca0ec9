//! A simulated power cut, in process, for both fsync policies. Unlike `kill -9`
//! (`node_crash.rs`, `store_crash.rs`), which keeps the kernel's page cache and so
//! passes even when nothing is ever synced, this keeps only what the node's syncs
//! covered: a sync hook records, per segment file, the length each successful sync
//! made durable; the "power cut" copies the running node's log files into a fresh
//! dir with everything past that length replaced, as a real cut may leave it, by a
//! random part of the unsynced bytes (pages the kernel happened to write back, torn
//! records included) followed by zeros. Recovery then runs on the copy.
//!
//! - `fsync = "always"`: every SENDACKed message survives.
//! - the interval policy: everything the last sync covered survives (the test waits
//!   until a sync covered the first batch; a node that never syncs fails there).
//! - both: recovery is clean, every channel reads as its seqs 1..k, each message the
//!   one that was sent with that seq (no torn or stale record served).
//!
//! Seeds are fixed (printed on failure); `POWER_CUT_SEED=n` picks another.

// Test configs change a few nested fields of the defaults.
#![allow(clippy::field_reassign_with_default)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engine::channel::person_channel_key;
use engine::node::syncer::{NodeHooks, SyncHook};
use engine::node::{Node, NodeConfig};
use engine::store::{log_dir, FsyncPolicy, MessageLog, PullMode};
use net::client::{Client, Login, Received};
use net::io::Backend;
use rand::{Rng, SeedableRng};

#[macro_use]
mod support;
use support::{config, set_token};

const TIMEOUT: Duration = Duration::from_secs(20);
const PEERS: [&str; 4] = ["p1", "p2", "p3", "p4"];
const BATCH: u32 = 400;

/// The disk as the test sees it: what each segment's syncs made durable.
#[derive(Default)]
struct Recorder {
    synced: Mutex<HashMap<PathBuf, u32>>,
}

impl SyncHook for Recorder {
    fn sync(&self, file: &std::fs::File, path: &Path, len: u32) -> std::io::Result<()> {
        file.sync_data()?;
        let mut m = self.synced.lock().unwrap();
        let e = m.entry(path.to_path_buf()).or_insert(0);
        *e = (*e).max(len);
        Ok(())
    }
}

/// After the node stopped: whether its messages span more than one segment (the
/// batches rolled, so seals were part of the test).
fn rolled(c: &NodeConfig, data: &Path) -> bool {
    let map = slots::SlotMap::modulo(c.runtime.shard_count).unwrap();
    let logs: Vec<MessageLog> = (0..c.runtime.shard_count as usize)
        .map(|i| {
            MessageLog::open(&log_dir(data, i), c.log.clone())
                .unwrap()
                .0
        })
        .collect();
    PEERS.iter().any(|peer| {
        let key = person_channel_key("u1", peer);
        let log = &logs[map.shard_of_key(key.as_bytes()) as usize];
        let read = log.read(1, &key, 0, 0, 0, PullMode::Up).unwrap();
        read.messages.iter().any(|m| m.position >> 32 > 0)
    })
}

/// Copies the node's logs into `to` as a power cut at this instant would leave them.
fn power_cut(data: &Path, shards: usize, rec: &Recorder, to: &Path, rng: &mut impl Rng) {
    let synced = rec.synced.lock().unwrap().clone();
    for shard in 0..shards {
        let from = log_dir(data, shard);
        let dest = log_dir(to, shard);
        std::fs::create_dir_all(&dest).unwrap();
        for entry in std::fs::read_dir(&from).unwrap() {
            let entry = entry.unwrap();
            let name = entry.file_name().into_string().unwrap();
            let Ok(mut bytes) = std::fs::read(entry.path()) else {
                continue; // retired meanwhile
            };
            if name.ends_with(".seg") {
                let durable = synced.get(&entry.path()).copied().unwrap_or(0) as usize;
                let durable = durable.min(bytes.len());
                // Some unsynced bytes may have reached the disk anyway.
                let kept = durable + rng.gen_range(0..=(bytes.len() - durable).min(4096));
                bytes[kept..].fill(0);
            } else if name != "channel_seqs.snap" {
                continue; // LOCK, temporaries
            }
            std::fs::write(dest.join(&name), &bytes).unwrap();
        }
    }
}

/// Recovers the copy: per peer, the payloads of seqs 1..k (panics on a gap or a
/// message that is not the one sent with its seq).
fn recover(
    c: &NodeConfig,
    to: &Path,
    sent: &HashMap<(usize, u64), Vec<u8>>,
    seed: u64,
) -> Vec<u64> {
    let map = slots::SlotMap::modulo(c.runtime.shard_count).unwrap();
    let mut logs: Vec<MessageLog> = (0..c.runtime.shard_count as usize)
        .map(|i| MessageLog::open(&log_dir(to, i), c.log.clone()).unwrap().0)
        .collect();
    let mut counts = Vec::new();
    for (p, peer) in PEERS.iter().enumerate() {
        let key = person_channel_key("u1", peer);
        let log = &mut logs[map.shard_of_key(key.as_bytes()) as usize];
        let read = log.read(1, &key, 0, 0, 0, PullMode::Up).unwrap();
        for (i, m) in read.messages.iter().enumerate() {
            assert_eq!(m.message_seq, i as u64 + 1, "seed {seed}: gap in {peer}");
            let want = sent.get(&(p, m.message_seq));
            assert_eq!(
                Some(&m.payload.to_vec()),
                want,
                "seed {seed}: {peer} seq {} is not what was sent",
                m.message_seq
            );
        }
        counts.push(read.messages.len() as u64);
    }
    counts
}

fn payload(peer: usize, n: u32) -> Vec<u8> {
    let mut p = format!("{peer}/{n}/").into_bytes();
    p.extend((0..(500 + n * 37 % 1500)).map(|i| (i + n) as u8));
    p
}

/// Sends `BATCH` messages round-robin to the peers; returns (peer, seq) → payload
/// of every SENDACKed one.
fn send_batch(a: &mut Client, first: u32, acked: &mut HashMap<(usize, u64), Vec<u8>>) {
    let mut by_client_seq = HashMap::new();
    for n in first..first + BATCH {
        let p = n as usize % PEERS.len();
        a.send(PEERS[p], 1, n, "", &payload(p, n), false).unwrap();
        by_client_seq.insert(n, p);
    }
    let mut got = 0;
    while got < BATCH {
        if let Received::Sendack {
            client_seq,
            message_seq,
            reason,
            ..
        } = a.read().unwrap()
        {
            assert_eq!(reason, 1);
            let p = by_client_seq[&client_seq];
            acked.insert((p, message_seq), payload(p, client_seq));
            got += 1;
        }
    }
}

fn start(dir: &Path, fsync: FsyncPolicy) -> (NodeConfig, Arc<Recorder>, Node, Client) {
    let mut c = config(dir, Backend::Mio);
    c.log.fsync = fsync;
    // Small segments: the batches roll several, so seals count too.
    c.log.payload_bytes_max = 4096;
    c.log.segment_bytes = 256 << 10;
    let rec = Arc::new(Recorder::default());
    let hooks = NodeHooks {
        log_sync: Some(rec.clone()),
    };
    let node = Node::start_with(c.clone(), hooks).unwrap();
    set_token(&node, "u1", 1, 1);
    let (a, reason) = Client::connect(
        node.tcp_addr().unwrap(),
        &Login::new("u1", "tok-u1"),
        TIMEOUT,
    )
    .unwrap();
    assert_eq!(reason, 1);
    (c, rec, node, a)
}

fn seed(default: u64) -> u64 {
    std::env::var("POWER_CUT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

#[test]
fn always_every_sendacked_message_survives_a_power_cut() {
    let seed = seed(11);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let (c, rec, node, mut a) = start(&dir.path().join("data"), FsyncPolicy::Always);
    let mut acked = HashMap::new();
    send_batch(&mut a, 1, &mut acked);
    send_batch(&mut a, 1 + BATCH, &mut acked);
    let cut = dir.path().join("cut");
    power_cut(
        &dir.path().join("data"),
        c.runtime.shard_count as usize,
        &rec,
        &cut,
        &mut rng,
    );
    let counts = recover(&c, &cut, &acked, seed);
    for (p, peer) in PEERS.iter().enumerate() {
        let acked_here = acked.keys().filter(|k| k.0 == p).count() as u64;
        assert_eq!(
            counts[p], acked_here,
            "seed {seed}: {peer} lost SENDACKed messages"
        );
    }
    drop(a);
    node.shutdown().unwrap();
    assert!(rolled(&c, &dir.path().join("data")), "the batches roll");
}

#[test]
fn interval_everything_the_last_sync_covered_survives_a_power_cut() {
    let seed = seed(12);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (c, rec, node, mut a) = start(&data, FsyncPolicy::IntervalMs(20));
    let shards = c.runtime.shard_count as usize;
    let mut first = HashMap::new();
    send_batch(&mut a, 1, &mut first);
    // Wait (bounded) until a sync covered the whole first batch: each try is a
    // power cut of the running node and a recovery.
    let deadline = Instant::now() + TIMEOUT;
    let mut tries = 0;
    loop {
        tries += 1;
        let cut = dir.path().join(format!("try-{tries}"));
        power_cut(&data, shards, &rec, &cut, &mut rng);
        let counts = recover(&c, &cut, &first, seed);
        let covered = PEERS
            .iter()
            .enumerate()
            .all(|(p, _)| counts[p] >= first.keys().filter(|k| k.0 == p).count() as u64);
        if covered {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "seed {seed}: no sync covered the acknowledged batch (recovered {counts:?})"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // More messages, acknowledged before their sync; the power goes at once.
    let mut all = first.clone();
    send_batch(&mut a, 1 + BATCH, &mut all);
    let cut = dir.path().join("cut");
    power_cut(&data, shards, &rec, &cut, &mut rng);
    let counts = recover(&c, &cut, &all, seed);
    for (p, peer) in PEERS.iter().enumerate() {
        let synced = first.keys().filter(|k| k.0 == p).count() as u64;
        assert!(
            counts[p] >= synced,
            "seed {seed}: {peer} lost synced messages"
        );
    }
    drop(a);
    node.shutdown().unwrap();
    assert!(rolled(&c, &dir.path().join("data")), "the batches roll");
}
