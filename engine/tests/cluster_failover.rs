//! Issue 13, failover: when a view moves hash slots, every gateway re-registers its
//! live sessions of those slots at the new authority at once (the rebuild queue,
//! `[session] rebuild_routes_per_s`), not only as clients ping. Three nodes on
//! 127.0.0.1 in this process (`support::cluster`).
//!
//! - The drill: ~1,000 idle clients spread over the three nodes (they never ping, so
//!   only the rebuild can put them back) and senders sending person and group
//!   messages throughout; a third of the hash slots move. Then `/user/onlinestatus`
//!   asked of each uid's new authority matches the connected set; every RECV any
//!   client got was addressed to it (and nothing reached a connection after it was
//!   closed); every SENDACKed message is read back by `/channel/messagesync` at its
//!   channel's home.
//! - A client that reconnects to another node while its slot moves ends with
//!   exactly one route at the new authority, and messages reach the new connection.
//!
//! Randomness is seeded: `FAILOVER_SEED=<n>` replays a run (the seed is printed).

#[macro_use]
mod support;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use engine::cluster::ClusterView;
use net::client::{Client, Received, RecvMessage};
use net::io::Backend;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use support::api;
use support::cluster::{login_any, Cluster};

/// How long a condition may take to hold before the test fails (a failure
/// detector, not a wait: every wait below polls its condition).
const CONVERGE: Duration = Duration::from_secs(30);
/// Idle clients of the drill (two descriptors each in this process).
const IDLE_CLIENTS: usize = 1_000;
const SENDERS: usize = 6;
const GROUPS: usize = 3;
const GROUP_IDLE_MEMBERS: usize = 20;
/// Each sender's messages before the slots move.
const WARM_MESSAGES: usize = 20;
/// Most messages one sender sends; then it waits for the drill's end, connected.
const SENDER_MESSAGES_MAX: usize = 1_000;
/// Idle clients closed (device_quit) and moved to another node during the drill.
const QUITS: usize = 10;
const RECONNECTS: usize = 10;

fn seed() -> u64 {
    let seed = std::env::var("FAILOVER_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x13_F0_13);
    eprintln!("failover seed: FAILOVER_SEED={seed}");
    seed
}

/// What a RECV must be to be addressed to `uid`: a person message whose payload
/// names `uid`, or a message of a group `uid` is a member of; with a good msg_key.
fn check_recv(
    uid: &str,
    m: &RecvMessage,
    groups: &BTreeMap<String, BTreeSet<String>>,
) -> Result<(), String> {
    let text = String::from_utf8_lossy(&m.payload);
    let ok = m.msg_key_ok
        && match m.channel_type {
            1 => m.channel_id == m.from_uid && text.starts_with(&format!("to={uid};")),
            2 => {
                groups.get(&m.channel_id).is_some_and(|g| g.contains(uid))
                    && text.starts_with(&format!("grp={};", m.channel_id))
            }
            _ => false,
        };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{uid} got a RECV not addressed to it: {m:?} ({text})"
        ))
    }
}

/// Pings and reads up to the PONG: every frame the node wrote before it; each RECV
/// checked.
fn drain(uid: &str, c: &mut Client, groups: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    c.ping().unwrap();
    let mut errors = Vec::new();
    loop {
        match c.read().unwrap_or_else(|e| panic!("{uid}: {e}")) {
            Received::Pong => return errors,
            Received::Recv(m) => errors.extend(check_recv(uid, &m, groups).err()),
            other => errors.push(format!("{uid}: unexpected {other:?}")),
        }
    }
}

