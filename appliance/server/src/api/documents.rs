//! `/api/v1/collections/{name}/documents`: upload (multipart or JSON text), list, get,
//! delete, cancel, re-index, chunks.
//!
//! An upload answers 202 as soon as `KnowledgeBase::accept` has stored each original and its
//! `queued` record durably; the knowledge-base thread then parses, chunks, embeds and indexes
//! in the background (see `kbtask`), and `GET .../documents/{id}` shows the stage moving.

use std::collections::BTreeMap;

use axum::extract::{Multipart, Path, State};
use axum::http::StatusCode;
use engram_kb::{Admission, Document, KbError, NewDocument};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::api::{AppState, Caller, Json};
use crate::auth::Scope;
use crate::error::ApiError;

/// A text document.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TextDocument {
    /// File name; its extension picks the parser (`.md`, `.txt`, `.html`). Unique in the
    /// collection: new text under an existing name replaces the document.
    pub name: String,
    pub text: String,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
}

/// What happened to one uploaded document.
#[derive(Debug, Serialize, ToSchema)]
pub struct UploadResult {
    pub name: String,
    /// `queued` (a new document, stored, waiting for processing), `replaced` (new content
    /// under a known name: same id, queued again), `requeued` (same content had failed or was
    /// cancelled: queued again under its id), `unchanged` (same name and content already there
    /// or queued) or `failed`.
    pub outcome: &'static str,
    pub id: Option<u64>,
    /// The document's stage now (`queued` right after an upload).
    pub stage: Option<&'static str>,
    /// With `replaced`: the document whose content was replaced (a document keeps its id).
    pub replaced_id: Option<u64>,
    pub reason: Option<String>,
}

/// The upload's documents, each durable when listed with an id.
#[derive(Debug, Serialize, ToSchema)]
pub struct UploadResponse {
    pub documents: Vec<UploadResult>,
}

/// A document with its stage history.
#[derive(Debug, Serialize, ToSchema)]
pub struct DocumentInfo {
    pub id: u64,
    pub name: String,
    pub hash: String,
    pub size: u64,
    pub format: Option<String>,
    pub title: Option<String>,
    pub chunks: u32,
    pub metadata: BTreeMap<String, String>,
    /// `queued`, `parsing`, `chunking`, `embedding`, `indexing`, `done` or `failed`.
    pub stage: &'static str,
    pub stages: Vec<StageInfo>,
    /// Why it failed, and what to do.
    pub error: Option<String>,
    /// The kind of failure, stable for programs: the parser's (`too_large`,
    /// `unsupported_format`, `encoding`, `no_text_layer`, `needs_ocr`, `ocr_failed`, `encrypted`, `malformed`,
    /// `archive_limit`, `empty`) or the pipeline's (`no_text`, `too_many_chunks`, `embedding`,
    /// `internal`, `original_unreadable`, `cancelled`); absent for documents that failed before
    /// kinds were recorded.
    pub failure: Option<String>,
    /// While the document is in the pipeline: how far each stage is.
    pub progress: Option<ProgressInfo>,
    /// What went wrong without failing it: scanned pages OCR could not read, each with why
    /// (`page 3: tesseract took longer than the page's time limit`).
    pub warnings: Vec<String>,
}

