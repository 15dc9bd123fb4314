//! The admin console against a real `engramd` (real models from `$ENGRAM_MODELS_DIR`, default
//! `<workspace>/models`; a temporary data directory), over plain HTTP/1.1 with cookies.
//!
//! One server serves every test; it starts with three console accounts: `root` (admin),
//! `watcher` (operator) and `locky` (admin, used only by the lockout test).
//!
//! - sessions: every page but sign-in redirects to sign-in without a session;
//! - sign-in: right and wrong passwords, lockout after repeated failures, sign-out; an empty
//!   token, an impossible user name or an oversized body cost nothing; an account deleted
//!   from the command line is signed out at its next request;
//! - CSRF: a POST without or with a wrong token is 403;
//! - roles: an operator reads pages but gets 403 on every change (keys, settings, users,
//!   knowledge bases, uploads, document actions);
//! - a malformed form gets the console's error page, not axum's plain text;
//! - languages: the catalogs have the same keys; `Accept-Language: zh-CN` gets Chinese;
//! - without script: a knowledge base, a multipart upload, a retrieval test and a chat answer
//!   through plain forms; deleting a knowledge base needs its name typed.

mod common;

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use engram_server::console::{Role, UserStore, EN_SOURCE, ZH_CN_SOURCE};

const ADMIN_PW: &str = "root password 123";
const OPERATOR_PW: &str = "watcher password 456";
const LOCKY_PW: &str = "locky password 789";

struct Server {
    addr: SocketAddr,
    dir: tempfile::TempDir,
}

fn server() -> &'static Server {
    static SERVER: OnceLock<Server> = OnceLock::new();
    SERVER.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let users = UserStore::new(dir.path());
        users.create("root", Role::Admin, ADMIN_PW).unwrap();
        users
            .create("watcher", Role::Operator, OPERATOR_PW)
            .unwrap();
        users.create("locky", Role::Admin, LOCKY_PW).unwrap();
        let addr = common::start_daemon(
            "[limits]\nmax_tokens = 16\n[kv]\ndram_mib = 64\nnvme_gib = 1\n\
                 [storage]\nreserve_mib = 16\n",
            dir.path(),
        );
        Server { addr, dir }
    })
}

struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
    /// The body's bytes (an archive).
    bytes: Vec<u8>,
}

impl Resp {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The value a `Set-Cookie` header gives `name`.
    fn cookie(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case("set-cookie"))
            .find_map(|(_, v)| {
                let first = v.split(';').next()?;
                let (k, val) = first.split_once('=')?;
                (k == name).then(|| val.to_owned())
            })
    }

    /// The value of the first hidden `csrf` field (or the page's csrf meta tag).
    fn csrf(&self) -> String {
        for pat in ["name=\"csrf\" value=\"", "name=\"csrf-token\" content=\""] {
            if let Some(at) = self.body.find(pat) {
                let rest = &self.body[at + pat.len()..];
                return rest[..rest.find('"').unwrap()].to_owned();
            }
        }
        panic!("no csrf token in {}", self.body)
    }
}

/// One request with `Connection: close`; `cookies` as a `Cookie` header value; `form` as a
/// urlencoded body.
fn request(
    method: &str,
    path: &str,
    cookies: &str,
    extra: &[(&str, &str)],
    form: Option<&str>,
) -> Resp {
    let body = form.map(|f| {
        (
            "application/x-www-form-urlencoded".to_owned(),
            f.as_bytes().to_vec(),
        )
    });
    request_raw(method, path, cookies, extra, body)
}

fn request_raw(
    method: &str,
    path: &str,
    cookies: &str,
    extra: &[(&str, &str)],
    body: Option<(String, Vec<u8>)>,
) -> Resp {
    let mut headers: Vec<(&str, &str)> = Vec::new();
    if !cookies.is_empty() {
        headers.push(("Cookie", cookies));
    }
    headers.extend_from_slice(extra);
    let (ct, bytes) = body.map_or((String::new(), None), |(ct, b)| (ct, Some(b)));
    let r = common::send(
        server().addr,
        method,
        path,
        &headers,
        bytes.map(|b| (ct.as_str(), b)),
    );
    Resp {
        status: r.status,
        headers: r.headers,
        body: String::from_utf8_lossy(&r.body).into_owned(),
        bytes: r.body,
    }
}

/// A JSON POST to the API with an admin key (made once in the test server's data directory),
/// to set up what the console shows.
fn api(path: &str, body: serde_json::Value) -> Resp {
    static KEY: OnceLock<String> = OnceLock::new();
    let key = KEY.get_or_init(|| {
        engram_server::KeyStore::new(server().dir.path())
            .create(vec![engram_server::Scope::Admin], None)
            .unwrap()
            .1
    });
    request_raw(
        "POST",
        path,
        "",
        &[("Authorization", &format!("Bearer {key}"))],
        Some(("application/json".into(), body.to_string().into_bytes())),
    )
}

