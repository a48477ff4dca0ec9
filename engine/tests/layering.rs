//! The files of each crate stand in floors: a file takes names only from files below
//! it, so no two files import each other, directly or around a circle
//! (ARCHITECTURE.md, "a shard's code is split by concern"). The compiler allows
//! circles inside a crate; this test does not.
//!
//! A file's imports are the module paths it names (`use` and inline paths:
//! `super::`, `self::`, `crate::`), each resolved to the deepest file module it
//! reaches; comments and the files' test modules are left out (a test module may
//! reach anything it tests). A re-export counts as an import of the file it names,
//! except a folder's `mod.rs` naming its own files (it presents them). A name
//! taken through a folder's re-export is an import of the folder's `mod.rs`, not
//! of the file behind it: name the file where it matters.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The crates whose files are checked, from the workspace root.
const CRATES: &[&str] = &[
    "ring/src",
    "slots/src",
    "wheel/src",
    "shard/src",
    "proto/src",
    "net/src",
    "domain/src",
    "engine/src",
];

/// One source file: its module path in the crate (`["node", "peers", "io"]`) and
/// its text.
struct Source {
    module: Vec<String>,
    text: String,
}

/// The module path of a file under the crate's `src` (`lib.rs` and `main.rs` are the
/// root; `x/mod.rs` is `x`). `None` for files of another crate (`bin/`).
fn module_of(rel: &Path) -> Option<Vec<String>> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts.first().is_some_and(|p| p == "bin") {
        return None;
    }
    let last = parts.pop()?;
    let stem = last.strip_suffix(".rs")?;
    if !matches!(stem, "mod" | "lib" | "main") {
        parts.push(stem.to_owned());
    }
    Some(parts)
}

/// The text without comments and without the `#[cfg(test)]` module at the end of
/// a file (tests may reach anything).
fn code_of(text: &str) -> String {
    let body = match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => text,
    };
    body.lines()
        .map(|l| match l.find("//") {
            Some(at) => &l[..at],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The submodules a file declares (`mod x;`, `pub mod x;`, `pub(crate) mod x;`).
fn children_of(code: &str) -> Vec<String> {
    code.lines()
        .filter_map(|l| {
            let l = l.trim();
            let rest = l
                .strip_prefix("pub ")
                .or_else(|| l.strip_prefix("pub(crate) "));
            let name = rest.unwrap_or(l).strip_prefix("mod ")?.strip_suffix(';')?;
            Some(name.trim().to_owned())
        })
        .collect()
}

/// Every path in `code` that starts with `super::`, `self::`, `crate::` or the
/// name of a submodule the file declares, resolved against `module` (braces expand
/// one level: `super::{a::X, b}` names `a` and `b`).
fn paths_named(module: &[String], code: &str) -> Vec<Vec<String>> {
    let children: Vec<String> = children_of(code)
        .into_iter()
        .map(|c| format!("{c}::"))
        .collect();
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut i = 0;
    while i < bytes.len() {
        if !code.is_char_boundary(i) {
            i += 1;
            continue;
        }
        let starts_word = i == 0 || !word(bytes[i - 1]) && bytes[i - 1] != b':';
        let rest = &code[i..];
        let head = ["super::", "self::", "crate::"]
            .into_iter()
            .chain(children.iter().map(String::as_str))
            .find(|h| rest.starts_with(h));
        let Some(head) = head.filter(|_| starts_word) else {
            i += 1;
            continue;
        };
        // The module the path starts from: a `mod.rs` file is its folder's module,
        // so its `self` is itself and its `super` the folder's parent.
        let mut base: Vec<String> = match head {
            "crate::" => Vec::new(),
            "self::" => module.to_vec(),
            "super::" => module[..module.len().saturating_sub(1)].to_vec(),
            child => module
                .iter()
                .cloned()
                .chain([child.trim_end_matches(':').to_owned()])
                .collect(),
        };
        let mut j = i + head.len();
        // Further `super::` segments.
        while code[j..].starts_with("super::") {
            base.pop();
            j += "super::".len();
        }
        let tail = &code[j..];
        if let Some(inner) = tail.strip_prefix('{') {
            let end = inner.find('}').unwrap_or(inner.len());
            for item in inner[..end].split(',') {
                let segs = segments(item.trim());
                if !segs.is_empty() {
                    out.push(base.iter().cloned().chain(segs).collect());
                }
            }
        } else {
            out.push(base.iter().cloned().chain(segments(tail)).collect());
        }
        i = j;
    }
    out
}

/// `a::b::C` of a path's text (up to the first character that ends a path).
fn segments(text: &str) -> Vec<String> {
    let end = text
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(text.len());
    text[..end]
        .split("::")
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Each file's imports of the crate's other files (by module path).
fn imports(sources: &[Source]) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let files: BTreeSet<Vec<String>> = sources.iter().map(|s| s.module.clone()).collect();
    let mut graph = BTreeMap::new();
    for s in sources {
        let mut to = BTreeSet::new();
        for path in paths_named(&s.module, &code_of(&s.text)) {
            // The deepest file module the path reaches.
            let target = (0..=path.len())
                .rev()
                .map(|n| path[..n].to_vec())
                .find(|p| files.contains(p));
            if let Some(t) = target {
                // The crate root and the file itself are no import; nor is a
                // folder's `mod.rs` naming its own files (it presents them: its
                // re-exports and its start-up code); its files naming it are.
                if !t.is_empty() && !t.starts_with(&s.module) {
                    to.insert(t);
                }
            }
        }
        graph.insert(s.module.clone(), to);
    }
    graph
}

/// The circles of `graph`: each strongly connected set of two files or more.
fn circles(graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<Vec<String>> {
    let reach = |from: &Vec<String>| {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from.clone()];
        while let Some(n) = stack.pop() {
            for m in graph.get(&n).into_iter().flatten() {
                if seen.insert(m.clone()) {
                    stack.push(m.clone());
                }
            }
        }
        seen
    };
    let reached: BTreeMap<_, _> = graph.keys().map(|k| (k.clone(), reach(k))).collect();
    let mut done = BTreeSet::new();
    let mut out = Vec::new();
    for k in graph.keys() {
        if done.contains(k) || !reached[k].contains(k) {
            continue;
        }
        let set: Vec<String> = graph
            .keys()
            .filter(|m| reached[k].contains(*m) && reached[*m].contains(k))
            .inspect(|m| {
                done.insert((*m).clone());
            })
            .map(|m| m.join("::"))
            .collect();
        out.push(set);
    }
    out
}

fn sources_of(dir: &Path) -> Vec<Source> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path: PathBuf = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path.strip_prefix(dir).unwrap();
                if let Some(module) = module_of(rel) {
                    let text = std::fs::read_to_string(&path).unwrap();
                    out.push(Source { module, text });
                }
            }
        }
    }
    out
}

