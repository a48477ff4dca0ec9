//! WebSocket, sans-IO, both sides: the HTTP/1.1 upgrade (`httparse`, accept key from
//! `tungstenite`) and frame decoding/encoding (`tungstenite`'s [`FrameHeader`]) on
//! our own buffers.
//!
//! A connection's first data message picks its mode ([`WsMode`]), kept for its
//! life: binary (wkproto) messages have their payloads appended to the
//! connection's input as one byte stream; text (JSON-RPC, [`crate::jsonrpc`])
//! messages keep their boundaries, each appended as a 4-byte little-endian length
//! and the message ([`next_text_message`] takes one). A message of the other kind
//! closes the connection with 1003.
//!
//! - Server (`net::io`): [`handshake`] answers an upgrade request,
//!   [`WsDecoder::default`] takes masked client frames, [`write_binary`] and friends
//!   write unmasked frames.
//! - Client (`net::client`, imbench): [`write_upgrade_request`] and
//!   [`upgrade_response`], [`WsDecoder::client`] takes unmasked server frames,
//!   [`write_masked_binary`] and [`write_masked_pong`] write masked frames (no
//!   allocation: the payload is copied once and masked in place).

use std::io::Cursor;

pub use tungstenite::protocol::frame::coding::{Control, Data, OpCode};
use tungstenite::protocol::frame::FrameHeader;

/// A fixed `Sec-WebSocket-Key` (RFC 6455 §1.3's sample nonce), for clients that
/// need no unpredictability: tests and the load harness.
pub const SAMPLE_KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";
/// A fixed masking key for the same clients (masking is not a secret).
pub const FIXED_MASK: [u8; 4] = [0x1b, 0x5e, 0x7a, 0x33];
/// Headers parsed from an upgrade request.
const HANDSHAKE_HEADERS_MAX: usize = 32;
/// Close codes we send.
pub const CLOSE_NORMAL: u16 = 1000;
pub const CLOSE_PROTOCOL: u16 = 1002;
pub const CLOSE_UNSUPPORTED: u16 = 1003;
pub const CLOSE_TOO_BIG: u16 = 1009;
/// Largest control frame payload (RFC 6455 §5.5).
const CONTROL_PAYLOAD_MAX: u64 = 125;

/// Whether a close code received from the peer may be sent back (RFC 6455 §7.4).
pub fn close_code_sendable(code: u16) -> bool {
    matches!(code, 1000..=1003 | 1007..=1014 | 3000..=4999)
}

/// Outcome of feeding bytes to the upgrade parser.
#[derive(Debug, PartialEq, Eq)]
pub enum Handshake {
    /// The request is incomplete.
    Partial,
    /// Upgrade accepted: the 101 response to send, and how many bytes the request took
    /// (what follows is frame data).
    Done { response: Vec<u8>, consumed: usize },
    /// Not a valid upgrade: the error response to send before closing.
    Reject(Vec<u8>),
}

/// Parses an HTTP/1.1 WebSocket upgrade request from the start of `buf`.
pub fn handshake(buf: &[u8]) -> Handshake {
    let mut headers = [httparse::EMPTY_HEADER; HANDSHAKE_HEADERS_MAX];
    let mut req = httparse::Request::new(&mut headers);
    let consumed = match req.parse(buf) {
        Ok(httparse::Status::Partial) => return Handshake::Partial,
        Ok(httparse::Status::Complete(n)) => n,
        Err(_) => return Handshake::Reject(reject()),
    };
    if req.method != Some("GET") || req.version != Some(1) {
        return Handshake::Reject(reject());
    }
    let header = |name: &str| {
        req.headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .map(|h| h.value)
    };
    let has_token = |name: &str, token: &str| {
        header(name).is_some_and(|v| {
            std::str::from_utf8(v)
                .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
        })
    };
    let key = match header("sec-websocket-key") {
        Some(k) if !k.is_empty() => k,
        _ => return Handshake::Reject(reject()),
    };
    if !has_token("upgrade", "websocket")
        || !has_token("connection", "upgrade")
        || header("sec-websocket-version") != Some(b"13")
    {
        return Handshake::Reject(reject());
    }
    let accept = tungstenite::handshake::derive_accept_key(key);
    let response = format!(
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n\r\n"
    );
    Handshake::Done {
        response: response.into_bytes(),
        consumed,
    }
}

