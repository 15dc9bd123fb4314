//! The generation engine's one owner: a thread holding the model, tokenizer, chat template,
//! chunk KV store and prefix cache. It serves jobs from a bounded queue with continuous
//! batching and streams each job's tokens back over its own channel:
//!
//! - up to `max_batch` sequences decode together, one [`Model::forward_batch`] per step, so a
//!   step of eight sequences reads the weights once instead of eight times;
//! - a waiting job joins the batch between two steps: its prompt is prefilled (fused) in
//!   pieces of [`INTERLEAVE_PIECE`] tokens with a decode step of the batch between pieces, so
//!   a long prompt delays the others' next token by one piece, not by the whole prompt;
//! - a sequence leaves the batch at its end, at `max_tokens`, or when its receiver is gone (the
//!   client left), and its cache is freed at once.
//!
//! When no job is waiting or running, the engine computes and stores the KV of newly indexed
//! chunks (the chunk KV stage of ingestion), one chunk at a time, so a job waits behind at most
//! one chunk's prefill.

use std::cell::{OnceCell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engram_fusion::{
    chunk_tokens, fused_prefill_on, rag_frame, ChunkStore, Ensured, FusedPrompt, GateLimits,
    Interleave, Policy, PrefixCache, DEFAULT_LAYOUT, DEFAULT_SYSTEM,
};
use engram_grammar::{Constrained, Grammar, TokenTrie};
use engram_kvstore::{DramTier, KvDtype, KvStore, NvmeTier};
use engram_model::{Logits, Model, Sampler, SamplingParams};
use engram_rag::{no_answer, rag_prompt_with, AnswerOptions, Answering, CopyBias, OutputText};

use crate::decode::{Decoder, SeqKv};
use engram_tokenizer::{ChatTemplate, Detokenizer, Message, Tokenizer};
use tokio::sync::mpsc;

use crate::error::{ApiError, Result, ServerError};
use crate::kbtask::KvWork;
use crate::metrics::Metrics;

/// Seconds a client told "queue full" should wait: about one short answer on a small CPU.
pub const RETRY_AFTER_S: u64 = 2;
/// Events a job can send beyond one per generated token (the prompt's log probabilities, the
/// detokenizer's tail, the summary, an error): a job's channel holds all of its events, so the
/// engine never waits on a slow reader (the memory is bounded by `max_tokens`).
const EXTRA_EVENTS: usize = 5;
/// Prompt tokens prefilled between two decode steps of the running batch: about half a second
/// on 2 cores with the default model, the longest pause a running stream sees when a long
/// prompt joins.
pub const INTERLEAVE_PIECE: usize = 128;

/// What the engine is started with.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    pub llm: PathBuf,
    pub threads: usize,
    /// Where the fidelity gate's record lives (next to the NVMe tier).
    pub kv_dir: PathBuf,
    pub kv_dram_mib: u64,
    /// The NVMe tier, opened by the daemon (which also asks it to make room on a low disk).
    pub nvme: Option<Arc<NvmeTier>>,
    pub kv_dtype: KvDtype,
    pub prefix_cache_mib: u64,
    pub policy: Policy,
    pub gate_max_kl: f64,
    /// A RAG answer's copy bias when the job does not set one (`engram_rag::CopyBias`).
    pub copy_bias: f32,
    /// Whether a RAG answer's start is checked against the evidence sentence
    /// (`engram_rag::OutputText::check_start`).
    pub check_start: bool,
    /// Answer rules turned off (`[answers] rules_off`).
    pub rules_off: engram_rag::AnswerRules,
    pub queue_depth: usize,
    /// Sequences decoded together at most (the profile's `batch_size`).
    pub max_batch: usize,
    /// Decode on a GPU when one is found and passes the check (`[gpu] serving = "auto"`).
    pub gpu: bool,
    /// Where compiled GPU kernels are kept between starts.
    pub kernel_cache: Option<PathBuf>,
}

/// The prompt of a job.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// Question answering over retrieved passages, through fused prefill. Without passages
    /// (nothing relevant was retrieved) the answer says so without running the model.
    Rag {
        question: String,
        passages: Vec<String>,
        /// The evidence sentence chosen by the embedder (`engram_rag::ground`); `None`: by the
        /// question's terms.
        evidence: Option<String>,
    },
    /// A plain chat (OpenAI without retrieval): the template over the messages.
    Chat { messages: Vec<(String, String)> },
    /// Text continued as it is (OpenAI's completions): no template; special tokens written
    /// in it are parsed, and BOS is added when the model wants it, as llama.cpp does.
    Text { text: String },
    /// The model's token ids continued as they are (OpenAI's completions with a token
    /// array, as scoring harnesses send): no template, no BOS added.
    Tokens { ids: Vec<u32> },
}

/// One generation request.
pub struct Job {
    pub prompt: Prompt,
    pub max_tokens: usize,
    pub sampling: Sampling,
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
    /// With `Sampling::logprobs`: the tokens generated since the last `Token`, sent just before
    /// the `Token` their text completes (or before `Done`, for tokens whose text never went
    /// out: a stop string's, an end the answer's cleanup dropped).
    Logprobs(Vec<TokenLogprob>),
    Done(Summary),
    Error(ApiError),
}

/// One generated token's log probability (OpenAI's `logprobs`), under the distribution it was
/// drawn from before temperature, nucleus, penalties and bias (the model's, with a RAG
/// answer's copy bias and a grammar's mask applied), and the most likely tokens there.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token's bytes (a piece of a UTF-8 character for some tokens).
    pub bytes: Vec<u8>,
    pub logprob: f32,
    /// The `Sampling::logprobs` most likely tokens, most likely first.
    pub top: Vec<(Vec<u8>, f32)>,
}