#[test]
fn no_crate_has_an_import_circle_among_its_files() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut found = Vec::new();
    for krate in CRATES {
        let sources = sources_of(&root.join(krate));
        assert!(!sources.is_empty(), "{krate}: no sources read");
        for circle in circles(&imports(&sources)) {
            found.push(format!("{krate}: {}", circle.join(" <-> ")));
        }
    }
    assert!(
        found.is_empty(),
        "files that import each other (move what both need below both):\n{}",
        found.join("\n")
    );
}

fn source(module: &str, text: &str) -> Source {
    Source {
        module: module.split("::").map(str::to_owned).collect(),
        text: text.to_owned(),
    }
}

/// The checker sees circles through `use`, inline paths, braces, `super::super`
/// and folders' `mod.rs`; and none where the imports only run down, or only in a
/// comment or a test module.
#[test]
fn the_checker_finds_a_circle_and_only_a_circle() {
    let layered = [
        source("node", "mod msg;\nmod shard;\nuse self::shard::NodeShard;\n"),
        source("node::shard", "use super::msg::Msg;\n// use super::conns::x;\n"),
        source("node::msg", "pub enum Msg {}\n"),
        source(
            "node::conns",
            "use super::shard::NodeShard;\n#[cfg(test)]\nmod tests {\n    use super::super::shard::x;\n}\n",
        ),
    ];
    assert!(circles(&imports(&layered)).is_empty());

    let through_use = [
        source("node::shard", "use super::conns::Conn;\n"),
        source("node::conns", "use super::shard::NodeShard;\n"),
    ];
    assert_eq!(
        circles(&imports(&through_use)),
        vec![vec!["node::conns".to_owned(), "node::shard".to_owned()]]
    );

    let around_three = [
        source("a", "fn f() { crate::b::g() }\n"),
        source("b", "use crate::c::{X, Y};\n"),
        source("c", "fn h(_: super::a::T) {}\n"),
    ];
    assert_eq!(circles(&imports(&around_three)).len(), 1);
    assert_eq!(circles(&imports(&around_three))[0].len(), 3);

    let nested = [
        source("node::send", "use super::shard::NodeShard;\n"),
        source("node::send::commit", "pub fn on_commit() {}\n"),
        source(
            "node::shard",
            "fn f() { super::send::commit::on_commit() }\n",
        ),
    ];
    assert!(circles(&imports(&nested)).is_empty());
    let nested_circle = [
        source("node::send", "use super::shard::NodeShard;\n"),
        source("node::shard", "use super::{send::CommitSide, msg};\n"),
    ];
    assert_eq!(circles(&imports(&nested_circle)).len(), 1);
    let re_export = [
        source(
            "node::send",
            "pub mod commit;\npub use commit::on_commit;\n",
        ),
        source("node::send::commit", "use super::CommitSide;\n"),
        source("node::shard", "use super::send::on_commit;\n"),
    ];
    assert!(circles(&imports(&re_export)).is_empty());
    let two_up = [
        source("node::send::owner", "use super::super::shard::NodeShard;\n"),
        source("node::shard", "fn f() { super::send::owner::go() }\n"),
    ];
    assert_eq!(circles(&imports(&two_up)).len(), 1);
}
