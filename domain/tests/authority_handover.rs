//! A moved hash slot's handover (issue "Cluster defects found in a review…",
//! item 7): the old authority hands its routes and tombstones over, the new one
//! answers lookups `Rebuilding` until they came (or `handover_wait_s` passed).
//! Two nodes, each with its own directory, one writer of every hash slot each;
//! the test carries the batches.

use domain::cluster::{ClusterView, HashSlot, NodeId, Target};
use domain::presence::authority::{
    Authority, AuthorityConfig, Directory, Handover, HandoverBatch, HandoverOutcome,
};
use domain::presence::route::{
    AuthorityError, DeviceLevel, Endpoint, RegisterOutcome, Route, RouteIdentity, Transport, Uid,
};
use slots::{hash_slot, HASH_SLOTS};

const T0: u64 = 1_000;
const WAIT_S: u64 = 2;

fn authority() -> Authority {
    authority_waiting(WAIT_S)
}

/// A writer of every hash slot that waits `wait_s` for a handover.
fn authority_waiting(wait_s: u64) -> Authority {
    let cfg = AuthorityConfig {
        handover_wait_s: wait_s,
        handover_stash_routes_max: 4,
        ..AuthorityConfig::default()
    };
    let dir = Directory::new(&cfg).unwrap();
    let slots: Vec<HashSlot> = (0..HASH_SLOTS as HashSlot).collect();
    Authority::new(cfg, &dir, &slots).unwrap()
}

/// A session of node 3's gateway: the uid `uid`, session `session`.
fn route(uid: &str, session: u64) -> Route {
    Route {
        uid: Uid::from(uid),
        device_id: format!("d{session}").into(),
        device_flag: 1,
        device_level: DeviceLevel::Master,
        node_id: 3,
        boot_id: 77,
        session_id: session,
        listener: Transport::Tcp,
        owner_seq: 1,
        connected_at_ms: 0,
        last_active_s: Some(T0),
    }
}

/// Two uids of one hash slot led by node 1 in the first view.
fn two_uids(view: &ClusterView) -> (String, String, HashSlot) {
    let mut of_slot = (0..)
        .map(|i| format!("u{i}"))
        .filter(|u| view.target_for_uid(u).leader_node_id == 1);
    let a = of_slot.next().unwrap();
    let h = hash_slot(a.as_bytes());
    let b = (0..)
        .map(|i| format!("v{i}"))
        .find(|u| hash_slot(u.as_bytes()) == h)
        .unwrap();
    (a, b, h)
}

/// What a lookup of `uid` at `target` on `a` answers: its sessions, or why not.
fn lookup(a: &Authority, target: Target, uid: &str) -> Result<Vec<u64>, AuthorityError> {
    let uids = [Uid::from(uid)];
    let found = a.reader().endpoints_by_targets(&[(target, &uids)]);
    let eps: Vec<Endpoint> = found.into_iter().next().unwrap()?;
    Ok(eps.iter().map(|e| e.session_id).collect())
}

/// A whole handover in one batch for `target`: `routes`, no tombstones.
fn one_batch(target: Target, routes: Vec<Route>) -> HandoverBatch {
    HandoverBatch {
        target,
        routes,
        tombstones: Vec::new(),
        batch: 0,
        batches: 1,
    }
}

fn register(a: &mut Authority, view: &ClusterView, r: Route) {
    let t = view.target_for_uid(&r.uid);
    let out = a.register_route(&t, r, T0).unwrap();
    assert_eq!(out, RegisterOutcome::Active);
}

fn taken(a: &mut Authority) -> Vec<Handover> {
    let mut out = Vec::new();
    a.take_handovers(&mut out);
    out
}

struct Pair {
    one: Authority,
    two: Authority,
    view: ClusterView,
    moved: ClusterView,
    uids: (String, String),
    slot: HashSlot,
}

