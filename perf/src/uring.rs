//! The io_uring event loop of the send phase (`--io uring`, the default where the
//! kernel allows it): one ring per worker (`SINGLE_ISSUER | DEFER_TASKRUN`), a
//! multishot recv per connection into a ring of provided buffers (each completion is
//! one read: decoded at once and the buffer handed back), at most one `send` in flight
//! per connection, and the wait for the next completion or the next intended send as
//! the timespec of the one `io_uring_enter` that also submits everything queued.
//!
//! Per RECV this costs no syscall of its own: the recv and the RECVACK's send are
//! both carried by the loop's single `io_uring_enter`, where the epoll loop needs an
//! `epoll_wait`, a `recvfrom` and a `sendto`. The kernel's TCP work is the same.
//!
//! The ring only moves bytes; the worker owns the connections. Buffers the kernel may
//! still write into (provided buffers) or read from (a connection's in-flight send)
//! are never freed while a request references them: dropping the ring cancels every
//! request and waits (bounded) for their completions, and leaks the memory otherwise.

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

use io_uring::types::{Fd, SubmitArgs, Timespec};
use io_uring::{cqueue, opcode, squeue, IoUring};
use net::io::bufring::BufRing;

/// Submission queue entries (completion queue: four times as many).
pub const RING_ENTRIES: u32 = 4096;
/// Provided receive buffers per ring (a power of two).
pub const RECV_BUF_COUNT: u16 = 128;
/// Bytes of each provided receive buffer: one read brings in at most this much.
pub const RECV_BUF_BYTES: u32 = 32 * 1024;
/// Buffer group id of the provided receive buffers.
const BGID: u16 = 0;

// user_data: op (8 bits) | connection index (56 bits).
const OP_RECV: u64 = 1;
const OP_SEND: u64 = 2;
const OP_CANCEL: u64 = 3;

fn user_data(op: u64, idx: usize) -> u64 {
    (op << 56) | (idx as u64 & ((1 << 56) - 1))
}

fn split(ud: u64) -> (u64, usize) {
    (ud >> 56, (ud & ((1 << 56) - 1)) as usize)
}

/// The ring's view of one connection.
#[derive(Default)]
struct UConn {
    fd: Option<RawFd>,
    recv_armed: bool,
    send_inflight: bool,
    cancels: u32,
    /// The bytes of the send in flight (never touched until it completes).
    sending: Vec<u8>,
    sent: usize,
}

/// One completion the worker acts on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completion {
    /// Connection `conn` read `len` bytes into provided buffer `bid`: see
    /// [`Ring::data`], then [`Ring::recycle`].
    Recv { conn: usize, bid: u16, len: usize },
    /// The send in flight of `conn` completed: the next may start.
    Sent { conn: usize },
    /// The peer closed connection `conn`.
    Eof { conn: usize },
    /// A request of connection `conn` failed with this errno.
    Error { conn: usize, errno: i32 },
}

/// The io_uring of one worker.
pub struct Ring {
    // Declared before `bufs`: the io_uring is closed before the buffers are unmapped.
    uring: IoUring,
    bufs: Option<BufRing>,
    conns: Vec<UConn>,
    /// Requests submitted whose final completion has not arrived.
    inflight: usize,
    /// Connections whose multishot recv ended (out of buffers) and must be re-armed.
    rearm: Vec<usize>,
    cqes: Vec<(u64, i32, u32)>,
}

impl Ring {
    /// A ring for connections `0..conns`. Fails if the kernel refuses io_uring (an old
    /// kernel, or a sandbox): the caller then keeps the epoll loop.
    pub fn new(conns: usize) -> io::Result<Ring> {
        let uring: IoUring = IoUring::builder()
            .setup_single_issuer()
            .setup_coop_taskrun()
            .setup_taskrun_flag()
            .setup_defer_taskrun()
            .setup_cqsize(RING_ENTRIES * 4)
            .build(RING_ENTRIES)?;
        let bufs = BufRing::new(&uring, RECV_BUF_COUNT, RECV_BUF_BYTES, BGID)?;
        Ok(Ring {
            uring,
            bufs: Some(bufs),
            conns: (0..conns).map(|_| UConn::default()).collect(),
            inflight: 0,
            rearm: Vec::new(),
            cqes: Vec::with_capacity(RING_ENTRIES as usize * 4),
        })
    }

