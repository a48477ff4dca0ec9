//! The simulated cluster: nodes of shards, each shard with the real owner
//! [`Registry`], the real [`Authority`] writer of its hash slots and the real
//! [`Activation`]s of its connecting clients; hops between shards of a node carried
//! by a ring (ordered, never lost while the node lives), hops between nodes by links
//! that delay, reorder, lose, get cut one way or both, and are found down after a
//! while; requests without an answer get the one answer `domain::hop::on_no_answer`
//! gives them. Nodes crash (a new boot id on restart, every session gone) and
//! pause; slots move (a new view spread over the links, and to every node whose
//! link comes up). Clients connect to any node, ping, close and reconnect. Every
//! decision is drawn from one `StdRng`; time is virtual.

use std::collections::BTreeMap;
use std::sync::Arc;

use domain::cluster::{ClusterView, NodeId, Target, Term};
use domain::hop::{on_no_answer, HopKind, NoAnswer, NoAnswerAction};
use domain::presence::activation::{
    Activation, ActivationConfig, ActivationId, AuthorityRequest, Event, Output, OwnerActionFailed,
};
use domain::presence::authority::{
    Authority, AuthorityConfig, AuthorityReply, Directory, HandoverBatch, HandoverOutcome,
    TouchAnswer,
};
use domain::presence::registry::{
    NewSession, RebuildLimits, Registry, RegistryConfig, SessionState, UnregisterRequest,
};
use domain::presence::route::{
    AuthorityError, BootId, DeviceLevel, OwnerAction, Route, RouteIdentity, SessionId, Transport,
};
use domain::send::commit::CommitRequest;
use domain::send::delivery::{session_id, session_shard, Lookup, LookupReply};
use proto::wkproto::ReasonCode;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use slots::{hash_slot, HashSlot, ShardId};

#[path = "send.rs"]
mod send;
pub use send::Phase;
use send::{Answer, Core, Messaging};

/// A request's deadline at its requester (`rpc_request_deadline_ms`).
pub const RPC_DEADLINE_MS: u64 = 300;
/// How long a cut link takes to be found down (the link's heartbeat).
const LINK_DETECT_MS: u64 = 500;
/// The touch worker's period (`touch_flush_interval_ms`).
pub const TOUCH_FLUSH_MS: u64 = 100;
/// `rebuild_routes_per_s`: small, so rebuilds take a while and race logins.
pub const REBUILD_ROUTES_PER_S: u32 = 20;
const TOUCH_BATCH_MAX: usize = 8;
/// Routes an expiry pass is due (`route_ttl_s`): long enough that a pinging client
/// never loses its route to expiry, short enough that dead boots' routes go.
const ROUTE_TTL_S: u64 = 30;
/// Clients ping at least this often while active (their keep-alive).
pub const PING_EVERY_MS: u64 = 2_000;
const RING_DELAY_MS: u64 = 2;
const LINK_DELAY_MS: std::ops::Range<u64> = 1..40;

/// Planted bugs: the simulation must catch each.
#[derive(Clone, Copy, Debug, Default)]
pub struct Bugs {
    /// The owner of an old session answers an owner action without closing it.
    pub owner_ignores_kick: bool,
    /// A touch answer's superseded routes are dropped (the zombie of
    /// "Cluster defects found in a review…", item 1).
    pub ignore_superseded: bool,
    /// A node does not send its view to a peer whose link comes up.
    pub no_view_on_link_up: bool,
    /// A request whose answer was lost is taken for one never sent (the ghost
    /// route of "Cluster defects found in a review…", item 8).
    pub lost_as_not_sent: bool,
    /// A node does not keep its view across a restart (a move it made and had not
    /// spread yet is lost with the crash, and its next moves reuse its terms).
    pub view_not_saved: bool,
    /// A move gives its slot the term above the old one whoever moves it (two
    /// moves made at once through two nodes tie, and the merge drops one).
    pub moves_share_terms: bool,
    /// The owner writes RECV to every pushed endpoint without
    /// `Registry::revalidate` (a closed or kicked session, an old boot's).
    pub skip_revalidation: bool,
    /// Every push to another node is carried twice.
    pub duplicate_pushes: bool,
    /// Pushes to another node vanish (uncounted, whatever the link).
    pub drop_remote_pushes: bool,
    /// A crash also loses the newest synced record of the node's logs.
    pub crash_drops_synced: bool,
    /// The outputs of each pump of a commit shard's planner are carried in the
    /// reverse order.
    pub reversed_plan_outputs: bool,
    /// A moved slot's old authority hands nothing over and its new one serves
    /// lookups at once (`handover_wait_s = 0`): what the node did before issue
    /// "Cluster defects found in a review…", item 7.
    pub no_handover: bool,
}

/// The shape of one seed's cluster.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub nodes: usize,
    pub shards: usize,
    pub clients: usize,
}

impl Shape {
    pub fn draw(rng: &mut StdRng) -> Shape {
        Shape {
            nodes: rng.gen_range(3..=5),
            shards: rng.gen_range(1..=3),
            clients: rng.gen_range(4..=14),
        }
    }
}

type Addr = (NodeId, ShardId);

/// What a request left behind at its requester, until its answer or deadline.
#[derive(Debug)]
enum Pending {
    Activation {
        act: u64,
        request_kind: Call,
    },
    Unregister(Box<UnregisterRequest>),
    Touch {
        target: Target,
        routes: Vec<Route>,
    },
    Owner {
        act: u64,
        index: u32,
    },
    /// A client's SEND, forwarded to its channel's commit shard.
    Send {
        send: usize,
    },
    /// A delivery page's lookup at another node's authority.
    Lookup {
        lookup_id: u64,
    },
    /// A batch of a moved slot's routes to its new authority.
    Handover,
}

#[derive(Clone, Copy, Debug)]
enum Call {
    Register,
    Commit,
    Abort,
}

#[derive(Debug)]
enum Request {
    Authority {
        target: Target,
        request: AuthorityRequest,
    },
    Touch {
        target: Target,
        routes: Vec<Route>,
    },
    Owner(OwnerAction),
    Send(Box<CommitRequest<()>>),
    Lookup(Lookup),
    Handover(HandoverBatch),
}

#[derive(Debug)]
enum Reply {
    Authority(AuthorityReply),
    Touch(TouchAnswer),
    Owner(Result<(), OwnerActionFailed>),
    /// The SENDACK's fields.
    Send {
        message_id: i64,
        message_seq: u64,
        reason: ReasonCode,
    },
    Lookup(LookupReply),
    Handover(Result<HandoverOutcome, AuthorityError>),
}

#[derive(Debug)]
enum Body {
    Request {
        from: Addr,
        from_boot: BootId,
        id: u64,
        to_shard: ShardId,
        request: Request,
    },
    Reply {
        to_shard: ShardId,
        id: u64,
        reply: Reply,
    },
    View(Box<ClusterView>),
    /// A push batch to the owner shards of its endpoints (one-way).
    Push {
        message: send::Message,
        endpoints: Vec<domain::presence::route::Endpoint>,
    },
    /// A commit shard's sync job done (its syncer, on the same node).
    SyncDone {
        shard: ShardId,
    },
}

