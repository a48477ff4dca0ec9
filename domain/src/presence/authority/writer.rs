//! The writer of one installed hash slot ([`SlotWriter`]): its uids, records and
//! candidates, the published table it writes, and its expiry ring and wheel; every
//! authority call and touch on a slot ends here. The [`Authority`](super::Authority)
//! holds one per slot it leads.

use super::*;

/// A candidate's wheel entry: its record and nonce.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) struct PendingKey {
    pub(super) rec: u32,
    pub(super) nonce: u64,
}

/// The writer state of one installed hash slot.
pub(super) struct SlotWriter {
    pub(super) target: Target,
    pub(super) revision: Revision,
    /// The user of each uid.
    pub(super) by_uid: HashMap<Uid, u32, FxBuildHasher>,
    pub(super) users: Slab<User>,
    /// Every record (at most `fence_records_per_slot_max`).
    pub(super) recs: Slab<Record>,
    pub(super) table: TableWriter,
    /// The records' deadlines (see [`Record::link`]), by record index.
    pub(super) ring: ExpiryRing,
    /// The candidates' deadlines.
    pub(super) wheel: TimerWheel<PendingKey>,
    pub(super) active: usize,
    pub(super) pending: usize,
    pub(super) next_nonce: u64,
    pub(super) next_activation: u64,
    /// The endpoints of the uid being published (at most `records_per_uid_max`).
    pub(super) scratch: Vec<CompactEndpoint>,
}

/// Entries of a slot's published table at most: room for every uid with a route
/// (at most `routes_per_slot_max`) at a load of at most one half after a rebuild.
pub(super) fn table_entries_max(cfg: &AuthorityConfig) -> usize {
    cfg.routes_per_slot_max
        .saturating_add(1)
        .saturating_mul(2)
        .next_power_of_two()
}

/// How many due entries ahead an expiry pass prefetches published entries
/// (records: twice as far).
pub(super) const EXPIRE_PREFETCH_DISTANCE: usize = 8;

#[inline]
pub(super) fn route_deadline(last_active_s: Option<u64>, ttl_s: u64) -> Option<u64> {
    last_active_s.map(|a| a.saturating_add(ttl_s).saturating_add(1))
}

#[inline]
pub(super) fn compact_of(r: &Route) -> CompactEndpoint {
    CompactEndpoint {
        uid_index: 0,
        device_flag: r.device_flag,
        device_level: r.device_level,
        node_id: r.node_id,
        boot_id: r.boot_id,
        session_id: r.session_id,
        owner_seq: r.owner_seq,
    }
}

/// The deadline record `rec`'s state asks for in the expiry ring: its active
/// route's expiry, none while it has a candidate, else its retention deadline.
#[inline]
pub(super) fn wanted_deadline(rec: &Record, cfg: &AuthorityConfig) -> Option<u64> {
    if let Some(a) = rec.active() {
        route_deadline(a.route.last_active_s, cfg.route_ttl_s)
    } else if rec.pending.is_some() {
        None
    } else {
        rec.retain_until_s
    }
}

/// Brings `rec.retain_until_s` in line with its state: none while it has a route
/// or candidate; else kept, or started at `now_s` when none ran or
/// `reset_retention`.
#[inline]
pub(super) fn settle_retention(
    rec: &mut Record,
    now_s: u64,
    cfg: &AuthorityConfig,
    reset_retention: bool,
) {
    rec.retain_until_s = if rec.is_active || rec.pending.is_some() {
        None
    } else {
        match rec.retain_until_s {
            Some(d) if !reset_retention => Some(d),
            _ => Some(now_s.saturating_add(cfg.fence_retention_s)),
        }
    };
}

impl SlotWriter {
    pub(super) fn new(
        target: Target,
        revision: Revision,
        now_s: u64,
        cfg: &AuthorityConfig,
        next_nonce: u64,
        table: TableWriter,
    ) -> SlotWriter {
        SlotWriter {
            target,
            revision,
            by_uid: HashMap::default(),
            users: Slab::new(),
            recs: Slab::new(),
            table,
            ring: ExpiryRing::new(
                now_s,
                cfg.route_ttl_s.max(cfg.fence_retention_s).saturating_add(1),
                cfg.fence_records_per_slot_max,
            ),
            wheel: TimerWheel::new(now_s, cfg.pending_per_slot_max.saturating_add(1)),
            active: 0,
            pending: 0,
            next_nonce,
            next_activation: 0,
            scratch: Vec::new(),
        }
    }

    /// Gives record `i` the retention and the ring deadline its state asks for
    /// (see [`settle_retention`], [`wanted_deadline`]).
    #[inline]
    pub(super) fn settle(
        &mut self,
        i: u32,
        now_s: u64,
        cfg: &AuthorityConfig,
        reset_retention: bool,
    ) {
        let rec = &mut self.recs[i];
        settle_retention(rec, now_s, cfg, reset_retention);
        let moved = match wanted_deadline(rec, cfg) {
            None => self.ring.cancel(i, &mut rec.link),
            Some(d) => self.ring.set(i, &mut rec.link, d),
        };
        if let Some(m) = moved {
            m.apply(&mut self.recs[m.rec].link);
        }
    }

