//! The knowledge base's one owner: a thread that holds the `KnowledgeBase` and runs the
//! commands (closures) sent to it over a channel, answering each on a oneshot. The heavy half
//! of ingestion (parse, chunk, embed) runs on a second thread, the preparer, which reports each
//! step back; the owner applies those reports, adds finished documents to the indexes in
//! bounded steps and commits, always after the commands waiting, so a query waits behind at
//! most one such step (milliseconds to a few hundred), never behind a document.
//!
//! The owner also feeds the engine's chunk KV stage from the catalog's durable queue of `done`
//! documents whose KV is not stored yet, a few documents at a time, and records each document
//! the engine reports finished.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use engram_kb::{KnowledgeBase, Models, PrepareJob, Prepared};
use tokio::sync::{mpsc, oneshot};

use crate::error::{ApiError, Result, ServerError};
use crate::metrics::Metrics;
use crate::storage::Storage;

/// Commands waiting for the knowledge base before senders wait: searches are milliseconds,
/// ingestion is bounded separately, so this only absorbs bursts.
const COMMAND_QUEUE: usize = 256;

/// Chunks embedded per call of the embedder on the preparer: one packed batch of the encoder
/// (4096 tokens, about 16 chunks of 256), about a second on a 2-core CPU; the preparer looks
/// at a document's cancel flag between batches.
pub const STEP_CHUNKS: usize = 16;

/// Messages the preparer may have sent before the owner applies them: a few batches, so memory
/// stays bounded when the owner is busy with queries.
const PREPARED_QUEUE: usize = 8;

/// Documents handed to the engine's chunk KV stage at a time: enough to keep it busy, few
/// enough that a deletion or shutdown wastes little.
pub const KV_WORK_QUEUE: usize = 2;

/// Pause after a background step failed, so that a persistent failure (a full disk) does not
/// spin the thread; the queue goes on afterwards.
const STEP_ERROR_PAUSE: Duration = Duration::from_millis(500);

/// How often the owner recounts the bytes still to ingest for the disk admission (a catalog
/// read per queued document).
const PENDING_EVERY: Duration = Duration::from_secs(1);

/// Longest the owner sleeps without a message: commits that are due on time (see
/// `engram_kb::COMMIT_INTERVAL`) happen even when nothing else arrives.
const IDLE_TICK: Duration = Duration::from_secs(1);

type Command = Box<dyn FnOnce(&mut KnowledgeBase) + Send>;

/// The chunks of one `done` document, for the engine's chunk KV stage.
#[derive(Debug)]
pub struct KvWork {
    pub doc: u64,
    pub texts: Vec<String>,
}

/// The two ends of the chunk KV stage the knowledge base holds: work out, finished documents
/// back.
pub struct KvLink {
    pub work: mpsc::Sender<KvWork>,
    pub done: mpsc::UnboundedReceiver<u64>,
}

/// What the knowledge base needs to open.
pub struct KbOptions {
    pub data_dir: PathBuf,
    pub embedder: PathBuf,
    pub llm: PathBuf,
    pub threads: usize,
    pub max_upload_bytes: usize,
    /// The data directory's disk: ingestion pauses while it is short of its reserve.
    pub storage: Arc<Storage>,
    /// The engine's chunk KV stage (none: no precompute).
    pub kv: Option<KvLink>,
    /// `[ingest] ocr`: Tesseract's languages and the page time bound (none: OCR off).
    pub ocr: Option<(String, Duration)>,
}

/// How long the owner waits between two tries to open a knowledge base that the disk was too
/// full for.
const REOPEN_EVERY: Duration = Duration::from_secs(5);

/// A cheap, cloneable handle to the knowledge-base thread.
#[derive(Clone)]
pub struct KbHandle {
    tx: mpsc::Sender<Command>,
    /// Facts fixed at open, readable without a round trip.
    pub embed_model: Arc<str>,
    pub embed_dim: usize,
    /// Why the knowledge base is not open (a disk too full to open the catalog safely); the
    /// owner tries again every few seconds.
    unavailable: Arc<std::sync::Mutex<Option<String>>>,
}

