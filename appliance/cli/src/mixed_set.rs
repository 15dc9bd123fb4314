//! `engram eval mixed-set`: a mixed Chinese/English retrieval set in BEIR form, built from XQuAD's
//! parallel English and Chinese paragraphs (`../shared/data/qa-eval/xquad`).
//!
//! Each document is an English paragraph with, after its first sentence, the Chinese sentences of
//! its translation that hold the answers of its questions, as many as keep Han characters at most
//! a tenth of its letters and digits: an English handbook that quotes a few Chinese lines (any
//! chunk of it is mostly English, by the engine's own rule too). Two query splits: `zh`, the
//! Chinese questions whose answer sentence is in the document, and `en`, every English question.
//! A Chinese question can only be found through the Chinese run of a mostly English chunk, which
//! is what an index that analyses a chunk by its majority script misses.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use engram_fusion::han_share;
use serde::Deserialize;

use crate::eval::{read_jsonl, CorpusDoc};

/// Most Han characters a document may hold, as a share of its letters and digits.
const MAX_HAN_SHARE: f64 = 0.10;

#[derive(Args)]
pub struct MixedSetArgs {
    /// XQuAD folder: contexts.{en,zh}.jsonl and qa.{en,zh}.jsonl.
    #[arg(long, default_value = "../shared/data/qa-eval/xquad")]
    xquad: PathBuf,
    /// Where the BEIR folder is written: corpus.jsonl, queries.jsonl, qrels/{zh,en}.tsv.
    #[arg(long)]
    out: PathBuf,
}

/// One line of XQuAD's `qa.<lang>.jsonl`.
#[derive(Deserialize)]
struct QaLine {
    id: String,
    question: String,
    answer_starts: Vec<usize>,
    context_id: String,
}

/// A document of the set and the questions it answers.
struct MixedDoc {
    id: String,
    title: String,
    text: String,
    zh_questions: Vec<String>,
}

pub fn run(a: MixedSetArgs) -> Result<()> {
    let en: Vec<CorpusDoc> = read_jsonl(&a.xquad.join("contexts.en.jsonl"))?;
    let zh: HashMap<String, String> = read_jsonl::<CorpusDoc>(&a.xquad.join("contexts.zh.jsonl"))?
        .into_iter()
        .map(|d| (d.id, d.text))
        .collect();
    let qa_en: Vec<QaLine> = read_jsonl(&a.xquad.join("qa.en.jsonl"))?;
    let qa_zh: Vec<QaLine> = read_jsonl(&a.xquad.join("qa.zh.jsonl"))?;
    let mut zh_by_context: BTreeMap<&str, Vec<&QaLine>> = BTreeMap::new();
    for q in &qa_zh {
        zh_by_context.entry(&q.context_id).or_default().push(q);
    }

    let mut docs = Vec::with_capacity(en.len());
    for paragraph in &en {
        let Some(translation) = zh.get(&paragraph.id) else {
            bail!(
                "{}: no Chinese translation of {}",
                a.xquad.display(),
                paragraph.id
            );
        };
        let sentences = sentences(translation);
        let english = paragraph.text.as_str();
        let first_end = english.find(". ").map_or(english.len(), |i| i + 1);
        let mut quote = String::new();
        let mut quoted: Vec<usize> = Vec::new();
        let mut zh_questions = Vec::new();
        for q in zh_by_context
            .get(paragraph.id.as_str())
            .into_iter()
            .flatten()
        {
            // SQuAD's answer_start counts characters; the sentences are byte ranges.
            let Some(start) = q
                .answer_starts
                .first()
                .and_then(|&c| translation.char_indices().nth(c))
                .map(|(byte, _)| byte)
            else {
                continue;
            };
            let Some(s) = sentences.iter().position(|r| r.contains(&start)) else {
                continue;
            };
            if !quoted.contains(&s) {
                let candidate = format!("{quote}{}", translation[sentences[s].clone()].trim());
                if han_share(&format!("{english}{candidate}")) > MAX_HAN_SHARE {
                    continue;
                }
                quote = candidate;
                quoted.push(s);
            }
            zh_questions.push(q.id.clone());
        }
        let text = if quote.is_empty() {
            english.to_owned()
        } else {
            format!(
                "{} {quote} {}",
                &english[..first_end],
                english[first_end..].trim_start()
            )
        };
        docs.push(MixedDoc {
            id: paragraph.id.clone(),
            title: paragraph.title.clone(),
            text,
            zh_questions,
        });
    }
    write(&a.out, &docs, &qa_en, &qa_zh)?;

    let zh_queries: usize = docs.iter().map(|d| d.zh_questions.len()).sum();
    let quoting = docs.iter().filter(|d| !d.zh_questions.is_empty()).count();
    println!(
        "{}: {} documents ({} quoting Chinese), {} zh queries, {} en queries",
        a.out.display(),
        docs.len(),
        quoting,
        zh_queries,
        qa_en.len()
    );
    Ok(())
}

