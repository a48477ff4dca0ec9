//! The peers imbench compares imrouter with: Redis pub/sub (RESP2) and NATS (its text
//! protocol). Minimal client codecs for the load loop ([`crate::conn::Conn`] carries
//! them): the encoders append to the connection's output buffer, the decoder reads in
//! place from the receive buffer and returns borrowed slices (no allocation per
//! message).
//!
//! What a peer connection says is mapped onto the events the load loop already
//! counts: [`PeerEvent::Ready`] (the subscription is confirmed, or the publisher's
//! PING answered) stands for CONNACK, [`PeerEvent::Published`] (Redis's integer
//! reply to PUBLISH) for SENDACK, [`PeerEvent::Message`] for RECV. A peer gets no
//! RECVACK (neither protocol has one), and NATS answers no PUB (`verbose` off, as its
//! clients run): its sends count as acknowledged when written.

use std::io::Write;
use std::net::SocketAddr;

/// Longest payload a peer message may carry (a longer one is a protocol error).
pub const PEER_PAYLOAD_MAX_BYTES: usize = 1 << 20;
/// Longest control line (NATS `INFO` included) before its CRLF.
pub const PEER_LINE_MAX_BYTES: usize = 16 * 1024;
/// Elements of a RESP array the decoder reads (pub/sub pushes have 3).
const RESP_ARRAY_MAX: usize = 4;

/// Which peer protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerProto {
    Redis,
    Nats,
}

impl PeerProto {
    pub fn name(self) -> &'static str {
        match self {
            PeerProto::Redis => "redis",
            PeerProto::Nats => "nats",
        }
    }

    /// Whether the server answers each publish (Redis's subscriber count).
    pub fn acks_publish(self) -> bool {
        self == PeerProto::Redis
    }
}

/// A peer server: `redis://HOST:PORT` or `nats://HOST:PORT`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerUrl {
    pub proto: PeerProto,
    pub addr: SocketAddr,
}

impl std::str::FromStr for PeerUrl {
    type Err = String;
    fn from_str(s: &str) -> Result<PeerUrl, String> {
        let (scheme, rest) = s
            .split_once("://")
            .ok_or_else(|| format!("{s:?}: expected redis://HOST:PORT or nats://HOST:PORT"))?;
        let proto = match scheme {
            "redis" => PeerProto::Redis,
            "nats" => PeerProto::Nats,
            _ => {
                return Err(format!(
                    "{s:?}: unknown peer scheme {scheme:?} (redis, nats)"
                ))
            }
        };
        let addr = rest
            .trim_end_matches('/')
            .parse()
            .map_err(|e| format!("{s:?}: {e} (HOST is an IP address, e.g. 127.0.0.1:6379)"))?;
        Ok(PeerUrl { proto, addr })
    }
}

impl std::fmt::Display for PeerUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}://{}", self.proto.name(), self.addr)
    }
}

/// A peer client's part: subscriber of `subscribe`, or publisher (None).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerRole {
    pub proto: PeerProto,
    pub subscribe: Option<String>,
}

/// What the decoder read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerEvent<'a> {
    /// The subscription is confirmed, or the PING sent after CONNECT answered.
    Ready,
    /// Redis's reply to PUBLISH: how many subscribers got the message.
    Published(i64),
    /// A message on a subscribed channel: its payload.
    Message(&'a [u8]),
    /// NATS's keep-alive: answer [`encode_pong`].
    Ping,
    /// Anything else of no interest (NATS `INFO`, `+OK`, Redis `pong` pushes).
    Ignored,
}

