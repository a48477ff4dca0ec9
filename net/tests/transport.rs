//! The TCP and WebSocket transports end to end, against both backends: a shard
//! runtime whose handler echoes every byte it receives, and plain std / tungstenite
//! clients on 127.0.0.1. Every wait is on an event or a read; timeouts only bound a
//! failure.

mod support;
use support::uring_available;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use net::io::{
    bind_reuseport, Backend, CloseReason, ConnId, NetConfig, NetDriver, NetEvent, Transport,
};
use shard::runtime::{Context, Driver, EventFd, Handler, Runtime, RuntimeConfig, ShardInit};
use slots::ShardId;
use tungstenite::Message;

/// Bounds every wait of a test that fails.
const FAIL_AFTER: Duration = Duration::from_secs(20);
/// Input that makes the echo handler answer it and then close the connection.
const BYE: &[u8] = b"bye!";

/// Echoes input back; reports every event except `Readable` to the test. With
/// `block_bytes > 0` it echoes whole blocks only and leaves a partial block in the
/// input (like a decoder waiting for the rest of a frame).
struct Echo {
    tx: Sender<(ShardId, NetEvent)>,
    block_bytes: usize,
    /// Largest unconsumed input seen.
    input_bytes_max: Arc<AtomicUsize>,
}

impl Handler for Echo {
    type Msg = ();
    type Timer = ();
    type Driver = NetDriver;

    fn on_message(&mut self, _: &mut Context<(), ()>, _: &mut NetDriver, _: ShardId, _: ()) {}

    fn on_io(&mut self, cx: &mut Context<(), ()>, driver: &mut NetDriver, event: NetEvent) {
        match event {
            NetEvent::Readable { conn } => {
                let input = driver.input(conn);
                self.input_bytes_max
                    .fetch_max(input.len(), Ordering::Relaxed);
                let take = match self.block_bytes {
                    0 => input.len(),
                    b => input.len() - input.len() % b,
                };
                let data = input[..take].to_vec();
                driver.consume(conn, data.len());
                let _ = driver.send(conn, &data);
                if data.ends_with(BYE) {
                    driver.close(conn);
                }
            }
            other => {
                let _ = self.tx.send((cx.shard_id(), other));
            }
        }
    }
}

struct Server {
    rt: Option<Runtime<Echo>>,
    tcp: SocketAddr,
    ws: SocketAddr,
    events: Receiver<(ShardId, NetEvent)>,
    input_bytes_max: Arc<AtomicUsize>,
}

impl Server {
    fn start(backend: Backend, shards: u16, config: NetConfig) -> Server {
        Self::start_with(backend, shards, config, 0)
    }

    fn start_with(backend: Backend, shards: u16, config: NetConfig, block_bytes: usize) -> Server {
        let config = NetConfig { backend, ..config };
        let localhost: SocketAddr = "127.0.0.1:0".parse().unwrap();
        // One SO_REUSEPORT listener per shard on the same two ports.
        let mut per_shard: Vec<Vec<(Transport, TcpListener)>> = Vec::new();
        let tcp0 = bind_reuseport(localhost, 4096).unwrap();
        let ws0 = bind_reuseport(localhost, 4096).unwrap();
        let (tcp, ws) = (tcp0.local_addr().unwrap(), ws0.local_addr().unwrap());
        per_shard.push(vec![(Transport::Tcp, tcp0), (Transport::WebSocket, ws0)]);
        for _ in 1..shards {
            per_shard.push(vec![
                (Transport::Tcp, bind_reuseport(tcp, 4096).unwrap()),
                (Transport::WebSocket, bind_reuseport(ws, 4096).unwrap()),
            ]);
        }
        let per_shard = Mutex::new(per_shard.into_iter().map(Some).collect::<Vec<_>>());
        let (tx, events) = channel();
        let tx = Mutex::new(tx);
        let input_bytes_max = Arc::new(AtomicUsize::new(0));
        let input_max = input_bytes_max.clone();
        let rt_config = RuntimeConfig {
            shard_count: shards,
            pin_cores: Vec::new(),
            thread_name: "transport-test".into(),
            ..RuntimeConfig::default()
        };
        let rt = Runtime::start(rt_config, move |init: &ShardInit| {
            let listeners = per_shard.lock().unwrap()[init.shard as usize]
                .take()
                .expect("one factory call per shard");
            let driver = NetDriver::new(&config, init.doorbell.clone(), listeners)?;
            assert_eq!(driver.backend(), backend);
            let tx = tx.lock().unwrap().clone();
            let echo = Echo {
                tx,
                block_bytes,
                input_bytes_max: input_max.clone(),
            };
            Ok((echo, driver))
        })
        .unwrap();
        Server {
            rt: Some(rt),
            tcp,
            ws,
            events,
            input_bytes_max,
        }
    }

