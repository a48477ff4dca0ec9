//! The load client: one pinned event loop per worker thread, many connections per
//! loop, open-loop SENDs at fixed rates with the intended send time in the payload,
//! exact per-message accounting of every expected RECV.
//!
//! Event loop: each worker's connections are sockets of the node's own driver,
//! `net::io::NetDriver` (made with `NetDriver::dialer`: raw byte streams, no
//! listener), on its io_uring backend (`IoMode::Uring`, the default; mio where the
//! kernel refuses io_uring) or its mio/epoll one (`IoMode::Epoll`), for the connect
//! phase and the send phase alike. The connections themselves ([`Conn`]) are
//! sans-IO: the bytes of a connection's input go to its codecs, what they queue goes
//! to the driver's `send`. One loop turn: the sends that are due are made, then one
//! driver poll writes every connection's queued output (io_uring: one
//! `io_uring_enter`, at most one send in flight per connection), waits until the next
//! intended send (`NetDriver::poll_until`: to the microsecond on both backends) or
//! at most [`POLL_MAX`], and reads. The clock is read once per poll: every RECV of
//! that batch gets the same arrival time (the reads of one wait arrived together),
//! is decoded and counted, and its RECVACK queued; a connection's RECVACKs of one
//! batch leave in one send.
//!
//! The harness shares the machine with the node, so its CPU per RECV is kept low: no
//! per-read allocation (a batch is decoded in place from the driver's input, only an
//! incomplete tail is kept by the connection), the shared RECV counter published
//! once per loop turn, and on io_uring no syscall per RECV at all (one
//! `io_uring_enter` per turn carries them).
//!
//! Phases of a run ([`run`]): every worker connects its share of the clients (bounded
//! concurrency, CONNACK latency recorded) → barrier → the caller's hook measures the
//! idle connected state (RSS per connection) → the send phase at the planned rates →
//! a bounded drain → stop. Latency is always measured from the *intended* send time of
//! a message (coordinated-omission correction): a late send is charged to the message.
//!
//! Accounting: message `idx` expects `fanout` RECVs (set when it is sent, cleared when
//! its SENDACK fails); every RECV adds one to `received[idx]`. After the run,
//! `missing = Σ max(expected - received, 0)` and `extra = Σ max(received - expected, 0)`:
//! nothing is silently ignored.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use net::io::{Backend, CloseReason, ConnId, NetConfig, NetDriver, NetEvent};
use proto::crypto::SessionCipher;
use proto::wkproto::{
    ChannelType, ConnackPacket, Flags, Frame, RecvPacket, SendPacket, SendackPacket, Setting,
};
use shard::runtime::Driver;

use crate::conn::Wire;
use crate::conn::{
    client_key, ClientKey, Conn, ConnCtx, ConnError, ConnState, Transport, RX_CAPACITY_MAX_BYTES,
    TX_CAPACITY_MAX_BYTES,
};
use crate::jsonrpc;
use crate::peer::{self, PeerRole};
use crate::tls::ClientTls;

/// Messages one run may plan (sizes the accounting arrays: 8 bytes each).
pub const MAX_MESSAGES: u64 = 64 << 20;
/// SENDs without SENDACK kept per connection; past it a SEND is not made (counted).
pub const MAX_INFLIGHT_PER_CONN: usize = 1 << 16;
/// Smallest payload: intended time (8), message index (8), class (1).
pub const PAYLOAD_HEADER_BYTES: usize = 17;
/// Longest a loop blocks in poll (it re-checks the stop flag this often).
const POLL_MAX: Duration = Duration::from_millis(5);
/// Longest the connect phase blocks in poll while connects are paced (`connect_rate`).
const PACED_POLL_MAX: Duration = Duration::from_millis(1);
/// From the end of the connect phase to the first intended send: the workers are
/// released from the barrier in between.
const SEND_LEAD: Duration = Duration::from_millis(20);
/// Highest latency a histogram holds (longer values are clamped and counted).
pub const HIST_MAX_NS: u64 = 120_000_000_000;

/// What kind of traffic a message belongs to (one histogram pair per class).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Class {
    Person = 0,
    Group = 1,
}

/// Number of [`Class`] values.
pub const CLASSES: usize = 2;

impl Class {
    fn from_u8(b: u8) -> Option<Class> {
        match b {
            0 => Some(Class::Person),
            1 => Some(Class::Group),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Class::Person => "person",
            Class::Group => "group",
        }
    }
}

/// One client of the run.
#[derive(Clone)]
pub struct ClientSpec {
    pub uid: String,
    pub token: String,
    pub addr: SocketAddr,
    /// A peer server's client (Redis, NATS) instead of a wkproto one.
    pub peer: Option<PeerRole>,
}

/// A sender and where it sends.
#[derive(Clone, Debug)]
pub struct Route {
    /// Index into [`Plan::clients`].
    pub client: usize,
    pub channel_id: String,
    pub channel_type: u8,
    /// RECVs one message on this route must produce.
    pub fanout: u32,
}

/// One open-loop stream of messages.
#[derive(Clone, Debug)]
pub struct Schedule {
    pub class: Class,
    /// Messages per second over all routes.
    pub rate_per_s: f64,
    /// Messages go round-robin over a worker's routes.
    pub routes: Vec<Route>,
}

/// Everything a run does.
#[derive(Clone)]
pub struct Plan {
    pub clients: Vec<ClientSpec>,
    pub schedules: Vec<Schedule>,
}

/// The backend of the workers' drivers (`net::io::NetDriver`), for both phases.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IoMode {
    /// The mio (epoll) backend: readiness, then `read` and `write` calls per
    /// connection.
    Epoll,
    /// The io_uring backend: multishot recvs and sends carried by one
    /// `io_uring_enter` per loop turn (falls back to mio where the kernel refuses
    /// io_uring).
    Uring,
}

/// How a run is driven.
#[derive(Clone, Debug)]
pub struct LoadConfig {
    pub transport: Transport,
    /// `wss://`: TLS around the WebSocket (`transport` must be WebSocket).
    pub tls: Option<ClientTls>,
    /// JSON-RPC text messages instead of wkproto (`transport` must be WebSocket).
    pub jsonrpc: bool,
    /// The workers' driver backend.
    pub io: IoMode,
    /// Encrypted SENDs, decrypted RECVs with msg_key checks, client-side key agreement.
    pub encrypt: bool,
    pub threads: usize,
    /// Pin worker `i` to core `i % cores`.
    pub pin: bool,
    pub duration: Duration,
    pub drain: Duration,
    pub payload_bytes: usize,
    /// CONNECTs in progress at once, over all workers.
    pub connect_concurrency: usize,
    /// New connections per second over all workers (open loop: each client's
    /// CONNACK latency runs from its intended start, so a harness that falls behind
    /// is charged for it); `None`: as fast as `connect_concurrency` allows.
    pub connect_rate: Option<f64>,
    pub connect_timeout: Duration,
    /// Wake this long before each intended send and poll without blocking until it is
    /// due (zero: rely on the timer alone). Costs harness CPU, cuts its send lag.
    pub spin: Duration,
    /// Print a progress line every second on stderr.
    pub progress: bool,
}

