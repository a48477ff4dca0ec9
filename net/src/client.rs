//! A small blocking wkproto client over TCP or WebSocket ([`proto::ws`]'s client
//! side; also `wss://`, WebSocket over rustls, [`Client::connect_wss`]): CONNECT with the key agreement, SEND (encrypted or NoEncrypt), RECV decryption and msg_key check,
//! RECVACK, PING. For integration tests and tools; not for the data path.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use proto::crypto::{ClientKey, SessionCipher};
use proto::wkproto::{
    decode, ChannelType, ConnectPacket, DeviceFlag, Flags, Frame, RecvackPacket, SendPacket,
    Setting, MAX_FRAME_BYTES,
};
use proto::ws::{self, UpgradeResponse, WsControl, WsDecoder, WsError};
pub use proto::Transport;

/// What a client logs in with.
#[derive(Clone, Debug)]
pub struct Login {
    /// The uid the CONNECT logs in as.
    pub uid: String,
    /// The uid's token, checked at its home node.
    pub token: String,
    /// The CONNECT's device flag (0 APP, 1 WEB, 2 PC).
    pub device_flag: u8,
    /// The CONNECT's device id.
    pub device_id: String,
    /// The wkproto version the CONNECT asks for; the client frames with the version
    /// `negotiate_version` gives for it.
    pub version: u8,
    /// The client's X25519 private key (fixed in tests for reproducibility).
    pub private_key: [u8; 32],
}

impl Login {
    /// A login for `uid` with `token`, device flag 1 (WEB), protocol version 6.
    pub fn new(uid: &str, token: &str) -> Login {
        let mut private_key = [7u8; 32];
        for (i, b) in uid.bytes().enumerate() {
            private_key[i % 32] ^= b;
        }
        Login {
            uid: uid.into(),
            token: token.into(),
            device_flag: 1,
            device_id: format!("{uid}-device"),
            version: 6,
            private_key,
        }
    }
}

/// A frame as the client keeps it (owned; RECV payload already decrypted).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Received {
    /// CONNACK (the login's own is read by the connect call, which returns its
    /// reason).
    Connack {
        /// The wkproto reason code (1 Success).
        reason: u8,
        /// The serving node's id (0 before wkproto version 4).
        node_id: u64,
    },
    /// SENDACK: the answer to one of this client's SENDs.
    Sendack {
        /// The SEND's `client_seq`, echoed.
        client_seq: u32,
        /// The committed message's id; 0 when refused.
        message_id: i64,
        /// The message's seq in its channel; 0 when refused or NoPersist.
        message_seq: u64,
        /// The wkproto reason code (1 Success).
        reason: u8,
    },
    /// RECV: a message delivered to this session.
    Recv(RecvMessage),
    /// DISCONNECT from the server (a kick is reason 12).
    Disconnect {
        /// The wkproto reason code.
        reason: u8,
        /// The server's explanation.
        text: String,
    },
    /// PONG: the answer to [`Client::ping`].
    Pong,
    /// SUBACK: the answer to a SUB.
    Suback {
        /// The wkproto reason code.
        reason: u8,
    },
    /// Any other packet a server should not send: its packet type.
    Other(u8),
}

/// A RECV, decrypted and checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecvMessage {
    /// The header's DUP flag: a re-send of a RECV not yet acknowledged.
    pub dup: bool,
    /// The RECV setting byte (NoEncrypt 0x10: the payload came as plaintext).
    pub setting: u8,
    /// The sender's uid.
    pub from_uid: String,
    /// The channel as this recipient sees it: a group's id, or for a person channel
    /// the other party's uid.
    pub channel_id: String,
    /// The wkproto channel_type (1 person, 2 group).
    pub channel_type: u8,
    /// The sender's client message number.
    pub client_msg_no: String,
    /// The message id (what [`Client::recvack`] acknowledges).
    pub message_id: i64,
    /// The message's seq in its channel.
    pub message_seq: u64,
    /// When the message was committed, in Unix seconds.
    pub timestamp_s: i32,
    /// The payload, decrypted with the session key (as sent with NoEncrypt).
    pub payload: Vec<u8>,
    /// Whether the msg_key matched (always true with NoEncrypt).
    pub msg_key_ok: bool,
}

/// Longest WebSocket upgrade response the client accepts.
const WS_UPGRADE_RESPONSE_MAX_BYTES: usize = 4 * 1024;
/// Bytes read per `read` call.
const READ_CHUNK_BYTES: usize = 16 * 1024;

/// A byte stream under the WebSocket framing: TCP, or TLS over TCP.
trait Io: Read + Write + Send {}
impl<T: Read + Write + Send> Io for T {}

