//! Pre-tokenizer choice: `tokenizer.ggml.pre` -> the regex splits llama.cpp applies before BPE.
//!
//! Each family is a list of regexes applied one after the other (every match and every gap
//! between matches becomes a piece that the next regex splits further), then byte-level BPE runs
//! on each piece. The regexes are the ones in the models' own `tokenizer.json` files, which is
//! what llama.cpp's `llama-vocab.cpp` reproduces; we run them with Oniguruma through the
//! `tokenizers` crate, as Hugging Face does.

use crate::error::{Result, TokenizerError};

/// GPT-2's word split (with the trailing `\s+` of the original `tokenizer.json`).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Llama 3's split: case-insensitive contractions, numbers in groups of up to three.
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 2's split: as Llama 3 but one digit per piece.
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Mistral's "tekken" split (case-aware words, one digit per piece).
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GPT-4o / Llama 4's split (case-aware words with contractions, numbers by three).
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// DeepSeek LLM's Latin-letter class (letters of cased scripts, as in its `tokenizer.json`).
const DEEPSEEK_LLM_LETTERS: &str = r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+";

/// How one `tokenizer.ggml.pre` value tokenizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PreTokenizerSpec {
    /// The family name reported by [`crate::Tokenizer::pre_tokenizer`].
    pub family: &'static str,
    /// Regexes applied in order, each splitting the pieces of the previous one.
    pub regexes: &'static [&'static str],
    /// A piece that is itself a vocabulary token is emitted whole, without running merges
    /// (Llama 3 and Tekken vocabularies contain tokens the merges cannot reach).
    pub ignore_merges: bool,
    /// Whether BOS is added by default, before `tokenizer.ggml.add_bos_token` overrides it.
    pub add_bos: bool,
}

const fn spec(
    family: &'static str,
    regexes: &'static [&'static str],
    ignore_merges: bool,
    add_bos: bool,
) -> PreTokenizerSpec {
    PreTokenizerSpec {
        family,
        regexes,
        ignore_merges,
        add_bos,
    }
}

/// llama.cpp's fallback when the file names no pre-tokenizer (old conversions): punctuation
/// runs, then GPT-2, then digit runs, then groups of three digits.
const DEFAULT: PreTokenizerSpec = spec(
    "default",
    &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    false,
    false,
);

/// Every supported `tokenizer.ggml.pre` value and its spec.
const TABLE: &[(&[&str], PreTokenizerSpec)] = &[
    (&["default"], DEFAULT),
    (
        &[
            "gpt2",
            "gpt-2",
            "phi-2",
            "mpt",
            "olmo",
            "jais",
            "jina-es",
            "jina-de",
            "jina-v1-en",
            "jina-v2-es",
            "jina-v2-de",
            "jina-v2-code",
            "roberta-bpe",
            "gigachat",
            "exaone4",
            "trillion",
            "granite-docling",
        ],
        spec("gpt2", &[GPT2], false, false),
    ),
    (
        &[
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
        ],
        spec("llama3", &[LLAMA3], true, true),
    ),
    (
        &["dbrx", "smaug-bpe", "chatglm-bpe", "glm4"],
        spec("llama3-regex", &[LLAMA3], false, false),
    ),
    (
        &[
            "qwen2",
            "deepseek-r1-qwen",
            "megrez",
            "stablelm2",
            "hunyuan",
            "kormo",
        ],
        spec("qwen2", &[QWEN2], false, false),
    ),
    (
        &[
            "smollm",
            "starcoder",
            "refact",
            "command-r",
            "codeshell",
            "exaone",
            "minerva-7b",
        ],
        spec("smollm", &[r"\p{N}", GPT2], false, false),
    ),
    (
        &["deepseek-llm"],
        spec(
            "deepseek-llm",
            &[
                r"[\r\n]",
                DEEPSEEK_LLM_LETTERS,
                r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
                r"\s+$",
                r"[一-龥ࠀ-一가-퟿]+",
                r"\p{N}+",
            ],
            false,
            false,
        ),
    ),
    (
        &["deepseek-coder"],
        spec(
            "deepseek-coder",
            &[
                r"[\r\n]",
                r"\s?\p{L}+",
                r"\s?\p{P}+",
                r"[一-龥ࠀ-一가-퟿]+",
                r"\p{N}",
            ],
            false,
            false,
        ),
    ),
    (
        &["deepseek-v3"],
        spec(
            "deepseek-v3",
            &[
                r"\p{N}{1,3}",
                r"[一-龥぀-ゟ゠-ヿ]+",
                r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
            ],
            false,
            false,
        ),
    ),
    (
        &["falcon"],
        spec(
            "falcon",
            &[
                r"[\p{P}\$\+<=>\^~\|`]+",
                r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                r"[0-9][0-9][0-9]",
            ],
            false,
            false,
        ),
    ),
    (
        &["bloom", "poro-chat", "gpt3-finnish"],
        spec("bloom", &[r" ?[^(\s|.,!?…。，、।۔،)]+"], false, false),
    ),
    (&["tekken"], spec("tekken", &[TEKKEN], true, true)),
    (
        &["gpt-4o", "llama4", "kanana2"],
        spec("gpt-4o", &[GPT4O], false, false),
    ),
];

/// The spec for a `tokenizer.ggml.pre` value; a missing value means llama.cpp's "default".
pub(crate) fn lookup(pre: Option<&str>) -> Result<PreTokenizerSpec> {
    let Some(pre) = pre else {
        return Ok(DEFAULT);
    };
    TABLE
        .iter()
        .find(|(names, _)| names.contains(&pre))
        .map(|(_, spec)| *spec)
        .ok_or_else(|| TokenizerError::UnsupportedPreTokenizer {
            pre: pre.to_owned(),
            known: TABLE
                .iter()
                .flat_map(|(names, _)| names.iter().copied())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_regex_compiles_with_oniguruma() {
        for (names, spec) in TABLE {
            for re in spec.regexes {
                tokenizers::utils::SysRegex::new(re)
                    .unwrap_or_else(|e| panic!("{names:?}: {re:?} does not compile: {e}"));
            }
        }
    }

    #[test]
    fn unknown_pre_tokenizer_is_named_in_the_error() {
        let err = lookup(Some("made-up")).unwrap_err();
        assert!(
            matches!(&err, TokenizerError::UnsupportedPreTokenizer { pre, .. } if pre == "made-up"),
            "{err}"
        );
        assert!(err.to_string().contains("smollm"));
        assert_eq!(lookup(None).unwrap().family, "default");
        assert_eq!(lookup(Some("llama-bpe")).unwrap().family, "llama3");
    }
}
