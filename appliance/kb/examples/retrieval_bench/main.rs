//! Retrieval at a million chunks: builds one collection's BM25 and HNSW indexes over a
//! synthetic corpus through the index code the product uses, reopens them as `engramd` does at
//! start, and times hybrid searches through [`engram_kb::rank`], the ranking half of
//! `KnowledgeBase::retrieve` (BM25 top 100 + HNSW top 100, min-max fusion 0.55 / 0.45, top 10).
//!
//! ```text
//! cargo run --release -p engram-kb --example retrieval_bench -- \
//!     --chunks 1000000 --queries 1000 --dir /tmp/retrieval-1m --threads 2
//! ```
//!
//! Flags: `--chunks N` (default 1,000,000), `--queries N` (1,000), `--dir DIR` (required; the
//! indexes stay there), `--threads N` (2: the HNSW build's rayon pool and the embedder),
//! `--seed N`, `--recall-queries N` (200), `--reuse` (skip the build when `DIR` holds one of
//! the same size, seed and generator; its build figures are read back), `--models DIR`
//! (all-MiniLM-L6-v2; default `$ENGRAM_MODELS_DIR` or `<workspace>/models`), `--data DIR`
//! (the shared retrieval-eval folder; default `$ENGRAM_SHARED_DIR/data/retrieval-eval`, with
//! `../shared` beside the workspace).
//!
//! Why an example of engram-kb and not an `engram` subcommand: it needs exactly the knowledge
//! base's view of a search (its defaults, [`engram_kb::rank`], the embedder's dense-signal
//! check) and the index crate's writers, all of them this crate's dependencies, and nothing of
//! the CLI; it stays out of the shipped binary, like `chunk_bench` here and `embed_bench` in
//! engram-embed; and its smoke test runs with this crate's tests.
//!
//! What is synthetic and what is real (`corpus.rs` has the details):
//!
//! - The chunks' texts and vectors are synthetic (embedding a million chunks with the real
//!   model would take about 20 hours on the 2-core machine): words with SciFact's frequencies,
//!   clustered 384-d unit vectors that share topics with the texts. Queries aim at existing
//!   chunks: words of a target chunk, a vector near it.
//! - The query embedding is real: the "with embedding" pass runs all-MiniLM-L6-v2 on SciFact's
//!   real queries (the dense-signal tokenization and `embed_one`, as `retrieve` does), then
//!   the same search, and times the two together.
//! - Not timed: the catalog reads after ranking (`KnowledgeBase::search` fetches the 10 hits'
//!   text and document from sled and computes highlights); the product applies no document
//!   filter unless the caller asks for metadata, so the searches here have none.
//!
//! Build: chunks go to each index [`INDEX_STEP`] at a time, as `index_step` adds them, with
//! one commit after all but the last [`COMMIT_EVERY`] chunks (as a rebuild from the catalog
//! commits once) and one more after those: the second is what each commit of live ingestion
//! costs at that size (the vector index rewrites its data file and graph at every commit).
//! BM25 is written first, then the vectors, so that each index's time is its own. Then the
//! benchmark starts itself again with `--reuse`: reopening, RSS and queries are measured in a
//! fresh process, as when engramd starts (the build's freed heap stays in its own process).
//!
//! Output: a table, then one line
//! `RETRIEVAL1M chunks=.. build_s=.. reopen_s=.. p50_ms=.. p99_ms=.. p99_with_embed_ms=..
//! recall10=.. disk_bytes_per_chunk=.. rss_mib=..` (and more fields; see [`Report::line`]).

mod corpus;

use std::collections::HashSet;
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use engram_embed::Embedder;
use engram_index::{fuse, Bm25Index, ChunkDoc, Fusion, Hit, VectorIndex};
use engram_kb::{
    blind_pieces, rank, Models, SearchRequest, TokenCounter, COMMIT_EVERY, DEFAULT_CANDIDATES,
    DEFAULT_DENSE_WEIGHT, INDEX_STEP,
};

use corpus::{Corpus, DIM};

type Error = Box<dyn std::error::Error>;

/// The vector index's model id: the vectors are not all-MiniLM-L6-v2's.
const MODEL_ID: &str = "synthetic-384";
/// The build's figures, kept beside the indexes for `--reuse`.
const BUILD_FILE: &str = "retrieval-bench.json";
/// Queries run before timing (their own stream): they page in the index files and fill caches.
const WARMUP_QUERIES: u64 = 50;

#[derive(Clone, Debug)]
struct Args {
    chunks: u64,
    queries: u64,
    dir: PathBuf,
    threads: usize,
    seed: u64,
    recall_queries: u64,
    reuse: bool,
    models: PathBuf,
    data: PathBuf,
}

