//! `engram gen-model`: writes a random-weight Llama-family GGUF of a standard shape (dense Llama,
//! or the mixture-of-experts shapes of Qwen3-MoE and Mixtral), so that benchmarks run on
//! machines that can neither download a model nor receive a large file, and llama.cpp can be
//! compared on the very same bytes.
//!
//! The weights are random quant blocks with fixed scale fields, chosen so that every dequantised
//! matrix has a standard deviation near [`WEIGHT_STD`] and the forward pass stays finite; the
//! numbers mean nothing, but the shapes, types and bytes moved are those of the real model. A
//! 7B file streams to disk tensor by tensor (one tensor in memory at a time), filled by every
//! core, and the same `--seed` gives the same bytes whatever the thread count.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use engram_gguf::{GgmlType, GgufWriter, TensorDecl, Value, ValueType};
use engram_kernels::f16;

use crate::quantize::pack_k4_scales;

#[derive(Args)]
pub struct GenModelArgs {
    /// Where to write the GGUF file.
    #[arg(long)]
    out: PathBuf,
    /// The model's shape.
    #[arg(long, value_enum, default_value_t = Shape::Tiny)]
    shape: Shape,
    /// Storage type of every weight matrix (token embedding and output head included).
    #[arg(long = "type", value_name = "TYPE", value_enum, default_value_t = WeightType::Q4_0)]
    ty: WeightType,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Override the shape's layer count.
    #[arg(long)]
    layers: Option<usize>,
    /// The `context_length` written into the metadata.
    #[arg(long, default_value_t = 4096)]
    context: usize,
    /// Threads filling the tensors [default: all cores].
    #[arg(long)]
    threads: Option<usize>,
}

/// The shapes `gen-model` knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Shape {
    /// 2 layers, 256 wide: for tests.
    Tiny,
    /// SmolLM2-135M's shape (the default model's).
    Smollm,
    /// A Llama-3.2-1B-like shape with a 32000-token vocabulary.
    #[value(name = "1b")]
    Llama1b,
    /// Llama-2-7B's shape.
    #[value(name = "7b")]
    Llama7b,
    /// Qwen3-MoE (`qwen3moe`), 2 layers, 256 wide, 4 of 16 experts of width 128: for tests.
    TinyQwen3moe,
    /// Mixtral's graph (`llama` with experts), 2 layers, 256 wide, 2 of 8 experts: for tests.
    TinyMixtral,
    /// Qwen3-30B-A3B's shape: 48 layers, 8 of 128 experts of width 768 (`--layers` scales it).
    #[value(name = "qwen3-30b-a3b")]
    Qwen3_30bA3b,
    /// Mixtral-8x7B's shape: 32 layers, 2 of 8 experts of width 14336.
    #[value(name = "mixtral-8x7b")]
    Mixtral8x7b,
}

/// The hyper-parameters of one shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Dims {
    pub(crate) n_layer: usize,
    pub(crate) n_embd: usize,
    pub(crate) n_ff: usize,
    pub(crate) n_head: usize,
    pub(crate) n_head_kv: usize,
    pub(crate) vocab: usize,
    /// Routed experts instead of one dense network per block.
    pub(crate) moe: Option<MoeDims>,
    /// Standard deviation of the token embedding's values.
    pub(crate) embedding_std: f32,
}

/// The routed experts of a mixture-of-experts shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MoeDims {
    /// `qwen3moe` (Qwen3's attention: Q/K norms, 128-wide heads) or `llama` (Mixtral).
    pub(crate) arch: &'static str,
    pub(crate) n_expert: usize,
    pub(crate) n_expert_used: usize,
    pub(crate) n_ff_expert: usize,
    pub(crate) head_dim: usize,
}

impl Dims {
    /// A dense Llama shape.
    pub(crate) fn dense(
        n_layer: usize,
        n_embd: usize,
        n_ff: usize,
        (n_head, n_head_kv): (usize, usize),
        vocab: usize,
    ) -> Dims {
        Dims {
            n_layer,
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            vocab,
            moe: None,
            embedding_std: WEIGHT_STD,
        }
    }

