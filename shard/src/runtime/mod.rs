//! The thread-per-core runtime: N shard threads, each pinned to a core and running one
//! loop, connected by an N×N mesh of SPSC rings (Seastar's smp queues).
//!
//! # One loop turn
//! 1. drain the inbound ring of every peer, at most `inbound_batch_max` messages per
//!    peer ([`Handler::on_message`]);
//! 2. fire due timers ([`Handler::on_timer`]);
//! 3. poll the IO driver without blocking ([`Handler::on_io`]);
//! 4. let the handler do its own work ([`Handler::on_turn`]);
//! 5. flush the outboxes: each peer's batch goes into its ring with one index publish,
//!    and the peer's doorbell is rung at most once per batch, only if it sleeps.
//!
//! A turn that found no work counts as idle. After a spin of idle turns (at most
//! `idle_spin_us`; how long is [`SpinPolicy`]'s decision, adaptive by default) the
//! shard parks: it announces sleep on its [`ring::Doorbell`], re-checks its inbound
//! rings, and then blocks in [`Driver::poll`] with the next timer as the timeout. That
//! one wait covers sockets, messages from peers (their eventfd write) and timers.
//!
//! # Messages and backpressure
//! [`Context::send_to`] appends to the peer's queue; a queue of `outbox_batch_max`
//! messages is flushed into the ring at once, the rest at the end of the turn. What a
//! full ring cannot take stays queued (in order) and moves on as the peer drains: a
//! shard never blocks on a peer and never drops what it accepted. The queue is
//! bounded (`peer_queue_max`): past it `send_to` gives the message back as `Err`.
//! Producers keep far below that bound by admission ([`Context::send_capacity`]
//! tells how much room is left), so `Err` means a broken admission rule.
//!
//! Two lanes per peer: [`Context::send_urgent`] (control: activations, touches,
//! replies) is flushed before [`Context::send_to`] (data: commits, pushes), so
//! control never waits behind queued data, only behind what is already in the ring.
//! Within a lane, messages between one pair of shards arrive in send order. Messages
//! a shard sends to itself go through a local queue with the same bound as a ring
//! plus a peer queue.
//!
//! # A shard that fails
//! A shard whose handler panics or whose driver fails ends its thread; the runtime
//! records the cause ([`RuntimeHandle::failure`], [`RuntimeHandle::wait_failure`]) so
//! the process can stop (a node must not serve with a shard missing). The other
//! shards keep running until told to stop.
//!
//! # From outside the runtime
//! Threads that are not shards (the HTTP API, signal handling, tests) reach a shard
//! through its [`Injector`]: a bounded, mutex-protected queue (`injector_capacity`)
//! drained once per turn, for rare control traffic; the data path never uses it.

mod driver;
mod eventfd;
mod spin;

pub use driver::{Driver, PlainDriver};
pub use eventfd::EventFd;
pub use spin::SpinPolicy;

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ring::{Consumer, Doorbell, Producer};

use slots::ShardId;
use wheel::{TimerHandle, TimerWheel};

/// Limits and behaviour of a runtime. Every bound has its unit in its name.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RuntimeConfig {
    /// Number of shard threads.
    pub shard_count: u16,
    /// Capacity of each SPSC ring between two shards (a power of two).
    pub ring_capacity: usize,
    /// Messages buffered per peer before a flush into its ring.
    pub outbox_batch_max: usize,
    /// Messages queued per peer (both lanes) beyond what its ring holds; `send_to`
    /// refuses past it. Worst case per shard: `(shard_count - 1) × peer_queue_max`
    /// messages.
    pub peer_queue_max: usize,
    /// Messages taken from one peer's ring per loop turn (fairness between peers).
    pub inbound_batch_max: usize,
    /// Messages queued per shard from outside the runtime ([`Injector`]).
    pub injector_capacity: usize,
    /// The longest a shard spins on idle turns before it parks.
    pub idle_spin_us: u64,
    /// Adapt the spin to how idle spells end, within a credit earned by busy time
    /// ([`SpinPolicy`]); `false`: every idle spell spins `idle_spin_us`.
    pub idle_spin_adaptive: bool,
    /// Adaptive: spin time earned per busy time, in percent (the spin CPU's bound
    /// relative to the work's).
    pub idle_spin_busy_percent: u64,
    /// Live timers per shard.
    pub timers_max: usize,
    /// Pin shard `i` to core `pin_cores[i % len]`; empty: no pinning. Default: all cores.
    pub pin_cores: Vec<usize>,
    /// Thread name prefix (`{prefix}-{shard}`).
    pub thread_name: String,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            shard_count: std::thread::available_parallelism().map_or(1, |n| n.get() as u16),
            ring_capacity: 4096,
            outbox_batch_max: 64,
            peer_queue_max: 16_384,
            inbound_batch_max: 256,
            injector_capacity: 1024,
            idle_spin_us: 50,
            idle_spin_adaptive: true,
            idle_spin_busy_percent: 25,
            timers_max: 1 << 20,
            pin_cores: core_affinity::get_core_ids()
                .map(|ids| ids.into_iter().map(|c| c.id).collect())
                .unwrap_or_default(),
            thread_name: "imrouter".into(),
        }
    }
}