/// How far a document in the pipeline is.
#[derive(Debug, Serialize, ToSchema)]
pub struct ProgressInfo {
    /// Bytes of its parsed text, and how many are cut into chunks.
    pub text_bytes: u64,
    pub text_bytes_chunked: u64,
    /// Chunks it has (0 until it is chunked), embedded and stored, and in the indexes.
    pub chunks: u32,
    pub chunks_embedded: u32,
    pub chunks_indexed: u32,
    /// Scanned pages (images, PDF pages without a text layer) OCR has to read, and has read.
    pub ocr_pages: u32,
    pub ocr_pages_done: u32,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct StageInfo {
    pub stage: &'static str,
    /// Milliseconds since the Unix epoch.
    pub at_ms: u64,
}

impl From<&Document> for DocumentInfo {
    fn from(d: &Document) -> Self {
        DocumentInfo {
            id: d.id,
            name: d.name.clone(),
            hash: d.hash.clone(),
            size: d.size,
            format: d.format.clone(),
            title: d.title.clone(),
            chunks: d.chunks,
            metadata: d.metadata.clone(),
            stage: d.stage.name(),
            stages: d
                .stages
                .iter()
                .map(|s| StageInfo {
                    stage: s.stage.name(),
                    at_ms: s.at_ms,
                })
                .collect(),
            error: d.error.clone(),
            failure: d.failure.clone(),
            progress: d.progress.map(|p| ProgressInfo {
                text_bytes: p.text_bytes,
                text_bytes_chunked: p.text_bytes_chunked,
                chunks: p.chunks,
                chunks_embedded: p.chunks_embedded,
                chunks_indexed: p.chunks_indexed,
                ocr_pages: p.ocr_pages,
                ocr_pages_done: p.ocr_pages_done,
            }),
            warnings: d.warnings.clone(),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DocumentList {
    pub documents: Vec<DocumentInfo>,
}

/// A chunk of a document.
#[derive(Debug, Serialize, ToSchema)]
pub struct ChunkInfo {
    pub id: u64,
    pub ordinal: u32,
    pub bytes: [usize; 2],
    pub chars: [usize; 2],
    pub tokens: u32,
    pub page: Option<u32>,
    pub text: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ChunkList {
    pub chunks: Vec<ChunkInfo>,
}

/// Accepts each document on the knowledge-base thread (one command for the whole upload).
/// `202` when every document is durable; `207` (with each document's outcome) when some
/// failed; when all failed, the first failure's error: `400` for a refused name or metadata,
/// `507` when the disk cannot take them (checked before anything is written: the reserve kept
/// for the catalog must remain), else `500`.
async fn ingest(
    s: &AppState,
    caller: &Caller,
    collection: String,
    docs: Vec<NewDocument>,
) -> Result<(StatusCode, axum::Json<UploadResponse>), ApiError> {
    caller.require(Scope::Ingest)?;
    caller.require_collection(&collection)?;
    if docs.is_empty() {
        return Err(ApiError::invalid("files", "no file in the request"));
    }
    let _permit = s.ingest.clone().try_acquire_owned().map_err(|_| {
        s.metrics.rejected.with_label_values(&["ingest_busy"]).inc();
        ApiError::Overloaded {
            depth: s.ingest.available_permits(),
            retry_after_s: crate::engine::RETRY_AFTER_S,
        }
    })?;
    let bytes: usize = docs.iter().map(|d| d.bytes.len()).sum();
    s.storage.admit(bytes as u64).inspect_err(|_| {
        s.metrics.rejected.with_label_values(&["disk_full"]).inc();
    })?;
    let n = docs.len();
    let c = collection.clone();
    let results =
        s.kb.call(move |kb| -> Result<Vec<(String, UploadOutcome)>, KbError> {
            kb.collection(&c)?;
            Ok(docs
                .into_iter()
                .map(|nd| {
                    let name = nd.name.clone();
                    let accepted = kb.accept(&c, nd).and_then(|a| {
                        let stage = kb.document(&c, &a.doc.to_string())?.stage.name();
                        Ok((a, stage))
                    });
                    (name, accepted)
                })
                .collect())
        })
        .await??;
    let failed = results.iter().filter(|(_, r)| r.is_err()).count();
    if failed == n {
        let (name, first) = results.into_iter().next().expect("at least one document");
        let e = first.expect_err("all failed");
        tracing::warn!(collection = %collection, documents = n, key = %caller.key_id, "upload refused: {name}: {e}");
        return Err(ApiError::Kb(e));
    }
    let results: Vec<UploadResult> = results
        .into_iter()
        .map(|(name, r)| upload_result(name, r))
        .collect();
    let queued = results.iter().filter(|r| r.stage == Some("queued")).count();
    tracing::info!(collection = %collection, documents = n, queued, failed, key = %caller.key_id, "upload accepted");
    let status = if failed > 0 {
        StatusCode::MULTI_STATUS
    } else {
        StatusCode::ACCEPTED
    };
    Ok((status, axum::Json(UploadResponse { documents: results })))
}

/// What `accept` answered for one document, with its stage.
type UploadOutcome = Result<(engram_kb::Accepted, &'static str), KbError>;

fn upload_result(name: String, accepted: UploadOutcome) -> UploadResult {
    let mut u = UploadResult {
        name,
        outcome: "failed",
        id: None,
        stage: None,
        replaced_id: None,
        reason: None,
    };
    match accepted {
        Ok((a, stage)) => {
            u.id = Some(a.doc);
            u.stage = Some(stage);
            u.outcome = match a.outcome {
                Admission::Queued => "queued",
                Admission::Replaced { old } => {
                    u.replaced_id = Some(old);
                    "replaced"
                }
                Admission::Requeued => "requeued",
                Admission::Unchanged => "unchanged",
            };
        }
        Err(e) => u.reason = Some(e.to_string()),
    }
    u
}

/// Uploads files (multipart: any part with a file name is a document; an optional `metadata`
/// part holds a JSON object of strings applied to every file). Answers 202 once every file
/// is stored durably and queued; processing goes on in the background. Scope `ingest`.
#[utoipa::path(post, path = "/api/v1/collections/{name}/documents", tag = "documents",
    params(("name" = String, Path)),
    request_body(content_type = "multipart/form-data", content = String),
    responses((status = 202, body = UploadResponse), (status = 207, body = UploadResponse, description = "some documents failed (see each outcome)"),
        (status = 400, body = crate::api::openapi::ErrorBody), (status = 413, body = crate::api::openapi::ErrorBody),
        (status = 507, body = crate::api::openapi::ErrorBody, description = "not enough disk space to store the upload durably")),
    security(("bearer" = [])))]
pub async fn upload(
    State(s): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    multipart: Result<Multipart, axum::extract::multipart::MultipartRejection>,
) -> Result<(StatusCode, axum::Json<UploadResponse>), ApiError> {
    caller.require(Scope::Ingest)?;
    caller.require_collection(&name)?;
    let mut multipart = multipart.map_err(|e| ApiError::invalid("body", e.body_text()))?;
    let limit = s.limits.max_upload_bytes;
    let too_large = |e: axum::extract::multipart::MultipartError| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::PayloadTooLarge { limit }
        } else {
            ApiError::invalid("body", e.body_text())
        }
    };
    let mut files = Vec::new();
    let mut metadata = BTreeMap::new();
    while let Some(field) = multipart.next_field().await.map_err(too_large)? {
        let file_name = field.file_name().map(str::to_owned);
        let field_name = field.name().unwrap_or_default().to_owned();
        let bytes = field.bytes().await.map_err(too_large)?;
        match file_name {
            Some(f) if !f.is_empty() => files.push((f, bytes.to_vec())),
            _ if field_name == "metadata" => {
                metadata = serde_json::from_slice(&bytes).map_err(|e| {
                    ApiError::invalid(
                        "metadata",
                        format!("expected a JSON object of strings: {e}"),
                    )
                })?;
            }
            _ => {
                return Err(ApiError::invalid(
                    field_name,
                    "a part without a file name (only `metadata` may have none)",
                ))
            }
        }
    }
    let docs = files
        .into_iter()
        .map(|(name, bytes)| NewDocument {
            name,
            bytes,
            metadata: metadata.clone(),
        })
        .collect();
    ingest(&s, &caller, name, docs).await
}

/// Adds one text document. Scope `ingest`.
#[utoipa::path(post, path = "/api/v1/collections/{name}/documents/text", tag = "documents",
    params(("name" = String, Path)), request_body = TextDocument,
    responses((status = 202, body = UploadResponse), (status = 400, body = crate::api::openapi::ErrorBody),
        (status = 507, body = crate::api::openapi::ErrorBody, description = "not enough disk space to store the upload durably")),
    security(("bearer" = [])))]
