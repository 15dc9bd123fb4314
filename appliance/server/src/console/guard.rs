//! The gate in front of every signed-in page: a live session (else a redirect to sign-in),
//! the CSRF token on every POST (hidden form field `csrf`, or the `X-CSRF-Token` header for
//! script requests; else 403), the admin role on changes, and error pages in the viewer's
//! language. Also the security headers of every console response.

use std::net::SocketAddr;

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, FromRequest, Multipart, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::session::{cookie, same_secret, SESSION_COOKIE};
use super::view::{enc, error_page, lang_of, see_other, Failure, Viewer};
use crate::api::AppState;

/// The header script requests carry the CSRF token in.
pub const CSRF_HEADER: &str = "x-csrf-token";
/// The header of the script's background refreshes (live dashboard, documents being indexed):
/// they do not count as activity, so an unattended screen still reaches the idle timeout.
pub const LIVE_HEADER: &str = "x-engram-live";

/// Session, CSRF, error pages.
pub async fn guard(
    State(s): State<AppState>,
    ConnectInfo(addr): ConnectInfo<SocketAddr>,
    req: Request,
    next: Next,
) -> Response {
    let lang = lang_of(req.headers());
    let settings = s.console.settings.get();
    let active = !req.headers().contains_key(LIVE_HEADER);
    let session = cookie(req.headers(), SESSION_COOKIE).and_then(|id| {
        let sess = s
            .console
            .sessions
            .touch(id, settings.session_idle(), active)?;
        // The account must still exist with the same role: `engramd users delete` on the
        // command line ends its sessions at their next request. Fails closed on a bad file.
        match s.console.users.get(&sess.user) {
            Ok(Some(u)) if u.role == sess.role => Some((id.to_owned(), sess)),
            _ => {
                s.console.sessions.remove(id);
                None
            }
        }
    });
    let Some((id, sess)) = session else {
        if req.headers().contains_key(CSRF_HEADER) {
            // A script's request: a redirect would be followed silently.
            return (StatusCode::UNAUTHORIZED, "session expired; sign in again").into_response();
        }
        let next_path = if req.method() == Method::GET {
            req.uri()
                .path_and_query()
                .map_or("/console/", |p| p.as_str())
                .to_owned()
        } else {
            "/console/".to_owned()
        };
        return see_other(&format!("/console/signin?next={}", enc(&next_path)));
    };
    let viewer = Viewer {
        user: sess.user.clone(),
        role: sess.role,
        csrf: sess.csrf.clone(),
        session: id,
        lang,
        ip: addr.ip().to_string(),
    };
    let mut req = req;
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let (parts, body) = req.into_parts();
        // A token in the header is checked without reading the body, which then streams (a
        // restore's archive); in a form field it needs the body, held up to the upload limit.
        if let Some(t) = parts.headers.get(CSRF_HEADER).and_then(|v| v.to_str().ok()) {
            if !same_secret(t, &sess.csrf) {
                tracing::warn!(user = %viewer.user, ip = %viewer.ip, path = %parts.uri.path(), "console: wrong CSRF token");
                return error_page(&viewer, &Failure::new(StatusCode::FORBIDDEN, "error.csrf"));
            }
            let mut req = Request::from_parts(parts, body);
            req.extensions_mut().insert(viewer.clone());
            return finish(&viewer, next.run(req).await);
        }
        let limit = s.limits.max_upload_bytes.saturating_add(64 << 10);
        let bytes = match axum::body::to_bytes(body, limit).await {
            Ok(b) => b,
            Err(_) => {
                return error_page(
                    &viewer,
                    &Failure::new(StatusCode::PAYLOAD_TOO_LARGE, "error.too_large"),
                )
            }
        };
        let token = form_token(parts.headers.get(header::CONTENT_TYPE), &bytes).await;
        if !token.is_some_and(|t| same_secret(&t, &sess.csrf)) {
            tracing::warn!(user = %viewer.user, ip = %viewer.ip, path = %parts.uri.path(), "console: missing or wrong CSRF token");
            return error_page(&viewer, &Failure::new(StatusCode::FORBIDDEN, "error.csrf"));
        }
        req = Request::from_parts(parts, Body::from(bytes));
    }
    req.extensions_mut().insert(viewer.clone());
    finish(&viewer, next.run(req).await)
}

/// A handler's failure, or an extractor's plain-text rejection, as the console's error page.
fn finish(viewer: &Viewer, res: Response) -> Response {
    if let Some(f) = res.extensions().get::<Failure>() {
        return error_page(viewer, f);
    }
    // An extractor's rejection (a form field missing or of the wrong kind) is axum's plain
    // text: show the console's page in the viewer's language instead.
    let plain = res
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/plain"));
    if plain && matches!(res.status().as_u16(), 400 | 415 | 422) {
        return error_page(viewer, &Failure::new(res.status(), "error.bad_form"));
    }
    res
}

/// The `csrf` field of a urlencoded or multipart body.
async fn form_token(content_type: Option<&HeaderValue>, body: &Bytes) -> Option<String> {
    let ct = content_type?.to_str().ok()?;
    if ct.starts_with("application/x-www-form-urlencoded") {
        let fields: Vec<(String, String)> = serde_urlencoded::from_bytes(body).ok()?;
        return fields
            .into_iter()
            .find(|(k, _)| k == "csrf")
            .map(|(_, v)| v);
    }
    if ct.starts_with("multipart/form-data") {
        let req = Request::builder()
            .header(header::CONTENT_TYPE, ct)
            .body(Body::from(body.clone()))
            .ok()?;
        let mut mp = Multipart::from_request(req, &()).await.ok()?;
        while let Ok(Some(field)) = mp.next_field().await {
            if field.name() == Some("csrf") {
                return field.text().await.ok();
            }
        }
    }
    None
}

/// 403 for operators (read-only accounts) on every change.
pub async fn admin_only(req: Request, next: Next) -> Response {
    match req.extensions().get::<Viewer>() {
        Some(v) if v.is_admin() => next.run(req).await,
        Some(v) => {
            tracing::warn!(user = %v.user, path = %req.uri().path(), "console: an operator tried a change");
            Failure::new(StatusCode::FORBIDDEN, "error.read_only").into_response()
        }
        None => Failure::forbidden().into_response(),
    }
}

/// No framing, no sniffing, no referrer, and only our own scripts and styles.
pub async fn security_headers(req: Request, next: Next) -> Response {
    let mut res = next.run(req).await;
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
             connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    res
}
