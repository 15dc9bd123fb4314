//! Tokenizers and chat templates built from a GGUF file's own metadata, matching llama.cpp.
//!
//! Engram serves customer models it has never seen, and stored KV caches are only reusable if
//! every prompt tokenizes to exactly the ids the reference runtime would produce. So the
//! tokenizer is rebuilt from `tokenizer.ggml.*` inside the GGUF file (never from a downloaded
//! `tokenizer.json`) and follows llama.cpp's `llama_tokenize` step for step: special tokens are
//! cut out longest first, the pre-tokenizer regexes are chosen by `tokenizer.ggml.pre`, and BPE
//! (from the Hugging Face `tokenizers` crate) runs on the rest. The chat template is the file's
//! Jinja `tokenizer.chat_template`, rendered with jinja2's settings as Hugging Face does.
//!
//! ```no_run
//! use engram_tokenizer::{ChatTemplate, Message, Tokenizer};
//!
//! let file = engram_gguf::GgufFile::open("models/SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! let tokenizer = Tokenizer::from_gguf(file.metadata())?;
//! let template = ChatTemplate::from_gguf(file.metadata())?.expect("model has a chat template");
//! let prompt = template.render(&[Message::new("user", "What is the capital of France?")], true)?;
//! let mut ids = Vec::new();
//! if tokenizer.add_bos() {
//!     ids.extend(tokenizer.bos_id());
//! }
//! ids.extend(tokenizer.encode(&prompt, true)?);
//! assert_eq!(tokenizer.decode(&ids, false), prompt);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Supported: `tokenizer.ggml.model = "gpt2"` (byte-level BPE) with the pre-tokenizers listed in
//! `pretok.rs` (default, gpt2, llama3, qwen2, smollm/starcoder, deepseek-llm, deepseek-coder,
//! deepseek-v3, falcon, bloom, tekken, gpt-4o and their aliases), and `"llama"` (SentencePiece
//! BPE with byte fallback). An unknown model or pre-tokenizer is an error naming it, as in
//! llama.cpp, rather than a silently different tokenization.
#![forbid(unsafe_code)]

mod byte_level;
mod error;
mod pretok;
mod template;
mod tiktoken;
mod tokenizer;
mod vocab;

pub use error::{Result, TokenizerError};
pub use template::{ChatTemplate, Message, KEY_CHAT_TEMPLATE};
pub use tiktoken::TiktokenVocab;
pub use tokenizer::{Detokenizer, Tokenizer};
pub use vocab::{ModelKind, TokenKind};

#[cfg(test)]
mod tests;
