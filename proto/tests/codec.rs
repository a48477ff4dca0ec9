//! Codec behaviour: error cases, varint edges, and deterministic property
//! tests (round trip of every packet at every version 2..=6, frames split
//! across reads, and random bytes / mutated frames never panicking).
//!
//! Seeds: `NET_PROP_SEED` (default 0x77b9_2026) seeds the proptest runner;
//! `NET_PROP_CASES` sets the case count (default 256). The seed in use is
//! printed (shown on failure).

use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};
use proto::wkproto::{
    decode, decode_connect, peek_frame_len, varint_len, ChannelType, ConnackPacket, ConnectPacket,
    DecodeError, DeviceFlag, DisconnectPacket, EncodeError, Flags, Frame, PacketType, ReasonCode,
    RecvPacket, RecvackPacket, SendPacket, SendackPacket, Setting, SubPacket, SubackPacket,
    MAX_FRAME_BYTES, MAX_STRING_BYTES, MAX_VARINT_VALUE,
};

const DEFAULT_SEED: u64 = 0x77b9_2026;

fn config() -> Config {
    let seed = std::env::var("NET_PROP_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SEED);
    eprintln!("NET_PROP_SEED={seed}");
    let cases = std::env::var("NET_PROP_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(256);
    Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        ..Config::default()
    }
}

// ---------------------------------------------------------------------------
// Deterministic error cases

fn dec(buf: &[u8]) -> Result<Option<(Frame<'_>, usize)>, DecodeError> {
    decode(buf, 6, MAX_FRAME_BYTES)
}

#[test]
fn header_errors() {
    assert_eq!(dec(&[]), Ok(None));
    assert_eq!(dec(&[0x00, 0x00]), Err(DecodeError::UnknownPacketType(0)));
    for t in 13..=15u8 {
        assert_eq!(dec(&[t << 4]), Err(DecodeError::UnknownPacketType(t)));
    }
    assert_eq!(
        dec(&[0xc0, 0x01, 0x00]),
        Err(DecodeError::UnsupportedPacket(PacketType::Event))
    );
    let msg = DecodeError::UnsupportedPacket(PacketType::Event).to_string();
    assert!(msg.contains("EVENT"), "{msg}");
}

#[test]
fn varint_limits() {
    // Incomplete varints wait for more bytes.
    assert_eq!(dec(&[0x30]), Ok(None));
    assert_eq!(dec(&[0x30, 0xff, 0xff, 0xff]), Ok(None));
    // A continuation bit in the 4th byte: longer than 4 bytes.
    assert_eq!(
        dec(&[0x30, 0xff, 0xff, 0xff, 0xff]),
        Err(DecodeError::VarintTooLong)
    );
    assert_eq!(
        decode(&[0x30, 0x80, 0x80, 0x80, 0x80, 0x01], 6, usize::MAX),
        Err(DecodeError::VarintTooLong)
    );
    // The largest 4-byte value is accepted when the limit allows it.
    assert_eq!(
        peek_frame_len(&[0x30, 0xff, 0xff, 0xff, 0x7f], usize::MAX),
        Ok(Some(5 + MAX_VARINT_VALUE))
    );
    // The limit is checked before the body arrives: exactly 1 MiB is fine,
    // one more byte is not.
    let one_mib = [0x30, 0x80, 0x80, 0x40];
    assert_eq!(
        peek_frame_len(&one_mib, MAX_FRAME_BYTES),
        Ok(Some(4 + (1 << 20)))
    );
    assert_eq!(dec(&one_mib), Ok(None));
    assert_eq!(
        dec(&[0x30, 0x81, 0x80, 0x40]),
        Err(DecodeError::FrameTooLarge {
            len_bytes: (1 << 20) + 1,
            bytes_max: MAX_FRAME_BYTES
        })
    );
    assert_eq!(
        decode(&[0x40, 0x11], 6, 16),
        Err(DecodeError::FrameTooLarge {
            len_bytes: 17,
            bytes_max: 16
        })
    );
    // PING and PONG have no length.
    assert_eq!(peek_frame_len(&[0x70], 0), Ok(Some(1)));
    assert_eq!(dec(&[0x80, 0x70]), Ok(Some((Frame::Pong, 1))));
    // Flags on PING are ignored.
    assert_eq!(dec(&[0x7f]), Ok(Some((Frame::Ping, 1))));
    // varint_len: length 0 is no bytes at all.
    let lens = [
        0,
        1,
        127,
        128,
        16383,
        16384,
        2_097_151,
        2_097_152,
        MAX_VARINT_VALUE,
    ];
    let want = [0, 1, 1, 2, 2, 3, 3, 4, 4];
    for (l, w) in lens.into_iter().zip(want) {
        assert_eq!(varint_len(l), w, "{l}");
    }
}

#[test]
fn body_errors() {
    use DecodeError::*;
    // Zero remaining length on a packet with fields.
    assert_eq!(
        dec(&[0x90, 0x00]),
        Err(Truncated {
            packet: PacketType::Disconnect,
            field: "reason_code",
            need_bytes: 1,
            left_bytes: 0
        })
    );
    assert_eq!(
        dec(&[0x40, 0x02, 0, 0]),
        Err(Truncated {
            packet: PacketType::Sendack,
            field: "message_id",
            need_bytes: 8,
            left_bytes: 2
        })
    );
    // v6 SENDACK needs a u64 message_seq; a v5-sized body is truncated.
    let v5 = [0x40, 17, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3, 1];
    assert!(matches!(
        decode(&v5, 5, MAX_FRAME_BYTES),
        Ok(Some((Frame::Sendack(_), 19)))
    ));
    assert_eq!(
        decode(&v5, 6, MAX_FRAME_BYTES),
        Err(Truncated {
            packet: PacketType::Sendack,
            field: "message_seq",
            need_bytes: 8,
            left_bytes: 5
        })
    );
    assert_eq!(
        dec(&[0x90, 0x03, 0x0c, 0x00, 0x05]),
        Err(StringPastBody {
            packet: PacketType::Disconnect,
            field: "reason",
            len_bytes: 5,
            left_bytes: 0
        })
    );
    // The string length lies past the body even though the buffer holds
    // more bytes (the next frame): bounded by the body, not the buffer.
    assert_eq!(
        dec(&[0x90, 0x04, 0x0c, 0x00, 0x02, b'a', 0x70]),
        Err(StringPastBody {
            packet: PacketType::Disconnect,
            field: "reason",
            len_bytes: 2,
            left_bytes: 1
        })
    );
    assert_eq!(
        dec(&[0x90, 0x03, 0x0c, 0x80, 0x00]),
        Err(NegativeStringLength {
            packet: PacketType::Disconnect,
            field: "reason",
            len: i16::MIN
        })
    );
    assert_eq!(
        dec(&[0x90, 0x04, 0x0c, 0x00, 0x01, 0xff]),
        Err(InvalidUtf8 {
            packet: PacketType::Disconnect,
            field: "reason"
        })
    );
    // Trailing bytes after the last field of a payload-less packet are
    // consumed and ignored.
    assert_eq!(
        dec(&[0x90, 0x05, 0x0c, 0x00, 0x00, 0xde, 0xad, 0x70]),
        Ok(Some((
            Frame::Disconnect(DisconnectPacket {
                flags: Flags::NONE,
                reason_code: ReasonCode::CONNECT_KICK,
                reason: ""
            }),
            7
        )))
    );
    for e in [
        UnknownPacketType(0),
        VarintTooLong,
        FrameTooLarge {
            len_bytes: 2,
            bytes_max: 1,
        },
        ExpectedConnect(PacketType::Ping),
    ] {
        assert!(!e.to_string().is_empty());
    }
}

#[test]
fn encode_errors_leave_output_unchanged() {
    let long = "x".repeat(MAX_STRING_BYTES + 1);
    let max = "x".repeat(MAX_STRING_BYTES);
    let mut out = b"keep".to_vec();
    let p = SendPacket {
        channel_id: &long,
        ..SendPacket::default()
    };
    assert_eq!(
        p.encode(6, &mut out),
        Err(EncodeError::StringTooLong {
            packet: PacketType::Send,
            field: "channel_id",
            len_bytes: MAX_STRING_BYTES + 1
        })
    );
    assert_eq!(out, b"keep");
    // 32767 bytes is the longest string and round-trips.
    let p = SendPacket {
        channel_id: &max,
        ..SendPacket::default()
    };
    out.clear();
    p.encode(6, &mut out).expect("max string");
    assert_eq!(dec(&out), Ok(Some((Frame::Send(p), out.len()))));

    let ack = SendackPacket {
        message_seq: u64::from(u32::MAX) + 1,
        ..SendackPacket::default()
    };
    out = b"keep".to_vec();
    assert_eq!(
        ack.encode(5, &mut out),
        Err(EncodeError::MessageSeqTooLarge {
            packet: PacketType::Sendack,
            message_seq: u64::from(u32::MAX) + 1,
            version: 5
        })
    );
    assert_eq!(out, b"keep");
    assert!(ack.encode(6, &mut out).is_ok());

    let huge = vec![0u8; MAX_VARINT_VALUE];
    let p = RecvPacket {
        payload: &huge,
        ..RecvPacket::default()
    };
    out = b"keep".to_vec();
    assert!(matches!(
        p.encode(6, &mut out),
        Err(EncodeError::FrameTooLarge {
            packet: PacketType::Recv,
            ..
        })
    ));
    assert_eq!(out, b"keep");
}

#[test]
fn large_frames_use_long_varints() {
    for (payload_len, header_bytes) in [(20_000usize, 4usize), (2_200_000, 5)] {
        let payload = vec![7u8; payload_len];
        let p = RecvPacket {
            payload: &payload,
            ..RecvPacket::default()
        };
        let mut out = Vec::new();
        let n = p.encode(6, &mut out).expect("encodable");
        assert_eq!(n, out.len());
        let body = n - header_bytes;
        assert_eq!(varint_len(body) + 1, header_bytes);
        assert_eq!(peek_frame_len(&out, 4 << 20), Ok(Some(n)));
        assert_eq!(decode(&out, 6, 4 << 20), Ok(Some((Frame::Recv(p), n))));
        if body > MAX_FRAME_BYTES {
            assert!(matches!(dec(&out), Err(DecodeError::FrameTooLarge { .. })));
        }
    }
}

#[test]
fn connack_server_version_flag() {
    let p = ConnackPacket {
        flags: Flags::DUP.with(Flags::HAS_SERVER_VERSION),
        server_version: None,
        node_id: 9,
        ..ConnackPacket::default()
    };
    let mut out = Vec::new();
    p.encode(5, &mut out).expect("encodable");
    // No server version: flag cleared, node_id follows the connection's v5.
    assert_eq!(out[0], 0x28);
    let (f, _) = decode(&out, 5, MAX_FRAME_BYTES).unwrap().unwrap();
    assert_eq!(
        f,
        Frame::Connack(ConnackPacket {
            flags: Flags::DUP,
            ..p
        })
    );
    // With a server version the flag is set and that version decides node_id.
    let p = ConnackPacket {
        server_version: Some(3),
        ..ConnackPacket::default()
    };
    out.clear();
    p.encode(6, &mut out).expect("encodable");
    assert_eq!(out[0], 0x21);
    assert_eq!(out.len(), 2 + 1 + 8 + 1 + 2 + 2);
}

#[test]
fn decode_connect_rejects_other_first_frames() {
    assert_eq!(decode_connect(&[], MAX_FRAME_BYTES), Ok(None));
    assert_eq!(
        decode_connect(&[0x70], MAX_FRAME_BYTES),
        Err(DecodeError::ExpectedConnect(PacketType::Ping))
    );
    assert_eq!(
        decode_connect(&[0x00], MAX_FRAME_BYTES),
        Err(DecodeError::UnknownPacketType(0))
    );
    let c = ConnectPacket {
        version: 0,
        device_flag: DeviceFlag::SYSTEM,
        uid: "ü",
        ..ConnectPacket::default()
    };
    let mut out = Vec::new();
    c.encode(2, &mut out).unwrap();
    out.push(0x70);
    assert_eq!(
        decode_connect(&out, MAX_FRAME_BYTES),
        Ok(Some((c, out.len() - 1)))
    );
}

// ---------------------------------------------------------------------------
// Property tests

/// Owned field values from which every packet type is built.
#[derive(Clone, Debug)]
struct Fields {
    strs: Vec<String>,
    payload: Vec<u8>,
    nums: [u64; 16],
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => "\\PC{0,12}",
        1 => "[a-z]{100,300}",
        1 => Just(String::new()),
    ]
}

