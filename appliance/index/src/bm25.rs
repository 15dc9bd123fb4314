//! BM25 over chunk text on tantivy, in one field analysed by script (`analyzer::text`).
//!
//! Every chunk and every query goes through the same analyzer, which segments Han runs with
//! jieba and stems the Latin words, so a mixed corpus, and a mixed chunk, answers queries in
//! either language. (Format 1 indexed each chunk in an English or a Chinese field chosen by its
//! majority script, which lost the Chinese sentences of mostly English chunks.) A query becomes
//! one disjunction of term queries built from analysed terms, never through tantivy's query
//! parser, so user text with `:`, `"`, `(` or `AND` cannot make a query fail.
//!
//! BM25 uses tantivy's constants (k1 = 1.2, b = 0.75): tantivy 0.27 hard-codes them in
//! `query/bm25.rs`, so Anserini's k1 = 0.9, b = 0.4 would need a fork or a custom scorer.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};
use std::ops::Range;
use std::path::{Path, PathBuf};

use tantivy::collector::TopDocs;
use tantivy::columnar::Column;
use tantivy::query::{
    BooleanQuery, ConstScoreQuery, EnableScoring, Occur, Query, TermQuery, TermSetQuery,
};
use tantivy::schema::{
    Field, IndexRecordOption, Schema, TextFieldIndexing, TextOptions, FAST, INDEXED, STORED,
};
use tantivy::{
    DocAddress, Index, IndexReader, IndexWriter, ReloadPolicy, Score, Searcher, TantivyDocument,
    TantivyError, Term,
};

use crate::analyzer::{self, ANALYZER};
use crate::error::{IndexError, Result};
use crate::{ChunkDoc, DocFilter, Hit};

/// Version of the schema and payload written here; bump it when either changes, and an index of
/// another version is reported as `Mismatch` (and rebuilt by the catalog).
pub const FORMAT_VERSION: u32 = 2;

/// Prefix of the commit payload, followed by the catalog sequence number.
const PAYLOAD_PREFIX: &str = "engram-bm25 v2 seq=";

/// Indexing heap of the single writer thread. tantivy needs at least 15 MB per thread; 64 MB
/// makes segments of roughly 100k chunks before flushing, and one thread keeps ingestion from
/// taking more than one core of a small appliance away from queries.
const WRITER_HEAP_BYTES: usize = 64 << 20;

#[derive(Clone, Copy)]
struct Fields {
    chunk_id: Field,
    doc_id: Field,
    text: Field,
}

fn schema() -> (Schema, Fields) {
    let mut builder = Schema::builder();
    let chunk_id = builder.add_u64_field("chunk_id", FAST | INDEXED | STORED);
    let doc_id = builder.add_u64_field("doc_id", FAST | INDEXED);
    // BM25 needs term frequencies but no positions: no phrase queries, a third smaller index.
    let options = TextOptions::default().set_indexing_options(
        TextFieldIndexing::default()
            .set_tokenizer(ANALYZER)
            .set_index_option(IndexRecordOption::WithFreqs),
    );
    let text = builder.add_text_field("text", options);
    let fields = Fields {
        chunk_id,
        doc_id,
        text,
    };
    (builder.build(), fields)
}

/// BM25 over chunk text, analysed by script (jieba for Han runs, stemmed English for the rest).
///
/// Writes (`add`, `delete_doc`) become visible to `search` at the next `commit`. Chunk ids must
/// be unique within the collection: re-indexing a document goes through `delete_doc` first.
pub struct Bm25Index {
    dir: PathBuf,
    writer: IndexWriter,
    reader: IndexReader,
    fields: Fields,
    seq: u64,
    poisoned: bool,
    /// [`COMMON_POSTINGS_MAX`]; tests lower it to reach the skipping search on small data.
    common_postings_max: u64,
}

