//! Token-aware chunking: splits a document's text into overlapping spans of at most N LLM
//! tokens, cutting at paragraph, then sentence, then line, clause, word and character
//! boundaries, in English and Chinese.
//!
//! Tokens are counted with the LLM's tokenizer ([`TokenCounter`]) because each chunk's KV cache
//! is computed and stored later: a chunk's size is what it costs in the model's context. Spans
//! are byte and char ranges into the text, never cutting a UTF-8 character, so a citation can
//! highlight exactly the chunk.
//!
//! For each chunk the chunker finds the furthest end that still fits (a galloping then binary
//! search over char boundaries, counting the candidate span each time), then looks back over
//! the second half of that window for the strongest boundary and cuts there. The next chunk
//! starts up to `overlap_tokens` before the cut: at the first sentence start inside that
//! window, or else at its first word boundary.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::{KbError, Result};

/// Counts the tokens a text costs in the model that will read it.
pub trait TokenCounter: Send + Sync {
    /// Tokens of `text` without special tokens (no BOS).
    fn count(&self, text: &str) -> usize;

    /// Where each token of `text` ends, in bytes from its start, when the tokenizer can say
    /// (its tokens' bytes add up to the text). The chunker then finds a chunk's end from one
    /// encoding of a window instead of a search that encodes a dozen candidate spans; every
    /// chunk's count is still checked with [`count`](Self::count). `None`: no such shortcut.
    fn token_ends(&self, text: &str) -> Option<Vec<usize>> {
        let _ = text;
        None
    }
}

/// The LLM's own tokenizer. A text it cannot encode (it has no such failure today) counts as
/// its byte length, the most a byte-level BPE can produce, so a chunk never overflows.
impl TokenCounter for engram_tokenizer::Tokenizer {
    fn count(&self, text: &str) -> usize {
        self.encode(text, false).map_or(text.len(), |ids| ids.len())
    }

    fn token_ends(&self, text: &str) -> Option<Vec<usize>> {
        self.encode_with_ends(text, false).ok()?.1
    }
}

/// Default chunk size in LLM tokens: a few paragraphs, small enough that a question's top
/// chunks fit a small model's context with room for the answer, and about what
/// all-MiniLM-L6-v2 reads (256 word pieces) before it truncates.
pub const DEFAULT_CHUNK_TOKENS: usize = 256;

/// Default overlap in LLM tokens between neighbouring chunks: about one sentence, so a fact
/// that straddles a cut is whole in at least one chunk.
pub const DEFAULT_OVERLAP_TOKENS: usize = 32;

/// The smallest chunk size accepted: below it a chunk holds less than a sentence, and one
/// UTF-8 character (at most 4 byte tokens) always fits.
pub const MIN_CHUNK_TOKENS: usize = 16;

/// The largest chunk size accepted: beyond the context of the models the appliance runs.
pub const MAX_CHUNK_TOKENS: usize = 8192;

/// Of the window that fits, the share (in bytes) a cut may give up to land on a stronger
/// boundary. One half: a paragraph break in the second half beats a sentence end at the limit.
const MIN_FILL: f64 = 0.5;

/// First guess of bytes per token when sizing the search window (English averages ~4.5,
/// Chinese ~2.5 with SmolLM2's tokenizer); the window doubles until it holds a whole chunk.
const BYTES_PER_TOKEN_GUESS: usize = 4;

/// Most bytes per token assumed when looking back for the overlap's start.
const MAX_BYTES_PER_TOKEN: usize = 16;

/// How big chunks are and how much neighbours share.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkConfig {
    /// Most LLM tokens in one chunk.
    pub max_tokens: usize,
    /// LLM tokens (at most) that a chunk repeats from the end of the one before.
    pub overlap_tokens: usize,
}

impl Default for ChunkConfig {
    fn default() -> ChunkConfig {
        ChunkConfig {
            max_tokens: DEFAULT_CHUNK_TOKENS,
            overlap_tokens: DEFAULT_OVERLAP_TOKENS,
        }
    }
}

