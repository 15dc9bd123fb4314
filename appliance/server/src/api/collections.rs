//! `/api/v1/collections`: list, create, get, delete.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use engram_kb::{ChunkConfig, Collection, DEFAULT_CHUNK_TOKENS, DEFAULT_OVERLAP_TOKENS};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::api::{AppState, Caller, Json};
use crate::auth::Scope;
use crate::error::ApiError;

/// A new collection.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateCollection {
    pub name: String,
    /// LLM tokens per chunk.
    pub chunk_tokens: Option<usize>,
    /// LLM tokens shared by neighbouring chunks.
    pub overlap_tokens: Option<usize>,
}

/// A collection.
#[derive(Debug, Serialize, ToSchema)]
pub struct CollectionInfo {
    pub id: u64,
    pub name: String,
    pub chunk_tokens: usize,
    pub overlap_tokens: usize,
    pub embed_model: String,
    pub dim: usize,
    pub documents: u64,
    pub chunks: u64,
    pub created_ms: u64,
}

impl From<&Collection> for CollectionInfo {
    fn from(c: &Collection) -> Self {
        CollectionInfo {
            id: c.id,
            name: c.name.clone(),
            chunk_tokens: c.chunking.max_tokens,
            overlap_tokens: c.chunking.overlap_tokens,
            embed_model: c.embed_model.clone(),
            dim: c.dim,
            documents: c.documents,
            chunks: c.chunks,
            created_ms: c.created_ms,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CollectionList {
    pub collections: Vec<CollectionInfo>,
}

/// Collections the key may see.
#[utoipa::path(get, path = "/api/v1/collections", tag = "collections",
    responses((status = 200, body = CollectionList), (status = 401, body = crate::api::openapi::ErrorBody)),
    security(("bearer" = [])))]
pub async fn list(
    State(s): State<AppState>,
    caller: Caller,
) -> Result<axum::Json<CollectionList>, ApiError> {
    let all = s.kb.call(|kb| kb.collections()).await??;
    Ok(axum::Json(CollectionList {
        collections: all
            .iter()
            .filter(|c| caller.sees(&c.name))
            .map(CollectionInfo::from)
            .collect(),
    }))
}

/// Creates a collection (scope `ingest`).
#[utoipa::path(post, path = "/api/v1/collections", tag = "collections", request_body = CreateCollection,
    responses((status = 201, body = CollectionInfo), (status = 409, body = crate::api::openapi::ErrorBody)),
    security(("bearer" = [])))]
pub async fn create(
    State(s): State<AppState>,
    caller: Caller,
    Json(req): Json<CreateCollection>,
) -> Result<impl IntoResponse, ApiError> {
    caller.require(Scope::Ingest)?;
    caller.require_collection(&req.name)?;
    let chunking = ChunkConfig {
        max_tokens: req.chunk_tokens.unwrap_or(DEFAULT_CHUNK_TOKENS),
        overlap_tokens: req.overlap_tokens.unwrap_or(DEFAULT_OVERLAP_TOKENS),
    };
    let c =
        s.kb.call(move |kb| kb.create_collection(&req.name, chunking))
            .await??;
    tracing::info!(collection = %c.name, key = %caller.key_id, "collection created");
    Ok((StatusCode::CREATED, axum::Json(CollectionInfo::from(&c))))
}

/// One collection.
#[utoipa::path(get, path = "/api/v1/collections/{name}", tag = "collections",
    params(("name" = String, Path)),
    responses((status = 200, body = CollectionInfo), (status = 404, body = crate::api::openapi::ErrorBody)),
    security(("bearer" = [])))]
pub async fn get(
    State(s): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<axum::Json<CollectionInfo>, ApiError> {
    caller.require_collection(&name)?;
    let c = s.kb.call(move |kb| kb.collection(&name)).await??;
    Ok(axum::Json(CollectionInfo::from(&c)))
}

/// Deletes a collection with all its documents (scope `admin`).
#[utoipa::path(delete, path = "/api/v1/collections/{name}", tag = "collections",
    params(("name" = String, Path)),
    responses((status = 204), (status = 404, body = crate::api::openapi::ErrorBody)),
    security(("bearer" = [])))]
pub async fn delete(
    State(s): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    caller.require(Scope::Admin)?;
    caller.require_collection(&name)?;
    let n = name.clone();
    s.kb.call(move |kb| kb.delete_collection(&n)).await??;
    tracing::info!(collection = %name, key = %caller.key_id, "collection deleted");
    Ok(StatusCode::NO_CONTENT)
}
