//! Per-connection encryption of the WuKongIM protocol (spec: "Encryption"
//! in `shared/spec/wkproto.md`), sans-IO and deterministic: the caller
//! supplies the random bytes.
//!
//! # Handshake (on CONNECT)
//! [`server_handshake`]`(connect.client_key, seed, salt_random)` with a fresh
//! 32-byte random `seed` (the server's X25519 private key for this
//! connection) and 16 random bytes for the salt returns the connection's
//! [`SessionCipher`] plus the `server_key` and `salt` strings for CONNACK.
//! Its errors map to CONNACK reason codes via [`CryptoError::reason_code`]
//! (empty key → 21, anything else → 2); then close the connection.
//!
//! Derivation: `secret = X25519(server_private, client_public)`;
//! `aes_key` = first 16 chars of lowercase hex `MD5(base64(secret))` as
//! ASCII bytes; `iv = salt` (16 chars of `[A-Za-z0-9]`), the same for every
//! packet of the connection. Cipher: AES-128-CBC, PKCS7, base64 text.
//!
//! # Per packet
//! - SEND in: [`SessionCipher::open_send`] verifies msg_key, then decrypts
//!   (NoEncrypt: copies the payload). Mismatch → SENDACK reason 8, bad
//!   payload → 9, both via [`CryptoError::reason_code`]; neither closes.
//! - RECV out: [`SessionCipher::encode_recv`] encrypts the plaintext
//!   straight into the output frame, computes msg_key and patches it in
//!   (NoEncrypt: encodes the plaintext as is). No allocation once the output
//!   buffer has the capacity, no scratch buffer.
//!
//! All buffer APIs append to a caller-owned `Vec<u8>` and leave it as it
//! was on error. Nothing here panics on any input.

use aes::cipher::block_padding::Pkcs7;
use aes::cipher::consts::U16;
use aes::cipher::generic_array::GenericArray;
use aes::cipher::inout::InOutBuf;
use aes::cipher::{BlockDecryptMut, BlockEncryptMut, InnerIvInit, KeyInit};
use aes::{Aes128Dec, Aes128Enc};
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use md5::{Digest, Md5};
use x25519_dalek::{PublicKey, StaticSecret};

use crate::wkproto::{EncodeError, ReasonCode, RecvPacket, SendPacket, Setting};

/// Bytes of an X25519 key (public, private, shared secret).
pub const KEY_BYTES: usize = 32;
/// Characters of a base64 X25519 public key (with padding).
pub const KEY_B64_BYTES: usize = 44;
/// Bytes of the AES key (16 ASCII hex characters).
pub const AES_KEY_BYTES: usize = 16;
/// Characters of the salt, which is also the AES IV.
pub const SALT_BYTES: usize = 16;
/// Characters of a msg_key (lowercase hex MD5).
pub const MSG_KEY_BYTES: usize = 32;
/// AES block size.
const BLOCK_BYTES: usize = 16;
/// Streaming chunk: a multiple of 16 (AES blocks) and of 3 (base64 groups
/// without padding), so chunk encodings concatenate to the whole encoding.
const CHUNK_BYTES: usize = 48 * 16;
const CHUNK_B64_BYTES: usize = CHUNK_BYTES / 3 * 4;

const SALT_ALPHABET: &[u8; 62] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
const HEX: &[u8; 16] = b"0123456789abcdef";

/// Why a key, ciphertext or msg_key was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CryptoError {
    /// CONNECT carried an empty `client_key`.
    #[error("client key is empty")]
    EmptyClientKey,
    /// `client_key` is not standard base64 of exactly 32 bytes.
    #[error("client key is not base64 of a 32-byte X25519 public key")]
    BadClientKey,
    /// The client key is a low-order point: the shared secret would be all
    /// zeros (no contribution from the server's key).
    #[error("client key is a low-order point (non-contributory key agreement)")]
    WeakClientKey,
    /// SEND msg_key does not match the one computed from its fields.
    #[error("msg_key does not match")]
    MsgKeyMismatch,
    /// The payload is not standard (padded) base64.
    #[error("payload is not valid base64")]
    BadBase64,
    /// The decoded ciphertext is empty or not a multiple of 16 bytes.
    #[error("ciphertext of {len_bytes} bytes is not a positive multiple of 16")]
    BadLength {
        /// Decoded ciphertext length.
        len_bytes: usize,
    },
    /// The decrypted data does not end in valid PKCS7 padding.
    #[error("bad PKCS7 padding")]
    BadPadding,
}

