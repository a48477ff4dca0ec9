//! Message log: append + group-commit sync throughput (64-byte payloads, batches of 1
//! and 64), append alone (with and without pages populated ahead by `prefault`), and
//! a 100-message read.
//!
//! `cargo bench -p engine --bench store -- --warm-up-time 1 --measurement-time 3`
//! The log lives in a temp dir under `$TMPDIR` (default /tmp): sync figures are those
//! of that file system's device.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use engine::store::{FsyncPolicy, LogConfig, MessageLog, NewMessage, PullMode};

fn config() -> LogConfig {
    LogConfig {
        segment_bytes: 64 << 20,
        segments_max: 4,
        channels_max: 1024,
        indexed_messages_max: 4_000_000,
        payload_bytes_max: 4096,
        read_messages_max: 1000,
        fsync: FsyncPolicy::Always,
        ..LogConfig::default()
    }
}

fn message<'a>(channel: &'a str, payload: &'a [u8]) -> NewMessage<'a> {
    NewMessage {
        message_id: 1,
        channel_type: 2,
        channel_id: channel,
        from_uid: "bench-user",
        client_msg_no: "0123456789abcdef",
        setting: 0,
        msg_flags: 0,
        timestamp_s: 1_700_000_000,
        payload,
    }
}

fn bench(c: &mut Criterion) {
    let tmp = tempfile::tempdir().unwrap();
    let (mut log, _) = MessageLog::open(tmp.path(), config()).unwrap();
    let payload = [0x5au8; 64];
    let channels: Vec<String> = (0..64).map(|i| format!("group-{i}")).collect();
    let mut n = 0usize;

    let mut g = c.benchmark_group("log");
    for batch in [1usize, 64] {
        g.throughput(Throughput::Elements(batch as u64));
        g.bench_function(format!("append_sync_batch_{batch}"), |b| {
            b.iter(|| {
                for _ in 0..batch {
                    n += 1;
                    let m = message(&channels[n % channels.len()], &payload);
                    black_box(log.append(&m).unwrap());
                }
                log.sync(0).unwrap();
            })
        });
    }
    g.throughput(Throughput::Elements(1));
    g.bench_function("append_no_sync", |b| {
        b.iter(|| {
            n += 1;
            let m = message(&channels[n % channels.len()], &payload);
            black_box(log.append(&m).unwrap())
        })
    });
    log.sync(0).unwrap();
    // as the engine would run it: pages populated off the latency path (untimed)
    g.bench_function("append_no_sync_prefaulted", |b| {
        b.iter_custom(|iters| {
            let mut total = std::time::Duration::ZERO;
            let mut left = iters;
            while left > 0 {
                log.prefault(256 << 10);
                let chunk = left.min(512);
                let start = std::time::Instant::now();
                for _ in 0..chunk {
                    n += 1;
                    let m = message(&channels[n % channels.len()], &payload);
                    black_box(log.append(&m).unwrap());
                }
                total += start.elapsed();
                left -= chunk;
            }
            total
        })
    });
    log.sync(0).unwrap();

    for _ in 0..10_000 {
        log.append(&message("history", &payload)).unwrap();
    }
    log.sync(0).unwrap();
    g.throughput(Throughput::Elements(100));
    g.bench_function("read_100", |b| {
        b.iter(|| {
            let r = log
                .read(2, "history", black_box(5_000), 0, 100, PullMode::Up)
                .unwrap();
            assert_eq!(r.messages.len(), 100);
            black_box(r.messages.last().map(|m| m.payload.len()))
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
