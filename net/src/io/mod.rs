//! Transports of one shard: the clients' raw TCP and WebSocket connections, and the
//! inter-node connections (accepted on an RPC listener, or dialed with
//! [`NetDriver::connect`]; raw TCP), behind one driver: one sans-IO connection
//! table (`core.rs`) that every accessor reads, and one of two backends that move
//! its bytes, io_uring (`uring_driver.rs`) and mio/epoll (`mio_driver.rs`), picked
//! at run time ([`Backend`]).
//!
//! The transports move bytes; they do not parse wkproto or RPC frames. For WebSocket connections
//! they run the HTTP/1.1 upgrade and the framing, and hand the handler the
//! concatenated payloads of the binary messages, i.e. the same byte stream a raw
//! TCP connection carries; or, on a connection whose first message was text
//! (JSON-RPC, [`NetDriver::text_messages`]), each text message behind its length.
//!
//! # Contract (both backends)
//! - A driver belongs to one shard thread; it implements [`shard::runtime::Driver`]:
//!   `poll(Some(ZERO))` never blocks, any other timeout blocks in one wait covering
//!   the sockets, the shard's doorbell eventfd (drained when it fired) and the
//!   timeout. Each poll first writes the output queued since the previous poll (one
//!   batch: io_uring submits once per poll, mio writes until `WouldBlock`), then
//!   collects IO, then fires the driver's idle timers. The io_uring ring is set up
//!   `SINGLE_ISSUER | DEFER_TASKRUN`: create, poll and drop a driver on one thread
//!   (the runtime's factory runs on the shard thread). Dropping a driver closes its
//!   connections.
//! - Every accepted connection the handler sees gets exactly one
//!   [`NetEvent::Accepted`] (for WebSocket: after the upgrade), then any number of
//!   [`NetEvent::Readable`], then exactly one [`NetEvent::Closed`]. A dialed one (see
//!   "Dialing") gets [`NetEvent::Connected`] instead of `Accepted`, or only `Closed`
//!   if it never connected. After `Closed` the [`ConnId`] is stale:
//!   [`NetDriver::send`] fails, [`NetDriver::input`] is empty once the event batch
//!   that carried `Closed` has been handled. A stale id never reaches a newer
//!   connection in the same slot (ids carry a generation).
//! - Input: [`NetDriver::input`] is the unconsumed byte stream, in order, however
//!   the peer split or coalesced it; the handler removes what it decoded with
//!   [`NetDriver::consume`]. `Readable` is reported once per poll when new bytes
//!   arrived. Reading pauses while unconsumed input is within one read
//!   (`read_chunk_bytes`, io_uring: `uring_buf_bytes`) of
//!   [`NetConfig::inbound_buffer_bytes_max`] and resumes once the handler consumed.
//!   mio never exceeds the limit; io_uring may still deliver the completions already
//!   posted when it paused (at most `uring_buf_count * uring_buf_bytes`). Past that
//!   the connection is closed ([`CloseReason::InboundOverflow`]).
//! - Output: [`NetDriver::send`] appends to the connection's queue (WebSocket: one
//!   binary message per call); the queue is bounded by
//!   [`NetConfig::outbound_queue_bytes_max`]; a send past it closes that connection
//!   only ([`CloseReason::OutboundOverflow`], logged). [`NetDriver::close`] is
//!   graceful: queued output is flushed (WebSocket: a close frame is sent), then the
//!   write side is shut down and the socket is closed when the peer closes or after
//!   [`NetConfig::close_linger_ms`].
//! - A connection without input for [`NetConfig::idle_timeout_ms`] is closed
//!   ([`CloseReason::IdleTimeout`]); one the handler has not marked established
//!   ([`NetDriver::mark_established`], after CONNECT or the RPC handshake) is closed
//!   [`NetConfig::connect_timeout_ms`] after its accept (dialed: after `Connected`)
//!   whatever it sends ([`CloseReason::ConnectTimeout`]; WebSocket PINGs do not keep
//!   it open).
//! - Output of the shard's client connections is bounded by
//!   [`NetConfig::outbound_budget_bytes_per_shard`]: a send (or a PONG) that would
//!   pass it closes the client connection with the largest queue
//!   ([`CloseReason::SlowReader`]). Inter-node links (`Transport::Rpc`) are never
//!   closed for it nor charged to it: each has its own queue limit,
//!   [`NetConfig::rpc_outbound_queue_bytes_max`]. Written output buffers larger than 4 KiB are
//!   released, so a burst's memory does not stay with the connection.
//! - Accepting: past [`NetConfig::connections_per_shard_max`] (TCP and WebSocket
//!   together; inter-node links: past [`NetConfig::rpc_links_per_shard_max`],
//!   accepted and dialed together) an accepted socket is reset at once (`SO_LINGER` 0, counted as
//!   `conn_cap`) and never reported. When `accept` fails for lack of descriptors or
//!   memory (EMFILE, ENFILE, ENOBUFS, ENOMEM) the driver closes its spare descriptor,
//!   accepts and resets one connection (`fd_limit`), and reopens the spare; if even
//!   that fails the listener pauses on the schedule of [`AcceptBackoff`] (the retry
//!   time bounds the driver's wait, so accepting resumes by itself, and the whole
//!   queue is drained then). Nothing spins on a failing accept.
//! - Listeners: each shard's driver gets its own listening sockets, each of a kind
//!   ([`Transport`]): `Tcp` and `WebSocket` for clients, `Rpc` for other nodes (raw
//!   TCP, never WebSocket; `Accepted` reports `listener: Transport::Rpc`, and its
//!   counters are [`NetStats::rpc`]). Bind one per shard with [`bind_reuseport`]
//!   (the kernel spreads connections over shards), or hand every shard a
//!   `try_clone` of the same listener. A connection stays on the shard that
//!   accepted it.
//! - TLS: a [`Listener`] with a [`TlsServer`] (a WebSocket listener: `wss://`,
//!   [`NetDriver::with_listeners`]) speaks TLS first: the core decrypts what the
//!   socket gives into the WebSocket layer and seals the queued output into records
//!   when the backend takes it, so both backends carry it alike and the handler
//!   sees a WebSocket connection (`listener: Transport::WebSocket`) as any other.
//!   The TLS handshake comes before the upgrade, within the same
//!   `connect_timeout_ms`; `Accepted` follows the upgrade. A shard does at most
//!   `[tls] handshakes_per_poll_max` handshake steps per poll (the rest wait, at
//!   most `handshake_bytes_max` each, for the next polls, which then do not
//!   block), so a storm of handshakes is spread over the loop's turns. Bad TLS
//!   input closes that connection only ([`CloseReason::Tls`], counted in
//!   [`NetStats::tls_failures`] and the listener's [`tls::TlsCounters`], logged at
//!   powers of two). Output limits count the queued plaintext and then its
//!   records (their overhead included).
//! - Dialing: [`NetDriver::connect`] opens a non-blocking raw-TCP connection
//!   (`TCP_NODELAY`, like accepted ones) and returns its id at once; the connect
//!   goes on during the following polls. It counts against
//!   `rpc_links_per_shard_max` from that moment (at the cap `connect` fails with
//!   `QuotaExceeded` and no event follows; so does a failure to create the socket).
//!   Then exactly one of: [`NetEvent::Connected`] (then `Readable`s, then one
//!   `Closed`, as for an accepted connection); `Closed` with
//!   [`CloseReason::ConnectFailed`] (the socket's error kind: refused, unreachable,
//!   reset; also when the `connect` call failed at once: the event comes with the
//!   next poll); `Closed` with [`CloseReason::ConnectTimeout`] when it has not
//!   connected [`NetConfig::connect_timeout_ms`] after `connect`. Bytes sent before
//!   `Connected` are queued (within `rpc_outbound_queue_bytes_max`) and written from the first poll after it. `close` before
//!   `Connected` abandons the dial at once (queued bytes dropped, `Closed { Local }`).
//!   After `Connected` every rule above applies unchanged: the handler marks it
//!   established after its own handshake, else it is closed `connect_timeout_ms`
//!   after `Connected`; the idle timeout applies. The drivers do not retry: the
//!   caller reconnects (with its own backoff). Completion: mio registers the socket
//!   for readability and writability and, on its first event, reads `SO_ERROR`
//!   (`take_error`) and `peer_addr` to tell success from failure; io_uring uses the
//!   same non-blocking `connect` and a single-shot `PollAdd(POLLOUT)` on the socket
//!   (so no socket address must outlive the call), then the same checks, then arms
//!   its multishot recv.
//! - A process that only dials (a load generator, `imbench`) makes its driver with
//!   [`NetDriver::dialer`] and [`NetConfig::dialer`]`(n)`: no listener, a table of
//!   `n` dialed connections, each a raw byte stream (as a dialed link always is),
//!   never closed for silence; [`NetDriver::poll_until`] ends a wait at a deadline
//!   to the microsecond on both backends (mio: a timerfd; the node never makes one).

