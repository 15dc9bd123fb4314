//! The compute half of ingestion: parse, chunk and embed documents, with no access to the
//! catalog or the indexes, so that it runs on a thread of its own while the knowledge base's
//! owner goes on answering queries (the daemon), or inline (the command line).
//!
//! [`prepare`] takes a [`PrepareJob`] (documents of one collection with their original bytes)
//! and reports each step as a [`Prepared`] message: parsed, chunking progress, chunked, runs of
//! embedded chunks, finished, or failed. The owner applies the messages with
//! [`KnowledgeBase::apply`](crate::KnowledgeBase::apply); a message for a revision that is no
//! longer current (the document was deleted, cancelled or replaced meanwhile) is dropped there.
//!
//! Work is bounded for quick stops: a document's cancel flag is checked between parsing and
//! chunking, every [`CHUNK_CHECK_EVERY`] chunks, and before every embedding batch of at most
//! `batch_chunks` chunks (the daemon uses one packed batch of the encoder, about a second).
//! Chunks of several small documents share a batch, which is what keeps the encoder's packed
//! batches full.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::chunker::{ChunkConfig, ChunkSpan, Chunker};
use crate::ingest::StageTimes;
use crate::kb::Models;
use crate::records::{chunk_id, Chunk, MAX_CHUNKS_PER_DOC};

/// Chunks cut between two looks at the cancel flag (and two progress reports at most).
pub const CHUNK_CHECK_EVERY: usize = 64;

/// Least time between two chunking progress reports of one document.
const PROGRESS_EVERY: Duration = Duration::from_millis(500);

/// One document to prepare.
#[derive(Debug)]
pub struct PrepareDoc {
    pub doc: u64,
    pub revision: u32,
    pub name: String,
    pub bytes: Vec<u8>,
    /// Chunks an interrupted run already stored: how many, and the byte span of the last. When
    /// the document chunks the same way again, only the chunks after them are embedded.
    pub stored: Option<(u32, Range<usize>)>,
    /// Set by the owner to stop the work on this document (cancelled, deleted, replaced).
    pub cancel: Arc<AtomicBool>,
}

impl PrepareDoc {
    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }
}

/// Documents of one collection to prepare together.
#[derive(Debug)]
pub struct PrepareJob {
    pub collection: u64,
    pub chunking: ChunkConfig,
    pub docs: Vec<PrepareDoc>,
}

impl PrepareJob {
    /// Bytes of original content in the job.
    pub fn bytes(&self) -> usize {
        self.docs.iter().map(|d| d.bytes.len()).sum()
    }
}

/// What preparing a document did, step by step.
#[derive(Clone, Debug, PartialEq)]
pub enum Prepared {
    /// OCR is reading its scanned pages: `done` of `pages` so far.
    Reading {
        doc: u64,
        revision: u32,
        done: u32,
        pages: u32,
    },
    /// Parsed: its format, its own title, the length of its text, and the scanned pages OCR
    /// could not read (each with why).
    Parsed {
        doc: u64,
        revision: u32,
        format: String,
        title: Option<String>,
        text_bytes: u64,
        warnings: Vec<String>,
    },
    /// Chunking a long text: bytes of it behind the cut so far.
    Chunking { doc: u64, revision: u32, done: u64 },
    /// Cut into `chunks` chunks, the first `stored` of which are already in the catalog.
    Chunked {
        doc: u64,
        revision: u32,
        chunks: u32,
        stored: u32,
    },
    /// Consecutive chunks with their vectors.
    Embedded {
        doc: u64,
        revision: u32,
        chunks: Vec<Chunk>,
        vectors: Vec<Vec<f32>>,
    },
    /// Every chunk was sent.
    Finished { doc: u64, revision: u32 },
    /// Gave up; `kind` names the failure (a parse error's `error_type`, `no_text`,
    /// `too_many_chunks`, `embedding`), the reason says what to do.
    Failed {
        doc: u64,
        revision: u32,
        kind: &'static str,
        reason: String,
    },
}

impl Prepared {
    /// The document and revision the message is about.
    pub fn doc(&self) -> (u64, u32) {
        match *self {
            Prepared::Parsed { doc, revision, .. }
            | Prepared::Reading { doc, revision, .. }
            | Prepared::Chunking { doc, revision, .. }
            | Prepared::Chunked { doc, revision, .. }
            | Prepared::Embedded { doc, revision, .. }
            | Prepared::Finished { doc, revision }
            | Prepared::Failed { doc, revision, .. } => (doc, revision),
        }
    }
}

