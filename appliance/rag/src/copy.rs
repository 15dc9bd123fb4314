//! Copy bias: a number or a character a RAG answer has started writing is nudged to go on as a
//! retrieved passage writes it.
//!
//! A small model answers from passages by copying, and numbers are where it loses the thread:
//! asked within how many days expense claims are submitted, the default model writes " 3" and
//! then weighs " days" against "0" almost evenly (0.7 apart), though the passage says "within 30
//! days" and no passage says "3 days"; asked how many people were lost in Algiers, it answers
//! "3" where the passage says "30 to 50 thousand". While the answer [ends open](ends_open) (its
//! last token ends in a digit, or its last character is not complete), its longest ending that
//! also occurs in the retrieved passages is found, and every token that follows that ending
//! there (another digit, a separator, a unit, the rest of the character) gets [`CopyBias`]'s
//! bias added to its logit: the passages' own continuations win such near-ties, and among them,
//! or where the model is sure of something else, the model still chooses.
//!
//! The character case is Chinese: a byte-level vocabulary spells most Han characters with two
//! or three tokens, and the default model, having started a character from a passage, often
//! ends it with another's bytes, writing characters no passage has ("20世线" for "20世纪",
//! "政河" for "政治"). Elsewhere nothing is biased: biasing every continuation of any ending made
//! English answers run on, copying the rest of a sentence, and so did continuing every whole
//! Han character in Chinese (as many answers changed, none better on average); biasing only a
//! letter or digit straight after one (to finish the word) turned "7,000,000" into "734,000",
//! another passage's number, as the comma was not biased. Measured with `engram eval qa
//! --copy-bias` (docs/bench/2026-11-27-copy-bias.md, docs/bench/2026-11-28-qa-zh.md).
//!
//! Which number to start is the other place it loses the thread: asked how often passwords are
//! changed, with "Passwords are changed every 180 days." shown as the evidence sentence, it
//! answered "30 days", another passage's number. So until the answer has written a digit, the
//! tokens that begin a number of the evidence sentence ([`FusedPrompt::evidence`]) get the bias
//! too. Once a number is written it is not biased again: biasing every later start made answers
//! repeat the number in a loop. Measured with `engram eval qa --evidence-numbers on,off`
//! (docs/bench/2026-12-04-evidence-numbers.md).

use std::collections::HashMap;

use engram_tokenizer::Tokenizer;

use engram_fusion::FusedPrompt;

/// Logit bias of the default RAG answer (see the module documentation and the measurement).
pub const DEFAULT_COPY_BIAS: f32 = 2.0;

/// The largest bias a request or the configuration may set: beyond it the passage's spelling
/// overrides anything the model writes.
pub const MAX_COPY_BIAS: f32 = 10.0;

/// Whether `bias` is a copy bias one may set: 0 (off) to [`MAX_COPY_BIAS`].
pub fn check_copy_bias(bias: f32) -> std::result::Result<(), String> {
    if bias.is_finite() && (0.0..=MAX_COPY_BIAS).contains(&bias) {
        Ok(())
    } else {
        Err(format!("{bias} is outside 0..={MAX_COPY_BIAS}"))
    }
}

/// The longest answer ending looked for in the passages, in tokens (a bound on the work of one
/// step).
const MAX_MATCH: usize = 32;

/// Between two chunks in [`CopyBias::text`]: no match runs across it.
const SEPARATOR: u32 = u32::MAX;

/// The passages of one prompt, indexed for the continuations of an answer's ending.
#[derive(Debug, Clone)]
pub struct CopyBias {
    /// The chunks' token ids one after another, [`SEPARATOR`] after each.
    text: Vec<u32>,
    /// The bytes of every token id in the passages.
    pieces: HashMap<u32, Vec<u8>>,
    /// Token id -> its positions in `text`, ascending.
    at: HashMap<u32, Vec<usize>>,
    /// The tokens that begin a number the evidence sentence states, ascending: biased until
    /// the answer has written a digit.
    starts: Vec<u32>,
    bias: f32,
}

