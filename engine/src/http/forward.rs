//! The API's own HTTP/1.1 client: one blocking request to another node's HTTP API,
//! the transport of the API requests homed elsewhere (see the module doc of
//! [`super`]).
//!
//! Contract: [`send`] opens one TCP connection, writes one request (`Connection:
//! close`, the body with its `Content-Length`, the caller's bearer token, and the
//! [`FORWARDED_HEADER`] naming this node), and reads one answer: its status and
//! body (by `Content-Length`, chunked, or up to the close). Everything, the connect
//! included, happens within `timeout` (a deadline for the whole exchange, not per
//! read); an answer body over `answer_bytes_max` or a head over
//! [`ANSWER_HEAD_BYTES_MAX`] is refused. It blocks the calling thread: the API calls
//! it only from its blocking pool (or in process, from the caller's thread).
//!
//! Why not a client crate: the peers are imrouter nodes on a trusted network, plain
//! HTTP/1.1, one request per connection; the blocking pool's threads need a blocking
//! call with a whole-exchange deadline. `httparse` (already hyper's parser) reads
//! the answer head and chunk sizes; the rest is the ~150 lines below, with no second
//! async runtime (hyper's client) and no TLS stack (ureq's defaults) brought in.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::cluster::NodeId;

/// The header a forwarded request carries: the id of the node that forwarded it.
/// A node answers such a request from its own data only, never forwarding again.
pub const FORWARDED_HEADER: &str = "x-imrouter-forwarded";

/// Largest answer head (status line and headers) read from another node.
pub const ANSWER_HEAD_BYTES_MAX: usize = 16 << 10;

/// Most headers of an answer head.
const ANSWER_HEADERS_MAX: usize = 32;

/// One request to another node's API.
#[derive(Debug, Clone, Copy)]
pub struct Outgoing<'a> {
    pub method: &'a str,
    /// The path and query, as the client sent them.
    pub target: &'a str,
    /// The `Authorization` header to pass on, if any.
    pub authorization: Option<&'a str>,
    pub body: &'a [u8],
    /// This node: the value of [`FORWARDED_HEADER`].
    pub from: NodeId,
}

/// The other node's answer.
#[derive(Debug, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub body: Vec<u8>,
}

/// Why no answer came.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("no answer within {0} ms")]
    Timeout(u64),
    #[error("answer larger than {0} bytes")]
    TooLarge(usize),
    #[error("not an HTTP answer: {0}")]
    Malformed(String),
    #[error("the request cannot be passed on: {0}")]
    BadRequest(&'static str),
}

/// Sends `request` to the API at `addr` and reads its answer, all within `timeout`.
pub fn send(
    addr: SocketAddr,
    request: &Outgoing<'_>,
    timeout: Duration,
    answer_bytes_max: usize,
) -> Result<Answer, ForwardError> {
    let head = request_head(addr, request)?;
    let deadline = Instant::now() + timeout;
    let timeout_ms = timeout.as_millis() as u64;
    let stream = TcpStream::connect_timeout(&addr, timeout).map_err(|e| timed(e, timeout_ms))?;
    let _ = stream.set_nodelay(true);
    let mut conn = Conn {
        stream,
        buf: Vec::new(),
        deadline,
        timeout_ms,
        limit: ANSWER_HEAD_BYTES_MAX + answer_bytes_max,
    };
    conn.write_all(head.as_bytes())?;
    conn.write_all(request.body)?;
    let (status, body) = conn.read_head()?;
    let body = match body {
        BodyKind::Length(n) if n > answer_bytes_max => return Err(ForwardError::TooLarge(n)),
        BodyKind::Length(n) => conn.read_exact_body(n)?,
        BodyKind::Chunked => conn.read_chunked(answer_bytes_max)?,
        BodyKind::ToClose => conn.read_to_close(answer_bytes_max)?,
    };
    Ok(Answer { status, body })
}

/// The request line and headers. Refuses a method, target or token that would
/// break the head (whitespace or control characters).
fn request_head(addr: SocketAddr, r: &Outgoing<'_>) -> Result<String, ForwardError> {
    let clean = |s: &str, spaces: bool| {
        !s.is_empty()
            && !s
                .bytes()
                .any(|b| b.is_ascii_control() || (!spaces && b == b' '))
    };
    if !clean(r.method, false) || !clean(r.target, false) || !r.target.starts_with('/') {
        return Err(ForwardError::BadRequest("bad method or path"));
    }
    let mut head = format!(
        "{} {} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n{FORWARDED_HEADER}: {}\r\n",
        r.method,
        r.target,
        r.body.len(),
        r.from
    );
    if let Some(auth) = r.authorization {
        if !clean(auth, true) {
            return Err(ForwardError::BadRequest("bad Authorization header"));
        }
        head.push_str("Authorization: ");
        head.push_str(auth);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    Ok(head)
}

/// A timeout as [`ForwardError::Timeout`], any other error as it is.
fn timed(e: io::Error, timeout_ms: u64) -> ForwardError {
    match e.kind() {
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => ForwardError::Timeout(timeout_ms),
        _ => ForwardError::Io(e),
    }
}

/// How the answer's body ends.
enum BodyKind {
    Length(usize),
    Chunked,
    ToClose,
}

/// The connection, the bytes read and not yet used, and the deadline.
struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
    deadline: Instant,
    timeout_ms: u64,
    /// Most bytes held in `buf`.
    limit: usize,
}

