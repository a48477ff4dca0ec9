//! The handover of a moved hash slot (issue "Cluster defects found in a review…",
//! item 7): a planned move (a slot move, a drain) loses no push.
//!
//! Without it, the new leader of a hash slot starts with an empty table and answers
//! every lookup "offline" until the gateways' rebuild touches arrive, so messages
//! committed meanwhile skip recipients who stayed connected. With it:
//!
//! - **The old leader** ([`Authority::apply_view`]) hands every active route of a
//!   slot it loses to the new leader ([`Handover`]; the driver carries it in
//!   bounded [`HandoverBatch`]es), even when it has none: the batch count tells the
//!   new leader when it has everything.
//! - **The new leader** installs a slot it gained from another node *waiting*: its
//!   lookups answer [`AuthorityError::Rebuilding`] (the delivery planner looks up
//!   again a little later) until every batch of the handover is applied
//!   ([`Authority::take_handover`]) or `handover_wait_s` passed (the old leader
//!   crashed, or its handover was lost: the gateways' rebuild is then the only
//!   source, as before). Registers, touches and unregisters are served throughout.
//! - A batch that arrives before the view that gives the slot to this node (the
//!   view and the handover travel apart) is kept, bounded by
//!   `handover_stash_routes_max` and for `handover_wait_s`, and applied when that
//!   identity is installed.
//! - A slot lost while it still waits (moved on again before its handover came)
//!   is *relayed*: the routes it has and those of the batches still to come for
//!   its identity are handed over together once the last one came (or its wait
//!   ran out), so the next leader's wait ends with every route, not with the
//!   few the middle node had.
//!
//! Handed-over routes are applied as touches (rules 14–17): each keeps its
//! activity time (so its TTL), and one that conflicts with a newer registration,
//! is at or below a tombstone or below the identity's owner_seq is ignored, as a
//! gateway's own rebuild touch would be. Routes are applied only while the slot
//! waits for them: a late handover (the wait ran out, or the slot was installed
//! without one, as after a crash that lost its tombstones) could bring back a
//! session unregistered since.
//!
//! A handover also carries the old leader's tombstones (rules 18, 19), applied
//! whenever the identity is installed, awaited or not: a tombstone only ever
//! removes a route at or below it. They remove what a leader that missed a term
//! still holds: a node that led a slot, missed the move to another node (where
//! a session was unregistered) and the move back, keeps its own routes, that
//! session's among them, until the intermediate leader's tombstones come.

use std::collections::BTreeSet;

use crate::cluster::{HashSlot, NodeId, Target};
use crate::presence::route::{AuthorityError, OwnerSeq, Route, RouteIdentity};

use super::{Authority, SlotWriter};

/// An unregister tombstone: the identity and the owner_seq at or below which its
/// routes are removed.
pub type Tombstone = (RouteIdentity, OwnerSeq);

/// The active routes of a hash slot this node lost, for its new leader.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Handover {
    /// The new leader's identity of the slot (its node is `target.leader_node_id`).
    pub target: Target,
    /// Every active route of the slot here, oldest activation first.
    pub routes: Vec<Route>,
    /// Every unregister tombstone of the slot here.
    pub tombstones: Vec<Tombstone>,
}

/// One part of a [`Handover`] on its way: batches may arrive in any order; the
/// handover is complete when `batches` distinct ones were applied.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HandoverBatch {
    /// The new leader's identity of the slot.
    pub target: Target,
    /// Some of the handover's routes (all of one hash slot).
    pub routes: Vec<Route>,
    /// Some of the handover's tombstones.
    pub tombstones: Vec<Tombstone>,
    /// This batch's number, `0..batches`.
    pub batch: u32,
    /// The handover's batch count (at least 1: a slot without routes is one empty
    /// batch).
    pub batches: u32,
}

impl HandoverBatch {
    /// What a kept batch counts against `handover_stash_routes_max`: its routes
    /// and tombstones, at least 1 (an empty batch is kept too).
    fn items(&self) -> usize {
        (self.routes.len() + self.tombstones.len()).max(1)
    }
}

