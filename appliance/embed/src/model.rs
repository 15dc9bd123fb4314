//! The BERT encoder: immutable weights and a forward pass over a packed batch of sequences.

use engram_kernels::{matmul_packed, PackedF32, ThreadPool};

use crate::config::{Activation, BertConfig};
use crate::error::{EmbedError, Result};
use crate::ops::{attention, bias_act, layer_norm, par_rows, Span};
use crate::weights::TensorFile;

/// A dense layer `y = W x + b`, W packed once at load for the kernels' f32 GEMM.
struct Linear {
    /// `rows x cols` f32 weights (PyTorch's `[out, in]`), in the kernels' panel layout.
    w: PackedF32,
    b: Vec<f32>,
}

impl Linear {
    fn load(t: &TensorFile<'_>, name: &str, rows: usize, cols: usize) -> Result<Linear> {
        Linear::new(
            &t.get(&format!("{name}.weight"), &[rows, cols])?,
            t.get(&format!("{name}.bias"), &[rows])?,
            rows,
            cols,
        )
    }

    fn new(w: &[f32], b: Vec<f32>, rows: usize, cols: usize) -> Result<Linear> {
        Ok(Linear {
            w: PackedF32::pack(w, rows, cols)?,
            b,
        })
    }

    /// Stacks layers that read the same input into one (Q, K and V become one matmul), from
    /// their row-major weights.
    fn concat(parts: Vec<(Vec<f32>, Vec<f32>)>, cols: usize) -> Result<Linear> {
        let mut w = Vec::new();
        let mut b = Vec::new();
        for (pw, pb) in parts {
            debug_assert_eq!(pw.len(), pb.len() * cols);
            w.extend_from_slice(&pw);
            b.extend_from_slice(&pb);
        }
        let rows = b.len();
        Linear::new(&w, b, rows, cols)
    }

    /// `W x` for `n` tokens of `cols` activations each into `out` (`n x rows`, overwritten;
    /// the bias is added by the caller, fused with what follows).
    fn forward_into(&self, x: &[f32], n: usize, out: &mut [f32], pool: &ThreadPool) -> Result<()> {
        matmul_packed(&self.w, x, n, &mut out[..n * self.w.rows()], pool)?;
        Ok(())
    }

    fn rows(&self) -> usize {
        self.w.rows()
    }
}

/// LayerNorm's scale and shift (older checkpoints call them `gamma` and `beta`).
struct Norm {
    w: Vec<f32>,
    b: Vec<f32>,
}

impl Norm {
    fn load(t: &TensorFile<'_>, name: &str, n: usize) -> Result<Norm> {
        Ok(Norm {
            w: t.get_any(&[&format!("{name}.weight"), &format!("{name}.gamma")], &[n])?,
            b: t.get_any(&[&format!("{name}.bias"), &format!("{name}.beta")], &[n])?,
        })
    }
}

/// One transformer block.
struct Layer {
    qkv: Linear,
    attn_out: Linear,
    attn_norm: Norm,
    ffn_up: Linear,
    ffn_down: Linear,
    ffn_norm: Norm,
}

/// A BERT encoder (`BertModel` without the pooler).
pub(crate) struct Bert {
    cfg: BertConfig,
    word: Vec<f32>,
    position: Vec<f32>,
    token_type: Vec<f32>,
    emb_norm: Norm,
    layers: Vec<Layer>,
}

