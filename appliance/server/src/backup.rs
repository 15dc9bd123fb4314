//! Backups of a data directory, and restoring one into an empty directory. Format:
//! `docs/formats/backup.md`.
//!
//! A backup is taken while the daemon serves: the knowledge base's owner thread copies the
//! catalog after a flush and hard-links the blobs and committed index files between two of its
//! writes ([`KnowledgeBase::snapshot`]), the daemon's own files (keys, console accounts,
//! settings, audit log) are copied, and optionally the chunk KV tier's blobs are linked; all
//! of it into a staging folder under the data directory (`.backup/`). The archive is then
//! written from that folder off every serving thread: a tar stream, zstd-compressed, the
//! files under `data/`, then `MANIFEST.json` (format, version, what made it, every file's
//! size and SHA-256) and `MANIFEST.sha256`. A restore checks every byte against the manifest
//! before anything lands in the target directory.

use std::fs;
use std::io::{self, Read, Write};
use std::path::{Component, Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use engram_kb::{copy_tree, KnowledgeBase, SnapshotStats};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Result, ServerError};

/// The `format` field of every manifest.
pub const FORMAT: &str = "engram-backup";
/// Layout version of the archive; a restore refuses a newer one.
pub const FORMAT_VERSION: u32 = 1;
/// Staging folders of backups in flight, under the data directory (removed at start-up).
pub const STAGING_DIR: &str = ".backup";
/// Where a restore unpacks before it moves the verified files into place.
pub const RESTORE_DIR: &str = ".restore-partial";
/// A restore staged through the API or the console: the verified tree in `data/` and, once
/// complete, the `READY` marker; swapped in at the next start ([`apply_staged_restore`]).
pub const STAGED_RESTORE_DIR: &str = ".restore-staged";
/// Where a staged restore moves the data it replaces, deleted once the swap is done.
const REPLACED_DIR: &str = ".restore-replaced";
const READY: &str = "READY";
const MOVED_OUT: &str = "MOVED";
const MANIFEST: &str = "MANIFEST.json";
const MANIFEST_SUM: &str = "MANIFEST.sha256";
const DATA: &str = "data/";
/// The daemon's own files at the top of the data directory that a backup carries.
const SERVER_FILES: [&str; 6] = [
    crate::auth::KEY_FILE,
    crate::auth::KEY_USE_FILE,
    crate::versions::HISTORY_FILE,
    crate::console::users::USER_FILE,
    crate::console::settings::SETTINGS_FILE,
    crate::console::audit::AUDIT_FILE,
];
/// zstd level: fast, and most of the bytes (index segments, PDFs) are compressed already.
const ZSTD_LEVEL: i32 = 3;

/// What an archive holds.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    /// The version of Engram that wrote it.
    pub engram_version: String,
    pub created_unix_s: u64,
    /// The knowledge-base catalog's schema version inside.
    pub catalog_schema: u32,
    /// Whether the chunk KV tier's blobs are inside (they can be recomputed).
    pub kv: bool,
    pub files: Vec<FileEntry>,
}

/// One file of an archive, by its path under the data directory.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileEntry {
    pub path: String,
    pub bytes: u64,
    pub sha256: String,
}

impl Manifest {
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.bytes).sum()
    }
}

/// A staging folder, removed with everything in it when dropped.
#[derive(Debug)]
pub struct Staged {
    dir: PathBuf,
}

impl Staged {
    /// A new, empty staging folder under `data_dir/.backup/`.
    pub fn new(data_dir: &Path) -> Result<Staged> {
        let parent = data_dir.join(STAGING_DIR);
        fs::create_dir_all(&parent).map_err(|e| ServerError::io("creating", &parent, e))?;
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let dir = parent.join(format!("{nanos}-{}", std::process::id()));
        Ok(Staged { dir })
    }

    /// Where the data directory's copy goes (`<staging>/data`, created by the first stage).
    pub fn data(&self) -> PathBuf {
        self.dir.join("data")
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
        // The parent too once no other backup is in flight (fails while one is).
        if let Some(parent) = self.dir.parent() {
            let _ = fs::remove_dir(parent);
        }
    }
}

/// Removes what interrupted backups left under `data_dir` (their links pin deleted files).
pub fn remove_stale(data_dir: &Path) {
    let _ = fs::remove_dir_all(data_dir.join(STAGING_DIR));
}

/// Copies the daemon's own files (API keys, console accounts, settings, the audit log) into
/// the staged data folder. Each is replaced by rename or only appended to, so a copy is a
/// whole version of it.
pub fn stage_server_files(data_dir: &Path, staged: &Staged) -> Result<()> {
    let to = staged.data();
    fs::create_dir_all(&to).map_err(|e| ServerError::io("creating", &to, e))?;
    for name in SERVER_FILES {
        let from = data_dir.join(name);
        match fs::copy(&from, to.join(name)) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(ServerError::io("copying", &from, e)),
        }
    }
    Ok(())
}

