//! The connection table and per-connection state machine shared by both backends,
//! sans-IO: backends feed it received bytes, end of stream and errors (with `now`
//! passed to [`Core::advance`]), take output chunks from it, and tear down the
//! sockets of the connections it marks dead. Events for the handler queue here.
//!
//! Phases: `Handshake` (WebSocket upgrade; invisible to the handler) or
//! `Connecting` (a dialed connection whose TCP connect has not completed; output is
//! queued, not written) → `Open` → `Flushing` (graceful close: write what is queued)
//! → `Lingering` (write side shut down, waiting for the peer's end of stream) →
//! `Dead` (the backend closes the socket and frees the slot once no IO references
//! its buffers).
//!
//! Dialing: the backend asks [`Core::reserve_dial`] (the connection cap), starts a
//! non-blocking connect, takes a slot with [`Core::alloc_dial`] and reports the
//! outcome with [`Core::on_connected`] or [`Core::on_error`] (which, while
//! connecting, closes with [`CloseReason::ConnectFailed`]); [`Core::advance`] closes
//! a dial still connecting `connect_timeout_ms` after it started
//! ([`CloseReason::ConnectTimeout`]).

use std::io;
use std::net::SocketAddr;

use wheel::{TimerHandle, TimerWheel};

use super::outbuf::recycle;
use super::tls::{TlsConn, TlsServer};
use super::ws::{self, Handshake, WsControl, WsDecoder};
use super::{
    CloseReason, ConnId, ListenerStats, NetConfig, NetEvent, NetStats, SendError, Transport,
};

/// An input buffer whose capacity passed this is released when fully consumed, so
/// idle connections hold no large receive buffer.
const INPUT_KEEP_BYTES: usize = 4096;
/// The TLS layer's scratch buffers keep at most this capacity between uses.
const TLS_SCRATCH_KEEP_BYTES: usize = 64 * 1024;
/// The retry schedule of a listener whose accept failed for lack of resources
/// (EMFILE, ENFILE, ENOBUFS, ENOMEM, even after the spare descriptor was used):
/// the first retry after `initial_ms`, each next one after twice as long, at most
/// `max_ms`; the first successful accept resets it. Sans-IO.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AcceptBackoff {
    initial_ms: u64,
    max_ms: u64,
    /// The delay of the last failure (0: no failure since the last success).
    current_ms: u64,
}

impl AcceptBackoff {
    /// A schedule from `initial_ms` doubling to `max_ms`.
    pub fn new(initial_ms: u64, max_ms: u64) -> Self {
        let initial_ms = initial_ms.max(1);
        AcceptBackoff {
            initial_ms,
            max_ms: max_ms.max(initial_ms),
            current_ms: 0,
        }
    }

    /// The schedule of `cfg` (`accept_backoff_initial_ms`, `accept_backoff_ms_max`).
    pub fn from_config(cfg: &NetConfig) -> Self {
        Self::new(cfg.accept_backoff_initial_ms, cfg.accept_backoff_ms_max)
    }

    /// A failed accept round at `now_ms`: the time of the retry.
    pub fn on_failure(&mut self, now_ms: u64) -> u64 {
        self.current_ms = match self.current_ms {
            0 => self.initial_ms,
            d => d.saturating_mul(2).min(self.max_ms),
        };
        now_ms.saturating_add(self.current_ms)
    }

    /// An accept succeeded: the next failure starts the schedule again.
    pub fn on_success(&mut self) {
        self.current_ms = 0;
    }

    /// The delay before the last scheduled retry (0 after a success).
    pub fn delay_ms(&self) -> u64 {
        self.current_ms
    }

    /// Distinct delays of this schedule before it stays at its maximum.
    pub fn schedule_len(&self) -> u32 {
        let mut b = *self;
        b.current_ms = 0;
        let mut n = 0;
        loop {
            b.on_failure(0);
            n += 1;
            if b.current_ms >= b.max_ms {
                return n;
            }
        }
    }

    /// [`AcceptBackoff::schedule_len`] of the default configuration.
    pub fn steps() -> u32 {
        Self::from_config(&NetConfig::default()).schedule_len()
    }
}

/// What a failed `accept` means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AcceptFailure {
    /// Interrupted: try again at once.
    Retry,
    /// The connection vanished from the queue (ECONNABORTED, EPROTO, EPERM): it is
    /// counted; the next one is accepted at once.
    Dropped,
    /// Out of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM): the spare
    /// descriptor, then a backoff.
    Resources,
    /// Anything else: counted, and the listener backs off.
    Other,
}

/// Classifies an `accept` error (`WouldBlock` is not an error: the queue is empty).
pub(crate) fn classify_accept_error(err: &std::io::Error) -> AcceptFailure {
    match err.raw_os_error() {
        Some(libc::EINTR) => AcceptFailure::Retry,
        Some(libc::ECONNABORTED | libc::EPROTO | libc::EPERM) => AcceptFailure::Dropped,
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
            AcceptFailure::Resources
        }
        _ if err.kind() == std::io::ErrorKind::Interrupted => AcceptFailure::Retry,
        _ => AcceptFailure::Other,
    }
}

/// Why a listener refused a connection (the `reason` label of
/// `imrouter_accept_refused_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Over the shard's connection cap: accepted and reset.
    ConnCap,
    /// Out of descriptors: accepted with the spare descriptor and reset.
    FdLimit,
    /// Another accept error.
    Other,
}

/// One listening socket's accept state.
struct ListenerState {
    kind: Transport,
    /// A TLS listener's certificate and limits: its connections speak TLS first.
    tls: Option<TlsServer>,
    backoff: AcceptBackoff,
    /// Accepting is paused until then (a failed round's retry time).
    paused_until_ms: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    Handshake,
    /// Dialed; the TCP connect has not completed.
    Connecting,
    Open,
    Flushing,
    Lingering,
    Dead,
}

/// What a backend must do after a connection's queue drained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AfterFlush {
    /// Nothing (still open, or output left).
    Nothing,
    /// Shut down the write side; the connection lingers for the peer's close.
    Shutdown,
}

pub(crate) struct Conn {
    generation: u32,
    in_use: bool,
    pub(crate) phase: Phase,
    kind: Transport,
    peer: SocketAddr,
    /// Bytes for the handler: `input[input_start..]` is unconsumed.
    input: Vec<u8>,
    input_start: usize,
    /// WebSocket: received bytes not yet decoded (upgrade request or partial frame).
    raw: Vec<u8>,
    ws: WsDecoder,
    /// A connection of a TLS listener: rustls's state and the plaintext queued for
    /// it (the queues below then hold ciphertext only).
    tls: Option<Box<TlsConn>>,
    /// Output appended by sends; swapped into `out_cur` when that is written.
    out_next: Vec<u8>,
    /// Output being written: `out_cur[out_off..]` is unwritten. Backends may keep it
    /// referenced by in-flight IO: it is only touched through `out_*` calls.
    out_cur: Vec<u8>,
    out_off: usize,
    last_input_ms: u64,
    /// When the socket was accepted (dialed: when the dial started, then when its
    /// connect completed): the connect deadline counts from it.
    accepted_ms: u64,
    /// The handler called `mark_established` (the client authenticated): from then
    /// on only the idle timer applies.
    established: bool,
    linger_deadline_ms: u64,
    timer: Option<TimerHandle>,
    peer_eof: bool,
    readable_flag: bool,
    dirty_flag: bool,
    /// Accepted was reported and Closed was not yet.
    visible: bool,
    /// Closed is queued for the handler and not yet taken: the slot is not freed
    /// before the handler saw it (its input stays readable during that batch).
    closed_pending: bool,
}

impl Conn {
    fn empty() -> Self {
        Conn {
            generation: 0,
            in_use: false,
            phase: Phase::Dead,
            kind: Transport::Tcp,
            peer: SocketAddr::from(([127, 0, 0, 1], 0)),
            input: Vec::new(),
            input_start: 0,
            raw: Vec::new(),
            ws: WsDecoder::default(),
            tls: None,
            out_next: Vec::new(),
            out_cur: Vec::new(),
            out_off: 0,
            last_input_ms: 0,
            accepted_ms: 0,
            established: false,
            linger_deadline_ms: 0,
            timer: None,
            peer_eof: false,
            readable_flag: false,
            dirty_flag: false,
            visible: false,
            closed_pending: false,
        }
    }

    /// Queued output: ciphertext and, on a TLS connection, plaintext not yet sealed.
    fn out_len(&self) -> usize {
        self.out_cur.len() - self.out_off
            + self.out_next.len()
            + self.tls.as_ref().map_or(0, |t| t.plain.len())
    }

    /// Where output the core frames goes: the queue, or on a TLS connection the
    /// plaintext that [`Core::take_dirty`] seals into it.
    fn out_buf(&mut self) -> &mut Vec<u8> {
        match &mut self.tls {
            Some(t) => &mut t.plain,
            None => &mut self.out_next,
        }
    }

    fn unconsumed(&self) -> usize {
        self.input.len() - self.input_start
    }

    /// Moves unconsumed input to the front before appending.
    fn compact_input(&mut self) {
        if self.input_start > 0 {
            self.input.drain(..self.input_start);
            self.input_start = 0;
        }
    }
}

pub(crate) struct Core {
    pub(crate) cfg: NetConfig,
    /// What the backend may still deliver after it paused reading a connection.
    inbound_slack_bytes: usize,
    conns: Vec<Conn>,
    free: Vec<u32>,
    /// Slots in use, of every kind.
    live: usize,
    /// Of `live`, the inter-node links (`Transport::Rpc`): they have a cap of their
    /// own, `rpc_links_per_shard_max`, and never count in the clients'.
    live_links: usize,
    events: Vec<NetEvent>,
    dirty: Vec<u32>,
    dead: Vec<u32>,
    timers: TimerWheel<(u32, u32)>,
    /// Timers fired by one `advance` (reused).
    fired: Vec<(u32, u32)>,
    now_ms: u64,
    /// Queued output of every connection that is not dead, against
    /// `outbound_budget_bytes_per_shard`.
    out_total: usize,
    listeners: Vec<ListenerState>,
    /// TLS connections (index, generation) whose handshake input waits for the
    /// next poll's handshake budget.
    tls_deferred: Vec<(u32, u32)>,
    /// Handshake steps left in this poll (`[tls] handshakes_per_poll_max`, of the
    /// TLS listeners together; refilled by [`Core::advance`]).
    tls_budget: usize,
    tls_budget_max: usize,
    /// Plaintext decrypted by one receive (reused).
    tls_plain: Vec<u8>,
    /// Records rustls gave for one connection (reused).
    tls_records: Vec<u8>,
    pub(crate) stats: NetStats,
}