    fn arch(&self) -> &'static str {
        self.moe.map_or("llama", |m| m.arch)
    }

    fn head_dim(&self) -> usize {
        self.moe.map_or(self.n_embd / self.n_head, |m| m.head_dim)
    }
}

impl Shape {
    fn dims(self) -> Dims {
        let moe = |arch, (n_expert, n_expert_used, n_ff_expert), head_dim| {
            Some(MoeDims {
                arch,
                n_expert,
                n_expert_used,
                n_ff_expert,
                head_dim,
            })
        };
        match self {
            Shape::Tiny => Dims::dense(2, 256, 512, (4, 2), 512),
            Shape::Smollm => Dims::dense(30, 576, 1536, (9, 3), 49152),
            Shape::Llama1b => Dims::dense(16, 2048, 8192, (32, 8), 32000),
            Shape::Llama7b => Dims::dense(32, 4096, 11008, (32, 32), 32000),
            Shape::TinyQwen3moe => Dims {
                moe: moe("qwen3moe", (16, 4, 128), 64),
                ..Dims::dense(2, 256, 512, (4, 2), 512)
            },
            Shape::TinyMixtral => Dims {
                moe: moe("llama", (8, 2, 512), 64),
                ..Dims::dense(2, 256, 512, (4, 2), 512)
            },
            Shape::Qwen3_30bA3b => Dims {
                moe: moe("qwen3moe", (128, 8, 768), 128),
                embedding_std: MOE_EMBEDDING_STD,
                ..Dims::dense(48, 2048, 6144, (32, 4), 151936)
            },
            Shape::Mixtral8x7b => Dims {
                moe: moe("llama", (8, 2, 14336), 128),
                embedding_std: MOE_EMBEDDING_STD,
                ..Dims::dense(32, 4096, 14336, (32, 8), 32000)
            },
        }
    }

    fn name(self) -> &'static str {
        match self {
            Shape::Tiny => "tiny",
            Shape::Smollm => "smollm",
            Shape::Llama1b => "1b",
            Shape::Llama7b => "7b",
            Shape::TinyQwen3moe => "tiny-qwen3moe",
            Shape::TinyMixtral => "tiny-mixtral",
            Shape::Qwen3_30bA3b => "qwen3-30b-a3b",
            Shape::Mixtral8x7b => "mixtral-8x7b",
        }
    }
}

/// The storage types `gen-model` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum WeightType {
    #[value(name = "q4_0")]
    Q4_0,
    #[value(name = "q4_1")]
    Q4_1,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_k")]
    Q4K,
    #[value(name = "q6_k")]
    Q6K,
    #[value(name = "f16")]
    F16,
    #[value(name = "f32")]
    F32,
}

impl WeightType {
    fn ggml(self) -> GgmlType {
        match self {
            WeightType::Q4_0 => GgmlType::Q4_0,
            WeightType::Q4_1 => GgmlType::Q4_1,
            WeightType::Q8_0 => GgmlType::Q8_0,
            WeightType::Q4K => GgmlType::Q4K,
            WeightType::Q6K => GgmlType::Q6K,
            WeightType::F16 => GgmlType::F16,
            WeightType::F32 => GgmlType::F32,
        }
    }
}

/// Standard deviation of every dequantised weight: Llama's initialiser range, which keeps the
/// projections of a unit-scale activation at unit scale for widths of 2048 to 11008 (a row of
/// 4096 weights gives 0.02 * sqrt(4096) = 1.3), so 32 random layers stay far from overflow.
const WEIGHT_STD: f32 = 0.02;

/// Bytes each seeded piece of a tensor spans (rounded down to whole blocks). Pieces, not
/// threads, carry the seeds, so the bytes do not depend on the thread count; 1 MiB pieces give
/// a 7B model's matrices dozens each to spread over the cores.
const PIECE_BYTES: usize = 1 << 20;

/// One tensor to generate: name, ggml dims (innermost first), type.
pub(crate) type Plan = Vec<(String, Vec<u64>, GgmlType)>;

