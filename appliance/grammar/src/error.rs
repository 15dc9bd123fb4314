//! The grammar crate's error type.

use thiserror::Error;

/// Why a schema cannot be enforced.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum GrammarError {
    /// A keyword the grammar cannot enforce: refused rather than silently ignored.
    #[error("schema keyword `{keyword}` at {path} is not supported by constrained decoding")]
    Unsupported { path: String, keyword: String },
    /// The schema itself is wrong (a bad type, a dangling `$ref`, ...).
    #[error("invalid schema at {path}: {reason}")]
    BadSchema { path: String, reason: String },
    /// The compiled grammar would exceed [`crate::MAX_RULES`].
    #[error("the schema compiles to more than {limit} grammar rules")]
    TooLarge { limit: usize },
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, GrammarError>;