/// Nodes 1 and 2 on the first view; node 1 holds two sessions of one slot; the
/// slot moves to node 2 (through node 1).
fn moved_pair() -> Pair {
    let view = ClusterView::initial(&[1, 2], 256).unwrap();
    let (mut one, mut two) = (authority(), authority());
    assert!(one.apply_view(&view, 1, T0) && two.apply_view(&view, 2, T0));
    let (a, b, slot) = two_uids(&view);
    register(&mut one, &view, route(&a, 10));
    register(&mut one, &view, route(&b, 11));
    let moved = view.with_leaders(1, &[(slot, 2)]);
    Pair {
        one,
        two,
        view,
        moved,
        uids: (a, b),
        slot,
    }
}

#[test]
fn a_moved_slot_answers_rebuilding_until_every_batch_of_its_handover_came() {
    let mut p = moved_pair();
    let new = p.moved.target_for_slot(p.slot);
    assert!(p.two.apply_view(&p.moved, 2, T0 + 1));
    assert!(p.two.is_waiting_for_handover(p.slot));
    let (a, b) = p.uids.clone();
    assert_eq!(lookup(&p.two, new, &a), Err(AuthorityError::Rebuilding));
    assert!(p.one.apply_view(&p.moved, 1, T0 + 1));
    let handovers = taken(&mut p.one);
    assert_eq!(handovers.len(), 1, "one handover, of the one slot lost");
    assert_eq!(handovers[0].target, new);
    assert_eq!(handovers[0].routes.len(), 2);
    let batches = handovers.into_iter().next().unwrap().into_batches(1);
    assert_eq!(batches.len(), 2);
    let mut batches = batches.into_iter();
    let first = batches.next().unwrap();
    assert_eq!(
        p.two.take_handover(first.clone(), T0 + 1),
        Ok(HandoverOutcome::Applied { done: false })
    );
    assert_eq!(lookup(&p.two, new, &a), Err(AuthorityError::Rebuilding));
    // A batch carried twice counts once.
    assert_eq!(
        p.two.take_handover(first, T0 + 1),
        Ok(HandoverOutcome::Applied { done: false })
    );
    let second = batches.next().unwrap();
    assert_eq!(
        p.two.take_handover(second, T0 + 1),
        Ok(HandoverOutcome::Applied { done: true })
    );
    assert!(!p.two.is_waiting_for_handover(p.slot));
    assert_eq!(lookup(&p.two, new, &a), Ok(vec![10]));
    assert_eq!(lookup(&p.two, new, &b), Ok(vec![11]));
    assert_eq!(p.two.stats().handover_routes, 3);
    assert_eq!(
        lookup(&p.one, p.view.target_for_slot(p.slot), &a),
        Err(AuthorityError::NotLeader),
        "the old leader holds nothing of it"
    );
}

#[test]
fn a_slot_without_routes_is_handed_over_as_one_empty_batch() {
    let mut p = moved_pair();
    let other = (0..HASH_SLOTS as HashSlot)
        .find(|&h| h != p.slot && p.view.target_for_slot(h).leader_node_id == 1)
        .unwrap();
    let moved = p.view.with_leaders(1, &[(other, 2)]);
    assert!(p.one.apply_view(&moved, 1, T0));
    let h = taken(&mut p.one);
    let batches = h.into_iter().next().unwrap().into_batches(8);
    assert_eq!(batches.len(), 1);
    assert_eq!((batches[0].batch, batches[0].batches), (0, 1));
    assert!(batches[0].routes.is_empty());
    assert!(p.two.apply_view(&moved, 2, T0));
    assert!(p.two.is_waiting_for_handover(other));
    let b = batches.into_iter().next().unwrap();
    assert_eq!(
        p.two.take_handover(b, T0),
        Ok(HandoverOutcome::Applied { done: true })
    );
    assert!(!p.two.is_waiting_for_handover(other));
}

