//! The tokenizer: special-token partition as llama.cpp does it, then BPE from `tokenizers`.

use engram_gguf::Metadata;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;

use crate::byte_level;
use crate::error::{Result, TokenizerError};
use crate::pretok::{self, PreTokenizerSpec};
use crate::vocab::{opt_str, ModelKind, TokenKind, Vocab, KEY_MERGES, KEY_MODEL, KEY_PRE};

/// SentencePiece's visible space, which stands for ' ' inside SentencePiece tokens.
const SPM_SPACE: char = '\u{2581}';

/// A tokenizer built from a GGUF file's metadata that reproduces llama.cpp's `llama_tokenize`.
#[derive(Clone)]
pub struct Tokenizer {
    vocab: Vocab,
    /// The `tokenizers` pipeline (pre-tokenizer + BPE model) that encodes plain-text fragments.
    backend: tokenizers::Tokenizer,
    /// The pre-tokenizer family ("smollm", "llama3", ...; "spm" for SentencePiece).
    pre: &'static str,
    /// Control, user-defined and unknown ids, longest text first: the order llama.cpp matches
    /// them in, so a longer special token wins over one it contains.
    specials: Vec<u32>,
    /// The bytes each token renders as (control and user-defined tokens as their text).
    pieces: Vec<Vec<u8>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("model", &self.vocab.kind)
            .field("pre", &self.pre)
            .field("vocab_size", &self.vocab.len())
            .field("bos", &self.vocab.bos)
            .field("eos", &self.vocab.eos)
            .field("eog", &self.vocab.eog)
            .finish_non_exhaustive()
    }
}

/// A piece of the input after special tokens are cut out.
enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

fn backend_err(stage: &'static str) -> impl Fn(tokenizers::Error) -> TokenizerError {
    move |e| TokenizerError::Backend {
        stage,
        message: e.to_string(),
    }
}

impl Tokenizer {
    /// Builds the tokenizer described by `tokenizer.ggml.*` metadata.
    pub fn from_gguf(meta: &Metadata) -> Result<Tokenizer> {
        let model = meta.get_str(KEY_MODEL)?;
        match model {
            "gpt2" => {
                let spec = pretok::lookup(opt_str(meta, KEY_PRE)?)?;
                let vocab = Vocab::from_gguf(meta, ModelKind::BytePairBpe, spec.add_bos)?;
                let merges = read_merges(meta, &vocab)?;
                let backend = byte_level_backend(&vocab, merges, &spec)?;
                Ok(Self::assemble(vocab, backend, spec.family))
            }
            "llama" => {
                let vocab = Vocab::from_gguf(meta, ModelKind::SentencePiece, true)?;
                let backend = sentencepiece_backend(&vocab)?;
                Ok(Self::assemble(vocab, backend, "spm"))
            }
            other => Err(TokenizerError::UnsupportedModel {
                model: other.to_owned(),
            }),
        }
    }

    fn assemble(vocab: Vocab, backend: tokenizers::Tokenizer, pre: &'static str) -> Tokenizer {
        let mut specials: Vec<u32> = (0..vocab.len() as u32)
            .filter(|&id| {
                matches!(
                    vocab.kinds[id as usize],
                    TokenKind::Control | TokenKind::UserDefined | TokenKind::Unknown
                )
            })
            .collect();
        specials.sort_by_key(|&id| std::cmp::Reverse(vocab.tokens[id as usize].len()));
        let pieces = (0..vocab.len())
            .map(|id| render_piece(&vocab, id))
            .collect();
        Tokenizer {
            vocab,
            backend,
            pre,
            specials,
            pieces,
        }
    }

