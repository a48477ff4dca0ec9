//! The io_uring provided-buffer ring (`IORING_REGISTER_PBUF_RING`) of the io_uring
//! driver (the node's shards, and imbench's workers, which run on the same driver).
//!
//! Contract: the owner drops the io_uring (or cancels and reaps every request using
//! the group) before dropping the `BufRing`; if requests may still be live, it calls
//! [`BufRing::leak`] instead.
//! A buffer handed out by a completion stays the owner's until it is pushed back.

use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU16, Ordering};

use io_uring::types::{BufRingEntry, CancelBuilder, SubmitArgs, Timespec};
use io_uring::{cqueue, opcode, IoUring};

/// A provided-buffer ring: `count` buffers of `size` bytes, registered as buffer
/// group `bgid`. Memory comes from anonymous mmaps, so it is page aligned and never moves.
pub struct BufRing {
    ring: NonNull<BufRingEntry>,
    ring_bytes: usize,
    bufs: NonNull<u8>,
    bufs_bytes: usize,
    count: u16,
    size: u32,
    /// Our copy of the tail; published to the kernel with a release store.
    tail: u16,
}

fn mmap_anon(len: usize) -> io::Result<NonNull<u8>> {
    // SAFETY: an anonymous private mapping with no address hint has no preconditions;
    // the result is checked.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    NonNull::new(p.cast()).ok_or_else(|| io::Error::other("mmap returned null"))
}

impl BufRing {
    /// Maps and registers the ring. `count` must be a power of two (the kernel's rule).
    pub fn new(ring: &IoUring, count: u16, size: u32, bgid: u16) -> io::Result<Self> {
        if !count.is_power_of_two() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "provided-buffer count must be a power of two",
            ));
        }
        let ring_bytes = usize::from(count) * std::mem::size_of::<BufRingEntry>();
        let bufs_bytes = usize::from(count) * size as usize;
        let ring_mem = mmap_anon(ring_bytes)?;
        let bufs = match mmap_anon(bufs_bytes) {
            Ok(b) => b,
            Err(e) => {
                // SAFETY: unmaps the mapping created just above, not referenced elsewhere.
                unsafe { libc::munmap(ring_mem.as_ptr().cast(), ring_bytes) };
                return Err(e);
            }
        };
        let mut br = BufRing {
            ring: ring_mem.cast(),
            ring_bytes,
            bufs,
            bufs_bytes,
            count,
            size,
            tail: 0,
        };
        // SAFETY: the ring memory is page aligned, `count` entries long, and lives until
        // `BufRing` is dropped, which happens only after the io_uring is gone (the
        // driver declares `ring` before `bufs`) or after unregistering.
        unsafe {
            ring.submitter().register_buf_ring_with_flags(
                br.ring.as_ptr() as u64,
                count,
                bgid,
                0,
            )?;
        }
        for bid in 0..count {
            br.push(bid);
        }
        br.publish();
        Ok(br)
    }

    /// Hands buffer `bid` back to the kernel (visible after [`BufRing::publish`]).
    ///
    /// # Panics
    /// If `bid >= count` (not a buffer of this ring: a completion's buffer id is the
    /// kernel's word, checked rather than trusted).
    pub fn push(&mut self, bid: u16) {
        assert!(
            bid < self.count,
            "buffer id {bid} out of range (count {})",
            self.count
        );
        let slot = usize::from(self.tail & (self.count - 1));
        // SAFETY: `slot < count`, inside the ring mapping; the kernel only reads
        // entries between its head and our published tail, and this one is past it.
        let entry = unsafe { &mut *self.ring.as_ptr().add(slot) };
        // SAFETY: `bid < count` (asserted above), so the buffer lies inside the buffer
        // mapping.
        let addr = unsafe {
            self.bufs
                .as_ptr()
                .add(usize::from(bid) * self.size as usize)
        };
        entry.set_addr(addr as u64);
        entry.set_len(self.size);
        entry.set_bid(bid);
        self.tail = self.tail.wrapping_add(1);
    }

    /// Makes the buffers pushed so far visible to the kernel.
    pub fn publish(&self) {
        // SAFETY: the tail field overlays the first entry's `resv`, inside the mapping;
        // the kernel reads it with an acquire load, so it is accessed atomically.
        let tail = unsafe { &*(BufRingEntry::tail(self.ring.as_ptr()) as *const AtomicU16) };
        tail.store(self.tail, Ordering::Release);
    }

    /// The first `len` bytes of buffer `bid`, as filled by a completed recv.
    pub fn data(&self, bid: u16, len: usize) -> &[u8] {
        assert!(bid < self.count && len <= self.size as usize);
        // SAFETY: the buffer is inside the mapping; the kernel wrote `len` bytes into it
        // and does not touch it again until we push it back.
        unsafe {
            std::slice::from_raw_parts(
                self.bufs
                    .as_ptr()
                    .add(usize::from(bid) * self.size as usize),
                len,
            )
        }
    }
}

