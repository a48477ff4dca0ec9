//! Golden tests against `tests/data/wkproto-vectors.json` (computed
//! independently with Node.js's crypto) and the JS SDK's CONNECT frames of
//! `docs/wkproto.md` ("Golden bytes"): byte-for-byte decode and re-encode, key
//! agreement, AES, msg_keys, and the crypto error paths.

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use proto::crypto::{
    aes_key_from_secret, decode_client_key, public_key, salt_from_random, server_handshake,
    shared_secret, CryptoError, SessionCipher,
};
use proto::wkproto::{
    decode, decode_connect, ChannelType, ConnackPacket, DecodeError, DeviceFlag, DisconnectPacket,
    Flags, Frame, PacketType, ReasonCode, RecvPacket, RecvackPacket, SendPacket, SendackPacket,
    Setting, MAX_FRAME_BYTES,
};
use serde_json::Value;

const VECTORS: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/wkproto-vectors.json"
));

fn vectors() -> Value {
    serde_json::from_str(VECTORS).expect("vectors file is valid JSON")
}

fn s<'a>(v: &'a Value, path: &[&str]) -> &'a str {
    let mut cur = v;
    for p in path {
        cur = &cur[*p];
    }
    cur.as_str()
        .unwrap_or_else(|| panic!("missing string at {path:?}"))
}

fn n(v: &Value, path: &[&str]) -> u64 {
    let mut cur = v;
    for p in path {
        cur = &cur[*p];
    }
    cur.as_u64()
        .or_else(|| cur.as_str().and_then(|t| t.parse().ok()))
        .unwrap_or_else(|| panic!("missing number at {path:?}"))
}

fn unhex(h: &str) -> Vec<u8> {
    assert!(h.len().is_multiple_of(2), "odd hex length");
    (0..h.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&h[i..i + 2], 16).expect("hex"))
        .collect()
}

fn unhex32(h: &str) -> [u8; 32] {
    unhex(h).try_into().expect("32 bytes")
}

fn b64_32(t: &str) -> [u8; 32] {
    decode_client_key(t).expect("32-byte base64")
}

/// Decodes `bytes` as exactly one frame at `version`.
fn decode_one(bytes: &[u8], version: u8) -> Frame<'_> {
    let (frame, used) = decode(bytes, version, MAX_FRAME_BYTES)
        .expect("valid frame")
        .expect("complete frame");
    assert_eq!(used, bytes.len(), "consumed the whole frame");
    // Every strict prefix is incomplete, never an error.
    for cut in 0..bytes.len() {
        assert_eq!(
            decode(&bytes[..cut], version, MAX_FRAME_BYTES),
            Ok(None),
            "prefix of {cut} bytes"
        );
    }
    frame
}

fn reencode(frame: &Frame<'_>, version: u8) -> Vec<u8> {
    let mut out = vec![0xAA]; // encoding appends: keep a sentinel in front
    let n = frame.encode(version, &mut out).expect("encodable");
    assert_eq!(n, out.len() - 1);
    assert_eq!(frame.encoded_len(version), Ok(n));
    assert_eq!(out[0], 0xAA);
    out.remove(0);
    out
}

const JS_CONNECT_V2: &str = "106702010021663462663331386237656630636238663135366564633665376534336539663957000275310006746f6b2d7531000001a236ad0222002c306b764856304c6743556f3345796b6950786b316f51343676662f366874385041707943427a55702f48733d";
const JS_CONNECT_V5: &str = "106705010021346133636461373261383162353666323432663935393937336239343233663657000275310006746f6b2d7531000001a236ad7a83002c743052775256573642366c626a5a3355316f48716c7638624e6c59527a50735858636638445233787044673d";

