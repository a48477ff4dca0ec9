//! The shard runtime end to end: the mesh delivers everything in order under
//! backpressure, parked shards wake for messages and timers, and stop works.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use shard::runtime::{Context, Handler, PlainDriver, Runtime, RuntimeConfig, ShardInit};
use slots::ShardId;
use wheel::TimerHandle;

fn config(shards: u16) -> RuntimeConfig {
    RuntimeConfig {
        shard_count: shards,
        ring_capacity: 256,
        outbox_batch_max: 32,
        ..RuntimeConfig::default()
    }
}

/// Sends `total` sequence numbers to every peer, retrying on backpressure, and
/// checks that each peer's numbers arrive exactly once and in order.
struct Streamer {
    total: u64,
    next_to_send: Vec<u64>,
    next_expected: Vec<u64>,
    done: Arc<AtomicUsize>,
    finished: bool,
}

impl Handler for Streamer {
    type Msg = u64;
    type Timer = ();
    type Driver = PlainDriver;

    fn on_message(
        &mut self,
        cx: &mut Context<u64, ()>,
        _: &mut PlainDriver,
        from: ShardId,
        msg: u64,
    ) {
        let expected = &mut self.next_expected[from as usize];
        assert_eq!(
            msg,
            *expected,
            "shard {} got {msg} from {from}, expected {expected}",
            cx.shard_id()
        );
        *expected += 1;
    }

    fn on_turn(&mut self, cx: &mut Context<u64, ()>, _driver: &mut PlainDriver) -> usize {
        let mut sent = 0;
        for peer in 0..cx.shard_count() {
            if peer == cx.shard_id() {
                continue;
            }
            while self.next_to_send[peer as usize] < self.total {
                if cx.send_to(peer, self.next_to_send[peer as usize]).is_err() {
                    break;
                }
                self.next_to_send[peer as usize] += 1;
                sent += 1;
            }
        }
        let me = cx.shard_id() as usize;
        let all_received = self
            .next_expected
            .iter()
            .enumerate()
            .all(|(peer, &n)| peer == me || n == self.total);
        if all_received && !self.finished {
            self.finished = true;
            if self.done.fetch_add(1, Ordering::SeqCst) + 1 == cx.shard_count() as usize {
                cx.stop_runtime();
            }
        }
        sent
    }
}

fn stream(shards: u16, total: u64) {
    let done = Arc::new(AtomicUsize::new(0));
    let d = done.clone();
    let rt = Runtime::start(config(shards), move |init: &ShardInit| {
        let n = init.shard_count as usize;
        Ok((
            Streamer {
                total,
                next_to_send: vec![0; n],
                next_expected: vec![0; n],
                done: d.clone(),
                finished: false,
            },
            PlainDriver::new(init.doorbell.clone()),
        ))
    })
    .unwrap();
    for (i, result) in rt.join().into_iter().enumerate() {
        let (handler, stats) = result.unwrap();
        for (peer, &n) in handler.next_expected.iter().enumerate() {
            if peer != i {
                assert_eq!(n, total, "shard {i} received {n} of {total} from {peer}");
            }
        }
        assert_eq!(stats.messages_received, total * (shards as u64 - 1));
        assert_eq!(stats.messages_sent, total * (shards as u64 - 1));
        assert!(
            stats.batches_flushed < stats.messages_sent,
            "sends were batched"
        );
    }
    assert_eq!(done.load(Ordering::SeqCst), shards as usize);
}

#[test]
fn two_shards_exchange_a_million_messages_each_way_in_order() {
    stream(2, 1_000_000);
}

#[test]
fn four_shards_all_to_all_in_order() {
    stream(4, 50_000);
}

/// Shard 0 waits until shard 1 is parked, then sends it one message: the doorbell
/// must wake it (exactly one eventfd write), and shard 1 stops the runtime.
struct Waker {
    sent: bool,
    got: bool,
}

impl Handler for Waker {
    type Msg = &'static str;
    type Timer = ();
    type Driver = PlainDriver;

    fn on_message(
        &mut self,
        cx: &mut Context<Self::Msg, ()>,
        _: &mut PlainDriver,
        from: ShardId,
        msg: Self::Msg,
    ) {
        assert_eq!((cx.shard_id(), from, msg), (1, 0, "wake up"));
        self.got = true;
        cx.stop_runtime();
    }

    fn on_turn(&mut self, cx: &mut Context<Self::Msg, ()>, _driver: &mut PlainDriver) -> usize {
        if cx.shard_id() != 0 || self.sent {
            return 0;
        }
        if cx.is_parked(1) {
            cx.send_to(1, "wake up").unwrap();
            self.sent = true;
        }
        1 // keep shard 0 awake until it has sent
    }
}

