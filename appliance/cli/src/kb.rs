//! `engram ingest`, `search`, `docs` and `collections`: the knowledge-base commands.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use engram_kb::{
    ChunkConfig, Collection, Document, IngestReport, KnowledgeBase, Models, NewDocument, Outcome,
    Progress, SearchMode, SearchRequest, SearchResults, DEFAULT_CHUNK_TOKENS,
    DEFAULT_OVERLAP_TOKENS,
};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

/// The default embedding model's folder inside the models folder.
pub const DEFAULT_EMBEDDER: &str = "all-MiniLM-L6-v2";

/// Where a knowledge base lives and which models it uses.
#[derive(Args, Clone, Debug)]
pub struct KbArgs {
    /// Data directory [default: $ENGRAM_DATA_DIR or ./data]
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Embedding model folder [default: $ENGRAM_MODELS_DIR or ./models, then all-MiniLM-L6-v2]
    #[arg(long)]
    pub embed_model: Option<PathBuf>,
    /// GGUF LLM whose tokenizer sizes chunks [default: the default LLM in the models folder]
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Compute threads for the embedder [default: all cores]
    #[arg(long)]
    pub threads: Option<usize>,
}

fn models_dir() -> PathBuf {
    std::env::var_os("ENGRAM_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("models"))
}

impl KbArgs {
    pub fn data_dir(&self) -> PathBuf {
        self.data_dir
            .clone()
            .or_else(|| std::env::var_os("ENGRAM_DATA_DIR").map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from("data"))
    }

    /// Loads the embedder and the LLM's tokenizer.
    pub fn models(&self) -> Result<Models> {
        let embed = self
            .embed_model
            .clone()
            .unwrap_or_else(|| models_dir().join(DEFAULT_EMBEDDER));
        if !embed.join("model.safetensors").is_file() {
            bail!(
                "embedding model {} not found (run scripts/fetch-models.sh, or pass --embed-model)",
                embed.display()
            );
        }
        let llm = self.model.clone().unwrap_or_else(crate::default_model_path);
        if !llm.is_file() {
            bail!(
                "model file {} not found (run scripts/fetch-models.sh, or pass --model)",
                llm.display()
            );
        }
        let gguf = engram_gguf::GgufFile::open(&llm)
            .with_context(|| format!("opening {}", llm.display()))?;
        let tokens = engram_tokenizer::Tokenizer::from_gguf(gguf.metadata())
            .context("building the LLM tokenizer")?;
        let threads = self.threads.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        });
        Models::load(&embed, threads, Arc::new(tokens))
            .with_context(|| format!("loading {}", embed.display()))
    }

    /// Opens the knowledge base, reporting on stderr what start-up recovery did.
    pub fn open(&self) -> Result<KnowledgeBase> {
        let dir = self.data_dir();
        let mut kb = KnowledgeBase::open(&dir, self.models()?)
            .with_context(|| format!("opening the knowledge base in {}", dir.display()))?;
        // Images and scanned PDF pages are read where Tesseract is installed, as engramd's
        // `[ingest] ocr = "auto"` does.
        if let Ok(ocr) = engram_parse::Ocr::detect(
            engram_parse::DEFAULT_OCR_LANGUAGES,
            std::time::Duration::from_secs(120),
        ) {
            kb.set_ocr(Some(Arc::new(ocr)));
        }
        let r = kb.recovery();
        for (coll, index, why) in &r.rebuilt {
            eprintln!("recovery: rebuilt the {index} index of `{coll}` ({why})");
        }
        for (coll, index, n) in &r.caught_up {
            eprintln!("recovery: caught the {index} index of `{coll}` up ({n} changes)");
        }
        for coll in &r.reembedded {
            eprintln!(
                "recovery: re-embedded `{coll}` with {}",
                kb.models().embedder.model_id()
            );
        }
        if r.resumed > 0 {
            eprintln!("recovery: finishing {} interrupted documents", r.resumed);
        }
        let mut kb = kb;
        let finished = kb
            .finish_queued()
            .context("finishing interrupted documents")?;
        if finished > 0 {
            eprintln!("recovery: {finished} interrupted documents finished");
        }
        Ok(kb)
    }
}

