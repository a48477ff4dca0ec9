//! SENDs through the replicated groups (`[cluster] replicas = 3`, three nodes, two
//! shards each): once every slot id's home leads its group (a leader elsewhere
//! hands over to it), a SEND is proposed to its slot id's group and answered only
//! after the entry is committed on a majority, with the seq the replicas' logs
//! gave it; the messages then reach the recipient, and a resend (same
//! client_msg_no) is answered with the first copy's ids and not delivered again. After the nodes stop, each
//! node's log is read back: a majority holds every acknowledged message with its
//! id and seq, and no node holds another message at those seqs. With both other
//! replicas of a channel's group stopped, a SEND is refused (15, once the leader
//! steps down), never acknowledged. With a channel's home stopped, its group
//! elects another leader, which claims the slot id: SENDs commit there with the
//! next seq, reach the recipient (whose authority moved with it) and messagesync
//! there returns what the stopped node acknowledged.
//! Waits are bounded polls (no sleeps).

use std::time::{Duration, Instant};

use base64::Engine as _;
use net::io::Backend;
use serde_json::{json, Value};
use support::cluster::{find_uid, login_any, Cluster, SLOT_IDS};

#[macro_use]
mod support;

const WAIT: Duration = Duration::from_secs(20);

fn start() -> Cluster {
    Cluster::start_with(Backend::Mio, |cfg| {
        cfg.cluster.replicas = 3;
        cfg.runtime.shard_count = 2;
    })
}

/// Waits (bounded) until every node sees every slot id's home (`nodes[s % 3]`,
/// ids 1..=3) lead its group, and its view has the home's claim (homes follow the
/// groups' leaders: the claim comes once the leader committed an entry of its term).
fn homes_lead(c: &Cluster) {
    let deadline = Instant::now() + WAIT;
    'wait: loop {
        assert!(Instant::now() < deadline, "the homes did not all lead");
        std::thread::yield_now();
        for node in &c.nodes {
            let view = node.shared().view();
            for s in 0..SLOT_IDS {
                let home = u64::from(s % 3) + 1;
                if node.shared().raft_status.of(s).map(|(l, _)| l) != Some(home) {
                    continue 'wait;
                }
            }
            for h in 0..256u16 {
                let slot = view.slots[h as usize];
                let home = u64::from(slot.slot_id % 3) + 1;
                if (slot.leader_node_id, view.home_node(h)) != (home, home) || slot.leader_term < 2
                {
                    continue 'wait;
                }
            }
        }
        return;
    }
}

fn send(node: &engine::node::Node, to: &str, text: &str) -> (u16, Value) {
    send_numbered(node, to, text, "")
}

fn send_numbered(
    node: &engine::node::Node,
    to: &str,
    text: &str,
    client_msg_no: &str,
) -> (u16, Value) {
    let payload = base64::engine::general_purpose::STANDARD.encode(text.as_bytes());
    support::api(
        node,
        "/message/send",
        json!({"from_uid": "sys", "channel_id": to, "channel_type": 1, "payload": payload,
               "client_msg_no": client_msg_no}),
    )
}

/// `(seq, message id)` of every message of `channel` in the log of `shard` of
/// the data dir `dir`.
fn logged(
    dir: &std::path::Path,
    shard: usize,
    log: &engine::store::LogConfig,
    channel: &str,
) -> Vec<(u64, i64)> {
    let (log, _) =
        engine::store::MessageLog::open(&engine::store::log_dir(dir, shard), log.clone())
            .expect("the log opens");
    let mut found = Vec::new();
    log.scan(|m| {
        if m.channel_id == channel {
            found.push((m.message_seq, m.message_id));
        }
    })
    .unwrap();
    found
}