impl Core {
    /// `inbound_slack_bytes`: input the backend may still deliver after pausing.
    pub(crate) fn new(cfg: &NetConfig, inbound_slack_bytes: usize) -> Self {
        Core {
            cfg: cfg.clone(),
            inbound_slack_bytes,
            conns: Vec::new(),
            free: Vec::new(),
            live: 0,
            live_links: 0,
            events: Vec::new(),
            dirty: Vec::new(),
            dead: Vec::new(),
            // One timer per connection slot, clients' and links'.
            timers: TimerWheel::new(
                0,
                cfg.connections_per_shard_max + cfg.rpc_links_per_shard_max,
            ),
            fired: Vec::new(),
            now_ms: 0,
            out_total: 0,
            listeners: Vec::new(),
            tls_deferred: Vec::new(),
            tls_budget: 0,
            tls_budget_max: 0,
            tls_plain: Vec::new(),
            tls_records: Vec::new(),
            stats: NetStats::default(),
        }
    }

    /// Registers listener number `listeners.len()` (the backend's listener index).
    #[cfg(test)]
    pub(crate) fn add_listener(&mut self, kind: Transport) -> usize {
        self.add_listener_tls(kind, None)
    }

    /// [`Core::add_listener`] of a listener whose connections speak TLS first when
    /// `tls` is given (a WebSocket listener: `wss://`).
    pub(crate) fn add_listener_tls(&mut self, kind: Transport, tls: Option<TlsServer>) -> usize {
        if let Some(t) = &tls {
            self.tls_budget_max = self
                .tls_budget_max
                .max(t.config().handshakes_per_poll_max.max(1));
            self.tls_budget = self.tls_budget_max;
        }
        self.listeners.push(ListenerState {
            kind,
            tls,
            backoff: AcceptBackoff::from_config(&self.cfg),
            paused_until_ms: None,
        });
        self.listeners.len() - 1
    }

    fn listener_stats(&mut self, kind: Transport) -> &mut ListenerStats {
        match kind {
            Transport::Tcp => &mut self.stats.tcp,
            Transport::WebSocket => &mut self.stats.ws,
            Transport::Rpc => &mut self.stats.rpc,
        }
    }

    /// Whether listener `li` waits for its retry time.
    pub(crate) fn listener_paused(&self, li: usize) -> bool {
        self.listeners[li].paused_until_ms.is_some()
    }

    /// Listener `li` accepted a socket: its backoff starts over.
    pub(crate) fn accept_succeeded(&mut self, li: usize) {
        self.listeners[li].backoff.on_success();
    }

    /// Counts a connection listener `li` accepted and reset (or lost), by reason.
    pub(crate) fn accept_refused(&mut self, li: usize, why: Refusal) {
        let kind = self.listeners[li].kind;
        let s = self.listener_stats(kind);
        match why {
            Refusal::ConnCap => s.refused_conn_cap += 1,
            Refusal::FdLimit => s.refused_fd_limit += 1,
            Refusal::Other => s.refused_other += 1,
        }
    }

    /// An accept round of listener `li` failed (even with the spare descriptor):
    /// accepting pauses until the backoff's retry time, which
    /// [`Core::next_deadline_ms`] includes. Logged at powers of two.
    pub(crate) fn accept_failed(&mut self, li: usize, err: &std::io::Error) {
        if self.listeners[li].paused_until_ms.is_some() {
            // Another accept that was already in flight (io_uring): the same round.
            self.stats.accept_errors += 1;
            return;
        }
        let now = self.now_ms;
        let l = &mut self.listeners[li];
        let retry = l.backoff.on_failure(now);
        let delay = l.backoff.delay_ms();
        let kind = l.kind;
        if l.paused_until_ms.replace(retry).is_none() {
            self.listener_stats(kind).paused += 1;
        }
        let s = self.listener_stats(kind);
        s.accept_pauses += 1;
        if classify_accept_error(err) == AcceptFailure::Other {
            s.refused_other += 1;
        }
        self.stats.accept_errors += 1;
        let n = self.stats.accept_errors;
        if n.is_power_of_two() {
            tracing::warn!(
                error = %err,
                listener = ?kind,
                failures = n,
                retry_in_ms = delay,
                "accept failed: listener paused"
            );
        }
    }

    /// Listeners whose pause ended by `now_ms` (set by [`Core::advance`]): the
    /// backend accepts on them again (mio: until `WouldBlock`; io_uring: re-arms).
    pub(crate) fn take_resumed(&mut self, out: &mut Vec<usize>) {
        out.clear();
        let now = self.now_ms;
        for (li, l) in self.listeners.iter_mut().enumerate() {
            if l.paused_until_ms.is_some_and(|t| t <= now) {
                l.paused_until_ms = None;
                out.push(li);
                match l.kind {
                    Transport::Tcp => self.stats.tcp.paused -= 1,
                    Transport::WebSocket => self.stats.ws.paused -= 1,
                    Transport::Rpc => self.stats.rpc.paused -= 1,
                }
            }
        }
    }

    pub(crate) fn live(&self) -> usize {
        self.live
    }

    pub(crate) fn id(&self, idx: u32) -> ConnId {
        ConnId {
            index: idx,
            generation: self.conns[idx as usize].generation,
        }
    }

    fn lookup(&self, conn: ConnId) -> Option<usize> {
        let c = self.conns.get(conn.index as usize)?;
        (c.in_use && c.generation == conn.generation).then_some(conn.index as usize)
    }

    pub(crate) fn phase(&self, idx: u32) -> Phase {
        self.conns[idx as usize].phase
    }

    /// Whether the shard holds as many connections of `kind` as its cap allows:
    /// `connections_per_shard_max` client connections, `rpc_links_per_shard_max`
    /// inter-node links (neither counts in the other's cap).
    fn at_cap(&self, kind: Transport) -> bool {
        match kind {
            Transport::Rpc => self.live_links >= self.cfg.rpc_links_per_shard_max,
            Transport::Tcp | Transport::WebSocket => {
                self.live - self.live_links >= self.cfg.connections_per_shard_max
            }
        }
    }

    /// A new socket accepted by listener `li`. `None`: at the cap of its kind
    /// ([`Core::at_cap`]); counted as `conn_cap`, the caller resets it.
    pub(crate) fn alloc(&mut self, li: usize, peer: SocketAddr) -> Option<u32> {
        self.accept_succeeded(li);
        let kind = self.listeners[li].kind;
        if self.at_cap(kind) {
            self.stats.refused += 1;
            self.accept_refused(li, Refusal::ConnCap);
            return None;
        }
        self.listener_stats(kind).accepted += 1;
        let phase = match kind {
            Transport::WebSocket => Phase::Handshake,
            Transport::Tcp | Transport::Rpc => Phase::Open,
        };
        let deadline = self.cfg.idle_timeout_ms.min(self.cfg.connect_timeout_ms);
        let idx = self.take_slot(kind, peer, phase, deadline);
        if let Some(server) = &self.listeners[li].tls {
            match server.accept() {
                Ok(t) => self.conns[idx as usize].tls = Some(Box::new(t)),
                Err(e) => {
                    tracing::warn!(error = %e, "TLS connection could not be set up");
                    self.abort(idx, CloseReason::Tls);
                    return Some(idx);
                }
            }
        }
        if phase == Phase::Open {
            self.accept_visible(idx);
        }
        Some(idx)
    }

    /// Takes a free slot for a new connection in `phase`, its timer `deadline_in_ms`
    /// from now. The caller checked the connection cap.
    fn take_slot(
        &mut self,
        kind: Transport,
        peer: SocketAddr,
        phase: Phase,
        deadline_in_ms: u64,
    ) -> u32 {
        let idx = match self.free.pop() {
            Some(i) => i,
            None => {
                self.conns.push(Conn::empty());
                (self.conns.len() - 1) as u32
            }
        };
        self.live += 1;
        self.live_links += usize::from(kind == Transport::Rpc);
        let now = self.now_ms;
        let c = &mut self.conns[idx as usize];
        debug_assert!(!c.in_use);
        c.in_use = true;
        c.kind = kind;
        c.peer = peer;
        c.last_input_ms = now;
        c.accepted_ms = now;
        c.established = false;
        c.peer_eof = false;
        c.phase = phase;
        c.ws = WsDecoder::default();
        c.tls = None;
        c.timer = self
            .timers
            .insert(now + deadline_in_ms, (idx, c.generation))
            .ok();
        idx
    }

    /// Whether a dial (an inter-node link) may start: refused (counted, with an
    /// error naming the limit) when the shard holds `rpc_links_per_shard_max` links.
    /// Client connections do not count.
    pub(crate) fn reserve_dial(&mut self) -> io::Result<()> {
        if !self.at_cap(Transport::Rpc) {
            return Ok(());
        }
        self.stats.dials.refused_conn_cap += 1;
        Err(io::Error::new(
            io::ErrorKind::QuotaExceeded,
            format!(
                "link cap of the shard reached (rpc_links_per_shard_max = {})",
                self.cfg.rpc_links_per_shard_max
            ),
        ))
    }

    /// A dial to `peer` started (after [`Core::reserve_dial`] allowed it): a slot in
    /// `Connecting`, visible to the handler at once (its `Closed` is reported), closed
    /// with `ConnectTimeout` if not connected within `connect_timeout_ms`.
    pub(crate) fn alloc_dial(&mut self, peer: SocketAddr) -> u32 {
        debug_assert!(!self.at_cap(Transport::Rpc));
        self.stats.dials.started += 1;
        let deadline = self.cfg.connect_timeout_ms;
        let idx = self.take_slot(Transport::Rpc, peer, Phase::Connecting, deadline);
        self.conns[idx as usize].visible = true;
        idx
    }

