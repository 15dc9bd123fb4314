//! [`KnowledgeBase`]: one data directory (catalog, blobs, per-collection indexes) with its one
//! owner; collections, documents, deletion, and the start-up recovery that brings every index
//! back in line with the catalog.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use engram_embed::Embedder;
use engram_index::{Bm25Index, ChunkDoc, VectorIndex};

use crate::blobs::{BlobStore, ContentHash};
use crate::catalog::{doc_hash, Catalog, Txn};
use crate::chunker::{ChunkConfig, TokenCounter};
use crate::error::{KbError, Result};
use crate::records::{now_ms, Chunk, Collection, Document, Job, JobKind, JobState, LogOp, Stage};

/// Chunks embedded per [`Embedder::embed`] call: enough to fill the encoder's packed batches
/// (4096 tokens, about 16 chunks of 256) several times over, small enough that progress moves.
pub const EMBED_BATCH: usize = 64;

/// Chunks added to an index between two of its commits during ingestion or a rebuild. A commit
/// writes segment files (tantivy) and the graph (HNSW), so committing per document would cost
/// more than indexing; the catalog already holds everything, so a crash between commits only
/// means a catch-up on the next start.
pub const COMMIT_EVERY: usize = 4096;

/// Free bytes the catalog needs to open: sled may write up to two of its 512 KiB log segments
/// while it recovers, and a write that runs out of space mid-way is what must never happen.
pub const MIN_OPEN_FREE: u64 = 1 << 20;

/// The longest collection name, in bytes.
pub const MAX_NAME_BYTES: usize = 128;

/// A vocabulary with fewer single CJK ideographs than this cannot read Chinese: everyday
/// Chinese uses about 3,500 characters, and bert-base-uncased's vocabulary (all-MiniLM-L6-v2's)
/// holds 244 of them. With such a vocabulary the CJK pieces it does know count as blind too:
/// an encoder trained on English learnt nothing useful about them.
pub const MIN_CJK_VOCAB: usize = 2000;

/// The models a knowledge base needs: the embedder, the word pieces it cannot read (for the
/// dense-signal check of [`crate::search`]) and the LLM's token counter (for chunk sizes).
#[derive(Clone)]
pub struct Models {
    pub embedder: Arc<Embedder>,
    /// Ids of the embedder's word pieces that carry no meaning for it: `[UNK]`, and single CJK
    /// characters when the vocabulary has fewer than [`MIN_CJK_VOCAB`] of them.
    pub blind: Arc<HashSet<u32>>,
    pub tokens: Arc<dyn TokenCounter>,
}

impl std::fmt::Debug for Models {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Models")
            .field("embedder", &self.embedder)
            .field("blind", &self.blind.len())
            .finish_non_exhaustive()
    }
}

impl Models {
    /// Loads the embedder folder on `threads` threads and reads which pieces it cannot read.
    pub fn load(embed_dir: &Path, threads: usize, tokens: Arc<dyn TokenCounter>) -> Result<Models> {
        Ok(Models {
            embedder: Arc::new(Embedder::load(embed_dir, threads)?),
            blind: Arc::new(blind_pieces(embed_dir)?),
            tokens,
        })
    }
}

/// The ids of the word pieces in a model folder's `tokenizer.json` that carry no meaning for
/// the model: the unknown token (`model.unk_token`, looked up in `model.vocab` or
/// `added_tokens`), plus every single-CJK-character piece when there are fewer than
/// [`MIN_CJK_VOCAB`] of them. Byte-level vocabularies have neither and give an empty set.
pub fn blind_pieces(embed_dir: &Path) -> Result<HashSet<u32>> {
    let path = embed_dir.join("tokenizer.json");
    let bytes = fs::read(&path).map_err(|e| KbError::io("reading", &path, e))?;
    let json: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| KbError::corrupted(path.display().to_string(), e.to_string()))?;
    let mut blind = HashSet::new();
    let vocab = json["model"]["vocab"].as_object();
    if let Some(unk) = json["model"]["unk_token"].as_str() {
        let id = vocab
            .and_then(|v| v.get(unk))
            .and_then(|id| id.as_u64())
            .or_else(|| {
                json["added_tokens"]
                    .as_array()?
                    .iter()
                    .find(|t| t["content"] == unk)?["id"]
                    .as_u64()
            });
        blind.extend(id.map(|id| id as u32));
    }
    // Single CJK characters, as a word start or a `##` continuation.
    let cjk: Vec<(char, u32)> = vocab
        .into_iter()
        .flatten()
        .filter_map(|(piece, id)| {
            let mut chars = piece.strip_prefix("##").unwrap_or(piece).chars();
            match (chars.next(), chars.next(), id.as_u64()) {
                (Some(c), None, Some(id)) if is_cjk_ideograph(c) => Some((c, id as u32)),
                _ => None,
            }
        })
        .collect();
    let distinct: HashSet<char> = cjk.iter().map(|&(c, _)| c).collect();
    if distinct.len() < MIN_CJK_VOCAB {
        blind.extend(cjk.iter().map(|&(_, id)| id));
    }
    Ok(blind)
}

/// CJK Unified Ideographs, Extension A and the compatibility block.
fn is_cjk_ideograph(c: char) -> bool {
    matches!(c as u32, 0x3400..=0x4DBF | 0x4E00..=0x9FFF | 0xF900..=0xFAFF)
}

