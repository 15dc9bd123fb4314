//! The catalog's records: collections, documents with their stage history, chunks, jobs and
//! the index change log, each stored as versioned JSON.

use std::collections::BTreeMap;
use std::ops::Range;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::chunker::ChunkConfig;
use crate::error::{KbError, Result};

/// Version of every JSON record's layout (the `v` field). Bump it, and teach [`decode`] the old
/// one, when a record changes shape.
pub const RECORD_VERSION: u32 = 1;

/// Version of the binary embedding records (first byte).
pub const EMBEDDING_VERSION: u8 = 1;

/// Bits of a chunk id that hold the chunk's ordinal in its document; the rest hold the
/// document id. 2^24 chunks is far more than a 32 MiB text makes at the smallest chunk size.
pub const ORDINAL_BITS: u32 = 24;

/// The most chunks one document may have (see [`ORDINAL_BITS`]).
pub const MAX_CHUNKS_PER_DOC: u64 = 1 << ORDINAL_BITS;

/// The id of a document's chunk: chunks of one document are contiguous in the `chunks` tree.
pub fn chunk_id(doc: u64, ordinal: u32) -> u64 {
    (doc << ORDINAL_BITS) | ordinal as u64
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A knowledge base: its documents are searched together, and only together.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Collection {
    pub id: u64,
    pub name: String,
    pub chunking: ChunkConfig,
    /// [`engram_embed::Embedder::model_id`] of the model its vectors come from.
    pub embed_model: String,
    /// Components of those vectors.
    pub dim: usize,
    pub created_ms: u64,
    /// Catalog sequence number of the last change to its documents (what its indexes must
    /// have committed to be current).
    pub last_seq: u64,
    /// Change-log entries at or below this sequence number were dropped: an index older than
    /// it is rebuilt rather than caught up.
    pub log_floor: u64,
    /// Documents that reached the indexing stage, and their chunks.
    pub documents: u64,
    pub chunks: u64,
}

/// Where a document is in the ingest flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// Stored (blob and catalog), waiting for the pipeline.
    Queued,
    Parsing,
    Chunking,
    Embedding,
    /// Chunks and vectors are in the catalog; the indexes are being updated.
    Indexing,
    /// Searchable.
    Done,
    /// Gave up; [`Document::error`] says why.
    Failed,
}

impl Stage {
    /// Lower-case name, as in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Queued => "queued",
            Stage::Parsing => "parsing",
            Stage::Chunking => "chunking",
            Stage::Embedding => "embedding",
            Stage::Indexing => "indexing",
            Stage::Done => "done",
            Stage::Failed => "failed",
        }
    }

    /// Done or failed: nothing more happens to the document.
    pub fn is_final(self) -> bool {
        matches!(self, Stage::Done | Stage::Failed)
    }
}

/// When a document entered a stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageTime {
    pub stage: Stage,
    pub at_ms: u64,
}

/// One uploaded file in a collection.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Document {
    pub id: u64,
    pub collection: u64,
    /// The file name it was uploaded as (unique in its collection).
    pub name: String,
    /// xxh3-128 of the original bytes, hex: the blob's address.
    pub hash: String,
    /// Bytes of the original file.
    pub size: u64,
    pub metadata: BTreeMap<String, String>,
    /// The parser's format name and the document's own title, once parsed.
    pub format: Option<String>,
    pub title: Option<String>,
    pub chunks: u32,
    pub stage: Stage,
    /// Every stage entered, in order.
    pub stages: Vec<StageTime>,
    /// Why it failed.
    pub error: Option<String>,
    /// What kind of failure (`Document::fail` callers' [`Failure`] names, parse errors' own
    /// `error_type`s): what a reader in another language is told, `error` being the detail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    /// Bumped each time the document goes back to the queue (new content under its name, a
    /// re-index): work still in flight for an earlier revision is dropped, not written.
    #[serde(default)]
    pub revision: u32,
    /// How far the pipeline is with it, while it is in the pipeline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<DocProgress>,
    /// What went wrong without failing it: scanned pages OCR could not read, each with why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// Where a document in the pipeline is, in units an operator can follow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DocProgress {
    /// Bytes of its parsed text, and how many of them are cut into chunks.
    pub text_bytes: u64,
    pub text_bytes_chunked: u64,
    /// Chunks it has (0 until it is chunked), how many are embedded and stored, and how many
    /// are in the indexes.
    pub chunks: u32,
    pub chunks_embedded: u32,
    pub chunks_indexed: u32,
    /// Scanned pages OCR has to read (images and PDF pages without a text layer), and how many
    /// it has read so far.
    #[serde(default)]
    pub ocr_pages: u32,
    #[serde(default)]
    pub ocr_pages_done: u32,
}