/// Links the chunk KV tier's blobs (each written once and renamed into place; one evicted
/// meanwhile is left out) into the staged data folder as `kv/`.
pub fn stage_kv(kv_dir: &Path, staged: &Staged) -> Result<SnapshotStats> {
    let mut stats = SnapshotStats::default();
    copy_tree(kv_dir, &staged.data().join("kv"), true, &mut stats)?;
    Ok(stats)
}

/// Takes the whole snapshot of a data directory no process has open: the catalog's lock is
/// held while it is copied, so no daemon or CLI writes meanwhile (one that is running makes
/// this fail with the catalog's lock error).
pub fn stage_closed(data_dir: &Path, kv_dir: Option<&Path>, staged: &Staged) -> Result<()> {
    KnowledgeBase::snapshot_closed(data_dir, &staged.data())?;
    stage_server_files(data_dir, staged)?;
    if let Some(kv) = kv_dir {
        stage_kv(kv, staged)?;
    }
    Ok(())
}

/// Writes the staged folder as an archive to `out`: zstd-compressed tar, the files under
/// `data/` in path order, then the manifest and its checksum. Returns the manifest.
pub fn write_archive(staged: &Staged, kv: bool, out: impl Write) -> Result<Manifest> {
    let root = staged.data();
    let mut paths = Vec::new();
    list_files(&root, &root, &mut paths)?;
    paths.sort();
    let enc = zstd::Encoder::new(out, ZSTD_LEVEL)
        .map_err(|e| ServerError::io("compressing", &root, e))?;
    let mut tar = tar::Builder::new(enc);
    tar.mode(tar::HeaderMode::Deterministic);
    let mut files = Vec::with_capacity(paths.len());
    for rel in paths {
        let path = root.join(&rel);
        let file = fs::File::open(&path).map_err(|e| ServerError::io("opening", &path, e))?;
        let bytes = file
            .metadata()
            .map_err(|e| ServerError::io("reading", &path, e))?
            .len();
        let mut header = tar::Header::new_gnu();
        header.set_size(bytes);
        header.set_mode(0o600);
        header.set_entry_type(tar::EntryType::Regular);
        let mut reader = Hashing::new(file.take(bytes));
        tar.append_data(&mut header, format!("{DATA}{rel}"), &mut reader)
            .map_err(|e| ServerError::io("archiving", &path, e))?;
        if reader.count != bytes {
            return Err(ServerError::Backup {
                reason: format!(
                    "{} changed while it was archived ({} of {bytes} bytes)",
                    path.display(),
                    reader.count
                ),
            });
        }
        files.push(FileEntry {
            path: rel,
            bytes,
            sha256: reader.hex(),
        });
    }
    let manifest = Manifest {
        format: FORMAT.into(),
        version: FORMAT_VERSION,
        engram_version: crate::versions::version().into(),
        created_unix_s: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        catalog_schema: engram_kb::SCHEMA_VERSION,
        kv,
        files,
    };
    let json = serde_json::to_vec_pretty(&manifest).expect("a manifest serializes");
    let sum = format!("{}  {MANIFEST}\n", hex(&Sha256::digest(&json)));
    for (name, body) in [(MANIFEST, &json[..]), (MANIFEST_SUM, sum.as_bytes())] {
        let mut header = tar::Header::new_gnu();
        header.set_size(body.len() as u64);
        header.set_mode(0o600);
        header.set_entry_type(tar::EntryType::Regular);
        tar.append_data(&mut header, name, body)
            .map_err(|e| ServerError::io("archiving", name, e))?;
    }
    let enc = tar
        .into_inner()
        .map_err(|e| ServerError::io("archiving", &root, e))?;
    let mut out = enc
        .finish()
        .map_err(|e| ServerError::io("compressing", &root, e))?;
    out.flush()
        .map_err(|e| ServerError::io("writing", "the archive", e))?;
    Ok(manifest)
}

/// Every regular file under `dir`, as `/`-separated paths relative to `root`.
fn list_files(root: &Path, dir: &Path, out: &mut Vec<String>) -> Result<()> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(ServerError::io("listing", dir, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| ServerError::io("listing", dir, e))?;
        let path = entry.path();
        let kind = entry
            .file_type()
            .map_err(|e| ServerError::io("reading", &path, e))?;
        if kind.is_dir() {
            list_files(root, &path, out)?;
        } else if kind.is_file() {
            let rel = path.strip_prefix(root).expect("under the root");
            let parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            out.push(parts.join("/"));
        }
    }
    Ok(())
}

