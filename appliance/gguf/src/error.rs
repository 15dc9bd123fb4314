//! Errors of the GGUF reader and writer.

use std::path::PathBuf;

/// Everything that can go wrong reading or writing a GGUF file.
///
/// A truncated or inconsistent file is always `Corrupted` (with what was being read and at which
/// byte offset), never a panic or an out-of-bounds read.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("not a GGUF file: magic is {found:#010x}, expected {expected:#010x} (\"GGUF\")")]
    BadMagic { found: u32, expected: u32 },
    #[error("unsupported GGUF version {version} (supported: 2 and 3)")]
    UnsupportedVersion { version: u32 },
    #[error("corrupted GGUF file at byte {offset}: {comment}")]
    Corrupted { offset: u64, comment: String },
    #[error("metadata key `{key}` is missing")]
    MissingKey { key: String },
    #[error("metadata key `{key}` has type {found}, expected {expected}")]
    WrongType {
        key: String,
        found: &'static str,
        expected: &'static str,
    },
    #[error("tensor `{name}` is missing")]
    MissingTensor { name: String },
    #[error("tensor `{name}`: rows of {row} elements are not a multiple of the {ty} block size {block_size}")]
    NotBlockMultiple {
        name: String,
        row: u64,
        ty: &'static str,
        block_size: usize,
    },
    #[error("tensor `{name}`: {found} bytes given, its type and shape take {expected}")]
    TensorBytes {
        name: String,
        found: u64,
        expected: u64,
    },
    #[error("tensor stream: {declared} tensors declared, {written} written")]
    TensorCount { declared: usize, written: usize },
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, GgufError>;

pub(crate) fn corrupted(offset: u64, comment: impl Into<String>) -> GgufError {
    GgufError::Corrupted {
        offset,
        comment: comment.into(),
    }
}
