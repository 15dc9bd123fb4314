//! Element-wise activations of the feed-forward block: SwiGLU (`silu(gate) * up`), split over
//! the pool for prefill.
//!
//! The formula is ggml's scalar one, `x / (1 + expf(-x)) * up`, with libm's `expf`. A vectorised
//! polynomial exp (2e-7 relative error) was tried and is not used: the 8-bit quantisation of the
//! next matmul's input turns such ulp-level differences into different quants, and over 30
//! layers that moved SmolLM2's logits by up to 0.8 and flipped a greedy token against
//! llama.cpp's golden outputs. Running the exact formula on every thread keeps the bits and
//! still takes it off prefill's serial path.

use crate::error::{KernelError, Result};
use crate::pool::ThreadPool;

/// Gate values per pool task: below this the whole vector runs on the caller (decode).
const CHUNK: usize = 16 * 1024;

/// `gate[i] = silu(gate[i]) * up[i]`, with `silu(x) = x / (1 + e^-x)`, split over `pool` when
/// long (prefill).
pub fn swiglu(gate: &mut [f32], up: &[f32], pool: &ThreadPool) -> Result<()> {
    if gate.len() != up.len() {
        return Err(KernelError::LengthMismatch {
            what: "swiglu up values",
            expected: gate.len(),
            actual: up.len(),
        });
    }
    if gate.len() <= CHUNK || pool.n_threads() == 1 {
        swiglu_body(gate, up);
        return Ok(());
    }
    let parts: Vec<std::sync::Mutex<(&mut [f32], &[f32])>> = gate
        .chunks_mut(CHUNK)
        .zip(up.chunks(CHUNK))
        .map(std::sync::Mutex::new)
        .collect();
    pool.run(parts.len(), |i| {
        let mut part = parts[i].lock().unwrap_or_else(|p| p.into_inner());
        let (g, u) = &mut *part;
        swiglu_body(g, u);
    });
    Ok(())
}

fn swiglu_body(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swiglu_is_the_scalar_formula_on_every_thread_count() {
        let n = 40_000;
        let gate: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 12.0).collect();
        let up: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos() * 3.0).collect();
        let want: Vec<f32> = gate
            .iter()
            .zip(&up)
            .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads).unwrap();
            let mut got = gate.clone();
            swiglu(&mut got, &up, &pool).unwrap();
            // The same formula on every thread: the same bits.
            assert_eq!(got, want, "threads={threads}");
        }
        let pool = ThreadPool::new(1).unwrap();
        assert!(swiglu(&mut [0.0; 3], &[0.0; 2], &pool).is_err());
    }
}
