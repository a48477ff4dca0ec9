//! `msg.notify`: every message of this node's message logs, batched, at least once
//! across restarts.
//!
//! The logs are the queue. Each shard publishes where its log ends after the
//! commits it answered ([`super::WebhookSink::committed`]: an atomic max and a
//! wake-up, nothing else on the shard). One task ([`run`], on the driver's runtime)
//! follows every shard's log with a [`LogTail`] (reads of the segment files on
//! tokio's blocking pool: the shard thread is never held), encodes what it read,
//! feeds a `domain::webhook::WebhookQueue` of its own (batching, retries, the byte
//! budget) and posts its requests with the webhooks' client.
//!
//! The cursor, per shard, is the position of the oldest message read and not yet
//! accepted (a 2xx), or where the next read starts when every message read was.
//! It is written atomically to `DATA_DIR/`[`CURSOR_FILE`] at most every
//! `notify_cursor_interval_ms`, when it moved; a start reads it and resends from
//! there: what was accepted after the last write is sent again (at least once; a
//! receiver deduplicates by `message_id`), nothing is lost. A first start (no file)
//! starts at the logs' ends and writes the file before the shards take a SEND.
//!
//! Bounds: a read takes at most `notify_read_max` messages and about half the room
//! left in `queue_bytes_max`; nothing more is read while what was read waits for room
//! in the queue, nor from a shard with `notify_window_max` messages read and not yet
//! behind its cursor (a batch retried for long holds the cursor while later ones are
//! accepted), and reads go at most at `notify_read_per_s` messages a second. So a
//! slow or dead receiver costs memory up to the budget and no disk reads, and a
//! replay after an outage reads at a bounded rate. Nothing is dropped for a slow
//! receiver (the log holds it); what the log's retention deletes before it was read
//! is skipped, counted (`imrouter_webhook_notify_skipped_total`) and logged. A
//! single message larger than the whole budget is dropped (counted as dropped).

use std::collections::VecDeque;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use domain::send::commit::Committed;
use domain::webhook::{Admit, Event, EventKind, Layout, QueueCounts, WebhookQueue};
use tokio::task::{JoinHandle, JoinSet};

use super::client::WebhookClient;
use super::{encode, WebhookSink};
use crate::store::tail::{LogTail, TailRead};
use crate::store::{log_dir, LogPosition, StoredMessage};

/// The cursor's file in the data dir.
pub const CURSOR_FILE: &str = "webhook_notify_cursor.json";
/// The format this binary writes and reads.
const CURSOR_VERSION: u32 = 1;
/// How long a read that failed (an IO error) waits before it is tried again.
const READ_RETRY: Duration = Duration::from_secs(1);

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct CursorFile {
    cursor_version: u32,
    /// Per shard, where its log is resent from.
    positions: Vec<LogPosition>,
}

/// Reads the cursor of `data_dir` (`None`: there is none), refusing a file that does
/// not parse or is not of `shards` shards, with its path.
pub fn load_cursor(data_dir: &Path, shards: usize) -> io::Result<Option<Vec<LogPosition>>> {
    let path = data_dir.join(CURSOR_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io::Error::new(e.kind(), format!("{}: {e}", path.display()))),
    };
    let bad = |why: String| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{}: {why} (the msg.notify webhook's cursor)",
                path.display()
            ),
        )
    };
    let file: CursorFile = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
    if file.cursor_version != CURSOR_VERSION {
        return Err(bad(format!(
            "cursor_version {} (this binary reads {CURSOR_VERSION})",
            file.cursor_version
        )));
    }
    if file.positions.len() != shards {
        return Err(bad(format!(
            "{} positions for {shards} shards",
            file.positions.len()
        )));
    }
    Ok(Some(file.positions))
}

/// Writes `positions` as the cursor of `data_dir`, atomically.
pub fn save_cursor(data_dir: &Path, positions: &[LogPosition]) -> io::Result<()> {
    let file = CursorFile {
        cursor_version: CURSOR_VERSION,
        positions: positions.to_vec(),
    };
    let bytes = serde_json::to_vec(&file).map_err(io::Error::other)?;
    crate::store::write_atomic(data_dir, CURSOR_FILE, &bytes)
}

