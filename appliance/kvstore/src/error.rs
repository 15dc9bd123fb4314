//! The crate's error type.

use std::path::PathBuf;

use crate::layout::{KvLayout, ModelFingerprint};
use crate::tier::TierKind;

/// Why a blob or tier operation failed.
///
/// The blob errors split in two: `Corrupted` and `UnsupportedVersion` say the bytes cannot be
/// trusted or read, while `ModelMismatch`, `TokenMismatch` and `LayoutMismatch` say an intact blob
/// belongs to another model or chunk. Either way the caller recomputes the chunk's KV; see
/// [`KvStoreError::is_corrupt`] for the ones after which the stored copy should be dropped.
/// `Io` and `NoSpace` are kept apart from `Corrupted`: they may be transient and are no reason to
/// throw stored KV away.
#[derive(Debug, thiserror::Error)]
pub enum KvStoreError {
    /// The bytes do not check out: bad magic, truncated, checksum mismatch, a header field out of
    /// range or sizes that disagree with the length.
    #[error("corrupted KV blob: {what}")]
    Corrupted { what: String },
    /// The blob was written by another version of the format.
    #[error(
        "KV blob format version {found} is not supported (this build reads version {supported})"
    )]
    UnsupportedVersion { found: u32, supported: u32 },
    /// The blob was computed by another model (or another build of its weights).
    #[error("KV blob model fingerprint {found} differs from the expected {expected}")]
    ModelMismatch {
        found: ModelFingerprint,
        expected: ModelFingerprint,
    },
    /// The blob holds the KV of other token ids.
    #[error(
        "KV blob token ids differ from the chunk's: {stored_tokens} stored, {expected_tokens} expected"
    )]
    TokenMismatch {
        stored_tokens: usize,
        expected_tokens: usize,
    },
    /// The blob's shape (layers, KV heads, head dimension, tokens) is not the expected one.
    #[error("KV blob layout {found} differs from the expected {expected}")]
    LayoutMismatch { found: KvLayout, expected: KvLayout },
    /// A layout dimension is above the format's limit, or a chunk's buffers disagree with it.
    #[error("{what} is {value}, above the limit of {limit}")]
    TooLarge {
        what: &'static str,
        value: u64,
        limit: u64,
    },
    /// A [`crate::ChunkKv`] whose token ids or K/V buffers disagree with its layout.
    #[error("chunk KV {what} has {found} entries, its layout {layout} needs {expected}")]
    BadChunk {
        what: &'static str,
        found: usize,
        expected: usize,
        layout: KvLayout,
    },
    /// A dtype name other than `f16` or `int8`.
    #[error("unknown KV dtype {found:?} (expected \"f16\" or \"int8\")")]
    UnknownDtype { found: String },
    /// A file-system operation failed.
    #[error("I/O error during {op} on {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The blob does not fit in the tier's byte budget and nothing can be evicted to make room
    /// (it is larger than the whole budget, or concurrent writes hold the rest).
    #[error("{tier} tier is full: {needed} bytes needed, budget is {budget} bytes")]
    Full {
        tier: TierKind,
        needed: u64,
        budget: u64,
    },
    /// The file system ran out of space (ENOSPC or EDQUOT) while writing, or lacks the free
    /// space the tier must leave ([`crate::NvmeOptions::reserve_free_bytes`]) beyond this
    /// write with nothing left to evict; nothing was stored.
    #[error("no space left on the device holding {path}")]
    NoSpace { path: PathBuf },
    /// Another `NvmeTier` holds the directory's lock file.
    #[error("KV tier directory {path} is locked by another process or tier")]
    Locked { path: PathBuf },
}

impl KvStoreError {
    /// True when the bytes themselves are bad (`Corrupted`, `UnsupportedVersion`): the stored
    /// copy is useless and should be dropped ([`crate::KvStore::report_corrupt`]).
    pub fn is_corrupt(&self) -> bool {
        matches!(
            self,
            KvStoreError::Corrupted { .. } | KvStoreError::UnsupportedVersion { .. }
        )
    }

    pub(crate) fn corrupted(what: impl Into<String>) -> KvStoreError {
        KvStoreError::Corrupted { what: what.into() }
    }

    pub(crate) fn io(
        op: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> KvStoreError {
        KvStoreError::Io {
            op,
            path: path.into(),
            source,
        }
    }

    /// An error of the write path: running out of space becomes `NoSpace`, the rest `Io`.
    pub(crate) fn write(
        op: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> KvStoreError {
        if is_no_space(&source) {
            KvStoreError::NoSpace { path: path.into() }
        } else {
            KvStoreError::io(op, path, source)
        }
    }
}

/// ENOSPC (device full) and EDQUOT (quota exhausted) both mean "this write cannot fit".
pub(crate) fn is_no_space(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
        || e.kind() == std::io::ErrorKind::StorageFull
}

pub type Result<T> = std::result::Result<T, KvStoreError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enospc_and_edquot_map_to_no_space() {
        for errno in [libc::ENOSPC, libc::EDQUOT] {
            let e = KvStoreError::write("write", "/x", std::io::Error::from_raw_os_error(errno));
            assert!(matches!(e, KvStoreError::NoSpace { .. }), "{errno}: {e}");
        }
        let e = KvStoreError::write("write", "/x", std::io::Error::from_raw_os_error(libc::EIO));
        assert!(matches!(e, KvStoreError::Io { op: "write", .. }), "{e}");
        assert!(!e.is_corrupt());
        assert!(KvStoreError::corrupted("x").is_corrupt());
    }
}
