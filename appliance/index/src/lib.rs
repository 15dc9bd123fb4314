//! Retrieval indexes of one knowledge-base collection: BM25 over chunk text, HNSW over chunk
//! embeddings, and the fusion of their rankings.
//!
//! One [`Bm25Index`] and one [`VectorIndex`] per collection, each in its own directory, so a
//! query can only ever see the chunks of the collection it was opened for. The catalog (in
//! `engram-kb`) is the source of truth: both indexes record the catalog sequence number they
//! were last committed at ([`Bm25Index::seq`], [`VectorIndex::seq`]), so the catalog can tell an
//! index that is behind, and an index whose open fails with an error for which
//! [`IndexError::needs_rebuild`] holds (`Corrupt`, `Mismatch`) is rebuilt from the catalog.
//!
//! - `bm25`: tantivy, one field; `analyzer` segments text by script (jieba for Han runs, the
//!   stemmed English chain for the rest), so either script of a mixed chunk is searchable.
//! - `vector`: hnsw_rs with tombstones, compaction, and a checksummed on-disk format.
//! - `fusion`: reciprocal-rank and weighted min-max fusion of the two candidate lists.
//!
//! ```
//! use engram_index::{fuse, Bm25Index, ChunkDoc, Fusion, VectorIndex};
//!
//! # fn main() -> engram_index::Result<()> {
//! let dir = tempfile::tempdir().unwrap();
//! let mut bm25 = Bm25Index::open_or_create(&dir.path().join("bm25"))?;
//! let mut vectors = VectorIndex::open_or_create(&dir.path().join("vectors"), 2, "toy-model")?;
//!
//! bm25.add(&[
//!     ChunkDoc { chunk_id: 1, doc_id: 10, text: "The cat runs after the mouse" },
//!     ChunkDoc { chunk_id: 2, doc_id: 20, text: "Dogs sleep all day" },
//! ])?;
//! vectors.add(&[(1, 10, &[1.0, 0.0]), (2, 20, &[0.0, 1.0])])?;
//! bm25.commit(1)?;
//! vectors.commit(1)?;
//!
//! let lexical = bm25.search("running cats", 100, None)?;
//! let dense = vectors.search(&[0.9, 0.1], 100, None)?;
//! let fused = fuse(&lexical, &dense, Fusion::default());
//! assert_eq!(fused[0].chunk_id, 1);
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]

mod analyzer;
mod bm25;
mod error;
mod fusion;
mod vector;

#[cfg(test)]
mod tests;

use std::collections::HashSet;

pub use bm25::Bm25Index;
/// The BM25 index's on-disk format; another version is rebuilt from the catalog.
pub use bm25::FORMAT_VERSION as BM25_FORMAT_VERSION;
pub use error::{IndexError, Result};
pub use fusion::{fuse, Fused, Fusion, FusionMode};
pub use vector::VectorIndex;
/// The vector index's on-disk format; another version is rebuilt from the catalog.
pub use vector::FORMAT_VERSION as VECTOR_FORMAT_VERSION;

/// One chunk as the BM25 index sees it.
#[derive(Clone, Copy, Debug)]
pub struct ChunkDoc<'a> {
    pub chunk_id: u64,
    pub doc_id: u64,
    pub text: &'a str,
}

/// A hit from either index.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hit {
    pub chunk_id: u64,
    pub doc_id: u64,
    /// BM25 score, or cosine similarity for vectors.
    pub score: f32,
}

/// Restricts a search to these documents (`None`: the whole collection).
pub type DocFilter<'a> = Option<&'a HashSet<u64>>;
