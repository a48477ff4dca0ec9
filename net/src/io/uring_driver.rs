//! The io_uring backend. One ring per shard (`SINGLE_ISSUER | COOP_TASKRUN |
//! DEFER_TASKRUN | TASKRUN_FLAG`, so it must be created and used on the shard thread):
//! a few single-shot accepts in flight per listener, multishot recv per connection into a ring of
//! provided buffers (copied into the connection's input and returned at once, so an
//! idle connection holds no receive buffer), one outstanding `send` per connection
//! from its queue, the doorbell eventfd through a multishot `PollAdd`, and the park
//! timeout as the timespec of the one `io_uring_enter` that submits and waits.
//! Everything queued during a loop turn is submitted by the next poll's single enter.
//! A dial is a non-blocking `connect` made at once plus a single-shot
//! `PollAdd(POLLOUT)` on the socket (rather than the Connect opcode, whose socket
//! address would have to live in the slot until its completion); its completion is
//! checked with `connect_outcome` (`SO_ERROR`, `peer_addr`), re-armed after a
//! spurious wakeup, and followed by the connection's multishot recv.

use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};

use std::sync::Arc;
use std::time::{Duration, Instant};

use io_uring::types::{Fd, SubmitArgs, Timespec};
use io_uring::{cqueue, opcode, squeue, IoUring};
use shard::runtime::EventFd;

use super::bufring::BufRing;
use super::core::{classify_accept_error, AcceptFailure, AfterFlush, Core, Phase, Refusal};
use super::{
    accept_with_spare, connect_outcome, prepare_listener, reset, restore_spare, ConnId, Listener,
    NetConfig, NetEvent, Spare, SpareOutcome, Transport,
};

/// Buffer group id of the provided receive buffers.
const BGID: u16 = 0;

// user_data: kind (8 bits) | slot index (24 bits) | generation (32 bits).
const OP_ACCEPT: u64 = 1;
const OP_RECV: u64 = 2;
const OP_SEND: u64 = 3;
const OP_DOORBELL: u64 = 4;
const OP_CANCEL: u64 = 5;
const OP_CANCEL_ALL: u64 = 6;
/// The writability poll of a dial whose connect is in progress.
const OP_CONNECT: u64 = 7;

fn user_data(op: u64, idx: u32, generation: u32) -> u64 {
    debug_assert!(idx < (1 << 24));
    (op << 56) | (u64::from(idx) << 32) | u64::from(generation)
}

fn split_user_data(ud: u64) -> (u64, u32, u32) {
    (ud >> 56, ((ud >> 32) & 0xFF_FFFF) as u32, ud as u32)
}

/// Where the kernel writes an accepted connection's peer address: one per accept in
/// flight, so the address comes with the accept (no `getpeername` per connection).
#[derive(Clone, Copy)]
struct AcceptAddr {
    storage: libc::sockaddr_storage,
    len: libc::socklen_t,
}

impl AcceptAddr {
    fn empty() -> Self {
        AcceptAddr {
            // SAFETY: `sockaddr_storage` is plain old data; all zeroes is a valid value.
            storage: unsafe { std::mem::zeroed() },
            len: std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t,
        }
    }

    /// The address the kernel wrote, if it is an IP one.
    fn peer(&self) -> Option<SocketAddr> {
        let len = self.len as usize;
        let at = (&raw const self.storage).cast::<u8>();
        match i32::from(self.storage.ss_family) {
            libc::AF_INET if len >= std::mem::size_of::<libc::sockaddr_in>() => {
                // SAFETY: the kernel wrote a `sockaddr_in` (family and length checked)
                // at the start of the storage, which is large and aligned enough.
                let a = unsafe { at.cast::<libc::sockaddr_in>().read() };
                let ip = std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
                Some(SocketAddr::from((ip, u16::from_be(a.sin_port))))
            }
            libc::AF_INET6 if len >= std::mem::size_of::<libc::sockaddr_in6>() => {
                // SAFETY: as above, a `sockaddr_in6`.
                let a = unsafe { at.cast::<libc::sockaddr_in6>().read() };
                let ip = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
                Some(SocketAddr::V6(std::net::SocketAddrV6::new(
                    ip,
                    u16::from_be(a.sin6_port),
                    a.sin6_flowinfo,
                    a.sin6_scope_id,
                )))
            }
            _ => None,
        }
    }
}

