//! Approximate nearest neighbours over chunk embeddings: HNSW with tombstoned deletes.
//!
//! - `graph`: the hnsw_rs graph and the cosine distance on unit vectors.
//! - `format`: the manifest and data files, and crash-safe commits.
//!
//! The raw vectors are kept beside the graph (in memory and on disk): they serve exact search,
//! filtered searches too selective for the graph, compaction, and rebuilding a damaged graph
//! without re-embedding anything. The price is a second copy, n x dim x 4 bytes (150 MB at 100k
//! chunks of 384 dimensions) in memory and on disk.

mod format;
mod graph;

pub use format::FORMAT_VERSION;

use std::collections::{HashMap, HashSet};
use std::fs::{self, File, TryLockError};
use std::path::{Path, PathBuf};

use crate::error::{IndexError, Result};
use crate::{DocFilter, Hit};
use format::{GraphFiles, Manifest, MANIFEST};
use graph::{dot, Graph};

/// A commit rebuilds the graph without tombstones once they are more than this share of the
/// rows: below it, tombstones cost little search time (hnsw_rs walks through them), above it
/// the graph fills with dead ends and recall drops at a fixed ef.
const COMPACT_DEAD_SHARE: f64 = 0.2;

/// Smallest search breadth (hnsw_rs `ef`) at layer 0, for k = 10: ef = 64 gave recall@10 of
/// 0.981 at 10k clustered 384-d vectors, 96 keeps it above 0.98 at 100k (`benches/retrieval.rs`).
/// `ef` grows as 2k for larger k.
const EF_SEARCH_MIN: usize = 96;
/// Upper bound on `ef` when a filter makes the graph search wider.
const EF_SEARCH_MAX: usize = 1024;

/// A filtered search scans the allowed rows exactly (instead of walking the graph) when they
/// are at most this many: 8192 dot products of 384 dimensions take well under a millisecond.
const EXACT_SCAN_MAX_ROWS: usize = 8192;
/// ... or when they are less than 1/this of the live rows: a graph search through a filter that
/// rejects most nodes visits most of the graph anyway, and may miss allowed rows.
const EXACT_SCAN_SELECTIVITY: usize = 10;

/// Approximate nearest neighbours (HNSW, cosine on unit vectors) with tombstoned deletes.
///
/// Vectors are L2-normalised on the way in, and scores are cosine similarities. Unlike
/// [`crate::Bm25Index`], `add` and `delete_doc` are visible to `search` at once; `commit`
/// makes them durable, with the catalog's `seq`. A chunk id that is added again replaces its
/// previous vector.
///
/// A commit rewrites the whole data file and graph dump when rows were added (linear in the
/// collection size), so commit once per ingestion batch, not per chunk.
pub struct VectorIndex {
    dir: PathBuf,
    /// Held for the index's lifetime: one writer per directory.
    _lock: File,
    dim: usize,
    model_id: String,
    seq: u64,
    generation: u64,
    /// Per row: (chunk_id, doc_id). Row numbers are the graph's point ids.
    ids: Vec<(u64, u64)>,
    /// Row-major unit vectors, `dim` per row.
    vectors: Vec<f32>,
    dead: Vec<bool>,
    dead_count: usize,
    /// Live rows of each document.
    by_doc: HashMap<u64, Vec<u32>>,
    /// The live row of each chunk.
    by_chunk: HashMap<u64, u32>,
    graph: Graph,
    /// The files of the last commit (None before the first).
    committed: Option<(String, u64, Option<GraphFiles>)>,
    /// Rows were added or compacted since the last commit: the next commit writes a new
    /// generation of the data file and graph.
    rows_changed: bool,
    graph_recovered: bool,
    poisoned: bool,
    /// [`EXACT_SCAN_MAX_ROWS`]; tests lower it to reach the filtered graph search on small data.
    exact_scan_max_rows: usize,
}

