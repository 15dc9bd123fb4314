//! The model folder's JSON settings: BERT hyper-parameters, pooling mode and sequence limit.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{EmbedError, Result};

/// Hugging Face model config (architecture hyper-parameters).
pub(crate) const CONFIG_FILE: &str = "config.json";
/// sentence-transformers' Transformer-module settings (`max_seq_length`).
pub(crate) const SBERT_CONFIG_FILE: &str = "sentence_bert_config.json";
/// sentence-transformers' pipeline; names the pooling module's folder.
pub(crate) const MODULES_FILE: &str = "modules.json";
/// The pooling folder when `modules.json` does not name one (sentence-transformers' default).
pub(crate) const DEFAULT_POOLING_DIR: &str = "1_Pooling";

/// The feed-forward activation (`hidden_act`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Activation {
    /// `gelu`: the exact erf form, PyTorch's default.
    Gelu,
    /// `gelu_new`, `gelu_pytorch_tanh`, `gelu_fast`: the tanh approximation.
    GeluTanh,
    /// `relu`.
    Relu,
}

/// The `hidden_act` names [`Activation::parse`] accepts, for error messages.
const SUPPORTED_ACTIVATIONS: &str = "gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, relu";

impl Activation {
    fn parse(name: &str) -> Option<Activation> {
        match name {
            "gelu" => Some(Activation::Gelu),
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Some(Activation::GeluTanh),
            "relu" => Some(Activation::Relu),
            _ => None,
        }
    }
}

/// How token vectors become one sentence vector (sentence-transformers' Pooling module).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pooling {
    /// Mean over all tokens, [CLS] and [SEP] included.
    Mean,
    /// The mean times `sqrt(len)`.
    MeanSqrtLen,
    /// The [CLS] token's vector.
    Cls,
    /// Per-component maximum over tokens.
    Max,
}

/// The checked hyper-parameters of a BERT encoder.
#[derive(Debug, Clone)]
pub(crate) struct BertConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub hidden_act: Activation,
    pub layer_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub type_vocab_size: usize,
}

/// Everything the JSON files of a model folder say.
#[derive(Debug, Clone)]
pub(crate) struct FolderConfig {
    pub bert: BertConfig,
    pub pooling: Pooling,
    /// Most tokens per sequence, [CLS] and [SEP] included.
    pub max_seq_length: usize,
    /// The raw bytes of every settings file read, for the model id.
    pub raw: Vec<u8>,
}

impl FolderConfig {
    /// Reads and checks `config.json` (required), `sentence_bert_config.json` (optional:
    /// `max_seq_length` defaults to `max_position_embeddings`) and the pooling config (optional:
    /// mean pooling, as sentence-transformers uses for a plain Hugging Face model).
    pub fn load(dir: &Path) -> Result<FolderConfig> {
        let mut raw = Vec::new();
        let path = dir.join(CONFIG_FILE);
        let cfg = read_json(&path, "BERT config (config.json)", &mut raw)?;
        let bert = parse_bert(&path, &cfg)?;

        let path = dir.join(SBERT_CONFIG_FILE);
        let max_seq_length = if path.exists() {
            let v = read_json(&path, "sentence-transformers config", &mut raw)?;
            let n = usize_field(&path, &v, "max_seq_length")?;
            if n < 2 || n > bert.max_position_embeddings {
                return Err(config_err(
                    &path,
                    "max_seq_length",
                    format!(
                        "must be in 2..={} (max_position_embeddings), got {n}",
                        bert.max_position_embeddings
                    ),
                ));
            }
            n
        } else {
            bert.max_position_embeddings
        };

        let path = dir.join(pooling_dir(dir, &mut raw)?).join(CONFIG_FILE);
        let pooling = if path.exists() {
            let v = read_json(&path, "pooling config", &mut raw)?;
            parse_pooling(&path, &v, bert.hidden_size)?
        } else {
            Pooling::Mean
        };
        Ok(FolderConfig {
            bert,
            pooling,
            max_seq_length,
            raw,
        })
    }
}

/// The pooling module's folder, from `modules.json` if the folder has one.
fn pooling_dir(dir: &Path, raw: &mut Vec<u8>) -> Result<String> {
    let path = dir.join(MODULES_FILE);
    if !path.exists() {
        return Ok(DEFAULT_POOLING_DIR.to_owned());
    }
    let v = read_json(&path, "sentence-transformers modules", raw)?;
    let found = v.as_array().and_then(|mods| {
        mods.iter().find_map(|m| {
            let ty = m.get("type")?.as_str()?;
            ty.ends_with(".Pooling")
                .then(|| m.get("path")?.as_str().map(str::to_owned))?
        })
    });
    Ok(found.unwrap_or_else(|| DEFAULT_POOLING_DIR.to_owned()))
}

