//! Outbound connections (`NetDriver::connect`) and the RPC listener kind, end to end
//! on both backends: two drivers driven by hand on the test's thread, one dialing,
//! one accepting on a `Transport::Rpc` listener, on 127.0.0.1. Every wait is for an
//! event or a kernel state; the deadline only bounds a failing test.

mod support;

use std::collections::HashMap;
use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use net::io::{
    bind_reuseport, Backend, CloseReason, ConnId, NetConfig, NetDriver, NetEvent, Transport,
};
use shard::runtime::{Driver, EventFd};

/// Bounds every wait of a test that fails.
const FAIL_AFTER: Duration = Duration::from_secs(20);
/// How long one poll may block: two drivers share the thread, so neither parks long.
const POLL_WAIT: Duration = Duration::from_millis(2);

/// One driver and what it reported: every event but `Readable`, and the bytes read
/// per connection (input is consumed as it arrives).
struct Side {
    d: NetDriver,
    events: Vec<NetEvent>,
    received: HashMap<ConnId, Vec<u8>>,
}

impl Side {
    fn new(backend: Backend, config: &NetConfig, listeners: Vec<(Transport, TcpListener)>) -> Side {
        let config = NetConfig {
            backend,
            ..config.clone()
        };
        let doorbell = Arc::new(EventFd::new().unwrap());
        let d = NetDriver::new(&config, doorbell, listeners).unwrap();
        assert_eq!(d.backend(), backend);
        Side {
            d,
            events: Vec::new(),
            received: HashMap::new(),
        }
    }

    /// A side with one RPC listener on a free loopback port (`backlog` deep).
    fn listening(backend: Backend, config: &NetConfig, backlog: i32) -> (Side, SocketAddr) {
        let l = bind_reuseport("127.0.0.1:0".parse().unwrap(), backlog).unwrap();
        let addr = l.local_addr().unwrap();
        let config = NetConfig {
            listen_backlog: backlog,
            ..config.clone()
        };
        (Side::new(backend, &config, vec![(Transport::Rpc, l)]), addr)
    }

    fn poll(&mut self) {
        let mut evs = Vec::new();
        self.d.poll(Some(POLL_WAIT), &mut evs).unwrap();
        for ev in evs {
            match ev {
                NetEvent::Readable { conn } => {
                    let bytes = self.d.input(conn).to_vec();
                    self.d.consume(conn, bytes.len());
                    self.received.entry(conn).or_default().extend(bytes);
                }
                other => self.events.push(other),
            }
        }
    }

    fn received(&self, conn: ConnId) -> &[u8] {
        self.received.get(&conn).map_or(&[], Vec::as_slice)
    }

    /// Every reported event of `conn`.
    fn events_of(&self, conn: ConnId) -> Vec<NetEvent> {
        self.events
            .iter()
            .filter(|e| match e {
                NetEvent::Accepted { conn: c, .. }
                | NetEvent::Connected { conn: c, .. }
                | NetEvent::Readable { conn: c }
                | NetEvent::Closed { conn: c, .. } => *c == conn,
            })
            .copied()
            .collect()
    }

    fn closed(&self, conn: ConnId) -> Option<CloseReason> {
        self.events.iter().find_map(|e| match e {
            NetEvent::Closed { conn: c, reason } if *c == conn => Some(*reason),
            _ => None,
        })
    }

    /// The connection an RPC listener accepted, if any yet.
    fn accepted_rpc(&self) -> Option<ConnId> {
        self.events.iter().find_map(|e| match e {
            NetEvent::Accepted {
                conn,
                listener: Transport::Rpc,
                ..
            } => Some(*conn),
            _ => None,
        })
    }
}

/// Polls every side until `done` holds; panics naming `what` after [`FAIL_AFTER`].
fn until(sides: &mut [&mut Side], what: &str, done: impl Fn(&[&mut Side]) -> bool) {
    let deadline = Instant::now() + FAIL_AFTER;
    while !done(sides) {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        for s in sides.iter_mut() {
            s.poll();
        }
    }
}

