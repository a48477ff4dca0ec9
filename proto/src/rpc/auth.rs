//! Authentication of an inter-node connection, before anything else is served:
//! a challenge-response with HMAC-SHA256 keyed by the cluster secret, nonces both
//! ways, both node ids and both boot ids bound into both MACs, and both sides'
//! cluster terms (cluster id, slot-id count) carried and bound in too. Sans-IO:
//! the caller supplies the nonce (32 random bytes) and moves the bytes.
//!
//! The transcript (D = dialer, L = listener; ids little-endian u64; `terms_x` =
//! X's cluster id zero-padded to [`CLUSTER_ID_BYTES_MAX`] bytes ‖ X's slot-id
//! count, little-endian u32: [`TERMS_BYTES`] bytes):
//! 1. D → L `Hello`, header from (D.node_id, D.boot_id), body `nonce_d ‖ terms_d`
//!    (32 + 36 bytes). L refuses a node id that is not one of its peers (or is its
//!    own).
//! 2. L → D `Challenge`, header from (L.node_id, L.boot_id), body
//!    `nonce_l ‖ terms_l ‖ mac_l` (32 + 36 + 32 bytes). If `terms_d` differ from its
//!    own, L still sends the Challenge (so D learns L's terms, authenticated), then
//!    refuses by name: [`Refusal::OtherCluster`] or [`Refusal::OtherSlotIds`]. D
//!    refuses a node id other than the one it dialed, `nonce_l == nonce_d` (a
//!    reflected Hello), a `mac_l` that does not verify, then terms other than its
//!    own, by name as L does; otherwise it is established with (L.node_id,
//!    L.boot_id).
//! 3. D → L `Proof`, header from (D.node_id, D.boot_id) again, body `mac_d` (32
//!    bytes). L refuses other ids than the Hello's and a `mac_d` that does not
//!    verify; otherwise it is established with (D.node_id, D.boot_id).
//!
//! The dialer is established as soon as the Challenge verifies and may send its
//! first requests right behind the Proof; bytes after the frame that ends the
//! handshake are left to the caller (`Step::consumed`).
//!
//! `mac_x = HMAC-SHA256(secret, label_x ‖ D.node_id ‖ D.boot_id ‖ L.node_id ‖
//! L.boot_id ‖ nonce_d ‖ nonce_l ‖ terms_d ‖ terms_l)` with `label_l = "imrouter rpc
//! v2 listener"` and `label_d = "imrouter rpc v2 dialer"`: distinct labels, so one
//! side's MAC is never the other's (a reflected Challenge or Proof fails); fresh
//! nonces on both sides, so a recorded transcript replayed to either side fails;
//! the ids inside the MAC, so a peer (or a man in the middle rewriting headers)
//! claiming other ids fails; both sides' terms inside the MAC, so terms rewritten
//! on the way fail (the dialer names another cluster or slot-id count only once
//! the listener's MAC vouches for it; the listener names what the Hello claims,
//! which nothing vouches for yet, and its Challenge MAC then fails at the dialer
//! if the Hello was rewritten). MACs are compared in constant time (`subtle`).
//!
//! Why the terms: nodes of two clusters that share a secret by mistake, or of one
//! cluster whose `slot_ids` differ, would route every uid to different homes
//! without an error anywhere; they are refused instead, naming both values. The
//! node list is not compared: membership is meant to change at run time.
//!
//! Any other frame before the end, a handshake frame out of order, a body of the
//! wrong size, a malformed cluster id, or a frame over
//! [`HANDSHAKE_FRAME_BYTES_MAX`] (an unauthenticated peer cannot make the node
//! buffer more) is a refusal: the machine writes a `Goodbye` with the reason
//! (unless the peer sent one) and the caller closes.
//!
//! What the handshake leaves behind: the link's session keys ([`SessionKeys`], see
//! [`super::seal`]), one per direction, derived with HKDF-SHA256 from the cluster
//! secret and the whole transcript. Extract: `prk = HMAC-SHA256(secret,
//! label_s ‖ transcript)` (HKDF-Extract with the secret as its key and the
//! transcript, as the MACs cover it, as input), `label_s = "imrouter rpc v4
//! session"`; expand: `key_dl = HKDF-Expand(prk, "imrouter rpc v4 dialer to
//! listener", 32)` and `key_ld` alike. Fresh nonces on both sides make the keys of
//! every link new, and the two directions never share a key. Every frame after
//! the handshake is sealed with them; the PRK and the keys are zeroized.

