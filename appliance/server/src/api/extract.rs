//! Request extractors whose rejections are [`ApiError`]s, so a bad body gets the same JSON
//! error shape as every other failure.

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use crate::api::AppState;
use crate::error::ApiError;

/// `axum::Json` with [`ApiError`] rejections (`invalid_json`, `payload_too_large`).
pub struct Json<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for Json<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        match axum::Json::<T>::from_request(req, state).await {
            Ok(axum::Json(v)) => Ok(Json(v)),
            Err(r) if r.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Err(ApiError::PayloadTooLarge {
                    limit: state.limits.max_upload_bytes,
                })
            }
            Err(JsonRejection::MissingJsonContentType(_)) => Err(ApiError::BadJson {
                reason: "expected `Content-Type: application/json`".into(),
            }),
            Err(r) => Err(ApiError::BadJson {
                reason: r.body_text(),
            }),
        }
    }
}