#[test]
fn a_handover_that_never_comes_ends_the_wait_at_handover_wait_s() {
    let mut p = moved_pair();
    let new = p.moved.target_for_slot(p.slot);
    assert!(p.two.apply_view(&p.moved, 2, T0));
    let a = p.uids.0.clone();
    p.two.expire(T0 + WAIT_S - 1);
    assert_eq!(lookup(&p.two, new, &a), Err(AuthorityError::Rebuilding));
    p.two.expire(T0 + WAIT_S);
    assert_eq!(
        lookup(&p.two, new, &a),
        Ok(vec![]),
        "served, from what it has"
    );
    assert_eq!(p.two.stats().handover_waits_expired, 1);
    // Late, its routes are not applied (they could be older than an unregister
    // since); it is answered.
    assert!(p.one.apply_view(&p.moved, 1, T0 + 5));
    let batch = taken(&mut p.one).remove(0).into_batches(8).remove(0);
    assert_eq!(
        p.two.take_handover(batch, T0 + 5),
        Ok(HandoverOutcome::Applied { done: true })
    );
    assert_eq!(lookup(&p.two, new, &a), Ok(vec![]));
    assert_eq!(p.two.stats().handovers_ignored, 1);
}

#[test]
fn the_first_view_and_a_move_to_the_same_node_do_not_wait() {
    let mut p = moved_pair();
    // Start-up: node 2 applies the moved view first (a view saved before a crash).
    let mut fresh = authority();
    assert!(fresh.apply_view(&p.moved, 2, T0));
    assert!(!fresh.is_waiting_for_handover(p.slot));
    // A move of the slot to node 1 itself: a new term, the same routes, no wait.
    let again = p.view.with_leaders(2, &[(p.slot, 1)]);
    let t = again.target_for_slot(p.slot);
    assert!(t.leader_term > p.view.target_for_slot(p.slot).leader_term);
    assert!(p.one.apply_view(&again, 1, T0 + 1));
    assert!(!p.one.is_waiting_for_handover(p.slot));
    assert!(taken(&mut p.one).is_empty());
    assert_eq!(lookup(&p.one, t, &p.uids.0), Ok(vec![10]));
    assert_eq!(lookup(&p.one, t, &p.uids.1), Ok(vec![11]));
}

/// `handover_wait_s` 0 is the node before handovers: a slot gained from another
/// node answers from its table at once (no wait), and a move of a slot to the
/// node that leads it starts it empty.
#[test]
fn without_a_handover_wait_nothing_waits_and_a_move_to_itself_starts_empty() {
    let view = ClusterView::initial(&[1, 2], 256).unwrap();
    let (mut one, mut two) = (authority_waiting(0), authority_waiting(0));
    assert!(one.apply_view(&view, 1, T0) && two.apply_view(&view, 2, T0));
    let (a, _, slot) = two_uids(&view);
    register(&mut one, &view, route(&a, 10));
    let moved = view.with_leaders(1, &[(slot, 2)]);
    assert!(two.apply_view(&moved, 2, T0 + 1));
    assert!(!two.is_waiting_for_handover(slot));
    assert_eq!(lookup(&two, moved.target_for_slot(slot), &a), Ok(vec![]));
    // Node 1 keeps the slot at a new term (a move made through node 2).
    let again = view.with_leaders(2, &[(slot, 1)]);
    assert!(one.apply_view(&again, 1, T0 + 1));
    assert!(!one.is_waiting_for_handover(slot));
    assert_eq!(lookup(&one, again.target_for_slot(slot), &a), Ok(vec![]));
    assert!(taken(&mut one).is_empty());
}

/// A slot that comes back to this node from a move it missed (it still holds the
/// identity it had) waits for the handover of the node it comes back from: that
/// node led it in between.
#[test]
fn a_slot_back_from_a_move_this_node_missed_waits_for_the_leader_between() {
    let mut p = moved_pair();
    assert!(p.two.apply_view(&p.moved, 2, T0));
    // Node 1 never applied `moved`; the slot comes back to it from node 2.
    let back = p.moved.with_leaders(2, &[(p.slot, 1)]);
    let t = back.target_for_slot(p.slot);
    assert!(p.one.identity(p.slot).is_some());
    assert!(p.one.apply_view(&back, 1, T0 + 1));
    assert!(p.one.is_waiting_for_handover(p.slot));
    assert_eq!(
        lookup(&p.one, t, &p.uids.0),
        Err(AuthorityError::Rebuilding)
    );
    p.one.expire(T0 + 1 + WAIT_S);
    assert!(!p.one.is_waiting_for_handover(p.slot));
    assert_eq!(p.one.stats().handover_waits_expired, 1);
    // The routes it held are not carried over: they were node 2's to give.
    assert_eq!(lookup(&p.one, t, &p.uids.0), Ok(vec![]));
}

