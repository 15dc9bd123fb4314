//! The vocabulary read from GGUF metadata: token texts and types, scores, special ids, EOG set.

use std::collections::HashMap;

use engram_gguf::{Metadata, Value};

use crate::error::{Result, TokenizerError};

pub(crate) const KEY_MODEL: &str = "tokenizer.ggml.model";
pub(crate) const KEY_PRE: &str = "tokenizer.ggml.pre";
pub(crate) const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
pub(crate) const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
pub(crate) const KEY_SCORES: &str = "tokenizer.ggml.scores";
pub(crate) const KEY_MERGES: &str = "tokenizer.ggml.merges";
pub(crate) const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
pub(crate) const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
pub(crate) const KEY_EOT: &str = "tokenizer.ggml.eot_token_id";
pub(crate) const KEY_EOM: &str = "tokenizer.ggml.eom_token_id";
pub(crate) const KEY_UNK: &str = "tokenizer.ggml.unknown_token_id";
pub(crate) const KEY_PAD: &str = "tokenizer.ggml.padding_token_id";
pub(crate) const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
pub(crate) const KEY_ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
pub(crate) const KEY_ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";

/// Token texts that end generation whatever the metadata says, as llama.cpp detects them (the
/// converters do not record every end-of-turn marker). Such tokens are also made control tokens.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<｜end▁of▁sentence｜>",
];

/// Tokens gpt-oss's chat format needs rendered as text; llama.cpp makes them user-defined.
const ALWAYS_RENDERED: &[&str] = &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

/// What a token is, from `tokenizer.ggml.token_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenKind {
    /// An ordinary piece of text (type 1).
    Normal,
    /// The unknown token (type 2).
    Unknown,
    /// A control token such as BOS, EOS or `<|im_start|>` (type 3): matched in text only when
    /// special tokens are parsed, skipped by `decode(.., skip_special = true)`.
    Control,
    /// A token added by the model's authors (type 4): always matched in text, always rendered.
    UserDefined,
    /// A reserved slot (type 5): never produced, renders as nothing.
    Unused,
    /// A byte-fallback token `<0xNN>` (type 6).
    Byte,
    /// Any other type value: renders as nothing.
    Undefined,
}

impl TokenKind {
    fn from_gguf(v: i64) -> TokenKind {
        match v {
            1 => TokenKind::Normal,
            2 => TokenKind::Unknown,
            3 => TokenKind::Control,
            4 => TokenKind::UserDefined,
            5 => TokenKind::Unused,
            6 => TokenKind::Byte,
            _ => TokenKind::Undefined,
        }
    }

    /// Control and unknown tokens: what `parse_special` and `skip_special` act on.
    pub fn is_special(self) -> bool {
        matches!(self, TokenKind::Control | TokenKind::Unknown)
    }
}

/// The tokenizer algorithm named by `tokenizer.ggml.model`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelKind {
    /// "gpt2": byte-level BPE with explicit merges.
    BytePairBpe,
    /// "llama": SentencePiece BPE driven by token scores, with `<0xNN>` byte fallback.
    SentencePiece,
}

/// The vocabulary and its special ids.
#[derive(Debug, Clone)]
pub(crate) struct Vocab {
    pub kind: ModelKind,
    pub tokens: Vec<String>,
    pub kinds: Vec<TokenKind>,
    /// SentencePiece scores (zero when the file has none).
    pub scores: Vec<f32>,
    pub ids: HashMap<String, u32>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_space_prefix: bool,
    /// Sorted end-of-generation ids.
    pub eog: Vec<u32>,
}

/// An optional string value (`Metadata::opt` cannot return borrowed values).
pub(crate) fn opt_str<'a>(meta: &'a Metadata, key: &str) -> Result<Option<&'a str>> {
    if meta.get(key).is_none() {
        return Ok(None);
    }
    Ok(Some(meta.get_str(key)?))
}

/// The elements of a per-token array, checked to cover every token.
fn per_token<'a>(meta: &'a Metadata, key: &'static str, n: usize) -> Result<Option<&'a [Value]>> {
    if meta.get(key).is_none() {
        return Ok(None);
    }
    let items = meta.get_array(key)?;
    if items.len() < n {
        return Err(TokenizerError::LengthMismatch {
            key,
            found: items.len(),
            expected: n,
        });
    }
    Ok(Some(&items[..n]))
}

