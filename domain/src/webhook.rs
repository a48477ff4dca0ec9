//! Webhook queues, sans-IO (issue 28 item 3): what to POST to the application's
//! webhook receiver, when, and what to do when it fails.
//!
//! One [`WebhookQueue`] per event kind ([`EventKind`]). The driver hands it events
//! ([`WebhookQueue::push`]: one JSON value each, already encoded), asks it for the
//! requests to send now ([`WebhookQueue::poll`]), reports each request's outcome
//! ([`WebhookQueue::on_done`]) and sleeps until [`WebhookQueue::next_wake`]. Time is
//! the driver's monotonic clock in ms, passed in; nothing here reads a clock or
//! touches a socket.
//!
//! - **Batching**: queued events leave as one request of at most `batch_max` of them
//!   (a JSON array; `msg.offline` is one object per request, [`Layout::Single`]),
//!   once `batch_max` are queued or the oldest has waited `batch_delay_ms`.
//! - **Bounded**: what is queued and what is in flight (retries included) is charged
//!   its bytes against `queue_bytes_max`; an event that does not fit is dropped and
//!   counted ([`QueueCounts::dropped`]): a slow or dead receiver costs memory up to
//!   the budget and nothing else.
//! - **Retries**: a failed request (no 2xx, a timeout, a connection error) is sent
//!   again, the same body, after `backoff_min_ms` doubling per attempt up to
//!   `backoff_ms_max`, until it succeeds (at-least-once while the node lives). At
//!   most `requests_in_flight_max` requests are out or waiting for their retry; the
//!   rest waits in the queue (and, past the budget, is dropped).
//! - **Deduplication**: an event with an id (a message id) that was accepted before
//!   is not queued again while its id is remembered: the ids of the accepted events
//!   whose bytes, newest first, fit in `queue_bytes_max` ([`Admit::Duplicate`]). A
//!   receiver deduplicates the rest by the ids in the bodies (a retry of a request
//!   that did arrive, for one).

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;

/// The events WuKongIM's webhooks send, by the name of the `event` query parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EventKind {
    /// `msg.offline`: a committed message and the recipients that had no route
    /// when it was planned (`to_uids`).
    Offline,
    /// `user.onlinestatus`: route changes as `uid-flag-status-connid-devices-total`.
    OnlineStatus,
    /// `msg.notify`: every committed message.
    Notify,
}

impl EventKind {
    /// Every kind, in index order.
    pub const ALL: [EventKind; 3] = [
        EventKind::Offline,
        EventKind::OnlineStatus,
        EventKind::Notify,
    ];

    /// The `event` query parameter's value.
    pub fn name(self) -> &'static str {
        match self {
            EventKind::Offline => "msg.offline",
            EventKind::OnlineStatus => "user.onlinestatus",
            EventKind::Notify => "msg.notify",
        }
    }

    /// The kind of an event name, `None` for a name WuKongIM does not send.
    pub fn parse(name: &str) -> Option<EventKind> {
        EventKind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Its place in [`EventKind::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// How its requests' bodies are laid out.
    pub fn layout(self) -> Layout {
        match self {
            EventKind::Offline => Layout::Single,
            EventKind::OnlineStatus | EventKind::Notify => Layout::Array,
        }
    }
}

/// How the events of one request form its body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// One event per request, the body is the event itself (`msg.offline`).
    Single,
    /// A JSON array of up to `batch_max` events.
    Array,
}

/// The limits of one queue (`[webhook]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueLimits {
    /// Events per request (at least 1 counts; [`Layout::Single`]: 1).
    pub batch_max: usize,
    /// How long the oldest queued event waits for a request to fill.
    pub batch_delay_ms: u64,
    /// Bytes of events queued and in flight (retries included).
    pub queue_bytes_max: usize,
    /// Requests out or waiting for their retry at once (at least 1 counts).
    pub requests_in_flight_max: usize,
    /// The first retry's delay; each further attempt doubles it.
    pub backoff_min_ms: u64,
    /// The longest delay between two attempts of one request.
    pub backoff_ms_max: u64,
}

/// One event: its encoded JSON value and, for deduplication, its id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// A message id (`msg.offline`, `msg.notify`); `None`: never a duplicate.
    pub id: Option<u64>,
    /// The event's JSON value.
    pub json: Vec<u8>,
}

/// What [`WebhookQueue::push`] did with an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Queued for the next batch; its id (if any) is now remembered.
    Queued,
    /// Its id was accepted before and is still remembered: not queued.
    Duplicate,
    /// It did not fit in `queue_bytes_max`: dropped (counted).
    Dropped,
}

