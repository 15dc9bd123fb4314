//! Unit tests on tiny vocabularies written with `GgufWriter`.

use engram_gguf::{str_array, GgufError, GgufFile, GgufWriter, Metadata, Value, ValueType};

use crate::{ChatTemplate, Detokenizer, ModelKind, TokenKind, Tokenizer, TokenizerError};

fn i32_array(items: &[i32]) -> Value {
    Value::Array(
        ValueType::I32,
        items.iter().map(|&v| Value::I32(v)).collect(),
    )
}

fn f32_array(items: &[f32]) -> Value {
    Value::Array(
        ValueType::F32,
        items.iter().map(|&v| Value::F32(v)).collect(),
    )
}

fn metadata(w: &GgufWriter) -> Metadata {
    GgufFile::from_bytes(w.to_bytes())
        .expect("writer output parses")
        .metadata()
        .clone()
}

/// GPT-2's byte alphabet in byte order, written out independently of `byte_level.rs`.
fn byte_alphabet() -> Vec<String> {
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            if matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF) {
                char::from(b).to_string()
            } else {
                next += 1;
                char::from_u32(next - 1).unwrap().to_string()
            }
        })
        .collect()
}

const SPECIALS: [(&str, i32); 4] = [
    ("<|endoftext|>", 3),
    ("<|im_start|>", 3),
    ("<|im_end|>", 3),
    ("<tool>", 4),
];
const MERGES: [&str; 6] = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o"];

/// A byte-level BPE vocabulary: 4 special tokens, the 256-character alphabet, merged tokens.
fn bpe_writer(pre: Option<&str>) -> GgufWriter {
    let mut tokens: Vec<String> = SPECIALS.iter().map(|(t, _)| t.to_string()).collect();
    let mut types: Vec<i32> = SPECIALS.iter().map(|&(_, t)| t).collect();
    tokens.extend(byte_alphabet());
    for m in MERGES {
        tokens.push(m.replace(' ', ""));
    }
    types.resize(tokens.len(), 1);
    let mut w = GgufWriter::new();
    w.metadata("tokenizer.ggml.model", Value::String("gpt2".into()));
    if let Some(pre) = pre {
        w.metadata("tokenizer.ggml.pre", Value::String(pre.into()));
    }
    w.metadata("tokenizer.ggml.tokens", str_array(&tokens))
        .metadata("tokenizer.ggml.token_type", i32_array(&types))
        .metadata("tokenizer.ggml.merges", str_array(&MERGES))
        .metadata("tokenizer.ggml.bos_token_id", Value::U32(1))
        .metadata("tokenizer.ggml.eos_token_id", Value::U32(2))
        .metadata("tokenizer.ggml.add_bos_token", Value::Bool(false));
    w
}

fn bpe(pre: Option<&str>) -> Tokenizer {
    Tokenizer::from_gguf(&metadata(&bpe_writer(pre))).expect("tiny BPE builds")
}

#[test]
fn bpe_encodes_with_merges_and_byte_fallback_characters() {
    let t = bpe(Some("gpt2"));
    let hello = t.token_id("hello").unwrap();
    let gwo = t.token_id("Ġwo").unwrap();
    let ids = t.encode("hello world", false).unwrap();
    let expected: Vec<u32> = vec![
        hello,
        gwo,
        t.token_id("r").unwrap(),
        t.token_id("l").unwrap(),
        t.token_id("d").unwrap(),
    ];
    assert_eq!(ids, expected);
    assert_eq!(t.decode(&ids, false), "hello world");
    assert_eq!(t.token_bytes(gwo), b" wo");
    assert_eq!(t.token_text(gwo), Some("Ġwo"));
    assert_eq!(t.model_kind(), ModelKind::BytePairBpe);
    assert_eq!(t.pre_tokenizer(), "gpt2");
    assert!(t.encode("", true).unwrap().is_empty());
}

