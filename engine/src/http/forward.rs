//! The API's client to other nodes' APIs, the transport of the API requests homed
//! elsewhere (see the module doc of [`super`]), and each peer's places and breaker.
//!
//! Contract of [`ForwardClient::send`]: one request (the body with its
//! `Content-Length`, the caller's bearer token, the [`FORWARDED_HEADER`] naming this
//! node) on a pooled keep-alive connection of the tree's one client
//! ([`super::client::HttpClient`]), its answer's status and body; the whole
//! exchange, the connect included, within `timeout`; an answer body over
//! `answer_bytes_max` is refused. It is awaited on the API's runtime: no thread
//! is held while the other node thinks.
//!
//! Contract of [`Peers::forward`]: at most `forward_connections_per_peer` requests
//! in flight to one peer (more wait for a place, up to `queue_timeout_ms`, then
//! [`PeerError::Busy`]); after `forward_breaker_failures` forwards in a row that got
//! no answer (unreachable, timed out), the peer's [`Breaker`] opens: forwards to it
//! fail at once ([`PeerError::Open`]) for `forward_breaker_cooldown_ms`, then one
//! is let through; its answer closes the breaker, its failure opens it again.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE, HOST};
use hyper::{Method, Uri};
use tokio::sync::Semaphore;

use super::client::{ClientLimits, ExchangeError, HttpClient};

use crate::cluster::NodeId;

/// The header a forwarded request carries: the id of the node that forwarded it.
/// A node answers such a request from its own data only, never forwarding again.
pub const FORWARDED_HEADER: &str = "x-imrouter-forwarded";

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

pub use super::client::Answer;

/// Why no answer came.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// No connection, or it closed before an answer.
    #[error("{0}")]
    Unreachable(String),
    #[error("no answer within {0} ms")]
    Timeout(u64),
    #[error("answer larger than {0} bytes")]
    TooLarge(usize),
    #[error("not an HTTP answer: {0}")]
    Malformed(String),
    #[error("the request cannot be passed on: {0}")]
    BadRequest(&'static str),
}

impl ForwardError {
    /// Whether the peer gave no answer at all (what the breaker counts).
    pub fn is_no_answer(&self) -> bool {
        matches!(
            self,
            ForwardError::Unreachable(_) | ForwardError::Timeout(_)
        )
    }
}

/// The pooled client the forwards share.
#[derive(Clone)]
pub struct ForwardClient {
    client: HttpClient,
    answer_bytes_max: usize,
}

impl ForwardClient {
    /// Connects within `connect_timeout`; keeps up to `idle_per_host_max` idle
    /// connections per node for `idle`; reads answers up to `answer_bytes_max`.
    pub fn new(
        connect_timeout: Duration,
        idle: Duration,
        idle_per_host_max: usize,
        answer_bytes_max: usize,
    ) -> ForwardClient {
        let limits = ClientLimits {
            connect_timeout,
            idle,
            idle_per_host_max,
        };
        ForwardClient {
            client: HttpClient::plain(limits),
            answer_bytes_max,
        }
    }

    /// Sends `request` to the API at `addr` and reads its answer, all within
    /// `timeout`. Must be awaited on a tokio runtime with IO and time enabled.
    pub async fn send(
        &self,
        addr: SocketAddr,
        request: &Outgoing<'_>,
        timeout: Duration,
    ) -> Result<Answer, ForwardError> {
        let req = build_request(addr, request)?;
        Ok(self
            .client
            .exchange(req, self.answer_bytes_max, timeout)
            .await?)
    }
}

impl From<ExchangeError> for ForwardError {
    fn from(e: ExchangeError) -> ForwardError {
        match e {
            ExchangeError::Unreachable(text) => ForwardError::Unreachable(text),
            ExchangeError::Timeout(ms) => ForwardError::Timeout(ms),
            ExchangeError::TooLarge { bytes, .. } => ForwardError::TooLarge(bytes),
            ExchangeError::Malformed(text) => ForwardError::Malformed(text),
        }
    }
}

