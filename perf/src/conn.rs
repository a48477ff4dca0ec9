//! One client connection of the load loop, sans-IO: wkproto over TCP or WebSocket,
//! or JSON-RPC over WebSocket text messages, either WebSocket plain or inside TLS
//! (`wss://`, [`crate::tls`]), or a peer server's client (Redis, NATS:
//! [`crate::peer`]). It owns no socket: the load loop dials one with
//! `net::io::NetDriver::connect` (a raw byte stream), hands every batch of bytes the
//! driver read to [`Conn::on_bytes`] and sends what [`Conn::output`] gives (then
//! [`Conn::output_taken`]) with the driver's `send`.
//!
//! Frames queued before the WebSocket upgrade completes are kept and released once
//! it does (the driver itself queues what is sent before the TCP connect completes).
//! Every buffer has a limit; exceeding one is an error value, and the connection is
//! then closed by its owner.
//!
//! With TLS, what the driver read is ciphertext: [`Conn::on_bytes`] opens it first,
//! and the queued output is plaintext sealed into records by [`Conn::output`]: the
//! frames queued between two sends share records, as the node's own output does.
//! JSON-RPC messages are handed to the frame sink as the wkproto frames they stand
//! for.

use std::io;
use std::net::SocketAddr;

pub use proto::crypto::ClientKey;
use proto::crypto::SessionCipher;
use proto::wkproto::{
    decode, ConnackPacket, ConnectPacket, DeviceFlag, DisconnectPacket, Flags, Frame, ReasonCode,
    RecvPacket, RecvackPacket, SendackPacket, Setting, MAX_FRAME_BYTES,
};
use proto::ws::{self, UpgradeResponse, WsControl, WsDecoder, WsError};
pub use proto::Transport;

use crate::jsonrpc::{self, Incoming};
use crate::peer::{self, PeerEvent, PeerProto, PeerRole};
use crate::tls::{ClientTls, Opened, TlsLayer};

/// How a client speaks to the node: the stream's framing, TLS around a WebSocket,
/// and the protocol inside (wkproto, or JSON-RPC in text messages).
#[derive(Clone, Debug)]
pub struct Wire {
    pub transport: Transport,
    /// `wss://`: the WebSocket inside TLS.
    pub tls: Option<ClientTls>,
    /// JSON-RPC text messages instead of binary wkproto (WebSocket only).
    pub jsonrpc: bool,
}

impl Wire {
    /// wkproto over `transport`, no TLS.
    pub fn plain(transport: Transport) -> Wire {
        Wire {
            transport,
            tls: None,
            jsonrpc: false,
        }
    }

    /// The name in reports: `tcp`, `ws`, `wss`, `ws+jsonrpc`, `wss+jsonrpc`.
    pub fn name(&self) -> String {
        let t = match (self.transport, self.tls.is_some()) {
            (Transport::WebSocket, true) => "wss",
            (t, _) => t.name(),
        };
        if self.jsonrpc {
            format!("{t}+jsonrpc")
        } else {
            t.to_string()
        }
    }
}

/// Bytes one connection buffers for reading before a frame must be complete.
pub const RX_CAPACITY_MAX_BYTES: usize = MAX_FRAME_BYTES + 64 * 1024;
/// Bytes one connection may have queued for writing (the socket is then too slow):
/// its own queue before the upgrade or a send, and the driver's queue of it.
pub const TX_CAPACITY_MAX_BYTES: usize = 8 << 20;
/// Initial receive buffer (grown on demand up to [`RX_CAPACITY_MAX_BYTES`]).
const RX_INITIAL_BYTES: usize = 4 * 1024;
/// Plaintext buffer one TLS read batch keeps between uses.
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
    /// Read batches handed in ([`Conn::on_bytes`]) and outputs handed to the driver
    /// ([`Conn::output_taken`]): the harness's own work per RECV.
    pub reads: u64,
    pub writes: u64,
    key: ClientKey,
    rx: Vec<u8>,
    rx_off: usize,
    /// WebSocket: raw bytes not yet deframed, and the frame decoder.
    ws_raw: Vec<u8>,
    ws: WsDecoder,
    /// Output not yet handed to the driver (with TLS: plaintext, sealed by
    /// [`Conn::output`]).
    tx: Vec<u8>,
    /// Frames queued while the WebSocket upgrade is pending (already WS-framed).
    pending: Vec<u8>,
    scratch: Vec<u8>,
    /// A peer's connection (Redis, NATS) instead of wkproto.
    pub peer: Option<PeerProto>,
    /// `wss://`: the connection's TLS (boxed: rustls's state is large).
    tls: Option<Box<TlsLayer>>,
    /// Plaintext opened from one read (reused).
    opened: Vec<u8>,
    /// JSON-RPC text messages instead of wkproto.
    pub jsonrpc: bool,
    /// Peer publishes answered so far (Redis answers in order: the next answer is
    /// for client_seq `peer_acked + 1`).
    peer_acked: u32,
}