#[test]
fn a_parked_shard_is_woken_by_one_doorbell_ring() {
    let rt = Runtime::start(config(2), |init: &ShardInit| {
        Ok((
            Waker {
                sent: false,
                got: false,
            },
            PlainDriver::new(init.doorbell.clone()),
        ))
    })
    .unwrap();
    let results: Vec<_> = rt.join().into_iter().map(|r| r.unwrap()).collect();
    let (s0, st0) = &results[0];
    let (s1, st1) = &results[1];
    assert!(s0.sent && s1.got);
    assert_eq!(
        st0.doorbells_rung, 1,
        "one message to a sleeping peer rings exactly once"
    );
    assert!(st1.parks >= 1);
}

/// A timer armed on an idle shard fires through the park timeout.
struct Sleeper {
    armed_at_ms: u64,
    fired_at_ms: Option<u64>,
    handle: Option<TimerHandle>,
}

impl Handler for Sleeper {
    type Msg = ();
    type Timer = u32;
    type Driver = PlainDriver;

    fn on_start(&mut self, cx: &mut Context<(), u32>, _: &mut PlainDriver) {
        self.armed_at_ms = cx.now_ms();
        // One timer to cancel, one to fire.
        let cancelled = cx.set_timer(self.armed_at_ms + 5, 1).unwrap();
        self.handle = Some(cx.set_timer(self.armed_at_ms + 20, 2).unwrap());
        assert_eq!(cx.cancel_timer(cancelled), Some(1));
    }

    fn on_message(
        &mut self,
        _cx: &mut Context<(), u32>,
        _: &mut PlainDriver,
        _from: ShardId,
        _msg: (),
    ) {
    }

    fn on_timer(
        &mut self,
        cx: &mut Context<(), u32>,
        _: &mut PlainDriver,
        handle: TimerHandle,
        value: u32,
    ) {
        assert_eq!((Some(handle), value), (self.handle, 2));
        self.fired_at_ms = Some(cx.now_ms());
        cx.stop_runtime();
    }
}

#[test]
fn timers_fire_on_an_idle_shard_and_cancelled_ones_do_not() {
    let rt = Runtime::start(config(1), |init: &ShardInit| {
        Ok((
            Sleeper {
                armed_at_ms: 0,
                fired_at_ms: None,
                handle: None,
            },
            PlainDriver::new(init.doorbell.clone()),
        ))
    })
    .unwrap();
    let (s, stats) = rt.join().pop().unwrap().unwrap();
    let fired = s.fired_at_ms.expect("the timer fired");
    assert!(
        fired >= s.armed_at_ms + 20,
        "fired at {fired}, armed at {}",
        s.armed_at_ms
    );
    assert_eq!(stats.timers_fired, 1);
}

#[test]
fn an_idle_runtime_parks_every_shard_and_stops_from_outside() {
    struct Idle;
    impl Handler for Idle {
        type Msg = ();
        type Timer = ();
        type Driver = PlainDriver;
        fn on_message(&mut self, _: &mut Context<(), ()>, _: &mut PlainDriver, _: ShardId, _: ()) {}
    }
    let rt = Runtime::start(config(2), |init: &ShardInit| {
        Ok((Idle, PlainDriver::new(init.doorbell.clone())))
    })
    .unwrap();
    let handle = rt.handle();
    // Wait for the condition itself (both parked), not for a duration.
    while !(handle.is_parked(0) && handle.is_parked(1)) {
        std::thread::yield_now();
    }
    handle.stop();
    for r in rt.join() {
        let (_, stats) = r.unwrap();
        assert!(stats.parks >= 1);
        assert_eq!(stats.messages_received, 0);
    }
}

#[test]
fn bad_configs_are_refused() {
    struct Nop;
    impl Handler for Nop {
        type Msg = ();
        type Timer = ();
        type Driver = PlainDriver;
        fn on_message(&mut self, _: &mut Context<(), ()>, _: &mut PlainDriver, _: ShardId, _: ()) {}
    }
    let f = |init: &ShardInit| -> io::Result<(Nop, PlainDriver)> {
        Ok((Nop, PlainDriver::new(init.doorbell.clone())))
    };
    let bad_ring = RuntimeConfig {
        ring_capacity: 100,
        ..config(2)
    };
    assert!(Runtime::start(bad_ring, f).is_err());
    let no_shards = RuntimeConfig {
        shard_count: 0,
        ..config(2)
    };
    assert!(Runtime::start(no_shards, f).is_err());
}