/// The request to `addr`. Refuses a method, target or token that is not valid in
/// an HTTP head.
fn build_request(
    addr: SocketAddr,
    r: &Outgoing<'_>,
) -> Result<hyper::Request<Full<Bytes>>, ForwardError> {
    let bad_path = ForwardError::BadRequest("bad method or path");
    if !r.target.starts_with('/') {
        return Err(bad_path);
    }
    let method = Method::from_bytes(r.method.as_bytes()).map_err(|_| bad_path)?;
    let uri: Uri = format!("http://{addr}{}", r.target)
        .parse()
        .map_err(|_| ForwardError::BadRequest("bad method or path"))?;
    let mut b = hyper::Request::builder()
        .method(method)
        .uri(uri)
        .header(HOST, addr.to_string())
        .header(CONTENT_TYPE, "application/json")
        .header(FORWARDED_HEADER, r.from);
    if let Some(auth) = r.authorization {
        let v = HeaderValue::from_str(auth)
            .map_err(|_| ForwardError::BadRequest("bad Authorization header"))?;
        b = b.header(AUTHORIZATION, v);
    }
    b.body(Full::new(Bytes::copy_from_slice(r.body)))
        .map_err(|_| ForwardError::BadRequest("bad method or path"))
}

/// What a [`Breaker`] lets a forward do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// The breaker is closed.
    Go,
    /// The cool-down passed: this one forward tries the peer.
    Probe,
    /// Open: refused at once. `failures` in a row so far; the next try in
    /// `retry_in`.
    Refuse { failures: u32, retry_in: Duration },
}

/// One peer's circuit breaker (sans-IO: the caller gives the time).
#[derive(Debug, Default)]
pub struct Breaker {
    /// Forwards in a row that got no answer.
    failures: u32,
    /// Open until then (`None`: closed).
    open_until: Option<Instant>,
    /// A probe is in flight.
    probing: bool,
}

impl Breaker {
    /// Whether a forward may go to the peer now.
    pub fn admit(&mut self, now: Instant) -> Admit {
        match self.open_until {
            None => Admit::Go,
            Some(until) if now < until || self.probing => Admit::Refuse {
                failures: self.failures,
                retry_in: until.saturating_duration_since(now),
            },
            Some(_) => {
                self.probing = true;
                Admit::Probe
            }
        }
    }

    /// While open and cooling down (before a probe may go): the failures in a row
    /// and the time left. Changes nothing.
    pub fn cooling(&self, now: Instant) -> Option<(u32, Duration)> {
        self.open_until
            .filter(|&until| now < until)
            .map(|until| (self.failures, until - now))
    }

    /// The outcome of a forward [`Breaker::admit`] let go (`probe`: it was the
    /// probe): `answered` closes the breaker; a failure opens it at the
    /// `threshold`-th in a row, or again after a probe, for `cooldown`.
    pub fn record(
        &mut self,
        answered: bool,
        probe: bool,
        now: Instant,
        threshold: u32,
        cooldown: Duration,
    ) {
        if probe {
            self.probing = false;
        }
        if answered {
            *self = Breaker::default();
            return;
        }
        self.failures = self.failures.saturating_add(1);
        if probe || (self.open_until.is_none() && self.failures >= threshold) {
            self.open_until = Some(now + cooldown);
        }
    }

    /// A probe ended with no outcome (its request was dropped): the next forward
    /// may probe.
    pub fn abandon_probe(&mut self) {
        self.probing = false;
    }
}

/// The limits of [`Peers`] (from `ApiConfig`).
#[derive(Debug, Clone, Copy)]
pub struct PeerLimits {
    pub places: usize,
    pub place_wait: Duration,
    pub timeout: Duration,
    pub breaker_failures: u32,
    pub breaker_cooldown: Duration,
}

/// Why a forward to a peer got no answer.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("is not in [[cluster.nodes]]")]
    Unknown,
    #[error("is busy: {places} requests to it are in flight and no place freed within {wait_ms} ms; retry")]
    Busy { places: usize, wait_ms: u64 },
    #[error("is not asked: its last {failures} forwards in a row got no answer; next try in {retry_ms} ms")]
    Open { failures: u32, retry_ms: u64 },
    #[error("{0}")]
    Forward(#[from] ForwardError),
}

struct Peer {
    addr: SocketAddr,
    places: Arc<Semaphore>,
    breaker: Mutex<Breaker>,
}

/// The other nodes as the forwards see them: address, places, breaker.
pub struct Peers {
    client: ForwardClient,
    limits: PeerLimits,
    peers: HashMap<NodeId, Peer>,
}

/// Clears a probe that ends without an outcome (its future dropped).
struct ProbeGuard<'a> {
    breaker: Option<&'a Mutex<Breaker>>,
}

impl Drop for ProbeGuard<'_> {
    fn drop(&mut self) {
        if let Some(b) = self.breaker {
            b.lock().unwrap_or_else(|e| e.into_inner()).abandon_probe();
        }
    }
}

