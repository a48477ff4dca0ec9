//! TLS on a listener (the WebSocket listener's `wss://`), with rustls (the ring
//! provider; no OpenSSL), sans-IO inside the connection core.
//!
//! [`TlsServer`] is the listener's side, shared by every shard: the certificate
//! chain and key loaded from PEM files ([`TlsServer::load`]), swapped in place by
//! [`TlsServer::reload`] (SIGHUP: connections already up keep the session they
//! negotiated; the next handshake presents the new certificate), the session cache,
//! and counters. `TlsConn` is one connection's: rustls's `ServerConnection` and
//! the plaintext the core queued for it that is not sealed yet. The core
//! (`core.rs`) feeds it what the socket gave and hands the WebSocket layer the
//! plaintext; the backends only ever see ciphertext in the output queue, so both
//! get TLS alike.
//!
//! Versions TLS 1.3 and 1.2 (rustls's safe suites), ALPN `http/1.1` (a client that
//! offers ALPN without it is refused; one that offers none is served).

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use rustls::crypto::{ActiveKeyExchange, CryptoProvider, SharedSecret, SupportedKxGroup};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, ServerConfig, ServerConnection};
use rustls::sign::CertifiedKey;
use rustls::NamedGroup;
use zeroize::Zeroize;

/// `[tls]`: the certificate of the TLS listener and the limits of TLS connections.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM: the server certificate first, then its chain (intermediates).
    pub cert_file: PathBuf,
    /// PEM: the private key of the first certificate (PKCS#8, PKCS#1 RSA or SEC1
    /// EC).
    pub key_file: PathBuf,
    /// TLS handshake bytes a connection may have waiting on its shard (received while
    /// the shard's handshake budget for its poll was spent); past it the connection
    /// is closed. (rustls bounds a handshake message itself.)
    pub handshake_bytes_max: usize,
    /// Handshake steps (a client flight decrypted and answered: the first costs the
    /// key exchange and the certificate's signature) a shard does per poll of its
    /// driver; the rest wait for the next polls, so a storm of handshakes is spread
    /// over turns instead of stalling the shard's loop for all of them at once.
    pub handshakes_per_poll_max: usize,
    /// TLS sessions remembered for resumption (TLS 1.2 session ids and TLS 1.3
    /// tickets), shared by the shards; 0 turns resumption off.
    pub session_cache_entries: usize,
}

impl Default for TlsConfig {
    fn default() -> Self {
        TlsConfig {
            cert_file: PathBuf::new(),
            key_file: PathBuf::new(),
            handshake_bytes_max: 32 * 1024,
            handshakes_per_poll_max: 32,
            session_cache_entries: 4096,
        }
    }
}

impl TlsConfig {
    /// Whether both files are named (`[tls]` configured).
    pub fn is_set(&self) -> bool {
        !self.cert_file.as_os_str().is_empty() || !self.key_file.as_os_str().is_empty()
    }
}

/// A certificate or key that did not load: the file and the reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsLoadError {
    /// `cert_file` or `key_file`.
    pub key: &'static str,
    /// The path the config named for it.
    pub file: PathBuf,
    /// What went wrong: unreadable, bad PEM, no item of the right kind, or a key
    /// that rustls refuses or that does not match the first certificate.
    pub reason: String,
}

impl std::fmt::Display for TlsLoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "tls.{} {}: {}",
            self.key,
            self.file.display(),
            self.reason
        )
    }
}

impl std::error::Error for TlsLoadError {}

/// Counters of a TLS listener, shared by every shard (each bumped once per
/// connection event, never per message).
#[derive(Debug, Default)]
pub struct TlsCounters {
    /// Handshakes completed.
    pub handshakes: AtomicU64,
    /// Connections closed for bad TLS input (garbage records, a failed handshake, an
    /// oversized handshake).
    pub failures: AtomicU64,
    /// Successful reloads of the certificate.
    pub reloads: AtomicU64,
    /// Reloads refused (the files did not load; the old certificate stays).
    pub reload_failures: AtomicU64,
}

