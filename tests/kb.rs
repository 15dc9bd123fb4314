//! Knowledge bases end to end with the real parsers, chunker, embedder and indexes: ingest,
//! re-ingest, delete, restart and corruption recovery, Chinese BM25, collection isolation,
//! metadata filters, and the `engram ingest`/`search`/`docs` commands.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};

use engram_kb::{
    chunk_text, ChunkConfig, KnowledgeBase, Models, NewDocument, Outcome, SearchMode,
    SearchRequest, Stage, TokenCounter,
};
use proptest::prelude::*;

use crate::common;

/// The embedder and the LLM tokenizer, loaded once for every test of this module.
pub(crate) fn models() -> Models {
    static MODELS: OnceLock<Models> = OnceLock::new();
    MODELS
        .get_or_init(|| {
            let embed = common::models_dir().join("all-MiniLM-L6-v2");
            assert!(
                embed.join("model.safetensors").is_file(),
                "{} is missing: run scripts/fetch-models.sh first",
                embed.display()
            );
            let gguf = engram_gguf::GgufFile::open(common::default_llm()).expect("the LLM opens");
            let tokens = engram_tokenizer::Tokenizer::from_gguf(gguf.metadata())
                .expect("the LLM tokenizer builds");
            Models::load(&embed, 2, Arc::new(tokens)).expect("the embedder loads")
        })
        .clone()
}

