//! The constrained-decoding mask on the default model's vocabulary (SmolLM2, 49,152 tokens):
//! what a decoding step under a JSON Schema costs on top of the forward pass.
//!
//! - `trie`: building the vocabulary trie (once per engine).
//! - `cold/structure`: the first mask of an answer (a fresh matcher at `{`): nothing cached.
//! - `cold/string`: the first mask inside a string value, where most of the vocabulary is
//!   allowed and the whole trie is walked (the worst step).
//! - `warm/string`: a later step inside the same string: the state recurs, its mask is kept,
//!   and the step is copying it onto the logits.
//!
//! ```text
//! cargo bench -p engram-grammar --bench mask
//! ```
//!
//! Needs `models/SmolLM2-135M-Instruct.Q4_1.gguf` (scripts/fetch-models.sh).

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use engram_grammar::{compile, Constrained, Grammar, Json, TokenTrie};
use engram_tokenizer::Tokenizer;

const SCHEMA: &str = r#"{"type": "object", "properties": {
    "name": {"type": "string"}, "born": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "born"]}"#;

fn tokenizer() -> Tokenizer {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../models/SmolLM2-135M-Instruct.Q4_1.gguf"
    );
    let file =
        engram_gguf::GgufFile::open(path).expect("the default model (scripts/fetch-models.sh)");
    Tokenizer::from_gguf(file.metadata()).expect("its tokenizer")
}

fn trie_of(t: &Tokenizer) -> TokenTrie {
    let n = t.vocab_size() as u32;
    let tokens = (0..n)
        .filter(|&id| !t.is_special(id) && !t.is_eog(id))
        .map(|id| (id, t.token_piece(id)));
    TokenTrie::new(tokens, t.eog_ids(), t.vocab_size())
}

fn bench(c: &mut Criterion) {
    let t = tokenizer();
    c.bench_function("trie", |b| b.iter(|| trie_of(&t)));
    let trie = Arc::new(trie_of(&t));
    let grammar: Arc<Grammar> =
        Arc::new(compile(&serde_json::from_str::<Json>(SCHEMA).unwrap()).unwrap());
    let mut logits = vec![0.0f32; t.vocab_size()];
    c.bench_function("cold/structure", |b| {
        b.iter(|| {
            let mut g = Constrained::new(grammar.clone(), trie.clone());
            g.mask(&mut logits)
        })
    });
    c.bench_function("cold/string", |b| {
        b.iter(|| {
            let mut g = Constrained::new(grammar.clone(), trie.clone());
            assert!(g.accept(br#"{"name": ""#));
            g.mask(&mut logits)
        })
    });
    let mut g = Constrained::new(grammar.clone(), trie.clone());
    assert!(g.accept(br#"{"name": "Ada"#));
    g.mask(&mut logits);
    c.bench_function("warm/string", |b| {
        b.iter(|| {
            assert!(g.accept(b"a"));
            g.mask(&mut logits)
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
