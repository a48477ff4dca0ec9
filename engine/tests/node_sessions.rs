//! Session lifecycle on one node through real sockets: route expiry after missed
//! pings, idle close, RECV re-sent with DUP until acknowledged, Slave conflicts, the
//! sender's other devices, and /user/device_quit.

// Test configs change a few nested fields of the defaults.
#![allow(clippy::field_reassign_with_default)]

use std::time::{Duration, Instant};

use engine::node::{Node, NodeConfig};
use net::client::{Client, Login, Received, RecvMessage};
use net::io::Backend;
use serde_json::json;

#[macro_use]
mod support;
use support::api;

fn config(dir: &std::path::Path, backend: Backend) -> NodeConfig {
    support::config(dir, backend)
}

fn set_token(node: &Node, uid: &str, level: u8) {
    support::set_token(node, uid, 1, level);
}

/// Bounds every blocking wait: only a failing test ever waits this long.
const TIMEOUT: Duration = Duration::from_secs(10);

fn login_device(node: &Node, uid: &str, device_id: &str) -> Client {
    let mut l = Login::new(uid, &format!("tok-{uid}"));
    l.device_id = device_id.into();
    let (c, reason) = Client::connect(node.tcp_addr().unwrap(), &l, TIMEOUT).unwrap();
    assert_eq!(reason, 1);
    c
}

fn online_devices(node: &Node, uid: &str) -> usize {
    let (status, body) = api(node, "/user/onlinestatus", json!([uid]));
    assert_eq!(status, 200);
    body.as_array().unwrap().len()
}

/// Polls `cond` until it holds; panics after TIMEOUT. For conditions that depend on
/// the node's own clock (TTL expiry), never as a stand-in for a reply.
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn next_recv(c: &mut Client) -> RecvMessage {
    loop {
        match c.read().unwrap() {
            Received::Recv(m) => return m,
            Received::Pong | Received::Sendack { .. } => continue,
            other => panic!("expected RECV, got {other:?}"),
        }
    }
}

fn a_route_expires_after_missed_pings_while_a_pinging_one_stays(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), backend);
    c.authority.route_ttl_s = 1;
    c.session.touch_flush_interval_ms = 100;
    c.session.expiry_interval_ms = 100;
    let node = Node::start(c).unwrap();
    set_token(&node, "silent", 1);
    set_token(&node, "pinger", 1);
    let _silent = login_device(&node, "silent", "d");
    let mut pinger = login_device(&node, "pinger", "d");
    assert_eq!(online_devices(&node, "silent"), 1);
    // The pinger pings (and reads its PONG) until the silent route has expired.
    wait_until("the silent route to expire", || {
        pinger.ping().unwrap();
        assert_eq!(pinger.read().unwrap(), Received::Pong);
        online_devices(&node, "silent") == 0
    });
    assert_eq!(
        online_devices(&node, "pinger"),
        1,
        "pings keep the route alive"
    );
    node.shutdown().unwrap();
}

fn an_idle_connection_is_closed(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), backend);
    c.net.idle_timeout_ms = 300;
    let node = Node::start(c).unwrap();
    set_token(&node, "u1", 1);
    let mut idle = login_device(&node, "u1", "d");
    assert!(idle.wait_closed().unwrap().is_empty());
    wait_until("the closed session's route to go", || {
        online_devices(&node, "u1") == 0
    });
    node.shutdown().unwrap();
}

fn an_unacknowledged_recv_is_resent_with_dup(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), backend);
    c.session.ack_timeout_ms = 100;
    c.session.ack_resends_max = 2;
    let node = Node::start(c).unwrap();
    set_token(&node, "u1", 1);
    set_token(&node, "u2", 1);
    let mut a = login_device(&node, "u1", "d");
    let mut b = login_device(&node, "u2", "d");
    a.send("u2", 1, 1, "m1", b"ack me", true).unwrap();
    let first = next_recv(&mut b);
    assert!(!first.dup);
    let again = next_recv(&mut b);
    assert!(again.dup, "re-sent with DUP");
    assert_eq!(
        (again.message_id, again.payload.as_slice()),
        (first.message_id, &b"ack me"[..])
    );
    b.recvack(again.message_id, again.message_seq).unwrap();
    // After the ack nothing more comes: the next frame is our PONG.
    b.ping().unwrap();
    assert_eq!(b.read().unwrap(), Received::Pong);
    node.shutdown().unwrap();
}

