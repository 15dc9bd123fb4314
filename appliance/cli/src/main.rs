//! `engram`: the command line of the Engram appliance (tokenize, generate, chat, info).

mod ask;
mod bench;
mod eval;
mod fusion_eval;
mod fusion_set;
mod gen_model;
mod gpu;
mod kb;
mod kv_deviation;
mod mixed_set;
mod qa_eval;
mod quantize;
mod requantize;

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use engram_model::{
    generate, FinishReason, GenerateRequest, Generation, KvCache, Model, SamplingParams,
};
use engram_tokenizer::{ChatTemplate, Message, Tokenizer};

/// The default LLM's file name inside the models folder.
const DEFAULT_LLM: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

#[derive(Parser)]
#[command(
    name = "engram",
    version,
    about = "Engram: private question answering over your documents"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the token ids of a text.
    Tokenize(TokenizeArgs),
    /// Generate a completion for one prompt, streaming it to stdout.
    Generate(GenerateArgs),
    /// Chat with the model, several turns, reading your messages from stdin.
    Chat(ChatArgs),
    /// Describe a GGUF model: architecture, shapes, tokenizer, tensor types.
    Info(ModelArgs),
    /// Measure prefill and decode speed, load time and peak memory.
    Bench(BenchArgs),
    /// Add files and folders to a knowledge base collection.
    Ingest(kb::IngestArgs),
    /// Search a collection (hybrid BM25 + dense by default).
    Search(kb::SearchArgs),
    /// List or delete a collection's documents.
    Docs(kb::DocsArgs),
    /// List, create or delete collections.
    Collections(kb::CollectionsArgs),
    /// Answer a question from a collection: retrieval, fused chunk KV, streamed answer.
    Ask(ask::AskArgs),
    /// Stored chunk KV: precompute a collection's, or show what the tiers hold.
    Kv(ask::KvCmdArgs),
    /// Measure retrieval quality (BEIR) or fusion fidelity and speed (MuSiQue).
    Eval(eval::EvalArgs),
    /// Write a random-weight Llama GGUF of a standard shape (for benchmarks without downloads).
    GenModel(gen_model::GenModelArgs),
    /// Rewrite a GGUF model's weights in a fixed mix of types (K-quants, Q5) for the tests.
    Requantize(requantize::RequantizeArgs),
    /// The GPU: list devices, check the GPU forward pass against the CPU, measure it.
    Gpu(gpu::GpuArgs),
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt lengths to prefill (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [128, 512, 2048, 4096])]
    prefill: Vec<usize>,
    /// Tokens to decode one at a time (0: skip).
    #[arg(long, default_value_t = 128)]
    decode: usize,
    /// Context before decoding.
    #[arg(long, default_value_t = 512)]
    decode_context: usize,
    /// Runs of each figure; medians are reported.
    #[arg(long, default_value_t = 3)]
    repetitions: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Only measure the memory read bandwidth (a 1 GiB buffer summed by --threads threads,
    /// best of --repetitions passes); no model is loaded.
    #[arg(long)]
    read_bandwidth: bool,
}

#[derive(Args)]
struct ModelArgs {
    /// GGUF model file [default: $ENGRAM_MODELS_DIR or ./models, then SmolLM2-135M-Instruct.Q4_1.gguf]
    #[arg(long)]
    model: Option<PathBuf>,
    /// Compute threads [default: all cores]
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(Args)]
struct TokenizeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Read the text from this file.
    #[arg(long, conflicts_with = "text")]
    text_file: Option<PathBuf>,
    /// The text to tokenize.
    #[arg(long)]
    text: Option<String>,
    /// Treat special-token text such as `<|im_start|>` as plain text.
    #[arg(long)]
    no_parse_special: bool,
    /// Print `{"ids": [...]}` instead of one line per token.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct SamplingArgs {
    /// Greedy decoding (argmax); the default unless --temperature is given.
    #[arg(long)]
    greedy: bool,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep only the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus sampling threshold (1: off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Repetition penalty (1: off).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Tokens the repetition penalty looks back over.
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    /// OpenAI's presence penalty, in [-2, 2]: subtracted from the logit of every token already
    /// generated (0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    presence_penalty: f32,
    /// OpenAI's frequency penalty, in [-2, 2]: subtracted once per time a token was generated
    /// (0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    frequency_penalty: f32,
    /// Random seed for sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when this text is produced (repeatable).
    #[arg(long = "stop")]
    stop: Vec<String>,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    ignore_eos: bool,
}

impl SamplingArgs {
    fn request(&self, prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
        GenerateRequest {
            prompt,
            max_tokens,
            sampling: self.params(),
            stop_strings: self.stop.clone(),
            ignore_eos: self.ignore_eos,
        }
    }

    fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: if self.greedy { 0.0 } else { self.temperature },
            top_k: self.top_k,
            top_p: self.top_p,
            repetition_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            seed: self.seed,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logit_bias: Vec::new(),
        }
    }
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// A user message; the model's chat template is applied (with --system if given).
    #[arg(long, group = "input")]
    prompt: Option<String>,
    /// A file of prompt text that is already templated; used as is.
    #[arg(long, group = "input")]
    prompt_file: Option<PathBuf>,
    /// A JSON file `[{"role": ..., "content": ...}]`; the chat template is applied with the
    /// generation prompt.
    #[arg(long, group = "input")]
    messages_file: Option<PathBuf>,
    /// The prompt as token ids, comma- or space-separated, used as they are (no BOS added):
    /// for golden files given in ids and random-weight models whose vocabulary spells nothing.
    #[arg(long, group = "input", value_name = "IDS")]
    prompt_ids: Option<String>,
    /// System prompt for --prompt.
    #[arg(long)]
    system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Print one JSON object (token ids, top-5 logits, text, timings) instead of streaming.
    #[arg(long)]
    json: bool,
    /// With --json, also list the N highest logits at the last prompt position
    /// (`top_logits_last_prompt`).
    #[arg(long, default_value_t = 0)]
    top_logits: usize,
}

#[derive(Args)]
struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// System prompt.
    #[arg(long)]
    system: Option<String>,
    /// Most tokens per answer.
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    /// Context size in tokens [default: the model's, at most 8192].
    #[arg(long)]
    ctx: Option<usize>,
    #[command(flatten)]
    sampling: SamplingArgs,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(tracing_subscriber::filter::LevelFilter::WARN)
        .with_target(false)
        .without_time()
        .init();
    match cli.command {
        Command::Tokenize(a) => tokenize(a),
        Command::Generate(a) => generate_cmd(a),
        Command::Chat(a) => chat(a),
        Command::Info(a) => info(a),
        Command::Bench(a) => bench_cmd(a),
        Command::Ingest(a) => kb::ingest(a),
        Command::Search(a) => kb::search(a),
        Command::Docs(a) => kb::docs(a),
        Command::Collections(a) => kb::collections(a),
        Command::Ask(a) => ask::ask(a),
        Command::Kv(a) => ask::kv(a),
        Command::Eval(a) => eval::eval(a),
        Command::GenModel(a) => gen_model::gen_model(a),
        Command::Requantize(a) => requantize::requantize(a),
        Command::Gpu(a) => gpu::gpu(a),
    }
}

fn default_model_path() -> PathBuf {
    let dir = std::env::var_os("ENGRAM_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("models"));
    dir.join(DEFAULT_LLM)
}

impl ModelArgs {
    fn path(&self) -> Result<PathBuf> {
        let p = self.model.clone().unwrap_or_else(default_model_path);
        if !p.is_file() {
            bail!(
                "model file {} not found (run scripts/fetch-models.sh, or pass --model)",
                p.display()
            );
        }
        Ok(p)
    }

    fn threads(&self) -> usize {
        self.threads.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        })
    }

    fn load(&self) -> Result<Loaded> {
        let path = self.path()?;
        let started = std::time::Instant::now();
        let model = Model::load(&path, self.threads())
            .with_context(|| format!("loading {}", path.display()))?;
        let meta = model.gguf().metadata();
        let tokenizer = Tokenizer::from_gguf(meta).context("building the tokenizer")?;
        let template = ChatTemplate::from_gguf(meta).context("parsing the chat template")?;
        Ok(Loaded {
            model,
            tokenizer,
            template,
            load_ms: started.elapsed().as_secs_f64() * 1e3,
        })
    }
}

struct Loaded {
    model: Model,
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    load_ms: f64,
}

impl Loaded {
    /// Token ids of prompt text, with BOS prepended when the model asks for it.
    fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.tokenizer.encode_prompt(text)?)
    }

    fn render(&self, messages: &[Message]) -> Result<String> {
        match &self.template {
            Some(t) => Ok(t.render(messages, true)?),
            None => bail!(
                "this model has no chat template; pass already templated text with --prompt-file"
            ),
        }
    }
}