/// Why a restore was refused.
fn refuse(reason: impl Into<String>) -> ServerError {
    ServerError::Restore {
        reason: reason.into(),
    }
}

/// Restores an archive into `data_dir`, which must be missing or empty. Every file is
/// unpacked into `data_dir/.restore-partial/` and checked against the manifest (its own
/// checksum, the format and version, each file's size and SHA-256, nothing missing and
/// nothing extra); only then are they moved into place. On any error nothing is left in
/// `data_dir` but the partial folder's removal. Returns the manifest.
pub fn restore(archive: impl Read, data_dir: &Path) -> Result<Manifest> {
    fs::create_dir_all(data_dir).map_err(|e| ServerError::io("creating", data_dir, e))?;
    let partial = data_dir.join(RESTORE_DIR);
    let _ = fs::remove_dir_all(&partial);
    let occupied: Vec<String> = fs::read_dir(data_dir)
        .map_err(|e| ServerError::io("listing", data_dir, e))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    if !occupied.is_empty() {
        return Err(refuse(format!(
            "{} is not empty ({}): restore goes into a new or empty data directory",
            data_dir.display(),
            occupied.join(", ")
        )));
    }
    let result = unpack_and_check(archive, Some(&partial));
    let manifest = match result {
        Ok(m) => m,
        Err(e) => {
            let _ = fs::remove_dir_all(&partial);
            return Err(e);
        }
    };
    let moved = (|| -> Result<()> {
        for entry in fs::read_dir(&partial).map_err(|e| ServerError::io("listing", &partial, e))? {
            let entry = entry.map_err(|e| ServerError::io("listing", &partial, e))?;
            let to = data_dir.join(entry.file_name());
            fs::rename(entry.path(), &to).map_err(|e| ServerError::io("moving into", &to, e))?;
        }
        fs::remove_dir(&partial).map_err(|e| ServerError::io("removing", &partial, e))?;
        fs::File::open(data_dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| ServerError::io("syncing", data_dir, e))
    })();
    moved?;
    Ok(manifest)
}

/// Unpacks and checks an archive as [`restore`] does, but beside the data a daemon is serving:
/// into `<data_dir>/.restore-staged/data`, marked `READY` only once every file verified. The
/// next start swaps it in ([`apply_staged_restore`]). A restore staged earlier is replaced; on
/// any error nothing stays staged.
pub fn stage_restore(archive: impl Read, data_dir: &Path) -> Result<Manifest> {
    let stage = data_dir.join(STAGED_RESTORE_DIR);
    remove_dir_if_present(&stage)?;
    let staged = (|| {
        fs::create_dir_all(&stage).map_err(|e| ServerError::io("creating", &stage, e))?;
        let manifest = restore(archive, &stage.join("data"))?;
        let summary = serde_json::to_vec(&serde_json::json!({
            "engram_version": manifest.engram_version,
            "created_unix_s": manifest.created_unix_s,
            "files": manifest.files.len(),
            "bytes": manifest.total_bytes(),
        }))
        .map_err(|e| refuse(e.to_string()))?;
        crate::atomic::write_atomic(&stage.join(READY), &summary)?;
        Ok(manifest)
    })();
    if staged.is_err() {
        let _ = fs::remove_dir_all(&stage);
    }
    staged
}

/// Removes a folder and everything in it; one already gone is fine.
fn remove_dir_if_present(dir: &Path) -> Result<()> {
    match fs::remove_dir_all(dir) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(ServerError::io("removing", dir, e)),
        _ => Ok(()),
    }
}

/// Whether a verified restore waits for the next start.
pub fn restore_staged(data_dir: &Path) -> bool {
    data_dir.join(STAGED_RESTORE_DIR).join(READY).exists()
}

