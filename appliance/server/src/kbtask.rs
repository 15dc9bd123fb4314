//! The knowledge base's one owner: a thread that holds the `KnowledgeBase` and runs the
//! commands (closures) sent to it over a channel, answering each on a oneshot. Between
//! commands it moves the ingestion queue on, one bounded step at a time, and hands the
//! chunks of every document that becomes searchable to the engine's chunk KV stage.

use std::path::PathBuf;
use std::sync::Arc;

use engram_kb::{KnowledgeBase, Models};
use tokio::sync::{mpsc, oneshot};

use crate::error::{ApiError, Result, ServerError};
use crate::metrics::Metrics;

/// Commands waiting for the knowledge base before senders wait: searches are milliseconds,
/// ingestion is bounded separately, so this only absorbs bursts.
const COMMAND_QUEUE: usize = 256;

/// Chunks embedded per background step: one packed batch of the encoder (4096 tokens, about
/// 16 chunks of 256), about a second on a 2-core CPU. A query never waits behind more than
/// one step (or one document's parse).
pub const STEP_CHUNKS: usize = 16;

/// Pause after a background step failed, so that a persistent failure (a full disk) does not
/// spin the thread; the queue goes on afterwards.
const STEP_ERROR_PAUSE: std::time::Duration = std::time::Duration::from_millis(500);

type Command = Box<dyn FnOnce(&mut KnowledgeBase) + Send>;

/// Chunk texts of a document that became searchable, for the engine's chunk KV stage.
pub type KvWork = Vec<String>;

/// What the knowledge base needs to open.
#[derive(Clone, Debug)]
pub struct KbOptions {
    pub data_dir: PathBuf,
    pub embedder: PathBuf,
    pub llm: PathBuf,
    pub threads: usize,
    pub max_upload_bytes: usize,
    /// Where the chunks of indexed documents go for their KV (none: no precompute).
    pub kv_work: Option<mpsc::UnboundedSender<KvWork>>,
}

/// A cheap, cloneable handle to the knowledge-base thread.
#[derive(Clone)]
pub struct KbHandle {
    tx: mpsc::Sender<Command>,
    /// Facts fixed at open, readable without a round trip.
    pub embed_model: Arc<str>,
    pub embed_dim: usize,
}

impl KbHandle {
    /// Starts the thread and opens the knowledge base there (with recovery); returns once it
    /// is open. The thread ends, dropping (and so flushing) the knowledge base, when every
    /// handle is gone.
    pub fn spawn(
        opts: KbOptions,
        metrics: Arc<Metrics>,
    ) -> Result<(KbHandle, std::thread::JoinHandle<()>)> {
        let (tx, mut rx) = mpsc::channel::<Command>(COMMAND_QUEUE);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let join = std::thread::Builder::new()
            .name("engram-kb".into())
            .spawn(move || {
                let mut kb = match open(&opts) {
                    Ok(kb) => {
                        let e = &kb.models().embedder;
                        let _ = ready_tx.send(Ok((Arc::<str>::from(e.model_id()), e.dim())));
                        kb
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                owner_loop(&mut kb, &mut rx, opts.kv_work.as_ref(), &metrics);
                tracing::info!("knowledge base closed");
            })
            .map_err(|e| ServerError::io("spawning", "engram-kb thread", e))?;
        let (embed_model, embed_dim) = ready_rx.recv().map_err(|_| ServerError::Profile {
            reason: "the knowledge-base thread died while opening".into(),
        })??;
        Ok((
            KbHandle {
                tx,
                embed_model,
                embed_dim,
            },
            join,
        ))
    }

    /// Runs `f` on the knowledge base and returns its result.
    pub async fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut KnowledgeBase) -> T + Send + 'static,
    ) -> std::result::Result<T, ApiError> {
        let (tx, rx) = oneshot::channel();
        let cmd: Command = Box::new(move |kb| {
            let _ = tx.send(f(kb));
        });
        self.tx.send(cmd).await.map_err(|_| ApiError::Unavailable {
            reason: "the knowledge base is shut down".into(),
        })?;
        rx.await
            .map_err(|_| ApiError::internal("the knowledge-base command failed"))
    }

    /// Whether the owner thread is still running.
    pub fn is_open(&self) -> bool {
        !self.tx.is_closed()
    }
}