#[test]
fn js_sdk_connect_frames_decode_and_reencode() {
    for (hex, version, ts) in [
        (JS_CONNECT_V2, 2u8, 0x0000_01a2_36ad_0222_i64),
        (JS_CONNECT_V5, 5u8, 0x0000_01a2_36ad_7a83_i64),
    ] {
        let bytes = unhex(hex);
        assert_eq!(bytes.len(), 2 + 103);
        let (c, used) = decode_connect(&bytes, MAX_FRAME_BYTES)
            .expect("valid")
            .expect("complete");
        assert_eq!(used, bytes.len());
        assert_eq!(c.flags, Flags::NONE);
        assert_eq!(c.version, version);
        assert_eq!(c.device_flag, DeviceFlag::WEB);
        assert_eq!(c.device_id.len(), 33);
        assert_eq!(c.uid, "u1");
        assert_eq!(c.token, "tok-u1");
        assert_eq!(c.client_timestamp_ms, ts);
        assert_eq!(c.client_key.len(), 44);
        // The key is a real X25519 public key.
        assert!(decode_client_key(c.client_key).is_ok());
        // Any version decodes CONNECT the same; re-encoding is exact.
        for v in 2..=6 {
            assert_eq!(decode_one(&bytes, v), Frame::Connect(c));
            assert_eq!(reencode(&Frame::Connect(c), v), bytes);
        }
    }
    // decode_connect refuses another first frame as soon as it sees it.
    assert_eq!(
        decode_connect(&[0x30], MAX_FRAME_BYTES),
        Err(DecodeError::ExpectedConnect(PacketType::Send))
    );
    assert_eq!(decode_connect(&[0x10, 0x67], MAX_FRAME_BYTES), Ok(None));
}

#[test]
fn vector_frames_decode_to_fields_and_reencode_byte_for_byte() {
    let v = vectors();
    let send_payload = s(&v, &["send", "payload"]);
    let recv_payload = s(&v, &["recv", "payload"]);
    let message_id = n(&v, &["recv", "message_id"]) as i64;
    let message_seq = n(&v, &["recv", "message_seq"]);
    for (name, version) in [("v2", 2u8), ("v3", 3), ("v5", 5), ("v6", 6)] {
        let frames = &v["frames"][name];

        let send = unhex(s(frames, &["send"]));
        let expected = SendPacket {
            flags: Flags::NONE,
            setting: Setting::NONE,
            client_seq: n(&v, &["send", "client_seq"]) as u32,
            client_msg_no: s(&v, &["send", "client_msg_no"]),
            stream_no: "",
            channel_id: s(&v, &["send", "channel_id"]),
            channel_type: ChannelType(n(&v, &["send", "channel_type"]) as u8),
            expire_s: 0,
            msg_key: s(&v, &["send", "msg_key"]),
            topic: "",
            payload: send_payload.as_bytes(),
        };
        let f = decode_one(&send, version);
        assert_eq!(f, Frame::Send(expected), "{name} send");
        assert_eq!(reencode(&f, version), send, "{name} send");

        let sendack = unhex(s(frames, &["sendack"]));
        let expected = SendackPacket {
            flags: Flags::NONE,
            message_id,
            client_seq: 1,
            message_seq,
            reason_code: ReasonCode::SUCCESS,
        };
        let f = decode_one(&sendack, version);
        assert_eq!(f, Frame::Sendack(expected), "{name} sendack");
        assert_eq!(reencode(&f, version), sendack, "{name} sendack");

        let recv = unhex(s(frames, &["recv"]));
        let expected = RecvPacket {
            flags: Flags::NONE,
            setting: Setting::NONE,
            msg_key: s(&v, &["recv", "msg_key"]),
            from_uid: s(&v, &["recv", "from_uid"]),
            channel_id: s(&v, &["recv", "channel_id"]),
            channel_type: ChannelType::PERSON,
            expire_s: 0,
            client_msg_no: s(&v, &["recv", "client_msg_no"]),
            stream_flag: 0,
            stream_no: "",
            stream_id: 0,
            message_id,
            message_seq,
            timestamp_s: n(&v, &["recv", "timestamp"]) as i32,
            topic: "",
            payload: recv_payload.as_bytes(),
        };
        let f = decode_one(&recv, version);
        assert_eq!(f, Frame::Recv(expected), "{name} recv");
        assert_eq!(reencode(&f, version), recv, "{name} recv");

        let recvack = unhex(s(frames, &["recvack"]));
        let expected = RecvackPacket {
            flags: Flags::NONE,
            message_id,
            message_seq,
        };
        let f = decode_one(&recvack, version);
        assert_eq!(f, Frame::Recvack(expected), "{name} recvack");
        assert_eq!(reencode(&f, version), recvack, "{name} recvack");

        let connack = unhex(s(frames, &["connack"]));
        let expected = ConnackPacket {
            flags: Flags::NONE,
            server_version: (version > 3).then_some(version),
            time_diff_ms: 4,
            reason_code: ReasonCode::SUCCESS,
            server_key: s(&v, &["keys", "server_public_b64"]),
            salt: s(&v, &["keys", "salt_iv"]),
            node_id: if version >= 4 { 1001 } else { 0 },
        };
        let f = decode_one(&connack, version);
        assert_eq!(f, Frame::Connack(expected), "{name} connack");
        assert_eq!(reencode(&f, version), connack, "{name} connack");

        for (key, frame) in [("ping", Frame::Ping), ("pong", Frame::Pong)] {
            let bytes = unhex(s(&v, &["frames", "common", key]));
            assert_eq!(decode_one(&bytes, version), frame);
            assert_eq!(reencode(&frame, version), bytes);
        }
        let bytes = unhex(s(&v, &["frames", "common", "disconnect_kick"]));
        let expected = Frame::Disconnect(DisconnectPacket {
            flags: Flags::NONE,
            reason_code: ReasonCode::CONNECT_KICK,
            reason: "login in other device",
        });
        assert_eq!(decode_one(&bytes, version), expected);
        assert_eq!(reencode(&expected, version), bytes);
    }
}

