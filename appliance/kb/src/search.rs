//! Hybrid search over one collection: BM25, dense vectors, or both fused (a weighted sum of
//! min-max normalised scores by default, reciprocal-rank on request), with metadata filters and
//! hits that carry everything a citation needs.
//!
//! # The dense side and languages the embedder does not know
//!
//! The default embedding model (all-MiniLM-L6-v2) has an English word-piece vocabulary: most
//! Chinese characters become `[UNK]`, and the few it has (244) were barely trained, so a
//! Chinese query's vector says next to nothing and the dense ranking is close to noise. Fusing
//! noise with a good BM25 ranking only drags the good one down. Before a hybrid search the query
//! is therefore tokenized with the embedder's own tokenizer and the share of "blind" word
//! pieces measured ([`Models::blind`](crate::Models::blind): `[UNK]`, and single CJK characters
//! when the vocabulary holds too few of them to read Chinese). The dense weight is kept whole up
//! to [`BLIND_SHARE_FULL`], falls linearly to zero at [`BLIND_SHARE_NONE`], and when it is zero
//! the dense search is skipped and the hybrid ranking is the BM25 ranking. An explicit
//! [`SearchMode::Dense`] search is always run as asked. A multilingual embedder (few blind
//! pieces) keeps its full weight.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use engram_index::{fuse, Bm25Index, DocFilter, Fused, Fusion, FusionMode, Hit, VectorIndex};

use crate::error::Result;
use crate::kb::{KnowledgeBase, Models};
use crate::records::{Collection, Document};

/// Up to this share of blind word pieces the query keeps its full dense weight: a stray emoji
/// or rare symbol in an English query does not matter.
pub const BLIND_SHARE_FULL: f32 = 0.05;

/// From this share of blind word pieces on, the dense side gets no weight: a quarter of the
/// query unreadable means the vector mostly encodes what is left, e.g. the digits and
/// punctuation of a Chinese question.
pub const BLIND_SHARE_NONE: f32 = 0.25;

/// Candidates each side retrieves before fusion (at least `k`): fusion needs more than the
/// final `k` from each list, since a chunk ranked 30th by both can beat one ranked 1st by one.
pub const DEFAULT_CANDIDATES: usize = 100;

/// Longest query the knowledge base searches, in bytes: far beyond any question (the embedder
/// reads 256 word pieces), small enough that BM25's per-term cost stays bounded. Callers may
/// set a lower limit.
pub const MAX_QUERY_BYTES: usize = 64 << 10;

/// Reciprocal-rank fusion's usual constant (Cormack et al. 2009).
pub const DEFAULT_RRF_K: f32 = 60.0;

/// How hybrid search fuses by default: each side's scores min-max normalised over its
/// candidates, then summed with [`DEFAULT_BM25_WEIGHT`] and [`DEFAULT_DENSE_WEIGHT`]. Chosen on
/// SciFact's train queries (809, never the test ones; `engram eval retrieval --split train`):
/// 0.7306 nDCG@10 against 0.7108 for equal-weight RRF (k = 60) and 0.7206 for RRF with k = 10,
/// and within 0.004 of its best for 50 to 200 candidates per side. RRF keeps only ranks, so a
/// chunk that one side scores far above the rest counts no more than a narrow winner; the
/// normalised scores keep that margin (Bruch et al. 2023, "An Analysis of Fusion Functions for
/// Hybrid Retrieval", find the same).
pub const DEFAULT_FUSION: FusionMode = FusionMode::Weighted;

/// BM25's weight in the default fusion (dense 0.35 / 0.4 / 0.45 / 0.5 / 0.55 gave 0.7270 /
/// 0.7272 / 0.7306 / 0.7279 / 0.7230 on SciFact train at 100 candidates).
pub const DEFAULT_BM25_WEIGHT: f32 = 0.55;

/// The dense side's weight in the default fusion, before the unknown-token scaling above.
pub const DEFAULT_DENSE_WEIGHT: f32 = 0.45;

/// Which retriever(s) to run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SearchMode {
    Bm25,
    Dense,
    #[default]
    Hybrid,
}

impl SearchMode {
    pub fn name(self) -> &'static str {
        match self {
            SearchMode::Bm25 => "bm25",
            SearchMode::Dense => "dense",
            SearchMode::Hybrid => "hybrid",
        }
    }
}