/// What a shard's handler sees of the runtime during a callback.
pub struct Context<M, T> {
    shard: ShardId,
    shard_count: u16,
    now_ms: u64,
    outbox_batch_max: usize,
    ring_capacity: usize,
    peer_queue_max: usize,
    /// `outboxes[p]`: messages for peer `p` not yet in its ring (`p != shard`).
    outboxes: Vec<PeerQueue<M>>,
    /// `producers[p]`: the ring into peer `p` (`None` for this shard itself).
    producers: Vec<Option<Producer<M>>>,
    peer_doorbells: Vec<Arc<Doorbell>>,
    peer_eventfds: Vec<Arc<EventFd>>,
    self_queue: VecDeque<M>,
    timers: TimerWheel<T>,
    shared: Arc<Shared>,
    stats: ShardStats,
}

/// The messages for one peer that are not in its ring yet: control first.
struct PeerQueue<M> {
    urgent: VecDeque<M>,
    normal: VecDeque<M>,
}

impl<M> PeerQueue<M> {
    fn len(&self) -> usize {
        self.urgent.len() + self.normal.len()
    }

    fn is_empty(&self) -> bool {
        self.urgent.is_empty() && self.normal.is_empty()
    }
}

/// Counters of one shard, readable by its handler ([`Context::stats`]) and returned by
/// [`Runtime::join`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShardStats {
    pub turns: u64,
    pub messages_received: u64,
    pub messages_sent: u64,
    /// Sends refused because the peer's queue was at `peer_queue_max`.
    pub send_backpressure: u64,
    /// The most messages ever queued for one peer beyond its ring.
    pub peer_queue_peak: u64,
    /// Batches flushed into rings.
    pub batches_flushed: u64,
    /// Eventfd writes to wake a sleeping peer.
    pub doorbells_rung: u64,
    pub timers_fired: u64,
    /// Times this shard parked in its driver.
    pub parks: u64,
}

impl<M: Send, T> Context<M, T> {
    /// This shard's index.
    pub fn shard_id(&self) -> ShardId {
        self.shard
    }

    /// Number of shards in the runtime.
    pub fn shard_count(&self) -> u16 {
        self.shard_count
    }

    /// Milliseconds since the runtime started, read once per loop turn.
    pub fn now_ms(&self) -> u64 {
        self.now_ms
    }

    /// This shard's counters so far.
    pub fn stats(&self) -> &ShardStats {
        &self.stats
    }

    /// Queues `msg` (data lane) for shard `to`. It is flushed into the ring at the end
    /// of the turn (or now, when `outbox_batch_max` are queued); what the ring cannot
    /// take waits in the peer's queue. `Err(msg)`: the queue holds `peer_queue_max`
    /// messages already (admission should have kept it far below: see
    /// [`Context::send_capacity`]).
    pub fn send_to(&mut self, to: ShardId, msg: M) -> Result<(), M> {
        self.enqueue(to, msg, false)
    }

    /// Like [`Context::send_to`], on the control lane: flushed before any queued data.
    pub fn send_urgent(&mut self, to: ShardId, msg: M) -> Result<(), M> {
        self.enqueue(to, msg, true)
    }

    /// Like [`Context::send_to`] (data lane), never refused: for messages whose
    /// number the caller bounds itself by credits it holds (a commit, or the answer a
    /// credit reserved room for), which must not be lost to a queue that other
    /// traffic filled. The queue may then pass `peer_queue_max` by at most those
    /// credits.
    pub fn send_reserved(&mut self, to: ShardId, msg: M) {
        if let Err(msg) = self.enqueue(to, msg, false) {
            self.stats.send_backpressure -= 1;
            if to == self.shard {
                self.self_queue.push_back(msg);
            } else {
                let q = &mut self.outboxes[to as usize];
                q.normal.push_back(msg);
                self.stats.peer_queue_peak = self.stats.peer_queue_peak.max(q.len() as u64);
            }
            self.stats.messages_sent += 1;
        }
    }