/// Reads a closed connection to its end: each RECV before the close checked,
/// nothing at all after a DISCONNECT.
fn drain_closed(
    uid: &str,
    c: &mut Client,
    groups: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<String> {
    let seen = c
        .wait_closed()
        .unwrap_or_else(|e| panic!("{uid}: not closed: {e}"));
    let mut errors = Vec::new();
    let mut disconnected = false;
    for f in seen {
        match f {
            _ if disconnected => errors.push(format!("{uid}: {f:?} after its DISCONNECT")),
            Received::Disconnect { .. } => disconnected = true,
            Received::Recv(m) => errors.extend(check_recv(uid, &m, groups).err()),
            Received::Pong => {}
            other => errors.push(format!("{uid}: unexpected {other:?}")),
        }
    }
    errors
}

/// Reads a connection replaced by a login of the same device on another node: it
/// is closed (its route was at the authority when the new one registered: the
/// owner action closed it) or open without a route (its rebuild touch came after
/// the new route, which it conflicts with: ignored, rule 15). Either way every
/// RECV it got is checked, and nothing follows a DISCONNECT.
fn drain_replaced(
    uid: &str,
    c: &mut Client,
    groups: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<String> {
    let _ = c.ping();
    let mut errors = Vec::new();
    let mut disconnected = false;
    loop {
        match c.read() {
            Ok(f) if disconnected => errors.push(format!("{uid}: {f:?} after its DISCONNECT")),
            Ok(Received::Pong) => return errors,
            Ok(Received::Disconnect { .. }) => disconnected = true,
            Ok(Received::Recv(m)) => errors.extend(check_recv(uid, &m, groups).err()),
            Ok(other) => errors.push(format!("{uid}: unexpected {other:?}")),
            Err(e)
                if e.kind() == std::io::ErrorKind::UnexpectedEof
                    || e.kind() == std::io::ErrorKind::ConnectionReset
                    || e.kind() == std::io::ErrorKind::BrokenPipe =>
            {
                return errors
            }
            Err(e) => panic!("{uid}: {e}"),
        }
    }
}

/// One SENDACKed message: where to read it back.
#[derive(Debug, Clone)]
struct Acked {
    sender: String,
    channel_id: String,
    channel_type: u8,
    message_id: i64,
    message_seq: u64,
}

struct SenderOut {
    acked: Vec<Acked>,
    errors: Vec<String>,
}

/// A sender: person messages to random idle uids and messages to its groups, one
/// at a time (each waits for its SENDACK; RECVs in between are checked), until
/// `stop` says so (after `SENDER_MESSAGES_MAX` it waits for `stop`, still
/// connected). Signals `warm` after `WARM_MESSAGES`.
fn run_sender(
    uid: &str,
    mut c: Client,
    seed: u64,
    targets: &[String],
    groups: &BTreeMap<String, BTreeSet<String>>,
    stop: mpsc::Receiver<()>,
    warm: mpsc::Sender<()>,
) -> SenderOut {
    let mut rng = StdRng::seed_from_u64(seed);
    let my_groups: Vec<&String> = groups
        .iter()
        .filter(|(_, m)| m.contains(uid))
        .map(|(g, _)| g)
        .collect();
    let mut out = SenderOut {
        acked: Vec::new(),
        errors: Vec::new(),
    };
    for i in 1..=SENDER_MESSAGES_MAX {
        if i == WARM_MESSAGES + 1 {
            let _ = warm.send(());
        }
        if i > WARM_MESSAGES && stop.try_recv().is_ok() {
            break;
        }
        if i == SENDER_MESSAGES_MAX {
            let _ = stop.recv();
            break;
        }
        let (channel_id, channel_type, payload) = if rng.gen_bool(0.7) || my_groups.is_empty() {
            let to = &targets[rng.gen_range(0..targets.len())];
            (to.clone(), 1, format!("to={to};n={uid}/{i}"))
        } else {
            let g = my_groups[rng.gen_range(0..my_groups.len())];
            (g.clone(), 2, format!("grp={g};n={uid}/{i}"))
        };
        c.send(
            &channel_id,
            channel_type,
            i as u32,
            &format!("{uid}-{i}"),
            payload.as_bytes(),
            true,
        )
        .unwrap();
        loop {
            match c.read().unwrap_or_else(|e| panic!("sender {uid}: {e}")) {
                Received::Sendack {
                    client_seq,
                    message_id,
                    message_seq,
                    reason,
                } => {
                    assert_eq!(client_seq, i as u32);
                    if reason == 1 {
                        out.acked.push(Acked {
                            sender: uid.to_string(),
                            channel_id: channel_id.clone(),
                            channel_type,
                            message_id,
                            message_seq,
                        });
                    }
                    break;
                }
                Received::Recv(m) => out.errors.extend(check_recv(uid, &m, groups).err()),
                Received::Pong => {}
                other => out
                    .errors
                    .push(format!("sender {uid}: unexpected {other:?}")),
            }
        }
    }
    out.errors.extend(drain(uid, &mut c, groups));
    out
}

/// The authority of each of `uids` in `view`, and `/user/onlinestatus` asked of it:
/// the online uids (each once per device flag online).
fn online_at_authorities(
    cluster: &Cluster,
    view: &ClusterView,
    uids: &[String],
) -> BTreeMap<String, usize> {
    let mut by_node: BTreeMap<u64, Vec<&String>> = BTreeMap::new();
    for u in uids {
        by_node
            .entry(view.target_for_uid(u).leader_node_id)
            .or_default()
            .push(u);
    }
    let mut online = BTreeMap::new();
    for (node, asked) in by_node {
        let (status, reply) = api(cluster.node(node), "/user/onlinestatus", json!(asked));
        assert_eq!(status, 200, "{reply}");
        for e in reply.as_array().unwrap() {
            *online
                .entry(e["uid"].as_str().unwrap().to_string())
                .or_insert(0) += 1;
        }
    }
    online
}

/// Polls until every node holds `revision` and its rebuild queue is empty, and the
/// nodes together rebuilt at least `rebuilt_min` routes.
fn wait_rebuilt(cluster: &Cluster, revision: u64, rebuilt_min: u64) {
    let deadline = Instant::now() + CONVERGE;
    loop {
        let views = cluster
            .nodes
            .iter()
            .all(|n| n.shared().view().revision == revision);
        let queued: u64 = cluster
            .nodes
            .iter()
            .map(|n| support::metric(n, "imrouter_route_rebuild_queued"))
            .sum();
        let rebuilt: u64 = cluster
            .nodes
            .iter()
            .map(|n| support::metric(n, "imrouter_routes_rebuilt_total"))
            .sum();
        if views && queued == 0 && rebuilt >= rebuilt_min {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "rebuild not done: views at {revision}: {views}, queued {queued}, rebuilt {rebuilt} of at least {rebuilt_min}"
        );
        std::thread::yield_now();
    }
}

/// Polls `/user/onlinestatus` at the new authorities until it reports exactly
/// `expected` (each uid once); fails with the difference.
fn wait_online(
    cluster: &Cluster,
    view: &ClusterView,
    asked: &[String],
    expected: &BTreeSet<String>,
) -> Duration {
    let start = Instant::now();
    loop {
        let online = online_at_authorities(cluster, view, asked);
        let got: BTreeSet<String> = online.keys().cloned().collect();
        let twice: Vec<_> = online.iter().filter(|(_, &n)| n > 1).collect();
        if got == *expected && twice.is_empty() {
            return start.elapsed();
        }
        if start.elapsed() > CONVERGE {
            let missing: Vec<_> = expected.difference(&got).take(20).collect();
            let extra: Vec<_> = got.difference(expected).take(20).collect();
            panic!(
                "onlinestatus at the new authorities: {} missing (e.g. {missing:?}), {} extra \
                 (e.g. {extra:?}), more than one route: {twice:?}",
                expected.difference(&got).count(),
                got.difference(expected).count()
            );
        }
        std::thread::yield_now();
    }
}

/// Moves `n` random hash slots, each to a node other than its leader, with one
/// `POST /cluster/slots/leader` per new leader on one node; returns the final view.
fn move_slots(cluster: &Cluster, rng: &mut StdRng, n: usize) -> ClusterView {
    let mut view = cluster.node(1).shared().view().as_ref().clone();
    let mut slots: Vec<u16> = (0..256).collect();
    for i in 0..n {
        let j = rng.gen_range(i..slots.len());
        slots.swap(i, j);
    }
    let mut by_leader: BTreeMap<u64, Vec<u16>> = BTreeMap::new();
    for &s in &slots[..n] {
        let others: Vec<u64> = (1..=3)
            .filter(|&x| x != view.slots[s as usize].leader_node_id)
            .collect();
        by_leader
            .entry(others[rng.gen_range(0..2)])
            .or_default()
            .push(s);
    }
    let api_node = cluster.node(rng.gen_range(1..=3));
    for (leader, hash_slots) in by_leader {
        let (status, reply) = api(
            api_node,
            "/cluster/slots/leader",
            json!({"hash_slots": hash_slots, "leader_node_id": leader}),
        );
        assert_eq!(status, 200, "{reply}");
        for s in hash_slots {
            let slot = &mut view.slots[s as usize];
            slot.from_node_id = slot.leader_node_id;
            slot.leader_node_id = leader;
            slot.leader_term += 1;
        }
        view.revision += 1;
    }
    assert_eq!(*api_node.shared().view(), view);
    view
}

/// Every message in `acked` is in `/channel/messagesync` at its channel's home.
fn check_synced(cluster: &Cluster, acked: &[Acked]) {
    let mut by_channel: HashMap<(String, String, u8), Vec<&Acked>> = HashMap::new();
    for a in acked {
        let key = (a.sender.clone(), a.channel_id.clone(), a.channel_type);
        by_channel.entry(key).or_default().push(a);
    }
    for ((sender, channel_id, channel_type), msgs) in by_channel {
        let home = cluster.home_of(&sender, &channel_id, channel_type);
        let mut stored: HashMap<u64, i64> = HashMap::new();
        let mut start = 1;
        loop {
            let body = json!({"login_uid": sender, "channel_id": channel_id, "channel_type": channel_type,
                              "start_message_seq": start, "limit": 1000, "pull_mode": 1});
            let (status, reply) = api(cluster.node(home), "/channel/messagesync", body);
            assert_eq!(status, 200, "{reply}");
            let page = reply["messages"].as_array().unwrap();
            for m in page {
                stored.insert(
                    m["message_seq"].as_u64().unwrap(),
                    m["message_id"].as_i64().unwrap(),
                );
            }
            match page.last() {
                Some(last) if reply["more"] == 1 => {
                    start = last["message_seq"].as_u64().unwrap() + 1
                }
                _ => break,
            }
        }
        for a in msgs {
            assert_eq!(
                stored.get(&a.message_seq),
                Some(&a.message_id),
                "SENDACKed {a:?} not synced at its home node {home}"
            );
        }
    }
}

/// Creates the drill's groups at their homes: random idle members plus every sender.
fn make_groups(
    cluster: &Cluster,
    rng: &mut StdRng,
    idle: &[String],
    senders: &[String],
) -> BTreeMap<String, BTreeSet<String>> {
    let mut groups = BTreeMap::new();
    for g in 0..GROUPS {
        let gid = format!("fo-team{g}");
        let mut members: BTreeSet<String> = senders.iter().cloned().collect();
        while members.len() < senders.len() + GROUP_IDLE_MEMBERS {
            members.insert(idle[rng.gen_range(0..idle.len())].clone());
        }
        let home = cluster.home_of(&senders[0], &gid, 2);
        let (status, reply) = api(
            cluster.node(home),
            "/channel/subscriber_add",
            json!({"channel_id": gid, "channel_type": 2, "subscribers": members}),
        );
        assert_eq!(status, 200, "{reply}");
        groups.insert(gid, members);
    }
    groups
}

fn failover_drill(backend: Backend) {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let cluster = Cluster::start(backend);
    let idle: Vec<String> = (0..IDLE_CLIENTS).map(|i| format!("fo-u{i}")).collect();
    let senders: Vec<String> = (0..SENDERS).map(|i| format!("fo-s{i}")).collect();
    let groups = make_groups(&cluster, &mut rng, &idle, &senders);
    // Idle clients on random nodes; they never ping.
    let mut clients: BTreeMap<String, (u64, Client)> = BTreeMap::new();
    for u in &idle {
        let node = rng.gen_range(1..=3);
        clients.insert(u.clone(), (node, login_any(cluster.node(node), u)));
    }
    let (warm_tx, warm_rx) = mpsc::channel();
    let mut connected: BTreeSet<String> = idle.iter().chain(&senders).cloned().collect();
    let (view, outs, errors) = std::thread::scope(|s| {
        // Inside the scope: a failing check unwinds it, which drops these and so
        // ends the senders waiting for them (the scope joins its threads).
        let mut stops = Vec::new();
        let handles: Vec<_> = senders
            .iter()
            .enumerate()
            .map(|(k, uid)| {
                let c = login_any(cluster.node(k as u64 % 3 + 1), uid);
                let (stop_tx, stop) = mpsc::channel();
                stops.push(stop_tx);
                let (groups, idle, warm) = (&groups, &idle, warm_tx.clone());
                s.spawn(move || run_sender(uid, c, seed ^ (k as u64 + 1), idle, groups, stop, warm))
            })
            .collect();
        for _ in 0..SENDERS {
            warm_rx.recv_timeout(CONVERGE).expect("a sender warmed up");
        }
        // The drill: a third of the hash slots move while messages flow.
        let view = move_slots(&cluster, &mut rng, 256 / 3);
        let moved = |u: &str| cluster.view.target_for_uid(u) != view.target_for_uid(u);
        let moved_idle = idle.iter().filter(|u| moved(u)).count() as u64;
        let moved_senders = senders.iter().filter(|u| moved(u)).count() as u64;
        // Meanwhile some clients quit and others reconnect to another node.
        let mut errors = Vec::new();
        let picked: Vec<String> = {
            let mut p = BTreeSet::new();
            while p.len() < QUITS + RECONNECTS {
                p.insert(idle[rng.gen_range(0..idle.len())].clone());
            }
            p.into_iter().collect()
        };
        for (i, u) in picked.iter().enumerate() {
            let (node, mut old) = clients.remove(u).unwrap();
            if i < QUITS {
                let (status, reply) = api(
                    cluster.node(node),
                    "/user/device_quit",
                    json!({"uid": u, "device_flag": -1}),
                );
                assert_eq!(status, 200, "{reply}");
                errors.extend(drain_closed(u, &mut old, &groups));
                connected.remove(u);
            } else {
                let to = node % 3 + 1;
                let new = login_any(cluster.node(to), u);
                errors.extend(drain_replaced(u, &mut old, &groups));
                clients.insert(u.clone(), (to, new));
            }
        }
        let churned = picked.iter().filter(|u| moved(u)).count() as u64;
        wait_rebuilt(
            &cluster,
            view.revision,
            moved_idle + moved_senders - churned,
        );
        let asked: BTreeSet<String> = connected
            .iter()
            .cloned()
            .chain(picked.iter().cloned())
            .chain((0..50).map(|i| format!("fo-never{i}")))
            .collect();
        let asked: Vec<String> = asked.into_iter().collect();
        let took = wait_online(&cluster, &view, &asked, &connected);
        eprintln!(
            "moved {} hash slots: {moved_idle} idle and {moved_senders} sending sessions in them; \
             onlinestatus matched {took:?} after the rebuild metric said done",
            256 / 3
        );
        for stop in &stops {
            let _ = stop.send(());
        }
        let outs: Vec<SenderOut> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        (view, outs, errors)
    });
    let _ = view;
    let mut errors = errors;
    for (u, (_, c)) in clients.iter_mut() {
        errors.extend(drain(u, c, &groups));
    }
    let mut acked = Vec::new();
    for o in outs {
        errors.extend(o.errors);
        acked.extend(o.acked);
    }
    assert!(
        errors.is_empty(),
        "seed {seed}: {} bad RECVs: {:?}",
        errors.len(),
        &errors[..errors.len().min(10)]
    );
    assert!(
        acked.len() >= SENDERS * WARM_MESSAGES,
        "{} messages acknowledged",
        acked.len()
    );
    check_synced(&cluster, &acked);
    for (i, n) in cluster.nodes.iter().enumerate() {
        eprintln!(
            "node {}: routes rebuilt {}, last rebuild {} ms (slowest shard), recvs {}, stale pushes {}",
            i + 1,
            support::metric(n, "imrouter_routes_rebuilt_total"),
            support::metric(n, "imrouter_route_rebuild_last_ms"),
            support::metric(n, "imrouter_recvs_total"),
            support::metric(n, "imrouter_push_stale_total"),
        );
    }
    eprintln!("{} messages acknowledged and synced", acked.len());
}

/// Clients whose slots move reconnect to another node at once, racing their old
/// session's rebuild: each uid ends with exactly one route, at its new authority,
/// and a message sent afterwards reaches the new connection only.
fn reconnect_during_the_drill_leaves_one_route(backend: Backend) {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let cluster = Cluster::start(backend);
    let uids: Vec<String> = (0..60).map(|i| format!("fo-r{i}")).collect();
    let mut old: Vec<(u64, Client)> = uids
        .iter()
        .map(|u| {
            let node = rng.gen_range(1..=3);
            (node, login_any(cluster.node(node), u))
        })
        .collect();
    let view = move_slots(&cluster, &mut rng, 256 / 3);
    let groups = BTreeMap::new();
    let mut errors = Vec::new();
    let mut new: Vec<Client> = Vec::new();
    for (u, (node, c)) in uids.iter().zip(old.iter_mut()) {
        let to = (*node + rng.gen_range(0..2)) % 3 + 1;
        new.push(login_any(cluster.node(to), u));
        errors.extend(drain_replaced(u, c, &groups));
    }
    let moved = uids
        .iter()
        .filter(|u| cluster.view.target_for_uid(u) != view.target_for_uid(u))
        .count();
    assert!(moved > 0, "seed {seed}: some uid's slot moved");
    wait_rebuilt(&cluster, view.revision, 0);
    let expected: BTreeSet<String> = uids.iter().cloned().collect();
    wait_online(&cluster, &view, &uids, &expected);
    // A message to each reaches its new connection.
    let mut sender = login_any(cluster.node(1), "fo-r-sender");
    for (i, (u, c)) in uids.iter().zip(new.iter_mut()).enumerate() {
        let seq = i as u32 + 1;
        sender
            .send(
                u,
                1,
                seq,
                &format!("r-{i}"),
                format!("to={u};").as_bytes(),
                true,
            )
            .unwrap();
        loop {
            match sender.read().unwrap() {
                Received::Sendack {
                    client_seq, reason, ..
                } if client_seq == seq => {
                    assert_eq!(reason, 1);
                    break;
                }
                Received::Pong => {}
                other => panic!("sender: unexpected {other:?}"),
            }
        }
        match c.read().unwrap() {
            Received::Recv(m) => errors.extend(check_recv(u, &m, &groups).err()),
            other => panic!("seed {seed}: {u}: expected its RECV, got {other:?}"),
        }
        errors.extend(drain(u, c, &groups));
    }
    assert!(errors.is_empty(), "seed {seed}: {errors:?}");
}

#[test]
fn failover_drill_mio() {
    failover_drill(Backend::Mio);
}

on_both_drivers!(reconnect_during_the_drill_leaves_one_route);