#[test]
fn special_tokens_split_only_when_parsed_but_user_defined_always() {
    let t = bpe(Some("gpt2"));
    let hello = t.token_id("hello").unwrap();
    let ids = t.encode("<|im_start|>hello<|im_end|>", true).unwrap();
    assert_eq!(ids, vec![1, hello, 2]);
    let plain = t.encode("<|im_start|>hello<|im_end|>", false).unwrap();
    assert!(!plain.contains(&1) && !plain.contains(&2), "{plain:?}");
    assert_eq!(t.decode(&plain, false), "<|im_start|>hello<|im_end|>");
    // User-defined tokens are matched whatever parse_special says.
    for parse in [true, false] {
        assert_eq!(t.encode("<tool>hello", parse).unwrap(), vec![3, hello]);
    }
    assert_eq!(t.decode(&[1, hello, 3, 2], true), "hello<tool>");
    assert_eq!(
        t.decode(&[1, hello, 2], false),
        "<|im_start|>hello<|im_end|>"
    );
    assert_eq!(t.token_kind(3), Some(TokenKind::UserDefined));
    assert!(t.is_special(1) && !t.is_special(3));
}

#[test]
fn eog_ids_follow_llama_cpp() {
    let t = bpe(Some("smollm"));
    assert_eq!(t.eog_ids(), &[0, 2]);
    assert!(t.is_eog(0) && t.is_eog(2) && !t.is_eog(1));
    assert_eq!(
        (t.bos_id(), t.eos_id(), t.add_bos()),
        (Some(1), Some(2), false)
    );
}

#[test]
fn pre_tokenizer_changes_digit_splitting() {
    // smollm isolates every digit; gpt2 keeps a run of digits together (then byte chars).
    let smollm = bpe(Some("smollm"));
    let gpt2 = bpe(Some("gpt2"));
    let s = smollm.encode("123", false).unwrap();
    let g = gpt2.encode("123", false).unwrap();
    assert_eq!(s, g, "no digit merges exist, so both give one id per digit");
    assert_eq!(s.len(), 3);
    // Unknown and missing pre-tokenizers.
    let err = Tokenizer::from_gguf(&metadata(&bpe_writer(Some("nonsense")))).unwrap_err();
    assert!(err.to_string().contains("nonsense"), "{err}");
    assert_eq!(bpe(None).pre_tokenizer(), "default");
    assert_eq!(bpe(Some("llama-bpe")).pre_tokenizer(), "llama3");
    assert!(
        !bpe(Some("llama-bpe")).add_bos(),
        "add_bos_token = false overrides llama3's default"
    );
}

#[test]
fn missing_tokens_array_is_a_metadata_error() {
    let mut w = GgufWriter::new();
    w.metadata("tokenizer.ggml.model", Value::String("gpt2".into()))
        .metadata("tokenizer.ggml.merges", str_array(&["a b"]));
    let err = Tokenizer::from_gguf(&metadata(&w)).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::Metadata(GgufError::MissingKey { key }) if key == "tokenizer.ggml.tokens"),
        "{err}"
    );
    let err = Tokenizer::from_gguf(&Metadata::default()).unwrap_err();
    assert!(
        matches!(err, TokenizerError::Metadata(GgufError::MissingKey { .. })),
        "{err}"
    );
}

#[test]
fn merges_referencing_unknown_tokens_are_rejected() {
    let mut w = bpe_writer(Some("gpt2"));
    w.metadata("tokenizer.ggml.merges", str_array(&["h e", "x yz"]));
    let err = Tokenizer::from_gguf(&metadata(&w)).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::MergeOutOfVocabulary { index: 1, missing, .. } if missing == "yz"),
        "{err}"
    );
    let mut w = bpe_writer(Some("gpt2"));
    w.metadata("tokenizer.ggml.merges", str_array(&["he"]));
    let err = Tokenizer::from_gguf(&metadata(&w)).unwrap_err();
    assert!(
        matches!(err, TokenizerError::MalformedMerge { index: 0, .. }),
        "{err}"
    );
    // The merged token itself must exist too.
    let mut w = bpe_writer(Some("gpt2"));
    w.metadata("tokenizer.ggml.merges", str_array(&["o w"]));
    let err = Tokenizer::from_gguf(&metadata(&w)).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::MergeOutOfVocabulary { missing, .. } if missing == "ow"),
        "{err}"
    );
}

