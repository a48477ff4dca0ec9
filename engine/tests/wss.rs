//! `wss://`: the WebSocket listener behind TLS (`[listen] wss_addr`, `[tls]`).
//! Each test makes its own CA and a certificate for 127.0.0.1 it signs (rcgen),
//! written as PEM files; clients trust only that CA. Over wss: a Rust client
//! (rustls) CONNECT/SEND/RECV on both IO drivers, garbage TLS input closing only its
//! own connection, the official JS SDK under Node.js (`NODE_EXTRA_CA_CERTS`), a bad
//! certificate or key refusing the start by name (the configuration and the
//! `imrouter` binary), and SIGHUP to a running `imrouter` with a new certificate:
//! the connection made before keeps working, a new one is served the new one.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::config::Config;
use engine::node::{Node, NodeConfig};
use net::client::{Client, Login};
use serde_json::{json, Value};

#[macro_use]
mod support;

/// Bounds every wait: only a failing test waits this long.
const TIMEOUT: Duration = Duration::from_secs(20);

/// A CA and a certificate for 127.0.0.1 and localhost signed by it, as PEM files in
/// `dir`: `cert.pem` (the certificate, then the CA: a chain), `key.pem`, `ca.pem`.
struct Pki {
    ca: rustls::pki_types::CertificateDer<'static>,
    ca_file: PathBuf,
    tls: net::io::TlsConfig,
}

fn make_pki(dir: &Path, name: &str) -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
    let dir = dir.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, format!("imrouter test CA {name}"));
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let tls = net::io::TlsConfig {
        cert_file: dir.join("cert.pem"),
        key_file: dir.join("key.pem"),
        ..net::io::TlsConfig::default()
    };
    std::fs::write(&tls.cert_file, leaf.pem() + &ca.pem()).unwrap();
    std::fs::write(&tls.key_file, key.serialize_pem()).unwrap();
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, ca.pem()).unwrap();
    Pki {
        ca: ca.der().clone(),
        ca_file,
        tls,
    }
}