impl Document {
    /// Moves to `stage`, stamping the time.
    pub fn enter(&mut self, stage: Stage) {
        self.stage = stage;
        self.stages.push(StageTime {
            stage,
            at_ms: now_ms(),
        });
    }

    /// Moves to [`Stage::Failed`] with the kind of failure and the reason in detail.
    pub fn fail(&mut self, kind: &str, reason: impl Into<String>) {
        self.error = Some(reason.into());
        self.failure = Some(kind.to_owned());
        self.progress = None;
        self.enter(Stage::Failed);
    }

    /// Its progress, created on first use.
    pub fn progress_mut(&mut self) -> &mut DocProgress {
        self.progress.get_or_insert_with(DocProgress::default)
    }
}

/// One span of a document's text, the unit that is embedded, indexed and cited.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunk {
    /// [`chunk_id`] of the document and ordinal.
    pub id: u64,
    pub doc: u64,
    pub ordinal: u32,
    /// Byte range in the parsed text of the document.
    pub bytes: Range<usize>,
    /// The same range in chars.
    pub chars: Range<usize>,
    /// LLM tokens of `text`.
    pub tokens: u32,
    /// 1-based page of the chunk's start (PDF only).
    pub page: Option<u32>,
    pub text: String,
}

impl Chunk {
    /// The document a chunk id belongs to.
    pub fn doc_of(chunk_id: u64) -> u64 {
        chunk_id >> ORDINAL_BITS
    }

    /// The text that is embedded and BM25-indexed: the chunk, preceded by its document's title
    /// when the document names one that the chunk does not already contain. A chunk from the
    /// middle of a document is then still found by what the document is about, and the title
    /// costs nothing in the stored text or the citation spans.
    pub fn indexed_text(&self, title: Option<&str>) -> std::borrow::Cow<'_, str> {
        match title.map(str::trim) {
            Some(t) if !t.is_empty() && !self.text.contains(t) => {
                format!("{t}\n\n{}", self.text).into()
            }
            _ => self.text.as_str().into(),
        }
    }
}

/// What a job does.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum JobKind {
    /// Ingest a batch of uploaded documents.
    Ingest,
    /// Re-embed every chunk of the collection with a new model and rebuild its vector index.
    Reembed {
        from_model: String,
        to_model: String,
    },
    /// Resume documents an interrupted run left half-way.
    Resume,
}

/// Where a job is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Running,
    Done,
    /// Stopped by an error (the documents it had finished stay finished).
    Failed {
        reason: String,
    },
    /// The process stopped while it ran; its documents are resumed on the next start.
    Interrupted,
}

/// An ingestion or maintenance job and its counts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    pub id: u64,
    pub collection: u64,
    pub kind: JobKind,
    pub state: JobState,
    pub started_ms: u64,
    pub finished_ms: Option<u64>,
    /// Documents (or chunks, for re-embedding) to process, processed, failed.
    pub total: u64,
    pub done: u64,
    pub failed: u64,
}

/// One change to a collection's documents, replayed onto an index that is behind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogOp {
    /// The document's chunks were written: (re)index them.
    Add { doc: u64 },
    /// The document was removed: drop its chunks.
    Delete { doc: u64 },
    /// Every vector was recomputed (new embedding model): rebuild the vector index.
    Reembed,
}