impl BufRing {
    /// A stand-in that owns nothing (to swap in before [`BufRing::leak`]).
    pub fn empty() -> BufRing {
        BufRing {
            ring: NonNull::dangling(),
            ring_bytes: 0,
            bufs: NonNull::dangling(),
            bufs_bytes: 0,
            count: 1,
            size: 0,
            tail: 0,
        }
    }

    /// Never unmaps the memory: for when requests the kernel may still complete
    /// point into it.
    pub fn leak(self) {
        std::mem::forget(self);
    }
}

impl Drop for BufRing {
    fn drop(&mut self) {
        if self.ring_bytes == 0 {
            return; // The empty stand-in of a leaked ring.
        }
        // SAFETY: both mappings were created in `new` and are no longer used by the
        // kernel (the driver destroys the ring first, after its IO finished).
        unsafe {
            libc::munmap(self.ring.as_ptr().cast(), self.ring_bytes);
            libc::munmap(self.bufs.as_ptr().cast(), self.bufs_bytes);
        }
    }
}

/// How long a teardown waits for cancelled requests to finish, in waits of at most
/// `TEARDOWN_WAIT_STEP_NS`.
pub const TEARDOWN_WAIT: std::time::Duration = std::time::Duration::from_secs(3);
const TEARDOWN_WAIT_STEP_NS: u32 = 5_000_000;
/// The teardown repeats its cancel-all every this many waits (requests still being
/// issued may miss a cancel).
const TEARDOWN_CANCEL_EVERY_ROUNDS: usize = 20;

/// Cancels every request on `ring` and reaps completions until none of the
/// `inflight` requests (final completions not yet reaped) remains or
/// [`TEARDOWN_WAIT`] has passed. Returns whether all ended: if not, the memory they
/// reference (a [`BufRing`], send buffers) must be leaked, never freed.
/// `cancel_user_data` tags the cancel requests (their own completions are counted
/// like any other request's).
pub fn cancel_all_and_drain(
    ring: &mut IoUring,
    inflight: &mut usize,
    cancel_user_data: u64,
) -> bool {
    let give_up = std::time::Instant::now() + TEARDOWN_WAIT;
    for round in 0.. {
        if *inflight == 0 || std::time::Instant::now() > give_up {
            break;
        }
        if round % TEARDOWN_CANCEL_EVERY_ROUNDS == 0 {
            let e = opcode::AsyncCancel2::new(CancelBuilder::any().all())
                .build()
                .user_data(cancel_user_data);
            // SAFETY: a cancel references no memory.
            while unsafe { ring.submission().push(&e) }.is_err() {
                if ring.submit().is_err() {
                    return *inflight == 0;
                }
            }
            *inflight += 1;
        }
        let ts = Timespec::new().nsec(TEARDOWN_WAIT_STEP_NS);
        let args = SubmitArgs::new().timespec(&ts);
        let _ = ring.submitter().submit_with_args(1, &args);
        for cqe in ring.completion() {
            if !cqueue::more(cqe.flags()) {
                *inflight -= 1;
            }
        }
    }
    *inflight == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_refuses_a_buffer_id_out_of_range() {
        let Ok(ring) = io_uring::IoUring::new(8) else {
            println!("NOTE: io_uring refused by the kernel; test skipped");
            return;
        };
        let Ok(mut br) = BufRing::new(&ring, 4, 256, 0) else {
            println!("NOTE: provided buffer rings refused by the kernel; test skipped");
            return;
        };
        br.push(3); // In range: fine.
        let out_of_range = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| br.push(4)));
        assert!(
            out_of_range.is_err(),
            "a buffer id >= count must be refused, not point past the mapping"
        );
    }
}
