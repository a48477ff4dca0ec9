//! The inter-node link machines (`proto::rpc::link`), a dialer's `Outbound` and a
//! listener's `Inbound` wired byte to byte in memory, time passed by hand:
//! handshake → up; a request reaches the listener with its kind, id and deadline,
//! its reply (written by the other node's own outbound link) completes it; deadlines,
//! the in-flight bound, a lost link, backoff, a peer restart, heartbeats, silence,
//! garbage and a wrong secret; arbitrary splits of both byte streams.
//!
//! Seeds: `RPC_TEST_SEED=<u64>` replays a run; every failure message names its seed.

use hmac::{Hmac, Mac};
use proto::rpc::auth::NONCE_BYTES;
use proto::rpc::frame::{decode, encode, FrameError, Header, Kind, HEADER_BYTES};
use proto::rpc::link::{deadline_at_ms, request_shard, InvalidLinkLimits};
use proto::rpc::seal::TAG_BYTES;
use proto::rpc::{
    ClusterId, ClusterKey, ClusterSecret, Failure, Identity, Inbound, InboundEvent,
    LinkCloseReason, LinkEvent, LinkLimits, LinkState, Outbound, Refusal, Refused, SenderMismatch,
};
use proto::rpc::{Handshake, SessionKeys, Unauthentic};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sha2::Sha256;

const SECRET: &[u8] = b"the cluster secret, 32 bytes ok.";
const A: Identity = Identity {
    node_id: 1,
    boot_id: 0xa1a1,
};
const B: Identity = Identity {
    node_id: 2,
    boot_id: 0xb1b1,
};
/// The shard of node A whose links these are.
const SHARD: u16 = 7;

