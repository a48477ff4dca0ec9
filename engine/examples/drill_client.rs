//! The clients of the fault drill (`scripts/drill`), on `net::client`: each mode
//! prints one JSON object on stdout when it ends.
//!
//! `hold ADDR UID DEVICE_ID UNTIL_FILE MAX_S`: logs one device in (device flag 0,
//! app; its level is the node's, Master without a token record when `token_auth` is
//! off) and keeps it: a PING about every second, every DISCONNECT and close noted, until
//! `UNTIL_FILE` exists or `MAX_S` passed; then one last PING tells whether the
//! session still answers (`alive_at_end`).
//!
//! `probe TAG SENDER_UID@ADDR RCPT_UID@ADDR[,...] COUNT`: logs the recipients and the
//! sender in, sends `COUNT` person messages to each recipient (client_msg_no
//! `TAG-RCPT-i`), collects every SENDACK (up to 10 s) and then every recipient's
//! RECVs (up to 2 s after the last SENDACK). Run again with the same TAG, it
//! resends the same client_msg_nos (a client's retry).
//!
//! `cargo build --release -p engine --example drill_client`

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use net::client::{Client, Login, Received};
use serde_json::{json, Value};

/// How long one read waits (the CONNACK included).
const READ_STEP: Duration = Duration::from_secs(2);

fn login(uid: &str, device_id: &str) -> Login {
    let mut l = Login::new(uid, "drill");
    l.device_flag = 0;
    l.device_id = device_id.into();
    l
}

