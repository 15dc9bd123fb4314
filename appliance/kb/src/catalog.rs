//! The sled catalog, the knowledge bases' source of truth: collections, documents, chunks with
//! their embeddings, jobs, and a change log the indexes catch up from.
//!
//! Trees (keys are big-endian so that prefixes and ranges scan in id order):
//!
//! ```text
//! meta             "schema_version" -> u32 LE, "seq" -> u64 LE
//! collections      coll id -> Collection          collection_names  name -> coll id
//! documents        doc id -> Document             coll_docs         coll ++ doc -> ()
//! doc_names        coll ++ name -> doc id         by_hash           hash ++ coll ++ doc -> ()
//! doc_meta         coll ++ key 0 value 0 ++ doc -> ()
//! chunks           chunk id -> Chunk              embeddings        chunk id -> vector
//! log              coll ++ seq -> LogOp           jobs              job id -> Job
//! kv_pending       doc id -> ()  (done documents whose chunk KV is not all stored yet)
//! ```
//!
//! `kv_pending` was added after schema version 1 without a version bump: an older build
//! ignores the tree, and a newer one finds it empty in an older catalog.
//!
//! Several trees change together through a [`Txn`], applied as one sled transaction; callers
//! [`flush`](Catalog::flush) before acknowledging. Records are versioned JSON (see
//! [`records`](crate::records)). The catalog has one writer, the owning
//! [`KnowledgeBase`](crate::KnowledgeBase), so reads outside a transaction followed by a write
//! are race-free.

use std::collections::HashSet;
use std::path::Path;

use sled::transaction::{ConflictableTransactionError, TransactionError};
use sled::{Batch, Transactional, Tree};

use crate::blobs::ContentHash;
use crate::error::{KbError, Result};
use crate::records::{
    decode, decode_embedding, encode, encode_embedding, Chunk, Collection, Document, Job, LogOp,
    MAX_CHUNKS_PER_DOC, ORDINAL_BITS,
};

/// Layout version of the catalog as a whole (tree names and key layouts).
pub const SCHEMA_VERSION: u32 = 1;

const SCHEMA_KEY: &[u8] = b"schema_version";
const SEQ_KEY: &[u8] = b"seq";

/// Index of each tree in [`Catalog::trees`] and [`Txn::batches`].
#[derive(Clone, Copy)]
enum T {
    Meta,
    Collections,
    CollectionNames,
    Documents,
    CollDocs,
    DocNames,
    ByHash,
    DocMeta,
    Chunks,
    Embeddings,
    Log,
    Jobs,
    KvPending,
}

const TREE_NAMES: [&str; 13] = [
    "meta",
    "collections",
    "collection_names",
    "documents",
    "coll_docs",
    "doc_names",
    "by_hash",
    "doc_meta",
    "chunks",
    "embeddings",
    "log",
    "jobs",
    "kv_pending",
];

fn be(x: u64) -> [u8; 8] {
    x.to_be_bytes()
}

fn key2(a: u64, b: u64) -> [u8; 16] {
    let mut k = [0; 16];
    k[..8].copy_from_slice(&be(a));
    k[8..].copy_from_slice(&be(b));
    k
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

fn name_key(coll: u64, name: &str) -> Vec<u8> {
    let mut k = be(coll).to_vec();
    k.extend_from_slice(name.as_bytes());
    k
}

fn meta_prefix(coll: u64, key: &str, value: &str) -> Vec<u8> {
    let mut k = be(coll).to_vec();
    k.extend_from_slice(key.as_bytes());
    k.push(0);
    k.extend_from_slice(value.as_bytes());
    k.push(0);
    k
}

fn hash_key(hash: ContentHash, coll: u64, doc: u64) -> [u8; 32] {
    let mut k = [0; 32];
    k[..16].copy_from_slice(&hash.to_bytes());
    k[16..].copy_from_slice(&key2(coll, doc));
    k
}

/// The parsed content hash of a document record.
pub(crate) fn doc_hash(doc: &Document) -> Result<ContentHash> {
    ContentHash::from_hex(&doc.hash).ok_or_else(|| {
        KbError::corrupted(
            format!("document {}", doc.id),
            format!("hash {:?} is not 32 hex digits", doc.hash),
        )
    })
}

/// The catalog database.
pub struct Catalog {
    db: sled::Db,
    trees: Vec<Tree>,
}

impl std::fmt::Debug for Catalog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Catalog").finish_non_exhaustive()
    }
}

