//! The README's metrics table is the operator's reference: every family `/metrics`
//! exports must have its row there (name, type), so the table cannot fall behind.

use engine::node::Node;

mod support;

#[test]
fn the_readme_lists_every_metric_family() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(support::config(dir.path(), net::io::Backend::Mio)).unwrap();
    let metrics = node.api().handle("GET", "/metrics", None, b"").body;
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    let mut missing = Vec::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let (name, ty) = rest.split_once(' ').unwrap();
        if name.starts_with("imrouter_shard_") {
            continue; // the per-shard series of a node family: one row covers both
        }
        if !readme.contains(&format!("| `{name}` | {ty} |")) {
            missing.push(format!("{name} ({ty})"));
        }
    }
    assert!(
        missing.is_empty(),
        "README.md's metrics table lacks: {}",
        missing.join(", ")
    );
    node.shutdown().unwrap();
}
