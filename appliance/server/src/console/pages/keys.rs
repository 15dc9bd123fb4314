//! API keys: list (ids, scopes, grants; never secrets), create with scopes and collection
//! grants (the key is shown once), revoke. The daemon notices the key file's change on the
//! next API request.

use askama::Template;
use axum::extract::{Path, Query, RawForm, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Extension;

use super::dashboard::FlashQuery;
use crate::api::AppState;
use crate::auth::{KeyStore, Scope, KEY_PREFIX};
use crate::console::view::{datetime, html, see_other, Chrome, Failure, Viewer};

pub struct KeyRow {
    pub id: String,
    pub prefix: String,
    pub scopes: String,
    pub collections: String,
    pub created: String,
}

#[derive(Template)]
#[template(path = "keys.html", config = "../../web/askama.toml")]
pub struct KeysPage {
    pub c: Chrome,
    pub keys: Vec<KeyRow>,
    pub all: Vec<String>,
    pub scopes: Vec<&'static str>,
    /// The key just created, shown once.
    pub created: Option<String>,
    pub error: Option<String>,
}

async fn keys_page(s: &AppState, v: &Viewer, flash: Option<&str>) -> Result<KeysPage, Failure> {
    let store = KeyStore::new(&s.console.data_dir);
    let keys = store
        .list()
        .map_err(|e| Failure::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .into_iter()
        .map(|k| KeyRow {
            prefix: format!("{KEY_PREFIX}{}_…", k.id),
            scopes: k
                .scopes
                .iter()
                .map(|s| s.name())
                .collect::<Vec<_>>()
                .join(", "),
            collections: k.collections.map(|c| c.join(", ")).unwrap_or_default(),
            created: datetime(k.created_ms),
            id: k.id,
        })
        .collect();
    let all =
        s.kb.call(|kb| kb.collections())
            .await??
            .into_iter()
            .map(|c| c.name)
            .collect();
    Ok(KeysPage {
        c: v.chrome("keys", "nav.keys", "/console/keys")
            .with_flash(flash),
        keys,
        all,
        scopes: vec!["search", "qa", "ingest", "admin"],
        created: None,
        error: None,
    })
}

/// `GET /console/keys`.
pub async fn page(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    Query(q): Query<FlashQuery>,
) -> Result<Response, Failure> {
    let mut page = keys_page(&s, &v, q.ok.as_deref()).await?;
    page.created = s.console.sessions.take_reveal(&v.session);
    Ok(html(&page))
}

/// `POST /console/keys` (admin): `scopes` (repeated), `collections` (repeated; none: all).
/// Creates the key, keeps it in the session and redirects to the list, which shows it once
/// (post/redirect/get: reloading the page does not create another key).
pub async fn create(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    RawForm(body): RawForm,
) -> Result<Response, Failure> {
    let pairs: Vec<(String, String)> = serde_urlencoded::from_bytes(&body).unwrap_or_default();
    let field = |k: &str| -> Vec<String> {
        pairs
            .iter()
            .filter(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .collect()
    };
    let scopes = Scope::parse_list(&field("scopes").join(","));
    let grants = field("collections");
    let Ok(scopes) = scopes else {
        let mut page = keys_page(&s, &v, None).await?;
        page.error = Some(page.c.t.get("keys.need_scope").to_owned());
        return Ok(html(&page));
    };
    let store = KeyStore::new(&s.console.data_dir);
    let grants = (!grants.is_empty()).then_some(grants);
    // argon2 and an fsync: off the async threads.
    let (rec, key) = tokio::task::spawn_blocking(move || store.create(scopes, grants))
        .await
        .map_err(|e| Failure::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(|e| Failure::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    s.console
        .audit
        .record(&v.user, "key_created", &rec.id, &v.ip);
    s.console.sessions.stash_reveal(&v.session, key);
    Ok(see_other("/console/keys?ok=flash.key_created"))
}

/// `POST /console/keys/{id}/revoke` (admin).
pub async fn revoke(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    Path(id): Path<String>,
) -> Result<Response, Failure> {
    let store = KeyStore::new(&s.console.data_dir);
    let rec = tokio::task::spawn_blocking(move || store.revoke(&id))
        .await
        .map_err(|e| Failure::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(|e| Failure::new(StatusCode::NOT_FOUND, e.to_string()))?;
    s.console
        .audit
        .record(&v.user, "key_revoked", &rec.id, &v.ip);
    Ok(see_other("/console/keys?ok=flash.key_revoked"))
}
