//! Sleeping-consumer doorbell (Seastar-style "sleeping" flag).
//!
//! Shared (e.g. in an `Arc`) between one consumer and any number of producers.
//! See the crate docs for the protocol. Why no wake-up is lost (Dekker
//! pattern): the consumer does `swap sleeping=true; fence(SeqCst); load
//! tails` (`prepare_sleep` then the re-check); a producer does `store tail;
//! fence(SeqCst); load sleeping` (`push` then `should_wake`). The two fences
//! are totally ordered: if the consumer's comes first, the producer's load sees
//! `sleeping == true` (or a later store: another producer's claim, which wakes
//! the consumer, or the consumer's own `cancel_sleep`, which means it is
//! awake); if the producer's comes first, the consumer's re-check sees the new
//! tail and it does not sleep.

use crossbeam_utils::CachePadded;

use crate::sync::{fence, AtomicBool, Ordering};

/// Sleeping flag of one consumer, on its own cache line.
#[derive(Debug)]
pub struct Doorbell {
    sleeping: CachePadded<AtomicBool>,
}

impl Doorbell {
    /// A doorbell whose consumer is awake.
    #[cfg(not(loom))]
    pub const fn new() -> Self {
        Self {
            sleeping: CachePadded::new(AtomicBool::new(false)),
        }
    }

    /// A doorbell whose consumer is awake (loom build: not `const`).
    #[cfg(loom)]
    pub fn new() -> Self {
        Self {
            sleeping: CachePadded::new(AtomicBool::new(false)),
        }
    }

    /// Consumer: announces it is about to sleep. Contains a `SeqCst` fence
    /// ordering the announcement before the re-check that MUST follow: if any
    /// ring it consumes is non-empty, call [`cancel_sleep`](Self::cancel_sleep)
    /// and do not sleep; otherwise sleep until woken.
    #[inline]
    pub fn prepare_sleep(&self) {
        // A swap rather than a store: the C++ model does not need it (a store
        // is mo-after any producer's earlier claim by RMW atomicity), but
        // loom does not model RMW atomicity against later plain stores and
        // reports a false lost wake-up; the RMW makes the order explicit.
        // Costs one locked instruction on the (rare) going-to-sleep path.
        self.sleeping.swap(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// Consumer: withdraws the announcement (re-check found work), or clears
    /// it after waking for any reason (wake, timeout, spurious).
    #[inline]
    pub fn cancel_sleep(&self) {
        self.sleeping.store(false, Ordering::Relaxed);
    }

    /// Producer: call AFTER publishing items. Returns `true` iff the consumer
    /// announced sleep and no other producer claimed the wake yet; the caller
    /// must then wake it. At most one caller gets `true` per announced sleep.
    /// Contains a `SeqCst` fence; when the consumer is awake the rest is one
    /// plain load (no read-modify-write, the line stays shared).
    #[inline]
    pub fn should_wake(&self) -> bool {
        fence(Ordering::SeqCst);
        if !self.sleeping.load(Ordering::Relaxed) {
            return false;
        }
        self.sleeping.swap(false, Ordering::AcqRel)
    }

    /// `true` while the consumer has announced sleep and nobody claimed the
    /// wake (a snapshot, for metrics and tests).
    #[inline]
    pub fn is_sleeping(&self) -> bool {
        self.sleeping.load(Ordering::Relaxed)
    }
}

impl Default for Doorbell {
    fn default() -> Self {
        Self::new()
    }
}
