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

use std::collections::HashSet;
use std::ops::Range;
use std::path::{Path, PathBuf};

use tantivy::collector::TopDocs;
use tantivy::query::{BooleanQuery, ConstScoreQuery, Occur, Query, TermQuery, TermSetQuery};
use tantivy::schema::{
    Field, IndexRecordOption, Schema, TextFieldIndexing, TextOptions, FAST, INDEXED, STORED,
};
use tantivy::{Index, IndexReader, IndexWriter, ReloadPolicy, TantivyDocument, TantivyError, Term};

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

    /// The `k` best chunks for `query`, best first, among the documents `filter` allows.
    ///
    /// The filter is a clause of the query (a term set on `doc_id`), so the top `k` are taken
    /// among allowed chunks, not cut from a list that other documents crowded.
    pub fn search(&self, query: &str, k: usize, filter: DocFilter<'_>) -> Result<Vec<Hit>> {
        if k == 0 || filter.is_some_and(HashSet::is_empty) {
            return Ok(Vec::new());
        }
        let Some(text_query) = self.text_query(query) else {
            return Ok(Vec::new());
        };
        let query: Box<dyn Query> = match filter {
            None => text_query,
            Some(docs) => {
                let terms = docs
                    .iter()
                    .map(|&d| Term::from_field_u64(self.fields.doc_id, d));
                let allowed = ConstScoreQuery::new(Box::new(TermSetQuery::new(terms)), 0.0);
                Box::new(BooleanQuery::new(vec![
                    (Occur::Must, text_query),
                    (Occur::Must, Box::new(allowed)),
                ]))
            }
        };
        let searcher = self.reader.searcher();
        let top = searcher
            .search(&*query, &TopDocs::with_limit(k).order_by_score())
            .map_err(|e| tantivy_error(&self.dir, e))?;
        let mut hits = Vec::with_capacity(top.len());
        for (score, address) in top {
            let fast = searcher.segment_reader(address.segment_ord).fast_fields();
            let read = |name: &str| -> Result<u64> {
                let column = fast.u64(name).map_err(|e| tantivy_error(&self.dir, e))?;
                column.first(address.doc_id).ok_or_else(|| {
                    IndexError::corrupt(&self.dir, format!("chunk without a {name} value"))
                })
            };
            hits.push(Hit {
                chunk_id: read("chunk_id")?,
                doc_id: read("doc_id")?,
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

    /// The query's terms as one disjunction; `None` when no term survives analysis (empty,
    /// punctuation only, stop words only).
    fn text_query(&self, query: &str) -> Option<Box<dyn Query>> {
        let mut clauses: Vec<(Occur, Box<dyn Query>)> = Vec::new();
        let mut seen = HashSet::new();
        for (term, _, _) in analyzer::tokens(&mut analyzer::text(), query) {
            if seen.insert(term.clone()) {
                let term = Term::from_field_text(self.fields.text, &term);
                clauses.push((
                    Occur::Should,
                    Box::new(TermQuery::new(term, IndexRecordOption::WithFreqs)),
                ));
            }
        }
        (!clauses.is_empty()).then(|| Box::new(BooleanQuery::new(clauses)) as Box<dyn Query>)
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