    fn enqueue(&mut self, to: ShardId, msg: M, urgent: bool) -> Result<(), M> {
        let to_i = to as usize;
        assert!(
            to_i < self.shard_count as usize,
            "send_to: shard {to} does not exist"
        );
        if to == self.shard {
            if self.self_queue.len() >= self.ring_capacity + self.peer_queue_max {
                self.stats.send_backpressure += 1;
                return Err(msg);
            }
            self.self_queue.push_back(msg);
            self.stats.messages_sent += 1;
            return Ok(());
        }
        let mut queued = self.outboxes[to_i].len();
        if queued >= self.outbox_batch_max {
            self.flush_peer(to_i);
            queued = self.outboxes[to_i].len();
            if queued >= self.peer_queue_max {
                self.stats.send_backpressure += 1;
                return Err(msg);
            }
        }
        let q = &mut self.outboxes[to_i];
        if urgent {
            q.urgent.push_back(msg);
        } else {
            q.normal.push_back(msg);
        }
        self.stats.peer_queue_peak = self.stats.peer_queue_peak.max(queued as u64 + 1);
        self.stats.messages_sent += 1;
        Ok(())
    }

    /// Room left for messages to `to` before `send_to` pushes back (its ring's free
    /// slots plus the peer queue's).
    pub fn send_capacity(&mut self, to: ShardId) -> usize {
        let to_i = to as usize;
        if to == self.shard {
            return (self.ring_capacity + self.peer_queue_max)
                .saturating_sub(self.self_queue.len());
        }
        let ring_free = self.producers[to_i].as_ref().map_or(0, |p| p.free_slots());
        ring_free
            + self
                .peer_queue_max
                .saturating_sub(self.outboxes[to_i].len())
    }

    /// Messages queued for `to` and not yet taken by it (its ring plus this shard's
    /// outbox), for occupancy metrics.
    pub fn queued_for(&mut self, to: ShardId) -> usize {
        let to_i = to as usize;
        if to == self.shard {
            return self.self_queue.len();
        }
        let in_ring = self.producers[to_i]
            .as_ref()
            .map_or(0, |p| p.capacity() - p.free_slots());
        in_ring + self.outboxes[to_i].len()
    }

    /// Arms a timer firing [`Handler::on_timer`] once `now_ms() >= deadline_ms`.
    /// `Err(value)`: the shard is at `timers_max`.
    pub fn set_timer(&mut self, deadline_ms: u64, value: T) -> Result<TimerHandle, T> {
        self.timers
            .insert(deadline_ms, value)
            .map_err(|full| full.0)
    }

    /// Cancels a timer; `None` if it already fired or was cancelled.
    pub fn cancel_timer(&mut self, handle: TimerHandle) -> Option<T> {
        self.timers.cancel(handle)
    }

    /// Whether shard `shard` is parked in its driver right now (a racy observation).
    pub fn is_parked(&self, shard: ShardId) -> bool {
        self.shared.parked[shard as usize].load(Ordering::SeqCst) == 1
    }

    /// Asks every shard of the runtime to stop after its current turn.
    pub fn stop_runtime(&self) {
        self.shared.stop();
    }

    /// Moves what is queued for `to` into its ring now (ringing its doorbell if it
    /// sleeps) instead of at the end of the turn: for latency-critical hand-offs that
    /// precede long local work, so the peer starts in parallel. Returns whether any
    /// message moved.
    pub fn flush_to(&mut self, to: ShardId) -> bool {
        let to_i = to as usize;
        to_i < self.outboxes.len() && self.flush_peer(to_i)
    }

    fn flush_peer(&mut self, peer: usize) -> bool {
        let outbox = &mut self.outboxes[peer];
        if outbox.is_empty() {
            return false;
        }
        let Some(producer) = self.producers[peer].as_mut() else {
            return false;
        };
        // Take only what fits, so draining never drops a message; control first: data
        // moves only once no control waits (the free space is read once, so data cannot
        // take room the consumer freed after control found none).
        let mut free = producer.free_slots();
        let mut pushed = 0;
        for lane in [&mut outbox.urgent, &mut outbox.normal] {
            let fits = free.min(lane.len());
            if fits > 0 {
                let n = producer.push_batch(&mut lane.drain(..fits));
                assert_eq!(
                    n, fits,
                    "a single-producer ring cannot shrink its free space"
                );
                pushed += n;
                free -= n;
            }
            if !lane.is_empty() {
                break;
            }
        }
        if pushed == 0 {
            return false;
        }
        self.stats.batches_flushed += 1;
        if self.peer_doorbells[peer].should_wake() {
            self.peer_eventfds[peer].notify();
            self.stats.doorbells_rung += 1;
        }
        true
    }

    /// Flushes every outbox; returns whether any message moved.
    fn flush_all(&mut self) -> bool {
        let mut moved = false;
        for peer in 0..self.outboxes.len() {
            moved |= self.flush_peer(peer);
        }
        moved
    }

    fn outboxes_pending(&self) -> bool {
        self.outboxes.iter().any(|o| !o.is_empty())
    }
}

