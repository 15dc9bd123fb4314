//! The text units every answer step shares: the language of a question, its words and Han
//! characters, stems, stop words and sentences.

pub(crate) use engram_fusion::is_han;
use engram_fusion::MAX_EVIDENCE_CHARS;

/// Han characters that say what kind of question it is or join its words ("什么", "多少",
/// "的"): a pair of two of them says nothing about the topic and is not counted.
pub(crate) const FUNCTION_CHARS: &str = "的了是在有和与及或也都就而之其这那个些什么哪谁几多少吗呢吧怎样如何为被把对从于由中上下到将以会可能要所年月日";

/// Whether `question` is written mostly in ASCII letters: the embedder's language, judged by
/// the cosine floors.
pub(crate) fn is_english(question: &str) -> bool {
    let (ascii, letters) = question
        .chars()
        .filter(|c| c.is_alphabetic())
        .fold((0usize, 0usize), |(a, l), c| {
            (a + usize::from(c.is_ascii()), l + 1)
        });
    letters > 0 && ascii * 4 >= letters * 3
}

/// English words that carry no topic: a question's content words are the others.
pub(crate) const STOP_WORDS: [&str; 96] = [
    "a", "about", "after", "all", "also", "an", "and", "any", "are", "as", "at", "be", "been",
    "before", "being", "but", "by", "can", "could", "did", "do", "does", "done", "during", "each",
    "for", "from", "get", "gets", "got", "had", "has", "have", "he", "her", "his", "how", "i",
    "if", "in", "into", "is", "it", "its", "many", "may", "me", "might", "more", "most", "much",
    "must", "my", "no", "not", "of", "on", "one", "or", "other", "our", "she", "should", "so",
    "some", "than", "that", "the", "their", "them", "then", "there", "these", "they", "this",
    "those", "to", "up", "was", "we", "were", "what", "when", "where", "which", "who", "whom",
    "whose", "why", "will", "with", "would", "you", "your", "s", "t",
];

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
pub(crate) fn ends_clause(c: char) -> bool {
    matches!(c, '，' | ',' | '：' | ':')
}

/// `text`'s first `max` characters.
pub(crate) fn cut_chars(text: &str, max: usize) -> &str {
    text.char_indices()
        .nth(max)
        .map_or(text, |(i, _)| &text[..i])
}

/// `text` cut after each character `ends(c, next)` accepts, pieces trimmed, empty ones left out.
pub(crate) fn split_after(text: &str, ends: impl Fn(char, Option<char>) -> bool) -> Vec<&str> {
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

/// A word cut to what its inflections share: its Snowball English stem ("passwords",
/// "changed" and "change" give "password" and "chang"), then at most six characters
/// ("kilometres" and "kilometers" meet). Numbers stay whole.
pub(crate) fn stem(word: &str) -> String {
    if word.chars().all(|c| c.is_ascii_digit()) {
        return word.to_owned();
    }
    frostem::Stemmer::new(frostem::Algorithm::English)
        .stem(word)
        .chars()
        .take(6)
        .collect()
}

/// Calls `f` with each unit of `text` in order: a lower-cased run of letters and digits, or a
/// single Han character (Chinese has no spaces).
pub(crate) fn for_each_unit(text: &str, mut f: impl FnMut(&str)) {
    let mut word = String::new();
    for c in text.chars() {
        if is_han(c) {
            if !word.is_empty() {
                f(&word);
                word.clear();
            }
            let mut b = [0u8; 4];
            f(c.encode_utf8(&mut b));
        } else if c.is_alphanumeric() {
            word.extend(c.to_lowercase());
        } else if !word.is_empty() {
            f(&word);
            word.clear();
        }
    }
    if !word.is_empty() {
        f(&word);
    }
}
