//! The disk under the data directory. The catalog (sled) cannot even open on a full disk, so
//! the daemon keeps a reserve of free space for it and the indexes:
//!
//! - an upload is admitted only if the disk keeps the reserve beyond [`UPLOAD_SPACE_FACTOR`]
//!   times its size (the original, its text and vectors in the catalog, its index entries);
//!   otherwise it gets `507 insufficient_storage`, after the KV tier (a cache) was asked to
//!   make room;
//! - below half the reserve the daemon is read-only: ingestion pauses (documents stay queued),
//!   uploads get 507, queries go on, `/readyz` says why; at the whole reserve again it resumes;
//! - the NVMe KV tier, when it shares the file system, keeps twice the reserve free and
//!   evicts its least recently used blobs to do so, so chunk KV never takes the catalog's room;
//! - a ballast file ([`BALLAST_FILE`], [`ballast_size`]: at least what the catalog needs to
//!   open) holds part of the reserve. Should the disk still fill up (another program, a tiny
//!   file system), start-up gives the ballast back so the catalog opens and the daemon serves
//!   read-only; it is written again once space returns.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use engram_kvstore::{disk_space, NvmeTier};

use crate::error::{ApiError, Result, ServerError};

/// The ballast file in the data directory.
pub const BALLAST_FILE: &str = "reserve.ballast";

/// Share of the file system kept free by default: room for the catalog and indexes to finish
/// what is in flight, sled's log to roll over, and an operator's `engram` command.
const RESERVE_SHARE: f64 = 0.05;
/// Bounds of the default reserve: at least two of sled's log segments, at most a size that
/// covers any commit on the largest data directories.
const MIN_RESERVE: u64 = 1 << 20;
const MAX_RESERVE: u64 = 1 << 30;

/// Free bytes an upload needs beyond the reserve, per byte uploaded: the stored original, the
/// parsed text in the catalog's chunks (with overlap), their vectors (1.5 KiB per chunk of
/// about 1 KiB), the log-structured catalog's garbage until it is collected, and index entries
/// (measured: 40 text files of 200 KB took about 6 times their size).
pub const UPLOAD_SPACE_FACTOR: u64 = 8;

/// Least time between two readings of the file system (`statvfs` is cheap, but the owner loop
/// asks often).
const REFRESH_EVERY: Duration = Duration::from_millis(200);

/// The data directory's disk, its reserve, and whether the daemon is read-only.
pub struct Storage {
    dir: PathBuf,
    reserve: u64,
    /// What the next index commit may write before it frees anything (the knowledge base's
    /// estimate, kept up to date by its owner).
    headroom: AtomicU64,
    /// Bytes of originals accepted and not yet ingested: their catalog and index writes are
    /// still to come, so an upload's admission counts them too.
    pending: AtomicU64,
    available: AtomicU64,
    total: u64,
    read_only: AtomicBool,
    /// Why the daemon is read-only (for `/readyz` and the log).
    reason: Mutex<Option<String>>,
    last: Mutex<Option<Instant>>,
    ballast_given_back: AtomicBool,
    /// The NVMe KV tier, when it lives on the same file system.
    kv: OnceLock<Arc<NvmeTier>>,
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Storage")
            .field("dir", &self.dir)
            .field("reserve", &self.reserve)
            .field("read_only", &self.read_only())
            .finish_non_exhaustive()
    }
}

/// The reserve for a file system of `total` bytes: [`RESERVE_SHARE`] of it, within bounds.
pub fn default_reserve(total: u64) -> u64 {
    ((total as f64 * RESERVE_SHARE) as u64).clamp(MIN_RESERVE, MAX_RESERVE)
}

/// The ballast file's size for a reserve: half of it, and never less than what the catalog
/// needs free to open ([`engram_kb::MIN_OPEN_FREE`]) plus [`START_WRITES`]. Half the 1 MiB
/// minimum reserve was less than that: on a small disk filled while the daemon was down, the
/// ballast given back at the next start left the catalog short, and the knowledge base never
/// opened.
pub fn ballast_size(reserve: u64) -> u64 {
    (reserve / 2).max(engram_kb::MIN_OPEN_FREE + START_WRITES)
}

/// What a start writes before the catalog opens, beside it (the version history, the key
/// use times, the files of a first start): a few KiB, rounded up generously.
const START_WRITES: u64 = 256 << 10;

