//! The repository's text points only inside the repository: every `docs/…` file
//! named in a source file or a Markdown page exists, and no text names the spec's
//! location outside the repository (`shared/spec/…`) — the rules and flows the code
//! cites are copied into `docs/`.

use std::path::{Path, PathBuf};

/// Top-level directories whose `.rs`, `.md` and `.toml` files are checked.
const CHECKED: &[&str] = &[
    "ring", "shard", "net", "domain", "engine", "perf", "benches", "docs", "deploy", "scripts",
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy();
        if path.is_dir() {
            if name != "target" && name != "node_modules" && name != "fuzz" {
                files(&path, out);
            }
        } else if ["rs", "md", "toml"]
            .iter()
            .any(|e| name.ends_with(&format!(".{e}")))
        {
            out.push(path);
        }
    }
}

/// The `docs/…` paths `text` names (up to the first character that cannot be part of
/// a file name).
fn docs_named(text: &str) -> Vec<&str> {
    text.match_indices("docs/")
        .filter(|(i, _)| {
            // `docs/` as a path of its own, not the tail of another word or path.
            !text[..*i]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_alphanumeric() || c == '/' || c == '_' || c == '.')
        })
        .map(|(i, _)| {
            let rest = &text[i..];
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || "/._-".contains(c)))
                .unwrap_or(rest.len());
            rest[..end].trim_end_matches('.')
        })
        .filter(|p| p.len() > "docs/".len())
        .collect()
}

#[test]
fn every_docs_file_named_exists_and_nothing_points_outside() {
    let root = repo();
    let mut all = Vec::new();
    for dir in CHECKED {
        files(&root.join(dir), &mut all);
    }
    for top in ["README.md", "ARCHITECTURE.md", "CHANGELOG.md"] {
        all.push(root.join(top));
    }
    assert!(
        all.len() > 50,
        "found the repository's files ({})",
        all.len()
    );
    let mut missing = Vec::new();
    for file in &all {
        let text = std::fs::read_to_string(file).unwrap();
        let shown = file.strip_prefix(&root).unwrap().display().to_string();
        if shown != "engine/tests/repo_docs.rs" && text.contains(concat!("shared", "/spec")) {
            missing.push(format!("{shown}: names the spec outside the repository"));
        }
        for named in docs_named(&text) {
            if !root.join(named).exists() {
                missing.push(format!("{shown}: `{named}` does not exist"));
            }
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}

#[test]
fn docs_paths_are_read_whole_and_only_as_paths() {
    assert_eq!(
        docs_named("see `docs/flows.md`, flow 5; and docs/wkproto.md."),
        vec!["docs/flows.md", "docs/wkproto.md"]
    );
    assert!(docs_named("rustdocs/x.md and /work/docs/y").is_empty());
}
