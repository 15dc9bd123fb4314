//! The Llama-family forward pass over explicit positions and a caller-owned KV cache.

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;

use engram_gguf::GgufFile;
use half::f16;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::generate::PREFILL_CHUNK;
use crate::kv::KvCache;
use crate::ops::{rms_norm, rms_norm_in_place, Rope};
use crate::weights::{Ffn, Matrix, MoeFfn, Weights};

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
    pub(crate) weights: Weights,
    pub(crate) rope: Rope,
    threads: usize,
    /// The kernels' worker pool (`threads` threads), shared by every matmul of this model.
    pool: Arc<engram_kernels::ThreadPool>,
    /// [`Model::fingerprint`], computed on first use.
    fingerprint: std::sync::OnceLock<[u8; 16]>,
}

/// CacheBlend's selection step for [`Model::forward_blend`].
pub struct Blend<'a> {
    /// The layer whose value deviation chooses the rows recomputed in the later layers
    /// (CacheBlend uses layer 1: layer 0 attends almost only to each token itself).
    pub check_layer: usize,
    /// Given each row's squared value deviation (infinite for appended rows), returns the rows
    /// to keep, as indices in any order. The last row is always kept.
    pub select: &'a mut dyn FnMut(&[f32]) -> Vec<usize>,
}

/// Receives, per layer, the call's fresh keys before RoPE and values (`[tokens][kv_width]`).
pub type LayerObserver<'f> = dyn FnMut(usize, &[f32], &[f32]) + 'f;

/// Receives each layer's index and the call's queries after RoPE (`[tokens][q_width]`, f32),
/// before that layer's attention: what a fused prefill uses to see which stored tokens a
/// question attends to. Returning `ControlFlow::Break` ends the call there and it returns no
/// logits: the call's slots hold that layer's keys and values but nothing in later layers, so
/// the caller truncates them.
pub type QueryObserver<'f> = dyn FnMut(usize, &[f32]) -> ControlFlow<()> + 'f;

/// One sequence of a [`Model::forward_batch`] call: its next tokens, their positions, and the
/// sequence's own cache.
pub struct Sequence<'a> {
    pub tokens: &'a [u32],
    pub positions: &'a [i32],
    pub kv: &'a mut KvCache,
}

/// One forward call, as the public entry points describe it.
struct Call<'a, 'f> {
    /// Every sequence's tokens, one sequence after the other.
    tokens: &'a [u32],
    positions: &'a [i32],
    /// Rows of sequence `s` are `bounds[s]..bounds[s + 1]`; each sequence has its own cache.
    bounds: &'a [usize],
    /// Slots of the first `overwrite.len()` tokens (already cached); the rest are appended.
    overwrite: &'a [usize],
    logits: Logits,
    observer: Option<&'f mut LayerObserver<'f>>,
    queries: Option<&'f mut QueryObserver<'f>>,
    blend: Option<Blend<'f>>,
    /// The first layer to run: later than 0 when the earlier ones ran elsewhere (the GPU of a
    /// split placement) and `input` holds their output.
    first_layer: usize,
    /// The residual stream entering `first_layer` (`[tokens][n_embd]`), instead of embeddings.
    input: Option<&'a [f32]>,
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
            fingerprint: std::sync::OnceLock::new(),
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

    /// A stable 128-bit identity of the model's computation: xxh3-128 over the configuration
    /// (architecture, shapes, RoPE settings) and every tensor's name, type, shape and bytes.
    /// Stored KV carries it, so KV computed by other weights is never reused. Hashing runs once,
    /// on first use, at memory speed (about 10 ms for the 100 MB default model, seconds for a
    /// 70B one).
    pub fn fingerprint(&self) -> [u8; 16] {
        *self.fingerprint.get_or_init(|| {
            let mut h = xxhash_rust::xxh3::Xxh3::new();
            let c = &self.cfg;
            h.update(
                format!(
                    "engram-model-fingerprint-v1|{}|{} {} {} {} {} {} {} {}|{} {} {} {:?} {:?}",
                    c.arch.name(),
                    c.n_layer,
                    c.n_embd,
                    c.n_ff,
                    c.n_head,
                    c.n_head_kv,
                    c.head_dim,
                    c.head_dim_v,
                    c.vocab_size,
                    c.rms_eps,
                    c.rope_base,
                    c.rope_dims,
                    c.rope_style,
                    c.rope_scaling,
                )
                .as_bytes(),
            );
            let file = &self.weights.file;
            for t in file.tensors() {
                h.update(format!("|{}:{:?}:{:?}|", t.name, t.ty, t.dims).as_bytes());
                h.update(file.tensor_data(t));
            }
            h.digest128().to_le_bytes()
        })
    }