#[test]
fn a_send_is_answered_after_its_commit_on_a_majority_with_the_replicas_seq() {
    let mut c = start();
    homes_lead(&c);
    let to = "replicated-rcpt";
    let key = engine::channel::person_channel_key("sys", to);
    let slot = slots::hash_slot(key.as_bytes());
    let slot_id = domain::cluster::slot_id_of(slot, SLOT_IDS);
    let mut client = login_any(c.node(2), to);
    let mut sent = Vec::new();
    for (i, n) in [1, 2, 3].into_iter().enumerate() {
        let (status, reply) = send(c.node(n), to, &format!("m{i}"));
        assert_eq!(status, 200, "{reply}");
        assert_eq!(reply["message_seq"], i + 1, "{reply}");
        sent.push((i as u64 + 1, reply["message_id"].as_i64().unwrap()));
        let m = support::next_recv(&mut client);
        assert_eq!(m.message_id, sent[i].1);
    }
    // A resend (same client_msg_no) gets the first copy's ids and no RECV.
    let (status, first) = send_numbered(c.node(1), to, "once", "n-1");
    assert_eq!(status, 200, "{first}");
    let (status, again) = send_numbered(c.node(3), to, "once", "n-1");
    assert_eq!(status, 200, "{again}");
    assert_eq!(
        (&again["message_id"], &again["message_seq"]),
        (&first["message_id"], &first["message_seq"])
    );
    assert_eq!(first["message_seq"], 4, "{first}");
    sent.push((4, first["message_id"].as_i64().unwrap()));
    assert_eq!(support::next_recv(&mut client).message_id, sent[3].1);
    support::cluster::nothing_more(&mut client);
    let shard = slot_id as usize % 2;
    let dirs: Vec<(std::path::PathBuf, engine::store::LogConfig)> = (c.nodes.iter())
        .map(|n| {
            (
                n.shared().config.data_dir.clone(),
                n.shared().config.log.clone(),
            )
        })
        .collect();
    drop(client);
    for node in c.nodes.drain(..) {
        node.shutdown().unwrap();
    }
    let mut holding = 0;
    for (dir, log) in &dirs {
        let found = logged(dir, shard, log, &key);
        assert!(
            sent.starts_with(&found),
            "{}: {found:?} against {sent:?}",
            dir.display()
        );
        holding += usize::from(found == sent);
    }
    assert!(
        holding >= 2,
        "{holding} of 3 logs hold every acknowledged message"
    );
}

#[test]
fn with_the_other_replicas_stopped_a_send_is_refused_never_acknowledged() {
    let mut c = start();
    homes_lead(&c);
    let to = "replicated-alone";
    let key = engine::channel::person_channel_key("sys", to);
    let home = c.view.home_node(slots::hash_slot(key.as_bytes()));
    let (status, reply) = send(c.node(home), to, "before");
    assert_eq!(status, 200, "{reply}");
    let others: Vec<u64> = [1, 2, 3].into_iter().filter(|&n| n != home).collect();
    for &n in others.iter().rev() {
        let node = c.nodes.remove(n as usize - 1);
        node.shutdown().unwrap();
    }
    let (status, reply) = send(&c.nodes[0], to, "alone");
    assert_ne!(status, 200, "acknowledged without a majority: {reply}");
    assert_eq!(reply["reason"], 15, "{reply}");
    // A read needs the group's leader confirmed by a quorum (ReadIndex): the
    // lone replica answers none from its log, which may be stale (and holds the
    // refused SEND's entry, never committed).
    let (status, reply) = support::api(
        &c.nodes[0],
        "/channel/messagesync",
        json!({"login_uid": to, "channel_id": "sys", "channel_type": 1,
               "start_message_seq": 0, "end_message_seq": 0, "limit": 0, "pull_mode": 1}),
    );
    assert_eq!(status, 503, "read without a confirmed leader: {reply}");
    let not_leader = support::metric(&c.nodes[0], "imrouter_api_reads_not_leader_total");
    assert_eq!(not_leader, 1, "counted by its reason");
    assert_eq!(
        support::metric(&c.nodes[0], "imrouter_api_reads_busy_total"),
        0
    );
    // Counted (the shard publishes its counts just after the answer left).
    let deadline = Instant::now() + WAIT;
    while support::metric(&c.nodes[0], "imrouter_commits_proposals_failed_total") != 1 {
        assert!(Instant::now() < deadline, "the refusal was not counted");
        std::thread::yield_now();
    }
}