/// What [`Conn::on_bytes`] hands to its callback: a decoded frame of this connection.
pub type FrameSink<'a> = dyn FnMut(&mut ConnCtx<'_>, Frame<'_>) + 'a;

/// The parts of a connection a frame callback may use while the frame borrows `rx`.
pub struct ConnCtx<'a> {
    pub cipher: &'a mut Option<SessionCipher>,
    pub state: &'a mut ConnState,
    pub version: u8,
    /// When the read batch that brought this frame in was taken (ns since the run's
    /// start).
    pub read_ns: u64,
    /// Whether RECVs are acknowledged (wkproto); a peer has no RECVACK.
    pub recvack: bool,
    key: &'a ClientKey,
    out: &'a mut Vec<u8>,
    ws: bool,
    /// JSON-RPC: frames are text messages.
    text: bool,
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
        queue_into(self.out, self.ws, self.text, self.scratch, encode);
    }

    /// Queues the acknowledgement of a RECV: a RECVACK, or JSON-RPC's `recvack`.
    pub fn recvack(&mut self, message_id: i64, message_seq: u64) {
        if self.text {
            self.queue(|out| jsonrpc::encode_recvack(message_id, message_seq, out));
            return;
        }
        let ack = RecvackPacket {
            message_id,
            message_seq,
            ..Default::default()
        };
        let v = self.version;
        self.queue(|out| {
            let _ = ack.encode(v, out);
        });
    }
}

