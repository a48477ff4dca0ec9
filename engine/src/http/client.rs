//! The one HTTP client of the tree: hyper-util's pooled client (HTTP/1.1,
//! keep-alive) over hyper-rustls (`http://` and `https://`), on the tokio runtime it
//! is awaited on. The API's forwards to other nodes (`http::forward`), the webhooks
//! (`webhook::client`) and imbench's set-up calls ([`BlockingClient`]) all go through
//! [`HttpClient::exchange`].
//!
//! Contract of [`HttpClient::exchange`]: one request on a pooled connection (connect
//! bounded by the client's `connect_timeout`, `TCP_NODELAY`), its answer's status and
//! body; the whole exchange, the connect and a TLS handshake included, within
//! `timeout`; a body over `answer_bytes_max` (declared, or read so far) is refused
//! with the answer's status, and the rest of it is not waited for.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::header::{HeaderValue, AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, HOST};
use hyper::{Method, Request, Uri};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// An answer: its status and whole body.
#[derive(Debug, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub body: Vec<u8>,
}

/// Why an exchange gave no (whole) answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExchangeError {
    /// No connection (refused, TLS refused, connect timed out), or it closed before
    /// an answer; the error and its sources.
    #[error("{0}")]
    Unreachable(String),
    /// Nothing (whole) within the exchange's timeout, in milliseconds.
    #[error("no answer within {0} ms")]
    Timeout(u64),
    /// The answer's body is over the limit: `bytes`, the length it declared, or
    /// the limit when it declared none; `status` is the answer's.
    #[error("answer of more than {bytes} bytes, over the limit")]
    TooLarge { bytes: usize, status: u16 },
    /// What came back is not an HTTP answer.
    #[error("not an HTTP answer: {0}")]
    Malformed(String),
}

/// How a client connects and keeps connections.
#[derive(Debug, Clone, Copy)]
pub struct ClientLimits {
    /// The most a connect may take (TCP; the TLS handshake counts against the
    /// exchange's timeout).
    pub connect_timeout: Duration,
    /// How long an idle pooled connection is kept.
    pub idle: Duration,
    /// The most idle connections kept per host.
    pub idle_per_host_max: usize,
}

/// A pooled HTTP/1.1 client; cheap to clone (the clones share the pool).
#[derive(Clone)]
pub struct HttpClient {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
}

impl HttpClient {
    /// A client whose `https://` requests check the server's chain against `roots`:
    /// rustls on the wss listener's provider (ring), TLS 1.3 and 1.2, no client
    /// certificate.
    pub fn new(limits: ClientLimits, roots: rustls::RootCertStore) -> HttpClient {
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(net::io::tls::provider()))
            .with_safe_default_protocol_versions()
            .expect("the wss listener's provider supports TLS 1.3 and 1.2")
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut http = HttpConnector::new();
        http.set_connect_timeout(Some(limits.connect_timeout));
        http.set_nodelay(true);
        http.enforce_http(false);
        // ALPN (`http/1.1`) is set by the connector's `enable_http1`.
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(limits.idle)
            .pool_max_idle_per_host(limits.idle_per_host_max)
            .build(connector);
        HttpClient { client }
    }

    /// A client for `http://` only (an `https://` request fails: no root is
    /// trusted).
    pub fn plain(limits: ClientLimits) -> HttpClient {
        HttpClient::new(limits, rustls::RootCertStore::empty())
    }

    /// Sends `request` and reads its answer (module docs). Must be awaited on a
    /// tokio runtime with IO and time enabled.
    pub async fn exchange(
        &self,
        request: Request<Full<Bytes>>,
        answer_bytes_max: usize,
        timeout: Duration,
    ) -> Result<Answer, ExchangeError> {
        let exchange = async {
            let resp = self.client.request(request).await.map_err(request_error)?;
            let status = resp.status().as_u16();
            let too_large = |bytes| ExchangeError::TooLarge { bytes, status };
            let declared = resp
                .headers()
                .get(CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<usize>().ok());
            if let Some(n) = declared.filter(|&n| n > answer_bytes_max) {
                return Err(too_large(n));
            }
            let body = Limited::new(resp.into_body(), answer_bytes_max)
                .collect()
                .await
                .map_err(|e| {
                    if e.is::<http_body_util::LengthLimitError>() {
                        too_large(answer_bytes_max)
                    } else {
                        ExchangeError::Unreachable(format!("the answer broke off: {e}"))
                    }
                })?
                .to_bytes();
            Ok(Answer {
                status,
                body: body.to_vec(),
            })
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(r) => r,
            Err(_) => Err(ExchangeError::Timeout(timeout.as_millis() as u64)),
        }
    }
}

