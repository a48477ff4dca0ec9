//! A first SEND→RECV latency figure with real clients on loopback: starts a node
//! in-process (2 shards), logs two clients in over TCP, and times `n` one-at-a-time
//! person messages from the SEND write to the RECV read (NoEncrypt, 64 B), plus the
//! loopback TCP echo floor measured the same way.
//!
//! `cargo run --release -p engine --example send_recv_latency -- [n]`

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use engine::node::{Node, NodeConfig};
use net::client::{Client, Login, Received};

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn report(name: &str, mut v: Vec<Duration>) {
    v.sort();
    println!(
        "{name:>22}: n={} p50={:.1}us p90={:.1}us p99={:.1}us max={:.1}us",
        v.len(),
        percentile(&v, 0.50).as_secs_f64() * 1e6,
        percentile(&v, 0.90).as_secs_f64() * 1e6,
        percentile(&v, 0.99).as_secs_f64() * 1e6,
        v.last().unwrap().as_secs_f64() * 1e6
    );
}

fn floor(n: usize) -> Vec<Duration> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_nodelay(true).unwrap();
        let mut buf = [0u8; 64];
        while s.read_exact(&mut buf).is_ok() {
            s.write_all(&buf).unwrap();
        }
    });
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_nodelay(true).unwrap();
    let mut buf = [0u8; 64];
    (0..n)
        .map(|_| {
            let t = Instant::now();
            c.write_all(&buf).unwrap();
            c.read_exact(&mut buf).unwrap();
            t.elapsed()
        })
        .collect()
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(20_000);
    let dir = std::env::temp_dir().join(format!("imrouter-latency-{}", std::process::id()));
    let mut c = NodeConfig {
        data_dir: dir.clone(),
        tcp_addr: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        ws_addr: None,
        token_auth: false,
        ..NodeConfig::default()
    };
    c.api.addr = None;
    c.runtime.shard_count = 2;
    let node = Node::start(c).expect("start node");
    let addr = node.tcp_addr().unwrap();
    let t = Duration::from_secs(5);
    let (mut a, ra) = Client::connect(addr, &Login::new("lat-a", "x"), t).unwrap();
    let (mut b, rb) = Client::connect(addr, &Login::new("lat-b", "x"), t).unwrap();
    assert_eq!((ra, rb), (1, 1));
    let payload = [b'x'; 64];
    let mut send_recv = Vec::with_capacity(n);
    let mut send_ack = Vec::with_capacity(n);
    for i in 0..n + 1000 {
        let start = Instant::now();
        a.send("lat-b", 1, i as u32, "", &payload, false).unwrap();
        let recv = loop {
            if let Received::Recv(m) = b.read().unwrap() {
                break m;
            }
        };
        let got = start.elapsed();
        let acked = loop {
            if let Received::Sendack { .. } = a.read().unwrap() {
                break start.elapsed();
            }
        };
        b.recvack(recv.message_id, recv.message_seq).unwrap();
        if i >= 1000 {
            // the first 1000 warm up
            send_recv.push(got);
            send_ack.push(acked);
        }
    }
    report("loopback echo floor", floor(n));
    report("SEND->RECV", send_recv);
    report("SEND->SENDACK (after)", send_ack);
    node.shutdown().unwrap();
    let _ = std::fs::remove_dir_all(dir);
}
