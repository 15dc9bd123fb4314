//! `engram eval qa`: end-to-end question answering over a collection built from a QA set's
//! paragraphs (XQuAD, CMRC2018 in `../shared/data/qa-eval`): hybrid retrieval, the RAG prompt,
//! fused prefill and greedy decoding, scored against the gold answers (SQuAD's F1 and exact
//! match; by character for Chinese, as CMRC2018's evaluation does). Retrieval recall@k is
//! reported separately, so a passage never retrieved is not blamed on generation.
//!
//! With `--peer URL` the same retrieved passages also go to an OpenAI-compatible server
//! (`llama-server` on the same GGUF, see `bench/qa-vs-llamacpp.sh`) in the RAG prompt
//! LangChain's default RAG chain uses, greedy, scored the same way in the same run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use engram_fusion::{Layout, Policy, DEFAULT_LAYOUT, DEFAULT_POLICY, DEFAULT_SYSTEM};
use engram_kb::{NewDocument, SearchRequest};
use engram_kvstore::{DramTier, KvDtype, KvStore};
use engram_rag::{no_answer, not_answered, rag_prompt_with, DEFAULT_COPY_BIAS};
use serde::Deserialize;

use crate::ask::Llm;
use crate::fusion_eval::{mean, quantile};
use crate::kb::{ChunkArgs, KbArgs, StageBars};

#[derive(Args)]
pub struct QaArgs {
    /// The QA set: `xquad-en`, `xquad-zh` or `cmrc2018`, under --root.
    #[arg(long)]
    set: String,
    /// Folder of the QA sets.
    #[arg(long, default_value = "../shared/data/qa-eval")]
    root: PathBuf,
    /// Questions evaluated, spread evenly over the set (every question of the set when 0).
    #[arg(long, default_value_t = 150)]
    limit: usize,
    /// Chunks retrieved into the prompt.
    #[arg(long, default_value_t = 5)]
    k: usize,
    /// Fusion policy: full, reuse, boundary:N or deviation:R.
    #[arg(long, default_value_t = DEFAULT_POLICY.name())]
    policy: String,
    /// Prompt layouts to compare, comma-separated (the default layout first); see
    /// `engram_fusion::LAYOUTS`.
    #[arg(long, default_value = DEFAULT_LAYOUT.name)]
    layouts: String,
    /// Copy biases to compare, comma-separated (the default first; 0 = off): each layout is
    /// answered once per bias, on the same passages. See `engram_rag::CopyBias`.
    #[arg(long, default_value_t = DEFAULT_COPY_BIAS.to_string())]
    copy_bias: String,
    /// Whether the copy bias also favours the numbers the evidence sentence states, where the
    /// answer is not inside a number, comma-separated to compare (`on`, `off`; the first is
    /// compared against). See `engram_rag::CopyBias`.
    #[arg(long, default_value = "on")]
    evidence_numbers: String,
    /// Whether an answer that starts with what the evidence sentence does not support (a number
    /// it does not state, a bare yes or no) is replaced by the sentence, comma-separated to
    /// compare (`on`, `off`; the first is compared against). See
    /// `engram_rag::OutputText::or_sentence`.
    #[arg(long, default_value = "on")]
    start_check: String,
    /// Answer rules turned off for every answer, comma-separated by name
    /// (`engram_rag::AnswerRule`); each variant's report counts the rules that changed
    /// answers (`answer_rules`).
    #[arg(long, default_value = "")]
    rules_off: String,
    /// Measure each answer rule: wherever a rule changed the first system's answer, the answer
    /// is generated again with that rule off and scored. Reports each rule's F1 with it on
    /// minus off over all questions (0 where it changed nothing: a rule that does not fire
    /// leaves the answer as it is), with a paired bootstrap 95 % interval (`rule_ablation`).
    #[arg(long)]
    rule_ablation: bool,
    /// How the evidence sentence is chosen, comma-separated (the first is compared against):
    /// `embed` as engramd chooses it (`engram_rag::evidence_to_embed`), `terms` by the
    /// question's terms alone. A question whose picks give the same prompt is answered once.
    #[arg(long, default_value = "embed")]
    evidence_picks: String,
    /// Which half of the evenly spread questions: `a` or `b` take every other one of 2 x
    /// --limit (two disjoint sets, one to tune on and one to check on); `all` the --limit.
    #[arg(long, default_value = "all")]
    half: String,
    /// Most tokens generated per answer.
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// An OpenAI-compatible server (e.g. `http://127.0.0.1:8090`) answering the same
    /// passages in LangChain's default RAG prompt, scored the same way.
    #[arg(long)]
    peer: Option<String>,
    /// Also ask the first --limit queries of this BEIR `queries.jsonl` (e.g. SciFact's, against
    /// a Wikipedia set): questions nothing in the collection answers, for the share answered
    /// "I don't know" and the relevance floor's calibration.
    #[arg(long)]
    off_topic: Option<PathBuf>,
    /// Generate nothing: measure how often the evidence sentence holds a gold answer, chosen by
    /// the question's terms alone (the prompt's) and with the embedder's help (see
    /// [`EvidencePicks`]), over the questions whose gold paragraph was retrieved.
    #[arg(long)]
    evidence: bool,
    /// Print every question with its answers.
    #[arg(long)]
    verbose: bool,
    /// Print the results as one JSON object.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    chunking: ChunkArgs,
    #[command(flatten)]
    kb: KbArgs,
}

#[derive(Deserialize)]
struct QaItem {
    id: String,
    question: String,
    answers: Vec<String>,
    context_id: String,
}

