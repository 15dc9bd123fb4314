//! API keys: `egk_<id>_<secret>`, stored as argon2id hashes in `<data dir>/keys.json`
//! (written crash-safely), looked up by the non-secret id, verified once and then remembered
//! for a short time; failed attempts are rate-limited per client address.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;
use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::atomic::{locked_update, write_atomic};
use crate::error::{ApiError, Result, ServerError};

/// Every key starts with this, so leaked keys are easy to find by secret scanners.
pub const KEY_PREFIX: &str = "egk_";
/// Characters of the key id: 8 base62 characters give 2^47 ids, enough to never collide
/// among the keys of one appliance.
pub const ID_LEN: usize = 8;
/// Characters of the secret: 32 base62 characters are about 190 bits of entropy.
pub const SECRET_LEN: usize = 32;
/// Version of `keys.json`.
pub const KEY_FILE_VERSION: u32 = 1;
/// The key file inside the data directory.
pub const KEY_FILE: &str = "keys.json";
/// When each key was last used, beside the key file: written apart (at most every
/// [`USE_FLUSH_INTERVAL`]) so that recording a use neither rewrites `keys.json` nor, by
/// changing it, drops every key's verification from the cache.
pub const KEY_USE_FILE: &str = "keys-used.json";
/// Version of `keys-used.json`.
pub const KEY_USE_FILE_VERSION: u32 = 1;
/// How often recorded key uses are written out (and at shutdown).
pub const USE_FLUSH_INTERVAL: Duration = Duration::from_secs(30);
/// Characters a key's name may have.
pub const MAX_KEY_NAME_CHARS: usize = 64;

const BASE62: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// What a key may do. `admin` implies every other scope.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    Search,
    Qa,
    Ingest,
    Admin,
}

impl Scope {
    pub fn name(self) -> &'static str {
        match self {
            Scope::Search => "search",
            Scope::Qa => "qa",
            Scope::Ingest => "ingest",
            Scope::Admin => "admin",
        }
    }

    /// Parses `search,qa,...`.
    pub fn parse_list(s: &str) -> Result<Vec<Scope>> {
        let mut out = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let scope = match part {
                "search" => Scope::Search,
                "qa" => Scope::Qa,
                "ingest" => Scope::Ingest,
                "admin" => Scope::Admin,
                other => {
                    return Err(ServerError::Keys(format!(
                        "unknown scope `{other}` (expected search, qa, ingest, admin)"
                    )))
                }
            };
            if !out.contains(&scope) {
                out.push(scope);
            }
        }
        if out.is_empty() {
            return Err(ServerError::Keys("at least one scope is needed".into()));
        }
        out.sort();
        Ok(out)
    }
}

/// One stored key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRecord {
    /// The non-secret id embedded in the key (`egk_<id>_...`).
    pub id: String,
    /// argon2id PHC string of the whole key.
    pub hash: String,
    pub scopes: Vec<Scope>,
    /// `None`: every collection.
    pub collections: Option<Vec<String>>,
    pub created_ms: u64,
    /// What the key is for ("Dify production", "nightly eval"), given at creation. Absent in
    /// files written before names existed (readers of version 1 ignore it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl KeyRecord {
    /// What `keys list` shows: the key's visible prefix, never the hash.
    pub fn public_json(&self, last_used_ms: Option<u64>) -> serde_json::Value {
        serde_json::json!({
            "id": self.id,
            "name": self.name,
            "prefix": format!("{KEY_PREFIX}{}_", self.id),
            "scopes": self.scopes,
            "collections": self.collections,
            "created_ms": self.created_ms,
            "last_used_ms": last_used_ms,
        })
    }
}

