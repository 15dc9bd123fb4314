//! The generation engine's one owner: a thread holding the model, tokenizer, chat template,
//! chunk KV store and prefix cache, serving jobs from a bounded queue one at a time and
//! streaming each job's tokens back over its own channel. A job whose receiver is gone (the
//! client left) stops at the next token. When no job is waiting, the engine computes and
//! stores the KV of newly indexed chunks (the chunk KV stage of ingestion), one chunk at a
//! time, so a job waits behind at most one chunk's prefill.
//!
//! Continuous batching across sequences is a later step: a job runs alone from prefill to
//! its last token.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engram_fusion::{
    chunk_tokens, fused_prefill, rag_frame, rag_prompt, ChunkStore, FusedPrompt, GateLimits,
    Policy, PrefixCache, DEFAULT_SYSTEM,
};
use engram_kvstore::{DramTier, IoMode, KvDtype, KvStore, NvmeOptions, NvmeTier};
use engram_model::{Logits, Model, Sampler, SamplingParams};
use engram_tokenizer::{ChatTemplate, Detokenizer, Message, Tokenizer};
use tokio::sync::mpsc;

use crate::error::{ApiError, Result, ServerError};
use crate::kbtask::KvWork;
use crate::metrics::Metrics;

/// Seconds a client told "queue full" should wait: about one short answer on a small CPU.
pub const RETRY_AFTER_S: u64 = 2;
/// Tokens buffered per job between the engine and the HTTP response: enough that a slow
/// reader does not stall the engine on every token, small enough to notice a gone client.
const TOKEN_BUFFER: usize = 64;

/// What the engine is started with.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    pub llm: PathBuf,
    pub threads: usize,
    pub kv_dir: PathBuf,
    pub kv_dram_mib: u64,
    pub kv_nvme_gib: u64,
    pub kv_dtype: KvDtype,
    pub prefix_cache_mib: u64,
    pub policy: Policy,
    pub gate_max_kl: f64,
    pub queue_depth: usize,
}

/// The prompt of a job.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// Question answering over retrieved passages, through fused prefill.
    Rag {
        question: String,
        passages: Vec<String>,
    },
    /// A plain chat (OpenAI without retrieval): the template over the messages.
    Chat { messages: Vec<(String, String)> },
}

/// One generation request.
pub struct Job {
    pub prompt: Prompt,
    pub max_tokens: usize,
    pub temperature: f32,
    pub seed: u64,
    /// `None`: the configured policy.
    pub policy: Option<Policy>,
    /// Metrics label: `qa` or `chat`.
    pub kind: &'static str,
    events: mpsc::Sender<Event>,
    enqueued: Instant,
}

/// What a job streams back.
#[derive(Debug)]
pub enum Event {
    Token(String),
    Done(Summary),
    Error(ApiError),
}

/// The end of a job.
#[derive(Clone, Debug)]
pub struct Summary {
    pub policy: String,
    pub fusion_disabled: Option<String>,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// `stop` (end of generation) or `length` (max_tokens or the context reached).
    pub finish_reason: &'static str,
    pub timings: serde_json::Value,
}

/// Facts about the loaded model, fixed at start.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    pub model_id: String,
    pub context_length: usize,
    pub kv_tiers: Vec<&'static str>,
    /// The stored chunk KV was computed for another model or frame (or there is no record of
    /// which): every chunk's KV should be computed again in the background.
    pub kv_model_changed: bool,
}

/// The file under the KV directory that records which model and frame the stored chunk KV
/// belongs to (the hex `ChunkStore` fingerprint).
pub const KV_MODEL_RECORD: &str = "chunk-kv-model";

