//! Administration routes: backups.

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use utoipa::IntoParams;

use crate::api::{AppState, Caller};
use crate::auth::Scope;
use crate::backup::{self, ChannelWriter, Staged};
use crate::error::ApiError;

#[derive(Debug, Deserialize, IntoParams)]
pub struct BackupParams {
    /// Also carry the chunk KV tier's blobs (large; they can be recomputed).
    #[serde(default)]
    pub kv: bool,
}

/// A consistent backup of the whole appliance, streamed as it is written: the catalog,
/// originals, indexes, API keys, console accounts, settings and audit log (and with `kv=true`
/// the chunk KV tier), as a zstd-compressed tar with a checksummed manifest
/// (`docs/formats/backup.md`; restore with `engramd restore FILE`). Served meanwhile; the
/// knowledge base pauses only while its catalog is copied. Scope `admin`, with no collection
/// grants.
#[utoipa::path(post, path = "/api/v1/admin/backup", tag = "admin",
    params(BackupParams),
    responses(
        (status = 200, description = "the archive", content_type = "application/zstd"),
        (status = 403, body = crate::api::openapi::ErrorBody),
        (status = 503, body = crate::api::openapi::ErrorBody),
        (status = 507, body = crate::api::openapi::ErrorBody)),
    security(("bearer" = [])))]
pub async fn backup(
    State(s): State<AppState>,
    caller: Caller,
    Query(p): Query<BackupParams>,
) -> Result<Response, ApiError> {
    caller.require(Scope::Admin)?;
    if caller.collections.is_some() {
        return Err(ApiError::Forbidden {
            reason: "a backup holds every collection: it needs an admin key without collection \
                     grants"
                .into(),
        });
    }
    stream_backup(&s, p.kv).await
}

/// Takes a backup and answers with the archive streamed as it is written (the API route and
/// the console's download).
pub async fn stream_backup(s: &AppState, kv: bool) -> Result<Response, ApiError> {
    let data_dir = s.data_dir.clone();
    let catalog_bytes = tokio::task::spawn_blocking({
        let d = data_dir.join("catalog");
        move || engram_kb::dir_size(&d)
    })
    .await
    .map_err(ApiError::internal)?;
    s.storage.admit_copy(catalog_bytes)?;
    let staged = Staged::new(&data_dir).map_err(ApiError::internal)?;
    let to = staged.data();
    let stats = s.kb.call(move |kb| kb.snapshot(&to)).await??;
    tracing::info!(
        files = stats.files,
        bytes = stats.bytes,
        copied = stats.copied_bytes,
        "backup: knowledge base snapshot taken"
    );
    let kv_dir = if kv { s.kv_dir.clone() } else { None };
    let staged = tokio::task::spawn_blocking(move || -> crate::error::Result<Staged> {
        backup::stage_server_files(&data_dir, &staged)?;
        if let Some(kv) = &kv_dir {
            backup::stage_kv(kv, &staged)?;
        }
        Ok(staged)
    })
    .await
    .map_err(ApiError::internal)?
    .map_err(ApiError::internal)?;
    let (tx, mut rx) = tokio::sync::mpsc::channel(4);
    let with_kv = kv;
    tokio::task::spawn_blocking(move || {
        let mut w = ChannelWriter::new(tx);
        match backup::write_archive(&staged, with_kv, &mut w) {
            Ok(m) => tracing::info!(
                files = m.files.len(),
                bytes = m.total_bytes(),
                "backup written"
            ),
            Err(e) => {
                tracing::error!("backup failed: {e}");
                w.fail(std::io::Error::other(e.to_string()));
            }
        }
        drop(staged);
    });
    let stream = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
    let name = format!(
        "engram-backup-{}.tar.zst",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    );
    Ok((
        [
            (header::CONTENT_TYPE, "application/zstd".to_owned()),
            (
                header::CONTENT_DISPOSITION,
                format!("attachment; filename=\"{name}\""),
            ),
        ],
        Body::from_stream(stream),
    )
        .into_response())
}