/// What start-up found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recovery {
    /// `(collection, index, why)` of every index rebuilt from the catalog.
    pub rebuilt: Vec<(String, &'static str, String)>,
    /// `(collection, index, log entries)` of every index caught up from the change log.
    pub caught_up: Vec<(String, &'static str, usize)>,
    /// Collections whose chunks were re-embedded for a new model.
    pub reembedded: Vec<String>,
    /// Documents an interrupted run left half-way: finished when their chunks were all
    /// stored, else queued again (the chunks already stored are kept).
    pub resumed: usize,
    /// Unreferenced blobs removed.
    pub blobs_removed: usize,
    /// `(collection, why)` of every index sync left for later: a full disk (or another index
    /// write failure) while catching up or rebuilding. The collection is served from the
    /// indexes as they are and synced by the first [`index_step`](KnowledgeBase::index_step)
    /// that can write.
    pub deferred: Vec<(String, String)>,
}

/// A collection's two indexes.
pub(crate) struct Indexes {
    pub bm25: Bm25Index,
    pub vectors: VectorIndex,
}

/// One data directory: the catalog, the blob store and every collection's indexes.
///
/// Layout: `catalog/` (sled), `blobs/`, `collections/<id>/{bm25,vectors}/`. A knowledge base
/// has one owner; writes take `&mut self`, searches `&self`.
pub struct KnowledgeBase {
    pub(crate) dir: PathBuf,
    pub(crate) catalog: Catalog,
    pub(crate) blobs: BlobStore,
    pub(crate) models: Models,
    pub(crate) indexes: HashMap<u64, Indexes>,
    pub(crate) limits: engram_parse::Limits,
    /// Reads scanned pages and images at parse time, when set ([`KnowledgeBase::set_ocr`]).
    pub(crate) ocr: Option<Arc<engram_parse::Ocr>>,
    /// Accepted documents between acceptance and `done`, by collection id.
    pub(crate) background: HashMap<u64, crate::ingest::Background>,
    /// Documents that became `done` or `failed`, until [`take_finished`](Self::take_finished).
    pub(crate) finished: Vec<crate::ingest::Finished>,
    /// Round-robin counter over collections with work.
    pub(crate) turn: usize,
    /// Chunks of the documents waiting for their chunk KV (counted on first use).
    kv_pending_chunks: Option<u64>,
    /// Collections whose indexes must be synced with the catalog again before more is added:
    /// an index write failed (a full disk), here or during recovery.
    pub(crate) resync: HashSet<u64>,
    /// Bytes of each collection's index files after its last commit.
    footprint: HashMap<u64, u64>,
    recovery: Recovery,
}

impl std::fmt::Debug for KnowledgeBase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KnowledgeBase")
            .field("dir", &self.dir)
            .field("models", &self.models)
            .finish_non_exhaustive()
    }
}

/// Which of a collection's indexes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Which {
    Bm25,
    Vectors,
}

impl Which {
    fn name(self) -> &'static str {
        match self {
            Which::Bm25 => "bm25",
            Which::Vectors => "vectors",
        }
    }
}

impl KnowledgeBase {
    /// Opens (creating) the data directory and recovers: re-embeds collections built with
    /// another embedding model, catches up or rebuilds every index that is behind, missing or
    /// corrupt, finishes documents an interrupted run left, and removes orphan blobs.
    pub fn open(dir: &Path, models: Models) -> Result<KnowledgeBase> {
        fs::create_dir_all(dir).map_err(|e| KbError::io("creating", dir, e))?;
        // What failed or crashed index commits left goes first: on a full disk it is the room
        // the catalog needs to open.
        if let Ok(colls) = fs::read_dir(dir.join("collections")) {
            for c in colls.flatten() {
                VectorIndex::remove_stale(&c.path().join("vectors"));
            }
        }
        let available = rustix::fs::statvfs(dir)
            .map(|s| s.f_bavail.saturating_mul(s.f_frsize))
            .map_err(|e| KbError::io("statvfs", dir, e.into()))?;
        if available < MIN_OPEN_FREE {
            return Err(KbError::DiskFull {
                path: dir.to_owned(),
                available,
                needed: MIN_OPEN_FREE,
            });
        }
        let catalog = Catalog::open(&dir.join("catalog"))?;
        let blobs = BlobStore::open(&dir.join("blobs"))?;
        let mut kb = KnowledgeBase {
            dir: dir.to_owned(),
            catalog,
            blobs,
            models,
            indexes: HashMap::new(),
            limits: engram_parse::Limits::default(),
            ocr: None,
            background: HashMap::new(),
            finished: Vec::new(),
            turn: 0,
            kv_pending_chunks: None,
            resync: HashSet::new(),
            footprint: HashMap::new(),
            recovery: Recovery::default(),
        };
        kb.recover()?;
        Ok(kb)
    }

    /// What [`open`](Self::open) found and did.
    pub fn recovery(&self) -> &Recovery {
        &self.recovery
    }

    /// Free disk space the next index commit may need beyond what it frees: a commit writes a
    /// new generation of the vector index (and tantivy merges segments) before dropping the
    /// old, so up to the largest collection's index files again.
    pub fn commit_headroom(&mut self) -> u64 {
        let ids: Vec<u64> = self
            .indexes
            .keys()
            .copied()
            .filter(|id| !self.footprint.contains_key(id))
            .collect();
        for id in ids {
            let n = dir_size(&self.collection_dir(id));
            self.footprint.insert(id, n);
        }
        self.footprint.values().copied().max().unwrap_or(0)
    }

    /// The data directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The models in use.
    pub fn models(&self) -> &Models {
        &self.models
    }