fn read_file(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

fn tokenize(a: TokenizeArgs) -> Result<()> {
    let path = a.model.path()?;
    let file = engram_gguf::GgufFile::open(&path)?;
    let tokenizer = Tokenizer::from_gguf(file.metadata())?;
    let text = match (&a.text_file, &a.text) {
        (Some(f), _) => read_file(f)?,
        (None, Some(t)) => t.clone(),
        (None, None) => bail!("give the text with --text or --text-file"),
    };
    let mut ids = tokenizer.encode(&text, !a.no_parse_special)?;
    if tokenizer.add_bos() {
        if let Some(bos) = tokenizer.bos_id() {
            ids.insert(0, bos);
        }
    }
    if a.json {
        println!("{}", serde_json::json!({ "ids": ids }));
    } else {
        for id in ids {
            let piece = String::from_utf8_lossy(&tokenizer.token_bytes(id)).into_owned();
            println!("{id:>7} {piece:?}");
        }
    }
    Ok(())
}

fn generate_cmd(a: GenerateArgs) -> Result<()> {
    let loaded = a.model.load()?;
    let text = if let Some(ids) = &a.prompt_ids {
        String::from(ids)
    } else if let Some(f) = &a.prompt_file {
        read_file(f)?
    } else if let Some(f) = &a.messages_file {
        let messages: Vec<Message> = serde_json::from_str(&read_file(f)?)
            .with_context(|| format!("{} is not a JSON list of {{role, content}}", f.display()))?;
        loaded.render(&messages)?
    } else if let Some(p) = &a.prompt {
        let mut messages = Vec::new();
        if let Some(s) = &a.system {
            messages.push(Message::new("system", s));
        }
        messages.push(Message::new("user", p));
        loaded.render(&messages)?
    } else {
        bail!("give a prompt with --prompt, --prompt-file, --messages-file or --prompt-ids");
    };
    let prompt = match &a.prompt_ids {
        Some(_) => parse_ids(&text, loaded.model.config().vocab_size)?,
        None => loaded.encode_prompt(&text)?,
    };
    let capacity = prompt.len() + a.max_tokens;
    let mut kv = loaded.model.new_cache(capacity);
    let req = a.sampling.request(prompt, a.max_tokens);
    let mut cached = Vec::new();
    let json = a.json;
    let g = generate(
        &loaded.model,
        &loaded.tokenizer,
        &mut kv,
        &mut cached,
        &req,
        |t| json || print_stream(t),
    )?;
    if json {
        let out = serde_json::json!({
            "prompt_token_ids": req.prompt,
            "generated_token_ids": g.token_ids,
            "top5_last_prompt": g.top5_last_prompt.iter().map(|&(id, l)| serde_json::json!([id, l])).collect::<Vec<_>>(),
            "top_logits_last_prompt": engram_model::top_k(&g.last_prompt_logits, a.top_logits).iter().map(|&(id, l)| serde_json::json!([id, l])).collect::<Vec<_>>(),
            "text": g.text,
            "finish_reason": g.finish_reason,
            "stats": stats_json(&g, loaded.load_ms),
        });
        println!("{out}");
    } else {
        println!();
        eprintln!("{}", stats_line(&g));
    }
    Ok(())
}

/// Token ids separated by commas or white space, each below `vocab`; at least one.
fn parse_ids(text: &str, vocab: usize) -> Result<Vec<u32>> {
    let ids = text
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(|s| match s.parse::<u32>() {
            Ok(id) if (id as usize) < vocab => Ok(id),
            Ok(id) => bail!("--prompt-ids: {id} is outside the vocabulary of {vocab}"),
            Err(_) => bail!("--prompt-ids: `{s}` is not a token id"),
        })
        .collect::<Result<Vec<u32>>>()?;
    if ids.is_empty() {
        bail!("--prompt-ids: no token ids given");
    }
    Ok(ids)
}

/// Writes streamed text to stdout at once; a closed stdout (e.g. `| head`) cancels generation.
fn print_stream(text: &str) -> bool {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .is_ok()
}

fn stats_json(g: &Generation, load_ms: f64) -> serde_json::Value {
    let s = &g.stats;
    serde_json::json!({
        "model_load_ms": load_ms,
        "prompt_tokens": s.prompt_tokens,
        "cached_prompt_tokens": s.cached_prompt_tokens,
        "generated_tokens": s.generated_tokens,
        "time_to_first_token_ms": s.time_to_first_token.as_secs_f64() * 1e3,
        "prefill_tokens_per_second": s.prefill_tokens_per_second(),
        "decode_tokens_per_second": s.decode_tokens_per_second(),
    })
}

fn stats_line(g: &Generation) -> String {
    let s = &g.stats;
    let finish = match g.finish_reason {
        FinishReason::Eog => "end of generation",
        FinishReason::Stop => "stop string",
        FinishReason::Length => "max tokens",
        FinishReason::Cancelled => "cancelled",
    };
    format!(
        "[prompt {} tokens ({} cached) | first token {:.0} ms | prefill {:.1} tok/s | {} tokens at {:.1} tok/s | {}]",
        s.prompt_tokens,
        s.cached_prompt_tokens,
        s.time_to_first_token.as_secs_f64() * 1e3,
        s.prefill_tokens_per_second(),
        s.generated_tokens,
        s.decode_tokens_per_second(),
        finish
    )
}

fn chat(a: ChatArgs) -> Result<()> {
    let loaded = a.model.load()?;
    let ctx = a
        .ctx
        .unwrap_or_else(|| loaded.model.config().context_length.min(8192));
    let mut kv: KvCache = loaded.model.new_cache(ctx);
    let mut cached = Vec::new();
    let mut messages = Vec::new();
    if let Some(s) = &a.system {
        messages.push(Message::new("system", s));
    }
    let interactive = std::io::IsTerminal::is_terminal(&std::io::stdin());
    eprintln!(
        "engram chat: {} ({} layers), {} context tokens. Type a message; /reset clears, /exit quits.",
        loaded.model.config().arch.name(),
        loaded.model.config().n_layer,
        ctx
    );
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        if interactive {
            eprint!("> ");
        }
        let Some(line) = lines.next() else { break };
        let line = line?;
        let line = line.trim();
        match line {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages.retain(|m: &Message| m.role == "system");
                eprintln!("(conversation cleared)");
                continue;
            }
            _ => {}
        }
        messages.push(Message::new("user", line));
        let prompt = loaded.encode_prompt(&loaded.render(&messages)?)?;
        if prompt.len() + a.max_tokens > ctx {
            messages.pop();
            eprintln!(
                "(the conversation is {} tokens; with {} for the answer it exceeds the {ctx}-token context: /reset to start over)",
                prompt.len(),
                a.max_tokens
            );
            continue;
        }
        let req = a.sampling.request(prompt, a.max_tokens);
        let g = generate(
            &loaded.model,
            &loaded.tokenizer,
            &mut kv,
            &mut cached,
            &req,
            print_stream,
        )?;
        println!();
        eprintln!("{}", stats_line(&g));
        messages.push(Message::new("assistant", g.text.trim()));
    }
    Ok(())
}

