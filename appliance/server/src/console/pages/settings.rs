//! Settings: the console's own settings (admins change them at run time) and the daemon's
//! configuration as loaded (read-only: it changes in `engramd.toml` and takes a restart).

use askama::Template;
use axum::extract::{Form, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Extension;
use serde::Deserialize;

use super::dashboard::FlashQuery;
use crate::api::AppState;
use crate::console::settings::ConsoleSettings;
use crate::console::view::{html, see_other, Chrome, Failure, Viewer};

#[derive(Template)]
#[template(path = "settings.html", config = "../../web/askama.toml")]
pub struct SettingsPage {
    pub c: Chrome,
    pub s: ConsoleSettings,
    pub max_tokens: usize,
    pub config: Vec<(&'static str, String)>,
    pub error: Option<String>,
    pub version: &'static str,
    /// Newest first: (the kind's i18n key, version, previous, when, snapshot).
    pub history: Vec<(String, String, String, String, String)>,
    pub history_error: Option<String>,
}

fn settings_page(s: &AppState, v: &Viewer, flash: Option<&str>) -> SettingsPage {
    let mut current = s.console.settings.get();
    // The default may exceed a small `limits.max_tokens`; show what the playground uses.
    current.chat_max_tokens = current.chat_max_tokens.min(s.limits.max_tokens);
    // A small file, read on the page's request.
    let (history, history_error) = match crate::versions::history(&s.data_dir) {
        Ok(events) => (
            events
                .into_iter()
                .rev()
                .map(|e| {
                    (
                        format!("settings.version_kind_{}", e.kind),
                        e.version,
                        e.previous.unwrap_or_default(),
                        crate::console::view::datetime(e.at_ms),
                        e.snapshot.unwrap_or_default(),
                    )
                })
                .collect(),
            None,
        ),
        Err(e) => (Vec::new(), Some(e.to_string())),
    };
    SettingsPage {
        c: v.chrome("settings", "nav.settings", "/console/settings")
            .with_flash(flash),
        s: current,
        max_tokens: s.limits.max_tokens,
        config: s.console.facts.config.clone(),
        error: None,
        version: crate::versions::version(),
        history,
        history_error,
    }
}

/// `GET /console/settings`.
pub async fn page(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    Query(q): Query<FlashQuery>,
) -> Response {
    html(&settings_page(&s, &v, q.ok.as_deref()))
}

#[derive(Deserialize)]
pub struct SettingsForm {
    session_idle_minutes: u64,
    lockout_failures: u32,
    lockout_minutes: u64,
    chat_max_tokens: usize,
}

/// `POST /console/settings` (admin).
pub async fn save(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    Form(f): Form<SettingsForm>,
) -> Result<Response, Failure> {
    let new = ConsoleSettings {
        session_idle_minutes: f.session_idle_minutes,
        lockout_failures: f.lockout_failures,
        lockout_minutes: f.lockout_minutes,
        chat_max_tokens: f.chat_max_tokens,
        ..s.console.settings.get()
    };
    if let Err(e) = new.validate(s.limits.max_tokens) {
        let mut page = settings_page(&s, &v, None);
        page.s = new;
        page.error = Some(e);
        let mut res = html(&page);
        *res.status_mut() = StatusCode::BAD_REQUEST;
        return Ok(res);
    }
    s.console
        .settings
        .set(new)
        .map_err(|e| Failure::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    s.console.audit.record(
        &v.user,
        "settings_changed",
        &serde_json::to_string(&new).unwrap_or_default(),
        &v.ip,
    );
    Ok(see_other("/console/settings?ok=flash.settings_saved"))
}

#[derive(Deserialize)]
pub struct BackupForm {
    #[serde(default)]
    kv: Option<String>,
}

/// `POST /console/backup` (admin): downloads a backup of the whole appliance, as
/// `POST /api/v1/admin/backup` does.
pub async fn backup(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    Form(f): Form<BackupForm>,
) -> Result<Response, Failure> {
    let kv = f.kv.is_some();
    let res = crate::api::admin::stream_backup(&s, kv).await?;
    s.console.audit.record(
        &v.user,
        "backup_downloaded",
        if kv { "with chunk KV" } else { "" },
        &v.ip,
    );
    Ok(res)
}

/// `POST /console/restore` (admin): stages a backup for the next start, as
/// `POST /api/v1/admin/restore` does. The console's script sends the file as the body (with the
/// CSRF token in a header, so it is streamed, however large); without the script, a multipart
/// form up to the upload limit.
pub async fn restore(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    req: axum::extract::Request,
) -> Result<Response, Failure> {
    use axum::extract::FromRequest;
    let multipart = req
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .is_some_and(|c| c.as_bytes().starts_with(b"multipart/form-data"));
    let staged = if multipart {
        let bad = |e: String| Failure::new(StatusCode::BAD_REQUEST, e);
        let mut mp = axum::extract::Multipart::from_request(req, &())
            .await
            .map_err(|e| bad(e.body_text()))?;
        let mut staged = None;
        while let Some(field) = mp.next_field().await.map_err(|e| bad(e.body_text()))? {
            if field.name() == Some("archive") {
                staged = Some(crate::api::admin::stage_restore(&s, field, None).await?);
                break;
            }
        }
        staged.ok_or_else(|| Failure::new(StatusCode::BAD_REQUEST, "error.no_file"))?
    } else {
        let len = req
            .headers()
            .get(axum::http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse().ok());
        crate::api::admin::stage_restore(&s, req.into_body().into_data_stream(), len).await?
    };
    s.console.audit.record(
        &v.user,
        "restore_staged",
        &format!(
            "a backup by Engram {} ({} files), applied at the next start",
            staged.engram_version, staged.files
        ),
        &v.ip,
    );
    Ok(see_other("/console/settings?ok=flash.restore_staged"))
}