/// Error counters of a run (all must be zero in a clean run).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Errors {
    pub connect_failed: u64,
    /// CONNACK reason → count (reason != 1).
    pub connack_reasons: HashMap<u8, u64>,
    /// SENDACK reason → count (reason != 1 and != 22).
    pub sendack_reasons: HashMap<u8, u64>,
    /// SENDs the node refused with SENDACK 22 (RateLimit: its credits or delivery
    /// backlog were full): the node's retryable answer to overload, counted apart and
    /// not an error (a client retries them; their RECVs are not expected).
    pub sendack_rate_limited: u64,
    /// SENDs never acknowledged by the end of the drain.
    pub sendack_missing: u64,
    /// SENDs not made: the sender was not connected or had too many in flight.
    pub sends_skipped: u64,
    pub msg_key_mismatch: u64,
    pub decrypt_failed: u64,
    /// RECVs whose payload is not one of this run's messages.
    pub foreign_recvs: u64,
    pub disconnects: u64,
    pub conn_errors: u64,
    pub unexpected_frames: u64,
}

impl Errors {
    fn merge(&mut self, o: &Errors) {
        self.connect_failed += o.connect_failed;
        for (k, v) in &o.connack_reasons {
            *self.connack_reasons.entry(*k).or_default() += v;
        }
        for (k, v) in &o.sendack_reasons {
            *self.sendack_reasons.entry(*k).or_default() += v;
        }
        self.sendack_missing += o.sendack_missing;
        self.sendack_rate_limited += o.sendack_rate_limited;
        self.sends_skipped += o.sends_skipped;
        self.msg_key_mismatch += o.msg_key_mismatch;
        self.decrypt_failed += o.decrypt_failed;
        self.foreign_recvs += o.foreign_recvs;
        self.disconnects += o.disconnects;
        self.conn_errors += o.conn_errors;
        self.unexpected_frames += o.unexpected_frames;
    }

    /// Counts a SENDACK whose reason is not success: 22 (RateLimit) is a refusal
    /// under overload, any other reason an error.
    pub fn count_sendack_refusal(&mut self, reason: u8) {
        if reason == 22 {
            self.sendack_rate_limited += 1;
        } else {
            *self.sendack_reasons.entry(reason).or_default() += 1;
        }
    }

    /// Sum of every error counter (SENDACK 22 refusals are not errors).
    pub fn total(&self) -> u64 {
        self.connect_failed
            + self.connack_reasons.values().sum::<u64>()
            + self.sendack_reasons.values().sum::<u64>()
            + self.sendack_missing
            + self.sends_skipped
            + self.msg_key_mismatch
            + self.decrypt_failed
            + self.foreign_recvs
            + self.disconnects
            + self.conn_errors
            + self.unexpected_frames
    }
}

/// A latency histogram in nanoseconds.
pub fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, HIST_MAX_NS, 3).unwrap_or_else(|_| Histogram::new(3).unwrap())
}

/// What a run measured.
pub struct Outcome {
    pub connect: Histogram<u64>,
    /// How late the harness made each SEND after its intended time (its own lag).
    pub send_lag: Histogram<u64>,
    pub sendack: [Histogram<u64>; CLASSES],
    pub recv: [Histogram<u64>; CLASSES],
    pub errors: Errors,
    pub clients: usize,
    pub connected: u64,
    /// From the first CONNECT to the last CONNACK.
    pub connect_phase: Duration,
    pub sent: [u64; CLASSES],
    pub expected: [u64; CLASSES],
    pub delivered: [u64; CLASSES],
    pub missing: [u64; CLASSES],
    /// RECVs beyond the expected count (duplicates).
    pub extra: [u64; CLASSES],
    /// RECVs carrying the DUP flag (server re-sends).
    pub dup_flagged: u64,
    /// From the first intended send to the last delivery or the drain's end.
    pub send_phase: Duration,
    /// Whether the drain ended with every expected RECV in.
    pub drained: bool,
    /// CPU seconds of the worker threads in the connect phase and the send phase.
    pub harness_cpu_connect_s: f64,
    pub harness_cpu_send_s: f64,
    /// Workers whose driver ran on io_uring (the others used mio/epoll).
    pub uring_workers: usize,
    pub workers: usize,
    /// Read batches (a connection's input of one driver poll) and sends handed to
    /// the driver in the send phase (and drain), over all connections: RECVs per
    /// read and per write show how much of the harness's work per RECV was shared by
    /// several RECVs.
    pub send_phase_reads: u64,
    pub send_phase_writes: u64,
}

struct Shared {
    start: Instant,
    send_start_ns: AtomicU64,
    stop: AtomicBool,
    expected: Vec<AtomicU32>,
    received: Vec<AtomicU32>,
    sent: AtomicU64,
    acked: AtomicU64,
    expected_total: AtomicU64,
    received_total: AtomicU64,
    done_sending: AtomicU64,
    connect_slots: Vec<usize>,
    barrier: Barrier,
}

impl Shared {
    #[inline]
    fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    /// Message `idx` is sent and expects `fanout` RECVs.
    fn expect(&self, idx: u64, fanout: u32) {
        if let Some(e) = self.expected.get(idx as usize) {
            e.store(fanout, Ordering::Relaxed);
        }
        self.expected_total
            .fetch_add(u64::from(fanout), Ordering::Relaxed);
        self.sent.fetch_add(1, Ordering::Relaxed);
    }

    /// Message `idx` was refused: its `fanout` RECVs are no longer expected.
    fn withdraw(&self, idx: u64, fanout: u32) {
        if let Some(e) = self.expected.get(idx as usize) {
            e.store(0, Ordering::Relaxed);
        }
        self.expected_total
            .fetch_sub(u64::from(fanout), Ordering::Relaxed);
    }
}

struct WRoute {
    slot: usize,
    channel_id: String,
    channel_type: u8,
    fanout: u32,
}

struct WSchedule {
    class: Class,
    interval_ns: f64,
    offset_ns: u64,
    count: u64,
    base: u64,
    next: u64,
    routes: Vec<WRoute>,
}

impl WSchedule {
    fn intended(&self, start_ns: u64, k: u64) -> u64 {
        start_ns + self.offset_ns + (k as f64 * self.interval_ns) as u64
    }
}

struct Inflight {
    intended_ns: u64,
    idx: u64,
    class: Class,
    fanout: u32,
}

struct Slot {
    spec: ClientSpec,
    key: ClientKey,
    conn: Option<Conn>,
    /// Its connection in the worker's driver (`None`: not dialed, or closed).
    id: Option<ConnId>,
    inflight: HashMap<u32, Inflight>,
}