/// Appends a client's upgrade request for `/` on `host` with the
/// `Sec-WebSocket-Key` `key` (base64 of 16 bytes; check the answer with
/// [`upgrade_response`]).
pub fn write_upgrade_request(out: &mut Vec<u8>, host: &str, key: &str) {
    out.extend_from_slice(b"GET / HTTP/1.1\r\nHost: ");
    out.extend_from_slice(host.as_bytes());
    out.extend_from_slice(b"\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: ");
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(b"\r\nSec-WebSocket-Version: 13\r\n\r\n");
}

/// What a client makes of the bytes answering its upgrade request.
#[derive(Debug, PartialEq, Eq)]
pub enum UpgradeResponse {
    /// The response is incomplete.
    Partial,
    /// Upgraded: the response took `consumed` bytes (what follows is frame data).
    Done { consumed: usize },
    /// Refused or malformed, with why.
    Refused(String),
}

/// Parses the response to [`write_upgrade_request`] with `key` from the start of
/// `buf`: a `101` with the matching `Sec-WebSocket-Accept` (RFC 6455 §4.1).
pub fn upgrade_response(buf: &[u8], key: &str) -> UpgradeResponse {
    let mut headers = [httparse::EMPTY_HEADER; HANDSHAKE_HEADERS_MAX];
    let mut resp = httparse::Response::new(&mut headers);
    let consumed = match resp.parse(buf) {
        Ok(httparse::Status::Partial) => return UpgradeResponse::Partial,
        Ok(httparse::Status::Complete(n)) => n,
        Err(e) => return UpgradeResponse::Refused(format!("malformed upgrade response: {e}")),
    };
    if resp.code != Some(101) {
        return UpgradeResponse::Refused(format!(
            "upgrade refused: HTTP {}",
            resp.code.unwrap_or(0)
        ));
    }
    let accept = resp
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("sec-websocket-accept"))
        .map(|h| h.value);
    if accept != Some(tungstenite::handshake::derive_accept_key(key.as_bytes()).as_bytes()) {
        return UpgradeResponse::Refused("wrong Sec-WebSocket-Accept".into());
    }
    UpgradeResponse::Done { consumed }
}

fn reject() -> Vec<u8> {
    b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\nContent-Length: 0\r\n\r\n".to_vec()
}

/// Bytes before each text message in a text-mode connection's input: its length,
/// little-endian.
pub const TEXT_PREFIX_BYTES: usize = 4;

/// What a connection's data messages are, decided by its first one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WsMode {
    /// No data message yet.
    #[default]
    Undecided,
    /// Binary messages: one byte stream (wkproto).
    Binary,
    /// Text messages, boundaries kept (JSON-RPC).
    Text,
}

/// The first whole text message of a text-mode connection's input and the bytes
/// it takes there (prefix included); `None` until one is whole.
pub fn next_text_message(input: &[u8]) -> Option<(&[u8], usize)> {
    let prefix: [u8; TEXT_PREFIX_BYTES] = input.get(..TEXT_PREFIX_BYTES)?.try_into().ok()?;
    let len = u32::from_le_bytes(prefix) as usize;
    let end = TEXT_PREFIX_BYTES.checked_add(len)?;
    input.get(TEXT_PREFIX_BYTES..end).map(|m| (m, end))
}

/// Per-connection frame decoder state. [`WsDecoder::default`] is the server's
/// (client frames must be masked), [`WsDecoder::client`] the client's (server frames
/// must not be, RFC 6455 §5.1).
#[derive(Debug, Default)]
pub struct WsDecoder {
    /// A data message is in progress: continuation frames are expected.
    in_message: bool,
    /// Payload bytes of the message in progress.
    message_bytes: u64,
    /// Decodes a server's frames (unmasked) rather than a client's (masked).
    client: bool,
    /// Binary or text, from the first data message on.
    mode: WsMode,
    /// A fragmented text message so far (at most the message limit).
    text: Vec<u8>,
}

