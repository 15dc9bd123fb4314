//! `engram gpu`: find the GPUs, check the GPU forward pass against the CPU one, measure it.
//!
//! Built with `--features cuda`; without it every subcommand says so. Models for the checks
//! come from `engram gen-model` where the real ones cannot be copied (the GPU machine has no
//! network): the CPU path is the reference, proven against llama.cpp by the golden tests.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Subcommand};

#[derive(Args)]
pub struct GpuArgs {
    #[command(subcommand)]
    cmd: GpuCmd,
}

#[derive(Subcommand)]
enum GpuCmd {
    /// List the GPUs, or say why none can be used.
    Info,
    /// Compare the GPU forward pass (whole, and split with the CPU) with the CPU path.
    Check(CheckArgs),
    /// Measure prefill and decode on the GPU, and the device's copy bandwidth.
    Bench(BenchArgs),
    /// Fused prefill on the GPU: a RAG prompt from chunks whose KV waits in host memory,
    /// against full prefill of the same tokens (time to first token, agreement).
    Fusion(FusionArgs),
}

#[derive(Args)]
struct FusionArgs {
    /// GGUF model file.
    #[arg(long)]
    model: PathBuf,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Passages (chunks) in the prompt.
    #[arg(long, default_value_t = 10)]
    passages: usize,
    /// Tokens per passage.
    #[arg(long, default_value_t = 600)]
    passage_tokens: usize,
    /// Tokens before the passages (system prompt) and after them (the question).
    #[arg(long, default_value_t = 16)]
    prefix_tokens: usize,
    #[arg(long, default_value_t = 32)]
    question_tokens: usize,
    /// Leading tokens of each passage recomputed (the chunk-boundary policy), comma-separated
    /// variants; 0 uses the stored KV as it is.
    #[arg(long, value_delimiter = ',', default_values_t = [0, 4, 16])]
    recompute: Vec<usize>,
    /// Tokens per prefill call of the full prefill.
    #[arg(long, default_value_t = 512)]
    ubatch: usize,
    /// Runs of each figure; the median is reported.
    #[arg(long, default_value_t = 3)]
    repetitions: usize,
    /// Also print, for the first --recompute variant, each layer's copy and compute times of
    /// the overlapped run (copy lane against compute lane).
    #[arg(long)]
    timeline: bool,
}

/// How decode runs on the GPU (`engram gpu check` and `bench` compare the variants).
#[derive(Args)]
struct DecodePath {
    /// How the decode GEMVs are launched: `default`, another block shape (`r1w4`, `r4w4`,
    /// `r2w8`, `r8w2`: rows and warps per block; Q4_0 and Q4_K at 1 and 8 sequences), each
    /// optionally with `/pN`, a persistent grid of N blocks per multiprocessor.
    #[arg(long, default_value = "default")]
    gemv: String,
    /// Decode with the fused element-wise kernels (`GpuModel::set_fused`).
    #[arg(long)]
    fuse: bool,
    /// Decode launch by launch instead of replaying a captured CUDA graph
    /// (`GpuModel::set_graphs`).
    #[arg(long)]
    no_graphs: bool,
}

