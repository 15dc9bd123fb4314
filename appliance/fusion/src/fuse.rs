//! Fused prefill: a prompt assembled from segments (prefix, stored chunks, suffix), each chunk's
//! stored KV placed at its real positions by token ids, the tokens the policy names recomputed
//! under an exact causal mask, then the suffix prefilled over the fused cache.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use engram_model::{Blend, KvCache, Logits, Model};

use crate::chunks::{ChunkStore, FetchTimes, Source};
use crate::error::{FusionError, Result};
use crate::policy::{Policy, CHECK_LAYER};
use crate::prefix::PrefixCache;

/// A prompt as segments of token ids. The concatenation `prefix ++ chunks.. ++ suffix` is the
/// prompt full prefill would run; chunks are never re-tokenized from text.
#[derive(Debug, Clone, Default)]
pub struct FusedPrompt {
    /// Exact, cacheable start (chat template and system prompt).
    pub prefix: Vec<u32>,
    /// The retrieved chunks' token ids, in prompt order.
    pub chunks: Vec<Vec<u32>>,
    /// The question and the generation prompt.
    pub suffix: Vec<u32>,
    /// The suffix tokens that spell the evidence sentence a layout shows after the passages
    /// (empty when it shows none); [`crate::CopyBias`] reads the numbers it states.
    pub evidence: std::ops::Range<usize>,
    /// The evidence sentence those tokens spell, as the prompt shows it (empty when it shows
    /// none): the answer when the model writes none ([`crate::OutputText::or_sentence`]).
    pub evidence_text: String,
}

impl FusedPrompt {
    /// Every token id in prompt order.
    pub fn tokens(&self) -> Vec<u32> {
        let mut all = self.prefix.clone();
        for c in &self.chunks {
            all.extend_from_slice(c);
        }
        all.extend_from_slice(&self.suffix);
        all
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.prefix.len() + self.chunks.iter().map(Vec::len).sum::<usize>() + self.suffix.len()
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of chunk tokens.
    pub fn chunk_tokens(&self) -> usize {
        self.chunks.iter().map(Vec::len).sum()
    }
}

/// What a fused prefill did and how long each stage took.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct FuseStats {
    pub policy: String,
    pub prompt_tokens: usize,
    pub prefix_tokens: usize,
    /// Prefix tokens served by the prefix cache.
    pub prefix_cached_tokens: usize,
    pub chunk_tokens: usize,
    /// Chunk tokens run through every layer.
    pub recomputed_chunk_tokens: usize,
    pub suffix_tokens: usize,
    pub chunks_from_dram: usize,
    pub chunks_from_nvme: usize,
    /// Chunks with no usable stored KV, computed during the request.
    pub chunks_computed: usize,
    pub kv_bytes_read: u64,
    #[serde(serialize_with = "ms")]
    pub prefix_time: Duration,
    /// Reading the chunk KV from the tiers.
    #[serde(serialize_with = "ms")]
    pub kv_read_time: Duration,
    /// Verifying and decoding it.
    #[serde(serialize_with = "ms")]
    pub kv_decode_time: Duration,
    /// Computing missing chunks.
    #[serde(serialize_with = "ms")]
    pub kv_compute_time: Duration,
    /// Rotating and copying it into the cache.
    #[serde(serialize_with = "ms")]
    pub kv_place_time: Duration,
    /// Choosing the stored tokens to recompute (`query:R`: its partial pass over the suffix and
    /// the attention mass).
    #[serde(serialize_with = "ms")]
    pub rank_time: Duration,
    /// Recomputing chunk tokens.
    #[serde(serialize_with = "ms")]
    pub recompute_time: Duration,
    /// Prefilling the suffix (question).
    #[serde(serialize_with = "ms")]
    pub suffix_time: Duration,
    /// The whole prefill, less `interleaved_time`.
    #[serde(serialize_with = "ms")]
    pub total_time: Duration,
    /// Other sequences' decode steps run between this prefill's pieces (left out of every
    /// stage time above).
    #[serde(serialize_with = "ms")]
    pub interleaved_time: Duration,
}

