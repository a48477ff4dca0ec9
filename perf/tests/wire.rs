//! imbench's other client wires against an embedded node: wss (TLS around the
//! WebSocket, trusting a CA the test makes, or any certificate), and JSON-RPC in
//! text messages over ws and wss. Each asserts the accounting (every client
//! connected, every expected RECV counted once, no error), never speed.

use std::path::Path;
use std::time::Duration;

use engine::store::FsyncPolicy;
use perf::conn::Transport;
use perf::report::Summary;
use perf::tls::ClientTls;
use perf::{BenchConfig, Scenario, TargetSpec};

/// A CA and a certificate for 127.0.0.1 signed by it, as PEM files in `dir`: the
/// node's certificate and key, and `ca.pem`.
fn make_pki(dir: &Path) -> net::io::TlsConfig {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "imbench test CA");
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let tls = net::io::TlsConfig {
        cert_file: dir.join("cert.pem"),
        key_file: dir.join("key.pem"),
        ..net::io::TlsConfig::default()
    };
    std::fs::write(&tls.cert_file, leaf.pem()).unwrap();
    std::fs::write(&tls.key_file, key.serialize_pem()).unwrap();
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    tls
}

/// An embedded node (with a wss listener when `tls`), clients over WebSocket.
fn config(label: &str, tls: Option<net::io::TlsConfig>) -> BenchConfig {
    let mut load = perf::default_load();
    load.threads = 2;
    load.duration = Duration::from_secs(1);
    // Only a failing run waits this long: the drain ends once every RECV is in.
    load.drain = Duration::from_secs(30);
    load.connect_concurrency = 16;
    load.transport = Transport::WebSocket;
    BenchConfig {
        label: label.into(),
        preset: None,
        target: TargetSpec::Embedded {
            shards: 2,
            fsync: FsyncPolicy::Always,
            tls,
        },
        pid: None,
        load,
        floor: Duration::ZERO,
        out: None,
        set_tokens: true,
    }
}

fn assert_clean(s: &Summary) {
    let table = perf::report::table(s);
    assert!(s.clean(), "accounting not clean:\n{table}");
    assert!(s.drained, "{table}");
    assert_eq!(s.connected, s.clients as u64, "{table}");
    for c in &s.classes {
        assert!(c.sent > 0, "{table}");
        assert_eq!(c.delivered_recvs, c.expected_recvs, "{table}");
        assert_eq!(c.expected_recvs, c.sent, "{table}");
        assert_eq!(c.sendack.count, c.sent, "one answer per SEND: {table}");
    }
}

const PERSON: Scenario = Scenario::Person {
    pairs: 10,
    rate: 200.0,
};

/// A storm and person traffic over wss, the clients trusting only the test's CA,
/// on the io_uring loop and on the epoll loop; the report names the wire.
#[test]
fn wss_clients_trusting_a_ca_connect_and_exchange() {
    let dir = tempfile::tempdir().unwrap();
    let tls = make_pki(dir.path());
    let client = ClientTls::new(Some(&dir.path().join("ca.pem")), None).unwrap();
    for io in [perf::load::IoMode::Uring, perf::load::IoMode::Epoll] {
        let mut cfg = config("wss", Some(tls.clone()));
        cfg.load.tls = Some(client.clone());
        cfg.load.io = io;
        cfg.load.encrypt = true;
        let storm = Scenario::Storm {
            clients: 100,
            concurrency: 16,
            rate: None,
        };
        let (s, _) = perf::run_scenario(&cfg, &storm).unwrap();
        assert_eq!(s.transport, "wss");
        assert_eq!((s.connected, s.connect.count), (100, 100));
        assert_eq!(s.errors_total, 0, "{}", perf::report::table(&s));
        let (s, _) = perf::run_scenario(&cfg, &PERSON).unwrap();
        assert_clean(&s);
    }
}

/// A client that trusts another CA is refused by the handshake: every connect
/// fails and is counted, none connects.
#[test]
fn wss_clients_refuse_a_certificate_they_do_not_trust() {
    let dir = tempfile::tempdir().unwrap();
    let tls = make_pki(&dir.path().join("a").tap_mkdir());
    let other = dir.path().join("b").tap_mkdir();
    make_pki(&other);
    let mut cfg = config("wss-untrusted", Some(tls));
    cfg.load.tls = Some(ClientTls::new(Some(&other.join("ca.pem")), None).unwrap());
    cfg.load.connect_timeout = Duration::from_secs(30);
    let storm = Scenario::Storm {
        clients: 4,
        concurrency: 4,
        rate: None,
    };
    let (s, _) = perf::run_scenario(&cfg, &storm).unwrap();
    assert_eq!(s.connected, 0);
    assert_eq!(s.errors["connect_failed"], 4, "{}", perf::report::table(&s));
}

/// JSON-RPC clients (text messages) over ws, and over wss accepting any
/// certificate: connect, send to a person and to a group, every RECV counted and
/// acknowledged.
#[test]
fn jsonrpc_clients_exchange_over_ws_and_wss() {
    let dir = tempfile::tempdir().unwrap();
    let tls = make_pki(dir.path());
    for wss in [false, true] {
        let mut cfg = config("jsonrpc", Some(tls.clone()));
        cfg.load.jsonrpc = true;
        if wss {
            cfg.load.tls = Some(ClientTls::new(None, None).unwrap());
        }
        let (s, _) = perf::run_scenario(&cfg, &PERSON).unwrap();
        assert_eq!(s.transport, if wss { "wss+jsonrpc" } else { "ws+jsonrpc" });
        assert_clean(&s);
        let group = Scenario::Group {
            members: 6,
            online_share: 1.0,
            groups: 1,
            rate: 50.0,
        };
        let (s, _) = perf::run_scenario(&cfg, &group).unwrap();
        let table = perf::report::table(&s);
        assert!(s.clean() && s.drained, "{table}");
        assert_eq!(
            s.classes[0].expected_recvs,
            5 * s.classes[0].sent,
            "{table}"
        );
        assert_eq!(s.classes[0].delivered_recvs, s.classes[0].expected_recvs);
    }
}

/// JSON-RPC with message encryption, or TLS over plain TCP, is refused before a run.
#[test]
fn impossible_wires_are_refused() {
    let mut cfg = config("bad", None);
    cfg.load.jsonrpc = true;
    cfg.load.encrypt = true;
    let e = perf::run_scenario(&cfg, &PERSON).unwrap_err();
    assert!(e.to_string().contains("--encrypt"), "{e}");
    let mut cfg = config("bad", None);
    cfg.load.transport = Transport::Tcp;
    cfg.load.tls = Some(ClientTls::new(None, None).unwrap());
    let e = perf::run_scenario(&cfg, &PERSON).unwrap_err();
    assert!(e.to_string().contains("WebSocket only"), "{e}");
}

trait TapMkdir {
    fn tap_mkdir(self) -> Self;
}

impl TapMkdir for std::path::PathBuf {
    fn tap_mkdir(self) -> Self {
        std::fs::create_dir_all(&self).unwrap();
        self
    }
}
