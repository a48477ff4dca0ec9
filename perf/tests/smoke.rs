//! Smoke test of every imbench scenario against an embedded node: a second of
//! low-rate traffic each, asserting the harness's accounting (every expected RECV
//! counted, none missing, no error), never its speed.

use std::time::Duration;

use engine::store::FsyncPolicy;
use perf::conn::Transport;
use perf::load::{self, ClientSpec, Plan, Route, Schedule};
use perf::report::Summary;
use perf::{BenchConfig, Scenario, TargetSpec};

fn config(label: &str) -> BenchConfig {
    let mut load = perf::default_load();
    load.threads = 2;
    load.duration = Duration::from_secs(1);
    // Bounded, but generous: the drain ends as soon as every RECV is in, so only a
    // failing run waits this long (a loaded CI machine must not turn into "missing").
    load.drain = Duration::from_secs(30);
    load.connect_concurrency = 16;
    BenchConfig {
        label: label.into(),
        preset: None,
        target: TargetSpec::Embedded {
            shards: 2,
            fsync: FsyncPolicy::Always,
            tls: None,
        },
        pid: None,
        load,
        floor: Duration::from_millis(50),
        out: None,
        set_tokens: true,
    }
}

fn assert_clean(s: &Summary) {
    assert!(
        s.clean(),
        "accounting not clean:\n{}",
        perf::report::table(s)
    );
    assert!(s.drained, "{}", perf::report::table(s));
    for c in &s.classes {
        assert!(c.sent > 0, "{}", perf::report::table(s));
        assert_eq!(c.delivered_recvs, c.expected_recvs);
        assert_eq!(
            c.recv.count, c.expected_recvs,
            "one latency sample per RECV"
        );
        assert_eq!(c.sendack.count, c.sent, "one SENDACK per SEND");
    }
    assert!(s.floor_rtt.as_ref().is_some_and(|f| f.count > 0));
    if s.classes.iter().any(|c| c.delivered_recvs > 0) {
        // Every RECV came in through a counted read and left a RECVACK in a write.
        assert!(s.harness_reads > 0 && s.harness_writes > 0, "{s:?}");
    }
}

#[test]
fn floor_measures_round_trips() {
    let mut cfg = config("floor");
    cfg.load.duration = Duration::from_millis(100);
    let (s, hists) = perf::run_scenario(&cfg, &Scenario::Floor).unwrap();
    assert!(s.floor_rtt.unwrap().count > 0);
    assert_eq!(hists.len(), 1);
}

#[test]
fn person_accounts_for_every_recv() {
    let sc = Scenario::Person {
        pairs: 20,
        rate: 200.0,
    };
    let (s, _) = perf::run_scenario(&config("person"), &sc).unwrap();
    assert_clean(&s);
    // The default backend is io_uring wherever the kernel allows one.
    let uring = net::io::NetConfig {
        backend: net::io::Backend::Uring,
        ..net::io::NetConfig::dialer(1)
    };
    if net::io::NetDriver::dialer(&uring).is_ok() {
        assert_eq!(s.io, "uring");
    }
    assert_eq!(s.classes[0].expected_recvs, s.classes[0].sent);
}

/// The epoll loop (the fallback where io_uring is refused) accounts the same way.
#[test]
fn person_over_epoll_accounts_for_every_recv() {
    let mut cfg = config("person-epoll");
    cfg.load.io = load::IoMode::Epoll;
    let sc = Scenario::Person {
        pairs: 10,
        rate: 200.0,
    };
    let (s, _) = perf::run_scenario(&cfg, &sc).unwrap();
    assert_clean(&s);
    assert_eq!(s.io, "epoll");
}

#[test]
fn person_over_websocket_encrypted() {
    let mut cfg = config("person-ws");
    cfg.load.transport = Transport::WebSocket;
    cfg.load.encrypt = true;
    let sc = Scenario::Person {
        pairs: 5,
        rate: 100.0,
    };
    let (s, _) = perf::run_scenario(&cfg, &sc).unwrap();
    assert_clean(&s);
}

