//! [`Embedder`]: a model folder loaded once, turning texts into unit-length sentence vectors.

use std::path::Path;

use engram_kernels::ThreadPool;
use tokenizers::{
    PostProcessor, Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy,
};
use xxhash_rust::xxh3::Xxh3;

use crate::config::{read_file, FolderConfig, Pooling};
use crate::error::{EmbedError, Result};
use crate::model::Bert;
use crate::weights::{TensorFile, WEIGHTS_FILE};

/// The tokenizer inside a model folder.
const TOKENIZER_FILE: &str = "tokenizer.json";

/// Most tokens run through the encoder at once. Packed batches share every weight read across
/// their tokens, so bigger is faster up to here; past it the activations (about
/// `tokens * intermediate_size * 4` bytes, 25 MB for MiniLM's 1536-wide feed-forward) stop
/// fitting in cache and memory grows for no gain. A sequence is never split, so a batch holds
/// at least one text whatever its length.
pub const MAX_BATCH_TOKENS: usize = 4096;

/// `F.normalize`'s epsilon: a zero vector stays zero instead of becoming NaN.
const NORM_EPS: f64 = 1e-12;

/// Hex digits of the weights hash kept in [`Embedder::model_id`]: 48 bits tell apart any
/// models one appliance will ever hold, and keep the id readable.
const MODEL_ID_HASH_DIGITS: usize = 12;

/// A BERT sentence-embedding model (weights, tokenizer, pooling) with its own thread pool.
///
/// Immutable after [`load`](Embedder::load) and `Send + Sync`: share one behind an `Arc`.
/// Concurrent calls are correct; their matmuls take turns on the pool.
pub struct Embedder {
    tokenizer: Tokenizer,
    bert: Bert,
    pooling: Pooling,
    max_tokens: usize,
    model_id: String,
    pool: ThreadPool,
}

impl std::fmt::Debug for Embedder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedder")
            .field("model_id", &self.model_id)
            .field("dim", &self.dim())
            .field("max_tokens", &self.max_tokens)
            .field("pooling", &self.pooling)
            .finish()
    }
}