/// A parsed and chunked document whose chunks are being embedded.
struct Cut {
    doc: u64,
    revision: u32,
    title: Option<String>,
    text: String,
    pages: Vec<Range<usize>>,
    spans: Vec<ChunkSpan>,
    /// Next chunk to embed.
    next: usize,
    cancel: Arc<AtomicBool>,
}

impl Cut {
    fn chunk(&self, ordinal: usize) -> Chunk {
        let s = &self.spans[ordinal];
        Chunk {
            id: chunk_id(self.doc, ordinal as u32),
            doc: self.doc,
            ordinal: ordinal as u32,
            page: page_of(&self.pages, s.bytes.start),
            text: self.text[s.bytes.clone()].to_owned(),
            bytes: s.bytes.clone(),
            chars: s.chars.clone(),
            tokens: s.tokens as u32,
        }
    }
}

/// Prepares every document of `job`, reporting to `sink`; embeds at most `batch_chunks` chunks
/// per call of the embedder. Returns the time spent per stage.
pub fn prepare(
    models: &Models,
    limits: &engram_parse::Limits,
    ocr: Option<&engram_parse::Ocr>,
    job: PrepareJob,
    batch_chunks: usize,
    sink: &mut dyn FnMut(Prepared),
) -> StageTimes {
    let batch_chunks = batch_chunks.max(1);
    let mut times = StageTimes::default();
    let mut docs: VecDeque<PrepareDoc> = job.docs.into();
    let mut cut: VecDeque<Cut> = VecDeque::new();
    loop {
        // Cut documents until a batch is full (or none are left), then embed one batch.
        let waiting: usize = cut.iter().map(|c| c.spans.len() - c.next).sum();
        if waiting < batch_chunks {
            if let Some(d) = docs.pop_front() {
                if let Some(c) = cut_doc(models, limits, ocr, &job.chunking, d, &mut times, sink) {
                    cut.push_back(c);
                }
                continue;
            }
        }
        cut.retain(|c| !c.cancel.load(Ordering::Relaxed));
        if cut.is_empty() {
            if docs.is_empty() {
                return times;
            }
            continue;
        }
        embed_batch(models, &mut cut, batch_chunks, &mut times, sink);
    }
}

/// Parses and chunks one document; `None` when it failed (reported), was cancelled, or has
/// nothing left to embed (reported finished).
fn cut_doc(
    models: &Models,
    limits: &engram_parse::Limits,
    ocr: Option<&engram_parse::Ocr>,
    chunking: &ChunkConfig,
    d: PrepareDoc,
    times: &mut StageTimes,
    sink: &mut dyn FnMut(Prepared),
) -> Option<Cut> {
    let (doc, revision) = (d.doc, d.revision);
    let fail = |sink: &mut dyn FnMut(Prepared), kind: &'static str, reason: String| {
        sink(Prepared::Failed {
            doc,
            revision,
            kind,
            reason,
        })
    };
    if d.cancelled() {
        return None;
    }
    let t = Instant::now();
    let parsed = engram_parse::parse_with(&d.name, &d.bytes, limits, ocr, &mut |p| {
        sink(Prepared::Reading {
            doc,
            revision,
            done: p.done as u32,
            pages: p.pages as u32,
        })
    });
    times.parse += t.elapsed();
    let parsed = match parsed {
        Ok(p) => p,
        Err(e) => {
            fail(sink, e.error_type(), format!("cannot parse: {e}"));
            return None;
        }
    };
    drop(d.bytes);
    sink(Prepared::Parsed {
        doc,
        revision,
        format: format!("{:?}", parsed.format).to_lowercase(),
        title: parsed.title.clone(),
        text_bytes: parsed.text.len() as u64,
        warnings: parsed.ocr_failures.clone(),
    });

    let t = Instant::now();
    let mut chunker = Chunker::new(&parsed.text, *chunking, models.tokens.as_ref());
    let mut spans = Vec::new();
    let mut reported = Instant::now();
    loop {
        if spans.len() % CHUNK_CHECK_EVERY == 0 && !spans.is_empty() {
            if d.cancel.load(Ordering::Relaxed) {
                times.chunk += t.elapsed();
                return None;
            }
            if reported.elapsed() >= PROGRESS_EVERY {
                sink(Prepared::Chunking {
                    doc,
                    revision,
                    done: chunker.position() as u64,
                });
                reported = Instant::now();
            }
        }
        match chunker.next() {
            Some(s) => spans.push(s),
            None => break,
        }
        if spans.len() as u64 > MAX_CHUNKS_PER_DOC {
            break;
        }
    }
    times.chunk += t.elapsed();
    if spans.is_empty() {
        fail(
            sink,
            "no_text",
            "no text found (a scanned PDF needs OCR before it can be ingested)".into(),
        );
        return None;
    }
    if spans.len() as u64 > MAX_CHUNKS_PER_DOC {
        fail(
            sink,
            "too_many_chunks",
            format!(
                "more than the {MAX_CHUNKS_PER_DOC} chunks a document may have: split the file or raise chunk_tokens"
            ),
        );
        return None;
    }
    // Chunks an interrupted run stored are kept when the document still cuts the same way.
    let stored = match &d.stored {
        Some((n, last))
            if *n as usize <= spans.len() && *n > 0 && spans[*n as usize - 1].bytes == *last =>
        {
            *n as usize
        }
        _ => 0,
    };
    sink(Prepared::Chunked {
        doc,
        revision,
        chunks: spans.len() as u32,
        stored: stored as u32,
    });
    if stored == spans.len() {
        sink(Prepared::Finished { doc, revision });
        return None;
    }
    Some(Cut {
        doc,
        revision,
        title: parsed.title,
        text: parsed.text,
        pages: parsed.pages,
        spans,
        next: stored,
        cancel: d.cancel,
    })
}

