//! The crate's errors: `ServerError` for start-up and the key store, `ApiError` for requests,
//! with the one error-to-HTTP table (`ApiError::status`, `ApiError::error_type`).

use std::path::PathBuf;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use engram_fusion::FusionError;
use engram_kb::KbError;

/// Why the daemon could not start, or a key-store command failed.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A configuration value breaks a rule; `key` is its TOML key or environment variable.
    #[error("config `{key}`: {reason}")]
    Config { key: String, reason: String },

    /// No hardware profile fits, or the one named does not fit the machine.
    #[error("hardware profile: {reason}")]
    Profile { reason: String },

    /// A file or folder could not be read or written.
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },

    /// The key file does not decode.
    #[error("corrupted key store {path}: {comment}")]
    Corrupted { path: PathBuf, comment: String },

    /// A key-store command named something that is not there or is malformed.
    #[error("{0}")]
    Keys(String),

    /// A backup could not be written.
    #[error("backup: {reason}")]
    Backup { reason: String },

    /// An archive was not restored: damaged, of another format or version, or the target is
    /// not empty. Nothing was written to the target.
    #[error("restore refused: {reason}")]
    Restore { reason: String },

    #[error("knowledge base: {0}")]
    Kb(#[from] KbError),

    #[error("model: {0}")]
    Model(#[from] engram_model::ModelError),

    #[error("fusion: {0}")]
    Fusion(#[from] FusionError),

    #[error("tokenizer: {0}")]
    Tokenizer(#[from] engram_tokenizer::TokenizerError),

    #[error("KV store: {0}")]
    KvStore(#[from] engram_kvstore::KvStoreError),

    #[error("GGUF: {0}")]
    Gguf(#[from] engram_gguf::GgufError),
}

impl ServerError {
    pub(crate) fn config(key: impl Into<String>, reason: impl Into<String>) -> Self {
        ServerError::Config {
            key: key.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ServerError::Io {
            op,
            path: path.into(),
            source,
        }
    }
}

/// `Result` with [`ServerError`].
pub type Result<T> = std::result::Result<T, ServerError>;

/// Why a request failed. Every variant maps to one status and one stable snake_case type,
/// used in the JSON body, the SSE `error` event and the `type` label of the metrics.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{reason}")]
    Unauthorized { reason: &'static str },

    #[error("{reason}")]
    Forbidden { reason: String },

    #[error(
        "too many failed authentication attempts from this address; retry in {retry_after_s} s"
    )]
    RateLimited { retry_after_s: u64 },

    #[error("the generation queue is full ({depth} jobs waiting); retry in {retry_after_s} s")]
    Overloaded { depth: usize, retry_after_s: u64 },

    #[error("invalid `{field}`: {reason}")]
    Invalid { field: String, reason: String },

    #[error("invalid JSON body: {reason}")]
    BadJson { reason: String },

    #[error("request body larger than the limit of {limit} bytes")]
    PayloadTooLarge { limit: usize },

    /// A request header (or all of them) larger than the server reads.
    #[error("request headers larger than the limit of {limit} bytes")]
    HeadersTooLarge { limit: usize },

    #[error("{what} not found")]
    NotFound { what: String },

    /// An OpenAI request named a model this appliance does not serve (OpenAI's 404).
    #[error("the model `{model}` does not exist (GET /v1/models lists the models served)")]
    ModelNotFound { model: String },

    #[error("method not allowed on this path")]
    MethodNotAllowed,

    #[error("{0}")]
    Kb(#[from] KbError),

    #[error("{0}")]
    Fusion(#[from] FusionError),

    /// The disk cannot take the write durably (the free-space reserve, or the disk itself).
    #[error("{reason}")]
    InsufficientStorage { reason: String },

    #[error("{reason}")]
    Unavailable { reason: String },

    #[error("{reason}")]
    Internal { reason: String },
}

/// An answer step's error as the API reports it: the knowledge base's and fusion's as theirs.
impl From<engram_rag::RagError> for ApiError {
    fn from(e: engram_rag::RagError) -> Self {
        match e {
            engram_rag::RagError::Kb(e) => ApiError::Kb(e),
            engram_rag::RagError::Fusion(e) => ApiError::Fusion(e),
            e => ApiError::internal(e),
        }
    }
}

impl ApiError {
    pub(crate) fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        ApiError::Invalid {
            field: field.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn internal(reason: impl std::fmt::Display) -> Self {
        ApiError::Internal {
            reason: reason.to_string(),
        }
    }

    /// The one error-to-HTTP table.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Unauthorized { .. } => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden { .. } => StatusCode::FORBIDDEN,
            ApiError::RateLimited { .. } | ApiError::Overloaded { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            ApiError::Invalid { .. } | ApiError::BadJson { .. } => StatusCode::BAD_REQUEST,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::HeadersTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ApiError::NotFound { .. } | ApiError::ModelNotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::InsufficientStorage { .. } => StatusCode::INSUFFICIENT_STORAGE,
            ApiError::Kb(e) if e.is_storage_full() => StatusCode::INSUFFICIENT_STORAGE,
            ApiError::Kb(e) => match e {
                KbError::CollectionNotFound { .. } | KbError::DocumentNotFound { .. } => {
                    StatusCode::NOT_FOUND
                }
                KbError::CollectionExists { .. } | KbError::WrongStage { .. } => {
                    StatusCode::CONFLICT
                }
                KbError::Invalid { .. } => StatusCode::BAD_REQUEST,
                KbError::UnsupportedFormat(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            },
            ApiError::Fusion(e) => match e {
                FusionError::TooLong { .. } | FusionError::BadPolicy { .. } => {
                    StatusCode::BAD_REQUEST
                }
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            },
            ApiError::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Stable snake_case name of the error, for clients and metrics.
    pub fn error_type(&self) -> &'static str {
        match self {
            ApiError::Unauthorized { .. } => "unauthorized",
            ApiError::Forbidden { .. } => "forbidden",
            ApiError::RateLimited { .. } => "rate_limited",
            ApiError::Overloaded { .. } => "overloaded",
            ApiError::Invalid { .. } => "invalid_request",
            ApiError::BadJson { .. } => "invalid_json",
            ApiError::PayloadTooLarge { .. } => "payload_too_large",
            ApiError::HeadersTooLarge { .. } => "headers_too_large",
            ApiError::NotFound { .. } => "not_found",
            ApiError::ModelNotFound { .. } => "model_not_found",
            ApiError::MethodNotAllowed => "method_not_allowed",
            ApiError::InsufficientStorage { .. } => "insufficient_storage",
            ApiError::Kb(e) if e.is_storage_full() => "insufficient_storage",
            ApiError::Kb(e) => match e {
                KbError::CollectionNotFound { .. } | KbError::DocumentNotFound { .. } => {
                    "not_found"
                }
                KbError::CollectionExists { .. } | KbError::WrongStage { .. } => "conflict",
                KbError::Invalid { .. } => "invalid_request",
                KbError::UnsupportedFormat(_) => "unsupported_media_type",
                _ => "knowledge_base_error",
            },
            ApiError::Fusion(e) => match e {
                FusionError::TooLong { .. } => "context_length_exceeded",
                FusionError::BadPolicy { .. } => "invalid_request",
                _ => "engine_error",
            },
            ApiError::Unavailable { .. } => "unavailable",
            ApiError::Internal { .. } => "internal_error",
        }
    }

    /// The JSON body every error response carries.
    pub fn body(&self) -> serde_json::Value {
        error_body(self.error_type(), &self.to_string())
    }

    fn retry_after(&self) -> Option<u64> {
        match self {
            ApiError::RateLimited { retry_after_s }
            | ApiError::Overloaded { retry_after_s, .. } => Some(*retry_after_s),
            _ => None,
        }
    }
}

/// `{"error": {"type": ..., "message": ...}}`.
pub fn error_body(error_type: &str, message: &str) -> serde_json::Value {
    serde_json::json!({"error": {"type": error_type, "message": message}})
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        match self {
            // Conditions of the machine the operator acts on (a full disk, a knowledge base
            // waiting for space, a shutdown), not faults of the daemon.
            ApiError::InsufficientStorage { .. } | ApiError::Unavailable { .. } => {
                tracing::warn!(error_type = self.error_type(), "{self}");
            }
            _ if status.is_server_error() => {
                tracing::error!(error_type = self.error_type(), "{self}");
            }
            _ => {}
        }
        let mut res = (status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after() {
            res.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if matches!(self, ApiError::Unauthorized { .. }) {
            res.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"engram\""),
            );
        }
        res
    }
}