/// The per-shard application: created on its shard thread, driven by one loop.
pub trait Handler: Sized + Send + 'static {
    /// Messages exchanged between shards.
    type Msg: Send + 'static;
    /// What a timer carries.
    type Timer: 'static;
    /// The IO backend of this shard.
    type Driver: Driver;

    /// Called once on the shard thread before the first turn.
    fn on_start(&mut self, _cx: &mut Context<Self::Msg, Self::Timer>, _driver: &mut Self::Driver) {}

    /// A message from shard `from` (possibly this shard itself, or [`INJECTED`]).
    fn on_message(
        &mut self,
        cx: &mut Context<Self::Msg, Self::Timer>,
        driver: &mut Self::Driver,
        from: ShardId,
        msg: Self::Msg,
    );

    /// A timer armed with [`Context::set_timer`] is due.
    fn on_timer(
        &mut self,
        _cx: &mut Context<Self::Msg, Self::Timer>,
        _driver: &mut Self::Driver,
        _handle: TimerHandle,
        _value: Self::Timer,
    ) {
    }

    /// IO completed in the driver.
    fn on_io(
        &mut self,
        _cx: &mut Context<Self::Msg, Self::Timer>,
        _driver: &mut Self::Driver,
        _event: <Self::Driver as Driver>::Event,
    ) {
    }

    /// Once per loop turn, after messages, timers and IO: the handler's own work
    /// (retrying backpressured sends, flushing batches). Returns how much it did;
    /// a turn where everything returned 0 is idle and leads to parking.
    fn on_turn(
        &mut self,
        _cx: &mut Context<Self::Msg, Self::Timer>,
        _driver: &mut Self::Driver,
    ) -> usize {
        0
    }

    /// Called once on the shard thread after the last turn.
    fn on_stop(&mut self, _cx: &mut Context<Self::Msg, Self::Timer>, _driver: &mut Self::Driver) {}
}

/// What a shard's factory gets to build its handler and driver.
pub struct ShardInit {
    /// This shard's index.
    pub shard: ShardId,
    /// Number of shards.
    pub shard_count: u16,
    /// The shard's doorbell eventfd: the driver must wait on it (see [`Driver`]).
    pub doorbell: Arc<EventFd>,
}

struct Shared {
    stopping: AtomicBool,
    /// The first shard failure (`"shard N: cause"`), announced on `failed`.
    failure: Mutex<Option<String>>,
    failed: std::sync::Condvar,
    eventfds: Vec<Arc<EventFd>>,
    /// Per shard: 1 while parked in the driver (for observers and tests).
    parked: Vec<AtomicU64>,
}

impl Shared {
    /// Records a shard's failure (the first one wins) and wakes its waiters.
    fn fail(&self, cause: String) {
        let mut failure = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if failure.is_none() {
            *failure = Some(cause);
        }
        self.failed.notify_all();
    }

    fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        for fd in &self.eventfds {
            fd.notify();
        }
    }
}

/// Stops a running runtime from any thread.
#[derive(Clone)]
pub struct RuntimeHandle {
    shared: Arc<Shared>,
}

impl RuntimeHandle {
    /// Asks every shard to stop after its current turn and wakes parked ones.
    pub fn stop(&self) {
        self.shared.stop();
    }

    /// Whether shard `shard` is parked in its driver right now.
    pub fn is_parked(&self, shard: ShardId) -> bool {
        self.shared.parked[shard as usize].load(Ordering::SeqCst) == 1
    }

    /// Why a shard ended on its own (a panic, a driver or factory error), if one did.
    pub fn failure(&self) -> Option<String> {
        self.shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Waits up to `timeout` for a shard to fail; returns the cause if one has.
    pub fn wait_failure(&self, timeout: Duration) -> Option<String> {
        let guard = self
            .shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let (guard, _) = self
            .shared
            .failed
            .wait_timeout_while(guard, timeout, |f| f.is_none())
            .unwrap_or_else(|e| e.into_inner());
        guard.clone()
    }
}

/// The queue of one shard for messages from outside the runtime.
struct Inbox<M> {
    queue: Mutex<VecDeque<M>>,
    /// Set while `queue` may be non-empty: the shard checks it each turn without locking.
    pending: AtomicBool,
    capacity: usize,
}

/// Sends messages into one shard from any thread (bounded; for control traffic).
pub struct Injector<M> {
    shard: ShardId,
    inbox: Arc<Inbox<M>>,
    doorbell: Arc<Doorbell>,
    eventfd: Arc<EventFd>,
}

impl<M> Clone for Injector<M> {
    fn clone(&self) -> Self {
        Injector {
            shard: self.shard,
            inbox: self.inbox.clone(),
            doorbell: self.doorbell.clone(),
            eventfd: self.eventfd.clone(),
        }
    }
}

impl<M: Send> Injector<M> {
    /// The shard this injector feeds.
    pub fn shard(&self) -> ShardId {
        self.shard
    }