impl Bert {
    /// Reads every tensor `cfg` calls for, checking shapes.
    pub fn load(cfg: BertConfig, t: &TensorFile<'_>) -> Result<Bert> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let e = "embeddings";
        let word = t.get(&format!("{e}.word_embeddings.weight"), &[cfg.vocab_size, h])?;
        let position = t.get(
            &format!("{e}.position_embeddings.weight"),
            &[cfg.max_position_embeddings, h],
        )?;
        let token_type = t.get(
            &format!("{e}.token_type_embeddings.weight"),
            &[cfg.type_vocab_size, h],
        )?;
        let emb_norm = Norm::load(t, &format!("{e}.LayerNorm"), h)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|l| {
                let p = format!("encoder.layer.{l}");
                let qkv = ["query", "key", "value"]
                    .iter()
                    .map(|n| {
                        let name = format!("{p}.attention.self.{n}");
                        Ok((
                            t.get(&format!("{name}.weight"), &[h, h])?,
                            t.get(&format!("{name}.bias"), &[h])?,
                        ))
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(Layer {
                    qkv: Linear::concat(qkv, h)?,
                    attn_out: Linear::load(t, &format!("{p}.attention.output.dense"), h, h)?,
                    attn_norm: Norm::load(t, &format!("{p}.attention.output.LayerNorm"), h)?,
                    ffn_up: Linear::load(t, &format!("{p}.intermediate.dense"), i, h)?,
                    ffn_down: Linear::load(t, &format!("{p}.output.dense"), h, i)?,
                    ffn_norm: Norm::load(t, &format!("{p}.output.LayerNorm"), h)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Bert {
            cfg,
            word,
            position,
            token_type,
            emb_norm,
            layers,
        })
    }

    pub fn config(&self) -> &BertConfig {
        &self.cfg
    }

    /// The last hidden state of every token of `seqs`, packed: sequence after sequence,
    /// `hidden_size` values per token. Token types are all 0, as in sentence-transformers.
    ///
    /// Sequences are packed without padding; each attends only to its own tokens, so the
    /// result equals running them one by one (and a padded, masked batch).
    pub fn forward(&self, seqs: &[Vec<u32>], pool: &ThreadPool) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        let h = cfg.hidden_size;
        let mut spans = Vec::with_capacity(seqs.len());
        let mut x = Vec::new();
        for s in seqs {
            if s.len() > cfg.max_position_embeddings {
                return Err(EmbedError::SequenceTooLong {
                    len: s.len(),
                    max: cfg.max_position_embeddings,
                });
            }
            spans.push(Span {
                start: x.len() / h,
                len: s.len(),
            });
            for (pos, &id) in s.iter().enumerate() {
                let row = usize::try_from(id)
                    .ok()
                    .filter(|&r| r < cfg.vocab_size)
                    .ok_or(EmbedError::TokenOutOfRange {
                        id,
                        vocab_size: cfg.vocab_size,
                    })?;
                let w = &self.word[row * h..][..h];
                let p = &self.position[pos * h..][..h];
                let t = &self.token_type[..h];
                // PyTorch's order: (word + token_type) + position.
                x.extend(w.iter().zip(t).zip(p).map(|((w, t), p)| (w + t) + p));
            }
        }
        let n = x.len() / h;
        let eps = cfg.layer_norm_eps;
        let norm = |x: &mut Vec<f32>, nm: &Norm| {
            par_rows(pool, x, h, |_, row| layer_norm(row, &nm.w, &nm.b, eps));
        };
        norm(&mut x, &self.emb_norm);

        // Buffers for every layer, allocated (and zeroed) once per batch: each matmul
        // overwrites its output.
        let widest = |f: fn(&Layer) -> usize| self.layers.iter().map(f).max().unwrap_or(0);
        let mut qkv = vec![0.0f32; n * widest(|l| l.qkv.rows())];
        let mut a = vec![0.0f32; n * h];
        let mut up = vec![0.0f32; n * widest(|l| l.ffn_up.rows())];
        for layer in &self.layers {
            // Self-attention block.
            let qkv = &mut qkv[..n * layer.qkv.rows()];
            layer.qkv.forward_into(&x, n, qkv, pool)?;
            add_bias(pool, qkv, &layer.qkv.b, None);
            let ctx = attention(pool, qkv, &spans, h, cfg.num_attention_heads);
            layer.attn_out.forward_into(&ctx, n, &mut a, pool)?;
            residual_norm(pool, &mut a, &layer.attn_out.b, &x, &layer.attn_norm, eps);
            std::mem::swap(&mut x, &mut a);

            // Feed-forward block.
            let up = &mut up[..n * layer.ffn_up.rows()];
            layer.ffn_up.forward_into(&x, n, up, pool)?;
            add_bias(pool, up, &layer.ffn_up.b, Some(cfg.hidden_act));
            layer.ffn_down.forward_into(up, n, &mut a, pool)?;
            residual_norm(pool, &mut a, &layer.ffn_down.b, &x, &layer.ffn_norm, eps);
            std::mem::swap(&mut x, &mut a);
        }
        Ok(x)
    }
}

/// `y = act(y + b)` row by row.
fn add_bias(pool: &ThreadPool, y: &mut [f32], b: &[f32], act: Option<Activation>) {
    par_rows(pool, y, b.len(), |_, row| bias_act(row, b, act));
}

/// `y = LayerNorm((y + b) + residual)` row by row, as BertSelfOutput / BertOutput do.
fn residual_norm(
    pool: &ThreadPool,
    y: &mut [f32],
    b: &[f32],
    residual: &[f32],
    nm: &Norm,
    eps: f32,
) {
    let h = b.len();
    par_rows(pool, y, h, |i, row| {
        for ((v, &b), &r) in row.iter_mut().zip(b).zip(&residual[i * h..][..h]) {
            *v = (*v + b) + r;
        }
        layer_norm(row, &nm.w, &nm.b, eps);
    });
}
