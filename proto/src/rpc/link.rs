//! The inter-node link machines, sans-IO: one [`Outbound`] per (shard, peer node)
//! that this shard dials, one [`Inbound`] per connection a peer dialed here. No
//! sockets, clocks or randomness: the caller passes `now_ms`, nonces and jitter,
//! feeds received bytes in, and moves the bytes appended to its `out` buffer to the
//! connection.
//!
//! # Roles (decided in issue 13)
//! - Every shard dials every peer node's RPC listener. A link carries requests
//!   (and one-way messages, and replies) from its **dialer** only; the listening side
//!   writes nothing after the handshake except a `Pong` to each `Ping`, and a
//!   `Goodbye` when it closes the link.
//! - A reply is an ordinary frame ([`Kind::Reply`] with the request id) sent on the
//!   **replier's own outbound link** to the requester's node ([`Outbound::send_reply`]);
//!   it may arrive on any shard's inbound link there. The request id names the
//!   requesting shard in its top 16 bits ([`request_shard`]): the receiving shard
//!   forwards the reply to that shard, whose outbound link to the replier holds the
//!   request ([`Outbound::complete`]).
//!
//! # Sealing
//! Every frame after the handshake, both ways, is sealed with the link's keys
//! ([`super::seal`]): the machines seal what they write and open what they read,
//! so a caller moves ciphertext only. A frame that does not open closes the link
//! ([`LinkCloseReason::Unauthentic`]); an inbound frame's plaintext body is
//! [`Inbound::body`].
//!
//! # Contract of both machines
//! - Input: call `on_input(bytes, ..)` with the connection's whole unconsumed input
//!   whenever new bytes arrived, then remove the step's `consumed` bytes from the
//!   front. A step reports at most one event; after an event other than a close or
//!   refusal, call again with the rest (it may hold more frames). A byte counts as
//!   heard from the peer when the input passed is longer than what the previous step
//!   left unconsumed, so pass exactly the remaining input each time.
//! - Closing: a `Close` or `Refused` event means "close this connection now": the
//!   machine has already appended a `Goodbye` with the reason to `out` (except when
//!   the peer said goodbye, or the handshake refusal already wrote one). Flush `out`,
//!   close, log the reason and count it. Feed nothing more from that connection.
//! - Timers: call `on_tick(now_ms, ..)` at or after `next_timer_ms()` (and whenever
//!   convenient: it is idempotent). Each call does work bounded by the in-flight
//!   limit.
//! - Silence: a connection from which no byte arrived for
//!   [`LinkLimits::rpc_peer_silence_ms`] is closed ([`LinkCloseReason::Silence`]),
//!   during the handshake too (it bounds the handshake's time).
//!
//! # Outbound, in addition
//! - States: `Down { retry_at_ms }` → [`Outbound::on_dial`] (Hello written) →
//!   handshaking → `Up { peer_boot_id }` ([`LinkEvent::Up`]) → a close event →
//!   closing → [`Outbound::on_closed`] → `Down` again, with an exponential backoff
//!   (from [`LinkLimits::rpc_backoff_min_ms`] to `rpc_backoff_ms_max`, jittered by
//!   the caller, back to the minimum after each successful handshake).
//! - Call [`Outbound::on_closed`] once per connection, when it is gone (a dial that
//!   failed, a connection the peer closed, or one closed after a close event): it
//!   fails every request in flight with [`Failure::LinkLost`].
//! - Requests are refused at once when the link is not up ([`Refused::Down`]: no
//!   queue, the caller fails fast), past [`LinkLimits::rpc_requests_in_flight_max`]
//!   ([`Refused::Full`]), or past [`LinkLimits::rpc_requests_in_flight_per_kind_max`]
//!   of its own kind ([`Refused::KindFull`]: one flow's storm leaves the table's
//!   rest to the others). Each request in flight ends exactly once: completed
//!   ([`Outbound::complete`] returns its token), expired ([`Failure::Deadline`]) or
//!   lost ([`Failure::LinkLost`]).
//! - Heartbeat: when up, a `Ping` (body: the `now_ms` of its sending) is written when
//!   nothing was written for [`LinkLimits::rpc_heartbeat_ms`] (so the listener hears
//!   the dialer), and also when nothing was read for that long and no Ping was sent
//!   since (so the dialer hears the listener even while it writes requests without
//!   pause: replies come back on another connection).

use std::collections::{BTreeSet, HashMap};

use super::auth::HANDSHAKE_FRAME_BYTES_MAX;
use super::auth::{ClusterKey, Handshake, Identity, Outcome, Refusal, SessionKeys, NONCE_BYTES};
use super::frame::{
    self, Frame, FrameError, FrameLimits, Header, Kind, PING_BODY_BYTES_MAX,
    RPC_FRAME_BYTES_MAX_DEFAULT,
};
use super::seal::{SealError, Unauthentic};
use super::{check_sender, SenderMismatch};

/// Default of [`LinkLimits::rpc_requests_in_flight_max`].
pub const RPC_REQUESTS_IN_FLIGHT_MAX_DEFAULT: usize = 4096;
/// Default of [`LinkLimits::rpc_requests_in_flight_per_kind_max`]: a quarter of
/// the table, so a storm of one flow (logins are three kinds: token lookup,
/// register, commit) leaves the rest of it to SENDs and lookups.
pub const RPC_REQUESTS_IN_FLIGHT_PER_KIND_MAX_DEFAULT: usize = 1024;
/// Default of [`LinkLimits::rpc_breaker_failures`].
pub const RPC_BREAKER_FAILURES_DEFAULT: u32 = 16;
/// Default of [`LinkLimits::rpc_breaker_cooldown_ms`].
pub const RPC_BREAKER_COOLDOWN_MS_DEFAULT: u64 = 3_000;
/// Default of [`LinkLimits::rpc_request_deadline_ms`].
pub const RPC_REQUEST_DEADLINE_MS_DEFAULT: u32 = 2_000;
/// Default of [`LinkLimits::rpc_heartbeat_ms`].
pub const RPC_HEARTBEAT_MS_DEFAULT: u64 = 500;
/// Default of [`LinkLimits::rpc_peer_silence_ms`].
pub const RPC_PEER_SILENCE_MS_DEFAULT: u64 = 3_000;
/// Default of [`LinkLimits::rpc_backoff_min_ms`].
pub const RPC_BACKOFF_MIN_MS_DEFAULT: u64 = 50;
/// Default of [`LinkLimits::rpc_backoff_ms_max`].
pub const RPC_BACKOFF_MAX_MS_DEFAULT: u64 = 2_000;
/// Default of [`LinkLimits::rpc_replies_held_max`].
pub const RPC_REPLIES_HELD_MAX_DEFAULT: usize = 1024;
/// Default of [`LinkLimits::rpc_replies_held_bytes_max`]: 1 MiB.
pub const RPC_REPLIES_HELD_BYTES_MAX_DEFAULT: usize = 1 << 20;
/// Default of [`LinkLimits::rpc_reply_margin_ms`].
pub const RPC_REPLY_MARGIN_MS_DEFAULT: u32 = 1;
/// Largest reason written in a `Goodbye` body, in bytes.
pub const GOODBYE_REASON_BYTES_MAX: usize = 256;

