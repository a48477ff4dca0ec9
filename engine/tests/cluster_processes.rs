//! Issue 13 with real processes: three `imrouter` processes on 127.0.0.1
//! (`support::processes`), killed with SIGKILL and restarted by the tests.
//!
//! - Hostile peers on a node's RPC port (a dialer with another cluster secret, a
//!   node id that is not a peer, garbage bytes) are refused: the connection is
//!   closed and `imrouter_rpc_refused_total` grows; the cluster is unaffected.
//! - `kill -9` of one node mid-load: the other nodes keep serving what is not homed
//!   on it, SENDs to its channels are answered SENDACK 10, an operator moves its
//!   authority slots, and when it restarts it has a new boot id, learns the
//!   current view and serves clients again; its old sessions never get a RECV.
//! - A node that comes up is dialed back at once by its peers (not after their
//!   backoff), so the replies to its requests have a way back.
//! - A client of the killed node logs in on another node at once (the close owner
//!   action toward the dead node counts as done), and a session whose authority
//!   died with it is rebuilt at the new authority after the drill.
//!
//! Every wait is bounded and only detects a failure; no test depends on timing.

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use net::client::{Client, Login, Received};
use proto::rpc::auth::HANDSHAKE_FRAME_BYTES_MAX;
use proto::rpc::{FrameLimits, Handshake, Identity, Kind, Outcome, Refusal};
use rand::{Rng, SeedableRng};
use support::cluster::{find_uid, nothing_more, rpc_key, SLOT_IDS};
use support::processes::{Processes, NODES, SECRET};
use support::{next_recv, next_sendack};

/// Reads from clients and raw sockets time out after this (a failure detector).
const READ_TIMEOUT: Duration = Duration::from_secs(10);
const REFUSED: &str = "imrouter_rpc_refused_total";
const STALE: &str = "imrouter_push_stale_total";

fn login(p: &Processes, node: u64, uid: &str) -> (Client, u8) {
    Client::connect(p.tcp_addr(node), &Login::new(uid, "any"), READ_TIMEOUT)
        .unwrap_or_else(|e| panic!("CONNECT of {uid} on node {node}: {e}"))
}

fn logged_in(p: &Processes, node: u64, uid: &str) -> Client {
    let (client, reason) = login(p, node, uid);
    assert_eq!(reason, 1, "CONNACK for {uid} on node {node}");
    client
}

/// Logins of a test's set-up, right after [`start_ready`]: CI saw one of them
/// answered CONNACK 15 (one request failure on the gateway's shard, every link up,
/// not reproduced in 1,200 local runs). A set-up login so refused is tried again
/// (at most [`SETUP_LOGIN_TRIES`] times), each refusal printed with the node's
/// metrics and logs (the harness logs the links and hops at debug level), so the
/// test goes on to what it checks and the cause is on record.
fn logged_in_at_start(p: &Processes, node: u64, uid: &str) -> Client {
    for attempt in 1..SETUP_LOGIN_TRIES {
        let (client, reason) = login(p, node, uid);
        if reason == 1 {
            return client;
        }
        eprintln!("set-up login of {uid} on node {node}: CONNACK {reason} (try {attempt})");
        p.print_log_tail(node);
    }
    logged_in(p, node, uid)
}

/// Tries of a set-up login ([`logged_in_at_start`]).
const SETUP_LOGIN_TRIES: u32 = 3;

/// The next SENDACK's `(client_seq, reason)`.
fn sendack(c: &mut Client) -> (u32, u8) {
    let (client_seq, _, _, reason) = next_sendack(c);
    (client_seq, reason)
}

/// `from` sends `text` to `to` (person channel); the SENDACK is success and `to`
/// gets it as a RECV, and nothing else.
fn exchange(from: &mut Client, from_uid: &str, to: &mut Client, to_uid: &str, text: &str) {
    from.send(to_uid, 1, 1, text, text.as_bytes(), true)
        .unwrap();
    assert_eq!(sendack(from).1, 1, "SENDACK of {text:?}");
    let m = next_recv(to);
    assert!(m.msg_key_ok);
    assert_eq!(
        (m.from_uid.as_str(), m.payload.as_slice()),
        (from_uid, text.as_bytes())
    );
    to.recvack(m.message_id, m.message_seq).unwrap();
    nothing_more(to);
}

