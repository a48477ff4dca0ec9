//! The API's requests to other nodes: the transport of the API requests homed
//! elsewhere (see the module doc of [`super`]), and each peer's places and breaker.
//!
//! Contract of [`ForwardClient::send`]: one request (method, path and query, the
//! caller's bearer token, body) on the inter-node link to the node (the hop `Api`,
//! `crate::node`'s `api_hop.rs`: authenticated and sealed like every hop, never
//! plain HTTP between the nodes), handed to one of this node's shards in turn; the
//! other node's API answers it as if it had arrived there, from its own data only;
//! its status and body come back, or why none did, within `timeout` (the frame's
//! deadline). An answer body over `answer_bytes_max` is refused. It is awaited on
//! the API's runtime: no thread is held while the other node thinks.
//!
//! Contract of [`Peers::forward`]: at most `forward_connections_per_peer` requests
//! in flight to one peer (more wait for a place, up to `queue_timeout_ms`, then
//! [`PeerError::Busy`]); after `forward_breaker_failures` forwards in a row that got
//! no answer (unreachable, timed out), the peer's [`Breaker`] opens: forwards to it
//! fail at once ([`PeerError::Open`]) for `forward_breaker_cooldown_ms`, then one
//! is let through; its answer closes the breaker, its failure opens it again.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};

use domain::hop::NoAnswer;
use shard::runtime::Injector;
use tokio::sync::Semaphore;

use crate::cluster::NodeId;
use crate::node::msg::{ApiForward, Msg};
use crate::node::wire::ApiCall;

/// One request to another node's API.
#[derive(Debug, Clone, Copy)]
pub struct Outgoing<'a> {
    pub method: &'a str,
    /// The path and query, as the client sent them.
    pub target: &'a str,
    /// The `Authorization` header to pass on, if any.
    pub authorization: Option<&'a str>,
    pub body: &'a [u8],
}

pub use super::client::Answer;

/// Why no answer came.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// No link to the node, or the request or its answer was lost (the link
    /// closed, the node restarted).
    #[error("{0}")]
    Unreachable(String),
    #[error("no answer within {0} ms")]
    Timeout(u64),
    /// The link to the node had no room for it (its in-flight table, its quota of
    /// API requests, its breaker), or this node's shards had none: retry.
    #[error("{0}; retry")]
    Busy(&'static str),
    #[error("answer larger than {0} bytes")]
    TooLarge(usize),
}

impl ForwardError {
    /// Whether the peer gave no answer at all (what the breaker counts).
    pub fn is_no_answer(&self) -> bool {
        matches!(
            self,
            ForwardError::Unreachable(_) | ForwardError::Timeout(_)
        )
    }
}

/// The transport the forwards share: this node's shards and their links.
#[derive(Clone)]
pub struct ForwardClient {
    injectors: Vec<Injector<Msg>>,
    /// The shard the next request goes through (round robin).
    next: Arc<AtomicUsize>,
    answer_bytes_max: usize,
}

impl ForwardClient {
    /// Sends through the shards behind `injectors`; reads answers up to
    /// `answer_bytes_max`.
    pub fn new(injectors: Vec<Injector<Msg>>, answer_bytes_max: usize) -> ForwardClient {
        ForwardClient {
            injectors,
            next: Arc::new(AtomicUsize::new(0)),
            answer_bytes_max,
        }
    }

    /// Sends `request` to `node` and waits for its answer, all within `timeout`.
    /// Must be awaited on a tokio runtime with time enabled.
    pub async fn send(
        &self,
        node: NodeId,
        request: &Outgoing<'_>,
        timeout: Duration,
    ) -> Result<Answer, ForwardError> {
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let (answer, answered) = tokio::sync::oneshot::channel();
        let forward = ApiForward {
            node,
            call: ApiCall {
                method: request.method.to_owned(),
                target: request.target.to_owned(),
                authorization: request.authorization.map(str::to_owned),
                body: request.body.to_vec(),
            },
            deadline_ms: u32::try_from(timeout_ms).unwrap_or(u32::MAX).max(1),
            answer,
        };
        let shard = self.next.fetch_add(1, Ordering::Relaxed) % self.injectors.len().max(1);
        let Some(injector) = self.injectors.get(shard) else {
            return Err(ForwardError::Unreachable("this node runs no shard".into()));
        };
        if injector.send(Msg::ApiForward(Box::new(forward))).is_err() {
            return Err(ForwardError::Busy("this node's shard queue is full"));
        }
        // The link fails the request at its deadline; this bound only covers a
        // shard that stopped.
        let wait = timeout + Duration::from_secs(1);
        let (status, body) = match tokio::time::timeout(wait, answered).await {
            Ok(Ok(Ok(answer))) => answer,
            Ok(Ok(Err(why))) => return Err(no_answer(why, timeout_ms)),
            Ok(Err(_dropped)) => {
                return Err(ForwardError::Unreachable("the shard dropped it".into()))
            }
            Err(_elapsed) => return Err(ForwardError::Timeout(timeout_ms)),
        };
        if body.len() > self.answer_bytes_max {
            return Err(ForwardError::TooLarge(self.answer_bytes_max));
        }
        Ok(Answer {
            status,
            body: body.into_bytes(),
        })
    }
}

