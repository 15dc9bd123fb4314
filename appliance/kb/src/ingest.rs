//! Ingestion: store the original, parse, chunk, embed in batches, write chunks and vectors to
//! the catalog, index, commit; every document's stage is recorded as it goes.
//!
//! Order of durable writes, so that a crash at any point loses nothing acknowledged and leaves
//! nothing an index can see that the catalog does not have:
//!
//! 1. the blob (temp file, fsync, rename), then the document record (`queued`);
//! 2. per group of about [`EMBED_BATCH`] chunks: chunks, vectors, `indexing` stage and a change
//!    log entry in one catalog transaction;
//! 3. every [`COMMIT_EVERY`] chunks and at the end: catalog flush, index commits at the
//!    catalog's sequence number, documents `done`, flush.
//!
//! A crash after 1 resumes the document from its blob on the next start; after 2 the index
//! catches up from the change log.
//!
//! Two ways in: [`KnowledgeBase::ingest`] runs the whole flow in one call (the CLI), while
//! [`KnowledgeBase::accept`] does step 1 only, flushed, and queues the document, and
//! [`KnowledgeBase::process_queued`] moves the queue on by one bounded step per call (the
//! daemon, which answers queries between steps).

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use engram_index::ChunkDoc;

use crate::catalog::Txn;
use crate::chunker::chunk_text;
use crate::error::{KbError, Result};
use crate::kb::{KnowledgeBase, COMMIT_EVERY, EMBED_BATCH};
use crate::records::{
    chunk_id, now_ms, Chunk, Collection, Document, Job, JobKind, JobState, LogOp, Stage,
    MAX_CHUNKS_PER_DOC,
};

/// The longest document name, in bytes.
pub const MAX_DOC_NAME_BYTES: usize = 1024;

/// One file to ingest.
#[derive(Clone, Debug)]
pub struct NewDocument {
    /// Its file name (the parser picks the format from the extension); unique in a collection:
    /// a new content under an existing name replaces the old document.
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
    /// Same content already in the collection: nothing done.
    Unchanged { doc: u64 },
    /// New content under an existing name: the old document was removed.
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

/// A parsed and chunked document waiting for its vectors.
struct Pending {
    doc: Document,
    chunks: Vec<Chunk>,
    report: usize,
}

/// The state of one ingestion run.
pub(crate) struct Run {
    coll: Collection,
    job: Job,
    report: IngestReport,
    group: Vec<Pending>,
    group_chunks: usize,
    /// Vectors of the group's first chunks (in order), when it is embedded in steps.
    vectors: Vec<Vec<f32>>,
    /// Documents in the indexes but not yet committed, and their chunk count.
    uncommitted: Vec<(u64, usize)>,
    uncommitted_chunks: usize,
    /// A background run: stages are written to the catalog as they are entered, so that a
    /// reader between two steps sees where each document is.
    background: bool,
    /// Documents that failed since the last [`KnowledgeBase::process_queued`] answer.
    failed_ids: Vec<u64>,
}

/// Documents accepted and not yet through the pipeline, per collection (see
/// [`KnowledgeBase::accept`]).
#[derive(Default)]
pub(crate) struct Background {
    name: String,
    queue: VecDeque<u64>,
    run: Option<Run>,
}

impl Background {
    fn holds(&self, doc: u64) -> bool {
        self.queue.contains(&doc)
            || self.run.as_ref().is_some_and(|r| {
                r.group.iter().any(|p| p.doc.id == doc)
                    || r.uncommitted.iter().any(|&(d, _)| d == doc)
            })
    }

