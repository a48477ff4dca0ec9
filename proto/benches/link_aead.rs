//! Cost of sealing and opening one inter-node frame body (the link's AEAD after
//! the handshake): ChaCha20-Poly1305 against AES-256-GCM (RustCrypto), for bodies
//! of 64 B, 1 KiB and 16 KiB, with the frame's 40-byte header as associated data.
//! One iteration is a seal and an open, in place, with a fresh counter nonce.
//! `link_aead/link` is what a link does per frame: `proto::rpc::seal`'s `Sealer`
//! (header encoded, body copied and sealed into the output buffer) and `Opener`
//! (frame decoded, body copied into its buffer and opened).
//!
//! Run: `cargo bench -p proto --bench link_aead -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use aes_gcm::aead::{AeadInPlace, KeyInit};
use aes_gcm::Aes256Gcm;
use chacha20poly1305::ChaCha20Poly1305;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use proto::rpc::frame::{self, FrameLimits, Header, Kind};
use proto::rpc::seal::{Opener, Sealer};

const SIZES: [usize; 3] = [64, 1024, 16 * 1024];

fn nonce(counter: u64) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&counter.to_le_bytes());
    n
}

fn round_trip<A: AeadInPlace>(seal: &A, open: &A, counter: u64, aad: &[u8], body: &mut [u8]) {
    let n = nonce(counter);
    let n = aes_gcm::aead::Nonce::<A>::from_slice(&n);
    let tag = seal
        .encrypt_in_place_detached(n, aad, body)
        .expect("a frame body fits");
    open.decrypt_in_place_detached(n, aad, body, &tag)
        .expect("the frame just sealed opens");
}

fn bench_one<A: AeadInPlace + KeyInit>(c: &mut Criterion, name: &str) {
    let mut g = c.benchmark_group(format!("link_aead/{name}"));
    let key = [7u8; 32];
    let seal = A::new_from_slice(&key).expect("32-byte key");
    let open = A::new_from_slice(&key).expect("32-byte key");
    let aad = [0x42u8; 40];
    for size in SIZES {
        g.throughput(Throughput::Bytes(size as u64));
        let mut body = vec![0x5au8; size];
        let mut counter = 0u64;
        g.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, _| {
            b.iter(|| {
                counter += 1;
                round_trip(&seal, &open, counter, &aad, black_box(&mut body));
            })
        });
    }
    g.finish();
}

/// The link's own sealer and opener, one frame each way per iteration.
fn bench_link(c: &mut Criterion) {
    let mut g = c.benchmark_group("link_aead/link");
    let (mut sealer, mut opener) = (Sealer::new(&[7; 32]), Opener::new(&[7; 32]));
    let limits = FrameLimits::default();
    let header = Header {
        kind: Kind::Push,
        flags: 0,
        sender_node_id: 1,
        sender_boot_id: 2,
        request_id: 0,
        deadline_ms: 0,
    };
    let mut wire = Vec::new();
    for size in SIZES {
        g.throughput(Throughput::Bytes(size as u64));
        let body = vec![0x5au8; size];
        g.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, _| {
            b.iter(|| {
                wire.clear();
                sealer
                    .seal(&header, black_box(&body), limits, &mut wire)
                    .unwrap();
                let f = frame::decode(&wire, limits).unwrap().unwrap();
                black_box(opener.open(&wire, &f).unwrap());
            })
        });
    }
    g.finish();
}

fn link_aead(c: &mut Criterion) {
    bench_one::<ChaCha20Poly1305>(c, "chacha20poly1305");
    bench_one::<Aes256Gcm>(c, "aes256gcm");
    bench_link(c);
}

criterion_group!(benches, link_aead);
criterion_main!(benches);