    /// The parser's limits.
    pub fn parse_limits(&self) -> &engram_parse::Limits {
        &self.limits
    }

    /// Sets the parser's limits for later ingestion.
    pub fn set_parse_limits(&mut self, limits: engram_parse::Limits) {
        self.limits = limits;
    }

    /// The OCR documents are parsed with (images, scanned PDF pages), if any.
    pub fn ocr(&self) -> Option<&Arc<engram_parse::Ocr>> {
        self.ocr.as_ref()
    }

    /// Reads images and scanned PDF pages with `ocr` from now on (`None`: refuses them, saying
    /// OCR is off).
    pub fn set_ocr(&mut self, ocr: Option<Arc<engram_parse::Ocr>>) {
        self.ocr = ocr;
    }

    fn collection_dir(&self, id: u64) -> PathBuf {
        self.dir.join("collections").join(id.to_string())
    }

    // ---- collections ----

    /// Creates a collection for the current embedding model.
    pub fn create_collection(&mut self, name: &str, chunking: ChunkConfig) -> Result<Collection> {
        validate_name(name)?;
        chunking.validate()?;
        if self.catalog.collection_by_name(name)?.is_some() {
            return Err(KbError::CollectionExists { name: name.into() });
        }
        let coll = Collection {
            id: self.catalog.new_id()?,
            name: name.into(),
            chunking,
            embed_model: self.models.embedder.model_id().into(),
            dim: self.models.embedder.dim(),
            created_ms: now_ms(),
            last_seq: 0,
            log_floor: 0,
            documents: 0,
            chunks: 0,
        };
        let mut txn = Txn::default();
        txn.put_collection(&coll);
        self.catalog.write(txn)?;
        self.catalog.flush()?;
        self.open_indexes(&coll)?;
        Ok(coll)
    }

    /// The collection called `name`, created with `chunking` if there is none.
    pub fn ensure_collection(&mut self, name: &str, chunking: ChunkConfig) -> Result<Collection> {
        match self.catalog.collection_by_name(name)? {
            Some(c) => Ok(c),
            None => self.create_collection(name, chunking),
        }
    }

    /// The collection called `name`.
    pub fn collection(&self, name: &str) -> Result<Collection> {
        self.catalog
            .collection_by_name(name)?
            .ok_or_else(|| KbError::CollectionNotFound { name: name.into() })
    }

    /// Every collection, by id.
    pub fn collections(&self) -> Result<Vec<Collection>> {
        self.catalog.collections()
    }

    /// Deletes a collection with its documents, chunks, indexes and unshared blobs.
    pub fn delete_collection(&mut self, name: &str) -> Result<()> {
        let coll = self.collection(name)?;
        let docs = self.catalog.documents(coll.id)?;
        let mut txn = Txn::default();
        for d in &docs {
            txn.remove_document(d)?;
            txn.remove_kv_pending(d.id);
            for c in self.catalog.chunks(d.id)? {
                txn.remove_chunk(c.id);
            }
        }
        for seq in self.catalog.log_keys_upto(coll.id, u64::MAX)? {
            txn.remove_log(coll.id, seq);
        }
        txn.remove_collection(&coll);
        self.catalog.write(txn)?;
        self.catalog.flush()?;
        self.indexes.remove(&coll.id);
        if let Some(mut bg) = self.background.remove(&coll.id) {
            for d in &docs {
                bg.forget(d.id);
            }
        }
        self.kv_pending_chunks = None;
        let dir = self.collection_dir(coll.id);
        if dir.exists() {
            fs::remove_dir_all(&dir).map_err(|e| KbError::io("removing", &dir, e))?;
        }
        for d in &docs {
            self.remove_blob_if_unused(doc_hash(d)?)?;
        }
        Ok(())
    }

    // ---- documents ----

    /// The documents of a collection, by id.
    pub fn documents(&self, collection: &str) -> Result<Vec<Document>> {
        let coll = self.collection(collection)?;
        self.catalog.documents(coll.id)
    }

    /// A document of the collection, by id (digits) or by name.
    pub fn document(&self, collection: &str, id_or_name: &str) -> Result<Document> {
        let coll = self.collection(collection)?;
        let by_name = self.catalog.doc_by_name(coll.id, id_or_name)?;
        let id = by_name.or_else(|| id_or_name.parse().ok());
        id.map(|id| self.catalog.document(id))
            .transpose()?
            .flatten()
            .filter(|d| d.collection == coll.id)
            .ok_or_else(|| KbError::DocumentNotFound {
                collection: collection.into(),
                doc: id_or_name.into(),
            })
    }

    /// A document's chunks, in order.
    pub fn chunks(&self, doc: u64) -> Result<Vec<Chunk>> {
        self.catalog.chunks(doc)
    }

    /// A chunk's stored embedding.
    pub fn embedding(&self, chunk: u64) -> Result<Option<Vec<f32>>> {
        self.catalog.embedding(chunk)
    }

    /// The original bytes of a document.
    pub fn original(&self, doc: &Document) -> Result<Vec<u8>> {
        self.blobs.get(doc_hash(doc)?)
    }

    /// Whether the original bytes of `doc` are in the blob store.
    pub fn has_original(&self, doc: &Document) -> Result<bool> {
        Ok(self.blobs.contains(doc_hash(doc)?))
    }

    /// How many originals the blob store holds.
    pub fn original_count(&self) -> Result<usize> {
        Ok(self.blobs.list()?.len())
    }

    /// Entries per catalog tree, by tree name: lets tests check that nothing is left behind.
    pub fn catalog_sizes(&self) -> Vec<(&'static str, usize)> {
        self.catalog.tree_sizes()
    }

