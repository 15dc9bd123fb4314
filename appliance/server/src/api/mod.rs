//! The HTTP API: shared state, the router with its middleware (metrics, authentication, one
//! error shape), and the handlers by area.
//!
//! - `collections`, `documents`: the knowledge base (`/api/v1/collections/...`);
//! - `search`: `/api/v1/search` and Dify's External Knowledge API (`/retrieval`);
//! - `qa`: `/api/v1/qa`, JSON or server-sent events;
//! - `openai`: `/v1/models`, `/v1/chat/completions`, `/v1/embeddings`;
//! - `health`: `/healthz`, `/readyz`, `/metrics`;
//! - `admin`: `/api/v1/admin/backup`;
//! - `openapi`: the OpenAPI document.

pub(crate) mod admin;

mod collections;
mod documents;
mod extract;
mod health;
mod openai;
mod openapi;
pub(crate) mod qa;
pub(crate) mod search;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{ConnectInfo, DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

pub use extract::Json;
pub use openapi::openapi_json;

use crate::auth::{Authenticator, Principal};
use crate::engine::EngineHandle;
use crate::error::{error_body, ApiError};
use crate::kbtask::KbHandle;
use crate::metrics::Metrics;

/// Request limits the handlers check.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_upload_bytes: usize,
    pub max_tokens: usize,
    pub max_top_k: usize,
    pub max_query_bytes: usize,
}

impl Limits {
    /// Refuses a search query or question longer than `max_query_bytes` (400, naming `field`).
    pub fn check_query(&self, field: &str, text: &str) -> Result<(), ApiError> {
        if text.len() > self.max_query_bytes {
            return Err(ApiError::invalid(
                field,
                format!(
                    "{} bytes, more than the {} a query may have (limits.max_query_bytes)",
                    text.len(),
                    self.max_query_bytes
                ),
            ));
        }
        Ok(())
    }
}

/// What every handler can reach; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub kb: KbHandle,
    pub engine: EngineHandle,
    pub auth: Arc<Authenticator>,
    pub metrics: Arc<Metrics>,
    /// Ingestion requests running or waiting; a full semaphore answers 429.
    pub ingest: Arc<tokio::sync::Semaphore>,
    pub limits: Limits,
    /// The data directory's disk: upload admission and read-only mode.
    pub storage: Arc<crate::storage::Storage>,
    pub profile: Arc<str>,
    /// The admin console: accounts, sessions, audit log, dashboard history.
    pub console: Arc<crate::console::Console>,
    /// The data directory (backups).
    pub data_dir: std::path::PathBuf,
    /// The NVMe chunk KV tier's folder, when the tier is on (backups with `kv=true`).
    pub kv_dir: Option<std::path::PathBuf>,
    /// cl100k_base, to read token-id embedding inputs; `None` when its file is absent.
    pub token_vocab: Option<Arc<engram_tokenizer::TiktokenVocab>>,
    /// The GPUs found at start (`/readyz`, `/metrics`).
    pub gpu: Arc<crate::gpu::GpuStatus>,
    /// Other names `/v1/embeddings` answers to (`[openai] embedding_aliases`).
    pub embedding_aliases: Arc<[String]>,
}