    /// Number of compute threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The worker pool the kernels run on (`threads()` threads).
    pub fn pool(&self) -> &engram_kernels::ThreadPool {
        &self.pool
    }

    /// Bytes one decode step reads from memory with `context` tokens cached: every weight
    /// matrix of the blocks and the output head, one row of the token embedding, the norm and
    /// bias vectors, and the f16 keys and values of every layer. Decode on a CPU is bound by
    /// memory: this times tokens per second is the bandwidth it achieves.
    pub fn decode_bytes(&self, context: usize) -> u64 {
        let w = &self.weights;
        let bytes = |m: &crate::weights::Matrix| w.file.tensor_data(&m.info).len() as u64;
        let floats = |v: &Option<Vec<f32>>| v.as_ref().map_or(0, Vec::len);
        let mut total = bytes(&w.output)
            + bytes(&w.token_embd) / w.token_embd.rows as u64
            + 4 * w.output_norm.len() as u64;
        let used = self.cfg.moe.map_or(0, |m| m.n_expert_used);
        for l in &w.layers {
            total += [&l.wq, &l.wk, &l.wv, &l.wo]
                .into_iter()
                .map(bytes)
                .sum::<u64>()
                + l.ffn.bytes_per_token(&w.file, used);
            let vectors = l.attn_norm.len()
                + l.ffn_norm.len()
                + floats(&l.bq)
                + floats(&l.bk)
                + floats(&l.bv)
                + floats(&l.q_norm)
                + floats(&l.k_norm);
            total += 4 * vectors as u64;
        }
        let kv = 2 * 2 * self.cfg.kv_width() * context * self.cfg.n_layer;
        total + kv as u64
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
        self.forward_with(tokens, positions, kv, logits, None, None)
    }

    /// Runs `tokens` at `positions` in calls of at most [`PREFILL_CHUNK`] tokens (bounding the
    /// activations held at once) and returns the logits asked for, of every call for
    /// [`Logits::All`], of the last one for [`Logits::Last`].
    pub fn prefill(
        &self,
        tokens: &[u32],
        positions: &[i32],
        kv: &mut KvCache,
        logits: Logits,
    ) -> Result<Vec<f32>> {
        self.prefill_interleaved(tokens, positions, kv, logits, PREFILL_CHUNK, &mut || {})
    }

    /// [`Model::prefill`] in pieces of at most `piece` tokens (at most [`PREFILL_CHUNK`]),
    /// calling `between` after every piece but the last: a scheduler runs other sequences'
    /// decode steps there, so a long prompt does not stall them (chunked prefill).
    pub fn prefill_interleaved(
        &self,
        tokens: &[u32],
        positions: &[i32],
        kv: &mut KvCache,
        logits: Logits,
        piece: usize,
        between: &mut dyn FnMut(),
    ) -> Result<Vec<f32>> {
        if tokens.len() != positions.len() {
            return Err(ModelError::PositionCount {
                tokens: tokens.len(),
                positions: positions.len(),
            });
        }
        let piece = piece.clamp(1, PREFILL_CHUNK);
        let n_pieces = tokens.len().div_ceil(piece);
        let mut out = Vec::new();
        for (i, (t, p)) in tokens
            .chunks(piece)
            .zip(positions.chunks(piece))
            .enumerate()
        {
            let last = i + 1 == n_pieces;
            let want = match logits {
                Logits::Last if !last => Logits::None,
                other => other,
            };
            out.extend(self.forward(t, p, kv, want)?);
            if !last {
                between();
            }
        }
        Ok(out)
    }

