//! Message log: per-channel seqs, reads, roll, retention, limits, recovery, torn tails.

use std::collections::HashMap;
use std::path::Path;

use engine::store::record::RecordFields;
use engine::store::{
    FsyncPolicy, IdempotencyConfig, IdempotencyWindow, LogConfig, LogError, MessageLog, NewMessage,
    PullMode, SentIds,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn seed() -> u64 {
    let s = std::env::var("STORE_TEST_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed);
    println!("STORE_TEST_SEED={s}");
    s
}

/// Small segments (the smallest that holds a max-size record with 4 KiB payloads).
fn small_config() -> LogConfig {
    LogConfig {
        segment_bytes: 256 << 10,
        segments_max: 1000,
        channels_max: 10_000,
        retired_channels_max: 10_000,
        seq_floor_buckets: 64,
        indexed_messages_max: 1_000_000,
        payload_bytes_max: 4096,
        read_messages_max: 1000,
        fsync: FsyncPolicy::Always,
        groups_max: 16,
        entry_bytes_max: 256 << 10,
    }
}

fn payload_for(channel: &str, seq: u64, len: usize) -> Vec<u8> {
    let mut p = format!("{channel}#{seq}:").into_bytes();
    p.resize(len.max(p.len()), b'a' + (seq % 26) as u8);
    p
}

fn msg<'a>(channel: &'a str, client_msg_no: &'a str, payload: &'a [u8], id: i64) -> NewMessage<'a> {
    NewMessage {
        message_id: id,
        channel_type: 2,
        channel_id: channel,
        from_uid: "sender",
        client_msg_no,
        setting: 0,
        msg_flags: 0,
        timestamp_s: 1_700_000_000,
        payload,
    }
}

fn append_n(log: &mut MessageLog, channel: &str, n: u64, payload_len: usize) -> Vec<u64> {
    (0..n)
        .map(|_| {
            let seq = log.last_seq(2, channel) + 1;
            let p = payload_for(channel, seq, payload_len);
            let a = log.append(&msg(channel, "", &p, seq as i64)).unwrap();
            assert_eq!(a.message_seq, seq);
            a.position
        })
        .collect()
}

fn seqs(
    log: &MessageLog,
    channel: &str,
    start: u64,
    end: u64,
    limit: usize,
    mode: PullMode,
) -> (Vec<u64>, bool) {
    let r = log.read(2, channel, start, end, limit, mode).unwrap();
    (r.messages.iter().map(|m| m.message_seq).collect(), r.more)
}

fn range(a: u64, b: u64) -> Vec<u64> {
    (a..=b).collect()
}

/// Reads every retained message of `channel` and checks seqs are contiguous and each
/// payload is the one `payload_for` made. Returns (first, last) retained seqs.
fn check_channel(log: &MessageLog, channel: &str, payload_len: usize) -> Option<(u64, u64)> {
    let first = log.first_retained_seq(2, channel)?;
    let last = log.last_seq(2, channel);
    let mut next = first;
    loop {
        let r = log.read(2, channel, next, 0, 0, PullMode::Up).unwrap();
        for m in &r.messages {
            assert_eq!(m.message_seq, next);
            assert_eq!(m.channel_id, channel);
            assert_eq!(m.message_id, next as i64);
            assert_eq!(m.payload, &payload_for(channel, next, payload_len)[..]);
            next += 1;
        }
        if !r.more {
            break;
        }
    }
    assert_eq!(next, last + 1, "channel {channel}");
    Some((first, last))
}

fn segment_file(dir: &Path, id: u32) -> std::path::PathBuf {
    dir.join(format!("{id:020}.seg"))
}

fn patch_file(path: &Path, at: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, at).unwrap();
    f.sync_all().unwrap();
}

#[test]
fn interleaved_channels_get_seqs_from_one_and_read_back() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let tmp = tempfile::tempdir().unwrap();
    let (mut log, report) = MessageLog::open(tmp.path(), small_config()).unwrap();
    assert_eq!(report.records, 0);
    let channels: Vec<String> = (0..40).map(|i| format!("g{i}")).collect();
    let mut expect: HashMap<&str, u64> = HashMap::new();
    for _ in 0..4000 {
        let c = &channels[rng.gen_range(0..channels.len())];
        let e = expect.entry(c).or_insert(0);
        *e += 1;
        let p = payload_for(c, *e, rng.gen_range(0..200));
        let a = log.append(&msg(c, "", &p, *e as i64)).unwrap();
        assert_eq!(a.message_seq, *e, "seed {seed}");
    }
    log.sync(0).unwrap();
    assert!(log.segment_ids().len() > 1, "small segments rolled");
    for c in &channels {
        let last = expect[c.as_str()];
        assert_eq!(log.last_seq(2, c), last);
        let r = log.read(2, c, 1, 0, 0, PullMode::Up).unwrap();
        assert_eq!(r.messages.len() as u64, last);
        for (i, m) in r.messages.iter().enumerate() {
            assert_eq!(m.message_seq, i as u64 + 1);
            assert!(
                m.payload.starts_with(format!("{c}#{}:", i + 1).as_bytes()),
                "seed {seed}"
            );
        }
    }
    // the same id under another channel type is another channel
    let a = log
        .append(&NewMessage {
            channel_type: 1,
            ..msg("g0", "", b"x", 1)
        })
        .unwrap();
    assert_eq!(a.message_seq, 1);
    assert_eq!(log.last_seq(1, "g0"), 1);
    assert_eq!(log.last_seq(2, "g0"), expect["g0"]);
    assert_eq!(log.last_seq(2, "nope"), 0);
}