fn bench_cmd(a: BenchArgs) -> Result<()> {
    if a.read_bandwidth {
        let b = bench::read_bandwidth(a.model.threads(), a.repetitions);
        if a.json {
            println!("{}", serde_json::to_string(&b)?);
        } else {
            println!(
                "memory read {:.1} GB/s ({} threads, {} MiB buffer, best of {})",
                b.read_gbs,
                b.threads,
                b.buffer_mib,
                b.runs.len()
            );
        }
        return Ok(());
    }
    let path = a.model.path()?;
    let started = std::time::Instant::now();
    let model = Model::load(&path, a.model.threads())
        .with_context(|| format!("loading {}", path.display()))?;
    let load_ms = started.elapsed().as_secs_f64() * 1e3;
    let plan = bench::BenchPlan {
        prefill: a.prefill,
        decode_tokens: a.decode,
        decode_context: a.decode_context,
        repetitions: a.repetitions,
    };
    let name = path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let report = bench::run(&model, &name, load_ms, &plan)?;
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        bench::print_table(&report);
    }
    Ok(())
}

fn info(a: ModelArgs) -> Result<()> {
    let path = a.path()?;
    let file = engram_gguf::GgufFile::open(&path)?;
    let cfg = engram_model::ModelConfig::from_metadata(file.metadata())?;
    let tokenizer = Tokenizer::from_gguf(file.metadata())?;
    let mut types: std::collections::BTreeMap<&str, (usize, u64)> = Default::default();
    for t in file.tensors() {
        let e = types.entry(t.ty.name()).or_default();
        e.0 += 1;
        e.1 += t.size;
    }
    println!(
        "file         {} (GGUF v{}, {:.1} MiB)",
        path.display(),
        file.version(),
        file.file_size() as f64 / 1048576.0
    );
    println!(
        "name         {}",
        file.metadata().get_str("general.name").unwrap_or("?")
    );
    println!("architecture {}", cfg.arch.name());
    println!(
        "layers       {}  embedding {}  feed-forward {}",
        cfg.n_layer, cfg.n_embd, cfg.n_ff
    );
    if let Some(m) = cfg.moe {
        println!(
            "experts      {} per token of {}, each {} wide (on the CPU)",
            m.n_expert_used, m.n_expert, m.n_ff_expert
        );
    }
    println!(
        "heads        {} query / {} KV, head size {}",
        cfg.n_head, cfg.n_head_kv, cfg.head_dim
    );
    println!(
        "context      {}  rope base {}  rope dims {}  scaling {:?}",
        cfg.context_length, cfg.rope_base, cfg.rope_dims, cfg.rope_scaling
    );
    println!(
        "vocabulary   {} ({}, pre-tokenizer {}), EOG ids {:?}",
        tokenizer.vocab_size(),
        file.metadata()
            .get_str("tokenizer.ggml.model")
            .unwrap_or("?"),
        tokenizer.pre_tokenizer(),
        tokenizer.eog_ids()
    );
    for (ty, (n, bytes)) in types {
        println!(
            "tensors      {n:>4} x {ty:<6} {:>8.1} MiB",
            bytes as f64 / 1048576.0
        );
    }
    Ok(())
}