/// `msg.notify`'s counters (`/metrics`), besides its [`super::KindStats`].
#[derive(Debug, Default)]
pub struct NotifyStats {
    /// Cursor files written.
    pub cursor_writes: AtomicU64,
    /// Messages before the cursor last written, of those read since the start:
    /// a restart does not send them again.
    pub saved: AtomicU64,
    /// Ranges of a log skipped: deleted by retention before they were read (or a
    /// record that did not validate).
    pub skipped: AtomicU64,
}

/// What the shards and the follower share: where each log ends, the cursor the
/// node started from, the wake-up.
pub struct NotifyFeed {
    data_dir: PathBuf,
    /// Per shard: its log's end, as last published.
    ends: Box<[AtomicU64]>,
    /// Per shard: where the follower starts.
    start: Vec<LogPosition>,
    wake: tokio::sync::Notify,
    pub stats: NotifyStats,
}

impl NotifyFeed {
    /// The feed over the logs of `data_dir`, which end at `ends`: the saved cursor,
    /// each position at most its log's end (a log that lost its unsynced tail to a
    /// power cut ends before what was read of it); none saved: `ends`, saved now.
    pub fn open(data_dir: &Path, ends: &[LogPosition]) -> io::Result<NotifyFeed> {
        let start = match load_cursor(data_dir, ends.len())? {
            Some(saved) => saved.iter().zip(ends).map(|(&c, &e)| c.min(e)).collect(),
            None => {
                save_cursor(data_dir, ends).map_err(|e| {
                    io::Error::new(
                        e.kind(),
                        format!("{}: {e}", data_dir.join(CURSOR_FILE).display()),
                    )
                })?;
                ends.to_vec()
            }
        };
        Ok(NotifyFeed {
            data_dir: data_dir.to_path_buf(),
            ends: ends.iter().map(|&e| AtomicU64::new(e)).collect(),
            start,
            wake: tokio::sync::Notify::new(),
            stats: NotifyStats::default(),
        })
    }

    /// Shard `shard`'s log ends at `end` now.
    pub(super) fn published(&self, shard: usize, end: LogPosition) {
        if let Some(e) = self.ends.get(shard) {
            if e.fetch_max(end, Ordering::Release) < end {
                self.wake.notify_one();
            }
        }
    }

    fn end(&self, shard: usize) -> LogPosition {
        self.ends[shard].load(Ordering::Acquire)
    }
}

/// One shard's messages between the cursor and the next read.
struct ShardState {
    /// `None` while a read of it runs.
    tail: Option<LogTail>,
    /// Where the next read starts.
    read_pos: LogPosition,
    /// Read and not yet behind the cursor, in log order: (position, done: accepted
    /// or dropped).
    window: VecDeque<(LogPosition, bool)>,
    /// Messages read since the start that the cursor passed.
    passed: u64,
}

impl ShardState {
    fn cursor(&self) -> LogPosition {
        self.window.front().map_or(self.read_pos, |&(p, _)| p)
    }

    /// Marks the message at `pos` done and moves the cursor past what is.
    fn done(&mut self, pos: LogPosition) {
        if let Ok(i) = self.window.binary_search_by_key(&pos, |&(p, _)| p) {
            self.window[i].1 = true;
        }
        while self.window.front().is_some_and(|&(_, done)| done) {
            self.window.pop_front();
            self.passed += 1;
        }
    }
}

/// A message read, encoded, waiting for room in the queue.
struct Held {
    shard: usize,
    position: LogPosition,
    event: Event,
}

/// What a read on the blocking pool gives back.
struct ReadDone {
    shard: usize,
    /// Where it started.
    from: LogPosition,
    tail: LogTail,
    result: io::Result<TailRead>,
}