use std::sync::Arc;

use hkdf::Hkdf;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;
use zeroize::Zeroizing;

use super::frame::{self, FrameError, FrameLimits, Header, Kind, HEADER_BYTES};
use super::seal::{Opener, Sealer, KEY_BYTES};

/// Bytes of each side's nonce.
pub const NONCE_BYTES: usize = 32;
/// Bytes of a MAC (HMAC-SHA256).
pub const MAC_BYTES: usize = 32;
/// The shortest cluster secret accepted, in bytes.
pub const CLUSTER_SECRET_BYTES_MIN: usize = 16;
/// Largest frame accepted before authentication (header and a 256-byte body).
pub const HANDSHAKE_FRAME_BYTES_MAX: usize = HEADER_BYTES + 256;

/// The longest cluster id, in bytes (it travels zero-padded to this length).
pub const CLUSTER_ID_BYTES_MAX: usize = 32;
/// Bytes of one side's terms on the wire: the padded cluster id, the slot-id count.
pub const TERMS_BYTES: usize = CLUSTER_ID_BYTES_MAX + 4;
/// Bytes of a Hello body: the dialer's nonce and terms.
pub const HELLO_BODY_BYTES: usize = NONCE_BYTES + TERMS_BYTES;
/// Bytes of a Challenge body: the listener's nonce, terms and MAC.
pub const CHALLENGE_BODY_BYTES: usize = NONCE_BYTES + TERMS_BYTES + MAC_BYTES;

const LABEL_LISTENER: &[u8] = b"imrouter rpc v2 listener";
const LABEL_DIALER: &[u8] = b"imrouter rpc v2 dialer";
const LABEL_SESSION: &[u8] = b"imrouter rpc v4 session";
const INFO_DIALER_TO_LISTENER: &[u8] = b"imrouter rpc v4 dialer to listener";
const INFO_LISTENER_TO_DIALER: &[u8] = b"imrouter rpc v4 listener to dialer";

/// A cluster's name (`[cluster] id`): 1 to [`CLUSTER_ID_BYTES_MAX`] bytes of ASCII
/// letters, digits, `.`, `_` and `-` (it is printed in refusals and logs as is).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClusterId([u8; CLUSTER_ID_BYTES_MAX]);

/// A string that cannot be a cluster id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "a cluster id is 1 to {CLUSTER_ID_BYTES_MAX} bytes of ASCII letters, digits, '.', '_' and '-'"
)]
pub struct InvalidClusterId;

impl ClusterId {
    /// Checks `id` ([`InvalidClusterId`] says what is allowed).
    pub fn new(id: &str) -> Result<ClusterId, InvalidClusterId> {
        let ok = |b: &u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-');
        if id.is_empty() || id.len() > CLUSTER_ID_BYTES_MAX || !id.bytes().all(|b| ok(&b)) {
            return Err(InvalidClusterId);
        }
        let mut padded = [0u8; CLUSTER_ID_BYTES_MAX];
        padded[..id.len()].copy_from_slice(id.as_bytes());
        Ok(ClusterId(padded))
    }

    /// The id as on the wire (zero-padded) back, if it is one.
    fn from_wire(padded: &[u8; CLUSTER_ID_BYTES_MAX]) -> Option<ClusterId> {
        let len = padded.iter().position(|&b| b == 0).unwrap_or(padded.len());
        let id = std::str::from_utf8(&padded[..len]).ok()?;
        let back = ClusterId::new(id).ok()?;
        (back.0 == *padded).then_some(back)
    }