/// The files of a set: (questions, paragraphs, scored as Chinese).
pub(crate) fn set_files(root: &Path, set: &str) -> Result<(PathBuf, PathBuf, bool)> {
    Ok(match set {
        "xquad-en" => (
            root.join("xquad/qa.en.jsonl"),
            root.join("xquad/contexts.en.jsonl"),
            false,
        ),
        "xquad-zh" => (
            root.join("xquad/qa.zh.jsonl"),
            root.join("xquad/contexts.zh.jsonl"),
            true,
        ),
        "cmrc2018" => (
            root.join("cmrc2018-dev-subset/qa.jsonl"),
            root.join("cmrc2018-dev-subset/contexts.jsonl"),
            true,
        ),
        other => bail!("unknown QA set `{other}` (xquad-en, xquad-zh or cmrc2018)"),
    })
}

/// One way of answering that `eval qa` compares.
struct System {
    /// Index into the question's prompts (per layout, per evidence pick).
    prompt: usize,
    /// The copy bias.
    bias: f32,
    /// Whether the bias favours the evidence sentence's numbers.
    numbers: bool,
    /// Whether a start the evidence sentence does not support makes the answer the sentence
    /// (`OutputText::check_start`).
    check: bool,
    name: String,
}

/// Scores of one system on one question.
#[derive(Clone, Copy, Default)]
struct Score {
    f1: f64,
    em: f64,
}

#[derive(Default)]
struct Tally {
    f1: Vec<f64>,
    em: Vec<f64>,
    /// Retrieval to first token (Engram), retrieval to whole answer (the peer).
    ttft_ms: Vec<f64>,
    /// Answers the model wrote nothing of: empty, Engram's `not_answered`, or the evidence
    /// sentence in its place.
    empty: usize,
    /// Per question, the F1 the evidence sentence scored where it was the answer (the model
    /// wrote none, `OutputText::or_sentence`), else 0: what the sentence adds.
    sentence_f1: Vec<f64>,
    /// Answers that are the evidence sentence.
    sentences: usize,
    /// Answers each answer rule changed (of those generated; a repeated prompt's answer is
    /// counted once).
    rules: BTreeMap<&'static str, usize>,
}

impl Tally {
    /// `sentence`: the answer is the evidence sentence, the model wrote none.
    fn add(&mut self, s: Score, ttft_ms: f64, empty: bool, sentence: bool) {
        self.f1.push(s.f1);
        self.em.push(s.em);
        self.ttft_ms.push(ttft_ms);
        self.empty += usize::from(empty || sentence);
        self.sentence_f1.push(if sentence { s.f1 } else { 0.0 });
        self.sentences += usize::from(sentence);
    }

    /// `time`: what the times are (`ttft_ms_mean` for Engram, `answer_ms_mean` for the peer,
    /// which is asked without streaming).
    fn json(&self, time: &str) -> serde_json::Value {
        serde_json::json!({
            "f1": mean(&self.f1),
            "em": mean(&self.em),
            time: mean(&self.ttft_ms),
            "empty_answers": self.empty,
            "sentence_answers": self.sentences,
            "answer_rules": self.rules,
            "sentence_f1_gain": mean(&self.sentence_f1),
            "sentence_f1_gain_ci95": crate::fusion_eval::bootstrap_ci95(&self.sentence_f1),
        })
    }
}

/// LangChain's default RAG prompt (the `rlm/rag-prompt` hub prompt its RAG tutorials use),
/// as one user message.
fn langchain_prompt(question: &str, passages: &[String]) -> String {
    format!(
        "You are an assistant for question-answering tasks. Use the following pieces of retrieved context to answer the question. If you don't know the answer, just say that you don't know. Use three sentences maximum and keep the answer concise.\nQuestion: {question} \nContext: {} \nAnswer:",
        passages.join("\n\n")
    )
}

/// Asks the peer, greedy, for at most `max_tokens`: one HTTP/1.1 POST of its
/// `/v1/chat/completions` (a server on this machine or network, plain HTTP).
fn ask_peer(url: &str, prompt: &str, max_tokens: usize) -> Result<(String, f64)> {
    use std::io::{Read, Write};
    let t = Instant::now();
    let host = url
        .strip_prefix("http://")
        .context("--peer must be an http:// URL")?
        .trim_end_matches('/');
    let body = serde_json::json!({
        "model": "peer",
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0.0,
        "max_tokens": max_tokens,
    })
    .to_string();
    let mut conn = std::net::TcpStream::connect(host)
        .with_context(|| format!("connecting to the peer at {url}"))?;
    conn.set_read_timeout(Some(std::time::Duration::from_secs(300)))?;
    write!(
        conn,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw)
        .context("reading the peer's reply")?;
    let raw = String::from_utf8_lossy(&raw);
    let (head, payload) = raw
        .split_once("\r\n\r\n")
        .context("the peer's reply has no HTTP header")?;
    if !head.starts_with("HTTP/1.1 200") {
        bail!("the peer answered {}", head.lines().next().unwrap_or(""));
    }
    let payload = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(payload)?
    } else {
        payload.to_owned()
    };
    let reply: serde_json::Value =
        serde_json::from_str(&payload).context("the peer's reply is not JSON")?;
    let text = reply["choices"][0]["message"]["content"]
        .as_str()
        .context("the peer's reply has no choices[0].message.content")?
        .to_owned();
    Ok((text, t.elapsed().as_secs_f64() * 1e3))
}

/// The body of a chunked HTTP/1.1 reply.
fn dechunk(mut s: &str) -> Result<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = s
            .split_once("\r\n")
            .context("a bad chunk in the peer's reply")?;
        let n = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)
            .context("a bad chunk size in the peer's reply")?;
        if n == 0 {
            return Ok(out);
        }
        out.push_str(rest.get(..n).context("a short chunk in the peer's reply")?);
        s = rest[n..].trim_start_matches("\r\n");
    }
}

