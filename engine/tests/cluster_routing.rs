//! Issue 13: routing across nodes. Three nodes on 127.0.0.1 in this process (each
//! with its own shards, links and data directory; they talk over real loopback
//! sockets only): a person message whose sender, recipient, the recipient's
//! authority and the channel's home are on different nodes; a group with members on
//! all three nodes; a Master login on one node kicking the session on another.

#[macro_use]
mod support;

use std::time::Duration;

use engine::node::Node;
use net::client::{Client, Login, Received};
use net::io::Backend;
use serde_json::json;
use support::cluster::{find_uid, nothing_more, Cluster};
use support::{api, metric, next_recv, next_sendack};

const READ_TIMEOUT: Duration = Duration::from_secs(10);

fn login(node: &Node, uid: &str, device_flag: u8) -> Client {
    let mut login = Login::new(uid, "any");
    login.device_flag = device_flag;
    let (client, reason) = Client::connect(node.tcp_addr().unwrap(), &login, READ_TIMEOUT).unwrap();
    assert_eq!(reason, 1, "CONNACK for {uid}");
    client
}

fn person_message_crosses_four_roles(backend: Backend) {
    let cluster = Cluster::start(backend);
    // Sender on node 1, recipient on node 2, the recipient's authority node 3,
    // the person channel homed on node 1 or 2 (not on the gateway of both).
    let a = "alice".to_string();
    let b = find_uid("bob", |b| {
        cluster.authority_of(b) == 3 && cluster.home_of(&a, b, 1) != 3
    });
    let mut ca = login(cluster.node(1), &a, 1);
    let mut cb = login(cluster.node(2), &b, 1);

    ca.send(&b, 1, 1, "cmn-1", b"hello across nodes", true)
        .unwrap();
    let (seq, id, mseq, reason) = next_sendack(&mut ca);
    assert_eq!((seq, reason, mseq), (1, 1, 1));
    let m = next_recv(&mut cb);
    assert!(
        m.msg_key_ok,
        "encrypted for the recipient's session by its owner"
    );
    assert_eq!(
        (m.from_uid.as_str(), m.channel_id.as_str(), m.channel_type),
        (a.as_str(), a.as_str(), 1)
    );
    assert_eq!((m.message_id, m.message_seq), (id, 1));
    assert_eq!(m.payload, b"hello across nodes");
    cb.recvack(m.message_id, m.message_seq).unwrap();

    // And back, the other way round.
    cb.send(&a, 1, 2, "cmn-2", b"and back", true).unwrap();
    assert_eq!(next_sendack(&mut cb).3, 1);
    let m = next_recv(&mut ca);
    assert_eq!(
        (m.channel_id.as_str(), m.payload.as_slice()),
        (b.as_str(), &b"and back"[..])
    );
    nothing_more(&mut ca);
    nothing_more(&mut cb);
}

fn group_message_reaches_members_on_every_node(backend: Backend) {
    let cluster = Cluster::start(backend);
    let members = ["g-u1", "g-u2", "g-u3"];
    // The group's subscribers are stored at its home (an HTTP write on the home).
    let home = cluster.home_of("g-u1", "team", 2);
    let (status, reply) = api(
        cluster.node(home),
        "/channel/subscriber_add",
        json!({"channel_id": "team", "channel_type": 2, "subscribers": members}),
    );
    assert_eq!(status, 200, "{reply}");
    // u1 on node 1 with a second device on node 3; u2 on node 2; u3 on node 3.
    let mut u1 = login(cluster.node(1), "g-u1", 1);
    let mut u1_pc = login(cluster.node(3), "g-u1", 2);
    let mut u2 = login(cluster.node(2), "g-u2", 1);
    let mut u3 = login(cluster.node(3), "g-u3", 1);
    u1.send("team", 2, 1, "g-1", b"to the team", true).unwrap();
    assert_eq!(next_sendack(&mut u1).3, 1);
    for c in [&mut u1_pc, &mut u2, &mut u3] {
        let m = next_recv(c);
        assert_eq!(
            (
                m.channel_id.as_str(),
                m.from_uid.as_str(),
                m.payload.as_slice()
            ),
            ("team", "g-u1", &b"to the team"[..])
        );
        nothing_more(c);
    }
    // The sending session itself got no RECV.
    nothing_more(&mut u1);
}

