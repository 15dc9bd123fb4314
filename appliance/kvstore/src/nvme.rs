//! The NVMe tier: one file per blob under a directory, crash-safe writes, LRU eviction under a
//! byte budget, batched reads through io_uring (or plain `pread`), optionally O_DIRECT.
//!
//! ```text
//! <dir>/LOCK                      held (flock) while a tier has the directory open
//! <dir>/ab/abcdef....kv           a blob, named by its key's 32 hex digits, fanned out by the
//!                                 first byte so no directory holds more than 1/256 of them
//! <dir>/ab/abcdef....<pid>.<n>.tmp   a write in progress; deleted at open
//! ```
//!
//! A write goes to a temp file in the blob's fan-out directory, is fsynced, renamed over the
//! final name and the directory fsynced: after a crash a name holds either nothing, the old blob
//! or the whole new one. The in-memory index changes only after the rename, so it is never ahead
//! of the disk and a failed write leaves no trace but a removed temp file; that is why the tier,
//! unlike redb, keeps accepting writes after an I/O error (a full disk is the common case, and it
//! passes). Deletions (eviction, `remove`) are not fsynced: a blob that comes back after a crash
//! is a valid blob, and the budget is enforced again at open.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Instant, SystemTime};

use crate::blob::BlobKey;
use crate::error::{KvStoreError, Result};
use crate::io::{probe_uring, read_plain, ReadReq, Ring};
use crate::lru::Lru;
use crate::tier::{Counters, KvTier, TierKind, TierMetrics};

/// The lock file that keeps two tiers (or processes) out of one directory: each would delete the
/// other's temp files at open and evict by its own idea of the budget.
const LOCK_FILE: &str = "LOCK";
/// Extension of a stored blob.
const BLOB_EXT: &str = ".kv";
/// Extension of a write in progress.
const TMP_EXT: &str = ".tmp";

/// How the NVMe tier reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoMode {
    /// io_uring if the kernel allows it (probed once at open), else plain reads.
    Auto,
    /// io_uring or nothing: `open` fails if the probe does.
    Uring,
    /// `pread`, one file after another.
    Plain,
}

/// Options of [`NvmeTier::open`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NvmeOptions {
    pub budget_bytes: u64,
    pub io: IoMode,
    /// O_DIRECT reads into aligned buffers (bypassing the page cache, which would otherwise hold
    /// a second copy of every blob the DRAM tier already caches); falls back to buffered reads if
    /// the file system refuses O_DIRECT (EINVAL).
    pub direct: bool,
    /// Free bytes the tier leaves on its file system: before every write, and at open, it
    /// evicts its least recently used blobs until the file system has this much free beyond
    /// the write (the budget alone is a figure from start-up; other writers, the catalog
    /// first, share the disk). 0: no check.
    pub reserve_free_bytes: u64,
}

impl NvmeOptions {
    /// `budget_bytes` with io_uring where allowed, O_DIRECT reads and no free-space reserve.
    pub fn new(budget_bytes: u64) -> NvmeOptions {
        NvmeOptions {
            budget_bytes,
            io: IoMode::Auto,
            direct: true,
            reserve_free_bytes: 0,
        }
    }
}

/// Space on the file system holding a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskSpace {
    /// Bytes an unprivileged writer can still write.
    pub available: u64,
    /// Size of the file system.
    pub total: u64,
}

/// The space of the file system holding `path` (`statvfs`).
pub fn disk_space(path: &Path) -> io::Result<DiskSpace> {
    let s = rustix::fs::statvfs(path).map_err(io::Error::from)?;
    Ok(DiskSpace {
        available: s.f_bavail.saturating_mul(s.f_frsize),
        total: s.f_blocks.saturating_mul(s.f_frsize),
    })
}

/// Whether io_uring works in this process (the probe [`IoMode::Auto`] runs at open).
pub fn io_uring_available() -> io::Result<()> {
    probe_uring()
}

/// The in-memory index: per key its size and a generation number (so a reader that finds a file
/// missing drops only the entry it looked up, not a newer one), plus the bytes reserved by
/// writes in flight.
#[derive(Debug, Default)]
struct Index {
    lru: Lru<u64>,
    reserved: u64,
    next_gen: u64,
}

