//! Syncs and file work off the shard thread: the [`SyncHook`] every sync goes
//! through, the [`SyncJob`]s the syncer thread runs (a sync, then the spare segment
//! made ahead and the retired segments deleted), and the state they share with the
//! log.

use super::*;

/// Makes a segment's bytes durable. Every sync of the log goes through it: the
/// syncer's jobs, a roll's seal, the final sync of a stop. Without one (production)
/// the log calls `fdatasync`; tests install one ([`MessageLog::set_sync_hook`]) to
/// hold a sync, fail it, or record what it covered (a simulated power cut).
pub trait SyncHook: Send + Sync + 'static {
    /// Makes `file` (the segment at `path`) durable at least up to byte `len`.
    fn sync(&self, file: &File, path: &Path, len: u32) -> io::Result<()>;
}

pub(super) fn sync_file(
    hook: Option<&Arc<dyn SyncHook>>,
    file: &File,
    path: &Path,
    len: u32,
) -> io::Result<()> {
    match hook {
        Some(h) => h.sync(file, path, len),
        None => file.sync_data(),
    }
}

/// The sync of a log's appends up to [`MessageLog::begin_sync`], run on another
/// thread (`fdatasync` of the segment file: milliseconds on a virtual disk, which
/// the shard thread must not wait for).
///
/// A job also carries the log's file work, done after the sync: creating and
/// preallocating the next segment ahead of its roll, and deleting retired segments
/// (after writing the seq snapshot they need). So the shard thread neither creates
/// nor deletes files in steady state.
pub struct SyncJob {
    pub(super) file: Arc<File>,
    pub(super) path: Arc<Path>,
    /// The active segment's end when the job was made: what it makes durable.
    pub(super) len: u32,
    pub(super) hook: Option<Arc<dyn SyncHook>>,
    pub(super) work: Option<FileWork>,
}

impl SyncJob {
    /// Blocks until the appends are on disk, then does the job's file work.
    pub fn run(self) -> io::Result<()> {
        let mut out = Ok(());
        self.run_then(|r| out = r);
        out
    }

    /// Blocks until the appends are on disk, hands the result to `synced` (which
    /// may wake whoever waits for it), then does the job's file work.
    pub fn run_then(self, synced: impl FnOnce(io::Result<()>)) {
        synced(sync_file(
            self.hook.as_ref(),
            &self.file,
            &self.path,
            self.len,
        ));
        if let Some(work) = self.work {
            work.run();
        }
    }
}

/// The next segment, created by a job ahead of the roll that needs it.
pub(super) struct Spare {
    pub(super) id: u32,
    pub(super) path: Arc<Path>,
    pub(super) file: File,
    pub(super) map: MmapMut,
}

pub(super) enum SpareState {
    /// None, and none being made.
    Idle,
    /// A job's file work is making it.
    Preparing,
    Ready(Spare),
    /// The job could not make it (the roll then tries itself).
    Failed(io::Error),
}

/// What the log and its jobs' file work share.
pub(super) struct FileShared {
    pub(super) state: Mutex<FileState>,
    pub(super) changed: Condvar,
}

pub(super) struct FileState {
    pub(super) spare: SpareState,
    /// A retirement (snapshot write, delete, dir sync) that failed.
    pub(super) retire_error: Option<io::Error>,
    /// File work handed to jobs and not yet run or dropped: a retirement on the
    /// shard thread waits for it, so two writers never race on the seq snapshot (an
    /// older snapshot must not replace a newer one) or on its temporary file.
    pub(super) work_in_flight: usize,
}

impl FileShared {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, FileState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// File work handed to a [`SyncJob`].
pub(super) struct FileWork {
    pub(super) dir: Arc<Path>,
    /// Create the next segment: its id and size.
    pub(super) prepare: Option<(u32, u32)>,
    /// The seq snapshot to make durable before the retired segments go.
    pub(super) snapshot: Option<Vec<u8>>,
    /// Retired segments: unmapped and deleted here.
    pub(super) retired: Vec<Segment>,
    pub(super) shared: Arc<FileShared>,
}

impl FileWork {
    pub(super) fn run(mut self) {
        if let Some((id, bytes)) = self.prepare.take() {
            let made = new_segment_file(&self.dir, id, bytes);
            let mut st = self.shared.lock();
            st.spare = match made {
                Ok((path, file, map)) => SpareState::Ready(Spare {
                    id,
                    path: path.into(),
                    file,
                    map,
                }),
                Err(e) => SpareState::Failed(e),
            };
            drop(st);
            self.shared.changed.notify_all();
        }
        if let Err(e) = retire_files(&self.dir, self.snapshot.take(), &mut self.retired) {
            self.shared.lock().retire_error = Some(e);
        }
    }
}

impl Drop for FileWork {
    fn drop(&mut self) {
        // Run (at the end of `run`) or dropped without running (its job was never
        // run): either way it is no longer in flight, and a roll must not wait for a
        // segment it will not make.
        let mut st = self.shared.lock();
        st.work_in_flight -= 1;
        if self.prepare.is_some() && matches!(st.spare, SpareState::Preparing) {
            st.spare = SpareState::Idle;
        }
        drop(st);
        self.shared.changed.notify_all();
    }
}

/// Writes `snapshot` durably, then unmaps and deletes `retired` and syncs `dir`.
pub(super) fn retire_files(
    dir: &Path,
    snapshot: Option<Vec<u8>>,
    retired: &mut Vec<Segment>,
) -> io::Result<()> {
    if retired.is_empty() {
        return Ok(());
    }
    if let Some(bytes) = snapshot {
        write_atomic(dir, SEQ_SNAPSHOT_NAME, &bytes)?;
    }
    for seg in retired.drain(..) {
        let path = seg.path.clone();
        drop(seg);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    sync_dir(dir)
}

/// Creates segment `id` of `bytes` in `dir`: preallocated, mapped, its directory
/// entry synced. Nothing is left behind on failure.
pub(super) fn new_segment_file(
    dir: &Path,
    id: u32,
    bytes: u32,
) -> io::Result<(PathBuf, File, MmapMut)> {
    let path = segment_path(dir, id);
    let file = private_file().create_new(true).open(&path)?;
    let res = preallocate(&file, u64::from(bytes))
        .and_then(|()| map_segment(&file))
        .and_then(|map| sync_dir(dir).map(|()| map));
    match res {
        Ok(map) => Ok((path, file, map)),
        Err(e) => {
            let _ = std::fs::remove_file(&path);
            Err(e)
        }
    }
}
