//! Where the engine's sequences decode: on the CPU, or (feature `cuda`) on a GPU.
//!
//! A fused prompt is assembled on the CPU by the same code either way (the chunk KV it loads
//! lives in DRAM and on NVMe, and fusion's selection and placement run there). With a GPU, the
//! cache is uploaded once ([`GpuModel::upload_cache`]) and the sequence
//! decodes on the GPU, batched with the others ([`GpuModel::forward_batch`]); fusion's
//! forward passes after placement (the recompute and the question) run on the GPU too
//! ([`engram_fusion::GpuRunner`], uploading the placed cache at its first call). A prompt prefilled in full (a chat, a text completion, a question whose fusion is off) runs on the GPU
//! from the start ([`Decoder::prefill`]): what the prefix cache holds is uploaded and the rest
//! prefilled there. A finished conversation's cache is read back for the prefix cache. The layers go where the
//! placement planner puts them for the device's free memory and the profile's batch (all of
//! them when they fit, else the first N, as llama.cpp's `-ngl`).
//!
//! Before serving from a GPU the daemon checks it ([`GpuModel::check_serving`]: a prompt
//! prefilled on the CPU, uploaded, decoded as a batch of two, compared with the CPU step by
//! step, read back); a failed check, like a missing driver, leaves generation on the CPU with
//! the reason in the log and in `/readyz`.

use std::borrow::Cow;
#[cfg(feature = "cuda")]
use std::sync::Arc;

use engram_model::{KvCache, Logits, Model, ModelError, Sequence};
use serde::Serialize;

/// Where generation runs, for `/readyz` and the log.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Serving {
    /// `cpu`, or the GPU decode runs on (`cuda:0`).
    pub device: String,
    /// Where the layers run, when on a GPU.
    pub placement: Option<String>,
    /// Why generation stays on the CPU, when it does.
    pub reason: Option<String>,
}

/// One sequence's KV cache, where its decode runs.
pub enum SeqKv {
    Cpu(KvCache),
    #[cfg(feature = "cuda")]
    Gpu(engram_model::GpuCache),
}

/// Runs decode steps where the engine serves from.
pub struct Decoder {
    #[cfg(feature = "cuda")]
    gpu: Option<std::cell::RefCell<engram_model::GpuModel>>,
    pub serving: Serving,
}

impl Decoder {
    /// Decoding on the CPU, for `reason`.
    pub fn cpu(reason: impl Into<String>) -> Decoder {
        Decoder {
            #[cfg(feature = "cuda")]
            gpu: None,
            serving: Serving {
                device: "cpu".into(),
                placement: None,
                reason: Some(reason.into()),
            },
        }
    }

    /// The decoder `want_gpu` asks for: the first GPU when one is found, the model's layers
    /// placed for `sequences` caches of up to `context` tokens and the check passes; the CPU
    /// otherwise, saying why.
    #[cfg(feature = "cuda")]
    pub fn open(
        model: &Arc<Model>,
        want_gpu: bool,
        sequences: usize,
        context: usize,
        kernel_cache: Option<&std::path::Path>,
    ) -> Decoder {
        if !want_gpu {
            return Decoder::cpu("[gpu] serving = \"off\"");
        }
        match open_gpu(model, sequences, context, kernel_cache) {
            Ok(gpu) => {
                let dev = format!("cuda:{}", gpu.device().info().ordinal);
                let placement = gpu.describe();
                Decoder {
                    gpu: Some(std::cell::RefCell::new(gpu)),
                    serving: Serving {
                        device: dev,
                        placement: Some(placement),
                        reason: None,
                    },
                }
            }
            Err(reason) => Decoder::cpu(reason),
        }
    }

    /// Without the `cuda` feature: the CPU, saying why.
    #[cfg(not(feature = "cuda"))]
    pub fn open(
        _model: &std::sync::Arc<Model>,
        want_gpu: bool,
        _sequences: usize,
        _context: usize,
        _kernel_cache: Option<&std::path::Path>,
    ) -> Decoder {
        if want_gpu {
            Decoder::cpu("this engramd was built without the `cuda` feature")
        } else {
            Decoder::cpu("[gpu] serving = \"off\"")
        }
    }

    /// Moves a prefilled cache to where decode runs; `capacity`: the slots it may grow to.
    pub fn place(&self, kv: KvCache, capacity: usize) -> Result<SeqKv, ModelError> {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &self.gpu {
            return Ok(SeqKv::Gpu(gpu.borrow().upload_cache(&kv, capacity)?));
        }
        let _ = capacity;
        Ok(SeqKv::Cpu(kv))
    }

    /// Whether sequences decode on a GPU.
    #[cfg(feature = "cuda")]
    pub fn on_gpu(&self) -> bool {
        self.gpu.is_some()
    }

