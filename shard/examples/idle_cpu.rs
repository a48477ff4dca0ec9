//! Measures the CPU time an idle runtime burns: starts one shard per core with no
//! work, lets them park, and reports process CPU time over one idle second.
//!
//! `cargo run --release -p shard --example idle_cpu`

use std::time::Duration;

use shard::runtime::{Context, Handler, PlainDriver, Runtime, RuntimeConfig, ShardInit};
use slots::ShardId;

struct Idle;

impl Handler for Idle {
    type Msg = ();
    type Timer = ();
    type Driver = PlainDriver;
    fn on_message(&mut self, _: &mut Context<(), ()>, _: &mut PlainDriver, _: ShardId, _: ()) {}
}

fn cpu_time() -> Duration {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one rusage into the pointer we pass.
    let usage = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr());
        usage.assume_init()
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

fn main() {
    let config = RuntimeConfig::default();
    let shards = config.shard_count;
    let rt = Runtime::start(config, |init: &ShardInit| {
        Ok((Idle, PlainDriver::new(init.doorbell.clone())))
    })
    .expect("start runtime");
    let handle = rt.handle();
    while !(0..shards).all(|s| handle.is_parked(s)) {
        std::thread::yield_now();
    }
    let before = cpu_time();
    std::thread::sleep(Duration::from_secs(1));
    let used = cpu_time() - before;
    handle.stop();
    let stats: Vec<_> = rt.join().into_iter().map(|r| r.expect("shard").1).collect();
    println!(
        "idle runtime, {shards} shards: {} us of CPU over 1 s idle; parks per shard: {:?}",
        used.as_micros(),
        stats.iter().map(|s| s.parks).collect::<Vec<_>>()
    );
}
