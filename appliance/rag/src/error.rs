//! The answer pipeline's error type.

use thiserror::Error;

/// What can go wrong between a question's hits and its answer.
#[derive(Debug, Error)]
pub enum RagError {
    /// The embedder (grounding's similarities).
    #[error(transparent)]
    Kb(#[from] engram_kb::KbError),
    /// The prompt's KV (stored chunks, fused prefill).
    #[error(transparent)]
    Fusion(#[from] engram_fusion::FusionError),
    /// The forward pass or the sampler.
    #[error(transparent)]
    Model(#[from] engram_model::ModelError),
    /// The prompt's tokens.
    #[error(transparent)]
    Tokenizer(#[from] engram_tokenizer::TokenizerError),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, RagError>;