/// A leader cut off from its quorum (both other replicas stopped) stops serving
/// its slot ids' authority once its lease ends, though its view still names it
/// (nobody else could claim them): a login of a uid homed there, accepted before,
/// is refused with CONNACK 17 (not leader) and the refusal counted
/// (`imrouter_authority_lease_refusals_total`): a minority side cannot admit a
/// second Master session.
#[test]
fn a_leader_cut_off_from_its_quorum_stops_serving_its_authority() {
    let mut c = start();
    homes_lead(&c);
    // A new uid homed on node 1 per login: each registers at once (no session
    // of its own to replace), or is refused.
    let homed_on_one = |i: usize| {
        find_uid(&format!("leased{i}-"), |u| {
            c.view.home_node(slots::hash_slot(u.as_bytes())) == 1
        })
    };
    drop(login_any(c.node(1), &homed_on_one(0)));
    for n in [3, 2] {
        c.nodes.remove(n - 1).shutdown().unwrap();
    }
    let addr = c.nodes[0].tcp_addr().unwrap();
    let deadline = Instant::now() + WAIT;
    for i in 1.. {
        assert!(
            Instant::now() < deadline,
            "node 1 kept serving its authority"
        );
        let uid = homed_on_one(i);
        let login = net::client::Login::new(&uid, "any");
        let (client, reason) = net::client::Client::connect(addr, &login, Duration::from_secs(5))
            .expect("node 1 answers the CONNECT");
        drop(client);
        if reason == 17 {
            let view = c.nodes[0].shared().view();
            assert_eq!(
                view.target_for_uid(&uid).leader_node_id,
                1,
                "its view names it"
            );
            break;
        }
        assert_eq!(reason, 1, "accepted, or refused as not leader");
        std::thread::yield_now();
    }
    assert!(support::metric(&c.nodes[0], "imrouter_authority_lease_refusals_total") >= 1);
}

/// `POST /channel/messagesync` on `node`: the seqs and texts of `to`'s person
/// channel with `sys`, as `to` reads it.
fn synced(node: &engine::node::Node, to: &str) -> Vec<(u64, String)> {
    let (status, reply) = support::api(
        node,
        "/channel/messagesync",
        json!({"login_uid": to, "channel_id": "sys", "channel_type": 1,
               "start_message_seq": 0, "end_message_seq": 0, "limit": 0, "pull_mode": 1}),
    );
    assert_eq!(status, 200, "{reply}");
    let payload = |m: &Value| {
        let b = base64::engine::general_purpose::STANDARD
            .decode(m["payload"].as_str().unwrap())
            .unwrap();
        String::from_utf8(b).unwrap()
    };
    (reply["messages"].as_array().unwrap().iter())
        .map(|m| (m["message_seq"].as_u64().unwrap(), payload(m)))
        .collect()
}

/// `uid`'s token as each live node's catalog holds it, once all agree (bounded):
/// followers apply a change at their commit, just after the leader.
fn token_everywhere(nodes: &[engine::node::Node], uid: &str) -> Option<Box<str>> {
    let deadline = Instant::now() + WAIT;
    loop {
        let seen: Vec<_> = (nodes.iter())
            .map(|n| n.shared().catalog.token(uid, 1).map(|(t, _)| t))
            .collect();
        if seen.iter().all(|t| t == &seen[0]) && seen[0].is_some() {
            return seen[0].clone();
        }
        assert!(Instant::now() < deadline, "{uid}'s token: {seen:?}");
        std::thread::yield_now();
    }
}