impl Handover {
    /// The handover in batches of at most `items_max` routes and tombstones
    /// together (at least one batch; `items_max` 0 counts as 1).
    pub fn into_batches(self, items_max: usize) -> Vec<HandoverBatch> {
        let items_max = items_max.max(1);
        let mut parts: Vec<(Vec<Route>, Vec<Tombstone>)> = Vec::new();
        let mut routes = self.routes.into_iter().peekable();
        let mut tombstones = self.tombstones.into_iter().peekable();
        while routes.peek().is_some() || tombstones.peek().is_some() || parts.is_empty() {
            let r: Vec<Route> = routes.by_ref().take(items_max).collect();
            let t = tombstones.by_ref().take(items_max - r.len()).collect();
            parts.push((r, t));
        }
        let batches = parts.len() as u32;
        (parts.into_iter().enumerate())
            .map(|(i, (routes, tombstones))| HandoverBatch {
                target: self.target,
                routes,
                tombstones,
                batch: i as u32,
                batches,
            })
            .collect()
    }
}

/// What [`Authority::take_handover`] did with a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandoverOutcome {
    /// Its routes were applied; `done`: the slot's lookups are answered from its
    /// table from now on (every batch came, or the wait had already ended).
    Applied {
        /// The slot serves lookups now.
        done: bool,
    },
    /// The identity is newer than the one installed here (its view has not come
    /// yet): kept until it is installed or `handover_wait_s` passes.
    Kept,
    /// For an identity this node lost before its handover came: gathered with
    /// the routes it had, for the slot's next leader.
    Relayed,
}

/// A slot installed waiting for its handover.
#[derive(Clone, Debug, Default)]
pub(super) struct Waiting {
    /// The node the slot was taken from, whose handover is awaited.
    from: NodeId,
    /// The wait ends at this second whatever came.
    until_s: u64,
    /// The batch numbers applied so far (distinct: a repeated batch counts once).
    received: BTreeSet<u32>,
}

/// Whether a handover batch addressed to `target` is one a slot installed as
/// `installed` (and waiting) takes: an identity of the same slot led by the same
/// node, not newer. The old leader names the identity it saw; this node may have
/// missed it (a move to itself made by a node that saw it, or one that replaced
/// it while it waited).
fn awaits(installed: Target, target: Target) -> bool {
    let key = |t: Target| (t.config_epoch, t.leader_term);
    target.hash_slot == installed.hash_slot
        && target.leader_node_id == installed.leader_node_id
        && key(target) <= key(installed)
}

/// A slot lost while it waited for its handover: what it had, gathering the
/// batches still to come for its old identity before it is handed over.
#[derive(Debug)]
pub(super) struct Relay {
    /// The identity this node had, whose handover batches are still coming.
    from: Target,
    /// The newest identity of the slot elsewhere: where the routes go.
    to: Target,
    routes: Vec<Route>,
    /// The lost slot's tombstones and those of the batches gathered.
    tombstones: Vec<Tombstone>,
    /// The batch numbers of `from`'s handover applied or gathered so far.
    received: BTreeSet<u32>,
    /// Handed over at this second whatever came.
    until_s: u64,
}

/// Every unregister tombstone `w` holds.
fn tombstones_of(w: &SlotWriter) -> Vec<Tombstone> {
    (w.recs.iter())
        .filter_map(|(_, r)| {
            let t = r.tombstone?;
            Some((r.sess.identity(&w.users[r.user].uid), t))
        })
        .collect()
}

/// Batches kept for identities not installed yet.
#[derive(Debug, Default)]
pub(super) struct Kept {
    /// `(second kept, batch)`, oldest first.
    batches: Vec<(u64, HandoverBatch)>,
    /// Their routes and tombstones, an empty batch counting 1 (at most
    /// `handover_stash_routes_max`).
    routes: usize,
}

impl Authority {
    /// A new identity replaced `old` on this node while `old` still waited for
    /// its handover: the wait goes on (its batches name `old`, see [`awaits`]).
    pub(super) fn inherit_wait(&mut self, old: Target, waiting: Waiting) {
        self.waiting[old.hash_slot as usize] = Some(waiting);
    }