/// Chunk settings for a new collection.
#[derive(Args, Clone, Copy, Debug)]
pub struct ChunkArgs {
    /// LLM tokens per chunk (for a new collection)
    #[arg(long, default_value_t = DEFAULT_CHUNK_TOKENS)]
    pub chunk_tokens: usize,
    /// LLM tokens shared by neighbouring chunks (for a new collection)
    #[arg(long, default_value_t = DEFAULT_OVERLAP_TOKENS)]
    pub overlap_tokens: usize,
}

impl ChunkArgs {
    pub fn config(&self) -> ChunkConfig {
        ChunkConfig {
            max_tokens: self.chunk_tokens,
            overlap_tokens: self.overlap_tokens,
        }
    }
}

#[derive(Args)]
pub struct IngestArgs {
    /// Files and folders to ingest (folders recurse; hidden files are skipped).
    #[arg(required = true)]
    paths: Vec<PathBuf>,
    /// The collection to add them to (created if missing).
    #[arg(long)]
    collection: String,
    /// Metadata for every document, KEY=VALUE (repeatable).
    #[arg(long = "meta", value_parser = parse_pair)]
    meta: Vec<(String, String)>,
    #[command(flatten)]
    chunking: ChunkArgs,
    /// Also compute and store every new chunk's LLM KV (compute for storage), so `engram ask`
    /// loads it instead of recomputing it.
    #[arg(long)]
    kv: bool,
    #[command(flatten)]
    kv_tiers: crate::ask::KvArgs,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    kb: KbArgs,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ModeArg {
    Hybrid,
    Bm25,
    Dense,
}

impl From<ModeArg> for SearchMode {
    fn from(m: ModeArg) -> SearchMode {
        match m {
            ModeArg::Hybrid => SearchMode::Hybrid,
            ModeArg::Bm25 => SearchMode::Bm25,
            ModeArg::Dense => SearchMode::Dense,
        }
    }
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum FusionArg {
    /// Weighted sum of min-max normalised scores (BM25 0.55, dense 0.45).
    Weighted,
    /// Equal-weight reciprocal-rank fusion (k = 60).
    Rrf,
}

#[derive(Args)]
pub struct SearchArgs {
    /// The question or keywords.
    query: String,
    /// The collection to search.
    #[arg(long)]
    collection: String,
    #[arg(long, value_enum, default_value_t = ModeArg::Hybrid)]
    mode: ModeArg,
    /// Hits to return.
    #[arg(long, default_value_t = 10)]
    k: usize,
    #[arg(long, value_enum, default_value_t = FusionArg::Weighted)]
    fusion: FusionArg,
    /// Only documents with this metadata, KEY=VALUE (repeatable; all must match).
    #[arg(long = "filter", value_parser = parse_pair)]
    filter: Vec<(String, String)>,
    /// Print JSON instead of a list.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    kb: KbArgs,
}

#[derive(Args)]
pub struct DocsArgs {
    #[command(subcommand)]
    command: DocsCommand,
}

#[derive(Subcommand)]
enum DocsCommand {
    /// List a collection's documents with their stage and chunk count.
    List {
        #[arg(long)]
        collection: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        kb: KbArgs,
    },
    /// Delete documents (by id or name) from every store and index.
    Delete {
        /// Document ids or names.
        #[arg(required = true)]
        docs: Vec<String>,
        #[arg(long)]
        collection: String,
        #[command(flatten)]
        kb: KbArgs,
    },
}

#[derive(Args)]
pub struct CollectionsArgs {
    #[command(subcommand)]
    command: CollectionsCommand,
}

#[derive(Subcommand)]
enum CollectionsCommand {
    /// List collections.
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        kb: KbArgs,
    },
    /// Create an empty collection.
    Create {
        name: String,
        #[command(flatten)]
        chunking: ChunkArgs,
        #[command(flatten)]
        kb: KbArgs,
    },
    /// Delete a collection with all its documents.
    Delete {
        name: String,
        #[command(flatten)]
        kb: KbArgs,
    },
}

fn parse_pair(s: &str) -> std::result::Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

/// Every file under `paths` (folders recurse, sorted; hidden entries skipped), with the name
/// it gets in the collection: its path relative to the folder given, or its file name.
pub fn collect_files(paths: &[PathBuf]) -> Result<Vec<(PathBuf, String)>> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<(PathBuf, String)>) -> Result<()> {
        let mut entries = std::fs::read_dir(dir)
            .with_context(|| format!("listing {}", dir.display()))?
            .collect::<std::io::Result<Vec<_>>>()
            .with_context(|| format!("listing {}", dir.display()))?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            if e.file_name().to_string_lossy().starts_with('.') {
                continue;
            }
            let path = e.path();
            if path.is_dir() {
                walk(root, &path, out)?;
            } else if path.is_file() {
                let rel = path.strip_prefix(root).unwrap_or(&path);
                let name = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy())
                    .collect::<Vec<_>>()
                    .join("/");
                out.push((path, name));
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    for p in paths {
        if p.is_dir() {
            walk(p, p, &mut out)?;
        } else if p.is_file() {
            let name = p.file_name().map_or_else(
                || p.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            );
            out.push((p.clone(), name));
        } else {
            bail!("{} is neither a file nor a folder", p.display());
        }
    }
    Ok(out)
}

