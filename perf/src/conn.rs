//! One non-blocking wkproto client connection (TCP or WebSocket) for the load loops.
//!
//! Contract: the owner registers [`Conn::stream`] with its `mio::Poll` for READABLE and
//! WRITABLE (edge-triggered), calls [`Conn::on_writable`] on writable events and
//! [`Conn::read_frames`] on readable ones, and [`Conn::flush`] after queueing frames.
//! An io_uring owner instead reads the socket itself and hands each read's bytes to
//! [`Conn::on_bytes`], and sends what [`Conn::swap_tx`] gives it.
//! Frames queued before the TCP connect (or the WebSocket upgrade) completes are kept
//! and written once it does. Every buffer has a limit; exceeding one is an error
//! value, and the connection is then closed by its owner.

use std::io::{self, Read, Write};
use std::net::SocketAddr;

pub use proto::crypto::ClientKey;
use proto::crypto::SessionCipher;
use proto::wkproto::{
    decode, ConnackPacket, ConnectPacket, DeviceFlag, Frame, ReasonCode, RecvPacket, SendackPacket,
    Setting, MAX_FRAME_BYTES,
};
use proto::ws::{self, UpgradeResponse, WsControl, WsDecoder, WsError};
pub use proto::Transport;

use crate::peer::{self, PeerEvent, PeerProto, PeerRole};

/// Bytes one connection buffers for reading before a frame must be complete.
pub const RX_CAPACITY_MAX_BYTES: usize = MAX_FRAME_BYTES + 64 * 1024;
/// Bytes one connection may have queued for writing (the socket is then too slow).
pub const TX_CAPACITY_MAX_BYTES: usize = 8 << 20;
/// Initial receive buffer (grown on demand up to [`RX_CAPACITY_MAX_BYTES`]).
const RX_INITIAL_BYTES: usize = 4 * 1024;
/// Bytes read per `read` call at most (the size of the owner's read scratch).
pub const READ_CHUNK_BYTES: usize = 64 * 1024;
/// Longest WebSocket upgrade response we accept.
const WS_HANDSHAKE_MAX_BYTES: usize = 4 * 1024;

/// Lifecycle of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnState {
    /// WebSocket: upgrade request sent, waiting for `101`.
    WsUpgrade,
    /// CONNECT queued or sent, waiting for CONNACK.
    AwaitConnack,
    /// CONNACK success.
    Active,
    /// Refused or failed; the owner drops it.
    Closed,
}

/// A connection failure the harness counts (never a panic).
#[derive(Debug)]
pub enum ConnError {
    Io(io::Error),
    Eof,
    Protocol(String),
    BufferFull,
}

impl std::fmt::Display for ConnError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnError::Io(e) => write!(f, "io: {e}"),
            ConnError::Eof => write!(f, "server closed the connection"),
            ConnError::Protocol(s) => write!(f, "protocol: {s}"),
            ConnError::BufferFull => write!(f, "buffer limit reached"),
        }
    }
}

impl From<io::Error> for ConnError {
    fn from(e: io::Error) -> Self {
        ConnError::Io(e)
    }
}

/// One client connection.
pub struct Conn {
    pub stream: mio::net::TcpStream,
    pub transport: Transport,
    pub state: ConnState,
    /// The negotiated protocol version (the client asks for 6).
    pub version: u8,
    /// Set after a successful CONNACK when the key agreement is completed client-side.
    pub cipher: Option<SessionCipher>,
    /// When CONNECT was started (ns since the run's start).
    pub connect_started_ns: u64,
    /// Next SEND client_seq.
    pub client_seq: u32,
    /// Reads that brought bytes, and writes (or ring sends) made: the harness's own
    /// work per RECV.
    pub reads: u64,
    pub writes: u64,
    key: ClientKey,
    rx: Vec<u8>,
    rx_off: usize,
    /// WebSocket: raw bytes not yet deframed, and the frame decoder.
    ws_raw: Vec<u8>,
    ws: WsDecoder,
    tx: Vec<u8>,
    tx_off: usize,
    /// Frames queued while the WebSocket upgrade is pending (already WS-framed).
    pending: Vec<u8>,
    scratch: Vec<u8>,
    /// A peer's connection (Redis, NATS) instead of wkproto.
    pub peer: Option<PeerProto>,
    /// Peer publishes answered so far (Redis answers in order: the next answer is
    /// for client_seq `peer_acked + 1`).
    peer_acked: u32,
}