/// The parser's fixture files (real documents of every format).
fn fixture(name: &str) -> NewDocument {
    let path = common::workspace_root()
        .join("appliance/parse/tests/fixtures")
        .join(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    NewDocument::new(name, bytes)
}

const PUMPS: &str = "The pump station supplies the east district with drinking water.\n\n\
    Inspect the pumps every Monday and log the pressure and the flow rate. Replace the inlet \
    valve every twelve months; grease the outlet valve monthly.";
const BAKERY: &str = "Our bakery opens at seven. Sourdough bread is baked fresh every \
    morning, and croissants come out of the oven at eight.";
const ZH_PARK: &str = "今天天气很好，我们去公园散步。公园里有很多人在跑步和打太极拳。\n\n\
    湖边的柳树发芽了，孩子们在草地上放风筝。";
const ZH_TRAIN: &str = "高速铁路连接了北京和上海，全程大约四个半小时。列车每天早上六点发车。";

fn open(dir: &Path) -> KnowledgeBase {
    KnowledgeBase::open(dir, models()).expect("the knowledge base opens")
}

fn ingest(kb: &mut KnowledgeBase, coll: &str, docs: Vec<NewDocument>) -> engram_kb::IngestReport {
    kb.ensure_collection(coll, ChunkConfig::default()).unwrap();
    kb.ingest(coll, docs, &mut |_| {}).expect("ingest runs")
}

fn search(kb: &KnowledgeBase, coll: &str, query: &str, mode: SearchMode) -> Vec<(u64, f32)> {
    let mut req = SearchRequest::new(coll, query);
    req.mode = mode;
    kb.retrieve(&req)
        .unwrap()
        .hits
        .iter()
        .map(|h| (h.chunk_id, h.score))
        .collect()
}

const QUERIES: [&str; 4] = [
    "when is the inlet valve replaced",
    "fresh bread in the morning",
    "公园 跑步",
    "pump station maintenance",
];

/// Every query in every mode: what a rebuilt index must reproduce.
fn all_results(kb: &KnowledgeBase, coll: &str) -> Vec<Vec<u64>> {
    let mut out = Vec::new();
    for q in QUERIES {
        for mode in [SearchMode::Bm25, SearchMode::Dense, SearchMode::Hybrid] {
            out.push(search(kb, coll, q, mode).iter().map(|h| h.0).collect());
        }
    }
    out
}

fn small_corpus() -> Vec<NewDocument> {
    vec![
        NewDocument::new("pumps.txt", PUMPS),
        NewDocument::new("bakery.txt", BAKERY),
        NewDocument::new("park.txt", ZH_PARK),
        NewDocument::new("train.txt", ZH_TRAIN),
        fixture("guide.md"),
        fixture("english-2pages.pdf"),
    ]
}

#[test]
fn real_files_are_ingested_with_spans_and_pages() {
    let dir = common::temp_dir("kb-files");
    let mut kb = open(&dir);
    let mut docs = small_corpus();
    docs.extend(
        [
            "page.html",
            "chinese.md",
            "chinese.html",
            "gbk.txt",
            "scanned.pdf",
        ]
        .map(fixture),
    );
    let report = ingest(&mut kb, "files", docs);
    let failed: Vec<_> = report.failures().collect();
    assert_eq!(failed.len(), 1, "only the scanned PDF fails: {failed:?}");
    assert_eq!(failed[0].0, "scanned.pdf");
    for d in kb.documents("files").unwrap() {
        let expected = if d.name == "scanned.pdf" {
            Stage::Failed
        } else {
            Stage::Done
        };
        assert_eq!(d.stage, expected, "{}: {:?}", d.name, d.error);
        let stages: Vec<Stage> = d.stages.iter().map(|s| s.stage).collect();
        assert_eq!(stages[..2], [Stage::Queued, Stage::Parsing], "{}", d.name);
        if expected == Stage::Done {
            assert_eq!(
                stages[2..],
                [
                    Stage::Chunking,
                    Stage::Embedding,
                    Stage::Indexing,
                    Stage::Done
                ]
            );
        }
        // Every chunk is the parsed text at its spans, within the token limit.
        let chunks = kb.chunks(d.id).unwrap();
        assert_eq!(chunks.len(), d.chunks as usize);
        if d.chunks > 0 {
            let parsed =
                engram_parse::parse(&d.name, &kb.original(&d).unwrap(), &Default::default())
                    .unwrap();
            for c in &chunks {
                assert_eq!(parsed.text[c.bytes.clone()], c.text);
                assert_eq!(parsed.text[..c.bytes.start].chars().count(), c.chars.start);
                assert_eq!(c.text.chars().count(), c.chars.len());
                assert!(c.tokens as usize <= ChunkConfig::default().max_tokens);
                assert_eq!(c.page.is_some(), d.name.ends_with(".pdf"), "{}", d.name);
                assert_eq!(kb.embedding(c.id).unwrap().unwrap().len(), 384);
            }
        }
    }
    // The PDF's second page is cited as page 2.
    let hits = kb
        .search(&SearchRequest::new("files", "quarterly maintenance report"))
        .unwrap()
        .hits;
    let pdf = hits
        .iter()
        .find(|h| h.doc_name == "english-2pages.pdf")
        .expect("the PDF is found");
    assert!(pdf.page.is_some());
    assert!(pdf.bm25.is_some() && pdf.dense.is_some(), "{pdf:?}");
    for r in &pdf.highlights {
        assert!(pdf.text.is_char_boundary(r.start) && pdf.text.is_char_boundary(r.end));
    }
    let (bm25, vectors) = kb.index_sizes("files").unwrap();
    let coll = kb.collection("files").unwrap();
    assert_eq!((bm25, vectors), (coll.chunks, coll.chunks));
}

#[test]
fn reingest_is_a_noop_and_delete_leaves_no_trace() {
    let dir = common::temp_dir("kb-delete");
    let mut kb = open(&dir);
    let first = ingest(&mut kb, "docs", small_corpus());
    assert_eq!(first.failures().count(), 0);
    let before = kb.collection("docs").unwrap();
    let sizes_before = kb.catalog_sizes();

    let again = ingest(&mut kb, "docs", small_corpus());
    assert!(
        again
            .docs
            .iter()
            .all(|d| matches!(d.outcome, Outcome::Unchanged { .. })),
        "{again:?}"
    );
    assert_eq!(again.chunks, 0);
    let after = kb.collection("docs").unwrap();
    assert_eq!(after.last_seq, before.last_seq, "re-ingest changed nothing");
    let jobs = |s: Vec<(&'static str, usize)>| {
        s.into_iter()
            .filter(|(n, _)| *n != "jobs")
            .collect::<Vec<_>>()
    };
    assert_eq!(jobs(kb.catalog_sizes()), jobs(sizes_before));

    // Delete the pumps document: nothing of it may remain anywhere.
    let doc = kb.document("docs", "pumps.txt").unwrap();
    let chunks = kb.chunks(doc.id).unwrap();
    assert!(search(&kb, "docs", "inlet valve", SearchMode::Bm25)
        .iter()
        .any(|h| engram_kb::Chunk::doc_of(h.0) == doc.id));
    let blobs = kb.original_count().unwrap();
    let (bm25_before, vec_before) = kb.index_sizes("docs").unwrap();

    kb.delete_document("docs", "pumps.txt").unwrap();
    assert!(kb.document("docs", "pumps.txt").is_err());
    assert!(kb.document("docs", &doc.id.to_string()).is_err());
    assert!(kb.chunks(doc.id).unwrap().is_empty());
    for c in &chunks {
        assert!(kb.embedding(c.id).unwrap().is_none());
    }
    assert!(!kb.has_original(&doc).unwrap());
    assert_eq!(kb.original_count().unwrap(), blobs - 1);
    let n = chunks.len() as u64;
    assert_eq!(
        kb.index_sizes("docs").unwrap(),
        (bm25_before - n, vec_before - n)
    );
    for mode in [SearchMode::Bm25, SearchMode::Dense, SearchMode::Hybrid] {
        let hits = search(&kb, "docs", "inlet valve pump station", mode);
        assert!(
            hits.iter().all(|h| engram_kb::Chunk::doc_of(h.0) != doc.id),
            "{mode:?} still finds the deleted document"
        );
    }
    let coll = kb.collection("docs").unwrap();
    assert_eq!(coll.chunks, before.chunks - n);

    // Deleting everything empties every per-document tree.
    for d in kb.documents("docs").unwrap() {
        kb.delete_document("docs", &d.name).unwrap();
    }
    for (tree, n) in kb.catalog_sizes() {
        if !matches!(tree, "meta" | "collections" | "collection_names" | "jobs") {
            assert_eq!(n, 0, "catalog tree {tree} still has entries");
        }
    }
    assert_eq!(kb.original_count().unwrap(), 0);
    assert_eq!(kb.index_sizes("docs").unwrap(), (0, 0));

    // A deleted document can be ingested again.
    let back = ingest(&mut kb, "docs", vec![NewDocument::new("pumps.txt", PUMPS)]);
    assert!(matches!(back.docs[0].outcome, Outcome::Added { .. }));
}

#[test]
fn changed_content_under_the_same_name_replaces_the_document() {
    let dir = common::temp_dir("kb-replace");
    let mut kb = open(&dir);
    ingest(&mut kb, "docs", vec![NewDocument::new("notes.txt", PUMPS)]);
    let old = kb.document("docs", "notes.txt").unwrap();
    let r = ingest(&mut kb, "docs", vec![NewDocument::new("notes.txt", BAKERY)]);
    assert!(
        matches!(r.docs[0].outcome, Outcome::Replaced { old: o, .. } if o == old.id),
        "{r:?}"
    );
    assert_eq!(kb.documents("docs").unwrap().len(), 1);
    assert!(!kb.has_original(&old).unwrap());
    let hits = search(&kb, "docs", "inlet valve", SearchMode::Bm25);
    assert!(hits.is_empty(), "{hits:?}");
}

#[test]
fn restart_rebuilds_missing_indexes_with_the_same_results() {
    let dir = common::temp_dir("kb-restart");
    let mut kb = open(&dir);
    ingest(&mut kb, "docs", small_corpus());
    let expected = all_results(&kb, "docs");
    let coll = kb.collection("docs").unwrap();
    drop(kb);

    let coll_dir = dir.join("collections").join(coll.id.to_string());
    std::fs::remove_dir_all(coll_dir.join("bm25")).unwrap();
    std::fs::remove_dir_all(coll_dir.join("vectors")).unwrap();
    let kb = open(&dir);
    let rebuilt: Vec<&str> = kb.recovery().rebuilt.iter().map(|r| r.1).collect();
    assert_eq!(rebuilt, ["bm25", "vectors"], "{:?}", kb.recovery());
    assert_eq!(all_results(&kb, "docs"), expected);

    // A clean restart touches nothing.
    drop(kb);
    let kb = open(&dir);
    assert_eq!(kb.recovery(), &engram_kb::Recovery::default());
    assert_eq!(all_results(&kb, "docs"), expected);
}

/// Flips bytes in the middle of every file under `dir` whose name passes `pick`.
fn corrupt_files(dir: &Path, pick: &dyn Fn(&str) -> bool) -> usize {
    let mut n = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let path: PathBuf = e.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_file() && pick(&name) {
            let mut bytes = std::fs::read(&path).unwrap();
            if bytes.len() < 16 {
                continue;
            }
            let mid = bytes.len() / 2;
            for b in &mut bytes[mid..mid + 8] {
                *b ^= 0x5a;
            }
            std::fs::write(&path, bytes).unwrap();
            n += 1;
        }
    }
    n
}