struct Stats {
    connect: Histogram<u64>,
    send_lag: Histogram<u64>,
    sendack: [Histogram<u64>; CLASSES],
    recv: [Histogram<u64>; CLASSES],
    errors: Errors,
    dup_flagged: u64,
    /// RECVs counted since the last poll batch, not yet added to
    /// `Shared::received_total` (published once per batch).
    recvs_unpublished: u64,
    /// The worker's driver ran on io_uring.
    uring: bool,
    /// Read batches and sends of the connections (`Conn::reads`/`writes`) closed so
    /// far.
    closed_reads: u64,
    closed_writes: u64,
    connected: u64,
    first_connect_ns: u64,
    last_connack_ns: u64,
}

struct Worker {
    id: usize,
    shared: Arc<Shared>,
    cfg: LoadConfig,
    slots: Vec<Slot>,
    schedules: Vec<WSchedule>,
    stats: Stats,
    /// The worker's connections' sockets: the node's own driver, on io_uring or
    /// mio (`IoMode`), dialing only.
    net: NetDriver,
    /// The driver's reports of one turn (reused).
    events: Vec<NetEvent>,
    /// Driver connection index ([`ConnId::index`]) → slot (`usize::MAX`: none).
    owner: Vec<usize>,
    plain: Vec<u8>,
    bufs: SendBufs,
}

/// The reused buffers of a worker's SENDs.
#[derive(Default)]
struct SendBufs {
    payload: Vec<u8>,
    sealed: Vec<u8>,
    frame: Vec<u8>,
}

impl SendBufs {
    /// Encodes `msg` as a SEND on `route` from `conn` into `frame` (encrypted when
    /// `cfg.encrypt`): its payload carries the intended time, index and class, padded
    /// to `cfg.payload_bytes`. Returns its client_seq; None if it cannot be encoded.
    fn encode(
        &mut self,
        conn: &mut Conn,
        route: &WRoute,
        msg: &Inflight,
        cfg: &LoadConfig,
    ) -> Option<u32> {
        self.payload.clear();
        self.payload
            .extend_from_slice(&msg.intended_ns.to_le_bytes());
        self.payload.extend_from_slice(&msg.idx.to_le_bytes());
        self.payload.push(msg.class as u8);
        self.payload
            .resize(cfg.payload_bytes.max(PAYLOAD_HEADER_BYTES), b'x');
        if let Some(proto) = conn.peer {
            self.frame.clear();
            peer::encode_publish(proto, &route.channel_id, &self.payload, &mut self.frame);
            conn.client_seq = conn.client_seq.wrapping_add(1);
            return Some(conn.client_seq);
        }
        let mut msg_no_buf = [0u8; 20];
        if conn.jsonrpc {
            let seq = conn.client_seq.wrapping_add(1).max(1);
            self.frame.clear();
            let msg_no = fmt_u64(msg.idx, &mut msg_no_buf);
            jsonrpc::encode_send(
                seq,
                msg_no,
                &route.channel_id,
                route.channel_type,
                &self.payload,
                &mut self.frame,
            );
            conn.client_seq = seq;
            return Some(seq);
        }
        let mut p = SendPacket {
            setting: Setting::NO_ENCRYPT,
            client_seq: conn.client_seq.wrapping_add(1),
            client_msg_no: fmt_u64(msg.idx, &mut msg_no_buf),
            channel_id: &route.channel_id,
            channel_type: ChannelType(route.channel_type),
            payload: &self.payload,
            ..Default::default()
        };
        let key;
        if cfg.encrypt {
            let cipher = conn.cipher.as_ref()?;
            self.sealed.clear();
            cipher.encrypt_into(&self.payload, &mut self.sealed);
            p.setting = Setting::NONE;
            p.payload = &self.sealed;
            key = cipher.send_msg_key(&p);
            p.msg_key = key.as_str();
        }
        self.frame.clear();
        p.encode(conn.version, &mut self.frame).ok()?;
        conn.client_seq = p.client_seq;
        Some(p.client_seq)
    }
}

/// CPU time of the calling thread.
pub fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid clock id and a valid out pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn record(h: &mut Histogram<u64>, ns: u64) {
    h.saturating_record(ns.clamp(1, HIST_MAX_NS));
}

impl Worker {
    /// The slot of driver connection `id`, if it is still the one the slot dialed.
    fn slot_of(&self, id: ConnId) -> Option<usize> {
        let i = *self.owner.get(id.index())?;
        (self.slots.get(i)?.id == Some(id)).then_some(i)
    }

    /// Forgets connection `i` (its counts kept) and closes its driver connection
    /// (gracefully: what is queued still leaves).
    fn close(&mut self, i: usize) {
        if let Some(c) = self.slots[i].conn.take() {
            self.stats.closed_reads += c.reads;
            self.stats.closed_writes += c.writes;
        }
        if let Some(id) = self.slots[i].id.take() {
            self.net.close(id);
        }
    }

    /// Read batches and sends of every connection of this worker so far, open or
    /// closed.
    fn io_counts(&self) -> (u64, u64) {
        self.slots.iter().filter_map(|s| s.conn.as_ref()).fold(
            (self.stats.closed_reads, self.stats.closed_writes),
            |a, c| (a.0 + c.reads, a.1 + c.writes),
        )
    }

    /// Hands what connection `i` has queued to the driver (written by its next
    /// poll, in one batch with every other connection's output).
    fn flush_conn(&mut self, i: usize) -> Result<(), ConnError> {
        let slot = &mut self.slots[i];
        let (Some(conn), Some(id)) = (slot.conn.as_mut(), slot.id) else {
            return Ok(());
        };
        let out = conn.output()?;
        if out.is_empty() {
            return Ok(());
        }
        let sent = self.net.send(id, out);
        conn.output_taken();
        sent.map_err(|e| ConnError::Io(io::Error::other(e)))
    }

    /// Counts and reports a failed connection `i`, then closes it.
    fn conn_failed(&mut self, i: usize, e: ConnError) {
        let Some(conn) = self.slots[i].conn.as_ref() else {
            return;
        };
        let closed = conn.state == ConnState::Closed;
        if conn.state == ConnState::AwaitConnack || conn.state == ConnState::WsUpgrade {
            self.stats.errors.connect_failed += 1;
        } else if !matches!(e, ConnError::Eof) || !closed {
            self.stats.errors.conn_errors += 1;
        }
        if self.stats.errors.conn_errors + self.stats.errors.connect_failed <= 3 {
            eprintln!(
                "imbench: worker {}: {}: {e}",
                self.id, self.slots[i].spec.uid
            );
        }
        self.close(i);
    }