fn master_login_on_another_node_kicks_the_old_session(backend: Backend) {
    let cluster = Cluster::start(backend);
    let uid = find_uid("kick", |u| cluster.authority_of(u) == 1);
    let mut old = login(cluster.node(2), &uid, 1);
    let mut slave_other_flag = login(cluster.node(1), &uid, 2);
    // A Master login of another device with the same flag, on node 3.
    let mut master = Login::new(&uid, "any");
    master.device_id = "another-device".into();
    let (_new, reason) =
        Client::connect(cluster.node(3).tcp_addr().unwrap(), &master, READ_TIMEOUT).unwrap();
    assert_eq!(reason, 1);
    let seen = old.wait_closed().unwrap();
    assert!(
        matches!(seen.first(), Some(Received::Disconnect { reason: 12, .. })),
        "the old session on node 2 is kicked with DISCONNECT 12: {seen:?}"
    );
    // Another device flag coexists.
    nothing_more(&mut slave_other_flag);
}

/// Slave devices coexist across nodes: two Slave logins of one uid and flag with
/// different device ids, on two nodes (the authority on the third), both stay and
/// both receive; a third Slave login with the first one's device id replaces it
/// (a close, no kick) from yet another node.
fn slave_devices_coexist_across_nodes(backend: Backend) {
    let cluster = Cluster::start_with(backend, |c| {
        c.default_device_level = engine::route::DeviceLevel::Slave
    });
    let uid = find_uid("slave", |u| cluster.authority_of(u) == 3);
    let device = |id: &str| {
        let mut l = Login::new(&uid, "any");
        l.device_id = id.into();
        l
    };
    let connect = |node: u64, login: &Login| {
        let addr = cluster.node(node).tcp_addr().unwrap();
        let (client, reason) = Client::connect(addr, login, READ_TIMEOUT).unwrap();
        assert_eq!(reason, 1, "CONNACK for {} on node {node}", login.device_id);
        client
    };
    let mut phone = connect(1, &device("phone"));
    let mut tablet = connect(2, &device("tablet"));
    let mut sender = login(cluster.node(3), "slave-sender", 1);
    sender
        .send(&uid, 1, 1, "s-1", b"to both devices", true)
        .unwrap();
    assert_eq!(next_sendack(&mut sender).3, 1);
    for c in [&mut phone, &mut tablet] {
        assert_eq!(next_recv(c).payload, b"to both devices");
    }
    let _phone_again = connect(3, &device("phone"));
    let seen = phone.wait_closed().unwrap();
    assert!(
        !seen
            .iter()
            .any(|f| matches!(f, Received::Disconnect { .. })),
        "a Slave replacing its own device id closes without a kick: {seen:?}"
    );
    nothing_more(&mut tablet);
}

/// With `token_auth` on, a CONNECT on any node is checked against the token stored
/// at the uid's home (the token never leaves it): right token 1, wrong token 2;
/// with the home stopped, 14 (QueryTokenError) at once, not a hang.
fn tokens_are_checked_at_the_uids_home(backend: Backend) {
    let mut cluster = Cluster::start_with(backend, |c| c.token_auth = true);
    let uid = find_uid("tok", |u| home_of_uid(&cluster, u) == 3);
    let (status, reply) = api(
        cluster.node(3),
        "/user/token",
        json!({"uid": uid, "token": "secret-token", "device_flag": 1, "device_level": 1}),
    );
    assert_eq!(status, 200, "{reply}");
    let connect = |node: &Node, token: &str| {
        let (_, reason) = Client::connect(
            node.tcp_addr().unwrap(),
            &Login::new(&uid, token),
            READ_TIMEOUT,
        )
        .unwrap();
        reason
    };
    assert_eq!(connect(cluster.node(1), "secret-token"), 1);
    assert_eq!(connect(cluster.node(2), "wrong"), 2);
    cluster.nodes.pop().unwrap().shutdown().unwrap();
    assert_eq!(connect(cluster.node(1), "secret-token"), 14);
}

