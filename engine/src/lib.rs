//! The imrouter domain, sans-IO: every decision takes its inputs and `now` as
//! arguments and returns its outputs; the shard loops and IO drivers only move bytes
//! and messages between these pieces.
//!
//! - [`cluster`]: the cluster view and the exact authority [`cluster::Target`].
//! - [`route`]: routes, their identity, owner actions and the authority's errors.
//! - [`authority`]: the fenced, expiring route directory of the hash slots this shard leads.
//! - [`registry`]: the owner-local registry of sessions on one gateway shard.
//! - [`activation`]: the CONNECT → CONNACK activation state machine.
//! - [`channel`]: person channel keys and the channel ids a RECV carries.
//! - [`config`]: the node's TOML configuration, every limit with its unit.
//! - [`delivery`]: post-commit delivery planning: targets, lookups, push batches.
//! - [`http`]: the HTTP API (WuKongIM's server API subset, health, metrics).
//! - [`node`]: a running node: the shards wired to sockets, rings, timers and logs.
//! - [`store`]: the durable message log of a delivery shard and the metadata store.

pub mod activation;
pub mod authority;
pub mod channel;
pub mod cluster;
pub mod config;
pub mod delivery;
pub mod http;
pub mod node;
pub mod registry;
pub mod route;
pub mod store;