fn ms<S: serde::Serializer>(d: &Duration, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e3)
}

impl FuseStats {
    /// KV fetch, verification and placement together.
    pub fn kv_load_time(&self) -> Duration {
        self.kv_read_time + self.kv_decode_time + self.kv_place_time
    }

    /// The stage timings of an answer as JSON (milliseconds), as `engram ask` and `engramd`
    /// report them; callers add their own stages (retrieval, queue, first token, decode).
    pub fn timings_json(&self) -> serde_json::Map<String, serde_json::Value> {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        // The stages add up to the total: what no stage covers (gathering slots, the logits
        // copy) is `prefill_other_ms`.
        let stages = self.prefix_time
            + self.kv_load_time()
            + self.kv_compute_time
            + self.rank_time
            + self.recompute_time
            + self.suffix_time;
        let v = serde_json::json!({
            "prefix_prefill_ms": ms(self.prefix_time),
            "kv_load_ms": ms(self.kv_load_time()),
            "kv_compute_ms": ms(self.kv_compute_time),
            "kv_chunks": {
                "dram": self.chunks_from_dram,
                "nvme": self.chunks_from_nvme,
                "computed": self.chunks_computed,
            },
            "kv_bytes": self.kv_bytes_read,
            "prefix_cached_tokens": self.prefix_cached_tokens,
            "rank_ms": ms(self.rank_time),
            "recompute_ms": ms(self.recompute_time),
            "recomputed_tokens": self.recomputed_chunk_tokens,
            "question_prefill_ms": ms(self.suffix_time),
            "prefill_other_ms": ms(self.total_time.saturating_sub(stages)),
            "prefill_total_ms": ms(self.total_time),
            "interleaved_decode_ms": ms(self.interleaved_time),
        });
        match v {
            serde_json::Value::Object(m) => m,
            _ => unreachable!("a JSON object literal"),
        }
    }

    /// Share of the non-prefix prompt run through every layer: recomputed chunk tokens plus
    /// the suffix, over chunk plus suffix tokens (1 for `full`).
    pub fn recompute_fraction(&self) -> f64 {
        let all = self.chunk_tokens + self.suffix_tokens;
        if all == 0 {
            return 0.0;
        }
        (self.recomputed_chunk_tokens + self.suffix_tokens) as f64 / all as f64
    }
}

/// The result of a fused prefill: the cache holds the whole prompt, ready to decode.
pub struct Prefilled {
    /// Logits at the last prompt position.
    pub logits: Vec<f32>,
    /// Position of the first generated token.
    pub next_position: i32,
    pub stats: FuseStats,
}

/// Other work to run between the pieces of a prefill (chunked prefill: a scheduler's decode
/// steps of the sequences already generating).
pub struct Interleave<'a> {
    /// Prompt tokens run between two calls of `between` (capped at the model's prefill piece).
    pub piece: usize,
    pub between: &'a mut dyn FnMut(),
}

/// An [`Interleave`] that times what it runs, so stage times can leave it out.
struct Pauses<'a> {
    piece: usize,
    between: Option<&'a mut dyn FnMut()>,
    spent: Duration,
}

impl Pauses<'_> {
    /// `model.prefill`, with the pauses between its pieces.
    fn prefill(
        &mut self,
        model: &Model,
        tokens: &[u32],
        positions: &[i32],
        kv: &mut KvCache,
        logits: Logits,
    ) -> Result<Vec<f32>> {
        let Some(between) = self.between.as_deref_mut() else {
            return Ok(model.prefill(tokens, positions, kv, logits)?);
        };
        let spent = &mut self.spent;
        let mut timed = || {
            let t = Instant::now();
            between();
            *spent += t.elapsed();
        };
        Ok(model.prefill_interleaved(tokens, positions, kv, logits, self.piece, &mut timed)?)
    }

    /// Time since `t` spent on this prefill's own work, given the pause time at `t`.
    fn own(&self, t: Instant, spent_at_t: Duration) -> Duration {
        t.elapsed().saturating_sub(self.spent - spent_at_t)
    }
}

