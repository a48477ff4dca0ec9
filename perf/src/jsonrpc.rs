//! The client side of JSON-RPC over WebSocket text messages, as WuKongIM's EasySDKs
//! speak it (the node's side is `proto::jsonrpc`): `connect`, `send` (whose request
//! id is the SEND's client_seq) and `recvack` out; the `connect` and `send` results,
//! `recv` and `disconnect` notifications and error objects in, each handed to the
//! load loop as the wkproto frame it stands for. Payloads go out and come in as
//! base64; nothing is encrypted (JSON-RPC has no message encryption).

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use serde::Deserialize;
use serde_json::Value;

/// The request id of `connect` (`send` ids are client_seqs, from 1).
const CONNECT_ID: u64 = 0;

/// Appends the `connect` request for `uid`.
pub fn encode_connect(uid: &str, token: &str, out: &mut Vec<u8>) {
    let v = serde_json::json!({
        "jsonrpc": "2.0", "method": "connect", "id": CONNECT_ID,
        "params": {"uid": uid, "token": token, "deviceId": uid, "deviceFlag": 0,
                   "clientTimestamp": 0, "version": 6},
    });
    // Serializing a Value into a Vec cannot fail.
    let _ = serde_json::to_writer(out, &v);
}

/// Appends a `send` request (id `client_seq`) carrying `payload` as base64.
pub fn encode_send(
    client_seq: u32,
    client_msg_no: &str,
    channel_id: &str,
    channel_type: u8,
    payload: &[u8],
    out: &mut Vec<u8>,
) {
    let v = serde_json::json!({
        "jsonrpc": "2.0", "method": "send", "id": client_seq,
        "params": {"clientMsgNo": client_msg_no, "channelId": channel_id,
                   "channelType": channel_type, "payload": BASE64.encode(payload)},
    });
    let _ = serde_json::to_writer(out, &v);
}

/// Appends the `recvack` notification of a RECV.
pub fn encode_recvack(message_id: i64, message_seq: u64, out: &mut Vec<u8>) {
    let v = serde_json::json!({
        "jsonrpc": "2.0", "method": "recvack",
        "params": {"messageId": message_id.to_string(), "messageSeq": message_seq},
    });
    let _ = serde_json::to_writer(out, &v);
}

/// A message from the node.
#[derive(Debug, PartialEq, Eq)]
pub enum Incoming {
    /// The `connect` answer: reason 1 with the server's key, or the refusal's code.
    Connected {
        reason: u8,
        server_key: String,
        salt: String,
        server_version: Option<u8>,
    },
    /// A `send` answer (its id is the SEND's client_seq).
    Sent {
        client_seq: u32,
        message_id: i64,
        message_seq: u64,
        reason: u8,
    },
    /// A `recv` notification with its decoded payload.
    Recv {
        message_id: i64,
        message_seq: u64,
        dup: bool,
        payload: Vec<u8>,
    },
    Disconnect {
        reason: u8,
    },
    /// A pong, or a notification the harness has no use for.
    Ignored,
}

#[derive(Deserialize)]
struct Envelope {
    #[serde(default)]
    id: Option<Value>,
    #[serde(default)]
    method: Option<String>,
    #[serde(default)]
    params: Option<Value>,
    #[serde(default)]
    result: Option<Value>,
    #[serde(default)]
    error: Option<ErrorObject>,
}

