//! The imrouter decisions, sans-IO: every machine here takes its inputs and `now` as
//! arguments and returns its outputs. Nothing in this crate opens a socket or a file,
//! starts a thread or reads a clock; `engine` (the node's drivers) moves bytes and
//! messages between these machines, the network and the disk. The compiler keeps it
//! so: this crate cannot name `engine`, and `clippy.toml` forbids the std types and
//! functions that reach the outside (`tests/boundary.rs` checks the rest).
//!
//! The presence side (CONNECT):
//! - [`cluster`]: the cluster view and the exact authority [`cluster::Target`].
//! - [`route`]: routes, their identity, owner actions and the authority's errors.
//! - [`authority`]: the fenced, expiring route directory of the hash slots a shard leads.
//! - [`registry`]: the owner-local registry of sessions on one gateway shard.
//! - [`activation`]: the CONNECT → CONNACK activation machine.
//! - [`connection`]: what a client's frame does in each state of its connection.
//! - [`hop`]: the hops between the roles, and what a request without an answer becomes.
//!
//! The SEND path, in flow order:
//! - [`channel`]: person channel keys and the channel ids a RECV carries.
//! - [`send_rate`]: the gateway's per-uid SEND rate (per shard).
//! - [`new_channels`]: the gateway's per-connection budget of new channels.
//! - [`gateway`]: the gateway's credits of SENDs in flight.
//! - [`commit`]: the commit core: permission, back-pressure, ids and seqs, sync.
//! - [`idempotency`] and [`idgen`]: the commit's idempotency window and message ids.
//! - [`delivery`]: post-commit delivery planning: targets, lookups, push batches.
//! - [`acks`]: the owner's pending RECVACKs, re-sends and expiries.
//! - [`webhook`]: the webhook queues: batching, the byte budget, retries, dedup.

#![warn(clippy::too_many_lines)] // every function at most 80 code lines (clippy.toml)

pub mod acks;
pub mod activation;
pub mod authority;
pub mod channel;
pub mod cluster;
pub mod commit;
pub mod connection;
pub mod delivery;
pub mod gateway;
pub mod hop;
pub mod idempotency;
pub mod idgen;
pub mod new_channels;
pub mod registry;
pub mod route;
pub mod send_rate;
pub mod webhook;