/// Prefills `prompt` into `kv` (cleared first) under `policy`. `store` serves chunk KV (not
/// used by `full`); `prefixes`, when given, serves and keeps the prefix's exact KV.
pub fn fused_prefill(
    model: &Model,
    store: &ChunkStore,
    prefixes: Option<&PrefixCache>,
    prompt: &FusedPrompt,
    policy: Policy,
    kv: &mut KvCache,
) -> Result<Prefilled> {
    fused_prefill_interleaved(model, store, prefixes, prompt, policy, kv, None)
}

/// [`fused_prefill`] that runs `interleave.between` between the pieces of its longer prefills
/// (prefix, `full`'s prompt, `boundary`'s recomputed tokens); the result is the same.
pub fn fused_prefill_interleaved(
    model: &Model,
    store: &ChunkStore,
    prefixes: Option<&PrefixCache>,
    prompt: &FusedPrompt,
    policy: Policy,
    kv: &mut KvCache,
    interleave: Option<Interleave<'_>>,
) -> Result<Prefilled> {
    fused_prefill_on(model, store, prefixes, prompt, policy, kv, interleave, None)
}

/// Another device that runs a fused prefill's forward passes after the stored chunks are placed
/// (`boundary`'s and `query`'s recompute, `reuse`'s and their question). At its first call it
/// takes over `kv` as it is then (the prefix and the placed chunks) and keeps what it computes
/// itself: `kv` is not updated. `full` and `deviation` (whose layer check is CPU code) do not use
/// it; the prefix is prefilled on the CPU (the prefix cache serves it after the first time).
pub trait Runner {
    /// Appends `tokens` at `positions` after what the runner holds (or `kv`, at its first call);
    /// returns the logits asked for.
    fn append(
        &mut self,
        kv: &KvCache,
        tokens: &[u32],
        positions: &[i32],
        logits: Logits,
    ) -> engram_model::Result<Vec<f32>>;

    /// `Model::forward_blend` keeping every row: the first `overwrite.len()` tokens get fresh
    /// keys and values in the slots `overwrite` names (stored chunk tokens recomputed), the rest
    /// are appended; masking by position.
    fn recompute(
        &mut self,
        kv: &KvCache,
        tokens: &[u32],
        positions: &[i32],
        overwrite: &[usize],
        logits: Logits,
    ) -> engram_model::Result<Vec<f32>>;
}