    /// Hands the input the driver holds for connection `i` (`id`), read in the batch
    /// taken at `now`, to its frames, consumes it, then sends what the frames queued
    /// (RECVACKs).
    fn on_input(&mut self, i: usize, id: ConnId, now: u64) -> Result<(), ConnError> {
        let Some(Slot {
            conn: Some(conn),
            inflight,
            ..
        }) = self.slots.get_mut(i)
        else {
            return Ok(());
        };
        let mut frames = Frames {
            shared: &self.shared,
            stats: &mut self.stats,
            inflight,
            plain: &mut self.plain,
            connect_started_ns: conn.connect_started_ns,
            encrypt: self.cfg.encrypt,
        };
        let mut sink = |ctx: &mut ConnCtx<'_>, f: Frame<'_>| frames.on_frame(ctx, f);
        let data = self.net.input(id);
        let n = data.len();
        let r = conn.on_bytes(data, now, &mut sink);
        self.net.consume(id, n);
        r?;
        self.flush_conn(i)
    }

    /// Closes connection `i` when `result` is an error (counted) or when its frames
    /// closed it (refused, disconnected).
    fn after_io(&mut self, i: usize, result: Result<(), ConnError>) {
        match result {
            Err(e) => self.conn_failed(i, e),
            Ok(()) => {
                let closed = self.slots.get(i).and_then(|s| s.conn.as_ref());
                if closed.is_some_and(|c| c.state == ConnState::Closed) {
                    self.close(i);
                }
            }
        }
    }

    /// One turn of the loop: the driver writes what was queued, waits (until
    /// `until_ns`, ns since the run's start, to the microsecond; else at most
    /// `max`), and reads; then what it reported is handled with one clock read for
    /// the whole batch (the reads of one wait arrived together, right before it
    /// returned: each RECV's latency is taken once per batch).
    fn turn(&mut self, until_ns: Option<u64>, max: Duration) {
        let mut events = std::mem::take(&mut self.events);
        events.clear();
        let polled = match until_ns {
            Some(t) => {
                let deadline = self.shared.start + Duration::from_nanos(t);
                self.net.poll_until(deadline, &mut events)
            }
            None => self.net.poll(Some(max), &mut events),
        };
        if polled.is_err_and(|e| e.kind() != io::ErrorKind::Interrupted) {
            self.stats.errors.conn_errors += 1;
        }
        let now = self.shared.now_ns();
        for &ev in &events {
            match ev {
                NetEvent::Connected { conn, .. } => {
                    // The harness times its CONNECTs itself.
                    self.net.mark_established(conn);
                }
                NetEvent::Readable { conn } => {
                    if let Some(i) = self.slot_of(conn) {
                        let r = self.on_input(i, conn, now);
                        self.after_io(i, r);
                    }
                }
                NetEvent::Closed { conn, reason } => {
                    if let Some(i) = self.slot_of(conn) {
                        self.slots[i].id = None;
                        self.conn_failed(i, closed_error(reason));
                    }
                }
                NetEvent::Accepted { .. } => {}
            }
        }
        self.events = events;
        self.publish_recvs();
    }