    /// Encodes `text` into token ids. Never adds BOS or EOS: callers check [`Self::add_bos`].
    ///
    /// With `parse_special`, control-token texts in `text` (`<|im_start|>`) become their ids;
    /// without it they are tokenized as ordinary text. User-defined tokens are matched either
    /// way, as in llama.cpp and Hugging Face.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        Ok(self.encode_inner(text, parse_special, false)?.0)
    }

    /// [`Self::encode`], and where each token ends in `text`: `ends[i]` is the byte offset just
    /// past token `i`'s bytes, so token `i` spells `text[ends[i - 1]..ends[i]]`. The space
    /// SentencePiece prefixes (at the start and after each special token) is in no byte of
    /// `text`: a token that is only that space ends where it starts. `None` in place of the
    /// ends when the tokens do not spell `text` byte for byte (an unknown token).
    pub fn encode_with_ends(
        &self,
        text: &str,
        parse_special: bool,
    ) -> Result<(Vec<u32>, Option<Vec<usize>>)> {
        self.encode_inner(text, parse_special, true)
    }

    /// [`Self::encode_with_ends`], the ends left out (`None`) unless `with_ends`.
    fn encode_inner(
        &self,
        text: &str,
        parse_special: bool,
        with_ends: bool,
    ) -> Result<(Vec<u32>, Option<Vec<usize>>)> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut ends = with_ends.then(|| Vec::with_capacity(out.capacity()));
        // SentencePiece prefixes a space to text at the start and after each special token.
        let mut after_special = true;
        let mut at = 0;
        for fragment in self.partition(text, parse_special) {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                    at += self.vocab.tokens[id as usize].len();
                    if let Some(e) = ends.as_mut() {
                        e.push(at);
                    }
                }
                Fragment::Text(t) => {
                    let first = out.len();
                    let prefixed = self.encode_plain(t, after_special, &mut out)?;
                    after_special = false;
                    if let Some(e) = ends.as_mut() {
                        if !self.push_ends(&out[first..], at, t.len(), prefixed, e) {
                            ends = None;
                        }
                    }
                    at += t.len();
                }
            }
        }
        Ok((out, ends))
    }

    /// Appends to `ends` where each of `ids` (the encoding of one fragment of `len` bytes at
    /// byte `start`, with SentencePiece's space prefixed when `prefixed`) ends; false when
    /// their bytes do not add up to the fragment.
    fn push_ends(
        &self,
        ids: &[u32],
        start: usize,
        len: usize,
        prefixed: bool,
        ends: &mut Vec<usize>,
    ) -> bool {
        let mut spelled = 0;
        for &id in ids {
            spelled += self.token_piece(id).len();
            ends.push(start + spelled.saturating_sub(usize::from(prefixed)));
        }
        spelled == len + usize::from(prefixed)
    }

    /// The token ids of a prompt: `text` encoded with control tokens parsed, BOS prepended when
    /// the model asks for it ([`Self::add_bos`]) unless the text (a chat template) already
    /// starts with it. Every prompt the engine runs starts here.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.encode(text, true)?;
        if let Some(bos) = self.bos_id().filter(|_| self.add_bos()) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// Cuts special tokens out of `text`, longest token first, like llama.cpp's
    /// `tokenizer_st_partition`.
    fn partition<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut fragments = vec![Fragment::Text(text)];
        for &id in &self.specials {
            if !parse_special && self.vocab.kinds[id as usize].is_special() {
                continue;
            }
            let needle = self.vocab.tokens[id as usize].as_str();
            if !fragments
                .iter()
                .any(|f| matches!(f, Fragment::Text(t) if t.contains(needle)))
            {
                continue;
            }
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                let Fragment::Text(mut rest) = fragment else {
                    next.push(fragment);
                    continue;
                };
                while let Some(at) = rest.find(needle) {
                    if at > 0 {
                        next.push(Fragment::Text(&rest[..at]));
                    }
                    next.push(Fragment::Token(id));
                    rest = &rest[at + needle.len()..];
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            fragments = next;
        }
        fragments
    }

    /// Encodes text that contains no special tokens; true when a space was prefixed to it
    /// (SentencePiece at the start and after a special token).
    fn encode_plain(&self, text: &str, after_special: bool, out: &mut Vec<u32>) -> Result<bool> {
        let prefixed = self.vocab.kind == ModelKind::SentencePiece
            && self.vocab.add_space_prefix
            && after_special;
        let encoding = match self.vocab.kind {
            ModelKind::BytePairBpe => self.backend.encode_fast(text, false),
            ModelKind::SentencePiece => {
                let mut escaped = String::with_capacity(text.len() + 4);
                if prefixed {
                    escaped.push(SPM_SPACE);
                }
                escaped.extend(text.chars().map(|c| if c == ' ' { SPM_SPACE } else { c }));
                self.backend.encode_fast(escaped.as_str(), false)
            }
        }
        .map_err(backend_err("encode"))?;
        out.extend_from_slice(encoding.get_ids());
        Ok(prefixed)
    }

    /// Whether the model expects BOS before a prompt (`tokenizer.ggml.add_bos_token`).
    pub fn add_bos(&self) -> bool {
        self.vocab.add_bos
    }

    /// Whether the model expects EOS after a prompt (`tokenizer.ggml.add_eos_token`).
    pub fn add_eos(&self) -> bool {
        self.vocab.add_eos
    }

    /// The beginning-of-sequence id.
    pub fn bos_id(&self) -> Option<u32> {
        self.vocab.bos
    }

    /// The end-of-sequence id.
    pub fn eos_id(&self) -> Option<u32> {
        self.vocab.eos
    }

    /// The end-of-turn id (`tokenizer.ggml.eot_token_id`), when the file names one.
    pub fn eot_id(&self) -> Option<u32> {
        self.vocab.eot
    }

    /// The unknown-token id.
    pub fn unk_id(&self) -> Option<u32> {
        self.vocab.unk
    }

    /// The padding id.
    pub fn pad_id(&self) -> Option<u32> {
        self.vocab.pad
    }

    /// Whether generating `id` ends the turn.
    pub fn is_eog(&self, id: u32) -> bool {
        self.vocab.eog.binary_search(&id).is_ok()
    }

    /// Every end-of-generation id, sorted.
    pub fn eog_ids(&self) -> &[u32] {
        &self.vocab.eog
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// The tokenizer algorithm.
    pub fn model_kind(&self) -> ModelKind {
        self.vocab.kind
    }

    /// The pre-tokenizer family in use ("smollm", "llama3", "qwen2", ...; "spm" for
    /// SentencePiece models, which split nothing before BPE).
    pub fn pre_tokenizer(&self) -> &'static str {
        self.pre
    }

    /// What kind of token `id` is, or `None` outside the vocabulary.
    pub fn token_kind(&self, id: u32) -> Option<TokenKind> {
        self.vocab.kind_of(id)
    }

    /// The bytes token `id` stands for (a control token's text for control tokens); empty for
    /// ids outside the vocabulary. These may be part of a UTF-8 character.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.token_piece(id).to_vec()
    }

    /// Borrowing form of [`Self::token_bytes`].
    pub fn token_piece(&self, id: u32) -> &[u8] {
        self.pieces.get(id as usize).map_or(&[], Vec::as_slice)
    }

    /// Whether `decode(.., skip_special = true)` drops `id` (control and unknown tokens).
    pub fn is_special(&self, id: u32) -> bool {
        self.vocab.kind_of(id).is_some_and(TokenKind::is_special)
    }

    /// Decodes ids to text, replacing invalid UTF-8 with U+FFFD. With `skip_special`, control
    /// and unknown tokens are left out. SentencePiece models drop the space their encoder
    /// prefixed, so `decode(encode(x))` gives back `x`. No other clean-up is applied (llama.cpp's
    /// optional `clean_up_tokenization_spaces` is not reproduced): the text is the pieces joined.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut bytes = Vec::new();
        let mut first = true;
        for &id in ids {
            if skip_special && self.is_special(id) {
                continue;
            }
            let mut piece = self.token_piece(id);
            if first && self.vocab.kind == ModelKind::SentencePiece && self.vocab.add_space_prefix {
                piece = piece.strip_prefix(b" ").unwrap_or(piece);
            }
            first = false;
            bytes.extend_from_slice(piece);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The vocabulary string of `id` (byte-level or `▁`-escaped, as stored in the file).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.tokens.get(id as usize).map(String::as_str)
    }

    /// The id of the token whose vocabulary string is `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.ids.get(text).copied()
    }
}

