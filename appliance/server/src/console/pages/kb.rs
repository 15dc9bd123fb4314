//! Knowledge bases (collections): list, create, show (settings and documents, with the
//! upload form), delete after typing the name.

use askama::Template;
use axum::extract::{Form, Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Extension;
use engram_kb::{ChunkConfig, Collection, DEFAULT_CHUNK_TOKENS, DEFAULT_OVERLAP_TOKENS};
use serde::Deserialize;

use super::dashboard::FlashQuery;
use super::documents::DocRow;
use crate::api::AppState;
use crate::console::view::{datetime, enc, html, see_other, Chrome, Failure, Viewer};

pub struct KbRow {
    pub name: String,
    pub href: String,
    pub documents: u64,
    pub chunks: u64,
    pub chunk_tokens: usize,
    pub overlap_tokens: usize,
    pub created: String,
}

impl From<&Collection> for KbRow {
    fn from(c: &Collection) -> Self {
        KbRow {
            name: c.name.clone(),
            href: format!("/console/kb/{}", enc(&c.name)),
            documents: c.documents,
            chunks: c.chunks,
            chunk_tokens: c.chunking.max_tokens,
            overlap_tokens: c.chunking.overlap_tokens,
            created: datetime(c.created_ms),
        }
    }
}

#[derive(Template)]
#[template(path = "kb_list.html", config = "../../web/askama.toml")]
pub struct KbListPage {
    pub c: Chrome,
    pub kbs: Vec<KbRow>,
    pub default_chunk: usize,
    pub default_overlap: usize,
}

/// `GET /console/kb`.
pub async fn list(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    Query(q): Query<FlashQuery>,
) -> Result<Response, Failure> {
    let all = s.kb.call(|kb| kb.collections()).await??;
    Ok(html(&KbListPage {
        c: v.chrome("kb", "nav.kb", "/console/kb")
            .with_flash(q.ok.as_deref()),
        kbs: all.iter().map(KbRow::from).collect(),
        default_chunk: DEFAULT_CHUNK_TOKENS,
        default_overlap: DEFAULT_OVERLAP_TOKENS,
    }))
}

#[derive(Deserialize)]
pub struct CreateForm {
    name: String,
    chunk_tokens: Option<usize>,
    overlap_tokens: Option<usize>,
}

/// `POST /console/kb` (admin).
pub async fn create(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    Form(f): Form<CreateForm>,
) -> Result<Response, Failure> {
    let chunking = ChunkConfig {
        max_tokens: f.chunk_tokens.unwrap_or(DEFAULT_CHUNK_TOKENS),
        overlap_tokens: f.overlap_tokens.unwrap_or(DEFAULT_OVERLAP_TOKENS),
    };
    let name = f.name.trim().to_owned();
    let n = name.clone();
    let c =
        s.kb.call(move |kb| kb.create_collection(&n, chunking))
            .await??;
    s.console
        .audit
        .record(&v.user, "collection_created", &c.name, &v.ip);
    Ok(see_other(&format!(
        "/console/kb/{}?ok=flash.kb_created",
        enc(&c.name)
    )))
}

#[derive(Template)]
#[template(path = "kb_show.html", config = "../../web/askama.toml")]
pub struct KbShowPage {
    pub c: Chrome,
    pub kb: KbRow,
    pub embed_model: String,
    pub dim: usize,
    pub kv_dtype: String,
    pub docs: Vec<DocRow>,
    /// Some document is still moving through the pipeline (the page refreshes itself).
    pub busy: bool,
    pub max_upload: String,
}

/// `GET /console/kb/{name}`: settings, documents with their stages, upload.
pub async fn show(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    Path(name): Path<String>,
    Query(q): Query<FlashQuery>,
) -> Result<Response, Failure> {
    let n = name.clone();
    let (coll, docs) = s
        .kb
        .call(move |kb| -> engram_kb::Result<_> { Ok((kb.collection(&n)?, kb.documents(&n)?)) })
        .await??;
    let docs: Vec<DocRow> = docs.iter().map(|d| DocRow::new(&name, d)).collect();
    let busy = docs.iter().any(|d| d.busy);
    let kb = KbRow::from(&coll);
    Ok(html(&KbShowPage {
        c: v.chrome("kb", "nav.kb", &kb.href)
            .with_flash(q.ok.as_deref()),
        embed_model: coll.embed_model.clone(),
        dim: coll.dim,
        kv_dtype: s.console.facts.kv_dtype.clone(),
        kb,
        docs,
        busy,
        max_upload: crate::console::view::bytes(s.limits.max_upload_bytes as u64),
    }))
}

#[derive(Template)]
#[template(path = "kb_delete.html", config = "../../web/askama.toml")]
pub struct KbDeletePage {
    pub c: Chrome,
    pub kb: KbRow,
    pub mismatch: bool,
}

/// `GET /console/kb/{name}/delete`: the confirmation page.
pub async fn confirm_delete(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    Path(name): Path<String>,
) -> Result<Response, Failure> {
    let coll = s.kb.call(move |kb| kb.collection(&name)).await??;
    let kb = KbRow::from(&coll);
    Ok(html(&KbDeletePage {
        c: v.chrome("kb", "kb.delete_title", &format!("{}/delete", kb.href)),
        kb,
        mismatch: false,
    }))
}

#[derive(Deserialize)]
pub struct DeleteForm {
    #[serde(default)]
    confirm: String,
}

/// `POST /console/kb/{name}/delete` (admin): only when the typed name matches.
pub async fn delete(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    Path(name): Path<String>,
    Form(f): Form<DeleteForm>,
) -> Result<Response, Failure> {
    if f.confirm.trim() != name {
        let n = name.clone();
        let coll = s.kb.call(move |kb| kb.collection(&n)).await??;
        let kb = KbRow::from(&coll);
        let mut res = html(&KbDeletePage {
            c: v.chrome("kb", "kb.delete_title", &format!("{}/delete", kb.href)),
            kb,
            mismatch: true,
        });
        *res.status_mut() = StatusCode::BAD_REQUEST;
        return Ok(res);
    }
    let n = name.clone();
    s.kb.call(move |kb| kb.delete_collection(&n)).await??;
    s.console
        .audit
        .record(&v.user, "collection_deleted", &name, &v.ip);
    Ok(see_other("/console/kb?ok=flash.kb_deleted"))
}
