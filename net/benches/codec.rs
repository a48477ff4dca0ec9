//! wkproto codec and per-connection crypto throughput.
//!
//! Run: `cargo bench -p net --bench codec -- --warm-up-time 1 --measurement-time 3`
//!
//! - `encode/*`, `decode/*`: one SEND or RECV frame (v6) with a 64 B or
//!   1 KiB payload, into a reused buffer / from a ready buffer.
//! - `recv_encrypt/*`: `SessionCipher::encode_recv` (AES of the payload,
//!   msg_key over the sign string, frame encoding) per recipient.
//! - `send_open/*`: `SessionCipher::open_send` (msg_key check + decrypt).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use net::crypto::SessionCipher;
use net::wkproto::{decode, ChannelType, RecvPacket, SendPacket, Setting, MAX_FRAME_BYTES};

const VERSION: u8 = 6;

fn send(payload: &[u8]) -> SendPacket<'_> {
    SendPacket {
        setting: Setting::NONE,
        client_seq: 42,
        client_msg_no: "0c6d2f3e-5b7a-4e1c-9d3b-1f2e3d4c5b6a",
        channel_id: "group-000123",
        channel_type: ChannelType::GROUP,
        msg_key: "94f72eb1273e11dffc0beaf5a1c4aeb3",
        payload,
        ..SendPacket::default()
    }
}

fn recv(payload: &[u8]) -> RecvPacket<'_> {
    RecvPacket {
        msg_key: "f0b46d92d146bc8e55c3a5133fc1938a",
        from_uid: "user-000001",
        channel_id: "group-000123",
        channel_type: ChannelType::GROUP,
        client_msg_no: "0c6d2f3e-5b7a-4e1c-9d3b-1f2e3d4c5b6a",
        message_id: 123_456_789_012_345_678,
        message_seq: 7,
        timestamp_s: 1_764_633_600,
        payload,
        ..RecvPacket::default()
    }
}

fn codec(c: &mut Criterion) {
    for size in [64usize, 1024] {
        let payload = vec![b'a'; size];
        let s = send(&payload);
        let r = recv(&payload);
        let mut out = Vec::with_capacity(4096);

        let mut g = c.benchmark_group("encode");
        g.throughput(Throughput::Elements(1));
        g.bench_with_input(BenchmarkId::new("send", size), &s, |b, p| {
            b.iter(|| {
                out.clear();
                black_box(p).encode(VERSION, &mut out).unwrap();
                black_box(out.len())
            })
        });
        g.bench_with_input(BenchmarkId::new("recv", size), &r, |b, p| {
            b.iter(|| {
                out.clear();
                black_box(p).encode(VERSION, &mut out).unwrap();
                black_box(out.len())
            })
        });
        g.finish();

        let mut send_bytes = Vec::new();
        s.encode(VERSION, &mut send_bytes).unwrap();
        let mut recv_bytes = Vec::new();
        r.encode(VERSION, &mut recv_bytes).unwrap();
        let mut g = c.benchmark_group("decode");
        g.throughput(Throughput::Elements(1));
        g.bench_with_input(BenchmarkId::new("send", size), &send_bytes, |b, buf| {
            b.iter(|| black_box(decode(black_box(buf), VERSION, MAX_FRAME_BYTES).unwrap()))
        });
        g.bench_with_input(BenchmarkId::new("recv", size), &recv_bytes, |b, buf| {
            b.iter(|| black_box(decode(black_box(buf), VERSION, MAX_FRAME_BYTES).unwrap()))
        });
        g.finish();
    }
}

fn crypto(c: &mut Criterion) {
    let cipher = SessionCipher::new(b"6a42aec326f7c192", b"abcdefghijKLMNOP");
    let mut g = c.benchmark_group("recv_encrypt");
    g.throughput(Throughput::Elements(1));
    for size in [64usize, 1024, 16 * 1024] {
        let plain = vec![b'x'; size];
        let base = recv(&[]);
        let mut out = Vec::with_capacity(64 * 1024);
        g.bench_with_input(BenchmarkId::from_parameter(size), &plain, |b, plain| {
            b.iter(|| {
                out.clear();
                cipher
                    .encode_recv(black_box(&base), plain, VERSION, &mut out)
                    .unwrap();
                black_box(out.len())
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("send_open");
    g.throughput(Throughput::Elements(1));
    for size in [64usize, 1024, 16 * 1024] {
        let plain = vec![b'x'; size];
        let mut payload = Vec::new();
        cipher.encrypt_into(&plain, &mut payload);
        let mut p = send(&payload);
        let key = cipher.send_msg_key(&p);
        p.msg_key = key.as_str();
        let mut out = Vec::with_capacity(64 * 1024);
        g.bench_with_input(BenchmarkId::from_parameter(size), &p, |b, p| {
            b.iter(|| {
                out.clear();
                cipher.open_send(black_box(p), &mut out).unwrap();
                black_box(out.len())
            })
        });
    }
    g.finish();
}

criterion_group!(benches, codec, crypto);
criterion_main!(benches);
