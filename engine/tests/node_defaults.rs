//! What a user meets first (issue 26, item 9), with the `imrouter` binary:
//! - under a descriptor limit of 1024 (a shell's usual soft limit, with a hard limit
//!   to match) the default configuration starts: the connection cap, not set by the
//!   user, is lowered to what the limit holds, with a warning naming the numbers;
//! - a cap the user set that the limit cannot hold is refused, naming the numbers;
//! - logs written to a pipe (a file, journald) carry no ANSI colour codes.

#[macro_use]
mod support;

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Only a node that fails to do what is expected makes a wait this long.
const TIMEOUT: Duration = Duration::from_secs(20);

/// `imrouter` with `args` under `RLIMIT_NOFILE` = `limit` (soft and hard), its
/// stdout and stderr lines on a channel (closed when it exits).
fn imrouter(limit: u64, args: &[&str]) -> (Child, mpsc::Receiver<String>) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_imrouter"));
    cmd.args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: setrlimit is async-signal-safe; the closure touches nothing else.
    unsafe {
        cmd.pre_exec(move || {
            let l = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &l) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("imrouter starts");
    let (tx, rx) = mpsc::channel();
    let out = child.stdout.take().unwrap();
    let err = child.stderr.take().unwrap();
    for stream in [
        Box::new(out) as Box<dyn std::io::Read + Send>,
        Box::new(err),
    ] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
    }
    (child, rx)
}

/// Lines until one satisfies `found` (returned with all seen), or the output ends.
fn lines_until(rx: &mpsc::Receiver<String>, found: impl Fn(&str) -> bool) -> (bool, Vec<String>) {
    let mut seen = Vec::new();
    while let Ok(line) = rx.recv_timeout(TIMEOUT) {
        let hit = found(&line);
        seen.push(line);
        if hit {
            return (true, seen);
        }
    }
    (false, seen)
}

fn loopback_args(dir: &std::path::Path) -> Vec<String> {
    let ports = support::cluster::free_ports(3);
    vec![
        "--data-dir".into(),
        dir.display().to_string(),
        "--tcp-addr".into(),
        format!("127.0.0.1:{}", ports[0]),
        "--ws-addr".into(),
        format!("127.0.0.1:{}", ports[1]),
        "--api-addr".into(),
        format!("127.0.0.1:{}", ports[2]),
        "--shards".into(),
        "2".into(),
    ]
}

#[test]
fn the_default_config_starts_under_1024_descriptors_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let args = loopback_args(dir.path());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (mut child, rx) = imrouter(1024, &args);
    let (listening, seen) = lines_until(&rx, |l| l.contains("TCP listener up"));
    let _ = child.kill();
    let _ = child.wait();
    let text = seen.join("\n");
    assert!(listening, "the node did not start:\n{text}");
    let warning = seen
        .iter()
        .find(|l| l.contains("WARN") && l.contains("connections_per_shard_max"))
        .unwrap_or_else(|| panic!("no warning about the lowered cap:\n{text}"));
    assert!(
        warning.contains("1024") && warning.contains("8192"),
        "the warning names the limit and the default cap: {warning}"
    );
    assert!(
        !text.contains('\u{1b}'),
        "ANSI escape codes in logs written to a pipe:\n{text:?}"
    );
}

#[test]
fn a_cap_the_user_set_that_does_not_fit_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("imrouter.toml");
    std::fs::write(&config, "[net]\nconnections_per_shard_max = 8192\n").unwrap();
    let mut args = loopback_args(dir.path());
    args.extend(["--config".into(), config.display().to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (mut child, rx) = imrouter(1024, &args);
    let (listening, seen) = lines_until(&rx, |l| l.contains("TCP listener up"));
    let _ = child.kill();
    let status = child.wait().unwrap();
    let text = seen.join("\n");
    assert!(!listening, "started with a cap it cannot hold:\n{text}");
    assert!(!status.success(), "{status:?}");
    assert!(
        text.contains("connections_per_shard_max = 8192") && text.contains("1024"),
        "the refusal names the cap and the limit:\n{text}"
    );
}