fn slave_devices_conflict_only_on_the_same_device_id(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path(), backend)).unwrap();
    set_token(&node, "s", 0);
    let mut d1 = login_device(&node, "s", "device-1");
    let _d2 = login_device(&node, "s", "device-2");
    assert_eq!(online_devices(&node, "s"), 2, "other device ids coexist");
    let _d1_again = login_device(&node, "s", "device-1");
    let seen = d1.wait_closed().unwrap();
    assert!(
        !seen
            .iter()
            .any(|f| matches!(f, Received::Disconnect { reason: 12, .. })),
        "a Slave replacing its own device id closes without a kick: {seen:?}"
    );
    wait_until("two routes", || online_devices(&node, "s") == 2);
    node.shutdown().unwrap();
}

fn the_senders_other_devices_receive_but_not_the_sending_session(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path(), backend)).unwrap();
    set_token(&node, "u1", 0);
    set_token(&node, "u2", 1);
    let mut phone = login_device(&node, "u1", "phone");
    let mut laptop = login_device(&node, "u1", "laptop");
    let mut peer = login_device(&node, "u2", "d");
    phone
        .send("u2", 1, 1, "m", b"from the phone", true)
        .unwrap();
    let on_laptop = next_recv(&mut laptop);
    assert_eq!(
        (on_laptop.channel_id.as_str(), on_laptop.payload.as_slice()),
        ("u2", &b"from the phone"[..])
    );
    assert_eq!(next_recv(&mut peer).channel_id, "u1");
    match phone.read().unwrap() {
        Received::Sendack { reason: 1, .. } => {}
        other => panic!("expected SENDACK, got {other:?}"),
    }
    phone.ping().unwrap();
    assert_eq!(
        phone.read().unwrap(),
        Received::Pong,
        "no echo to the sending session"
    );
    node.shutdown().unwrap();
}

fn device_quit_closes_the_sessions_and_removes_their_routes(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path(), backend)).unwrap();
    set_token(&node, "u1", 1);
    let mut s = login_device(&node, "u1", "d");
    assert_eq!(online_devices(&node, "u1"), 1);
    let (status, body) = api(
        &node,
        "/user/device_quit",
        json!({"uid": "u1", "device_flag": 1}),
    );
    assert_eq!(status, 200, "{body}");
    let seen = s.wait_closed().unwrap();
    assert!(
        matches!(seen.first(), Some(Received::Disconnect { .. })),
        "{seen:?}"
    );
    wait_until("the route to go", || online_devices(&node, "u1") == 0);
    node.shutdown().unwrap();
}

fn idempotent_resend_gets_the_first_answer_and_is_delivered_once(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path(), backend)).unwrap();
    set_token(&node, "u1", 1);
    set_token(&node, "u2", 1);
    let mut a = login_device(&node, "u1", "d");
    let mut b = login_device(&node, "u2", "d");
    a.send("u2", 1, 1, "same-no", b"once", true).unwrap();
    a.send("u2", 1, 2, "same-no", b"once", true).unwrap();
    let mut acks = Vec::new();
    while acks.len() < 2 {
        if let Received::Sendack {
            client_seq,
            message_id,
            message_seq,
            reason,
        } = a.read().unwrap()
        {
            acks.push((client_seq, message_id, message_seq, reason));
        }
    }
    assert_eq!(
        (acks[0].1, acks[0].2, acks[0].3),
        (acks[1].1, acks[1].2, acks[1].3),
        "{acks:?}"
    );
    assert_eq!(
        (acks[0].0, acks[1].0),
        (1, 2),
        "each SENDACK echoes its own client_seq"
    );
    let m = next_recv(&mut b);
    assert_eq!(m.payload, b"once");
    b.recvack(m.message_id, m.message_seq).unwrap();
    b.ping().unwrap();
    assert_eq!(b.read().unwrap(), Received::Pong, "delivered once");
    node.shutdown().unwrap();
}