#[test]
fn corrupted_index_files_are_detected_and_rebuilt() {
    let dir = common::temp_dir("kb-corrupt");
    let mut kb = open(&dir);
    ingest(&mut kb, "docs", small_corpus());
    let expected = all_results(&kb, "docs");
    let coll = kb.collection("docs").unwrap();
    drop(kb);

    let coll_dir = dir.join("collections").join(coll.id.to_string());
    // Every tantivy segment file and every vector file except the lock.
    let n = corrupt_files(&coll_dir.join("bm25"), &|n| {
        !n.ends_with(".json") && !n.ends_with(".lock")
    });
    assert!(n > 0, "no BM25 segment files to corrupt");
    let n = corrupt_files(&coll_dir.join("vectors"), &|n| n != "LOCK");
    assert!(n > 0, "no vector files to corrupt");

    let kb = open(&dir);
    let rebuilt: Vec<&str> = kb.recovery().rebuilt.iter().map(|r| r.1).collect();
    assert_eq!(rebuilt, ["bm25", "vectors"], "{:?}", kb.recovery());
    assert_eq!(all_results(&kb, "docs"), expected);
}

#[test]
fn an_index_left_behind_is_brought_up_to_date() {
    let dir = common::temp_dir("kb-behind");
    let mut kb = open(&dir);
    ingest(&mut kb, "docs", vec![NewDocument::new("pumps.txt", PUMPS)]);
    let coll = kb.collection("docs").unwrap();
    drop(kb);
    // Keep the indexes as they are now, add a document, then put the old indexes back: what
    // a crash between the catalog write and the index commit would leave.
    let coll_dir = dir.join("collections").join(coll.id.to_string());
    let saved = common::temp_dir("kb-behind-saved");
    copy_dir(&coll_dir, &saved);
    let mut kb = open(&dir);
    ingest(
        &mut kb,
        "docs",
        vec![NewDocument::new("bakery.txt", BAKERY)],
    );
    let expected = all_results(&kb, "docs");
    drop(kb);
    std::fs::remove_dir_all(&coll_dir).unwrap();
    copy_dir(&saved, &coll_dir);

    let kb = open(&dir);
    let r = kb.recovery();
    assert_eq!(r.rebuilt.len() + r.caught_up.len(), 2, "{r:?}");
    assert_eq!(all_results(&kb, "docs"), expected);
    assert!(!search(&kb, "docs", "sourdough bread", SearchMode::Bm25).is_empty());
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}

