//! Hybrid retrieval latency and HNSW recall on synthetic collections.
//!
//! ```text
//! cargo bench -p engram-index --bench retrieval
//! ENGRAM_BENCH_SIZES=10000 ENGRAM_BENCH_QUERIES=200 cargo bench -p engram-index --bench retrieval
//! ```
//!
//! For each collection size it builds a BM25 index over synthetic English chunks (words drawn
//! from a Zipf distribution over a made-up vocabulary) and a vector index over clustered unit
//! vectors of 384 dimensions, then times hybrid queries (BM25 top 100 + vector top 100 + RRF,
//! keeping 10) and measures the vector index's recall@10 against exact search. The vectors are
//! synthetic, so the recall is a property of the graph settings, not of any embedding model.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use engram_index::{fuse, Bm25Index, ChunkDoc, Fusion, VectorIndex};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const DIM: usize = 384;
const VOCABULARY: usize = 30_000;
const ZIPF_EXPONENT: f64 = 1.0;
const WORDS_PER_CHUNK: usize = 120;
const CHUNKS_PER_DOC: u64 = 20;
const CLUSTERS: usize = 1_000;
/// Norm of the per-point noise added to its cluster centre (a unit vector) before
/// normalising: a point's cosine to its centre is about 0.7, to a cluster mate about 0.5.
const NOISE: f32 = 1.0;
const CANDIDATES: usize = 100;
const K: usize = 10;

fn main() {
    let sizes: Vec<usize> = std::env::var("ENGRAM_BENCH_SIZES")
        .unwrap_or_else(|_| "10000,100000".into())
        .split(',')
        .map(|s| {
            s.trim()
                .parse()
                .expect("ENGRAM_BENCH_SIZES: comma-separated counts")
        })
        .collect();
    let queries: usize = std::env::var("ENGRAM_BENCH_QUERIES")
        .map(|s| s.parse().expect("ENGRAM_BENCH_QUERIES: a count"))
        .unwrap_or(500);

    let mut rows = Vec::new();
    for &n in &sizes {
        rows.push(run(n, queries));
    }
    println!();
    println!(
        "{:>8} {:>9} {:>9} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>11}",
        "chunks",
        "bm25 add",
        "hnsw add",
        "reopen",
        "bm25 p50",
        "vec p50",
        "hyb p50",
        "hyb p99",
        "vec10 p50",
        "recall@10",
        "recall@10*"
    );
    for r in rows {
        println!(
            "{:>8} {:>8.1}s {:>8.1}s {:>6.0}ms {:>7.2}ms {:>7.2}ms {:>7.2}ms {:>7.2}ms {:>7.2}ms {:>10.4} {:>11.4}",
            r.n,
            r.bm25_build.as_secs_f64(),
            r.vector_build.as_secs_f64(),
            ms(r.reopen),
            ms(r.bm25_p50),
            ms(r.vector_p50),
            ms(r.hybrid_p50),
            ms(r.hybrid_p99),
            ms(r.vector10_p50),
            r.recall_k10,
            r.recall_k100,
        );
    }
    println!();
    println!("bm25/hnsw add: indexing and commit; reopen: VectorIndex::open_or_create from disk.");
    println!("bm25, vec, hyb: top {CANDIDATES} per side (+ RRF to {K}); vec10: vector search with k = {K}.");
    println!("recall@10: search(k = 10) vs exact; recall@10*: top 10 of search(k = {CANDIDATES}) vs exact.");
}

struct Row {
    n: usize,
    bm25_build: Duration,
    vector_build: Duration,
    reopen: Duration,
    bm25_p50: Duration,
    vector_p50: Duration,
    hybrid_p50: Duration,
    hybrid_p99: Duration,
    vector10_p50: Duration,
    recall_k10: f64,
    recall_k100: f64,
}

