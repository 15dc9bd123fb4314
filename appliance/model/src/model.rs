//! The Llama-family forward pass over explicit positions and a caller-owned KV cache.

use std::path::Path;
use std::sync::Arc;

use engram_gguf::GgufFile;
use half::f16;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::kv::KvCache;
use crate::ops::{rms_norm, rms_norm_in_place, Rope};
use crate::weights::{Matrix, Weights};

/// Which positions of a forward call need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// None (filling the cache only, e.g. chunk KV precompute).
    None,
    /// The last token of the call (prefill, decode).
    Last,
    /// Every token of the call (scoring, tests).
    All,
}

/// A loaded model: immutable weights plus the rotary tables. Cheap to share across threads.
pub struct Model {
    cfg: ModelConfig,
    weights: Weights,
    rope: Rope,
    threads: usize,
    /// The kernels' worker pool (`threads` threads), shared by every matmul of this model.
    pool: Arc<engram_kernels::ThreadPool>,
}

/// Per-call scratch buffers, sized for the call's tokens.
struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
}

impl Model {
    /// Opens a GGUF file and loads the model it holds, computing with `threads` threads.
    pub fn load(path: impl AsRef<Path>, threads: usize) -> Result<Model> {
        let file = Arc::new(GgufFile::open(path)?);
        Model::from_gguf(file, threads)
    }

    /// Loads the model held by an open GGUF file.
    pub fn from_gguf(file: Arc<GgufFile>, threads: usize) -> Result<Model> {
        let cfg = ModelConfig::from_metadata(file.metadata())?;
        let weights = Weights::load(file, &cfg)?;
        let rope = Rope::new(&cfg, weights.rope_freqs.as_deref());
        Ok(Model {
            cfg,
            weights,
            rope,
            threads: threads.max(1),
            pool: Arc::new(engram_kernels::ThreadPool::new(threads)?),
        })
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The GGUF file the weights live in (metadata, tokenizer).
    pub fn gguf(&self) -> &GgufFile {
        &self.weights.file
    }

    /// The rotary embedding: `rotate_at` places a stored pre-RoPE key at a position, `shift`
    /// moves an already-rotated one.
    pub fn rope(&self) -> &Rope {
        &self.rope
    }

    /// Number of compute threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The worker pool the kernels run on (`threads()` threads).
    pub fn pool(&self) -> &engram_kernels::ThreadPool {
        &self.pool
    }

    /// An empty KV cache for this model with room for `capacity` tokens.
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        KvCache::new(&self.cfg, capacity)
    }

