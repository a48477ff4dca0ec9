//! The data dir's layout record, `DATA_DIR/layout.toml`: how the data was placed
//! (shard count, the hash-slot placement rule, the cluster's nodes and slot ids, a
//! layout version), written atomically (mode 0600) at the first start and checked
//! at every later one.
//!
//! Channels live on the shard of their hash slot, each shard with its own log
//! (`DATA_DIR/shard-N/log`): by `hash_slot % shard_count` ([`PLACEMENT`]), or, on a
//! cluster whose slot ids are replicated (`[cluster] replicas` above 1), by the
//! shard of their slot id ([`PLACEMENT_BY_SLOT_ID`], layout version 3), so a slot
//! id's channels and its replica's raft log share one shard. The same data dir
//! opened with another shard count or placement would look for a channel's history
//! in the wrong log (old messages hidden, seqs restarting at 1). So a start whose
//! shard count, placement rule or hash slot count differs is refused with one line
//! that says what to do, and so is a layout version newer than this binary knows. A
//! data dir written before this file existed is judged by its `shard-N` directories.
//!
//! On a cluster the data of a uid or channel is homed on `nodes[slot_id % n]`
//! (`ClusterView::home_node`): the node list (ids and RPC addresses, in config
//! order), `[cluster] slot_ids` and `[cluster] replicas` decide which data this node
//! holds. A start whose `[[cluster.nodes]]`, slot ids or replicas differ from the
//! recorded ones is refused with one line naming both ([`LayoutError::Cluster`]): the homes would move and data
//! written here would be looked for on another node. A node alone (no peers)
//! records no node list; moving a node alone into a cluster (or a cluster node out
//! of it) is refused the same way, since the homes of its data would move too:
//! start the new cluster on new data dirs. A data dir recorded by layout version 1
//! (before the node list existed) is accepted with the nodes configured now, which
//! are recorded from then on.

use std::io;
use std::path::Path;

use super::fsutil::write_atomic;

/// The layout version this binary writes (and every one up to it, it reads): 2
/// added the cluster's node list and slot ids, 3 the replica count and the
/// placement by slot id.
pub const LAYOUT_VERSION: u32 = 3;
/// The file's name in the data dir.
pub const LAYOUT_FILE: &str = "layout.toml";
/// The placement rule of a node alone and of a cluster without replicated slot
/// ids (`slots::SlotMap::modulo`).
pub const PLACEMENT: &str = "hash_slot % shard_count";
/// The placement rule of a cluster with replicated slot ids
/// (`slots::SlotMap::by_slot_id`).
pub const PLACEMENT_BY_SLOT_ID: &str = "slot_id % shard_count";

#[derive(Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Layout {
    layout_version: u32,
    shard_count: u16,
    hash_slots: u16,
    placement: String,
    /// `[cluster] slot_ids` (0 for a node alone). Absent before version 2.
    #[serde(default)]
    cluster_slot_ids: u32,
    /// `[[cluster.nodes]]` in config order (empty for a node alone). Absent
    /// before version 2.
    #[serde(default)]
    cluster_nodes: Vec<RecordedNode>,
    /// `[cluster] replicas` (1 for a node alone). Absent before version 3 (1).
    #[serde(default = "one")]
    cluster_replicas: u32,
}

fn one() -> u32 {
    1
}

/// One node of the cluster as the data dir records it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordedNode {
    pub id: u64,
    pub rpc_addr: std::net::SocketAddr,
}

/// The cluster a data dir belongs to: the nodes in config order, the slot id
/// count and the replica count, which decide every hash slot's home and replicas. A
/// node alone: [`ClusterLayout::alone`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterLayout {
    pub slot_ids: u32,
    pub nodes: Vec<RecordedNode>,
    pub replicas: u32,
}

impl ClusterLayout {
    /// A node alone: no node list, no slot ids, one replica.
    pub fn alone() -> ClusterLayout {
        ClusterLayout {
            slot_ids: 0,
            nodes: Vec::new(),
            replicas: 1,
        }
    }

    /// The placement rule of this cluster's data: by slot id where the slot ids
    /// are replicated, else by hash slot.
    pub fn placement(&self) -> &'static str {
        if self.replicas > 1 && self.nodes.len() > 1 {
            PLACEMENT_BY_SLOT_ID
        } else {
            PLACEMENT
        }
    }

    /// How the refusal names it: `a node alone (…)` or `the cluster
    /// [1@127.0.0.1:11001, …] over N slot ids`.
    fn describe(&self) -> String {
        if self.nodes.is_empty() {
            return "a node alone (no [[cluster.nodes]])".into();
        }
        let list: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("{}@{}", n.id, n.rpc_addr))
            .collect();
        format!(
            "the cluster [{}] over {} slot ids, {} replica{}",
            list.join(", "),
            self.slot_ids,
            self.replicas,
            if self.replicas == 1 { "" } else { "s" }
        )
    }
}

