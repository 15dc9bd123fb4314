//! `engram ask`: retrieve, fuse the chunks' stored KV, stream the answer with citations and
//! stage timings. Also the chunk KV stage of `engram ingest --kv` and the tier options both
//! share.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use engram_fusion::{
    chunk_tokens, rag_frame_for, ChunkStore, Ensured, GateLimits, Layout, Policy, DEFAULT_LAYOUT,
    DEFAULT_POLICY, DEFAULT_SYSTEM,
};
use engram_kb::{KnowledgeBase, SearchRequest};
use engram_kvstore::{DramTier, IoMode, KvDtype, KvStore, NvmeOptions, NvmeTier};
use engram_model::Model;
use engram_rag::{no_answer, rag_prompt_with, AnswerOptions, AnswerRules, DEFAULT_COPY_BIAS};
use engram_tokenizer::{ChatTemplate, Tokenizer};

use crate::kb::KbArgs;

/// Where chunk KV is kept.
#[derive(Args, Clone, Debug)]
pub struct KvArgs {
    /// NVMe tier directory [default: <data dir>/kv]
    #[arg(long)]
    pub kv_dir: Option<PathBuf>,
    /// DRAM tier budget in MiB (0 disables the tier).
    #[arg(long, default_value_t = 1024)]
    pub kv_dram_mib: u64,
    /// NVMe tier budget in GiB (0 disables the tier).
    #[arg(long, default_value_t = 64)]
    pub kv_nvme_gib: u64,
    /// Stored element type: f16, or int8 (half the bytes, per-token scales).
    #[arg(long, default_value = "f16", value_parser = ["f16", "int8", "int4"])]
    pub kv_dtype: String,
}

impl KvArgs {
    /// Opens the tiers.
    pub fn open(&self, data_dir: &Path) -> Result<KvStore> {
        let dram = (self.kv_dram_mib > 0).then(|| DramTier::new(self.kv_dram_mib << 20));
        let nvme = if self.kv_nvme_gib > 0 {
            let dir = self.kv_dir.clone().unwrap_or_else(|| data_dir.join("kv"));
            Some(
                NvmeTier::open(
                    &dir,
                    NvmeOptions {
                        budget_bytes: self.kv_nvme_gib << 30,
                        io: IoMode::Auto,
                        direct: true,
                        reserve_free_bytes: 0,
                    },
                )
                .with_context(|| format!("opening the KV tier in {}", dir.display()))?,
            )
        } else {
            None
        };
        Ok(KvStore::new(dram, nvme))
    }

    pub fn dtype(&self) -> Result<KvDtype> {
        Ok(KvDtype::parse(&self.kv_dtype)?)
    }
}

#[derive(Args)]
pub struct AskArgs {
    /// The question.
    question: String,
    /// The collection to answer from.
    #[arg(long)]
    collection: String,
    /// Chunks retrieved into the prompt.
    #[arg(long, default_value_t = 5)]
    k: usize,
    /// Fusion policy: full, reuse, boundary:N or deviation:R.
    #[arg(long, default_value_t = DEFAULT_POLICY.name())]
    policy: String,
    /// Most tokens generated.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// While the answer is writing a number or a character, logit bias of the tokens that
    /// follow its ending in a retrieved passage (0 = off); see `engram_rag::CopyBias`.
    #[arg(long, default_value_t = DEFAULT_COPY_BIAS)]
    copy_bias: f32,
    /// Whether the copy bias also favours the numbers the evidence sentence states where the
    /// answer is not inside a number (`on`, `off`).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    evidence_numbers: String,
    /// Whether an answer that starts with what the evidence sentence does not support (a number
    /// it does not state, a bare yes or no) is replaced by the sentence (`on`, `off`); see
    /// `engram_rag::OutputText::or_sentence`.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    start_check: String,
    /// Answer rules turned off, comma-separated by name (`engram_rag::AnswerRule`), as
    /// engramd's `[answers] rules_off`.
    #[arg(long, default_value = "")]
    rules_off: String,
    /// Print one JSON object (answer, citations, timings) instead of streaming.
    #[arg(long)]
    json: bool,
    /// Fidelity gate: largest mean KL (nats) of fused vs full prefill on the built-in check
    /// before fusion is disabled for the model.
    #[arg(long, default_value_t = engram_fusion::GATE_MAX_KL)]
    gate_max_kl: f64,
    #[command(flatten)]
    kv: KvArgs,
    #[command(flatten)]
    kb: KbArgs,
}