    /// Queues `msg` for the shard ([`Handler::on_message`] with `from == INJECTED`);
    /// `Err(msg)` when its queue holds `injector_capacity` messages already.
    pub fn send(&self, msg: M) -> Result<(), M> {
        {
            let mut queue = self.inbox.queue.lock().unwrap_or_else(|e| e.into_inner());
            if queue.len() >= self.inbox.capacity {
                return Err(msg);
            }
            queue.push_back(msg);
            self.inbox.pending.store(true, Ordering::Release);
        }
        if self.doorbell.should_wake() {
            self.eventfd.notify();
        }
        Ok(())
    }
}

/// The `from` shard id of messages that came through an [`Injector`].
pub const INJECTED: ShardId = ShardId::MAX;

/// A started runtime: its shard threads run until stopped.
pub struct Runtime<S: Handler> {
    handle: RuntimeHandle,
    injectors: Vec<Injector<S::Msg>>,
    threads: Vec<JoinHandle<io::Result<(S, ShardStats)>>>,
}

/// Everything one shard thread takes with it.
struct ShardParts<M> {
    shard: ShardId,
    inbox: Arc<Inbox<M>>,
    producers: Vec<Option<Producer<M>>>,
    consumers: Vec<Option<Consumer<M>>>,
    doorbells: Vec<Arc<Doorbell>>,
}

impl<S: Handler> Runtime<S> {
    /// Starts `config.shard_count` shard threads. `factory` runs on each shard thread
    /// and builds that shard's handler and driver. Refuses a config whose counts or
    /// limits are zero or inconsistent (see [`validate_config`]), and gives the error of
    /// an eventfd or a thread that cannot be created.
    pub fn start<F>(config: RuntimeConfig, factory: F) -> io::Result<Self>
    where
        F: Fn(&ShardInit) -> io::Result<(S, S::Driver)> + Send + Sync + 'static,
    {
        validate_config(&config)?;
        let n = config.shard_count as usize;
        let eventfds: Vec<Arc<EventFd>> = (0..n)
            .map(|_| EventFd::new().map(Arc::new))
            .collect::<io::Result<_>>()?;
        let doorbells: Vec<Arc<Doorbell>> = (0..n).map(|_| Arc::new(Doorbell::new())).collect();
        let shared = Arc::new(Shared {
            stopping: AtomicBool::new(false),
            failure: Mutex::new(None),
            failed: std::sync::Condvar::new(),
            eventfds: eventfds.clone(),
            parked: (0..n).map(|_| AtomicU64::new(0)).collect(),
        });
        let parts = build_mesh::<S::Msg>(&config, &doorbells);
        let injectors = parts
            .iter()
            .map(|p| Injector {
                shard: p.shard,
                inbox: p.inbox.clone(),
                doorbell: doorbells[p.shard as usize].clone(),
                eventfd: eventfds[p.shard as usize].clone(),
            })
            .collect();
        let factory = Arc::new(factory);
        let mut threads = Vec::with_capacity(n);
        for part in parts {
            threads.push(spawn_shard(
                &config,
                part,
                factory.clone(),
                shared.clone(),
                eventfds.clone(),
            )?);
        }
        Ok(Runtime {
            handle: RuntimeHandle { shared },
            injectors,
            threads,
        })
    }

    /// A handle that can stop the runtime from any thread.
    pub fn handle(&self) -> RuntimeHandle {
        self.handle.clone()
    }

    /// The injector of shard `shard`, for messages from outside the runtime.
    pub fn injector(&self, shard: ShardId) -> Injector<S::Msg> {
        self.injectors[shard as usize].clone()
    }

    /// Waits for every shard to stop; returns each shard's handler and counters, in
    /// shard order. A shard that failed (driver error, factory error) gives its error.
    pub fn join(self) -> Vec<io::Result<(S, ShardStats)>> {
        self.threads
            .into_iter()
            .map(|t| {
                t.join()
                    .unwrap_or_else(|_| Err(io::Error::other("shard thread panicked")))
            })
            .collect()
    }
}

/// Checks the counts and limits `Runtime::start` relies on. Refuses (`InvalidInput`)
/// zero shards, a ring capacity that is not a power of two >= 2, a zero batch or
/// injector limit, and a peer queue smaller than one outbox batch.
fn validate_config(config: &RuntimeConfig) -> io::Result<()> {
    if config.shard_count == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "shard_count must be at least 1",
        ));
    }
    if !config.ring_capacity.is_power_of_two() || config.ring_capacity < 2 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "ring_capacity must be a power of two >= 2",
        ));
    }
    if config.outbox_batch_max == 0
        || config.peer_queue_max < config.outbox_batch_max
        || config.inbound_batch_max == 0
        || config.injector_capacity == 0
    {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "batch limits must be at least 1 (and peer_queue_max at least outbox_batch_max)",
        ));
    }
    Ok(())
}

