//! The evidence sentence: of the retrieved passages' sentences, the one that shares the most of
//! the question's rarer terms, repeated next to the question so a small model reads the fact
//! where it looks (measured in `docs/bench/2026-11-29-evidence.md`).

use std::collections::{HashMap, HashSet};

use engram_fusion::MAX_EVIDENCE_CHARS;

use crate::text::{
    cut_chars, ends_clause, for_each_unit, is_han, sentences, split_after, stem, FUNCTION_CHARS,
    STOP_WORDS,
};

/// The sentence of `passages` (in rank order, best first) that shares the most of `question`'s
/// terms, each term weighted by how rare it is among the passages' sentences (inverse document
/// frequency): English words without stop words and with their endings cut (`stem`), and pairs
/// of neighbouring Han characters. Ties go to the better-ranked passage, then the earlier
/// sentence. `None` when no sentence shares a term.
pub fn evidence<'a>(question: &str, passages: impl IntoIterator<Item = &'a str>) -> Option<String> {
    evidence_within(question, passages, MAX_EVIDENCE_CHARS)
}

/// [`evidence`], at most `max_chars` long: a longer sentence gives its run of clauses (cut
/// as [`sentences`] cuts one, after "，,：:") of at most `max_chars` that holds the most of the
/// question's terms (ties: the shorter, then the earlier), and a clause still longer is cut at
/// the limit.
pub fn evidence_within<'a>(
    question: &str,
    passages: impl IntoIterator<Item = &'a str>,
    max_chars: usize,
) -> Option<String> {
    evidence_candidates(question, passages, max_chars, 1.0)
        .into_iter()
        .next()
        .map(|c| c.text)
}

/// Most sentences [`evidence_candidates`] gives.
pub const MAX_EVIDENCE_CANDIDATES: usize = 8;

/// A sentence that may be the evidence, and its score: the sum of the inverse document
/// frequencies of the question's terms it holds (see [`evidence`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub text: String,
    pub score: f64,
}

/// The sentences of `passages` (in rank order, best first) that score at least `share` of the
/// best sentence's score (see [`evidence`]; `share` 1: the sentences tied with it), best first,
/// equals in passage and sentence order, at most [`MAX_EVIDENCE_CANDIDATES`], each cut to
/// `max_chars` as [`evidence_within`] cuts one. When the question asks for a kind of value (an
/// email address, a length of time, a number: `answer::wanted`) and some of these sentences hold
/// one, only those are given. The first is [`evidence_within`]'s choice. Empty when no sentence
/// shares a term.
pub fn evidence_candidates<'a>(
    question: &str,
    passages: impl IntoIterator<Item = &'a str>,
    max_chars: usize,
    share: f64,
) -> Vec<Candidate> {
    let wanted = terms(question);
    if wanted.is_empty() {
        return Vec::new();
    }
    let sentences: Vec<&str> = passages.into_iter().flat_map(sentences).collect();
    let found: Vec<HashSet<String>> = sentences.iter().map(|s| terms(s)).collect();
    let mut df: HashMap<&str, usize> = HashMap::new();
    for t in found.iter().flatten() {
        if wanted.contains(t) {
            *df.entry(t.as_str()).or_default() += 1;
        }
    }
    let n = sentences.len() as f64;
    let idf = |t: &str| ((n + 1.0) / (df.get(t).copied().unwrap_or(0) as f64 + 0.5)).ln();
    let score =
        |have: &HashSet<String>| -> f64 { have.intersection(&wanted).map(|t| idf(t)).sum() };
    // Compared in millionths: a sum of the same terms taken in another order is the same score.
    // A heading holds no fact to answer from: it scores nothing.
    let scores: Vec<i64> = found
        .iter()
        .zip(&sentences)
        .map(|(have, s)| {
            if is_heading(s) {
                0
            } else {
                (score(have) * 1e6).round() as i64
            }
        })
        .collect();
    let best = scores.iter().copied().max().unwrap_or(0);
    if best <= 0 {
        return Vec::new();
    }
    let floor = (best as f64 * share).round() as i64;
    let mut order: Vec<usize> = (0..sentences.len())
        .filter(|&i| scores[i] > 0 && scores[i] >= floor)
        .collect();
    // A question that asks for a kind of value (an email address, a length of time, a number)
    // is answered by a sentence that holds one: when some of these do, the others go.
    let kinds = crate::answer::wanted(question);
    if let Some(&kind) = kinds
        .iter()
        .find(|&&k| order.iter().any(|&i| crate::answer::holds(k, sentences[i])))
    {
        order.retain(|&i| crate::answer::holds(kind, sentences[i]));
    }
    // Stable: equals keep passage and sentence order.
    order.sort_by_key(|&i| std::cmp::Reverse(scores[i]));
    order.truncate(MAX_EVIDENCE_CANDIDATES);
    order
        .into_iter()
        .map(|i| Candidate {
            text: fit(sentences[i], max_chars, |run| score(&terms(run))),
            score: scores[i] as f64 / 1e6,
        })
        .collect()
}

