//! The fusion crate's error type.

use thiserror::Error;

/// Everything that can go wrong while precomputing, storing or fusing chunk KV.
#[derive(Debug, Error)]
pub enum FusionError {
    #[error(transparent)]
    Model(#[from] engram_model::ModelError),
    #[error(transparent)]
    Tokenizer(#[from] engram_tokenizer::TokenizerError),
    #[error(transparent)]
    Store(#[from] engram_kvstore::KvStoreError),
    #[error("invalid fusion policy `{text}`: {reason} (expected full, reuse, boundary:N or deviation:R)")]
    BadPolicy { text: String, reason: &'static str },
    #[error("empty chunk {index}: every chunk needs at least one token")]
    EmptyChunk { index: usize },
    #[error("the prompt's suffix (question and generation prompt) is empty")]
    EmptySuffix,
    #[error("prompt of {tokens} tokens exceeds the model's context of {context}")]
    TooLong { tokens: usize, context: usize },
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, FusionError>;