/// One progress bar per ingest stage, drawn on stderr when it is a terminal.
pub struct StageBars {
    multi: MultiProgress,
    parse: ProgressBar,
    chunk: ProgressBar,
    embed: ProgressBar,
    index: ProgressBar,
}

impl StageBars {
    pub fn new(docs: u64) -> StageBars {
        let multi = MultiProgress::new();
        let style = ProgressStyle::with_template(
            "{prefix:>7} [{bar:32}] {pos:>6}/{len:<6} {per_sec:>12} {msg}",
        )
        .expect("a valid template")
        .progress_chars("=> ");
        let bar = |name: &str, len: u64| {
            let b = multi.add(ProgressBar::new(len));
            b.set_style(style.clone());
            b.set_prefix(name.to_owned());
            b
        };
        StageBars {
            parse: bar("parse", docs),
            chunk: bar("chunk", docs),
            embed: bar("embed", 0),
            index: bar("index", docs),
            multi,
        }
    }

    /// Updates the bars for one progress event.
    pub fn update(&self, p: Progress<'_>) {
        match p {
            Progress::Parsed { .. } => self.parse.inc(1),
            Progress::Chunked { chunks, .. } => {
                self.chunk.inc(1);
                self.embed.inc_length(chunks as u64);
            }
            Progress::Embedded { chunks } => self.embed.inc(chunks as u64),
            Progress::Indexed { docs, .. } => self.index.inc(docs as u64),
            Progress::Failed { name, reason } => {
                let _ = self.multi.println(format!("failed: {name}: {reason}"));
            }
        }
    }

    pub fn finish(&self) {
        for b in [&self.parse, &self.chunk, &self.embed, &self.index] {
            b.finish();
        }
    }
}

