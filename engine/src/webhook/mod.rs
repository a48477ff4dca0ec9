//! Webhooks as WuKongIM sends them (issue 28 item 3): `POST {url}?event=NAME` with a
//! JSON body, to the application's receiver.
//!
//! - `msg.offline`: a committed message and `to_uids`, its recipients that had no
//!   route when its delivery was planned (`domain::send::delivery::PlanOutput::Offline`,
//!   the planner's own lookups), sent by the node that committed it (the channel's
//!   home): one request per message.
//! - `user.onlinestatus`: route changes at the uid's authority
//!   (`domain::presence::authority::PresenceChange`) as WuKongIM's strings
//!   `uid-device_flag-online-session_id-device_online-total_online`, batched; the
//!   counts are every node's, so the authority sends them, not the session's owner.
//! - `msg.notify`: every message in this node's message logs (every message it
//!   committed, NoPersist ones aside), batched, read from the logs' files by
//!   [`notify`] from a cursor persisted in the data dir: at least once across
//!   restarts. The shards only publish where each log ends ([`WebhookSink::committed`]).
//!
//! The shards hand events to the [`WebhookSink`] and go on: the hand-off never
//! blocks and never waits for the receiver. An event that would pass the kind's
//! `queue_bytes_max` (what is queued, in flight and on its way there) is dropped and
//! counted, with a warning at most every [`DROP_LOG_INTERVAL`]. The driver
//! ([`driver`]) runs on the HTTP API's tokio runtime (or a one-thread runtime of its
//! own when the node has no API listener): it encodes the events, feeds them to
//! the sans-IO queues of `domain::webhook` (batching, the byte budget, retries with
//! capped exponential backoff, dedup of message ids) and posts what they give with
//! the [`client`].

pub mod client;
pub mod driver;
mod encode;
pub mod notify;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use domain::presence::authority::PresenceChange;
use domain::presence::route::Uid;
use domain::send::commit::Committed;
use domain::webhook::{EventKind, QueueLimits};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::config::values::Secret;
use crate::store::LogPosition;

/// The shortest time between two warnings about dropped events of one kind.
pub const DROP_LOG_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

/// `[webhook]`: where and how events are posted. An empty `url`: no webhooks.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WebhookConfig {
    /// `http://host:port/path` or `https://...` of the receiver (`?event=NAME` is
    /// added); empty: no webhooks.
    pub url: String,
    /// An `https` receiver's certificate is checked against the CA certificates of
    /// this PEM file only; empty: against Mozilla's roots (webpki-roots).
    pub ca_file: PathBuf,
    /// The events sent: `msg.offline`, `user.onlinestatus`, `msg.notify`.
    pub events: Vec<String>,
    /// One request's limit: connect, send, answer and its body.
    pub timeout_ms: u64,
    /// Events per request (`user.onlinestatus`, `msg.notify`; `msg.offline` is one
    /// message per request).
    pub batch_max: usize,
    /// How long an event waits for its request to fill.
    pub batch_delay_ms: u64,
    /// Per event kind: what its events queued, in flight (retries included) and on
    /// their way from the shards may hold; past it new events are dropped
    /// (`imrouter_webhook_dropped_total`). Message ids accepted are remembered up to
    /// as many bytes: a duplicate is not queued again.
    pub queue_bytes_max: usize,
    /// Per event kind: requests out or waiting for their retry at once.
    pub requests_in_flight_max: usize,
    /// A failed request is retried after this, doubling per attempt...
    pub backoff_min_ms: u64,
    /// ...up to this; retries go on while the node runs.
    pub backoff_ms_max: u64,
    /// `msg.notify`: messages one read of a shard's log takes (what is read waits
    /// for room in `queue_bytes_max` before it is queued).
    pub notify_read_max: usize,
    /// `msg.notify`: messages read from the logs per second, at most (a replay
    /// after a restart or an outage reads no faster).
    pub notify_read_per_s: u64,
    /// `msg.notify`: per shard, messages read and not yet behind the cursor (the
    /// oldest not accepted holds the cursor; those read after it wait there,
    /// accepted or not); at it, that shard's log is not read further until the
    /// oldest is accepted.
    pub notify_window_max: usize,
    /// `msg.notify`: the cursor file is written at most this often (and only when
    /// it moved); a restart resends what the receiver accepted since.
    pub notify_cursor_interval_ms: u64,
    /// When set, every request carries `X-Imrouter-Signature: sha256=<hex>`, the
    /// HMAC-SHA256 of the body keyed by it.
    pub secret: Secret,
}

