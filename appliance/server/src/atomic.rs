//! Crash-safe small files: temp file, fsync, rename, fsync the directory (STYLE.md section 5),
//! and an exclusive lock around a file's read-modify-write, so that the daemon and the
//! `engramd keys|users` commands never lose each other's changes.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Result, ServerError};

/// Replaces `path` with `bytes` so that a crash leaves either the old or the new content.
/// The file is created with mode 0600: the console's files hold password hashes.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| ServerError::io("creating", dir, e))?;
    let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(".tmp");
    let tmp = dir.join(tmp_name);
    let io = |op, e| ServerError::io(op, &tmp, e);
    let mut file = {
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create(true).truncate(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
        o.open(&tmp).map_err(|e| io("creating", e))?
    };
    file.write_all(bytes).map_err(|e| io("writing", e))?;
    file.sync_all().map_err(|e| io("syncing", e))?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(|e| ServerError::io("renaming", path, e))?;
    sync_dir(dir)
}

/// Makes the renames and removals in `dir` durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| ServerError::io("syncing", dir, e))
}

/// Runs `f` (a read-modify-write of `path`) holding an exclusive advisory lock on
/// `<path>.lock`: one writer at a time across threads and processes. Readers need no lock, since
/// [`write_atomic`] replaces the file in one rename.
pub(crate) fn locked_update<T, E: From<ServerError>>(
    path: &Path,
    f: impl FnOnce() -> std::result::Result<T, E>,
) -> std::result::Result<T, E> {
    let lock_path = lock_path(path);
    if let Some(dir) = lock_path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| ServerError::io("creating", dir, e))?;
    }
    let file = {
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create(true).truncate(false);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
        o.open(&lock_path)
            .map_err(|e| ServerError::io("opening", &lock_path, e))?
    };
    file.lock()
        .map_err(|e| ServerError::io("locking", &lock_path, e))?;
    let out = f();
    // Closing the file releases the lock too; unlocking first makes the order explicit.
    let _ = file.unlock();
    out
}

fn lock_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".lock");
    path.with_file_name(name)
}

#[cfg(test)]
mod tests {
    #[test]
    fn concurrent_updates_lose_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("n.json");
        super::write_atomic(&p, b"0").unwrap();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..25 {
                        super::locked_update(&p, || {
                            let n: u32 = std::fs::read_to_string(&p).unwrap().parse().unwrap();
                            super::write_atomic(&p, (n + 1).to_string().as_bytes())
                        })
                        .unwrap();
                    }
                });
            }
        });
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "100");
    }

    #[test]
    fn replaces_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.json");
        super::write_atomic(&p, b"1").unwrap();
        super::write_atomic(&p, b"22").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"22");
        assert!(!dir.path().join("a.json.tmp").exists());
    }
}
