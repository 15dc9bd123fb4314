//! Which Engram version this is, and which versions have run on this data directory:
//! `<data>/versions.json`, one event per change of version (the install, each upgrade and
//! rollback), each with the on-disk format versions that build reads and writes and, after a
//! package upgrade, the pre-upgrade snapshot the package took (`docs/formats/upgrade.md`).
//! Written crash-safely at start, before the knowledge base opens, so a version that refuses
//! the data is on record too.

use std::cmp::Ordering;
use std::path::Path;
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::{Result, ServerError};

/// The version this library reports until a binary stamps its own ([`stamp`]).
pub const WORKSPACE_VERSION: &str = env!("CARGO_PKG_VERSION");

static STAMPED: OnceLock<&'static str> = OnceLock::new();

/// Sets this process's version, once, before anything reads it: `engramd`'s `main` passes
/// `ENGRAM_VERSION` as it was at build time (the packaging sets it to the package's version).
/// The binary's own crate reads that variable, not this library, so a package of another
/// version recompiles `main.rs` and links, instead of compiling this crate again. A second
/// call is ignored.
pub fn stamp(version: &'static str) {
    let _ = STAMPED.set(version);
}

/// This process's version: the one [`stamp`]ed, else the workspace's.
pub fn version() -> &'static str {
    STAMPED.get().copied().unwrap_or(WORKSPACE_VERSION)
}

/// The history file in the data directory.
pub const HISTORY_FILE: &str = "versions.json";
/// Left by the package's `preinst` before an upgrade or rollback: the path of the snapshot it
/// took. Recorded in the next event, then removed.
pub const SNAPSHOT_MARKER: &str = "pre-upgrade-snapshot";
const FILE_FORMAT: u32 = 1;
/// Events kept (the oldest beyond it are dropped).
const MAX_EVENTS: usize = 200;

/// The on-disk formats a build reads and writes. An index of another version is rebuilt from
/// the catalog, a chunk KV blob of another version recomputed; a catalog of another schema is
/// refused (with the snapshot to restore).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Formats {
    pub catalog_schema: u32,
    pub bm25_index: u32,
    pub vector_index: u32,
    pub kv_blob: u32,
    pub backup: u32,
}

impl Formats {
    pub fn current() -> Formats {
        Formats {
            catalog_schema: engram_kb::SCHEMA_VERSION,
            bm25_index: engram_index::BM25_FORMAT_VERSION,
            vector_index: engram_index::VECTOR_FORMAT_VERSION,
            kv_blob: engram_kvstore::FORMAT_VERSION,
            backup: crate::backup::FORMAT_VERSION,
        }
    }
}

/// One start of a version other than the last one recorded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct VersionEvent {
    /// `install`, `upgrade`, `rollback` or `reinstall` (the same version again after another).
    pub kind: String,
    pub version: String,
    /// The version that ran before; absent for the install.
    pub previous: Option<String>,
    /// Milliseconds since the Unix epoch, when this version first started on the data.
    pub at_ms: u64,
    pub formats: Formats,
    /// The snapshot the package took before the change (an `engramd backup` archive).
    pub snapshot: Option<String>,
}

#[derive(Debug, Serialize, Deserialize)]
struct HistoryFile {
    format: u32,
    events: Vec<VersionEvent>,
}

/// The history, oldest first (empty when none was recorded).
pub fn history(data_dir: &Path) -> Result<Vec<VersionEvent>> {
    let path = data_dir.join(HISTORY_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(ServerError::io("reading", &path, e)),
    };
    let file: HistoryFile = serde_json::from_slice(&bytes).map_err(|e| ServerError::Corrupted {
        path: path.clone(),
        comment: format!("not a version history: {e}"),
    })?;
    if file.format != FILE_FORMAT {
        return Err(ServerError::Corrupted {
            path,
            comment: format!(
                "version history format {} (this engramd reads {FILE_FORMAT})",
                file.format
            ),
        });
    }
    Ok(file.events)
}

/// Records this version's start when it differs from the last one recorded (or a snapshot
/// marker is waiting) and returns the new event, if any.
pub fn record_start(data_dir: &Path) -> Result<Option<VersionEvent>> {
    record(data_dir, version(), Formats::current(), now_ms())
}