impl Bm25Index {
    /// Opens the index in `dir`, creating the directory and an empty index if there is none.
    ///
    /// Every segment file's checksum is verified before the index is used (tantivy's footer
    /// CRC; a full read of the index), so a damaged index answers `Corrupt` here rather than
    /// failing or panicking later in a query.
    pub fn open_or_create(dir: &Path) -> Result<Bm25Index> {
        std::fs::create_dir_all(dir).map_err(|e| IndexError::io(dir, e))?;
        let (expected_schema, fields) = schema();
        let meta = dir.join("meta.json");
        let index = if meta.exists() {
            let index = Index::open_in_dir(dir).map_err(|e| open_error(dir, e))?;
            if index.schema() != expected_schema {
                // The payload names the format that wrote it ("engram-bm25 v1 seq=7").
                let found = index
                    .load_metas()
                    .ok()
                    .and_then(|m| m.payload)
                    .and_then(|p| p.split(" seq=").next().map(str::to_owned))
                    .filter(|f| f.starts_with("engram-bm25 v"))
                    .unwrap_or_else(|| "another schema".into());
                return Err(IndexError::Mismatch {
                    path: dir.to_path_buf(),
                    what: "format",
                    expected: format!("engram-bm25 v{FORMAT_VERSION}"),
                    found,
                });
            }
            let damaged = index.validate_checksum().map_err(|e| open_error(dir, e))?;
            if !damaged.is_empty() {
                let mut names: Vec<_> = damaged.iter().map(|p| p.display().to_string()).collect();
                names.sort();
                return Err(IndexError::corrupt(
                    dir,
                    format!("checksum mismatch in {}", names.join(", ")),
                ));
            }
            index
        } else {
            Index::create_in_dir(dir, expected_schema).map_err(|e| tantivy_error(dir, e))?
        };
        index.tokenizers().register(ANALYZER, analyzer::text());

        let payload = index.load_metas().map_err(|e| open_error(dir, e))?.payload;
        let seq = match payload {
            None => 0,
            Some(p) => parse_payload(&p).ok_or_else(|| IndexError::Mismatch {
                path: dir.to_path_buf(),
                what: "commit payload",
                expected: format!("{PAYLOAD_PREFIX}<seq>"),
                found: p.clone(),
            })?,
        };
        let reader = index
            .reader_builder()
            .reload_policy(ReloadPolicy::Manual)
            .try_into()
            .map_err(|e| open_error(dir, e))?;
        let writer = index
            .writer_with_num_threads(1, WRITER_HEAP_BYTES)
            .map_err(|e| match e {
                TantivyError::LockFailure(..) => IndexError::Locked {
                    path: dir.to_path_buf(),
                },
                e => tantivy_error(dir, e),
            })?;
        Ok(Bm25Index {
            dir: dir.to_path_buf(),
            writer,
            reader,
            fields,
            seq,
            poisoned: false,
            common_postings_max: COMMON_POSTINGS_MAX,
        })
    }

