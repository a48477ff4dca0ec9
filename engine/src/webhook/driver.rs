//! The webhooks' driver (`msg.offline`, `user.onlinestatus`; `msg.notify` is
//! [`super::notify`]'s): one tokio task. It takes the shards' events from the
//! hand-off, encodes them, feeds them to one `domain::webhook::WebhookQueue` per
//! kind, posts the requests the queues give (each on a task of its own, at most
//! `requests_in_flight_max` per kind), reports each outcome back, and sleeps until
//! the next event, answer or deadline (a batch delay, a retry). The decisions are
//! the queues'; this only carries them.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use domain::webhook::{Admit, EventKind, QueueCounts, Request, WebhookQueue};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::client::WebhookClient;
use super::{encode, Pending, WebhookSink};

/// Events taken from the hand-off per wake before the queues are polled.
const HANDOFF_BATCH_MAX: usize = 1_024;

/// What one posted request came back with.
struct Done {
    kind: EventKind,
    batch: u64,
    attempt: u32,
    result: Result<(), String>,
}

/// The queues and what was last published of their counters.
struct Queues {
    queues: [Option<WebhookQueue>; 3],
    published: [QueueCounts; 3],
    epoch: Instant,
}

impl Queues {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Encodes `p` and queues it (its hand-off charge released).
    fn push(&mut self, sink: &WebhookSink, p: Pending) {
        let (kind, charge) = (p.kind(), p.charge());
        sink.arrived(kind, charge);
        let now = self.now_ms();
        let Some(q) = self.queues[kind.index()].as_mut() else {
            return;
        };
        let event = match &p {
            Pending::Offline { message, uids } => encode::offline(message, uids),
            Pending::Status(change) => encode::status(change),
        };
        if q.push(event, now) == Admit::Dropped {
            // Counted by the queue; logged at the sink's rate.
            sink.dropped(kind, 0);
        }
    }

    /// Every request due now, with its kind.
    fn due(&mut self) -> Vec<(EventKind, Request)> {
        let now = self.now_ms();
        let mut out = Vec::new();
        for kind in EventKind::ALL {
            if let Some(q) = self.queues[kind.index()].as_mut() {
                while let Some(r) = q.poll(now) {
                    out.push((kind, r));
                }
            }
        }
        out
    }

    /// The earliest time a queue wants to be polled, from now.
    fn next_wake(&self) -> Option<Duration> {
        let now = self.now_ms();
        let wake = self
            .queues
            .iter()
            .flatten()
            .filter_map(|q| q.next_wake())
            .min()?;
        Some(Duration::from_millis(wake.saturating_sub(now)))
    }

    /// Mirrors each queue's counters and gauges into the sink's stats.
    fn publish(&mut self, sink: &WebhookSink) {
        for kind in EventKind::ALL {
            let Some(q) = self.queues[kind.index()].as_ref() else {
                continue;
            };
            let (c, last) = (q.counts(), &mut self.published[kind.index()]);
            let s = &sink.stats[kind.index()];
            s.sent.fetch_add(c.sent - last.sent, Ordering::Relaxed);
            s.failed
                .fetch_add(c.failed - last.failed, Ordering::Relaxed);
            s.dropped
                .fetch_add(c.dropped - last.dropped, Ordering::Relaxed);
            s.deduplicated
                .fetch_add(c.deduplicated - last.deduplicated, Ordering::Relaxed);
            s.queued.store(q.events() as u64, Ordering::Relaxed);
            s.queued_bytes.store(q.bytes(), Ordering::Relaxed);
            *last = c;
        }
    }
}

/// The driver's loop; ends when every sender of the hand-off is gone (the node
/// stopped) or with its runtime.
pub async fn run(
    sink: Arc<WebhookSink>,
    client: Arc<WebhookClient>,
    mut rx: mpsc::UnboundedReceiver<Pending>,
) {
    let limits = sink.config().limits();
    let mut queues = Queues {
        // `msg.notify` has a task of its own (`super::notify`).
        queues: EventKind::ALL.map(|k| {
            (sink.enabled(k) && k != EventKind::Notify)
                .then(|| WebhookQueue::new(limits, k.layout()))
        }),
        published: [QueueCounts::default(); 3],
        epoch: Instant::now(),
    };
    let mut out: JoinSet<Done> = JoinSet::new();
    let mut taken = Vec::with_capacity(HANDOFF_BATCH_MAX);
    loop {
        for (kind, r) in queues.due() {
            let client = client.clone();
            out.spawn(async move {
                let result = client.post(kind, &r).await;
                Done {
                    kind,
                    batch: r.batch,
                    attempt: r.attempt,
                    result,
                }
            });
        }
        queues.publish(&sink);
        let sleep = queues.next_wake().unwrap_or(Duration::from_secs(3_600));
        tokio::select! {
            n = rx.recv_many(&mut taken, HANDOFF_BATCH_MAX) => {
                if n == 0 {
                    return;
                }
                for p in taken.drain(..) {
                    queues.push(&sink, p);
                }
            }
            Some(done) = out.join_next(), if !out.is_empty() => {
                if let Ok(done) = done {
                    on_done(&mut queues, done);
                }
            }
            () = tokio::time::sleep(sleep) => {}
        }
    }
}

/// A request's outcome back to its queue (a failure logged at debug: the counter
/// shows them, and a receiver that is down fails every request).
fn on_done(queues: &mut Queues, done: Done) {
    let now = queues.now_ms();
    let Some(q) = queues.queues[done.kind.index()].as_mut() else {
        return;
    };
    if let Err(err) = &done.result {
        tracing::debug!(
            event = done.kind.name(),
            batch = done.batch,
            attempt = done.attempt,
            %err,
            "webhook request failed; retrying"
        );
    }
    q.on_done(done.batch, done.result.is_ok(), now);
}