    /// Takes the wait of slot `s` (for [`inherit_wait`](Self::inherit_wait)).
    pub(super) fn take_wait(&mut self, s: usize) -> Option<Waiting> {
        self.waiting[s].take()
    }

    /// Starts the wait for `target`'s handover (just installed, from another node's
    /// leadership) and applies the batches kept for it; drops kept batches of
    /// older identities of its slot.
    pub(super) fn begin_waiting(&mut self, target: Target, from: NodeId, now_s: u64) {
        let s = target.hash_slot as usize;
        self.waiting[s] = Some(Waiting {
            from,
            until_s: now_s.saturating_add(self.cfg.handover_wait_s),
            received: BTreeSet::new(),
        });
        let kept = std::mem::take(&mut self.kept.batches);
        self.kept.routes = 0;
        let mut mine = Vec::new();
        for (at_s, b) in kept {
            if b.target == target {
                mine.push(b);
            } else if b.target.hash_slot != target.hash_slot {
                self.kept.routes += b.items();
                self.kept.batches.push((at_s, b));
            }
        }
        for b in mine {
            let _ = self.apply_batch(&b, now_s);
        }
    }

    /// Applies one batch of a handover to this node (see the module docs):
    /// `StaleTarget` for an identity older than the installed one, `NotLeader` for
    /// a hash slot this writer does not own, `Full` when a batch for an identity
    /// not installed yet finds no room to be kept (the slot then waits out
    /// `handover_wait_s`, its rebuild coming from the gateways).
    pub fn take_handover(
        &mut self,
        batch: HandoverBatch,
        now_s: u64,
    ) -> Result<HandoverOutcome, AuthorityError> {
        let s = batch.target.hash_slot as usize;
        if !self.owned.get(s).copied().unwrap_or(false) {
            return Err(AuthorityError::NotLeader);
        }
        let installed = self.slots[s].as_ref().map(|w| w.target);
        if let Some(t) = installed.filter(|&t| awaits(t, batch.target)) {
            let mut batch = batch;
            batch.target = t;
            return self.apply_batch(&batch, now_s);
        }
        let relayed = |r: &Relay| awaits(r.from, batch.target);
        if let Some(i) = self.relays.iter().position(relayed) {
            self.gather(i, batch);
            return Ok(HandoverOutcome::Relayed);
        }
        let key = |t: &Target| (t.config_epoch, t.leader_term);
        // Not newer than the installed identity and not its own (`awaits`): an
        // old leader's or another node's.
        if installed.is_some_and(|t| key(&batch.target) <= key(&t)) {
            return Err(AuthorityError::StaleTarget);
        }
        let items = batch.items();
        if self.kept.routes + items > self.cfg.handover_stash_routes_max {
            return Err(AuthorityError::Full);
        }
        self.kept.routes += items;
        self.kept.batches.push((now_s, batch));
        Ok(HandoverOutcome::Kept)
    }

    /// Touches `batch`'s routes into its installed slot and counts the batch.
    fn apply_batch(
        &mut self,
        batch: &HandoverBatch,
        now_s: u64,
    ) -> Result<HandoverOutcome, AuthorityError> {
        let s = batch.target.hash_slot as usize;
        let (w, dir, cfg, log) = self.slot_mut(&batch.target)?;
        for (identity, seq) in &batch.tombstones {
            if slots::hash_slot(identity.uid.as_bytes()) == batch.target.hash_slot {
                // `Full` (no room for a new fence record): the route, if any, lives
                // on to its TTL, as with a gateway's unregister refused so.
                let _ = w.unregister(dir, cfg, log, identity, *seq, now_s);
            }
        }
        if self.waiting[s].is_none() {
            // Not awaited (the wait ran out, or the slot was installed without one:
            // at start-up, after a crash that lost its tombstones): routes this old
            // could bring back sessions unregistered since.
            self.stats.handovers_ignored += 1;
            return Ok(HandoverOutcome::Applied { done: true });
        }
        self.touch_in(batch.target, &batch.routes, now_s)?;
        self.stats.handover_routes += batch.routes.len() as u64;
        let Some(waiting) = self.waiting[s].as_mut() else {
            unreachable!("checked above");
        };
        waiting.received.insert(batch.batch);
        let done = waiting.received.len() >= batch.batches as usize;
        if done {
            self.end_waiting(s as HashSlot);
        }
        Ok(HandoverOutcome::Applied { done })
    }

