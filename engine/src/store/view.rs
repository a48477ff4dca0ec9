//! The cluster view a node last installed, `DATA_DIR/view.json`, written atomically
//! (mode 0600) before a slot move is answered and whenever a peer's view changed
//! this node's, and read at start.
//!
//! Views spread by gossip: a move made through a node lives only in that node's
//! memory until a peer has it. Without this file a node that crashed right after
//! answering a move 200 lost the move, and after its restart its next moves reused
//! terms it had already given (two views with one term and two leaders: the merge
//! dropped one). A whole cluster restarted went back to the configured leaders.
//! With it, a node starts from the configured view joined with its saved one.

use std::io;
use std::path::Path;

use domain::cluster::ClusterView;

use super::fsutil::write_atomic;

/// The file's name in the data dir.
pub const VIEW_FILE: &str = "view.json";
/// The format this binary writes and reads.
const VIEW_FILE_VERSION: u32 = 1;

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SavedView {
    view_file_version: u32,
    view: ClusterView,
}

/// Saves `view` as the data dir's view, atomically (the old file or the new one
/// survives a crash, never a mix).
pub fn save(data_dir: &Path, view: &ClusterView) -> io::Result<()> {
    let saved = SavedView {
        view_file_version: VIEW_FILE_VERSION,
        view: view.clone(),
    };
    let bytes = serde_json::to_vec(&saved).map_err(io::Error::other)?;
    write_atomic(data_dir, VIEW_FILE, &bytes)
}

/// The view saved in `data_dir`, `None` when there is none (a first start). A
/// file that does not parse, or of another format version, is an error naming it:
/// the node does not start on a view it cannot read (it may hold moves answered 200
/// that no peer has).
pub fn load(data_dir: &Path) -> io::Result<Option<ClusterView>> {
    let path = data_dir.join(VIEW_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io::Error::new(e.kind(), format!("{}: {e}", path.display()))),
    };
    let saved: SavedView = serde_json::from_slice(&bytes).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: {e} (the cluster view this node saved)", path.display()),
        )
    })?;
    if saved.view_file_version != VIEW_FILE_VERSION {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{}: view_file_version {} (this binary reads {VIEW_FILE_VERSION})",
                path.display(),
                saved.view_file_version
            ),
        ));
    }
    Ok(Some(saved.view))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_view_reads_back_and_a_first_start_has_none() {
        let dir = tempfile::tempdir().unwrap();
        assert!(load(dir.path()).unwrap().is_none());
        let view = ClusterView::initial(&[1, 2, 3], 8)
            .unwrap()
            .with_leaders(2, &[(7, 3)]);
        save(dir.path(), &view).unwrap();
        assert_eq!(load(dir.path()).unwrap(), Some(view));
    }

    #[test]
    fn an_unreadable_view_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(VIEW_FILE), b"{\"view_file_version\":1").unwrap();
        let e = load(dir.path()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains(VIEW_FILE), "{e}");
        let other =
            serde_json::json!({"view_file_version": 9, "view": ClusterView::single_node(1)});
        std::fs::write(dir.path().join(VIEW_FILE), other.to_string()).unwrap();
        let e = load(dir.path()).unwrap_err();
        assert!(e.to_string().contains("view_file_version 9"), "{e}");
    }
}