pub mod bufring;
mod core;
pub mod fd;
mod mio_driver;
mod outbuf;
mod timerfd;
pub mod tls;
mod uring_driver;
use proto::ws;

pub use self::core::AcceptBackoff;
use self::core::Core;
pub use self::tls::{TlsConfig, TlsLoadError, TlsServer};

use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

use shard::runtime::{Driver, EventFd};

use mio_driver::MioIo;
use uring_driver::UringIo;

/// Which IO backend a [`NetDriver`] uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// io_uring; fails if the kernel refuses it.
    Uring,
    /// mio (epoll).
    Mio,
    /// io_uring if it can be set up, otherwise mio (with a warning).
    Auto,
}

/// Limits and sizes of one shard's transports. Every bound has its unit in its name.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NetConfig {
    /// Open client connections per shard (TCP and WebSocket); further accepted
    /// sockets are reset at once. The node refuses to start when the descriptor
    /// limit cannot hold this many per shard beside `fd_reserve` and the links
    /// (raise `LimitNOFILE=` or lower this; `imrouter check-host` tells before a
    /// start). Inter-node links have a cap of their own.
    pub connections_per_shard_max: usize,
    /// Open inter-node links per shard (`Transport::Rpc`, accepted and dialed
    /// together), apart from the clients' cap so that idle clients at theirs
    /// never keep a peer from linking; further accepted links are reset at once,
    /// further dials refused with an error. The node sets it from the cluster
    /// (every peer's dial from each of its shards, twice over for a peer that
    /// restarted before its old links closed, plus this shard's own dials); not
    /// read from a file.
    #[serde(skip)]
    pub rpc_links_per_shard_max: usize,
    /// Queued, unsent output per inter-node link; a send past it closes the link
    /// (the node admits pushes against half of it). Links are never closed for
    /// the clients' `outbound_budget_bytes_per_shard`, nor charged to it: their
    /// output is bounded by this times `rpc_links_per_shard_max`.
    pub rpc_outbound_queue_bytes_max: usize,
    /// Descriptors the node keeps out of the connection caps for the process as a
    /// whole: the metadata journal, the HTTP API's connections, threads' files,
    /// stdio. The node adds what each shard holds besides client connections (log
    /// segments, listeners, accepts in flight, its `rpc_links_per_shard_max` links,
    /// rings, eventfds, the spare descriptor); the rest of `RLIMIT_NOFILE` is split
    /// between the shards as their connection cap.
    pub fd_reserve: usize,
    /// Queued, unsent output per connection; a send past it closes the connection.
    pub outbound_queue_bytes_max: usize,
    /// Queued, unsent output of all of a shard's connections together; a send past
    /// it closes the connection with the largest queue (a slow reader). Worst case
    /// of a shard's output memory: this budget, plus up to 4 KiB of kept buffer
    /// capacity per connection (`connections_per_shard_max` × 8 KiB with both
    /// buffers), plus a WebSocket handshake answer or close frame per connection.
    /// Without it the bound would be `outbound_queue_bytes_max` ×
    /// `connections_per_shard_max` (4 MiB × 65,536 = 256 GiB).
    pub outbound_budget_bytes_per_shard: usize,
    /// Bytes read per `read` call (mio: one per-shard scratch buffer of this size).
    pub read_chunk_bytes: usize,
    /// Largest wkproto frame the handler accepts (1 MiB body plus header).
    pub frame_bytes_max: usize,
    /// Unconsumed input per connection; past it the connection is closed. Default
    /// `frame_bytes_max + read_chunk_bytes`: a handler that consumes every whole
    /// frame never hits it.
    pub inbound_buffer_bytes_max: usize,
    /// Unconsumed input per inter-node link (`Transport::Rpc`), which carries
    /// frames up to `[rpc] rpc_frame_bytes_max`: the node refuses to start when a
    /// frame and one read do not fit. Default: the default frame limit plus
    /// `read_chunk_bytes`.
    pub rpc_inbound_buffer_bytes_max: usize,
    /// Largest WebSocket message (all fragments) accepted from a client.
    pub ws_message_bytes_max: usize,
    /// Largest HTTP upgrade request.
    pub ws_handshake_bytes_max: usize,
    /// A connection without input for this long is closed.
    pub idle_timeout_ms: u64,
    /// A connection the handler has not marked established (no successful CONNECT
    /// or RPC handshake) this long after its accept (dialed: after `Connected`) is
    /// closed, whatever it sends (PINGs included); a dial whose TCP connect has not
    /// completed this long after `connect` is closed too.
    pub connect_timeout_ms: u64,
    /// First pause of a listener whose accept failed for lack of descriptors or
    /// memory; each further failure doubles it.
    pub accept_backoff_initial_ms: u64,
    /// Longest pause of a failing listener.
    pub accept_backoff_ms_max: u64,
    /// After a graceful close has flushed, how long to wait for the peer's close.
    pub close_linger_ms: u64,
    /// `listen(2)` backlog of the listening sockets (the kernel caps it at somaxconn).
    pub listen_backlog: i32,
    /// mio: readiness events taken per wait.
    pub mio_events_capacity: usize,
    /// io_uring: submission queue entries (the completion queue has 4 times as many).
    pub uring_entries: u32,
    /// io_uring: accepts in flight per listener. Their descriptors exist before the
    /// shard sees them, so a shard may briefly hold this many per listener beyond
    /// its connection cap (`fd_reserve` covers it). At EMFILE one of them may take
    /// the descriptor the spare freed; the connection it gives is then reset to get
    /// the spare back (`restore_spare`).
    pub uring_accepts_inflight: u32,
    /// io_uring: provided receive buffers per shard (a power of two, at most 32768).
    pub uring_buf_count: u16,
    /// io_uring: bytes per provided receive buffer.
    pub uring_buf_bytes: u32,
    /// The backend to use.
    pub backend: Backend,
}

