//! Segment files are created and retired by the sync jobs (on the syncer thread in
//! a node), so that a roll on the shard thread only switches to a file that is
//! already there: the next segment is created and preallocated ahead by a job, the
//! retired ones are deleted by the job after the roll.

use std::path::{Path, PathBuf};

use engine::store::{FsyncPolicy, LogConfig, MessageLog, NewMessage, PullMode};

fn config() -> LogConfig {
    LogConfig {
        segment_bytes: 256 << 10,
        segments_max: 3,
        channels_max: 100,
        indexed_messages_max: 1_000_000,
        payload_bytes_max: 4096,
        read_messages_max: 100_000,
        fsync: FsyncPolicy::Always,
        ..LogConfig::default()
    }
}

fn segment_file(dir: &Path, id: u32) -> PathBuf {
    dir.join(format!("{id:020}.seg"))
}

fn append(log: &mut MessageLog, n: u64) -> u64 {
    let seq = log.last_seq(2, "c") + 1;
    let payload = vec![(n % 251) as u8; 1000];
    let a = log
        .append(&NewMessage {
            message_id: n as i64,
            channel_type: 2,
            channel_id: "c",
            from_uid: "u",
            client_msg_no: "",
            setting: 0,
            msg_flags: 0,
            timestamp_s: 1_700_000_000,
            payload: &payload,
        })
        .unwrap();
    assert_eq!(a.message_seq, seq);
    seq
}

/// Runs the log's next sync job on another thread, as the node's syncer does.
fn sync_elsewhere(log: &mut MessageLog, now_ms: u64) {
    if let Some(job) = log.begin_sync().unwrap() {
        let result = std::thread::spawn(move || job.run()).join().unwrap();
        log.end_sync(result, now_ms).unwrap();
    }
}

#[test]
fn the_next_segment_is_created_ahead_and_retired_ones_deleted_by_the_sync_jobs() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut log, _) = MessageLog::open(tmp.path(), config()).unwrap();
    append(&mut log, 1);
    sync_elsewhere(&mut log, 1);
    let next = segment_file(tmp.path(), 1);
    assert_eq!(
        std::fs::metadata(&next).map(|m| m.len()).ok(),
        Some(256 << 10),
        "the sync job created and preallocated the next segment"
    );
    // Under load: ~1 KiB records, a sync job every 16 appends; many rolls.
    let mut n = 1;
    while log.segment_ids().last().copied().unwrap() < 12 {
        for _ in 0..16 {
            n += 1;
            append(&mut log, n);
        }
        sync_elsewhere(&mut log, n);
    }
    let stats = log.stats();
    assert_eq!(
        stats.segments_created_inline, 0,
        "every roll switched to a segment a job created: {stats:?}"
    );
    let ids = log.segment_ids();
    assert_eq!(ids.len(), 3, "{ids:?}");
    // The job after the last roll deleted every retired segment.
    for id in 0..ids[0] {
        assert!(
            !segment_file(tmp.path(), id).exists(),
            "segment {id} retired"
        );
    }
    // Retained messages read back contiguous up to the last seq.
    let read = log.read(2, "c", 0, 0, 0, PullMode::Up).unwrap();
    let seqs: Vec<u64> = read.messages.iter().map(|m| m.message_seq).collect();
    assert_eq!(seqs.last().copied(), Some(n));
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1));
    drop(log);
    // Reopen: the spare (empty) segment is harmless; seqs continue.
    let (mut log, report) = MessageLog::open(tmp.path(), config()).unwrap();
    assert_eq!(report.truncated_bytes, 0);
    assert_eq!(log.last_seq(2, "c"), n);
    assert_eq!(append(&mut log, n + 1), n + 1);
}

#[test]
fn without_sync_jobs_a_roll_creates_the_segment_itself() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut log, _) = MessageLog::open(tmp.path(), config()).unwrap();
    for n in 1..=1000 {
        append(&mut log, n);
    }
    let stats = log.stats();
    assert!(stats.segments_created_inline >= 3, "{stats:?}");
    log.sync(0).unwrap();
    let ids = log.segment_ids();
    for id in 0..ids[0] {
        assert!(
            !segment_file(tmp.path(), id).exists(),
            "a full sync deletes the retired segments"
        );
    }
}

fn append_to(log: &mut MessageLog, channel: &str, n: u64) -> u64 {
    log.append(&NewMessage {
        message_id: n as i64,
        channel_type: 2,
        channel_id: channel,
        from_uid: "u",
        client_msg_no: "",
        setting: 0,
        msg_flags: 0,
        timestamp_s: 1_700_000_000,
        payload: &[7u8; 1000],
    })
    .unwrap()
    .message_seq
}

/// A full sync on the caller's thread (a graceful stop) waits for the file work a
/// job still holds: that work writes the seq snapshot of an earlier retirement, and
/// written after the stop's newer one it would drop a channel retired in between,
/// whose seqs would then start over after a restart.
#[test]
fn a_full_sync_waits_for_the_file_work_of_a_job_in_flight() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = LogConfig {
        segments_max: 10,
        channels_max: 3,
        ..config()
    };
    let (mut log, _) = MessageLog::open(tmp.path(), cfg.clone()).unwrap();
    // Segment 0: "a" once, then "c"; segment 1: "c", "x" once, "c"; segment 2: "c".
    let mut n = 1;
    append_to(&mut log, "a", n);
    while log.segment_ids().len() < 2 {
        n += 1;
        append_to(&mut log, "c", n);
        sync_elsewhere(&mut log, n); // keeps the next segment made ahead
    }
    assert_eq!(append_to(&mut log, "x", n), 1);
    while log.segment_ids().len() < 3 {
        n += 1;
        append_to(&mut log, "c", n);
        sync_elsewhere(&mut log, n);
    }
    // A fourth channel retires segment 0 ("a" goes cold) without a roll: the job
    // that carries the deletion has no segment to make.
    append_to(&mut log, "d", n);
    let job = log.begin_sync().unwrap().expect("a job with file work");
    // A fifth retires segment 1: "x" goes cold; the newer snapshot knows it.
    append_to(&mut log, "e", n);
    let stop = std::thread::spawn(move || {
        log.sync(0).unwrap();
        log
    });
    // Give an unfixed sync its chance to finish first (a fixed one waits for the
    // job, so this bound never decides the outcome).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while !stop.is_finished() && std::time::Instant::now() < deadline {
        std::thread::yield_now();
    }
    job.run().unwrap();
    drop(stop.join().unwrap());
    let (mut log, _) = MessageLog::open(tmp.path(), cfg).unwrap();
    assert_eq!(
        log.last_seq(2, "x"),
        1,
        "x's last seq survived its retirement"
    );
    assert_eq!(append_to(&mut log, "x", n + 1), 2, "seqs continue");
}