impl VectorIndex {
    /// Opens the index in `dir` for vectors of `dim` dimensions made by `model_id`, creating an
    /// empty one if the directory has none.
    ///
    /// Errors: `Mismatch` if the index was built for another dimension, model or format;
    /// `Corrupt` if the manifest or data file fails its checksum or is unreadable; `Locked` if
    /// another `VectorIndex` has the directory open. A graph dump that fails its checksum is
    /// not an error: the graph is rebuilt from the verified vectors
    /// ([`VectorIndex::graph_recovered`]) and written at the next commit.
    pub fn open_or_create(dir: &Path, dim: usize, model_id: &str) -> Result<VectorIndex> {
        if dim == 0 || dim > u32::MAX as usize {
            return Err(IndexError::Mismatch {
                path: dir.to_path_buf(),
                what: "dimension",
                expected: "1..=u32::MAX".into(),
                found: dim.to_string(),
            });
        }
        fs::create_dir_all(dir).map_err(|e| IndexError::io(dir, e))?;
        let lock_path = dir.join("LOCK");
        let lock = File::create(&lock_path).map_err(|e| IndexError::io(&lock_path, e))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(IndexError::Locked {
                    path: dir.to_path_buf(),
                })
            }
            Err(TryLockError::Error(e)) => return Err(IndexError::io(&lock_path, e)),
        }
        let mut index = VectorIndex {
            dir: dir.to_path_buf(),
            _lock: lock,
            dim,
            model_id: model_id.to_string(),
            seq: 0,
            generation: 0,
            ids: Vec::new(),
            vectors: Vec::new(),
            dead: Vec::new(),
            dead_count: 0,
            by_doc: HashMap::new(),
            by_chunk: HashMap::new(),
            graph: Graph::new(0),
            committed: None,
            rows_changed: false,
            graph_recovered: false,
            poisoned: false,
            exact_scan_max_rows: EXACT_SCAN_MAX_ROWS,
        };
        let manifest_path = dir.join(MANIFEST);
        match fs::read(&manifest_path) {
            Ok(bytes) => index.load(&manifest_path, &bytes)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(IndexError::io(&manifest_path, e)),
        }
        index.remove_stale_files();
        Ok(index)
    }

    fn load(&mut self, manifest_path: &Path, bytes: &[u8]) -> Result<()> {
        let m = Manifest::decode(manifest_path, bytes)?;
        if m.dim as usize != self.dim {
            return Err(self.mismatch("dimension", self.dim, m.dim));
        }
        if m.model_id != self.model_id {
            return Err(self.mismatch("embedding model", &self.model_id, &m.model_id));
        }
        let data_path = self.dir.join(&m.data_file);
        let data = format::read_data(&data_path, self.dim, m.rows, m.data_xxh3)?;
        self.seq = m.seq;
        self.generation = m.generation;
        self.ids = data.ids;
        self.vectors = data.vectors;
        self.dead = m.dead;
        self.dead_count = self.dead.iter().filter(|d| **d).count();
        for (row, &(chunk_id, doc_id)) in self.ids.iter().enumerate() {
            if !self.dead[row] {
                self.by_doc.entry(doc_id).or_default().push(row as u32);
                if self.by_chunk.insert(chunk_id, row as u32).is_some() {
                    return Err(IndexError::corrupt(
                        &data_path,
                        format!("chunk {chunk_id} has two live rows"),
                    ));
                }
            }
        }
        let loaded = m.graph.as_ref().and_then(|g| {
            let intact = g
                .paths(&self.dir)
                .iter()
                .zip([g.graph_xxh3, g.data_xxh3])
                .all(|(p, sum)| format::hash_file(p) == Some(sum));
            intact
                .then(|| Graph::load(&self.dir, &g.basename).ok())
                .flatten()
                .filter(|graph| graph.len() == self.ids.len())
        });
        match loaded {
            Some(graph) => self.graph = graph,
            None if self.ids.is_empty() => {}
            None => {
                self.graph = Graph::build(&self.vectors, self.dim);
                self.graph_recovered = true;
                self.rows_changed = true;
            }
        }
        self.committed = Some((m.data_file, m.data_xxh3, m.graph));
        Ok(())
    }

    /// The catalog sequence number of the last commit (0 for a new index).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Number of live (not deleted) vectors.
    pub fn len(&self) -> u64 {
        (self.ids.len() - self.dead_count) as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    /// Number of deleted vectors still in the graph (until a commit compacts them away).
    pub fn tombstones(&self) -> usize {
        self.dead_count
    }

    /// True if the graph dump was missing or damaged at open and was rebuilt from the vectors.
    pub fn graph_recovered(&self) -> bool {
        self.graph_recovered
    }

    /// Adds `(chunk_id, doc_id, vector)` items; each vector is L2-normalised. The whole batch is
    /// validated before anything is added.
    pub fn add(&mut self, items: &[(u64, u64, &[f32])]) -> Result<()> {
        self.check_writable()?;
        for &(chunk_id, _, v) in items {
            if v.len() != self.dim {
                return Err(IndexError::VectorDim {
                    chunk_id,
                    expected: self.dim,
                    found: v.len(),
                });
            }
            check_vector(v).map_err(|reason| IndexError::BadVector { chunk_id, reason })?;
        }
        let first = self.ids.len();
        self.vectors.reserve(items.len() * self.dim);
        for &(chunk_id, doc_id, v) in items {
            if let Some(&old) = self.by_chunk.get(&chunk_id) {
                self.kill(old as usize);
            }
            let row = self.ids.len() as u32;
            self.ids.push((chunk_id, doc_id));
            self.dead.push(false);
            self.by_doc.entry(doc_id).or_default().push(row);
            self.by_chunk.insert(chunk_id, row);
            let inv = 1.0 / dot(v, v).sqrt();
            self.vectors.extend(v.iter().map(|x| x * inv));
        }
        let new: Vec<(&[f32], usize)> = self.vectors[first * self.dim..]
            .chunks_exact(self.dim)
            .zip(first..)
            .collect();
        self.graph.insert(&new);
        self.rows_changed |= !items.is_empty();
        Ok(())
    }

    /// Deletes every vector of `doc_id`; returns how many there were.
    pub fn delete_doc(&mut self, doc_id: u64) -> Result<usize> {
        self.check_writable()?;
        let rows = self.by_doc.remove(&doc_id).unwrap_or_default();
        for &row in &rows {
            self.kill(row as usize);
        }
        Ok(rows.len())
    }

    fn kill(&mut self, row: usize) {
        if self.dead[row] {
            return;
        }
        self.dead[row] = true;
        self.dead_count += 1;
        let (chunk_id, doc_id) = self.ids[row];
        if self.by_chunk.get(&chunk_id) == Some(&(row as u32)) {
            self.by_chunk.remove(&chunk_id);
        }
        if let Some(rows) = self.by_doc.get_mut(&doc_id) {
            rows.retain(|&r| r as usize != row);
            if rows.is_empty() {
                self.by_doc.remove(&doc_id);
            }
        }
    }

    /// Makes every change durable with the catalog's `seq`, compacting first when tombstones
    /// exceed 20% of the rows. After an I/O error the index refuses further writes.
    pub fn commit(&mut self, seq: u64) -> Result<()> {
        self.check_writable()?;
        if self.dead_count > 0
            && self.dead_count as f64 > COMPACT_DEAD_SHARE * self.ids.len() as f64
        {
            self.compact();
        }
        let result = self.persist(seq);
        if result.is_err() {
            self.poisoned = true;
        }
        result
    }

    /// Drops tombstoned rows and rebuilds the graph over the live ones.
    fn compact(&mut self) {
        let mut ids = Vec::with_capacity(self.ids.len() - self.dead_count);
        let mut vectors = Vec::with_capacity(ids.capacity() * self.dim);
        for (row, v) in self.vectors.chunks_exact(self.dim).enumerate() {
            if !self.dead[row] {
                ids.push(self.ids[row]);
                vectors.extend_from_slice(v);
            }
        }
        self.by_doc.clear();
        self.by_chunk.clear();
        for (row, &(chunk_id, doc_id)) in ids.iter().enumerate() {
            self.by_doc.entry(doc_id).or_default().push(row as u32);
            self.by_chunk.insert(chunk_id, row as u32);
        }
        self.dead = vec![false; ids.len()];
        self.dead_count = 0;
        self.graph = Graph::build(&vectors, self.dim);
        self.ids = ids;
        self.vectors = vectors;
        self.rows_changed = true;
    }

    fn persist(&mut self, seq: u64) -> Result<()> {
        let previous = self.committed.clone();
        let (data_file, data_xxh3, graph) = match &previous {
            Some(files) if !self.rows_changed => files.clone(),
            _ => {
                let generation = self.generation + 1;
                let data_file = format!("vectors-{generation}.bin");
                let data_xxh3 = format::write_data(
                    &self.dir.join(&data_file),
                    self.dim,
                    &self.ids,
                    &self.vectors,
                )?;
                let graph = if self.ids.is_empty() {
                    None
                } else {
                    Some(self.dump_graph(generation)?)
                };
                self.generation = generation;
                (data_file, data_xxh3, graph)
            }
        };
        let manifest = Manifest {
            dim: self.dim as u32,
            model_id: self.model_id.clone(),
            seq,
            generation: self.generation,
            rows: self.ids.len() as u64,
            live: self.len(),
            data_file: data_file.clone(),
            data_xxh3,
            graph: graph.clone(),
            dead: self.dead.clone(),
        };
        format::write_atomic(&self.dir, MANIFEST, &manifest.encode())?;
        self.seq = seq;
        self.rows_changed = false;
        self.committed = Some((data_file, data_xxh3, graph));
        if previous != self.committed {
            self.remove_stale_files();
        }
        Ok(())
    }

    fn dump_graph(&self, generation: u64) -> Result<GraphFiles> {
        let basename = format!("graph-{generation}");
        for p in format::graph_paths(&self.dir, &basename) {
            // Leftovers of a commit that crashed before its manifest was written.
            let _ = fs::remove_file(p);
        }
        let basename =
            self.graph
                .dump(&self.dir, &basename)
                .map_err(|reason| IndexError::Hnsw {
                    path: self.dir.clone(),
                    reason,
                })?;
        let [graph_path, data_path] = format::graph_paths(&self.dir, &basename);
        Ok(GraphFiles {
            graph_xxh3: format::sync_and_hash(&graph_path)?,
            data_xxh3: format::sync_and_hash(&data_path)?,
            basename,
        })
    }

    /// Deletes data, graph and temp files that the current manifest does not name (earlier
    /// generations, crashed commits). Best effort: a file that stays is only wasted space.
    fn remove_stale_files(&self) {
        let committed = self
            .committed
            .as_ref()
            .map(|(data_file, _, graph)| (data_file.as_str(), graph.as_ref()));
        remove_unnamed(&self.dir, committed);
    }

    /// [`remove_stale_files`](Self::remove_stale_files) without opening the index: what a
    /// commit that failed (a full disk) or crashed left, found from the manifest alone, so a
    /// caller can free that space before anything else opens. A directory whose manifest is
    /// missing or unreadable is left alone. Returns the bytes freed.
    pub fn remove_stale(dir: &Path) -> u64 {
        let manifest_path = dir.join(MANIFEST);
        let Ok(bytes) = fs::read(&manifest_path) else {
            return 0;
        };
        let Ok(m) = Manifest::decode(&manifest_path, &bytes) else {
            return 0;
        };
        remove_unnamed(dir, Some((m.data_file.as_str(), m.graph.as_ref())))
    }

    /// The `k` nearest live chunks to `query` among the documents `filter` allows, best first,
    /// scored by cosine similarity.
    ///
    /// The filter is applied inside the graph search (with tombstones), and a filter that
    /// leaves few rows is answered by an exact scan of those rows, so `k` hits come back
    /// whenever `k` allowed chunks exist.
    pub fn search(&self, query: &[f32], k: usize, filter: DocFilter<'_>) -> Result<Vec<Hit>> {
        let q = self.normalised_query(query)?;
        let live = self.len() as usize;
        if k == 0 || live == 0 {
            return Ok(Vec::new());
        }
        let mut ef = EF_SEARCH_MIN.max(2 * k);
        let allowed = match filter {
            None => live,
            Some(docs) => {
                let rows: usize = docs
                    .iter()
                    .filter_map(|d| self.by_doc.get(d))
                    .map(Vec::len)
                    .sum();
                if rows <= k
                    || rows <= self.exact_scan_max_rows
                    || rows * EXACT_SCAN_SELECTIVITY < live
                {
                    return Ok(self.scan(&q, k, self.doc_rows(docs)));
                }
                ef = (ef * live / rows).min(EF_SEARCH_MAX).max(ef);
                rows
            }
        };
        let dead = &self.dead;
        let ids = &self.ids;
        let keep =
            |row: &usize| !dead[*row] && filter.is_none_or(|docs| docs.contains(&ids[*row].1));
        let found = if filter.is_none() && self.dead_count == 0 {
            self.graph.search(&q, k, ef, None)
        } else {
            self.graph.search(&q, k, ef, Some(&keep))
        };
        if found.len() < k.min(allowed) {
            // The graph walk came back short (a filter or tombstones cut it off): answer exactly.
            let rows: Vec<usize> = (0..ids.len()).filter(|r| keep(r)).collect();
            return Ok(self.scan(&q, k, rows.into_iter()));
        }
        Ok(self.hits(&q, found.into_iter().map(|(row, _)| row)))
    }

    /// Exact (brute-force) top `k`, for measuring recall and as the answer for small filters.
    pub fn exact_search(&self, query: &[f32], k: usize, filter: DocFilter<'_>) -> Result<Vec<Hit>> {
        let q = self.normalised_query(query)?;
        if k == 0 {
            return Ok(Vec::new());
        }
        Ok(match filter {
            Some(docs) => self.scan(&q, k, self.doc_rows(docs)),
            None => self.scan(&q, k, (0..self.ids.len()).filter(|&r| !self.dead[r])),
        })
    }

    fn doc_rows<'a>(&'a self, docs: &'a HashSet<u64>) -> impl Iterator<Item = usize> + 'a {
        docs.iter()
            .filter_map(|d| self.by_doc.get(d))
            .flatten()
            .map(|&r| r as usize)
    }

    fn scan(&self, q: &[f32], k: usize, rows: impl Iterator<Item = usize>) -> Vec<Hit> {
        let mut scored: Vec<(f32, usize)> = rows.map(|r| (dot(q, self.row(r)), r)).collect();
        let by_rank = |a: &(f32, usize), b: &(f32, usize)| {
            b.0.total_cmp(&a.0)
                .then(self.ids[a.1].0.cmp(&self.ids[b.1].0))
        };
        if scored.len() > k {
            scored.select_nth_unstable_by(k - 1, by_rank);
            scored.truncate(k);
        }
        scored.sort_by(by_rank);
        scored
            .into_iter()
            .map(|(score, r)| self.hit(r, score))
            .collect()
    }

    fn hits(&self, q: &[f32], rows: impl Iterator<Item = usize>) -> Vec<Hit> {
        let mut hits: Vec<Hit> = rows.map(|r| self.hit(r, dot(q, self.row(r)))).collect();
        hits.sort_by(|a, b| {
            b.score
                .total_cmp(&a.score)
                .then(a.chunk_id.cmp(&b.chunk_id))
        });
        hits
    }

    fn hit(&self, row: usize, score: f32) -> Hit {
        let (chunk_id, doc_id) = self.ids[row];
        Hit {
            chunk_id,
            doc_id,
            score,
        }
    }

    fn row(&self, row: usize) -> &[f32] {
        &self.vectors[row * self.dim..(row + 1) * self.dim]
    }

    fn normalised_query(&self, query: &[f32]) -> Result<Vec<f32>> {
        if query.len() != self.dim {
            return Err(IndexError::QueryDim {
                expected: self.dim,
                found: query.len(),
            });
        }
        check_vector(query).map_err(|reason| IndexError::BadQuery { reason })?;
        let inv = 1.0 / dot(query, query).sqrt();
        Ok(query.iter().map(|x| x * inv).collect())
    }

    fn mismatch(
        &self,
        what: &'static str,
        expected: impl ToString,
        found: impl ToString,
    ) -> IndexError {
        IndexError::Mismatch {
            path: self.dir.clone(),
            what,
            expected: expected.to_string(),
            found: found.to_string(),
        }
    }

    fn check_writable(&self) -> Result<()> {
        if self.poisoned {
            return Err(IndexError::Poisoned {
                path: self.dir.clone(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
impl VectorIndex {
    pub(crate) fn set_exact_scan_max_rows(&mut self, rows: usize) {
        self.exact_scan_max_rows = rows;
    }
}

/// Deletes the index files in `dir` that `committed` (data file, graph) does not name; returns
/// the bytes freed.
fn remove_unnamed(dir: &Path, committed: Option<(&str, Option<&GraphFiles>)>) -> u64 {
    let mut keep: HashSet<String> = [MANIFEST.to_string(), "LOCK".to_string()].into();
    if let Some((data_file, graph)) = committed {
        keep.insert(data_file.to_owned());
        if let Some(g) = graph {
            keep.insert(format!("{}.hnsw.graph", g.basename));
            keep.insert(format!("{}.hnsw.data", g.basename));
        }
    }
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    let mut freed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let ours =
            name.starts_with("vectors-") || name.starts_with("graph-") || name.ends_with(".tmp");
        if ours && !keep.contains(&name) {
            let len = entry.metadata().map_or(0, |m| m.len());
            if fs::remove_file(entry.path()).is_ok() {
                freed += len;
            }
        }
    }
    freed
}

fn check_vector(v: &[f32]) -> std::result::Result<(), &'static str> {
    if v.iter().any(|x| !x.is_finite()) {
        return Err("NaN or infinite component");
    }
    let norm2 = dot(v, v);
    if !(norm2.is_normal() && norm2.sqrt().is_normal()) {
        return Err("zero or subnormal length");
    }
    Ok(())
}
