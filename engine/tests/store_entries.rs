//! The message log as the raft log of replicated groups: entries of messages and of
//! other kinds, cuts that void a deposed leader's tail (and take back its seqs),
//! entries torn by a crash, retention, limits; each checked after a reopen too.

use std::collections::HashMap;
use std::path::Path;

use engine::store::log::{Entry, EntryBody, GroupSpan};
use engine::store::record::RecordKind;
use engine::store::{
    AppendedMessage, FsyncPolicy, LogConfig, LogError, MessageLog, NewMessage, PullMode,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn seed() -> u64 {
    let s = std::env::var("STORE_TEST_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed);
    println!("STORE_TEST_SEED={s}");
    s
}

fn config() -> LogConfig {
    LogConfig {
        segment_bytes: 256 << 10,
        payload_bytes_max: 4096,
        fsync: FsyncPolicy::Always,
        ..LogConfig::default()
    }
}

fn msg<'a>(channel: &'a str, payload: &'a [u8]) -> NewMessage<'a> {
    NewMessage {
        message_id: 7,
        channel_type: 2,
        channel_id: channel,
        from_uid: "u",
        client_msg_no: "",
        setting: 0,
        msg_flags: 0,
        timestamp_s: 1_700_000_000,
        payload,
    }
}

fn messages(
    log: &mut MessageLog,
    group: u32,
    term: u64,
    index: u64,
    msgs: &[NewMessage<'_>],
) -> Result<Vec<u64>, LogError> {
    let mut out = Vec::new();
    let e = Entry {
        group,
        term,
        index,
        body: EntryBody::Messages(msgs),
    };
    log.append_entry(&e, &mut out)?;
    Ok(out
        .iter()
        .map(|a: &AppendedMessage| a.message_seq)
        .collect())
}

fn other(log: &mut MessageLog, group: u32, term: u64, index: u64, body: EntryBody<'_>) {
    let e = Entry {
        group,
        term,
        index,
        body,
    };
    log.append_entry(&e, &mut Vec::new()).unwrap();
}

/// The payloads of a channel's messages, in seq order from 1.
fn payloads(log: &MessageLog, channel: &str) -> Vec<Vec<u8>> {
    let r = log.read(2, channel, 1, 0, 0, PullMode::Up).unwrap();
    for (i, m) in r.messages.iter().enumerate() {
        assert_eq!(m.message_seq, i as u64 + 1, "{channel}");
    }
    r.messages.iter().map(|m| m.payload.to_vec()).collect()
}

/// Per group, by index from 1: the entry's term and its messages (channel,
/// payload); none for a no-op.
type Model = HashMap<u32, Vec<(u64, Vec<(String, Vec<u8>)>)>>;

/// A refused entry and the check of its error.
type Refusal<'a> = (Entry<'a>, fn(&LogError) -> bool);

fn reopen(log: MessageLog, dir: &Path) -> (MessageLog, engine::store::RecoveryReport) {
    drop(log);
    MessageLog::open(dir, config()).unwrap()
}

/// Entries of every kind read back with their terms and records, give messages
/// their channels' next seqs (several in one entry), and read back alike after a
/// reopen; non-message entries are no messages to a scan.
#[test]
fn entries_of_every_kind_read_back_across_a_reopen() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut log, _) = MessageLog::open(tmp.path(), config()).unwrap();
    let m = [msg("a", b"a1"), msg("b", b"b1"), msg("a", b"a2")];
    assert_eq!(messages(&mut log, 3, 1, 1, &m).unwrap(), vec![1, 1, 2]);
    other(&mut log, 3, 1, 2, EntryBody::Noop);
    other(&mut log, 3, 2, 3, EntryBody::Catalog(b"token"));
    other(&mut log, 3, 2, 4, EntryBody::ConfChange(b"cc"));
    other(&mut log, 3, 2, 5, EntryBody::ConfChangeV2(b"cc2"));
    assert_eq!(
        messages(&mut log, 3, 2, 6, &[msg("a", b"a3")]).unwrap(),
        vec![3]
    );
    // Another group starts at any index (a replica caught up from a snapshot).
    assert_eq!(
        messages(&mut log, 9, 4, 100, &[msg("c", b"c1")]).unwrap(),
        vec![1]
    );
    // A message of no group between them.
    assert_eq!(log.append(&msg("a", b"a4")).unwrap().message_seq, 4);
    log.sync(0).unwrap();
    for pass in 0..2 {
        let span = GroupSpan {
            first_index: 1,
            last_index: 6,
        };
        assert_eq!(log.group_span(3), Some(span), "pass {pass}");
        assert_eq!(log.group_span(4), None);
        let r = log.entry_records(3, 1).unwrap();
        let got: Vec<_> = r
            .iter()
            .map(|f| (f.channel_id, f.message_seq, f.parts_left))
            .collect();
        assert_eq!(
            got,
            vec![(&b"a"[..], 1, 2), (&b"b"[..], 1, 1), (&b"a"[..], 2, 0)]
        );
        let kinds: Vec<_> = (2..=5)
            .map(|i| {
                let r = log.entry_records(3, i).unwrap();
                assert_eq!(r.len(), 1);
                (
                    r[0].kind,
                    r[0].payload.to_vec(),
                    log.entry_term(3, i).unwrap(),
                )
            })
            .collect();
        assert_eq!(
            kinds,
            vec![
                (RecordKind::Noop, b"".to_vec(), 1),
                (RecordKind::Catalog, b"token".to_vec(), 2),
                (RecordKind::ConfChange, b"cc".to_vec(), 2),
                (RecordKind::ConfChangeV2, b"cc2".to_vec(), 2),
            ]
        );
        assert_eq!(log.entry_term(9, 100).unwrap(), 4);
        assert!(matches!(
            log.entry_records(3, 7),
            Err(LogError::NoSuchEntry { group: 3, index: 7 })
        ));
        assert!(matches!(
            log.entry_term(3, 0),
            Err(LogError::NoSuchEntry { .. })
        ));
        assert_eq!(payloads(&log, "a"), [&b"a1"[..], b"a2", b"a3", b"a4"]);
        assert_eq!(payloads(&log, "b"), [b"b1"]);
        let mut scanned = Vec::new();
        log.scan(|m| scanned.push(m.payload.to_vec())).unwrap();
        assert_eq!(scanned, [&b"a1"[..], b"b1", b"a2", b"a3", b"c1", b"a4"]);
        let (l, report) = reopen(log, tmp.path());
        log = l;
        assert_eq!((report.entries, report.records, report.cuts), (7, 6, 0));
    }
}