/// What one posted request came back with.
struct Posted {
    batch: u64,
    ok: bool,
    err: Option<String>,
}

/// The follower's state besides its queue.
struct Follower {
    feed_limits: FeedLimits,
    shards: Vec<ShardState>,
    held: VecDeque<Held>,
    held_bytes: usize,
    /// The queue's events, oldest first: (shard, position); cut into batches in
    /// this order.
    queued: VecDeque<(usize, LogPosition)>,
    /// Batches out or waiting for a retry: their messages.
    batches: std::collections::HashMap<u64, Vec<(usize, LogPosition)>>,
    /// The shard the next read looks at first (round robin).
    next_shard: usize,
    /// No read starts before this (the read rate; a failed read's retry).
    read_at: Instant,
    /// The cursor last written, and when.
    saved: Vec<LogPosition>,
    saved_at: Option<Instant>,
}

#[derive(Clone, Copy)]
struct FeedLimits {
    read_max: usize,
    window_max: usize,
    read_per_s: u64,
    queue_bytes_max: usize,
    cursor_interval: Duration,
}

impl Follower {
    /// A follower of the shards' logs from `start` (one position per shard, each
    /// read through its `tails`), nothing read yet.
    fn new(
        feed_limits: FeedLimits,
        tails: impl Iterator<Item = LogTail>,
        start: &[LogPosition],
        now: Instant,
    ) -> Follower {
        Follower {
            feed_limits,
            shards: tails
                .zip(start)
                .map(|(tail, &pos)| ShardState {
                    tail: Some(tail),
                    read_pos: pos,
                    window: VecDeque::new(),
                    passed: 0,
                })
                .collect(),
            held: VecDeque::new(),
            held_bytes: 0,
            queued: VecDeque::new(),
            batches: Default::default(),
            next_shard: 0,
            read_at: now,
            saved: start.to_vec(),
            saved_at: None,
        }
    }

    fn cursor(&self) -> Vec<LogPosition> {
        self.shards.iter().map(ShardState::cursor).collect()
    }

    /// Moves what was read into the queue while it has room (a message larger than
    /// the whole budget goes to an empty queue, which drops and counts it).
    fn fill(&mut self, q: &mut WebhookQueue, now_ms: u64, sink: &WebhookSink) {
        while let Some(h) = self.held.front() {
            let len = h.event.json.len();
            if q.bytes() > 0 && q.bytes() + len > self.feed_limits.queue_bytes_max {
                break;
            }
            let Some(h) = self.held.pop_front() else {
                break;
            };
            self.held_bytes -= len;
            match q.push(h.event, now_ms) {
                Admit::Queued => self.queued.push_back((h.shard, h.position)),
                Admit::Duplicate => self.shards[h.shard].done(h.position),
                Admit::Dropped => {
                    sink.dropped(EventKind::Notify, 0);
                    self.shards[h.shard].done(h.position);
                }
            }
        }
    }

    /// The shard to read next, if a read may start now: none running, nothing
    /// waiting for room, room in the budget, the rate allows it, a log has more
    /// and its window is below `notify_window_max`.
    fn next_read(&mut self, feed: &NotifyFeed, q: &WebhookQueue, now: Instant) -> Option<usize> {
        if !self.held.is_empty()
            || q.bytes() >= self.feed_limits.queue_bytes_max
            || now < self.read_at
        {
            return None;
        }
        let n = self.shards.len();
        let window_max = self.feed_limits.window_max;
        let pick = (0..n).map(|i| (self.next_shard + i) % n).find(|&s| {
            let st = &self.shards[s];
            st.tail.is_some() && st.read_pos < feed.end(s) && st.window.len() < window_max
        })?;
        self.next_shard = (pick + 1) % n;
        Some(pick)
    }