/// How a job picks its tokens and when it ends early: greedy at temperature 0, else sampled
/// (nucleus `top_p`, 1 disables) from a generator seeded with `seed`, after OpenAI's
/// `logit_bias` and presence and frequency penalties (see [`SamplingParams`]); the answer ends
/// before the first of `stops` that appears in its text. With a `grammar`, only tokens that keep the
/// output inside it are sampled, and the answer ends when the grammar is complete. In a RAG
/// answer without a grammar, a number or a character goes on as the passages write it
/// (`copy_bias`, `None`: the configured one; see `engram_rag::CopyBias`).
#[derive(Clone, Debug)]
pub struct Sampling {
    pub temperature: f32,
    pub top_p: f32,
    pub seed: u64,
    pub stops: Vec<String>,
    pub grammar: Option<Arc<Grammar>>,
    pub copy_bias: Option<f32>,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub logit_bias: Vec<(u32, f32)>,
    /// `Some(n)`: send each generated token's log probability and its `n` most likely
    /// alternatives ([`Event::Logprobs`]).
    pub logprobs: Option<usize>,
    /// `Some(n)` (a [`Prompt::Text`] or [`Prompt::Tokens`] only): first send the prompt's
    /// tokens, each with its log probability given the tokens before it and its `n` most
    /// likely alternatives, in one [`Event::Logprobs`] (OpenAI's `echo` with `logprobs`). The
    /// first token has none: its `logprob` is NaN and its `top` empty. A BOS the engine added
    /// is not one of them.
    pub prompt_logprobs: Option<usize>,
}

impl Sampling {
    pub fn new(temperature: f32, seed: u64) -> Sampling {
        Sampling {
            temperature,
            top_p: 1.0,
            seed,
            stops: Vec::new(),
            grammar: None,
            copy_bias: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
        }
    }
}

/// The end of a job.
#[derive(Clone, Debug)]
pub struct Summary {
    /// The fusion policy the prefill ran under (`full` when fusion did not apply), or
    /// [`NO_PREFILL`].
    pub policy: String,
    pub fusion_disabled: Option<String>,
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache (OpenAI's `cached_tokens`).
    pub cached_tokens: usize,
    pub generated_tokens: usize,
    /// `stop` (end of generation) or `length` (max_tokens or the context reached).
    pub finish_reason: &'static str,
    pub timings: serde_json::Value,
}

/// [`Summary::policy`] of an answer no model wrote: no retrieved passage was about the
/// question, and the answer is "I don't know" without a prefill.
pub const NO_PREFILL: &str = "none";

/// Facts about the loaded model, fixed at start.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    pub model_id: String,
    pub context_length: usize,
    /// Token ids the model has (what `logit_bias` may name).
    pub vocab_size: usize,
    pub kv_tiers: Vec<&'static str>,
    /// The stored chunk KV was computed for another model or frame (or there is no record of
    /// which): every chunk's KV should be computed again in the background.
    pub kv_model_changed: bool,
    /// Where generation runs.
    pub serving: crate::decode::Serving,
}

/// A cheap, cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Job>,
    depth: usize,
    metrics: Arc<Metrics>,
    /// The model's tokenizer, for text the API builds from token ids.
    tokenizer: Arc<Tokenizer>,
    pub info: Arc<EngineInfo>,
}

