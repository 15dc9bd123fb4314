//! Console accounts: `<data dir>/users.json` (version 1, argon2id password hashes, written
//! crash-safely), roles `admin` (everything) and `operator` (read-only).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;
use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::atomic::{locked_update, write_atomic};
use crate::error::ServerError;

/// The account file inside the data directory.
pub const USER_FILE: &str = "users.json";
/// Version of `users.json`.
pub const USER_FILE_VERSION: u32 = 1;
/// Where the daemon writes the first admin's password when it creates one at start-up.
pub const INITIAL_PASSWORD_FILE: &str = "initial-admin-password";
/// Shortest password accepted: 12 characters is NIST 800-63B's floor for a single factor
/// raised a little, since the console controls every document and key.
pub const MIN_PASSWORD_CHARS: usize = 12;
/// Characters of a generated password: 20 base62 characters are about 119 bits.
const GENERATED_PASSWORD_CHARS: usize = 20;

/// What an account may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Everything, including keys, users and settings.
    Admin,
    /// Sees every page, changes nothing.
    Operator,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Operator => "operator",
        }
    }

    pub fn parse(s: &str) -> Result<Role, UserError> {
        match s.trim() {
            "admin" => Ok(Role::Admin),
            "operator" => Ok(Role::Operator),
            other => Err(UserError::Invalid {
                field: "role",
                reason: format!("unknown role `{other}` (expected admin or operator)"),
            }),
        }
    }
}

/// One stored account.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct User {
    pub name: String,
    pub role: Role,
    /// argon2id PHC string.
    pub hash: String,
    pub created_ms: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct UserFile {
    version: u32,
    users: Vec<User>,
}

/// Why an account change was refused.
#[derive(Debug, thiserror::Error)]
pub enum UserError {
    #[error("a user named `{name}` already exists")]
    Exists { name: String },
    #[error("no user named `{name}`")]
    NotFound { name: String },
    #[error("invalid {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error("`{name}` is the last admin; create another admin first")]
    LastAdmin { name: String },
    #[error(transparent)]
    Store(#[from] ServerError),
}

/// The account file. An exclusive file lock serialises the read-modify-write of every change,
/// from the daemon and from `engramd users` alike; reads are cached until the file changes (the
/// console's guard reads the account on every request).
pub struct UserStore {
    path: PathBuf,
    cache: Mutex<Option<(FileStamp, UserFile)>>,
}

/// What tells a replaced or changed file: inode, modification time and length.
type FileStamp = (u64, std::time::SystemTime, u64);

fn stamp(path: &Path) -> Option<FileStamp> {
    let m = std::fs::metadata(path).ok()?;
    #[cfg(unix)]
    let ino = std::os::unix::fs::MetadataExt::ino(&m);
    #[cfg(not(unix))]
    let ino = 0;
    Some((ino, m.modified().ok()?, m.len()))
}

fn argon2() -> Argon2<'static> {
    // argon2id v19 with the crate's defaults (19 MiB, 2 passes, 1 lane): OWASP's minimum.
    Argon2::default()
}

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A random password of base62 characters.
pub fn generate_password() -> String {
    const BASE62: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    let mut rng = rand::rngs::OsRng;
    (0..GENERATED_PASSWORD_CHARS)
        .map(|_| BASE62[rng.gen_range(0..BASE62.len())] as char)
        .collect()
}

/// Whether `name` is one an account may have (sign-in refuses others before any other work).
pub(crate) fn valid_name(name: &str) -> bool {
    check_name(name).is_ok()
}

fn check_name(name: &str) -> Result<(), UserError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(UserError::Invalid {
            field: "name",
            reason: "1 to 64 characters from a-z, A-Z, 0-9, `-`, `_`, `.`".into(),
        })
    }
}

fn check_password(password: &str) -> Result<(), UserError> {
    if password.chars().count() < MIN_PASSWORD_CHARS {
        return Err(UserError::Invalid {
            field: "password",
            reason: format!("at least {MIN_PASSWORD_CHARS} characters"),
        });
    }
    Ok(())
}

