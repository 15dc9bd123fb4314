//! Knowledge bases: the catalog that is the source of truth, token-aware chunking, the ingest
//! pipeline and hybrid search, around the parsers (`engram-parse`), the indexes
//! (`engram-index`) and the embedder (`engram-embed`).
//!
//! # Why
//!
//! A knowledge base must never lose an acknowledged document and never show a stale or broken
//! index. So one sled catalog holds everything (collections, documents with their stage
//! history, chunks with their text, spans and vectors, jobs, and a change log), the original
//! bytes sit in a content-addressed blob store, and the BM25 and vector indexes are derived
//! data: each carries the catalog sequence number it was committed at, and on start-up an
//! index that is behind catches up from the change log while one that is missing, corrupt or
//! inconsistent is rebuilt from the catalog, without re-embedding. A collection records the
//! embedding model of its vectors; opening it with another model re-embeds its chunks.
//!
//! # Example
//!
//! ```no_run
//! use std::sync::Arc;
//! use engram_kb::{ChunkConfig, KnowledgeBase, Models, NewDocument, SearchRequest};
//!
//! let gguf = engram_gguf::GgufFile::open("models/SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! let llm_tokens = Arc::new(engram_tokenizer::Tokenizer::from_gguf(gguf.metadata())?);
//! let models = Models::load("models/all-MiniLM-L6-v2".as_ref(), 2, llm_tokens)?;
//! let mut kb = KnowledgeBase::open("data".as_ref(), models)?;
//! kb.ensure_collection("handbook", ChunkConfig::default())?;
//! let doc = NewDocument::new("leave.md", "# Leave\n\nEveryone gets 25 days of paid leave.");
//! let report = kb.ingest("handbook", [doc], &mut |_| {})?;
//! assert_eq!(report.failures().count(), 0);
//! for hit in kb.search(&SearchRequest::new("handbook", "how many vacation days?"))?.hits {
//!     println!("{:.3} {} {:?}: {}", hit.score, hit.doc_name, hit.bytes, hit.text);
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]

mod blobs;
mod catalog;
mod chunker;
mod error;
mod ingest;
mod kb;
mod prepare;
mod records;
mod search;
mod snapshot;

pub use blobs::ContentHash;
pub use catalog::SCHEMA_VERSION;
pub use chunker::{
    chunk_text, ChunkConfig, ChunkSpan, Chunker, TokenCounter, DEFAULT_CHUNK_TOKENS,
    DEFAULT_OVERLAP_TOKENS, MAX_CHUNK_TOKENS, MIN_CHUNK_TOKENS,
};
pub use engram_index::FusionMode;
pub use error::{KbError, Result};
pub use ingest::{
    Accepted, Admission, DocReport, Finished, IndexStep, IngestReport, NewDocument, Outcome,
    Progress, QueueStep, StageTimes, CANCELLED, COMMIT_INTERVAL, INDEX_STEP, JOB_MAX_BYTES,
    JOB_MAX_DOCS,
};
pub use kb::{
    blind_pieces, dir_size, KnowledgeBase, Models, Recovery, COMMIT_EVERY, EMBED_BATCH,
    MIN_CJK_VOCAB, MIN_OPEN_FREE,
};
pub use prepare::{prepare, PrepareDoc, PrepareJob, Prepared, CHUNK_CHECK_EVERY};
pub use records::{
    Chunk, Collection, DocProgress, Document, Job, JobKind, JobState, Stage, StageTime,
    RECORD_VERSION,
};
pub use search::{
    rank, DenseSignal, Retrieved, SearchHit, SearchMode, SearchRequest, SearchResults,
    BLIND_SHARE_FULL, BLIND_SHARE_NONE, DEFAULT_BM25_WEIGHT, DEFAULT_CANDIDATES,
    DEFAULT_DENSE_WEIGHT, DEFAULT_FUSION, DEFAULT_RRF_K, MAX_QUERY_BYTES,
};
pub use snapshot::{copy_tree, skipped_in_snapshot, SnapshotStats};