    /// Runs `tokens` at `positions` through the model, appending their keys and values to `kv`,
    /// and returns the logits asked for (`vocab_size` values per returned token, in order).
    ///
    /// Token `i` attends to every cached slot whose position is `<= positions[i]`, including the
    /// slots this call appends, so a call may mix a prompt's tail, recomputed interior tokens of
    /// stored chunks, or one decode step.
    pub fn forward(
        &self,
        tokens: &[u32],
        positions: &[i32],
        kv: &mut KvCache,
        logits: Logits,
    ) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        if tokens.len() != positions.len() {
            return Err(ModelError::PositionCount {
                tokens: tokens.len(),
                positions: positions.len(),
            });
        }
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return Err(ModelError::TokenOutOfRange {
                id,
                vocab_size: cfg.vocab_size,
            });
        }
        if let Some(&p) = positions.iter().find(|&&p| p < 0) {
            return Err(ModelError::BadPosition { position: p.into() });
        }
        kv.check_layout(cfg)?;
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let first_slot = kv.append_slots(positions)?;
        let result = self.forward_slots(tokens, positions, kv, first_slot, logits);
        if result.is_err() {
            // Leave no half-written slots behind.
            kv.truncate(first_slot);
        }
        result
    }

    fn forward_slots(
        &self,
        tokens: &[u32],
        positions: &[i32],
        kv: &mut KvCache,
        first_slot: usize,
        logits: Logits,
    ) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        let n = tokens.len();

        let (d, qw, kvw, ff) = (cfg.n_embd, cfg.q_width(), cfg.kv_width(), cfg.n_ff);
        let mut s = Scratch {
            x: vec![0.0; n * d],
            h: vec![0.0; n * d],
            q: vec![0.0; n * qw],
            k: vec![0.0; n * kvw],
            v: vec![0.0; n * kvw],
            attn: vec![0.0; n * qw],
            proj: vec![0.0; n * d],
            gate: vec![0.0; n * ff],
            up: vec![0.0; n * ff],
        };
        for (t, &tok) in tokens.iter().enumerate() {
            self.weights.embed(tok, &mut s.x[t * d..(t + 1) * d])?;
        }
        let mut angles = Vec::with_capacity(n * self.rope.pairs());
        for &p in positions {
            self.rope.angles(p, &mut angles);
        }
        let pairs = self.rope.pairs();

        for (li, layer) in self.weights.layers.iter().enumerate() {
            // Attention block.
            rms_norm(&s.x, &layer.attn_norm, cfg.rms_eps, &mut s.h);
            self.matmul_many(
                &[&layer.wq, &layer.wk, &layer.wv],
                &s.h,
                n,
                &mut [&mut s.q, &mut s.k, &mut s.v],
            )?;
            for (buf, bias) in [
                (&mut s.q, &layer.bq),
                (&mut s.k, &layer.bk),
                (&mut s.v, &layer.bv),
            ] {
                if let Some(b) = bias {
                    for row in buf.chunks_exact_mut(b.len()) {
                        row.iter_mut().zip(b).for_each(|(x, b)| *x += b);
                    }
                }
            }
            if let Some(w) = &layer.q_norm {
                rms_norm_in_place(&mut s.q, w, cfg.rms_eps);
            }
            if let Some(w) = &layer.k_norm {
                rms_norm_in_place(&mut s.k, w, cfg.rms_eps);
            }
            for t in 0..n {
                let a = &angles[t * pairs..(t + 1) * pairs];
                self.rope.rotate(&mut s.q[t * qw..(t + 1) * qw], a);
                self.rope.rotate(&mut s.k[t * kvw..(t + 1) * kvw], a);
                kv.write(
                    li,
                    first_slot + t,
                    &s.k[t * kvw..(t + 1) * kvw],
                    &s.v[t * kvw..(t + 1) * kvw],
                );
            }
            self.attention(li, kv, positions, &s.q, &mut s.attn)?;
            self.matmul(&layer.wo, &s.attn, n, &mut s.proj)?;
            add_assign(&mut s.x, &s.proj);

            // Feed-forward block.
            rms_norm(&s.x, &layer.ffn_norm, cfg.rms_eps, &mut s.h);
            self.matmul_many(
                &[&layer.w_gate, &layer.w_up],
                &s.h,
                n,
                &mut [&mut s.gate, &mut s.up],
            )?;
            engram_kernels::swiglu(&mut s.gate, &s.up, &self.pool)?;
            self.matmul(&layer.w_down, &s.gate, n, &mut s.proj)?;
            add_assign(&mut s.x, &s.proj);
        }

        let rows: &[f32] = match logits {
            Logits::None => return Ok(Vec::new()),
            Logits::Last => &s.x[(n - 1) * d..],
            Logits::All => &s.x,
        };
        let m = rows.len() / d;
        let mut normed = vec![0.0; rows.len()];
        rms_norm(rows, &self.weights.output_norm, cfg.rms_eps, &mut normed);
        let mut out = vec![0.0; m * cfg.vocab_size];
        self.matmul(&self.weights.output, &normed, m, &mut out)?;
        Ok(out)
    }

    fn matmul(&self, w: &Matrix, x: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
        let view = w.view(&self.weights.file);
        engram_kernels::matmul(&view, x, n, out, &self.pool)?;
        Ok(())
    }

    /// Several matrices times the same input in one kernel call (quantised once, one pool
    /// dispatch when their types match): `outs[i] = ws[i] * x`, as `matmul` on each would give.
    fn matmul_many(
        &self,
        ws: &[&Matrix],
        x: &[f32],
        n: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<()> {
        let views: Vec<_> = ws.iter().map(|w| w.view(&self.weights.file)).collect();
        engram_kernels::matmul_many(&views, x, n, outs, &self.pool)?;
        Ok(())
    }

    /// Scaled dot-product attention of the call's queries over the whole cache of layer `li`,
    /// masked by position (the tiled kernel in `engram-kernels`). Writes `n * q_width` values.
    fn attention(
        &self,
        li: usize,
        kv: &KvCache,
        positions: &[i32],
        q: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        let cfg = &self.cfg;
        let len = kv.len();
        let keys: Vec<&[f16]> = (0..cfg.n_head_kv).map(|h| kv.keys(li, h, len)).collect();
        let values: Vec<&[f16]> = (0..cfg.n_head_kv).map(|h| kv.values(li, h, len)).collect();
        let a = engram_kernels::Attention {
            n_head: cfg.n_head,
            n_head_kv: cfg.n_head_kv,
            head_dim: cfg.head_dim,
            scale: 1.0 / (cfg.head_dim as f32).sqrt(),
            q,
            q_pos: positions,
            keys: &keys,
            values: &values,
            kv_pos: kv.positions(),
        };
        engram_kernels::attention(&a, out, &self.pool)?;
        Ok(())
    }
}

fn add_assign(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}
