//! Bounded wait-free SPSC ring (rtrb style) with batch push/pop.
//!
//! Positions are free-running `usize` counters (wrapping); a slot index is
//! `position & mask`. `tail - head` is the number of items in the ring, always
//! `<= capacity`. The producer owns `tail` (release-stores it after writing a
//! slot), the consumer owns `head` (release-stores it after reading a slot);
//! each acquire-loads the other's index only when its cached copy says the ring
//! is full (producer) or empty (consumer).

use core::cell::Cell;
use core::fmt;
use core::mem::MaybeUninit;

use crossbeam_utils::CachePadded;

use crate::sync::{Arc, AtomicBool, AtomicUsize, Ordering, UnsafeCell};

type Slot<T> = UnsafeCell<MaybeUninit<T>>;

/// State shared by the two endpoints.
struct Shared<T> {
    /// Next position to read. Written only by the consumer.
    head: CachePadded<AtomicUsize>,
    /// Next position to write. Written only by the producer.
    tail: CachePadded<AtomicUsize>,
    producer_gone: AtomicBool,
    consumer_gone: AtomicBool,
    /// `capacity - 1`.
    mask: usize,
    /// `capacity` slots; those in `[head, tail)` are initialized.
    slots: Box<[Slot<T>]>,
}

// SAFETY: `Shared` is only reachable through one `Producer` and one `Consumer`.
// A slot is written only by the producer while outside `[head, tail)` and read
// only by the consumer while inside it; the release/acquire pairs on `head` and
// `tail` order those accesses. Values of `T` cross threads, hence `T: Send`.
unsafe impl<T: Send> Sync for Shared<T> {}
// SAFETY: see the `Sync` impl; owning `Shared` owns values of `T: Send`.
unsafe impl<T: Send> Send for Shared<T> {}

impl<T> Shared<T> {
    /// Slot for `position`.
    #[inline(always)]
    fn slot(&self, position: usize) -> &Slot<T> {
        let index = position & self.mask;
        debug_assert!(index < self.slots.len());
        // SAFETY: `slots.len() == mask + 1`, so `index <= mask` is in bounds.
        unsafe { self.slots.get_unchecked(index) }
    }
}

/// The slot at `index` of the slot array starting at `slots`.
///
/// # Safety
/// `index` is less than the capacity of the ring `slots` belongs to, and that
/// ring is alive for `'a`.
#[inline(always)]
unsafe fn slot_at<'a, T>(slots: *const Slot<T>, index: usize) -> &'a Slot<T> {
    // SAFETY: in bounds of the live slot array (caller contract).
    unsafe { &*slots.add(index) }
}

/// Moves `value` into the free slot `slot`.
///
/// # Safety
/// The slot is outside `[head, tail)`: it holds no live value and the consumer
/// does not access it until a tail past it is published.
#[inline(always)]
unsafe fn write_slot<T>(slot: &Slot<T>, value: T) {
    slot.with_mut(|p| {
        // SAFETY: exclusive access to an empty slot (caller contract).
        unsafe { p.cast::<T>().write(value) }
    });
}

/// Moves the value out of the published slot `slot`.
///
/// # Safety
/// The slot is in `[head, tail)` with `tail` acquire-loaded by the consumer,
/// and the caller advances the head past it so the value is moved out once.
#[inline(always)]
unsafe fn read_slot<T>(slot: &Slot<T>) -> T {
    slot.with(|p| {
        // SAFETY: initialized, published, and read once (caller contract).
        unsafe { p.cast::<T>().read() }
    })
}

impl<T> Drop for Shared<T> {
    fn drop(&mut self) {
        // Both endpoints are gone; `Arc`'s drop synchronizes with their last
        // stores, so relaxed loads see final values.
        let mut head = self.head.load(Ordering::Relaxed);
        let tail = self.tail.load(Ordering::Relaxed);
        debug_assert!(tail.wrapping_sub(head) <= self.mask + 1);
        while head != tail {
            self.slot(head).with_mut(|p| {
                // SAFETY: positions in `[head, tail)` hold initialized values
                // that nobody popped; each is dropped once here.
                unsafe { p.cast::<T>().drop_in_place() }
            });
            head = head.wrapping_add(1);
        }
    }
}

/// Creates a ring of `capacity` slots and returns its two endpoints.
///
/// # Panics
/// If `capacity` is not a power of two `>= 2` (a programming error: sizes are
/// validated with the configuration).
pub fn channel<T: Send>(capacity: usize) -> (Producer<T>, Consumer<T>) {
    assert!(
        capacity >= 2 && capacity.is_power_of_two(),
        "ring::channel: capacity must be a power of two >= 2, got {capacity}"
    );
    let slots: Box<[Slot<T>]> = (0..capacity)
        .map(|_| UnsafeCell::new(MaybeUninit::uninit()))
        .collect();
    let mask = capacity - 1;
    let shared = Arc::new(Shared {
        head: CachePadded::new(AtomicUsize::new(0)),
        tail: CachePadded::new(AtomicUsize::new(0)),
        producer_gone: AtomicBool::new(false),
        consumer_gone: AtomicBool::new(false),
        mask,
        slots,
    });
    let producer = Producer {
        shared: Arc::clone(&shared),
        tail: 0,
        cached_head: Cell::new(0),
        mask,
    };
    let consumer = Consumer {
        shared,
        head: 0,
        cached_tail: Cell::new(0),
        mask,
    };
    (producer, consumer)
}