impl Args {
    fn parse(mut it: impl Iterator<Item = String>) -> Result<Args, Error> {
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let shared = std::env::var_os("ENGRAM_SHARED_DIR")
            .map_or_else(|| workspace.join("../shared"), PathBuf::from);
        let models = std::env::var_os("ENGRAM_MODELS_DIR")
            .map_or_else(|| workspace.join("models"), PathBuf::from);
        let mut a = Args {
            chunks: 1_000_000,
            queries: 1000,
            dir: PathBuf::new(),
            threads: 2,
            seed: 1,
            recall_queries: 200,
            reuse: false,
            models: models.join("all-MiniLM-L6-v2"),
            data: shared.join("data/retrieval-eval"),
        };
        while let Some(flag) = it.next() {
            let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
            match flag.as_str() {
                "--chunks" => a.chunks = value()?.parse()?,
                "--queries" => a.queries = value()?.parse()?,
                "--dir" => a.dir = value()?.into(),
                "--threads" => a.threads = value()?.parse()?,
                "--seed" => a.seed = value()?.parse()?,
                "--recall-queries" => a.recall_queries = value()?.parse()?,
                "--models" => a.models = value()?.into(),
                "--data" => a.data = value()?.into(),
                "--reuse" => a.reuse = true,
                _ => return Err(format!("unknown flag {flag} (see the example's docs)").into()),
            }
        }
        if a.dir.as_os_str().is_empty() {
            return Err("--dir DIR is required: the indexes are written there".into());
        }
        if a.chunks == 0 || a.queries == 0 || a.threads == 0 {
            return Err("--chunks, --queries and --threads must be above 0".into());
        }
        Ok(a)
    }
}

fn main() -> Result<(), Error> {
    let args = Args::parse(std::env::args().skip(1))?;
    // hnsw_rs inserts on rayon's global pool; size it before its first use.
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", args.threads.to_string());
    }
    eprintln!(
        "retrieval_bench: {} chunks, {} queries, {} threads, seed {}, cpu {}, load {}",
        args.chunks,
        args.queries,
        args.threads,
        args.seed,
        cpu_model(),
        load_average()
    );
    let corpus = Corpus::new(&args.data, args.chunks, args.seed)?;
    let build = prepare(&args, &corpus)?;
    if !build.reused {
        // Measure in a fresh process, as engramd opens the indexes at start: the build's
        // freed memory would otherwise stay in this one's RSS.
        eprintln!("built; reopening in a fresh process");
        let status = std::process::Command::new(std::env::current_exe()?)
            .args(std::env::args().skip(1))
            .arg("--reuse")
            .status()?;
        std::process::exit(status.code().unwrap_or(1));
    }
    let report = measure(&args, &corpus, build)?;
    report.print_table();
    eprintln!("load average at the end: {}", load_average());
    println!("{}", report.line());
    Ok(())
}

/// What building the indexes took (kept in [`BUILD_FILE`]).
#[derive(Clone, Debug, Default)]
struct Build {
    chunks: u64,
    seed: u64,
    generator: u32,
    /// Making the synthetic chunks (not part of any index figure).
    generate_s: f64,
    bm25_add_s: f64,
    hnsw_add_s: f64,
    /// The commit after all but the last `COMMIT_EVERY` chunks.
    bulk_commit_bm25_s: f64,
    bulk_commit_vectors_s: f64,
    /// The commit of the last `COMMIT_EVERY` chunks (0 when the collection is smaller).
    last_commit_chunks: u64,
    last_commit_bm25_s: f64,
    last_commit_vectors_s: f64,
    /// Waiting for the segment merges the commits started.
    bm25_merge_s: f64,
    peak_rss_mib: f64,
    reused: bool,
}

impl Build {
    fn bm25_s(&self) -> f64 {
        self.bm25_add_s + self.bulk_commit_bm25_s + self.last_commit_bm25_s
    }

    fn hnsw_s(&self) -> f64 {
        self.hnsw_add_s + self.bulk_commit_vectors_s + self.last_commit_vectors_s
    }

    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "chunks": self.chunks, "seed": self.seed, "generator": self.generator,
            "generate_s": self.generate_s, "bm25_add_s": self.bm25_add_s,
            "hnsw_add_s": self.hnsw_add_s, "bulk_commit_bm25_s": self.bulk_commit_bm25_s,
            "bulk_commit_vectors_s": self.bulk_commit_vectors_s,
            "last_commit_chunks": self.last_commit_chunks,
            "last_commit_bm25_s": self.last_commit_bm25_s,
            "last_commit_vectors_s": self.last_commit_vectors_s,
            "bm25_merge_s": self.bm25_merge_s,
            "peak_rss_mib": self.peak_rss_mib,
        })
    }

    fn from_json(v: &serde_json::Value) -> Option<Build> {
        let f = |k: &str| v[k].as_f64();
        let u = |k: &str| v[k].as_u64();
        Some(Build {
            chunks: u("chunks")?,
            seed: u("seed")?,
            generator: u("generator")? as u32,
            generate_s: f("generate_s")?,
            bm25_add_s: f("bm25_add_s")?,
            hnsw_add_s: f("hnsw_add_s")?,
            bulk_commit_bm25_s: f("bulk_commit_bm25_s")?,
            bulk_commit_vectors_s: f("bulk_commit_vectors_s")?,
            last_commit_chunks: u("last_commit_chunks")?,
            last_commit_bm25_s: f("last_commit_bm25_s")?,
            last_commit_vectors_s: f("last_commit_vectors_s")?,
            bm25_merge_s: f("bm25_merge_s")?,
            peak_rss_mib: f("peak_rss_mib")?,
            reused: true,
        })
    }
}

