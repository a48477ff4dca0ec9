//! wkproto codec and per-connection crypto throughput.
//!
//! Run: `cargo bench -p net --bench codec -- --warm-up-time 1 --measurement-time 3`
//!
//! - `encode/*`, `decode/*`: one SEND or RECV frame (v6) with a 64 B or
//!   1 KiB payload, into a reused buffer / from a ready buffer.
//! - `recv_encrypt/*`: `SessionCipher::encode_recv` (AES of the payload,
//!   msg_key over the sign string, frame encoding) per recipient.
//! - `send_open/*`: `SessionCipher::open_send` (msg_key check + decrypt).
//! - `jsonrpc_recv/*`: `jsonrpc::encode_recv` (a `recv` notification, base64 of the
//!   payload) per JSON-RPC recipient, beside `recv_encrypt/*` for a binary one.
//! - `jsonrpc_send/*`: `JsonRpc::decode` of a `send` request (base64 payload).

use std::hint::black_box;

use base64::Engine as _;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use proto::crypto::SessionCipher;
use proto::jsonrpc::{self, JsonRpc};
use proto::wkproto::{decode, ChannelType, RecvPacket, SendPacket, Setting, MAX_FRAME_BYTES};

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

fn json_rpc(c: &mut Criterion) {
    let mut g = c.benchmark_group("jsonrpc_recv");
    g.throughput(Throughput::Elements(1));
    for size in [64usize, 1024, 16 * 1024] {
        let plain = vec![b'x'; size];
        let mut out = Vec::with_capacity(64 * 1024);
        g.bench_with_input(BenchmarkId::from_parameter(size), &plain, |b, plain| {
            let p = RecvPacket {
                msg_key: "",
                payload: plain,
                ..recv(&[])
            };
            b.iter(|| {
                out.clear();
                jsonrpc::encode_recv(black_box(&p), &mut out);
                black_box(out.len())
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("jsonrpc_send");
    g.throughput(Throughput::Elements(1));
    for size in [64usize, 1024, 16 * 1024] {
        let b64 = base64::engine::general_purpose::STANDARD.encode(vec![b'x'; size]);
        let text = format!(
            r#"{{"method":"send","id":"0c6d2f3e","params":{{"clientMsgNo":"0c6d2f3e-5b7a-4e1c-9d3b-1f2e3d4c5b6a","channelId":"group-000123","channelType":2,"payload":"{b64}","header":{{"redDot":true}}}}}}"#
        );
        let mut rpc = JsonRpc::new(1);
        let connect = br#"{"method":"connect","id":"c","params":{"uid":"u","token":"t"}}"#;
        rpc.decode(connect).unwrap();
        g.bench_with_input(BenchmarkId::from_parameter(size), &text, |b, text| {
            b.iter(|| {
                let got = rpc.decode(black_box(text.as_bytes())).unwrap();
                // Answer it, so the codec's pending bound never fills.
                let proto::jsonrpc::Inbound::Send(s) = &got else {
                    unreachable!()
                };
                let ack = proto::wkproto::SendackPacket {
                    client_seq: s.client_seq,
                    ..Default::default()
                };
                let mut out = Vec::new();
                rpc.encode(&proto::wkproto::Frame::Sendack(ack), &mut out);
                black_box(got)
            })
        });
    }
    g.finish();
}

criterion_group!(benches, codec, crypto, json_rpc);
criterion_main!(benches);