fn form_encode(pairs: &[(&str, &str)]) -> String {
    pairs
        .iter()
        .map(|(k, v)| {
            let enc: String = v
                .bytes()
                .map(|b| {
                    if b.is_ascii_alphanumeric() {
                        (b as char).to_string()
                    } else {
                        format!("%{b:02X}")
                    }
                })
                .collect();
            format!("{k}={enc}")
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// Posts the sign-in form the way a browser does (token from the page, cookie kept).
fn try_sign_in(name: &str, password: &str) -> Resp {
    try_sign_in_with(name, password, &[])
}

fn try_sign_in_with(name: &str, password: &str, extra: &[(&str, &str)]) -> Resp {
    let page = request("GET", "/console/signin", "", &[], None);
    assert_eq!(page.status, 200);
    let pre = page.cookie("engram_signin").expect("a sign-in cookie");
    let body = form_encode(&[
        ("name", name),
        ("password", password),
        ("csrf", &page.csrf()),
        ("next", "/console/"),
    ]);
    request(
        "POST",
        "/console/signin",
        &format!("engram_signin={pre}"),
        extra,
        Some(&body),
    )
}

/// A signed-in session: its cookie header value and CSRF token.
struct Session {
    cookie: String,
    csrf: String,
}

fn sign_in(name: &str, password: &str) -> Session {
    let r = try_sign_in(name, password);
    assert_eq!(r.status, 303, "{}", r.body);
    let id = r.cookie("engram_session").expect("a session cookie");
    let set = r
        .headers
        .iter()
        .find(|(k, v)| k.eq_ignore_ascii_case("set-cookie") && v.starts_with("engram_session="))
        .unwrap()
        .1
        .clone();
    assert!(
        set.contains("HttpOnly") && set.contains("SameSite=Strict"),
        "{set}"
    );
    let cookie = format!("engram_session={id}");
    let page = request("GET", "/console/", &cookie, &[], None);
    assert_eq!(page.status, 200, "{}", page.body);
    Session {
        csrf: page.csrf(),
        cookie,
    }
}

/// Creates the knowledge base `name` through the console form.
fn create_kb(s: &Session, name: &str) {
    let r = request(
        "POST",
        "/console/kb",
        &s.cookie,
        &[],
        Some(&form_encode(&[("name", name), ("csrf", &s.csrf)])),
    );
    assert_eq!(r.status, 303, "{}", r.body);
}

/// The knowledge base's page (as `cookie` sees it) once its only document has reached `stage`
/// (`done` or `failed`); reaching the other one fails the test.
fn documents_when(cookie: &str, kb: &str, stage: &str) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    loop {
        let page = request("GET", &format!("/console/kb/{kb}"), cookie, &[], None).body;
        if page.contains(&format!("data-stage=\"{stage}\"")) {
            return page;
        }
        let other = if stage == "done" { "failed" } else { "done" };
        assert!(!page.contains(&format!("data-stage=\"{other}\"")), "{page}");
        assert!(std::time::Instant::now() < deadline, "never {stage}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn pages_need_a_session() {
    for path in [
        "/console/",
        "/console/kb",
        "/console/retrieval",
        "/console/chat",
        "/console/keys",
        "/console/users",
        "/console/settings",
        "/console/audit",
    ] {
        let r = request("GET", path, "", &[], None);
        assert_eq!(r.status, 303, "{path}");
        let to = r.header("location").unwrap();
        assert!(to.starts_with("/console/signin?next="), "{path} -> {to}");
    }
    // A made-up session id is no session.
    let r = request("GET", "/console/", "engram_session=00ff", &[], None);
    assert_eq!(r.status, 303);
    // `/` leads to the console.
    let r = request("GET", "/", "", &[], None);
    assert_eq!(r.header("location"), Some("/console/"));
}

#[test]
fn sign_in_works_and_a_wrong_password_fails() {
    let s = sign_in("root", ADMIN_PW);
    let page = request("GET", "/console/kb", &s.cookie, &[], None);
    assert_eq!(page.status, 200);
    assert!(page.body.contains("root"), "the user is shown");
    let missing = request("GET", "/console/no/such/page", &s.cookie, &[], None);
    assert_eq!(missing.status, 404);
    assert!(missing.body.contains("<html") && missing.body.contains("Not found"));
    // Behind a TLS proxy the cookie is Secure.
    let tls = try_sign_in_with("root", ADMIN_PW, &[("X-Forwarded-Proto", "https")]);
    assert_eq!(tls.status, 303);
    assert!(tls
        .headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("set-cookie")
            && v.starts_with("engram_session=")
            && v.contains("; Secure")));
    let r = try_sign_in("root", "not the password");
    assert_eq!(r.status, 401);
    assert!(r.cookie("engram_session").is_none());
    assert!(r.body.contains("Wrong user name or password"));
    let r = try_sign_in("nobody", "not the password");
    assert_eq!(r.status, 401);
    // The sign-in form itself needs its token.
    let r = request(
        "POST",
        "/console/signin",
        "",
        &[],
        Some(&form_encode(&[("name", "root"), ("password", ADMIN_PW)])),
    );
    assert_eq!(r.status, 403);
    // An empty token in the cookie and in the form is no token.
    let r = request(
        "POST",
        "/console/signin",
        "engram_signin=",
        &[],
        Some(&form_encode(&[
            ("name", "root"),
            ("password", ADMIN_PW),
            ("csrf", ""),
        ])),
    );
    assert_eq!(r.status, 403);
    // A name no account can have is refused before any work, and counts for no lockout.
    let long = "x".repeat(5000);
    for _ in 0..6 {
        assert_eq!(try_sign_in(&long, "whatever").status, 401);
    }
    let audit = std::fs::read_to_string(server().dir.path().join("audit.jsonl")).unwrap();
    assert!(!audit.contains(&long[..100]), "not audited");
    // The public routes take small bodies only.
    let page = request("GET", "/console/signin", "", &[], None);
    let pre = page.cookie("engram_signin").unwrap();
    let big = form_encode(&[("name", &"y".repeat(64 << 10)), ("csrf", &page.csrf())]);
    let r = request(
        "POST",
        "/console/signin",
        &format!("engram_signin={pre}"),
        &[],
        Some(&big),
    );
    assert_eq!(r.status, 413);
    // Sign-out ends the session.
    let out = request(
        "POST",
        "/console/signout",
        &s.cookie,
        &[],
        Some(&form_encode(&[("csrf", &s.csrf)])),
    );
    assert_eq!(out.status, 303);
    let r = request("GET", "/console/", &s.cookie, &[], None);
    assert_eq!(r.status, 303, "signed out");
}

#[test]
fn repeated_failures_lock_the_account() {
    for i in 0..5 {
        let r = try_sign_in("locky", "wrong password");
        assert_eq!(r.status, 401, "attempt {i}");
    }
    let r = try_sign_in("locky", LOCKY_PW);
    assert_eq!(r.status, 429, "locked even with the right password");
    assert!(r.body.contains("locked"), "{}", r.body);
    let audit = std::fs::read_to_string(server().dir.path().join("audit.jsonl")).unwrap();
    assert!(audit.contains("\"signin_failed\"") && audit.contains("\"account_locked\""));
    // Other accounts are not affected.
    sign_in("root", ADMIN_PW);
}

#[test]
fn posts_need_the_csrf_token() {
    let s = sign_in("root", ADMIN_PW);
    let missing = request(
        "POST",
        "/console/kb",
        &s.cookie,
        &[],
        Some(&form_encode(&[("name", "csrf-missing")])),
    );
    assert_eq!(missing.status, 403);
    assert!(missing.body.contains("security token"), "a clear page");
    let wrong = request(
        "POST",
        "/console/kb",
        &s.cookie,
        &[],
        Some(&form_encode(&[("name", "csrf-wrong"), ("csrf", "00")])),
    );
    assert_eq!(wrong.status, 403);
    // Another session's token is wrong too.
    let other = sign_in("root", ADMIN_PW);
    let r = request(
        "POST",
        "/console/settings",
        &s.cookie,
        &[("X-CSRF-Token", &other.csrf)],
        Some("session_idle_minutes=30&lockout_failures=5&lockout_minutes=15&chat_max_tokens=8"),
    );
    assert_eq!(r.status, 403);
    let ok = request(
        "POST",
        "/console/kb",
        &s.cookie,
        &[],
        Some(&form_encode(&[("name", "csrf-ok"), ("csrf", &s.csrf)])),
    );
    assert_eq!(ok.status, 303, "{}", ok.body);
    let list = request("GET", "/console/kb", &s.cookie, &[], None);
    assert!(list.body.contains("csrf-ok") && !list.body.contains("csrf-wrong"));
}

#[test]
fn operators_cannot_change_keys_or_settings() {
    let op = sign_in("watcher", OPERATOR_PW);
    for path in [
        "/console/keys",
        "/console/settings",
        "/console/users",
        "/console/audit",
    ] {
        let r = request("GET", path, &op.cookie, &[], None);
        assert_eq!(r.status, 200, "{path}");
    }
    let key = request(
        "POST",
        "/console/keys",
        &op.cookie,
        &[],
        Some(&form_encode(&[("scopes", "search"), ("csrf", &op.csrf)])),
    );
    assert_eq!(key.status, 403);
    assert!(key.body.contains("read-only"), "{}", key.body);
    let settings = request(
        "POST",
        "/console/settings",
        &op.cookie,
        &[],
        Some(&form_encode(&[
            ("session_idle_minutes", "60"),
            ("lockout_failures", "5"),
            ("lockout_minutes", "15"),
            ("chat_max_tokens", "8"),
            ("csrf", &op.csrf),
        ])),
    );
    assert_eq!(settings.status, 403);
    // Every other change: whether or not its target exists, the role check answers first.
    for (path, body) in [
        ("/console/kb", "name=op-made"),
        (
            "/console/users",
            "name=op2&role=admin&password=aaaaaaaaaaaaaaaa",
        ),
        ("/console/users/root/delete", ""),
        ("/console/keys/abcdefgh/revoke", ""),
        ("/console/kb/handbook/delete", "confirm=handbook"),
        ("/console/kb/handbook/upload", ""),
        ("/console/kb/handbook/doc/1/reindex", ""),
        ("/console/kb/handbook/doc/1/cancel", ""),
        ("/console/kb/handbook/doc/1/delete", ""),
        ("/console/backup", "kv=1"),
    ] {
        let r = request(
            "POST",
            path,
            &op.cookie,
            &[],
            Some(&format!("{body}&csrf={}", op.csrf)),
        );
        assert_eq!(r.status, 403, "{path}");
    }
    // An admin may: the key is shown once, and a revocation removes it.
    let admin = sign_in("root", ADMIN_PW);
    // A refused form comes back as the form, its message on it and the name as typed.
    let create_key = |fields: &[(&str, &str)]| {
        let mut fields = fields.to_vec();
        fields.push(("csrf", &admin.csrf));
        request(
            "POST",
            "/console/keys",
            &admin.cookie,
            &[],
            Some(&form_encode(&fields)),
        )
    };
    let refused = create_key(&[("name", "nightly eval")]);
    assert_eq!(refused.status, 422, "{}", refused.body);
    let form = &refused.body[refused.body.find("id=\"key-form\"").expect("the form")..];
    assert!(
        form.contains("form-error") && form.contains("Choose at least one scope"),
        "{form}"
    );
    assert!(form.contains("value=\"nightly eval\""), "{form}");
    let r = create_key(&[("name", "nightly eval"), ("scopes", "search")]);
    // Post/redirect/get: the key is kept in the session and shown by the next page, once,
    // so reloading that page creates no second key and shows the secret no more.
    assert_eq!(r.status, 303);
    assert_eq!(
        r.header("location"),
        Some("/console/keys?ok=flash.key_created")
    );
    let shown = request(
        "GET",
        "/console/keys?ok=flash.key_created",
        &admin.cookie,
        &[],
        None,
    );
    assert_eq!(shown.status, 200);
    let at = shown.body.find("egk_").expect("the new key is shown");
    let key = shown.body[at..]
        .split('<')
        .next()
        .unwrap()
        .trim()
        .to_owned();
    let id = key[4..12].to_owned();
    let again = request(
        "GET",
        "/console/keys?ok=flash.key_created",
        &admin.cookie,
        &[],
        None,
    );
    assert!(!again.body.contains(&key), "the secret is shown once");
    assert!(!again.body.contains("new-key-value"));
    let id = id.as_str();
    // Its row: the name, and "never" until the key is used; then when it was.
    let row = |body: &str| {
        let at = body
            .find(&format!("data-key=\"{id}\""))
            .expect("the key's row");
        body[at..body[at..].find("</tr>").unwrap() + at].to_owned()
    };
    let listed = row(&again.body);
    assert!(
        listed.contains("nightly eval") && listed.contains("never"),
        "{listed}"
    );
    let used = request(
        "GET",
        "/api/v1/collections",
        "",
        &[("Authorization", &format!("Bearer {key}"))],
        None,
    );
    assert_eq!(used.status, 200, "{}", used.body);
    let listed = row(&request("GET", "/console/keys", &admin.cookie, &[], None).body);
    assert!(!listed.contains("never"), "{listed}");
    let revoke = request(
        "POST",
        &format!("/console/keys/{id}/revoke"),
        &admin.cookie,
        &[],
        Some(&form_encode(&[("csrf", &admin.csrf)])),
    );
    assert_eq!(revoke.status, 303);
    let keys = std::fs::read_to_string(server().dir.path().join("keys.json")).unwrap();
    assert!(!keys.contains(id));
}

#[test]
fn an_account_deleted_on_the_command_line_is_signed_out() {
    let users = UserStore::new(server().dir.path());
    users
        .create("leaver", Role::Operator, "leaver password 000")
        .unwrap();
    let s = sign_in("leaver", "leaver password 000");
    // What `engramd users delete` does: the file changes under the running daemon.
    users.delete("leaver").unwrap();
    let r = request("GET", "/console/", &s.cookie, &[], None);
    assert_eq!(r.status, 303, "signed out");
    assert!(r.header("location").unwrap().starts_with("/console/signin"));
}

#[test]
fn a_malformed_form_gets_the_error_page() {
    let s = sign_in("root", ADMIN_PW);
    let r = request(
        "POST",
        "/console/kb",
        &s.cookie,
        &[],
        Some(&form_encode(&[
            ("name", "bad-form"),
            ("chunk_tokens", "many"),
            ("csrf", &s.csrf),
        ])),
    );
    assert!(matches!(r.status, 400 | 422), "{}", r.status);
    assert!(
        r.body.contains("<html") && r.body.contains("wrong kind"),
        "{}",
        r.body
    );
}

fn flat_keys(source: &str) -> Vec<String> {
    fn walk(prefix: &str, t: &toml::Table, out: &mut Vec<String>) {
        for (k, v) in t {
            let key = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            match v {
                toml::Value::Table(t) => walk(&key, t, out),
                _ => out.push(key),
            }
        }
    }
    let mut out = Vec::new();
    walk("", &toml::from_str(source).unwrap(), &mut out);
    out.sort();
    out
}

#[test]
fn catalogs_have_the_same_keys() {
    let en = flat_keys(EN_SOURCE);
    let zh = flat_keys(ZH_CN_SOURCE);
    let only_en: Vec<_> = en.iter().filter(|k| !zh.contains(k)).collect();
    let only_zh: Vec<_> = zh.iter().filter(|k| !en.contains(k)).collect();
    assert!(
        only_en.is_empty() && only_zh.is_empty(),
        "only in en: {only_en:?}; only in zh-CN: {only_zh:?}"
    );
    assert!(en.len() > 100);
}

#[test]
fn chinese_for_accept_language_zh_cn() {
    let r = request(
        "GET",
        "/console/signin",
        "",
        &[("Accept-Language", "zh-CN,zh;q=0.9,en;q=0.8")],
        None,
    );
    assert_eq!(r.status, 200);
    assert!(r.body.contains("<html lang=\"zh-CN\">") && r.body.contains("登录"));
    let r = request(
        "GET",
        "/console/signin",
        "",
        &[("Accept-Language", "en-US")],
        None,
    );
    assert!(r.body.contains("<html lang=\"en\">") && r.body.contains("Sign in"));
    let s = sign_in("root", ADMIN_PW);
    let zh = [("Accept-Language", "zh-CN")];
    let r = request("GET", "/console/", &s.cookie, &zh, None);
    assert!(r.body.contains("仪表盘"), "dashboard in Chinese");
    // Where generation runs (the CPU here), in either language.
    assert!(r.body.contains("生成运行于</dt><dd>CPU"), "{}", r.body);
    let en = request(
        "GET",
        "/console/",
        &s.cookie,
        &[("Accept-Language", "en")],
        None,
    );
    assert!(
        en.body.contains("Generation runs on</dt><dd>CPU"),
        "{}",
        en.body
    );
    // The switch's cookie wins over the header.
    let sw = request("GET", "/console/lang/en?back=%2Fconsole%2F", "", &[], None);
    let lang = sw.cookie("engram_lang").unwrap();
    assert_eq!(lang, "en");
    let r = request(
        "GET",
        "/console/",
        &format!("{}; engram_lang=en", s.cookie),
        &zh,
        None,
    );
    assert!(r.body.contains("Dashboard") && !r.body.contains("仪表盘"));
}

/// A refused form comes back as the page with the form, its message on it (from the catalog,
/// in the viewer's language) and what was typed, with 422: no dead-end error page.
#[test]
fn refused_forms_stay_on_the_form_in_the_viewers_language() {
    let s = sign_in("root", ADMIN_PW);
    let kb = |lang: &str, pairs: &[(&str, &str)]| {
        let mut pairs = pairs.to_vec();
        pairs.push(("csrf", &s.csrf));
        request(
            "POST",
            "/console/kb",
            &format!("{}; engram_lang={lang}", s.cookie),
            &[],
            Some(&form_encode(&pairs)),
        )
    };
    let form_of = |body: &str| {
        let at = body.find("form-error").expect("a message on the form");
        body[at..].to_owned()
    };
    let r = kb("en", &[("name", ".hidden"), ("chunk_tokens", "300")]);
    assert_eq!(r.status, 422, "{}", r.body);
    let form = form_of(&r.body);
    assert!(form.contains("does not start with"), "{form}");
    assert!(
        form.contains("value=\".hidden\"") && form.contains("value=\"300\""),
        "{form}"
    );
    let r = kb("zh-CN", &[("name", ".hidden")]);
    assert_eq!(r.status, 422);
    assert!(form_of(&r.body).contains("知识库名称"), "{}", r.body);
    let r = kb("zh-CN", &[("name", "big-chunks"), ("chunk_tokens", "9000")]);
    assert_eq!(r.status, 422);
    assert!(form_of(&r.body).contains("16–8192"), "{}", r.body);
    // A name taken already.
    assert_eq!(kb("en", &[("name", "twice")]).status, 303);
    let r = kb("en", &[("name", "twice")]);
    assert_eq!(r.status, 422);
    assert!(
        form_of(&r.body).contains("“twice” already exists"),
        "{}",
        r.body
    );
    // Users: a short password, in Chinese; the name typed is kept (the password never is).
    let r = request(
        "POST",
        "/console/users",
        &format!("{}; engram_lang=zh-CN", s.cookie),
        &[],
        Some(&form_encode(&[
            ("name", "newbie"),
            ("role", "admin"),
            ("password", "short"),
            ("csrf", &s.csrf),
        ])),
    );
    assert_eq!(r.status, 422, "{}", r.body);
    let form = form_of(&r.body);
    assert!(form.contains("密码至少需要"), "{form}");
    assert!(
        form.contains("value=\"newbie\"") && form.contains("selected"),
        "{form}"
    );
    assert!(!r.body.contains("value=\"short\""));
}

/// A request with a wrong key is no answer the generation queue dropped: the dashboard counts
/// it apart ("Generation queue: 1 rejected" was an API call with a bad key).
#[test]
fn the_dashboard_counts_refused_keys_apart_from_the_queue() {
    let s = sign_in("root", ADMIN_PW);
    let r = request_raw(
        "GET",
        "/api/v1/collections",
        "",
        &[("Authorization", "Bearer egk_not_a_key")],
        None,
    );
    assert_eq!(r.status, 401, "{}", r.body);
    let page = request("GET", "/console/", &s.cookie, &[], None);
    assert_eq!(page.status, 200);
    let stat = |id: &str| {
        let at = page.body.find(&format!("id=\"{id}\">")).expect(id) + id.len() + 6;
        page.body[at..at + page.body[at..].find('<').unwrap()].to_owned()
    };
    let refused: u64 = stat("auth-refused")
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(refused >= 1, "{}", stat("auth-refused"));
    assert_eq!(stat("queue-rejected"), "0 turned away (queue full)");
    // Whether this build can use a GPU, and why it does not here (no driver on a CI box).
    let gpu = stat("gpu-support");
    if cfg!(feature = "cuda") {
        assert_eq!(
            gpu.trim(),
            "compiled in (CUDA, loaded at run time)",
            "{gpu}"
        );
    } else {
        assert_eq!(gpu.trim(), "not compiled in", "{gpu}");
    }
}

/// The chat playground and the audit log in Chinese: a question with no knowledge base ticked
/// is explained in the viewer's language (it was the API's English message), and an account's
/// role is named in it (it was stored as "ops (operator)").
#[test]
fn the_playground_and_the_audit_log_speak_the_viewers_language() {
    let s = sign_in("root", ADMIN_PW);
    let zh = format!("{}; engram_lang=zh-CN", s.cookie);
    let r = request(
        "POST",
        "/console/chat/stream",
        &zh,
        &[("X-CSRF-Token", &s.csrf)],
        Some(&form_encode(&[
            ("question", "几点开门？"),
            ("csrf", &s.csrf),
        ])),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.body.contains("event: error") && r.body.contains("请至少勾选一个知识库"),
        "{}",
        r.body
    );
    let r = request(
        "POST",
        "/console/users",
        &zh,
        &[],
        Some(&form_encode(&[
            ("name", "ops-zh"),
            ("role", "operator"),
            ("password", "a long enough password 1"),
            ("csrf", &s.csrf),
        ])),
    );
    assert_eq!(r.status, 303, "{}", r.body);
    let page = request("GET", "/console/audit", &zh, &[], None);
    assert!(
        page.body.contains("ops-zh (运维员（只读）)"),
        "{}",
        page.body
    );
    assert!(!page.body.contains("(operator)"), "{}", page.body);
}

/// A document that fails is explained in the viewer's language (the failure's kind from the
/// catalog), with the pipeline's own message as a detail.
#[test]
fn a_failed_document_is_explained_in_chinese() {
    let s = sign_in("root", ADMIN_PW);
    create_kb(&s, "broken");
    let r = request_raw(
        "POST",
        "/console/kb/broken/upload",
        &s.cookie,
        &[],
        Some(multipart(&s.csrf, "scan.pdf", "%PDF-1.4 this is not a PDF")),
    );
    assert_eq!(r.status, 303, "{}", r.body);
    let zh = format!("{}; engram_lang=zh-CN", s.cookie);
    let page = documents_when(&zh, "broken", "failed");
    let pat = "class=\"error-text small\">";
    let at = page.find(pat).expect("a reason") + pat.len();
    let reason = &page[at..at + page[at..].find('<').unwrap()];
    assert!(
        reason
            .chars()
            .any(|c| ('\u{4e00}'..='\u{9fff}').contains(&c)),
        "{reason}"
    );
    assert!(
        page.contains("<summary>详情</summary><div translate=\"no\">cannot parse"),
        "{page}"
    );
}

/// A multipart body with a `csrf` field and one file.
fn multipart(csrf: &str, file_name: &str, text: &str) -> (String, Vec<u8>) {
    let b = "engramtestboundary";
    let body = format!(
        "--{b}\r\nContent-Disposition: form-data; name=\"csrf\"\r\n\r\n{csrf}\r\n\
         --{b}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{file_name}\"\r\n\
         Content-Type: text/markdown\r\n\r\n{text}\r\n--{b}--\r\n"
    );
    (
        format!("multipart/form-data; boundary={b}"),
        body.into_bytes(),
    )
}

#[test]
fn documents_retrieval_and_chat_work_without_script() {
    let s = sign_in("root", ADMIN_PW);
    create_kb(&s, "nojs");
    // An operator may not upload; an upload without the token is refused too.
    let op = sign_in("watcher", OPERATOR_PW);
    let text = "# Leave\n\nEvery employee gets 25 days of paid leave per year.";
    let r = request_raw(
        "POST",
        "/console/kb/nojs/upload",
        &op.cookie,
        &[],
        Some(multipart(&op.csrf, "leave.md", text)),
    );
    assert_eq!(r.status, 403);
    let r = request_raw(
        "POST",
        "/console/kb/nojs/upload",
        &s.cookie,
        &[],
        Some(multipart("wrong", "leave.md", text)),
    );
    assert_eq!(r.status, 403);
    let r = request_raw(
        "POST",
        "/console/kb/nojs/upload",
        &s.cookie,
        &[],
        Some(multipart(&s.csrf, "leave.md", text)),
    );
    assert_eq!(r.status, 303, "{}", r.body);
    assert_eq!(
        r.header("location"),
        Some("/console/kb/nojs?ok=flash.uploaded")
    );
    let page = documents_when(&s.cookie, "nojs", "done");
    assert!(page.contains("leave.md"));
    let r = request(
        "GET",
        "/console/retrieval?q=paid+leave&mode=hybrid&top_k=3&collections=nojs",
        &s.cookie,
        &[],
        None,
    );
    assert_eq!(r.status, 200);
    assert!(r.body.contains("<mark>"), "highlighted span");
    assert!(r.body.contains("BM25") && r.body.contains("/console/kb/nojs/doc/"));
    let chat = form_encode(&[
        ("question", "How many days of paid leave?"),
        ("collections", "nojs"),
        ("policy", "boundary:4"),
        ("max_tokens", "8"),
        ("csrf", &s.csrf),
    ]);
    let r = request("POST", "/console/chat", &op.cookie, &[], Some(&chat));
    assert_eq!(r.status, 403, "another session's token");
    let r = request("POST", "/console/chat", &s.cookie, &[], Some(&chat));
    assert_eq!(r.status, 200);
    let cites = &r.body[r.body.find("id=\"citations\"").unwrap()..];
    assert!(
        cites.contains("href=\"/console/kb/nojs/doc/"),
        "a citation link"
    );
    assert!(r.body.contains("data-field=\"first_token_ms\""));
    // The prefill's rows add up to its total (each shown to 0.1 ms).
    let ms = |field: &str| -> f64 {
        let at = r
            .body
            .find(&format!("data-field=\"{field}\""))
            .expect(field);
        let cell = &r.body[at..];
        let cell = &cell[cell.find("<td>").unwrap() + 4..];
        cell[..cell
            .find(" ms")
            .unwrap_or_else(|| panic!("{field}: {}", &cell[..40]))]
            .parse()
            .unwrap()
    };
    let parts: f64 = [
        "prefix_prefill_ms",
        "kv_load_ms",
        "kv_compute_ms",
        "rank_ms",
        "recompute_ms",
        "question_prefill_ms",
        "prefill_other_ms",
    ]
    .iter()
    .map(|f| ms(f))
    .sum();
    let total = ms("prefill_total_ms");
    assert!((parts - total).abs() <= 0.35, "{parts} vs {total}");
    // Deleting needs the name typed.
    let r = request(
        "POST",
        "/console/kb/nojs/delete",
        &s.cookie,
        &[],
        Some(&form_encode(&[("confirm", "nope"), ("csrf", &s.csrf)])),
    );
    assert_eq!(r.status, 400);
    let r = request(
        "POST",
        "/console/kb/nojs/delete",
        &s.cookie,
        &[],
        Some(&form_encode(&[("confirm", "nojs"), ("csrf", &s.csrf)])),
    );
    assert_eq!(r.status, 303);
    let r = request("GET", "/console/kb/nojs", &s.cookie, &[], None);
    assert_eq!(r.status, 404);
    assert!(r.body.contains("<html"), "an HTML error page");
}

#[test]
fn an_admin_downloads_a_backup_from_the_settings_page() {
    let admin = sign_in("root", ADMIN_PW);
    let page = request("GET", "/console/settings", &admin.cookie, &[], None);
    assert!(
        page.body.contains("action=\"/console/backup\""),
        "{}",
        page.body
    );
    let r = request(
        "POST",
        "/console/backup",
        &admin.cookie,
        &[],
        Some(&form_encode(&[("csrf", &admin.csrf)])),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("content-type"), Some("application/zstd"));
    assert!(r
        .header("content-disposition")
        .is_some_and(|d| d.starts_with("attachment") && d.contains(".tar.zst")));
    // Without the token it is refused like every other change.
    let r = request("POST", "/console/backup", &admin.cookie, &[], Some(""));
    assert_eq!(r.status, 403);
    let audit = request("GET", "/console/audit", &admin.cookie, &[], None);
    assert!(audit.body.contains("Backup downloaded"), "{}", audit.body);
    // An operator's settings page offers no backup.
    let op = sign_in("watcher", OPERATOR_PW);
    let page = request("GET", "/console/settings", &op.cookie, &[], None);
    assert!(!page.body.contains("/console/backup"));
}

#[test]
fn the_settings_page_shows_the_version_and_its_history() {
    let admin = sign_in("root", ADMIN_PW);
    let page = request("GET", "/console/settings", &admin.cookie, &[], None);
    let version = engram_server::versions::version();
    assert!(
        page.body.contains(&format!(
            "<span class=\"badge mono\" id=\"version-current\">{version}</span>"
        )),
        "{}",
        page.body
    );
    // The daemon's first start on this data directory is its install.
    let table = &page.body[page.body.find("id=\"version-history\"").unwrap()..];
    let table = &table[..table.find("</table>").unwrap()];
    assert!(table.contains("installed"), "{table}");
    assert!(
        table.contains(&format!("<td class=\"mono\">{version}</td>")),
        "{table}"
    );
}

#[test]
fn an_admin_stages_a_restore_from_the_settings_page() {
    let admin = sign_in("root", ADMIN_PW);
    let page = request("GET", "/console/settings", &admin.cookie, &[], None);
    assert!(
        page.body.contains("action=\"/console/restore\""),
        "{}",
        page.body
    );
    let archive = request(
        "POST",
        "/console/backup",
        &admin.cookie,
        &[],
        Some(&form_encode(&[("csrf", &admin.csrf)])),
    );
    assert_eq!(archive.status, 200, "{}", archive.body);
    let send = |cookie: &str, token: &str, body: &[u8]| {
        request_raw(
            "POST",
            "/console/restore",
            cookie,
            &[("X-CSRF-Token", token)],
            Some(("application/zstd".into(), body.to_vec())),
        )
    };
    // The script's way: the archive as the body, the token in a header.
    let r = send(&admin.cookie, "0".repeat(64).as_str(), &archive.bytes);
    assert_eq!(r.status, 403, "a wrong token");
    let r = send(
        &admin.cookie,
        &admin.csrf,
        &archive.bytes[..archive.bytes.len() / 2],
    );
    assert_eq!(r.status, 400, "a cut-off archive: {}", r.body);
    assert!(r.body.contains("<html"), "an HTML error page");
    let r = send(&admin.cookie, &admin.csrf, &archive.bytes);
    assert_eq!(r.status, 303, "{}", r.body);
    assert_eq!(
        r.header("location"),
        Some("/console/settings?ok=flash.restore_staged")
    );
    let audit = request("GET", "/console/audit", &admin.cookie, &[], None);
    assert!(audit.body.contains("Restore staged"), "{}", audit.body);
    // Operators cannot.
    let op = sign_in("watcher", OPERATOR_PW);
    let r = send(&op.cookie, &op.csrf, &archive.bytes);
    assert_eq!(r.status, 403);
}

#[test]
fn a_long_document_shows_its_chunks_a_page_at_a_time() {
    let r = api(
        "/api/v1/collections",
        serde_json::json!({"name": "long", "chunk_tokens": 16, "overlap_tokens": 0}),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let text: String = (1..=90)
        .map(|i| format!("Line {i} of the long manual describes step number {i} in full.\n\n"))
        .collect();
    let r = api(
        "/api/v1/collections/long/documents/text",
        serde_json::json!({"name": "manual.md", "text": text}),
    );
    assert_eq!(r.status, 202, "{}", r.body);
    let admin = sign_in("root", ADMIN_PW);
    let page = |q: &str| {
        request(
            "GET",
            &format!("/console/kb/long/doc/manual.md{q}"),
            &admin.cookie,
            &[],
            None,
        )
    };
    let mut first = page("");
    for _ in 0..240 {
        if first.body.contains("id=\"chunk-pager\"") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
        first = page("");
    }
    let count = |body: &str| body.matches("<article class=\"chunk\"").count();
    assert_eq!(count(&first.body), 50, "{}", first.body);
    assert!(first.body.contains("rel=\"next\""));
    assert!(!first.body.contains("rel=\"prev\""));
    let total: usize = {
        let h2 = &first.body[first.body.find("Chunks (").unwrap() + 8..];
        h2[..h2.find(')').unwrap()].parse().unwrap()
    };
    assert!(total > 50, "{total}");
    let last_page = total.div_ceil(50);
    let last = page(&format!("?page={last_page}"));
    assert_eq!(count(&last.body), total - 50 * (last_page - 1));
    assert!(last.body.contains("rel=\"prev\"") && !last.body.contains("rel=\"next\""));
    // Out of range: the nearest page.
    assert_eq!(count(&page("?page=999").body), count(&last.body));
}

#[test]
fn the_document_list_searches_and_pages_on_the_server() {
    assert_eq!(
        api("/api/v1/collections", serde_json::json!({"name": "many"})).status,
        201
    );
    for i in 0..105 {
        let name = if i % 10 == 0 {
            format!("Invoice-{i:03}.txt")
        } else {
            format!("memo-{i:03}.txt")
        };
        let r = api(
            "/api/v1/collections/many/documents/text",
            serde_json::json!({"name": name, "text": format!("Note {i}.")}),
        );
        assert_eq!(r.status, 202, "{}", r.body);
    }
    let admin = sign_in("root", ADMIN_PW);
    let page = |q: &str| {
        request(
            "GET",
            &format!("/console/kb/many{q}"),
            &admin.cookie,
            &[],
            None,
        )
    };
    let rows = |body: &str| body.matches("<tr data-doc=").count();
    let first = page("");
    assert_eq!(rows(&first.body), 100, "a page of 100");
    assert!(first.body.contains("rel=\"next\""), "{}", first.body);
    assert_eq!(rows(&page("?page=2").body), 5);
    // The search is on the server, in any case, over every page.
    let found = page("?q=INVOICE");
    assert_eq!(rows(&found.body), 11, "{}", found.body);
    assert!(found.body.contains("data-doc=\"Invoice-100.txt\""));
    assert!(!found.body.contains("memo-"));
    let none = page("?q=nothing-like-this");
    assert_eq!(rows(&none.body), 0);
    assert!(none.body.contains("No document matches."));
}