#[test]
fn a_batch_that_comes_before_its_view_is_kept_and_applied_at_install() {
    let mut p = moved_pair();
    let new = p.moved.target_for_slot(p.slot);
    assert!(p.one.apply_view(&p.moved, 1, T0));
    let batch = taken(&mut p.one).remove(0).into_batches(8).remove(0);
    assert_eq!(p.two.take_handover(batch, T0), Ok(HandoverOutcome::Kept));
    assert!(p.two.apply_view(&p.moved, 2, T0));
    assert!(
        !p.two.is_waiting_for_handover(p.slot),
        "everything had come"
    );
    assert_eq!(lookup(&p.two, new, &p.uids.0), Ok(vec![10]));
}

#[test]
fn batches_kept_for_a_view_are_bounded_and_dropped_after_the_wait() {
    let mut p = moved_pair();
    let new = p.moved.target_for_slot(p.slot);
    let batch = |routes: Vec<Route>| one_batch(new, routes);
    let (a, _) = p.uids.clone();
    let four: Vec<Route> = (0..4).map(|i| route(&a, 20 + i)).collect();
    assert_eq!(
        p.two.take_handover(batch(four), T0),
        Ok(HandoverOutcome::Kept)
    );
    assert_eq!(
        p.two.take_handover(batch(vec![route(&a, 30)]), T0),
        Err(AuthorityError::Full),
        "handover_stash_routes_max = 4"
    );
    p.two.expire(T0 + WAIT_S);
    assert_eq!(
        p.two.take_handover(batch(vec![route(&a, 30)]), T0 + WAIT_S),
        Ok(HandoverOutcome::Kept),
        "the old ones were dropped"
    );
}

#[test]
fn a_batch_for_an_older_identity_of_another_leader_is_refused() {
    let mut p = moved_pair();
    assert!(p.two.apply_view(&p.moved, 2, T0));
    let back = p.moved.with_leaders(2, &[(p.slot, 1)]);
    assert!(p.one.apply_view(&p.moved, 1, T0));
    assert!(p.one.apply_view(&back, 1, T0));
    let old = one_batch(p.moved.target_for_slot(p.slot), vec![]);
    assert_eq!(
        p.one.take_handover(old, T0),
        Err(AuthorityError::StaleTarget)
    );
}

/// The leader that missed a term (node 1 led, missed the move to node 2 and the
/// move back) keeps its own routes; the tombstones of node 2's handover remove
/// the session unregistered at node 2 meanwhile, though node 1 waits for no
/// handover (a move back to itself).
#[test]
fn tombstones_apply_even_where_no_handover_is_awaited() {
    let mut p = moved_pair();
    let (a, _) = p.uids.clone();
    assert!(p.two.apply_view(&p.moved, 2, T0));
    // Node 2 serves while node 1 is cut off: session 10 is unregistered there.
    p.two.expire(T0 + WAIT_S);
    let new = p.moved.target_for_slot(p.slot);
    let id = RouteIdentity {
        uid: Uid::from(a.as_str()),
        node_id: 3,
        boot_id: 77,
        session_id: 10,
    };
    p.two.unregister_route(&new, &id, 2, T0 + WAIT_S).unwrap();
    // The slot goes back to node 1, made by node 1's own view (it never saw
    // node 2's term): a move to itself, its routes kept, session 10's with them.
    let back = p.view.with_leaders(1, &[(p.slot, 1)]);
    let back = ClusterView {
        revision: p.moved.revision + 1,
        ..back
    };
    assert!(p.one.apply_view(&back, 1, T0 + 3));
    let t = back.target_for_slot(p.slot);
    assert_eq!(lookup(&p.one, t, &a), Ok(vec![10]), "a ghost, until…");
    // …node 2 hands over on the same view: its tombstone removes the ghost.
    assert!(p.two.apply_view(&back, 2, T0 + 3));
    let h = taken(&mut p.two).remove(0);
    assert_eq!(h.tombstones, vec![(id, 2)]);
    let batch = h.into_batches(8).remove(0);
    assert_eq!(
        p.one.take_handover(batch, T0 + 3),
        Ok(HandoverOutcome::Applied { done: true })
    );
    assert_eq!(lookup(&p.one, t, &a), Ok(vec![]));
}