/// Embeds the next `batch_chunks` chunks waiting in `cut` (across documents, in order) and
/// reports them; drops documents that are finished.
fn embed_batch(
    models: &Models,
    cut: &mut VecDeque<Cut>,
    batch_chunks: usize,
    times: &mut StageTimes,
    sink: &mut dyn FnMut(Prepared),
) {
    // (index in `cut`, first ordinal, end ordinal) of each document's share of the batch.
    let mut shares: Vec<(usize, usize, usize)> = Vec::new();
    let mut left = batch_chunks;
    for (i, c) in cut.iter().enumerate() {
        if left == 0 {
            break;
        }
        let n = (c.spans.len() - c.next).min(left);
        shares.push((i, c.next, c.next + n));
        left -= n;
    }
    let chunks: Vec<Vec<Chunk>> = shares
        .iter()
        .map(|&(i, from, to)| (from..to).map(|o| cut[i].chunk(o)).collect())
        .collect();
    let texts: Vec<String> = shares
        .iter()
        .zip(&chunks)
        .flat_map(|(&(i, _, _), cs)| {
            let title = cut[i].title.as_deref();
            cs.iter().map(move |c| c.indexed_text(title).into_owned())
        })
        .collect();
    let t = Instant::now();
    let texts_ref: Vec<&str> = texts.iter().map(String::as_str).collect();
    let embedded = models.embedder.embed(&texts_ref);
    times.embed += t.elapsed();
    match embedded {
        Ok(vectors) => {
            let mut vectors = vectors.into_iter();
            for (&(i, _, to), cs) in shares.iter().zip(chunks) {
                let c = &mut cut[i];
                let vs: Vec<Vec<f32>> = vectors.by_ref().take(cs.len()).collect();
                c.next = to;
                sink(Prepared::Embedded {
                    doc: c.doc,
                    revision: c.revision,
                    chunks: cs,
                    vectors: vs,
                });
                if c.next == c.spans.len() {
                    sink(Prepared::Finished {
                        doc: c.doc,
                        revision: c.revision,
                    });
                }
            }
        }
        Err(e) => {
            for &(i, _, _) in &shares {
                let c = &mut cut[i];
                c.next = c.spans.len();
                sink(Prepared::Failed {
                    doc: c.doc,
                    revision: c.revision,
                    kind: "embedding",
                    reason: format!("embedding failed: {e}"),
                });
            }
        }
    }
    cut.retain(|c| c.next < c.spans.len());
}

/// The 1-based page holding byte `at`, when the parser reported pages.
fn page_of(pages: &[Range<usize>], at: usize) -> Option<u32> {
    if pages.is_empty() {
        return None;
    }
    let i = pages.partition_point(|p| p.end <= at);
    Some(i.min(pages.len() - 1) as u32 + 1)
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