impl CryptoError {
    /// The reason code the gateway answers with: CONNACK 21 for an empty
    /// client key, CONNACK 2 for any other key error, SENDACK 8 for a
    /// msg_key mismatch, SENDACK 9 for an undecryptable payload.
    pub const fn reason_code(self) -> ReasonCode {
        match self {
            Self::EmptyClientKey => ReasonCode::CLIENT_KEY_IS_EMPTY,
            Self::BadClientKey | Self::WeakClientKey => ReasonCode::AUTH_FAIL,
            Self::MsgKeyMismatch => ReasonCode::MSG_KEY_ERROR,
            Self::BadBase64 | Self::BadLength { .. } | Self::BadPadding => {
                ReasonCode::PAYLOAD_DECODE_ERROR
            }
        }
    }
}

/// Decodes CONNECT's `client_key` (standard base64 with padding of a
/// 32-byte X25519 public key).
pub fn decode_client_key(client_key_b64: &str) -> Result<[u8; KEY_BYTES], CryptoError> {
    if client_key_b64.is_empty() {
        return Err(CryptoError::EmptyClientKey);
    }
    let mut key = [0u8; KEY_BYTES];
    // A valid key is exactly 44 characters; anything else cannot decode to
    // 32 bytes, and checking first keeps decode_slice's output bound.
    if client_key_b64.len() != KEY_B64_BYTES {
        return Err(CryptoError::BadClientKey);
    }
    match B64.decode_slice(client_key_b64, &mut key) {
        Ok(KEY_BYTES) => Ok(key),
        _ => Err(CryptoError::BadClientKey),
    }
}

/// The X25519 public key of the private key `seed` (clamped as X25519
/// requires).
pub fn public_key(seed: [u8; KEY_BYTES]) -> [u8; KEY_BYTES] {
    PublicKey::from(&StaticSecret::from(seed)).to_bytes()
}

/// `X25519(seed, peer_public)`; rejects low-order peer keys.
pub fn shared_secret(
    seed: [u8; KEY_BYTES],
    peer_public: [u8; KEY_BYTES],
) -> Result<[u8; KEY_BYTES], CryptoError> {
    let shared = StaticSecret::from(seed).diffie_hellman(&PublicKey::from(peer_public));
    if !shared.was_contributory() {
        return Err(CryptoError::WeakClientKey);
    }
    Ok(shared.to_bytes())
}

/// The AES key: the first 16 characters of the lowercase hex MD5 of
/// `base64(secret)`, as ASCII bytes.
pub fn aes_key_from_secret(secret: &[u8; KEY_BYTES]) -> [u8; AES_KEY_BYTES] {
    let mut b64 = [0u8; KEY_B64_BYTES];
    let n = B64.encode_slice(secret, &mut b64).unwrap_or(0);
    debug_assert_eq!(n, KEY_B64_BYTES);
    let digest = Md5::digest(&b64[..n]);
    let mut key = [0u8; AES_KEY_BYTES];
    for (i, byte) in digest.iter().take(AES_KEY_BYTES / 2).enumerate() {
        key[2 * i] = HEX[usize::from(byte >> 4)];
        key[2 * i + 1] = HEX[usize::from(byte & 0x0f)];
    }
    key
}

/// Maps 16 random bytes to 16 characters of `[A-Za-z0-9]` (`byte % 62`:
/// a slight bias towards the first 8 characters, irrelevant for an IV the
/// protocol reuses for the whole connection anyway).
pub fn salt_from_random(random: [u8; SALT_BYTES]) -> [u8; SALT_BYTES] {
    random.map(|b| SALT_ALPHABET[usize::from(b) % SALT_ALPHABET.len()])
}

/// Result of [`server_handshake`]: the connection's cipher and the two
/// CONNACK strings.
pub struct ServerHandshake {
    /// The connection's cipher.
    pub cipher: SessionCipher,
    server_key: [u8; KEY_B64_BYTES],
    salt: [u8; SALT_BYTES],
}