fn fields() -> impl Strategy<Value = Fields> {
    (
        proptest::collection::vec(text(), 8),
        proptest::collection::vec(any::<u8>(), 0..400),
        any::<[u64; 16]>(),
    )
        .prop_map(|(strs, payload, nums)| Fields {
            strs,
            payload,
            nums,
        })
}

/// Every packet type, with the fields absent at `v` (or for the setting)
/// set to the decoder's defaults so that decode(encode(p)) == p.
fn packets(f: &Fields, v: u8) -> Vec<Frame<'_>> {
    let s = |i: usize| f.strs[i].as_str();
    let n = f.nums;
    let flags = Flags(n[0] as u8 & Flags::MASK);
    let setting = Setting((n[0] >> 8) as u8);
    let seq = if v >= 6 {
        n[1]
    } else {
        n[1] & u64::from(u32::MAX)
    };
    let stream = (2..5).contains(&v) && setting.contains(Setting::STREAM);
    let topic = setting.contains(Setting::TOPIC);
    let expire = if v >= 3 { n[2] as u32 } else { 0 };
    let server_version = (n[3] & 1 == 1).then_some((n[3] >> 8) as u8);
    let effective = server_version.unwrap_or(v);
    vec![
        Frame::Connect(ConnectPacket {
            flags,
            version: n[4] as u8,
            device_flag: DeviceFlag((n[4] >> 8) as u8),
            device_id: s(0),
            uid: s(1),
            token: s(2),
            client_timestamp_ms: n[5] as i64,
            client_key: s(3),
        }),
        Frame::Connack(ConnackPacket {
            flags: flags.without(Flags::HAS_SERVER_VERSION),
            server_version,
            time_diff_ms: n[6] as i64,
            reason_code: ReasonCode((n[6] >> 8) as u8),
            server_key: s(4),
            salt: s(5),
            node_id: if effective >= 4 { n[7] } else { 0 },
        }),
        Frame::Send(SendPacket {
            flags,
            setting,
            client_seq: n[8] as u32,
            client_msg_no: s(0),
            stream_no: if stream { s(1) } else { "" },
            channel_id: s(2),
            channel_type: ChannelType((n[8] >> 32) as u8),
            expire_s: expire,
            msg_key: s(3),
            topic: if topic { s(4) } else { "" },
            payload: &f.payload,
        }),
        Frame::Sendack(SendackPacket {
            flags,
            message_id: n[9] as i64,
            client_seq: n[8] as u32,
            message_seq: seq,
            reason_code: ReasonCode((n[9] >> 16) as u8),
        }),
        Frame::Recv(RecvPacket {
            flags,
            setting,
            msg_key: s(5),
            from_uid: s(6),
            channel_id: s(7),
            channel_type: ChannelType((n[10] >> 40) as u8),
            expire_s: expire,
            client_msg_no: s(0),
            stream_flag: if stream { n[10] as u8 } else { 0 },
            stream_no: if stream { s(1) } else { "" },
            stream_id: if stream { n[11] } else { 0 },
            message_id: n[9] as i64,
            message_seq: seq,
            timestamp_s: n[12] as i32,
            topic: if topic { s(2) } else { "" },
            payload: &f.payload,
        }),
        Frame::Recvack(RecvackPacket {
            flags,
            message_id: n[9] as i64,
            message_seq: seq,
        }),
        Frame::Ping,
        Frame::Pong,
        Frame::Disconnect(DisconnectPacket {
            flags,
            reason_code: ReasonCode(n[13] as u8),
            reason: s(3),
        }),
        Frame::Sub(SubPacket {
            flags,
            setting: (n[13] >> 8) as u8,
            sub_no: s(4),
            channel_id: s(5),
            channel_type: ChannelType((n[13] >> 16) as u8),
            action: (n[13] >> 24) as u8,
            param: s(6),
        }),
        Frame::Suback(SubackPacket {
            flags,
            sub_no: s(7),
            channel_id: s(0),
            channel_type: ChannelType(n[14] as u8),
            action: (n[14] >> 8) as u8,
            reason_code: ReasonCode((n[14] >> 16) as u8),
        }),
    ]
}

