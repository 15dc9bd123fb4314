//! The stylesheet and the script, compiled in (the appliance may have no network).

use axum::extract::Path;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

const CSS: &str = include_str!("../../../../../web/static/console.css");
const JS: &str = include_str!("../../../../../web/static/console.js");

/// `/console/static/{file}`.
pub async fn serve(Path(file): Path<String>) -> Response {
    let (body, ct) = match file.as_str() {
        "console.css" => (CSS, "text/css; charset=utf-8"),
        "console.js" => (JS, "text/javascript; charset=utf-8"),
        _ => return StatusCode::NOT_FOUND.into_response(),
    };
    (
        [
            (header::CONTENT_TYPE, ct),
            // An hour: a new build's assets reach browsers soon, and pages load fast.
            (header::CACHE_CONTROL, "public, max-age=3600"),
        ],
        body,
    )
        .into_response()
}