#[test]
fn several_frames_in_one_buffer() {
    let v = vectors();
    let mut buf = Vec::new();
    for key in ["send", "sendack", "recv", "recvack"] {
        buf.extend(unhex(s(&v, &["frames", "v6", key])));
        buf.push(0x70);
    }
    let mut off = 0;
    let mut kinds = Vec::new();
    while let Some((f, used)) = decode(&buf[off..], 6, MAX_FRAME_BYTES).expect("valid") {
        kinds.push(f.packet_type());
        off += used;
    }
    assert_eq!(off, buf.len());
    use PacketType::*;
    assert_eq!(
        kinds,
        [Send, Ping, Sendack, Ping, Recv, Ping, Recvack, Ping]
    );
}

#[test]
fn key_agreement_matches_vectors() {
    let v = vectors();
    let client_private = unhex32(s(&v, &["keys", "client_private_hex"]));
    let server_private = unhex32(s(&v, &["keys", "server_private_hex"]));
    let client_public = b64_32(s(&v, &["keys", "client_public_b64"]));
    let server_public = b64_32(s(&v, &["keys", "server_public_b64"]));
    let secret = b64_32(s(&v, &["keys", "shared_secret_b64"]));

    assert_eq!(public_key(client_private), client_public);
    assert_eq!(public_key(server_private), server_public);
    assert_eq!(shared_secret(server_private, client_public), Ok(secret));
    assert_eq!(shared_secret(client_private, server_public), Ok(secret));
    assert_eq!(
        &aes_key_from_secret(&secret),
        s(&v, &["keys", "aes_key"]).as_bytes()
    );

    // The whole server handshake, with random bytes that map to the salt.
    let salt = s(&v, &["keys", "salt_iv"]);
    let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut random = [0u8; 16];
    for (r, c) in random.iter_mut().zip(salt.bytes()) {
        let idx = alphabet.iter().position(|&a| a == c).expect("alphanumeric") as u8;
        *r = idx + 62; // exercises the modulo
    }
    assert_eq!(&salt_from_random(random), salt.as_bytes());
    let hs = server_handshake(
        s(&v, &["keys", "client_public_b64"]),
        server_private,
        random,
    )
    .expect("valid client key");
    assert_eq!(hs.server_key(), s(&v, &["keys", "server_public_b64"]));
    assert_eq!(hs.salt(), salt);
    let mut out = Vec::new();
    hs.cipher
        .encrypt_into(s(&v, &["send", "plaintext"]).as_bytes(), &mut out);
    assert_eq!(out, s(&v, &["send", "payload"]).as_bytes());
}

