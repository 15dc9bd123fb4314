//! `engram eval retrieval`: nDCG@10 and Recall@100 of BM25, dense and hybrid search on a
//! BEIR-format folder, through the real ingest pipeline and search API.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use engram_kb::{NewDocument, SearchMode, SearchRequest};
use serde::Deserialize;

use crate::kb::{ChunkArgs, KbArgs, StageBars};

/// Rank cut-off of nDCG.
const NDCG_AT: usize = 10;
/// Rank cut-off of recall.
const RECALL_AT: usize = 100;
/// Chunks retrieved per query: a document scores as its best chunk, and with one to three
/// chunks per document 200 chunks give the 100 distinct documents recall needs.
const CHUNKS_RETRIEVED: usize = 200;
/// Neighbours compared for the HNSW recall figure.
const HNSW_RECALL_AT: usize = 10;

#[derive(Args)]
pub struct EvalArgs {
    #[command(subcommand)]
    command: EvalCommand,
}

#[derive(Subcommand)]
enum EvalCommand {
    /// nDCG@10 and Recall@100 of bm25, dense and hybrid search on a BEIR folder.
    Retrieval(RetrievalArgs),
    /// Fidelity and TTFT of fusion policies against full prefill (MuSiQue-shaped JSON).
    Fusion(crate::fusion_eval::FusionArgs),
    /// End-to-end QA (retrieve, prompt, fused prefill, greedy answer) scored against gold
    /// answers, optionally beside a peer server given the same passages.
    Qa(crate::qa_eval::QaArgs),
    /// Writes a mixed Chinese/English retrieval set (BEIR form) built from XQuAD's parallel
    /// paragraphs: English documents quoting Chinese sentences, with `zh` and `en` query splits.
    MixedSet(crate::mixed_set::MixedSetArgs),
    /// Writes held-out fusion questions (MuSiQue-shaped JSON for `eval fusion`) from a QA
    /// set: each gold paragraph among distractors of other articles, up to a token budget.
    FusionSet(crate::fusion_set::FusionSetArgs),
    /// How far two `eval fusion --json` runs agree, policy by policy: first token, answer F1
    /// and exact match between the runs (on `full`, the reference's own reproducibility), and,
    /// when both ran on the same data file, each run's gold F1 with the paired difference's
    /// 95 % interval (whether a change costs answers).
    FusionDiff(crate::fusion_eval::FusionDiffArgs),
}

#[derive(Args)]
struct RetrievalArgs {
    /// BEIR folder: corpus.jsonl, queries.jsonl, qrels/<split>.tsv.
    #[arg(long)]
    beir: PathBuf,
    /// The qrels split to evaluate.
    #[arg(long, default_value = "test")]
    split: String,
    /// Evaluate only the first N queries of the split.
    #[arg(long)]
    limit_queries: Option<usize>,
    /// Also print the HNSW index's recall@10 against exact search.
    #[arg(long)]
    hnsw_recall: bool,
    /// Print `{"bm25": {"ndcg@10": x, "recall@100": y}, "dense": ..., "hybrid": ...}`.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    chunking: ChunkArgs,
    /// Keep the knowledge base here (reused by later runs) instead of a temporary folder.
    #[command(flatten)]
    kb: KbArgs,
}

/// A BEIR corpus line (also the QA sets' paragraph files).
#[derive(Deserialize)]
pub struct CorpusDoc {
    #[serde(rename = "_id")]
    pub id: String,
    #[serde(default)]
    pub title: String,
    pub text: String,
}

#[derive(Deserialize)]
struct Query {
    #[serde(rename = "_id")]
    id: String,
    text: String,
}

pub fn read_jsonl<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Vec<T>> {
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        out.push(
            serde_json::from_str(&line)
                .with_context(|| format!("{}:{}: not a valid record", path.display(), i + 1))?,
        );
    }
    Ok(out)
}

/// `query id -> (doc id -> grade)`.
type Qrels = HashMap<String, HashMap<String, u32>>;

/// The qrels with grades above 0, and their query ids in file order of first appearance.
fn read_qrels(path: &Path) -> Result<(Vec<String>, Qrels)> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut order = Vec::new();
    let mut qrels = Qrels::new();
    for (i, line) in text.lines().enumerate().skip(1) {
        let cols: Vec<&str> = line.split('\t').collect();
        if line.trim().is_empty() {
            continue;
        }
        if cols.len() < 3 {
            bail!(
                "{}:{}: expected query-id, corpus-id, score",
                path.display(),
                i + 1
            );
        }
        let grade: i64 = cols[2]
            .trim()
            .parse()
            .with_context(|| format!("{}:{}: score is not an integer", path.display(), i + 1))?;
        if grade <= 0 {
            continue;
        }
        if !qrels.contains_key(cols[0]) {
            order.push(cols[0].to_owned());
        }
        qrels
            .entry(cols[0].to_owned())
            .or_default()
            .insert(cols[1].to_owned(), grade as u32);
    }
    Ok((order, qrels))
}