/// At start-up, before anything opens the data: swaps in a restore [`stage_restore`] left
/// `READY`. Every entry of the data directory moves to `.restore-replaced/`, then every
/// staged entry moves up, and only then is the marker removed and the replaced data deleted.
/// Each step is a rename, and a crash between them is finished by the next start (the
/// `MOVED` marker says the first step is complete). An unfinished staging is removed. Returns
/// the backup's Engram version when a restore was applied.
pub fn apply_staged_restore(data_dir: &Path) -> Result<Option<String>> {
    let stage = data_dir.join(STAGED_RESTORE_DIR);
    let replaced = data_dir.join(REPLACED_DIR);
    let ready = stage.join(READY);
    if !ready.exists() {
        // Nothing staged, an upload cut off, or a swap finished but not yet tidied.
        remove_dir_if_present(&stage)?;
        remove_dir_if_present(&replaced)?;
        return Ok(None);
    }
    let summary: serde_json::Value = fs::read(&ready)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let moved_out = stage.join(MOVED_OUT);
    let rename = |from: &Path, to: &Path| {
        fs::rename(from, to).map_err(|e| ServerError::io("moving into", to, e))
    };
    if !moved_out.exists() {
        fs::create_dir_all(&replaced).map_err(|e| ServerError::io("creating", &replaced, e))?;
        for entry in fs::read_dir(data_dir).map_err(|e| ServerError::io("listing", data_dir, e))? {
            let entry = entry.map_err(|e| ServerError::io("listing", data_dir, e))?;
            let name = entry.file_name();
            if name == STAGED_RESTORE_DIR || name == REPLACED_DIR {
                continue;
            }
            rename(&entry.path(), &replaced.join(&name))?;
        }
        crate::atomic::sync_dir(&replaced)?;
        crate::atomic::sync_dir(data_dir)?;
        crate::atomic::write_atomic(&moved_out, b"")?;
    }
    let data = stage.join("data");
    for entry in fs::read_dir(&data).map_err(|e| ServerError::io("listing", &data, e))? {
        let entry = entry.map_err(|e| ServerError::io("listing", &data, e))?;
        rename(&entry.path(), &data_dir.join(entry.file_name()))?;
    }
    crate::atomic::sync_dir(data_dir)?;
    fs::remove_file(&ready).map_err(|e| ServerError::io("removing", &ready, e))?;
    crate::atomic::sync_dir(&stage)?;
    remove_dir_if_present(&stage)?;
    remove_dir_if_present(&replaced)?;
    Ok(Some(
        summary["engram_version"]
            .as_str()
            .unwrap_or("unknown")
            .to_owned(),
    ))
}

/// Reads a request body that an async task hands over piece by piece (a restore's upload)
/// as a blocking reader.
pub struct ChannelReader {
    rx: tokio::sync::mpsc::Receiver<io::Result<axum::body::Bytes>>,
    piece: axum::body::Bytes,
}

impl ChannelReader {
    pub fn new(rx: tokio::sync::mpsc::Receiver<io::Result<axum::body::Bytes>>) -> Self {
        ChannelReader {
            rx,
            piece: axum::body::Bytes::new(),
        }
    }
}

impl Read for ChannelReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        while self.piece.is_empty() {
            match self.rx.blocking_recv() {
                Some(Ok(p)) => self.piece = p,
                Some(Err(e)) => return Err(e),
                None => return Ok(0),
            }
        }
        let n = out.len().min(self.piece.len());
        out[..n].copy_from_slice(&self.piece[..n]);
        self.piece = self.piece.slice(n..);
        Ok(n)
    }
}

/// Reads a whole archive and checks it against its manifest as [`restore`] does, writing
/// nothing. Returns the manifest.
pub fn verify(archive: impl Read) -> Result<Manifest> {
    unpack_and_check(archive, None)
}

/// Writes a backup to `to` crash-safely (a `.partial` file beside it, fsynced, renamed over
/// `to`) from `write`, then reads it back through [`verify`].
pub fn write_file(to: &Path, write: impl FnOnce(&mut fs::File) -> Result<()>) -> Result<Manifest> {
    let mut partial = to.as_os_str().to_owned();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    let done = (|| -> Result<Manifest> {
        let mut f =
            fs::File::create(&partial).map_err(|e| ServerError::io("creating", &partial, e))?;
        write(&mut f)?;
        f.sync_all()
            .map_err(|e| ServerError::io("syncing", &partial, e))?;
        drop(f);
        let f = fs::File::open(&partial).map_err(|e| ServerError::io("opening", &partial, e))?;
        let m = verify(io::BufReader::new(f)).map_err(|e| ServerError::Backup {
            reason: format!("the archive written does not read back: {e}"),
        })?;
        fs::rename(&partial, to).map_err(|e| ServerError::io("renaming to", to, e))?;
        if let Some(dir) = to.parent().filter(|d| !d.as_os_str().is_empty()) {
            let _ = fs::File::open(dir).and_then(|d| d.sync_all());
        }
        Ok(m)
    })();
    if done.is_err() {
        let _ = fs::remove_file(&partial);
    }
    done
}