/// The bytes a token renders as, following llama.cpp's `token_to_piece(special = true)`.
fn render_piece(vocab: &Vocab, id: usize) -> Vec<u8> {
    let text = &vocab.tokens[id];
    match vocab.kinds[id] {
        TokenKind::Control | TokenKind::Unknown | TokenKind::UserDefined => {
            text.as_bytes().to_vec()
        }
        TokenKind::Normal => match vocab.kind {
            ModelKind::BytePairBpe => byte_level::decode(text),
            ModelKind::SentencePiece => text.replace(SPM_SPACE, " ").into_bytes(),
        },
        TokenKind::Byte => parse_byte_token(text).map_or_else(Vec::new, |b| vec![b]),
        TokenKind::Unused | TokenKind::Undefined => Vec::new(),
    }
}

/// `<0xNN>` -> NN.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Reads `tokenizer.ggml.merges` ("left right" strings), checking every merge against the
/// vocabulary. A repeated merge keeps its first rank, as in llama.cpp.
fn read_merges(meta: &Metadata, vocab: &Vocab) -> Result<Vec<(String, String)>> {
    let raw = meta.get_str_array(KEY_MERGES)?;
    let mut seen = std::collections::HashSet::with_capacity(raw.len());
    let mut merges = Vec::with_capacity(raw.len());
    for (index, merge) in raw.into_iter().enumerate() {
        // Split at the first space after the first character: a part may itself be a space in
        // vocabularies that do not byte-encode it.
        let split = merge
            .char_indices()
            .skip(1)
            .find(|&(_, c)| c == ' ')
            .map(|(i, _)| i);
        let Some(at) = split else {
            return Err(TokenizerError::MalformedMerge {
                index,
                merge: merge.to_owned(),
            });
        };
        let (left, right) = (&merge[..at], &merge[at + 1..]);
        for needed in [left, right, &format!("{left}{right}")] {
            if !vocab.ids.contains_key(needed) {
                return Err(TokenizerError::MergeOutOfVocabulary {
                    index,
                    merge: merge.to_owned(),
                    missing: needed.to_owned(),
                });
            }
        }
        if seen.insert((left, right)) {
            merges.push((left.to_owned(), right.to_owned()));
        }
    }
    Ok(merges)
}