#[derive(Serialize)]
struct Envelope<'a, T> {
    v: u32,
    r: &'a T,
}

#[derive(Deserialize)]
struct OwnedEnvelope<T> {
    v: u32,
    r: T,
}

/// `{"v": RECORD_VERSION, "r": record}`.
pub fn encode<T: Serialize>(record: &T) -> Vec<u8> {
    serde_json::to_vec(&Envelope {
        v: RECORD_VERSION,
        r: record,
    })
    .expect("records serialise to JSON")
}

/// Decodes [`encode`]'s output; anything else is [`KbError::Corrupted`] naming `what`.
pub fn decode<T: DeserializeOwned>(what: impl FnOnce() -> String, bytes: &[u8]) -> Result<T> {
    match serde_json::from_slice::<OwnedEnvelope<T>>(bytes) {
        Ok(e) if e.v == RECORD_VERSION => Ok(e.r),
        Ok(e) => Err(KbError::corrupted(
            what(),
            format!("record version {} (this build reads {RECORD_VERSION})", e.v),
        )),
        Err(err) => Err(KbError::corrupted(what(), err.to_string())),
    }
}

/// `[version u8][dim u32 LE][dim x f32 LE]`.
pub fn encode_embedding(v: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + 4 * v.len());
    out.push(EMBEDDING_VERSION);
    out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

/// Decodes [`encode_embedding`]'s output.
pub fn decode_embedding(chunk: u64, bytes: &[u8]) -> Result<Vec<f32>> {
    let bad = |comment: String| KbError::corrupted(format!("embedding of chunk {chunk}"), comment);
    if bytes.len() < 5 || bytes[0] != EMBEDDING_VERSION {
        return Err(bad(format!(
            "expected version {EMBEDDING_VERSION} and a length, got {} bytes",
            bytes.len()
        )));
    }
    let dim = u32::from_le_bytes(bytes[1..5].try_into().expect("4 bytes")) as usize;
    if bytes.len() != 5 + 4 * dim {
        return Err(bad(format!(
            "{dim} components need {} bytes, got {}",
            5 + 4 * dim,
            bytes.len()
        )));
    }
    Ok(bytes[5..]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_with_version() {
        let job = Job {
            id: 3,
            collection: 1,
            kind: JobKind::Reembed {
                from_model: "a".into(),
                to_model: "b".into(),
            },
            state: JobState::Failed {
                reason: "disk full".into(),
            },
            started_ms: 5,
            finished_ms: Some(9),
            total: 10,
            done: 4,
            failed: 1,
        };
        let bytes = encode(&job);
        assert!(bytes.starts_with(br#"{"v":1,"r":"#));
        assert_eq!(decode::<Job>(|| "job".into(), &bytes).unwrap(), job);
        let future = String::from_utf8(bytes)
            .unwrap()
            .replace(r#""v":1"#, r#""v":2"#);
        let err = decode::<Job>(|| "job 3".into(), future.as_bytes()).unwrap_err();
        assert!(matches!(err, KbError::Corrupted { .. }), "{err}");
        assert!(decode::<Job>(|| "job".into(), b"{garbage").is_err());
    }

    #[test]
    fn embeddings_round_trip_and_reject_truncation() {
        let v = vec![0.25f32, -1.0, 3.5];
        let bytes = encode_embedding(&v);
        assert_eq!(decode_embedding(1, &bytes).unwrap(), v);
        assert!(decode_embedding(1, &bytes[..bytes.len() - 1]).is_err());
        assert!(decode_embedding(1, &[]).is_err());
    }

    #[test]
    fn chunk_ids_keep_documents_contiguous() {
        assert_eq!(chunk_id(7, 3) >> ORDINAL_BITS, 7);
        assert!(chunk_id(7, (MAX_CHUNKS_PER_DOC - 1) as u32) < chunk_id(8, 0));
    }
}