/// nDCG@k with linear gains (trec_eval's and BEIR's convention) and a log2 discount; the ideal
/// ranking puts every relevant document in grade order.
pub fn ndcg(ranked: &[&str], relevant: &HashMap<String, u32>, k: usize) -> f64 {
    let dcg: f64 = ranked
        .iter()
        .take(k)
        .enumerate()
        .map(|(i, d)| relevant.get(*d).copied().unwrap_or(0) as f64 / (i as f64 + 2.0).log2())
        .sum();
    let mut grades: Vec<u32> = relevant.values().copied().collect();
    grades.sort_unstable_by(|a, b| b.cmp(a));
    let ideal: f64 = grades
        .iter()
        .take(k)
        .enumerate()
        .map(|(i, &g)| g as f64 / (i as f64 + 2.0).log2())
        .sum();
    if ideal == 0.0 {
        0.0
    } else {
        dcg / ideal
    }
}

/// Share of the relevant documents among the first `k`.
pub fn recall(ranked: &[&str], relevant: &HashMap<String, u32>, k: usize) -> f64 {
    if relevant.is_empty() {
        return 0.0;
    }
    let found = ranked
        .iter()
        .take(k)
        .filter(|d| relevant.contains_key(**d))
        .count();
    found as f64 / relevant.len() as f64
}