impl Index {
    fn insert(&mut self, key: BlobKey, size: u64) {
        let generation = self.next_gen;
        self.next_gen += 1;
        self.lru.insert(key, generation, size);
    }
}

/// Blobs as files in a directory. See the module docs for the layout and the crash safety.
pub struct NvmeTier {
    dir: PathBuf,
    budget: u64,
    reserve_free: AtomicU64,
    index: Mutex<Index>,
    /// Serializes the steps that change files and index together (reserve and evict; rename and
    /// insert; remove), so an index entry and its file never disagree for long. The data write
    /// and its fsync run outside it, so concurrent writers overlap their I/O.
    writer: Mutex<()>,
    /// `Some` in io_uring mode: idle rings, one taken per batch so concurrent batches don't wait.
    rings: Option<Mutex<Vec<Ring>>>,
    /// Still opening with O_DIRECT (cleared the first time the file system refuses it).
    direct: AtomicBool,
    counters: Counters,
    _lock: File,
    /// Failure injection: the next temp-file write fails with this errno after half its bytes.
    #[cfg(test)]
    pub(crate) fail_next_write: Mutex<Option<i32>>,
    /// Failure injection: pretend the file system refuses O_DIRECT at open or at read.
    #[cfg(test)]
    refuse_direct: Mutex<Option<RefuseDirect>>,
    /// Failure injection: pretend the file system has this many bytes free when the tier is
    /// empty (its free space is this minus the bytes stored and reserved).
    #[cfg(test)]
    pub(crate) fake_disk: Mutex<Option<u64>>,
}

/// Where injected O_DIRECT refusals happen (every file system here accepts O_DIRECT).
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RefuseDirect {
    AtOpen,
    AtRead,
}

impl std::fmt::Debug for NvmeTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmeTier")
            .field("dir", &self.dir)
            .field("budget", &self.budget)
            .field("io", &self.io_mode())
            .field("direct", &self.direct_io())
            .finish_non_exhaustive()
    }
}