#[derive(Default)]
struct UConn {
    fd: Option<OwnedFd>,
    recv_armed: bool,
    send_inflight: bool,
    /// A dial's `PollAdd(POLLOUT)` is in flight.
    connect_armed: bool,
    cancels_inflight: u8,
    /// Reading stopped (recv cancelled) until the handler consumes input.
    paused: bool,
    /// Dead and torn down: freed once no IO references it.
    reaped: bool,
}

impl UConn {
    fn busy(&self) -> bool {
        self.recv_armed || self.send_inflight || self.connect_armed || self.cancels_inflight > 0
    }
}

/// The io_uring backend of one shard. See the [module docs](super) for the contract.
pub struct UringIo {
    // Declared before `bufs`: the ring is destroyed before the buffers are unmapped.
    ring: IoUring,
    bufs: BufRing,
    /// Leaks the buffers (receive and output) on drop if cancelled IO did not finish
    /// in time.
    bufs_unsafe_to_free: bool,
    /// [`UringIo::quiesce`] ran.
    quiesced: bool,
    doorbell: Arc<EventFd>,
    doorbell_armed: bool,
    listeners: Vec<(Transport, TcpListener)>,
    /// Single-shot accepts in flight per listener (at most
    /// `uring_accepts_inflight`): each completion carries a descriptor the kernel
    /// already installed, so they bound how far past its cap a shard's descriptors
    /// can go before it resets the extra ones.
    accepts_inflight: Vec<u32>,
    /// Per listener, one address slot per accept in flight (`uring_accepts_inflight`),
    /// and the free ones. Boxed: the kernel holds pointers into them until the accept
    /// completes (leaked on drop if IO did not finish, as the buffers are).
    accept_addrs: Vec<Box<[AcceptAddr]>>,
    accept_free: Vec<Vec<u32>>,
    conns: Vec<UConn>,
    /// SQEs pushed whose final CQE has not arrived.
    inflight: usize,
    /// Connections whose recv must be re-armed (ran out of buffers, or resumed).
    rearm: Vec<u32>,
    paused: Vec<u32>,
    list_buf: Vec<u32>,
    cqes: Vec<(u64, i32, u32)>,
    start: Instant,
    /// One receive buffer: reading pauses when a connection's unconsumed input is
    /// within it of the connection's limit (`Core::pause_bytes`).
    read_bytes: usize,
    /// Closed to accept (and reset) one connection when out of descriptors.
    spare: Spare,
    /// Listeners whose pause ended (reused).
    resumed: Vec<usize>,
}

impl UringIo {
    /// The io_uring side of a driver accepting on `listeners` and waking on
    /// `doorbell`, with the connection table it drives. Fails if the kernel refuses
    /// the ring or the provided buffers.
    pub fn new(
        config: &NetConfig,
        doorbell: Arc<EventFd>,
        listeners: Vec<Listener>,
    ) -> io::Result<(Core, Self)> {
        config.validate()?;
        let ring: IoUring = IoUring::builder()
            .setup_single_issuer()
            .setup_coop_taskrun()
            .setup_taskrun_flag()
            .setup_defer_taskrun()
            .setup_cqsize(config.uring_entries.saturating_mul(4))
            .build(config.uring_entries)?;
        let bufs = BufRing::new(&ring, config.uring_buf_count, config.uring_buf_bytes, BGID)?;
        for l in &listeners {
            prepare_listener(&l.socket, config.listen_backlog)?;
        }
        let n = listeners.len();
        // Completions already posted when reading pauses still deliver: at most one
        // batch, which cannot hold more than every provided buffer.
        let mut core = Core::new(
            config,
            usize::from(config.uring_buf_count) * config.uring_buf_bytes as usize,
        );
        let listeners: Vec<(Transport, TcpListener)> = listeners
            .into_iter()
            .map(|Listener { kind, socket, tls }| {
                core.add_listener_tls(kind, tls);
                (kind, socket)
            })
            .collect();
        let mut d = UringIo {
            ring,
            bufs,
            bufs_unsafe_to_free: false,
            quiesced: false,
            doorbell,
            doorbell_armed: false,
            listeners,
            accepts_inflight: vec![0; n],
            accept_addrs: (0..n)
                .map(|_| vec![AcceptAddr::empty(); config.uring_accepts_inflight as usize].into())
                .collect(),
            accept_free: (0..n)
                .map(|_| (0..config.uring_accepts_inflight).rev().collect())
                .collect(),
            conns: Vec::new(),
            inflight: 0,
            rearm: Vec::new(),
            paused: Vec::new(),
            list_buf: Vec::new(),
            cqes: Vec::with_capacity(config.uring_entries as usize * 4),
            start: Instant::now(),
            read_bytes: config.uring_buf_bytes as usize,
            spare: Spare::open(),
            resumed: Vec::new(),
        };
        d.arm_static(&mut core)?;
        d.ring.submit()?;
        Ok((core, d))
    }