enum Stream {
    Tcp(TcpStream),
    /// Framed by [`proto::ws`]: `raw` holds what arrived and is not deframed yet,
    /// `out` is the reused output buffer.
    Ws {
        tcp: Box<dyn Io>,
        decoder: WsDecoder,
        raw: Vec<u8>,
        out: Vec<u8>,
    },
}

/// Appends what one `read` brings to `buf`; Ok(0) at end of stream.
fn read_some(tcp: &mut (impl Read + ?Sized), buf: &mut Vec<u8>) -> io::Result<usize> {
    let mut chunk = [0u8; READ_CHUNK_BYTES];
    let n = tcp.read(&mut chunk)?;
    buf.extend_from_slice(&chunk[..n]);
    Ok(n)
}

fn eof() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "server closed the connection")
}

impl Stream {
    fn open(transport: Transport, addr: SocketAddr, timeout: Duration) -> io::Result<Stream> {
        let tcp = TcpStream::connect(addr)?;
        tcp.set_nodelay(true)?;
        tcp.set_read_timeout(Some(timeout))?;
        if transport != Transport::WebSocket {
            // Tcp (and Rpc, raw TCP too).
            return Ok(Stream::Tcp(tcp));
        }
        Stream::upgrade(Box::new(tcp), addr)
    }

    /// A `wss://` stream: TLS (verified by `tls` for `addr`'s IP address) under the
    /// WebSocket upgrade. The handshake's failure (an unknown certificate) is the
    /// error.
    fn open_tls(
        addr: SocketAddr,
        tls: Arc<rustls::ClientConfig>,
        timeout: Duration,
    ) -> io::Result<Stream> {
        let tcp = TcpStream::connect(addr)?;
        tcp.set_nodelay(true)?;
        tcp.set_read_timeout(Some(timeout))?;
        let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
        let conn = rustls::ClientConnection::new(tls, name).map_err(io::Error::other)?;
        let mut stream = rustls::StreamOwned::new(conn, tcp);
        while stream.conn.is_handshaking() {
            stream.conn.complete_io(&mut stream.sock)?;
        }
        Stream::upgrade(Box::new(stream), addr)
    }

    /// Runs the WebSocket upgrade on `tcp`.
    fn upgrade(mut tcp: Box<dyn Io>, addr: SocketAddr) -> io::Result<Stream> {
        let mut raw = Vec::new();
        ws::write_upgrade_request(&mut raw, &addr.to_string(), ws::SAMPLE_KEY);
        tcp.write_all(&raw)?;
        raw.clear();
        loop {
            match ws::upgrade_response(&raw, ws::SAMPLE_KEY) {
                UpgradeResponse::Done { consumed } => {
                    raw.drain(..consumed);
                    break;
                }
                UpgradeResponse::Refused(why) => return Err(bad(format!("WebSocket {why}"))),
                UpgradeResponse::Partial if raw.len() > WS_UPGRADE_RESPONSE_MAX_BYTES => {
                    return Err(bad("WebSocket upgrade response too long"))
                }
                UpgradeResponse::Partial => {
                    if read_some(&mut *tcp, &mut raw)? == 0 {
                        return Err(eof());
                    }
                }
            }
        }
        Ok(Stream::Ws {
            tcp,
            decoder: WsDecoder::client(),
            raw,
            out: Vec::new(),
        })
    }

    fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.write_all(bytes),
            Stream::Ws { tcp, out, .. } => {
                out.clear();
                ws::write_masked_binary(out, bytes, ws::FIXED_MASK);
                tcp.write_all(out)
            }
        }
    }

    /// Appends what arrives next to `rx`; Ok(0) at end of stream (or a close frame).
    fn read_into(&mut self, rx: &mut Vec<u8>) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => read_some(s, rx),
            Stream::Ws {
                tcp,
                decoder,
                raw,
                out,
            } => loop {
                let before = rx.len();
                let mut closed = false;
                out.clear();
                let used = decoder
                    .decode(raw, rx, MAX_FRAME_BYTES as u64, |c| match c {
                        WsControl::Ping(p) => ws::write_masked_pong(out, &p, ws::FIXED_MASK),
                        WsControl::Close(_) => closed = true,
                    })
                    .map_err(|WsError(code)| bad(format!("bad WebSocket frame (close {code})")))?;
                raw.drain(..used);
                if !out.is_empty() {
                    tcp.write_all(out)?;
                }
                if rx.len() > before {
                    return Ok(rx.len() - before);
                }
                if closed || read_some(&mut **tcp, raw)? == 0 {
                    return Ok(0);
                }
            },
        }
    }
}