/// Writes the model described by `a`.
pub fn gen_model(a: GenModelArgs) -> Result<()> {
    let mut dims = a.shape.dims();
    if let Some(n) = a.layers {
        if n == 0 {
            bail!("--layers must be at least 1");
        }
        dims.n_layer = n;
    }
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let started = Instant::now();
    let (plan, fallback) = tensor_plan(&dims, a.ty.ggml());
    if let Some(note) = fallback {
        eprintln!("{note}");
    }
    let name = format!("engram-random-{}-{}", a.shape.name(), a.ty.ggml().name());
    let writer = metadata(&name, &dims, a.context);
    let size = write(&writer, &plan, &a.out, a.seed, threads, dims.embedding_std)?;
    println!(
        "wrote {} ({name}: {} layers, {} tensors, {:.1} MiB) in {:.1} s",
        a.out.display(),
        dims.n_layer,
        plan.len(),
        size as f64 / 1048576.0,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The tensors of a Llama-family model in llama.cpp's order, every matrix of type `ty`, or of
/// Q8_0 where `ty` is a K-quant and a row is not a whole number of its 256-element
/// super-blocks; the second value then says which tensors fell back. A mixture-of-experts
/// block has an f32 router (`ffn_gate_inp`, which llama.cpp's quantiser leaves f32 too) and
/// each projection's experts stacked in one 3-D tensor; a `qwen3moe` block has Q/K norms.
pub(crate) fn tensor_plan(d: &Dims, ty: GgmlType) -> (Plan, Option<String>) {
    let head_dim = d.head_dim();
    let (e, q, kv, ff) = (
        d.n_embd as u64,
        (d.n_head * head_dim) as u64,
        (d.n_head_kv * head_dim) as u64,
        d.n_ff as u64,
    );
    let mut fell_back: Vec<String> = Vec::new();
    let mut matrix_type = |name: &str, cols: u64| {
        if cols.is_multiple_of(ty.block_size() as u64) {
            ty
        } else {
            fell_back.push(format!("{name} (rows of {cols})"));
            GgmlType::Q8_0
        }
    };
    let mut plan: Plan = Vec::new();
    let mut matrix = |plan: &mut Plan, name: String, rows: u64, cols: u64| {
        let t = matrix_type(&name, cols);
        plan.push((name, vec![cols, rows], t));
    };
    matrix(&mut plan, "token_embd.weight".into(), d.vocab as u64, e);
    for i in 0..d.n_layer {
        let n = |s: &str| format!("blk.{i}.{s}");
        plan.push((n("attn_norm.weight"), vec![e], GgmlType::F32));
        matrix(&mut plan, n("attn_q.weight"), q, e);
        matrix(&mut plan, n("attn_k.weight"), kv, e);
        matrix(&mut plan, n("attn_v.weight"), kv, e);
        matrix(&mut plan, n("attn_output.weight"), e, q);
        if d.arch() == "qwen3moe" {
            plan.push((
                n("attn_q_norm.weight"),
                vec![head_dim as u64],
                GgmlType::F32,
            ));
            plan.push((
                n("attn_k_norm.weight"),
                vec![head_dim as u64],
                GgmlType::F32,
            ));
        }
        plan.push((n("ffn_norm.weight"), vec![e], GgmlType::F32));
        match d.moe {
            None => {
                matrix(&mut plan, n("ffn_gate.weight"), ff, e);
                matrix(&mut plan, n("ffn_up.weight"), ff, e);
                matrix(&mut plan, n("ffn_down.weight"), e, ff);
            }
            Some(m) => {
                let (ne, fe) = (m.n_expert as u64, m.n_ff_expert as u64);
                plan.push((n("ffn_gate_inp.weight"), vec![e, ne], GgmlType::F32));
                for (name, rows, cols) in [
                    ("ffn_gate_exps.weight", fe, e),
                    ("ffn_up_exps.weight", fe, e),
                    ("ffn_down_exps.weight", e, fe),
                ] {
                    matrix(&mut plan, n(name), rows, cols);
                    plan.last_mut().expect("just pushed").1.push(ne);
                }
            }
        }
    }
    plan.push(("output_norm.weight".into(), vec![e], GgmlType::F32));
    matrix(&mut plan, "output.weight".into(), d.vocab as u64, e);
    let note = (!fell_back.is_empty()).then(|| {
        let mut shown = fell_back[..fell_back.len().min(3)].join(", ");
        if fell_back.len() > 3 {
            shown.push_str(", ...");
        }
        format!(
            "note: {} stores rows in whole blocks of {} elements; {} of the matrices are written as q8_0 instead: {shown}",
            ty.name(),
            ty.block_size(),
            fell_back.len()
        )
    });
    (plan, note)
}

/// The file's metadata: what `ModelConfig::from_metadata` reads, and a minimal SentencePiece
/// vocabulary (`<unk>`, `<s>`, `</s>`, then `t3`, `t4`, ...) so that `engram info`, `generate`
/// and the server, which all build the tokenizer, accept the file. The mixture-of-experts
/// shapes also turn SentencePiece's leading space off, so that a prompt such as `t5t17t300`
/// is the tokens 5, 17, 300 after `<s>` for Engram and llama.cpp alike (the vocabulary has no
/// `▁` piece, and llama.cpp's byte fallback has no byte pieces to fall back on).
pub(crate) fn metadata(name: &str, d: &Dims, context: usize) -> GgufWriter {
    let u32v = |v: usize| Value::U32(v as u32);
    let p = d.arch();
    let k = |key: &str| format!("{p}.{key}");
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", Value::String(p.into()))
        .metadata("general.name", Value::String(name.into()))
        .metadata(k("block_count"), u32v(d.n_layer))
        .metadata(k("context_length"), u32v(context))
        .metadata(k("embedding_length"), u32v(d.n_embd))
        .metadata(k("feed_forward_length"), u32v(d.n_ff))
        .metadata(k("attention.head_count"), u32v(d.n_head))
        .metadata(k("attention.head_count_kv"), u32v(d.n_head_kv))
        .metadata(k("attention.layer_norm_rms_epsilon"), Value::F32(1e-5))
        .metadata(k("rope.freq_base"), Value::F32(10_000.0))
        .metadata(k("rope.dimension_count"), u32v(d.head_dim()))
        .metadata(k("vocab_size"), u32v(d.vocab));
    if let Some(m) = d.moe {
        w.metadata(k("expert_count"), u32v(m.n_expert))
            .metadata(k("expert_used_count"), u32v(m.n_expert_used))
            .metadata(k("expert_feed_forward_length"), u32v(m.n_ff_expert))
            .metadata(k("attention.key_length"), u32v(m.head_dim))
            .metadata(k("attention.value_length"), u32v(m.head_dim))
            .metadata("tokenizer.ggml.add_space_prefix", Value::Bool(false));
    }
    let tokens = (0..d.vocab).map(|i| match i {
        0 => "<unk>".to_owned(),
        1 => "<s>".to_owned(),
        2 => "</s>".to_owned(),
        _ => format!("t{i}"),
    });
    // SentencePiece token types: 1 normal, 2 unknown, 3 control.
    let kinds = (0..d.vocab).map(|i| Value::I32([2, 3, 3].get(i).copied().unwrap_or(1)));
    let scores = (0..d.vocab).map(|i| Value::F32(-(i as f32)));
    w.metadata("tokenizer.ggml.model", Value::String("llama".into()))
        .metadata(
            "tokenizer.ggml.tokens",
            Value::Array(ValueType::String, tokens.map(Value::String).collect()),
        )
        .metadata(
            "tokenizer.ggml.scores",
            Value::Array(ValueType::F32, scores.collect()),
        )
        .metadata(
            "tokenizer.ggml.token_type",
            Value::Array(ValueType::I32, kinds.collect()),
        )
        .metadata("tokenizer.ggml.unknown_token_id", Value::U32(0))
        .metadata("tokenizer.ggml.bos_token_id", Value::U32(1))
        .metadata("tokenizer.ggml.eos_token_id", Value::U32(2));
    w
}

/// Standard deviation of the token embedding of the full-size mixture-of-experts shapes (the
/// tiny ones, for golden tests, keep `WEIGHT_STD`, so that every layer moves their logits): each token's own
/// part of the residual stream large next to what attention adds in common to every token (the
/// context's average value), so that a prompt's tokens spread over the experts as a trained
/// router spreads them. Measured on qwen3-30b-a3b with `--layers 12`, Q4_K, a 512-token
/// prefill: with `WEIGHT_STD` (0.02) layer 1 uses 124 of 128 experts but layers 6 to 12 only
/// 28 to 37, one expert taking nearly every token; with 1.0, 128 in layers 1 to 4 and 69 to 82
/// in 8 to 12; with 4.0, all 128 in every layer, the largest group 47 to 74 tokens (the mean is
/// 32). Q4_0 files route worse: their random quants `q - 8` have mean -0.5 d, so every matrix
/// adds a common vector (with 1.0, every token took the same 8 to 19 of 128 experts), hence
/// the benchmarks of mixtures use Q4_K.
const MOE_EMBEDDING_STD: f32 = 4.0;

/// Streams the header and then each tensor of `plan`, generated in memory one at a time, to
/// `out`, the token embedding's values of standard deviation `embedding_std`. Returns the file
/// size.
pub(crate) fn write(
    writer: &GgufWriter,
    plan: &Plan,
    out: &std::path::Path,
    seed: u64,
    threads: usize,
    embedding_std: f32,
) -> Result<u64> {
    let decls = plan
        .iter()
        .map(|(name, dims, ty)| TensorDecl::new(name.clone(), dims, *ty))
        .collect::<Vec<_>>();
    // `stream` refuses a declaration it cannot size, so past it every size is known.
    let sizes: Vec<u64> = decls.iter().map(|d| d.byte_size().unwrap_or(0)).collect();
    let mut stream = writer
        .stream(out, decls)
        .with_context(|| format!("creating {}", out.display()))?;
    for (index, ((name, dims, ty), size)) in plan.iter().zip(sizes).enumerate() {
        let mut data = vec![0u8; size as usize];
        if dims.len() == 1 {
            // Norm weights: 1.0, as a freshly initialised model has them.
            data.chunks_exact_mut(4)
                .for_each(|c| c.copy_from_slice(&1f32.to_le_bytes()));
        } else {
            let std = if name == "token_embd.weight" {
                embedding_std
            } else {
                WEIGHT_STD
            };
            fill_with_std(*ty, &mut data, mix(seed, index as u64), threads, std);
        }
        if name.ends_with("ffn_gate_inp.weight") {
            // Router logits of a unit-scale input spread by about 2 whatever the width (a
            // trained router's are a few units), so that the experts chosen are clear-cut.
            let scale = 2.0 / (dims[0] as f32).sqrt() / WEIGHT_STD;
            for c in data.chunks_exact_mut(4) {
                let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * scale;
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        stream
            .write_tensor(&data)
            .with_context(|| format!("writing {name}"))?;
    }
    Ok(stream.finish()?)
}

/// Fills `data` (whole blocks of `ty`) with random blocks, piece by piece, the pieces spread
/// over `threads` threads; piece `i` draws from its own generator seeded by `seed` and `i`.
#[cfg(test)]
fn fill(ty: GgmlType, data: &mut [u8], seed: u64, threads: usize) {
    fill_with_std(ty, data, seed, threads, WEIGHT_STD);
}

/// [`fill`] with values of standard deviation `std` instead of [`WEIGHT_STD`].
fn fill_with_std(ty: GgmlType, data: &mut [u8], seed: u64, threads: usize, std: f32) {
    let block = ty.type_size();
    let piece = (PIECE_BYTES / block).max(1) * block;
    let scales = Scales::new(ty, std);
    let mut pieces: Vec<(usize, &mut [u8])> = data.chunks_mut(piece).enumerate().collect();
    let per_thread = pieces.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for group in pieces.chunks_mut(per_thread) {
            let scales = &scales;
            s.spawn(move || {
                for (i, bytes) in group.iter_mut() {
                    let mut rng = SplitMix64(mix(seed, *i as u64));
                    fill_piece(ty, scales, bytes, &mut rng);
                }
            });
        }
    });
}

/// The fixed scale fields (f16 bits) of a type's blocks, each the wanted standard deviation
/// (`WEIGHT_STD` but for the mixtures' embeddings) over that of the block's random quants:
///
/// - Q4_0: quants `q - 8`, `q` uniform on 0..16: RMS sqrt(21.5) = 4.64.
/// - Q4_1: `q * d + m` with `m = -7.5 d`, zero mean: std sqrt(21.25) = 4.61.
/// - Q8_0: uniform i8: std sqrt((256^2 - 1) / 12) = 73.9.
/// - Q4_K: sub-block scale `sc` uniform on 16..48 and min `mn = sc`, with `dmin = 7.5 d` so
///   each sub-block has zero mean: std sqrt(E[sc^2] 21.25) = sqrt(1077.5 * 21.25) = 151.3.
/// - Q6_K: quants `q - 32`, `q` uniform on 0..64 (variance 341.25), scales `+-(4..12)`
///   (E[sc^2] = 61.5): std 144.9. Small scales keep `d` a normal f16.
struct Scales {
    d: [u8; 2],
    /// Q4_1's `m`, Q4_K's `dmin`.
    second: [u8; 2],
    /// The wanted standard deviation over `WEIGHT_STD`, for the float types.
    float_factor: f32,
}

impl Scales {
    fn new(ty: GgmlType, std: f32) -> Scales {
        let f = |v: f32| f16::from_f32(v).to_le_bytes();
        let (d, second) = match ty {
            GgmlType::Q4_0 => (std / 21.5f32.sqrt(), 0.0),
            GgmlType::Q4_1 => {
                let d = std / 21.25f32.sqrt();
                (d, -7.5 * d)
            }
            GgmlType::Q8_0 => (std / 5461.25f32.sqrt(), 0.0),
            GgmlType::Q4K => {
                let d = std / (1077.5f32 * 21.25).sqrt();
                (d, 7.5 * d)
            }
            GgmlType::Q6K => (std / (61.5f32 * 341.25).sqrt(), 0.0),
            _ => (0.0, 0.0),
        };
        Scales {
            d: f(d),
            second: f(second),
            float_factor: std / WEIGHT_STD,
        }
    }
}

/// Fills one piece of whole blocks.
fn fill_piece(ty: GgmlType, s: &Scales, bytes: &mut [u8], rng: &mut SplitMix64) {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q8_0 => {
            for b in bytes.chunks_exact_mut(ty.type_size()) {
                b[..2].copy_from_slice(&s.d);
                rng.fill(&mut b[2..]);
            }
        }
        GgmlType::Q4_1 => {
            for b in bytes.chunks_exact_mut(ty.type_size()) {
                b[..2].copy_from_slice(&s.d);
                b[2..4].copy_from_slice(&s.second);
                rng.fill(&mut b[4..]);
            }
        }
        GgmlType::Q4K => {
            for b in bytes.chunks_exact_mut(ty.type_size()) {
                b[..2].copy_from_slice(&s.d);
                b[2..4].copy_from_slice(&s.second);
                let sc = rng.next().to_le_bytes().map(|x| 16 + (x & 31));
                b[4..16].copy_from_slice(&pack_k4_scales(&sc, &sc));
                rng.fill(&mut b[16..]);
            }
        }
        GgmlType::Q6K => {
            for b in bytes.chunks_exact_mut(ty.type_size()) {
                rng.fill(&mut b[..192]);
                let bits = rng.next().to_le_bytes().into_iter();
                for (out, x) in b[192..208]
                    .iter_mut()
                    .zip(bits.chain(rng.next().to_le_bytes()))
                {
                    let magnitude = 4 + (x & 7) as i8;
                    *out = (if x & 0x80 != 0 { -magnitude } else { magnitude }) as u8;
                }
                b[208..].copy_from_slice(&s.d);
            }
        }
        GgmlType::F16 => {
            for v in bytes.chunks_exact_mut(2) {
                let x = normalish(rng.next()) * s.float_factor;
                v.copy_from_slice(&f16::from_f32(x).to_le_bytes());
            }
        }
        GgmlType::F32 => {
            for v in bytes.chunks_exact_mut(4) {
                v.copy_from_slice(&(normalish(rng.next()) * s.float_factor).to_le_bytes());
            }
        }
        other => unreachable!("gen-model does not write {other}"),
    }
}

/// A value of mean 0 and standard deviation `WEIGHT_STD` from 64 random bits: the sum of four
/// 16-bit uniforms (Irwin-Hall, close to normal; variance 4/12).
fn normalish(bits: u64) -> f32 {
    let sum: u64 = (0..4).map(|i| (bits >> (16 * i)) & 0xFFFF).sum();
    (sum as f32 / 65536.0 - 2.0) * 3f32.sqrt() * WEIGHT_STD
}

/// SplitMix64 (Steele, Lea, Flood 2014): one add and three multiply-xorshifts per 64 bits,
/// plenty for weights whose only job is to look like weights, and for the seeded draws of
/// the evaluation sets (`eval fusion-set`).
pub(crate) struct SplitMix64(pub(crate) u64);

impl SplitMix64 {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        finalize(self.0)
    }

    /// Uniform in `0..n` (`n` > 0; the modulo bias is below 2^-40 for any `n` under 2^24).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Fisher-Yates.
    pub(crate) fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }

    fn fill(&mut self, out: &mut [u8]) {
        let mut chunks = out.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            let last = self.next().to_le_bytes();
            rest.copy_from_slice(&last[..rest.len()]);
        }
    }
}