impl KbHandle {
    /// Starts the thread and opens the knowledge base there (recovery queues interrupted
    /// documents rather than finishing them first); returns once it is open. The thread ends,
    /// dropping (and so flushing) the knowledge base, when every handle is gone.
    pub fn spawn(
        opts: KbOptions,
        metrics: Arc<Metrics>,
    ) -> Result<(KbHandle, std::thread::JoinHandle<()>)> {
        let (tx, mut rx) = mpsc::channel::<Command>(COMMAND_QUEUE);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let unavailable = Arc::new(std::sync::Mutex::new(None::<String>));
        let state = unavailable.clone();
        let join = std::thread::Builder::new()
            .name("engram-kb".into())
            .spawn(move || {
                let models = match load_models(&opts) {
                    Ok(m) => m,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let e = &models.embedder;
                let info = (Arc::<str>::from(e.model_id()), e.dim());
                let mut ready_tx = Some(ready_tx);
                // A disk too full to open the catalog safely does not stop the daemon: it
                // serves what needs no knowledge base, says why in /readyz, and tries again.
                let mut kb = loop {
                    match open(&opts, models.clone()) {
                        Ok(kb) => break kb,
                        Err(ServerError::Kb(e)) if e.is_storage_full() => {
                            let reason = format!("knowledge base not open: {e}");
                            tracing::error!("{reason}");
                            *state.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason);
                            if let Some(r) = ready_tx.take() {
                                let _ = r.send(Ok(info.clone()));
                            }
                            if !wait_closed(&mut rx, REOPEN_EVERY) {
                                return;
                            }
                        }
                        Err(e) => {
                            match ready_tx.take() {
                                Some(r) => {
                                    let _ = r.send(Err(e));
                                }
                                None => tracing::error!("the knowledge base cannot open: {e}"),
                            }
                            return;
                        }
                    }
                };
                *state.lock().unwrap_or_else(|p| p.into_inner()) = None;
                if let Some(r) = ready_tx.take() {
                    let _ = r.send(Ok(info));
                } else {
                    tracing::info!("the knowledge base is open again");
                }
                let mut kv = opts.kv;
                match Preparer::spawn(&kb, metrics.clone()) {
                    Ok(preparer) => {
                        let storage = opts.storage.clone();
                        owner_loop(&mut kb, &mut rx, preparer, kv.as_mut(), &storage, &metrics);
                    }
                    Err(e) => tracing::error!("cannot start the preparer thread: {e}"),
                }
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
                unavailable,
            },
            join,
        ))
    }

    /// Why the knowledge base is not open, while it is not.
    pub fn unavailable(&self) -> Option<String> {
        self.unavailable
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Runs `f` on the knowledge base and returns its result.
    pub async fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut KnowledgeBase) -> T + Send + 'static,
    ) -> std::result::Result<T, ApiError> {
        if let Some(reason) = self.unavailable() {
            return Err(ApiError::Unavailable { reason });
        }
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

    /// Whether the owner thread is running with the knowledge base open.
    pub fn is_open(&self) -> bool {
        !self.tx.is_closed() && self.unavailable().is_none()
    }
}

/// What the preparer thread sends back.
enum FromPreparer {
    Step(Prepared),
    /// The job handed out last is finished (a new one can go).
    JobDone,
}

/// The preparer thread: parses, chunks and embeds the jobs it is given (one at a time) with
/// the knowledge base's models, off the owner thread.
struct Preparer {
    jobs: std::sync::mpsc::Sender<PrepareJob>,
    out: mpsc::Receiver<FromPreparer>,
    busy: bool,
    join: std::thread::JoinHandle<()>,
}

