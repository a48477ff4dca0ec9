//! Authenticated encryption of every frame after the handshake (wire version 4).
//!
//! Each end of a link has two keys from the handshake ([`super::auth`]): one seals
//! what it sends, the other opens what it receives; the peer's are the same two the
//! other way round. A sealed frame is the 40-byte header as before, whose `body_len`
//! counts the tag, then the body encrypted with AES-256-GCM and its 16-byte tag:
//!
//! `header(body_len = n + 16) ‖ AES-256-GCM(key_dir, nonce, aad = header, body[n]) ‖ tag[16]`
//!
//! The nonce is not sent: it is `0u32 ‖ counter` (little-endian u64), the count of
//! frames sealed before in that direction on that link. TCP delivers in order, so
//! the receiver expects exactly the next counter: a frame replayed, dropped,
//! reordered, altered (header or body), or sealed with another link's or
//! direction's key fails to open ([`Unauthentic`]) and the link closes by name.
//! Keys are new on every link (fresh nonces in the handshake), so a counter never
//! repeats under one key; a counter that would wrap closes the link instead.
//!
//! Why AES-256-GCM: `cargo bench -p proto --bench link_aead` times a seal and an
//! open of one body against ChaCha20-Poly1305 (RustCrypto both); with AES-NI and
//! CLMUL it is the cheaper at every frame size measured (README, "A cluster of
//! nodes"). The AES round keys are zeroized when a link's keys are dropped (the
//! `zeroize` features), and so are the key bytes and the PRK they came from.

use aes_gcm::aead::consts::U12;
use aes_gcm::aead::{AeadInPlace, KeyInit};
use aes_gcm::{Aes256Gcm, Nonce, Tag};

use super::frame::{self, Frame, FrameError, FrameLimits, Header, Kind, HEADER_BYTES};

/// Bytes of a direction's key (AES-256).
pub const KEY_BYTES: usize = 32;
/// Bytes of the tag each sealed frame's body ends with.
pub const TAG_BYTES: usize = 16;
/// An opener keeps at most this much of its plaintext buffer between frames (a
/// larger frame's buffer, up to `rpc_frame_bytes_max`, is released after it).
pub const PLAIN_KEEP_BYTES_MAX: usize = 64 << 10;

fn nonce(counter: u64) -> Nonce<U12> {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&counter.to_le_bytes());
    Nonce::<U12>::from(n)
}

/// A received frame that did not open: altered, replayed, reordered, cut, or
/// sealed with another key. The link must close.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{kind:?} frame {counter} of the link fails authentication (altered, replayed, \
     reordered, or sealed with another key)"
)]
pub struct Unauthentic {
    /// The kind its header claims.
    pub kind: Kind,
    /// The counter it was expected to be sealed with (frames opened before it).
    pub counter: u64,
}

/// Why a frame could not be sealed (nothing was written).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    /// The sealed frame (body and tag) is over `rpc_frame_bytes_max`.
    #[error("{0}")]
    Frame(#[from] FrameError),
    /// 2^64 frames were sealed with this key: the link must be dialed anew.
    #[error("the link's frame counter is spent: redial")]
    CounterSpent,
}

/// Seals the frames one end sends on a link.
pub struct Sealer {
    aead: Aes256Gcm,
    next: u64,
}

impl Sealer {
    /// The sealer of the direction whose key is `key`, at counter 0.
    pub fn new(key: &[u8; KEY_BYTES]) -> Sealer {
        Sealer {
            aead: Aes256Gcm::new(key.into()),
            next: 0,
        }
    }

    /// Frames sealed so far.
    pub fn sealed(&self) -> u64 {
        self.next
    }

    /// Appends the frame `header` ‖ `body`, sealed, to `out`; returns the bytes
    /// written. Refuses (writing nothing) a frame whose sealed size is over the
    /// limit, undefined flags, or a spent counter.
    pub fn seal(
        &mut self,
        header: &Header,
        body: &[u8],
        limits: FrameLimits,
        out: &mut Vec<u8>,
    ) -> Result<usize, SealError> {
        if self.next == u64::MAX {
            return Err(SealError::CounterSpent);
        }
        let start = out.len();
        let written = frame::encode_header(header, body.len() + TAG_BYTES, limits, out)?;
        out.extend_from_slice(body);
        let (aad, text) = out[start..].split_at_mut(HEADER_BYTES);
        let tag = self
            .aead
            .encrypt_in_place_detached(&nonce(self.next), aad, text)
            .map_err(|_| {
                SealError::Frame(FrameError::TooLarge {
                    frame_bytes: written,
                    bytes_max: limits.rpc_frame_bytes_max,
                })
            });
        let tag = match tag {
            Ok(tag) => tag,
            Err(e) => {
                out.truncate(start);
                return Err(e);
            }
        };
        out.extend_from_slice(&tag);
        self.next += 1;
        Ok(written)
    }
}