impl Peers {
    /// The peers at `nodes` (id, API address).
    pub fn new(
        client: ForwardClient,
        limits: PeerLimits,
        nodes: impl IntoIterator<Item = (NodeId, SocketAddr)>,
    ) -> Peers {
        let peers = nodes
            .into_iter()
            .map(|(id, addr)| {
                let peer = Peer {
                    addr,
                    places: Arc::new(Semaphore::new(limits.places)),
                    breaker: Mutex::new(Breaker::default()),
                };
                (id, peer)
            })
            .collect();
        Peers {
            client,
            limits,
            peers,
        }
    }

    /// The API address of `node`, if it is a known node.
    pub fn addr(&self, node: NodeId) -> Option<SocketAddr> {
        self.peers.get(&node).map(|p| p.addr)
    }

    /// Passes `request` to `node` (module docs: places, breaker, timeout).
    pub async fn forward(&self, node: NodeId, request: &Outgoing<'_>) -> Result<Answer, PeerError> {
        let peer = self.peers.get(&node).ok_or(PeerError::Unknown)?;
        let limits = self.limits;
        let open = |b: &mut Breaker| match b.admit(Instant::now()) {
            Admit::Refuse { failures, retry_in } => Err(PeerError::Open {
                failures,
                retry_ms: retry_in.as_millis() as u64,
            }),
            admit => Ok(admit),
        };
        let lock = || peer.breaker.lock().unwrap_or_else(|e| e.into_inner());
        // Refused before waiting for a place while the breaker cools down.
        if let Some((failures, retry_in)) = lock().cooling(Instant::now()) {
            return Err(PeerError::Open {
                failures,
                retry_ms: retry_in.as_millis() as u64,
            });
        }
        let _place = tokio::time::timeout(limits.place_wait, peer.places.acquire())
            .await
            .map_err(|_| PeerError::Busy {
                places: limits.places,
                wait_ms: limits.place_wait.as_millis() as u64,
            })?
            .map_err(|_| PeerError::Unknown)?;
        let probe = open(&mut lock())? == Admit::Probe;
        let mut guard = ProbeGuard {
            breaker: probe.then_some(&peer.breaker),
        };
        let result = self.client.send(peer.addr, request, limits.timeout).await;
        guard.breaker = None;
        let answered = match &result {
            Ok(_) => true,
            Err(e) => !e.is_no_answer(),
        };
        lock().record(
            answered,
            probe,
            Instant::now(),
            limits.breaker_failures,
            limits.breaker_cooldown,
        );
        Ok(result?)
    }
}

