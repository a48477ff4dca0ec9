//! Two spinning threads, no criterion: one-way hand-off latency (ping-pong round trip
//! / 2) and transfer throughput (single and batches of 32) through `ring`, beside
//! `rtrb` single push/pop, over long runs (criterion's short per-sample runs with a
//! thread spawn each were dominated by scheduling on this 2-vCPU machine).
//!
//! `cargo run --release -p ring --example handoff`

use std::thread;
use std::time::Instant;

const ROUND_TRIPS: u64 = 200_000;
const ITEMS: u64 = 20_000_000;

fn ping_pong() -> f64 {
    let (mut to_b, mut from_a) = ring::channel::<u64>(64);
    let (mut to_a, mut from_b) = ring::channel::<u64>(64);
    let echo = thread::spawn(move || {
        for _ in 0..ROUND_TRIPS {
            let v = loop {
                if let Some(v) = from_a.pop() {
                    break v;
                }
                std::hint::spin_loop();
            };
            while to_a.push(v).is_err() {}
        }
    });
    let start = Instant::now();
    for i in 0..ROUND_TRIPS {
        while to_b.push(i).is_err() {}
        loop {
            if from_b.pop().is_some() {
                break;
            }
            std::hint::spin_loop();
        }
    }
    let ns = start.elapsed().as_nanos() as f64 / ROUND_TRIPS as f64 / 2.0;
    echo.join().unwrap();
    ns
}

fn transfer(batch: usize) -> f64 {
    let (mut p, mut c) = ring::channel::<u64>(1024);
    let consumer = thread::spawn(move || {
        let mut got = 0u64;
        let mut sum = 0u64;
        while got < ITEMS {
            let n = c.pop_batch(batch, |v| sum = sum.wrapping_add(v));
            if n == 0 {
                std::hint::spin_loop();
            }
            got += n as u64;
        }
        sum
    });
    let start = Instant::now();
    let mut next = 0u64;
    while next < ITEMS {
        let end = (next + batch as u64).min(ITEMS);
        let mut items = next..end;
        let n = p.push_batch(&mut items);
        next += n as u64;
    }
    let sum = consumer.join().unwrap();
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(sum, ITEMS * (ITEMS - 1) / 2);
    ITEMS as f64 / secs / 1e6
}

fn rtrb_ping_pong() -> f64 {
    let (mut to_b, mut from_a) = rtrb::RingBuffer::<u64>::new(64);
    let (mut to_a, mut from_b) = rtrb::RingBuffer::<u64>::new(64);
    let echo = thread::spawn(move || {
        for _ in 0..ROUND_TRIPS {
            let v = loop {
                if let Ok(v) = from_a.pop() {
                    break v;
                }
                std::hint::spin_loop();
            };
            while to_a.push(v).is_err() {}
        }
    });
    let start = Instant::now();
    for i in 0..ROUND_TRIPS {
        while to_b.push(i).is_err() {}
        while from_b.pop().is_err() {
            std::hint::spin_loop();
        }
    }
    let ns = start.elapsed().as_nanos() as f64 / ROUND_TRIPS as f64 / 2.0;
    echo.join().unwrap();
    ns
}

fn rtrb_transfer() -> f64 {
    let (mut p, mut c) = rtrb::RingBuffer::<u64>::new(1024);
    let consumer = thread::spawn(move || {
        let (mut got, mut sum) = (0u64, 0u64);
        while got < ITEMS {
            match c.pop() {
                Ok(v) => {
                    sum = sum.wrapping_add(v);
                    got += 1;
                }
                Err(_) => std::hint::spin_loop(),
            }
        }
        sum
    });
    let start = Instant::now();
    for i in 0..ITEMS {
        while p.push(i).is_err() {
            std::hint::spin_loop();
        }
    }
    let sum = consumer.join().unwrap();
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(sum, ITEMS * (ITEMS - 1) / 2);
    ITEMS as f64 / secs / 1e6
}

fn transfer_single() -> f64 {
    let (mut p, mut c) = ring::channel::<u64>(1024);
    let consumer = thread::spawn(move || {
        let (mut got, mut sum) = (0u64, 0u64);
        while got < ITEMS {
            match c.pop() {
                Some(v) => {
                    sum = sum.wrapping_add(v);
                    got += 1;
                }
                None => std::hint::spin_loop(),
            }
        }
        sum
    });
    let start = Instant::now();
    for i in 0..ITEMS {
        while p.push(i).is_err() {
            std::hint::spin_loop();
        }
    }
    let sum = consumer.join().unwrap();
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(sum, ITEMS * (ITEMS - 1) / 2);
    ITEMS as f64 / secs / 1e6
}

fn main() {
    for run in 1..=3 {
        println!(
            "run {run}: one-way hand-off ring {:.0} ns, rtrb {:.0} ns; transfer single ring {:.1}, rtrb {:.1} M items/s; ring batch 32 {:.1} M items/s",
            ping_pong(),
            rtrb_ping_pong(),
            transfer_single(),
            rtrb_transfer(),
            transfer(32)
        );
    }
}
