//! Step 1 of a SEND, on the sender's shard: from the decoded frame to a [`Commit`]
//! on the channel's commit shard, or a SENDACK refusal at once; and, when the answer
//! comes back, the SENDACK to the connection.

use net::io::{ConnId, NetDriver};
use proto::wkproto::{Flags, ReasonCode, SendPacket, SendackPacket, Setting};
use shard::runtime::Context;

use crate::channel::Channel;
use crate::delivery::Sender;
use domain::send::gateway::{SendCredits, SendRoute};
use domain::send::send_rate::Verdict;

use super::super::msg::Pending;
use super::super::msg::{Msg, SendAck};
use super::super::shard::{NodeShard, NodeTimer};
use super::super::wire;
use super::{Commit, Origin};

/// A SEND from an active connection.
pub fn on_send(
    node: &mut NodeShard,
    cx: &mut Context<Msg, NodeTimer>,
    driver: &mut NetDriver,
    id: ConnId,
    p: &SendPacket<'_>,
) {
    // The turn's clock (`NodeShard::turn_now`): one read per loop turn, not per SEND.
    let decoded_ns = node.turn_now().mono_ns;
    let refuse = |node: &mut NodeShard, driver: &mut NetDriver, reason: ReasonCode| {
        let ack = SendackPacket {
            client_seq: p.client_seq,
            reason_code: reason,
            ..Default::default()
        };
        node.write_frame(driver, id, |v, out| ack.encode(v, out));
    };
    let Some(conn) = node.conn(id) else { return };
    let (uid, session_id) = (conn.uid.clone(), conn.session_id);
    let channel = match Channel::resolve(&uid, p.channel_id, p.channel_type.0) {
        Ok(c) => c,
        Err(e) => {
            node.metrics.send_refused.inc();
            return refuse(node, driver, e.reason_code());
        }
    };
    if node.send_rate.admit(&uid, decoded_ns) != Verdict::Admit {
        node.metrics.sends_refused_uid_rate.inc();
        return refuse(node, driver, ReasonCode::RATE_LIMIT);
    }
    if !admit_new_channel(node, id, &channel, decoded_ns / 1_000_000) {
        node.metrics.sends_rate_limited.inc();
        return refuse(node, driver, ReasonCode::RATE_LIMIT);
    }
    let payload = match open_payload(node, id, p) {
        Ok(payload) => payload,
        Err(reason) => return refuse(node, driver, reason),
    };
    // One CRC32 of the channel key: its hash slot gives both the home node and the
    // commit shard.
    let slot = slots::hash_slot(channel.key().as_bytes());
    let local_node = node.shared.config.node_id;
    let route = SendRoute::of(&node.view, &node.shared.slot_map, local_node, slot);
    if !take_credit(node, id, route.credit_shard(node.me)) {
        node.metrics.sends_refused_credit.inc();
        return refuse(node, driver, ReasonCode::RATE_LIMIT);
    }
    let sent = SendOf {
        id,
        uid,
        session_id,
        channel,
        payload,
    };
    let to = match route {
        SendRoute::Local(to) => to,
        SendRoute::Remote(home) => {
            let (request, pending) = forward_request(node, p, sent);
            let request = wire::Request::Send(Box::new(request));
            return node.request_remote(cx, home, request, pending);
        }
    };
    node.metrics.sends.inc();
    let answer_to = Origin::Client {
        shard: node.me,
        conn: sent.id,
        session_id: sent.session_id,
        client_seq: p.client_seq,
    };
    let commit = Commit {
        request: commit_request(node, p, sent, answer_to),
        decoded_ns,
    };
    node.hand(cx, driver, to, Msg::Commit(Box::new(commit)));
}

/// A SEND that passed the gateway's checks: its connection, sender, channel and
/// plaintext payload.
struct SendOf {
    id: ConnId,
    uid: crate::route::Uid,
    session_id: crate::route::SessionId,
    channel: Channel,
    payload: Vec<u8>,
}

/// The SEND's flags the commit keeps.
fn commit_flags(p: &SendPacket<'_>) -> u8 {
    p.flags.0 & (Flags::NO_PERSIST.0 | Flags::SYNC_ONCE.0 | Flags::RED_DOT.0)
}