/// Deterministic test bytes.
fn pattern(len: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// A loopback address nothing listens on: a port just bound and released.
fn dead_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    addr
}

/// Connections waiting in `listener`'s accept queue (`TCP_INFO` of a listening
/// socket reports its accept backlog in `tcpi_unacked`).
fn accept_queue_len(listener: &TcpListener) -> u32 {
    use std::os::fd::AsRawFd;
    // SAFETY: tcp_info is plain old data; all-zero is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `info`, which outlives it.
    let rc = unsafe {
        libc::getsockopt(
            listener.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    assert_eq!(rc, 0, "TCP_INFO: {}", std::io::Error::last_os_error());
    info.tcpi_unacked
}

// ---------------------------------------------------------------- the suite

/// Dial a listener served by a second driver: `Connected` on the dialer,
/// `Accepted { Rpc }` on the listener, bytes both ways, `Closed` on both after the
/// dialer closes.
fn dial_exchange_and_close(backend: Backend) {
    let config = NetConfig::default();
    let (mut server, addr) = Side::listening(backend, &config, 64);
    let mut dialer = Side::new(backend, &config, Vec::new());
    let c = dialer.d.connect(addr).unwrap();
    assert_eq!(dialer.d.connection_count(), 1);
    until(
        &mut [&mut dialer, &mut server],
        "Connected and Accepted",
        |s| !s[0].events.is_empty() && s[1].accepted_rpc().is_some(),
    );
    assert_eq!(
        dialer.events_of(c),
        vec![NetEvent::Connected {
            conn: c,
            peer: addr
        }]
    );
    let s = server.accepted_rpc().unwrap();
    dialer.d.mark_established(c);
    server.d.mark_established(s);

    let (ping, pong) = (pattern(3000, 1), pattern(5000, 2));
    dialer.d.send(c, &ping).unwrap();
    until(&mut [&mut dialer, &mut server], "ping", |x| {
        x[1].received(s).len() >= ping.len()
    });
    server.d.send(s, &pong).unwrap();
    until(&mut [&mut dialer, &mut server], "pong", |x| {
        x[0].received(c).len() >= pong.len()
    });
    assert_eq!(server.received(s), ping);
    assert_eq!(dialer.received(c), pong);

    dialer.d.close(c);
    until(&mut [&mut dialer, &mut server], "Closed on both", |x| {
        x[0].closed(c).is_some() && x[1].closed(s).is_some()
    });
    assert_eq!(dialer.closed(c), Some(CloseReason::Local));
    assert_eq!(server.closed(s), Some(CloseReason::PeerClosed));
    assert_eq!(dialer.events_of(c).len(), 2, "{:?}", dialer.events_of(c));
    until(&mut [&mut dialer, &mut server], "slots freed", |x| {
        x[0].d.connection_count() == 0 && x[1].d.connection_count() == 0
    });
    let (ds, ss) = (dialer.d.stats(), server.d.stats());
    assert_eq!((ds.dials.started, ds.dials.connected), (1, 1));
    assert_eq!(
        (ss.rpc.accepted, ss.tcp.accepted, ss.ws.accepted),
        (1, 0, 0)
    );
    assert_eq!(dialer.d.send(c, b"late"), Err(net::io::SendError::Closed));
}

/// Bytes sent before the connect completed are queued, counted, and arrive in order
/// after it (a large one too, written over several polls).
fn bytes_sent_before_connected_arrive(backend: Backend) {
    let config = NetConfig::default();
    let (mut server, addr) = Side::listening(backend, &config, 64);
    let mut dialer = Side::new(backend, &config, Vec::new());
    let c = dialer.d.connect(addr).unwrap();
    let chunks = [pattern(10, 3), pattern(1 << 20, 4), pattern(7, 5)];
    for chunk in &chunks {
        dialer.d.send(c, chunk).unwrap();
    }
    let total: usize = chunks.iter().map(Vec::len).sum();
    assert_eq!(dialer.d.outbound_bytes(c), total);
    assert_eq!(dialer.d.outbound_total_bytes(), total);
    until(&mut [&mut dialer, &mut server], "every queued byte", |x| {
        x[1].accepted_rpc()
            .is_some_and(|s| x[1].received(s).len() >= total)
    });
    let s = server.accepted_rpc().unwrap();
    assert_eq!(server.received(s), chunks.concat());
    assert!(matches!(
        dialer.events_of(c)[..],
        [NetEvent::Connected { .. }]
    ));
    assert_eq!(dialer.d.outbound_bytes(c), 0);
}

/// Nothing listens on the port: exactly one `Closed { ConnectFailed(refused) }`.
fn dial_to_a_closed_port_fails(backend: Backend) {
    let mut dialer = Side::new(backend, &NetConfig::default(), Vec::new());
    let c = dialer.d.connect(dead_port()).unwrap();
    dialer.d.send(c, b"never written").unwrap();
    until(&mut [&mut dialer], "Closed", |x| x[0].closed(c).is_some());
    assert_eq!(
        dialer.events_of(c),
        vec![NetEvent::Closed {
            conn: c,
            reason: CloseReason::ConnectFailed(ErrorKind::ConnectionRefused)
        }]
    );
    until(&mut [&mut dialer], "slot freed", |x| {
        x[0].d.connection_count() == 0
    });
    let st = dialer.d.stats();
    assert_eq!((st.dials.failed, st.dials.connected), (1, 0));
    assert_eq!(st.outbound_bytes, 0);
}

/// Dials and accepted links count against `rpc_links_per_shard_max` (the links' own cap): a
/// dial past it is refused with an error, an accept past it is reset, and a slot
/// freed by a close makes room again.
fn the_link_cap_refuses_a_dial(backend: Backend) {
    let config = NetConfig {
        rpc_links_per_shard_max: 1,
        ..NetConfig::default()
    };
    let (mut server, addr) = Side::listening(backend, &NetConfig::default(), 64);
    let (mut dialer, dialer_addr) = Side::listening(backend, &config, 64);
    let c = dialer.d.connect(addr).unwrap();
    let err = dialer.d.connect(addr).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::QuotaExceeded, "{err}");
    assert_eq!(dialer.d.stats().dials.refused_conn_cap, 1);
    // An inbound connection is reset: the dial holds the shard's only slot.
    let mut inbound = TcpStream::connect(dialer_addr).unwrap();
    inbound.set_read_timeout(Some(FAIL_AFTER)).unwrap();
    until(
        &mut [&mut dialer, &mut server],
        "the inbound refusal",
        |x| x[0].d.stats().rpc.refused_conn_cap == 1,
    );
    match inbound.read(&mut [0; 1]) {
        Ok(0) => {}
        Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
        other => panic!("expected a reset, got {other:?}"),
    }
    dialer.d.close(c);
    until(&mut [&mut dialer, &mut server], "slot freed", |x| {
        x[0].d.connection_count() == 0
    });
    let c2 = dialer.d.connect(addr).unwrap();
    until(&mut [&mut dialer, &mut server], "Connected", |x| {
        x[0].events_of(c2).contains(&NetEvent::Connected {
            conn: c2,
            peer: addr,
        })
    });
}

/// A dial that never completes is closed with `ConnectTimeout`. The listener's
/// accept queue (backlog 0: one connection) is filled and never drained, so the
/// kernel drops the dial's SYN (`ListenOverflows`) and the connect stays pending.
fn a_pending_dial_times_out(backend: Backend) {
    let l = bind_reuseport("127.0.0.1:0".parse().unwrap(), 0).unwrap();
    let addr = l.local_addr().unwrap();
    let _filler = TcpStream::connect(addr).unwrap();
    // The filler's final ACK may still be on its way: wait until it is queued.
    let deadline = Instant::now() + FAIL_AFTER;
    while accept_queue_len(&l) < 1 {
        assert!(Instant::now() < deadline, "the accept queue never filled");
        std::thread::yield_now();
    }
    let config = NetConfig {
        connect_timeout_ms: 300,
        ..NetConfig::default()
    };
    let mut dialer = Side::new(backend, &config, Vec::new());
    let c = dialer.d.connect(addr).unwrap();
    dialer.d.send(c, b"queued").unwrap();
    until(&mut [&mut dialer], "Closed", |x| x[0].closed(c).is_some());
    assert_eq!(
        dialer.events_of(c),
        vec![NetEvent::Closed {
            conn: c,
            reason: CloseReason::ConnectTimeout
        }]
    );
    let st = dialer.d.stats();
    assert_eq!((st.dials.timed_out, st.connect_timeouts), (1, 1));
    until(&mut [&mut dialer], "slot freed", |x| {
        x[0].d.connection_count() == 0
    });
    drop(l);
}

/// A dial told to leave from 127.0.0.11 reaches a listener on 127.0.0.12 from that
/// address (Linux answers all of 127/8 on `lo`); without a source address the
/// kernel picks 127.0.0.1. Both are also the dialer's local address seen by the
/// listener's `Accepted`.
fn a_dial_leaves_from_the_source_address(backend: Backend) {
    let config = NetConfig::default();
    let l = bind_reuseport("127.0.0.12:0".parse().unwrap(), 64).unwrap();
    let addr = l.local_addr().unwrap();
    let mut server = Side::new(backend, &config, vec![(Transport::Rpc, l)]);
    let mut dialer = Side::new(backend, &config, Vec::new());
    let from: std::net::IpAddr = "127.0.0.11".parse().unwrap();
    let c = dialer.d.connect_from(addr, Some(from)).unwrap();
    let plain = dialer.d.connect(addr).unwrap();
    until(&mut [&mut dialer, &mut server], "two accepted", |s| {
        s[0].events.len() == 2
            && s[1]
                .events
                .iter()
                .filter(|e| matches!(e, NetEvent::Accepted { .. }))
                .count()
                == 2
    });
    assert!(
        dialer
            .events_of(c)
            .iter()
            .chain(dialer.events_of(plain).iter())
            .all(|e| matches!(e, NetEvent::Connected { peer, .. } if *peer == addr)),
        "{:?}",
        dialer.events
    );
    let mut peers: Vec<std::net::IpAddr> = server
        .events
        .iter()
        .filter_map(|e| match e {
            NetEvent::Accepted { peer, .. } => Some(peer.ip()),
            _ => None,
        })
        .collect();
    peers.sort();
    let expected: Vec<std::net::IpAddr> = vec!["127.0.0.1".parse().unwrap(), from];
    assert_eq!(peers, expected);
}

/// An unspecified source address, or one of the other family, binds nothing: the
/// dial goes out as without one.
fn an_unspecified_source_address_is_ignored(backend: Backend) {
    let config = NetConfig::default();
    let (mut server, addr) = Side::listening(backend, &config, 64);
    let mut dialer = Side::new(backend, &config, Vec::new());
    let a = dialer
        .d
        .connect_from(addr, Some("0.0.0.0".parse().unwrap()))
        .unwrap();
    let b = dialer
        .d
        .connect_from(addr, Some("::1".parse().unwrap()))
        .unwrap();
    until(&mut [&mut dialer, &mut server], "both connected", |s| {
        s[0].events.len() == 2
    });
    for c in [a, b] {
        assert_eq!(
            dialer.events_of(c),
            vec![NetEvent::Connected {
                conn: c,
                peer: addr
            }]
        );
    }
}

suite!(
    dial_exchange_and_close,
    bytes_sent_before_connected_arrive,
    dial_to_a_closed_port_fails,
    the_link_cap_refuses_a_dial,
    a_pending_dial_times_out,
    a_dial_leaves_from_the_source_address,
    an_unspecified_source_address_is_ignored,
);
