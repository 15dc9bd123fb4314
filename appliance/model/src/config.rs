//! Model hyper-parameters read from GGUF metadata, validated into a `ModelConfig`.

use engram_gguf::Metadata;

use crate::error::{ModelError, Result};

/// Architectures whose forward pass this crate implements.
pub const SUPPORTED_ARCHITECTURES: &str = "llama, mistral, qwen2, qwen3, qwen3moe";

/// The Llama-family variants, which differ only in a few switches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Llama 1-3, SmolLM, TinyLlama and friends.
    Llama,
    /// Mistral 7B / Nemo: the llama graph (GGUF writes most Mistral models as `llama`).
    Mistral,
    /// Qwen2 / Qwen2.5: biases on Q, K and V; NeoX RoPE.
    Qwen2,
    /// Qwen3: RMS norms on Q and K per head, no biases; NeoX RoPE.
    Qwen3,
    /// Qwen3's mixture-of-experts models (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention
    /// and routed experts in every block, no shared expert.
    Qwen3Moe,
}

impl Architecture {
    /// Parses `general.architecture`.
    pub fn from_name(name: &str) -> Result<Architecture> {
        Ok(match name {
            "llama" => Architecture::Llama,
            "mistral" => Architecture::Mistral,
            "qwen2" => Architecture::Qwen2,
            "qwen3" => Architecture::Qwen3,
            "qwen3moe" => Architecture::Qwen3Moe,
            other => {
                return Err(ModelError::UnsupportedArchitecture {
                    arch: other.into(),
                    supported: SUPPORTED_ARCHITECTURES,
                })
            }
        })
    }

    /// The name used as metadata key prefix.
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mistral => "mistral",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Qwen3Moe => "qwen3moe",
        }
    }

    /// Which rotary variant the converted GGUF weights expect. llama.cpp's converter permutes
    /// Llama's Q/K weights so adjacent pairs rotate together; Qwen keeps the half-split layout.
    pub fn rope_style(self) -> RopeStyle {
        match self {
            Architecture::Llama | Architecture::Mistral => RopeStyle::Interleaved,
            Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe => RopeStyle::NeoX,
        }
    }

    /// Whether the blocks carry Qwen3's per-head RMS norms of queries and keys.
    pub fn has_qk_norm(self) -> bool {
        matches!(self, Architecture::Qwen3 | Architecture::Qwen3Moe)
    }
}

/// The routed experts of a mixture-of-experts model: every block's feed-forward network is
/// `n_expert` SwiGLU experts of width `n_ff_expert`, of which a router picks `n_expert_used`
/// per token.
///
/// Routing is llama.cpp's for Mixtral (GGUF `llama` with experts) and Qwen3-MoE: the softmax
/// of the router's logits over all experts, the `n_expert_used` most probable experts, their
/// probabilities divided by their sum (the weights of the experts' outputs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeConfig {
    pub n_expert: usize,
    pub n_expert_used: usize,
    /// Hidden width of one expert.
    pub n_ff_expert: usize,
}

/// How dimensions are paired for rotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs `(2i, 2i+1)` (ggml "normal" mode).
    Interleaved,
    /// Pairs `(i, i + n_rot/2)` (ggml "NeoX" mode).
    NeoX,
}

/// Context-extension scaling of rotary positions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (position interpolation).
    Linear {
        factor: f32,
    },
    /// YaRN: interpolation blended with extrapolation per frequency, plus attention scaling.
    Yarn {
        factor: f32,
        original_context: u32,
        ext_factor: f32,
        attn_factor: f32,
        beta_fast: f32,
        beta_slow: f32,
    },
}

/// Everything the forward pass needs to know about the model's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Architecture,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    /// Per-head width of queries and keys.
    pub head_dim: usize,
    /// Per-head width of values.
    pub head_dim_v: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    /// How many leading dimensions of each head are rotated.
    pub rope_dims: usize,
    pub rope_style: RopeStyle,
    pub rope_scaling: RopeScaling,
    /// The routed experts, for a mixture-of-experts model; `None` for a dense one.
    pub moe: Option<MoeConfig>,
}