impl Default for NetConfig {
    fn default() -> Self {
        let read_chunk_bytes = 64 * 1024;
        let frame_bytes_max = (1 << 20) + 5;
        NetConfig {
            connections_per_shard_max: 8192,
            rpc_links_per_shard_max: 64,
            rpc_outbound_queue_bytes_max: 4 << 20,
            fd_reserve: 256,
            outbound_queue_bytes_max: 4 << 20,
            outbound_budget_bytes_per_shard: 256 << 20,
            read_chunk_bytes,
            frame_bytes_max,
            inbound_buffer_bytes_max: frame_bytes_max + read_chunk_bytes,
            rpc_inbound_buffer_bytes_max: proto::rpc::frame::RPC_FRAME_BYTES_MAX_DEFAULT
                + read_chunk_bytes,
            ws_message_bytes_max: frame_bytes_max,
            ws_handshake_bytes_max: 8 * 1024,
            idle_timeout_ms: 90_000,
            connect_timeout_ms: 10_000,
            accept_backoff_initial_ms: 10,
            accept_backoff_ms_max: 1_000,
            close_linger_ms: 2_000,
            listen_backlog: 4096,
            mio_events_capacity: 1024,
            uring_entries: 4096,
            uring_accepts_inflight: 8,
            uring_buf_count: 1024,
            uring_buf_bytes: 16 * 1024,
            backend: Backend::Auto,
        }
    }
}