/// Builds each shard's parts: its injector inbox and the mesh, a ring (i -> j) of
/// `config.ring_capacity` for every ordered pair i != j. Refuses nothing.
fn build_mesh<M: Send>(config: &RuntimeConfig, doorbells: &[Arc<Doorbell>]) -> Vec<ShardParts<M>> {
    let n = config.shard_count as usize;
    let mut parts: Vec<ShardParts<M>> = (0..n)
        .map(|i| ShardParts {
            shard: i as ShardId,
            inbox: Arc::new(Inbox {
                queue: Mutex::new(VecDeque::new()),
                pending: AtomicBool::new(false),
                capacity: config.injector_capacity,
            }),
            producers: (0..n).map(|_| None).collect(),
            consumers: (0..n).map(|_| None).collect(),
            doorbells: doorbells.to_vec(),
        })
        .collect();
    for i in 0..n {
        for j in 0..n {
            if i != j {
                let (p, c) = ring::channel(config.ring_capacity);
                parts[i].producers[j] = Some(p);
                parts[j].consumers[i] = Some(c);
            }
        }
    }
    parts
}

/// Spawns the thread of shard `part.shard`: it pins itself, builds its handler and
/// driver with `factory`, and runs [`run_shard`]. A panic or an error ends this shard
/// only; it is logged and recorded in `shared` so the process can stop instead of
/// serving with a shard missing. Gives the error of a thread that cannot be spawned.
fn spawn_shard<S, F>(
    config: &RuntimeConfig,
    part: ShardParts<S::Msg>,
    factory: Arc<F>,
    shared: Arc<Shared>,
    eventfds: Vec<Arc<EventFd>>,
) -> io::Result<JoinHandle<io::Result<(S, ShardStats)>>>
where
    S: Handler,
    F: Fn(&ShardInit) -> io::Result<(S, S::Driver)> + Send + Sync + 'static,
{
    let i = part.shard as usize;
    let config = config.clone();
    std::thread::Builder::new()
        .name(format!("{}-{}", config.thread_name, i))
        .spawn(move || {
            pin_to_core(&config, i);
            let init = ShardInit {
                shard: i as ShardId,
                shard_count: config.shard_count,
                doorbell: eventfds[i].clone(),
            };
            let watch = shared.clone();
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let (handler, driver) = factory(&init)?;
                run_shard(config, part, eventfds, shared, handler, driver)
            }))
            .unwrap_or_else(|panic| {
                Err(io::Error::other(format!(
                    "panicked: {}",
                    panic_message(&*panic)
                )))
            });
            if let Err(err) = &result {
                tracing::error!(shard = i, %err, "shard thread ended");
                watch.fail(format!("shard {i}: {err}"));
            }
            result
        })
}

/// The text of a panic payload (`&str` or `String`), or "unknown panic".
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

fn pin_to_core(config: &RuntimeConfig, shard: usize) {
    if config.pin_cores.is_empty() {
        return;
    }
    let core = config.pin_cores[shard % config.pin_cores.len()];
    if !core_affinity::set_for_current(core_affinity::CoreId { id: core }) {
        tracing::warn!(
            shard,
            core,
            "could not pin shard thread to its core; it runs unpinned"
        );
    }
}

/// The body of one shard thread: turns (inbound messages, due timers, ready IO, the
/// handler's own work, outbox flush) until the runtime stops, spinning a little and
/// then parking in the driver when a turn finds no work. Gives the driver's error.
fn run_shard<S: Handler>(
    config: RuntimeConfig,
    part: ShardParts<S::Msg>,
    eventfds: Vec<Arc<EventFd>>,
    shared: Arc<Shared>,
    mut handler: S,
    mut driver: S::Driver,
) -> io::Result<(S, ShardStats)> {
    let start = Instant::now();
    let ShardParts {
        shard,
        inbox,
        producers,
        consumers,
        doorbells,
    } = part;
    let my_doorbell = doorbells[shard as usize].clone();
    let mut inbound = Inbound {
        consumers,
        inbox,
        batch_max: config.inbound_batch_max,
    };
    let mut cx = new_context::<S>(&config, shard, producers, doorbells, eventfds, shared);
    let mut events: Vec<<S::Driver as Driver>::Event> = Vec::new();
    let mut fired: Vec<(TimerHandle, S::Timer)> = Vec::new();
    let mut idle = Idle::new(&config, start);

    handler.on_start(&mut cx, &mut driver);
    cx.flush_all();
    loop {
        let now = Instant::now();
        idle.turn(now);
        cx.now_ms = now.duration_since(start).as_millis() as u64;
        cx.stats.turns += 1;
        // 1. Messages from peers, the injector and this shard, a bounded batch of each.
        let mut work = inbound.drain(&mut cx, &mut handler, &mut driver);
        // 2. Due timers.
        work += fire_timers(&mut cx, &mut fired, &mut handler, &mut driver);
        // 3. IO that is ready, without blocking (the driver reuses the turn's clock).
        driver.poll_now(now, &mut events)?;
        work += events.len();
        dispatch_io(&mut cx, &mut events, &mut handler, &mut driver);
        // 4. The handler's own work; 5. flush outboxes.
        work += handler.on_turn(&mut cx, &mut driver);
        if cx.flush_all() {
            work += 1;
        }

        if cx.shared.stopping.load(Ordering::Acquire) {
            break;
        }
        if work > 0 || cx.outboxes_pending() || !cx.self_queue.is_empty() {
            idle.work(now);
            continue;
        }
        if idle.keep_spinning(now) {
            std::hint::spin_loop();
            continue;
        }
        idle.park(now);
        if park::<S>(
            &mut cx,
            &inbound,
            &my_doorbell,
            start,
            &mut driver,
            &mut events,
        )? {
            dispatch_io(&mut cx, &mut events, &mut handler, &mut driver);
        }
    }
    handler.on_stop(&mut cx, &mut driver);
    cx.flush_all();
    Ok((handler, cx.stats))
}

