//! Metadata store: persistence across reopen, torn journal tails, compaction, limits.

use std::path::Path;

use engine::route::DeviceLevel;
use engine::store::{MetaConfig, MetaError, MetaStore};

fn config() -> MetaConfig {
    MetaConfig {
        tokens_max: 100,
        groups_max: 10,
        subscribers_per_group_max: 50,
        field_bytes_max: 64,
        journal_bytes_max: 1 << 20,
    }
}

fn uids(store: &MetaStore, g: &str) -> Vec<String> {
    store
        .subscribers(g)
        .map(|s| s.iter().map(|u| u.to_string()).collect())
        .unwrap_or_default()
}

fn populate(store: &mut MetaStore) {
    store
        .set_token("alice", 1, "t-a1", DeviceLevel::Master)
        .unwrap();
    store
        .set_token("alice", 0, "t-a0", DeviceLevel::Slave)
        .unwrap();
    store
        .set_token("bob", 1, "old", DeviceLevel::Slave)
        .unwrap();
    store
        .set_token("bob", 1, "new", DeviceLevel::Master)
        .unwrap();
    assert_eq!(
        store
            .add_subscribers("g1", &["zed", "amy", "bob", "amy"], false)
            .unwrap(),
        3
    );
    assert_eq!(store.add_subscribers("g1", &["carl"], false).unwrap(), 4);
    assert_eq!(
        store.remove_subscribers("g1", &["bob", "nobody"]).unwrap(),
        3
    );
    assert_eq!(store.add_subscribers("g2", &["x", "y"], false).unwrap(), 2);
    assert_eq!(store.add_subscribers("g2", &["y", "w"], true).unwrap(), 2);
    assert_eq!(store.add_subscribers("g3", &["q"], false).unwrap(), 1);
    assert_eq!(store.remove_subscribers("g3", &["q"]).unwrap(), 0);
}

fn check(store: &MetaStore) {
    assert_eq!(store.token("alice", 1), Some(("t-a1", DeviceLevel::Master)));
    assert_eq!(store.token("alice", 0), Some(("t-a0", DeviceLevel::Slave)));
    assert_eq!(store.token("alice", 2), None);
    assert_eq!(store.token("bob", 1), Some(("new", DeviceLevel::Master)));
    assert_eq!(store.token("carol", 1), None);
    assert_eq!(
        uids(store, "g1"),
        ["amy", "carl", "zed"],
        "sorted, deduplicated"
    );
    assert_eq!(uids(store, "g2"), ["w", "y"], "reset replaced the list");
    assert!(
        store.subscribers("g3").is_none(),
        "an emptied group is removed"
    );
    assert!(store.is_subscriber("g1", "carl"));
    assert!(!store.is_subscriber("g1", "bob"));
    assert!(!store.is_subscriber("nope", "amy"));
    assert_eq!(store.group_count(), 2);
}

#[test]
fn state_survives_reopen() {
    let tmp = tempfile::tempdir().unwrap();
    {
        let (mut store, report) = MetaStore::open(tmp.path(), config()).unwrap();
        assert_eq!(report.replayed_ops, 0);
        populate(&mut store);
        check(&store);
        assert!(matches!(
            MetaStore::open(tmp.path(), config()),
            Err(MetaError::Locked)
        ));
    }
    let (store, report) = MetaStore::open(tmp.path(), config()).unwrap();
    assert_eq!(report.truncated_bytes, 0);
    assert!(report.replayed_ops >= 9);
    check(&store);
    assert_eq!(store.token_count(), 3);
}

#[test]
fn no_op_calls_write_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut store, _) = MetaStore::open(tmp.path(), config()).unwrap();
    populate(&mut store);
    let before = store.journal_bytes();
    store
        .set_token("alice", 1, "t-a1", DeviceLevel::Master)
        .unwrap();
    store.add_subscribers("g1", &["amy"], false).unwrap();
    store.add_subscribers("g2", &["y", "w"], true).unwrap();
    store.remove_subscribers("g1", &["nobody"]).unwrap();
    store.remove_subscribers("none", &["amy"]).unwrap();
    assert_eq!(store.journal_bytes(), before);
}

fn journal(dir: &Path) -> std::path::PathBuf {
    dir.join("meta.journal")
}

#[test]
fn torn_journal_tail_is_truncated_and_writes_continue() {
    let tmp = tempfile::tempdir().unwrap();
    let len_before_last;
    {
        let (mut store, _) = MetaStore::open(tmp.path(), config()).unwrap();
        populate(&mut store);
        len_before_last = store.journal_bytes();
        store
            .set_token("dave", 3, "torn", DeviceLevel::Master)
            .unwrap();
    }
    // cut the last op in half, then add garbage after it
    let full = std::fs::read(journal(tmp.path())).unwrap();
    let cut = len_before_last as usize + (full.len() - len_before_last as usize) / 2;
    let mut bytes = full[..cut].to_vec();
    bytes.extend_from_slice(&[0xab; 37]);
    std::fs::write(journal(tmp.path()), &bytes).unwrap();
    {
        let (mut store, report) = MetaStore::open(tmp.path(), config()).unwrap();
        assert_eq!(
            report.truncated_bytes,
            (bytes.len() as u64) - len_before_last
        );
        assert_eq!(store.token("dave", 3), None, "the torn op is gone");
        check(&store);
        assert_eq!(
            std::fs::metadata(journal(tmp.path())).unwrap().len(),
            len_before_last
        );
        store.set_token("erin", 0, "e", DeviceLevel::Slave).unwrap();
    }
    let (store, report) = MetaStore::open(tmp.path(), config()).unwrap();
    assert_eq!(report.truncated_bytes, 0);
    assert_eq!(store.token("erin", 0), Some(("e", DeviceLevel::Slave)));
    check(&store);
}