/// Writing endpoint of a ring. `Send` (for `T: Send`), not `Sync`.
pub struct Producer<T> {
    shared: Arc<Shared<T>>,
    /// Authoritative next write position (the shared `tail` equals it after
    /// every publish).
    tail: usize,
    /// Last `head` seen; `<=` the real head.
    cached_head: Cell<usize>,
    /// `capacity - 1` (local copy: no pointer chase on the fast path).
    mask: usize,
}

impl<T: Send> Producer<T> {
    /// Pushes `value`, or returns it as `Err(value)` if the ring is full.
    #[inline]
    pub fn push(&mut self, value: T) -> Result<(), T> {
        let tail = self.tail;
        if tail.wrapping_sub(self.cached_head.get()) > self.mask && self.refresh_free() == 0 {
            return Err(value);
        }
        self.write(tail, value);
        self.tail = tail.wrapping_add(1);
        self.shared.tail.store(self.tail, Ordering::Release);
        Ok(())
    }

    /// Pushes items from `items` while there is room, then publishes them all
    /// with one store. Returns how many were pushed. `items.next()` is called
    /// only when a slot is free, so an item is never taken and then lost; the
    /// remaining items stay in the iterator. If `items.next()` panics, the
    /// items already written are published.
    #[inline]
    pub fn push_batch<I: Iterator<Item = T>>(&mut self, items: &mut I) -> usize {
        let start = self.tail;
        let capacity = self.mask + 1;
        let mask = self.mask;
        let slots = self.shared.slots.as_ptr();
        let mut batch = PublishTail {
            tail: start,
            producer: self,
        };
        'fill: loop {
            let mut free = capacity - batch.tail.wrapping_sub(batch.producer.cached_head.get());
            if free == 0 {
                // Do not touch the consumer's line for an exhausted iterator.
                if items.size_hint().1 == Some(0) {
                    break 'fill;
                }
                let head = batch.producer.shared.head.load(Ordering::Acquire);
                batch.producer.cached_head.set(head);
                free = capacity - batch.tail.wrapping_sub(head);
                if free == 0 {
                    break 'fill;
                }
            }
            let end = batch.tail.wrapping_add(free);
            while batch.tail != end {
                let Some(value) = items.next() else {
                    break 'fill;
                };
                // SAFETY: `batch.tail & mask < capacity`; `batch.tail` is
                // below `cached head + capacity` (`end`), and the cached head
                // is never ahead of the real one, so the slot is free and not
                // yet published.
                unsafe { write_slot(slot_at(slots, batch.tail & mask), value) };
                batch.tail = batch.tail.wrapping_add(1);
            }
        }
        batch.tail.wrapping_sub(start)
        // `batch` drops here: one release store of the new tail.
    }

    /// Number of free slots (reads the consumer's index and refreshes the
    /// cached copy). May be stale by the time it is used, but only too low.
    #[inline]
    pub fn free_slots(&self) -> usize {
        self.refresh_free()
    }

    /// Number of slots of the ring.
    #[inline]
    pub fn capacity(&self) -> usize {
        self.mask + 1
    }

    /// `true` once the consumer was dropped (pushed items will never be read).
    #[inline]
    pub fn is_abandoned(&self) -> bool {
        self.shared.consumer_gone.load(Ordering::Acquire)
    }

    /// Reloads the consumer's index into the cache; returns the free slots.
    #[inline]
    fn refresh_free(&self) -> usize {
        let head = self.shared.head.load(Ordering::Acquire);
        self.cached_head.set(head);
        let used = self.tail.wrapping_sub(head);
        debug_assert!(used <= self.mask + 1);
        self.mask + 1 - used
    }

    /// Writes `value` into the free slot at `position` (not yet published).
    #[inline(always)]
    fn write(&self, position: usize, value: T) {
        debug_assert!(position.wrapping_sub(self.cached_head.get()) <= self.mask);
        // SAFETY: `position & mask < capacity`. `position` is outside
        // `[head, tail)` (checked against the cached head, which is never ahead of the real one), so the consumer
        // does not access this slot until the tail is published, and the slot
        // holds no live value (it was popped or never written).
        unsafe {
            write_slot(
                slot_at(self.shared.slots.as_ptr(), position & self.mask),
                value,
            )
        }
    }
}

/// Commits and publishes the batch's tail on drop (end of batch, or
/// unwinding). The running tail lives here, in a local, so the loop keeps it
/// in a register.
struct PublishTail<'a, T> {
    producer: &'a mut Producer<T>,
    tail: usize,
}

impl<T> Drop for PublishTail<'_, T> {
    #[inline(always)]
    fn drop(&mut self) {
        // An empty batch must not dirty the shared line.
        if self.tail != self.producer.tail {
            self.producer.tail = self.tail;
            self.producer
                .shared
                .tail
                .store(self.tail, Ordering::Release);
        }
    }
}