/// Byte ranges of the sentences of a Chinese paragraph: each ends after 。！？ or a line break
/// (with any closing quote that follows).
fn sentences(text: &str) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut chars = text.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if matches!(c, '。' | '！' | '？' | '\n') {
            let mut end = i + c.len_utf8();
            while let Some(&(j, q)) = chars.peek() {
                if !matches!(q, '”' | '’' | '」' | '』' | '）') {
                    break;
                }
                end = j + q.len_utf8();
                chars.next();
            }
            if !text[start..end].trim().is_empty() {
                out.push(start..end);
            }
            start = end;
        }
    }
    if !text[start..].trim().is_empty() {
        out.push(start..text.len());
    }
    out
}

fn write(out: &Path, docs: &[MixedDoc], qa_en: &[QaLine], qa_zh: &[QaLine]) -> Result<()> {
    std::fs::create_dir_all(out.join("qrels"))
        .with_context(|| format!("creating {}", out.display()))?;
    let open = |name: &str| -> Result<std::io::BufWriter<std::fs::File>> {
        let path = out.join(name);
        let f =
            std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(std::io::BufWriter::new(f))
    };
    let mut corpus = open("corpus.jsonl")?;
    for d in docs {
        let line = serde_json::json!({ "_id": d.id, "title": d.title, "text": d.text });
        writeln!(corpus, "{line}")?;
    }
    corpus.flush()?;

    let question: HashMap<&str, &str> = qa_zh
        .iter()
        .map(|q| (q.id.as_str(), q.question.as_str()))
        .collect();
    let mut queries = open("queries.jsonl")?;
    let mut zh_qrels = open("qrels/zh.tsv")?;
    writeln!(zh_qrels, "query-id\tcorpus-id\tscore")?;
    for d in docs {
        for id in &d.zh_questions {
            let line =
                serde_json::json!({ "_id": format!("zh-{id}"), "text": question[id.as_str()] });
            writeln!(queries, "{line}")?;
            writeln!(zh_qrels, "zh-{id}\t{}\t1", d.id)?;
        }
    }
    zh_qrels.flush()?;
    let mut en_qrels = open("qrels/en.tsv")?;
    writeln!(en_qrels, "query-id\tcorpus-id\tscore")?;
    for q in qa_en {
        let line = serde_json::json!({ "_id": format!("en-{}", q.id), "text": q.question });
        writeln!(queries, "{line}")?;
        writeln!(en_qrels, "en-{}\t{}\t1", q.id, q.context_id)?;
    }
    en_qrels.flush()?;
    queries.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentences_end_at_chinese_stops_and_keep_closing_quotes() {
        let text = "他说：“好。”然后走了！最后一句没有句号";
        let got: Vec<&str> = sentences(text).into_iter().map(|r| &text[r]).collect();
        assert_eq!(got, ["他说：“好。”", "然后走了！", "最后一句没有句号"]);
    }
}