/// Whether the KV directory's record names another store fingerprint than `fp`; records `fp`
/// (crash-safe rename) so the re-precompute is scheduled once per change.
fn kv_model_changed(dir: &std::path::Path, fp: &engram_kvstore::ModelFingerprint) -> bool {
    let hex: String = fp.0.iter().map(|b| format!("{b:02x}")).collect();
    let path = dir.join(KV_MODEL_RECORD);
    let recorded = std::fs::read_to_string(&path).ok();
    if recorded.as_deref().map(str::trim) == Some(hex.as_str()) {
        return false;
    }
    let tmp = path.with_extension("tmp");
    let written = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&tmp, &hex))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = written {
        tracing::warn!(
            "cannot record the chunk KV model in {}: {e}",
            path.display()
        );
    }
    if let Some(old) = recorded {
        tracing::info!(old = old.trim(), new = %hex, "model or frame changed: chunk KV will be recomputed in the background");
    }
    true
}

/// A cheap, cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Job>,
    depth: usize,
    metrics: Arc<Metrics>,
    pub info: Arc<EngineInfo>,
}

impl EngineHandle {
    /// Loads the model and the tiers on a new thread; returns once it is ready.
    pub fn spawn(
        opts: EngineOptions,
        metrics: Arc<Metrics>,
        kv_work: mpsc::UnboundedReceiver<KvWork>,
    ) -> Result<(EngineHandle, std::thread::JoinHandle<()>)> {
        let (tx, rx) = mpsc::channel::<Job>(opts.queue_depth);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let m = metrics.clone();
        let depth = opts.queue_depth;
        let join = std::thread::Builder::new()
            .name("engram-engine".into())
            .spawn(move || match Engine::load(&opts, m) {
                Ok(mut engine) => {
                    // The fidelity gate of the configured policy runs before the engine says
                    // it is ready, so no request pays for it.
                    if let Err(e) = engine.gated(opts.policy) {
                        tracing::warn!("fidelity gate for {}: {e}", opts.policy);
                    }
                    let mut info = engine.info();
                    info.kv_model_changed =
                        kv_model_changed(&opts.kv_dir, &engine.store.fingerprint());
                    let _ = ready_tx.send(Ok(info));
                    engine.run(rx, kv_work);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|e| ServerError::io("spawning", "engram-engine thread", e))?;
        let info = ready_rx.recv().map_err(|_| ServerError::Profile {
            reason: "the engine thread died while loading".into(),
        })??;
        Ok((
            EngineHandle {
                tx,
                depth,
                metrics,
                info: Arc::new(info),
            },
            join,
        ))
    }

    /// Queues a job; 429 `overloaded` when the queue is full. Returns the job's events.
    #[allow(clippy::too_many_arguments)]
    pub fn submit(
        &self,
        kind: &'static str,
        prompt: Prompt,
        max_tokens: usize,
        temperature: f32,
        seed: u64,
        policy: Option<Policy>,
    ) -> std::result::Result<mpsc::Receiver<Event>, ApiError> {
        let (events, rx) = mpsc::channel(TOKEN_BUFFER);
        let job = Job {
            prompt,
            max_tokens,
            temperature,
            seed,
            policy,
            kind,
            events,
            enqueued: Instant::now(),
        };
        match self.tx.try_send(job) {
            Ok(()) => {
                self.metrics.queue_depth.inc();
                Ok(rx)
            }
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.metrics
                    .rejected
                    .with_label_values(&["queue_full"])
                    .inc();
                Err(ApiError::Overloaded {
                    depth: self.depth,
                    retry_after_s: RETRY_AFTER_S,
                })
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Err(ApiError::Unavailable {
                reason: "the engine is shut down".into(),
            }),
        }
    }

    pub fn is_running(&self) -> bool {
        !self.tx.is_closed()
    }
}

/// Collects a job's events into (answer, summary).
pub async fn collect(
    mut rx: mpsc::Receiver<Event>,
) -> std::result::Result<(String, Summary), ApiError> {
    let mut answer = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Token(t) => answer.push_str(&t),
            Event::Done(s) => return Ok((answer, s)),
            Event::Error(e) => return Err(e),
        }
    }
    Err(ApiError::internal("the engine dropped the job"))
}