impl Preparer {
    fn spawn(kb: &KnowledgeBase, metrics: Arc<Metrics>) -> std::io::Result<Preparer> {
        let (jobs, job_rx) = std::sync::mpsc::channel::<PrepareJob>();
        let (tx, out) = mpsc::channel(PREPARED_QUEUE);
        let models: Models = kb.models().clone();
        let limits = kb.parse_limits().clone();
        let ocr = kb.ocr().cloned();
        let join = std::thread::Builder::new()
            .name("engram-prepare".into())
            .spawn(move || {
                while let Ok(job) = job_rx.recv() {
                    let docs: Vec<(u64, u32)> =
                        job.docs.iter().map(|d| (d.doc, d.revision)).collect();
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        engram_kb::prepare(
                            &models,
                            &limits,
                            ocr.as_deref(),
                            job,
                            STEP_CHUNKS,
                            &mut |m| {
                                match &m {
                                    Prepared::Chunked { chunks, .. } => metrics
                                        .ingest_chunks
                                        .with_label_values(&["chunked"])
                                        .inc_by(u64::from(*chunks)),
                                    Prepared::Embedded { chunks, .. } => metrics
                                        .ingest_chunks
                                        .with_label_values(&["embedded"])
                                        .inc_by(chunks.len() as u64),
                                    _ => {}
                                }
                                // A closed channel means shutdown: the rest is dropped and resumed
                                // from the catalog at the next start.
                                let _ = tx.blocking_send(FromPreparer::Step(m));
                            },
                        )
                    }));
                    if r.is_err() {
                        tracing::error!("the preparer panicked; its documents fail");
                        for (doc, revision) in docs {
                            let _ = tx.blocking_send(FromPreparer::Step(Prepared::Failed {
                                doc,
                                revision,
                                kind: "internal",
                                reason: "internal error while preparing the document".into(),
                            }));
                        }
                    }
                    if tx.blocking_send(FromPreparer::JobDone).is_err() {
                        break;
                    }
                }
            })?;
        Ok(Preparer {
            jobs,
            out,
            busy: false,
            join,
        })
    }
}