    /// The id.
    pub fn as_str(&self) -> &str {
        let len = self.0.iter().position(|&b| b == 0).unwrap_or(self.0.len());
        // Only ASCII goes in (ClusterId::new): always valid UTF-8.
        std::str::from_utf8(&self.0[..len]).unwrap_or_default()
    }
}

impl std::fmt::Display for ClusterId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Debug for ClusterId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ClusterId({:?})", self.as_str())
    }
}

/// What both ends of a link must agree on, besides the secret: carried by the
/// Hello and the Challenge, bound into both MACs, compared by both sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Terms {
    id: ClusterId,
    slot_ids: u32,
}

impl Terms {
    fn to_wire(self) -> [u8; TERMS_BYTES] {
        let mut out = [0u8; TERMS_BYTES];
        out[..CLUSTER_ID_BYTES_MAX].copy_from_slice(&self.id.0);
        out[CLUSTER_ID_BYTES_MAX..].copy_from_slice(&self.slot_ids.to_le_bytes());
        out
    }

    fn from_wire(kind: Kind, wire: &[u8]) -> Result<Terms, Refusal> {
        let (id, slot_ids) = wire.split_at(CLUSTER_ID_BYTES_MAX);
        let id = id.try_into().ok().and_then(ClusterId::from_wire);
        let slot_ids = slot_ids.try_into().ok().map(u32::from_le_bytes);
        match (id, slot_ids) {
            (Some(id), Some(slot_ids)) => Ok(Terms { id, slot_ids }),
            _ => Err(Refusal::BadClusterId(kind)),
        }
    }

    /// The peer's terms against ours: a refusal that names the difference.
    fn check(self, ours: Terms) -> Result<(), Refusal> {
        if self.id != ours.id {
            return Err(Refusal::OtherCluster {
                peer: self.id,
                ours: ours.id,
            });
        }
        if self.slot_ids != ours.slot_ids {
            return Err(Refusal::OtherSlotIds {
                peer: self.slot_ids,
                ours: ours.slot_ids,
            });
        }
        Ok(())
    }
}

/// The cluster secret: its bytes, shared by every link of the process and zeroized
/// when the last one drops it. Each MAC and key derivation keys HMAC-SHA256 with
/// it for that one use (hmac 0.12 has no zeroize support: its keyed state lives on
/// the stack for that one computation only).
#[derive(Clone)]
pub struct ClusterSecret(Arc<Zeroizing<Vec<u8>>>);

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(<redacted>)")
    }
}

/// A cluster secret that cannot be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("cluster secret of {0} bytes is too short (at least {CLUSTER_SECRET_BYTES_MIN})")]
pub struct SecretTooShort(pub usize);

impl ClusterSecret {
    /// Keys HMAC-SHA256 with `secret`; refuses one under [`CLUSTER_SECRET_BYTES_MIN`].
    pub fn new(secret: &[u8]) -> Result<ClusterSecret, SecretTooShort> {
        if secret.len() < CLUSTER_SECRET_BYTES_MIN {
            return Err(SecretTooShort(secret.len()));
        }
        Ok(ClusterSecret(Arc::new(Zeroizing::new(secret.to_vec()))))
    }

    fn mac(&self, label: &[u8], t: &Transcript) -> [u8; MAC_BYTES] {
        // HMAC takes a key of any length: this cannot fail.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes any key");
        mac.update(label);
        for id in [
            t.dialer.node_id,
            t.dialer.boot_id,
            t.listener.node_id,
            t.listener.boot_id,
        ] {
            mac.update(&id.to_le_bytes());
        }
        mac.update(&t.nonce_d);
        mac.update(&t.nonce_l);
        mac.update(&t.terms_d.to_wire());
        mac.update(&t.terms_l.to_wire());
        mac.finalize().into_bytes().into()
    }

    fn verify(&self, label: &[u8], t: &Transcript, got: &[u8]) -> bool {
        bool::from(self.mac(label, t).as_slice().ct_eq(got))
    }

