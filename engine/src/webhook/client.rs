//! The webhooks' HTTP client: hyper-util's pooled client (HTTP/1.1, keep-alive) on
//! the runtime the driver runs on, every request bounded by `timeout_ms` (connect,
//! send, answer and its body together).

use std::time::Duration;

use bytes::Bytes;
use domain::webhook::{EventKind, Request};
use hmac::{Hmac, Mac};
use http_body_util::{BodyExt, Full, Limited};
use hyper::header::{CONTENT_TYPE, HOST};
use hyper::Uri;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use sha2::Sha256;

use super::WebhookConfig;

/// The signature header: `sha256=` and the hex HMAC-SHA256 of the body keyed by
/// `[webhook] secret`.
pub const SIGNATURE_HEADER: &str = "x-imrouter-signature";
/// The batch header: the same on every attempt of one request (`node.kind.batch`;
/// a receiver may deduplicate retries by it).
pub const BATCH_HEADER: &str = "x-imrouter-batch";
/// The most of an answer's body read (the rest is not waited for).
const ANSWER_BYTES_MAX: usize = 64 << 10;

/// The receiver: `http://authority/path?query` (`event=NAME` is appended).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    authority: String,
    /// Path and query, `?` or `&` last: the event's parameter follows.
    path_query: String,
}

impl Target {
    /// Parses `url`; refuses what is not `http://host[:port][/path][?query]`.
    pub fn parse(url: &str) -> Result<Target, String> {
        let uri: Uri = url.parse().map_err(|e| format!("not a URL: {e}"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => {
                return Err("https is not supported: point it at a local proxy over http".into())
            }
            _ => return Err("the URL must start with http://".into()),
        }
        let Some(authority) = uri.authority() else {
            return Err("the URL has no host".into());
        };
        let mut path_query = uri.path().to_string();
        match uri.query() {
            Some(q) if !q.is_empty() => path_query += &format!("?{q}&"),
            _ => path_query.push('?'),
        }
        Ok(Target {
            authority: authority.to_string(),
            path_query,
        })
    }

    /// The request URI of `kind`'s events.
    fn uri(&self, kind: EventKind) -> Result<Uri, String> {
        let s = format!(
            "http://{}{}event={}",
            self.authority,
            self.path_query,
            kind.name()
        );
        s.parse().map_err(|e| format!("{s}: {e}"))
    }
}

/// A pooled HTTP/1.1 client (hyper-util's legacy client, keep-alive) whose
/// connections run on the runtime it is used from: connects bounded by
/// `connect_timeout`, `TCP_NODELAY`, at most `max_idle_per_host` idle connections
/// per host, each kept `idle`. The webhooks post with it, and the HTTP API passes
/// requests to other nodes with it (`http::forward`).
pub fn pooled_client(
    connect_timeout: Duration,
    idle: Duration,
    max_idle_per_host: usize,
) -> Client<HttpConnector, Full<Bytes>> {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(connect_timeout));
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(idle)
        .pool_max_idle_per_host(max_idle_per_host)
        .build(connector)
}

/// Posts the queues' requests.
#[derive(Clone)]
pub struct WebhookClient {
    client: Client<HttpConnector, Full<Bytes>>,
    target: Target,
    timeout: Duration,
    secret: Option<Vec<u8>>,
    node_id: u64,
}

impl WebhookClient {
    pub fn new(config: &WebhookConfig, node_id: u64) -> Result<WebhookClient, String> {
        let target = Target::parse(&config.url)?;
        let timeout = Duration::from_millis(config.timeout_ms);
        let client = pooled_client(
            timeout,
            Duration::from_secs(30),
            config.requests_in_flight_max * 3,
        );
        let secret = config
            .secret
            .is_set()
            .then(|| config.secret.expose().to_vec());
        Ok(WebhookClient {
            client,
            target,
            timeout,
            secret,
            node_id,
        })
    }

    /// POSTs `r` as `kind`'s event; `Ok` when the receiver answered 2xx in time,
    /// else why not.
    pub async fn post(&self, kind: EventKind, r: &Request) -> Result<(), String> {
        let uri = self.target.uri(kind)?;
        let body = Bytes::from_owner(r.body.clone());
        let mut req = hyper::Request::post(uri)
            .header(HOST, &self.target.authority)
            .header(CONTENT_TYPE, "application/json")
            .header(
                BATCH_HEADER,
                format!("{}.{}.{}", self.node_id, kind.name(), r.batch),
            );
        if let Some(secret) = &self.secret {
            req = req.header(SIGNATURE_HEADER, signature(secret, &r.body));
        }
        let req = req.body(Full::new(body)).map_err(|e| e.to_string())?;
        let answer = async {
            let resp = self.client.request(req).await.map_err(|e| e.to_string())?;
            let status = resp.status();
            // Read (a bounded part of) the answer so the connection can be reused.
            let _ = Limited::new(resp.into_body(), ANSWER_BYTES_MAX)
                .collect()
                .await;
            if status.is_success() {
                Ok(())
            } else {
                Err(format!("answered {status}"))
            }
        };
        match tokio::time::timeout(self.timeout, answer).await {
            Ok(result) => result,
            Err(_) => Err(format!("no answer within {} ms", self.timeout.as_millis())),
        }
    }
}

/// `sha256=<hex>`: the HMAC-SHA256 of `body` keyed by `secret`.
pub fn signature(secret: &[u8], body: &[u8]) -> String {
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret) else {
        unreachable!("HMAC takes a key of any length");
    };
    mac.update(body);
    let tag = mac.finalize().into_bytes();
    let mut s = String::with_capacity(7 + 2 * tag.len());
    s.push_str("sha256=");
    for b in tag {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked_and_the_event_is_a_query_parameter() {
        let t = Target::parse("http://127.0.0.1:9000/hook").unwrap();
        assert_eq!(
            t.uri(EventKind::Offline).unwrap().to_string(),
            "http://127.0.0.1:9000/hook?event=msg.offline"
        );
        let t = Target::parse("http://h/hook?app=1").unwrap();
        assert_eq!(
            t.uri(EventKind::OnlineStatus).unwrap().to_string(),
            "http://h/hook?app=1&event=user.onlinestatus"
        );
        let t = Target::parse("http://h").unwrap();
        assert_eq!(
            t.uri(EventKind::Offline).unwrap().to_string(),
            "http://h/?event=msg.offline"
        );
        assert!(Target::parse("https://h/x").unwrap_err().contains("https"));
        assert!(Target::parse("ftp://h/x").is_err());
        assert!(Target::parse("/just/a/path").is_err());
        assert!(Target::parse("not a url").is_err());
    }

    /// RFC 4231 test case 2.
    #[test]
    fn the_signature_is_hmac_sha256_in_hex() {
        assert_eq!(
            signature(b"Jefe", b"what do ya want for nothing?"),
            "sha256=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }
}
