//! The events' JSON, as WuKongIM's webhooks send them.

use base64::Engine as _;
use domain::presence::authority::PresenceChange;
use domain::presence::route::Uid;
use domain::send::commit::Committed;
use domain::webhook::Event;
use proto::wkproto::Flags;
use serde_json::json;

/// A committed message as WuKongIM's webhooks show it (`msg.offline`, `msg.notify`):
/// header flags, ids (`message_idstr` for JavaScript), the channel as the sender
/// addressed it (a person channel: the recipient's uid), seconds, base64 payload.
fn message_json(m: &Committed) -> serde_json::Map<String, serde_json::Value> {
    let flag = |f: Flags| u8::from(m.flags & f.0 != 0);
    let channel_id = crate::channel::recv_channel_id(&m.channel_key, m.channel_type, &m.from_uid);
    let v = json!({
        "header": {
            "no_persist": flag(Flags::NO_PERSIST),
            "red_dot": flag(Flags::RED_DOT),
            "sync_once": flag(Flags::SYNC_ONCE),
        },
        "setting": m.setting,
        "expire": m.expire_s,
        "message_id": m.message_id,
        "message_idstr": m.message_id.to_string(),
        "client_msg_no": m.client_msg_no,
        "message_seq": m.message_seq,
        "from_uid": &*m.from_uid,
        "channel_id": channel_id,
        "channel_type": m.channel_type,
        "timestamp": m.timestamp_s,
        "payload": base64::engine::general_purpose::STANDARD.encode(&m.payload),
    });
    let serde_json::Value::Object(mut o) = v else {
        unreachable!("an object literal");
    };
    if !m.topic.is_empty() {
        o.insert("topic".into(), m.topic.clone().into());
    }
    o
}

/// `msg.offline`: the message and `to_uids`; deduplicated by its message id.
pub fn offline(m: &Committed, uids: &[Uid]) -> Event {
    let mut o = message_json(m);
    let to: Vec<&str> = uids.iter().map(|u| &**u).collect();
    o.insert("to_uids".into(), to.into());
    Event {
        id: Some(m.message_id as u64),
        json: serde_json::Value::Object(o).to_string().into_bytes(),
    }
}

/// `msg.notify`: the message; deduplicated by its message id.
pub fn notify(m: &Committed) -> Event {
    Event {
        id: Some(m.message_id as u64),
        json: serde_json::Value::Object(message_json(m))
            .to_string()
            .into_bytes(),
    }
}

/// `user.onlinestatus`: WuKongIM's
/// `uid-device_flag-online-session_id-device_online-total_online` string.
pub fn status(c: &PresenceChange) -> Event {
    let s = format!(
        "{}-{}-{}-{}-{}-{}",
        c.uid,
        c.device_flag,
        u8::from(c.online),
        c.session_id,
        c.device_online,
        c.total_online
    );
    Event {
        id: None,
        json: serde_json::Value::String(s).to_string().into_bytes(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offline_is_the_message_with_to_uids() {
        let m = Committed {
            committed_ns: 0,
            message_id: 1 << 60,
            message_seq: 3,
            timestamp_s: 1_785_398_400,
            from_uid: "alice".into(),
            channel_key: "g1".into(),
            channel_type: 2,
            client_msg_no: "c1".into(),
            setting: 0,
            flags: Flags::RED_DOT.0,
            expire_s: 0,
            topic: String::new(),
            payload: b"hi".to_vec(),
        };
        let e = offline(&m, &["b".into(), "c".into()]);
        assert_eq!(e.id, Some(1 << 60));
        let v: serde_json::Value = serde_json::from_slice(&e.json).unwrap();
        assert_eq!(
            v,
            json!({
                "header": {"no_persist": 0, "red_dot": 1, "sync_once": 0},
                "setting": 0, "expire": 0,
                "message_id": 1u64 << 60, "message_idstr": (1u64 << 60).to_string(),
                "client_msg_no": "c1", "message_seq": 3, "from_uid": "alice",
                "channel_id": "g1", "channel_type": 2, "timestamp": 1_785_398_400u32,
                "payload": "aGk=", "to_uids": ["b", "c"],
            })
        );
    }

    #[test]
    fn status_is_wukongims_string() {
        let c = PresenceChange {
            uid: "u1".into(),
            device_flag: 1,
            online: false,
            session_id: 42,
            device_online: 0,
            total_online: 2,
        };
        assert_eq!(status(&c).json, br#""u1-1-0-42-0-2""#);
    }
}
