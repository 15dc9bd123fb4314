//! Unit tests: a tiny random BERT written as safetensors, checked against a naive f64 forward
//! pass, plus the loader's error cases.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use engram_kernels::f16;
use safetensors::tensor::TensorView;
use safetensors::Dtype;

use crate::{EmbedError, Embedder};

const VOCAB: [&str; 16] = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", "world", "the", "cat", "##s", "a", "dog", ",",
    ".", "run", "##ning", "cafe",
];
const HIDDEN: usize = 8;
const HEADS: usize = 2;
const INTER: usize = 16;
const LAYERS: usize = 2;
const MAX_POS: usize = 12;
const MAX_SEQ: usize = 10;
const EPS: f64 = 1e-12;

/// Named tensors with shapes; values are f16-representable so F32 and F16 files agree.
type Tensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

fn tiny_weights(seed: u64) -> Tensors {
    let mut state = seed;
    let mut rand = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let u = (state >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
        u - 0.5
    };
    let mut t = Tensors::new();
    let mut add = |name: String, shape: Vec<usize>, scale: f32, offset: f32| {
        let n = shape.iter().product();
        let v = (0..n)
            .map(|_| f16::from_f32(offset + scale * rand()).to_f32())
            .collect();
        t.insert(name, (shape, v));
    };
    let e = "embeddings";
    add(
        format!("{e}.word_embeddings.weight"),
        vec![VOCAB.len(), HIDDEN],
        2.0,
        0.0,
    );
    add(
        format!("{e}.position_embeddings.weight"),
        vec![MAX_POS, HIDDEN],
        1.0,
        0.0,
    );
    add(
        format!("{e}.token_type_embeddings.weight"),
        vec![2, HIDDEN],
        1.0,
        0.0,
    );
    add(format!("{e}.LayerNorm.weight"), vec![HIDDEN], 0.5, 1.0);
    add(format!("{e}.LayerNorm.bias"), vec![HIDDEN], 0.5, 0.0);
    for l in 0..LAYERS {
        let p = format!("encoder.layer.{l}");
        let mut lin = |name: String, rows: usize, cols: usize| {
            add(format!("{name}.weight"), vec![rows, cols], 1.0, 0.0);
            add(format!("{name}.bias"), vec![rows], 0.2, 0.0);
        };
        for n in ["query", "key", "value"] {
            lin(format!("{p}.attention.self.{n}"), HIDDEN, HIDDEN);
        }
        lin(format!("{p}.attention.output.dense"), HIDDEN, HIDDEN);
        lin(format!("{p}.intermediate.dense"), INTER, HIDDEN);
        lin(format!("{p}.output.dense"), HIDDEN, INTER);
        for n in ["attention.output.LayerNorm", "output.LayerNorm"] {
            add(format!("{p}.{n}.weight"), vec![HIDDEN], 0.5, 1.0);
            add(format!("{p}.{n}.bias"), vec![HIDDEN], 0.5, 0.0);
        }
    }
    // A pooler, which the embedder ignores.
    add("pooler.dense.weight".into(), vec![HIDDEN, HIDDEN], 1.0, 0.0);
    t
}

