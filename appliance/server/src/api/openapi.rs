//! The OpenAPI document, generated from the handlers' annotations; served at
//! `/api/v1/openapi.json` and committed as `docs/api/openapi.json` (checked for drift).

use axum::response::IntoResponse;
use serde::Serialize;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi, ToSchema};

use crate::api::{admin, collections, documents, health, openai, qa, search};

/// The error body every failure carries.
#[derive(Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Serialize, ToSchema)]
pub struct ErrorDetail {
    /// Stable snake_case error type, e.g. `unauthorized`, `invalid_json`, `not_found`.
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
}

struct Bearer;

impl Modify for Bearer {
    fn modify(&self, api: &mut utoipa::openapi::OpenApi) {
        let c = api.components.get_or_insert_with(Default::default);
        c.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("egk_<id>_<secret>")
                    .build(),
            ),
        );
    }
}

#[derive(OpenApi)]
#[openapi(
    info(title = "engramd", description = "Engram's daemon: knowledge bases, retrieval, question answering with fused chunk KV, OpenAI- and Dify-compatible endpoints."),
    paths(
        collections::list, collections::create, collections::get, collections::delete,
        documents::upload, documents::upload_text, documents::list, documents::get,
        documents::delete, documents::chunks, documents::cancel, documents::reindex,
        search::search, search::dify_retrieval, qa::qa,
        openai::models, openai::model, openai::chat, openai::completions, openai::embeddings,
        health::healthz, health::readyz, health::metrics,
        admin::backup, admin::restore, admin::version,
    ),
    components(schemas(ErrorBody, ErrorDetail)),
    modifiers(&Bearer),
)]
pub struct ApiDoc;

/// The document as pretty JSON with a final newline (the committed file's form).
pub fn openapi_json() -> String {
    let mut s = ApiDoc::openapi()
        .to_pretty_json()
        .expect("the OpenAPI document serializes");
    s.push('\n');
    s
}

pub async fn serve() -> impl IntoResponse {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        openapi_json(),
    )
}

#[cfg(test)]
mod tests {
    /// Fails when `docs/api/openapi.json` differs from the generated document; regenerate with
    /// `cargo run -p engram-server -- openapi > docs/api/openapi.json`.
    #[test]
    fn committed_document_matches() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/api/openapi.json");
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        let generated = super::openapi_json();
        if committed != generated {
            let line = committed
                .lines()
                .zip(generated.lines())
                .position(|(a, b)| a != b)
                .unwrap_or(committed.lines().count().min(generated.lines().count()));
            panic!(
                "docs/api/openapi.json is out of date (first difference at line {}); run \
                 `cargo run -p engram-server -- openapi > docs/api/openapi.json`",
                line + 1
            );
        }
    }
}