    /// Chunks in the collection's BM25 and vector indexes.
    pub fn index_sizes(&self, collection: &str) -> Result<(u64, u64)> {
        let coll = self.collection(collection)?;
        let idx = self.indexes(&coll)?;
        Ok((idx.bm25.len(), idx.vectors.len()))
    }

    /// Every job, by id.
    pub fn jobs(&self) -> Result<Vec<Job>> {
        self.catalog.jobs()
    }

    /// Removes a document (by id or name) from the catalog, both indexes and, unless another
    /// document has the same content, the blob store. Durable when it returns.
    pub fn delete_document(&mut self, collection: &str, id_or_name: &str) -> Result<Document> {
        let doc = self.document(collection, id_or_name)?;
        let mut coll = self.collection(collection)?;
        self.remove_document(&mut coll, &doc)?;
        self.commit_indexes(&mut coll, &[])?;
        self.close_job_if_idle(coll.id)?;
        self.remove_blob_if_unused(doc_hash(&doc)?)?;
        Ok(doc)
    }

    /// Removes `doc` from the catalog (durably) and from the indexes (not yet committed).
    pub(crate) fn remove_document(&mut self, coll: &mut Collection, doc: &Document) -> Result<()> {
        self.forget_queued(coll.id, doc.id);
        let chunks = self.catalog.chunks(doc.id)?;
        let seq = self.catalog.seq()? + 1;
        self.forget_kv(doc);
        let mut txn = Txn::default();
        txn.remove_document(doc)?;
        txn.remove_kv_pending(doc.id);
        for c in &chunks {
            txn.remove_chunk(c.id);
        }
        if matches!(doc.stage, Stage::Indexing | Stage::Done) {
            coll.documents = coll.documents.saturating_sub(1);
            coll.chunks = coll.chunks.saturating_sub(chunks.len() as u64);
        }
        coll.last_seq = seq;
        txn.log(coll.id, seq, LogOp::Delete { doc: doc.id });
        txn.put_collection(coll);
        txn.set_seq(seq);
        self.catalog.write(txn)?;
        self.catalog.flush()?;
        let idx = self.indexes_mut(coll)?;
        idx.bm25.delete_doc(doc.id)?;
        idx.vectors.delete_doc(doc.id)?;
        Ok(())
    }

    /// Takes `doc`'s chunks out of the catalog and both indexes (committed) and replaces its
    /// record by `next` in the same transaction: before it is processed again (re-index, new
    /// content under its name).
    pub(crate) fn unindex_document(
        &mut self,
        coll: &mut Collection,
        doc: &Document,
        next: &Document,
    ) -> Result<()> {
        let chunks = self.catalog.chunks(doc.id)?;
        let seq = self.catalog.seq()? + 1;
        let mut txn = Txn::default();
        for c in &chunks {
            txn.remove_chunk(c.id);
        }
        txn.remove_document(doc)?;
        txn.put_document(next)?;
        self.forget_kv(doc);
        txn.remove_kv_pending(doc.id);
        if matches!(doc.stage, Stage::Indexing | Stage::Done) {
            coll.documents = coll.documents.saturating_sub(1);
            coll.chunks = coll.chunks.saturating_sub(chunks.len() as u64);
        }
        coll.last_seq = seq;
        txn.log(coll.id, seq, LogOp::Delete { doc: doc.id });
        txn.put_collection(coll);
        txn.set_seq(seq);
        self.catalog.write(txn)?;
        let idx = self.indexes_mut(coll)?;
        idx.bm25.delete_doc(doc.id)?;
        idx.vectors.delete_doc(doc.id)?;
        self.commit_indexes(coll, &[]).map(|_| ())
    }

    pub(crate) fn remove_blob_if_unused(&self, hash: ContentHash) -> Result<()> {
        if self.catalog.hash_refs(hash)? == 0 {
            self.blobs.remove(hash)?;
        }
        Ok(())
    }

    /// Commits both indexes of `coll` at the highest sequence number they fully hold (its
    /// `last_seq` unless a finished document is still being added; after flushing the catalog,
    /// so an index is never ahead of it), marks the `done` documents that are still
    /// `indexing` done (and waiting for their chunk KV, see [`kv_pending`](Self::kv_pending)),
    /// and drops the
    /// change-log entries both indexes now cover. Returns the documents marked done.
    pub(crate) fn commit_indexes(
        &mut self,
        coll: &mut Collection,
        done: &[u64],
    ) -> Result<Vec<u64>> {
        self.catalog.flush()?;
        let seq = self
            .background
            .get(&coll.id)
            .map_or(coll.last_seq, |b| b.safe_seq(coll.last_seq));
        let committed = self.indexes_mut(coll).and_then(|idx| {
            idx.bm25.commit(seq)?;
            idx.vectors.commit(seq)?;
            Ok(())
        });
        if let Err(e) = committed {
            // The indexes may hold more than they committed, and a failed writer refuses
            // more: reopen and sync them before anything else is added.
            self.resync.insert(coll.id);
            return Err(e);
        }
        self.footprint
            .insert(coll.id, dir_size(&self.collection_dir(coll.id)));
        let mut txn = Txn::default();
        let mut marked = Vec::new();
        for &id in done {
            // A document requeued since its chunks were written (new content under its name)
            // is not done: its new revision is on its way.
            if let Some(mut d) = self.catalog.document(id)? {
                if d.stage == Stage::Indexing {
                    d.enter(Stage::Done);
                    d.progress = None;
                    txn.put_document(&d)?;
                    txn.set_kv_pending(id);
                    if let Some(n) = &mut self.kv_pending_chunks {
                        *n += d.chunks as u64;
                    }
                    marked.push(id);
                }
            }
        }
        for s in self.catalog.log_keys_upto(coll.id, seq)? {
            txn.remove_log(coll.id, s);
        }
        coll.log_floor = seq;
        txn.put_collection(coll);
        self.catalog.write(txn)?;
        self.catalog.flush()?;
        Ok(marked)
    }