impl UserStore {
    pub fn new(data_dir: &Path) -> UserStore {
        UserStore {
            path: data_dir.join(USER_FILE),
            cache: Mutex::new(None),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn read(&self) -> Result<UserFile, ServerError> {
        let before = stamp(&self.path);
        let mut cache = self.cache.lock().expect("user cache lock");
        if let (Some(now), Some((at, f))) = (before, cache.as_ref()) {
            if now == *at {
                return Ok(f.clone());
            }
        }
        let f = self.read_file()?;
        // Cache only what was read from an unchanged file (a writer may replace it meanwhile).
        match before {
            Some(b) if stamp(&self.path) == Some(b) => *cache = Some((b, f.clone())),
            _ => *cache = None,
        }
        Ok(f)
    }

    fn read_file(&self) -> Result<UserFile, ServerError> {
        match std::fs::read(&self.path) {
            Ok(bytes) => {
                let f: UserFile =
                    serde_json::from_slice(&bytes).map_err(|e| ServerError::Corrupted {
                        path: self.path.clone(),
                        comment: e.to_string(),
                    })?;
                if f.version != USER_FILE_VERSION {
                    return Err(ServerError::Corrupted {
                        path: self.path.clone(),
                        comment: format!(
                            "version {} (this build reads {USER_FILE_VERSION})",
                            f.version
                        ),
                    });
                }
                Ok(f)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(UserFile {
                version: USER_FILE_VERSION,
                users: Vec::new(),
            }),
            Err(e) => Err(ServerError::io("reading", &self.path, e)),
        }
    }

    fn write(&self, f: &UserFile) -> Result<(), ServerError> {
        write_atomic(
            &self.path,
            &serde_json::to_vec_pretty(f).expect("user records serialize"),
        )
    }

    pub fn list(&self) -> Result<Vec<User>, ServerError> {
        Ok(self.read()?.users)
    }

    pub fn get(&self, name: &str) -> Result<Option<User>, ServerError> {
        Ok(self.read()?.users.into_iter().find(|u| u.name == name))
    }

    /// Creates an account (argon2 runs here: call from a blocking context).
    pub fn create(&self, name: &str, role: Role, password: &str) -> Result<User, UserError> {
        check_name(name)?;
        check_password(password)?;
        let salt = SaltString::generate(&mut argon2::password_hash::rand_core::OsRng);
        let hash = argon2()
            .hash_password(password.as_bytes(), &salt)
            .map_err(|e| UserError::Invalid {
                field: "password",
                reason: format!("hashing failed: {e}"),
            })?
            .to_string();
        locked_update(&self.path, || {
            let mut f = self.read()?;
            if f.users.iter().any(|u| u.name == name) {
                return Err(UserError::Exists { name: name.into() });
            }
            let user = User {
                name: name.to_owned(),
                role,
                hash,
                created_ms: now_ms(),
            };
            f.users.push(user.clone());
            self.write(&f)?;
            Ok(user)
        })
    }

    /// Deletes an account; the last admin cannot be deleted.
    pub fn delete(&self, name: &str) -> Result<User, UserError> {
        locked_update(&self.path, || {
            let mut f = self.read()?;
            let at = f
                .users
                .iter()
                .position(|u| u.name == name)
                .ok_or_else(|| UserError::NotFound { name: name.into() })?;
            let admins = f.users.iter().filter(|u| u.role == Role::Admin).count();
            if f.users[at].role == Role::Admin && admins == 1 {
                return Err(UserError::LastAdmin { name: name.into() });
            }
            let user = f.users.remove(at);
            self.write(&f)?;
            Ok(user)
        })
    }

    /// The account when `password` is right (argon2 runs here: call from a blocking
    /// context). An unknown name costs a hash too, so timing does not reveal which names exist.
    pub fn verify(&self, name: &str, password: &str) -> Result<Option<User>, ServerError> {
        let user = self.get(name)?;
        // For an unknown name, a valid hash of a random string: same cost, never matches.
        static DUMMY: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
            let salt = SaltString::generate(&mut argon2::password_hash::rand_core::OsRng);
            argon2()
                .hash_password(generate_password().as_bytes(), &salt)
                .map_or_else(|_| String::new(), |h| h.to_string())
        });
        let hash = user.as_ref().map_or(DUMMY.as_str(), |u| u.hash.as_str());
        let ok = PasswordHash::new(hash)
            .map(|h| argon2().verify_password(password.as_bytes(), &h).is_ok())
            .unwrap_or(false);
        Ok(user.filter(|_| ok))
    }

    /// At first start, with no account at all: creates `admin` with a random password written
    /// once to `<data dir>/initial-admin-password` (mode 0600). Returns that file's path.
    pub fn ensure_initial_admin(&self, data_dir: &Path) -> Result<Option<PathBuf>, UserError> {
        if !self.list()?.is_empty() {
            return Ok(None);
        }
        let password = generate_password();
        let file = data_dir.join(INITIAL_PASSWORD_FILE);
        write_atomic(&file, format!("{password}\n").as_bytes())?;
        self.create("admin", Role::Admin, &password)?;
        Ok(Some(file))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_verify_delete() {
        let dir = tempfile::tempdir().unwrap();
        let s = UserStore::new(dir.path());
        s.create("root", Role::Admin, "correct horse battery")
            .unwrap();
        assert!(matches!(
            s.create("root", Role::Admin, "correct horse battery"),
            Err(UserError::Exists { .. })
        ));
        assert!(matches!(
            s.create("op", Role::Operator, "short"),
            Err(UserError::Invalid { .. })
        ));
        s.create("op", Role::Operator, "another long password")
            .unwrap();
        assert!(s.verify("root", "correct horse battery").unwrap().is_some());
        assert!(s.verify("root", "wrong password!!").unwrap().is_none());
        assert!(s
            .verify("nobody", "correct horse battery")
            .unwrap()
            .is_none());
        let text = std::fs::read_to_string(s.path()).unwrap();
        assert!(text.contains("\"version\": 1") && !text.contains("battery"));
        assert!(matches!(s.delete("root"), Err(UserError::LastAdmin { .. })));
        s.delete("op").unwrap();
        assert_eq!(s.list().unwrap().len(), 1);
    }

    #[test]
    fn initial_admin_once() {
        let dir = tempfile::tempdir().unwrap();
        let s = UserStore::new(dir.path());
        let file = s.ensure_initial_admin(dir.path()).unwrap().unwrap();
        let pw = std::fs::read_to_string(&file).unwrap();
        assert!(s.verify("admin", pw.trim()).unwrap().is_some());
        assert!(s.ensure_initial_admin(dir.path()).unwrap().is_none());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&file).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }
}