fn vector_cipher(v: &Value) -> SessionCipher {
    let key: [u8; 16] = s(v, &["keys", "aes_key"]).as_bytes().try_into().unwrap();
    let iv: [u8; 16] = s(v, &["keys", "salt_iv"]).as_bytes().try_into().unwrap();
    SessionCipher::new(&key, &iv)
}

fn vector_send(v: &Value) -> SendPacket<'_> {
    SendPacket {
        client_seq: n(v, &["send", "client_seq"]) as u32,
        client_msg_no: s(v, &["send", "client_msg_no"]),
        channel_id: s(v, &["send", "channel_id"]),
        channel_type: ChannelType(n(v, &["send", "channel_type"]) as u8),
        msg_key: s(v, &["send", "msg_key"]),
        payload: s(v, &["send", "payload"]).as_bytes(),
        ..SendPacket::default()
    }
}

#[test]
fn send_payload_and_msg_key_match_vectors() {
    let v = vectors();
    let cipher = vector_cipher(&v);
    let plaintext = s(&v, &["send", "plaintext"]).as_bytes();
    let p = vector_send(&v);

    let mut out = b"prefix:".to_vec();
    cipher.encrypt_into(plaintext, &mut out);
    assert_eq!(&out[7..], p.payload);
    assert_eq!(
        SessionCipher::encrypted_len(plaintext.len()),
        p.payload.len()
    );

    assert_eq!(cipher.send_msg_key(&p).as_str(), p.msg_key);
    assert!(cipher.send_msg_key_ok(&p));

    let mut plain = b"x".to_vec();
    cipher.open_send(&p, &mut plain).expect("valid SEND");
    assert_eq!(&plain[1..], plaintext);

    // A changed msg_key, or a field covered by it, is a mismatch (reason 8).
    let mut bad_key = p.msg_key.to_owned();
    bad_key.replace_range(0..1, if bad_key.starts_with('0') { "1" } else { "0" });
    let upper = p.msg_key.to_uppercase();
    for bad in [
        SendPacket {
            msg_key: &bad_key,
            ..p
        },
        SendPacket { msg_key: "", ..p },
        SendPacket {
            msg_key: &upper,
            ..p
        },
        SendPacket {
            client_seq: p.client_seq + 1,
            ..p
        },
        SendPacket {
            channel_id: "u3",
            ..p
        },
        SendPacket {
            channel_type: ChannelType::GROUP,
            ..p
        },
    ] {
        assert!(!cipher.send_msg_key_ok(&bad));
        let mut out = b"keep".to_vec();
        let err = cipher.open_send(&bad, &mut out).unwrap_err();
        assert_eq!(err, CryptoError::MsgKeyMismatch);
        assert_eq!(err.reason_code(), ReasonCode::MSG_KEY_ERROR);
        assert_eq!(out, b"keep");
    }

    // NoEncrypt: the payload is taken as is, msg_key not checked.
    let clear = SendPacket {
        setting: Setting::NO_ENCRYPT,
        msg_key: "",
        payload: plaintext,
        ..p
    };
    let mut out = Vec::new();
    cipher.open_send(&clear, &mut out).expect("NoEncrypt");
    assert_eq!(out, plaintext);
}

