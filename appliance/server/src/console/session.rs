//! Console sessions and sign-in lockout: a random 256-bit session id in an HttpOnly,
//! SameSite=Strict cookie, the session (user, role, CSRF token, expiry) kept server-side;
//! failed sign-ins counted per account in a sliding window.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::{header, HeaderMap};
use rand::RngCore;

use super::users::Role;

/// The session cookie.
pub const SESSION_COOKIE: &str = "engram_session";
/// The cookie that carries the sign-in form's CSRF token before a session exists
/// (double submit).
pub const SIGNIN_COOKIE: &str = "engram_signin";
/// A session ends this long after sign-in whatever its activity: a work day.
pub const SESSION_MAX_AGE: Duration = Duration::from_secs(12 * 3600);
/// Sessions kept at most; the oldest go first, so a flood of sign-ins cannot grow memory.
const MAX_SESSIONS: usize = 10_000;
/// Account names whose recent failures are kept at most (names are at most 64 bytes, so this
/// bounds the lockout table near 1 MiB whatever is sent).
const MAX_LOCKOUT_NAMES: usize = 10_000;

/// 32 random bytes from the OS, hex.
pub fn random_token() -> String {
    let mut b = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Compares two secrets in time independent of where they differ.
pub fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// One signed-in browser.
#[derive(Clone, Debug)]
pub struct Session {
    pub user: String,
    pub role: Role,
    /// Checked on every POST (hidden form field or `X-CSRF-Token` header).
    pub csrf: String,
    created: Instant,
    last_seen: Instant,
    /// A secret to show once on the next page that asks for it (a new API key: the create
    /// form redirects, so reloading the page that shows it creates nothing).
    reveal: Option<String>,
}

/// Sessions by id.
pub struct Sessions {
    map: Mutex<HashMap<String, Session>>,
}

impl Default for Sessions {
    fn default() -> Self {
        Sessions {
            map: Mutex::new(HashMap::new()),
        }
    }
}

impl Sessions {
    /// Starts a session; returns its id (the cookie value).
    pub fn create(&self, user: &str, role: Role) -> String {
        let id = random_token();
        let now = Instant::now();
        let mut m = self.map.lock().expect("sessions lock");
        if m.len() >= MAX_SESSIONS {
            if let Some(oldest) = m
                .iter()
                .min_by_key(|(_, s)| s.last_seen)
                .map(|(k, _)| k.clone())
            {
                m.remove(&oldest);
            }
        }
        m.insert(
            id.clone(),
            Session {
                user: user.to_owned(),
                role,
                csrf: random_token(),
                created: now,
                last_seen: now,
                reveal: None,
            },
        );
        id
    }

    /// The live session with this id, its idle timer reset when `active` (a person's request,
    /// not a background refresh); an expired one is removed.
    pub fn touch(&self, id: &str, idle: Duration, active: bool) -> Option<Session> {
        let now = Instant::now();
        let mut m = self.map.lock().expect("sessions lock");
        let s = m.get_mut(id)?;
        if now.duration_since(s.last_seen) > idle || now.duration_since(s.created) > SESSION_MAX_AGE
        {
            m.remove(id);
            return None;
        }
        if active {
            s.last_seen = now;
        }
        Some(s.clone())
    }

    /// Keeps `secret` for the next [`take_reveal`](Self::take_reveal) of session `id`.
    pub fn stash_reveal(&self, id: &str, secret: String) {
        if let Some(s) = self.map.lock().expect("sessions lock").get_mut(id) {
            s.reveal = Some(secret);
        }
    }

    /// The secret stashed for session `id`, once.
    pub fn take_reveal(&self, id: &str) -> Option<String> {
        self.map
            .lock()
            .expect("sessions lock")
            .get_mut(id)?
            .reveal
            .take()
    }

    pub fn remove(&self, id: &str) {
        self.map.lock().expect("sessions lock").remove(id);
    }

    /// Ends every session of `user` (deleted account).
    pub fn remove_user(&self, user: &str) {
        self.map
            .lock()
            .expect("sessions lock")
            .retain(|_, s| s.user != user);
    }
}

/// Failed sign-ins per account name within a sliding window.
pub struct Lockout {
    failures: Mutex<HashMap<String, Vec<Instant>>>,
}

impl Default for Lockout {
    fn default() -> Self {
        Lockout {
            failures: Mutex::new(HashMap::new()),
        }
    }
}

impl Lockout {
    /// Counts a sign-in attempt of `name` before its password is checked, so that parallel
    /// guesses cannot all pass the check before any is counted: `Err(time left)` when `name`
    /// already has `max` attempts within `window` (locked), else `Ok(attempts now in the
    /// window)`. A successful sign-in then calls [`Lockout::clear`].
    pub fn attempt(&self, name: &str, max: u32, window: Duration) -> Result<usize, Duration> {
        let now = Instant::now();
        let mut m = self.failures.lock().expect("lockout lock");
        if m.len() >= MAX_LOCKOUT_NAMES && !m.contains_key(name) {
            m.retain(|_, f| f.iter().any(|t| now.duration_since(*t) < window));
            if m.len() >= MAX_LOCKOUT_NAMES {
                // Still full of live entries: forget the name whose last attempt is oldest.
                if let Some(k) = m
                    .iter()
                    .min_by_key(|(_, f)| f.iter().max().copied())
                    .map(|(k, _)| k.clone())
                {
                    m.remove(&k);
                }
            }
        }
        let f = m.entry(name.to_owned()).or_default();
        f.retain(|t| now.duration_since(*t) < window);
        if f.len() >= max as usize {
            let oldest = f.iter().min().copied().unwrap_or(now);
            return Err(window.saturating_sub(now.duration_since(oldest)));
        }
        f.push(now);
        Ok(f.len())
    }

    pub fn clear(&self, name: &str) {
        self.failures.lock().expect("lockout lock").remove(name);
    }
}

/// The value of cookie `name` in the request.
pub fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|kv| {
            let (k, v) = kv.trim().split_once('=')?;
            (k == name).then_some(v)
        })
}