fn seed() -> u64 {
    std::env::var("RPC_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x1313_2027)
}

const CLUSTER: &str = "link-test";
const SLOT_IDS: u32 = 64;

/// The key of the test cluster with the secret `bytes`.
fn secret(bytes: &[u8]) -> ClusterKey {
    key(bytes, CLUSTER)
}

fn key(bytes: &[u8], cluster: &str) -> ClusterKey {
    let id = ClusterId::new(cluster).unwrap();
    ClusterKey::new(ClusterSecret::new(bytes).unwrap(), id, SLOT_IDS)
}

/// The documented terms of the test cluster (id padded to 32 bytes, slot ids).
fn terms() -> Vec<u8> {
    let mut t = CLUSTER.as_bytes().to_vec();
    t.resize(32, 0);
    t.extend_from_slice(&SLOT_IDS.to_le_bytes());
    t
}

fn limits() -> LinkLimits {
    LinkLimits::default()
}

/// One connection: `from`'s outbound link dialing `to`'s listener.
struct Wire {
    link: Outbound<u32>,
    inbound: Inbound,
    /// Written by the dialer, not delivered yet.
    sent_l: Vec<u8>,
    /// Delivered to the listener, unconsumed.
    rx_l: Vec<u8>,
    /// Written by the listener, not delivered yet.
    sent_d: Vec<u8>,
    /// Delivered to the dialer, unconsumed.
    rx_d: Vec<u8>,
    /// Frames the listener handed up (header, body).
    frames: Vec<(Header, Vec<u8>)>,
    link_events: Vec<LinkEvent>,
    inbound_events: Vec<InboundEvent>,
}

impl Wire {
    /// `link` dials `to` (whose listener has `listener_secret`) at `now`.
    fn new(
        mut link: Outbound<u32>,
        to: Identity,
        listener_secret: &ClusterKey,
        rng: &mut StdRng,
        now: u64,
    ) -> Wire {
        let mut sent_l = Vec::new();
        assert!(link.on_dial(rng.gen(), now, &mut sent_l));
        let peers = [A.node_id, B.node_id, 3];
        let inbound = Inbound::new(listener_secret, to, &peers, rng.gen(), limits(), now);
        Wire {
            link,
            inbound,
            sent_l,
            rx_l: Vec::new(),
            sent_d: Vec::new(),
            rx_d: Vec::new(),
            frames: Vec::new(),
            link_events: Vec::new(),
            inbound_events: Vec::new(),
        }
    }

    /// Feeds the listener what was delivered to it; true if it consumed anything.
    fn feed_listener(&mut self, now: u64) -> bool {
        let mut moved = false;
        loop {
            let step = self.inbound.on_input(&self.rx_l, now, &mut self.sent_d);
            match &step.event {
                Some(InboundEvent::Frame { header }) => {
                    self.frames.push((*header, self.inbound.body().to_vec()));
                }
                Some(event) => self.inbound_events.push(event.clone()),
                None => {}
            }
            self.rx_l.drain(..step.consumed);
            moved |= step.consumed > 0;
            if step.event.is_none() {
                return moved;
            }
        }
    }

    /// Feeds the dialer what was delivered to it; true if it consumed anything.
    fn feed_dialer(&mut self, now: u64) -> bool {
        let mut moved = false;
        loop {
            let step = self.link.on_input(&self.rx_d, now, &mut self.sent_l);
            self.rx_d.drain(..step.consumed);
            moved |= step.consumed > 0;
            match step.event {
                Some(event) => self.link_events.push(event),
                None => return moved,
            }
        }
    }

    /// Delivers at most `max` bytes each way, then lets both sides read.
    fn step(&mut self, now: u64, max: usize) -> bool {
        let n = self.sent_l.len().min(max);
        self.rx_l.extend(self.sent_l.drain(..n));
        let m = self.sent_d.len().min(max);
        self.rx_d.extend(self.sent_d.drain(..m));
        let fed = self.feed_listener(now) | self.feed_dialer(now);
        fed || n > 0 || m > 0
    }

    /// Delivers everything both ways until nothing moves.
    fn pump(&mut self, now: u64) {
        while self.step(now, usize::MAX) {}
    }
}

fn new_link(shard: u16, me: Identity, peer: Identity, limits: LinkLimits) -> Outbound<u32> {
    Outbound::new(&secret(SECRET), me, peer.node_id, shard, limits)
}

/// A's link to B, up at `now`.
fn up(rng: &mut StdRng, limits: LinkLimits, now: u64) -> Wire {
    let mut w = Wire::new(new_link(SHARD, A, B, limits), B, &secret(SECRET), rng, now);
    w.pump(now);
    assert_eq!(w.inbound_events, vec![InboundEvent::Established(A)]);
    assert_eq!(
        w.link_events,
        vec![LinkEvent::Up {
            peer_boot_id: B.boot_id,
            restarted: false
        }]
    );
    w.link_events.clear();
    w.inbound_events.clear();
    w
}

/// The frames in `bytes` (all whole).
fn frames_in(mut bytes: &[u8]) -> Vec<(Header, Vec<u8>)> {
    let mut frames = Vec::new();
    while let Some(f) = decode(bytes, limits().frame()).unwrap() {
        frames.push((f.header, f.body.to_vec()));
        bytes = &bytes[f.wire_len()..];
    }
    assert!(bytes.is_empty(), "a partial frame left");
    frames
}

fn kinds(bytes: &[u8]) -> Vec<Kind> {
    frames_in(bytes).into_iter().map(|(h, _)| h.kind).collect()
}

fn frame_from(me: Identity, kind: Kind, request_id: u64, body: &[u8]) -> Vec<u8> {
    let header = Header {
        kind,
        flags: 0,
        sender_node_id: me.node_id,
        sender_boot_id: me.boot_id,
        request_id,
        deadline_ms: 0,
    };
    let mut out = Vec::new();
    encode(&header, body, limits().frame(), &mut out).unwrap();
    out
}

#[test]
fn a_request_reaches_the_listener_and_its_reply_on_the_other_link_completes_it() {
    let seed = seed();
    let rng = &mut StdRng::seed_from_u64(seed);
    let mut ab = up(rng, limits(), 1_000);
    let id = ab
        .link
        .request(
            Kind::ForwardedSend,
            b"send",
            1_500,
            11,
            1_000,
            &mut ab.sent_l,
        )
        .unwrap();
    assert_eq!(request_shard(id), SHARD, "seed {seed}");
    assert_eq!(id & 0xffff_ffff_ffff, 1, "the first id of the link");
    ab.link
        .oneway(Kind::TouchBatch, b"touches", 1_000, &mut ab.sent_l)
        .unwrap();
    ab.pump(1_010);
    let (h, body) = &ab.frames[0];
    assert_eq!(
        (h.kind, h.request_id, h.deadline_ms),
        (Kind::ForwardedSend, id, 1_500)
    );
    assert_eq!(
        (h.sender_node_id, h.sender_boot_id, &body[..]),
        (A.node_id, A.boot_id, &b"send"[..])
    );
    assert_eq!(deadline_at_ms(h, 1_010), Some(2_510));
    let (h, body) = &ab.frames[1];
    assert_eq!(
        (h.kind, h.request_id, h.deadline_ms, &body[..]),
        (Kind::TouchBatch, 0, 0, &b"touches"[..])
    );
    assert_eq!(deadline_at_ms(h, 1_010), None);
    assert!(
        ab.sent_d.is_empty() && ab.rx_d.is_empty(),
        "the listener writes nothing"
    );

    // B answers on its own link to A; A's listener hands the reply up.
    let mut ba = Wire::new(new_link(0, B, A, limits()), A, &secret(SECRET), rng, 1_010);
    ba.pump(1_010);
    ba.link
        .send_reply(id, b"ack", 1_010, &mut ba.sent_l)
        .unwrap();
    ba.pump(1_020);
    let (h, body) = &ba.frames[0];
    assert_eq!(
        (h.kind, h.request_id, &body[..]),
        (Kind::Reply, id, &b"ack"[..])
    );
    assert_eq!(request_shard(h.request_id), SHARD);
    assert_eq!(ab.link.in_flight(), 1);
    assert_eq!(
        ab.link.complete(h.request_id, h.sender_boot_id),
        Some(11),
        "seed {seed}"
    );
    assert_eq!(
        ab.link.complete(h.request_id, h.sender_boot_id),
        None,
        "a duplicate"
    );
    assert_eq!(ab.link.in_flight(), 0);
    assert_eq!(
        ab.link.next_timer_ms(),
        Some(1_500),
        "only the heartbeat is left"
    );
}

#[test]
fn an_expired_request_fails_with_deadline_and_its_late_reply_is_refused() {
    let seed = seed();
    let rng = &mut StdRng::seed_from_u64(seed);
    let mut w = up(rng, limits(), 0);
    let short = w
        .link
        .request(Kind::Push, b"", 300, 1, 0, &mut w.sent_l)
        .unwrap();
    let default = w
        .link
        .request(Kind::Push, b"", 0, 2, 0, &mut w.sent_l)
        .unwrap();
    w.pump(0);
    assert_eq!(
        w.frames[1].0.deadline_ms, 2_000,
        "0 = rpc_request_deadline_ms"
    );
    assert_eq!(w.link.next_timer_ms(), Some(300), "seed {seed}");
    let mut failed = Vec::new();
    assert_eq!(w.link.on_tick(299, &mut w.sent_l, &mut failed), None);
    assert!(failed.is_empty());
    assert_eq!(w.link.on_tick(300, &mut w.sent_l, &mut failed), None);
    assert_eq!(failed, vec![(1, Failure::Deadline)]);
    assert_eq!(w.link.complete(short, B.boot_id), None, "late");
    // Keep the link alive with heartbeats up to the default deadline.
    let mut now = 300;
    while let Some(at) = w.link.next_timer_ms().filter(|at| *at <= 2_000) {
        now = at;
        assert_eq!(w.link.on_tick(now, &mut w.sent_l, &mut failed), None);
        w.pump(now);
    }
    assert_eq!(now, 2_000);
    assert_eq!(failed, vec![(1, Failure::Deadline), (2, Failure::Deadline)]);
    assert_eq!(w.link.complete(default, B.boot_id), None);
    assert_eq!(
        w.link.state(),
        LinkState::Up {
            peer_boot_id: B.boot_id
        }
    );
}

#[test]
fn requests_are_refused_when_down_full_or_not_a_request_and_nothing_is_written() {
    let seed = seed();
    let rng = &mut StdRng::seed_from_u64(seed);
    let mut link = new_link(SHARD, A, B, limits());
    let mut out = Vec::new();
    assert_eq!(
        link.request(Kind::Push, b"x", 0, 5, 0, &mut out),
        Err((Refused::Down, 5))
    );
    assert_eq!(
        link.oneway(Kind::Push, b"x", 0, &mut out),
        Err(Refused::Down)
    );
    assert_eq!(link.send_reply(9, b"x", 0, &mut out), Err(Refused::Down));
    assert!(out.is_empty());

    let small = LinkLimits {
        rpc_requests_in_flight_max: 3,
        rpc_requests_in_flight_per_kind_max: 3,
        ..limits()
    };
    let mut w = up(rng, small, 0);
    let ids: Vec<u64> = (0..3)
        .map(|t| {
            w.link
                .request(Kind::Push, b"x", 0, t, 0, &mut w.sent_l)
                .unwrap()
        })
        .collect();
    let written = w.sent_l.len();
    let full = w.link.request(Kind::Push, b"x", 0, 3, 0, &mut w.sent_l);
    assert_eq!(full, Err((Refused::Full(3), 3)), "seed {seed}");
    for kind in [Kind::Reply, Kind::Ping, Kind::Hello] {
        assert_eq!(
            w.link.request(kind, b"", 0, 4, 0, &mut w.sent_l),
            Err((Refused::NotAHop(kind), 4))
        );
        assert_eq!(
            w.link.oneway(kind, b"", 0, &mut w.sent_l),
            Err(Refused::NotAHop(kind))
        );
    }
    // Room again once one completed; one-way messages do not count.
    assert_eq!(w.link.complete(ids[1], B.boot_id), Some(1));
    let big = vec![0; limits().rpc_frame_bytes_max];
    let too_large = w.link.request(Kind::Push, &big, 0, 6, 0, &mut w.sent_l);
    assert!(matches!(
        too_large,
        Err((Refused::Frame(FrameError::TooLarge { .. }), 6))
    ));
    assert_eq!(
        w.sent_l.len(),
        written,
        "nothing written for a refused request"
    );
    w.link.oneway(Kind::Push, b"y", 0, &mut w.sent_l).unwrap();
    assert!(w
        .link
        .request(Kind::Push, b"x", 0, 7, 0, &mut w.sent_l)
        .is_ok());
    assert_eq!(w.link.in_flight(), 3);
}

/// Issue 26 item 5: one kind (a login storm's registers) fills at most its quota
/// of the in-flight table; the other kinds (SENDs, lookups) keep their place. A
/// request that ends by its reply, its deadline or the link's loss gives its
/// kind's place back.
#[test]
fn one_kind_fills_at_most_its_quota_and_others_keep_their_place() {
    let seed = seed();
    let rng = &mut StdRng::seed_from_u64(seed);
    let quota = LinkLimits {
        rpc_requests_in_flight_max: 5,
        rpc_requests_in_flight_per_kind_max: 2,
        ..limits()
    };
    assert_eq!(quota.validate(), Ok(()));
    let mut w = up(rng, quota, 0);
    let register = |w: &mut Wire, token: u32, deadline_ms: u32| {
        (w.link).request(
            Kind::AuthorityRegister,
            b"r",
            deadline_ms,
            token,
            0,
            &mut w.sent_l,
        )
    };
    let first = register(&mut w, 1, 0).unwrap();
    register(&mut w, 2, 50).unwrap();
    let written = w.sent_l.len();
    assert_eq!(
        register(&mut w, 3, 0),
        Err((Refused::KindFull(Kind::AuthorityRegister, 2), 3)),
        "seed {seed}"
    );
    assert_eq!(
        w.sent_l.len(),
        written,
        "nothing written for a refused request"
    );
    // Other kinds still get their place while registers are at their quota.
    for (token, kind) in [(4, Kind::ForwardedSend), (5, Kind::EndpointLookup)] {
        assert!(
            w.link
                .request(kind, b"s", 0, token, 0, &mut w.sent_l)
                .is_ok(),
            "{kind:?} refused while only registers were at their quota (seed {seed})"
        );
    }
    // A reply gives its kind's place back.
    assert_eq!(w.link.complete(first, B.boot_id), Some(1));
    register(&mut w, 6, 0).unwrap();
    assert_eq!(
        register(&mut w, 7, 0),
        Err((Refused::KindFull(Kind::AuthorityRegister, 2), 7))
    );
    // So does a deadline (request 2, due at 50 ms).
    let mut failed = Vec::new();
    let _ = w.link.on_tick(50, &mut w.sent_l, &mut failed);
    assert_eq!(failed, vec![(2, Failure::Deadline)], "seed {seed}");
    register(&mut w, 8, 0).unwrap();
    // The whole table still bounds every kind together.
    (w.link)
        .request(Kind::TouchBatch, b"b", 0, 10, 0, &mut w.sent_l)
        .unwrap();
    assert_eq!(w.link.in_flight(), 5);
    assert_eq!(
        w.link
            .request(Kind::TokenLookup, b"t", 0, 9, 0, &mut w.sent_l),
        Err((Refused::Full(5), 9))
    );
    // And the link's loss, every place.
    w.link.on_closed(60, 0, &mut failed);
    assert_eq!(w.link.in_flight(), 0);
    let bad = LinkLimits {
        rpc_requests_in_flight_per_kind_max: 6,
        ..quota
    };
    assert!(
        bad.validate().is_err(),
        "a kind's quota above the whole table"
    );
    let bad = LinkLimits {
        rpc_requests_in_flight_per_kind_max: 0,
        ..quota
    };
    assert!(bad.validate().is_err());
}

/// Issue 26 item 5: a peer that answers Pings but no request opens the link's
/// breaker after `rpc_breaker_failures` unanswered requests in a row: requests are
/// refused at once (nothing written) for the cool-down, then one probe goes; its
/// deadline opens the breaker again, its answer closes it. An answer in between
/// restarts the count; 0 turns the breaker off.
#[test]
fn unanswered_requests_open_the_breaker_until_a_probe_is_answered() {
    let seed = seed();
    let rng = &mut StdRng::seed_from_u64(seed);
    let limits = LinkLimits {
        rpc_breaker_failures: 3,
        rpc_breaker_cooldown_ms: 100,
        ..limits()
    };
    assert_eq!(limits.validate(), Ok(()));
    let mut w = up(rng, limits, 0);
    let send = |w: &mut Wire, token: u32, now: u64| {
        (w.link).request(Kind::EndpointLookup, b"q", 10, token, now, &mut w.sent_l)
    };
    let mut failed = Vec::new();
    let mut tick = |w: &mut Wire, now: u64| {
        failed.clear();
        let _ = w.link.on_tick(now, &mut w.sent_l, &mut failed);
        failed.len()
    };
    // Two unanswered, one answered: the count starts again.
    send(&mut w, 1, 0).unwrap();
    send(&mut w, 2, 0).unwrap();
    let answered = send(&mut w, 3, 5).unwrap();
    assert_eq!(tick(&mut w, 10), 2);
    assert_eq!(w.link.complete(answered, B.boot_id), Some(3));
    for token in 4..6 {
        send(&mut w, token, 20).unwrap();
    }
    assert_eq!(tick(&mut w, 30), 2);
    assert!(
        send(&mut w, 6, 30).is_ok(),
        "2 in a row: still closed (seed {seed})"
    );
    // The third in a row opens it until 40 + 100.
    assert_eq!(tick(&mut w, 40), 1);
    let written = w.sent_l.len();
    assert_eq!(send(&mut w, 7, 41), Err((Refused::Breaker(3), 7)));
    assert_eq!(send(&mut w, 8, 139), Err((Refused::Breaker(3), 8)));
    assert_eq!(w.sent_l.len(), written, "nothing written while open");
    // The cool-down passed: one probe, the others refused while it is in flight.
    send(&mut w, 9, 140).unwrap();
    assert_eq!(send(&mut w, 10, 141), Err((Refused::Breaker(3), 10)));
    // The probe unanswered: open again for a whole cool-down.
    assert_eq!(tick(&mut w, 150), 1);
    assert_eq!(send(&mut w, 11, 249), Err((Refused::Breaker(4), 11)));
    let probe = send(&mut w, 12, 250).unwrap();
    // The probe answered: closed, and every request goes again.
    assert_eq!(w.link.complete(probe, B.boot_id), Some(12));
    for token in 13..16 {
        send(&mut w, token, 251).unwrap();
    }

    let off = LinkLimits {
        rpc_breaker_failures: 0,
        ..limits
    };
    let mut w = up(rng, off, 0);
    for token in 0..20 {
        send(&mut w, token, 0).unwrap();
    }
    assert_eq!(tick(&mut w, 10), 20);
    assert!(
        send(&mut w, 20, 11).is_ok(),
        "no breaker with rpc_breaker_failures = 0"
    );
    let bad = LinkLimits {
        rpc_breaker_cooldown_ms: 0,
        ..limits
    };
    assert!(bad.validate().is_err());
}

#[test]
fn a_lost_link_fails_everything_in_flight_and_backs_off_exponentially_until_up() {
    let seed = seed();
    let rng = &mut StdRng::seed_from_u64(seed);
    let mut w = up(rng, limits(), 0);
    for token in [1, 2, 3] {
        w.link
            .request(Kind::Push, b"", 100 * token, token, 0, &mut w.sent_l)
            .unwrap();
    }
    let mut failed = Vec::new();
    w.link.on_closed(10, 0, &mut failed);
    assert_eq!(
        failed,
        vec![
            (1, Failure::LinkLost),
            (2, Failure::LinkLost),
            (3, Failure::LinkLost)
        ]
    );
    assert_eq!(w.link.in_flight(), 0);
    assert_eq!(
        w.link.state(),
        LinkState::Down { retry_at_ms: 60 },
        "seed {seed}"
    );
    assert_eq!(w.link.next_timer_ms(), Some(60));
    w.link.on_closed(20, 0, &mut failed);
    assert_eq!(
        w.link.state(),
        LinkState::Down { retry_at_ms: 60 },
        "closing twice is one close"
    );
    assert!(!w.link.due_to_dial(59) && w.link.due_to_dial(60));

    // Dials that fail: 100, 200, ... up to 2000 ms.
    let mut link = w.link;
    let mut now = 60;
    for want in [100, 200, 400, 800, 1_600, 2_000, 2_000] {
        assert!(link.due_to_dial(now));
        assert!(link.on_dial(rng.gen(), now, &mut Vec::new()));
        assert!(
            !link.on_dial(rng.gen(), now, &mut Vec::new()),
            "dialing already"
        );
        link.on_closed(now, 0, &mut failed);
        assert_eq!(
            link.state(),
            LinkState::Down {
                retry_at_ms: now + want
            },
            "seed {seed}"
        );
        now += want;
    }
    // Jitter shortens the pause to no less than half of it.
    assert_eq!(link.backoff_ms(), 2_000);
    link.on_dial(rng.gen(), now, &mut Vec::new());
    link.on_closed(now, 1_000, &mut failed);
    assert_eq!(
        link.state(),
        LinkState::Down {
            retry_at_ms: now + 1_000
        }
    );
    link.on_dial(rng.gen(), now, &mut Vec::new());
    link.on_closed(now, 1_001, &mut failed);
    assert_eq!(
        link.state(),
        LinkState::Down {
            retry_at_ms: now + 2_000
        }
    );
    // A successful handshake resets it.
    let mut w = Wire::new(link, B, &secret(SECRET), rng, now);
    w.pump(now);
    assert_eq!(
        w.link.state(),
        LinkState::Up {
            peer_boot_id: B.boot_id
        }
    );
    assert_eq!(w.link.backoff_ms(), 50);
    w.link.on_closed(now, 0, &mut failed);
    assert_eq!(
        w.link.state(),
        LinkState::Down {
            retry_at_ms: now + 50
        }
    );
    assert_eq!(failed.len(), 3, "nothing else was in flight");
}

#[test]
fn a_restarted_peer_is_reported_and_replies_from_its_old_boot_are_refused() {
    let seed = seed();
    let rng = &mut StdRng::seed_from_u64(seed);
    let mut w = up(rng, limits(), 0);
    let old = w
        .link
        .request(Kind::Push, b"", 0, 1, 0, &mut w.sent_l)
        .unwrap();
    // Another connection authenticated B with a new boot id: this one is stale.
    assert_eq!(w.link.on_peer_boot(B.boot_id, &mut w.sent_l), None);
    let mut out = Vec::new();
    let event = w.link.on_peer_boot(0xb2b2, &mut out);
    let reason = LinkCloseReason::PeerRestarted {
        old_boot_id: B.boot_id,
        new_boot_id: 0xb2b2,
    };
    assert_eq!(event, Some(LinkEvent::Close(reason)), "seed {seed}");
    assert_eq!(kinds(&out), vec![Kind::Goodbye]);
    assert_eq!(w.link.state(), LinkState::Closing);
    assert_eq!(
        w.link.request(Kind::Push, b"", 0, 2, 0, &mut out),
        Err((Refused::Down, 2))
    );
    let mut failed = Vec::new();
    w.link.on_closed(5, 0, &mut failed);
    assert_eq!(failed, vec![(1, Failure::LinkLost)]);
    assert_eq!(w.link.complete(old, B.boot_id), None);

    let b2 = Identity {
        boot_id: 0xb2b2,
        ..B
    };
    let mut w = Wire::new(w.link, b2, &secret(SECRET), rng, 100);
    w.pump(100);
    let up = LinkEvent::Up {
        peer_boot_id: b2.boot_id,
        restarted: true,
    };
    assert_eq!(w.link_events, vec![up], "seed {seed}");
    let id = w
        .link
        .request(Kind::Push, b"", 0, 3, 100, &mut w.sent_l)
        .unwrap();
    assert_eq!(
        w.link.complete(id, B.boot_id),
        None,
        "a reply from the old boot"
    );
    assert_eq!(w.link.complete(id, b2.boot_id), Some(3));
    // The same boot again is not a restart.
    let mut link = w.link;
    link.on_closed(200, 0, &mut failed);
    let mut w = Wire::new(link, b2, &secret(SECRET), rng, 300);
    w.pump(300);
    assert_eq!(
        w.link_events,
        vec![LinkEvent::Up {
            peer_boot_id: b2.boot_id,
            restarted: false
        }]
    );
}

#[test]
fn an_idle_link_pings_the_listener_pongs_and_both_stay_up() {
    let seed = seed();
    let rng = &mut StdRng::seed_from_u64(seed);
    let mut w = up(rng, limits(), 1_000);
    assert_eq!(w.link.next_timer_ms(), Some(1_500), "seed {seed}");
    assert_eq!(w.inbound.next_timer_ms(), Some(4_000));
    let mut failed = Vec::new();
    assert_eq!(w.link.on_tick(1_499, &mut w.sent_l, &mut failed), None);
    assert!(w.sent_l.is_empty());
    assert_eq!(w.link.on_tick(1_500, &mut w.sent_l, &mut failed), None);
    let ping = frames_in(&w.sent_l);
    assert_eq!(ping.len(), 1);
    assert_eq!(
        (ping[0].0.kind, ping[0].1.len()),
        (Kind::Ping, 8 + TAG_BYTES)
    );
    assert_ne!(&ping[0].1[..8], &1_500u64.to_le_bytes()[..], "sealed");
    w.pump(1_520);
    assert_eq!(w.link.rtt_ms(), Some(20));
    assert!(w.frames.is_empty(), "Pings are not handed up");
    assert!(w.link_events.is_empty() && w.inbound_events.is_empty());
    // Ten seconds of heartbeats, ticking both sides when due: nobody closes.
    let mut pings = 1;
    let next = |w: &Wire| {
        let at = w
            .link
            .next_timer_ms()
            .unwrap()
            .min(w.inbound.next_timer_ms().unwrap());
        (at <= 11_500).then_some(at)
    };
    while let Some(now) = next(&w) {
        let before = w.sent_l.len();
        assert_eq!(
            w.link.on_tick(now, &mut w.sent_l, &mut failed),
            None,
            "seed {seed}"
        );
        pings += usize::from(w.sent_l.len() > before);
        assert_eq!(w.inbound.on_tick(now, &mut w.sent_d), None, "seed {seed}");
        w.pump(now);
    }
    assert_eq!(pings, 21, "one Ping every 500 ms");
    assert!(w.link_events.is_empty() && w.inbound_events.is_empty());
    assert_eq!(
        w.link.state(),
        LinkState::Up {
            peer_boot_id: B.boot_id
        }
    );
}

#[test]
fn a_busy_dialer_still_pings_to_hear_the_listener() {
    let seed = seed();
    let rng = &mut StdRng::seed_from_u64(seed);
    let mut w = up(rng, limits(), 0);
    let mut failed = Vec::new();
    // A one-way message every 100 ms: the dialer never idles, yet pings every 500 ms
    // since nothing comes back otherwise.
    for now in (100..=5_000).step_by(100) {
        w.link.oneway(Kind::Push, b"p", now, &mut w.sent_l).unwrap();
        assert_eq!(
            w.link.on_tick(now, &mut w.sent_l, &mut failed),
            None,
            "seed {seed} at {now}"
        );
        w.pump(now);
    }
    assert_eq!(w.frames.len(), 50, "the pushes, and no Ping handed up");
    assert_eq!(
        w.link.state(),
        LinkState::Up {
            peer_boot_id: B.boot_id
        }
    );
    assert_eq!(w.link.rtt_ms(), Some(0));
}

#[test]
fn silence_closes_both_sides_with_a_goodbye() {
    let seed = seed();
    let rng = &mut StdRng::seed_from_u64(seed);
    // The listener's answers are never delivered: the dialer pings, then gives up.
    let mut w = up(rng, limits(), 0);
    let mut failed = Vec::new();
    let (now, event) = loop {
        let now = w.link.next_timer_ms().unwrap();
        if let Some(event) = w.link.on_tick(now, &mut w.sent_l, &mut failed) {
            break (now, event);
        }
    };
    assert_eq!(now, 3_000, "seed {seed}");
    assert_eq!(
        event,
        LinkEvent::Close(LinkCloseReason::Silence { silent_ms: 3_000 })
    );
    let written = kinds(&w.sent_l);
    assert_eq!(written.last(), Some(&Kind::Goodbye));
    assert!(written[..written.len() - 1]
        .iter()
        .all(|k| *k == Kind::Ping));
    assert_eq!(w.link.state(), LinkState::Closing);
    assert_eq!(w.link.next_timer_ms(), None);
    assert_eq!(
        w.link.on_tick(9_000, &mut w.sent_l, &mut failed),
        None,
        "asked once"
    );

    // A listener that hears nothing after the accept, or after the handshake.
    let mut inbound = Inbound::new(&secret(SECRET), B, &[1], rng.gen(), limits(), 100);
    let mut out = Vec::new();
    assert_eq!(inbound.next_timer_ms(), Some(3_100));
    assert_eq!(inbound.on_tick(3_099, &mut out), None);
    let silence = LinkCloseReason::Silence { silent_ms: 3_000 };
    assert_eq!(
        inbound.on_tick(3_100, &mut out),
        Some(InboundEvent::Close(silence.clone()))
    );
    assert_eq!(kinds(&out), vec![Kind::Goodbye]);
    assert!(inbound.is_closed() && inbound.next_timer_ms().is_none());
    let mut w = up(rng, limits(), 0);
    assert_eq!(
        w.inbound.on_tick(3_000, &mut w.sent_d),
        Some(InboundEvent::Close(silence))
    );
    // A dialer whose Hello is never answered.
    let mut link = new_link(SHARD, A, B, limits());
    link.on_dial(rng.gen(), 10, &mut Vec::new());
    assert_eq!(link.next_timer_ms(), Some(3_010));
    let event = link.on_tick(3_010, &mut Vec::new(), &mut failed);
    assert_eq!(
        event,
        Some(LinkEvent::Close(LinkCloseReason::Silence {
            silent_ms: 3_000
        }))
    );
}

#[test]
fn bytes_that_stay_unconsumed_are_not_heard_again() {
    let seed = seed();
    let rng = &mut StdRng::seed_from_u64(seed);
    let mut w = up(rng, limits(), 0);
    // Half a frame arrives at 100 and is fed again (no new byte) at 3000: silent since 100.
    let frame = frame_from(A, Kind::Push, 0, b"body");
    let half = &frame[..HEADER_BYTES / 2];
    assert_eq!(w.inbound.on_input(half, 100, &mut w.sent_d).consumed, 0);
    assert_eq!(w.inbound.on_input(half, 3_000, &mut w.sent_d).consumed, 0);
    let silence = LinkCloseReason::Silence { silent_ms: 3_000 };
    assert_eq!(
        w.inbound.on_tick(3_100, &mut w.sent_d),
        Some(InboundEvent::Close(silence)),
        "seed {seed}"
    );
}

/// Feeds `bytes` to a listener established with A; returns its events and output.
/// B's listener with A's dialer played by the test (a `Handshake` whose session
/// keys the test holds: it seals what it likes and opens what the listener writes).
fn listener_and_played_dialer(rng: &mut StdRng) -> (Inbound, SessionKeys) {
    let mut inbound = Inbound::new(&secret(SECRET), B, &[1, 3], rng.gen(), limits(), 0);
    let mut hello = Vec::new();
    let mut dialer = Handshake::dialer(&secret(SECRET), A, B.node_id, rng.gen(), &mut hello);
    let mut challenge = Vec::new();
    let step = inbound.on_input(&hello, 0, &mut challenge);
    assert_eq!((step.consumed, step.event), (hello.len(), None));
    let mut proof = Vec::new();
    dialer.receive(&challenge, &mut proof);
    let step = inbound.on_input(&proof, 0, &mut Vec::new());
    assert_eq!(step.event, Some(InboundEvent::Established(A)));
    (
        inbound,
        dialer.take_keys().expect("the dialer is established"),
    )
}

/// A's outbound link to B with B's listener played by the test.
fn outbound_and_played_listener(rng: &mut StdRng) -> (Outbound<u32>, SessionKeys) {
    let mut link = new_link(SHARD, A, B, limits());
    let mut hello = Vec::new();
    assert!(link.on_dial(rng.gen(), 0, &mut hello));
    let mut listener = Handshake::listener(&secret(SECRET), B, &[1, 3], rng.gen());
    let mut challenge = Vec::new();
    listener.receive(&hello, &mut challenge);
    let mut proof = Vec::new();
    let step = link.on_input(&challenge, 0, &mut proof);
    assert!(matches!(step.event, Some(LinkEvent::Up { .. })));
    listener.receive(&proof, &mut Vec::new());
    (
        link,
        listener.take_keys().expect("the listener is established"),
    )
}

/// A frame from `me` sealed with the test-played end's sending key.
fn sealed_from(
    keys: &mut SessionKeys,
    me: Identity,
    kind: Kind,
    request_id: u64,
    body: &[u8],
) -> Vec<u8> {
    let header = Header {
        kind,
        flags: 0,
        sender_node_id: me.node_id,
        sender_boot_id: me.boot_id,
        request_id,
        deadline_ms: 0,
    };
    let mut out = Vec::new();
    keys.send
        .seal(&header, body, limits().frame(), &mut out)
        .unwrap();
    out
}

/// The frames in `bytes`, opened with the test-played end's receiving key.
fn opened(keys: &mut SessionKeys, mut bytes: &[u8]) -> Vec<(Header, Vec<u8>)> {
    let mut frames = Vec::new();
    while let Some(f) = decode(bytes, limits().frame()).unwrap() {
        let body = keys
            .recv
            .open(bytes, &f)
            .expect("the machine's frame opens");
        frames.push((f.header, body.to_vec()));
        bytes = &bytes[f.wire_len()..];
    }
    frames
}

/// An established listener fed `bytes` (sealed by `make` with the played
/// dialer's keys): its events and what it wrote, opened.
fn established_listener_fed(
    rng: &mut StdRng,
    make: impl FnOnce(&mut SessionKeys) -> Vec<u8>,
) -> (Vec<InboundEvent>, Vec<(Header, Vec<u8>)>) {
    let (mut inbound, mut keys) = listener_and_played_dialer(rng);
    let mut input = make(&mut keys);
    let mut out = Vec::new();
    let mut events = Vec::new();
    loop {
        let step = inbound.on_input(&input, 0, &mut out);
        input.drain(..step.consumed);
        match step.event {
            Some(InboundEvent::Frame { header }) => {
                assert_eq!(inbound.body(), b"ok", "{header:?}");
            }
            Some(event) => events.push(event),
            None => break,
        }
    }
    (events, opened(&mut keys, &out))
}

#[test]
fn an_established_listener_closes_on_any_protocol_error_with_a_reason() {
    let seed = seed();
    let rng = &mut StdRng::seed_from_u64(seed);
    let a_lie = Identity {
        boot_id: 0xbad,
        ..A
    };
    type Make = fn(&mut SessionKeys) -> Vec<u8>;
    let cases: [(Make, LinkCloseReason); 6] = [
        (
            |k| sealed_from(k, A, Kind::Hello, 0, &[0; 32]),
            LinkCloseReason::Unexpected(Kind::Hello),
        ),
        (
            |k| sealed_from(k, A, Kind::Pong, 0, &[]),
            LinkCloseReason::Unexpected(Kind::Pong),
        ),
        (
            |k| sealed_from(k, A, Kind::Ping, 0, &[0; 65]),
            LinkCloseReason::BadPing { body_bytes: 65 },
        ),
        (
            |k| {
                let mut bad_magic = sealed_from(k, A, Kind::Push, 0, &[]);
                bad_magic[0] = b'X';
                bad_magic
            },
            LinkCloseReason::Frame(FrameError::BadMagic(*b"XMRN")),
        ),
        (
            |k| {
                let mut oversized = sealed_from(k, A, Kind::Push, 0, &[]);
                oversized[36..40].copy_from_slice(&(4u32 << 20).to_le_bytes());
                oversized
            },
            LinkCloseReason::Frame(FrameError::TooLarge {
                frame_bytes: HEADER_BYTES + (4 << 20),
                bytes_max: 4 << 20,
            }),
        ),
        (
            |k| {
                sealed_from(
                    k,
                    Identity {
                        boot_id: 0xbad,
                        ..A
                    },
                    Kind::Push,
                    0,
                    &[],
                )
            },
            LinkCloseReason::Sender(SenderMismatch {
                peer_node_id: A.node_id,
                peer_boot_id: A.boot_id,
                got_node_id: A.node_id,
                got_boot_id: a_lie.boot_id,
            }),
        ),
    ];
    for (make, reason) in cases {
        // A good frame first: handed up, then the bad one closes.
        let (events, written) = established_listener_fed(rng, |k| {
            let mut input = sealed_from(k, A, Kind::Push, 0, b"ok");
            input.extend_from_slice(&make(k));
            input
        });
        assert_eq!(
            events,
            vec![InboundEvent::Close(reason.clone())],
            "seed {seed}"
        );
        assert_eq!(written.len(), 1);
        assert_eq!(written[0].0.kind, Kind::Goodbye);
        assert_eq!(
            String::from_utf8(written[0].1.clone()).unwrap(),
            reason.to_string()
        );
    }
    // The peer's Goodbye: closed without one of ours.
    let (events, written) =
        established_listener_fed(rng, |k| sealed_from(k, A, Kind::Goodbye, 0, b"bye"));
    assert_eq!(
        events,
        vec![InboundEvent::Close(LinkCloseReason::PeerGoodbye(
            "bye".into()
        ))]
    );
    assert!(written.is_empty());
}

#[test]
fn an_outbound_link_closes_on_anything_but_pongs_from_the_listener() {
    let seed = seed();
    let rng = &mut StdRng::seed_from_u64(seed);
    for (kind, request_id, body, reason) in [
        (
            Kind::Reply,
            1,
            &b""[..],
            LinkCloseReason::Unexpected(Kind::Reply),
        ),
        (
            Kind::Ping,
            0,
            &b""[..],
            LinkCloseReason::Unexpected(Kind::Ping),
        ),
        (
            Kind::Goodbye,
            0,
            &b"going"[..],
            LinkCloseReason::PeerGoodbye("going".into()),
        ),
    ] {
        let (mut link, mut keys) = outbound_and_played_listener(rng);
        let mut sent = Vec::new();
        link.request(Kind::Push, b"", 0, 1, 0, &mut sent).unwrap();
        sent.clear();
        let bytes = sealed_from(&mut keys, B, kind, request_id, body);
        let step = link.on_input(&bytes, 0, &mut sent);
        assert_eq!(
            step.event,
            Some(LinkEvent::Close(reason.clone())),
            "seed {seed}"
        );
        let goodbyes = usize::from(!matches!(reason, LinkCloseReason::PeerGoodbye(_)));
        assert_eq!(kinds(&sent), vec![Kind::Goodbye; goodbyes]);
        let mut failed = Vec::new();
        link.on_closed(0, 0, &mut failed);
        assert_eq!(failed, vec![(1, Failure::LinkLost)]);
    }
}

/// Issue 26, item 3: a bit flipped anywhere in a sealed frame (its header, its
/// encrypted body, its tag) closes the link that reads it, by name, with a sealed
/// Goodbye; on both machines.
#[test]
fn a_flipped_bit_in_a_sealed_frame_closes_the_link_by_name() {
    let seed = seed();
    let rng = &mut StdRng::seed_from_u64(seed);
    let body = b"a token, a plaintext message, a bearer token".to_vec();
    let frame_bytes = HEADER_BYTES + body.len() + TAG_BYTES;
    // Byte 24 is in the request id, 45 in the encrypted body, the last in the tag.
    for at in [24, HEADER_BYTES + 5, frame_bytes - 1] {
        let mut w = up(rng, limits(), 0);
        w.link
            .request(Kind::Push, &body, 0, 1, 0, &mut w.sent_l)
            .unwrap();
        assert!(!w.sent_l.windows(body.len()).any(|x| x == body), "sealed");
        w.sent_l[at] ^= 0x10;
        w.pump(0);
        let reason = LinkCloseReason::Unauthentic(Unauthentic {
            kind: Kind::Push,
            counter: 0,
        });
        assert_eq!(w.inbound_events, vec![InboundEvent::Close(reason.clone())]);
        assert!(w.frames.is_empty(), "nothing handed up (byte {at})");
        assert!(reason.to_string().contains("fails authentication"));
        // The listener's Goodbye reached the dialer, which closes too.
        assert_eq!(
            w.link_events,
            vec![LinkEvent::Close(LinkCloseReason::PeerGoodbye(
                reason.to_string()
            ))],
            "seed {seed}"
        );
    }
    // The other direction: a Pong with a flipped bit closes the dialer's link.
    let (mut link, mut keys) = outbound_and_played_listener(rng);
    let mut pong = sealed_from(&mut keys, B, Kind::Pong, 0, &7u64.to_le_bytes());
    pong[HEADER_BYTES] ^= 1;
    let mut out = Vec::new();
    let step = link.on_input(&pong, 5, &mut out);
    let reason = LinkCloseReason::Unauthentic(Unauthentic {
        kind: Kind::Pong,
        counter: 0,
    });
    assert_eq!(step.event, Some(LinkEvent::Close(reason.clone())));
    assert_eq!(link.rtt_ms(), None);
    let goodbye = opened(&mut keys, &out);
    assert_eq!(goodbye.len(), 1);
    assert_eq!(goodbye[0].1, reason.to_string().into_bytes());
}

/// A frame delivered twice, or two delivered out of order, do not open: the
/// counter expected is exactly the next one.
#[test]
fn a_replayed_or_reordered_frame_is_refused() {
    let seed = seed();
    let rng = &mut StdRng::seed_from_u64(seed);
    let two = |rng: &mut StdRng| {
        let (inbound, mut keys) = listener_and_played_dialer(rng);
        let first = sealed_from(&mut keys, A, Kind::Push, 0, b"ok");
        let second = sealed_from(&mut keys, A, Kind::Push, 0, b"ok");
        (inbound, first, second)
    };
    let refused = |counter| {
        Some(InboundEvent::Close(LinkCloseReason::Unauthentic(
            Unauthentic {
                kind: Kind::Push,
                counter,
            },
        )))
    };
    // Replayed: the first frame again where the second is expected.
    let (mut inbound, first, _) = two(rng);
    let step = inbound.on_input(&first, 0, &mut Vec::new());
    assert!(matches!(step.event, Some(InboundEvent::Frame { .. })));
    let step = inbound.on_input(&first, 0, &mut Vec::new());
    assert_eq!(step.event, refused(1), "seed {seed}");
    assert!(inbound.is_closed());
    // Reordered: the second frame first.
    let (mut inbound, _, second) = two(rng);
    let step = inbound.on_input(&second, 0, &mut Vec::new());
    assert_eq!(step.event, refused(0), "seed {seed}");
    // The same frame replayed to a new link (new keys) does not open either.
    let (mut other, _, _) = two(rng);
    let step = other.on_input(&first, 0, &mut Vec::new());
    assert_eq!(step.event, refused(0), "seed {seed}");
}

/// The keys of a link's two directions differ: what one end seals opens only at
/// the other end, never with its own receiving key (a frame reflected back to its
/// sender fails), and equal plaintexts at equal counters differ on the wire.
#[test]
fn the_two_directions_use_different_keys() {
    let seed = seed();
    let rng = &mut StdRng::seed_from_u64(seed);
    let (mut link, mut listener) = outbound_and_played_listener(rng);
    // The dialer's first sealed frame (counter 0 of dialer → listener)...
    let mut sent = Vec::new();
    link.oneway(Kind::Push, b"same bytes", 0, &mut sent)
        .unwrap();
    // ... and the listener's first (counter 0 of listener → dialer), same body.
    let reflected = sealed_from(&mut listener, A, Kind::Push, 0, b"same bytes");
    assert_eq!(sent.len(), reflected.len());
    assert_ne!(
        sent[HEADER_BYTES..],
        reflected[HEADER_BYTES..],
        "seed {seed}"
    );
    // The listener opens the dialer's frame with its receiving key.
    assert_eq!(opened(&mut listener, &sent)[0].1, b"same bytes");
    // The dialer's own frame, reflected back to it, does not open there.
    let sealed_b = sealed_from(&mut listener, B, Kind::Pong, 0, &[0; 8]);
    let mut echo = sent.clone();
    echo[5] = Kind::Pong as u8;
    echo[8..24].copy_from_slice(&sealed_b[8..24]);
    let step = link.on_input(&echo, 0, &mut Vec::new());
    assert_eq!(
        step.event,
        Some(LinkEvent::Close(LinkCloseReason::Unauthentic(
            Unauthentic {
                kind: Kind::Pong,
                counter: 0
            }
        )))
    );
}

/// Many frames of many sizes, split anyhow on the way, arrive whole and in order,
/// and every byte on the wire after the handshake is sealed.
#[test]
fn many_sealed_frames_round_trip() {
    let seed = seed();
    let rng = &mut StdRng::seed_from_u64(seed);
    let mut w = up(rng, limits(), 0);
    let mut want = Vec::new();
    for i in 0..2_000u32 {
        let len = match i % 4 {
            0 => 0,
            1 => rng.gen_range(1..64),
            2 => rng.gen_range(64..1024),
            _ => rng.gen_range(1024..20_000),
        };
        let mut body = vec![0u8; len];
        rng.fill(&mut body[..]);
        w.link
            .oneway(Kind::TouchBatch, &body, 0, &mut w.sent_l)
            .unwrap();
        let frame = &w.sent_l[w.sent_l.len() - (HEADER_BYTES + len + TAG_BYTES)..];
        if len >= 16 {
            let plain = &body[..16];
            assert!(!frame.windows(16).any(|x| x == plain), "frame {i} sealed");
        }
        want.push(body);
        if i % 7 == 0 {
            let max = rng.gen_range(1..5_000);
            w.step(0, max);
        }
    }
    w.pump(0);
    assert!(
        w.inbound_events.is_empty(),
        "seed {seed}: {:?}",
        w.inbound_events
    );
    let got: Vec<Vec<u8>> = w.frames.iter().map(|(_, b)| b.clone()).collect();
    assert_eq!(got.len(), want.len(), "seed {seed}");
    assert!(got == want, "seed {seed}: bodies differ");
}

#[test]
fn garbage_and_strangers_are_refused_before_the_handshake() {
    let seed = seed();
    let rng = &mut StdRng::seed_from_u64(seed);
    for i in 0..2_000 {
        let garbage: Vec<u8> = (0..rng.gen_range(HEADER_BYTES..200))
            .map(|_| rng.gen())
            .collect();
        let mut inbound = Inbound::new(&secret(SECRET), B, &[1], rng.gen(), limits(), 0);
        let mut out = Vec::new();
        let step = inbound.on_input(&garbage, 0, &mut out);
        assert!(
            matches!(step.event, Some(InboundEvent::Refused(Refusal::Frame(_)))),
            "seed {seed} input {i}: {step:?}"
        );
        assert_eq!(step.consumed, garbage.len());
        assert_eq!(kinds(&out), vec![Kind::Goodbye]);
        assert!(inbound.is_closed());
    }
    // A request before the handshake.
    let mut inbound = Inbound::new(&secret(SECRET), B, &[1], rng.gen(), limits(), 0);
    let step = inbound.on_input(&frame_from(A, Kind::Push, 1, b""), 0, &mut Vec::new());
    let want = Refusal::Unexpected {
        got: Kind::Push,
        expected: Kind::Hello,
    };
    assert_eq!(step.event, Some(InboundEvent::Refused(want)));
    // A node that is not a peer.
    let stranger = Identity {
        node_id: 9,
        boot_id: 1,
    };
    let mut w = Wire::new(
        new_link(0, stranger, B, limits()),
        B,
        &secret(SECRET),
        rng,
        0,
    );
    w.pump(0);
    assert_eq!(
        w.inbound_events,
        vec![InboundEvent::Refused(Refusal::UnknownPeer(9))]
    );
    assert_eq!(
        w.link_events,
        vec![LinkEvent::Refused(Refusal::PeerGoodbye)]
    );
}

#[test]
fn a_wrong_secret_is_refused_on_both_sides() {
    let seed = seed();
    let rng = &mut StdRng::seed_from_u64(seed);
    // The dialer finds the listener's MAC wrong and says so.
    let other = secret(b"another secret, long enough.....");
    let link = Outbound::new(&other, A, B.node_id, SHARD, limits());
    let mut w = Wire::new(link, B, &secret(SECRET), rng, 0);
    w.pump(0);
    assert_eq!(
        w.link_events,
        vec![LinkEvent::Refused(Refusal::BadMac)],
        "seed {seed}"
    );
    assert_eq!(
        w.inbound_events,
        vec![InboundEvent::Refused(Refusal::PeerGoodbye)]
    );
    let mut failed = Vec::new();
    w.link.on_closed(0, 0, &mut failed);
    assert_eq!(w.link.state(), LinkState::Down { retry_at_ms: 50 });

    // A dialer that answers the Challenge anyway, with a MAC under another secret.
    let mut inbound = Inbound::new(&secret(SECRET), B, &[1], rng.gen(), limits(), 0);
    let nonce_d: [u8; NONCE_BYTES] = rng.gen();
    let mut challenge = Vec::new();
    let hello = [&nonce_d[..], &terms()].concat();
    let step = inbound.on_input(&frame_from(A, Kind::Hello, 0, &hello), 0, &mut challenge);
    assert_eq!(step.event, None);
    let (_, body) = &frames_in(&challenge)[0];
    let mut mac = Hmac::<Sha256>::new_from_slice(b"another secret, long enough.....").unwrap();
    mac.update(b"imrouter rpc v2 dialer");
    for id in [A.node_id, A.boot_id, B.node_id, B.boot_id] {
        mac.update(&id.to_le_bytes());
    }
    mac.update(&nonce_d);
    mac.update(&body[..NONCE_BYTES]);
    mac.update(&terms());
    mac.update(&terms());
    let proof = frame_from(A, Kind::Proof, 0, &mac.finalize().into_bytes());
    let mut out = Vec::new();
    let step = inbound.on_input(&proof, 0, &mut out);
    assert_eq!(
        step.event,
        Some(InboundEvent::Refused(Refusal::BadMac)),
        "seed {seed}"
    );
    assert_eq!(kinds(&out), vec![Kind::Goodbye]);
    assert!(inbound.peer().is_none());
}

#[test]
fn arbitrary_splits_of_both_streams_deliver_the_same_frames() {
    let seed = seed();
    let rng = &mut StdRng::seed_from_u64(seed);
    for run in 0..200 {
        let mut w = Wire::new(new_link(SHARD, A, B, limits()), B, &secret(SECRET), rng, 0);
        let max = rng.gen_range(1..64);
        while w.link.state()
            != (LinkState::Up {
                peer_boot_id: B.boot_id,
            })
        {
            assert!(
                w.step(0, rng.gen_range(1..=max)),
                "seed {seed} run {run}: stuck"
            );
        }
        let mut sent = Vec::new();
        let mut failed = Vec::new();
        for now in 1..60u64 {
            let body: Vec<u8> = (0..rng.gen_range(0..300)).map(|_| rng.gen()).collect();
            let kind = Kind::ALL[rng.gen_range(0..Kind::ALL.len())];
            let (kind, id) = match rng.gen_range(0..3) {
                0 => (
                    kind,
                    w.link
                        .request(kind, &body, 0, 0, now * 100, &mut w.sent_l)
                        .ok(),
                ),
                1 => (
                    kind,
                    w.link
                        .oneway(kind, &body, now * 100, &mut w.sent_l)
                        .ok()
                        .map(|()| 0),
                ),
                _ => (
                    Kind::Reply,
                    w.link
                        .send_reply(now, &body, now * 100, &mut w.sent_l)
                        .ok()
                        .map(|()| now),
                ),
            };
            if let Some(id) = id {
                sent.push((kind, id, body));
            }
            assert_eq!(w.link.on_tick(now * 100, &mut w.sent_l, &mut failed), None);
            // Everything arrives before the next tick, in pieces of random sizes.
            while w.step(now * 100, rng.gen_range(1..=max)) {}
        }
        w.pump(6_000);
        let got: Vec<_> = w
            .frames
            .iter()
            .map(|(h, b)| (h.kind, h.request_id, b.clone()))
            .collect();
        assert_eq!(got, sent, "seed {seed} run {run}");
        // Requests may follow the Proof before the listener has read it.
        let up = LinkEvent::Up {
            peer_boot_id: B.boot_id,
            restarted: false,
        };
        assert_eq!(w.link_events, vec![up], "seed {seed} run {run}");
        let established = InboundEvent::Established(A);
        assert_eq!(w.inbound_events, vec![established], "seed {seed} run {run}");
        assert!(
            w.link.rtt_ms().is_some(),
            "Pongs came back, seed {seed} run {run}"
        );
    }
}

#[test]
fn limits_are_validated_and_read_from_config() {
    assert_eq!(limits().validate(), Ok(()));
    let bad = LinkLimits {
        rpc_heartbeat_ms: 3_000,
        ..limits()
    };
    assert!(matches!(bad.validate(), Err(InvalidLinkLimits(_))));
    let bad = LinkLimits {
        rpc_backoff_min_ms: 3_000,
        ..limits()
    };
    assert!(bad.validate().is_err());
    let bad = LinkLimits {
        rpc_requests_in_flight_max: 0,
        ..limits()
    };
    assert!(bad.validate().is_err());
    // A reply margin as long as the deadline would leave no request in time.
    let bad = LinkLimits {
        rpc_reply_margin_ms: 2_000,
        rpc_request_deadline_ms: 2_000,
        ..limits()
    };
    assert!(bad.validate().is_err());
    let parsed: LinkLimits = serde_json::from_str(
        r#"{"rpc_requests_in_flight_max": 16, "rpc_backoff_ms_max": 500,
            "rpc_replies_held_max": 8, "rpc_replies_held_bytes_max": 4096,
            "rpc_reply_margin_ms": 3}"#,
    )
    .unwrap();
    assert_eq!(
        parsed,
        LinkLimits {
            rpc_requests_in_flight_max: 16,
            rpc_backoff_ms_max: 500,
            rpc_replies_held_max: 8,
            rpc_replies_held_bytes_max: 4096,
            rpc_reply_margin_ms: 3,
            ..limits()
        }
    );
    assert!(serde_json::from_str::<LinkLimits>(r#"{"rpc_typo": 1}"#).is_err());
}

#[test]
fn a_peer_of_another_cluster_is_refused_by_name_on_both_links() {
    let seed = seed();
    let rng = &mut StdRng::seed_from_u64(seed);
    let link = Outbound::new(&key(SECRET, "blue"), A, B.node_id, SHARD, limits());
    let mut w = Wire::new(link, B, &key(SECRET, "green"), rng, 0);
    w.pump(0);
    let (blue, green) = (
        ClusterId::new("blue").unwrap(),
        ClusterId::new("green").unwrap(),
    );
    let named = |peer, ours| Refusal::OtherCluster { peer, ours };
    assert_eq!(
        w.link_events,
        vec![LinkEvent::Refused(named(green, blue))],
        "seed {seed}"
    );
    assert_eq!(
        w.inbound_events,
        vec![InboundEvent::Refused(named(blue, green))],
        "seed {seed}"
    );
    assert!(w.inbound.is_closed() && w.link.state() == LinkState::Closing);
}