impl NvmeTier {
    /// Opens (creating it if needed) the tier in `dir`: takes its lock, deletes leftover temp
    /// files, rebuilds the index from the blob files (recency from modification time, oldest
    /// first) and evicts down to the budget.
    pub fn open(dir: impl AsRef<Path>, opts: NvmeOptions) -> Result<NvmeTier> {
        let dir = dir.as_ref().to_path_buf();
        fs::create_dir_all(&dir).map_err(|e| KvStoreError::io("create directory", &dir, e))?;
        let lock_path = dir.join(LOCK_FILE);
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(|e| KvStoreError::io("open lock file", &lock_path, e))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => return Err(KvStoreError::Locked { path: dir }),
            Err(fs::TryLockError::Error(e)) => return Err(KvStoreError::io("lock", &lock_path, e)),
        }
        let rings = match opts.io {
            IoMode::Plain => None,
            IoMode::Uring => {
                probe_uring().map_err(|e| KvStoreError::io("io_uring probe", &dir, e))?;
                Some(Mutex::new(Vec::new()))
            }
            IoMode::Auto => probe_uring().ok().map(|()| Mutex::new(Vec::new())),
        };
        let tier = NvmeTier {
            budget: opts.budget_bytes,
            reserve_free: AtomicU64::new(opts.reserve_free_bytes),
            index: Mutex::new(Index::default()),
            writer: Mutex::new(()),
            rings,
            direct: AtomicBool::new(opts.direct),
            counters: Counters::default(),
            _lock: lock,
            #[cfg(test)]
            fail_next_write: Mutex::new(None),
            #[cfg(test)]
            refuse_direct: Mutex::new(None),
            #[cfg(test)]
            fake_disk: Mutex::new(None),
            dir,
        };
        tier.scan()?;
        tier.make_room(0)?;
        Ok(tier)
    }

    /// Free bytes the tier leaves on its file system ([`NvmeOptions::reserve_free_bytes`]).
    pub fn reserve_free_bytes(&self) -> u64 {
        self.reserve_free.load(Ordering::Relaxed)
    }

    /// Changes the free-space reserve (the daemon raises it with what its catalog needs); the
    /// next write or [`make_room`](Self::make_room) evicts to keep it.
    pub fn set_reserve_free_bytes(&self, bytes: u64) {
        self.reserve_free.store(bytes, Ordering::Relaxed);
    }

    /// Evicts least recently used blobs until the file system has `extra` bytes free beyond
    /// the tier's reserve (or the tier is empty); returns the bytes evicted. The daemon calls
    /// it when the disk it shares with the catalog runs low: chunk KV is a cache, and goes
    /// first.
    pub fn make_room(&self, extra: u64) -> Result<u64> {
        if self.reserve_free_bytes() == 0 && extra == 0 {
            return Ok(0);
        }
        let _w = self.lock_writer();
        let evicted = {
            let mut ix = self.lock_index();
            self.evict_for_space(&mut ix, None, extra)?
        };
        let bytes = evicted.iter().map(|(_, s)| s).sum();
        let keys: Vec<BlobKey> = evicted.into_iter().map(|(k, _)| k).collect();
        self.delete_files(&keys);
        Ok(bytes)
    }

    /// Free bytes of the file system once files of `freed` bytes, already out of the index,
    /// are deleted.
    fn free_bytes(&self, ix: &Index, freed: u64) -> Result<u64> {
        #[cfg(test)]
        if let Some(disk) = *self
            .fake_disk
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
        {
            return Ok(disk.saturating_sub(ix.lru.used() + ix.reserved));
        }
        let _ = ix;
        Ok(disk_space(&self.dir)
            .map_err(|e| KvStoreError::io("statvfs", &self.dir, e))?
            .available
            + freed)
    }

    /// Pops LRU entries (other than `keep`) until the file system would have `extra` bytes
    /// beyond the reserve once their files are deleted; returns them with their sizes.
    fn evict_for_space(
        &self,
        ix: &mut Index,
        keep: Option<&BlobKey>,
        extra: u64,
    ) -> Result<Vec<(BlobKey, u64)>> {
        let free = self.free_bytes(ix, 0)?;
        let mut short = (self.reserve_free_bytes() + extra).saturating_sub(free);
        let mut evicted = Vec::new();
        while short > 0 {
            let Some((k, e)) = ix.lru.pop_lru_except(keep) else {
                break;
            };
            short = short.saturating_sub(e.size);
            evicted.push((k, e.size));
        }
        Ok(evicted)
    }

    /// `"io_uring"` or `"plain"`.
    pub fn io_mode(&self) -> &'static str {
        if self.rings.is_some() {
            "io_uring"
        } else {
            "plain"
        }
    }

    /// Whether reads still use O_DIRECT (asked for, and not refused by the file system yet).
    pub fn direct_io(&self) -> bool {
        self.direct.load(Ordering::Relaxed)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the blob of `key` lives.
    pub fn blob_path(&self, key: &BlobKey) -> PathBuf {
        let hex = key.to_hex();
        self.dir.join(&hex[..2]).join(format!("{hex}{BLOB_EXT}"))
    }

    fn lock_index(&self) -> MutexGuard<'_, Index> {
        // Every index update completes or does nothing, so a poisoned lock is still consistent.
        self.index.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn lock_writer(&self) -> MutexGuard<'_, ()> {
        self.writer.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Rebuilds the index from the directory (see [`NvmeTier::open`]).
    fn scan(&self) -> Result<()> {
        let read_dir =
            |d: &Path| fs::read_dir(d).map_err(|e| KvStoreError::io("read directory", d, e));
        let mut found: Vec<(SystemTime, BlobKey, u64)> = Vec::new();
        for sub in read_dir(&self.dir)? {
            let sub = sub.map_err(|e| KvStoreError::io("read directory", &self.dir, e))?;
            let name = sub.file_name();
            let Some(prefix) = name.to_str().filter(|n| is_fanout_name(n)) else {
                continue;
            };
            let sub_path = sub.path();
            if !sub_path.is_dir() {
                continue;
            }
            for entry in read_dir(&sub_path)? {
                let entry = entry.map_err(|e| KvStoreError::io("read directory", &sub_path, e))?;
                let path = entry.path();
                let name = entry.file_name();
                let Some(name) = name.to_str() else { continue };
                if name.ends_with(TMP_EXT) {
                    match fs::remove_file(&path) {
                        Ok(()) => {}
                        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                        Err(e) => return Err(KvStoreError::io("remove temp file", &path, e)),
                    }
                    continue;
                }
                let Some(key) = name
                    .strip_suffix(BLOB_EXT)
                    .filter(|hex| hex.starts_with(prefix))
                    .and_then(BlobKey::from_hex)
                else {
                    continue;
                };
                let meta = entry
                    .metadata()
                    .map_err(|e| KvStoreError::io("stat", &path, e))?;
                if meta.is_file() {
                    let mtime = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                    found.push((mtime, key, meta.len()));
                }
            }
        }
        found.sort();
        let evicted = {
            let mut ix = self.lock_index();
            for (_, key, size) in found {
                ix.insert(key, size);
            }
            let mut evicted = Vec::new();
            while ix.lru.used() > self.budget {
                let (key, _) = ix
                    .lru
                    .pop_lru_except(None)
                    .expect("used > 0 means an entry");
                evicted.push(key);
            }
            evicted
        };
        self.delete_files(&evicted);
        Ok(())
    }

    /// Deletes evicted blobs' files. A file that cannot be deleted stays on disk outside the
    /// index until the next open indexes it again and re-applies the budget.
    fn delete_files(&self, keys: &[BlobKey]) {
        for key in keys {
            let _ = fs::remove_file(self.blob_path(key));
        }
        self.counters.evicted(keys.len());
    }

    /// Makes room for `size` more bytes (evicting LRU entries other than `key`, whose old size
    /// counts as free since the write replaces it) and reserves them. `Full`, evicting nothing,
    /// if even an empty tier could not take it next to the writes in flight. With a free-space
    /// reserve, also evicts until the file system keeps it beyond this write and the writes in
    /// flight; `NoSpace` when even an empty tier would not.
    fn reserve(&self, key: &BlobKey, size: u64) -> Result<()> {
        let _w = self.lock_writer();
        let mut evicted = Vec::new();
        let result = {
            let mut ix = self.lock_index();
            if ix.reserved + size > self.budget {
                return Err(KvStoreError::Full {
                    tier: TierKind::Nvme,
                    needed: size,
                    budget: self.budget,
                });
            }
            let mut freed = 0;
            loop {
                let old = ix.lru.peek(key).map_or(0, |s| s.size);
                if ix.lru.used() - old + ix.reserved + size <= self.budget {
                    break;
                }
                let (k, slot) = ix
                    .lru
                    .pop_lru_except(Some(key))
                    .expect("with every other entry gone, reserved + size fits");
                freed += slot.size;
                evicted.push(k);
            }
            let mut short = 0;
            let reserve_free = self.reserve_free_bytes();
            if reserve_free > 0 {
                // Files evicted above are deleted below: count them as free already.
                let free = self.free_bytes(&ix, freed)?;
                short = (reserve_free + ix.reserved + size).saturating_sub(free);
                while short > 0 {
                    let Some((k, slot)) = ix.lru.pop_lru_except(Some(key)) else {
                        break;
                    };
                    short = short.saturating_sub(slot.size);
                    evicted.push(k);
                }
            }
            if short > 0 {
                Err(KvStoreError::NoSpace {
                    path: self.dir.clone(),
                })
            } else {
                ix.reserved += size;
                Ok(())
            }
        };
        self.delete_files(&evicted);
        result
    }

    /// Creates the fan-out directory if needed, making its entry durable.
    fn ensure_subdir(&self, sub: &Path) -> Result<()> {
        if sub.is_dir() {
            return Ok(());
        }
        match fs::create_dir(sub) {
            Ok(()) => sync_dir(&self.dir),
            // A concurrent writer made it (or something else is in the way, which the temp file
            // creation reports).
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(KvStoreError::write("create directory", sub, e)),
        }
    }

    /// Writes and fsyncs the temp file.
    fn write_temp(&self, tmp: &Path, bytes: &[u8]) -> Result<()> {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(tmp)
            .map_err(|e| KvStoreError::write("create temp file", tmp, e))?;
        #[cfg(test)]
        if let Some(errno) = self
            .fail_next_write
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            f.write_all(&bytes[..bytes.len() / 2])
                .map_err(|e| KvStoreError::write("write", tmp, e))?;
            return Err(KvStoreError::write(
                "write",
                tmp,
                io::Error::from_raw_os_error(errno),
            ));
        }
        f.write_all(bytes)
            .map_err(|e| KvStoreError::write("write", tmp, e))?;
        f.sync_all()
            .map_err(|e| KvStoreError::write("fsync", tmp, e))
    }

    /// Temp file, rename, directory fsync, index; the reservation of `bytes.len()` is released
    /// on every path.
    fn write_blob(&self, key: &BlobKey, bytes: &[u8]) -> Result<()> {
        let size = bytes.len() as u64;
        let path = self.blob_path(key);
        let sub = path.parent().expect("blob paths have a fan-out directory");
        let release = || self.lock_index().reserved -= size;
        let tmp = sub.join(format!(
            "{}.{}.{}{TMP_EXT}",
            key.to_hex(),
            std::process::id(),
            TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        if let Err(e) = self
            .ensure_subdir(sub)
            .and_then(|()| self.write_temp(&tmp, bytes))
        {
            let _ = fs::remove_file(&tmp);
            release();
            return Err(e);
        }
        let _w = self.lock_writer();
        if let Err(e) = fs::rename(&tmp, &path) {
            let _ = fs::remove_file(&tmp);
            release();
            return Err(KvStoreError::write("rename", &path, e));
        }
        {
            let mut ix = self.lock_index();
            ix.reserved -= size;
            ix.insert(*key, size);
        }
        self.counters.written(bytes.len());
        // The blob is in place and readable, so it stays indexed; the error says it may not
        // survive a crash.
        sync_dir(sub)
    }

    /// Opens a blob for reading, with O_DIRECT while the file system accepts it.
    fn open_blob(&self, path: &Path) -> io::Result<(File, usize, bool)> {
        let direct = self.direct_io();
        let file = if direct {
            let opened = OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(path);
            #[cfg(test)]
            let opened = match *self.refuse_direct.lock().unwrap() {
                Some(RefuseDirect::AtOpen) => Err(io::Error::from_raw_os_error(libc::EINVAL)),
                _ => opened,
            };
            match opened {
                Ok(f) => Some(f),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    self.direct.store(false, Ordering::Relaxed);
                    None
                }
                Err(e) => return Err(e),
            }
        } else {
            None
        };
        let (file, direct) = match file {
            Some(f) => (f, true),
            None => (File::open(path)?, false),
        };
        let len = usize::try_from(file.metadata()?.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "file too large"))?;
        Ok((file, len, direct))
    }

    /// Runs a batch of reads with a pooled ring, or with `pread` in plain mode (or when no ring
    /// can be set up, e.g. out of locked memory).
    fn run_reads(&self, reqs: &mut [ReadReq]) {
        let Some(pool) = &self.rings else {
            return read_plain(reqs);
        };
        let ring = pool
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
            .map_or_else(Ring::new, Ok);
        match ring {
            Ok(mut ring) => {
                // A ring that failed is dropped; its requests carry the error.
                if ring.read_batch(reqs).is_ok() {
                    pool.lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(ring);
                }
            }
            Err(_) => read_plain(reqs),
        }
    }

    /// Drops the index entry of a blob whose file has vanished, unless it was replaced since.
    fn forget(&self, key: &BlobKey, generation: u64) {
        let mut ix = self.lock_index();
        if ix.lru.peek(key).map(|s| s.value) == Some(generation) {
            ix.lru.remove(key);
        }
    }
}