/// A connected client.
pub struct Client {
    stream: Stream,
    version: u8,
    cipher: Option<SessionCipher>,
    rx: Vec<u8>,
    frame: Vec<u8>,
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

impl Client {
    /// Connects and sends CONNECT; returns the client and the CONNACK reason (1 = success).
    /// `timeout` bounds every later read.
    pub fn connect(addr: SocketAddr, login: &Login, timeout: Duration) -> io::Result<(Client, u8)> {
        Client::connect_via(Transport::Tcp, addr, login, timeout)
    }

    /// [`Client::connect`] over the given transport (WebSocket: one binary message
    /// per frame).
    pub fn connect_via(
        transport: Transport,
        addr: SocketAddr,
        login: &Login,
        timeout: Duration,
    ) -> io::Result<(Client, u8)> {
        Client::login(Stream::open(transport, addr, timeout)?, login)
    }

    /// [`Client::connect`] over `wss://`: TLS verified by `tls` for `addr`'s IP
    /// address, then the WebSocket upgrade. A handshake that fails (an unknown
    /// certificate) is the error.
    pub fn connect_wss(
        addr: SocketAddr,
        tls: Arc<rustls::ClientConfig>,
        login: &Login,
        timeout: Duration,
    ) -> io::Result<(Client, u8)> {
        Client::login(Stream::open_tls(addr, tls, timeout)?, login)
    }

    fn login(stream: Stream, login: &Login) -> io::Result<(Client, u8)> {
        let mut client = Client {
            stream,
            version: proto::wkproto::negotiate_version(login.version),
            cipher: None,
            rx: Vec::new(),
            frame: Vec::new(),
        };
        let key = ClientKey::new(login.private_key);
        client.send_connect(login, &key)?;
        let reason = client.await_connack(&key)?;
        Ok((client, reason))
    }

    fn send_connect(&mut self, login: &Login, key: &ClientKey) -> io::Result<()> {
        let connect = ConnectPacket {
            version: login.version,
            device_flag: DeviceFlag(login.device_flag),
            device_id: &login.device_id,
            uid: &login.uid,
            token: &login.token,
            client_timestamp_ms: 0,
            client_key: key.client_key(),
            ..Default::default()
        };
        self.frame.clear();
        connect
            .encode(0, &mut self.frame)
            .map_err(|e| bad(format!("{e:?}")))?;
        self.stream.write_all(&self.frame)
    }

    /// Reads the CONNACK; on success completes the key agreement. Returns its reason.
    fn await_connack(&mut self, key: &ClientKey) -> io::Result<u8> {
        let bytes = self.next_frame_bytes()?;
        let connack =
            match decode(&bytes, self.version, MAX_FRAME_BYTES).map_err(|e| bad(e.to_string()))? {
                Some((Frame::Connack(c), _)) => c,
                Some((other, _)) => {
                    return Err(bad(format!(
                        "expected CONNACK, got {:?}",
                        other.packet_type()
                    )))
                }
                None => return Err(bad("truncated frame")),
            };
        if connack.reason_code.0 == 1 {
            let cipher = key
                .session_cipher(connack.server_key, connack.salt)
                .map_err(|e| bad(e.to_string()))?;
            self.cipher = Some(cipher);
        }
        Ok(connack.reason_code.0)
    }

    /// Reads one whole frame's bytes.
    fn next_frame_bytes(&mut self) -> io::Result<Vec<u8>> {
        loop {
            if let Some(n) = proto::wkproto::peek_frame_len(&self.rx, MAX_FRAME_BYTES)
                .map_err(|e| bad(e.to_string()))?
            {
                if n <= self.rx.len() {
                    let frame: Vec<u8> = self.rx.drain(..n).collect();
                    return Ok(frame);
                }
            }
            if self.stream.read_into(&mut self.rx)? == 0 {
                return Err(eof());
            }
        }
    }

    /// Sends a SEND; `encrypt` false sets NoEncrypt.
    pub fn send(
        &mut self,
        channel_id: &str,
        channel_type: u8,
        client_seq: u32,
        client_msg_no: &str,
        payload: &[u8],
        encrypt: bool,
    ) -> io::Result<()> {
        let mut p = SendPacket {
            setting: if encrypt {
                Setting::NONE
            } else {
                Setting::NO_ENCRYPT
            },
            client_seq,
            client_msg_no,
            channel_id,
            channel_type: ChannelType(channel_type),
            payload,
            ..Default::default()
        };
        let mut sealed = Vec::new();
        let key;
        if encrypt {
            let cipher = self.cipher.as_ref().ok_or_else(|| bad("not connected"))?;
            cipher.encrypt_into(payload, &mut sealed);
            p.payload = &sealed;
            key = cipher.send_msg_key(&p);
            p.msg_key = key.as_str();
        }
        self.frame.clear();
        p.encode(self.version, &mut self.frame)
            .map_err(|e| bad(format!("{e:?}")))?;
        self.stream.write_all(&self.frame)
    }