impl ChunkConfig {
    /// Checks the bounds: `MIN_CHUNK_TOKENS..=MAX_CHUNK_TOKENS`, overlap at most half a chunk.
    pub fn validate(&self) -> Result<()> {
        if !(MIN_CHUNK_TOKENS..=MAX_CHUNK_TOKENS).contains(&self.max_tokens) {
            return Err(KbError::invalid(
                "chunk_tokens",
                format!(
                    "must be in {MIN_CHUNK_TOKENS}..={MAX_CHUNK_TOKENS}, got {}",
                    self.max_tokens
                ),
            ));
        }
        if self.overlap_tokens > self.max_tokens / 2 {
            return Err(KbError::invalid(
                "overlap_tokens",
                format!(
                    "must be at most half of chunk_tokens ({}), got {}",
                    self.max_tokens / 2,
                    self.overlap_tokens
                ),
            ));
        }
        Ok(())
    }
}

/// Where one chunk lies in the text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkSpan {
    /// Byte range in the text (on char boundaries; no leading or trailing whitespace).
    pub bytes: Range<usize>,
    /// The same range counted in Unicode scalar values.
    pub chars: Range<usize>,
    /// LLM tokens of `text[bytes]`.
    pub tokens: usize,
}

/// How good a place to cut is, weakest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Level {
    /// Any char boundary (inside a word, or inside whitespace).
    Char,
    /// After spaces, or between two CJK characters.
    Word,
    /// After a comma, colon, `，`, `、` or `：`.
    Clause,
    /// After a single line break.
    Line,
    /// After `.`, `!` or `?` and whitespace, or after `。`, `！`, `？`, `；`.
    Sentence,
    /// After a blank line, or the end of the text.
    Paragraph,
}

/// Splits `text` into chunks of at most `cfg.max_tokens` tokens (one character may exceed a
/// limit below 4 tokens, which [`ChunkConfig::validate`] rules out). Whitespace-only stretches
/// between chunks belong to none; every other byte is in at least one chunk.
pub fn chunk_text(text: &str, cfg: &ChunkConfig, counter: &dyn TokenCounter) -> Vec<ChunkSpan> {
    Chunker::new(text, *cfg, counter).collect()
}

/// [`chunk_text`] one chunk at a time: a caller can report progress ([`Chunker::position`])
/// and stop between chunks of a large text.
pub struct Chunker<'t> {
    text: &'t str,
    cfg: ChunkConfig,
    counter: &'t dyn TokenCounter,
    chars: CharIndex,
    /// Start of the next chunk; `None` once the text is done.
    next: Option<usize>,
    /// End of the previous chunk: the next one must reach past it.
    prev_end: usize,
}

impl<'t> Chunker<'t> {
    pub fn new(text: &'t str, cfg: ChunkConfig, counter: &'t dyn TokenCounter) -> Chunker<'t> {
        Chunker {
            text,
            cfg,
            counter,
            chars: CharIndex::default(),
            next: skip_ws(text, 0),
            prev_end: 0,
        }
    }

    /// Bytes of the text behind the next chunk's start (the text's length when done).
    pub fn position(&self) -> usize {
        self.next.unwrap_or(self.text.len())
    }
}

impl Iterator for Chunker<'_> {
    type Item = ChunkSpan;

    fn next(&mut self) -> Option<ChunkSpan> {
        let (text, cfg, counter) = (self.text, &self.cfg, self.counter);
        loop {
            let s = self.next?;
            let count = |e: usize| counter.count(&text[s..trim_end(text, s, e)]);
            let fits = fast_fit(text, s, cfg.max_tokens, counter, &count)
                .unwrap_or_else(|| furthest_fit(text, s, cfg.max_tokens, &count));
            let mut end = if fits.0 == text.len() {
                fits.0
            } else {
                let floor = floor_char(text, s + ((fits.0 - s) as f64 * MIN_FILL) as usize);
                best_boundary(text, floor.max(self.prev_end), fits.0).unwrap_or(fits.0)
            };
            let mut tokens = if end == fits.0 { fits.1 } else { count(end) };
            if tokens > cfg.max_tokens {
                // Token counts are not quite monotone in the span's end; the search's own point
                // fits.
                end = fits.0;
                tokens = fits.1;
            }
            if end <= self.prev_end {
                // Only after an overlap that left no room (not seen with real tokenizers): drop
                // it.
                self.next = Some(self.prev_end);
                continue;
            }
            let e = trim_end(text, s, end);
            let span = ChunkSpan {
                bytes: s..e,
                chars: self.chars.at(text, s)..self.chars.at(text, e),
                tokens,
            };
            self.next = skip_ws(text, end).map(|next| {
                overlap_start(text, s, end, cfg.overlap_tokens, counter)
                    .filter(|&o| o > s)
                    .unwrap_or(next)
            });
            self.prev_end = end;
            return Some(span);
        }
    }
}