#[test]
fn read_bounds_and_pull_modes() {
    let tmp = tempfile::tempdir().unwrap();
    let config = LogConfig {
        read_messages_max: 50,
        ..small_config()
    };
    let (mut log, _) = MessageLog::open(tmp.path(), config).unwrap();
    append_n(&mut log, "c", 100, 8);
    use PullMode::{Down, Up};
    // both zero: the newest `limit`, whatever the mode
    assert_eq!(seqs(&log, "c", 0, 0, 10, Down), (range(91, 100), true));
    assert_eq!(seqs(&log, "c", 0, 0, 10, Up), (range(91, 100), true));
    assert_eq!(
        seqs(&log, "c", 0, 0, 200, Down),
        (range(51, 100), true),
        "clamped to read_messages_max"
    );
    assert_eq!(
        seqs(&log, "c", 0, 0, 0, Down),
        (range(51, 100), true),
        "0 = read_messages_max"
    );
    // down: (end, start], newest first-limited
    assert_eq!(seqs(&log, "c", 100, 0, 10, Down), (range(91, 100), true));
    assert_eq!(seqs(&log, "c", 5, 0, 10, Down), (range(1, 5), false));
    assert_eq!(seqs(&log, "c", 100, 95, 10, Down), (range(96, 100), false));
    assert_eq!(
        seqs(&log, "c", 100, 90, 10, Down),
        (range(91, 100), false),
        "exact more"
    );
    assert_eq!(seqs(&log, "c", 100, 50, 10, Down), (range(91, 100), true));
    assert_eq!(
        seqs(&log, "c", 500, 0, 3, Down),
        (range(98, 100), true),
        "start clipped to last"
    );
    assert_eq!(
        seqs(&log, "c", 0, 97, 10, Down),
        (range(98, 100), false),
        "start 0 = last"
    );
    assert_eq!(seqs(&log, "c", 10, 10, 10, Down), (vec![], false));
    assert_eq!(seqs(&log, "c", 10, 20, 10, Down), (vec![], false));
    // up: [start, end), oldest first-limited
    assert_eq!(seqs(&log, "c", 1, 0, 10, Up), (range(1, 10), true));
    assert_eq!(seqs(&log, "c", 95, 0, 10, Up), (range(95, 100), false));
    assert_eq!(seqs(&log, "c", 10, 20, 100, Up), (range(10, 19), false));
    assert_eq!(seqs(&log, "c", 10, 20, 10, Up), (range(10, 19), false));
    assert_eq!(seqs(&log, "c", 10, 20, 5, Up), (range(10, 14), true));
    assert_eq!(
        seqs(&log, "c", 0, 4, 10, Up),
        (range(1, 3), false),
        "start 0 = from the first"
    );
    assert_eq!(seqs(&log, "c", 101, 0, 10, Up), (vec![], false));
    assert_eq!(seqs(&log, "c", 10, 10, 10, Up), (vec![], false));
    assert_eq!(seqs(&log, "c", 10, 1, 10, Up), (vec![], false));
    assert_eq!(
        seqs(&log, "c", u64::MAX, u64::MAX, 10, Down),
        (vec![], false)
    );
    assert_eq!(seqs(&log, "c", u64::MAX, 0, 1, Up), (vec![], false));
    assert_eq!(seqs(&log, "unknown", 0, 0, 10, Down), (vec![], false));
    assert_eq!(PullMode::from_wire(1), Up);
    assert_eq!(PullMode::from_wire(0), Down);
    assert_eq!(PullMode::from_wire(7), Down);
}

#[test]
fn recovery_after_reopen_returns_every_record_synced_or_not() {
    let tmp = tempfile::tempdir().unwrap();
    let channels = ["a", "b", "c"];
    {
        let (mut log, _) = MessageLog::open(tmp.path(), small_config()).unwrap();
        for round in 0..300 {
            for c in channels {
                append_n(&mut log, c, 1, 300 + round);
            }
            if round == 200 {
                log.sync(0).unwrap();
            }
        }
        // the last 99 rounds were never synced: dropping the log (like a process exit)
        // leaves them in the page cache, which the reopen reads.
        assert!(log.stats().unsynced_bytes > 0);
    }
    let (log, report) = MessageLog::open(tmp.path(), small_config()).unwrap();
    assert_eq!(report.records, 900);
    assert_eq!(report.truncated_bytes, 0);
    assert_eq!(report.dropped_segments, 0);
    assert_eq!(report.seq_discontinuities, 0);
    assert_eq!(report.channels, 3);
    for c in channels {
        assert_eq!(log.last_seq(2, c), 300);
        let r = log.read(2, c, 1, 0, 0, PullMode::Up).unwrap();
        assert_eq!(r.messages.len(), 300);
        for (i, m) in r.messages.iter().enumerate() {
            assert_eq!(m.payload, &payload_for(c, i as u64 + 1, 300 + i)[..]);
            assert_eq!(m.from_uid, "sender");
            assert_eq!(m.timestamp_s, 1_700_000_000);
            assert_eq!(log.get(m.position).unwrap(), *m);
        }
    }
}