fn unpack_and_check(archive: impl Read, partial: Option<&Path>) -> Result<Manifest> {
    let dec = zstd::Decoder::new(archive).map_err(|e| refuse(format!("not zstd: {e}")))?;
    let mut tar = tar::Archive::new(dec);
    let mut seen: Vec<FileEntry> = Vec::new();
    let mut manifest_json: Option<Vec<u8>> = None;
    let mut manifest_sum: Option<String> = None;
    // Folders written into, fsynced once every file is in (so the moved tree is durable).
    let mut dirs = std::collections::BTreeSet::new();
    let entries = tar
        .entries()
        .map_err(|e| refuse(format!("not a backup archive: {e}")))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| refuse(format!("damaged archive: {e}")))?;
        if entry.header().entry_type() != tar::EntryType::Regular {
            return Err(refuse("the archive holds something other than plain files"));
        }
        let name = entry
            .path()
            .map_err(|e| refuse(format!("damaged archive: {e}")))?
            .to_string_lossy()
            .into_owned();
        match name.as_str() {
            MANIFEST | MANIFEST_SUM => {
                let mut body = Vec::new();
                entry
                    .read_to_end(&mut body)
                    .map_err(|e| refuse(format!("damaged archive: {e}")))?;
                if name == MANIFEST {
                    manifest_json = Some(body);
                } else {
                    manifest_sum = Some(String::from_utf8_lossy(&body).into_owned());
                }
                continue;
            }
            _ => {}
        }
        let Some(rel) = name.strip_prefix(DATA).filter(|r| safe_relative(r)) else {
            return Err(refuse(format!("unexpected entry `{name}` in the archive")));
        };
        let mut reader = Hashing::new(&mut entry);
        if let Some(partial) = partial {
            let to = partial.join(rel);
            if let Some(parent) = to.parent() {
                fs::create_dir_all(parent).map_err(|e| ServerError::io("creating", parent, e))?;
                let mut d = parent;
                while d.starts_with(partial) && dirs.insert(d.to_owned()) {
                    match d.parent() {
                        Some(up) => d = up,
                        None => break,
                    }
                }
            }
            let mut file =
                fs::File::create(&to).map_err(|e| ServerError::io("creating", &to, e))?;
            io::copy(&mut reader, &mut file).map_err(|e| match e.kind() {
                io::ErrorKind::StorageFull | io::ErrorKind::PermissionDenied => {
                    ServerError::io("writing", &to, e)
                }
                _ => refuse(format!("damaged archive at `{name}`: {e}")),
            })?;
            file.sync_all()
                .map_err(|e| ServerError::io("syncing", &to, e))?;
        } else {
            io::copy(&mut reader, &mut io::sink())
                .map_err(|e| refuse(format!("damaged archive at `{name}`: {e}")))?;
        }
        seen.push(FileEntry {
            path: rel.to_owned(),
            bytes: reader.count,
            sha256: reader.hex(),
        });
    }
    for d in &dirs {
        fs::File::open(d)
            .and_then(|f| f.sync_all())
            .map_err(|e| ServerError::io("syncing", d, e))?;
    }
    let json = manifest_json.ok_or_else(|| refuse("the archive has no MANIFEST.json"))?;
    let sum = manifest_sum.ok_or_else(|| refuse("the archive has no MANIFEST.sha256"))?;
    if sum.split_whitespace().next() != Some(hex(&Sha256::digest(&json)).as_str()) {
        return Err(refuse("MANIFEST.json does not match MANIFEST.sha256"));
    }
    let manifest: Manifest = serde_json::from_slice(&json)
        .map_err(|e| refuse(format!("MANIFEST.json does not parse: {e}")))?;
    if manifest.format != FORMAT {
        return Err(refuse(format!(
            "not an Engram backup (format `{}`)",
            manifest.format
        )));
    }
    if manifest.version > FORMAT_VERSION {
        return Err(refuse(format!(
            "made by Engram {} in backup format version {}; this build reads version {} and \
             older: restore with that version or newer",
            manifest.engram_version, manifest.version, FORMAT_VERSION
        )));
    }
    if manifest.catalog_schema > engram_kb::SCHEMA_VERSION {
        return Err(refuse(format!(
            "its catalog has schema version {}; this build reads {}",
            manifest.catalog_schema,
            engram_kb::SCHEMA_VERSION
        )));
    }
    let mut want = manifest.files.clone();
    want.sort_by(|a, b| a.path.cmp(&b.path));
    seen.sort_by(|a, b| a.path.cmp(&b.path));
    if want != seen {
        let bad = want
            .iter()
            .find(|w| !seen.contains(w))
            .map(|w| w.path.clone())
            .or_else(|| {
                seen.iter()
                    .find(|s| !want.contains(s))
                    .map(|s| s.path.clone())
            })
            .unwrap_or_default();
        return Err(refuse(format!(
            "checksum mismatch: `{bad}` differs from the manifest (the archive is damaged)"
        )));
    }
    Ok(manifest)
}

/// A relative path of plain names: no root, no `..`, nothing empty.
fn safe_relative(rel: &str) -> bool {
    !rel.is_empty()
        && Path::new(rel)
            .components()
            .all(|c| matches!(c, Component::Normal(_)))
}