impl Vocab {
    /// Reads the vocabulary; `default_add_bos` comes from the pre-tokenizer family.
    pub fn from_gguf(meta: &Metadata, kind: ModelKind, default_add_bos: bool) -> Result<Vocab> {
        let raw = meta.get_array(KEY_TOKENS)?;
        if raw.is_empty() {
            return Err(TokenizerError::EmptyVocabulary);
        }
        if raw.len() as u64 > u64::from(u32::MAX) {
            return Err(TokenizerError::VocabularyTooLarge {
                len: raw.len(),
                max: u64::from(u32::MAX),
            });
        }
        let n = raw.len();
        let mut tokens = Vec::with_capacity(n);
        let mut ids = HashMap::with_capacity(n);
        for (i, v) in raw.iter().enumerate() {
            let text = v.as_str().ok_or(TokenizerError::WrongElementType {
                key: KEY_TOKENS,
                index: i,
                found: v.type_name(),
                expected: "string",
            })?;
            // llama.cpp gives empty tokens a placeholder so text -> id stays a function.
            let text = if text.is_empty() {
                format!("[EMPTY_{i}]")
            } else {
                text.to_owned()
            };
            if let Some(&first) = ids.get(&text) {
                return Err(TokenizerError::DuplicateToken {
                    text,
                    first,
                    second: i as u32,
                });
            }
            ids.insert(text.clone(), i as u32);
            tokens.push(text);
        }

        let mut kinds = vec![TokenKind::Normal; n];
        if let Some(types) = per_token(meta, KEY_TOKEN_TYPE, n)? {
            for (i, v) in types.iter().enumerate() {
                let t = v.as_i64().ok_or(TokenizerError::WrongElementType {
                    key: KEY_TOKEN_TYPE,
                    index: i,
                    found: v.type_name(),
                    expected: "integer",
                })?;
                kinds[i] = TokenKind::from_gguf(t);
            }
        }

        let mut scores = vec![0.0f32; n];
        if let Some(values) = per_token(meta, KEY_SCORES, n)? {
            for (i, v) in values.iter().enumerate() {
                scores[i] = v.as_f64().ok_or(TokenizerError::WrongElementType {
                    key: KEY_SCORES,
                    index: i,
                    found: v.type_name(),
                    expected: "number",
                })? as f32;
            }
        }

        let special = |key: &'static str, default: Option<u32>| -> Result<Option<u32>> {
            match meta.opt(key, Metadata::get_u64)? {
                None => Ok(default.filter(|&d| (d as usize) < n)),
                Some(id) if id < n as u64 => Ok(Some(id as u32)),
                Some(id) => Err(TokenizerError::SpecialIdOutOfRange {
                    key,
                    id,
                    vocab_size: n,
                }),
            }
        };
        // SentencePiece files from before these keys existed assume LLaMA's layout.
        let spm = kind == ModelKind::SentencePiece;
        let bos = special(KEY_BOS, spm.then_some(1))?;
        let eos = special(KEY_EOS, spm.then_some(2))?;
        let unk = special(KEY_UNK, spm.then_some(0))?;
        let eot = special(KEY_EOT, None)?;
        let eom = special(KEY_EOM, None)?;
        let pad = special(KEY_PAD, None)?;

        let flag = |key: &str, default: bool| -> Result<bool> {
            Ok(meta.opt(key, Metadata::get_bool)?.unwrap_or(default))
        };
        let add_bos = flag(KEY_ADD_BOS, spm || default_add_bos)?;
        let add_eos = flag(KEY_ADD_EOS, false)?;
        let add_space_prefix = flag(KEY_ADD_SPACE_PREFIX, spm)?;

        let mut vocab = Vocab {
            kind,
            tokens,
            kinds,
            scores,
            ids,
            bos,
            eos,
            eot,
            eom,
            unk,
            pad,
            add_bos,
            add_eos,
            add_space_prefix,
            eog: Vec::new(),
        };
        vocab.find_eog();
        Ok(vocab)
    }

    /// Builds the end-of-generation set the way llama.cpp does: every token whose text is a
    /// known end marker (made a control token if it was not), plus the EOS, EOT and EOM ids.
    ///
    /// Newer llama.cpp builds also stop on fill-in-the-middle tokens (`<|fim_pad|>`,
    /// `<reponame>`, ...); the reference build our golden files come from does not (SmolLM2's
    /// EOG set is `[0, 2]` there, without `<reponame>`), so neither do we.
    fn find_eog(&mut self) {
        let mut eog = Vec::new();
        for text in EOG_TEXTS {
            if let Some(&id) = self.ids.get(*text) {
                eog.push(id);
                if !self.kinds[id as usize].is_special() {
                    self.kinds[id as usize] = TokenKind::Control;
                }
            }
        }
        for text in ALWAYS_RENDERED {
            if let Some(&id) = self.ids.get(*text) {
                self.kinds[id as usize] = TokenKind::UserDefined;
            }
        }
        eog.extend([self.eos, self.eot, self.eom].into_iter().flatten());
        eog.sort_unstable();
        eog.dedup();

        // gpt-oss (and solar-open) end a message with <|end|> but keep generating after it: when
        // their return/call markers exist, <|end|> is a rendered token, not an end.
        let has = |t: &str| self.ids.get(t).is_some_and(|id| eog.contains(id));
        if has("<|end|>")
            && ((has("<|return|>") && has("<|call|>")) || (has("<|calls|>") && has("<|flush|>")))
        {
            let end = self.ids["<|end|>"];
            eog.retain(|&id| id != end);
            self.kinds[end as usize] = TokenKind::UserDefined;
        }
        self.eog = eog;
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn kind_of(&self, id: u32) -> Option<TokenKind> {
        self.kinds.get(id as usize).copied()
    }
}
