//! `/api/v1/search` (hybrid retrieval over one or more collections) and Dify's External
//! Knowledge API (`/retrieval`); also the retrieval step of QA and chat.

use std::collections::BTreeMap;

use axum::extract::State;
use engram_kb::{SearchHit, SearchMode, SearchRequest};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::api::{AppState, Caller, Json};
use crate::auth::{Principal, Scope};
use crate::error::ApiError;

/// Hits returned when the request does not say.
pub const DEFAULT_TOP_K: usize = 10;

/// Which retriever(s) run.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    Bm25,
    Dense,
    #[default]
    Hybrid,
}

impl From<Mode> for SearchMode {
    fn from(m: Mode) -> SearchMode {
        match m {
            Mode::Bm25 => SearchMode::Bm25,
            Mode::Dense => SearchMode::Dense,
            Mode::Hybrid => SearchMode::Hybrid,
        }
    }
}

/// A search.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SearchBody {
    pub query: String,
    pub collections: Vec<String>,
    pub top_k: Option<usize>,
    #[serde(default)]
    pub mode: Mode,
    /// Only documents whose metadata has every one of these key/value pairs.
    #[serde(default)]
    pub filters: BTreeMap<String, String>,
}

/// Where a hit sits in its document.
#[derive(Debug, Serialize, ToSchema)]
pub struct Span {
    /// Byte range in the parsed text.
    pub bytes: [usize; 2],
    /// Character range in the parsed text.
    pub chars: [usize; 2],
    pub page: Option<u32>,
}

/// One retrieved chunk.
#[derive(Debug, Serialize, ToSchema)]
pub struct Hit {
    pub collection: String,
    pub chunk_id: u64,
    pub document: HitDocument,
    pub ordinal: u32,
    pub span: Span,
    /// The fused score (the ranking).
    pub score: f32,
    pub bm25: Option<f32>,
    pub dense: Option<f32>,
    pub text: String,
    /// Byte ranges of `text` that matched the query.
    pub highlights: Vec<[usize; 2]>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct HitDocument {
    pub id: u64,
    pub name: String,
    pub title: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct SearchResponse {
    pub query: String,
    pub mode: Mode,
    pub hits: Vec<Hit>,
}

impl Hit {
    pub fn new(collection: &str, h: SearchHit) -> Hit {
        Hit {
            collection: collection.to_owned(),
            chunk_id: h.chunk_id,
            document: HitDocument {
                id: h.doc_id,
                name: h.doc_name,
                title: h.doc_title,
            },
            ordinal: h.ordinal,
            span: Span {
                bytes: [h.bytes.start, h.bytes.end],
                chars: [h.chars.start, h.chars.end],
                page: h.page,
            },
            score: h.score,
            bm25: h.bm25,
            dense: h.dense,
            text: h.text,
            highlights: h.highlights.iter().map(|r| [r.start, r.end]).collect(),
        }
    }
}

/// Searches every collection (each checked against the key's grants) as one ranking
/// ([`engram_kb::KnowledgeBase::search_many`]: scores on one scale across them) and keeps the
/// best `top_k`.
pub async fn retrieve(
    s: &AppState,
    caller: &Principal,
    collections: &[String],
    query: &str,
    top_k: usize,
    mode: Mode,
    filters: &BTreeMap<String, String>,
) -> Result<Vec<Hit>, ApiError> {
    if collections.is_empty() {
        return Err(ApiError::invalid(
            "collections",
            "name at least one collection",
        ));
    }
    if query.trim().is_empty() {
        return Err(ApiError::invalid("query", "must not be empty"));
    }
    s.limits.check_query("query", query)?;
    if top_k == 0 || top_k > s.limits.max_top_k {
        return Err(ApiError::invalid(
            "top_k",
            format!("{top_k} is outside 1..={}", s.limits.max_top_k),
        ));
    }
    for c in collections {
        caller.require_collection(c)?;
    }
    let reqs: Vec<SearchRequest> = collections
        .iter()
        .map(|c| {
            let mut r = SearchRequest::new(c, query);
            r.k = top_k;
            r.mode = mode.into();
            r.metadata = filters
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            r
        })
        .collect();
    let hits =
        s.kb.call(move |kb| {
            let found = kb.search_many(&reqs)?;
            Ok::<_, engram_kb::KbError>(
                found
                    .into_iter()
                    .map(|(i, h)| Hit::new(&reqs[i].collection, h))
                    .collect::<Vec<_>>(),
            )
        })
        .await??;
    Ok(hits)
}

/// Hybrid, BM25 or dense search. Scope `search`.
#[utoipa::path(post, path = "/api/v1/search", tag = "search", request_body = SearchBody,
    responses((status = 200, body = SearchResponse), (status = 403, body = crate::api::openapi::ErrorBody)),
    security(("bearer" = [])))]