#[test]
fn malformed_vocabularies_are_rejected() {
    let mut w = bpe_writer(Some("gpt2"));
    w.metadata("tokenizer.ggml.token_type", i32_array(&[1, 1]));
    let err = Tokenizer::from_gguf(&metadata(&w)).unwrap_err();
    assert!(
        matches!(err, TokenizerError::LengthMismatch { found: 2, .. }),
        "{err}"
    );

    let mut w = bpe_writer(Some("gpt2"));
    w.metadata("tokenizer.ggml.eos_token_id", Value::U32(1_000_000));
    let err = Tokenizer::from_gguf(&metadata(&w)).unwrap_err();
    assert!(
        matches!(
            err,
            TokenizerError::SpecialIdOutOfRange { id: 1_000_000, .. }
        ),
        "{err}"
    );

    let mut w = bpe_writer(Some("gpt2"));
    w.metadata("tokenizer.ggml.tokens", str_array(&["a", "b", "a"]))
        .metadata("tokenizer.ggml.token_type", i32_array(&[1, 1, 1]))
        .metadata("tokenizer.ggml.merges", str_array::<&str>(&[]))
        .metadata("tokenizer.ggml.bos_token_id", Value::U32(0))
        .metadata("tokenizer.ggml.eos_token_id", Value::U32(0));
    let err = Tokenizer::from_gguf(&metadata(&w)).unwrap_err();
    assert!(
        matches!(
            err,
            TokenizerError::DuplicateToken {
                first: 0,
                second: 2,
                ..
            }
        ),
        "{err}"
    );

    let mut w = bpe_writer(None);
    w.metadata("tokenizer.ggml.model", Value::String("bert".into()));
    let err = Tokenizer::from_gguf(&metadata(&w)).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::UnsupportedModel { model } if model == "bert"),
        "{err}"
    );
}

#[test]
fn detokenizer_holds_back_split_utf8() {
    let t = bpe(Some("gpt2"));
    // "é€" is five bytes; the tiny vocabulary has one token per byte.
    let ids = t.encode("aé€b", false).unwrap();
    assert_eq!(ids.len(), 7);
    let mut d = Detokenizer::new(&t, false);
    let pieces: Vec<String> = ids.iter().map(|&id| d.push(id)).collect();
    assert_eq!(pieces, ["a", "", "é", "", "", "€", "b"]);
    assert!(!d.has_pending());

    // An incomplete character is held, whatever comes between its bytes.
    let mut d = Detokenizer::new(&t, true);
    assert_eq!(d.push(ids[3]), "");
    assert_eq!(d.push(1), "", "control tokens are skipped");
    assert!(d.has_pending());

    // A byte that can never start a character is replaced at once.
    let mut d = Detokenizer::new(&t, false);
    let lone_continuation = t.token_id(&byte_alphabet()[0x80]).unwrap();
    assert_eq!(d.push(lone_continuation), "\u{fffd}");
    assert_eq!(d.push(t.token_id("a").unwrap()), "a");
    assert_eq!(t.decode(&[lone_continuation], false), "\u{fffd}");
}

#[test]
fn chat_template_from_gguf_uses_vocabulary_bos_eos() {
    let mut w = bpe_writer(Some("gpt2"));
    w.metadata(
        "tokenizer.chat_template",
        Value::String("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}".into()),
    );
    let t = ChatTemplate::from_gguf(&metadata(&w)).unwrap().unwrap();
    let out = t
        .render(&[crate::Message::new("user", "x")], false)
        .unwrap();
    assert_eq!(out, "<|im_start|>x<|im_end|>");
    assert!(ChatTemplate::from_gguf(&metadata(&bpe_writer(None)))
        .unwrap()
        .is_none());
}

