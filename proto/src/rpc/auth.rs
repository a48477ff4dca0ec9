//! Authentication of an inter-node connection, before anything else is served:
//! a challenge-response with HMAC-SHA256 keyed by the cluster secret, nonces both
//! ways, both node ids and both boot ids bound into both MACs. Sans-IO: the
//! caller supplies the nonce (32 random bytes) and moves the bytes.
//!
//! The transcript (D = dialer, L = listener; ids little-endian u64):
//! 1. D → L `Hello`, header from (D.node_id, D.boot_id), body `nonce_d` (32 bytes).
//!    L refuses a node id that is not one of its peers (or is its own).
//! 2. L → D `Challenge`, header from (L.node_id, L.boot_id), body
//!    `nonce_l ‖ mac_l` (32 + 32 bytes). D refuses a node id other than the one it
//!    dialed, `nonce_l == nonce_d` (a reflected Hello), and a `mac_l` that does not
//!    verify; otherwise it is established with (L.node_id, L.boot_id).
//! 3. D → L `Proof`, header from (D.node_id, D.boot_id) again, body `mac_d` (32
//!    bytes). L refuses other ids than the Hello's and a `mac_d` that does not
//!    verify; otherwise it is established with (D.node_id, D.boot_id).
//!
//! The dialer is established as soon as the Challenge verifies and may send its
//! first requests right behind the Proof; bytes after the frame that ends the
//! handshake are left to the caller (`Step::consumed`).
//!
//! `mac_x = HMAC-SHA256(secret, label_x ‖ D.node_id ‖ D.boot_id ‖ L.node_id ‖
//! L.boot_id ‖ nonce_d ‖ nonce_l)` with `label_l = "imrouter rpc v1 listener"` and
//! `label_d = "imrouter rpc v1 dialer"`: distinct labels, so one side's MAC is never
//! the other's (a reflected Challenge or Proof fails); fresh nonces on both sides,
//! so a recorded transcript replayed to either side fails; the ids inside the MAC,
//! so a peer (or a man in the middle rewriting headers) claiming other ids fails.
//! MACs are compared in constant time (`subtle`).
//!
//! Any other frame before the end, a handshake frame out of order, a body of the
//! wrong size, or a frame over [`HANDSHAKE_FRAME_BYTES_MAX`] (an unauthenticated
//! peer cannot make the node buffer more) is a refusal: the machine writes a
//! `Goodbye` with the reason (unless the peer sent one) and the caller closes.
//!
//! What this does not give: the frames after the handshake are neither encrypted
//! nor MACed (the inter-node network is trusted not to rewrite an established
//! TCP stream; TLS would be the next step if it is not).

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

use super::frame::{self, FrameError, FrameLimits, Header, Kind, HEADER_BYTES};

/// Bytes of each side's nonce.
pub const NONCE_BYTES: usize = 32;
/// Bytes of a MAC (HMAC-SHA256).
pub const MAC_BYTES: usize = 32;
/// The shortest cluster secret accepted, in bytes.
pub const CLUSTER_SECRET_BYTES_MIN: usize = 16;
/// Largest frame accepted before authentication (header and a 256-byte body).
pub const HANDSHAKE_FRAME_BYTES_MAX: usize = HEADER_BYTES + 256;

const LABEL_LISTENER: &[u8] = b"imrouter rpc v1 listener";
const LABEL_DIALER: &[u8] = b"imrouter rpc v1 dialer";

/// The cluster secret, keyed once (HMAC's inner and outer pads precomputed).
#[derive(Clone)]
pub struct ClusterSecret(Hmac<Sha256>);

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
        let mac = Hmac::<Sha256>::new_from_slice(secret).map_err(|_| SecretTooShort(0))?;
        Ok(ClusterSecret(mac))
    }

    fn mac(&self, label: &[u8], t: &Transcript) -> [u8; MAC_BYTES] {
        let mut mac = self.0.clone();
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
        mac.finalize().into_bytes().into()
    }

    fn verify(&self, label: &[u8], t: &Transcript, got: &[u8]) -> bool {
        bool::from(self.mac(label, t).as_slice().ct_eq(got))
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
    secret: ClusterSecret,
    me: Identity,
    nonce: [u8; NONCE_BYTES],
    state: State,
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
        secret: &ClusterSecret,
        me: Identity,
        peer_node_id: u64,
        nonce: [u8; NONCE_BYTES],
        out: &mut Vec<u8>,
    ) -> Handshake {
        write(Kind::Hello, me, &nonce, out);
        Handshake {
            secret: secret.clone(),
            me,
            nonce,
            state: State::DialerAwaitChallenge { peer_node_id },
        }
    }

    /// The accepting side; `peers` are the node ids allowed to connect.
    pub fn listener(
        secret: &ClusterSecret,
        me: Identity,
        peers: &[u64],
        nonce: [u8; NONCE_BYTES],
    ) -> Handshake {
        Handshake {
            secret: secret.clone(),
            me,
            nonce,
            state: State::ListenerAwaitHello {
                peers: peers.to_vec(),
            },
        }
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

    /// Listener, step 2: answers a Hello with the Challenge.
    fn on_hello(&self, dialer: Identity, body: &[u8], out: &mut Vec<u8>) -> Result<State, Refusal> {
        let nonce_d = body_of::<NONCE_BYTES>(Kind::Hello, body)?;
        if nonce_d == self.nonce {
            return Err(Refusal::ReflectedNonce);
        }
        let t = Transcript {
            dialer,
            listener: self.me,
            nonce_d,
            nonce_l: self.nonce,
        };
        let mut challenge = [0u8; NONCE_BYTES + MAC_BYTES];
        challenge[..NONCE_BYTES].copy_from_slice(&self.nonce);
        challenge[NONCE_BYTES..].copy_from_slice(&self.secret.mac(LABEL_LISTENER, &t));
        write(Kind::Challenge, self.me, &challenge, out);
        Ok(State::ListenerAwaitProof { dialer, nonce_d })
    }

    /// Dialer, step 3: verifies the Challenge, answers with the Proof.
    fn on_challenge(
        &self,
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
        let body = body_of::<{ NONCE_BYTES + MAC_BYTES }>(Kind::Challenge, body)?;
        let (nonce_l, mac_l) = body.split_at(NONCE_BYTES);
        let nonce_l: [u8; NONCE_BYTES] = nonce_l.try_into().expect("split at NONCE_BYTES");
        if nonce_l == self.nonce {
            return Err(Refusal::ReflectedNonce);
        }
        let t = Transcript {
            dialer: self.me,
            listener,
            nonce_d: self.nonce,
            nonce_l,
        };
        if !self.secret.verify(LABEL_LISTENER, &t, mac_l) {
            return Err(Refusal::BadMac);
        }
        write(
            Kind::Proof,
            self.me,
            &self.secret.mac(LABEL_DIALER, &t),
            out,
        );
        Ok(State::Done(Outcome::Established {
            peer_node_id: listener.node_id,
            peer_boot_id: listener.boot_id,
        }))
    }

    /// Listener, end: verifies the Proof.
    fn on_proof(
        &self,
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
        };
        if !self.secret.verify(LABEL_DIALER, &t, &mac_d) {
            return Err(Refusal::BadMac);
        }
        Ok(State::Done(Outcome::Established {
            peer_node_id: dialer.node_id,
            peer_boot_id: dialer.boot_id,
        }))
    }
}
