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
    chunk_tokens, evidence_to_embed, fused_prefill, nearest_evidence, no_answer, rag_frame_for,
    rag_prompt_with, relevant, relevant_sentence, retain_distinct, sentences_to_embed, AnswerRules,
    ChunkStore, CopyBias, Ensured, GateLimits, Layout, OutputText, Policy, DEFAULT_COPY_BIAS,
    DEFAULT_LAYOUT, DEFAULT_POLICY, DEFAULT_SYSTEM,
};
use engram_kb::{KnowledgeBase, SearchRequest};
use engram_kvstore::{DramTier, IoMode, KvDtype, KvStore, NvmeOptions, NvmeTier};
use engram_model::{Logits, Model, Sampler, SamplingParams};
use engram_tokenizer::{ChatTemplate, Detokenizer, Tokenizer};

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
    /// follow its ending in a retrieved passage (0 = off); see `engram_fusion::CopyBias`.
    #[arg(long, default_value_t = DEFAULT_COPY_BIAS)]
    copy_bias: f32,
    /// Whether the copy bias also favours the numbers the evidence sentence states where the
    /// answer is not inside a number (`on`, `off`).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    evidence_numbers: String,
    /// Whether an answer that starts with what the evidence sentence does not support (a number
    /// it does not state, a bare yes or no) is replaced by the sentence (`on`, `off`); see
    /// `engram_fusion::OutputText::or_sentence`.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    start_check: String,
    /// Answer rules turned off, comma-separated by name (`engram_fusion::AnswerRule`), as
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
    let mut hits = kb.search(&req)?.hits;
    // As engramd (`grounded`): nothing relevant retrieved answers "I don't know" without
    // running the model, and a passage that mostly repeats a better-ranked one is left out.
    if !grounded(kb.models(), &a.question, &hits)? {
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
    retain_distinct(&mut hits, |h| &h.text);
    engram_fusion::retain_language(&a.question, &mut hits, |h| &h.text);
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
    let chosen = chosen_evidence(kb.models(), &a.question, passages.iter().copied())?;
    let mut prompt = rag_prompt_with(
        DEFAULT_LAYOUT,
        &llm.tokenizer,
        llm.template.as_ref(),
        DEFAULT_SYSTEM,
        &passages,
        &a.question,
        chosen.as_deref(),
    )?;
    if a.evidence_numbers == "off" {
        prompt.evidence = 0..0;
    }
    let stdout = std::io::stdout();
    let json = a.json;
    let g = generate(
        &llm,
        &store,
        &prompt,
        &a.question,
        policy,
        a.max_tokens,
        a.temperature,
        a.copy_bias,
        a.start_check == "on",
        parse_rules_off(&a.rules_off)?,
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

/// Whether `hits` are worth answering `question` from, as engramd judges it: [`relevant`], and
/// for an English question that refuses, its [`second_look`] ([`relevant_sentence`]).
pub fn grounded(
    models: &engram_kb::Models,
    question: &str,
    hits: &[engram_kb::SearchHit],
) -> Result<bool> {
    let best = hits.iter().filter_map(|h| h.dense).reduce(f32::max);
    let texts = || hits.iter().map(|h| h.text.as_str());
    let first = relevant(question, best, texts());
    Ok(first || relevant_sentence(second_look(models, question, first, texts())?))
}

/// The evidence sentence of the default layout, as engramd chooses it: by the embedder among
/// the sentences near the best term score ([`evidence_to_embed`], [`nearest_evidence`]);
/// `None` leaves the choice to the terms (one such sentence, or a question not in English).
pub fn chosen_evidence<'a>(
    models: &engram_kb::Models,
    question: &str,
    passages: impl IntoIterator<Item = &'a str>,
) -> Result<Option<String>> {
    let sentences = evidence_to_embed(question, passages, DEFAULT_LAYOUT.evidence_max_chars);
    if sentences.is_empty() {
        return Ok(None);
    }
    let refs: Vec<&str> = sentences.iter().map(String::as_str).collect();
    let cosines = models.similarities(question, &refs)?;
    Ok(nearest_evidence(sentences, &cosines))
}

/// For a question [`relevant`] refused (`first` false): the best cosine similarity between it
/// and one of the retrieved sentences ([`sentences_to_embed`]), as engramd takes a second look
/// (`None` when `first` held or the question is not English).
pub fn second_look<'a>(
    models: &engram_kb::Models,
    question: &str,
    first: bool,
    passages: impl IntoIterator<Item = &'a str>,
) -> Result<Option<f32>> {
    if first {
        return Ok(None);
    }
    let sentences = sentences_to_embed(question, passages);
    Ok(models.best_similarity(question, &sentences)?)
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

/// A generated answer.
pub struct Generated {
    /// The answer up to the first stop string.
    pub text: String,
    /// Whether the model wrote no answer and `text` is the evidence sentence
    /// ([`OutputText::or_sentence`]).
    pub fell_back: bool,
    /// The answer rules that changed the answer.
    pub rules: AnswerRules,
    pub prefilled: engram_fusion::FuseStats,
    /// From the start of the prefill to the first token.
    pub first_token: std::time::Duration,
    pub decode: std::time::Duration,
    pub generated: usize,
}

/// Prefills `prompt` (asking `question`) under `policy` and decodes an answer (greedy at
/// temperature 0) until the end-of-generation token, the end of the answer ([`OutputText`]:
/// a stop string, the answer repeating itself) or `max_tokens`; `on_piece` gets the text as it
/// becomes final, as `engramd` sends it. With `start_check`, an answer that starts with what
/// the evidence sentence does not support is the sentence (`OutputText::check_start`); the
/// rules in `rules_off` are off (`OutputText::rules_off`).
#[allow(clippy::too_many_arguments)]
pub fn generate(
    llm: &Llm,
    store: &ChunkStore,
    prompt: &engram_fusion::FusedPrompt,
    question: &str,
    policy: Policy,
    max_tokens: usize,
    temperature: f32,
    copy_bias: f32,
    start_check: bool,
    rules_off: AnswerRules,
    on_piece: &mut dyn FnMut(&str),
) -> Result<Generated> {
    let started = Instant::now();
    let mut kv = llm.model.new_cache(prompt.len() + max_tokens + 1);
    let done = fused_prefill(&llm.model, store, None, prompt, policy, &mut kv)?;
    let mut sampler = Sampler::new(SamplingParams {
        temperature,
        ..SamplingParams::default()
    })?;
    let mut text = OutputText::answer(question, &[]);
    text.or_sentence(&prompt.evidence_text);
    let passages: Vec<String> = prompt
        .chunks
        .iter()
        .map(|c| llm.tokenizer.decode(c, true))
        .collect();
    text.from_passages(passages.iter().map(String::as_str));
    text.check_start(start_check);
    text.rules_off(rules_off);
    let mut history = prompt.tokens();
    let prompt_len = history.len();
    let copy = CopyBias::from_prompt(prompt, &llm.tokenizer, copy_bias);
    let mut detok = Detokenizer::new(&llm.tokenizer, true);
    let mut logits = done.logits;
    let decode_start = Instant::now();
    let mut first_token = None;
    let mut generated = 0;
    let mut stopped = false;
    for (i, pos) in (done.next_position..).take(max_tokens).enumerate() {
        if let Some(c) = &copy {
            c.apply(&history[prompt_len..], &mut logits);
        }
        let id = sampler.sample(&logits, &history);
        first_token.get_or_insert_with(|| started.elapsed());
        if llm.tokenizer.is_eog(id) {
            break;
        }
        generated += 1;
        history.push(id);
        let (out, ended) = text.push(&detok.push(id));
        on_piece(&out);
        if ended {
            stopped = true;
            break;
        }
        if i + 1 < max_tokens {
            logits = llm.model.forward(&[id], &[pos], &mut kv, Logits::Last)?;
        }
    }
    if !stopped {
        on_piece(&text.finish().0);
    }
    Ok(Generated {
        text: text.text().to_owned(),
        fell_back: text.fell_back(),
        rules: text.rules_fired(),
        prefilled: done.stats,
        first_token: first_token.unwrap_or_default(),
        decode: decode_start.elapsed(),
        generated,
    })
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
