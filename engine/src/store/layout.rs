//! The data dir's layout record, `DATA_DIR/layout.toml`: how the data was placed
//! (shard count, the hash-slot placement rule, a layout version), written
//! atomically (mode 0600) at the first start and checked at every later one.
//!
//! Channels live on the shard of their hash slot (`slot % shard_count`), each
//! shard with its own log (`DATA_DIR/shard-N/log`): the same data dir opened with
//! another shard count would look for a channel's history in the wrong log (old
//! messages hidden, seqs restarting at 1). So a start whose shard count, placement
//! rule or hash slot count differs is refused with one line that says what to do,
//! and so is a layout version newer than this binary knows. A data dir written
//! before this file existed is judged by its `shard-N` directories.

use std::io;
use std::path::Path;

use super::fsutil::write_atomic;

/// The layout version this binary writes and reads.
pub const LAYOUT_VERSION: u32 = 1;
/// The file's name in the data dir.
pub const LAYOUT_FILE: &str = "layout.toml";
/// The placement rule of this binary (`shard::slots::SlotMap::modulo`).
pub const PLACEMENT: &str = "hash_slot % shard_count";

#[derive(Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Layout {
    layout_version: u32,
    shard_count: u16,
    hash_slots: u16,
    placement: String,
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
            LayoutError::Other(what) => f.write_str(what),
            LayoutError::Io(e) => write!(f, "data dir layout: {e}"),
        }
    }
}

impl std::error::Error for LayoutError {}

/// Checks `data_dir` against `shard_count` and `hash_slots`, recording the layout
/// if the dir has none yet. `data_dir` must exist.
pub fn check_or_record(
    data_dir: &Path,
    shard_count: u16,
    hash_slots: u16,
) -> Result<(), LayoutError> {
    let shown = data_dir.display().to_string();
    let mine = Layout {
        layout_version: LAYOUT_VERSION,
        shard_count,
        hash_slots,
        placement: PLACEMENT.into(),
    };
    let found = match std::fs::read_to_string(data_dir.join(LAYOUT_FILE)) {
        Ok(text) => Some(parse(&shown, &text)?),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(LayoutError::Io(e)),
    };
    let recorded = found.is_some();
    let written = match found {
        Some(layout) => {
            if layout.placement != mine.placement || layout.hash_slots != mine.hash_slots {
                return Err(LayoutError::Other(format!(
                    "data dir {shown} places channels by \"{}\" over {} hash slots; this \
                     binary places them by \"{PLACEMENT}\" over {hash_slots}: use the \
                     binary that wrote it",
                    layout.placement, layout.hash_slots
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
             # placed on shards by these values: starting with another shard count\n\
             # is refused. Do not edit.\n{}",
            toml::to_string(&mine).expect("a flat struct serializes")
        );
        write_atomic(data_dir, LAYOUT_FILE, text.as_bytes()).map_err(LayoutError::Io)?;
    }
    Ok(())
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