pub async fn search(
    State(s): State<AppState>,
    caller: Caller,
    Json(b): Json<SearchBody>,
) -> Result<axum::Json<SearchResponse>, ApiError> {
    caller.require(Scope::Search)?;
    let t = std::time::Instant::now();
    let hits = retrieve(
        &s,
        &caller,
        &b.collections,
        &b.query,
        b.top_k.unwrap_or(DEFAULT_TOP_K),
        b.mode,
        &b.filters,
    )
    .await?;
    let mode = serde_json::to_value(b.mode)
        .map_or_else(|_| String::new(), |m| m.as_str().unwrap_or("").to_owned());
    s.console.queries().record(
        "api",
        &caller.key_id,
        &b.query,
        &mode,
        &b.collections,
        hits.len(),
        t.elapsed().as_secs_f64() * 1e3,
    );
    Ok(axum::Json(SearchResponse {
        query: b.query,
        mode: b.mode,
        hits,
    }))
}

/// Dify's retrieval request.
#[derive(Debug, Deserialize, ToSchema)]
pub struct DifyRequest {
    /// The collection.
    pub knowledge_id: String,
    pub query: String,
    pub retrieval_setting: DifySetting,
    /// Dify's metadata condition: `is` conditions joined by `and` become metadata filters;
    /// other operators are refused.
    #[serde(default)]
    #[schema(value_type = Object)]
    pub metadata_condition: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize, ToSchema)]
pub struct DifySetting {
    pub top_k: usize,
    #[serde(default)]
    pub score_threshold: f32,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DifyRecord {
    pub content: String,
    pub score: f32,
    pub title: String,
    #[schema(value_type = Object)]
    pub metadata: serde_json::Value,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DifyResponse {
    pub records: Vec<DifyRecord>,
}

/// Dify External Knowledge API (Dify's contract: `POST {endpoint}/retrieval`):
/// `knowledge_id` is the collection. Records come in Engram's fused ranking; each `score` is
/// the chunk's cosine similarity to the query (all-MiniLM-L6-v2, clamped to [0, 1]: about 0.3
/// is related, 0.5 and above close), so Dify's `score_threshold` means what it says. When the
/// dense side is skipped (a query the embedder cannot read, e.g. Chinese) the score is the
/// chunk's BM25 score over the best hit's (the best is 1). `metadata_condition`: `is` / `=`
/// conditions joined by `and`, on document metadata or `path` (the document's name). Errors
/// follow Dify's shape `{"error_code", "error_msg"}`: 1001 (403) a missing or malformed
/// Authorization header, 1002 (403) a wrong key or one not granted the collection, 2001 (404)
/// no such knowledge base, otherwise the HTTP status as the code. Scope `search`.
#[utoipa::path(post, path = "/retrieval", tag = "dify", request_body = DifyRequest,
    responses((status = 200, body = DifyResponse), (status = 400, body = DifyError),
        (status = 403, body = DifyError), (status = 404, body = DifyError)),
    security(("bearer" = [])))]
pub async fn dify_retrieval(
    State(s): State<AppState>,
    caller: Caller,
    Json(b): Json<DifyRequest>,
) -> Result<axum::Json<DifyResponse>, ApiError> {
    caller.require(Scope::Search)?;
    let (filters, path) = dify_filters(b.metadata_condition.as_ref())?;
    let t = std::time::Instant::now();
    let top_k = b.retrieval_setting.top_k;
    // A `path` condition is applied to the ranking: fetch enough to fill top_k after it.
    let fetch = if path.is_some() {
        top_k.saturating_mul(8).clamp(top_k, 200)
    } else {
        top_k
    };
    let mut hits = retrieve(
        &s,
        &caller,
        std::slice::from_ref(&b.knowledge_id),
        &b.query,
        fetch,
        Mode::Hybrid,
        &filters,
    )
    .await?;
    if let Some(p) = &path {
        hits.retain(|h| &h.document.name == p);
    }
    hits.truncate(top_k);
    s.console.queries().record(
        "dify",
        &caller.key_id,
        &b.query,
        "hybrid",
        std::slice::from_ref(&b.knowledge_id),
        hits.len(),
        t.elapsed().as_secs_f64() * 1e3,
    );
    let best_bm25 = hits.iter().filter_map(|h| h.bm25).fold(0.0f32, f32::max);
    let threshold = b.retrieval_setting.score_threshold;
    Ok(axum::Json(DifyResponse {
        records: hits
            .into_iter()
            .map(|h| {
                let score = match (h.dense, h.bm25) {
                    (Some(cos), _) => cos.clamp(0.0, 1.0),
                    (None, Some(bm25)) if best_bm25 > 0.0 => (bm25 / best_bm25).clamp(0.0, 1.0),
                    _ => 0.0,
                };
                (h, score)
            })
            .filter(|(_, score)| *score >= threshold)
            .map(|(h, score)| DifyRecord {
                metadata: serde_json::json!({
                    "document_id": h.document.id,
                    "chunk_id": h.chunk_id,
                    "path": h.document.name,
                    "page": h.span.page,
                    "fused_score": h.score,
                }),
                title: h.document.title.clone().unwrap_or(h.document.name.clone()),
                score,
                content: h.text,
            })
            .collect(),
    }))
}

