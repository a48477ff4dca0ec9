//! A real crash: a child process (this test binary, running the ignored `crash_child`
//! test) appends records and prints each acknowledged one; the parent `kill -9`s it
//! after reading a number of acks (no sleep involved), reopens the log and checks that
//! every acknowledged record is there and intact.
//!
//! Two modes: `sync` acknowledges after `sync` (the SENDACK rule under
//! `FsyncPolicy::Always`); `nosync` acknowledges right after `append`, checking the
//! claim that a process crash loses nothing that was appended (the page cache
//! outlives the process).
//!
//! SIGKILL keeps the kernel's page cache, so this passes even if nothing is ever
//! synced: `store_power_cut.rs` is the test that needs the syncs (it keeps only what
//! they covered).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use engine::store::{FsyncPolicy, LogConfig, MessageLog, NewMessage, PullMode};

const DIR_ENV: &str = "STORE_CRASH_DIR";
const MODE_ENV: &str = "STORE_CRASH_MODE";
const CHANNELS: [&str; 3] = ["alpha", "beta", "gamma"];
const BATCH: usize = 8;
const MAX_CHILD_RECORDS: u64 = 1_000_000;
const ACKS_BEFORE_KILL: usize = 12_000;

fn config() -> LogConfig {
    LogConfig {
        segment_bytes: 1 << 20,
        segments_max: 10_000,
        channels_max: 16,
        indexed_messages_max: 10_000_000,
        payload_bytes_max: 4096,
        read_messages_max: 100_000,
        fsync: FsyncPolicy::Always,
        ..LogConfig::default()
    }
}

fn payload(channel: &str, seq: u64) -> Vec<u8> {
    let mut p = format!("{channel}/{seq}/").into_bytes();
    let fill = (seq * 31 % 300) as usize;
    p.extend((0..fill).map(|i| (seq as usize + i) as u8));
    p
}

/// The child: appends until killed (or `MAX_CHILD_RECORDS`), acknowledging on stdout.
#[test]
#[ignore = "run by crash_* tests as a child process"]
fn crash_child() {
    let dir = std::env::var(DIR_ENV).expect("run by the crash tests");
    let sync = std::env::var(MODE_ENV).expect("mode") == "sync";
    let (mut log, _) = MessageLog::open(std::path::Path::new(&dir), config()).unwrap();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut n = 0u64;
    let mut batch = Vec::with_capacity(BATCH);
    let mut pending = String::new();
    while n < MAX_CHILD_RECORDS {
        batch.clear();
        for _ in 0..BATCH {
            let c = CHANNELS[(n % 3) as usize];
            let seq = log.last_seq(2, c) + 1;
            let p = payload(c, seq);
            let m = NewMessage {
                message_id: n as i64,
                channel_type: 2,
                channel_id: c,
                from_uid: "crash",
                client_msg_no: "",
                setting: 0,
                msg_flags: 0,
                timestamp_s: 0,
                payload: &p,
            };
            let a = log.append(&m).unwrap();
            assert_eq!(a.message_seq, seq);
            batch.push((c, seq));
            n += 1;
        }
        if sync {
            log.sync(0).unwrap();
        }
        // Acknowledge the previous batch only now, with this one appended (and synced):
        // at the kill the log always holds appended records that were never
        // acknowledged. One write per batch (< PIPE_BUF: never half a batch).
        out.write_all(pending.as_bytes()).unwrap();
        out.flush().unwrap();
        pending.clear();
        for (c, seq) in &batch {
            pending.push_str(&format!("ACK {c} {seq}\n"));
        }
    }
}

fn crash_and_check(mode: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "crash_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(DIR_ENV, tmp.path())
        .env(MODE_ENV, mode)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut reader = BufReader::new(child.stdout.take().unwrap());
    let mut acked: HashMap<String, u64> = HashMap::new();
    let mut acks = 0usize;
    let mut line = Vec::new();
    let mut killed = false;
    loop {
        line.clear();
        if reader.read_until(b'\n', &mut line).unwrap() == 0 {
            break;
        }
        if !line.ends_with(b"\n") {
            break; // a partial last line is not an acknowledgement
        }
        let text = String::from_utf8_lossy(&line);
        // libtest may print "test crash_child ... " before the first line
        let Some(at) = text.find("ACK ") else {
            continue;
        };
        let mut it = text[at + 4..].split_whitespace();
        let c = it.next().unwrap().to_owned();
        let seq: u64 = it.next().unwrap().parse().unwrap();
        let prev = acked.insert(c, seq).unwrap_or(0);
        assert_eq!(seq, prev + 1, "acks come in seq order");
        acks += 1;
        if acks == ACKS_BEFORE_KILL && !killed {
            child.kill().unwrap(); // SIGKILL; lines already in the pipe are still read
            killed = true;
        }
    }
    let status = child.wait().unwrap();
    assert!(killed, "child ended before the kill: {status:?}");
    assert!(!status.success());
    assert!(acks >= ACKS_BEFORE_KILL);

    let (log, report) = MessageLog::open(tmp.path(), config()).unwrap();
    println!("mode {mode}: {acks} acks; recovery {report:?}");
    assert!(
        report.records >= acks as u64 + BATCH as u64,
        "unacknowledged appends exist"
    );
    assert!(report.segments > 1, "the child rolled segments");
    for c in CHANNELS {
        let last_acked = acked[c];
        assert!(
            log.last_seq(2, c) >= last_acked,
            "{c}: acknowledged records lost"
        );
        let r = log.read(2, c, 1, last_acked + 1, 0, PullMode::Up).unwrap();
        assert_eq!(r.messages.len() as u64, last_acked);
        for (i, m) in r.messages.iter().enumerate() {
            let seq = i as u64 + 1;
            assert_eq!(m.message_seq, seq);
            assert_eq!(m.from_uid, "crash");
            assert_eq!(m.payload, &payload(c, seq)[..], "{c} #{seq} intact");
        }
    }
}

#[test]
fn crash_kill9_keeps_every_synced_ack() {
    crash_and_check("sync");
}

#[test]
fn crash_kill9_keeps_every_append_even_unsynced() {
    crash_and_check("nosync");
}