    /// Runs several sequences, each over its own cache, through the model in one pass: every
    /// weight matrix is read once for all the call's rows (continuous batching: one decode step
    /// of many sequences costs about as much memory traffic as one), while attention stays per
    /// sequence. Each sequence's logits equal, bit for bit, what [`Model::forward`] on it alone
    /// returns (the kernels' results do not depend on the row count).
    ///
    /// Returns the logits asked for, sequence after sequence ([`Logits::Last`]: the last token
    /// of each sequence). On error no cache keeps a slot of this call.
    pub fn forward_batch(&self, seqs: &mut [Sequence<'_>], logits: Logits) -> Result<Vec<f32>> {
        self.forward_batch_at(seqs, logits, 0, None)
    }

    /// [`Model::forward`] that also hands `observer` every layer's fresh keys before RoPE and
    /// values (`[tokens][kv_width]` each, f32): how chunk KV is captured for storage.
    pub fn forward_observed(
        &self,
        tokens: &[u32],
        positions: &[i32],
        kv: &mut KvCache,
        logits: Logits,
        observer: &mut LayerObserver<'_>,
    ) -> Result<Vec<f32>> {
        // Shorten the observer's own lifetime to the borrow's (`Call` holds one lifetime).
        let observer: &mut LayerObserver<'_> = observer;
        self.forward_with(tokens, positions, kv, logits, Some(observer), None)
    }

    /// [`Model::forward`] that also hands `queries` every layer's queries after RoPE, before
    /// its attention.
    pub fn forward_queries(
        &self,
        tokens: &[u32],
        positions: &[i32],
        kv: &mut KvCache,
        logits: Logits,
        queries: &mut QueryObserver<'_>,
    ) -> Result<Vec<f32>> {
        // As in `forward_observed`.
        let queries: &mut QueryObserver<'_> = queries;
        self.forward_with(tokens, positions, kv, logits, None, Some(queries))
    }

    /// Runs layers `first_layer..` and the output head on `input`, the residual stream the
    /// earlier layers produced elsewhere (`[tokens][n_embd]`, every sequence's rows one after
    /// the other; the GPU half of a split placement), appending each sequence's slots to its
    /// cache (whose layers below `first_layer` are left unwritten). As [`Model::forward_batch`],
    /// each weight matrix is read once for all the sequences, and each sequence's logits equal
    /// what the same call on it alone returns.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn forward_batch_from_layer(
        &self,
        input: &[f32],
        first_layer: usize,
        seqs: &mut [Sequence<'_>],
        logits: Logits,
    ) -> Result<Vec<f32>> {
        self.forward_batch_at(seqs, logits, first_layer, Some(input))
    }

    /// The batched forward call from layer `first_layer`: from the sequences' embeddings, or
    /// from `input`, the residual stream entering that layer (every sequence's rows).
    fn forward_batch_at(
        &self,
        seqs: &mut [Sequence<'_>],
        logits: Logits,
        first_layer: usize,
        input: Option<&[f32]>,
    ) -> Result<Vec<f32>> {
        let mut bounds = Vec::with_capacity(seqs.len() + 1);
        bounds.push(0);
        for (index, s) in seqs.iter().enumerate() {
            self.check_call(s.tokens, s.positions, s.kv)?;
            if s.tokens.is_empty() {
                return Err(ModelError::EmptySequence { index });
            }
            bounds.push(bounds[index] + s.tokens.len());
        }
        let n = bounds[seqs.len()];
        if let Some(input) = input.filter(|x| x.len() != n * self.cfg.n_embd) {
            return Err(ModelError::PositionCount {
                tokens: input.len() / self.cfg.n_embd.max(1),
                positions: n,
            });
        }
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.tokens).copied().collect();
        let positions: Vec<i32> = seqs.iter().flat_map(|s| s.positions).copied().collect();
        let mut kvs: Vec<&mut KvCache> = seqs.iter_mut().map(|s| &mut *s.kv).collect();
        let call = Call {
            tokens: &tokens,
            positions: &positions,
            bounds: &bounds,
            overwrite: &[],
            logits,
            observer: None,
            queries: None,
            blend: None,
            first_layer,
            input,
        };
        self.run(call, &mut kvs).map(|(logits, _)| logits)
    }

    /// One sequence's forward call, with the observers asked for.
    fn forward_with<'f>(
        &self,
        tokens: &[u32],
        positions: &[i32],
        kv: &mut KvCache,
        logits: Logits,
        observer: Option<&'f mut LayerObserver<'f>>,
        queries: Option<&'f mut QueryObserver<'f>>,
    ) -> Result<Vec<f32>> {
        self.check_call(tokens, positions, kv)?;
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        let call = Call {
            tokens,
            positions,
            bounds: &[0, tokens.len()],
            overwrite: &[],
            logits,
            observer,
            queries,
            blend: None,
            first_layer: 0,
            input: None,
        };
        self.run(call, &mut [kv]).map(|(logits, _)| logits)
    }