pub async fn upload_text(
    State(s): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    Json(doc): Json<TextDocument>,
) -> Result<(StatusCode, axum::Json<UploadResponse>), ApiError> {
    if doc.text.trim().is_empty() {
        return Err(ApiError::invalid("text", "must not be empty"));
    }
    let nd = NewDocument {
        name: doc.name,
        bytes: doc.text.into_bytes(),
        metadata: doc.metadata,
    };
    ingest(&s, &caller, name, vec![nd]).await
}

/// A collection's documents with their stage and per-stage timestamps. Scope `search`.
#[utoipa::path(get, path = "/api/v1/collections/{name}/documents", tag = "documents",
    params(("name" = String, Path)),
    responses((status = 200, body = DocumentList), (status = 404, body = crate::api::openapi::ErrorBody)),
    security(("bearer" = [])))]
pub async fn list(
    State(s): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<axum::Json<DocumentList>, ApiError> {
    caller.require(Scope::Search)?;
    caller.require_collection(&name)?;
    let docs = s.kb.call(move |kb| kb.documents(&name)).await??;
    Ok(axum::Json(DocumentList {
        documents: docs.iter().map(DocumentInfo::from).collect(),
    }))
}

/// One document, by id or name. Scope `search`.
#[utoipa::path(get, path = "/api/v1/collections/{name}/documents/{id}", tag = "documents",
    params(("name" = String, Path), ("id" = String, Path, description = "document id or name")),
    responses((status = 200, body = DocumentInfo), (status = 404, body = crate::api::openapi::ErrorBody)),
    security(("bearer" = [])))]
pub async fn get(
    State(s): State<AppState>,
    caller: Caller,
    Path((name, id)): Path<(String, String)>,
) -> Result<axum::Json<DocumentInfo>, ApiError> {
    caller.require(Scope::Search)?;
    caller.require_collection(&name)?;
    let d = s.kb.call(move |kb| kb.document(&name, &id)).await??;
    Ok(axum::Json(DocumentInfo::from(&d)))
}