    /// A read came back: its messages encoded and held, the rate charged.
    fn on_read(&mut self, done: ReadDone, now: Instant, feed: &NotifyFeed) {
        let st = &mut self.shards[done.shard];
        st.tail = Some(done.tail);
        let read = match done.result {
            Ok(r) => r,
            Err(err) => {
                tracing::warn!(shard = done.shard, %err, "msg.notify: reading the message log failed; retrying");
                self.read_at = now + READ_RETRY;
                return;
            }
        };
        if let Some((from, to)) = read.skipped {
            feed.stats.skipped.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                shard = done.shard,
                from,
                to,
                "msg.notify: log records skipped (deleted by retention before they were \
                 sent, or not valid): those messages are not sent"
            );
        }
        let n = read.messages.len();
        if read.next == done.from {
            // Below the published end and nothing there: not expected (the shard
            // publishes after its appends); not read again at once.
            tracing::warn!(
                shard = done.shard,
                position = done.from,
                "msg.notify: no record where the log should have one; retrying"
            );
            self.read_at = now + READ_RETRY;
            return;
        }
        for m in read.messages {
            let event = encode::notify(&committed(m.message));
            st.window.push_back((m.position, false));
            self.held_bytes += event.json.len();
            self.held.push_back(Held {
                shard: done.shard,
                position: m.position,
                event,
            });
        }
        st.read_pos = read.next;
        let per_s = self.feed_limits.read_per_s.max(1);
        let cost = Duration::from_nanos((n as u64).saturating_mul(1_000_000_000) / per_s);
        self.read_at = self.read_at.max(now) + cost;
    }

    /// A new batch of `events` was cut: the oldest queued messages.
    fn cut(&mut self, batch: u64, events: usize) {
        let n = events.min(self.queued.len());
        self.batches
            .insert(batch, self.queued.drain(..n).collect::<Vec<_>>());
    }

    /// A batch was accepted: its messages are done.
    fn accepted(&mut self, batch: u64) {
        for (shard, pos) in self.batches.remove(&batch).unwrap_or_default() {
            self.shards[shard].done(pos);
        }
    }

    /// Whether the cursor should be written now (it moved, and the interval
    /// passed), else when it will be.
    fn cursor_due(&self, now: Instant) -> Option<Instant> {
        if self.cursor() == self.saved {
            return None;
        }
        Some(
            self.saved_at
                .map_or(now, |t| t + self.feed_limits.cursor_interval),
        )
    }
}

/// A logged message as the webhooks' encoder takes it (the log keeps no topic or
/// expiry).
fn committed(m: StoredMessage) -> Committed {
    Committed {
        committed_ns: 0,
        message_id: m.message_id,
        message_seq: m.message_seq,
        timestamp_s: m.timestamp_s,
        from_uid: m.from_uid.into(),
        channel_key: m.channel_id,
        channel_type: m.channel_type,
        client_msg_no: m.client_msg_no,
        setting: m.setting,
        flags: m.msg_flags,
        expire_s: 0,
        topic: String::new(),
        payload: m.payload,
    }
}

/// Resolves with the handle's output when there is one; never while `None`.
async fn join<T>(h: &mut Option<JoinHandle<T>>) -> Result<T, tokio::task::JoinError> {
    match h {
        Some(h) => h.await,
        None => std::future::pending().await,
    }
}

/// A cursor write's outcome: the cursor written, the messages it passed.
type CursorWrite = (Vec<LogPosition>, u64, io::Result<()>);

/// The follower task: its state, its queue and what it has running.
struct Task<'a> {
    sink: &'a WebhookSink,
    feed: &'a NotifyFeed,
    client: Arc<WebhookClient>,
    f: Follower,
    q: WebhookQueue,
    published: QueueCounts,
    epoch: Instant,
    out: JoinSet<Posted>,
    reading: Option<JoinHandle<ReadDone>>,
    writing: Option<JoinHandle<CursorWrite>>,
}