/// What decoding found besides data.
#[derive(Debug, PartialEq, Eq)]
pub enum WsControl {
    /// Reply with a pong carrying this payload.
    Ping(Vec<u8>),
    /// The peer sent a close frame (with its status code if any).
    Close(Option<u16>),
}

/// Why the input is rejected; the close code to send.
#[derive(Debug, PartialEq, Eq)]
pub struct WsError(pub u16);

impl WsDecoder {
    /// The client side's decoder: it takes unmasked frames only.
    pub fn client() -> WsDecoder {
        WsDecoder {
            client: true,
            ..WsDecoder::default()
        }
    }

    /// The connection's mode so far.
    pub fn mode(&self) -> WsMode {
        self.mode
    }

    /// Whether a frame with `header` and a payload of `len` bytes may come next:
    /// no reserved bits or opcodes, masked as the side requires, short final control
    /// frames, continuations only within a message, data of the connection's mode
    /// only, messages within `message_bytes_max`.
    fn check(&self, header: &FrameHeader, len: u64, message_bytes_max: u64) -> Result<(), WsError> {
        if header.rsv1 || header.rsv2 || header.rsv3 {
            return Err(WsError(CLOSE_PROTOCOL));
        }
        // Client frames are masked, server frames are not (RFC 6455 §5.1).
        if header.mask.is_some() == self.client {
            return Err(WsError(CLOSE_PROTOCOL));
        }
        match header.opcode {
            OpCode::Control(_) if len > CONTROL_PAYLOAD_MAX || !header.is_final => {
                Err(WsError(CLOSE_PROTOCOL))
            }
            OpCode::Data(Data::Binary | Data::Text) if self.in_message => {
                Err(WsError(CLOSE_PROTOCOL))
            }
            OpCode::Data(Data::Continue) if !self.in_message => Err(WsError(CLOSE_PROTOCOL)),
            OpCode::Data(Data::Text) if self.mode == WsMode::Binary => {
                Err(WsError(CLOSE_UNSUPPORTED))
            }
            OpCode::Data(Data::Binary) if self.mode == WsMode::Text => {
                Err(WsError(CLOSE_UNSUPPORTED))
            }
            OpCode::Data(Data::Reserved(_)) | OpCode::Control(Control::Reserved(_)) => {
                Err(WsError(CLOSE_PROTOCOL))
            }
            OpCode::Data(_) if self.message_bytes + len > message_bytes_max => {
                Err(WsError(CLOSE_TOO_BIG))
            }
            _ => Ok(()),
        }
    }

    /// Decodes whole frames from `raw`, appending binary payloads (unmasked) or
    /// whole text messages (prefixed with their length) to `input`, and calling
    /// `control` for pings and close frames. Returns how many bytes of `raw` were
    /// consumed (the rest is an incomplete frame). Stops after a close frame.
    pub fn decode(
        &mut self,
        raw: &[u8],
        input: &mut Vec<u8>,
        message_bytes_max: u64,
        mut control: impl FnMut(WsControl),
    ) -> Result<usize, WsError> {
        let mut pos = 0usize;
        while pos < raw.len() {
            let mut cursor = Cursor::new(&raw[pos..]);
            let (header, len) = match FrameHeader::parse(&mut cursor) {
                Ok(Some(h)) => h,
                Ok(None) => break,
                Err(_) => return Err(WsError(CLOSE_PROTOCOL)),
            };
            let header_len = cursor.position() as usize;
            self.check(&header, len, message_bytes_max)?;
            let mask = header.mask;
            let len = len as usize;
            if raw.len() - pos - header_len < len {
                break; // Incomplete payload (its size is bounded by the checks above).
            }
            let payload = &raw[pos + header_len..pos + header_len + len];
            pos += header_len + len;
            match header.opcode {
                OpCode::Data(op) => {
                    if op == Data::Text {
                        self.mode = WsMode::Text;
                    } else if op == Data::Binary {
                        self.mode = WsMode::Binary;
                    }
                    if self.mode == WsMode::Text {
                        self.take_text(payload, mask, header.is_final, input);
                    } else {
                        let start = input.len();
                        input.extend_from_slice(payload);
                        unmask(&mut input[start..], mask);
                    }
                    if header.is_final {
                        self.in_message = false;
                        self.message_bytes = 0;
                    } else {
                        self.in_message = true;
                        self.message_bytes += len as u64;
                    }
                }
                OpCode::Control(Control::Ping) => {
                    let mut data = payload.to_vec();
                    unmask(&mut data, mask);
                    control(WsControl::Ping(data));
                }
                OpCode::Control(Control::Pong) => {}
                OpCode::Control(Control::Close) => {
                    let mut data = payload.to_vec();
                    unmask(&mut data, mask);
                    if data.len() == 1 {
                        return Err(WsError(CLOSE_PROTOCOL));
                    }
                    let code = (data.len() >= 2).then(|| u16::from_be_bytes([data[0], data[1]]));
                    control(WsControl::Close(code));
                    return Ok(pos);
                }
                OpCode::Control(Control::Reserved(_)) => return Err(WsError(CLOSE_PROTOCOL)),
            }
        }
        Ok(pos)
    }
}