/// The LLM with its tokenizer and template, for the fusion commands.
pub struct Llm {
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
}

impl Llm {
    pub fn load(kb: &KbArgs) -> Result<Llm> {
        let path = kb.model.clone().unwrap_or_else(crate::default_model_path);
        let threads = kb.threads.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        });
        let model =
            Model::load(&path, threads).with_context(|| format!("loading {}", path.display()))?;
        let meta = model.gguf().metadata();
        let tokenizer = Tokenizer::from_gguf(meta).context("building the tokenizer")?;
        let template = ChatTemplate::from_gguf(meta).context("parsing the chat template")?;
        Ok(Llm {
            model,
            tokenizer,
            template,
        })
    }

    /// The chunk store for this model; records its fingerprint next to the NVMe tier, as the
    /// daemon does, so that KV stored here is not taken for another model's at its next start.
    pub fn chunk_store(&self, store: KvStore, dtype: KvDtype) -> Result<ChunkStore> {
        self.chunk_store_for(DEFAULT_LAYOUT, store, dtype)
    }

    /// [`Self::chunk_store`] with chunks computed in `layout`'s frame ([`rag_frame_for`]).
    pub fn chunk_store_for(
        &self,
        layout: Layout,
        store: KvStore,
        dtype: KvDtype,
    ) -> Result<ChunkStore> {
        let frame = rag_frame_for(layout, &self.tokenizer, self.template.as_ref())?;
        let store = ChunkStore::new(Arc::new(store), &self.model, frame, dtype);
        if let Err(e) = store.record_fingerprint() {
            eprintln!("warning: cannot record the chunk KV model next to the NVMe tier: {e}");
        }
        Ok(store)
    }
}

/// The KV stage of ingestion: computes and stores the KV of every chunk of `docs` that no tier
/// holds yet. Returns (computed, already stored).
///
/// Each document leaves the knowledge base's durable chunk KV queue once all its chunks are
/// stored, so an interrupted run leaves the rest to the next one (or to `engramd`).
pub fn precompute_docs(
    kb: &mut KnowledgeBase,
    llm: &Llm,
    store: &ChunkStore,
    docs: &[u64],
    mut progress: impl FnMut(usize),
) -> Result<(usize, usize)> {
    let (mut computed, mut present) = (0, 0);
    for &doc in docs {
        for chunk in kb.chunks(doc)? {
            let ids = chunk_tokens(&llm.tokenizer, &chunk.text)?;
            if store.ensure(&llm.model, &ids)? == Ensured::Present {
                present += 1;
            } else {
                computed += 1;
            }
            progress(computed + present);
        }
        kb.kv_done(doc)?;
    }
    Ok((computed, present))
}