#[test]
fn a_stopped_homes_uids_and_channels_are_served_by_their_groups_new_leader() {
    let mut c = Cluster::start_with(Backend::Mio, |cfg| {
        cfg.cluster.replicas = 3;
        cfg.runtime.shard_count = 2;
        cfg.token_auth = true;
    });
    homes_lead(&c);
    let home_is_1 = |key: &str| c.view.home_node(slots::hash_slot(key.as_bytes())) == 1;
    // A recipient whose channel with `sys`, whose own authority and token are node
    // 1's, and a group homed there with it as subscriber.
    let to = find_uid("failover-rcpt", |u| {
        home_is_1(&engine::channel::person_channel_key("sys", u)) && home_is_1(u)
    });
    let group = find_uid("failover-group", |g| home_is_1(g));
    let key = engine::channel::person_channel_key("sys", &to);
    let slot_id = domain::cluster::slot_id_of(slots::hash_slot(key.as_bytes()), SLOT_IDS);
    // Catalog changes through node 2 are passed to node 1, committed through the
    // group and applied by every replica.
    support::set_token(c.node(2), &to, 1, 1);
    let (status, reply) = support::api(
        c.node(3),
        "/channel/subscriber_add",
        json!({"channel_id": group, "channel_type": 2, "subscribers": [to, "sys"]}),
    );
    assert_eq!(status, 200, "{reply}");
    assert_eq!(
        token_everywhere(&c.nodes, &to).as_deref(),
        Some(&*format!("tok-{to}"))
    );
    let mut client = support::login(c.node(2), &to);
    let (status, before) = send(c.node(2), &to, "before");
    assert_eq!(status, 200, "{before}");
    assert_eq!(before["message_seq"], 1, "{before}");
    let first_id = before["message_id"].as_i64().unwrap();
    let first = support::next_recv(&mut client);
    assert_eq!((first.message_id, first.dup), (first_id, false));
    // Acknowledged: its gateway never sends it again on its own.
    client.recvack(first_id, 1).unwrap();
    let old_term =
        c.node(2).shared().view().slots[slots::hash_slot(key.as_bytes()) as usize].leader_term;
    let claims = |c: &Cluster, nodes: &[usize]| -> u64 {
        (nodes.iter())
            .map(|&i| support::metric(&c.nodes[i], "imrouter_raft_claims_total"))
            .sum()
    };
    let claimed_before = claims(&c, &[1, 2]);
    c.nodes.remove(0).shutdown().unwrap();
    let two = &c.nodes[0];
    // Both live nodes' views name new leaders (claims above the old term) for the
    // person channel's, the group's and the uid's slot ids, and the recipient's
    // session is online at its uid's new authority (its gateway registered it
    // again there).
    let deadline = Instant::now() + WAIT;
    let keys = [key.as_str(), group.as_str(), to.as_str()];
    loop {
        assert!(
            Instant::now() < deadline,
            "no new leader took the slot ids over"
        );
        std::thread::yield_now();
        let moved = c.nodes.iter().all(|n| {
            let view = n.shared().view();
            keys.iter().all(|k| {
                let slot = view.slots[slots::hash_slot(k.as_bytes()) as usize];
                slot.leader_node_id != 1 && slot.leader_term > 1
            }) && view.slots[slots::hash_slot(key.as_bytes()) as usize].leader_term > old_term
        });
        if !moved {
            continue;
        }
        let (status, online) = support::api(two, "/user/onlinestatus", json!([to]));
        if status == 200 && online.as_array().is_some_and(|a| !a.is_empty()) {
            break;
        }
    }
    let leader = two
        .shared()
        .view()
        .home_node(slots::hash_slot(key.as_bytes()));
    assert_ne!(leader, 1);
    assert!(
        claims(&c, &[0, 1]) > claimed_before,
        "the new leaders' claims are counted"
    );
    assert_eq!(
        two.shared().raft_status.of(slot_id).map(|(l, _)| l),
        Some(leader),
        "the view's home is the group's leader"
    );
    // The stopped leader's last message is one its delivery mark had not passed
    // (no later entry carried a mark): the new leader delivers it again, DUP.
    let again = support::next_recv(&mut client);
    assert_eq!(
        (again.message_id, again.message_seq, again.dup),
        (first_id, 1, true),
        "the predecessor's last message again, flagged DUP"
    );
    // SENDs through either live node commit at the new leader, after the stopped
    // node's message.
    let (status, after) = send_numbered(two, &to, "after", "after-1");
    assert_eq!(status, 200, "{after}");
    assert_eq!(after["message_seq"], 2, "{after}");
    assert!(after["message_id"].as_i64().unwrap() > first_id, "{after}");
    assert_eq!(
        support::next_recv(&mut client).message_id,
        after["message_id"].as_i64().unwrap()
    );
    let (status, third) = send(&c.nodes[1], &to, "third");
    assert_eq!(status, 200, "{third}");
    assert_eq!(third["message_seq"], 3, "{third}");
    assert_eq!(
        support::next_recv(&mut client).message_id,
        third["message_id"].as_i64().unwrap()
    );
    // The group's subscribers were replicated: a SEND to it reaches the recipient.
    let payload = base64::engine::general_purpose::STANDARD.encode(b"to the group");
    let (status, grouped) = support::api(
        &c.nodes[1],
        "/message/send",
        json!({"from_uid": "sys", "channel_id": group, "channel_type": 2, "payload": payload}),
    );
    assert_eq!(status, 200, "{grouped}");
    assert_eq!(
        support::next_recv(&mut client).message_id,
        grouped["message_id"].as_i64().unwrap()
    );
    let want: Vec<(u64, String)> = vec![
        (1, "before".into()),
        (2, "after".into()),
        (3, "third".into()),
    ];
    for node in &c.nodes {
        assert_eq!(synced(node, &to), want, "messagesync through a live node");
    }
    // The uid logs in with its token on the other live node (checked at its new
    // home), and a wrong token is refused there.
    let _again = support::login(&c.nodes[1], &to);
    let wrong = net::client::Login::new(&to, "not-the-token");
    let (_, reason) = net::client::Client::connect(
        c.nodes[1].tcp_addr().unwrap(),
        &wrong,
        Duration::from_secs(10),
    )
    .unwrap();
    assert_eq!(reason, 2, "a wrong token is refused at the new home");
    // A token change now commits through the new leader.
    let body = json!({"uid": to, "token": "renewed", "device_flag": 1, "device_level": 1});
    let (status, reply) = support::api(&c.nodes[1], "/user/token", body);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(token_everywhere(&c.nodes, &to).as_deref(), Some("renewed"));
}