impl NetConfig {
    /// The configuration of a process that only dials ([`NetDriver::dialer`]: a load
    /// generator, a test client) up to `links` connections at once: the table is
    /// sized for them (dials count against `rpc_links_per_shard_max`, which is
    /// `links`; one client slot, as no listener accepts), and a connection is never
    /// closed for silence (`idle_timeout_ms` is a day). Every other limit is the
    /// default: queues of `rpc_outbound_queue_bytes_max` and input of
    /// `rpc_inbound_buffer_bytes_max` per connection, `connect_timeout_ms` for the
    /// TCP connect and then for [`NetDriver::mark_established`], the backend `Auto`.
    /// `links` must be at most 65536 (the process's descriptor limit bounds it first).
    pub fn dialer(links: usize) -> NetConfig {
        NetConfig {
            connections_per_shard_max: 1,
            rpc_links_per_shard_max: links,
            idle_timeout_ms: 24 * 3600 * 1000,
            ..NetConfig::default()
        }
    }

    fn validate(&self) -> io::Result<()> {
        let bad = |what: &str| {
            Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                what.to_string(),
            ))
        };
        if self.connections_per_shard_max == 0 || self.connections_per_shard_max > (1 << 24) {
            return bad("connections_per_shard_max must be in 1..=2^24");
        }
        if self.rpc_links_per_shard_max > (1 << 16) || self.rpc_outbound_queue_bytes_max == 0 {
            return bad(
                "rpc_links_per_shard_max must be at most 65536 and rpc_outbound_queue_bytes_max \
                 positive",
            );
        }
        if self.read_chunk_bytes == 0
            || self.inbound_buffer_bytes_max == 0
            || self.rpc_inbound_buffer_bytes_max == 0
        {
            return bad(
                "read_chunk_bytes, inbound_buffer_bytes_max and rpc_inbound_buffer_bytes_max \
                 must be positive",
            );
        }
        if !self.uring_buf_count.is_power_of_two() || self.uring_buf_count > 32768 {
            return bad("uring_buf_count must be a power of two <= 32768");
        }
        if self.uring_buf_bytes == 0
            || self.uring_entries == 0
            || self.mio_events_capacity == 0
            || self.uring_accepts_inflight == 0
        {
            return bad(
                "uring_buf_bytes, uring_entries, uring_accepts_inflight and mio_events_capacity \
                 must be positive",
            );
        }
        if self.outbound_budget_bytes_per_shard < self.outbound_queue_bytes_max {
            return bad("outbound_budget_bytes_per_shard must be >= outbound_queue_bytes_max");
        }
        if self.accept_backoff_initial_ms == 0
            || self.accept_backoff_ms_max < self.accept_backoff_initial_ms
        {
            return bad("accept_backoff_initial_ms must be positive and <= accept_backoff_ms_max");
        }
        Ok(())
    }
}

/// Which listener accepted a connection: the one transport enum of the crate (the
/// old name, kept for `engine`).
pub use proto::Transport;

/// One connection of one shard: slot index plus the slot's generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConnId {
    index: u32,
    generation: u32,
}

impl ConnId {
    /// The slot index, `< connections_per_shard_max + rpc_links_per_shard_max`:
    /// usable to index the handler's
    /// own per-connection table (check the generation through the whole id).
    pub fn index(self) -> usize {
        self.index as usize
    }
}

/// Why a connection was closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloseReason {
    /// The peer closed (TCP end of stream, or a WebSocket close frame).
    PeerClosed,
    /// A socket error.
    Error(io::ErrorKind),
    /// No input for `idle_timeout_ms`.
    IdleTimeout,
    /// Not marked established within `connect_timeout_ms` of the accept (dialed: of
    /// the `Connected` event), or a dial whose TCP connect did not complete within
    /// `connect_timeout_ms` of [`NetDriver::connect`].
    ConnectTimeout,
    /// A dial's TCP connect failed (refused, unreachable, reset): the error of the
    /// socket (`SO_ERROR`, or of the `connect` call itself), as its kind.
    ConnectFailed(io::ErrorKind),
    /// The outbound queue passed `outbound_queue_bytes_max`.
    OutboundOverflow,
    /// The shard's output passed `outbound_budget_bytes_per_shard` and this
    /// connection had the largest queue.
    SlowReader,
    /// Unconsumed input passed `inbound_buffer_bytes_max`.
    InboundOverflow,
    /// Bad WebSocket input (unmasked or malformed frame, oversized message, a text
    /// message on a binary connection or the reverse).
    WebSocketProtocol,
    /// Bad TLS input on a TLS listener's connection (garbage records, a failed
    /// handshake, a handshake past `[tls] handshake_bytes_max`).
    Tls,
    /// The handler called `close`.
    Local,
}

/// What the driver reports to the shard's handler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NetEvent {
    /// A new connection (WebSocket: upgrade completed).
    Accepted {
        /// The new connection's id, valid until its `Closed`.
        conn: ConnId,
        /// The kind of listener that accepted it (a `wss://` one is `WebSocket`).
        listener: Transport,
        /// The remote address of the socket.
        peer: SocketAddr,
    },
    /// A connection dialed with [`NetDriver::connect`] is established (TCP connect
    /// completed); `peer` is the address it reached.
    Connected {
        /// The id `connect` returned.
        conn: ConnId,
        /// The remote address the socket is connected to.
        peer: SocketAddr,
    },
    /// New bytes are in the connection's input.
    Readable {
        /// The connection whose [`NetDriver::input`] grew.
        conn: ConnId,
    },
    /// The connection is closed; its id is stale from now on.
    Closed {
        /// The connection, closed; never reused for a newer one.
        conn: ConnId,
        /// Why it closed.
        reason: CloseReason,
    },
}

