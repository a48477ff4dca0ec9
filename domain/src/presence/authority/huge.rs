//! The memory of the published tables (the arrays lookups hit at random).
//!
//! [`HugePages`] allocates from mimalloc, used directly: the process keeps the
//! system allocator (mimalloc as the global allocator measured 5.7–9.2 KiB of RSS
//! per idle connection against 3.2 KiB; this use adds ~4 MiB of fixed RSS at
//! 10,000 connections). mimalloc backs the segments it commits eagerly with transparent huge pages
//! where the kernel allows it (`madvise` mode, the common default;
//! `MIMALLOC_ALLOW_THP=0` turns THP off for the whole process), and the tables of all 256 slots share
//! those segments. A lookup's random access then rarely misses the TLB, where 4 KiB pages cost a page walk per uid: with 1M routes in
//! 256 slots (each slot's table ~512 KiB, too small for a huge page of its own),
//! `cargo bench -p engine --bench authority` measured 11.2 M looked-up routes/s
//! (compact) on 4 KiB pages and 13.7 M here (medians of 3). (Record slabs in the same memory
//! measured no better: an expiry pass is bound by more than the TLB.) Miri cannot
//! run mimalloc's C code: there, the system allocator.

use std::alloc::{GlobalAlloc, Layout};
use std::ptr::NonNull;

use allocator_api2::alloc::{AllocError, Allocator};

#[cfg(not(miri))]
const BACKING: mimalloc::MiMalloc = mimalloc::MiMalloc;
#[cfg(miri)]
const BACKING: std::alloc::System = std::alloc::System;

/// See the module docs.
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct HugePages;

/// A boxed slice in [`HugePages`] memory.
pub(crate) type HugeBox<T> = allocator_api2::boxed::Box<T, HugePages>;

impl HugePages {
    #[inline]
    fn finish(p: *mut u8, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        NonNull::new(p)
            .map(|p| NonNull::slice_from_raw_parts(p, layout.size()))
            .ok_or(AllocError)
    }

    #[inline]
    fn dangling(layout: Layout) -> NonNull<[u8]> {
        let p = NonNull::new(std::ptr::without_provenance_mut::<u8>(layout.align()))
            .expect("alignments are non-zero");
        NonNull::slice_from_raw_parts(p, 0)
    }
}

// SAFETY: blocks come from `BACKING` (a `GlobalAlloc`) with their exact layout and
// go back to it with that layout; a zero-sized request gets a dangling, aligned
// pointer that is never handed to `BACKING`. Blocks stay valid until deallocated,
// and `HugePages` is a stateless `Copy` handle, so clones free each other's blocks.
unsafe impl Allocator for HugePages {
    #[inline]
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        if layout.size() == 0 {
            return Ok(HugePages::dangling(layout));
        }
        // SAFETY: a non-zero size.
        HugePages::finish(unsafe { BACKING.alloc(layout) }, layout)
    }

    #[inline]
    fn allocate_zeroed(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        if layout.size() == 0 {
            return Ok(HugePages::dangling(layout));
        }
        // SAFETY: a non-zero size.
        HugePages::finish(unsafe { BACKING.alloc_zeroed(layout) }, layout)
    }

    #[inline]
    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() != 0 {
            // SAFETY: per the trait's contract, `ptr` is a block of ours with this
            // layout, and non-empty blocks came from `BACKING`.
            unsafe { BACKING.dealloc(ptr.as_ptr(), layout) };
        }
    }

    #[inline]
    unsafe fn grow(
        &self,
        ptr: NonNull<u8>,
        old: Layout,
        new: Layout,
    ) -> Result<NonNull<[u8]>, AllocError> {
        if old.size() == 0 || old.align() != new.align() {
            let block = self.allocate(new)?;
            // SAFETY: the new block holds at least `old.size()` bytes and does not
            // overlap the old one, which is ours and freed once copied.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    ptr.as_ptr(),
                    block.cast::<u8>().as_ptr(),
                    old.size(),
                );
                self.deallocate(ptr, old);
            }
            return Ok(block);
        }
        // SAFETY: `ptr` came from `BACKING` with layout `old` (non-zero size), and
        // the new size is at least the old one, so non-zero.
        HugePages::finish(
            unsafe { BACKING.realloc(ptr.as_ptr(), old, new.size()) },
            new,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A zero-sized block is empty and aligned as asked (a slice of zero-sized or
    /// over-aligned elements reads through it), never handed to the backing
    /// allocator, so freeing it is a no-op.
    #[test]
    fn zero_sized_blocks_are_empty_and_aligned() {
        for align in [1, 8, 64, 4096] {
            let layout = Layout::from_size_align(0, align).unwrap();
            for block in [
                HugePages.allocate(layout).unwrap(),
                HugePages.allocate_zeroed(layout).unwrap(),
            ] {
                assert_eq!(block.len(), 0);
                assert_eq!(block.cast::<u8>().as_ptr() as usize % align, 0, "{align}");
                // SAFETY: a block of ours with this layout.
                unsafe { HugePages.deallocate(block.cast(), layout) };
            }
        }
    }

    #[test]
    fn vectors_and_boxes_keep_their_values_across_growth() {
        let mut v = allocator_api2::vec::Vec::new_in(HugePages);
        for i in 0..100_000u64 {
            v.push(i * 3);
        }
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u64 * 3));
        let empty: allocator_api2::vec::Vec<u8, _> =
            allocator_api2::vec::Vec::with_capacity_in(0, HugePages);
        assert!(empty.is_empty());
        let b: HugeBox<[std::mem::MaybeUninit<u64>]> =
            HugeBox::new_zeroed_slice_in(4096, HugePages);
        // SAFETY: zeroed `u64`s are initialized.
        let b = unsafe { b.assume_init() };
        assert!(b.iter().all(|&x| x == 0));
    }
}