#[test]
fn chinese_queries_find_chinese_chunks_and_skip_the_blind_dense_side() {
    let dir = common::temp_dir("kb-chinese");
    let mut kb = open(&dir);
    ingest(&mut kb, "docs", small_corpus());
    let park = kb.document("docs", "park.txt").unwrap().id;
    let train = kb.document("docs", "train.txt").unwrap().id;
    for (query, doc) in [("公园里跑步的人", park), ("北京到上海的高速铁路", train)]
    {
        let bm25 = search(&kb, "docs", query, SearchMode::Bm25);
        assert_eq!(engram_kb::Chunk::doc_of(bm25[0].0), doc, "{query}");
        let mut req = SearchRequest::new("docs", query);
        req.mode = SearchMode::Hybrid;
        let res = kb.search(&req).unwrap();
        assert!(
            res.signal.blind_share > engram_kb::BLIND_SHARE_NONE,
            "{:?}",
            res.signal
        );
        assert_eq!(res.dense_weight, 0.0);
        assert_eq!(res.hits[0].doc_id, doc);
        // With the dense side off, hybrid ranks exactly as BM25 does.
        let hybrid: Vec<u64> = res.hits.iter().map(|h| h.chunk_id).collect();
        let bm25: Vec<u64> = bm25.iter().map(|h| h.0).take(hybrid.len()).collect();
        assert_eq!(hybrid, bm25);
        assert!(!res.hits[0].highlights.is_empty());
    }
    // An English query keeps its dense side.
    let res = kb
        .search(&SearchRequest::new("docs", "when are croissants ready"))
        .unwrap();
    assert_eq!(res.signal.blind_share, 0.0);
    assert_eq!(res.dense_weight, engram_kb::DEFAULT_DENSE_WEIGHT);
    assert_eq!(res.hits[0].doc_name, "bakery.txt");
}