impl Conn {
    /// Time left before the deadline, or the timeout error.
    fn left(&self) -> Result<Duration, ForwardError> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ForwardError::Timeout(self.timeout_ms));
        }
        Ok(left)
    }

    fn write_all(&mut self, bytes: &[u8]) -> Result<(), ForwardError> {
        let mut rest = bytes;
        while !rest.is_empty() {
            self.stream.set_write_timeout(Some(self.left()?))?;
            match self.stream.write(rest) {
                Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero).into()),
                Ok(n) => rest = &rest[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(timed(e, self.timeout_ms)),
            }
        }
        Ok(())
    }

    /// Reads more into `buf`; false at the end of the stream.
    fn fill(&mut self) -> Result<bool, ForwardError> {
        if self.buf.len() >= self.limit {
            return Err(ForwardError::TooLarge(self.limit));
        }
        self.stream.set_read_timeout(Some(self.left()?))?;
        let mut chunk = [0u8; 16 << 10];
        let room = chunk.len().min(self.limit - self.buf.len());
        loop {
            match self.stream.read(&mut chunk[..room]) {
                Ok(0) => return Ok(false),
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    return Ok(true);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(timed(e, self.timeout_ms)),
            }
        }
    }

    /// Reads until `buf` holds `n` bytes; refuses an early end.
    fn fill_to(&mut self, n: usize) -> Result<(), ForwardError> {
        while self.buf.len() < n {
            if !self.fill()? {
                return Err(ForwardError::Malformed("the answer ended early".into()));
            }
        }
        Ok(())
    }

    /// Reads and parses the answer head (skipping `1xx` answers); leaves the body's
    /// first bytes in `buf`.
    fn read_head(&mut self) -> Result<(u16, BodyKind), ForwardError> {
        loop {
            let mut headers = [httparse::EMPTY_HEADER; ANSWER_HEADERS_MAX];
            let mut answer = httparse::Response::new(&mut headers);
            match answer.parse(&self.buf) {
                Ok(httparse::Status::Complete(len)) => {
                    let status = answer.code.unwrap_or(0);
                    let kind = body_kind(answer.headers)?;
                    self.buf.drain(..len);
                    if (100..200).contains(&status) {
                        continue;
                    }
                    return Ok((status, kind));
                }
                Ok(httparse::Status::Partial) => {
                    if self.buf.len() > ANSWER_HEAD_BYTES_MAX {
                        return Err(ForwardError::TooLarge(ANSWER_HEAD_BYTES_MAX));
                    }
                    if !self.fill()? {
                        return Err(ForwardError::Malformed("closed before an answer".into()));
                    }
                }
                Err(e) => return Err(ForwardError::Malformed(e.to_string())),
            }
        }
    }

    fn read_exact_body(&mut self, n: usize) -> Result<Vec<u8>, ForwardError> {
        self.fill_to(n)?;
        self.buf.truncate(n);
        Ok(std::mem::take(&mut self.buf))
    }

    fn read_to_close(&mut self, max: usize) -> Result<Vec<u8>, ForwardError> {
        while self.fill()? {}
        if self.buf.len() > max {
            return Err(ForwardError::TooLarge(max));
        }
        Ok(std::mem::take(&mut self.buf))
    }

    /// Decodes a chunked body (trailers ignored) of at most `max` bytes.
    fn read_chunked(&mut self, max: usize) -> Result<Vec<u8>, ForwardError> {
        let mut body = Vec::new();
        let mut pos = 0;
        loop {
            let (consumed, size) = loop {
                match httparse::parse_chunk_size(&self.buf[pos..]) {
                    Ok(httparse::Status::Complete(c)) => break c,
                    Ok(httparse::Status::Partial) => self.fill_to(self.buf.len() + 1)?,
                    Err(_) => return Err(ForwardError::Malformed("bad chunk size".into())),
                }
            };
            pos += consumed;
            if size == 0 {
                return Ok(body);
            }
            let size = usize::try_from(size).map_err(|_| ForwardError::TooLarge(max))?;
            if body.len() + size > max {
                return Err(ForwardError::TooLarge(max));
            }
            self.fill_to(pos + size + 2)?;
            body.extend_from_slice(&self.buf[pos..pos + size]);
            pos += size + 2;
        }
    }
}