    /// Selective recomputation (CacheBlend): the first `overwrite.len()` tokens already sit in
    /// the cache with stored keys and values at those slots (and at their positions); the rest
    /// are appended. Every token runs through the layers up to and including
    /// `blend.check_layer`, whose fresh keys and values replace the stored ones; there the
    /// squared deviation of each token's fresh values from its stored ones goes to
    /// `blend.select`, and only the tokens it keeps (plus every appended token, and always the
    /// last) run through the later layers, overwriting their slots. Masking stays by position,
    /// so each recomputed token sees exactly the tokens before it.
    ///
    /// Returns the logits asked for (of kept tokens only) and the kept token indices. On error
    /// the overwritten slots may hold a mix of stored and fresh values: discard the cache.
    pub fn forward_blend(
        &self,
        tokens: &[u32],
        positions: &[i32],
        overwrite: &[usize],
        kv: &mut KvCache,
        blend: Blend<'_>,
        logits: Logits,
    ) -> Result<(Vec<f32>, Vec<usize>)> {
        self.check_call(tokens, positions, kv)?;
        if overwrite.len() > tokens.len() {
            return Err(ModelError::OverwriteCount {
                overwrite: overwrite.len(),
                tokens: tokens.len(),
            });
        }
        for (i, &slot) in overwrite.iter().enumerate() {
            if kv.positions().get(slot) != Some(&positions[i]) {
                return Err(ModelError::OverwriteSlot {
                    index: i,
                    slot,
                    position: positions[i],
                });
            }
        }
        if tokens.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        if blend.check_layer >= self.cfg.n_layer {
            return Err(ModelError::BadLayer {
                layer: blend.check_layer,
                n_layer: self.cfg.n_layer,
            });
        }
        let call = Call {
            tokens,
            positions,
            bounds: &[0, tokens.len()],
            overwrite,
            logits,
            observer: None,
            queries: None,
            blend: Some(blend),
            first_layer: 0,
            input: None,
        };
        self.run(call, &mut [kv])
    }

    fn check_call(&self, tokens: &[u32], positions: &[i32], kv: &KvCache) -> Result<()> {
        self.check_tokens(tokens, positions)?;
        kv.check_layout(&self.cfg)
    }

    /// One position per token, every token in the vocabulary, no negative position (the checks
    /// every forward entry point makes, on the CPU or the GPU, before touching a cache).
    pub(crate) fn check_tokens(&self, tokens: &[u32], positions: &[i32]) -> Result<()> {
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
        Ok(())
    }

    /// Appends the call's new slots to each sequence's cache (`kvs[s]` for sequence `s`; only
    /// the first sequence may overwrite), runs it, and on error forgets the appended slots again.
    fn run(&self, call: Call<'_, '_>, kvs: &mut [&mut KvCache]) -> Result<(Vec<f32>, Vec<usize>)> {
        let mut first_slots = Vec::with_capacity(kvs.len());
        for (s, kv) in kvs.iter_mut().enumerate() {
            let skip = if s == 0 { call.overwrite.len() } else { 0 };
            let appended = &call.positions[call.bounds[s] + skip..call.bounds[s + 1]];
            match kv.append_slots(appended) {
                Ok(first) => first_slots.push(first),
                Err(e) => {
                    kvs.iter_mut()
                        .zip(&first_slots)
                        .for_each(|(kv, &first)| kv.truncate(first));
                    return Err(e);
                }
            }
        }
        let result = self.run_slots(call, kvs, &first_slots);
        if result.is_err() {
            // Leave no half-written slots behind.
            kvs.iter_mut()
                .zip(&first_slots)
                .for_each(|(kv, &first)| kv.truncate(first));
        }
        result
    }

