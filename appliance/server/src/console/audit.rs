//! The audit log: `<data dir>/audit.jsonl`, one JSON object per line, appended and fsynced
//! before the action is reported done (sign-ins, failed sign-ins, lockouts, key and user
//! changes, deletions, settings).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::users::now_ms;

/// The audit file inside the data directory.
pub const AUDIT_FILE: &str = "audit.jsonl";
/// Bytes read from the end of the file for the audit page: about 2,000 entries.
const TAIL_BYTES: u64 = 512 << 10;

/// One audited event.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AuditEntry {
    pub at_ms: u64,
    /// The console user (or `-` before sign-in).
    pub actor: String,
    /// `signin`, `signin_failed`, `signin_locked`, `signout`, `key_created`, `key_revoked`,
    /// `user_created`, `user_deleted`, `collection_created`, `collection_deleted`,
    /// `document_deleted`, `documents_uploaded`, `settings_changed`, ...
    pub action: String,
    pub target: String,
    /// The role an account event is about (`admin`, `operator`, ...): a name, shown in the
    /// reader's language, not English words baked into `target` (absent in older entries).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    pub ip: String,
}

/// Append-only; one lock keeps lines whole.
pub struct AuditLog {
    path: PathBuf,
    file: Mutex<()>,
}

impl AuditLog {
    pub fn new(data_dir: &Path) -> AuditLog {
        AuditLog {
            path: data_dir.join(AUDIT_FILE),
            file: Mutex::new(()),
        }
    }

    /// Appends and fsyncs one entry; a failure is logged (the action itself already happened).
    pub fn record(&self, actor: &str, action: &str, target: &str, ip: &str) {
        self.append(actor, action, target, None, ip);
    }

    /// [`Self::record`] for an event about an account of `role` (a sign-in, a new user).
    pub fn record_role(&self, actor: &str, action: &str, target: &str, role: &str, ip: &str) {
        self.append(actor, action, target, Some(role), ip);
    }

    fn append(&self, actor: &str, action: &str, target: &str, role: Option<&str>, ip: &str) {
        tracing::info!(actor, action, target, role, ip, "audit");
        let e = AuditEntry {
            at_ms: now_ms(),
            actor: actor.to_owned(),
            action: action.to_owned(),
            target: target.to_owned(),
            role: role.map(str::to_owned),
            ip: ip.to_owned(),
        };
        let mut line = serde_json::to_vec(&e).expect("audit entries serialize");
        line.push(b'\n');
        let _g = self.file.lock().expect("audit lock");
        let r = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .and_then(|mut f| {
                f.write_all(&line)?;
                f.sync_data()
            });
        if let Err(e) = r {
            tracing::error!("writing the audit log {}: {e}", self.path.display());
        }
    }

    /// The newest entries first, at most `n`.
    pub fn recent(&self, n: usize) -> Vec<AuditEntry> {
        use std::io::{Read, Seek, SeekFrom};
        let Ok(mut f) = std::fs::File::open(&self.path) else {
            return Vec::new();
        };
        let len = f.metadata().map_or(0, |m| m.len());
        let start = len.saturating_sub(TAIL_BYTES);
        let mut buf = String::new();
        if f.seek(SeekFrom::Start(start)).is_err() || f.read_to_string(&mut buf).is_err() {
            return Vec::new();
        }
        // A partial first line (when we started mid-file) does not parse and is skipped.
        buf.lines()
            .rev()
            .filter_map(|l| serde_json::from_str(l).ok())
            .take(n)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn appends_and_reads_newest_first() {
        let dir = tempfile::tempdir().unwrap();
        let log = super::AuditLog::new(dir.path());
        log.record("admin", "signin", "", "127.0.0.1");
        log.record("admin", "key_created", "abc", "127.0.0.1");
        let r = log.recent(10);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].action, "key_created");
    }
}
