//! The authority's presence changes (the `user.onlinestatus` webhook's input):
//! every route that becomes active or ends, with its uid's counts after it.

use domain::cluster::{ClusterView, HashSlot};
use domain::presence::authority::{Authority, AuthorityConfig, Directory, PresenceChange};
use domain::presence::route::{DeviceLevel, RegisterOutcome, Route, RouteIdentity, Transport, Uid};
use slots::HASH_SLOTS;

const T0: u64 = 1_000;
const TTL_S: u64 = 60;

fn setup() -> (Authority, ClusterView) {
    let cfg = AuthorityConfig {
        route_ttl_s: TTL_S,
        ..AuthorityConfig::default()
    };
    let dir = Directory::new(&cfg).unwrap();
    let slots: Vec<HashSlot> = (0..HASH_SLOTS as HashSlot).collect();
    let mut a = Authority::new(cfg, &dir, &slots).unwrap();
    let view = ClusterView::single_node(1);
    assert!(a.apply_view(&view, 1, T0));
    (a, view)
}

fn route(uid: &str, device: &str, flag: u8, level: DeviceLevel, session: u64) -> Route {
    Route {
        uid: Uid::from(uid),
        device_id: device.into(),
        device_flag: flag,
        device_level: level,
        node_id: 2,
        boot_id: 77,
        session_id: session,
        listener: Transport::Tcp,
        owner_seq: 1,
        connected_at_ms: 0,
        last_active_s: Some(T0),
    }
}

fn change(uid: &str, flag: u8, online: bool, session: u64, dev: u32, total: u32) -> PresenceChange {
    PresenceChange {
        uid: Uid::from(uid),
        device_flag: flag,
        online,
        session_id: session,
        device_online: dev,
        total_online: total,
    }
}

fn taken(a: &mut Authority) -> Vec<PresenceChange> {
    let mut out = Vec::new();
    a.take_presence(&mut out);
    out
}

#[test]
fn every_route_that_starts_or_ends_is_recorded_with_the_counts_after_it() {
    let (mut a, view) = setup();
    let t = view.target_for_uid("ann");
    a.record_presence(true);
    let web = route("ann", "web", 1, DeviceLevel::Slave, 11);
    let pc = route("ann", "pc", 2, DeviceLevel::Slave, 12);
    assert_eq!(a.register_route(&t, web, T0), Ok(RegisterOutcome::Active));
    assert_eq!(
        a.register_route(&t, pc.clone(), T0),
        Ok(RegisterOutcome::Active)
    );
    assert_eq!(
        taken(&mut a),
        [
            change("ann", 1, true, 11, 1, 1),
            change("ann", 2, true, 12, 1, 2)
        ]
    );
    // A Master login of flag 1 replaces session 11 when committed.
    let phone = route("ann", "phone", 1, DeviceLevel::Master, 13);
    let Ok(RegisterOutcome::Pending { token, .. }) = a.register_route(&t, phone, T0) else {
        panic!("a conflicting Master waits for its commit");
    };
    assert_eq!(taken(&mut a), [], "a candidate is not online");
    a.commit_route(&t, &token, T0).unwrap();
    assert_eq!(
        taken(&mut a),
        [
            change("ann", 1, false, 11, 1, 2),
            change("ann", 1, true, 13, 1, 2)
        ]
    );
    let identity = RouteIdentity {
        uid: pc.uid.clone(),
        node_id: pc.node_id,
        boot_id: pc.boot_id,
        session_id: pc.session_id,
    };
    assert_eq!(a.unregister_route(&t, &identity, 2, T0), Ok(true));
    assert_eq!(a.unregister_route(&t, &identity, 2, T0), Ok(false));
    assert_eq!(taken(&mut a), [change("ann", 2, false, 12, 0, 1)], "once");
    // A touch recreates a route the authority lost: online again.
    let lost = route("ann", "pad", 3, DeviceLevel::Slave, 14);
    a.touch_routes(&t, &[lost], T0 + 1).unwrap();
    assert_eq!(taken(&mut a), [change("ann", 3, true, 14, 1, 2)]);
    // Both expire past the TTL.
    assert_eq!(a.expire(T0 + 2 * TTL_S), 2);
    let mut expired = taken(&mut a);
    expired.sort_by_key(|c| c.session_id);
    let totals: Vec<u32> = expired.iter().map(|c| c.total_online).collect();
    assert_eq!(expired.len(), 2);
    assert!(expired.iter().all(|c| !c.online && c.device_online == 0));
    assert!(totals == [1, 0] || totals == [0, 1], "{totals:?}");
}

#[test]
fn nothing_is_recorded_unless_switched_on() {
    let (mut a, view) = setup();
    let t = view.target_for_uid("bob");
    a.register_route(&t, route("bob", "web", 1, DeviceLevel::Slave, 1), T0)
        .unwrap();
    assert_eq!(taken(&mut a), []);
    a.record_presence(true);
    a.register_route(&t, route("bob", "pc", 2, DeviceLevel::Slave, 2), T0)
        .unwrap();
    a.record_presence(false);
    assert_eq!(taken(&mut a), [], "switching off drops what was recorded");
}