    /// The session keys of the link `t` describes, seen from `role`'s side (see
    /// the module docs).
    fn session_keys(&self, t: &Transcript, role: Role) -> SessionKeys {
        let prk = Zeroizing::new(self.mac(LABEL_SESSION, t));
        // A PRK of the hash's length is always accepted.
        let hkdf = Hkdf::<Sha256>::from_prk(prk.as_slice()).expect("a 32-byte PRK");
        let expand = |info: &[u8]| {
            let mut key = Zeroizing::new([0u8; KEY_BYTES]);
            // 32 bytes are within HKDF-SHA256's 8160.
            hkdf.expand(info, key.as_mut_slice())
                .expect("32 bytes of output");
            key
        };
        let dialer_to_listener = expand(INFO_DIALER_TO_LISTENER);
        let listener_to_dialer = expand(INFO_LISTENER_TO_DIALER);
        let (send, recv) = match role {
            Role::Dialer => (dialer_to_listener, listener_to_dialer),
            Role::Listener => (listener_to_dialer, dialer_to_listener),
        };
        SessionKeys {
            send: Sealer::new(&send),
            recv: Opener::new(&recv),
        }
    }
}

/// Which end of a link a machine is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Dialer,
    Listener,
}

/// One end's keys of an established link: [`Sealer`] for the frames it sends,
/// [`Opener`] for those it receives (the peer's sealer has this opener's key, and
/// the other way round).
pub struct SessionKeys {
    /// Seals what this end sends.
    pub send: Sealer,
    /// Opens what it receives.
    pub recv: Opener,
}

impl std::fmt::Debug for SessionKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionKeys(<redacted>)")
    }
}

/// What a node proves its membership of a cluster with: the cluster secret, and
/// the terms both ends of a link must share (the cluster id, `[cluster] id`; the
/// slot-id count, `[cluster] slot_ids`: nodes that count slot ids differently put
/// a uid's home on different nodes).
#[derive(Clone, Debug)]
pub struct ClusterKey {
    secret: ClusterSecret,
    terms: Terms,
}

impl ClusterKey {
    /// The key of cluster `id`, whose nodes group the hash slots into `slot_ids`
    /// slot ids.
    pub fn new(secret: ClusterSecret, id: ClusterId, slot_ids: u32) -> ClusterKey {
        ClusterKey {
            secret,
            terms: Terms { id, slot_ids },
        }
    }

    /// The cluster id.
    pub fn id(&self) -> ClusterId {
        self.terms.id
    }

    /// The slot-id count.
    pub fn slot_ids(&self) -> u32 {
        self.terms.slot_ids
    }
}

/// Who a node is on the wire: its node id and this process's boot id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Identity {
    /// The node id (`[node] node_id`).
    pub node_id: u64,
    /// This process's boot id.
    pub boot_id: u64,
}

/// Why a handshake was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The bytes are not a frame (or one too large before authentication).
    #[error("bad frame: {0}")]
    Frame(#[from] FrameError),
    /// A frame other than the next handshake step.
    #[error("unexpected {got:?} frame before authentication (expected {expected:?})")]
    Unexpected {
        /// The kind received.
        got: Kind,
        /// The step the machine waited for.
        expected: Kind,
    },
    /// A handshake body of the wrong size.
    #[error("{kind:?} body of {body_bytes} bytes (expected {expected_bytes})")]
    BadBody {
        /// The frame's kind.
        kind: Kind,
        /// Its body size.
        body_bytes: usize,
        /// The size it must have.
        expected_bytes: usize,
    },
    /// The dialer's node id is not a peer of this node (or is this node's own).
    #[error("node {0} is not a peer of this node")]
    UnknownPeer(u64),
    /// The listener answered with another node id than the one dialed.
    #[error("dialed node {expected} but node {got} answered")]
    WrongPeer {
        /// The node dialed.
        expected: u64,
        /// The node id in the Challenge.
        got: u64,
    },
    /// The Proof came with other ids than the Hello.
    #[error("sender ids changed during the handshake")]
    SenderChanged,
    /// The peer's nonce equals ours (our own Hello reflected back).
    #[error("reflected nonce")]
    ReflectedNonce,
    /// A Hello or Challenge whose cluster id is not one ([`ClusterId::new`]).
    #[error("{0:?} carries a malformed cluster id")]
    BadClusterId(Kind),
    /// The peer is of another cluster (`[cluster] id`).
    #[error("peer is of cluster \"{peer}\", this node of cluster \"{ours}\"")]
    OtherCluster {
        /// The peer's cluster id.
        peer: ClusterId,
        /// This node's.
        ours: ClusterId,
    },
    /// The peer groups the hash slots into another number of slot ids
    /// (`[cluster] slot_ids`).
    #[error("peer has {peer} slot ids, this node {ours}")]
    OtherSlotIds {
        /// The peer's count.
        peer: u32,
        /// This node's.
        ours: u32,
    },
    /// The MAC does not verify: another secret, a replayed or altered transcript.
    #[error("MAC does not verify (wrong cluster secret, replayed or altered transcript)")]
    BadMac,
    /// The peer sent a Goodbye.
    #[error("the peer said goodbye")]
    PeerGoodbye,
}