/// A key's name, trimmed: 1 to [`MAX_KEY_NAME_CHARS`] characters, no control characters.
pub fn key_name(name: &str) -> Result<String> {
    let name = name.trim();
    if name.is_empty()
        || name.chars().count() > MAX_KEY_NAME_CHARS
        || name.chars().any(char::is_control)
    {
        return Err(ServerError::Keys(format!(
            "a key's name has 1 to {MAX_KEY_NAME_CHARS} characters and no control characters"
        )));
    }
    Ok(name.to_owned())
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct KeyUseFile {
    version: u32,
    /// Key id -> when it last authenticated a request (Unix ms).
    last_used_ms: HashMap<String, u64>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct KeyFile {
    version: u32,
    keys: Vec<KeyRecord>,
}

fn random_base62(n: usize) -> String {
    let mut rng = rand::rngs::StdRng::from_entropy();
    (0..n)
        .map(|_| BASE62[rng.gen_range(0..BASE62.len())] as char)
        .collect()
}

use rand::SeedableRng;

/// Splits a key into (id, whole key) when it has the right shape.
fn key_id(key: &str) -> Option<&str> {
    let rest = key.strip_prefix(KEY_PREFIX)?;
    let (id, secret) = rest.split_once('_')?;
    let ok = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_alphanumeric());
    (ok(id, ID_LEN) && ok(secret, SECRET_LEN)).then_some(id)
}

fn argon2() -> Argon2<'static> {
    // argon2id v19 with the crate's defaults (19 MiB, 2 passes, 1 lane): OWASP's minimum.
    Argon2::default()
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The key file: create, list, revoke (the `engramd keys` commands).
pub struct KeyStore {
    path: PathBuf,
}

impl KeyStore {
    pub fn new(data_dir: &Path) -> KeyStore {
        KeyStore {
            path: data_dir.join(KEY_FILE),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn read(&self) -> Result<KeyFile> {
        match std::fs::read(&self.path) {
            Ok(bytes) => {
                let f: KeyFile =
                    serde_json::from_slice(&bytes).map_err(|e| ServerError::Corrupted {
                        path: self.path.clone(),
                        comment: e.to_string(),
                    })?;
                if f.version != KEY_FILE_VERSION {
                    return Err(ServerError::Corrupted {
                        path: self.path.clone(),
                        comment: format!(
                            "version {} (this build reads {KEY_FILE_VERSION})",
                            f.version
                        ),
                    });
                }
                Ok(f)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(KeyFile {
                version: KEY_FILE_VERSION,
                keys: Vec::new(),
            }),
            Err(e) => Err(ServerError::io("reading", &self.path, e)),
        }
    }

    fn write(&self, f: &KeyFile) -> Result<()> {
        write_atomic(
            &self.path,
            &serde_json::to_vec_pretty(f).expect("key records serialize"),
        )
    }

    /// Creates a key; returns its record and the key itself (shown once, never stored).
    pub fn create(
        &self,
        scopes: Vec<Scope>,
        collections: Option<Vec<String>>,
    ) -> Result<(KeyRecord, String)> {
        self.create_named(None, scopes, collections)
    }

    /// [`KeyStore::create`] with a name (checked by [`key_name`]).
    pub fn create_named(
        &self,
        name: Option<&str>,
        scopes: Vec<Scope>,
        collections: Option<Vec<String>>,
    ) -> Result<(KeyRecord, String)> {
        let name = name.map(key_name).transpose()?;
        let mut key = String::new();
        let rec = locked_update(&self.path, || -> Result<KeyRecord> {
            let mut f = self.read()?;
            let (mut rec, k) = new_key(&f, scopes, collections)?;
            rec.name = name.clone();
            f.keys.push(rec.clone());
            self.write(&f)?;
            key = k;
            Ok(rec)
        })?;
        Ok((rec, key))
    }

    pub fn list(&self) -> Result<Vec<KeyRecord>> {
        Ok(self.read()?.keys)
    }

    fn use_path(&self) -> PathBuf {
        self.path.with_file_name(KEY_USE_FILE)
    }

    /// When each key last authenticated a request, as of the daemon's last write (at most
    /// [`USE_FLUSH_INTERVAL`] old while it runs). A missing or unreadable file is no uses:
    /// the record is informative, never a reason to refuse anything.
    pub fn last_used(&self) -> HashMap<String, u64> {
        let path = self.use_path();
        let Ok(bytes) = std::fs::read(&path) else {
            return HashMap::new();
        };
        match serde_json::from_slice::<KeyUseFile>(&bytes) {
            Ok(f) if f.version == KEY_USE_FILE_VERSION => f.last_used_ms,
            Ok(f) => {
                tracing::warn!(path = %path.display(), version = f.version, "key use file of another version ignored");
                HashMap::new()
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), "key use file ignored: {e}");
                HashMap::new()
            }
        }
    }

    /// Merges `uses` (newer wins) into the key use file, crash-safely.
    fn record_uses(&self, uses: &HashMap<String, u64>) -> Result<()> {
        let path = self.use_path();
        locked_update(&path, || -> Result<()> {
            let mut all = self.last_used();
            for (id, &ms) in uses {
                let at = all.entry(id.clone()).or_insert(0);
                *at = (*at).max(ms);
            }
            let f = KeyUseFile {
                version: KEY_USE_FILE_VERSION,
                last_used_ms: all,
            };
            write_atomic(&path, &serde_json::to_vec(&f).expect("key uses serialize"))
        })
    }

    /// Removes a key by id (or by the key's visible prefix).
    pub fn revoke(&self, id: &str) -> Result<KeyRecord> {
        let id = id
            .strip_prefix(KEY_PREFIX)
            .map_or(id, |r| r.split('_').next().unwrap_or(r));
        locked_update(&self.path, || -> Result<KeyRecord> {
            let mut f = self.read()?;
            let at = f
                .keys
                .iter()
                .position(|k| k.id == id)
                .ok_or_else(|| ServerError::Keys(format!("no key with id `{id}`")))?;
            let rec = f.keys.remove(at);
            self.write(&f)?;
            Ok(rec)
        })
    }
}

/// A fresh key (an id not in `f`) and its record with the argon2 hash (the slow part).
fn new_key(
    f: &KeyFile,
    scopes: Vec<Scope>,
    collections: Option<Vec<String>>,
) -> Result<(KeyRecord, String)> {
    let id = loop {
        let id = random_base62(ID_LEN);
        if !f.keys.iter().any(|k| k.id == id) {
            break id;
        }
    };
    let key = format!("{KEY_PREFIX}{id}_{}", random_base62(SECRET_LEN));
    let salt = SaltString::generate(&mut argon2::password_hash::rand_core::OsRng);
    let hash = argon2()
        .hash_password(key.as_bytes(), &salt)
        .map_err(|e| ServerError::Keys(format!("hashing the key: {e}")))?
        .to_string();
    let rec = KeyRecord {
        id,
        hash,
        scopes,
        collections,
        created_ms: now_ms(),
        name: None,
    };
    Ok((rec, key))
}

/// Who is calling: the verified key's id, scopes and collection grants.
#[derive(Clone, Debug)]
pub struct Principal {
    pub key_id: String,
    pub scopes: Vec<Scope>,
    pub collections: Option<Vec<String>>,
}

impl Principal {
    /// 403 unless the key has `scope` (or `admin`).
    pub fn require(&self, scope: Scope) -> std::result::Result<(), ApiError> {
        if self.scopes.contains(&scope) || self.scopes.contains(&Scope::Admin) {
            Ok(())
        } else {
            Err(ApiError::Forbidden {
                reason: format!("this key lacks the `{}` scope", scope.name()),
            })
        }
    }

    /// 403 unless the key is granted `collection`.
    pub fn require_collection(&self, collection: &str) -> std::result::Result<(), ApiError> {
        match &self.collections {
            Some(c) if !c.iter().any(|c| c == collection) => Err(ApiError::Forbidden {
                reason: format!("this key is not granted collection `{collection}`"),
            }),
            _ => Ok(()),
        }
    }

    /// Whether the key sees `collection` (for listings).
    pub fn sees(&self, collection: &str) -> bool {
        self.collections
            .as_ref()
            .is_none_or(|c| c.iter().any(|c| c == collection))
    }
}

/// A token bucket of failed attempts for one client address.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Token buckets of failed authentication attempts per client address: each failure takes a
/// token, `per_minute` tokens come back per minute, an empty bucket answers 429.
#[derive(Debug)]
pub struct FailureLimiter {
    per_minute: f64,
    buckets: HashMap<IpAddr, Bucket>,
}

/// Buckets kept before full ones are swept, so a scan of many addresses cannot grow the map
/// without bound.
const MAX_BUCKETS: usize = 10_000;

impl FailureLimiter {
    pub fn new(per_minute: u32) -> FailureLimiter {
        FailureLimiter {
            per_minute: f64::from(per_minute),
            buckets: HashMap::new(),
        }
    }

    fn refill(&mut self, ip: IpAddr, now: Instant) -> &mut Bucket {
        let cap = self.per_minute;
        let b = self.buckets.entry(ip).or_insert(Bucket {
            tokens: cap,
            at: now,
        });
        let dt = now.saturating_duration_since(b.at).as_secs_f64();
        b.tokens = (b.tokens + dt * cap / 60.0).min(cap);
        b.at = now;
        b
    }

    /// `Some(seconds to wait)` when `ip` has no attempts left.
    pub fn blocked(&mut self, ip: IpAddr, now: Instant) -> Option<u64> {
        let rate = self.per_minute / 60.0;
        let b = self.refill(ip, now);
        (b.tokens < 1.0).then(|| ((1.0 - b.tokens) / rate).ceil().max(1.0) as u64)
    }

    /// Records a failed attempt.
    pub fn fail(&mut self, ip: IpAddr, now: Instant) {
        if self.buckets.len() >= MAX_BUCKETS {
            let cap = self.per_minute;
            self.buckets.retain(|_, b| b.tokens < cap);
        }
        let b = self.refill(ip, now);
        b.tokens = (b.tokens - 1.0).max(0.0);
    }
}

/// The key records as last read, with the file's stamp to notice `keys create/revoke`.
struct Loaded {
    stamp: Option<(SystemTime, u64)>,
    records: HashMap<String, KeyRecord>,
    /// Key id -> (seeded hash of the whole key, valid until).
    verified: HashMap<String, (u128, Instant)>,
}

/// Verifies bearer keys for the server.
pub struct Authenticator {
    store: KeyStore,
    cache_ttl: Duration,
    /// Per-process seed of the verification cache's hash, so cached values say nothing
    /// outside this process.
    seed: u64,
    // Short critical sections only (no argon2 under the lock); not engine state.
    loaded: Mutex<Loaded>,
    limiter: Mutex<FailureLimiter>,
    /// Key id -> last successful use (Unix ms) not yet written to the key use file.
    uses: Mutex<HashMap<String, u64>>,
}

impl Authenticator {
    pub fn new(data_dir: &Path, cache_ttl: Duration, failures_per_minute: u32) -> Result<Self> {
        let store = KeyStore::new(data_dir);
        let a = Authenticator {
            store,
            cache_ttl,
            seed: rand::random(),
            loaded: Mutex::new(Loaded {
                stamp: None,
                records: HashMap::new(),
                verified: HashMap::new(),
            }),
            limiter: Mutex::new(FailureLimiter::new(failures_per_minute)),
            uses: Mutex::new(HashMap::new()),
        };
        a.reload_if_changed()?;
        Ok(a)
    }

    /// Writes the key uses recorded since the last call (blocking: a small file and an
    /// fsync; the daemon calls it every [`USE_FLUSH_INTERVAL`] off the async threads and at
    /// shutdown). Failures are logged; the uses are kept for the next call.
    pub fn flush_uses(&self) {
        let uses = std::mem::take(&mut *self.uses.lock().expect("uses lock"));
        if uses.is_empty() {
            return;
        }
        if let Err(e) = self.store.record_uses(&uses) {
            tracing::warn!("recording key uses: {e}");
            let mut pending = self.uses.lock().expect("uses lock");
            for (id, ms) in uses {
                let at = pending.entry(id).or_insert(0);
                *at = (*at).max(ms);
            }
        }
    }

    /// Records a successful use of key `id` (written out by [`Authenticator::flush_uses`]).
    fn used(&self, id: &str) {
        self.uses
            .lock()
            .expect("uses lock")
            .insert(id.to_owned(), now_ms());
    }

    /// Number of keys known.
    pub fn key_count(&self) -> usize {
        self.loaded.lock().expect("auth lock").records.len()
    }

    fn stamp(&self) -> Option<(SystemTime, u64)> {
        let m = std::fs::metadata(self.store.path()).ok()?;
        Some((m.modified().ok()?, m.len()))
    }

    /// Re-reads the key file when its modification time or size changed (one `stat` per
    /// request); clears the verification cache then, so a revocation applies at once.
    fn reload_if_changed(&self) -> Result<()> {
        let stamp = self.stamp();
        if self.loaded.lock().expect("auth lock").stamp == stamp && stamp.is_some() {
            return Ok(());
        }
        let records = self
            .store
            .list()?
            .into_iter()
            .map(|r| (r.id.clone(), r))
            .collect();
        let mut l = self.loaded.lock().expect("auth lock");
        l.records = records;
        l.verified.clear();
        l.stamp = stamp;
        Ok(())
    }

    /// Checks an `Authorization` header value for a client at `ip`.
    pub async fn authenticate(
        &self,
        header: Option<&str>,
        ip: IpAddr,
    ) -> std::result::Result<Principal, ApiError> {
        let now = Instant::now();
        if let Some(retry_after_s) = self.limiter.lock().expect("limiter lock").blocked(ip, now) {
            tracing::warn!(%ip, "authentication rate limit hit");
            return Err(ApiError::RateLimited { retry_after_s });
        }
        match self.check(header).await {
            Ok(p) => Ok(p),
            Err(reason) => {
                tracing::warn!(%ip, reason, "authentication failed");
                self.limiter.lock().expect("limiter lock").fail(ip, now);
                Err(ApiError::Unauthorized { reason })
            }
        }
    }

    async fn check(&self, header: Option<&str>) -> std::result::Result<Principal, &'static str> {
        let header = header.ok_or("missing `Authorization: Bearer <key>` header")?;
        let key = header
            .strip_prefix("Bearer ")
            .or_else(|| header.strip_prefix("bearer "))
            .ok_or("the Authorization header must be `Bearer <key>`")?
            .trim();
        let id = key_id(key).ok_or("invalid API key")?;
        if let Err(e) = self.reload_if_changed() {
            tracing::error!("reading the key file: {e}");
            return Err("the key store cannot be read");
        }
        let fast = xxhash_rust::xxh3::xxh3_128_with_seed(key.as_bytes(), self.seed);
        let rec = {
            let l = self.loaded.lock().expect("auth lock");
            let rec = l.records.get(id).cloned().ok_or("invalid API key")?;
            if let Some(&(h, until)) = l.verified.get(id) {
                if h == fast && Instant::now() < until {
                    drop(l);
                    self.used(id);
                    return Ok(principal(&rec));
                }
            }
            rec
        };
        let key_owned = key.to_owned();
        let hash = rec.hash.clone();
        let ok = tokio::task::spawn_blocking(move || {
            PasswordHash::new(&hash)
                .map(|h| argon2().verify_password(key_owned.as_bytes(), &h).is_ok())
                .unwrap_or(false)
        })
        .await
        .unwrap_or(false);
        if !ok {
            return Err("invalid API key");
        }
        self.loaded
            .lock()
            .expect("auth lock")
            .verified
            .insert(rec.id.clone(), (fast, Instant::now() + self.cache_ttl));
        self.used(&rec.id);
        Ok(principal(&rec))
    }
}

fn principal(r: &KeyRecord) -> Principal {
    Principal {
        key_id: r.id.clone(),
        scopes: r.scopes.clone(),
        collections: r.collections.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_shape() {
        let id = "AbCd1234";
        let key = format!("egk_{id}_{}", "x".repeat(SECRET_LEN));
        assert_eq!(key_id(&key), Some(id));
        assert_eq!(key_id("egk_short_x"), None);
        assert_eq!(key_id(&key.replace("egk_", "sk_")), None);
        assert_eq!(random_base62(SECRET_LEN).len(), SECRET_LEN);
    }

    #[test]
    fn names_are_checked_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let store = KeyStore::new(dir.path());
        let (rec, _) = store
            .create_named(Some("  Dify production "), vec![Scope::Search], None)
            .unwrap();
        assert_eq!(rec.name.as_deref(), Some("Dify production"));
        assert_eq!(store.list().unwrap()[0].name, rec.name);
        for bad in ["", "   ", "a\u{7}b", &"x".repeat(MAX_KEY_NAME_CHARS + 1)] {
            assert!(
                store
                    .create_named(Some(bad), vec![Scope::Qa], None)
                    .is_err(),
                "{bad:?}"
            );
        }
        // A file written before names existed still reads.
        let old = r#"{"version": 1, "keys": [{"id": "AbCd1234", "hash": "h", "scopes": ["qa"], "collections": null, "created_ms": 1}]}"#;
        std::fs::write(store.path(), old).unwrap();
        assert_eq!(store.list().unwrap()[0].name, None);
    }

    #[test]
    fn scopes_parse() {
        assert_eq!(
            Scope::parse_list("qa, search,qa").unwrap(),
            vec![Scope::Search, Scope::Qa]
        );
        assert!(Scope::parse_list("root").is_err());
        assert!(Scope::parse_list("").is_err());
    }

    #[test]
    fn limiter_blocks_after_the_budget_and_refills() {
        let mut l = FailureLimiter::new(10);
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let t0 = Instant::now();
        for _ in 0..10 {
            assert_eq!(l.blocked(ip, t0), None);
            l.fail(ip, t0);
        }
        assert!(l.blocked(ip, t0).is_some());
        assert_eq!(l.blocked("10.0.0.2".parse().unwrap(), t0), None);
        assert_eq!(l.blocked(ip, t0 + Duration::from_secs(7)), None);
    }

    #[tokio::test]
    async fn create_verify_revoke() {
        let dir = tempfile::tempdir().unwrap();
        let store = KeyStore::new(dir.path());
        let (rec, key) = store
            .create(vec![Scope::Search], Some(vec!["a".into()]))
            .unwrap();
        assert!(key.starts_with("egk_") && key_id(&key) == Some(rec.id.as_str()));
        assert!(!std::fs::read_to_string(store.path())
            .unwrap()
            .contains(&key));
        let auth = Authenticator::new(dir.path(), Duration::from_secs(60), 100).unwrap();
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let p = auth
            .authenticate(Some(&format!("Bearer {key}")), ip)
            .await
            .unwrap();
        assert!(p.require(Scope::Search).is_ok());
        assert!(p.require(Scope::Qa).is_err());
        assert!(p.require_collection("b").is_err());
        // Cached path.
        assert!(auth
            .authenticate(Some(&format!("Bearer {key}")), ip)
            .await
            .is_ok());
        let wrong = format!("{}X", &key[..key.len() - 1]);
        let wrong = if wrong == key {
            key.replace('_', "_Y").to_string()
        } else {
            wrong
        };
        assert!(auth
            .authenticate(Some(&format!("Bearer {wrong}")), ip)
            .await
            .is_err());
        // Uses are recorded in memory and written apart from the key file.
        assert!(store.last_used().is_empty());
        let before = std::fs::read(store.path()).unwrap();
        auth.flush_uses();
        let used = store.last_used();
        assert!(used[&rec.id] > 0, "{used:?}");
        assert_eq!(std::fs::read(store.path()).unwrap(), before);
        store.revoke(&rec.id).unwrap();
        // A different size guarantees the stamp changes even within one mtime tick.
        assert!(auth
            .authenticate(Some(&format!("Bearer {key}")), ip)
            .await
            .is_err());
        assert!(store.list().unwrap().is_empty());
    }
}