    /// The routes of a slot's former identity on this node, touched into its new
    /// one (a move of the slot to the node that leads it: a new term, the same
    /// routes).
    pub(super) fn carry_over(&mut self, target: Target, routes: &[Route], now_s: u64) {
        let _ = self.touch_in(target, routes, now_s);
    }

    /// Touches `routes` of `target`'s slot into its installed identity (rules
    /// 14–17); a route of another slot is skipped. `slot_mut`'s error when
    /// `target` is not the installed identity.
    fn touch_in(
        &mut self,
        target: Target,
        routes: &[Route],
        now_s: u64,
    ) -> Result<(), AuthorityError> {
        let (w, dir, cfg, log) = self.slot_mut(&target)?;
        for r in routes {
            if slots::hash_slot(r.uid.as_bytes()) == target.hash_slot {
                let _ = w.touch_one(dir, cfg, log, r, now_s);
            }
        }
        Ok(())
    }

    /// Slot `s` (installed as `from`) is lost to `to`: handed over at once, or
    /// relayed while it still waits for its own handover.
    pub(super) fn lose(&mut self, from: Target, to: Target) {
        let s = from.hash_slot as usize;
        let routes = self.active_routes(from.hash_slot);
        let tombstones = self.slots[s]
            .as_deref()
            .map(tombstones_of)
            .unwrap_or_default();
        match self.waiting[s].take() {
            Some(w) => {
                // A slot's relay ends when it is installed again (`drop_relay`):
                // this is its only one.
                debug_assert!(self
                    .relays
                    .iter()
                    .all(|r| r.from.hash_slot != from.hash_slot));
                self.relays.push(Relay {
                    from,
                    to,
                    routes,
                    tombstones,
                    received: w.received,
                    until_s: w.until_s,
                });
            }
            None => self.hand_over(Handover {
                target: to,
                routes,
                tombstones,
            }),
        }
    }

    /// Relay `i` gathers `batch`; once it has every batch, it is handed over.
    fn gather(&mut self, i: usize, batch: HandoverBatch) {
        let r = &mut self.relays[i];
        r.received.insert(batch.batch);
        // Bounded as the slot itself is (what passes could not be applied).
        let room = self.cfg.routes_per_slot_max.saturating_sub(r.routes.len());
        // A gathered route at or below a tombstone of the lost slot (a session
        // closed while this node led it) goes too: the next leader applies the
        // tombstones, which come first, before the routes.
        r.routes.extend(batch.routes.into_iter().take(room));
        let room = (self.cfg.fence_records_per_slot_max).saturating_sub(r.tombstones.len());
        r.tombstones.extend(batch.tombstones.into_iter().take(room));
        if r.received.len() >= batch.batches as usize {
            self.hand_on(i);
        }
    }

    /// Relay `i` is handed over to its slot's newest leader with what it has.
    fn hand_on(&mut self, i: usize) {
        let r = self.relays.swap_remove(i);
        self.stats.handovers_relayed += 1;
        self.hand_over(Handover {
            target: r.to,
            routes: r.routes,
            tombstones: r.tombstones,
        });
    }