/// A search over one collection.
#[derive(Clone, Debug, PartialEq)]
pub struct SearchRequest {
    pub collection: String,
    pub query: String,
    pub mode: SearchMode,
    /// Hits returned.
    pub k: usize,
    /// Candidates per side before fusion (raised to `k`).
    pub candidates: usize,
    /// How hybrid combines the two lists.
    pub fusion: FusionMode,
    pub bm25_weight: f32,
    /// Before the unknown-token scaling above.
    pub dense_weight: f32,
    /// Only documents whose metadata has every one of these key/value pairs.
    pub metadata: Vec<(String, String)>,
}

impl SearchRequest {
    /// A hybrid search for the top 10, fused the default way.
    pub fn new(collection: impl Into<String>, query: impl Into<String>) -> SearchRequest {
        SearchRequest {
            collection: collection.into(),
            query: query.into(),
            mode: SearchMode::Hybrid,
            k: 10,
            candidates: DEFAULT_CANDIDATES,
            fusion: DEFAULT_FUSION,
            bm25_weight: DEFAULT_BM25_WEIGHT,
            dense_weight: DEFAULT_DENSE_WEIGHT,
            metadata: Vec::new(),
        }
    }

    /// Fuses with equal-weight reciprocal-rank fusion (k = 60) instead.
    pub fn rrf(mut self) -> SearchRequest {
        self.fusion = FusionMode::Rrf { k: DEFAULT_RRF_K };
        self.bm25_weight = 1.0;
        self.dense_weight = 1.0;
        self
    }
}

/// How much the dense side can say about a query.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DenseSignal {
    /// Share of the query's word pieces (without `[CLS]`/`[SEP]`) that are blind.
    pub blind_share: f32,
    /// Factor applied to the dense weight in hybrid searches, 0 to 1.
    pub scale: f32,
}

impl DenseSignal {
    /// The scale for an unknown-token share (see the module docs).
    pub fn from_blind_share(blind_share: f32) -> DenseSignal {
        let scale = ((BLIND_SHARE_NONE - blind_share) / (BLIND_SHARE_NONE - BLIND_SHARE_FULL))
            .clamp(0.0, 1.0);
        DenseSignal { blind_share, scale }
    }
}

/// Ranked candidates without their text: what [`KnowledgeBase::retrieve`] returns.
#[derive(Clone, Debug, PartialEq)]
pub struct Retrieved {
    /// Best first; `score` is the fused score (or the one side's score).
    pub hits: Vec<Fused>,
    pub signal: DenseSignal,
    /// The dense weight used (0 when the dense side was skipped).
    pub dense_weight: f32,
    /// The query's vector, when the dense side ran.
    pub query_vector: Option<Vec<f32>>,
}

/// One search hit, ready to cite.
#[derive(Clone, Debug, PartialEq)]
pub struct SearchHit {
    pub chunk_id: u64,
    pub doc_id: u64,
    pub doc_name: String,
    pub doc_title: Option<String>,
    /// The chunk's ordinal in its document.
    pub ordinal: u32,
    /// Span of the chunk in the document's text, in bytes and in chars.
    pub bytes: Range<usize>,
    pub chars: Range<usize>,
    /// 1-based page (PDF).
    pub page: Option<u32>,
    pub text: String,
    /// BM25 score, when BM25 retrieved the chunk.
    pub bm25: Option<f32>,
    /// Cosine similarity to the query, when the query was embedded.
    pub dense: Option<f32>,
    /// The score the hits are ranked by.
    pub score: f32,
    /// Byte ranges in `text` of the query's terms.
    pub highlights: Vec<Range<usize>>,
}

/// The outcome of [`KnowledgeBase::search`].
#[derive(Clone, Debug, PartialEq)]
pub struct SearchResults {
    pub hits: Vec<SearchHit>,
    pub signal: DenseSignal,
    pub dense_weight: f32,
}

impl Models {
    /// How much signal the embedder's vector of `query` carries (see the module docs).
    pub fn dense_signal(&self, query: &str) -> Result<DenseSignal> {
        if self.blind.is_empty() {
            return Ok(DenseSignal::from_blind_share(0.0));
        }
        let ids = self.embedder.tokenize(query)?;
        // Drop [CLS] and [SEP].
        let pieces = ids.get(1..ids.len().saturating_sub(1)).unwrap_or(&[]);
        if pieces.is_empty() {
            return Ok(DenseSignal::from_blind_share(0.0));
        }
        let blind = pieces.iter().filter(|id| self.blind.contains(id)).count();
        Ok(DenseSignal::from_blind_share(
            blind as f32 / pieces.len() as f32,
        ))
    }

    /// The largest cosine similarity between `query` and one of `texts` (`None` when there are
    /// none): all embedded in one call, the query with them.
    pub fn best_similarity(&self, query: &str, texts: &[&str]) -> Result<Option<f32>> {
        Ok(self
            .similarities(query, texts)?
            .into_iter()
            .reduce(f32::max))
    }