/// The SEND as its commit core takes it, answered to `answer_to`.
fn commit_request<A>(
    node: &NodeShard,
    p: &SendPacket<'_>,
    s: SendOf,
    answer_to: A,
) -> domain::send::commit::CommitRequest<A> {
    let sender = Sender {
        node_id: node.shared.config.node_id,
        boot_id: node.shared.boot_id,
        session_id: s.session_id,
    };
    domain::send::commit::CommitRequest {
        answer_to,
        sender: Some(sender),
        from_uid: s.uid,
        client_msg_no: p.client_msg_no.to_owned(),
        setting: p.setting.0,
        flags: commit_flags(p),
        expire_s: p.expire_s,
        topic: p.topic.to_owned(),
        payload: s.payload,
        channel: s.channel,
    }
}

/// A SEND whose channel is homed on another node, as the hop `ForwardedSend` to
/// it; its SENDACK comes back as the reply (or SENDACK 10 if the home does not
/// answer), to the connection the [`Pending`] names.
fn forward_request(
    node: &mut NodeShard,
    p: &SendPacket<'_>,
    s: SendOf,
) -> (wire::ForwardedSend, Pending) {
    node.metrics.sends.inc();
    let pending = Pending::Send {
        conn: s.id,
        session_id: s.session_id,
        client_seq: p.client_seq,
    };
    (commit_request(node, p, s, ()), pending)
}

/// How fast this connection starts new channels (`domain::send::new_channels`).
fn admit_new_channel(node: &mut NodeShard, id: ConnId, channel: &Channel, now_ms: u64) -> bool {
    let limits = node.shared.config.session.new_channel_limits();
    let hash = domain::send::new_channels::channel_hash(channel.channel_type(), channel.key());
    node.conn_mut(id)
        .is_some_and(|c| c.new_channels.admit(limits, hash, now_ms))
}

/// The plaintext payload: verified (msg_key) and decrypted for the connection's
/// session, or as it came when the SEND says NoEncrypt or came as JSON-RPC.
fn open_payload(node: &NodeShard, id: ConnId, p: &SendPacket<'_>) -> Result<Vec<u8>, ReasonCode> {
    let json = node.conn(id).is_some_and(|c| c.is_jsonrpc());
    if json || p.setting.contains(Setting::NO_ENCRYPT) {
        return Ok(p.payload.to_vec());
    }
    let cipher = node
        .conn(id)
        .and_then(|c| c.cipher.as_ref())
        .ok_or(ReasonCode::SYSTEM_ERROR)?;
    // One pass: `open_send` verifies the msg_key (one MD5 over the re-encrypted
    // sign string) and then decrypts; a mismatch is SENDACK 8, a payload that is not
    // ciphertext SENDACK 9 (`CryptoError::reason_code`).
    let mut plain = Vec::with_capacity(p.payload.len());
    if let Err(err) = cipher.open_send(p, &mut plain) {
        node.metrics.send_refused.inc();
        return Err(err.reason_code());
    }
    Ok(plain)
}

/// Credits (`domain::send::gateway`): the connection's SENDs in flight, and this shard's
/// towards `to` (each reserves room for its SENDACK on the way back).
fn take_credit(node: &mut NodeShard, id: ConnId, to: slots::ShardId) -> bool {
    let Some(conn) = node.conns.get_mut(id) else {
        return false;
    };
    node.credits.take(&mut conn.sends_in_flight, to)
}

/// SENDACK back on the gateway shard, if the sending session is still there (its
/// SEND's shard credit returns when the SENDACK arrives, in `NodeShard::on_message`).
pub fn on_sendack(node: &mut NodeShard, driver: &mut NetDriver, ack: SendAck) {
    let Some(conn) = node.conn_mut(ack.conn) else {
        return;
    };
    if conn.session_id != ack.session_id {
        return;
    }
    SendCredits::answered(&mut conn.sends_in_flight);
    let p = SendackPacket {
        message_id: ack.message_id,
        client_seq: ack.client_seq,
        message_seq: ack.message_seq,
        reason_code: ack.reason,
        ..Default::default()
    };
    node.write_frame(driver, ack.conn, |v, out| p.encode(v, out));
}
