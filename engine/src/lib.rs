//! The imrouter node: the drivers. The decisions live in the sans-IO crate
//! [`domain`] (re-exported here under their old paths); this crate wires them to the
//! shard threads, the rings, the sockets, the disk and the HTTP API, and only moves
//! bytes and messages between them.
//!
//! - [`config`]: the node's TOML configuration, every limit with its unit.
//! - [`hostcheck`]: `imrouter check-host`, the host against the configured load.
//! - [`http`]: the HTTP API (WuKongIM's server API subset, health, metrics).
//! - [`node`]: a running node: the shards wired to sockets, rings, timers and logs.
//! - [`store`]: the durable message log of a commit shard and the metadata store.

#![warn(clippy::too_many_lines)] // every function at most 80 code lines (clippy.toml)

pub use domain::cluster;
pub use domain::presence::{activation, authority, registry, route};
pub use domain::send::{channel, delivery};

pub mod config;
pub mod hostcheck;
pub mod http;
pub mod node;
pub mod store;
pub mod webhook;
