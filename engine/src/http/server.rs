//! The HTTP server: hyper 1 (HTTP/1.1) with an axum router, on a small dedicated
//! tokio runtime (`worker_threads`), behind tower-http's request timeout and panic
//! catcher.
//!
//! What keeps it alive on the open network:
//! - at most `connections_max` open connections: at the cap the oldest idle one
//!   (no request in progress) is closed for the new one; with none idle the new one
//!   gets a canned 503 and is reset at once;
//! - `header_read_timeout_ms` for a request head, which is also the idle keep-alive
//!   timeout; `request_timeout_ms` to produce an answer (408);
//!   a connection whose client accepts no byte of its answer for
//!   `answer_write_timeout_ms` is closed;
//! - accept errors (EMFILE, ENFILE, ENOBUFS, ENOMEM, …) are counted and back off
//!   ([`AcceptBackoff`]); the loop never ends on them;
//! - the bearer token is checked before the body is read;
//! - a request that may wait (on a shard, another node or the metadata store) takes
//!   a place in the waiting queue (`waiting_requests_max`, over it 503 at once) and
//!   is awaited on the runtime, holding no thread: shard replies come on tokio
//!   channels, forwards on the links ([`super::forward`]); only metadata
//!   store calls (journal and fsync) run on the blocking pool (`blocking_threads`),
//!   waiting for a place up to `queue_timeout_ms` (then 503); `/healthz`,
//!   `/readyz`, `/metrics`, `/cluster/slots`, `/route` and `/route/batch` answer
//!   from memory, outside the queue;
//! - requests passed on by other nodes do not come here: they travel on the
//!   inter-node links (the hop `Api`, [`super::Api::serve_peer_calls`]);
//! - a panicking handler answers 500 and is counted.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};
use tower::ServiceExt as _;

use super::{Api, ApiMetrics, Reply};

/// The accept loop's pause after an error: starts small, doubles up to a ceiling,
/// and the first success resets it. Sans-IO: the caller sleeps.
#[derive(Debug, Clone)]
pub struct AcceptBackoff {
    next: Duration,
}

impl AcceptBackoff {
    /// The first pause.
    pub const FIRST: Duration = Duration::from_millis(5);
    /// The longest pause.
    pub const MAX: Duration = Duration::from_secs(1);

    pub fn new() -> AcceptBackoff {
        AcceptBackoff { next: Self::FIRST }
    }

    /// An accept failed: how long to pause before the next one.
    pub fn on_error(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        d
    }

    /// An accept succeeded.
    pub fn on_success(&mut self) {
        self.next = Self::FIRST;
    }
}

impl Default for AcceptBackoff {
    fn default() -> Self {
        Self::new()
    }
}

/// Set in [`ConnState::busy`] when the connection was chosen to be closed.
const EVICTED: u32 = 1 << 31;

/// One open connection, as the admission logic sees it.
struct ConnState {
    /// Requests in progress (their answer not yet fully written), plus [`EVICTED`].
    busy: AtomicU32,
    /// Milliseconds since the server started of the last accept or answer.
    last_active_ms: AtomicU64,
    /// 1 + the milliseconds since the server started when a write to the client
    /// last found its socket full; 0 when the last write went through.
    write_blocked_ms: AtomicU64,
    /// Wakes the connection's task to close it.
    close: Notify,
}

/// The open connections; at most `connections_max`.
struct Conns {
    max: usize,
    next_id: AtomicU64,
    open: Mutex<HashMap<u64, Arc<ConnState>>>,
    started: Instant,
}