impl WsDecoder {
    /// A text frame's payload: a whole message goes to `input` behind its length; a
    /// fragment waits in `self.text` for the final one.
    fn take_text(&mut self, payload: &[u8], mask: Option<[u8; 4]>, fin: bool, input: &mut Vec<u8>) {
        // The message limit (at most `u32::MAX` in practice) bounds the lengths.
        if fin && self.text.is_empty() {
            input.extend_from_slice(&(payload.len() as u32).to_le_bytes());
            let start = input.len();
            input.extend_from_slice(payload);
            unmask(&mut input[start..], mask);
            return;
        }
        let start = self.text.len();
        self.text.extend_from_slice(payload);
        unmask(&mut self.text[start..], mask);
        if fin {
            input.extend_from_slice(&(self.text.len() as u32).to_le_bytes());
            input.extend_from_slice(&self.text);
            if self.text.capacity() > TEXT_KEEP_BYTES {
                self.text = Vec::new();
            } else {
                self.text.clear();
            }
        }
    }
}

/// Capacity of the fragment buffer kept between text messages.
const TEXT_KEEP_BYTES: usize = 4096;

fn unmask(buf: &mut [u8], mask: Option<[u8; 4]>) {
    if let Some(mask) = mask {
        apply_mask(buf, mask);
    }
}

/// XORs `buf` with the 4-byte `mask` (RFC 6455 §5.3), 8 bytes at a time.
pub fn apply_mask(buf: &mut [u8], mask: [u8; 4]) {
    let mask8 = u64::from_ne_bytes([
        mask[0], mask[1], mask[2], mask[3], mask[0], mask[1], mask[2], mask[3],
    ]);
    let mut chunks = buf.chunks_exact_mut(8);
    for chunk in &mut chunks {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        chunk.copy_from_slice(&(u64::from_ne_bytes(word) ^ mask8).to_ne_bytes());
    }
    for (i, b) in chunks.into_remainder().iter_mut().enumerate() {
        *b ^= mask[i & 3];
    }
}

/// Appends an unmasked server frame header for a final frame of `opcode` with a
/// payload of `len` bytes.
pub fn write_header(out: &mut Vec<u8>, opcode: OpCode, len: usize) {
    format_header(out, opcode, len, None);
}

fn format_header(out: &mut Vec<u8>, opcode: OpCode, len: usize, mask: Option<[u8; 4]>) {
    let header = FrameHeader {
        is_final: true,
        rsv1: false,
        rsv2: false,
        rsv3: false,
        opcode,
        mask,
    };
    // Writing into a Vec cannot fail.
    let _ = header.format(len as u64, out);
}

/// Appends a client's final frame of `opcode` carrying `payload` masked with `mask`.
fn write_masked(out: &mut Vec<u8>, opcode: OpCode, payload: &[u8], mask: [u8; 4]) {
    format_header(out, opcode, payload.len(), Some(mask));
    let start = out.len();
    out.extend_from_slice(payload);
    apply_mask(&mut out[start..], mask);
}