#[test]
fn a_second_open_of_the_same_directory_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (_log, _) = MessageLog::open(tmp.path(), small_config()).unwrap();
    assert!(matches!(
        MessageLog::open(tmp.path(), small_config()),
        Err(LogError::Locked)
    ));
}

#[test]
fn segments_roll_when_full_and_records_span_them() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut log, _) = MessageLog::open(tmp.path(), small_config()).unwrap();
    assert_eq!(log.segment_ids(), vec![0]);
    // ~1 KiB records: a 256 KiB segment holds ~240
    let positions = append_n(&mut log, "r", 1000, 1000);
    let ids = log.segment_ids();
    assert_eq!(ids, (0..ids.len() as u32).collect::<Vec<_>>());
    assert!(ids.len() >= 4, "{ids:?}");
    let mut segs: Vec<u64> = positions.iter().map(|p| p >> 32).collect();
    segs.dedup();
    assert_eq!(segs.len(), ids.len());
    for id in &ids {
        let len = std::fs::metadata(segment_file(tmp.path(), *id))
            .unwrap()
            .len();
        assert_eq!(len, 256 << 10, "segments are preallocated to segment_bytes");
    }
    check_channel(&log, "r", 1000);
    drop(log);
    let (log, report) = MessageLog::open(tmp.path(), small_config()).unwrap();
    assert_eq!(report.records, 1000);
    assert_eq!(report.segments as usize, ids.len());
    assert_eq!(check_channel(&log, "r", 1000), Some((1, 1000)));
}

#[test]
fn retention_deletes_oldest_segments_and_seqs_continue_after_reopen() {
    let tmp = tempfile::tempdir().unwrap();
    let config = LogConfig {
        segments_max: 3,
        ..small_config()
    };
    let (mut log, _) = MessageLog::open(tmp.path(), config.clone()).unwrap();
    let cold_positions = append_n(&mut log, "cold", 5, 100);
    append_n(&mut log, "hot", 2000, 1000);
    log.sync(0).unwrap();
    let ids = log.segment_ids();
    assert_eq!(ids.len(), 3);
    assert!(ids[0] > 0, "oldest segments retired");
    for id in 0..ids[0] {
        assert!(!segment_file(tmp.path(), id).exists());
    }
    let stats = log.stats();
    assert!(stats.retired_segments > 0 && stats.retired_messages > 0);
    assert_eq!(stats.indexed_messages as u64 + stats.retired_messages, 2005);
    // cold's messages are all gone; hot keeps a suffix
    assert_eq!(log.first_retained_seq(2, "cold"), None);
    assert!(matches!(
        log.get(cold_positions[0]),
        Err(LogError::NoSuchPosition { .. })
    ));
    assert_eq!(log.last_seq(2, "cold"), 5);
    assert_eq!(
        seqs(&log, "cold", 0, 0, 10, PullMode::Down),
        (vec![], false)
    );
    let (first, last) = check_channel(&log, "hot", 1000).unwrap();
    assert!(first > 1 && last == 2000);
    // a read reaching below the retained range gets what is retained, and no `more`
    let (got, more) = seqs(&log, "hot", first + 2, 0, 10, PullMode::Down);
    assert_eq!((got, more), (range(first, first + 2), false));
    drop(log);

    let (mut log, report) = MessageLog::open(tmp.path(), config).unwrap();
    assert_eq!(
        report.snapshot_channels, 1,
        "cold's last seq came from the snapshot"
    );
    assert_eq!(log.last_seq(2, "cold"), 5);
    assert_eq!(
        log.append(&msg("cold", "", b"again", 6))
            .unwrap()
            .message_seq,
        6
    );
    assert_eq!(check_channel(&log, "hot", 1000), Some((first, 2000)));
    assert_eq!(
        log.append(&msg("hot", "", b"x", 1)).unwrap().message_seq,
        2001
    );
}

#[test]
fn index_budget_retires_oldest_segments_and_appends_go_on() {
    let tmp = tempfile::tempdir().unwrap();
    let config = LogConfig {
        indexed_messages_max: 300,
        segment_bytes: 1 << 20,
        ..small_config()
    };
    let (mut log, _) = MessageLog::open(tmp.path(), config.clone()).unwrap();
    // 1000 small records fit in one segment: the budget, not the segment size, binds
    append_n(&mut log, "a", 1000, 16);
    let stats = log.stats();
    assert!(stats.indexed_messages <= 300, "{stats:?}");
    assert!(stats.retired_messages >= 700, "{stats:?}");
    let (first, last) = check_channel(&log, "a", 16).unwrap();
    assert_eq!(last, 1000);
    assert_eq!(first, 1001 - stats.indexed_messages as u64);
    drop(log);
    let (log, report) = MessageLog::open(tmp.path(), config).unwrap();
    assert_eq!(log.last_seq(2, "a"), 1000);
    assert!(report.records <= 300);
    assert_eq!(check_channel(&log, "a", 16), Some((first, 1000)));
}