/// What [`Conn::read_frames`] hands to its callback: a decoded frame of this connection.
pub type FrameSink<'a> = dyn FnMut(&mut ConnCtx<'_>, Frame<'_>) + 'a;

/// The parts of a connection a frame callback may use while the frame borrows `rx`.
pub struct ConnCtx<'a> {
    pub cipher: &'a mut Option<SessionCipher>,
    pub state: &'a mut ConnState,
    pub version: u8,
    /// When the `read` that brought this frame in returned (ns since the run's start).
    pub read_ns: u64,
    /// Whether RECVs are acknowledged (wkproto); a peer has no RECVACK.
    pub recvack: bool,
    key: &'a ClientKey,
    out: &'a mut Vec<u8>,
    ws: bool,
    scratch: &'a mut Vec<u8>,
}

impl ConnCtx<'_> {
    /// Completes the key agreement from CONNACK's `server_key` and `salt`.
    pub fn agree(&mut self, server_key: &str, salt: &str) -> Result<(), ConnError> {
        let cipher = self
            .key
            .session_cipher(server_key, salt)
            .map_err(|e| ConnError::Protocol(e.to_string()))?;
        *self.cipher = Some(cipher);
        Ok(())
    }

    /// Queues one frame encoded by `encode` (appending to the given buffer).
    pub fn queue(&mut self, encode: impl FnOnce(&mut Vec<u8>)) {
        queue_into(self.out, self.ws, self.scratch, encode);
    }
}

fn queue_into(
    out: &mut Vec<u8>,
    ws: bool,
    scratch: &mut Vec<u8>,
    encode: impl FnOnce(&mut Vec<u8>),
) {
    if ws {
        scratch.clear();
        encode(scratch);
        ws::write_masked_binary(out, scratch, ws::FIXED_MASK);
    } else {
        encode(out);
    }
}

