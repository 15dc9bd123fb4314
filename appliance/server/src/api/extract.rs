//! Request extractors whose rejections are [`ApiError`]s, so a bad body gets the same JSON
//! error shape as every other failure, in words a client's developer reads without knowing
//! Rust's type names.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{header, StatusCode};
use serde::de::DeserializeOwned;

use crate::api::AppState;
use crate::error::ApiError;

/// `axum::Json` with [`ApiError`] rejections: `invalid_json` for a body that is not JSON (or
/// not sent as JSON), `invalid_request` naming the field for JSON that does not fit the
/// request (`max_tokens: -1`, an unknown `mode`), `payload_too_large`.
pub struct Json<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for Json<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let json = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|m| {
                let m = m.trim().to_ascii_lowercase();
                m == "application/json" || (m.starts_with("application/") && m.ends_with("+json"))
            });
        if !json {
            return Err(ApiError::BadJson {
                reason: "expected `Content-Type: application/json`".into(),
            });
        }
        let bytes = Bytes::from_request(req, state).await.map_err(|r| {
            if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge {
                    limit: state.limits.max_upload_bytes,
                }
            } else {
                ApiError::BadJson {
                    reason: r.body_text(),
                }
            }
        })?;
        parse(&bytes).map(Json)
    }
}

/// Deserializes a request body: syntax errors are `invalid_json` with their line and column,
/// values that do not fit are `invalid_request` naming the field ([`plain`]).
pub(crate) fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let bad_json = |e: &serde_json::Error| ApiError::BadJson {
        reason: format!(
            "{} (line {}, column {})",
            without_position(e),
            e.line(),
            e.column()
        ),
    };
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_data() {
            let (field, reason) = plain(&path, &inner);
            ApiError::invalid(field, reason)
        } else {
            bad_json(&inner)
        }
    })?;
    de.end().map_err(|e| bad_json(&e))?;
    Ok(value)
}

/// serde_json's message without its " at line L column C" tail.
fn without_position(e: &serde_json::Error) -> String {
    let text = e.to_string();
    let tail = format!(" at line {} column {}", e.line(), e.column());
    text.strip_suffix(&tail).unwrap_or(&text).to_owned()
}

/// The field a data error is about and what is wrong, in plain words: Rust's type names
/// ("expected usize") become what a JSON value must be ("a whole number, 0 or more"), and a
/// missing field is named as the field.
fn plain(path: &str, e: &serde_json::Error) -> (String, String) {
    let text = without_position(e);
    let field = if path == "." {
        "body".to_owned()
    } else {
        path.to_owned()
    };
    if let Some(rest) = text.strip_prefix("missing field `") {
        let name = rest.trim_end_matches('`');
        let field = if field == "body" {
            name.to_owned()
        } else {
            format!("{field}.{name}")
        };
        return (field, "is required".to_owned());
    }
    // "unknown variant `x`, expected one of `a`, `b`, `c`" (or for two "expected `a` or `b`");
    // "unknown field `x`, expected ...", whose path already ends with the field.
    if let Some(rest) = text.strip_prefix("unknown variant `") {
        if let Some((got, expected)) = rest.split_once("`, expected ") {
            let expected = expected.replace('`', "");
            return (field, format!("unknown value {got:?}; expected {expected}"));
        }
    }
    if let Some((_, expected)) = text
        .strip_prefix("unknown field `")
        .and_then(|rest| rest.split_once("`, expected "))
    {
        let expected = expected.replace('`', "");
        return (field, format!("unknown field; expected {expected}"));
    }
    // "invalid type: string \"x\", expected usize", "invalid value: integer `-1`, expected u32",
    // "invalid length 5, expected ..."
    if let Some((got, expected)) = text.rsplit_once(", expected ") {
        let got = got
            .trim_start_matches("invalid type: ")
            .trim_start_matches("invalid value: ")
            .replace('`', "");
        return (
            field,
            format!("expected {}, got {got}", json_kind(expected)),
        );
    }
    (field, text)
}

/// What a JSON value must be, for serde's name of the Rust type it fills.
fn json_kind(expected: &str) -> String {
    let kind = match expected.trim() {
        "usize" | "u64" | "u32" | "u16" | "u8" => "a whole number, 0 or more",
        "isize" | "i64" | "i32" | "i16" | "i8" => "a whole number",
        "f64" | "f32" => "a number",
        "a boolean" => "true or false",
        "a string" | "a borrowed string" | "a character" => "a string",
        "a sequence" => "an array",
        "a map" => "an object",
        other => other,
    };
    kind.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Body {
        max_tokens: Option<usize>,
        temperature: Option<f32>,
        mode: Option<Mode>,
        query: String,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(rename_all = "snake_case")]
    enum Mode {
        Bm25,
        Hybrid,
    }

    fn error(body: &str) -> (u16, &'static str, String) {
        let e = parse::<Body>(body.as_bytes()).unwrap_err();
        (e.status().as_u16(), e.error_type(), e.to_string())
    }

    #[test]
    fn values_that_do_not_fit_name_the_field_in_plain_words() {
        let (status, kind, message) = error(r#"{"query": "x", "max_tokens": -1}"#);
        assert_eq!((status, kind), (400, "invalid_request"));
        assert_eq!(
            message,
            "invalid `max_tokens`: expected a whole number, 0 or more, got integer -1"
        );
        let (_, kind, message) = error(r#"{"query": "x", "mode": "fuzzy"}"#);
        assert_eq!(kind, "invalid_request");
        assert_eq!(
            message,
            r#"invalid `mode`: unknown value "fuzzy"; expected bm25 or hybrid"#
        );
        let (_, _, message) = error(r#"{"query": "x", "temperature": "hot"}"#);
        assert_eq!(
            message,
            r#"invalid `temperature`: expected a number, got string "hot""#
        );
        let (_, _, message) = error(r#"{"max_tokens": 3}"#);
        assert_eq!(message, "invalid `query`: is required");
        let (_, _, message) = error(r#"{"query": "x", "top": 3}"#);
        assert_eq!(
            message,
            "invalid `top`: unknown field; expected one of max_tokens, temperature, mode, query"
        );
    }

    #[test]
    fn broken_json_is_invalid_json_with_its_place() {
        let (status, kind, message) = error("{\"query\": ");
        assert_eq!((status, kind), (400, "invalid_json"));
        assert!(message.contains("line 1, column 10"), "{message}");
        let (_, kind, _) = error(r#"{"query": "x"} trailing"#);
        assert_eq!(kind, "invalid_json");
    }
}