/// A slot lost while it still waited (1 → 2 → 3 before node 1's handover reached
/// node 2) is relayed: node 3 gets node 1's routes from node 2 once they came,
/// and not a session node 2 saw unregistered.
#[test]
fn a_slot_lost_while_waiting_is_relayed_with_what_comes_after() {
    let view = ClusterView::initial(&[1, 2, 3], 256).unwrap();
    let (mut one, mut two, mut three) = (authority(), authority(), authority());
    for (a, n) in [(&mut one, 1), (&mut two, 2), (&mut three, 3)] {
        assert!(a.apply_view(&view, n as NodeId, T0));
    }
    let (a, b, slot) = two_uids(&view);
    register(&mut one, &view, route(&a, 10));
    register(&mut one, &view, route(&b, 11));
    let to_two = view.with_leaders(1, &[(slot, 2)]);
    let to_three = to_two.with_leaders(2, &[(slot, 3)]);
    assert!(two.apply_view(&to_two, 2, T0));
    // At node 2, session 11 is unregistered before node 1's handover came.
    let t2 = to_two.target_for_slot(slot);
    let id11 = RouteIdentity {
        uid: Uid::from(b.as_str()),
        node_id: 3,
        boot_id: 77,
        session_id: 11,
    };
    two.unregister_route(&t2, &id11, 2, T0).unwrap();
    assert!(two.apply_view(&to_three, 2, T0));
    assert!(taken(&mut two).is_empty(), "relayed: nothing yet");
    assert!(three.apply_view(&to_two, 3, T0) && three.apply_view(&to_three, 3, T0));
    assert!(three.is_waiting_for_handover(slot));
    assert!(one.apply_view(&to_two, 1, T0));
    let batch = taken(&mut one).remove(0).into_batches(8).remove(0);
    assert_eq!(two.take_handover(batch, T0), Ok(HandoverOutcome::Relayed));
    let relayed = taken(&mut two);
    assert_eq!(relayed.len(), 1);
    assert_eq!(relayed[0].target, to_three.target_for_slot(slot));
    assert_eq!(two.stats().handovers_relayed, 1);
    let batch = relayed
        .into_iter()
        .next()
        .unwrap()
        .into_batches(8)
        .remove(0);
    assert_eq!(
        three.take_handover(batch, T0),
        Ok(HandoverOutcome::Applied { done: true })
    );
    let t3 = to_three.target_for_slot(slot);
    assert_eq!(lookup(&three, t3, &a), Ok(vec![10]));
    assert_eq!(lookup(&three, t3, &b), Ok(vec![]), "unregistered at node 2");
}

/// A handover's routes and tombstones share the batches: at most `items_max`
/// items in each, every item in one.
#[test]
fn a_handover_is_cut_into_batches_of_routes_and_tombstones() {
    let view = ClusterView::initial(&[1, 2], 256).unwrap();
    let (a, _, slot) = two_uids(&view);
    let id = |s: u64| RouteIdentity {
        uid: Uid::from(a.as_str()),
        node_id: 3,
        boot_id: 77,
        session_id: s,
    };
    let h = Handover {
        target: view.target_for_slot(slot),
        routes: (0..3).map(|s| route(&a, s)).collect(),
        tombstones: (10..15).map(|s| (id(s), 1)).collect(),
    };
    let batches = h.into_batches(3);
    let sizes: Vec<(usize, usize)> = (batches.iter())
        .map(|b| (b.routes.len(), b.tombstones.len()))
        .collect();
    assert_eq!(sizes, vec![(3, 0), (0, 3), (0, 2)]);
    assert!(batches
        .iter()
        .enumerate()
        .all(|(i, b)| b.batch == i as u32 && b.batches == 3));
    let h = Handover {
        target: view.target_for_slot(slot),
        routes: (0..2).map(|s| route(&a, s)).collect(),
        tombstones: (10..12).map(|s| (id(s), 1)).collect(),
    };
    let sizes: Vec<(usize, usize)> = (h.into_batches(3).iter())
        .map(|b| (b.routes.len(), b.tombstones.len()))
        .collect();
    assert_eq!(sizes, vec![(2, 1), (0, 1)]);
}