fn run(n: usize, queries: usize) -> Row {
    eprintln!("== {n} chunks");
    let dir = tempfile::tempdir().expect("temp dir");
    let mut rng = StdRng::seed_from_u64(n as u64);
    let words = vocabulary(&mut rng);
    let zipf = Zipf::new(VOCABULARY, ZIPF_EXPONENT);

    let texts: Vec<String> = (0..n)
        .map(|_| {
            let mut text = String::with_capacity(WORDS_PER_CHUNK * 8);
            for i in 0..WORDS_PER_CHUNK {
                if i > 0 {
                    text.push(' ');
                }
                text.push_str(&words[zipf.sample(&mut rng)]);
            }
            text
        })
        .collect();
    let centres: Vec<Vec<f32>> = (0..CLUSTERS)
        .map(|_| unit(gaussian(&mut rng, DIM)))
        .collect();
    let vectors: Vec<Vec<f32>> = (0..n).map(|_| clustered(&mut rng, &centres)).collect();

    let t = Instant::now();
    let mut bm25 = Bm25Index::open_or_create(&dir.path().join("bm25")).expect("bm25 open");
    let chunks: Vec<ChunkDoc> = texts
        .iter()
        .enumerate()
        .map(|(i, text)| ChunkDoc {
            chunk_id: i as u64,
            doc_id: i as u64 / CHUNKS_PER_DOC,
            text,
        })
        .collect();
    for batch in chunks.chunks(10_000) {
        bm25.add(batch).expect("bm25 add");
    }
    bm25.commit(1).expect("bm25 commit");
    let bm25_build = t.elapsed();
    eprintln!("bm25 built in {bm25_build:.1?}");

    let vector_dir = dir.path().join("vectors");
    let t = Instant::now();
    let mut index = VectorIndex::open_or_create(&vector_dir, DIM, "synthetic").expect("open");
    let items: Vec<(u64, u64, &[f32])> = vectors
        .iter()
        .enumerate()
        .map(|(i, v)| (i as u64, i as u64 / CHUNKS_PER_DOC, &v[..]))
        .collect();
    for batch in items.chunks(10_000) {
        index.add(batch).expect("vector add");
    }
    index.commit(1).expect("vector commit");
    let vector_build = t.elapsed();
    eprintln!("hnsw built in {vector_build:.1?}");
    drop(index);
    let t = Instant::now();
    let index = VectorIndex::open_or_create(&vector_dir, DIM, "synthetic").expect("reopen");
    let reopen = t.elapsed();
    assert!(!index.graph_recovered());

    // Queries: 2-5 words from the middle of the frequency range, and fresh clustered vectors.
    let text_queries: Vec<String> = (0..queries)
        .map(|_| {
            let len = rng.gen_range(2..=5);
            (0..len)
                .map(|_| words[rng.gen_range(50..5_000)].as_str())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    let vector_queries: Vec<Vec<f32>> = (0..queries)
        .map(|_| clustered(&mut rng, &centres))
        .collect();

    // Warm up caches and page in the mmapped tantivy files.
    for (q, v) in text_queries.iter().zip(&vector_queries).take(20) {
        bm25.search(q, CANDIDATES, None).expect("bm25 search");
        index.search(v, CANDIDATES, None).expect("vector search");
    }

    let (mut bm25_t, mut vector_t, mut hybrid_t, mut vector10_t) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut found10, mut found100) = (0usize, 0usize);
    for (q, v) in text_queries.iter().zip(&vector_queries) {
        let t0 = Instant::now();
        let lexical = bm25.search(q, CANDIDATES, None).expect("bm25 search");
        let t1 = Instant::now();
        let dense = index.search(v, CANDIDATES, None).expect("vector search");
        let t2 = Instant::now();
        let mut fused = fuse(&lexical, &dense, Fusion::default());
        fused.truncate(K);
        let t3 = Instant::now();
        std::hint::black_box(&fused);
        bm25_t.push(t1 - t0);
        vector_t.push(t2 - t1);
        hybrid_t.push(t3 - t0);

        let t = Instant::now();
        let top10 = index.search(v, K, None).expect("vector search");
        vector10_t.push(t.elapsed());

        let exact: HashSet<u64> = index
            .exact_search(v, K, None)
            .expect("exact search")
            .iter()
            .map(|h| h.chunk_id)
            .collect();
        found10 += top10.iter().filter(|h| exact.contains(&h.chunk_id)).count();
        found100 += dense[..K]
            .iter()
            .filter(|h| exact.contains(&h.chunk_id))
            .count();
    }
    let total = (queries * K) as f64;
    let row = Row {
        n,
        bm25_build,
        vector_build,
        reopen,
        bm25_p50: percentile(&mut bm25_t, 0.5),
        vector_p50: percentile(&mut vector_t, 0.5),
        hybrid_p50: percentile(&mut hybrid_t, 0.5),
        hybrid_p99: percentile(&mut hybrid_t, 0.99),
        vector10_p50: percentile(&mut vector10_t, 0.5),
        recall_k10: found10 as f64 / total,
        recall_k100: found100 as f64 / total,
    };
    eprintln!("done: recall@10 {:.4}", row.recall_k10);
    row
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    let i = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[i]
}

/// Pronounceable made-up words, distinct, 2-4 syllables.
fn vocabulary(rng: &mut StdRng) -> Vec<String> {
    const ONSETS: &[&str] = &[
        "b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "st", "tr",
        "pl",
    ];
    const VOWELS: &[&str] = &["a", "e", "i", "o", "u", "ai", "ou"];
    let mut seen = HashSet::new();
    let mut words = Vec::with_capacity(VOCABULARY);
    while words.len() < VOCABULARY {
        let syllables = rng.gen_range(2..=4);
        let word: String = (0..syllables)
            .map(|_| {
                format!(
                    "{}{}",
                    ONSETS[rng.gen_range(0..ONSETS.len())],
                    VOWELS[rng.gen_range(0..VOWELS.len())]
                )
            })
            .collect();
        if seen.insert(word.clone()) {
            words.push(word);
        }
    }
    words
}

/// Zipf over ranks 0..n by inverse-CDF lookup.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: usize, s: f64) -> Zipf {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (1..=n)
            .map(|r| {
                acc += 1.0 / (r as f64).powf(s);
                acc
            })
            .collect();
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf }
    }

    fn sample(&self, rng: &mut StdRng) -> usize {
        let u: f64 = rng.gen();
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1)
    }
}

fn gaussian(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            // Box-Muller.
            let u1: f64 = rng.gen_range(f64::EPSILON..1.0);
            let u2: f64 = rng.gen();
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
        })
        .collect()
}

fn unit(mut v: Vec<f32>) -> Vec<f32> {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.iter_mut().for_each(|x| *x /= norm);
    v
}

fn clustered(rng: &mut StdRng, centres: &[Vec<f32>]) -> Vec<f32> {
    let centre = &centres[rng.gen_range(0..centres.len())];
    let noise = unit(gaussian(rng, DIM));
    unit(
        centre
            .iter()
            .zip(&noise)
            .map(|(c, e)| c + NOISE * e)
            .collect(),
    )
}