/// Awaits every future of `futures` at once (on this task); their outputs in the
/// same order.
pub async fn join_all<F: Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, out) in futures.iter_mut().zip(outputs.iter_mut()) {
            if out.is_none() {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => *out = Some(v),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    outputs
        .into_iter()
        .map(|o| o.expect("every future finished"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    /// A one-shot server on loopback: reads the request head and body, writes
    /// `answer`, closes, and gives back what it read.
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

    const LONG: Duration = Duration::from_secs(10);

    fn client(max: usize) -> ForwardClient {
        ForwardClient::new(LONG, LONG, 4, max)
    }

    #[tokio::test]
    async fn passes_method_path_token_and_marker_and_reads_a_sized_answer() {
        let (addr, h) = serve_once(b"HTTP/1.1 201 Created\r\nContent-Length: 5\r\n\r\nhello");
        let a = client(1024).send(addr, &request(), LONG).await.unwrap();
        assert_eq!((a.status, a.body.as_slice()), (201, &b"hello"[..]));
        let got = h.join().unwrap().to_ascii_lowercase();
        assert!(
            got.starts_with("post /user/token?x=1 http/1.1\r\n"),
            "{got}"
        );
        assert!(got.contains("authorization: bearer sekret\r\n"), "{got}");
        assert!(got.contains("x-imrouter-forwarded: 2\r\n"), "{got}");
        assert!(got.contains("content-length: 2\r\n"), "{got}");
    }

    #[tokio::test]
    async fn reads_chunked_and_close_delimited_answers() {
        let (addr, _h) = serve_once(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        );
        let a = client(1024).send(addr, &request(), LONG).await.unwrap();
        assert_eq!(a.body, b"abcde");
        let (addr, _h) = serve_once(b"HTTP/1.1 503 Nope\r\nConnection: close\r\n\r\nuntil close");
        let a = client(1024).send(addr, &request(), LONG).await.unwrap();
        assert_eq!((a.status, a.body.as_slice()), (503, &b"until close"[..]));
    }

    #[tokio::test]
    async fn refuses_answers_over_the_limit_and_answers_that_are_not_http() {
        let (addr, _h) = serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n");
        let r = client(10).send(addr, &request(), LONG).await;
        assert!(matches!(r, Err(ForwardError::TooLarge(100))), "{r:?}");
        let (addr, _h) =
            serve_once(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n0123456789abcdef");
        let r = client(10).send(addr, &request(), LONG).await;
        assert!(matches!(r, Err(ForwardError::TooLarge(10))), "{r:?}");
        let (addr, _h) = serve_once(b"SMTP ready\r\n\r\n");
        let r = client(10).send(addr, &request(), LONG).await;
        assert!(matches!(r, Err(ForwardError::Malformed(_))), "{r:?}");
    }

    #[tokio::test]
    async fn a_silent_server_is_a_timeout_and_a_closed_port_unreachable() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        // Accepted by the kernel (backlog), never answered.
        let r = client(1024)
            .send(addr, &request(), Duration::from_millis(50))
            .await;
        assert!(matches!(r, Err(ForwardError::Timeout(50))), "{r:?}");
        drop(l);
        let r = client(1024).send(addr, &request(), LONG).await;
        assert!(matches!(r, Err(ForwardError::Unreachable(_))), "{r:?}");
    }

    #[tokio::test]
    async fn a_head_breaking_token_or_path_is_refused_before_connecting() {
        let addr = SocketAddr::from(([127, 0, 0, 1], 9));
        let mut r = request();
        r.authorization = Some("Bearer a\r\nX-Evil: 1");
        let got = client(1).send(addr, &r, LONG).await;
        assert!(matches!(got, Err(ForwardError::BadRequest(_))), "{got:?}");
        for target in ["/a b", "x", "/a\r\nb"] {
            let mut r = request();
            r.target = target;
            let got = client(1).send(addr, &r, LONG).await;
            assert!(
                matches!(got, Err(ForwardError::BadRequest(_))),
                "{target:?}: {got:?}"
            );
        }
    }

    #[test]
    fn the_breaker_opens_at_the_threshold_cools_down_and_lets_one_probe() {
        let (t0, cool) = (Instant::now(), Duration::from_secs(5));
        let mut b = Breaker::default();
        for _ in 0..2 {
            assert_eq!(b.admit(t0), Admit::Go);
            b.record(false, false, t0, 3, cool);
        }
        // An answer (any status) resets the count.
        b.record(true, false, t0, 3, cool);
        for _ in 0..3 {
            assert_eq!(b.admit(t0), Admit::Go);
            b.record(false, false, t0, 3, cool);
        }
        let refused = Admit::Refuse {
            failures: 3,
            retry_in: cool,
        };
        assert_eq!(b.admit(t0), refused);
        assert_eq!(b.cooling(t0), Some((3, cool)));
        // A forward admitted before it opened fails: the cool-down is not pushed.
        b.record(false, false, t0 + cool / 2, 3, cool);
        let end = t0 + cool;
        assert_eq!(b.cooling(end), None);
        assert_eq!(b.admit(end), Admit::Probe);
        assert!(matches!(b.admit(end), Admit::Refuse { .. }), "one probe");
        // The probe fails: open again for a whole cool-down.
        b.record(false, true, end, 3, cool);
        assert_eq!(b.cooling(end), Some((5, cool)));
        let later = end + cool;
        assert_eq!(b.admit(later), Admit::Probe);
        // A probe dropped without an outcome lets the next forward probe.
        b.abandon_probe();
        assert_eq!(b.admit(later), Admit::Probe);
        b.record(true, true, later, 3, cool);
        assert_eq!(b.admit(later), Admit::Go);
        assert_eq!(b.cooling(later), None);
    }

    #[tokio::test]
    async fn join_all_gives_the_outputs_in_order() {
        let (tx, rx) = tokio::sync::oneshot::channel::<u32>();
        let first =
            Box::pin(async move { rx.await.unwrap() }) as Pin<Box<dyn Future<Output = u32> + Send>>;
        let second = Box::pin(async move {
            tx.send(7).unwrap();
            2u32
        }) as Pin<Box<dyn Future<Output = u32> + Send>>;
        assert_eq!(join_all(vec![first, second]).await, vec![7, 2]);
    }
}