fn safetensors_bytes(t: &Tensors, prefix: &str, dtype: Dtype) -> Vec<u8> {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = t
        .iter()
        .map(|(name, (shape, v))| {
            let b = match dtype {
                Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                Dtype::F16 => v
                    .iter()
                    .flat_map(|x| f16::from_f32(*x).to_le_bytes())
                    .collect(),
                _ => unreachable!("the tests write F32 or F16"),
            };
            (format!("{prefix}{name}"), shape.clone(), b)
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(n, s, b)| (n.clone(), TensorView::new(dtype, s.clone(), b).unwrap()));
    safetensors::serialize(views, None).unwrap()
}

fn tokenizer_json() -> String {
    let vocab: Vec<String> = VOCAB
        .iter()
        .enumerate()
        .map(|(i, t)| format!("{t:?}: {i}"))
        .collect();
    let added: Vec<String> = VOCAB[..4]
        .iter()
        .enumerate()
        .map(|(i, t)| {
            format!(
                r#"{{"id": {i}, "content": {t:?}, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true}}"#
            )
        })
        .collect();
    // Truncation 4 and fixed padding 16, as in MiniLM's file (128 / 128): both must be
    // overridden by max_seq_length.
    format!(
        r###"{{
  "version": "1.0",
  "truncation": {{"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}},
  "padding": {{"strategy": {{"Fixed": 16}}, "direction": "Right", "pad_to_multiple_of": null,
              "pad_id": 0, "pad_type_id": 0, "pad_token": "[PAD]"}},
  "added_tokens": [{}],
  "normalizer": {{"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
                 "strip_accents": null, "lowercase": true}},
  "pre_tokenizer": {{"type": "BertPreTokenizer"}},
  "post_processor": {{"type": "BertProcessing", "sep": ["[SEP]", 3], "cls": ["[CLS]", 2]}},
  "decoder": {{"type": "WordPiece", "prefix": "##", "cleanup": true}},
  "model": {{"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
            "max_input_chars_per_word": 100, "vocab": {{{}}}}}
}}"###,
        added.join(", "),
        vocab.join(", ")
    )
}

fn config_json(act: &str, heads: usize) -> String {
    format!(
        r#"{{"architectures": ["BertModel"], "model_type": "bert", "hidden_act": "{act}",
  "hidden_size": {HIDDEN}, "num_hidden_layers": {LAYERS}, "num_attention_heads": {heads},
  "intermediate_size": {INTER}, "layer_norm_eps": {EPS}, "max_position_embeddings": {MAX_POS},
  "type_vocab_size": 2, "vocab_size": {}, "position_embedding_type": "absolute"}}"#,
        VOCAB.len()
    )
}

/// A fresh folder under the system temp dir holding a complete tiny model.
fn write_model(name: &str, t: &Tensors, prefix: &str, dtype: Dtype) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("engram-embed-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("1_Pooling")).unwrap();
    let w = |f: &str, data: &[u8]| std::fs::write(dir.join(f), data).unwrap();
    w("model.safetensors", &safetensors_bytes(t, prefix, dtype));
    w("config.json", config_json("gelu", HEADS).as_bytes());
    w("tokenizer.json", tokenizer_json().as_bytes());
    w(
        "sentence_bert_config.json",
        format!(r#"{{"max_seq_length": {MAX_SEQ}, "do_lower_case": false}}"#).as_bytes(),
    );
    w(
        "1_Pooling/config.json",
        format!(
            r#"{{"word_embedding_dimension": {HIDDEN}, "pooling_mode_cls_token": false,
  "pooling_mode_mean_tokens": true, "pooling_mode_max_tokens": false,
  "pooling_mode_mean_sqrt_len_tokens": false}}"#
        )
        .as_bytes(),
    );
    dir
}