    pub(crate) fn indexes_mut(&mut self, coll: &Collection) -> Result<&mut Indexes> {
        if !self.indexes.contains_key(&coll.id) {
            self.open_indexes(coll)?;
        }
        Ok(self.indexes.get_mut(&coll.id).expect("opened above"))
    }

    pub(crate) fn indexes(&self, coll: &Collection) -> Result<&Indexes> {
        self.indexes.get(&coll.id).ok_or_else(|| {
            KbError::corrupted(
                format!("collection {}", coll.name),
                "its indexes are not open",
            )
        })
    }

    /// Opens both indexes, replacing any that is corrupt or was built for something else by an
    /// empty one (the caller syncs them). Returns why each was replaced.
    fn open_indexes(&mut self, coll: &Collection) -> Result<Vec<(Which, String)>> {
        // Close any open instance first: an index directory has one writer at a time.
        self.indexes.remove(&coll.id);
        let dir = self.collection_dir(coll.id);
        let mut replaced = Vec::new();
        let bm25_dir = dir.join("bm25");
        let bm25 = match Bm25Index::open_or_create(&bm25_dir) {
            Ok(i) => i,
            Err(e) if e.needs_rebuild() => {
                replaced.push((Which::Bm25, format!("cannot be opened: {e}")));
                remove_dir(&bm25_dir)?;
                Bm25Index::open_or_create(&bm25_dir)?
            }
            Err(e) => return Err(e.into()),
        };
        let vec_dir = dir.join("vectors");
        let vectors = match VectorIndex::open_or_create(&vec_dir, coll.dim, &coll.embed_model) {
            Ok(i) => i,
            Err(e) if e.needs_rebuild() => {
                replaced.push((Which::Vectors, format!("cannot be opened: {e}")));
                remove_dir(&vec_dir)?;
                VectorIndex::open_or_create(&vec_dir, coll.dim, &coll.embed_model)?
            }
            Err(e) => return Err(e.into()),
        };
        self.indexes.insert(coll.id, Indexes { bm25, vectors });
        Ok(replaced)
    }

    // ---- the chunk KV stage ----

    /// Up to `n` documents, after document `after` in id order, that are `done` and whose chunk
    /// KV is not recorded as stored: the chunk KV stage's durable queue. A document enters it
    /// when it becomes `done` and leaves it through [`kv_done`](Self::kv_done), deletion or
    /// re-indexing, so a crash never loses the work.
    pub fn kv_pending(&self, after: u64, n: usize) -> Result<Vec<u64>> {
        self.catalog.kv_pending(after, n)
    }

    /// Records that every chunk of `doc` has its KV stored.
    pub fn kv_done(&mut self, doc: u64) -> Result<()> {
        if self.catalog.kv_pending(doc.saturating_sub(1), 1)? != [doc] {
            return Ok(());
        }
        if let (Some(n), Some(d)) = (&mut self.kv_pending_chunks, self.catalog.document(doc)?) {
            *n = n.saturating_sub(d.chunks as u64);
        }
        let mut txn = Txn::default();
        txn.remove_kv_pending(doc);
        self.catalog.write(txn)
    }

    /// Puts every `done` document (of `collection`, or of all) back in the chunk KV queue:
    /// after a change of model or frame. Returns how many.
    pub fn mark_kv_pending(&mut self, collection: Option<&str>) -> Result<usize> {
        let colls = match collection {
            Some(name) => vec![self.collection(name)?],
            None => self.catalog.collections()?,
        };
        let mut n = 0;
        for c in colls {
            let mut txn = Txn::default();
            for d in self.catalog.documents(c.id)? {
                if d.stage == Stage::Done {
                    txn.set_kv_pending(d.id);
                    n += 1;
                }
            }
            self.catalog.write(txn)?;
        }
        self.catalog.flush()?;
        self.kv_pending_chunks = None;
        Ok(n)
    }

    /// Chunks of the documents waiting in the chunk KV queue (counted once, then kept up to
    /// date).
    pub fn kv_pending_chunks(&mut self) -> Result<u64> {
        if let Some(n) = self.kv_pending_chunks {
            return Ok(n);
        }
        let mut n = 0u64;
        let mut after = 0;
        loop {
            let ids = self.catalog.kv_pending(after, 1024)?;
            let Some(&last) = ids.last() else { break };
            for id in ids {
                n += self.catalog.document(id)?.map_or(0, |d| d.chunks as u64);
            }
            after = last;
        }
        self.kv_pending_chunks = Some(n);
        Ok(n)
    }

    /// Drops a document's share of the cached pending count before its marker is removed.
    fn forget_kv(&mut self, doc: &Document) {
        let marked =
            self.catalog.kv_pending(doc.id.saturating_sub(1), 1).ok() == Some(vec![doc.id]);
        if let (Some(n), true) = (&mut self.kv_pending_chunks, marked) {
            *n = n.saturating_sub(doc.chunks as u64);
        }
    }

    // ---- recovery ----