/// A request to send: POST `body`, then report the outcome with `batch`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Names the batch in [`WebhookQueue::on_done`]; the same on every attempt (a
    /// receiver may deduplicate by it too).
    pub batch: u64,
    /// 1 for the first attempt.
    pub attempt: u32,
    /// Events in the body.
    pub events: usize,
    /// The POST body: the event itself ([`Layout::Single`]) or a JSON array of the
    /// events; byte for byte the same on every attempt.
    pub body: Arc<[u8]>,
}

/// Cumulative counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueCounts {
    /// Events in requests the receiver accepted (2xx).
    pub sent: u64,
    /// Requests that failed (each is retried).
    pub failed: u64,
    /// Events dropped: they did not fit in `queue_bytes_max`.
    pub dropped: u64,
    /// Events not queued: their id was seen before.
    pub deduplicated: u64,
}

/// A batch out or waiting for its retry.
struct Batch {
    id: u64,
    body: Arc<[u8]>,
    events: usize,
    /// What its events are charged.
    bytes: usize,
    attempt: u32,
    /// `None`: out; `Some(t)`: sent again at `t`.
    retry_at_ms: Option<u64>,
}

/// The queue of one event kind (see the module docs).
pub struct WebhookQueue {
    limits: QueueLimits,
    layout: Layout,
    /// Events not yet in a batch, oldest first, with the time each was queued.
    queued: VecDeque<(u64, Vec<u8>)>,
    queued_bytes: usize,
    batches: Vec<Batch>,
    batch_bytes: usize,
    next_batch: u64,
    /// Ids of accepted events (with their bytes), oldest first, and as a set.
    seen_order: VecDeque<(u64, usize)>,
    seen: HashSet<u64>,
    seen_bytes: usize,
    counts: QueueCounts,
}

impl WebhookQueue {
    /// An empty queue of one event kind, its bodies laid out as `layout`
    /// ([`EventKind::layout`]).
    pub fn new(limits: QueueLimits, layout: Layout) -> WebhookQueue {
        WebhookQueue {
            limits,
            layout,
            queued: VecDeque::new(),
            queued_bytes: 0,
            batches: Vec::new(),
            batch_bytes: 0,
            next_batch: 1,
            seen_order: VecDeque::new(),
            seen: HashSet::new(),
            seen_bytes: 0,
            counts: QueueCounts::default(),
        }
    }

    /// Events per request for this queue's layout.
    fn batch_max(&self) -> usize {
        match self.layout {
            Layout::Single => 1,
            Layout::Array => self.limits.batch_max.max(1),
        }
    }

    /// Queues `event` at `now_ms` (see [`Admit`]).
    pub fn push(&mut self, event: Event, now_ms: u64) -> Admit {
        if event.id.is_some_and(|id| self.seen.contains(&id)) {
            self.counts.deduplicated += 1;
            return Admit::Duplicate;
        }
        let len = event.json.len();
        if self.bytes() + len > self.limits.queue_bytes_max {
            self.counts.dropped += 1;
            return Admit::Dropped;
        }
        if let Some(id) = event.id {
            self.remember(id, len);
        }
        self.queued_bytes += len;
        self.queued.push_back((now_ms, event.json));
        Admit::Queued
    }