impl ServerHandshake {
    /// CONNACK `server_key`: base64 of the server's public key.
    pub fn server_key(&self) -> &str {
        core::str::from_utf8(&self.server_key).unwrap_or_default()
    }

    /// CONNACK `salt` (also the IV).
    pub fn salt(&self) -> &str {
        core::str::from_utf8(&self.salt).unwrap_or_default()
    }
}

impl core::fmt::Debug for ServerHandshake {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ServerHandshake")
            .field("server_key", &self.server_key())
            .field("salt", &self.salt())
            .finish_non_exhaustive()
    }
}

/// The server side of the key agreement for one connection.
///
/// `server_seed` must be 32 fresh random bytes per connection (the server's
/// X25519 private key), `salt_random` 16 random bytes. Deterministic for
/// given inputs.
pub fn server_handshake(
    client_key_b64: &str,
    server_seed: [u8; KEY_BYTES],
    salt_random: [u8; SALT_BYTES],
) -> Result<ServerHandshake, CryptoError> {
    let client_public = decode_client_key(client_key_b64)?;
    let secret = shared_secret(server_seed, client_public)?;
    let aes_key = aes_key_from_secret(&secret);
    let salt = salt_from_random(salt_random);
    let mut server_key = [0u8; KEY_B64_BYTES];
    let n = B64
        .encode_slice(public_key(server_seed), &mut server_key)
        .unwrap_or(0);
    debug_assert_eq!(n, KEY_B64_BYTES);
    Ok(ServerHandshake {
        cipher: SessionCipher::new(&aes_key, &salt),
        server_key,
        salt,
    })
}

/// A msg_key: 32 lowercase hex characters.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct MsgKey(pub [u8; MSG_KEY_BYTES]);

impl MsgKey {
    /// The key as text.
    pub fn as_str(&self) -> &str {
        core::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl core::fmt::Debug for MsgKey {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "MsgKey({})", self.as_str())
    }
}

/// One connection's cipher: the expanded AES-128 key (both directions) and
/// the IV. Immutable after creation; `&self` methods only, so one cipher
/// can be used from the connection's thread without further state.
#[derive(Clone)]
pub struct SessionCipher {
    enc: Aes128Enc,
    dec: Aes128Dec,
    iv: [u8; BLOCK_BYTES],
}

impl core::fmt::Debug for SessionCipher {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("SessionCipher").finish_non_exhaustive()
    }
}

impl SessionCipher {
    /// A cipher from the 16-byte ASCII AES key and the 16-byte IV (salt).
    pub fn new(aes_key: &[u8; AES_KEY_BYTES], iv: &[u8; SALT_BYTES]) -> Self {
        let key = GenericArray::from(*aes_key);
        Self {
            enc: Aes128Enc::new(&key),
            dec: Aes128Dec::new(&key),
            iv: *iv,
        }
    }

    /// Length of the base64 text [`encrypt_into`](Self::encrypt_into)
    /// produces for `plain_len` bytes.
    #[inline]
    pub const fn encrypted_len(plain_len: usize) -> usize {
        let ct = (plain_len / BLOCK_BYTES + 1) * BLOCK_BYTES;
        ct.div_ceil(3) * 4
    }

    /// Appends `base64(AES-CBC(plain))` to `out`.
    pub fn encrypt_into(&self, plain: &[u8], out: &mut Vec<u8>) {
        out.reserve(Self::encrypted_len(plain.len()));
        self.encrypt_pieces(&[plain], |b64| out.extend_from_slice(b64));
    }

    /// Appends the plaintext of `base64(AES-CBC(plain))` text `b64` to
    /// `out`. On error `out` is unchanged.
    pub fn decrypt(&self, b64: &[u8], out: &mut Vec<u8>) -> Result<(), CryptoError> {
        let start = out.len();
        if B64.decode_vec(b64, out).is_err() {
            out.truncate(start);
            return Err(CryptoError::BadBase64);
        }
        let ct_len = out.len() - start;
        if ct_len == 0 || !ct_len.is_multiple_of(BLOCK_BYTES) {
            out.truncate(start);
            return Err(CryptoError::BadLength { len_bytes: ct_len });
        }
        let dec = cbc::Decryptor::<Aes128Dec>::inner_iv_init(
            self.dec.clone(),
            GenericArray::from_slice(&self.iv),
        );
        match dec.decrypt_padded_mut::<Pkcs7>(&mut out[start..]) {
            Ok(plain) => {
                let n = plain.len();
                out.truncate(start + n);
                Ok(())
            }
            Err(_) => {
                out.truncate(start);
                Err(CryptoError::BadPadding)
            }
        }
    }