/// The tokens of `tokens` (a text's encoding; `piece` gives a token's bytes) that begin a
/// number: the token holds an ASCII digit within its first two bytes (" 180" may be one token)
/// and the token before it does not end in a digit or a separator of one (",", ".", ":").
fn number_starts(tokens: &[u32], piece: impl Fn(u32) -> Vec<u8>) -> Vec<u32> {
    let mut starts = Vec::new();
    let mut before: Vec<u8> = Vec::new();
    for &t in tokens {
        let p = piece(t);
        let digit = p.iter().take(2).any(u8::is_ascii_digit)
            && !p.first().is_some_and(|b| b.is_ascii_alphabetic());
        let inside = before
            .last()
            .is_some_and(|b| b.is_ascii_digit() || b",.:".contains(b));
        if digit && !inside {
            starts.push(t);
        }
        before = p;
    }
    starts
}

/// Whether a token whose piece is `piece` leaves the text in a number: it ends in an ASCII
/// digit.
pub fn ends_number(piece: &[u8]) -> bool {
    piece.last().is_some_and(u8::is_ascii_digit)
}

/// Whether text ending in `tail` (its last bytes) is in the middle of something written as the
/// passages write it: a number (it ends in an ASCII digit), or a character whose bytes are not
/// all there yet (a byte-level vocabulary spells most Chinese characters with two or three
/// tokens, and a model that starts one from a passage and ends it elsewhere writes a character
/// no passage has: "20世线" for "20世纪").
pub fn ends_open(tail: &[u8]) -> bool {
    if ends_number(tail) {
        return true;
    }
    // The last character's first byte: at most 3 continuation bytes (10xxxxxx) follow it. From
    // there the character is incomplete when the decoder wants more bytes, the rule the
    // detokenizer holds bytes back by.
    let Some(start) = (tail.len().saturating_sub(4)..tail.len())
        .rev()
        .find(|&i| tail[i] & 0xC0 != 0x80)
    else {
        return false;
    };
    matches!(std::str::from_utf8(&tail[start..]), Err(e) if e.error_len().is_none())
}

impl CopyBias {
    /// The bias over `prompt`'s retrieved chunks, pieces from `tokenizer`; `None` when `bias`
    /// is 0 or there are no chunks.
    pub fn from_prompt(prompt: &FusedPrompt, tokenizer: &Tokenizer, bias: f32) -> Option<Self> {
        let piece = |t: u32| tokenizer.token_piece(t).to_vec();
        let evidence = prompt.suffix.get(prompt.evidence.clone()).unwrap_or(&[]);
        let starts = number_starts(evidence, piece);
        Some(Self::new(&prompt.chunks, bias, piece)?.with_starts(starts))
    }

    /// The bias with `starts` (tokens that begin a number of the evidence sentence) biased
    /// until the answer has written a digit.
    pub fn with_starts(mut self, mut starts: Vec<u32>) -> Self {
        starts.sort_unstable();
        starts.dedup();
        self.starts = starts;
        self
    }

    /// The bias over `chunks` (token ids), where `piece(t)` gives token `t`'s bytes; `None`
    /// when `bias` is 0 or nothing is to be copied.
    pub fn new(chunks: &[Vec<u32>], bias: f32, piece: impl Fn(u32) -> Vec<u8>) -> Option<CopyBias> {
        if bias == 0.0 || chunks.iter().all(Vec::is_empty) {
            return None;
        }
        let mut text = Vec::with_capacity(chunks.iter().map(|c| c.len() + 1).sum());
        for c in chunks {
            text.extend_from_slice(c);
            text.push(SEPARATOR);
        }
        let mut at: HashMap<u32, Vec<usize>> = HashMap::new();
        for (i, &t) in text.iter().enumerate() {
            if t != SEPARATOR {
                at.entry(t).or_default().push(i);
            }
        }
        let pieces = at.keys().map(|&t| (t, piece(t))).collect();
        Some(CopyBias {
            text,
            pieces,
            at,
            starts: Vec::new(),
            bias,
        })
    }