impl Task<'_> {
    fn now_ms(&self, now: Instant) -> u64 {
        now.duration_since(self.epoch).as_millis() as u64
    }

    /// Starts a read of the next shard's log when one may start.
    fn start_read(&mut self, now: Instant) {
        if self.reading.is_some() {
            return;
        }
        let Some(shard) = self.f.next_read(self.feed, &self.q, now) else {
            return;
        };
        let st = &mut self.f.shards[shard];
        let (from, end) = (st.read_pos, self.feed.end(shard));
        let Some(mut tail) = st.tail.take() else {
            return;
        };
        let room = self
            .f
            .feed_limits
            .queue_bytes_max
            .saturating_sub(self.q.bytes())
            / 2;
        let window_room = self.f.feed_limits.window_max - st.window.len();
        let max = self.f.feed_limits.read_max.min(window_room);
        self.reading = Some(tokio::task::spawn_blocking(move || {
            let result = tail.read(from, end, max, room.max(1));
            ReadDone {
                shard,
                from,
                tail,
                result,
            }
        }));
    }

    /// Posts every request the queue has now.
    fn post_due(&mut self, now: Instant) {
        let now_ms = self.now_ms(now);
        while let Some(r) = self.q.poll(now_ms) {
            if r.attempt == 1 {
                self.f.cut(r.batch, r.events);
            }
            let client = self.client.clone();
            self.out.spawn(async move {
                let result = client.post(EventKind::Notify, &r).await;
                Posted {
                    batch: r.batch,
                    ok: result.is_ok(),
                    err: result.err(),
                }
            });
        }
    }

    /// Starts writing the cursor when it is due.
    fn start_write(&mut self, now: Instant) {
        if self.writing.is_some() || self.f.cursor_due(now).is_none_or(|t| t > now) {
            return;
        }
        let cursor = self.f.cursor();
        let passed = self.f.shards.iter().map(|s| s.passed).sum();
        let dir = self.feed.data_dir.clone();
        self.f.saved_at = Some(now);
        self.writing = Some(tokio::task::spawn_blocking(move || {
            let result = save_cursor(&dir, &cursor);
            (cursor, passed, result)
        }));
    }

    /// How long to sleep when nothing else wakes the task: until a batch or retry
    /// is due, the cursor is due, or the read rate allows the next read.
    fn sleep(&self, now: Instant) -> Duration {
        let mut wake = self
            .q
            .next_wake()
            .map(|t| self.epoch + Duration::from_millis(t));
        let mut sooner = |t: Option<Instant>| {
            if let Some(t) = t {
                wake = Some(wake.map_or(t, |w| w.min(t)));
            }
        };
        if self.writing.is_none() {
            sooner(self.f.cursor_due(now));
        }
        let behind = (0..self.f.shards.len()).any(|s| self.f.shards[s].read_pos < self.feed.end(s));
        if self.reading.is_none() && behind && self.f.held.is_empty() && now < self.f.read_at {
            sooner(Some(self.f.read_at));
        }
        wake.map_or(Duration::from_secs(3_600), |w| {
            w.saturating_duration_since(now)
        })
    }

    /// A request came back.
    fn on_posted(&mut self, done: Posted) {
        let now_ms = self.now_ms(Instant::now());
        if let Some(err) = &done.err {
            tracing::debug!(event = "msg.notify", batch = done.batch, %err, "webhook request failed; retrying");
        }
        if self.q.on_done(done.batch, done.ok, now_ms) && done.ok {
            self.f.accepted(done.batch);
        }
    }

    /// A cursor write came back.
    fn on_written(&mut self, written: Result<CursorWrite, tokio::task::JoinError>) {
        match written {
            Ok((cursor, passed, Ok(()))) => {
                self.f.saved = cursor;
                let stats = &self.feed.stats;
                stats.cursor_writes.fetch_add(1, Ordering::Relaxed);
                stats.saved.store(passed, Ordering::Relaxed);
            }
            Ok((_, _, Err(err))) => {
                let file = self.feed.data_dir.join(CURSOR_FILE);
                tracing::warn!(%err, file = %file.display(), "msg.notify: writing the cursor failed; retrying");
            }
            Err(e) => tracing::warn!(err = %e, "msg.notify: the cursor write did not run"),
        }
    }
}