/// Bits of a request id below the requesting shard's number.
pub const REQUEST_COUNTER_BITS: u32 = 48;
const REQUEST_COUNTER_MASK: u64 = (1 << REQUEST_COUNTER_BITS) - 1;

/// The shard that sent the request `request_id` (its top 16 bits): a reply that
/// lands on another shard is forwarded there.
pub const fn request_shard(request_id: u64) -> u16 {
    (request_id >> REQUEST_COUNTER_BITS) as u16
}

/// The limits of one link (both sides). Every bound has its unit in its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LinkLimits {
    /// Requests in flight on one outbound link; more are refused ([`Refused::Full`]).
    pub rpc_requests_in_flight_max: usize,
    /// Requests of one kind in flight on one outbound link (at most
    /// `rpc_requests_in_flight_max`); more of that kind are refused
    /// ([`Refused::KindFull`]) while other kinds still get their place.
    pub rpc_requests_in_flight_per_kind_max: usize,
    /// Requests in a row that got no answer by their deadline (none answered in
    /// between) before the link's breaker opens: requests are then refused at once
    /// ([`Refused::Breaker`]) for `rpc_breaker_cooldown_ms`, then one goes as a
    /// probe; its answer closes the breaker, its deadline opens it again. A peer
    /// that answers Pings but not requests then costs its callers nothing but the
    /// refusal. 0: no breaker.
    pub rpc_breaker_failures: u32,
    /// How long an open breaker refuses requests before a probe.
    pub rpc_breaker_cooldown_ms: u64,
    /// The deadline of a request sent with `deadline_ms == 0`, in ms.
    pub rpc_request_deadline_ms: u32,
    /// An up outbound link writes a Ping after this long without writing (or
    /// without reading, see the module docs).
    pub rpc_heartbeat_ms: u64,
    /// A link from which no byte arrived for this long is closed (handshake
    /// included). Must exceed `rpc_heartbeat_ms` (a few heartbeats).
    pub rpc_peer_silence_ms: u64,
    /// The first pause before redialing a link that closed.
    pub rpc_backoff_min_ms: u64,
    /// The longest pause; each failure in a row doubles the pause up to it.
    pub rpc_backoff_ms_max: u64,
    /// Largest frame (header, body and the seal's 16-byte tag) sent or accepted
    /// after the handshake.
    pub rpc_frame_bytes_max: usize,
    /// Replies the node holds per outbound link while that link is not up with the
    /// process that asked (a peer that restarted dials this node and asks before
    /// this node has dialed it back): sent when the link comes up with that very
    /// process, dropped at the request's deadline (the one its frame carried).
    /// Past the limit a reply is dropped (the request fails at its deadline there).
    /// Not read by the link machines.
    pub rpc_replies_held_max: usize,
    /// The bytes of those held replies' bodies, per outbound link.
    pub rpc_replies_held_bytes_max: usize,
    /// The time taken for a reply to get back to its requester: a request of
    /// another node with no more than this left before its deadline is not run, and
    /// a reply with no more than this left is not sent (the requester has failed
    /// the request by then, or will before the reply arrives). Less than
    /// `rpc_request_deadline_ms`. Not read by the link machines.
    pub rpc_reply_margin_ms: u32,
}

impl Default for LinkLimits {
    fn default() -> Self {
        LinkLimits {
            rpc_requests_in_flight_max: RPC_REQUESTS_IN_FLIGHT_MAX_DEFAULT,
            rpc_requests_in_flight_per_kind_max: RPC_REQUESTS_IN_FLIGHT_PER_KIND_MAX_DEFAULT,
            rpc_request_deadline_ms: RPC_REQUEST_DEADLINE_MS_DEFAULT,
            rpc_heartbeat_ms: RPC_HEARTBEAT_MS_DEFAULT,
            rpc_peer_silence_ms: RPC_PEER_SILENCE_MS_DEFAULT,
            rpc_backoff_min_ms: RPC_BACKOFF_MIN_MS_DEFAULT,
            rpc_backoff_ms_max: RPC_BACKOFF_MAX_MS_DEFAULT,
            rpc_frame_bytes_max: RPC_FRAME_BYTES_MAX_DEFAULT,
            rpc_replies_held_max: RPC_REPLIES_HELD_MAX_DEFAULT,
            rpc_replies_held_bytes_max: RPC_REPLIES_HELD_BYTES_MAX_DEFAULT,
            rpc_reply_margin_ms: RPC_REPLY_MARGIN_MS_DEFAULT,
            rpc_breaker_failures: RPC_BREAKER_FAILURES_DEFAULT,
            rpc_breaker_cooldown_ms: RPC_BREAKER_COOLDOWN_MS_DEFAULT,
        }
    }
}