/// A comma-separated list of `yes` and `no` (the values of option `flag`) as booleans.
fn two_way(list: &str, flag: &str, yes: &str, no: &str) -> Result<Vec<bool>> {
    list.split(',')
        .map(|v| match v.trim() {
            v if v == yes => Ok(true),
            v if v == no => Ok(false),
            other => bail!("{flag} takes `{yes}` and `{no}`, not `{other}`"),
        })
        .collect()
}

pub fn run(a: QaArgs) -> Result<()> {
    let (qa_path, ctx_path, chinese) = set_files(&a.root, &a.set)?;
    let mut items: Vec<QaItem> = crate::eval::read_jsonl(&qa_path)?;
    let paragraphs: Vec<crate::eval::CorpusDoc> = crate::eval::read_jsonl(&ctx_path)?;
    let (spread, keep) = match a.half.as_str() {
        "all" => (a.limit, None),
        "a" => (a.limit * 2, Some(0)),
        "b" => (a.limit * 2, Some(1)),
        other => bail!("--half is `a`, `b` or `all`, not `{other}`"),
    };
    if a.limit > 0 && items.len() > spread {
        // Evenly spread: the sets list questions article by article.
        let n = items.len();
        items = items
            .into_iter()
            .enumerate()
            .filter(|(i, _)| (i * spread) % n < spread)
            .map(|(_, q)| q)
            .take(spread)
            .collect();
    }
    if let Some(half) = keep {
        items = items
            .into_iter()
            .enumerate()
            .filter(|(i, _)| i % 2 == half)
            .map(|(_, q)| q)
            .collect();
    }
    if items.is_empty() {
        bail!("{}: no questions", qa_path.display());
    }
    let layouts: Vec<Layout> = a
        .layouts
        .split(',')
        .map(|n| {
            Layout::named(n.trim()).with_context(|| {
                format!(
                    "unknown layout `{n}` (one of {})",
                    engram_fusion::LAYOUTS
                        .iter()
                        .map(|l| l.name)
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })
        })
        .collect::<Result<_>>()?;
    let policy: Policy = a.policy.parse()?;
    let biases: Vec<f32> = a
        .copy_bias
        .split(',')
        .map(|b| {
            b.trim()
                .parse::<f32>()
                .ok()
                .filter(|b| b.is_finite() && *b >= 0.0)
                .with_context(|| format!("--copy-bias `{b}` is not a number >= 0"))
        })
        .collect::<Result<_>>()?;
    let picks = two_way(&a.evidence_picks, "--evidence-picks", "embed", "terms")?;
    let numbers = two_way(&a.evidence_numbers, "--evidence-numbers", "on", "off")?;
    let checks = two_way(&a.start_check, "--start-check", "on", "off")?;
    let rules_off = crate::ask::parse_rules_off(&a.rules_off)?;
    // Every layout with every bias, evidence pick, number setting and start check, named by
    // the layout alone when one of each is compared.
    let mut systems: Vec<System> = Vec::new();
    for (li, l) in layouts.iter().enumerate() {
        for (pi, embed) in picks.iter().enumerate() {
            for &b in &biases {
                for &n in &numbers {
                    for &check in &checks {
                        let mut name = format!("engram:{}", l.name);
                        if biases.len() > 1 {
                            name.push_str(&format!("/copy={b}"));
                        }
                        if picks.len() > 1 {
                            name.push_str(if *embed { "/ev=embed" } else { "/ev=terms" });
                        }
                        if numbers.len() > 1 {
                            name.push_str(if n { "/numbers=on" } else { "/numbers=off" });
                        }
                        if checks.len() > 1 {
                            name.push_str(if check { "/check=on" } else { "/check=off" });
                        }
                        systems.push(System {
                            prompt: li * picks.len() + pi,
                            bias: b,
                            numbers: n,
                            check,
                            name,
                        });
                    }
                }
            }
        }
    }

    let mut kb_args = a.kb.clone();
    let _temp = if kb_args.data_dir.is_none() {
        let dir = std::env::temp_dir().join(format!("engram-eval-qa-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        kb_args.data_dir = Some(dir.clone());
        Some(crate::eval::TempDir(dir))
    } else {
        None
    };
    let mut kb = kb_args.open()?;
    let collection = format!("qa-{}", a.set);
    kb.ensure_collection(&collection, a.chunking.config())?;
    let t = Instant::now();
    let bars = StageBars::new(paragraphs.len() as u64);
    let docs = paragraphs
        .iter()
        .map(|p| NewDocument::new(format!("{}.txt", p.id), p.text.clone()));
    let report = kb.ingest(&collection, docs, &mut |p| bars.update(p))?;
    bars.finish();
    if let Some((name, e)) = report.failures().next() {
        bail!("paragraph {name} failed to ingest: {e}");
    }
    eprintln!(
        "{} paragraphs ingested in {:.1} s ({} titles unused)",
        paragraphs.len(),
        t.elapsed().as_secs_f64(),
        paragraphs.iter().filter(|p| !p.title.is_empty()).count()
    );

    let llm = Llm::load(&kb_args)?;
    // The chunk KV lives in DRAM for the run: computed at its first use, reused after, in the
    // first layout's frame (the others' first chunks are exact only where their prefix is the
    // same).
    let store = llm.chunk_store_for(
        layouts[0],
        KvStore::new(Some(DramTier::new(4 << 30)), None),
        KvDtype::F16,
    )?;

    let mut tallies: Vec<Tally> = systems.iter().map(|_| Tally::default()).collect();
    // `--rule-ablation`: per rule, (the question's place in the first tally, F1 with the rule,
    // F1 without it) where it changed the first system's answer.
    let mut ablation: BTreeMap<&'static str, Vec<(usize, f64, f64)>> = BTreeMap::new();
    let mut peer = Tally::default();
    let (mut recalled, mut skipped, mut refused) = (0usize, 0usize, 0usize);
    let mut best_dense = Vec::new();
    let mut best_coverage = Vec::new();
    let mut best_terms = Vec::new();
    // Per question, the best sentence's cosine when the first look refused it (English only).
    let mut best_sentence: Vec<Option<f32>> = Vec::new();
    let mut first_look: Vec<bool> = Vec::new();
    let mut evidence = EvidencePicks::default();
    let started = Instant::now();
    for (qi, item) in items.iter().enumerate() {
        let t = Instant::now();
        let mut req = SearchRequest::new(&collection, &item.question);
        req.k = a.k;
        let hits = kb.search(&req)?.hits;
        let retrieve_ms = t.elapsed().as_secs_f64() * 1e3;
        let hit_gold = hits
            .iter()
            .any(|h| h.doc_name.strip_suffix(".txt") == Some(item.context_id.as_str()));
        recalled += usize::from(hit_gold);
        let best = hits.iter().filter_map(|h| h.dense).reduce(f32::max);
        best_dense.push(best.unwrap_or(0.0) as f64);
        let texts = || hits.iter().map(|h| h.text.as_str());
        best_coverage.push(engram_rag::best_coverage(&item.question, texts()));
        best_terms.push(engram_rag::best_term_coverage(&item.question, texts()));
        // As engramd (`engram_rag::ground`): the relevance floors, a passage that mostly
        // repeats a better-ranked one left out (the peer gets the same passages), and the
        // embedder's evidence sentence.
        let g = engram_rag::ground(kb.models(), &item.question, hits)?;
        best_sentence.push(g.best_sentence);
        first_look.push(g.first_look);
        let grounded = !g.refused();
        refused += usize::from(!grounded);
        let passages: Vec<String> = g.hits.into_iter().map(|h| h.text).collect();
        if a.evidence {
            if hit_gold && grounded {
                let line = evidence.add(
                    kb.models(),
                    &item.question,
                    &passages,
                    &item.answers,
                    layouts[0].evidence_max_chars,
                )?;
                if a.verbose {
                    eprintln!("[{}/{}] {}\n{line}", qi + 1, items.len(), item.question);
                }
            }
            continue;
        }
        let chosen = g.evidence;
        // Per layout, per pick.
        let mut prompts = Vec::new();
        for l in &layouts {
            for embed in &picks {
                let e = if *embed { chosen.as_deref() } else { None };
                prompts.push(rag_prompt_with(
                    *l,
                    &llm.tokenizer,
                    llm.template.as_ref(),
                    DEFAULT_SYSTEM,
                    &passages,
                    &item.question,
                    e,
                )?);
            }
        }
        let context = llm.model.config().context_length;
        if grounded && prompts.iter().any(|p| p.len() + a.max_tokens >= context) {
            skipped += 1;
            continue;
        }
        if grounded {
            // As after ingestion: the chunks' KV is stored before the question (not part of
            // TTFT). Every layout holds the same chunks.
            for c in &prompts[0].chunks {
                store.ensure(&llm.model, c)?;
            }
        }
        let mut line = vec![format!(
            "[{}/{}] {} {} | gold {:?} | retrieved gold: {hit_gold}",
            qi + 1,
            items.len(),
            item.id,
            item.question,
            item.answers.first().map(String::as_str).unwrap_or("")
        )];
        // This question's answers so far: (prompt, bias, start check, the evidence's span the
        // bias read, score, TTFT, empty, sentence, answer).
        type Answered = (
            usize,
            f32,
            bool,
            std::ops::Range<usize>,
            Score,
            f64,
            bool,
            bool,
            String,
        );
        let mut answered: Vec<Answered> = Vec::new();
        for (si, (system, tally)) in systems.iter().zip(tallies.iter_mut()).enumerate() {
            let System {
                prompt: layout,
                bias,
                numbers,
                check,
                name,
            } = system;
            // Without the evidence's numbers: the same tokens, no span for the bias to read.
            let unnumbered;
            let prompt = if *numbers {
                &prompts[*layout]
            } else {
                unnumbered = engram_fusion::FusedPrompt {
                    evidence: 0..0,
                    ..prompts[*layout].clone()
                };
                &unnumbered
            };
            if !grounded {
                // A refusal is scored as no answer (its words are not an answer's).
                let answer = no_answer(&item.question);
                tally.add(
                    best_score("", &item.answers, chinese),
                    retrieve_ms,
                    false,
                    false,
                );
                line.push(format!("  {name}: {answer:?}"));
                continue;
            }
            // The same prompt with the same bias and check gives the same greedy answer.
            let same = answered.iter().find(|(p, b, c, e, ..)| {
                *b == *bias
                    && *c == *check
                    && *e == prompt.evidence
                    && prompts[*p].tokens() == prompt.tokens()
            });
            if let Some((_, _, _, _, score, ms, none, sentence, answer)) = same {
                tally.add(*score, *ms, *none, *sentence);
                line.push(format!(
                    "  {name} (f1 {:.2}, same prompt): {answer:?}",
                    score.f1
                ));
                continue;
            }
            // This prompt's greedy answer with the rules in `off` off, scored: nothing of the
            // model's is scored as no answer; the evidence sentence in its place is scored (and
            // counted apart).
            let answer_with = |off| -> Result<_> {
                let g = engram_rag::generate(
                    &llm.model,
                    &llm.tokenizer,
                    &store,
                    prompt,
                    &item.question,
                    &passages,
                    policy,
                    a.max_tokens,
                    0.0,
                    engram_rag::AnswerOptions {
                        copy_bias: *bias,
                        check_start: *check,
                        rules_off: off,
                    },
                    &mut |_| {},
                )?;
                let answer = g.text.trim().to_owned();
                let none = answer.is_empty() || answer == not_answered(&item.question);
                let score = best_score(if none { "" } else { &answer }, &item.answers, chinese);
                Ok((g, answer, none, score))
            };
            let (g, answer, none, score) = answer_with(rules_off)?;
            for rule in g.rules.iter() {
                *tally.rules.entry(rule.name()).or_default() += 1;
            }
            let ms = retrieve_ms + g.first_token.as_secs_f64() * 1e3;
            tally.add(score, ms, none, g.fell_back);
            if si == 0 && a.rule_ablation {
                // The same answer with each rule that changed it turned off.
                let at = tally.f1.len() - 1;
                for rule in g.rules.iter() {
                    let mut off = rules_off;
                    off.insert(rule);
                    let (_, answer, _, without) = answer_with(off)?;
                    line.push(format!(
                        "    without {} (f1 {:.2}): {answer:?}",
                        rule.name(),
                        without.f1
                    ));
                    ablation
                        .entry(rule.name())
                        .or_default()
                        .push((at, score.f1, without.f1));
                }
            }
            let from = if g.fell_back {
                ", the evidence sentence"
            } else {
                ""
            };
            line.push(format!("  {name} (f1 {:.2}{from}): {answer:?}", score.f1));
            answered.push((
                *layout,
                *bias,
                *check,
                prompt.evidence.clone(),
                score,
                ms,
                none,
                g.fell_back,
                answer,
            ));
        }
        if let Some(url) = &a.peer {
            let (text, ms) = ask_peer(
                url,
                &langchain_prompt(&item.question, &passages),
                a.max_tokens,
            )?;
            let answer = text.trim().to_owned();
            let score = best_score(&answer, &item.answers, chinese);
            peer.add(score, retrieve_ms + ms, answer.is_empty(), false);
            line.push(format!("  peer (f1 {:.2}): {answer:?}", score.f1));
        }
        if a.verbose {
            eprintln!("{}", line.join("\n"));
        }
    }
    let n = items.len() - skipped;
    let recall = recalled as f64 / items.len() as f64;
    if a.evidence {
        let out = evidence.json();
        if a.json {
            println!("{out}");
        } else {
            println!(
                "{}: {} questions whose gold paragraph was retrieved (recall@{} {recall:.3})",
                a.set, evidence.questions, a.k
            );
            println!("{:<16} {:>8} {:>8}", "evidence", "holds", "changed");
            for (name, held, changed) in evidence.rows() {
                println!("{name:<16} {held:>8.3} {changed:>8}");
            }
        }
        return Ok(());
    }
    let off_topic = match &a.off_topic {
        Some(path) => Some(off_topic(&kb, &collection, path, a.limit.max(1))?),
        None => None,
    };
    let systems_run = systems;
    // Each system's tally, with its F1 against the first system's, paired.
    let with_delta = |tally: &Tally, time: &str| {
        let mut v = tally.json(time);
        if let Some((delta, ci)) = f1_vs_first(tally, &tallies[0]) {
            v["f1_delta_vs_first"] = delta.into();
            v["f1_delta_ci95"] = serde_json::json!(ci);
        }
        v
    };
    let mut systems = serde_json::Map::new();
    for (system, tally) in systems_run.iter().zip(&tallies) {
        systems.insert(system.name.clone(), with_delta(tally, "ttft_ms_mean"));
    }
    if a.peer.is_some() {
        systems.insert("peer".into(), with_delta(&peer, "answer_ms_mean"));
    }
    let out = serde_json::json!({
        "set": a.set,
        "questions": n,
        "skipped_too_long": skipped,
        "k": a.k,
        "policy": policy.name(),
        format!("recall@{}", a.k): recall,
        "systems": systems,
        "refused_as_irrelevant": refused,
        "best_dense": percentiles(&best_dense),
        "best_coverage": percentiles(&best_coverage),
        "best_term_coverage": percentiles(&best_terms),
        "off_topic": off_topic.as_ref().map(|o| serde_json::json!({
            "questions": o.asked,
            "refused": o.refused,
            "best_dense": percentiles(&o.dense),
            "best_coverage": percentiles(&o.coverage),
            "best_term_coverage": percentiles(&o.terms),
        })),
        "rule_ablation": a.rule_ablation.then(|| rule_ablation(&ablation, tallies[0].f1.len())),
        "elapsed_s": started.elapsed().as_secs_f64(),
    });
    if a.json {
        println!("{out}");
        return Ok(());
    }
    println!(
        "{} ({n} questions, {skipped} skipped as too long; policy {}; top {})",
        a.set,
        policy.name(),
        a.k
    );
    println!("retrieval recall@{}: {recall:.3}", a.k);
    println!(
        "answered \"I don't know\" (best chunk below the relevance floor): {refused}; best \
         chunk's cosine {}, question coverage {}",
        percentiles(&best_dense),
        percentiles(&best_coverage)
    );
    if let Some(o) = &off_topic {
        println!(
            "off-topic questions answered \"I don't know\": {}/{}; best chunk's cosine {}, \
             question coverage {}",
            o.refused,
            o.asked,
            percentiles(&o.dense),
            percentiles(&o.coverage)
        );
        // What other floors would refuse, for the floors' calibration: the cosine judges
        // English questions, the coverage Chinese ones.
        let below =
            |v: &[f64], f: f64| v.iter().filter(|&&d| d < f).count() as f64 / v.len() as f64;
        for floor in [0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4] {
            println!(
                "floor {floor:.2}: cosine refuses {:.3} of the set's questions, {:.3} of the \
                 off-topic ones; coverage {:.3} and {:.3}",
                below(&best_dense, floor),
                below(&o.dense, floor),
                below(&best_coverage, floor),
                below(&o.coverage, floor)
            );
        }
        // English: the cosine floor, and the content-word pairs one chunk repeats as a second
        // way in.
        let refused = |dense: &[f64], terms: &[f64], floor: f64| {
            let n = dense
                .iter()
                .zip(terms)
                .filter(|(&d, &t)| d < f64::from(engram_rag::DENSE_FLOOR) && t < floor)
                .count();
            n as f64 / dense.len().max(1) as f64
        };
        for floor in [0.25, 0.3, 0.34, 0.5, 0.67, 1.0, f64::INFINITY] {
            println!(
                "cosine under {} and term coverage under {floor:.2}: refuses {:.3} of the set's \
                 questions, {:.3} of the off-topic ones",
                engram_rag::DENSE_FLOOR,
                refused(&best_dense, &best_terms, floor),
                refused(&o.dense, &o.terms, floor)
            );
        }
        // English: the second look at the sentences of what the first refused.
        for floor in [0.3, 0.35, 0.4, 0.45, 0.5, f32::INFINITY] {
            println!(
                "refused by the floors above and best sentence under {floor:.2}: refuses {:.3} \
                 of the set's questions, {:.3} of the off-topic ones",
                refused_at(&first_look, &best_sentence, floor),
                refused_at(&o.first, &o.sentence, floor)
            );
        }
    }
    println!(
        "{:<32} {:>6} {:>6} {:>10} {:>6} {:>9} {:>7}",
        "system", "F1", "EM", "TTFT ms", "empty", "sentence", "its F1"
    );
    let mut rows: Vec<(String, &Tally)> = systems_run
        .iter()
        .zip(&tallies)
        .map(|(system, t)| (system.name.clone(), t))
        .collect();
    if a.peer.is_some() {
        rows.push(("peer (llama.cpp)".into(), &peer));
    }
    for (name, t) in rows {
        let delta = match f1_vs_first(t, &tallies[0]) {
            Some((d, [lo, hi])) => format!("  F1 vs first {d:+.3} [{lo:+.3}, {hi:+.3}]"),
            None => String::new(),
        };
        println!(
            "{name:<32} {:>6.3} {:>6.3} {:>10.0} {:>6} {:>9} {:>+7.3}{delta}",
            mean(&t.f1),
            mean(&t.em),
            mean(&t.ttft_ms),
            t.empty,
            t.sentences,
            mean(&t.sentence_f1)
        );
    }
    if let Some(rules) = out["rule_ablation"].as_object() {
        println!(
            "\n{:<16} {:>8} {:>9} {:>9} {:>10} {:>18}",
            "answer rule", "changed", "F1 with", "without", "gain", "gain CI95"
        );
        for (name, r) in rules {
            let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
            println!(
                "{name:<16} {:>8} {:>9.3} {:>9.3} {:>+10.4} {:>18}",
                r["changed_answers"].as_u64().unwrap_or(0),
                f("f1_with_rule"),
                f("f1_without_rule"),
                f("f1_gain_all_questions"),
                format!(
                    "[{:+.4}, {:+.4}]",
                    r["f1_gain_ci95"][0].as_f64().unwrap_or(0.0),
                    r["f1_gain_ci95"][1].as_f64().unwrap_or(0.0)
                )
            );
        }
    }
    Ok(())
}

/// How often each way of choosing the evidence sentence picks one that holds a gold answer.
/// `terms` is the prompt's choice ([`engram_rag::evidence_within`]); the others let the
/// embedder choose, by cosine similarity to the question, among the sentences whose term score
/// is at least a share of the best (`ties`: equal to it; `near:S`: S of it), and `cosine` among
/// every sentence [`engram_rag::sentences_to_embed`] gives (English only).
#[derive(Default)]
struct EvidencePicks {
    questions: usize,
    /// Per way: questions its evidence held a gold answer in, and questions it chose another
    /// sentence than `terms`.
    held: [usize; EVIDENCE_WAYS.len()],
    changed: [usize; EVIDENCE_WAYS.len()],
}

/// The ways [`EvidencePicks`] compares, and their share of the best term score (`None`: every
/// sentence, by cosine alone).
const EVIDENCE_WAYS: [(&str, Option<f64>); 6] = [
    ("terms", Some(f64::INFINITY)),
    ("ties", Some(1.0)),
    ("near:0.8", Some(0.8)),
    ("near:0.6", Some(0.6)),
    ("near:0.4", Some(0.4)),
    ("cosine", None),
];

impl EvidencePicks {
    /// Scores one question's picks; gives a line for each way.
    fn add(
        &mut self,
        models: &engram_kb::Models,
        question: &str,
        passages: &[String],
        answers: &[String],
        max_chars: usize,
    ) -> Result<String> {
        let texts = || passages.iter().map(String::as_str);
        let holds = |e: &str| {
            let e = e.to_lowercase();
            answers.iter().any(|g| e.contains(&g.trim().to_lowercase()))
        };
        let first = engram_rag::evidence_within(question, texts(), max_chars);
        let mut lines = Vec::new();
        self.questions += 1;
        for (w, (name, share)) in EVIDENCE_WAYS.iter().enumerate() {
            let pick = match share {
                Some(s) if s.is_infinite() => first.clone(),
                Some(s) => {
                    let c = engram_rag::evidence_candidates(question, texts(), max_chars, *s);
                    let refs: Vec<&str> = c.iter().map(|c| c.text.as_str()).collect();
                    best_by_cosine(models, question, &refs)?
                }
                None => {
                    let all = engram_rag::sentences_to_embed(question, texts());
                    best_by_cosine(models, question, &all)?
                }
            };
            let held = pick.as_deref().is_some_and(holds);
            self.held[w] += usize::from(held);
            self.changed[w] += usize::from(pick != first);
            lines.push(format!("  {name} ({held}): {pick:?}"));
        }
        Ok(lines.join("\n"))
    }

    /// (way, share of the questions its evidence held a gold answer in, questions changed).
    fn rows(&self) -> Vec<(&'static str, f64, usize)> {
        EVIDENCE_WAYS
            .iter()
            .enumerate()
            .map(|(w, (name, _))| {
                let q = self.questions.max(1) as f64;
                (*name, self.held[w] as f64 / q, self.changed[w])
            })
            .collect()
    }

    fn json(&self) -> serde_json::Value {
        let ways: serde_json::Map<String, serde_json::Value> = self
            .rows()
            .into_iter()
            .map(|(name, held, changed)| {
                (
                    name.to_owned(),
                    serde_json::json!({"holds_gold": held, "changed": changed}),
                )
            })
            .collect();
        serde_json::json!({"questions": self.questions, "ways": ways})
    }
}

/// The one of `texts` nearest `question` by the embedder (the first of equals), `None` when
/// there are none; one text needs no embedding.
fn best_by_cosine(
    models: &engram_kb::Models,
    question: &str,
    texts: &[&str],
) -> Result<Option<String>> {
    if texts.len() <= 1 {
        return Ok(texts.first().map(|t| (*t).to_owned()));
    }
    let cosines = models.similarities(question, texts)?;
    let owned = texts.iter().map(|t| (*t).to_owned()).collect();
    Ok(engram_rag::nearest_evidence(owned, &cosines))
}

/// `--rule-ablation`'s report: per rule, the answers it changed, their F1 with it and without
/// it, and its F1 gain over all `n` questions (0 where it changed nothing) with the paired
/// bootstrap 95 % interval. A rule pays where the interval is above 0.
fn rule_ablation(
    ablation: &BTreeMap<&'static str, Vec<(usize, f64, f64)>>,
    n: usize,
) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    for rule in engram_rag::AnswerRule::ALL {
        let fired = ablation.get(rule.name()).map_or(&[][..], Vec::as_slice);
        let mut gain = vec![0.0; n];
        for &(at, on, off) in fired {
            if let Some(g) = gain.get_mut(at) {
                *g = on - off;
            }
        }
        let on: Vec<f64> = fired.iter().map(|f| f.1).collect();
        let off: Vec<f64> = fired.iter().map(|f| f.2).collect();
        out.insert(
            rule.name().into(),
            serde_json::json!({
                "changed_answers": fired.len(),
                "f1_with_rule": mean(&on),
                "f1_without_rule": mean(&off),
                "f1_gain_all_questions": mean(&gain),
                "f1_gain_ci95": crate::fusion_eval::bootstrap_ci95(&gain),
                "models": rule.models(),
            }),
        );
    }
    serde_json::Value::Object(out)
}

/// `t`'s F1 minus `first`'s, paired on the same questions: the mean and its bootstrap 95 %
/// interval; `None` for `first` itself (or a tally of other questions).
fn f1_vs_first(t: &Tally, first: &Tally) -> Option<(f64, [f64; 2])> {
    if std::ptr::eq(t, first) || t.f1.len() != first.f1.len() {
        return None;
    }
    let d: Vec<f64> = t.f1.iter().zip(&first.f1).map(|(x, y)| x - y).collect();
    Some((mean(&d), crate::fusion_eval::bootstrap_ci95(&d)))
}

/// What the relevance floors did to questions nothing in the collection answers.
struct OffTopic {
    /// Refused by the floor ([`engram_rag::relevant`]).
    refused: usize,
    asked: usize,
    /// Each question's best chunk's cosine similarity, and best [`engram_rag::best_coverage`].
    dense: Vec<f64>,
    coverage: Vec<f64>,
    /// Each question's [`engram_rag::best_term_coverage`].
    terms: Vec<f64>,
    /// Whether [`engram_rag::relevant`] answered each question, and its best sentence cosine when it did
    /// not (see [`engram_rag::Grounded::best_sentence`]).
    first: Vec<bool>,
    sentence: Vec<Option<f32>>,
}

/// Share of the questions refused with a sentence floor at `floor`: refused by the first look
/// ([`engram_rag::relevant`]) and under the floor on the second
/// ([`engram_rag::Grounded::best_sentence`]).
fn refused_at(first: &[bool], second: &[Option<f32>], floor: f32) -> f64 {
    let n = first
        .iter()
        .zip(second)
        .filter(|(&f, s)| !f && s.is_none_or(|s| s < floor))
        .count();
    n as f64 / first.len().max(1) as f64
}

/// Asks `limit` queries of a BEIR queries.jsonl (`{"text": ...}` per line).
fn off_topic(
    kb: &engram_kb::KnowledgeBase,
    collection: &str,
    path: &Path,
    limit: usize,
) -> Result<OffTopic> {
    #[derive(Deserialize)]
    struct Query {
        text: String,
    }
    let queries: Vec<Query> = crate::eval::read_jsonl(path)?;
    let (mut refused, mut dense, mut coverage, mut terms) = (0, Vec::new(), Vec::new(), Vec::new());
    let (mut sentence, mut firsts) = (Vec::new(), Vec::new());
    for q in queries.iter().take(limit) {
        let hits = kb.search(&SearchRequest::new(collection, &q.text))?.hits;
        let best = hits.iter().filter_map(|h| h.dense).reduce(f32::max);
        dense.push(best.unwrap_or(0.0) as f64);
        let texts = || hits.iter().map(|h| h.text.as_str());
        coverage.push(engram_rag::best_coverage(&q.text, texts()));
        terms.push(engram_rag::best_term_coverage(&q.text, texts()));
        let g = engram_rag::ground(kb.models(), &q.text, hits)?;
        sentence.push(g.best_sentence);
        firsts.push(g.first_look);
        refused += usize::from(g.refused());
    }
    Ok(OffTopic {
        refused,
        asked: queries.len().min(limit),
        dense,
        coverage,
        terms,
        first: firsts,
        sentence,
    })
}

/// p10, median and p90 of `v`, as JSON.
fn percentiles(v: &[f64]) -> serde_json::Value {
    let at = |q| quantile(v, q);
    serde_json::json!({"p2": at(0.02), "p5": at(0.05), "p10": at(0.1), "p50": at(0.5), "p90": at(0.9)})
}

/// The best score of `answer` over the gold answers.
fn best_score(answer: &str, gold: &[String], chinese: bool) -> Score {
    gold.iter()
        .map(|g| {
            let (p, r) = if chinese {
                (char_tokens(answer), char_tokens(g))
            } else {
                (squad_tokens(answer), squad_tokens(g))
            };
            Score {
                f1: overlap_f1(&p, &r),
                em: f64::from(u8::from(p == r)),
            }
        })
        .fold(Score::default(), |best, s| Score {
            f1: best.f1.max(s.f1),
            em: best.em.max(s.em),
        })
}

/// SQuAD's normalisation (evaluate-v1.1.py): lower case, punctuation and the articles a, an
/// and the removed, split on white space.
pub fn squad_tokens(s: &str) -> Vec<String> {
    let lowered: String = s
        .to_lowercase()
        .chars()
        .map(|c| if c.is_ascii_punctuation() { ' ' } else { c })
        .collect();
    lowered
        .split_whitespace()
        .filter(|w| !matches!(*w, "a" | "an" | "the"))
        .map(str::to_owned)
        .collect()
}

/// CMRC2018's segmentation (cmrc2018_evaluate.py): every CJK character and every other
/// non-space, non-punctuation character is its own token after lower-casing, except runs of
/// ASCII letters and digits, which stay whole words.
pub fn char_tokens(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    for c in s.to_lowercase().chars() {
        if c.is_ascii_alphanumeric() {
            word.push(c);
            continue;
        }
        if !word.is_empty() {
            out.push(std::mem::take(&mut word));
        }
        if !(c.is_whitespace() || c.is_ascii_punctuation() || is_cjk_punctuation(c)) {
            out.push(c.to_string());
        }
    }
    if !word.is_empty() {
        out.push(word);
    }
    out
}

fn is_cjk_punctuation(c: char) -> bool {
    matches!(
        c,
        '，' | '。'
            | '、'
            | '；'
            | '：'
            | '？'
            | '！'
            | '“'
            | '”'
            | '‘'
            | '’'
            | '（'
            | '）'
            | '《'
            | '》'
            | '「'
            | '」'
            | '『'
            | '』'
            | '【'
            | '】'
            | '—'
            | '…'
            | '·'
            | '～'
            | '〈'
            | '〉'
    )
}

/// F1 of the tokens two texts share (counted with multiplicity); 1 when both are empty.
pub fn overlap_f1(p: &[String], r: &[String]) -> f64 {
    if p.is_empty() || r.is_empty() {
        return f64::from(u8::from(p == r));
    }
    let mut counts: std::collections::HashMap<&str, i64> = std::collections::HashMap::new();
    for w in r {
        *counts.entry(w).or_default() += 1;
    }
    let mut common = 0;
    for w in p {
        if let Some(c) = counts.get_mut(w.as_str()) {
            if *c > 0 {
                *c -= 1;
                common += 1;
            }
        }
    }
    if common == 0 {
        return 0.0;
    }
    let precision = common as f64 / p.len() as f64;
    let recall = common as f64 / r.len() as f64;
    2.0 * precision * recall / (precision + recall)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn english_scoring_follows_squad() {
        let gold = vec!["Denver Broncos".to_owned()];
        let s = best_score("the Denver Broncos.", &gold, false);
        assert_eq!((s.f1, s.em), (1.0, 1.0));
        let s = best_score("Denver", &gold, false);
        assert!((s.f1 - 2.0 / 3.0).abs() < 1e-9 && s.em == 0.0);
        assert_eq!(best_score("Carolina", &gold, false).f1, 0.0);
    }

    #[test]
    fn chinese_scoring_is_by_character() {
        assert_eq!(
            char_tokens("1994年NBA总冠军，"),
            ["1994", "年", "nba", "总", "冠", "军"]
        );
        let gold = vec!["北京大学".to_owned(), "北大".to_owned()];
        let s = best_score("北京大学。", &gold, true);
        assert_eq!((s.f1, s.em), (1.0, 1.0));
        let s = best_score("北京", &gold, true);
        // Against 北京大学: precision 1, recall 1/2; against 北大: 1/2 and 1/2.
        assert!((s.f1 - 2.0 / 3.0).abs() < 1e-9 && s.em == 0.0);
    }
}
