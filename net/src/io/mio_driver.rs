//! The mio (epoll, edge-triggered) backend. One `mio::Poll` per shard; the doorbell
//! eventfd is registered in it, so a park is one `epoll_wait`. Reads go through one
//! per-shard scratch buffer of `read_chunk_bytes` and are appended to the
//! connection's input; writes (one `writev` when the queue spans both of its
//! buffers) go out until `WouldBlock`, then wait for writability. A dialed socket is
//! registered like an accepted one; its first event is checked with
//! `connect_outcome` (`SO_ERROR`, `peer_addr`) before any read or write.

use std::io::{self, IoSlice, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::net::{TcpListener as MioListener, TcpStream};
use mio::unix::SourceFd;
use mio::{Interest, Poll, Token};
use shard::runtime::{Driver, EventFd};

use super::core::{classify_accept_error, AcceptFailure, AfterFlush, Core, Phase, Refusal};
use super::{
    accept_with_spare, connect_outcome, prepare_listener, reset, restore_spare, ConnId, Listener,
    NetConfig, NetEvent, NetStats, SendError, Spare, SpareOutcome, Transport,
};

const DOORBELL: Token = Token(usize::MAX);
/// Listener `i` has token `LISTENER_BASE - i`; connection tokens are slot indices
/// (`< 2^24`).
const LISTENER_BASE: usize = usize::MAX - 1;

/// One readiness event, copied out of `mio::Events`.
#[derive(Clone, Copy)]
struct Ready {
    token: Token,
    readable: bool,
    /// The peer closed or the socket failed: read to the end.
    closed: bool,
    writable: bool,
}

#[derive(Default)]
struct MioConn {
    sock: Option<TcpStream>,
    /// Reading stopped because the unconsumed input reached the pause threshold.
    paused: bool,
}

/// The mio backend of one shard. See the [module docs](super) for the contract.
pub struct MioDriver {
    core: Core,
    poll: Poll,
    events: mio::Events,
    doorbell: Arc<EventFd>,
    listeners: Vec<(Transport, MioListener)>,
    conns: Vec<MioConn>,
    paused: Vec<u32>,
    scratch: Vec<u8>,
    start: Instant,
    list_buf: Vec<u32>,
    /// Readiness copied out of `events`.
    ready: Vec<Ready>,
    /// One read: reading pauses when a connection's unconsumed input is within
    /// it of the connection's limit (`Core::pause_bytes`).
    read_bytes: usize,
    /// Closed to accept (and reset) one connection when out of descriptors.
    spare: Spare,
    /// Listeners whose pause ended (reused).
    resumed: Vec<usize>,
}

impl MioDriver {
    /// A mio driver accepting on `listeners` and waking on `doorbell`.
    pub fn new(
        config: &NetConfig,
        doorbell: Arc<EventFd>,
        listeners: Vec<Listener>,
    ) -> io::Result<Self> {
        config.validate()?;
        let poll = Poll::new()?;
        poll.registry().register(
            &mut SourceFd(&doorbell.as_raw_fd()),
            DOORBELL,
            Interest::READABLE,
        )?;
        let mut core = Core::new(config, 0);
        let mut mio_listeners = Vec::with_capacity(listeners.len());
        for (
            i,
            Listener {
                kind,
                socket: l,
                tls,
            },
        ) in listeners.into_iter().enumerate()
        {
            core.add_listener_tls(kind, tls);
            prepare_listener(&l, config.listen_backlog)?;
            let mut l = MioListener::from_std(l);
            poll.registry()
                .register(&mut l, Token(LISTENER_BASE - i), Interest::READABLE)?;
            mio_listeners.push((kind, l));
        }
        Ok(MioDriver {
            // Reads stop at the pause threshold, one chunk below the limit: no slack.
            core,
            poll,
            events: mio::Events::with_capacity(config.mio_events_capacity),
            doorbell,
            listeners: mio_listeners,
            conns: Vec::new(),
            paused: Vec::new(),
            scratch: vec![0; config.read_chunk_bytes],
            start: Instant::now(),
            list_buf: Vec::new(),
            ready: Vec::with_capacity(config.mio_events_capacity),
            read_bytes: config.read_chunk_bytes,
            spare: Spare::open(),
            resumed: Vec::new(),
        })
    }

    /// Lifts `connect_timeout_ms` from `conn` (CONNECT accepted, or the RPC handshake
    /// done); a stale id is a no-op
    /// ([`NetDriver::mark_established`](super::NetDriver::mark_established)).
    pub fn mark_established(&mut self, conn: ConnId) {
        self.core.mark_established(conn)
    }

    /// See [`NetDriver::connect`](super::NetDriver::connect): a non-blocking connect,
    /// registered for both readiness kinds; its first event tells the outcome.
    pub fn connect(&mut self, addr: SocketAddr, from: Option<IpAddr>) -> io::Result<ConnId> {
        let (idx, id, stream) = super::begin_dial(&mut self.core, addr, from)?;
        if self.conns.len() <= idx as usize {
            self.conns.resize_with(idx as usize + 1, MioConn::default);
        }
        let Some(stream) = stream else {
            return Ok(id);
        };
        let mut stream = TcpStream::from_std(stream);
        if let Err(e) = self.poll.registry().register(
            &mut stream,
            Token(idx as usize),
            Interest::READABLE | Interest::WRITABLE,
        ) {
            self.core.on_error(idx, e.kind());
            return Ok(id);
        }
        self.conns[idx as usize].sock = Some(stream);
        Ok(id)
    }

    /// The first readiness of a dialing socket: connected, failed, or (a spurious
    /// wakeup without an error) still connecting.
    fn finish_connect(&mut self, idx: u32, hangup: bool) {
        let Some(sock) = self.conns[idx as usize].sock.as_ref() else {
            return;
        };
        match connect_outcome(sock, hangup) {
            Ok(Some(peer)) => self.core.on_connected(idx, peer),
            Ok(None) => {}
            Err(e) => self.core.on_error(idx, e.kind()),
        }
    }

    /// Queued, unwritten output of all connections, against
    /// `outbound_budget_bytes_per_shard`
    /// ([`NetDriver::outbound_total_bytes`](super::NetDriver::outbound_total_bytes)).
    pub fn outbound_total_bytes(&self) -> usize {
        self.core.outbound_total()
    }

    /// The unconsumed input of `conn`, empty for a stale id
    /// ([`NetDriver::input`](super::NetDriver::input)).
    pub fn input(&self, conn: ConnId) -> &[u8] {
        self.core.input(conn)
    }

    /// Drops the first `n` bytes of `conn`'s input, clamped to its length
    /// ([`NetDriver::consume`](super::NetDriver::consume)).
    pub fn consume(&mut self, conn: ConnId, n: usize) {
        self.core.consume(conn, n)
    }

    /// Queues `bytes` for `conn` (WebSocket: one binary message), written at the next
    /// poll; refused for a stale id or past the queue's limit
    /// ([`NetDriver::send`](super::NetDriver::send)).
    pub fn send(&mut self, conn: ConnId, bytes: &[u8]) -> Result<(), SendError> {
        self.core.send(conn, bytes)
    }

    /// Queues `bytes` for `conn` as one WebSocket text message (on TCP: as they are)
    /// ([`NetDriver::send_text`](super::NetDriver::send_text)).
    pub fn send_text(&mut self, conn: ConnId, bytes: &[u8]) -> Result<(), SendError> {
        self.core.send_text(conn, bytes)
    }

    /// Whether `conn` is a WebSocket connection whose first data message was text
    /// ([`NetDriver::text_messages`](super::NetDriver::text_messages)).
    pub fn text_messages(&self, conn: ConnId) -> bool {
        self.core.text_messages(conn)
    }

    /// Closes `conn` gracefully; a `Closed { reason: Local }` follows, a stale id is
    /// a no-op ([`NetDriver::close`](super::NetDriver::close)).
    pub fn close(&mut self, conn: ConnId) {
        self.core.close(conn)
    }

    /// Bytes queued and not yet written for `conn`, 0 for a stale id
    /// ([`NetDriver::outbound_bytes`](super::NetDriver::outbound_bytes)).
    pub fn outbound_bytes(&self, conn: ConnId) -> usize {
        self.core.outbound_bytes(conn)
    }

    /// Open connections, including those in a WebSocket upgrade or closing
    /// ([`NetDriver::connection_count`](super::NetDriver::connection_count)).
    pub fn connection_count(&self) -> usize {
        self.core.live()
    }

    /// This driver's counters, with the output queued now
    /// ([`NetDriver::stats`](super::NetDriver::stats)).
    pub fn stats(&self) -> NetStats {
        NetStats {
            outbound_bytes: self.core.outbound_total() as u64,
            ..self.core.stats
        }
    }

    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Closes the sockets of dead connections and frees their slots.
    fn reap(&mut self) {
        let mut dead = std::mem::take(&mut self.list_buf);
        self.core.take_dead(&mut dead);
        for &idx in &dead {
            let mc = &mut self.conns[idx as usize];
            if let Some(mut sock) = mc.sock.take() {
                let _ = self.poll.registry().deregister(&mut sock);
            }
            mc.paused = false;
            self.core.free(idx);
        }
        self.list_buf = dead;
    }

    /// Writes `idx`'s queue until empty or `WouldBlock`.
    fn flush(&mut self, idx: u32) {
        if matches!(
            self.core.phase(idx),
            Phase::Dead | Phase::Lingering | Phase::Connecting
        ) {
            return;
        }
        let Some(sock) = self.conns[idx as usize].sock.as_mut() else {
            return;
        };
        loop {
            let (cur, next) = self.core.out_slices(idx);
            let written = match (cur.is_empty(), next.is_empty()) {
                (true, true) => break,
                (false, true) => sock.write(cur),
                (true, false) => sock.write(next),
                // Both buffers in one writev.
                (false, false) => sock.write_vectored(&[IoSlice::new(cur), IoSlice::new(next)]),
            };
            match written {
                Ok(n) => self.core.out_advance_vectored(idx, n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.core.on_error(idx, e.kind());
                    return;
                }
            }
        }
        if self.core.after_flush(idx) == AfterFlush::Shutdown {
            let _ = sock.shutdown(Shutdown::Write);
        }
    }

    /// Reads `idx`'s socket until `WouldBlock`, end of stream, or the pause threshold;
    /// a short read also ends it unless `to_end` (the peer's close or an error was
    /// already signalled, and no further wakeup will come).
    fn read(&mut self, idx: u32, to_end: bool) {
        let Some(sock) = self.conns[idx as usize].sock.as_mut() else {
            return;
        };
        loop {
            if self.core.phase(idx) == Phase::Dead {
                return;
            }
            let id = self.core.id(idx);
            if self.core.input(id).len() >= self.core.pause_bytes(id, self.read_bytes) {
                let mc = &mut self.conns[idx as usize];
                if !mc.paused {
                    mc.paused = true;
                    self.paused.push(idx);
                }
                return;
            }
            match sock.read(&mut self.scratch) {
                Ok(0) => {
                    self.core.on_eof(idx);
                    return;
                }
                Ok(n) => {
                    self.core.on_recv(idx, &self.scratch[..n]);
                    if n < self.scratch.len() && !to_end {
                        // A short read drained the socket; data arriving later wakes
                        // epoll again (every arrival re-arms an edge-triggered fd), so
                        // the read that would return WouldBlock is skipped.
                        return;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.core.on_error(idx, e.kind());
                    return;
                }
            }
        }
    }

    /// Accepts until the queue is empty (epoll is edge-triggered: a connection left
    /// in the queue would wait for the next arrival) or the listener pauses.
    fn accept(&mut self, li: usize) {
        if self.core.listener_paused(li) {
            return; // Retried when the pause ends.
        }
        loop {
            let listener = &self.listeners[li].1;
            let (stream, peer) = match listener.accept() {
                Ok(s) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => match classify_accept_error(&e) {
                    AcceptFailure::Retry => continue,
                    AcceptFailure::Dropped => {
                        self.core.accept_refused(li, Refusal::Other);
                        continue;
                    }
                    AcceptFailure::Resources => {
                        let l = &self.listeners[li].1;
                        match accept_with_spare(&mut self.spare, e, || l.accept().map(|(s, _)| s)) {
                            SpareOutcome::ResetOne => {
                                self.core.accept_refused(li, Refusal::FdLimit);
                                continue;
                            }
                            SpareOutcome::Empty => return,
                            SpareOutcome::Failed(e) => {
                                self.core.accept_failed(li, &e);
                                return;
                            }
                        }
                    }
                    AcceptFailure::Other => {
                        self.core.accept_failed(li, &e);
                        return;
                    }
                },
            };
            let Some(mut stream) = restore_spare(&mut self.spare, stream) else {
                self.core.accept_refused(li, Refusal::FdLimit);
                continue;
            };
            let Some(idx) = self.core.alloc(li, peer) else {
                reset(stream); // Over the shard's connection cap.
                continue;
            };
            // TCP_NODELAY came from the listener (`prepare_listener`).
            if let Err(e) = self.poll.registry().register(
                &mut stream,
                Token(idx as usize),
                Interest::READABLE | Interest::WRITABLE,
            ) {
                self.core.on_error(idx, e.kind());
                continue;
            }
            if self.conns.len() <= idx as usize {
                self.conns.resize_with(idx as usize + 1, MioConn::default);
            }
            self.conns[idx as usize].sock = Some(stream);
        }
    }
}

impl MioDriver {
    /// Writes the output queued since the last poll (one batch), closes the sockets
    /// of dead connections (including those the flush finished), and resumes reading
    /// on connections whose reading paused, now that the handler consumed.
    fn flush_reap_resume(&mut self) {
        let mut dirty = std::mem::take(&mut self.list_buf);
        self.core.take_dirty(&mut dirty);
        for &idx in &dirty {
            self.flush(idx);
        }
        self.list_buf = dirty;
        self.reap();
        let mut dirty = std::mem::take(&mut self.list_buf);
        dirty.clear();
        dirty.append(&mut self.paused);
        for &idx in &dirty {
            let mc = &mut self.conns[idx as usize];
            if mc.paused {
                mc.paused = false;
                self.read(idx, true);
            }
        }
        self.list_buf = dirty;
    }

    /// How long the poll may wait: not at all with events undelivered, else the
    /// caller's `timeout` bounded by the core's next deadline (`None`: forever).
    fn wait_time(&self, timeout: Option<Duration>) -> Option<Duration> {
        if self.core.has_events() || timeout.is_some_and(|t| t.is_zero()) {
            return Some(Duration::ZERO);
        }
        match (timeout, self.core.next_deadline_ms()) {
            (Some(t), None) => Some(t),
            (t, Some(deadline_ms)) => {
                let d = Duration::from_millis(deadline_ms.saturating_sub(self.now_ms()));
                Some(t.map_or(d, |t| t.min(d)))
            }
            (None, None) => None,
        }
    }

    /// Handles the readiness `self.events` reported: drains the doorbell, accepts on
    /// ready listeners, flushes writable and reads readable connections.
    fn handle_ready(&mut self) {
        let mut ready = std::mem::take(&mut self.ready);
        ready.clear();
        ready.extend(self.events.iter().map(|e| Ready {
            token: e.token(),
            readable: e.is_readable() || e.is_read_closed() || e.is_error(),
            closed: e.is_read_closed() || e.is_error(),
            writable: e.is_writable(),
        }));
        for &Ready {
            token,
            readable,
            closed,
            writable,
        } in &ready
        {
            match token {
                DOORBELL => {
                    self.doorbell.drain();
                }
                Token(t) if t > LISTENER_BASE - self.listeners.len() => {
                    self.accept(LISTENER_BASE - t);
                }
                Token(t) => {
                    let idx = t as u32;
                    if self.core.phase(idx) == Phase::Connecting {
                        self.finish_connect(idx, closed);
                        if self.core.phase(idx) != Phase::Open {
                            continue;
                        }
                    }
                    if writable {
                        self.flush(idx);
                    }
                    if readable && !self.conns[t].paused {
                        self.read(idx, closed);
                    }
                }
            }
        }
        self.ready = ready;
    }

    /// Listeners whose pause ended: accepts what queued meanwhile (no new arrival
    /// would signal it).
    fn accept_resumed(&mut self) {
        let mut resumed = std::mem::take(&mut self.resumed);
        self.core.take_resumed(&mut resumed);
        for &li in &resumed {
            self.accept(li);
        }
        self.resumed = resumed;
    }
}

impl Driver for MioDriver {
    type Event = NetEvent;

    fn poll(&mut self, timeout: Option<Duration>, out: &mut Vec<NetEvent>) -> io::Result<()> {
        self.poll_at(timeout, None, out)
    }

    fn poll_now(&mut self, now: Instant, out: &mut Vec<NetEvent>) -> io::Result<()> {
        self.poll_at(Some(Duration::ZERO), Some(now), out)
    }
}

impl MioDriver {
    /// [`Driver::poll`]; `now`: the caller's clock reading for a poll that does not
    /// block (else the clock is read once, after the wait).
    fn poll_at(
        &mut self,
        timeout: Option<Duration>,
        now: Option<Instant>,
        out: &mut Vec<NetEvent>,
    ) -> io::Result<()> {
        self.flush_reap_resume();
        let wait = self.wait_time(timeout);
        match self.poll.poll(&mut self.events, wait) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
        // Deadlines of what arrived are measured from after the wait.
        let now_ms = match now {
            Some(t) if wait.is_some_and(|w| w.is_zero()) => {
                t.saturating_duration_since(self.start).as_millis() as u64
            }
            _ => self.now_ms(),
        };
        self.core.set_now(now_ms);
        self.handle_ready();
        self.core.advance(now_ms);
        self.accept_resumed();
        self.core.take_events(out);
        Ok(())
    }
}
