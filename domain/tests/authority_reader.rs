//! The reader's lookup forms (compact, full, hashed, owned) against one another, its
//! per-call uid budget at and past its edge, the identities it reads and its filter
//! counts.

use std::ops::Range;

use domain::cluster::{ClusterView, HashSlot, Target};
use domain::presence::authority::{
    uid_hash, Authority, AuthorityConfig, AuthorityReader, Directory, HashedGroup,
};
use domain::presence::route::{
    AuthorityError, CompactEndpoint, DeviceLevel, Endpoint, RegisterOutcome, Route, Transport, Uid,
};
use slots::{hash_slot, HASH_SLOTS};

const NODE: u64 = 1;
const T0: u64 = 1000;
const A: HashSlot = 3;
const B: HashSlot = 200;

type Results = Vec<Result<Range<usize>, AuthorityError>>;

/// One writer owning every hash slot, before any view (nothing published yet).
fn writer(lookup_uids_max: usize) -> Authority {
    let cfg = AuthorityConfig {
        lookup_uids_max,
        ..AuthorityConfig::default()
    };
    let dir = Directory::new(&cfg).unwrap();
    let slots: Vec<HashSlot> = (0..HASH_SLOTS as HashSlot).collect();
    Authority::new(cfg, &dir, &slots).unwrap()
}

/// The first `n` uids (of the form `u<i>`) that hash to `slot`.
fn uids_in(slot: HashSlot, n: usize) -> Vec<Uid> {
    (0..)
        .map(|i| format!("u{i}"))
        .filter(|u| hash_slot(u.as_bytes()) == slot)
        .take(n)
        .map(Uid::from)
        .collect()
}

/// A Master route of `uid`'s device flag `flag`, session `session` (owner_seq
/// `session + 10`).
fn master(uid: &Uid, flag: u8, session: u64) -> Route {
    Route {
        uid: uid.clone(),
        device_id: format!("d{flag}").into(),
        device_flag: flag,
        device_level: DeviceLevel::Master,
        node_id: 2,
        boot_id: 77,
        session_id: session,
        listener: Transport::Tcp,
        owner_seq: session + 10,
        connected_at_ms: 0,
        last_active_s: Some(T0),
    }
}

/// The single-node view applied; in slot A, uids[0] has sessions 1 and 2 (two
/// device flags), uids[1] none, uids[2] session 3; in slot B, uids[0] has session
/// 4, uids[1] none. Returns the reader and the uids of A and B.
fn populated(lookup_uids_max: usize) -> (Authority, AuthorityReader, Vec<Uid>, Vec<Uid>) {
    let mut a = writer(lookup_uids_max);
    let view = ClusterView::single_node(NODE);
    assert!(a.apply_view(&view, NODE, T0));
    let (ua, ub) = (uids_in(A, 3), uids_in(B, 2));
    let (ta, tb) = (view.target_for_slot(A), view.target_for_slot(B));
    for (t, r) in [
        (ta, master(&ua[0], 1, 1)),
        (ta, master(&ua[0], 2, 2)),
        (ta, master(&ua[2], 1, 3)),
        (tb, master(&ub[0], 1, 4)),
    ] {
        assert_eq!(a.register_route(&t, r, T0), Ok(RegisterOutcome::Active));
    }
    let r = a.reader();
    (a, r, ua, ub)
}

fn sessions(eps: &[Endpoint]) -> Vec<(Uid, u64)> {
    eps.iter().map(|e| (e.uid.clone(), e.session_id)).collect()
}

#[test]
fn the_identity_read_is_the_published_target() {
    let mut a = writer(16);
    let r = a.reader();
    assert_eq!(r.identity(A), None, "nothing published before a view");
    let view = ClusterView::single_node(NODE);
    assert!(a.apply_view(&view, NODE, T0));
    assert_eq!(r.identity(A), Some(view.target_for_slot(A)));
    assert_eq!(r.identity(B), Some(view.target_for_slot(B)));
}