#[test]
fn bad_input_is_an_error_that_changes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let config = small_config();
    let (mut log, _) = MessageLog::open(tmp.path(), config.clone()).unwrap();
    append_n(&mut log, "one", 2, 4);
    append_n(&mut log, "two", 1, 4);
    assert!(matches!(
        log.append(&msg("", "", b"x", 1)),
        Err(LogError::EmptyChannelId)
    ));
    let big = vec![0u8; 4097];
    assert!(matches!(
        log.append(&msg("one", "", &big, 1)),
        Err(LogError::PayloadTooLarge {
            len: 4097,
            payload_bytes_max: 4096
        })
    ));
    let long = "x".repeat(65536);
    assert!(matches!(
        log.append(&msg("one", &long, b"x", 1)),
        Err(LogError::FieldTooLong {
            field: "client_msg_no",
            ..
        })
    ));
    assert_eq!(log.last_seq(2, "three"), 0);
    assert_eq!(log.stats().indexed_messages, 3);
    assert_eq!(append_n(&mut log, "one", 1, 4).len(), 1);
    assert_eq!(log.last_seq(2, "one"), 3);
    // invalid configs are refused
    for bad in [
        LogConfig {
            segment_bytes: 4095,
            ..config.clone()
        },
        LogConfig {
            segment_bytes: 64 << 10,
            ..config.clone()
        },
        LogConfig {
            segments_max: 0,
            ..config.clone()
        },
        LogConfig {
            read_messages_max: 0,
            ..config.clone()
        },
        LogConfig {
            seq_floor_buckets: 0,
            ..config.clone()
        },
    ] {
        assert!(matches!(bad.validate(), Err(LogError::Config(_))));
    }
}

#[test]
fn sync_due_follows_the_policy() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut log, _) = MessageLog::open(tmp.path(), small_config()).unwrap();
    assert!(!log.sync_due(0));
    append_n(&mut log, "a", 1, 1);
    assert!(log.sync_due(0));
    log.sync(5).unwrap();
    assert!(!log.sync_due(1_000_000));
    drop(log);
    let config = LogConfig {
        fsync: FsyncPolicy::IntervalMs(100),
        ..small_config()
    };
    let (mut log, _) = MessageLog::open(tmp.path(), config).unwrap();
    log.sync(1_000).unwrap();
    append_n(&mut log, "a", 1, 1);
    assert!(!log.sync_due(1_099));
    assert!(log.sync_due(1_100));
    log.sync(1_100).unwrap();
    assert!(!log.sync_due(5_000));
    assert_eq!(log.stats().unsynced_bytes, 0);
}

#[test]
fn a_sync_job_covers_the_appends_before_it_and_its_failure_poisons_the_log() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut log, _) = MessageLog::open(tmp.path(), small_config()).unwrap();
    assert!(log.begin_sync().unwrap().is_none(), "nothing appended");
    append_n(&mut log, "a", 3, 10);
    let job = log.begin_sync().unwrap().expect("appends to sync");
    assert!(!log.sync_due(0), "the job holds them");
    assert!(log.begin_sync().unwrap().is_none(), "nothing since the job");
    append_n(&mut log, "a", 1, 10);
    assert!(log.sync_due(0), "an append after the job is not covered");
    // The job runs elsewhere (here: another thread) while the log goes on.
    let result = std::thread::spawn(move || job.run()).join().unwrap();
    log.end_sync(result, 7).unwrap();
    let second = log.begin_sync().unwrap().expect("the later append");
    log.end_sync(second.run(), 8).unwrap();
    assert_eq!(log.stats().unsynced_bytes, 0);

    append_n(&mut log, "a", 1, 10);
    let _failed = log.begin_sync().unwrap().unwrap();
    let err = log.end_sync(Err(std::io::Error::other("disk gone")), 9);
    assert!(matches!(err, Err(LogError::Io { .. })), "{err:?}");
    let p = payload_for("a", 6, 10);
    assert!(matches!(
        log.append(&msg("a", "", &p, 6)),
        Err(LogError::Poisoned)
    ));
    assert!(matches!(log.begin_sync(), Err(LogError::Poisoned)));
}

/// Writes three records per channel, then damages the tail of the log file.
fn torn_tail_case(damage: impl FnOnce(&Path, u64, usize)) {
    let tmp = tempfile::tempdir().unwrap();
    let config = small_config();
    let (mut log, _) = MessageLog::open(tmp.path(), config.clone()).unwrap();
    append_n(&mut log, "a", 3, 50);
    append_n(&mut log, "b", 3, 50);
    let last = append_n(&mut log, "a", 1, 50)[0];
    log.sync(0).unwrap();
    let len = RecordFields {
        message_id: 0,
        message_seq: 0,
        timestamp_s: 0,
        channel_type: 2,
        setting: 0,
        msg_flags: 0,
        channel_id: b"a",
        from_uid: b"sender",
        client_msg_no: b"",
        payload: &payload_for("a", 4, 50),
        ..RecordFields::default()
    }
    .record_len()
    .unwrap();
    drop(log);
    damage(
        &segment_file(tmp.path(), (last >> 32) as u32),
        last & 0xffff_ffff,
        len,
    );

    let (mut log, report) = MessageLog::open(tmp.path(), config.clone()).unwrap();
    assert!(report.truncated_bytes > 0, "{report:?}");
    assert_eq!(report.records, 6);
    assert_eq!(log.last_seq(2, "a"), 3, "the torn record is gone");
    assert_eq!(check_channel(&log, "a", 50), Some((1, 3)));
    assert_eq!(check_channel(&log, "b", 50), Some((1, 3)));
    let a = log
        .append(&msg("a", "", &payload_for("a", 4, 50), 4))
        .unwrap();
    assert_eq!(
        (a.message_seq, a.position),
        (4, last),
        "appends continue where the log ends"
    );
    append_n(&mut log, "b", 2, 50);
    log.sync(0).unwrap();
    drop(log);
    // the garbage was zeroed: the next open is clean and sees the new records
    let (log, report) = MessageLog::open(tmp.path(), config).unwrap();
    assert_eq!(report.truncated_bytes, 0, "{report:?}");
    assert_eq!(report.records, 9);
    assert_eq!(check_channel(&log, "a", 50), Some((1, 4)));
    assert_eq!(check_channel(&log, "b", 50), Some((1, 5)));
}

