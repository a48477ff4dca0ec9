//! Bounded lock-free single-producer/single-consumer rings and a
//! sleeping-consumer doorbell. No syscalls, no allocation after
//! [`channel`].
//!
//! # Ring contract ([`spsc`])
//! - [`channel`]`(capacity)` returns one [`Producer`] and one [`Consumer`];
//!   `capacity` must be a power of two `>= 2` (checked: a panic, since it is a
//!   programming error). The ring never grows: a full ring makes
//!   [`Producer::push`] return `Err(value)` (backpressure, nothing is lost).
//! - Items are delivered exactly once, in push order.
//! - Each endpoint is `Send` (if `T: Send`) but not `Sync`: it is owned by one
//!   thread at a time. All methods are wait-free.
//! - [`Producer::push_batch`] / [`Consumer::pop_batch`] move many items with a
//!   single publication of the shared index (one cache-line transfer per batch).
//! - Each side caches the other side's index and only reads the shared one when
//!   the cached value says full (producer) or empty (consumer).
//! - Dropping one endpoint makes the other report `is_abandoned()`; items still
//!   in the ring stay poppable. When both endpoints are gone, unconsumed items
//!   are dropped exactly once.
//!
//! # Doorbell contract ([`doorbell`])
//! One consumer, any number of producers (each on its own ring into that
//! consumer). The wake mechanism itself (eventfd, futex, park) is the caller's.
//!
//! Consumer, before sleeping:
//! 1. [`Doorbell::prepare_sleep`];
//! 2. re-check every ring it consumes (e.g. [`Consumer::is_empty`]); if any is
//!    non-empty: [`Doorbell::cancel_sleep`] and go back to work;
//! 3. otherwise sleep on the wake mechanism; after waking (by a producer, a
//!    timeout or spuriously) call [`Doorbell::cancel_sleep`].
//!
//! Producer, after publishing items ([`Producer::push`] / `push_batch`):
//! call [`Doorbell::should_wake`]; if it returns `true`, wake the consumer.
//!
//! Guarantee: under any interleaving, a consumer that follows this protocol
//! never sleeps while an item published before a `should_wake` call sits in one
//! of its rings, and at most one producer gets `true` per announced sleep.
//! Spurious wakes are possible (a claimed wake may arrive after the consumer
//! already woke up by itself); the consumer must tolerate them. Both
//! `prepare_sleep` and `should_wake` contain a `SeqCst` fence (Dekker pattern),
//! so the ring operations themselves only need acquire/release.
//!
//! # Example
//! ```
//! use std::sync::Arc;
//! use std::thread;
//!
//! let bell = Arc::new(ring::Doorbell::new());
//! let (mut tx, mut rx) = ring::channel::<u64>(64);
//!
//! let consumer_bell = Arc::clone(&bell);
//! let consumer = thread::spawn(move || {
//!     let mut sum = 0;
//!     let mut received = 0;
//!     while received < 1000 {
//!         let n = rx.pop_batch(32, |v| sum += v);
//!         received += n;
//!         if n > 0 {
//!             continue;
//!         }
//!         consumer_bell.prepare_sleep();
//!         if rx.is_empty() {
//!             thread::park(); // the wake mechanism (an eventfd in a shard)
//!         }
//!         consumer_bell.cancel_sleep();
//!     }
//!     sum
//! });
//!
//! let mut items = 0..1000u64;
//! while !items.is_empty() {
//!     if tx.push_batch(&mut items) > 0 && bell.should_wake() {
//!         consumer.thread().unpark();
//!     }
//!     // (a real producer would do other work here instead of spinning)
//! }
//! assert_eq!(consumer.join().unwrap(), 999 * 1000 / 2);
//! ```
//!
//! # Checking
//! Loom models: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p ring
//! --release --test loom`. Miri: `cargo +nightly miri test -p ring --test unit
//! --test stress` (sizes shrink under `cfg(miri)`).

#![warn(clippy::too_many_lines)] // every function at most 80 code lines (clippy.toml)
#![warn(missing_docs)]

pub mod doorbell;
pub mod spsc;
mod sync;

pub use doorbell::Doorbell;
pub use spsc::{channel, Consumer, Producer};