/// `POST /node/drain` with replicas hands the node's groups over: once it answers
/// 200 the node leads no group and its view names it leader of no hash slot, its
/// peers know it drains (their leaders do not hand back to it), and a channel
/// homed on it takes SENDs through another node at its new leader, after what it
/// acknowledged; restarted, it no longer drains and its groups hand their
/// leadership back to it.
#[test]
fn a_drained_node_hands_its_groups_over_and_takes_them_back_after_a_restart() {
    let mut c = start();
    homes_lead(&c);
    let to = find_uid("drain-rcpt", |u| {
        let key = engine::channel::person_channel_key("sys", u);
        c.view.home_node(slots::hash_slot(key.as_bytes())) == 1
    });
    let (status, before) = send(c.node(2), &to, "before");
    assert_eq!(
        (status, &before["message_seq"]),
        (200, &json!(1)),
        "{before}"
    );
    let led = (0..SLOT_IDS).filter(|s| s % 3 == 0).count();
    let (status, drained) = support::api(c.node(1), "/node/drain", json!({}));
    assert_eq!(status, 200, "{drained}");
    assert_eq!(drained["handed_over_slot_ids"], led, "{drained}");
    let one = c.node(1).shared();
    assert_eq!(one.raft_status.led_by(1), 0, "node 1 leads no group");
    let view = one.view();
    assert!(
        view.slots.iter().all(|s| s.leader_node_id != 1),
        "node 1's view names it leader of no hash slot"
    );
    let (status, again) = support::api(c.node(1), "/node/drain", json!({"move_to": [2]}));
    assert_eq!(status, 400, "{again}");
    for n in [2, 3] {
        assert!(c.node(n).shared().is_node_draining(1), "node {n} knows");
    }
    let (status, after) = send(c.node(3), &to, "after");
    assert_eq!((status, &after["message_seq"]), (200, &json!(2)), "{after}");
    let want: Vec<(u64, String)> = vec![(1, "before".into()), (2, "after".into())];
    assert_eq!(synced(c.node(2), &to), want);
    // Restarted, node 1 leads its groups again (homes_lead: every node's status
    // and view).
    let config = c.nodes[0].shared().config.clone();
    c.nodes.remove(0).shutdown().unwrap();
    c.nodes
        .insert(0, engine::node::Node::start(config).unwrap());
    homes_lead(&c);
    assert!(!c.node(2).shared().is_node_draining(1));
    assert_eq!(synced(c.node(1), &to), want);
}

/// A committed catalog change that a replica's own store refuses (its `[meta]`
/// limit below the leader's) is counted there
/// (`imrouter_catalog_applies_failed_total`): that replica's catalog differs, the
/// others applied it.
#[test]
fn a_catalog_change_a_replicas_store_refuses_is_counted_there() {
    let c = Cluster::start_with(Backend::Mio, |cfg| {
        cfg.cluster.replicas = 3;
        cfg.runtime.shard_count = 2;
        if cfg.node_id == 3 {
            cfg.meta.subscribers_per_group_max = 1;
        }
    });
    homes_lead(&c);
    let group = find_uid("refused-group", |g| {
        c.view.home_node(slots::hash_slot(g.as_bytes())) == 1
    });
    let (status, reply) = support::api(
        c.node(2),
        "/channel/subscriber_add",
        json!({"channel_id": group, "channel_type": 2, "subscribers": ["a", "b"]}),
    );
    assert_eq!(status, 200, "{reply}");
    let failed = |n: u64| support::metric(c.node(n), "imrouter_catalog_applies_failed_total");
    let deadline = Instant::now() + WAIT;
    while failed(3) == 0 {
        assert!(Instant::now() < deadline, "node 3 never refused the change");
        std::thread::yield_now();
    }
    assert_eq!((failed(1), failed(2), failed(3)), (0, 0, 1));
    let held = |n: u64| (c.node(n).shared().catalog.subscribers(&group)).map_or(0, |s| s.len());
    let deadline = Instant::now() + WAIT;
    while held(2) != 2 {
        assert!(Instant::now() < deadline, "node 2 never applied the change");
        std::thread::yield_now();
    }
    assert_eq!((held(1), held(3)), (2, 0), "node 3's catalog differs");
}

