//! What every page shares: the signed-in viewer, the page chrome (catalog, navigation,
//! CSRF token, language switch), HTML responses, error pages and small formatters.

use askama::Template;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};

use super::i18n::{Catalog, Lang, LANG_COOKIE};
use super::session::cookie;
use super::users::Role;
use crate::error::ApiError;

/// The signed-in user of a request, put in its extensions by the session guard.
#[derive(Clone, Debug)]
pub struct Viewer {
    pub user: String,
    pub role: Role,
    pub csrf: String,
    pub session: String,
    pub lang: Lang,
    /// The client address, for the audit log.
    pub ip: String,
}

impl Viewer {
    pub fn is_admin(&self) -> bool {
        self.role == Role::Admin
    }

    /// The chrome of a page in navigation section `nav` with the title `title_key`.
    pub fn chrome(&self, nav: &'static str, title_key: &str, path: &str) -> Chrome {
        let t = self.lang.catalog();
        Chrome {
            t,
            lang: self.lang.tag(),
            user: self.user.clone(),
            role: t.get(&format!("role.{}", self.role.name())).to_owned(),
            admin: self.is_admin(),
            csrf: self.csrf.clone(),
            nav,
            title: t.get(title_key).to_owned(),
            back: enc(path),
            flash: None,
        }
    }
}

/// The frame around every signed-in page (`web/templates/base.html`).
pub struct Chrome {
    pub t: &'static Catalog,
    pub lang: &'static str,
    pub user: String,
    /// The role's display name.
    pub role: String,
    pub admin: bool,
    pub csrf: String,
    /// The active navigation entry.
    pub nav: &'static str,
    pub title: String,
    /// This page's path and query, percent-encoded: where the language switch comes back to.
    pub back: String,
    /// A one-line notice (`?ok=<key>` after a redirect), already translated.
    pub flash: Option<String>,
}

impl Chrome {
    /// Shows the notice named by a `flash.*` catalog key (other keys are ignored, so a
    /// crafted link cannot show arbitrary text).
    pub fn with_flash(mut self, key: Option<&str>) -> Chrome {
        if let Some(k) = key.filter(|k| k.starts_with("flash.")) {
            let s = self.t.get(k);
            if s != k {
                self.flash = Some(s.to_owned());
            }
        }
        self
    }

    /// Whether `nav` is the active section (for the navigation's `class`).
    pub fn is(&self, nav: &str) -> bool {
        self.nav == nav
    }
}

/// The request's language: the switch's cookie, else `Accept-Language`, else English.
pub fn lang_of(headers: &HeaderMap) -> Lang {
    cookie(headers, LANG_COOKIE)
        .and_then(Lang::from_tag)
        .or_else(|| {
            headers
                .get(header::ACCEPT_LANGUAGE)
                .and_then(|v| v.to_str().ok())
                .and_then(Lang::negotiate)
        })
        .unwrap_or(Lang::En)
}

/// Renders a template as an HTML response that no cache keeps.
pub fn html(t: &impl Template) -> Response {
    html_status(StatusCode::OK, t)
}

pub fn html_status(status: StatusCode, t: &impl Template) -> Response {
    match t.render() {
        Ok(body) => (
            status,
            [
                (header::CONTENT_TYPE, "text/html; charset=utf-8"),
                (header::CACHE_CONTROL, "no-store"),
            ],
            body,
        )
            .into_response(),
        Err(e) => {
            tracing::error!("rendering a console page: {e}");
            (StatusCode::INTERNAL_SERVER_ERROR, "template error").into_response()
        }
    }
}

/// 303 to a console path (after a POST, so a reload does not repeat it).
pub fn see_other(to: &str) -> Response {
    Redirect::to(to).into_response()
}

/// A handler's failure: status and a message, rendered as a full error page (with the
/// viewer's chrome) by the session guard.
#[derive(Clone, Debug)]
pub struct Failure {
    pub status: StatusCode,
    /// A catalog key (`error.*`) or, for errors from below, their own text.
    pub message: String,
}

impl Failure {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Failure {
        Failure {
            status,
            message: message.into(),
        }
    }

    pub fn forbidden() -> Failure {
        Failure::new(StatusCode::FORBIDDEN, "error.forbidden")
    }

    pub fn not_found() -> Failure {
        Failure::new(StatusCode::NOT_FOUND, "error.not_found")
    }
}

impl From<ApiError> for Failure {
    fn from(e: ApiError) -> Failure {
        Failure::new(e.status(), e.to_string())
    }
}

impl From<engram_kb::KbError> for Failure {
    fn from(e: engram_kb::KbError) -> Failure {
        Failure::from(ApiError::from(e))
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let mut r = self.status.into_response();
        r.extensions_mut().insert(self);
        r
    }
}

/// The error page.
#[derive(Template)]
#[template(path = "error.html", config = "../../web/askama.toml")]
pub struct ErrorPage {
    pub c: Chrome,
    pub status: u16,
    pub message: String,
}

/// Renders a [`Failure`] for `viewer`.
pub fn error_page(viewer: &Viewer, f: &Failure) -> Response {
    let mut c = viewer.chrome("", "error.title", "/console/");
    c.title = format!("{} {}", f.status.as_u16(), c.t.get("error.title"));
    let message = c.t.get(&f.message).to_owned();
    html_status(
        f.status,
        &ErrorPage {
            c,
            status: f.status.as_u16(),
            message,
        },
    )
}

/// One page of a list shown `per_page` items at a time: the page asked for (1-based, clamped to
/// the pages there are), where it starts, and links to its neighbours.
pub struct Pager {
    /// Items before this page.
    pub offset: usize,
    pub prev_href: Option<String>,
    pub next_href: Option<String>,
}

impl Pager {
    /// `href(n)` is the address of page `n`.
    pub fn new(
        total: usize,
        per_page: usize,
        asked: Option<usize>,
        href: impl Fn(usize) -> String,
    ) -> Pager {
        let pages = total.div_ceil(per_page).max(1);
        let page = asked.unwrap_or(1).clamp(1, pages);
        Pager {
            offset: (page - 1) * per_page,
            prev_href: (page > 1).then(|| href(page - 1)),
            next_href: (page < pages).then(|| href(page + 1)),
        }
    }
}

/// `2026-11-21 14:20:05` (UTC) from milliseconds since the epoch.
pub fn datetime(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// `2026-11-21 14:20:05.123` (UTC): stage timestamps, where steps take milliseconds.
pub fn datetime_ms(ms: u64) -> String {
    format!("{}.{:03}", datetime(ms), ms % 1000)
}

/// `1.5 GiB`, `320 MiB`, `12 KiB`, `900 B`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Percent-encodes a path segment or query value.
pub fn enc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn formats() {
        assert_eq!(super::datetime(0), "1970-01-01 00:00:00");
        assert_eq!(super::datetime(1_795_277_205_000), "2026-11-21 16:06:45");
        assert_eq!(super::bytes(1536), "1.5 KiB");
        assert_eq!(super::enc("a b/é"), "a%20b%2F%C3%A9");
    }
}
