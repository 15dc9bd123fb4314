//! The model's weights: immutable views into the memory-mapped GGUF file, checked at load.

use std::sync::Arc;

use engram_gguf::{GgufFile, TensorInfo};
use engram_kernels::QMatrix;

use crate::config::{Architecture, ModelConfig, MoeConfig};
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

/// `count` matrices of `rows` outputs by `cols` inputs stacked in one 3-D tensor (ggml dims
/// `[cols, rows, count]`): one projection of every expert of a mixture-of-experts block. Each
/// expert's matrix is a contiguous run of whole rows, so it is a [`QMatrix`] of its own.
#[derive(Debug, Clone)]
pub struct Experts {
    pub info: TensorInfo,
    pub count: usize,
    pub rows: usize,
    pub cols: usize,
}

impl Experts {
    fn load(
        file: &GgufFile,
        name: &str,
        count: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Experts> {
        let info = file.tensor(name)?.clone();
        let expected = vec![cols as u64, rows as u64, count as u64];
        if info.dims != expected {
            return Err(ModelError::TensorShape {
                name: name.into(),
                found: info.dims,
                expected,
            });
        }
        if !info.ty.is_supported() {
            return Err(ModelError::UnsupportedTensorType {
                name: name.into(),
                ty: info.ty.name(),
            });
        }
        Ok(Experts {
            info,
            count,
            rows,
            cols,
        })
    }

    /// The kernel view of expert `e`'s matrix over the file's bytes.
    pub fn view<'a>(&self, file: &'a GgufFile, e: usize) -> QMatrix<'a> {
        let data = file.tensor_data(&self.info);
        let bytes = data.len() / self.count;
        QMatrix::new(
            self.info.ty,
            self.rows,
            self.cols,
            &data[e * bytes..(e + 1) * bytes],
        )
        .expect("shape validated at load")
    }
}

/// A block's feed-forward network.
pub enum Ffn {
    /// One SwiGLU network every token goes through.
    Dense {
        gate: Matrix,
        up: Matrix,
        down: Matrix,
    },
    /// Routed SwiGLU experts (Mixtral, Qwen3-MoE).
    Moe(MoeFfn),
}

/// The router and experts of a mixture-of-experts block.
pub struct MoeFfn {
    /// `ffn_gate_inp`: one row of router logits per expert.
    pub router: Matrix,
    pub gate: Experts,
    pub up: Experts,
    pub down: Experts,
}

impl Ffn {
    fn load(f: &GgufFile, n: &dyn Fn(&str) -> String, cfg: &ModelConfig) -> Result<Ffn> {
        let d = cfg.n_embd;
        let Some(MoeConfig {
            n_expert: ne,
            n_ff_expert: ff,
            ..
        }) = cfg.moe
        else {
            let ff = cfg.n_ff;
            return Ok(Ffn::Dense {
                gate: Matrix::load(f, &n("ffn_gate.weight"), ff, d)?,
                up: Matrix::load(f, &n("ffn_up.weight"), ff, d)?,
                down: Matrix::load(f, &n("ffn_down.weight"), d, ff)?,
            });
        };
        // Shared experts (Qwen2-MoE, DeepSeek) are a graph this crate does not build.
        for s in ["ffn_gate_shexp.weight", "ffn_gate_inp_shexp.weight"] {
            if f.has_tensor(&n(s)) {
                return Err(ModelError::UnsupportedTensor { name: n(s) });
            }
        }
        if !f.has_tensor(&n("ffn_gate_exps.weight")) && f.has_tensor(&n("ffn_gate.0.weight")) {
            return Err(ModelError::MissingWeight {
                name: format!(
                    "{} (this file stores one tensor per expert, an older GGUF layout: \
                     convert the model again with a current llama.cpp)",
                    n("ffn_gate_exps.weight")
                ),
            });
        }
        Ok(Ffn::Moe(MoeFfn {
            router: Matrix::load(f, &n("ffn_gate_inp.weight"), ne, d)?,
            gate: Experts::load(f, &n("ffn_gate_exps.weight"), ne, ff, d)?,
            up: Experts::load(f, &n("ffn_up_exps.weight"), ne, ff, d)?,
            down: Experts::load(f, &n("ffn_down_exps.weight"), ne, d, ff)?,
        }))
    }

    /// The bytes of every weight matrix of this network in the file.
    pub fn bytes(&self, file: &GgufFile) -> u64 {
        let m = |m: &Matrix| file.tensor_data(&m.info).len() as u64;
        let e = |e: &Experts| file.tensor_data(&e.info).len() as u64;
        match self {
            Ffn::Dense { gate, up, down } => m(gate) + m(up) + m(down),
            Ffn::Moe(moe) => m(&moe.router) + e(&moe.gate) + e(&moe.up) + e(&moe.down),
        }
    }

    /// The bytes one token reads: all of a dense network; the router and `used` experts of a
    /// mixture.
    pub fn bytes_per_token(&self, file: &GgufFile, used: usize) -> u64 {
        match self {
            Ffn::Dense { .. } => self.bytes(file),
            Ffn::Moe(moe) => {
                let e = |e: &Experts| (file.tensor_data(&e.info).len() / e.count) as u64;
                file.tensor_data(&moe.router.info).len() as u64
                    + used as u64 * (e(&moe.gate) + e(&moe.up) + e(&moe.down))
            }
        }
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
    pub ffn: Ffn,
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
        let (d, q, kv) = (cfg.n_embd, cfg.q_width(), cfg.kv_width());
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
                ffn: Ffn::load(f, &n, cfg)?,
            });
            if cfg.arch.has_qk_norm() && (layers[i].q_norm.is_none() || layers[i].k_norm.is_none())
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