    /// Remembers an accepted id, forgetting the oldest past the budget.
    fn remember(&mut self, id: u64, len: usize) {
        self.seen.insert(id);
        self.seen_order.push_back((id, len));
        self.seen_bytes += len;
        while self.seen_bytes > self.limits.queue_bytes_max {
            let Some((old, n)) = self.seen_order.pop_front() else {
                break;
            };
            self.seen.remove(&old);
            self.seen_bytes -= n;
        }
    }

    /// The next request to send at `now_ms`, if any: a batch whose retry is due,
    /// else a new batch when a slot is free and the queue is ready (`batch_max`
    /// events, or the oldest has waited `batch_delay_ms`). Call it until `None`.
    pub fn poll(&mut self, now_ms: u64) -> Option<Request> {
        if let Some(b) = self
            .batches
            .iter_mut()
            .find(|b| b.retry_at_ms.is_some_and(|t| t <= now_ms))
        {
            b.retry_at_ms = None;
            b.attempt += 1;
            return Some(Request {
                batch: b.id,
                attempt: b.attempt,
                events: b.events,
                body: b.body.clone(),
            });
        }
        if !self.ready(now_ms) {
            return None;
        }
        Some(self.cut_batch())
    }

    /// Whether a new batch may be cut at `now_ms`.
    fn ready(&self, now_ms: u64) -> bool {
        let Some(&(oldest_ms, _)) = self.queued.front() else {
            return false;
        };
        self.batches.len() < self.limits.requests_in_flight_max.max(1)
            && (self.queued.len() >= self.batch_max()
                || now_ms >= oldest_ms.saturating_add(self.limits.batch_delay_ms))
    }

    /// Takes up to `batch_max` queued events into a new batch, out now.
    fn cut_batch(&mut self) -> Request {
        let n = self.batch_max().min(self.queued.len());
        let mut body = Vec::new();
        let mut bytes = 0;
        if self.layout == Layout::Array {
            body.push(b'[');
        }
        for (i, (_, json)) in self.queued.drain(..n).enumerate() {
            if i > 0 {
                body.push(b',');
            }
            bytes += json.len();
            body.extend_from_slice(&json);
        }
        if self.layout == Layout::Array {
            body.push(b']');
        }
        self.queued_bytes -= bytes;
        self.batch_bytes += bytes;
        let id = self.next_batch;
        self.next_batch += 1;
        let body: Arc<[u8]> = body.into();
        self.batches.push(Batch {
            id,
            body: body.clone(),
            events: n,
            bytes,
            attempt: 1,
            retry_at_ms: None,
        });
        Request {
            batch: id,
            attempt: 1,
            events: n,
            body,
        }
    }

    /// The outcome of a request of `batch` at `now_ms`: accepted (`ok`), the batch
    /// is done; failed, it is sent again after its backoff. Returns whether the
    /// batch was out (an unknown or waiting batch is ignored).
    pub fn on_done(&mut self, batch: u64, ok: bool, now_ms: u64) -> bool {
        let Some(i) = self
            .batches
            .iter()
            .position(|b| b.id == batch && b.retry_at_ms.is_none())
        else {
            return false;
        };
        if ok {
            let b = self.batches.swap_remove(i);
            self.batch_bytes -= b.bytes;
            self.counts.sent += b.events as u64;
        } else {
            self.counts.failed += 1;
            let b = &mut self.batches[i];
            b.retry_at_ms = Some(now_ms.saturating_add(self.limits.backoff_ms(b.attempt)));
        }
        true
    }