    /// Documents queued or in the pipeline.
    fn pending(&self) -> usize {
        self.queue.len()
            + self
                .run
                .as_ref()
                .map_or(0, |r| r.group.len() + r.uncommitted.len())
    }
}

/// What [`KnowledgeBase::accept`] did with a document.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Stored and queued.
    Queued,
    /// Stored and queued; the document that had this name before was removed.
    Replaced { old: u64 },
    /// Same content already in the collection (done, or queued already): nothing done.
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

impl KnowledgeBase {
    /// Ingests documents into the collection `collection` (which must exist), streaming: each
    /// document is stored and parsed as it arrives, chunks are embedded [`EMBED_BATCH`] at a
    /// time, and the indexes commit every [`COMMIT_EVERY`] chunks and at the end. A document
    /// that cannot be parsed is reported as failed; the others go on. Everything reported is
    /// durable when this returns.
    ///
    /// This is [`accept`](Self::accept) and processing in one call, without the queue: the
    /// original bytes are parsed from memory and the catalog is flushed once per commit.
    pub fn ingest(
        &mut self,
        collection: &str,
        docs: impl IntoIterator<Item = NewDocument>,
        progress: &mut dyn FnMut(Progress<'_>),
    ) -> Result<IngestReport> {
        let started = Instant::now();
        let coll = self.collection(collection)?;
        let mut run = self.start_run(coll, JobKind::Ingest, false)?;
        let res = (|| {
            for nd in docs {
                self.ingest_one(&mut run, nd, progress)?;
                if run.group_chunks >= EMBED_BATCH {
                    self.flush_group(&mut run, progress)?;
                }
            }
            self.flush_group(&mut run, progress)?;
            self.commit_run(&mut run, progress)
        })();
        self.finish_run(run, res, started)
    }

    /// Stores a document durably (the original blob, fsynced, and its `queued` record,
    /// flushed) and queues it for [`process_queued`](Self::process_queued); returns its id.
    /// Once this returns the document is acknowledged: after a crash, [`open`](Self::open)
    /// finishes it. Same content under the same name that is done or already queued is
    /// `Unchanged`; new content under an existing name replaces that document at once.
    pub fn accept(&mut self, collection: &str, nd: NewDocument) -> Result<Accepted> {
        validate_doc(&nd)?;
        let mut coll = self.collection(collection)?;
        let (doc, (outcome, id)) = self.store_doc(&mut coll, &nd, true)?;
        if doc.is_some() {
            let bg = self.background.entry(coll.id).or_default();
            bg.name = coll.name.clone();
            if !bg.queue.contains(&id) {
                bg.queue.push_back(id);
            }
        }
        Ok(Accepted { doc: id, outcome })
    }

    /// Moves the queue of `collection` on by one bounded step: parse and chunk one document,
    /// or embed up to `budget` chunks (at least one), or write an embedded group to the
    /// catalog and the indexes, or commit the indexes (documents become `done`). A caller
    /// that interleaves these calls with searches keeps both going.
    pub fn process_queued(&mut self, collection: &str, budget: usize) -> Result<QueueStep> {
        let coll = self.collection(collection)?;
        let coll_id = coll.id;
        let Some(mut bg) = self.background.remove(&coll_id) else {
            return Ok(QueueStep::default());
        };
        let mut run = match bg.run.take() {
            Some(mut r) => {
                // Another call (a deletion, a replacement) may have changed the record.
                r.coll = coll;
                r
            }
            None if !bg.queue.is_empty() => self.start_run(coll, JobKind::Ingest, true)?,
            None => return Ok(QueueStep::default()),
        };
        let mut step = QueueStep {
            worked: true,
            ..QueueStep::default()
        };
        let res = self.step(&mut run, &mut bg.queue, budget.max(1), &mut step);
        step.failed.append(&mut run.failed_ids);
        let res = match res {
            Ok(false) => {
                bg.run = Some(run);
                Ok(())
            }
            Ok(true) => self.finish_run(run, Ok(()), Instant::now()).map(|_| ()),
            Err(e) => {
                // Documents caught in the failed step are marked failed (a re-index retries
                // them); the rest of the queue goes on in the next call.
                let reason = format!("ingestion stopped: {e}");
                let indexed: Vec<u64> = run.uncommitted.iter().map(|&(d, _)| d).collect();
                if self.commit_indexes(&mut run.coll, &indexed).is_ok() {
                    step.done = indexed;
                }
                for p in std::mem::take(&mut run.group) {
                    let mut d = p.doc;
                    d.fail(reason.clone());
                    let mut txn = Txn::default();
                    if txn.put_document(&d).is_ok() && self.catalog.write(txn).is_ok() {
                        step.failed.push(d.id);
                    }
                }
                self.finish_run(run, Err(e), Instant::now()).map(|_| ())
            }
        };
        step.pending = bg.pending();
        if step.pending > 0 {
            self.background.insert(coll_id, bg);
        }
        res.map(|()| step)
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

    /// Cancels a document that is still `queued` (not yet picked up): it becomes `failed`
    /// with the reason `cancelled`, keeps its original, and can be re-indexed.
    pub fn cancel(&mut self, collection: &str, id_or_name: &str) -> Result<Document> {
        let mut doc = self.document(collection, id_or_name)?;
        let picked_up = self
            .background
            .get(&doc.collection)
            .and_then(|b| b.run.as_ref())
            .is_some_and(|r| r.group.iter().any(|p| p.doc.id == doc.id));
        if doc.stage != Stage::Queued || picked_up {
            return Err(KbError::WrongStage {
                doc: doc.id,
                stage: if picked_up {
                    "parsing"
                } else {
                    doc.stage.name()
                },
                wanted: "queued",
            });
        }
        if let Some(bg) = self.background.get_mut(&doc.collection) {
            bg.queue.retain(|&d| d != doc.id);
        }
        doc.fail(CANCELLED);
        let mut txn = Txn::default();
        txn.put_document(&doc)?;
        self.catalog.write(txn)?;
        self.catalog.flush()?;
        Ok(doc)
    }

    /// Runs a document through the pipeline again from its stored original (after a failure,
    /// a cancellation, or a change of chunking): its chunks leave the indexes now, and it is
    /// queued for [`process_queued`](Self::process_queued). A document still in the pipeline
    /// is refused.
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
        doc.chunks = 0;
        doc.revision += 1;
        doc.enter(Stage::Queued);
        self.unindex_document(&mut coll, &old, &doc)?;
        let bg = self.background.entry(coll.id).or_default();
        bg.name = coll.name.clone();
        bg.queue.push_back(doc.id);
        Ok(doc)
    }

    /// Drops `doc` from the background queue (it was removed).
    pub(crate) fn forget_queued(&mut self, coll: u64, doc: u64) {
        if let Some(bg) = self.background.get_mut(&coll) {
            bg.queue.retain(|&d| d != doc);
        }
    }

    /// One step of a background run; `Ok(true)` when the run has nothing left.
    fn step(
        &mut self,
        run: &mut Run,
        queue: &mut VecDeque<u64>,
        budget: usize,
        step: &mut QueueStep,
    ) -> Result<bool> {
        let mut ignore = |_: Progress<'_>| {};
        if !run.group.is_empty() && (run.group_chunks >= EMBED_BATCH || queue.is_empty()) {
            if run.vectors.len() < run.group_chunks {
                self.embed_some(run, budget, &mut ignore)?;
            } else {
                self.write_group(run, &mut ignore)?;
            }
            return Ok(false);
        }
        if run.uncommitted_chunks >= COMMIT_EVERY || (queue.is_empty() && run.group.is_empty()) {
            if !run.uncommitted.is_empty() {
                let docs: Vec<u64> = run.uncommitted.iter().map(|&(d, _)| d).collect();
                self.commit_run(run, &mut ignore)?;
                step.done = docs;
            }
            return Ok(queue.is_empty() && run.group.is_empty());
        }
        if let Some(id) = queue.pop_front() {
            match self.catalog.document(id)? {
                Some(doc) if doc.stage == Stage::Queued && doc.collection == run.coll.id => {
                    run.job.total += 1;
                    match self.original(&doc) {
                        Ok(bytes) => self.process(run, doc, &bytes, usize::MAX, &mut ignore)?,
                        Err(e) => {
                            let reason = format!("the stored original cannot be read: {e}");
                            self.fail(run, doc, usize::MAX, reason, &mut ignore)?;
                        }
                    }
                }
                // Deleted, cancelled or replaced since it was queued.
                _ => {}
            }
        }
        Ok(false)
    }

    /// Runs documents an interrupted run left before indexing through the pipeline again.
    pub(crate) fn resume(&mut self, coll: &mut Collection, docs: Vec<Document>) -> Result<()> {
        let started = Instant::now();
        let mut ignore = |_: Progress<'_>| {};
        let mut run = self.start_run(coll.clone(), JobKind::Resume, false)?;
        let res = (|| {
            for doc in docs {
                run.job.total += 1;
                let bytes = match self.original(&doc) {
                    Ok(b) => b,
                    Err(e) => {
                        let reason = format!("the stored original cannot be read: {e}");
                        self.fail(&mut run, doc, usize::MAX, reason, &mut ignore)?;
                        continue;
                    }
                };
                self.process(&mut run, doc, &bytes, usize::MAX, &mut ignore)?;
                if run.group_chunks >= EMBED_BATCH {
                    self.flush_group(&mut run, &mut ignore)?;
                }
            }
            self.flush_group(&mut run, &mut ignore)?;
            self.commit_run(&mut run, &mut ignore)
        })();
        *coll = run.coll.clone();
        self.finish_run(run, res, started).map(|_| ())
    }

    fn start_run(&mut self, coll: Collection, kind: JobKind, background: bool) -> Result<Run> {
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
        self.indexes_mut(&coll)?;
        Ok(Run {
            coll,
            report: IngestReport {
                job: job.id,
                ..IngestReport::default()
            },
            job,
            group: Vec::new(),
            group_chunks: 0,
            vectors: Vec::new(),
            uncommitted: Vec::new(),
            uncommitted_chunks: 0,
            background,
            failed_ids: Vec::new(),
        })
    }

    fn finish_run(&mut self, run: Run, res: Result<()>, started: Instant) -> Result<IngestReport> {
        let Run {
            mut job,
            mut report,
            ..
        } = run;
        job.finished_ms = Some(now_ms());
        job.state = match &res {
            Ok(()) => JobState::Done,
            Err(e) => JobState::Failed {
                reason: e.to_string(),
            },
        };
        let mut txn = Txn::default();
        txn.put_job(&job);
        // Record the job even after a failure, but report the failure that stopped it.
        let recorded = self.catalog.write(txn).and_then(|()| self.catalog.flush());
        res?;
        recorded?;
        report.elapsed = started.elapsed();
        Ok(report)
    }

    fn ingest_one(
        &mut self,
        run: &mut Run,
        nd: NewDocument,
        progress: &mut dyn FnMut(Progress<'_>),
    ) -> Result<()> {
        run.job.total += 1;
        let at = run.report.docs.len();
        run.report.docs.push(DocReport {
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
            run.report.docs[at].outcome = Outcome::Failed { reason };
            run.job.failed += 1;
            return Ok(());
        }
        let t = Instant::now();
        let (doc, (admission, id)) = self.store_doc(&mut run.coll, &nd, false)?;
        run.report.times.store += t.elapsed();
        match admission {
            Admission::Unchanged => {
                run.report.docs[at].outcome = Outcome::Unchanged { doc: id };
                run.job.done += 1;
                progress(Progress::Parsed { name: &nd.name });
                return Ok(());
            }
            Admission::Replaced { old } => {
                run.report.docs[at].outcome = Outcome::Replaced {
                    doc: 0,
                    chunks: 0,
                    old,
                };
            }
            Admission::Queued | Admission::Requeued => {}
        }
        let doc = doc.expect("a stored document unless unchanged");
        self.process(run, doc, &nd.bytes, at, progress)
    }

    /// The store step of ingestion. A document is a name in a collection: its id is handed
    /// out once and stays until the user deletes it. The same name with the same content is
    /// `Unchanged` (its metadata is updated) or, after a failure, `Requeued`; the same name with
    /// new content is `Replaced` in place (same id, next revision, old chunks gone); a new name
    /// is a new document, even when another name has the same bytes (the blob is shared).
    /// Stores the blob and the `queued` record (flushed when `flush`). Returns the record to
    /// process (none when unchanged), the admission and the document id.
    fn store_doc(
        &mut self,
        coll: &mut Collection,
        nd: &NewDocument,
        flush: bool,
    ) -> Result<(Option<Document>, (Admission, u64))> {
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
                return Ok((None, (Admission::Unchanged, d.id)));
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
                    revision: 0,
                };
                (d, Admission::Queued)
            }
        };
        let old = d.clone();
        if admission != Admission::Queued {
            d.revision += 1;
            d.error = None;
            d.chunks = 0;
            d.hash = hash.to_hex();
            d.size = nd.bytes.len() as u64;
            d.metadata = nd.metadata.clone();
            d.format = None;
            d.title = None;
        }
        // The blob first: a record never names content that is not stored.
        self.blobs.put(&nd.bytes)?;
        d.enter(Stage::Queued);
        if admission == Admission::Queued {
            let mut txn = Txn::default();
            txn.put_document(&d)?;
            self.catalog.write(txn)?;
        } else {
            // Its previous chunks leave the catalog and the indexes now; a run that still holds
            // the previous revision drops it (see `write_group`).
            self.unindex_document(coll, &old, &d)?;
        }
        if flush {
            self.catalog.flush()?;
        }
        if old.hash != d.hash {
            self.remove_blob_if_unused(crate::catalog::doc_hash(&old)?)?;
        }
        let id = d.id;
        Ok((Some(d), (admission, id)))
    }

