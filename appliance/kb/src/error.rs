//! The crate's error type: everything that can stop a knowledge-base operation.

use std::path::PathBuf;

/// Why a knowledge-base operation failed.
///
/// A document that cannot be parsed is not an error of the operation: ingestion records it as a
/// failed document with its reason and goes on with the others.
#[derive(Debug, thiserror::Error)]
pub enum KbError {
    /// A file or folder of the data directory could not be read or written.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done, e.g. "writing blob".
        op: &'static str,
        /// The file or folder.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },

    /// The disk under the data directory has too little free space to open the catalog
    /// safely (sled writes as it opens, and must never run out of space mid-write).
    #[error("the disk under {path} has {available} bytes free; the catalog needs at least {needed} to open safely: free space (or grow the disk), then start again")]
    DiskFull {
        path: PathBuf,
        available: u64,
        needed: u64,
    },

    /// The sled catalog reported an error (I/O underneath, or its own corruption check).
    #[error("catalog: {0}")]
    Catalog(#[from] sled::Error),

    /// Stored bytes do not decode, or contradict each other: the caller rebuilds what it can.
    #[error("corrupted {what}: {comment}")]
    Corrupted {
        /// The record or file, e.g. "document 12" or "blob 3f2a...".
        what: String,
        /// What is wrong with it.
        comment: String,
    },

    /// The catalog was written by a version of Engram whose schema this one does not read.
    #[error("catalog schema version {found} is not supported (this build reads version {supported}); use the Engram release that wrote it")]
    SchemaVersion {
        /// The version stored in the catalog.
        found: u32,
        /// The version this build writes and reads.
        supported: u32,
    },

    /// No collection has this name.
    #[error("collection `{name}` does not exist (see `engram collections list`)")]
    CollectionNotFound {
        /// The name asked for.
        name: String,
    },

    /// A collection with this name exists already.
    #[error("collection `{name}` already exists")]
    CollectionExists {
        /// The name.
        name: String,
    },

    /// No document with this id or name in the collection.
    #[error("document `{doc}` is not in collection `{collection}` (see `engram docs list`)")]
    DocumentNotFound {
        /// The collection searched.
        collection: String,
        /// The id or name asked for.
        doc: String,
    },

    /// The operation needs the document in another stage (e.g. cancelling one that is
    /// already being parsed).
    #[error("document {doc} is {stage}; this needs it {wanted}")]
    WrongStage {
        /// The document id.
        doc: u64,
        /// Its stage now.
        stage: &'static str,
        /// The stage(s) the operation accepts.
        wanted: &'static str,
    },

    /// A name, setting or metadata entry breaks a rule; `field` names it.
    #[error("invalid {field}: {reason}")]
    Invalid {
        /// The offending field, e.g. "collection name" or "chunk_tokens".
        field: String,
        /// The rule it breaks, with the limit.
        reason: String,
    },

    /// An upload in a format no parser reads (by its name's extension and its first bytes):
    /// refused before it is stored. The message names the formats that are read.
    #[error("{0}")]
    UnsupportedFormat(engram_parse::ParseError),

    /// The embedder failed.
    #[error("embedding: {0}")]
    Embed(#[from] engram_embed::EmbedError),

    /// A BM25 or vector index failed.
    #[error("index: {0}")]
    Index(#[from] engram_index::IndexError),
}

impl KbError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        KbError::Io {
            op,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        KbError::Invalid {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// Whether the disk is full (ENOSPC, or a quota): the write can succeed once space is
    /// freed, and nothing was acknowledged.
    pub fn is_storage_full(&self) -> bool {
        let io = match self {
            KbError::DiskFull { .. } => return true,
            KbError::Io { source, .. } => Some(source),
            KbError::Catalog(sled::Error::Io(e)) => Some(e),
            KbError::Index(e) => return e.is_storage_full(),
            _ => None,
        };
        io.is_some_and(|e| {
            matches!(
                e.kind(),
                std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
            )
        })
    }

    pub(crate) fn corrupted(what: impl Into<String>, comment: impl Into<String>) -> Self {
        KbError::Corrupted {
            what: what.into(),
            comment: comment.into(),
        }
    }
}

/// `Result` with [`KbError`].
pub type Result<T> = std::result::Result<T, KbError>;
