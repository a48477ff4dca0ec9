//! The connection table and per-connection state machine shared by both backends,
//! sans-IO: backends feed it received bytes, end of stream and errors (with `now`
//! passed to [`Core::advance`]), take output chunks from it, and tear down the
//! sockets of the connections it marks dead. Events for the handler queue here.
//!
//! Phases: `Handshake` (WebSocket upgrade; invisible to the handler) → `Open` →
//! `Flushing` (graceful close: write what is queued) → `Lingering` (write side shut
//! down, waiting for the peer's end of stream) → `Dead` (the backend closes the
//! socket and frees the slot once no IO references its buffers).

use std::net::SocketAddr;

use shard::timer::{TimerHandle, TimerWheel};

use super::ws::{self, Handshake, WsControl, WsDecoder};
use super::{CloseReason, ConnId, ListenerKind, NetConfig, NetEvent, NetStats, SendError};

/// An input buffer whose capacity passed this is released when fully consumed, so
/// idle connections hold no large receive buffer.
const INPUT_KEEP_BYTES: usize = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    Handshake,
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
    kind: ListenerKind,
    peer: SocketAddr,
    /// Bytes for the handler: `input[input_start..]` is unconsumed.
    input: Vec<u8>,
    input_start: usize,
    /// WebSocket: received bytes not yet decoded (upgrade request or partial frame).
    raw: Vec<u8>,
    ws: WsDecoder,
    /// Output appended by sends; swapped into `out_cur` when that is written.
    out_next: Vec<u8>,
    /// Output being written: `out_cur[out_off..]` is unwritten. Backends may keep it
    /// referenced by in-flight IO: it is only touched through `out_*` calls.
    out_cur: Vec<u8>,
    out_off: usize,
    last_input_ms: u64,
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
            kind: ListenerKind::Tcp,
            peer: SocketAddr::from(([127, 0, 0, 1], 0)),
            input: Vec::new(),
            input_start: 0,
            raw: Vec::new(),
            ws: WsDecoder::default(),
            out_next: Vec::new(),
            out_cur: Vec::new(),
            out_off: 0,
            last_input_ms: 0,
            linger_deadline_ms: 0,
            timer: None,
            peer_eof: false,
            readable_flag: false,
            dirty_flag: false,
            visible: false,
            closed_pending: false,
        }
    }

    fn out_len(&self) -> usize {
        self.out_cur.len() - self.out_off + self.out_next.len()
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
    /// Unconsumed input past which a connection is closed: `inbound_buffer_bytes_max`
    /// plus what the backend may deliver after it paused reading.
    inbound_close_bytes: usize,
    conns: Vec<Conn>,
    free: Vec<u32>,
    live: usize,
    events: Vec<NetEvent>,
    dirty: Vec<u32>,
    dead: Vec<u32>,
    timers: TimerWheel<(u32, u32)>,
    /// Timers fired by one `advance` (reused).
    fired: Vec<(u32, u32)>,
    now_ms: u64,
    pub(crate) stats: NetStats,
}

