//! Documents of a knowledge base: upload (plain multipart form, or one XHR per file from
//! the script for progress bars), the stage timeline and chunks of one document, and
//! retry (re-index), cancel and delete.

use std::collections::BTreeMap;

use askama::Template;
use axum::extract::{Multipart, Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use engram_kb::{Admission, Document, KbError, NewDocument, Stage};
use serde::{Deserialize, Serialize};

use crate::api::AppState;
use crate::console::view::{
    bytes, datetime_ms, enc, html, see_other, Chrome, Failure, Pager, Viewer,
};

/// One row of the documents table.
pub struct DocRow {
    pub name: String,
    pub href: String,
    /// The catalog key of the stage (`stage.queued`, ...).
    pub stage_key: String,
    pub stage: &'static str,
    pub size: String,
    pub chunks: u32,
    /// Why it failed, in detail (the pipeline's English message, shown as a detail).
    pub error: Option<String>,
    /// The catalog key that says why in the viewer's language (`failure.<kind>`).
    pub failure_key: Option<String>,
    pub can_cancel: bool,
    /// "Retry" on a failed document; "Re-index" (the same action, named for what it does to
    /// a document that is done) on a finished one.
    pub can_retry: bool,
    pub can_reindex: bool,
    /// (stage key, time) of every stage reached.
    pub stages: Vec<(String, String)>,
    /// While in the pipeline: (catalog key, "done / total", percent) of the stage under way.
    pub progress: Option<(String, String, u32)>,
}

/// The kinds of failure the catalogs explain (`failure.<kind>`): the parser's error types and
/// the pipeline's own.
pub const FAILURES: [&str; 17] = [
    "too_large",
    "unsupported_format",
    "encoding",
    "no_text_layer",
    "needs_ocr",
    "ocr_failed",
    "encrypted",
    "malformed",
    "archive_limit",
    "empty",
    "no_text",
    "too_many_chunks",
    "embedding",
    "internal",
    "original_unreadable",
    "cancelled",
    "other",
];

/// The catalog key for a failure of `kind` (`failure.other` for one failed before kinds were
/// recorded, or of a kind the catalogs do not know).
pub fn failure_key(kind: Option<&str>) -> String {
    match kind {
        Some(k) if FAILURES.contains(&k) => format!("failure.{k}"),
        _ => "failure.other".into(),
    }
}

/// What a document in the pipeline shows of its progress: the stage's catalog key, its
/// figure, and a percentage for the bar.
pub fn progress_of(d: &Document) -> Option<(String, String, u32)> {
    let p = d.progress?;
    let pct = |done: u64, total: u64| (done * 100).checked_div(total).unwrap_or(0) as u32;
    match d.stage {
        Stage::Parsing if p.ocr_pages > 0 => Some((
            "progress.ocr".into(),
            format!("{} / {}", p.ocr_pages_done, p.ocr_pages),
            pct(p.ocr_pages_done.into(), p.ocr_pages.into()),
        )),
        Stage::Chunking if p.text_bytes > 0 => Some((
            "progress.chunked".into(),
            format!("{} / {}", bytes(p.text_bytes_chunked), bytes(p.text_bytes)),
            pct(p.text_bytes_chunked, p.text_bytes),
        )),
        Stage::Embedding if p.chunks > 0 => Some((
            "progress.embedded".into(),
            format!("{} / {}", p.chunks_embedded, p.chunks),
            pct(p.chunks_embedded.into(), p.chunks.into()),
        )),
        Stage::Indexing if p.chunks > 0 => Some((
            "progress.indexed".into(),
            format!("{} / {}", p.chunks_indexed, p.chunks),
            pct(p.chunks_indexed.into(), p.chunks.into()),
        )),
        _ => None,
    }
}

impl DocRow {
    pub fn new(collection: &str, d: &Document) -> DocRow {
        DocRow {
            name: d.name.clone(),
            href: format!("/console/kb/{}/doc/{}", enc(collection), d.id),
            stage_key: format!("stage.{}", d.stage.name()),
            stage: d.stage.name(),
            size: bytes(d.size),
            chunks: d.chunks,
            error: d.error.clone(),
            failure_key: (d.stage == Stage::Failed).then(|| failure_key(d.failure.as_deref())),
            can_cancel: !matches!(d.stage, Stage::Done | Stage::Failed),
            can_retry: d.stage == Stage::Failed,
            can_reindex: d.stage == Stage::Done,
            stages: d
                .stages
                .iter()
                .map(|s| (format!("stage.{}", s.stage.name()), datetime_ms(s.at_ms)))
                .collect(),
            progress: progress_of(d),
        }
    }
}

/// One file's outcome, for the script's progress list.
#[derive(Serialize)]
struct Uploaded {
    name: String,
    outcome: &'static str,
    id: Option<u64>,
    reason: Option<String>,
}

/// `POST /console/kb/{name}/upload` (admin): every file part is a document; answers JSON to
/// the script (`Accept: application/json`), else redirects back to the knowledge base.
pub async fn upload(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    Path(name): Path<String>,
    headers: HeaderMap,
    multipart: Result<Multipart, axum::extract::multipart::MultipartRejection>,
) -> Result<Response, Failure> {
    let bad = |e: String| Failure::new(StatusCode::BAD_REQUEST, e);
    let mut mp = multipart.map_err(|e| bad(e.body_text()))?;
    let mut docs = Vec::new();
    while let Some(field) = mp.next_field().await.map_err(|e| bad(e.body_text()))? {
        let file_name = field.file_name().map(str::to_owned);
        let data = field.bytes().await.map_err(|e| bad(e.body_text()))?;
        if let Some(f) = file_name.filter(|f| !f.is_empty()) {
            docs.push(NewDocument {
                name: f,
                bytes: data.to_vec(),
                metadata: BTreeMap::new(),
            });
        }
    }
    if docs.is_empty() {
        return Err(Failure::new(StatusCode::BAD_REQUEST, "error.no_file"));
    }
    let _permit = s.ingest.clone().try_acquire_owned().map_err(|_| {
        s.metrics.rejected.with_label_values(&["ingest_busy"]).inc();
        Failure::new(StatusCode::TOO_MANY_REQUESTS, "error.busy")
    })?;
    let bytes: usize = docs.iter().map(|d| d.bytes.len()).sum();
    if s.storage.admit(bytes as u64).is_err() {
        s.metrics.rejected.with_label_values(&["disk_full"]).inc();
        return Err(Failure::new(
            StatusCode::INSUFFICIENT_STORAGE,
            "error.disk_full",
        ));
    }
    let n = docs.len();
    let c = name.clone();
    let accepted =
        s.kb.call(move |kb| -> engram_kb::Result<Vec<_>> {
            kb.collection(&c)?;
            Ok(docs
                .into_iter()
                .map(|nd| (nd.name.clone(), kb.accept(&c, nd)))
                .collect())
        })
        .await??;
    let t = v.lang.catalog();
    let results: Vec<Uploaded> = accepted
        .into_iter()
        .map(|(name, accepted)| match accepted {
            Ok(a) => Uploaded {
                name,
                outcome: match a.outcome {
                    Admission::Queued => "queued",
                    Admission::Replaced { .. } => "replaced",
                    Admission::Requeued => "requeued",
                    Admission::Unchanged => "unchanged",
                },
                id: Some(a.doc),
                reason: None,
            },
            Err(e) => Uploaded {
                // A format nothing reads, in the viewer's language with the formats that are.
                reason: Some(match e {
                    KbError::UnsupportedFormat(_) => t.fmt("docs.unsupported", &name),
                    e => e.to_string(),
                }),
                name,
                outcome: "failed",
                id: None,
            },
        })
        .collect();
    let names: Vec<&str> = results.iter().map(|r| r.name.as_str()).collect();
    s.console.audit.record(
        &v.user,
        "documents_uploaded",
        &format!("{name}: {}", names.join(", ")),
        &v.ip,
    );
    tracing::info!(collection = %name, documents = n, user = %v.user, "console upload accepted");
    let wants_json = headers
        .get(header::ACCEPT)
        .and_then(|h| h.to_str().ok())
        .is_some_and(|h| h.contains("application/json"));
    if wants_json {
        return Ok(axum::Json(serde_json::json!({ "documents": results })).into_response());
    }
    let flash = if results.iter().any(|r| r.outcome == "failed") {
        "flash.upload_partial"
    } else {
        "flash.uploaded"
    };
    Ok(see_other(&format!("/console/kb/{}?ok={flash}", enc(&name))))
}

pub struct ChunkRow {
    pub id: u64,
    pub ordinal: u32,
    pub tokens: u32,
    pub chars: String,
    pub page: String,
    pub text: String,
}

#[derive(Template)]
#[template(path = "doc_show.html", config = "../../web/askama.toml")]
pub struct DocPage {
    pub c: Chrome,
    pub kb: String,
    pub kb_href: String,
    pub doc: DocRow,
    pub title: String,
    pub format: String,
    pub hash: String,
    pub metadata: Vec<(String, String)>,
    /// This page's chunks.
    pub chunks: Vec<ChunkRow>,
    /// All of the document's chunks, and where this page starts in them (1-based, for the
    /// "x-y of n" line).
    pub total_chunks: usize,
    pub first: usize,
    pub prev_href: Option<String>,
    pub next_href: Option<String>,
}

/// Chunks per page of a document: a page stays a few screens long whatever the document's
/// size (a 1,000-chunk document would otherwise render hundreds of thousands of pixels).
pub const CHUNKS_PER_PAGE: usize = 50;

#[derive(Deserialize)]
pub struct DocQuery {
    pub ok: Option<String>,
    /// 1-based page of chunks.
    pub page: Option<usize>,
}

/// `GET /console/kb/{name}/doc/{id}`: stages with timestamps, failure reason, chunks.
pub async fn show(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    Path((name, id)): Path<(String, String)>,
    Query(q): Query<DocQuery>,
) -> Result<Response, Failure> {
    let n = name.clone();
    let (d, chunks) =
        s.kb.call(move |kb| -> engram_kb::Result<_> {
            let d = kb.document(&n, &id)?;
            let c = kb.chunks(d.id)?;
            Ok((d, c))
        })
        .await??;
    let row = DocRow::new(&name, &d);
    let total_chunks = chunks.len();
    let pager = Pager::new(total_chunks, CHUNKS_PER_PAGE, q.page, |p| {
        format!("{}?page={p}", row.href)
    });
    Ok(html(&DocPage {
        c: v.chrome("kb", "doc.title", &row.href)
            .with_flash(q.ok.as_deref()),
        kb_href: format!("/console/kb/{}", enc(&name)),
        kb: name,
        title: d.title.clone().unwrap_or_default(),
        format: d.format.clone().unwrap_or_default(),
        hash: d.hash.clone(),
        metadata: d.metadata.clone().into_iter().collect(),
        total_chunks,
        first: pager.offset + 1,
        prev_href: pager.prev_href,
        next_href: pager.next_href,
        chunks: chunks
            .into_iter()
            .skip(pager.offset)
            .take(CHUNKS_PER_PAGE)
            .map(|c| ChunkRow {
                id: c.id,
                ordinal: c.ordinal,
                tokens: c.tokens,
                chars: format!("{}..{}", c.chars.start, c.chars.end),
                page: c.page.map_or_else(String::new, |p| p.to_string()),
                text: c.text,
            })
            .collect(),
        doc: row,
    }))
}

/// `POST /console/kb/{name}/doc/{id}/{reindex|cancel|delete}` (admin).
pub async fn act(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    Path((name, id, action)): Path<(String, String, String)>,
) -> Result<Response, Failure> {
    let (n, i) = (name.clone(), id.clone());
    let (d, flash) = match action.as_str() {
        "reindex" => (
            s.kb.call(move |kb| kb.reindex(&n, &i)).await??,
            "flash.reindexed",
        ),
        "cancel" => (
            s.kb.call(move |kb| kb.cancel(&n, &i)).await??,
            "flash.cancelled",
        ),
        "delete" => (
            s.kb.call(move |kb| kb.delete_document(&n, &i)).await??,
            "flash.doc_deleted",
        ),
        _ => return Err(Failure::not_found()),
    };
    let what = if action == "delete" {
        "document_deleted".to_owned()
    } else {
        format!("document_{action}")
    };
    s.console.audit.record(
        &v.user,
        &what,
        &format!("{name}/{} ({})", d.name, d.id),
        &v.ip,
    );
    Ok(see_other(&format!("/console/kb/{}?ok={flash}", enc(&name))))
}
