//! The transports of one shard, the IO half of the wire (its sans-IO half, the
//! codecs and machines, is the `proto` crate).
//!
//! - [`io`]: the TCP and WebSocket transports of one shard and its inter-node
//!   connections, on io_uring with a mio fallback, behind `shard`'s driver contract.
//! - [`client`]: a small blocking client for tests and tools.

#![warn(clippy::too_many_lines)] // every function at most 80 code lines (clippy.toml)
#![warn(missing_docs)]

pub mod client;
#[cfg(target_os = "linux")]
pub mod io;
