//! The evidence sentence: of the retrieved passages' sentences, the one that shares the most of
//! the question's rarer terms, repeated next to the question so a small model reads the fact
//! where it looks (measured in `docs/bench/2026-11-29-evidence.md`).

use std::collections::{HashMap, HashSet};

use crate::answer::{FUNCTION_CHARS, STOP_WORDS};
use crate::dedup::{for_each_unit, is_han};

/// Longest evidence, in characters: a longer sentence is cut into its clauses first, and a
/// clause longer than this is cut at the limit.
pub const MAX_EVIDENCE_CHARS: usize = 400;

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
    let wanted = terms(question);
    if wanted.is_empty() {
        return None;
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
    let mut best: Option<(f64, usize)> = None;
    for (i, have) in found.iter().enumerate() {
        let score = score(have);
        // Strictly greater: the first of equals (better-ranked passage, earlier sentence) stays.
        if score > 0.0 && best.is_none_or(|(b, _)| score > b) {
            best = Some((score, i));
        }
    }
    let sentence = sentences[best?.1];
    if sentence.chars().count() <= max_chars {
        return Some(sentence.to_owned());
    }
    // The best run of clauses that fits.
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
            let s = score(&terms(run));
            let better = match pick {
                None => true,
                Some((b, l, _)) => s > b || (s == b && len < l),
            };
            if better {
                pick = Some((s, len, run));
            }
        }
    }
    pick.map(|(_, _, run)| run.trim().to_owned())
}

/// The sentences of `text`, trimmed: split after "。！？；;!?", after a "." followed by white
/// space, and at line ends. A sentence longer than [`MAX_EVIDENCE_CHARS`] is split into its
/// clauses (after "，,：:"), and a clause still longer is cut at the limit.
pub(crate) fn sentences(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    for s in split_after(text, |c, next| {
        matches!(c, '。' | '！' | '？' | '；' | ';' | '!' | '?' | '\n')
            || (c == '.' && next.is_none_or(char::is_whitespace))
    }) {
        if s.chars().count() <= MAX_EVIDENCE_CHARS {
            out.push(s);
            continue;
        }
        for clause in split_after(s, |c, _| ends_clause(c)) {
            out.push(cut_chars(clause, MAX_EVIDENCE_CHARS));
        }
    }
    out
}

/// Whether a clause of a sentence ends after `c`.
fn ends_clause(c: char) -> bool {
    matches!(c, '，' | ',' | '：' | ':')
}

/// `text`'s first `max` characters.
fn cut_chars(text: &str, max: usize) -> &str {
    text.char_indices()
        .nth(max)
        .map_or(text, |(i, _)| &text[..i])
}

/// `text` cut after each character `ends(c, next)` accepts, pieces trimmed, empty ones left out.
fn split_after(text: &str, ends: impl Fn(char, Option<char>) -> bool) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut chars = text.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        let next = chars.peek().map(|&(_, n)| n);
        if ends(c, next) {
            let end = i + c.len_utf8();
            out.push(text[start..end].trim());
            start = end;
        }
    }
    out.push(text[start..].trim());
    out.retain(|s| !s.is_empty());
    out
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

/// A word cut to what its inflections share: a plural's or verb's ending off ("passwords",
/// "changed", "booking"), then at most six characters ("kilometres" and "kilometers" meet).
/// Numbers stay whole.
fn stem(word: &str) -> String {
    if word.chars().all(|c| c.is_ascii_digit()) {
        return word.to_owned();
    }
    let mut w = word;
    for ending in ["ing", "ed", "es", "s"] {
        if w.len() <= ending.len() + 2 {
            continue;
        }
        if let Some(rest) = w.strip_suffix(ending) {
            if !(ending == "s" && rest.ends_with('s')) {
                w = rest;
                break;
            }
        }
    }
    w.chars().take(6).collect()
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