    fn recover(&mut self) -> Result<()> {
        for job in self.catalog.jobs()? {
            if job.state == JobState::Running {
                let mut job = job;
                job.state = JobState::Interrupted;
                job.finished_ms = Some(now_ms());
                let mut txn = Txn::default();
                txn.put_job(&job);
                // A full disk must not keep the knowledge base from opening: the job stays
                // `running` in the record until a later start can write.
                self.deferrable(self.catalog.write(txn), "", "a job record")?;
            }
        }
        for mut coll in self.catalog.collections()? {
            if coll.embed_model != self.models.embedder.model_id()
                || coll.dim != self.models.embedder.dim()
            {
                self.reembed(&mut coll)?;
                self.recovery.reembedded.push(coll.name.clone());
            }
            let synced = self.sync_collection(&mut coll);
            if self.deferrable(synced, &coll.name, "index sync")?.is_none() {
                self.resync.insert(coll.id);
                if !self.indexes.contains_key(&coll.id) {
                    // Serve what the indexes hold until they can be synced.
                    let opened = self.open_indexes(&coll).map(|_| ());
                    self.deferrable(opened, &coll.name, "opening the indexes")?;
                }
            }
            let resumed = self.resume_documents(&mut coll);
            self.deferrable(resumed, &coll.name, "finishing indexed documents")?;
        }
        self.deferrable(self.catalog.flush(), "", "flushing the catalog")?;
        for hash in self.blobs.list()? {
            if self.catalog.hash_refs(hash)? == 0 {
                self.blobs.remove(hash)?;
                self.recovery.blobs_removed += 1;
            }
        }
        Ok(())
    }