/// Opens the frames one end receives on a link, in order.
pub struct Opener {
    aead: Aes256Gcm,
    next: u64,
    /// The last opened frame's body (at most `rpc_frame_bytes_max`; kept up to
    /// [`PLAIN_KEEP_BYTES_MAX`] between frames).
    plain: Vec<u8>,
}

impl Opener {
    /// The opener of the direction whose key is `key`, expecting counter 0.
    pub fn new(key: &[u8; KEY_BYTES]) -> Opener {
        Opener {
            aead: Aes256Gcm::new(key.into()),
            next: 0,
            plain: Vec::new(),
        }
    }

    /// Frames opened so far.
    pub fn opened(&self) -> u64 {
        self.next
    }

    /// Opens `f`, the frame whose bytes start `wire` (its header as received is the
    /// associated data): its plaintext body, valid until the next call.
    pub fn open(&mut self, wire: &[u8], f: &Frame<'_>) -> Result<&[u8], Unauthentic> {
        let refused = Unauthentic {
            kind: f.header.kind,
            counter: self.next,
        };
        let Some(text_bytes) = f.body.len().checked_sub(TAG_BYTES) else {
            return Err(refused);
        };
        if self.next == u64::MAX {
            return Err(refused);
        }
        if self.plain.capacity() > PLAIN_KEEP_BYTES_MAX && text_bytes <= PLAIN_KEEP_BYTES_MAX {
            self.plain = Vec::new();
        }
        let (text, tag) = f.body.split_at(text_bytes);
        self.plain.clear();
        self.plain.extend_from_slice(text);
        let aad = &wire[..HEADER_BYTES];
        let opened = self.aead.decrypt_in_place_detached(
            &nonce(self.next),
            aad,
            &mut self.plain,
            Tag::from_slice(tag),
        );
        if opened.is_err() {
            self.plain.clear();
            return Err(refused);
        }
        self.next += 1;
        Ok(&self.plain)
    }

    /// The body [`Opener::open`] returned last.
    pub fn body(&self) -> &[u8] {
        &self.plain
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(kind: Kind) -> Header {
        Header {
            kind,
            flags: 0,
            sender_node_id: 1,
            sender_boot_id: 2,
            request_id: 3,
            deadline_ms: 4,
        }
    }

    fn open_all(opener: &mut Opener, wire: &[u8]) -> Result<Vec<Vec<u8>>, Unauthentic> {
        let mut bodies = Vec::new();
        let mut at = 0;
        while let Some(f) = frame::decode(&wire[at..], FrameLimits::default()).unwrap() {
            bodies.push(opener.open(&wire[at..], &f)?.to_vec());
            at += f.wire_len();
        }
        Ok(bodies)
    }

    #[test]
    fn sealed_frames_open_in_order_and_hide_the_body() {
        let (mut s, mut o) = (Sealer::new(&[1; 32]), Opener::new(&[1; 32]));
        let mut wire = Vec::new();
        let body = b"a user's token and a plaintext message";
        for _ in 0..3 {
            s.seal(&header(Kind::Push), body, FrameLimits::default(), &mut wire)
                .unwrap();
        }
        assert!(!wire.windows(body.len()).any(|w| w == body));
        assert_eq!(open_all(&mut o, &wire).unwrap(), vec![body.to_vec(); 3]);
        assert_eq!((s.sealed(), o.opened()), (3, 3));
    }

    #[test]
    fn the_seal_counts_against_the_frame_limit() {
        let mut s = Sealer::new(&[1; 32]);
        let limits = FrameLimits {
            rpc_frame_bytes_max: HEADER_BYTES + TAG_BYTES + 10,
        };
        let mut out = Vec::new();
        assert!(s
            .seal(&header(Kind::Push), &[0; 11], limits, &mut out)
            .is_err());
        assert!(out.is_empty());
        assert_eq!(
            s.seal(&header(Kind::Push), &[0; 10], limits, &mut out),
            Ok(66)
        );
    }

    #[test]
    fn a_frame_too_short_for_its_tag_does_not_open() {
        let mut wire = Vec::new();
        frame::encode(
            &header(Kind::Pong),
            &[0; 15],
            FrameLimits::default(),
            &mut wire,
        )
        .unwrap();
        let f = frame::decode(&wire, FrameLimits::default())
            .unwrap()
            .unwrap();
        let err = Opener::new(&[1; 32]).open(&wire, &f).unwrap_err();
        assert_eq!(
            err,
            Unauthentic {
                kind: Kind::Pong,
                counter: 0
            }
        );
    }
}