    /// See [`NetDriver::connect`](super::NetDriver::connect): a non-blocking connect
    /// now, its writability poll submitted by the next poll's enter.
    pub fn connect(
        &mut self,
        core: &mut Core,
        addr: SocketAddr,
        from: Option<IpAddr>,
    ) -> io::Result<ConnId> {
        let (idx, id, stream) = super::begin_dial(core, addr, from)?;
        if self.conns.len() <= idx as usize {
            self.conns.resize_with(idx as usize + 1, UConn::default);
        }
        let Some(stream) = stream else {
            return Ok(id);
        };
        self.conns[idx as usize].fd = Some(OwnedFd::from(stream));
        if let Err(e) = self.arm_connect(core, idx) {
            core.on_error(idx, e.kind());
        }
        Ok(id)
    }

    /// Arms the single-shot writability poll of dialing connection `idx`.
    fn arm_connect(&mut self, core: &mut Core, idx: u32) -> io::Result<()> {
        let Some(fd) = self.conns[idx as usize].fd.as_ref().map(|f| f.as_raw_fd()) else {
            return Ok(());
        };
        let generation = core.id(idx).generation;
        let e = opcode::PollAdd::new(Fd(fd), libc::POLLOUT as u32)
            .build()
            .user_data(user_data(OP_CONNECT, idx, generation));
        // SAFETY: a poll references no memory.
        unsafe { self.push(&e)? };
        self.conns[idx as usize].connect_armed = true;
        Ok(())
    }