    /// The dial of `idx` connected to `peer`: `Connected` is reported, queued output
    /// becomes writable, and the idle and connect deadlines count from now. Ignored
    /// unless `idx` is connecting.
    pub(crate) fn on_connected(&mut self, idx: u32, peer: SocketAddr) {
        let now = self.now_ms;
        let c = &mut self.conns[idx as usize];
        if c.phase != Phase::Connecting {
            return;
        }
        c.phase = Phase::Open;
        c.peer = peer;
        c.accepted_ms = now;
        c.last_input_ms = now;
        let (conn, queued) = (
            ConnId {
                index: idx,
                generation: c.generation,
            },
            c.out_len(),
        );
        self.stats.dials.connected += 1;
        self.events.push(NetEvent::Connected { conn, peer });
        if queued > 0 {
            self.mark_dirty(idx);
        }
    }

    /// The handler authenticated `conn` (CONNECT accepted): the connect deadline no
    /// longer applies, only the idle timer. No-op for a stale id.
    pub(crate) fn mark_established(&mut self, conn: ConnId) {
        if let Some(i) = self.lookup(conn) {
            self.conns[i].established = true;
        }
    }

    /// When an open connection is closed for silence, and why: `idle_timeout_ms`
    /// after its last input, or `connect_timeout_ms` after its accept while the
    /// handler has not marked it established (PINGs do not extend that one).
    fn open_deadline(&self, c: &Conn) -> (u64, CloseReason) {
        let idle = c.last_input_ms + self.cfg.idle_timeout_ms;
        let connect = c.accepted_ms + self.cfg.connect_timeout_ms;
        if !c.established && connect < idle {
            (connect, CloseReason::ConnectTimeout)
        } else {
            (idle, CloseReason::IdleTimeout)
        }
    }

    /// Makes room for `n` more queued bytes on `idx`: its own queue stays within
    /// `outbound_queue_bytes_max` (a link's: `rpc_outbound_queue_bytes_max`) and the
    /// shard's client connections' within `outbound_budget_bytes_per_shard`,
    /// closing the largest client queues (slow readers) until it fits. A link is
    /// never closed for the clients' budget, and its bytes are not charged to it
    /// (its bound is its own queue times `rpc_links_per_shard_max`). `false`: `idx`
    /// itself was closed.
    fn reserve_out(&mut self, idx: u32, n: usize) -> bool {
        let c = &self.conns[idx as usize];
        let link = c.kind == Transport::Rpc;
        let queue_max = if link {
            self.cfg.rpc_outbound_queue_bytes_max
        } else {
            self.cfg.outbound_queue_bytes_max
        };
        if c.out_len() + n > queue_max {
            tracing::warn!(
                conn = idx,
                peer = %c.peer,
                queued_bytes = c.out_len(),
                limit_bytes = queue_max,
                link,
                "outbound queue overflow: closing connection"
            );
            self.stats.outbound_overflow_closes += 1;
            self.abort(idx, CloseReason::OutboundOverflow);
            return false;
        }
        let budget = self.cfg.outbound_budget_bytes_per_shard;
        // The sum of every queue first: the clients' share is summed only past it.
        while !link && self.out_total + n > budget && self.clients_out_total() + n > budget {
            // The largest client queue, `idx` counted with what it is about to queue.
            let (mut victim, mut largest) = (idx, self.conns[idx as usize].out_len() + n);
            for (i, c) in self.conns.iter().enumerate() {
                let client = c.kind != Transport::Rpc;
                if client && c.in_use && c.phase != Phase::Dead && c.out_len() > largest {
                    (victim, largest) = (i as u32, c.out_len());
                }
            }
            let c = &self.conns[victim as usize];
            tracing::warn!(
                conn = victim,
                peer = %c.peer,
                queued_bytes = c.out_len(),
                shard_queued_bytes = self.out_total,
                budget_bytes = self.cfg.outbound_budget_bytes_per_shard,
                "outbound budget of the shard exhausted: closing the largest queue (slow reader)"
            );
            self.stats.slow_reader_closes += 1;
            self.abort(victim, CloseReason::SlowReader);
            if victim == idx {
                return false;
            }
        }
        self.out_total += n;
        true
    }

    /// Bytes appended to a closing connection's queue outside [`Core::reserve_out`]
    /// (a refused upgrade's answer or a close frame: at most ~100 bytes, once per
    /// connection, so the budget may be passed by that much per closing connection).
    fn queued_unchecked(&mut self, n: usize) {
        self.out_total += n;
    }

    /// Queued output of the shard (every connection not yet dead).
    pub(crate) fn outbound_total(&self) -> usize {
        self.out_total
    }

    /// Of [`Core::outbound_total`], the client connections' (what
    /// `outbound_budget_bytes_per_shard` bounds): the links' queues are summed, on
    /// the over-budget path only (a shard has a few dozen links at most).
    fn clients_out_total(&self) -> usize {
        let links: usize = (self.conns.iter())
            .filter(|c| c.in_use && c.kind == Transport::Rpc && c.phase != Phase::Dead)
            .map(Conn::out_len)
            .sum();
        self.out_total - links
    }

    fn accept_visible(&mut self, idx: u32) {
        let c = &mut self.conns[idx as usize];
        c.visible = true;
        self.stats.accepted += 1;
        self.events.push(NetEvent::Accepted {
            conn: ConnId {
                index: idx,
                generation: c.generation,
            },
            listener: c.kind,
            peer: c.peer,
        });
    }

    fn report_closed(&mut self, idx: u32, reason: CloseReason) {
        let c = &mut self.conns[idx as usize];
        if c.visible {
            c.visible = false;
            c.closed_pending = true;
            self.stats.closed += 1;
            self.events.push(NetEvent::Closed {
                conn: ConnId {
                    index: idx,
                    generation: c.generation,
                },
                reason,
            });
        }
    }

    fn mark_dirty(&mut self, idx: u32) {
        let c = &mut self.conns[idx as usize];
        if !c.dirty_flag {
            c.dirty_flag = true;
            self.dirty.push(idx);
        }
    }

    fn mark_readable(&mut self, idx: u32) {
        let c = &mut self.conns[idx as usize];
        if !c.readable_flag {
            c.readable_flag = true;
            self.events.push(NetEvent::Readable {
                conn: ConnId {
                    index: idx,
                    generation: c.generation,
                },
            });
        }
    }

    /// Closes at once: reports `reason`, the backend tears the socket down.
    pub(crate) fn abort(&mut self, idx: u32, reason: CloseReason) {
        self.report_closed(idx, reason);
        self.set_dead(idx);
    }

    fn set_dead(&mut self, idx: u32) {
        let c = &mut self.conns[idx as usize];
        if c.phase == Phase::Dead {
            return;
        }
        // A dead connection's output is never written: out of the budget now.
        self.out_total -= c.out_len();
        c.phase = Phase::Dead;
        if let Some(t) = c.timer.take() {
            self.timers.cancel(t);
        }
        self.dead.push(idx);
    }

    /// Graceful close: reports `reason`, queues a WebSocket close frame with
    /// `ws_code` (after the upgrade), flushes, then shuts down.
    fn begin_close(&mut self, idx: u32, reason: CloseReason, ws_code: u16) {
        self.report_closed(idx, reason);
        let linger = self.now_ms + self.cfg.close_linger_ms;
        let c = &mut self.conns[idx as usize];
        if !matches!(c.phase, Phase::Open | Phase::Handshake) {
            return;
        }
        let before = c.out_len();
        let tls_failed = c.tls.as_ref().is_some_and(|t| t.failed);
        if c.kind == Transport::WebSocket && c.phase == Phase::Open && !tls_failed {
            ws::write_close(c.out_buf(), ws_code);
        }
        let added = c.out_len() - before;
        c.phase = Phase::Flushing;
        c.linger_deadline_ms = linger;
        self.queued_unchecked(added);
        self.mark_dirty(idx);
    }

    /// The unconsumed input a connection of `kind` may hold: an inter-node link's
    /// frames are larger than a client's.
    pub(crate) fn inbound_max(&self, kind: Transport) -> usize {
        match kind {
            Transport::Rpc => self.cfg.rpc_inbound_buffer_bytes_max,
            Transport::Tcp | Transport::WebSocket => self.cfg.inbound_buffer_bytes_max,
        }
    }

    /// The unconsumed input of connection `id` at which its backend pauses reading,
    /// `read_bytes` (one read) below its limit.
    pub(crate) fn pause_bytes(&self, id: ConnId, read_bytes: usize) -> usize {
        let kind = self
            .conns
            .get(id.index())
            .map_or(Transport::Tcp, |c| c.kind);
        self.inbound_max(kind).saturating_sub(read_bytes).max(1)
    }

    /// Past this, connection `idx`'s input overflows: its limit plus what the
    /// backend may deliver after it paused.
    fn inbound_close_bytes(&self, idx: u32) -> usize {
        self.inbound_max(self.conns[idx as usize].kind)
            .saturating_add(self.inbound_slack_bytes)
    }

    /// Bytes received on connection `idx`.
    pub(crate) fn on_recv(&mut self, idx: u32, data: &[u8]) {
        self.stats.bytes_in += data.len() as u64;
        let now = self.now_ms;
        let c = &mut self.conns[idx as usize];
        c.last_input_ms = now;
        if c.tls.is_some() {
            self.tls_recv(idx, data);
        } else {
            self.on_plain(idx, data);
        }
    }

    /// Plaintext received on connection `idx` (on a TLS connection: decrypted).
    fn on_plain(&mut self, idx: u32, data: &[u8]) {
        let max_in = self.inbound_close_bytes(idx);
        let c = &mut self.conns[idx as usize];
        match (c.phase, c.kind) {
            (Phase::Open, Transport::Tcp | Transport::Rpc) => {
                if c.unconsumed() + data.len() > max_in {
                    self.abort(idx, CloseReason::InboundOverflow);
                    return;
                }
                c.compact_input();
                c.input.extend_from_slice(data);
                self.mark_readable(idx);
            }
            (Phase::Open, Transport::WebSocket) => {
                c.raw.extend_from_slice(data);
                self.decode_ws(idx);
            }
            (Phase::Handshake, _) => {
                c.raw.extend_from_slice(data);
                self.handshake(idx);
            }
            // Closing: input is discarded.
            _ => {}
        }
    }

