//! What the io driver tests share: the io_uring probe and the macro that runs each
//! scenario `fn name(backend: Backend)` on both backends (`name::mio`,
//! `name::uring`, the latter skipped with a note where the kernel refuses io_uring).

use net::io::{Backend, NetConfig, NetDriver};
use shard::runtime::EventFd;

/// Whether io_uring works here; prints why the io_uring half is skipped if not.
/// Probed once, on its own thread: a ring's teardown may interrupt the blocking
/// socket calls (with timeouts) of the thread that created it.
pub fn uring_available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        std::thread::spawn(|| {
            let doorbell = std::sync::Arc::new(EventFd::new().unwrap());
            let config = NetConfig {
                backend: Backend::Uring,
                uring_entries: 8,
                uring_buf_count: 4,
                ..NetConfig::default()
            };
            match NetDriver::new(&config, doorbell, Vec::new()) {
                Ok(_) => true,
                Err(e) => {
                    println!("NOTE: io_uring refused by the kernel ({e}); io_uring tests skipped");
                    false
                }
            }
        })
        .join()
        .unwrap()
    })
}

#[macro_export]
macro_rules! suite {
    ($($name:ident),* $(,)?) => {
        mod mio {
            use super::*;
            $( #[test] fn $name() { super::$name(Backend::Mio) } )*
        }
        mod uring {
            use super::*;
            $( #[test] fn $name() { if $crate::support::uring_available() { super::$name(Backend::Uring) } } )*
        }
    };
}