/// Why a data dir cannot be opened with this configuration.
#[derive(Debug)]
pub enum LayoutError {
    /// The data dir was written with another shard count.
    ShardCount {
        data_dir: String,
        written: u16,
        configured: u16,
    },
    /// The data dir's layout is newer than this binary.
    TooNew {
        data_dir: String,
        version: u32,
    },
    /// The data dir belongs to another cluster (node list or slot ids), or to a
    /// node alone started in a cluster, or the other way round.
    Cluster {
        data_dir: String,
        written: String,
        configured: String,
    },
    /// Another placement rule or hash slot count, or an unreadable file.
    Other(String),
    Io(io::Error),
}

impl std::fmt::Display for LayoutError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LayoutError::ShardCount {
                data_dir, written, ..
            } => write!(
                f,
                "data dir {data_dir} was written with {written} shards; start with \
                 --shards {written} (or [runtime] shard_count = {written})"
            ),
            LayoutError::TooNew { data_dir, version } => write!(
                f,
                "data dir {data_dir} has layout version {version}, newer than this \
                 binary knows ({LAYOUT_VERSION}); run a newer imrouter"
            ),
            LayoutError::Cluster {
                data_dir,
                written,
                configured,
            } => write!(
                f,
                "data dir {data_dir} was written by {written}, but \
                 [[cluster.nodes]], [cluster] slot_ids and replicas now give {configured}: \
                 the homes of its data would move; start with the recorded cluster, or use \
                 a new data dir for the new cluster"
            ),
            LayoutError::Other(what) => f.write_str(what),
            LayoutError::Io(e) => write!(f, "data dir layout: {e}"),
        }
    }
}

impl std::error::Error for LayoutError {}

/// Checks `data_dir` against `shard_count`, `hash_slots` and `cluster`, recording
/// the layout if the dir has none yet or an older version (version 1 gets the
/// cluster configured now recorded; version 2, written before replicas, is
/// checked as one replica). `data_dir` must exist.
pub fn check_or_record(
    data_dir: &Path,
    shard_count: u16,
    hash_slots: u16,
    cluster: &ClusterLayout,
) -> Result<(), LayoutError> {
    let shown = data_dir.display().to_string();
    let mine = Layout {
        layout_version: LAYOUT_VERSION,
        shard_count,
        hash_slots,
        placement: cluster.placement().into(),
        cluster_slot_ids: cluster.slot_ids,
        cluster_nodes: cluster.nodes.clone(),
        cluster_replicas: cluster.replicas,
    };
    let found = match std::fs::read_to_string(data_dir.join(LAYOUT_FILE)) {
        Ok(text) => Some(parse(&shown, &text)?),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(LayoutError::Io(e)),
    };
    let recorded = found
        .as_ref()
        .is_some_and(|l| l.layout_version == LAYOUT_VERSION);
    if let Some(layout) = found.as_ref().filter(|l| l.layout_version >= 2) {
        check_cluster(&shown, layout, cluster)?;
    }
    let written = match found {
        Some(layout) => {
            if layout.placement != mine.placement || layout.hash_slots != mine.hash_slots {
                return Err(LayoutError::Other(format!(
                    "data dir {shown} places channels by \"{}\" over {} hash slots; this \
                     configuration places them by \"{}\" over {hash_slots}: use the \
                     configuration (or the binary) that wrote it",
                    layout.placement, layout.hash_slots, mine.placement
                )));
            }
            Some(layout.shard_count)
        }
        None => legacy_shard_count(data_dir).map_err(LayoutError::Io)?,
    };
    if let Some(written) = written {
        if written != shard_count {
            return Err(LayoutError::ShardCount {
                data_dir: shown,
                written,
                configured: shard_count,
            });
        }
    }
    if !recorded {
        let text = format!(
            "# Written by imrouter at the first start of this data dir. Channels are\n\
             # placed on shards, and homed on the cluster's nodes, by these values:\n\
             # starting with another shard count or another cluster is refused.\n\
             # Do not edit.\n{}",
            toml::to_string(&mine).expect("the layout serializes")
        );
        write_atomic(data_dir, LAYOUT_FILE, text.as_bytes()).map_err(LayoutError::Io)?;
    }
    Ok(())
}

/// Refuses a layout recorded for another cluster than `cluster`.
fn check_cluster(shown: &str, layout: &Layout, cluster: &ClusterLayout) -> Result<(), LayoutError> {
    let written = ClusterLayout {
        slot_ids: layout.cluster_slot_ids,
        nodes: layout.cluster_nodes.clone(),
        replicas: layout.cluster_replicas,
    };
    if written == *cluster {
        return Ok(());
    }
    Err(LayoutError::Cluster {
        data_dir: shown.into(),
        written: written.describe(),
        configured: cluster.describe(),
    })
}