/// Decodes every frame of `buf`, re-encoding each into `out`; stops at the
/// first error or incomplete frame and returns the bytes consumed.
fn decode_all(buf: &[u8], v: u8, max: usize, out: &mut Vec<u8>) -> Result<usize, TestCaseError> {
    let mut off = 0;
    loop {
        match decode(&buf[off..], v, max) {
            Ok(Some((frame, used))) => {
                prop_assert!(used >= 1 && used <= buf.len() - off);
                // Anything decoded re-encodes, and decodes to itself.
                let at = out.len();
                let n = frame
                    .encode(v, out)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(n, out.len() - at);
                let again = decode(&out[at..], v, usize::MAX);
                prop_assert_eq!(again, Ok(Some((frame, n))));
                off += used;
            }
            Ok(None) => return Ok(off),
            Err(e) => {
                prop_assert!(!e.to_string().is_empty());
                return Ok(off);
            }
        }
    }
}

/// A mutation of a valid byte stream.
#[derive(Clone, Debug)]
enum Mutation {
    FlipBit(usize, u8),
    Truncate(usize),
    Insert(usize, u8),
    Remove(usize, usize),
    Set(usize, u8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(i, b)| Mutation::FlipBit(i, b)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        (any::<usize>(), 1usize..8).prop_map(|(i, n)| Mutation::Remove(i, n)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
    ]
}

fn apply(buf: &mut Vec<u8>, m: &Mutation) {
    let len = buf.len();
    match *m {
        Mutation::FlipBit(i, b) if len > 0 => buf[i % len] ^= 1 << b,
        Mutation::Truncate(i) => buf.truncate(i % (len + 1)),
        Mutation::Insert(i, b) => buf.insert(i % (len + 1), b),
        Mutation::Remove(i, n) if len > 0 => {
            let at = i % len;
            buf.drain(at..(at + n).min(len));
        }
        Mutation::Set(i, b) if len > 0 => buf[i % len] = b,
        _ => {}
    }
}

proptest! {
    #![proptest_config(config())]

    /// Every packet at every version 2..=6 encodes, decodes to itself and
    /// re-encodes to the same bytes; all prefixes are incomplete.
    #[test]
    fn round_trip_every_packet(f in fields(), v in 2u8..=6) {
        for p in packets(&f, v) {
            let mut out = vec![0xEE];
            let n = p.encode(v, &mut out).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(n, out.len() - 1);
            prop_assert_eq!(p.encoded_len(v), Ok(n));
            let bytes = &out[1..];
            prop_assert_eq!(peek_frame_len(bytes, MAX_FRAME_BYTES), Ok(Some(n)));
            let got = decode(bytes, v, MAX_FRAME_BYTES);
            prop_assert_eq!(got, Ok(Some((p, n))), "{}", p.packet_type());
            // With the capacity there, encoding does not reallocate.
            let mut again = Vec::with_capacity(n);
            let ptr = again.as_ptr();
            p.encode(v, &mut again).unwrap();
            prop_assert_eq!(&again[..], bytes);
            prop_assert_eq!(again.as_ptr(), ptr);
            prop_assert_eq!(again.capacity(), n);
            for cut in [0, 1, n / 2, n - 1] {
                if cut < n {
                    prop_assert_eq!(decode(&bytes[..cut], v, MAX_FRAME_BYTES), Ok(None));
                }
            }
        }
    }

    /// A stream of every packet, delivered in reads of random sizes into a
    /// receive buffer driven as the module docs say, yields the same frames.
    #[test]
    fn frames_split_across_reads(
        f in fields(),
        v in 2u8..=6,
        reads in proptest::collection::vec(1usize..64, 1..64),
    ) {
        let mut stream = Vec::new();
        for p in packets(&f, v) {
            p.encode(v, &mut stream).unwrap();
        }
        let mut rx = Vec::new();
        let mut out = Vec::new();
        let mut pos = 0;
        let mut r = reads.iter().cycle();
        while pos < stream.len() {
            let n = (*r.next().unwrap()).min(stream.len() - pos);
            rx.extend_from_slice(&stream[pos..pos + n]);
            pos += n;
            let used = decode_all(&rx, v, MAX_FRAME_BYTES, &mut out)?;
            rx.drain(..used);
        }
        prop_assert!(rx.is_empty());
        prop_assert_eq!(out, stream);
    }

    /// Mutated valid streams: errors or valid frames only, never a panic,
    /// never more consumed than given.
    #[test]
    fn mutated_frames_never_panic(
        f in fields(),
        v in 2u8..=6,
        decode_v in prop_oneof![2u8..=6, any::<u8>()],
        max in prop_oneof![Just(MAX_FRAME_BYTES), 0usize..600],
        muts in proptest::collection::vec(mutation(), 1..6),
    ) {
        let mut buf = Vec::new();
        for p in packets(&f, v) {
            p.encode(v, &mut buf).unwrap();
        }
        for m in &muts {
            apply(&mut buf, m);
        }
        let mut out = Vec::new();
        let mut off = 0;
        // Restart after each error at the next byte to reach deeper frames.
        while off < buf.len() {
            let used = decode_all(&buf[off..], decode_v, max, &mut out)?;
            off += used.max(1);
        }
        let _ = decode_connect(&buf, max);
    }

    /// Random bytes: errors or valid frames only.
    #[test]
    fn random_bytes_never_panic(
        buf in proptest::collection::vec(any::<u8>(), 0..512),
        v in any::<u8>(),
    ) {
        let mut out = Vec::new();
        let used = decode_all(&buf, v, MAX_FRAME_BYTES, &mut out)?;
        prop_assert!(used <= buf.len());
        if let Ok(Some(n)) = peek_frame_len(&buf, MAX_FRAME_BYTES) {
            prop_assert!(n >= 1);
        }
        let _ = decode_connect(&buf, MAX_FRAME_BYTES);
    }
}
