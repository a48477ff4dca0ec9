//! Loom models of the published tables' in-place write protocol
//! (`domain/src/presence/authority/seqline.rs`, included here with loom's atomics): a writer
//! rewrites lines (version, backup line), readers read them; a reader never gets a
//! torn value, a value of another line, or a value older than one it already got.
//! And of the presence filter's invariant (`domain/src/presence/authority/presence.rs`,
//! included the same way): a reader that sees a uid's endpoint sees its filter
//! bits, through filter rebuilds too, and a lookup that happens after an insert
//! (filter first, then the table) is never told "absent".
//!
//! Each model explores every interleaving (and every value the C11 memory model
//! lets a relaxed load return) up to `LOOM_MAX_PREEMPTIONS` preemptions, default 2
//! here; run more with e.g. `LOOM_MAX_PREEMPTIONS=3 cargo test -p engine --release
//! --test published_loom`. Reclamation (crossbeam-epoch) is not modelled: miri runs
//! the table's tests for that (`.ci/run`).

// A test driver, outside the sans-IO boundary (clippy.toml): it may read seeds from
// the environment, time itself and run threads.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use loom::sync::Arc;
use loom::thread;

#[path = "../src/presence/authority/seqline.rs"]
#[allow(dead_code)]
mod seqline;

#[path = "../src/presence/authority/presence.rs"]
#[allow(dead_code)]
mod presence;

/// What `seqline` takes its atomics from (the library: `std`'s).
mod line_sync {
    pub(crate) use loom::sync::atomic::{fence, AtomicU64, Ordering};

    /// A reader's retry lets the writer run.
    pub(crate) fn spin() {
        loom::thread::yield_now();
    }

    /// The writer's load of a word only it stores: its last store, untracked
    /// (see `seqline`'s docs).
    pub(crate) fn own_load(a: &AtomicU64) -> u64 {
        // SAFETY: only the calling thread (the single writer) stores to `a`, so
        // no store races with this load.
        unsafe { a.unsync_load() }
    }
}

use seqline::{Line, Lines};

/// Two words per line: enough to see a torn value (words of two writes).
type Table = Lines<Box<[Line<2>]>, 2>;

fn table(values: &[u64]) -> Arc<Table> {
    let t = Lines::new(values.iter().map(|_| Line::new()).collect::<Box<[_]>>());
    for (i, &x) in values.iter().enumerate() {
        t.init(i, &value(x));
    }
    Arc::new(t)
}

/// A value whose two words derive from `x` differently: a mix of two is caught.
fn value(x: u64) -> [u64; 2] {
    [x, x.wrapping_mul(0x9e37_79b9_7f4a_7c15)]
}

/// The `x` of a whole value; panics on a torn one.
fn whole(v: [u64; 2], what: &str) -> u64 {
    assert_eq!(v, value(v[0]), "torn value of {what}");
    v[0]
}

/// Runs `f` under loom (preemption bound 2 unless `LOOM_MAX_PREEMPTIONS` says)
/// and returns the number of executions explored.
fn model(f: impl Fn() + Sync + Send + 'static) -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(2);
    }
    let runs = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    b.check(move || {
        counted.fetch_add(1, Ordering::Relaxed);
        f()
    });
    let n = runs.load(Ordering::Relaxed);
    eprintln!("{n} executions explored");
    n
}

/// One line written twice while a reader reads it twice: each read is a whole
/// value the line held, the second not older than the first.
#[test]
fn a_reader_gets_whole_values_never_older_ones() {
    model(|| {
        let t = table(&[0]);
        let w = {
            let t = t.clone();
            thread::spawn(move || {
                t.write(0, &value(1));
                t.write(0, &value(2));
            })
        };
        let a = whole(t.read(0), "line 0");
        let b = whole(t.read(0), "line 0");
        assert!(a <= 2 && a <= b, "read {a} then {b}");
        w.join().unwrap();
        assert_eq!(t.read(0), value(2));
    });
}

/// Two lines share the backup: while the writer rewrites line 1, then line 0, then
/// line 1 again, readers of line 0 get only line 0's values (the backup answers for
/// its own line and version only).
#[test]
fn the_backup_answers_only_for_its_own_line_and_version() {
    model(|| {
        let t = table(&[10, 20]);
        let w = {
            let t = t.clone();
            thread::spawn(move || {
                t.write(1, &value(21));
                t.write(0, &value(11));
                t.write(1, &value(22));
            })
        };
        let a = whole(t.read(0), "line 0");
        assert!(a == 10 || a == 11, "line 0 read {a}");
        let b = whole(t.read(1), "line 1");
        assert!((20..=22).contains(&b), "line 1 read {b}");
        w.join().unwrap();
    });
}