impl Catalog {
    /// Opens (creating) the catalog in `dir` and checks its schema version.
    pub fn open(dir: &Path) -> Result<Catalog> {
        let db = open_db(dir)?;
        let trees = TREE_NAMES
            .iter()
            .map(|n| db.open_tree(n))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let cat = Catalog { db, trees };
        match cat.tree(T::Meta).get(SCHEMA_KEY)? {
            Some(v) => {
                let found = <[u8; 4]>::try_from(&v[..])
                    .map(u32::from_le_bytes)
                    .map_err(|_| KbError::corrupted("catalog schema version", "not 4 bytes"))?;
                if found != SCHEMA_VERSION {
                    return Err(KbError::SchemaVersion {
                        found,
                        supported: SCHEMA_VERSION,
                    });
                }
            }
            None => {
                cat.tree(T::Meta)
                    .insert(SCHEMA_KEY, &SCHEMA_VERSION.to_le_bytes())?;
                cat.flush()?;
            }
        }
        Ok(cat)
    }

    fn tree(&self, t: T) -> &Tree {
        &self.trees[t as usize]
    }

    /// Makes every write so far durable.
    pub fn flush(&self) -> Result<()> {
        self.db.flush()?;
        Ok(())
    }

    /// A fresh id (never 0, never reused).
    pub fn new_id(&self) -> Result<u64> {
        Ok(self.db.generate_id()? + 1)
    }

    /// The last sequence number handed out.
    pub fn seq(&self) -> Result<u64> {
        match self.tree(T::Meta).get(SEQ_KEY)? {
            None => Ok(0),
            Some(v) => <[u8; 8]>::try_from(&v[..])
                .map(u64::from_le_bytes)
                .map_err(|_| KbError::corrupted("catalog sequence number", "not 8 bytes")),
        }
    }

    /// Applies `txn` atomically: all of its changes or none.
    pub fn write(&self, txn: Txn) -> Result<()> {
        let trees: Vec<&Tree> = self.trees.iter().collect();
        let res: std::result::Result<(), TransactionError<()>> =
            trees.as_slice().transaction(|views| {
                for (view, batch) in views.iter().zip(&txn.batches) {
                    view.apply_batch(batch)?;
                }
                Ok::<(), ConflictableTransactionError<()>>(())
            });
        match res {
            Ok(()) => Ok(()),
            Err(TransactionError::Storage(e)) => Err(e.into()),
            Err(TransactionError::Abort(())) => unreachable!("the transaction never aborts"),
        }
    }

    fn get<R: serde::de::DeserializeOwned>(
        &self,
        t: T,
        key: &[u8],
        what: &str,
    ) -> Result<Option<R>> {
        self.tree(t)
            .get(key)?
            .map(|v| decode(|| what.to_owned(), &v))
            .transpose()
    }

    pub fn collection(&self, id: u64) -> Result<Option<Collection>> {
        self.get(T::Collections, &be(id), &format!("collection {id}"))
    }

    pub fn collection_by_name(&self, name: &str) -> Result<Option<Collection>> {
        match self.tree(T::CollectionNames).get(name.as_bytes())? {
            None => Ok(None),
            Some(id) => self.collection(u64_at(&id, 0)),
        }
    }

    /// Every collection, by id.
    pub fn collections(&self) -> Result<Vec<Collection>> {
        self.tree(T::Collections)
            .iter()
            .map(|kv| {
                let (k, v) = kv?;
                decode(|| format!("collection {}", u64_at(&k, 0)), &v)
            })
            .collect()
    }

    pub fn document(&self, id: u64) -> Result<Option<Document>> {
        self.get(T::Documents, &be(id), &format!("document {id}"))
    }

    /// Ids of the documents of a collection, ascending.
    pub fn document_ids(&self, coll: u64) -> Result<Vec<u64>> {
        self.tree(T::CollDocs)
            .scan_prefix(be(coll))
            .keys()
            .map(|k| Ok(u64_at(&k?, 8)))
            .collect()
    }

    /// The documents of a collection, by id.
    pub fn documents(&self, coll: u64) -> Result<Vec<Document>> {
        let mut out = Vec::new();
        for id in self.document_ids(coll)? {
            out.push(self.document(id)?.ok_or_else(|| {
                KbError::corrupted(
                    format!("collection {coll}"),
                    format!("lists document {id}, which has no record"),
                )
            })?);
        }
        Ok(out)
    }

    /// The document of this name in the collection.
    pub fn doc_by_name(&self, coll: u64, name: &str) -> Result<Option<u64>> {
        Ok(self
            .tree(T::DocNames)
            .get(name_key(coll, name))?
            .map(|v| u64_at(&v, 0)))
    }

