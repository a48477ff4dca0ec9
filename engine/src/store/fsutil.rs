//! Small file-system helpers shared by the log and the metadata store.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

/// Mode of every file the stores create: the owner only (message contents, tokens).
pub const FILE_MODE: u32 = 0o600;
/// Mode of every directory the stores create.
pub const DIR_MODE: u32 = 0o700;

/// `create_dir_all` with mode 0700 for every directory it creates (existing ones
/// keep their mode).
pub fn create_private_dir_all(dir: &Path) -> io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)
}

/// Options for a new file of the stores: read-write, created with [`FILE_MODE`].
pub fn private_file() -> OpenOptions {
    let mut o = OpenOptions::new();
    o.read(true).write(true).mode(FILE_MODE);
    o
}

/// Reserves `len_bytes` of real disk blocks for `file` (and sets its size), so that
/// later stores through a shared mapping cannot hit ENOSPC (which would be a SIGBUS).
pub fn preallocate(file: &File, len_bytes: u64) -> io::Result<()> {
    let len = libc::off_t::try_from(len_bytes)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "length exceeds off_t"))?;
    // SAFETY: plain FFI call on a file descriptor that `file` keeps open for the call.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}

/// fsyncs a directory, making creations, renames and deletions inside it durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// An exclusive advisory lock (`flock`) on `<dir>/LOCK`, held while the value lives:
/// a second process (or a second open in this one) opening the same directory fails
/// with `WouldBlock` instead of corrupting it.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
}

impl DirLock {
    pub fn acquire(dir: &Path) -> io::Result<DirLock> {
        let file = private_file()
            .create(true)
            .truncate(false)
            .open(dir.join("LOCK"))?;
        // SAFETY: plain FFI call on a file descriptor that `file` keeps open; the lock
        // is released when the descriptor is closed (when `DirLock` drops).
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(DirLock { _file: file })
    }
}

/// Writes `bytes` to `<dir>/<name>` atomically: a temporary file is written and
/// fsynced, renamed over the target, and the directory fsynced. A crash leaves either
/// the old file or the new one, never a mix.
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let tmp = dir.join(format!("{name}.tmp"));
    {
        let mut f = private_file().create(true).truncate(true).open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, dir.join(name))?;
    sync_dir(dir)
}