/// A textbook f64 BERT + mean pooling + L2 normalisation, one sequence at a time.
fn reference(t: &Tensors, ids: &[u32]) -> Vec<f64> {
    let g = |n: &str| -> Vec<f64> { t[n].1.iter().map(|&v| v as f64).collect() };
    let ln = |x: &mut [f64], w: &[f64], b: &[f64]| {
        let m = x.iter().sum::<f64>() / x.len() as f64;
        let var = x.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / x.len() as f64;
        for i in 0..x.len() {
            x[i] = (x[i] - m) / (var + EPS).sqrt() * w[i] + b[i];
        }
    };
    let linear = |x: &[f64], name: &str| -> Vec<f64> {
        let (w, b) = (g(&format!("{name}.weight")), g(&format!("{name}.bias")));
        let cols = x.len();
        (0..b.len())
            .map(|r| b[r] + (0..cols).map(|c| w[r * cols + c] * x[c]).sum::<f64>())
            .collect()
    };
    let (word, pos, ty) = (
        g("embeddings.word_embeddings.weight"),
        g("embeddings.position_embeddings.weight"),
        g("embeddings.token_type_embeddings.weight"),
    );
    let mut xs: Vec<Vec<f64>> = ids
        .iter()
        .enumerate()
        .map(|(p, &id)| {
            let mut x: Vec<f64> = (0..HIDDEN)
                .map(|k| word[id as usize * HIDDEN + k] + ty[k] + pos[p * HIDDEN + k])
                .collect();
            ln(
                &mut x,
                &g("embeddings.LayerNorm.weight"),
                &g("embeddings.LayerNorm.bias"),
            );
            x
        })
        .collect();
    let d = HIDDEN / HEADS;
    for l in 0..LAYERS {
        let p = format!("encoder.layer.{l}");
        let proj = |n: &str| -> Vec<Vec<f64>> {
            xs.iter()
                .map(|x| linear(x, &format!("{p}.attention.self.{n}")))
                .collect()
        };
        let (q, k, v) = (proj("query"), proj("key"), proj("value"));
        let mut next = Vec::new();
        for (i, x) in xs.iter().enumerate() {
            let mut ctx = vec![0.0; HIDDEN];
            for h in 0..HEADS {
                let s: Vec<f64> = (0..ids.len())
                    .map(|j| {
                        (0..d)
                            .map(|e| q[i][h * d + e] * k[j][h * d + e])
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let z: f64 = s.iter().map(|s| s.exp()).sum();
                for (j, s) in s.iter().enumerate() {
                    for e in 0..d {
                        ctx[h * d + e] += s.exp() / z * v[j][h * d + e];
                    }
                }
            }
            let mut a = linear(&ctx, &format!("{p}.attention.output.dense"));
            a.iter_mut().zip(x).for_each(|(a, x)| *a += x);
            let n = format!("{p}.attention.output.LayerNorm");
            ln(&mut a, &g(&format!("{n}.weight")), &g(&format!("{n}.bias")));
            let up: Vec<f64> = linear(&a, &format!("{p}.intermediate.dense"))
                .into_iter()
                .map(|u| 0.5 * u * (1.0 + crate::erf_ref::erf(u / 2f64.sqrt())))
                .collect();
            let mut o = linear(&up, &format!("{p}.output.dense"));
            o.iter_mut().zip(&a).for_each(|(o, a)| *o += a);
            let n = format!("{p}.output.LayerNorm");
            ln(&mut o, &g(&format!("{n}.weight")), &g(&format!("{n}.bias")));
            next.push(o);
        }
        xs = next;
    }
    let mean: Vec<f64> = (0..HIDDEN)
        .map(|k| xs.iter().map(|x| x[k]).sum::<f64>() / xs.len() as f64)
        .collect();
    let norm = mean.iter().map(|v| v * v).sum::<f64>().sqrt();
    mean.iter().map(|v| v / norm).collect()
}

const TEXTS: [&str; 5] = [
    "Hello world.",
    "The cats, the dog.",
    "a",
    "Running CAFÉ dogs hello",
    "the cat the dog the cat the dog the cat the dog a cat",
];

#[test]
fn matches_naive_reference() {
    let t = tiny_weights(1);
    let dir = write_model("ref", &t, "", Dtype::F32);
    let e = Embedder::load(&dir, 3).unwrap();
    assert_eq!(e.dim(), HIDDEN);
    assert_eq!(e.max_tokens(), MAX_SEQ);
    let got = e.embed(&TEXTS).unwrap();
    for (text, v) in TEXTS.iter().zip(&got) {
        let want = reference(&t, &e.tokenize(text).unwrap());
        let err = v
            .iter()
            .zip(&want)
            .map(|(a, b)| (*a as f64 - b).abs())
            .fold(0.0, f64::max);
        assert!(
            err < 2e-6,
            "{text:?}: max abs error {err}\n got {v:?}\nwant {want:?}"
        );
    }
}

#[test]
fn tokenizer_overrides_truncation_and_padding() {
    let dir = write_model("tok", &tiny_weights(2), "", Dtype::F32);
    let e = Embedder::load(&dir, 1).unwrap();
    // Lowercased, accents stripped, word pieces, [CLS]/[SEP], no padding.
    assert_eq!(e.tokenize("Running CAFÉ").unwrap(), vec![2, 13, 14, 15, 3]);
    assert_eq!(e.tokenize("").unwrap(), vec![2, 3]);
    assert_eq!(e.tokenize("zebra").unwrap(), vec![2, 1, 3]);
    // Truncated to max_seq_length (10) including [CLS] and [SEP], not to the file's 4.
    let long = e.tokenize(TEXTS[4]).unwrap();
    assert_eq!(long.len(), MAX_SEQ);
    assert_eq!((long[0], long[MAX_SEQ - 1]), (2, 3));
    assert_eq!(long[1..4], [6, 7, 6]);
}

#[test]
fn batching_does_not_change_results() {
    let dir = write_model("batch", &tiny_weights(3), "", Dtype::F32);
    let e = Embedder::load(&dir, 2).unwrap();
    let batched = e.embed(&TEXTS).unwrap();
    for (text, v) in TEXTS.iter().zip(&batched) {
        assert_eq!(&e.embed_one(text).unwrap(), v, "{text:?}");
    }
    // Enough texts to span several batches of MAX_BATCH_TOKENS.
    let many: Vec<&str> = TEXTS.iter().cycle().take(1500).copied().collect();
    let n_tokens: usize = many.iter().map(|t| e.tokenize(t).unwrap().len()).sum();
    assert!(n_tokens > 2 * crate::MAX_BATCH_TOKENS);
    let out = e.embed(&many).unwrap();
    for (i, v) in out.iter().enumerate() {
        assert_eq!(v, &batched[i % TEXTS.len()], "text {i}");
    }
    assert!(e.embed(&[]).unwrap().is_empty());
}

#[test]
fn f16_weights_and_bert_prefix() {
    let t = tiny_weights(4);
    let plain = Embedder::load(&write_model("f32", &t, "", Dtype::F32), 1).unwrap();
    let half = Embedder::load(&write_model("f16", &t, "bert.", Dtype::F16), 1).unwrap();
    // The weights are f16-representable, so both files hold the same numbers.
    assert_eq!(plain.embed(&TEXTS).unwrap(), half.embed(&TEXTS).unwrap());
    assert_ne!(plain.model_id(), half.model_id());
    assert!(
        plain.model_id().starts_with("engram-embed-f32-"),
        "{}",
        plain.model_id()
    );
    let other = Embedder::load(&write_model("f32b", &tiny_weights(5), "", Dtype::F32), 1);
    let other_hash = other
        .unwrap()
        .model_id()
        .split('@')
        .nth(1)
        .unwrap()
        .to_owned();
    assert_ne!(plain.model_id().split('@').nth(1).unwrap(), other_hash);
}

#[test]
fn unit_length_and_send_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Embedder>();
    let e = Embedder::load(&write_model("unit", &tiny_weights(6), "", Dtype::F32), 2).unwrap();
    let e = std::sync::Arc::new(e);
    let handles: Vec<_> = (0..3)
        .map(|_| {
            let e = e.clone();
            std::thread::spawn(move || e.embed(&TEXTS).unwrap())
        })
        .collect();
    let first = e.embed(&TEXTS).unwrap();
    for h in handles {
        assert_eq!(h.join().unwrap(), first);
    }
    for v in first {
        let n: f32 = v.iter().map(|x| x * x).sum();
        assert!((n - 1.0).abs() < 1e-6);
    }
}

fn load_err(dir: &Path) -> EmbedError {
    Embedder::load(dir, 1).expect_err("load should fail")
}

#[test]
fn missing_files_are_named() {
    let t = tiny_weights(7);
    for (file, what) in [
        ("config.json", "config.json"),
        ("model.safetensors", "model.safetensors"),
        ("tokenizer.json", "tokenizer.json"),
    ] {
        let dir = write_model(&format!("missing-{file}"), &t, "", Dtype::F32);
        std::fs::remove_file(dir.join(file)).unwrap();
        match load_err(&dir) {
            EmbedError::MissingFile { path, what: w } => {
                assert_eq!(path, dir.join(file));
                assert!(w.contains(what), "{w}");
            }
            e => panic!("{file}: unexpected {e}"),
        }
    }
    // The optional files fall back to max_position_embeddings and mean pooling.
    let dir = write_model("optional", &t, "", Dtype::F32);
    std::fs::remove_file(dir.join("sentence_bert_config.json")).unwrap();
    std::fs::remove_dir_all(dir.join("1_Pooling")).unwrap();
    assert_eq!(Embedder::load(&dir, 1).unwrap().max_tokens(), MAX_POS);
}

#[test]
fn missing_or_misshapen_tensor_is_named() {
    let mut t = tiny_weights(8);
    t.remove("encoder.layer.1.output.dense.bias");
    let dir = write_model("no-tensor", &t, "bert.", Dtype::F32);
    match load_err(&dir) {
        EmbedError::MissingTensor { name, .. } => {
            assert_eq!(name, "bert.encoder.layer.1.output.dense.bias")
        }
        e => panic!("unexpected {e}"),
    }
    let mut t = tiny_weights(8);
    t.get_mut("encoder.layer.0.intermediate.dense.weight")
        .unwrap()
        .0 = vec![INTER / 2, 2 * HIDDEN];
    let err = load_err(&write_model("bad-shape", &t, "", Dtype::F32));
    assert!(
        matches!(&err, EmbedError::TensorShape { name, expected, .. }
            if name == "encoder.layer.0.intermediate.dense.weight" && expected == &[INTER, HIDDEN]),
        "{err}"
    );
    let mut t = tiny_weights(8);
    t.retain(|n, _| !n.starts_with("embeddings."));
    let err = load_err(&write_model("no-embeddings", &t, "", Dtype::F32));
    assert!(
        err.to_string()
            .contains("embeddings.word_embeddings.weight"),
        "{err}"
    );
}

#[test]
fn bad_configs_are_rejected() {
    let t = tiny_weights(9);
    let dir = write_model("bad-act", &t, "", Dtype::F32);
    std::fs::write(dir.join("config.json"), config_json("swish", HEADS)).unwrap();
    let err = load_err(&dir);
    assert!(
        matches!(&err, EmbedError::UnsupportedActivation { act, .. } if act == "swish"),
        "{err}"
    );

    std::fs::write(dir.join("config.json"), config_json("gelu", 3)).unwrap();
    let err = load_err(&dir);
    assert!(
        matches!(&err, EmbedError::Config { field, .. } if field == "num_attention_heads"),
        "{err}"
    );

    std::fs::write(dir.join("config.json"), "{\"hidden_act\": \"gelu\"").unwrap();
    assert!(matches!(load_err(&dir), EmbedError::Json { .. }));

    std::fs::write(dir.join("config.json"), config_json("gelu", HEADS)).unwrap();
    std::fs::write(
        dir.join("sentence_bert_config.json"),
        r#"{"max_seq_length": 13}"#,
    )
    .unwrap();
    let err = load_err(&dir);
    assert!(
        matches!(&err, EmbedError::Config { field, .. } if field == "max_seq_length"),
        "{err}"
    );
    assert!(err.to_string().contains("max_position_embeddings"), "{err}");

    std::fs::write(
        dir.join("sentence_bert_config.json"),
        r#"{"max_seq_length": 8}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("1_Pooling/config.json"),
        r#"{"pooling_mode_mean_tokens": true, "pooling_mode_cls_token": true}"#,
    )
    .unwrap();
    let err = load_err(&dir);
    assert!(
        matches!(&err, EmbedError::Config { field, .. } if field == "pooling_mode_*"),
        "{err}"
    );
    std::fs::write(
        dir.join("1_Pooling/config.json"),
        r#"{"pooling_mode_cls_token": true}"#,
    )
    .unwrap();
    Embedder::load(&dir, 1).expect("CLS pooling loads");
}
