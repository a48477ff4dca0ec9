//! A connect storm over `ws://` and `wss://` in one window: starts a node in-process
//! (2 shards, token authentication off, a test CA's ECDSA P-256 certificate), then
//! `rounds` times opens `n` connections over ws and `n` over wss from `threads`
//! blocking client threads (all kept open until the round ends), timing each from
//! the TCP connect to the CONNACK (the TLS handshake and the upgrade included).
//! Rounds alternate ws and wss so both see the same machine.
//!
//! A rough figure, not the 10,000-client storm: the clients run on the same
//! cores as the node (their own TLS costs compete with the node's), at most
//! `threads` connect at once, and `n` is bounded by the descriptor limit (each
//! connection holds two descriptors).
//!
//! `cargo run --release -p engine --example wss_storm -- [n] [threads] [rounds]`

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::node::{Node, NodeConfig};
use net::client::{Client, Login, Transport};

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Opens `n` connections from `threads` threads; gives each one's CONNACK time.
fn storm(
    n: usize,
    threads: usize,
    connect: Arc<dyn Fn(usize) -> Client + Send + Sync>,
) -> Vec<Duration> {
    let per = n.div_ceil(threads);
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let connect = connect.clone();
            std::thread::spawn(move || {
                let mut kept = Vec::with_capacity(per);
                let mut times = Vec::with_capacity(per);
                for i in t * per..((t + 1) * per).min(n) {
                    let start = Instant::now();
                    kept.push(connect(i));
                    times.push(start.elapsed());
                }
                (times, kept)
            })
        })
        .collect();
    let mut all = Vec::with_capacity(n);
    let mut open = Vec::new();
    for h in handles {
        let (times, kept) = h.join().unwrap();
        all.extend(times);
        open.push(kept);
    }
    drop(open);
    all.sort();
    all
}

fn main() {
    let mut args = std::env::args()
        .skip(1)
        .map(|a| a.parse::<usize>().unwrap());
    let n = args.next().unwrap_or(4000);
    let threads = args.next().unwrap_or(64);
    let rounds = args.next().unwrap_or(2);

    let dir = tempfile::tempdir().unwrap();
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let tls = net::io::TlsConfig {
        cert_file: dir.path().join("cert.pem"),
        key_file: dir.path().join("key.pem"),
        ..net::io::TlsConfig::default()
    };
    std::fs::write(&tls.cert_file, leaf.pem()).unwrap();
    std::fs::write(&tls.key_file, key.serialize_pem()).unwrap();

    let mut c = NodeConfig {
        data_dir: dir.path().join("data"),
        tcp_addr: None,
        ws_addr: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        wss_addr: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        tls: Some(net::io::TlsServer::load(&tls).unwrap()),
        token_auth: false,
        ..NodeConfig::default()
    };
    c.api.addr = None;
    c.runtime.shard_count = 2;
    c.runtime.pin_cores = Vec::new();
    c.session.sends_per_uid_per_s = 0;
    let node = Node::start(c).unwrap();
    let (ws, wss) = (node.ws_addr().unwrap(), node.wss_addr().unwrap());

    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der().clone()).unwrap();
    let client_tls = Arc::new(
        rustls::ClientConfig::builder_with_provider(Arc::new(net::io::tls::provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    );
    let timeout = Duration::from_secs(30);
    let over_ws: Arc<dyn Fn(usize) -> Client + Send + Sync> = Arc::new(move |i| {
        let login = Login::new(&format!("ws{i}"), "t");
        let (c, reason) = Client::connect_via(Transport::WebSocket, ws, &login, timeout).unwrap();
        assert_eq!(reason, 1);
        c
    });
    let over_wss: Arc<dyn Fn(usize) -> Client + Send + Sync> = Arc::new(move |i| {
        let login = Login::new(&format!("wss{i}"), "t");
        let (c, reason) = Client::connect_wss(wss, client_tls.clone(), &login, timeout).unwrap();
        assert_eq!(reason, 1);
        c
    });
    println!("{n} connections per round, {threads} client threads, 2 shards");
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    for round in 0..rounds {
        let a = storm(n, threads, over_ws.clone());
        let b = storm(n, threads, over_wss.clone());
        let (a50, a99, b50, b99) = (
            percentile(&a, 0.5),
            percentile(&a, 0.99),
            percentile(&b, 0.5),
            percentile(&b, 0.99),
        );
        println!(
            "round {round}: ws CONNACK p50 {:.0} us p99 {:.0} us | wss p50 {:.0} us p99 {:.0} us | wss/ws p99 {:.2}",
            us(a50),
            us(a99),
            us(b50),
            us(b99),
            b99.as_secs_f64() / a99.as_secs_f64()
        );
    }
    node.shutdown().unwrap();
}