/// Why [`NetDriver::send`] refused bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendError {
    /// The connection is closed or closing (stale id).
    Closed,
    /// The outbound queue would pass its limit: the connection is being closed.
    Overflow,
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::Closed => f.write_str("connection closed"),
            SendError::Overflow => f.write_str("outbound queue full: connection closed"),
        }
    }
}

impl std::error::Error for SendError {}

/// A listening socket bound with `SO_REUSEADDR` and `SO_REUSEPORT`, backlog
/// `backlog`, non-blocking. Bind one per shard to the same address.
pub fn bind_reuseport(addr: SocketAddr, backlog: i32) -> io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(backlog)?;
    Ok(socket.into())
}

/// Closes an accepted socket with a reset (`SO_LINGER` 0): the client learns at
/// once that it was refused instead of waiting on an idle connection.
fn reset<S: std::os::fd::AsFd>(stream: S) {
    let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
    drop(stream);
}

/// The spare descriptor of a driver (`/dev/null`): closed to make room for one
/// `accept` when the process is out of descriptors, reopened after.
struct Spare(Option<std::fs::File>);

impl Spare {
    fn open() -> Spare {
        Spare(std::fs::File::open("/dev/null").ok())
    }

    fn reopen(&mut self) {
        if self.0.is_none() {
            self.0 = std::fs::File::open("/dev/null").ok();
        }
    }
}

/// What one attempt with the spare descriptor gave.
enum SpareOutcome {
    /// A connection was accepted with it and reset: try the queue again.
    ResetOne,
    /// The queue is empty.
    Empty,
    /// Even with the spare descriptor the accept failed (or there was no spare).
    Failed(io::Error),
}

/// The classic answer to EMFILE: close the spare descriptor, `accept` one
/// connection (non-blocking) and reset it, reopen the spare.
fn accept_with_spare<S: std::os::fd::AsFd>(
    spare: &mut Spare,
    first: io::Error,
    mut accept: impl FnMut() -> io::Result<S>,
) -> SpareOutcome {
    spare.reopen();
    if spare.0.take().is_none() {
        return SpareOutcome::Failed(first);
    }
    let outcome = loop {
        match accept() {
            Ok(stream) => {
                reset(stream);
                break SpareOutcome::ResetOne;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break SpareOutcome::Empty,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => break SpareOutcome::Failed(e),
        }
    };
    spare.reopen();
    outcome
}

/// A connection accepted normally while the spare descriptor is missing (another
/// thread, or an accept in flight, took the one it freed): the spare comes first, so
/// the next EMFILE can be answered. If it cannot be reopened the process is at its
/// limit: the new connection is reset to make room for it (`None`: counted as an
/// `fd_limit` refusal by the caller).
fn restore_spare<S: std::os::fd::AsFd>(spare: &mut Spare, stream: S) -> Option<S> {
    if spare.0.is_some() {
        return Some(stream);
    }
    spare.reopen();
    if spare.0.is_some() {
        return Some(stream);
    }
    reset(stream);
    spare.reopen();
    None
}

/// A non-blocking TCP socket (`TCP_NODELAY`, close-on-exec) whose connect to
/// `addr` has started, from `from` when given (see [`dial_source`]). `Err`: no
/// socket (out of descriptors or memory). The second value is the error of the
/// `bind` or `connect` call itself when it failed at once (the dial is then
/// reported failed); otherwise completion is signalled by writability and told
/// apart with [`connect_outcome`].
fn start_connect(
    addr: SocketAddr,
    from: Option<IpAddr>,
) -> io::Result<(std::net::TcpStream, Option<io::Error>)> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(
        Domain::for_address(addr),
        Type::STREAM.nonblocking(),
        Some(Protocol::TCP),
    )?;
    socket.set_tcp_nodelay(true)?;
    if let Some(ip) = dial_source(addr, from) {
        if let Err(e) = bind_source(&socket, ip) {
            return Ok((socket.into(), Some(e)));
        }
    }
    let failed = match socket.connect(&addr.into()) {
        Ok(()) => None,
        // In progress (EINTR: the connect goes on asynchronously too).
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINPROGRESS | libc::EINTR)) => None,
        Err(e) => Some(e),
    };
    Ok((socket.into(), failed))
}

/// The source address a dial to `addr` binds before connecting: `from`, unless it
/// is unspecified (`0.0.0.0`, `::`: the kernel chooses, as without one) or of the
/// other family than `addr`.
fn dial_source(addr: SocketAddr, from: Option<IpAddr>) -> Option<IpAddr> {
    from.filter(|ip| !ip.is_unspecified() && ip.is_ipv4() == addr.is_ipv4())
}