/// [`fused_prefill_interleaved`] with the forward passes after placement on `runner` when one
/// is given (see [`Runner`]); with `None`, on the CPU into `kv`.
#[allow(clippy::too_many_arguments)]
pub fn fused_prefill_on(
    model: &Model,
    store: &ChunkStore,
    prefixes: Option<&PrefixCache>,
    prompt: &FusedPrompt,
    policy: Policy,
    kv: &mut KvCache,
    interleave: Option<Interleave<'_>>,
    mut runner: Option<&mut dyn Runner>,
) -> Result<Prefilled> {
    let start = Instant::now();
    let mut pauses = match interleave {
        Some(i) => Pauses {
            piece: i.piece,
            between: Some(i.between),
            spent: Duration::ZERO,
        },
        None => Pauses {
            piece: 0,
            between: None,
            spent: Duration::ZERO,
        },
    };
    if prompt.suffix.is_empty() {
        return Err(FusionError::EmptySuffix);
    }
    if let Some(index) = prompt.chunks.iter().position(Vec::is_empty) {
        return Err(FusionError::EmptyChunk { index });
    }
    let context = model.config().context_length;
    if prompt.len() > context {
        return Err(FusionError::TooLong {
            tokens: prompt.len(),
            context,
        });
    }
    let mut stats = FuseStats {
        policy: policy.name(),
        prompt_tokens: prompt.len(),
        prefix_tokens: prompt.prefix.len(),
        chunk_tokens: prompt.chunk_tokens(),
        suffix_tokens: prompt.suffix.len(),
        ..FuseStats::default()
    };
    kv.clear();

    // The prefix: exact, from the prefix cache when possible.
    let t = Instant::now();
    stats.prefix_cached_tokens = prefill_prefix(model, prefixes, &prompt.prefix, kv, &mut pauses)?;
    stats.prefix_time = pauses.own(t, Duration::ZERO);

    // Where each chunk starts.
    let mut starts = Vec::with_capacity(prompt.chunks.len());
    let mut pos = prompt.prefix.len();
    for c in &prompt.chunks {
        starts.push(pos);
        pos += c.len();
    }
    let suffix_pos: Vec<i32> = (pos..pos + prompt.suffix.len()).map(|p| p as i32).collect();

    let logits = if policy == Policy::Full {
        let (t, spent) = (Instant::now(), pauses.spent);
        let mut rest: Vec<u32> = prompt.chunks.concat();
        let n_chunk = rest.len();
        rest.extend_from_slice(&prompt.suffix);
        let logits = prefill_run(model, kv, &rest, prompt.prefix.len(), &mut pauses)?;
        stats.recomputed_chunk_tokens = n_chunk;
        // One pass: attribute it by token share.
        let all = pauses.own(t, spent);
        let share = n_chunk as f64 / rest.len() as f64;
        stats.recompute_time = all.mul_f64(share);
        stats.suffix_time = all - stats.recompute_time;
        logits
    } else {
        let refs: Vec<&[u32]> = prompt.chunks.iter().map(Vec::as_slice).collect();
        let (fetched, times) = store.fetch(model, &refs)?;
        let FetchTimes {
            read,
            decode,
            compute,
        } = times;
        stats.kv_read_time = read;
        stats.kv_decode_time = decode;
        stats.kv_compute_time = compute;
        for f in &fetched {
            stats.kv_bytes_read += f.bytes;
            match f.source {
                Source::Tier(engram_kvstore::TierKind::Dram) => stats.chunks_from_dram += 1,
                Source::Tier(engram_kvstore::TierKind::Nvme) => stats.chunks_from_nvme += 1,
                Source::Computed => stats.chunks_computed += 1,
            }
        }
        // How many leading tokens of each chunk are recomputed rather than placed. The first
        // chunk's stored KV is exact when the prompt's prefix is the frame it was computed in.
        let exact_start = |i: usize| i == 0 && prompt.prefix == store.frame();
        let skip: Vec<usize> = prompt
            .chunks
            .iter()
            .enumerate()
            .map(|(i, c)| match policy {
                Policy::Boundary(n) if !exact_start(i) => n.min(c.len()),
                _ => 0,
            })
            .collect();

        let t = Instant::now();
        let mut chunk_slots = Vec::with_capacity(prompt.chunk_tokens());
        for ((f, &s), &at) in fetched.iter().zip(&skip).zip(&starts) {
            let c = &f.kv;
            let hd = c.layout().head_dim;
            let n = c.layout().n_tokens;
            let positions: Vec<i32> = ((at + s)..(at + n)).map(|p| p as i32).collect();
            let first = kv.append_prerope(
                model.rope(),
                &positions,
                |l, h| &c.k_head(l, h)[s * hd..],
                |l, h| &c.v_head(l, h)[s * hd..],
                model.pool(),
            )?;
            chunk_slots.extend(first..first + positions.len());
        }
        stats.kv_place_time = t.elapsed();

        match policy {
            Policy::Boundary(_) => {
                let (t, spent) = (Instant::now(), pauses.spent);
                let mut tokens = Vec::new();
                let mut positions = Vec::new();
                for ((c, &s), &at) in prompt.chunks.iter().zip(&skip).zip(&starts) {
                    tokens.extend_from_slice(&c[..s]);
                    positions.extend((at..at + s).map(|p| p as i32));
                }
                stats.recomputed_chunk_tokens = tokens.len();
                match runner.as_deref_mut() {
                    Some(r) => {
                        r.append(kv, &tokens, &positions, Logits::None)?;
                    }
                    None => {
                        pauses.prefill(model, &tokens, &positions, kv, Logits::None)?;
                    }
                }
                stats.recompute_time = pauses.own(t, spent);
                let t = Instant::now();
                let logits = match runner {
                    Some(r) => r.append(kv, &prompt.suffix, &suffix_pos, Logits::Last)?,
                    None => model.forward(&prompt.suffix, &suffix_pos, kv, Logits::Last)?,
                };
                stats.suffix_time = t.elapsed();
                logits
            }
            Policy::Reuse => {
                let t = Instant::now();
                let logits = match runner {
                    Some(r) => r.append(kv, &prompt.suffix, &suffix_pos, Logits::Last)?,
                    None => model.forward(&prompt.suffix, &suffix_pos, kv, Logits::Last)?,
                };
                stats.suffix_time = t.elapsed();
                logits
            }
            Policy::Deviation(r) => {
                let t = Instant::now();
                let mut tokens: Vec<u32> = prompt.chunks.concat();
                let mut positions: Vec<i32> =
                    (prompt.prefix.len()..pos).map(|p| p as i32).collect();
                let n_ctx = tokens.len();
                tokens.extend_from_slice(&prompt.suffix);
                positions.extend_from_slice(&suffix_pos);
                let budget = ((r as f64) * n_ctx as f64).ceil() as usize;
                let mut select = |dev: &[f32]| top_rows(&dev[..n_ctx.min(dev.len())], budget);
                let (logits, kept) = model.forward_blend(
                    &tokens,
                    &positions,
                    &chunk_slots,
                    kv,
                    Blend {
                        check_layer: CHECK_LAYER.min(model.config().n_layer - 1),
                        select: &mut select,
                    },
                    Logits::Last,
                )?;
                stats.recomputed_chunk_tokens = kept.iter().filter(|&&r| r < n_ctx).count();
                stats.recompute_time = t.elapsed();
                logits
            }
            Policy::Query(r) => {
                let (t, spent) = (Instant::now(), pauses.spent);
                let placed = kv.len();
                // The suffix over the stored KV, as far as the ranking layers, keeping the
                // queries of its last tokens.
                let layers = QUERY_RANK_LAYERS.min(model.config().n_layer);
                let keep = QUERY_RANK_TOKENS * model.config().q_width();
                let mut queries: Vec<Vec<f32>> = vec![Vec::new(); layers];
                model.forward_queries(
                    &prompt.suffix,
                    &suffix_pos,
                    kv,
                    Logits::None,
                    &mut |l, q| {
                        queries[l] = q[q.len().saturating_sub(keep)..].to_vec();
                        if l + 1 < layers {
                            ControlFlow::Continue(())
                        } else {
                            ControlFlow::Break(())
                        }
                    },
                )?;
                kv.truncate(placed);
                let mut mass = attention_mass(model, kv, &queries, placed, &chunk_slots);
                // The first tokens of every chunk (as `boundary:4`) deviate most from full
                // prefill (`eval fusion --kv-deviation`): always recomputed.
                let mut forced = 0;
                for (i, (c, &at)) in prompt.chunks.iter().zip(&starts).enumerate() {
                    if !exact_start(i) {
                        let at = at - prompt.prefix.len();
                        let n = QUERY_BOUNDARY.min(c.len());
                        mass[at..at + n].fill(f32::INFINITY);
                        forced += n;
                    }
                }
                // The first chunk's stored KV is exact when the prefix is its frame.
                let from = if exact_start(0) {
                    prompt.chunks.first().map_or(0, Vec::len)
                } else {
                    0
                };
                let budget = forced + ((r as f64) * chunk_slots.len() as f64).ceil() as usize;
                let mut rows: Vec<usize> = top_rows(&mass[from..], budget)
                    .into_iter()
                    .map(|i| i + from)
                    .collect();
                rows.sort_unstable();
                stats.rank_time = pauses.own(t, spent);
                let (t, spent) = (Instant::now(), pauses.spent);
                let all: Vec<u32> = prompt.chunks.concat();
                let mut tokens: Vec<u32> = rows.iter().map(|&i| all[i]).collect();
                let mut positions: Vec<i32> = rows
                    .iter()
                    .map(|&i| (prompt.prefix.len() + i) as i32)
                    .collect();
                let overwrite: Vec<usize> = rows.iter().map(|&i| chunk_slots[i]).collect();
                tokens.extend_from_slice(&prompt.suffix);
                positions.extend_from_slice(&suffix_pos);
                let n_rows = tokens.len();
                let mut keep_all = |_: &[f32]| (0..n_rows).collect::<Vec<usize>>();
                let logits = match runner {
                    Some(r) => r.recompute(kv, &tokens, &positions, &overwrite, Logits::Last)?,
                    None => {
                        model
                            .forward_blend(
                                &tokens,
                                &positions,
                                &overwrite,
                                kv,
                                Blend {
                                    check_layer: 0,
                                    select: &mut keep_all,
                                },
                                Logits::Last,
                            )?
                            .0
                    }
                };
                stats.recomputed_chunk_tokens = rows.len();
                stats.recompute_time = pauses.own(t, spent);
                logits
            }
            Policy::Full => unreachable!("handled above"),
        }
    };
    stats.interleaved_time = pauses.spent;
    stats.total_time = pauses.own(start, Duration::ZERO);
    Ok(Prefilled {
        logits,
        next_position: prompt.len() as i32,
        stats,
    })
}

