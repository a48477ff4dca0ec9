//! Per-connection key agreement cost (the CONNECT path of an encrypted
//! connection storm) and one encrypted RECV frame, for comparison.
//!
//! Run: `cargo bench -p net --bench crypto -- --warm-up-time 1 --measurement-time 3`
//!
//! - `x25519/public_key`: `proto::crypto::public_key` (fixed-base X25519).
//! - `x25519/shared_secret`: `proto::crypto::shared_secret` (variable-base
//!   X25519 + low-order check).
//! - `handshake/server`: `proto::crypto::server_handshake` (base64 decode,
//!   both of the above, MD5 key derivation, AES key expansion).
//! - `encode_recv/64`: `SessionCipher::encode_recv` of a 64 B payload.
//!
//! Inputs change every iteration (a counter xored into the seed) so no
//! result can be reused; both sides are the same per-iteration work.

use std::hint::black_box;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use proto::crypto::{public_key, server_handshake, shared_secret, SessionCipher};
use proto::wkproto::{ChannelType, RecvPacket};

const VERSION: u8 = 6;

/// A fresh-looking 32-byte seed per iteration.
fn seed(i: u64) -> [u8; 32] {
    let mut s = [0x5au8; 32];
    s[..8].copy_from_slice(&i.to_le_bytes());
    s
}

fn crypto(c: &mut Criterion) {
    let client_public = public_key([0x11; 32]);
    let client_b64 = B64.encode(client_public);

    let mut g = c.benchmark_group("x25519");
    g.throughput(Throughput::Elements(1));
    let mut i = 0u64;
    g.bench_function("public_key", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            black_box(public_key(black_box(seed(i))))
        })
    });
    g.bench_function("shared_secret", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            black_box(shared_secret(black_box(seed(i)), black_box(client_public)))
        })
    });
    g.finish();

    let mut g = c.benchmark_group("handshake");
    g.throughput(Throughput::Elements(1));
    g.bench_function("server", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            let hs = server_handshake(black_box(&client_b64), black_box(seed(i)), [7; 16]);
            black_box(hs.is_ok())
        })
    });
    g.finish();

    let cipher = SessionCipher::new(b"0123456789abcdef", b"ABCDEFGHabcdefgh");
    let plaintext = [b'a'; 64];
    let base = RecvPacket {
        from_uid: "user-000001",
        channel_id: "group-000123",
        channel_type: ChannelType::GROUP,
        client_msg_no: "0c6d2f3e-5b7a-4e1c-9d3b-1f2e3d4c5b6a",
        message_id: 123_456_789_012_345_678,
        message_seq: 7,
        timestamp_s: 1_764_633_600,
        ..RecvPacket::default()
    };
    let mut out = Vec::with_capacity(4096);
    let mut g = c.benchmark_group("encode_recv");
    g.throughput(Throughput::Elements(1));
    g.bench_function("64", |b| {
        b.iter(|| {
            out.clear();
            black_box(&cipher)
                .encode_recv(black_box(&base), black_box(&plaintext), VERSION, &mut out)
                .unwrap();
            black_box(out.len())
        })
    });
    g.finish();
}

criterion_group!(benches, crypto);
criterion_main!(benches);