// ---- SentencePiece --------------------------------------------------------------------------

/// A SentencePiece vocabulary: unk, bos, eos, 256 byte tokens, then scored pieces.
fn spm_vocab() -> (Vec<String>, Vec<f32>, Vec<i32>) {
    let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
    let mut scores = vec![0.0, 0.0, 0.0];
    let mut types = vec![2, 3, 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        scores.push(0.0);
        types.push(6);
    }
    let pieces = [
        "▁", "h", "e", "l", "o", "w", "r", "d", "a", "b", "▁h", "he", "ll", "▁he", "llo", "▁hello",
        "▁w", "or", "▁wor", "ld", "▁world", "ab", "ba", "aba", "bab", "el", "▁hel",
    ];
    for (i, p) in pieces.iter().enumerate() {
        tokens.push(p.to_string());
        // Distinct scores, not in list order, so ranks matter.
        scores.push(-((i * 7 % pieces.len()) as f32) - 1.0);
        types.push(1);
    }
    (tokens, scores, types)
}

fn spm() -> Tokenizer {
    let (tokens, scores, types) = spm_vocab();
    let mut w = GgufWriter::new();
    w.metadata("tokenizer.ggml.model", Value::String("llama".into()))
        .metadata("tokenizer.ggml.tokens", str_array(&tokens))
        .metadata("tokenizer.ggml.scores", f32_array(&scores))
        .metadata("tokenizer.ggml.token_type", i32_array(&types));
    Tokenizer::from_gguf(&metadata(&w)).expect("tiny SPM builds")
}

/// llama.cpp's SentencePiece algorithm written naively: repeatedly merge the adjacent pair
/// whose concatenation is the best-scored token (leftmost on ties), then bytes for leftovers.
fn reference_spm(tokens: &[String], scores: &[f32], text: &str) -> Vec<u32> {
    let id = |s: &str| tokens.iter().position(|t| t == s).map(|i| i as u32);
    if text.is_empty() {
        return Vec::new();
    }
    let escaped: String = format!(" {text}").replace(' ', "▁");
    let mut symbols: Vec<String> = escaped.chars().map(String::from).collect();
    loop {
        let mut best: Option<(f32, usize)> = None;
        for i in 0..symbols.len().saturating_sub(1) {
            let joined = format!("{}{}", symbols[i], symbols[i + 1]);
            if let Some(t) = id(&joined) {
                let s = scores[t as usize];
                if best.is_none_or(|(b, _)| s > b) {
                    best = Some((s, i));
                }
            }
        }
        let Some((_, i)) = best else { break };
        let right = symbols.remove(i + 1);
        symbols[i].push_str(&right);
    }
    let mut out = Vec::new();
    for s in symbols {
        match id(&s) {
            Some(t) => out.push(t),
            None => out.extend(s.bytes().map(|b| id(&format!("<0x{b:02X}>")).unwrap())),
        }
    }
    out
}

#[test]
fn sentencepiece_matches_the_reference_algorithm() {
    let t = spm();
    let (tokens, scores, _) = spm_vocab();
    assert_eq!(t.model_kind(), ModelKind::SentencePiece);
    assert!(t.add_bos());
    assert_eq!(
        (t.bos_id(), t.eos_id(), t.unk_id()),
        (Some(1), Some(2), Some(0))
    );
    assert_eq!(t.eog_ids(), &[2]);
    for text in [
        "hello world",
        "hello",
        "helloworld",
        "abababa babab",
        "hel lo  wor ld",
        "é hello ü",
        "x",
        " leading",
    ] {
        let ids = t.encode(text, true).unwrap();
        assert_eq!(ids, reference_spm(&tokens, &scores, text), "{text:?}");
        assert_eq!(t.decode(&ids, false), text, "round trip of {text:?}");
    }
    // The space prefix is added again after a special token.
    let ids = t.encode("hello</s>hello", true).unwrap();
    let hello = t.token_id("▁hello").unwrap();
    assert_eq!(ids, vec![hello, 2, hello]);
    assert_eq!(t.decode(&ids, true), "hello hello");
    // Byte tokens render as their byte.
    assert_eq!(t.token_bytes(t.token_id("<0x41>").unwrap()), b"A");
}

