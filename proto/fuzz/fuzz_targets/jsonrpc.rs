//! Feeds arbitrary text messages to the JSON-RPC codec the way a connection does:
//! the first byte says whether `connect` came already, the rest is split into
//! messages at 0xFF bytes. A decoded message must stand for a packet that encodes
//! as wkproto and decodes to itself; a rejection must answer in valid JSON; every
//! `send` taken must be answerable once. Errors are fine, panics are bugs.
#![no_main]

use libfuzzer_sys::fuzz_target;
use proto::jsonrpc::{encode_rejection, Inbound, JsonRpc};
use proto::wkproto::{decode, ConnackPacket, Frame, ReasonCode, SendackPacket};

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let mut rpc = JsonRpc::new(4);
    if sel & 1 == 1 {
        let connect = br#"{"method":"connect","id":"c","params":{"uid":"u","token":"t"}}"#;
        assert!(rpc.decode(connect).is_ok());
        let ack = ConnackPacket {
            reason_code: ReasonCode::SUCCESS,
            ..Default::default()
        };
        let mut out = Vec::new();
        assert!(rpc.encode(&Frame::Connack(ack), &mut out));
    }
    let mut out = Vec::new();
    let mut wire = Vec::new();
    for message in rest.split(|&b| b == 0xff) {
        out.clear();
        match rpc.decode(message) {
            Ok(inbound) => {
                let frame = inbound.frame();
                wire.clear();
                if frame.encode(6, &mut wire).is_ok() {
                    let back = decode(&wire, 6, usize::MAX).expect("re-decodes");
                    assert_eq!(back.map(|(f, _)| f), Some(frame));
                }
                if let Inbound::Send(s) = &inbound {
                    let ack = SendackPacket {
                        client_seq: s.client_seq,
                        message_id: i64::MAX,
                        ..Default::default()
                    };
                    assert!(rpc.encode(&Frame::Sendack(ack), &mut out));
                    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
                    assert_eq!(v["result"]["messageId"], "9223372036854775807");
                    out.clear();
                    assert!(!rpc.encode(&Frame::Sendack(ack), &mut out), "answered once");
                }
            }
            Err(rejection) => {
                encode_rejection(&rejection, &mut out);
                let _: serde_json::Value = serde_json::from_slice(&out).expect("valid JSON");
            }
        }
    }
});