#[test]
fn chinese_lines_of_english_documents_are_found() {
    // `engram eval mixed-set`: XQuAD's English paragraphs quoting Chinese sentences of their
    // translation. Indexed by majority script, the Chinese questions scored 0.28 nDCG@10.
    let dir = common::temp_dir("kb-mixed");
    let set = dir.join("mixed");
    let out = Command::new(common::engram_bin())
        .args(["eval", "mixed-set", "--xquad"])
        .arg(common::shared_dir().join("data/qa-eval/xquad"))
        .arg("--out")
        .arg(&set)
        .output()
        .expect("engram runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let corpus = std::fs::read_to_string(set.join("corpus.jsonl")).unwrap();
    assert_eq!(corpus.lines().count(), 240);
    for line in corpus.lines() {
        let doc: serde_json::Value = serde_json::from_str(line).unwrap();
        let text = doc["text"].as_str().unwrap();
        assert!(!engram_fusion::is_chinese(text), "{text}");
    }
    let (ok, stdout, stderr) = engram(
        &dir.join("data"),
        &[
            "eval",
            "retrieval",
            "--beir",
            set.to_str().unwrap(),
            "--split",
            "zh",
            "--limit-queries",
            "100",
            "--json",
        ],
    );
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
    let bm25 = v["bm25"]["ndcg@10"].as_f64().unwrap();
    let hybrid = v["hybrid"]["ndcg@10"].as_f64().unwrap();
    assert!(bm25 > 0.8 && hybrid > 0.8, "{v}");
}

#[test]
fn a_collection_never_returns_another_collections_chunks() {
    let dir = common::temp_dir("kb-isolation");
    let mut kb = open(&dir);
    ingest(&mut kb, "a", vec![NewDocument::new("pumps.txt", PUMPS)]);
    // Collection b holds the same content and more: its ids must never show up in a.
    ingest(
        &mut kb,
        "b",
        vec![
            NewDocument::new("pumps.txt", PUMPS),
            NewDocument::new("bakery.txt", BAKERY),
        ],
    );
    let a_docs: HashSet<u64> = kb.documents("a").unwrap().iter().map(|d| d.id).collect();
    let b_docs: HashSet<u64> = kb.documents("b").unwrap().iter().map(|d| d.id).collect();
    assert!(a_docs.is_disjoint(&b_docs));
    for q in QUERIES {
        for mode in [SearchMode::Bm25, SearchMode::Dense, SearchMode::Hybrid] {
            let mut req = SearchRequest::new("a", q);
            req.mode = mode;
            req.k = 100;
            for h in kb.search(&req).unwrap().hits {
                assert!(a_docs.contains(&h.doc_id), "{mode:?} {q}: {h:?}");
            }
        }
    }
    // Deleting the shared content from b keeps a's blob.
    let in_a = kb.document("a", "pumps.txt").unwrap();
    kb.delete_document("b", "pumps.txt").unwrap();
    assert!(kb.has_original(&in_a).unwrap());
    assert!(!search(&kb, "a", "inlet valve", SearchMode::Bm25).is_empty());
    // Deleting a collection removes its files and documents.
    kb.delete_collection("b").unwrap();
    assert!(kb.collection("b").is_err());
    assert_eq!(kb.collections().unwrap().len(), 1);
}

#[test]
fn several_collections_rank_on_one_scale() {
    // Normalised per collection, every collection's best hit scored 1: a lone chunk barely
    // about the question outranked another collection's chunk that answers it, higher on
    // BM25 and on cosine, because a paraphrase there scored the better cosine.
    let dir = common::temp_dir("kb-across");
    let mut kb = open(&dir);
    ingest(
        &mut kb,
        "office",
        vec![NewDocument::new(
            "chairs.txt",
            "Office chairs are replaced every five years.",
        )],
    );
    ingest(
        &mut kb,
        "plant",
        vec![
            NewDocument::new("pumps.txt", PUMPS),
            NewDocument::new(
                "intake.txt",
                "How frequently should the intake gate be swapped? Intake gates get changed yearly.",
            ),
        ],
    );
    let query = "how often is the inlet valve replaced";
    let reqs = ["office", "plant"].map(|c| SearchRequest::new(c, query));
    let hits = kb.search_many(&reqs).unwrap();
    let names: Vec<&str> = hits.iter().map(|(_, h)| h.doc_name.as_str()).collect();
    let pumps = hits
        .iter()
        .find(|(_, h)| h.doc_name == "pumps.txt")
        .unwrap();
    let chairs = hits
        .iter()
        .find(|(_, h)| h.doc_name == "chairs.txt")
        .unwrap();
    assert_eq!(reqs[pumps.0].collection, "plant");
    assert_eq!(reqs[chairs.0].collection, "office");
    // The answer has the higher BM25 and cosine of the two, so it ranks above.
    assert!(
        pumps.1.bm25 > chairs.1.bm25 && pumps.1.dense > chairs.1.dense,
        "{hits:?}"
    );
    let rank = |n: &str| names.iter().position(|x| *x == n).unwrap();
    assert!(rank("pumps.txt") < rank("chairs.txt"), "{names:?}");
    // Searched one collection at a time and merged by score (as engramd did), the lone chunk
    // came first: this data has the failure one ranking fixes.
    let alone = |c: &str, doc: &str| {
        let hits = kb.search(&SearchRequest::new(c, query)).unwrap().hits;
        hits.iter().find(|h| h.doc_name == doc).unwrap().score
    };
    assert!(
        alone("office", "chairs.txt") > alone("plant", "pumps.txt"),
        "{hits:?}"
    );
    // No hit beats the first on both raw scores, and every fused score is on 0..=1.
    let top = &hits[0].1;
    for (_, h) in &hits {
        assert!(!(h.bm25 > top.bm25 && h.dense > top.dense), "{hits:?}");
        assert!((0.0..=1.0).contains(&h.score), "{hits:?}");
    }
    // A BM25 search's score is on the same scale (its raw score stays in `bm25`).
    let mut bm25 = SearchRequest::new("plant", query);
    bm25.mode = SearchMode::Bm25;
    let res = kb.search(&bm25).unwrap();
    assert_eq!(res.hits[0].score, 1.0);
    assert!(res.hits[0].bm25.unwrap() > 1.0, "{:?}", res.hits[0]);
    // Requests that ask different things of their collections are one search no more.
    let mut other = SearchRequest::new("plant", "bread");
    other.k = 3;
    assert!(kb
        .search_many(&[SearchRequest::new("office", "bread"), other])
        .is_err());
}

#[test]
fn metadata_filters_restrict_the_documents() {
    let dir = common::temp_dir("kb-meta");
    let mut kb = open(&dir);
    let mut pumps = NewDocument::new("pumps.txt", PUMPS);
    pumps.metadata.insert("dept".into(), "ops".into());
    let mut bakery = NewDocument::new("bakery.txt", BAKERY);
    bakery.metadata.insert("dept".into(), "kitchen".into());
    ingest(&mut kb, "docs", vec![pumps, bakery]);
    for (dept, name) in [("ops", "pumps.txt"), ("kitchen", "bakery.txt")] {
        for mode in [SearchMode::Bm25, SearchMode::Dense, SearchMode::Hybrid] {
            let mut req = SearchRequest::new("docs", "pumps bread valve morning");
            req.mode = mode;
            req.metadata = vec![("dept".into(), dept.into())];
            let hits = kb.search(&req).unwrap().hits;
            assert!(!hits.is_empty(), "{mode:?} {dept}");
            assert!(hits.iter().all(|h| h.doc_name == name), "{mode:?} {dept}");
        }
    }
    let mut req = SearchRequest::new("docs", "pumps");
    req.metadata = vec![("dept".into(), "nobody".into())];
    assert!(kb.search(&req).unwrap().hits.is_empty());
}

/// Runs `engram` with the test's data directory; returns (status ok, stdout, stderr).
fn engram(data: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(common::engram_bin())
        .args(args)
        .arg("--data-dir")
        .arg(data)
        .arg("--threads")
        .arg("2")
        .env("ENGRAM_MODELS_DIR", common::models_dir())
        .output()
        .expect("engram runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn cli_ingest_search_and_docs() {
    let dir = common::temp_dir("kb-cli");
    let files = dir.join("files");
    std::fs::create_dir_all(files.join("sub")).unwrap();
    std::fs::write(files.join("pumps.txt"), PUMPS).unwrap();
    std::fs::write(files.join("sub").join("park.md"), ZH_PARK).unwrap();
    std::fs::write(files.join(".hidden.txt"), "skipped").unwrap();
    let data = dir.join("data");

    let files_arg = files.to_str().unwrap();
    let (ok, _, err) = engram(&data, &["ingest", files_arg, "--collection", "cli"]);
    assert!(ok, "{err}");
    assert!(err.contains("2 added"), "{err}");

    // A file the parsers reject (a zip bomb; a scanned PDF is read by OCR where Tesseract is
    // installed): listed with its reason, non-zero exit, the rest unaffected.
    let rejected =
        common::workspace_root().join("appliance/parse/tests/fixtures/bomb-lying-header.docx");
    let (ok, out, err) = engram(
        &data,
        &[
            "ingest",
            rejected.to_str().unwrap(),
            files_arg,
            "--collection",
            "cli",
            "--json",
        ],
    );
    assert!(!ok, "a failed document must fail the command");
    assert!(err.contains("bomb-lying-header.docx: "), "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let outcomes: Vec<&str> = report["documents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(outcomes, ["failed", "unchanged", "unchanged"]);

    let (ok, out, err) = engram(
        &data,
        &[
            "search",
            "inlet valve",
            "--collection",
            "cli",
            "--json",
            "--k",
            "3",
        ],
    );
    assert!(ok, "{err}");
    let res: serde_json::Value = serde_json::from_str(&out).unwrap();
    let top = &res["hits"][0];
    assert_eq!(top["doc_name"], "pumps.txt");
    assert!(top["bm25"].is_number() && top["dense"].is_number(), "{top}");
    let text = top["text"].as_str().unwrap();
    let bytes = top["bytes"].as_array().unwrap();
    let span = bytes[0].as_u64().unwrap() as usize..bytes[1].as_u64().unwrap() as usize;
    assert_eq!(&PUMPS[span], text);
    assert!(!top["highlights"].as_array().unwrap().is_empty());

    let (ok, out, _) = engram(
        &data,
        &["search", "公园", "--collection", "cli", "--mode", "bm25"],
    );
    assert!(ok);
    assert!(out.contains("sub/park.md"), "{out}");

    let (ok, out, _) = engram(&data, &["docs", "list", "--collection", "cli", "--json"]);
    assert!(ok);
    let docs: serde_json::Value = serde_json::from_str(&out).unwrap();
    let names: HashSet<&str> = docs
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        HashSet::from(["pumps.txt", "sub/park.md", "bomb-lying-header.docx"])
    );

    let (ok, _, err) = engram(
        &data,
        &["docs", "delete", "pumps.txt", "--collection", "cli"],
    );
    assert!(ok, "{err}");
    let (ok, out, _) = engram(
        &data,
        &["search", "inlet valve", "--collection", "cli", "--json"],
    );
    assert!(ok);
    assert!(!out.contains("pumps.txt"), "{out}");

    let (ok, out, _) = engram(&data, &["collections", "list"]);
    assert!(ok);
    assert!(out.starts_with("cli "), "{out}");
    let (ok, _, err) = engram(&data, &["search", "x", "--collection", "nope"]);
    assert!(!ok);
    assert!(err.contains("collection `nope` does not exist"), "{err}");
}

/// The LLM tokenizer as a [`TokenCounter`], shared by the property test.
fn llm_tokens() -> Arc<dyn TokenCounter> {
    models().tokens
}

fn piece() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-zA-Z]{1,10}",
        Just(" ".to_string()),
        Just(". ".to_string()),
        Just("\n\n".to_string()),
        Just("，".to_string()),
        Just("。".to_string()),
        "[一-龥]{1,6}",
        "[0-9]{1,4}",
        "[é😀ß€]{1,2}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// With the real LLM tokenizer: every chunk fits, spans are valid char boundaries, and
    /// every non-space byte is covered.
    #[test]
    fn chunks_fit_the_llm_tokenizer(pieces in proptest::collection::vec(piece(), 0..300), max in 16usize..80) {
        let text: String = pieces.concat();
        let cfg = ChunkConfig { max_tokens: max, overlap_tokens: max / 4 };
        let counter = llm_tokens();
        let spans = chunk_text(&text, &cfg, counter.as_ref());
        let mut covered = vec![false; text.len()];
        for s in &spans {
            prop_assert!(text.is_char_boundary(s.bytes.start) && text.is_char_boundary(s.bytes.end));
            prop_assert!(s.tokens <= max, "{} > {max}", s.tokens);
            prop_assert_eq!(counter.count(&text[s.bytes.clone()]), s.tokens);
            prop_assert_eq!(text[..s.bytes.start].chars().count(), s.chars.start);
            covered[s.bytes.clone()].iter_mut().for_each(|c| *c = true);
        }
        for (i, c) in text.char_indices() {
            prop_assert!(c.is_whitespace() || covered[i], "byte {} not covered", i);
        }
    }
}