/// An entry at a held index cuts the group's log there: the cut entries' messages
/// leave their channels, whose seqs go back and are given again, and a scan no
/// longer sees them; a reopen replays the cut the same way.
#[test]
fn a_cut_voids_the_tail_and_takes_back_its_seqs() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut log, _) = MessageLog::open(tmp.path(), config()).unwrap();
    for (i, p) in [b"x1", b"x2", b"x3", b"x4"].iter().enumerate() {
        let seqs = messages(&mut log, 1, 1, i as u64 + 1, &[msg("x", *p)]).unwrap();
        assert_eq!(seqs, vec![i as u64 + 1]);
    }
    assert_eq!(
        messages(&mut log, 1, 1, 5, &[msg("y", b"y1"), msg("x", b"x5")]).unwrap(),
        vec![1, 5]
    );
    // A new leader of term 2 replaces entries 3.. with its own.
    assert_eq!(
        messages(&mut log, 1, 2, 3, &[msg("x", b"X3")]).unwrap(),
        vec![3]
    );
    assert_eq!(log.last_seq(2, "y"), 0);
    assert_eq!(log.group_span(1).unwrap().last_index, 3);
    other(&mut log, 1, 2, 4, EntryBody::Noop);
    // And a cut of the entry just written (a cut at the last index).
    assert_eq!(
        messages(&mut log, 1, 3, 4, &[msg("y", b"Y1")]).unwrap(),
        vec![1]
    );
    log.sync(0).unwrap();
    for pass in 0..2 {
        assert_eq!(
            payloads(&log, "x"),
            [&b"x1"[..], b"x2", b"X3"],
            "pass {pass}"
        );
        assert_eq!(payloads(&log, "y"), [b"Y1"]);
        assert_eq!(log.entry_term(1, 3).unwrap(), 2);
        assert_eq!(log.entry_term(1, 4).unwrap(), 3);
        assert_eq!(log.group_span(1).unwrap().last_index, 4);
        let mut scanned = Vec::new();
        log.scan(|m| scanned.push(m.payload.to_vec())).unwrap();
        assert_eq!(scanned, [&b"x1"[..], b"x2", b"X3", b"Y1"]);
        let (l, report) = reopen(log, tmp.path());
        log = l;
        assert_eq!(
            (report.cuts, report.entries, report.seq_discontinuities),
            (2, 4, 0)
        );
        assert_eq!(report.records, 4);
    }
    assert_eq!(
        messages(&mut log, 1, 3, 5, &[msg("x", b"x4")]).unwrap(),
        vec![4]
    );
}