    /// One shared-counter update per loop turn, not one per RECV.
    fn publish_recvs(&mut self) {
        let n = std::mem::take(&mut self.stats.recvs_unpublished);
        if n > 0 {
            self.shared.received_total.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Connects every client of this worker with at most `concurrency` in progress.
    fn connect_phase(&mut self, concurrency: usize) {
        let deadline = self.shared.now_ns() + self.cfg.connect_timeout.as_nanos() as u64;
        let mut next = 0usize;
        let total = self.slots.len();
        // This worker's share of the rate: its clients evenly spaced from the run's
        // start, the workers' interleaved (worker w offset by w / rate).
        let threads = self.shared.connect_slots.len().max(1) as f64;
        let paced = self.cfg.connect_rate.filter(|r| *r > 0.0).map(|r| {
            let offset = (1e9 * self.id as f64 / r) as u64;
            (offset, 1e9 * threads / r)
        });
        let wire = Wire {
            transport: self.cfg.transport,
            tls: self.cfg.tls.clone(),
            jsonrpc: self.cfg.jsonrpc,
        };
        loop {
            let in_progress = self.connects_in_progress();
            if next == total && in_progress == 0 {
                break;
            }
            if self.shared.now_ns() > deadline {
                self.connects_timed_out(in_progress + (total - next));
                break;
            }
            let mut free = concurrency.saturating_sub(in_progress);
            while free > 0 && next < total {
                let now = self.shared.now_ns();
                let started_ns = match paced {
                    Some((t0, interval)) => {
                        let due = t0 + (next as f64 * interval) as u64;
                        if due > now {
                            break;
                        }
                        due
                    }
                    None => now,
                };
                let i = next;
                next += 1;
                free -= 1;
                self.start_client(i, &wire, started_ns);
            }
            let wait = if paced.is_some() && next < total {
                PACED_POLL_MAX
            } else {
                POLL_MAX
            };
            self.turn(None, wait);
        }
    }

    /// Connections waiting for their upgrade or CONNACK.
    fn connects_in_progress(&self) -> usize {
        (self.slots.iter())
            .filter(|s| {
                s.conn.as_ref().is_some_and(|c| {
                    matches!(c.state, ConnState::AwaitConnack | ConnState::WsUpgrade)
                })
            })
            .count()
    }

    /// The connect phase ran out of time: the `stuck` connects (in progress or not
    /// started) are counted failed, and every connection not active is closed.
    fn connects_timed_out(&mut self, stuck: usize) {
        self.stats.errors.connect_failed += stuck as u64;
        eprintln!("imbench: worker {}: {stuck} connects timed out", self.id);
        for i in 0..self.slots.len() {
            if self.slots[i]
                .conn
                .as_ref()
                .is_some_and(|c| c.state != ConnState::Active)
            {
                self.close(i);
            }
        }
    }

    /// Starts client `i`'s connection: dials it and queues its greeting (its CONNACK
    /// latency runs from `started_ns`); a failure is counted.
    fn start_client(&mut self, i: usize, wire: &Wire, started_ns: u64) {
        if self.stats.first_connect_ns == 0 {
            self.stats.first_connect_ns = started_ns.max(1);
        }
        let s = &self.slots[i];
        let addr = s.spec.addr;
        let started = match &s.spec.peer {
            Some(role) => Conn::new_peer(addr, role, started_ns),
            None => Conn::new(addr, wire, &s.spec.uid, &s.spec.token, &s.key, started_ns),
        }
        .and_then(|c| Ok((c, self.net.connect(addr)?)));
        let (conn, id) = match started {
            Ok(x) => x,
            Err(e) => {
                if self.stats.errors.connect_failed < 3 {
                    eprintln!("imbench: connect: {e}");
                }
                self.stats.errors.connect_failed += 1;
                return;
            }
        };
        if self.owner.len() <= id.index() {
            self.owner.resize(id.index() + 1, usize::MAX);
        }
        self.owner[id.index()] = i;
        self.slots[i].conn = Some(conn);
        self.slots[i].id = Some(id);
        // Queued by the driver until the TCP connect completes.
        if let Err(e) = self.flush_conn(i) {
            self.conn_failed(i, e);
        }
    }

    /// Sends message `k` of schedule `s` (intended at `intended_ns`) on its route,
    /// or counts it as skipped (sender not connected, too many in flight).
    fn send_one(&mut self, s: usize, k: u64, intended_ns: u64) {
        let sched = &self.schedules[s];
        let route = &sched.routes[(k % sched.routes.len() as u64) as usize];
        let msg = Inflight {
            intended_ns,
            idx: sched.base + k,
            class: sched.class,
            fanout: route.fanout,
        };
        let (i, idx, fanout) = (route.slot, msg.idx, msg.fanout);
        let slot = &mut self.slots[i];
        let conn = match slot.conn.as_mut() {
            Some(c)
                if c.state == ConnState::Active && slot.inflight.len() < MAX_INFLIGHT_PER_CONN =>
            {
                c
            }
            _ => {
                self.stats.errors.sends_skipped += 1;
                return;
            }
        };
        let Some(seq) = self.bufs.encode(conn, route, &msg, &self.cfg) else {
            self.stats.errors.sends_skipped += 1;
            return;
        };
        self.shared.expect(idx, fanout);
        if conn.peer.is_some_and(|p| !p.acks_publish()) {
            // No answer will come (NATS): acknowledged once written.
            self.shared.acked.fetch_add(1, Ordering::Relaxed);
        } else {
            slot.inflight.insert(seq, msg);
        }
        record(
            &mut self.stats.send_lag,
            self.shared.now_ns().saturating_sub(intended_ns),
        );
        let frame = &self.bufs.frame;
        let r = conn
            .queue(|out| out.extend_from_slice(frame))
            .and_then(|_| self.flush_conn(i));
        if r.is_err() {
            self.stats.errors.conn_errors += 1;
            self.close(i);
        }
    }

    /// Makes every send of the schedules that is due by now; returns the intended
    /// time of the next one (`u64::MAX`: none left).
    fn send_due(&mut self, start_ns: u64) -> u64 {
        let mut next_wake = u64::MAX;
        let now = self.shared.now_ns();
        for s in 0..self.schedules.len() {
            loop {
                let sc = &self.schedules[s];
                if sc.next >= sc.count {
                    break;
                }
                let k = sc.next;
                let t = sc.intended(start_ns, k);
                if t > now {
                    next_wake = next_wake.min(t);
                    break;
                }
                self.schedules[s].next += 1;
                self.send_one(s, k, t);
            }
        }
        next_wake
    }

    /// Sends at the planned times until the run stops: each turn makes the sends
    /// that are due, then waits for IO until the next one (less the spin window,
    /// polled without blocking) or at most [`POLL_MAX`].
    fn send_phase(&mut self) {
        let start_ns = self.shared.send_start_ns.load(Ordering::Acquire);
        let mut sending = !self.schedules.is_empty();
        if !sending {
            self.shared.done_sending.fetch_add(1, Ordering::AcqRel);
        }
        let spin_ns = self.cfg.spin.as_nanos() as u64;
        while !self.shared.stop.load(Ordering::Acquire) {
            let mut next_wake = u64::MAX;
            if sending {
                next_wake = self.send_due(start_ns);
                if next_wake == u64::MAX {
                    sending = false;
                    self.shared.done_sending.fetch_add(1, Ordering::AcqRel);
                }
            }
            if next_wake == u64::MAX {
                self.turn(None, POLL_MAX);
                continue;
            }
            let wait = next_wake.saturating_sub(self.shared.now_ns());
            if wait == 0 {
                continue;
            }
            if wait <= spin_ns {
                // Within the spin window: poll without blocking until the send is due
                // (a timer wakeup alone is late by tens of µs on a busy VM).
                self.turn(None, Duration::ZERO);
            } else if wait - spin_ns < POLL_MAX.as_nanos() as u64 {
                self.turn(Some(next_wake - spin_ns), POLL_MAX);
            } else {
                self.turn(None, POLL_MAX);
            }
        }
    }
}

/// What a driver's `Closed` means to the harness's counting (`PeerClosed` is the
/// end of stream, counted only where the connection was not expected to close).
fn closed_error(reason: CloseReason) -> ConnError {
    match reason {
        CloseReason::PeerClosed => ConnError::Eof,
        CloseReason::Error(kind) | CloseReason::ConnectFailed(kind) => {
            ConnError::Io(io::Error::from(kind))
        }
        CloseReason::ConnectTimeout => ConnError::Io(io::Error::from(io::ErrorKind::TimedOut)),
        CloseReason::OutboundOverflow | CloseReason::InboundOverflow => ConnError::BufferFull,
        other => ConnError::Protocol(format!("closed by the driver: {other:?}")),
    }
}

/// Decimal text of `v` in `buf`.
fn fmt_u64(mut v: u64, buf: &mut [u8; 20]) -> &str {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    std::str::from_utf8(&buf[i..]).unwrap_or("0")
}

/// What the frames of one connection update: the worker's counters and the
/// connection's SENDs in flight.
struct Frames<'a> {
    shared: &'a Shared,
    stats: &'a mut Stats,
    inflight: &'a mut HashMap<u32, Inflight>,
    /// Decryption scratch (reused).
    plain: &'a mut Vec<u8>,
    connect_started_ns: u64,
    encrypt: bool,
}

impl Frames<'_> {
    fn on_frame(&mut self, ctx: &mut ConnCtx<'_>, f: Frame<'_>) {
        match f {
            Frame::Connack(c) => self.on_connack(ctx, &c),
            Frame::Sendack(a) => self.on_sendack(ctx.read_ns, &a),
            Frame::Recv(r) => self.on_recv(ctx, &r),
            Frame::Disconnect(_) => {
                self.stats.errors.disconnects += 1;
                *ctx.state = ConnState::Closed;
            }
            Frame::Pong => {}
            _ => self.stats.errors.unexpected_frames += 1,
        }
    }

    /// Success activates the connection (after the key agreement when encrypting)
    /// and records the CONNECT→CONNACK latency; a refusal is counted by reason.
    fn on_connack(&mut self, ctx: &mut ConnCtx<'_>, c: &ConnackPacket<'_>) {
        let now = ctx.read_ns;
        if c.reason_code.0 != 1 {
            let reasons = &mut self.stats.errors.connack_reasons;
            *reasons.entry(c.reason_code.0).or_default() += 1;
            *ctx.state = ConnState::Closed;
            return;
        }
        if self.encrypt {
            if let Err(e) = ctx.agree(c.server_key, c.salt) {
                eprintln!("imbench: key agreement: {e}");
                self.stats.errors.connect_failed += 1;
                *ctx.state = ConnState::Closed;
                return;
            }
        }
        *ctx.state = ConnState::Active;
        self.stats.connected += 1;
        self.stats.last_connack_ns = now;
        record(
            &mut self.stats.connect,
            now.saturating_sub(self.connect_started_ns),
        );
    }

