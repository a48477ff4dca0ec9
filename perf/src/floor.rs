//! The machine's floor: a raw loopback TCP echo round trip (blocking sockets, one
//! message in flight), measured by imbench itself so every report states it.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::load::new_hist;

/// Round trips one floor measurement makes at most.
pub const FLOOR_ROUND_TRIPS_MAX: u64 = 10_000_000;

/// Measures `payload_bytes`-byte echo round trips over loopback for `duration`.
pub fn measure(duration: Duration, payload_bytes: usize) -> io::Result<Histogram<u64>> {
    let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
    let addr = listener.local_addr()?;
    let n = payload_bytes.max(1);
    let server = std::thread::Builder::new()
        .name("imbench-echo".into())
        .spawn(move || -> io::Result<()> {
            let (mut s, _) = listener.accept()?;
            s.set_nodelay(true)?;
            let mut buf = vec![0u8; n];
            loop {
                if let Err(e) = s.read_exact(&mut buf) {
                    return if e.kind() == io::ErrorKind::UnexpectedEof {
                        Ok(())
                    } else {
                        Err(e)
                    };
                }
                s.write_all(&buf)?;
            }
        })?;
    let mut c = TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    c.set_read_timeout(Some(Duration::from_secs(5)))?;
    let msg = vec![0x5au8; n];
    let mut back = vec![0u8; n];
    let mut h = new_hist();
    // Warm up (page faults, first wakeups) before recording.
    for _ in 0..100 {
        c.write_all(&msg)?;
        c.read_exact(&mut back)?;
    }
    let end = Instant::now() + duration;
    let mut trips = 0u64;
    while trips < FLOOR_ROUND_TRIPS_MAX {
        let t0 = Instant::now();
        if t0 >= end {
            break;
        }
        c.write_all(&msg)?;
        c.read_exact(&mut back)?;
        h.saturating_record((t0.elapsed().as_nanos() as u64).max(1));
        trips += 1;
    }
    drop(c);
    server
        .join()
        .map_err(|_| io::Error::other("echo thread panicked"))??;
    Ok(h)
}