impl Conns {
    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Admits a new connection, closing the oldest idle one at the cap. `None`: at
    /// the cap with every connection busy.
    fn admit(&self, metrics: &ApiMetrics) -> Option<(u64, Arc<ConnState>)> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if open.len() >= self.max {
            let mut idle: Vec<(u64, u64)> = open
                .iter()
                .filter(|(_, c)| {
                    // Neither a request in progress nor an answer waiting to be sent.
                    c.busy.load(Ordering::Acquire) == 0
                        && c.write_blocked_ms.load(Ordering::Relaxed) == 0
                })
                .map(|(&id, c)| (c.last_active_ms.load(Ordering::Relaxed), id))
                .collect();
            idle.sort_unstable();
            // A request may start between the scan and the claim: then try the next.
            let victim = idle.into_iter().find(|&(_, id)| {
                open[&id]
                    .busy
                    .compare_exchange(0, EVICTED, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            });
            let (_, id) = victim?;
            let c = open.remove(&id).expect("found above");
            c.close.notify_one();
            ApiMetrics::inc(&metrics.connections_evicted);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(ConnState {
            busy: AtomicU32::new(0),
            last_active_ms: AtomicU64::new(self.now_ms()),
            write_blocked_ms: AtomicU64::new(0),
            close: Notify::new(),
        });
        open.insert(id, state.clone());
        Some((id, state))
    }

    fn remove(&self, id: u64) {
        self.open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
    }
}

/// What every request handler shares.
struct App {
    api: Api,
}

impl App {
    fn metrics(&self) -> &ApiMetrics {
        &self.api.shared.api_metrics
    }
}

fn to_response(reply: Reply) -> Response {
    let mut r = Response::new(Body::from(reply.body));
    *r.status_mut() = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::OK);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(reply.content_type),
    );
    r
}

/// Every route: the open ones first, then the token (before any body byte is
/// read), the body limit, and a place in the waiting queue for what may wait.
async fn route(State(app): State<Arc<App>>, request: Request) -> Response {
    let method = request.method().as_str().to_owned();
    let path = request.uri().path().to_owned();
    if let Some(reply) = app.api.handle_open(&method, &path) {
        return to_response(reply);
    }
    let headers = request.headers();
    let auth = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if let Err(reply) = app.api.authorize(&method, &path, auth.as_deref()) {
        return to_response(reply);
    }
    let target = request
        .uri()
        .path_and_query()
        .map_or_else(|| path.clone(), |p| p.as_str().to_owned());
    let body = match read_body(request, app.api.config.body_bytes_max).await {
        Ok(b) => b,
        Err(reply) => return to_response(reply),
    };
    let owned = OwnedRequest {
        method,
        target,
        auth,
        body,
    };
    to_response(app.api.serve_admitted(&owned.as_request()).await)
}

/// A request's parts, owned.
struct OwnedRequest {
    method: String,
    target: String,
    auth: Option<String>,
    body: Bytes,
}

impl OwnedRequest {
    fn as_request(&self) -> super::ApiRequest<'_> {
        super::ApiRequest {
            method: &self.method,
            target: &self.target,
            authorization: self.auth.as_deref(),
            forwarded_by: None,
            body: &self.body,
        }
    }
}

/// The body, within `limit` (413 over it, by its Content-Length or as read).
async fn read_body(request: Request, limit: usize) -> Result<Bytes, Reply> {
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(Reply::error(413, "request body too large"));
    }
    axum::body::to_bytes(request.into_body(), limit)
        .await
        .map_err(|e| {
            let too_large = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            if too_large {
                Reply::error(413, "request body too large")
            } else {
                Reply::error(400, format!("could not read the body: {e}"))
            }
        })
}

/// Answers a panic in the async part of a handler with 500 and counts it.
#[derive(Clone)]
struct PanicTo500(Arc<App>);

impl tower_http::catch_panic::ResponseForPanic for PanicTo500 {
    type ResponseBody = Body;

    fn response_for_panic(
        &mut self,
        _err: Box<dyn std::any::Any + Send + 'static>,
    ) -> Response<Body> {
        ApiMetrics::inc(&self.0.metrics().panics);
        tracing::error!("an HTTP API handler panicked");
        to_response(Reply::error(500, "internal error"))
    }
}

/// A response body that marks its connection idle once written (or dropped).
struct Tracked {
    inner: Body,
    _guard: BusyGuard,
}