pub fn ingest(a: IngestArgs) -> Result<()> {
    let files = collect_files(&a.paths)?;
    if files.is_empty() {
        bail!("no files found under the given paths");
    }
    let mut kb = a.kb.open()?;
    kb.ensure_collection(&a.collection, a.chunking.config())?;
    let bars = StageBars::new(files.len() as u64);
    let meta: BTreeMap<String, String> = a.meta.iter().cloned().collect();
    let mut unreadable = Vec::new();
    let docs = files
        .iter()
        .filter_map(|(path, name)| match std::fs::read(path) {
            Ok(bytes) => Some(NewDocument {
                name: name.clone(),
                bytes,
                metadata: meta.clone(),
            }),
            Err(e) => {
                unreadable.push((name.clone(), format!("cannot read {}: {e}", path.display())));
                None
            }
        });
    let report = kb.ingest(&a.collection, docs, &mut |p| bars.update(p))?;
    bars.finish();
    let kv = if a.kv {
        Some(kv_stage(&mut kb, &a, &report)?)
    } else {
        None
    };
    if a.json {
        let mut json = report_json(&report, &unreadable);
        if let Some((computed, present, secs)) = kv {
            json["kv"] = serde_json::json!({"computed": computed, "already_stored": present, "elapsed_s": secs});
        }
        println!("{json}");
    }
    print_summary(&a.collection, &report, &unreadable);
    if let Some((computed, present, secs)) = kv {
        eprintln!(
            "chunk KV: {computed} computed and stored, {present} already stored ({secs:.1} s)"
        );
    }
    let failed = report.failures().count() + unreadable.len();
    if failed > 0 {
        bail!("{failed} of {} documents failed", files.len());
    }
    Ok(())
}

/// The chunk KV stage: every chunk of the documents just ingested (or found unchanged) gets its
/// KV computed and stored unless a tier holds it. Returns (computed, present, seconds).
fn kv_stage(
    kb: &mut KnowledgeBase,
    a: &IngestArgs,
    report: &IngestReport,
) -> Result<(usize, usize, f64)> {
    let started = std::time::Instant::now();
    let llm = crate::ask::Llm::load(&a.kb)?;
    let store = llm.chunk_store(a.kv_tiers.open(&a.kb.data_dir())?, a.kv_tiers.dtype()?)?;
    let docs: Vec<u64> = report
        .docs
        .iter()
        .filter_map(|d| match d.outcome {
            Outcome::Added { doc, .. }
            | Outcome::Replaced { doc, .. }
            | Outcome::Unchanged { doc } => Some(doc),
            Outcome::Failed { .. } => None,
        })
        .collect();
    let total: usize = docs
        .iter()
        .map(|&d| kb.chunks(d).map_or(0, |c| c.len()))
        .sum();
    let bar = ProgressBar::new(total as u64);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>10} {bar:30} {pos}/{len} chunks {elapsed}")
            .expect("valid template"),
    );
    bar.set_prefix("chunk KV");
    let (computed, present) =
        crate::ask::precompute_docs(kb, &llm, &store, &docs, |n| bar.set_position(n as u64))?;
    bar.finish_and_clear();
    Ok((computed, present, started.elapsed().as_secs_f64()))
}