/// An entry whose last records never reached the file (a crash mid-append) is
/// dropped whole at recovery, the log zeroed from its start; the entries before it
/// stay and the next append takes its index.
#[test]
fn a_torn_entry_is_dropped_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut log, _) = MessageLog::open(tmp.path(), config()).unwrap();
    messages(&mut log, 1, 1, 1, &[msg("x", b"x1")]).unwrap();
    let three = [msg("x", b"x2"), msg("y", b"y1"), msg("x", b"x3")];
    let mut out = Vec::new();
    log.append_entry(
        &Entry {
            group: 1,
            term: 1,
            index: 2,
            body: EntryBody::Messages(&three),
        },
        &mut out,
    )
    .unwrap();
    log.sync(0).unwrap();
    drop(log);
    // The third record never written: zeros where it was.
    let last = out[2].position;
    let seg = tmp.path().join(format!("{:020}.seg", last >> 32));
    let f = std::fs::OpenOptions::new().write(true).open(&seg).unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(&[0u8; 96], last & 0xffff_ffff).unwrap();
    drop(f);
    let (mut log, report) = MessageLog::open(tmp.path(), config()).unwrap();
    assert_eq!(
        (report.torn_entries, report.entries, report.records),
        (1, 1, 1)
    );
    assert!(report.truncated_bytes > 0);
    assert_eq!(payloads(&log, "x"), [b"x1"]);
    assert_eq!(log.last_seq(2, "y"), 0);
    assert_eq!(log.group_span(1).unwrap().last_index, 1);
    assert_eq!(
        messages(&mut log, 1, 2, 2, &[msg("y", b"Y1")]).unwrap(),
        vec![1]
    );
    let (log, report) = reopen(log, tmp.path());
    assert_eq!((report.torn_entries, report.truncated_bytes), (0, 0));
    assert_eq!(payloads(&log, "y"), [b"Y1"]);
}

/// Every refusal names its reason and changes nothing.
#[test]
fn bad_entries_are_refused_and_change_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let small = LogConfig {
        groups_max: 2,
        entry_bytes_max: 4096,
        ..config()
    };
    let (mut log, _) = MessageLog::open(tmp.path(), small).unwrap();
    messages(&mut log, 1, 1, 1, &[msg("x", b"x1")]).unwrap();
    messages(&mut log, 2, 1, 1, &[msg("z", b"z1")]).unwrap();
    let end = log.end_position();
    let p = vec![1u8; 4000];
    let big = [msg("x", &p), msg("x", &p)];
    let empty_channel = [msg("", b"")];
    let cases: Vec<Refusal<'_>> = vec![
        (entry(1, 1, 2, &[]), |e| {
            matches!(e, LogError::EntryMessages { len: 0 })
        }),
        (entry(1, 0, 2, &[]), |e| matches!(e, LogError::EntryZero)),
        (entry(1, 1, 0, &[]), |e| matches!(e, LogError::EntryZero)),
        (entry(3, 1, 1, &[]), |e| {
            matches!(e, LogError::TooManyGroups { groups_max: 2 })
        }),
        (entry(1, 1, 4, &big[..1]), |e| {
            matches!(
                e,
                LogError::EntryGap {
                    group: 1,
                    index: 4,
                    next_index: 2
                }
            )
        }),
        (entry(1, 1, 2, &big), |e| {
            matches!(
                e,
                LogError::EntryTooLarge {
                    entry_bytes_max: 4096,
                    ..
                }
            )
        }),
        (entry(1, 1, 2, &empty_channel), |e| {
            matches!(e, LogError::EmptyChannelId)
        }),
    ];
    for (e, is) in cases {
        let err = log.append_entry(&e, &mut Vec::new()).unwrap_err();
        assert!(is(&err), "{e:?}: {err}");
        assert!(!err.to_string().is_empty());
        assert_eq!(log.end_position(), end, "{e:?} wrote");
    }
    assert_eq!(log.group_span(1).unwrap().last_index, 1);
    assert_eq!(payloads(&log, "x"), [b"x1"]);
    let (mut log, report) = reopen(log, tmp.path());
    assert_eq!((report.entries, report.torn_entries), (2, 0));
    assert_eq!(
        messages(&mut log, 1, 1, 2, &[msg("x", b"x2")]).unwrap(),
        vec![2]
    );
}

