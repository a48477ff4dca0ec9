//! The inter-node frame codec (`proto::rpc::frame`): round trips of every header
//! field, truncation byte by byte, seeded garbage (no panic, no allocation, a
//! refusal with a reason), oversized lengths.
//!
//! Seeds: `RPC_TEST_SEED=<u64>` replays a run; every failure message names its seed.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use proto::rpc::frame::{
    decode, encode, FrameError, FrameLimits, Header, Kind, HEADER_BYTES, MAGIC, WIRE_VERSION,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Counts this thread's allocations, so a test can assert the decoder makes none.
struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator unchanged; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

fn seed() -> u64 {
    std::env::var("RPC_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x1313_2026)
}

fn random_header(rng: &mut StdRng) -> Header {
    Header {
        kind: Kind::ALL[rng.gen_range(0..Kind::ALL.len())],
        flags: 0,
        sender_node_id: rng.gen(),
        sender_boot_id: rng.gen(),
        request_id: rng.gen(),
        deadline_ms: rng.gen(),
    }
}

#[test]
fn every_header_field_and_body_round_trips_back_to_back() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let limits = FrameLimits::default();
    let mut out = Vec::new();
    let mut sent = Vec::new();
    for i in 0..500 {
        let header = random_header(&mut rng);
        let body: Vec<u8> = (0..rng.gen_range(0..300)).map(|_| rng.gen()).collect();
        let n = encode(&header, &body, limits, &mut out).unwrap();
        assert_eq!(n, HEADER_BYTES + body.len(), "seed {seed} frame {i}");
        sent.push((header, body));
    }
    // Extremes of every field.
    for v in [0u64, u64::MAX] {
        let header = Header {
            kind: Kind::Reply,
            flags: 0,
            sender_node_id: v,
            sender_boot_id: v,
            request_id: v,
            deadline_ms: v as u32,
        };
        encode(&header, b"", limits, &mut out).unwrap();
        sent.push((header, Vec::new()));
    }
    let mut off = 0;
    for (i, (header, body)) in sent.iter().enumerate() {
        let frame = decode(&out[off..], limits)
            .unwrap_or_else(|e| panic!("seed {seed} frame {i}: {e}"))
            .unwrap_or_else(|| panic!("seed {seed} frame {i}: incomplete"));
        assert_eq!(frame.header, *header, "seed {seed} frame {i}");
        assert_eq!(frame.body, &body[..], "seed {seed} frame {i}");
        off += frame.wire_len();
    }
    assert_eq!(off, out.len(), "seed {seed}");
    assert_eq!(decode(&out[off..], limits), Ok(None));
}

#[test]
fn a_truncated_frame_is_incomplete_at_every_byte_then_whole() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let limits = FrameLimits::default();
    for round in 0..20 {
        let header = random_header(&mut rng);
        let body: Vec<u8> = (0..rng.gen_range(0..100)).map(|_| rng.gen()).collect();
        let mut out = Vec::new();
        encode(&header, &body, limits, &mut out).unwrap();
        for len in 0..out.len() {
            assert_eq!(
                decode(&out[..len], limits),
                Ok(None),
                "seed {seed} round {round}: prefix of {len} of {} bytes",
                out.len()
            );
        }
        let frame = decode(&out, limits).unwrap().unwrap();
        assert_eq!(
            (frame.header, frame.body),
            (header, &body[..]),
            "seed {seed}"
        );
    }
}

/// Random bytes; half of them behind a valid magic and version, and half of
/// those with a valid kind and no flags too (to reach the kind, flags and length
/// checks), some of those with a small length.
fn garbage(rng: &mut StdRng) -> Vec<u8> {
    let mut buf: Vec<u8> = (0..rng.gen_range(0..120)).map(|_| rng.gen()).collect();
    if rng.gen_bool(0.5) && buf.len() >= HEADER_BYTES {
        buf[..4].copy_from_slice(&MAGIC);
        buf[4] = WIRE_VERSION;
        if rng.gen_bool(0.5) {
            buf[5] = Kind::ALL[rng.gen_range(0..Kind::ALL.len())] as u8;
            buf[6..8].fill(0);
            if rng.gen_bool(0.3) {
                let body_len: u32 = rng.gen_range(0..200);
                buf[36..40].copy_from_slice(&body_len.to_le_bytes());
            }
        }
    }
    buf
}