    /// Lets a recovery step fail on a full disk (or an index write) without failing the open:
    /// records it in [`Recovery::deferred`] and returns `None`. Other errors are returned.
    fn deferrable<T>(&mut self, r: Result<T>, collection: &str, what: &str) -> Result<Option<T>> {
        match r {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.is_storage_full() || matches!(e, KbError::Index(_)) => {
                self.recovery
                    .deferred
                    .push((collection.to_owned(), format!("{what}: {e}")));
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Syncs a collection whose indexes failed a write (see [`Recovery::deferred`]): reopens
    /// them and catches them up from the change log (or rebuilds them), which covers every
    /// document already logged; those are then `done`.
    pub(crate) fn resync_collection(&mut self, coll: &mut Collection) -> Result<()> {
        self.indexes.remove(&coll.id);
        self.sync_collection(coll)?;
        let mut ids = Vec::new();
        if let Some(bg) = self.background.get_mut(&coll.id) {
            ids.extend(bg.take_indexed());
        }
        self.commit_indexes(coll, &ids)?;
        self.resume_documents(coll)?;
        self.resync.remove(&coll.id);
        Ok(())
    }

    /// Brings both indexes of `coll` to its `last_seq`: replays the change log onto an index
    /// that is behind, rebuilds one that is missing, corrupt, ahead of the catalog, older than
    /// the log, or holding a different number of chunks than the catalog.
    fn sync_collection(&mut self, coll: &mut Collection) -> Result<()> {
        let replaced = self.open_indexes(coll)?;
        for which in [Which::Bm25, Which::Vectors] {
            let (seq, len) = {
                let idx = &self.indexes[&coll.id];
                match which {
                    Which::Bm25 => (idx.bm25.seq(), idx.bm25.len()),
                    Which::Vectors => (idx.vectors.seq(), idx.vectors.len()),
                }
            };
            let why = if let Some((_, why)) = replaced.iter().find(|(w, _)| *w == which) {
                Some(why.clone())
            } else if seq > coll.last_seq {
                Some(format!(
                    "it is at sequence {seq}, ahead of the catalog's {}",
                    coll.last_seq
                ))
            } else if seq < coll.log_floor {
                Some(format!(
                    "it is at sequence {seq}, older than the change log (from {})",
                    coll.log_floor
                ))
            } else if seq == coll.last_seq && len != coll.chunks {
                Some(format!(
                    "it holds {len} chunks, the catalog {}",
                    coll.chunks
                ))
            } else {
                None
            };
            let why = match why {
                None if seq < coll.last_seq => {
                    let n = self.catch_up(coll, which, seq)?;
                    self.recovery
                        .caught_up
                        .push((coll.name.clone(), which.name(), n));
                    let idx = &self.indexes[&coll.id];
                    let len = match which {
                        Which::Bm25 => idx.bm25.len(),
                        Which::Vectors => idx.vectors.len(),
                    };
                    (len != coll.chunks).then(|| {
                        format!(
                            "after catching up it holds {len} chunks, the catalog {}",
                            coll.chunks
                        )
                    })
                }
                other => other,
            };
            if let Some(why) = why {
                self.rebuild(coll, which)?;
                self.recovery
                    .rebuilt
                    .push((coll.name.clone(), which.name(), why));
            }
        }
        Ok(())
    }

    /// Replays the change log after `from` onto one index and commits it; returns the entries
    /// replayed. A re-embedding entry rebuilds the vector index instead.
    fn catch_up(&mut self, coll: &Collection, which: Which, from: u64) -> Result<usize> {
        let ops = self.catalog.log_since(coll.id, from)?;
        for (_, op) in &ops {
            match *op {
                LogOp::Add { doc } => {
                    self.index_delete(coll, which, doc)?;
                    let chunks = self.catalog.chunks(doc)?;
                    self.index_add(coll, which, &chunks)?;
                }
                LogOp::Delete { doc } => self.index_delete(coll, which, doc)?,
                LogOp::Reembed if which == Which::Vectors => {
                    self.rebuild(coll, which)?;
                    return Ok(ops.len());
                }
                LogOp::Reembed => {}
            }
        }
        let idx = self.indexes_mut(coll)?;
        match which {
            Which::Bm25 => idx.bm25.commit(coll.last_seq)?,
            Which::Vectors => idx.vectors.commit(coll.last_seq)?,
        }
        Ok(ops.len())
    }

    fn index_delete(&mut self, coll: &Collection, which: Which, doc: u64) -> Result<()> {
        let idx = self.indexes_mut(coll)?;
        match which {
            Which::Bm25 => idx.bm25.delete_doc(doc)?,
            Which::Vectors => {
                idx.vectors.delete_doc(doc)?;
            }
        }
        Ok(())
    }

    /// Adds chunks to one index, taking vectors from the catalog (re-embedding any that are
    /// missing or unreadable, and storing them back).
    pub(crate) fn index_add(
        &mut self,
        coll: &Collection,
        which: Which,
        chunks: &[Chunk],
    ) -> Result<()> {
        if chunks.is_empty() {
            return Ok(());
        }
        let texts = self.indexed_texts(chunks)?;
        match which {
            Which::Bm25 => {
                let docs: Vec<ChunkDoc<'_>> = chunks
                    .iter()
                    .zip(&texts)
                    .map(|(c, t)| ChunkDoc {
                        chunk_id: c.id,
                        doc_id: c.doc,
                        text: t,
                    })
                    .collect();
                self.indexes_mut(coll)?.bm25.add(&docs)?;
            }
            Which::Vectors => {
                let mut vectors = Vec::with_capacity(chunks.len());
                let mut missing = Vec::new();
                for c in chunks {
                    match self.catalog.embedding(c.id) {
                        Ok(Some(v)) if v.len() == coll.dim => vectors.push(Some(v)),
                        _ => {
                            missing.push(vectors.len());
                            vectors.push(None);
                        }
                    }
                }
                if !missing.is_empty() {
                    let missing_texts: Vec<&str> =
                        missing.iter().map(|&i| texts[i].as_ref()).collect();
                    let fresh = self.models.embedder.embed(&missing_texts)?;
                    let mut txn = Txn::default();
                    for (&i, v) in missing.iter().zip(fresh) {
                        txn.put_embedding(chunks[i].id, &v);
                        vectors[i] = Some(v);
                    }
                    self.catalog.write(txn)?;
                }
                let items: Vec<(u64, u64, &[f32])> = chunks
                    .iter()
                    .zip(&vectors)
                    .map(|(c, v)| (c.id, c.doc, v.as_deref().expect("filled above")))
                    .collect();
                self.indexes_mut(coll)?.vectors.add(&items)?;
            }
        }
        Ok(())
    }

    /// Each chunk's [`Chunk::indexed_text`], with its document's title from the catalog.
    fn indexed_texts<'c>(&self, chunks: &'c [Chunk]) -> Result<Vec<std::borrow::Cow<'c, str>>> {
        let mut titles: HashMap<u64, Option<String>> = HashMap::new();
        let mut out = Vec::with_capacity(chunks.len());
        for c in chunks {
            let title = match titles.entry(c.doc) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(self.catalog.document(c.doc)?.and_then(|d| d.title))
                }
            };
            out.push(c.indexed_text(title.as_deref()));
        }
        Ok(out)
    }

    /// Replaces one index by a fresh one built from the catalog, committed at `last_seq`.
    pub(crate) fn rebuild(&mut self, coll: &Collection, which: Which) -> Result<()> {
        let dir = self.collection_dir(coll.id).join(which.name());
        {
            let idx = self.indexes.remove(&coll.id);
            // Close the index before removing its files; keep the other one.
            let other = idx.map(|i| match which {
                Which::Bm25 => (None, Some(i.vectors)),
                Which::Vectors => (Some(i.bm25), None),
            });
            remove_dir(&dir)?;
            let (bm25, vectors) = match other {
                Some((Some(b), None)) => (
                    b,
                    VectorIndex::open_or_create(&dir, coll.dim, &coll.embed_model)?,
                ),
                Some((None, Some(v))) => (Bm25Index::open_or_create(&dir)?, v),
                _ => {
                    let base = self.collection_dir(coll.id);
                    (
                        Bm25Index::open_or_create(&base.join("bm25"))?,
                        VectorIndex::open_or_create(
                            &base.join("vectors"),
                            coll.dim,
                            &coll.embed_model,
                        )?,
                    )
                }
            };
            self.indexes.insert(coll.id, Indexes { bm25, vectors });
        }
        let mut pending = Vec::new();
        for d in self.catalog.documents(coll.id)? {
            // Chunks of a document still being embedded are not in the indexes yet.
            if !matches!(d.stage, Stage::Indexing | Stage::Done) {
                continue;
            }
            pending.extend(self.catalog.chunks(d.id)?);
            if pending.len() >= COMMIT_EVERY {
                self.index_add(coll, which, &pending)?;
                pending.clear();
            }
        }
        self.index_add(coll, which, &pending)?;
        let idx = self.indexes_mut(coll)?;
        match which {
            Which::Bm25 => idx.bm25.commit(coll.last_seq)?,
            Which::Vectors => idx.vectors.commit(coll.last_seq)?,
        }
        Ok(())
    }

    /// Re-embeds every chunk of `coll` with the current model (a recorded job), stores the
    /// vectors in the catalog and switches the collection to the model; the vector index is
    /// then rebuilt by [`sync_collection`](Self::sync_collection) through the logged
    /// [`LogOp::Reembed`].
    fn reembed(&mut self, coll: &mut Collection) -> Result<()> {
        let to_model = self.models.embedder.model_id().to_owned();
        let mut job = Job {
            id: self.catalog.new_id()?,
            collection: coll.id,
            kind: JobKind::Reembed {
                from_model: coll.embed_model.clone(),
                to_model: to_model.clone(),
            },
            state: JobState::Running,
            started_ms: now_ms(),
            finished_ms: None,
            total: coll.chunks,
            done: 0,
            failed: 0,
        };
        let mut txn = Txn::default();
        txn.put_job(&job);
        self.catalog.write(txn)?;
        // The vector index of the old model is useless now; drop it before it is reopened.
        self.indexes.remove(&coll.id);
        remove_dir(&self.collection_dir(coll.id).join(Which::Vectors.name()))?;
        for id in self.catalog.document_ids(coll.id)? {
            let chunks = self.catalog.chunks(id)?;
            for batch in chunks.chunks(EMBED_BATCH) {
                let texts = self.indexed_texts(batch)?;
                let texts: Vec<&str> = texts.iter().map(|t| t.as_ref()).collect();
                let vectors = self.models.embedder.embed(&texts)?;
                let mut txn = Txn::default();
                for (c, v) in batch.iter().zip(&vectors) {
                    txn.put_embedding(c.id, v);
                }
                job.done += batch.len() as u64;
                txn.put_job(&job);
                self.catalog.write(txn)?;
            }
        }
        let seq = self.catalog.seq()? + 1;
        coll.embed_model = to_model;
        coll.dim = self.models.embedder.dim();
        coll.last_seq = seq;
        job.state = JobState::Done;
        job.finished_ms = Some(now_ms());
        let mut txn = Txn::default();
        txn.log(coll.id, seq, LogOp::Reembed);
        txn.put_collection(coll);
        txn.set_seq(seq);
        txn.put_job(&job);
        self.catalog.write(txn)?;
        self.catalog.flush()
    }

    /// Finishes documents an interrupted run left: those already indexing only need marking
    /// done (their chunks are in the catalog and the indexes were just synced); the others are
    /// queued again, to go through the pipeline from their stored original after `open`
    /// returns (the daemon serves meanwhile).
    fn resume_documents(&mut self, coll: &mut Collection) -> Result<()> {
        let unfinished: Vec<Document> = self
            .catalog
            .documents(coll.id)?
            .into_iter()
            .filter(|d| !d.stage.is_final())
            .collect();
        if unfinished.is_empty() {
            return Ok(());
        }
        self.recovery.resumed += unfinished.len();
        let (indexing, rest): (Vec<Document>, Vec<Document>) = unfinished
            .into_iter()
            .partition(|d| d.stage == Stage::Indexing);
        if !rest.is_empty() {
            self.resume(coll, rest);
        }
        let mut txn = Txn::default();
        for mut d in indexing {
            d.enter(Stage::Done);
            d.progress = None;
            txn.put_document(&d)?;
            txn.set_kv_pending(d.id);
        }
        self.catalog.write(txn)
    }
}