/// Distinguishes temp files of concurrent writes of the same key in one process.
static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

fn is_fanout_name(name: &str) -> bool {
    name.len() == 2
        && name
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| KvStoreError::io("fsync directory", dir, e))
}

impl KvTier for NvmeTier {
    fn kind(&self) -> TierKind {
        TierKind::Nvme
    }

    fn get(&self, key: &BlobKey) -> Result<Option<Arc<[u8]>>> {
        self.get_many(std::slice::from_ref(key))
            .pop()
            .expect("one result per key")
    }

    fn get_many(&self, keys: &[BlobKey]) -> Vec<Result<Option<Arc<[u8]>>>> {
        let start = Instant::now();
        let mut out: Vec<Result<Option<Arc<[u8]>>>> = keys.iter().map(|_| Ok(None)).collect();
        let generations: Vec<Option<u64>> = {
            let mut ix = self.lock_index();
            keys.iter()
                .map(|k| ix.lru.touch(k).map(|s| s.value))
                .collect()
        };
        // Open every file first, then read them all in one batch.
        let mut reqs = Vec::new();
        let mut slots = Vec::new();
        for (i, (key, generation)) in keys.iter().zip(&generations).enumerate() {
            let Some(generation) = *generation else {
                continue;
            };
            let path = self.blob_path(key);
            match self.open_blob(&path) {
                Ok((file, len, direct)) => {
                    reqs.push(ReadReq::new(file, len, direct));
                    slots.push((i, path));
                }
                // Deleted behind the tier's back: a miss, and the entry goes.
                Err(e) if e.kind() == io::ErrorKind::NotFound => self.forget(key, generation),
                Err(e) => out[i] = Err(KvStoreError::io("open", path, e)),
            }
        }
        self.run_reads(&mut reqs);
        #[cfg(test)]
        if *self.refuse_direct.lock().unwrap() == Some(RefuseDirect::AtRead) {
            reqs.iter_mut().for_each(ReadReq::refuse_if_direct);
        }
        // Reads the file system refused under O_DIRECT are retried buffered, once.
        let refused: Vec<usize> = (0..reqs.len())
            .filter(|&j| reqs[j].direct_refused())
            .collect();
        if !refused.is_empty() {
            self.direct.store(false, Ordering::Relaxed);
            let mut retry = Vec::new();
            let mut retry_at = Vec::new();
            for &j in &refused {
                match self.open_blob(&slots[j].1) {
                    Ok((file, len, direct)) => {
                        retry.push(ReadReq::new(file, len, direct));
                        retry_at.push(j);
                    }
                    Err(e) => out[slots[j].0] = Err(KvStoreError::io("open", &slots[j].1, e)),
                }
            }
            self.run_reads(&mut retry);
            for (j, r) in retry_at.into_iter().zip(retry) {
                reqs[j] = r;
            }
        }
        for (r, (i, path)) in reqs.into_iter().zip(slots) {
            if out[i].is_err() {
                continue;
            }
            match r.finish() {
                Ok((bytes, done)) => {
                    self.counters
                        .hit(bytes.len(), done.saturating_duration_since(start));
                    out[i] = Ok(Some(bytes));
                }
                Err(e) => out[i] = Err(KvStoreError::io("read", path, e)),
            }
        }
        for r in &out {
            if matches!(r, Ok(None)) {
                self.counters.miss();
            }
        }
        out
    }