/// Whether two paths are on the same file system.
pub fn same_file_system(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (fs::metadata(a), fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev(),
        _ => false,
    }
}

impl Storage {
    /// Reads the disk under `dir` (which exists), sets the reserve (`reserve_bytes`, or
    /// [`default_reserve`]), gives the ballast back if the disk is short of the reserve, and
    /// decides whether the daemon starts read-only.
    pub fn open(dir: &Path, reserve_bytes: Option<u64>) -> Result<Storage> {
        let space = disk_space(dir).map_err(|e| ServerError::io("statvfs", dir, e))?;
        let reserve = reserve_bytes.unwrap_or_else(|| default_reserve(space.total));
        let s = Storage {
            dir: dir.to_owned(),
            reserve,
            headroom: AtomicU64::new(0),
            pending: AtomicU64::new(0),
            available: AtomicU64::new(space.available),
            total: space.total,
            read_only: AtomicBool::new(false),
            reason: Mutex::new(None),
            last: Mutex::new(None),
            ballast_given_back: AtomicBool::new(false),
            kv: OnceLock::new(),
        };
        if space.available < reserve {
            s.give_back_ballast();
            // The ballast's room is the catalog's to open in, not room for new writes: the
            // daemon starts read-only, until the reserve and the ballast's room are free.
            s.enter_read_only(format!(
                "the disk under {} had {} free at start, short of the {} reserve: the ballast \
                 file was given back so the catalog could open; uploads and ingestion are \
                 paused (queries go on) until {} is free",
                dir.display(),
                mib(space.available),
                mib(reserve),
                mib(s.resume_at())
            ));
        }
        s.refresh_now();
        Ok(s)
    }

    /// Free bytes kept for the catalog and indexes.
    pub fn reserve(&self) -> u64 {
        self.reserve
    }

    /// The NVMe KV tier, asked to make room when the disk runs low (only when it shares the
    /// data directory's file system).
    pub fn set_kv_tier(&self, tier: Arc<NvmeTier>) {
        if same_file_system(&self.dir, tier.dir()) {
            let _ = self.kv.set(tier);
        }
    }

    /// Sets the space the next index commit may need on top of the reserve.
    pub fn set_headroom(&self, bytes: u64) {
        self.headroom.store(bytes, Ordering::Relaxed);
    }

    /// Sets the bytes of originals accepted and not yet ingested.
    pub fn set_pending(&self, bytes: u64) {
        self.pending.store(bytes, Ordering::Relaxed);
    }

    /// The reserve plus the index commit headroom: what must stay free.
    fn floor(&self) -> u64 {
        self.reserve + self.headroom.load(Ordering::Relaxed)
    }

    /// What must be free for writes to resume after read-only mode: the [`Self::floor`], and
    /// while the ballast is given back, its room too (the catalog may have opened in it; new
    /// writes must not take it).
    fn resume_at(&self) -> u64 {
        let ballast = if self.ballast_given_back.load(Ordering::Relaxed) {
            ballast_size(self.reserve)
        } else {
            0
        };
        self.floor() + ballast
    }

    /// Enters read-only mode for `reason` (logged, and shown by `/readyz`).
    fn enter_read_only(&self, reason: String) {
        tracing::error!("{reason}");
        *self.reason.lock().unwrap_or_else(PoisonError::into_inner) = Some(reason);
        self.read_only.store(true, Ordering::Relaxed);
    }

    /// Free bytes at the last reading.
    pub fn available(&self) -> u64 {
        self.available.load(Ordering::Relaxed)
    }

    pub fn read_only(&self) -> bool {
        self.read_only.load(Ordering::Relaxed)
    }