/// Link limits that cannot work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid rpc link limits: {0}")]
pub struct InvalidLinkLimits(pub &'static str);

impl LinkLimits {
    /// The codec limits of an established link.
    pub fn frame(&self) -> FrameLimits {
        FrameLimits {
            rpc_frame_bytes_max: self.rpc_frame_bytes_max,
        }
    }

    /// Checks the limits; the machines assume valid ones.
    pub fn validate(&self) -> Result<(), InvalidLinkLimits> {
        let checks = [
            (
                self.rpc_requests_in_flight_max >= 1,
                "rpc_requests_in_flight_max must be at least 1",
            ),
            (
                self.rpc_requests_in_flight_per_kind_max >= 1
                    && self.rpc_requests_in_flight_per_kind_max <= self.rpc_requests_in_flight_max,
                "rpc_requests_in_flight_per_kind_max must be at least 1 and at most \
                 rpc_requests_in_flight_max",
            ),
            (
                self.rpc_request_deadline_ms >= 1,
                "rpc_request_deadline_ms must be at least 1",
            ),
            (
                self.rpc_breaker_failures == 0 || self.rpc_breaker_cooldown_ms >= 1,
                "rpc_breaker_cooldown_ms must be at least 1 (or rpc_breaker_failures 0)",
            ),
            (
                self.rpc_reply_margin_ms < self.rpc_request_deadline_ms,
                "rpc_reply_margin_ms must be less than rpc_request_deadline_ms",
            ),
            (
                self.rpc_heartbeat_ms >= 1 && self.rpc_heartbeat_ms < self.rpc_peer_silence_ms,
                "rpc_heartbeat_ms must be at least 1 and less than rpc_peer_silence_ms",
            ),
            (
                self.rpc_backoff_min_ms >= 1 && self.rpc_backoff_min_ms <= self.rpc_backoff_ms_max,
                "rpc_backoff_min_ms must be at least 1 and at most rpc_backoff_ms_max",
            ),
            (
                self.rpc_frame_bytes_max >= HANDSHAKE_FRAME_BYTES_MAX,
                "rpc_frame_bytes_max must hold a handshake frame (296 bytes)",
            ),
        ];
        match checks.into_iter().find(|(ok, _)| !ok) {
            Some((_, why)) => Err(InvalidLinkLimits(why)),
            None => Ok(()),
        }
    }
}

/// Why a link asks to be closed (log it and count it).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LinkCloseReason {
    /// No byte from the peer for `rpc_peer_silence_ms`.
    #[error("no byte from the peer for {silent_ms} ms")]
    Silence {
        /// Time since the last byte heard.
        silent_ms: u64,
    },
    /// Bytes that are not a frame, or a frame over `rpc_frame_bytes_max`.
    #[error("bad frame: {0}")]
    Frame(#[from] FrameError),
    /// A frame with another node id or boot id than the authenticated peer's.
    #[error("{0}")]
    Sender(#[from] SenderMismatch),
    /// A frame this side of the link never receives after the handshake (a second
    /// Hello, a request on the dialer's side, a Pong on the listener's side...).
    #[error("unexpected {0:?} frame on an established link")]
    Unexpected(Kind),
    /// A Ping with a body over [`PING_BODY_BYTES_MAX`].
    #[error("Ping body of {body_bytes} bytes (at most {PING_BODY_BYTES_MAX})")]
    BadPing {
        /// Its body size.
        body_bytes: usize,
    },
    /// The peer said goodbye, with this reason (lossy UTF-8, at most 256 bytes).
    #[error("the peer said goodbye: {0}")]
    PeerGoodbye(String),
    /// A frame after the handshake that does not open with the link's key for its
    /// direction and its counter: altered on the way, replayed, reordered, or not
    /// from the authenticated peer.
    #[error("{0}")]
    Unauthentic(#[from] Unauthentic),
    /// The peer node came back with another boot id ([`Outbound::on_peer_boot`]).
    #[error("the peer restarted (boot {old_boot_id:#x} → {new_boot_id:#x})")]
    PeerRestarted {
        /// The boot id this link is up with.
        old_boot_id: u64,
        /// The boot id seen elsewhere.
        new_boot_id: u64,
    },
}

/// What happened on an outbound link.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkEvent {
    /// The handshake succeeded: requests may be sent.
    Up {
        /// The peer process's boot id.
        peer_boot_id: u64,
        /// The boot id differs from the one this link last saw: the peer restarted
        /// (its state about this node is gone).
        restarted: bool,
    },
    /// The handshake was refused (a Goodbye is in `out` unless the peer sent one):
    /// close the connection, then [`Outbound::on_closed`].
    Refused(Refusal),
    /// Close the connection (a Goodbye is in `out` unless the peer sent one), then
    /// [`Outbound::on_closed`].
    Close(LinkCloseReason),
}

/// The result of [`Outbound::on_input`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub struct LinkStep {
    /// Bytes of the input consumed.
    pub consumed: usize,
    /// What happened, if anything.
    pub event: Option<LinkEvent>,
}

/// Why a frame was not sent (nothing was written).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// The link is not up: fail fast (nothing is queued).
    #[error("the link is not up")]
    Down,
    /// `rpc_requests_in_flight_max` requests are in flight.
    #[error("{0} requests in flight (rpc_requests_in_flight_max)")]
    Full(usize),
    /// The link's breaker is open: `failures` requests in a row got no answer
    /// (`rpc_breaker_failures`); refused until a probe is answered.
    #[error("the peer answered none of the last {0} requests (breaker open)")]
    Breaker(u32),
    /// `rpc_requests_in_flight_per_kind_max` requests of this kind are in flight.
    #[error("{1} requests of kind {0:?} in flight (rpc_requests_in_flight_per_kind_max)")]
    KindFull(Kind, usize),
    /// Requests and one-way messages are kinds 16..=63 ([`Kind::is_hop`]).
    #[error("{0:?} is not a request kind")]
    NotAHop(Kind),
    /// The frame is over `rpc_frame_bytes_max`.
    #[error("{0}")]
    Frame(#[from] FrameError),
    /// The link sealed 2^64 frames: it must be dialed anew.
    #[error("the link's frame counter is spent")]
    CounterSpent,
}

impl From<SealError> for Refused {
    fn from(e: SealError) -> Refused {
        match e {
            SealError::Frame(e) => Refused::Frame(e),
            SealError::CounterSpent => Refused::CounterSpent,
        }
    }
}

/// How a request in flight failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// No reply before its deadline.
    Deadline,
    /// The link closed first (the peer may or may not have acted on it).
    LinkLost,
}

/// Where an outbound link stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkState {
    /// No connection; dial at or after `retry_at_ms` ([`Outbound::due_to_dial`]).
    Down {
        /// When to dial again.
        retry_at_ms: u64,
    },
    /// Hello written, waiting for the handshake to end.
    Handshaking,
    /// Authenticated: requests flow.
    Up {
        /// The peer process's boot id.
        peer_boot_id: u64,
    },
    /// A close event was reported; waiting for [`Outbound::on_closed`].
    Closing,
}

/// When the peer was last heard (see the module contract on input).
#[derive(Clone, Copy, Debug)]
struct Heard {
    last_ms: u64,
    unconsumed: usize,
}

impl Heard {
    fn new(now_ms: u64) -> Heard {
        Heard {
            last_ms: now_ms,
            unconsumed: 0,
        }
    }

    fn arrived(&mut self, input_bytes: usize, now_ms: u64) {
        if input_bytes > self.unconsumed {
            self.last_ms = now_ms;
        }
    }

    fn silence_at(&self, limits: &LinkLimits) -> u64 {
        self.last_ms.saturating_add(limits.rpc_peer_silence_ms)
    }