fn report_json(r: &IngestReport, unreadable: &[(String, String)]) -> serde_json::Value {
    let mut docs: Vec<serde_json::Value> = r
        .docs
        .iter()
        .map(|d| match &d.outcome {
            Outcome::Added { doc, chunks } => {
                serde_json::json!({"name": d.name, "outcome": "added", "doc_id": doc, "chunks": chunks})
            }
            Outcome::Replaced { doc, chunks, old } => serde_json::json!({"name": d.name, "outcome": "replaced", "doc_id": doc, "chunks": chunks, "old_doc_id": old}),
            Outcome::Unchanged { doc } => {
                serde_json::json!({"name": d.name, "outcome": "unchanged", "doc_id": doc})
            }
            Outcome::Failed { reason } => {
                serde_json::json!({"name": d.name, "outcome": "failed", "reason": reason})
            }
        })
        .collect();
    docs.extend(unreadable.iter().map(
        |(name, reason)| serde_json::json!({"name": name, "outcome": "failed", "reason": reason}),
    ));
    serde_json::json!({
        "job_id": r.job,
        "documents": docs,
        "chunks": r.chunks,
        "elapsed_s": r.elapsed.as_secs_f64(),
    })
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

fn print_summary(collection: &str, r: &IngestReport, unreadable: &[(String, String)]) {
    let count = |f: fn(&Outcome) -> bool| r.docs.iter().filter(|d| f(&d.outcome)).count();
    let added = count(|o| matches!(o, Outcome::Added { .. }));
    let replaced = count(|o| matches!(o, Outcome::Replaced { .. }));
    let unchanged = count(|o| matches!(o, Outcome::Unchanged { .. }));
    let failed = count(|o| matches!(o, Outcome::Failed { .. })) + unreadable.len();
    let t = &r.times;
    eprintln!(
        "`{collection}`: {added} added, {replaced} replaced, {unchanged} unchanged, {failed} failed; {} chunks in {} ({:.0} chunks/s; parse {}, chunk {}, embed {}, index {})",
        r.chunks,
        secs(r.elapsed),
        r.chunks as f64 / r.elapsed.as_secs_f64().max(1e-9),
        secs(t.parse),
        secs(t.chunk),
        secs(t.embed),
        secs(t.index),
    );
    if failed > 0 {
        eprintln!("failed:");
        for (name, reason) in r
            .failures()
            .chain(unreadable.iter().map(|(n, r)| (n.as_str(), r.as_str())))
        {
            eprintln!("  {name}: {reason}");
        }
    }
}

pub fn search(a: SearchArgs) -> Result<()> {
    let kb = a.kb.open()?;
    let mut req = match a.fusion {
        FusionArg::Weighted => SearchRequest::new(&a.collection, &a.query),
        FusionArg::Rrf => SearchRequest::new(&a.collection, &a.query).rrf(),
    };
    req.mode = a.mode.into();
    req.k = a.k;
    req.metadata = a.filter.clone();
    let res = kb.search(&req)?;
    if a.json {
        println!("{}", results_json(&req, &res));
    } else {
        print_results(&res);
    }
    Ok(())
}

fn results_json(req: &SearchRequest, res: &SearchResults) -> serde_json::Value {
    let hits: Vec<serde_json::Value> = res
        .hits
        .iter()
        .map(|h| {
            serde_json::json!({
                "chunk_id": h.chunk_id,
                "doc_id": h.doc_id,
                "doc_name": h.doc_name,
                "doc_title": h.doc_title,
                "ordinal": h.ordinal,
                "bytes": [h.bytes.start, h.bytes.end],
                "chars": [h.chars.start, h.chars.end],
                "page": h.page,
                "score": h.score,
                "bm25": h.bm25,
                "dense": h.dense,
                "text": h.text,
                "highlights": h.highlights.iter().map(|r| [r.start, r.end]).collect::<Vec<_>>(),
            })
        })
        .collect();
    serde_json::json!({
        "query": req.query,
        "collection": req.collection,
        "mode": req.mode.name(),
        "blind_share": res.signal.blind_share,
        "dense_weight": res.dense_weight,
        "hits": hits,
    })
}

/// `text` with highlighted ranges wrapped in `[` `]`, cut to about `max` chars.
fn excerpt(text: &str, highlights: &[std::ops::Range<usize>], max: usize) -> String {
    let mut out = String::new();
    let mut at = 0;
    for r in highlights {
        if r.start < at || r.end > text.len() {
            continue;
        }
        out.push_str(&text[at..r.start]);
        out.push('[');
        out.push_str(&text[r.clone()]);
        out.push(']');
        at = r.end;
    }
    out.push_str(&text[at..]);
    let flat: String = out.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() > max {
        let cut: String = flat.chars().take(max).collect();
        format!("{cut}...")
    } else {
        flat
    }
}

fn print_results(res: &SearchResults) {
    if res.hits.is_empty() {
        println!("no hits");
    }
    for (i, h) in res.hits.iter().enumerate() {
        let page = h.page.map_or_else(String::new, |p| format!(" p.{p}"));
        let opt = |s: Option<f32>| s.map_or_else(|| "-".to_owned(), |s| format!("{s:.3}"));
        println!(
            "{:>2}. {:.4}  {} #{}{}  bytes {}..{}  (bm25 {}, dense {})",
            i + 1,
            h.score,
            h.doc_name,
            h.ordinal,
            page,
            h.bytes.start,
            h.bytes.end,
            opt(h.bm25),
            opt(h.dense)
        );
        println!("    {}", excerpt(&h.text, &h.highlights, 240));
    }
    if res.dense_weight == 0.0 && res.signal.blind_share > 0.0 {
        eprintln!(
            "(dense side skipped: {:.0}% of the query's word pieces mean nothing to the embedder)",
            res.signal.blind_share * 100.0
        );
    }
}

pub fn docs(a: DocsArgs) -> Result<()> {
    match a.command {
        DocsCommand::List {
            collection,
            json,
            kb,
        } => {
            let kb = kb.open()?;
            let docs = kb.documents(&collection)?;
            if json {
                println!("{}", serde_json::to_string(&docs_json(&docs))?);
            } else {
                println!(
                    "{:>8}  {:<9} {:>6} {:>10}  name",
                    "id", "stage", "chunks", "bytes"
                );
                for d in &docs {
                    println!(
                        "{:>8}  {:<9} {:>6} {:>10}  {}{}",
                        d.id,
                        d.stage.name(),
                        d.chunks,
                        d.size,
                        d.name,
                        d.error
                            .as_ref()
                            .map_or_else(String::new, |e| format!("  ({e})"))
                    );
                }
            }
        }
        DocsCommand::Delete {
            docs,
            collection,
            kb,
        } => {
            let mut kb = kb.open()?;
            for d in docs {
                let doc = kb.delete_document(&collection, &d)?;
                eprintln!("deleted {} ({}, {} chunks)", doc.name, doc.id, doc.chunks);
            }
        }
    }
    Ok(())
}

fn docs_json(docs: &[Document]) -> serde_json::Value {
    serde_json::Value::Array(
        docs.iter()
            .map(|d| {
                serde_json::json!({
                    "id": d.id,
                    "name": d.name,
                    "hash": d.hash,
                    "size": d.size,
                    "format": d.format,
                    "title": d.title,
                    "chunks": d.chunks,
                    "metadata": d.metadata,
                    "stage": d.stage.name(),
                    "stages": d.stages.iter().map(|s| serde_json::json!({"stage": s.stage.name(), "at_ms": s.at_ms})).collect::<Vec<_>>(),
                    "error": d.error,
                })
            })
            .collect(),
    )
}

fn collection_json(c: &Collection) -> serde_json::Value {
    serde_json::json!({
        "id": c.id,
        "name": c.name,
        "chunk_tokens": c.chunking.max_tokens,
        "overlap_tokens": c.chunking.overlap_tokens,
        "embed_model": c.embed_model,
        "dim": c.dim,
        "documents": c.documents,
        "chunks": c.chunks,
    })
}

pub fn collections(a: CollectionsArgs) -> Result<()> {
    match a.command {
        CollectionsCommand::List { json, kb } => {
            let kb = kb.open()?;
            let colls = kb.collections()?;
            if json {
                let v: Vec<_> = colls.iter().map(collection_json).collect();
                println!("{}", serde_json::Value::Array(v));
            } else {
                for c in &colls {
                    println!(
                        "{}  {} documents, {} chunks ({} tokens, overlap {}; {})",
                        c.name,
                        c.documents,
                        c.chunks,
                        c.chunking.max_tokens,
                        c.chunking.overlap_tokens,
                        c.embed_model
                    );
                }
            }
        }
        CollectionsCommand::Create { name, chunking, kb } => {
            let mut kb = kb.open()?;
            let c = kb.create_collection(&name, chunking.config())?;
            eprintln!("created `{}` ({})", c.name, c.embed_model);
        }
        CollectionsCommand::Delete { name, kb } => {
            let mut kb = kb.open()?;
            kb.delete_collection(&name)?;
            eprintln!("deleted `{name}`");
        }
    }
    Ok(())
}