/// Latency percentiles of one pass, in milliseconds.
#[derive(Clone, Copy, Debug, Default)]
struct Latency {
    p50: f64,
    p99: f64,
    max: f64,
}

impl Latency {
    fn of(samples: &mut [Duration]) -> Latency {
        samples.sort();
        let at = |p: f64| {
            let i = ((samples.len() as f64 - 1.0) * p).round() as usize;
            samples[i].as_secs_f64() * 1e3
        };
        Latency {
            p50: at(0.5),
            p99: at(0.99),
            max: at(1.0),
        }
    }
}

#[derive(Clone, Debug, Default)]
struct Report {
    chunks: u64,
    threads: usize,
    topics: usize,
    build: Build,
    bm25_bytes: u64,
    vector_bytes: u64,
    bm25_segments: usize,
    reopen_bm25_s: f64,
    reopen_vectors_s: f64,
    /// RSS with the BM25 index open, before the vectors.
    rss_after_bm25_mib: f64,
    rss_after_reopen_mib: f64,
    peak_rss_reopen_mib: f64,
    peak_rss_queries_mib: f64,
    /// The first Chinese query after the reopen (jieba loads its dictionary).
    first_chinese_ms: f64,
    queries: u64,
    /// Queries that got at least one hit.
    answered: u64,
    /// Queries whose target chunk is in the top 10.
    target_top10: u64,
    hybrid: Latency,
    bm25: Latency,
    dense: Latency,
    fuse: Latency,
    embed: Latency,
    with_embed: Latency,
    /// Top 10 of the HNSW candidates (k = 100, as a search asks) against the exact top 10.
    recall10: f64,
    /// The 100 HNSW candidates against the exact top 100.
    recall100: f64,
    /// A k = 10 HNSW search against the exact top 10.
    recall10_k10: f64,
    /// Of the recall queries, those whose BM25 top 100 is tantivy's unpruned top 100.
    bm25_agree: u64,
    /// ... and those whose fused top 10 is the same as with the unpruned BM25 list.
    fused_agree: u64,
    recall_queries: u64,
    /// Mean cosine of the exact 1st, 10th and 100th neighbour of those queries: how far the
    /// answers stand out from the crowd (the closer, the harder for the graph).
    exact_cosine: [f64; 3],
}

impl Report {
    fn disk_per_chunk(&self) -> f64 {
        (self.bm25_bytes + self.vector_bytes) as f64 / self.chunks as f64
    }

    fn reopen_s(&self) -> f64 {
        self.reopen_bm25_s + self.reopen_vectors_s
    }