fn parse(shown: &str, text: &str) -> Result<Layout, LayoutError> {
    let bad = |e: &dyn std::fmt::Display| {
        LayoutError::Other(format!(
            "data dir {shown}: {LAYOUT_FILE} is unreadable: {e}"
        ))
    };
    // The version first: a newer layout may have other fields.
    let value: toml::Table = toml::from_str(text).map_err(|e| bad(&e))?;
    let version = value
        .get("layout_version")
        .and_then(|v| v.as_integer())
        .ok_or_else(|| bad(&"no layout_version"))?;
    if version > i64::from(LAYOUT_VERSION) {
        return Err(LayoutError::TooNew {
            data_dir: shown.into(),
            version: u32::try_from(version).unwrap_or(u32::MAX),
        });
    }
    toml::from_str(text).map_err(|e| bad(&e))
}

/// The shard count of a data dir written before `layout.toml` existed: one more
/// than the highest `shard-N` directory (`None`: no shard directory, a new dir).
fn legacy_shard_count(data_dir: &Path) -> io::Result<Option<u16>> {
    let mut highest: Option<u16> = None;
    for entry in std::fs::read_dir(data_dir)? {
        let name = entry?.file_name();
        if let Some(n) = name
            .to_str()
            .and_then(|n| n.strip_prefix("shard-"))
            .and_then(|n| n.parse::<u16>().ok())
        {
            highest = Some(highest.map_or(n, |h| h.max(n)));
        }
    }
    Ok(highest.map(|h| h.saturating_add(1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(nodes: &[(u64, u16)], slot_ids: u32) -> ClusterLayout {
        ClusterLayout {
            slot_ids,
            replicas: 1,
            nodes: nodes
                .iter()
                .map(|&(id, port)| RecordedNode {
                    id,
                    rpc_addr: std::net::SocketAddr::from(([127, 0, 0, 1], port)),
                })
                .collect(),
        }
    }

    fn check(dir: &Path, c: &ClusterLayout) -> Result<(), LayoutError> {
        check_or_record(dir, 2, 256, c)
    }

    #[test]
    fn the_cluster_is_recorded_and_the_same_one_starts_again() {
        let dir = tempfile::tempdir().unwrap();
        let three = cluster(&[(1, 11001), (2, 11002), (3, 11003)], 64);
        check(dir.path(), &three).unwrap();
        let text = std::fs::read_to_string(dir.path().join(LAYOUT_FILE)).unwrap();
        assert!(text.contains("layout_version = 3"), "{text}");
        assert!(text.contains("cluster_slot_ids = 64"), "{text}");
        assert!(text.contains("cluster_replicas = 1"), "{text}");
        assert!(
            text.contains("placement = \"hash_slot % shard_count\""),
            "{text}"
        );
        assert!(text.contains("[[cluster_nodes]]"), "{text}");
        assert!(text.contains("rpc_addr = \"127.0.0.1:11003\""), "{text}");
        check(dir.path(), &three).unwrap();
    }

    #[test]
    fn another_node_list_is_refused_with_one_line_naming_both() {
        let dir = tempfile::tempdir().unwrap();
        let three = cluster(&[(1, 11001), (2, 11002), (3, 11003)], 64);
        check(dir.path(), &three).unwrap();
        let cases = [
            cluster(&[(1, 11001), (2, 11002)], 64),
            cluster(&[(1, 11001), (3, 11003), (2, 11002)], 64),
            cluster(&[(1, 11001), (2, 11002), (3, 12003)], 64),
            cluster(&[(1, 11001), (2, 11002), (3, 11003), (4, 11004)], 64),
            cluster(&[(1, 11001), (2, 11002), (3, 11003)], 32),
            ClusterLayout {
                replicas: 3,
                ..three.clone()
            },
            ClusterLayout::alone(),
        ];
        for configured in cases {
            let err = check(dir.path(), &configured).unwrap_err();
            assert!(matches!(err, LayoutError::Cluster { .. }), "{err:?}");
            let line = err.to_string();
            assert!(!line.contains('\n'), "one line: {line}");
            assert!(
                line.contains(
                    "[1@127.0.0.1:11001, 2@127.0.0.1:11002, 3@127.0.0.1:11003] over 64 slot ids, 1 replica"
                ),
                "names the recorded list: {line}"
            );
            assert!(
                line.contains(&configured.describe()),
                "names the configured list: {line}"
            );
        }
        check(dir.path(), &three).unwrap();
    }

    #[test]
    fn a_node_alone_records_no_cluster_and_is_refused_into_one() {
        let dir = tempfile::tempdir().unwrap();
        check(dir.path(), &ClusterLayout::alone()).unwrap();
        let text = std::fs::read_to_string(dir.path().join(LAYOUT_FILE)).unwrap();
        assert!(text.contains("cluster_nodes = []"), "{text}");
        let three = cluster(&[(1, 11001), (2, 11002), (3, 11003)], 64);
        let line = check(dir.path(), &three).unwrap_err().to_string();
        assert!(
            line.contains("written by a node alone (no [[cluster.nodes]])"),
            "{line}"
        );
        assert!(line.contains("over 64 slot ids"), "{line}");
        check(dir.path(), &ClusterLayout::alone()).unwrap();
    }

    #[test]
    fn a_version_1_layout_takes_the_cluster_configured_now() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join(LAYOUT_FILE),
            "layout_version = 1\nshard_count = 2\nhash_slots = 256\n\
             placement = \"hash_slot % shard_count\"\n",
        )
        .unwrap();
        let three = cluster(&[(1, 11001), (2, 11002), (3, 11003)], 64);
        check(dir.path(), &three).unwrap();
        let text = std::fs::read_to_string(dir.path().join(LAYOUT_FILE)).unwrap();
        assert!(text.contains("layout_version = 3"), "{text}");
        let other = cluster(&[(1, 11001), (2, 11002)], 64);
        assert!(matches!(
            check(dir.path(), &other),
            Err(LayoutError::Cluster { .. })
        ));
        // The shard count is still checked first for a version 1 file.
        assert!(matches!(
            check_or_record(dir.path(), 3, 256, &three),
            Err(LayoutError::ShardCount { .. })
        ));
    }

    /// Replicated slot ids (layout version 3): the replicas and the placement by
    /// slot id are recorded; the same cluster starts again; another replica count
    /// is refused by name, and so is the cluster without replicas (its channels
    /// would be looked for on other shards).
    #[test]
    fn a_replicated_cluster_records_its_replicas_and_placement_by_slot_id() {
        let dir = tempfile::tempdir().unwrap();
        let three = ClusterLayout {
            replicas: 3,
            ..cluster(&[(1, 11001), (2, 11002), (3, 11003)], 64)
        };
        assert_eq!(three.placement(), PLACEMENT_BY_SLOT_ID);
        check(dir.path(), &three).unwrap();
        let text = std::fs::read_to_string(dir.path().join(LAYOUT_FILE)).unwrap();
        assert!(text.contains("cluster_replicas = 3"), "{text}");
        assert!(
            text.contains("placement = \"slot_id % shard_count\""),
            "{text}"
        );
        check(dir.path(), &three).unwrap();
        for replicas in [1, 2] {
            let other = ClusterLayout {
                replicas,
                ..three.clone()
            };
            let line = check(dir.path(), &other).unwrap_err().to_string();
            assert!(line.contains("over 64 slot ids, 3 replicas"), "{line}");
            assert!(line.contains(&other.describe()), "{line}");
        }
    }

    /// A version 2 layout (written before replicas were recorded) is checked as one
    /// replica: the same cluster without replicas opens it and records version 3;
    /// the cluster with replicated slot ids is refused (its data was placed by hash
    /// slot).
    #[test]
    fn a_version_2_layout_is_one_replica_placed_by_hash_slot() {
        let v2 = "layout_version = 2\nshard_count = 2\nhash_slots = 256\n\
                  placement = \"hash_slot % shard_count\"\ncluster_slot_ids = 64\n\
                  [[cluster_nodes]]\nid = 1\nrpc_addr = \"127.0.0.1:11001\"\n\
                  [[cluster_nodes]]\nid = 2\nrpc_addr = \"127.0.0.1:11002\"\n";
        let two = cluster(&[(1, 11001), (2, 11002)], 64);
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(LAYOUT_FILE), v2).unwrap();
        let replicated = ClusterLayout {
            replicas: 2,
            ..two.clone()
        };
        let line = check(dir.path(), &replicated).unwrap_err().to_string();
        assert!(line.contains("over 64 slot ids, 1 replica,"), "{line}");
        let other = cluster(&[(1, 11001), (3, 11003)], 64);
        assert!(matches!(
            check(dir.path(), &other),
            Err(LayoutError::Cluster { .. })
        ));
        check(dir.path(), &two).unwrap();
        let text = std::fs::read_to_string(dir.path().join(LAYOUT_FILE)).unwrap();
        assert!(text.contains("layout_version = 3"), "{text}");
        assert!(text.contains("cluster_replicas = 1"), "{text}");
    }
}