    /// How many documents, in any collection, have this content.
    pub fn hash_refs(&self, hash: ContentHash) -> Result<usize> {
        Ok(self.tree(T::ByHash).scan_prefix(hash.to_bytes()).count())
    }

    /// Documents of the collection whose metadata has `key` = `value`.
    pub fn docs_with_meta(&self, coll: u64, key: &str, value: &str) -> Result<HashSet<u64>> {
        let prefix = meta_prefix(coll, key, value);
        let n = prefix.len();
        self.tree(T::DocMeta)
            .scan_prefix(prefix)
            .keys()
            .map(|k| Ok(u64_at(&k?, n)))
            .collect()
    }

    /// A document's chunks, in order.
    pub fn chunks(&self, doc: u64) -> Result<Vec<Chunk>> {
        let lo = be(doc << ORDINAL_BITS);
        let hi = be((doc + 1) << ORDINAL_BITS);
        self.tree(T::Chunks)
            .range(lo..hi)
            .map(|kv| {
                let (k, v) = kv?;
                decode(|| format!("chunk {}", u64_at(&k, 0)), &v)
            })
            .collect()
    }

    /// Up to `n` chunks of a document from ordinal `from` on, in order.
    pub fn chunks_from(&self, doc: u64, from: u32, n: usize) -> Result<Vec<Chunk>> {
        let lo = be((doc << ORDINAL_BITS) | from as u64);
        let hi = be((doc + 1) << ORDINAL_BITS);
        self.tree(T::Chunks)
            .range(lo..hi)
            .take(n)
            .map(|kv| {
                let (k, v) = kv?;
                decode(|| format!("chunk {}", u64_at(&k, 0)), &v)
            })
            .collect()
    }

    /// A document's last chunk (chunks are written in order, so its ordinal + 1 is how many it
    /// has).
    pub fn last_chunk(&self, doc: u64) -> Result<Option<Chunk>> {
        let lo = be(doc << ORDINAL_BITS);
        let hi = be((doc + 1) << ORDINAL_BITS);
        match self.tree(T::Chunks).range(lo..hi).next_back() {
            None => Ok(None),
            Some(kv) => {
                let (k, v) = kv?;
                decode(|| format!("chunk {}", u64_at(&k, 0)), &v).map(Some)
            }
        }
    }

    /// Documents whose chunk KV is waiting, in id order, after `after`, at most `n`.
    pub fn kv_pending(&self, after: u64, n: usize) -> Result<Vec<u64>> {
        self.tree(T::KvPending)
            .range(be(after.saturating_add(1))..)
            .keys()
            .take(n)
            .map(|k| Ok(u64_at(&k?, 0)))
            .collect()
    }

    pub fn chunk(&self, id: u64) -> Result<Option<Chunk>> {
        self.get(T::Chunks, &be(id), &format!("chunk {id}"))
    }

    pub fn embedding(&self, chunk: u64) -> Result<Option<Vec<f32>>> {
        self.tree(T::Embeddings)
            .get(be(chunk))?
            .map(|v| decode_embedding(chunk, &v))
            .transpose()
    }

    /// Change-log entries of the collection after `seq`, in order.
    pub fn log_since(&self, coll: u64, seq: u64) -> Result<Vec<(u64, LogOp)>> {
        self.tree(T::Log)
            .range(key2(coll, seq + 1)..key2(coll + 1, 0))
            .map(|kv| {
                let (k, v) = kv?;
                let seq = u64_at(&k, 8);
                Ok((seq, decode(|| format!("log entry {coll}/{seq}"), &v)?))
            })
            .collect()
    }

    /// Change-log keys of the collection at or below `seq`.
    pub fn log_keys_upto(&self, coll: u64, seq: u64) -> Result<Vec<u64>> {
        self.tree(T::Log)
            .range(key2(coll, 0)..key2(coll, seq.saturating_add(1)))
            .keys()
            .map(|k| Ok(u64_at(&k?, 8)))
            .collect()
    }

    pub fn jobs(&self) -> Result<Vec<Job>> {
        self.tree(T::Jobs)
            .iter()
            .map(|kv| {
                let (k, v) = kv?;
                decode(|| format!("job {}", u64_at(&k, 0)), &v)
            })
            .collect()
    }

    /// Counts of every tree's entries, for tests that check nothing is left behind.
    pub fn tree_sizes(&self) -> Vec<(&'static str, usize)> {
        TREE_NAMES
            .iter()
            .zip(&self.trees)
            .map(|(n, t)| (*n, t.len()))
            .collect()
    }
}