/// A SEND to a channel homed on a node that is down is answered SENDACK 10
/// (ForwardSendPacketError) at once; one homed on a live node still goes through.
fn a_send_to_a_channel_homed_on_a_stopped_node_gets_10(backend: Backend) {
    let mut cluster = Cluster::start(backend);
    let a = "stopper";
    let to_dead = find_uid("dead", |u| cluster.home_of(a, u, 1) == 3);
    let to_live = find_uid("live", |u| {
        cluster.home_of(a, u, 1) != 3 && cluster.authority_of(u) != 3
    });
    let mut ca = login(cluster.node(1), a, 1);
    let mut live = login(cluster.node(2), &to_live, 1);
    cluster.nodes.pop().unwrap().shutdown().unwrap();
    ca.send(&to_dead, 1, 1, "d-1", b"nobody home", true)
        .unwrap();
    assert_eq!(next_sendack(&mut ca).3, 10);
    ca.send(&to_live, 1, 2, "l-1", b"still here", true).unwrap();
    assert_eq!(next_sendack(&mut ca).3, 1);
    assert_eq!(next_recv(&mut live).payload, b"still here");
}

/// Issue "Cluster defects found in a review…", item 7: a slot move hands the old
/// authority's routes to the new one (besides the gateways' rebuild), whose
/// lookups wait for them: a message sent right after the move reaches the
/// recipient who stayed connected.
fn a_slot_move_hands_its_routes_to_the_new_leader(backend: Backend) {
    let cluster = Cluster::start(backend);
    let a = "mover";
    let b = find_uid("handed", |b| cluster.authority_of(b) == 1);
    let mut ca = login(cluster.node(3), a, 1);
    let mut cb = login(cluster.node(3), &b, 1);
    let slot = slots::hash_slot(b.as_bytes());
    let body = json!({"hash_slots": [slot], "leader_node_id": 2});
    let (status, reply) = api(cluster.node(1), "/cluster/slots/leader", body);
    assert_eq!(status, 200, "{reply}");
    let moved = &reply["slots"][slot as usize];
    assert_eq!(
        (&moved["leader_node_id"], &moved["from_node_id"]),
        (&json!(2), &json!(1)),
        "the view names the node the move took the slot from"
    );
    ca.send(&b, 1, 1, "h-1", b"right after the move", true)
        .unwrap();
    assert_eq!(next_sendack(&mut ca).3, 1);
    assert_eq!(next_recv(&mut cb).payload, b"right after the move");
    assert!(metric(cluster.node(1), "imrouter_handover_batches_sent_total") >= 1);
    // Published by node 2's expiry pass (`[session] expiry_interval_ms`).
    let deadline = std::time::Instant::now() + READ_TIMEOUT;
    while metric(cluster.node(2), "imrouter_handover_routes_total") == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "node 2 applied no handed-over route"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        metric(cluster.node(2), "imrouter_handover_waits_expired_total"),
        0
    );
}

/// The home of `uid`'s tokens.
fn home_of_uid(cluster: &Cluster, uid: &str) -> u64 {
    cluster.view.home_node(slots::hash_slot(uid.as_bytes()))
}

on_both_drivers!(
    slave_devices_coexist_across_nodes,
    tokens_are_checked_at_the_uids_home,
    a_send_to_a_channel_homed_on_a_stopped_node_gets_10,
    person_message_crosses_four_roles,
    group_message_reaches_members_on_every_node,
    master_login_on_another_node_kicks_the_old_session,
    a_slot_move_hands_its_routes_to_the_new_leader,
);
