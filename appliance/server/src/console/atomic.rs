//! Crash-safe small files: temp file, fsync, rename, fsync the directory (STYLE.md section 5).

use std::io::Write;
use std::path::Path;

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
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| ServerError::io("syncing", dir, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
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
