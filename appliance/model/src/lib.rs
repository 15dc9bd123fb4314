//! Llama-family transformer inference on the CPU, proven against llama.cpp.
//!
//! Engram's compute-for-storage design needs an engine whose KV cache is data the caller owns:
//! fusion assembles a cache from stored chunk KV and hands it to [`Model::forward`] together
//! with the tokens to (re)compute and their explicit positions. So the weights are immutable
//! views into the memory-mapped GGUF file, positions are given per token, and attention masks
//! by position rather than by slot order.
//!
//! ```no_run
//! use engram_model::{Logits, Model};
//! let model = Model::load("models/SmolLM2-135M-Instruct.Q4_1.gguf", 2)?;
//! let mut kv = model.new_cache(64);
//! let logits = model.forward(&[1, 9690, 198], &[0, 1, 2], &mut kv, Logits::Last)?;
//! let next = engram_model::argmax(&logits);
//! # let _ = next;
//! # Ok::<(), engram_model::ModelError>(())
//! ```
#![forbid(unsafe_code)]

mod config;
mod error;
mod generate;
#[cfg(feature = "cuda")]
mod gpu;
mod kv;
mod model;
mod ops;
pub mod placement;
mod sampling;
mod weights;

pub use config::{Architecture, ModelConfig, RopeScaling, RopeStyle, SUPPORTED_ARCHITECTURES};
pub use error::{ModelError, Result};
pub use generate::{
    generate, FinishReason, GenerateRequest, Generation, GenerationStats, StopMatcher,
    PREFILL_CHUNK,
};
#[cfg(feature = "cuda")]
pub use gpu::{same_top, GpuCache, GpuModel, HostKv, LayerTimes};
pub use kv::KvCache;
pub use model::{Blend, LayerObserver, Logits, Model, QueryObserver, Sequence};
pub use ops::Rope;
pub use sampling::{argmax, top_k, Sampler, SamplingParams};

#[cfg(test)]
mod tests;
