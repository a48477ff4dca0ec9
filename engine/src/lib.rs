//! The imrouter domain, sans-IO: every decision takes its inputs and `now` as
//! arguments and returns its outputs; the shard loops and IO drivers only move bytes
//! and messages between these pieces.
//!
//! - [`cluster`]: the cluster view and the exact authority [`cluster::Target`].
//! - [`route`]: routes, their identity, owner actions and the authority's errors.
//! - [`authority`]: the fenced, expiring route directory of the hash slots this shard leads.
//! - [`registry`]: the owner-local registry of sessions on one gateway shard.
//! - [`activation`]: the CONNECT → CONNACK activation state machine.

pub mod activation;
pub mod authority;
pub mod cluster;
pub mod registry;
pub mod route;