    fn put(&self, key: &BlobKey, bytes: &[u8]) -> Result<()> {
        let size = bytes.len() as u64;
        if size > self.budget {
            return Err(KvStoreError::Full {
                tier: TierKind::Nvme,
                needed: size,
                budget: self.budget,
            });
        }
        self.reserve(key, size)?;
        self.write_blob(key, bytes)
    }

    fn remove(&self, key: &BlobKey) -> Result<bool> {
        let _w = self.lock_writer();
        if self.lock_index().lru.remove(key).is_none() {
            return Ok(false);
        }
        let path = self.blob_path(key);
        match fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(true),
            Err(e) => Err(KvStoreError::io("remove", path, e)),
        }
    }

    fn contains(&self, key: &BlobKey) -> bool {
        self.lock_index().lru.contains(key)
    }

    fn used_bytes(&self) -> u64 {
        self.lock_index().lru.used()
    }

    fn budget_bytes(&self) -> u64 {
        self.budget
    }

    fn len(&self) -> usize {
        self.lock_index().lru.len()
    }

    fn metrics(&self) -> TierMetrics {
        self.counters.snapshot()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_free_space_reserve_evicts_first_then_refuses() {
        let dir = tempfile::tempdir().unwrap();
        let mut opts = NvmeOptions::new(1 << 20);
        opts.io = IoMode::Plain;
        opts.reserve_free_bytes = 300;
        let t = NvmeTier::open(dir.path(), opts).unwrap();
        // A 1000-byte disk: blobs of 200 leave 300 free up to 700 bytes stored.
        *t.fake_disk.lock().unwrap() = Some(1000);
        let keys: Vec<BlobKey> = (1..=4).map(|i| BlobKey([i; 16])).collect();
        for k in &keys[..3] {
            t.put(k, &[7; 200]).unwrap();
        }
        assert_eq!(t.used_bytes(), 600);
        // The fourth would leave 200 free: the oldest goes first.
        t.put(&keys[3], &[7; 200]).unwrap();
        assert!(!t.contains(&keys[0]) && t.contains(&keys[3]));
        assert_eq!(t.used_bytes(), 600);
        // Something else took the disk: even an empty tier cannot keep the reserve.
        t.remove(&keys[1]).unwrap();
        t.remove(&keys[2]).unwrap();
        *t.fake_disk.lock().unwrap() = Some(400);
        let e = t.put(&BlobKey([9; 16]), &[7; 200]).unwrap_err();
        assert!(matches!(e, KvStoreError::NoSpace { .. }), "{e}");
        assert_eq!(t.len(), 0, "everything evictable went first");
        // make_room frees the tier down to the reserve without a write.
        *t.fake_disk.lock().unwrap() = Some(1000);
        t.put(&keys[0], &[7; 200]).unwrap();
        t.put(&keys[1], &[7; 200]).unwrap();
        *t.fake_disk.lock().unwrap() = Some(600);
        assert_eq!(t.make_room(0).unwrap(), 200);
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn full_from_writes_in_flight_evicts_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let opts = NvmeOptions {
            budget_bytes: 1000,
            io: IoMode::Plain,
            direct: false,
            reserve_free_bytes: 0,
        };
        let t = NvmeTier::open(dir.path(), opts).unwrap();
        let a = BlobKey([1; 16]);
        t.put(&a, &[1; 300]).unwrap();
        // Another writer has reserved 800 bytes: a 300-byte blob cannot fit even if `a` goes.
        t.lock_index().reserved = 800;
        let e = t.put(&BlobKey([2; 16]), &[2; 300]).unwrap_err();
        assert!(matches!(e, KvStoreError::Full { needed: 300, .. }), "{e}");
        assert!(t.contains(&a));
        assert_eq!(t.metrics().evictions, 0);
        // 200 bytes fit once `a` is evicted.
        t.put(&BlobKey([3; 16]), &[3; 200]).unwrap();
        assert!(!t.contains(&a));
        assert_eq!(t.lock_index().reserved, 800);
        assert_eq!(t.used_bytes(), 200);
    }

    #[test]
    fn refused_o_direct_falls_back_to_buffered_reads() {
        for (refuse, io) in [
            (RefuseDirect::AtOpen, IoMode::Plain),
            (RefuseDirect::AtRead, IoMode::Plain),
            (RefuseDirect::AtRead, IoMode::Auto),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let t = NvmeTier::open(
                dir.path(),
                NvmeOptions {
                    budget_bytes: 1 << 20,
                    io,
                    direct: true,
                    reserve_free_bytes: 0,
                },
            )
            .unwrap();
            let keys = [BlobKey([1; 16]), BlobKey([2; 16])];
            for (i, k) in keys.iter().enumerate() {
                t.put(k, &vec![i as u8 + 1; 5000 + i]).unwrap();
            }
            assert!(t.direct_io());
            *t.refuse_direct.lock().unwrap() = Some(refuse);
            let got = t.get_many(&keys);
            for (i, r) in got.into_iter().enumerate() {
                assert_eq!(&r.unwrap().unwrap()[..], &vec![i as u8 + 1; 5000 + i][..]);
            }
            assert!(!t.direct_io(), "{refuse:?}: still claims O_DIRECT");
            assert_eq!(t.metrics().hits, 2);
        }
    }
}
