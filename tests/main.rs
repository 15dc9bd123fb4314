//! Engram's one integration test binary (ripgrep's layout): each module tests one area end to
//! end against the real default models and the reference outputs in `../shared/golden` (and
//! `tests/golden`, for references computed on files the tests make from those models).
//!
//! Models come from `$ENGRAM_MODELS_DIR` or `./models` (run `scripts/fetch-models.sh`); the
//! reference files from `$ENGRAM_SHARED_DIR` or `../shared`. A missing model or reference file
//! fails the test with the command that fixes it: these tests never skip silently.

// Shared helpers: locating models, golden files and the `engram` binary.
mod common;
// Tokenizer and chat template against llama.cpp's golden tokenization and rendering.
mod tokenizer_golden;
// The engine through `engram generate`/`tokenize`: logits and greedy tokens against llama.cpp.
mod engine_golden;
// The engine on K-quant and Q5 weights (the default model through `engram requantize`) against
// llama.cpp's reference in tests/golden.
mod engine_golden_kquant;
// Mixture-of-experts models (Qwen3-MoE, Mixtral; random weights from `engram gen-model`)
// against llama.cpp's reference in tests/golden.
mod engine_golden_moe;
// The BERT embedder against sentence-transformers' reference vectors.
mod embed_golden;
// Knowledge bases: ingest, delete, recovery, hybrid search and the `engram` kb commands.
mod kb;
// Compute for storage: fused prefill vs full, stored KV, tiers, prefix cache, gate, `ask`.
mod fusion;
// The answer pipeline's grounding (`engram-rag`) with the real embedder and indexes.
mod rag;