fn bpe_vocab(vocab: &Vocab) -> tokenizers::models::bpe::Vocab {
    vocab
        .tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.clone(), id as u32))
        .collect()
}

/// Regex splits, byte-level mapping, then BPE with the file's merges.
fn byte_level_backend(
    vocab: &Vocab,
    merges: Vec<(String, String)>,
    spec: &PreTokenizerSpec,
) -> Result<tokenizers::Tokenizer> {
    let bpe = BPE::builder()
        .vocab_and_merges(bpe_vocab(vocab), merges)
        .ignore_merges(spec.ignore_merges)
        .build()
        .map_err(backend_err("BPE model"))?;
    let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(spec.regexes.len() + 1);
    for re in spec.regexes {
        let split = Split::new(
            SplitPattern::Regex((*re).to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(backend_err("pre-tokenizer regex"))?;
        steps.push(split.into());
    }
    steps.push(ByteLevel::new(false, false, false).into());
    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(Sequence::new(steps)));
    Ok(tokenizer)
}

/// SentencePiece as BPE: every way of splitting a token into two vocabulary tokens is a merge,
/// ranked by the merged token's score (higher first), with `<0xNN>` byte fallback. This is
/// how Hugging Face converts LLaMA tokenizers, and it makes the same choices as llama.cpp's
/// score-driven bigram merging.
fn sentencepiece_backend(vocab: &Vocab) -> Result<tokenizers::Tokenizer> {
    let mut ranked: Vec<(f32, u32, usize, String, String)> = Vec::new();
    for (id, text) in vocab.tokens.iter().enumerate() {
        if vocab.kinds[id] == TokenKind::Byte {
            continue;
        }
        for (at, _) in text.char_indices().skip(1) {
            let (left, right) = text.split_at(at);
            if let (Some(&l), Some(&r)) = (vocab.ids.get(left), vocab.ids.get(right)) {
                if vocab.kinds[l as usize] == TokenKind::Byte
                    || vocab.kinds[r as usize] == TokenKind::Byte
                {
                    continue;
                }
                ranked.push((
                    vocab.scores[id],
                    id as u32,
                    at,
                    left.to_owned(),
                    right.to_owned(),
                ));
            }
        }
    }
    // Highest score first; among splits of one token, the one with the shorter left part.
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let merges = ranked.into_iter().map(|(_, _, _, l, r)| (l, r)).collect();
    let mut builder = BPE::builder()
        .vocab_and_merges(bpe_vocab(vocab), merges)
        .byte_fallback(true);
    if let Some(unk) = vocab.unk {
        builder = builder.unk_token(vocab.tokens[unk as usize].clone());
    }
    let bpe = builder.build().map_err(backend_err("BPE model"))?;
    Ok(tokenizers::Tokenizer::new(bpe))
}

/// Streams text as token ids arrive, emitting only complete UTF-8: a character whose bytes are
/// split over several tokens is held back until its last byte arrives, and one still held when
/// generation stops (a token limit, a stop) is never written: a reader gets no U+FFFD for it.
#[derive(Debug)]
pub struct Detokenizer<'a> {
    tokenizer: &'a Tokenizer,
    skip_special: bool,
    pending: Vec<u8>,
}

impl<'a> Detokenizer<'a> {
    /// A detokenizer over `tokenizer`; `skip_special` drops control and unknown tokens.
    pub fn new(tokenizer: &'a Tokenizer, skip_special: bool) -> Self {
        Detokenizer {
            tokenizer,
            skip_special,
            pending: Vec::new(),
        }
    }

    /// Adds one token and returns the text that became complete (often empty). Bytes that can
    /// never become valid UTF-8 are emitted as U+FFFD at once.
    pub fn push(&mut self, id: u32) -> String {
        if self.skip_special && self.tokenizer.is_special(id) {
            return String::new();
        }
        self.pending
            .extend_from_slice(self.tokenizer.token_piece(id));
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = start + e.valid_up_to();
                    out.push_str(
                        std::str::from_utf8(&self.pending[start..valid]).expect("validated prefix"),
                    );
                    match e.error_len() {
                        // An incomplete character at the end: wait for more bytes.
                        None => {
                            start = valid;
                            break;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = valid + bad;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }

    /// Whether bytes of an incomplete character are held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }
}