pub fn ask(a: AskArgs) -> Result<()> {
    let kb = a.kb.open()?;
    let t = Instant::now();
    let mut req = SearchRequest::new(&a.collection, &a.question);
    req.k = a.k;
    let hits = kb.search(&req)?.hits;
    // As engramd (`engram_rag::ground`): nothing relevant retrieved answers "I don't know"
    // without running the model, and a passage that mostly repeats a better-ranked one is left
    // out.
    let grounded = engram_rag::ground(kb.models(), &a.question, hits)?;
    if grounded.refused() {
        let answer = no_answer(&a.question);
        if a.json {
            let mut timings = serde_json::Map::new();
            timings.insert(
                "retrieve_ms".into(),
                (t.elapsed().as_secs_f64() * 1e3).into(),
            );
            print_json(answer, None, None, 0, Vec::new(), timings)?;
        } else {
            println!("{answer}");
        }
        return Ok(());
    }
    let hits = grounded.hits;
    let retrieve = t.elapsed();

    let llm = Llm::load(&a.kb)?;
    let data_dir = a.kb.data_dir();
    let store = llm.chunk_store(a.kv.open(&data_dir)?, a.kv.dtype()?)?;
    let mut policy: Policy = a.policy.parse()?;
    let mut fusion_disabled = None;
    if policy != Policy::Full {
        let limits = GateLimits {
            max_mean_kl: a.gate_max_kl,
            ..GateLimits::default()
        };
        let report = engram_fusion::recorded_gate(
            &llm.model,
            &llm.tokenizer,
            llm.template.as_ref(),
            &store,
            policy,
            limits,
            &data_dir.join("kv"),
        )?;
        if !report.passed {
            eprintln!(
                "fusion disabled for this model ({}); using full prefill",
                report.reason.as_deref().unwrap_or("fidelity gate failed")
            );
            policy = Policy::Full;
            fusion_disabled = report.reason;
        }
    }

    let passages: Vec<&str> = hits.iter().map(|h| h.text.as_str()).collect();
    let mut prompt = rag_prompt_with(
        DEFAULT_LAYOUT,
        &llm.tokenizer,
        llm.template.as_ref(),
        DEFAULT_SYSTEM,
        &passages,
        &a.question,
        grounded.evidence.as_deref(),
    )?;
    if a.evidence_numbers == "off" {
        prompt.evidence = 0..0;
    }
    let stdout = std::io::stdout();
    let json = a.json;
    let g = engram_rag::generate(
        &llm.model,
        &llm.tokenizer,
        &store,
        &prompt,
        &a.question,
        &passages,
        policy,
        a.max_tokens,
        a.temperature,
        AnswerOptions {
            copy_bias: a.copy_bias,
            check_start: a.start_check == "on",
            rules_off: parse_rules_off(&a.rules_off)?,
        },
        &mut |piece| {
            if !json {
                let mut out = stdout.lock();
                let _ = write!(out, "{piece}");
                let _ = out.flush();
            }
        },
    )?;
    let first_token = Some(g.first_token + retrieve);
    let (answer, decode, generated, done) = (g.text, g.decode, g.generated, g.prefilled);
    let s = &done;
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    let citations: Vec<serde_json::Value> = hits
        .iter()
        .enumerate()
        .map(|(i, h)| {
            serde_json::json!({
                "n": i + 1,
                "doc_id": h.doc_id,
                "doc_name": h.doc_name,
                "chunk_id": h.chunk_id,
                "chars": [h.chars.start, h.chars.end],
                "page": h.page,
                "score": h.score,
            })
        })
        .collect();
    let mut timings = s.timings_json();
    timings.insert("retrieve_ms".into(), ms(retrieve).into());
    timings.insert("first_token_ms".into(), first_token.map_or(0.0, ms).into());
    timings.insert("decode_ms".into(), ms(decode).into());
    timings.insert("generated_tokens".into(), generated.into());
    timings.insert("answer_rules".into(), g.rules.names().into());
    if a.json {
        return print_json(
            answer.trim(),
            Some(&policy.name()),
            fusion_disabled.as_deref(),
            prompt.len(),
            citations,
            timings,
        );
    }
    println!();
    println!();
    for (i, h) in hits.iter().enumerate() {
        let page = h.page.map(|p| format!(", page {p}")).unwrap_or_default();
        println!(
            "[{}] {} (chunk {}, chars {}..{}{page})",
            i + 1,
            h.doc_name,
            h.ordinal,
            h.chars.start,
            h.chars.end
        );
    }
    eprintln!(
        "\npolicy {} | retrieve {:.0} ms | KV load {:.0} ms ({} DRAM, {} NVMe, {} computed) | \
         recompute {:.0} ms ({} tokens) | question {:.0} ms | first token {:.0} ms | decode {:.0} ms ({} tokens)",
        policy.name(),
        ms(retrieve),
        ms(s.kv_load_time()),
        s.chunks_from_dram,
        s.chunks_from_nvme,
        s.chunks_computed,
        ms(s.recompute_time),
        s.recomputed_chunk_tokens,
        ms(s.suffix_time),
        first_token.map_or(0.0, ms),
        ms(decode),
        generated,
    );
    Ok(())
}