    fn print_table(&self) {
        let b = &self.build;
        let n = self.chunks as f64;
        println!();
        println!(
            "retrieval at {} chunks ({} topics), {} threads{}",
            self.chunks,
            self.topics,
            self.threads,
            if b.reused {
                " (build figures from the run that built the indexes)"
            } else {
                ""
            }
        );
        println!("build");
        println!(
            "  synthetic chunks made        {:>9.1} s (not counted)",
            b.generate_s
        );
        println!(
            "  BM25 add / bulk commit       {:>9.1} s / {:.1} s",
            b.bm25_add_s, b.bulk_commit_bm25_s
        );
        println!(
            "  HNSW add / bulk commit       {:>9.1} s / {:.1} s",
            b.hnsw_add_s, b.bulk_commit_vectors_s
        );
        println!(
            "  commit of the last {:>5}     {:>9.2} s BM25, {:.2} s vectors",
            b.last_commit_chunks, b.last_commit_bm25_s, b.last_commit_vectors_s
        );
        println!(
            "  BM25 merges after the commits {:>8.1} s (not counted)",
            b.bm25_merge_s
        );
        println!("  peak RSS while building      {:>9.0} MiB", b.peak_rss_mib);
        println!("disk");
        println!(
            "  BM25                         {:>9.1} MiB  {:>6.0} B/chunk  ({} segments)",
            mib(self.bm25_bytes),
            self.bm25_bytes as f64 / n,
            self.bm25_segments
        );
        println!(
            "  vectors (data + graph)       {:>9.1} MiB  {:>6.0} B/chunk",
            mib(self.vector_bytes),
            self.vector_bytes as f64 / n
        );
        println!(
            "  total                        {:>9.1} MiB  {:>6.0} B/chunk",
            mib(self.bm25_bytes + self.vector_bytes),
            self.disk_per_chunk()
        );
        println!("reopen (as engramd opens a collection)");
        println!(
            "  BM25 / vectors               {:>9.2} s / {:.2} s",
            self.reopen_bm25_s, self.reopen_vectors_s
        );
        println!(
            "  RSS after reopen             {:>9.0} MiB (BM25 alone {:.0} MiB, peak while \
             reopening {:.0} MiB)",
            self.rss_after_reopen_mib, self.rss_after_bm25_mib, self.peak_rss_reopen_mib
        );
        println!(
            "queries: {} ({} answered, target chunk in the top 10 for {:.1} %)",
            self.queries,
            self.answered,
            100.0 * self.target_top10 as f64 / self.queries as f64
        );
        println!("  {:<34} {:>8} {:>8} {:>8}", "ms", "p50", "p99", "max");
        for (name, l) in [
            ("hybrid search (no embedding)", self.hybrid),
            ("  BM25 top 100", self.bm25),
            ("  HNSW top 100", self.dense),
            ("  fusion", self.fuse),
            ("query embedding (real, SciFact)", self.embed),
            ("hybrid search with embedding", self.with_embed),
        ] {
            println!(
                "  {:<34} {:>8.2} {:>8.2} {:>8.2}",
                name, l.p50, l.p99, l.max
            );
        }
        println!(
            "  peak RSS from reopen to the last query {:.0} MiB (embedder included)",
            self.peak_rss_queries_mib
        );
        println!(
            "  the first Chinese query after the reopen (not counted above: jieba loads its \
             dictionary) {:.1} ms",
            self.first_chinese_ms
        );
        println!(
            "dense recall against exact search ({} queries): top 10 of the 100 candidates {:.4}, \
             100 candidates {:.4}, k = 10 search {:.4}",
            self.recall_queries, self.recall10, self.recall100, self.recall10_k10
        );
        println!(
            "  mean cosine of the exact 1st / 10th / 100th neighbour: {:.3} / {:.3} / {:.3}",
            self.exact_cosine[0], self.exact_cosine[1], self.exact_cosine[2]
        );
        println!(
            "BM25 top 100 the same as tantivy's unpruned search for {} of {} queries, the fused \
             top 10 for {}",
            self.bm25_agree, self.recall_queries, self.fused_agree
        );
    }

    /// The machine-readable summary line.
    fn line(&self) -> String {
        let b = &self.build;
        format!(
            "RETRIEVAL1M chunks={} threads={} build_s={:.1} bm25_build_s={:.1} hnsw_build_s={:.1} \
             commit_s={:.2} reopen_s={:.2} p50_ms={:.2} p99_ms={:.2} max_ms={:.2} \
             p50_with_embed_ms={:.2} p99_with_embed_ms={:.2} embed_p50_ms={:.2} recall10={:.4} \
             recall100={:.4} target10={:.3} bm25_agree={:.3} fused_agree={:.3} \
             disk_bytes_per_chunk={:.0} \
             bm25_bytes_per_chunk={:.0} vector_bytes_per_chunk={:.0} rss_mib={:.0} \
             peak_rss_mib={:.0} build_peak_rss_mib={:.0}",
            self.chunks,
            self.threads,
            b.bm25_s() + b.hnsw_s(),
            b.bm25_s(),
            b.hnsw_s(),
            b.last_commit_bm25_s + b.last_commit_vectors_s,
            self.reopen_s(),
            self.hybrid.p50,
            self.hybrid.p99,
            self.hybrid.max,
            self.with_embed.p50,
            self.with_embed.p99,
            self.embed.p50,
            self.recall10,
            self.recall100,
            self.target_top10 as f64 / self.queries as f64,
            self.bm25_agree as f64 / self.recall_queries.max(1) as f64,
            self.fused_agree as f64 / self.recall_queries.max(1) as f64,
            self.disk_per_chunk(),
            self.bm25_bytes as f64 / self.chunks as f64,
            self.vector_bytes as f64 / self.chunks as f64,
            self.rss_after_reopen_mib,
            self.peak_rss_queries_mib,
            b.peak_rss_mib,
        )
    }
}