    /// The writability poll of dial `idx` completed with `res` (the poll mask, or
    /// an error): connected (recv armed), failed, or re-armed after a spurious wakeup.
    fn on_connect_poll(&mut self, core: &mut Core, idx: u32, res: i32) -> io::Result<()> {
        self.conns[idx as usize].connect_armed = false;
        let uc = &self.conns[idx as usize];
        if uc.reaped || res == -libc::ECANCELED || core.phase(idx) != Phase::Connecting {
            self.maybe_free(core, idx);
            return Ok(());
        }
        let outcome = match (&uc.fd, res) {
            (_, r) if r < 0 => Err(io::Error::from_raw_os_error(-r)),
            (Some(fd), mask) => {
                let hangup = mask & i32::from(libc::POLLERR | libc::POLLHUP) != 0;
                connect_outcome(fd, hangup)
            }
            (None, _) => Err(io::Error::from(io::ErrorKind::NotConnected)),
        };
        match outcome {
            Ok(Some(peer)) => {
                core.on_connected(idx, peer);
                self.arm_recv(core, idx)?;
            }
            Ok(None) => self.arm_connect(core, idx)?,
            Err(e) => core.on_error(idx, e.kind()),
        }
        self.maybe_free(core, idx);
        Ok(())
    }

    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Pushes one SQE, submitting first if the queue is full.
    ///
    /// # Safety
    /// Every buffer the entry points to must stay valid until its final completion.
    unsafe fn push(&mut self, entry: &squeue::Entry) -> io::Result<()> {
        loop {
            // SAFETY: forwarded from the caller.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                self.inflight += 1;
                return Ok(());
            }
            self.ring.submit()?;
        }
    }

    /// (Re-)arms the doorbell poll and the listeners' accepts.
    fn arm_static(&mut self, core: &mut Core) -> io::Result<()> {
        if !self.doorbell_armed {
            let e = opcode::PollAdd::new(Fd(self.doorbell.as_raw_fd()), libc::POLLIN as u32)
                .multi(true)
                .build()
                .user_data(user_data(OP_DOORBELL, 0, 0));
            // SAFETY: a poll references no memory.
            unsafe { self.push(&e)? };
            self.doorbell_armed = true;
        }
        for i in 0..self.listeners.len() {
            // A paused listener is re-armed when its pause ends.
            if core.listener_paused(i) {
                continue;
            }
            let fd = self.listeners[i].1.as_raw_fd();
            while self.accepts_inflight[i] < core.cfg.uring_accepts_inflight {
                // Single-shot: each accept is prepared with the current descriptor
                // limit, and the accepted descriptors not yet handled stay bounded
                // (a multishot accept would fill the descriptor table in a flood
                // before the shard resets what is over its cap).
                let slot = self.accept_free[i]
                    .pop()
                    .expect("one address slot per accept in flight");
                let a = &mut self.accept_addrs[i][slot as usize];
                *a = AcceptAddr::empty();
                let e = opcode::Accept::new(
                    Fd(fd),
                    (&raw mut a.storage).cast::<libc::sockaddr>(),
                    &raw mut a.len,
                )
                .flags(libc::SOCK_CLOEXEC)
                .build()
                .user_data(user_data(OP_ACCEPT, i as u32, slot));
                // SAFETY: the address slot is boxed (it does not move), not reused
                // until this accept's completion returns it to `accept_free`, and
                // outlives the ring (leaked on drop if IO did not finish).
                unsafe { self.push(&e)? };
                self.accepts_inflight[i] += 1;
            }
        }
        Ok(())
    }

    fn arm_recv(&mut self, core: &mut Core, idx: u32) -> io::Result<()> {
        let uc = &self.conns[idx as usize];
        if uc.recv_armed || uc.paused || uc.reaped {
            return Ok(());
        }
        let Some(fd) = uc.fd.as_ref().map(|f| f.as_raw_fd()) else {
            return Ok(());
        };
        let generation = core.id(idx).generation;
        let e = opcode::RecvMulti::new(Fd(fd), BGID)
            .build()
            .user_data(user_data(OP_RECV, idx, generation));
        // SAFETY: the recv writes only into provided buffers, which live as long as the
        // ring.
        unsafe { self.push(&e)? };
        self.conns[idx as usize].recv_armed = true;
        Ok(())
    }

    fn cancel(&mut self, core: &mut Core, idx: u32, op: u64) -> io::Result<()> {
        let generation = core.id(idx).generation;
        let e = opcode::AsyncCancel::new(user_data(op, idx, generation))
            .build()
            .user_data(user_data(OP_CANCEL, idx, generation));
        // SAFETY: a cancel references no memory.
        unsafe { self.push(&e)? };
        self.conns[idx as usize].cancels_inflight += 1;
        Ok(())
    }

    /// Starts the next send of `idx`'s queue if none is in flight; after the queue
    /// drained, moves a closing connection on.
    fn flush(&mut self, core: &mut Core, idx: u32) -> io::Result<()> {
        let uc = &self.conns[idx as usize];
        if uc.send_inflight || uc.reaped {
            return Ok(());
        }
        let Some(fd) = uc.fd.as_ref().map(|f| f.as_raw_fd()) else {
            return Ok(());
        };
        if matches!(
            core.phase(idx),
            Phase::Dead | Phase::Lingering | Phase::Connecting
        ) {
            return Ok(());
        }
        let generation = core.id(idx).generation;
        let chunk = core.out_chunk(idx);
        if chunk.is_empty() {
            if core.after_flush(idx) == AfterFlush::Shutdown {
                // SAFETY: shutdown on a socket we own; errors are irrelevant here.
                unsafe { libc::shutdown(fd, libc::SHUT_WR) };
            }
            return Ok(());
        }
        let len = chunk.len().min(u32::MAX as usize) as u32;
        let e = opcode::Send::new(Fd(fd), chunk.as_ptr(), len)
            .flags(libc::MSG_NOSIGNAL)
            .build()
            .user_data(user_data(OP_SEND, idx, generation));
        // SAFETY: the chunk is the connection's current output buffer, which the core
        // neither moves nor frees until `out_advance`/`free`: we call `out_advance`
        // only on this send's completion and `free` only when no send is in flight.
        unsafe { self.push(&e)? };
        self.conns[idx as usize].send_inflight = true;
        Ok(())
    }

    /// Tears down connections that died: cancels their IO, closes the socket; the
    /// slot is freed when the last IO completed.
    fn reap(&mut self, core: &mut Core) -> io::Result<()> {
        let mut dead = std::mem::take(&mut self.list_buf);
        core.take_dead(&mut dead);
        for &idx in &dead {
            let uc = &mut self.conns[idx as usize];
            uc.reaped = true;
            let (recv, send, connect) = (uc.recv_armed, uc.send_inflight, uc.connect_armed);
            if recv {
                self.cancel(core, idx, OP_RECV)?;
            }
            if send {
                self.cancel(core, idx, OP_SEND)?;
            }
            if connect {
                self.cancel(core, idx, OP_CONNECT)?;
            }
            // In-flight requests hold their own file reference; closing the number now
            // is safe and lets the cancels finish them.
            self.conns[idx as usize].fd = None;
            self.maybe_free(core, idx);
        }
        self.list_buf = dead;
        Ok(())
    }

    fn maybe_free(&mut self, core: &mut Core, idx: u32) {
        let uc = &mut self.conns[idx as usize];
        if uc.reaped && !uc.busy() {
            *uc = UConn::default();
            core.free(idx);
        }
    }

    /// `peer`: the address the accept wrote (unspecified when the kernel gave none).
    fn on_accept(
        &mut self,
        core: &mut Core,
        li: usize,
        res: i32,
        peer: Option<SocketAddr>,
    ) -> io::Result<()> {
        if res == -libc::ECANCELED {
            return Ok(());
        }
        if res < 0 {
            let err = io::Error::from_raw_os_error(-res);
            match classify_accept_error(&err) {
                // Re-armed by the next poll.
                AcceptFailure::Retry => {}
                AcceptFailure::Dropped => core.accept_refused(li, Refusal::Other),
                AcceptFailure::Resources => loop {
                    // Out of descriptors: reset what queued, one spare descriptor at a
                    // time, until the queue is empty or even that fails.
                    let first = io::Error::from_raw_os_error(-res);
                    let l = &self.listeners[li].1;
                    match accept_with_spare(&mut self.spare, first, || l.accept().map(|(s, _)| s)) {
                        SpareOutcome::ResetOne => core.accept_refused(li, Refusal::FdLimit),
                        SpareOutcome::Empty => break,
                        SpareOutcome::Failed(e) => {
                            core.accept_failed(li, &e);
                            break;
                        }
                    }
                },
                AcceptFailure::Other => core.accept_failed(li, &err),
            }
            return Ok(());
        }
        // SAFETY: a successful accept returns a new descriptor that we now own.
        let stream = unsafe { TcpStream::from_raw_fd(res) };
        let Some(stream) = restore_spare(&mut self.spare, stream) else {
            core.accept_refused(li, Refusal::FdLimit);
            return Ok(());
        };
        let peer = peer.unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
        let Some(idx) = core.alloc(li, peer) else {
            reset(stream); // Over the shard's connection cap.
            return Ok(());
        };
        // TCP_NODELAY came from the listener (`prepare_listener`).
        let raw: RawFd = stream.into_raw_fd();
        if self.conns.len() <= idx as usize {
            self.conns.resize_with(idx as usize + 1, UConn::default);
        }
        // SAFETY: `raw` came from `into_raw_fd` just above; we own it.
        self.conns[idx as usize].fd = Some(unsafe { OwnedFd::from_raw_fd(raw) });
        self.arm_recv(core, idx)
    }

    fn on_recv(&mut self, core: &mut Core, idx: u32, res: i32, flags: u32) -> io::Result<()> {
        let more = cqueue::more(flags);
        if !more {
            self.conns[idx as usize].recv_armed = false;
        }
        if res > 0 {
            let Some(bid) = cqueue::buffer_select(flags) else {
                return Err(io::Error::other("recv completion without a buffer"));
            };
            if !self.conns[idx as usize].reaped {
                core.on_recv(idx, self.bufs.data(bid, res as usize));
            }
            self.bufs.push(bid);
            let uc = &self.conns[idx as usize];
            if uc.reaped || core.phase(idx) == Phase::Dead {
                // Nothing to do: reap cancels the recv.
            } else if core.input(core.id(idx)).len()
                >= core.pause_bytes(core.id(idx), self.read_bytes)
            {
                if !uc.paused {
                    self.conns[idx as usize].paused = true;
                    self.paused.push(idx);
                    if more {
                        self.cancel(core, idx, OP_RECV)?;
                    }
                }
            } else if !more {
                self.rearm.push(idx);
            }
        } else if res == 0 {
            if !self.conns[idx as usize].reaped {
                core.on_eof(idx);
            }
        } else if res == -libc::ENOBUFS {
            // Out of provided buffers: re-armed after this batch returned some.
            self.rearm.push(idx);
        } else if res != -libc::ECANCELED && !self.conns[idx as usize].reaped {
            core.on_error(idx, io::Error::from_raw_os_error(-res).kind());
        }
        self.maybe_free(core, idx);
        Ok(())
    }

    fn on_send(&mut self, core: &mut Core, idx: u32, res: i32) -> io::Result<()> {
        self.conns[idx as usize].send_inflight = false;
        if res >= 0 {
            core.out_advance(idx, res as usize);
            if !self.conns[idx as usize].reaped {
                self.flush(core, idx)?;
            }
        } else if !self.conns[idx as usize].reaped && res != -libc::ECANCELED {
            core.on_error(idx, io::Error::from_raw_os_error(-res).kind());
        }
        self.maybe_free(core, idx);
        Ok(())
    }

    /// Handles every completion in the queue.
    fn reap_completions(&mut self, core: &mut Core) -> io::Result<()> {
        let mut cqes = std::mem::take(&mut self.cqes);
        loop {
            cqes.clear();
            cqes.extend(
                self.ring
                    .completion()
                    .map(|c| (c.user_data(), c.result(), c.flags())),
            );
            if cqes.is_empty() {
                break;
            }
            for &(ud, res, flags) in &cqes {
                if !cqueue::more(flags) {
                    self.inflight -= 1;
                }
                let (op, idx, generation) = split_user_data(ud);
                match op {
                    OP_DOORBELL => {
                        self.doorbell.drain();
                        if !cqueue::more(flags) {
                            self.doorbell_armed = false;
                        }
                    }
                    OP_ACCEPT => {
                        let li = idx as usize;
                        self.accepts_inflight[li] -= 1;
                        // The address is only written by an accept that succeeded.
                        let slot = &self.accept_addrs[li][generation as usize];
                        let peer = if res >= 0 { slot.peer() } else { None };
                        self.accept_free[li].push(generation);
                        self.on_accept(core, li, res, peer)?;
                    }
                    OP_RECV => self.on_recv(core, idx, res, flags)?,
                    OP_SEND => self.on_send(core, idx, res)?,
                    OP_CONNECT => self.on_connect_poll(core, idx, res)?,
                    OP_CANCEL => {
                        self.conns[idx as usize].cancels_inflight -= 1;
                        self.maybe_free(core, idx);
                    }
                    _ => {}
                }
            }
            self.bufs.publish();
            let mut rearm = std::mem::take(&mut self.rearm);
            for &idx in &rearm {
                if core.phase(idx) != Phase::Dead {
                    self.arm_recv(core, idx)?;
                }
            }
            rearm.clear();
            self.rearm = rearm;
        }
        self.cqes = cqes;
        Ok(())
    }

    /// Submits and reaps; `now_ms` is the time to stamp what arrived with (`None`:
    /// read the clock after the wait). Returns the time used.
    fn submit_and_collect(
        &mut self,
        core: &mut Core,
        wait: Option<Duration>,
        now_ms: Option<u64>,
    ) -> io::Result<u64> {
        let result = match wait {
            Some(d) if d.is_zero() => {
                let mut sq = self.ring.submission();
                let idle = sq.is_empty() && !sq.taskrun() && !sq.cq_overflow();
                sq.sync();
                drop(sq);
                if idle {
                    Ok(0)
                } else {
                    // With DEFER_TASKRUN completions are posted only by an enter that
                    // asks for events; submit_and_wait sets GETEVENTS when task work is
                    // flagged pending.
                    self.ring.submitter().submit_and_wait(0)
                }
            }
            Some(d) => {
                let ts = Timespec::new().sec(d.as_secs()).nsec(d.subsec_nanos());
                let args = SubmitArgs::new().timespec(&ts);
                self.ring.submitter().submit_with_args(1, &args)
            }
            None => self.ring.submitter().submit_and_wait(1),
        };
        match result {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY)
                ) => {}
            Err(e) => return Err(e),
        }
        // Deadlines of what arrived are measured from after the wait.
        let now_ms = now_ms.unwrap_or_else(|| self.now_ms());
        core.set_now(now_ms);
        self.reap_completions(core)?;
        Ok(now_ms)
    }
}

