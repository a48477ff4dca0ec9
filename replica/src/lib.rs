//! Replicated groups for imrouter, sans-IO.
//!
//! A group is one raft group (tikv/raft-rs, pinned behind this crate): its
//! replicas agree on one log, and its leader is the one that may act for it. The
//! node runs one group per slot id (a controller group is to come: "Replicated
//! slot ids…"); this crate holds what one replica decides, with no IO:
//!
//! - [`group`]: one replica, driven by ticks, peers' bytes and proposals; it gives
//!   out the bytes to send and the entries committed ([`group::Group`]). Election
//!   timeouts come from a seed, so a run replays.
//! - [`durable`]: what a replica makes durable (records, hard state,
//!   configuration) in our own types, and the order it must be made durable in
//!   before the messages that depend on it leave.
//! - [`wire`]: raft messages in our own postcard encoding; a peer's proposal, the
//!   kinds a node only gives itself, and misaddressed or malformed bytes are
//!   refused by name, and no protobuf from a peer is ever parsed.
//!
//! The boundary: no sockets, files, threads or clocks (clippy.toml's
//! `disallowed-*`, tests/boundary.rs). The engine moves the bytes and makes the
//! log durable.

#![warn(missing_docs)]

pub mod durable;
pub mod group;
pub mod wire;

pub use durable::{ConfState, Durable, HardState, Persist, Record, RecordKind};
pub use group::{Committed, Group, GroupConfig, GroupError, Outputs, Role};
pub use wire::WireError;