    /// Sends a SEND whose msg_key is right but whose payload is not valid ciphertext
    /// (for tests: the server must answer SENDACK 9 PayloadDecodeError).
    pub fn send_undecryptable(
        &mut self,
        channel_id: &str,
        channel_type: u8,
        client_seq: u32,
    ) -> io::Result<()> {
        let cipher = self.cipher.as_ref().ok_or_else(|| bad("not connected"))?;
        let mut p = SendPacket {
            client_seq,
            client_msg_no: "undecryptable",
            channel_id,
            channel_type: ChannelType(channel_type),
            payload: b"%%% not base64 %%%",
            ..Default::default()
        };
        let key = cipher.send_msg_key(&p);
        p.msg_key = key.as_str();
        self.frame.clear();
        p.encode(self.version, &mut self.frame)
            .map_err(|e| bad(format!("{e:?}")))?;
        self.stream.write_all(&self.frame)
    }

    /// Sends raw bytes (for bad-input tests).
    pub fn send_raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// Sends PING.
    pub fn ping(&mut self) -> io::Result<()> {
        self.stream.write_all(&[0x70])
    }

    /// Acknowledges a RECV.
    pub fn recvack(&mut self, message_id: i64, message_seq: u64) -> io::Result<()> {
        let p = RecvackPacket {
            message_id,
            message_seq,
            ..Default::default()
        };
        self.frame.clear();
        p.encode(self.version, &mut self.frame)
            .map_err(|e| bad(format!("{e:?}")))?;
        self.stream.write_all(&self.frame)
    }

    /// Reads the next frame (blocking up to the read timeout).
    pub fn read(&mut self) -> io::Result<Received> {
        let bytes = self.next_frame_bytes()?;
        let (frame, _) = decode(&bytes, self.version, MAX_FRAME_BYTES)
            .map_err(|e| bad(e.to_string()))?
            .ok_or_else(|| bad("truncated frame"))?;
        Ok(match frame {
            Frame::Connack(c) => Received::Connack {
                reason: c.reason_code.0,
                node_id: c.node_id,
            },
            Frame::Sendack(a) => Received::Sendack {
                client_seq: a.client_seq,
                message_id: a.message_id,
                message_seq: a.message_seq,
                reason: a.reason_code.0,
            },
            Frame::Recv(r) => {
                let (payload, msg_key_ok) = if r.setting.contains(Setting::NO_ENCRYPT) {
                    (r.payload.to_vec(), true)
                } else {
                    let cipher = self
                        .cipher
                        .as_ref()
                        .ok_or_else(|| bad("RECV before key agreement"))?;
                    let ok = cipher.recv_msg_key(&r).as_str() == r.msg_key;
                    let mut plain = Vec::new();
                    cipher
                        .decrypt(r.payload, &mut plain)
                        .map_err(|e| bad(e.to_string()))?;
                    (plain, ok)
                };
                Received::Recv(RecvMessage {
                    dup: r.flags.contains(Flags::DUP),
                    setting: r.setting.0,
                    from_uid: r.from_uid.into(),
                    channel_id: r.channel_id.into(),
                    channel_type: r.channel_type.0,
                    client_msg_no: r.client_msg_no.into(),
                    message_id: r.message_id,
                    message_seq: r.message_seq,
                    timestamp_s: r.timestamp_s,
                    payload,
                    msg_key_ok,
                })
            }
            Frame::Disconnect(d) => Received::Disconnect {
                reason: d.reason_code.0,
                text: d.reason.into(),
            },
            Frame::Pong => Received::Pong,
            Frame::Suback(s) => Received::Suback {
                reason: s.reason_code.0,
            },
            other => Received::Other(other.packet_type().as_u8()),
        })
    }

    /// Whether the server closed the connection (reads until EOF or the timeout).
    pub fn wait_closed(&mut self) -> io::Result<Vec<Received>> {
        let mut seen = Vec::new();
        loop {
            match self.read() {
                Ok(f) => seen.push(f),
                Err(e)
                    if e.kind() == io::ErrorKind::UnexpectedEof
                        || e.kind() == io::ErrorKind::ConnectionReset =>
                {
                    return Ok(seen)
                }
                Err(e) => return Err(e),
            }
        }
    }
}