/// The greeting of a connection with `role`: Redis `SUBSCRIBE ch` or `PING`; NATS
/// `CONNECT` (no echo, not verbose), `SUB ch 1` for a subscriber, then `PING` (its
/// `PONG` says the subscription is in place).
pub fn encode_hello(role: &PeerRole, out: &mut Vec<u8>) {
    match (role.proto, &role.subscribe) {
        (PeerProto::Redis, Some(ch)) => {
            out.extend_from_slice(b"*2\r\n$9\r\nSUBSCRIBE\r\n");
            resp_bulk(out, ch.as_bytes());
        }
        (PeerProto::Redis, None) => out.extend_from_slice(b"*1\r\n$4\r\nPING\r\n"),
        (PeerProto::Nats, sub) => {
            out.extend_from_slice(
                b"CONNECT {\"verbose\":false,\"pedantic\":false,\"echo\":false,\
                  \"name\":\"imbench\",\"lang\":\"rust\",\"version\":\"0\",\"protocol\":1}\r\n",
            );
            if let Some(ch) = sub {
                out.extend_from_slice(b"SUB ");
                out.extend_from_slice(ch.as_bytes());
                out.extend_from_slice(b" 1\r\n");
            }
            out.extend_from_slice(b"PING\r\n");
        }
    }
}

/// One publish of `payload` on `channel`.
pub fn encode_publish(proto: PeerProto, channel: &str, payload: &[u8], out: &mut Vec<u8>) {
    match proto {
        PeerProto::Redis => {
            out.extend_from_slice(b"*3\r\n$7\r\nPUBLISH\r\n");
            resp_bulk(out, channel.as_bytes());
            resp_bulk(out, payload);
        }
        PeerProto::Nats => {
            out.extend_from_slice(b"PUB ");
            out.extend_from_slice(channel.as_bytes());
            let _ = write!(out, " {}\r\n", payload.len());
            out.extend_from_slice(payload);
            out.extend_from_slice(b"\r\n");
        }
    }
}

/// NATS's answer to the server's PING.
pub fn encode_pong(out: &mut Vec<u8>) {
    out.extend_from_slice(b"PONG\r\n");
}

fn resp_bulk(out: &mut Vec<u8>, b: &[u8]) {
    let _ = write!(out, "${}\r\n", b.len());
    out.extend_from_slice(b);
    out.extend_from_slice(b"\r\n");
}

/// Decodes the first complete reply or push at the start of `buf`: the event and
/// the bytes it spans, None when incomplete, an error for anything malformed.
pub fn decode(proto: PeerProto, buf: &[u8]) -> Result<Option<(PeerEvent<'_>, usize)>, String> {
    match proto {
        PeerProto::Redis => decode_resp(buf),
        PeerProto::Nats => decode_nats(buf),
    }
}

/// The line at the start of `buf` (without CRLF) and the bytes with it; None when
/// its CRLF has not arrived.
fn line(buf: &[u8]) -> Result<Option<(&[u8], usize)>, String> {
    match buf.windows(2).position(|w| w == b"\r\n") {
        Some(i) => Ok(Some((&buf[..i], i + 2))),
        None if buf.len() > PEER_LINE_MAX_BYTES => {
            Err(format!("a line longer than {PEER_LINE_MAX_BYTES} bytes"))
        }
        None => Ok(None),
    }
}

fn number(s: &[u8]) -> Result<i64, String> {
    std::str::from_utf8(s)
        .ok()
        .and_then(|t| t.parse().ok())
        .ok_or_else(|| format!("bad number {:?}", String::from_utf8_lossy(s)))
}

/// A payload length within [`PEER_PAYLOAD_MAX_BYTES`].
fn length(s: &[u8]) -> Result<usize, String> {
    let n = number(s)?;
    if n < 0 || n as usize > PEER_PAYLOAD_MAX_BYTES {
        return Err(format!("length {n} out of 0..={PEER_PAYLOAD_MAX_BYTES}"));
    }
    Ok(n as usize)
}

/// One RESP element: a bulk string or an integer.
#[derive(Clone, Copy)]
enum Elem<'a> {
    Bulk(&'a [u8]),
    /// An integer (checked, its value unused: a subscription count).
    Int,
}