/// Builds the indexes in `args.dir`, or finds them there (`--reuse`).
fn prepare(args: &Args, corpus: &Corpus) -> Result<Build, Error> {
    std::fs::create_dir_all(&args.dir)?;
    let bm25_dir = args.dir.join("bm25");
    let vector_dir = args.dir.join("vectors");

    let reusable = args
        .reuse
        .then(|| std::fs::read(args.dir.join(BUILD_FILE)).ok())
        .flatten()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .and_then(|v| Build::from_json(&v))
        .filter(|b| {
            b.chunks == args.chunks
                && b.seed == args.seed
                && b.generator == corpus::GENERATOR_VERSION
        });
    Ok(match reusable {
        Some(b) => {
            eprintln!("reusing the indexes in {}", args.dir.display());
            b
        }
        None => {
            let _ = std::fs::remove_file(args.dir.join(BUILD_FILE));
            for d in [&bm25_dir, &vector_dir] {
                if d.exists() {
                    std::fs::remove_dir_all(d)?;
                }
            }
            let b = build(corpus, &bm25_dir, &vector_dir)?;
            std::fs::write(
                args.dir.join(BUILD_FILE),
                serde_json::to_vec_pretty(&b.to_json())?,
            )?;
            b
        }
    })
}

/// Reopens the indexes `prepare` left and measures them.
fn measure(args: &Args, corpus: &Corpus, build: Build) -> Result<Report, Error> {
    let bm25_dir = args.dir.join("bm25");
    let vector_dir = args.dir.join("vectors");
    let mut r = Report {
        chunks: args.chunks,
        threads: args.threads,
        topics: corpus.topics(),
        bm25_bytes: dir_bytes(&bm25_dir),
        vector_bytes: dir_bytes(&vector_dir),
        bm25_segments: count_ext(&bm25_dir, "term"),
        build,
        ..Report::default()
    };

    // Reopen as `KnowledgeBase::open` opens a collection's indexes, with the peak RSS counted
    // from here (writing 5 to clear_refs resets VmHWM to the current RSS).
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let t = Instant::now();
    let bm25 = Bm25Index::open_or_create(&bm25_dir)?;
    r.reopen_bm25_s = t.elapsed().as_secs_f64();
    r.rss_after_bm25_mib = rss_mib().0;
    let t = Instant::now();
    let vectors = VectorIndex::open_or_create(&vector_dir, DIM, MODEL_ID)?;
    r.reopen_vectors_s = t.elapsed().as_secs_f64();
    let (rss, hwm) = rss_mib();
    r.rss_after_reopen_mib = rss;
    r.peak_rss_reopen_mib = hwm;
    if bm25.len() != args.chunks || vectors.len() != args.chunks {
        return Err(format!(
            "reopened indexes hold {} (BM25) and {} (vectors) chunks, not {}",
            bm25.len(),
            vectors.len(),
            args.chunks
        )
        .into());
    }
    if vectors.graph_recovered() {
        return Err("the HNSW graph did not reload: it was rebuilt from the vectors".into());
    }
    eprintln!(
        "reopened in {:.2} s (BM25 {:.2} s, vectors {:.2} s), RSS {:.0} MiB",
        r.reopen_s(),
        r.reopen_bm25_s,
        r.reopen_vectors_s,
        rss
    );

    let models = Models {
        embedder: Arc::new(Embedder::load(&args.models, args.threads)?),
        blind: Arc::new(blind_pieces(&args.models)?),
        tokens: Arc::new(Words),
    };
    let real = corpus::real_queries(&args.data)?;
    let queries: Vec<corpus::Query> = (0..args.queries).map(|i| corpus.query(0, i)).collect();
    // The dense weight `retrieve` would give each query (Chinese ones: none, BM25 alone).
    let requests: Vec<(SearchRequest, f32)> = queries
        .iter()
        .map(|q| {
            let signal = models.dense_signal(&q.text)?;
            Ok((
                SearchRequest::new("bench", q.text.clone()),
                DEFAULT_DENSE_WEIGHT * signal.scale,
            ))
        })
        .collect::<Result<_, Error>>()?;
    // Warm-up, on queries of their own, Chinese first: its first query after start loads
    // jieba's dictionary, a one-off that is reported apart.
    let first_chinese = (WARMUP_QUERIES..)
        .map(|i| corpus.query(1, i))
        .find(|q| Corpus::is_chinese(q.target))
        .expect("one query in 40 is Chinese");
    for (i, q) in std::iter::once(first_chinese)
        .chain((0..WARMUP_QUERIES).map(|i| corpus.query(1, i)))
        .enumerate()
    {
        let dw = DEFAULT_DENSE_WEIGHT * models.dense_signal(&q.text)?.scale;
        let req = SearchRequest::new("bench", q.text);
        let t = Instant::now();
        black_box(rank(&bm25, &vectors, &req, Some(&q.vector), dw, None)?);
        if i == 0 {
            r.first_chinese_ms = t.elapsed().as_secs_f64() * 1e3;
        }
    }

    // The searches as a query runs them, its vector given.
    let mut times = Vec::with_capacity(queries.len());
    for (q, (req, dw)) in queries.iter().zip(&requests) {
        let t = Instant::now();
        let hits = rank(&bm25, &vectors, req, Some(&q.vector), *dw, None)?;
        times.push(t.elapsed());
        r.answered += u64::from(!hits.is_empty());
        r.target_top10 += u64::from(hits.iter().any(|h| h.chunk_id == q.target));
    }
    r.queries = queries.len() as u64;
    r.hybrid = Latency::of(&mut times);

    // Where the time goes: each side alone, then the fusion of their lists.
    let (mut lexical_t, mut dense_t, mut fuse_t) = (Vec::new(), Vec::new(), Vec::new());
    for (q, (req, dw)) in queries.iter().zip(&requests) {
        let t = Instant::now();
        let lexical = bm25.search(&req.query, DEFAULT_CANDIDATES, None)?;
        lexical_t.push(t.elapsed());
        let t = Instant::now();
        let dense = vectors.search(&q.vector, DEFAULT_CANDIDATES, None)?;
        dense_t.push(t.elapsed());
        let t = Instant::now();
        black_box(fuse(
            &lexical,
            &dense,
            Fusion {
                mode: req.fusion,
                bm25_weight: req.bm25_weight,
                dense_weight: *dw,
            },
        ));
        fuse_t.push(t.elapsed());
    }
    r.bm25 = Latency::of(&mut lexical_t);
    r.dense = Latency::of(&mut dense_t);
    r.fuse = Latency::of(&mut fuse_t);

    // With the query's embedding: a real question through the dense-signal check and the
    // embedder, then the same search (the synthetic vector stands in for the real one, which
    // lives in another space than the synthetic chunks).
    let (mut embed_t, mut total_t) = (Vec::new(), Vec::new());
    for (i, (q, (req, dw))) in queries.iter().zip(&requests).enumerate() {
        let text = &real[i % real.len()];
        let t = Instant::now();
        let signal = models.dense_signal(text)?;
        if signal.scale > 0.0 {
            black_box(models.embedder.embed_one(text)?);
        }
        embed_t.push(t.elapsed());
        black_box(rank(&bm25, &vectors, req, Some(&q.vector), *dw, None)?);
        total_t.push(t.elapsed());
    }
    r.embed = Latency::of(&mut embed_t);
    r.with_embed = Latency::of(&mut total_t);

    // Dense recall against brute force, and BM25 against tantivy's unpruned top k (the
    // filtered search with every document allowed), on the first queries.
    r.recall_queries = args.recall_queries.min(args.queries);
    let every_doc: HashSet<u64> = (0..args.chunks.div_ceil(corpus::CHUNKS_PER_DOC)).collect();
    let (mut found10, mut found100, mut found_k10) = (0usize, 0usize, 0usize);
    let (mut want10, mut want100) = (0usize, 0usize);
    for (q, (req, dw)) in queries
        .iter()
        .zip(&requests)
        .take(r.recall_queries as usize)
    {
        let fast = bm25.search(&q.text, DEFAULT_CANDIDATES, None)?;
        let plain = bm25.search(&q.text, DEFAULT_CANDIDATES, Some(&every_doc))?;
        r.bm25_agree += u64::from(same_top(&fast, &plain));
        let fused = rank(&bm25, &vectors, req, Some(&q.vector), *dw, None)?;
        let dense = vectors.search(&q.vector, DEFAULT_CANDIDATES, None)?;
        let fusion = Fusion {
            mode: req.fusion,
            bm25_weight: req.bm25_weight,
            dense_weight: *dw,
        };
        let mut unpruned = fuse(&plain, if *dw > 0.0 { &dense } else { &[] }, fusion);
        unpruned.truncate(req.k);
        let ids =
            |hits: &[engram_index::Fused]| hits.iter().map(|h| h.chunk_id).collect::<Vec<_>>();
        r.fused_agree += u64::from(ids(&fused) == ids(&unpruned));
        let exact = vectors.exact_search(&q.vector, DEFAULT_CANDIDATES, None)?;
        let exact10: HashSet<u64> = exact.iter().take(10).map(|h| h.chunk_id).collect();
        let exact100: HashSet<u64> = exact.iter().map(|h| h.chunk_id).collect();
        let served = vectors.search(&q.vector, DEFAULT_CANDIDATES, None)?;
        found10 += served
            .iter()
            .take(10)
            .filter(|h| exact10.contains(&h.chunk_id))
            .count();
        found100 += served
            .iter()
            .filter(|h| exact100.contains(&h.chunk_id))
            .count();
        found_k10 += vectors
            .search(&q.vector, 10, None)?
            .iter()
            .filter(|h| exact10.contains(&h.chunk_id))
            .count();
        want10 += exact10.len();
        want100 += exact100.len();
        for (sum, rank) in r.exact_cosine.iter_mut().zip([1, 10, 100]) {
            *sum += exact.get(rank - 1).map_or(0.0, |h| h.score as f64);
        }
    }
    let sampled = r.recall_queries.max(1) as f64;
    r.exact_cosine.iter_mut().for_each(|c| *c /= sampled);
    r.recall10 = found10 as f64 / want10.max(1) as f64;
    r.recall100 = found100 as f64 / want100.max(1) as f64;
    r.recall10_k10 = found_k10 as f64 / want10.max(1) as f64;
    r.peak_rss_queries_mib = rss_mib().1;
    Ok(r)
}