    fn handshake(&mut self, idx: u32) {
        let max = self.cfg.ws_handshake_bytes_max;
        let c = &mut self.conns[idx as usize];
        match ws::handshake(&c.raw) {
            Handshake::Partial => {
                if c.raw.len() > max {
                    const TOO_LARGE: &[u8] =
                        b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\n\r\n";
                    c.out_buf().extend_from_slice(TOO_LARGE);
                    self.queued_unchecked(TOO_LARGE.len());
                    self.begin_close(idx, CloseReason::WebSocketProtocol, ws::CLOSE_PROTOCOL);
                }
            }
            Handshake::Reject(response) => {
                c.out_buf().extend_from_slice(&response);
                self.queued_unchecked(response.len());
                self.begin_close(idx, CloseReason::WebSocketProtocol, ws::CLOSE_PROTOCOL);
            }
            Handshake::Done { response, consumed } => {
                if !self.reserve_out(idx, response.len()) {
                    return;
                }
                let c = &mut self.conns[idx as usize];
                c.out_buf().extend_from_slice(&response);
                c.raw.drain(..consumed);
                c.phase = Phase::Open;
                self.mark_dirty(idx);
                self.accept_visible(idx);
                if !self.conns[idx as usize].raw.is_empty() {
                    self.decode_ws(idx);
                }
            }
        }
    }

    fn decode_ws(&mut self, idx: u32) {
        let msg_max = self.cfg.ws_message_bytes_max as u64;
        let max_in = self.inbound_close_bytes(idx);
        let c = &mut self.conns[idx as usize];
        c.compact_input();
        let before = c.input.len();
        let mut controls: Vec<WsControl> = Vec::new();
        let result =
            c.ws.decode(&c.raw, &mut c.input, msg_max, |ctl| controls.push(ctl));
        let grew = c.input.len() > before;
        let overflow = c.unconsumed() > max_in;
        match result {
            Ok(n) => {
                c.raw.drain(..n);
            }
            Err(ws::WsError(code)) => {
                c.raw.clear();
                if grew && !overflow {
                    self.mark_readable(idx);
                }
                self.begin_close(idx, CloseReason::WebSocketProtocol, code);
                return;
            }
        }
        if overflow {
            self.abort(idx, CloseReason::InboundOverflow);
            return;
        }
        if grew {
            self.mark_readable(idx);
        }
        for ctl in controls {
            match ctl {
                WsControl::Ping(payload) => {
                    // A PONG is output like any other: within the connection's and
                    // the shard's limits, or the connection closes.
                    if self.conns[idx as usize].phase == Phase::Open {
                        let n = ws::header_len(payload.len()) + payload.len();
                        if !self.reserve_out(idx, n) {
                            return;
                        }
                        ws::write_pong(self.conns[idx as usize].out_buf(), &payload);
                        self.mark_dirty(idx);
                    }
                }
                WsControl::Close(code) => {
                    // Echo the peer's code (RFC 6455 §5.5.1) if it may be sent on the
                    // wire, then close our side.
                    let code = match code {
                        None => ws::CLOSE_NORMAL,
                        Some(c) if ws::close_code_sendable(c) => c,
                        Some(_) => ws::CLOSE_PROTOCOL,
                    };
                    self.begin_close(idx, CloseReason::PeerClosed, code);
                    self.conns[idx as usize].peer_eof = true;
                }
            }
        }
    }

    /// The peer closed its side.
    pub(crate) fn on_eof(&mut self, idx: u32) {
        let c = &mut self.conns[idx as usize];
        c.peer_eof = true;
        match c.phase {
            Phase::Open => {
                // Flush what the handler queued, then close.
                self.report_closed(idx, CloseReason::PeerClosed);
                let c = &mut self.conns[idx as usize];
                c.phase = Phase::Flushing;
                c.linger_deadline_ms = self.now_ms + self.cfg.close_linger_ms;
                self.mark_dirty(idx);
            }
            Phase::Flushing => {}
            Phase::Handshake | Phase::Lingering => self.set_dead(idx),
            // Not read before connected; should a backend report it, the dial failed.
            Phase::Connecting => self.on_error(idx, io::ErrorKind::NotConnected),
            Phase::Dead => {}
        }
    }

    /// A socket error on connection `idx` (while connecting: the connect failed).
    pub(crate) fn on_error(&mut self, idx: u32, kind: std::io::ErrorKind) {
        if self.conns[idx as usize].phase == Phase::Connecting {
            self.stats.dials.failed += 1;
            self.abort(idx, CloseReason::ConnectFailed(kind));
        } else {
            self.abort(idx, CloseReason::Error(kind));
        }
    }

    /// Unwritten output of `idx`: the slice to write next (empty: nothing queued).
    /// The slice stays valid and unmoved until [`Core::out_advance`] consumed it.
    pub(crate) fn out_chunk(&mut self, idx: u32) -> &[u8] {
        let c = &mut self.conns[idx as usize];
        if c.out_off == c.out_cur.len() && !c.out_next.is_empty() {
            recycle(&mut c.out_cur);
            c.out_off = 0;
            std::mem::swap(&mut c.out_cur, &mut c.out_next);
        }
        &c.out_cur[c.out_off..]
    }

    /// Unwritten output of `idx` as two slices in order (for a vectored write).
    pub(crate) fn out_slices(&self, idx: u32) -> (&[u8], &[u8]) {
        let c = &self.conns[idx as usize];
        (&c.out_cur[c.out_off..], &c.out_next)
    }

    /// `n` bytes of the slices from [`Core::out_slices`] were written.
    pub(crate) fn out_advance_vectored(&mut self, idx: u32, n: usize) {
        let c = &mut self.conns[idx as usize];
        let cur_left = c.out_cur.len() - c.out_off;
        debug_assert!(n <= cur_left + c.out_next.len());
        if n <= cur_left {
            c.out_off += n;
        } else {
            // The current buffer is done; the next one becomes current.
            recycle(&mut c.out_cur);
            std::mem::swap(&mut c.out_cur, &mut c.out_next);
            c.out_off = (n - cur_left).min(c.out_cur.len());
        }
        if c.out_off == c.out_cur.len() {
            // Written out: a burst's buffer is released.
            recycle(&mut c.out_cur);
            c.out_off = 0;
        }
        if c.phase != Phase::Dead {
            self.out_total -= n;
        }
        self.stats.bytes_out += n as u64;
    }

    /// `n` bytes of the chunk from [`Core::out_chunk`] were written.
    pub(crate) fn out_advance(&mut self, idx: u32, n: usize) {
        let c = &mut self.conns[idx as usize];
        debug_assert!(c.out_off + n <= c.out_cur.len());
        let n = n.min(c.out_cur.len() - c.out_off);
        c.out_off += n;
        if c.out_off == c.out_cur.len() {
            // Written out (the send that referenced it completed): a burst's buffer
            // is released.
            recycle(&mut c.out_cur);
            c.out_off = 0;
        }
        if c.phase != Phase::Dead {
            self.out_total -= n;
        }
        self.stats.bytes_out += n as u64;
    }

    /// Called when `idx`'s queue is empty after writing: a flushing connection moves
    /// on to shutdown (or straight to dead when the peer already closed).
    pub(crate) fn after_flush(&mut self, idx: u32) -> AfterFlush {
        let c = &mut self.conns[idx as usize];
        if c.phase != Phase::Flushing || c.out_len() != 0 {
            return AfterFlush::Nothing;
        }
        if c.peer_eof {
            self.set_dead(idx);
            return AfterFlush::Nothing;
        }
        c.phase = Phase::Lingering;
        AfterFlush::Shutdown
    }

    /// Connections with output queued since the last call.
    /// TLS connections among them have their plaintext sealed into records now.
    pub(crate) fn take_dirty(&mut self, out: &mut Vec<u32>) {
        out.clear();
        std::mem::swap(out, &mut self.dirty);
        for &idx in out.iter() {
            self.conns[idx as usize].dirty_flag = false;
            if self.conns[idx as usize].tls.is_some() {
                self.tls_seal(idx);
            }
        }
    }

    /// Dead connections whose `Closed` event (if any) the handler has taken: the
    /// backend closes their sockets and calls [`Core::free`] when no IO references
    /// them. Others stay for a later call.
    pub(crate) fn take_dead(&mut self, out: &mut Vec<u32>) {
        out.clear();
        let conns = &self.conns;
        self.dead.retain(|&idx| {
            if conns[idx as usize].closed_pending {
                true
            } else {
                out.push(idx);
                false
            }
        });
    }

    /// Releases a dead slot; its id becomes stale.
    pub(crate) fn free(&mut self, idx: u32) {
        let c = &mut self.conns[idx as usize];
        debug_assert!(c.in_use && c.phase == Phase::Dead);
        c.in_use = false;
        c.generation = c.generation.wrapping_add(1);
        c.input = Vec::new();
        c.input_start = 0;
        c.raw = Vec::new();
        c.tls = None;
        c.out_next = Vec::new();
        c.out_cur = Vec::new();
        c.out_off = 0;
        c.readable_flag = false;
        c.dirty_flag = false;
        c.visible = false;
        c.closed_pending = false;
        let link = c.kind == Transport::Rpc;
        self.free.push(idx);
        self.live -= 1;
        self.live_links -= usize::from(link);
    }

    /// Moves events for the handler into `out`.
    pub(crate) fn take_events(&mut self, out: &mut Vec<NetEvent>) {
        for ev in self.events.drain(..) {
            match ev {
                NetEvent::Readable { conn } => {
                    self.conns[conn.index as usize].readable_flag = false
                }
                NetEvent::Closed { conn, .. } => {
                    self.conns[conn.index as usize].closed_pending = false
                }
                NetEvent::Accepted { .. } | NetEvent::Connected { .. } => {}
            }
            out.push(ev);
        }
    }