    /// Pushes one entry, submitting first when the queue is full.
    ///
    /// # Safety
    /// Every buffer the entry points to must stay valid until its final completion.
    unsafe fn push(&mut self, e: &squeue::Entry) -> io::Result<()> {
        loop {
            // SAFETY: forwarded from the caller.
            if unsafe { self.uring.submission().push(e) }.is_ok() {
                self.inflight += 1;
                return Ok(());
            }
            self.uring.submit()?;
        }
    }

    /// Starts reading connection `conn` on socket `fd` (which stays open until
    /// [`Ring::close`]).
    pub fn add(&mut self, conn: usize, fd: RawFd) -> io::Result<()> {
        self.conns[conn].fd = Some(fd);
        self.arm_recv(conn)
    }

    fn arm_recv(&mut self, conn: usize) -> io::Result<()> {
        let u = &self.conns[conn];
        let Some(fd) = u.fd.filter(|_| !u.recv_armed) else {
            return Ok(());
        };
        let e = opcode::RecvMulti::new(Fd(fd), BGID)
            .build()
            .user_data(user_data(OP_RECV, conn));
        // SAFETY: the recv writes only into provided buffers, which outlive it.
        unsafe { self.push(&e)? };
        self.conns[conn].recv_armed = true;
        Ok(())
    }

    /// Whether `conn` can take bytes for a send now (none in flight).
    pub fn can_send(&self, conn: usize) -> bool {
        let u = &self.conns[conn];
        u.fd.is_some() && !u.send_inflight
    }

    /// Starts a send of the bytes `fill` puts into the ring's (empty) send buffer of
    /// `conn`; nothing if it put none. Call only when [`Ring::can_send`].
    pub fn send_with(&mut self, conn: usize, fill: impl FnOnce(&mut Vec<u8>)) -> io::Result<()> {
        let u = &mut self.conns[conn];
        if u.send_inflight || u.fd.is_none() {
            return Ok(());
        }
        u.sending.clear();
        fill(&mut u.sending);
        u.sent = 0;
        if u.sending.is_empty() {
            return Ok(());
        }
        self.push_send(conn)
    }

    fn push_send(&mut self, conn: usize) -> io::Result<()> {
        let u = &self.conns[conn];
        let Some(fd) = u.fd else { return Ok(()) };
        let rest = &u.sending[u.sent..];
        let len = rest.len().min(u32::MAX as usize) as u32;
        let e = opcode::Send::new(Fd(fd), rest.as_ptr(), len)
            .flags(libc::MSG_NOSIGNAL)
            .build()
            .user_data(user_data(OP_SEND, conn));
        // SAFETY: `sending` is neither touched nor dropped while the send is in flight
        // (`send_inflight`), and the ring outlives it or leaks it (see `Drop`).
        unsafe { self.push(&e)? };
        self.conns[conn].send_inflight = true;
        Ok(())
    }

    /// Stops reading and sending `conn` (its requests are cancelled; the caller may
    /// close the socket now: requests hold their own reference to it).
    pub fn close(&mut self, conn: usize) -> io::Result<()> {
        let u = &mut self.conns[conn];
        if u.fd.take().is_none() {
            return Ok(());
        }
        let (recv, send) = (u.recv_armed, u.send_inflight);
        for (armed, op) in [(recv, OP_RECV), (send, OP_SEND)] {
            if armed {
                let e = opcode::AsyncCancel::new(user_data(op, conn))
                    .build()
                    .user_data(user_data(OP_CANCEL, conn));
                // SAFETY: a cancel references no memory.
                unsafe { self.push(&e)? };
                self.conns[conn].cancels += 1;
            }
        }
        Ok(())
    }

