//! `imbench group --peer` against tiny in-repo stubs of Redis pub/sub (RESP2:
//! SUBSCRIBE, PUBLISH, PING, `message` pushes) and NATS (INFO, CONNECT, SUB, PUB,
//! MSG, PING/PONG): no Redis or NATS needed. The stubs split every push over two
//! writes at a point drawn from a fixed seed, so the client's decoder meets split
//! reads. The tests assert the accounting (every expected message received once,
//! nothing missing, extra or erroneous), never speed.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use perf::peer::{PeerProto, PeerUrl};
use perf::{BenchConfig, Scenario, TargetSpec};

/// Seed of the split points (printed on failure through the test name).
const SPLIT_SEED: u64 = 0x5eed_f5a1_1711;

type Subs = Arc<Mutex<HashMap<String, Vec<Arc<Mutex<TcpStream>>>>>>;

/// Writes `bytes` in two writes, split at a point drawn from `rng`.
fn split_write(s: &Mutex<TcpStream>, bytes: &[u8], rng: &AtomicU64) {
    let x = rng.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
    let x = (x ^ (x >> 31)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let cut = (x as usize) % (bytes.len() + 1);
    let mut s = s.lock().unwrap();
    let _ = s.write_all(&bytes[..cut]);
    let _ = s.flush();
    let _ = s.write_all(&bytes[cut..]);
}

/// A stub server on 127.0.0.1 serving each connection on a thread of its own.
fn serve(proto: PeerProto) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let subs: Subs = Arc::default();
    let rng = Arc::new(AtomicU64::new(SPLIT_SEED));
    std::thread::spawn(move || {
        for s in listener.incoming().flatten() {
            let _ = s.set_nodelay(true);
            let (subs, rng) = (subs.clone(), rng.clone());
            std::thread::spawn(move || match proto {
                PeerProto::Redis => redis_conn(s, &subs, &rng),
                PeerProto::Nats => nats_conn(s, &subs, &rng),
            });
        }
    });
    addr
}

/// One RESP command (an array of bulk strings), None at the end of the stream.
fn resp_command(r: &mut impl BufRead) -> Option<Vec<Vec<u8>>> {
    let mut line = String::new();
    r.read_line(&mut line).ok().filter(|&n| n > 0)?;
    let n: usize = line.trim_end().strip_prefix('*')?.parse().ok()?;
    let mut args = Vec::new();
    for _ in 0..n {
        line.clear();
        r.read_line(&mut line).ok()?;
        let len: usize = line.trim_end().strip_prefix('$')?.parse().ok()?;
        let mut b = vec![0u8; len + 2];
        r.read_exact(&mut b).ok()?;
        b.truncate(len);
        args.push(b);
    }
    Some(args)
}

fn bulk(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(format!("${}\r\n", b.len()).as_bytes());
    out.extend_from_slice(b);
    out.extend_from_slice(b"\r\n");
}

fn redis_conn(s: TcpStream, subs: &Subs, rng: &AtomicU64) {
    let me = Arc::new(Mutex::new(s.try_clone().unwrap()));
    let mut r = BufReader::new(s);
    while let Some(args) = resp_command(&mut r) {
        let mut out = Vec::new();
        match args[0].to_ascii_uppercase().as_slice() {
            b"SUBSCRIBE" => {
                let ch = String::from_utf8(args[1].clone()).unwrap();
                subs.lock().unwrap().entry(ch).or_default().push(me.clone());
                out.extend_from_slice(b"*3\r\n");
                bulk(&mut out, b"subscribe");
                bulk(&mut out, &args[1]);
                out.extend_from_slice(b":1\r\n");
            }
            b"PUBLISH" => {
                let ch = String::from_utf8(args[1].clone()).unwrap();
                let targets = subs.lock().unwrap().get(&ch).cloned().unwrap_or_default();
                let mut push = b"*3\r\n".to_vec();
                bulk(&mut push, b"message");
                bulk(&mut push, &args[1]);
                bulk(&mut push, &args[2]);
                for t in &targets {
                    split_write(t, &push, rng);
                }
                out.extend_from_slice(format!(":{}\r\n", targets.len()).as_bytes());
            }
            b"PING" => out.extend_from_slice(b"+PONG\r\n"),
            _ => out.extend_from_slice(b"-ERR unknown command\r\n"),
        }
        split_write(&me, &out, rng);
    }
}

