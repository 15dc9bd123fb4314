//! Sentence embeddings for ingest and retrieval: a BERT encoder (all-MiniLM-L6-v2 by default)
//! on Engram's own CPU kernels, with sentence-transformers' pooling and L2 normalisation.
//!
//! # Why
//!
//! Every chunk a knowledge base ingests and every question it answers is embedded, and a
//! collection is only searchable if both sides come from the same function. Engram runs that
//! function itself, on the matmul kernels that serve the LLM, instead of shipping a Python
//! runtime, and matches sentence-transformers' `encode()` to float rounding (checked against
//! its reference vectors in `tests/embed_golden.rs`): the same tokenization (`tokenizer.json`
//! through the `tokenizers` crate, truncated to `max_seq_length` with [CLS] and [SEP]), the
//! same encoder, mean pooling over tokens and unit length. Vectors are unit length, so cosine
//! similarity is a dot product.
//!
//! Any BERT-family sentence-transformers folder loads the same way (`config.json`,
//! `model.safetensors`, `tokenizer.json`, optional `sentence_bert_config.json` and
//! `1_Pooling/config.json`); what is missing or unsupported is an error that names it.
//! [`Embedder::model_id`] names the folder and hashes its contents, so a collection records
//! which model built it.
//!
//! # Example
//!
//! ```no_run
//! use engram_embed::Embedder;
//!
//! let embedder = Embedder::load("models/all-MiniLM-L6-v2".as_ref(), 2)?;
//! let v = embedder.embed(&["How do I reset my password?", "Click \"Forgot password\"."])?;
//! assert_eq!(v[0].len(), embedder.dim());
//! let cosine: f32 = v[0].iter().zip(&v[1]).map(|(a, b)| a * b).sum();
//! println!("{}: cosine {cosine:.3}", embedder.model_id());
//! # Ok::<(), engram_embed::EmbedError>(())
//! ```
#![forbid(unsafe_code)]

mod config;
mod embedder;
#[cfg(test)]
mod erf_ref;
mod error;
mod model;
mod ops;
mod weights;

pub use embedder::{Embedder, MAX_BATCH_TOKENS};
pub use error::{EmbedError, Result};

#[cfg(test)]
mod tests;