/// Writes the collection to fresh indexes in `bm25_dir` and `vector_dir`, one after the other
/// so that each one's time is its own (ingestion interleaves them, 256 chunks at a time, and
/// tantivy indexes on a thread of its own).
fn build(corpus: &Corpus, bm25_dir: &Path, vector_dir: &Path) -> Result<Build, Error> {
    let n = corpus.chunks;
    let mut b = Build {
        chunks: n,
        seed: corpus.seed(),
        generator: corpus::GENERATOR_VERSION,
        ..Build::default()
    };
    // The last COMMIT_EVERY chunks get a commit of their own, when there are more than that.
    let split = if n > 2 * COMMIT_EVERY as u64 {
        n - COMMIT_EVERY as u64
    } else {
        n
    };
    let ranges = [(0..split, 1), (split..n, 2)];

    eprintln!("BM25:");
    let mut bm25 = Bm25Index::open_or_create(bm25_dir)?;
    let mut progress = Progress::new(n);
    for (range, seq) in ranges.clone() {
        if range.is_empty() {
            continue;
        }
        for start in range.clone().step_by(INDEX_STEP) {
            let end = (start + INDEX_STEP as u64).min(range.end);
            let t = Instant::now();
            let texts: Vec<String> = (start..end).map(|i| corpus.text(i)).collect();
            b.generate_s += t.elapsed().as_secs_f64();
            let t = Instant::now();
            let docs: Vec<ChunkDoc<'_>> = (start..end)
                .zip(&texts)
                .map(|(i, text)| ChunkDoc {
                    chunk_id: i,
                    doc_id: Corpus::doc(i),
                    text,
                })
                .collect();
            bm25.add(&docs)?;
            b.bm25_add_s += t.elapsed().as_secs_f64();
            progress.at(end, b.generate_s);
        }
        let t = Instant::now();
        bm25.commit(seq)?;
        let s = t.elapsed().as_secs_f64();
        if seq == 1 {
            b.bulk_commit_bm25_s = s;
        } else {
            b.last_commit_chunks = range.end - range.start;
            b.last_commit_bm25_s = s;
        }
        eprintln!("  commit {seq} at {} chunks: {s:.2} s", range.end);
    }
    // A daemon that runs on after ingestion lets tantivy finish the merges a commit starts.
    let t = Instant::now();
    bm25.close()?;
    b.bm25_merge_s = t.elapsed().as_secs_f64();
    eprintln!("  merges finished after {:.1} s more", b.bm25_merge_s);

    eprintln!("HNSW:");
    let mut vectors = VectorIndex::open_or_create(vector_dir, DIM, MODEL_ID)?;
    let mut progress = Progress::new(n);
    let generated_before = b.generate_s;
    for (range, seq) in ranges {
        if range.is_empty() {
            continue;
        }
        for start in range.clone().step_by(INDEX_STEP) {
            let end = (start + INDEX_STEP as u64).min(range.end);
            let t = Instant::now();
            let rows: Vec<Vec<f32>> = (start..end).map(|i| corpus.vector(i)).collect();
            b.generate_s += t.elapsed().as_secs_f64();
            let t = Instant::now();
            let items: Vec<(u64, u64, &[f32])> = (start..end)
                .zip(&rows)
                .map(|(i, v)| (i, Corpus::doc(i), &v[..]))
                .collect();
            vectors.add(&items)?;
            b.hnsw_add_s += t.elapsed().as_secs_f64();
            progress.at(end, b.generate_s - generated_before);
        }
        let t = Instant::now();
        vectors.commit(seq)?;
        let s = t.elapsed().as_secs_f64();
        if seq == 1 {
            b.bulk_commit_vectors_s = s;
        } else {
            b.last_commit_vectors_s = s;
        }
        eprintln!("  commit {seq} at {} chunks: {s:.2} s", range.end);
    }
    b.peak_rss_mib = rss_mib().1;
    Ok(b)
}

