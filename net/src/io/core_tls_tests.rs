//! The core's TLS layer driven by hand: a rustls client in memory on one side, the
//! core's queues on the other (no sockets, no clock).

use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore};

use super::*;

/// A CA and a certificate for `localhost` it signed, written as PEM files.
pub(crate) struct TestPki {
    pub(crate) ca: CertificateDer<'static>,
    pub(crate) dir: PathBuf,
    pub(crate) config: crate::io::TlsConfig,
}

impl Drop for TestPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(crate) fn test_pki(name: &str) -> TestPki {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let dir = std::env::temp_dir().join(format!("net-tls-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cert_file, key_file) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert_file, leaf.pem() + &ca.pem()).unwrap();
    std::fs::write(&key_file, key.serialize_pem()).unwrap();
    TestPki {
        ca: ca.der().clone(),
        dir,
        config: crate::io::TlsConfig {
            cert_file,
            key_file,
            ..crate::io::TlsConfig::default()
        },
    }
}

pub(crate) fn client(ca: &CertificateDer<'static>) -> ClientConnection {
    let mut roots = RootCertStore::empty();
    roots.add(ca.clone()).unwrap();
    let provider = Arc::new(crate::io::tls::provider());
    let mut cfg = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    ClientConnection::new(Arc::new(cfg), ServerName::try_from("localhost").unwrap()).unwrap()
}

const WSS: usize = 0;
const TCP: usize = 1;

fn core_with(server: TlsServer, cfg: NetConfig) -> Core {
    let mut c = Core::new(&cfg, 0);
    assert_eq!(c.add_listener_tls(Transport::WebSocket, Some(server)), WSS);
    assert_eq!(c.add_listener(Transport::Tcp), TCP);
    c
}

fn peer() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9))
}

/// Writes what the core queued for `idx` into the client (as a backend would).
fn to_client(c: &mut Core, idx: u32, client: &mut ClientConnection) -> bool {
    let mut dirty = Vec::new();
    c.take_dirty(&mut dirty);
    let mut moved = false;
    loop {
        let chunk = c.out_chunk(idx).to_vec();
        if chunk.is_empty() {
            c.after_flush(idx);
            return moved;
        }
        c.out_advance(idx, chunk.len());
        let mut rd = &chunk[..];
        while !rd.is_empty() {
            client.read_tls(&mut rd).unwrap();
            client.process_new_packets().unwrap();
        }
        moved = true;
    }
}

/// Moves bytes both ways until neither side has any (one `advance` per round: a
/// poll).
fn pump(c: &mut Core, idx: u32, client: &mut ClientConnection, now: &mut u64) {
    loop {
        let mut up = Vec::new();
        while client.wants_write() {
            client.write_tls(&mut up).unwrap();
        }
        if !up.is_empty() {
            c.on_recv(idx, &up);
        }
        *now += 1;
        c.advance(*now);
        let down = to_client(c, idx, client);
        if up.is_empty() && !down && c.tls_deferred.is_empty() {
            return;
        }
    }
}

fn client_plain(client: &mut ClientConnection) -> Vec<u8> {
    let mut got = Vec::new();
    let _ = client.reader().read_to_end(&mut got);
    got
}

const WS_UPGRADE: &[u8] = b"GET / HTTP/1.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
                            Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
                            Sec-WebSocket-Version: 13\r\n\r\n";

