//! A consistent copy of a knowledge base's files, taken by its owner between two writes, for
//! backups: the catalog copied after a flush (sled rewrites its files in place), the blobs and
//! the committed index files hard-linked (every one of them is written once and renamed into
//! place, so a link keeps the version of the moment; a copy where linking is refused). The
//! indexes may be behind the catalog; a knowledge base opened on the copy catches them up
//! from the change log, as after a crash.

use std::fs;
use std::path::Path;

use crate::catalog::Catalog;
use crate::error::{KbError, Result};
use crate::kb::KnowledgeBase;

/// What a snapshot holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SnapshotStats {
    pub files: u64,
    pub bytes: u64,
    /// Bytes copied rather than linked (the catalog, mostly): what the snapshot took from the
    /// disk.
    pub copied_bytes: u64,
}

impl KnowledgeBase {
    /// Writes a consistent copy of the catalog, blobs and indexes under `to` (which must not
    /// exist): `catalog/`, `blobs/`, `collections/`. Needs free space for a copy of the
    /// catalog; the rest is links. Runs on the owner's thread, so no write happens meanwhile.
    pub fn snapshot(&mut self, to: &Path) -> Result<SnapshotStats> {
        copy_snapshot(&self.catalog, &self.dir, to)
    }

    /// [`snapshot`](Self::snapshot) of a data directory no process has open, without loading
    /// the models: the catalog is opened (so its lock keeps every other process out) and held
    /// while the files are copied.
    pub fn snapshot_closed(dir: &Path, to: &Path) -> Result<SnapshotStats> {
        let catalog = Catalog::open(&dir.join("catalog"))?;
        copy_snapshot(&catalog, dir, to)
    }
}

/// The snapshot of data directory `dir` into `to`, by whoever holds `dir`'s open `catalog`
/// (so nothing writes meanwhile): the catalog flushed and copied, blobs and indexes linked.
fn copy_snapshot(catalog: &Catalog, dir: &Path, to: &Path) -> Result<SnapshotStats> {
    if to.exists() {
        return Err(KbError::io(
            "snapshot into",
            to,
            std::io::Error::from(std::io::ErrorKind::AlreadyExists),
        ));
    }
    catalog.flush()?;
    let mut stats = SnapshotStats::default();
    copy_tree(&dir.join("catalog"), &to.join("catalog"), false, &mut stats)?;
    for sub in ["blobs", "collections"] {
        copy_tree(&dir.join(sub), &to.join(sub), true, &mut stats)?;
    }
    Ok(stats)
}

/// Whether a file is left out of snapshots: locks (held by the live process), temp files of
/// writes in flight.
pub fn skipped_in_snapshot(name: &str) -> bool {
    name == "LOCK"
        || name.ends_with(".lock")
        || name.ends_with(".tmp")
        || name.starts_with(".tmp")
        || name.contains(".tmp.")
}

/// Copies (or, with `link`, hard-links, copying where the file system refuses) every file
/// under `from` into `to`, creating folders. A missing `from` is an empty tree.
pub fn copy_tree(from: &Path, to: &Path, link: bool, stats: &mut SnapshotStats) -> Result<()> {
    let entries = match fs::read_dir(from) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(KbError::io("listing", from, e)),
    };
    fs::create_dir_all(to).map_err(|e| KbError::io("creating", to, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| KbError::io("listing", from, e))?;
        let name = entry.file_name();
        if skipped_in_snapshot(&name.to_string_lossy()) {
            continue;
        }
        let (src, dst) = (entry.path(), to.join(&name));
        let kind = entry
            .file_type()
            .map_err(|e| KbError::io("reading", &src, e))?;
        if kind.is_dir() {
            copy_tree(&src, &dst, link, stats)?;
            continue;
        }
        if !kind.is_file() {
            continue;
        }
        let linked = link && fs::hard_link(&src, &dst).is_ok();
        let bytes = if linked {
            fs::metadata(&dst).map_or(0, |m| m.len())
        } else {
            match fs::copy(&src, &dst) {
                Ok(n) => {
                    stats.copied_bytes += n;
                    n
                }
                // Removed meanwhile by another thread (an evicted cache file): not part of
                // the snapshot.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && link => continue,
                Err(e) => return Err(KbError::io("copying", &src, e)),
            }
        };
        stats.files += 1;
        stats.bytes += bytes;
    }
    Ok(())
}
