//! Ingestion on the knowledge base's side: accept (store the original and a `queued` record),
//! hand documents to a preparer ([`crate::prepare`]), apply what it reports (chunks and their
//! vectors, written to the catalog as they come), add finished documents to the indexes in
//! bounded steps, and commit (documents become `done`).
//!
//! Order of durable writes, so that a crash at any point loses nothing acknowledged and leaves
//! nothing an index can see that the catalog does not have:
//!
//! 1. the blob (temp file, fsync, rename), then the document record (`queued`), flushed;
//! 2. per embedded batch: its chunks and vectors and the document's progress, in one catalog
//!    transaction (a restart re-embeds only what follows the last stored chunk);
//! 3. when every chunk is stored: the document `indexing`, the collection's counts and an
//!    `Add` entry in the change log, in one transaction;
//! 4. index additions in steps of [`INDEX_STEP`] chunks, then a commit at the highest sequence
//!    number the indexes fully hold, then the documents `done`, flushed.
//!
//! A crash after 1 or 2 resumes the document from its blob on the next start (in the
//! background: the daemon serves meanwhile); after 3 the index catches up from the change log.
//!
//! Two drivers use the same steps: [`KnowledgeBase::ingest`] and
//! [`KnowledgeBase::process_queued`] run the preparer inline (the command line, tests), while
//! `engramd` runs it on a thread of its own, calling [`KnowledgeBase::next_job`],
//! [`KnowledgeBase::apply`] and [`KnowledgeBase::index_step`] between queries.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::catalog::Txn;
use crate::error::{KbError, Result};
use crate::kb::{KnowledgeBase, COMMIT_EVERY, EMBED_BATCH};
use crate::prepare::{prepare, PrepareDoc, PrepareJob, Prepared};
use crate::records::{now_ms, Collection, Document, Job, JobKind, JobState, LogOp, Stage};

/// The longest document name, in bytes.
pub const MAX_DOC_NAME_BYTES: usize = 1024;

/// Chunks added to the indexes per [`KnowledgeBase::index_step`]: a few hundred milliseconds
/// of BM25 analysis and graph insertion on a small CPU, the longest a query waits behind it.
pub const INDEX_STEP: usize = 256;

/// Longest time indexed documents wait for their commit while more work keeps coming (without
/// more work they are committed at once): how long a steady stream of uploads may keep a
/// finished document from being searchable.
pub const COMMIT_INTERVAL: Duration = Duration::from_secs(5);

/// Most documents and bytes of originals handed to a preparer in one job by
/// [`KnowledgeBase::next_job`]: enough small documents to fill the encoder's batches, few
/// enough that memory stays small and a job ends soon.
pub const JOB_MAX_DOCS: usize = 64;
pub const JOB_MAX_BYTES: usize = 4 << 20;

/// The reason a cancelled document carries.
pub const CANCELLED: &str = "cancelled";

/// One file to ingest.
#[derive(Clone, Debug)]
pub struct NewDocument {
    /// Its file name (the parser picks the format from the extension); unique in a collection:
    /// new content under an existing name replaces that document's content, keeping its id.
    pub name: String,
    pub bytes: Vec<u8>,
    /// Key/value pairs searches can filter on.
    pub metadata: BTreeMap<String, String>,
}

impl NewDocument {
    /// A document without metadata.
    pub fn new(name: impl Into<String>, bytes: impl Into<Vec<u8>>) -> NewDocument {
        NewDocument {
            name: name.into(),
            bytes: bytes.into(),
            metadata: BTreeMap::new(),
        }
    }
}

/// What happened to one document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Parsed, chunked, embedded and indexed.
    Added { doc: u64, chunks: u32 },
    /// Same name and content already in the collection: nothing done.
    Unchanged { doc: u64 },
    /// New content under an existing name: the document (same id, `old`) now holds it.
    Replaced { doc: u64, chunks: u32, old: u64 },
    /// Could not be ingested; the reason says what to do.
    Failed { reason: String },
}

/// One line of an [`IngestReport`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DocReport {
    pub name: String,
    pub outcome: Outcome,
}

/// Time spent per stage of one ingestion.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StageTimes {
    pub store: Duration,
    pub parse: Duration,
    pub chunk: Duration,
    pub embed: Duration,
    pub index: Duration,
}

impl StageTimes {
    fn add(&mut self, o: &StageTimes) {
        self.store += o.store;
        self.parse += o.parse;
        self.chunk += o.chunk;
        self.embed += o.embed;
        self.index += o.index;
    }
}

/// The outcome of [`KnowledgeBase::ingest`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct IngestReport {
    pub job: u64,
    pub docs: Vec<DocReport>,
    /// Chunks written.
    pub chunks: u64,
    pub times: StageTimes,
    pub elapsed: Duration,
}

impl IngestReport {
    /// Documents that failed, with their reasons.
    pub fn failures(&self) -> impl Iterator<Item = (&str, &str)> {
        self.docs.iter().filter_map(|d| match &d.outcome {
            Outcome::Failed { reason } => Some((d.name.as_str(), reason.as_str())),
            _ => None,
        })
    }
}

/// Progress of an ingestion, reported as it happens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress<'a> {
    /// A document was stored and parsed (or found unchanged, or failed before chunking).
    Parsed { name: &'a str },
    /// A document was cut into this many chunks, now waiting for the embedder.
    Chunked { name: &'a str, chunks: usize },
    /// This many more chunks were embedded.
    Embedded { chunks: usize },
    /// This many more documents (with their chunks) were committed to the indexes.
    Indexed { docs: usize, chunks: usize },
    /// A document failed.
    Failed { name: &'a str, reason: &'a str },
}

/// What [`KnowledgeBase::accept`] did with a document.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// A new document, stored and queued.
    Queued,
    /// New content under a known name: stored and queued under the same id (`old`), its
    /// previous chunks gone.
    Replaced { old: u64 },
    /// Same name and content already in the collection (done, or on its way): nothing done
    /// but the metadata, which is applied.
    Unchanged,
    /// The same content under the same name had failed (or was cancelled): queued again
    /// under its id.
    Requeued,
}