/// Bytes of the files under `dir` (recursively; 0 when absent).
pub fn dir_size(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_size(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// Removes a folder and everything in it (a no-op when absent).
fn remove_dir(dir: &Path) -> Result<()> {
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(KbError::io("removing", dir, e)),
    }
}

/// Collection names: 1 to [`MAX_NAME_BYTES`] bytes of letters, digits, `-`, `_` and `.`, not
/// starting with `.`.
pub(crate) fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(KbError::invalid(
            "collection name",
            format!("{name:?} must be 1 to {MAX_NAME_BYTES} bytes of letters, digits, '-', '_' or '.', not starting with '.'"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blind_of(tokenizer_json: &str) -> HashSet<u32> {
        let dir = std::env::temp_dir().join(format!(
            "engram-kb-blind-{}-{}",
            std::process::id(),
            tokenizer_json.len()
        ));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("tokenizer.json"), tokenizer_json).unwrap();
        let blind = blind_pieces(&dir).unwrap();
        fs::remove_dir_all(&dir).unwrap();
        blind
    }

    #[test]
    fn blind_pieces_are_unk_and_scarce_cjk() {
        // An English WordPiece vocabulary with a few CJK characters: all of them are blind.
        let english = r###"{"model": {"unk_token": "[UNK]",
            "vocab": {"[UNK]": 100, "the": 1996, "公": 1772, "##公": 1773, "大": 1810}}}"###;
        assert_eq!(blind_of(english), HashSet::from([100, 1772, 1773, 1810]));
        // A vocabulary that covers Chinese keeps its CJK pieces readable.
        let mut vocab: Vec<String> = (0..MIN_CJK_VOCAB as u32)
            .map(|i| format!("\"{}\": {}", char::from_u32(0x4E00 + i).unwrap(), 1000 + i))
            .collect();
        vocab.push("\"<unk>\": 3".into());
        let multilingual = format!(
            r#"{{"model": {{"unk_token": "<unk>", "vocab": {{{}}}}}}}"#,
            vocab.join(",")
        );
        assert_eq!(blind_of(&multilingual), HashSet::from([3]));
        // Byte-level BPE: no unknown token at all.
        assert!(blind_of(r#"{"model": {"type": "BPE", "vocab": {"a": 0}}}"#).is_empty());
    }
}
