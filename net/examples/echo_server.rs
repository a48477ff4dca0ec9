//! An echo server on the transports: every shard binds its own SO_REUSEPORT TCP and
//! WebSocket listeners on 127.0.0.1 and echoes every byte back. Runs for a bounded
//! time, then prints each shard's counters.
//!
//! `cargo run --release -p net --example echo_server -- [uring|mio|auto] [tcp_port] [ws_port] [seconds]`
//! (defaults: auto 5100 5101 30)

use std::net::SocketAddr;
use std::time::Duration;

use net::io::{bind_reuseport, Backend, NetConfig, NetDriver, NetEvent, NetStats, Transport};
use shard::runtime::{Context, Handler, Runtime, RuntimeConfig, ShardInit};
use slots::ShardId;

struct Echo {
    stats: NetStats,
}

impl Handler for Echo {
    type Msg = ();
    type Timer = ();
    type Driver = NetDriver;

    fn on_message(&mut self, _: &mut Context<(), ()>, _: &mut NetDriver, _: ShardId, _: ()) {}

    fn on_io(&mut self, _: &mut Context<(), ()>, driver: &mut NetDriver, event: NetEvent) {
        if let NetEvent::Readable { conn } = event {
            let data = driver.input(conn).to_vec();
            driver.consume(conn, data.len());
            let _ = driver.send(conn, &data);
        }
    }

    fn on_stop(&mut self, _: &mut Context<(), ()>, driver: &mut NetDriver) {
        self.stats = driver.stats();
    }
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let backend = match args.first().map(String::as_str) {
        Some("uring") => Backend::Uring,
        Some("mio") => Backend::Mio,
        _ => Backend::Auto,
    };
    let port = |i: usize, default: u16| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(default);
    let tcp = SocketAddr::from(([127, 0, 0, 1], port(1, 5100)));
    let ws = SocketAddr::from(([127, 0, 0, 1], port(2, 5101)));
    let seconds = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(30u64);
    let config = NetConfig {
        backend,
        ..NetConfig::default()
    };
    let backlog = config.listen_backlog;
    let rt = Runtime::start(RuntimeConfig::default(), move |init: &ShardInit| {
        let listeners = vec![
            (Transport::Tcp, bind_reuseport(tcp, backlog)?),
            (Transport::WebSocket, bind_reuseport(ws, backlog)?),
        ];
        let driver = NetDriver::new(&config, init.doorbell.clone(), listeners)?;
        println!(
            "shard {}: {:?} backend, tcp {tcp}, ws {ws}",
            init.shard,
            driver.backend()
        );
        Ok((
            Echo {
                stats: NetStats::default(),
            },
            driver,
        ))
    })?;
    std::thread::sleep(Duration::from_secs(seconds));
    rt.handle().stop();
    for (shard, result) in rt.join().into_iter().enumerate() {
        let (echo, _) = result?;
        println!("shard {shard}: {:?}", echo.stats);
    }
    Ok(())
}