impl Default for WebhookConfig {
    fn default() -> Self {
        WebhookConfig {
            url: String::new(),
            ca_file: PathBuf::new(),
            events: vec![
                EventKind::Offline.name().into(),
                EventKind::OnlineStatus.name().into(),
            ],
            timeout_ms: 5_000,
            batch_max: 100,
            batch_delay_ms: 50,
            queue_bytes_max: 64 << 20,
            requests_in_flight_max: 4,
            backoff_min_ms: 100,
            backoff_ms_max: 30_000,
            notify_read_max: 1_000,
            notify_read_per_s: 20_000,
            notify_window_max: 100_000,
            notify_cursor_interval_ms: 1_000,
            secret: Secret::default(),
        }
    }
}

impl WebhookConfig {
    /// Whether webhooks are on.
    pub fn enabled(&self) -> bool {
        !self.url.is_empty()
    }

    /// The event kinds asked for (names checked by [`validate`](Self::validate)).
    pub fn kinds(&self) -> Vec<EventKind> {
        let mut kinds: Vec<EventKind> = self
            .events
            .iter()
            .filter_map(|e| EventKind::parse(e))
            .collect();
        kinds.sort();
        kinds.dedup();
        kinds
    }

    /// The queues' limits.
    pub fn limits(&self) -> QueueLimits {
        QueueLimits {
            batch_max: self.batch_max,
            batch_delay_ms: self.batch_delay_ms,
            queue_bytes_max: self.queue_bytes_max,
            requests_in_flight_max: self.requests_in_flight_max,
            backoff_min_ms: self.backoff_min_ms,
            backoff_ms_max: self.backoff_ms_max,
        }
    }

    /// Refuses a configuration the node cannot send with, naming the key. Nothing
    /// is checked while `url` is empty.
    pub fn validate(&self) -> Result<(), String> {
        if !self.enabled() {
            return Ok(());
        }
        let target = client::Target::parse(&self.url)
            .map_err(|e| format!("webhook.url = {:?}: {e}", self.url))?;
        if !self.ca_file.as_os_str().is_empty() {
            if !target.is_https() {
                return Err(format!(
                    "webhook.ca_file is set but webhook.url = {:?} is not https://",
                    self.url
                ));
            }
            client::root_store(&self.ca_file)
                .map_err(|e| format!("webhook.ca_file {}: {e}", self.ca_file.display()))?;
        }
        for e in &self.events {
            if EventKind::parse(e).is_none() {
                return Err(format!(
                    "webhook.events: unknown event {e:?} (the events sent: msg.offline, \
                     user.onlinestatus, msg.notify)"
                ));
            }
        }
        if self.secret.expose() == b"<set>" {
            return Err(
                "webhook.secret is \"<set>\", the placeholder --print-config shows: \
                 write the secret itself"
                    .into(),
            );
        }
        crate::config::values::at_least_one(
            "webhook",
            &[
                ("timeout_ms", self.timeout_ms),
                ("batch_max", self.batch_max as u64),
                ("queue_bytes_max", self.queue_bytes_max as u64),
                ("requests_in_flight_max", self.requests_in_flight_max as u64),
                ("backoff_min_ms", self.backoff_min_ms),
                ("backoff_ms_max", self.backoff_ms_max),
                ("notify_read_max", self.notify_read_max as u64),
                ("notify_read_per_s", self.notify_read_per_s),
                ("notify_window_max", self.notify_window_max as u64),
                ("notify_cursor_interval_ms", self.notify_cursor_interval_ms),
            ],
        )?;
        if self.backoff_ms_max < self.backoff_min_ms {
            return Err(format!(
                "webhook.backoff_ms_max = {} is below backoff_min_ms = {}",
                self.backoff_ms_max, self.backoff_min_ms
            ));
        }
        Ok(())
    }
}