    fn run_slots(
        &self,
        call: Call<'_, '_>,
        kvs: &mut [&mut KvCache],
        first_slots: &[usize],
    ) -> Result<(Vec<f32>, Vec<usize>)> {
        let Call {
            tokens,
            positions,
            bounds,
            overwrite,
            logits,
            mut observer,
            mut queries,
            mut blend,
            first_layer,
            input,
        } = call;
        let cfg = &self.cfg;
        let mut n = tokens.len();
        let mut bounds = bounds.to_vec();
        // Destination slot, sequence, position and original index of each row still running.
        let mut slots: Vec<usize> = Vec::with_capacity(n);
        let mut seq_of: Vec<usize> = Vec::with_capacity(n);
        for (s, &first) in first_slots.iter().enumerate() {
            let skip = if s == 0 { overwrite.len() } else { 0 };
            let appended = bounds[s + 1] - bounds[s] - skip;
            if s == 0 {
                slots.extend_from_slice(overwrite);
            }
            slots.extend(first..first + appended);
            seq_of.resize(bounds[s + 1], s);
        }
        let mut positions: Vec<i32> = positions.to_vec();
        let mut kept: Vec<usize> = (0..n).collect();

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
        match input {
            Some(x) => s.x.copy_from_slice(x),
            None => {
                for (t, &tok) in tokens.iter().enumerate() {
                    self.weights.embed(tok, &mut s.x[t * d..(t + 1) * d])?;
                }
            }
        }
        let mut angles = Vec::with_capacity(n * self.rope.pairs());
        for &p in &positions {
            self.rope.angles(p, &mut angles);
        }
        let pairs = self.rope.pairs();
        let mut k_raw = if observer.is_some() {
            vec![0.0; n * kvw]
        } else {
            Vec::new()
        };

        for (li, layer) in self.weights.layers.iter().enumerate().skip(first_layer) {
            // Attention block.
            rms_norm(
                &s.x[..n * d],
                &layer.attn_norm,
                cfg.rms_eps,
                &mut s.h[..n * d],
            );
            self.matmul_many(
                &[&layer.wq, &layer.wk, &layer.wv],
                &s.h[..n * d],
                n,
                &mut [&mut s.q[..n * qw], &mut s.k[..n * kvw], &mut s.v[..n * kvw]],
            )?;
            for (buf, bias) in [
                (&mut s.q[..n * qw], &layer.bq),
                (&mut s.k[..n * kvw], &layer.bk),
                (&mut s.v[..n * kvw], &layer.bv),
            ] {
                if let Some(b) = bias {
                    for row in buf.chunks_exact_mut(b.len()) {
                        row.iter_mut().zip(b).for_each(|(x, b)| *x += b);
                    }
                }
            }
            if let Some(w) = &layer.q_norm {
                rms_norm_in_place(&mut s.q[..n * qw], w, cfg.rms_eps);
            }
            if let Some(w) = &layer.k_norm {
                rms_norm_in_place(&mut s.k[..n * kvw], w, cfg.rms_eps);
            }
            if let Some(obs) = observer.as_deref_mut() {
                k_raw[..n * kvw].copy_from_slice(&s.k[..n * kvw]);
                obs(li, &k_raw[..n * kvw], &s.v[..n * kvw]);
            }
            // CacheBlend's check layer: how far each row's fresh values are from its stored ones
            // (appended rows have none and always continue).
            let deviation: Option<Vec<f32>> = match &blend {
                Some(b) if b.check_layer == li => {
                    Some(self.value_deviation(kvs[0], li, &slots[..n], overwrite.len(), &s.v))
                }
                _ => None,
            };
            for t in 0..n {
                let a = &angles[t * pairs..(t + 1) * pairs];
                self.rope.rotate(&mut s.q[t * qw..(t + 1) * qw], a);
                self.rope.rotate(&mut s.k[t * kvw..(t + 1) * kvw], a);
                kvs[seq_of[t]].write(
                    li,
                    slots[t],
                    &s.k[t * kvw..(t + 1) * kvw],
                    &s.v[t * kvw..(t + 1) * kvw],
                );
            }
            if let Some(obs) = queries.as_deref_mut() {
                if obs(li, &s.q[..n * qw]).is_break() {
                    return Ok((Vec::new(), kept));
                }
            }
            if let (Some(dev), Some(b)) = (deviation, blend.as_mut()) {
                let keep = select_rows(&dev, &mut *b.select);
                compact_rows(&keep, &mut s.q, qw);
                compact_rows(&keep, &mut s.x, d);
                compact_rows(&keep, &mut angles, pairs);
                slots = keep.iter().map(|&r| slots[r]).collect();
                positions = keep.iter().map(|&r| positions[r]).collect();
                kept = keep.iter().map(|&r| kept[r]).collect();
                n = keep.len();
                // Blending runs on one sequence only.
                seq_of.truncate(n);
                bounds = vec![0, n];
            }
            self.attention(
                li,
                kvs,
                &bounds,
                &positions,
                &s.q[..n * qw],
                &mut s.attn[..n * qw],
            )?;
            self.matmul(&layer.wo, &s.attn[..n * qw], n, &mut s.proj[..n * d])?;
            add_assign(&mut s.x[..n * d], &s.proj[..n * d]);

            // Feed-forward block.
            rms_norm(
                &s.x[..n * d],
                &layer.ffn_norm,
                cfg.rms_eps,
                &mut s.h[..n * d],
            );
            match &layer.ffn {
                Ffn::Dense { gate, up, down } => {
                    self.matmul_many(
                        &[gate, up],
                        &s.h[..n * d],
                        n,
                        &mut [&mut s.gate[..n * ff], &mut s.up[..n * ff]],
                    )?;
                    engram_kernels::swiglu(&mut s.gate[..n * ff], &s.up[..n * ff], &self.pool)?;
                    self.matmul(down, &s.gate[..n * ff], n, &mut s.proj[..n * d])?;
                }
                Ffn::Moe(moe) => self.moe_ffn(moe, &s.h[..n * d], n, &mut s.proj[..n * d])?,
            }
            add_assign(&mut s.x[..n * d], &s.proj[..n * d]);
        }

        let last_rows: Vec<f32>;
        let rows: &[f32] = match logits {
            Logits::None => return Ok((Vec::new(), kept)),
            Logits::Last if bounds.len() == 2 => &s.x[(n - 1) * d..n * d],
            Logits::Last => {
                last_rows = bounds[1..]
                    .iter()
                    .flat_map(|&end| &s.x[(end - 1) * d..end * d])
                    .copied()
                    .collect();
                &last_rows
            }
            Logits::All => &s.x[..n * d],
        };
        let m = rows.len() / d;
        let mut normed = vec![0.0; rows.len()];
        rms_norm(rows, &self.weights.output_norm, cfg.rms_eps, &mut normed);
        let mut out = vec![0.0; m * cfg.vocab_size];
        self.matmul(&self.weights.output, &normed, m, &mut out)?;
        Ok((out, kept))
    }