fn parse_bert(path: &Path, v: &Value) -> Result<BertConfig> {
    if let Some(t) = v.get("model_type").and_then(Value::as_str) {
        if t != "bert" {
            return Err(config_err(
                path,
                "model_type",
                format!("must be \"bert\" (BERT-family encoders only), got {t:?}"),
            ));
        }
    }
    if let Some(t) = v.get("position_embedding_type").and_then(Value::as_str) {
        if t != "absolute" {
            return Err(config_err(
                path,
                "position_embedding_type",
                format!("must be \"absolute\", got {t:?}"),
            ));
        }
    }
    let act = v
        .get("hidden_act")
        .and_then(Value::as_str)
        .ok_or_else(|| config_err(path, "hidden_act", "is missing or not a string".into()))?;
    let hidden_act = Activation::parse(act).ok_or_else(|| EmbedError::UnsupportedActivation {
        path: path.to_owned(),
        act: act.to_owned(),
        supported: SUPPORTED_ACTIVATIONS,
    })?;
    let eps = v
        .get("layer_norm_eps")
        .and_then(Value::as_f64)
        .ok_or_else(|| config_err(path, "layer_norm_eps", "is missing or not a number".into()))?;
    if !(eps > 0.0 && eps < 1.0) {
        return Err(config_err(
            path,
            "layer_norm_eps",
            format!("must be in (0, 1), got {eps}"),
        ));
    }
    let cfg = BertConfig {
        vocab_size: usize_field(path, v, "vocab_size")?,
        hidden_size: usize_field(path, v, "hidden_size")?,
        num_hidden_layers: usize_field(path, v, "num_hidden_layers")?,
        num_attention_heads: usize_field(path, v, "num_attention_heads")?,
        intermediate_size: usize_field(path, v, "intermediate_size")?,
        hidden_act,
        layer_norm_eps: eps as f32,
        max_position_embeddings: usize_field(path, v, "max_position_embeddings")?,
        type_vocab_size: usize_field(path, v, "type_vocab_size")?,
    };
    if !cfg.hidden_size.is_multiple_of(cfg.num_attention_heads) {
        return Err(config_err(
            path,
            "num_attention_heads",
            format!(
                "must divide hidden_size {}, got {}",
                cfg.hidden_size, cfg.num_attention_heads
            ),
        ));
    }
    Ok(cfg)
}

fn parse_pooling(path: &Path, v: &Value, hidden_size: usize) -> Result<Pooling> {
    if let Some(d) = v.get("word_embedding_dimension") {
        if d.as_u64() != Some(hidden_size as u64) {
            return Err(config_err(
                path,
                "word_embedding_dimension",
                format!("must equal hidden_size {hidden_size}, got {d}"),
            ));
        }
    }
    let modes = [
        ("pooling_mode_mean_tokens", Pooling::Mean),
        ("pooling_mode_mean_sqrt_len_tokens", Pooling::MeanSqrtLen),
        ("pooling_mode_cls_token", Pooling::Cls),
        ("pooling_mode_max_tokens", Pooling::Max),
    ];
    let on: Vec<_> = modes
        .iter()
        .filter(|(k, _)| v.get(*k).and_then(Value::as_bool) == Some(true))
        .collect();
    match on.as_slice() {
        [(_, mode)] => Ok(*mode),
        _ => Err(config_err(
            path,
            "pooling_mode_*",
            format!(
                "exactly one of {} must be true, found {}",
                modes.map(|(k, _)| k).join(", "),
                on.len()
            ),
        )),
    }
}

/// Reads `path` as JSON, appending its bytes to `raw`.
fn read_json(path: &Path, what: &'static str, raw: &mut Vec<u8>) -> Result<Value> {
    let bytes = read_file(path, what)?;
    let v = serde_json::from_slice(&bytes).map_err(|source| EmbedError::Json {
        path: path.to_owned(),
        source,
    })?;
    raw.extend_from_slice(&bytes);
    Ok(v)
}

/// Reads a whole file, reporting a missing one as [`EmbedError::MissingFile`].
pub(crate) fn read_file(path: &Path, what: &'static str) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => EmbedError::MissingFile {
            path: path.to_owned(),
            what,
        },
        _ => EmbedError::Io {
            path: path.to_owned(),
            source,
        },
    })
}

fn usize_field(path: &Path, v: &Value, field: &str) -> Result<usize> {
    match v.get(field) {
        None => Err(config_err(path, field, "is missing".into())),
        Some(x) => match x.as_u64().and_then(|n| usize::try_from(n).ok()) {
            Some(n) if n > 0 => Ok(n),
            _ => Err(config_err(
                path,
                field,
                format!("must be a positive integer, got {x}"),
            )),
        },
    }
}

fn config_err(path: &Path, field: &str, reason: String) -> EmbedError {
    EmbedError::Config {
        path: PathBuf::from(path),
        field: field.to_owned(),
        reason,
    }
}