/// Three nodes, each ready and seen up by both others (every shard of every node
/// has its links up). `/readyz` needs only a majority of the nodes: a node may be
/// ready while one shard's link to the third node is still dialing, and a CONNECT
/// whose token or authority is on that node is then answered 15 (seen in CI).
fn start_ready() -> Processes {
    all_up(Processes::start_all())
}

/// Waits until every node of `p` is ready and seen up by every other node.
fn all_up(mut p: Processes) -> Processes {
    for id in 1..=NODES as u64 {
        p.wait_ready(id);
    }
    for id in 1..=NODES as u64 {
        let boot = own_boot_id(&p, id);
        p.wait_until(id, "every node sees it up", |p| all_see_up(p, id, boot));
    }
    p
}

fn all_ready(p: &Processes, nodes: &[u64]) {
    for &id in nodes {
        let (status, body) = p.get(id, "/readyz").expect("node answers");
        assert_eq!(status, 200, "node {id}: {body}");
    }
}

// ---------------------------------------------------------------------------
// (a) Hostile peers.

/// Reads until the peer closes (EOF or reset); what arrived before. A connection
/// still open after [`READ_TIMEOUT`] fails the test.
fn read_until_closed(s: &mut TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match s.read(&mut chunk) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return got,
            Err(e) => panic!("the node did not close the connection: {e}"),
        }
    }
}