impl EngineHandle {
    /// Loads the model and the tiers on a new thread; returns once it is ready.
    pub fn spawn(
        opts: EngineOptions,
        metrics: Arc<Metrics>,
        kv_work: mpsc::Receiver<KvWork>,
        kv_done: mpsc::UnboundedSender<u64>,
    ) -> Result<(EngineHandle, std::thread::JoinHandle<()>)> {
        let (tx, rx) = mpsc::channel::<Job>(opts.queue_depth);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let m = metrics.clone();
        let depth = opts.queue_depth;
        let join = std::thread::Builder::new()
            .name("engram-engine".into())
            .spawn(move || match Engine::load(&opts, m) {
                Ok(engine) => {
                    // The fidelity gate of the configured policy runs before the engine says
                    // it is ready, so no request pays for it.
                    if let Err(e) = engine.gated(opts.policy) {
                        tracing::warn!("fidelity gate for {}: {e}", opts.policy);
                    }
                    let mut info = engine.info();
                    info.kv_model_changed = match engine.store.record_fingerprint() {
                        Ok(changed) => changed,
                        Err(e) => {
                            tracing::warn!("cannot record the chunk KV model: {e}");
                            false
                        }
                    };
                    if info.kv_model_changed {
                        tracing::info!(
                            "model or frame changed: chunk KV will be recomputed in the background"
                        );
                    }
                    let _ = ready_tx.send(Ok((info, engine.tokenizer.clone())));
                    engine.run(rx, kv_work, kv_done);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|e| ServerError::io("spawning", "engram-engine thread", e))?;
        let (info, tokenizer) = ready_rx.recv().map_err(|_| ServerError::Profile {
            reason: "the engine thread died while loading".into(),
        })??;
        Ok((
            EngineHandle {
                tx,
                depth,
                metrics,
                tokenizer: Arc::new(tokenizer),
                info: Arc::new(info),
            },
            join,
        ))
    }

    /// Jobs the engine's queue holds: a request of more choices than this can never be queued.
    pub fn queue_depth(&self) -> usize {
        self.depth
    }

    /// The text of the model's token ids, special tokens written out (as a token prompt
    /// echoes); an id outside the vocabulary gives nothing.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, false)
    }

    /// Queues a job; 429 `overloaded` when the queue is full. Returns the job's events.
    pub fn submit(
        &self,
        kind: &'static str,
        prompt: Prompt,
        max_tokens: usize,
        sampling: Sampling,
        policy: Option<Policy>,
    ) -> std::result::Result<mpsc::Receiver<Event>, ApiError> {
        // With log probabilities, each `Token` may follow a `Logprobs`.
        let per_token = if sampling.logprobs.is_some() { 2 } else { 1 };
        let (events, rx) = mpsc::channel(
            max_tokens
                .saturating_mul(per_token)
                .saturating_add(EXTRA_EVENTS),
        );
        if let Prompt::Rag {
            question, passages, ..
        } = &prompt
        {
            if passages.is_empty() {
                let _ = events.try_send(Event::Token(no_answer(question).to_owned()));
                let _ = events.try_send(Event::Done(Summary {
                    // No prefill ran, under any policy: the answer is the fixed one.
                    policy: NO_PREFILL.to_owned(),
                    fusion_disabled: None,
                    prompt_tokens: 0,
                    cached_tokens: 0,
                    generated_tokens: 0,
                    finish_reason: "stop",
                    timings: serde_json::json!({"no_relevant_passages": true}),
                }));
                return Ok(rx);
            }
        }
        let job = Job {
            prompt,
            max_tokens,
            sampling,
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
    rx: mpsc::Receiver<Event>,
) -> std::result::Result<(String, Summary), ApiError> {
    collect_logprobs(rx)
        .await
        .map(|(answer, sum, _)| (answer, sum))
}

/// [`collect`], with the log probabilities of the tokens generated (none unless the job asked
/// for them).
pub async fn collect_logprobs(
    mut rx: mpsc::Receiver<Event>,
) -> std::result::Result<(String, Summary, Vec<TokenLogprob>), ApiError> {
    let mut answer = String::new();
    let mut logprobs = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Token(t) => answer.push_str(&t),
            Event::Logprobs(l) => logprobs.extend(l),
            Event::Done(s) => return Ok((answer, s, logprobs)),
            Event::Error(e) => return Err(e),
        }
    }
    Err(ApiError::internal("the engine dropped the job"))
}

struct Engine {
    model: Arc<Model>,
    /// Where sequences decode (the CPU, or a GPU).
    decoder: Decoder,
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    store: ChunkStore,
    prefixes: PrefixCache,
    opts: EngineOptions,
    metrics: Arc<Metrics>,
    /// Policy asked -> policy used, and why fusion is off when the gate failed.
    gates: RefCell<HashMap<String, (Policy, Option<String>)>>,
    last_kv: RefCell<(engram_kvstore::StoreMetrics, engram_fusion::ChunkCounts)>,
    /// The vocabulary's bytes as a trie, built at the first constrained job.
    trie: OnceCell<Arc<TokenTrie>>,
}

/// `tokens` run as they are, with no passages: everything but the last token is a prefix the
/// prefix cache can serve next turn. Errors name `field`.
fn plain_prompt(mut tokens: Vec<u32>, field: &str) -> std::result::Result<FusedPrompt, ApiError> {
    let Some(last) = tokens.pop() else {
        return Err(ApiError::invalid(field, "the prompt is empty"));
    };
    Ok(FusedPrompt {
        prefix: tokens,
        chunks: Vec::new(),
        suffix: vec![last],
        evidence: 0..0,
        evidence_text: String::new(),
    })
}

/// A sampling parameter [`SamplingParams::validate`] refused, as a 400 naming it.
pub fn sampling_error(e: engram_model::ModelError) -> ApiError {
    let param = match &e {
        engram_model::ModelError::Sampling { name, .. } => *name,
        _ => "sampling",
    };
    ApiError::invalid(param, e.to_string())
}

/// A job in the decode batch: its own cache, sampler and output state.
struct Active<'t> {
    job: Job,
    kv: SeqKv,
    sampler: Sampler,
    /// Prompt and generated tokens (the repetition penalty looks at them).
    history: Vec<u32>,
    detok: Detokenizer<'t>,
    /// The text on its way out: stop strings, and for a RAG answer its cleaned start and the
    /// repetition stop.
    out: OutputText,
    /// The grammar the output is held to, if the job has one.
    constrained: Option<Constrained>,
    /// A RAG answer's bias towards its passages' spelling.
    copy: Option<CopyBias>,
    /// The logits the next token is sampled from.
    logits: Vec<f32>,
    /// Log probabilities of tokens whose text has not gone out yet (with `Sampling::logprobs`).
    logprobs: Vec<TokenLogprob>,
    /// The last sampled token, fed at `position` by the next step.
    pending: u32,
    position: i32,
    max_tokens: usize,
    generated: usize,
    /// When the engine took the job, when its decode began, its time to first token.
    started: Instant,
    decode_start: Instant,
    first_token: Option<Duration>,
    /// When the first text went out: after the first token for most answers, later where a
    /// RAG answer's start is held back until its checks decide
    /// (`engram_rag::OutputText`).
    first_visible: Option<Duration>,
    policy: Policy,
    fusion_disabled: Option<String>,
    prompt_tokens: usize,
    stats: engram_fusion::FuseStats,
}

