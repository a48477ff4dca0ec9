//! The client-facing wire layer of the router.
//!
//! - [`wkproto`]: the WuKongIM binary protocol codec, sans-IO (incremental,
//!   zero-copy decoding; allocation-free encoding into reusable buffers).
//! - [`crypto`]: the per-connection key agreement and encryption, sans-IO (the
//!   caller supplies random seeds).
//! - [`io`]: the TCP and WebSocket transports of one shard, on io_uring with a mio
//!   fallback, behind `shard`'s driver contract.
//! - [`client`]: a small blocking client for tests and tools.

pub mod client;
pub mod crypto;
#[cfg(target_os = "linux")]
pub mod io;
pub mod wkproto;