/// Reads one whole handshake frame.
fn read_frame(s: &mut TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
    let limits = handshake_limits();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 512];
    loop {
        if let Some(f) = proto::rpc::decode(&buf, limits).unwrap() {
            let n = f.wire_len();
            return buf[..n].to_vec();
        }
        let n = s.read(&mut chunk).unwrap();
        assert!(n > 0, "closed before a whole frame");
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn handshake_limits() -> FrameLimits {
    FrameLimits {
        rpc_frame_bytes_max: HANDSHAKE_FRAME_BYTES_MAX,
    }
}

/// The frames in `bytes` are exactly one Goodbye; gives its reason text.
fn goodbye_reason(bytes: &[u8]) -> String {
    let f = proto::rpc::decode(bytes, handshake_limits())
        .unwrap()
        .unwrap_or_else(|| panic!("no whole frame before the close: {bytes:?}"));
    assert_eq!(f.header.kind, Kind::Goodbye);
    assert_eq!(f.wire_len(), bytes.len(), "nothing after the Goodbye");
    String::from_utf8_lossy(f.body).into_owned()
}

/// A dialer claiming to be peer `claimed` of node `listener`, keyed with another
/// secret. The node's Challenge does not verify under that secret; a Proof MACed
/// with it (over the node's real ids and nonce: a wrong-secret listener machine
/// forges the Challenge the dialer accepts) is refused with a Goodbye and a close.
fn wrong_secret_peer(rpc: SocketAddr, listener: u64, claimed: u64, rng: &mut impl Rng) {
    let wrong = rpc_key(b"another-secret-of-enough-bytes", SLOT_IDS);
    let me = Identity {
        node_id: claimed,
        boot_id: rng.gen(),
    };
    let nonce_d: [u8; 32] = rng.gen();
    let mut hello = Vec::new();
    let mut dialer = Handshake::dialer(&wrong, me, listener, nonce_d, &mut hello);
    let mut s = TcpStream::connect(rpc).unwrap();
    s.write_all(&hello).unwrap();
    let challenge = read_frame(&mut s);
    // The node's MAC does not verify under the wrong secret.
    let mut probe = Handshake::dialer(&wrong, me, listener, nonce_d, &mut Vec::new());
    let step = probe.receive(&challenge, &mut Vec::new());
    assert_eq!(step.outcome, Outcome::Refused(Refusal::BadMac));
    // The same transcript MACed with the wrong secret: the dialer proceeds.
    let c = proto::rpc::decode(&challenge, handshake_limits())
        .unwrap()
        .unwrap();
    let node = Identity {
        node_id: c.header.sender_node_id,
        boot_id: c.header.sender_boot_id,
    };
    assert_eq!(node.node_id, listener);
    let nonce_l: [u8; 32] = c.body[..32].try_into().unwrap();
    let mut forged = Vec::new();
    let mut liar = Handshake::listener(&wrong, node, &[claimed], nonce_l);
    liar.receive(&hello, &mut forged);
    let mut proof = Vec::new();
    let step = dialer.receive(&forged, &mut proof);
    assert!(
        matches!(step.outcome, Outcome::Established { .. }),
        "{step:?}"
    );
    s.write_all(&proof).unwrap();
    let reason = goodbye_reason(&read_until_closed(&mut s));
    assert!(reason.contains("MAC does not verify"), "{reason}");
}

/// A dialer with the right secret whose node id is not in the cluster: refused at
/// its Hello.
fn unknown_node_peer(rpc: SocketAddr, listener: u64, rng: &mut impl Rng) {
    let secret = rpc_key(SECRET.as_bytes(), SLOT_IDS);
    let me = Identity {
        node_id: 9,
        boot_id: rng.gen(),
    };
    let mut hello = Vec::new();
    let _dialer = Handshake::dialer(&secret, me, listener, rng.gen(), &mut hello);
    let mut s = TcpStream::connect(rpc).unwrap();
    s.write_all(&hello).unwrap();
    let reason = goodbye_reason(&read_until_closed(&mut s));
    assert!(reason.contains("node 9 is not a peer"), "{reason}");
}

/// Random bytes (behind a text line, so the magic is wrong) on the RPC port.
fn garbage_peer(rpc: SocketAddr, rng: &mut impl Rng) {
    let mut bytes = b"GET / HTTP/1.1\r\n\r\n".to_vec();
    bytes.extend((0..200).map(|_| rng.gen::<u8>()));
    let mut s = TcpStream::connect(rpc).unwrap();
    // The node may close before it read everything: a reset here is fine.
    let _ = s.write_all(&bytes);
    read_until_closed(&mut s);
}

#[test]
fn hostile_peers_are_refused_and_the_cluster_is_unaffected() {
    let seed: u64 = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(13);
    eprintln!("CHAOS_SEED={seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut p = start_ready();
    let refused_before: Vec<u64> = (1..=3).map(|id| p.metric(id, REFUSED)).collect();

    wrong_secret_peer(p.rpc_addr(1), 1, 2, &mut rng);
    unknown_node_peer(p.rpc_addr(2), 2, &mut rng);
    garbage_peer(p.rpc_addr(3), &mut rng);
    garbage_peer(p.rpc_addr(1), &mut rng);

    // Each refusal is counted by the node that refused it.
    for (id, more) in [(1u64, 2u64), (2, 1), (3, 1)] {
        let want = refused_before[id as usize - 1] + more;
        p.wait_until(id, &format!("{REFUSED} reaches {want}"), |p| {
            p.metric(id, REFUSED) >= want
        });
    }
    // The cluster is unaffected: ready everywhere, a person message across nodes
    // (sender on 1, recipient on 3, the recipient's authority on 2).
    all_ready(&p, &[1, 2, 3]);
    let a = "hostile-a";
    let b = find_uid("hostile-b", |b| p.authority_of(b) == 2);
    let mut ca = logged_in(&p, 1, a);
    let mut cb = logged_in(&p, 3, &b);
    exchange(&mut ca, a, &mut cb, &b, "unaffected");
    exchange(&mut cb, &b, &mut ca, a, "and back");
    for id in 1..=3 {
        assert_eq!(
            p.metric(id, REFUSED),
            refused_before[id as usize - 1] + [2, 1, 1][id as usize - 1],
            "node {id}: only the hostile connections were refused"
        );
    }
}

// ---------------------------------------------------------------------------
// (b) kill -9 mid-load, the drill, the restart.

/// The node killed in the test.
const VICTIM: u64 = 3;

/// The uids of the kill test, chosen by placement in the initial view.
struct Cast {
    /// On node 1; sends the load.
    a: String,
    /// On node 2; receives the load (authorities and the channel's home live).
    b: String,
    /// Not logged in; the channel a→c is homed on the victim.
    c: String,
    /// On the victim before the kill (authority live, channel a↔d homed live).
    d: String,
    /// Authority on the victim (moved by the drill); logs in on node 2 after it.
    e: String,
    /// On node 2 (authority live); its SENDs to h are in flight at the kill.
    g: String,
    /// Not logged in; the channel g→h is homed on the victim.
    h: String,
}

impl Cast {
    fn choose(p: &Processes) -> Cast {
        let live = |n: u64| n != VICTIM;
        let a = find_uid("kill-a", |u| live(p.authority_of(u)));
        let b = find_uid("kill-b", |u| {
            live(p.authority_of(u)) && live(p.home_of(&a, u, 1))
        });
        let c = find_uid("kill-c", |u| p.home_of(&a, u, 1) == VICTIM);
        let d = find_uid("kill-d", |u| {
            live(p.authority_of(u)) && live(p.home_of(&a, u, 1))
        });
        let e = find_uid("kill-e", |u| {
            p.authority_of(u) == VICTIM && live(p.home_of(&a, u, 1))
        });
        let g = find_uid("kill-g", |u| live(p.authority_of(u)));
        let h = find_uid("kill-h", |u| p.home_of(&g, u, 1) == VICTIM);
        Cast {
            a,
            b,
            c,
            d,
            e,
            g,
            h,
        }
    }
}

/// What the load thread reports: SENDs acknowledged so far.
type Progress = mpsc::Receiver<u32>;

/// `a` sends windows of 8 messages to `b` until `stop`, every SENDACK success,
/// then a last message "end"; reports the count after each window. Gives the
/// client and the number sent before "end".
fn spawn_load(
    mut a: Client,
    b: String,
    stop: Arc<AtomicBool>,
) -> (std::thread::JoinHandle<(Client, u32)>, Progress) {
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::spawn(move || {
        let mut sent = 0u32;
        while !stop.load(Ordering::Acquire) {
            for k in sent + 1..=sent + 8 {
                let text = format!("load-{k}");
                a.send(&b, 1, k, &text, text.as_bytes(), true).unwrap();
            }
            for k in sent + 1..=sent + 8 {
                assert_eq!(sendack(&mut a), (k, 1), "SENDACK of load-{k}");
            }
            sent += 8;
            let _ = tx.send(sent);
        }
        a.send(&b, 1, sent + 1, "end", b"end", true).unwrap();
        assert_eq!(sendack(&mut a), (sent + 1, 1), "SENDACK of end");
        (a, sent)
    });
    (handle, rx)
}

/// `b` reads RECVs (acknowledging each) until "end"; gives the payloads before it.
fn spawn_reader(mut b: Client) -> std::thread::JoinHandle<(Client, Vec<String>)> {
    std::thread::spawn(move || {
        let mut got = Vec::new();
        loop {
            let m = next_recv(&mut b);
            assert!(!m.dup, "a RECV sent twice: {m:?}");
            b.recvack(m.message_id, m.message_seq).unwrap();
            let text = String::from_utf8(m.payload).unwrap();
            if text == "end" {
                return (b, got);
            }
            got.push(text);
        }
    })
}

/// Waits (bounded) until the load has reported at least `n` acknowledged SENDs;
/// gives the latest count it reported.
fn wait_progress(progress: &Progress, n: u32) -> u32 {
    let mut sent = 0;
    while sent < n {
        sent = progress
            .recv_timeout(READ_TIMEOUT)
            .expect("the load makes progress");
    }
    while let Ok(later) = progress.try_recv() {
        sent = later;
    }
    sent
}

/// While the victim is down: SENDs to a channel homed on it are answered SENDACK
/// 10 (each, not a hang); a login whose authority is on it is refused (not a hang).
fn victim_down_answers(p: &Processes, a: &mut Client, cast: &Cast) {
    for k in 1..=3u32 {
        let text = format!("to-the-dead-home-{k}");
        a.send(&cast.c, 1, 100 + k, &text, text.as_bytes(), true)
            .unwrap();
        assert_eq!(
            sendack(a),
            (100 + k, 10),
            "SENDACK 10 (FORWARD_SEND_PACKET_ERROR) for {text}"
        );
    }
    let (_e, reason) = login(p, 2, &cast.e);
    eprintln!(
        "login of {} while its authority is down: CONNACK {reason}",
        cast.e
    );
    assert_ne!(
        reason, 1,
        "no authority for {} while node 3 is down",
        cast.e
    );
}

/// `POST /cluster/slots/leader` on node 1 moves the victim's hash slots to node 1;
/// gives the new revision once node 2 has it too.
fn drill(p: &mut Processes) -> (u64, Vec<u16>) {
    let moved = p.slots_led_by(VICTIM);
    let body = serde_json::json!({"hash_slots": moved, "leader_node_id": 1}).to_string();
    let (status, reply) = p
        .api(1, "POST", "/cluster/slots/leader", &body)
        .expect("node 1 answers");
    assert_eq!(status, 200, "{reply}");
    let reply: serde_json::Value = serde_json::from_str(&reply).unwrap();
    let revision = reply["revision"].as_u64().unwrap();
    p.wait_until(2, "node 2 has the drill's view", |p| {
        p.slots(2)
            .is_some_and(|v| view_has_moved(&v, revision, &moved))
    });
    (revision, moved)
}

/// Whether `/cluster/slots` shows `revision` and node 1 leading every `moved` slot.
fn view_has_moved(slots: &serde_json::Value, revision: u64, moved: &[u16]) -> bool {
    slots["revision"].as_u64() == Some(revision)
        && moved
            .iter()
            .all(|&h| slots["slots"][h as usize]["leader_node_id"].as_u64() == Some(1))
}

/// How node `observer` sees node `node` in `/cluster/slots`: its state (`self`,
/// `up`: every shard of the observer has an up link to it, `unreachable`) and the
/// boot id its links reported.
fn node_seen(p: &Processes, observer: u64, node: u64) -> Option<(String, Option<u64>)> {
    let slots = p.slots(observer)?;
    let n = slots["nodes"]
        .as_array()?
        .iter()
        .find(|n| n["id"].as_u64() == Some(node))?
        .clone();
    let boot = n["boot_id"].as_str().map(|b| b.parse().unwrap());
    Some((n["state"].as_str()?.to_string(), boot))
}

/// Node `id`'s own boot id, from its `/cluster/slots`.
fn own_boot_id(p: &Processes, id: u64) -> u64 {
    let (state, boot) = node_seen(p, id, id).expect("node answers /cluster/slots");
    assert_eq!(state, "self");
    boot.expect("a node knows its own boot id")
}

/// Whether every live node sees `node` up with boot id `boot` (each of its shards
/// has an up link to that process).
fn all_see_up(p: &Processes, node: u64, boot: u64) -> bool {
    (1..=NODES as u64)
        .filter(|&o| o != node)
        .all(|o| node_seen(p, o, node) == Some(("up".into(), Some(boot))))
}

/// SENDs of `g` toward the victim's home acknowledged before the kill, then as
/// many written just before it.
const TOWARD_THE_VICTIM: u32 = 8;

/// `g` sends [`TOWARD_THE_VICTIM`] messages to `h` (homed on the victim), each
/// acknowledged success, then pipelines as many more without reading their
/// SENDACKs (they are in flight when the test kills the victim).
fn send_toward_the_victim(g: &mut Client, h: &str) {
    let n = TOWARD_THE_VICTIM;
    for k in 1..=2 * n {
        let text = format!("toward-{k}");
        g.send(h, 1, k, &text, text.as_bytes(), true).unwrap();
        if k == n {
            for k in 1..=n {
                assert_eq!(sendack(g), (k, 1), "SENDACK of toward-{k}");
            }
        }
    }
}

/// Every SEND `g` had in flight at the kill is answered, success (1) or the
/// forward's failure (10), none twice; gives the client_msg_nos of all of `g`'s
/// SENDs answered 1.
fn in_flight_answers(g: &mut Client) -> Vec<String> {
    let n = TOWARD_THE_VICTIM;
    let mut answered = std::collections::BTreeMap::new();
    for _ in 0..n {
        let (seq, reason) = sendack(g);
        assert!(
            matches!(reason, 1 | 10),
            "SENDACK {reason} for toward-{seq}"
        );
        assert!(answered.insert(seq, reason).is_none(), "toward-{seq} twice");
    }
    let seqs: Vec<u32> = answered.keys().copied().collect();
    assert_eq!(seqs, (n + 1..=2 * n).collect::<Vec<_>>());
    nothing_more(g);
    let late = answered.iter().filter(|(_, &r)| r == 1).map(|(&k, _)| k);
    (1..=n).chain(late).map(|k| format!("toward-{k}")).collect()
}

/// The client_msg_nos of channel g→h stored at its home (`/channel/messagesync`
/// on the victim, as `g`).
fn synced(p: &Processes, cast: &Cast) -> Vec<String> {
    let body = serde_json::json!({"login_uid": cast.g, "channel_id": cast.h, "channel_type": 1,
        "start_message_seq": 0, "end_message_seq": 0, "limit": 100, "pull_mode": 1})
    .to_string();
    let (status, reply) = p
        .api(VICTIM, "POST", "/channel/messagesync", &body)
        .expect("node 3 answers");
    assert_eq!(status, 200, "{reply}");
    let reply: serde_json::Value = serde_json::from_str(&reply).unwrap();
    reply["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["client_msg_no"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn kill9_mid_load_then_drill_then_restart() {
    let mut p = start_ready();
    let cast = Cast::choose(&p);
    let boot_before = own_boot_id(&p, VICTIM);
    let a = logged_in_at_start(&p, 1, &cast.a);
    let b = logged_in_at_start(&p, 2, &cast.b);
    let mut d_old = logged_in_at_start(&p, VICTIM, &cast.d);
    let mut g = logged_in_at_start(&p, 2, &cast.g);

    // Mid-load: a on node 1 → b on node 2; the victim dies between windows.
    let stop = Arc::new(AtomicBool::new(false));
    let reader = spawn_reader(b);
    let (load, progress) = spawn_load(a, cast.b.clone(), stop.clone());
    let at_kill = wait_progress(&progress, 24);
    send_toward_the_victim(&mut g, &cast.h);
    p.kill9(VICTIM);
    let acknowledged = in_flight_answers(&mut g);
    wait_progress(&progress, at_kill + 24);
    stop.store(true, Ordering::Release);
    let (mut a, sent) = load.join().unwrap();
    let (mut b, got) = reader.join().unwrap();
    eprintln!("load: {sent} messages, node 3 killed after {at_kill}");
    let want: Vec<String> = (1..=sent).map(|k| format!("load-{k}")).collect();
    assert_eq!(
        got, want,
        "every acknowledged message reached b once, in order"
    );

    // The session on the victim died with it, without a RECV.
    let seen = d_old.wait_closed().unwrap();
    assert!(
        !seen.iter().any(|f| matches!(f, Received::Recv(_))),
        "{seen:?}"
    );
    victim_down_answers(&p, &mut a, &cast);
    exchange(&mut b, &cast.b, &mut a, &cast.a, "still-serving");

    // The drill moves the victim's authority slots; a login they cover works.
    let (revision, moved) = drill(&mut p);
    let mut e = logged_in(&p, 2, &cast.e);
    exchange(&mut a, &cast.a, &mut e, &cast.e, "after-the-drill");

    // The victim restarts: ready, a new boot id, the current view.
    p.restart(VICTIM);
    p.wait_ready(VICTIM);
    p.wait_until(VICTIM, "node 3 learned the drill's view", |p| {
        p.slots(VICTIM)
            .is_some_and(|v| view_has_moved(&v, revision, &moved))
    });
    let boot_after = own_boot_id(&p, VICTIM);
    assert_ne!(boot_after, boot_before, "a new process, a new boot id");
    // The live nodes link back to it (their links' view of it: up, the new boot).
    p.wait_until(VICTIM, "nodes 1 and 2 see node 3 up again", |p| {
        all_see_up(p, VICTIM, boot_after)
    });
    all_ready(&p, &[1, 2, 3]);
    // Every SEND acknowledged before the kill is stored at the restarted home,
    // once (one answered 10 may be stored too: its answer was lost, not its append).
    let stored = synced(&p, &cast);
    for no in &acknowledged {
        assert_eq!(
            stored.iter().filter(|s| *s == no).count(),
            1,
            "{no} in {stored:?}"
        );
    }
    eprintln!(
        "toward the victim: {} acknowledged, {} stored at its home",
        acknowledged.len(),
        stored.len()
    );

    // d's old route (old boot id) is still at d's live authority: a message to d
    // now is pushed to the restarted process, which drops it (fenced, counted).
    let stale_before = p.metric(VICTIM, STALE);
    a.send(
        &cast.d,
        1,
        300,
        "while-d-was-away",
        b"while-d-was-away",
        true,
    )
    .unwrap();
    assert_eq!(sendack(&mut a), (300, 1));
    p.wait_until(VICTIM, "the push to d's old session is dropped", |p| {
        p.metric(VICTIM, STALE) > stale_before
    });

    // A client that reconnects to it works (the old route is replaced), and the
    // channels homed on it are served again.
    let mut d = logged_in(&p, VICTIM, &cast.d);
    exchange(&mut a, &cast.a, &mut d, &cast.d, "after-the-restart");
    exchange(&mut d, &cast.d, &mut b, &cast.b, "from-the-restarted-node");
    a.send(&cast.c, 1, 200, "home-back", b"home-back", true)
        .unwrap();
    assert_eq!(sendack(&mut a), (200, 1), "the victim's home serves again");
    nothing_more(&mut a);
}

/// Link limits under which a link that closed (or failed to dial) waits one to
/// two minutes before its next dial: longer than any wait of the tests.
const SLOW_REDIAL: &str = "[rpc]\nrpc_backoff_min_ms = 120000\nrpc_backoff_ms_max = 120000\n";

/// A node that comes up (at the cluster's start, or restarted with a new boot id)
/// is dialed back at once by the nodes it dialed, not after their backoff: every
/// shard of every live node has its link to it up again (a reply goes back on
/// that link: without it the replies to the restarted node's requests were
/// dropped, and its CONNECTs failed with 15 until the backoff passed, up to
/// `rpc_backoff_ms_max`). Backoff is two minutes here, so only the dial-back can
/// make the links come up within the test's waits.
#[test]
fn a_node_that_comes_up_is_dialed_back_at_once() {
    let mut p = all_up(Processes::start_all_with(SLOW_REDIAL));
    let boot_before = own_boot_id(&p, VICTIM);
    p.kill9(VICTIM);
    p.restart(VICTIM);
    p.wait_ready(VICTIM);
    let boot = own_boot_id(&p, VICTIM);
    assert_ne!(boot, boot_before, "a new process, a new boot id");
    p.wait_until(VICTIM, "nodes 1 and 2 dial node 3 back", |p| {
        all_see_up(p, VICTIM, boot)
    });
    // A login on node 3 whose authority is on node 1 or 2: the register's reply
    // comes back.
    let uid = find_uid("back", |u| p.authority_of(u) != VICTIM);
    let (_client, reason) = login(&p, VICTIM, &uid);
    assert_eq!(reason, 1, "CONNACK for {uid} on the restarted node");
}

// ---------------------------------------------------------------------------
// Failover after a kill.

/// Issue 13, Failover: "kill -9 of a node: its clients reconnect elsewhere". A
/// client of the killed node reconnecting on another node (same uid and device)
/// while it is down: its old route, at a live authority, names the dead node; the
/// close owner action toward a node whose link is down counts as done
/// (`imrouter_owner_actions_owner_down_total`), so the login gets CONNACK 1 (it
/// was CONNACK 15 under rule 11 until the old route's TTL).
#[test]
fn a_client_of_the_killed_node_reconnects_elsewhere() {
    let mut p = start_ready();
    let cast = Cast::choose(&p);
    let _d_old = logged_in_at_start(&p, VICTIM, &cast.d);
    p.kill9(VICTIM);
    drill(&mut p);
    let (_d, reason) = login(&p, 1, &cast.d);
    assert_eq!(
        reason, 1,
        "{} reconnects on node 1 while node 3 is down",
        cast.d
    );
}

/// Issue 13, Failover: "When a view moves slots, gateways re-register their live
/// sessions of those slots with the new authority at once". A session on node 2
/// whose authority died with node 3 is rebuilt at node 1 after the drill (the
/// rebuild queue, not its next touch): `/user/onlinestatus` at the new authority
/// shows it, and a message to it is pushed.
#[test]
fn sessions_whose_authority_died_are_rebuilt_after_the_drill() {
    let mut p = start_ready();
    let cast = Cast::choose(&p);
    let f = find_uid("kill-f", |u| {
        p.authority_of(u) == VICTIM && p.home_of(&cast.a, u, 1) != VICTIM
    });
    let mut a = logged_in_at_start(&p, 1, &cast.a);
    let mut cf = logged_in_at_start(&p, 2, &f);
    p.kill9(VICTIM);
    drill(&mut p);
    let body = serde_json::json!([f]).to_string();
    p.wait_until(1, "the new authority knows f's session", |p| {
        p.api(1, "POST", "/user/onlinestatus", &body)
            .is_some_and(|(status, reply)| status == 200 && reply.contains(&f))
    });
    exchange(&mut a, &cast.a, &mut cf, &f, "rebuilt");
}
