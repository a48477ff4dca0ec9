//! Step 1 of a SEND, on the sender's shard: from the decoded frame to a [`Commit`]
//! on the channel's commit shard (or the hop `ForwardedSend` to its home node), or a
//! SENDACK refusal at once; and, when the answer comes back, the SENDACK to the
//! connection.
//!
//! [`GatewaySide`] (its state in `send/mod.rs`) decides: the channel, the uid's SEND
//! rate (`domain::send::send_rate`), the connection's new-channel budget
//! (`domain::send::new_channels`), msg_key and decryption (`proto::crypto`), the
//! credits of SENDs in flight (`domain::send::gateway`), and where the commit runs
//! (`SendRoute`). It borrows the connection table and the view per call
//! ([`GatewayIo`]) and returns what the SEND becomes ([`Admitted`]); the shard's
//! `on_send` below carries it.

use net::io::{ConnId, NetDriver};
use proto::wkproto::{Flags, ReasonCode, SendPacket, SendackPacket, Setting};
use shard::runtime::Context;
use slots::{ShardId, SlotMap};

use crate::channel::Channel;
use crate::cluster::{ClusterView, NodeId};
use crate::delivery::Sender;
use domain::send::gateway::{SendCredits, SendRoute};
use domain::send::send_rate::Verdict;

use super::super::conn::ConnTable;
use super::super::metrics::ShardMetrics;
use super::super::msg::Pending;
use super::super::msg::{Msg, SendAck};
use super::super::shard::{NodeShard, NodeTimer};
use super::super::wire;
use super::{Commit, GatewaySide, Origin};

/// What one call of the gateway side borrows from its shard.
pub(crate) struct GatewayIo<'a> {
    pub(crate) conns: &'a mut ConnTable,
    pub(crate) metrics: &'a ShardMetrics,
    pub(crate) view: &'a ClusterView,
    pub(crate) slot_map: &'a SlotMap,
}

/// What a SEND becomes at its gateway.
pub(crate) enum Admitted {
    /// Refused: a SENDACK with this reason, at once.
    Refused(ReasonCode),
    /// To the channel's commit shard on this node (maybe this shard).
    Commit { to: ShardId, commit: Box<Commit> },
    /// To the channel's home node: its SENDACK comes back as the reply.
    Forward {
        home: NodeId,
        request: wire::Request,
        pending: Pending,
    },
}

impl GatewaySide {
    /// A SEND of connection `id` decoded at `decoded_ns`; `None` when the
    /// connection is gone.
    pub(crate) fn on_send(
        &mut self,
        io: &mut GatewayIo<'_>,
        id: ConnId,
        p: &SendPacket<'_>,
        decoded_ns: u64,
    ) -> Option<Admitted> {
        let conn = io.conns.get(id)?;
        let (uid, session_id) = (conn.uid.clone(), conn.session_id);
        let channel = match Channel::resolve(&uid, p.channel_id, p.channel_type.0) {
            Ok(c) => c,
            Err(e) => {
                io.metrics.send_refused.inc();
                return Some(Admitted::Refused(e.reason_code()));
            }
        };
        if self.send_rate.admit(&uid, decoded_ns) != Verdict::Admit {
            io.metrics.sends_refused_uid_rate.inc();
            return Some(Admitted::Refused(ReasonCode::RATE_LIMIT));
        }
        if !self.admit_new_channel(io.conns, id, &channel, decoded_ns / 1_000_000) {
            io.metrics.sends_rate_limited.inc();
            return Some(Admitted::Refused(ReasonCode::RATE_LIMIT));
        }
        let payload = match open_payload(io, id, p) {
            Ok(payload) => payload,
            Err(reason) => return Some(Admitted::Refused(reason)),
        };
        // One CRC32 of the channel key: its hash slot gives both the home node and
        // the commit shard.
        let slot = slots::hash_slot(channel.key().as_bytes());
        let route = SendRoute::of(io.view, io.slot_map, self.node_id, slot);
        if !self.take_credit(io.conns, id, route.credit_shard(self.me)) {
            io.metrics.sends_refused_credit.inc();
            return Some(Admitted::Refused(ReasonCode::RATE_LIMIT));
        }
        io.metrics.sends.inc();
        let sent = SendOf {
            id,
            uid,
            session_id,
            channel,
            payload,
        };
        Some(match route {
            SendRoute::Local(to) => Admitted::Commit {
                to,
                commit: Box::new(self.commit(p, sent, decoded_ns)),
            },
            SendRoute::Remote(home) => {
                let (request, pending) = self.forward_request(p, sent);
                Admitted::Forward {
                    home,
                    request: wire::Request::Send(Box::new(request)),
                    pending,
                }
            }
        })
    }

    /// The SENDACK of a SEND of this gateway: the SENDACK frame to write, if the
    /// sending session is still there (its SEND's credit towards the commit shard
    /// came back with the message that carried the answer: [`Self::returned_from`]).
    pub(crate) fn on_sendack(
        &mut self,
        conns: &mut ConnTable,
        ack: &SendAck,
    ) -> Option<SendackPacket> {
        let conn = conns.get_mut(ack.conn)?;
        if conn.session_id != ack.session_id {
            return None;
        }
        SendCredits::answered(&mut conn.sends_in_flight);
        Some(SendackPacket {
            message_id: ack.message_id,
            client_seq: ack.client_seq,
            message_seq: ack.message_seq,
            reason_code: ack.reason,
            ..Default::default()
        })
    }