    fn silent(&self, now_ms: u64, limits: &LinkLimits) -> Option<LinkCloseReason> {
        (now_ms >= self.silence_at(limits)).then(|| LinkCloseReason::Silence {
            silent_ms: now_ms.saturating_sub(self.last_ms),
        })
    }
}

/// Appends one frame from `me`: sealed with the link's sending key once it has
/// keys (after the handshake), as is before.
#[allow(clippy::too_many_arguments)]
fn write(
    me: Identity,
    keys: Option<&mut SessionKeys>,
    kind: Kind,
    request_id: u64,
    deadline_ms: u32,
    body: &[u8],
    limits: FrameLimits,
    out: &mut Vec<u8>,
) -> Result<usize, SealError> {
    let header = Header {
        kind,
        flags: 0,
        sender_node_id: me.node_id,
        sender_boot_id: me.boot_id,
        request_id,
        deadline_ms,
    };
    match keys {
        Some(keys) => keys.send.seal(&header, body, limits, out),
        None => Ok(frame::encode(&header, body, limits, out)?),
    }
}

/// Opens the frame `f` at the start of `wire` with the link's receiving key: its
/// plaintext body.
fn open<'k>(
    keys: &'k mut Option<SessionKeys>,
    wire: &[u8],
    f: &Frame<'_>,
) -> Result<&'k [u8], LinkCloseReason> {
    match keys {
        Some(keys) => Ok(keys.recv.open(wire, f)?),
        // An established link always has its keys: treat the impossible as a
        // frame that does not open.
        None => Err(LinkCloseReason::Unauthentic(Unauthentic {
            kind: f.header.kind,
            counter: 0,
        })),
    }
}

/// Appends a Goodbye with `reason` (cut to [`GOODBYE_REASON_BYTES_MAX`] at a char
/// boundary), unless the peer said goodbye itself; sealed when the link has keys.
fn goodbye(
    me: Identity,
    keys: Option<&mut SessionKeys>,
    reason: &LinkCloseReason,
    limits: FrameLimits,
    out: &mut Vec<u8>,
) {
    if matches!(reason, LinkCloseReason::PeerGoodbye(_)) {
        return;
    }
    let text = reason.to_string();
    let mut end = text.len().min(GOODBYE_REASON_BYTES_MAX);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    // At most 296 bytes and a tag, and valid limits hold a handshake frame: fails
    // only past 2^64 frames.
    let written = write(
        me,
        keys,
        Kind::Goodbye,
        0,
        0,
        &text.as_bytes()[..end],
        limits,
        out,
    );
    debug_assert!(written.is_ok(), "goodbye refused: {written:?}");
}

fn peer_goodbye(body: &[u8]) -> LinkCloseReason {
    let body = &body[..body.len().min(GOODBYE_REASON_BYTES_MAX)];
    LinkCloseReason::PeerGoodbye(String::from_utf8_lossy(body).into_owned())
}

/// The absolute deadline, on the receiver's clock, of a request received at
/// `now_ms` (`None`: the frame carries no deadline).
pub fn deadline_at_ms(header: &Header, now_ms: u64) -> Option<u64> {
    (header.deadline_ms != 0).then(|| now_ms.saturating_add(u64::from(header.deadline_ms)))
}

struct Pending<T> {
    token: T,
    kind: Kind,
    deadline_at_ms: u64,
    peer_boot_id: u64,
}

/// The requests in flight of one link: a map by id and an ordered set by
/// (deadline, id), both at most `rpc_requests_in_flight_max` entries, and how many
/// of each kind (at most `rpc_requests_in_flight_per_kind_max` each).
struct InFlight<T> {
    by_id: HashMap<u64, Pending<T>>,
    by_deadline: BTreeSet<(u64, u64)>,
    /// By kind number (every kind is below 64: [`Kind::is_hop`]).
    by_kind: [u32; 64],
}

impl<T> InFlight<T> {
    fn new() -> InFlight<T> {
        InFlight {
            by_id: HashMap::new(),
            by_deadline: BTreeSet::new(),
            by_kind: [0; 64],
        }
    }

    fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Requests of `kind` in flight.
    fn of_kind(&self, kind: Kind) -> usize {
        self.by_kind[kind as usize] as usize
    }

    /// Forgets a request that ended (its kind's count goes down).
    fn ended(&mut self, pending: &Pending<T>) {
        let n = &mut self.by_kind[pending.kind as usize];
        debug_assert!(*n > 0, "a request of kind {:?} ended twice", pending.kind);
        *n = n.saturating_sub(1);
    }

    fn insert(&mut self, request_id: u64, pending: Pending<T>) {
        self.by_kind[pending.kind as usize] += 1;
        self.by_deadline
            .insert((pending.deadline_at_ms, request_id));
        let old = self.by_id.insert(request_id, pending);
        debug_assert!(old.is_none(), "request id {request_id:#x} reused in flight");
    }

    fn take(&mut self, request_id: u64, sender_boot_id: u64) -> Option<T> {
        let pending = self.by_id.get(&request_id)?;
        if pending.peer_boot_id != sender_boot_id {
            return None;
        }
        let pending = self.by_id.remove(&request_id)?;
        self.by_deadline
            .remove(&(pending.deadline_at_ms, request_id));
        self.ended(&pending);
        Some(pending.token)
    }

    fn earliest_deadline_ms(&self) -> Option<u64> {
        self.by_deadline.first().map(|(at, _)| *at)
    }

    /// Fails (earliest deadline first) every request due at `now_ms`, or every
    /// request when `now_ms` is `None`.
    fn fail(&mut self, now_ms: Option<u64>, why: Failure, failed: &mut Vec<(T, Failure)>) {
        while let Some(&(at, id)) = self.by_deadline.first() {
            if now_ms.is_some_and(|now| at > now) {
                break;
            }
            self.by_deadline.pop_first();
            if let Some(pending) = self.by_id.remove(&id) {
                self.ended(&pending);
                failed.push((pending.token, why));
            }
        }
        debug_assert!(now_ms.is_some() || self.by_id.is_empty());
    }
}

/// One link's breaker (`rpc_breaker_failures`, `rpc_breaker_cooldown_ms`).
#[derive(Default)]
struct Breaker {
    /// Requests in a row whose deadline passed without an answer.
    failures: u32,
    /// Open until then (`None`: closed).
    open_until_ms: Option<u64>,
    /// The request id of the probe in flight, once the cool-down passed.
    probe: Option<u64>,
}