impl Embedder {
    /// Loads a sentence-transformers BERT folder: `config.json`, `model.safetensors` (F32, F16
    /// or BF16) and `tokenizer.json` are required; `sentence_bert_config.json` (max_seq_length)
    /// and the pooling config (`1_Pooling/config.json`, or the folder `modules.json` names) are
    /// read when present. Matmuls run on `threads` threads (0 counts as 1).
    pub fn load(dir: &Path, threads: usize) -> Result<Embedder> {
        let cfg = FolderConfig::load(dir)?;

        let path = dir.join(WEIGHTS_FILE);
        let bytes = read_file(&path, "model weights (model.safetensors)")?;
        let bert = Bert::load(cfg.bert.clone(), &TensorFile::parse(&path, &bytes)?)?;

        let tok_path = dir.join(TOKENIZER_FILE);
        let tok_bytes = read_file(&tok_path, "tokenizer (tokenizer.json)")?;
        let tokenizer = load_tokenizer(&tok_path, &tok_bytes, cfg.max_seq_length)?;

        let mut h = Xxh3::new();
        for part in [&bytes[..], &tok_bytes, &cfg.raw] {
            h.update(&(part.len() as u64).to_le_bytes());
            h.update(part);
        }
        let hash = format!("{:016x}", h.digest());
        let name = dir
            .canonicalize()
            .ok()
            .as_deref()
            .and_then(Path::file_name)
            .or_else(|| dir.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".to_owned());
        Ok(Embedder {
            tokenizer,
            bert,
            pooling: cfg.pooling,
            max_tokens: cfg.max_seq_length,
            model_id: format!("{name}@{}", &hash[..MODEL_ID_HASH_DIGITS]),
            pool: ThreadPool::new(threads)?,
        })
    }

    /// Components per embedding (the model's hidden size).
    pub fn dim(&self) -> usize {
        self.bert.config().hidden_size
    }

    /// `<folder name>@<xxh3 of weights, tokenizer and settings>`, e.g.
    /// `all-MiniLM-L6-v2@1a2b3c4d5e6f`: record it with stored vectors, since vectors from
    /// different models (or settings) are not comparable.
    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    /// Most tokens per text, [CLS] and [SEP] included; longer texts are truncated (their end
    /// does not affect the embedding).
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// The ids the encoder sees for `text`: `[CLS] word pieces [SEP]`, truncated to
    /// [`max_tokens`](Self::max_tokens).
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| EmbedError::Tokenize {
                reason: e.to_string(),
            })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Unit-length embeddings of `texts`, in order. Texts run in packed batches of up to
    /// [`MAX_BATCH_TOKENS`] tokens; the result does not depend on how they are batched.
    pub fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        let ids = texts
            .iter()
            .map(|t| self.tokenize(t))
            .collect::<Result<Vec<_>>>()?;
        let mut out = Vec::with_capacity(texts.len());
        let mut start = 0;
        while start < ids.len() {
            let mut end = start + 1;
            let mut tokens = ids[start].len();
            while end < ids.len() && tokens + ids[end].len() <= MAX_BATCH_TOKENS {
                tokens += ids[end].len();
                end += 1;
            }
            let batch = &ids[start..end];
            let hidden = self.bert.forward(batch, &self.pool)?;
            let mut row = 0;
            for seq in batch {
                let states = &hidden[row * self.dim()..(row + seq.len()) * self.dim()];
                out.push(normalize(self.pool_tokens(states, seq.len())));
                row += seq.len();
            }
            start = end;
        }
        Ok(out)
    }

    /// The unit-length embedding of one text.
    pub fn embed_one(&self, text: &str) -> Result<Vec<f32>> {
        Ok(self.embed(&[text])?.remove(0))
    }

    /// One sequence's token states (`len x dim`) pooled into one vector.
    fn pool_tokens(&self, states: &[f32], len: usize) -> Vec<f64> {
        let dim = self.dim();
        let rows = states.chunks_exact(dim);
        match self.pooling {
            Pooling::Cls => states[..dim].iter().map(|&v| v as f64).collect(),
            Pooling::Max => rows.fold(vec![f64::NEG_INFINITY; dim], |mut m, r| {
                m.iter_mut().zip(r).for_each(|(m, &v)| *m = m.max(v as f64));
                m
            }),
            Pooling::Mean | Pooling::MeanSqrtLen => {
                let mut sum = rows.fold(vec![0.0f64; dim], |mut s, r| {
                    s.iter_mut().zip(r).for_each(|(s, &v)| *s += v as f64);
                    s
                });
                let div = match self.pooling {
                    Pooling::Mean => len as f64,
                    _ => (len as f64).sqrt(),
                };
                sum.iter_mut().for_each(|s| *s /= div);
                sum
            }
        }
    }
}

/// `v / max(|v|, eps)` as f32.
fn normalize(v: Vec<f64>) -> Vec<f32> {
    let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt().max(NORM_EPS);
    v.into_iter().map(|x| (x / norm) as f32).collect()
}

/// `tokenizer.json` with its truncation set to `max_len` (it may carry a shorter one, as
/// all-MiniLM-L6-v2's 128 does; sentence-transformers overrides it) and padding off.
fn load_tokenizer(path: &Path, bytes: &[u8], max_len: usize) -> Result<Tokenizer> {
    let err = |reason: String| EmbedError::TokenizerLoad {
        path: path.to_owned(),
        reason,
    };
    let mut tok = Tokenizer::from_bytes(bytes).map_err(|e| err(e.to_string()))?;
    let added = tok
        .get_post_processor()
        .map_or(0, |p| p.added_tokens(false));
    if max_len <= added {
        return Err(err(format!(
            "max_seq_length {max_len} leaves no room beside the {added} special tokens"
        )));
    }
    tok.with_padding(None);
    tok.with_truncation(Some(TruncationParams {
        direction: TruncationDirection::Right,
        max_length: max_len,
        strategy: TruncationStrategy::LongestFirst,
        stride: 0,
    }))
    .map_err(|e| err(e.to_string()))?;
    Ok(tok)
}