#[test]
fn garbage_never_panics_never_allocates_and_is_refused_with_a_reason() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let limits = FrameLimits {
        rpc_frame_bytes_max: 64 << 10,
    };
    let before = allocations();
    std::hint::black_box(Box::new(seed));
    assert!(allocations() > before, "the allocation counter counts");
    let (mut refused, mut incomplete, mut whole) = (0, 0, 0);
    for i in 0..20_000 {
        let buf = garbage(&mut rng);
        let before = allocations();
        let result = decode(&buf, limits);
        assert_eq!(
            allocations(),
            before,
            "seed {seed} input {i}: decode allocated"
        );
        match result {
            Err(e) => {
                assert!(!e.to_string().is_empty());
                refused += 1;
            }
            Ok(None) if buf.len() < HEADER_BYTES => incomplete += 1,
            Ok(None) => {
                // Waiting for the body: only ever for a frame within the limit,
                // so a caller buffering until it is whole stays under it.
                let body_len = u32::from_le_bytes(buf[36..40].try_into().unwrap()) as usize;
                assert!(
                    HEADER_BYTES + body_len <= limits.rpc_frame_bytes_max,
                    "seed {seed} input {i}"
                );
                incomplete += 1;
            }
            Ok(Some(frame)) => {
                assert!(frame.wire_len() <= buf.len(), "seed {seed} input {i}");
                whole += 1;
            }
        }
    }
    assert!(refused > 5_000, "seed {seed}: only {refused} refusals");
    assert!(
        incomplete > 0 && whole > 0,
        "seed {seed}: {incomplete} incomplete, {whole} whole"
    );
}

fn valid_header_bytes() -> Vec<u8> {
    let mut out = Vec::new();
    let header = Header {
        kind: Kind::Hello,
        flags: 0,
        sender_node_id: 1,
        sender_boot_id: 2,
        request_id: 3,
        deadline_ms: 4,
    };
    encode(&header, b"", FrameLimits::default(), &mut out).unwrap();
    out
}

#[test]
fn each_bad_field_is_refused_with_its_own_reason() {
    let limits = FrameLimits::default();
    let mut bad = valid_header_bytes();
    bad[0] = b'X';
    assert_eq!(decode(&bad, limits), Err(FrameError::BadMagic(*b"XMRN")));
    // Version 1 (before the handshake carried the cluster terms) and the next one.
    for version in [1, WIRE_VERSION + 1] {
        let mut bad = valid_header_bytes();
        bad[4] = version;
        let err = decode(&bad, limits);
        assert_eq!(err, Err(FrameError::UnsupportedVersion(version)));
    }
    for kind in [0u8, 7, 15, 63, 65, 255] {
        let mut bad = valid_header_bytes();
        bad[5] = kind;
        assert_eq!(decode(&bad, limits), Err(FrameError::UnknownKind(kind)));
    }
    let mut bad = valid_header_bytes();
    bad[7] = 0x80;
    assert_eq!(decode(&bad, limits), Err(FrameError::UnknownFlags(0x8000)));
    let err = decode(&[0u8; HEADER_BYTES], limits).unwrap_err();
    assert!(err.to_string().contains("magic"), "{err}");
}

#[test]
fn an_oversized_length_is_refused_from_the_header_alone() {
    let limits = FrameLimits::default();
    let max = limits.rpc_frame_bytes_max;
    for body_len in [(max - HEADER_BYTES + 1) as u32, u32::MAX] {
        let mut head = valid_header_bytes();
        head[36..40].copy_from_slice(&body_len.to_le_bytes());
        assert_eq!(
            decode(&head, limits),
            Err(FrameError::TooLarge {
                frame_bytes: HEADER_BYTES + body_len as usize,
                bytes_max: max
            })
        );
    }
    // Exactly at the limit: waits for the body.
    let mut head = valid_header_bytes();
    head[36..40].copy_from_slice(&((max - HEADER_BYTES) as u32).to_le_bytes());
    assert_eq!(decode(&head, limits), Ok(None));
}
