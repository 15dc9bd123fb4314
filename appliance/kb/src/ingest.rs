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

use std::collections::BTreeMap;
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
struct Run<'p> {
    coll: Collection,
    job: Job,
    report: IngestReport,
    group: Vec<Pending>,
    group_chunks: usize,
    /// Documents in the indexes but not yet committed, and their chunk count.
    uncommitted: Vec<(u64, usize)>,
    uncommitted_chunks: usize,
    progress: &'p mut dyn FnMut(Progress<'_>),
}

impl KnowledgeBase {
    /// Ingests documents into the collection `collection` (which must exist), streaming: each
    /// document is stored and parsed as it arrives, chunks are embedded [`EMBED_BATCH`] at a
    /// time, and the indexes commit every [`COMMIT_EVERY`] chunks and at the end. A document
    /// that cannot be parsed is reported as failed; the others go on. Everything reported is
    /// durable when this returns.
    pub fn ingest(
        &mut self,
        collection: &str,
        docs: impl IntoIterator<Item = NewDocument>,
        progress: &mut dyn FnMut(Progress<'_>),
    ) -> Result<IngestReport> {
        let started = Instant::now();
        let coll = self.collection(collection)?;
        let mut run = self.start_run(coll, JobKind::Ingest, progress)?;
        let res = (|| {
            for nd in docs {
                self.ingest_one(&mut run, nd)?;
            }
            self.flush_group(&mut run)?;
            self.commit_run(&mut run)
        })();
        self.finish_run(run, res, started)
    }

    /// Runs documents an interrupted run left before indexing through the pipeline again.
    pub(crate) fn resume(&mut self, coll: &mut Collection, docs: Vec<Document>) -> Result<()> {
        let started = Instant::now();
        let mut ignore = |_: Progress<'_>| {};
        let mut run = self.start_run(coll.clone(), JobKind::Resume, &mut ignore)?;
        let res = (|| {
            for doc in docs {
                run.job.total += 1;
                let bytes = match self.original(&doc) {
                    Ok(b) => b,
                    Err(e) => {
                        let reason = format!("the stored original cannot be read: {e}");
                        self.fail(&mut run, doc, usize::MAX, reason)?;
                        continue;
                    }
                };
                self.process(&mut run, doc, &bytes, usize::MAX)?;
            }
            self.flush_group(&mut run)?;
            self.commit_run(&mut run)
        })();
        *coll = run.coll.clone();
        self.finish_run(run, res, started).map(|_| ())
    }

    fn start_run<'p>(
        &mut self,
        coll: Collection,
        kind: JobKind,
        progress: &'p mut dyn FnMut(Progress<'_>),
    ) -> Result<Run<'p>> {
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
            uncommitted: Vec::new(),
            uncommitted_chunks: 0,
            progress,
        })
    }

    fn finish_run(
        &mut self,
        run: Run<'_>,
        res: Result<()>,
        started: Instant,
    ) -> Result<IngestReport> {
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

    fn ingest_one(&mut self, run: &mut Run<'_>, nd: NewDocument) -> Result<()> {
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
            (run.progress)(Progress::Failed {
                name: &nd.name,
                reason: &reason,
            });
            run.report.docs[at].outcome = Outcome::Failed { reason };
            run.job.failed += 1;
            return Ok(());
        }
        let t = Instant::now();
        let hash = crate::blobs::ContentHash::of(&nd.bytes);
        let coll_id = run.coll.id;
        let existing = match self.catalog.doc_by_hash(coll_id, hash)? {
            Some(id) => self.catalog.document(id)?,
            None => None,
        };
        let doc = match existing {
            Some(d) if d.stage == Stage::Done => {
                run.report.docs[at].outcome = Outcome::Unchanged { doc: d.id };
                run.job.done += 1;
                (run.progress)(Progress::Parsed { name: &nd.name });
                return Ok(());
            }
            Some(mut d) if d.name == nd.name => {
                // Failed before, or left half-way: run it again under the same id.
                let mut txn = Txn::default();
                for c in self.catalog.chunks(d.id)? {
                    txn.remove_chunk(c.id);
                }
                d.error = None;
                d.chunks = 0;
                d.enter(Stage::Queued);
                txn.put_document(&d)?;
                self.catalog.write(txn)?;
                d
            }
            other => {
                // Same content under another name that is not done: that one is replaced too.
                if let Some(d) = other {
                    self.remove_document(&mut run.coll, &d)?;
                }
                let replaced = match self.catalog.doc_by_name(coll_id, &nd.name)? {
                    Some(old) => self.catalog.document(old)?,
                    None => None,
                };
                if let Some(old) = &replaced {
                    self.remove_document(&mut run.coll, old)?;
                    self.remove_blob_if_unused(crate::catalog::doc_hash(old)?)?;
                    run.report.docs[at].outcome = Outcome::Replaced {
                        doc: 0,
                        chunks: 0,
                        old: old.id,
                    };
                }
                self.blobs.put(&nd.bytes)?;
                let mut d = Document {
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
                };
                d.enter(Stage::Queued);
                let mut txn = Txn::default();
                txn.put_document(&d)?;
                self.catalog.write(txn)?;
                d
            }
        };
        run.report.times.store += t.elapsed();
        self.process(run, doc, &nd.bytes, at)
    }

    /// Parses and chunks one stored document and queues it for embedding.
    fn process(
        &mut self,
        run: &mut Run<'_>,
        mut doc: Document,
        bytes: &[u8],
        at: usize,
    ) -> Result<()> {
        let t = Instant::now();
        doc.enter(Stage::Parsing);
        let parsed = engram_parse::parse(&doc.name, bytes, &self.limits);
        run.report.times.parse += t.elapsed();
        let parsed = match parsed {
            Ok(p) => p,
            Err(e) => return self.fail(run, doc, at, format!("cannot parse: {e}")),
        };
        (run.progress)(Progress::Parsed { name: &doc.name });
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
            );
        }
        if spans.len() as u64 > MAX_CHUNKS_PER_DOC {
            let reason = format!(
                "{} chunks, more than the {MAX_CHUNKS_PER_DOC} a document may have: split the file or raise chunk_tokens",
                spans.len()
            );
            return self.fail(run, doc, at, reason);
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
        (run.progress)(Progress::Chunked {
            name: &doc.name,
            chunks: chunks.len(),
        });
        run.group_chunks += chunks.len();
        run.group.push(Pending {
            doc,
            chunks,
            report: at,
        });
        if run.group_chunks >= EMBED_BATCH {
            self.flush_group(run)?;
        }
        Ok(())
    }

    /// Records a failed document (durably, with its reason).
    fn fail(
        &mut self,
        run: &mut Run<'_>,
        mut doc: Document,
        at: usize,
        reason: String,
    ) -> Result<()> {
        doc.fail(reason.clone());
        let mut txn = Txn::default();
        txn.put_document(&doc)?;
        self.catalog.write(txn)?;
        (run.progress)(Progress::Failed {
            name: &doc.name,
            reason: &reason,
        });
        if let Some(r) = run.report.docs.get_mut(at) {
            r.outcome = Outcome::Failed { reason };
        }
        run.job.failed += 1;
        Ok(())
    }

    /// Embeds the queued documents' chunks, writes them to the catalog with one change-log
    /// entry per document, and adds them to the indexes (committed later).
    fn flush_group(&mut self, run: &mut Run<'_>) -> Result<()> {
        if run.group.is_empty() {
            return Ok(());
        }
        let mut group = std::mem::take(&mut run.group);
        run.group_chunks = 0;
        for p in &mut group {
            p.doc.enter(Stage::Embedding);
        }
        let t = Instant::now();
        let texts: Vec<String> = group
            .iter()
            .flat_map(|p| {
                let title = p.doc.title.as_deref();
                p.chunks
                    .iter()
                    .map(move |c| c.indexed_text(title).into_owned())
            })
            .collect();
        let mut vectors = Vec::with_capacity(texts.len());
        for batch in texts.chunks(EMBED_BATCH) {
            let batch: Vec<&str> = batch.iter().map(String::as_str).collect();
            vectors.extend(self.models.embedder.embed(&batch)?);
            (run.progress)(Progress::Embedded {
                chunks: batch.len(),
            });
        }
        run.report.times.embed += t.elapsed();

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
        if run.uncommitted_chunks >= COMMIT_EVERY {
            self.commit_run(run)?;
        }
        Ok(())
    }

    /// Commits the indexes and marks the uncommitted documents done.
    fn commit_run(&mut self, run: &mut Run<'_>) -> Result<()> {
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
        (run.progress)(Progress::Indexed {
            docs: docs.len(),
            chunks: run.uncommitted_chunks,
        });
        run.uncommitted.clear();
        run.uncommitted_chunks = 0;
        Ok(())
    }
}

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