#[test]
fn recv_payload_msg_key_and_frames_match_vectors() {
    let v = vectors();
    let cipher = vector_cipher(&v);
    let plaintext = s(&v, &["recv", "plaintext"]).as_bytes();
    for (name, version) in [("v2", 2u8), ("v3", 3), ("v5", 5), ("v6", 6)] {
        let bytes = unhex(s(&v["frames"][name], &["recv"]));
        let Frame::Recv(p) = decode_one(&bytes, version) else {
            panic!("not a RECV");
        };
        assert_eq!(p.msg_key, s(&v, &["recv", "msg_key"]));
        assert_eq!(cipher.recv_msg_key(&p).as_str(), p.msg_key);
        let mut plain = Vec::new();
        cipher.decrypt(p.payload, &mut plain).expect("decrypts");
        assert_eq!(plain, plaintext);

        // encode_recv builds the same frame from the plaintext, ignoring the
        // base's payload and msg_key; appends after existing bytes.
        let base = RecvPacket {
            msg_key: "stale",
            payload: b"stale",
            ..p
        };
        let mut out = Vec::with_capacity(1 + bytes.len());
        out.push(0x70);
        let ptr = out.as_ptr();
        let n = cipher
            .encode_recv(&base, plaintext, version, &mut out)
            .expect("encodable");
        assert_eq!(n, bytes.len());
        assert_eq!(&out[1..], &bytes[..], "{name}");
        assert_eq!(out.as_ptr(), ptr, "no reallocation with enough capacity");

        // NoEncrypt: plaintext payload, msg_key as given, no encryption.
        let clear = RecvPacket {
            setting: Setting::NO_ENCRYPT,
            msg_key: "",
            ..p
        };
        let mut out = Vec::new();
        cipher
            .encode_recv(&clear, plaintext, version, &mut out)
            .expect("encodable");
        let Frame::Recv(got) = decode_one(&out, version) else {
            panic!("not a RECV");
        };
        assert_eq!(got.payload, plaintext);
        assert_eq!(got.msg_key, "");
    }
}

#[test]
fn bad_ciphertexts_are_errors() {
    let v = vectors();
    let cipher = vector_cipher(&v);
    let check = |b64: &[u8], want: CryptoError| {
        let mut out = b"keep".to_vec();
        assert_eq!(cipher.decrypt(b64, &mut out), Err(want), "{b64:?}");
        assert_eq!(out, b"keep", "output unchanged on error");
        assert_eq!(want.reason_code(), ReasonCode::PAYLOAD_DECODE_ERROR);
    };
    check(b"not base64!", CryptoError::BadBase64);
    check(
        b"8voUD/FZ5ZD88gqrzkbfV4Bm95NUrhJ0s69JodXidA0",
        CryptoError::BadBase64,
    ); // no padding
    check(b"", CryptoError::BadLength { len_bytes: 0 });
    check(
        b"AAAAAAAAAAAAAAAAAAAAAAAAAAAA",
        CryptoError::BadLength { len_bytes: 21 },
    );

    // Bad padding: the first block of a two-block ciphertext of 16 x 'A'
    // decrypts to "AAAA…A", whose last byte (65) is no PKCS7 pad length.
    let mut ct_b64 = Vec::new();
    cipher.encrypt_into(&[b'A'; 16], &mut ct_b64);
    let ct = B64.decode(&ct_b64).expect("base64");
    assert_eq!(ct.len(), 32);
    check(B64.encode(&ct[..16]).as_bytes(), CryptoError::BadPadding);
}

#[test]
fn client_key_errors_map_to_connack_reasons() {
    let v = vectors();
    let seed = unhex32(s(&v, &["keys", "server_private_hex"]));
    let cases: [(&str, CryptoError, ReasonCode); 5] = [
        (
            "",
            CryptoError::EmptyClientKey,
            ReasonCode::CLIENT_KEY_IS_EMPTY,
        ),
        (
            "not a key",
            CryptoError::BadClientKey,
            ReasonCode::AUTH_FAIL,
        ),
        // base64 of 31 bytes
        (
            "AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHw==",
            CryptoError::BadClientKey,
            ReasonCode::AUTH_FAIL,
        ),
        // 44 characters that are not base64
        (
            "B6N8vBQgk8i3VdwbEOhstCY3StFqqFPtC9/Asrht!!!=",
            CryptoError::BadClientKey,
            ReasonCode::AUTH_FAIL,
        ),
        // the all-zero point: low order, all-zero shared secret
        (
            "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
            CryptoError::WeakClientKey,
            ReasonCode::AUTH_FAIL,
        ),
    ];
    for (key, err, reason) in cases {
        assert_eq!(
            server_handshake(key, seed, [0; 16]).unwrap_err(),
            err,
            "{key:?}"
        );
        assert_eq!(err.reason_code(), reason);
    }
}

