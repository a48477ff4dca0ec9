//! What a client's frame does in each state of its connection, after the CONNECT:
//! frame × state → action, one table ([`on_frame`]). The gateway's driver reads the
//! frame, asks the table, and carries the action out (PONG, the SEND to the
//! gateway's path, the RECVACK to the pending acknowledgements, a SUBACK refusal, a
//! close with its reason). The CONNECT itself is admission's (its version, token
//! and activation).

use proto::wkproto::{Frame, ReasonCode};

/// Where a connection is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnPhase {
    /// Accepted; waiting for CONNECT.
    AwaitConnect,
    /// CONNECT received; its token is being checked at the uid's home node.
    Authenticating,
    /// CONNECT received; activation running.
    Activating,
    /// CONNACK success sent; the session sends and receives messages.
    Active,
    /// Closing (kicked, refused, shut down): what it sends is not acted on.
    Closing,
}

/// A client frame, as the table sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    /// PING: the client's keep-alive.
    Ping,
    /// SEND: a message to a channel.
    Send,
    /// RECVACK: the client acknowledges a RECV.
    Recvack,
    /// SUB: a subscription request (refused in every phase).
    Sub,
    /// DISCONNECT: the client leaves.
    Disconnect,
    /// CONNECT again, or a packet only a server sends (CONNACK, SENDACK, RECV, PONG,
    /// SUBACK).
    Other,
}

impl FrameKind {
    /// The kind of a decoded frame.
    pub fn of(frame: &Frame<'_>) -> FrameKind {
        match frame {
            Frame::Ping => FrameKind::Ping,
            Frame::Send(_) => FrameKind::Send,
            Frame::Recvack(_) => FrameKind::Recvack,
            Frame::Sub(_) => FrameKind::Sub,
            Frame::Disconnect(_) => FrameKind::Disconnect,
            Frame::Connect(_)
            | Frame::Connack(_)
            | Frame::Sendack(_)
            | Frame::Recv(_)
            | Frame::Pong
            | Frame::Suback(_) => FrameKind::Other,
        }
    }
}

/// What the driver does with the frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameAction {
    /// Answer PONG and mark the session touched (rule 33: a PING only marks it; the
    /// touch worker batches), in any state.
    Pong,
    /// Mark the session active and hand the SEND to the gateway's path.
    Send,
    /// Mark the session active and clear the acknowledged RECV.
    Recvack,
    /// Answer SUBACK with this reason (no channel type is subscribable yet).
    RefuseSub(ReasonCode),
    /// The client said DISCONNECT: close, in any state.
    Close,
    /// Send DISCONNECT with this reason, log the text, close.
    Refuse(ReasonCode, &'static str),
}

/// The table: what `kind` does in `phase` (`None`: a connection the table no longer
/// holds).
pub fn on_frame(phase: Option<ConnPhase>, kind: FrameKind) -> FrameAction {
    use ConnPhase::{Activating, Active, Authenticating};
    match (kind, phase) {
        (FrameKind::Ping, _) => FrameAction::Pong,
        (FrameKind::Disconnect, _) => FrameAction::Close,
        (FrameKind::Send, Some(Active)) => FrameAction::Send,
        (FrameKind::Recvack, Some(Active)) => FrameAction::Recvack,
        (FrameKind::Sub, Some(Active)) => {
            FrameAction::RefuseSub(ReasonCode::NOT_SUPPORT_CHANNEL_TYPE)
        }
        (
            FrameKind::Send | FrameKind::Recvack | FrameKind::Sub,
            Some(Activating | Authenticating),
        ) => FrameAction::Refuse(ReasonCode::SYSTEM_ERROR, "frame before CONNACK"),
        _ => FrameAction::Refuse(ReasonCode::NOT_SUPPORT_HEADER, "unexpected packet type"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PHASES: [Option<ConnPhase>; 6] = [
        Some(ConnPhase::AwaitConnect),
        Some(ConnPhase::Authenticating),
        Some(ConnPhase::Activating),
        Some(ConnPhase::Active),
        Some(ConnPhase::Closing),
        None,
    ];

    /// The whole table, written out: a row per frame kind, a column per phase in
    /// the order of `PHASES`.
    #[test]
    fn every_frame_in_every_phase() {
        use FrameAction as A;
        let early = A::Refuse(ReasonCode::SYSTEM_ERROR, "frame before CONNACK");
        let unexpected = A::Refuse(ReasonCode::NOT_SUPPORT_HEADER, "unexpected packet type");
        let sub = A::RefuseSub(ReasonCode::NOT_SUPPORT_CHANNEL_TYPE);
        let table = [
            (FrameKind::Ping, [A::Pong; 6]),
            (FrameKind::Disconnect, [A::Close; 6]),
            (
                FrameKind::Send,
                [unexpected, early, early, A::Send, unexpected, unexpected],
            ),
            (
                FrameKind::Recvack,
                [unexpected, early, early, A::Recvack, unexpected, unexpected],
            ),
            (
                FrameKind::Sub,
                [unexpected, early, early, sub, unexpected, unexpected],
            ),
            (FrameKind::Other, [unexpected; 6]),
        ];
        for (kind, row) in table {
            for (phase, expected) in PHASES.into_iter().zip(row) {
                assert_eq!(on_frame(phase, kind), expected, "{kind:?} in {phase:?}");
            }
        }
    }

    #[test]
    fn frames_are_told_apart_by_kind() {
        use proto::wkproto::{RecvackPacket, SendPacket};
        assert_eq!(FrameKind::of(&Frame::Ping), FrameKind::Ping);
        assert_eq!(FrameKind::of(&Frame::Pong), FrameKind::Other);
        assert_eq!(
            FrameKind::of(&Frame::Send(SendPacket::default())),
            FrameKind::Send
        );
        assert_eq!(
            FrameKind::of(&Frame::Recvack(RecvackPacket::default())),
            FrameKind::Recvack
        );
    }
}