/// [`furthest_fit`] from one encoding of a window: the end of the window's `max`-th token
/// (the window widens until it holds more than `max` tokens or reaches the end), checked with
/// one exact count. `None` when the counter has no token ends or the check fails (token
/// boundaries near a cut can differ from a whole-window encoding): the search runs instead.
fn fast_fit(
    text: &str,
    s: usize,
    max: usize,
    counter: &dyn TokenCounter,
    count: &dyn Fn(usize) -> usize,
) -> Option<(usize, usize)> {
    let mut width = max.saturating_mul(FAST_FIT_BYTES_PER_TOKEN);
    loop {
        let e = floor_char(text, s.saturating_add(width).min(text.len()));
        if e <= s {
            return None;
        }
        let ends = counter.token_ends(&text[s..e])?;
        let cut = if ends.len() > max {
            // Up to the next token's first visible character: the whitespace before it costs
            // nothing once trimmed, and the boundary there is what the search would judge.
            let at = floor_char(text, s + ends[max - 1]);
            skip_ws(text, at).unwrap_or(text.len())
        } else if e == text.len() {
            e
        } else {
            width = width.saturating_mul(2);
            continue;
        };
        if cut <= s {
            return None;
        }
        let c = count(cut);
        return (c <= max).then_some((cut, c));
    }
}

/// Bytes per token the fast fit's first window allows for: more than any tokenizer here
/// averages (English about 4.5, Chinese about 2.5 with SmolLM2), so one encoding usually holds
/// a whole chunk.
const FAST_FIT_BYTES_PER_TOKEN: usize = 8;

/// The largest end `e` (a char boundary after `s`) with `count(e) <= max`, and its count; at
/// least one character.
fn furthest_fit(
    text: &str,
    s: usize,
    max: usize,
    count: &dyn Fn(usize) -> usize,
) -> (usize, usize) {
    let first = next_char(text, s);
    let mut ok = (first, count(first));
    if ok.1 > max || first == text.len() {
        return ok;
    }
    let mut width = max * BYTES_PER_TOKEN_GUESS;
    let mut bad = loop {
        let e = floor_char(text, s.saturating_add(width).min(text.len()));
        if e <= ok.0 {
            // The window ends inside the first (multi-byte) character: widen it.
            width = width.saturating_mul(2);
            continue;
        }
        let c = count(e);
        if c > max {
            break e;
        }
        ok = (e, c);
        if e == text.len() {
            return ok;
        }
        width = width.saturating_mul(2);
    };
    while next_char(text, ok.0) < bad {
        let mut mid = floor_char(text, ok.0 + (bad - ok.0) / 2);
        if mid <= ok.0 {
            mid = next_char(text, ok.0);
        }
        let c = count(mid);
        if c <= max {
            ok = (mid, c);
        } else {
            bad = mid;
        }
    }
    ok
}

/// The strongest boundary in `(lo, hi]`, the latest of equals; `None` when all are `Char`.
fn best_boundary(text: &str, lo: usize, hi: usize) -> Option<usize> {
    if lo >= hi {
        return None;
    }
    let mut best: Option<(Level, usize)> = None;
    for (i, _) in text[lo..hi].char_indices().skip(1) {
        let p = lo + i;
        let level = level_at(text, p);
        if level > Level::Char && best.is_none_or(|(l, _)| level >= l) {
            best = Some((level, p));
        }
    }
    let end = level_at(text, hi);
    if end > Level::Char && best.is_none_or(|(l, _)| end >= l) {
        best = Some((end, hi));
    }
    best.map(|(_, p)| p)
}

/// Where the chunk after `[s, end)` starts so that it repeats at most `overlap` tokens: the
/// first sentence start in the overlap window, else its first word boundary.
fn overlap_start(
    text: &str,
    s: usize,
    end: usize,
    overlap: usize,
    counter: &dyn TokenCounter,
) -> Option<usize> {
    if overlap == 0 {
        return None;
    }
    let lo = floor_char(
        text,
        end.saturating_sub(overlap * MAX_BYTES_PER_TOKEN).max(s),
    );
    let words: Vec<(usize, Level)> = text[lo..end]
        .char_indices()
        .map(|(i, _)| lo + i)
        .filter(|&p| p > s)
        .map(|p| (p, level_at(text, p)))
        .filter(|&(_, l)| l >= Level::Word)
        .collect();
    // Counts fall as the start moves right: find the first boundary whose tail fits.
    let tail = |p: usize| counter.count(&text[p..trim_end(text, p, end)]);
    let (mut lo_i, mut hi_i) = (0, words.len());
    while lo_i < hi_i {
        let mid = (lo_i + hi_i) / 2;
        if tail(words[mid].0) <= overlap {
            hi_i = mid;
        } else {
            lo_i = mid + 1;
        }
    }
    let window = &words[lo_i..];
    window
        .iter()
        .find(|&&(_, l)| l >= Level::Sentence)
        .or(window.first())
        .map(|&(p, _)| p)
}

