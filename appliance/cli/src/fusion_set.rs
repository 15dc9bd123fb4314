//! `engram eval fusion-set`: held-out fusion questions built from a QA set's paragraphs (XQuAD
//! en/zh, CMRC2018 in `../shared/data/qa-eval`), in the MuSiQue shape `engram eval fusion`
//! reads: each question with its gold paragraph among distractor paragraphs of other articles,
//! at a random place, until the passages reach a token budget.
//!
//! The questions are drawn from the whole set with a seeded shuffle, and MuSiQue is what fusion
//! was tuned on, so these are questions no policy was chosen with. Passages are measured with
//! the model's own tokenizer, as the prompt will hold them.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use engram_fusion::chunk_tokens;
use serde::{Deserialize, Serialize};

use crate::eval::{read_jsonl, CorpusDoc};
use crate::fusion_eval::passage_text;
use crate::gen_model::SplitMix64;
use crate::ModelArgs;

#[derive(Args)]
pub struct FusionSetArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// `xquad-en`, `xquad-zh` or `cmrc2018`.
    #[arg(long)]
    set: String,
    /// Folder of the QA sets.
    #[arg(long, default_value = "../shared/data/qa-eval")]
    qa_root: PathBuf,
    /// Where the MuSiQue-shaped JSON is written.
    #[arg(long)]
    out: PathBuf,
    /// Questions written.
    #[arg(long, default_value_t = 150)]
    questions: usize,
    /// Passage tokens to reach per question (gold and distractors together); a distractor that
    /// would take them past `--max-tokens` is passed over.
    #[arg(long, default_value_t = 2500)]
    tokens: usize,
    #[arg(long, default_value_t = 4000)]
    max_tokens: usize,
    /// Seed of the question draw and of the distractors.
    #[arg(long, default_value_t = 2026)]
    seed: u64,
}

#[derive(Deserialize)]
struct QaLine {
    question: String,
    answers: Vec<String>,
    context_id: String,
}

#[derive(Serialize)]
struct Example<'a> {
    question: &'a str,
    answers: &'a [String],
    ctxs: Vec<Ctx<'a>>,
    /// Index of the gold paragraph in `ctxs`.
    gold: usize,
}

#[derive(Serialize)]
struct Ctx<'a> {
    title: &'a str,
    text: &'a str,
}

pub fn run(a: FusionSetArgs) -> Result<()> {
    let (qa, contexts, _) = crate::qa_eval::set_files(&a.qa_root, &a.set)?;
    if a.tokens > a.max_tokens {
        bail!(
            "--tokens {} is above --max-tokens {}",
            a.tokens,
            a.max_tokens
        );
    }
    let mut questions: Vec<QaLine> = read_jsonl(&qa)?;
    let paragraphs: Vec<CorpusDoc> = read_jsonl(&contexts)?;
    let loaded = a.model.load()?;
    let tokens: Vec<usize> = paragraphs
        .iter()
        .map(|p| Ok(chunk_tokens(&loaded.tokenizer, &passage_text(&p.title, &p.text))?.len()))
        .collect::<Result<_>>()?;
    let by_id: HashMap<&str, usize> = paragraphs
        .iter()
        .enumerate()
        .map(|(i, p)| (p.id.as_str(), i))
        .collect();

    let mut rng = SplitMix64(a.seed);
    rng.shuffle(&mut questions);
    let mut out = Vec::with_capacity(a.questions);
    let mut lengths = Vec::with_capacity(a.questions);
    for q in &questions {
        if out.len() == a.questions {
            break;
        }
        let Some(&gold) = by_id.get(q.context_id.as_str()) else {
            bail!(
                "{}: question's context {} is not in {}",
                qa.display(),
                q.context_id,
                contexts.display()
            );
        };
        if tokens[gold] > a.max_tokens {
            continue;
        }
        // Distractors: paragraphs of other articles, in a random order, while under budget.
        let mut others: Vec<usize> = (0..paragraphs.len())
            .filter(|&i| paragraphs[i].title != paragraphs[gold].title)
            .collect();
        rng.shuffle(&mut others);
        let mut chosen = Vec::new();
        let mut total = tokens[gold];
        for i in others {
            if total >= a.tokens {
                break;
            }
            if total + tokens[i] <= a.max_tokens {
                chosen.push(i);
                total += tokens[i];
            }
        }
        if chosen.is_empty() {
            continue;
        }
        let at = rng.below(chosen.len() + 1);
        chosen.insert(at, gold);
        lengths.push(total);
        out.push(Example {
            question: &q.question,
            answers: &q.answers,
            ctxs: chosen
                .iter()
                .map(|&i| Ctx {
                    title: &paragraphs[i].title,
                    text: &paragraphs[i].text,
                })
                .collect(),
            gold: at,
        });
    }
    if out.is_empty() {
        bail!(
            "no question of {} fits --max-tokens {}",
            a.set,
            a.max_tokens
        );
    }
    let json = serde_json::to_string(&out)?;
    std::fs::write(&a.out, json).with_context(|| format!("writing {}", a.out.display()))?;
    lengths.sort_unstable();
    eprintln!(
        "{}: {} questions, passage tokens min {} median {} max {}",
        a.out.display(),
        out.len(),
        lengths[0],
        lengths[lengths.len() / 2],
        lengths[lengths.len() - 1]
    );
    Ok(())
}
