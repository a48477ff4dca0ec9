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
use shard::runtime::EventFd;

use super::core::{classify_accept_error, AcceptFailure, AfterFlush, Core, Phase, Refusal};
use super::timerfd::TimerFd;
use super::{
    accept_with_spare, connect_outcome, prepare_listener, reset, restore_spare, ConnId, Listener,
    NetConfig, NetEvent, Spare, SpareOutcome, Transport,
};

const DOORBELL: Token = Token(usize::MAX);
/// The timer of [`MioIo::poll_until`] (below the listeners' tokens, above every slot
/// index).
const TIMER: Token = Token(LISTENER_BASE / 2);
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
pub struct MioIo {
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
    /// The timer of [`MioIo::poll_until`], made by its first call (never by `poll`),
    /// and the deadline it is armed for (`None`: fired, or never armed).
    timer: Option<TimerFd>,
    timer_deadline: Option<Instant>,
}

impl MioIo {
    /// The mio side of a driver accepting on `listeners` and waking on `doorbell`,
    /// with the connection table it drives (no read slack: reads stop at the pause
    /// threshold, one chunk below the limit).
    pub fn new(
        config: &NetConfig,
        doorbell: Arc<EventFd>,
        listeners: Vec<Listener>,
    ) -> io::Result<(Core, Self)> {
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
        let io = MioIo {
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
            timer: None,
            timer_deadline: None,
        };
        Ok((core, io))
    }

    /// See [`NetDriver::connect`](super::NetDriver::connect): a non-blocking connect,
    /// registered for both readiness kinds; its first event tells the outcome.
    pub fn connect(
        &mut self,
        core: &mut Core,
        addr: SocketAddr,
        from: Option<IpAddr>,
    ) -> io::Result<ConnId> {
        let (idx, id, stream) = super::begin_dial(core, addr, from)?;
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
            core.on_error(idx, e.kind());
            return Ok(id);
        }
        self.conns[idx as usize].sock = Some(stream);
        Ok(id)
    }

    /// The first readiness of a dialing socket: connected, failed, or (a spurious
    /// wakeup without an error) still connecting.
    fn finish_connect(&mut self, core: &mut Core, idx: u32, hangup: bool) {
        let Some(sock) = self.conns[idx as usize].sock.as_ref() else {
            return;
        };
        match connect_outcome(sock, hangup) {
            Ok(Some(peer)) => core.on_connected(idx, peer),
            Ok(None) => {}
            Err(e) => core.on_error(idx, e.kind()),
        }
    }

    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Closes the sockets of dead connections and frees their slots.
    fn reap(&mut self, core: &mut Core) {
        let mut dead = std::mem::take(&mut self.list_buf);
        core.take_dead(&mut dead);
        for &idx in &dead {
            let mc = &mut self.conns[idx as usize];
            if let Some(mut sock) = mc.sock.take() {
                let _ = self.poll.registry().deregister(&mut sock);
            }
            mc.paused = false;
            core.free(idx);
        }
        self.list_buf = dead;
    }

    /// Writes `idx`'s queue until empty or `WouldBlock`.
    fn flush(&mut self, core: &mut Core, idx: u32) {
        if matches!(
            core.phase(idx),
            Phase::Dead | Phase::Lingering | Phase::Connecting
        ) {
            return;
        }
        let Some(sock) = self.conns[idx as usize].sock.as_mut() else {
            return;
        };
        loop {
            let (cur, next) = core.out_slices(idx);
            let written = match (cur.is_empty(), next.is_empty()) {
                (true, true) => break,
                (false, true) => sock.write(cur),
                (true, false) => sock.write(next),
                // Both buffers in one writev.
                (false, false) => sock.write_vectored(&[IoSlice::new(cur), IoSlice::new(next)]),
            };
            match written {
                Ok(n) => core.out_advance_vectored(idx, n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    core.on_error(idx, e.kind());
                    return;
                }
            }
        }
        if core.after_flush(idx) == AfterFlush::Shutdown {
            let _ = sock.shutdown(Shutdown::Write);
        }
    }

    /// Reads `idx`'s socket until `WouldBlock`, end of stream, or the pause threshold;
    /// a short read also ends it unless `to_end` (the peer's close or an error was
    /// already signalled, and no further wakeup will come).
    fn read(&mut self, core: &mut Core, idx: u32, to_end: bool) {
        let Some(sock) = self.conns[idx as usize].sock.as_mut() else {
            return;
        };
        loop {
            if core.phase(idx) == Phase::Dead {
                return;
            }
            let id = core.id(idx);
            if core.input(id).len() >= core.pause_bytes(id, self.read_bytes) {
                let mc = &mut self.conns[idx as usize];
                if !mc.paused {
                    mc.paused = true;
                    self.paused.push(idx);
                }
                return;
            }
            match sock.read(&mut self.scratch) {
                Ok(0) => {
                    core.on_eof(idx);
                    return;
                }
                Ok(n) => {
                    core.on_recv(idx, &self.scratch[..n]);
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
                    core.on_error(idx, e.kind());
                    return;
                }
            }
        }
    }

    /// Accepts until the queue is empty (epoll is edge-triggered: a connection left
    /// in the queue would wait for the next arrival) or the listener pauses.
    fn accept(&mut self, core: &mut Core, li: usize) {
        if core.listener_paused(li) {
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
                        core.accept_refused(li, Refusal::Other);
                        continue;
                    }
                    AcceptFailure::Resources => {
                        let l = &self.listeners[li].1;
                        match accept_with_spare(&mut self.spare, e, || l.accept().map(|(s, _)| s)) {
                            SpareOutcome::ResetOne => {
                                core.accept_refused(li, Refusal::FdLimit);
                                continue;
                            }
                            SpareOutcome::Empty => return,
                            SpareOutcome::Failed(e) => {
                                core.accept_failed(li, &e);
                                return;
                            }
                        }
                    }
                    AcceptFailure::Other => {
                        core.accept_failed(li, &e);
                        return;
                    }
                },
            };
            let Some(mut stream) = restore_spare(&mut self.spare, stream) else {
                core.accept_refused(li, Refusal::FdLimit);
                continue;
            };
            let Some(idx) = core.alloc(li, peer) else {
                reset(stream); // Over the shard's connection cap.
                continue;
            };
            // TCP_NODELAY came from the listener (`prepare_listener`).
            if let Err(e) = self.poll.registry().register(
                &mut stream,
                Token(idx as usize),
                Interest::READABLE | Interest::WRITABLE,
            ) {
                core.on_error(idx, e.kind());
                continue;
            }
            if self.conns.len() <= idx as usize {
                self.conns.resize_with(idx as usize + 1, MioConn::default);
            }
            self.conns[idx as usize].sock = Some(stream);
        }
    }
}