#[test]
fn a_new_embedding_model_reembeds_the_collection() {
    let dir = common::temp_dir("kb-reembed");
    let mut kb = open(&dir);
    ingest(&mut kb, "docs", small_corpus());
    let expected = all_results(&kb, "docs");
    let old_model = kb.collection("docs").unwrap().embed_model;
    drop(kb);

    // The same weights in a folder of another name: another model id, so the collection's
    // vectors no longer match the embedder and must be recomputed.
    let src = common::models_dir().join("all-MiniLM-L6-v2");
    let copy = dir.join("minilm-copy");
    copy_dir(&src, &copy);
    let mut other = models();
    other.embedder = Arc::new(engram_embed::Embedder::load(&copy, 2).unwrap());
    let kb = KnowledgeBase::open(&dir, other.clone()).unwrap();
    assert_eq!(kb.recovery().reembedded, ["docs"]);
    let coll = kb.collection("docs").unwrap();
    assert_ne!(coll.embed_model, old_model);
    assert_eq!(coll.embed_model, other.embedder.model_id());
    let job = kb.jobs().unwrap().into_iter().find(|j| {
        matches!(&j.kind, engram_kb::JobKind::Reembed { from_model, .. } if *from_model == old_model)
    });
    let job = job.expect("a re-embedding job is recorded");
    assert_eq!(job.state, engram_kb::JobState::Done);
    assert_eq!(job.done, coll.chunks);
    assert_eq!(kb.index_sizes("docs").unwrap(), (coll.chunks, coll.chunks));
    assert_eq!(all_results(&kb, "docs"), expected);
    drop(kb);
    // Reopening with the new model changes nothing more.
    let kb = KnowledgeBase::open(&dir, other).unwrap();
    assert_eq!(kb.recovery(), &engram_kb::Recovery::default());
}