/// Commands first, always; then the preparer's reports; then handing out the next job, one
/// index step, and the chunk KV feed; then sleep until something arrives. A closed command
/// channel (shutdown) stops the loop between two steps: the preparer's current work stops at
/// its next check, and what is left is durable and resumed on the next start.
fn owner_loop(
    kb: &mut KnowledgeBase,
    rx: &mut mpsc::Receiver<Command>,
    mut preparer: Preparer,
    mut kv: Option<&mut KvLink>,
    storage: &Storage,
    metrics: &Metrics,
) {
    // Only to wait on several channels at once; nothing runs on it.
    let waiter = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a current-thread runtime builds");
    let run = |kb: &mut KnowledgeBase, cmd: Command| {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cmd(kb)));
        if r.is_err() {
            tracing::error!("a knowledge-base command panicked; the owner goes on");
        }
    };
    let mut kv_feed = KvFeed::default();
    let mut pending_at: Option<std::time::Instant> = None;
    loop {
        report(kb, metrics);
        if pending_at.is_none_or(|t| t.elapsed() >= PENDING_EVERY) {
            storage.set_pending(kb.queued_bytes());
            pending_at = Some(std::time::Instant::now());
        }
        match rx.try_recv() {
            Ok(cmd) => {
                run(kb, cmd);
                continue;
            }
            Err(mpsc::error::TryRecvError::Disconnected) => break,
            Err(mpsc::error::TryRecvError::Empty) => {}
        }
        // Short of the reserve, nothing is written but what users ask for: the preparer's
        // reports wait (it blocks when its queue is full), documents stay queued.
        storage.set_headroom(kb.commit_headroom());
        let writable = storage.writable();
        metrics.storage_read_only.set(i64::from(!writable));
        metrics
            .storage_available
            .set(storage.available().min(i64::MAX as u64) as i64);
        if !writable {
            enum Woke {
                Cmd(Option<Command>),
                Tick,
            }
            let woke = waiter.block_on(async {
                tokio::select! {
                    biased;
                    c = rx.recv() => Woke::Cmd(c),
                    () = tokio::time::sleep(IDLE_TICK) => Woke::Tick,
                }
            });
            match woke {
                Woke::Cmd(Some(cmd)) => run(kb, cmd),
                Woke::Cmd(None) => break,
                Woke::Tick => {}
            }
            continue;
        }
        match preparer.out.try_recv() {
            Ok(FromPreparer::Step(m)) => {
                apply(kb, m);
                continue;
            }
            Ok(FromPreparer::JobDone) => {
                preparer.busy = false;
                continue;
            }
            Err(_) => {}
        }
        if !preparer.busy && kb.has_queued() {
            match kb.next_job(engram_kb::JOB_MAX_DOCS, engram_kb::JOB_MAX_BYTES) {
                Ok(Some(job)) => {
                    if preparer.jobs.send(job).is_ok() {
                        preparer.busy = true;
                    }
                    continue;
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::error!("handing out documents to prepare: {e}");
                    std::thread::sleep(STEP_ERROR_PAUSE);
                    continue;
                }
            }
        }
        let step = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            kb.index_step(engram_kb::INDEX_STEP)
        }));
        match step {
            Ok(Ok(Some(s))) => {
                metrics
                    .ingest_chunks
                    .with_label_values(&["indexed"])
                    .inc_by(s.chunks as u64);
                continue;
            }
            Ok(Ok(None)) => {}
            Ok(Err(e)) => {
                tracing::error!("index step failed: {e}");
                std::thread::sleep(STEP_ERROR_PAUSE);
                continue;
            }
            Err(_) => {
                tracing::error!("an index step panicked");
                std::thread::sleep(STEP_ERROR_PAUSE);
                continue;
            }
        }
        if let Some(link) = kv.as_deref_mut() {
            while let Ok(doc) = link.done.try_recv() {
                kv_feed.done(kb, doc);
            }
            if kv_feed.feed(kb, link) {
                continue;
            }
        }
        // Nothing to do now: wait for a command, a report, a finished chunk KV document, or
        // the tick.
        enum Woke {
            Cmd(Option<Command>),
            Prepared(Option<FromPreparer>),
            KvDone(Option<u64>),
            Tick,
        }
        let woke = waiter.block_on(async {
            let kv_done = async {
                match kv.as_deref_mut() {
                    Some(link) => link.done.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                c = rx.recv() => Woke::Cmd(c),
                m = preparer.out.recv() => Woke::Prepared(m),
                d = kv_done => Woke::KvDone(d),
                () = tokio::time::sleep(IDLE_TICK) => Woke::Tick,
            }
        });
        match woke {
            Woke::Cmd(Some(cmd)) => run(kb, cmd),
            Woke::Cmd(None) => break,
            Woke::Prepared(Some(FromPreparer::Step(m))) => apply(kb, m),
            Woke::Prepared(Some(FromPreparer::JobDone)) => preparer.busy = false,
            Woke::Prepared(None) => {
                tracing::error!("the preparer thread is gone; ingestion stops");
                preparer.busy = true;
            }
            Woke::KvDone(Some(doc)) => kv_feed.done(kb, doc),
            Woke::KvDone(None) => kv = None,
            Woke::Tick => {}
        }
    }
    // Stop the preparer at its next check; its documents stay where the catalog has them.
    kb.stop_work();
    drop(preparer.jobs);
    drop(preparer.out);
    let _ = preparer.join.join();
}

/// Applies one report of the preparer; a failure to write it (a full disk) puts the document
/// back in the queue for a later try.
fn apply(kb: &mut KnowledgeBase, m: Prepared) {
    let (doc, _) = m.doc();
    if let Err(e) = kb.apply(m) {
        tracing::error!(
            document = doc,
            "applying an ingestion step failed, retrying later: {e}"
        );
        kb.requeue(doc);
        std::thread::sleep(STEP_ERROR_PAUSE);
    }
}

/// Logs and counts finished documents, and sets the queue gauges.
fn report(kb: &mut KnowledgeBase, metrics: &Metrics) {
    for f in kb.take_finished() {
        if f.done {
            tracing::info!(collection = %f.collection, document = f.doc, chunks = f.chunks, "document indexed");
        } else {
            tracing::warn!(collection = %f.collection, document = f.doc, "document failed");
        }
        metrics
            .ingested
            .with_label_values(&[if f.done { "done" } else { "failed" }])
            .inc();
    }
    metrics
        .ingest_pending
        .with_label_values(&["documents"])
        .set(kb.queued_documents() as i64);
    if let Ok(n) = kb.kv_pending_chunks() {
        metrics
            .ingest_pending
            .with_label_values(&["chunk_kv"])
            .set(n as i64);
    }
}

