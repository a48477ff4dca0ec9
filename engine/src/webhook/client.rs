//! The webhooks' HTTP client: the tree's one client (`http::client`, hyper-util's
//! pooled client, HTTP/1.1, keep-alive) on the runtime the driver runs on, every
//! request bounded by `timeout_ms` (connect, TLS handshake, send, answer and its
//! body together). `https://` receivers go
//! through hyper-rustls: rustls with the wss listener's crypto provider
//! (`net::io::tls::provider`, ring), TLS 1.3 and 1.2, ALPN `http/1.1`, the
//! receiver's certificate checked against Mozilla's roots (webpki-roots) or, with
//! `[webhook] ca_file`, against the CA certificates of that PEM file only.

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use domain::webhook::{EventKind, Request};
use hmac::{Hmac, Mac};
use http_body_util::Full;
use hyper::header::{CONTENT_TYPE, HOST};
use hyper::{StatusCode, Uri};
use sha2::Sha256;

use super::WebhookConfig;
use crate::http::client::{ClientLimits, ExchangeError, HttpClient};

/// The signature header: `sha256=` and the hex HMAC-SHA256 of the body keyed by
/// `[webhook] secret`.
pub const SIGNATURE_HEADER: &str = "x-imrouter-signature";
/// The batch header: the same on every attempt of one request
/// (`node.kind.boot.batch`, `boot` a random number of this start of the node, so a
/// batch number of a later start is another batch; a receiver may deduplicate
/// retries by it).
pub const BATCH_HEADER: &str = "x-imrouter-batch";
/// The most of an answer's body read (the rest is not waited for).
const ANSWER_BYTES_MAX: usize = 64 << 10;

/// The receiver: `http[s]://authority/path?query` (`event=NAME` is appended).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// `http` or `https`.
    scheme: &'static str,
    authority: String,
    /// Path and query, `?` or `&` last: the event's parameter follows.
    path_query: String,
}

impl Target {
    /// Parses `url`; refuses what is not `http[s]://host[:port][/path][?query]`.
    pub fn parse(url: &str) -> Result<Target, String> {
        let uri: Uri = url.parse().map_err(|e| format!("not a URL: {e}"))?;
        let scheme = match uri.scheme_str() {
            Some("http") => "http",
            Some("https") => "https",
            _ => return Err("the URL must start with http:// or https://".into()),
        };
        let Some(authority) = uri.authority() else {
            return Err("the URL has no host".into());
        };
        let mut path_query = uri.path().to_string();
        match uri.query() {
            Some(q) if !q.is_empty() => path_query += &format!("?{q}&"),
            _ => path_query.push('?'),
        }
        Ok(Target {
            scheme,
            authority: authority.to_string(),
            path_query,
        })
    }

    /// Whether the receiver is reached over TLS.
    pub fn is_https(&self) -> bool {
        self.scheme == "https"
    }

    /// The request URI of `kind`'s events.
    fn uri(&self, kind: EventKind) -> Result<Uri, String> {
        let s = format!(
            "{}://{}{}event={}",
            self.scheme,
            self.authority,
            self.path_query,
            kind.name()
        );
        s.parse().map_err(|e| format!("{s}: {e}"))
    }
}

/// The certificates a receiver's chain is checked against: those of `ca_file` (PEM,
/// at least one CERTIFICATE), or Mozilla's roots when it is empty. Gives why the
/// file does not do.
pub fn root_store(ca_file: &Path) -> Result<rustls::RootCertStore, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    if ca_file.as_os_str().is_empty() {
        return Ok(rustls::RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        });
    }
    let pem = std::fs::read(ca_file).map_err(|e| e.to_string())?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("bad PEM: {e}"))?;
    if certs.is_empty() {
        return Err("no CERTIFICATE in the PEM file".into());
    }
    let mut roots = rustls::RootCertStore::empty();
    for (i, cert) in certs.into_iter().enumerate() {
        roots
            .add(cert)
            .map_err(|e| format!("certificate {} is not a usable CA: {e}", i + 1))?;
    }
    Ok(roots)
}

/// Posts the queues' requests.
#[derive(Clone)]
pub struct WebhookClient {
    client: HttpClient,
    target: Target,
    timeout: Duration,
    secret: Option<Vec<u8>>,
    node_id: u64,
    boot: u64,
}

impl WebhookClient {
    pub fn new(config: &WebhookConfig, node_id: u64, boot: u64) -> Result<WebhookClient, String> {
        let target = Target::parse(&config.url)?;
        let timeout = Duration::from_millis(config.timeout_ms);
        let roots = root_store(Path::new(&config.ca_file))
            .map_err(|e| format!("webhook.ca_file {:?}: {e}", config.ca_file))?;
        let limits = ClientLimits {
            connect_timeout: timeout,
            idle: Duration::from_secs(30),
            idle_per_host_max: config.requests_in_flight_max * 3,
        };
        let client = HttpClient::new(limits, roots);
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
            boot,
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
                format!(
                    "{}.{}.{:x}.{}",
                    self.node_id,
                    kind.name(),
                    self.boot,
                    r.batch
                ),
            );
        if let Some(secret) = &self.secret {
            req = req.header(SIGNATURE_HEADER, signature(secret, &r.body));
        }
        let req = req.body(Full::new(body)).map_err(|e| e.to_string())?;
        // A body over the limit is not waited for; the status decides.
        let status = match self
            .client
            .exchange(req, ANSWER_BYTES_MAX, self.timeout)
            .await
        {
            Ok(answer) => answer.status,
            Err(ExchangeError::TooLarge { status, .. }) => status,
            Err(e) => return Err(e.to_string()),
        };
        let status = StatusCode::from_u16(status).map_err(|e| e.to_string())?;
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("answered {status}"))
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
        let t = Target::parse("https://h:8443/x").unwrap();
        assert!(t.is_https());
        assert_eq!(
            t.uri(EventKind::Notify).unwrap().to_string(),
            "https://h:8443/x?event=msg.notify"
        );
        assert!(Target::parse("ftp://h/x").is_err());
        assert!(Target::parse("/just/a/path").is_err());
        assert!(Target::parse("not a url").is_err());
    }

    #[tokio::test]
    async fn the_client_is_built_for_http_and_https() {
        for url in ["http://127.0.0.1:9/x", "https://127.0.0.1:9/x"] {
            let config = WebhookConfig {
                url: url.into(),
                ..WebhookConfig::default()
            };
            assert!(WebhookClient::new(&config, 1, 2).is_ok(), "{url}");
        }
    }

    #[test]
    fn a_ca_file_must_hold_a_certificate() {
        assert!(!root_store(Path::new("")).unwrap().is_empty(), "Mozilla's");
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("none.pem");
        assert!(root_store(&missing).is_err());
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "no pem here\n").unwrap();
        assert!(root_store(&empty).unwrap_err().contains("no CERTIFICATE"));
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