fn record(
    data_dir: &Path,
    version: &str,
    formats: Formats,
    at_ms: u64,
) -> Result<Option<VersionEvent>> {
    let marker = data_dir.join(SNAPSHOT_MARKER);
    let snapshot = match std::fs::read_to_string(&marker) {
        Ok(s) => Some(s.trim().to_owned()).filter(|s| !s.is_empty()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(ServerError::io("reading", &marker, e)),
    };
    let mut events = history(data_dir)?;
    let previous = events.last().map(|e| e.version.clone());
    if previous.as_deref() == Some(version) && snapshot.is_none() {
        return Ok(None);
    }
    let kind = match previous.as_deref() {
        None => "install",
        Some(p) => match compare(version, p) {
            Ordering::Greater => "upgrade",
            Ordering::Less => "rollback",
            Ordering::Equal => "reinstall",
        },
    };
    let event = VersionEvent {
        kind: kind.into(),
        version: version.into(),
        previous,
        at_ms,
        formats,
        snapshot,
    };
    events.push(event.clone());
    if events.len() > MAX_EVENTS {
        events.drain(..events.len() - MAX_EVENTS);
    }
    let bytes = serde_json::to_vec_pretty(&HistoryFile {
        format: FILE_FORMAT,
        events,
    })
    .map_err(|e| ServerError::config(HISTORY_FILE, format!("encoding: {e}")))?;
    crate::atomic::write_atomic(&data_dir.join(HISTORY_FILE), &bytes)?;
    // Only once the event holding it is durable.
    match std::fs::remove_file(&marker) {
        Ok(()) => crate::atomic::sync_dir(data_dir)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(ServerError::io("removing", &marker, e)),
    }
    Ok(Some(event))
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Orders versions as dpkg does, so the history agrees with the package manager: runs of
/// digits compare as numbers, other characters by ASCII with letters before non-letters, and
/// `~` before anything, even the end (`0.2.0~rc1` < `0.2.0` < `0.2.0+fix1`).
pub fn compare(a: &str, b: &str) -> Ordering {
    fn weight(c: Option<u8>) -> i32 {
        match c {
            Some(b'~') => -1,
            None => 0,
            Some(c) if c.is_ascii_alphabetic() => i32::from(c),
            Some(c) => i32::from(c) + 256,
        }
    }
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let (mut i, mut j) = (0, 0);
    while i < a.len() || j < b.len() {
        // The non-digit run.
        while (i < a.len() && !a[i].is_ascii_digit()) || (j < b.len() && !b[j].is_ascii_digit()) {
            let ca = a.get(i).copied().filter(|c| !c.is_ascii_digit());
            let cb = b.get(j).copied().filter(|c| !c.is_ascii_digit());
            match weight(ca).cmp(&weight(cb)) {
                Ordering::Equal => {}
                o => return o,
            }
            i += usize::from(ca.is_some());
            j += usize::from(cb.is_some());
        }
        // The digit run, as a number (leading zeros ignored).
        let start = (i, j);
        while i < a.len() && a[i].is_ascii_digit() {
            i += 1;
        }
        while j < b.len() && b[j].is_ascii_digit() {
            j += 1;
        }
        let da = std::str::from_utf8(&a[start.0..i])
            .unwrap_or("")
            .trim_start_matches('0');
        let db = std::str::from_utf8(&b[start.1..j])
            .unwrap_or("")
            .trim_start_matches('0');
        match da.len().cmp(&db.len()).then_with(|| da.cmp(db)) {
            Ordering::Equal => {}
            o => return o,
        }
    }
    Ordering::Equal
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_order_as_dpkg_orders_them() {
        let ordered = [
            "0.1.0~rc1",
            "0.1.0",
            "0.1.0+test.1",
            "0.1.0+test.2",
            "0.1.1",
            "0.2.0",
            "0.10.0",
            "1.0.0",
        ];
        for (x, a) in ordered.iter().enumerate() {
            for (y, b) in ordered.iter().enumerate() {
                assert_eq!(compare(a, b), x.cmp(&y), "{a} vs {b}");
            }
        }
        assert_eq!(compare("1.01", "1.1"), Ordering::Equal);
    }

    #[test]
    fn history_records_each_change_once_with_the_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let f = Formats::current();
        let install = record(d, "0.1.0", f.clone(), 1).unwrap().unwrap();
        assert_eq!((install.kind.as_str(), install.previous), ("install", None));
        assert_eq!(
            record(d, "0.1.0", f.clone(), 2).unwrap(),
            None,
            "same version"
        );

        std::fs::write(d.join(SNAPSHOT_MARKER), "/var/backups/engram/a.tar.zst\n").unwrap();
        let up = record(d, "0.2.0", f.clone(), 3).unwrap().unwrap();
        assert_eq!(up.kind, "upgrade");
        assert_eq!(up.previous.as_deref(), Some("0.1.0"));
        assert_eq!(
            up.snapshot.as_deref(),
            Some("/var/backups/engram/a.tar.zst")
        );
        assert!(!d.join(SNAPSHOT_MARKER).exists(), "the marker is consumed");

        let back = record(d, "0.1.0", f.clone(), 4).unwrap().unwrap();
        assert_eq!((back.kind.as_str(), back.snapshot), ("rollback", None));
        let kinds: Vec<_> = history(d).unwrap().into_iter().map(|e| e.kind).collect();
        assert_eq!(kinds, ["install", "upgrade", "rollback"]);
    }

    #[test]
    fn a_damaged_history_is_an_error_not_a_new_install() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(HISTORY_FILE), b"{\"format\": 1, \"ev").unwrap();
        let err = record(dir.path(), "0.1.0", Formats::current(), 1).unwrap_err();
        assert!(err.to_string().contains("not a version history"), "{err}");
    }
}