/// Whether the browser reached us over TLS (through a reverse proxy that says so).
pub fn is_tls(headers: &HeaderMap) -> bool {
    headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("https"))
}

/// A `Set-Cookie` value: HttpOnly, SameSite=Strict, path `/console`, Secure over TLS;
/// `max_age` none for a browser-session cookie, zero to delete.
pub fn set_cookie(name: &str, value: &str, max_age: Option<u64>, tls: bool) -> String {
    let mut c = format!("{name}={value}; Path=/console; HttpOnly; SameSite=Strict");
    if let Some(s) = max_age {
        c.push_str(&format!("; Max-Age={s}"));
    }
    if tls {
        c.push_str("; Secure");
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_expire_when_idle() {
        let s = Sessions::default();
        let id = s.create("a", Role::Admin);
        assert_eq!(id.len(), 64);
        assert!(s.touch(&id, Duration::from_secs(60), true).is_some());
        assert!(s.touch(&id, Duration::ZERO, true).is_none());
        assert!(
            s.touch(&id, Duration::from_secs(60), true).is_none(),
            "removed"
        );
        // A background refresh does not reset the idle timer.
        let id = s.create("bob", Role::Operator);
        std::thread::sleep(Duration::from_millis(30));
        assert!(s.touch(&id, Duration::from_secs(60), false).is_some());
        assert!(s.touch(&id, Duration::from_millis(20), false).is_none());
    }

    #[test]
    fn lockout_after_max_attempts() {
        let l = Lockout::default();
        let w = Duration::from_secs(900);
        for i in 1..=5 {
            assert_eq!(l.attempt("a", 5, w), Ok(i));
        }
        assert!(l.attempt("a", 5, w).is_err());
        assert_eq!(l.attempt("b", 5, w), Ok(1));
        l.clear("a");
        assert_eq!(l.attempt("a", 5, w), Ok(1));
    }

    #[test]
    fn parallel_attempts_cannot_pass_the_lockout() {
        let l = Lockout::default();
        let w = Duration::from_secs(900);
        let passed = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..10 {
                        if l.attempt("admin", 5, w).is_ok() {
                            passed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        }
                    }
                });
            }
        });
        assert_eq!(passed.into_inner(), 5);
    }

    #[test]
    fn the_lockout_table_is_bounded() {
        let l = Lockout::default();
        let w = Duration::from_secs(900);
        for i in 0..MAX_LOCKOUT_NAMES + 50 {
            l.attempt(&format!("u{i}"), 5, w).unwrap();
        }
        assert!(l.failures.lock().unwrap().len() <= MAX_LOCKOUT_NAMES);
    }

    #[test]
    fn cookies_parse() {
        let mut h = HeaderMap::new();
        h.insert(header::COOKIE, "a=1; engram_session=xyz".parse().unwrap());
        assert_eq!(cookie(&h, "engram_session"), Some("xyz"));
        assert_eq!(cookie(&h, "b"), None);
        assert!(same_secret("abc", "abc") && !same_secret("abc", "abd"));
    }
}
