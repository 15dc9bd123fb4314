//! Near-duplicate passages: a retrieved passage whose text is mostly in better-ranked ones
//! adds no fact to a RAG prompt, and it makes fused prefill drift from full prefill (repeated
//! text is read differently the second time, and a chunk's stored KV never saw the first).

use std::collections::HashSet;

use crate::text::for_each_unit;

/// Units per shingle: eight words (or Han characters) in a row. Long enough that ordinary
/// phrases ("one of the largest", "in the early twentieth century") do not make two unrelated
/// passages look alike; short enough that a sentence copied from one passage into another
/// shows up.
const SHINGLE: usize = 8;

/// A passage is redundant when at least this share of its shingles is in passages kept
/// before it. One half: of MuSiQue's 1,500 passages (overlapping windows of the same
/// Wikipedia articles) 558 repeat under 0.4 of their text and 841 repeat 0.7 or more, with few
/// between (`docs/bench/2026-11-28-fusion-musique.md`). A chunk that shares only its overlap
/// with a neighbour (32 of 256 tokens by default) stays.
pub const REDUNDANT_SHARE: f64 = 0.5;

/// Keeps the passages that say something new: an item is dropped when at least
/// [`REDUNDANT_SHARE`] of the shingles of its `text` already appear in the items kept before
/// it. `items` are in rank order (best first), so of two near-duplicates the better-ranked
/// stays; the order of those kept is unchanged. A passage too short to have a shingle is kept.
pub fn retain_distinct<T>(items: &mut Vec<T>, text: impl Fn(&T) -> &str) {
    let mut seen: HashSet<u64> = HashSet::new();
    // `retain` visits every item once, in order.
    items.retain(|item| {
        let own = shingles(text(item));
        let repeated = own.iter().filter(|s| seen.contains(s)).count();
        let keep = own.is_empty() || (repeated as f64) < REDUNDANT_SHARE * own.len() as f64;
        if keep {
            seen.extend(own);
        }
        keep
    });
}

/// Keeps the passages written in the question's language when there are any: an item whose
/// `text` is Chinese ([`engram_fusion::is_chinese`]) is dropped for a question that is not, and one
/// that is not Chinese for a Chinese question, as long as one item in the question's language
/// stays. A bilingual collection (a handbook in English and in Chinese) retrieves both
/// versions of a fact, and a small model given the other language's passages beside its own
/// copies their numbers into the wrong answer; with none in its language, the question is
/// answered from what was found. The order of those kept is unchanged.
pub fn retain_language<T>(question: &str, items: &mut Vec<T>, text: impl Fn(&T) -> &str) {
    let zh = engram_fusion::is_chinese(question);
    let same = |item: &T| engram_fusion::is_chinese(text(item)) == zh;
    if items.iter().any(same) {
        items.retain(same);
    }
}

/// The distinct hashes of a text's shingles: runs of [`SHINGLE`] units (see [`for_each_unit`]).
fn shingles(text: &str) -> HashSet<u64> {
    let mut units: Vec<u64> = Vec::new();
    for_each_unit(text, |u| {
        units.push(xxhash_rust::xxh3::xxh3_64(u.as_bytes()))
    });
    units
        .windows(SHINGLE)
        .map(|w| {
            let bytes: Vec<u8> = w.iter().flat_map(|u| u.to_le_bytes()).collect();
            xxhash_rust::xxh3::xxh3_64(&bytes)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passages_in_the_questions_language_are_kept_when_there_are_any() {
        let en = "Every employee gets 25 days of paid leave per year.";
        let zh = "每位员工每年有 25 天带薪年假。";
        let mut items = vec![zh, en, zh];
        retain_language("How many days of paid leave?", &mut items, |t| t);
        assert_eq!(items, [en]);
        let mut items = vec![en, zh];
        retain_language("每年有几天年假？", &mut items, |t| t);
        assert_eq!(items, [zh]);
        // None in the question's language: all stay.
        let mut items = vec![zh, zh];
        retain_language("How many days of paid leave?", &mut items, |t| t);
        assert_eq!(items.len(), 2);
    }

    /// Indices of the passages [`retain_distinct`] keeps.
    fn distinct_passages<S: AsRef<str>>(passages: &[S]) -> Vec<usize> {
        let mut items: Vec<(usize, &str)> =
            passages.iter().map(AsRef::as_ref).enumerate().collect();
        retain_distinct(&mut items, |&(_, t)| t);
        items.into_iter().map(|(i, _)| i).collect()
    }

    const A: &str = "The observatory on the northern ridge was built in the early twentieth \
                     century by a society of amateur astronomers, who raised the money through \
                     subscriptions and public lectures.";
    const B: &str = "Every employee gets 25 days of paid leave per year, and unused days may be \
                     carried over into the first quarter of the next year.";

    #[test]
    fn a_repeated_passage_is_dropped_and_the_better_ranked_copy_kept() {
        let shifted = format!("{} Its first telescope was a refractor.", &A[30..]);
        assert_eq!(distinct_passages(&[A, B, A]), vec![0, 1]);
        // Case and punctuation do not hide a copy; a window shifted by a few words is one.
        assert_eq!(
            distinct_passages(&[A.to_uppercase().replace(',', ";"), B.into()]),
            vec![0, 1]
        );
        assert_eq!(distinct_passages(&[A.to_owned(), shifted]), vec![0]);
    }

    #[test]
    fn passages_that_share_a_sentence_or_less_are_kept() {
        // Two passages with one sentence in common (a chunk and its neighbour's overlap).
        let first = format!("{B} Requests go to the team lead at least two weeks ahead.");
        let second = format!(
            "Requests go to the team lead at least two weeks ahead. {A} The dome was turned \
             by hand until an electric motor was fitted in the 1950s, and the weather station \
             beside it has measured rain every day since 1921."
        );
        assert_eq!(distinct_passages(&[first, second]), vec![0, 1]);
        // Too short for a shingle: kept, whatever it repeats.
        assert_eq!(distinct_passages(&[A, "the northern ridge"]), vec![0, 1]);
        assert_eq!(distinct_passages::<&str>(&[]), Vec::<usize>::new());
    }

    #[test]
    fn chinese_is_compared_by_character() {
        let a = "员工每年享有二十五天带薪年假，未使用的天数可以结转到下一年的第一季度。";
        let b = "本公司总部位于上海，在北京、深圳和成都设有分公司，员工总数约为三千人。";
        assert_eq!(distinct_passages(&[a, b, a]), vec![0, 1]);
        assert_eq!(distinct_passages(&[a, b]), vec![0, 1]);
    }
}
