//! What one `wss://` handshake costs the shard that accepts it: the server side of
//! TLS handshakes (rustls, ring; an ECDSA P-256 certificate as `rcgen` and the
//! README's quick start make) run in memory, timed per step, beside the key
//! agreement every wkproto CONNECT already costs (`proto::crypto::server_handshake`).
//! `cargo run --release -p net --example tls_handshake_cost [N] [ring_default]`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

fn main() {
    let n: u32 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2000);
    let cert = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
    let chain = vec![CertificateDer::from(cert.cert.der().to_vec())];
    let key = PrivateKeyDer::from_pem_slice(cert.signing_key.serialize_pem().as_bytes()).unwrap();
    // The node's provider (X25519 first), on both sides; `ring_default` measures
    // ring's own order (P-384 first) instead.
    let provider = Arc::new(if std::env::args().any(|a| a == "ring_default") {
        #[allow(deprecated)]
        rustls::crypto::ring::default_provider()
    } else {
        net::io::tls::provider()
    });
    let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain.clone(), key)
        .unwrap();
    server.alpn_protocols = vec![b"http/1.1".to_vec()];
    server.send_tls13_tickets = 0;
    let server = Arc::new(server);
    let mut roots = rustls::RootCertStore::empty();
    roots.add(chain[0].clone()).unwrap();
    let client = Arc::new(
        rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    );
    let (mut hello, mut finished, mut client_side) =
        (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    for _ in 0..n {
        let mut c = rustls::ClientConnection::new(
            client.clone(),
            ServerName::try_from("127.0.0.1").unwrap(),
        )
        .unwrap();
        let mut s = rustls::ServerConnection::new(server.clone()).unwrap();
        let mut buf = Vec::new();
        for step in 0..2 {
            buf.clear();
            while c.wants_write() {
                c.write_tls(&mut buf).unwrap();
            }
            let t = Instant::now();
            s.read_tls(&mut &buf[..]).unwrap();
            s.process_new_packets().unwrap();
            let mut out = Vec::new();
            while s.wants_write() {
                s.write_tls(&mut out).unwrap();
            }
            if step == 0 {
                hello += t.elapsed()
            } else {
                finished += t.elapsed()
            }
            let t = Instant::now();
            c.read_tls(&mut &out[..]).unwrap();
            c.process_new_packets().unwrap();
            client_side += t.elapsed();
        }
        assert!(!s.is_handshaking() && !c.is_handshaking());
    }
    let t = Instant::now();
    for i in 0..n {
        let key = proto::crypto::ClientKey::new([i as u8 | 1; 32]);
        let h = proto::crypto::server_handshake(key.client_key(), [7; 32], [9; 16]).unwrap();
        std::hint::black_box(h);
    }
    let connect = t.elapsed();
    let us = |d: Duration| d.as_secs_f64() * 1e6 / f64::from(n);
    println!(
        "TLS handshake, server side, per connection ({n} runs): ClientHello {:.1} us + Finished {:.1} us = {:.1} us",
        us(hello),
        us(finished),
        us(hello + finished)
    );
    println!(
        "the client's side of the same handshakes (certificate chain and signature checked): {:.1} us",
        us(client_side)
    );
    println!(
        "wkproto CONNECT key agreement (proto::crypto::server_handshake, client key encoding included): {:.1} us",
        us(connect)
    );
}