#[test]
fn torn_tail_partial_body_is_truncated() {
    torn_tail_case(|file, off, len| patch_file(file, off + len as u64 - 20, &[0u8; 12]));
}

#[test]
fn torn_tail_partial_header_and_garbage_after_it_are_truncated() {
    torn_tail_case(|file, off, len| {
        // only the first 20 bytes of the header made it, and garbage lies further on
        patch_file(file, off + 20, &vec![0u8; len - 20]);
        let mut rng = StdRng::seed_from_u64(seed());
        let garbage: Vec<u8> = (0..3000).map(|_| rng.gen()).collect();
        patch_file(file, off + len as u64 + 4096, &garbage);
    });
}

#[test]
fn garbage_after_the_last_valid_record_is_truncated() {
    torn_tail_case(|file, off, _len| {
        let mut rng = StdRng::seed_from_u64(seed() ^ 1);
        let garbage: Vec<u8> = (0..777).map(|_| rng.gen::<u8>() | 1).collect();
        patch_file(file, off, &garbage);
    });
}

#[test]
fn crc_mismatch_in_the_middle_ends_the_log_there() {
    let tmp = tempfile::tempdir().unwrap();
    let config = small_config();
    let (mut log, _) = MessageLog::open(tmp.path(), config.clone()).unwrap();
    let positions = append_n(&mut log, "m", 1000, 1000);
    log.sync(0).unwrap();
    let segments = log.segment_ids().len() as u32;
    assert!(segments >= 4);
    drop(log);
    // flip one payload byte of a record in segment 1
    let victim = positions.iter().position(|p| p >> 32 == 1).unwrap() + 5;
    let pos = positions[victim];
    patch_file(
        &segment_file(tmp.path(), 1),
        (pos & 0xffff_ffff) + 100,
        b"\xff",
    );

    let (mut log, report) = MessageLog::open(tmp.path(), config).unwrap();
    assert_eq!(report.records, victim as u64);
    assert_eq!(
        report.dropped_segments,
        segments - 2,
        "segments after the bad one deleted"
    );
    assert!(report.truncated_bytes > 0);
    assert_eq!(log.segment_ids(), vec![0, 1]);
    assert!(!segment_file(tmp.path(), 2).exists());
    assert_eq!(check_channel(&log, "m", 1000), Some((1, victim as u64)));
    let a = log
        .append(&msg(
            "m",
            "",
            &payload_for("m", victim as u64 + 1, 1000),
            victim as i64 + 1,
        ))
        .unwrap();
    assert_eq!(a.message_seq, victim as u64 + 1);
    assert_eq!(a.position, pos);
}

#[test]
fn idempotency_window_is_rebuilt_from_the_log() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut log, _) = MessageLog::open(tmp.path(), small_config()).unwrap();
    for i in 0..10u32 {
        let no = format!("cm{i}");
        let m = NewMessage {
            timestamp_s: 1000 + i,
            from_uid: if i % 2 == 0 { "u0" } else { "u1" },
            ..msg("g", &no, b"p", 100 + i as i64)
        };
        log.append(&m).unwrap();
    }
    let mut w = IdempotencyWindow::new(IdempotencyConfig {
        entries_max: 4,
        ttl_s: 100,
        budget_bytes: 1 << 20,
    })
    .unwrap();
    // at 1103, records stamped at or before 1003 are past the ttl; of the 6 others,
    // the newest 4 fit the bound
    assert_eq!(
        engine::store::refill_idempotency(&mut w, &log, 1103).unwrap(),
        4
    );
    assert_eq!(
        w.get("u1", "cm9", 1103),
        Some(SentIds {
            message_id: 109,
            message_seq: 10
        })
    );
    assert_eq!(
        w.get("u0", "cm6", 1103),
        Some(SentIds {
            message_id: 106,
            message_seq: 7
        })
    );
    assert_eq!(w.get("u1", "cm5", 1103), None, "evicted by entries_max");
    assert_eq!(w.get("u0", "cm4", 1103), None, "evicted by entries_max");
    assert_eq!(w.get("u0", "cm8", 1108), None, "expired by ttl_s at 1108");
}

