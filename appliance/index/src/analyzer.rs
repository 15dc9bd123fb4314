//! Text analysis: one analyzer for every chunk and query, which segments text by script.
//!
//! Runs of Han characters go to jieba (search mode), everything else to tantivy's
//! letters-and-digits words; then lowercase, English and Chinese stop words, the English
//! stemmer (which leaves Han words as they are). A mostly English document that quotes a Chinese
//! sentence is searchable by that sentence's words, and a Chinese document by its English terms,
//! whatever the share of either script.

use std::sync::LazyLock;

use jieba_rs::{Jieba, TokenizeMode};
use tantivy::tokenizer::{
    Language, LowerCaser, RemoveLongFilter, Stemmer, StopWordFilter, TextAnalyzer, Token,
    TokenStream, Tokenizer,
};

/// Name under which the analyzer is registered with tantivy.
pub(crate) const ANALYZER: &str = "engram_text";

/// Tokens longer than this many bytes are dropped: base64 blobs, hashes and URLs only bloat the
/// term dictionary (tantivy's default is 40; a Chinese word is rarely over 5 characters, 15
/// bytes).
const MAX_TOKEN_BYTES: usize = 40;

/// Structural particles, conjunctions and copulas that appear in nearly every Chinese chunk;
/// a short list on purpose: content words, pronouns and negations stay searchable.
const CHINESE_STOP_WORDS: &[&str] = &[
    "的", "地", "得", "了", "着", "过", "是", "在", "和", "与", "及", "或", "而", "之", "其", "也",
    "都", "就", "把", "被", "对", "从", "这", "那", "个", "吗", "呢", "吧", "啊",
];

/// The jieba dictionary, loaded once per process (it takes ~100 ms and tens of MB) and shared by
/// every index.
static JIEBA: LazyLock<Jieba> = LazyLock::new(Jieba::new);

/// The script-segmenting tokenizer, long-token removal, lowercase, English then Chinese stop
/// words, the Snowball English stemmer (for the Latin words: the Lucene `EnglishAnalyzer` chain
/// that Anserini's BM25 baselines use).
pub(crate) fn text() -> TextAnalyzer {
    let english_stop = StopWordFilter::new(Language::English)
        .unwrap_or_else(|| StopWordFilter::remove(Vec::new()));
    let chinese_stop = StopWordFilter::remove(CHINESE_STOP_WORDS.iter().map(|w| w.to_string()));
    TextAnalyzer::builder(ScriptTokenizer)
        .filter(RemoveLongFilter::limit(MAX_TOKEN_BYTES))
        .filter(LowerCaser)
        .filter(english_stop)
        .filter(chinese_stop)
        .filter(Stemmer::new(Language::English))
        .build()
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

/// Splits text into runs of Han and of other characters: a Han run becomes jieba's words (search
/// mode: the sub-words of a long word too), any other run its maximal runs of letters and digits
/// (tantivy's `SimpleTokenizer`). Offsets are byte offsets into the input, as tantivy expects.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ScriptTokenizer;

pub(crate) struct ScriptTokenStream {
    tokens: Vec<Token>,
    next: usize,
}

impl Tokenizer for ScriptTokenizer {
    type TokenStream<'a> = ScriptTokenStream;

    fn token_stream<'a>(&'a mut self, text: &'a str) -> ScriptTokenStream {
        let mut tokens = Vec::new();
        let mut push = |from: usize, to: usize| {
            tokens.push(Token {
                offset_from: from,
                offset_to: to,
                position: tokens.len(),
                text: text[from..to].to_string(),
                position_length: 1,
            })
        };
        let mut rest = text.char_indices().peekable();
        while let Some(&(start, c)) = rest.peek() {
            let han = is_han(c);
            let mut end = start;
            while let Some(&(i, c)) = rest.peek() {
                if is_han(c) != han {
                    break;
                }
                end = i + c.len_utf8();
                rest.next();
            }
            let run = &text[start..end];
            if han {
                for t in JIEBA.tokenize(run, TokenizeMode::Search, true) {
                    push(start + t.byte_start, start + t.byte_end);
                }
            } else {
                let mut word: Option<usize> = None;
                for (i, c) in run.char_indices() {
                    match (c.is_alphanumeric(), word) {
                        (true, None) => word = Some(i),
                        (false, Some(from)) => {
                            push(start + from, start + i);
                            word = None;
                        }
                        _ => {}
                    }
                }
                if let Some(from) = word {
                    push(start + from, end);
                }
            }
        }
        ScriptTokenStream { tokens, next: 0 }
    }
}

impl TokenStream for ScriptTokenStream {
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

    fn terms(text_: &str) -> Vec<String> {
        tokens(&mut text(), text_)
            .into_iter()
            .map(|t| t.0)
            .collect()
    }

    #[test]
    fn english_stems_lowercases_and_drops_stop_words() {
        assert_eq!(
            terms("The Runner was RUNNING and runs"),
            ["runner", "run", "run"]
        );
    }

    #[test]
    fn chinese_segments_in_search_mode_and_drops_punctuation() {
        let t = terms("我来到北京清华大学，学习 Rust。");
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
    fn offsets_are_bytes_of_the_input() {
        let text_ = "你好，世界 and the Worlds of 北京2024年";
        let mut unstemmed = TextAnalyzer::builder(ScriptTokenizer).build();
        let got = tokens(&mut unstemmed, text_);
        assert!(!got.is_empty());
        for (word, from, to) in got {
            assert_eq!(&text_[from..to], word);
        }
    }

    #[test]
    fn a_chinese_sentence_inside_english_text_is_segmented() {
        // Under the old per-chunk choice this text was English and the Chinese sentence one
        // unsearchable 30-byte token.
        let t = terms(
            "Passwords are checked at every sign-in. 新密码至少需要8个字符。 Reset them from the console.",
        );
        for w in [
            "密码", "至少", "需要", "字符", "8", "password", "check", "consol",
        ] {
            assert!(t.contains(&w.to_string()), "{w} missing from {t:?}");
        }
    }

    #[test]
    fn english_words_inside_chinese_text_are_stemmed_and_han_words_untouched() {
        let t = terms("使用 Indexes 建立索引，searching 搜索");
        for w in ["使用", "index", "建立", "索引", "search", "搜索"] {
            assert!(t.contains(&w.to_string()), "{w} missing from {t:?}");
        }
    }
}
