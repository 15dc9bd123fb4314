//! `engramd`, Engram's daemon: the enterprise REST API (`/api/v1`), the OpenAI-compatible API
//! (`/v1`) and Dify's External Knowledge API over the knowledge base and the fused-prefill
//! engine.
//!
//! Data flow of a question: `api` (auth, validation) -> `kbtask` (the knowledge base's one
//! owner: hybrid retrieval) -> `engine` (the model's one owner: fused prefill, decode) ->
//! tokens streamed back per job. Start-up: `config` -> `profile` -> `server`. The admin
//! console (`console`) serves HTML pages under `/console/` from the same state.
#![forbid(unsafe_code)]

mod api;
mod atomic;
mod auth;
pub mod backup;
mod config;
pub mod console;
mod decode;
mod engine;
mod error;
pub mod gpu;
mod http;
mod kbtask;
mod lifecycle;
mod metrics;
mod profile;
mod server;
pub mod storage;
pub mod tls;
pub mod versions;

pub use api::{openapi_json, router, AppState, Limits};
pub use auth::{Authenticator, KeyRecord, KeyStore, Principal, Scope, KEY_FILE};
pub use config::{load as load_config, Config, Overrides, RawConfig};
pub use engine::{EngineHandle, EngineInfo, EngineOptions};
pub use error::{ApiError, Result, ServerError};
pub use lifecycle::{sd_notify, shutdown_signal};
pub use metrics::Metrics;
pub use profile::{choose as choose_profile, nvidia_device_files, Chosen, Machine, Profile};
pub use server::Daemon;
