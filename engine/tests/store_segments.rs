//! Segment files are created and retired by the sync jobs (on the syncer thread in
//! a node), so that a roll on the shard thread only switches to a file that is
//! already there: the next segment is created and preallocated ahead by a job, the
//! retired ones are deleted by the job after the roll.

use std::path::{Path, PathBuf};

use engine::store::{FsyncPolicy, LogConfig, MessageLog, NewMessage, PullMode};

fn config() -> LogConfig {
    LogConfig {
        segment_bytes: 256 << 10,
        max_segments: 3,
        max_channels: 100,
        max_indexed_messages: 1_000_000,
        max_payload_bytes: 4096,
        max_read_messages: 100_000,
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
