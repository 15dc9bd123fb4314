//! CPU kernels for Engram: GGML block formats, dequantisation, quantised dot products and
//! matrix multiplication.
//!
//! # Why
//!
//! Engram runs GGUF models on the CPU and its answers must match llama.cpp's. That depends on
//! more than the weight layout: llama.cpp quantises each activation row on the fly to the
//! weight type's *vec-dot type* (Q8_0, Q8_1 or Q8_K, or f16/bf16/f32 for float weights) and then
//! takes integer dot products. This crate does the same, with the same rounding, so the model
//! crate gets llama.cpp's numerics from one entry point, [`matmul`].
//!
//! Matmuls run on a persistent [`ThreadPool`] (no thread is spawned per call). Every quantised
//! weight format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) goes through register-tiled
//! integer kernels (AVX-512 VNNI or AVX2) that reuse each
//! unpacked weight block across several tokens and each activation block across several rows.
//!
//! The f32 embedding model takes another route: its weights are packed once into row panels
//! ([`PackedF32`]) and [`matmul_packed`] runs BLAS-style outer-product micro-kernels (AVX-512
//! or AVX2 + FMA) near the FMA peak, with bit-identical results on every ISA. Its element-wise
//! steps have kernels of their own, also bit-identical on every ISA: bias + exact-erf GELU
//! ([`gelu_bias_rows`]), row softmax ([`softmax_rows`]) and LayerNorm ([`layer_norm_rows`]).
//!
//! Every kernel has a scalar reference that is always compiled. Faster per-ISA kernels sit
//! behind a dispatcher that detects CPU features once and caches the choice; property tests
//! check them against the reference. Kernels never panic on bad lengths: they return
//! [`KernelError`].
//!
//! # Example
//!
//! ```
//! use engram_kernels::{matmul, quantize_row, GgmlType, QMatrix, ThreadPool};
//!
//! // A 2 x 64 weight matrix stored as Q8_0 (quantize_row can write Q8_0 weights too).
//! let (rows, cols) = (2, 64);
//! let weights: Vec<f32> = (0..rows * cols).map(|i| if i < cols { 1.0 } else { -0.5 }).collect();
//! let mut bytes = Vec::new();
//! quantize_row(GgmlType::Q8_0, &weights, &mut bytes)?;
//! let w = QMatrix::new(GgmlType::Q8_0, rows, cols, &bytes)?;
//!
//! let pool = ThreadPool::new(2)?; // create once, reuse for every matmul
//! let x = vec![0.25f32; cols]; // one token
//! let mut out = vec![0.0f32; rows];
//! matmul(&w, &x, 1, &mut out, &pool)?;
//! assert!((out[0] - 16.0).abs() < 1e-2 && (out[1] + 8.0).abs() < 1e-2);
//! # Ok::<(), engram_kernels::KernelError>(())
//! ```

#![warn(missing_docs)]

/// `assert!` of a condition a raw pointer's bounds rest on: checked in debug builds and in any
/// build made with `ENGRAM_CHECKED` set (CI's, `scripts/test.sh`), compiled out of the
/// release build. `debug_assert!` would need the profile's `debug-assertions`, which also turns
/// on the standard library's precondition checks of every `unsafe` call inlined here: a build
/// with them ran prefill 22 % and decode 40 % slower (docs/bench/2026-12-07-ci-time.md).
/// Exported for `engram-kernels-cuda`'s launches (expanded there, so its build reads the
/// variable too).
#[doc(hidden)]
#[macro_export]
macro_rules! guard {
    ($($arg:tt)*) => {
        if cfg!(debug_assertions) || option_env!("ENGRAM_CHECKED").is_some() {
            assert!($($arg)*);
        }
    };
}

/// [`guard!`] for `assert_eq!`.
#[allow(unused_macros)]
macro_rules! guard_eq {
    ($($arg:tt)*) => {
        if cfg!(debug_assertions) || option_env!("ENGRAM_CHECKED").is_some() {
            assert_eq!($($arg)*);
        }
    };
}

mod act;
mod attention;
mod blocks;
mod dequant;
mod dot;
mod dtype;
mod elementwise;
mod error;
mod gemm;
mod matmul;
mod pool;
mod quantize;

pub use act::swiglu;
pub use attention::{attention, attention_many, key_tile_index, Attention, KV_TILE, Q_TILE};
pub use dequant::dequantize_row;
pub use dot::{vec_dot, vec_dot_f32};
pub use dtype::{GgmlType, QK_K};
pub use elementwise::{gelu_bias_rows, layer_norm_rows, softmax_rows};
pub use error::{KernelError, Result};
pub use gemm::{matmul_packed, PackedF32};
pub use half::{bf16, f16};
pub use matmul::{embedding_row, matmul, matmul_many, matmul_many_no_amx, QMatrix};
pub use pool::ThreadPool;

/// The kernels this process runs: the instruction set `matmul` and the dot products use
/// (`scalar`, `avx2`, `avx512bw`, `avx512-vnni`), plus `+amx` where prefill-sized matmuls take
/// the AMX tiles. Detected once (the first call may ask Linux for the AMX tile state).
pub fn kernels_in_use() -> String {
    let isa = dot::Isa::detected();
    #[cfg(target_arch = "x86_64")]
    if gemm::amx_enabled() {
        return format!("{}+amx", isa.name());
    }
    isa.name().to_string()
}
pub use quantize::{quantize_activations, quantize_row};