/// Messages from outside the runtime reach a parked shard through its injector, in
/// order, and a full injector pushes back.
#[test]
fn injected_messages_wake_a_parked_shard_in_order() {
    struct Collector {
        got: Vec<u32>,
    }
    impl Handler for Collector {
        type Msg = u32;
        type Timer = ();
        type Driver = PlainDriver;
        fn on_message(
            &mut self,
            cx: &mut Context<u32, ()>,
            _: &mut PlainDriver,
            from: ShardId,
            msg: u32,
        ) {
            assert_eq!(from, shard::runtime::INJECTED);
            self.got.push(msg);
            if msg == 99 {
                cx.stop_runtime();
            }
        }
    }
    let cfg = RuntimeConfig {
        injector_capacity: 100,
        ..config(1)
    };
    let rt = Runtime::start(cfg, |init: &ShardInit| {
        Ok((
            Collector { got: Vec::new() },
            PlainDriver::new(init.doorbell.clone()),
        ))
    })
    .unwrap();
    let handle = rt.handle();
    while !handle.is_parked(0) {
        std::thread::yield_now();
    }
    let injector = rt.injector(0);
    for i in 0..100 {
        injector.send(i).unwrap();
    }
    let (handler, stats) = rt.join().pop().unwrap().unwrap();
    assert_eq!(handler.got, (0..100).collect::<Vec<_>>());
    assert!(stats.parks >= 1);
}

#[test]
fn a_full_injector_pushes_back() {
    struct Nop;
    impl Handler for Nop {
        type Msg = u32;
        type Timer = ();
        type Driver = PlainDriver;
        fn on_message(
            &mut self,
            _: &mut Context<u32, ()>,
            _: &mut PlainDriver,
            _: ShardId,
            _: u32,
        ) {
        }
    }
    // Stop the runtime first, so nothing drains the queue while we fill it.
    let cfg = RuntimeConfig {
        injector_capacity: 3,
        ..config(1)
    };
    let rt = Runtime::start(cfg, |init: &ShardInit| {
        Ok((Nop, PlainDriver::new(init.doorbell.clone())))
    })
    .unwrap();
    let handle = rt.handle();
    handle.stop();
    let injector = rt.injector(0);
    rt.join();
    // The shard is gone; its queue still bounds what can be queued.
    for i in 0..3 {
        assert_eq!(injector.send(i), Ok(()));
    }
    assert_eq!(injector.send(3), Err(3));
}

/// `flush_to` hands a message to its peer before the sending turn ends: shard 0
/// sends, flushes, then waits inside the same turn until shard 1 has seen it (which
/// would never happen if the message stayed in the outbox until the turn's end).
#[test]
fn flush_to_delivers_before_the_turn_ends() {
    use std::sync::atomic::AtomicBool;
    struct Handoff {
        seen: Arc<AtomicBool>,
        started: bool,
    }
    impl Handler for Handoff {
        type Msg = u32;
        type Timer = ();
        type Driver = PlainDriver;
        fn on_message(
            &mut self,
            cx: &mut Context<u32, ()>,
            _: &mut PlainDriver,
            _from: ShardId,
            _msg: u32,
        ) {
            assert_eq!(cx.shard_id(), 1);
            self.seen.store(true, Ordering::SeqCst);
        }
        fn on_turn(&mut self, cx: &mut Context<u32, ()>, _: &mut PlainDriver) -> usize {
            if cx.shard_id() != 0 || self.started {
                return 0;
            }
            self.started = true;
            cx.send_to(1, 7).unwrap();
            assert!(cx.flush_to(1), "the message moved into the ring");
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while !self.seen.load(Ordering::SeqCst) {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the peer never saw the flushed message"
                );
                std::thread::yield_now();
            }
            cx.stop_runtime();
            1
        }
    }
    let seen = Arc::new(AtomicBool::new(false));
    let seen_by_shards = seen.clone();
    let rt = Runtime::start(config(2), move |init: &ShardInit| {
        Ok((
            Handoff {
                seen: seen_by_shards.clone(),
                started: false,
            },
            PlainDriver::new(init.doorbell.clone()),
        ))
    })
    .unwrap();
    for result in rt.join() {
        result.unwrap();
    }
    assert!(seen.load(Ordering::SeqCst));
}

/// Shard 0 sends a burst far larger than its ring to shard 1 in one callback, with a
/// control message last: nothing is refused or dropped, data arrives in order, and the
/// control message overtakes the data still queued.
struct Burst {
    total: u64,
    /// Set by shard 0 once it knows how many it sent (0 until then).
    sent: Arc<std::sync::atomic::AtomicU64>,
    received: Vec<u64>,
    urgent_at: Option<usize>,
}