    /// The catalog sequence number of the last commit (0 for a new index).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Number of searchable chunks as of the last commit.
    pub fn len(&self) -> u64 {
        self.reader.searcher().num_docs()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Queues chunks for indexing; searchable after the next commit.
    pub fn add(&mut self, chunks: &[ChunkDoc<'_>]) -> Result<()> {
        self.check_writable()?;
        for chunk in chunks {
            let mut doc = TantivyDocument::new();
            doc.add_u64(self.fields.chunk_id, chunk.chunk_id);
            doc.add_u64(self.fields.doc_id, chunk.doc_id);
            doc.add_text(self.fields.text, chunk.text);
            self.writer
                .add_document(doc)
                .map_err(|e| tantivy_error(&self.dir, e))?;
        }
        Ok(())
    }

    /// Queues the deletion of every chunk of `doc_id` (including ones added since the last
    /// commit); takes effect at the next commit.
    pub fn delete_doc(&mut self, doc_id: u64) -> Result<()> {
        self.check_writable()?;
        self.writer
            .delete_term(Term::from_field_u64(self.fields.doc_id, doc_id));
        Ok(())
    }

    /// Makes every queued write durable and searchable, recording the catalog's `seq` in the
    /// same atomic commit.
    pub fn commit(&mut self, seq: u64) -> Result<()> {
        self.check_writable()?;
        let result = (|| {
            let mut prepared = self.writer.prepare_commit()?;
            prepared.set_payload(&format!("{PAYLOAD_PREFIX}{seq}"));
            prepared.commit()?;
            self.reader.reload()
        })();
        match result {
            Ok(()) => {
                self.seq = seq;
                Ok(())
            }
            Err(e) => {
                self.poisoned = true;
                Err(tantivy_error(&self.dir, e))
            }
        }
    }

    /// Waits for the segment merges that commits started, then closes the index. Dropping it
    /// instead abandons a merge in progress (tantivy merges in the background after a commit),
    /// which leaves the index in more, smaller segments, each searched on its own, until the
    /// next commit merges again.
    pub fn close(self) -> Result<()> {
        let dir = self.dir;
        self.writer
            .wait_merging_threads()
            .map_err(|e| tantivy_error(&dir, e))
    }

    /// The `k` best chunks for `query`, best first, among the documents `filter` allows.
    ///
    /// The filter is a clause of the query (a term set on `doc_id`), so the top `k` are taken
    /// among allowed chunks, not cut from a list that other documents crowded. Without a
    /// filter the search runs in two passes (see `top_k`), which in a large collection leave out
    /// the chunks that hold none of a long query's rare terms.
    pub fn search(&self, query: &str, k: usize, filter: DocFilter<'_>) -> Result<Vec<Hit>> {
        if k == 0 || filter.is_some_and(HashSet::is_empty) {
            return Ok(Vec::new());
        }
        let terms = self.query_terms(query);
        if terms.is_empty() {
            return Ok(Vec::new());
        }
        let searcher = self.reader.searcher();
        let top = match filter {
            None => top_k(&searcher, &terms, k, self.common_postings_max),
            Some(docs) => {
                let allowed = docs
                    .iter()
                    .map(|&d| Term::from_field_u64(self.fields.doc_id, d));
                let allowed = ConstScoreQuery::new(Box::new(TermSetQuery::new(allowed)), 0.0);
                let query = BooleanQuery::new(vec![
                    (Occur::Must, disjunction(&terms)),
                    (Occur::Must, Box::new(allowed)),
                ]);
                searcher.search(&query, &TopDocs::with_limit(k).order_by_score())
            }
        }
        .map_err(|e| tantivy_error(&self.dir, e))?;
        // Each segment's id columns, opened once per search: opening one decodes its block
        // index (a few thousand blocks at a million chunks), which per hit cost more than
        // the hits' scoring.
        let mut columns: Vec<Option<[Column<u64>; 2]>> =
            vec![None; searcher.segment_readers().len()];
        let mut hits = Vec::with_capacity(top.len());
        for (score, address) in top {
            let [chunk_ids, doc_ids] = match &mut columns[address.segment_ord as usize] {
                Some(c) => &*c,
                slot @ None => {
                    let fast = searcher.segment_reader(address.segment_ord).fast_fields();
                    let open = |name: &str| fast.u64(name).map_err(|e| tantivy_error(&self.dir, e));
                    slot.insert([open("chunk_id")?, open("doc_id")?])
                }
            };
            let read = |column: &Column<u64>, name: &str| -> Result<u64> {
                column.first(address.doc_id).ok_or_else(|| {
                    IndexError::corrupt(&self.dir, format!("chunk without a {name} value"))
                })
            };
            hits.push(Hit {
                chunk_id: read(chunk_ids, "chunk_id")?,
                doc_id: read(doc_ids, "doc_id")?,
                score,
            });
        }
        hits.sort_by(|a, b| {
            b.score
                .total_cmp(&a.score)
                .then(a.chunk_id.cmp(&b.chunk_id))
        });
        Ok(hits)
    }

    /// Byte ranges in `text` of the terms `query` matches, for highlighting: `text` and `query`
    /// are analysed as they are indexed and searched, and the ranges of matching tokens are
    /// returned sorted, overlaps merged.
    pub fn highlight(&self, query: &str, text: &str) -> Vec<Range<usize>> {
        let mut analyzer = analyzer::text();
        let wanted: HashSet<String> = analyzer::tokens(&mut analyzer, query)
            .into_iter()
            .map(|t| t.0)
            .collect();
        if wanted.is_empty() {
            return Vec::new();
        }
        let mut ranges: Vec<Range<usize>> = analyzer::tokens(&mut analyzer, text)
            .into_iter()
            .filter(|t| wanted.contains(&t.0))
            .map(|t| t.1..t.2)
            .collect();
        ranges.sort_by_key(|r| (r.start, r.end));
        let mut merged: Vec<Range<usize>> = Vec::with_capacity(ranges.len());
        for r in ranges {
            match merged.last_mut() {
                Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
                _ => merged.push(r),
            }
        }
        merged
    }

    /// The query's distinct analysed terms; none when nothing survives analysis (empty,
    /// punctuation only, stop words only).
    fn query_terms(&self, query: &str) -> Vec<Term> {
        let mut seen = HashSet::new();
        analyzer::tokens(&mut analyzer::text(), query)
            .into_iter()
            .filter(|(term, _, _)| seen.insert(term.clone()))
            .map(|(term, _, _)| Term::from_field_text(self.fields.text, &term))
            .collect()
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

/// The terms as one disjunction: a chunk's score is the sum of its terms' BM25 scores.
fn disjunction(terms: &[Term]) -> Box<dyn Query> {
    Box::new(BooleanQuery::new(disjunction_clauses(terms)))
}

fn disjunction_clauses(terms: &[Term]) -> Vec<(Occur, Box<dyn Query>)> {
    terms
        .iter()
        .map(|t| {
            let q: Box<dyn Query> =
                Box::new(TermQuery::new(t.clone(), IndexRecordOption::WithFreqs));
            (Occur::Should, q)
        })
        .collect()
}

/// A query term in more than this share of the chunks is common: its postings are long and
/// its weight (idf) low. Rarer terms are in at most 5 % of the chunks (idf above about 3).
/// Elasticsearch's `common` terms query drew the same line (`cutoff_frequency`); at a million
/// synthetic chunks, 1 % left more queries with no rare term at all (searched the plain way),
/// and their slowest as slow as before.
const COMMON_DF_SHARE: f64 = 0.05;

/// [`top_k`] skips the chunks that hold common terms only when their lists hold more postings
/// than this in all: walking them is what a long query costs at a million chunks (20 to 50
/// ms for ten common terms, 2 to 4 million postings, on the 2-core development machine), while
/// below it (SciFact's 9,571 chunks, and any collection under about 100,000) the search stays
/// exact at little cost.
const COMMON_POSTINGS_MAX: u64 = 1_000_000;

/// The `k` best chunks for the disjunction of `terms`, best first by BM25 (the sum of the
/// terms' scores), found in up to two passes instead of tantivy's `TopDocs`:
///
/// 1. When the query has both rare and common terms (see [`COMMON_DF_SHARE`]): every chunk
///    that holds a rare term, scored with all the terms. Rare lists are short, and for each of
///    their chunks the common lists are only sought to, not walked.
/// 2. The chunks the first pass did not see, by block-max WAND (all the terms, or the common
///    ones alone after pass 1, since a chunk without a rare term scores by its common terms),
///    from the threshold pass 1 reached, one threshold across segments.
///
/// Both passes together return exactly `TopDocs`'s top `k` (up to ties at the last place).
/// Pass 2 is skipped when pass 1 filled `k` places and the common terms' lists are longer than
/// [`COMMON_POSTINGS_MAX`]: then a chunk that holds none of the query's rare terms cannot be
/// returned (Elasticsearch's common terms query), which at a million chunks kept BM25's top 100
/// for 191 of 200 queries and the fused top 10 for 199 of 200, and cut BM25's p99 from 38 to
/// 16 ms; block-max WAND alone walks the common lists block by block whatever its threshold.
/// Deleted chunks are skipped in both passes.
fn top_k(
    searcher: &Searcher,
    terms: &[Term],
    k: usize,
    common_postings_max: u64,
) -> tantivy::Result<Vec<(Score, DocAddress)>> {
    let scoring = EnableScoring::enabled_from_searcher(searcher);
    let chunks = searcher.num_docs().max(1) as f64;
    let (mut rare, mut common) = (Vec::new(), Vec::new());
    let mut common_postings = 0;
    for t in terms {
        let df = searcher.doc_freq(t)?;
        if df as f64 <= COMMON_DF_SHARE * chunks {
            rare.push(t.clone());
        } else {
            common.push(t.clone());
            common_postings += df;
        }
    }
    let mut top = TopK::new(k);
    let mut seen: HashSet<DocAddress> = HashSet::new();
    let rest = if !rare.is_empty() && !common.is_empty() {
        let mut clauses = vec![(Occur::Must, disjunction(&rare))];
        clauses.extend(disjunction_clauses(&common));
        let holding_rare = BooleanQuery::new(clauses).weight(scoring)?;
        for (ord, reader) in searcher.segment_readers().iter().enumerate() {
            let alive = reader.alive_bitset();
            holding_rare.for_each_pruning(top.threshold(), reader, &mut |doc, score| {
                if alive.is_none_or(|a| a.is_alive(doc)) {
                    let address = DocAddress::new(ord as u32, doc);
                    top.push(score, address);
                    seen.insert(address);
                }
                top.threshold()
            })?;
        }
        if top.is_full() && common_postings > common_postings_max {
            return Ok(top.into_vec());
        }
        disjunction(&common).weight(scoring)?
    } else {
        disjunction(terms).weight(scoring)?
    };
    for (ord, reader) in searcher.segment_readers().iter().enumerate() {
        let alive = reader.alive_bitset();
        rest.for_each_pruning(top.threshold(), reader, &mut |doc, score| {
            let address = DocAddress::new(ord as u32, doc);
            // A chunk pass 1 pushed may come again (its common terms alone beat the threshold).
            if alive.is_none_or(|a| a.is_alive(doc)) && !seen.contains(&address) {
                top.push(score, address);
            }
            top.threshold()
        })?;
    }
    Ok(top.into_vec())
}

/// The `k` best-scored chunks seen so far (a min-heap on the score).
struct TopK {
    k: usize,
    heap: BinaryHeap<Reverse<Scored>>,
}

#[derive(PartialEq)]
struct Scored(Score, DocAddress);

impl Eq for Scored {}

impl Ord for Scored {
    fn cmp(&self, other: &Scored) -> std::cmp::Ordering {
        // At equal scores the lower address ranks higher, as in tantivy's collectors.
        self.0.total_cmp(&other.0).then(other.1.cmp(&self.1))
    }
}

impl PartialOrd for Scored {
    fn partial_cmp(&self, other: &Scored) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl TopK {
    fn new(k: usize) -> TopK {
        TopK {
            k,
            heap: BinaryHeap::with_capacity(k + 1),
        }
    }

    fn push(&mut self, score: Score, address: DocAddress) {
        self.heap.push(Reverse(Scored(score, address)));
        if self.heap.len() > self.k {
            self.heap.pop();
        }
    }

    fn is_full(&self) -> bool {
        self.heap.len() == self.k
    }

    /// The score a chunk must beat to enter: the `k`-th best so far, or none until `k` are in.
    fn threshold(&self) -> Score {
        match self.heap.peek() {
            Some(Reverse(worst)) if self.is_full() => worst.0,
            _ => Score::MIN,
        }
    }

    fn into_vec(self) -> Vec<(Score, DocAddress)> {
        self.heap
            .into_iter()
            .map(|Reverse(Scored(s, a))| (s, a))
            .collect()
    }
}

#[cfg(test)]
impl Bm25Index {
    pub(crate) fn set_common_postings_max(&mut self, postings: u64) {
        self.common_postings_max = postings;
    }
}

fn parse_payload(payload: &str) -> Option<u64> {
    payload.strip_prefix(PAYLOAD_PREFIX)?.parse().ok()
}

fn tantivy_error(dir: &Path, source: TantivyError) -> IndexError {
    IndexError::Tantivy {
        path: dir.to_path_buf(),
        source,
    }
}

/// While opening, anything but a plain I/O failure or a lock means the files cannot be trusted.
fn open_error(dir: &Path, e: TantivyError) -> IndexError {
    match e {
        TantivyError::IoError(io)
            if !matches!(
                io.kind(),
                std::io::ErrorKind::InvalidData | std::io::ErrorKind::UnexpectedEof
            ) =>
        {
            IndexError::Io {
                path: dir.to_path_buf(),
                source: std::io::Error::new(io.kind(), io.to_string()),
            }
        }
        TantivyError::LockFailure(..) => IndexError::Locked {
            path: dir.to_path_buf(),
        },
        e => IndexError::corrupt(dir, e.to_string()),
    }
}