/// The certificate presented now, swapped by a reload.
#[derive(Debug)]
struct CertSlot {
    current: RwLock<Arc<CertifiedKey>>,
    /// The first certificate's notAfter, seconds since the Unix epoch.
    not_after_unix: AtomicI64,
}

impl ResolvesServerCert for CertSlot {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        )
    }
}

/// The session cache (resumption), emptied by a reload: a client cannot resume a
/// session made under the certificate that was replaced.
#[derive(Debug)]
struct Sessions {
    entries: usize,
    current: RwLock<Arc<rustls::server::ServerSessionMemoryCache>>,
}

impl Sessions {
    fn now(&self) -> Arc<rustls::server::ServerSessionMemoryCache> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn clear(&self) {
        *self.current.write().unwrap_or_else(|e| e.into_inner()) =
            rustls::server::ServerSessionMemoryCache::new(self.entries);
    }
}

impl rustls::server::StoresServerSessions for Sessions {
    fn put(&self, key: Vec<u8>, value: Vec<u8>) -> bool {
        self.now().put(key, value)
    }
    fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.now().get(key)
    }
    fn take(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.now().take(key)
    }
    fn can_cache(&self) -> bool {
        true
    }
}

struct Shared {
    config: Arc<ServerConfig>,
    /// `None`: resumption off (`session_cache_entries` 0).
    sessions: Option<Arc<Sessions>>,
    provider: Arc<CryptoProvider>,
    slot: Arc<CertSlot>,
    limits: TlsConfig,
    counters: TlsCounters,
}

/// The TLS side of a listener: what every shard's TLS connections are made from.
/// Cheap to clone (one `Arc`).
#[derive(Clone)]
pub struct TlsServer(Arc<Shared>);

impl std::fmt::Debug for TlsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsServer")
            .field("cert_file", &self.0.limits.cert_file)
            .field("key_file", &self.0.limits.key_file)
            .field("not_after_unix", &self.not_after_unix())
            .finish()
    }
}