/// Removes the temporary data folder when the evaluation ends, however it ends.
pub struct TempDir(pub PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn eval(a: EvalArgs) -> Result<()> {
    match a.command {
        EvalCommand::Retrieval(r) => retrieval(r),
        EvalCommand::Fusion(f) => crate::fusion_eval::run(f),
        EvalCommand::Qa(q) => crate::qa_eval::run(q),
        EvalCommand::MixedSet(m) => crate::mixed_set::run(m),
        EvalCommand::FusionSet(f) => crate::fusion_set::run(f),
        EvalCommand::FusionDiff(d) => crate::fusion_eval::diff(d),
    }
}

fn retrieval(a: RetrievalArgs) -> Result<()> {
    let corpus: Vec<CorpusDoc> = read_jsonl(&a.beir.join("corpus.jsonl"))?;
    let queries: Vec<Query> = read_jsonl(&a.beir.join("queries.jsonl"))?;
    let (order, qrels) = read_qrels(&a.beir.join("qrels").join(format!("{}.tsv", a.split)))?;
    let query_text: HashMap<&str, &str> = queries
        .iter()
        .map(|q| (q.id.as_str(), q.text.as_str()))
        .collect();
    let mut eval_queries: Vec<(&str, &str)> = order
        .iter()
        .filter_map(|id| query_text.get(id.as_str()).map(|t| (id.as_str(), *t)))
        .collect();
    if let Some(n) = a.limit_queries {
        eval_queries.truncate(n);
    }
    if eval_queries.is_empty() {
        bail!("no query of split `{}` has relevant documents", a.split);
    }

    let mut kb_args = a.kb.clone();
    let _temp = if kb_args.data_dir.is_none() {
        let dir = std::env::temp_dir().join(format!("engram-eval-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        kb_args.data_dir = Some(dir.clone());
        Some(TempDir(dir))
    } else {
        None
    };
    let mut kb = kb_args.open()?;
    let name: String = a
        .beir
        .file_name()
        .map_or_else(|| "beir".into(), |n| n.to_string_lossy().into_owned())
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let collection = format!("eval-{name}");
    kb.ensure_collection(&collection, a.chunking.config())?;

    let started = Instant::now();
    let bars = StageBars::new(corpus.len() as u64);
    let docs = corpus.iter().map(|d| {
        let text = if d.title.trim().is_empty() {
            d.text.clone()
        } else {
            format!("{}\n\n{}", d.title, d.text)
        };
        NewDocument::new(format!("{}.txt", d.id), text)
    });
    let report = kb.ingest(&collection, docs, &mut |p| bars.update(p))?;
    bars.finish();
    let failed: Vec<_> = report.failures().collect();
    if !failed.is_empty() {
        bail!(
            "{} corpus documents failed to ingest, e.g. {}: {}",
            failed.len(),
            failed[0].0,
            failed[0].1
        );
    }
    let coll = kb.collection(&collection)?;
    eprintln!(
        "ingested {} documents ({} new chunks, {} in the collection) in {:.1} s; embed {:.1} s",
        corpus.len(),
        report.chunks,
        coll.chunks,
        started.elapsed().as_secs_f64(),
        report.times.embed.as_secs_f64()
    );

    let corpus_id: HashMap<u64, String> = kb
        .documents(&collection)?
        .into_iter()
        .map(|d| {
            let id = d.name.strip_suffix(".txt").unwrap_or(&d.name).to_owned();
            (d.id, id)
        })
        .collect();
    let mut results: BTreeMap<&str, serde_json::Value> = BTreeMap::new();
    let mut rows = Vec::new();
    for mode in [SearchMode::Bm25, SearchMode::Dense, SearchMode::Hybrid] {
        let t = Instant::now();
        let (mut ndcg_sum, mut recall_sum) = (0.0, 0.0);
        for (qid, text) in &eval_queries {
            let mut req = SearchRequest::new(&collection, *text);
            req.mode = mode;
            req.k = CHUNKS_RETRIEVED;
            req.candidates = CHUNKS_RETRIEVED;
            let hits = kb.retrieve(&req)?.hits;
            let mut seen = HashSet::new();
            let ranked: Vec<&str> = hits
                .iter()
                .filter(|h| seen.insert(h.doc_id))
                .filter_map(|h| corpus_id.get(&h.doc_id).map(String::as_str))
                .take(RECALL_AT)
                .collect();
            let relevant = &qrels[*qid];
            ndcg_sum += ndcg(&ranked, relevant, NDCG_AT);
            recall_sum += recall(&ranked, relevant, RECALL_AT);
        }
        let n = eval_queries.len() as f64;
        let (nd, rc) = (ndcg_sum / n, recall_sum / n);
        eprintln!(
            "{}: {} queries in {:.1} s",
            mode.name(),
            eval_queries.len(),
            t.elapsed().as_secs_f64()
        );
        results.insert(
            mode.name(),
            serde_json::json!({ format!("ndcg@{NDCG_AT}"): nd, format!("recall@{RECALL_AT}"): rc }),
        );
        rows.push((mode.name(), nd, rc));
    }
    let hnsw = if a.hnsw_recall {
        let texts: Vec<&str> = eval_queries.iter().map(|&(_, t)| t).collect();
        let r = kb.hnsw_recall(&collection, &texts, HNSW_RECALL_AT)?;
        results.insert(
            "hnsw",
            serde_json::json!({ format!("recall@{HNSW_RECALL_AT}"): r }),
        );
        Some(r)
    } else {
        None
    };
    drop(kb);

    if a.json {
        let ordered = serde_json::json!(results);
        println!("{ordered}");
    } else {
        println!(
            "{} ({} split, {} queries, {} documents, {} chunks)",
            a.beir.display(),
            a.split,
            eval_queries.len(),
            corpus.len(),
            coll.chunks
        );
        println!("{:<8} {:>8} {:>11}", "mode", "nDCG@10", "Recall@100");
        for (mode, nd, rc) in rows {
            println!("{mode:<8} {nd:>8.4} {rc:>11.4}");
        }
        if let Some(r) = hnsw {
            println!("HNSW recall@{HNSW_RECALL_AT} against exact search: {r:.4}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rel(pairs: &[(&str, u32)]) -> HashMap<String, u32> {
        pairs.iter().map(|&(d, g)| (d.to_owned(), g)).collect()
    }

    #[test]
    fn ndcg_and_recall_by_hand() {
        let relevant = rel(&[("a", 1), ("b", 1)]);
        assert!((ndcg(&["a", "b", "c"], &relevant, 10) - 1.0).abs() < 1e-12);
        // One relevant document at rank 2 of two relevant: (1/log2 3) / (1 + 1/log2 3).
        let expect = (1.0 / 3f64.log2()) / (1.0 + 1.0 / 3f64.log2());
        assert!((ndcg(&["x", "a"], &relevant, 10) - expect).abs() < 1e-12);
        assert_eq!(ndcg(&["x", "y"], &relevant, 10), 0.0);
        assert_eq!(recall(&["x", "a"], &relevant, 100), 0.5);
        assert_eq!(recall(&["x", "a"], &relevant, 1), 0.0);
        // Graded gains: the grade-2 document first is ideal.
        let graded = rel(&[("a", 2), ("b", 1)]);
        assert!((ndcg(&["a", "b"], &graded, 10) - 1.0).abs() < 1e-12);
        assert!(ndcg(&["b", "a"], &graded, 10) < 1.0);
    }
}