/// A client error as [`ExchangeError`]: an answer that does not parse is
/// malformed; anything else (no connection, TLS refused, closed before an answer)
/// unreachable. The text holds the error's sources (a TLS refusal is a source of
/// hyper-util's connect error).
fn request_error(e: hyper_util::client::legacy::Error) -> ExchangeError {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(&e);
    let mut parse = false;
    while let Some(s) = source {
        parse |= s
            .downcast_ref::<hyper::Error>()
            .is_some_and(|h| h.is_parse());
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    if parse {
        ExchangeError::Malformed(text)
    } else {
        ExchangeError::Unreachable(text)
    }
}

/// [`HttpClient`] for a program without a runtime (imbench's set-up, tests): JSON
/// requests to one API, each exchange within `timeout`, on a runtime of its own.
pub struct BlockingClient {
    runtime: tokio::runtime::Runtime,
    client: HttpClient,
    addr: SocketAddr,
    authorization: Option<HeaderValue>,
    timeout: Duration,
    answer_bytes_max: usize,
}

impl BlockingClient {
    /// A client of the API at `addr`, sending `Authorization: Bearer <bearer>` when
    /// given, reading answers up to `answer_bytes_max`. Fails if the runtime cannot
    /// start or the token is not a header value.
    pub fn new(
        addr: SocketAddr,
        bearer: Option<&str>,
        timeout: Duration,
        answer_bytes_max: usize,
    ) -> std::io::Result<BlockingClient> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let authorization = bearer
            .map(|t| HeaderValue::from_str(&format!("Bearer {t}")))
            .transpose()
            .map_err(std::io::Error::other)?;
        let client = HttpClient::plain(ClientLimits {
            connect_timeout: timeout,
            idle: Duration::from_secs(30),
            idle_per_host_max: 4,
        });
        Ok(BlockingClient {
            runtime,
            client,
            addr,
            authorization,
            timeout,
            answer_bytes_max,
        })
    }

    /// One request (`path`: path and query) with a JSON `body`; the answer's status
    /// and body as text.
    pub fn request(&self, method: &str, path: &str, body: &str) -> std::io::Result<(u16, String)> {
        let method = Method::from_bytes(method.as_bytes()).map_err(std::io::Error::other)?;
        let uri: Uri = format!("http://{}{path}", self.addr)
            .parse()
            .map_err(std::io::Error::other)?;
        let mut b = Request::builder()
            .method(method)
            .uri(uri)
            .header(HOST, self.addr.to_string())
            .header(CONTENT_TYPE, "application/json");
        if let Some(auth) = &self.authorization {
            b = b.header(AUTHORIZATION, auth);
        }
        let request = b
            .body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
            .map_err(std::io::Error::other)?;
        let answer = self
            .runtime
            .block_on(
                self.client
                    .exchange(request, self.answer_bytes_max, self.timeout),
            )
            .map_err(std::io::Error::other)?;
        let text = String::from_utf8(answer.body).map_err(std::io::Error::other)?;
        Ok((answer.status, text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    /// Serves one connection: reads one request head (and a body of
    /// `Content-Length`), answers `answer`, and returns what it read.
    fn serve_once(answer: &'static str) -> (SocketAddr, std::thread::JoinHandle<String>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let h = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            loop {
                let n = s.read(&mut buf).unwrap();
                assert!(n > 0, "the client closed before a whole request");
                got.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&got).to_string();
                if let Some(head_end) = text.find("\r\n\r\n") {
                    let len = text[..head_end]
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length: "))
                        .map_or(0, |v| v.trim().parse::<usize>().unwrap());
                    if got.len() >= head_end + 4 + len {
                        break;
                    }
                }
            }
            s.write_all(answer.as_bytes()).unwrap();
            String::from_utf8(got).unwrap()
        });
        (addr, h)
    }

    /// The blocking client sends the method, path, JSON body and bearer token, and
    /// gives back the status and body.
    #[test]
    fn a_blocking_request_carries_its_parts_and_reads_the_answer() {
        let (addr, server) =
            serve_once("HTTP/1.1 201 Created\r\ncontent-length: 7\r\n\r\n{\"a\":1}");
        let c = BlockingClient::new(addr, Some("tok"), Duration::from_secs(30), 1 << 10).unwrap();
        let (status, body) = c
            .request("POST", "/user/token?x=1", "{\"uid\":\"u\"}")
            .unwrap();
        assert_eq!((status, body.as_str()), (201, "{\"a\":1}"));
        let req = server.join().unwrap();
        assert!(
            req.starts_with("POST /user/token?x=1 HTTP/1.1\r\n"),
            "{req}"
        );
        assert!(req.contains("authorization: Bearer tok\r\n"), "{req}");
        assert!(req.contains("content-type: application/json\r\n"), "{req}");
        assert!(req.ends_with("\r\n\r\n{\"uid\":\"u\"}"), "{req}");
    }

    /// A declared body over the limit is refused with the answer's status; a body
    /// that is not HTTP is malformed; a closed port is unreachable.
    #[test]
    fn large_malformed_and_missing_answers_are_told_apart() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let client = HttpClient::plain(ClientLimits {
            connect_timeout: Duration::from_secs(30),
            idle: Duration::from_secs(1),
            idle_per_host_max: 1,
        });
        let get = |addr: SocketAddr| {
            Request::get(format!("http://{addr}/x"))
                .body(Full::new(Bytes::new()))
                .unwrap()
        };
        let long = Duration::from_secs(30);
        let (addr, server) = serve_once("HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\nhello world");
        let e = rt
            .block_on(client.exchange(get(addr), 10, long))
            .unwrap_err();
        assert_eq!(
            e,
            ExchangeError::TooLarge {
                bytes: 11,
                status: 200
            }
        );
        server.join().unwrap();
        let (addr, server) = serve_once("SSH-2.0-not-http\r\n\r\n");
        let e = rt
            .block_on(client.exchange(get(addr), 10, long))
            .unwrap_err();
        assert!(matches!(e, ExchangeError::Malformed(_)), "{e:?}");
        server.join().unwrap();
        let closed = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let e = rt
            .block_on(client.exchange(get(closed), 10, long))
            .unwrap_err();
        assert!(matches!(e, ExchangeError::Unreachable(_)), "{e:?}");
    }
}