    pub(crate) fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// The earliest timer deadline, if any.
    /// Handshakes waiting for the next poll's budget make it now.
    pub(crate) fn next_deadline_ms(&self) -> Option<u64> {
        if !self.tls_deferred.is_empty() {
            return Some(self.now_ms);
        }
        let paused = self
            .listeners
            .iter()
            .filter_map(|l| l.paused_until_ms)
            .min();
        match (self.timers.next_deadline(), paused) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Sets the time used for new deadlines (call after a wait, before feeding IO),
    /// without firing timers. Never moves backward.
    pub(crate) fn set_now(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
    }

    /// Moves time to `now_ms` and fires idle and linger timers.
    /// Handshakes deferred by earlier polls go first, within this poll's budget,
    /// which is then refilled for the next poll.
    pub(crate) fn advance(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
        self.tls_run_deferred();
        self.tls_budget = self.tls_budget_max;
        let mut fired = std::mem::take(&mut self.fired);
        fired.clear();
        self.timers
            .advance(self.now_ms, |_, _, value| fired.push(value));
        for &(idx, generation) in &fired {
            let c = &mut self.conns[idx as usize];
            if !c.in_use || c.generation != generation {
                continue;
            }
            c.timer = None;
            let c = &self.conns[idx as usize];
            let (deadline, reason) = match c.phase {
                Phase::Handshake | Phase::Open => self.open_deadline(c),
                Phase::Connecting => (
                    c.accepted_ms + self.cfg.connect_timeout_ms,
                    CloseReason::ConnectTimeout,
                ),
                Phase::Flushing | Phase::Lingering => (c.linger_deadline_ms, CloseReason::Local),
                Phase::Dead => continue,
            };
            let c = &mut self.conns[idx as usize];
            if self.now_ms < deadline {
                c.timer = self.timers.insert(deadline, (idx, generation)).ok();
                continue;
            }
            if reason == CloseReason::ConnectTimeout {
                self.stats.connect_timeouts += 1;
            }
            match c.phase {
                Phase::Connecting => {
                    self.stats.dials.timed_out += 1;
                    self.abort(idx, reason);
                }
                Phase::Open => {
                    self.begin_close(idx, reason, ws::CLOSE_NORMAL);
                    // The linger timer.
                    let c = &mut self.conns[idx as usize];
                    c.timer = self
                        .timers
                        .insert(c.linger_deadline_ms, (idx, generation))
                        .ok();
                }
                _ => self.set_dead(idx),
            }
        }
        self.fired = fired;
    }

    pub(crate) fn input(&self, conn: ConnId) -> &[u8] {
        match self.lookup(conn) {
            Some(i) => &self.conns[i].input[self.conns[i].input_start..],
            None => &[],
        }
    }

    pub(crate) fn consume(&mut self, conn: ConnId, n: usize) {
        let Some(i) = self.lookup(conn) else { return };
        let c = &mut self.conns[i];
        c.input_start += n.min(c.unconsumed());
        if c.input_start == c.input.len() {
            c.input_start = 0;
            if c.input.capacity() > INPUT_KEEP_BYTES {
                c.input = Vec::new();
            } else {
                c.input.clear();
            }
        }
    }

    pub(crate) fn send(&mut self, conn: ConnId, bytes: &[u8]) -> Result<(), SendError> {
        self.send_as(conn, bytes, false)
    }

    /// Whether `conn` is a WebSocket connection whose messages are text (JSON-RPC).
    pub(crate) fn text_messages(&self, conn: ConnId) -> bool {
        self.lookup(conn).is_some_and(|i| {
            let c = &self.conns[i];
            c.kind == Transport::WebSocket && c.ws.mode() == ws::WsMode::Text
        })
    }

    /// Like [`Self::send`], as a text message on a WebSocket connection.
    pub(crate) fn send_text(&mut self, conn: ConnId, bytes: &[u8]) -> Result<(), SendError> {
        self.send_as(conn, bytes, true)
    }

    fn send_as(&mut self, conn: ConnId, bytes: &[u8], text: bool) -> Result<(), SendError> {
        let Some(i) = self.lookup(conn) else {
            return Err(SendError::Closed);
        };
        let c = &self.conns[i];
        if !matches!(c.phase, Phase::Open | Phase::Connecting) {
            return Err(SendError::Closed);
        }
        let framed = match c.kind {
            Transport::Tcp | Transport::Rpc => bytes.len(),
            Transport::WebSocket => ws::header_len(bytes.len()) + bytes.len(),
        };
        if !self.reserve_out(i as u32, framed) {
            return Err(SendError::Overflow);
        }
        let c = &mut self.conns[i];
        let kind = c.kind;
        let out = c.out_buf();
        match kind {
            Transport::Tcp | Transport::Rpc => out.extend_from_slice(bytes),
            Transport::WebSocket if text => ws::write_text(out, bytes),
            Transport::WebSocket => ws::write_binary(out, bytes),
        }
        // Queued while connecting: written once connected (`on_connected`).
        if c.phase == Phase::Open {
            self.mark_dirty(i as u32);
        }
        Ok(())
    }

    /// Graceful close of an open connection; a dial still connecting is abandoned at
    /// once (its queued output dropped). Both report `Closed { Local }`.
    pub(crate) fn close(&mut self, conn: ConnId) {
        let Some(i) = self.lookup(conn) else { return };
        match self.conns[i].phase {
            Phase::Open => self.begin_close(i as u32, CloseReason::Local, ws::CLOSE_NORMAL),
            Phase::Connecting => self.abort(i as u32, CloseReason::Local),
            _ => {}
        }
    }

    pub(crate) fn outbound_bytes(&self, conn: ConnId) -> usize {
        self.lookup(conn).map_or(0, |i| self.conns[i].out_len())
    }
}

/// The TLS layer of the core: a TLS listener's connections decrypt here into the
/// WebSocket layer above ([`Core::on_plain`]) and have their output sealed when the
/// backend takes the dirty list.
impl Core {
    /// Ciphertext received on TLS connection `idx`. While the handshake is in
    /// progress and this poll's handshake budget is spent, it waits (at most
    /// `[tls] handshake_bytes_max`) for a later poll.
    fn tls_recv(&mut self, idx: u32, data: &[u8]) {
        let budget_spent = self.tls_budget == 0;
        let c = &mut self.conns[idx as usize];
        if !matches!(c.phase, Phase::Handshake | Phase::Open) {
            return; // Closing: input is discarded.
        }
        let generation = c.generation;
        let Some(t) = c.tls.as_mut() else { return };
        let waiting = !t.deferred.is_empty();
        if waiting || (budget_spent && t.is_handshaking()) {
            if t.deferred.len() + data.len() > t.limits().handshake_bytes_max {
                self.tls_fail(idx, "handshake larger than [tls] handshake_bytes_max");
                return;
            }
            t.deferred.extend_from_slice(data);
            if !waiting {
                self.tls_deferred.push((idx, generation));
            }
            return;
        }
        self.tls_input(idx, data);
    }

    /// Runs the handshakes deferred by earlier polls, as far as the budget goes.
    fn tls_run_deferred(&mut self) {
        if self.tls_deferred.is_empty() {
            return;
        }
        let mut list = std::mem::take(&mut self.tls_deferred);
        let mut keep = 0;
        for i in 0..list.len() {
            let (idx, generation) = list[i];
            let c = &mut self.conns[idx as usize];
            if !c.in_use || c.generation != generation {
                continue;
            }
            let Some(t) = c.tls.as_mut() else { continue };
            if self.tls_budget == 0 {
                list[keep] = (idx, generation);
                keep += 1;
                continue;
            }
            let data = std::mem::take(&mut t.deferred);
            if matches!(c.phase, Phase::Handshake | Phase::Open) {
                self.tls_input(idx, &data);
            }
        }
        list.truncate(keep);
        // Connections deferred while running these (none: the budget was left) come
        // after the ones still waiting.
        list.append(&mut self.tls_deferred);
        self.tls_deferred = list;
    }

    /// Feeds ciphertext to rustls: the handshake's answer is queued, the plaintext
    /// goes up to the WebSocket layer, bad input closes the connection.
    fn tls_input(&mut self, idx: u32, data: &[u8]) {
        let mut plain = std::mem::take(&mut self.tls_plain);
        plain.clear();
        let Some(t) = self.conns[idx as usize].tls.as_mut() else {
            return;
        };
        if t.is_handshaking() {
            self.tls_budget = self.tls_budget.saturating_sub(1);
        }
        let result = t.receive(data, &mut plain);
        match result {
            Err(e) => {
                self.tls_plain = plain;
                self.tls_fail(idx, &e.to_string());
            }
            Ok(rx) => {
                if rx.handshake_done {
                    self.stats.tls_handshakes += 1;
                }
                if !self.tls_queue_records(idx) {
                    self.tls_plain = plain;
                    return;
                }
                if !plain.is_empty() {
                    self.on_plain(idx, &plain);
                }
                self.tls_plain = plain;
                if rx.peer_closed && self.conns[idx as usize].phase != Phase::Dead {
                    self.on_eof(idx);
                }
            }
        }
    }

    /// Queues the records rustls has to send (a handshake flight, an alert) within
    /// the connection's and the shard's output limits. `false`: `idx` was closed.
    fn tls_queue_records(&mut self, idx: u32) -> bool {
        let mut records = std::mem::take(&mut self.tls_records);
        let start = records.len();
        if let Some(t) = self.conns[idx as usize].tls.as_mut() {
            t.take_output(&mut records);
        }
        let n = records.len() - start;
        let ok = n == 0 || self.reserve_out(idx, n);
        if ok && n > 0 {
            self.conns[idx as usize]
                .out_next
                .extend_from_slice(&records[start..]);
            self.mark_dirty(idx);
        }
        records.truncate(start);
        self.tls_records = records;
        ok
    }

