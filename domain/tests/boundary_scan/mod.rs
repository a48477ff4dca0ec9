//! The scans of a sans-IO crate's boundary (its manifest's dependencies, the paths
//! its sources name), shared by the boundary tests of `domain` and `replica`.

// A test driver, outside the sans-IO boundary: it reads the crates' files.
#![allow(clippy::disallowed_methods, clippy::disallowed_types, dead_code)]

use std::path::{Path, PathBuf};

/// The `.rs` files under `dir`.
pub fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("the sources are readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The names in a manifest's `[dependencies]` and target-specific dependency tables
/// (not dev-dependencies: tests are drivers).
pub fn dependencies(manifest: &str) -> Vec<String> {
    let mut section = "";
    let mut found = Vec::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line;
            continue;
        }
        let runtime_section = section == "[dependencies]"
            || (section.starts_with("[target.") && section.ends_with(".dependencies]"));
        if runtime_section && !line.is_empty() && !line.starts_with('#') {
            let name = line.split(['=', ' ', '.']).next().unwrap().to_owned();
            found.push(name);
        }
    }
    found
}

/// The `forbidden` paths `text` names outside its unit tests and comments, with their
/// line numbers.
pub fn io_paths_named(text: &str, forbidden: &[&'static str]) -> Vec<(usize, &'static str)> {
    // Unit tests sit at the bottom of a file, after `#[cfg(test)]`: drivers of their
    // own (threads, seeds from the environment).
    let code = text.split("#[cfg(test)]").next().unwrap();
    let mut named = Vec::new();
    for (n, line) in code.lines().enumerate() {
        let line = line.split("//").next().unwrap();
        for path in forbidden {
            let whole_word = line.match_indices(path).any(|(i, _)| {
                let before = line[..i].chars().next_back();
                let after = line[i + path.len()..].chars().next();
                !before.is_some_and(|c| c.is_alphanumeric() || c == '_')
                    && !after.is_some_and(|c| c.is_alphanumeric() || c == '_')
            });
            if whole_word {
                named.push((n + 1, *path));
            }
        }
    }
    named
}

/// Every line of a `.rs` file under `src` that names a `forbidden` path, as
/// `file:line: names `path``.
pub fn io_offences(src: &Path, forbidden: &[&'static str]) -> Vec<String> {
    let mut files = Vec::new();
    sources(src, &mut files);
    assert!(!files.is_empty(), "no sources under {}", src.display());
    let mut offences = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for (line, path) in io_paths_named(&text, forbidden) {
            offences.push(format!("{}:{line}: names `{path}`", file.display()));
        }
    }
    offences
}