#[test]
fn prefault_populates_ahead_and_changes_no_contents() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut log, _) = MessageLog::open(tmp.path(), small_config()).unwrap();
    append_n(&mut log, "p", 10, 100);
    let n = log.prefault(64 << 10);
    assert!(n >= 60 << 10, "populated {n} bytes (needs Linux >= 5.14)");
    assert_eq!(log.prefault(64 << 10), 0, "already populated");
    append_n(&mut log, "p", 300, 100);
    assert!(log.prefault(1 << 30) > 0, "clipped to the segment");
    log.sync(0).unwrap();
    drop(log);
    let (log, report) = MessageLog::open(tmp.path(), small_config()).unwrap();
    assert_eq!((report.records, report.truncated_bytes), (310, 0));
    assert_eq!(check_channel(&log, "p", 100), Some((1, 310)));
}

/// Every channel's retained records, ascending, found by scanning the segments on
/// disk (what a read must return, whatever the in-memory index holds).
fn on_disk_seqs(log: &MessageLog) -> HashMap<String, Vec<u64>> {
    let mut out: HashMap<String, Vec<u64>> = HashMap::new();
    log.scan(|m| {
        assert_eq!(m.channel_type, 2);
        out.entry(m.channel_id.to_owned())
            .or_default()
            .push(m.message_seq);
    })
    .unwrap();
    out
}

/// All of `channel`'s retained messages through `read` (paging Up), checked against
/// their payloads.
fn read_all(log: &MessageLog, channel: &str) -> Vec<u64> {
    let mut out = Vec::new();
    let mut next = 1;
    loop {
        let r = log.read(2, channel, next, 0, 0, PullMode::Up).unwrap();
        for m in &r.messages {
            assert_eq!(m.channel_id, channel);
            assert_eq!(m.payload, &payload_for(channel, m.message_seq, 1500)[..]);
            out.push(m.message_seq);
            next = m.message_seq + 1;
        }
        if !r.more {
            return out;
        }
    }
}

/// Issue 11.3: `channels_max` bounds the channels held in memory, not the channels a
/// log may ever see. Over its life the log takes appends to many more distinct
/// channels than `channels_max`; every append succeeds, each channel's seqs continue
/// across eviction (never reused, never skipped), and a read returns exactly the
/// channel's records still on disk.
#[test]
fn more_distinct_channels_than_max_channels_all_work_and_seqs_continue() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let tmp = tempfile::tempdir().unwrap();
    let config = LogConfig {
        channels_max: 8,
        segments_max: 4,
        ..small_config()
    };
    let (mut log, _) = MessageLog::open(tmp.path(), config.clone()).unwrap();
    let channels: Vec<String> = (0..60).map(|i| format!("ch-{i}")).collect();
    let mut model: HashMap<String, u64> = HashMap::new();
    let check = |log: &MessageLog, model: &HashMap<String, u64>| {
        let mut disk = on_disk_seqs(log);
        for c in &channels {
            let want = model.get(c).copied().unwrap_or(0);
            assert_eq!(log.last_seq(2, c), want, "last seq of {c}, seed {seed}");
            let on_disk = disk.remove(c).unwrap_or_default();
            if let (Some(&f), Some(&l)) = (on_disk.first(), on_disk.last()) {
                assert_eq!(on_disk, range(f, l), "{c}: on disk, seed {seed}");
                assert_eq!(l, want, "{c}: newest on disk, seed {seed}");
            }
            assert_eq!(read_all(log, c), on_disk, "{c}: read, seed {seed}");
        }
        assert!(log.stats().channels <= 8, "{:?}", log.stats());
    };
    let (mut retired_segments, mut returns_after_eviction) = (0, 0);
    for round in 0..6 {
        for _ in 0..400 {
            // a few busy channels and a long tail of new and returning ones
            let c = if rng.gen_bool(0.3) {
                &channels[rng.gen_range(0..3)]
            } else {
                &channels[rng.gen_range(0..channels.len())]
            };
            let seq = model.get(c).copied().unwrap_or(0) + 1;
            if seq > 1 && log.first_retained_seq(2, c).is_none() {
                returns_after_eviction += 1;
            }
            let p = payload_for(c, seq, 1500);
            let a = log
                .append(&msg(c, "", &p, seq as i64))
                .unwrap_or_else(|e| panic!("append to {c} (round {round}, seed {seed}): {e}"));
            assert_eq!(a.message_seq, seq, "{c}, seed {seed}");
            model.insert(c.clone(), seq);
        }
        assert!(model.len() > 8);
        check(&log, &model);
        if round % 2 == 1 {
            retired_segments += log.stats().retired_segments;
            log.sync(0).unwrap();
            drop(log);
            log = MessageLog::open(tmp.path(), config.clone()).unwrap().0;
            check(&log, &model);
        }
    }
    assert_eq!(model.len(), channels.len(), "every channel was used");
    assert!(retired_segments > 0);
    assert!(
        returns_after_eviction > 100,
        "{returns_after_eviction} appends to evicted channels"
    );
}