/// Checks `encode_with_ends` against `encode` and against the text: each token spells the bytes
/// its ends say, SentencePiece's prefixed space aside.
fn check_ends(t: &Tokenizer, text: &str, parse_special: bool) -> Vec<usize> {
    let (ids, ends) = t.encode_with_ends(text, parse_special).unwrap();
    let ends = ends.unwrap_or_else(|| panic!("{text:?} has ends"));
    assert_eq!(ids, t.encode(text, parse_special).unwrap(), "{text:?}");
    assert_eq!(ends.len(), ids.len(), "{text:?}");
    assert_eq!(ends.last().copied().unwrap_or(0), text.len(), "{text:?}");
    let mut at = 0;
    for (&id, &end) in ids.iter().zip(&ends) {
        let piece = t.token_piece(id);
        let spelled = &text.as_bytes()[at..end];
        assert!(
            piece == spelled || piece.strip_prefix(b" ") == Some(spelled),
            "{text:?}: token {id} spells {piece:?}, its ends say {spelled:?}"
        );
        at = end;
    }
    ends
}

#[test]
fn token_ends_locate_every_token_in_the_text() {
    let b = bpe(Some("gpt2"));
    for text in ["hello world", "<|im_start|>hello<|im_end|> wo", "é x", ""] {
        check_ends(&b, text, true);
    }
    let s = spm();
    for text in [
        "hello world",
        " leading",
        "hello</s>hello",
        "</s>é hello ü",
        "x",
    ] {
        check_ends(&s, text, true);
    }
    // The space prefixed after `</s>` is in no byte of the text: the second "▁hello" spells
    // bytes 9..14, not 8..14.
    assert_eq!(check_ends(&s, "hello</s>hello", true), vec![5, 9, 14]);
}

#[test]
fn prompts_get_one_bos_when_the_model_asks_for_it() {
    let t = spm();
    let hello = t.token_id("▁hello").unwrap();
    assert_eq!(t.encode_prompt("hello").unwrap(), vec![1, hello]);
    // A template that wrote BOS already does not get a second one.
    assert_eq!(t.encode_prompt("<s>hello").unwrap(), vec![1, hello]);
    // add_bos_token = false: none.
    let b = bpe(None);
    assert!(!b.add_bos());
    assert_eq!(
        b.encode_prompt("ab").unwrap(),
        b.encode("ab", true).unwrap()
    );
}

#[test]
fn sentencepiece_matches_the_reference_on_random_text() {
    let t = spm();
    let (tokens, scores, _) = spm_vocab();
    let alphabet: Vec<char> = "helowrdab  ü".chars().collect();
    // A fixed xorshift stream keeps the test deterministic without a dependency.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..500 {
        let len = (next() % 16) as usize;
        let text: String = (0..len)
            .map(|_| alphabet[(next() % alphabet.len() as u64) as usize])
            .collect();
        let ids = t.encode(&text, false).unwrap();
        assert_eq!(ids, reference_spm(&tokens, &scores, &text), "{text:?}");
        assert_eq!(t.decode(&ids, false), text, "round trip of {text:?}");
    }
}

#[test]
fn tokenizer_and_template_can_be_shared_between_threads() {
    fn shared<T: Send + Sync>() {}
    shared::<Tokenizer>();
    shared::<ChatTemplate>();
}
