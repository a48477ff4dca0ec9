//! JSON-RPC 2.0 as WuKongIM's EasySDKs speak it over WebSocket text messages,
//! sans-IO: one text message in, the wkproto packet it stands for out; a wkproto
//! packet for the client in, one text message out. Everything behind the
//! connection edge (admission, activation, SEND, RECV and RECVACK, kicks, limits)
//! sees the same packets as for the binary protocol.
//!
//! One [`JsonRpc`] per connection keeps what a reply needs and a packet lacks: the
//! id of the `connect` request (for CONNACK), the id of each `send` by the
//! `client_seq` this codec gives it (for its SENDACK, at most `pending_max` at
//! once), and the id of each `ping` (for PONG).
//!
//! | client → server | packet | server → client |
//! | --- | --- | --- |
//! | `connect` request (`uid`, `token`, `deviceId`, `deviceFlag`, `clientTimestamp`, `version`, `clientKey`) | CONNECT / CONNACK | result (`serverKey`, `salt`, `timeDiff`, `reasonCode`, `serverVersion`, `nodeId`), or an error object whose `code` is the refusal's reason code |
//! | `send` request (`clientMsgNo`, `channelId`, `channelType`, `payload`, `header`, `setting`, `expire`, `topic`; `streamNo` and `msgKey` are ignored: no streams, no encryption) | SEND / SENDACK | result (`messageId` as a string, `messageSeq`, `reasonCode`) |
//! | | RECV | `recv` notification (`header`, `setting`, `messageId` as a string, `messageSeq`, `timestamp`, `channelId`, `channelType`, `fromUid`, `clientMsgNo`, `expire`, `topic`, `payload` as base64) |
//! | `recvack` notification (`messageId`, `messageSeq`) | RECVACK | |
//! | `ping` (request or notification) | PING / PONG | result `null` (request) or a `pong` notification |
//! | `disconnect` notification | DISCONNECT | `disconnect` notification (`reasonCode`, `reason`) |
//!
//! Payloads: a `send` payload may be an object or array (its compact JSON text is
//! the payload), a string of base64 (its bytes; what the EasySDKs send) or a string
//! of JSON text (its UTF-8 bytes). A `recv` payload is always base64 of the stored
//! bytes, which the EasySDKs decode. Message ids go out as decimal strings
//! (JavaScript numbers hold 53 bits); a `recvack` may give one as a string or a
//! number.
//!
//! Bad input is a [`Rejection`]: an error object answering its request when the
//! message had a usable id, else a `disconnect` notification with the reason; the
//! connection is closed after either (as WuKongIM does).

use std::collections::VecDeque;

use base64::Engine as _;
use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::wkproto::{
    ChannelType, ConnackPacket, ConnectPacket, DeviceFlag, DisconnectPacket, Flags, Frame,
    ReasonCode, RecvPacket, RecvackPacket, SendPacket, SendackPacket, Setting,
};

/// Longest request id kept for its reply (its JSON text, quotes included).
pub const ID_BYTES_MAX: usize = 128;
/// Pings awaiting their PONG (the node answers each at once: one is the norm).
pub const PINGS_PENDING_MAX: usize = 16;

/// JSON-RPC's own error codes.
pub const PARSE_ERROR: i32 = -32700;
pub const INVALID_REQUEST: i32 = -32600;
pub const METHOD_NOT_FOUND: i32 = -32601;
pub const INVALID_PARAMS: i32 = -32602;

const BASE64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// A request id: a string or a number, kept as the client wrote it.
#[derive(Clone, Debug, PartialEq)]
pub struct Id(Value);

/// Why a message is refused: answered with an error object when `id` is known,
/// else with a `disconnect` notification; the connection closes after either.
#[derive(Clone, Debug, PartialEq)]
pub struct Rejection {
    pub id: Option<Id>,
    pub code: i32,
    pub message: String,
}

impl Rejection {
    fn new(id: Option<&Id>, code: i32, message: impl Into<String>) -> Self {
        Rejection {
            id: id.cloned(),
            code,
            message: message.into(),
        }
    }
}

/// A decoded client message, owning its data: [`Inbound::frame`] is the wkproto
/// packet it stands for.
#[derive(Clone, Debug, PartialEq)]
pub enum Inbound {
    Connect(ConnectFields),
    Send(SendFields),
    Recvack(RecvackPacket),
    Ping,
    Disconnect {
        reason_code: ReasonCode,
        reason: String,
    },
}

/// A `connect` request's fields.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ConnectFields {
    pub version: u8,
    pub device_flag: u8,
    pub device_id: String,
    pub uid: String,
    pub token: String,
    pub client_timestamp_ms: i64,
    pub client_key: String,
}

/// A `send` request's fields; `payload` is plaintext.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SendFields {
    pub flags: Flags,
    pub setting: Setting,
    pub client_seq: u32,
    pub client_msg_no: String,
    pub channel_id: String,
    pub channel_type: u8,
    pub expire_s: u32,
    pub topic: String,
    pub payload: Vec<u8>,
}