/// Leading tokens of each chunk that `Policy::Query` recomputes whatever the question attends
/// to.
const QUERY_BOUNDARY: usize = 4;

/// `Policy::Query` ranks stored tokens by the attention of the suffix's last
/// `QUERY_RANK_TOKENS` tokens (the end of the question and the generation prompt, from which
/// the answer's first token is predicted) in the first `QUERY_RANK_LAYERS` layers, so its
/// first pass over the suffix stops there. On 24 held-out questions this kept tf KL within
/// noise of ranking with every suffix token in every layer (0.0198 against 0.0183) and cut the
/// policy's TTFT by about 40 % (`docs/bench/2026-11-27-fusion-query.md`).
const QUERY_RANK_LAYERS: usize = 12;
/// See [`QUERY_RANK_LAYERS`].
const QUERY_RANK_TOKENS: usize = 8;

/// Attention mass of each chunk token (`chunk_slots[i]`) from the suffix's queries
/// (`queries[l]`: layer `l`'s, for the suffix tokens kept): per layer, query head and suffix
/// token, the softmax of its scores over the `placed` slots (the prefix and the chunks),
/// summed. Layers run in parallel on the model's pool.
fn attention_mass(
    model: &Model,
    kv: &KvCache,
    queries: &[Vec<f32>],
    placed: usize,
    chunk_slots: &[usize],
) -> Vec<f32> {
    let (layers, kv_heads, hd) = kv.shape();
    let heads = model.config().n_head;
    let group = heads / kv_heads.max(1);
    let scale = 1.0 / (hd as f32).sqrt();
    let per_layer = model.pool().map(layers.min(queries.len()), |l| {
        let mut mass = vec![0.0f32; placed];
        for h in 0..kv_heads {
            // This KV head's query heads, for every suffix token: [nq][hd].
            let q: Vec<f32> = queries[l]
                .chunks_exact(heads * hd)
                .flat_map(|t| &t[h * group * hd..(h + 1) * group * hd])
                .copied()
                .collect();
            let nq = q.len() / hd;
            let mut scores = vec![0.0f32; nq * placed];
            kv.key_dots(l, h, placed, &q, &mut scores);
            for row in scores.chunks_exact_mut(placed) {
                // Eight running maxima and sums rather than one, so the loops vectorize.
                let mut max = [f32::NEG_INFINITY; 8];
                for c in row.chunks(8) {
                    for (m, &x) in max.iter_mut().zip(c) {
                        *m = if x > *m { x } else { *m };
                    }
                }
                let max = max.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                for x in row.iter_mut() {
                    *x = exp_approx((*x - max) * scale);
                }
                let mut sum = [0.0f32; 8];
                for c in row.chunks(8) {
                    for (s, &x) in sum.iter_mut().zip(c) {
                        *s += x;
                    }
                }
                let inv = 1.0 / sum.iter().sum::<f32>();
                for (m, &x) in mass.iter_mut().zip(row.iter()) {
                    *m += x * inv;
                }
            }
        }
        mass
    });
    let mut total = vec![0.0f32; placed];
    for m in per_layer {
        for (t, x) in total.iter_mut().zip(m) {
            *t += x;
        }
    }
    chunk_slots.iter().map(|&s| total[s]).collect()
}