/// Progress lines every 5 % of a phase, with an estimate of what is left.
struct Progress {
    total: u64,
    started: Instant,
    next: f64,
}

impl Progress {
    fn new(total: u64) -> Progress {
        Progress {
            total,
            started: Instant::now(),
            next: 0.05,
        }
    }

    fn at(&mut self, done: u64, generating_s: f64) {
        let share = done as f64 / self.total as f64;
        if share < self.next {
            return;
        }
        self.next += 0.05;
        let elapsed = self.started.elapsed().as_secs_f64();
        eprintln!(
            "  {done:>9} chunks {elapsed:>7.0} s (making chunks {generating_s:.0} s), about \
             {:.0} s to go, RSS {:.0} MiB",
            elapsed / share - elapsed,
            rss_mib().0
        );
    }
}

/// Whether two BM25 lists hold the same scores and the same chunks above the last place
/// (where a tie may go either way).
fn same_top(a: &[Hit], b: &[Hit]) -> bool {
    let close = |x: f32, y: f32| (x - y).abs() <= 1e-4 * y.abs().max(1.0);
    let Some(last) = b.last().map(|h| h.score) else {
        return a.is_empty();
    };
    let above = |hits: &[Hit]| -> HashSet<u64> {
        hits.iter()
            .filter(|h| h.score > last && !close(h.score, last))
            .map(|h| h.chunk_id)
            .collect()
    };
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| close(x.score, y.score))
        && above(a) == above(b)
}