    /// The cosine similarity of `query` to each of `texts`, all embedded in one call.
    pub fn similarities(&self, query: &str, texts: &[&str]) -> Result<Vec<f32>> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let mut all = Vec::with_capacity(texts.len() + 1);
        all.push(query);
        all.extend_from_slice(texts);
        let vectors = self.embedder.embed(&all)?;
        let (q, rest) = vectors.split_first().expect("the query was embedded");
        Ok(rest.iter().map(|v| cosine(v, q)).collect())
    }
}

/// The cosine similarity of two unit-length embeddings.
fn cosine(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

impl KnowledgeBase {
    /// How much signal the embedder's vector of `query` carries (see the module docs).
    pub fn dense_signal(&self, query: &str) -> Result<DenseSignal> {
        self.models.dense_signal(query)
    }

    /// The documents of `coll` matching every metadata pair (`None`: no filter).
    fn metadata_filter(
        &self,
        coll: &Collection,
        pairs: &[(String, String)],
    ) -> Result<Option<HashSet<u64>>> {
        let mut allowed: Option<HashSet<u64>> = None;
        for (k, v) in pairs {
            let docs = self.catalog.docs_with_meta(coll.id, k, v)?;
            allowed = Some(match allowed {
                None => docs,
                Some(a) => a.intersection(&docs).copied().collect(),
            });
        }
        Ok(allowed)
    }

    /// Ranked chunk ids and scores, without reading their text: the cheap half of
    /// [`search`](Self::search), for evaluation.
    pub fn retrieve(&self, req: &SearchRequest) -> Result<Retrieved> {
        let plan = self.plan(req)?;
        let (lexical, dense) = self.candidates(req, &plan)?;
        let mut hits = fuse_sides(&lexical, &dense, req, plan.dense_weight);
        hits.truncate(req.k);
        Ok(Retrieved {
            hits,
            signal: plan.signal,
            dense_weight: plan.dense_weight,
            query_vector: plan.query_vector,
        })
    }

    /// Searches a collection and returns the top `k` chunks with their documents, spans,
    /// pages, scores and highlight ranges. A chunk that only BM25 found still gets its cosine
    /// similarity (from its stored vector) when the query was embedded.
    pub fn search(&self, req: &SearchRequest) -> Result<SearchResults> {
        let (hits, plan) = self.search_in(std::slice::from_ref(req))?;
        Ok(SearchResults {
            hits: hits.into_iter().map(|(_, h)| h).collect(),
            signal: plan.signal,
            dense_weight: plan.dense_weight,
        })
    }

    /// One search over several collections: `reqs` ask the same (query, mode, fusion, weights,
    /// `k`) of one collection each, with its own metadata filter. Each side's candidates from
    /// every collection are ranked together, so the fused score is on one scale across them:
    /// normalised per collection, every collection's best hit would score 1 and a weak
    /// collection's best would outrank a strong one's second. Returns the top `k`, each with the
    /// index of the request (the collection) it came from.
    pub fn search_many(&self, reqs: &[SearchRequest]) -> Result<Vec<(usize, SearchHit)>> {
        if let Some(first) = reqs.first() {
            let same = |r: &SearchRequest| {
                (&r.query, r.mode, r.k, r.candidates, r.fusion)
                    == (
                        &first.query,
                        first.mode,
                        first.k,
                        first.candidates,
                        first.fusion,
                    )
                    && r.bm25_weight == first.bm25_weight
                    && r.dense_weight == first.dense_weight
            };
            if !reqs.iter().all(same) {
                return Err(crate::KbError::invalid(
                    "collections",
                    "a search over several collections asks the same of each (query, mode, \
                     fusion, weights, k)",
                ));
            }
        }
        Ok(self.search_in(reqs)?.0)
    }

    /// [`search_many`](Self::search_many), and the query's plan.
    fn search_in(&self, reqs: &[SearchRequest]) -> Result<(Vec<(usize, SearchHit)>, Plan)> {
        let Some(first) = reqs.first() else {
            return Ok((Vec::new(), Plan::none()));
        };
        let plan = self.plan(first)?;
        let mut colls = Vec::with_capacity(reqs.len());
        let mut lexical = Vec::new();
        let mut dense = Vec::new();
        let mut source: HashMap<u64, usize> = HashMap::new();
        for (i, req) in reqs.iter().enumerate() {
            let coll = self.collection(&req.collection)?;
            let (l, d) = self.candidates(req, &plan)?;
            for h in l.iter().chain(&d) {
                source.insert(h.chunk_id, i);
            }
            lexical.extend(l);
            dense.extend(d);
            colls.push(coll);
        }
        // Several collections' lists merged, best first as one collection's are (ties: the
        // lower chunk id); one collection's stay in the order its indexes gave.
        if reqs.len() > 1 {
            for side in [&mut lexical, &mut dense] {
                side.sort_by(|a, b| {
                    b.score
                        .total_cmp(&a.score)
                        .then(a.chunk_id.cmp(&b.chunk_id))
                });
            }
        }
        let mut fused = fuse_sides(&lexical, &dense, first, plan.dense_weight);
        fused.truncate(first.k);
        let mut docs: HashMap<u64, Document> = HashMap::new();
        let mut hits = Vec::with_capacity(fused.len());
        for f in &fused {
            let i = source[&f.chunk_id];
            // An index entry the catalog no longer has (never expected) is skipped, not shown.
            let Some(chunk) = self.catalog.chunk(f.chunk_id)? else {
                continue;
            };
            let doc = match docs.entry(f.doc_id) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    let Some(d) = self.catalog.document(f.doc_id)? else {
                        continue;
                    };
                    e.insert(d)
                }
            };
            let dense = match (f.dense, &plan.query_vector) {
                (Some(d), _) => Some(d),
                (None, Some(q)) => self.catalog.embedding(chunk.id)?.map(|v| cosine(&v, q)),
                (None, None) => None,
            };
            let idx = self.indexes(&colls[i])?;
            hits.push((
                i,
                SearchHit {
                    chunk_id: chunk.id,
                    doc_id: doc.id,
                    doc_name: doc.name.clone(),
                    doc_title: doc.title.clone(),
                    ordinal: chunk.ordinal,
                    highlights: idx.bm25.highlight(&first.query, &chunk.text),
                    bytes: chunk.bytes,
                    chars: chunk.chars,
                    page: chunk.page,
                    text: chunk.text,
                    bm25: f.bm25,
                    dense,
                    score: f.score,
                },
            ));
        }
        Ok((hits, plan))
    }

    /// The query's side of a search: how much the dense side can say about it, the dense
    /// weight it gets, and its vector when the dense side runs.
    fn plan(&self, req: &SearchRequest) -> Result<Plan> {
        if req.query.len() > MAX_QUERY_BYTES {
            return Err(crate::KbError::invalid(
                "query",
                format!(
                    "{} bytes, more than the {MAX_QUERY_BYTES} a query may have",
                    req.query.len()
                ),
            ));
        }
        let signal = match req.mode {
            SearchMode::Hybrid => self.dense_signal(&req.query)?,
            _ => DenseSignal::from_blind_share(0.0),
        };
        let dense_weight = match req.mode {
            SearchMode::Bm25 => 0.0,
            SearchMode::Dense => 1.0,
            SearchMode::Hybrid => req.dense_weight * signal.scale,
        };
        let query_vector = if dense_weight > 0.0 {
            Some(self.models.embedder.embed_one(&req.query)?)
        } else {
            None
        };
        Ok(Plan {
            signal,
            dense_weight,
            query_vector,
        })
    }

    /// Each side's candidates in `req`'s collection, among the documents its metadata allows.
    fn candidates(&self, req: &SearchRequest, plan: &Plan) -> Result<(Vec<Hit>, Vec<Hit>)> {
        let coll = self.collection(&req.collection)?;
        let idx = self.indexes(&coll)?;
        let filter = self.metadata_filter(&coll, &req.metadata)?;
        if filter.as_ref().is_some_and(HashSet::is_empty) {
            return Ok((Vec::new(), Vec::new()));
        }
        candidates(
            &idx.bm25,
            &idx.vectors,
            req,
            plan.query_vector.as_deref(),
            plan.dense_weight,
            filter.as_ref(),
        )
    }

    /// Mean recall@k of the HNSW search against exact search, over these queries.
    pub fn hnsw_recall(&self, collection: &str, queries: &[&str], k: usize) -> Result<f64> {
        let coll = self.collection(collection)?;
        let idx = self.indexes(&coll)?;
        let mut sum = 0.0;
        let mut n = 0;
        for batch in queries.chunks(crate::kb::EMBED_BATCH) {
            for q in self.models.embedder.embed(batch)? {
                let exact: HashSet<u64> = idx
                    .vectors
                    .exact_search(&q, k, None)?
                    .iter()
                    .map(|h| h.chunk_id)
                    .collect();
                if exact.is_empty() {
                    continue;
                }
                let found = idx
                    .vectors
                    .search(&q, k, None)?
                    .iter()
                    .filter(|h| exact.contains(&h.chunk_id))
                    .count();
                sum += found as f64 / exact.len() as f64;
                n += 1;
            }
        }
        Ok(if n == 0 { 1.0 } else { sum / n as f64 })
    }
}