    /// The next reported event matching `pred`, skipping others.
    fn wait_for(&self, what: &str, pred: impl Fn(&NetEvent) -> bool) -> (ShardId, NetEvent) {
        let deadline = Instant::now() + FAIL_AFTER;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok((shard, ev)) if pred(&ev) => return (shard, ev),
                Ok(_) => {}
                Err(_) => panic!("timed out waiting for {what}"),
            }
        }
    }

    fn wait_accepted(&self, kind: Transport) -> ConnId {
        match self
            .wait_for(
                "Accepted",
                |e| matches!(e, NetEvent::Accepted { listener, .. } if *listener == kind),
            )
            .1
        {
            NetEvent::Accepted { conn, .. } => conn,
            _ => unreachable!(),
        }
    }

    fn wait_closed(&self, conn: ConnId) -> CloseReason {
        match self
            .wait_for(
                "Closed",
                |e| matches!(e, NetEvent::Closed { conn: c, .. } if *c == conn),
            )
            .1
        {
            NetEvent::Closed { reason, .. } => reason,
            _ => unreachable!(),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.handle().stop();
            for r in rt.join() {
                if let Err(e) = r {
                    if !std::thread::panicking() {
                        panic!("shard failed: {e}");
                    }
                }
            }
        }
    }
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(FAIL_AFTER)).unwrap();
    s.set_write_timeout(Some(FAIL_AFTER)).unwrap();
    s
}

fn read_exact_n(s: &mut TcpStream, n: usize) -> Vec<u8> {
    let mut buf = vec![0; n];
    s.read_exact(&mut buf).unwrap();
    buf
}

/// Reads until end of stream or a reset; returns the bytes before it.
fn read_to_close(s: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return out,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return out,
            Err(e) => panic!("expected the server to close, got {e}"),
        }
    }
}

type Ws = tungstenite::WebSocket<TcpStream>;

fn ws_connect(addr: SocketAddr, path: &str) -> Ws {
    let stream = connect(addr);
    let (ws, resp) = tungstenite::client(format!("ws://{addr}{path}"), stream).unwrap();
    assert_eq!(resp.status(), 101);
    assert!(resp.headers().get("sec-websocket-protocol").is_none());
    ws
}

/// Reads binary messages until `n` payload bytes arrived; returns them concatenated.
fn ws_read_bytes(ws: &mut Ws, n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    while out.len() < n {
        match ws.read().unwrap() {
            Message::Binary(b) => out.extend_from_slice(&b),
            other => panic!("unexpected message {other:?}"),
        }
    }
    assert_eq!(out.len(), n);
    out
}

