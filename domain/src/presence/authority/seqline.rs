//! Versioned lines with a backup line: the in-place write protocol of the published
//! tables (see `published.rs`, "Writing in place, lock-free for readers").
//!
//! One writer, any number of readers, no locks. Each [`Line`] is a version (odd
//! while the writer writes the line) and `N` value words. Before writing a line the
//! writer copies the line's value into the single [`Backup`] of its [`Lines`]
//! (tagged with the line and its version), then makes the version odd, writes the
//! value, makes it even again. A reader that sees an even version reads the value
//! and checks the version did not move (a seqlock read); one that sees an odd
//! version takes the previous value from the backup instead of waiting. So a
//! reader never waits for the writer and retries only when a write completed
//! meanwhile. Every word is an atomic: a torn read is detected, never undefined.
//!
//! Atomics come from `super::line_sync`: `std`'s in the library, loom's in the loom
//! model (`domain/tests/published_loom.rs`, which includes this file), so the model
//! checks this very code. The writer reads the words only it stores with
//! `own_load` (a relaxed load; in loom an untracked one, which returns the same
//! value, the writer's last store: loom's partial-order reduction compares an
//! access with the last one only, so the writer's own loads would hide a
//! reader's earlier load from its next store and the model would miss races).

use super::line_sync::{fence, own_load, spin, AtomicU64, Ordering};

/// A version and `N` value words, on one cache line when `N` <= 7.
#[repr(C, align(64))]
pub(crate) struct Line<const N: usize> {
    version: AtomicU64,
    words: [AtomicU64; N],
}

impl<const N: usize> Line<N> {
    /// Version 0, every word 0: the same as all-zero bytes, which the library's
    /// tables start from; the loom model builds its lines with this.
    #[allow(dead_code)]
    pub(crate) fn new() -> Self {
        Line {
            version: AtomicU64::new(0),
            words: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    /// Value word `k`, for peeks that need no consistency (prefetch addresses).
    #[inline]
    pub(crate) fn word(&self, k: usize) -> &AtomicU64 {
        &self.words[k]
    }

    /// The value words, loaded relaxed (readers validate them with the version).
    #[inline]
    fn load(&self) -> [u64; N] {
        std::array::from_fn(|k| self.words[k].load(Ordering::Relaxed))
    }

    /// The value words as the writer last stored them (writer only).
    #[inline]
    fn own(&self) -> [u64; N] {
        std::array::from_fn(|k| own_load(&self.words[k]))
    }

    /// Stores the value words relaxed (outside a table: see [`Lines::init`]).
    #[inline]
    fn store(&self, v: &[u64; N]) {
        for (w, &x) in self.words.iter().zip(v) {
            w.store(x, Ordering::Relaxed);
        }
    }
}

/// The previous value of the line the writer is writing.
#[repr(C, align(64))]
pub(crate) struct Backup<const N: usize> {
    /// Odd while the writer fills the backup.
    state: AtomicU64,
    /// The line whose value this is, and that line's (even) version of it.
    index: AtomicU64,
    version: AtomicU64,
    words: [AtomicU64; N],
}

impl<const N: usize> Backup<N> {
    pub(crate) fn new() -> Self {
        Backup {
            state: AtomicU64::new(0),
            index: AtomicU64::new(u64::MAX),
            version: AtomicU64::new(0),
            words: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

/// Lines (in storage `S`) and their backup line.
pub(crate) struct Lines<S, const N: usize> {
    lines: S,
    backup: Backup<N>,
}

impl<S: std::ops::Deref<Target = [Line<N>]>, const N: usize> Lines<S, N> {
    pub(crate) fn new(lines: S) -> Self {
        Lines {
            lines,
            backup: Backup::new(),
        }
    }

    /// Line `i`, for peeks and prefetches.
    #[inline]
    pub(crate) fn line(&self, i: usize) -> &Line<N> {
        &self.lines[i]
    }

    /// The lines' storage, for prefetches.
    #[inline]
    pub(crate) fn as_ptr(&self) -> *const Line<N> {
        self.lines.as_ptr()
    }

    /// A consistent copy of line `i`'s value. Never waits for the writer: retries
    /// only when a write of this line completed while reading.
    #[inline]
    pub(crate) fn read(&self, i: usize) -> [u64; N] {
        let e = &self.lines[i];
        loop {
            let s = e.version.load(Ordering::Acquire);
            if s & 1 == 0 {
                let v = e.load();
                fence(Ordering::Acquire);
                if e.version.load(Ordering::Relaxed) == s {
                    return v;
                }
            } else if let Some(v) = self.read_backup(i, s - 1) {
                return v;
            }
            spin();
        }
    }

    /// Version `version` of line `i`, if the backup line holds it (consistently).
    #[cold]
    pub(crate) fn read_backup(&self, i: usize, version: u64) -> Option<[u64; N]> {
        let b = &self.backup;
        let s = b.state.load(Ordering::Acquire);
        if s & 1 == 1 {
            return None;
        }
        let index = b.index.load(Ordering::Relaxed);
        let ver = b.version.load(Ordering::Relaxed);
        let v = std::array::from_fn(|k| b.words[k].load(Ordering::Relaxed));
        fence(Ordering::Acquire);
        if b.state.load(Ordering::Relaxed) != s || index != i as u64 || ver != version {
            return None;
        }
        Some(v)
    }

    /// The current value of line `i` (writer only: without another writer, plain
    /// relaxed loads are exact).
    #[inline]
    pub(crate) fn current(&self, i: usize) -> [u64; N] {
        self.lines[i].own()
    }

    /// Sets line `i`'s value in lines no reader can reach yet (a table being built).
    #[inline]
    pub(crate) fn init(&self, i: usize, v: &[u64; N]) {
        self.lines[i].store(v);
    }

    /// Replaces the value of line `i` (writer only).
    #[inline]
    pub(crate) fn write(&self, i: usize, v: &[u64; N]) {
        self.begin_write(i);
        self.finish_write(i, v);
    }

    /// First half of [`write`](Self::write): backs the value up and makes the
    /// version odd. Split only so that tests can look between the halves.
    #[inline]
    pub(crate) fn begin_write(&self, i: usize) {
        let e = &self.lines[i];
        let s = own_load(&e.version);
        debug_assert!(s & 1 == 0, "line {i} written twice at once");
        let old = e.own();
        let b = &self.backup;
        let bs = own_load(&b.state);
        debug_assert!(bs & 1 == 0);
        b.state.store(bs + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        b.index.store(i as u64, Ordering::Relaxed);
        b.version.store(s, Ordering::Relaxed);
        for (w, x) in b.words.iter().zip(old) {
            w.store(x, Ordering::Relaxed);
        }
        b.state.store(bs + 2, Ordering::Release);
        // Release: a reader that sees the odd version sees the complete backup.
        e.version.store(s + 1, Ordering::Release);
        fence(Ordering::Release);
    }

    /// Second half of [`write`](Self::write): stores the value, makes the version
    /// even.
    #[inline]
    pub(crate) fn finish_write(&self, i: usize, v: &[u64; N]) {
        let e = &self.lines[i];
        let s = own_load(&e.version);
        debug_assert!(s & 1 == 1);
        e.store(v);
        e.version.store(s + 1, Ordering::Release);
    }
}