    /// Records the SENDACK latency; a refusal withdraws the message's expected RECVs.
    fn on_sendack(&mut self, now: u64, a: &SendackPacket) {
        let Some(m) = self.inflight.remove(&a.client_seq) else {
            self.stats.errors.unexpected_frames += 1;
            return;
        };
        record(
            &mut self.stats.sendack[m.class as usize],
            now.saturating_sub(m.intended_ns),
        );
        self.shared.acked.fetch_add(1, Ordering::Relaxed);
        if a.reason_code.0 != 1 {
            self.stats.errors.count_sendack_refusal(a.reason_code.0);
            self.shared.withdraw(m.idx, m.fanout);
        }
    }

    /// Opens and counts a RECV (latency from its intended send time), and queues
    /// its RECVACK.
    fn on_recv(&mut self, ctx: &mut ConnCtx<'_>, r: &RecvPacket<'_>) {
        let errors = &mut self.stats.errors;
        let Some(payload) = open_recv(ctx.cipher.as_ref(), r, self.plain, errors) else {
            return;
        };
        match parse_payload(payload, self.shared.received.len()) {
            Some((t, idx, class)) => {
                self.shared.received[idx as usize].fetch_add(1, Ordering::Relaxed);
                self.stats.recvs_unpublished += 1;
                record(
                    &mut self.stats.recv[class as usize],
                    ctx.read_ns.saturating_sub(t),
                );
            }
            None => self.stats.errors.foreign_recvs += 1,
        }
        if r.flags.contains(Flags::DUP) {
            self.stats.dup_flagged += 1;
        }
        if ctx.recvack {
            ctx.recvack(r.message_id, r.message_seq);
        }
    }
}

/// The plaintext of a RECV: its payload (NoEncrypt), or decrypted into `plain`
/// (msg_key checked). None (counted) when it cannot be decrypted.
fn open_recv<'p>(
    cipher: Option<&SessionCipher>,
    r: &'p RecvPacket<'_>,
    plain: &'p mut Vec<u8>,
    errors: &mut Errors,
) -> Option<&'p [u8]> {
    if r.setting.contains(Setting::NO_ENCRYPT) {
        return Some(r.payload);
    }
    let Some(cipher) = cipher else {
        errors.decrypt_failed += 1;
        return None;
    };
    if cipher.recv_msg_key(r).as_str() != r.msg_key {
        errors.msg_key_mismatch += 1;
    }
    plain.clear();
    if cipher.decrypt(r.payload, plain).is_err() {
        errors.decrypt_failed += 1;
        return None;
    }
    Some(plain)
}

/// The intended send time, message index (below `messages`) and class a payload of
/// this run starts with; None for anything else.
fn parse_payload(payload: &[u8], messages: usize) -> Option<(u64, u64, Class)> {
    if payload.len() < PAYLOAD_HEADER_BYTES {
        return None;
    }
    let t = u64::from_le_bytes(payload[0..8].try_into().ok()?);
    let idx = u64::from_le_bytes(payload[8..16].try_into().ok()?);
    let class = Class::from_u8(payload[16])?;
    ((idx as usize) < messages).then_some((t, idx, class))
}

/// What the caller measures between the connect phase and the send phase.
pub trait PhaseHook {
    /// Every client is connected (or failed) and idle.
    fn connected(&mut self) {}
    /// The send phase begins.
    fn sending(&mut self) {}
    /// The send phase and drain are over (connections still open).
    fn done(&mut self) {}
}

impl PhaseHook for () {}

/// Runs `plan`: connect, (hook), send at the planned rates, drain, stop.
pub fn run(plan: &Plan, cfg: &LoadConfig, hook: &mut dyn PhaseHook) -> io::Result<Outcome> {
    let threads = cfg.threads.max(1);
    let (schedules, messages) = split_schedules(plan, cfg.duration, threads)?;
    let shared = Arc::new(Shared::new(messages, cfg.connect_concurrency, threads));
    let handles = spawn_workers(plan, cfg, &shared, schedules)?;
    let phases = drive_phases(&shared, cfg, threads, hook);
    let mut results = Vec::with_capacity(threads);
    for h in handles {
        match h.join() {
            Ok(r) => results.push(r?),
            Err(_) => return Err(io::Error::other("a worker panicked")),
        }
    }
    Ok(Outcome::collect(plan, threads, &shared, phases, &results))
}

/// Client `client` of the plan is served by worker `client % threads`, in its slot
/// `client / threads`.
fn worker_of(client: usize, threads: usize) -> usize {
    client % threads
}

fn slot_of(client: usize, threads: usize) -> usize {
    client / threads
}

/// Splits every schedule over the workers (each gets the routes of its clients and
/// their share of the rate, its first send offset within the interval) and numbers
/// the messages. Returns the schedules per worker and the number of messages.
fn split_schedules(
    plan: &Plan,
    duration: Duration,
    threads: usize,
) -> io::Result<(Vec<Vec<WSchedule>>, u64)> {
    let dur_ns = duration.as_nanos() as f64;
    let mut per_worker: Vec<Vec<WSchedule>> = (0..threads).map(|_| Vec::new()).collect();
    let mut base = 0u64;
    for sc in &plan.schedules {
        if sc.routes.is_empty() || sc.rate_per_s <= 0.0 {
            continue;
        }
        for (w, list) in per_worker.iter_mut().enumerate() {
            let routes: Vec<WRoute> = sc
                .routes
                .iter()
                .filter(|r| worker_of(r.client, threads) == w)
                .map(|r| WRoute {
                    slot: slot_of(r.client, threads),
                    channel_id: r.channel_id.clone(),
                    channel_type: r.channel_type,
                    fanout: r.fanout,
                })
                .collect();
            if routes.is_empty() {
                continue;
            }
            let rate = sc.rate_per_s * routes.len() as f64 / sc.routes.len() as f64;
            let interval_ns = 1e9 / rate;
            let offset_ns = (interval_ns * w as f64 / threads as f64) as u64;
            let count = if dur_ns > offset_ns as f64 {
                ((dur_ns - offset_ns as f64) / interval_ns).ceil() as u64
            } else {
                0
            };
            list.push(WSchedule {
                class: sc.class,
                interval_ns,
                offset_ns,
                count,
                base,
                next: 0,
                routes,
            });
            base += count;
        }
    }
    if base > MAX_MESSAGES {
        return Err(io::Error::other(format!(
            "the run plans {base} messages, more than MAX_MESSAGES = {MAX_MESSAGES}"
        )));
    }
    Ok((per_worker, base))
}