impl TlsServer {
    /// Loads `config`'s certificate chain and key. Refuses, naming the file and the
    /// reason, a file that cannot be read, holds no certificate or key, a key of an
    /// unsupported kind, a key that is not the first certificate's, or a certificate
    /// whose validity cannot be read.
    pub fn load(config: &TlsConfig) -> Result<TlsServer, TlsLoadError> {
        let provider = Arc::new(provider());
        let (key, not_after) = load_certified_key(config, &provider)?;
        let slot = Arc::new(CertSlot {
            current: RwLock::new(Arc::new(key)),
            not_after_unix: AtomicI64::new(not_after),
        });
        let mut sc = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|e| TlsLoadError {
                key: "cert_file",
                file: config.cert_file.clone(),
                reason: format!("TLS setup: {e}"),
            })?
            .with_no_client_auth()
            .with_cert_resolver(slot.clone());
        sc.alpn_protocols = vec![b"http/1.1".to_vec()];
        let sessions = (config.session_cache_entries > 0).then(|| {
            Arc::new(Sessions {
                entries: config.session_cache_entries,
                current: RwLock::new(rustls::server::ServerSessionMemoryCache::new(
                    config.session_cache_entries,
                )),
            })
        });
        match &sessions {
            Some(s) => sc.session_storage = s.clone(),
            None => {
                sc.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
                sc.send_tls13_tickets = 0;
            }
        }
        Ok(TlsServer(Arc::new(Shared {
            config: Arc::new(sc),
            sessions,
            provider,
            slot,
            limits: config.clone(),
            counters: TlsCounters::default(),
        })))
    }

    /// Loads the files again and, when they load, presents the new certificate to
    /// every handshake from now on (connections already up are not touched) and
    /// forgets the sessions made before (no resumption past a change of
    /// certificate). On failure the certificate in use stays and the error names
    /// the file.
    pub fn reload(&self) -> Result<(), TlsLoadError> {
        match load_certified_key(&self.0.limits, &self.0.provider) {
            Ok((key, not_after)) => {
                *self
                    .0
                    .slot
                    .current
                    .write()
                    .unwrap_or_else(|e| e.into_inner()) = Arc::new(key);
                self.0
                    .slot
                    .not_after_unix
                    .store(not_after, Ordering::Relaxed);
                if let Some(s) = &self.0.sessions {
                    s.clear();
                }
                self.0.counters.reloads.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                self.0
                    .counters
                    .reload_failures
                    .fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// The presented certificate's notAfter (seconds since the Unix epoch).
    pub fn not_after_unix(&self) -> i64 {
        self.0.slot.not_after_unix.load(Ordering::Relaxed)
    }

    /// Seconds until the presented certificate expires at `now_unix` (negative once
    /// expired): the gauge `imrouter_tls_cert_expiry_seconds`.
    pub fn expires_in_s(&self, now_unix: i64) -> i64 {
        self.not_after_unix() - now_unix
    }

    /// The configuration it was loaded from (files and limits).
    pub fn config(&self) -> &TlsConfig {
        &self.0.limits
    }

    /// The listener's counters.
    pub fn counters(&self) -> &TlsCounters {
        &self.0.counters
    }

    /// A new server-side connection.
    pub(crate) fn accept(&self) -> Result<TlsConn, rustls::Error> {
        let conn = ServerConnection::new(self.0.config.clone())?;
        Ok(TlsConn {
            conn,
            server: self.clone(),
            plain: Vec::new(),
            deferred: Vec::new(),
            failed: false,
            close_notify_sent: false,
        })
    }
}

/// The crypto provider: ring (it builds from crates.io with a C compiler alone;
/// rustls deprecates it for lacking post-quantum key exchange), with the key
/// exchange groups in order of cost: X25519 (and P-256) first. ring's default puts
/// P-384 first, which costs a shard about 0.8 ms per handshake against about 0.1 ms
/// (`cargo run --release -p net --example tls_handshake_cost`). X25519 itself is
/// [`X25519`]: the wkproto key agreement's implementation (`proto::crypto`:
/// s2n-bignum's verified assembly where the CPU has it), about half of ring's cost.
pub fn provider() -> CryptoProvider {
    use rustls::crypto::ring::kx_group;
    #[allow(deprecated)]
    let mut p = rustls::crypto::ring::default_provider();
    let x25519: &'static dyn SupportedKxGroup = &X25519;
    p.kx_groups = vec![x25519, kx_group::SECP256R1, kx_group::SECP384R1];
    p
}

/// TLS's X25519 key exchange (RFC 7748, RFC 8446 §7.4.2) on `proto::crypto`'s
/// X25519 (the one every wkproto CONNECT already uses), the private key from ring's
/// system random source. An all-zero shared secret (a low-order peer key) is
/// refused, as ring refuses it.
#[derive(Debug)]
pub struct X25519;

impl SupportedKxGroup for X25519 {
    fn start(&self) -> Result<Box<dyn ActiveKeyExchange>, rustls::Error> {
        // The private key is drawn into its box (no copy left behind to clear).
        let mut ex = Box::new(X25519Exchange {
            seed: [0; proto::crypto::KEY_BYTES],
            public: [0; proto::crypto::KEY_BYTES],
        });
        #[allow(deprecated)]
        let random = rustls::crypto::ring::default_provider().secure_random;
        random.fill(&mut ex.seed).map_err(rustls::Error::from)?;
        ex.public = proto::crypto::public_key(ex.seed);
        Ok(ex)
    }

    fn name(&self) -> NamedGroup {
        NamedGroup::X25519
    }
}

/// One side's ephemeral X25519 key pair.
struct X25519Exchange {
    seed: [u8; proto::crypto::KEY_BYTES],
    public: [u8; proto::crypto::KEY_BYTES],
}

impl ActiveKeyExchange for X25519Exchange {
    fn complete(self: Box<Self>, peer_pub_key: &[u8]) -> Result<SharedSecret, rustls::Error> {
        let peer: [u8; proto::crypto::KEY_BYTES] = peer_pub_key
            .try_into()
            .map_err(|_| rustls::Error::from(rustls::PeerMisbehaved::InvalidKeyShare))?;
        let mut shared = proto::crypto::shared_secret(self.seed, peer)
            .map_err(|_| rustls::Error::from(rustls::PeerMisbehaved::InvalidKeyShare))?;
        // rustls's SharedSecret zeroizes its own copy when dropped; this one too.
        let secret = SharedSecret::from(&shared[..]);
        shared.zeroize();
        Ok(secret)
    }

    fn pub_key(&self) -> &[u8] {
        &self.public
    }

    fn group(&self) -> NamedGroup {
        NamedGroup::X25519
    }
}

impl Drop for X25519Exchange {
    fn drop(&mut self) {
        // The ephemeral private key, zeroized as the link keys are (proto::rpc::seal).
        self.seed.zeroize();
    }
}

/// Reads the chain and the key of `config` and checks they belong together; gives
/// them with the first certificate's notAfter.
fn load_certified_key(
    config: &TlsConfig,
    provider: &CryptoProvider,
) -> Result<(CertifiedKey, i64), TlsLoadError> {
    let cert_err = |reason: String| TlsLoadError {
        key: "cert_file",
        file: config.cert_file.clone(),
        reason,
    };
    let key_err = |reason: String| TlsLoadError {
        key: "key_file",
        file: config.key_file.clone(),
        reason,
    };
    let cert_pem = read_file(&config.cert_file).map_err(cert_err)?;
    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| cert_err(format!("bad PEM: {e}")))?;
    let Some(first) = chain.first() else {
        return Err(cert_err("no CERTIFICATE in the PEM file".into()));
    };
    let not_after = cert_not_after_unix(first).ok_or_else(|| {
        cert_err("the first certificate is not a readable X.509 certificate".into())
    })?;
    let key_pem = read_file(&config.key_file).map_err(key_err)?;
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
        key_err(match e {
            rustls::pki_types::pem::Error::NoItemsFound => "no PRIVATE KEY in the PEM file".into(),
            e => format!("bad PEM: {e}"),
        })
    })?;
    let signing = provider
        .key_provider
        .load_private_key(key)
        .map_err(|e| key_err(format!("unsupported or malformed key: {e}")))?;
    let certified = CertifiedKey::new(chain, signing);
    match certified.keys_match() {
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {}
        Err(rustls::Error::InconsistentKeys(_)) => {
            return Err(key_err(format!(
                "the key does not belong to the first certificate of {}",
                config.cert_file.display()
            )))
        }
        Err(e) => return Err(cert_err(format!("bad certificate: {e}"))),
    }
    Ok((certified, not_after))
}

