//! The commit core of a channel's commit shard: permission, back-pressure, the
//! idempotency window, message id and seq assignment, and what waits for the log's
//! sync before it is answered and delivered.

use std::sync::Arc;

use crate::route::Uid;

/// A committed message, shared by every push batch of its fan-out.
pub struct Committed {
    /// When the commit was appended (the driver's monotonic clock, ns): the start
    /// of the RECV latency.
    pub committed_ns: u64,
    pub message_id: i64,
    pub message_seq: u64,
    pub timestamp_s: u32,
    pub from_uid: Uid,
    pub channel_key: String,
    pub channel_type: u8,
    pub client_msg_no: String,
    pub setting: u8,
    pub flags: u8,
    pub expire_s: u32,
    pub topic: String,
    pub payload: Vec<u8>,
}

/// A RECV's message as the pending-ACK machine sees it.
impl crate::acks::AckMessage for Arc<Committed> {
    fn message_id(&self) -> i64 {
        self.message_id
    }

    /// Its payload and strings, whether or not other sessions share the message.
    fn charge_bytes(&self) -> usize {
        self.payload.len()
            + self.topic.len()
            + self.client_msg_no.len()
            + self.from_uid.len()
            + self.channel_key.len()
    }
}
