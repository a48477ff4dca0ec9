//! The SEND path, in flow order (`docs/flows.md`, flow 5): the gateway's admission,
//! the commit, delivery planning, the owner's acknowledgements.

pub mod acks;
pub mod channel;
pub mod commit;
pub mod delivery;
pub mod gateway;
pub mod idempotency;
pub mod idgen;
pub mod message;
pub mod new_channels;
pub mod send_rate;
