//! Per-connection encryption of the WuKongIM protocol (spec: "Encryption"
//! in `docs/wkproto.md`), sans-IO and deterministic: the caller
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
//! The client side: [`ClientKey`] gives CONNECT's `client_key`, and
//! [`ClientKey::session_cipher`] the same cipher from CONNACK's `server_key` and
//! `salt`.
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
    /// CONNACK's salt is not 16 characters (client side).
    #[error("salt is not {SALT_BYTES} bytes")]
    BadSalt,
}

impl CryptoError {
    /// The reason code the gateway answers with: CONNACK 21 for an empty
    /// client key, CONNACK 2 for any other key error, SENDACK 8 for a
    /// msg_key mismatch, SENDACK 9 for an undecryptable payload.
    pub const fn reason_code(self) -> ReasonCode {
        match self {
            Self::EmptyClientKey => ReasonCode::CLIENT_KEY_IS_EMPTY,
            Self::BadClientKey | Self::WeakClientKey | Self::BadSalt => ReasonCode::AUTH_FAIL,
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
/// requires): `X25519(seed, 9)`.
///
/// Uses graviola (s2n-bignum's constant-time, formally verified assembly)
/// where the CPU supports it, x25519-dalek otherwise; both compute exactly
/// RFC 7748's function.
pub fn public_key(seed: [u8; KEY_BYTES]) -> [u8; KEY_BYTES] {
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    if graviola::util::is_cpu_supported() {
        return with_graviola(|| {
            graviola::key_agreement::x25519::StaticPrivateKey::from_array(&seed)
                .public_key()
                .as_bytes()
        });
    }
    dalek_public_key(seed)
}

/// `X25519(seed, peer_public)` (RFC 7748: bit 255 of `peer_public`
/// ignored, non-canonical and twist coordinates accepted); rejects
/// low-order peer keys (an all-zero result) with
/// [`CryptoError::WeakClientKey`]. Constant time in `seed`.
///
/// Same backends as [`public_key`].
pub fn shared_secret(
    seed: [u8; KEY_BYTES],
    peer_public: [u8; KEY_BYTES],
) -> Result<[u8; KEY_BYTES], CryptoError> {
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    if graviola::util::is_cpu_supported() {
        use graviola::key_agreement::x25519;
        return with_graviola(|| {
            // Its only error is the all-zero (low-order) result.
            x25519::StaticPrivateKey::from_array(&seed)
                .diffie_hellman(&x25519::PublicKey::from_array(&peer_public))
                .map(|shared| shared.as_bytes())
                .map_err(|_| CryptoError::WeakClientKey)
        });
    }
    dalek_shared_secret(seed, peer_public)
}

/// Runs `f`, a graviola call (all its temporaries dropped inside `f`), and
/// then, on x86_64, clears the upper halves of the YMM registers.
///
/// graviola zeroises its key material on drop (after its own `vzeroall`)
/// with 256-bit AVX stores and no `vzeroupper`: the dirty upper state left
/// behind made the thread's later SSE code slower (measured: +20% on
/// `encode_recv` after a single `public_key`) until something cleared it.
///
/// Call only after `graviola::util::is_cpu_supported()` returned true.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline]
fn with_graviola<T>(f: impl FnOnce() -> T) -> T {
    let out = f();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `zero_upper` needs AVX; our callers only run after
    // `graviola::util::is_cpu_supported()`, which requires AVX (and AVX2).
    unsafe {
        zero_upper();
    }
    out
}

/// `vzeroupper`: zeroes bits 128.. of YMM0-15. The compiler knows the
/// intrinsic clobbers them, and without AVX enabled for the caller no value
/// lives there anyway.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
fn zero_upper() {
    core::arch::x86_64::_mm256_zeroupper();
}

/// [`public_key`] with x25519-dalek (fixed-base Edwards table).
fn dalek_public_key(seed: [u8; KEY_BYTES]) -> [u8; KEY_BYTES] {
    PublicKey::from(&StaticSecret::from(seed)).to_bytes()
}

/// [`shared_secret`] with x25519-dalek (Montgomery ladder).
fn dalek_shared_secret(
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

/// The client side of the key agreement: an X25519 private key and CONNECT's
/// `client_key` (base64 of its public key), computed once.
#[derive(Clone, Copy)]
pub struct ClientKey {
    private: [u8; KEY_BYTES],
    public_b64: [u8; KEY_B64_BYTES],
}

impl ClientKey {
    /// The key pair of the private key `private` (fresh random bytes in a real
    /// client; tests and the load harness use fixed ones).
    pub fn new(private: [u8; KEY_BYTES]) -> ClientKey {
        let mut public_b64 = [0u8; KEY_B64_BYTES];
        let n = B64
            .encode_slice(public_key(private), &mut public_b64)
            .unwrap_or(0);
        debug_assert_eq!(n, KEY_B64_BYTES);
        ClientKey {
            private,
            public_b64,
        }
    }

    /// CONNECT `client_key`: base64 of the public key.
    pub fn client_key(&self) -> &str {
        core::str::from_utf8(&self.public_b64).unwrap_or_default()
    }

    /// The connection's cipher from CONNACK's `server_key` and `salt`: the same
    /// one [`server_handshake`] derived on the other side.
    pub fn session_cipher(
        &self,
        server_key: &str,
        salt: &str,
    ) -> Result<SessionCipher, CryptoError> {
        let server_public = decode_client_key(server_key)?;
        let secret = shared_secret(self.private, server_public)?;
        let salt: &[u8; SALT_BYTES] = salt
            .as_bytes()
            .try_into()
            .map_err(|_| CryptoError::BadSalt)?;
        Ok(SessionCipher::new(&aes_key_from_secret(&secret), salt))
    }
}

impl core::fmt::Debug for ClientKey {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ClientKey")
            .field("client_key", &self.client_key())
            .finish_non_exhaustive()
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::RngSeed;

    /// The client's cipher, derived from CONNACK, is the server's: what one side
    /// seals the other opens.
    #[test]
    fn client_key_agrees_with_server_handshake() {
        let client = ClientKey::new([7u8; KEY_BYTES]);
        assert_eq!(client.client_key().len(), KEY_B64_BYTES);
        assert_eq!(
            decode_client_key(client.client_key()),
            Ok(public_key([7u8; KEY_BYTES]))
        );
        let server = server_handshake(client.client_key(), [9u8; KEY_BYTES], [3u8; SALT_BYTES])
            .expect("server handshake");
        let cipher = client
            .session_cipher(server.server_key(), server.salt())
            .expect("client cipher");
        let mut sealed = Vec::new();
        cipher.encrypt_into(b"hello", &mut sealed);
        let mut plain = Vec::new();
        server.cipher.decrypt(&sealed, &mut plain).expect("decrypt");
        assert_eq!(plain, b"hello");
        assert_eq!(
            client.session_cipher(server.server_key(), "short").err(),
            Some(CryptoError::BadSalt)
        );
        assert_eq!(
            client.session_cipher("", server.salt()).err(),
            Some(CryptoError::EmptyClientKey)
        );
    }

    /// RFC 7748's function, no low-order check: the reference.
    fn reference(
        seed: [u8; KEY_BYTES],
        peer: [u8; KEY_BYTES],
    ) -> Result<[u8; KEY_BYTES], CryptoError> {
        match x25519_dalek::x25519(seed, peer) {
            zero if zero == [0; KEY_BYTES] => Err(CryptoError::WeakClientKey),
            shared => Ok(shared),
        }
    }

    fn unhex(s: &str) -> [u8; KEY_BYTES] {
        let mut out = [0u8; KEY_BYTES];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex");
        }
        out
    }

    /// Little-endian `p + k` (p = 2^255 - 19), `k < 19`: a non-canonical
    /// encoding of `k`.
    fn p_plus(k: u8) -> [u8; KEY_BYTES] {
        let mut u = [0xff; KEY_BYTES];
        u[0] = 0xed + k;
        u[31] = 0x7f;
        u
    }

    #[test]
    fn rfc7748_vectors() {
        // Section 5.2, the two single-shot vectors.
        let k = unhex("a546e36bf0527c9d3b16154b82465edd62144c0ac1fc5a18506a2244ba449ac4");
        let u = unhex("e6db6867583030db3594c1a424b15f7c726624ec26b3353b10a903a6d0ab1c4c");
        let out = unhex("c3da55379de9c6908e94ea4df28d084f32eccf03491c71f754b4075577a28552");
        assert_eq!(shared_secret(k, u), Ok(out));
        assert_eq!(reference(k, u), Ok(out));
        let k = unhex("4b66e9d4d1b4673c5ad22691957d6af5c11b6421e0ea01d42ca4169e7918ba0d");
        let u = unhex("e5210f12786811d3f4b7959d0538ae2c31dbe7106fc03c3efc4cd549c715a493");
        let out = unhex("95cbde9476e8907d7aade45cb4b873f88b595a68799fa152e6f8f7647aac7957");
        assert_eq!(shared_secret(k, u), Ok(out));
        assert_eq!(reference(k, u), Ok(out));

        // Section 5.2, iterated: k, u = X25519(k, u), k from 9. Most of the
        // u values here are arbitrary bytes, so about half on the twist.
        let mut k = [0u8; KEY_BYTES];
        k[0] = 9;
        let mut u = k;
        for i in 1..=1000 {
            let next = shared_secret(k, u).expect("not low order");
            u = k;
            k = next;
            if i == 1 {
                let want =
                    unhex("422c8e7a6227d7bca1350b3e2bb7279f7897b87bb6854b783c60e80311ae3079");
                assert_eq!(k, want);
            }
        }
        let want = unhex("684cf59ba83309552800ef566f2f4d3c1c3887c49360e3875f2eb94d99532c51");
        assert_eq!(k, want);

        // Section 6.1: key agreement.
        let a = unhex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a");
        let a_pub = unhex("8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a");
        let b = unhex("5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb");
        let b_pub = unhex("de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f");
        let k = unhex("4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742");
        assert_eq!(public_key(a), a_pub);
        assert_eq!(public_key(b), b_pub);
        assert_eq!(shared_secret(a, b_pub), Ok(k));
        assert_eq!(shared_secret(b, a_pub), Ok(k));
    }

    #[test]
    fn low_order_points_are_rejected() {
        let order8_a = unhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800");
        let order8_b = unhex("5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157");
        let mut points = vec![[0u8; KEY_BYTES], order8_a, order8_b];
        let mut one = [0u8; KEY_BYTES];
        one[0] = 1;
        points.push(one);
        // p - 1 (order 2 on the twist), p (= 0), p + 1 (= 1).
        let mut p_minus_1 = p_plus(0);
        p_minus_1[0] -= 1;
        points.extend([p_minus_1, p_plus(0), p_plus(1)]);
        // Bit 255 set: the same points for X25519.
        let with_top: Vec<_> = points
            .iter()
            .map(|p| {
                let mut p = *p;
                p[31] |= 0x80;
                p
            })
            .collect();
        points.extend(with_top);
        for (i, peer) in points.iter().enumerate() {
            for seed in [[0u8; KEY_BYTES], [0xff; KEY_BYTES], [0x42; KEY_BYTES]] {
                assert_eq!(
                    reference(seed, *peer),
                    Err(CryptoError::WeakClientKey),
                    "{i}"
                );
                assert_eq!(
                    shared_secret(seed, *peer),
                    Err(CryptoError::WeakClientKey),
                    "{i}"
                );
                assert_eq!(
                    dalek_shared_secret(seed, *peer),
                    Err(CryptoError::WeakClientKey)
                );
            }
        }
    }

    #[test]
    fn small_and_non_canonical_coordinates_match_reference() {
        // u = 0..64 (curve and twist points alike), and p + k for every
        // non-canonical k, with and without bit 255.
        let mut peers: Vec<[u8; KEY_BYTES]> = (0u8..64)
            .map(|k| {
                let mut u = [0u8; KEY_BYTES];
                u[0] = k;
                u
            })
            .collect();
        peers.extend((0u8..19).map(p_plus));
        let with_top: Vec<_> = peers
            .iter()
            .map(|p| {
                let mut p = *p;
                p[31] |= 0x80;
                p
            })
            .collect();
        peers.extend(with_top);
        let seed = [0x5au8; KEY_BYTES];
        for peer in peers {
            assert_eq!(
                shared_secret(seed, peer),
                reference(seed, peer),
                "{peer:02x?}"
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 256,
            rng_seed: RngSeed::Fixed(0x7725_5190),
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// Random peer keys: arbitrary 32-byte strings (about half of them
        /// twist points, bit 255 random) and real public keys (bit 255
        /// randomly set).
        #[test]
        fn x25519_matches_reference(
            seed in any::<[u8; KEY_BYTES]>(),
            peer_seed in any::<[u8; KEY_BYTES]>(),
            raw in any::<bool>(),
            top in any::<bool>(),
        ) {
            let peer = if raw {
                peer_seed
            } else {
                let mut p = x25519_dalek::x25519(peer_seed, x25519_dalek::X25519_BASEPOINT_BYTES);
                p[31] |= u8::from(top) << 7;
                p
            };
            let want = reference(seed, peer);
            prop_assert_eq!(shared_secret(seed, peer), want);
            prop_assert_eq!(dalek_shared_secret(seed, peer), want);
            let public = x25519_dalek::x25519(seed, x25519_dalek::X25519_BASEPOINT_BYTES);
            prop_assert_eq!(public_key(seed), public);
            prop_assert_eq!(dalek_public_key(seed), public);
        }
    }
}