impl Handler for Burst {
    type Msg = u64;
    type Timer = ();
    type Driver = PlainDriver;

    fn on_start(&mut self, cx: &mut Context<u64, ()>, _: &mut PlainDriver) {
        if cx.shard_id() != 0 {
            // Shard 1 starts consuming only once shard 0 has queued everything, so the
            // ring is full and the rest waits in the queue when the control message goes.
            while self.sent.load(Ordering::SeqCst) == 0 {
                std::thread::yield_now();
            }
            return;
        }
        for i in 0..self.total {
            cx.send_to(1, i)
                .expect("within peer_queue_max: never refused");
        }
        cx.send_urgent(1, u64::MAX).expect("control lane");
        // The queue is bounded: one more than it holds is refused.
        let room = cx.send_capacity(1) as u64;
        let mut accepted = 0u64;
        while cx.send_to(1, self.total + accepted).is_ok() {
            accepted += 1;
            assert!(accepted <= 10 * room, "the queue never refuses");
        }
        assert!(accepted >= room, "the reported room was there");
        self.total += accepted;
        assert_eq!(cx.stats().send_backpressure, 1);
        // A message its sender bounds by credits is never refused, even now.
        cx.send_reserved(1, self.total);
        self.total += 1;
        assert_eq!(cx.stats().send_backpressure, 1);
        self.sent.store(self.total, Ordering::SeqCst);
    }

    fn on_message(&mut self, cx: &mut Context<u64, ()>, _: &mut PlainDriver, _: ShardId, m: u64) {
        if m == u64::MAX {
            self.urgent_at = Some(self.received.len());
        } else {
            assert_eq!(m, self.received.len() as u64, "data in send order");
            self.received.push(m);
        }
        if self.received.len() as u64 == self.sent.load(Ordering::SeqCst)
            && self.urgent_at.is_some()
        {
            cx.stop_runtime();
        }
    }
}

#[test]
fn a_burst_beyond_the_ring_waits_in_the_peer_queue_and_control_overtakes_it() {
    const RING: usize = 16;
    const QUEUE: usize = 10_000;
    let cfg = RuntimeConfig {
        shard_count: 2,
        ring_capacity: RING,
        outbox_batch_max: 8,
        peer_queue_max: QUEUE,
        ..RuntimeConfig::default()
    };
    let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let rt = Runtime::start(cfg, move |init: &ShardInit| {
        Ok((
            Burst {
                total: 5_000,
                sent: sent.clone(),
                received: Vec::new(),
                urgent_at: None,
            },
            PlainDriver::new(init.doorbell.clone()),
        ))
    })
    .unwrap();
    let results: Vec<_> = rt.join().into_iter().map(|r| r.unwrap()).collect();
    let (s1, _) = &results[1];
    let (s0, st0) = &results[0];
    assert_eq!(
        s1.received.len() as u64,
        s0.total,
        "every accepted message arrived"
    );
    let at = s1.urgent_at.expect("the control message arrived");
    assert!(
        at <= RING,
        "control waited only behind the ring's content, not the queue: arrived after {at}"
    );
    assert_eq!(
        st0.peer_queue_peak,
        QUEUE as u64 + 1,
        "the bound, plus the reserved one"
    );
}

/// A shard that panics is reported as the runtime's failure while the others run.
struct Panicker;

impl Handler for Panicker {
    type Msg = ();
    type Timer = ();
    type Driver = PlainDriver;

    fn on_start(&mut self, cx: &mut Context<(), ()>, _: &mut PlainDriver) {
        if cx.shard_id() == 1 {
            panic!("boom in shard 1");
        }
    }

    fn on_message(&mut self, _: &mut Context<(), ()>, _: &mut PlainDriver, _: ShardId, _: ()) {}
}

#[test]
fn a_panicking_shard_is_reported_as_the_runtime_failure() {
    let rt = Runtime::start(config(2), |init: &ShardInit| {
        Ok((Panicker, PlainDriver::new(init.doorbell.clone())))
    })
    .unwrap();
    let handle = rt.handle();
    let cause = handle
        .wait_failure(std::time::Duration::from_secs(30))
        .expect("the failure is reported");
    assert!(
        cause.contains("shard 1") && cause.contains("boom"),
        "{cause}"
    );
    assert!(!handle.is_parked(1) || handle.failure().is_some());
    handle.stop();
    let results = rt.join();
    assert!(
        results[0].is_ok(),
        "the other shard ran on and stopped cleanly"
    );
    assert!(results[1].is_err());
}