#[derive(Args)]
struct CheckArgs {
    /// GGUF model file.
    #[arg(long)]
    model: PathBuf,
    /// CPU threads for the reference [default: all cores]
    #[arg(long)]
    threads: Option<usize>,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Layers on the GPU, one check each: a number, `all`, `half`, or `auto` (the placement
    /// planner's choice for the device's free memory).
    #[arg(long, value_delimiter = ',', default_values_t = ["all".to_string(), "half".to_string()])]
    layers: Vec<String>,
    /// Prompt tokens (pseudo-random ids unless --text is given).
    #[arg(long, default_value_t = 64)]
    prompt: usize,
    /// A prompt text instead (tokenized with the model's tokenizer).
    #[arg(long)]
    text: Vec<String>,
    /// Greedy tokens decoded on each side after the prompt.
    #[arg(long, default_value_t = 16)]
    decode: usize,
    /// Seed of the pseudo-random prompt.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// llama.cpp's golden file (`../shared/golden/smollm2-135m-q4_1.llamacpp.json`): its prompts
    /// replace the pseudo-random one, and the GPU's greedy tokens and top-5 logits are also held
    /// to llama.cpp's with the golden tests' bars.
    #[arg(long)]
    golden: Option<PathBuf>,
    /// Also compare with the CPU path on the weights dequantised to f32 (the exact reference;
    /// needs four bytes of memory per weight).
    #[arg(long)]
    f32_reference: bool,
    #[command(flatten)]
    decode_path: DecodePath,
    /// Also decode this many sequences of different lengths together (one batched call per
    /// step) and hold each one's logits to the same sequence decoded alone.
    #[arg(long, default_value_t = 0)]
    batch: usize,
}

#[derive(Args)]
struct BenchArgs {
    /// GGUF model file.
    #[arg(long)]
    model: PathBuf,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Layers on the GPU: a number, `half`, `all`, or `auto` (the placement planner's choice
    /// for the device's free memory and the run's context and batch).
    #[arg(long, default_value = "auto")]
    layers: String,
    /// CPU threads for the CPU layers of a split placement [default: all cores]
    #[arg(long)]
    threads: Option<usize>,
    /// Prompt lengths to prefill (comma-separated), in calls of --ubatch tokens.
    #[arg(long, value_delimiter = ',', default_values_t = [512, 2048])]
    prefill: Vec<usize>,
    /// Tokens per prefill call (llama.cpp's default micro-batch is 512).
    #[arg(long, default_value_t = 512)]
    ubatch: usize,
    /// Decode steps timed per batch size.
    #[arg(long, default_value_t = 64)]
    decode: usize,
    /// Sequences decoded together (comma-separated batch sizes).
    #[arg(long, value_delimiter = ',', default_values_t = [1, 8])]
    batch: Vec<usize>,
    /// Context each sequence holds before decoding.
    #[arg(long, default_value_t = 512)]
    decode_context: usize,
    /// Runs of each prefill figure; the median is reported.
    #[arg(long, default_value_t = 3)]
    repetitions: usize,
    /// After each figure, one more pass timed per kind of work (matmul, attention, ...; the
    /// device is synchronised between kinds, so these passes run slower).
    #[arg(long)]
    profile: bool,
    #[command(flatten)]
    decode_path: DecodePath,
}

/// Runs `engram gpu`.
pub fn gpu(a: GpuArgs) -> Result<()> {
    imp::run(a)
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;

    pub fn run(_a: GpuArgs) -> Result<()> {
        anyhow::bail!("this engram was built without GPU support (cargo build --features cuda)")
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use std::sync::Arc;
    use std::time::Instant;

    use anyhow::{bail, Context};
    use engram_kernels_cuda::{probe, Device, GemvLaunch};
    use engram_model::placement::{Device as PlacementDevice, Placement, PlacementRequest};
    use engram_model::{argmax, GpuModel, Logits, Model};
    use serde_json::json;

    use super::*;

    /// The golden tests' top-5 logit tolerance against llama.cpp (`LOGIT_TOLERANCE` in
    /// tests/engine_golden.rs), compared the same way.
    const GOLDEN_TOLERANCE: f64 = 0.6;

    pub fn run(a: GpuArgs) -> Result<()> {
        match a.cmd {
            GpuCmd::Info => info(),
            GpuCmd::Check(c) => check(c),
            GpuCmd::Bench(b) => bench(b),
            GpuCmd::Fusion(f) => fusion(f),
        }
    }

    fn info() -> Result<()> {
        match probe() {
            Ok(devices) => {
                for d in devices {
                    println!("{}", d.describe());
                }
            }
            Err(e) => println!("{e}; the CPU path serves"),
        }
        Ok(())
    }

    fn cores(threads: Option<usize>) -> usize {
        threads.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        })
    }

    fn kernel_cache() -> Option<PathBuf> {
        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/engram/cuda"))
    }

    fn open(device: usize) -> Result<Device> {
        let started = Instant::now();
        let dev = Device::open(device, kernel_cache().as_deref())?;
        eprintln!(
            "{}: kernels ready in {:.2} s (open {:.2} s; {})",
            dev.info().describe(),
            dev.compile_seconds(),
            started.elapsed().as_secs_f64(),
            dev.compiler()
        );
        Ok(dev)
    }

    /// Layers for the GPU: `all`, `half`, a number, or `auto`: the placement planner's choice
    /// for this device's free memory, holding `context` tokens in each of `sequences` caches
    /// and prefill calls of `ubatch` tokens.
    fn layer_count(
        spec: &str,
        model: &Model,
        dev: &Device,
        context: usize,
        sequences: usize,
        ubatch: usize,
    ) -> Result<usize> {
        let n_layer = model.config().n_layer;
        Ok(match spec {
            "all" => n_layer,
            "half" => n_layer / 2,
            "auto" => {
                let mut req = PlacementRequest::for_model(model, context, sequences);
                req.scratch_bytes = GpuModel::scratch_estimate(model, ubatch, context);
                let (free, _) = dev.memory()?;
                let plan = Placement::plan(
                    &req,
                    &[PlacementDevice::new(
                        format!("cuda:{}", dev.info().ordinal),
                        free,
                    )],
                );
                eprintln!("placement: {}", plan.describe());
                plan.n_gpu_layers()
            }
            n => n.parse().with_context(|| format!("--layers {n}"))?,
        })
    }

    /// `engram bench`'s pseudo-random prompt ids.
    fn pseudo_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
        crate::bench::tokens(n, vocab, seed)
    }

    fn positions(from: usize, n: usize) -> Vec<i32> {
        (from..from + n).map(|p| p as i32).collect()
    }