fn read_file(path: &Path) -> Result<Vec<u8>, String> {
    if path.as_os_str().is_empty() {
        return Err("not set".into());
    }
    std::fs::read(path).map_err(|e| e.to_string())
}

/// One DER element of `input`: its tag, its contents and what follows it.
fn der_next(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (first as usize, rest)
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, &b| (acc << 8) | b as usize);
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

/// The notAfter of an X.509 certificate (DER), seconds since the Unix epoch: the
/// second time of `tbsCertificate.validity`.
pub fn cert_not_after_unix(cert: &[u8]) -> Option<i64> {
    const SEQUENCE: u8 = 0x30;
    let (tag, cert, _) = der_next(cert)?;
    if tag != SEQUENCE {
        return None;
    }
    let (tag, tbs, _) = der_next(cert)?;
    if tag != SEQUENCE {
        return None;
    }
    let (tag, _, mut rest) = der_next(tbs)?;
    if tag == 0xa0 {
        // [0] version; the serial number follows.
        (_, _, rest) = der_next(rest)?;
    }
    // signature, issuer, then validity.
    let (_, _, rest) = der_next(rest)?;
    let (_, _, rest) = der_next(rest)?;
    let (tag, validity, _) = der_next(rest)?;
    if tag != SEQUENCE {
        return None;
    }
    let (_, _, rest) = der_next(validity)?;
    let (tag, time, _) = der_next(rest)?;
    asn1_time_unix(tag, time)
}