    /// When [`poll`](Self::poll) has something next (a retry, or the oldest
    /// event's batch delay; a past time: at once), `None` while only answers are
    /// awaited (each [`on_done`](Self::on_done) is a reason to poll again).
    pub fn next_wake(&self) -> Option<u64> {
        let retry = self.batches.iter().filter_map(|b| b.retry_at_ms).min();
        let slot_free = self.batches.len() < self.limits.requests_in_flight_max.max(1);
        let batch = match self.queued.front() {
            Some(&(oldest_ms, _)) if slot_free => {
                if self.queued.len() >= self.batch_max() {
                    Some(oldest_ms)
                } else {
                    Some(oldest_ms.saturating_add(self.limits.batch_delay_ms))
                }
            }
            _ => None,
        };
        match (retry, batch) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Bytes of events queued and in flight (charged against `queue_bytes_max`).
    pub fn bytes(&self) -> usize {
        self.queued_bytes + self.batch_bytes
    }

    /// Events queued and in flight.
    pub fn events(&self) -> usize {
        self.queued.len() + self.batches.iter().map(|b| b.events).sum::<usize>()
    }

    /// The counters so far.
    pub fn counts(&self) -> QueueCounts {
        self.counts
    }
}

impl QueueLimits {
    /// The delay before attempt `attempt + 1`: `backoff_min_ms × 2^(attempt-1)`,
    /// at most `backoff_ms_max`.
    pub fn backoff_ms(&self, attempt: u32) -> u64 {
        let doublings = attempt.saturating_sub(1).min(63);
        self.backoff_min_ms
            .checked_shl(doublings)
            .filter(|d| d >> doublings == self.backoff_min_ms)
            .unwrap_or(u64::MAX)
            .min(self.backoff_ms_max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> QueueLimits {
        QueueLimits {
            batch_max: 3,
            batch_delay_ms: 100,
            queue_bytes_max: 1_000,
            requests_in_flight_max: 2,
            backoff_min_ms: 50,
            backoff_ms_max: 400,
        }
    }

    fn ev(id: u64, json: &str) -> Event {
        Event {
            id: Some(id),
            json: json.as_bytes().to_vec(),
        }
    }

    fn body(r: &Request) -> &str {
        std::str::from_utf8(&r.body).unwrap()
    }

    #[test]
    fn a_batch_leaves_when_full_or_when_its_oldest_event_waited_the_delay() {
        let mut q = WebhookQueue::new(limits(), Layout::Array);
        q.push(ev(1, "1"), 0);
        q.push(ev(2, "2"), 10);
        assert_eq!(q.poll(99), None, "two of three, 99 ms");
        assert_eq!(q.next_wake(), Some(100));
        let r = q.poll(100).expect("the delay passed");
        assert_eq!((body(&r), r.events, r.attempt), ("[1,2]", 2, 1));
        q.push(ev(3, "3"), 200);
        q.push(ev(4, "4"), 201);
        q.push(ev(5, "5"), 202);
        q.push(ev(6, "6"), 203);
        let r = q.poll(203).expect("batch_max reached: at once");
        assert_eq!(body(&r), "[3,4,5]");
        assert_eq!(q.poll(203), None, "two requests out: no slot");
        assert_eq!(q.next_wake(), None, "only answers awaited");
        assert_eq!(q.events(), 6);
    }

    #[test]
    fn single_layout_sends_one_event_per_request_as_it_is() {
        let mut q = WebhookQueue::new(limits(), Layout::Single);
        q.push(ev(1, r#"{"a":1}"#), 0);
        q.push(ev(2, r#"{"a":2}"#), 0);
        assert_eq!(body(&q.poll(0).unwrap()), r#"{"a":1}"#);
        assert_eq!(body(&q.poll(0).unwrap()), r#"{"a":2}"#);
        assert_eq!(q.poll(1_000), None);
    }

    #[test]
    fn a_failed_request_is_retried_with_its_body_after_a_capped_exponential_backoff() {
        let mut q = WebhookQueue::new(limits(), Layout::Array);
        q.push(ev(1, "1"), 0);
        let first = q.poll(100).unwrap();
        let mut now = 100;
        let mut delays = Vec::new();
        let mut last = first.clone();
        for _ in 0..6 {
            assert!(q.on_done(last.batch, false, now));
            let due = q.next_wake().unwrap();
            assert_eq!(q.poll(due - 1), None, "not before its backoff");
            delays.push(due - now);
            now = due;
            last = q.poll(now).unwrap();
            assert_eq!((last.batch, &last.body), (first.batch, &first.body));
        }
        assert_eq!(delays, [50, 100, 200, 400, 400, 400]);
        assert_eq!(last.attempt, 7);
        assert!(q.on_done(last.batch, true, now));
        assert_eq!(
            q.counts(),
            QueueCounts {
                sent: 1,
                failed: 6,
                ..QueueCounts::default()
            }
        );
        assert_eq!((q.bytes(), q.events(), q.next_wake()), (0, 0, None));
        assert!(!q.on_done(last.batch, true, now), "done once");
    }

    #[test]
    fn backoff_never_overflows() {
        let l = QueueLimits {
            backoff_min_ms: 1 << 40,
            backoff_ms_max: u64::MAX,
            ..limits()
        };
        assert_eq!(l.backoff_ms(1), 1 << 40);
        assert_eq!(l.backoff_ms(30), u64::MAX);
        assert_eq!(l.backoff_ms(u32::MAX), u64::MAX);
    }

    #[test]
    fn past_the_byte_budget_events_are_dropped_and_counted_retries_included() {
        let l = QueueLimits {
            queue_bytes_max: 10,
            ..limits()
        };
        let mut q = WebhookQueue::new(l, Layout::Array);
        assert_eq!(q.push(ev(1, "1234"), 0), Admit::Queued);
        assert_eq!(q.push(ev(2, "5678"), 0), Admit::Queued);
        assert_eq!(q.push(ev(3, "abc"), 0), Admit::Dropped, "4 + 4 + 3 > 10");
        assert_eq!(q.push(ev(4, "ab"), 0), Admit::Queued, "4 + 4 + 2 fits");
        let r = q.poll(0).unwrap();
        assert!(q.on_done(r.batch, false, 0));
        assert_eq!(
            q.bytes(),
            10,
            "a batch waiting for its retry keeps its charge"
        );
        assert_eq!(q.push(ev(5, "x"), 1), Admit::Dropped);
        let r = q.poll(1_000).unwrap();
        assert!(q.on_done(r.batch, true, 1_000));
        assert_eq!(q.push(ev(5, "x"), 1_001), Admit::Queued, "room again");
        let c = q.counts();
        assert_eq!((c.dropped, c.sent, c.failed), (2, 3, 1));
    }

    #[test]
    fn an_accepted_id_is_not_queued_again_while_remembered() {
        let l = QueueLimits {
            queue_bytes_max: 6,
            ..limits()
        };
        let mut q = WebhookQueue::new(l, Layout::Array);
        assert_eq!(q.push(ev(7, "aa"), 0), Admit::Queued);
        assert_eq!(q.push(ev(7, "aa"), 0), Admit::Duplicate);
        let r = q.poll(100).unwrap();
        q.on_done(r.batch, true, 100);
        assert_eq!(
            q.push(ev(7, "aa"), 101),
            Admit::Duplicate,
            "sent: still seen"
        );
        let no_id = Event {
            id: None,
            json: b"zz".to_vec(),
        };
        assert_eq!(q.push(no_id.clone(), 101), Admit::Queued);
        assert_eq!(
            q.push(no_id, 101),
            Admit::Queued,
            "no id: never a duplicate"
        );
        // 2 + 2 + 2 bytes of ids remembered (7, 8, 9) pass 6 with 10: 7 forgotten.
        let r = q.poll(300).unwrap();
        q.on_done(r.batch, true, 300);
        for id in [8, 9, 10] {
            assert_eq!(q.push(ev(id, "bb"), 300), Admit::Queued);
            let r = q.poll(500).unwrap();
            q.on_done(r.batch, true, 500);
        }
        assert_eq!(q.push(ev(10, "bb"), 600), Admit::Duplicate);
        assert_eq!(q.push(ev(7, "aa"), 600), Admit::Queued, "forgotten");
        assert_eq!(q.counts().deduplicated, 3);
    }

    #[test]
    fn ids_are_remembered_up_to_exactly_the_byte_budget() {
        // 2 bytes an event, 6 bytes of memory: three ids at a time.
        let l = QueueLimits {
            queue_bytes_max: 6,
            ..limits()
        };
        let mut q = WebhookQueue::new(l, Layout::Single);
        let send = |q: &mut WebhookQueue, id: u64| {
            assert_eq!(q.push(ev(id, "ab"), 0), Admit::Queued, "id {id}");
            let r = q.poll(0).expect("a single event goes at once");
            assert!(q.on_done(r.batch, true, 0));
        };
        for id in 1..=3 {
            send(&mut q, id);
        }
        // At the budget exactly: all three remembered.
        for id in 1..=3 {
            assert_eq!(q.push(ev(id, "ab"), 0), Admit::Duplicate, "id {id}");
        }
        send(&mut q, 4);
        assert_eq!(q.push(ev(2, "ab"), 0), Admit::Duplicate);
        send(&mut q, 5);
        // Each new id past the budget forgot exactly the oldest.
        assert_eq!(q.push(ev(3, "ab"), 0), Admit::Duplicate);
        assert_eq!(q.push(ev(4, "ab"), 0), Admit::Duplicate);
        assert_eq!(q.push(ev(5, "ab"), 0), Admit::Duplicate);
        send(&mut q, 2);
        send(&mut q, 1);
    }

    #[test]
    fn each_batch_has_its_own_id_and_only_an_out_batch_completes() {
        let mut q = WebhookQueue::new(limits(), Layout::Single);
        q.push(ev(1, "1"), 0);
        q.push(ev(2, "2"), 0);
        let (a, b) = (q.poll(0).unwrap(), q.poll(0).unwrap());
        assert_ne!(a.batch, b.batch);
        assert!(
            q.on_done(a.batch, false, 0),
            "a failed: it waits for its retry"
        );
        assert!(!q.on_done(a.batch, true, 0), "a waiting batch is not out");
        assert!(q.on_done(b.batch, true, 0));
        assert!(!q.on_done(b.batch, true, 0), "done once");
        let again = q.poll(1_000).unwrap();
        assert_eq!(
            (again.batch, again.attempt, body(&again)),
            (a.batch, 2, "1")
        );
    }

    #[test]
    fn a_retry_comes_before_a_new_batch_and_slots_bound_what_is_out() {
        let l = QueueLimits {
            requests_in_flight_max: 1,
            ..limits()
        };
        let mut q = WebhookQueue::new(l, Layout::Array);
        q.push(ev(1, "1"), 0);
        let r = q.poll(100).unwrap();
        q.push(ev(2, "2"), 100);
        assert_eq!(q.poll(1_000), None, "the one slot is out");
        q.on_done(r.batch, false, 1_000);
        assert_eq!(q.next_wake(), Some(1_050), "the retry; no slot for event 2");
        let again = q.poll(1_050).unwrap();
        assert_eq!(body(&again), "[1]");
        q.on_done(again.batch, true, 1_051);
        assert_eq!(q.next_wake(), Some(200), "event 2's delay has passed");
        assert_eq!(body(&q.poll(1_051).unwrap()), "[2]");
    }

    #[test]
    fn event_names_round_trip() {
        for k in EventKind::ALL {
            assert_eq!(EventKind::parse(k.name()), Some(k));
            assert_eq!(EventKind::ALL[k.index()], k);
        }
        assert_eq!(EventKind::parse("msg.other"), None);
    }
}