/// `fsync = "always"`: SENDACKs wait for the shard's background sync (pipelined
/// group commit); every message is acknowledged in order, delivered once, and is
/// in the log after a restart.
/// A sync hook that holds every sync while closed (the test's view of the syncer).
struct SyncGate {
    /// (open, syncs waiting at the gate)
    state: std::sync::Mutex<(bool, u32)>,
    changed: std::sync::Condvar,
}

impl SyncGate {
    fn closed() -> SyncGate {
        SyncGate {
            state: std::sync::Mutex::new((false, 0)),
            changed: std::sync::Condvar::new(),
        }
    }

    fn wait_until_holding(&self) {
        let deadline = Instant::now() + TIMEOUT;
        let mut g = self.state.lock().unwrap();
        while g.1 == 0 {
            let left = deadline
                .checked_duration_since(Instant::now())
                .expect("timed out waiting for a sync to reach the gate");
            g = self.changed.wait_timeout(g, left).unwrap().0;
        }
    }

    fn open(&self) {
        self.state.lock().unwrap().0 = true;
        self.changed.notify_all();
    }
}

impl engine::node::syncer::SyncHook for SyncGate {
    fn sync(&self, file: &std::fs::File, _: &std::path::Path, _: u32) -> std::io::Result<()> {
        let mut g = self.state.lock().unwrap();
        g.1 += 1;
        self.changed.notify_all();
        while !g.0 {
            g = self.changed.wait(g).unwrap();
        }
        g.1 -= 1;
        drop(g);
        file.sync_data()
    }
}

/// Opens the gate when dropped: a failing test must not leave the node's final
/// sync waiting at a closed gate.
struct OpenOnDrop(std::sync::Arc<SyncGate>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

/// Reads `c` up to the PONG of a PING sent now; panics on any SENDACK or RECV.
fn nothing_before_pong(c: &mut Client, who: &str) {
    c.ping().unwrap();
    match c.read().unwrap() {
        Received::Pong => {}
        other => panic!("{who} got {other:?} while the sync was held"),
    }
}

fn always_fsync_acknowledges_after_the_background_sync(backend: Backend) {
    const MESSAGES: u32 = 40;
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), backend);
    c.log.fsync = engine::store::FsyncPolicy::Always;
    // One shard: a PING sent after the sync was submitted is handled after every
    // answer the shard could have given before the sync, on the same connection.
    c.runtime.shard_count = 1;
    let gate = std::sync::Arc::new(SyncGate::closed());
    let hooks = engine::node::syncer::NodeHooks {
        log_sync: Some(gate.clone()),
    };
    let node = Node::start_with(c.clone(), hooks).unwrap();
    let _open_on_drop = OpenOnDrop(gate.clone());
    set_token(&node, "u1", 1);
    set_token(&node, "u2", 1);
    let mut a = login_device(&node, "u1", "d");
    let mut b = login_device(&node, "u2", "d");
    // Pipelined: later SENDs arrive while an earlier sync is in flight.
    for i in 1..=MESSAGES {
        a.send(
            "u2",
            1,
            i,
            &format!("no-{i}"),
            format!("m{i}").as_bytes(),
            true,
        )
        .unwrap();
    }
    // The first sync is held: no SENDACK and no RECV may leave meanwhile.
    gate.wait_until_holding();
    nothing_before_pong(&mut a, "the sender");
    nothing_before_pong(&mut b, "the recipient");
    gate.open();
    let mut acks = Vec::new();
    while acks.len() < MESSAGES as usize {
        if let Received::Sendack {
            client_seq,
            message_seq,
            reason,
            ..
        } = a.read().unwrap()
        {
            acks.push((client_seq, message_seq, reason));
        }
    }
    let expected: Vec<(u32, u64, u8)> = (1..=MESSAGES).map(|i| (i, u64::from(i), 1)).collect();
    assert_eq!(acks, expected);
    for i in 1..=MESSAGES {
        let m = next_recv(&mut b);
        assert_eq!(m.payload, format!("m{i}").as_bytes());
        b.recvack(m.message_id, m.message_seq).unwrap();
    }
    node.shutdown().unwrap();

    let node = Node::start(c).unwrap();
    let (status, body) = api(
        &node,
        "/channel/messagesync",
        json!({"login_uid": "u2", "channel_id": "u1", "channel_type": 1, "start_message_seq": 0, "end_message_seq": 0, "limit": 100, "pull_mode": 1}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["messages"].as_array().unwrap().len(),
        MESSAGES as usize
    );
    node.shutdown().unwrap();
}