/// The retired-seq table is bounded: beyond `retired_channels_max` its oldest entries
/// fold into `seq_floor_buckets` high-water marks. Seqs may then skip but never go
/// back or repeat, also across reopens that change the bucket count.
#[test]
fn retired_channels_beyond_their_budget_never_reuse_a_seq() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let tmp = tempfile::tempdir().unwrap();
    let config = LogConfig {
        channels_max: 2,
        segments_max: 2,
        retired_channels_max: 3,
        seq_floor_buckets: 2,
        ..small_config()
    };
    let (mut log, _) = MessageLog::open(tmp.path(), config.clone()).unwrap();
    let mut model: HashMap<String, u64> = HashMap::new();
    let mut skips = 0;
    for round in 0..4 {
        for _ in 0..200 {
            let c = format!("c{}", rng.gen_range(0..40));
            let before = model.get(&c).copied().unwrap_or(0);
            let a = log.append(&msg(&c, "", b"x", 1)).unwrap();
            assert_eq!(log.last_seq(2, &c), a.message_seq);
            assert!(a.message_seq > before, "{c} went back, seed {seed}");
            skips += u64::from(a.message_seq > before + 1);
            model.insert(c, a.message_seq);
        }
        let stats = log.stats();
        assert!(
            stats.retired_channels <= 3 && stats.channels <= 2,
            "{stats:?}"
        );
        log.sync(0).unwrap();
        drop(log);
        let buckets = if round % 2 == 0 { 5 } else { 2 };
        let (l, report) = MessageLog::open(
            tmp.path(),
            LogConfig {
                seq_floor_buckets: buckets,
                ..config.clone()
            },
        )
        .unwrap();
        assert_eq!(report.seq_discontinuities, 0);
        log = l;
        for (c, &last) in &model {
            assert!(log.last_seq(2, c) >= last, "{c}, seed {seed}");
        }
    }
    assert!(skips > 0, "the floors were used");
}

/// A `channel_seqs.snap` of format 1 (listed ids, written by earlier versions) is
/// still read: its channels continue from their last seq.
#[test]
fn a_format_1_seq_snapshot_is_still_read() {
    let tmp = tempfile::tempdir().unwrap();
    let mut v1 = Vec::new();
    v1.extend_from_slice(b"ICSQ");
    v1.extend_from_slice(&1u64.to_le_bytes());
    v1.push(2);
    v1.extend_from_slice(&3u16.to_le_bytes());
    v1.extend_from_slice(b"old");
    v1.extend_from_slice(&41u64.to_le_bytes());
    let crc = crc32fast::hash(&v1);
    v1.extend_from_slice(&crc.to_le_bytes());
    std::fs::write(tmp.path().join("channel_seqs.snap"), &v1).unwrap();
    let (mut log, report) = MessageLog::open(tmp.path(), small_config()).unwrap();
    assert_eq!(report.snapshot_channels, 1);
    assert_eq!(log.last_seq(2, "old"), 41);
    assert_eq!(
        log.append(&msg("old", "", b"x", 1)).unwrap().message_seq,
        42
    );
    assert_eq!(log.last_seq(2, "new"), 0);
    // a corrupt snapshot is an error, not a silent restart of every seq
    drop(log);
    let mut bad = v1.clone();
    bad[14] ^= 1;
    std::fs::write(tmp.path().join("channel_seqs.snap"), &bad).unwrap();
    assert!(matches!(
        MessageLog::open(tmp.path(), small_config()),
        Err(LogError::SnapshotCorrupt)
    ));
}

/// Issue 11.8: the idempotency window is bounded by bytes. Keys of very different
/// sizes (up to 2 × 64 KiB) totalling far more than `budget_bytes`: the accounted
/// bytes never pass the budget, the oldest entries go first, the newest stay, and an
/// entry larger than the whole budget is not kept (nor does it evict anything).
#[test]
fn idempotency_window_keeps_its_byte_budget_evicting_oldest_first() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let budget = 512 << 10;
    let mut w = IdempotencyWindow::new(IdempotencyConfig {
        entries_max: 1_000_000,
        ttl_s: 1_000,
        budget_bytes: budget,
    })
    .unwrap();
    let mut inserted: Vec<(String, String, usize)> = Vec::new();
    let mut total = 0;
    for i in 0..400u64 {
        let uid = format!("u{}", rng.gen_range(0..5));
        let len = if rng.gen_bool(0.1) {
            65_000
        } else {
            rng.gen_range(1..4000)
        };
        let no = format!("{i}-{}", "n".repeat(len));
        let ids = SentIds {
            message_id: i as i64,
            message_seq: i,
        };
        assert_eq!(w.insert(&uid, &no, ids, 10), None);
        total += IdempotencyWindow::entry_bytes(&uid, &no);
        inserted.push((uid, no, i as usize));
        assert!(w.bytes() <= budget, "{} > {budget}, seed {seed}", w.bytes());
    }
    assert!(total > 4 * budget);
    // what is kept is a suffix of the insertions (oldest evicted first) that fits
    let kept: Vec<bool> = inserted
        .iter()
        .map(|(u, n, _)| w.get(u, n, 10).is_some())
        .collect();
    let first_kept = kept.iter().position(|&k| k).expect("the newest is kept");
    assert!(kept[first_kept..].iter().all(|&k| k), "seed {seed}");
    let sum: usize = inserted[first_kept..]
        .iter()
        .map(|(u, n, _)| IdempotencyWindow::entry_bytes(u, n))
        .sum();
    assert_eq!(sum, w.bytes());
    let before_oldest = &inserted[first_kept - 1];
    assert!(
        sum + IdempotencyWindow::entry_bytes(&before_oldest.0, &before_oldest.1) > budget,
        "the next older one would not have fit"
    );
    // an entry larger than the budget is not kept and evicts nothing
    let len_before = w.len();
    let huge = "h".repeat(65_535);
    let tiny = IdempotencyWindow::new(IdempotencyConfig {
        budget_bytes: 1000,
        ..IdempotencyConfig::default()
    });
    let mut tiny = tiny.unwrap();
    tiny.insert(
        "a",
        "1",
        SentIds {
            message_id: 1,
            message_seq: 1,
        },
        0,
    );
    tiny.insert(
        &huge,
        &huge,
        SentIds {
            message_id: 2,
            message_seq: 2,
        },
        0,
    );
    assert_eq!(tiny.len(), 1);
    assert!(tiny.get(&huge, &huge, 0).is_none());
    assert!(tiny.get("a", "1", 0).is_some());
    assert_eq!(w.len(), len_before);
    // expiry gives the bytes back
    assert!(w.get("u0", "x", 1_010).is_none());
    assert_eq!((w.len(), w.bytes()), (0, 0));
}