    /// Why the daemon is read-only, if it is.
    pub fn reason(&self) -> Option<String> {
        self.reason
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Reads the disk again (at most every [`REFRESH_EVERY`]) and updates the read-only
    /// state; returns whether writes may go on.
    pub fn writable(&self) -> bool {
        let due = {
            let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
            let due = last.is_none_or(|t| t.elapsed() >= REFRESH_EVERY);
            if due {
                *last = Some(Instant::now());
            }
            due
        };
        if due {
            self.refresh_now();
        }
        !self.read_only()
    }

    /// Reads the disk, lets the KV tier make room when the disk is below twice the reserve,
    /// and enters read-only mode below half the reserve (leaving it at the whole reserve, and
    /// the ballast's room when it was given back: [`Self::resume_at`]).
    fn refresh_now(&self) {
        let mut available = self.read();
        if let Some(kv) = self.kv.get() {
            // The KV tier leaves twice what the catalog and indexes need right now.
            kv.set_reserve_free_bytes(2 * self.floor());
        }
        if available < 2 * self.floor() {
            if let Some(kv) = self.kv.get() {
                match kv.make_room(0) {
                    Ok(0) => {}
                    Ok(n) => {
                        tracing::warn!(bytes = n, "disk low: chunk KV evicted to keep the reserve");
                        available = self.read();
                    }
                    Err(e) => tracing::warn!("disk low: the KV tier could not make room: {e}"),
                }
            }
        }
        let was = self.read_only();
        let headroom = self.headroom.load(Ordering::Relaxed);
        if !was && available < self.reserve / 2 + headroom {
            self.enter_read_only(format!(
                "the disk under {} has {} free, below half the {} reserve kept for the catalog \
                 plus the {} the next index commit may need: uploads and ingestion are paused \
                 (queries go on) until space is freed",
                self.dir.display(),
                mib(available),
                mib(self.reserve),
                mib(headroom)
            ));
            // Writes already under way (the catalog's background flush, a commit) get the
            // ballast's room rather than a full disk.
            self.give_back_ballast();
        } else if was && available >= self.resume_at() {
            tracing::info!(
                free = available,
                "disk space is back above the reserve: writes resume"
            );
            *self.reason.lock().unwrap_or_else(PoisonError::into_inner) = None;
            self.read_only.store(false, Ordering::Relaxed);
        }
        if !self.read_only() && self.ballast_given_back.load(Ordering::Relaxed) {
            // Space came back: hold part of the reserve again.
            if available >= 3 * self.reserve {
                self.ensure_ballast();
            }
        }
    }

    fn read(&self) -> u64 {
        let available = match disk_space(&self.dir) {
            Ok(s) => s.available,
            Err(e) => {
                tracing::warn!("statvfs {}: {e}", self.dir.display());
                self.available()
            }
        };
        self.available.store(available, Ordering::Relaxed);
        available
    }

    /// Admits an upload of `bytes`: `Ok` when the disk keeps the reserve beyond
    /// [`UPLOAD_SPACE_FACTOR`] times its size (the KV tier makes room first if it can), else
    /// `507 insufficient_storage` saying how much is free and needed.
    pub fn admit(&self, bytes: u64) -> std::result::Result<(), ApiError> {
        let pending = self.pending.load(Ordering::Relaxed);
        let needed =
            self.floor() + UPLOAD_SPACE_FACTOR.saturating_mul(bytes.saturating_add(pending));
        self.refresh_now();
        let mut available = self.available();
        if available < needed && !self.read_only() {
            if let Some(kv) = self.kv.get() {
                let want = needed.saturating_sub(kv.reserve_free_bytes());
                if kv.make_room(want).unwrap_or(0) > 0 {
                    available = self.read();
                }
            }
        }
        if self.read_only() || available < needed {
            return Err(ApiError::InsufficientStorage {
                reason: format!(
                    "not enough free disk space to store this upload durably: {} free under the \
                     data directory, {} needed ({}x the upload and the {} still being ingested, \
                     plus the {} kept for the catalog and indexes); free space or grow the disk, \
                     then retry",
                    mib(available),
                    mib(needed),
                    UPLOAD_SPACE_FACTOR,
                    mib(pending),
                    mib(self.floor())
                ),
            });
        }
        Ok(())
    }

    /// Admits a copy of `bytes` (a backup's snapshot of the catalog): `Ok` when the disk keeps
    /// the reserve beyond it, else `507`.
    pub fn admit_copy(&self, bytes: u64) -> std::result::Result<(), ApiError> {
        let needed = self.floor().saturating_add(bytes);
        let available = self.read();
        if self.read_only() || available < needed {
            return Err(ApiError::InsufficientStorage {
                reason: format!(
                    "not enough free disk space for the backup's copy of the catalog: {} free \
                     under the data directory, {} needed",
                    mib(available),
                    mib(needed)
                ),
            });
        }
        Ok(())
    }

    /// Writes the ballast file ([`ballast_size`]) unless it is there; best effort.
    pub fn ensure_ballast(&self) {
        let path = self.dir.join(BALLAST_FILE);
        let size = ballast_size(self.reserve);
        if fs::metadata(&path).is_ok_and(|m| m.len() == size) {
            self.ballast_given_back.store(false, Ordering::Relaxed);
            return;
        }
        if self.read() < 2 * self.reserve + size {
            self.ballast_given_back.store(true, Ordering::Relaxed);
            return;
        }
        match write_ballast(&path, size) {
            Ok(()) => {
                self.ballast_given_back.store(false, Ordering::Relaxed);
                self.read();
            }
            Err(e) => {
                tracing::warn!("cannot write the ballast file {}: {e}", path.display());
                let _ = fs::remove_file(&path);
            }
        }
    }

    /// Deletes the ballast file so the catalog can open on a full disk.
    fn give_back_ballast(&self) {
        let path = self.dir.join(BALLAST_FILE);
        if let Ok(m) = fs::metadata(&path) {
            match fs::remove_file(&path) {
                Ok(()) => {
                    tracing::warn!(
                        bytes = m.len(),
                        "the disk is short of its reserve: gave back the ballast file"
                    );
                    self.ballast_given_back.store(true, Ordering::Relaxed);
                    self.read();
                }
                Err(e) => tracing::error!("cannot delete {}: {e}", path.display()),
            }
        } else {
            self.ballast_given_back.store(true, Ordering::Relaxed);
        }
    }

    /// The storage check of `/readyz`.
    pub fn status_json(&self) -> serde_json::Value {
        serde_json::json!({
            "ok": !self.read_only(),
            "read_only": self.read_only(),
            "reason": self.reason(),
            "available_bytes": self.available(),
            "total_bytes": self.total,
            "reserve_bytes": self.reserve,
            "index_headroom_bytes": self.headroom.load(Ordering::Relaxed),
            "pending_ingest_bytes": self.pending.load(Ordering::Relaxed),
        })
    }
}

/// Allocates `size` bytes at `path` (allocated, not sparse: a sparse file would reserve
/// nothing), fsynced, through a temp file and a rename: `fallocate` where the file system has
/// it (instant), else written zeros.
fn write_ballast(path: &Path, size: u64) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let result = (|| {
        let mut f = File::create(&tmp)?;
        let allocated =
            rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::empty(), 0, size).is_ok();
        if !allocated {
            let zeros = vec![0u8; 1 << 20];
            let mut left = size;
            while left > 0 {
                let n = left.min(zeros.len() as u64) as usize;
                f.write_all(&zeros[..n])?;
                left -= n as u64;
            }
        }
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_reserve_is_a_bounded_share() {
        assert_eq!(default_reserve(20 << 20), 1 << 20);
        assert_eq!(default_reserve(100 << 20), 5 << 20);
        assert_eq!(default_reserve(1 << 40), 1 << 30);
    }

    #[test]
    fn admission_and_read_only_follow_the_reserve() {
        let dir = tempfile::tempdir().unwrap();
        let free = disk_space(dir.path()).unwrap().available;
        // A reserve the disk holds with room to spare: writable, a small upload admitted, one
        // as large as the disk refused with 507.
        let s = Storage::open(dir.path(), Some(1 << 20)).unwrap();
        assert!(s.writable());
        s.admit(1000).unwrap();
        let e = s.admit(free).unwrap_err();
        assert_eq!(e.status(), axum::http::StatusCode::INSUFFICIENT_STORAGE);
        assert!(e.to_string().contains("free space or grow the disk"), "{e}");
        // A reserve larger than the disk: read-only from the start, and /readyz says why.
        let s = Storage::open(dir.path(), Some(free.saturating_mul(4))).unwrap();
        assert!(!s.writable());
        assert!(s.admit(1).is_err());
        let j = s.status_json();
        assert_eq!(j["read_only"], true);
        assert!(j["reason"].as_str().unwrap().contains("paused"), "{j}");
    }

    #[test]
    fn the_ballast_is_written_and_given_back() {
        let dir = tempfile::tempdir().unwrap();
        let s = Storage::open(dir.path(), Some(1 << 20)).unwrap();
        s.ensure_ballast();
        let path = dir.path().join(BALLAST_FILE);
        // Half of a 1 MiB reserve would be less than the catalog needs to open: given back on
        // a full disk, the ballast must leave at least that.
        assert!(fs::metadata(&path).unwrap().len() > engram_kb::MIN_OPEN_FREE);
        assert_eq!(ballast_size(64 << 20), 32 << 20);
        s.give_back_ballast();
        assert!(!path.exists());
    }
}