/// Binds `socket` to `ip` with a port the kernel picks. On IPv4 with
/// `IP_BIND_ADDRESS_NO_PORT`: the port is chosen at connect time, per destination
/// (a plain bind holds an ephemeral port of its own whatever the destination);
/// where the option is refused the bind takes a port as usual.
fn bind_source(socket: &socket2::Socket, ip: IpAddr) -> io::Result<()> {
    if ip.is_ipv4() {
        use std::os::fd::AsRawFd;
        let on: libc::c_int = 1;
        // SAFETY: `on` is a live c_int of the length passed; the option only reads it.
        // Its failure is harmless (an older kernel): the bind below still works.
        let _ = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::IPPROTO_IP,
                libc::IP_BIND_ADDRESS_NO_PORT,
                (&on as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
    }
    socket.bind(&SocketAddr::new(ip, 0).into())
}

/// The start of a dial, common to both backends: the cap checked, the socket's
/// non-blocking connect started (from `from`, see [`dial_source`]), the slot taken.
/// Gives the slot, its id, and the socket to watch — `None` when the `bind` or
/// `connect` call failed at once (the dial is then already reported failed by the
/// table).
fn begin_dial(
    core: &mut self::core::Core,
    addr: SocketAddr,
    from: Option<IpAddr>,
) -> io::Result<(u32, ConnId, Option<std::net::TcpStream>)> {
    core.reserve_dial()?;
    let (stream, failed) = start_connect(addr, from)?;
    let idx = core.alloc_dial(addr);
    let id = core.id(idx);
    if let Some(e) = failed {
        core.on_error(idx, e.kind());
        return Ok((idx, id, None));
    }
    Ok((idx, id, Some(stream)))
}

/// Where a dialing socket stands once it signalled writability or an error:
/// `Ok(Some(peer))` connected, `Ok(None)` still connecting (a spurious wakeup; with
/// `hangup`, i.e. the poll reported an error or hang-up, it counts as failed), `Err`
/// the connect failed (`SO_ERROR`).
fn connect_outcome<S: std::os::fd::AsFd>(sock: &S, hangup: bool) -> io::Result<Option<SocketAddr>> {
    let s = socket2::SockRef::from(sock);
    if let Some(e) = s.take_error()? {
        return Err(e);
    }
    match s.peer_addr() {
        Ok(a) => Ok(a.as_socket()),
        Err(e) if e.kind() == io::ErrorKind::NotConnected && !hangup => Ok(None),
        Err(e) => Err(e),
    }
}

/// Prepares a listener handed to a driver: non-blocking, backlog raised, and
/// `TCP_NODELAY` set once on the listener, which Linux copies to every socket it
/// accepts (so no `setsockopt` per accepted connection; pinned by the test
/// `accepted_sockets_inherit_the_listeners_nodelay`).
fn prepare_listener(listener: &TcpListener, backlog: i32) -> io::Result<()> {
    listener.set_nonblocking(true)?;
    let sock = socket2::SockRef::from(listener);
    sock.set_tcp_nodelay(true)?;
    // Calling listen again on a listening socket only changes its backlog.
    sock.listen(backlog)
}

/// A listening socket handed to a driver: its kind and, for `wss://`, its TLS side.
pub struct Listener {
    /// What its connections speak: raw TCP wkproto, WebSocket, or RPC (inter-node).
    pub kind: Transport,
    /// The bound socket (one per shard with `SO_REUSEPORT`, [`bind_reuseport`]).
    pub socket: TcpListener,
    /// Connections accepted on it speak TLS first (a WebSocket listener: `wss://`).
    pub tls: Option<TlsServer>,
}

impl From<(Transport, TcpListener)> for Listener {
    fn from((kind, socket): (Transport, TcpListener)) -> Self {
        Listener {
            kind,
            socket,
            tls: None,
        }
    }
}

impl Listener {
    /// A `wss://` listener: WebSocket behind TLS with `tls`'s certificate.
    pub fn wss(socket: TcpListener, tls: TlsServer) -> Self {
        Listener {
            kind: Transport::WebSocket,
            socket,
            tls: Some(tls),
        }
    }

    fn try_clone(&self) -> io::Result<Self> {
        Ok(Listener {
            kind: self.kind,
            socket: self.socket.try_clone()?,
            tls: self.tls.clone(),
        })
    }
}

/// One shard's transport driver: one connection table (`Core`, every accessor
/// below) and one backend that moves its bytes (io_uring or mio, chosen at
/// construction; only polling and dialing reach it).
pub struct NetDriver {
    core: Core,
    io: Io,
}

/// The backend of a [`NetDriver`].
enum Io {
    /// The io_uring backend ([`Backend::Uring`], or `Auto` where the kernel allows).
    Uring(Box<UringIo>),
    /// The mio (epoll) backend ([`Backend::Mio`], or `Auto`'s fallback).
    Mio(Box<MioIo>),
}

impl NetDriver {
    /// A driver waiting on `doorbell` and accepting on `listeners` (taken over; for
    /// a shared listener pass a `try_clone`). `config.backend` picks the backend.
    pub fn new(
        config: &NetConfig,
        doorbell: Arc<EventFd>,
        listeners: Vec<(Transport, TcpListener)>,
    ) -> io::Result<Self> {
        Self::with_listeners(
            config,
            doorbell,
            listeners.into_iter().map(Listener::from).collect(),
        )
    }

    /// [`NetDriver::new`] with listeners that may speak TLS ([`Listener::wss`]).
    pub fn with_listeners(
        config: &NetConfig,
        doorbell: Arc<EventFd>,
        listeners: Vec<Listener>,
    ) -> io::Result<Self> {
        let mio = |listeners| {
            MioIo::new(config, doorbell.clone(), listeners).map(|(core, io)| NetDriver {
                core,
                io: Io::Mio(Box::new(io)),
            })
        };
        let uring = |listeners| {
            UringIo::new(config, doorbell.clone(), listeners).map(|(core, io)| NetDriver {
                core,
                io: Io::Uring(Box::new(io)),
            })
        };
        match config.backend {
            Backend::Mio => mio(listeners),
            Backend::Uring => uring(listeners),
            Backend::Auto => {
                // Keep duplicates so a failed io_uring setup leaves the sockets for mio.
                let copies = listeners
                    .iter()
                    .map(Listener::try_clone)
                    .collect::<io::Result<Vec<_>>>()?;
                uring(copies).or_else(|err| {
                    tracing::warn!(%err, "io_uring unavailable; using the mio backend");
                    mio(listeners)
                })
            }
        }
    }

    /// A driver without listeners, for a process that only dials (configured with
    /// [`NetConfig::dialer`]): its connections are [`NetDriver::connect`]'s, raw byte
    /// streams (`Transport::Rpc`: no WebSocket or TLS layer; what is sent is written
    /// as it is, what is read is the input as it came). Its doorbell is its own and
    /// never rung: its waits end on IO or their timeout ([`NetDriver::poll_until`]).
    /// Create, poll and drop it on one thread (the io_uring backend's rule).
    pub fn dialer(config: &NetConfig) -> io::Result<Self> {
        Self::with_listeners(config, Arc::new(EventFd::new()?), Vec::new())
    }

    /// One poll (the contract of `Driver::poll`) whose wait ends at `deadline` to
    /// the microsecond on both backends (at once when it has passed), where
    /// `Driver::poll`'s timeout is whole milliseconds on mio: io_uring's wait takes
    /// the timeout as a timespec, mio's ends on a timerfd armed for the deadline
    /// (made by the first call; armed once per distinct deadline). For a caller
    /// whose own timers are finer than a millisecond (a load generator's intended
    /// send times); the node's shards use `Driver::poll`.
    pub fn poll_until(
        &mut self,
        deadline: std::time::Instant,
        events: &mut Vec<NetEvent>,
    ) -> io::Result<()> {
        match &mut self.io {
            Io::Uring(io) => {
                let wait = deadline.saturating_duration_since(std::time::Instant::now());
                io.poll_at(&mut self.core, Some(wait), None, events)
            }
            Io::Mio(io) => io.poll_until(&mut self.core, deadline, events),
        }
    }

    /// The backend in use (`Uring` or `Mio`).
    pub fn backend(&self) -> Backend {
        match self.io {
            Io::Uring(_) => Backend::Uring,
            Io::Mio(_) => Backend::Mio,
        }
    }

    /// The unconsumed input of `conn` (empty for a stale id).
    pub fn input(&self, conn: ConnId) -> &[u8] {
        self.core.input(conn)
    }

    /// Removes the first `n` bytes of `conn`'s input (clamped to its length).
    pub fn consume(&mut self, conn: ConnId, n: usize) {
        self.core.consume(conn, n)
    }

    /// Queues `bytes` for `conn` (WebSocket: as one binary message); written at the
    /// next poll. Refused for a stale id or past the connection's queue limit.
    pub fn send(&mut self, conn: ConnId, bytes: &[u8]) -> Result<(), SendError> {
        self.core.send(conn, bytes)
    }

    /// Queues `bytes` (JSON text) for `conn` as one WebSocket text message (on TCP:
    /// as they are); written at the next poll.
    pub fn send_text(&mut self, conn: ConnId, bytes: &[u8]) -> Result<(), SendError> {
        self.core.send_text(conn, bytes)
    }

    /// Whether `conn` is a WebSocket connection whose first data message was text:
    /// its input holds whole text messages, each behind its length
    /// (`ws::next_text_message`), and its output goes with [`Self::send_text`].
    pub fn text_messages(&self, conn: ConnId) -> bool {
        self.core.text_messages(conn)
    }

    /// Sends the same bytes to every connection of `conns`; returns how many took them.
    pub fn send_many(&mut self, conns: &[ConnId], bytes: &[u8]) -> usize {
        conns
            .iter()
            .filter(|&&c| self.send(c, bytes).is_ok())
            .count()
    }

    /// Starts an outbound raw-TCP connection to `addr` (non-blocking, `TCP_NODELAY`)
    /// and returns its id at once. `Connected`, then `Readable`s, then one `Closed`
    /// follow; or only `Closed { ConnectFailed(kind) }` / `Closed { ConnectTimeout }`
    /// (module docs, "Dialing"). Bytes sent before `Connected` are queued and written
    /// once connected. `Err` (no event follows): the shard holds
    /// `rpc_links_per_shard_max` links (kind `QuotaExceeded`), or no socket
    /// could be created (out of descriptors, memory; an address family the host
    /// lacks).
    pub fn connect(&mut self, addr: SocketAddr) -> io::Result<ConnId> {
        self.connect_from(addr, None)
    }

    /// [`Self::connect`] from the source address `from` (port chosen by the
    /// kernel): the connection leaves from that IP, as a node's links leave from its
    /// `rpc_addr`'s. `None`, or an unspecified or other-family address: the kernel
    /// chooses, as with [`Self::connect`]. A bind that fails (an address this host
    /// does not have) reports the dial failed (`Closed { ConnectFailed(kind) }`).
    pub fn connect_from(&mut self, addr: SocketAddr, from: Option<IpAddr>) -> io::Result<ConnId> {
        match &mut self.io {
            Io::Uring(io) => io.connect(&mut self.core, addr, from),
            Io::Mio(io) => io.connect(&mut self.core, addr, from),
        }
    }

    /// Closes `conn` gracefully (flush, WebSocket close frame, shutdown); a dial not
    /// yet connected is abandoned at once, its queued output dropped. A
    /// `Closed { reason: Local }` event follows. No-op for a stale id.
    pub fn close(&mut self, conn: ConnId) {
        self.core.close(conn)
    }

    /// `conn` authenticated (CONNECT accepted, or the RPC handshake done):
    /// `connect_timeout_ms` no longer applies to it, only `idle_timeout_ms`. No-op
    /// for a stale id.
    pub fn mark_established(&mut self, conn: ConnId) {
        self.core.mark_established(conn)
    }

    /// Queued, unwritten output of all connections (against
    /// `outbound_budget_bytes_per_shard`).
    pub fn outbound_total_bytes(&self) -> usize {
        self.core.outbound_total()
    }

    /// Bytes queued and not yet written for `conn` (0 for a stale id).
    pub fn outbound_bytes(&self, conn: ConnId) -> usize {
        self.core.outbound_bytes(conn)
    }

    /// Open connections (including those in a WebSocket upgrade or closing).
    pub fn connection_count(&self) -> usize {
        self.core.live()
    }

    /// Counters of this driver, with the output queued now.
    pub fn stats(&self) -> NetStats {
        NetStats {
            outbound_bytes: self.core.outbound_total() as u64,
            ..self.core.stats
        }
    }
}

impl Driver for NetDriver {
    type Event = NetEvent;

    fn poll(&mut self, timeout: Option<Duration>, events: &mut Vec<NetEvent>) -> io::Result<()> {
        match &mut self.io {
            Io::Uring(io) => io.poll_at(&mut self.core, timeout, None, events),
            Io::Mio(io) => io.poll_at(&mut self.core, timeout, None, events),
        }
    }

    fn poll_now(&mut self, now: std::time::Instant, events: &mut Vec<NetEvent>) -> io::Result<()> {
        let zero = Some(Duration::ZERO);
        match &mut self.io {
            Io::Uring(io) => io.poll_at(&mut self.core, zero, Some(now), events),
            Io::Mio(io) => io.poll_at(&mut self.core, zero, Some(now), events),
        }
    }
}

impl Drop for NetDriver {
    fn drop(&mut self) {
        // io_uring sends in flight read the connections' output buffers, which the
        // table owns: when the ring could not be emptied, they are leaked with it.
        if let Io::Uring(io) = &mut self.io {
            if io.quiesce() {
                let cfg = self.core.cfg.clone();
                std::mem::forget(std::mem::replace(&mut self.core, Core::new(&cfg, 0)));
            }
        }
    }
}

/// Accept counters of one driver's listeners of one kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ListenerStats {
    /// Sockets accepted and kept (WebSocket: before the upgrade).
    pub accepted: u64,
    /// Sockets reset at once: the shard was at its connection cap.
    pub refused_conn_cap: u64,
    /// Sockets reset at once: accepted with the spare descriptor while out of
    /// descriptors.
    pub refused_fd_limit: u64,
    /// Connections lost to other accept errors (ECONNABORTED, ...).
    pub refused_other: u64,
    /// Failed accept rounds (even the spare descriptor did not help): each pauses
    /// the listener for the backoff's next delay.
    pub accept_pauses: u64,
    /// Listeners of this kind paused now (gauge).
    pub paused: u64,
}

