//! The audit log page: the newest entries of `audit.jsonl`.

use askama::Template;
use axum::extract::State;
use axum::response::Response;
use axum::Extension;

use crate::api::AppState;
use crate::console::audit::AuditEntry;
use crate::console::view::{datetime, html, Chrome, Viewer};

/// Entries shown.
const SHOWN: usize = 500;

pub struct AuditRow {
    pub at: String,
    pub e: AuditEntry,
    /// `audit.actions.<action>` when the catalog names it.
    pub action_key: String,
    /// `role.<role>`, for an event about an account.
    pub role_key: Option<String>,
}

#[derive(Template)]
#[template(path = "audit.html", config = "../../web/askama.toml")]
pub struct AuditPage {
    pub c: Chrome,
    pub rows: Vec<AuditRow>,
}

/// `GET /console/audit`.
pub async fn page(State(s): State<AppState>, Extension(v): Extension<Viewer>) -> Response {
    let rows = s
        .console
        .audit
        .recent(SHOWN)
        .into_iter()
        .map(|e| AuditRow {
            at: datetime(e.at_ms),
            action_key: format!("audit.actions.{}", e.action),
            role_key: e.role.as_ref().map(|r| format!("role.{r}")),
            e,
        })
        .collect();
    html(&AuditPage {
        c: v.chrome("audit", "nav.audit", "/console/audit"),
        rows,
    })
}