impl Inbound {
    /// The wkproto packet this message stands for (a SEND's payload is plaintext).
    pub fn frame(&self) -> Frame<'_> {
        match self {
            Inbound::Connect(c) => Frame::Connect(ConnectPacket {
                flags: Flags::NONE,
                version: c.version,
                device_flag: DeviceFlag(c.device_flag),
                device_id: &c.device_id,
                uid: &c.uid,
                token: &c.token,
                client_timestamp_ms: c.client_timestamp_ms,
                client_key: &c.client_key,
            }),
            Inbound::Send(s) => Frame::Send(SendPacket {
                flags: s.flags,
                setting: s.setting,
                client_seq: s.client_seq,
                client_msg_no: &s.client_msg_no,
                stream_no: "",
                channel_id: &s.channel_id,
                channel_type: ChannelType(s.channel_type),
                expire_s: s.expire_s,
                msg_key: "",
                topic: &s.topic,
                payload: &s.payload,
            }),
            Inbound::Recvack(p) => Frame::Recvack(*p),
            Inbound::Ping => Frame::Ping,
            Inbound::Disconnect {
                reason_code,
                reason,
            } => Frame::Disconnect(DisconnectPacket {
                flags: Flags::NONE,
                reason_code: *reason_code,
                reason,
            }),
        }
    }
}

// ------------------------------------------------------------------ inbound shapes