/// Kept batches count their tombstones too (an empty one counts 1) against
/// `handover_stash_routes_max`, and a slot's install takes only its own.
#[test]
fn kept_batches_count_tombstones_and_an_install_takes_only_its_slots() {
    let mut p = moved_pair();
    let new = p.moved.target_for_slot(p.slot);
    let other = (0..HASH_SLOTS as HashSlot)
        .find(|&h| h != p.slot && p.view.target_for_slot(h).leader_node_id == 1)
        .unwrap();
    let moved_too = p.moved.with_leaders(1, &[(other, 2)]);
    let other_t = moved_too.target_for_slot(other);
    let (a, _) = p.uids.clone();
    let id = RouteIdentity {
        uid: Uid::from(a.as_str()),
        node_id: 3,
        boot_id: 77,
        session_id: 99,
    };
    let empty = |target| one_batch(target, vec![]);
    let tombs = HandoverBatch {
        tombstones: vec![(id.clone(), 1), (id.clone(), 2)],
        ..empty(new)
    };
    assert_eq!(p.two.take_handover(tombs, T0), Ok(HandoverOutcome::Kept));
    assert_eq!(
        p.two.take_handover(empty(other_t), T0),
        Ok(HandoverOutcome::Kept)
    );
    // 2 tombstones + 1 empty batch = 3 of 4.
    let two_routes = HandoverBatch {
        routes: vec![route(&a, 40), route(&a, 41)],
        ..empty(other_t)
    };
    assert_eq!(
        p.two.take_handover(two_routes.clone(), T0),
        Err(AuthorityError::Full)
    );
    // The first slot's install takes its batch (2 items); the other's stays kept.
    assert!(p.two.apply_view(&p.moved, 2, T0));
    assert!(!p.two.is_waiting_for_handover(p.slot));
    assert_eq!(
        p.two.take_handover(two_routes.clone(), T0),
        Ok(HandoverOutcome::Kept),
        "1 + 2 of 4"
    );
    assert_eq!(
        p.two.take_handover(two_routes, T0),
        Err(AuthorityError::Full),
        "the other slot's batches are still counted"
    );
}

/// The slot moves to node 2, then to node 2 again (a new term) before node 1's
/// handover came: node 2 goes on waiting, and node 1's batches, addressed to the
/// first term, end the wait.
#[test]
fn a_move_to_a_node_that_still_waits_goes_on_waiting() {
    let mut p = moved_pair();
    assert!(p.two.apply_view(&p.moved, 2, T0));
    let again = p.moved.with_leaders(1, &[(p.slot, 2)]);
    assert!(p.two.apply_view(&again, 2, T0));
    assert!(p.two.is_waiting_for_handover(p.slot));
    let t = again.target_for_slot(p.slot);
    assert_eq!(
        lookup(&p.two, t, &p.uids.0),
        Err(AuthorityError::Rebuilding)
    );
    assert!(p.one.apply_view(&p.moved, 1, T0));
    let batch = taken(&mut p.one).remove(0).into_batches(8).remove(0);
    assert_eq!(batch.target, p.moved.target_for_slot(p.slot));
    assert_eq!(
        p.two.take_handover(batch, T0),
        Ok(HandoverOutcome::Applied { done: true })
    );
    assert_eq!(lookup(&p.two, t, &p.uids.0), Ok(vec![10]));
}

/// ... and it is the same wait: for the node it came from, ending when the first
/// one would have (not a new wait for itself from the move on).
#[test]
fn a_move_to_a_node_that_still_waits_keeps_the_wait_it_had() {
    let mut p = moved_pair();
    assert!(p.two.apply_view(&p.moved, 2, T0));
    let again = p.moved.with_leaders(1, &[(p.slot, 2)]);
    assert!(p.two.apply_view(&again, 2, T0 + 1));
    assert!(p.two.is_waiting_for_handover(p.slot));
    assert_eq!(
        p.two.end_waits_from(2),
        0,
        "it waits for node 1, not itself"
    );
    assert!(p.two.is_waiting_for_handover(p.slot));
    p.two.expire(T0 + WAIT_S);
    assert!(
        !p.two.is_waiting_for_handover(p.slot),
        "ended at T0 + WAIT_S"
    );
    assert_eq!(p.two.stats().handover_waits_expired, 1);
}