/// Chunk sizes do not matter here: the chunks are made already.
struct Words;

impl TokenCounter for Words {
    fn count(&self, text: &str) -> usize {
        text.split_whitespace().count()
    }
}

/// (VmRSS, VmHWM) of this process in MiB, 0 where /proc has none.
fn rss_mib() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

/// Bytes of the files in `dir` (not recursive: both indexes are flat).
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

fn count_ext(dir: &Path, ext: &str) -> usize {
    std::fs::read_dir(dir).map_or(0, |entries| {
        entries
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == ext))
            .count()
    })
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole benchmark at 2,000 chunks: every query answered, the target chunks found,
    /// the dense side close to exact search, the indexes reopened (and reused) intact. Sizes,
    /// not speed, are checked: a benchmark is never a timed test.
    #[test]
    fn small_run_is_sane() {
        let dir =
            std::env::temp_dir().join(format!("engram-retrieval-bench-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut args = Args::parse(
            [
                "--chunks",
                "2000",
                "--queries",
                "40",
                "--recall-queries",
                "40",
                "--dir",
            ]
            .iter()
            .map(|s| s.to_string())
            .chain([dir.display().to_string()]),
        )
        .unwrap();
        let corpus = Corpus::new(&args.data, args.chunks, args.seed).unwrap();
        let build = prepare(&args, &corpus).unwrap();
        let r = measure(&args, &corpus, build).unwrap();
        assert_eq!(r.queries, 40);
        assert_eq!(r.answered, 40);
        assert!(
            r.target_top10 >= 36,
            "targets in the top 10: {}",
            r.target_top10
        );
        assert!(r.recall10 >= 0.95, "recall@10 {}", r.recall10);
        assert!(r.recall100 >= 0.9, "recall@100 {}", r.recall100);
        assert_eq!(r.bm25_agree, 40, "BM25 top 100 against the unpruned search");
        assert_eq!(
            r.fused_agree, 40,
            "fused top 10 against the unpruned search"
        );
        assert!(!r.build.reused && r.build.last_commit_chunks == 0);
        // 2000 chunks of ~200 words and 384 floats: BM25 and two copies of the vectors.
        let per_chunk = r.disk_per_chunk();
        assert!(
            (3000.0..20_000.0).contains(&per_chunk),
            "{per_chunk} bytes per chunk"
        );
        assert!(r.line().starts_with("RETRIEVAL1M chunks=2000 "));

        args.reuse = true;
        args.queries = 10;
        let build = prepare(&args, &corpus).unwrap();
        let again = measure(&args, &corpus, build).unwrap();
        assert!(again.build.reused);
        assert_eq!(again.answered, 10);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn chunks_are_deterministic() {
        let data = Args::parse(["--dir", "x"].iter().map(|s| s.to_string()))
            .unwrap()
            .data;
        let a = Corpus::new(&data, 5000, 7).unwrap();
        for i in [0, 39, 4999] {
            assert_eq!(a.text(i), a.text(i));
            assert_eq!(a.vector(i), a.vector(i));
        }
        assert_ne!(a.text(1), a.text(2));
        assert!(Corpus::is_chinese(39));
        assert!(a.text(39).chars().any(|c| c >= '\u{4e00}'));
        let words = a.text(0).split_whitespace().count();
        assert!((150..=250).contains(&words), "{words} words");
        let q = a.query(0, 3);
        let t = a.vector(q.target);
        let cos: f32 = q.vector.iter().zip(&t).map(|(x, y)| x * y).sum();
        assert!((0.75..0.98).contains(&cos), "query to target cosine {cos}");
    }
}