/// Deletes a document from every store and index. Scope `ingest`.
#[utoipa::path(delete, path = "/api/v1/collections/{name}/documents/{id}", tag = "documents",
    params(("name" = String, Path), ("id" = String, Path, description = "document id or name")),
    responses((status = 200, body = DocumentInfo), (status = 404, body = crate::api::openapi::ErrorBody)),
    security(("bearer" = [])))]
pub async fn delete(
    State(s): State<AppState>,
    caller: Caller,
    Path((name, id)): Path<(String, String)>,
) -> Result<axum::Json<DocumentInfo>, ApiError> {
    caller.require(Scope::Ingest)?;
    caller.require_collection(&name)?;
    let d =
        s.kb.call(move |kb| kb.delete_document(&name, &id))
            .await??;
    tracing::info!(document = d.id, key = %caller.key_id, "document deleted");
    Ok(axum::Json(DocumentInfo::from(&d)))
}

/// Cancels a document that is queued or anywhere in the pipeline: the work on it stops (within
/// about a second), its chunks leave the indexes, and it becomes `failed` with the reason
/// `cancelled` (re-index it to try again). 409 once it is `done` or `failed`. Scope `ingest`.
#[utoipa::path(post, path = "/api/v1/collections/{name}/documents/{id}/cancel", tag = "documents",
    params(("name" = String, Path), ("id" = String, Path, description = "document id or name")),
    responses((status = 200, body = DocumentInfo), (status = 404, body = crate::api::openapi::ErrorBody),
        (status = 409, body = crate::api::openapi::ErrorBody)),
    security(("bearer" = [])))]
pub async fn cancel(
    State(s): State<AppState>,
    caller: Caller,
    Path((name, id)): Path<(String, String)>,
) -> Result<axum::Json<DocumentInfo>, ApiError> {
    caller.require(Scope::Ingest)?;
    caller.require_collection(&name)?;
    let d = s.kb.call(move |kb| kb.cancel(&name, &id)).await??;
    tracing::info!(document = d.id, key = %caller.key_id, "document cancelled");
    Ok(axum::Json(DocumentInfo::from(&d)))
}

/// Runs a `done` or `failed` document through the pipeline again from its stored original
/// (its chunks leave the indexes at once); answers 202 with the document `queued`. 409 while
/// it is still being processed. Scope `ingest`.
#[utoipa::path(post, path = "/api/v1/collections/{name}/documents/{id}/reindex", tag = "documents",
    params(("name" = String, Path), ("id" = String, Path, description = "document id or name")),
    responses((status = 202, body = DocumentInfo), (status = 404, body = crate::api::openapi::ErrorBody),
        (status = 409, body = crate::api::openapi::ErrorBody)),
    security(("bearer" = [])))]
pub async fn reindex(
    State(s): State<AppState>,
    caller: Caller,
    Path((name, id)): Path<(String, String)>,
) -> Result<(StatusCode, axum::Json<DocumentInfo>), ApiError> {
    caller.require(Scope::Ingest)?;
    caller.require_collection(&name)?;
    let d = s.kb.call(move |kb| kb.reindex(&name, &id)).await??;
    tracing::info!(document = d.id, key = %caller.key_id, "document queued for re-indexing");
    Ok((StatusCode::ACCEPTED, axum::Json(DocumentInfo::from(&d))))
}

/// A document's chunks with their spans. Scope `search`.
#[utoipa::path(get, path = "/api/v1/collections/{name}/documents/{id}/chunks", tag = "documents",
    params(("name" = String, Path), ("id" = String, Path, description = "document id or name")),
    responses((status = 200, body = ChunkList), (status = 404, body = crate::api::openapi::ErrorBody)),
    security(("bearer" = [])))]
pub async fn chunks(
    State(s): State<AppState>,
    caller: Caller,
    Path((name, id)): Path<(String, String)>,
) -> Result<axum::Json<ChunkList>, ApiError> {
    caller.require(Scope::Search)?;
    caller.require_collection(&name)?;
    let chunks =
        s.kb.call(move |kb| {
            let d = kb.document(&name, &id)?;
            kb.chunks(d.id)
        })
        .await??;
    Ok(axum::Json(ChunkList {
        chunks: chunks
            .into_iter()
            .map(|c| ChunkInfo {
                id: c.id,
                ordinal: c.ordinal,
                bytes: [c.bytes.start, c.bytes.end],
                chars: [c.chars.start, c.chars.end],
                tokens: c.tokens,
                page: c.page,
                text: c.text,
            })
            .collect(),
    }))
}