/// What sampling one token did to a sequence.
enum Advance {
    /// Feed `pending` at the next step.
    Continue,
    /// The sequence is complete (`stop` or `length`).
    Finished(&'static str),
    /// The client is gone.
    Cancelled,
}

impl Engine {
    fn load(opts: &EngineOptions, metrics: Arc<Metrics>) -> Result<Engine> {
        let model = Arc::new(Model::load(&opts.llm, opts.threads)?);
        let decoder = Decoder::open(
            &model,
            opts.gpu,
            opts.max_batch,
            model.config().context_length,
            opts.kernel_cache.as_deref(),
        );
        match &decoder.serving.reason {
            None => tracing::info!(
                device = %decoder.serving.device,
                placement = decoder.serving.placement.as_deref().unwrap_or(""),
                "generation decodes on the GPU"
            ),
            Some(r) => tracing::info!(reason = %r, "generation runs on the CPU"),
        }
        let meta = model.gguf().metadata();
        let tokenizer = Tokenizer::from_gguf(meta)?;
        let template = ChatTemplate::from_gguf(meta)?;
        let dram = (opts.kv_dram_mib > 0).then(|| DramTier::new(opts.kv_dram_mib << 20));
        let frame = rag_frame(&tokenizer, template.as_ref())?;
        let store = ChunkStore::new(
            Arc::new(KvStore::with_shared_nvme(dram, opts.nvme.clone())),
            &model,
            frame,
            opts.kv_dtype,
        );
        Ok(Engine {
            prefixes: PrefixCache::new(opts.prefix_cache_mib << 20),
            model,
            decoder,
            tokenizer,
            template,
            store,
            opts: opts.clone(),
            metrics,
            gates: RefCell::new(HashMap::new()),
            last_kv: Default::default(),
            trie: OnceCell::new(),
        })
    }

    /// The vocabulary trie constrained jobs are masked with (control tokens never allowed;
    /// the end-of-generation ones once the output is complete).
    fn trie(&self) -> Arc<TokenTrie> {
        self.trie
            .get_or_init(|| {
                let t = &self.tokenizer;
                let n = t.vocab_size() as u32;
                let tokens = (0..n)
                    .filter(|&id| !t.is_special(id) && !t.is_eog(id))
                    .map(|id| (id, t.token_piece(id)));
                Arc::new(TokenTrie::new(tokens, t.eog_ids(), t.vocab_size()))
            })
            .clone()
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
            vocab_size: self.model.config().vocab_size,
            kv_tiers,
            kv_model_changed: false,
            serving: self.decoder.serving.clone(),
        }
    }

    /// The scheduler: admit one waiting job when the batch has room, run one decode step of
    /// the batch, repeat; chunk KV work only when no job waits or runs; block on both when
    /// idle. Stops when every handle is gone and the batch has finished (chunk KV work left
    /// then is only a cache not yet filled).
    fn run(
        self,
        mut rx: mpsc::Receiver<Job>,
        mut kv: mpsc::Receiver<KvWork>,
        kv_done: mpsc::UnboundedSender<u64>,
    ) {
        // A job is boxed while it is passed through here: it is several times a `KvWork`.
        enum Next {
            Job(Option<Box<Job>>),
            Kv(Option<KvWork>),
        }
        // Only to wait on two channels at once; nothing runs on it.
        let waiter = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a current-thread runtime builds");
        // Documents whose chunks wait for their KV, the front one being worked through.
        let mut chunks: VecDeque<KvWork> = VecDeque::new();
        let mut kv_open = true;
        let mut jobs_open = true;
        let mut batch: Vec<Active<'_>> = Vec::new();
        loop {
            if jobs_open && batch.len() < self.opts.max_batch.max(1) {
                match rx.try_recv() {
                    Ok(job) => {
                        if let Some(a) = self.admit(job, &mut batch) {
                            batch.push(a);
                        }
                    }
                    Err(mpsc::error::TryRecvError::Disconnected) => jobs_open = false,
                    Err(mpsc::error::TryRecvError::Empty) => {}
                }
            }
            if !batch.is_empty() {
                self.step(&mut batch);
                continue;
            }
            if !jobs_open {
                break;
            }
            if !rx.is_empty() {
                continue;
            }
            if let Some(work) = chunks.front_mut() {
                match work.texts.pop() {
                    Some(text) => self.precompute(&text),
                    None => {
                        // Every chunk of the document is stored (or was tried and logged).
                        let _ = kv_done.send(work.doc);
                        chunks.pop_front();
                    }
                }
                continue;
            }
            let next = match kv.try_recv() {
                Ok(w) => Next::Kv(Some(w)),
                Err(_) => waiter.block_on(async {
                    tokio::select! {
                        biased;
                        j = rx.recv() => Next::Job(j.map(Box::new)),
                        w = kv.recv(), if kv_open => Next::Kv(w),
                    }
                }),
            };
            match next {
                Next::Job(Some(job)) => {
                    if let Some(a) = self.admit(*job, &mut batch) {
                        batch.push(a);
                    }
                }
                Next::Job(None) => jobs_open = false,
                Next::Kv(Some(w)) => chunks.push_back(w),
                Next::Kv(None) => kv_open = false,
            }
        }
        tracing::info!("engine stopped");
    }

    /// Takes a job off the queue: prefills its prompt (decode steps of `batch` between the
    /// pieces) and samples its first token. Returns it when it goes on to decode.
    fn admit<'t>(&'t self, job: Job, batch: &mut Vec<Active<'t>>) -> Option<Active<'t>> {
        self.metrics.queue_depth.dec();
        if job.events.is_closed() {
            tracing::info!("job cancelled while queued");
            return None;
        }
        let events = job.events.clone();
        let admitted = self.start(job, batch);
        let now = (self.store.store().metrics(), self.store.counters.snapshot());
        self.metrics.record_kv(&now, &self.last_kv.borrow());
        *self.last_kv.borrow_mut() = now;
        match admitted {
            // Only the prompt was asked for (`echo` with `max_tokens` 0).
            Ok(a) if a.max_tokens == 0 => {
                self.finish(a, "length");
                None
            }
            Ok(mut a) => match self.advance(&mut a) {
                Advance::Continue => Some(a),
                Advance::Finished(reason) => {
                    self.finish(a, reason);
                    None
                }
                Advance::Cancelled => None,
            },
            Err(e) => {
                let _ = events.try_send(Event::Error(e));
                None
            }
        }
    }