fn nats_conn(s: TcpStream, subs: &Subs, rng: &AtomicU64) {
    let me = Arc::new(Mutex::new(s.try_clone().unwrap()));
    split_write(
        &me,
        b"INFO {\"server_id\":\"stub\",\"max_payload\":1048576}\r\n",
        rng,
    );
    // A keep-alive from the server, which the client must answer.
    split_write(&me, b"PING\r\n", rng);
    let mut r = BufReader::new(s);
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line).map_or(true, |n| n == 0) {
            return;
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.first().copied() {
            Some("CONNECT") | Some("PONG") => {}
            Some("PING") => split_write(&me, b"PONG\r\n", rng),
            Some("SUB") => {
                let ch = words[1].to_string();
                subs.lock().unwrap().entry(ch).or_default().push(me.clone());
            }
            Some("PUB") => {
                let n: usize = words[2].parse().unwrap();
                let mut payload = vec![0u8; n + 2];
                r.read_exact(&mut payload).unwrap();
                payload.truncate(n);
                let mut msg = format!("MSG {} 1 {n}\r\n", words[1]).into_bytes();
                msg.extend_from_slice(&payload);
                msg.extend_from_slice(b"\r\n");
                let targets = subs
                    .lock()
                    .unwrap()
                    .get(words[1])
                    .cloned()
                    .unwrap_or_default();
                for t in &targets {
                    split_write(t, &msg, rng);
                }
            }
            _ => split_write(&me, b"-ERR 'Unknown Protocol Operation'\r\n", rng),
        }
    }
}

fn config(url: PeerUrl) -> BenchConfig {
    let mut load = perf::default_load();
    load.threads = 2;
    load.duration = Duration::from_millis(500);
    // Ends as soon as every message is in; only a failing run waits this long.
    load.drain = Duration::from_secs(30);
    load.connect_concurrency = 16;
    BenchConfig {
        label: url.proto.name().into(),
        preset: None,
        target: TargetSpec::Peer(url),
        pid: None,
        load,
        floor: Duration::from_millis(20),
        out: None,
        set_tokens: false,
    }
}

/// Two groups of 6 online members: 5 subscribers and 6 publishers each.
fn run_group(proto: PeerProto) -> perf::report::Summary {
    let url = PeerUrl {
        proto,
        addr: serve(proto),
    };
    let sc = Scenario::Group {
        members: 6,
        online_share: 1.0,
        groups: 2,
        rate: 400.0,
    };
    let (s, _) = perf::run_scenario(&config(url), &sc).unwrap();
    let table = perf::report::table(&s);
    assert!(s.clean(), "seed {SPLIT_SEED:#x}: not clean:\n{table}");
    assert!(s.drained, "{table}");
    assert_eq!(s.clients, 2 * (5 + 6), "{table}");
    let c = &s.classes[0];
    assert!(c.sent > 0, "{table}");
    assert_eq!(c.expected_recvs, c.sent * 5, "{table}");
    assert_eq!(c.delivered_recvs, c.expected_recvs, "{table}");
    assert_eq!(c.recv.count, c.expected_recvs, "one latency per message");
    // The stub runs in this process: found listening on its port.
    let me = format!("pid {} (listening on port", std::process::id());
    assert!(s.server.source.starts_with(&me), "{}", s.server.source);
    s
}

#[test]
fn redis_pubsub_fanout_accounts_for_every_message() {
    let s = run_group(PeerProto::Redis);
    let c = &s.classes[0];
    assert_eq!(c.sendack.count, c.sent, "one PUBLISH reply per publish");
}

#[test]
fn nats_fanout_accounts_for_every_message() {
    let s = run_group(PeerProto::Nats);
    // NATS answers no PUB (verbose off): nothing to time, nothing missing.
    assert_eq!(s.classes[0].sendack.count, 0);
}

/// A server error on one connection fails that connection only, counted.
#[test]
fn a_server_error_is_counted_not_a_panic() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for mut s in listener.incoming().flatten() {
            let _ = s.write_all(b"-ERR no pub/sub here\r\n");
            held.push(s);
        }
    });
    let url = PeerUrl {
        proto: PeerProto::Redis,
        addr,
    };
    let sc = Scenario::Group {
        members: 3,
        online_share: 1.0,
        groups: 1,
        rate: 100.0,
    };
    let mut cfg = config(url);
    cfg.load.drain = Duration::from_millis(100);
    let (s, _) = perf::run_scenario(&cfg, &sc).unwrap();
    assert!(!s.clean());
    assert_eq!(s.connected, 0);
    assert!(
        s.errors_total >= s.clients as u64,
        "{}",
        perf::report::table(&s)
    );
}