    /// Indices of the `k` largest values.
    fn top(v: &[f32], k: usize) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..v.len()).collect();
        idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]));
        idx.truncate(k);
        idx
    }

    /// The model with every tensor dequantised to f32: the exact reference (the CPU's
    /// quantised path rounds activations to 8 bits per block, which random-weight K-quant
    /// models amplify layer after layer).
    fn dequantized(model: &Model, threads: usize) -> Result<Model> {
        let f = model.gguf();
        let mut w = engram_gguf::GgufWriter::new();
        for (k, v) in f.metadata().iter() {
            w.metadata(k, v.clone());
        }
        for t in f.tensors() {
            let cols = t.dims[0] as usize;
            let data = f.tensor_data(t);
            let row_bytes = t.ty.row_bytes(cols).context("row size")?;
            let mut vals = vec![0f32; t.n_elements() as usize];
            for (r, row) in vals.chunks_mut(cols).enumerate() {
                engram_kernels::dequantize_row(
                    t.ty,
                    &data[r * row_bytes..(r + 1) * row_bytes],
                    row,
                )?;
            }
            w.tensor_f32(t.name.clone(), &t.dims, &vals);
        }
        let file = engram_gguf::GgufFile::from_bytes(w.to_bytes())?;
        Ok(Model::from_gguf(Arc::new(file), threads)?)
    }

    /// Prefill logits of every prompt token and the greedy continuation, each side feeding
    /// its own choices.
    struct Run {
        logits: Vec<f32>,
        greedy: Vec<u32>,
        /// Logits of each decode step.
        steps: Vec<Vec<f32>>,
    }

    /// Prefills `ids` (logits of every position), then decodes `decode` greedy tokens, each
    /// fed back: `prefill` and `step` (token, position) are the side's forward calls.
    fn greedy_run(
        ids: &[u32],
        vocab: usize,
        decode: usize,
        prefill: impl FnOnce(&[u32], &[i32]) -> Result<Vec<f32>>,
        mut step: impl FnMut(u32, i32) -> Result<Vec<f32>>,
    ) -> Result<Run> {
        let logits = prefill(ids, &positions(0, ids.len()))?;
        let mut greedy = vec![argmax(&logits[logits.len() - vocab..])];
        let mut steps = Vec::new();
        for i in 0..decode {
            let l = step(*greedy.last().expect("one token"), (ids.len() + i) as i32)?;
            greedy.push(argmax(&l));
            steps.push(l);
        }
        Ok(Run {
            logits,
            greedy,
            steps,
        })
    }

    fn cpu_run(model: &Model, ids: &[u32], decode: usize) -> Result<Run> {
        let kv = std::cell::RefCell::new(model.new_cache(ids.len() + decode + 1));
        greedy_run(
            ids,
            model.config().vocab_size,
            decode,
            |t, p| Ok(model.prefill(t, p, &mut kv.borrow_mut(), Logits::All)?),
            |t, p| Ok(model.forward(&[t], &[p], &mut kv.borrow_mut(), Logits::Last)?),
        )
    }

    fn gpu_run(gpu: &mut GpuModel, ids: &[u32], decode: usize) -> Result<Run> {
        let kv = std::cell::RefCell::new(gpu.new_cache(ids.len() + decode + 1)?);
        let vocab = gpu.model().config().vocab_size;
        let gpu = std::cell::RefCell::new(gpu);
        greedy_run(
            ids,
            vocab,
            decode,
            |t, p| {
                Ok(gpu
                    .borrow_mut()
                    .forward(t, p, &mut kv.borrow_mut(), Logits::All)?)
            },
            |t, p| {
                Ok(gpu
                    .borrow_mut()
                    .forward(&[t], &[p], &mut kv.borrow_mut(), Logits::Last)?)
            },
        )
    }

    fn compare(gpu: &Run, cpu: &Run, v: usize) -> serde_json::Value {
        let (mut max_abs, mut scale, mut agree) = (0f32, 0f32, 0usize);
        for (cr, gr) in cpu.logits.chunks(v).zip(gpu.logits.chunks(v)) {
            for (a, b) in cr.iter().zip(gr) {
                max_abs = max_abs.max((a - b).abs());
                scale = scale.max(a.abs());
            }
            agree += usize::from(argmax(cr) == argmax(gr));
        }
        let rows = cpu.logits.len() / v;
        let last_c = &cpu.logits[cpu.logits.len() - v..];
        let last_g = &gpu.logits[gpu.logits.len() - v..];
        let (tc, tg) = (top(last_c, 5), top(last_g, 5));
        let common = cpu
            .greedy
            .iter()
            .zip(&gpu.greedy)
            .take_while(|(a, b)| a == b)
            .count();
        // Decode logits compared while both sides were fed the same tokens.
        let decode_max_abs = cpu
            .steps
            .iter()
            .zip(&gpu.steps)
            .take(common.saturating_sub(1))
            .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs()))
            .fold(0f32, f32::max);
        json!({
            "prefill_max_abs": max_abs,
            "prefill_rel": max_abs / scale.max(f32::MIN_POSITIVE),
            "argmax_agreement": agree as f64 / rows as f64,
            "top5_overlap_last": tc.iter().filter(|i| tg.contains(i)).count(),
            "top5_max_abs_last": tc.iter().map(|&i| (last_c[i] - last_g[i]).abs()).fold(0f32, f32::max),
            "decode_max_abs": decode_max_abs,
            "greedy_tokens": cpu.greedy.len(),
            "greedy_common_prefix": common,
            "greedy_equal": cpu.greedy == gpu.greedy,
        })
    }

    fn check(c: CheckArgs) -> Result<()> {
        let threads = cores(c.threads);
        let model = Arc::new(Model::load(&c.model, threads)?);
        let cfg = model.config().clone();
        let golden: Vec<serde_json::Value> = match &c.golden {
            Some(p) => {
                let v: serde_json::Value = serde_json::from_slice(&std::fs::read(p)?)?;
                v["prompts"].as_array().context("golden prompts")?.clone()
            }
            None => Vec::new(),
        };
        let ids_of = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_u64())
                        .map(|x| x as u32)
                        .collect()
                })
                .unwrap_or_default()
        };
        let prompts: Vec<Vec<u32>> = if !golden.is_empty() {
            golden
                .iter()
                .map(|g| ids_of(&g["prompt_token_ids"]))
                .collect()
        } else if c.text.is_empty() {
            vec![pseudo_tokens(c.prompt, cfg.vocab_size, c.seed)]
        } else {
            let tok = engram_tokenizer::Tokenizer::from_gguf(model.gguf().metadata())?;
            c.text
                .iter()
                .map(|t| tok.encode_prompt(t))
                .collect::<std::result::Result<_, _>>()?
        };
        let exact = if c.f32_reference {
            Some(dequantized(&model, threads)?)
        } else {
            None
        };
        // The golden files hold 32 greedy tokens: the prefill's and 31 decode steps.
        let decode = if golden.is_empty() { c.decode } else { 31 };
        let mut references = Vec::new();
        for ids in &prompts {
            let quantized = cpu_run(&model, ids, decode)?;
            let f32 = exact
                .as_ref()
                .map(|m| cpu_run(m, ids, decode))
                .transpose()?;
            references.push((quantized, f32));
        }
        let mut failed = false;
        let mut device = open(c.device)?;
        device.set_gemv_launch(GemvLaunch::parse(&c.decode_path.gemv)?);
        let mut dev = Some(device);
        for spec in &c.layers {
            let device = dev.take().expect("device");
            let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
            let n_gpu = layer_count(spec, &model, &device, longest + decode + 1, 1, longest)?;
            let mut gpu = GpuModel::new(model.clone(), device, n_gpu)?;
            gpu.set_fused(c.decode_path.fuse);
            gpu.set_graphs(!c.decode_path.no_graphs);
            for (pi, (ids, (quantized, f32))) in prompts.iter().zip(&references).enumerate() {
                let run = gpu_run(&mut gpu, ids, decode)?;
                let vs_quantized = compare(&run, quantized, cfg.vocab_size);
                let vs_llamacpp = golden.get(pi).map(|g| {
                    let v = cfg.vocab_size;
                    let last = &run.logits[run.logits.len() - v..];
                    let top5 = g["top5_last_prompt_position"]
                        .as_array()
                        .cloned()
                        .unwrap_or_default();
                    // As the golden tests compare (tests/engine_golden.rs): each top-5 logit
                    // after the five differences' mean, a constant no sampler sees, is taken
                    // out; the mean itself within 3x the tolerance.
                    let diffs: Vec<f64> = top5
                        .iter()
                        .map(|t| {
                            let id = t["id"].as_u64().unwrap_or(0) as usize;
                            f64::from(last[id]) - t["logit"].as_f64().unwrap_or(0.0)
                        })
                        .collect();
                    let shift = diffs.iter().sum::<f64>() / diffs.len().max(1) as f64;
                    let top5_max_abs = diffs.iter().map(|d| d.abs()).fold(0f64, f64::max);
                    let centered_max_abs =
                        diffs.iter().map(|d| (d - shift).abs()).fold(0f64, f64::max);
                    let want = ids_of(&g["generated_token_ids"]);
                    let margins: Vec<f64> = g["greedy_top1_top2_margin"]
                        .as_array()
                        .map(|a| a.iter().filter_map(|m| m.as_f64()).collect())
                        .unwrap_or_default();
                    // Equal up to the first step llama.cpp itself calls a near-tie (< 0.3).
                    let decisive = margins.iter().take_while(|&&m| m >= 0.3).count();
                    let common = want
                        .iter()
                        .zip(&run.greedy)
                        .take_while(|(a, b)| a == b)
                        .count();
                    let pass = centered_max_abs <= GOLDEN_TOLERANCE
                        && shift.abs() <= 3.0 * GOLDEN_TOLERANCE
                        && common >= decisive.min(want.len());
                    failed |= !pass;
                    json!({
                        "id": g["id"],
                        "top5_max_abs": top5_max_abs,
                        "top5_shift": shift,
                        "top5_max_abs_centered": centered_max_abs,
                        "greedy_common_prefix": common,
                        "decisive_steps": decisive,
                        "greedy_equal": want == run.greedy,
                        "pass": pass,
                    })
                });
                let vs_f32 = f32.as_ref().map(|r| compare(&run, r, cfg.vocab_size));
                // A broken kernel gives unrelated logits; rounding differences move near-ties.
                let best = vs_f32.as_ref().unwrap_or(&vs_quantized);
                failed |= best["top5_overlap_last"].as_u64().unwrap_or(0) < 3
                    || best["argmax_agreement"].as_f64().unwrap_or(0.0) < 0.5;
                println!(
                    "{}",
                    json!({
                        "model": c.model.file_name().map(|n| n.to_string_lossy()),
                        "prompt": pi,
                        "prompt_tokens": ids.len(),
                        "n_gpu_layers": gpu.n_gpu_layers(),
                        "placement": gpu.describe(),
                        "vs_cpu": vs_quantized,
                        "vs_cpu_f32_weights": vs_f32,
                        "vs_llamacpp": vs_llamacpp,
                    })
                );
            }
            if c.batch > 1 {
                failed |= !batch_check(&mut gpu, &c, decode)?;
            }
            // The way engramd serves: CPU prefill, the cache uploaded, batched decode, the
            // cache read back (what the daemon checks before it serves from this device).
            if gpu.n_gpu_layers() == cfg.n_layer {
                let (gpu_back, ok) = fused_check(gpu, c.seed)?;
                gpu = gpu_back;
                failed |= !ok;
            }
            let serving = gpu.check_serving(&prompts[0], decode.max(2));
            failed |= serving.is_err();
            println!(
                "{}",
                json!({
                    "test": "serving",
                    "n_gpu_layers": gpu.n_gpu_layers(),
                    "pass": serving.is_ok(),
                    "top5_max_abs_diff": serving.as_ref().ok(),
                    "error": serving.as_ref().err().map(|e| e.to_string()),
                })
            );
            dev = Some(gpu.into_device());
        }
        if failed {
            bail!("the GPU path disagrees with the CPU path (see the lines above)");
        }
        Ok(())
    }

    /// Fused prefill as `engramd` runs it on a GPU (`engram_fusion::GpuRunner`: the placed
    /// cache uploaded, the recompute and the question run there) against the CPU route, for
    /// `boundary:4`, `reuse` and `query:0.05` over a prompt of three stored chunks: prints each
    /// policy's comparison and returns the GPU model and whether all agree
    /// ([`engram_model::same_top`], the whole prompt in the GPU cache).
    fn fused_check(gpu: GpuModel, seed: u64) -> Result<(GpuModel, bool)> {
        use engram_fusion::{fused_prefill, fused_prefill_on, ChunkStore, FusedPrompt, Policy};
        let model = gpu.model().clone();
        let v = model.config().vocab_size;
        let frame = pseudo_tokens(12, v, seed + 300);
        let prompt = FusedPrompt {
            prefix: frame.clone(),
            chunks: (0..3)
                .map(|i| pseudo_tokens(48 + 17 * i, v, seed + 301 + i as u64))
                .collect(),
            suffix: pseudo_tokens(12, v, seed + 310),
            evidence: 0..0,
            evidence_text: String::new(),
        };
        let store = ChunkStore::new(
            Arc::new(engram_kvstore::KvStore::new(
                Some(engram_kvstore::DramTier::new(64 << 20)),
                None,
            )),
            &model,
            frame,
            engram_kvstore::KvDtype::F16,
        );
        let gpu = std::cell::RefCell::new(gpu);
        let mut ok = true;
        for policy in [Policy::Boundary(4), Policy::Reuse, Policy::Query(0.05)] {
            let mut kv = model.new_cache(prompt.len() + 1);
            let cpu = fused_prefill(&model, &store, None, &prompt, policy, &mut kv)?;
            let mut kv = model.new_cache(prompt.len() + 1);
            let mut runner = engram_fusion::GpuRunner::new(&gpu, prompt.len() + 1);
            let on_gpu = fused_prefill_on(
                &model,
                &store,
                None,
                &prompt,
                policy,
                &mut kv,
                None,
                Some(&mut runner),
            )?;
            let held = runner.into_cache().map_or(0, |c| c.len());
            let (mine, theirs) = (top(&on_gpu.logits, 5), top(&cpu.logits, 5));
            let shared = mine.iter().filter(|i| theirs.contains(i)).count();
            let pass = engram_model::same_top(&on_gpu.logits, &cpu.logits) && held == prompt.len();
            ok &= pass;
            println!(
                "{}",
                json!({
                    "test": "fused_prefill_on_gpu",
                    "policy": policy.to_string(),
                    "pass": pass,
                    "argmax_equal": mine[0] == theirs[0],
                    "top5_shared": shared,
                    "kl_vs_cpu": kl(&cpu.logits, &on_gpu.logits),
                    "gpu_cache_slots": held,
                    "prompt_tokens": prompt.len(),
                })
            );
        }
        Ok((gpu.into_inner(), ok))
    }

    /// Decodes `c.batch` sequences of different lengths together (one batched call per step)
    /// and each alone, fed the same tokens; prints how far apart their logits are and returns
    /// whether they agree (same argmax everywhere, within 1e-3 of the largest logit).
    fn batch_check(gpu: &mut GpuModel, c: &CheckArgs, decode: usize) -> Result<bool> {
        let vocab = gpu.model().config().vocab_size;
        let steps = decode.max(2);
        // Lengths across several attention splits (64 slots each).
        let prompts: Vec<Vec<u32>> = (0..c.batch)
            .map(|i| pseudo_tokens(c.prompt + 37 * i, vocab, c.seed + 100 + i as u64))
            .collect();
        // Alone: the reference tokens and logits of every step.
        let mut alone = Vec::new();
        for ids in &prompts {
            alone.push(gpu_run(gpu, ids, steps)?);
        }
        let mut caches = Vec::new();
        for ids in &prompts {
            let mut kv = gpu.new_cache(ids.len() + steps + 1)?;
            gpu.forward(ids, &positions(0, ids.len()), &mut kv, Logits::Last)?;
            caches.push(kv);
        }
        let (mut max_abs, mut scale, mut disagree) = (0f32, 0f32, 0usize);
        for step in 0..steps {
            let toks: Vec<[u32; 1]> = alone.iter().map(|r| [r.greedy[step]]).collect();
            let pos: Vec<[i32; 1]> = prompts.iter().map(|p| [(p.len() + step) as i32]).collect();
            let mut seqs: Vec<(&[u32], &[i32], &mut engram_model::GpuCache)> = caches
                .iter_mut()
                .zip(toks.iter().zip(&pos))
                .map(|(kv, (t, p))| (&t[..], &p[..], kv))
                .collect();
            let logits = gpu.forward_batch(&mut seqs, Logits::Last)?;
            for (row, r) in logits.chunks(vocab).zip(&alone) {
                let want = &r.steps[step];
                for (a, b) in row.iter().zip(want) {
                    max_abs = max_abs.max((a - b).abs());
                    scale = scale.max(b.abs());
                }
                disagree += usize::from(argmax(row) != argmax(want));
            }
        }
        let pass = disagree == 0 && max_abs <= 1e-3 * scale.max(1.0);
        println!(
            "{}",
            json!({"model": c.model.file_name().map(|n| n.to_string_lossy()),
                   "batch_check": c.batch, "placement": gpu.describe(), "steps": steps,
                   "prompt_tokens": prompts.iter().map(Vec::len).collect::<Vec<_>>(),
                   "max_abs": max_abs, "logits_max": scale, "argmax_disagreements": disagree,
                   "pass": pass})
        );
        Ok(pass)
    }

    /// log-softmax of `v` (f64).
    fn log_softmax(v: &[f32]) -> Vec<f64> {
        let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let z = v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
        v.iter().map(|&x| x as f64 - z).collect()
    }

    /// KL(p || q) of two logit rows.
    fn kl(p: &[f32], q: &[f32]) -> f64 {
        let (lp, lq) = (log_softmax(p), log_softmax(q));
        lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum()
    }

    fn fusion(f: FusionArgs) -> Result<()> {
        let model = Arc::new(Model::load(&f.model, cores(None))?);
        let cfg = model.config().clone();
        let dev = open(f.device)?;
        let mut gpu = GpuModel::new(model.clone(), dev, cfg.n_layer)?;
        let name = f
            .model
            .file_name()
            .map(|n| n.to_string_lossy().into_owned());
        let v = cfg.vocab_size;
        let prefix = pseudo_tokens(f.prefix_tokens, v, 21);
        let question = pseudo_tokens(f.question_tokens, v, 22);
        let passages: Vec<Vec<u32>> = (0..f.passages)
            .map(|i| pseudo_tokens(f.passage_tokens, v, 100 + i as u64))
            .collect();
        let mut prompt = prefix.clone();
        let mut starts = Vec::new();
        for p in &passages {
            starts.push(prompt.len());
            prompt.extend_from_slice(p);
        }
        let q_start = prompt.len();
        prompt.extend_from_slice(&question);
        let total = prompt.len();

        // Ingest: each passage's KV computed alone at positions 0.., kept in host memory.
        let mut stored = Vec::new();
        for p in &passages {
            let mut kv = gpu.new_cache(p.len())?;
            gpu.forward(p, &positions(0, p.len()), &mut kv, Logits::None)?;
            stored.push(gpu.export_kv(&kv, 0..p.len())?);
        }
        let kv_bytes: usize = stored.iter().map(engram_model::HostKv::bytes).sum();

        // Full prefill of the same tokens, in --ubatch calls.
        let mut full_logits = Vec::new();
        let mut full_s = Vec::new();
        for _ in 0..f.repetitions + 1 {
            let mut kv = gpu.new_cache(total)?;
            let start = Instant::now();
            for (i, chunk) in prompt.chunks(f.ubatch.max(1)).enumerate() {
                let pos = positions(i * f.ubatch, chunk.len());
                full_logits = gpu.forward(chunk, &pos, &mut kv, Logits::Last)?;
            }
            full_s.push(start.elapsed().as_secs_f64());
        }
        full_s.remove(0);
        let full_ttft = median(&mut full_s);
        println!(
            "{}",
            json!({"model": name, "prompt_tokens": total, "passages": f.passages,
                   "passage_tokens": f.passage_tokens, "stored_kv_bytes": kv_bytes,
                   "policy": "full", "ttft_ms": 1e3 * full_ttft})
        );

        let chunks: Vec<(&engram_model::HostKv, i32)> = stored
            .iter()
            .zip(&starts)
            .map(|(s, &at)| (s, at as i32))
            .collect();
        for (ri, &r) in f.recompute.iter().enumerate() {
            let r = r.min(f.passage_tokens);
            // One call: each passage's first r tokens recomputed in place, then the prefix
            // and the question appended. Slots need not follow positions: the stored chunks go
            // in first.
            let mut toks = Vec::new();
            let mut pos = Vec::new();
            let mut slots = Vec::new();
            let mut slot_base = 0;
            for (p, &at) in passages.iter().zip(&starts) {
                for (j, &t) in p.iter().take(r).enumerate() {
                    toks.push(t);
                    pos.push((at + j) as i32);
                    slots.push(slot_base + j);
                }
                slot_base += p.len();
            }
            toks.extend_from_slice(&prefix);
            pos.extend(positions(0, prefix.len()));
            toks.extend_from_slice(&question);
            pos.extend(positions(q_start, question.len()));
            let mut runs = Vec::new();
            let mut logits = Vec::new();
            let (mut load_ms, mut compute_ms) = (Vec::new(), Vec::new());
            for _ in 0..f.repetitions + 1 {
                let mut kv = gpu.new_cache(total)?;
                let start = Instant::now();
                for (s, shift) in &chunks {
                    gpu.import_kv(&mut kv, s, *shift)?;
                }
                gpu.device().synchronize()?;
                let loaded = start.elapsed().as_secs_f64();
                logits = gpu.forward_fused(&toks, &pos, &slots, &mut kv, Logits::Last)?;
                let done = start.elapsed().as_secs_f64();
                runs.push(done);
                load_ms.push(1e3 * loaded);
                compute_ms.push(1e3 * (done - loaded));
            }
            runs.remove(0);
            load_ms.remove(0);
            compute_ms.remove(0);
            // The same call with the chunks' KV copied layer by layer beside the recompute.
            // A fresh cache each time, made before the clock starts.
            let mut overlapped_call = |timeline: bool| -> Result<_> {
                let mut kv = gpu.new_cache(total)?;
                let start = Instant::now();
                let (logits, times) = gpu.forward_fused_from_host(
                    &chunks,
                    &toks,
                    &pos,
                    &slots,
                    &mut kv,
                    Logits::Last,
                    timeline,
                )?;
                Ok((logits, times, start.elapsed().as_secs_f64()))
            };
            let mut overlapped = Vec::new();
            let mut overlapped_logits = Vec::new();
            for _ in 0..f.repetitions + 1 {
                let (logits, _, seconds) = overlapped_call(false)?;
                overlapped_logits = logits;
                overlapped.push(seconds);
            }
            overlapped.remove(0);
            let overlapped_ttft = median(&mut overlapped);
            if f.timeline && ri == 0 {
                let (_, times, _) = overlapped_call(true)?;
                for (layer, t) in times.iter().enumerate() {
                    let next = times.get(layer + 1).map(|n| n.wait_start_ms);
                    println!(
                        "{}",
                        json!({"model": name, "policy": format!("boundary:{r}"), "layer": layer,
                               "copy_start_ms": t.copy_start_ms, "copy_end_ms": t.copy_end_ms,
                               "copy_ms": t.copy_end_ms - t.copy_start_ms,
                               "compute_reached_ms": t.wait_start_ms,
                               "compute_waited_ms": t.wait_end_ms - t.wait_start_ms,
                               "compute_to_next_layer_ms": next.map(|n| n - t.wait_end_ms)})
                    );
                }
            }
            let ttft = median(&mut runs);
            let (tf, tg) = (top(&full_logits, 5), top(&logits, 5));
            println!(
                "{}",
                json!({"model": name, "prompt_tokens": total, "policy": format!("boundary:{r}"),
                       "recomputed_tokens": r * f.passages + prefix.len() + question.len(),
                       "ttft_ms": 1e3 * ttft, "speedup_vs_full": full_ttft / ttft,
                       "overlapped_ttft_ms": 1e3 * overlapped_ttft,
                       "overlapped_speedup_vs_full": full_ttft / overlapped_ttft,
                       "overlapped_vs_serial_max_abs": logits.iter().zip(&overlapped_logits)
                           .map(|(a, b)| (a - b).abs()).fold(0f32, f32::max),
                       "load_ms": median(&mut load_ms), "compute_ms": median(&mut compute_ms),
                       "load_gbs": kv_bytes as f64 / (median(&mut load_ms) / 1e3) / 1e9,
                       "first_token_equal": argmax(&full_logits) == argmax(&logits),
                       "top5_overlap": tf.iter().filter(|i| tg.contains(i)).count(),
                       "kl_full_fused": kl(&full_logits, &logits),
                       "logits_max_abs": full_logits.iter().zip(&logits)
                           .map(|(a, b)| (a - b).abs()).fold(0f32, f32::max),
                       "logits_max": full_logits.iter().map(|a| a.abs()).fold(0f32, f32::max)})
            );
        }
        Ok(())
    }

    /// Prints milliseconds per call of each kind of work of a profiled pass of `calls` calls.
    fn print_profile(gpu: &GpuModel, test: &str, calls: usize) {
        let p = gpu.take_profile();
        let total: f64 = p.iter().map(|(_, s)| s).sum();
        let ms: serde_json::Map<String, serde_json::Value> = p
            .iter()
            .map(|(k, s)| (k.to_string(), json!(1e3 * s / calls as f64)))
            .collect();
        println!(
            "{}",
            json!({"profile": test, "ms_per_call": ms, "total_ms_per_call": 1e3 * total / calls as f64})
        );
    }

    fn median(v: &mut [f64]) -> f64 {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }

    fn bench(b: BenchArgs) -> Result<()> {
        let load = Instant::now();
        let model = Arc::new(Model::load(&b.model, cores(b.threads))?);
        let cfg = model.config().clone();
        let mut dev = open(b.device)?;
        dev.set_gemv_launch(GemvLaunch::parse(&b.decode_path.gemv)?);
        let copy_gbs = dev.copy_bandwidth(1 << 30, 5)?;
        let context = b
            .prefill
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .max(b.decode_context + b.decode + 16);
        let sequences = b.batch.iter().copied().max().unwrap_or(1);
        let n_gpu = layer_count(&b.layers, &model, &dev, context, sequences, b.ubatch)?;
        let upload = Instant::now();
        let mut gpu = GpuModel::new(model.clone(), dev, n_gpu)?;
        gpu.set_fused(b.decode_path.fuse);
        gpu.set_graphs(!b.decode_path.no_graphs);
        let upload_s = upload.elapsed().as_secs_f64();
        let name = b
            .model
            .file_name()
            .map(|n| n.to_string_lossy().into_owned());
        println!(
            "{}",
            json!({
                "model": name,
                "device": gpu.device().info().describe(),
                "placement": gpu.describe(),
                "weight_bytes": gpu.weight_bytes(),
                "load_s": load.elapsed().as_secs_f64(),
                "upload_s": upload_s,
                "copy_gbs": copy_gbs,
                "gemv": b.decode_path.gemv,
                "fused": b.decode_path.fuse,
                "graphs": !b.decode_path.no_graphs,
            })
        );
        for &len in &b.prefill {
            let ids = pseudo_tokens(len, cfg.vocab_size, 7);
            let mut runs = Vec::new();
            for rep in 0..b.repetitions + 1 {
                let mut kv = gpu.new_cache(len + 1)?;
                let start = Instant::now();
                for (i, chunk) in ids.chunks(b.ubatch.max(1)).enumerate() {
                    let pos = positions(i * b.ubatch, chunk.len());
                    gpu.forward(chunk, &pos, &mut kv, Logits::Last)?;
                }
                // The first run warms up (cuBLAS heuristics, allocations).
                if rep > 0 {
                    runs.push(start.elapsed().as_secs_f64());
                }
            }
            let s = median(&mut runs);
            println!(
                "{}",
                json!({"model": name, "test": format!("pp{len}"), "ubatch": b.ubatch,
                       "seconds": s, "tokens_per_s": len as f64 / s})
            );
            if b.profile {
                gpu.set_profiling(true);
                let mut kv = gpu.new_cache(len + 1)?;
                for (i, chunk) in ids.chunks(b.ubatch.max(1)).enumerate() {
                    let pos = positions(i * b.ubatch, chunk.len());
                    gpu.forward(chunk, &pos, &mut kv, Logits::Last)?;
                }
                print_profile(&gpu, &format!("pp{len}"), 1);
                gpu.set_profiling(false);
            }
        }
        for &batch in &b.batch {
            let ctx = b.decode_context;
            let mut caches = Vec::new();
            let mut next = Vec::new();
            for sq in 0..batch {
                let ids = pseudo_tokens(ctx, cfg.vocab_size, 11 + sq as u64);
                let mut kv = gpu.new_cache(ctx + b.decode + 16)?;
                let mut last = Vec::new();
                for (i, chunk) in ids.chunks(b.ubatch.max(1)).enumerate() {
                    let pos = positions(i * b.ubatch, chunk.len());
                    last = gpu.forward(chunk, &pos, &mut kv, Logits::Last)?;
                }
                next.push(argmax(&last));
                caches.push(kv);
            }
            let mut step_times = Vec::new();
            for step in 0..b.decode + 1 {
                let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
                let pos = [(ctx + step) as i32];
                let mut seqs: Vec<(&[u32], &[i32], &mut engram_model::GpuCache)> = caches
                    .iter_mut()
                    .zip(&toks)
                    .map(|(kv, t)| (&t[..], &pos[..], kv))
                    .collect();
                let start = Instant::now();
                let logits = gpu.forward_batch(&mut seqs, Logits::Last)?;
                if step > 0 {
                    step_times.push(start.elapsed().as_secs_f64());
                }
                next = logits.chunks(cfg.vocab_size).map(argmax).collect();
            }
            if b.profile {
                gpu.set_profiling(true);
                let steps = 8;
                for step in 0..steps {
                    let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
                    let pos = [(ctx + b.decode + 1 + step) as i32];
                    let mut seqs: Vec<(&[u32], &[i32], &mut engram_model::GpuCache)> = caches
                        .iter_mut()
                        .zip(&toks)
                        .map(|(kv, t)| (&t[..], &pos[..], kv))
                        .collect();
                    let logits = gpu.forward_batch(&mut seqs, Logits::Last)?;
                    next = logits.chunks(cfg.vocab_size).map(argmax).collect();
                }
                print_profile(&gpu, &format!("tg x{batch}"), steps);
                gpu.set_profiling(false);
            }
            let total: f64 = step_times.iter().sum();
            let steps_per_s = step_times.len() as f64 / total;
            let mid_ctx = ctx + b.decode / 2;
            // Weights once per step, each sequence's KV once.
            let weights = model.decode_bytes(0);
            let kv_bytes = model.decode_bytes(mid_ctx) - weights;
            let bytes_per_step = weights + batch as u64 * kv_bytes;
            let gbs = bytes_per_step as f64 * steps_per_s / 1e9;
            println!(
                "{}",
                json!({"model": name, "test": format!("tg{} x{batch}", b.decode),
                       "context": ctx, "batch": batch,
                       "tokens_per_s": steps_per_s * batch as f64,
                       "step_ms": 1e3 / steps_per_s,
                       "bytes_per_step": bytes_per_step, "decode_gbs": gbs,
                       "decode_fraction_of_copy": gbs / copy_gbs,
                       "graph_error": gpu.graph_error()})
            );
        }
        Ok(())
    }
}