/// Where a handshake stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Waiting for the peer's next frame.
    Pending,
    /// Authenticated: frames of other kinds may flow.
    Established {
        /// The peer's node id.
        peer_node_id: u64,
        /// The peer's boot id.
        peer_boot_id: u64,
    },
    /// Refused: flush the output (a Goodbye) and close.
    Refused(Refusal),
}

/// The result of feeding bytes: how many were consumed and where things stand.
/// Bytes after the frame that completes the handshake are not consumed: they are
/// the first frames of the authenticated stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// Bytes of the input consumed.
    pub consumed: usize,
    /// The state after them.
    pub outcome: Outcome,
}

struct Transcript {
    dialer: Identity,
    listener: Identity,
    nonce_d: [u8; NONCE_BYTES],
    nonce_l: [u8; NONCE_BYTES],
    terms_d: Terms,
    terms_l: Terms,
}

enum State {
    /// Dialer: Hello sent, waiting for the Challenge.
    DialerAwaitChallenge {
        peer_node_id: u64,
    },
    /// Listener: waiting for the Hello.
    ListenerAwaitHello {
        peers: Vec<u64>,
    },
    /// Listener: Challenge sent, waiting for the Proof.
    ListenerAwaitProof {
        dialer: Identity,
        nonce_d: [u8; NONCE_BYTES],
    },
    Done(Outcome),
}

/// One side's handshake machine.
pub struct Handshake {
    key: ClusterKey,
    me: Identity,
    nonce: [u8; NONCE_BYTES],
    state: State,
    /// The session keys, from the step that established the link until taken.
    keys: Option<SessionKeys>,
}

fn handshake_header(kind: Kind, me: Identity) -> Header {
    Header {
        kind,
        flags: 0,
        sender_node_id: me.node_id,
        sender_boot_id: me.boot_id,
        request_id: 0,
        deadline_ms: 0,
    }
}

fn handshake_limits() -> FrameLimits {
    FrameLimits {
        rpc_frame_bytes_max: HANDSHAKE_FRAME_BYTES_MAX,
    }
}

fn write(kind: Kind, me: Identity, body: &[u8], out: &mut Vec<u8>) {
    // Bodies here are at most 256 bytes: encode cannot refuse them.
    let written = frame::encode(&handshake_header(kind, me), body, handshake_limits(), out);
    debug_assert!(written.is_ok(), "handshake frame refused: {written:?}");
}

fn body_of<const N: usize>(kind: Kind, body: &[u8]) -> Result<[u8; N], Refusal> {
    body.try_into().map_err(|_| Refusal::BadBody {
        kind,
        body_bytes: body.len(),
        expected_bytes: N,
    })
}

impl Handshake {
    /// The dialing side toward `peer_node_id`: writes the Hello into `out`.
    pub fn dialer(
        key: &ClusterKey,
        me: Identity,
        peer_node_id: u64,
        nonce: [u8; NONCE_BYTES],
        out: &mut Vec<u8>,
    ) -> Handshake {
        let mut hello = [0u8; HELLO_BODY_BYTES];
        hello[..NONCE_BYTES].copy_from_slice(&nonce);
        hello[NONCE_BYTES..].copy_from_slice(&key.terms.to_wire());
        write(Kind::Hello, me, &hello, out);
        Handshake {
            key: key.clone(),
            me,
            nonce,
            state: State::DialerAwaitChallenge { peer_node_id },
            keys: None,
        }
    }