/// An ASN.1 UTCTime (tag 0x17, `YYMMDDHHMMSSZ`, years 1950..2049) or
/// GeneralizedTime (0x18, `YYYYMMDDHHMMSSZ`) as seconds since the Unix epoch.
fn asn1_time_unix(tag: u8, time: &[u8]) -> Option<i64> {
    let digits = |s: &[u8]| -> Option<i64> {
        s.iter().try_fold(0i64, |acc, &b| {
            b.is_ascii_digit().then(|| acc * 10 + i64::from(b - b'0'))
        })
    };
    let (year, rest) = match tag {
        0x17 if time.len() == 13 => {
            let yy = digits(&time[..2])?;
            (if yy < 50 { 2000 + yy } else { 1900 + yy }, &time[2..])
        }
        0x18 if time.len() == 15 => (digits(&time[..4])?, &time[4..]),
        _ => return None,
    };
    if rest[10] != b'Z' {
        return None;
    }
    let field = |i: usize| digits(&rest[i..i + 2]);
    let (month, day) = (field(0)?, field(2)?);
    let (h, m, s) = (field(4)?, field(6)?, field(8)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || h > 23 || m > 59 || s > 60 {
        return None;
    }
    Some(days_from_civil(year, month, day) * 86_400 + h * 3600 + m * 60 + s)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// `days_from_civil`).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// One TLS connection's state in the core.
pub(crate) struct TlsConn {
    conn: ServerConnection,
    server: TlsServer,
    /// Plaintext the core queued (WebSocket frames, the upgrade answer), sealed into
    /// records by [`TlsConn::seal`] when the backend is about to write. Counted in
    /// the connection's output queue.
    pub(crate) plain: Vec<u8>,
    /// Ciphertext received while the shard's handshake budget was spent, at most
    /// `handshake_bytes_max`.
    pub(crate) deferred: Vec<u8>,
    /// The TLS layer failed (bad input): nothing more is sealed; the alert rustls
    /// queued is the last output.
    pub(crate) failed: bool,
    close_notify_sent: bool,
}

/// What [`TlsConn::receive`] found besides plaintext.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Received {
    /// The handshake completed with this input.
    pub(crate) handshake_done: bool,
    /// The peer sent close_notify.
    pub(crate) peer_closed: bool,
}

/// A [`Write`] that appends to a `Vec` (for `write_tls`).
struct Append<'a>(&'a mut Vec<u8>);

impl Write for Append<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl TlsConn {
    pub(crate) fn is_handshaking(&self) -> bool {
        self.conn.is_handshaking()
    }

    pub(crate) fn limits(&self) -> &TlsConfig {
        &self.server.0.limits
    }

    /// Feeds `data` (ciphertext, in order) to rustls: the plaintext it carried is
    /// appended to `plain_in`. `Err`: bad TLS input (the alert rustls queued is left
    /// for [`TlsConn::take_output`]); the connection is done.
    pub(crate) fn receive(
        &mut self,
        mut data: &[u8],
        plain_in: &mut Vec<u8>,
    ) -> Result<Received, rustls::Error> {
        let handshaking = self.conn.is_handshaking();
        let mut out = Received::default();
        while !data.is_empty() {
            if let Err(e) = self.conn.read_tls(&mut data) {
                // rustls refuses more input (its plaintext buffer is drained below
                // after every record batch, so only after a close): bad input.
                return Err(rustls::Error::General(e.to_string()));
            }
            let state = self.conn.process_new_packets()?;
            let n = state.plaintext_bytes_to_read();
            if n > 0 {
                let at = plain_in.len();
                plain_in.resize(at + n, 0);
                let got = self.conn.reader().read(&mut plain_in[at..]).unwrap_or(0);
                plain_in.truncate(at + got);
            }
            if state.peer_has_closed() {
                out.peer_closed = true;
                break;
            }
        }
        out.handshake_done = handshaking && !self.conn.is_handshaking();
        if out.handshake_done {
            self.server
                .0
                .counters
                .handshakes
                .fetch_add(1, Ordering::Relaxed);
        }
        Ok(out)
    }

    /// Counts a connection closed for bad TLS input.
    pub(crate) fn count_failure(&self) -> u64 {
        self.server
            .0
            .counters
            .failures
            .fetch_add(1, Ordering::Relaxed)
            + 1
    }