/// What a shard hands over: the event before it is encoded (the driver encodes it,
/// off the shards).
pub enum Pending {
    /// `msg.offline`: the message and its offline recipients.
    Offline {
        message: Arc<Committed>,
        uids: Vec<Uid>,
    },
    /// `user.onlinestatus`: one route change.
    Status(PresenceChange),
}

impl Pending {
    fn kind(&self) -> EventKind {
        match self {
            Pending::Offline { .. } => EventKind::Offline,
            Pending::Status(_) => EventKind::OnlineStatus,
        }
    }

    /// What it is charged on its way (at least its encoded size, about).
    fn charge(&self) -> usize {
        match self {
            Pending::Offline { message, uids } => {
                let strings = message.from_uid.len()
                    + message.channel_key.len()
                    + message.client_msg_no.len()
                    + message.topic.len();
                let uids: usize = uids.iter().map(|u| u.len() + 3).sum();
                320 + message.payload.len().div_ceil(3) * 4 + 2 * strings + uids
            }
            Pending::Status(c) => c.uid.len() + 64,
        }
    }
}

/// One event kind's counters and gauges (`/metrics`).
#[derive(Debug, Default)]
pub struct KindStats {
    /// Whether this kind is sent.
    pub enabled: bool,
    /// Events the receiver accepted.
    pub sent: AtomicU64,
    /// Requests that failed (each retried).
    pub failed: AtomicU64,
    /// Events dropped: over `queue_bytes_max`.
    pub dropped: AtomicU64,
    /// Events not queued: their message id was accepted before.
    pub deduplicated: AtomicU64,
    /// Events queued and in flight (the driver's queue).
    pub queued: AtomicU64,
    /// Bytes queued and in flight (the driver's queue).
    pub queued_bytes: AtomicUsize,
    /// Bytes on their way from the shards to the driver.
    handoff_bytes: AtomicUsize,
    /// When a drop was last logged (ms since the sink started; 0: never).
    last_drop_log_ms: AtomicU64,
    /// The charge of the last event offered: what the next one is expected to
    /// need ([`WebhookSink::has_room`]).
    last_charge: AtomicUsize,
}

impl KindStats {
    /// Bytes charged against `queue_bytes_max`: queued, in flight, on their way.
    pub fn bytes(&self) -> usize {
        self.queued_bytes.load(Ordering::Relaxed) + self.handoff_bytes.load(Ordering::Relaxed)
    }
}

/// The shards' end of the webhooks: a non-blocking hand-off to the driver, and the
/// counters `/metrics` shows. Disabled (no `[webhook] url`): every call returns at
/// once.
pub struct WebhookSink {
    config: WebhookConfig,
    /// Per [`EventKind::index`].
    pub stats: [KindStats; 3],
    tx: Option<mpsc::UnboundedSender<Pending>>,
    /// The driver's end, until it starts.
    rx: Mutex<Option<mpsc::UnboundedReceiver<Pending>>>,
    started: Instant,
    /// `msg.notify`: where each log ends and the cursor (with [`Self::with_logs`]).
    notify: Option<notify::NotifyFeed>,
}