    /// The accepting side; `peers` are the node ids allowed to connect.
    pub fn listener(
        key: &ClusterKey,
        me: Identity,
        peers: &[u64],
        nonce: [u8; NONCE_BYTES],
    ) -> Handshake {
        Handshake {
            key: key.clone(),
            me,
            nonce,
            state: State::ListenerAwaitHello {
                peers: peers.to_vec(),
            },
            keys: None,
        }
    }

    /// The link's session keys, once established (given out once): what this side
    /// seals its frames with and opens the peer's with.
    pub fn take_keys(&mut self) -> Option<SessionKeys> {
        self.keys.take()
    }

    /// Where the handshake stands.
    pub fn outcome(&self) -> Outcome {
        match self.state {
            State::Done(outcome) => outcome,
            _ => Outcome::Pending,
        }
    }

    /// Feeds received bytes (the start of the receive buffer); writes any frame
    /// to send into `out`. Consumes whole handshake frames only, and nothing
    /// once established or refused.
    pub fn receive(&mut self, buf: &[u8], out: &mut Vec<u8>) -> Step {
        let mut consumed = 0;
        while self.outcome() == Outcome::Pending {
            match frame::decode(&buf[consumed..], handshake_limits()) {
                Ok(None) => break,
                Ok(Some(f)) => {
                    consumed += f.wire_len();
                    if let Err(refusal) = self.on_frame(f.header, f.body, out) {
                        self.refuse(refusal, out);
                    }
                }
                Err(e) => self.refuse(Refusal::Frame(e), out),
            }
        }
        Step {
            consumed,
            outcome: self.outcome(),
        }
    }

    fn refuse(&mut self, refusal: Refusal, out: &mut Vec<u8>) {
        if refusal != Refusal::PeerGoodbye {
            let reason = refusal.to_string();
            let reason = &reason.as_bytes()[..reason.len().min(256)];
            write(Kind::Goodbye, self.me, reason, out);
        }
        self.state = State::Done(Outcome::Refused(refusal));
    }

    fn expected(&self) -> Kind {
        match self.state {
            State::DialerAwaitChallenge { .. } => Kind::Challenge,
            State::ListenerAwaitHello { .. } => Kind::Hello,
            State::ListenerAwaitProof { .. } | State::Done(_) => Kind::Proof,
        }
    }

    fn on_frame(&mut self, h: Header, body: &[u8], out: &mut Vec<u8>) -> Result<(), Refusal> {
        let expected = self.expected();
        if h.kind == Kind::Goodbye {
            return Err(Refusal::PeerGoodbye);
        }
        if h.kind != expected {
            return Err(Refusal::Unexpected {
                got: h.kind,
                expected,
            });
        }
        let peer = Identity {
            node_id: h.sender_node_id,
            boot_id: h.sender_boot_id,
        };
        let next = match &self.state {
            State::DialerAwaitChallenge { peer_node_id } => {
                self.on_challenge(*peer_node_id, peer, body, out)?
            }
            State::ListenerAwaitHello { peers } => {
                if peer.node_id == self.me.node_id || !peers.contains(&peer.node_id) {
                    return Err(Refusal::UnknownPeer(peer.node_id));
                }
                self.on_hello(peer, body, out)?
            }
            State::ListenerAwaitProof { dialer, nonce_d } => {
                self.on_proof(*dialer, *nonce_d, peer, body)?
            }
            State::Done(_) => return Ok(()),
        };
        self.state = next;
        Ok(())
    }