/// Dify's error body.
#[derive(Debug, Serialize, ToSchema)]
pub struct DifyError {
    pub error_code: u32,
    pub error_msg: String,
}

/// Rewrites `/retrieval`'s error responses (Engram's `{"error": {"type", "message"}}`, from
/// the handler or the authentication before it) into Dify's `{"error_code", "error_msg"}`,
/// with the status Dify's client expects.
pub async fn dify_error_shape(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::http::StatusCode;
    use axum::response::IntoResponse;
    let dify = req.uri().path() == "/retrieval";
    let res = next.run(req).await;
    if !dify || res.status().is_success() {
        return res;
    }
    let status = res.status();
    let (parts, body) = res.into_parts();
    let bytes = axum::body::to_bytes(body, 64 << 10)
        .await
        .unwrap_or_default();
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
    let message = v["error"]["message"]
        .as_str()
        .map(str::to_owned)
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
    let (status, code) = match (status, v["error"]["type"].as_str()) {
        (StatusCode::UNAUTHORIZED, _) if message == "invalid API key" => {
            (StatusCode::FORBIDDEN, 1002)
        }
        (StatusCode::UNAUTHORIZED, _) => (StatusCode::FORBIDDEN, 1001),
        (StatusCode::FORBIDDEN, _) => (StatusCode::FORBIDDEN, 1002),
        (StatusCode::NOT_FOUND, Some("not_found")) if message.contains("collection") => {
            (StatusCode::NOT_FOUND, 2001)
        }
        (s, _) => (s, u32::from(s.as_u16())),
    };
    let mut out = (
        status,
        axum::Json(DifyError {
            error_code: code,
            error_msg: message,
        }),
    )
        .into_response();
    // Retry-After and the like stay.
    for (k, v) in parts.headers.iter() {
        if k != axum::http::header::CONTENT_TYPE
            && k != axum::http::header::CONTENT_LENGTH
            && k != axum::http::header::WWW_AUTHENTICATE
        {
            out.headers_mut().insert(k.clone(), v.clone());
        }
    }
    out
}

/// Dify's `metadata_condition` as metadata filters, and a `path` (document name) condition.
type DifyFilters = (BTreeMap<String, String>, Option<String>);

fn dify_filters(cond: Option<&serde_json::Value>) -> Result<DifyFilters, ApiError> {
    let mut out = BTreeMap::new();
    let mut path = None;
    let Some(cond) = cond.filter(|c| !c.is_null()) else {
        return Ok((out, path));
    };
    let bad = |why: &str| ApiError::invalid("metadata_condition", why.to_owned());
    if cond["logical_operator"]
        .as_str()
        .is_some_and(|o| o != "and")
    {
        return Err(bad("only `and` is supported"));
    }
    for c in cond["conditions"].as_array().into_iter().flatten() {
        if !matches!(c["comparison_operator"].as_str(), Some("is" | "=")) {
            return Err(bad("only the `is` operator is supported"));
        }
        let name = c["name"]
            .as_array()
            .and_then(|n| n.first())
            .or(Some(&c["name"]))
            .and_then(|n| n.as_str())
            .ok_or_else(|| bad("a condition without a name"))?;
        let value = match &c["value"] {
            serde_json::Value::String(s) => s.clone(),
            v if !v.is_null() => v.to_string(),
            _ => return Err(bad("a condition without a value")),
        };
        if name == "path" {
            if path.as_ref().is_some_and(|p| p != &value) {
                return Err(bad("two different `path` conditions match nothing"));
            }
            path = Some(value);
        } else {
            out.insert(name.to_owned(), value);
        }
    }
    Ok((out, path))
}