struct Engine {
    model: Model,
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    store: ChunkStore,
    prefixes: PrefixCache,
    opts: EngineOptions,
    metrics: Arc<Metrics>,
    /// Policy asked -> policy used, and why fusion is off when the gate failed.
    gates: HashMap<String, (Policy, Option<String>)>,
    last_kv: engram_kvstore::StoreMetrics,
}

impl Engine {
    fn load(opts: &EngineOptions, metrics: Arc<Metrics>) -> Result<Engine> {
        let model = Model::load(&opts.llm, opts.threads)?;
        let meta = model.gguf().metadata();
        let tokenizer = Tokenizer::from_gguf(meta)?;
        let template = ChatTemplate::from_gguf(meta)?;
        let dram = (opts.kv_dram_mib > 0).then(|| DramTier::new(opts.kv_dram_mib << 20));
        let nvme = if opts.kv_nvme_gib > 0 {
            Some(NvmeTier::open(
                &opts.kv_dir,
                NvmeOptions {
                    budget_bytes: opts.kv_nvme_gib << 30,
                    io: IoMode::Auto,
                    direct: true,
                },
            )?)
        } else {
            None
        };
        let frame = rag_frame(&tokenizer, template.as_ref())?;
        let store = ChunkStore::new(
            Arc::new(KvStore::new(dram, nvme)),
            &model,
            frame,
            opts.kv_dtype,
        );
        Ok(Engine {
            prefixes: PrefixCache::new(opts.prefix_cache_mib << 20),
            model,
            tokenizer,
            template,
            store,
            opts: opts.clone(),
            metrics,
            gates: HashMap::new(),
            last_kv: Default::default(),
        })
    }

    fn info(&self) -> EngineInfo {
        let mut kv_tiers = Vec::new();
        if self.store.store().dram().is_some() {
            kv_tiers.push("dram");
        }
        if self.store.store().nvme().is_some() {
            kv_tiers.push("nvme");
        }
        EngineInfo {
            model_id: self
                .opts
                .llm
                .file_stem()
                .map_or_else(|| "engram".into(), |s| s.to_string_lossy().into_owned()),
            context_length: self.model.config().context_length,
            kv_tiers,
            kv_model_changed: false,
        }
    }

    /// Jobs first; chunk KV work only when no job waits; blocks on both when idle. Stops
    /// when every handle is gone (chunk KV work left then is only a cache not yet filled).
    fn run(mut self, mut rx: mpsc::Receiver<Job>, mut kv: mpsc::UnboundedReceiver<KvWork>) {
        enum Next {
            Job(Option<Job>),
            Kv(Option<KvWork>),
        }
        // Only to wait on two channels at once; nothing runs on it.
        let waiter = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a current-thread runtime builds");
        let mut chunks: VecDeque<String> = VecDeque::new();
        let mut kv_open = true;
        loop {
            let next = match rx.try_recv() {
                Ok(job) => Next::Job(Some(job)),
                Err(mpsc::error::TryRecvError::Disconnected) => Next::Job(None),
                Err(mpsc::error::TryRecvError::Empty) => {
                    if let Some(text) = chunks.pop_front() {
                        self.precompute(&text);
                        continue;
                    }
                    match kv.try_recv() {
                        Ok(w) => Next::Kv(Some(w)),
                        Err(_) => waiter.block_on(async {
                            tokio::select! {
                                biased;
                                j = rx.recv() => Next::Job(j),
                                w = kv.recv(), if kv_open => Next::Kv(w),
                            }
                        }),
                    }
                }
            };
            match next {
                Next::Job(Some(job)) => self.handle(job),
                Next::Job(None) => break,
                Next::Kv(Some(w)) => chunks.extend(w),
                Next::Kv(None) => kv_open = false,
            }
        }
        tracing::info!("engine stopped");
    }

    fn handle(&mut self, job: Job) {
        self.metrics.queue_depth.dec();
        if job.events.is_closed() {
            tracing::info!("job cancelled while queued");
            return;
        }
        let events = job.events.clone();
        if let Err(e) = self.serve(job) {
            let _ = events.blocking_send(Event::Error(e));
        }
        let now = self.store.store().metrics();
        self.metrics.record_kv(&now, &self.last_kv);
        self.last_kv = now;
    }