#[test]
fn compaction_snapshots_state_and_starts_a_new_generation() {
    let tmp = tempfile::tempdir().unwrap();
    let small = MetaConfig {
        journal_bytes_max: 200,
        ..config()
    };
    let stale_journal;
    {
        let (mut store, _) = MetaStore::open(tmp.path(), small).unwrap();
        populate(&mut store);
        assert!(store.compactions() > 0);
        assert!(store.journal_bytes() <= 200 + 100);
        // the journal of the current generation, then one more compaction: this copy
        // is what a crash between "snapshot renamed" and "journal replaced" leaves
        store.set_token("zoe", 9, "z1", DeviceLevel::Slave).unwrap();
        stale_journal = std::fs::read(journal(tmp.path())).unwrap();
        store.compact().unwrap();
        store.set_token("zoe", 9, "z2", DeviceLevel::Slave).unwrap();
        store.compact().unwrap();
    }
    std::fs::write(journal(tmp.path()), &stale_journal).unwrap();
    let (store, report) = MetaStore::open(tmp.path(), small).unwrap();
    assert_eq!(
        report.replayed_ops, 0,
        "a journal the snapshot covers is not replayed"
    );
    assert!(report.snapshot_ops >= 5);
    check(&store);
    assert_eq!(store.token("zoe", 9), Some(("z2", DeviceLevel::Slave)));
}

#[test]
fn corrupt_snapshot_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    {
        let (mut store, _) = MetaStore::open(tmp.path(), config()).unwrap();
        populate(&mut store);
        store.compact().unwrap();
    }
    let snap = tmp.path().join("meta.snap");
    let mut bytes = std::fs::read(&snap).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    std::fs::write(&snap, &bytes).unwrap();
    assert!(matches!(
        MetaStore::open(tmp.path(), config()),
        Err(MetaError::SnapshotCorrupt)
    ));
}

#[test]
fn limits_and_bad_input_refuse_the_whole_call() {
    let tmp = tempfile::tempdir().unwrap();
    let tight = MetaConfig {
        tokens_max: 2,
        groups_max: 1,
        subscribers_per_group_max: 3,
        ..config()
    };
    {
        let (mut store, _) = MetaStore::open(tmp.path(), tight).unwrap();
        store.set_token("a", 0, "t", DeviceLevel::Slave).unwrap();
        store.set_token("a", 1, "t", DeviceLevel::Slave).unwrap();
        assert!(matches!(
            store.set_token("b", 0, "t", DeviceLevel::Slave),
            Err(MetaError::TooManyTokens { tokens_max: 2 })
        ));
        store.set_token("a", 1, "t2", DeviceLevel::Master).unwrap(); // replacing is fine
        assert!(matches!(
            store.set_token("", 0, "t", DeviceLevel::Slave),
            Err(MetaError::EmptyField { field: "uid" })
        ));
        let long = "x".repeat(65);
        assert!(matches!(
            store.set_token("c", 0, &long, DeviceLevel::Slave),
            Err(MetaError::FieldTooLong { field: "token", .. })
        ));
        store.add_subscribers("g", &["1", "2"], false).unwrap();
        assert!(matches!(
            store.add_subscribers("g", &["3", "4"], false),
            Err(MetaError::TooManySubscribers {
                subscribers_per_group_max: 3
            })
        ));
        assert!(matches!(
            store.add_subscribers("h", &["1"], false),
            Err(MetaError::TooManyGroups { groups_max: 1 })
        ));
        assert!(matches!(
            store.add_subscribers("g", &["3", ""], false),
            Err(MetaError::EmptyField { field: "uid" })
        ));
        assert!(matches!(
            store.add_subscribers("g", &["3", &long], false),
            Err(MetaError::FieldTooLong { field: "uid", .. })
        ));
        assert_eq!(uids(&store, "g"), ["1", "2"]);
        store.add_subscribers("g", &["2", "3", "4"], true).unwrap();
    }
    let (store, _) = MetaStore::open(tmp.path(), tight).unwrap();
    assert_eq!(store.token_count(), 2);
    assert_eq!(store.token("a", 1), Some(("t2", DeviceLevel::Master)));
    assert_eq!(store.token("b", 0), None);
    assert_eq!(uids(&store, "g"), ["2", "3", "4"]);
    assert!(store.subscribers("h").is_none());
    assert!(matches!(
        MetaStore::open(
            tmp.path(),
            MetaConfig {
                field_bytes_max: 0,
                ..tight
            }
        ),
        Err(MetaError::Config(_))
    ));
}