/// A RESP element at the start of `buf` and its length.
fn resp_elem(buf: &[u8]) -> Result<Option<(Elem<'_>, usize)>, String> {
    let Some((l, used)) = line(buf)? else {
        return Ok(None);
    };
    match l.first() {
        Some(b':') => number(&l[1..]).map(|_| Some((Elem::Int, used))),
        Some(b'$') => {
            let n = length(&l[1..])?;
            if buf.len() < used + n + 2 {
                return Ok(None);
            }
            if &buf[used + n..used + n + 2] != b"\r\n" {
                return Err("bulk string not followed by CRLF".into());
            }
            Ok(Some((Elem::Bulk(&buf[used..used + n]), used + n + 2)))
        }
        _ => Err(format!(
            "unexpected RESP element {:?}",
            String::from_utf8_lossy(l)
        )),
    }
}

fn decode_resp(buf: &[u8]) -> Result<Option<(PeerEvent<'_>, usize)>, String> {
    let Some((l, mut used)) = line(buf)? else {
        return Ok(None);
    };
    let ev = match l.first() {
        Some(b'+') if &l[1..] == b"PONG" => PeerEvent::Ready,
        Some(b'+') => PeerEvent::Ignored,
        Some(b'-') => {
            return Err(format!(
                "server error: {}",
                String::from_utf8_lossy(&l[1..])
            ))
        }
        Some(b':') => PeerEvent::Published(number(&l[1..])?),
        Some(b'*') => {
            let n = length(&l[1..])?;
            if n == 0 || n > RESP_ARRAY_MAX {
                return Err(format!("RESP array of {n} elements"));
            }
            let mut elems = [Elem::Int; RESP_ARRAY_MAX];
            for e in elems.iter_mut().take(n) {
                let Some((el, u)) = resp_elem(&buf[used..])? else {
                    return Ok(None);
                };
                *e = el;
                used += u;
            }
            match (elems[0], n) {
                (Elem::Bulk(b"message"), 3) => match elems[2] {
                    Elem::Bulk(p) => PeerEvent::Message(p),
                    Elem::Int => return Err("message push without a payload".into()),
                },
                (Elem::Bulk(b"subscribe"), 3) => PeerEvent::Ready,
                (Elem::Bulk(b"pong"), _) => PeerEvent::Ignored,
                _ => return Err("unexpected RESP push".into()),
            }
        }
        _ => {
            return Err(format!(
                "unexpected RESP reply {:?}",
                String::from_utf8_lossy(l)
            ))
        }
    };
    Ok(Some((ev, used)))
}

fn decode_nats(buf: &[u8]) -> Result<Option<(PeerEvent<'_>, usize)>, String> {
    let Some((l, used)) = line(buf)? else {
        return Ok(None);
    };
    let ev = if l.starts_with(b"MSG ") {
        // MSG <subject> <sid> [reply-to] <#bytes>
        let n = l
            .rsplit(|&b| b == b' ')
            .next()
            .map(length)
            .ok_or("MSG without a length")??;
        if buf.len() < used + n + 2 {
            return Ok(None);
        }
        if &buf[used + n..used + n + 2] != b"\r\n" {
            return Err("MSG payload not followed by CRLF".into());
        }
        return Ok(Some((
            PeerEvent::Message(&buf[used..used + n]),
            used + n + 2,
        )));
    } else if l == b"PING" {
        PeerEvent::Ping
    } else if l == b"PONG" {
        PeerEvent::Ready
    } else if l.starts_with(b"INFO ") || l == b"+OK" {
        PeerEvent::Ignored
    } else if l.starts_with(b"-ERR") {
        return Err(format!("server error: {}", String::from_utf8_lossy(l)));
    } else {
        return Err(format!(
            "unexpected NATS line {:?}",
            String::from_utf8_lossy(l)
        ));
    };
    Ok(Some((ev, used)))
}