#[test]
fn group_with_offline_members_accounts_for_every_recv() {
    let mut cfg = config("group");
    cfg.load.encrypt = true;
    let sc = Scenario::Group {
        members: 12,
        online_share: 0.5,
        groups: 2,
        rate: 100.0,
    };
    let (s, _) = perf::run_scenario(&cfg, &sc).unwrap();
    assert_clean(&s);
    // 6 online of 12 per group: every message reaches the 5 other online members.
    assert_eq!(s.classes[0].expected_recvs, 5 * s.classes[0].sent);
    // The node's CPU per answered SEND and per delivered RECV, printed and in the JSON.
    let table = perf::report::table(&s);
    assert!(table.contains("node CPU per SEND "), "{table}");
    assert!(table.contains(" per delivered RECV "), "{table}");
    let json = serde_json::to_value(&s).unwrap();
    let cpu = json["server"]["cpu_s_send_phase"].as_f64().unwrap();
    let per_send = json["server"]["cpu_us_per_send"].as_f64();
    assert_eq!(
        per_send,
        Some(cpu * 1e6 / s.classes[0].sendack.count as f64)
    );
    let per_recv = json["server"]["cpu_us_per_recv"].as_f64();
    assert_eq!(
        per_recv,
        Some(cpu * 1e6 / s.classes[0].delivered_recvs as f64)
    );
}

#[test]
fn storm_connects_every_client() {
    let sc = Scenario::Storm {
        clients: 300,
        concurrency: 32,
        rate: None,
    };
    let (s, _) = perf::run_scenario(&config("storm"), &sc).unwrap();
    assert_clean(&s);
    assert_eq!(s.connected, 300);
    assert_eq!(s.connect.count, 300);
}

/// A paced storm (`--rate`) connects every client, and its connects are spread
/// over the schedule: the last one starts (n - 1) / rate after the first.
#[test]
fn paced_storm_connects_every_client_on_its_schedule() {
    let sc = Scenario::Storm {
        clients: 60,
        concurrency: 60,
        rate: Some(300.0),
    };
    let (s, _) = perf::run_scenario(&config("storm-paced"), &sc).unwrap();
    assert_clean(&s);
    assert_eq!((s.connected, s.connect.count), (60, 60));
    assert!(
        s.connect_phase_s >= 59.0 / 300.0,
        "{}",
        perf::report::table(&s)
    );
}

#[test]
fn mixed_accounts_for_both_classes() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config("mixed");
    cfg.out = Some(dir.path().to_path_buf());
    let sc = Scenario::Mixed {
        pairs: 5,
        person_rate: 100.0,
        members: 6,
        online_share: 1.0,
        group_rate: 50.0,
    };
    let (s, _) = perf::run_scenario(&cfg, &sc).unwrap();
    assert_clean(&s);
    assert_eq!(s.classes.len(), 2);
    // The files the CLI writes, and a plot of them.
    let json = dir.path().join("mixed.json");
    assert!(dir.path().join("mixed-group-recv.hgrm").exists());
    let a = perf::plot::read_curve(&json, "group-recv").unwrap();
    let b = perf::plot::read_curve(&dir.path().join("mixed-person-recv.hgrm"), "recv").unwrap();
    let svg = perf::plot::svg(&[a, b], "smoke");
    assert_eq!(svg.matches("<path").count(), 2);
}

/// A plan that expects more RECVs than the node can deliver: the shortfall must be
/// reported as missing, not ignored.
#[test]
fn missing_recvs_are_reported() {
    let target = perf::target::Target::embedded(2, FsyncPolicy::Always, None).unwrap();
    let addr = target.nodes[0].tcp.unwrap();
    let uids = ["miss-a", "miss-b"];
    let list: Vec<String> = uids.iter().map(|u| u.to_string()).collect();
    target
        .control
        .set_tokens(&list, |u| format!("t-{u}"))
        .unwrap();
    let clients = uids
        .iter()
        .map(|u| ClientSpec {
            uid: u.to_string(),
            token: format!("t-{u}"),
            addr,
            peer: None,
        })
        .collect();
    let plan = Plan {
        clients,
        schedules: vec![Schedule {
            class: load::Class::Person,
            rate_per_s: 50.0,
            // A person message has one recipient; claim three.
            routes: vec![Route {
                client: 0,
                channel_id: "miss-b".into(),
                channel_type: 1,
                fanout: 3,
            }],
        }],
    };
    let mut cfg = config("missing").load;
    cfg.duration = Duration::from_millis(400);
    cfg.drain = Duration::from_millis(300);
    let out = load::run(&plan, &cfg, &mut ()).unwrap();
    let c = load::Class::Person as usize;
    assert!(out.sent[c] > 0);
    assert!(!out.drained);
    assert_eq!(out.expected[c], 3 * out.sent[c]);
    // Whatever arrived in time, every expected RECV is either delivered or missing,
    // and at least the two phantom recipients of each message are missing.
    assert!(out.delivered[c] <= out.sent[c]);
    assert_eq!(out.delivered[c] + out.missing[c], out.expected[c]);
    assert!(out.missing[c] >= 2 * out.sent[c]);
    assert_eq!(out.extra[c], 0);
    assert_eq!(out.errors.total(), 0);
    target.shutdown().unwrap();
}