/// A wss connection after the TLS handshake and the upgrade.
fn wss_open(c: &mut Core, pki: &TestPki, now: &mut u64) -> (u32, ClientConnection) {
    let idx = c.alloc(WSS, peer()).unwrap();
    let mut cl = client(&pki.ca);
    pump(c, idx, &mut cl, now);
    assert!(!cl.is_handshaking(), "the TLS handshake completed");
    assert_eq!(cl.alpn_protocol(), Some(&b"http/1.1"[..]));
    cl.writer().write_all(WS_UPGRADE).unwrap();
    pump(c, idx, &mut cl, now);
    let answer = client_plain(&mut cl);
    assert!(
        answer.starts_with(b"HTTP/1.1 101"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    (idx, cl)
}

#[test]
fn a_wss_connection_carries_websocket_messages_both_ways() {
    let pki = test_pki("both-ways");
    let server = TlsServer::load(&pki.config).unwrap();
    let mut c = core_with(server.clone(), NetConfig::default());
    let mut now = 0;
    let (idx, mut cl) = wss_open(&mut c, &pki, &mut now);
    let id = c.id(idx);
    let mut ev = Vec::new();
    c.take_events(&mut ev);
    assert_eq!(
        ev,
        vec![NetEvent::Accepted {
            conn: id,
            listener: Transport::WebSocket,
            peer: peer()
        }],
        "the handler sees a WebSocket connection, after the upgrade"
    );
    // Client → node: a masked binary message arrives as plain input.
    let mut frame = Vec::new();
    ws::write_masked_binary(&mut frame, b"CONNECT bytes", [1, 2, 3, 4]);
    cl.writer().write_all(&frame).unwrap();
    pump(&mut c, idx, &mut cl, &mut now);
    assert_eq!(c.input(id), b"CONNECT bytes");
    // Node → client: one binary message, sealed.
    c.send(id, b"CONNACK").unwrap();
    assert_eq!(c.outbound_bytes(id), 2 + 7, "plaintext counts in the queue");
    pump(&mut c, idx, &mut cl, &mut now);
    assert_eq!(client_plain(&mut cl), b"\x82\x07CONNACK");
    assert_eq!(c.outbound_total(), 0);
    assert_eq!(c.stats.tls_handshakes, 1);
    assert_eq!(
        server
            .counters()
            .handshakes
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    // A graceful close: a WebSocket close frame, then close_notify.
    c.close(id);
    pump(&mut c, idx, &mut cl, &mut now);
    assert_eq!(client_plain(&mut cl), b"\x88\x02\x03\xe8");
    let mut probe = [0u8; 1];
    assert_eq!(
        cl.reader().read(&mut probe).unwrap(),
        0,
        "close_notify received"
    );
    assert_eq!(c.phase(idx), Phase::Lingering);
}

#[test]
fn garbage_records_close_only_their_own_connection() {
    let pki = test_pki("garbage");
    let server = TlsServer::load(&pki.config).unwrap();
    let mut c = core_with(server.clone(), NetConfig::default());
    let mut now = 0;
    let (good, mut cl) = wss_open(&mut c, &pki, &mut now);
    let tcp = c.alloc(TCP, peer()).unwrap();
    let bad = c.alloc(WSS, peer()).unwrap();
    c.on_recv(bad, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!(c.phase(bad), Phase::Flushing, "closing after its alert");
    assert!(!c.out_chunk(bad).is_empty(), "a TLS alert is queued");
    // Garbage in the middle of an established session.
    let late = {
        let (i, _cl2) = wss_open(&mut c, &pki, &mut now);
        i
    };
    c.on_recv(late, &[0x17, 0x03, 0x03, 0x00, 0x05, 1, 2, 3, 4, 5]);
    let mut ev = Vec::new();
    c.take_events(&mut ev);
    assert!(ev.contains(&NetEvent::Closed {
        conn: c.id(late),
        reason: CloseReason::Tls
    }));
    assert_eq!(c.stats.tls_failures, 2);
    assert_eq!(
        server
            .counters()
            .failures
            .load(std::sync::atomic::Ordering::Relaxed),
        2
    );
    // The others work on.
    c.send(c.id(good), b"still here").unwrap();
    pump(&mut c, good, &mut cl, &mut now);
    assert_eq!(client_plain(&mut cl), b"\x82\x0astill here");
    assert_eq!(c.phase(tcp), Phase::Open);
}

#[test]
fn handshakes_past_the_polls_budget_wait_for_the_next_poll() {
    let mut pki = test_pki("budget");
    pki.config.handshakes_per_poll_max = 1;
    let server = TlsServer::load(&pki.config).unwrap();
    let mut c = core_with(server, NetConfig::default());
    let (a, b) = (c.alloc(WSS, peer()).unwrap(), c.alloc(WSS, peer()).unwrap());
    let (mut ca, mut cb) = (client(&pki.ca), client(&pki.ca));
    let hello = |cl: &mut ClientConnection| {
        let mut up = Vec::new();
        cl.write_tls(&mut up).unwrap();
        up
    };
    // One poll: both ClientHellos arrive, then the poll's `advance`.
    c.advance(1);
    c.on_recv(a, &hello(&mut ca));
    c.on_recv(b, &hello(&mut cb));
    c.advance(2);
    // Its budget answered a; b waits, and the driver must not block.
    let mut dirty = Vec::new();
    c.take_dirty(&mut dirty);
    assert_eq!(dirty, vec![a]);
    assert_eq!(c.next_deadline_ms(), Some(2), "the next poll comes at once");
    c.advance(3);
    c.take_dirty(&mut dirty);
    assert_eq!(dirty, vec![b], "answered by the next poll");
    assert!(c.tls_deferred.is_empty());
    // Over handshake_bytes_max while waiting: closed.
    let mut pki2 = test_pki("budget-bytes");
    pki2.config.handshakes_per_poll_max = 1;
    pki2.config.handshake_bytes_max = 100;
    let mut c = core_with(TlsServer::load(&pki2.config).unwrap(), NetConfig::default());
    let (a, b) = (c.alloc(WSS, peer()).unwrap(), c.alloc(WSS, peer()).unwrap());
    c.on_recv(a, &hello(&mut client(&pki2.ca)));
    c.on_recv(b, &hello(&mut client(&pki2.ca)));
    assert_eq!(c.phase(b), Phase::Flushing);
    assert_eq!(c.stats.tls_failures, 1);
}

#[test]
fn a_reload_serves_the_new_certificate_to_new_connections_only() {
    let pki = test_pki("reload");
    let server = TlsServer::load(&pki.config).unwrap();
    let mut c = core_with(server.clone(), NetConfig::default());
    let mut now = 0;
    let (old, mut old_client) = wss_open(&mut c, &pki, &mut now);
    // New files at the same paths, from another CA.
    let next = test_pki("reload-next");
    std::fs::copy(&next.config.cert_file, &pki.config.cert_file).unwrap();
    std::fs::copy(&next.config.key_file, &pki.config.key_file).unwrap();
    server.reload().unwrap();
    // The old session goes on.
    c.send(c.id(old), b"old").unwrap();
    pump(&mut c, old, &mut old_client, &mut now);
    assert_eq!(client_plain(&mut old_client), b"\x82\x03old");
    // A new one is served the new certificate: the new CA verifies it, the old not.
    let (_, fresh) = wss_open(&mut c, &next, &mut now);
    let presented = fresh.peer_certificates().unwrap()[0].clone();
    let want = std::fs::read(&next.config.cert_file).unwrap();
    let want: Vec<_> = CertificateDer::pem_slice_iter(&want)
        .map(Result::unwrap)
        .collect();
    assert_eq!(presented, want[0]);
    // A reload that fails keeps what is served.
    std::fs::write(&pki.config.key_file, b"not a key").unwrap();
    let e = server.reload().unwrap_err();
    assert!(e.to_string().contains("key_file"), "{e}");
    assert!(e.to_string().contains("key.pem"), "{e}");
    let (_, again) = wss_open(&mut c, &next, &mut now);
    assert_eq!(again.peer_certificates().unwrap()[0], want[0]);
}

#[test]
fn bad_files_are_refused_by_name_and_reason() {
    let pki = test_pki("bad-files");
    let mut cfg = pki.config.clone();
    cfg.cert_file = pki.dir.join("missing.pem");
    let e = TlsServer::load(&cfg).unwrap_err().to_string();
    assert!(e.starts_with("tls.cert_file "), "{e}");
    assert!(e.contains("missing.pem"), "{e}");
    let garbage = pki.dir.join("garbage.pem");
    std::fs::write(&garbage, b"hello").unwrap();
    let mut cfg = pki.config.clone();
    cfg.cert_file = garbage.clone();
    let e = TlsServer::load(&cfg).unwrap_err().to_string();
    assert!(e.contains("no CERTIFICATE"), "{e}");
    let mut cfg = pki.config.clone();
    cfg.key_file = garbage;
    let e = TlsServer::load(&cfg).unwrap_err().to_string();
    assert!(
        e.starts_with("tls.key_file ") && e.contains("no PRIVATE KEY"),
        "{e}"
    );
    // Another certificate's key.
    let other = test_pki("bad-files-other");
    let mut cfg = pki.config.clone();
    cfg.key_file = other.config.key_file.clone();
    let e = TlsServer::load(&cfg).unwrap_err().to_string();
    assert!(e.contains("does not belong"), "{e}");
    // The good pair loads, and its expiry is read.
    let ok = TlsServer::load(&pki.config).unwrap();
    assert!(
        ok.not_after_unix() > 1_700_000_000,
        "{}",
        ok.not_after_unix()
    );
}

#[test]
fn the_output_budget_stays_exact_with_tls_connections() {
    let pki = test_pki("budget-exact");
    let server = TlsServer::load(&pki.config).unwrap();
    let mut c = core_with(
        server,
        NetConfig {
            outbound_queue_bytes_max: 3_000,
            outbound_budget_bytes_per_shard: 8_000,
            ..NetConfig::default()
        },
    );
    let mut now = 0;
    let (a, mut ca) = wss_open(&mut c, &pki, &mut now);
    let (b, _cb) = wss_open(&mut c, &pki, &mut now);
    let sum = |c: &Core| -> usize {
        c.conns
            .iter()
            .filter(|x| x.in_use && x.phase != Phase::Dead)
            .map(Conn::out_len)
            .sum()
    };
    for i in 0..20 {
        let _ = c.send(c.id(a), &vec![7; 100 + i * 37]);
        let _ = c.send(c.id(b), &vec![8; 900]);
        let mut dirty = Vec::new();
        c.take_dirty(&mut dirty);
        assert_eq!(c.outbound_total(), sum(&c), "round {i}");
        if i % 3 == 0 {
            to_client(&mut c, a, &mut ca);
            assert_eq!(c.outbound_total(), sum(&c), "round {i} after writing");
        }
    }
    assert!(c.stats.slow_reader_closes + c.stats.outbound_overflow_closes > 0);
}
