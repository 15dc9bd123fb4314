//! Fused prefill's passes after placement on a GPU (feature `cuda`).

use std::cell::RefCell;

use engram_model::{GpuCache, GpuModel, KvCache, Logits};

use crate::fuse::Runner;

/// Prompt tokens one GPU prefill call runs (the activations a placement reserves room for).
pub const GPU_PREFILL_PIECE: usize = 512;

/// A fused prefill's forward passes after placement on the GPU ([`Runner`]): the placed cache
/// uploaded at the first call ([`GpuModel::upload_cache`]), the recompute and the question run
/// there, appended tokens in pieces of [`GPU_PREFILL_PIECE`]. Recomputing stored slots in place
/// (`query`) needs every layer on the GPU.
pub struct GpuRunner<'d> {
    gpu: &'d RefCell<GpuModel>,
    capacity: usize,
    cache: Option<GpuCache>,
}

impl<'d> GpuRunner<'d> {
    /// A runner on `gpu` for a cache of up to `capacity` slots.
    pub fn new(gpu: &'d RefCell<GpuModel>, capacity: usize) -> GpuRunner<'d> {
        GpuRunner {
            gpu,
            capacity,
            cache: None,
        }
    }

    /// The cache the runner filled, if it ran.
    pub fn into_cache(self) -> Option<GpuCache> {
        self.cache
    }

    fn cache(&mut self, gpu: &GpuModel, kv: &KvCache) -> engram_model::Result<&mut GpuCache> {
        if self.cache.is_none() {
            self.cache = Some(gpu.upload_cache(kv, self.capacity)?);
        }
        Ok(self.cache.as_mut().expect("uploaded above"))
    }
}

impl Runner for GpuRunner<'_> {
    fn append(
        &mut self,
        kv: &KvCache,
        tokens: &[u32],
        positions: &[i32],
        logits: Logits,
    ) -> engram_model::Result<Vec<f32>> {
        let gpu_cell = self.gpu;
        let mut gpu = gpu_cell.borrow_mut();
        let cache = self.cache(&gpu, kv)?;
        let pieces = tokens.len().div_ceil(GPU_PREFILL_PIECE);
        let mut out = Vec::new();
        for (i, (t, p)) in tokens
            .chunks(GPU_PREFILL_PIECE)
            .zip(positions.chunks(GPU_PREFILL_PIECE))
            .enumerate()
        {
            let want = match logits {
                Logits::Last if i + 1 < pieces => Logits::None,
                l => l,
            };
            out.extend(gpu.forward(t, p, cache, want)?);
        }
        Ok(out)
    }

    fn recompute(
        &mut self,
        kv: &KvCache,
        tokens: &[u32],
        positions: &[i32],
        overwrite: &[usize],
        logits: Logits,
    ) -> engram_model::Result<Vec<f32>> {
        let gpu_cell = self.gpu;
        let mut gpu = gpu_cell.borrow_mut();
        let cache = self.cache(&gpu, kv)?;
        gpu.forward_fused(tokens, positions, overwrite, cache, logits)
    }
}
