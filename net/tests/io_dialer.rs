//! A driver that only dials (`NetDriver::dialer`, `NetConfig::dialer`), as a load
//! generator uses one, on both backends: a table sized past the node's default link
//! cap, connections that are raw byte streams both ways (no WebSocket or TLS layer,
//! whatever the bytes look like), and `poll_until`, whose wait ends at its deadline
//! rather than at the next whole millisecond. Peers are plain sockets on 127.0.0.1;
//! the deadline only bounds a failing test.

mod support;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use net::io::{Backend, ConnId, NetConfig, NetDriver, NetEvent};
use shard::runtime::Driver;

/// Bounds every wait of a test that fails.
const FAIL_AFTER: Duration = Duration::from_secs(20);
/// Connections of the sizing test: more than `NetConfig::default()`'s link cap.
const LINKS: usize = 100;

fn dialer(backend: Backend, links: usize) -> NetDriver {
    let config = NetConfig {
        backend,
        ..NetConfig::dialer(links)
    };
    let d = NetDriver::dialer(&config).unwrap();
    assert_eq!(d.backend(), backend);
    d
}

/// Polls `d` until `done` holds for what it reported so far (every event, and the
/// input consumed per connection); panics naming `what` after [`FAIL_AFTER`].
fn poll_until_done(
    d: &mut NetDriver,
    seen: &mut Vec<NetEvent>,
    input: &mut HashMap<ConnId, Vec<u8>>,
    what: &str,
    done: impl Fn(&[NetEvent], &HashMap<ConnId, Vec<u8>>) -> bool,
) {
    let deadline = Instant::now() + FAIL_AFTER;
    let mut evs = Vec::new();
    while !done(seen, input) {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        evs.clear();
        d.poll(Some(Duration::from_millis(2)), &mut evs).unwrap();
        for &ev in &evs {
            if let NetEvent::Readable { conn } = ev {
                let bytes = d.input(conn).to_vec();
                d.consume(conn, bytes.len());
                input.entry(conn).or_default().extend(bytes);
            }
        }
        seen.extend_from_slice(&evs);
    }
}

/// Reads `n` bytes from the peer socket `s`, polling `d` (which writes them) while
/// none are there; what `d` reports goes to `seen`.
fn read_polling(
    d: &mut NetDriver,
    s: &mut TcpStream,
    n: usize,
    seen: &mut Vec<NetEvent>,
) -> Vec<u8> {
    s.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + FAIL_AFTER;
    let mut got = vec![0u8; n];
    let mut have = 0;
    let mut evs = Vec::new();
    while have < n {
        assert!(Instant::now() < deadline, "timed out reading {n} bytes");
        match s.read(&mut got[have..]) {
            Ok(0) => panic!("closed after {have} of {n} bytes"),
            Ok(k) => have += k,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                evs.clear();
                d.poll(Some(Duration::from_millis(1)), &mut evs).unwrap();
                seen.extend_from_slice(&evs);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => panic!("{e}"),
        }
    }
    s.set_nonblocking(false).unwrap();
    got
}

/// `LINKS` dials (past the default cap of 64 links) all connect; the bytes sent
/// before and after `Connected` reach the peer as they were sent, and the peer's
/// bytes (an HTTP upgrade request and a WebSocket-looking frame among them) come in
/// as they were written: no layer reads or answers them.
fn dialer_links_past_the_default_cap_are_raw_byte_streams(backend: Backend) {
    assert!(LINKS > NetConfig::default().rpc_links_per_shard_max);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut d = dialer(backend, LINKS);
    let ids: Vec<ConnId> = (0..LINKS).map(|_| d.connect(addr).unwrap()).collect();
    for (n, &id) in ids.iter().enumerate() {
        // Queued before the connect completed: written once it does.
        d.send(id, format!("conn{n:04}").as_bytes()).unwrap();
    }
    let (mut seen, mut input) = (Vec::new(), HashMap::new());
    let mut peers: HashMap<usize, TcpStream> = HashMap::new();
    for _ in 0..LINKS {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(FAIL_AFTER)).unwrap();
        let hello = read_polling(&mut d, &mut s, 8, &mut seen);
        let n: usize = std::str::from_utf8(&hello[4..]).unwrap().parse().unwrap();
        peers.insert(n, s);
    }
    assert_eq!(d.connection_count(), LINKS);
    let request = b"GET / HTTP/1.1\r\nUpgrade: websocket\r\n\r\n\x82\x85abcd";
    for (n, s) in peers.iter_mut() {
        s.write_all(request).unwrap();
        s.write_all(format!("#{n}").as_bytes()).unwrap();
    }
    poll_until_done(
        &mut d,
        &mut seen,
        &mut input,
        "every peer's bytes",
        |_, input| {
            ids.iter().enumerate().all(|(n, id)| {
                input.get(id).map_or(0, Vec::len) >= request.len() + format!("#{n}").len()
            })
        },
    );
    for (n, id) in ids.iter().enumerate() {
        let mut want = request.to_vec();
        want.extend_from_slice(format!("#{n}").as_bytes());
        assert_eq!(input[id], want, "connection {n}");
        assert!(seen.contains(&NetEvent::Connected {
            conn: *id,
            peer: addr
        }));
        d.send(*id, b"\x81\x05bytes").unwrap();
    }
    for (_, s) in peers.iter_mut() {
        let got = read_polling(&mut d, s, 7, &mut seen);
        assert_eq!(got, b"\x81\x05bytes", "written as sent");
    }
    assert!(
        !seen.iter().any(|e| matches!(e, NetEvent::Closed { .. })),
        "{seen:?}"
    );
}

/// Without IO, `poll_until` returns at its deadline, never before it, with no
/// event; a deadline already passed returns at once. (How close to the deadline a
/// wait ends is a speed, not asserted here: on mio a timerfd ends it, where
/// epoll's own timeout would round it up to the next whole millisecond.)
fn poll_until_ends_at_the_deadline_to_the_microsecond(backend: Backend) {
    let mut d = dialer(backend, 1);
    let mut evs = Vec::new();
    for _ in 0..20 {
        let start = Instant::now();
        let deadline = start + Duration::from_micros(50);
        d.poll_until(deadline, &mut evs).unwrap();
        assert!(Instant::now() >= deadline, "returned before its deadline");
    }
    assert!(evs.is_empty(), "{evs:?}");
    d.poll_until(Instant::now() - Duration::from_millis(1), &mut evs)
        .unwrap();
    assert!(evs.is_empty(), "{evs:?}");
}

/// A `NetConfig::dialer` table holds what its size says and refuses the next dial
/// (the cap error of `connect`); a far larger one is accepted by the driver.
fn dialer_config_sizes_the_table(backend: Backend) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut d = dialer(backend, 3);
    for _ in 0..3 {
        d.connect(addr).unwrap();
    }
    let err = d.connect(addr).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::QuotaExceeded);
    drop(dialer(backend, 20_000));
}

suite!(
    dialer_links_past_the_default_cap_are_raw_byte_streams,
    poll_until_ends_at_the_deadline_to_the_microsecond,
    dialer_config_sizes_the_table,
);
