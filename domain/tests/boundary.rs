//! The sans-IO boundary of `domain`, the part the compiler and clippy cannot see.
//!
//! `engine`, `shard` (the runtime) and `net` (the drivers) are not dependencies, so
//! no source of `domain` can name a node, a shard thread or a socket; and
//! `clippy.toml` forbids std's clocks, files, sockets and threads (clippy runs with
//! `-D warnings` in CI). Left to check here: the crate's dependencies stay pure data
//! structures, and so do the workspace crates it depends on (`slots`, `wheel`,
//! `proto`): none of them reaches the runtime, a driver or an IO library.

// A test driver, outside the sans-IO boundary: it reads the crate's files.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::path::Path;

mod boundary_scan;
use boundary_scan::{dependencies, io_offences, io_paths_named};

/// What `domain` may depend on: none of these reaches a socket, a file, a thread or
/// a clock.
const ALLOWED_DEPENDENCIES: &[&str] = &[
    "slots",
    "wheel",
    "proto",
    "crossbeam-epoch",
    "crc32fast",
    "tracing",
    "serde",
    "mimalloc",
    "allocator-api2",
];

/// The workspace crates among them, whose own dependencies are checked in turn.
const WORKSPACE_DEPENDENCIES: &[&str] = &["slots", "wheel", "proto"];

/// Crates that run threads or reach sockets, files or clocks: no crate of the pure
/// floor may depend on them.
const IO_CRATES: &[&str] = &[
    "shard",
    "net",
    "engine",
    "ring",
    "tokio",
    "mio",
    "io-uring",
    "libc",
    "socket2",
    "core_affinity",
    "memmap2",
    "hyper",
];

/// Paths no source file of `domain` (tests excepted) may name.
const FORBIDDEN_PATHS: &[&str] = &[
    "std::net",
    "std::fs",
    "std::thread",
    "std::process",
    "std::env",
    "std::time::Instant",
    "std::time::SystemTime",
    "tokio",
    "mio",
    "io_uring",
    "libc",
];

fn crate_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn manifest_of(crate_name: &str) -> String {
    let dir = crate_dir().parent().unwrap().join(crate_name);
    std::fs::read_to_string(dir.join("Cargo.toml")).unwrap()
}

#[test]
fn dependencies_are_only_the_allowed_pure_ones() {
    let found = dependencies(&manifest_of("domain"));
    assert!(
        found.contains(&"slots".to_owned()),
        "the parser reads the manifest"
    );
    for name in &found {
        assert!(
            ALLOWED_DEPENDENCIES.contains(&name.as_str()),
            "domain depends on `{name}`: the sans-IO crate may depend only on {ALLOWED_DEPENDENCIES:?} \
             (add IO to engine instead, or extend the list with a reason)"
        );
    }
}

#[test]
fn the_workspace_crates_below_domain_reach_no_io() {
    for krate in WORKSPACE_DEPENDENCIES {
        let found = dependencies(&manifest_of(krate));
        for name in &found {
            assert!(
                !IO_CRATES.contains(&name.as_str()),
                "`{krate}`, below the sans-IO domain, depends on `{name}`, which reaches IO"
            );
        }
    }
    // The check sees a driver's dependencies (a check that cannot fail is a defect).
    let net = dependencies(&manifest_of("net"));
    assert!(
        net.iter().any(|n| IO_CRATES.contains(&n.as_str())),
        "{net:?}"
    );
}

#[test]
fn no_source_file_names_an_io_path() {
    let offences = io_offences(&crate_dir().join("src"), FORBIDDEN_PATHS);
    assert!(
        offences.is_empty(),
        "IO in the sans-IO crate:\n{}",
        offences.join("\n")
    );
}

/// The scan finds what it looks for (a check that cannot fail is a defect), and
/// only that: whole paths in code, not in comments, words or unit tests.
#[test]
fn the_scan_sees_io_paths_in_code_only() {
    let text = "use std::sync::Arc;\n\
                fn f() { let t = std::time::Instant::now(); }\n\
                use mio::Poll; // the driver\n\
                let minstd = 1; // std::fs here is a comment\n\
                use tokio_like::X;\n\
                #[cfg(test)]\nmod tests { use std::thread; }\n";
    assert_eq!(
        io_paths_named(text, FORBIDDEN_PATHS),
        vec![(2, "std::time::Instant"), (3, "mio")]
    );
}