/// Share of the best term score at which [`evidence_to_embed`] still offers a sentence to the
/// embedder. Measured with `engram eval qa --evidence` (docs/bench/2026-12-03-evidence-pick.md):
/// on 400 XQuAD-en questions whose gold paragraph was retrieved, the evidence held a gold
/// answer for 76.0 % chosen by the terms alone, 76.8 % with the embedder breaking exact ties,
/// 78.0 % at 0.8, 76.5 % at 0.6 and 70.5 % by the cosine alone.
pub const EVIDENCE_NEAR_SHARE: f64 = 0.8;

/// The sentences the embedder chooses an English question's evidence among (see
/// [`nearest_evidence`]): the [`evidence_candidates`] within [`EVIDENCE_NEAR_SHARE`] of the
/// best term score, cut to `max_chars`. Empty when there are fewer than two and the one is the
/// terms' choice (the terms decide), or the question is not English (the embedder reads English
/// only).
pub fn evidence_to_embed<'a>(
    question: &str,
    passages: impl IntoIterator<Item = &'a str>,
    max_chars: usize,
) -> Vec<String> {
    if !crate::text::is_english(question) {
        return Vec::new();
    }
    let passages: Vec<&str> = passages.into_iter().collect();
    let c = evidence_candidates(
        question,
        passages.iter().copied(),
        max_chars,
        EVIDENCE_NEAR_SHARE,
    );
    // One sentence alone near the best (the only one holding the value the question asks for)
    // is the evidence even where the terms alone would choose another.
    let alone = || {
        c.len() == 1
            && evidence_within(question, passages.iter().copied(), max_chars).as_ref()
                != Some(&c[0].text)
    };
    if c.len() < 2 && !alone() {
        return Vec::new();
    }
    c.into_iter().map(|c| c.text).collect()
}

/// Of [`evidence_to_embed`]'s sentences, the one the question embeds nearest (`cosines`, in
/// their order; the first of equals); `None` when there are none.
pub fn nearest_evidence(sentences: Vec<String>, cosines: &[f32]) -> Option<String> {
    let best = cosines.iter().take(sentences.len()).enumerate().fold(
        None,
        |b: Option<(usize, f32)>, (i, &c)| match b {
            Some((_, bc)) if bc >= c => b,
            _ => Some((i, c)),
        },
    )?;
    sentences.into_iter().nth(best.0)
}

