//! A blocking JSON-RPC client over WebSocket text messages, as the EasySDKs speak
//! it (`proto::jsonrpc`), on the framing of `proto::ws`.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use proto::ws::{self, UpgradeResponse, WsControl, WsDecoder};
use serde_json::{json, Value};

/// What the server sent next.
#[derive(Debug, PartialEq)]
pub enum Event {
    /// One text message, parsed.
    Message(Value),
    /// The server's close frame (its code), then the end of the stream.
    Closed(Option<u16>),
}

pub struct RpcClient {
    tcp: TcpStream,
    decoder: WsDecoder,
    raw: Vec<u8>,
    rx: Vec<u8>,
    closed: Option<Option<u16>>,
    next_id: u64,
}

impl RpcClient {
    /// Opens a WebSocket to `addr`; every read times out after `timeout` (a failure
    /// detector, not a wait).
    pub fn open(addr: SocketAddr, timeout: Duration) -> RpcClient {
        let mut tcp = TcpStream::connect(addr).unwrap();
        tcp.set_read_timeout(Some(timeout)).unwrap();
        tcp.set_nodelay(true).unwrap();
        let mut req = Vec::new();
        ws::write_upgrade_request(&mut req, &addr.to_string(), ws::SAMPLE_KEY);
        tcp.write_all(&req).unwrap();
        let mut raw = Vec::new();
        loop {
            match ws::upgrade_response(&raw, ws::SAMPLE_KEY) {
                UpgradeResponse::Done { consumed } => {
                    raw.drain(..consumed);
                    break;
                }
                UpgradeResponse::Refused(why) => panic!("upgrade refused: {why}"),
                UpgradeResponse::Partial => {
                    let mut chunk = [0u8; 4096];
                    let n = tcp.read(&mut chunk).unwrap();
                    assert!(n > 0, "closed during the upgrade");
                    raw.extend_from_slice(&chunk[..n]);
                }
            }
        }
        RpcClient {
            tcp,
            decoder: WsDecoder::client(),
            raw,
            rx: Vec::new(),
            closed: None,
            next_id: 1,
        }
    }

    /// Sends `text` as one text message.
    pub fn send_text(&mut self, text: &[u8]) -> io::Result<()> {
        let mut out = Vec::new();
        ws::write_masked_text(&mut out, text, ws::FIXED_MASK);
        self.tcp.write_all(&out)
    }

    /// Sends requests `(method, params)` with the given ids in one write (they reach
    /// the node together).
    pub fn requests_at_once(&mut self, requests: &[(&str, &str, Value)]) {
        let mut out = Vec::new();
        for (id, method, params) in requests {
            let v = json!({"jsonrpc": "2.0", "method": method, "params": params, "id": id});
            ws::write_masked_text(&mut out, v.to_string().as_bytes(), ws::FIXED_MASK);
        }
        self.tcp.write_all(&out).unwrap();
    }

    /// Sends the first fragment of a text message (not final; under 126 bytes).
    pub fn send_text_fragment(&mut self, text: &[u8]) -> io::Result<()> {
        assert!(text.len() < 126);
        let mut out = vec![0x01, 0x80 | text.len() as u8];
        out.extend_from_slice(&ws::FIXED_MASK);
        let start = out.len();
        out.extend_from_slice(text);
        ws::apply_mask(&mut out[start..], ws::FIXED_MASK);
        self.tcp.write_all(&out)
    }

    /// Sends `bytes` as one binary message.
    pub fn send_binary(&mut self, bytes: &[u8]) -> io::Result<()> {
        let mut out = Vec::new();
        ws::write_masked_binary(&mut out, bytes, ws::FIXED_MASK);
        self.tcp.write_all(&out)
    }

    pub fn send_json(&mut self, v: &Value) {
        self.send_text(v.to_string().as_bytes()).unwrap();
    }

    /// Sends request `method` with a fresh string id; returns the id.
    pub fn request(&mut self, method: &str, params: Value) -> String {
        let id = format!("r{}", self.next_id);
        self.next_id += 1;
        self.send_json(&json!({"jsonrpc": "2.0", "method": method, "params": params, "id": id}));
        id
    }

    /// The next message or the close.
    pub fn next(&mut self) -> Event {
        loop {
            if let Some((msg, used)) = ws::next_text_message(&self.rx) {
                let v: Value = serde_json::from_slice(msg)
                    .unwrap_or_else(|e| panic!("server sent bad JSON ({e}): {msg:?}"));
                self.rx.drain(..used);
                return Event::Message(v);
            }
            if let Some(code) = self.closed {
                return Event::Closed(code);
            }
            let mut closed = None;
            let used = self
                .decoder
                .decode(&self.raw, &mut self.rx, 1 << 24, |c| {
                    if let WsControl::Close(code) = c {
                        closed = Some(code);
                    }
                })
                .expect("server frames are valid");
            self.raw.drain(..used);
            if closed.is_some() {
                self.closed = closed;
                continue;
            }
            if ws::next_text_message(&self.rx).is_some() {
                continue;
            }
            let mut chunk = [0u8; 16 * 1024];
            let n = match self.tcp.read(&mut chunk) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => 0,
                Err(e) => panic!("read: {e}"),
            };
            if n == 0 {
                self.closed = Some(None);
                continue;
            }
            self.raw.extend_from_slice(&chunk[..n]);
        }
    }

    /// The next message (panics at the close).
    pub fn message(&mut self) -> Value {
        match self.next() {
            Event::Message(v) => v,
            Event::Closed(code) => panic!("closed ({code:?}) instead of a message"),
        }
    }

    /// The answer to request `id`; notifications before it are returned too.
    pub fn answer(&mut self, id: &str) -> (Value, Vec<Value>) {
        let mut notes = Vec::new();
        loop {
            let v = self.message();
            if v["id"] == id {
                return (v, notes);
            }
            notes.push(v);
        }
    }

    /// The next `recv` notification (answers to requests are skipped).
    pub fn recv(&mut self) -> Value {
        loop {
            let v = self.message();
            if v["method"] == "recv" {
                return v["params"].clone();
            }
            assert!(v.get("id").is_some(), "expected recv, got {v}");
        }
    }

    /// Everything until the close, and the close code.
    pub fn until_closed(&mut self) -> (Vec<Value>, Option<u16>) {
        let mut seen = Vec::new();
        loop {
            match self.next() {
                Event::Message(v) => seen.push(v),
                Event::Closed(code) => return (seen, code),
            }
        }
    }

    /// `connect` as `uid` with `token` and device flag 1; the answer.
    pub fn connect(&mut self, uid: &str, token: &str) -> Value {
        let id = self.request(
            "connect",
            json!({"uid": uid, "token": token, "deviceId": format!("{uid}-rpc"),
                   "deviceFlag": 1, "clientTimestamp": 1_700_000_000_000_i64}),
        );
        self.answer(&id).0
    }
}