impl ModelConfig {
    /// Reads and validates the configuration from GGUF metadata.
    pub fn from_metadata(meta: &Metadata) -> Result<ModelConfig> {
        let arch = Architecture::from_name(meta.get_str("general.architecture")?)?;
        let p = arch.name();
        let key = |k: &str| format!("{p}.{k}");
        let usize_key = |k: &str| -> Result<usize> { Ok(meta.get_u64(&key(k))? as usize) };
        let opt_u64 = |k: &str| meta.opt(&key(k), Metadata::get_u64);
        let opt_f64 = |k: &str| meta.opt(&key(k), Metadata::get_f64);

        let n_layer = usize_key("block_count")?;
        let n_embd = usize_key("embedding_length")?;
        let moe = match opt_u64("expert_count")? {
            None | Some(0) if arch == Architecture::Qwen3Moe => {
                return Err(ModelError::MissingWeight {
                    name: key("expert_count"),
                })
            }
            None | Some(0) => None,
            Some(n_expert) => {
                let n_expert_used =
                    opt_u64("expert_used_count")?.ok_or_else(|| ModelError::MissingWeight {
                        name: key("expert_used_count"),
                    })?;
                // Mixtral's experts are `feed_forward_length` wide; Qwen3-MoE states theirs.
                let n_ff_expert = match opt_u64("expert_feed_forward_length")? {
                    Some(v) => v as usize,
                    None => per_layer_uniform(meta, &key("feed_forward_length"))?,
                };
                Some(MoeConfig {
                    n_expert: n_expert as usize,
                    n_expert_used: n_expert_used as usize,
                    n_ff_expert,
                })
            }
        };
        // A mixture-of-experts file may leave out the dense width (its blocks have none).
        let n_ff = match (meta.get(&key("feed_forward_length")), moe) {
            (None, Some(m)) => m.n_ff_expert,
            _ => per_layer_uniform(meta, &key("feed_forward_length"))?,
        };
        let n_head = per_layer_uniform(meta, &key("attention.head_count"))?;
        let n_head_kv = match meta.get(&key("attention.head_count_kv")) {
            Some(_) => per_layer_uniform(meta, &key("attention.head_count_kv"))?,
            None => n_head,
        };
        let default_head = n_embd.checked_div(n_head).unwrap_or(0);
        let head_dim = opt_u64("attention.key_length")?.map_or(default_head, |v| v as usize);
        let head_dim_v = opt_u64("attention.value_length")?.map_or(head_dim, |v| v as usize);
        let vocab_size = match opt_u64("vocab_size")? {
            Some(v) => v as usize,
            None => meta.get_array("tokenizer.ggml.tokens")?.len(),
        };
        let context_length = opt_u64("context_length")?.map_or(4096, |v| v as usize);
        let rms_eps = opt_f64("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5) as f32;
        let rope_base = opt_f64("rope.freq_base")?.unwrap_or(10_000.0) as f32;
        let rope_dims = opt_u64("rope.dimension_count")?.map_or(head_dim, |v| v as usize);

        let factor = opt_f64("rope.scaling.factor")?
            .or(opt_f64("rope.scale_linear")?)
            .unwrap_or(1.0) as f32;
        let scaling_type = meta
            .opt(&key("rope.scaling.type"), |m, k| {
                m.get_str(k).map(str::to_owned)
            })?
            .unwrap_or_else(|| {
                if factor != 1.0 {
                    "linear".into()
                } else {
                    "none".into()
                }
            });
        let rope_scaling = match scaling_type.as_str() {
            "none" => RopeScaling::None,
            _ if factor == 1.0 => RopeScaling::None,
            "linear" => RopeScaling::Linear { factor },
            "yarn" => RopeScaling::Yarn {
                factor,
                original_context: opt_u64("rope.scaling.original_context_length")?
                    .map_or(context_length as u32, |v| v as u32),
                ext_factor: opt_f64("rope.scaling.yarn_ext_factor")?.map_or(1.0, |v| {
                    if v < 0.0 {
                        1.0
                    } else {
                        v as f32
                    }
                }),
                attn_factor: opt_f64("rope.scaling.yarn_attn_factor")?.map_or(1.0, |v| v as f32),
                beta_fast: opt_f64("rope.scaling.yarn_beta_fast")?.map_or(32.0, |v| v as f32),
                beta_slow: opt_f64("rope.scaling.yarn_beta_slow")?.map_or(1.0, |v| v as f32),
            },
            other => {
                return Err(ModelError::InvalidConfig {
                    field: "rope.scaling.type",
                    value: other.into(),
                    reason: "supported: none, linear, yarn".into(),
                })
            }
        };

        let cfg = ModelConfig {
            arch,
            n_layer,
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            head_dim_v,
            vocab_size,
            context_length,
            rms_eps,
            rope_base,
            rope_dims,
            rope_style: arch.rope_style(),
            rope_scaling,
            moe,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, value: usize, reason: &str| {
            Err(ModelError::InvalidConfig {
                field,
                value: value.to_string(),
                reason: reason.into(),
            })
        };
        for (field, v) in [
            ("block_count", self.n_layer),
            ("embedding_length", self.n_embd),
            ("feed_forward_length", self.n_ff),
            ("attention.head_count", self.n_head),
            ("attention.head_count_kv", self.n_head_kv),
            ("attention.key_length", self.head_dim),
            ("vocab_size", self.vocab_size),
        ] {
            if v == 0 {
                return bad(field, v, "must be positive");
            }
        }
        if !self.n_head.is_multiple_of(self.n_head_kv) {
            return bad(
                "attention.head_count_kv",
                self.n_head_kv,
                &format!("must divide head_count {}", self.n_head),
            );
        }
        if self.rope_dims > self.head_dim || !self.rope_dims.is_multiple_of(2) {
            return bad(
                "rope.dimension_count",
                self.rope_dims,
                &format!("must be even and at most the head size {}", self.head_dim),
            );
        }
        if self.head_dim_v != self.head_dim {
            return bad(
                "attention.value_length",
                self.head_dim_v,
                "value heads narrower or wider than key heads are not supported yet",
            );
        }
        if let Some(m) = self.moe {
            if m.n_ff_expert == 0 {
                return bad("expert_feed_forward_length", 0, "must be positive");
            }
            if m.n_expert_used == 0 || m.n_expert_used > m.n_expert {
                return bad(
                    "expert_used_count",
                    m.n_expert_used,
                    &format!("must be between 1 and expert_count {}", m.n_expert),
                );
            }
        }
        if !(self.rms_eps > 0.0 && self.rope_base > 0.0) {
            return bad("rope.freq_base / rms_epsilon", 0, "must be positive");
        }
        Ok(())
    }

    /// Query heads per KV head (grouped-query attention).
    pub fn gqa_group(&self) -> usize {
        self.n_head / self.n_head_kv
    }

    /// Width of one token's keys (or values) across all KV heads.
    pub fn kv_width(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// Width of one token's queries across all heads.
    pub fn q_width(&self) -> usize {
        self.n_head * self.head_dim
    }
}

/// Reads a count that GGUF may store either as one integer or as one integer per layer; Engram
/// needs it uniform across layers.
fn per_layer_uniform(meta: &Metadata, key: &str) -> Result<usize> {
    if let Some(items) = meta.get(key).and_then(|v| v.as_array()) {
        let vals: Vec<u64> = items.iter().filter_map(|v| v.as_u64()).collect();
        let first = vals.first().copied().unwrap_or(0);
        if vals.len() != items.len() || vals.iter().any(|&v| v != first) {
            return Err(ModelError::InvalidConfig {
                field: "per-layer hyper-parameter",
                value: key.into(),
                reason: "layers of different sizes are not supported".into(),
            });
        }
        return Ok(first as usize);
    }
    Ok(meta.get_u64(key)? as usize)
}