/// Two readers of one line, a writer in between: both get whole values.
#[test]
fn concurrent_readers_get_whole_values() {
    model(|| {
        let t = table(&[0]);
        let r = {
            let t = t.clone();
            thread::spawn(move || whole(t.read(0), "line 0"))
        };
        t.write(0, &value(1));
        let mine = whole(t.read(0), "line 0");
        assert_eq!(mine, 1, "the writer reads its own write");
        assert!(r.join().unwrap() <= 1);
    });
}

/// Filter keys of two uids (any values: the bits are what they are).
const KEY_X: u32 = 0x1234_5678;
const KEY_Y: u32 = 0x9abc_def0;

fn filter() -> presence::Filter {
    presence::Filter::for_routes(0, 16, 1 << 10)
}

/// The writer sets a uid's bits, then writes the entry that gives it an endpoint:
/// a reader that sees the endpoint sees the bits.
#[test]
fn a_reader_that_sees_an_endpoint_sees_its_filter_bits() {
    model(|| {
        let t = table(&[0]);
        let f = Arc::new(filter());
        let w = {
            let (t, f) = (t.clone(), f.clone());
            thread::spawn(move || {
                f.insert(KEY_X);
                t.write(0, &value(1));
            })
        };
        if whole(t.read(0), "line 0") == 1 {
            assert!(f.may_contain(KEY_X), "endpoint visible, its bits not");
        }
        w.join().unwrap();
    });
}

/// Two filters and the index of the published one (the library swaps a pointer
/// with the same orderings: Release to publish, Acquire to load).
struct Slot {
    table: Arc<Table>,
    filters: [presence::Filter; 2],
    current: loom::sync::atomic::AtomicU64,
    /// Set (Release) by the writer once Y's insert is done: what a CONNACK and the
    /// SEND it leads to carry in the node.
    y_done: loom::sync::atomic::AtomicU64,
}

/// X (line 0) has an endpoint and its bits in filter 0; Y (line 1) has none. The
/// writer removes X, rebuilds the filter from the table (filter 1: nothing live),
/// publishes it, then inserts Y (bits in filter 1, then the entry), then says so.
fn rebuild_then_insert(s: &Slot) {
    use loom::sync::atomic::Ordering;
    s.table.write(0, &value(0));
    // The rebuild: the table has no live uid (X was removed), so no bit to set.
    s.current.store(1, Ordering::Release);
    s.filters[1].insert(KEY_Y);
    s.table.write(1, &value(1));
    s.y_done.store(1, Ordering::Release);
}

fn slot() -> Arc<Slot> {
    let s = Slot {
        table: table(&[1, 0]),
        filters: [filter(), filter()],
        current: loom::sync::atomic::AtomicU64::new(0),
        y_done: loom::sync::atomic::AtomicU64::new(0),
    };
    s.filters[0].insert(KEY_X);
    Arc::new(s)
}

/// Through a rebuild: a reader that sees Y's endpoint sees Y's bits in the
/// filter it loads then.
#[test]
fn a_rebuilt_filter_covers_what_the_reader_sees() {
    use loom::sync::atomic::Ordering;
    model(|| {
        let s = slot();
        let w = {
            let s = s.clone();
            thread::spawn(move || rebuild_then_insert(&s))
        };
        if whole(s.table.read(1), "line 1") == 1 {
            let c = s.current.load(Ordering::Acquire) as usize;
            assert_eq!(c, 1, "Y's endpoint visible, the old filter loaded");
            assert!(s.filters[c].may_contain(KEY_Y), "Y visible, its bits not");
        }
        w.join().unwrap();
    });
}

/// A lookup that happens after Y's insert (here: it saw the writer's flag),
/// done as the node does it (the filter first, then the table only on "maybe"),
/// finds Y: never "absent" for a uid whose endpoint was published before.
#[test]
fn a_lookup_after_an_insert_is_never_told_absent() {
    use loom::sync::atomic::Ordering;
    model(|| {
        let s = slot();
        let w = {
            let s = s.clone();
            thread::spawn(move || rebuild_then_insert(&s))
        };
        if s.y_done.load(Ordering::Acquire) == 1 {
            let c = s.current.load(Ordering::Acquire) as usize;
            assert!(s.filters[c].may_contain(KEY_Y), "the filter ruled Y out");
            assert_eq!(whole(s.table.read(1), "line 1"), 1);
        }
        w.join().unwrap();
    });
}