/// The boundary level of char boundary `p` (0 < p <= len).
fn level_at(text: &str, p: usize) -> Level {
    let Some(next) = text[p..].chars().next() else {
        return Level::Paragraph;
    };
    let Some(prev) = text[..p].chars().next_back() else {
        return Level::Char;
    };
    if next.is_whitespace() {
        return Level::Char;
    }
    if prev.is_whitespace() {
        let before = text[..p].trim_end_matches(char::is_whitespace);
        let newlines = text[before.len()..p].matches('\n').count();
        if newlines >= 2 {
            return Level::Paragraph;
        }
        let last = before.trim_end_matches(is_closing).chars().next_back();
        return match last {
            Some(c) if is_terminator(c) || is_cjk_terminator(c) => Level::Sentence,
            _ if newlines == 1 => Level::Line,
            Some(c) if is_clause(c) => Level::Clause,
            _ => Level::Word,
        };
    }
    let last = text[..p].trim_end_matches(is_closing).chars().next_back();
    match last {
        Some(c) if is_cjk_terminator(c) && !is_closing(next) => Level::Sentence,
        Some(c) if is_cjk_clause(c) && !is_closing(next) => Level::Clause,
        _ if is_cjk(prev) || is_cjk(next) => Level::Word,
        _ => Level::Char,
    }
}

/// Ends an English sentence when whitespace follows.
fn is_terminator(c: char) -> bool {
    matches!(c, '.' | '!' | '?')
}

/// Ends a Chinese sentence (full-width punctuation, no space needed).
fn is_cjk_terminator(c: char) -> bool {
    matches!(c, '。' | '！' | '？' | '；' | '!' | '?')
}

/// Ends a clause when whitespace follows.
fn is_clause(c: char) -> bool {
    matches!(c, ',' | ';' | ':') || is_cjk_clause(c)
}

/// Ends a Chinese clause.
fn is_cjk_clause(c: char) -> bool {
    matches!(c, '，' | '、' | '：')
}

/// Closing quotes and brackets that may follow a sentence's end.
fn is_closing(c: char) -> bool {
    matches!(
        c,
        '"' | '\'' | ')' | ']' | '}' | '”' | '’' | '」' | '』' | '）' | '》' | '】'
    )
}

/// Scripts written without spaces between words: any boundary between two such characters is
/// as good as a word boundary.
fn is_cjk(c: char) -> bool {
    matches!(c as u32,
        0x3040..=0x30FF     // Hiragana, Katakana
        | 0x3400..=0x4DBF   // CJK Extension A
        | 0x4E00..=0x9FFF   // CJK Unified Ideographs
        | 0xF900..=0xFAFF   // CJK Compatibility Ideographs
        | 0x20000..=0x2FFFF // CJK Extensions B..F
        | 0x3000..=0x303F   // CJK punctuation
        | 0xFF00..=0xFFEF   // full-width forms
    )
}

/// `p` moved back over whitespace, but not before `s`.
fn trim_end(text: &str, s: usize, p: usize) -> usize {
    s + text[s..p].trim_end().len()
}

/// The first non-whitespace byte at or after `p`, or `None` at the end.
fn skip_ws(text: &str, p: usize) -> Option<usize> {
    let rest = &text[p..];
    let skipped = rest.len() - rest.trim_start().len();
    (p + skipped < text.len()).then_some(p + skipped)
}

/// The char boundary after the char at `p` (`p` itself at the end).
fn next_char(text: &str, p: usize) -> usize {
    text[p..].chars().next().map_or(p, |c| p + c.len_utf8())
}

/// The largest char boundary at or before `p`.
fn floor_char(text: &str, mut p: usize) -> usize {
    while !text.is_char_boundary(p) {
        p -= 1;
    }
    p
}

/// Byte offset to char offset, walking from the last position asked (chunks move forward,
/// with small steps back for the overlap, so the walk stays short).
#[derive(Default)]
struct CharIndex {
    byte: usize,
    char: usize,
}