#[derive(Deserialize)]
struct Envelope {
    #[serde(default)]
    jsonrpc: Option<Value>,
    #[serde(default)]
    method: Option<Value>,
    #[serde(default)]
    id: Option<Value>,
    #[serde(default)]
    params: Option<Value>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct HeaderIn {
    #[serde(default, deserialize_with = "nullable")]
    no_persist: bool,
    #[serde(default, deserialize_with = "nullable")]
    red_dot: bool,
    #[serde(default, deserialize_with = "nullable")]
    sync_once: bool,
    #[serde(default, deserialize_with = "nullable")]
    dup: bool,
}

impl HeaderIn {
    fn flags(&self) -> Flags {
        let mut f = Flags::NONE;
        for (on, bit) in [
            (self.no_persist, Flags::NO_PERSIST),
            (self.red_dot, Flags::RED_DOT),
            (self.sync_once, Flags::SYNC_ONCE),
            (self.dup, Flags::DUP),
        ] {
            if on {
                f = f.with(bit);
            }
        }
        f
    }
}

#[derive(Deserialize, Default)]
struct SettingIn {
    #[serde(default, deserialize_with = "nullable")]
    receipt: bool,
    #[serde(default, deserialize_with = "nullable")]
    signal: bool,
    #[serde(default, deserialize_with = "nullable")]
    stream: bool,
    #[serde(default, deserialize_with = "nullable")]
    topic: bool,
}

impl SettingIn {
    fn setting(&self) -> Setting {
        let mut s = Setting::NONE;
        for (on, bit) in [
            (self.receipt, Setting::RECEIPT),
            (self.signal, Setting::SIGNAL),
            (self.stream, Setting::STREAM),
            (self.topic, Setting::TOPIC),
        ] {
            if on {
                s = s.with(bit);
            }
        }
        s
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ConnectIn {
    uid: String,
    #[serde(default, deserialize_with = "nullable")]
    token: String,
    #[serde(default, deserialize_with = "nullable")]
    device_id: String,
    #[serde(default, deserialize_with = "nullable")]
    device_flag: u8,
    #[serde(default, deserialize_with = "nullable")]
    client_timestamp: i64,
    #[serde(default, deserialize_with = "nullable")]
    version: u8,
    #[serde(default, deserialize_with = "nullable")]
    client_key: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SendIn {
    #[serde(default, deserialize_with = "nullable")]
    client_msg_no: String,
    channel_id: String,
    channel_type: u8,
    payload: Value,
    #[serde(default, deserialize_with = "nullable")]
    header: HeaderIn,
    #[serde(default, deserialize_with = "nullable")]
    setting: SettingIn,
    #[serde(default, deserialize_with = "nullable")]
    expire: u32,
    #[serde(default, deserialize_with = "nullable")]
    topic: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RecvackIn {
    message_id: Value,
    #[serde(default, deserialize_with = "nullable")]
    message_seq: u64,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct DisconnectIn {
    #[serde(default, deserialize_with = "nullable")]
    reason_code: u8,
    #[serde(default, deserialize_with = "nullable")]
    reason: String,
}

/// An optional field: absent or `null` is the default (as WuKongIM's decoder takes
/// it; the EasySDKs may send `null` for options not given).
fn nullable<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

// ----------------------------------------------------------------- outbound shapes

#[derive(Serialize)]
struct Response<'a, T: Serialize> {
    jsonrpc: &'static str,
    id: &'a Value,
    result: T,
}

#[derive(Serialize)]
struct ErrorResponse<'a> {
    jsonrpc: &'static str,
    id: &'a Value,
    error: ErrorObject<'a>,
}

#[derive(Serialize)]
struct ErrorObject<'a> {
    code: i32,
    message: &'a str,
}

#[derive(Serialize)]
struct Notification<T: Serialize> {
    jsonrpc: &'static str,
    method: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    params: Option<T>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ConnectResult<'a> {
    server_key: &'a str,
    salt: &'a str,
    time_diff: i64,
    reason_code: u8,
    #[serde(skip_serializing_if = "Option::is_none")]
    server_version: Option<u8>,
    node_id: u64,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct SendResult {
    message_id: String,
    message_seq: u64,
    reason_code: u8,
}

#[derive(Serialize, Default)]
#[serde(rename_all = "camelCase")]
struct HeaderOut {
    #[serde(skip_serializing_if = "is_false")]
    no_persist: bool,
    #[serde(skip_serializing_if = "is_false")]
    red_dot: bool,
    #[serde(skip_serializing_if = "is_false")]
    sync_once: bool,
    #[serde(skip_serializing_if = "is_false")]
    dup: bool,
}

#[derive(Serialize)]
struct SettingOut {
    #[serde(skip_serializing_if = "is_false")]
    receipt: bool,
    #[serde(skip_serializing_if = "is_false")]
    signal: bool,
    #[serde(skip_serializing_if = "is_false")]
    stream: bool,
    #[serde(skip_serializing_if = "is_false")]
    topic: bool,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct RecvParams<'a> {
    header: HeaderOut,
    #[serde(skip_serializing_if = "Option::is_none")]
    setting: Option<SettingOut>,
    message_id: String,
    message_seq: u64,
    timestamp: i32,
    channel_id: &'a str,
    channel_type: u8,
    from_uid: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    client_msg_no: &'a str,
    #[serde(skip_serializing_if = "is_zero")]
    expire: u32,
    #[serde(skip_serializing_if = "str::is_empty")]
    topic: &'a str,
    payload: String,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct DisconnectParams<'a> {
    reason_code: u8,
    reason: &'a str,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn write_json<T: Serialize>(out: &mut Vec<u8>, value: &T) {
    // Serializing these shapes into a Vec cannot fail (string keys, no maps of
    // non-string keys, no I/O).
    let _ = serde_json::to_writer(out, value);
}

// ------------------------------------------------------------------------- codec

/// One connection's JSON-RPC state (module docs).
#[derive(Debug)]
pub struct JsonRpc {
    /// A `connect` was decoded (only one is, and nothing comes before it).
    connect_seen: bool,
    connect_id: Option<Id>,
    /// `send`s awaiting their SENDACK: (client_seq, id), oldest first.
    sends: VecDeque<(u32, Id)>,
    pending_max: usize,
    next_seq: u32,
    pings: VecDeque<Option<Id>>,
}

impl JsonRpc {
    /// A connection's codec remembering at most `pending_max` unanswered `send`s
    /// (the node's `sends_in_flight_per_conn_max`: its credits refuse more anyway).
    pub fn new(pending_max: usize) -> Self {
        JsonRpc {
            connect_seen: false,
            connect_id: None,
            sends: VecDeque::new(),
            pending_max: pending_max.max(1),
            next_seq: 1,
            pings: VecDeque::new(),
        }
    }

    /// `send`s awaiting their SENDACK.
    pub fn sends_pending(&self) -> usize {
        self.sends.len()
    }

    /// Decodes one text message.
    pub fn decode(&mut self, text: &[u8]) -> Result<Inbound, Rejection> {
        if first_non_space(text) == Some(b'[') {
            return Err(Rejection::new(
                None,
                INVALID_REQUEST,
                "batch requests are not supported",
            ));
        }
        let env: Envelope = serde_json::from_slice(text)
            .map_err(|e| Rejection::new(None, PARSE_ERROR, format!("not a JSON object: {e}")))?;
        let id = match env.id {
            None | Some(Value::Null) => None,
            Some(v @ (Value::String(_) | Value::Number(_))) => {
                if v.to_string().len() > ID_BYTES_MAX {
                    return Err(Rejection::new(
                        None,
                        INVALID_REQUEST,
                        format!("request id longer than {ID_BYTES_MAX} bytes"),
                    ));
                }
                Some(Id(v))
            }
            Some(_) => {
                return Err(Rejection::new(
                    None,
                    INVALID_REQUEST,
                    "request id must be a string or a number",
                ))
            }
        };
        let id = id.as_ref();
        match env.jsonrpc {
            None => {}
            Some(Value::String(v)) if v == "2.0" => {}
            Some(_) => {
                return Err(Rejection::new(
                    id,
                    INVALID_REQUEST,
                    "jsonrpc must be \"2.0\"",
                ))
            }
        }
        let method = match env.method {
            Some(Value::String(m)) => m,
            _ => return Err(Rejection::new(id, INVALID_REQUEST, "method missing")),
        };
        self.decode_method(&method, id, env.params)
    }

    fn decode_method(
        &mut self,
        method: &str,
        id: Option<&Id>,
        params: Option<Value>,
    ) -> Result<Inbound, Rejection> {
        match (method, self.connect_seen) {
            ("connect", true) => Err(Rejection::new(
                id,
                INVALID_REQUEST,
                "connect: the connection has connected already",
            )),
            ("connect", false) => {
                let id = require_id(id, method)?;
                let p: ConnectIn = params_of(Some(id), method, params)?;
                self.connect_seen = true;
                self.connect_id = Some(id.clone());
                Ok(Inbound::Connect(ConnectFields {
                    version: p.version,
                    device_flag: p.device_flag,
                    device_id: p.device_id,
                    uid: p.uid,
                    token: p.token,
                    client_timestamp_ms: p.client_timestamp,
                    client_key: p.client_key,
                }))
            }
            (_, false) => Err(Rejection::new(
                id,
                INVALID_REQUEST,
                format!("{method}: connect first"),
            )),
            ("send", true) => self.decode_send(require_id(id, method)?, params),
            ("recvack", true) => {
                let p: RecvackIn = params_of(id, method, params)?;
                let message_id = message_id_of(&p.message_id).ok_or_else(|| {
                    Rejection::new(id, INVALID_PARAMS, "recvack: messageId is not an int64")
                })?;
                Ok(Inbound::Recvack(RecvackPacket {
                    flags: Flags::NONE,
                    message_id,
                    message_seq: p.message_seq,
                }))
            }
            ("ping", true) => {
                if self.pings.len() >= PINGS_PENDING_MAX {
                    return Err(Rejection::new(
                        id,
                        INVALID_REQUEST,
                        "too many pings pending",
                    ));
                }
                self.pings.push_back(id.cloned());
                Ok(Inbound::Ping)
            }
            ("disconnect", true) => {
                let p: DisconnectIn = match params {
                    None | Some(Value::Null) => DisconnectIn::default(),
                    some => params_of(id, method, some)?,
                };
                Ok(Inbound::Disconnect {
                    reason_code: ReasonCode(p.reason_code),
                    reason: p.reason,
                })
            }
            (other, true) => Err(Rejection::new(
                id,
                METHOD_NOT_FOUND,
                format!("method {other:?} is not supported"),
            )),
        }
    }

    fn decode_send(&mut self, id: &Id, params: Option<Value>) -> Result<Inbound, Rejection> {
        let p: SendIn = params_of(Some(id), "send", params)?;
        let payload = payload_bytes(p.payload)
            .map_err(|why| Rejection::new(Some(id), INVALID_PARAMS, format!("send: {why}")))?;
        if self.sends.len() >= self.pending_max {
            return Err(Rejection::new(
                Some(id),
                INVALID_REQUEST,
                format!("more than {} sends awaiting their answer", self.pending_max),
            ));
        }
        let client_seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1).max(1);
        self.sends.push_back((client_seq, id.clone()));
        let mut setting = p.setting.setting();
        if !p.topic.is_empty() {
            setting = setting.with(Setting::TOPIC);
        }
        Ok(Inbound::Send(SendFields {
            flags: p.header.flags(),
            setting,
            client_seq,
            client_msg_no: p.client_msg_no,
            channel_id: p.channel_id,
            channel_type: p.channel_type,
            expire_s: p.expire,
            topic: p.topic,
            payload,
        }))
    }

    /// Appends the text message answering or carrying `frame` (a packet for the
    /// client; a RECV's payload plaintext); false when it has none (an answer whose
    /// request is unknown, a packet with no JSON-RPC form).
    pub fn encode(&mut self, frame: &Frame<'_>, out: &mut Vec<u8>) -> bool {
        match frame {
            Frame::Connack(p) => match self.connect_id.take() {
                Some(id) => {
                    encode_connack(&id, p, out);
                    true
                }
                None => false,
            },
            Frame::Sendack(p) => {
                let Some(at) = self.sends.iter().position(|(seq, _)| *seq == p.client_seq) else {
                    return false;
                };
                let Some((_, id)) = self.sends.remove(at) else {
                    return false;
                };
                encode_sendack(&id, p, out);
                true
            }
            Frame::Recv(p) => {
                encode_recv(p, out);
                true
            }
            Frame::Pong => {
                match self.pings.pop_front() {
                    Some(Some(id)) => write_json(
                        out,
                        &Response {
                            jsonrpc: "2.0",
                            id: &id.0,
                            result: (),
                        },
                    ),
                    _ => write_json(out, &notification::<()>("pong", None)),
                }
                true
            }
            Frame::Disconnect(p) => {
                encode_disconnect(p.reason_code, p.reason, out);
                true
            }
            _ => false,
        }
    }
}

/// Appends the answer to a [`Rejection`]: its error object, or a `disconnect`
/// notification with its message when it has no id.
pub fn encode_rejection(r: &Rejection, out: &mut Vec<u8>) {
    match &r.id {
        Some(id) => write_json(
            out,
            &ErrorResponse {
                jsonrpc: "2.0",
                id: &id.0,
                error: ErrorObject {
                    code: r.code,
                    message: &r.message,
                },
            },
        ),
        None => encode_disconnect(ReasonCode::UNKNOWN, &r.message, out),
    }
}

fn notification<T: Serialize>(method: &'static str, params: Option<T>) -> Notification<T> {
    Notification {
        jsonrpc: "2.0",
        method,
        params,
    }
}

fn encode_disconnect(reason_code: ReasonCode, reason: &str, out: &mut Vec<u8>) {
    let params = DisconnectParams {
        reason_code: reason_code.0,
        reason,
    };
    write_json(out, &notification("disconnect", Some(params)));
}

fn encode_connack(id: &Id, p: &ConnackPacket<'_>, out: &mut Vec<u8>) {
    if p.reason_code != ReasonCode::SUCCESS {
        let message = p.reason_code.name().unwrap_or("refused");
        return write_json(
            out,
            &ErrorResponse {
                jsonrpc: "2.0",
                id: &id.0,
                error: ErrorObject {
                    code: i32::from(p.reason_code.0),
                    message,
                },
            },
        );
    }
    let result = ConnectResult {
        server_key: p.server_key,
        salt: p.salt,
        time_diff: p.time_diff_ms,
        reason_code: p.reason_code.0,
        server_version: p.server_version,
        node_id: p.node_id,
    };
    write_json(
        out,
        &Response {
            jsonrpc: "2.0",
            id: &id.0,
            result,
        },
    );
}

fn encode_sendack(id: &Id, p: &SendackPacket, out: &mut Vec<u8>) {
    let result = SendResult {
        message_id: p.message_id.to_string(),
        message_seq: p.message_seq,
        reason_code: p.reason_code.0,
    };
    write_json(
        out,
        &Response {
            jsonrpc: "2.0",
            id: &id.0,
            result,
        },
    );
}

/// Appends the `recv` notification of `p`, whose payload is the plaintext.
pub fn encode_recv(p: &RecvPacket<'_>, out: &mut Vec<u8>) {
    let f = p.flags;
    let header = HeaderOut {
        no_persist: f.contains(Flags::NO_PERSIST),
        red_dot: f.contains(Flags::RED_DOT),
        sync_once: f.contains(Flags::SYNC_ONCE),
        dup: f.contains(Flags::DUP),
    };
    let s = p.setting;
    let setting = SettingOut {
        receipt: s.contains(Setting::RECEIPT),
        signal: s.contains(Setting::SIGNAL),
        stream: s.contains(Setting::STREAM),
        topic: s.contains(Setting::TOPIC),
    };
    let any_setting = setting.receipt || setting.signal || setting.stream || setting.topic;
    let params = RecvParams {
        header,
        setting: any_setting.then_some(setting),
        message_id: p.message_id.to_string(),
        message_seq: p.message_seq,
        timestamp: p.timestamp_s,
        channel_id: p.channel_id,
        channel_type: p.channel_type.0,
        from_uid: p.from_uid,
        client_msg_no: p.client_msg_no,
        expire: p.expire_s,
        topic: p.topic,
        payload: BASE64.encode(p.payload),
    };
    write_json(out, &notification("recv", Some(params)));
}

fn first_non_space(text: &[u8]) -> Option<u8> {
    text.iter()
        .copied()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
}

fn require_id<'a>(id: Option<&'a Id>, method: &str) -> Result<&'a Id, Rejection> {
    id.ok_or_else(|| {
        Rejection::new(
            None,
            INVALID_REQUEST,
            format!("{method} must be a request with an id"),
        )
    })
}

fn params_of<T: serde::de::DeserializeOwned>(
    id: Option<&Id>,
    method: &str,
    params: Option<Value>,
) -> Result<T, Rejection> {
    let params =
        params.ok_or_else(|| Rejection::new(id, INVALID_PARAMS, format!("{method}: no params")))?;
    serde_json::from_value(params)
        .map_err(|e| Rejection::new(id, INVALID_PARAMS, format!("{method}: {e}")))
}

/// A `send` payload's bytes (module docs).
fn payload_bytes(v: Value) -> Result<Vec<u8>, &'static str> {
    match v {
        Value::String(s) => {
            if let Ok(bytes) = BASE64.decode(s.as_bytes()) {
                return Ok(bytes);
            }
            if serde_json::from_str::<IgnoredAny>(&s).is_ok() {
                return Ok(s.into_bytes());
            }
            Err("payload: a string must be base64 or JSON text")
        }
        v @ (Value::Object(_) | Value::Array(_)) => {
            serde_json::to_vec(&v).map_err(|_| "payload: not serializable")
        }
        _ => Err("payload must be an object, an array, base64 or JSON text"),
    }
}