    /// One decode step of every sequence in `batch`: drops the ones whose client left, runs
    /// the rest in one batched forward pass, samples each one's next token, and finishes the
    /// ones that are done.
    fn step(&self, batch: &mut Vec<Active<'_>>) {
        batch.retain(|a| {
            let gone = a.job.events.is_closed();
            if gone {
                tracing::info!(generated = a.generated, "client gone; generation cancelled");
            }
            !gone
        });
        if batch.is_empty() {
            return;
        }
        let tokens: Vec<[u32; 1]> = batch.iter().map(|a| [a.pending]).collect();
        let positions: Vec<[i32; 1]> = batch.iter().map(|a| [a.position]).collect();
        let mut seqs: Vec<(&[u32], &[i32], &mut SeqKv)> = batch
            .iter_mut()
            .zip(tokens.iter().zip(&positions))
            .map(|(a, (t, p))| (&t[..], &p[..], &mut a.kv))
            .collect();
        let t = Instant::now();
        let result = self.decoder.step(&self.model, &mut seqs, Logits::Last);
        drop(seqs);
        let n = batch.len();
        self.metrics.batch_size.observe(n as f64);
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("decode step of {n} sequences: {e}");
                for a in batch.drain(..) {
                    let _ = a.job.events.try_send(Event::Error(ApiError::internal(&e)));
                }
                return;
            }
        };
        let step_s = t.elapsed().as_secs_f64();
        let vocab = self.model.config().vocab_size;
        let mut rest = Vec::with_capacity(n);
        for (mut a, row) in batch.drain(..).zip(logits.chunks_exact(vocab)) {
            a.logits.copy_from_slice(row);
            a.position += 1;
            self.metrics
                .tpot
                .with_label_values(&[a.job.kind])
                .observe(step_s);
            match self.advance(&mut a) {
                Advance::Continue => rest.push(a),
                Advance::Finished(reason) => self.finish(a, reason),
                Advance::Cancelled => {
                    tracing::info!(generated = a.generated, "client gone; generation cancelled");
                }
            }
        }
        *batch = rest;
    }

    /// Samples a sequence's next token from its logits (among those its grammar allows) and
    /// sends its text.
    fn advance(&self, a: &mut Active<'_>) -> Advance {
        if let Some(c) = &a.copy {
            c.apply(&a.history[a.prompt_tokens..], &mut a.logits);
        }
        if let Some(c) = &mut a.constrained {
            if !c.mask(&mut a.logits) {
                // Cannot happen for a grammar that is not complete; ends it rather than loop.
                tracing::warn!("constrained generation has no allowed token");
                return Advance::Finished("stop");
            }
        }
        let id = a.sampler.sample(&a.logits, &a.history);
        if a.first_token.is_none() {
            a.first_token = Some(a.started.elapsed());
            self.metrics
                .ttft
                .with_label_values(&[a.job.kind])
                .observe(a.job.enqueued.elapsed().as_secs_f64());
        }
        if self.tokenizer.is_eog(id) {
            return Advance::Finished("stop");
        }
        if let Some(top) = a.job.sampling.logprobs {
            a.logprobs.push(self.logprob(&a.logits, id, top));
        }
        a.generated += 1;
        a.history.push(id);
        let mut finished = false;
        if let Some(c) = &mut a.constrained {
            let followed = c.accept(self.tokenizer.token_piece(id));
            debug_assert!(followed, "the mask allowed token {id}");
            finished = c.is_finished();
        }
        let (piece, ended) = a.out.push(&a.detok.push(id));
        if !piece.is_empty() {
            // Closed: the client left (the channel has room for every event of the job).
            if !a.logprobs.is_empty()
                && a.job
                    .events
                    .try_send(Event::Logprobs(std::mem::take(&mut a.logprobs)))
                    .is_err()
            {
                return Advance::Cancelled;
            }
            if a.job.events.try_send(Event::Token(piece)).is_err() {
                return Advance::Cancelled;
            }
            a.first_visible.get_or_insert_with(|| a.started.elapsed());
        }
        if ended || finished {
            return Advance::Finished("stop");
        }
        if a.generated >= a.max_tokens {
            return Advance::Finished("length");
        }
        a.pending = id;
        Advance::Continue
    }

    /// Token `id`'s log probability under `logits` (a log-softmax in f64), and the `top` most
    /// likely tokens.
    fn logprob(&self, logits: &[f32], id: u32, top: usize) -> TokenLogprob {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits
            .iter()
            .map(|&l| f64::from(l - max).exp())
            .sum::<f64>();
        let log_z = f64::from(max) + sum.ln();
        let lp = |l: f32| (f64::from(l) - log_z) as f32;
        let bytes = |t: u32| self.tokenizer.token_piece(t).to_vec();
        TokenLogprob {
            bytes: bytes(id),
            logprob: logits
                .get(id as usize)
                .map_or(f32::NEG_INFINITY, |&l| lp(l)),
            top: engram_model::top_k(logits, top)
                .into_iter()
                .map(|(t, l)| (bytes(t), lp(l)))
                // Tokens a grammar masks out are not alternatives.
                .filter(|(_, l)| l.is_finite())
                .collect(),
        }
    }

    /// Prefills `prompt` in full on the GPU: the prefix cache's part of its prefix copied into
    /// `kv` (empty, for the job's capacity) and uploaded, the rest run there; a prefix the cache
    /// did not hold is read back and kept for the next request.
    #[cfg(feature = "cuda")]
    fn prefill_on_gpu(
        &self,
        prompt: &engram_fusion::FusedPrompt,
        mut kv: engram_model::KvCache,
    ) -> std::result::Result<(SeqKv, engram_fusion::Prefilled), ApiError> {
        let started = Instant::now();
        let tokens = prompt.tokens();
        let hit = self.prefixes.lookup(&prompt.prefix);
        let cached = hit.as_ref().map_or(0, |h| h.len);
        if let Some(h) = &hit {
            kv.append_from(&h.entry.kv, 0..h.len)
                .map_err(ApiError::internal)?;
        }
        let capacity = kv.capacity();
        let (seq, logits) = self
            .decoder
            .prefill(&kv, &tokens[cached..], cached, capacity)
            .map_err(|e| ApiError::internal(format!("prefill on the GPU: {e}")))?;
        let prefix = prompt.prefix.len();
        if cached < prefix {
            match self.decoder.host_cache(&seq) {
                Ok(all) => {
                    let mut own = self.model.new_cache(prefix);
                    match own.append_from(&all, 0..prefix) {
                        Ok(_) => self.prefixes.insert(&prompt.prefix, own),
                        Err(e) => tracing::warn!("prefix KV not kept: {e}"),
                    }
                }
                Err(e) => tracing::warn!("prefix KV not read back: {e}"),
            }
        }
        let stats = engram_fusion::FuseStats {
            policy: Policy::Full.name(),
            prompt_tokens: tokens.len(),
            prefix_tokens: prefix,
            prefix_cached_tokens: cached,
            chunk_tokens: prompt.chunk_tokens(),
            recomputed_chunk_tokens: prompt.chunk_tokens(),
            suffix_tokens: prompt.suffix.len(),
            total_time: started.elapsed(),
            ..Default::default()
        };
        Ok((
            seq,
            engram_fusion::Prefilled {
                logits,
                next_position: tokens.len() as i32,
                stats,
            },
        ))
    }

    /// Whether [`text_prompt`](Self::text_prompt) added a BOS to `text`'s `tokens`.
    fn added_bos(&self, text: &str, tokens: &[u32]) -> std::result::Result<bool, ApiError> {
        let plain = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| ApiError::invalid("prompt", e.to_string()))?;
        Ok(tokens.len() == plain.len() + 1)
    }

    /// Prefills a text or token prompt's `tokens` into `kv` with every position's logits, in
    /// pieces (decode steps of the running batch between them, as `between` runs them),
    /// scoring each prompt token after the first as [`Sampling::prompt_logprobs`] says (`top`
    /// alternatives; a BOS the engine added, `added_bos`, is left out). No prefix cache: its
    /// KV would not give the logits.
    fn prefill_scored(
        &self,
        added_bos: bool,
        tokens: &[u32],
        top: usize,
        kv: &mut engram_model::KvCache,
        between: &mut dyn FnMut(),
    ) -> std::result::Result<(engram_fusion::Prefilled, Vec<TokenLogprob>), ApiError> {
        let started = Instant::now();
        let first = usize::from(added_bos);
        let vocab = self.model.config().vocab_size;
        let mut entries = Vec::with_capacity(tokens.len() - first);
        if let Some(&t) = tokens.get(first) {
            entries.push(TokenLogprob {
                bytes: self.tokenizer.token_piece(t).to_vec(),
                logprob: f32::NAN,
                top: Vec::new(),
            });
        }
        let mut last = Vec::new();
        for (i, piece) in tokens.chunks(INTERLEAVE_PIECE).enumerate() {
            if i > 0 {
                between();
            }
            let at = i * INTERLEAVE_PIECE;
            let positions: Vec<i32> = (at..at + piece.len()).map(|p| p as i32).collect();
            let logits = self
                .model
                .forward(piece, &positions, kv, Logits::All)
                .map_err(ApiError::internal)?;
            for (j, row) in logits.chunks_exact(vocab).enumerate() {
                // Row `at + j` predicts token `at + j + 1`.
                match tokens.get(at + j + 1) {
                    Some(&next) if at + j >= first => entries.push(self.logprob(row, next, top)),
                    Some(_) => {}
                    None => last = row.to_vec(),
                }
            }
        }
        let stats = engram_fusion::FuseStats {
            policy: Policy::Full.name(),
            prompt_tokens: tokens.len(),
            suffix_tokens: tokens.len(),
            suffix_time: started.elapsed(),
            total_time: started.elapsed(),
            ..Default::default()
        };
        Ok((
            engram_fusion::Prefilled {
                logits: last,
                next_position: tokens.len() as i32,
                stats,
            },
            entries,
        ))
    }

    /// Sends a finished sequence's last text and its summary.
    fn finish(&self, mut a: Active<'_>, mut finish_reason: &'static str) {
        // After a stop string nothing more goes out; else the detokenizer's and the stop
        // matcher's held text (which may still end at a stop string).
        let (tail, stopped) = a.out.finish();
        if stopped {
            finish_reason = "stop";
        }
        if !a.logprobs.is_empty()
            && a.job
                .events
                .try_send(Event::Logprobs(std::mem::take(&mut a.logprobs)))
                .is_err()
        {
            return;
        }
        if !tail.is_empty() {
            if a.job.events.try_send(Event::Token(tail)).is_err() {
                return;
            }
            a.first_visible.get_or_insert_with(|| a.started.elapsed());
        }
        self.metrics
            .generated_tokens
            .with_label_values(&[a.job.kind])
            .inc_by(a.generated as u64);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let mut timings = a.stats.timings_json();
        timings.insert(
            "queue_ms".into(),
            ms(a.started.duration_since(a.job.enqueued)).into(),
        );
        timings.insert(
            "first_token_ms".into(),
            a.first_token.map_or(0.0, ms).into(),
        );
        // What a reader waits for: the first text that went out (0 when none did).
        timings.insert(
            "first_visible_ms".into(),
            a.first_visible.map_or(0.0, ms).into(),
        );
        timings.insert("decode_ms".into(), ms(a.decode_start.elapsed()).into());
        timings.insert("generated_tokens".into(), a.generated.into());
        if a.out.fell_back() {
            timings.insert("evidence_sentence_answer".into(), true.into());
        }
        // The answer rules that changed this answer's text (an empty list when none did).
        let fired = a.out.rules_fired();
        for rule in fired.iter() {
            self.metrics
                .answer_rules
                .with_label_values(&[rule.name()])
                .inc();
        }
        timings.insert("answer_rules".into(), fired.names().into());
        let _ = a.job.events.try_send(Event::Done(Summary {
            policy: a.policy.name(),
            fusion_disabled: a.fusion_disabled,
            prompt_tokens: a.prompt_tokens,
            cached_tokens: a.stats.prefix_cached_tokens,
            generated_tokens: a.generated,
            finish_reason,
            timings: serde_json::Value::Object(timings),
        }));
        if a.generated > 0 {
            self.keep_conversation(&a.job.prompt, &a.kv, &a.history);
        }
    }

    /// Keeps a finished chat's KV (prompt and answer) in the prefix cache, so the next turn of
    /// the conversation, which starts with this one, prefills only what is new. Only exact KV
    /// is kept: a RAG prompt's fused chunks are approximate.
    fn keep_conversation(&self, prompt: &Prompt, kv: &SeqKv, history: &[u32]) {
        if matches!(prompt, Prompt::Rag { .. }) {
            return;
        }
        let kv = match self.decoder.host_cache(kv) {
            Ok(kv) => kv,
            Err(e) => {
                tracing::warn!("conversation KV not kept: {e}");
                return;
            }
        };
        // The cache holds the prompt and every answer token fed back (all but the last).
        let n = kv.len().min(history.len());
        let mut own = self.model.new_cache(n);
        match own.append_from(&kv, 0..n) {
            Ok(_) => self.prefixes.insert(&history[..n], own),
            Err(e) => tracing::warn!("conversation KV not kept: {e}"),
        }
    }

    /// The chunk KV stage for one chunk: computes and stores its KV unless a tier holds it
    /// (the key is the one a question over this chunk looks up). A failure, or KV no tier
    /// kept, is logged and counted (`kv_failed`): the chunk is then computed when a question
    /// first needs it.
    fn precompute(&self, text: &str) {
        let computed = chunk_tokens(&self.tokenizer, text)
            .map_err(|e| e.to_string())
            .and_then(|ids| {
                self.store
                    .ensure(&self.model, &ids)
                    .map_err(|e| e.to_string())
            });
        let outcome = match computed {
            Ok(Ensured::Stored) => "kv_computed",
            Ok(Ensured::Present) => "kv_present",
            Ok(Ensured::NotStored) => {
                tracing::warn!("chunk KV precompute: no tier kept the chunk's KV");
                "kv_failed"
            }
            Err(e) => {
                tracing::warn!("chunk KV precompute: {e}");
                "kv_failed"
            }
        };
        self.metrics.ingested.with_label_values(&[outcome]).inc();
    }

    /// The policy to use after the fidelity gate (run once per policy, recorded next to the
    /// NVMe tier), as `engram ask` does.
    fn gated(&self, asked: Policy) -> std::result::Result<(Policy, Option<String>), ApiError> {
        if asked == Policy::Full {
            return Ok((Policy::Full, None));
        }
        if let Some(g) = self.gates.borrow().get(&asked.name()) {
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
        self.gates.borrow_mut().insert(asked.name(), g.clone());
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
        self.text_prompt(&text, "messages")
    }

    /// A prompt of `text` as it is; errors name `field`.
    fn text_prompt(&self, text: &str, field: &str) -> std::result::Result<FusedPrompt, ApiError> {
        let tokens = self
            .tokenizer
            .encode_prompt(text)
            .map_err(|e| ApiError::invalid(field, e.to_string()))?;
        plain_prompt(tokens, field)
    }

    /// A token prompt as it is, every id checked against the vocabulary.
    fn token_prompt(&self, ids: &[u32]) -> std::result::Result<FusedPrompt, ApiError> {
        let vocab = self.model.config().vocab_size;
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::invalid(
                "prompt",
                format!("token id {bad} is outside the model's vocabulary (0..{vocab})"),
            ));
        }
        plain_prompt(ids.to_vec(), "prompt")
    }

    /// Builds a job's prompt and prefills it, running decode steps of `batch` between the
    /// pieces of a long prefill.
    fn start<'t>(
        &'t self,
        job: Job,
        batch: &mut Vec<Active<'t>>,
    ) -> std::result::Result<Active<'t>, ApiError> {
        let started = Instant::now();
        let constrained = job
            .sampling
            .grammar
            .clone()
            .map(|g| Constrained::new(g, self.trie()));
        let (prompt, policy, fusion_disabled) = match &job.prompt {
            Prompt::Rag {
                question,
                passages,
                evidence,
            } => {
                let (policy, off) = self.gated(job.policy.unwrap_or(self.opts.policy))?;
                let p = rag_prompt_with(
                    DEFAULT_LAYOUT,
                    &self.tokenizer,
                    self.template.as_ref(),
                    DEFAULT_SYSTEM,
                    passages,
                    question,
                    evidence.as_deref(),
                )
                .map_err(|e| ApiError::invalid("question", e.to_string()))?;
                (p, policy, off)
            }
            Prompt::Chat { messages } => (self.chat_prompt(messages)?, Policy::Full, None),
            Prompt::Text { text } => (self.text_prompt(text, "prompt")?, Policy::Full, None),
            Prompt::Tokens { ids } => (self.token_prompt(ids)?, Policy::Full, None),
        };
        // A RAG answer's text is made as every answer's is (`engram_rag::Answering`); structured
        // output is taken as the grammar gives it, and other text is cut at its stops only.
        let Answering { out, copy } = match &job.prompt {
            Prompt::Rag {
                question, passages, ..
            } if job.sampling.grammar.is_none() => Answering::new(
                &prompt,
                &self.tokenizer,
                question,
                passages,
                &job.sampling.stops,
                AnswerOptions {
                    copy_bias: job.sampling.copy_bias.unwrap_or(self.opts.copy_bias),
                    check_start: self.opts.check_start,
                    rules_off: self.opts.rules_off,
                },
            ),
            _ => Answering {
                out: OutputText::plain(&job.sampling.stops),
                copy: None,
            },
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
        let mut between = || {
            if !batch.is_empty() {
                self.step(batch);
            }
        };
        let capacity = kv.capacity();
        let place = |kv| {
            self.decoder
                .place(kv, capacity)
                .map_err(|e| ApiError::internal(format!("moving the prompt's KV to the GPU: {e}")))
        };
        let (kv, done) = match (&job.prompt, job.sampling.prompt_logprobs) {
            (Prompt::Text { .. } | Prompt::Tokens { .. }, Some(top)) => {
                let tokens = prompt.tokens();
                let added_bos = match &job.prompt {
                    Prompt::Text { text } => self.added_bos(text, &tokens)?,
                    _ => false,
                };
                let (done, entries) =
                    self.prefill_scored(added_bos, &tokens, top, &mut kv, &mut between)?;
                // Room for it: the channel holds every event of the job.
                let _ = job.events.try_send(Event::Logprobs(entries));
                (place(kv)?, done)
            }
            #[cfg(feature = "cuda")]
            _ if policy == Policy::Full && self.decoder.on_gpu() => {
                self.prefill_on_gpu(&prompt, kv)?
            }
            _ => {
                // With every layer on a GPU, fusion's passes after placement run there.
                #[cfg(feature = "cuda")]
                let mut runner = self.decoder.runner(capacity);
                #[cfg(feature = "cuda")]
                let on = runner.as_mut().map(|r| r as &mut dyn engram_fusion::Runner);
                #[cfg(not(feature = "cuda"))]
                let on = None;
                let done = fused_prefill_on(
                    &self.model,
                    &self.store,
                    Some(&self.prefixes),
                    &prompt,
                    policy,
                    &mut kv,
                    Some(Interleave {
                        piece: INTERLEAVE_PIECE,
                        between: &mut between,
                    }),
                    on,
                )?;
                // The runner's cache, if it ran; else (no GPU runner, or a policy it does not
                // serve: `deviation`) the CPU's.
                #[cfg(feature = "cuda")]
                let on_gpu = runner.and_then(|r| r.into_cache()).map(SeqKv::Gpu);
                #[cfg(not(feature = "cuda"))]
                let on_gpu: Option<SeqKv> = None;
                let seq = match on_gpu {
                    Some(seq) => seq,
                    None => place(kv)?,
                };
                (seq, done)
            }
        };
        let cached = done.stats.prefix_cached_tokens;
        let prefix = prompt.prefix.len();
        self.metrics
            .prefix_tokens
            .with_label_values(&["hit"])
            .inc_by(cached as u64);
        self.metrics
            .prefix_tokens
            .with_label_values(&["miss"])
            .inc_by(prefix.saturating_sub(cached) as u64);
        let sampler = Sampler::new(SamplingParams {
            temperature: job.sampling.temperature,
            top_p: job.sampling.top_p,
            seed: job.sampling.seed,
            presence_penalty: job.sampling.presence_penalty,
            frequency_penalty: job.sampling.frequency_penalty,
            logit_bias: job.sampling.logit_bias.clone(),
            ..SamplingParams::default()
        })
        .map_err(sampling_error)?;
        Ok(Active {
            kv,
            sampler,
            history: prompt.tokens(),
            detok: Detokenizer::new(&self.tokenizer, true),
            out,
            constrained,
            copy,
            logits: done.logits,
            logprobs: Vec::new(),
            pending: 0,
            position: done.next_position,
            max_tokens,
            generated: 0,
            started,
            decode_start: Instant::now(),
            first_token: None,
            first_visible: None,
            policy,
            fusion_disabled,
            prompt_tokens: prompt.len(),
            stats: done.stats,
            job,
        })
    }
}

#[cfg(test)]
mod tests {
    use engram_rag::OutputText;

    /// A chat's or completion's text through the engine's output with `stops`.
    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = OutputText::plain(&stops);
        let mut out = String::new();
        for p in pieces {
            let (emit, hit) = m.push(p);
            out.push_str(&emit);
            if hit {
                return (out, true);
            }
        }
        out.push_str(&m.finish().0);
        (out, false)
    }

    #[test]
    fn stop_strings_cut_the_text_even_across_pieces() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&["\n\n"], &["one\n", "\ntwo"]), ("one".into(), true));
        assert_eq!(
            run(&["END", "STOP"], &["x S", "TO", "P y"]),
            ("x ".into(), true)
        );
        // A held prefix that turns out not to be a stop string goes out.
        assert_eq!(run(&["STOP"], &["ST", "AR"]), ("STAR".into(), false));
        assert_eq!(run(&["STOP"], &["a ST"]), ("a ST".into(), false));
        // The earliest stop string wins; multi-byte text is cut on char boundaries.
        assert_eq!(run(&["b", "a"], &["xab"]), ("x".into(), true));
        assert_eq!(run(&["é!"], &["caf", "é", "!"]), ("caf".into(), true));
    }
}