/// Appends a client's binary message, masked with `mask` (RFC 6455 §5.3: the key
/// should be unpredictable to intermediaries; a load harness may use a fixed one).
pub fn write_masked_binary(out: &mut Vec<u8>, payload: &[u8], mask: [u8; 4]) {
    write_masked(out, OpCode::Data(Data::Binary), payload, mask);
}

/// Appends a client's pong, masked with `mask`.
pub fn write_masked_pong(out: &mut Vec<u8>, payload: &[u8], mask: [u8; 4]) {
    write_masked(out, OpCode::Control(Control::Pong), payload, mask);
}

/// Bytes of a server frame header for a payload of `len` bytes.
pub fn header_len(len: usize) -> usize {
    match len {
        0..=125 => 2,
        126..=65535 => 4,
        _ => 10,
    }
}

/// Appends a binary message.
pub fn write_binary(out: &mut Vec<u8>, payload: &[u8]) {
    write_header(out, OpCode::Data(Data::Binary), payload.len());
    out.extend_from_slice(payload);
}

/// Appends a text message (the caller's bytes are UTF-8: JSON text).
pub fn write_text(out: &mut Vec<u8>, payload: &[u8]) {
    write_header(out, OpCode::Data(Data::Text), payload.len());
    out.extend_from_slice(payload);
}

/// Appends a client's text message, masked with `mask`.
pub fn write_masked_text(out: &mut Vec<u8>, payload: &[u8], mask: [u8; 4]) {
    write_masked(out, OpCode::Data(Data::Text), payload, mask);
}

/// Appends a pong.
pub fn write_pong(out: &mut Vec<u8>, payload: &[u8]) {
    write_header(out, OpCode::Control(Control::Pong), payload.len());
    out.extend_from_slice(payload);
}

