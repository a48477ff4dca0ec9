//! The presence side: where each device is connected, and the CONNECT that makes it
//! so (`docs/flows.md`, flows 1–4; the rules of `docs/authority-rules.md`).

pub mod activation;
pub mod authority;
pub mod connection;
pub mod registry;
pub mod route;