    /// Bad TLS input on `idx`: counted and logged (at powers of two of the shard's
    /// count), the alert rustls queued is sent and the connection closed; nothing
    /// else is affected.
    fn tls_fail(&mut self, idx: u32, why: &str) {
        self.stats.tls_failures += 1;
        let n = self.stats.tls_failures;
        let c = &mut self.conns[idx as usize];
        let peer = c.peer;
        let Some(t) = c.tls.as_mut() else { return };
        t.failed = true;
        t.deferred = Vec::new();
        let dropped = std::mem::take(&mut t.plain).len();
        let total = t.count_failure();
        self.out_total -= dropped;
        if n.is_power_of_two() {
            tracing::info!(%peer, error = why, failures = n, total, "bad TLS input: connection closed");
        } else {
            tracing::debug!(%peer, error = why, "bad TLS input: connection closed");
        }
        let c = &mut self.conns[idx as usize];
        if let Some(t) = c.tls.as_mut() {
            let before = c.out_next.len();
            t.take_output(&mut c.out_next);
            let added = c.out_next.len() - before;
            self.queued_unchecked(added);
        }
        self.begin_close(idx, CloseReason::Tls, ws::CLOSE_PROTOCOL);
    }

    /// Seals `idx`'s queued plaintext into records (and, once it is closing, a
    /// close_notify) at the end of its output queue. The records' overhead is
    /// reserved like any output (past the limits the connection is closed).
    fn tls_seal(&mut self, idx: u32) {
        let c = &mut self.conns[idx as usize];
        if matches!(c.phase, Phase::Dead | Phase::Lingering | Phase::Connecting) {
            return;
        }
        let closing = c.phase == Phase::Flushing;
        let Some(t) = c.tls.as_mut() else { return };
        let mut records = std::mem::take(&mut self.tls_records);
        records.clear();
        let taken = t.seal(closing, &mut records);
        // The plaintext left the queue; the records take its place.
        self.out_total -= taken;
        let n = records.len();
        if self.reserve_out(idx, n) {
            self.conns[idx as usize]
                .out_next
                .extend_from_slice(&records);
        }
        // A burst's buffer is not kept past one record batch's size.
        if records.capacity() > TLS_SCRATCH_KEEP_BYTES {
            records = Vec::new();
        }
        records.clear();
        self.tls_records = records;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::outbuf::OUTPUT_KEEP_BYTES;

    /// The listener indices of [`core`].
    const TCP: usize = 0;
    const WS: usize = 1;

    fn core(cfg: NetConfig) -> Core {
        let mut c = Core::new(&cfg, 0);
        assert_eq!(c.add_listener(Transport::Tcp), TCP);
        assert_eq!(c.add_listener(Transport::WebSocket), WS);
        c
    }

    fn peer() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 9))
    }

    #[test]
    fn stale_id_never_reaches_new_connection() {
        let mut c = core(NetConfig::default());
        let a = c.alloc(TCP, peer()).unwrap();
        let old = c.id(a);
        c.on_recv(a, b"xy");
        c.abort(a, CloseReason::Local);
        let mut dead = Vec::new();
        c.take_dead(&mut dead);
        assert!(dead.is_empty(), "not freed before the handler saw Closed");
        assert_eq!(c.input(old), b"xy", "input stays readable until freed");
        let mut ev = Vec::new();
        c.take_events(&mut ev);
        c.take_dead(&mut dead);
        assert_eq!(dead, vec![a]);
        c.free(a);
        let b = c.alloc(TCP, peer()).unwrap();
        assert_eq!(a, b, "slot reused");
        assert_ne!(c.id(b), old);
        assert_eq!(c.send(old, b"x"), Err(SendError::Closed));
        assert!(c.input(old).is_empty());
        c.on_recv(b, b"new");
        assert_eq!(c.input(c.id(b)), b"new");
    }

    #[test]
    fn outbound_overflow_closes_only_that_connection() {
        let mut c = core(NetConfig {
            outbound_queue_bytes_max: 10,
            ..NetConfig::default()
        });
        let a = c.alloc(TCP, peer()).unwrap();
        let b = c.alloc(TCP, peer()).unwrap();
        let (ia, ib) = (c.id(a), c.id(b));
        assert_eq!(c.send(ia, &[0; 8]), Ok(()));
        assert_eq!(c.send(ia, &[0; 3]), Err(SendError::Overflow));
        assert_eq!(c.send(ib, &[0; 10]), Ok(()));
        let mut ev = Vec::new();
        c.take_events(&mut ev);
        assert!(ev.contains(&NetEvent::Closed {
            conn: ia,
            reason: CloseReason::OutboundOverflow
        }));
        assert!(!ev
            .iter()
            .any(|e| matches!(e, NetEvent::Closed { conn, .. } if *conn == ib)));
    }

    #[test]
    fn idle_timer_fires_only_after_silence() {
        let mut c = core(NetConfig {
            idle_timeout_ms: 100,
            ..NetConfig::default()
        });
        let a = c.alloc(TCP, peer()).unwrap();
        let id = c.id(a);
        c.advance(60);
        c.on_recv(a, b"x");
        c.advance(120);
        let mut ev = Vec::new();
        c.take_events(&mut ev);
        assert!(!ev.iter().any(|e| matches!(e, NetEvent::Closed { .. })));
        c.advance(160);
        ev.clear();
        c.take_events(&mut ev);
        assert_eq!(
            ev,
            vec![NetEvent::Closed {
                conn: id,
                reason: CloseReason::IdleTimeout
            }]
        );
    }

    #[test]
    fn vectored_and_chunked_output_keep_order() {
        let mut c = core(NetConfig::default());
        let a = c.alloc(TCP, peer()).unwrap();
        let id = c.id(a);
        c.send(id, b"abc").unwrap();
        assert_eq!(c.out_chunk(a), b"abc");
        c.out_advance(a, 1);
        c.send(id, b"def").unwrap();
        assert_eq!(c.out_slices(a), (&b"bc"[..], &b"def"[..]));
        c.out_advance_vectored(a, 3);
        assert_eq!(c.out_slices(a), (&b"ef"[..], &b""[..]));
        c.send(id, b"g").unwrap();
        c.out_advance_vectored(a, 2);
        assert_eq!(c.out_chunk(a), b"g");
        c.out_advance(a, 1);
        assert_eq!(c.outbound_bytes(id), 0);
    }

    #[test]
    fn idle_deadline_counts_from_accept_after_a_long_park() {
        let mut c = core(NetConfig {
            idle_timeout_ms: 100,
            ..NetConfig::default()
        });
        c.advance(10);
        c.set_now(10_000); // The driver slept long; then a connection arrived.
        let a = c.alloc(TCP, peer()).unwrap();
        let id = c.id(a);
        let mut ev = Vec::new();
        c.take_events(&mut ev);
        c.advance(10_099);
        ev.clear();
        c.take_events(&mut ev);
        assert!(ev.is_empty(), "closed early: {ev:?}");
        c.advance(10_100);
        c.take_events(&mut ev);
        assert_eq!(
            ev,
            vec![NetEvent::Closed {
                conn: id,
                reason: CloseReason::IdleTimeout
            }]
        );
    }

    #[test]
    fn inbound_overflow_closes() {
        let mut c = core(NetConfig {
            inbound_buffer_bytes_max: 4,
            ..NetConfig::default()
        });
        let a = c.alloc(TCP, peer()).unwrap();
        c.on_recv(a, b"abc");
        c.consume(c.id(a), 2);
        c.on_recv(a, b"def");
        assert_eq!(c.input(c.id(a)), b"cdef");
        c.on_recv(a, b"g");
        assert_eq!(c.phase(a), Phase::Dead);
    }

    #[test]
    fn accept_backoff_doubles_to_its_maximum_and_resets_on_success() {
        let mut b = AcceptBackoff::new(10, 1_000);
        let retries: Vec<u64> = (0..10).map(|_| b.on_failure(5_000) - 5_000).collect();
        assert_eq!(
            retries,
            [10, 20, 40, 80, 160, 320, 640, 1_000, 1_000, 1_000]
        );
        assert_eq!(b.schedule_len(), 8);
        b.on_success();
        assert_eq!(b.delay_ms(), 0);
        assert_eq!(b.on_failure(7), 17, "a success starts the schedule again");
        assert_eq!(
            AcceptBackoff::steps(),
            8,
            "the default schedule: 10 ms .. 1 s"
        );
    }

    #[test]
    fn a_paused_listener_bounds_the_wait_and_resumes_at_its_retry_time() {
        let mut c = core(NetConfig::default());
        c.advance(100);
        let emfile = std::io::Error::from_raw_os_error(libc::EMFILE);
        c.accept_failed(TCP, &emfile);
        assert!(c.listener_paused(TCP));
        assert_eq!(c.next_deadline_ms(), Some(110));
        assert_eq!(c.stats.tcp.paused, 1);
        let mut resumed = Vec::new();
        c.advance(109);
        c.take_resumed(&mut resumed);
        assert!(resumed.is_empty());
        c.advance(110);
        c.take_resumed(&mut resumed);
        assert_eq!(resumed, vec![TCP]);
        assert!(!c.listener_paused(TCP));
        assert_eq!(c.stats.tcp.paused, 0);
        // Failing again doubles; a successful accept resets the schedule.
        c.accept_failed(TCP, &emfile);
        assert_eq!(c.next_deadline_ms(), Some(130));
        c.advance(130);
        c.take_resumed(&mut resumed);
        c.alloc(TCP, peer()).unwrap();
        c.accept_failed(TCP, &emfile);
        assert_eq!(c.next_deadline_ms(), Some(140));
        assert_eq!(c.stats.tcp.accept_pauses, 3);
        assert_eq!(c.stats.tcp.refused_other, 0, "EMFILE is not `other`");
    }

    #[test]
    fn over_the_cap_is_counted_per_listener() {
        let mut c = core(NetConfig {
            connections_per_shard_max: 1,
            ..NetConfig::default()
        });
        c.alloc(TCP, peer()).unwrap();
        assert_eq!(c.alloc(WS, peer()), None);
        assert_eq!(c.alloc(TCP, peer()), None);
        assert_eq!((c.stats.tcp.accepted, c.stats.tcp.refused_conn_cap), (1, 1));
        assert_eq!((c.stats.ws.accepted, c.stats.ws.refused_conn_cap), (0, 1));
    }

    /// A WebSocket connection after its upgrade (the 101 answer written out).
    fn ws_open(c: &mut Core) -> u32 {
        let a = c.alloc(WS, peer()).unwrap();
        c.on_recv(
            a,
            b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
              Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
        );
        assert_eq!(c.phase(a), Phase::Open);
        let n = c.out_chunk(a).len();
        c.out_advance(a, n);
        a
    }

    fn ping(payload: &[u8]) -> Vec<u8> {
        let mask = [1, 2, 3, 4];
        let mut f = vec![0x89, 0x80 | payload.len() as u8];
        f.extend_from_slice(&mask);
        f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        f
    }

    #[test]
    fn pings_without_connect_are_closed_at_the_connect_deadline() {
        let mut c = core(NetConfig {
            connect_timeout_ms: 1_000,
            idle_timeout_ms: 90_000,
            ..NetConfig::default()
        });
        let a = ws_open(&mut c);
        let id = c.id(a);
        let mut ev = Vec::new();
        for t in (100..1_000).step_by(100) {
            c.advance(t);
            c.on_recv(a, &ping(b"hi"));
            let n = c.out_chunk(a).len();
            c.out_advance(a, n);
        }
        c.take_events(&mut ev);
        assert!(!ev.iter().any(|e| matches!(e, NetEvent::Closed { .. })));
        c.advance(1_000);
        ev.clear();
        c.take_events(&mut ev);
        assert_eq!(
            ev,
            vec![NetEvent::Closed {
                conn: id,
                reason: CloseReason::ConnectTimeout
            }]
        );
        assert_eq!(c.stats.connect_timeouts, 1);
        // An established connection only has the idle timer.
        let b = c.alloc(TCP, peer()).unwrap();
        c.mark_established(c.id(b));
        c.advance(5_000);
        c.on_recv(b, b"x");
        c.advance(60_000);
        ev.clear();
        c.take_events(&mut ev);
        assert!(
            !ev.iter()
                .any(|e| matches!(e, NetEvent::Closed { conn, .. } if *conn == c.id(b))),
            "{ev:?}"
        );
    }

    #[test]
    fn pongs_count_against_the_outbound_limit() {
        let mut c = core(NetConfig {
            outbound_queue_bytes_max: 1_000,
            ..NetConfig::default()
        });
        let a = ws_open(&mut c);
        let id = c.id(a);
        let flood: Vec<u8> = (0..100).flat_map(|_| ping(&[7; 100])).collect();
        c.on_recv(a, &flood); // Never written: the peer does not read.
        assert!(c.outbound_bytes(id) <= 1_000);
        let mut ev = Vec::new();
        c.take_events(&mut ev);
        assert!(ev.contains(&NetEvent::Closed {
            conn: id,
            reason: CloseReason::OutboundOverflow
        }));
        assert_eq!(
            c.outbound_total(),
            0,
            "a dead connection's output leaves the budget"
        );
    }

    #[test]
    fn the_shard_budget_closes_the_largest_queue() {
        let mut c = core(NetConfig {
            outbound_queue_bytes_max: 1_000,
            outbound_budget_bytes_per_shard: 2_000,
            ..NetConfig::default()
        });
        let ids: Vec<ConnId> = (0..3)
            .map(|_| {
                let i = c.alloc(TCP, peer()).unwrap();
                c.id(i)
            })
            .collect();
        let mut ev = Vec::new();
        c.take_events(&mut ev);
        c.send(ids[0], &[0; 900]).unwrap();
        c.send(ids[1], &[0; 600]).unwrap();
        c.send(ids[2], &[0; 400]).unwrap();
        assert_eq!(c.outbound_total(), 1_900);
        // 200 more for the smallest queue: the largest (ids[0]) is closed for it.
        c.send(ids[2], &[0; 200]).unwrap();
        assert_eq!(c.outbound_total(), 1_200);
        assert_eq!(c.stats.slow_reader_closes, 1);
        ev.clear();
        c.take_events(&mut ev);
        assert_eq!(
            ev,
            vec![NetEvent::Closed {
                conn: ids[0],
                reason: CloseReason::SlowReader
            }]
        );
        // The sender itself when its queue would be the largest.
        let mut c = core(NetConfig {
            outbound_queue_bytes_max: 1_000,
            outbound_budget_bytes_per_shard: 1_500,
            ..NetConfig::default()
        });
        let (a, b) = (c.alloc(TCP, peer()).unwrap(), c.alloc(TCP, peer()).unwrap());
        let (a, b) = (c.id(a), c.id(b));
        c.send(a, &[0; 900]).unwrap();
        c.send(b, &[0; 600]).unwrap();
        assert_eq!(c.send(a, &[0; 50]), Err(SendError::Overflow));
        assert_eq!(c.outbound_total(), 600);
        assert_eq!(c.outbound_bytes(b), 600, "the smaller queue stays");
    }

    #[test]
    fn output_buffers_shrink_after_a_burst() {
        let mut c = core(NetConfig::default());
        let a = c.alloc(TCP, peer()).unwrap();
        let id = c.id(a);
        for _ in 0..64 {
            c.send(id, &[1; 16 * 1024]).unwrap();
        }
        assert!(c.outbound_total() >= 1 << 20);
        // Written in pieces, as a backend does.
        loop {
            let n = c.out_chunk(a).len().min(100_000);
            if n == 0 {
                break;
            }
            c.out_advance(a, n);
        }
        let conn = &c.conns[a as usize];
        assert_eq!(c.outbound_total(), 0);
        assert!(
            conn.out_cur.capacity() <= OUTPUT_KEEP_BYTES
                && conn.out_next.capacity() <= OUTPUT_KEEP_BYTES,
            "kept {} + {} bytes",
            conn.out_cur.capacity(),
            conn.out_next.capacity()
        );
        // Vectored writes (mio) too.
        c.send(id, &[1; 100_000]).unwrap();
        let _ = c.out_chunk(a);
        c.send(id, &[2; 100_000]).unwrap();
        c.out_advance_vectored(a, 150_000);
        c.out_advance_vectored(a, 50_000);
        let conn = &c.conns[a as usize];
        assert!(conn.out_cur.capacity() <= OUTPUT_KEEP_BYTES);
        assert!(conn.out_next.capacity() <= OUTPUT_KEEP_BYTES);
    }

    fn dial_cfg() -> NetConfig {
        NetConfig {
            connect_timeout_ms: 1_000,
            idle_timeout_ms: 5_000,
            ..NetConfig::default()
        }
    }

    fn events(c: &mut Core) -> Vec<NetEvent> {
        let mut ev = Vec::new();
        c.take_events(&mut ev);
        ev
    }

    #[test]
    fn a_dial_queues_output_until_connected_then_writes_it() {
        let mut c = core(dial_cfg());
        c.reserve_dial().unwrap();
        let a = c.alloc_dial(peer());
        let id = c.id(a);
        assert_eq!(c.phase(a), Phase::Connecting);
        c.send(id, b"hello ").unwrap();
        c.send(id, b"world").unwrap();
        assert_eq!(c.outbound_bytes(id), 11);
        assert_eq!(
            c.outbound_total(),
            11,
            "queued output counts against the budget"
        );
        let mut dirty = Vec::new();
        c.take_dirty(&mut dirty);
        assert!(
            dirty.is_empty(),
            "nothing is written before the connect completed"
        );
        assert!(events(&mut c).is_empty());
        let reached = SocketAddr::from(([127, 0, 0, 2], 7));
        c.on_connected(a, reached);
        assert_eq!(
            events(&mut c),
            vec![NetEvent::Connected {
                conn: id,
                peer: reached
            }]
        );
        c.take_dirty(&mut dirty);
        assert_eq!(dirty, vec![a]);
        assert_eq!(c.out_chunk(a), b"hello world");
        c.out_advance(a, 11);
        // Raw TCP both ways once open.
        c.on_recv(a, b"pong");
        assert_eq!(c.input(id), b"pong");
        assert_eq!(events(&mut c), vec![NetEvent::Readable { conn: id }]);
        assert_eq!((c.stats.dials.started, c.stats.dials.connected), (1, 1));
    }

    #[test]
    fn a_dial_not_connected_in_time_is_closed_by_the_hand_driven_clock() {
        let mut c = core(dial_cfg());
        c.advance(500);
        c.reserve_dial().unwrap();
        let a = c.alloc_dial(peer());
        let id = c.id(a);
        c.send(id, &[1; 100]).unwrap();
        c.advance(1_499);
        assert!(events(&mut c).is_empty());
        c.advance(1_500);
        assert_eq!(
            events(&mut c),
            vec![NetEvent::Closed {
                conn: id,
                reason: CloseReason::ConnectTimeout
            }]
        );
        assert_eq!(c.phase(a), Phase::Dead);
        assert_eq!(c.outbound_total(), 0, "its queued output left the budget");
        assert_eq!((c.stats.dials.timed_out, c.stats.connect_timeouts), (1, 1));
        let mut dead = Vec::new();
        c.take_dead(&mut dead);
        assert_eq!(dead, vec![a]);
        c.free(a);
        assert_eq!(c.live(), 0);
        assert_eq!(c.send(id, b"x"), Err(SendError::Closed));
    }

    #[test]
    fn a_failed_dial_reports_one_close_with_the_error() {
        let mut c = core(dial_cfg());
        c.reserve_dial().unwrap();
        let a = c.alloc_dial(peer());
        let id = c.id(a);
        c.on_error(a, std::io::ErrorKind::ConnectionRefused);
        c.advance(10_000); // Its timer is gone: no second Closed.
        assert_eq!(
            events(&mut c),
            vec![NetEvent::Closed {
                conn: id,
                reason: CloseReason::ConnectFailed(std::io::ErrorKind::ConnectionRefused)
            }]
        );
        assert_eq!(c.stats.dials.failed, 1);
        // After it connected, an error is an ordinary one.
        c.reserve_dial().unwrap();
        let b = c.alloc_dial(peer());
        c.on_connected(b, peer());
        c.on_error(b, std::io::ErrorKind::ConnectionReset);
        assert_eq!(
            events(&mut c).last(),
            Some(&NetEvent::Closed {
                conn: c.id(b),
                reason: CloseReason::Error(std::io::ErrorKind::ConnectionReset)
            })
        );
    }

    #[test]
    fn a_connected_dial_has_the_handshake_and_idle_deadlines() {
        let mut c = core(dial_cfg());
        c.reserve_dial().unwrap();
        let a = c.alloc_dial(peer());
        let id = c.id(a);
        c.advance(900);
        c.on_connected(a, peer());
        events(&mut c);
        // Not established: closed connect_timeout_ms after Connected, not after the dial.
        c.advance(1_899);
        assert!(events(&mut c).is_empty());
        c.advance(1_900);
        assert_eq!(
            events(&mut c),
            vec![NetEvent::Closed {
                conn: id,
                reason: CloseReason::ConnectTimeout
            }]
        );
        assert_eq!(c.stats.dials.timed_out, 0, "it did connect");
        // Established: only the idle timer.
        c.reserve_dial().unwrap();
        let b = c.alloc_dial(peer());
        let id = c.id(b);
        c.on_connected(b, peer());
        c.mark_established(id);
        events(&mut c);
        c.advance(1_900 + 4_999);
        assert!(events(&mut c).is_empty());
        c.advance(1_900 + 5_000);
        assert_eq!(
            events(&mut c),
            vec![NetEvent::Closed {
                conn: id,
                reason: CloseReason::IdleTimeout
            }]
        );
    }

    /// Issue "Cluster defects found in a review…", item 2: links (dialed and
    /// accepted) have a cap of their own; clients at theirs never keep a peer from
    /// linking, and links never take a client's place.
    #[test]
    fn links_and_clients_have_caps_of_their_own() {
        let mut c = core(NetConfig {
            connections_per_shard_max: 2,
            rpc_links_per_shard_max: 2,
            ..dial_cfg()
        });
        let rpc = c.add_listener(Transport::Rpc);
        c.alloc(TCP, peer()).unwrap();
        c.alloc(WS, peer()).unwrap();
        assert_eq!(c.alloc(TCP, peer()), None, "the clients' cap");
        c.reserve_dial().unwrap();
        let a = c.alloc_dial(peer());
        c.alloc(rpc, peer())
            .expect("a link beside clients at their cap");
        let err = c.reserve_dial().unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::QuotaExceeded);
        assert!(err.to_string().contains("rpc_links_per_shard_max = 2"));
        assert_eq!(c.alloc(rpc, peer()), None, "the dial holds a link's slot");
        assert_eq!(
            (
                c.stats.dials.refused_conn_cap,
                c.stats.rpc.refused_conn_cap,
                c.stats.tcp.refused_conn_cap
            ),
            (1, 1, 1)
        );
        // Closing the dial before it connected abandons it and frees its slot.
        let id = c.id(a);
        c.send(id, b"dropped").unwrap();
        c.close(id);
        assert_eq!(
            events(&mut c).last(),
            Some(&NetEvent::Closed {
                conn: id,
                reason: CloseReason::Local
            })
        );
        assert_eq!(c.outbound_total(), 0);
        let mut dead = Vec::new();
        c.take_dead(&mut dead);
        assert_eq!(dead, vec![a]);
        c.free(a);
        c.reserve_dial().unwrap();
        assert_eq!(
            c.alloc(WS, peer()),
            None,
            "a freed link is no client's slot"
        );
    }

    /// Item 2: a link's queue has its own limit and is neither charged to the
    /// clients' budget nor closed to make room in it: a client past the budget
    /// closes the largest client queue, though the link's is larger.
    #[test]
    fn a_link_is_never_closed_for_the_clients_budget() {
        let mut c = core(NetConfig {
            outbound_queue_bytes_max: 3_000,
            outbound_budget_bytes_per_shard: 4_000,
            rpc_outbound_queue_bytes_max: 10_000,
            ..dial_cfg()
        });
        c.reserve_dial().unwrap();
        let link = c.alloc_dial(peer());
        c.on_connected(link, peer());
        let link = c.id(link);
        c.send(link, &[0; 9_000])
            .expect("within the link's own queue");
        let a = c.alloc(TCP, peer()).unwrap();
        let b = c.alloc(TCP, peer()).unwrap();
        let (a, b) = (c.id(a), c.id(b));
        c.send(a, &[0; 2_500]).unwrap();
        c.send(b, &[0; 1_000]).unwrap();
        c.send(b, &[0; 1_000]).unwrap();
        let closed: Vec<(ConnId, CloseReason)> = events(&mut c)
            .into_iter()
            .filter_map(|e| match e {
                NetEvent::Closed { conn, reason } => Some((conn, reason)),
                _ => None,
            })
            .collect();
        assert_eq!(closed, vec![(a, CloseReason::SlowReader)]);
        assert_eq!(c.outbound_total(), 9_000 + 2_000);
        assert_eq!(
            c.send(link, &[0; 1_001]),
            Err(super::super::SendError::Overflow),
            "past the link's own queue"
        );
        assert_eq!(c.stats.outbound_overflow_closes, 1);
    }

    #[test]
    fn an_rpc_listener_reports_its_kind_and_carries_raw_bytes() {
        let mut c = core(NetConfig::default());
        let rpc = c.add_listener(Transport::Rpc);
        let a = c.alloc(rpc, peer()).unwrap();
        let id = c.id(a);
        c.on_recv(a, b"GET / HTTP/1.1\r\n\r\n"); // Never a WebSocket upgrade.
        assert_eq!(
            events(&mut c),
            vec![
                NetEvent::Accepted {
                    conn: id,
                    listener: Transport::Rpc,
                    peer: peer()
                },
                NetEvent::Readable { conn: id }
            ]
        );
        c.send(id, b"raw").unwrap();
        assert_eq!(c.out_chunk(a), b"raw");
        assert_eq!((c.stats.rpc.accepted, c.stats.tcp.accepted), (1, 0));
    }

    /// The budget's running total equals the queued output of the live connections.
    fn assert_out_total(c: &Core) {
        let sum: usize = c
            .conns
            .iter()
            .filter(|x| x.in_use && x.phase != Phase::Dead)
            .map(Conn::out_len)
            .sum();
        assert_eq!(c.outbound_total(), sum);
    }

    /// A WebSocket upgrade request.
    const WS_UPGRADE: &[u8] = b"GET / HTTP/1.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
                                Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
                                Sec-WebSocket-Version: 13\r\n\r\n";

    /// Does one random operation on `c`: accept (TCP, or WebSocket and upgrade) or
    /// dial, send, a PING (answered with a PONG), a partial write (a dial: its connect
    /// completes instead), a partial vectored write, a close / EOF / error, or the
    /// backend's collection of events and dead slots.
    fn random_op(c: &mut Core, rnd: &mut impl FnMut(u64) -> u64, ev: &mut Vec<NetEvent>) {
        let live: Vec<u32> = (0..c.conns.len() as u32)
            .filter(|&i| c.conns[i as usize].in_use)
            .collect();
        let pick = |r: u64| live.get(r as usize % live.len().max(1)).copied();
        match rnd(8) {
            0 if rnd(3) == 0 => {
                if c.reserve_dial().is_ok() {
                    c.alloc_dial(peer());
                }
            }
            0 => {
                let li = if rnd(2) == 0 { TCP } else { WS };
                if let Some(i) = c.alloc(li, peer()) {
                    if li == WS {
                        c.on_recv(i, WS_UPGRADE);
                    }
                }
            }
            1 | 2 => {
                if let Some(i) = pick(rnd(1000)) {
                    let _ = c.send(c.id(i), &vec![0; rnd(1500) as usize]);
                }
            }
            3 => {
                if let Some(i) = pick(rnd(1000)) {
                    if c.phase(i) == Phase::Open && c.conns[i as usize].kind == Transport::WebSocket
                    {
                        c.on_recv(i, &ping(&[1; 100]));
                    }
                }
            }
            4 => {
                if let Some(i) = pick(rnd(1000)) {
                    if c.phase(i) == Phase::Connecting {
                        c.on_connected(i, peer());
                        return;
                    }
                    let n = c.out_chunk(i).len();
                    let w = rnd(n as u64 + 1) as usize;
                    c.out_advance(i, w);
                }
            }
            5 => {
                if let Some(i) = pick(rnd(1000)).filter(|&i| c.phase(i) != Phase::Connecting) {
                    let (a, b) = c.out_slices(i);
                    let n = a.len() + b.len();
                    let w = rnd(n as u64 + 1) as usize;
                    c.out_advance_vectored(i, w);
                }
            }
            6 => {
                if let Some(i) = pick(rnd(1000)) {
                    match rnd(3) {
                        0 => c.close(c.id(i)),
                        1 => c.on_eof(i),
                        _ => c.on_error(i, std::io::ErrorKind::BrokenPipe),
                    }
                }
            }
            _ => {
                c.take_events(ev);
                ev.clear();
                let mut dead = Vec::new();
                c.take_dead(&mut dead);
                for &i in &dead {
                    c.free(i);
                }
            }
        }
    }

    #[test]
    fn the_output_budget_total_stays_exact_under_random_operations() {
        for seed in 1..=200u64 {
            let mut x = seed;
            let mut rnd = move |n: u64| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % n
            };
            let mut c = core(NetConfig {
                outbound_queue_bytes_max: 3_000,
                outbound_budget_bytes_per_shard: 8_000,
                rpc_outbound_queue_bytes_max: 3_000,
                ..NetConfig::default()
            });
            let mut ev = Vec::new();
            for step in 0..400 {
                random_op(&mut c, &mut rnd, &mut ev);
                let total = c.clients_out_total();
                // Close frames may pass the budget, by a few bytes per closing one.
                let closing = c
                    .conns
                    .iter()
                    .filter(|x| x.in_use && x.phase == Phase::Flushing)
                    .count();
                assert!(
                    total <= 8_000 + 4 * closing,
                    "seed {seed} step {step}: over budget {total}"
                );
                let sum: usize = c
                    .conns
                    .iter()
                    .filter(|x| x.in_use && x.phase != Phase::Dead)
                    .map(Conn::out_len)
                    .sum();
                assert_eq!(c.outbound_total(), sum, "seed {seed} step {step}");
            }
            assert_out_total(&c);
        }
    }
}

#[cfg(test)]
#[path = "core_tls_tests.rs"]
mod tls_tests;