/// A client configuration trusting only `ca`.
fn trusting(ca: &rustls::pki_types::CertificateDer<'static>) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).unwrap();
    let provider = Arc::new(net::io::tls::provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(cfg)
}

fn wss_login(addr: SocketAddr, ca: &Arc<rustls::ClientConfig>, uid: &str) -> Client {
    let (client, reason) = Client::connect_wss(
        addr,
        ca.clone(),
        &Login::new(uid, &format!("tok-{uid}")),
        Duration::from_secs(10),
    )
    .unwrap();
    assert_eq!(reason, 1, "CONNACK for {uid}");
    client
}

/// A node with a wss listener on 127.0.0.1 port 0 (beside TCP and ws).
fn wss_node(dir: &Path, pki: &Pki, backend: net::io::Backend) -> Node {
    let mut c: NodeConfig = support::config(dir, backend);
    c.wss_addr = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    c.tls = Some(net::io::TlsServer::load(&pki.tls).unwrap());
    let node = Node::start(c).unwrap();
    for uid in ["u1", "u2", "u3"] {
        support::set_token(&node, uid, 1, 1);
    }
    node
}

/// The value of the series `line_prefix` (name and labels) in `/metrics` text.
fn series(text: &str, line_prefix: &str) -> Option<i64> {
    text.lines()
        .find(|l| l.starts_with(&format!("{line_prefix} ")))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Two Rust clients over wss: a SEND from one is RECVed by the other (and acked),
/// beside a plain TCP client; garbage on a third TCP connection to the wss port
/// closes that one only; `/route` names the wss address; `/metrics` counts.
fn rust_clients_talk_over_wss(backend: net::io::Backend) {
    let dir = tempfile::tempdir().unwrap();
    let pki = make_pki(dir.path(), "ca");
    let node = wss_node(dir.path(), &pki, backend);
    let wss = node.wss_addr().unwrap();
    let ca = trusting(&pki.ca);
    let mut a = wss_login(wss, &ca, "u1");
    let mut b = wss_login(wss, &ca, "u2");
    let mut c = support::login(&node, "u3");
    a.send("u2", 1, 1, "m1", b"over wss", true).unwrap();
    let (seq, _, _, reason) = support::next_sendack(&mut a);
    assert_eq!((seq, reason), (1, 1));
    let m = support::next_recv(&mut b);
    assert_eq!(
        (m.from_uid.as_str(), &m.payload[..]),
        ("u1", &b"over wss"[..])
    );
    assert!(m.msg_key_ok);
    b.recvack(m.message_id, m.message_seq).unwrap();

    // Garbage where a ClientHello belongs: that connection is closed, no one else's.
    let mut bad = std::net::TcpStream::connect(wss).unwrap();
    bad.set_read_timeout(Some(TIMEOUT)).unwrap();
    bad.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut rest = Vec::new();
    let _ = std::io::Read::read_to_end(&mut bad, &mut rest);
    assert_eq!(rest.first(), Some(&0x15), "a TLS alert, then the close");
    b.send("u1", 1, 1, "m2", b"after the garbage", true)
        .unwrap();
    assert_eq!(support::next_sendack(&mut b).3, 1);
    assert_eq!(support::next_recv(&mut a).payload, b"after the garbage");
    c.send("u1", 1, 1, "m3", b"from tcp", true).unwrap();
    assert_eq!(support::next_sendack(&mut c).3, 1);
    assert_eq!(support::next_recv(&mut a).payload, b"from tcp");

    let reply = node.api().handle("GET", "/route?uid=u1", None, b"");
    let route: Value = serde_json::from_str(&reply.body).unwrap();
    assert_eq!(route["wss_addr"], format!("wss://{wss}"), "{route}");
    let text = node.api().handle("GET", "/metrics", None, b"").body;
    assert_eq!(series(&text, "imrouter_tls_handshakes_total"), Some(2));
    assert_eq!(series(&text, "imrouter_tls_failures_total"), Some(1));
    let left = series(&text, "imrouter_tls_cert_expiry_seconds").unwrap();
    assert!(left > 86_400, "rcgen's certificates run for years: {left}");
    drop((a, b, c));
    node.shutdown().unwrap();
}

on_both_drivers!(rust_clients_talk_over_wss);

/// The official JS SDK (`wukongimjssdk`, under Node.js with the `ws` package)
/// connects to `wss://127.0.0.1:PORT` trusting the test CA through
/// `NODE_EXTRA_CA_CERTS`; person messages go both ways.
#[test]
fn js_sdk_over_wss() {
    let interop = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../interop");
    assert!(
        interop.join("node_modules/wukongimjssdk").exists(),
        "the JS SDK is not installed: run scripts/test (it runs `npm ci --prefix interop`)"
    );
    let dir = tempfile::tempdir().unwrap();
    let pki = make_pki(dir.path(), "ca");
    let node = wss_node(dir.path(), &pki, net::io::Backend::Auto);
    let addr = format!("wss://{}", node.wss_addr().unwrap());
    let sdk = |uid: &str| {
        let mut child = Command::new("node")
            .current_dir(&interop)
            .args(["--import", "./register.mjs", "sdk_client.mjs"])
            .env("WS_ADDR", &addr)
            .env("NODE_EXTRA_CA_CERTS", &pki.ca_file)
            .env("UID", uid)
            .env("TOKEN", format!("tok-{uid}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("node (Node.js) must be installed");
        let stdin = child.stdin.take().unwrap();
        let events = support::SdkEvents::read(uid, child.stdout.take().unwrap());
        (ChildGuard(child), stdin, events)
    };
    let (_ga, mut a_in, a) = sdk("u1");
    let (_gb, mut b_in, b) = sdk("u2");
    for e in [&a, &b] {
        e.expect("connected", TIMEOUT, |e| {
            e["event"] == "status" && e["status"] == 1
        });
    }
    let send = |stdin: &mut std::process::ChildStdin, to: &str, text: &str| {
        let cmd = json!({"cmd": "send", "channel_id": to, "channel_type": 1, "text": text});
        writeln!(stdin, "{cmd}").unwrap();
    };
    send(&mut a_in, "u2", "hello over wss");
    let ack = a.expect("sendack", TIMEOUT, |e| e["event"] == "sendack");
    assert_eq!(ack["reason"], 1, "{ack}");
    let m = b.expect("message", TIMEOUT, |e| {
        e["event"] == "message" && e["text"] == "hello over wss"
    });
    assert_eq!(
        (m["from"].as_str(), m["channel_id"].as_str()),
        (Some("u1"), Some("u1"))
    );
    send(&mut b_in, "u1", "and back");
    let m = a.expect("message", TIMEOUT, |e| {
        e["event"] == "message" && e["text"] == "and back"
    });
    assert_eq!(m["from"], "u2");
    let text = node.api().handle("GET", "/metrics", None, b"").body;
    assert_eq!(series(&text, "imrouter_tls_handshakes_total"), Some(2));
    drop((a_in, b_in));
    node.shutdown().unwrap();
}

/// Kills a child process when dropped.
struct ChildGuard(std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `[listen] wss_addr` with `[tls]` files, as TOML.
fn wss_toml(cert: &Path, key: &Path) -> String {
    format!(
        "[listen]\nwss_addr = \"127.0.0.1:0\"\n[tls]\ncert_file = {:?}\nkey_file = {:?}\n",
        cert, key
    )
}

/// A certificate or key that does not load refuses the configuration with the key,
/// the file and the reason; `imrouter` itself exits 2 saying so.
#[test]
fn a_bad_certificate_or_key_refuses_the_start_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let pki = make_pki(dir.path(), "ca");
    let other = make_pki(dir.path(), "other");
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "-----BEGIN CERTIFICATE-----\nnot base64\n").unwrap();
    let missing = dir.path().join("missing.pem");
    let refused = |cert: &Path, key: &Path| -> String {
        let text = wss_toml(cert, key);
        Config::parse(&text, |_| None)
            .unwrap()
            .to_node_config()
            .unwrap_err()
    };
    let (cert, key) = (&pki.tls.cert_file, &pki.tls.key_file);
    let e = refused(&missing, key);
    assert!(
        e.starts_with("tls.cert_file ") && e.contains("missing.pem"),
        "{e}"
    );
    assert!(e.contains("No such file"), "{e}");
    let e = refused(&garbage, key);
    assert!(
        e.contains("tls.cert_file") && e.contains("garbage.pem"),
        "{e}"
    );
    let e = refused(cert, &garbage);
    assert!(
        e.contains("tls.key_file") && e.contains("garbage.pem"),
        "{e}"
    );
    let e = refused(cert, &other.tls.key_file);
    assert!(
        e.contains("tls.key_file") && e.contains("does not belong"),
        "{e}"
    );
    let e = Config::parse("[listen]\nwss_addr = \"127.0.0.1:0\"\n", |_| None)
        .unwrap()
        .to_node_config()
        .unwrap_err();
    assert!(e.contains("needs [tls] cert_file and key_file"), "{e}");
    // The good pair is accepted.
    Config::parse(&wss_toml(cert, key), |_| None)
        .unwrap()
        .to_node_config()
        .unwrap();

    // The binary: exit 2, the file and the reason on stderr, nothing served.
    let file = dir.path().join("node.toml");
    let text = format!(
        "[node]\ndata_dir = {:?}\n{}",
        dir.path().join("data"),
        wss_toml(cert, &other.tls.key_file)
    )
    .replace(
        "[listen]\n",
        "[listen]\ntcp_addr = \"\"\nws_addr = \"\"\napi_addr = \"\"\n",
    );
    std::fs::write(&file, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_imrouter"))
        .arg("--config")
        .arg(&file)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&other.tls.key_file.display().to_string())
            && stderr.contains("does not belong"),
        "{stderr}"
    );
}

/// Polls the node's `/metrics` until `pred` holds for the text (bounded: a failure
/// detector).
fn wait_metrics(api: SocketAddr, what: &str, pred: impl Fn(&str) -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Ok((200, text)) = support::http_get(api, "/metrics") {
            if pred(&text) {
                return;
            }
        }
        assert!(Instant::now() < deadline, "no {what} in /metrics");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGHUP to a running `imrouter` after new certificate files were written: the
/// wss connection made before keeps sending and receiving; a new connection is
/// served the new certificate (a client trusting only the new CA connects, one
/// trusting only the old one is refused).
#[test]
fn sighup_serves_a_new_certificate_and_keeps_connections() {
    let dir = tempfile::tempdir().unwrap();
    let old = make_pki(dir.path(), "old");
    let next = make_pki(dir.path(), "next");
    let ports = support::cluster::free_ports(3);
    let addr = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
    let (tcp, wss, api) = (addr(ports[0]), addr(ports[1]), addr(ports[2]));
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::copy(&old.tls.cert_file, &cert).unwrap();
    std::fs::copy(&old.tls.key_file, &key).unwrap();
    let file = dir.path().join("node.toml");
    let text = format!(
        "[node]\ndata_dir = {:?}\n[listen]\ntcp_addr = \"{tcp}\"\nws_addr = \"\"\n\
         wss_addr = \"{wss}\"\napi_addr = \"{api}\"\n[auth]\ntoken_auth = false\n\
         [runtime]\nshard_count = 2\npin_cores = []\n[tls]\ncert_file = {cert:?}\n\
         key_file = {key:?}\n",
        dir.path().join("data")
    );
    std::fs::write(&file, text).unwrap();
    let log = std::fs::File::create(dir.path().join("node.log")).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_imrouter"))
        .arg("--config")
        .arg(&file)
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let child = ChildGuard(child);
    let (status, body) = support::wait_http(api, "/readyz", 200, TIMEOUT);
    assert_eq!(status, 200, "not ready: {body}");

    let (old_ca, next_ca) = (trusting(&old.ca), trusting(&next.ca));
    let mut before = wss_login(wss, &old_ca, "u1");
    let (mut peer, reason) =
        Client::connect(tcp, &Login::new("u2", "any"), Duration::from_secs(10)).unwrap();
    assert_eq!(reason, 1);

    std::fs::copy(&next.tls.cert_file, &cert).unwrap();
    std::fs::copy(&next.tls.key_file, &key).unwrap();
    // SAFETY: a signal to the child process this test started and still holds.
    let rc = unsafe { libc::kill(child.0.id() as libc::pid_t, libc::SIGHUP) };
    assert_eq!(rc, 0);
    wait_metrics(api, "reload", |t| {
        series(t, "imrouter_tls_reloads_total{result=\"ok\"}") == Some(1)
    });

    // The connection made before works on, both ways.
    before
        .send("u2", 1, 1, "m4", b"before the reload", true)
        .unwrap();
    assert_eq!(support::next_sendack(&mut before).3, 1);
    assert_eq!(support::next_recv(&mut peer).payload, b"before the reload");
    peer.send("u1", 1, 1, "m5", b"to the old connection", true)
        .unwrap();
    assert_eq!(support::next_sendack(&mut peer).3, 1);
    assert_eq!(
        support::next_recv(&mut before).payload,
        b"to the old connection"
    );

    // New connections see the new certificate.
    let mut after = wss_login(wss, &next_ca, "u3");
    after
        .send("u1", 1, 1, "m6", b"from a new connection", true)
        .unwrap();
    assert_eq!(support::next_sendack(&mut after).3, 1);
    assert_eq!(
        support::next_recv(&mut before).payload,
        b"from a new connection"
    );
    let refused = Client::connect_wss(wss, old_ca, &Login::new("u4", "any"), TIMEOUT);
    let e = refused
        .err()
        .expect("the old CA does not verify the new certificate");
    assert!(e.to_string().contains("certificate"), "{e}");

    // A reload whose files do not load keeps the certificate, and says so.
    std::fs::write(&key, "not a key").unwrap();
    // SAFETY: as above.
    let rc = unsafe { libc::kill(child.0.id() as libc::pid_t, libc::SIGHUP) };
    assert_eq!(rc, 0);
    wait_metrics(api, "failed reload", |t| {
        series(t, "imrouter_tls_reloads_total{result=\"failed\"}") == Some(1)
    });
    wss_login(wss, &next_ca, "u5");
    let log = std::fs::read_to_string(dir.path().join("node.log")).unwrap();
    assert!(
        log.contains("SIGHUP: TLS certificate not reloaded") && log.contains("key.pem"),
        "{log}"
    );
    drop((before, peer, after));
}
