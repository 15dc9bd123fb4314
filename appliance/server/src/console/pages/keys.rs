//! API keys: list (names, ids, scopes, grants, last use; never secrets), create with a name,
//! scopes and collection grants (the key is shown once; a refused form comes back with its
//! message and what was typed), revoke. The daemon notices the key file's change on the
//! next API request.

use askama::Template;
use axum::extract::{Path, Query, RawForm, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Extension;

use super::dashboard::FlashQuery;
use crate::api::AppState;
use crate::auth::{key_name, KeyStore, Scope, KEY_PREFIX};
use crate::console::view::{datetime, html, html_status, see_other, Chrome, Failure, Viewer};

pub struct KeyRow {
    pub id: String,
    /// Empty when the key has none.
    pub name: String,
    /// When it last authenticated a request (as of the daemon's last write of the uses).
    pub last_used: Option<String>,
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
    /// Why the create form was refused, shown on the form with what was typed.
    pub error: Option<String>,
    pub name: String,
}

async fn keys_page(s: &AppState, v: &Viewer, flash: Option<&str>) -> Result<KeysPage, Failure> {
    let store = KeyStore::new(&s.console.data_dir);
    // Uses recorded since the last periodic write are written first, so the list is current.
    let auth = s.auth.clone();
    let _ = tokio::task::spawn_blocking(move || auth.flush_uses()).await;
    let used = store.last_used();
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
            last_used: used.get(&k.id).map(|&ms| datetime(ms)),
            name: k.name.unwrap_or_default(),
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
        name: String::new(),
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
    let name = field("name").concat();
    let refused = |key: &'static str| async {
        let mut page = keys_page(&s, &v, None).await?;
        page.error = Some(page.c.t.get(key).to_owned());
        page.name = name.clone();
        Ok::<_, Failure>(html_status(StatusCode::UNPROCESSABLE_ENTITY, &page))
    };
    let Ok(scopes) = scopes else {
        return refused("keys.need_scope").await;
    };
    let name = match name.trim() {
        "" => None,
        n => match key_name(n) {
            Ok(n) => Some(n),
            Err(_) => return refused("keys.bad_name").await,
        },
    };
    let store = KeyStore::new(&s.console.data_dir);
    let grants = (!grants.is_empty()).then_some(grants);
    // argon2 and an fsync: off the async threads.
    let (rec, key) =
        tokio::task::spawn_blocking(move || store.create_named(name.as_deref(), scopes, grants))
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