impl UringIo {
    /// One poll of [`NetDriver`](super::NetDriver) (`Driver::poll`) over `core`;
    /// `now`: the caller's clock reading (else the clock is read).
    pub fn poll_at(
        &mut self,
        core: &mut Core,
        timeout: Option<Duration>,
        now: Option<Instant>,
        out: &mut Vec<NetEvent>,
    ) -> io::Result<()> {
        self.arm_static(core)?;
        // Paused connections resume once the handler consumed.
        let mut list = std::mem::take(&mut self.list_buf);
        list.clear();
        list.append(&mut self.paused);
        for &idx in &list {
            let id = core.id(idx);
            let uc = &mut self.conns[idx as usize];
            if !uc.paused {
                continue; // Stale entry: the slot was freed since.
            }
            if uc.reaped || core.phase(idx) == Phase::Dead {
                uc.paused = false;
            } else if uc.recv_armed {
                // The cancel of its recv has not completed yet.
                self.paused.push(idx);
            } else if core.input(id).len() < core.pause_bytes(id, self.read_bytes) {
                uc.paused = false;
                self.arm_recv(core, idx)?;
            } else {
                self.paused.push(idx);
            }
        }
        // Output queued since the last poll: one batch of sends.
        core.take_dirty(&mut list);
        for &idx in &list {
            self.flush(core, idx)?;
        }
        self.list_buf = list;
        // Then sockets of dead connections close (including those the flush finished).
        self.reap(core)?;

        // At most one clock read per poll that does not block (none when the caller
        // gave its turn's reading), a second one only after a real wait.
        let mut now_ms = now.map_or_else(
            || self.now_ms(),
            |t| t.saturating_duration_since(self.start).as_millis() as u64,
        );
        let wait = if core.has_events() {
            Some(Duration::ZERO)
        } else {
            match (timeout, core.next_deadline_ms()) {
                (Some(t), None) => Some(t),
                (t, Some(deadline_ms)) => {
                    let d = Duration::from_millis(deadline_ms.saturating_sub(now_ms));
                    Some(t.map_or(d, |t| t.min(d)))
                }
                (None, None) => None,
            }
        };
        let blocks = wait.is_none_or(|d| !d.is_zero());
        now_ms = self.submit_and_collect(core, wait, (!blocks).then_some(now_ms))?;
        core.advance(now_ms);
        // Listeners whose pause ended are re-armed by the next poll's `arm_static`,
        // submitted by that poll's enter.
        let mut resumed = std::mem::take(&mut self.resumed);
        core.take_resumed(&mut resumed);
        self.resumed = resumed;
        core.take_events(out);
        Ok(())
    }
}