    /// Listener, step 2: answers a Hello with the Challenge, even one of other
    /// terms (the dialer learns ours, vouched for by the MAC), then refuses those.
    fn on_hello(&self, dialer: Identity, body: &[u8], out: &mut Vec<u8>) -> Result<State, Refusal> {
        let body = body_of::<HELLO_BODY_BYTES>(Kind::Hello, body)?;
        let (nonce_d, terms_d) = body.split_at(NONCE_BYTES);
        let nonce_d: [u8; NONCE_BYTES] = nonce_d.try_into().expect("split at NONCE_BYTES");
        if nonce_d == self.nonce {
            return Err(Refusal::ReflectedNonce);
        }
        let terms_d = Terms::from_wire(Kind::Hello, terms_d)?;
        let ours = self.key.terms;
        let t = Transcript {
            dialer,
            listener: self.me,
            nonce_d,
            nonce_l: self.nonce,
            terms_d,
            terms_l: ours,
        };
        let mut challenge = [0u8; CHALLENGE_BODY_BYTES];
        let (nonce_l, rest) = challenge.split_at_mut(NONCE_BYTES);
        let (terms_l, mac_l) = rest.split_at_mut(TERMS_BYTES);
        nonce_l.copy_from_slice(&self.nonce);
        terms_l.copy_from_slice(&ours.to_wire());
        mac_l.copy_from_slice(&self.key.secret.mac(LABEL_LISTENER, &t));
        write(Kind::Challenge, self.me, &challenge, out);
        terms_d.check(ours)?;
        Ok(State::ListenerAwaitProof { dialer, nonce_d })
    }

    /// Dialer, step 3: verifies the Challenge and the listener's terms, answers
    /// with the Proof.
    fn on_challenge(
        &mut self,
        peer_node_id: u64,
        listener: Identity,
        body: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<State, Refusal> {
        if listener.node_id != peer_node_id {
            return Err(Refusal::WrongPeer {
                expected: peer_node_id,
                got: listener.node_id,
            });
        }
        let body = body_of::<CHALLENGE_BODY_BYTES>(Kind::Challenge, body)?;
        let (nonce_l, rest) = body.split_at(NONCE_BYTES);
        let (terms_l, mac_l) = rest.split_at(TERMS_BYTES);
        let nonce_l: [u8; NONCE_BYTES] = nonce_l.try_into().expect("split at NONCE_BYTES");
        if nonce_l == self.nonce {
            return Err(Refusal::ReflectedNonce);
        }
        let terms_l = Terms::from_wire(Kind::Challenge, terms_l)?;
        let t = Transcript {
            dialer: self.me,
            listener,
            nonce_d: self.nonce,
            nonce_l,
            terms_d: self.key.terms,
            terms_l,
        };
        if !self.key.secret.verify(LABEL_LISTENER, &t, mac_l) {
            return Err(Refusal::BadMac);
        }
        terms_l.check(self.key.terms)?;
        let proof = self.key.secret.mac(LABEL_DIALER, &t);
        write(Kind::Proof, self.me, &proof, out);
        self.keys = Some(self.key.secret.session_keys(&t, Role::Dialer));
        Ok(State::Done(Outcome::Established {
            peer_node_id: listener.node_id,
            peer_boot_id: listener.boot_id,
        }))
    }

    /// Listener, end: verifies the Proof (the dialer's terms are ours by now).
    fn on_proof(
        &mut self,
        dialer: Identity,
        nonce_d: [u8; NONCE_BYTES],
        sender: Identity,
        body: &[u8],
    ) -> Result<State, Refusal> {
        if sender != dialer {
            return Err(Refusal::SenderChanged);
        }
        let mac_d = body_of::<MAC_BYTES>(Kind::Proof, body)?;
        let t = Transcript {
            dialer,
            listener: self.me,
            nonce_d,
            nonce_l: self.nonce,
            terms_d: self.key.terms,
            terms_l: self.key.terms,
        };
        if !self.key.secret.verify(LABEL_DIALER, &t, &mac_d) {
            return Err(Refusal::BadMac);
        }
        self.keys = Some(self.key.secret.session_keys(&t, Role::Listener));
        Ok(State::Done(Outcome::Established {
            peer_node_id: dialer.node_id,
            peer_boot_id: dialer.boot_id,
        }))
    }
}