/// The follower's loop; ends with its runtime.
pub async fn run(sink: Arc<WebhookSink>, client: Arc<WebhookClient>) {
    let Some(feed) = sink.notify() else {
        return;
    };
    let config = sink.config();
    let epoch = Instant::now();
    let feed_limits = FeedLimits {
        read_max: config.notify_read_max,
        window_max: config.notify_window_max,
        read_per_s: config.notify_read_per_s,
        queue_bytes_max: config.queue_bytes_max,
        cursor_interval: Duration::from_millis(config.notify_cursor_interval_ms),
    };
    let tails = (0..feed.start.len()).map(|i| LogTail::new(&log_dir(&feed.data_dir, i)));
    let f = Follower::new(feed_limits, tails, &feed.start, epoch);
    let mut t = Task {
        sink: &sink,
        feed,
        client,
        f,
        q: WebhookQueue::new(config.limits(), Layout::Array),
        published: QueueCounts::default(),
        epoch,
        out: JoinSet::new(),
        reading: None,
        writing: None,
    };
    loop {
        let now = Instant::now();
        let now_ms = t.now_ms(now);
        t.f.fill(&mut t.q, now_ms, t.sink);
        t.start_read(now);
        t.post_due(now);
        t.start_write(now);
        publish(t.sink, &t.q, &t.f, &mut t.published);
        let sleep = t.sleep(now);
        tokio::select! {
            () = feed.wake.notified() => {}
            done = join(&mut t.reading) => {
                t.reading = None;
                match done {
                    Ok(done) => t.f.on_read(done, Instant::now(), feed),
                    Err(e) => {
                        // The read panicked: its reader is gone.
                        tracing::error!(err = %e, "msg.notify: a log read failed; not sent any more");
                        return;
                    }
                }
            }
            Some(done) = t.out.join_next(), if !t.out.is_empty() => {
                if let Ok(done) = done {
                    t.on_posted(done);
                }
            }
            written = join(&mut t.writing) => {
                t.writing = None;
                t.on_written(written);
            }
            () = tokio::time::sleep(sleep) => {}
        }
    }
}