#[derive(Debug)]
struct Flight {
    from: NodeId,
    to: NodeId,
    /// The receiver's boot when sent: a restarted receiver never sees it.
    to_boot: BootId,
    body: Body,
}

struct Running {
    activation: Activation,
    client: usize,
}

struct Shard {
    reg: Registry,
    auth: Authority,
    view: ClusterView,
    acts: BTreeMap<u64, Running>,
    /// Open connections: session id → client.
    conns: BTreeMap<SessionId, usize>,
    /// This shard's requests awaiting an answer: id → (deadline, pending).
    pending: BTreeMap<u64, (u64, Pending)>,
    next_flush_ms: u64,
    /// The commit core of the channels placed on this shard, over its log.
    commit: Core,
}

struct Node {
    id: NodeId,
    boot: BootId,
    up: bool,
    paused_until_ms: u64,
    view: ClusterView,
    shards: Vec<Shard>,
}

/// Where a client is connected, and how far.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conn {
    pub node: NodeId,
    pub boot: BootId,
    pub shard: ShardId,
    pub session_id: SessionId,
    pub active: bool,
    pub last_ping_ms: u64,
    /// When its CONNACK 0 was written.
    pub active_since_ms: u64,
}

pub struct Client {
    pub uid: String,
    pub device_id: Arc<str>,
    pub flag: u8,
    pub level: DeviceLevel,
    pub conn: Option<Conn>,
    /// DISCONNECTs received (kicks).
    pub kicked: u32,
}

/// A directed link's state: up, cut (frames vanish; the sender does not know yet),
/// or found down (requests fail at once) since a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Link {
    Up,
    Cut { since_ms: u64 },
}

pub struct World {
    pub seed: u64,
    pub bugs: Bugs,
    pub shape: Shape,
    slot_ids: u32,
    rng: StdRng,
    pub now_ms: u64,
    nodes: Vec<Node>,
    pub clients: Vec<Client>,
    links: BTreeMap<(NodeId, NodeId), Link>,
    flights: BTreeMap<(u64, u64), Flight>,
    next_flight: u64,
    next_request: u64,
    next_session: u64,
    next_boot: BootId,
    /// `CLUSTER_SIM_TRACE=uid`: what happens to that uid is printed.
    trace_uid: Option<String>,
    /// The quiet phase: no faults, the cluster settled.
    quiet: bool,
    /// The phase SENDs are made in.
    phase: Phase,
    /// Invariants broken inside a turn, reported by `check_always`.
    violations: Vec<String>,
    /// Answers made during a caller's turn, handled after it.
    later: Vec<(Addr, Pending, NoAnswerAction)>,
    /// Every slot move made (an operator's call answered 200): the hash slot, the
    /// leader and the term the moving node's view gave it.
    moves_made: Vec<(HashSlot, NodeId, Term)>,
    /// Each node's view as saved on its disk (every installed view, before a move
    /// is answered): what survives its crashes.
    saved_views: BTreeMap<NodeId, ClusterView>,
    /// The SEND path's state: groups, logs, SENDs and RECVs.
    msg: Messaging,
    pub stats: Stats,
}

#[derive(Debug, Default)]
pub struct Stats {
    pub connects: u64,
    pub connacks_ok: u64,
    pub kicks: u64,
    pub moves: u64,
    pub crashes: u64,
    pub partitions: u64,
    pub lost: u64,
    pub owner_down_done: u64,
    pub superseded: u64,
    pub sends: u64,
    pub sendacks_ok: u64,
    pub recvs: u64,
    pub remote_pushes: u64,
    pub lookups: u64,
    pub stale_pushes: u64,
    /// Endpoints of pushes checked by "push order" (`send.rs`).
    pub ordered_pushes: u64,
    /// Handover batches applied at a new authority (or kept for its view).
    pub handovers: u64,
}

fn registry_config(shard: ShardId, node: NodeId, boot: BootId) -> RegistryConfig {
    let mut cfg = RegistryConfig::new(shard, node, boot);
    cfg.sessions_max = 64;
    cfg.unregister_retry_base_ms = 50;
    cfg.unregister_retry_ms_max = 1_000;
    cfg.unregister_attempts_max = 1_000;
    cfg
}

fn authority_config(bugs: Bugs) -> AuthorityConfig {
    AuthorityConfig {
        route_ttl_s: ROUTE_TTL_S,
        handover_wait_s: if bugs.no_handover { 0 } else { 2 },
        ..AuthorityConfig::default()
    }
}

impl World {
    pub fn new(seed: u64, bugs: Bugs) -> World {
        let mut rng = StdRng::seed_from_u64(seed);
        let shape = Shape::draw(&mut rng);
        let ids: Vec<NodeId> = (1..=shape.nodes as NodeId).collect();
        let slot_ids = [4u32, 16, 256][rng.gen_range(0..3)];
        let view = ClusterView::initial(&ids, slot_ids).expect("valid view");
        let mut w = World {
            seed,
            bugs,
            shape,
            slot_ids,
            rng,
            now_ms: 1_000_000,
            nodes: Vec::new(),
            clients: Vec::new(),
            links: BTreeMap::new(),
            flights: BTreeMap::new(),
            next_flight: 0,
            next_request: 1,
            next_session: 1,
            next_boot: 100,
            later: Vec::new(),
            moves_made: Vec::new(),
            saved_views: BTreeMap::new(),
            msg: Messaging::default(),
            quiet: false,
            phase: Phase::Chaos,
            trace_uid: std::env::var("CLUSTER_SIM_TRACE").ok(),
            violations: Vec::new(),
            stats: Stats::default(),
        };
        for &id in &ids {
            let boot = w.fresh_boot();
            let node = w.boot_node(id, boot, &view);
            w.nodes.push(node);
        }
        for &a in &ids {
            for &b in &ids {
                if a != b {
                    w.links.insert((a, b), Link::Up);
                }
            }
        }
        let uids = (shape.clients / 2).max(2);
        for i in 0..shape.clients {
            let uid = format!("u{}", w.rng.gen_range(0..uids));
            let device_id: Arc<str> = Arc::from(format!("d{}", i % 3).as_str());
            let flag = w.rng.gen_range(0..2u8);
            let level = if w.rng.gen_bool(0.7) {
                DeviceLevel::Master
            } else {
                DeviceLevel::Slave
            };
            w.clients.push(Client {
                uid,
                device_id,
                flag,
                level,
                conn: None,
                kicked: 0,
            });
        }
        w.msg.groups = send::draw_groups(&mut w.rng, uids);
        w.msg.uids = uids;
        w
    }

    fn fresh_boot(&mut self) -> BootId {
        self.next_boot += 1;
        self.next_boot
    }