/// `engram ask --json`'s one object: the answer, the policy it was prefilled under (none when
/// it was not generated), why fusion was disabled, the prompt's length, the citations and the
/// stage timings.
fn print_json(
    answer: &str,
    policy: Option<&str>,
    fusion_disabled: Option<&str>,
    prompt_tokens: usize,
    citations: Vec<serde_json::Value>,
    timings: serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    println!(
        "{}",
        serde_json::to_string_pretty(&serde_json::json!({
            "answer": answer,
            "policy": policy,
            "fusion_disabled": fusion_disabled,
            "prompt_tokens": prompt_tokens,
            "citations": citations,
            "timings": timings,
        }))?
    );
    Ok(())
}

/// Answer rules named in `names`, comma-separated (`--rules-off`); an unknown name is refused
/// with the list.
pub fn parse_rules_off(names: &str) -> Result<AnswerRules> {
    AnswerRules::from_names(names.split(',').map(str::trim).filter(|n| !n.is_empty()))
        .map_err(anyhow::Error::msg)
}

#[derive(Args)]
pub struct KvCmdArgs {
    #[command(subcommand)]
    command: KvCommand,
}

#[derive(clap::Subcommand)]
enum KvCommand {
    /// Compute and store the KV of every chunk of a collection that no tier holds for the
    /// current model (after a model change, or for documents ingested without --kv).
    Precompute {
        #[arg(long)]
        collection: String,
        #[command(flatten)]
        kv: KvArgs,
        #[command(flatten)]
        kb: KbArgs,
    },
    /// What the NVMe tier holds.
    Stats {
        #[command(flatten)]
        kv: KvArgs,
        #[command(flatten)]
        kb: KbArgs,
    },
}

pub fn kv(a: KvCmdArgs) -> Result<()> {
    match a.command {
        KvCommand::Precompute { collection, kv, kb } => {
            let mut base = kb.open()?;
            let llm = Llm::load(&kb)?;
            let store = llm.chunk_store(kv.open(&kb.data_dir())?, kv.dtype()?)?;
            // Queued durably first: a run that is stopped leaves the rest to the next.
            base.mark_kv_pending(Some(&collection))?;
            let docs: Vec<u64> = base
                .documents(&collection)?
                .iter()
                .filter(|d| d.stage == engram_kb::Stage::Done)
                .map(|d| d.id)
                .collect();
            let started = Instant::now();
            let (computed, present) = precompute_docs(&mut base, &llm, &store, &docs, |_| {})?;
            let failed = store
                .counters
                .put_failed
                .load(std::sync::atomic::Ordering::Relaxed);
            println!(
                "{}",
                serde_json::json!({
                    "collection": collection,
                    "computed": computed,
                    "already_stored": present,
                    "not_stored": failed,
                    "elapsed_s": started.elapsed().as_secs_f64(),
                })
            );
            Ok(())
        }
        KvCommand::Stats { kv, kb } => {
            let store = kv.open(&kb.data_dir())?;
            let mut out = serde_json::Map::new();
            if let Some(t) = store.nvme() {
                use engram_kvstore::KvTier;
                out.insert(
                    "nvme".into(),
                    serde_json::json!({
                        "dir": t.dir().display().to_string(),
                        "io": t.io_mode(),
                        "blobs": t.len(),
                        "used_bytes": t.used_bytes(),
                        "budget_bytes": t.budget_bytes(),
                    }),
                );
            }
            println!("{}", serde_json::Value::Object(out));
            Ok(())
        }
    }
}