/// Changes to several trees, applied together by [`Catalog::write`].
pub struct Txn {
    batches: Vec<Batch>,
}

impl Default for Txn {
    fn default() -> Txn {
        Txn {
            batches: TREE_NAMES.iter().map(|_| Batch::default()).collect(),
        }
    }
}

impl Txn {
    fn b(&mut self, t: T) -> &mut Batch {
        &mut self.batches[t as usize]
    }

    pub fn set_seq(&mut self, seq: u64) {
        self.b(T::Meta).insert(SEQ_KEY, &seq.to_le_bytes());
    }

    pub fn put_collection(&mut self, c: &Collection) {
        self.b(T::Collections).insert(&be(c.id), encode(c));
        self.b(T::CollectionNames)
            .insert(c.name.as_bytes(), &be(c.id));
    }

    pub fn remove_collection(&mut self, c: &Collection) {
        self.b(T::Collections).remove(&be(c.id));
        self.b(T::CollectionNames).remove(c.name.as_bytes());
    }

    /// Writes the document record and its lookup entries (idempotent).
    pub fn put_document(&mut self, d: &Document) -> Result<()> {
        let hash = doc_hash(d)?;
        self.b(T::Documents).insert(&be(d.id), encode(d));
        self.b(T::CollDocs).insert(&key2(d.collection, d.id), &[]);
        self.b(T::DocNames)
            .insert(name_key(d.collection, &d.name), &be(d.id));
        self.b(T::ByHash)
            .insert(&hash_key(hash, d.collection, d.id), &[]);
        for (k, v) in &d.metadata {
            let mut key = meta_prefix(d.collection, k, v);
            key.extend_from_slice(&be(d.id));
            self.b(T::DocMeta).insert(key, &[]);
        }
        Ok(())
    }

    /// Removes the document record and its lookup entries (not its chunks).
    pub fn remove_document(&mut self, d: &Document) -> Result<()> {
        let hash = doc_hash(d)?;
        self.b(T::Documents).remove(&be(d.id));
        self.b(T::CollDocs).remove(&key2(d.collection, d.id));
        self.b(T::DocNames).remove(name_key(d.collection, &d.name));
        self.b(T::ByHash)
            .remove(&hash_key(hash, d.collection, d.id));
        for (k, v) in &d.metadata {
            let mut key = meta_prefix(d.collection, k, v);
            key.extend_from_slice(&be(d.id));
            self.b(T::DocMeta).remove(key);
        }
        Ok(())
    }

    /// Writes a chunk and its embedding.
    pub fn put_chunk(&mut self, c: &Chunk, embedding: &[f32]) -> Result<()> {
        if c.ordinal as u64 >= MAX_CHUNKS_PER_DOC {
            return Err(KbError::invalid(
                "document",
                format!("has more than {MAX_CHUNKS_PER_DOC} chunks"),
            ));
        }
        self.b(T::Chunks).insert(&be(c.id), encode(c));
        self.put_embedding(c.id, embedding);
        Ok(())
    }

    pub fn put_embedding(&mut self, chunk: u64, embedding: &[f32]) {
        self.b(T::Embeddings)
            .insert(&be(chunk), encode_embedding(embedding));
    }

    pub fn remove_chunk(&mut self, chunk: u64) {
        self.b(T::Chunks).remove(&be(chunk));
        self.b(T::Embeddings).remove(&be(chunk));
    }

    pub fn log(&mut self, coll: u64, seq: u64, op: LogOp) {
        self.b(T::Log).insert(&key2(coll, seq), encode(&op));
    }

    pub fn remove_log(&mut self, coll: u64, seq: u64) {
        self.b(T::Log).remove(&key2(coll, seq));
    }

    /// Records that `doc`'s chunk KV is waiting to be computed.
    pub fn set_kv_pending(&mut self, doc: u64) {
        self.b(T::KvPending).insert(&be(doc), &[]);
    }

    pub fn remove_kv_pending(&mut self, doc: u64) {
        self.b(T::KvPending).remove(&be(doc));
    }

    pub fn put_job(&mut self, j: &Job) {
        self.b(T::Jobs).insert(&be(j.id), encode(j));
    }
}