/// SplitMix64's output function, a good 64-bit mixer.
fn finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A seed derived from `seed` and `index`, unrelated to its neighbours.
fn mix(seed: u64, index: u64) -> u64 {
    finalize(finalize(seed) ^ index.wrapping_mul(0xD6E8_FEB8_6659_FD93))
}

#[cfg(test)]
mod tests {
    use super::*;
    use engram_model::{Logits, Model};

    fn temp_path(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("engram-gen-model-{}-{name}", std::process::id()))
    }

    fn generate(path: &std::path::Path, shape: Shape, ty: WeightType, seed: u64, threads: usize) {
        gen_model(GenModelArgs {
            out: path.to_path_buf(),
            shape,
            ty,
            seed,
            layers: None,
            context: 256,
            threads: Some(threads),
        })
        .unwrap();
    }

    /// Every type's tiny model loads, builds its tokenizer and gives finite, varied logits.
    #[test]
    fn every_type_runs_finite() {
        for ty in WeightType::value_variants() {
            let path = temp_path(&format!("{ty:?}.gguf"));
            generate(&path, Shape::Tiny, *ty, 1, 3);
            let model = Model::load(&path, 2).unwrap();
            engram_tokenizer::Tokenizer::from_gguf(model.gguf().metadata()).unwrap();
            let expect = ty.ggml();
            let t = model.gguf().tensor("blk.1.ffn_down.weight").unwrap();
            assert_eq!(t.ty, expect);
            let mut kv = model.new_cache(8);
            let logits = model
                .forward(&[1, 17, 300, 5], &[0, 1, 2, 3], &mut kv, Logits::All)
                .unwrap();
            std::fs::remove_file(&path).unwrap();
            assert_eq!(logits.len(), 4 * 512);
            assert!(
                logits.iter().all(|v| v.is_finite()),
                "{ty:?}: non-finite logits"
            );
            let (lo, hi) = logits
                .iter()
                .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
            // Unit-scale hidden states times a 0.02-std head of width 256: logits of about 0.3.
            assert!(hi - lo > 0.1, "{ty:?}: logits span only {lo}..{hi}");
        }
    }

    /// The mixture-of-experts shapes load as such (the experts stacked, the router f32) and
    /// give finite, varied logits; prefill and decode route alike.
    #[test]
    fn moe_shapes_run_finite() {
        for (shape, arch, experts) in [
            (
                Shape::TinyQwen3moe,
                engram_model::Architecture::Qwen3Moe,
                16,
            ),
            (Shape::TinyMixtral, engram_model::Architecture::Llama, 8),
        ] {
            let path = temp_path(&format!("{shape:?}.gguf"));
            generate(&path, shape, WeightType::Q4K, 1, 2);
            let model = Model::load(&path, 2).unwrap();
            let cfg = model.config();
            assert_eq!(cfg.arch, arch);
            assert_eq!(cfg.moe.map(|m| m.n_expert), Some(experts));
            let router = model.gguf().tensor("blk.1.ffn_gate_inp.weight").unwrap();
            assert_eq!(router.ty, GgmlType::F32);
            let gate = model.gguf().tensor("blk.1.ffn_gate_exps.weight").unwrap();
            assert_eq!(
                gate.dims,
                vec![256, cfg.moe.unwrap().n_ff_expert as u64, experts as u64]
            );
            let tokens = [1, 17, 300, 5];
            let mut kv = model.new_cache(8);
            let all = model
                .forward(&tokens, &[0, 1, 2, 3], &mut kv, Logits::All)
                .unwrap();
            std::fs::remove_file(&path).unwrap();
            assert!(all.iter().all(|v| v.is_finite()), "{shape:?}");
            let (lo, hi) = all
                .iter()
                .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
            assert!(hi - lo > 0.1, "{shape:?}: logits span only {lo}..{hi}");
            // One token at a time: the decode path (one dispatch for every expert's gate and
            // up) gives the last position's logits to float noise.
            let mut kv = model.new_cache(8);
            let mut last = Vec::new();
            for (i, &t) in tokens.iter().enumerate() {
                last = model
                    .forward(&[t], &[i as i32], &mut kv, Logits::Last)
                    .unwrap();
            }
            let worst = last
                .iter()
                .zip(&all[3 * 512..])
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                worst < 1e-4,
                "{shape:?}: decode differs from prefill by {worst}"
            );
        }
    }

    /// The bytes depend on the seed, not on the thread count.
    #[test]
    fn seeded_bytes_do_not_depend_on_threads() {
        let read = |seed, threads| {
            let path = temp_path(&format!("seed-{seed}-{threads}.gguf"));
            generate(&path, Shape::Tiny, WeightType::Q4K, seed, threads);
            let bytes = std::fs::read(&path).unwrap();
            std::fs::remove_file(&path).unwrap();
            bytes
        };
        let one = read(5, 1);
        assert_eq!(one, read(5, 4));
        assert_ne!(one, read(6, 1));
    }

    /// Dequantised random blocks have the intended spread and no offset.
    #[test]
    fn quant_blocks_have_the_intended_scale() {
        for ty in WeightType::value_variants() {
            let ty = ty.ggml();
            let n = 256 * 64;
            let mut data = vec![0u8; ty.row_bytes(n).unwrap()];
            fill(ty, &mut data, 9, 2);
            let mut y = vec![0f32; n];
            engram_kernels::dequantize_row(ty, &data, &mut y).unwrap();
            let mean = y.iter().sum::<f32>() / n as f32;
            let std = (y.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / n as f32).sqrt();
            assert!(
                (std - WEIGHT_STD).abs() < 0.1 * WEIGHT_STD,
                "{ty}: std {std}"
            );
            // Q4_0's quants are centred on -0.5 (of 4.64 RMS); every other type on 0.
            assert!(mean.abs() < 0.15 * WEIGHT_STD, "{ty}: mean {mean}");
        }
    }

    #[test]
    fn k_quant_fallback_is_reported() {
        let (plan, note) = tensor_plan(&Shape::Smollm.dims(), GgmlType::Q4K);
        let ty = |name: &str| plan.iter().find(|t| t.0 == name).unwrap().2;
        assert_eq!(ty("blk.0.attn_q.weight"), GgmlType::Q8_0);
        assert_eq!(ty("blk.0.ffn_down.weight"), GgmlType::Q4K);
        assert!(note.unwrap().contains("q8_0"));
        assert!(tensor_plan(&Shape::Llama7b.dims(), GgmlType::Q6K)
            .1
            .is_none());
    }
}