/// Appends a close frame with `code`.
pub fn write_close(out: &mut Vec<u8>, code: u16) {
    write_header(out, OpCode::Control(Control::Close), 2);
    out.extend_from_slice(&code.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn masked(opcode: u8, fin: bool, payload: &[u8], mask: [u8; 4]) -> Vec<u8> {
        let mut out = vec![opcode | if fin { 0x80 } else { 0 }];
        assert!(payload.len() < 126);
        out.push(0x80 | payload.len() as u8);
        out.extend_from_slice(&mask);
        let mut p = payload.to_vec();
        apply_mask(&mut p, mask);
        out.extend_from_slice(&p);
        out
    }

    #[test]
    fn upgrade_request_is_accepted_with_rfc_key() {
        let req = b"GET /chat HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: keep-alive, Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\nrest";
        match handshake(req) {
            Handshake::Done { response, consumed } => {
                assert_eq!(&req[consumed..], b"rest");
                let text = String::from_utf8(response).unwrap();
                assert!(text.contains("Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo="));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(handshake(&req[..20]), Handshake::Partial);
        assert!(matches!(
            handshake(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
            Handshake::Reject(_)
        ));
        assert!(matches!(
            handshake(b"\x00\x01garbage\r\n\r\n"),
            Handshake::Reject(_)
        ));
    }

    #[test]
    fn decodes_fragments_ping_and_rejects_unmasked() {
        let mut raw = masked(0x2, false, b"hel", [1, 2, 3, 4]);
        raw.extend(masked(0x9, true, b"p", [9, 9, 9, 9]));
        raw.extend(masked(0x0, true, b"lo world", [5, 6, 7, 8]));
        let mut dec = WsDecoder::default();
        let mut input = Vec::new();
        let mut pings = Vec::new();
        let n = dec
            .decode(&raw[..raw.len() - 1], &mut input, 1024, |c| pings.push(c))
            .unwrap();
        assert_eq!(input, b"hel");
        let m = dec
            .decode(&raw[n..], &mut input, 1024, |c| pings.push(c))
            .unwrap();
        assert_eq!(n + m, raw.len());
        assert_eq!(input, b"hello world");
        assert_eq!(pings, vec![WsControl::Ping(b"p".to_vec())]);

        let unmasked = [0x82u8, 0x01, b'x'];
        let err = WsDecoder::default().decode(&unmasked, &mut input, 1024, |_| {});
        assert_eq!(err, Err(WsError(CLOSE_PROTOCOL)));
        let big = masked(0x2, true, &[0u8; 100], [1, 1, 1, 1]);
        let err = WsDecoder::default().decode(&big, &mut input, 99, |_| {});
        assert_eq!(err, Err(WsError(CLOSE_TOO_BIG)));
    }

    #[test]
    fn client_side_upgrade_checks_the_accept_key() {
        let key = "dGhlIHNhbXBsZSBub25jZQ==";
        let mut req = Vec::new();
        write_upgrade_request(&mut req, "127.0.0.1:5200", key);
        let Handshake::Done { response, consumed } = handshake(&req) else {
            panic!("the server refused the client's upgrade request");
        };
        assert_eq!(consumed, req.len());
        let mut resp = response.clone();
        resp.extend_from_slice(&[0x82, 0x00]);
        assert_eq!(
            upgrade_response(&resp, key),
            UpgradeResponse::Done {
                consumed: response.len()
            }
        );
        assert_eq!(
            upgrade_response(&response[..10], key),
            UpgradeResponse::Partial
        );
        let other_key = "b3RoZXIga2V5IDEyMzQ1Ng==";
        assert!(matches!(
            upgrade_response(&response, other_key),
            UpgradeResponse::Refused(_)
        ));
        assert!(matches!(
            upgrade_response(&reject(), key),
            UpgradeResponse::Refused(_)
        ));
    }

    #[test]
    fn client_and_server_frames_round_trip() {
        let mask = [0x1b, 0x5e, 0x7a, 0x33];
        for n in [0usize, 10, 125, 126, 200, 65_535, 70_000] {
            let payload: Vec<u8> = (0..n).map(|i| (i * 7) as u8).collect();
            let mut up = Vec::new();
            write_masked_binary(&mut up, &payload, mask);
            assert_eq!(up.len(), header_len(n) + 4 + n, "{n} bytes");
            let mut input = Vec::new();
            let used = WsDecoder::default().decode(&up, &mut input, 1 << 20, |_| {});
            assert_eq!((used, &input), (Ok(up.len()), &payload), "{n} bytes");

            let mut down = Vec::new();
            write_binary(&mut down, &payload);
            let mut input = Vec::new();
            let used = WsDecoder::client().decode(&down, &mut input, 1 << 20, |_| {});
            assert_eq!((used, &input), (Ok(down.len()), &payload), "{n} bytes");
            // Each side refuses the other side's masking.
            let err = WsDecoder::client().decode(&up, &mut input, 1 << 20, |_| {});
            assert_eq!(err, Err(WsError(CLOSE_PROTOCOL)));
            if n > 0 {
                let err = WsDecoder::default().decode(&down, &mut input, 1 << 20, |_| {});
                assert_eq!(err, Err(WsError(CLOSE_PROTOCOL)));
            }
        }
        // A server's ping reaches the client; the client's pong is a valid frame.
        let mut down = Vec::new();
        write_header(&mut down, OpCode::Control(Control::Ping), 2);
        down.extend_from_slice(b"hi");
        let mut pings = Vec::new();
        let mut input = Vec::new();
        let used = WsDecoder::client().decode(&down, &mut input, 1024, |c| pings.push(c));
        assert_eq!(used, Ok(down.len()));
        assert_eq!(pings, vec![WsControl::Ping(b"hi".to_vec())]);
        let mut pong = Vec::new();
        write_masked_pong(&mut pong, b"hi", mask);
        let used = WsDecoder::default().decode(&pong, &mut input, 1024, |_| {});
        assert_eq!((used, input.len()), (Ok(pong.len()), 0));
    }

    #[test]
    fn text_messages_keep_their_boundaries() {
        // Two whole messages and one in three fragments with a ping between.
        let mut raw = masked(0x1, true, b"{\"a\":1}", [1, 2, 3, 4]);
        raw.extend(masked(0x1, true, b"{}", [4, 3, 2, 1]));
        raw.extend(masked(0x1, false, b"{\"b\"", [9, 8, 7, 6]));
        raw.extend(masked(0x0, false, b":", [1, 1, 1, 1]));
        raw.extend(masked(0x9, true, b"p", [2, 2, 2, 2]));
        raw.extend(masked(0x0, true, b"2}", [3, 3, 3, 3]));
        let mut dec = WsDecoder::default();
        assert_eq!(dec.mode(), WsMode::Undecided);
        let mut input = Vec::new();
        let mut controls = Vec::new();
        // Byte by byte: partial frames and fragments wait.
        let mut used = 0;
        for end in 1..=raw.len() {
            used += dec
                .decode(&raw[used..end], &mut input, 1024, |c| controls.push(c))
                .unwrap();
        }
        assert_eq!(used, raw.len());
        assert_eq!(dec.mode(), WsMode::Text);
        assert_eq!(controls, vec![WsControl::Ping(b"p".to_vec())]);
        let mut messages = Vec::new();
        let mut rest = &input[..];
        while let Some((m, n)) = next_text_message(rest) {
            messages.push(m.to_vec());
            rest = &rest[n..];
        }
        assert!(rest.is_empty());
        assert_eq!(
            messages,
            vec![b"{\"a\":1}".to_vec(), b"{}".to_vec(), b"{\"b\":2}".to_vec()]
        );
        assert_eq!(
            next_text_message(&input[..input.len() - 1]).map(|(m, _)| m.len()),
            Some(7)
        );
        assert_eq!(next_text_message(&input[..3]), None);
    }

    #[test]
    fn the_first_data_message_picks_the_mode() {
        let text = masked(0x1, true, b"{}", [1, 2, 3, 4]);
        let binary = masked(0x2, true, b"\x70", [1, 2, 3, 4]);
        let mut input = Vec::new();
        let mut dec = WsDecoder::default();
        dec.decode(&binary, &mut input, 1024, |_| {}).unwrap();
        assert_eq!(dec.mode(), WsMode::Binary);
        assert_eq!(
            dec.decode(&text, &mut input, 1024, |_| {}),
            Err(WsError(CLOSE_UNSUPPORTED))
        );
        let mut dec = WsDecoder::default();
        dec.decode(&text, &mut input, 1024, |_| {}).unwrap();
        assert_eq!(
            dec.decode(&binary, &mut input, 1024, |_| {}),
            Err(WsError(CLOSE_UNSUPPORTED))
        );
        // A text message is bounded like a binary one, fragments included.
        let mut dec = WsDecoder::default();
        let mut raw = masked(0x1, false, &[b' '; 60], [1, 1, 1, 1]);
        raw.extend(masked(0x0, true, &[b' '; 60], [1, 1, 1, 1]));
        assert_eq!(
            dec.decode(&raw, &mut input, 100, |_| {}),
            Err(WsError(CLOSE_TOO_BIG))
        );
        // A new data frame inside a fragmented message is a protocol error.
        let mut dec = WsDecoder::default();
        let mut raw = masked(0x1, false, b"{", [1, 1, 1, 1]);
        raw.extend(masked(0x1, true, b"}", [1, 1, 1, 1]));
        assert_eq!(
            dec.decode(&raw, &mut input, 100, |_| {}),
            Err(WsError(CLOSE_PROTOCOL))
        );
        // Server-side text frames reach a client as messages.
        let mut down = Vec::new();
        write_text(&mut down, b"{\"x\":1}");
        let mut input = Vec::new();
        let used = WsDecoder::client().decode(&down, &mut input, 1024, |_| {});
        assert_eq!(used, Ok(down.len()));
        assert_eq!(
            next_text_message(&input).map(|(m, _)| m),
            Some(&b"{\"x\":1}"[..])
        );
    }

    #[test]
    fn header_len_matches_format() {
        for len in [0usize, 125, 126, 65535, 65536] {
            let mut out = Vec::new();
            write_header(&mut out, OpCode::Data(Data::Binary), len);
            assert_eq!(out.len(), header_len(len));
        }
    }
}