/// The pid of the process listening on TCP `addr`'s port (IPv4 or IPv6): the
/// listening socket's inode from `/proc/net/tcp{,6}`, then the process holding a
/// descriptor on it (`/proc/*/fd`: only processes this user may inspect).
pub fn pid_listening_on(addr: SocketAddr) -> Option<u32> {
    let port = format!(":{:04X}", addr.port());
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for l in text.lines().skip(1) {
            let f: Vec<&str> = l.split_whitespace().collect();
            // local_address, state 0A = LISTEN, inode in column 10.
            if f.len() > 9 && f[1].ends_with(&port) && f[3] == "0A" {
                inodes.push(format!("socket:[{}]", f[9]));
            }
        }
    }
    if inodes.is_empty() {
        return None;
    }
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let link = std::fs::read_link(fd.path()).unwrap_or_default();
            if inodes.iter().any(|i| link.as_os_str() == i.as_str()) {
                return Some(pid);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_and_bad_ones_say_why() {
        let u: PeerUrl = "redis://127.0.0.1:6379".parse().unwrap();
        assert_eq!((u.proto, u.addr.port()), (PeerProto::Redis, 6379));
        let u: PeerUrl = "nats://127.0.0.1:4222/".parse().unwrap();
        assert_eq!(u.to_string(), "nats://127.0.0.1:4222");
        assert!("kafka://127.0.0.1:1".parse::<PeerUrl>().is_err());
        assert!("redis://localhost".parse::<PeerUrl>().is_err());
    }

    /// Every prefix of a complete push is "incomplete", never an error or a
    /// wrong event (split reads).
    fn every_prefix_incomplete(proto: PeerProto, wire: &[u8], want: PeerEvent<'_>) {
        for cut in 0..wire.len() {
            assert_eq!(decode(proto, &wire[..cut]), Ok(None), "cut at {cut}");
        }
        assert_eq!(decode(proto, wire), Ok(Some((want, wire.len()))));
    }

    #[test]
    fn resp_pushes_and_replies_decode_at_any_split() {
        let payload = b"a\r\nbinary\0payload";
        let mut wire = b"*3\r\n$7\r\nmessage\r\n$2\r\nch\r\n".to_vec();
        resp_bulk(&mut wire, payload);
        every_prefix_incomplete(PeerProto::Redis, &wire, PeerEvent::Message(payload));
        let sub = b"*3\r\n$9\r\nsubscribe\r\n$2\r\nch\r\n:1\r\n";
        every_prefix_incomplete(PeerProto::Redis, sub, PeerEvent::Ready);
        every_prefix_incomplete(PeerProto::Redis, b":100\r\n", PeerEvent::Published(100));
        every_prefix_incomplete(PeerProto::Redis, b"+PONG\r\n", PeerEvent::Ready);
        assert!(decode(PeerProto::Redis, b"-ERR wrong\r\n").is_err());
        assert!(decode(PeerProto::Redis, b"*3\r\n$-5\r\n").is_err());
        assert!(decode(PeerProto::Redis, b"*3\r\n$2\r\nabXY").is_err());
    }

    #[test]
    fn nats_lines_decode_at_any_split() {
        let payload = b"x\r\ny";
        let wire = b"MSG grp 1 4\r\nx\r\ny\r\n";
        every_prefix_incomplete(PeerProto::Nats, wire, PeerEvent::Message(payload));
        every_prefix_incomplete(PeerProto::Nats, b"PING\r\n", PeerEvent::Ping);
        every_prefix_incomplete(PeerProto::Nats, b"PONG\r\n", PeerEvent::Ready);
        let info = b"INFO {\"server_id\":\"x\"}\r\n";
        every_prefix_incomplete(PeerProto::Nats, info, PeerEvent::Ignored);
        assert!(decode(PeerProto::Nats, b"-ERR 'Unknown Protocol'\r\n").is_err());
        assert!(decode(PeerProto::Nats, &[b'I'; PEER_LINE_MAX_BYTES + 1]).is_err());
    }

    #[test]
    fn publish_encodes_what_the_decoder_reads_back_as_a_message() {
        let mut out = Vec::new();
        encode_publish(PeerProto::Nats, "grp", b"hello", &mut out);
        assert_eq!(out, b"PUB grp 5\r\nhello\r\n");
        out.clear();
        encode_publish(PeerProto::Redis, "grp", b"hello", &mut out);
        assert_eq!(out, b"*3\r\n$7\r\nPUBLISH\r\n$3\r\ngrp\r\n$5\r\nhello\r\n");
    }
}