/// `POST /cluster/slots/leader` with replicas transfers a slot id's leadership:
/// asked of a node that does not lead it, the choice is committed in the group
/// through its leader and answered 200 once the target leads and the view names
/// it for every hash slot of the slot id (the others stay); every replica knows
/// the choice, the group's SENDs commit there, and the target restarted takes the
/// group back (the choice replayed from the log, not handed back to the home).
#[test]
fn a_slot_id_moved_by_hand_is_led_by_its_chosen_replica_through_a_restart() {
    let mut c = start();
    homes_lead(&c);
    let to = find_uid("moved-rcpt", |u| {
        let key = engine::channel::person_channel_key("sys", u);
        c.view.home_node(slots::hash_slot(key.as_bytes())) == 1
    });
    let key = engine::channel::person_channel_key("sys", &to);
    let hash_slot = slots::hash_slot(key.as_bytes());
    let slot_id = c.view.slots[hash_slot as usize].slot_id;
    let other = (0..SLOT_IDS).find(|&s| s % 3 == 0 && s != slot_id).unwrap();
    let revision = c.node(2).shared().view().revision;
    let (status, stale) = support::api(
        c.node(2),
        "/cluster/slots/leader",
        json!({"hash_slots": [hash_slot], "leader_node_id": 3, "revision": revision + 9}),
    );
    assert_eq!(status, 409, "{stale}");
    let (status, moved) = support::api(
        c.node(2),
        "/cluster/slots/leader",
        json!({"hash_slots": [hash_slot], "leader_node_id": 3}),
    );
    assert_eq!(status, 200, "{moved}");
    let slots = moved["slots"].as_array().unwrap();
    for s in slots {
        let leader = s["leader_node_id"].as_u64().unwrap();
        match s["slot_id"].as_u64().unwrap() as u32 {
            s if s == slot_id => assert_eq!(leader, 3, "every hash slot of the slot id"),
            s if s == other => assert_eq!(leader, 1, "another slot id of node 1 stays"),
            _ => {}
        }
    }
    let deadline = Instant::now() + WAIT;
    while !(1..=3).all(|n| c.node(n).shared().raft_status.preferred_of(slot_id) == Some(3)) {
        assert!(
            Instant::now() < deadline,
            "a replica never applied the choice"
        );
        std::thread::yield_now();
    }
    let (status, sent) = send(c.node(1), &to, "moved");
    assert_eq!((status, &sent["message_seq"]), (200, &json!(1)), "{sent}");
    assert_eq!(c.node(3).shared().raft_status.of(slot_id).unwrap().0, 3);
    // Restarted, node 3 takes the group back from whichever replica was elected
    // (every node's status, and its view: the claim).
    let config = c.nodes[2].shared().config.clone();
    c.nodes.remove(2).shutdown().unwrap();
    c.nodes
        .insert(2, engine::node::Node::start(config).unwrap());
    let deadline = Instant::now() + WAIT;
    let leads = |n: u64| {
        let shared = c.node(n).shared();
        let named = shared.view().slots[hash_slot as usize].leader_node_id;
        (shared.raft_status.of(slot_id).map(|(l, _)| l), named) == (Some(3), 3)
    };
    while !(1..=3).all(leads) {
        assert!(
            Instant::now() < deadline,
            "node 3 never led the slot id again"
        );
        std::thread::yield_now();
    }
    assert_eq!(
        c.node(3).shared().raft_status.preferred_of(slot_id),
        Some(3)
    );
    let (status, sent) = send(c.node(2), &to, "again");
    assert_eq!((status, &sent["message_seq"]), (200, &json!(2)), "{sent}");
}