    /// A slot not installed here moved on to `to`: a relay of it follows; batches
    /// kept for an identity of it this node never installed (the view that gave
    /// it the slot was overtaken by the one that took it away) are relayed to
    /// `to`, which waits for them.
    pub(super) fn moved_on(&mut self, to: Target, now_s: u64) {
        let slot = to.hash_slot;
        if let Some(r) = (self.relays.iter_mut()).find(|r| r.from.hash_slot == slot) {
            r.to = to;
            return;
        }
        // Only an identity the view has overtaken: one newer than it is still to
        // come here.
        let key = |t: &Target| (t.config_epoch, t.leader_term);
        let overtaken = |b: &HandoverBatch| b.target.hash_slot == slot && key(&b.target) < key(&to);
        if !self.kept.batches.iter().any(|(_, b)| overtaken(b)) {
            return;
        }
        let (mine, others): (Vec<_>, Vec<_>) = std::mem::take(&mut self.kept.batches)
            .into_iter()
            .partition(|(_, b)| overtaken(b));
        self.kept.batches = others;
        self.kept.routes = self.kept.batches.iter().map(|(_, b)| b.items()).sum();
        let from = (mine.iter().map(|(_, b)| b.target))
            .max_by_key(|t| (t.config_epoch, t.leader_term))
            .unwrap_or(to);
        self.relays.push(Relay {
            from,
            to,
            routes: Vec::new(),
            tombstones: Vec::new(),
            received: BTreeSet::new(),
            until_s: now_s.saturating_add(self.cfg.handover_wait_s),
        });
        for (_, b) in mine {
            // Another identity's batches than the newest kept are not its.
            if b.target == from {
                if let Some(i) = self.relays.iter().position(|r| r.from == from) {
                    self.gather(i, b);
                }
            }
        }
    }

    /// A slot led here again drops its relay: the routes it gathered are as old
    /// as this node's last leadership (a session closed since was unregistered
    /// at the leader in between, whose handover this node now waits for), so
    /// they are not taken back.
    pub(super) fn drop_relay(&mut self, hash_slot: HashSlot) {
        self.relays.retain(|r| r.from.hash_slot != hash_slot);
    }

    /// Queues the handover of a slot this writer lost, replacing an earlier one
    /// of that slot not taken yet (so at most one per slot waits).
    pub(super) fn hand_over(&mut self, h: Handover) {
        let slot = h.target.hash_slot;
        self.handovers.retain(|o| o.target.hash_slot != slot);
        self.handovers.push(h);
    }

    /// Moves the handovers of the slots this writer lost (by
    /// [`apply_view`](Authority::apply_view)) to `out`, for the driver to carry to
    /// each new leader in [`HandoverBatch`]es.
    pub fn take_handovers(&mut self, out: &mut Vec<Handover>) {
        out.append(&mut self.handovers);
    }

    /// The slot's lookups are answered from its table from now on.
    pub(super) fn end_waiting(&mut self, hash_slot: HashSlot) {
        let s = hash_slot as usize;
        if self.waiting[s].take().is_some() {
            // A slot not installed has no published state: nothing to clear.
            self.dir.end_rebuilding(s);
        }
    }

    /// Ends the waits past their second and drops kept batches as old (the
    /// expiry pass).
    pub(super) fn expire_handovers(&mut self, now_s: u64) {
        for s in 0..self.waiting.len() {
            if self.waiting[s].as_ref().is_some_and(|w| now_s >= w.until_s) {
                self.stats.handover_waits_expired += 1;
                self.end_waiting(s as HashSlot);
            }
        }
        let mut i = 0;
        while i < self.relays.len() {
            if now_s >= self.relays[i].until_s {
                self.hand_on(i);
            } else {
                i += 1;
            }
        }
        let wait_s = self.cfg.handover_wait_s;
        let before = self.kept.batches.len();
        self.kept
            .batches
            .retain(|(at_s, _)| now_s < at_s.saturating_add(wait_s));
        if self.kept.batches.len() != before {
            self.kept.routes = self.kept.batches.iter().map(|(_, b)| b.items()).sum();
        }
    }

    /// Ends every wait for a handover from `node` (the driver found it unreachable:
    /// its handover will not come, and waiting out `handover_wait_s` would only
    /// hold deliveries). Returns the waits ended; each is counted in
    /// `handover_waits_expired`.
    pub fn end_waits_from(&mut self, node: NodeId) -> usize {
        let mut ended = 0;
        for s in 0..self.waiting.len() {
            if self.waiting[s].as_ref().is_some_and(|w| w.from == node) {
                self.stats.handover_waits_expired += 1;
                self.end_waiting(s as HashSlot);
                ended += 1;
            }
        }
        ended
    }

    /// Whether `hash_slot`'s lookups wait for its handover.
    pub fn is_waiting_for_handover(&self, hash_slot: HashSlot) -> bool {
        self.waiting
            .get(hash_slot as usize)
            .is_some_and(|w| w.is_some())
    }
}
