//! Compute for storage (以存换算): chunk KV computed once at ingestion and stored, then at
//! question time loaded, placed at its positions and fused with a few recomputed tokens.
//!
//! - [`chunks`](ChunkStore): precompute a chunk's KV in a fixed frame, store and fetch it
//!   through the tiers of `engram-kvstore`, verified against the model and the token ids.
//! - [`fused_prefill`]: assemble prefix, chunks and suffix in the cache under a [`Policy`]
//!   (`full`, `reuse`, `boundary:N`, `deviation:R`).
//! - [`PrefixCache`]: exact KV of shared prompt prefixes.
//! - [`gate`](FidelityGate): the per-model self-check that decides whether fusion is used.
//! - [`retain_distinct`]: drops retrieved passages that repeat better-ranked ones.
#![forbid(unsafe_code)]

mod answer;
mod chunks;
mod copy;
mod dedup;
mod error;
mod evidence;
mod fuse;
mod gate;
#[cfg(feature = "cuda")]
mod gpu;
mod policy;
mod prefix;
mod prompt;

pub use answer::{
    best_coverage, best_term_coverage, no_answer, not_answered, question_coverage, relevant,
    relevant_sentence, sentences_to_embed, AnswerRule, AnswerRules, OutputText, ANSWER_STOPS,
    COVERAGE_FLOOR, DENSE_FLOOR, MAX_CHECKED_SENTENCES, SENTENCE_FLOOR, TERM_COVERAGE_FLOOR,
};
pub use chunks::{
    bos_frame, precompute, ChunkCounters, ChunkCounts, ChunkStore, Ensured, FetchTimes, Fetched,
    Reject, Source, FINGERPRINT_RECORD,
};
pub use copy::{check_copy_bias, ends_number, CopyBias, DEFAULT_COPY_BIAS, MAX_COPY_BIAS};
pub use dedup::{retain_distinct, retain_language, REDUNDANT_SHARE};
pub use error::{FusionError, Result};
pub use evidence::{
    evidence, evidence_candidates, evidence_to_embed, evidence_within, nearest_evidence, Candidate,
    EVIDENCE_NEAR_SHARE, MAX_EVIDENCE_CANDIDATES, MAX_EVIDENCE_CHARS,
};
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
    chunk_text, chunk_tokens, han_share, is_chinese, rag_frame, rag_frame_for, rag_prefix_frame,
    rag_prompt, rag_prompt_with, Layout, DEFAULT_LAYOUT, DEFAULT_SYSTEM, EVIDENCE, EVIDENCE_ZH,
    FRAME_CONTEXT, LAYOUTS, QUESTION_INSTRUCTION,
};