struct BusyGuard {
    conn: Arc<ConnState>,
    conns: Arc<Conns>,
    app: Arc<App>,
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.app
            .metrics()
            .requests_in_progress
            .fetch_sub(1, Ordering::Relaxed);
        self.conn
            .last_active_ms
            .store(self.conns.now_ms(), Ordering::Relaxed);
        self.conn.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A connection's socket that records when writes find it full (the write
/// watchdog of [`serve_connection`]).
struct Watched {
    inner: tokio::net::TcpStream,
    state: Arc<ConnState>,
    conns: Arc<Conns>,
}

impl Watched {
    fn record<T>(&self, r: &Poll<std::io::Result<T>>) {
        let blocked = &self.state.write_blocked_ms;
        match r {
            Poll::Pending => {
                if blocked.load(Ordering::Relaxed) == 0 {
                    blocked.store(self.conns.now_ms() + 1, Ordering::Relaxed);
                }
            }
            Poll::Ready(_) => blocked.store(0, Ordering::Relaxed),
        }
    }
}

impl tokio::io::AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.record(&r);
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.record(&r);
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The running HTTP API.
pub struct HttpServer {
    addr: SocketAddr,
    runtime: Option<tokio::runtime::Runtime>,
    shutdown: watch::Sender<bool>,
    stop_timeout: Duration,
}

impl HttpServer {
    /// Binds `addr` and starts serving on a runtime of `worker_threads` threads.
    pub fn start(api: Api, addr: SocketAddr) -> std::io::Result<HttpServer> {
        let config = api.config.clone();
        config.validate().map_err(std::io::Error::other)?;
        let std_listener = std::net::TcpListener::bind(addr)?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        if !addr.ip().is_loopback() && config.bearer_token.is_none() {
            tracing::warn!(%addr, "the HTTP API is bound to a non-loopback address without a bearer token ([auth] api_bearer_token): anyone who reaches it can send messages and set tokens");
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.worker_threads)
            .max_blocking_threads(config.blocking_threads)
            .thread_name("imrouter-http")
            .enable_all()
            .build()?;
        let listener = {
            let _guard = runtime.enter();
            TcpListener::from_std(std_listener)?
        };
        let app = Arc::new(App { api });
        let router = Router::new()
            .fallback(route)
            .with_state(app.clone())
            .layer(tower_http::timeout::TimeoutLayer::with_status_code(
                StatusCode::REQUEST_TIMEOUT,
                Duration::from_millis(config.request_timeout_ms),
            ))
            .layer(tower_http::catch_panic::CatchPanicLayer::custom(
                PanicTo500(app.clone()),
            ));
        let conns = Arc::new(Conns {
            max: config.connections_max,
            next_id: AtomicU64::new(0),
            open: Mutex::new(HashMap::new()),
            started: Instant::now(),
        });
        let (shutdown, stop) = watch::channel(false);
        let timeouts = (
            Duration::from_millis(config.header_read_timeout_ms),
            Duration::from_millis(config.answer_write_timeout_ms),
        );
        runtime.spawn(accept_loop(listener, router, app, conns, timeouts, stop));
        tracing::info!(%addr, "HTTP API up");
        Ok(HttpServer {
            addr,
            runtime: Some(runtime),
            shutdown,
            stop_timeout: Duration::from_millis(config.shard_reply_timeout_ms)
                + Duration::from_secs(1),
        })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The runtime the API runs on (the webhooks' driver runs there too).
    pub fn runtime_handle(&self) -> tokio::runtime::Handle {
        match &self.runtime {
            Some(rt) => rt.handle().clone(),
            None => unreachable!("the runtime is taken only by the stop"),
        }
    }

    /// Stops accepting, closes the connections, and waits (bounded by the shard
    /// reply timeout) for requests waiting on a shard.
    pub fn stop(mut self) {
        self.shut_down();
    }

    fn shut_down(&mut self) {
        let _ = self.shutdown.send(true);
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(self.stop_timeout);
        }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// Whether an accept error concerns only the connection being accepted (the next
/// accept may succeed at once) rather than the process (descriptors, memory).
fn is_connection_error(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::Interrupted
            | std::io::ErrorKind::WouldBlock
    )
}

/// The canned answer to a connection over the cap.
const REFUSED: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: 60\r\nconnection: close\r\n\r\n{\"status\":503,\"msg\":\"too many API connections; retry later\"}";

async fn accept_loop(
    listener: TcpListener,
    router: Router,
    app: Arc<App>,
    conns: Arc<Conns>,
    timeouts: (Duration, Duration),
    mut stop: watch::Receiver<bool>,
) {
    let mut backoff = AcceptBackoff::new();
    let mut last_warn: Option<Instant> = None;
    loop {
        let accepted = tokio::select! {
            _ = stop.changed() => return,
            r = listener.accept() => r,
        };
        let stream = match accepted {
            Ok((stream, _)) => {
                backoff.on_success();
                stream
            }
            Err(e) if is_connection_error(&e) => {
                // That connection's own failure: the next accept may succeed at once.
                ApiMetrics::inc(&app.metrics().accept_errors);
                continue;
            }
            Err(e) => {
                ApiMetrics::inc(&app.metrics().accept_errors);
                let pause = backoff.on_error();
                if last_warn.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                    last_warn = Some(Instant::now());
                    tracing::warn!(%e, ?pause, "HTTP API accept failed; pausing");
                }
                tokio::select! {
                    _ = stop.changed() => return,
                    _ = tokio::time::sleep(pause) => {}
                }
                continue;
            }
        };
        let Some((id, state)) = conns.admit(app.metrics()) else {
            ApiMetrics::inc(&app.metrics().connections_refused);
            // Best effort and never waits: the client learns at once, from the 503
            // or, when the reset overtakes it, from the reset (SO_LINGER 0).
            let _ = stream.try_write(REFUSED);
            let _ = stream.set_zero_linger();
            continue;
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(serve_connection(
            stream,
            router.clone(),
            app.clone(),
            conns.clone(),
            id,
            state,
            timeouts,
            stop.clone(),
        ));
    }
}

#[allow(clippy::too_many_arguments)]
async fn serve_connection(
    stream: tokio::net::TcpStream,
    router: Router,
    app: Arc<App>,
    conns: Arc<Conns>,
    id: u64,
    state: Arc<ConnState>,
    timeouts: (Duration, Duration),
    mut stop: watch::Receiver<bool>,
) {
    let (header_timeout, write_timeout) = timeouts;
    ApiMetrics::inc(&app.metrics().connections);
    let service = {
        let (state, conns, app) = (state.clone(), conns.clone(), app.clone());
        hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            let (state, conns, app, router) =
                (state.clone(), conns.clone(), app.clone(), router.clone());
            async move {
                let guard = BusyGuard {
                    conn: state.clone(),
                    conns,
                    app: app.clone(),
                };
                ApiMetrics::inc(&app.metrics().requests_in_progress);
                let prev = state.busy.fetch_add(1, Ordering::AcqRel);
                let response = if prev & EVICTED != 0 {
                    // Chosen for closing before this request started: not served.
                    to_response(Reply::error(503, "connection closing; retry"))
                } else {
                    router
                        .oneshot(request.map(Body::new))
                        .await
                        .unwrap_or_else(|e| match e {})
                };
                app.metrics().count_status(response.status().as_u16());
                Ok::<_, std::convert::Infallible>(response.map(|inner| Tracked {
                    inner,
                    _guard: guard,
                }))
            }
        })
    };
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .keep_alive(true)
        .serve_connection(
            TokioIo::new(Watched {
                inner: stream,
                state: state.clone(),
                conns: conns.clone(),
            }),
            service,
        );
    tokio::pin!(conn);
    // A client that does not read its answer would hold the connection (and its
    // place under connections_max) forever: close it once no byte could be written
    // to it for answer_write_timeout_ms.
    let mut watchdog = tokio::time::interval(write_timeout);
    watchdog.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let write_timeout_ms = write_timeout.as_millis() as u64;
    loop {
        tokio::select! {
            _ = conn.as_mut() => break,
            // Evicted for a new connection (the map entry is gone already).
            _ = state.close.notified() => break,
            _ = stop.changed() => break,
            _ = watchdog.tick() => {
                let blocked = state.write_blocked_ms.load(Ordering::Relaxed);
                if blocked != 0 && conns.now_ms() + 1 - blocked >= write_timeout_ms {
                    ApiMetrics::inc(&app.metrics().write_timeouts);
                    break;
                }
            }
        }
    }
    conns.remove(id);
    app.metrics().connections.fetch_sub(1, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_backoff_doubles_to_a_second_and_resets_on_success() {
        let mut b = AcceptBackoff::new();
        let steps: Vec<u64> = (0..10).map(|_| b.on_error().as_millis() as u64).collect();
        assert_eq!(steps, [5, 10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
        b.on_success();
        assert_eq!(b.on_error(), AcceptBackoff::FIRST);
    }
}