/// `e^x` for `x <= 0` within 0.2 % (about 0 below -87): the weights only rank stored tokens,
/// so this is plenty, and the loop has no libm call (about 30 million exponentials for a
/// 4,000-token prompt). `2^(x log2 e)`: the integer part goes into the exponent bits, the
/// fraction through 2^f's degree-4 Taylor polynomial.
#[inline]
fn exp_approx(x: f32) -> f32 {
    let t = (x * std::f32::consts::LOG2_E).max(-126.0);
    // floor(t) without libm's `floorf` (not inlined on baseline x86-64): truncation, one less
    // for a negative non-integer.
    let tr = t as i32;
    let i = tr - i32::from((tr as f32) > t);
    let f = t - i as f32;
    // 2^f on [0, 1): a degree-4 fit.
    let p = 1.0
        + f * (std::f32::consts::LN_2 + f * (0.240_226_5 + f * (0.055_504_1 + f * 0.009_618_1)));
    f32::from_bits(((i + 127) as u32) << 23) * p
}

/// Indices of the `k` largest values.
fn top_rows(dev: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..dev.len()).collect();
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    idx.select_nth_unstable_by(k - 1, |&a, &b| dev[b].total_cmp(&dev[a]));
    idx.truncate(k);
    idx
}

/// Runs `tokens` at positions `start..`, returning the last position's logits.
fn prefill_run(
    model: &Model,
    kv: &mut KvCache,
    tokens: &[u32],
    start: usize,
    pauses: &mut Pauses<'_>,
) -> Result<Vec<f32>> {
    let positions: Vec<i32> = (start..start + tokens.len()).map(|p| p as i32).collect();
    pauses.prefill(model, tokens, &positions, kv, Logits::Last)
}