/// A deterministic key pair for client number `n` (the harness needs no secrecy),
/// computed before timed phases.
pub fn client_key(n: u64) -> ClientKey {
    let mut private = [0x5au8; 32];
    private[..8].copy_from_slice(&n.to_le_bytes());
    private[8..16].copy_from_slice(&n.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
    ClientKey::new(private)
}

impl Conn {
    /// Starts a non-blocking connect to `addr` and queues the WebSocket upgrade (if
    /// any) and CONNECT for `uid`/`token`.
    pub fn start(
        addr: SocketAddr,
        transport: Transport,
        uid: &str,
        token: &str,
        key: &ClientKey,
        now_ns: u64,
    ) -> Result<Conn, ConnError> {
        let stream = mio::net::TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        let mut c = Conn {
            stream,
            transport,
            state: ConnState::AwaitConnack,
            version: 6,
            cipher: None,
            connect_started_ns: now_ns,
            client_seq: 0,
            reads: 0,
            writes: 0,
            key: *key,
            rx: Vec::with_capacity(RX_INITIAL_BYTES),
            rx_off: 0,
            ws_raw: Vec::new(),
            ws: WsDecoder::client(),
            tx: Vec::new(),
            tx_off: 0,
            pending: Vec::new(),
            scratch: Vec::new(),
            peer: None,
            peer_acked: 0,
        };
        let connect = ConnectPacket {
            version: 6,
            device_flag: DeviceFlag(0),
            device_id: uid,
            uid,
            token,
            client_timestamp_ms: 0,
            client_key: key.client_key(),
            ..Default::default()
        };
        if transport == Transport::WebSocket {
            c.state = ConnState::WsUpgrade;
            ws::write_upgrade_request(&mut c.tx, &addr.to_string(), ws::SAMPLE_KEY);
        }
        let mut encoded = Ok(0);
        c.queue(|out| encoded = connect.encode(6, out))?;
        encoded.map_err(|e| ConnError::Protocol(format!("{e:?}")))?;
        Ok(c)
    }

    /// Starts a non-blocking connect to a peer server and queues its greeting
    /// (subscription or PING): the connection is Active once the server confirms it.
    pub fn start_peer(addr: SocketAddr, role: &PeerRole, now_ns: u64) -> Result<Conn, ConnError> {
        let mut c = Conn::start(addr, Transport::Tcp, "", "", &client_key(0), now_ns)?;
        c.tx.clear();
        c.peer = Some(role.proto);
        peer::encode_hello(role, &mut c.tx);
        Ok(c)
    }

    /// Queues one frame (encoded by `encode`); call [`Conn::flush`] to write it.
    pub fn queue(&mut self, encode: impl FnOnce(&mut Vec<u8>)) -> Result<(), ConnError> {
        let ws = self.transport == Transport::WebSocket;
        let out = if self.state == ConnState::WsUpgrade {
            &mut self.pending
        } else {
            &mut self.tx
        };
        queue_into(out, ws, &mut self.scratch, encode);
        if self.tx.len() + self.pending.len() > TX_CAPACITY_MAX_BYTES {
            return Err(ConnError::BufferFull);
        }
        Ok(())
    }

    /// Bytes queued and not yet written.
    pub fn tx_pending_bytes(&self) -> usize {
        self.tx.len() - self.tx_off
    }

    /// Writes what is queued until the socket would block.
    pub fn flush(&mut self) -> Result<(), ConnError> {
        while self.tx_off < self.tx.len() {
            match self.stream.write(&self.tx[self.tx_off..]) {
                Ok(0) => return Err(ConnError::Eof),
                Ok(n) => {
                    self.tx_off += n;
                    self.writes += 1;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::NotConnected => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.into()),
            }
        }
        if self.tx_off == self.tx.len() {
            self.tx.clear();
            self.tx_off = 0;
        } else if self.tx_off > 64 * 1024 {
            self.tx.drain(..self.tx_off);
            self.tx_off = 0;
        }
        Ok(())
    }

    /// On a writable event: surfaces a failed connect (only while connecting: a
    /// `getsockopt` per event would cost a syscall per RECV), then flushes what is
    /// queued (nothing to do, and no syscall, when the queue is empty).
    pub fn on_writable(&mut self) -> Result<(), ConnError> {
        if self.state != ConnState::Active {
            if let Some(e) = self.stream.take_error()? {
                return Err(e.into());
            }
        }
        if self.tx_pending_bytes() > 0 {
            self.flush()?;
        }
        Ok(())
    }

    /// Reads until the socket is drained and hands every complete frame to `sink`,
    /// with [`ConnCtx::read_ns`] = `clock()` read once right after the `read` that
    /// brought the frame in (all frames of one read arrived together).
    ///
    /// With edge-triggered readiness, a read that returns less than `chunk.len()`
    /// bytes emptied the socket's receive queue (a stream socket: epoll(7)), so no
    /// second `read` is made to see `WouldBlock`, unless `peer_closed` (the event
    /// carried RDHUP: read on to the end of stream, which brings no new edge).
    /// TCP frames are decoded in place from `chunk` (the owner's reusable scratch);
    /// only an incomplete tail is copied into the connection's own buffer.
    /// Frames the sink queues (RECVACKs) are left for the caller's [`Conn::flush`]:
    /// the RECVACKs of one read go out in one write.
    pub fn read_frames(
        &mut self,
        chunk: &mut [u8],
        peer_closed: bool,
        clock: &dyn Fn() -> u64,
        sink: &mut FrameSink<'_>,
    ) -> Result<(), ConnError> {
        loop {
            match self.stream.read(chunk) {
                Ok(0) => return Err(ConnError::Eof),
                Ok(n) => {
                    self.on_bytes(&chunk[..n], clock(), sink)?;
                    if n < chunk.len() && !peer_closed {
                        return Ok(());
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Handles the bytes of one read (made at `now`, ns since the run's start): hands
    /// every frame they complete to `sink`, keeps an incomplete tail. TCP frames are
    /// decoded in place from `data` when no earlier tail is pending.
    pub fn on_bytes(
        &mut self,
        data: &[u8],
        now: u64,
        sink: &mut FrameSink<'_>,
    ) -> Result<(), ConnError> {
        self.reads += 1;
        if self.transport == Transport::WebSocket {
            if self.ws_raw.len() + data.len() > RX_CAPACITY_MAX_BYTES {
                return Err(ConnError::BufferFull);
            }
            self.ws_raw.extend_from_slice(data);
            self.deframe_ws()?;
            self.process(now, sink)
        } else if self.rx_off == self.rx.len() {
            let used = self.decode_slice(data, now, sink)?;
            self.rx.clear();
            self.rx_off = 0;
            if data.len() - used > RX_CAPACITY_MAX_BYTES {
                return Err(ConnError::BufferFull);
            }
            self.rx.extend_from_slice(&data[used..]);
            Ok(())
        } else {
            if self.rx.len() + data.len() > RX_CAPACITY_MAX_BYTES {
                return Err(ConnError::BufferFull);
            }
            self.rx.extend_from_slice(data);
            self.process(now, sink)
        }
    }

    /// The socket's descriptor (for an io_uring loop; it stays owned by `stream`).
    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.stream.as_raw_fd()
    }

    /// Exchanges the queued output with `buf` (an io_uring loop sends it from there
    /// and hands the emptied buffer back next time). Only when nothing was written
    /// partially by [`Conn::flush`].
    pub fn swap_tx(&mut self, buf: &mut Vec<u8>) {
        debug_assert_eq!(self.tx_off, 0);
        self.writes += 1;
        buf.clear();
        std::mem::swap(&mut self.tx, buf);
    }

    /// WebSocket: completes the upgrade, then moves message payloads into `rx`.
    fn deframe_ws(&mut self) -> Result<(), ConnError> {
        let mut off = 0;
        if self.state == ConnState::WsUpgrade {
            match ws::upgrade_response(&self.ws_raw, ws::SAMPLE_KEY) {
                UpgradeResponse::Partial if self.ws_raw.len() > WS_HANDSHAKE_MAX_BYTES => {
                    return Err(ConnError::Protocol(
                        "WebSocket upgrade response too long".into(),
                    ))
                }
                UpgradeResponse::Partial => return Ok(()),
                UpgradeResponse::Refused(why) => return Err(ConnError::Protocol(why)),
                UpgradeResponse::Done { consumed } => off = consumed,
            }
            self.state = ConnState::AwaitConnack;
            self.tx.extend_from_slice(&self.pending);
            self.pending = Vec::new();
        }
        let mut closed = false;
        let tx = &mut self.tx;
        let used = self.ws.decode(
            &self.ws_raw[off..],
            &mut self.rx,
            MAX_FRAME_BYTES as u64,
            |c| match c {
                WsControl::Ping(p) => ws::write_masked_pong(tx, &p, ws::FIXED_MASK),
                WsControl::Close(_) => closed = true,
            },
        );
        match used {
            Err(WsError(ws::CLOSE_TOO_BIG)) => return Err(ConnError::BufferFull),
            Err(WsError(code)) => {
                return Err(ConnError::Protocol(format!(
                    "bad WebSocket frame (close code {code})"
                )))
            }
            Ok(_) if closed => return Err(ConnError::Eof),
            Ok(n) => off += n,
        }
        self.ws_raw.drain(..off);
        if self.rx.len() > RX_CAPACITY_MAX_BYTES {
            return Err(ConnError::BufferFull);
        }
        Ok(())
    }

    /// Decodes the frames of `rx` (past `rx_off`) and compacts it.
    fn process(&mut self, now: u64, sink: &mut FrameSink<'_>) -> Result<(), ConnError> {
        let rx = std::mem::take(&mut self.rx);
        let r = self.decode_slice(&rx[self.rx_off..], now, sink);
        self.rx = rx;
        self.rx_off += r?;
        if self.rx_off == self.rx.len() {
            self.rx.clear();
            self.rx_off = 0;
        } else if self.rx_off > 0 {
            self.rx.drain(..self.rx_off);
            self.rx_off = 0;
        }
        Ok(())
    }

    /// Hands every complete frame at the start of `buf` to `sink`; returns the bytes
    /// they span (the rest is an incomplete frame).
    fn decode_slice(
        &mut self,
        buf: &[u8],
        now: u64,
        sink: &mut FrameSink<'_>,
    ) -> Result<usize, ConnError> {
        if let Some(proto) = self.peer {
            return self.decode_peer(proto, buf, now, sink);
        }
        let mut ctx = ConnCtx {
            recvack: true,
            cipher: &mut self.cipher,
            state: &mut self.state,
            key: &self.key,
            version: self.version,
            read_ns: now,
            out: &mut self.tx,
            ws: self.transport == Transport::WebSocket,
            scratch: &mut self.scratch,
        };
        let mut off = 0;
        let r = loop {
            match decode(&buf[off..], ctx.version, MAX_FRAME_BYTES) {
                Ok(Some((frame, used))) => {
                    off += used;
                    if let Frame::Connack(c) = &frame {
                        if let Some(v) = c.server_version {
                            ctx.version = v;
                        }
                    }
                    sink(&mut ctx, frame);
                }
                Ok(None) => break Ok(off),
                Err(e) => break Err(ConnError::Protocol(e.to_string())),
            }
        };
        self.version = ctx.version;
        r
    }

    /// A peer's [`Conn::decode_slice`]: its replies and pushes handed to `sink` as
    /// the frames they stand for (see [`crate::peer`]).
    fn decode_peer(
        &mut self,
        proto: PeerProto,
        buf: &[u8],
        now: u64,
        sink: &mut FrameSink<'_>,
    ) -> Result<usize, ConnError> {
        let mut ctx = ConnCtx {
            recvack: false,
            cipher: &mut self.cipher,
            state: &mut self.state,
            key: &self.key,
            version: self.version,
            read_ns: now,
            out: &mut self.tx,
            ws: false,
            scratch: &mut self.scratch,
        };
        let mut off = 0;
        loop {
            let (ev, used) = match peer::decode(proto, &buf[off..]) {
                Ok(Some(x)) => x,
                Ok(None) => return Ok(off),
                Err(e) => return Err(ConnError::Protocol(format!("{}: {e}", proto.name()))),
            };
            off += used;
            let frame = match ev {
                PeerEvent::Ready if *ctx.state == ConnState::AwaitConnack => {
                    Frame::Connack(ConnackPacket {
                        reason_code: ReasonCode::SUCCESS,
                        ..Default::default()
                    })
                }
                PeerEvent::Ready | PeerEvent::Ignored => continue,
                PeerEvent::Ping => {
                    peer::encode_pong(ctx.out);
                    continue;
                }
                PeerEvent::Published(_) => {
                    self.peer_acked = self.peer_acked.wrapping_add(1);
                    Frame::Sendack(SendackPacket {
                        client_seq: self.peer_acked,
                        reason_code: ReasonCode::SUCCESS,
                        ..Default::default()
                    })
                }
                PeerEvent::Message(payload) => Frame::Recv(RecvPacket {
                    setting: Setting::NO_ENCRYPT,
                    payload,
                    ..Default::default()
                }),
            };
            sink(&mut ctx, frame);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_key_is_a_valid_x25519_public_key() {
        let k = client_key(42);
        assert_eq!(k.client_key().len(), 44);
        assert!(proto::crypto::decode_client_key(k.client_key()).is_ok());
        assert_ne!(k.client_key(), client_key(43).client_key());
    }
}
