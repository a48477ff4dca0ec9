//! The imrouter decisions, sans-IO: every machine here takes its inputs and `now` as
//! arguments and returns its outputs. Nothing in this crate opens a socket or a file,
//! starts a thread or reads a clock; `engine` (the node's drivers) moves bytes and
//! messages between these machines, the network and the disk. The compiler keeps it
//! so: this crate cannot name `engine`, and `clippy.toml` forbids the std types and
//! functions that reach the outside (`tests/boundary.rs` checks the rest).
//!
//! The presence side (CONNECT), [`presence`]:
//! - [`presence::route`]: routes, their identity, owner actions and the authority's errors.
//! - [`presence::authority`]: the fenced, expiring route directory of the hash slots a shard leads.
//! - [`presence::registry`]: the owner-local registry of sessions on one gateway shard.
//! - [`presence::activation`]: the CONNECT → CONNACK activation machine.
//! - [`presence::connection`]: what a client's frame does in each state of its connection.
//!
//! The SEND path, in flow order, [`send`]:
//! - [`send::channel`]: person channel keys and the channel ids a RECV carries.
//! - [`send::send_rate`]: the gateway's per-uid SEND rate (per shard).
//! - [`send::new_channels`]: the gateway's per-connection budget of new channels.
//! - [`send::gateway`]: the route of a SEND and the gateway's credits of SENDs in flight.
//! - [`send::commit`]: the commit core: permission, back-pressure, ids and seqs, sync.
//! - [`send::idempotency`] and [`send::idgen`]: the commit's idempotency window and message ids.
//! - [`send::delivery`]: post-commit delivery planning: targets, lookups, push batches.
//! - [`send::acks`]: the owner's pending RECVACKs, re-sends and expiries.
//!
//! Across both:
//! - [`cluster`]: the cluster view and the exact authority [`cluster::Target`].
//! - [`hop`]: the hops between the roles, and what a request without an answer becomes.
//! - [`webhook`]: the webhook queues: batching, the byte budget, retries, dedup.

#![warn(clippy::too_many_lines)] // every function at most 80 code lines (clippy.toml)
#![warn(missing_docs)]

pub mod cluster;
pub mod hop;
pub mod presence;
pub mod send;
pub mod webhook;
