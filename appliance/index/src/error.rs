//! The crate's error type.

use std::path::PathBuf;

/// Why an index operation failed.
///
/// `Corrupt` and `Mismatch` are the two answers to "can this directory be used as it is?": the
/// catalog rebuilds the index from its own records in both cases, so they are kept apart from
/// `Io`, which may be transient and is not a reason to throw an index away.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    /// A read or write of an index file failed.
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The files are there but do not check out: bad checksum, unreadable metadata, missing
    /// segment, truncated file. Rebuild the index.
    #[error("index at {path} is corrupt: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    /// The index is intact but was built for something else (another vector dimension, another
    /// embedding model, another schema or format version). Rebuild the index.
    #[error("index at {path} was built with {what} {found}, expected {expected}")]
    Mismatch {
        path: PathBuf,
        what: &'static str,
        expected: String,
        found: String,
    },
    /// Another writer holds the index directory.
    #[error("index at {path} is locked by another writer")]
    Locked { path: PathBuf },
    /// A vector given to `add` has the wrong dimension.
    #[error(
        "vector of chunk {chunk_id} has dimension {found}, the index has dimension {expected}"
    )]
    VectorDim {
        chunk_id: u64,
        expected: usize,
        found: usize,
    },
    /// A query vector has the wrong dimension.
    #[error("query vector has dimension {found}, the index has dimension {expected}")]
    QueryDim { expected: usize, found: usize },
    /// A vector that cannot be normalised (zero length, NaN or infinite components).
    #[error("vector of chunk {chunk_id} is not usable: {reason}")]
    BadVector { chunk_id: u64, reason: &'static str },
    /// A query vector that cannot be normalised.
    #[error("query vector is not usable: {reason}")]
    BadQuery { reason: &'static str },
    /// An earlier write failed; the in-memory state may be ahead of the disk, so the index
    /// refuses further writes until it is reopened (as redb does).
    #[error("index at {path} refuses writes after an earlier failed write; reopen it")]
    Poisoned { path: PathBuf },
    /// Any other tantivy failure.
    #[error("tantivy error on {path}: {source}")]
    Tantivy {
        path: PathBuf,
        #[source]
        source: tantivy::TantivyError,
    },
    /// The HNSW library failed to dump its graph.
    #[error("hnsw error on {path}: {reason}")]
    Hnsw { path: PathBuf, reason: String },
}

impl IndexError {
    /// Whether the disk was full (ENOSPC or a quota): the write can succeed once space is
    /// freed.
    pub fn is_storage_full(&self) -> bool {
        let full = |e: &std::io::Error| {
            matches!(
                e.kind(),
                std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
            )
        };
        match self {
            IndexError::Io { source, .. } => full(source),
            IndexError::Tantivy { source, .. } => match source {
                tantivy::TantivyError::IoError(e) => full(e),
                other => other.to_string().contains("No space left on device"),
            },
            IndexError::Hnsw { reason, .. } => reason.contains("No space left on device"),
            _ => false,
        }
    }

    /// True for the errors after which the catalog should rebuild the index from its records.
    pub fn needs_rebuild(&self) -> bool {
        matches!(
            self,
            IndexError::Corrupt { .. } | IndexError::Mismatch { .. }
        )
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> IndexError {
        IndexError::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn corrupt(path: impl Into<PathBuf>, reason: impl Into<String>) -> IndexError {
        IndexError::Corrupt {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, IndexError>;