    /// The chunk KV stage for one chunk: computes and stores its KV unless a tier holds it
    /// (the key is the one a question over this chunk looks up). Failures are logged: the
    /// chunk is then computed when a question first needs it.
    fn precompute(&mut self, text: &str) {
        self.metrics
            .ingest_pending
            .with_label_values(&["chunk_kv"])
            .dec();
        let computed = chunk_tokens(&self.tokenizer, text)
            .map_err(|e| e.to_string())
            .and_then(|ids| {
                self.store
                    .ensure(&self.model, &ids)
                    .map_err(|e| e.to_string())
            });
        match computed {
            Ok(c) => self
                .metrics
                .ingested
                .with_label_values(&[if c { "kv_computed" } else { "kv_present" }])
                .inc(),
            Err(e) => tracing::warn!("chunk KV precompute: {e}"),
        }
    }

    /// The policy to use after the fidelity gate (run once per policy, recorded next to the
    /// NVMe tier), as `engram ask` does.
    fn gated(&mut self, asked: Policy) -> std::result::Result<(Policy, Option<String>), ApiError> {
        if asked == Policy::Full {
            return Ok((Policy::Full, None));
        }
        if let Some(g) = self.gates.get(&asked.name()) {
            return Ok(g.clone());
        }
        let limits = GateLimits {
            max_mean_kl: self.opts.gate_max_kl,
            ..GateLimits::default()
        };
        let report = engram_fusion::recorded_gate(
            &self.model,
            &self.tokenizer,
            self.template.as_ref(),
            &self.store,
            asked,
            limits,
            &self.opts.kv_dir,
        )?;
        let g = if report.passed {
            tracing::info!(policy = %asked, mean_kl = report.mean_kl, "fidelity gate passed");
            (asked, None)
        } else {
            let reason = report
                .reason
                .unwrap_or_else(|| "fidelity gate failed".into());
            tracing::warn!(policy = %asked, %reason, "fusion disabled; using full prefill");
            (Policy::Full, Some(reason))
        };
        self.gates.insert(asked.name(), g.clone());
        Ok(g)
    }

    fn chat_prompt(
        &self,
        messages: &[(String, String)],
    ) -> std::result::Result<FusedPrompt, ApiError> {
        let text = match &self.template {
            Some(t) => t
                .render(
                    &messages
                        .iter()
                        .map(|(r, c)| Message::new(r.as_str(), c.as_str()))
                        .collect::<Vec<_>>(),
                    true,
                )
                .map_err(|e| ApiError::invalid("messages", e.to_string()))?,
            None => {
                let mut s: String = messages
                    .iter()
                    .map(|(r, c)| format!("{r}: {c}\n"))
                    .collect();
                s.push_str("assistant:");
                s
            }
        };
        let mut tokens = self
            .tokenizer
            .encode(&text, true)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
        if let Some(bos) = self.tokenizer.bos_id().filter(|_| self.tokenizer.add_bos()) {
            if tokens.first() != Some(&bos) {
                tokens.insert(0, bos);
            }
        }
        let Some(last) = tokens.pop() else {
            return Err(ApiError::invalid("messages", "the prompt is empty"));
        };
        // Everything but the last token is a prefix the prefix cache can serve next turn.
        Ok(FusedPrompt {
            prefix: tokens,
            chunks: Vec::new(),
            suffix: vec![last],
        })
    }