/// What the breaker lets a request do.
enum Admit {
    Go,
    /// The cool-down passed: this request tries the peer.
    Probe,
    Refuse,
}

impl Breaker {
    fn admit(&self, now_ms: u64) -> Admit {
        match self.open_until_ms {
            None => Admit::Go,
            Some(until) if now_ms < until || self.probe.is_some() => Admit::Refuse,
            Some(_) => Admit::Probe,
        }
    }

    /// `expired` requests passed their deadline unanswered (the probe among them
    /// when `probe_expired`): counted; the breaker opens at the threshold, and
    /// again, for a whole cool-down, when the probe went unanswered.
    fn on_expired(&mut self, expired: u32, probe_expired: bool, now_ms: u64, limits: &LinkLimits) {
        if expired == 0 || limits.rpc_breaker_failures == 0 {
            return;
        }
        self.failures = self.failures.saturating_add(expired);
        if probe_expired {
            self.probe = None;
        }
        let reached = self.open_until_ms.is_none() && self.failures >= limits.rpc_breaker_failures;
        if reached || probe_expired {
            self.open_until_ms = Some(now_ms.saturating_add(limits.rpc_breaker_cooldown_ms));
        }
    }
}

enum State {
    Down { retry_at_ms: u64 },
    Handshaking(Box<Handshake>),
    Up { peer_boot_id: u64 },
    Closing,
}

/// One outbound link: this shard's connection to one peer node, its handshake,
/// heartbeat, reconnection schedule and requests in flight. `T` is the caller's
/// token for a request, handed back exactly once when the request ends.
pub struct Outbound<T> {
    key: ClusterKey,
    me: Identity,
    peer_node_id: u64,
    shard_prefix: u16,
    limits: LinkLimits,
    state: State,
    counter: u64,
    backoff_ms: u64,
    last_peer_boot_id: Option<u64>,
    heard: Heard,
    last_write_ms: u64,
    last_ping_ms: u64,
    rtt_ms: Option<u64>,
    in_flight: InFlight<T>,
    breaker: Breaker,
    /// The session keys while up (dropped, and so zeroized, when it closes).
    keys: Option<SessionKeys>,
}

impl<T> Outbound<T> {
    /// A link of shard `shard_prefix` (the top 16 bits of its request ids) toward
    /// `peer_node_id`, down and due to dial at once. `limits` must be valid
    /// ([`LinkLimits::validate`]).
    pub fn new(
        key: &ClusterKey,
        me: Identity,
        peer_node_id: u64,
        shard_prefix: u16,
        limits: LinkLimits,
    ) -> Outbound<T> {
        debug_assert_eq!(limits.validate(), Ok(()));
        Outbound {
            key: key.clone(),
            me,
            peer_node_id,
            shard_prefix,
            limits,
            state: State::Down { retry_at_ms: 0 },
            counter: 0,
            backoff_ms: limits.rpc_backoff_min_ms,
            last_peer_boot_id: None,
            heard: Heard::new(0),
            last_write_ms: 0,
            last_ping_ms: 0,
            rtt_ms: None,
            in_flight: InFlight::new(),
            breaker: Breaker::default(),
            keys: None,
        }
    }

    /// Where the link stands.
    pub fn state(&self) -> LinkState {
        match self.state {
            State::Down { retry_at_ms } => LinkState::Down { retry_at_ms },
            State::Handshaking(_) => LinkState::Handshaking,
            State::Up { peer_boot_id } => LinkState::Up { peer_boot_id },
            State::Closing => LinkState::Closing,
        }
    }

    /// The peer node this link dials.
    pub fn peer_node_id(&self) -> u64 {
        self.peer_node_id
    }