impl<T> Drop for Producer<T> {
    fn drop(&mut self) {
        self.shared.producer_gone.store(true, Ordering::Release);
    }
}

impl<T> fmt::Debug for Producer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Producer")
            .field("capacity", &(self.mask + 1))
            .field("tail", &self.tail)
            .finish_non_exhaustive()
    }
}

/// Reading endpoint of a ring. `Send` (for `T: Send`), not `Sync`.
pub struct Consumer<T> {
    shared: Arc<Shared<T>>,
    /// Authoritative next read position (the shared `head` equals it after
    /// every publish).
    head: usize,
    /// Last `tail` seen; `<=` the real tail.
    cached_tail: Cell<usize>,
    /// `capacity - 1` (local copy: no pointer chase on the fast path).
    mask: usize,
}

impl<T: Send> Consumer<T> {
    /// Pops the oldest item, or `None` if the ring is empty.
    #[inline]
    pub fn pop(&mut self) -> Option<T> {
        let head = self.head;
        if head == self.cached_tail.get() && self.refresh_len() == 0 {
            return None;
        }
        let value = self.read(head);
        self.head = head.wrapping_add(1);
        self.shared.head.store(self.head, Ordering::Release);
        Some(value)
    }

    /// Pops up to `max` items in order, calling `f` on each, then frees their
    /// slots with one store. Returns how many were popped. If `f` panics, the
    /// items already handed to `f` are released (never handed out twice) and
    /// the rest stay in the ring.
    #[inline]
    pub fn pop_batch<F: FnMut(T)>(&mut self, max: usize, mut f: F) -> usize {
        let mut available = self.cached_tail.get().wrapping_sub(self.head);
        if available < max {
            available = self.refresh_len();
        }
        let count = available.min(max);
        if count == 0 {
            return 0;
        }
        let mask = self.mask;
        let slots = self.shared.slots.as_ptr();
        let end = self.head.wrapping_add(count);
        let mut batch = PublishHead {
            head: self.head,
            consumer: self,
        };
        while batch.head != end {
            // SAFETY: `batch.head & mask < capacity`; `batch.head` is in
            // `[head, cached tail)` (`count <= available`), published by the
            // acquire load of the tail; the head advances right after, so each
            // value is moved out once, even if `f` unwinds.
            let value = unsafe { read_slot(slot_at(slots, batch.head & mask)) };
            batch.head = batch.head.wrapping_add(1);
            f(value);
        }
        count
        // `batch` drops here: one release store of the new head.
    }

    /// Number of items in the ring (reads the producer's index and refreshes
    /// the cached copy). May be stale by the time it is used, but only too low.
    #[inline]
    pub fn len(&self) -> usize {
        self.refresh_len()
    }

    /// `true` if the ring holds no item (reads the producer's index). This is
    /// the re-check of the doorbell protocol.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.refresh_len() == 0
    }

    /// Number of slots of the ring.
    #[inline]
    pub fn capacity(&self) -> usize {
        self.mask + 1
    }

    /// `true` once the producer was dropped (no more items will arrive; those
    /// already in the ring can still be popped).
    #[inline]
    pub fn is_abandoned(&self) -> bool {
        self.shared.producer_gone.load(Ordering::Acquire)
    }

    /// Reloads the producer's index into the cache; returns the item count.
    #[inline]
    fn refresh_len(&self) -> usize {
        let tail = self.shared.tail.load(Ordering::Acquire);
        self.cached_tail.set(tail);
        let len = tail.wrapping_sub(self.head);
        debug_assert!(len <= self.mask + 1);
        len
    }

    /// Moves the value out of the published slot at `position`.
    #[inline(always)]
    fn read(&self, position: usize) -> T {
        debug_assert!(position != self.cached_tail.get());
        // SAFETY: `position & mask < capacity`. `position` is in
        // `[head, cached tail)`: the producer
        // initialized the slot and published it (acquire load of `tail`), and
        // will not touch it before the head moves past it. The caller advances
        // the head right after, so the value is moved out once.
        unsafe { read_slot(slot_at(self.shared.slots.as_ptr(), position & self.mask)) }
    }
}

/// Commits and publishes the batch's head on drop (end of batch, or
/// unwinding, where it frees exactly the slots already handed to `f`).
struct PublishHead<'a, T> {
    consumer: &'a mut Consumer<T>,
    head: usize,
}

impl<T> Drop for PublishHead<'_, T> {
    #[inline(always)]
    fn drop(&mut self) {
        self.consumer.head = self.head;
        self.consumer
            .shared
            .head
            .store(self.head, Ordering::Release);
    }
}

impl<T> Drop for Consumer<T> {
    fn drop(&mut self) {
        self.shared.consumer_gone.store(true, Ordering::Release);
    }
}

impl<T> fmt::Debug for Consumer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("capacity", &(self.mask + 1))
            .field("head", &self.head)
            .finish_non_exhaustive()
    }
}
