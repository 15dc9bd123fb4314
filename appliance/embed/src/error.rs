//! The crate's error type: every fallible step of loading a model folder or embedding text.

use std::path::PathBuf;

/// Why a model folder could not be loaded, or a text could not be embedded.
#[derive(Debug, thiserror::Error)]
pub enum EmbedError {
    /// A file the model folder must contain is not there.
    #[error("{what} is missing: {path} does not exist")]
    MissingFile {
        /// The file that was looked for.
        path: PathBuf,
        /// What the file holds, e.g. "BERT config (config.json)".
        what: &'static str,
    },

    /// A file exists but could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },

    /// A settings file is not valid JSON.
    #[error("{path} is not valid JSON: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's complaint.
        source: serde_json::Error,
    },

    /// A settings field is missing or out of range.
    #[error("{path}: field `{field}` {reason}")]
    Config {
        /// The settings file.
        path: PathBuf,
        /// The offending field.
        field: String,
        /// What is wrong with it, e.g. "is missing" or "must be at most 512, got 1024".
        reason: String,
    },

    /// `hidden_act` names an activation this crate does not implement.
    #[error("{path}: hidden_act `{act}` is not supported (supported: {supported})")]
    UnsupportedActivation {
        /// The config file.
        path: PathBuf,
        /// The activation it names.
        act: String,
        /// The activations that are implemented.
        supported: &'static str,
    },

    /// The safetensors file is malformed.
    #[error("{path} is not a valid safetensors file: {source}")]
    Safetensors {
        /// The weights file.
        path: PathBuf,
        /// The parser's complaint.
        source: safetensors::SafeTensorError,
    },

    /// A tensor the architecture needs is not in the weights file.
    #[error("{path} has no tensor `{name}`")]
    MissingTensor {
        /// The weights file.
        path: PathBuf,
        /// The tensor's full name (with any `bert.` prefix the file uses).
        name: String,
    },

    /// A tensor has a shape other than the config implies.
    #[error(
        "{path}: tensor `{name}` has shape {actual:?}, expected {expected:?} from config.json"
    )]
    TensorShape {
        /// The weights file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// The shape config.json implies.
        expected: Vec<usize>,
        /// The shape stored.
        actual: Vec<usize>,
    },

    /// A tensor is stored in a type other than F32, F16 or BF16.
    #[error("{path}: tensor `{name}` has dtype {dtype}; supported: F32, F16, BF16")]
    TensorDtype {
        /// The weights file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// The stored dtype.
        dtype: String,
    },

    /// `tokenizer.json` could not be loaded or configured.
    #[error("cannot load tokenizer {path}: {reason}")]
    TokenizerLoad {
        /// The tokenizer file.
        path: PathBuf,
        /// The tokenizers crate's complaint.
        reason: String,
    },

    /// The tokenizer failed on a text.
    #[error("cannot tokenize text: {reason}")]
    Tokenize {
        /// The tokenizers crate's complaint.
        reason: String,
    },

    /// The tokenizer produced an id the embedding table has no row for.
    #[error("token id {id} is out of range for vocab_size {vocab_size}: tokenizer.json does not match the model")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// Rows of the word-embedding table.
        vocab_size: usize,
    },

    /// A sequence is longer than the model's position table (only reachable through a
    /// tokenizer that ignores its truncation setting).
    #[error("sequence of {len} tokens exceeds max_seq_length {max}")]
    SequenceTooLong {
        /// Tokens in the sequence.
        len: usize,
        /// The limit.
        max: usize,
    },

    /// A CPU kernel refused its input (a bug here) or the thread pool could not start.
    #[error(transparent)]
    Kernel(#[from] engram_kernels::KernelError),
}

/// `Result` with [`EmbedError`].
pub type Result<T> = std::result::Result<T, EmbedError>;