/// `sentence` when it is at most `max_chars` long, else its run of clauses of at most
/// `max_chars` with the best `score` (ties: the shorter, then the earlier), a clause still
/// longer cut at the limit.
fn fit(sentence: &str, max_chars: usize, score: impl Fn(&str) -> f64) -> String {
    if sentence.chars().count() <= max_chars {
        return sentence.to_owned();
    }
    let clauses = split_after(sentence, |c, _| ends_clause(c));
    let start_of = |c: &str| c.as_ptr() as usize - sentence.as_ptr() as usize;
    let mut pick: Option<(f64, usize, &str)> = None;
    for i in 0..clauses.len() {
        for j in i..clauses.len() {
            let run = &sentence[start_of(clauses[i])..start_of(clauses[j]) + clauses[j].len()];
            let len = run.chars().count();
            if len > max_chars && j > i {
                break;
            }
            let run = cut_chars(run, max_chars);
            let s = score(run);
            let better = match pick {
                None => true,
                Some((b, l, _)) => s > b || (s == b && len < l),
            };
            if better {
                pick = Some((s, len, run));
            }
        }
    }
    pick.map_or_else(String::new, |(_, _, run)| run.trim().to_owned())
}

/// Most words of a line [`is_heading`] takes for a heading.
const MAX_HEADING_WORDS: usize = 8;

/// Whether a piece of [`sentences`] is a heading (a section's title on its own line, as parsed
/// documents keep them): no punctuation that ends a sentence or clause, no digit, and at most
/// [`MAX_HEADING_WORDS`] words or twice as many Han characters.
fn is_heading(s: &str) -> bool {
    let ends = |c: char| "。！？；;!?.，,：:".contains(c);
    if s.chars().any(|c| ends(c) || c.is_ascii_digit()) {
        return false;
    }
    let han = s.chars().filter(|&c| is_han(c)).count();
    s.split_whitespace().count() + han / 2 <= MAX_HEADING_WORDS
}