/// A batch naming this slot at the installed term but another leader is no
/// handover to this node: refused, not kept.
#[test]
fn a_batch_for_another_leader_at_the_installed_term_is_refused() {
    let mut p = moved_pair();
    assert!(p.two.apply_view(&p.moved, 2, T0));
    let mine = p.moved.target_for_slot(p.slot);
    let other = Target {
        leader_node_id: 1,
        ..mine
    };
    let batch = one_batch(other, vec![]);
    assert_eq!(
        p.two.take_handover(batch, T0),
        Err(AuthorityError::StaleTarget)
    );
}

/// Batches kept for an identity this node never installed (the view that gave it
/// the slot was overtaken by one that took it on to node 3) are relayed to node
/// 3, which waits for them.
#[test]
fn batches_kept_for_an_identity_never_installed_are_relayed_on() {
    let view = ClusterView::initial(&[1, 2, 3], 256).unwrap();
    let (mut one, mut two, mut three) = (authority(), authority(), authority());
    for (a, n) in [(&mut one, 1), (&mut two, 2), (&mut three, 3)] {
        assert!(a.apply_view(&view, n as NodeId, T0));
    }
    let (a, _, slot) = two_uids(&view);
    register(&mut one, &view, route(&a, 10));
    let to_two = view.with_leaders(1, &[(slot, 2)]);
    let to_three = to_two.with_leaders(3, &[(slot, 3)]);
    assert!(one.apply_view(&to_two, 1, T0));
    let batch = taken(&mut one).remove(0).into_batches(8).remove(0);
    assert_eq!(two.take_handover(batch, T0), Ok(HandoverOutcome::Kept));
    // Node 2 never gets the view of its term: the next one takes the slot on.
    assert!(two.apply_view(&to_three, 2, T0));
    let relayed = taken(&mut two);
    assert_eq!(relayed.len(), 1, "complete: handed on at once");
    assert_eq!(relayed[0].target, to_three.target_for_slot(slot));
    assert!(three.apply_view(&to_three, 3, T0));
    assert!(three.is_waiting_for_handover(slot), "taken from node 2");
    let batch = relayed
        .into_iter()
        .next()
        .unwrap()
        .into_batches(8)
        .remove(0);
    assert_eq!(
        three.take_handover(batch, T0),
        Ok(HandoverOutcome::Applied { done: true })
    );
    assert_eq!(
        lookup(&three, to_three.target_for_slot(slot), &a),
        Ok(vec![10])
    );
}

/// A relay ends when its slot comes back to this node (its routes are as old as
/// this node's leadership): nothing is handed over when its wait runs out.
#[test]
fn a_relay_is_dropped_when_its_slot_comes_back() {
    let view = ClusterView::initial(&[1, 2, 3], 256).unwrap();
    let mut two = authority();
    assert!(two.apply_view(&view, 2, T0));
    let (_, _, slot) = two_uids(&view);
    let to_two = view.with_leaders(1, &[(slot, 2)]);
    let to_three = to_two.with_leaders(2, &[(slot, 3)]);
    let back = to_three.with_leaders(3, &[(slot, 2)]);
    assert!(two.apply_view(&to_two, 2, T0));
    assert!(two.apply_view(&to_three, 2, T0));
    assert!(taken(&mut two).is_empty(), "relayed, waiting");
    assert!(two.apply_view(&back, 2, T0));
    assert!(two.is_waiting_for_handover(slot), "node 3's routes awaited");
    two.expire(T0 + WAIT_S);
    assert!(taken(&mut two).is_empty(), "the relay was dropped");
    assert_eq!(two.stats().handovers_relayed, 0);
}