#[derive(Deserialize)]
struct ErrorObject {
    code: i64,
    #[serde(default)]
    message: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ConnectResult {
    #[serde(default)]
    server_key: String,
    #[serde(default)]
    salt: String,
    reason_code: u8,
    #[serde(default)]
    server_version: Option<u8>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SendResult {
    message_id: String,
    message_seq: u64,
    reason_code: u8,
}

#[derive(Deserialize, Default)]
struct HeaderIn {
    #[serde(default)]
    dup: bool,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RecvParams {
    #[serde(default)]
    header: HeaderIn,
    message_id: String,
    message_seq: u64,
    payload: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct DisconnectParams {
    reason_code: u8,
}

fn bad(what: &str, e: impl std::fmt::Display) -> String {
    format!("JSON-RPC {what}: {e}")
}

/// Decodes one text message from the node.
pub fn decode(text: &[u8]) -> Result<Incoming, String> {
    let env: Envelope = serde_json::from_slice(text).map_err(|e| bad("message", e))?;
    if let Some(method) = env.method {
        let params = env.params.unwrap_or(Value::Null);
        return match method.as_str() {
            "recv" => {
                let p: RecvParams = serde_json::from_value(params).map_err(|e| bad("recv", e))?;
                Ok(Incoming::Recv {
                    message_id: p.message_id.parse().map_err(|e| bad("recv id", e))?,
                    message_seq: p.message_seq,
                    dup: p.header.dup,
                    payload: BASE64
                        .decode(p.payload)
                        .map_err(|e| bad("recv payload", e))?,
                })
            }
            "disconnect" => {
                let p: DisconnectParams =
                    serde_json::from_value(params).map_err(|e| bad("disconnect", e))?;
                Ok(Incoming::Disconnect {
                    reason: p.reason_code,
                })
            }
            _ => Ok(Incoming::Ignored),
        };
    }
    let id = env.id.as_ref().and_then(Value::as_u64);
    match (id, env.result, env.error) {
        (Some(CONNECT_ID), Some(r), _) => {
            let r: ConnectResult = serde_json::from_value(r).map_err(|e| bad("connect", e))?;
            Ok(Incoming::Connected {
                reason: r.reason_code,
                server_key: r.server_key,
                salt: r.salt,
                server_version: r.server_version,
            })
        }
        (Some(CONNECT_ID), None, Some(e)) => Ok(Incoming::Connected {
            reason: u8::try_from(e.code).unwrap_or(0),
            server_key: String::new(),
            salt: String::new(),
            server_version: None,
        }),
        (Some(seq), Some(r), None) if r.is_object() => {
            let r: SendResult = serde_json::from_value(r).map_err(|e| bad("send", e))?;
            Ok(Incoming::Sent {
                client_seq: u32::try_from(seq).map_err(|e| bad("send id", e))?,
                message_id: r
                    .message_id
                    .parse()
                    .map_err(|e| bad("send message id", e))?,
                message_seq: r.message_seq,
                reason: r.reason_code,
            })
        }
        (_, _, Some(e)) => Err(format!("JSON-RPC error {}: {}", e.code, e.message)),
        _ => Ok(Incoming::Ignored),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::jsonrpc::{Inbound, JsonRpc};
    use proto::wkproto::{
        ChannelType, ConnackPacket, Flags, Frame, ReasonCode, RecvPacket, SendackPacket,
    };

    /// What the harness sends is what the node's codec takes, and what the node's
    /// codec answers is what the harness reads back: connect, send, recv, recvack.
    #[test]
    #[allow(clippy::too_many_lines)] // one round trip per message kind, in a row
    fn round_trips_through_the_nodes_codec() {
        let mut node = JsonRpc::new(16);
        let mut out = Vec::new();
        encode_connect("u1", "t-u1", &mut out);
        let Inbound::Connect(c) = node.decode(&out).unwrap() else {
            panic!("not a connect");
        };
        assert_eq!((c.uid.as_str(), c.token.as_str()), ("u1", "t-u1"));
        out.clear();
        let connack = ConnackPacket {
            reason_code: ReasonCode::SUCCESS,
            server_key: "k",
            salt: "s",
            server_version: Some(6),
            ..Default::default()
        };
        assert!(node.encode(&Frame::Connack(connack), &mut out));
        assert_eq!(
            decode(&out).unwrap(),
            Incoming::Connected {
                reason: 1,
                server_key: "k".into(),
                salt: "s".into(),
                server_version: Some(6)
            }
        );

        out.clear();
        encode_send(7, "m7", "u2", 1, b"\x00\x01bytes", &mut out);
        let Inbound::Send(s) = node.decode(&out).unwrap() else {
            panic!("not a send");
        };
        assert_eq!(s.payload, b"\x00\x01bytes");
        assert_eq!((s.channel_id.as_str(), s.channel_type), ("u2", 1));
        out.clear();
        let ack = SendackPacket {
            client_seq: s.client_seq,
            message_id: 1 << 60,
            message_seq: 3,
            reason_code: ReasonCode::SUCCESS,
            ..Default::default()
        };
        assert!(node.encode(&Frame::Sendack(ack), &mut out));
        assert_eq!(
            decode(&out).unwrap(),
            Incoming::Sent {
                client_seq: 7,
                message_id: 1 << 60,
                message_seq: 3,
                reason: 1
            }
        );

        out.clear();
        let recv = RecvPacket {
            flags: Flags::DUP,
            message_id: 42,
            message_seq: 9,
            channel_id: "u1",
            channel_type: ChannelType(1),
            from_uid: "u1",
            payload: b"\xffpayload",
            ..Default::default()
        };
        proto::jsonrpc::encode_recv(&recv, &mut out);
        assert_eq!(
            decode(&out).unwrap(),
            Incoming::Recv {
                message_id: 42,
                message_seq: 9,
                dup: true,
                payload: b"\xffpayload".to_vec()
            }
        );
        out.clear();
        encode_recvack(42, 9, &mut out);
        let Inbound::Recvack(a) = node.decode(&out).unwrap() else {
            panic!("not a recvack");
        };
        assert_eq!((a.message_id, a.message_seq), (42, 9));
    }

    #[test]
    fn a_refused_connect_gives_its_reason() {
        let mut node = JsonRpc::new(1);
        let mut out = Vec::new();
        encode_connect("u1", "wrong", &mut out);
        node.decode(&out).unwrap();
        out.clear();
        let refused = ConnackPacket {
            reason_code: ReasonCode(2),
            ..Default::default()
        };
        assert!(node.encode(&Frame::Connack(refused), &mut out));
        assert!(matches!(
            decode(&out).unwrap(),
            Incoming::Connected { reason: 2, .. }
        ));
    }
}
