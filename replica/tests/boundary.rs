//! The sans-IO boundary of `replica`, the part the compiler and clippy cannot see:
//! its dependencies are raft-rs and plain data crates, none of which reaches a
//! socket, a file, a thread or a clock of ours (raft-rs draws election timeouts
//! from `thread_rng`, which `group` overrides from its seed: see
//! tests/sim.rs's replay test), and no source names an IO path.

// A test driver, outside the sans-IO boundary: it reads the crate's files.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::path::Path;

#[path = "../../domain/tests/boundary_scan/mod.rs"]
mod boundary_scan;
use boundary_scan::{dependencies, io_offences, io_paths_named};

/// What `replica` may depend on.
const ALLOWED_DEPENDENCIES: &[&str] = &[
    "raft",
    "protobuf",
    "slog",
    "postcard",
    "serde",
    "rand",
    "rand_chacha",
    "thiserror",
];

/// Paths no source file of `replica` (unit tests excepted) may name.
const FORBIDDEN_PATHS: &[&str] = &[
    "std::net",
    "std::fs",
    "std::thread",
    "std::process",
    "std::env",
    "std::time::Instant",
    "std::time::SystemTime",
    "thread_rng",
    "tokio",
    "mio",
    "io_uring",
    "libc",
    "net",
    "shard",
    "engine",
];

fn crate_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn dependencies_are_only_raft_and_plain_data() {
    let manifest = std::fs::read_to_string(crate_dir().join("Cargo.toml")).unwrap();
    let found = dependencies(&manifest);
    assert!(found.contains(&"raft".to_owned()), "{found:?}");
    for name in &found {
        assert!(
            ALLOWED_DEPENDENCIES.contains(&name.as_str()),
            "replica depends on `{name}`: it may depend only on {ALLOWED_DEPENDENCIES:?}"
        );
    }
}

#[test]
fn no_source_file_names_an_io_path() {
    let offences = io_offences(&crate_dir().join("src"), FORBIDDEN_PATHS);
    assert!(
        offences.is_empty(),
        "IO in replica:\n{}",
        offences.join("\n")
    );
    // The scan sees what it looks for.
    let planted = "fn f() { let r = rand::thread_rng(); }\n";
    assert_eq!(
        io_paths_named(planted, FORBIDDEN_PATHS),
        vec![(1, "thread_rng")]
    );
}