/// Two losses of one slot before the driver takes the handovers: only the
/// newest is handed over (one per slot waits).
#[test]
fn only_the_newest_handover_of_a_slot_waits_for_the_driver() {
    let mut p = moved_pair();
    let back = p.moved.with_leaders(1, &[(p.slot, 1)]);
    let again = back.with_leaders(1, &[(p.slot, 2)]);
    assert!(p.one.apply_view(&p.moved, 1, T0));
    assert!(p.one.apply_view(&back, 1, T0));
    p.one.expire(T0 + WAIT_S);
    assert!(p.one.apply_view(&again, 1, T0 + WAIT_S));
    let h = taken(&mut p.one);
    assert_eq!(h.len(), 1);
    assert_eq!(h[0].target, again.target_for_slot(p.slot));
}

/// A relay whose handover never comes is handed on with what it had when its
/// wait runs out, not a second before.
#[test]
fn a_relay_is_handed_on_when_its_wait_runs_out() {
    let view = ClusterView::initial(&[1, 2, 3], 256).unwrap();
    let mut two = authority();
    assert!(two.apply_view(&view, 2, T0));
    let (a, _, slot) = two_uids(&view);
    let to_two = view.with_leaders(1, &[(slot, 2)]);
    let to_three = to_two.with_leaders(2, &[(slot, 3)]);
    assert!(two.apply_view(&to_two, 2, T0));
    register(&mut two, &to_two, route(&a, 10));
    assert!(two.apply_view(&to_three, 2, T0));
    two.expire(T0 + WAIT_S - 1);
    assert!(taken(&mut two).is_empty(), "still gathering");
    two.expire(T0 + WAIT_S);
    let h = taken(&mut two);
    assert_eq!(h.len(), 1);
    assert_eq!(h[0].target, to_three.target_for_slot(slot));
    let sessions: Vec<u64> = h[0].routes.iter().map(|r| r.session_id).collect();
    assert_eq!(sessions, vec![10]);
    assert_eq!(two.stats().handovers_relayed, 1);
    assert_eq!(two.stats().handover_waits_expired, 0, "no wait of its own");
    two.expire(T0 + 2 * WAIT_S);
    assert!(taken(&mut two).is_empty(), "handed on once");
}

/// A kept batch lives `handover_wait_s`: kept (and counted) a second before,
/// dropped at it.
#[test]
fn a_kept_batch_lives_handover_wait_s() {
    let mut p = moved_pair();
    let new = p.moved.target_for_slot(p.slot);
    let (a, _) = p.uids.clone();
    let batch = |routes: Vec<Route>| one_batch(new, routes);
    let four: Vec<Route> = (0..4).map(|i| route(&a, 20 + i)).collect();
    assert_eq!(
        p.two.take_handover(batch(four), T0),
        Ok(HandoverOutcome::Kept)
    );
    p.two.expire(T0 + WAIT_S - 1);
    assert_eq!(
        p.two
            .take_handover(batch(vec![route(&a, 30)]), T0 + WAIT_S - 1),
        Err(AuthorityError::Full),
        "still kept"
    );
    p.two.expire(T0 + WAIT_S);
    assert_eq!(
        p.two.take_handover(batch(vec![route(&a, 30)]), T0 + WAIT_S),
        Ok(HandoverOutcome::Kept)
    );
}

/// A slot taken from a node the driver finds unreachable stops waiting for its
/// handover at once; waits for other nodes' handovers go on.
#[test]
fn waits_for_an_unreachable_node_end_at_once() {
    let mut p = moved_pair();
    assert!(p.two.apply_view(&p.moved, 2, T0));
    assert!(p.two.is_waiting_for_handover(p.slot));
    assert_eq!(p.two.end_waits_from(3), 0, "not waiting for node 3");
    assert!(p.two.is_waiting_for_handover(p.slot));
    assert_eq!(p.two.end_waits_from(1), 1);
    assert!(!p.two.is_waiting_for_handover(p.slot));
    let t = p.moved.target_for_slot(p.slot);
    assert_eq!(
        lookup(&p.two, t, &p.uids.0),
        Ok(vec![]),
        "served from what it has"
    );
    assert_eq!(p.two.stats().handover_waits_expired, 1);
}