/// Mirrors the queue's counters and what waits for it into `msg.notify`'s stats.
fn publish(sink: &WebhookSink, q: &WebhookQueue, f: &Follower, last: &mut QueueCounts) {
    let c = q.counts();
    let s = &sink.stats[EventKind::Notify.index()];
    s.sent.fetch_add(c.sent - last.sent, Ordering::Relaxed);
    s.failed
        .fetch_add(c.failed - last.failed, Ordering::Relaxed);
    s.dropped
        .fetch_add(c.dropped - last.dropped, Ordering::Relaxed);
    s.deduplicated
        .fetch_add(c.deduplicated - last.deduplicated, Ordering::Relaxed);
    s.queued
        .store((q.events() + f.held.len()) as u64, Ordering::Relaxed);
    s.queued_bytes
        .store(q.bytes() + f.held_bytes, Ordering::Relaxed);
    *last = c;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cursor_file_round_trips_and_a_bad_one_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        assert!(load_cursor(dir.path(), 2).unwrap().is_none());
        save_cursor(dir.path(), &[5, 1 << 32]).unwrap();
        assert_eq!(load_cursor(dir.path(), 2).unwrap(), Some(vec![5, 1 << 32]));
        let e = load_cursor(dir.path(), 3).unwrap_err();
        assert!(e.to_string().contains(CURSOR_FILE), "{e}");
        assert!(e.to_string().contains("2 positions for 3 shards"), "{e}");
        std::fs::write(dir.path().join(CURSOR_FILE), b"{").unwrap();
        let e = load_cursor(dir.path(), 2).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains(CURSOR_FILE), "{e}");
    }

    #[test]
    fn a_first_start_saves_the_ends_and_a_saved_cursor_is_clamped_to_them() {
        let dir = tempfile::tempdir().unwrap();
        let feed = NotifyFeed::open(dir.path(), &[100, 200]).unwrap();
        assert_eq!(feed.start, [100, 200]);
        assert_eq!(load_cursor(dir.path(), 2).unwrap(), Some(vec![100, 200]));
        save_cursor(dir.path(), &[50, 300]).unwrap();
        // The second log lost its tail (a power cut): it resends from its end.
        let feed = NotifyFeed::open(dir.path(), &[100, 250]).unwrap();
        assert_eq!(feed.start, [50, 250]);
    }

    fn follower(feed: &NotifyFeed, window_max: usize) -> Follower {
        let limits = FeedLimits {
            read_max: 10,
            window_max,
            read_per_s: 1_000,
            queue_bytes_max: 1_000,
            cursor_interval: Duration::from_millis(1),
        };
        let tails = feed
            .start
            .iter()
            .map(|_| LogTail::new(Path::new("/nonexistent")));
        Follower::new(limits, tails, &feed.start, Instant::now())
    }

    #[test]
    fn reads_wait_for_room_the_rate_and_the_window() {
        let dir = tempfile::tempdir().unwrap();
        let feed = NotifyFeed::open(dir.path(), &[0, 0]).unwrap();
        let limits = domain::webhook::QueueLimits {
            batch_max: 10,
            batch_delay_ms: 0,
            queue_bytes_max: 1_000,
            requests_in_flight_max: 1,
            backoff_min_ms: 1,
            backoff_ms_max: 1,
        };
        let mut q = WebhookQueue::new(limits, Layout::Array);
        let mut f = follower(&feed, 2);
        let now = Instant::now();
        assert_eq!(f.next_read(&feed, &q, now), None, "nothing published");
        feed.published(1, 64);
        assert_eq!(f.next_read(&feed, &q, now), Some(1));
        feed.published(0, 64);
        assert_eq!(f.next_read(&feed, &q, now), Some(0), "round robin");
        // Shard 0's window is full: the oldest of two is not accepted yet.
        f.shards[0].window = VecDeque::from([(0, false), (8, true)]);
        f.next_shard = 0;
        assert_eq!(f.next_read(&feed, &q, now), Some(1), "only shard 1");
        f.shards[1].window = VecDeque::from([(0, false), (8, false)]);
        assert_eq!(f.next_read(&feed, &q, now), None, "both windows full");
        f.shards[0].done(0);
        assert_eq!(f.shards[0].cursor(), 0, "the read position: all passed");
        assert_eq!(f.next_read(&feed, &q, now), Some(0));
        // The queue at its budget: no read.
        q.push(
            Event {
                id: None,
                json: vec![b'1'; 1_000],
            },
            0,
        );
        assert_eq!(f.next_read(&feed, &q, now), None, "no room");
        let q = WebhookQueue::new(limits, Layout::Array);
        // Something waits for room: no read; the rate: no read before read_at.
        f.held.push_back(Held {
            shard: 0,
            position: 0,
            event: Event {
                id: None,
                json: b"1".to_vec(),
            },
        });
        assert_eq!(f.next_read(&feed, &q, now), None, "held");
        f.held.clear();
        f.read_at = now + Duration::from_secs(1);
        assert_eq!(f.next_read(&feed, &q, now), None, "rate");
        assert_eq!(f.next_read(&feed, &q, f.read_at), Some(0));
    }

    #[test]
    fn the_cursor_waits_for_the_oldest_message_not_accepted() {
        let mut st = ShardState {
            tail: None,
            read_pos: 40,
            window: VecDeque::from([(10, false), (20, false), (30, false)]),
            passed: 0,
        };
        assert_eq!(st.cursor(), 10);
        st.done(20);
        assert_eq!((st.cursor(), st.passed), (10, 0), "10 not accepted yet");
        st.done(10);
        assert_eq!((st.cursor(), st.passed), (30, 2));
        st.done(30);
        assert_eq!((st.cursor(), st.passed), (40, 3), "all read: the next read");
        st.done(99);
        assert_eq!(st.cursor(), 40, "unknown positions change nothing");
    }
}