    /// The limits in force.
    pub fn limits(&self) -> &LinkLimits {
        &self.limits
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The pause the next close will schedule (before jitter).
    pub fn backoff_ms(&self) -> u64 {
        self.backoff_ms
    }

    /// The round trip of the last Pong, in ms.
    pub fn rtt_ms(&self) -> Option<u64> {
        self.rtt_ms
    }

    /// Whether the link is down and its retry time has come: connect, then
    /// [`Outbound::on_dial`].
    pub fn due_to_dial(&self, now_ms: u64) -> bool {
        matches!(self.state, State::Down { retry_at_ms } if now_ms >= retry_at_ms)
    }

    /// A connection to the peer is being opened: writes the Hello (with `nonce`,
    /// 32 random bytes from the caller) into `out`, the connection's first bytes.
    /// Returns false, writing nothing, unless the link is down (it may be before its
    /// retry time: the caller decides).
    pub fn on_dial(&mut self, nonce: [u8; NONCE_BYTES], now_ms: u64, out: &mut Vec<u8>) -> bool {
        if !matches!(self.state, State::Down { .. }) {
            return false;
        }
        let handshake = Handshake::dialer(&self.key, self.me, self.peer_node_id, nonce, out);
        self.state = State::Handshaking(Box::new(handshake));
        self.keys = None;
        self.heard = Heard::new(now_ms);
        self.last_write_ms = now_ms;
        true
    }

    /// Feeds the connection's unconsumed input (see the module contract); writes
    /// handshake answers into `out`.
    pub fn on_input(&mut self, bytes: &[u8], now_ms: u64, out: &mut Vec<u8>) -> LinkStep {
        self.heard.arrived(bytes.len(), now_ms);
        let step = match self.state {
            State::Handshaking(_) => self.handshake_input(bytes, now_ms, out),
            State::Up { peer_boot_id } => self.frames_input(bytes, peer_boot_id, now_ms, out),
            State::Down { .. } | State::Closing => LinkStep {
                consumed: bytes.len(),
                event: None,
            },
        };
        self.heard.unconsumed = bytes.len() - step.consumed;
        step
    }

    fn handshake_input(&mut self, bytes: &[u8], now_ms: u64, out: &mut Vec<u8>) -> LinkStep {
        let State::Handshaking(handshake) = &mut self.state else {
            unreachable!("handshake_input while not handshaking");
        };
        let step = handshake.receive(bytes, out);
        let event = match step.outcome {
            Outcome::Pending => None,
            Outcome::Refused(refusal) => {
                self.state = State::Closing;
                return LinkStep {
                    consumed: bytes.len(),
                    event: Some(LinkEvent::Refused(refusal)),
                };
            }
            Outcome::Established { peer_boot_id, .. } => {
                self.keys = handshake.take_keys();
                Some(self.established(peer_boot_id, now_ms))
            }
        };
        LinkStep {
            consumed: step.consumed,
            event,
        }
    }

    fn established(&mut self, peer_boot_id: u64, now_ms: u64) -> LinkEvent {
        let restarted = self.last_peer_boot_id.is_some_and(|b| b != peer_boot_id);
        self.last_peer_boot_id = Some(peer_boot_id);
        self.state = State::Up { peer_boot_id };
        self.backoff_ms = self.limits.rpc_backoff_min_ms;
        // The Proof was just written.
        self.last_write_ms = now_ms;
        self.last_ping_ms = now_ms;
        LinkEvent::Up {
            peer_boot_id,
            restarted,
        }
    }

    /// Up: only Pongs and a Goodbye come from the listener.
    fn frames_input(
        &mut self,
        bytes: &[u8],
        peer_boot_id: u64,
        now_ms: u64,
        out: &mut Vec<u8>,
    ) -> LinkStep {
        let peer = Identity {
            node_id: self.peer_node_id,
            boot_id: peer_boot_id,
        };
        let mut consumed = 0;
        let reason = loop {
            let f = match frame::decode(&bytes[consumed..], self.limits.frame()) {
                Ok(None) => {
                    return LinkStep {
                        consumed,
                        event: None,
                    }
                }
                Ok(Some(f)) => f,
                Err(e) => break LinkCloseReason::Frame(e),
            };
            let body = match open(&mut self.keys, &bytes[consumed..], &f) {
                Ok(body) => body,
                Err(reason) => break reason,
            };
            consumed += f.wire_len();
            if let Err(mismatch) = check_sender(&f.header, peer) {
                break LinkCloseReason::Sender(mismatch);
            }
            match f.header.kind {
                Kind::Pong => {
                    let sent = <[u8; 8]>::try_from(body).ok();
                    self.on_pong(sent, now_ms);
                }
                Kind::Goodbye => break peer_goodbye(body),
                kind => break LinkCloseReason::Unexpected(kind),
            }
        };
        LinkStep {
            consumed: bytes.len(),
            event: Some(self.close(reason, out)),
        }
    }

    fn on_pong(&mut self, sent: Option<[u8; 8]>, now_ms: u64) {
        if let Some(sent) = sent {
            self.rtt_ms = Some(now_ms.saturating_sub(u64::from_le_bytes(sent)));
        }
    }

    fn close(&mut self, reason: LinkCloseReason, out: &mut Vec<u8>) -> LinkEvent {
        goodbye(
            self.me,
            self.keys.as_mut(),
            &reason,
            self.limits.frame(),
            out,
        );
        self.state = State::Closing;
        self.keys = None;
        LinkEvent::Close(reason)
    }

    /// Another connection (an inbound link) authenticated the peer node with
    /// `peer_boot_id`. If this link is up with another boot id, the peer restarted
    /// and this connection is stale: returns a close event (Goodbye in `out`).
    pub fn on_peer_boot(&mut self, peer_boot_id: u64, out: &mut Vec<u8>) -> Option<LinkEvent> {
        let State::Up { peer_boot_id: old } = self.state else {
            return None;
        };
        (old != peer_boot_id).then(|| {
            let reason = LinkCloseReason::PeerRestarted {
                old_boot_id: old,
                new_boot_id: peer_boot_id,
            };
            self.close(reason, out)
        })
    }

    fn next_request_id(&mut self) -> u64 {
        self.counter = (self.counter + 1) & REQUEST_COUNTER_MASK;
        if self.counter == 0 {
            self.counter = 1;
        }
        (u64::from(self.shard_prefix) << REQUEST_COUNTER_BITS) | self.counter
    }

    /// Sends a request of `kind` (16..=63) with `body`, to be answered within
    /// `deadline_ms` (0: [`LinkLimits::rpc_request_deadline_ms`]); the deadline
    /// travels relative, the receiver adds its own clock. Returns its request id, or
    /// the token back with why nothing was written.
    pub fn request(
        &mut self,
        kind: Kind,
        body: &[u8],
        deadline_ms: u32,
        token: T,
        now_ms: u64,
        out: &mut Vec<u8>,
    ) -> Result<u64, (Refused, T)> {
        let peer_boot_id = match Self::check_hop(kind).and_then(|()| self.up_boot_id()) {
            Ok(boot) => boot,
            Err(refused) => return Err((refused, token)),
        };
        if self.in_flight.len() >= self.limits.rpc_requests_in_flight_max {
            return Err((Refused::Full(self.in_flight.len()), token));
        }
        let of_kind = self.in_flight.of_kind(kind);
        if of_kind >= self.limits.rpc_requests_in_flight_per_kind_max {
            return Err((Refused::KindFull(kind, of_kind), token));
        }
        let probe = match self.breaker.admit(now_ms) {
            Admit::Go => false,
            Admit::Probe => true,
            Admit::Refuse => return Err((Refused::Breaker(self.breaker.failures), token)),
        };
        let deadline_ms = match deadline_ms {
            0 => self.limits.rpc_request_deadline_ms,
            ms => ms,
        };
        let request_id = self.next_request_id();
        let frame = self.limits.frame();
        let keys = self.keys.as_mut();
        if let Err(e) = write(
            self.me,
            keys,
            kind,
            request_id,
            deadline_ms,
            body,
            frame,
            out,
        ) {
            return Err((e.into(), token));
        }
        self.last_write_ms = now_ms;
        let pending = Pending {
            token,
            kind,
            deadline_at_ms: now_ms.saturating_add(u64::from(deadline_ms)),
            peer_boot_id,
        };
        self.in_flight.insert(request_id, pending);
        if probe {
            self.breaker.probe = Some(request_id);
        }
        Ok(request_id)
    }

    fn check_hop(kind: Kind) -> Result<(), Refused> {
        if kind.is_hop() {
            Ok(())
        } else {
            Err(Refused::NotAHop(kind))
        }
    }

    /// The peer's boot id if the link is up.
    fn up_boot_id(&self) -> Result<u64, Refused> {
        match self.state {
            State::Up { peer_boot_id } => Ok(peer_boot_id),
            _ => Err(Refused::Down),
        }
    }

    /// Sends a one-way message of `kind` (16..=63; request id 0, no deadline).
    pub fn oneway(
        &mut self,
        kind: Kind,
        body: &[u8],
        now_ms: u64,
        out: &mut Vec<u8>,
    ) -> Result<(), Refused> {
        Self::check_hop(kind)?;
        self.up_boot_id()?;
        let frame = self.limits.frame();
        write(self.me, self.keys.as_mut(), kind, 0, 0, body, frame, out)?;
        self.last_write_ms = now_ms;
        Ok(())
    }

    /// Sends the reply to the peer's request `request_id` ([`Kind::Reply`]). The
    /// requester matches it with [`Outbound::complete`] on its own link.
    pub fn send_reply(
        &mut self,
        request_id: u64,
        body: &[u8],
        now_ms: u64,
        out: &mut Vec<u8>,
    ) -> Result<(), Refused> {
        self.up_boot_id()?;
        let frame = self.limits.frame();
        let keys = self.keys.as_mut();
        write(self.me, keys, Kind::Reply, request_id, 0, body, frame, out)?;
        self.last_write_ms = now_ms;
        Ok(())
    }

    /// A reply to `request_id` arrived from the process `sender_boot_id` (the
    /// frame's checked sender). Call it on the link of shard
    /// [`request_shard`]`(request_id)` toward the reply's sender node (request ids
    /// are counted per link). Returns the request's token if it is in flight and
    /// was sent to that very process; `None` otherwise (late, duplicate, or from
    /// another boot of the peer: the caller counts it and drops the reply).
    pub fn complete(&mut self, request_id: u64, sender_boot_id: u64) -> Option<T> {
        let token = self.in_flight.take(request_id, sender_boot_id)?;
        // An answer: the peer serves requests (the breaker closes).
        self.breaker = Breaker::default();
        Some(token)
    }

    /// Timers: fails the requests whose deadline passed ([`Failure::Deadline`],
    /// pushed to `failed`), writes a Ping when one is due, and asks to close a
    /// silent connection (Goodbye in `out`).
    pub fn on_tick(
        &mut self,
        now_ms: u64,
        out: &mut Vec<u8>,
        failed: &mut Vec<(T, Failure)>,
    ) -> Option<LinkEvent> {
        let before = failed.len();
        self.in_flight.fail(Some(now_ms), Failure::Deadline, failed);
        let expired = (failed.len() - before) as u32;
        let probe_expired =
            (self.breaker.probe).is_some_and(|id| !self.in_flight.by_id.contains_key(&id));
        self.breaker
            .on_expired(expired, probe_expired, now_ms, &self.limits);
        if !matches!(self.state, State::Handshaking(_) | State::Up { .. }) {
            return None;
        }
        if let Some(reason) = self.heard.silent(now_ms, &self.limits) {
            return Some(self.close(reason, out));
        }
        if matches!(self.state, State::Up { .. }) && now_ms >= self.ping_at_ms() {
            let stamp = now_ms.to_le_bytes();
            // 8 bytes and a tag: within any valid frame limit (fails only past 2^64
            // frames).
            let frame = self.limits.frame();
            let keys = self.keys.as_mut();
            let written = write(self.me, keys, Kind::Ping, 0, 0, &stamp, frame, out);
            debug_assert!(written.is_ok(), "ping refused: {written:?}");
            self.last_write_ms = now_ms;
            self.last_ping_ms = now_ms;
        }
        None
    }

    /// When the next Ping is due (up only).
    fn ping_at_ms(&self) -> u64 {
        let heartbeat = self.limits.rpc_heartbeat_ms;
        let idle_write = self.last_write_ms.saturating_add(heartbeat);
        let idle_read = self
            .heard
            .last_ms
            .max(self.last_ping_ms)
            .saturating_add(heartbeat);
        idle_write.min(idle_read)
    }

    /// The earliest instant at which [`Outbound::on_tick`] (or, when down,
    /// [`Outbound::due_to_dial`]) has something to do; `None`: nothing until an
    /// input or a call.
    pub fn next_timer_ms(&self) -> Option<u64> {
        let link = match self.state {
            State::Down { retry_at_ms } => Some(retry_at_ms),
            State::Handshaking(_) => Some(self.heard.silence_at(&self.limits)),
            State::Up { .. } => Some(self.heard.silence_at(&self.limits).min(self.ping_at_ms())),
            State::Closing => None,
        };
        match (link, self.in_flight.earliest_deadline_ms()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The connection is gone (a failed dial, a close by the peer, or one closed
    /// after a close event). Fails every request in flight ([`Failure::LinkLost`])
    /// and schedules the next dial after the current backoff, shortened by
    /// `jitter_ms % (backoff / 2 + 1)` (any random number from the caller: the pause
    /// lies in [backoff / 2, backoff]); the backoff then doubles, up to
    /// `rpc_backoff_ms_max`. Does nothing when already down.
    pub fn on_closed(&mut self, now_ms: u64, jitter_ms: u64, failed: &mut Vec<(T, Failure)>) {
        if matches!(self.state, State::Down { .. }) {
            return;
        }
        self.in_flight.fail(None, Failure::LinkLost, failed);
        // A probe lost with its link proves nothing: the next request probes.
        self.breaker.probe = None;
        self.keys = None;
        let pause_ms = self.backoff_ms - jitter_ms % (self.backoff_ms / 2 + 1);
        self.state = State::Down {
            retry_at_ms: now_ms.saturating_add(pause_ms),
        };
        self.backoff_ms = self
            .backoff_ms
            .saturating_mul(2)
            .min(self.limits.rpc_backoff_ms_max);
    }
}

/// What happened on an inbound link.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InboundEvent {
    /// The dialer is authenticated (frames may follow in the rest of the input).
    Established(Identity),
    /// A request, one-way message or reply from the authenticated peer, opened
    /// with the link's key and checked with [`check_sender`]: its plaintext body is
    /// [`Inbound::body`] until the next step. Control frames never come out here.
    Frame {
        /// The header (kind 16..=63 or [`Kind::Reply`]).
        header: Header,
    },
    /// The handshake was refused (a Goodbye is in `out` unless the peer sent one):
    /// close the connection.
    Refused(Refusal),
    /// Close the connection (a Goodbye is in `out` unless the peer sent one).
    Close(LinkCloseReason),
}

/// The result of [`Inbound::on_input`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub struct InboundStep {
    /// Bytes of the input consumed (a frame event's frame included).
    pub consumed: usize,
    /// What happened, if anything.
    pub event: Option<InboundEvent>,
}

enum InState {
    Handshaking(Box<Handshake>),
    Up(Identity),
    Closed,
}

/// One inbound link: a connection a peer node dialed to this node's RPC listener.
/// It authenticates the dialer, then hands the caller one frame at a time; it
/// answers Pings itself and writes nothing else but a Goodbye when it closes.
pub struct Inbound {
    me: Identity,
    limits: LinkLimits,
    state: InState,
    heard: Heard,
    /// The session keys while up (dropped, and so zeroized, when it closes).
    keys: Option<SessionKeys>,
}

impl Inbound {
    /// A connection accepted at `now_ms` (its silence is counted from then);
    /// `peers` are the node ids allowed to dial, `nonce` 32 random bytes from the
    /// caller. `limits` must be valid.
    pub fn new(
        key: &ClusterKey,
        me: Identity,
        peers: &[u64],
        nonce: [u8; NONCE_BYTES],
        limits: LinkLimits,
        now_ms: u64,
    ) -> Inbound {
        debug_assert_eq!(limits.validate(), Ok(()));
        Inbound {
            me,
            limits,
            state: InState::Handshaking(Box::new(Handshake::listener(key, me, peers, nonce))),
            heard: Heard::new(now_ms),
            keys: None,
        }
    }

    /// The plaintext body of the frame the last step handed up
    /// ([`InboundEvent::Frame`]), until the next step; meaningless after any other
    /// event.
    pub fn body(&self) -> &[u8] {
        self.keys.as_ref().map_or(&[], |k| k.recv.body())
    }

    /// The authenticated peer, once established.
    pub fn peer(&self) -> Option<Identity> {
        match self.state {
            InState::Up(peer) => Some(peer),
            _ => None,
        }
    }

    /// Whether a close or refusal was reported (the machine ignores further input).
    pub fn is_closed(&self) -> bool {
        matches!(self.state, InState::Closed)
    }

    /// Feeds the connection's unconsumed input (see the module contract); writes
    /// the handshake's Challenge, Pongs and a Goodbye into `out`.
    pub fn on_input(&mut self, bytes: &[u8], now_ms: u64, out: &mut Vec<u8>) -> InboundStep {
        self.heard.arrived(bytes.len(), now_ms);
        let step = match self.state {
            InState::Handshaking(_) => self.handshake_input(bytes, out),
            InState::Up(peer) => self.frames_input(bytes, peer, out),
            InState::Closed => InboundStep {
                consumed: bytes.len(),
                event: None,
            },
        };
        self.heard.unconsumed = bytes.len() - step.consumed;
        step
    }

    fn handshake_input(&mut self, bytes: &[u8], out: &mut Vec<u8>) -> InboundStep {
        let InState::Handshaking(handshake) = &mut self.state else {
            unreachable!("handshake_input while not handshaking");
        };
        let step = handshake.receive(bytes, out);
        match step.outcome {
            Outcome::Pending => InboundStep {
                consumed: step.consumed,
                event: None,
            },
            Outcome::Refused(refusal) => {
                self.state = InState::Closed;
                InboundStep {
                    consumed: bytes.len(),
                    event: Some(InboundEvent::Refused(refusal)),
                }
            }
            Outcome::Established {
                peer_node_id,
                peer_boot_id,
            } => {
                let peer = Identity {
                    node_id: peer_node_id,
                    boot_id: peer_boot_id,
                };
                self.keys = handshake.take_keys();
                self.state = InState::Up(peer);
                InboundStep {
                    consumed: step.consumed,
                    event: Some(InboundEvent::Established(peer)),
                }
            }
        }
    }

    fn frames_input(&mut self, bytes: &[u8], peer: Identity, out: &mut Vec<u8>) -> InboundStep {
        let mut consumed = 0;
        let reason = loop {
            let f = match frame::decode(&bytes[consumed..], self.limits.frame()) {
                Ok(None) => {
                    return InboundStep {
                        consumed,
                        event: None,
                    }
                }
                Ok(Some(f)) => f,
                Err(e) => break LinkCloseReason::Frame(e),
            };
            let start = consumed;
            consumed += f.wire_len();
            match self.on_frame(&bytes[start..], f, peer, out) {
                Ok(false) => {}
                Ok(true) => {
                    let event = InboundEvent::Frame { header: f.header };
                    return InboundStep {
                        consumed,
                        event: Some(event),
                    };
                }
                Err(reason) => break reason,
            }
        };
        self.close(&reason, out);
        InboundStep {
            consumed: bytes.len(),
            event: Some(InboundEvent::Close(reason)),
        }
    }

    /// Writes a Goodbye with `reason` (sealed when up) and closes; the keys are
    /// dropped.
    fn close(&mut self, reason: &LinkCloseReason, out: &mut Vec<u8>) {
        goodbye(
            self.me,
            self.keys.as_mut(),
            reason,
            self.limits.frame(),
            out,
        );
        self.state = InState::Closed;
        self.keys = None;
    }

    /// Opens the frame `f` (at the start of `wire`), then handles a control frame
    /// (`Ok(false)`), passes a hop or reply on (`Ok(true)`), or says why the link
    /// must close.
    fn on_frame(
        &mut self,
        wire: &[u8],
        f: Frame<'_>,
        peer: Identity,
        out: &mut Vec<u8>,
    ) -> Result<bool, LinkCloseReason> {
        let body = open(&mut self.keys, wire, &f)?;
        check_sender(&f.header, peer)?;
        match f.header.kind {
            Kind::Ping if body.len() > PING_BODY_BYTES_MAX => Err(LinkCloseReason::BadPing {
                body_bytes: body.len(),
            }),
            Kind::Ping => {
                let mut echo = [0u8; PING_BODY_BYTES_MAX];
                let echo = &mut echo[..body.len()];
                echo.copy_from_slice(body);
                let frame = self.limits.frame();
                // At most 64 bytes of body and a tag: within any valid frame limit
                // (fails only past 2^64 frames).
                let keys = self.keys.as_mut();
                let written = write(self.me, keys, Kind::Pong, 0, 0, echo, frame, out);
                debug_assert!(written.is_ok(), "pong refused: {written:?}");
                Ok(false)
            }
            Kind::Goodbye => Err(peer_goodbye(body)),
            kind if kind.is_control() => Err(LinkCloseReason::Unexpected(kind)),
            _ => Ok(true),
        }
    }

    /// Timers: asks to close a connection silent for `rpc_peer_silence_ms`
    /// (Goodbye in `out`).
    pub fn on_tick(&mut self, now_ms: u64, out: &mut Vec<u8>) -> Option<InboundEvent> {
        if self.is_closed() {
            return None;
        }
        let reason = self.heard.silent(now_ms, &self.limits)?;
        self.close(&reason, out);
        Some(InboundEvent::Close(reason))
    }

    /// When [`Inbound::on_tick`] has something to do (`None` once closed).
    pub fn next_timer_ms(&self) -> Option<u64> {
        (!self.is_closed()).then(|| self.heard.silence_at(&self.limits))
    }
}