/// The answer of [`KnowledgeBase::accept`]: the document is durable when it is returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Accepted {
    pub doc: u64,
    pub outcome: Admission,
}

/// What one [`KnowledgeBase::process_queued`] call did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueStep {
    /// Whether there was anything to do.
    pub worked: bool,
    /// Documents that became searchable (`done`) in this step.
    pub done: Vec<u64>,
    /// Documents that failed in this step.
    pub failed: Vec<u64>,
    /// Documents of the collection still queued or in the pipeline.
    pub pending: usize,
}

/// A document that became `done` or `failed`, reported by [`KnowledgeBase::take_finished`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finished {
    pub collection: String,
    pub doc: u64,
    /// `done` (searchable) or `failed`.
    pub done: bool,
    pub chunks: u32,
}

/// What one [`KnowledgeBase::index_step`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IndexStep {
    pub collection: String,
    /// Chunks added to the indexes.
    pub chunks: usize,
    /// Whether the indexes were committed (documents became `done`).
    pub committed: bool,
}

/// A document handed to a preparer and not all back yet.
struct InFlight {
    revision: u32,
    cancel: Arc<AtomicBool>,
    /// Ordinal of the next chunk expected, and how many there are (once chunked).
    next: u32,
    chunks: u32,
}

/// A document whose chunks are all stored and whose `Add` entry is logged at `seq`: waiting
/// for (or in) its index additions.
struct Ready {
    doc: u64,
    revision: u32,
    seq: u64,
    chunks: u32,
    /// Ordinal of the next chunk to add to the indexes.
    next: u32,
}

/// A collection's documents between acceptance and `done`, in memory (the catalog has their
/// stages; this is what the owner does with them next).
#[derive(Default)]
pub(crate) struct Background {
    name: String,
    queue: VecDeque<u64>,
    in_flight: HashMap<u64, InFlight>,
    /// In `Add` order; only the front is ever partly in the indexes.
    ready: VecDeque<Ready>,
    /// Fully in the indexes, not yet committed: document and chunks.
    uncommitted: Vec<(u64, u32)>,
    uncommitted_chunks: usize,
    /// When the oldest uncommitted document was added.
    since: Option<Instant>,
    /// How long the last commit took: a commit rewrites a collection's vector file, so a large
    /// collection under a steady stream commits less often (see `commit_due`).
    last_commit: Duration,
    /// The job record of this burst of work.
    job: Option<Job>,
}

impl Background {
    /// Whether the document is anywhere between acceptance and `done`.
    pub(crate) fn holds(&self, doc: u64) -> bool {
        self.queue.contains(&doc)
            || self.in_flight.contains_key(&doc)
            || self.ready.iter().any(|r| r.doc == doc)
            || self.uncommitted.iter().any(|&(d, _)| d == doc)
    }

    /// Documents queued or in the pipeline.
    fn pending(&self) -> usize {
        self.queue.len() + self.in_flight.len() + self.ready.len() + self.uncommitted.len()
    }

    /// Drops the document from every stage (stopping a preparer working on it).
    pub(crate) fn forget(&mut self, doc: u64) {
        self.queue.retain(|&d| d != doc);
        if let Some(f) = self.in_flight.remove(&doc) {
            f.cancel.store(true, Ordering::Relaxed);
        }
        self.ready.retain(|r| r.doc != doc);
        if let Some(i) = self.uncommitted.iter().position(|&(d, _)| d == doc) {
            let (_, n) = self.uncommitted.remove(i);
            self.uncommitted_chunks -= n as usize;
        }
    }

    /// Empties the documents waiting for (or in) their index additions and their commit:
    /// after a catch-up from the change log put them all in the indexes.
    pub(crate) fn take_indexed(&mut self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.ready.drain(..).map(|r| r.doc).collect();
        ids.extend(self.uncommitted.drain(..).map(|(d, _)| d));
        self.uncommitted_chunks = 0;
        self.since = None;
        ids
    }

    /// The highest sequence number the indexes fully hold: below the oldest `Add` not yet
    /// (completely) added. A commit there is exact after a crash: the catch-up replays that
    /// `Add` (delete, then add every chunk) and whatever follows.
    pub(crate) fn safe_seq(&self, last_seq: u64) -> u64 {
        self.ready.front().map_or(last_seq, |r| r.seq - 1)
    }

    fn commit_due(&self) -> bool {
        if self.uncommitted.is_empty() {
            return false;
        }
        let idle = self.queue.is_empty() && self.in_flight.is_empty() && self.ready.is_empty();
        // At most about a tenth of the time goes to commits under a steady stream.
        let interval = COMMIT_INTERVAL.max(self.last_commit * 10);
        idle || self.uncommitted_chunks >= COMMIT_EVERY
            || self.since.is_some_and(|t| t.elapsed() >= interval)
    }
}

