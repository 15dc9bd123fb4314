//! Knowledge bases (collections): list, create, show (settings and documents, with the
//! upload form), delete after typing the name.

use askama::Template;
use axum::extract::{Form, Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Extension;
use engram_kb::{
    ChunkConfig, Collection, Document, KbError, Stage, DEFAULT_CHUNK_TOKENS,
    DEFAULT_OVERLAP_TOKENS, MAX_CHUNK_TOKENS, MIN_CHUNK_TOKENS,
};
use serde::Deserialize;

use super::dashboard::FlashQuery;
use super::documents::DocRow;
use crate::api::AppState;
use crate::console::view::{
    datetime, enc, html, html_status, see_other, Chrome, Failure, Pager, Viewer,
};

pub struct KbRow {
    pub name: String,
    pub href: String,
    /// Every document, in any stage (the collection's own count leaves out those that never
    /// reached indexing), and those of them that failed.
    pub documents: usize,
    pub failed: usize,
    pub chunks: u64,
    pub chunk_tokens: usize,
    pub overlap_tokens: usize,
    pub created: String,
}

impl KbRow {
    fn new(c: &Collection, docs: &[Document]) -> KbRow {
        KbRow {
            name: c.name.clone(),
            href: format!("/console/kb/{}", enc(&c.name)),
            documents: docs.len(),
            failed: docs.iter().filter(|d| d.stage == Stage::Failed).count(),
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
    /// The create form's values: the defaults, or what was typed into a refused form.
    pub name: String,
    pub default_chunk: usize,
    pub default_overlap: usize,
    /// Why the create form was refused (from the catalog), shown on the form.
    pub error: Option<String>,
}

/// The knowledge-base list with its create form empty (the defaults) and no message.
async fn list_page(s: &AppState, v: &Viewer, flash: Option<&str>) -> Result<KbListPage, Failure> {
    let kbs =
        s.kb.call(|kb| -> engram_kb::Result<Vec<KbRow>> {
            kb.collections()?
                .iter()
                .map(|c| Ok(KbRow::new(c, &kb.documents(&c.name)?)))
                .collect()
        })
        .await??;
    Ok(KbListPage {
        c: v.chrome("kb", "nav.kb", "/console/kb").with_flash(flash),
        kbs,
        name: String::new(),
        default_chunk: DEFAULT_CHUNK_TOKENS,
        default_overlap: DEFAULT_OVERLAP_TOKENS,
        error: None,
    })
}

/// `GET /console/kb`.
pub async fn list(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    Query(q): Query<FlashQuery>,
) -> Result<Response, Failure> {
    Ok(html(&list_page(&s, &v, q.ok.as_deref()).await?))
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
    let created =
        s.kb.call(move |kb| kb.create_collection(&n, chunking))
            .await?;
    let c = match created {
        Ok(c) => c,
        Err(e) => {
            // A refusal the form can fix comes back on the form, in the viewer's language.
            let t = v.lang.catalog();
            let error = match &e {
                KbError::CollectionExists { name } => t.fmt("kb.err_exists", name),
                KbError::Invalid { field, .. } => match field.as_str() {
                    "collection name" => t.get("kb.err_name").to_owned(),
                    "chunk_tokens" => t.fmt(
                        "kb.err_chunk_tokens",
                        format!("{MIN_CHUNK_TOKENS}–{MAX_CHUNK_TOKENS}"),
                    ),
                    "overlap_tokens" => t.fmt("kb.err_overlap", chunking.max_tokens / 2),
                    _ => return Err(e.into()),
                },
                _ => return Err(e.into()),
            };
            let page = KbListPage {
                name,
                default_chunk: chunking.max_tokens,
                default_overlap: chunking.overlap_tokens,
                error: Some(error),
                ..list_page(&s, &v, None).await?
            };
            return Ok(html_status(StatusCode::UNPROCESSABLE_ENTITY, &page));
        }
    };
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
    /// This page of the documents that match the search.
    pub docs: Vec<DocRow>,
    /// Some document is still moving through the pipeline (the page refreshes itself).
    pub busy: bool,
    pub max_upload: String,
    /// The search (part of a document's name or title, any case), as typed.
    pub q: String,
    /// Documents in the collection, those matching, and where this page starts (1-based).
    pub total_docs: usize,
    pub matching: usize,
    pub first: usize,
    pub prev_href: Option<String>,
    pub next_href: Option<String>,
}

/// Documents per page of a knowledge base.
pub const DOCS_PER_PAGE: usize = 100;

#[derive(Deserialize)]
pub struct KbQuery {
    pub ok: Option<String>,
    pub q: Option<String>,
    /// 1-based.
    pub page: Option<usize>,
}

/// `GET /console/kb/{name}`: settings, documents with their stages, upload.
pub async fn show(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    Path(name): Path<String>,
    Query(q): Query<KbQuery>,
) -> Result<Response, Failure> {
    let n = name.clone();
    let (coll, docs) = s
        .kb
        .call(move |kb| -> engram_kb::Result<_> { Ok((kb.collection(&n)?, kb.documents(&n)?)) })
        .await??;
    let total_docs = docs.len();
    // Still in the pipeline: the list refreshes itself.
    let busy = docs
        .iter()
        .any(|d| !matches!(d.stage, engram_kb::Stage::Done | engram_kb::Stage::Failed));
    let search = q.q.as_deref().unwrap_or("").trim().to_owned();
    let needle = search.to_lowercase();
    let matching: Vec<_> = docs
        .iter()
        .filter(|d| {
            needle.is_empty()
                || d.name.to_lowercase().contains(&needle)
                || d.title
                    .as_deref()
                    .is_some_and(|t| t.to_lowercase().contains(&needle))
        })
        .collect();
    let kb = KbRow::new(&coll, &docs);
    let pager = Pager::new(matching.len(), DOCS_PER_PAGE, q.page, |p| {
        let mut h = format!("{}?page={p}", kb.href);
        if !search.is_empty() {
            h.push_str("&q=");
            h.push_str(&enc(&search));
        }
        h
    });
    let matching_count = matching.len();
    let docs: Vec<DocRow> = matching
        .into_iter()
        .skip(pager.offset)
        .take(DOCS_PER_PAGE)
        .map(|d| DocRow::new(&name, d))
        .collect();
    Ok(html(&KbShowPage {
        q: search,
        total_docs,
        matching: matching_count,
        first: pager.offset + 1,
        prev_href: pager.prev_href,
        next_href: pager.next_href,
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

/// One knowledge base's row, its documents counted.
async fn kb_row(s: &AppState, name: String) -> Result<KbRow, Failure> {
    Ok(s.kb
        .call(move |kb| -> engram_kb::Result<KbRow> {
            Ok(KbRow::new(&kb.collection(&name)?, &kb.documents(&name)?))
        })
        .await??)
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
    let kb = kb_row(&s, name).await?;
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
        let kb = kb_row(&s, name).await?;
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