    /// Appends the records rustls has to send (handshake flights, alerts, sealed
    /// data) to `out`; gives how many bytes.
    pub(crate) fn take_output(&mut self, out: &mut Vec<u8>) -> usize {
        let before = out.len();
        while self.conn.wants_write() {
            match self.conn.write_tls(&mut Append(out)) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        out.len() - before
    }

    /// Seals the queued plaintext into records appended to `out` (one record per
    /// 16 KiB at most), then, when `closing`, a close_notify. Plaintext waits while
    /// the handshake is in progress. Gives the plaintext bytes taken (0 when none
    /// could be).
    pub(crate) fn seal(&mut self, closing: bool, out: &mut Vec<u8>) -> usize {
        if self.failed || self.conn.is_handshaking() {
            return 0;
        }
        let plain = std::mem::take(&mut self.plain);
        let mut off = 0;
        while off < plain.len() {
            match self.conn.writer().write(&plain[off..]) {
                Ok(0) | Err(_) => break,
                Ok(n) => off += n,
            }
            self.take_output(out);
        }
        // A write refused (rustls closed for writing): what is left is dropped.
        let taken = plain.len();
        self.plain = plain;
        crate::io::outbuf::recycle(&mut self.plain);
        if closing && !self.close_notify_sent {
            self.close_notify_sent = true;
            self.conn.send_close_notify();
        }
        self.take_output(out);
        taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asn1_times_convert_to_unix_seconds() {
        assert_eq!(asn1_time_unix(0x17, b"700101000000Z"), Some(0));
        assert_eq!(asn1_time_unix(0x17, b"491231235959Z"), Some(2_524_607_999));
        assert_eq!(asn1_time_unix(0x17, b"500101000000Z"), Some(-631_152_000));
        assert_eq!(
            asn1_time_unix(0x18, b"20380119031408Z"),
            Some(2_147_483_648)
        );
        assert_eq!(
            asn1_time_unix(0x18, b"20240229120000Z"),
            Some(1_709_208_000)
        );
        assert_eq!(asn1_time_unix(0x17, b"700101000000+"), None);
        assert_eq!(asn1_time_unix(0x17, b"701301000000Z"), None);
        assert_eq!(asn1_time_unix(0x18, b"700101000000Z"), None);
    }

    /// The node's X25519 agrees with ring's own (what its TLS used before, and what
    /// any RFC 7748 peer computes), whichever side starts; each start is a fresh key.
    #[test]
    fn x25519_agrees_with_rings_own() {
        let ring = rustls::crypto::ring::kx_group::X25519;
        for _ in 0..8 {
            let ours = X25519.start().unwrap();
            let theirs = ring.start().unwrap();
            assert_eq!(ours.pub_key().len(), 32);
            assert_eq!(ours.group(), NamedGroup::X25519);
            let (ours_pub, theirs_pub) = (ours.pub_key().to_vec(), theirs.pub_key().to_vec());
            let a = ours.complete(&theirs_pub).unwrap();
            let b = theirs.complete(&ours_pub).unwrap();
            assert_eq!(a.secret_bytes(), b.secret_bytes());
        }
        let (x, y) = (X25519.start().unwrap(), X25519.start().unwrap());
        assert_ne!(x.pub_key(), y.pub_key());
        assert_eq!(X25519.name(), NamedGroup::X25519);
    }

    /// A low-order peer key (an all-zero shared secret) and a key of the wrong length
    /// are refused as an invalid key share.
    #[test]
    fn x25519_refuses_low_order_and_malformed_keys() {
        let bad = rustls::Error::PeerMisbehaved(rustls::PeerMisbehaved::InvalidKeyShare);
        for peer in [&[0u8; 32][..], &[1u8; 31][..], &[9u8; 33][..]] {
            let r = X25519.start().unwrap().complete(peer);
            assert_eq!(r.err(), Some(bad.clone()), "{peer:?}");
        }
    }

    #[test]
    fn garbage_is_not_a_certificate() {
        assert_eq!(cert_not_after_unix(b""), None);
        assert_eq!(cert_not_after_unix(&[0x30, 0x82, 0xff]), None);
        assert_eq!(cert_not_after_unix(&[0x30, 0x03, 0x02, 0x01, 0x00]), None);
    }
}