impl Core {
    /// `inbound_slack_bytes`: input the backend may still deliver after pausing.
    pub(crate) fn new(cfg: &NetConfig, inbound_slack_bytes: usize) -> Self {
        Core {
            cfg: cfg.clone(),
            inbound_close_bytes: cfg
                .inbound_buffer_bytes_max
                .saturating_add(inbound_slack_bytes),
            conns: Vec::new(),
            free: Vec::new(),
            live: 0,
            events: Vec::new(),
            dirty: Vec::new(),
            dead: Vec::new(),
            // One timer per connection slot.
            timers: TimerWheel::new(0, cfg.max_connections_per_shard),
            fired: Vec::new(),
            now_ms: 0,
            stats: NetStats::default(),
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

    /// A new socket. `None`: at `max_connections_per_shard` (the caller closes it).
    pub(crate) fn alloc(&mut self, kind: ListenerKind, peer: SocketAddr) -> Option<u32> {
        if self.live >= self.cfg.max_connections_per_shard {
            self.stats.refused += 1;
            return None;
        }
        let idx = match self.free.pop() {
            Some(i) => i,
            None => {
                self.conns.push(Conn::empty());
                (self.conns.len() - 1) as u32
            }
        };
        self.live += 1;
        let now = self.now_ms;
        let deadline = now + self.cfg.idle_timeout_ms;
        let c = &mut self.conns[idx as usize];
        debug_assert!(!c.in_use);
        c.in_use = true;
        c.kind = kind;
        c.peer = peer;
        c.last_input_ms = now;
        c.peer_eof = false;
        c.phase = match kind {
            ListenerKind::Tcp => Phase::Open,
            ListenerKind::WebSocket => Phase::Handshake,
        };
        c.ws = WsDecoder::default();
        c.timer = self.timers.insert(deadline, (idx, c.generation)).ok();
        if kind == ListenerKind::Tcp {
            self.accept_visible(idx);
        }
        Some(idx)
    }

    /// Counts a failed accept; logs the 1st, 2nd, 4th, 8th... so a persistent
    /// failure (out of file descriptors) cannot flood the log.
    pub(crate) fn accept_error(&mut self, err: &std::io::Error) {
        self.stats.accept_errors += 1;
        let n = self.stats.accept_errors;
        if n.is_power_of_two() {
            tracing::warn!(error = %err, failures = n, "accept failed");
        }
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
        if c.kind == ListenerKind::WebSocket && c.phase == Phase::Open {
            ws::write_close(&mut c.out_next, ws_code);
        }
        c.phase = Phase::Flushing;
        c.linger_deadline_ms = linger;
        self.mark_dirty(idx);
    }

    /// Bytes received on connection `idx`.
    pub(crate) fn on_recv(&mut self, idx: u32, data: &[u8]) {
        self.stats.bytes_in += data.len() as u64;
        let max_in = self.inbound_close_bytes;
        let now = self.now_ms;
        let c = &mut self.conns[idx as usize];
        c.last_input_ms = now;
        match (c.phase, c.kind) {
            (Phase::Open, ListenerKind::Tcp) => {
                if c.unconsumed() + data.len() > max_in {
                    self.abort(idx, CloseReason::InboundOverflow);
                    return;
                }
                c.compact_input();
                c.input.extend_from_slice(data);
                self.mark_readable(idx);
            }
            (Phase::Open, ListenerKind::WebSocket) => {
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
                    c.out_next.extend_from_slice(
                        b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\n\r\n",
                    );
                    self.begin_close(idx, CloseReason::WebSocketProtocol, ws::CLOSE_PROTOCOL);
                }
            }
            Handshake::Reject(response) => {
                c.out_next.extend_from_slice(&response);
                self.begin_close(idx, CloseReason::WebSocketProtocol, ws::CLOSE_PROTOCOL);
            }
            Handshake::Done { response, consumed } => {
                c.out_next.extend_from_slice(&response);
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
        let max_msg = self.cfg.ws_message_bytes_max as u64;
        let max_in = self.inbound_close_bytes;
        let c = &mut self.conns[idx as usize];
        c.compact_input();
        let before = c.input.len();
        let mut controls: Vec<WsControl> = Vec::new();
        let result =
            c.ws.decode(&c.raw, &mut c.input, max_msg, |ctl| controls.push(ctl));
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
                    let c = &mut self.conns[idx as usize];
                    if c.phase == Phase::Open {
                        ws::write_pong(&mut c.out_next, &payload);
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
            Phase::Dead => {}
        }
    }

    /// A socket error on connection `idx`.
    pub(crate) fn on_error(&mut self, idx: u32, kind: std::io::ErrorKind) {
        self.abort(idx, CloseReason::Error(kind));
    }

    /// Unwritten output of `idx`: the slice to write next (empty: nothing queued).
    /// The slice stays valid and unmoved until [`Core::out_advance`] consumed it.
    pub(crate) fn out_chunk(&mut self, idx: u32) -> &[u8] {
        let c = &mut self.conns[idx as usize];
        if c.out_off == c.out_cur.len() && !c.out_next.is_empty() {
            c.out_cur.clear();
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
            c.out_cur.clear();
            std::mem::swap(&mut c.out_cur, &mut c.out_next);
            c.out_off = (n - cur_left).min(c.out_cur.len());
        }
        self.stats.bytes_out += n as u64;
    }

    /// `n` bytes of the chunk from [`Core::out_chunk`] were written.
    pub(crate) fn out_advance(&mut self, idx: u32, n: usize) {
        let c = &mut self.conns[idx as usize];
        debug_assert!(c.out_off + n <= c.out_cur.len());
        c.out_off = (c.out_off + n).min(c.out_cur.len());
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
    pub(crate) fn take_dirty(&mut self, out: &mut Vec<u32>) {
        out.clear();
        std::mem::swap(out, &mut self.dirty);
        for &idx in out.iter() {
            self.conns[idx as usize].dirty_flag = false;
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
        c.out_next = Vec::new();
        c.out_cur = Vec::new();
        c.out_off = 0;
        c.readable_flag = false;
        c.dirty_flag = false;
        c.visible = false;
        c.closed_pending = false;
        self.free.push(idx);
        self.live -= 1;
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
                NetEvent::Accepted { .. } => {}
            }
            out.push(ev);
        }
    }

    pub(crate) fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// The earliest timer deadline, if any.
    pub(crate) fn next_deadline_ms(&self) -> Option<u64> {
        self.timers.next_deadline()
    }

    /// Sets the time used for new deadlines (call after a wait, before feeding IO),
    /// without firing timers. Never moves backward.
    pub(crate) fn set_now(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
    }

    /// Moves time to `now_ms` and fires idle and linger timers.
    pub(crate) fn advance(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
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
            let deadline = match c.phase {
                Phase::Handshake | Phase::Open => c.last_input_ms + self.cfg.idle_timeout_ms,
                Phase::Flushing | Phase::Lingering => c.linger_deadline_ms,
                Phase::Dead => continue,
            };
            if self.now_ms < deadline {
                c.timer = self.timers.insert(deadline, (idx, generation)).ok();
                continue;
            }
            match c.phase {
                Phase::Open => {
                    self.begin_close(idx, CloseReason::IdleTimeout, ws::CLOSE_NORMAL);
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
        let Some(i) = self.lookup(conn) else {
            return Err(SendError::Closed);
        };
        let c = &mut self.conns[i];
        if c.phase != Phase::Open {
            return Err(SendError::Closed);
        }
        let framed = match c.kind {
            ListenerKind::Tcp => bytes.len(),
            ListenerKind::WebSocket => ws::header_len(bytes.len()) + bytes.len(),
        };
        if c.out_len() + framed > self.cfg.outbound_queue_bytes_max {
            tracing::warn!(
                conn = i,
                peer = %c.peer,
                queued_bytes = c.out_len(),
                limit_bytes = self.cfg.outbound_queue_bytes_max,
                "outbound queue overflow: closing connection"
            );
            self.abort(i as u32, CloseReason::OutboundOverflow);
            return Err(SendError::Overflow);
        }
        match c.kind {
            ListenerKind::Tcp => c.out_next.extend_from_slice(bytes),
            ListenerKind::WebSocket => ws::write_binary(&mut c.out_next, bytes),
        }
        self.mark_dirty(i as u32);
        Ok(())
    }

    pub(crate) fn close(&mut self, conn: ConnId) {
        let Some(i) = self.lookup(conn) else { return };
        if self.conns[i].phase == Phase::Open {
            self.begin_close(i as u32, CloseReason::Local, ws::CLOSE_NORMAL);
        }
    }

    pub(crate) fn outbound_bytes(&self, conn: ConnId) -> usize {
        self.lookup(conn).map_or(0, |i| self.conns[i].out_len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn core(cfg: NetConfig) -> Core {
        Core::new(&cfg, 0)
    }

    fn peer() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 9))
    }

    #[test]
    fn stale_id_never_reaches_new_connection() {
        let mut c = core(NetConfig::default());
        let a = c.alloc(ListenerKind::Tcp, peer()).unwrap();
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
        let b = c.alloc(ListenerKind::Tcp, peer()).unwrap();
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
        let a = c.alloc(ListenerKind::Tcp, peer()).unwrap();
        let b = c.alloc(ListenerKind::Tcp, peer()).unwrap();
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
        let a = c.alloc(ListenerKind::Tcp, peer()).unwrap();
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
        let a = c.alloc(ListenerKind::Tcp, peer()).unwrap();
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
        let a = c.alloc(ListenerKind::Tcp, peer()).unwrap();
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
        let a = c.alloc(ListenerKind::Tcp, peer()).unwrap();
        c.on_recv(a, b"abc");
        c.consume(c.id(a), 2);
        c.on_recv(a, b"def");
        assert_eq!(c.input(c.id(a)), b"cdef");
        c.on_recv(a, b"g");
        assert_eq!(c.phase(a), Phase::Dead);
    }
}