fn queue_into(
    out: &mut Vec<u8>,
    ws: bool,
    text: bool,
    scratch: &mut Vec<u8>,
    encode: impl FnOnce(&mut Vec<u8>),
) {
    if ws {
        scratch.clear();
        encode(scratch);
        if text {
            ws::write_masked_text(out, scratch, ws::FIXED_MASK);
        } else {
            ws::write_masked_binary(out, scratch, ws::FIXED_MASK);
        }
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
    /// A client of the node at `addr` (its IP names the TLS server, its text the
    /// WebSocket `Host`) with the TLS handshake and the WebSocket upgrade (if any)
    /// and CONNECT (or JSON-RPC's `connect`) for `uid`/`token` queued: the owner
    /// dials `addr` and sends [`Conn::output`].
    pub fn new(
        addr: SocketAddr,
        wire: &Wire,
        uid: &str,
        token: &str,
        key: &ClientKey,
        now_ns: u64,
    ) -> Result<Conn, ConnError> {
        let transport = wire.transport;
        let ws_only =
            |what: &str| ConnError::Protocol(format!("{what} needs the WebSocket transport"));
        if transport != Transport::WebSocket && wire.tls.is_some() {
            return Err(ws_only("TLS"));
        }
        if transport != Transport::WebSocket && wire.jsonrpc {
            return Err(ws_only("JSON-RPC"));
        }
        let tls = match &wire.tls {
            Some(t) => Some(Box::new(t.layer(addr.ip())?)),
            None => None,
        };
        let mut c = Conn {
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
            pending: Vec::new(),
            scratch: Vec::new(),
            peer: None,
            peer_acked: 0,
            tls,
            opened: Vec::new(),
            jsonrpc: wire.jsonrpc,
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
        if wire.jsonrpc {
            c.queue(|out| jsonrpc::encode_connect(uid, token, out))?;
            return Ok(c);
        }
        let mut encoded = Ok(0);
        c.queue(|out| encoded = connect.encode(6, out))?;
        encoded.map_err(|e| ConnError::Protocol(format!("{e:?}")))?;
        Ok(c)
    }

    /// A client of a peer server with its greeting (subscription or PING) queued:
    /// the connection is Active once the server confirms it.
    pub fn new_peer(addr: SocketAddr, role: &PeerRole, now_ns: u64) -> Result<Conn, ConnError> {
        let wire = Wire::plain(Transport::Tcp);
        let mut c = Conn::new(addr, &wire, "", "", &client_key(0), now_ns)?;
        c.tx.clear();
        c.peer = Some(role.proto);
        peer::encode_hello(role, &mut c.tx);
        Ok(c)
    }

    /// Queues one frame (encoded by `encode`); the owner sends [`Conn::output`].
    pub fn queue(&mut self, encode: impl FnOnce(&mut Vec<u8>)) -> Result<(), ConnError> {
        let ws = self.transport == Transport::WebSocket;
        let out = if self.state == ConnState::WsUpgrade {
            &mut self.pending
        } else {
            &mut self.tx
        };
        queue_into(out, ws, self.jsonrpc, &mut self.scratch, encode);
        if self.tx.len() + self.pending.len() > TX_CAPACITY_MAX_BYTES {
            return Err(ConnError::BufferFull);
        }
        Ok(())
    }

    /// The bytes to send now: what was queued (with TLS sealed into records first;
    /// before the handshake completes rustls keeps the plaintext). Empty when nothing
    /// is to be sent. Call [`Conn::output_taken`] once they were handed to the driver.
    pub fn output(&mut self) -> Result<&[u8], ConnError> {
        match self.tls.as_mut() {
            None => Ok(&self.tx),
            Some(t) => {
                t.seal(&mut self.tx).map_err(ConnError::Protocol)?;
                if t.pending() > TX_CAPACITY_MAX_BYTES {
                    return Err(ConnError::BufferFull);
                }
                Ok(&t.out[t.out_off..])
            }
        }
    }

    /// The bytes [`Conn::output`] gave were handed to the driver (counted as one
    /// write when there were any): they are forgotten here.
    pub fn output_taken(&mut self) {
        let buf = match self.tls.as_mut() {
            Some(t) => {
                t.out_off = 0;
                &mut t.out
            }
            None => &mut self.tx,
        };
        if !buf.is_empty() {
            self.writes += 1;
            buf.clear();
        }
    }

    /// Handles one batch of bytes the driver read (taken at `now`, ns since the
    /// run's start: all frames of one batch arrived together): hands every frame they
    /// complete to `sink`, keeps an incomplete tail. TCP frames are decoded in place
    /// from `data` when no earlier tail is pending. With TLS the bytes are opened
    /// first (handshake answers are queued for the next [`Conn::output`]). Frames the
    /// sink queues (RECVACKs) wait for the owner's next send: the RECVACKs of one
    /// batch leave in one send.
    pub fn on_bytes(
        &mut self,
        data: &[u8],
        now: u64,
        sink: &mut FrameSink<'_>,
    ) -> Result<(), ConnError> {
        self.reads += 1;
        let Some(tls) = self.tls.as_mut() else {
            return self.on_plain(data, now, sink);
        };
        let mut opened = std::mem::take(&mut self.opened);
        opened.clear();
        let r = tls.open(data, &mut opened, RX_CAPACITY_MAX_BYTES);
        let r = match r {
            Ok(state) => self.on_plain(&opened, now, sink).and(match state {
                Opened::Open => Ok(()),
                Opened::Closed => Err(ConnError::Eof),
            }),
            Err(why) => Err(ConnError::Protocol(why)),
        };
        if opened.capacity() <= READ_CHUNK_BYTES {
            self.opened = opened;
        }
        r
    }

    /// [`Conn::on_bytes`] past TLS.
    fn on_plain(
        &mut self,
        data: &[u8],
        now: u64,
        sink: &mut FrameSink<'_>,
    ) -> Result<(), ConnError> {
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
        if self.jsonrpc {
            return self.decode_jsonrpc(buf, now, sink);
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
            text: false,
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
            text: false,
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

impl Conn {
    /// JSON-RPC's [`Conn::decode_slice`]: every whole text message (behind its
    /// length prefix) handed to `sink` as the frame it stands for.
    fn decode_jsonrpc(
        &mut self,
        buf: &[u8],
        now: u64,
        sink: &mut FrameSink<'_>,
    ) -> Result<usize, ConnError> {
        let mut ctx = ConnCtx {
            recvack: true,
            cipher: &mut self.cipher,
            state: &mut self.state,
            key: &self.key,
            version: self.version,
            read_ns: now,
            out: &mut self.tx,
            ws: true,
            text: true,
            scratch: &mut self.scratch,
        };
        let mut off = 0;
        while let Some((text, used)) = ws::next_text_message(&buf[off..]) {
            off += used;
            let incoming = jsonrpc::decode(text).map_err(ConnError::Protocol)?;
            sink_incoming(&mut ctx, incoming, sink);
        }
        Ok(off)
    }
}

/// Hands one decoded JSON-RPC message to `sink` as the wkproto frame it stands for
/// (what the binary decoder would have produced).
fn sink_incoming(ctx: &mut ConnCtx<'_>, incoming: Incoming, sink: &mut FrameSink<'_>) {
    match incoming {
        Incoming::Connected {
            reason,
            server_key,
            salt,
            server_version,
        } => sink(
            ctx,
            Frame::Connack(ConnackPacket {
                reason_code: ReasonCode(reason),
                server_key: &server_key,
                salt: &salt,
                server_version,
                ..Default::default()
            }),
        ),
        Incoming::Sent {
            client_seq,
            message_id,
            message_seq,
            reason,
        } => sink(
            ctx,
            Frame::Sendack(SendackPacket {
                client_seq,
                message_id,
                message_seq,
                reason_code: ReasonCode(reason),
                ..Default::default()
            }),
        ),
        Incoming::Recv {
            message_id,
            message_seq,
            dup,
            payload,
        } => sink(
            ctx,
            Frame::Recv(RecvPacket {
                flags: if dup { Flags::DUP } else { Flags::NONE },
                setting: Setting::NO_ENCRYPT,
                message_id,
                message_seq,
                payload: &payload,
                ..Default::default()
            }),
        ),
        Incoming::Disconnect { reason } => sink(
            ctx,
            Frame::Disconnect(DisconnectPacket {
                reason_code: ReasonCode(reason),
                ..Default::default()
            }),
        ),
        Incoming::Ignored => {}
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
