//! Errors of model loading and inference.

/// Everything that can go wrong loading a model or running it.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] engram_gguf::GgufError),
    #[error(transparent)]
    Kernel(#[from] engram_kernels::KernelError),
    #[error(transparent)]
    Tokenizer(#[from] engram_tokenizer::TokenizerError),
    /// The GPU path failed or cannot run this model (feature `cuda`).
    #[error("GPU: {0}")]
    Gpu(String),
    #[error("unsupported architecture `{arch}` (supported: {supported})")]
    UnsupportedArchitecture {
        arch: String,
        supported: &'static str,
    },
    #[error("invalid model: {field} = {value}: {reason}")]
    InvalidConfig {
        field: &'static str,
        value: String,
        reason: String,
    },
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    TensorShape {
        name: String,
        found: Vec<u64>,
        expected: Vec<u64>,
    },
    #[error("tensor `{name}` is not part of the graph Engram implements for this architecture")]
    UnsupportedTensor { name: String },
    #[error("tensor `{name}` is required by this architecture but missing")]
    MissingWeight { name: String },
    #[error("tensor `{name}` has type {ty} which Engram cannot compute with")]
    UnsupportedTensorType { name: String, ty: &'static str },
    #[error("token id {id} is outside the vocabulary of {vocab_size}")]
    TokenOutOfRange { id: u32, vocab_size: usize },
    #[error("{tokens} tokens and {positions} positions given: each token needs one position")]
    PositionCount { tokens: usize, positions: usize },
    #[error("KV cache full: {used} of {capacity} slots used, {requested} more requested")]
    CacheFull {
        used: usize,
        capacity: usize,
        requested: usize,
    },
    #[error("KV cache layout {found} does not match the model's {expected}")]
    CacheLayout { found: String, expected: String },
    #[error("position {position} is negative or beyond the model's limit")]
    BadPosition { position: i64 },
    #[error("token {index} is to overwrite slot {slot}, which does not hold position {position}")]
    OverwriteSlot {
        index: usize,
        slot: usize,
        position: i32,
    },
    #[error("{overwrite} slots to overwrite given for {tokens} tokens")]
    OverwriteCount { overwrite: usize, tokens: usize },
    #[error("sequence {index} of a batched call has no tokens")]
    EmptySequence { index: usize },
    #[error("layer {layer} does not exist: the model has {n_layer} layers")]
    BadLayer { layer: usize, n_layer: usize },
    #[error("stored KV layout {found} does not match the cache's {expected}")]
    StoredLayout { found: String, expected: String },
    #[error("invalid sampling parameter {name} = {value}: {reason}")]
    Sampling {
        name: &'static str,
        value: String,
        reason: &'static str,
    },
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, ModelError>;