/// A masked client frame.
fn masked_frame(opcode: u8, fin: bool, payload: &[u8], mask: [u8; 4]) -> Vec<u8> {
    let mut out = vec![opcode | if fin { 0x80 } else { 0 }];
    match payload.len() {
        n if n < 126 => out.push(0x80 | n as u8),
        n if n < 65536 => {
            out.push(0x80 | 126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(0x80 | 127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(&mask);
    out.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    out
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

// ---------------------------------------------------------------- the suite

fn tcp_echo(backend: Backend) {
    let server = Server::start(backend, 1, NetConfig::default());
    let mut c = connect(server.tcp);
    let conn = server.wait_accepted(Transport::Tcp);
    c.write_all(b"hello").unwrap();
    assert_eq!(read_exact_n(&mut c, 5), b"hello");
    let big = pattern(300_000, 7);
    c.write_all(&big).unwrap();
    assert_eq!(read_exact_n(&mut c, big.len()), big);
    drop(c);
    assert_eq!(server.wait_closed(conn), CloseReason::PeerClosed);
}

/// The accepted connection reports the client's address (the io_uring backend takes
/// it from the accept itself, not from a `getpeername` per connection).
fn accepted_peer_is_the_clients_address(backend: Backend) {
    let server = Server::start(backend, 1, NetConfig::default());
    for _ in 0..3 {
        let c = connect(server.tcp);
        let (_, ev) = server.wait_for("Accepted", |e| matches!(e, NetEvent::Accepted { .. }));
        let NetEvent::Accepted { peer, .. } = ev else {
            unreachable!()
        };
        assert_eq!(peer, c.local_addr().unwrap());
    }
}

fn ws_echo_ping_close(backend: Backend) {
    let server = Server::start(backend, 1, NetConfig::default());
    let mut ws = ws_connect(server.ws, "/any/path?x=1");
    let conn = server.wait_accepted(Transport::WebSocket);
    ws.send(Message::Binary(b"hello ws".to_vec().into()))
        .unwrap();
    assert_eq!(ws_read_bytes(&mut ws, 8), b"hello ws");
    let big = pattern(200_000, 3);
    ws.send(Message::Binary(big.clone().into())).unwrap();
    assert_eq!(ws_read_bytes(&mut ws, big.len()), big);
    ws.send(Message::Ping(b"p1".to_vec().into())).unwrap();
    match ws.read().unwrap() {
        Message::Pong(p) => assert_eq!(&p[..], b"p1"),
        other => panic!("expected pong, got {other:?}"),
    }
    ws.close(None).unwrap();
    // The server answers the close frame and closes the connection.
    loop {
        match ws.read() {
            Ok(Message::Close(_)) => {}
            Ok(other) => panic!("unexpected {other:?}"),
            Err(tungstenite::Error::ConnectionClosed) => break,
            Err(e) => panic!("close handshake failed: {e}"),
        }
    }
    assert_eq!(server.wait_closed(conn), CloseReason::PeerClosed);
}

fn split_and_coalesced_input(backend: Backend) {
    let server = Server::start(backend, 1, NetConfig::default());
    // TCP: one message byte by byte, then several at once.
    let mut c = connect(server.tcp);
    let msg = pattern(600, 11);
    for b in &msg {
        c.write_all(std::slice::from_ref(b)).unwrap();
    }
    assert_eq!(read_exact_n(&mut c, msg.len()), msg);
    let many: Vec<u8> = (0..50u32).flat_map(|i| pattern(100, i)).collect();
    c.write_all(&many).unwrap();
    assert_eq!(read_exact_n(&mut c, many.len()), many);

    // WebSocket: a message fragmented in three frames with a ping inside, written
    // byte by byte; then several messages in one write.
    let mut ws = ws_connect(server.ws, "/");
    let payload = pattern(3000, 5);
    let mut raw = masked_frame(0x2, false, &payload[..1000], [1, 2, 3, 4]);
    raw.extend(masked_frame(0x9, true, b"in-between", [7, 7, 7, 7]));
    raw.extend(masked_frame(0x0, false, &payload[1000..2000], [9, 8, 7, 6]));
    raw.extend(masked_frame(0x0, true, &payload[2000..], [0, 0, 0, 1]));
    for b in &raw {
        ws.get_mut().write_all(std::slice::from_ref(b)).unwrap();
    }
    let mut got = Vec::new();
    let mut ponged = false;
    while got.len() < payload.len() || !ponged {
        match ws.read().unwrap() {
            Message::Binary(b) => got.extend_from_slice(&b),
            Message::Pong(p) => {
                assert_eq!(&p[..], b"in-between");
                ponged = true;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(got, payload);
    let mut raw = Vec::new();
    let mut expect = Vec::new();
    for i in 0..20u32 {
        let p = pattern(70 + i as usize, 100 + i);
        raw.extend(masked_frame(0x2, true, &p, [i as u8, 1, 2, 3]));
        expect.extend(p);
    }
    ws.get_mut().write_all(&raw).unwrap();
    assert_eq!(ws_read_bytes(&mut ws, expect.len()), expect);
}

fn bad_websocket_input_closes_only_that_client(backend: Backend) {
    let server = Server::start(backend, 1, NetConfig::default());
    let mut good = ws_connect(server.ws, "/");
    let good_id = server.wait_accepted(Transport::WebSocket);
    for bad_bytes in [
        // An unmasked binary frame.
        vec![0x82u8, 0x03, b'a', b'b', b'c'],
        // Garbage: reserved bits and opcode.
        vec![0xFFu8; 16],
    ] {
        let mut bad = ws_connect(server.ws, "/bad");
        let bad_id = server.wait_accepted(Transport::WebSocket);
        bad.get_mut().write_all(&bad_bytes).unwrap();
        assert_eq!(server.wait_closed(bad_id), CloseReason::WebSocketProtocol);
        // The bad client gets a close frame (protocol error), then end of stream.
        match bad.read() {
            Ok(Message::Close(Some(frame))) => assert_eq!(u16::from(frame.code), 1002),
            other => panic!("expected a close frame, got {other:?}"),
        }
        // The neighbour keeps working.
        good.send(Message::Binary(b"still here".to_vec().into()))
            .unwrap();
        assert_eq!(ws_read_bytes(&mut good, 10), b"still here");
    }
    // A bad upgrade request gets a 400 and is never reported.
    let mut c = connect(server.ws);
    c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let resp = read_to_close(&mut c);
    assert!(resp.starts_with(b"HTTP/1.1 400"), "{resp:?}");
    good.send(Message::Binary(b"again".to_vec().into()))
        .unwrap();
    assert_eq!(ws_read_bytes(&mut good, 5), b"again");
    good.close(None).unwrap();
    assert_eq!(server.wait_closed(good_id), CloseReason::PeerClosed);
}

fn slow_reader_is_closed_on_outbound_overflow(backend: Backend) {
    let config = NetConfig {
        outbound_queue_bytes_max: 64 * 1024,
        ..NetConfig::default()
    };
    let server = Server::start(backend, 1, config);
    let mut steady = connect(server.tcp);
    let steady_id = server.wait_accepted(Transport::Tcp);
    // The slow client: small receive buffer, never reads, keeps sending.
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    sock.connect(&server.tcp.into()).unwrap();
    let mut slow: TcpStream = sock.into();
    slow.set_write_timeout(Some(FAIL_AFTER)).unwrap();
    let slow_id = server.wait_accepted(Transport::Tcp);
    let flooder = std::thread::spawn(move || {
        let chunk = vec![0x5Au8; 16 * 1024];
        let limit_bytes = 1usize << 30;
        let mut sent = 0usize;
        while sent < limit_bytes {
            match slow.write(&chunk) {
                Ok(n) => sent += n,
                Err(_) => return sent, // Closed by the server.
            }
        }
        panic!("the server never closed the slow reader after {sent} bytes");
    });
    assert_eq!(server.wait_closed(slow_id), CloseReason::OutboundOverflow);
    let sent = flooder.join().unwrap();
    assert!(sent > 64 * 1024);
    steady.write_all(b"ping").unwrap();
    assert_eq!(read_exact_n(&mut steady, 4), b"ping");
    drop(steady);
    assert_eq!(server.wait_closed(steady_id), CloseReason::PeerClosed);
}

fn unconsumed_input_pauses_reading(backend: Backend) {
    // The handler consumes 100 KiB blocks only; reading pauses while a partial block
    // waits, resumes once it is consumed, and unconsumed input stays bounded.
    const BLOCK: usize = 100 * 1024;
    let defaults = NetConfig::default();
    let config = NetConfig {
        inbound_buffer_bytes_max: BLOCK + 64 * 1024,
        ..NetConfig::default()
    };
    let limit = config.inbound_buffer_bytes_max;
    let server = Server::start_with(backend, 1, config, BLOCK);
    let mut c = connect(server.tcp);
    let id = server.wait_accepted(Transport::Tcp);
    let data = pattern(20 * BLOCK, 9);
    let mut writer = c.try_clone().unwrap();
    let to_send = data.clone();
    let sender = std::thread::spawn(move || writer.write_all(&to_send).unwrap());
    assert_eq!(read_exact_n(&mut c, data.len()), data);
    sender.join().unwrap();
    let max_seen = server.input_bytes_max.load(Ordering::Relaxed);
    // io_uring may deliver the completions already posted when it paused.
    let slack = match backend {
        Backend::Uring => usize::from(defaults.uring_buf_count) * defaults.uring_buf_bytes as usize,
        _ => 0,
    };
    println!("max unconsumed input: {max_seen} bytes (limit {limit} + slack {slack})");
    assert!(
        max_seen >= BLOCK && max_seen <= limit + slack,
        "max unconsumed {max_seen}"
    );
    drop(c);
    assert_eq!(server.wait_closed(id), CloseReason::PeerClosed);
}

fn idle_connection_is_closed(backend: Backend) {
    let config = NetConfig {
        idle_timeout_ms: 150,
        ..NetConfig::default()
    };
    let server = Server::start(backend, 1, config);
    let mut silent = connect(server.tcp);
    let id = server.wait_accepted(Transport::Tcp);
    assert_eq!(server.wait_closed(id), CloseReason::IdleTimeout);
    assert!(read_to_close(&mut silent).is_empty());
    // A silent WebSocket client gets a close frame.
    let mut ws = ws_connect(server.ws, "/");
    let id = server.wait_accepted(Transport::WebSocket);
    assert_eq!(server.wait_closed(id), CloseReason::IdleTimeout);
    assert!(matches!(ws.read(), Ok(Message::Close(_))));
}

fn connections_past_the_limit_are_refused(backend: Backend) {
    let config = NetConfig {
        connections_per_shard_max: 2,
        ..NetConfig::default()
    };
    let server = Server::start(backend, 1, config);
    let mut a = connect(server.tcp);
    let a_id = server.wait_accepted(Transport::Tcp);
    let mut b = connect(server.tcp);
    server.wait_accepted(Transport::Tcp);
    let mut extra = connect(server.tcp);
    // Over the cap: accepted and reset at once (SO_LINGER 0), not a graceful close.
    let mut buf = [0u8; 16];
    match extra.read(&mut buf) {
        Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
        other => panic!("the extra connection must be reset, got {other:?}"),
    }
    for c in [&mut a, &mut b] {
        c.write_all(b"ok").unwrap();
        assert_eq!(read_exact_n(c, 2), b"ok");
    }
    // A slot freed by a close is usable again.
    drop(a);
    assert_eq!(server.wait_closed(a_id), CloseReason::PeerClosed);
    let mut again = connect(server.tcp);
    server.wait_accepted(Transport::Tcp);
    again.write_all(b"re").unwrap();
    assert_eq!(read_exact_n(&mut again, 2), b"re");
}

fn ws_ping_flood_output_is_bounded(backend: Backend) {
    // A client that upgrades, then sends PINGs and never reads: each PONG counts
    // against the outbound limit, so the connection is closed instead of growing.
    let config = NetConfig {
        outbound_queue_bytes_max: 64 * 1024,
        ..NetConfig::default()
    };
    let server = Server::start(backend, 1, config);
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    sock.connect(&server.ws.into()).unwrap();
    let stream: TcpStream = sock.into();
    stream.set_read_timeout(Some(FAIL_AFTER)).unwrap();
    stream.set_write_timeout(Some(FAIL_AFTER)).unwrap();
    let (ws, _) = tungstenite::client(format!("ws://{}/", server.ws), stream).unwrap();
    let id = server.wait_accepted(Transport::WebSocket);
    let mut raw = ws.into_inner();
    let pings: Vec<u8> = (0..64u8)
        .flat_map(|i| masked_frame(0x9, true, &[i; 125], [i, 1, 2, 3]))
        .collect();
    let flooder = std::thread::spawn(move || {
        let limit_bytes = 1usize << 30;
        let mut sent = 0usize;
        while sent < limit_bytes {
            match raw.write(&pings) {
                Ok(n) => sent += n,
                Err(_) => return sent, // Closed by the server.
            }
        }
        panic!("the server never closed the PING flooder after {sent} bytes");
    });
    assert_eq!(server.wait_closed(id), CloseReason::OutboundOverflow);
    let sent = flooder.join().unwrap();
    println!("PING bytes sent before the close: {sent}");
}

fn ws_pings_without_connect_time_out(backend: Backend) {
    // PINGs keep input flowing but do not authenticate: the connection is closed
    // connect_timeout_ms after its accept (the handler never marks it established).
    let config = NetConfig {
        connect_timeout_ms: 300,
        ..NetConfig::default()
    };
    let server = Server::start(backend, 1, config);
    let mut ws = ws_connect(server.ws, "/");
    let id = server.wait_accepted(Transport::WebSocket);
    let pinger = std::thread::spawn(move || {
        let deadline = Instant::now() + FAIL_AFTER;
        while Instant::now() < deadline {
            if ws.send(Message::Ping(b"alive".to_vec().into())).is_err() {
                return; // Closed by the server.
            }
            match ws.read() {
                Ok(Message::Pong(_)) => {}
                Ok(Message::Close(_)) | Err(_) => return,
                Ok(other) => panic!("unexpected {other:?}"),
            }
            std::thread::sleep(Duration::from_millis(20)); // The client's PING pace.
        }
        panic!("still open after {FAIL_AFTER:?} of PINGs");
    });
    assert_eq!(server.wait_closed(id), CloseReason::ConnectTimeout);
    pinger.join().unwrap();
}

fn graceful_local_close(backend: Backend) {
    let server = Server::start(backend, 1, NetConfig::default());
    let mut c = connect(server.tcp);
    let id = server.wait_accepted(Transport::Tcp);
    c.write_all(BYE).unwrap();
    // The echo queued before close() is flushed, then the stream ends.
    assert_eq!(read_to_close(&mut c), BYE);
    assert_eq!(server.wait_closed(id), CloseReason::Local);
    let mut ws = ws_connect(server.ws, "/");
    let id = server.wait_accepted(Transport::WebSocket);
    ws.send(Message::Binary(BYE.to_vec().into())).unwrap();
    assert_eq!(ws_read_bytes(&mut ws, BYE.len()), BYE);
    match ws.read() {
        Ok(Message::Close(Some(frame))) => assert_eq!(u16::from(frame.code), 1000),
        other => panic!("expected a close frame, got {other:?}"),
    }
    assert_eq!(server.wait_closed(id), CloseReason::Local);
}

fn two_shards_reuseport(backend: Backend) {
    let server = Server::start(backend, 2, NetConfig::default());
    let mut clients: Vec<TcpStream> = (0..64).map(|_| connect(server.tcp)).collect();
    for (i, c) in clients.iter_mut().enumerate() {
        let msg = pattern(32, i as u32);
        c.write_all(&msg).unwrap();
        assert_eq!(read_exact_n(c, 32), msg);
    }
    let mut per_shard = [0usize; 2];
    for _ in 0..64 {
        let (shard, _) = server.wait_for("Accepted", |e| matches!(e, NetEvent::Accepted { .. }));
        per_shard[shard as usize] += 1;
    }
    println!("connections per shard: {per_shard:?}");
    assert_eq!(per_shard.iter().sum::<usize>(), 64);
}

/// Connections opened by the child process in `ten_thousand_connections`.
const MANY_CONNECTIONS: usize = 10_000;
const CHILD_ADDR_ENV: &str = "NET_TRANSPORT_CHILD_ADDR";

fn ten_thousand_connections(backend: Backend) {
    // Both ends of 10,000 connections need 20,000 fds, the per-process limit: the
    // clients run in a child process (this test binary, `child_clients`). One such
    // test at a time, so the server ends of both backends' runs never add up.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    // One shard holds all of them (the default cap is 8,192 per shard).
    let cfg = NetConfig {
        connections_per_shard_max: MANY_CONNECTIONS + 64,
        ..NetConfig::default()
    };
    let server = Server::start(backend, 1, cfg);
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "child_clients", "--nocapture"])
        .env(CHILD_ADDR_ENV, server.tcp.to_string())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains(&format!("echoed {MANY_CONNECTIONS} of {MANY_CONNECTIONS}")));
    let mut accepted = 0;
    while accepted < MANY_CONNECTIONS {
        server.wait_for("Accepted", |e| matches!(e, NetEvent::Accepted { .. }));
        accepted += 1;
    }
}

/// The client side of `ten_thousand_connections`, run in a child process.
#[test]
#[ignore = "run by ten_thousand_connections in a child process"]
fn child_clients() {
    let addr: SocketAddr = std::env::var(CHILD_ADDR_ENV)
        .expect("run by ten_thousand_connections")
        .parse()
        .unwrap();
    let mut conns: Vec<TcpStream> = (0..MANY_CONNECTIONS).map(|_| connect(addr)).collect();
    for (i, c) in conns.iter_mut().enumerate() {
        c.write_all(&(i as u32).to_le_bytes()).unwrap();
    }
    let mut ok = 0;
    for (i, c) in conns.iter_mut().enumerate() {
        assert_eq!(
            read_exact_n(c, 4),
            (i as u32).to_le_bytes(),
            "connection {i}"
        );
        ok += 1;
    }
    println!("echoed {ok} of {MANY_CONNECTIONS}");
}

/// `poll_now` takes the time from its caller (the runtime's one clock reading per
/// turn): a turn clock past a connection's idle timeout closes it in that poll,
/// though the minute has not passed, and a clock before it closes nothing.
fn poll_now_runs_the_drivers_timers_on_the_callers_clock(backend: Backend) {
    let config = NetConfig {
        backend,
        idle_timeout_ms: 60_000,
        ..NetConfig::default()
    };
    let listener = bind_reuseport("127.0.0.1:0".parse().unwrap(), 16).unwrap();
    let addr = listener.local_addr().unwrap();
    let doorbell = Arc::new(EventFd::new().unwrap());
    let mut driver = NetDriver::new(&config, doorbell, vec![(Transport::Tcp, listener)]).unwrap();
    let _client = connect(addr);
    let mut events = Vec::new();
    let give_up = Instant::now() + FAIL_AFTER;
    let conn = loop {
        driver
            .poll(Some(Duration::from_millis(50)), &mut events)
            .unwrap();
        let accepted = events.iter().find_map(|e| match e {
            NetEvent::Accepted { conn, .. } => Some(*conn),
            _ => None,
        });
        if let Some(conn) = accepted {
            break conn;
        }
        assert!(Instant::now() < give_up, "never accepted");
    };
    driver.mark_established(conn);
    events.clear();
    driver.poll_now(Instant::now(), &mut events).unwrap();
    assert!(events.is_empty(), "nothing is due yet: {events:?}");
    let later = Instant::now() + Duration::from_secs(61);
    driver.poll_now(later, &mut events).unwrap();
    assert_eq!(
        events,
        [NetEvent::Closed {
            conn,
            reason: CloseReason::IdleTimeout
        }]
    );
}

suite!(
    poll_now_runs_the_drivers_timers_on_the_callers_clock,
    tcp_echo,
    accepted_peer_is_the_clients_address,
    ws_echo_ping_close,
    split_and_coalesced_input,
    bad_websocket_input_closes_only_that_client,
    slow_reader_is_closed_on_outbound_overflow,
    unconsumed_input_pauses_reading,
    idle_connection_is_closed,
    connections_past_the_limit_are_refused,
    ws_ping_flood_output_is_bounded,
    ws_pings_without_connect_time_out,
    graceful_local_close,
    two_shards_reuseport,
    ten_thousand_connections,
);

#[test]
fn auto_backend_picks_uring_when_available() {
    let backend = std::thread::spawn(|| {
        let doorbell = std::sync::Arc::new(EventFd::new().unwrap());
        let config = NetConfig {
            backend: Backend::Auto,
            ..NetConfig::default()
        };
        NetDriver::new(&config, doorbell, Vec::new())
            .unwrap()
            .backend()
    })
    .join()
    .unwrap();
    let expect = if uring_available() {
        Backend::Uring
    } else {
        Backend::Mio
    };
    assert_eq!(backend, expect);
}

#[test]
fn auto_backend_falls_back_to_mio_when_uring_setup_fails() {
    // A ring size the kernel refuses makes the io_uring setup fail; Auto then serves
    // with mio on the same listener.
    let listener = bind_reuseport("127.0.0.1:0".parse().unwrap(), 16).unwrap();
    let addr = listener.local_addr().unwrap();
    let config = NetConfig {
        backend: Backend::Auto,
        uring_entries: u32::MAX,
        ..NetConfig::default()
    };
    let (tx, rx) = channel();
    let driver_thread = std::thread::spawn(move || {
        let doorbell = std::sync::Arc::new(EventFd::new().unwrap());
        let mut d = NetDriver::new(&config, doorbell, vec![(Transport::Tcp, listener)]).unwrap();
        tx.send(d.backend()).unwrap();
        // Serve one echo by hand.
        let mut events = Vec::new();
        let deadline = Instant::now() + FAIL_AFTER;
        while Instant::now() < deadline {
            shard::runtime::Driver::poll(&mut d, Some(Duration::from_millis(50)), &mut events)
                .unwrap();
            for ev in events.drain(..) {
                if let NetEvent::Readable { conn } = ev {
                    let data = d.input(conn).to_vec();
                    d.consume(conn, data.len());
                    d.send(conn, &data).unwrap();
                }
                if let NetEvent::Closed { .. } = ev {
                    return;
                }
            }
        }
        panic!("no close within the bound");
    });
    assert_eq!(rx.recv_timeout(FAIL_AFTER).unwrap(), Backend::Mio);
    let mut c = connect(addr);
    c.write_all(b"fallback").unwrap();
    assert_eq!(read_exact_n(&mut c, 8), b"fallback");
    drop(c);
    driver_thread.join().unwrap();
}