#[test]
fn reads_bounded_by_bytes_keep_the_start_of_the_pull_and_say_more() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut log, _) = MessageLog::open(tmp.path(), small_config()).unwrap();
    append_n(&mut log, "c", 20, 100);
    use PullMode::{Down, Up};
    let read = |start, end, mode, bytes_max| {
        let r = log
            .read_within(2, "c", start, end, 0, mode, bytes_max)
            .unwrap();
        let bytes: usize = r.messages.iter().map(|m| m.copy_bytes()).sum();
        let seqs: Vec<u64> = r.messages.iter().map(|m| m.message_seq).collect();
        (seqs, r.more, bytes)
    };
    // 107 bytes a message (100 payload, channel "c", sender "sender").
    assert_eq!(read(1, 0, Up, 350), (range(1, 3), true, 321));
    assert_eq!(read(4, 0, Up, 321), (range(4, 6), true, 321));
    assert_eq!(read(18, 0, Up, 350), (range(18, 20), false, 321));
    assert_eq!(read(0, 0, Down, 350), (range(18, 20), true, 321));
    assert_eq!(read(17, 0, Down, 350), (range(15, 17), true, 321));
    assert_eq!(read(3, 0, Down, 350), (range(1, 3), false, 321));
    // One message over the bound alone is still returned, so paging advances.
    assert_eq!(read(5, 0, Up, 10), (vec![5], true, 107));
    assert_eq!(read(5, 0, Down, 10), (vec![5], true, 107));
    // Unbounded: as `read`.
    assert_eq!(read(1, 0, Up, usize::MAX).0, range(1, 20));
}

/// A version 1 record (the 48-byte header of logs written before replication).
fn v1_record(channel: &str, seq: u64, payload: &[u8]) -> Vec<u8> {
    use engine::store::record::{align_up, RecordHeaderV1, RECORD_MAGIC, RECORD_VERSION_1};
    let body = [channel.as_bytes(), b"sender", payload].concat();
    let len = align_up(48 + body.len());
    let h = RecordHeaderV1 {
        magic: RECORD_MAGIC,
        version: RECORD_VERSION_1,
        msg_flags: 0,
        record_len: len as u32,
        crc32: 0,
        message_id: seq as i64,
        message_seq: seq,
        timestamp_s: 1_700_000_000,
        payload_len: payload.len() as u32,
        channel_id_len: channel.len() as u16,
        from_uid_len: 6,
        client_msg_no_len: 0,
        channel_type: 2,
        setting: 0,
    };
    let mut rec = bytemuck::bytes_of(&h).to_vec();
    let mut crc = crc32fast::Hasher::new();
    crc.update(&rec[..12]);
    crc.update(&rec[16..]);
    crc.update(&body);
    rec[12..16].copy_from_slice(&crc.finalize().to_le_bytes());
    rec.extend_from_slice(&body);
    rec.resize(len, 0);
    rec
}

/// A log written by version 1 (records of the 48-byte header) opens: its messages
/// read back with their seqs, appends continue them in version 2 in the same
/// segment, and both read back after a restart.
#[test]
fn a_log_of_version_1_records_opens_and_continues() {
    let tmp = tempfile::tempdir().unwrap();
    let mut seg = Vec::new();
    for seq in 1..=3 {
        seg.extend(v1_record("old", seq, &payload_for("old", seq, 30)));
    }
    std::fs::write(segment_file(tmp.path(), 0), &seg).unwrap();
    let (mut log, report) = MessageLog::open(tmp.path(), small_config()).unwrap();
    assert_eq!((report.records, report.truncated_bytes), (3, 0));
    assert_eq!(check_channel(&log, "old", 30), Some((1, 3)));
    assert_eq!(append_n(&mut log, "old", 2, 30).len(), 2);
    log.sync(0).unwrap();
    drop(log);
    let (log, report) = MessageLog::open(tmp.path(), small_config()).unwrap();
    assert_eq!((report.records, report.seq_discontinuities), (5, 0));
    assert_eq!(check_channel(&log, "old", 30), Some((1, 5)));
}