    /// A SENDACK came from commit shard `from`: this gateway's credit towards it
    /// returns.
    pub(crate) fn returned_from(&mut self, from: ShardId) {
        self.credits.returned_from(from);
    }

    /// The commit of a SEND to a commit shard of this node.
    fn commit(&self, p: &SendPacket<'_>, sent: SendOf, decoded_ns: u64) -> Commit {
        let answer_to = Origin::Client {
            shard: self.me,
            conn: sent.id,
            session_id: sent.session_id,
            client_seq: p.client_seq,
        };
        Commit {
            request: self.commit_request(p, sent, answer_to),
            decoded_ns,
        }
    }

    /// The SEND as its commit core takes it, answered to `answer_to`.
    fn commit_request<A>(
        &self,
        p: &SendPacket<'_>,
        s: SendOf,
        answer_to: A,
    ) -> domain::send::commit::CommitRequest<A> {
        let sender = Sender {
            node_id: self.node_id,
            boot_id: self.boot_id,
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

    /// A SEND whose channel is homed on another node, as the hop `ForwardedSend`
    /// to it; its SENDACK comes back as the reply (or SENDACK 10 if the home does
    /// not answer), to the connection the [`Pending`] names.
    fn forward_request(&self, p: &SendPacket<'_>, s: SendOf) -> (wire::ForwardedSend, Pending) {
        let pending = Pending::Send {
            conn: s.id,
            session_id: s.session_id,
            client_seq: p.client_seq,
        };
        (self.commit_request(p, s, ()), pending)
    }

    /// How fast this connection starts new channels
    /// (`domain::send::new_channels`).
    fn admit_new_channel(
        &self,
        conns: &mut ConnTable,
        id: ConnId,
        channel: &Channel,
        now_ms: u64,
    ) -> bool {
        let hash = domain::send::new_channels::channel_hash(channel.channel_type(), channel.key());
        conns
            .get_mut(id)
            .is_some_and(|c| c.new_channels.admit(self.new_channel_limits, hash, now_ms))
    }

    /// Credits (`domain::send::gateway`): the connection's SENDs in flight, and this
    /// shard's towards `to` (each reserves room for its SENDACK on the way back).
    fn take_credit(&mut self, conns: &mut ConnTable, id: ConnId, to: ShardId) -> bool {
        let Some(conn) = conns.get_mut(id) else {
            return false;
        };
        self.credits.take(&mut conn.sends_in_flight, to)
    }
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

/// The plaintext payload: verified (msg_key) and decrypted for the connection's
/// session, or as it came when the SEND says NoEncrypt or came as JSON-RPC.
fn open_payload(io: &GatewayIo<'_>, id: ConnId, p: &SendPacket<'_>) -> Result<Vec<u8>, ReasonCode> {
    let conn = io.conns.get(id);
    let json = conn.is_some_and(|c| c.is_jsonrpc());
    if json || p.setting.contains(Setting::NO_ENCRYPT) {
        return Ok(p.payload.to_vec());
    }
    let cipher = conn
        .and_then(|c| c.cipher.as_ref())
        .ok_or(ReasonCode::SYSTEM_ERROR)?;
    // One pass: `open_send` verifies the msg_key (one MD5 over the re-encrypted
    // sign string) and then decrypts; a mismatch is SENDACK 8, a payload that is not
    // ciphertext SENDACK 9 (`CryptoError::reason_code`).
    let mut plain = Vec::with_capacity(p.payload.len());
    if let Err(err) = cipher.open_send(p, &mut plain) {
        io.metrics.send_refused.inc();
        return Err(err.reason_code());
    }
    Ok(plain)
}

impl NodeShard {
    /// A SEND from an active connection: the gateway side decides, the shard
    /// carries its answer (a refusal to the socket, a commit to its shard, a
    /// forward to the home node).
    pub(crate) fn on_send(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        id: ConnId,
        p: &SendPacket<'_>,
    ) {
        // The turn's clock: one read per loop turn, not per SEND.
        let decoded_ns = self.turn_now().mono_ns;
        let (gateway, mut io) = self.gateway_io();
        match gateway.on_send(&mut io, id, p, decoded_ns) {
            None => {}
            Some(Admitted::Refused(reason)) => {
                let ack = SendackPacket {
                    client_seq: p.client_seq,
                    reason_code: reason,
                    ..Default::default()
                };
                self.write_frame(driver, id, |v, out| ack.encode(v, out));
            }
            Some(Admitted::Commit { to, commit }) => self.hand(cx, driver, to, Msg::Commit(commit)),
            Some(Admitted::Forward {
                home,
                request,
                pending,
            }) => self.request_remote(cx, home, request, pending),
        }
    }

    /// SENDACK back on the gateway shard, if the sending session is still there.
    pub(crate) fn on_sendack(&mut self, driver: &mut NetDriver, ack: SendAck) {
        if let Some(p) = self.gateway.on_sendack(&mut self.conns, &ack) {
            self.write_frame(driver, ack.conn, |v, out| p.encode(v, out));
        }
    }

    /// The gateway side, with what one of its calls borrows from the shard.
    fn gateway_io(&mut self) -> (&mut GatewaySide, GatewayIo<'_>) {
        let io = GatewayIo {
            conns: &mut self.conns,
            metrics: &self.metrics,
            view: &self.view,
            slot_map: &self.shared.slot_map,
        };
        (&mut self.gateway, io)
    }
}