impl KnowledgeBase {
    /// Ingests documents into the collection `collection` (which must exist): stores each,
    /// then parses, chunks, embeds ([`EMBED_BATCH`] chunks at a time, across documents) and
    /// indexes them on this thread. A document that cannot be parsed is reported as failed;
    /// the others go on. Everything reported is durable when this returns.
    pub fn ingest(
        &mut self,
        collection: &str,
        docs: impl IntoIterator<Item = NewDocument>,
        progress: &mut dyn FnMut(Progress<'_>),
    ) -> Result<IngestReport> {
        let started = Instant::now();
        let mut coll = self.collection(collection)?;
        let mut report = IngestReport::default();
        let mut job = self.new_job(&coll, JobKind::Ingest)?;
        report.job = job.id;
        // Report line of each queued document, and the names to show in progress.
        let mut lines: HashMap<u64, usize> = HashMap::new();
        let res = (|| {
            let mut queued_bytes = 0usize;
            for nd in docs {
                job.total += 1;
                let at = report.docs.len();
                report.docs.push(DocReport {
                    name: nd.name.clone(),
                    outcome: Outcome::Failed {
                        reason: "not processed".into(),
                    },
                });
                if let Err(e) = validate_doc(&nd) {
                    let reason = e.to_string();
                    progress(Progress::Failed {
                        name: &nd.name,
                        reason: &reason,
                    });
                    report.docs[at].outcome = Outcome::Failed { reason };
                    continue;
                }
                let t = Instant::now();
                let (id, admission) = self.store_doc(&mut coll, &nd, false)?;
                report.times.store += t.elapsed();
                match admission {
                    Admission::Unchanged => {
                        progress(Progress::Parsed { name: &nd.name });
                        report.docs[at].outcome = Outcome::Unchanged { doc: id };
                    }
                    Admission::Replaced { old } => {
                        report.docs[at].outcome = Outcome::Replaced {
                            doc: id,
                            chunks: 0,
                            old,
                        };
                        lines.insert(id, at);
                        self.enqueue(&coll, id);
                        queued_bytes += nd.bytes.len();
                    }
                    Admission::Queued | Admission::Requeued => {
                        lines.insert(id, at);
                        self.enqueue(&coll, id);
                        queued_bytes += nd.bytes.len();
                    }
                }
                if queued_bytes >= JOB_MAX_BYTES * 4 {
                    self.catalog.flush()?;
                    self.drain(&coll.name, &report, &lines, progress)?;
                    queued_bytes = 0;
                }
            }
            self.catalog.flush()?;
            self.drain(&coll.name, &report, &lines, progress)
        })();
        let times = res.as_ref().map_or(StageTimes::default(), |t| *t);
        report.times.add(&times);
        for (&id, &at) in &lines {
            let Some(d) = self.catalog.document(id)? else {
                continue;
            };
            let line = &mut report.docs[at];
            line.outcome = match (&line.outcome, d.stage) {
                (Outcome::Replaced { old, .. }, Stage::Done) => Outcome::Replaced {
                    doc: id,
                    chunks: d.chunks,
                    old: *old,
                },
                (_, Stage::Done) => Outcome::Added {
                    doc: id,
                    chunks: d.chunks,
                },
                (_, Stage::Failed) => Outcome::Failed {
                    reason: d.error.unwrap_or_else(|| "failed".into()),
                },
                (_, stage) => Outcome::Failed {
                    reason: format!("stopped while {}", stage.name()),
                },
            };
            if let Outcome::Added { chunks, .. } | Outcome::Replaced { chunks, .. } = line.outcome {
                report.chunks += chunks as u64;
            }
        }
        job.done = report
            .docs
            .iter()
            .filter(|d| !matches!(d.outcome, Outcome::Failed { .. }))
            .count() as u64;
        job.failed = job.total - job.done;
        self.finish_job(job, res.as_ref().err())?;
        res?;
        report.elapsed = started.elapsed();
        Ok(report)
    }

    /// Runs everything queued in `collection` through the pipeline on this thread.
    fn drain(
        &mut self,
        collection: &str,
        report: &IngestReport,
        lines: &HashMap<u64, usize>,
        progress: &mut dyn FnMut(Progress<'_>),
    ) -> Result<StageTimes> {
        let mut times = StageTimes::default();
        let name = |doc: u64| {
            lines
                .get(&doc)
                .map_or("", |&at| report.docs[at].name.as_str())
        };
        loop {
            if let Some(job) = self.next_job_in(collection, JOB_MAX_DOCS, JOB_MAX_BYTES)? {
                times.add(&self.prepare_inline(job, EMBED_BATCH, &mut |m| match m {
                    Prepared::Parsed { doc, .. } => progress(Progress::Parsed { name: name(*doc) }),
                    Prepared::Chunked { doc, chunks, .. } => progress(Progress::Chunked {
                        name: name(*doc),
                        chunks: *chunks as usize,
                    }),
                    Prepared::Embedded { chunks, .. } => progress(Progress::Embedded {
                        chunks: chunks.len(),
                    }),
                    Prepared::Failed { doc, reason, .. } => progress(Progress::Failed {
                        name: name(*doc),
                        reason,
                    }),
                    _ => {}
                })?);
                continue;
            }
            let t = Instant::now();
            let step = self.index_step_in(collection, COMMIT_EVERY, true)?;
            times.index += t.elapsed();
            let finished = self.take_finished();
            let done: Vec<&Finished> = finished.iter().filter(|f| f.done).collect();
            if !done.is_empty() {
                progress(Progress::Indexed {
                    docs: done.len(),
                    chunks: done.iter().map(|f| f.chunks as usize).sum(),
                });
            }
            if step.is_none() {
                return Ok(times);
            }
        }
    }

    /// Runs a prepare job on this thread, applying each message as it comes; `observe` sees
    /// every message first. A failure to apply stops the job and is returned.
    fn prepare_inline(
        &mut self,
        job: PrepareJob,
        batch_chunks: usize,
        observe: &mut dyn FnMut(&Prepared),
    ) -> Result<StageTimes> {
        let models = self.models.clone();
        let limits = self.limits.clone();
        let ocr = self.ocr.clone();
        let flags: Vec<Arc<AtomicBool>> = job.docs.iter().map(|d| d.cancel.clone()).collect();
        let mut failure = None;
        let times = prepare(
            &models,
            &limits,
            ocr.as_deref(),
            job,
            batch_chunks,
            &mut |m| {
                if failure.is_some() {
                    return;
                }
                observe(&m);
                if let Err(e) = self.apply(m) {
                    failure = Some(e);
                    for f in &flags {
                        f.store(true, Ordering::Relaxed);
                    }
                }
            },
        );
        match failure {
            Some(e) => Err(e),
            None => Ok(times),
        }
    }

    /// Stores a document durably (the original blob, fsynced, and its `queued` record,
    /// flushed) and queues it; returns its id. Once this returns the document is acknowledged:
    /// after a crash, [`open`](Self::open) queues it again. See [`Admission`] for what an
    /// existing name does.
    pub fn accept(&mut self, collection: &str, nd: NewDocument) -> Result<Accepted> {
        validate_doc(&nd)?;
        // A format nothing reads (an archive; an image where OCR is off) is refused now, not
        // failed a moment after the upload was acknowledged.
        let format =
            engram_parse::detect_format(&nd.name, &nd.bytes).map_err(KbError::UnsupportedFormat)?;
        if format == engram_parse::Format::Image && self.ocr.is_none() {
            return Err(KbError::UnsupportedFormat(
                engram_parse::ParseError::UnsupportedFormat {
                    file: nd.name.clone(),
                    detail: "an image, and OCR is off here ([ingest] ocr, Tesseract)".into(),
                },
            ));
        }
        let mut coll = self.collection(collection)?;
        let (id, outcome) = self.store_doc(&mut coll, &nd, true)?;
        if outcome != Admission::Unchanged {
            self.enqueue(&coll, id);
        }
        Ok(Accepted { doc: id, outcome })
    }

    fn enqueue(&mut self, coll: &Collection, doc: u64) {
        let bg = self.background.entry(coll.id).or_default();
        bg.name = coll.name.clone();
        if !bg.queue.contains(&doc) {
            bg.queue.push_back(doc);
        }
    }

    /// Moves the queue of `collection` on by one step on this thread: one index step (or
    /// commit) when documents wait for the indexes, else one prepare job (up to
    /// [`JOB_MAX_DOCS`] documents, embedded `budget` chunks per call of the embedder), run to
    /// its end. A caller that interleaves these calls with searches keeps both going; the
    /// daemon runs the prepare jobs on a thread of its own instead.
    pub fn process_queued(&mut self, collection: &str, budget: usize) -> Result<QueueStep> {
        let coll = self.collection(collection)?;
        let mut step = QueueStep::default();
        if self.index_step_in(&coll.name, INDEX_STEP, false)?.is_some() {
            step.worked = true;
        } else if let Some(job) = self.next_job_in(&coll.name, JOB_MAX_DOCS, JOB_MAX_BYTES)? {
            self.prepare_inline(job, budget, &mut |_| {})?;
            step.worked = true;
        } else if self.index_step_in(&coll.name, INDEX_STEP, true)?.is_some() {
            step.worked = true;
        }
        for f in self.take_finished() {
            if f.done {
                step.done.push(f.doc);
            } else {
                step.failed.push(f.doc);
            }
        }
        step.pending = self.background.get(&coll.id).map_or(0, Background::pending);
        Ok(step)
    }

    /// Runs every collection's queue to its end on this thread (what the command line does
    /// with documents an interrupted run left); returns how many documents it finished.
    pub fn finish_queued(&mut self) -> Result<usize> {
        let before = self.queued_documents();
        for name in self.queued_collections() {
            let report = IngestReport::default();
            self.drain(&name, &report, &HashMap::new(), &mut |_| {})?;
        }
        self.take_finished();
        Ok(before - self.queued_documents())
    }

    /// Names of the collections with documents queued or in the pipeline.
    pub fn queued_collections(&self) -> Vec<String> {
        self.background
            .values()
            .filter(|b| b.pending() > 0)
            .map(|b| b.name.clone())
            .collect()
    }

    /// Documents queued or in the pipeline, over every collection.
    pub fn queued_documents(&self) -> usize {
        self.background.values().map(Background::pending).sum()
    }

    /// Bytes of the originals of the documents queued or with a preparer: what ingestion is
    /// still to write about (the daemon's disk admission counts it).
    pub fn queued_bytes(&self) -> u64 {
        self.background
            .values()
            .flat_map(|b| b.queue.iter().chain(b.in_flight.keys()))
            .filter_map(|&id| self.catalog.document(id).ok().flatten())
            .map(|d| d.size)
            .sum()
    }

    /// Whether a document waits for a preparer (see [`next_job`](Self::next_job)).
    pub fn has_queued(&self) -> bool {
        self.background.values().any(|b| !b.queue.is_empty())
    }

    /// Documents that became `done` or `failed` since the last call.
    pub fn take_finished(&mut self) -> Vec<Finished> {
        std::mem::take(&mut self.finished)
    }

    /// Hands out the next documents waiting in any collection (round robin): up to
    /// `max_docs` documents and about `max_bytes` of originals, read from the blob store, each
    /// with a cancel flag the knowledge base sets when the document is cancelled, deleted or
    /// replaced. Their stage becomes `parsing`. Feed what the preparer reports to
    /// [`apply`](Self::apply).
    pub fn next_job(&mut self, max_docs: usize, max_bytes: usize) -> Result<Option<PrepareJob>> {
        let mut names: Vec<String> = self
            .background
            .values()
            .filter(|b| !b.queue.is_empty())
            .map(|b| b.name.clone())
            .collect();
        names.sort();
        if names.is_empty() {
            return Ok(None);
        }
        self.turn = self.turn.wrapping_add(1);
        let n = names.len();
        for i in 0..n {
            let name = &names[(self.turn + i) % n];
            if let Some(job) = self.next_job_in(name, max_docs, max_bytes)? {
                return Ok(Some(job));
            }
        }
        Ok(None)
    }

    fn next_job_in(
        &mut self,
        collection: &str,
        max_docs: usize,
        max_bytes: usize,
    ) -> Result<Option<PrepareJob>> {
        let coll = self.collection(collection)?;
        let mut docs = Vec::new();
        let mut bytes = 0usize;
        loop {
            if docs.len() >= max_docs.max(1) || (bytes >= max_bytes && !docs.is_empty()) {
                break;
            }
            let Some(bg) = self.background.get_mut(&coll.id) else {
                break;
            };
            let Some(id) = bg.queue.pop_front() else {
                break;
            };
            if bg.in_flight.contains_key(&id) {
                continue;
            }
            let Some(mut d) = self.catalog.document(id)? else {
                continue;
            };
            if d.stage.is_final() || d.collection != coll.id {
                continue;
            }
            let original = match self.original(&d) {
                Ok(b) => b,
                Err(e) => {
                    self.fail_doc(
                        &coll,
                        d,
                        "original_unreadable",
                        format!("the stored original cannot be read: {e}"),
                    )?;
                    continue;
                }
            };
            // Chunks an interrupted run stored (they are contiguous from the first).
            let stored = self
                .catalog
                .last_chunk(id)?
                .map(|c| (c.ordinal + 1, c.bytes));
            d.enter(Stage::Parsing);
            d.progress = None;
            let mut txn = Txn::default();
            txn.put_document(&d)?;
            self.catalog.write(txn)?;
            let cancel = Arc::new(AtomicBool::new(false));
            let bg = self.background.get_mut(&coll.id).expect("looked up above");
            bg.in_flight.insert(
                id,
                InFlight {
                    revision: d.revision,
                    cancel: cancel.clone(),
                    next: 0,
                    chunks: 0,
                },
            );
            bytes += original.len();
            docs.push(PrepareDoc {
                doc: id,
                revision: d.revision,
                name: d.name,
                bytes: original,
                stored,
                cancel,
            });
        }
        if docs.is_empty() {
            return Ok(None);
        }
        if self.background[&coll.id].job.is_none() {
            let job = self.new_job(&coll, JobKind::Ingest)?;
            self.background.get_mut(&coll.id).expect("exists").job = Some(job);
        }
        let bg = self.background.get_mut(&coll.id).expect("exists");
        if let Some(j) = &mut bg.job {
            j.total += docs.len() as u64;
        }
        Ok(Some(PrepareJob {
            collection: coll.id,
            chunking: coll.chunking,
            docs,
        }))
    }

    /// Applies one message of a preparer: the document's stage and progress, its chunks and
    /// vectors (written to the catalog), its failure, or its end (`indexing`, with an `Add`
    /// entry in the change log). A message about a document that is no longer in flight under
    /// that revision (cancelled, deleted, replaced) is dropped.
    pub fn apply(&mut self, msg: Prepared) -> Result<()> {
        let (doc, revision) = msg.doc();
        let Some(coll_id) = self
            .background
            .iter()
            .find(|(_, b)| {
                b.in_flight
                    .get(&doc)
                    .is_some_and(|f| f.revision == revision)
            })
            .map(|(&c, _)| c)
        else {
            return Ok(());
        };
        let current = self
            .catalog
            .document(doc)?
            .filter(|d| d.revision == revision && !d.stage.is_final());
        let Some(mut d) = current else {
            self.forget_queued(coll_id, doc);
            return Ok(());
        };
        let name = self.background[&coll_id].name.clone();
        let mut coll = self.collection(&name)?;
        let mut txn = Txn::default();
        match msg {
            Prepared::Reading { done, pages, .. } => {
                let p = d.progress_mut();
                p.ocr_pages = pages;
                p.ocr_pages_done = done;
            }
            Prepared::Parsed {
                format,
                title,
                text_bytes,
                warnings,
                ..
            } => {
                d.format = Some(format);
                d.title = title;
                d.warnings = warnings;
                d.progress_mut().text_bytes = text_bytes;
                d.enter(Stage::Chunking);
            }
            Prepared::Chunking { done, .. } => {
                d.progress_mut().text_bytes_chunked = done;
            }
            Prepared::Chunked { chunks, stored, .. } => {
                let p = d.progress_mut();
                p.text_bytes_chunked = p.text_bytes;
                p.chunks = chunks;
                p.chunks_embedded = stored;
                d.enter(Stage::Embedding);
                let f = self.in_flight(coll_id, doc);
                f.next = stored;
                f.chunks = chunks;
                // Chunks of an interrupted run that no longer match are dropped.
                self.remove_chunks_from(doc, stored, &mut txn)?;
            }
            Prepared::Embedded {
                chunks, vectors, ..
            } => {
                let f = self.in_flight(coll_id, doc);
                let expected = f.next;
                if chunks.first().map(|c| c.ordinal) != Some(expected)
                    || chunks.len() != vectors.len()
                {
                    let reason = format!(
                        "internal error: chunks arrived out of order (expected chunk {expected})"
                    );
                    return self.fail_doc(&coll, d, "internal", reason);
                }
                f.next += chunks.len() as u32;
                let next = f.next;
                for (c, v) in chunks.iter().zip(&vectors) {
                    txn.put_chunk(c, v)?;
                }
                d.progress_mut().chunks_embedded = next;
            }
            Prepared::Finished { .. } => {
                let bg = self.background.get_mut(&coll_id).expect("found above");
                let f = bg.in_flight.remove(&doc).expect("found above");
                let seq = self.catalog.seq()? + 1;
                d.chunks = f.chunks;
                d.progress_mut().chunks_embedded = f.chunks;
                d.enter(Stage::Indexing);
                coll.documents += 1;
                coll.chunks += f.chunks as u64;
                coll.last_seq = seq;
                txn.log(coll.id, seq, LogOp::Add { doc });
                txn.put_collection(&coll);
                txn.set_seq(seq);
                bg.ready.push_back(Ready {
                    doc,
                    revision,
                    seq,
                    chunks: f.chunks,
                    next: 0,
                });
            }
            Prepared::Failed { kind, reason, .. } => return self.fail_doc(&coll, d, kind, reason),
        }
        txn.put_document(&d)?;
        self.catalog.write(txn)
    }

    fn in_flight(&mut self, coll: u64, doc: u64) -> &mut InFlight {
        self.background
            .get_mut(&coll)
            .and_then(|b| b.in_flight.get_mut(&doc))
            .expect("the caller found it in flight")
    }

    /// Adds the removal of `doc`'s chunks from ordinal `from` on to `txn`.
    fn remove_chunks_from(&self, doc: u64, mut from: u32, txn: &mut Txn) -> Result<()> {
        loop {
            let stale = self.catalog.chunks_from(doc, from, 1024)?;
            let Some(last) = stale.last() else {
                return Ok(());
            };
            from = last.ordinal + 1;
            for c in &stale {
                txn.remove_chunk(c.id);
            }
        }
    }

    /// Records a failed document durably with its reason, dropping any chunks it stored.
    fn fail_doc(
        &mut self,
        coll: &Collection,
        mut d: Document,
        kind: &str,
        reason: String,
    ) -> Result<()> {
        if let Some(bg) = self.background.get_mut(&coll.id) {
            bg.forget(d.id);
            if let Some(j) = &mut bg.job {
                j.failed += 1;
            }
        }
        let mut txn = Txn::default();
        self.remove_chunks_from(d.id, 0, &mut txn)?;
        d.fail(kind, reason);
        d.chunks = 0;
        txn.put_document(&d)?;
        self.catalog.write(txn)?;
        self.catalog.flush()?;
        self.finished.push(Finished {
            collection: coll.name.clone(),
            doc: d.id,
            done: false,
            chunks: 0,
        });
        self.close_job_if_idle(coll.id)
    }

    /// Adds up to `budget` chunks of finished documents to the indexes of some collection
    /// (round robin), or commits them when a commit is due (the documents become `done`).
    /// `None` when there was nothing to do.
    pub fn index_step(&mut self, budget: usize) -> Result<Option<IndexStep>> {
        // A collection whose indexes failed a write is synced first.
        if let Some(&id) = self.resync.iter().next() {
            let Some(mut coll) = self.catalog.collection(id)? else {
                self.resync.remove(&id);
                return Ok(None);
            };
            self.resync_collection(&mut coll)?;
            return Ok(Some(IndexStep {
                collection: coll.name,
                chunks: 0,
                committed: true,
            }));
        }
        let mut names: Vec<String> = self
            .background
            .values()
            .filter(|b| !b.ready.is_empty() || b.commit_due())
            .map(|b| b.name.clone())
            .collect();
        names.sort();
        if names.is_empty() {
            return Ok(None);
        }
        self.turn = self.turn.wrapping_add(1);
        let name = names[self.turn % names.len()].clone();
        self.index_step_in(&name, budget, false)
    }

    /// [`index_step`](Self::index_step) in one collection; `commit_now` commits whatever is
    /// indexed even when no commit is due.
    fn index_step_in(
        &mut self,
        collection: &str,
        budget: usize,
        commit_now: bool,
    ) -> Result<Option<IndexStep>> {
        let mut coll = self.collection(collection)?;
        let Some(bg) = self.background.get_mut(&coll.id) else {
            return Ok(None);
        };
        let mut step = IndexStep {
            collection: coll.name.clone(),
            ..IndexStep::default()
        };
        let had_ready = !bg.ready.is_empty();
        // Chunks of the documents at the front of the line, up to `budget` in all: many small
        // documents go in one step (one call of each index), a large one over several.
        let mut left = budget.max(1);
        let mut docs: Vec<(Document, u32, u32)> = Vec::new(); // record, first ordinal, total
        let mut chunks = Vec::new();
        let mut stale = 0;
        for r in &bg.ready {
            if left == 0 {
                break;
            }
            let current = self
                .catalog
                .document(r.doc)?
                .filter(|d| d.revision == r.revision && d.stage == Stage::Indexing);
            let Some(d) = current else {
                if docs.is_empty() {
                    stale += 1;
                    continue;
                }
                break;
            };
            let got = self.catalog.chunks_from(r.doc, r.next, left)?;
            left -= got.len().min(left);
            docs.push((d, r.next, r.chunks));
            chunks.extend(got);
        }
        let bg = self.background.get_mut(&coll.id).expect("found above");
        for _ in 0..stale {
            bg.ready.pop_front();
        }
        if !chunks.is_empty() {
            let added = self
                .index_add(&coll, crate::kb::Which::Bm25, &chunks)
                .and_then(|()| self.index_add(&coll, crate::kb::Which::Vectors, &chunks));
            if let Err(e) = added {
                // The indexes may be ahead of what the log says they hold: sync them before
                // anything else is added (the change log has every document).
                self.resync.insert(coll.id);
                return Err(e);
            }
        }
        step.chunks = chunks.len();
        let mut txn = Txn::default();
        let bg = self.background.get_mut(&coll.id).expect("found above");
        for (mut d, from, total) in docs {
            let added = chunks.iter().filter(|c| c.doc == d.id).count() as u32;
            let next = from + added;
            d.progress_mut().chunks_indexed = next;
            txn.put_document(&d)?;
            let front = bg.ready.front_mut().expect("taken from the front");
            front.next = next;
            if next >= total || added == 0 {
                bg.ready.pop_front();
                bg.uncommitted.push((d.id, total));
                bg.uncommitted_chunks += total as usize;
                bg.since.get_or_insert_with(Instant::now);
            }
        }
        self.catalog.write(txn)?;
        let bg = self.background.get_mut(&coll.id).expect("found above");
        if had_ready && !(bg.commit_due() || commit_now && bg.ready.is_empty()) {
            return Ok(Some(step));
        }
        let bg = self.background.get_mut(&coll.id).expect("found above");
        if bg.uncommitted.is_empty() || !(commit_now || bg.commit_due()) {
            return Ok((step.chunks > 0).then_some(step));
        }
        let done: Vec<(u64, u32)> = std::mem::take(&mut bg.uncommitted);
        bg.uncommitted_chunks = 0;
        bg.since = None;
        let ids: Vec<u64> = done.iter().map(|&(d, _)| d).collect();
        let started = Instant::now();
        let committed = self.commit_indexes(&mut coll, &ids);
        if let Some(bg) = self.background.get_mut(&coll.id) {
            bg.last_commit = started.elapsed();
        }
        let marked = match committed {
            Ok(m) => m,
            Err(e) => {
                // Put them back; the sync that follows a failed commit finishes them.
                let bg = self.background.get_mut(&coll.id).expect("found above");
                bg.uncommitted_chunks = done.iter().map(|&(_, n)| n as usize).sum();
                bg.uncommitted = done;
                bg.since.get_or_insert_with(Instant::now);
                if matches!(e, KbError::Index(_)) || e.is_storage_full() {
                    self.resync.insert(coll.id);
                }
                return Err(e);
            }
        };
        let bg = self.background.get_mut(&coll.id).expect("found above");
        if let Some(j) = &mut bg.job {
            j.done += marked.len() as u64;
        }
        for &(doc, chunks) in &done {
            if marked.contains(&doc) {
                self.finished.push(Finished {
                    collection: coll.name.clone(),
                    doc,
                    done: true,
                    chunks,
                });
            }
        }
        step.committed = true;
        self.close_job_if_idle(coll.id)?;
        Ok(Some(step))
    }

    /// Cancels a document that is queued or anywhere in the pipeline: the work on it stops
    /// (a preparer sees its flag within one batch), its chunks leave the catalog and the
    /// indexes, and it becomes `failed` with the reason `cancelled`, keeping its original so
    /// it can be re-indexed. A `done` or `failed` document is refused.
    pub fn cancel(&mut self, collection: &str, id_or_name: &str) -> Result<Document> {
        let doc = self.document(collection, id_or_name)?;
        let mut coll = self.collection(collection)?;
        if doc.stage.is_final() {
            return Err(KbError::WrongStage {
                doc: doc.id,
                stage: doc.stage.name(),
                wanted: "queued or in the pipeline",
            });
        }
        if let Some(bg) = self.background.get_mut(&coll.id) {
            bg.forget(doc.id);
        }
        let mut next = doc.clone();
        next.fail(CANCELLED, CANCELLED);
        next.chunks = 0;
        self.unindex_document(&mut coll, &doc, &next)?;
        self.close_job_if_idle(coll.id)?;
        Ok(next)
    }

    /// Runs a document through the pipeline again from its stored original (after a failure,
    /// a cancellation, or a change of chunking): its chunks leave the indexes now, and it is
    /// queued. A document still in the pipeline is refused.
    pub fn reindex(&mut self, collection: &str, id_or_name: &str) -> Result<Document> {
        let mut doc = self.document(collection, id_or_name)?;
        let mut coll = self.collection(collection)?;
        if !doc.stage.is_final()
            || self
                .background
                .get(&coll.id)
                .is_some_and(|b| b.holds(doc.id))
        {
            return Err(KbError::WrongStage {
                doc: doc.id,
                stage: doc.stage.name(),
                wanted: "done or failed",
            });
        }
        if !self.has_original(&doc)? {
            return Err(KbError::corrupted(
                format!("document {}", doc.id),
                "its original is not in the blob store",
            ));
        }
        let old = doc.clone();
        doc.error = None;
        doc.failure = None;
        doc.chunks = 0;
        doc.revision += 1;
        doc.progress = None;
        doc.enter(Stage::Queued);
        self.unindex_document(&mut coll, &old, &doc)?;
        self.enqueue(&coll, doc.id);
        Ok(doc)
    }

    /// Stops every preparer at its next check (shutdown): the documents stay where the catalog
    /// has them and are queued again at the next open.
    pub fn stop_work(&mut self) {
        for bg in self.background.values_mut() {
            for f in bg.in_flight.values() {
                f.cancel.store(true, Ordering::Relaxed);
            }
        }
    }

    /// Takes a document out of the preparer's hands and queues it again (after its step could
    /// not be written); the chunks it stored are kept for the next try.
    pub fn requeue(&mut self, doc: u64) {
        let Some(coll) = self
            .background
            .iter()
            .find(|(_, b)| b.holds(doc))
            .map(|(&c, _)| c)
        else {
            return;
        };
        let bg = self.background.get_mut(&coll).expect("found above");
        if bg.in_flight.contains_key(&doc) {
            bg.forget(doc);
            bg.queue.push_back(doc);
        }
    }

    /// Drops `doc` from the background work of `coll` (it is being removed or replaced),
    /// stopping a preparer working on it.
    pub(crate) fn forget_queued(&mut self, coll: u64, doc: u64) {
        if let Some(bg) = self.background.get_mut(&coll) {
            bg.forget(doc);
        }
    }

    /// Queues documents an interrupted run left before indexing (at open): they go through
    /// the pipeline again from their stored original, keeping the chunks already stored.
    pub(crate) fn resume(&mut self, coll: &Collection, docs: Vec<Document>) {
        for d in docs {
            self.enqueue(coll, d.id);
        }
    }

    fn new_job(&mut self, coll: &Collection, kind: JobKind) -> Result<Job> {
        let job = Job {
            id: self.catalog.new_id()?,
            collection: coll.id,
            kind,
            state: JobState::Running,
            started_ms: now_ms(),
            finished_ms: None,
            total: 0,
            done: 0,
            failed: 0,
        };
        let mut txn = Txn::default();
        txn.put_job(&job);
        self.catalog.write(txn)?;
        Ok(job)
    }

    fn finish_job(&mut self, mut job: Job, err: Option<&KbError>) -> Result<()> {
        job.finished_ms = Some(now_ms());
        job.state = match err {
            None => JobState::Done,
            Some(e) => JobState::Failed {
                reason: e.to_string(),
            },
        };
        let mut txn = Txn::default();
        txn.put_job(&job);
        self.catalog.write(txn)?;
        self.catalog.flush()
    }

    /// Ends the background job of a collection once nothing of it is left.
    pub(crate) fn close_job_if_idle(&mut self, coll: u64) -> Result<()> {
        let Some(bg) = self.background.get_mut(&coll) else {
            return Ok(());
        };
        if bg.pending() > 0 {
            return Ok(());
        }
        let job = bg.job.take();
        self.background.remove(&coll);
        match job {
            Some(j) => self.finish_job(j, None),
            None => Ok(()),
        }
    }

    /// The store step of ingestion. A document is a name in a collection: its id is handed
    /// out once and stays until the user deletes it. The same name with the same content is
    /// `Unchanged` (its metadata is updated) or, after a failure, `Requeued`; the same name with
    /// new content is `Replaced` in place (same id, next revision, old chunks gone); a new name
    /// is a new document, even when another name has the same bytes (the blob is shared).
    /// Stores the blob and the `queued` record (flushed when `flush`). Returns the id and the
    /// admission; the caller queues the document unless it is unchanged.
    fn store_doc(
        &mut self,
        coll: &mut Collection,
        nd: &NewDocument,
        flush: bool,
    ) -> Result<(u64, Admission)> {
        let hash = crate::blobs::ContentHash::of(&nd.bytes);
        let coll_id = coll.id;
        let existing = match self.catalog.doc_by_name(coll_id, &nd.name)? {
            Some(id) => self.catalog.document(id)?,
            None => None,
        };
        let held = |kb: &Self, id: u64| kb.background.get(&coll_id).is_some_and(|b| b.holds(id));
        let (mut d, admission) = match existing {
            Some(d)
                if d.hash == hash.to_hex() && (d.stage != Stage::Failed || held(self, d.id)) =>
            {
                // Same bytes, done or on its way: only the metadata can have changed.
                if d.metadata != nd.metadata {
                    let mut updated = d.clone();
                    updated.metadata = nd.metadata.clone();
                    let mut txn = Txn::default();
                    txn.remove_document(&d)?;
                    txn.put_document(&updated)?;
                    self.catalog.write(txn)?;
                    if flush {
                        self.catalog.flush()?;
                    }
                }
                return Ok((d.id, Admission::Unchanged));
            }
            Some(d) if d.hash == hash.to_hex() => (d, Admission::Requeued),
            Some(d) => {
                let old = d.id;
                (d, Admission::Replaced { old })
            }
            None => {
                let d = Document {
                    id: self.catalog.new_id()?,
                    collection: coll_id,
                    name: nd.name.clone(),
                    hash: hash.to_hex(),
                    size: nd.bytes.len() as u64,
                    metadata: nd.metadata.clone(),
                    format: None,
                    title: None,
                    chunks: 0,
                    stage: Stage::Queued,
                    stages: Vec::new(),
                    error: None,
                    failure: None,
                    revision: 0,
                    progress: None,
                    warnings: Vec::new(),
                };
                (d, Admission::Queued)
            }
        };
        let old = d.clone();
        if admission != Admission::Queued {
            self.forget_queued(coll_id, d.id);
            d.revision += 1;
            d.error = None;
            d.failure = None;
            d.chunks = 0;
            d.hash = hash.to_hex();
            d.size = nd.bytes.len() as u64;
            d.metadata = nd.metadata.clone();
            d.format = None;
            d.title = None;
            d.progress = None;
        }
        // The blob first: a record never names content that is not stored.
        self.blobs.put(&nd.bytes)?;
        d.enter(Stage::Queued);
        if admission == Admission::Queued {
            let mut txn = Txn::default();
            txn.put_document(&d)?;
            self.catalog.write(txn)?;
        } else {
            // Its previous chunks leave the catalog and the indexes now; work still in flight
            // for the previous revision is stopped and dropped (see `apply`).
            self.unindex_document(coll, &old, &d)?;
        }
        if flush {
            self.catalog.flush()?;
        }
        if old.hash != d.hash {
            self.remove_blob_if_unused(crate::catalog::doc_hash(&old)?)?;
        }
        Ok((d.id, admission))
    }
}

/// Names and metadata must be usable as catalog keys: no NUL, bounded length.
fn validate_doc(nd: &NewDocument) -> Result<()> {
    if nd.name.is_empty() || nd.name.len() > MAX_DOC_NAME_BYTES || nd.name.contains('\0') {
        return Err(KbError::invalid(
            "document name",
            format!("must be 1 to {MAX_DOC_NAME_BYTES} bytes without NUL"),
        ));
    }
    for (k, v) in &nd.metadata {
        if k.is_empty() || k.contains('\0') || v.contains('\0') {
            return Err(KbError::invalid(
                "metadata",
                format!(
                    "key {k:?}: keys must be non-empty and neither key nor value may contain NUL"
                ),
            ));
        }
    }
    Ok(())
}