fn entry<'a>(group: u32, term: u64, index: u64, msgs: &'a [NewMessage<'a>]) -> Entry<'a> {
    Entry {
        group,
        term,
        index,
        body: EntryBody::Messages(msgs),
    }
}

/// Entries retire with their segment, oldest first; a cut below the oldest
/// retained entry is refused by name; the group goes on at its next index.
#[test]
fn entries_retire_with_their_segments_and_a_cut_below_them_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let c = LogConfig {
        segments_max: 2,
        ..config()
    };
    let (mut log, _) = MessageLog::open(tmp.path(), c.clone()).unwrap();
    let p = vec![7u8; 4000];
    let mut index = 0;
    while log.segment_ids()[0] == 0 || log.segment_ids().len() < 2 {
        index += 1;
        messages(&mut log, 1, 1, index, &[msg("x", &p)]).unwrap();
    }
    let span = log.group_span(1).unwrap();
    assert!(span.first_index > 1, "{span:?}");
    assert_eq!(span.last_index, index);
    assert_eq!(log.first_retained_seq(2, "x"), Some(span.first_index));
    let err = messages(&mut log, 1, 2, span.first_index - 1, &[msg("x", b"")]).unwrap_err();
    assert!(
        matches!(err, LogError::CutRetired { group: 1, .. }),
        "{err}"
    );
    assert!(matches!(
        log.entry_records(1, 1),
        Err(LogError::NoSuchEntry { .. })
    ));
    // A cut at the oldest retained entry is allowed.
    let seqs = messages(&mut log, 1, 2, span.first_index, &[msg("x", b"new")]).unwrap();
    assert_eq!(seqs, vec![span.first_index]);
    log.sync(0).unwrap();
    drop(log);
    let (log, report) = MessageLog::open(tmp.path(), c).unwrap();
    assert_eq!(report.cuts, 1);
    assert_eq!(
        log.group_span(1),
        Some(GroupSpan {
            first_index: span.first_index,
            last_index: span.first_index
        })
    );
    assert_eq!(log.last_seq(2, "x"), span.first_index);
}

/// One group's log as raft keeps it, against the log, with random appends, cuts
/// and reopens: after each step every retained entry reads back with its term, and
/// each channel holds exactly the messages of the live entries, with dense seqs.
#[test]
fn random_appends_cuts_and_reopens_match_a_model() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let tmp = tempfile::tempdir().unwrap();
    let (mut log, _) = MessageLog::open(tmp.path(), config()).unwrap();
    let mut model = Model::new();
    let mut term = 1;
    for step in 0..400 {
        let group = rng.gen_range(0..3u32);
        let entries = model.entry(group).or_default();
        match rng.gen_range(0..10) {
            0 => {
                log.sync(0).unwrap();
                log = reopen(log, tmp.path()).0;
            }
            k => {
                // Mostly the next index; sometimes a cut at a held one.
                let index = if k < 3 && !entries.is_empty() {
                    term += 1;
                    rng.gen_range(1..=entries.len() as u64)
                } else {
                    entries.len() as u64 + 1
                };
                let n = rng.gen_range(0..4);
                let body: Vec<(String, Vec<u8>)> = (0..n)
                    .map(|i| {
                        let ch = format!("g{group}c{}", rng.gen_range(0..3));
                        (ch, format!("{step}.{i}").into_bytes())
                    })
                    .collect();
                let msgs: Vec<NewMessage<'_>> = body.iter().map(|(c, p)| msg(c, p)).collect();
                let e = Entry {
                    group,
                    term,
                    index,
                    body: if msgs.is_empty() {
                        EntryBody::Noop
                    } else {
                        EntryBody::Messages(&msgs)
                    },
                };
                log.append_entry(&e, &mut Vec::new())
                    .unwrap_or_else(|err| panic!("seed {seed} step {step}: {err}"));
                entries.truncate(index as usize - 1);
                entries.push((term, body));
            }
        }
        check_model(&log, &model, seed, step);
    }
}

fn check_model(log: &MessageLog, model: &Model, seed: u64, step: usize) {
    let names: Vec<String> = (0..3)
        .flat_map(|g| (0..3).map(move |k| format!("g{g}c{k}")))
        .collect();
    let mut channels: HashMap<&str, Vec<Vec<u8>>> =
        names.iter().map(|c| (c.as_str(), Vec::new())).collect();
    for (&group, entries) in model {
        if entries.is_empty() {
            continue;
        }
        let span = log.group_span(group).expect("held");
        assert_eq!(
            span.last_index,
            entries.len() as u64,
            "seed {seed} step {step}"
        );
        for (i, (term, body)) in entries.iter().enumerate() {
            let index = i as u64 + 1;
            assert_eq!(
                log.entry_term(group, index).unwrap(),
                *term,
                "seed {seed} step {step}"
            );
            let records = log.entry_records(group, index).unwrap();
            let got: Vec<_> = records
                .iter()
                .filter(|r| r.kind == RecordKind::Message)
                .map(|r| r.payload.to_vec())
                .collect();
            let want: Vec<_> = body.iter().map(|(_, p)| p.clone()).collect();
            assert_eq!(
                got, want,
                "seed {seed} step {step} group {group} index {index}"
            );
            for (c, p) in body {
                channels.entry(c).or_default().push(p.clone());
            }
        }
    }
    for (c, want) in channels {
        assert_eq!(
            payloads(log, c),
            want,
            "seed {seed} step {step} channel {c}"
        );
    }
}
