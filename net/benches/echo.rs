//! Echo round trip of a 64 B message on loopback: a one-shard runtime (pinned to
//! core 0) whose handler echoes, driven by the io_uring or the mio backend, and one
//! blocking client pinned to core 1. The floor is a plain blocking std TCP echo
//! thread on the same cores.
//!
//! Besides criterion's estimate, each variant prints p50/p99/p999 of
//! `PERCENTILE_ROUND_TRIPS` individually timed round trips.
//!
//! `cargo bench -p net --bench echo -- --warm-up-time 1 --measurement-time 3`

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use net::io::{bind_reuseport, Backend, NetConfig, NetDriver, NetEvent, Transport};
use shard::runtime::{Context, Handler, Runtime, RuntimeConfig, ShardInit};
use slots::ShardId;

const MESSAGE_BYTES: usize = 64;
const PERCENTILE_ROUND_TRIPS: usize = 20_000;
const SERVER_CORE: usize = 0;
const CLIENT_CORE: usize = 1;

struct Echo;

impl Handler for Echo {
    type Msg = ();
    type Timer = ();
    type Driver = NetDriver;

    fn on_message(&mut self, _: &mut Context<(), ()>, _: &mut NetDriver, _: ShardId, _: ()) {}

    fn on_io(&mut self, _: &mut Context<(), ()>, driver: &mut NetDriver, event: NetEvent) {
        if let NetEvent::Readable { conn } = event {
            let mut buf = [0u8; 4096];
            let input = driver.input(conn);
            let n = input.len().min(buf.len());
            buf[..n].copy_from_slice(&input[..n]);
            driver.consume(conn, n);
            let _ = driver.send(conn, &buf[..n]);
        }
    }
}

fn pin_current(core: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes inside it and
    // sched_setaffinity only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn start_node(backend: Backend) -> (Runtime<Echo>, SocketAddr) {
    let listener = bind_reuseport("127.0.0.1:0".parse().unwrap(), 128).unwrap();
    let addr = listener.local_addr().unwrap();
    let listener = Mutex::new(Some(listener));
    let config = NetConfig {
        backend,
        ..NetConfig::default()
    };
    let rt = Runtime::start(
        RuntimeConfig {
            shard_count: 1,
            pin_cores: vec![SERVER_CORE],
            thread_name: "echo-bench".into(),
            ..RuntimeConfig::default()
        },
        move |init: &ShardInit| {
            let l = listener.lock().unwrap().take().expect("one shard");
            let driver = NetDriver::new(&config, init.doorbell.clone(), vec![(Transport::Tcp, l)])?;
            assert_eq!(driver.backend(), backend);
            Ok((Echo, driver))
        },
    )
    .unwrap();
    (rt, addr)
}

fn start_std_echo() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        pin_current(SERVER_CORE);
        // Serves connections one after another until the process exits.
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { return };
            let _ = s.set_nodelay(true);
            let mut buf = [0u8; 4096];
            loop {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if s.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                }
            }
        }
    });
    addr
}

fn client(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

fn round_trip(s: &mut TcpStream, msg: &[u8; MESSAGE_BYTES], buf: &mut [u8; MESSAGE_BYTES]) {
    s.write_all(msg).unwrap();
    s.read_exact(buf).unwrap();
}

fn percentiles(name: &str, s: &mut TcpStream) {
    let msg = [7u8; MESSAGE_BYTES];
    let mut buf = [0u8; MESSAGE_BYTES];
    for _ in 0..1000 {
        round_trip(s, &msg, &mut buf);
    }
    let mut ns: Vec<u64> = (0..PERCENTILE_ROUND_TRIPS)
        .map(|_| {
            let t = Instant::now();
            round_trip(s, &msg, &mut buf);
            t.elapsed().as_nanos() as u64
        })
        .collect();
    ns.sort_unstable();
    let at = |q: f64| ns[((ns.len() as f64 * q) as usize).min(ns.len() - 1)] as f64 / 1000.0;
    println!(
        "{name}: {PERCENTILE_ROUND_TRIPS} round trips of {MESSAGE_BYTES} B: p50 {:.1} us, p99 {:.1} us, p999 {:.1} us",
        at(0.5),
        at(0.99),
        at(0.999)
    );
}

fn bench_echo(c: &mut Criterion) {
    pin_current(CLIENT_CORE);
    // `cargo test --all-targets` runs this binary without `--bench`: skip the long
    // percentile runs there (criterion itself runs each benchmark once).
    let measure = std::env::args().any(|a| a == "--bench");
    let percentiles = |name: &str, s: &mut TcpStream| {
        if measure {
            percentiles(name, s);
        }
    };
    let mut group = c.benchmark_group("echo_64B_rtt");
    let msg = [7u8; MESSAGE_BYTES];
    let mut buf = [0u8; MESSAGE_BYTES];

    let std_addr = start_std_echo();
    let mut s = client(std_addr);
    percentiles("std_blocking", &mut s);
    group.bench_function("std_blocking", |b| {
        b.iter(|| round_trip(&mut s, &msg, &mut buf))
    });
    drop(s);

    for (name, backend) in [("uring", Backend::Uring), ("mio", Backend::Mio)] {
        let (rt, addr) = start_node(backend);
        let mut s = client(addr);
        percentiles(name, &mut s);
        group.bench_function(name, |b| b.iter(|| round_trip(&mut s, &msg, &mut buf)));
        drop(s);
        rt.handle().stop();
        for r in rt.join() {
            r.unwrap();
        }
    }
    group.finish();
}

criterion_group!(benches, bench_echo);
criterion_main!(benches);
