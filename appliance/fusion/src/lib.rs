//! Compute for storage (以存换算): chunk KV computed once at ingestion and stored, then at
//! question time loaded, placed at its positions and fused with a few recomputed tokens.
//!
//! - [`chunks`](ChunkStore): precompute a chunk's KV in a fixed frame, store and fetch it
//!   through the tiers of `engram-kvstore`, verified against the model and the token ids.
//! - [`fused_prefill`]: assemble prefix, chunks and suffix in the cache under a [`Policy`]
//!   (`full`, `reuse`, `boundary:N`, `deviation:R`).
//! - [`PrefixCache`]: exact KV of shared prompt prefixes.
//! - [`gate`](FidelityGate): the per-model self-check that decides whether fusion is used.
//! - [`build_prompt`]: the RAG prompt's layout around the chunks, in the frame their KV was
//!   computed in.
//!
//! What a question is answered from and what an answer's text is (grounding, the evidence
//! sentence, the answer rules) is `engram-rag`'s.
#![forbid(unsafe_code)]

mod chunks;
mod error;
mod fuse;
mod gate;
#[cfg(feature = "cuda")]
mod gpu;
mod policy;
mod prefix;
mod prompt;

pub use chunks::{
    bos_frame, precompute, ChunkCounters, ChunkCounts, ChunkStore, Ensured, FetchTimes, Fetched,
    Reject, Source, FINGERPRINT_RECORD,
};
pub use error::{FusionError, Result};
pub use fuse::{
    fused_prefill, fused_prefill_interleaved, fused_prefill_on, FuseStats, FusedPrompt, Interleave,
    Prefilled, Runner,
};
pub use gate::{
    greedy, kl_divergence, recorded_gate, FidelityGate, GateLimits, GateReport, GATE_MAX_KL,
    GATE_MIN_AGREEMENT, GATE_TOKENS,
};
#[cfg(feature = "cuda")]
pub use gpu::{GpuRunner, GPU_PREFILL_PIECE};
pub use policy::{Policy, CHECK_LAYER, DEFAULT_POLICY};
pub use prefix::{PrefixCache, PrefixEntry, PrefixHit, BLOCK};
pub use prompt::{
    build_prompt, chunk_text, chunk_tokens, han_share, is_chinese, is_han, rag_frame,
    rag_frame_for, rag_prefix_frame, Layout, DEFAULT_LAYOUT, DEFAULT_SYSTEM, EVIDENCE, EVIDENCE_ZH,
    FRAME_CONTEXT, LAYOUTS, MAX_EVIDENCE_CHARS, QUESTION_INSTRUCTION,
};