/// The shard loop's idle time, fed to its [`SpinPolicy`]: whether the previous turn
/// was busy, the current idle spell (its start and what it may spin), and the park
/// that ended the last one. Uses the turn's clock reading only.
struct Idle {
    policy: SpinPolicy,
    last_turn: Instant,
    last_busy: bool,
    spell: Option<(Instant, u64)>,
    /// The spell that parked: its spin (ns) and when it parked.
    parked: Option<(u64, Instant)>,
}

fn nanos(d: Duration) -> u64 {
    d.as_nanos().min(u128::from(u64::MAX)) as u64
}

impl Idle {
    fn new(config: &RuntimeConfig, start: Instant) -> Self {
        Idle {
            policy: SpinPolicy::new(
                config.idle_spin_us.saturating_mul(1_000),
                config.idle_spin_adaptive,
                config.idle_spin_busy_percent,
            ),
            last_turn: start,
            last_busy: false,
            spell: None,
            parked: None,
        }
    }

    /// A turn starts at `now`: the previous one's busy time, or the park's length.
    #[inline]
    fn turn(&mut self, now: Instant) {
        if self.last_busy {
            self.policy.on_busy(nanos(now - self.last_turn));
        }
        self.last_turn = now;
        if let Some((spun_ns, at)) = self.parked.take() {
            self.policy.on_park(spun_ns, nanos(now - at));
        }
    }

    /// The turn found work: ends the idle spell, if one was on.
    #[inline]
    fn work(&mut self, now: Instant) {
        self.last_busy = true;
        if let Some((since, _)) = self.spell.take() {
            self.policy.on_work(nanos(now - since));
        }
    }

    /// The turn found no work: whether to spin on (else park).
    #[inline]
    fn keep_spinning(&mut self, now: Instant) -> bool {
        self.last_busy = false;
        let policy = &self.policy;
        let (since, allowed_ns) = *self.spell.get_or_insert_with(|| (now, policy.allowed_ns()));
        nanos(now - since) < allowed_ns
    }

    /// The shard parks at `now`, ending the spell (a park that found work at once
    /// counts as a zero-length one).
    fn park(&mut self, now: Instant) {
        if let Some((since, _)) = self.spell.take() {
            self.parked = Some((nanos(now - since), now));
        }
    }
}

/// Builds shard `shard`'s [`Context`]: its outboxes (one per peer), rings, peers'
/// doorbells and eventfds, and a timer wheel of `config.timers_max`. Refuses nothing.
fn new_context<S: Handler>(
    config: &RuntimeConfig,
    shard: ShardId,
    producers: Vec<Option<Producer<S::Msg>>>,
    doorbells: Vec<Arc<Doorbell>>,
    eventfds: Vec<Arc<EventFd>>,
    shared: Arc<Shared>,
) -> Context<S::Msg, S::Timer> {
    Context {
        shard,
        shard_count: config.shard_count,
        now_ms: 0,
        outbox_batch_max: config.outbox_batch_max,
        ring_capacity: config.ring_capacity,
        peer_queue_max: config.peer_queue_max,
        outboxes: (0..config.shard_count)
            .map(|_| PeerQueue {
                urgent: VecDeque::new(),
                normal: VecDeque::with_capacity(config.outbox_batch_max),
            })
            .collect(),
        producers,
        peer_doorbells: doorbells,
        peer_eventfds: eventfds,
        self_queue: VecDeque::new(),
        timers: TimerWheel::new(0, config.timers_max),
        shared,
        stats: ShardStats::default(),
    }
}