impl UringIo {
    /// Ends every connection's IO (recvs see end of stream, sends fail), cancels
    /// every request, then waits (bounded) until none references our memory.
    /// Listeners are not shut down: other shards may share their socket. Returns
    /// whether IO may still reference memory after all: then the receive buffers
    /// and accept addresses are leaked by our drop, and the caller must leak the
    /// connections' output buffers (its [`Core`]). Runs once; later calls only
    /// answer.
    pub fn quiesce(&mut self) -> bool {
        if self.quiesced {
            return self.bufs_unsafe_to_free;
        }
        self.quiesced = true;
        for uc in &self.conns {
            if let Some(fd) = &uc.fd {
                // SAFETY: shutdown on a socket we own.
                unsafe { libc::shutdown(fd.as_raw_fd(), libc::SHUT_RDWR) };
            }
        }
        let cancel = user_data(OP_CANCEL_ALL, 0, 0);
        super::bufring::cancel_all_and_drain(&mut self.ring, &mut self.inflight, cancel);
        if self.inflight > 0 {
            // Some IO may still write into the buffers: never unmap them.
            self.bufs_unsafe_to_free = true;
        }
        self.bufs_unsafe_to_free
    }
}

impl Drop for UringIo {
    fn drop(&mut self) {
        if self.quiesce() {
            std::mem::replace(&mut self.bufs, BufRing::empty()).leak();
            // An accept still in flight may write its peer address.
            std::mem::forget(std::mem::take(&mut self.accept_addrs));
        }
    }
}
