//! `/healthz` (liveness, no key), `/readyz` (each dependency), `/metrics` (Prometheus text,
//! scope `admin`).

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;

use crate::api::{AppState, Caller};
use crate::auth::Scope;
use crate::error::ApiError;

/// The process is up.
#[utoipa::path(get, path = "/healthz", tag = "health", responses((status = 200, description = "alive")))]
pub async fn healthz() -> axum::Json<serde_json::Value> {
    axum::Json(serde_json::json!({"status": "ok"}))
}

/// Whether every dependency is ready: models loaded, knowledge base open, KV tiers open. A
/// daemon whose disk is short of its reserve is ready but `read_only` (queries are served,
/// uploads get 507), and `checks.storage.reason` says why. `gpu` lists the GPUs found at start
/// (or why none is usable) and where generation runs; it does not affect readiness.
#[utoipa::path(get, path = "/readyz", tag = "health",
    responses((status = 200, description = "ready"), (status = 503, description = "not ready")),
    security(("bearer" = [])))]
pub async fn readyz(State(s): State<AppState>) -> impl IntoResponse {
    let kb = s.kb.is_open();
    let engine = s.engine.is_running();
    let ready = kb && engine;
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        axum::Json(serde_json::json!({
            "ready": ready,
            "profile": &*s.profile,
            "checks": {
                "models": {"ok": engine, "llm": s.engine.info.model_id, "embedder": &*s.kb.embed_model,
                           "context_length": s.engine.info.context_length},
                "knowledge_base": {"ok": kb, "reason": s.kb.unavailable()},
                "kv_tiers": {"ok": engine, "tiers": s.engine.info.kv_tiers},
                "auth": {"ok": true, "keys": s.auth.key_count()},
                "storage": s.storage.status_json(),
            },
            "read_only": s.storage.read_only(),
            "gpu": &*s.gpu,
        })),
    )
}

/// Prometheus metrics. Scope `admin`.
#[utoipa::path(get, path = "/metrics", tag = "health",
    responses((status = 200, description = "Prometheus text format")), security(("bearer" = [])))]
pub async fn metrics(
    State(s): State<AppState>,
    caller: Caller,
) -> Result<impl IntoResponse, ApiError> {
    caller.require(Scope::Admin)?;
    s.metrics.gpu_devices.set(s.gpu.devices.len() as i64);
    for d in &s.gpu.devices {
        s.metrics
            .gpu_memory_total
            .with_label_values(&[&d.ordinal.to_string()])
            .set(d.total_bytes as i64);
    }
    Ok((
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    ))
}
