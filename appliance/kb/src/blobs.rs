//! The content-addressed store of original uploads: one file per distinct content, named by
//! its xxh3-128, written crash-safely, so an acknowledged document can always be re-parsed.
//!
//! Layout: `<dir>/<first 2 hex digits>/<32 hex digits>`; temporary files go to `<dir>/tmp/`
//! and are removed on open. A blob is written to a temporary file, fsynced, renamed into place
//! and its folder fsynced; a reader re-hashes what it reads and reports `Corrupted` on a
//! mismatch.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_128;

use crate::error::{KbError, Result};

/// The stable content address of some bytes: xxh3-128 (never `DefaultHasher`, whose output may
/// change between Rust releases).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContentHash(pub u128);

impl ContentHash {
    /// Hashes `bytes`.
    pub fn of(bytes: &[u8]) -> ContentHash {
        ContentHash(xxh3_128(bytes))
    }

    /// 32 lower-case hex digits.
    pub fn to_hex(self) -> String {
        format!("{:032x}", self.0)
    }

    /// Parses [`to_hex`](Self::to_hex)'s output.
    pub fn from_hex(s: &str) -> Option<ContentHash> {
        if s.len() != 32 {
            return None;
        }
        u128::from_str_radix(s, 16).ok().map(ContentHash)
    }

    /// Big-endian bytes, for catalog keys.
    pub fn to_bytes(self) -> [u8; 16] {
        self.0.to_be_bytes()
    }
}

/// The blob folder.
#[derive(Debug)]
pub struct BlobStore {
    dir: PathBuf,
}

impl BlobStore {
    /// Opens (creating) the folder and clears temporary files an interrupted write left.
    pub fn open(dir: &Path) -> Result<BlobStore> {
        let tmp = dir.join("tmp");
        fs::create_dir_all(&tmp).map_err(|e| KbError::io("creating", &tmp, e))?;
        for entry in fs::read_dir(&tmp).map_err(|e| KbError::io("listing", &tmp, e))? {
            let path = entry.map_err(|e| KbError::io("listing", &tmp, e))?.path();
            fs::remove_file(&path).map_err(|e| KbError::io("removing", &path, e))?;
        }
        Ok(BlobStore {
            dir: dir.to_owned(),
        })
    }

    fn path(&self, hash: ContentHash) -> PathBuf {
        let hex = hash.to_hex();
        self.dir.join(&hex[..2]).join(hex)
    }

    /// Whether the blob is stored.
    pub fn contains(&self, hash: ContentHash) -> bool {
        self.path(hash).is_file()
    }

    /// Stores `bytes` under their hash (a no-op when present) and returns the hash. Durable when
    /// it returns.
    pub fn put(&self, bytes: &[u8]) -> Result<ContentHash> {
        let hash = ContentHash::of(bytes);
        let path = self.path(hash);
        if path.is_file() {
            return Ok(hash);
        }
        let parent = path.parent().expect("blob paths have a folder");
        fs::create_dir_all(parent).map_err(|e| KbError::io("creating", parent, e))?;
        let tmp = self
            .dir
            .join("tmp")
            .join(format!("{}.{}", hash.to_hex(), std::process::id()));
        let write = || -> std::io::Result<()> {
            let mut f = File::create(&tmp)?;
            f.write_all(bytes)?;
            f.sync_all()
        };
        write().map_err(|e| KbError::io("writing blob", &tmp, e))?;
        fs::rename(&tmp, &path).map_err(|e| KbError::io("renaming blob to", &path, e))?;
        sync_dir(parent)?;
        Ok(hash)
    }

    /// The stored bytes, checked against their hash.
    pub fn get(&self, hash: ContentHash) -> Result<Vec<u8>> {
        let path = self.path(hash);
        let bytes = fs::read(&path).map_err(|e| KbError::io("reading blob", &path, e))?;
        let found = ContentHash::of(&bytes);
        if found != hash {
            return Err(KbError::corrupted(
                format!("blob {}", path.display()),
                format!("its content hashes to {}", found.to_hex()),
            ));
        }
        Ok(bytes)
    }

    /// Removes the blob (a no-op when absent).
    pub fn remove(&self, hash: ContentHash) -> Result<()> {
        let path = self.path(hash);
        match fs::remove_file(&path) {
            Ok(()) => sync_dir(path.parent().expect("blob paths have a folder")),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(KbError::io("removing blob", &path, e)),
        }
    }

    /// Every stored blob.
    pub fn list(&self) -> Result<Vec<ContentHash>> {
        let mut out = Vec::new();
        let read = |p: &Path| fs::read_dir(p).map_err(|e| KbError::io("listing", p, e));
        for shard in read(&self.dir)? {
            let shard = shard
                .map_err(|e| KbError::io("listing", &self.dir, e))?
                .path();
            if !shard.is_dir() || shard.file_name().is_some_and(|n| n == "tmp") {
                continue;
            }
            for entry in read(&shard)? {
                let entry = entry.map_err(|e| KbError::io("listing", &shard, e))?;
                if let Some(h) = entry.file_name().to_str().and_then(ContentHash::from_hex) {
                    out.push(h);
                }
            }
        }
        Ok(out)
    }
}

/// fsyncs a folder so a rename or removal in it is durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| KbError::io("syncing folder", dir, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("engram-kb-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn put_get_remove() {
        let dir = temp("blobs");
        let store = BlobStore::open(&dir).unwrap();
        let h = store.put(b"hello").unwrap();
        assert_eq!(ContentHash::from_hex(&h.to_hex()), Some(h));
        assert_eq!(store.put(b"hello").unwrap(), h);
        assert_eq!(store.get(h).unwrap(), b"hello");
        assert_eq!(store.list().unwrap(), [h]);
        // A blob altered on disk is reported, not returned.
        fs::write(store.path(h), b"hellO").unwrap();
        assert!(matches!(store.get(h), Err(KbError::Corrupted { .. })));
        store.remove(h).unwrap();
        store.remove(h).unwrap();
        assert!(!store.contains(h));
        assert!(store.list().unwrap().is_empty());
        // Leftover temporary files go on open.
        fs::write(dir.join("tmp").join("x.1"), b"torn").unwrap();
        BlobStore::open(&dir).unwrap();
        assert_eq!(fs::read_dir(dir.join("tmp")).unwrap().count(), 0);
        fs::remove_dir_all(&dir).unwrap();
    }
}