    /// Parses and chunks one stored document and queues it for embedding.
    fn process(
        &mut self,
        run: &mut Run,
        mut doc: Document,
        bytes: &[u8],
        at: usize,
        progress: &mut dyn FnMut(Progress<'_>),
    ) -> Result<()> {
        let t = Instant::now();
        doc.enter(Stage::Parsing);
        let parsed = engram_parse::parse(&doc.name, bytes, &self.limits);
        run.report.times.parse += t.elapsed();
        let parsed = match parsed {
            Ok(p) => p,
            Err(e) => return self.fail(run, doc, at, format!("cannot parse: {e}"), progress),
        };
        progress(Progress::Parsed { name: &doc.name });
        doc.format = Some(format!("{:?}", parsed.format).to_lowercase());
        doc.title = parsed.title.clone();

        let t = Instant::now();
        doc.enter(Stage::Chunking);
        let spans = chunk_text(
            &parsed.text,
            &run.coll.chunking,
            self.models.tokens.as_ref(),
        );
        run.report.times.chunk += t.elapsed();
        if spans.is_empty() {
            return self.fail(
                run,
                doc,
                at,
                "no text found (a scanned PDF needs OCR before it can be ingested)".into(),
                progress,
            );
        }
        if spans.len() as u64 > MAX_CHUNKS_PER_DOC {
            let reason = format!(
                "{} chunks, more than the {MAX_CHUNKS_PER_DOC} a document may have: split the file or raise chunk_tokens",
                spans.len()
            );
            return self.fail(run, doc, at, reason, progress);
        }
        let chunks: Vec<Chunk> = spans
            .into_iter()
            .enumerate()
            .map(|(i, s)| Chunk {
                id: chunk_id(doc.id, i as u32),
                doc: doc.id,
                ordinal: i as u32,
                page: page_of(&parsed.pages, s.bytes.start),
                text: parsed.text[s.bytes.clone()].to_owned(),
                bytes: s.bytes,
                chars: s.chars,
                tokens: s.tokens as u32,
            })
            .collect();
        progress(Progress::Chunked {
            name: &doc.name,
            chunks: chunks.len(),
        });
        if run.background {
            // Visible between steps: the document waits for (or is in) the embedder.
            doc.enter(Stage::Embedding);
            let mut txn = Txn::default();
            txn.put_document(&doc)?;
            self.catalog.write(txn)?;
        }
        run.group_chunks += chunks.len();
        run.group.push(Pending {
            doc,
            chunks,
            report: at,
        });
        Ok(())
    }

    /// Records a failed document (durably, with its reason).
    fn fail(
        &mut self,
        run: &mut Run,
        mut doc: Document,
        at: usize,
        reason: String,
        progress: &mut dyn FnMut(Progress<'_>),
    ) -> Result<()> {
        doc.fail(reason.clone());
        let mut txn = Txn::default();
        txn.put_document(&doc)?;
        self.catalog.write(txn)?;
        if run.background {
            self.catalog.flush()?;
        }
        progress(Progress::Failed {
            name: &doc.name,
            reason: &reason,
        });
        if let Some(r) = run.report.docs.get_mut(at) {
            r.outcome = Outcome::Failed { reason };
        }
        run.job.failed += 1;
        run.failed_ids.push(doc.id);
        Ok(())
    }

    /// The group's chunks' indexed texts, in order.
    fn group_texts(group: &[Pending]) -> Vec<String> {
        group
            .iter()
            .flat_map(|p| {
                let title = p.doc.title.as_deref();
                p.chunks
                    .iter()
                    .map(move |c| c.indexed_text(title).into_owned())
            })
            .collect()
    }

    /// Embeds up to `budget` more chunks of the group (at most [`EMBED_BATCH`] per call of
    /// the embedder).
    fn embed_some(
        &mut self,
        run: &mut Run,
        budget: usize,
        progress: &mut dyn FnMut(Progress<'_>),
    ) -> Result<()> {
        let t = Instant::now();
        let texts = Self::group_texts(&run.group);
        let from = run.vectors.len();
        let to = from.saturating_add(budget).min(texts.len());
        for batch in texts[from..to].chunks(EMBED_BATCH) {
            let batch: Vec<&str> = batch.iter().map(String::as_str).collect();
            run.vectors.extend(self.models.embedder.embed(&batch)?);
            progress(Progress::Embedded {
                chunks: batch.len(),
            });
        }
        run.report.times.embed += t.elapsed();
        Ok(())
    }

    /// Embeds the queued documents' chunks, writes them to the catalog with one change-log
    /// entry per document, and adds them to the indexes (committed later).
    fn flush_group(&mut self, run: &mut Run, progress: &mut dyn FnMut(Progress<'_>)) -> Result<()> {
        if run.group.is_empty() {
            return Ok(());
        }
        for p in &mut run.group {
            if p.doc.stage != Stage::Embedding {
                p.doc.enter(Stage::Embedding);
            }
        }
        self.embed_some(run, usize::MAX, progress)?;
        self.write_group(run, progress)
    }

    /// Writes an embedded group to the catalog and the indexes; commits when enough chunks
    /// wait for a commit.
    fn write_group(&mut self, run: &mut Run, progress: &mut dyn FnMut(Progress<'_>)) -> Result<()> {
        let mut group = std::mem::take(&mut run.group);
        let mut vectors = std::mem::take(&mut run.vectors);
        run.group_chunks = 0;
        debug_assert_eq!(
            vectors.len(),
            group.iter().map(|p| p.chunks.len()).sum::<usize>()
        );
        if run.background {
            // A document deleted (or replaced) while it waited for the embedder is dropped.
            let mut keep = Vec::with_capacity(group.len());
            for p in &group {
                let live = self
                    .catalog
                    .document(p.doc.id)?
                    .is_some_and(|d| !d.stage.is_final() && d.revision == p.doc.revision);
                keep.push(live);
            }
            if keep.iter().any(|k| !k) {
                let mut kept_vectors = Vec::with_capacity(vectors.len());
                let mut vecs = vectors.into_iter();
                for (p, &k) in group.iter().zip(&keep) {
                    for _ in 0..p.chunks.len() {
                        let v = vecs.next().expect("one vector per chunk");
                        if k {
                            kept_vectors.push(v);
                        }
                    }
                }
                vectors = kept_vectors;
                let mut k = keep.iter();
                group.retain(|_| *k.next().expect("one flag per document"));
            }
            if group.is_empty() {
                return Ok(());
            }
        }
        let texts = Self::group_texts(&group);

        let t = Instant::now();
        let mut seq = self.catalog.seq()?;
        let mut txn = Txn::default();
        let mut vecs = vectors.iter();
        for p in &mut group {
            for c in &p.chunks {
                txn.put_chunk(c, vecs.next().expect("one vector per chunk"))?;
            }
            seq += 1;
            p.doc.chunks = p.chunks.len() as u32;
            p.doc.enter(Stage::Indexing);
            txn.put_document(&p.doc)?;
            txn.log(run.coll.id, seq, LogOp::Add { doc: p.doc.id });
            run.coll.documents += 1;
            run.coll.chunks += p.chunks.len() as u64;
        }
        run.coll.last_seq = seq;
        txn.put_collection(&run.coll);
        txn.set_seq(seq);
        self.catalog.write(txn)?;

        let chunk_docs: Vec<ChunkDoc<'_>> = group
            .iter()
            .flat_map(|p| p.chunks.iter())
            .zip(&texts)
            .map(|(c, t)| ChunkDoc {
                chunk_id: c.id,
                doc_id: c.doc,
                text: t,
            })
            .collect();
        let items: Vec<(u64, u64, &[f32])> = group
            .iter()
            .flat_map(|p| p.chunks.iter())
            .zip(&vectors)
            .map(|(c, v)| (c.id, c.doc, v.as_slice()))
            .collect();
        let idx = self.indexes_mut(&run.coll)?;
        idx.bm25.add(&chunk_docs)?;
        idx.vectors.add(&items)?;
        for p in &group {
            let n = p.chunks.len();
            run.uncommitted.push((p.doc.id, n));
            run.uncommitted_chunks += n;
            run.report.chunks += n as u64;
            if let Some(r) = run.report.docs.get_mut(p.report) {
                r.outcome = match r.outcome {
                    Outcome::Replaced { old, .. } => Outcome::Replaced {
                        doc: p.doc.id,
                        chunks: n as u32,
                        old,
                    },
                    _ => Outcome::Added {
                        doc: p.doc.id,
                        chunks: n as u32,
                    },
                };
            }
        }
        run.report.times.index += t.elapsed();
        if run.uncommitted_chunks >= COMMIT_EVERY && !run.background {
            self.commit_run(run, progress)?;
        }
        Ok(())
    }

    /// Commits the indexes and marks the uncommitted documents done.
    fn commit_run(&mut self, run: &mut Run, progress: &mut dyn FnMut(Progress<'_>)) -> Result<()> {
        if run.uncommitted.is_empty() {
            // Deletions (replaced documents) still need their commit.
            return self.commit_indexes(&mut run.coll, &[]);
        }
        let t = Instant::now();
        let docs: Vec<u64> = run.uncommitted.iter().map(|&(d, _)| d).collect();
        self.commit_indexes(&mut run.coll, &docs)?;
        run.report.times.index += t.elapsed();
        run.job.done += docs.len() as u64;
        let mut txn = Txn::default();
        txn.put_job(&run.job);
        self.catalog.write(txn)?;
        progress(Progress::Indexed {
            docs: docs.len(),
            chunks: run.uncommitted_chunks,
        });
        run.uncommitted.clear();
        run.uncommitted_chunks = 0;
        Ok(())
    }
}

/// The reason a cancelled document carries.
pub const CANCELLED: &str = "cancelled";

/// The 1-based page holding byte `at`, when the parser reported pages.
fn page_of(pages: &[std::ops::Range<usize>], at: usize) -> Option<u32> {
    if pages.is_empty() {
        return None;
    }
    let i = pages.partition_point(|p| p.end <= at);
    Some(i.min(pages.len() - 1) as u32 + 1)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_by_start_offset() {
        let pages = [0..10, 10..25, 25..30];
        assert_eq!(page_of(&pages, 0), Some(1));
        assert_eq!(page_of(&pages, 9), Some(1));
        assert_eq!(page_of(&pages, 10), Some(2));
        assert_eq!(page_of(&pages, 29), Some(3));
        assert_eq!(page_of(&pages, 99), Some(3));
        assert_eq!(page_of(&[], 3), None);
    }
}