/// One-shot reference: base64(AES-128-CBC-PKCS7(plain)) with the RustCrypto
/// block-mode API directly (no streaming), to check the chunked encoder
/// beyond the short vectors.
fn reference_encrypt(key: &[u8; 16], iv: &[u8; 16], plain: &[u8]) -> String {
    use aes::cipher::{block_padding::Pkcs7, BlockEncryptMut, KeyIvInit};
    let mut ct = vec![0u8; plain.len() + 16];
    let n = cbc::Encryptor::<aes::Aes128>::new(key.into(), iv.into())
        .encrypt_padded_b2b_mut::<Pkcs7>(plain, &mut ct)
        .expect("buffer large enough")
        .len();
    B64.encode(&ct[..n])
}

fn reference_msg_key(key: &[u8; 16], iv: &[u8; 16], sign: &[u8]) -> String {
    use md5::{Digest, Md5};
    let digest = Md5::digest(reference_encrypt(key, iv, sign).as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn streaming_cipher_matches_one_shot_reference() {
    let v = vectors();
    let key: [u8; 16] = s(&v, &["keys", "aes_key"]).as_bytes().try_into().unwrap();
    let iv: [u8; 16] = s(&v, &["keys", "salt_iv"]).as_bytes().try_into().unwrap();
    let cipher = SessionCipher::new(&key, &iv);
    let sizes = (0..=1600).chain([4095, 4096, 16 * 1024, 100_000]);
    let mut out = Vec::new();
    let mut plain_back = Vec::new();
    for size in sizes {
        let plain: Vec<u8> = (0..size).map(|i| (i * 7 + size) as u8).collect();
        out.clear();
        cipher.encrypt_into(&plain, &mut out);
        let want = reference_encrypt(&key, &iv, &plain);
        assert_eq!(out, want.as_bytes(), "size {size}");
        assert_eq!(SessionCipher::encrypted_len(size), out.len());
        plain_back.clear();
        cipher.decrypt(&out, &mut plain_back).expect("decrypts");
        assert_eq!(plain_back, plain, "size {size}");

        if size % 97 == 0 || size > 1600 {
            // SEND msg_key over a long payload.
            let p = SendPacket {
                client_seq: 9,
                client_msg_no: "m",
                channel_id: "g1",
                channel_type: ChannelType::GROUP,
                payload: &out,
                ..SendPacket::default()
            };
            let mut sign = b"9mg12".to_vec();
            sign.extend_from_slice(&out);
            assert_eq!(
                cipher.send_msg_key(&p).as_str(),
                reference_msg_key(&key, &iv, &sign)
            );

            // A whole RECV with a long payload, negative message id.
            let message_id = if size > 1600 { i64::MIN } else { -5 };
            let base = RecvPacket {
                from_uid: "u9",
                channel_id: "g1",
                channel_type: ChannelType::GROUP,
                client_msg_no: "m",
                message_id,
                message_seq: u64::MAX,
                timestamp_s: -1,
                ..RecvPacket::default()
            };
            let mut frame = Vec::new();
            cipher
                .encode_recv(&base, &plain, 6, &mut frame)
                .expect("encodable");
            let (Frame::Recv(got), _) = decode(&frame, 6, usize::MAX).unwrap().unwrap() else {
                panic!("not a RECV");
            };
            assert_eq!(got.payload, out.as_slice());
            let mut sign = format!("{message_id}{}m-1u9g12", u64::MAX).into_bytes();
            sign.extend_from_slice(&out);
            assert_eq!(
                got.msg_key,
                reference_msg_key(&key, &iv, &sign),
                "size {size}"
            );
        }
    }
}