    /// A runner of fused prefill's passes after placement on the GPU, for a cache of up to
    /// `capacity` slots: when sequences decode on a GPU that holds every layer (recomputing
    /// stored slots in place needs them all there).
    #[cfg(feature = "cuda")]
    pub fn runner(&self, capacity: usize) -> Option<engram_fusion::GpuRunner<'_>> {
        let gpu = self.gpu.as_ref()?;
        let whole = {
            let g = gpu.borrow();
            g.n_gpu_layers() == g.model().config().n_layer
        };
        whole.then(|| engram_fusion::GpuRunner::new(gpu, capacity))
    }

    /// Prefills `tokens` at positions `start..` on the GPU after what `kv` holds (the first
    /// `start` slots, e.g. a prefix cache hit), in pieces of
    /// [`engram_fusion::GPU_PREFILL_PIECE`] tokens. Returns the cache, now for up to `capacity`
    /// slots, and the last position's logits.
    #[cfg(feature = "cuda")]
    pub fn prefill(
        &self,
        kv: &KvCache,
        tokens: &[u32],
        start: usize,
        capacity: usize,
    ) -> Result<(SeqKv, Vec<f32>), ModelError> {
        use engram_fusion::Runner;
        let gpu = self
            .gpu
            .as_ref()
            .ok_or_else(|| ModelError::Gpu("prefill on the GPU without one".into()))?;
        // The runner's append: `kv` uploaded, then the tokens in pieces.
        let mut runner = engram_fusion::GpuRunner::new(gpu, capacity);
        let positions: Vec<i32> = (start..start + tokens.len()).map(|p| p as i32).collect();
        let logits = runner.append(kv, tokens, &positions, Logits::Last)?;
        let cache = runner.into_cache().expect("uploaded by append");
        Ok((SeqKv::Gpu(cache), logits))
    }

    /// One forward pass of every sequence (`tokens`, `positions`, its cache), all placed by
    /// this decoder; the logits asked for, sequence after sequence.
    pub fn step(
        &self,
        model: &Model,
        seqs: &mut [(&[u32], &[i32], &mut SeqKv)],
        logits: Logits,
    ) -> Result<Vec<f32>, ModelError> {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &self.gpu {
            let mut on_gpu = Vec::with_capacity(seqs.len());
            for (t, p, kv) in seqs.iter_mut() {
                match &mut **kv {
                    SeqKv::Gpu(c) => on_gpu.push((*t, *p, c)),
                    SeqKv::Cpu(_) => return Err(mixed()),
                }
            }
            return gpu.borrow_mut().forward_batch(&mut on_gpu, logits);
        }
        let mut on_cpu = Vec::with_capacity(seqs.len());
        for (t, p, kv) in seqs.iter_mut() {
            match &mut **kv {
                SeqKv::Cpu(c) => on_cpu.push(Sequence {
                    tokens: t,
                    positions: p,
                    kv: c,
                }),
                #[cfg(feature = "cuda")]
                SeqKv::Gpu(_) => return Err(mixed()),
            }
        }
        model.forward_batch(&mut on_cpu, logits)
    }

    /// The cache in host memory (read back from the GPU when it is there).
    pub fn host_cache<'a>(&self, kv: &'a SeqKv) -> Result<Cow<'a, KvCache>, ModelError> {
        match kv {
            SeqKv::Cpu(c) => Ok(Cow::Borrowed(c)),
            #[cfg(feature = "cuda")]
            SeqKv::Gpu(c) => match &self.gpu {
                Some(gpu) => Ok(Cow::Owned(gpu.borrow().download_cache(c)?)),
                None => Err(mixed()),
            },
        }
    }
}

#[cfg(feature = "cuda")]
fn mixed() -> ModelError {
    ModelError::Gpu("a decode batch mixes CPU and GPU caches".into())
}

/// Tokens of the check prompt ([`GpuModel::check_serving`]) and decode steps after it.
#[cfg(feature = "cuda")]
const CHECK_PROMPT: usize = 24;
#[cfg(feature = "cuda")]
const CHECK_STEPS: usize = 8;

/// Opens the first GPU, places the model's layers and checks the serving path; the reason
/// when any of it fails.
#[cfg(feature = "cuda")]
fn open_gpu(
    model: &Arc<Model>,
    sequences: usize,
    context: usize,
    kernel_cache: Option<&std::path::Path>,
) -> Result<engram_model::GpuModel, String> {
    use engram_kernels_cuda::Device;
    use engram_model::placement::{Device as PlacementDevice, Placement, PlacementRequest};
    use engram_model::GpuModel;

    let found = engram_kernels_cuda::probe().map_err(|e| e.to_string())?;
    if found.is_empty() {
        return Err("no CUDA device".into());
    }
    let dev = Device::open(0, kernel_cache).map_err(|e| format!("opening cuda:0: {e}"))?;
    let mut req = PlacementRequest::for_model(model, context, sequences.max(1));
    let rows = sequences.max(engram_fusion::GPU_PREFILL_PIECE);
    req.scratch_bytes = GpuModel::scratch_estimate(model, rows, context);
    let (free, _) = dev.memory().map_err(|e| e.to_string())?;
    let plan = Placement::plan(&req, &[PlacementDevice::new("cuda:0", free)]);
    let n_gpu = plan.n_gpu_layers();
    if let (0, Some(why)) = (n_gpu, &req.cpu_only) {
        return Err(why.clone());
    }
    if n_gpu == 0 {
        return Err(format!(
            "no layer fits in cuda:0's {} MiB free: {}",
            free >> 20,
            plan.describe()
        ));
    }
    let mut gpu = GpuModel::new(model.clone(), dev, n_gpu).map_err(|e| e.to_string())?;
    let vocab = model.config().vocab_size as u64;
    // Ordinary-looking ids spread over the vocabulary (the check is numerical).
    let prompt: Vec<u32> = (0..CHECK_PROMPT as u64)
        .map(|i| ((i * 7919 + 101) % vocab) as u32)
        .collect();
    let worst = gpu
        .check_serving(&prompt, CHECK_STEPS)
        .map_err(|e| format!("the GPU serving check failed: {e}"))?;
    tracing::info!(
        placement = %gpu.describe(),
        top5_max_abs_diff = worst,
        "GPU serving check passed"
    );
    Ok(gpu)
}