    /// The bytes of a [`Completion::Recv`].
    pub fn data(&self, bid: u16, len: usize) -> &[u8] {
        match &self.bufs {
            Some(b) => b.data(bid, len),
            None => &[],
        }
    }

    /// Returns a [`Completion::Recv`]'s buffer to the kernel.
    pub fn recycle(&mut self, bid: u16) {
        if let Some(b) = self.bufs.as_mut() {
            b.push(bid);
        }
    }

    /// Submits everything queued and waits until a completion arrives or `timeout`
    /// passes (zero: do not wait), then collects the completions into `out`.
    pub fn wait(&mut self, timeout: Duration, out: &mut Vec<Completion>) -> io::Result<()> {
        if let Some(b) = self.bufs.as_ref() {
            b.publish();
        }
        let mut rearm = std::mem::take(&mut self.rearm);
        for c in rearm.drain(..) {
            self.arm_recv(c)?;
        }
        self.rearm = rearm;
        let r = if timeout.is_zero() {
            let mut sq = self.uring.submission();
            let idle = sq.is_empty() && !sq.taskrun() && !sq.cq_overflow();
            sq.sync();
            drop(sq);
            if idle {
                Ok(0)
            } else {
                // With DEFER_TASKRUN, completions are posted only by an enter that asks
                // for events; submit_and_wait sets GETEVENTS when task work is pending.
                self.uring.submitter().submit_and_wait(0)
            }
        } else {
            let ts = Timespec::new()
                .sec(timeout.as_secs())
                .nsec(timeout.subsec_nanos());
            let args = SubmitArgs::new().timespec(&ts);
            self.uring.submitter().submit_with_args(1, &args)
        };
        match r {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY)
                ) => {}
            Err(e) => return Err(e),
        }
        self.collect(out)
    }

    fn collect(&mut self, out: &mut Vec<Completion>) -> io::Result<()> {
        let mut cqes = std::mem::take(&mut self.cqes);
        cqes.clear();
        cqes.extend(
            self.uring
                .completion()
                .map(|c| (c.user_data(), c.result(), c.flags())),
        );
        for &(ud, res, flags) in &cqes {
            let more = cqueue::more(flags);
            if !more {
                self.inflight -= 1;
            }
            let (op, conn) = split(ud);
            let Some(u) = self.conns.get_mut(conn) else {
                continue;
            };
            match op {
                OP_RECV => {
                    if !more {
                        u.recv_armed = false;
                    }
                    if res > 0 {
                        let Some(bid) = cqueue::buffer_select(flags) else {
                            return Err(io::Error::other("recv completion without a buffer"));
                        };
                        if u.fd.is_some() {
                            out.push(Completion::Recv {
                                conn,
                                bid,
                                len: res as usize,
                            });
                        } else if let Some(b) = self.bufs.as_mut() {
                            b.push(bid);
                        }
                        if !more && u.fd.is_some() {
                            self.rearm.push(conn);
                        }
                    } else if res == 0 {
                        if u.fd.is_some() {
                            out.push(Completion::Eof { conn });
                        }
                    } else if res == -libc::ENOBUFS {
                        // Out of provided buffers: re-armed once this batch gave some back.
                        self.rearm.push(conn);
                    } else if res != -libc::ECANCELED && u.fd.is_some() {
                        out.push(Completion::Error { conn, errno: -res });
                    }
                }
                OP_SEND => {
                    u.send_inflight = false;
                    if res >= 0 {
                        u.sent += res as usize;
                        if u.fd.is_some() {
                            if u.sent < u.sending.len() {
                                self.push_send(conn)?;
                            } else {
                                out.push(Completion::Sent { conn });
                            }
                        }
                    } else if res != -libc::ECANCELED && u.fd.is_some() {
                        out.push(Completion::Error { conn, errno: -res });
                    }
                }
                OP_CANCEL => u.cancels = u.cancels.saturating_sub(1),
                _ => {}
            }
        }
        self.cqes = cqes;
        Ok(())
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // Cancel every request, then wait (bounded) until none references our memory.
        net::io::bufring::cancel_all_and_drain(
            &mut self.uring,
            &mut self.inflight,
            user_data(OP_CANCEL, 0),
        );
        if self.inflight > 0 {
            // Requests may still use the buffers: never free them.
            if let Some(b) = self.bufs.take() {
                b.leak();
            }
            std::mem::forget(std::mem::take(&mut self.conns));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;

    #[test]
    fn user_data_round_trips() {
        for (op, idx) in [(OP_RECV, 0usize), (OP_SEND, 12_345), (OP_CANCEL, 1 << 40)] {
            assert_eq!(split(user_data(op, idx)), (op, idx));
        }
    }

    /// Waits (at most `WAITS_MAX` rounds) until `done` accepts a completion batch.
    fn wait_until(ring: &mut Ring, mut done: impl FnMut(&mut Ring, &[Completion]) -> bool) {
        const WAITS_MAX: usize = 1000;
        let mut out = Vec::new();
        for _ in 0..WAITS_MAX {
            out.clear();
            ring.wait(Duration::from_millis(100), &mut out).unwrap();
            if done(ring, &out) {
                return;
            }
        }
        panic!("the awaited completion never came");
    }

    /// Bytes written by a peer come back as recv completions (one buffer each, handed
    /// back); a send reaches the peer and completes; the peer's close is an end of
    /// stream; closing a connection cancels its recv, leaving nothing in flight.
    #[test]
    fn recv_send_eof_and_close_over_loopback() {
        let Ok(mut ring) = Ring::new(2) else {
            eprintln!("io_uring unavailable here: skipped");
            return;
        };
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        // Connection 1: closed by us while its recv is armed (the cancel path).
        let other = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (_other_peer, _) = l.accept().unwrap();
        ring.add(1, other.as_raw_fd()).unwrap();
        ring.close(1).unwrap();
        drop(other);
        wait_until(&mut ring, |ring, out| {
            assert!(
                out.is_empty(),
                "a closed connection reports nothing: {out:?}"
            );
            ring.inflight == 0
        });
        let client = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        // The load loop hands the ring non-blocking sockets (from mio).
        client.set_nonblocking(true).unwrap();
        let (mut peer, _) = l.accept().unwrap();
        ring.add(0, client.as_raw_fd()).unwrap();
        // More than one provided buffer's worth: several completions, in order.
        let sent: Vec<u8> = (0..RECV_BUF_BYTES as usize * 3 + 17)
            .map(|i| (i % 251) as u8)
            .collect();
        peer.write_all(&sent).unwrap();
        let mut got = Vec::new();
        wait_until(&mut ring, |ring, out| {
            for c in out {
                match *c {
                    Completion::Recv { conn, bid, len } => {
                        assert_eq!(conn, 0);
                        assert!(len <= RECV_BUF_BYTES as usize);
                        got.extend_from_slice(ring.data(bid, len));
                        ring.recycle(bid);
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
            got.len() >= sent.len()
        });
        assert_eq!(got, sent);

        assert!(ring.can_send(0));
        ring.send_with(0, |b| b.extend_from_slice(b"world"))
            .unwrap();
        assert!(!ring.can_send(0), "one send in flight at a time");
        wait_until(&mut ring, |_, out| {
            out.contains(&Completion::Sent { conn: 0 })
        });
        assert!(ring.can_send(0));
        let mut buf = [0u8; 5];
        peer.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"world");

        drop(peer);
        wait_until(&mut ring, |_, out| {
            out.contains(&Completion::Eof { conn: 0 })
        });
        ring.close(0).unwrap();
        assert!(!ring.can_send(0));
        wait_until(&mut ring, |ring, _| ring.inflight == 0);
        drop(ring);
        drop(client);
    }
}