impl Shared {
    /// The state of a run of `messages` messages over `threads` workers, which share
    /// `connect_concurrency` CONNECTs in flight (at least one each).
    fn new(messages: u64, connect_concurrency: usize, threads: usize) -> Shared {
        Shared {
            start: Instant::now(),
            send_start_ns: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            expected: (0..messages).map(|_| AtomicU32::new(0)).collect(),
            received: (0..messages).map(|_| AtomicU32::new(0)).collect(),
            sent: AtomicU64::new(0),
            acked: AtomicU64::new(0),
            expected_total: AtomicU64::new(0),
            received_total: AtomicU64::new(0),
            done_sending: AtomicU64::new(0),
            connect_slots: (0..threads)
                .map(|w| {
                    (connect_concurrency / threads + usize::from(w < connect_concurrency % threads))
                        .max(1)
                })
                .collect(),
            barrier: Barrier::new(threads + 1),
        }
    }
}

/// Starts one worker thread per entry of `schedules` with its share of the clients
/// (pinned to core `w % cores` when `cfg.pin`).
fn spawn_workers(
    plan: &Plan,
    cfg: &LoadConfig,
    shared: &Arc<Shared>,
    schedules: Vec<Vec<WSchedule>>,
) -> io::Result<Vec<std::thread::JoinHandle<io::Result<WorkerResult>>>> {
    let threads = schedules.len();
    let mut slots_per_worker: Vec<Vec<Slot>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, c) in plan.clients.iter().enumerate() {
        slots_per_worker[worker_of(i, threads)].push(Slot {
            spec: c.clone(),
            key: client_key(i as u64),
            conn: None,
            id: None,
            inflight: HashMap::new(),
        });
    }
    let cores = core_affinity::get_core_ids().unwrap_or_default();
    let mut handles = Vec::with_capacity(threads);
    for (w, (slots, schedules)) in slots_per_worker.into_iter().zip(schedules).enumerate() {
        let shared = shared.clone();
        let cfg = cfg.clone();
        let core = (cfg.pin && !cores.is_empty()).then(|| cores[w % cores.len()]);
        let h = std::thread::Builder::new()
            .name(format!("imbench-w{w}"))
            .spawn(move || worker_main(w, core, shared, cfg, slots, schedules))?;
        handles.push(h);
    }
    Ok(handles)
}

/// When the send phase started and ended (ns since the run's start), and whether
/// every expected RECV was in by then.
struct Phases {
    send_start_ns: u64,
    end_ns: u64,
    drained: bool,
}

/// Leads the workers through the phases: waits for the connect phase, lets `hook`
/// measure, starts the send phase, waits until every SENDACK and expected RECV is in
/// (or the drain time is over), then stops the workers.
fn drive_phases(
    shared: &Shared,
    cfg: &LoadConfig,
    threads: usize,
    hook: &mut dyn PhaseHook,
) -> Phases {
    shared.barrier.wait();
    hook.connected();
    let send_start_ns = shared.now_ns() + SEND_LEAD.as_nanos() as u64;
    shared.send_start_ns.store(send_start_ns, Ordering::Release);
    hook.sending();
    shared.barrier.wait();
    let drained = wait_drained(shared, cfg, threads, send_start_ns);
    let end_ns = shared.now_ns();
    hook.done();
    shared.stop.store(true, Ordering::Release);
    Phases {
        send_start_ns,
        end_ns,
        drained,
    }
}

/// Waits until every worker sent its schedules and every SENDACK and expected RECV
/// is in (true), or the send phase and the drain are over (false); prints progress
/// every second when `cfg.progress`.
fn wait_drained(shared: &Shared, cfg: &LoadConfig, threads: usize, send_start: u64) -> bool {
    let drain_end = send_start + (cfg.duration + cfg.drain).as_nanos() as u64;
    let mut last_progress = send_start;
    loop {
        let now = shared.now_ns();
        let all_sent = shared.done_sending.load(Ordering::Acquire) == threads as u64;
        let sent = shared.sent.load(Ordering::Relaxed);
        let acked = shared.acked.load(Ordering::Relaxed);
        let exp = shared.expected_total.load(Ordering::Relaxed);
        let got = shared.received_total.load(Ordering::Relaxed);
        if all_sent && acked >= sent && got >= exp {
            return true;
        }
        if now > drain_end && all_sent {
            return false;
        }
        if cfg.progress && now > last_progress + 1_000_000_000 {
            last_progress = now;
            eprintln!(
                "imbench: t={:.0}s sent={sent} acked={acked} delivered={got}/{exp}",
                (now - send_start) as f64 / 1e9
            );
        }
        std::thread::park_timeout(Duration::from_millis(2));
    }
}

impl Outcome {
    /// Merges the workers' results and counts every message's RECVs against its
    /// expectation.
    fn collect(
        plan: &Plan,
        threads: usize,
        shared: &Shared,
        phases: Phases,
        results: &[WorkerResult],
    ) -> Outcome {
        let mut out = Outcome::empty(plan.clients.len(), threads);
        out.send_phase = Duration::from_nanos(phases.end_ns.saturating_sub(phases.send_start_ns));
        out.drained = phases.drained;
        let (mut first, mut last) = (u64::MAX, 0u64);
        for r in results {
            out.add_worker(r);
            if r.stats.first_connect_ns != 0 {
                first = first.min(r.stats.first_connect_ns);
            }
            last = last.max(r.stats.last_connack_ns);
            for &(class, lo, hi) in &r.ranges {
                out.count_messages(shared, class, lo..hi);
            }
        }
        if first != u64::MAX && last >= first {
            out.connect_phase = Duration::from_nanos(last - first);
        }
        out
    }

    fn empty(clients: usize, workers: usize) -> Outcome {
        Outcome {
            connect: new_hist(),
            send_lag: new_hist(),
            sendack: [new_hist(), new_hist()],
            recv: [new_hist(), new_hist()],
            errors: Errors::default(),
            clients,
            connected: 0,
            connect_phase: Duration::ZERO,
            sent: [0; CLASSES],
            expected: [0; CLASSES],
            delivered: [0; CLASSES],
            missing: [0; CLASSES],
            extra: [0; CLASSES],
            dup_flagged: 0,
            send_phase: Duration::ZERO,
            drained: false,
            harness_cpu_connect_s: 0.0,
            harness_cpu_send_s: 0.0,
            uring_workers: 0,
            workers,
            send_phase_reads: 0,
            send_phase_writes: 0,
        }
    }

    /// Adds one worker's histograms and counters.
    fn add_worker(&mut self, r: &WorkerResult) {
        let st = &r.stats;
        let _ = self.connect.add(&st.connect);
        let _ = self.send_lag.add(&st.send_lag);
        for c in 0..CLASSES {
            let _ = self.sendack[c].add(&st.sendack[c]);
            let _ = self.recv[c].add(&st.recv[c]);
        }
        self.errors.merge(&st.errors);
        self.errors.sendack_missing += r.unacked;
        self.connected += st.connected;
        self.dup_flagged += st.dup_flagged;
        self.harness_cpu_connect_s += r.cpu_connect.as_secs_f64();
        self.harness_cpu_send_s += r.cpu_send.as_secs_f64();
        self.uring_workers += usize::from(st.uring);
        self.send_phase_reads += r.send_phase_reads;
        self.send_phase_writes += r.send_phase_writes;
    }