impl MioIo {
    /// Writes the output queued since the last poll (one batch), closes the sockets
    /// of dead connections (including those the flush finished), and resumes reading
    /// on connections whose reading paused, now that the handler consumed.
    fn flush_reap_resume(&mut self, core: &mut Core) {
        let mut dirty = std::mem::take(&mut self.list_buf);
        core.take_dirty(&mut dirty);
        for &idx in &dirty {
            self.flush(core, idx);
        }
        self.list_buf = dirty;
        self.reap(core);
        let mut dirty = std::mem::take(&mut self.list_buf);
        dirty.clear();
        dirty.append(&mut self.paused);
        for &idx in &dirty {
            let mc = &mut self.conns[idx as usize];
            if mc.paused {
                mc.paused = false;
                self.read(core, idx, true);
            }
        }
        self.list_buf = dirty;
    }

    /// How long the poll may wait: not at all with events undelivered, else the
    /// caller's `timeout` bounded by the core's next deadline (`None`: forever).
    fn wait_time(&self, core: &Core, timeout: Option<Duration>) -> Option<Duration> {
        if core.has_events() || timeout.is_some_and(|t| t.is_zero()) {
            return Some(Duration::ZERO);
        }
        match (timeout, core.next_deadline_ms()) {
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
    fn handle_ready(&mut self, core: &mut Core) {
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
                TIMER => {
                    if let Some(t) = &self.timer {
                        t.clear();
                    }
                    self.timer_deadline = None;
                }
                Token(t) if t > LISTENER_BASE - self.listeners.len() => {
                    self.accept(core, LISTENER_BASE - t);
                }
                Token(t) => {
                    let idx = t as u32;
                    if core.phase(idx) == Phase::Connecting {
                        self.finish_connect(core, idx, closed);
                        if core.phase(idx) != Phase::Open {
                            continue;
                        }
                    }
                    if writable {
                        self.flush(core, idx);
                    }
                    if readable && !self.conns[t].paused {
                        self.read(core, idx, closed);
                    }
                }
            }
        }
        self.ready = ready;
    }

    /// Listeners whose pause ended: accepts what queued meanwhile (no new arrival
    /// would signal it).
    fn accept_resumed(&mut self, core: &mut Core) {
        let mut resumed = std::mem::take(&mut self.resumed);
        core.take_resumed(&mut resumed);
        for &li in &resumed {
            self.accept(core, li);
        }
        self.resumed = resumed;
    }
}

impl MioIo {
    /// One poll of [`NetDriver`](super::NetDriver) (`Driver::poll`) over `core`;
    /// `now`: the caller's clock reading for a poll that does not
    /// block (else the clock is read once, after the wait).
    pub fn poll_at(
        &mut self,
        core: &mut Core,
        timeout: Option<Duration>,
        now: Option<Instant>,
        out: &mut Vec<NetEvent>,
    ) -> io::Result<()> {
        self.flush_reap_resume(core);
        let wait = self.wait_time(core, timeout);
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
        core.set_now(now_ms);
        self.handle_ready(core);
        core.advance(now_ms);
        self.accept_resumed(core);
        core.take_events(out);
        Ok(())
    }
}

impl MioIo {
    /// [`NetDriver::poll_until`](super::NetDriver::poll_until): one poll whose wait
    /// ends at `deadline` to the microsecond. epoll's timeout is whole milliseconds
    /// (mio rounds up), so a timerfd registered in the poll (made by the first call)
    /// is armed for the deadline, once per distinct deadline: a wait that ended early
    /// leaves it armed for the next call with the same deadline.
    pub fn poll_until(
        &mut self,
        core: &mut Core,
        deadline: Instant,
        out: &mut Vec<NetEvent>,
    ) -> io::Result<()> {
        let wait = deadline.saturating_duration_since(Instant::now());
        if !wait.is_zero() && self.timer_deadline != Some(deadline) {
            let timer = match self.timer.take() {
                Some(t) => t,
                None => {
                    let t = TimerFd::new()?;
                    let fd = t.raw_fd();
                    (self.poll.registry()).register(
                        &mut SourceFd(&fd),
                        TIMER,
                        Interest::READABLE,
                    )?;
                    t
                }
            };
            let armed = timer.arm(wait);
            self.timer = Some(timer);
            armed?;
            self.timer_deadline = Some(deadline);
        }
        self.poll_at(core, Some(wait), None, out)
    }
}