    /// Sum over every KV head of the squared difference between each row's fresh values and
    /// the values stored in its slot of layer `li`; rows past `n_overwrite` (appended, nothing
    /// stored) get infinity so that they are always kept.
    fn value_deviation(
        &self,
        kv: &KvCache,
        li: usize,
        slots: &[usize],
        n_overwrite: usize,
        v: &[f32],
    ) -> Vec<f32> {
        let (hd, kvw) = (self.cfg.head_dim, self.cfg.kv_width());
        slots
            .iter()
            .enumerate()
            .map(|(t, &slot)| {
                if t >= n_overwrite {
                    return f32::INFINITY;
                }
                (0..self.cfg.n_head_kv)
                    .map(|h| {
                        let stored = &kv.values(li, h, slot + 1)[slot * hd..(slot + 1) * hd];
                        let fresh = &v[t * kvw + h * hd..t * kvw + (h + 1) * hd];
                        stored
                            .iter()
                            .zip(fresh)
                            .map(|(a, b)| (a.to_f32() - b).powi(2))
                            .sum::<f32>()
                    })
                    .sum()
            })
            .collect()
    }

    /// A mixture-of-experts block on `n` normed rows `h`, into `out`, as llama.cpp computes it
    /// (`build_moe_ffn` with softmax gating and normalised weights): each token's router
    /// logits, softmax over every expert, the `n_expert_used` most probable experts (ties to
    /// the lower index) weighted by their probabilities over the chosen ones' sum; then expert by
    /// expert, the tokens routed to it gathered into one batch (a prefill's tokens share each
    /// expert's weight reads); last, each token's weighted outputs summed in the order the
    /// router ranked them. The experts never take the AMX tiles
    /// ([`engram_kernels::matmul_many_no_amx`]: groups of ~32 tokens gain nothing from them,
    /// and their block order slows a decode step), so a token's result does not depend on the
    /// other tokens of the call.
    fn moe_ffn(&self, moe: &MoeFfn, h: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
        let m = self.cfg.moe.expect("an MoE block has an MoE config");
        let (d, ff, ne, k) = (self.cfg.n_embd, m.n_ff_expert, m.n_expert, m.n_expert_used);
        let file = &self.weights.file;
        let mut logits = vec![0.0; n * ne];
        self.matmul(&moe.router, h, n, &mut logits)?;
        // Per token, its experts in rank order and their weights.
        let mut chosen: Vec<(usize, f32)> = Vec::with_capacity(n * k);
        for row in logits.chunks_exact(ne) {
            route(row, k, &mut chosen);
        }
        // Per expert, the (token, rank) pairs routed to it, in token order.
        let mut groups: Vec<Vec<usize>> = vec![Vec::new(); ne];
        for (i, &(e, _)) in chosen.iter().enumerate() {
            groups[e].push(i);
        }
        // Every (token, rank)'s expert output.
        let mut ys = vec![0.0f32; n * k * d];
        if n == 1 {
            // One token (decode): every chosen expert's gate and up projections of the same
            // input in one dispatch, then each expert's down projection.
            let views: Vec<_> = chosen
                .iter()
                .flat_map(|&(e, _)| [moe.gate.view(file, e), moe.up.view(file, e)])
                .collect();
            let mut act = vec![0.0f32; 2 * k * ff];
            {
                let mut outs: Vec<&mut [f32]> = act.chunks_exact_mut(ff).collect();
                engram_kernels::matmul_many_no_amx(&views, h, 1, &mut outs, &self.pool)?;
            }
            for (j, &(e, _)) in chosen.iter().enumerate() {
                let (gate, up) = act[2 * j * ff..(2 * j + 2) * ff].split_at_mut(ff);
                engram_kernels::swiglu(gate, up, &self.pool)?;
                engram_kernels::matmul_many_no_amx(
                    &[moe.down.view(file, e)],
                    gate,
                    1,
                    &mut [&mut ys[j * d..(j + 1) * d]],
                    &self.pool,
                )?;
            }
        } else {
            let most = groups.iter().map(Vec::len).max().unwrap_or(0);
            let (mut xs, mut ys_e) = (vec![0.0f32; most * d], vec![0.0f32; most * d]);
            let (mut gate, mut up) = (vec![0.0f32; most * ff], vec![0.0f32; most * ff]);
            for (e, group) in groups.iter().enumerate() {
                let g = group.len();
                if g == 0 {
                    continue;
                }
                for (r, &i) in group.iter().enumerate() {
                    let t = i / k;
                    xs[r * d..(r + 1) * d].copy_from_slice(&h[t * d..(t + 1) * d]);
                }
                engram_kernels::matmul_many_no_amx(
                    &[moe.gate.view(file, e), moe.up.view(file, e)],
                    &xs[..g * d],
                    g,
                    &mut [&mut gate[..g * ff], &mut up[..g * ff]],
                    &self.pool,
                )?;
                engram_kernels::swiglu(&mut gate[..g * ff], &up[..g * ff], &self.pool)?;
                engram_kernels::matmul_many_no_amx(
                    &[moe.down.view(file, e)],
                    &gate[..g * ff],
                    g,
                    &mut [&mut ys_e[..g * d]],
                    &self.pool,
                )?;
                for (r, &i) in group.iter().enumerate() {
                    ys[i * d..(i + 1) * d].copy_from_slice(&ys_e[r * d..(r + 1) * d]);
                }
            }
        }
        for (t, o) in out.chunks_exact_mut(d).enumerate() {
            for j in 0..k {
                let (_, w) = chosen[t * k + j];
                let y = &ys[(t * k + j) * d..(t * k + j + 1) * d];
                if j == 0 {
                    o.iter_mut().zip(y).for_each(|(o, y)| *o = w * y);
                } else {
                    o.iter_mut().zip(y).for_each(|(o, y)| *o += w * y);
                }
            }
        }
        Ok(())
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

    /// Scaled dot-product attention of each sequence's queries (rows `bounds[s]..bounds[s+1]`
    /// of `q`) over the whole cache of layer `li` of its own cache `kvs[s]`, masked by
    /// position: the tiled kernel in `engram-kernels`, every sequence in one dispatch. Writes
    /// `q.len()` values.
    fn attention(
        &self,
        li: usize,
        kvs: &[&mut KvCache],
        bounds: &[usize],
        positions: &[i32],
        q: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        let cfg = &self.cfg;
        let qw = cfg.q_width();
        let keys: Vec<Vec<&[f16]>> = kvs
            .iter()
            .map(|kv| {
                (0..cfg.n_head_kv)
                    .map(|h| kv.keys(li, h, kv.len()))
                    .collect()
            })
            .collect();
        let values: Vec<Vec<&[f16]>> = kvs
            .iter()
            .map(|kv| {
                (0..cfg.n_head_kv)
                    .map(|h| kv.values(li, h, kv.len()))
                    .collect()
            })
            .collect();
        let calls: Vec<engram_kernels::Attention<'_>> = kvs
            .iter()
            .enumerate()
            .map(|(si, kv)| {
                let rows = bounds[si]..bounds[si + 1];
                engram_kernels::Attention {
                    n_head: cfg.n_head,
                    n_head_kv: cfg.n_head_kv,
                    head_dim: cfg.head_dim,
                    scale: 1.0 / (cfg.head_dim as f32).sqrt(),
                    q: &q[rows.start * qw..rows.end * qw],
                    q_pos: &positions[rows],
                    keys: &keys[si],
                    values: &values[si],
                    kv_pos: kv.positions(),
                }
            })
            .collect();
        let mut outs: Vec<&mut [f32]> = Vec::with_capacity(kvs.len());
        let mut rest = out;
        for si in 0..kvs.len() {
            let (head, tail) = rest.split_at_mut((bounds[si + 1] - bounds[si]) * qw);
            outs.push(head);
            rest = tail;
        }
        engram_kernels::attention_many(&calls, &mut outs, &self.pool)?;
        Ok(())
    }
}

/// Appends to `chosen` the `k` experts a token's router `logits` pick and their weights: the
/// softmax over every expert, the `k` largest probabilities (ties to the lower index), each
/// divided by their sum (at least 2^-14, llama.cpp's guard against a zero sum).
pub(crate) fn route(logits: &[f32], k: usize, chosen: &mut Vec<(usize, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let sum: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= sum);
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.select_nth_unstable_by(k - 1, |&a, &b| {
        probs[b].total_cmp(&probs[a]).then(a.cmp(&b))
    });
    order.truncate(k);
    order.sort_unstable_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    let total = order
        .iter()
        .map(|&e| probs[e])
        .sum::<f32>()
        .max(6.103_515_6e-5);
    chosen.extend(order.into_iter().map(|e| (e, probs[e] / total)));
}

/// The rows `select` keeps plus every appended row and the last one, sorted.
fn select_rows(deviation: &[f32], select: &mut dyn FnMut(&[f32]) -> Vec<usize>) -> Vec<usize> {
    let n = deviation.len();
    let mut keep: Vec<usize> = select(deviation).into_iter().filter(|&r| r < n).collect();
    // Appended rows (nothing stored, infinite deviation) and the last row always continue.
    keep.extend((0..n).filter(|&r| deviation[r].is_infinite()));
    keep.push(n - 1);
    keep.sort_unstable();
    keep.dedup();
    keep
}

/// Moves the rows listed in `keep` (sorted) to the front of `buf`, rows of `width` values.
fn compact_rows<T: Copy>(keep: &[usize], buf: &mut [T], width: usize) {
    for (i, &r) in keep.iter().enumerate() {
        if i != r {
            buf.copy_within(r * width..(r + 1) * width, i * width);
        }
    }
}

fn add_assign(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}
