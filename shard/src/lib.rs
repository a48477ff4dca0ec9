//! Thread-per-core runtime for imrouter.
//!
//! - [`table`]: epoch-reclaimed single-writer/multi-reader hash table.
//! - [`runtime`]: pinned shard threads, the N×N SPSC mesh, doorbells, the IO driver contract.

#![warn(clippy::too_many_lines)] // every function at most 80 code lines (clippy.toml)

pub mod runtime;
pub mod table;
