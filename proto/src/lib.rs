//! The wire of the router, sans-IO: bytes in, values out, values in, bytes out; no
//! sockets, files, threads or clocks (the drivers in `net::io` and `engine` move the
//! bytes).
//!
//! - [`wkproto`]: the WuKongIM binary protocol codec (incremental, zero-copy
//!   decoding; allocation-free encoding into reusable buffers).
//! - [`jsonrpc`]: JSON-RPC 2.0 as WuKongIM's EasySDKs speak it over WebSocket text
//!   messages, translated to and from the wkproto packet types.
//! - [`crypto`]: the per-connection key agreement and encryption (the caller
//!   supplies random seeds), both sides: [`crypto::server_handshake`] and
//!   [`crypto::ClientKey`].
//! - [`ws`]: WebSocket framing and the HTTP/1.1 upgrade, both sides (the server's
//!   transport and the clients: `net::client`, imbench).
//! - [`rpc`]: the inter-node wire: fixed frame headers, the authenticating
//!   handshake and the link machines.
//! - [`Transport`]: how a client reaches a node (and which listener accepted it).

#![warn(clippy::too_many_lines)] // every function at most 80 code lines (clippy.toml)

use std::fmt;
use std::str::FromStr;

pub mod crypto;
pub mod jsonrpc;
pub mod rpc;
pub mod wkproto;
pub mod ws;

/// How a client reaches a node, and which listener accepted a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    /// wkproto frames back to back on the stream.
    Tcp,
    /// wkproto frames inside binary WebSocket messages.
    WebSocket,
    /// The inter-node listener (`proto::rpc` frames on raw TCP, never WebSocket). Not
    /// a way for clients: [`FromStr`] does not accept it.
    Rpc,
}

impl Transport {
    /// The name on command lines and in reports: `tcp`, `ws` (or `rpc`).
    pub const fn name(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::WebSocket => "ws",
            Transport::Rpc => "rpc",
        }
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Transport {
    type Err = String;

    /// `tcp`, or `ws` (also `websocket`), any case: the client transports (`rpc` is
    /// refused).
    fn from_str(s: &str) -> Result<Transport, String> {
        match s.to_ascii_lowercase().as_str() {
            "tcp" => Ok(Transport::Tcp),
            "ws" | "websocket" => Ok(Transport::WebSocket),
            _ => Err(format!("transport is `tcp` or `ws`, not {s:?}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Transport;

    #[test]
    fn transport_names_round_trip() {
        for t in [Transport::Tcp, Transport::WebSocket] {
            assert_eq!(t.to_string().parse::<Transport>(), Ok(t));
        }
        assert_eq!("WebSocket".parse::<Transport>(), Ok(Transport::WebSocket));
        assert!("udp".parse::<Transport>().unwrap_err().contains("udp"));
        assert!(
            "rpc".parse::<Transport>().is_err(),
            "not a client transport"
        );
    }
}
