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
}

fn settings_page(s: &AppState, v: &Viewer, flash: Option<&str>) -> SettingsPage {
    let mut current = s.console.settings.get();
    // The default may exceed a small `limits.max_tokens`; show what the playground uses.
    current.chat_max_tokens = current.chat_max_tokens.min(s.limits.max_tokens);
    SettingsPage {
        c: v.chrome("settings", "nav.settings", "/console/settings")
            .with_flash(flash),
        s: current,
        max_tokens: s.limits.max_tokens,
        config: s.console.facts.config.clone(),
        error: None,
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