/// A reader that counts and hashes what passes through.
struct Hashing<R> {
    inner: R,
    hash: Sha256,
    count: u64,
}

impl<R: Read> Hashing<R> {
    fn new(inner: R) -> Self {
        Hashing {
            inner,
            hash: Sha256::new(),
            count: 0,
        }
    }

    fn hex(&self) -> String {
        hex(&self.hash.clone().finalize())
    }
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// A `Write` that hands its bytes to an async body in pieces: the archive is written on a
/// blocking thread while the response streams it.
pub struct ChannelWriter {
    tx: tokio::sync::mpsc::Sender<io::Result<axum::body::Bytes>>,
    buf: Vec<u8>,
}

/// Bytes per piece sent to the response.
const PIECE: usize = 256 << 10;

impl ChannelWriter {
    pub fn new(tx: tokio::sync::mpsc::Sender<io::Result<axum::body::Bytes>>) -> Self {
        ChannelWriter {
            tx,
            buf: Vec::with_capacity(PIECE),
        }
    }

    fn send(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let piece =
            axum::body::Bytes::from(std::mem::replace(&mut self.buf, Vec::with_capacity(PIECE)));
        self.tx
            .blocking_send(Ok(piece))
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the client went away"))
    }

    /// Ends the stream with an error the client sees as a cut-off body.
    pub fn fail(self, e: io::Error) {
        let _ = self.tx.blocking_send(Err(e));
    }
}

impl Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= PIECE {
            self.send()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send()
    }
}

/// Asks the daemon listening on `addr` for a backup (`POST /api/v1/admin/backup`) with an
/// admin `key`, copying the archive into `out`: what `engramd backup` does while the daemon
/// holds the data directory. Plain HTTP/1.1 on loopback; the archive's own checksums catch
/// anything damaged on the way ([`write_file`] reads it back).
pub fn fetch_from_daemon(
    addr: std::net::SocketAddr,
    key: &str,
    kv: bool,
    out: &mut impl Write,
) -> Result<()> {
    use std::io::BufRead;
    let mut addr = addr;
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr {
            std::net::SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    let io_err = |e: io::Error| ServerError::io("asking the daemon at", addr.to_string(), e);
    let mut stream = std::net::TcpStream::connect(addr).map_err(io_err)?;
    write!(
        stream,
        "POST /api/v1/admin/backup?kv={kv} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer \
         {key}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .map_err(io_err)?;
    let mut r = io::BufReader::new(stream);
    let mut line = String::new();
    r.read_line(&mut line).map_err(io_err)?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let mut chunked = false;
    loop {
        line.clear();
        r.read_line(&mut line).map_err(io_err)?;
        let h = line.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("transfer-encoding")
                && v.trim().eq_ignore_ascii_case("chunked")
            {
                chunked = true;
            }
        }
    }
    let mut body: Box<dyn Read + '_> = if chunked {
        Box::new(Chunked {
            inner: &mut r,
            left: 0,
            done: false,
        })
    } else {
        Box::new(&mut r)
    };
    if status != 200 {
        let mut text = String::new();
        let _ = body.take(64 << 10).read_to_string(&mut text);
        return Err(ServerError::Backup {
            reason: format!("the daemon answered {status}: {}", text.trim()),
        });
    }
    io::copy(&mut body, out).map_err(io_err)?;
    Ok(())
}

/// An HTTP/1.1 chunked body.
struct Chunked<'a, R> {
    inner: &'a mut R,
    left: u64,
    done: bool,
}