#[test]
fn the_lookup_forms_agree_and_append_after_what_the_buffers_hold() {
    let (_a, r, ua, ub) = populated(64);
    let view = ClusterView::single_node(NODE);
    let (ta, tb) = (view.target_for_slot(A), view.target_for_slot(B));
    let stale = Target {
        leader_term: ta.leader_term + 1,
        ..ta
    };
    let groups: Vec<(Target, &[Uid])> =
        vec![(ta, &ua[..]), (tb, &ub[..]), (stale, &ua[..1]), (tb, &[])];
    let expected_a = vec![(ua[0].clone(), 1), (ua[0].clone(), 2), (ua[2].clone(), 3)];

    // The owned form.
    let owned = r.endpoints_by_targets(&groups);
    assert_eq!(owned.len(), 4);
    assert_eq!(sessions(owned[0].as_ref().unwrap()), expected_a);
    assert_eq!(sessions(owned[1].as_ref().unwrap()), [(ub[0].clone(), 4)]);
    assert_eq!(owned[2], Err(AuthorityError::StaleTarget));
    assert_eq!(owned[3], Ok(vec![]));

    // The full form, into buffers that already hold something.
    let mut out = owned[1].clone().unwrap();
    let mut results: Results = vec![Err(AuthorityError::Full)];
    r.endpoints_by_targets_into(&groups, &mut out, &mut results);
    let want_ranges: Results = vec![
        Err(AuthorityError::Full),
        Ok(1..4),
        Ok(4..5),
        Err(AuthorityError::StaleTarget),
        Ok(5..5),
    ];
    assert_eq!(results, want_ranges);
    assert_eq!(sessions(&out[1..4]), expected_a);
    assert_eq!(sessions(&out[4..5]), [(ub[0].clone(), 4)]);
    assert_eq!(out[4].owner_seq, 14);

    // The compact form: the same endpoints, naming their uids by position.
    let mut compact = vec![CompactEndpoint {
        uid_index: 9,
        device_flag: 0,
        device_level: DeviceLevel::Slave,
        node_id: 0,
        boot_id: 0,
        session_id: 0,
        owner_seq: 0,
    }];
    let mut results: Results = vec![Err(AuthorityError::Full)];
    r.endpoints_by_targets_compact_into(&groups, &mut compact, &mut results);
    assert_eq!(results, want_ranges);
    let named: Vec<(Uid, u64)> = compact[1..4]
        .iter()
        .map(|e| (ua[e.uid_index as usize].clone(), e.session_id))
        .collect();
    assert_eq!(named, expected_a);
    assert_eq!(
        compact[4].endpoint(&ub[compact[4].uid_index as usize]),
        out[4]
    );

    // The hashed form.
    let hashes = |u: &[Uid]| u.iter().map(|u| uid_hash(u)).collect::<Vec<u64>>();
    let (ha, hb) = (hashes(&ua), hashes(&ub));
    let hashed: Vec<HashedGroup<'_>> = groups
        .iter()
        .zip([&ha[..], &hb[..], &ha[..1], &[]])
        .map(|(&(target, uids), hashes)| HashedGroup {
            target,
            uids,
            hashes,
        })
        .collect();
    let mut out2 = owned[1].clone().unwrap();
    let mut results: Results = vec![Err(AuthorityError::Full)];
    r.endpoints_by_hashed_groups_into(&hashed, &mut out2, &mut results);
    assert_eq!(results, want_ranges);
    assert_eq!(out2, out);
}

/// The groups' results of one call, `Ok(n)` for a group answered with `n` endpoints.
fn budget_call(
    r: &AuthorityReader,
    t: Target,
    sizes: &[usize],
    uids: &[Uid],
) -> Vec<Result<usize, AuthorityError>> {
    let groups: Vec<(Target, &[Uid])> = sizes.iter().map(|&n| (t, &uids[..n])).collect();
    let (mut out, mut results) = (Vec::new(), Vec::new());
    r.endpoints_by_targets_compact_into(&groups, &mut out, &mut results);
    results
        .into_iter()
        .map(|g| g.map(|range| range.len()))
        .collect()
}

#[test]
fn the_uid_budget_of_a_call_is_reached_and_not_passed() {
    // Budget 3; uids[0] has two endpoints, uids[1] none, uids[2] one.
    let (_a, r, ua, _) = populated(3);
    let t = ClusterView::single_node(NODE).target_for_slot(A);
    let full = Err(AuthorityError::Full);
    assert_eq!(
        budget_call(&r, t, &[3], &ua),
        [Ok(3)],
        "a group of the whole budget"
    );
    assert_eq!(budget_call(&r, t, &[1], &ua), [Ok(2)]);
    assert_eq!(budget_call(&r, t, &[2, 1], &ua), [Ok(2), Ok(2)]);
    assert_eq!(budget_call(&r, t, &[2, 1, 1], &ua), [Ok(2), Ok(2), full]);
    assert_eq!(budget_call(&r, t, &[2, 2], &ua), [Ok(2), full]);
    // A refused group takes nothing from the budget; each call has its own.
    assert_eq!(budget_call(&r, t, &[4, 3], &uids_in(A, 4)), [full, Ok(3)]);
    assert_eq!(budget_call(&r, t, &[3], &ua), [Ok(3)]);
}

#[test]
fn the_filter_counts_cover_every_absent_uid_and_add_up() {
    let (_a, r, ua, ub) = populated(1 << 16);
    let view = ClusterView::single_node(NODE);
    assert_eq!(r.filter_counts(), Default::default());
    // Absent uids of a slot with routes, past the present ones.
    let absent_a: Vec<Uid> = uids_in(A, 40)[3..].to_vec();
    let mut with_present = ua.clone();
    with_present.extend(absent_a.iter().cloned());
    let groups: Vec<(Target, &[Uid])> = vec![
        (view.target_for_slot(A), &with_present[..]),
        (view.target_for_slot(B), &ub[1..]),
    ];
    let absent = (absent_a.len() + 2) as u64; // and ua[1], ub[1]
    let found = r.endpoints_by_targets(&groups);
    assert_eq!(found[0].as_ref().map(Vec::len), Ok(3));
    let c = r.filter_counts();
    assert_eq!(c.skipped + c.false_positives, absent);
    assert!(
        c.skipped > 0,
        "the filter skips some of {absent} absent uids"
    );
    r.endpoints_by_targets(&groups);
    let c2 = r.filter_counts();
    assert_eq!(
        (c2.skipped, c2.false_positives),
        (2 * c.skipped, 2 * c.false_positives)
    );
}