/// Counters of one driver's outbound connections.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DialStats {
    /// Dials started (a connection slot taken, the connect begun).
    pub started: u64,
    /// Dials that connected (`Connected` reported).
    pub connected: u64,
    /// Dials whose connect failed (`ConnectFailed`).
    pub failed: u64,
    /// Dials still connecting after `connect_timeout_ms` (`ConnectTimeout`).
    pub timed_out: u64,
    /// Dials refused at once: the shard held `rpc_links_per_shard_max` links.
    pub refused_conn_cap: u64,
}

/// Counters of one driver.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Connections accepted and kept (TCP; WebSocket after the upgrade).
    pub accepted: u64,
    /// Accepted sockets reset at once because the shard was at its limit.
    pub refused: u64,
    /// Failed accept rounds (e.g. out of file descriptors); logged at powers of two.
    pub accept_errors: u64,
    /// Accepting on the TCP listeners.
    pub tcp: ListenerStats,
    /// Accepting on the WebSocket listeners.
    pub ws: ListenerStats,
    /// Accepting on the inter-node (RPC) listeners.
    pub rpc: ListenerStats,
    /// Outbound connections ([`NetDriver::connect`]).
    pub dials: DialStats,
    /// Connections closed for not authenticating within `connect_timeout_ms` (dials
    /// that did not connect in time included).
    pub connect_timeouts: u64,
    /// Connections closed because their queue passed `outbound_queue_bytes_max`.
    pub outbound_overflow_closes: u64,
    /// Connections closed as slow readers: the shard's output passed
    /// `outbound_budget_bytes_per_shard` and theirs was the largest queue.
    pub slow_reader_closes: u64,
    /// Queued, unwritten output of the shard (gauge).
    pub outbound_bytes: u64,
    /// Connections closed (each reason).
    pub closed: u64,
    /// Bytes received from sockets.
    pub bytes_in: u64,
    /// Bytes written to sockets.
    pub bytes_out: u64,
    /// TLS handshakes completed.
    pub tls_handshakes: u64,
    /// TLS connections closed for bad TLS input.
    pub tls_failures: u64,
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn accepted_sockets_inherit_the_listeners_nodelay() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        super::prepare_listener(&listener, 16).unwrap();
        let _client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        listener.set_nonblocking(false).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        assert!(accepted.nodelay().unwrap(), "TCP_NODELAY not inherited");
    }
}