    /// msg_key of a SEND: hex MD5 of `enc(client_seq ‖ client_msg_no ‖
    /// channel_id ‖ channel_type ‖ payload)`, numbers in decimal.
    pub fn send_msg_key(&self, p: &SendPacket<'_>) -> MsgKey {
        let mut seq = DecBuf::new();
        let mut ct = DecBuf::new();
        self.msg_key_of(&[
            seq.unsigned(u64::from(p.client_seq)),
            p.client_msg_no.as_bytes(),
            p.channel_id.as_bytes(),
            ct.unsigned(u64::from(p.channel_type.0)),
            p.payload,
        ])
    }

    /// Whether a SEND's msg_key is the one its fields and this connection's
    /// key give (exact, lowercase hex).
    pub fn send_msg_key_ok(&self, p: &SendPacket<'_>) -> bool {
        let expected = self.send_msg_key(p);
        ct_eq(expected.0.as_slice(), p.msg_key.as_bytes())
    }

    /// Verifies a SEND's msg_key, then appends its decrypted payload to
    /// `out`; with [`Setting::NO_ENCRYPT`] appends the payload unchanged.
    /// On error `out` is unchanged.
    pub fn open_send(&self, p: &SendPacket<'_>, out: &mut Vec<u8>) -> Result<(), CryptoError> {
        if p.setting.contains(Setting::NO_ENCRYPT) {
            out.extend_from_slice(p.payload);
            return Ok(());
        }
        if !self.send_msg_key_ok(p) {
            return Err(CryptoError::MsgKeyMismatch);
        }
        self.decrypt(p.payload, out)
    }

    /// msg_key of a RECV: hex MD5 of `enc(message_id ‖ message_seq ‖
    /// client_msg_no ‖ timestamp ‖ from_uid ‖ channel_id ‖ channel_type ‖
    /// payload)`, numbers in decimal, `payload` being the base64 text
    /// already in `p`.
    pub fn recv_msg_key(&self, p: &RecvPacket<'_>) -> MsgKey {
        self.recv_msg_key_with_payload(p, p.payload)
    }

    fn recv_msg_key_with_payload(&self, p: &RecvPacket<'_>, payload: &[u8]) -> MsgKey {
        let mut id = DecBuf::new();
        let mut seq = DecBuf::new();
        let mut ts = DecBuf::new();
        let mut ct = DecBuf::new();
        self.msg_key_of(&[
            id.signed(p.message_id),
            seq.unsigned(p.message_seq),
            p.client_msg_no.as_bytes(),
            ts.signed(i64::from(p.timestamp_s)),
            p.from_uid.as_bytes(),
            p.channel_id.as_bytes(),
            ct.unsigned(u64::from(p.channel_type.0)),
            payload,
        ])
    }

    /// Appends one RECV frame for this connection: `plaintext` encrypted
    /// into the payload and the matching msg_key; `base.payload` and
    /// `base.msg_key` are ignored. With [`Setting::NO_ENCRYPT`] in
    /// `base.setting`, encodes `base` with `plaintext` as the payload and
    /// `base.msg_key` unchanged. Returns the bytes appended; on error `out`
    /// is unchanged. One AES pass over the payload, one over the sign
    /// string, no allocation once `out` has the capacity.
    pub fn encode_recv(
        &self,
        base: &RecvPacket<'_>,
        plaintext: &[u8],
        version: u8,
        out: &mut Vec<u8>,
    ) -> Result<usize, EncodeError> {
        if base.setting.contains(Setting::NO_ENCRYPT) {
            let p = RecvPacket {
                payload: plaintext,
                ..*base
            };
            return p.encode(version, out);
        }
        const PLACEHOLDER: &str = "00000000000000000000000000000000";
        let head = RecvPacket {
            msg_key: PLACEHOLDER,
            payload: &[],
            ..*base
        };
        let payload_len = Self::encrypted_len(plaintext.len());
        let start = out.len();
        let msg_key_at = crate::wkproto::encode_recv_head(&head, version, payload_len, out)?;
        let payload_at = out.len();
        self.encrypt_into(plaintext, out);
        debug_assert_eq!(out.len() - payload_at, payload_len);
        let key = self.recv_msg_key_with_payload(&head, &out[payload_at..]);
        if let Some(slot) = out.get_mut(msg_key_at..msg_key_at + MSG_KEY_BYTES) {
            slot.copy_from_slice(&key.0);
        }
        Ok(out.len() - start)
    }

