//! The model's weights: immutable views into the memory-mapped GGUF file, checked at load.

use std::sync::Arc;

use engram_gguf::{GgufFile, TensorInfo};
use engram_kernels::QMatrix;

use crate::config::{Architecture, ModelConfig};
use crate::error::{ModelError, Result};

/// A 2-D weight matrix of `rows` outputs by `cols` inputs, stored in the GGUF file.
#[derive(Debug, Clone)]
pub struct Matrix {
    pub info: TensorInfo,
    pub rows: usize,
    pub cols: usize,
}

impl Matrix {
    fn load(file: &GgufFile, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let info = file.tensor(name)?.clone();
        if info.dims != [cols as u64, rows as u64] {
            return Err(ModelError::TensorShape {
                name: name.into(),
                found: info.dims,
                expected: vec![cols as u64, rows as u64],
            });
        }
        if !info.ty.is_supported() {
            return Err(ModelError::UnsupportedTensorType {
                name: name.into(),
                ty: info.ty.name(),
            });
        }
        Ok(Matrix { info, rows, cols })
    }

    /// The kernel view of this matrix over the file's bytes.
    pub fn view<'a>(&self, file: &'a GgufFile) -> QMatrix<'a> {
        QMatrix::new(
            self.info.ty,
            self.rows,
            self.cols,
            file.tensor_data(&self.info),
        )
        .expect("shape validated at load")
    }
}

/// Reads a 1-D f32-convertible tensor of `len` values (norm weights, biases).
fn vector(file: &GgufFile, name: &str, len: usize) -> Result<Vec<f32>> {
    let info = file.tensor(name)?;
    if info.dims != [len as u64] {
        return Err(ModelError::TensorShape {
            name: name.into(),
            found: info.dims.clone(),
            expected: vec![len as u64],
        });
    }
    if !info.ty.is_supported() {
        return Err(ModelError::UnsupportedTensorType {
            name: name.into(),
            ty: info.ty.name(),
        });
    }
    let mut out = vec![0.0; len];
    engram_kernels::dequantize_row(info.ty, file.tensor_data(info), &mut out)?;
    Ok(out)
}

fn optional_vector(file: &GgufFile, name: &str, len: usize) -> Result<Option<Vec<f32>>> {
    if file.has_tensor(name) {
        vector(file, name, len).map(Some)
    } else {
        Ok(None)
    }
}

/// One transformer block.
pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub wq: Matrix,
    pub wk: Matrix,
    pub wv: Matrix,
    pub wo: Matrix,
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    /// Qwen3's per-head RMS norms of queries and keys.
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub w_gate: Matrix,
    pub w_up: Matrix,
    pub w_down: Matrix,
}

/// All weights of a Llama-family model.
pub struct Weights {
    pub file: Arc<GgufFile>,
    pub token_embd: Matrix,
    pub layers: Vec<Layer>,
    pub output_norm: Vec<f32>,
    /// The output head (`output.weight`, or the token embedding when the model ties them).
    pub output: Matrix,
    /// Llama 3's rotary frequency divisors, when present.
    pub rope_freqs: Option<Vec<f32>>,
}

impl Weights {
    /// Checks every tensor the architecture needs against `cfg` and keeps views of them.
    pub fn load(file: Arc<GgufFile>, cfg: &ModelConfig) -> Result<Weights> {
        let f = &*file;
        let (d, q, kv, ff) = (cfg.n_embd, cfg.q_width(), cfg.kv_width(), cfg.n_ff);
        let token_embd = Matrix::load(f, "token_embd.weight", cfg.vocab_size, d)?;
        let output = if f.has_tensor("output.weight") {
            Matrix::load(f, "output.weight", cfg.vocab_size, d)?
        } else {
            token_embd.clone()
        };
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            // Qwen2 always has Q/K/V biases; other Llama-family files may carry them too.
            let bias = |s: &str, len| -> Result<Option<Vec<f32>>> {
                if cfg.arch == Architecture::Qwen2 {
                    vector(f, &n(s), len).map(Some)
                } else {
                    optional_vector(f, &n(s), len)
                }
            };
            // Biases this graph has no place for must not be dropped silently.
            for s in [
                "attn_output.bias",
                "ffn_gate.bias",
                "ffn_up.bias",
                "ffn_down.bias",
            ] {
                if f.has_tensor(&n(s)) {
                    return Err(ModelError::UnsupportedTensor { name: n(s) });
                }
            }
            layers.push(Layer {
                attn_norm: vector(f, &n("attn_norm.weight"), d)?,
                wq: Matrix::load(f, &n("attn_q.weight"), q, d)?,
                wk: Matrix::load(f, &n("attn_k.weight"), kv, d)?,
                wv: Matrix::load(f, &n("attn_v.weight"), kv, d)?,
                wo: Matrix::load(f, &n("attn_output.weight"), d, q)?,
                bq: bias("attn_q.bias", q)?,
                bk: bias("attn_k.bias", kv)?,
                bv: bias("attn_v.bias", kv)?,
                q_norm: optional_vector(f, &n("attn_q_norm.weight"), cfg.head_dim)?,
                k_norm: optional_vector(f, &n("attn_k_norm.weight"), cfg.head_dim)?,
                ffn_norm: vector(f, &n("ffn_norm.weight"), d)?,
                w_gate: Matrix::load(f, &n("ffn_gate.weight"), ff, d)?,
                w_up: Matrix::load(f, &n("ffn_up.weight"), ff, d)?,
                w_down: Matrix::load(f, &n("ffn_down.weight"), d, ff)?,
            });
            if cfg.arch == Architecture::Qwen3
                && (layers[i].q_norm.is_none() || layers[i].k_norm.is_none())
            {
                return Err(ModelError::MissingWeight {
                    name: n("attn_q_norm.weight / attn_k_norm.weight"),
                });
            }
        }
        Ok(Weights {
            output_norm: vector(f, "output_norm.weight", d)?,
            rope_freqs: optional_vector(f, "rope_freqs.weight", cfg.rope_dims / 2)?,
            token_embd,
            layers,
            output,
            file,
        })
    }

    /// Copies the embedding of `token` into `out`.
    pub fn embed(&self, token: u32, out: &mut [f32]) -> Result<()> {
        let m = &self.token_embd;
        let row_bytes = m
            .info
            .ty
            .row_bytes(m.cols)
            .expect("validated when the file was opened");
        let data = self.file.tensor_data(&m.info);
        let start = token as usize * row_bytes;
        engram_kernels::dequantize_row(m.info.ty, &data[start..start + row_bytes], out)?;
        Ok(())
    }
}