/// Commands first, always: a background step runs only when no command is waiting, and a
/// closed channel (shutdown) stops the loop between two steps. What is left in the queue is
/// durable and resumed on the next start.
fn owner_loop(
    kb: &mut KnowledgeBase,
    rx: &mut mpsc::Receiver<Command>,
    kv_work: Option<&mpsc::UnboundedSender<KvWork>>,
    metrics: &Metrics,
) {
    let run = |kb: &mut KnowledgeBase, cmd: Command| {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cmd(kb)));
        if r.is_err() {
            tracing::error!("a knowledge-base command panicked; the owner goes on");
        }
    };
    let pending = metrics.ingest_pending.with_label_values(&["documents"]);
    let mut turn = 0usize;
    loop {
        match rx.try_recv() {
            Ok(cmd) => {
                run(kb, cmd);
                pending.set(kb.queued_documents() as i64);
                continue;
            }
            Err(mpsc::error::TryRecvError::Disconnected) => break,
            Err(mpsc::error::TryRecvError::Empty) => {}
        }
        let colls = kb.queued_collections();
        if !colls.is_empty() {
            // Round robin over the collections with work.
            turn = turn.wrapping_add(1);
            let coll = &colls[turn % colls.len()];
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                kb.process_queued(coll, STEP_CHUNKS)
            }));
            match r {
                Ok(Ok(step)) if step.worked => {
                    record_step(kb, coll, &step, kv_work, metrics);
                    pending.set(kb.queued_documents() as i64);
                    continue;
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    tracing::error!(collection = %coll, "ingestion step failed: {e}");
                    std::thread::sleep(STEP_ERROR_PAUSE);
                    continue;
                }
                Err(_) => {
                    tracing::error!(collection = %coll, "an ingestion step panicked");
                    std::thread::sleep(STEP_ERROR_PAUSE);
                    continue;
                }
            }
        }
        match rx.blocking_recv() {
            Some(cmd) => {
                run(kb, cmd);
                pending.set(kb.queued_documents() as i64);
            }
            None => break,
        }
    }
}

/// Logs a step's finished documents, counts them, and queues the chunks of the done ones for
/// their KV.
fn record_step(
    kb: &KnowledgeBase,
    coll: &str,
    step: &engram_kb::QueueStep,
    kv_work: Option<&mpsc::UnboundedSender<KvWork>>,
    metrics: &Metrics,
) {
    for &doc in &step.failed {
        tracing::warn!(collection = %coll, document = doc, "document failed");
    }
    metrics
        .ingested
        .with_label_values(&["failed"])
        .inc_by(step.failed.len() as u64);
    metrics
        .ingested
        .with_label_values(&["done"])
        .inc_by(step.done.len() as u64);
    for &doc in &step.done {
        tracing::info!(collection = %coll, document = doc, "document indexed");
        let Some(tx) = kv_work else { continue };
        match kb.chunks(doc) {
            Ok(chunks) if !chunks.is_empty() => {
                let texts: KvWork = chunks.into_iter().map(|c| c.text).collect();
                metrics
                    .ingest_pending
                    .with_label_values(&["chunk_kv"])
                    .add(texts.len() as i64);
                let _ = tx.send(texts);
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(document = doc, "chunks for the KV stage: {e}"),
        }
    }
}

fn open(opts: &KbOptions) -> Result<KnowledgeBase> {
    if !opts.embedder.join("model.safetensors").is_file() {
        return Err(ServerError::config(
            "models.embedder",
            format!("{} holds no model.safetensors", opts.embedder.display()),
        ));
    }
    let gguf = engram_gguf::GgufFile::open(&opts.llm)?;
    let tokens = engram_tokenizer::Tokenizer::from_gguf(gguf.metadata())?;
    let models = Models::load(&opts.embedder, opts.threads, Arc::new(tokens))?;
    let mut kb = KnowledgeBase::open(&opts.data_dir, models)?;
    kb.set_parse_limits(engram_parse::Limits {
        max_input_bytes: opts.max_upload_bytes as u64,
        ..engram_parse::Limits::default()
    });
    let r = kb.recovery();
    for (coll, index, why) in &r.rebuilt {
        tracing::warn!(collection = %coll, index, "recovery: rebuilt ({why})");
    }
    for (coll, index, n) in &r.caught_up {
        tracing::info!(collection = %coll, index, changes = n, "recovery: caught up");
    }
    if r.resumed > 0 {
        tracing::info!(
            documents = r.resumed,
            "recovery: finished interrupted documents"
        );
    }
    Ok(kb)
}