/// The query's side of a search ([`KnowledgeBase::plan`]).
struct Plan {
    signal: DenseSignal,
    dense_weight: f32,
    query_vector: Option<Vec<f32>>,
}

impl Plan {
    /// The plan of no search at all.
    fn none() -> Plan {
        Plan {
            signal: DenseSignal::from_blind_share(0.0),
            dense_weight: 0.0,
            query_vector: None,
        }
    }
}

/// The ranking half of [`KnowledgeBase::retrieve`], on one collection's two indexes: BM25's
/// and the vector index's top `req.candidates` (at least `req.k`) among the documents `filter`
/// allows, fused as `req` says with the dense side weighed `dense_weight` (hybrid), cut to
/// `req.k`. The dense side runs when `query_vector` is given and `dense_weight` is above 0.
///
/// Public so that a benchmark can time exactly what a search runs on indexes it built itself
/// (`examples/retrieval_bench/`: a million synthetic chunks).
pub fn rank(
    bm25: &Bm25Index,
    vectors: &VectorIndex,
    req: &SearchRequest,
    query_vector: Option<&[f32]>,
    dense_weight: f32,
    filter: DocFilter<'_>,
) -> Result<Vec<Fused>> {
    let (lexical, dense) = candidates(bm25, vectors, req, query_vector, dense_weight, filter)?;
    let mut hits = fuse_sides(&lexical, &dense, req, dense_weight);
    hits.truncate(req.k);
    Ok(hits)
}