impl WebhookSink {
    pub fn new(config: &WebhookConfig) -> WebhookSink {
        let mut stats: [KindStats; 3] = Default::default();
        let (tx, rx) = if config.enabled() {
            for k in config.kinds() {
                stats[k.index()].enabled = true;
            }
            let (tx, rx) = mpsc::unbounded_channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        WebhookSink {
            config: config.clone(),
            stats,
            tx,
            rx: Mutex::new(rx),
            started: Instant::now(),
            notify: None,
        }
    }

    /// With `msg.notify` on: follows the logs of `data_dir`, which end at `ends`
    /// (per shard, as just opened), from the cursor saved there (a first start: from
    /// `ends`, saved now). Gives why the cursor file cannot be read or written.
    pub fn with_logs(mut self, data_dir: &Path, ends: &[LogPosition]) -> std::io::Result<Self> {
        if self.enabled(EventKind::Notify) {
            self.notify = Some(notify::NotifyFeed::open(data_dir, ends)?);
        }
        Ok(self)
    }

    /// `msg.notify`'s shared state (`None`: not sent).
    pub fn notify(&self) -> Option<&notify::NotifyFeed> {
        self.notify.as_ref()
    }

    /// Shard `shard`'s log now ends at `end` (`msg.notify` reads up to it). Never
    /// blocks: an atomic max and, when it moved, a wake-up of the reader.
    pub fn committed(&self, shard: usize, end: LogPosition) {
        if let Some(n) = &self.notify {
            n.published(shard, end);
        }
    }

    /// Whether events of `kind` are sent.
    pub fn enabled(&self, kind: EventKind) -> bool {
        self.stats[kind.index()].enabled
    }

    /// Whether `kind`'s queue has room now for an event as large as the last one
    /// offered: the planner gathers a message's offline recipients only then (one
    /// that would be dropped costs nothing; a group of 10,000 members costs
    /// gathering 10,000 uids).
    pub fn has_room(&self, kind: EventKind) -> bool {
        let stats = &self.stats[kind.index()];
        stats.bytes() + stats.last_charge.load(Ordering::Relaxed) <= self.config.queue_bytes_max
    }

    pub fn config(&self) -> &WebhookConfig {
        &self.config
    }

    /// A message's offline recipients (`msg.offline`).
    pub fn offline(&self, message: &Arc<Committed>, uids: Vec<Uid>) {
        if self.enabled(EventKind::Offline) {
            let message = message.clone();
            self.offer(Pending::Offline { message, uids });
        }
    }

    /// A route change at this node's authority (`user.onlinestatus`).
    pub fn status(&self, change: PresenceChange) {
        if self.enabled(EventKind::OnlineStatus) {
            self.offer(Pending::Status(change));
        }
    }

    /// Hands `p` to the driver if its kind's budget has room; else drops it,
    /// counted (and logged at a bounded rate).
    fn offer(&self, p: Pending) {
        let (kind, charge) = (p.kind(), p.charge());
        let stats = &self.stats[kind.index()];
        let Some(tx) = &self.tx else { return };
        stats.last_charge.store(charge, Ordering::Relaxed);
        if stats.bytes() + charge > self.config.queue_bytes_max {
            return self.dropped(kind, 1);
        }
        stats.handoff_bytes.fetch_add(charge, Ordering::Relaxed);
        if tx.send(p).is_err() {
            // The driver is gone (the node is stopping).
            stats.handoff_bytes.fetch_sub(charge, Ordering::Relaxed);
            self.dropped(kind, 1);
        }
    }

    /// Counts `n` dropped events of `kind`; warns at most every
    /// [`DROP_LOG_INTERVAL`] per kind.
    pub(crate) fn dropped(&self, kind: EventKind, n: u64) {
        let stats = &self.stats[kind.index()];
        let total = stats.dropped.fetch_add(n, Ordering::Relaxed) + n;
        let now_ms = self.started.elapsed().as_millis() as u64 + 1;
        let last = stats.last_drop_log_ms.load(Ordering::Relaxed);
        let due = last == 0 || now_ms >= last + DROP_LOG_INTERVAL.as_millis() as u64;
        if due
            && stats
                .last_drop_log_ms
                .compare_exchange(last, now_ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(
                event = kind.name(),
                dropped_total = total,
                queue_bytes_max = self.config.queue_bytes_max,
                "webhook queue full: events dropped (a slow or unreachable receiver)"
            );
        }
    }

    /// The driver's end of the hand-off (once).
    fn take_receiver(&self) -> Option<mpsc::UnboundedReceiver<Pending>> {
        self.rx.lock().ok()?.take()
    }

    /// Marks `charge` bytes of `kind` as arrived at the driver.
    fn arrived(&self, kind: EventKind, charge: usize) {
        self.stats[kind.index()]
            .handoff_bytes
            .fetch_sub(charge, Ordering::Relaxed);
    }
}

/// Starts the driver on `runtime` (the API's, or one of its own), and `msg.notify`'s
/// follower when it is sent, if webhooks are on and they have not started. `boot`
/// tells this start's batches from the previous ones' (`X-Imrouter-Batch`).
pub fn start(sink: &Arc<WebhookSink>, node_id: u64, boot: u64, runtime: &tokio::runtime::Handle) {
    let Some(rx) = sink.take_receiver() else {
        return;
    };
    let client = match client::WebhookClient::new(sink.config(), node_id, boot) {
        Ok(c) => Arc::new(c),
        Err(e) => {
            tracing::error!(err = %e, "webhooks not started");
            return;
        }
    };
    if sink.notify().is_some() {
        runtime.spawn(notify::run(sink.clone(), client.clone()));
    }
    runtime.spawn(driver::run(sink.clone(), client, rx));
    tracing::info!(url = %sink.config().url, events = ?sink.config().events, "webhooks on");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on(f: impl Fn(&mut WebhookConfig)) -> Result<(), String> {
        let mut c = WebhookConfig {
            url: "http://127.0.0.1:9/hook".into(),
            ..WebhookConfig::default()
        };
        f(&mut c);
        c.validate()
    }

    #[test]
    fn bad_settings_are_refused_by_key() {
        assert_eq!(on(|_| {}), Ok(()));
        let no_url = WebhookConfig {
            batch_max: 0,
            ..WebhookConfig::default()
        };
        assert_eq!(no_url.validate(), Ok(()), "nothing is checked while off");
        let err = |f: fn(&mut WebhookConfig)| on(f).unwrap_err();
        assert_eq!(on(|c| c.url = "https://h/x".into()), Ok(()));
        assert_eq!(on(|c| c.events = vec!["msg.notify".into()]), Ok(()));
        assert!(err(|c| c.url = "h:80".into()).contains("webhook.url"));
        assert!(err(|c| c.url = "ftp://h/x".into()).contains("webhook.url"));
        assert!(err(|c| c.events = vec!["msg.offlin".into()]).contains("unknown event"));
        let e = err(|c| {
            c.url = "https://h/x".into();
            c.ca_file = "/nonexistent/ca.pem".into();
        });
        assert!(e.contains("webhook.ca_file /nonexistent/ca.pem"), "{e}");
        assert!(err(|c| c.ca_file = "/nonexistent/ca.pem".into()).contains("not https://"));
        assert!(err(|c| c.notify_read_max = 0).contains("webhook.notify_read_max"));
        assert!(err(|c| c.notify_read_per_s = 0).contains("webhook.notify_read_per_s"));
        assert!(err(|c| c.notify_window_max = 0).contains("webhook.notify_window_max"));
        assert!(
            err(|c| c.notify_cursor_interval_ms = 0).contains("webhook.notify_cursor_interval_ms")
        );
        assert!(err(|c| c.batch_max = 0).contains("webhook.batch_max"));
        assert!(err(|c| c.queue_bytes_max = 0).contains("webhook.queue_bytes_max"));
        assert!(err(|c| c.timeout_ms = 0).contains("webhook.timeout_ms"));
        assert!(err(|c| c.backoff_ms_max = 1).contains("webhook.backoff_ms_max"));
        assert!(err(|c| c.secret = Secret::new("<set>".into())).contains("placeholder"));
    }

    #[test]
    fn the_config_file_carries_the_section_and_refuses_its_mistakes() {
        let text =
            "[webhook]\nurl = \"http://127.0.0.1:8080/x\"\nevents = [\"user.onlinestatus\"]\n";
        let c: crate::config::Config = toml::from_str(text).unwrap();
        let node = c.to_node_config().unwrap();
        assert_eq!(node.webhook.kinds(), [EventKind::OnlineStatus]);
        let text = "[webhook]\nurl = \"https://h/x\"\nevents = [\"msg.notify\", \"msg.offline\"]\n\
                    notify_read_max = 10\nnotify_read_per_s = 20\nnotify_cursor_interval_ms = 30\n";
        let c: crate::config::Config = toml::from_str(text).unwrap();
        let node = c.to_node_config().unwrap();
        assert_eq!(
            node.webhook.kinds(),
            [EventKind::Offline, EventKind::Notify]
        );
        let w = &node.webhook;
        assert_eq!(
            (
                w.notify_read_max,
                w.notify_read_per_s,
                w.notify_cursor_interval_ms
            ),
            (10, 20, 30)
        );
        let c: crate::config::Config =
            toml::from_str("[webhook]\nurl = \"http://h/\"\nbatch_delay_ms = 1\nbatch_max = 0\n")
                .unwrap();
        assert!(c
            .to_node_config()
            .unwrap_err()
            .contains("webhook.batch_max"));
        assert!(toml::from_str::<crate::config::Config>("[webhook]\nurls = \"\"\n").is_err());
    }

    /// A route change of uid `u` (65 bytes charged).
    fn a_change() -> PresenceChange {
        PresenceChange {
            uid: "u".into(),
            device_flag: 1,
            online: true,
            session_id: 1,
            device_online: 1,
            total_online: 1,
        }
    }

    #[test]
    fn a_disabled_sink_takes_nothing_and_a_full_one_drops_and_counts() {
        let off = WebhookSink::new(&WebhookConfig::default());
        assert!(!off.enabled(EventKind::Offline));
        let change = a_change();
        off.status(change.clone());
        assert_eq!(off.stats[EventKind::OnlineStatus.index()].bytes(), 0);
        let small = WebhookConfig {
            url: "http://127.0.0.1:9/".into(),
            queue_bytes_max: 100,
            ..WebhookConfig::default()
        };
        let sink = WebhookSink::new(&small);
        sink.status(change.clone());
        let stats = &sink.stats[EventKind::OnlineStatus.index()];
        assert_eq!(stats.bytes(), 65, "charged on its way");
        sink.status(change);
        assert_eq!(stats.dropped.load(Ordering::Relaxed), 1, "65 + 65 > 100");
        assert_eq!(stats.bytes(), 65);
    }

    #[test]
    fn room_is_for_an_event_as_large_as_the_last_one() {
        let change = a_change();
        let config = WebhookConfig {
            url: "http://127.0.0.1:9/".into(),
            queue_bytes_max: 130,
            ..WebhookConfig::default()
        };
        let sink = WebhookSink::new(&config);
        let kind = EventKind::OnlineStatus;
        assert!(sink.has_room(kind), "empty");
        sink.status(change.clone());
        assert!(sink.has_room(kind), "65 + 65 <= 130");
        sink.status(change.clone());
        assert!(
            !sink.has_room(kind),
            "130 + 65 > 130: the next would be dropped"
        );
        sink.status(change);
        assert_eq!(sink.stats[kind.index()].dropped.load(Ordering::Relaxed), 1);
    }
}