/// What a request the link gave no answer to is for the API.
fn no_answer(why: NoAnswer, timeout_ms: u64) -> ForwardError {
    match why {
        NoAnswer::LinkDown => ForwardError::Unreachable("no link to it".into()),
        NoAnswer::LinkBusy => ForwardError::Busy("the link to it is busy"),
        NoAnswer::Lost => ForwardError::Unreachable(format!(
            "no answer within {timeout_ms} ms, or the link closed (it may have been applied)"
        )),
    }
}

/// What a [`Breaker`] lets a forward do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// The breaker is closed.
    Go,
    /// The cool-down passed: this one forward tries the peer.
    Probe,
    /// Open: refused at once. `failures` in a row so far; the next try in
    /// `retry_in`.
    Refuse { failures: u32, retry_in: Duration },
}

/// One peer's circuit breaker (sans-IO: the caller gives the time).
#[derive(Debug, Default)]
pub struct Breaker {
    /// Forwards in a row that got no answer.
    failures: u32,
    /// Open until then (`None`: closed).
    open_until: Option<Instant>,
    /// A probe is in flight.
    probing: bool,
}

impl Breaker {
    /// Whether a forward may go to the peer now.
    pub fn admit(&mut self, now: Instant) -> Admit {
        match self.open_until {
            None => Admit::Go,
            Some(until) if now < until || self.probing => Admit::Refuse {
                failures: self.failures,
                retry_in: until.saturating_duration_since(now),
            },
            Some(_) => {
                self.probing = true;
                Admit::Probe
            }
        }
    }

    /// While open and cooling down (before a probe may go): the failures in a row
    /// and the time left. Changes nothing.
    pub fn cooling(&self, now: Instant) -> Option<(u32, Duration)> {
        self.open_until
            .filter(|&until| now < until)
            .map(|until| (self.failures, until - now))
    }

    /// The outcome of a forward [`Breaker::admit`] let go (`probe`: it was the
    /// probe): `answered` closes the breaker; a failure opens it at the
    /// `threshold`-th in a row, or again after a probe, for `cooldown`.
    pub fn record(
        &mut self,
        answered: bool,
        probe: bool,
        now: Instant,
        threshold: u32,
        cooldown: Duration,
    ) {
        if probe {
            self.probing = false;
        }
        if answered {
            *self = Breaker::default();
            return;
        }
        self.failures = self.failures.saturating_add(1);
        if probe || (self.open_until.is_none() && self.failures >= threshold) {
            self.open_until = Some(now + cooldown);
        }
    }

    /// A probe ended with no outcome (its request was dropped): the next forward
    /// may probe.
    pub fn abandon_probe(&mut self) {
        self.probing = false;
    }
}

/// The limits of [`Peers`] (from `ApiConfig`).
#[derive(Debug, Clone, Copy)]
pub struct PeerLimits {
    pub places: usize,
    pub place_wait: Duration,
    pub timeout: Duration,
    pub breaker_failures: u32,
    pub breaker_cooldown: Duration,
}

/// Why a forward to a peer got no answer.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("is not in [[cluster.nodes]]")]
    Unknown,
    #[error("is busy: {places} requests to it are in flight and no place freed within {wait_ms} ms; retry")]
    Busy { places: usize, wait_ms: u64 },
    #[error("is not asked: its last {failures} forwards in a row got no answer; next try in {retry_ms} ms")]
    Open { failures: u32, retry_ms: u64 },
    #[error("{0}")]
    Forward(#[from] ForwardError),
}

struct Peer {
    places: Arc<Semaphore>,
    breaker: Mutex<Breaker>,
}

/// The other nodes as the forwards see them: places, breaker.
pub struct Peers {
    client: ForwardClient,
    limits: PeerLimits,
    peers: HashMap<NodeId, Peer>,
}

/// Clears a probe that ends without an outcome (its future dropped).
struct ProbeGuard<'a> {
    breaker: Option<&'a Mutex<Breaker>>,
}

impl Drop for ProbeGuard<'_> {
    fn drop(&mut self) {
        if let Some(b) = self.breaker {
            b.lock().unwrap_or_else(|e| e.into_inner()).abandon_probe();
        }
    }
}