/// A text's terms: its words, stop words left out, stemmed; and its pairs of neighbouring Han
/// characters, pairs of two [`FUNCTION_CHARS`] left out.
fn terms(text: &str) -> HashSet<String> {
    let mut out = HashSet::new();
    let mut last_han: Option<String> = None;
    for_each_unit(text, |u| {
        let han = u.chars().next().is_some_and(is_han);
        if han {
            if let Some(prev) = last_han.take() {
                let function = |s: &str| FUNCTION_CHARS.contains(s);
                if !(function(&prev) && function(u)) {
                    out.insert(format!("{prev}{u}"));
                }
            }
            last_han = Some(u.to_owned());
        } else {
            last_han = None;
            if !STOP_WORDS.contains(&u) {
                out.insert(stem(u));
            }
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const HANDBOOK: &str = "Every employee gets 25 days of paid leave per year. Up to 5 unused \
        days can be carried over into the next year; carried-over days expire on 31 March. Leave \
        is requested in the HR portal at least two weeks in advance.\n\nWorking hours\n\nThe \
        standard working week is 38 hours. Core hours are 10:00 to 15:00.";
    const TRAVEL: &str = "Expense claims are submitted within 30 days of the purchase, with a \
        receipt for every item above 25 euros. Train travel is booked in second class; flights \
        are allowed for trips of more than 600 kilometres.";

    #[test]
    fn the_sentence_with_the_questions_rarer_terms_is_chosen() {
        let ev = |q| evidence(q, [HANDBOOK, TRAVEL]).unwrap();
        assert_eq!(
            ev("Where is leave requested?"),
            "Leave is requested in the HR portal at least two weeks in advance."
        );
        assert_eq!(
            ev("How many hours is the standard working week?"),
            "The standard working week is 38 hours."
        );
        // Inflections and spelling meet: "kilometers"/"kilometres", "flight"/"flights".
        assert!(ev("How far must a trip be for a flight? In kilometers?").contains("600"));
        // A ";" ends a sentence: the carry-over clause, not the whole line.
        assert_eq!(
            ev("When do carried-over days expire?"),
            "carried-over days expire on 31 March."
        );
    }

    #[test]
    fn inflections_meet_and_headings_are_not_evidence() {
        assert_eq!(stem("changed"), stem("change"));
        assert_eq!(stem("changing"), stem("changes"));
        assert_eq!(stem("passwords"), stem("password"));
        assert_eq!(stem("kilometres"), stem("kilometers"));
        assert_eq!(stem("2024"), "2024");
        let section = "Passwords and accounts\n\nA new password has 12 characters. Passwords \
                       are changed every 180 days.";
        // "change" meets "changed"; the heading, which shares "passwords", is passed over.
        assert_eq!(
            evidence("How frequently must I change my password?", [section]).as_deref(),
            Some("Passwords are changed every 180 days.")
        );
        assert_eq!(
            evidence("Which passwords and accounts?", ["Passwords and accounts"]),
            None
        );
        assert!(is_heading("密码与账户"));
        assert!(!is_heading("标准工作周为 38 小时"));
        assert!(!is_heading("Leave is requested in the HR portal."));
    }

    #[test]
    fn candidates_are_the_sentences_near_the_best_score_best_first() {
        let badge = "Leave is requested in the HR portal; call your manager when you are ill. \
                     A lost badge is reported to the IT helpdesk.";
        let q = "Who do I call if I lose my badge?";
        let tied = evidence_candidates(q, [badge], MAX_EVIDENCE_CHARS, 1.0);
        let texts: Vec<&str> = tied.iter().map(|c| c.text.as_str()).collect();
        // "call" and "badge" are as rare: a tie, in passage order; the first is `evidence`'s.
        assert_eq!(
            texts,
            [
                "call your manager when you are ill.",
                "A lost badge is reported to the IT helpdesk."
            ]
        );
        assert_eq!(tied[0].score, tied[1].score);
        assert_eq!(evidence(q, [badge]).as_deref(), Some(texts[0]));
        // A lower share also admits sentences with fewer of the terms, after the better ones.
        let q = "Where is leave requested when you are ill?";
        let near = evidence_candidates(q, [HANDBOOK, badge], MAX_EVIDENCE_CHARS, 0.3);
        assert!(near.len() > 1);
        assert_eq!(near[0].text, evidence(q, [HANDBOOK, badge]).unwrap());
        assert!(near.windows(2).all(|w| w[0].score >= w[1].score));
        assert!(near.iter().all(|c| c.score >= near[0].score * 0.3));
        assert!(
            evidence_candidates("What is the capital of France?", [HANDBOOK], 400, 0.5).is_empty()
        );
    }

    #[test]
    fn a_question_for_a_kind_of_value_gets_a_sentence_that_holds_one() {
        let it = "Personal software may not be installed; the IT helpdesk installs approved \
                  software on request. A lost badge is reported to the IT helpdesk within one \
                  hour, at extension 4357 or helpdesk@northwind.example.";
        // Both sentences have "helpdesk"; only the second holds an email address, so it is the
        // terms' choice, and nothing is left for the embedder to choose among.
        let q = "What is the email address of the helpdesk?";
        let badge = "A lost badge is reported to the IT helpdesk within one hour, at extension \
                     4357 or helpdesk@northwind.example.";
        assert_eq!(evidence(q, [it]).as_deref(), Some(badge));
        assert!(evidence_to_embed(q, [it], MAX_EVIDENCE_CHARS).is_empty());
        // Without a kind of value asked for, both stay.
        assert_eq!(
            evidence_candidates("Who is the IT helpdesk?", [it], MAX_EVIDENCE_CHARS, 1.0).len(),
            2
        );
        // A number asked for: of the sentences near the best, the one that states one, even
        // below the best score; none states one, the terms choose as before.
        let pw = "A new password is chosen by the employee. It must be at least 12 characters \
                  long.";
        let near = |q| evidence_candidates(q, [pw], MAX_EVIDENCE_CHARS, 0.3);
        let texts = |c: Vec<Candidate>| c.into_iter().map(|c| c.text).collect::<Vec<_>>();
        assert_eq!(
            texts(near("How many characters must a new password have?")),
            ["It must be at least 12 characters long."]
        );
        assert_eq!(
            texts(near("Which characters must a new password have?")).len(),
            2
        );
        assert_eq!(
            evidence("How many passwords does an employee choose?", [pw]).as_deref(),
            Some("A new password is chosen by the employee.")
        );
    }

    #[test]
    fn the_embedder_chooses_among_english_sentences_near_the_best() {
        // "new" and "laptop" weigh the same: each is in one sentence.
        let laptop = "A new password has 12 characters. Every employee gets a laptop, which is \
                      replaced every three years. Core hours are 10:00 to 15:00.";
        let q = "When do we get a new laptop?";
        let offered = evidence_to_embed(q, [laptop], MAX_EVIDENCE_CHARS);
        assert_eq!(offered.len(), 2, "{offered:?}");
        assert!(offered[1].contains("three years"));
        // "How often" asks for a length of time: only one sentence holds one.
        let often = "How often do we get a new laptop?";
        assert!(evidence_to_embed(often, [laptop], MAX_EVIDENCE_CHARS).is_empty());
        assert!(evidence(often, [laptop]).is_some_and(|e| e.contains("three years")));
        // The nearest by cosine, the first of equals; nothing offered, nothing chosen.
        let s = |t: &str| t.to_owned();
        assert_eq!(
            nearest_evidence(vec![s("a"), s("b"), s("c")], &[0.2, 0.5, 0.5]).as_deref(),
            Some("b")
        );
        assert_eq!(nearest_evidence(Vec::new(), &[]), None);
        // One sentence near the best, or a Chinese question: the terms decide.
        assert!(evidence_to_embed("Where is leave requested?", [HANDBOOK], 400).is_empty());
        let zh = "密码每 180 天更换一次。新密码至少需要 12 个字符。";
        assert!(evidence_to_embed("密码多久更换一次？", [zh], 400).is_empty());
    }

    #[test]
    fn a_shorter_limit_keeps_the_clauses_with_the_questions_terms() {
        let ev = |q, max| evidence_within(q, [HANDBOOK, TRAVEL], max).unwrap();
        // Fits: the whole sentence.
        assert_eq!(
            ev("How many hours is the standard working week?", 60),
            "The standard working week is 38 hours."
        );
        // "Train travel is booked in second class; flights are allowed for trips of more than
        // 600 kilometres." is cut at ";" already; with 50 characters the claims sentence keeps
        // its receipt clause.
        let receipt = ev("Which items need a receipt?", 50);
        assert_eq!(receipt, "with a receipt for every item above 25 euros.");
        assert!(receipt.chars().count() <= 50);
        // One clause longer than the limit is cut at it.
        let endless = "leave ".repeat(300);
        let e = evidence_within("Where is leave requested?", [endless.as_str()], 40).unwrap();
        assert_eq!(e.chars().count(), 40);
    }

    #[test]
    fn chinese_is_matched_by_pairs_of_characters() {
        let zh = "每位员工每年有 25 天带薪年假。未休完的年假最多可以结转 5 天到下一年，结转的天数在 3 月 31 日作废。\
                  标准工作周为 38 小时。";
        assert_eq!(
            evidence("标准工作周是多少小时？", [zh]).unwrap(),
            "标准工作周为 38 小时。"
        );
        assert!(evidence("年假最多可以结转多少天？", [zh])
            .unwrap()
            .contains("结转 5 天"));
    }

    #[test]
    fn nothing_shared_gives_no_evidence_and_long_sentences_are_cut() {
        assert_eq!(evidence("What is the capital of France?", [HANDBOOK]), None);
        assert_eq!(evidence("", [HANDBOOK]), None);
        assert_eq!(evidence("Where is leave requested?", []), None);
        let long = format!(
            "{}, and the portal is where leave is requested.",
            "word ".repeat(200)
        );
        let ev = evidence("Where is leave requested?", [long.as_str()]).unwrap();
        assert_eq!(ev, "and the portal is where leave is requested.");
        let endless = "leave ".repeat(300);
        let ev = evidence("Where is leave requested?", [endless.as_str()]).unwrap();
        assert_eq!(ev.chars().count(), MAX_EVIDENCE_CHARS);
    }
}