    /// Whether `answer` ends [open](ends_open), judged by its last tokens' bytes (those the
    /// passages have: an answer whose last token they lack has nothing to copy anyway).
    fn open(&self, answer: &[u32]) -> bool {
        let mut tail: Vec<u8> = Vec::new();
        for t in answer.iter().rev() {
            let Some(p) = self.pieces.get(t) else {
                break;
            };
            tail.splice(0..0, p.iter().copied());
            if tail.len() >= 4 {
                break;
            }
        }
        ends_open(&tail)
    }

    /// Whether `answer` holds a digit: once it has stated a number, which number the evidence
    /// states is decided (biasing every later start made answers repeat it in a loop).
    fn wrote_number(&self, answer: &[u32]) -> bool {
        answer.iter().any(|t| {
            self.pieces
                .get(t)
                .is_some_and(|p| p.iter().any(u8::is_ascii_digit))
        })
    }

    /// The tokens that follow, somewhere in the passages, the longest ending of `answer` (the
    /// tokens generated so far) the passages contain, in ascending order; empty unless the
    /// answer [ends open](ends_open) and its last token occurs in a passage.
    pub fn continuations(&self, answer: &[u32]) -> Vec<u32> {
        let Some(&last) = answer.last() else {
            return Vec::new();
        };
        let Some(ends) = self.at.get(&last) else {
            return Vec::new();
        };
        if !self.open(answer) {
            return Vec::new();
        }
        // The occurrences of the answer's last `len` tokens, grown while any remain.
        let mut matched: Vec<usize> = ends.clone();
        for len in 2..=answer.len().min(MAX_MATCH) {
            let want = answer[answer.len() - len];
            let longer: Vec<usize> = matched
                .iter()
                .copied()
                .filter(|&end| end + 1 >= len && self.text[end + 1 - len] == want)
                .collect();
            if longer.is_empty() {
                break;
            }
            matched = longer;
        }
        let mut next: Vec<u32> = matched
            .iter()
            .map(|&end| self.text[end + 1])
            .filter(|&t| t != SEPARATOR)
            .collect();
        next.sort_unstable();
        next.dedup();
        next
    }