fn bad_msg_key_8_bad_payload_9_sub_23_and_the_connection_stays(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path(), backend)).unwrap();
    set_token(&node, "u1", 1);
    let mut a = login_device(&node, "u1", "d");
    // A SEND whose msg_key is wrong (encrypted flag set, key all zeros).
    let bad_key = proto::wkproto::SendPacket {
        client_seq: 1,
        client_msg_no: "k",
        channel_id: "u2",
        channel_type: proto::wkproto::ChannelType(1),
        msg_key: "00000000000000000000000000000000",
        payload: b"AAAA",
        ..Default::default()
    };
    let mut frame = Vec::new();
    bad_key.encode(6, &mut frame).unwrap();
    a.send_raw(&frame).unwrap();
    match a.read().unwrap() {
        Received::Sendack {
            client_seq: 1,
            reason: 8,
            ..
        } => {}
        other => panic!("expected SENDACK 8, got {other:?}"),
    }
    // A right msg_key over a payload that is not ciphertext: SENDACK 9.
    a.send_undecryptable("u2", 1, 2).unwrap();
    match a.read().unwrap() {
        Received::Sendack {
            client_seq: 2,
            reason: 9,
            ..
        } => {}
        other => panic!("expected SENDACK 9, got {other:?}"),
    }
    // SUB is answered with SUBACK 23 (no subscribable channel type yet).
    let sub = proto::wkproto::SubPacket {
        sub_no: "s1",
        channel_id: "c",
        channel_type: proto::wkproto::ChannelType(2),
        ..Default::default()
    };
    frame.clear();
    sub.encode(6, &mut frame).unwrap();
    a.send_raw(&frame).unwrap();
    assert_eq!(a.read().unwrap(), Received::Suback { reason: 23 });
    a.ping().unwrap();
    assert_eq!(a.read().unwrap(), Received::Pong, "the connection stays");
    node.shutdown().unwrap();
}

fn shutdown_sends_disconnect_to_every_session(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path(), backend)).unwrap();
    set_token(&node, "u1", 1);
    set_token(&node, "u2", 1);
    let mut a = login_device(&node, "u1", "d");
    let mut b = login_device(&node, "u2", "d");
    node.shutdown().unwrap();
    for c in [&mut a, &mut b] {
        let seen = c.wait_closed().unwrap();
        assert!(
            matches!(seen.first(), Some(Received::Disconnect { .. })),
            "{seen:?}"
        );
    }
}

/// A node alone leads every hash slot: a move to a node outside the cluster (issue
/// 26, item 10: leaders are validated) is refused and nothing moves; its routes stay.
fn a_slot_move_to_a_node_outside_the_cluster_is_refused(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path(), backend)).unwrap();
    set_token(&node, "u1", 1);
    let _a = login_device(&node, "u1", "d");
    assert_eq!(online_devices(&node, "u1"), 1);
    let before = node.shared().view().as_ref().clone();
    let slot = slots::hash_slot(b"u1");
    let (status, body) = api(
        &node,
        "/cluster/slots/leader",
        json!({"hash_slots": [slot], "leader_node_id": 2}),
    );
    assert_eq!(status, 400, "{body}");
    assert_eq!(*node.shared().view(), before, "nothing moved");
    assert_eq!(online_devices(&node, "u1"), 1);
    let (status, _) = api(
        &node,
        "/cluster/slots/leader",
        json!({"hash_slots": [300], "leader_node_id": 1}),
    );
    assert_eq!(status, 400);
    node.shutdown().unwrap();
}

