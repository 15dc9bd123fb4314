//! The console's own settings, changeable at run time by an admin and kept in
//! `<data dir>/console.json` (version 1, crash-safe writes). The daemon's configuration
//! (`engramd.toml`) is read at start and shown read-only.

use std::path::{Path, PathBuf};
use std::sync::RwLock;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::atomic::write_atomic;
use crate::error::ServerError;

/// The settings file inside the data directory.
pub const SETTINGS_FILE: &str = "console.json";
/// Version of `console.json`.
pub const SETTINGS_FILE_VERSION: u32 = 1;

/// What an admin may change without a restart.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ConsoleSettings {
    pub version: u32,
    /// A session unused this long ends (minutes, 5..=720).
    pub session_idle_minutes: u64,
    /// Failed sign-ins of one account that lock it (3..=20).
    pub lockout_failures: u32,
    /// The window the failures are counted in, and so the lock's length (minutes, 1..=1440).
    pub lockout_minutes: u64,
    /// Tokens the chat playground asks for by default (1..=limits.max_tokens).
    pub chat_max_tokens: usize,
}

impl Default for ConsoleSettings {
    fn default() -> Self {
        ConsoleSettings {
            version: SETTINGS_FILE_VERSION,
            // OWASP's session guidance: 15-30 minutes idle for sensitive applications.
            session_idle_minutes: 30,
            // 5 failures per 15 minutes: slows guessing to 480 tries a day per account while
            // a user who mistypes a few times is not locked out.
            lockout_failures: 5,
            lockout_minutes: 15,
            chat_max_tokens: 128,
        }
    }
}

impl ConsoleSettings {
    pub fn session_idle(&self) -> Duration {
        Duration::from_secs(self.session_idle_minutes * 60)
    }

    pub fn lockout_window(&self) -> Duration {
        Duration::from_secs(self.lockout_minutes * 60)
    }

    /// Checks every field against its range; names the first one that is out.
    pub fn validate(&self, max_tokens: usize) -> Result<(), String> {
        let check = |name: &str, v: u64, lo: u64, hi: u64| {
            if (lo..=hi).contains(&v) {
                Ok(())
            } else {
                Err(format!("{name}: {v} is outside {lo}..={hi}"))
            }
        };
        check("session_idle_minutes", self.session_idle_minutes, 5, 720)?;
        check("lockout_failures", u64::from(self.lockout_failures), 3, 20)?;
        check("lockout_minutes", self.lockout_minutes, 1, 1440)?;
        check(
            "chat_max_tokens",
            self.chat_max_tokens as u64,
            1,
            max_tokens as u64,
        )
    }
}

/// The settings in memory and on disk.
pub struct SettingsStore {
    path: PathBuf,
    current: RwLock<ConsoleSettings>,
}

impl SettingsStore {
    /// Reads the file (defaults when there is none).
    pub fn open(data_dir: &Path) -> Result<SettingsStore, ServerError> {
        let path = data_dir.join(SETTINGS_FILE);
        let current = match std::fs::read(&path) {
            Ok(b) => {
                let s: ConsoleSettings =
                    serde_json::from_slice(&b).map_err(|e| ServerError::Corrupted {
                        path: path.clone(),
                        comment: e.to_string(),
                    })?;
                if s.version != SETTINGS_FILE_VERSION {
                    return Err(ServerError::Corrupted {
                        path,
                        comment: format!(
                            "version {} (this build reads {SETTINGS_FILE_VERSION})",
                            s.version
                        ),
                    });
                }
                s
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => ConsoleSettings::default(),
            Err(e) => return Err(ServerError::io("reading", &path, e)),
        };
        Ok(SettingsStore {
            path,
            current: RwLock::new(current),
        })
    }

    pub fn get(&self) -> ConsoleSettings {
        *self.current.read().expect("settings lock")
    }

    /// Stores new settings (already validated) durably, then uses them.
    pub fn set(&self, s: ConsoleSettings) -> Result<(), ServerError> {
        let mut cur = self.current.write().expect("settings lock");
        write_atomic(
            &self.path,
            &serde_json::to_vec_pretty(&s).expect("settings serialize"),
        )?;
        *cur = s;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_ranges() {
        let dir = tempfile::tempdir().unwrap();
        let st = SettingsStore::open(dir.path()).unwrap();
        let mut s = st.get();
        s.lockout_failures = 7;
        assert!(s.validate(1024).is_ok());
        st.set(s).unwrap();
        assert_eq!(SettingsStore::open(dir.path()).unwrap().get(), s);
        s.lockout_failures = 1;
        assert!(s.validate(1024).unwrap_err().contains("lockout_failures"));
    }
}