fn timed_out(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

fn hold(args: &[String]) -> Value {
    let addr: SocketAddr = args[0].parse().expect("ADDR");
    let (uid, device_id, until) = (&args[1], &args[2], Path::new(&args[3]));
    let max = Duration::from_secs_f64(args[4].parse().expect("MAX_S"));
    let start = Instant::now();
    let mut out = json!({"uid": uid, "device_id": device_id, "addr": addr.to_string()});
    let mut client = match Client::connect(addr, &login(uid, device_id), READ_STEP) {
        Ok((c, reason)) => {
            out["connack"] = json!(reason);
            if reason != 1 {
                out["alive_at_end"] = json!(false);
                return out;
            }
            c
        }
        Err(e) => {
            out["connect_error"] = json!(e.to_string());
            out["alive_at_end"] = json!(false);
            return out;
        }
    };
    let mut events = Vec::new();
    let mut last_ping = Instant::now();
    let mut open = true;
    while open && start.elapsed() < max && !until.exists() {
        if last_ping.elapsed() >= Duration::from_secs(1) {
            last_ping = Instant::now();
            if client.ping().is_err() {
                events
                    .push(json!({"at_s": start.elapsed().as_secs_f64(), "closed": "ping failed"}));
                open = false;
            }
        }
        match client.read() {
            Ok(Received::Disconnect { reason, text }) => events.push(
                json!({"at_s": start.elapsed().as_secs_f64(), "disconnect": reason, "text": text}),
            ),
            Ok(_) => {}
            Err(e) if timed_out(&e) => {}
            Err(e) => {
                events
                    .push(json!({"at_s": start.elapsed().as_secs_f64(), "closed": e.to_string()}));
                open = false;
            }
        }
    }
    out["events"] = Value::Array(events);
    out["alive_at_end"] = json!(open && answers_ping(&mut client));
    out
}

/// One PING answered by a PONG within 2 s (other frames read past).
fn answers_ping(client: &mut Client) -> bool {
    if client.ping().is_err() {
        return false;
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        match client.read() {
            Ok(Received::Pong) => return true,
            Ok(Received::Disconnect { .. }) => return false,
            Ok(_) => {}
            Err(e) if timed_out(&e) => {}
            Err(_) => return false,
        }
    }
    false
}

fn uid_at(s: &str) -> (String, SocketAddr) {
    let (uid, addr) = s.split_once('@').expect("UID@ADDR");
    (uid.into(), addr.parse().expect("ADDR"))
}

/// Logs `uid` in at `addr` for the probe; the error text when it could not.
fn probe_login(uid: &str, addr: SocketAddr) -> Result<Client, String> {
    match Client::connect(addr, &login(uid, &format!("{uid}-probe")), READ_STEP) {
        Ok((c, 1)) => Ok(c),
        Ok((_, reason)) => Err(format!("CONNACK {reason}")),
        Err(e) => Err(e.to_string()),
    }
}

fn probe(args: &[String]) -> Value {
    let tag = &args[0];
    let (sender_uid, sender_addr) = uid_at(&args[1]);
    let rcpts: Vec<(String, SocketAddr)> = args[2].split(',').map(uid_at).collect();
    let count: u32 = args[3].parse().expect("COUNT");
    let mut out = json!({"tag": tag, "sender": sender_uid});
    let mut clients = Vec::new();
    for (uid, addr) in &rcpts {
        match probe_login(uid, *addr) {
            Ok(c) => clients.push((uid.clone(), Some(c))),
            Err(e) => {
                out["login_errors"][uid] = json!(e);
                clients.push((uid.clone(), None));
            }
        }
    }
    let mut sender = match probe_login(&sender_uid, sender_addr) {
        Ok(c) => c,
        Err(e) => {
            out["login_errors"][&sender_uid] = json!(e);
            return out;
        }
    };
    // client_seq -> (recipient, client_msg_no)
    let mut sent: BTreeMap<u32, (String, String)> = BTreeMap::new();
    let mut seq = 0u32;
    for i in 0..count {
        for (uid, _) in &rcpts {
            seq += 1;
            let no = format!("{tag}-{uid}-{i}");
            let payload = format!("{{\"type\":1,\"content\":\"{no}\"}}");
            if sender
                .send(uid, 1, seq, &no, payload.as_bytes(), false)
                .is_ok()
            {
                sent.insert(seq, (uid.clone(), no));
            }
        }
    }
    let acks = collect_acks(&mut sender, &sent);
    out["sent"] = Value::Array(
        sent.iter()
            .map(|(seq, (to, no))| {
                let mut m = json!({"to": to, "client_msg_no": no});
                if let Some((reason, id, mseq)) = acks.get(seq) {
                    m["reason"] = json!(reason);
                    m["message_id"] = json!(id);
                    m["message_seq"] = json!(mseq);
                }
                m
            })
            .collect(),
    );
    let deadline = Instant::now() + Duration::from_secs(2);
    for (uid, c) in &mut clients {
        let expected = acks
            .iter()
            .filter(|(seq, a)| a.0 == 1 && sent.get(seq).is_some_and(|(to, _)| to == uid))
            .count();
        let got = c
            .as_mut()
            .map(|c| collect_recvs(c, expected, deadline))
            .unwrap_or_default();
        out["received"][uid.as_str()] = json!(got);
    }
    out
}

/// Every SENDACK for `sent` within 10 s: client_seq -> (reason, message_id, seq).
fn collect_acks(
    sender: &mut Client,
    sent: &BTreeMap<u32, (String, String)>,
) -> BTreeMap<u32, (u8, i64, u64)> {
    let mut acks = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while acks.len() < sent.len() && Instant::now() < deadline {
        match sender.read() {
            Ok(Received::Sendack {
                client_seq,
                message_id,
                message_seq,
                reason,
            }) => {
                acks.insert(client_seq, (reason, message_id, message_seq));
            }
            Ok(_) => {}
            Err(e) if timed_out(&e) => {}
            Err(_) => break,
        }
    }
    acks
}

/// The client_msg_nos of the RECVs read until `expected` came or `deadline` (each
/// acknowledged).
fn collect_recvs(c: &mut Client, expected: usize, deadline: Instant) -> Vec<String> {
    let mut got = Vec::new();
    while got.len() < expected && Instant::now() < deadline {
        match c.read() {
            Ok(Received::Recv(m)) => {
                let _ = c.recvack(m.message_id, m.message_seq);
                got.push(m.client_msg_no);
            }
            Ok(_) => {}
            Err(e) if timed_out(&e) => {}
            Err(_) => break,
        }
    }
    got
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let out = match args.first().map(String::as_str) {
        Some("hold") if args.len() == 6 => hold(&args[1..]),
        Some("probe") if args.len() == 5 => probe(&args[1..]),
        _ => {
            eprintln!(
                "usage: drill_client hold ADDR UID DEVICE_ID UNTIL_FILE MAX_S\n       \
                 drill_client probe TAG SENDER@ADDR RCPT@ADDR[,...] COUNT"
            );
            std::process::exit(2);
        }
    };
    println!("{out}");
}
