//! Delivery planning, from a committed group SEND to its push batches: the real
//! `Planner` and the real `AuthorityReader`, over a directory of 1M routes (the
//! large online population: tables and filters far past the caches), for groups of
//! 100, 1,000 and 10,000 members with 1% and 50% of them online. One iteration is
//! one SEND: enqueue, pump until its delivery ended; timed in thread CPU time.
//!
//! `cargo bench -p domain --bench delivery -- --warm-up-time 1 --measurement-time 3`

// A test driver, outside the sans-IO boundary (clippy.toml): it may time itself.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use domain::cluster::{ClusterView, HashSlot};
use domain::presence::authority::{Authority, AuthorityConfig, AuthorityReader, Directory};
use domain::presence::route::{DeviceLevel, RegisterOutcome, Route, Transport, Uid};
use domain::send::channel::Subscribers;
use domain::send::commit::{Committed, Delivery};
use domain::send::delivery::{session_id, PlanLimits, PlanOutput, Planner};
use slots::HASH_SLOTS;

/// Routes of uids outside the groups: the node's other online users.
const POPULATION: usize = 1 << 20;
const T0: u64 = 1_000_000;

/// CPU time of the calling thread (figures stay meaningful on a shared machine).
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn cfg() -> AuthorityConfig {
    AuthorityConfig {
        route_ttl_s: 1 << 30,
        ..AuthorityConfig::default()
    }
}

/// The node's defaults (`[delivery]`): pages of 1,024, batches of 256.
fn limits() -> PlanLimits {
    PlanLimits {
        local_node: 1,
        me: 0,
        shard_count: 2,
        subscriber_page_max: 1_024,
        push_batch_max: 256,
        pages_per_turn_max: 64,
        lookup_pages_in_flight_max: 32,
        reserved_room_per_peer: 3 * 1_024,
        offline_uids: false,
        offline_room: true,
        lookup_retries_max: 2,
        rebuild_retry_interval_ms: 20,
        rebuild_wait_ms_max: 3_000,
    }
}

/// Registers one route of `uid` (a session on shard `n % 2` of node 1).
fn online(a: &mut Authority, view: &ClusterView, uid: &str, n: u64) {
    let route = Route {
        uid: uid.into(),
        device_id: "d".into(),
        device_flag: 1,
        device_level: DeviceLevel::Slave,
        node_id: 1,
        boot_id: 7,
        session_id: session_id((n % 2) as u16, n),
        listener: Transport::Tcp,
        owner_seq: 1,
        connected_at_ms: 0,
        last_active_s: Some(T0),
    };
    let t = view.target_for_uid(uid);
    assert_eq!(a.register_route(&t, route, T0), Ok(RegisterOutcome::Active));
}

/// A group of `members` uids (fresh allocations, as the catalog holds them), every
/// `1 / online` of them given a route.
fn group(a: &mut Authority, view: &ClusterView, members: usize, every: usize) -> Arc<Subscribers> {
    let mut uids: Vec<Uid> = Vec::with_capacity(members);
    for j in 0..members {
        let u = format!("g{members}-{every}-member-{j:06}");
        if j % every == 0 {
            online(a, view, &u, (POPULATION + j) as u64);
        }
        uids.push(u.into());
    }
    Arc::new(Subscribers::new(uids))
}

fn delivery(subscribers: &Arc<Subscribers>) -> Delivery {
    let message = Committed {
        committed_ns: 0,
        message_id: 1,
        message_seq: 1,
        timestamp_s: 0,
        from_uid: "sender".into(),
        channel_key: "g".into(),
        channel_type: 2,
        client_msg_no: String::new(),
        setting: 0,
        flags: 0,
        expire_s: 0,
        topic: String::new(),
        payload: vec![0; 64],
    };
    Delivery {
        message: Arc::new(message),
        sender: None,
        subscribers: Some(subscribers.clone()),
        charge_bytes: 1_024,
    }
}

/// Plans one SEND to its end; returns the endpoints pushed.
fn plan_one(
    p: &mut Planner,
    reader: &mut AuthorityReader,
    view: &ClusterView,
    d: Delivery,
    out: &mut Vec<PlanOutput>,
) -> usize {
    let limits = limits();
    p.enqueue(d);
    let mut pushed = 0;
    while !p.is_empty() {
        p.pump(0, view, reader, &mut |_| usize::MAX, &limits, out);
        for o in out.drain(..) {
            match o {
                PlanOutput::Push(push) => pushed += push.endpoints.len(),
                PlanOutput::Lookup(_) => unreachable!("one node leads every slot"),
                PlanOutput::Offline(_) => unreachable!("offline uids not asked for"),
            }
        }
    }
    pushed
}

fn bench_planning(c: &mut Criterion) {
    let dir = Directory::new(&cfg()).unwrap();
    let slots: Vec<HashSlot> = (0..HASH_SLOTS as HashSlot).collect();
    let mut a = Authority::new(cfg(), &dir, &slots).unwrap();
    let view = ClusterView::single_node(1);
    a.apply_view(&view, 1, T0);
    for i in 0..POPULATION {
        online(&mut a, &view, &format!("user-{i:08}"), i as u64);
    }
    let mut reader = a.reader();
    let mut g = c.benchmark_group("delivery_plan");
    for members in [100, 1_000, 10_000] {
        for (every, pct) in [(100, 1), (2, 50)] {
            let subs = group(&mut a, &view, members, every);
            let mut p = Planner::default();
            let mut out = Vec::new();
            let want = members.div_ceil(every);
            assert_eq!(
                plan_one(&mut p, &mut reader, &view, delivery(&subs), &mut out),
                want
            );
            g.throughput(Throughput::Elements(1));
            g.bench_function(format!("members_{members}_online_{pct}pct"), |b| {
                b.iter_custom(|iters| {
                    let start = thread_cpu();
                    for _ in 0..iters {
                        let d = delivery(&subs);
                        let n = plan_one(&mut p, &mut reader, &view, d, &mut out);
                        assert_eq!(n, want);
                    }
                    thread_cpu() - start
                })
            });
        }
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench_planning
}
criterion_main!(benches);