    /// Counts the messages `idx` of `class` (attempted; skipped ones are also in
    /// `errors.sends_skipped`) and their RECVs: delivered, missing, extra.
    fn count_messages(&mut self, shared: &Shared, class: Class, idx: std::ops::Range<u64>) {
        let c = class as usize;
        self.sent[c] += idx.end - idx.start;
        for i in idx {
            let e = u64::from(shared.expected[i as usize].load(Ordering::Relaxed));
            let r = u64::from(shared.received[i as usize].load(Ordering::Relaxed));
            self.expected[c] += e;
            self.delivered[c] += r.min(e);
            self.missing[c] += e.saturating_sub(r);
            self.extra[c] += r.saturating_sub(e);
        }
    }
}

/// What one worker hands back.
struct WorkerResult {
    stats: Stats,
    /// CPU time of the connect phase and of the send phase (with the drain).
    cpu_connect: Duration,
    cpu_send: Duration,
    /// SENDs never acknowledged.
    unacked: u64,
    /// Its message index ranges, per class.
    ranges: Vec<(Class, u64, u64)>,
    /// Reads and writes of the send phase.
    send_phase_reads: u64,
    send_phase_writes: u64,
}

/// One worker thread: pinned, connects its clients, meets the run at both barriers
/// (always, so that a failed worker never blocks the run), then sends.
fn worker_main(
    id: usize,
    core: Option<core_affinity::CoreId>,
    shared: Arc<Shared>,
    cfg: LoadConfig,
    slots: Vec<Slot>,
    schedules: Vec<WSchedule>,
) -> io::Result<WorkerResult> {
    if let Some(c) = core {
        core_affinity::set_for_current(c);
    }
    // SAFETY: prctl with PR_SET_TIMERSLACK and an integer argument affects only this
    // thread's timer slack (1 ns: wake at the intended send time, not 50 µs later).
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
    let (mut worker, failed) = match driver(id, &cfg, slots.len()) {
        Ok(net) => (
            Some(Worker::new(id, shared.clone(), cfg, slots, schedules, net)),
            None,
        ),
        Err(e) => (None, Some(e)),
    };
    if let Some(w) = worker.as_mut() {
        w.connect_phase(shared.connect_slots[id]);
    }
    let cpu_connect = thread_cpu();
    shared.barrier.wait();
    shared.barrier.wait();
    let Some(mut w) = worker else {
        shared.done_sending.fetch_add(1, Ordering::AcqRel);
        let e = failed.map_or_else(|| "unknown".to_string(), |e| e.to_string());
        return Err(io::Error::other(format!("the worker's driver: {e}")));
    };
    let io_before = w.io_counts();
    w.send_phase();
    w.stats.uring = w.net.backend() == Backend::Uring;
    let io_after = w.io_counts();
    Ok(WorkerResult {
        cpu_connect,
        cpu_send: thread_cpu().saturating_sub(cpu_connect),
        unacked: w.slots.iter().map(|s| s.inflight.len() as u64).sum(),
        ranges: w
            .schedules
            .iter()
            .map(|s| (s.class, s.base, s.base + s.next))
            .collect(),
        send_phase_reads: io_after.0 - io_before.0,
        send_phase_writes: io_after.1 - io_before.1,
        stats: w.stats,
    })
}

/// Worker `id`'s driver for `clients` connections: `net::io`'s, dialing only, on
/// io_uring (`IoMode::Uring`; mio where the kernel refuses io_uring, said once) or
/// mio (`IoMode::Epoll`). Its limits are the connection's own: output queued up to
/// [`TX_CAPACITY_MAX_BYTES`], input up to [`RX_CAPACITY_MAX_BYTES`] (consumed at
/// every batch), the TCP connect within the run's connect timeout; provided
/// receive buffers as the harness's own ring had them (128 of 32 KiB).
fn driver(id: usize, cfg: &LoadConfig, clients: usize) -> io::Result<NetDriver> {
    let mut net = NetConfig::dialer(clients.max(1));
    net.backend = match cfg.io {
        IoMode::Uring => Backend::Auto,
        IoMode::Epoll => Backend::Mio,
    };
    net.connect_timeout_ms = (cfg.connect_timeout.as_millis() as u64).max(1);
    net.rpc_outbound_queue_bytes_max = TX_CAPACITY_MAX_BYTES;
    net.rpc_inbound_buffer_bytes_max = RX_CAPACITY_MAX_BYTES;
    net.uring_buf_count = 128;
    net.uring_buf_bytes = 32 * 1024;
    let d = NetDriver::dialer(&net)?;
    if cfg.io == IoMode::Uring && d.backend() != Backend::Uring && id == 0 {
        eprintln!("imbench: io_uring unavailable: using epoll");
    }
    Ok(d)
}

impl Worker {
    fn new(
        id: usize,
        shared: Arc<Shared>,
        cfg: LoadConfig,
        slots: Vec<Slot>,
        schedules: Vec<WSchedule>,
        net: NetDriver,
    ) -> Worker {
        Worker {
            id,
            shared,
            cfg,
            slots,
            schedules,
            stats: Stats::new(),
            net,
            events: Vec::new(),
            owner: Vec::new(),
            plain: Vec::new(),
            bufs: SendBufs::default(),
        }
    }
}

impl Stats {
    fn new() -> Stats {
        Stats {
            connect: new_hist(),
            send_lag: new_hist(),
            sendack: [new_hist(), new_hist()],
            recv: [new_hist(), new_hist()],
            errors: Errors::default(),
            dup_flagged: 0,
            recvs_unpublished: 0,
            uring: false,
            closed_reads: 0,
            closed_writes: 0,
            connected: 0,
            first_connect_ns: 0,
            last_connack_ns: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Errors;

    /// SENDACK 22 is the node's retryable refusal under overload: counted apart, not
    /// an error (a run at an offered load above capacity stays clean); any other
    /// reason is an error.
    #[test]
    fn sendack_22_is_a_refusal_and_other_reasons_are_errors() {
        let mut a = Errors::default();
        a.count_sendack_refusal(22);
        a.count_sendack_refusal(22);
        assert_eq!((a.sendack_rate_limited, a.total()), (2, 0));
        let mut b = Errors::default();
        b.count_sendack_refusal(15);
        b.count_sendack_refusal(22);
        a.merge(&b);
        assert_eq!(a.sendack_rate_limited, 3);
        assert_eq!(a.sendack_reasons.get(&15), Some(&1));
        assert_eq!(a.total(), 1, "only reason 15 is an error");
    }
}