/// How long [`open_db`] waits for the lock of a database that was just closed.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Opens the sled database in `dir`. sled releases its file lock from a background thread after
/// the last handle is dropped, so a reopen right after a close (a restart in the same process)
/// can find it still held for a moment: wait for it, up to [`LOCK_WAIT`], rather than fail.
fn open_db(dir: &Path) -> std::result::Result<sled::Db, sled::Error> {
    let start = std::time::Instant::now();
    loop {
        match sled::Config::new().path(dir).open() {
            Err(sled::Error::Io(e))
                if e.to_string().contains("could not acquire lock")
                    && start.elapsed() < LOCK_WAIT =>
            {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            r => return r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunker::ChunkConfig;
    use crate::records::{chunk_id, Stage};

    fn temp(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("engram-kb-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    fn doc(id: u64, coll: u64, name: &str, bytes: &[u8]) -> Document {
        Document {
            id,
            collection: coll,
            name: name.into(),
            hash: ContentHash::of(bytes).to_hex(),
            size: bytes.len() as u64,
            metadata: [("lang".to_string(), "en".to_string())].into(),
            format: None,
            title: None,
            chunks: 1,
            stage: Stage::Queued,
            stages: Vec::new(),
            error: None,
            failure: None,
            revision: 0,
            progress: None,
            warnings: Vec::new(),
        }
    }

    #[test]
    fn writes_are_atomic_and_lookups_agree() {
        let dir = temp("catalog");
        let cat = Catalog::open(&dir).unwrap();
        let coll = Collection {
            id: cat.new_id().unwrap(),
            name: "docs".into(),
            chunking: ChunkConfig::default(),
            embed_model: "m@1".into(),
            dim: 3,
            created_ms: 0,
            last_seq: 1,
            log_floor: 0,
            documents: 1,
            chunks: 1,
        };
        let d = doc(7, coll.id, "a.txt", b"alpha");
        let chunk = Chunk {
            id: chunk_id(7, 0),
            doc: 7,
            ordinal: 0,
            bytes: 0..5,
            chars: 0..5,
            tokens: 1,
            page: None,
            text: "alpha".into(),
        };
        let mut txn = Txn::default();
        txn.put_collection(&coll);
        txn.put_document(&d).unwrap();
        txn.put_chunk(&chunk, &[1.0, 0.0, 0.0]).unwrap();
        txn.set_seq(1);
        txn.log(coll.id, 1, LogOp::Add { doc: 7 });
        cat.write(txn).unwrap();
        cat.flush().unwrap();
        drop(cat);

        let cat = Catalog::open(&dir).unwrap();
        assert_eq!(cat.seq().unwrap(), 1);
        assert_eq!(cat.collection_by_name("docs").unwrap().unwrap(), coll);
        assert_eq!(cat.documents(coll.id).unwrap(), std::slice::from_ref(&d));
        assert_eq!(cat.doc_by_name(coll.id, "a.txt").unwrap(), Some(7));
        let h = ContentHash::of(b"alpha");
        assert_eq!(cat.hash_refs(h).unwrap(), 1);
        assert_eq!(
            cat.docs_with_meta(coll.id, "lang", "en").unwrap(),
            [7].into()
        );
        assert!(cat.docs_with_meta(coll.id, "lang", "e").unwrap().is_empty());
        assert_eq!(cat.chunks(7).unwrap(), std::slice::from_ref(&chunk));
        assert!(cat.chunks(8).unwrap().is_empty());
        assert_eq!(cat.embedding(chunk.id).unwrap().unwrap(), [1.0, 0.0, 0.0]);
        assert_eq!(
            cat.log_since(coll.id, 0).unwrap(),
            [(1, LogOp::Add { doc: 7 })]
        );
        assert!(cat.log_since(coll.id, 1).unwrap().is_empty());

        let mut txn = Txn::default();
        txn.remove_document(&d).unwrap();
        txn.remove_chunk(chunk.id);
        txn.remove_log(coll.id, 1);
        txn.remove_collection(&coll);
        cat.write(txn).unwrap();
        let left: usize = cat
            .tree_sizes()
            .iter()
            .filter(|(n, _)| *n != "meta")
            .map(|(_, s)| s)
            .sum();
        assert_eq!(left, 0, "{:?}", cat.tree_sizes());
        drop(cat);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn refuses_other_schema_versions() {
        let dir = temp("schema");
        let cat = Catalog::open(&dir).unwrap();
        cat.tree(T::Meta)
            .insert(SCHEMA_KEY, &(SCHEMA_VERSION + 1).to_le_bytes())
            .unwrap();
        cat.flush().unwrap();
        drop(cat);
        assert!(matches!(
            Catalog::open(&dir),
            Err(KbError::SchemaVersion { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