/// BM25's and the vector index's top `req.candidates` (at least `req.k`), best first: the
/// sides `req.mode` and `dense_weight` run.
fn candidates(
    bm25: &Bm25Index,
    vectors: &VectorIndex,
    req: &SearchRequest,
    query_vector: Option<&[f32]>,
    dense_weight: f32,
    filter: DocFilter<'_>,
) -> Result<(Vec<Hit>, Vec<Hit>)> {
    let candidates = req.candidates.max(req.k);
    let lexical: Vec<Hit> = match req.mode {
        SearchMode::Dense => Vec::new(),
        _ => bm25.search(&req.query, candidates, filter)?,
    };
    let dense: Vec<Hit> = match query_vector {
        Some(q) if dense_weight > 0.0 => vectors.search(q, candidates, filter)?,
        _ => Vec::new(),
    };
    Ok((lexical, dense))
}

/// The ranking of a search's candidates, best first: hybrid fuses both sides as `req` says; a
/// search of one side, or a hybrid one whose dense side was skipped, ranks by that side's
/// scores min-max normalised over the candidates. Either way `score` is on one scale, 0 to 1
/// (RRF aside), and each side's raw score stays beside it (`bm25`, `dense`): a BM25 score of
/// 11.3 and a fused 0.8 are not put side by side.
fn fuse_sides(
    lexical: &[Hit],
    dense: &[Hit],
    req: &SearchRequest,
    dense_weight: f32,
) -> Vec<Fused> {
    let alone = |bm25_weight: f32| Fusion {
        mode: FusionMode::Weighted,
        bm25_weight,
        dense_weight: 1.0 - bm25_weight,
    };
    match req.mode {
        SearchMode::Bm25 => fuse(lexical, &[], alone(1.0)),
        SearchMode::Dense => fuse(&[], dense, alone(0.0)),
        SearchMode::Hybrid if dense.is_empty() => fuse(lexical, &[], alone(1.0)),
        SearchMode::Hybrid => fuse(
            lexical,
            dense,
            Fusion {
                mode: req.fusion,
                bm25_weight: req.bm25_weight,
                dense_weight,
            },
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_weight_falls_with_unknown_pieces() {
        assert_eq!(DenseSignal::from_blind_share(0.0).scale, 1.0);
        assert_eq!(DenseSignal::from_blind_share(BLIND_SHARE_FULL).scale, 1.0);
        let mid = DenseSignal::from_blind_share((BLIND_SHARE_FULL + BLIND_SHARE_NONE) / 2.0).scale;
        assert!((mid - 0.5).abs() < 1e-6, "{mid}");
        assert_eq!(DenseSignal::from_blind_share(BLIND_SHARE_NONE).scale, 0.0);
        assert_eq!(DenseSignal::from_blind_share(0.7).scale, 0.0);
    }
}
