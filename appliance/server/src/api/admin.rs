//! Administration routes: backups, restores (staged for the next start), the version and its
//! history.

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::api::{AppState, Caller};
use crate::auth::Scope;
use crate::backup::{self, ChannelWriter, Staged};
use crate::error::ApiError;
use crate::versions::{self, Formats, VersionEvent};

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
    require_every_collection(&caller, "a backup holds")?;
    stream_backup(&s, p.kv).await
}

/// Scope `admin` and no collection grants: what touches every collection at once (`what`:
/// "a backup holds", "a restore replaces").
fn require_every_collection(caller: &Caller, what: &str) -> Result<(), ApiError> {
    caller.require(Scope::Admin)?;
    if caller.collections.is_some() {
        return Err(ApiError::Forbidden {
            reason: format!(
                "{what} every collection: it needs an admin key without collection grants"
            ),
        });
    }
    Ok(())
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
    // Named by its UTC time, as the package's pre-upgrade snapshots are:
    // engram-backup-20261207T101500Z.tar.zst.
    let at = crate::console::view::datetime(crate::console::users::now_ms());
    let name = format!(
        "engram-backup-{}Z.tar.zst",
        at.replace(['-', ':'], "").replace(' ', "T")
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

/// This build's version and formats, and every version that has run on this data directory.
#[derive(Debug, Serialize, ToSchema)]
pub struct VersionInfo {
    pub version: String,
    pub formats: Formats,
    /// Oldest first: the install, then each upgrade and rollback.
    pub history: Vec<VersionEvent>,
}

/// Reads the version history (for the API and the console).
pub async fn version_info(s: &AppState) -> Result<VersionInfo, ApiError> {
    let dir = s.data_dir.clone();
    let history = tokio::task::spawn_blocking(move || versions::history(&dir))
        .await
        .map_err(ApiError::internal)?
        .map_err(ApiError::internal)?;
    Ok(VersionInfo {
        version: versions::version().into(),
        formats: Formats::current(),
        history,
    })
}

/// The running version, the on-disk formats it reads and writes, and the version history of
/// this data directory: the install, each upgrade and rollback, with the snapshot the package
/// took before each (`docs/formats/upgrade.md`). Scope `admin`.
#[utoipa::path(get, path = "/api/v1/admin/version", tag = "admin",
    responses(
        (status = 200, body = VersionInfo),
        (status = 403, body = crate::api::openapi::ErrorBody)),
    security(("bearer" = [])))]
pub async fn version(
    State(s): State<AppState>,
    caller: Caller,
) -> Result<Json<VersionInfo>, ApiError> {
    caller.require(Scope::Admin)?;
    Ok(Json(version_info(&s).await?))
}

/// A restore verified and staged for the next start.
#[derive(Debug, Serialize, ToSchema)]
pub struct RestoreStaged {
    /// Always true: nothing changes until engramd starts again.
    pub staged: bool,
    /// The Engram version that wrote the backup.
    pub engram_version: String,
    pub created_unix_s: u64,
    pub files: usize,
    pub bytes: u64,
    /// Whether the archive carries chunk KV.
    pub kv: bool,
    pub next_step: String,
}

/// Verifies an archive (`POST /api/v1/admin/backup`'s or `engramd backup`'s) streamed from
/// `body` and stages it beside the served data; the next start swaps it in.
pub async fn stage_restore<S, E>(
    s: &AppState,
    mut body: S,
    declared_len: Option<u64>,
) -> Result<RestoreStaged, ApiError>
where
    S: futures_util::Stream<Item = Result<axum::body::Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    use futures_util::StreamExt;
    // Room for the unpacked tree: the archive is compressed, most of it (PDFs, index
    // segments) barely.
    s.storage
        .admit_copy(declared_len.unwrap_or(0).saturating_mul(2))?;
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let data_dir = s.data_dir.clone();
    let job = tokio::task::spawn_blocking(move || {
        backup::stage_restore(backup::ChannelReader::new(rx), &data_dir)
    });
    while let Some(piece) = body.next().await {
        let piece = piece.map_err(|e| std::io::Error::other(format!("the upload broke off: {e}")));
        let broke = piece.is_err();
        // A closed channel: the unpacker has stopped (refused the archive).
        if tx.send(piece).await.is_err() || broke {
            break;
        }
    }
    drop(tx);
    let m = job
        .await
        .map_err(ApiError::internal)?
        .map_err(|e| match e {
            crate::ServerError::Restore { reason } => ApiError::invalid("archive", reason),
            crate::ServerError::Io { ref source, .. }
                if source.kind() == std::io::ErrorKind::StorageFull =>
            {
                ApiError::InsufficientStorage {
                    reason: format!("the restore does not fit on the data disk: {e}"),
                }
            }
            e => ApiError::internal(e),
        })?;
    tracing::warn!(
        backup_of = %m.engram_version,
        files = m.files.len(),
        bytes = m.total_bytes(),
        "restore staged: applied at the next start"
    );
    Ok(RestoreStaged {
        staged: true,
        engram_version: m.engram_version.clone(),
        created_unix_s: m.created_unix_s,
        files: m.files.len(),
        bytes: m.total_bytes(),
        kv: m.kv,
        next_step: "restart engramd (systemctl restart engramd): the data directory is replaced \
                    by the archive's before anything opens it"
            .into(),
    })
}

/// Restores a backup: the archive (`application/zstd`, as `POST /api/v1/admin/backup` or
/// `engramd backup` wrote it) is streamed in, checked file by file against its manifest
/// (checksums, format and catalog versions) and staged beside the served data; nothing
/// changes until engramd restarts, when the data directory is replaced by the archive's
/// before anything opens it. A damaged or newer archive is refused (400) and nothing is
/// staged; a second restore replaces the first. Scope `admin`, with no collection grants.
#[utoipa::path(post, path = "/api/v1/admin/restore", tag = "admin",
    request_body(content = Vec<u8>, content_type = "application/octet-stream",
        description = "the archive (a zstd-compressed tar; `application/zstd` is accepted too)"),
    responses(
        (status = 202, body = RestoreStaged),
        (status = 400, body = crate::api::openapi::ErrorBody),
        (status = 403, body = crate::api::openapi::ErrorBody),
        (status = 507, body = crate::api::openapi::ErrorBody)),
    security(("bearer" = [])))]
pub async fn restore(
    State(s): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> Result<(StatusCode, Json<RestoreStaged>), ApiError> {
    require_every_collection(&caller, "a restore replaces")?;
    let len = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let staged = stage_restore(&s, body.into_data_stream(), len).await?;
    Ok((StatusCode::ACCEPTED, Json(staged)))
}