    /// Adds the bias to the logit of every continuation of `answer` (see
    /// [`Self::continuations`]), or, while the answer has stated no number and is not inside
    /// one, of every token that begins a number of the evidence sentence; returns how many
    /// tokens got it.
    pub fn apply(&self, answer: &[u32], logits: &mut [f32]) -> usize {
        let mut n = 0;
        let continued;
        let biased: &[u32] = if self.open(answer) {
            continued = self.continuations(answer);
            &continued
        } else if self.starts.is_empty() || self.wrote_number(answer) {
            &[]
        } else {
            &self.starts
        };
        for &t in biased {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += self.bias;
                n += 1;
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Token ids in these tests: 0-9 the digits, 20 " ", 21 ",", 100-105 bytes of Chinese
    // characters (below), and every other id a word.
    fn piece(t: u32) -> Vec<u8> {
        match t {
            0..=9 => vec![b'0' + t as u8],
            20 => b" ".to_vec(),
            21 => b",".to_vec(),
            // "世" is E4 B8 96, "纪" E7 BA AA, "年" E5 B9 B4.
            100 => vec![0xE4],
            101 => vec![0xB8, 0x96],
            102 => vec![0xE7],
            103 => vec![0xBA, 0xAA],
            104 => vec![0xE5, 0xB9, 0xB4],
            _ => b" word".to_vec(),
        }
    }

    fn bias(chunks: &[&[u32]]) -> CopyBias {
        let chunks: Vec<Vec<u32>> = chunks.iter().map(|c| c.to_vec()).collect();
        CopyBias::new(&chunks, 1.5, piece).unwrap()
    }

    #[test]
    fn the_longest_ending_found_decides_the_continuations() {
        // " within" " " "3" "0" " days" | " " "3" "1" " March" | "7" "3" "8"
        let b = bias(&[&[27, 20, 3, 0, 29], &[20, 3, 1, 25, 7, 3, 8]]);
        // Ending "3": its three occurrences are followed by "0", "1" and "8".
        assert_eq!(b.continuations(&[3]), vec![0, 1, 8]);
        // Ending " " "3": two of them, followed by "0" and "1".
        assert_eq!(b.continuations(&[20, 3]), vec![0, 1]);
        // " within" " " "3": only the first, followed by "0".
        assert_eq!(b.continuations(&[27, 20, 3]), vec![0]);
        // An answer that left the passages a token ago is matched on what it shares with them:
        // "42" "3" is not in them, "3" is.
        assert_eq!(b.continuations(&[42, 3]), vec![0, 1, 8]);
        // Nothing generated yet, or a last token found nowhere: no continuation.
        assert!(b.continuations(&[]).is_empty());
        assert!(b.continuations(&[3, 9]).is_empty());
    }

    #[test]
    fn only_a_number_is_continued_and_with_whatever_follows_it() {
        // "7" "," "0" "0" "0" " km" | "7" "3" "4"
        let b = bias(&[&[7, 21, 0, 0, 0, 30], &[7, 3, 4]]);
        // After "7" the separator is as much the passages' as the digit.
        assert_eq!(b.continuations(&[7]), vec![3, 21]);
        // After "7" "," "0" "0" "0" the unit follows.
        assert_eq!(b.continuations(&[7, 21, 0, 0, 0]), vec![30]);
        // After a word, or after a separator, nothing is biased.
        assert!(b.continuations(&[7, 21, 0, 0, 0, 30]).is_empty());
        assert!(b.continuations(&[7, 21]).is_empty());
    }

    #[test]
    fn no_match_runs_across_chunks() {
        let b = bias(&[&[1, 2], &[3, 4]]);
        // "2" ends the first chunk, "3" starts the next: they are not one number.
        assert!(b.continuations(&[1, 2]).is_empty());
        assert_eq!(b.continuations(&[2, 3]), vec![4]);
        assert!(b.continuations(&[4]).is_empty());
    }

    #[test]
    fn the_bias_flips_a_near_tie_to_the_passage_and_leaves_a_clear_choice() {
        let b = bias(&[&[20, 3, 0, 29]]);
        // After " " "3", " days" (29) leads "0" by 0.7: the passage's "0" wins.
        let mut logits = vec![0.0f32; 30];
        logits[29] = 28.2;
        logits[0] = 27.5;
        assert_eq!(b.apply(&[20, 3], &mut logits), 1);
        assert!(logits[0] > logits[29]);
        // A lead larger than the bias is kept.
        let mut logits = vec![0.0f32; 30];
        logits[29] = 30.0;
        logits[0] = 27.5;
        b.apply(&[20, 3], &mut logits);
        assert!(logits[29] > logits[0]);
        // Continuations outside the vocabulary are ignored.
        let b = bias(&[&[20, 3, 99]]);
        assert_eq!(b.apply(&[20, 3], &mut [0.0; 4]), 0);
    }

    #[test]
    fn a_character_split_over_tokens_ends_as_a_passage_ends_it() {
        // "20世纪" "," "年": a byte-level vocabulary spells "纪" as two tokens, 102 and 103.
        let b = bias(&[&[2, 0, 100, 101, 102, 103, 21, 104]]);
        // Inside "纪" (its first byte written): the passage's second half.
        assert_eq!(b.continuations(&[2, 0, 100, 101, 102]), vec![103]);
        // After the whole character "世" or "纪", the model chooses: Chinese words are not
        // continued (measured: docs/bench/2026-11-28-qa-zh.md).
        assert!(b.continuations(&[2, 0, 100, 101]).is_empty());
        assert!(b.continuations(&[100, 101, 102, 103]).is_empty());
        // After a digit, as before: "20" goes on with "世"'s first byte.
        assert_eq!(b.continuations(&[2, 0]), vec![100]);
    }

    #[test]
    fn open_endings_are_numbers_and_split_characters() {
        assert!(ends_open(b" 2010"));
        assert!(ends_open(&"世".as_bytes()[..1]));
        assert!(ends_open(&"世".as_bytes()[..2]));
        assert!(ends_open(&[b'a', 0xF0, 0x9F, 0x98]));
        assert!(ends_open(&[b'C', b'a', b'f', 0xC3]));
        assert!(!ends_open("二十世".as_bytes()));
        assert!(!ends_open(b" days"));
        assert!(!ends_open("世，".as_bytes()));
        assert!(!ends_open("Café".as_bytes()));
        assert!(!ends_open(b""));
        // Continuation bytes whose first byte is not in the tail: nothing to judge by.
        assert!(!ends_open(&[0x80, 0x80, 0x80, 0x80]));
    }

    #[test]
    fn numbers_begin_after_anything_but_a_digit_or_its_separator() {
        // " every" " " "1" "8" "0" " days" "," " " "1" "0" ":" "0" "0"
        let t = [40, 20, 1, 8, 0, 29, 21, 20, 1, 0, 22, 0, 0];
        let piece = |t: u32| match t {
            22 => b":".to_vec(),
            t => piece(t),
        };
        assert_eq!(number_starts(&t, piece), vec![1, 1]);
        // A number that is one token with its space (" 180") begins too; a word with a digit
        // in it ("a1") does not.
        let piece = |t: u32| match t {
            50 => b" 180".to_vec(),
            51 => b"a1".to_vec(),
            t => piece(t),
        };
        assert_eq!(number_starts(&[40, 50, 29, 51], piece), vec![50]);
        assert!(number_starts(&[], piece).is_empty());
    }

    #[test]
    fn outside_a_number_the_evidence_numbers_starts_are_biased() {
        // Passages " within" " " "3" "0" " days" | " every" " " "1" "8" "0" " days"; the evidence
        // sentence states 180.
        let b = bias(&[&[27, 20, 3, 0, 29], &[40, 20, 1, 8, 0, 29]]).with_starts(vec![1]);
        // Before anything is written, and after a space, "1" leads a near tie with "3".
        for answer in [&[][..], &[20]] {
            let mut logits = vec![0.0f32; 41];
            logits[3] = 20.5;
            logits[1] = 19.5;
            assert_eq!(b.apply(answer, &mut logits), 1);
            assert!(logits[1] > logits[3]);
        }
        // Inside a number the passages' continuations are biased instead: after "1", "8".
        assert_eq!(b.continuations(&[20, 1]), vec![8]);
        let mut logits = vec![0.0f32; 41];
        b.apply(&[20, 1], &mut logits);
        assert_eq!(logits[8], 1.5);
        assert_eq!(logits[1], 0.0);
        // Once the answer has stated a number, starts are no longer biased: " " "1" "8" "0"
        // " days" " "
        assert_eq!(b.apply(&[20, 1, 8, 0, 29, 20], &mut [0.0f32; 41]), 0);
        // Without starts nothing is biased outside a number, as before.
        let plain = bias(&[&[27, 20, 3, 0, 29]]);
        assert_eq!(plain.apply(&[20], &mut [0.0f32; 41]), 0);
    }

    #[test]
    fn a_bias_is_checked() {
        assert!(check_copy_bias(0.0).is_ok());
        assert!(check_copy_bias(DEFAULT_COPY_BIAS).is_ok());
        assert!(check_copy_bias(MAX_COPY_BIAS).is_ok());
        for bad in [-0.5, 10.5, f32::NAN, f32::INFINITY] {
            assert!(check_copy_bias(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_zero_bias_or_no_passage_is_no_bias() {
        assert!(CopyBias::new(&[vec![1, 2]], 0.0, piece).is_none());
        assert!(CopyBias::new(&[], 1.0, piece).is_none());
        assert!(CopyBias::new(&[Vec::new()], 1.0, piece).is_none());
    }

    #[test]
    fn numbers_are_told_by_their_last_digit() {
        assert!(ends_number(b"3"));
        assert!(ends_number(b" 2010"));
        assert!(!ends_number(b" days"));
        assert!(!ends_number(b","));
        assert!(!ends_number(b""));
        assert!(!ends_number("三".as_bytes()));
    }
}
