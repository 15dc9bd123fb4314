//! Sign-in (with lockout), sign-out, the language switch and the redirects to the console.

use std::net::SocketAddr;

use askama::Template;
use axum::extract::{ConnectInfo, Form, Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde::Deserialize;

use crate::api::AppState;
use crate::console::i18n::{Catalog, Lang, LANG_COOKIE};
use crate::console::session::{
    cookie, is_tls, random_token, same_secret, set_cookie, SESSION_COOKIE, SESSION_MAX_AGE,
    SIGNIN_COOKIE,
};
use crate::console::users::valid_name;
use crate::console::view::{html_status, lang_of, see_other, Viewer};

#[derive(Template)]
#[template(path = "signin.html", config = "../../web/askama.toml")]
struct SignInPage {
    t: &'static Catalog,
    lang: &'static str,
    csrf: String,
    next: String,
    name: String,
    error: Option<String>,
}

#[derive(Deserialize)]
pub struct NextQuery {
    #[serde(default)]
    next: String,
}

/// Only console paths may be a redirect target (no open redirect).
fn safe_next(next: &str) -> &str {
    if next.starts_with("/console/") && !next.contains("//") && !next.contains('\\') {
        next
    } else {
        "/console/"
    }
}

fn render(
    headers: &HeaderMap,
    status: StatusCode,
    next: &str,
    name: &str,
    error: Option<String>,
) -> Response {
    let lang = lang_of(headers);
    // The browser's pending token when it has one, so two open sign-in tabs both work.
    let token = cookie(headers, SIGNIN_COOKIE)
        .filter(|t| t.len() == 64 && t.bytes().all(|b| b.is_ascii_hexdigit()))
        .map_or_else(random_token, str::to_owned);
    let mut res = html_status(
        status,
        &SignInPage {
            t: lang.catalog(),
            lang: lang.tag(),
            csrf: token.clone(),
            next: safe_next(next).to_owned(),
            name: name.to_owned(),
            error,
        },
    );
    let c = set_cookie(SIGNIN_COOKIE, &token, None, is_tls(headers));
    res.headers_mut()
        .append(header::SET_COOKIE, c.parse().expect("cookie value"));
    res
}

/// `GET /console/signin`.
pub async fn page(headers: HeaderMap, Query(q): Query<NextQuery>) -> Response {
    render(&headers, StatusCode::OK, &q.next, "", None)
}

#[derive(Deserialize)]
pub struct SignInForm {
    #[serde(default)]
    name: String,
    #[serde(default)]
    password: String,
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    next: String,
}

/// `POST /console/signin`: double-submit CSRF check, lockout, argon2 verification, session.
pub async fn sign_in(
    State(s): State<AppState>,
    ConnectInfo(addr): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Form(f): Form<SignInForm>,
) -> Response {
    let t = lang_of(&headers).catalog();
    let ip = addr.ip().to_string();
    let c = &s.console;
    // The token is one of ours (64 hex digits) in both places: an empty cookie and an empty
    // field are not a match.
    let ok_csrf = f.csrf.len() == 64
        && cookie(&headers, SIGNIN_COOKIE).is_some_and(|k| same_secret(k, &f.csrf));
    if !ok_csrf {
        return render(
            &headers,
            StatusCode::FORBIDDEN,
            &f.next,
            "",
            Some(t.get("error.csrf").to_owned()),
        );
    }
    let failed = |name: &str| {
        render(
            &headers,
            StatusCode::UNAUTHORIZED,
            &f.next,
            name,
            Some(t.get("signin.failed").to_owned()),
        )
    };
    let name = f.name.trim().to_owned();
    if !valid_name(&name) {
        // No account can have this name: refused before any hashing, counting or auditing,
        // so arbitrary input costs nothing and is stored nowhere.
        tracing::warn!(%ip, "console sign-in with an invalid user name");
        return failed("");
    }
    // Password checks cost 19 MiB and tens of milliseconds each: a few at a time, beyond that
    // 429 (sign-in is public, so this bounds what anyone can make the appliance spend).
    let Ok(_slot) = c.verify_slots.clone().try_acquire_owned() else {
        tracing::warn!(user = %name, %ip, "console sign-in refused: verifications busy");
        return render(
            &headers,
            StatusCode::TOO_MANY_REQUESTS,
            &f.next,
            &name,
            Some(t.get("signin.busy").to_owned()),
        );
    };
    let settings = c.settings.get();
    let attempts =
        match c
            .lockout
            .attempt(&name, settings.lockout_failures, settings.lockout_window())
        {
            Ok(n) => n,
            Err(left) => {
                // Logged, not audited: the lock itself was audited once (`account_locked`).
                tracing::warn!(user = %name, %ip, "console sign-in refused: account locked");
                let minutes = left.as_secs().div_ceil(60).max(1);
                return render(
                    &headers,
                    StatusCode::TOO_MANY_REQUESTS,
                    &f.next,
                    &name,
                    Some(t.fmt("signin.locked", minutes)),
                );
            }
        };
    let console = s.console.clone();
    let (n, p) = (name.clone(), f.password.clone());
    let verified = tokio::task::spawn_blocking(move || console.users.verify(&n, &p))
        .await
        .ok()
        .and_then(|r| {
            r.map_err(|e| tracing::error!("reading the console accounts: {e}"))
                .ok()
        })
        .flatten();
    let Some(user) = verified else {
        tracing::warn!(user = %name, %ip, attempts, "console sign-in failed");
        c.audit.record(&name, "signin_failed", "", &ip);
        if attempts >= settings.lockout_failures as usize {
            tracing::warn!(user = %name, %ip, "console account locked after {attempts} failures");
            c.audit.record(&name, "account_locked", "", &ip);
        }
        return failed(&name);
    };
    c.lockout.clear(&user.name);
    let id = c.sessions.create(&user.name, user.role);
    c.audit
        .record_role(&user.name, "signin", "", user.role.name(), &ip);
    let tls = is_tls(&headers);
    let mut res = see_other(safe_next(&f.next));
    let h = res.headers_mut();
    h.append(
        header::SET_COOKIE,
        set_cookie(SESSION_COOKIE, &id, Some(SESSION_MAX_AGE.as_secs()), tls)
            .parse()
            .expect("cookie value"),
    );
    h.append(
        header::SET_COOKIE,
        set_cookie(SIGNIN_COOKIE, "", Some(0), tls)
            .parse()
            .expect("cookie value"),
    );
    res
}

/// `POST /console/signout`.
pub async fn sign_out(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    headers: HeaderMap,
) -> Response {
    s.console.sessions.remove(&v.session);
    s.console.audit.record(&v.user, "signout", "", &v.ip);
    let mut res = see_other("/console/signin");
    res.headers_mut().append(
        header::SET_COOKIE,
        set_cookie(SESSION_COOKIE, "", Some(0), is_tls(&headers))
            .parse()
            .expect("cookie value"),
    );
    res
}

#[derive(Deserialize)]
pub struct BackQuery {
    #[serde(default)]
    back: String,
}

/// `GET /console/lang/{tag}?back=...`: remembers the language for a year (a preference,
/// no state change, so a plain link works on every page including sign-in).
pub async fn switch_lang(
    headers: HeaderMap,
    Path(tag): Path<String>,
    Query(q): Query<BackQuery>,
) -> Response {
    let lang = Lang::from_tag(&tag).unwrap_or(Lang::En);
    let mut res = see_other(safe_next(&q.back));
    res.headers_mut().append(
        header::SET_COOKIE,
        set_cookie(
            LANG_COOKIE,
            lang.tag(),
            Some(365 * 86_400),
            is_tls(&headers),
        )
        .parse()
        .expect("cookie value"),
    );
    res
}

/// `/` and `/console`: the console.
pub async fn to_console() -> impl IntoResponse {
    see_other("/console/")
}