impl Peers {
    /// The peers `nodes`.
    pub fn new(
        client: ForwardClient,
        limits: PeerLimits,
        nodes: impl IntoIterator<Item = NodeId>,
    ) -> Peers {
        let peers = nodes
            .into_iter()
            .map(|id| {
                let peer = Peer {
                    places: Arc::new(Semaphore::new(limits.places)),
                    breaker: Mutex::new(Breaker::default()),
                };
                (id, peer)
            })
            .collect();
        Peers {
            client,
            limits,
            peers,
        }
    }

    /// Whether `node` is a peer.
    pub fn knows(&self, node: NodeId) -> bool {
        self.peers.contains_key(&node)
    }

    /// Passes `request` to `node` (module docs: places, breaker, timeout).
    pub async fn forward(&self, node: NodeId, request: &Outgoing<'_>) -> Result<Answer, PeerError> {
        let peer = self.peers.get(&node).ok_or(PeerError::Unknown)?;
        let limits = self.limits;
        let open = |b: &mut Breaker| match b.admit(Instant::now()) {
            Admit::Refuse { failures, retry_in } => Err(PeerError::Open {
                failures,
                retry_ms: retry_in.as_millis() as u64,
            }),
            admit => Ok(admit),
        };
        let lock = || peer.breaker.lock().unwrap_or_else(|e| e.into_inner());
        // Refused before waiting for a place while the breaker cools down.
        if let Some((failures, retry_in)) = lock().cooling(Instant::now()) {
            return Err(PeerError::Open {
                failures,
                retry_ms: retry_in.as_millis() as u64,
            });
        }
        let _place = tokio::time::timeout(limits.place_wait, peer.places.acquire())
            .await
            .map_err(|_| PeerError::Busy {
                places: limits.places,
                wait_ms: limits.place_wait.as_millis() as u64,
            })?
            .map_err(|_| PeerError::Unknown)?;
        let probe = open(&mut lock())? == Admit::Probe;
        let mut guard = ProbeGuard {
            breaker: probe.then_some(&peer.breaker),
        };
        let result = self.client.send(node, request, limits.timeout).await;
        guard.breaker = None;
        let answered = match &result {
            Ok(_) => true,
            Err(e) => !e.is_no_answer(),
        };
        lock().record(
            answered,
            probe,
            Instant::now(),
            limits.breaker_failures,
            limits.breaker_cooldown,
        );
        Ok(result?)
    }
}

/// Awaits every future of `futures` at once (on this task); their outputs in the
/// same order.
pub async fn join_all<F: Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, out) in futures.iter_mut().zip(outputs.iter_mut()) {
            if out.is_none() {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => *out = Some(v),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    outputs
        .into_iter()
        .map(|o| o.expect("every future finished"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_breaker_opens_at_the_threshold_cools_down_and_lets_one_probe() {
        let (t0, cool) = (Instant::now(), Duration::from_secs(5));
        let mut b = Breaker::default();
        for _ in 0..2 {
            assert_eq!(b.admit(t0), Admit::Go);
            b.record(false, false, t0, 3, cool);
        }
        // An answer (any status) resets the count.
        b.record(true, false, t0, 3, cool);
        for _ in 0..3 {
            assert_eq!(b.admit(t0), Admit::Go);
            b.record(false, false, t0, 3, cool);
        }
        let refused = Admit::Refuse {
            failures: 3,
            retry_in: cool,
        };
        assert_eq!(b.admit(t0), refused);
        assert_eq!(b.cooling(t0), Some((3, cool)));
        // A forward admitted before it opened fails: the cool-down is not pushed.
        b.record(false, false, t0 + cool / 2, 3, cool);
        let end = t0 + cool;
        assert_eq!(b.cooling(end), None);
        assert_eq!(b.admit(end), Admit::Probe);
        assert!(matches!(b.admit(end), Admit::Refuse { .. }), "one probe");
        // The probe fails: open again for a whole cool-down.
        b.record(false, true, end, 3, cool);
        assert_eq!(b.cooling(end), Some((5, cool)));
        let later = end + cool;
        assert_eq!(b.admit(later), Admit::Probe);
        // A probe dropped without an outcome lets the next forward probe.
        b.abandon_probe();
        assert_eq!(b.admit(later), Admit::Probe);
        b.record(true, true, later, 3, cool);
        assert_eq!(b.admit(later), Admit::Go);
        assert_eq!(b.cooling(later), None);
    }

    #[tokio::test]
    async fn join_all_gives_the_outputs_in_order() {
        let (tx, rx) = tokio::sync::oneshot::channel::<u32>();
        let first =
            Box::pin(async move { rx.await.unwrap() }) as Pin<Box<dyn Future<Output = u32> + Send>>;
        let second = Box::pin(async move {
            tx.send(7).unwrap();
            2u32
        }) as Pin<Box<dyn Future<Output = u32> + Send>>;
        assert_eq!(join_all(vec![first, second]).await, vec![7, 2]);
    }
}