/// Issue "Cluster defects found in a review…", item 10: a shard whose view message
/// never arrived (its queue was full) takes the node's view on its expiry timer.
/// The node's view is changed here without any message to the shards, as a lost
/// one would leave it: each shard still applies it (`imrouter_view_revision`, the
/// shard furthest behind) and counts the re-read.
fn a_shard_that_missed_a_view_takes_the_nodes_on_its_timer(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), backend);
    c.session.expiry_interval_ms = 10;
    let shards = u64::from(c.runtime.shard_count);
    let node = Node::start(c).unwrap();
    let before = node.shared().view().revision;
    assert_eq!(support::metric(&node, "imrouter_view_revision"), before);
    let moved = node.shared().move_leaders(&[7], 1, None).unwrap();
    assert!(moved.revision > before);
    let deadline = Instant::now() + Duration::from_secs(10);
    while support::metric(&node, "imrouter_view_revision") < moved.revision {
        assert!(
            Instant::now() < deadline,
            "a shard stayed on revision {before}"
        );
        std::thread::yield_now();
    }
    assert_eq!(
        support::metric(&node, "imrouter_views_reread_total"),
        shards
    );
    node.shutdown().unwrap();
}

/// Issue "Cluster defects found in a review…", item 1 (zombie sessions): after a
/// slot move the routes are rebuilt at their new authority at
/// `rebuild_routes_per_s`; a Master login of the uid on another device before the
/// old session's rebuild touch arrives finds no route to kick. The old session's
/// touch is then refused for good (a conflicting active route): the session is
/// told (DISCONNECT 12) and closed, not left connected receiving nothing. Counted
/// in `imrouter_sessions_superseded_total` (not in `imrouter_kicks_total`: no owner action).
/// A node alone can only move a slot to itself, which keeps its routes since the
/// handover (issue 26 item 7; the login then kicks the old phone): with
/// `[authority] handover_wait_s = 0` it starts the slot empty, as a move whose
/// handover was lost does.
fn a_session_superseded_during_a_rebuild_is_told_and_closed(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), backend);
    // One registry, so the rebuild queue's order is the login order.
    c.runtime.shard_count = 1;
    c.session.rebuild_routes_per_s = 1;
    c.authority.handover_wait_s = 0;
    let node = Node::start(c).unwrap();
    let slot = slots::hash_slot(b"z");
    // Three sessions of the same hash slot, rebuilt (one a second) before the old
    // phone's: the new login has seconds to come first.
    let fillers: Vec<String> = (0..)
        .map(|i| format!("f{i}"))
        .filter(|u| slots::hash_slot(u.as_bytes()) == slot)
        .take(3)
        .collect();
    let mut sessions = Vec::new();
    for u in &fillers {
        set_token(&node, u, 0);
        sessions.push(login_device(&node, u, "d"));
    }
    set_token(&node, "z", 1);
    let mut old = login_device(&node, "z", "phone-old");
    let (status, body) = api(
        &node,
        "/cluster/slots/leader",
        json!({"hash_slots": [slot], "leader_node_id": 1}),
    );
    assert_eq!(status, 200, "{body}");
    let _new = login_device(&node, "z", "phone-new");
    let seen = old.wait_closed().unwrap();
    assert!(
        seen.iter()
            .any(|f| matches!(f, Received::Disconnect { reason: 12, .. })),
        "the superseded session is told: {seen:?}"
    );
    assert_eq!(
        support::metric(&node, "imrouter_sessions_superseded_total"),
        1
    );
    assert_eq!(support::metric(&node, "imrouter_kicks_total"), 0);
    assert_eq!(online_devices(&node, "z"), 1);
    node.shutdown().unwrap();
}

on_both_drivers!(
    a_session_superseded_during_a_rebuild_is_told_and_closed,
    a_route_expires_after_missed_pings_while_a_pinging_one_stays,
    an_idle_connection_is_closed,
    an_unacknowledged_recv_is_resent_with_dup,
    slave_devices_conflict_only_on_the_same_device_id,
    the_senders_other_devices_receive_but_not_the_sending_session,
    device_quit_closes_the_sessions_and_removes_their_routes,
    idempotent_resend_gets_the_first_answer_and_is_delivered_once,
    always_fsync_acknowledges_after_the_background_sync,
    bad_msg_key_8_bad_payload_9_sub_23_and_the_connection_stays,
    shutdown_sends_disconnect_to_every_session,
    a_slot_move_to_a_node_outside_the_cluster_is_refused,
    a_shard_that_missed_a_view_takes_the_nodes_on_its_timer,
);