/// Fills `kv` (empty) with the prefix's exact KV, from `prefixes` as far as it has it; caches
/// the whole prefix afterwards. Returns how many tokens came from the cache.
fn prefill_prefix(
    model: &Model,
    prefixes: Option<&PrefixCache>,
    prefix: &[u32],
    kv: &mut KvCache,
    pauses: &mut Pauses<'_>,
) -> Result<usize> {
    if prefix.is_empty() {
        return Ok(0);
    }
    let hit = prefixes.and_then(|p| p.lookup(prefix));
    let cached = hit.as_ref().map_or(0, |h| h.len);
    if let Some(h) = &hit {
        kv.append_from(&h.entry.kv, 0..h.len)?;
    }
    if cached < prefix.len() {
        prefill_run(model, kv, &prefix[cached..], cached, pauses)?;
        if let Some(p) = prefixes {
            let mut own = model.new_cache(prefix.len());
            own.append_from(kv, 0..prefix.len())?;
            p.insert(prefix, own);
        }
    }
    Ok(cached)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_approx_is_within_a_fifth_of_a_percent() {
        for i in 0..=20_000 {
            let x = -(i as f32) * 0.004;
            let (got, want) = (exp_approx(x), x.exp());
            assert!((got - want).abs() <= 2e-3 * want, "e^{x}: {got} vs {want}");
        }
        assert!(exp_approx(-200.0) < 1e-37);
    }
}