    #[inline]
    pub(super) fn records_of(&self, user: u32) -> UserRecords<'_> {
        records_from(&self.recs, self.users[user].first)
    }

    /// The record of `sess` under `user`.
    #[inline]
    pub(super) fn find_record(&self, user: u32, sess: Sess) -> Option<u32> {
        self.records_of(user)
            .find(|(_, r)| r.sess == sess)
            .map(|(i, _)| i)
    }

    /// The record of `sess` under `uid`.
    #[inline]
    pub(super) fn record_of(&self, uid: &Uid, sess: Sess) -> Option<u32> {
        let u = *self.by_uid.get(uid)?;
        self.find_record(u, sess)
    }

    /// Records (when on) that record `i`'s route became active or ended, with its
    /// uid's counts now.
    pub(super) fn note_presence(&self, log: &mut PresenceLog, i: u32, online: bool) {
        if !log.on {
            return;
        }
        let rec = &self.recs[i];
        let Some(route) = rec.route.as_ref().map(|a| &a.route) else {
            return;
        };
        let (mut device_online, mut total_online) = (0, 0);
        for (_, r) in self.records_of(rec.user) {
            if let Some(a) = r.active() {
                total_online += 1;
                device_online += u32::from(a.route.device_flag == route.device_flag);
            }
        }
        log.changes.push(PresenceChange {
            uid: route.uid.clone(),
            device_flag: route.device_flag,
            online,
            session_id: route.session_id,
            device_online,
            total_online,
        });
    }

    /// Publishes the active endpoints of `user`, ordered by (node_id, boot_id,
    /// session_id) (rule 25).
    pub(super) fn publish(&mut self, dir: &Directory, user: u32) {
        let mut eps = std::mem::take(&mut self.scratch);
        eps.clear();
        eps.extend(
            self.records_of(user)
                .filter_map(|(_, r)| r.active().map(|a| compact_of(&a.route))),
        );
        if eps.len() > 1 {
            eps.sort_unstable_by_key(|e| (e.node_id, e.boot_id, e.session_id));
        }
        self.table.publish(dir, user, &self.users[user].uid, &eps);
        self.scratch = eps;
    }

    /// Index of the record of `sess` under `uid`, creating it within the limits.
    pub(super) fn record_index_or_create(
        &mut self,
        uid: &Uid,
        sess: Sess,
        cfg: &AuthorityConfig,
    ) -> Result<u32, AuthorityError> {
        let user = self.by_uid.get(uid).copied();
        if let Some(u) = user {
            if let Some(i) = self.find_record(u, sess) {
                return Ok(i);
            }
            if self.users[u].records as usize >= cfg.records_per_uid_max {
                return Err(AuthorityError::Full);
            }
        }
        if self.recs.len >= cfg.fence_records_per_slot_max {
            return Err(AuthorityError::Full);
        }
        let u = match user {
            Some(u) => u,
            None => {
                let u = self.users.insert(User {
                    uid: uid.clone(),
                    first: NIL,
                    records: 0,
                });
                self.by_uid.insert(uid.clone(), u);
                u
            }
        };
        let i = self.recs.insert(Record::new(u, self.users[u].first, sess));
        let usr = &mut self.users[u];
        usr.first = i;
        usr.records += 1;
        Ok(i)
    }

    /// Room for a new record of `sess` under `uid` (without creating it).
    pub(super) fn can_create(&self, uid: &Uid, sess: Sess, cfg: &AuthorityConfig) -> bool {
        match self.by_uid.get(uid) {
            Some(&u) if self.find_record(u, sess).is_some() => true,
            Some(&u) if self.users[u].records as usize >= cfg.records_per_uid_max => false,
            _ => self.recs.len < cfg.fence_records_per_slot_max,
        }
    }

    /// Drops record `i` (neither route nor candidate), and its user with its last
    /// record.
    pub(super) fn drop_record(&mut self, dir: &Directory, i: u32) {
        let Some(rec) = self.recs.remove(i) else {
            debug_assert!(false, "drop of a vacant record");
            return;
        };
        debug_assert!(!rec.is_active && rec.pending.is_none());
        let mut link = rec.link;
        if let Some(m) = self.ring.cancel(i, &mut link) {
            m.apply(&mut self.recs[m.rec].link);
        }
        let u = rec.user;
        if self.users[u].first == i {
            self.users[u].first = rec.next;
        } else {
            let mut j = self.users[u].first;
            while j != NIL {
                let next = self.recs[j].next;
                if next == i {
                    self.recs[j].next = rec.next;
                    break;
                }
                j = next;
            }
        }
        self.users[u].records -= 1;
        if self.users[u].records == 0 {
            if let Some(user) = self.users.remove(u) {
                self.by_uid.remove(&user.uid);
            }
            self.table.release(dir, u);
        }
    }

    /// Registers `route` (rules 6-8): active at once when no live route of its uid
    /// conflicts, else a candidate pending until the conflicting owners close. Refuses
    /// a route at or below its record's tombstone (`Tombstoned`) and one beyond the
    /// slot's record, route or candidate limits (`Full`).
    pub(super) fn register(
        &mut self,
        dir: &Directory,
        cfg: &AuthorityConfig,
        log: &mut PresenceLog,
        mut route: Route,
        now_s: u64,
    ) -> Result<RegisterOutcome, AuthorityError> {
        route.last_active_s = route.last_active_s.map(|t| t.min(now_s));
        let sess = Sess::of_route(&route);
        let found = self.find_for_register(&route, sess);
        if found.tombstoned {
            return Err(AuthorityError::Tombstoned);
        }
        if !self.can_create(&route.uid, sess, cfg) {
            return Err(AuthorityError::Full);
        }
        if found.conflicts.is_empty() {
            self.register_active(dir, cfg, log, route, sess, found.had_active, now_s)
        } else {
            self.register_pending(cfg, route, sess, found, now_s)
        }
    }

    /// What `register` needs to know of `route`'s uid: the active routes of its other
    /// sessions that `route` conflicts with (and whether each is kicked), and the state
    /// of `route`'s own record. Refuses nothing.
    #[inline]
    pub(super) fn find_for_register(&self, route: &Route, sess: Sess) -> RegisterFound {
        let mut conflicts: Vec<(Sess, OwnerSeq, bool)> = Vec::new();
        let mut own: Option<&Record> = None;
        if let Some(&u) = self.by_uid.get(&route.uid) {
            for (_, r) in self.records_of(u) {
                if r.sess == sess {
                    own = Some(r);
                } else if let Some(a) = r.active() {
                    if route.conflicts_with(&a.route) {
                        let kick = route.device_level == DeviceLevel::Master
                            && a.route.device_id != route.device_id;
                        conflicts.push((r.sess, a.route.owner_seq, kick));
                    }
                }
            }
        }
        RegisterFound {
            conflicts,
            tombstoned: own.is_some_and(|r| r.tombstoned(route.owner_seq)),
            had_active: own.is_some_and(|r| r.is_active),
            had_pending: own.is_some_and(|r| r.pending.is_some()),
        }
    }

    /// Makes `route` its record's active route at once (rule 6; no conflict): replaces
    /// a candidate of the record, settles its deadline and publishes the uid. Refuses
    /// (`Full`) a new active route beyond `routes_per_slot_max`.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn register_active(
        &mut self,
        dir: &Directory,
        cfg: &AuthorityConfig,
        log: &mut PresenceLog,
        route: Route,
        sess: Sess,
        had_active: bool,
        now_s: u64,
    ) -> Result<RegisterOutcome, AuthorityError> {
        if !had_active && self.active >= cfg.routes_per_slot_max {
            return Err(AuthorityError::Full);
        }
        let uid = route.uid.clone();
        let i = self.record_index_or_create(&uid, sess, cfg)?;
        self.next_nonce += 1;
        self.next_activation += 1;
        let (nonce, activation) = (self.next_nonce, self.next_activation);
        let rec = &mut self.recs[i];
        rec.last_owner_seq = rec.last_owner_seq.max(route.owner_seq);
        rec.last_nonce = nonce;
        if let Some(p) = rec.pending.take() {
            self.wheel.cancel(p.timer);
            self.pending -= 1;
        }
        rec.activate(Active { route, activation });
        if !had_active {
            self.active += 1;
        }
        self.settle(i, now_s, cfg, false);
        let u = self.recs[i].user;
        self.publish(dir, u);
        if !had_active {
            self.note_presence(log, i, true);
        }
        Ok(RegisterOutcome::Active)
    }

    /// Makes `route` its record's candidate (rules 7, 8): pending until the owners of
    /// `found.conflicts` close them (the returned actions) and commit, or until
    /// `pending_ttl_s` passes. Refuses (`Full`) a new candidate beyond
    /// `pending_per_slot_max` or a full timer wheel.
    #[inline]
    pub(super) fn register_pending(
        &mut self,
        cfg: &AuthorityConfig,
        route: Route,
        sess: Sess,
        found: RegisterFound,
        now_s: u64,
    ) -> Result<RegisterOutcome, AuthorityError> {
        let conflicts = found.conflicts;
        if !found.had_pending && self.pending >= cfg.pending_per_slot_max {
            return Err(AuthorityError::Full);
        }
        let uid = route.uid.clone();
        let i = self.record_index_or_create(&uid, sess, cfg)?;
        self.next_nonce += 1;
        let nonce = self.next_nonce;
        // The wheel holds `pending_per_slot_max + 1` timers: every candidate (at
        // most that limit, checked above) and the one this registration replaces,
        // cancelled below once its successor is in.
        let Ok(timer) = self.wheel.insert(
            now_s.saturating_add(cfg.pending_ttl_s).saturating_add(1),
            PendingKey { rec: i, nonce },
        ) else {
            unreachable!("the pending wheel is sized for every candidate and one more");
        };
        let rec = &mut self.recs[i];
        rec.last_owner_seq = rec.last_owner_seq.max(route.owner_seq);
        rec.last_nonce = nonce;
        if let Some(p) = rec.pending.take() {
            self.wheel.cancel(p.timer);
        } else {
            self.pending += 1;
        }
        let token = PendingToken {
            identity: route.identity(),
            owner_seq: route.owner_seq,
            nonce,
        };
        let actions = conflicts
            .iter()
            .map(|&(s, seq, kick)| OwnerAction {
                kind: if kick {
                    OwnerActionKind::KickThenClose
                } else {
                    OwnerActionKind::Close
                },
                route: s.identity(&uid),
                owner_seq: seq,
            })
            .collect();
        rec.pending = Some(Box::new(Pending {
            route,
            nonce,
            acks: conflicts.iter().map(|&(s, seq, _)| (s, seq)).collect(),
            timer,
        }));
        self.settle(i, now_s, cfg, false);
        Ok(RegisterOutcome::Pending { token, actions })
    }

    pub(super) fn commit(
        &mut self,
        dir: &Directory,
        cfg: &AuthorityConfig,
        log: &mut PresenceLog,
        token: &PendingToken,
        now_s: u64,
    ) -> Result<(), AuthorityError> {
        let sess = Sess::of_identity(&token.identity);
        let Some(&u) = self.by_uid.get(&token.identity.uid) else {
            return Err(AuthorityError::NotReady);
        };
        let Some(i) = self.find_record(u, sess) else {
            return Err(AuthorityError::NotReady);
        };
        if token.nonce < self.recs[i].last_nonce {
            return Err(AuthorityError::Superseded);
        }
        let Some(p) = self.recs[i]
            .pending
            .as_ref()
            .filter(|p| p.nonce == token.nonce && p.route.owner_seq == token.owner_seq)
        else {
            return Err(AuthorityError::NotReady);
        };
        let remove = self.replaced_by(u, i, p)?;
        let had_active = self.recs[i].is_active;
        if self.active - remove.len() + usize::from(!had_active) > cfg.routes_per_slot_max {
            return Err(AuthorityError::Full);
        }
        let ended = self.end_replaced(&remove, cfg, now_s);
        self.next_activation += 1;
        let rec = &mut self.recs[i];
        let Some(p) = rec.pending.take() else {
            return Err(AuthorityError::NotReady);
        };
        self.wheel.cancel(p.timer);
        self.pending -= 1;
        rec.activate(Active {
            route: p.route,
            activation: self.next_activation,
        });
        if !had_active {
            self.active += 1;
        }
        self.settle(i, now_s, cfg, false);
        self.publish(dir, u);
        for j in ended {
            self.note_presence(log, j, false);
        }
        if !had_active {
            self.note_presence(log, i, true);
        }
        Ok(())
    }

    /// The active routes of user `u` that the candidate `p` of record `i` replaces
    /// (those it conflicts with); `NotReady` while one of them has not been
    /// acknowledged by its owner.
    pub(super) fn replaced_by(
        &self,
        u: u32,
        i: u32,
        p: &Pending,
    ) -> Result<Vec<u32>, AuthorityError> {
        let mut remove: Vec<u32> = Vec::new();
        for (j, r) in self.records_of(u) {
            if j == i {
                continue;
            }
            if let Some(a) = r.active() {
                if p.route.conflicts_with(&a.route) {
                    if !p.acks.contains(&(r.sess, a.route.owner_seq)) {
                        return Err(AuthorityError::NotReady);
                    }
                    remove.push(j);
                }
            }
        }
        Ok(remove)
    }

    /// Ends the routes a commit replaces, each tombstoned at its owner_seq (a
    /// candidate of the same identity at or below it goes too); returns the
    /// records whose route was active.
    pub(super) fn end_replaced(
        &mut self,
        remove: &[u32],
        cfg: &AuthorityConfig,
        now_s: u64,
    ) -> Vec<u32> {
        let mut ended = Vec::new();
        for &j in remove {
            let r = &mut self.recs[j];
            if let Some(seq) = r.deactivate() {
                r.tombstone = Some(r.tombstone.map_or(seq, |t| t.max(seq)));
                self.active -= 1;
                ended.push(j);
            }
            // Like an unregister: a candidate of the removed identity at or below
            // the new tombstone goes too.
            if r.pending
                .as_ref()
                .is_some_and(|p| r.tombstoned(p.route.owner_seq))
            {
                if let Some(p) = r.pending.take() {
                    self.wheel.cancel(p.timer);
                    self.pending -= 1;
                }
            }
            self.settle(j, now_s, cfg, false);
        }
        ended
    }

    pub(super) fn abort(
        &mut self,
        cfg: &AuthorityConfig,
        token: &PendingToken,
        now_s: u64,
    ) -> Result<(), AuthorityError> {
        let sess = Sess::of_identity(&token.identity);
        let Some(i) = self.record_of(&token.identity.uid, sess) else {
            return Ok(());
        };
        let rec = &mut self.recs[i];
        if token.nonce < rec.last_nonce {
            return Err(AuthorityError::Superseded);
        }
        if rec
            .pending
            .as_ref()
            .is_some_and(|p| p.nonce == token.nonce && p.route.owner_seq == token.owner_seq)
        {
            if let Some(p) = rec.pending.take() {
                self.wheel.cancel(p.timer);
                self.pending -= 1;
            }
            self.settle(i, now_s, cfg, false);
        }
        Ok(())
    }

    pub(super) fn unregister(
        &mut self,
        dir: &Directory,
        cfg: &AuthorityConfig,
        log: &mut PresenceLog,
        identity: &RouteIdentity,
        owner_seq: OwnerSeq,
        now_s: u64,
    ) -> Result<bool, AuthorityError> {
        let i = self.record_index_or_create(&identity.uid, Sess::of_identity(identity), cfg)?;
        let rec = &mut self.recs[i];
        let tomb = rec.tombstone.map_or(owner_seq, |t| t.max(owner_seq));
        rec.tombstone = Some(tomb);
        rec.last_owner_seq = rec.last_owner_seq.max(owner_seq);
        let mut removed = false;
        if rec.active().is_some_and(|a| a.route.owner_seq <= tomb) {
            rec.deactivate();
            self.active -= 1;
            removed = true;
        }
        if rec
            .pending
            .as_ref()
            .is_some_and(|p| p.route.owner_seq <= tomb)
        {
            if let Some(p) = rec.pending.take() {
                self.wheel.cancel(p.timer);
                self.pending -= 1;
            }
        }
        self.settle(i, now_s, cfg, true);
        if removed {
            let u = self.recs[i].user;
            self.publish(dir, u);
            self.note_presence(log, i, false);
        }
        Ok(removed)
    }

    /// A touch of record `j` of user `u`: refused when stale or tombstoned; an
    /// active route's activity and owner_seq move forward (republished when the
    /// owner_seq did). `None` when the record holds no active route (the touch
    /// may recreate it).
    #[inline]
    pub(super) fn refresh(
        &mut self,
        dir: &Directory,
        cfg: &AuthorityConfig,
        (u, j): (u32, u32),
        r: &Route,
        activity: u64,
    ) -> Option<TouchResult> {
        let rec = &mut self.recs[j];
        if r.owner_seq < rec.last_owner_seq {
            return Some(TouchResult::IgnoredStaleSeq);
        }
        if rec.tombstoned(r.owner_seq) {
            return Some(TouchResult::IgnoredTombstoned);
        }
        let a = rec.active_mut()?;
        let mut deadline = None;
        if let Some(old) = a.route.last_active_s {
            if activity > old {
                a.route.last_active_s = Some(activity);
                deadline = route_deadline(Some(activity), cfg.route_ttl_s);
            }
        }
        let republish = r.owner_seq > a.route.owner_seq;
        if republish {
            a.route.owner_seq = r.owner_seq;
        }
        rec.last_owner_seq = r.owner_seq;
        if let Some(d) = deadline {
            debug_assert!(
                rec.link.is_linked(),
                "active timed route without a deadline"
            );
            if let Some(m) = self.ring.set(j, &mut rec.link, d) {
                m.apply(&mut self.recs[m.rec].link);
            }
        }
        if republish {
            self.publish(dir, u);
        }
        Some(TouchResult::Refreshed)
    }

    /// One touched route. Hot path: no allocation unless the route is recreated.
    #[inline]
    pub(super) fn touch_one(
        &mut self,
        dir: &Directory,
        cfg: &AuthorityConfig,
        log: &mut PresenceLog,
        r: &Route,
        now_s: u64,
    ) -> TouchResult {
        let activity = r.last_active_s.unwrap_or(now_s).min(now_s);
        let sess = Sess::of_route(r);
        let mut missing_conflicts = false;
        if let Some(&u) = self.by_uid.get(&r.uid) {
            let mut found = None;
            for (j, rec) in self.records_of(u) {
                if rec.sess == sess {
                    found = Some(j);
                } else if let Some(a) = rec.active() {
                    if r.conflicts_with(&a.route) {
                        missing_conflicts = true;
                    }
                }
            }
            if let Some(result) = found.and_then(|j| self.refresh(dir, cfg, (u, j), r, activity)) {
                return result;
            }
        }
        // Missing: recreate if it conflicts with nothing (rule 15).
        if missing_conflicts {
            return TouchResult::IgnoredConflict;
        }
        if self.active >= cfg.routes_per_slot_max || !self.can_create(&r.uid, sess, cfg) {
            return TouchResult::Full;
        }
        let Ok(i) = self.record_index_or_create(&r.uid, sess, cfg) else {
            return TouchResult::Full;
        };
        self.next_activation += 1;
        let activation = self.next_activation;
        let rec = &mut self.recs[i];
        rec.last_owner_seq = rec.last_owner_seq.max(r.owner_seq);
        let mut route = r.clone();
        route.last_active_s = Some(activity);
        rec.activate(Active { route, activation });
        self.active += 1;
        self.settle(i, now_s, cfg, false);
        let u = self.recs[i].user;
        self.publish(dir, u);
        self.note_presence(log, i, true);
        TouchResult::Recreated
    }

    /// Hints the CPU to load what handling `due` will touch next: its record.
    #[inline(always)]
    pub(super) fn prefetch_record(&self, due: Due) {
        self.recs.prefetch(due.rec());
    }

    /// Hints the CPU to load what handling `due` touches after its record (loaded
    /// by now): its published entry.
    #[inline(always)]
    pub(super) fn prefetch_entry(&self, dir: &Directory, due: Due) {
        if let Some(r) = self.recs.get(due.rec()) {
            self.table.prefetch(dir, r.user);
        }
    }

    /// Handles one due entry of an expiry pass at `now_s` (see `Authority::expire`);
    /// the ring or the wheel already removed it.
    pub(super) fn fired(
        &mut self,
        dir: &Directory,
        cfg: &AuthorityConfig,
        due: Due,
        now_s: u64,
        stats: &mut AuthorityStats,
        log: &mut PresenceLog,
    ) {
        let i = due.rec();
        let Some(rec) = self.recs.get_mut(i) else {
            debug_assert!(false, "due entry of a dropped record");
            return;
        };
        match due {
            Due::Pending(_, nonce) => {
                if rec.pending.as_ref().is_some_and(|p| p.nonce == nonce) {
                    rec.pending = None;
                    self.pending -= 1;
                    stats.pending_expired += 1;
                    self.settle(i, now_s, cfg, false);
                } else {
                    debug_assert!(false, "due entry of a replaced candidate");
                }
            }
            Due::Record(_) => {
                // The ring took the entry out; its link is stale.
                let far = rec.link.take().is_far();
                if far && wanted_deadline(rec, cfg).is_some_and(|d| d > now_s) {
                    // Set beyond the ring's window: not due yet.
                    self.ring.note_far_again();
                    self.settle(i, now_s, cfg, false);
                    return;
                }
                // An active record's deadline is its route's expiry (the ring keeps
                // the deadline its state asks for; `check_invariants`): the route is
                // due. Decided from the first line alone.
                if rec.is_active {
                    debug_assert!(
                        wanted_deadline(rec, cfg).is_some_and(|d| d <= now_s),
                        "an active record's deadline came before its route's"
                    );
                    rec.deactivate();
                    self.active -= 1;
                    stats.routes_expired += 1;
                    let u = rec.user;
                    // Orphaned (or waiting for its candidate): the retention deadline
                    // or none, a push into the ring.
                    self.settle(i, now_s, cfg, false);
                    // The identity (the record's second line) is read only when the
                    // uid has other endpoints.
                    let recs = &self.recs;
                    self.table.unpublish_one(dir, u, |e| {
                        let sess = &recs[i].sess;
                        (e.node_id, e.boot_id, e.session_id)
                            == (sess.node_id, sess.boot_id, sess.session_id)
                    });
                    self.note_presence(log, i, false);
                } else if rec.pending.is_none() && rec.retain_until_s.is_some_and(|d| d <= now_s) {
                    stats.fence_records_dropped += 1;
                    self.drop_record(dir, i);
                } else {
                    debug_assert!(false, "a record's deadline that its state did not ask for");
                    self.settle(i, now_s, cfg, false);
                }
            }
        }
    }

    /// Checks every invariant of this slot (tests and the simulation call it): the
    /// wheel and the ring, each user and record, the counts, and that the published
    /// view equals the active routes. Gives the first broken one, described.
    pub(super) fn check_invariants(
        &self,
        dir: &Directory,
        cfg: &AuthorityConfig,
    ) -> Result<(), String> {
        self.wheel.check_invariants()?;
        self.ring.check_invariants()?;
        if self.by_uid.len() != self.users.len {
            return Err(format!(
                "{} uids mapped, {} users",
                self.by_uid.len(),
                self.users.len
            ));
        }
        let mut tally = Tally::default();
        for (u, user) in self.users.iter() {
            self.check_user(u, user, cfg, &mut tally)?;
        }
        self.check_counts(&tally)?;
        self.check_published(dir, tally.active)
    }

    /// Checks user `u`: its uid maps to it and hashes to this slot, and its record list
    /// is as long as counted, each record checked and tallied; an active user is
    /// published. Gives the first broken invariant.
    pub(super) fn check_user(
        &self,
        u: u32,
        user: &User,
        cfg: &AuthorityConfig,
        tally: &mut Tally,
    ) -> Result<(), String> {
        let uid = &user.uid;
        if self.by_uid.get(uid) != Some(&u) {
            return Err(format!("uid {uid}: mapped to another user"));
        }
        if user.records == 0 {
            return Err(format!("uid {uid}: no record"));
        }
        if hash_slot(uid.as_bytes()) != self.target.hash_slot {
            return Err(format!("uid {uid} in the wrong slot"));
        }
        let mut listed = 0u32;
        let mut has_active = false;
        for (i, r) in self.records_of(u) {
            listed += 1;
            if listed > user.records {
                return Err(format!("uid {uid}: record list longer than counted"));
            }
            if r.user != u {
                return Err(format!("uid {uid}: record of another user listed"));
            }
            has_active |= r.active().is_some();
            self.check_record(i, r, uid, cfg, tally)?;
        }
        if listed != user.records {
            return Err(format!("uid {uid}: record list shorter than counted"));
        }
        if has_active && !self.table.has_entry(u) {
            return Err(format!("uid {uid}: active but not published"));
        }
        Ok(())
    }

    /// Checks record `i` of `uid` and adds it to `tally`: its tombstone, its active
    /// route's identity and owner_seq, its candidate's wheel entry, its retention, and
    /// the ring's deadline for its state. Gives the first broken invariant.
    pub(super) fn check_record(
        &self,
        i: u32,
        r: &Record,
        uid: &Uid,
        cfg: &AuthorityConfig,
        tally: &mut Tally,
    ) -> Result<(), String> {
        tally.records += 1;
        if let Some(t) = r.tombstone {
            if t > r.last_owner_seq {
                return Err(format!("{uid}: tombstone above last owner_seq"));
            }
        }
        let desired = if let Some(a) = r.active() {
            tally.active += 1;
            if a.route.uid != *uid || Sess::of_route(&a.route) != r.sess {
                return Err(format!("{uid}: route of another identity"));
            }
            if r.tombstoned(a.route.owner_seq) {
                return Err(format!("{uid}: active route at or below its tombstone"));
            }
            if a.route.owner_seq > r.last_owner_seq {
                return Err(format!("{uid}: route owner_seq above last owner_seq"));
            }
            route_deadline(a.route.last_active_s, cfg.route_ttl_s)
        } else if r.pending.is_some() {
            None
        } else {
            if r.retain_until_s.is_none() {
                return Err(format!("{uid}: orphan record without retention"));
            }
            r.retain_until_s
        };
        if let Some(p) = &r.pending {
            tally.pending += 1;
            tally.timers += 1;
            match self.wheel.get(p.timer) {
                Some(k)
                    if *k
                        == (PendingKey {
                            rec: i,
                            nonce: p.nonce,
                        }) => {}
                _ => return Err(format!("{uid}: candidate without its wheel entry")),
            }
        }
        if (r.is_active || r.pending.is_some()) && r.retain_until_s.is_some() {
            return Err(format!("{uid}: retention running while in use"));
        }
        if let Err(e) = self.ring.check_link(i, &r.link, desired) {
            return Err(format!("{uid}: {e}"));
        }
        tally.deadlines += usize::from(desired.is_some());
        Ok(())
    }

    /// Checks the slot's kept counts (records, active routes, candidates, wheel and
    /// ring entries) against `tally`. Gives the first that differs.
    pub(super) fn check_counts(&self, tally: &Tally) -> Result<(), String> {
        let Tally {
            active,
            pending,
            records,
            timers,
            deadlines,
        } = *tally;
        if records != self.recs.len {
            return Err(format!("{records} records listed, {} kept", self.recs.len));
        }
        if (active, pending) != (self.active, self.pending) {
            return Err(format!(
                "counts: counted {active}/{pending}, kept {}/{}",
                self.active, self.pending
            ));
        }
        if timers != self.wheel.len() {
            return Err(format!(
                "wheel holds {} entries, candidates need {timers}",
                self.wheel.len()
            ));
        }
        if deadlines != self.ring.len() {
            return Err(format!(
                "ring holds {} entries, records need {deadlines}",
                self.ring.len()
            ));
        }
        Ok(())
    }

    /// Checks that the published view of this slot is installed with its target and
    /// lists exactly each user's `active` routes, sorted. Gives the first difference.
    pub(super) fn check_published(&self, dir: &Directory, active: usize) -> Result<(), String> {
        // The published view equals the writer's active routes.
        let guard = crossbeam_epoch::pin();
        let Some(view) = dir.state(self.target.hash_slot as usize, &guard) else {
            return Err("installed slot not published".into());
        };
        if view.target != self.target {
            return Err("published target differs".into());
        }
        let mut published = 0usize;
        self.table.check(dir, |u, uid, eps| {
            let Some(user) = self.users.get(u) else {
                return Err(format!("published entry of {uid} owned by no user"));
            };
            if *user.uid != *uid {
                return Err(format!("published entry of {uid} owned by {}", user.uid));
            }
            let mut expect: Vec<&Route> = self
                .records_of(u)
                .filter_map(|(_, r)| r.active().map(|a| &a.route))
                .collect();
            expect.sort_unstable_by_key(|r| Sess::of_route(r));
            let expect: Vec<CompactEndpoint> = expect.into_iter().map(compact_of).collect();
            if expect.as_slice() != eps {
                return Err(format!("published endpoints of {uid} differ"));
            }
            published += eps.len();
            Ok(())
        })?;
        if published != active {
            return Err(format!(
                "published {published} endpoints, {active} active routes"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! `SlotWriter::check_invariants` is the net every authority test and simulation
    //! relies on: each test here breaks one invariant of a sound slot by hand and
    //! sees the checker name that one (a checker that passes everything, or misses
    //! one kind of damage, would make all those tests weaker than they look).
    use super::*;
    use crate::presence::route::{DeviceLevel, Transport};

    const NODE: NodeId = 1;
    const SLOT: HashSlot = 7;
    const T0: u64 = 1000;

    /// The first `n` uids (of the form `u<i>`) that hash to `SLOT`.
    fn uids(n: usize) -> Vec<Uid> {
        (0..)
            .map(|i| format!("u{i}"))
            .filter(|u| hash_slot(u.as_bytes()) == SLOT)
            .take(n)
            .map(Uid::from)
            .collect()
    }

    fn route(uid: &Uid, dev: &str, level: DeviceLevel, session: u64, seq: u64) -> Route {
        Route {
            uid: uid.clone(),
            device_id: dev.into(),
            device_flag: 1,
            device_level: level,
            node_id: 2,
            boot_id: 77,
            session_id: session,
            listener: Transport::Tcp,
            owner_seq: seq,
            connected_at_ms: 0,
            last_active_s: Some(T0),
        }
    }

    /// A sound slot: uid 0 with two active routes (sessions 1 and 2, one per
    /// device), uid 1 with an active route (session 3) and a candidate (session 4,
    /// a Master of another device: it conflicts), uid 2 with only a fence record
    /// (session 5, unregistered). Returns the authority, the slot's target and
    /// the uids.
    fn sound() -> (Authority, Target, Vec<Uid>) {
        let cfg = AuthorityConfig {
            route_ttl_s: 60,
            pending_ttl_s: 30,
            fence_retention_s: 300,
            ..AuthorityConfig::default()
        };
        let dir = Directory::new(&cfg).unwrap();
        let mut a = Authority::new(cfg, &dir, &[SLOT]).unwrap();
        assert!(a.apply_view(&ClusterView::single_node(NODE), NODE, T0));
        let t = ClusterView::single_node(NODE).target_for_slot(SLOT);
        let u = uids(3);
        let slave = DeviceLevel::Slave;
        assert_eq!(
            a.register_route(&t, route(&u[0], "a", slave, 1, 1), T0),
            Ok(RegisterOutcome::Active)
        );
        assert_eq!(
            a.register_route(&t, route(&u[0], "b", slave, 2, 1), T0),
            Ok(RegisterOutcome::Active)
        );
        assert_eq!(
            a.register_route(&t, route(&u[1], "a", slave, 3, 1), T0),
            Ok(RegisterOutcome::Active)
        );
        let master = route(&u[1], "b", DeviceLevel::Master, 4, 1);
        assert!(matches!(
            a.register_route(&t, master, T0),
            Ok(RegisterOutcome::Pending { .. })
        ));
        let fenced = route(&u[2], "a", slave, 5, 1);
        assert_eq!(
            a.register_route(&t, fenced.clone(), T0),
            Ok(RegisterOutcome::Active)
        );
        assert_eq!(a.unregister_route(&t, &fenced.identity(), 1, T0), Ok(true));
        assert_eq!(a.check_invariants(), Ok(()));
        (a, t, u)
    }

    /// The writer of `SLOT`, the directory, and the index of `uid`'s record of
    /// `session`.
    fn record<'a>(a: &'a mut Authority, uid: &Uid, session: u64) -> (&'a mut SlotWriter, u32) {
        let w = a.slots[SLOT as usize].as_deref_mut().unwrap();
        let sess = Sess {
            node_id: 2,
            boot_id: 77,
            session_id: session,
        };
        let i = w.record_of(uid, sess).unwrap();
        (w, i)
    }

    /// Checks `a`, expecting the error that contains `what`.
    fn broken(a: &Authority, what: &str) {
        match a.check_invariants() {
            Ok(()) => panic!("damage not found (expected {what:?})"),
            Err(e) => assert!(e.contains(what), "{e:?} does not name {what:?}"),
        }
    }

    #[test]
    fn a_wrong_count_of_active_routes_or_candidates_is_found() {
        let (mut a, ..) = sound();
        a.slots[SLOT as usize].as_deref_mut().unwrap().active += 1;
        broken(&a, "counts: counted 3/1, kept 4/1");
        let (mut a, ..) = sound();
        a.slots[SLOT as usize].as_deref_mut().unwrap().pending -= 1;
        broken(&a, "counts: counted 3/1, kept 3/0");
    }

    #[test]
    fn a_tombstone_above_the_last_owner_seq_is_found() {
        let (mut a, _, u) = sound();
        let (w, i) = record(&mut a, &u[2], 5);
        w.recs[i].tombstone = Some(w.recs[i].last_owner_seq + 1);
        broken(&a, "tombstone above last owner_seq");
    }

    #[test]
    fn an_active_route_above_the_last_owner_seq_is_found() {
        let (mut a, _, u) = sound();
        let (w, i) = record(&mut a, &u[0], 2);
        w.recs[i].route.as_mut().unwrap().route.owner_seq += 1;
        broken(&a, "route owner_seq above last owner_seq");
    }

    #[test]
    fn an_active_route_of_another_session_is_found() {
        let (mut a, _, u) = sound();
        let (w, i) = record(&mut a, &u[0], 1);
        w.recs[i].route.as_mut().unwrap().route.session_id = 9;
        broken(&a, "route of another identity");
    }

    #[test]
    fn a_candidate_whose_wheel_entry_names_another_nonce_is_found() {
        let (mut a, _, u) = sound();
        let (w, i) = record(&mut a, &u[1], 4);
        w.recs[i].pending.as_mut().unwrap().nonce += 100;
        broken(&a, "candidate without its wheel entry");
    }

    #[test]
    fn a_retention_running_beside_an_active_route_is_found() {
        let (mut a, _, u) = sound();
        let (w, i) = record(&mut a, &u[0], 1);
        w.recs[i].retain_until_s = Some(T0 + 300);
        broken(&a, "retention running while in use");
    }

    #[test]
    fn an_active_user_without_a_published_entry_is_found() {
        let (mut a, _, u) = sound();
        let dir = a.dir.clone();
        let (w, i) = record(&mut a, &u[1], 3);
        let user = w.recs[i].user;
        w.table.publish(&dir, user, &u[1], &[]);
        w.table.release(&dir, user);
        broken(&a, "active but not published");
    }

    #[test]
    fn published_endpoints_that_differ_from_the_active_routes_are_found() {
        let (mut a, _, u) = sound();
        let dir = a.dir.clone();
        let (w, i) = record(&mut a, &u[0], 1);
        let user = w.recs[i].user;
        let one = compact_of(&w.recs[i].route.as_ref().unwrap().route);
        w.table.publish(&dir, user, &u[0], &[one]);
        broken(&a, "published endpoints of");
    }
}
