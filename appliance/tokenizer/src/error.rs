//! Errors of the tokenizer and the chat template.

/// Everything that can go wrong building a tokenizer from GGUF metadata, encoding text or
/// rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A tiktoken vocabulary file (`*.tiktoken`) is unreadable or malformed.
    #[error("tiktoken vocabulary {path}: {reason}")]
    Tiktoken { path: String, reason: String },

    /// A metadata key is missing or has the wrong type.
    #[error(transparent)]
    Metadata(#[from] engram_gguf::GgufError),

    /// `tokenizer.ggml.model` names a tokenizer family this crate does not implement.
    #[error("tokenizer model `{model}` is not supported (supported: \"gpt2\" byte-level BPE, \"llama\" SentencePiece)")]
    UnsupportedModel { model: String },

    /// `tokenizer.ggml.pre` names a pre-tokenizer this crate does not know (llama.cpp refuses
    /// these too rather than tokenizing differently from the model's training).
    #[error("pre-tokenizer `{pre}` (tokenizer.ggml.pre) is not supported; known: {known}")]
    UnsupportedPreTokenizer { pre: String, known: String },

    /// A per-token array is shorter than `tokenizer.ggml.tokens`.
    #[error("`{key}` has {found} entries but `tokenizer.ggml.tokens` has {expected}")]
    LengthMismatch {
        key: &'static str,
        found: usize,
        expected: usize,
    },

    /// An element of a per-token array has the wrong type.
    #[error("`{key}`[{index}] is a {found}, expected {expected}")]
    WrongElementType {
        key: &'static str,
        index: usize,
        found: &'static str,
        expected: &'static str,
    },

    /// The vocabulary is empty.
    #[error("`tokenizer.ggml.tokens` is empty")]
    EmptyVocabulary,

    /// Two ids share one token text, so text -> id would be ambiguous.
    #[error(
        "token {text:?} appears twice in `tokenizer.ggml.tokens`, at ids {first} and {second}"
    )]
    DuplicateToken {
        text: String,
        first: u32,
        second: u32,
    },

    /// The vocabulary does not fit in 32-bit ids.
    #[error("`tokenizer.ggml.tokens` has {len} entries, more than the {max} that u32 ids allow")]
    VocabularyTooLarge { len: usize, max: u64 },

    /// A special-token id key points outside the vocabulary.
    #[error("`{key}` = {id} is outside the vocabulary of {vocab_size} tokens")]
    SpecialIdOutOfRange {
        key: &'static str,
        id: u64,
        vocab_size: usize,
    },

    /// A merge is not two space-separated parts.
    #[error("`tokenizer.ggml.merges`[{index}] = {merge:?} is not two parts separated by a space")]
    MalformedMerge { index: usize, merge: String },

    /// A merge refers to a token (one of its parts, or their concatenation) missing from the
    /// vocabulary.
    #[error("`tokenizer.ggml.merges`[{index}] = {merge:?} needs token {missing:?}, which is not in the vocabulary")]
    MergeOutOfVocabulary {
        index: usize,
        merge: String,
        missing: String,
    },

    /// The Hugging Face `tokenizers` backend refused the configuration or the input.
    #[error("tokenizer backend ({stage}): {message}")]
    Backend {
        stage: &'static str,
        message: String,
    },

    /// The chat template does not parse.
    #[error("chat template does not compile: {message}")]
    TemplateSyntax { message: String },

    /// The chat template failed while rendering (including its own `raise_exception`).
    #[error("chat template failed to render: {message}")]
    TemplateRender { message: String },
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, TokenizerError>;