/// How the body of an answer with `headers` ends.
fn body_kind(headers: &[httparse::Header<'_>]) -> Result<BodyKind, ForwardError> {
    for h in headers {
        if h.name.eq_ignore_ascii_case("transfer-encoding") {
            let chunked = std::str::from_utf8(h.value)
                .is_ok_and(|v| v.trim().to_ascii_lowercase().ends_with("chunked"));
            if chunked {
                return Ok(BodyKind::Chunked);
            }
        }
    }
    for h in headers {
        if h.name.eq_ignore_ascii_case("content-length") {
            return std::str::from_utf8(h.value)
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .map(BodyKind::Length)
                .ok_or_else(|| ForwardError::Malformed("bad Content-Length".into()));
        }
    }
    Ok(BodyKind::ToClose)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A one-shot server on loopback: reads the request head and body, writes
    /// `answer`, and gives back what it read.
    fn serve_once(answer: &'static [u8]) -> (SocketAddr, std::thread::JoinHandle<String>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let h = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut got = Vec::new();
            let mut chunk = [0u8; 1024];
            // Head, then the 2-byte body every test sends.
            while !got.windows(4).any(|w| w == b"\r\n\r\n") || !got.ends_with(b"{}") {
                let n = s.read(&mut chunk).unwrap();
                got.extend_from_slice(&chunk[..n]);
            }
            s.write_all(answer).unwrap();
            String::from_utf8(got).unwrap()
        });
        (addr, h)
    }

    fn request() -> Outgoing<'static> {
        Outgoing {
            method: "POST",
            target: "/user/token?x=1",
            authorization: Some("Bearer sekret"),
            body: b"{}",
            from: 2,
        }
    }

    const SECOND: Duration = Duration::from_secs(10);

    #[test]
    fn passes_method_path_token_and_marker_and_reads_a_sized_answer() {
        let (addr, h) = serve_once(b"HTTP/1.1 201 Created\r\nContent-Length: 5\r\n\r\nhello-extra");
        let a = send(addr, &request(), SECOND, 1024).unwrap();
        assert_eq!((a.status, a.body.as_slice()), (201, &b"hello"[..]));
        let got = h.join().unwrap();
        assert!(
            got.starts_with("POST /user/token?x=1 HTTP/1.1\r\n"),
            "{got}"
        );
        assert!(got.contains("Authorization: Bearer sekret\r\n"), "{got}");
        assert!(got.contains("x-imrouter-forwarded: 2\r\n"), "{got}");
        assert!(got.contains("Content-Length: 2\r\n"), "{got}");
    }

    #[test]
    fn reads_chunked_and_close_delimited_answers() {
        let (addr, _h) = serve_once(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        );
        assert_eq!(send(addr, &request(), SECOND, 1024).unwrap().body, b"abcde");
        let (addr, _h) = serve_once(b"HTTP/1.1 503 Nope\r\n\r\nuntil close");
        let a = send(addr, &request(), SECOND, 1024).unwrap();
        assert_eq!((a.status, a.body.as_slice()), (503, &b"until close"[..]));
    }

    #[test]
    fn refuses_answers_over_the_limit() {
        let (addr, _h) = serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n");
        assert!(matches!(
            send(addr, &request(), SECOND, 10),
            Err(ForwardError::TooLarge(100))
        ));
        let (addr, _h) = serve_once(b"HTTP/1.1 200 OK\r\n\r\n0123456789abcdef");
        assert!(matches!(
            send(addr, &request(), SECOND, 10),
            Err(ForwardError::TooLarge(_))
        ));
    }

    #[test]
    fn a_silent_server_is_a_timeout_and_a_closed_port_an_io_error() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        // Accepted by the kernel (backlog), never answered.
        let r = send(addr, &request(), Duration::from_millis(50), 1024);
        assert!(matches!(r, Err(ForwardError::Timeout(50))), "{r:?}");
        drop(l);
        let r = send(addr, &request(), SECOND, 1024);
        assert!(matches!(r, Err(ForwardError::Io(_))), "{r:?}");
    }

    #[test]
    fn a_head_breaking_token_or_path_is_refused_before_connecting() {
        let mut r = request();
        r.authorization = Some("Bearer a\r\nX-Evil: 1");
        let addr = SocketAddr::from(([127, 0, 0, 1], 9));
        assert!(matches!(
            send(addr, &r, SECOND, 1),
            Err(ForwardError::BadRequest(_))
        ));
        let mut r = request();
        r.target = "/a b";
        assert!(matches!(
            send(addr, &r, SECOND, 1),
            Err(ForwardError::BadRequest(_))
        ));
    }
}
