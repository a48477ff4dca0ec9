//! The HTTP API survives running out of file descriptors: accept errors (EMFILE)
//! are counted and backed off, the server never ends, and it answers again once
//! descriptors free up.
//!
//! The only test of its binary: it lowers the process's own `RLIMIT_NOFILE`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use engine::node::Node;

#[macro_use]
mod support;

/// Only a failing (hung) server makes a read wait this long.
const FAILURE_TIMEOUT: Duration = Duration::from_secs(5);

fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd").unwrap().count() as u64
}

fn set_soft_nofile(n: u64) {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid rlimit pointer.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut l), 0);
        l.rlim_cur = n.min(l.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &l), 0);
    }
}

fn soft_nofile() -> u64 {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit with a valid rlimit pointer.
    unsafe { assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut l), 0) };
    l.rlim_cur
}

fn get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(FAILURE_TIMEOUT))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )?;
    let mut reply = String::new();
    s.read_to_string(&mut reply)?;
    let status = reply
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad reply {reply:?}")))?;
    let body = reply.split_once("\r\n\r\n").map_or("", |(_, b)| b).into();
    Ok((status, body))
}

fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics"))
}

#[test]
fn api_survives_emfile_and_answers_after() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = support::config(dir.path(), net::io::Backend::Mio);
    c.api.addr = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    let node = Node::start(c).unwrap();
    let addr = node.api_addr().unwrap();
    assert_eq!(get(addr, "/healthz").unwrap().0, 200);

    let saved = soft_nofile();
    set_soft_nofile(open_fds() + 32);
    // Take every descriptor but one with files, then connect: the client's socket
    // takes the last one, so the server's accept meets EMFILE.
    let mut filler = Vec::new();
    loop {
        match std::fs::File::open("/dev/null") {
            Ok(f) => filler.push(f),
            Err(e) if e.raw_os_error() == Some(libc::EMFILE) => break,
            Err(e) => panic!("open: {e}"),
        }
    }
    filler.pop();
    let mut pending = TcpStream::connect(addr).unwrap();
    let api = node.api();
    let accept_errors = || {
        let text = api.handle("GET", "/metrics", None, b"").body;
        metric(&text, "imrouter_api_accept_errors_total")
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while accept_errors() == 0 {
        assert!(Instant::now() < deadline, "no accept error was counted");
        std::thread::yield_now();
    }
    // While descriptors stay exhausted the server backs off (5 ms doubling to 1 s):
    // its failed accepts stay within the backoff steps plus one a second, a bound a
    // spinning accept loop would pass by orders of magnitude.
    let since = Instant::now();
    while accept_errors() < 8 {
        assert!(Instant::now() < deadline, "accepting was never retried");
        std::thread::yield_now();
    }
    let errors = accept_errors();
    let bound = 10 + since.elapsed().as_secs();
    eprintln!("{errors} failed accepts in {:?} of EMFILE", since.elapsed());
    assert!(
        errors <= bound,
        "{errors} failed accepts, more than {bound}"
    );
    // Descriptors free up: the connection waiting in the backlog is accepted by
    // itself (no new arrival) and served.
    drop(filler);
    set_soft_nofile(saved);
    pending.set_read_timeout(Some(FAILURE_TIMEOUT)).unwrap();
    write!(
        pending,
        "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    pending.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply:?}");
    // And fresh connections are served.
    assert_eq!(get(addr, "/healthz").unwrap().0, 200);
    let errors = accept_errors();
    eprintln!("accept errors counted during the test: {errors}");
    node.shutdown().unwrap();
}