/// A CONNECT whose activation timer cannot be armed (the shard's timer wheel is
/// full) is refused with CONNACK 15 and closed, before anything is registered: an
/// activation without its timer would never time out. Counted in
/// `imrouter_connect_refused`.
fn a_connect_without_room_for_its_activation_timer_is_refused(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), backend);
    // Each shard's own periodic timers (touch flush, expiry, log sync) fill it.
    c.runtime.timers_max = 3;
    let node = Node::start(c).unwrap();
    set_token(&node, "u1", 1);
    let (mut client, reason) = Client::connect(
        node.tcp_addr().unwrap(),
        &Login::new("u1", "tok-u1"),
        TIMEOUT,
    )
    .unwrap();
    assert_eq!(reason, 15, "CONNACK SystemError");
    assert!(client.wait_closed().is_ok(), "the connection is closed");
    assert_eq!(online_devices(&node, "u1"), 0, "no session, no route");
    let metrics = node.api().handle("GET", "/metrics", None, b"").body;
    assert!(
        metrics
            .lines()
            .any(|l| l == "imrouter_connect_refused_total 1"),
        "counted:\n{metrics}"
    );
    node.shutdown().unwrap();
}

/// Issue "Cluster defects found in a review…", item 2 (every batch bounded in
/// bytes): a uid or device id past its `[session]` limit is refused at the edge
/// (CONNACK 2, `/user/token` 400 naming the key), so a route's size, and with it a
/// touch batch's, is bounded. At the limit both are taken.
fn a_uid_or_device_id_past_its_limit_is_refused(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), backend);
    c.session.uid_bytes_max = 8;
    c.session.device_id_bytes_max = 4;
    let node = Node::start(c).unwrap();
    let (status, body) = api(
        &node,
        "/user/token",
        json!({"uid": "u23456789", "token": "t", "device_flag": 1, "device_level": 1}),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.to_string().contains("uid_bytes_max"), "{body}");
    let (status, body) = api(
        &node,
        "/channel/subscriber_add",
        json!({"channel_id": "g", "channel_type": 2, "subscribers": ["u2345678", "u23456789"]}),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.to_string().contains("uid_bytes_max"), "{body}");
    set_token(&node, "u2345678", 1);
    let connect = |uid: &str, device_id: &str| {
        let mut l = Login::new(uid, "tok-u2345678");
        l.device_id = device_id.into();
        Client::connect(node.tcp_addr().unwrap(), &l, TIMEOUT).unwrap()
    };
    let (mut long_uid, reason) = connect("u23456789", "d");
    assert_eq!(reason, 2, "CONNACK AuthFail for a uid past the limit");
    assert!(long_uid.wait_closed().is_ok());
    let (mut long_device, reason) = connect("u2345678", "d2345");
    assert_eq!(reason, 2, "CONNACK AuthFail for a device id past the limit");
    assert!(long_device.wait_closed().is_ok());
    let (_at_limit, reason) = connect("u2345678", "d234");
    assert_eq!(reason, 1, "both at their limit");
    node.shutdown().unwrap();
}

on_both_drivers!(
    a_connect_without_room_for_its_activation_timer_is_refused,
    a_uid_or_device_id_past_its_limit_is_refused
);

/// A limit that must be at least 1 is refused at start with a message naming it
/// (`subscriber_page_max = 0` used to start, then panic a shard at its first
/// delivery).
#[test]
fn a_zero_limit_is_refused_at_start_with_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), Backend::Mio);
    c.delivery.subscriber_page_max = 0;
    let err = Node::start(c).err().expect("refused at start");
    assert!(
        err.to_string().contains("delivery.subscriber_page_max"),
        "{err}"
    );
    let mut c = config(dir.path(), Backend::Mio);
    c.session.touch_batch_routes_max = 0;
    let err = Node::start(c).err().expect("refused at start");
    assert!(
        err.to_string().contains("session.touch_batch_routes_max"),
        "{err}"
    );
}