/// Where one shard's messages come from: the rings from its peers and its injector
/// inbox, each read at most `batch_max` messages per turn.
struct Inbound<M> {
    /// `consumers[p]`: the ring from peer `p` (`None` for this shard itself).
    consumers: Vec<Option<Consumer<M>>>,
    inbox: Arc<Inbox<M>>,
    batch_max: usize,
}

impl<M: Send> Inbound<M> {
    /// Hands the handler a bounded batch from each peer ring, from the injector inbox,
    /// and from the shard's own queue (`cx.self_queue`); returns how many it handed.
    /// Refuses nothing: what is beyond the batch waits for the next turn.
    #[inline]
    fn drain<S: Handler<Msg = M>>(
        &mut self,
        cx: &mut Context<M, S::Timer>,
        handler: &mut S,
        driver: &mut S::Driver,
    ) -> usize {
        let mut work = 0usize;
        for (from, consumer) in self.consumers.iter_mut().enumerate() {
            let Some(consumer) = consumer.as_mut() else {
                continue;
            };
            let n = consumer.pop_batch(self.batch_max, |msg| {
                handler.on_message(cx, driver, from as ShardId, msg)
            });
            cx.stats.messages_received += n as u64;
            work += n;
        }
        if self.inbox.pending.load(Ordering::Acquire) {
            let batch: Vec<M> = {
                let mut queue = self.inbox.queue.lock().unwrap_or_else(|e| e.into_inner());
                let n = queue.len().min(self.batch_max);
                let batch = queue.drain(..n).collect();
                self.inbox
                    .pending
                    .store(!queue.is_empty(), Ordering::Release);
                batch
            };
            work += batch.len();
            cx.stats.messages_received += batch.len() as u64;
            for msg in batch {
                handler.on_message(cx, driver, INJECTED, msg);
            }
        }
        let local = cx.self_queue.len().min(self.batch_max);
        for _ in 0..local {
            let Some(msg) = cx.self_queue.pop_front() else {
                break;
            };
            handler.on_message(cx, driver, cx.shard, msg);
        }
        cx.stats.messages_received += local as u64;
        work + local
    }

    /// Whether a peer ring or the injector inbox holds a message (checked with
    /// `SeqCst` after announcing sleep, so a wake-up cannot be missed).
    fn pending(&self) -> bool {
        self.consumers.iter().flatten().any(|c| !c.is_empty())
            || self.inbox.pending.load(Ordering::SeqCst)
    }
}

/// Fires the timers due at `cx.now_ms` (collected into `fired`, reused across turns)
/// and returns how many fired. Refuses nothing.
#[inline]
fn fire_timers<S: Handler>(
    cx: &mut Context<S::Msg, S::Timer>,
    fired: &mut Vec<(TimerHandle, S::Timer)>,
    handler: &mut S,
    driver: &mut S::Driver,
) -> usize {
    let now_ms = cx.now_ms;
    cx.timers.advance(now_ms, |handle, _deadline, value| {
        fired.push((handle, value))
    });
    let n = fired.len();
    cx.stats.timers_fired += n as u64;
    for (handle, value) in fired.drain(..) {
        handler.on_timer(cx, driver, handle, value);
    }
    n
}

/// Hands every event in `events` to the handler, leaving `events` empty.
#[inline]
fn dispatch_io<S: Handler>(
    cx: &mut Context<S::Msg, S::Timer>,
    events: &mut Vec<<S::Driver as Driver>::Event>,
    handler: &mut S,
    driver: &mut S::Driver,
) {
    for event in events.drain(..) {
        handler.on_io(cx, driver, event);
    }
}

/// Parks the shard: announces sleep on its doorbell, re-checks every inbound source
/// and the stop flag (then returns `false` without waiting), else waits in the driver
/// until IO, a wake-up or the next timer deadline; returns `true` with the events in
/// `events`. Gives the driver's error.
fn park<S: Handler>(
    cx: &mut Context<S::Msg, S::Timer>,
    inbound: &Inbound<S::Msg>,
    my_doorbell: &Doorbell,
    start: Instant,
    driver: &mut S::Driver,
    events: &mut Vec<<S::Driver as Driver>::Event>,
) -> io::Result<bool> {
    my_doorbell.prepare_sleep();
    if inbound.pending() || cx.shared.stopping.load(Ordering::SeqCst) {
        my_doorbell.cancel_sleep();
        return Ok(false);
    }
    let timeout = cx.timers.next_deadline().map(|deadline_ms| {
        let now_ms = start.elapsed().as_millis() as u64;
        Duration::from_millis(deadline_ms.saturating_sub(now_ms))
    });
    cx.stats.parks += 1;
    let me = cx.shard as usize;
    cx.shared.parked[me].store(1, Ordering::SeqCst);
    let result = driver.poll(timeout, events);
    cx.shared.parked[me].store(0, Ordering::SeqCst);
    my_doorbell.cancel_sleep();
    result?;
    Ok(true)
}