/// A message id given as a decimal string or an integer.
fn message_id_of(v: &Value) -> Option<i64> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn decode(rpc: &mut JsonRpc, v: Value) -> Result<Inbound, Rejection> {
        rpc.decode(v.to_string().as_bytes())
    }

    fn encoded(rpc: &mut JsonRpc, frame: &Frame<'_>) -> Option<Value> {
        let mut out = Vec::new();
        rpc.encode(frame, &mut out)
            .then(|| serde_json::from_slice(&out).unwrap())
    }

    /// A codec past a successful `connect`.
    fn connected() -> JsonRpc {
        let mut rpc = JsonRpc::new(4);
        decode(
            &mut rpc,
            json!({"method": "connect", "id": "c", "params": {"uid": "u", "token": "t"}}),
        )
        .unwrap();
        let ack = ConnackPacket {
            reason_code: ReasonCode::SUCCESS,
            ..Default::default()
        };
        assert!(encoded(&mut rpc, &Frame::Connack(ack)).is_some());
        rpc
    }

    #[test]
    fn connect_both_ways() {
        let mut rpc = JsonRpc::new(4);
        let got = decode(
            &mut rpc,
            json!({"jsonrpc": "2.0", "method": "connect", "id": "req-1", "params": {
                "uid": "u1", "token": "tok", "deviceId": "d1", "deviceFlag": 2,
                "clientTimestamp": 1_700_000_000_123_i64}}),
        )
        .unwrap();
        let Frame::Connect(p) = got.frame() else {
            panic!("{got:?}")
        };
        assert_eq!(
            (
                p.uid,
                p.token,
                p.device_id,
                p.device_flag.0,
                p.client_timestamp_ms
            ),
            ("u1", "tok", "d1", 2, 1_700_000_000_123)
        );
        assert_eq!(
            (p.version, p.client_key),
            (0, ""),
            "defaults: latest, no key"
        );
        let ack = ConnackPacket {
            server_version: Some(6),
            time_diff_ms: -15,
            reason_code: ReasonCode::SUCCESS,
            server_key: "sk",
            salt: "salt",
            node_id: 3,
            ..Default::default()
        };
        assert_eq!(
            encoded(&mut rpc, &Frame::Connack(ack)),
            Some(json!({"jsonrpc": "2.0", "id": "req-1", "result": {
                "serverKey": "sk", "salt": "salt", "timeDiff": -15, "reasonCode": 1,
                "serverVersion": 6, "nodeId": 3}}))
        );
        // Answered once: a second CONNACK has no request.
        assert_eq!(encoded(&mut rpc, &Frame::Connack(ack)), None);
    }

    #[test]
    fn a_refused_connect_is_an_error_object_with_the_reason() {
        let mut rpc = JsonRpc::new(4);
        decode(
            &mut rpc,
            json!({"method": "connect", "id": 7, "params": {"uid": "u", "token": "bad"}}),
        )
        .unwrap();
        let ack = ConnackPacket {
            reason_code: ReasonCode::AUTH_FAIL,
            ..Default::default()
        };
        let v = encoded(&mut rpc, &Frame::Connack(ack)).unwrap();
        assert_eq!(v["id"], 7, "a numeric id comes back as a number");
        assert_eq!(v["error"]["code"], 2);
        assert!(v.get("result").is_none());
    }

    #[test]
    fn send_both_ways_with_each_payload_form() {
        let mut rpc = connected();
        let raw = [0u8, 159, 146, 150, 255];
        let cases = [
            (json!(BASE64.encode(raw)), raw.to_vec()),
            (
                json!({"content": "hi", "type": 1}),
                br#"{"content":"hi","type":1}"#.to_vec(),
            ),
            (json!([1, 2]), b"[1,2]".to_vec()),
            (json!("{\"a\": 1}"), b"{\"a\": 1}".to_vec()),
        ];
        let mut seqs = Vec::new();
        for (i, (payload, bytes)) in cases.into_iter().enumerate() {
            let got = decode(
                &mut rpc,
                json!({"method": "send", "id": format!("s{i}"), "params": {
                    "clientMsgNo": "n", "channelId": "g1", "channelType": 2,
                    "payload": payload, "header": {"redDot": true},
                    "setting": {"receipt": true}, "topic": "t", "expire": 60}}),
            )
            .unwrap();
            let Frame::Send(p) = got.frame() else {
                panic!("{got:?}")
            };
            assert_eq!(p.payload, &bytes[..], "case {i}");
            assert_eq!(
                (p.channel_id, p.channel_type.0, p.client_msg_no),
                ("g1", 2, "n")
            );
            assert_eq!((p.topic, p.expire_s), ("t", 60));
            assert_eq!(p.flags, Flags::RED_DOT);
            assert_eq!(p.setting, Setting::RECEIPT.with(Setting::TOPIC));
            seqs.push(p.client_seq);
        }
        assert_eq!(rpc.sends_pending(), 4);
        // Answered out of order, each to its own id; message ids as strings.
        let big = i64::MAX - 1;
        for (i, &seq) in seqs.iter().enumerate().rev() {
            let ack = SendackPacket {
                message_id: big,
                client_seq: seq,
                message_seq: 9,
                reason_code: ReasonCode::SUCCESS,
                ..Default::default()
            };
            let v = encoded(&mut rpc, &Frame::Sendack(ack)).unwrap();
            assert_eq!(v["id"], format!("s{i}"));
            assert_eq!(
                v["result"],
                json!({"messageId": "9223372036854775806", "messageSeq": 9, "reasonCode": 1})
            );
        }
        assert_eq!(rpc.sends_pending(), 0);
        let unknown = SendackPacket {
            client_seq: 12345,
            ..Default::default()
        };
        assert_eq!(encoded(&mut rpc, &Frame::Sendack(unknown)), None);
    }

    #[test]
    fn optional_fields_may_be_null() {
        let mut rpc = JsonRpc::new(4);
        let got = decode(
            &mut rpc,
            json!({"method": "connect", "id": "c", "params": {"uid": "u", "token": null,
                   "deviceId": null, "deviceFlag": null, "clientTimestamp": null}}),
        )
        .unwrap();
        assert!(matches!(got, Inbound::Connect(ConnectFields { ref uid, .. }) if uid == "u"));
        let mut rpc = connected();
        let got = decode(
            &mut rpc,
            json!({"method": "send", "id": "s", "params": {"channelId": "u2", "channelType": 1,
                   "payload": "aGk=", "clientMsgNo": null, "header": null, "setting": null,
                   "topic": null, "expire": null}}),
        )
        .unwrap();
        let Frame::Send(p) = got.frame() else {
            panic!("{got:?}")
        };
        assert_eq!(
            (p.payload, p.setting, p.flags),
            (&b"hi"[..], Setting::NONE, Flags::NONE)
        );
        let err = decode(
            &mut rpc,
            json!({"method": "send", "id": "s", "params": {"channelId": null, "channelType": 1,
                   "payload": "aGk="}}),
        )
        .unwrap_err();
        assert_eq!(err.code, INVALID_PARAMS, "required fields are not optional");
    }

    #[test]
    fn sends_awaiting_answers_are_bounded() {
        let mut rpc = connected();
        let send = |id: u32| {
            json!({"method": "send", "id": id, "params": {
                "channelId": "u2", "channelType": 1, "payload": "aGk="}})
        };
        for i in 0..4 {
            decode(&mut rpc, send(i)).unwrap();
        }
        let err = decode(&mut rpc, send(4)).unwrap_err();
        assert_eq!((err.id, err.code), (Some(Id(json!(4))), INVALID_REQUEST));
    }

    #[test]
    fn recv_goes_out_with_base64_and_string_ids() {
        let payload = [0u8, 1, 2, 250];
        let p = RecvPacket {
            flags: Flags::DUP.with(Flags::RED_DOT),
            setting: Setting::NO_ENCRYPT,
            from_uid: "u2",
            channel_id: "u2",
            channel_type: ChannelType(1),
            client_msg_no: "m",
            message_id: 9_007_199_254_740_993, // 2^53 + 1: not a JavaScript number
            message_seq: 5,
            timestamp_s: 1_700_000_000,
            payload: &payload,
            ..Default::default()
        };
        let mut rpc = connected();
        let v = encoded(&mut rpc, &Frame::Recv(p)).unwrap();
        assert_eq!(
            v,
            json!({"jsonrpc": "2.0", "method": "recv", "params": {
                "header": {"dup": true, "redDot": true},
                "messageId": "9007199254740993", "messageSeq": 5,
                "timestamp": 1_700_000_000, "channelId": "u2", "channelType": 1,
                "fromUid": "u2", "clientMsgNo": "m", "payload": "AAEC+g=="}})
        );
    }

    #[test]
    fn recvack_takes_int64_ids_as_strings_or_numbers_exactly() {
        let mut rpc = connected();
        for id in [
            json!("9223372036854775807"),
            json!(9_223_372_036_854_775_807_i64),
        ] {
            let got = decode(
                &mut rpc,
                json!({"method": "recvack", "params": {"messageId": id, "messageSeq": 3}}),
            )
            .unwrap();
            assert_eq!(
                got.frame(),
                Frame::Recvack(RecvackPacket {
                    flags: Flags::NONE,
                    message_id: i64::MAX,
                    message_seq: 3
                })
            );
        }
        for bad in [json!("9223372036854775808"), json!(1.5), json!("x")] {
            let err = decode(
                &mut rpc,
                json!({"method": "recvack", "params": {"messageId": bad, "messageSeq": 3}}),
            )
            .unwrap_err();
            assert_eq!((err.id, err.code), (None, INVALID_PARAMS), "{bad}");
        }
    }

    #[test]
    fn ping_pong_and_disconnect_both_ways() {
        let mut rpc = connected();
        assert_eq!(
            decode(&mut rpc, json!({"method": "ping", "id": "p1"})),
            Ok(Inbound::Ping)
        );
        assert_eq!(
            decode(&mut rpc, json!({"method": "ping"})),
            Ok(Inbound::Ping)
        );
        assert_eq!(
            encoded(&mut rpc, &Frame::Pong),
            Some(json!({"jsonrpc": "2.0", "id": "p1", "result": null}))
        );
        assert_eq!(
            encoded(&mut rpc, &Frame::Pong),
            Some(json!({"jsonrpc": "2.0", "method": "pong"}))
        );
        let got = decode(
            &mut rpc,
            json!({"method": "disconnect", "params": {"reasonCode": 0, "reason": "bye"}}),
        )
        .unwrap();
        assert_eq!(
            got.frame(),
            Frame::Disconnect(DisconnectPacket {
                flags: Flags::NONE,
                reason_code: ReasonCode::UNKNOWN,
                reason: "bye"
            })
        );
        let kick = DisconnectPacket {
            reason_code: ReasonCode::CONNECT_KICK,
            reason: "login on another device",
            ..Default::default()
        };
        assert_eq!(
            encoded(&mut rpc, &Frame::Disconnect(kick)),
            Some(json!({"jsonrpc": "2.0", "method": "disconnect",
                        "params": {"reasonCode": 12, "reason": "login on another device"}}))
        );
    }

    #[test]
    fn bad_input_is_rejected_with_or_without_an_id() {
        let mut fresh = JsonRpc::new(4);
        let mut rpc = connected();
        let rejected = |rpc: &mut JsonRpc, text: &str| rpc.decode(text.as_bytes()).unwrap_err();
        // Unanswerable: no usable id.
        for text in [
            "",
            "{not json",
            "\u{0}",
            "[{\"method\":\"ping\",\"id\":1}]",
            "42",
            r#"{"method":"ping","id":{"x":1}}"#,
            r#"{"method":"send","params":{}}"#,
        ] {
            let r = rejected(&mut rpc, text);
            assert_eq!(r.id, None, "{text:?}");
            let mut out = Vec::new();
            encode_rejection(&r, &mut out);
            let v: Value = serde_json::from_slice(&out).unwrap();
            assert_eq!(v["method"], "disconnect", "{text:?}");
            assert_eq!(v["params"]["reason"], r.message.as_str());
        }
        let long_id = format!(r#"{{"method":"ping","id":"{}"}}"#, "x".repeat(ID_BYTES_MAX));
        assert_eq!(rejected(&mut rpc, &long_id).id, None);
        // Answerable: an error object with the request's id.
        for (before_connect, text, code) in [
            (true, r#"{"method":"ping","id":"a"}"#, INVALID_REQUEST),
            (
                false,
                r#"{"method":"connect","id":"a","params":{"uid":"u"}}"#,
                INVALID_REQUEST,
            ),
            (
                false,
                r#"{"jsonrpc":"1.0","method":"ping","id":"a"}"#,
                INVALID_REQUEST,
            ),
            (
                false,
                r#"{"method":"subscribe","id":"a","params":{}}"#,
                METHOD_NOT_FOUND,
            ),
            (false, r#"{"method":"send","id":"a"}"#, INVALID_PARAMS),
            (
                false,
                r#"{"method":"send","id":"a","params":{"channelId":"u","channelType":256,"payload":"aGk="}}"#,
                INVALID_PARAMS,
            ),
            (
                false,
                r#"{"method":"send","id":"a","params":{"channelId":"u","channelType":1,"payload":"not base64 nor json"}}"#,
                INVALID_PARAMS,
            ),
            (
                false,
                r#"{"method":"send","id":"a","params":{"channelId":"u","channelType":1,"payload":5}}"#,
                INVALID_PARAMS,
            ),
        ] {
            let codec = if before_connect { &mut fresh } else { &mut rpc };
            let r = rejected(codec, text);
            assert_eq!(
                (r.id.clone(), r.code),
                (Some(Id(json!("a"))), code),
                "{text}"
            );
            let mut out = Vec::new();
            encode_rejection(&r, &mut out);
            let v: Value = serde_json::from_slice(&out).unwrap();
            assert_eq!(v["id"], "a");
            assert_eq!(v["error"]["code"], code);
        }
        assert_eq!(rpc.sends_pending(), 0, "a refused send keeps no id");
    }

    #[test]
    fn pings_awaiting_pongs_are_bounded() {
        let mut rpc = connected();
        for _ in 0..PINGS_PENDING_MAX {
            decode(&mut rpc, json!({"method": "ping", "id": 1})).unwrap();
        }
        let err = decode(&mut rpc, json!({"method": "ping", "id": 2})).unwrap_err();
        assert_eq!(err.code, INVALID_REQUEST);
    }
}