    fn boot_node(&mut self, id: NodeId, boot: BootId, view: &ClusterView) -> Node {
        let dir = Directory::new(&authority_config(self.bugs)).expect("valid config");
        let shards = self.shape.shards;
        let now_s = self.now_ms / 1000;
        let mut cores: Vec<Core> = (0..shards)
            .map(|s| self.new_commit_core(id, s as ShardId))
            .collect();
        let shards = (0..shards)
            .map(|s| {
                let mine: Vec<HashSlot> = (0..256u16)
                    .filter(|h| *h as usize % shards == s)
                    .map(|h| h as HashSlot)
                    .collect();
                let mut auth =
                    Authority::new(authority_config(self.bugs), &dir, &mine).expect("claim");
                auth.apply_view(view, id, now_s);
                Shard {
                    reg: Registry::new(registry_config(s as ShardId, id, boot)).expect("config"),
                    auth,
                    view: view.clone(),
                    acts: BTreeMap::new(),
                    conns: BTreeMap::new(),
                    pending: BTreeMap::new(),
                    next_flush_ms: self.now_ms + TOUCH_FLUSH_MS,
                    commit: cores.remove(0),
                }
            })
            .collect();
        Node {
            id,
            boot,
            up: true,
            paused_until_ms: 0,
            view: view.clone(),
            shards,
        }
    }

    fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize - 1]
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.nodes[id as usize - 1]
    }

    fn shard_mut(&mut self, (n, s): Addr) -> &mut Shard {
        &mut self.nodes[n as usize - 1].shards[s as usize]
    }

    fn slot_shard(&self, h: HashSlot) -> ShardId {
        (h as usize % self.shape.shards) as ShardId
    }

    fn usable(&self, id: NodeId) -> bool {
        let n = self.node(id);
        n.up && n.paused_until_ms <= self.now_ms
    }

    // ------------------------------------------------------------------ carriage

    fn schedule(&mut self, delay_ms: u64, flight: Flight) {
        self.next_flight += 1;
        self.flights
            .insert((self.now_ms + delay_ms, self.next_flight), flight);
    }

    /// Whether `from` has found its link to `to` down (a request fails at once).
    fn link_down(&self, from: NodeId, to: NodeId) -> bool {
        match self.links[&(from, to)] {
            Link::Up => false,
            Link::Cut { since_ms } => self.now_ms >= since_ms + LINK_DETECT_MS,
        }
    }

    /// Sends a request from `from`; its answer comes back as a reply or, at the
    /// deadline, as `on_no_answer(kind, Lost)`; a link found down answers at once.
    fn request(&mut self, from: Addr, to: Addr, request: Request, pending: Pending) {
        let kind = hop_kind(&pending);
        if from.0 != to.0 && self.link_down(from.0, to.0) {
            // Answered after the caller's turn, as the node queues its local events.
            let action = on_no_answer(kind, NoAnswer::LinkDown);
            return self.later.push((from, pending, action));
        }
        let id = self.next_request;
        self.next_request += 1;
        let deadline = self.now_ms + RPC_DEADLINE_MS;
        self.shard_mut(from).pending.insert(id, (deadline, pending));
        let from_boot = self.node(from.0).boot;
        let delay = self.delay(from.0, to.0);
        let body = Body::Request {
            from,
            from_boot,
            id,
            to_shard: to.1,
            request,
        };
        self.carry(from.0, to.0, delay, body);
    }

    /// Schedules `body` from node `from` to node `to`'s current process, due in
    /// `delay_ms` (a restart of `to` before then loses it).
    fn carry(&mut self, from: NodeId, to: NodeId, delay_ms: u64, body: Body) {
        let to_boot = self.node(to).boot;
        let flight = Flight {
            from,
            to,
            to_boot,
            body,
        };
        self.schedule(delay_ms, flight);
    }

    fn delay(&mut self, from: NodeId, to: NodeId) -> u64 {
        if from == to {
            RING_DELAY_MS
        } else {
            self.rng.gen_range(LINK_DELAY_MS)
        }
    }

    fn reply(&mut self, server: NodeId, to: Addr, to_boot: BootId, id: u64, reply: Reply) {
        let delay = self.delay(server, to.0);
        let body = Body::Reply {
            to_shard: to.1,
            id,
            reply,
        };
        self.schedule(
            delay,
            Flight {
                from: server,
                to: to.0,
                to_boot,
                body,
            },
        );
    }

    fn send_view(&mut self, from: NodeId, to: NodeId) {
        let view = self.node(from).view.clone();
        let copies = if self.rng.gen_bool(0.1) { 2 } else { 1 };
        for _ in 0..copies {
            let delay = self.delay(from, to);
            self.carry(from, to, delay, Body::View(Box::new(view.clone())));
        }
    }

    /// Delivers the next flight due by `now_ms`, if any. A flight across a cut link,
    /// or to a node that crashed since, is lost; one to a paused node waits.
    fn deliver_due(&mut self) -> bool {
        let Some((&key, _)) = self.flights.range(..(self.now_ms + 1, 0)).next() else {
            return false;
        };
        let flight = self.flights.remove(&key).expect("present");
        let to = self.node(flight.to);
        if !to.up || to.boot != flight.to_boot {
            self.stats.lost += 1;
            return true;
        }
        if flight.from != flight.to && self.links[&(flight.from, flight.to)] != Link::Up {
            self.stats.lost += 1;
            return true;
        }
        if to.paused_until_ms > self.now_ms {
            let wait = to.paused_until_ms - self.now_ms;
            self.schedule(wait, flight);
            return true;
        }
        match flight.body {
            Body::Request {
                from,
                from_boot,
                id,
                to_shard,
                request,
            } => {
                let at = (flight.to, to_shard);
                if let Request::Send(request) = request {
                    let answer = Answer {
                        to: from,
                        to_boot: from_boot,
                        id,
                    };
                    self.commit_at(at, *request, answer);
                    return true;
                }
                let reply = self.serve(at, request);
                if let Some(reply) = reply {
                    self.reply(flight.to, from, from_boot, id, reply);
                }
            }
            Body::Reply {
                to_shard,
                id,
                reply,
            } => {
                let at = (flight.to, to_shard);
                if let Some((_, pending)) = self.shard_mut(at).pending.remove(&id) {
                    self.on_reply(at, pending, reply);
                }
            }
            Body::View(view) => self.install_view(flight.to, &view),
            Body::Push { message, endpoints } => {
                self.owner_push(flight.to, &message.0, &endpoints);
            }
            Body::SyncDone { shard } => self.sync_done((flight.to, shard)),
        }
        true
    }

    // ------------------------------------------------------------------ serving

    fn serve(&mut self, at: Addr, request: Request) -> Option<Reply> {
        let now_s = self.now_ms / 1000;
        match request {
            Request::Authority { target, request } => {
                let shard = self.shard_mut(at);
                Some(Reply::Authority(shard.auth.serve(&target, request, now_s)))
            }
            Request::Touch { target, routes } => {
                for r in &routes {
                    self.trace(&r.uid, || format!("touch at {at:?} of {r:?}"));
                }
                let shard = self.shard_mut(at);
                let answer = shard.auth.serve_touch(&target, routes, now_s);
                for r in answer.superseded.iter().chain(&answer.requeue) {
                    self.trace(&r.uid, || format!("touch answer {answer:?}"));
                }
                Some(Reply::Touch(answer))
            }
            Request::Owner(action) => {
                let node = self.node(at.0);
                if action.route.boot_id == node.boot && !self.bugs.owner_ignores_kick {
                    let owner = (at.0, session_shard(action.route.session_id));
                    self.perform_owner_action(owner, &action);
                }
                Some(Reply::Owner(Ok(())))
            }
            Request::Lookup(lookup) => Some(Reply::Lookup(self.serve_lookup(at, &lookup))),
            Request::Handover(batch) => {
                for r in &batch.routes {
                    self.trace(&r.uid, || {
                        format!("handover arrives at {at:?} for {:?}: {r:?}", batch.target)
                    });
                }
                let shard = self.shard_mut(at);
                Some(Reply::Handover(shard.auth.take_handover(batch, now_s)))
            }
            Request::Send(_) => unreachable!("a SEND is committed, not served"),
        }
    }

    /// Kicks or closes the old session (if still there): its activation learns
    /// it closed; an active one is deactivated and its client told.
    fn perform_owner_action(&mut self, at: Addr, action: &OwnerAction) {
        self.trace(&action.route.uid, || {
            format!("owner action at {at:?}: {action:?}")
        });
        let sid = action.route.session_id;
        let now_ms = self.now_ms;
        let shard = self.shard_mut(at);
        let Some(client) = shard.conns.remove(&sid) else {
            return;
        };
        self.stats.kicks += 1;
        let c = &mut self.clients[client];
        c.kicked += 1;
        c.conn = None;
        let shard = self.shard_mut(at);
        if shard.acts.contains_key(&sid) {
            self.feed(at, sid, Event::SessionClosed);
        } else if let Some(h) = shard.reg.handle_of(sid) {
            shard.reg.deactivate(h, now_ms);
        }
    }

    fn on_reply(&mut self, at: Addr, pending: Pending, reply: Reply) {
        let now_ms = self.now_ms;
        match (pending, reply) {
            (Pending::Activation { act, .. }, Reply::Authority(reply)) => {
                let event = match reply {
                    AuthorityReply::Register(r) => Event::RegisterReply(r),
                    AuthorityReply::Commit(r) => Event::CommitReply(r),
                    AuthorityReply::Abort(r) => Event::AbortReply(r),
                    AuthorityReply::Unregister(_) => return,
                };
                self.feed(at, act, event);
            }
            (Pending::Unregister(req), Reply::Authority(reply)) => {
                self.trace(&req.identity.uid, || {
                    format!("unregister at {:?} of {req:?}: {reply:?}", req.target)
                });
                if let AuthorityReply::Unregister(Err(_)) = reply {
                    self.shard_mut(at).reg.unregister_failed(*req, now_ms);
                }
            }
            (Pending::Touch { target, .. }, Reply::Touch(answer)) => {
                self.on_touch_answer(at, target, answer);
            }
            (Pending::Owner { act, index }, Reply::Owner(result)) => {
                self.feed(at, act, Event::OwnerActionDone { index, result });
            }
            (
                Pending::Send { send },
                Reply::Send {
                    message_id,
                    message_seq,
                    reason,
                },
            ) => self.on_sendack(send, reason, message_id, message_seq),
            (Pending::Lookup { lookup_id }, Reply::Lookup(reply)) => {
                self.shard_mut(at).commit.on_lookup_reply(lookup_id, reply);
            }
            (Pending::Handover, Reply::Handover(outcome)) => {
                self.stats.handovers += u64::from(outcome.is_ok());
            }
            (p, r) => panic!("seed {}: reply {r:?} to {p:?}", self.seed),
        }
    }

    /// The node's `on_reply` for a touch: requeue what failed; tell and close the
    /// sessions their authority superseded.
    fn on_touch_answer(&mut self, at: Addr, target: Target, answer: TouchAnswer) {
        let now_ms = self.now_ms;
        let shard = self.shard_mut(at);
        shard.reg.touch_failed(target, &answer.requeue);
        if self.bugs.ignore_superseded {
            return;
        }
        let handles = self.shard_mut(at).reg.superseded(&answer.superseded);
        for h in handles {
            let shard = self.shard_mut(at);
            let info = shard.reg.deactivate(h, now_ms).expect("a current session");
            let client = shard.conns.remove(&info.session_id).expect("connected");
            self.stats.superseded += 1;
            let c = &mut self.clients[client];
            c.kicked += 1;
            c.conn = None;
        }
    }

    fn no_answer(&mut self, at: Addr, pending: Pending, action: NoAnswerAction) {
        let now_ms = self.now_ms;
        match (pending, action) {
            (
                Pending::Activation {
                    act, request_kind, ..
                },
                NoAnswerAction::AuthorityFailed(err),
            ) => {
                let event = match request_kind {
                    Call::Register => Event::RegisterReply(Err(err)),
                    Call::Commit => Event::CommitReply(Err(err)),
                    Call::Abort => Event::AbortReply(Err(err)),
                };
                self.feed(at, act, event);
            }
            (Pending::Unregister(req), NoAnswerAction::AuthorityFailed(_)) => {
                self.shard_mut(at).reg.unregister_failed(*req, now_ms);
            }
            (Pending::Touch { target, routes }, NoAnswerAction::RequeueTouch) => {
                self.shard_mut(at).reg.touch_failed(target, &routes);
            }
            (Pending::Owner { act, index }, NoAnswerAction::OwnerActionDoneOwnerDown) => {
                self.stats.owner_down_done += 1;
                let event = Event::OwnerActionDone {
                    index,
                    result: Ok(()),
                };
                self.feed(at, act, event);
            }
            (Pending::Owner { act, index }, NoAnswerAction::OwnerActionFailed) => {
                let event = Event::OwnerActionDone {
                    index,
                    result: Err(OwnerActionFailed),
                };
                self.feed(at, act, event);
            }
            (Pending::Send { send }, NoAnswerAction::SendAck(reason)) => {
                self.on_sendack(send, reason, 0, 0);
            }
            (Pending::Lookup { lookup_id }, NoAnswerAction::LookupFailed(f)) => {
                let reply = LookupReply::Failed(f);
                self.shard_mut(at).commit.on_lookup_reply(lookup_id, reply);
            }
            (Pending::Handover, NoAnswerAction::HandoverLost) => {}
            (p, a) => panic!("seed {}: no-answer {a:?} for {p:?}", self.seed),
        }
    }

    // ------------------------------------------------------------------ gateway

    fn feed(&mut self, at: Addr, act: u64, event: Event) {
        if let Some(client) = self.shard_mut(at).acts.get(&act).map(|r| r.client) {
            let uid = self.clients[client].uid.clone();
            self.trace(&uid, || format!("act {act} at {at:?} <- {event:?}"));
        }
        let now_ms = self.now_ms;
        let shard = self.shard_mut(at);
        let Some(running) = shard.acts.get_mut(&act) else {
            return;
        };
        let mut out = Vec::new();
        running
            .activation
            .handle_event(&mut shard.reg, event, now_ms, &mut out);
        self.apply(at, act, out);
    }

    fn apply(&mut self, at: Addr, act: u64, out: Vec<Output>) {
        let client = self.shard_mut(at).acts[&act].client;
        let uid = self.clients[client].uid.clone();
        for o in &out {
            self.trace(&uid, || {
                format!("client {client} act {act} at {at:?}: {o:?}")
            });
        }
        for o in out {
            match o {
                Output::SendToAuthority { target, request } => {
                    let (kind, pending) = match &request {
                        AuthorityRequest::Register { .. } => (Call::Register, true),
                        AuthorityRequest::Commit { .. } => (Call::Commit, true),
                        AuthorityRequest::Abort { .. } => (Call::Abort, true),
                        AuthorityRequest::Unregister { .. } => (Call::Abort, false),
                    };
                    assert!(pending, "seed {}: activations never unregister", self.seed);
                    let to = (target.leader_node_id, self.slot_shard(target.hash_slot));
                    let p = Pending::Activation {
                        act,
                        request_kind: kind,
                    };
                    self.request(at, to, Request::Authority { target, request }, p);
                }
                Output::PerformOwnerAction { index, action } => {
                    self.owner_action(at, act, index, action);
                }
                Output::SendConnack { reason } => {
                    let now_ms = self.now_ms;
                    let conn = self.clients[client].conn.as_mut();
                    let c = conn.filter(|c| c.session_id == act && (c.node, c.shard) == at);
                    if let (Some(c), true) = (c, reason == ReasonCode::SUCCESS) {
                        self.stats.connacks_ok += 1;
                        c.active = true;
                        c.last_ping_ms = now_ms;
                        c.active_since_ms = now_ms;
                        if self.quiet {
                            self.check_login(client);
                        }
                    }
                }
                Output::CloseConnection => {
                    let conn = &mut self.clients[client].conn;
                    if conn.is_some_and(|c| c.session_id == act && (c.node, c.shard) == at) {
                        *conn = None;
                    }
                    self.shard_mut(at).conns.remove(&act);
                }
            }
        }
        let shard = self.shard_mut(at);
        if shard
            .acts
            .get(&act)
            .is_some_and(|r| r.activation.is_finished())
        {
            shard.acts.remove(&act);
        }
    }

    /// `request_owner_action` of the node: another node's session by request; an
    /// earlier process of this node needs nothing; this node's, on its shard.
    fn owner_action(&mut self, at: Addr, act: u64, index: u32, action: OwnerAction) {
        let node = action.route.node_id;
        let pending = Pending::Owner { act, index };
        if node != at.0 {
            let to = (node, session_shard(action.route.session_id));
            return self.request(at, to, Request::Owner(action), pending);
        }
        if action.route.boot_id != self.node(at.0).boot {
            let done = NoAnswerAction::OwnerActionDoneOwnerDown;
            return self.later.push((at, pending, done));
        }
        let to = (node, session_shard(action.route.session_id));
        self.request(at, to, Request::Owner(action), pending);
    }

    // ------------------------------------------------------------------ clients

    fn connect(&mut self, client: usize) {
        let ids: Vec<NodeId> = self
            .nodes
            .iter()
            .filter(|n| n.up && n.paused_until_ms <= self.now_ms)
            .map(|n| n.id)
            .collect();
        if ids.is_empty() {
            return;
        }
        let node = ids[self.rng.gen_range(0..ids.len())];
        let shard = self.rng.gen_range(0..self.shape.shards) as ShardId;
        let sid = session_id(shard, self.next_session);
        self.next_session += 1;
        let c = &self.clients[client];
        let new = NewSession {
            uid: c.uid.as_str().into(),
            device_id: c.device_id.clone(),
            device_flag: c.flag,
            device_level: c.level,
            session_id: sid,
            listener: Transport::Tcp,
            connected_at_ms: self.now_ms,
        };
        let boot = self.node(node).boot;
        self.clients[client].conn = Some(Conn {
            node,
            boot,
            shard,
            session_id: sid,
            active: false,
            last_ping_ms: self.now_ms,
            active_since_ms: 0,
        });
        self.stats.connects += 1;
        let at = (node, shard);
        let uid = self.clients[client].uid.clone();
        self.trace(&uid, || {
            format!("client {client} connects at {at:?} session {sid}")
        });
        let now_ms = self.now_ms;
        let act = sid;
        let sh = self.shard_mut(at);
        sh.conns.insert(sid, client);
        let mut out = Vec::new();
        let activation = Activation::start(
            ActivationId(act),
            &ActivationConfig::default(),
            &mut sh.reg,
            &sh.view,
            new,
            now_ms,
            &mut out,
        );
        sh.acts.insert(act, Running { activation, client });
        self.apply(at, act, out);
    }

    /// The client closes its connection (the gateway's close path).
    fn close(&mut self, client: usize) {
        let Some(c) = self.clients[client].conn.take() else {
            return;
        };
        let uid = self.clients[client].uid.clone();
        self.trace(&uid, || format!("client {client} closes {c:?}"));
        let at = (c.node, c.shard);
        if !self.usable(c.node) {
            // A paused gateway reads the close later: the client waits.
            self.clients[client].conn = Some(c);
            return;
        }
        let now_ms = self.now_ms;
        let shard = self.shard_mut(at);
        shard.conns.remove(&c.session_id);
        if shard.acts.contains_key(&c.session_id) {
            self.feed(at, c.session_id, Event::SessionClosed);
        } else if let Some(h) = shard.reg.handle_of(c.session_id) {
            shard.reg.deactivate(h, now_ms);
        }
    }

    /// Any client frame is activity for the route.
    fn ping(&mut self, client: usize) {
        let Some(c) = self.clients[client].conn else {
            return;
        };
        if !c.active || !self.usable(c.node) {
            return;
        }
        let now_ms = self.now_ms;
        let shard = self.shard_mut((c.node, c.shard));
        if let Some(h) = shard.reg.handle_of(c.session_id) {
            shard.reg.mark_touched(h, now_ms / 1000);
        }
        self.clients[client]
            .conn
            .as_mut()
            .expect("conn")
            .last_ping_ms = now_ms;
    }

    // ------------------------------------------------------------------ timers

    /// Fires what is due on every running shard: activation deadlines, request
    /// deadlines, the touch worker, the expiry pass.
    fn fire_timers(&mut self) {
        for n in 0..self.nodes.len() {
            let id = self.nodes[n].id;
            if !self.usable(id) {
                continue;
            }
            for s in 0..self.shape.shards {
                self.fire_shard((id, s as ShardId));
            }
        }
    }

    fn fire_shard(&mut self, at: Addr) {
        let now_ms = self.now_ms;
        let acts: Vec<u64> = self.shard_mut(at).acts.keys().copied().collect();
        for act in acts {
            let due = self
                .shard_mut(at)
                .acts
                .get(&act)
                .map(|r| r.activation.deadline_ms());
            if due.is_some_and(|d| d <= now_ms) {
                self.feed(at, act, Event::Tick);
            }
        }
        let expired: Vec<u64> = (self.shard_mut(at).pending.iter())
            .filter(|(_, (deadline, _))| *deadline <= now_ms)
            .map(|(&id, _)| id)
            .collect();
        for id in expired {
            let (_, pending) = self.shard_mut(at).pending.remove(&id).expect("present");
            let why = if self.bugs.lost_as_not_sent {
                NoAnswer::LinkDown
            } else {
                NoAnswer::Lost
            };
            let action = on_no_answer(hop_kind(&pending), why);
            self.no_answer(at, pending, action);
        }
        if self.shard_mut(at).next_flush_ms <= now_ms {
            self.shard_mut(at).next_flush_ms = now_ms + TOUCH_FLUSH_MS;
            self.flush_touches(at);
            let shard = self.shard_mut(at);
            shard.auth.expire(now_ms / 1000);
            // Relays whose wait ran out are handed over by the expiry pass.
            self.hand_over(at);
        }
    }

    /// The touch worker: rebuild, dirty routes, queued unregisters.
    fn flush_touches(&mut self, at: Addr) {
        let now_ms = self.now_ms;
        let limits = RebuildLimits {
            routes_per_s: REBUILD_ROUTES_PER_S,
            burst_routes: (REBUILD_ROUTES_PER_S as u64 * TOUCH_FLUSH_MS / 1000).max(1) as u32,
            batch_routes_max: TOUCH_BATCH_MAX,
        };
        let shard = self.shard_mut(at);
        let view = shard.view.clone();
        let mut batches = shard.reg.drain_rebuild(&view, now_ms, &limits);
        batches.extend(shard.reg.drain_touches(&view, TOUCH_BATCH_MAX));
        let unregisters = shard.reg.drain_unregisters(&view, now_ms, 16);
        for (target, routes) in batches {
            let to = (target.leader_node_id, self.slot_shard(target.hash_slot));
            let pending = Pending::Touch {
                target,
                routes: routes.clone(),
            };
            self.request(at, to, Request::Touch { target, routes }, pending);
        }
        for req in unregisters {
            let target = req.target;
            let to = (target.leader_node_id, self.slot_shard(target.hash_slot));
            let request = req.request();
            let pending = Pending::Unregister(Box::new(req));
            self.request(at, to, Request::Authority { target, request }, pending);
        }
    }

    // ------------------------------------------------------------------ views

    /// A view reaches a node: joined with its own; every shard applies the join
    /// (authority identities, the rebuild of moved routes); spread to the peers.
    fn install_view(&mut self, node: NodeId, view: &ClusterView) {
        let Some(joined) = self.node(node).view.merge(view) else {
            return;
        };
        self.node_mut(node).view = joined.clone();
        if !self.bugs.view_not_saved {
            self.saved_views.insert(node, joined.clone());
        }
        let now_ms = self.now_ms;
        for s in 0..self.shape.shards {
            if let Some(u) = self.trace_uid.clone() {
                let h = hash_slot(u.as_bytes());
                if h as usize % self.shape.shards == s {
                    let t = joined.target_for_slot(h);
                    let before = self.shard_mut((node, s as ShardId)).auth.identity(h);
                    self.trace(&u, || format!("node {node} applies {t:?} (had {before:?})"));
                }
            }
            let shard = self.shard_mut((node, s as ShardId));
            shard.auth.apply_view(&joined, node, now_ms / 1000);
            let old = std::mem::replace(&mut shard.view, joined.clone());
            shard.reg.queue_rebuild(&old, &joined, now_ms);
            self.hand_over((node, s as ShardId));
            // As the node: a slot taken from a node it cannot reach waits for no
            // handover.
            let down: Vec<NodeId> = (self.nodes.iter().map(|n| n.id))
                .filter(|&p| p != node && self.link_down(node, p))
                .collect();
            for p in down {
                self.shard_mut((node, s as ShardId)).auth.end_waits_from(p);
            }
        }
        let peers: Vec<NodeId> = self
            .nodes
            .iter()
            .map(|n| n.id)
            .filter(|&p| p != node)
            .collect();
        for p in peers {
            self.send_view(node, p);
        }
    }

    /// The handovers of the slots shard `at` lost, in batches to each new leader.
    fn hand_over(&mut self, at: Addr) {
        let mut handovers = Vec::new();
        self.shard_mut(at).auth.take_handovers(&mut handovers);
        if self.bugs.no_handover {
            return;
        }
        for h in handovers {
            let to = (h.target.leader_node_id, self.slot_shard(h.target.hash_slot));
            for r in &h.routes {
                self.trace(&r.uid, || {
                    format!("handover from {at:?} to {:?}: {r:?}", h.target)
                });
            }
            for batch in h.into_batches(TOUCH_BATCH_MAX) {
                self.request(at, to, Request::Handover(batch), Pending::Handover);
            }
        }
    }

    /// An operator moves a few hash slots (or a node's drain) at a running node.
    fn move_slots(&mut self) {
        let ids: Vec<NodeId> = self.nodes.iter().filter(|n| n.up).map(|n| n.id).collect();
        let at = ids[self.rng.gen_range(0..ids.len())];
        if !self.usable(at) {
            return;
        }
        let view = self.node(at).view.clone();
        let moves: Vec<(HashSlot, NodeId)> = if self.rng.gen_bool(0.2) {
            let to: Vec<NodeId> = ids.iter().copied().filter(|&n| n != at).collect();
            view.drain_moves(at, &to)
        } else {
            let uid = &self.clients[self.rng.gen_range(0..self.clients.len())].uid;
            let h = hash_slot(uid.as_bytes());
            let to = ids[self.rng.gen_range(0..ids.len())];
            vec![(h, to)]
        };
        if moves.is_empty() {
            return;
        }
        self.stats.moves += 1;
        let mut next = view.with_leaders(at, &moves);
        if self.bugs.moves_share_terms {
            for &(h, _) in &moves {
                next.slots[h as usize].leader_term = view.slots[h as usize].leader_term + 1;
            }
        }
        for &(h, _) in &moves {
            let s = next.slots[h as usize];
            self.moves_made.push((h, s.leader_node_id, s.leader_term));
        }
        self.install_view(at, &next);
    }

    // ------------------------------------------------------------------ faults

    fn partition(&mut self) {
        let a = self.rng.gen_range(1..=self.shape.nodes) as NodeId;
        let mut b = self.rng.gen_range(1..=self.shape.nodes) as NodeId;
        if a == b {
            b = b % self.shape.nodes as NodeId + 1;
        }
        let since_ms = self.now_ms;
        self.links.insert((a, b), Link::Cut { since_ms });
        if self.rng.gen_bool(0.5) {
            self.links.insert((b, a), Link::Cut { since_ms });
        }
        self.stats.partitions += 1;
    }

    /// Heals one cut link (or all): it comes up, and each side sends its view.
    fn heal(&mut self, all: bool) {
        let cut: Vec<(NodeId, NodeId)> = (self.links.iter())
            .filter(|(&(a, b), l)| **l != Link::Up && self.node(a).up && self.node(b).up)
            .map(|(&k, _)| k)
            .collect();
        if cut.is_empty() {
            return;
        }
        let heal: Vec<(NodeId, NodeId)> = if all {
            cut
        } else {
            vec![cut[self.rng.gen_range(0..cut.len())]]
        };
        for (a, b) in heal {
            self.links.insert((a, b), Link::Up);
            self.link_up(a, b);
        }
    }

    fn link_up(&mut self, a: NodeId, b: NodeId) {
        if self.bugs.no_view_on_link_up {
            return;
        }
        if self.node(a).up && self.node(b).up {
            self.send_view(a, b);
            self.send_view(b, a);
        }
    }

    /// kill -9: every session of the node is gone with it.
    fn crash(&mut self) {
        let up: Vec<NodeId> = self.nodes.iter().filter(|n| n.up).map(|n| n.id).collect();
        if up.len() <= 1 {
            return;
        }
        let id = up[self.rng.gen_range(0..up.len())];
        self.node_mut(id).up = false;
        self.crash_logs(id);
        for c in &mut self.clients {
            if c.conn.is_some_and(|c| c.node == id) {
                c.conn = None;
            }
        }
        let since_ms = self.now_ms;
        for l in self.links.iter_mut() {
            if (l.0 .0 == id || l.0 .1 == id) && *l.1 == Link::Up {
                *l.1 = Link::Cut { since_ms };
            }
        }
        self.stats.crashes += 1;
    }

    /// A crashed node restarts with a new boot id, from the configured view; its
    /// links come up (and views are exchanged).
    fn restart(&mut self, id: NodeId) {
        let boot = self.fresh_boot();
        let initial = {
            let ids: Vec<NodeId> = self.nodes.iter().map(|n| n.id).collect();
            ClusterView::initial(&ids, self.slot_ids).expect("valid")
        };
        let initial = match self.saved_views.get(&id) {
            Some(saved) => initial.merge(saved).unwrap_or(initial),
            None => initial,
        };
        let node = self.boot_node(id, boot, &initial);
        self.nodes[id as usize - 1] = node;
        let peers: Vec<NodeId> = self
            .nodes
            .iter()
            .map(|n| n.id)
            .filter(|&p| p != id)
            .collect();
        for p in peers {
            for key in [(id, p), (p, id)] {
                self.links.insert(key, Link::Up);
            }
            self.link_up(id, p);
        }
    }

    fn pause(&mut self) {
        let id = self.rng.gen_range(1..=self.shape.nodes) as NodeId;
        let ms = self.rng.gen_range(100..2_000);
        let until = self.now_ms + ms;
        self.node_mut(id).paused_until_ms = until;
    }

    // ------------------------------------------------------------------ driving

    fn trace(&self, uid: &str, what: impl FnOnce() -> String) {
        if self.trace_uid.as_deref() == Some(uid) {
            eprintln!("{:>8} {uid}: {}", self.now_ms, what());
        }
    }

    /// In a healthy, settled cluster a login replaces the sessions it conflicts
    /// with both ways (two Masters of a uid and flag, or one device twice) before
    /// its CONNACK (rule 11: their owners closed them first).
    fn check_login(&mut self, new: usize) {
        let n = &self.clients[new];
        let route = |c: &Client, k: Conn| Route {
            uid: c.uid.as_str().into(),
            device_id: c.device_id.clone(),
            device_flag: c.flag,
            device_level: c.level,
            node_id: k.node,
            boot_id: k.boot,
            session_id: k.session_id,
            listener: Transport::Tcp,
            owner_seq: 0,
            connected_at_ms: 0,
            last_active_s: None,
        };
        let mine = route(n, n.conn.expect("active"));
        for (i, c) in self.clients.iter().enumerate() {
            let Some(k) = c.conn.filter(|k| k.active && i != new) else {
                continue;
            };
            // Both ways: a Master and a Slave of other devices may both be active
            // (whichever committed later decides, and only the authority knows).
            let theirs = route(c, k);
            if mine.conflicts_with(&theirs) && theirs.conflicts_with(&mine) {
                self.violations.push(format!(
                    "login replaces: client {new} got CONNACK 0 while client {i} (uid {}, \
                     session {} on node {}) is still active",
                    c.uid, k.session_id, k.node
                ));
            }
        }
    }

    /// One step of the quiet phase (after the last heal): logins, closes, time.
    pub fn quiet_step(&mut self) {
        self.quiet = true;
        self.phase = Phase::Quiet;
        match self.rng.gen_range(0..100) {
            0..=14 => {
                let c = self.rng.gen_range(0..self.clients.len());
                if self.clients[c].conn.is_none() {
                    self.connect(c);
                }
            }
            15..=19 => {
                let c = self.rng.gen_range(0..self.clients.len());
                self.close(c);
            }
            20..=34 => {
                let c = self.rng.gen_range(0..self.clients.len());
                self.send(c);
            }
            _ => self.advance(),
        }
        self.drain_later();
    }

    /// One step of the moves phase (after the quiet one): an operator moves slots
    /// (one, or a node's drain) while clients SEND; no cut, crash or pause.
    pub fn moves_step(&mut self) {
        self.phase = Phase::Moves;
        match self.rng.gen_range(0..100) {
            0..=2 => self.move_slots(),
            3..=22 => {
                let c = self.rng.gen_range(0..self.clients.len());
                self.send(c);
            }
            _ => self.advance(),
        }
        self.drain_later();
    }

    /// Handles the answers queued during the last turn (and those they queue).
    fn drain_later(&mut self) {
        while !self.later.is_empty() {
            for (at, pending, action) in std::mem::take(&mut self.later) {
                if self.node(at.0).up {
                    self.no_answer(at, pending, action);
                }
            }
        }
    }

    /// One random step of the chaos phase.
    pub fn chaos_step(&mut self) {
        self.chaos_step_inner();
        self.drain_later();
    }

    fn chaos_step_inner(&mut self) {
        match self.rng.gen_range(0..1000) {
            0..=119 => {
                let c = self.rng.gen_range(0..self.clients.len());
                if self.clients[c].conn.is_none() {
                    self.connect(c);
                }
            }
            120..=159 => {
                let c = self.rng.gen_range(0..self.clients.len());
                self.close(c);
            }
            160..=169 => self.move_slots(),
            170..=177 => self.partition(),
            178..=189 => self.heal(false),
            190..=192 => self.crash(),
            193..=199 => {
                let down: Vec<NodeId> = self.nodes.iter().filter(|n| !n.up).map(|n| n.id).collect();
                if !down.is_empty() {
                    let id = down[self.rng.gen_range(0..down.len())];
                    self.restart(id);
                }
            }
            200..=203 => self.pause(),
            204..=279 => {
                let c = self.rng.gen_range(0..self.clients.len());
                self.send(c);
            }
            _ => self.advance(),
        }
    }

    /// Time moves on by a little; what is due happens.
    pub fn advance(&mut self) {
        self.now_ms += self.rng.gen_range(1..60);
        while self.deliver_due() {
            self.drain_later();
        }
        self.fire_timers();
        self.drain_later();
        self.pump_commits();
        self.drain_later();
        self.keep_alive();
    }

    /// Active clients ping before their keep-alive runs out.
    fn keep_alive(&mut self) {
        for c in 0..self.clients.len() {
            let due = self.clients[c]
                .conn
                .is_some_and(|k| k.active && self.now_ms >= k.last_ping_ms + PING_EVERY_MS);
            if due {
                self.ping(c);
            }
        }
    }

    /// Every fault ends: links up, crashed nodes restarted, pauses over.
    pub fn heal_all(&mut self) {
        let down: Vec<NodeId> = self.nodes.iter().filter(|n| !n.up).map(|n| n.id).collect();
        for id in down {
            self.restart(id);
        }
        for n in &mut self.nodes {
            n.paused_until_ms = 0;
        }
        self.heal(true);
    }

    /// Runs without faults, new logins or closes for `ms`: clients only ping.
    pub fn settle(&mut self, ms: u64) {
        let end = self.now_ms + ms;
        while self.now_ms < end {
            self.advance();
        }
    }

    // ------------------------------------------------------------------ invariants

    /// Each authority's own invariants (a scan of its tables: every few steps).
    pub fn check_authorities(&self) -> Result<(), String> {
        for n in self.nodes.iter().filter(|n| n.up) {
            for s in &n.shards {
                s.auth.check_invariants()?;
            }
        }
        Ok(())
    }

    /// Checked after every step: the world's own bookkeeping agrees with the
    /// machines (a client that believes it is active has an active session).
    pub fn check_always(&self) -> Result<(), String> {
        if let Some(v) = self.violations.first() {
            return Err(v.clone());
        }
        for (i, c) in self.clients.iter().enumerate() {
            let Some(k) = c.conn else { continue };
            let node = self.node(k.node);
            if !node.up || node.boot != k.boot {
                return Err(format!("client {i} connected to a dead process"));
            }
            let shard = &node.shards[k.shard as usize];
            if shard.conns.get(&k.session_id) != Some(&i) {
                return Err(format!("client {i}: its gateway lost its connection"));
            }
            if k.active {
                let h = shard.reg.handle_of(k.session_id);
                if h.and_then(|h| shard.reg.state(h)) != Some(SessionState::Active) {
                    return Err(format!("client {i}: CONNACK 0 but no active session"));
                }
            }
        }
        Ok(())
    }

    /// After the last heal and a settle of [`settle_ms`](Self::settle_ms):
    /// - **one device**: at most one active Master session per (uid, device flag),
    ///   and one per (uid, device flag, device id);
    /// - **no zombie**: every active session is routed by its uid's authority (the
    ///   authority the converged view names holds its route at its owner_seq).
    pub fn check_settled(&self) -> Result<(), String> {
        let view = &self.nodes[0].view;
        for n in &self.nodes {
            if n.view.slots != view.slots {
                return Err(format!("node {} did not converge on the view", n.id));
            }
        }
        let active: Vec<(usize, &Client, Conn)> = (self.clients.iter().enumerate())
            .filter_map(|(i, c)| c.conn.filter(|k| k.active).map(|k| (i, c, k)))
            .collect();
        for (x, (i, a, _)) in active.iter().enumerate() {
            for (j, b, _) in &active[x + 1..] {
                let same = a.uid == b.uid && a.flag == b.flag;
                let both_master = a.level == DeviceLevel::Master && b.level == DeviceLevel::Master;
                if same && (both_master || a.device_id == b.device_id) {
                    return Err(format!(
                        "one device: clients {i} and {j} are both active as uid {} flag {}",
                        a.uid, a.flag
                    ));
                }
            }
        }
        for (i, c, k) in &active {
            let target = view.target_for_uid(&c.uid);
            let auth_node = self.node(target.leader_node_id);
            let shard = &auth_node.shards[self.slot_shard(target.hash_slot) as usize];
            let identity = RouteIdentity {
                uid: c.uid.as_str().into(),
                node_id: k.node,
                boot_id: k.boot,
                session_id: k.session_id,
            };
            let gw = &self.node(k.node).shards[k.shard as usize];
            let seq = gw
                .reg
                .handle_of(k.session_id)
                .and_then(|h| gw.reg.get(h))
                .map(|i| i.owner_seq);
            let routed = shard.auth.route(&identity).map(|r| r.owner_seq);
            if routed.is_none() || routed != seq {
                return Err(format!(
                    "no zombie: client {i} (uid {}, session {} on node {}) is active at its \
                     gateway but its authority (node {}) has route {routed:?}, not {seq:?}",
                    c.uid, k.session_id, k.node, target.leader_node_id
                ));
            }
        }
        self.check_no_move_lost(view)?;
        self.check_no_ghost(view)
    }

    /// **No move lost**: every move answered 200 is in the converged view or
    /// superseded by a later one (a higher term): never dropped for another move at
    /// the same term (two moves of one slot made at once through two nodes).
    fn check_no_move_lost(&self, view: &ClusterView) -> Result<(), String> {
        for &(h, leader, term) in &self.moves_made {
            let now = view.slots[h as usize];
            if now.leader_term < term || (now.leader_term == term && now.leader_node_id != leader) {
                return Err(format!(
                    "no move lost: hash slot {h} was moved to node {leader} at term {term}, \
                     the converged view has node {} at term {}",
                    now.leader_node_id, now.leader_term
                ));
            }
        }
        Ok(())
    }

    /// **No ghost**: every active route of a live process names a session active at
    /// its gateway at the route's owner_seq (an app trusts `onlinestatus`: a ghost
    /// route says online and the app skips its offline push). Routes of a process
    /// that crashed wait out their TTL: the crash's window.
    fn check_no_ghost(&self, view: &ClusterView) -> Result<(), String> {
        for h in 0..slots::HASH_SLOTS {
            let h = h as HashSlot;
            let leader = self.node(view.slots[h as usize].leader_node_id);
            let auth = &leader.shards[self.slot_shard(h) as usize].auth;
            for r in auth.active_routes(h) {
                let owner = self.node(r.node_id);
                if !owner.up || owner.boot != r.boot_id {
                    continue;
                }
                let gw = &owner.shards[session_shard(r.session_id) as usize];
                let session = gw.reg.handle_of(r.session_id).and_then(|h| {
                    let state = gw.reg.state(h)?;
                    Some((state, gw.reg.get(h)?.owner_seq))
                });
                if session != Some((SessionState::Active, r.owner_seq)) {
                    return Err(format!(
                        "no ghost: node {} routes uid {} to session {} on node {} at \
                         owner_seq {}, which its gateway has as {session:?}",
                        leader.id, r.uid, r.session_id, r.node_id, r.owner_seq
                    ));
                }
            }
        }
        Ok(())
    }

    /// How long after the last heal the settled invariants must hold: every route
    /// rebuilt at `rebuild_routes_per_s`, one touch flush, one request deadline,
    /// one keep-alive (a zombie is found by its next touch), and the time views
    /// take to spread.
    pub fn settle_ms(&self) -> u64 {
        let routes = self.clients.len() as u64;
        routes * 1000 / u64::from(REBUILD_ROUTES_PER_S)
            + TOUCH_FLUSH_MS
            + RPC_DEADLINE_MS
            + PING_EVERY_MS
            + 2 * LINK_DELAY_MS.end
            + 1_000
    }
}

fn hop_kind(p: &Pending) -> HopKind {
    match p {
        Pending::Activation { .. } | Pending::Unregister(_) => HopKind::Authority,
        Pending::Touch { .. } => HopKind::Touch,
        Pending::Owner { .. } => HopKind::OwnerAction,
        Pending::Send { .. } => HopKind::Send,
        Pending::Lookup { .. } => HopKind::Lookup,
        Pending::Handover => HopKind::Handover,
    }
}