    /// hex MD5 of base64(AES(concatenation of `pieces`)).
    fn msg_key_of(&self, pieces: &[&[u8]]) -> MsgKey {
        let mut md5 = Md5::new();
        self.encrypt_pieces(pieces, |b64| md5.update(b64));
        let digest = md5.finalize();
        let mut key = [0u8; MSG_KEY_BYTES];
        for (i, byte) in digest.iter().enumerate() {
            key[2 * i] = HEX[usize::from(byte >> 4)];
            key[2 * i + 1] = HEX[usize::from(byte & 0x0f)];
        }
        MsgKey(key)
    }

    /// Streams `base64(AES-CBC-PKCS7(concatenation of pieces))` to `sink`
    /// in chunks, using only stack buffers.
    fn encrypt_pieces(&self, pieces: &[&[u8]], mut sink: impl FnMut(&[u8])) {
        let mut enc = cbc::Encryptor::<Aes128Enc>::inner_iv_init(
            self.enc.clone(),
            GenericArray::from_slice(&self.iv),
        );
        let mut buf = [0u8; CHUNK_BYTES];
        let mut b64 = [0u8; CHUNK_B64_BYTES];
        let mut len = 0usize;
        for piece in pieces {
            let mut piece: &[u8] = piece;
            while !piece.is_empty() {
                let n = piece.len().min(CHUNK_BYTES - len);
                buf[len..len + n].copy_from_slice(&piece[..n]);
                len += n;
                piece = &piece[n..];
                if len == CHUNK_BYTES {
                    encrypt_blocks(&mut enc, &mut buf);
                    let m = B64.encode_slice(buf, &mut b64).unwrap_or(0);
                    sink(&b64[..m]);
                    len = 0;
                }
            }
        }
        // PKCS7: 1..=16 bytes of value `pad`; fits since len < CHUNK_BYTES
        // and CHUNK_BYTES is a multiple of the block size.
        let pad = BLOCK_BYTES - len % BLOCK_BYTES;
        buf[len..len + pad].fill(pad as u8);
        len += pad;
        encrypt_blocks(&mut enc, &mut buf[..len]);
        let m = B64.encode_slice(&buf[..len], &mut b64).unwrap_or(0);
        sink(&b64[..m]);
    }
}

#[inline]
fn encrypt_blocks(enc: &mut cbc::Encryptor<Aes128Enc>, data: &mut [u8]) {
    // One call per chunk (not per block) keeps the backend dispatch out of
    // the loop.
    let (blocks, tail) = InOutBuf::from(data).into_chunks::<U16>();
    debug_assert!(tail.is_empty(), "whole blocks only");
    enc.encrypt_blocks_inout_mut(blocks);
}

/// Constant-time equality (lengths are public).
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Decimal text of an integer on the stack.
struct DecBuf {
    buf: [u8; 20],
}

impl DecBuf {
    const fn new() -> Self {
        Self { buf: [0; 20] }
    }

    fn unsigned(&mut self, mut v: u64) -> &[u8] {
        let mut i = self.buf.len();
        loop {
            i -= 1;
            self.buf[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        &self.buf[i..]
    }

    fn signed(&mut self, v: i64) -> &[u8] {
        // |i64::MIN| has 19 digits, so the sign fits in the 20-byte buffer.
        let start = self.buf.len() - self.unsigned(v.unsigned_abs()).len();
        if v < 0 {
            self.buf[start - 1] = b'-';
            &self.buf[start - 1..]
        } else {
            &self.buf[start..]
        }
    }
}
