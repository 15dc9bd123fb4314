//! Text analysis: the English and Chinese analyzers and the choice between them by script.

use std::sync::LazyLock;

use jieba_rs::{Jieba, TokenizeMode};
use tantivy::tokenizer::{
    Language, LowerCaser, RemoveLongFilter, SimpleTokenizer, Stemmer, StopWordFilter, TextAnalyzer,
    Token, TokenStream, Tokenizer,
};

/// Name under which the English analyzer is registered with tantivy.
pub(crate) const EN_ANALYZER: &str = "engram_en";
/// Name under which the Chinese analyzer is registered with tantivy.
pub(crate) const ZH_ANALYZER: &str = "engram_zh";

/// Tokens longer than this many bytes are dropped: base64 blobs, hashes and URLs only bloat the
/// term dictionary (tantivy's default is 40; a Chinese word is rarely over 5 characters, 15
/// bytes).
const MAX_TOKEN_BYTES: usize = 40;

/// A chunk whose letters and digits are at least this share of Han characters is indexed as
/// Chinese. A Han character carries about as much as a short English word, so a quarter by
/// character count already means most of the content is Chinese; English terms inside a
/// Chinese chunk are still indexed (jieba passes them through, lowercased).
const CJK_SHARE_FOR_CHINESE: f32 = 0.25;

/// Structural particles, conjunctions and copulas that appear in nearly every Chinese chunk;
/// a short list on purpose: content words, pronouns and negations stay searchable.
const CHINESE_STOP_WORDS: &[&str] = &[
    "的", "地", "得", "了", "着", "过", "是", "在", "和", "与", "及", "或", "而", "之", "其", "也",
    "都", "就", "把", "被", "对", "从", "这", "那", "个", "吗", "呢", "吧", "啊",
];

/// The jieba dictionary, loaded once per process (it takes ~100 ms and tens of MB) and shared by
/// every index.
static JIEBA: LazyLock<Jieba> = LazyLock::new(Jieba::new);

/// Simple tokenizer, long-token removal, lowercase, English stop words, Snowball English stemmer
/// (the Lucene `EnglishAnalyzer` chain that Anserini's BM25 baselines use).
pub(crate) fn english() -> TextAnalyzer {
    let builder = TextAnalyzer::builder(SimpleTokenizer::default())
        .filter(RemoveLongFilter::limit(MAX_TOKEN_BYTES))
        .filter(LowerCaser);
    match StopWordFilter::new(Language::English) {
        Some(stop) => builder
            .filter(stop)
            .filter(Stemmer::new(Language::English))
            .build(),
        None => builder.filter(Stemmer::new(Language::English)).build(),
    }
}

/// jieba in search mode (overlapping sub-words as well as whole words), lowercased, punctuation,
/// whitespace and a few particles dropped.
pub(crate) fn chinese() -> TextAnalyzer {
    let stop = CHINESE_STOP_WORDS.iter().map(|w| w.to_string());
    TextAnalyzer::builder(JiebaTokenizer)
        .filter(RemoveLongFilter::limit(MAX_TOKEN_BYTES))
        .filter(LowerCaser)
        .filter(StopWordFilter::remove(stop))
        .build()
}

/// Which analyzer (and field) a text belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Script {
    English,
    Chinese,
}

impl Script {
    pub(crate) fn of(text: &str) -> Script {
        let (mut han, mut alnum) = (0usize, 0usize);
        for c in text.chars().filter(|c| c.is_alphanumeric()) {
            alnum += 1;
            if is_han(c) {
                han += 1;
            }
        }
        if han > 0 && han as f32 >= CJK_SHARE_FOR_CHINESE * alnum as f32 {
            Script::Chinese
        } else {
            Script::English
        }
    }

    pub(crate) fn analyzer(self) -> TextAnalyzer {
        match self {
            Script::English => english(),
            Script::Chinese => chinese(),
        }
    }
}

/// CJK unified ideographs (basic block, extension A, compatibility ideographs, extensions B+).
fn is_han(c: char) -> bool {
    matches!(c as u32,
        0x4E00..=0x9FFF | 0x3400..=0x4DBF | 0xF900..=0xFAFF | 0x20000..=0x3134F)
}

/// The terms `analyzer` makes of `text`, each with its byte range in `text`.
pub(crate) fn tokens(analyzer: &mut TextAnalyzer, text: &str) -> Vec<(String, usize, usize)> {
    let mut out = Vec::new();
    let mut stream = analyzer.token_stream(text);
    while stream.advance() {
        let t = stream.token();
        out.push((t.text.clone(), t.offset_from, t.offset_to));
    }
    out
}

/// tantivy adapter for jieba. Offsets are byte offsets into the input, as tantivy expects.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct JiebaTokenizer;

pub(crate) struct JiebaTokenStream {
    tokens: Vec<Token>,
    next: usize,
}

impl Tokenizer for JiebaTokenizer {
    type TokenStream<'a> = JiebaTokenStream;

    fn token_stream<'a>(&'a mut self, text: &'a str) -> JiebaTokenStream {
        let tokens = JIEBA
            .tokenize(text, TokenizeMode::Search, true)
            .into_iter()
            .filter(|t| t.word.chars().any(char::is_alphanumeric))
            .enumerate()
            .map(|(position, t)| Token {
                offset_from: t.byte_start,
                offset_to: t.byte_end,
                position,
                text: t.word.to_string(),
                position_length: 1,
            })
            .collect();
        JiebaTokenStream { tokens, next: 0 }
    }
}

impl TokenStream for JiebaTokenStream {
    fn advance(&mut self) -> bool {
        if self.next < self.tokens.len() {
            self.next += 1;
            true
        } else {
            false
        }
    }

    fn token(&self) -> &Token {
        &self.tokens[self.next - 1]
    }

    fn token_mut(&mut self) -> &mut Token {
        &mut self.tokens[self.next - 1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn terms(mut a: TextAnalyzer, text: &str) -> Vec<String> {
        tokens(&mut a, text).into_iter().map(|t| t.0).collect()
    }

    #[test]
    fn english_stems_lowercases_and_drops_stop_words() {
        assert_eq!(
            terms(english(), "The Runner was RUNNING and runs"),
            ["runner", "run", "run"]
        );
    }

    #[test]
    fn chinese_segments_in_search_mode_and_drops_punctuation() {
        let t = terms(chinese(), "我来到北京清华大学，学习 Rust。");
        assert!(t.contains(&"清华".to_string()), "{t:?}");
        assert!(t.contains(&"清华大学".to_string()), "{t:?}");
        assert!(t.contains(&"rust".to_string()), "{t:?}");
        assert!(
            !t.iter()
                .any(|w| w == "，" || w == "。" || w.trim().is_empty()),
            "{t:?}"
        );
    }

    #[test]
    fn chinese_offsets_are_bytes() {
        let text = "你好，世界";
        for (word, from, to) in tokens(&mut chinese(), text) {
            assert_eq!(&text[from..to], word);
        }
    }

    #[test]
    fn script_detection() {
        assert_eq!(Script::of("plain English text"), Script::English);
        assert_eq!(Script::of("我来到北京清华大学"), Script::Chinese);
        assert_eq!(Script::of("使用 tantivy 建立索引"), Script::Chinese);
        assert_eq!(
            Script::of("A long English paragraph that quotes one word: 你好"),
            Script::English
        );
        assert_eq!(Script::of(""), Script::English);
    }
}