/// Which documents of the durable chunk KV queue are with the engine.
#[derive(Default)]
struct KvFeed {
    sent: HashSet<u64>,
    /// The queue is read in id order from after this document; back to the start when it
    /// runs out.
    cursor: u64,
}

impl KvFeed {
    /// Sends the next waiting document when the engine has room; whether one was sent.
    fn feed(&mut self, kb: &mut KnowledgeBase, link: &mut KvLink) -> bool {
        if link.work.capacity() == 0 {
            return false;
        }
        let next = match kb.kv_pending(self.cursor, 8) {
            Ok(ids) => ids.into_iter().find(|d| !self.sent.contains(d)),
            Err(e) => {
                tracing::warn!("reading the chunk KV queue: {e}");
                return false;
            }
        };
        let Some(doc) = next else {
            // Wrapped around: start over once everything sent is back.
            if self.cursor != 0 && self.sent.is_empty() {
                self.cursor = 0;
                return true;
            }
            return false;
        };
        self.cursor = doc;
        let texts = match kb.chunks(doc) {
            Ok(c) => c.into_iter().map(|c| c.text).collect(),
            Err(e) => {
                tracing::warn!(document = doc, "chunks for the KV stage: {e}");
                return false;
            }
        };
        match link.work.try_send(KvWork { doc, texts }) {
            Ok(()) => {
                self.sent.insert(doc);
                true
            }
            Err(_) => false,
        }
    }

    fn done(&mut self, kb: &mut KnowledgeBase, doc: u64) {
        self.sent.remove(&doc);
        if let Err(e) = kb.kv_done(doc) {
            tracing::warn!(document = doc, "recording the chunk KV done: {e}");
        }
    }
}

/// Waits up to `d` for the daemon to shut down, dropping any command that arrives (its caller
/// is told the knowledge base is unavailable); whether the daemon is still running.
fn wait_closed(rx: &mut mpsc::Receiver<Command>, d: Duration) -> bool {
    let deadline = std::time::Instant::now() + d;
    while std::time::Instant::now() < deadline {
        match rx.try_recv() {
            Ok(_) => {}
            Err(mpsc::error::TryRecvError::Disconnected) => return false,
            Err(mpsc::error::TryRecvError::Empty) => {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
    true
}

fn load_models(opts: &KbOptions) -> Result<Models> {
    if !opts.embedder.join("model.safetensors").is_file() {
        return Err(ServerError::config(
            "models.embedder",
            format!("{} holds no model.safetensors", opts.embedder.display()),
        ));
    }
    let gguf = engram_gguf::GgufFile::open(&opts.llm)?;
    let tokens = engram_tokenizer::Tokenizer::from_gguf(gguf.metadata())?;
    Ok(Models::load(
        &opts.embedder,
        opts.threads,
        Arc::new(tokens),
    )?)
}

fn open(opts: &KbOptions, models: Models) -> Result<KnowledgeBase> {
    let mut kb = KnowledgeBase::open(&opts.data_dir, models)?;
    kb.set_parse_limits(engram_parse::Limits {
        max_input_bytes: opts.max_upload_bytes as u64,
        ..engram_parse::Limits::default()
    });
    match &opts.ocr {
        Some((languages, timeout)) => match engram_parse::Ocr::detect(languages, *timeout) {
            Ok(ocr) => {
                tracing::info!(ocr = %ocr.describe(), "OCR on: images and scanned PDF pages are read");
                kb.set_ocr(Some(Arc::new(ocr)));
            }
            Err(why) => tracing::warn!(
                reason = %why,
                "OCR unavailable: images and scanned PDF pages are refused"
            ),
        },
        None => tracing::info!(
            "OCR off ([ingest] ocr = \"off\"): images and scanned PDF pages are refused"
        ),
    }
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
            "recovery: interrupted documents queued again (finished in the background)"
        );
    }
    for (coll, why) in &r.deferred {
        tracing::warn!(collection = %coll, "recovery: left for when the disk has room ({why})");
    }
    Ok(kb)
}