impl CharIndex {
    fn at(&mut self, text: &str, p: usize) -> usize {
        if p >= self.byte {
            self.char += text[self.byte..p].chars().count();
        } else {
            self.char -= text[p..self.byte].chars().count();
        }
        self.byte = p;
        self.char
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One token per ASCII word (run of alphanumerics) and per other non-space character: a
    /// stand-in for a subword tokenizer with the same shape of behaviour.
    struct WordCounter;

    impl TokenCounter for WordCounter {
        fn count(&self, text: &str) -> usize {
            let mut n = 0;
            let mut in_word = false;
            for c in text.chars() {
                if c.is_ascii_alphanumeric() {
                    if !in_word {
                        n += 1;
                    }
                    in_word = true;
                } else {
                    in_word = false;
                    if !c.is_whitespace() {
                        n += 1;
                    }
                }
            }
            n
        }
    }

    /// [`WordCounter`] that also reports its token ends, so the chunker takes the fast fit.
    struct EndsCounter;

    impl TokenCounter for EndsCounter {
        fn count(&self, text: &str) -> usize {
            WordCounter.count(text)
        }

        fn token_ends(&self, text: &str) -> Option<Vec<usize>> {
            let mut ends = Vec::new();
            let mut word_end = None;
            for (i, c) in text.char_indices() {
                let end = i + c.len_utf8();
                if c.is_ascii_alphanumeric() {
                    word_end = Some(end);
                    continue;
                }
                if let Some(e) = word_end.take() {
                    ends.push(e);
                }
                if !c.is_whitespace() {
                    ends.push(end);
                }
            }
            ends.extend(word_end);
            Some(ends)
        }
    }

    fn cfg(max: usize, overlap: usize) -> ChunkConfig {
        ChunkConfig {
            max_tokens: max,
            overlap_tokens: overlap,
        }
    }

    fn texts(text: &str, spans: &[ChunkSpan]) -> Vec<String> {
        spans.iter().map(|c| text[c.bytes.clone()].into()).collect()
    }

    /// Every check the property tests make.
    fn check(text: &str, c: &ChunkConfig, spans: &[ChunkSpan]) {
        let mut covered = vec![false; text.len()];
        let mut last_start = None;
        for span in spans {
            assert!(
                text.is_char_boundary(span.bytes.start) && text.is_char_boundary(span.bytes.end)
            );
            assert!(span.bytes.start < span.bytes.end, "empty chunk {span:?}");
            let piece = &text[span.bytes.clone()];
            assert_eq!(piece.trim(), piece, "chunk {span:?} is not trimmed");
            assert_eq!(text[..span.bytes.start].chars().count(), span.chars.start);
            assert_eq!(piece.chars().count(), span.chars.len());
            assert_eq!(WordCounter.count(piece), span.tokens);
            assert!(
                span.tokens <= c.max_tokens,
                "{} > {}",
                span.tokens,
                c.max_tokens
            );
            assert!(last_start < Some(span.bytes.start), "starts go forward");
            last_start = Some(span.bytes.start);
            covered[span.bytes.clone()]
                .iter_mut()
                .for_each(|b| *b = true);
        }
        for (i, ch) in text.char_indices() {
            if !ch.is_whitespace() {
                assert!(covered[i], "byte {i} ({ch:?}) is in no chunk");
            }
        }
    }

    #[test]
    fn short_text_is_one_chunk() {
        let text = "  Hello world.  ";
        let spans = chunk_text(text, &cfg(16, 4), &WordCounter);
        assert_eq!(texts(text, &spans), ["Hello world."]);
        assert_eq!(spans[0].bytes, 2..14);
        assert_eq!(spans[0].chars, 2..14);
        assert!(chunk_text(" \n\t ", &cfg(16, 4), &WordCounter).is_empty());
        assert!(chunk_text("", &cfg(16, 4), &WordCounter).is_empty());
    }

    #[test]
    fn prefers_paragraphs_then_sentences() {
        let sentence = |w: &str| format!("{w} {w} {w} {w} {w} {w} {w}.");
        let a = format!("{} {}", sentence("a"), sentence("x"));
        let text = format!("{a}\n\n{} {}", sentence("b"), sentence("c"));
        // 8 tokens a sentence: two paragraphs of 16 tokens. At 20 tokens the paragraph break
        // (16) wins over the sentence end that would fill the chunk.
        let spans = chunk_text(&text, &cfg(20, 0), &WordCounter);
        assert_eq!(
            texts(&text, &spans),
            [a.clone(), format!("{} {}", sentence("b"), sentence("c"))]
        );
        let spans = chunk_text(&text, &cfg(12, 0), &WordCounter);
        assert_eq!(
            texts(&text, &spans),
            [sentence("a"), sentence("x"), sentence("b"), sentence("c")]
        );
    }

    #[test]
    fn chinese_sentences_split_at_full_stops() {
        let s1 = "今天天气很好，我们去公园散步。";
        let s2 = "公园里有很多人在跑步！";
        let s3 = "你想一起来吗？";
        let text = format!("{s1}{s2}{s3}");
        // 15 + 11 + 7 characters, one token each.
        let spans = chunk_text(&text, &cfg(27, 0), &WordCounter);
        assert_eq!(texts(&text, &spans), [format!("{s1}{s2}"), s3.to_string()]);
        assert_eq!(spans[1].chars, 26..33);
        let spans = chunk_text(&text, &cfg(17, 0), &WordCounter);
        assert_eq!(texts(&text, &spans), [s1, s2, s3]);
    }

    #[test]
    fn huge_sentence_splits_at_words_then_chars() {
        let text = "word ".repeat(100);
        let spans = chunk_text(&text, &cfg(16, 4), &WordCounter);
        check(&text, &cfg(16, 4), &spans);
        assert!(spans
            .iter()
            .all(|s| text[s.bytes.clone()].split(' ').all(|w| w == "word")));
        // One unbroken run of CJK characters: cut between characters.
        let text = "汉".repeat(100);
        let spans = chunk_text(&text, &cfg(16, 4), &WordCounter);
        check(&text, &cfg(16, 4), &spans);
        assert!(spans.iter().all(|s| s.tokens <= 16));
    }

    #[test]
    fn overlap_repeats_the_end_of_the_previous_chunk() {
        let text: String = (0..60).map(|i| format!("w{i} ")).collect();
        let spans = chunk_text(&text, &cfg(20, 5), &WordCounter);
        check(&text, &cfg(20, 5), &spans);
        for pair in spans.windows(2) {
            let shared = pair[0].bytes.end.saturating_sub(pair[1].bytes.start);
            assert!(shared > 0, "chunks {pair:?} do not overlap");
            let tail = &text[pair[1].bytes.start..pair[0].bytes.end];
            assert!(WordCounter.count(tail) <= 5);
        }
    }

    #[test]
    fn a_last_single_character_is_its_own_chunk() {
        // Found by the property test: a final one-character chunk after an overlap.
        for text in [
            "abc d",
            "汉",
            "a 😀",
            "word word word word word word word word x",
        ] {
            let spans = chunk_text(text, &cfg(16, 8), &WordCounter);
            check(text, &cfg(16, 8), &spans);
        }
        let text = format!("{} é", "w ".repeat(15));
        let spans = chunk_text(&text, &cfg(16, 8), &WordCounter);
        check(&text, &cfg(16, 8), &spans);
    }

    #[test]
    fn config_bounds() {
        assert!(ChunkConfig::default().validate().is_ok());
        assert!(cfg(8, 0).validate().is_err());
        assert!(cfg(64, 33).validate().is_err());
        assert!(cfg(64, 32).validate().is_ok());
    }

    fn piece() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-z]{1,12}",
            Just(" ".to_string()),
            Just(". ".to_string()),
            Just("\n\n".to_string()),
            Just("\n".to_string()),
            Just(", ".to_string()),
            "[一-龥]{1,8}",
            Just("。".to_string()),
            Just("，".to_string()),
            Just("！”".to_string()),
            "[é😀ß]{1,3}",
            "[a-z]{30,80}",
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        #[test]
        fn spans_are_valid_and_cover_the_text(
            pieces in proptest::collection::vec(piece(), 0..200),
            max in 16usize..64,
            overlap_share in 0usize..=50,
        ) {
            let text: String = pieces.concat();
            let c = cfg(max, max * overlap_share / 100);
            let spans = chunk_text(&text, &c, &WordCounter);
            check(&text, &c, &spans);
            // The fast fit (token ends) keeps every property and cuts where the search does.
            let fast = chunk_text(&text, &c, &EndsCounter);
            check(&text, &c, &fast);
            prop_assert_eq!(fast, spans);
        }
    }
}
