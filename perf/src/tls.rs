//! The client side of `wss://` for imbench's connections: a rustls configuration
//! (ring provider, the node's key exchange order, ALPN `http/1.1`) trusting a CA
//! file, or, for a node on loopback only, any certificate (`--tls-insecure`: the
//! handshake's signatures are still checked, the certificate's chain and name are
//! not). Session resumption is off: every client of a storm is a device of its own
//! and pays a full handshake, as a real storm's clients would.
//!
//! The connection itself stays sans-IO ([`TlsLayer`]): ciphertext read by the owner's
//! loop (epoll or io_uring) goes in, plaintext comes out; plaintext queued goes in,
//! records to write come out. Every buffer has a limit.

use std::io::{self, Read, Write};
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, ClientConnection, DigitallySignedStruct, SignatureScheme};

/// Plaintext one connection may have queued for sealing before the handshake
/// completes (the WebSocket upgrade and a CONNECT are far below it).
pub const PLAINTEXT_PENDING_MAX_BYTES: usize = 64 * 1024;

/// Where a client's TLS trust comes from.
#[derive(Clone, Debug)]
pub struct ClientTls {
    pub config: Arc<ClientConfig>,
    /// The name checked against the certificate; `None`: the address's IP.
    pub server_name: Option<ServerName<'static>>,
}

impl ClientTls {
    /// Trusts the CA certificates of the PEM file `ca` (`None`: any certificate; for
    /// a node on loopback only). `server_name` overrides the address's IP.
    pub fn new(ca: Option<&Path>, server_name: Option<&str>) -> io::Result<ClientTls> {
        let provider = Arc::new(net::io::tls::provider());
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(io::Error::other)?;
        let mut config = match ca {
            Some(path) => {
                let pem = std::fs::read(path)
                    .map_err(|e| io::Error::other(format!("--ca {}: {e}", path.display())))?;
                let mut roots = rustls::RootCertStore::empty();
                for cert in rustls::pki_types::pem::PemObject::pem_slice_iter(&pem) {
                    let cert: CertificateDer<'static> = cert
                        .map_err(|e| io::Error::other(format!("--ca {}: {e}", path.display())))?;
                    roots
                        .add(cert)
                        .map_err(|e| io::Error::other(format!("--ca {}: {e}", path.display())))?;
                }
                if roots.is_empty() {
                    return Err(io::Error::other(format!(
                        "--ca {}: no CERTIFICATE in the file",
                        path.display()
                    )));
                }
                builder.with_root_certificates(roots).with_no_client_auth()
            }
            None => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
                .with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        config.resumption = rustls::client::Resumption::disabled();
        let server_name = server_name
            .map(|n| {
                ServerName::try_from(n.to_string())
                    .map_err(|e| io::Error::other(format!("--tls-name {n}: {e}")))
            })
            .transpose()?;
        Ok(ClientTls {
            config: Arc::new(config),
            server_name,
        })
    }

    /// A connection's TLS layer for a node at `ip`.
    pub fn layer(&self, ip: IpAddr) -> io::Result<TlsLayer> {
        let name = self
            .server_name
            .clone()
            .unwrap_or(ServerName::IpAddress(ip.into()));
        let mut conn =
            ClientConnection::new(self.config.clone(), name).map_err(io::Error::other)?;
        conn.set_buffer_limit(Some(PLAINTEXT_PENDING_MAX_BYTES));
        Ok(TlsLayer {
            conn,
            out: Vec::new(),
            out_off: 0,
        })
    }
}

/// Accepts any certificate (`--tls-insecure`); the handshake's signatures are still
/// verified with the provider's algorithms.
#[derive(Debug)]
struct AnyCertificate(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// One connection's TLS, sans-IO: [`TlsLayer::open`] takes what the socket gave,
/// [`TlsLayer::seal`] what the connection queued; [`TlsLayer::out`] holds the
/// records to write.
pub struct TlsLayer {
    conn: ClientConnection,
    /// Records (and handshake messages) not yet written, from `out_off` on.
    pub out: Vec<u8>,
    pub out_off: usize,
}

/// What [`TlsLayer::open`] found besides plaintext.
#[derive(Debug, PartialEq, Eq)]
pub enum Opened {
    Open,
    /// The node sent close_notify.
    Closed,
}

impl TlsLayer {
    /// Decrypts `data` (as read from the socket) and appends the plaintext to
    /// `plain`, at most `plain_max` bytes in all; queues any handshake answer.
    pub fn open(
        &mut self,
        mut data: &[u8],
        plain: &mut Vec<u8>,
        plain_max: usize,
    ) -> Result<Opened, String> {
        let mut closed = false;
        while !data.is_empty() {
            self.conn
                .read_tls(&mut data)
                .map_err(|e| format!("TLS: {e}"))?;
            let state = self
                .conn
                .process_new_packets()
                .map_err(|e| format!("TLS: {e}"))?;
            let n = state.plaintext_bytes_to_read();
            closed |= state.peer_has_closed();
            if n > 0 {
                if plain.len() + n > plain_max {
                    return Err("TLS: plaintext past the receive buffer's limit".into());
                }
                let start = plain.len();
                plain.resize(start + n, 0);
                self.conn
                    .reader()
                    .read_exact(&mut plain[start..])
                    .map_err(|e| format!("TLS: {e}"))?;
            }
        }
        self.drain_records();
        Ok(if closed { Opened::Closed } else { Opened::Open })
    }

    /// Seals `plain` (emptied) into records; before the handshake completes it waits
    /// inside rustls, at most [`PLAINTEXT_PENDING_MAX_BYTES`].
    pub fn seal(&mut self, plain: &mut Vec<u8>) -> Result<(), String> {
        if !plain.is_empty() {
            self.conn
                .writer()
                .write_all(plain)
                .map_err(|e| format!("TLS: plaintext not sealed: {e}"))?;
            plain.clear();
        }
        self.drain_records();
        Ok(())
    }

    /// Bytes waiting to be written.
    pub fn pending(&self) -> usize {
        self.out.len() - self.out_off
    }

    fn drain_records(&mut self) {
        if self.out_off == self.out.len() {
            self.out.clear();
            self.out_off = 0;
        }
        while self.conn.wants_write() {
            // Writing into a Vec cannot fail.
            if self.conn.write_tls(&mut self.out).is_err() {
                break;
            }
        }
    }
}