/// The whole router.
pub fn router(state: AppState) -> Router {
    let api = Router::new()
        .route(
            "/api/v1/collections",
            get(collections::list).post(collections::create),
        )
        .route(
            "/api/v1/collections/{name}",
            get(collections::get).delete(collections::delete),
        )
        .route(
            "/api/v1/collections/{name}/documents",
            get(documents::list).post(documents::upload),
        )
        .route(
            "/api/v1/collections/{name}/documents/text",
            post(documents::upload_text),
        )
        .route(
            "/api/v1/collections/{name}/documents/{id}",
            get(documents::get).delete(documents::delete),
        )
        .route(
            "/api/v1/collections/{name}/documents/{id}/chunks",
            get(documents::chunks),
        )
        .route(
            "/api/v1/collections/{name}/documents/{id}/cancel",
            post(documents::cancel),
        )
        .route(
            "/api/v1/collections/{name}/documents/{id}/reindex",
            post(documents::reindex),
        )
        .route("/api/v1/admin/backup", post(admin::backup))
        .route("/api/v1/admin/version", get(admin::version))
        // An archive as large as the data: streamed to disk, not held.
        .route(
            "/api/v1/admin/restore",
            post(admin::restore).layer(DefaultBodyLimit::disable()),
        )
        .route("/api/v1/search", post(search::search))
        .route("/api/v1/qa", post(qa::qa))
        .route("/api/v1/openapi.json", get(openapi::serve))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{id}", get(openai::model))
        .route("/v1/chat/completions", post(openai::chat))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/embeddings", post(openai::embeddings))
        .route("/retrieval", post(search::dify_retrieval))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(health::metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), authenticate))
        .route_layer(middleware::from_fn_with_state(state.clone(), track));
    let public = Router::new()
        .route("/healthz", get(health::healthz))
        .route_layer(middleware::from_fn_with_state(state.clone(), track));
    let console = crate::console::router(state.clone());
    api.merge(public)
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(state.limits.max_upload_bytes))
        .layer(middleware::from_fn(one_error_shape))
        // Outermost: Dify's error shape for `/retrieval`, whichever layer answered.
        .layer(middleware::from_fn(search::dify_error_shape))
        // After the error-shape layer: console errors are HTML pages, not JSON.
        .merge(console)
        .layer(middleware::map_response(sse_charset))
        // Outermost, before anything reads a header: an oversized head gets the JSON 431.
        .layer(middleware::from_fn(crate::http::limit_headers))
        .with_state(state)
}

/// Server-sent events (QA, chat, the console's playground) declared as UTF-8: without a
/// charset, Python's `requests` reads a `text/` body as ISO-8859-1 and garbles every Chinese
/// token.
async fn sse_charset(mut res: Response) -> Response {
    let sse = res
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes() == b"text/event-stream");
    if sse {
        res.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream; charset=utf-8"),
        );
    }
    res
}

/// Checks the bearer key and puts the [`Principal`] in the request's extensions.
async fn authenticate(
    State(s): State<AppState>,
    ConnectInfo(addr): ConnectInfo<SocketAddr>,
    mut req: Request,
    next: Next,
) -> Response {
    let header = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    match s.auth.authenticate(header.as_deref(), addr.ip()).await {
        Ok(p) => {
            req.extensions_mut().insert(p);
            next.run(req).await
        }
        Err(e) => {
            let reason = if matches!(e, ApiError::RateLimited { .. }) {
                "auth_rate_limited"
            } else {
                "unauthorized"
            };
            s.metrics.rejected.with_label_values(&[reason]).inc();
            e.into_response()
        }
    }
}

/// Counts requests and their latency by matched route and status.
async fn track(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |m| m.as_str().to_owned());
    let start = Instant::now();
    let res = next.run(req).await;
    let status = res.status().as_u16().to_string();
    s.metrics
        .requests
        .with_label_values(&[route.as_str(), status.as_str()])
        .inc();
    s.metrics
        .latency
        .with_label_values(&[route.as_str(), status.as_str()])
        .observe(start.elapsed().as_secs_f64());
    res
}

async fn not_found() -> ApiError {
    ApiError::NotFound {
        what: "route".into(),
    }
}

/// Rewrites any error response that is not already JSON (axum's own 405, 413, 415, ...) into
/// the one error shape.
async fn one_error_shape(req: Request, next: Next) -> Response {
    let res = next.run(req).await;
    let status = res.status();
    let is_json = res
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return res;
    }
    let (mut parts, body) = res.into_parts();
    let text = axum::body::to_bytes(body, 64 << 10)
        .await
        .unwrap_or_default();
    let message = String::from_utf8_lossy(&text).trim().to_owned();
    let kind = match status {
        StatusCode::NOT_FOUND => "not_found",
        StatusCode::METHOD_NOT_ALLOWED => "method_not_allowed",
        StatusCode::PAYLOAD_TOO_LARGE => "payload_too_large",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
        StatusCode::BAD_REQUEST | StatusCode::UNPROCESSABLE_ENTITY => "invalid_request",
        s if s.is_server_error() => "internal_error",
        _ => "http_error",
    };
    let message = if message.is_empty() {
        status.canonical_reason().unwrap_or("error").to_owned()
    } else {
        message
    };
    let body = serde_json::to_vec(&error_body(kind, &message)).expect("json");
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(body))
}

/// The caller, as the authentication middleware left it.
pub type Caller = axum::Extension<Principal>;