    fn serve(&mut self, job: Job) -> std::result::Result<(), ApiError> {
        let started = Instant::now();
        let (prompt, policy, fusion_disabled) = match &job.prompt {
            Prompt::Rag { question, passages } => {
                let (policy, off) = self.gated(job.policy.unwrap_or(self.opts.policy))?;
                let chunks = passages
                    .iter()
                    .map(|p| chunk_tokens(&self.tokenizer, p))
                    .collect::<engram_tokenizer::Result<Vec<_>>>()
                    .map_err(|e| ApiError::invalid("passages", e.to_string()))?;
                let p = rag_prompt(
                    &self.tokenizer,
                    self.template.as_ref(),
                    DEFAULT_SYSTEM,
                    chunks,
                    question,
                )
                .map_err(|e| ApiError::invalid("question", e.to_string()))?;
                (p, policy, off)
            }
            Prompt::Chat { messages } => (self.chat_prompt(messages)?, Policy::Full, None),
        };
        let context = self.model.config().context_length;
        if prompt.len() >= context {
            return Err(engram_fusion::FusionError::TooLong {
                tokens: prompt.len(),
                context,
            }
            .into());
        }
        let max_tokens = job.max_tokens.min(context - prompt.len());
        let mut kv = self.model.new_cache(prompt.len() + max_tokens + 1);
        let done = fused_prefill(
            &self.model,
            &self.store,
            Some(&self.prefixes),
            &prompt,
            policy,
            &mut kv,
        )?;
        let mut sampler = Sampler::new(SamplingParams {
            temperature: job.temperature,
            seed: job.seed,
            ..SamplingParams::default()
        })
        .map_err(|e| ApiError::invalid("temperature", e.to_string()))?;
        let mut history = prompt.tokens();
        let mut detok = Detokenizer::new(&self.tokenizer, true);
        let mut logits = done.logits;
        let decode_start = Instant::now();
        let mut first_token: Option<Duration> = None;
        let mut generated = 0;
        let mut finish_reason = "length";
        for (i, pos) in (done.next_position..).take(max_tokens).enumerate() {
            let id = sampler.sample(&logits, &history);
            if first_token.is_none() {
                first_token = Some(started.elapsed());
                self.metrics
                    .ttft
                    .with_label_values(&[job.kind])
                    .observe(job.enqueued.elapsed().as_secs_f64());
            }
            if self.tokenizer.is_eog(id) {
                finish_reason = "stop";
                break;
            }
            generated += 1;
            history.push(id);
            let piece = detok.push(id);
            if !piece.is_empty() && job.events.blocking_send(Event::Token(piece)).is_err() {
                tracing::info!(generated, "client gone; generation cancelled");
                return Ok(());
            }
            if i + 1 < max_tokens {
                logits = self
                    .model
                    .forward(&[id], &[pos], &mut kv, Logits::Last)
                    .map_err(ApiError::internal)?;
            }
        }
        let tail = detok.finish();
        if !tail.is_empty() && job.events.blocking_send(Event::Token(tail)).is_err() {
            return Ok(());
        }
        self.metrics
            .generated_tokens
            .with_label_values(&[job.kind])
            .inc_by(generated as u64);
        let s = &done.stats;
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let mut timings = s.timings_json();
        timings.insert(
            "queue_ms".into(),
            ms(started.duration_since(job.enqueued)).into(),
        );
        timings.insert("first_token_ms".into(), first_token.map_or(0.0, ms).into());
        timings.insert("decode_ms".into(), ms(decode_start.elapsed()).into());
        timings.insert("generated_tokens".into(), generated.into());
        let timings = serde_json::Value::Object(timings);
        let _ = job.events.blocking_send(Event::Done(Summary {
            policy: policy.name(),
            fusion_disabled,
            prompt_tokens: prompt.len(),
            generated_tokens: generated,
            finish_reason,
            timings,
        }));
        Ok(())
    }
}

#[cfg(test)]
mod kv_record_tests {
    use super::*;

    #[test]
    fn a_changed_store_fingerprint_is_reported_once() {
        let dir = std::env::temp_dir().join(format!("engram-kv-record-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let a = engram_kvstore::ModelFingerprint([1; 16]);
        let b = engram_kvstore::ModelFingerprint([2; 16]);
        assert!(kv_model_changed(&dir, &a), "no record yet");
        assert!(!kv_model_changed(&dir, &a), "recorded");
        assert!(kv_model_changed(&dir, &b), "another model");
        assert!(!kv_model_changed(&dir, &b));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