impl<R: io::BufRead> Read for Chunked<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.done || buf.is_empty() {
            return Ok(0);
        }
        if self.left == 0 {
            let mut line = String::new();
            self.inner.read_line(&mut line)?;
            if line.trim().is_empty() {
                // The CRLF after the previous chunk.
                line.clear();
                self.inner.read_line(&mut line)?;
            }
            let size = line.trim().split(';').next().unwrap_or("");
            self.left = u64::from_str_radix(size, 16).map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a bad chunk size in the response",
                )
            })?;
            if self.left == 0 {
                self.done = true;
                return Ok(0);
            }
        }
        let want = buf.len().min(self.left as usize);
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        self.left -= n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A staged data folder with a few files, written as an archive.
    fn archive(files: &[(&str, &[u8])]) -> (tempfile::TempDir, Vec<u8>, Manifest) {
        let data = tempfile::tempdir().unwrap();
        let staged = Staged::new(data.path()).unwrap();
        for (path, body) in files {
            let p = staged.data().join(path);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, body).unwrap();
        }
        let mut out = Vec::new();
        let m = write_archive(&staged, false, &mut out).unwrap();
        (data, out, m)
    }

    const FILES: [(&str, &[u8]); 3] = [
        ("keys.json", b"{\"version\":1,\"keys\":[]}"),
        ("catalog/db", b"catalog bytes"),
        ("collections/1/bm25/meta.json", b"{}"),
    ];

    /// The archive's entries, decompressed: (name, body).
    fn entries(archive: &[u8]) -> Vec<(String, Vec<u8>)> {
        let mut tar = tar::Archive::new(zstd::Decoder::new(archive).unwrap());
        tar.entries()
            .unwrap()
            .map(|e| {
                let mut e = e.unwrap();
                let name = e.path().unwrap().to_string_lossy().into_owned();
                let mut body = Vec::new();
                e.read_to_end(&mut body).unwrap();
                (name, body)
            })
            .collect()
    }

    /// An archive of `entries` as they are (no manifest computed).
    fn rebuild(entries: &[(String, Vec<u8>)]) -> Vec<u8> {
        let mut tar = tar::Builder::new(zstd::Encoder::new(Vec::new(), 1).unwrap());
        for (name, body) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_size(body.len() as u64);
            h.set_mode(0o600);
            h.set_entry_type(tar::EntryType::Regular);
            // The name as it is, `..` included (the crate's setters refuse those).
            h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
            h.set_cksum();
            tar.append(&h, &body[..]).unwrap();
        }
        tar.into_inner().unwrap().finish().unwrap()
    }

    #[test]
    fn an_archive_restores_byte_for_byte_and_the_staging_goes() {
        let (data, bytes, m) = archive(&FILES);
        assert_eq!(m.files.len(), 3);
        assert_eq!(m.files[0].path, "catalog/db");
        assert!(!data.path().join(STAGING_DIR).exists());
        let target = tempfile::tempdir().unwrap();
        let got = restore(&bytes[..], target.path()).unwrap();
        assert_eq!(got, m);
        for (path, body) in FILES {
            assert_eq!(fs::read(target.path().join(path)).unwrap(), body, "{path}");
        }
        assert!(!target.path().join(RESTORE_DIR).exists());
        assert_eq!(verify(&bytes[..]).unwrap(), m);
    }

    /// A data directory a daemon would be serving, different from the archive's.
    fn serving_dir() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        fs::write(d.path().join("keys.json"), b"the new keys").unwrap();
        fs::create_dir_all(d.path().join("catalog")).unwrap();
        fs::write(d.path().join("catalog/db"), b"the new catalog").unwrap();
        fs::write(d.path().join("users.json"), b"added after the backup").unwrap();
        d
    }

    fn assert_restored(d: &Path) {
        for (path, body) in FILES {
            assert_eq!(fs::read(d.join(path)).unwrap(), body, "{path}");
        }
        assert!(
            !d.join("users.json").exists(),
            "a file the backup lacks stays"
        );
        assert!(!d.join(STAGED_RESTORE_DIR).exists());
        assert!(!d.join(REPLACED_DIR).exists());
    }

    #[test]
    fn a_staged_restore_is_swapped_in_at_the_next_start() {
        let (_d, bytes, m) = archive(&FILES);
        let d = serving_dir();
        assert_eq!(
            apply_staged_restore(d.path()).unwrap(),
            None,
            "nothing staged"
        );
        assert_eq!(stage_restore(&bytes[..], d.path()).unwrap(), m);
        assert!(restore_staged(d.path()));
        // The served data is untouched until the swap.
        assert_eq!(
            fs::read(d.path().join("catalog/db")).unwrap(),
            b"the new catalog"
        );
        assert_eq!(
            apply_staged_restore(d.path()).unwrap().as_deref(),
            Some(m.engram_version.as_str())
        );
        assert_restored(d.path());
        assert!(!restore_staged(d.path()));
    }

    #[test]
    fn a_swap_cut_off_by_a_crash_is_finished_by_the_next_start() {
        let (_d, bytes, _) = archive(&FILES);
        // Cut off after moving part of the data out.
        let d = serving_dir();
        stage_restore(&bytes[..], d.path()).unwrap();
        fs::create_dir_all(d.path().join(REPLACED_DIR)).unwrap();
        fs::rename(
            d.path().join("catalog"),
            d.path().join(REPLACED_DIR).join("catalog"),
        )
        .unwrap();
        apply_staged_restore(d.path()).unwrap().unwrap();
        assert_restored(d.path());
        // Cut off after moving everything out and part of the restore in.
        let d = serving_dir();
        stage_restore(&bytes[..], d.path()).unwrap();
        let replaced = d.path().join(REPLACED_DIR);
        fs::create_dir_all(&replaced).unwrap();
        for name in ["keys.json", "catalog", "users.json"] {
            fs::rename(d.path().join(name), replaced.join(name)).unwrap();
        }
        let stage = d.path().join(STAGED_RESTORE_DIR);
        fs::write(stage.join(MOVED_OUT), b"").unwrap();
        fs::rename(stage.join("data/catalog"), d.path().join("catalog")).unwrap();
        apply_staged_restore(d.path()).unwrap().unwrap();
        assert_restored(d.path());
        // Cut off after the swap, before tidying: nothing is applied twice.
        let d = serving_dir();
        fs::create_dir_all(d.path().join(STAGED_RESTORE_DIR).join("data")).unwrap();
        fs::create_dir_all(d.path().join(REPLACED_DIR)).unwrap();
        assert_eq!(apply_staged_restore(d.path()).unwrap(), None);
        assert_eq!(
            fs::read(d.path().join("catalog/db")).unwrap(),
            b"the new catalog"
        );
        assert!(!d.path().join(STAGED_RESTORE_DIR).exists());
    }

    #[test]
    fn a_damaged_archive_stages_nothing() {
        let (_d, bytes, _) = archive(&FILES);
        let d = serving_dir();
        let e = stage_restore(&bytes[..bytes.len() / 2], d.path()).unwrap_err();
        assert!(matches!(e, ServerError::Restore { .. }), "{e}");
        assert!(!d.path().join(STAGED_RESTORE_DIR).exists());
        assert_eq!(apply_staged_restore(d.path()).unwrap(), None);
        assert_eq!(
            fs::read(d.path().join("catalog/db")).unwrap(),
            b"the new catalog"
        );
    }

    #[test]
    fn damaged_or_foreign_archives_are_refused_and_leave_nothing() {
        let (_d, bytes, _) = archive(&FILES);
        let original = entries(&bytes);
        let refused = |archive: &[u8], what: &str| {
            let target = tempfile::tempdir().unwrap();
            let e = restore(archive, target.path()).unwrap_err();
            assert!(matches!(e, ServerError::Restore { .. }), "{what}: {e}");
            assert_eq!(
                fs::read_dir(target.path()).unwrap().count(),
                0,
                "{what} left files behind"
            );
            e.to_string()
        };
        // A changed byte in a file.
        let mut changed = original.clone();
        changed[0].1[0] ^= 1;
        let e = refused(&rebuild(&changed), "a changed byte");
        assert!(
            e.contains("checksum mismatch") && e.contains("catalog/db"),
            "{e}"
        );
        // A file missing, a file added.
        let e = refused(&rebuild(&original[1..]), "a missing file");
        assert!(e.contains("checksum mismatch"), "{e}");
        let mut extra = original.clone();
        extra.insert(0, ("data/users.json".into(), b"{}".to_vec()));
        refused(&rebuild(&extra), "an extra file");
        // A manifest that does not match its checksum, or from a newer format.
        let manifest_at = original.iter().position(|(n, _)| n == MANIFEST).unwrap();
        let mut edited = original.clone();
        let text = String::from_utf8(edited[manifest_at].1.clone()).unwrap();
        edited[manifest_at].1 = text
            .replace("\"version\": 1", "\"version\": 2")
            .into_bytes();
        let e = refused(&rebuild(&edited), "an edited manifest");
        assert!(e.contains("MANIFEST.sha256"), "{e}");
        let sum = format!(
            "{}  {MANIFEST}\n",
            hex(&Sha256::digest(&edited[manifest_at].1))
        );
        edited[manifest_at + 1].1 = sum.into_bytes();
        let e = refused(&rebuild(&edited), "a newer format");
        assert!(e.contains("format version 2"), "{e}");
        // A path escaping the data folder; a cut-off archive; not an archive at all.
        let mut escape = original.clone();
        escape[0].0 = "data/../../etc/passwd".into();
        refused(&rebuild(&escape), "a path escaping");
        refused(&bytes[..bytes.len() / 2], "a cut-off archive");
        refused(b"PK\x03\x04 not a backup", "a zip file");
        // A target that is not empty.
        let target = tempfile::tempdir().unwrap();
        fs::write(target.path().join("catalog"), b"x").unwrap();
        let e = restore(&bytes[..], target.path()).unwrap_err();
        assert!(e.to_string().contains("not empty"), "{e}");
        assert_eq!(fs::read(target.path().join("catalog")).unwrap(), b"x");
    }

    #[test]
    fn a_chunked_response_body_decodes() {
        let body = b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n";
        let mut r = io::BufReader::new(&body[..]);
        let mut out = String::new();
        Chunked {
            inner: &mut r,
            left: 0,
            done: false,
        }
        .read_to_string(&mut out)
        .unwrap();
        assert_eq!(out, "hello world");
    }
}
