//! Compute for storage on the real default model: fused prefill against full prefill, stored
//! KV placed by RoPE, rejected blobs, a full NVMe tier, the prefix cache, the fidelity gate,
//! and `engram ingest --kv` / `ask` / `eval fusion` end to end.

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use engram_fusion::{
    chunk_tokens, fused_prefill, fused_prefill_interleaved, fused_prefill_on, kl_divergence,
    rag_frame, ChunkStore, Ensured, FidelityGate, FusedPrompt, Interleave, Policy, PrefixCache,
    Runner, Source, DEFAULT_POLICY, DEFAULT_SYSTEM,
};
use engram_kvstore::{DramTier, IoMode, KvDtype, KvStore, NvmeOptions, NvmeTier};
use engram_model::{argmax, Blend, KvCache, Logits, Model};
use engram_rag::{rag_prompt, CopyBias};
use engram_tokenizer::{ChatTemplate, Tokenizer};

use crate::common::{default_llm, engram_bin, models_dir, temp_dir};

/// Logits of two routes that do the same arithmetic up to batch composition (which tokens
/// share a matmul call) and f16 rounding of placed keys: measured below 0.05 on this model;
/// 0.25 still tells any real difference apart (reusing stale KV moves them by several units).
const TOL_SAME_LOGITS: f32 = 0.25;

/// KL divergence between two routes that differ only in the order of floating-point sums.
const MAX_KL_SAME: f64 = 0.01;

/// KL divergence between a prefill run whole and in pieces of 16 tokens: the attention of a
/// small piece splits the cache into slices and merges them (more tasks than KV heads x query
/// tiles), a different order of sums, which 30 layers amplify. Measured on the interleaved
/// test's prompt (1,390 tokens) on an AVX-512 Xeon: 0.0016 (`full`) and 0.0057 (`boundary:8`)
/// without AMX, 0.0106 (`full`) with it; 0.05 is still far below what wrong positions or
/// stale KV give (several units of logit).
const MAX_KL_PIECES: f64 = 0.05;

struct Llm {
    model: Model,
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
}

fn llm() -> &'static Llm {
    static LLM: OnceLock<Llm> = OnceLock::new();
    LLM.get_or_init(|| {
        let model = Model::load(default_llm(), 2).expect("loading the default LLM");
        let meta = model.gguf().metadata();
        let tokenizer = Tokenizer::from_gguf(meta).expect("tokenizer");
        let template = ChatTemplate::from_gguf(meta).expect("template");
        Llm {
            model,
            tokenizer,
            template,
        }
    })
}

const PASSAGES: [&str; 3] = [
    "The Rhine rises in the Swiss Alps and flows north through Germany and the Netherlands into the North Sea. Basel, Strasbourg and Cologne stand on its banks.",
    "Ada Lovelace wrote the first published program for Charles Babbage's Analytical Engine in 1843, a method for computing Bernoulli numbers.",
    "The Eiffel Tower was completed in 1889 for the World's Fair in Paris. At 330 metres it was the tallest man-made structure for four decades.",
];

fn prompt(l: &Llm, question: &str) -> FusedPrompt {
    rag_prompt(
        &l.tokenizer,
        l.template.as_ref(),
        DEFAULT_SYSTEM,
        &PASSAGES,
        question,
    )
    .expect("prompt")
}

fn dram_store(l: &Llm) -> ChunkStore {
    ChunkStore::new(
        Arc::new(KvStore::new(Some(DramTier::new(256 << 20)), None)),
        &l.model,
        rag_frame(&l.tokenizer, l.template.as_ref()).expect("frame"),
        KvDtype::F16,
    )
}

fn run(l: &Llm, store: &ChunkStore, p: &FusedPrompt, policy: Policy) -> engram_fusion::Prefilled {
    let mut kv = l.model.new_cache(p.len() + 8);
    fused_prefill(&l.model, store, None, p, policy, &mut kv).expect("fused prefill")
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn fused_prefill_recomputing_every_token_equals_full() {
    let l = llm();
    let p = prompt(l, "Who wrote the first published program?");
    // Chunks computed after the BOS only, so no chunk is exact and boundary:10000 recomputes
    // them all.
    let bos_store = ChunkStore::new(
        Arc::new(KvStore::new(Some(DramTier::new(256 << 20)), None)),
        &l.model,
        engram_fusion::bos_frame(l.tokenizer.bos_id()),
        KvDtype::F16,
    );
    for c in &p.chunks {
        bos_store.ensure(&l.model, c).expect("precompute");
    }
    let full = run(l, &bos_store, &p, Policy::Full);
    for policy in [
        Policy::Deviation(1.0),
        Policy::Boundary(10_000),
        Policy::Query(1.0),
    ] {
        let fused = run(l, &bos_store, &p, policy);
        let d = max_diff(&full.logits, &fused.logits);
        eprintln!("{policy}: max |logit diff| vs full {d:.4}");
        assert!(
            d < TOL_SAME_LOGITS,
            "{policy}: logits differ from full by {d}"
        );
        assert_eq!(fused.stats.recomputed_chunk_tokens, p.chunk_tokens());
        assert_eq!(fused.stats.chunks_computed, 0, "chunks came from the store");
    }
    // Reusing stored KV without recomputation really is different: the bar above is not
    // passed by accident.
    let reuse = run(l, &bos_store, &p, Policy::Reuse);
    assert!(max_diff(&full.logits, &reuse.logits) > TOL_SAME_LOGITS);
    assert!(kl_divergence(&full.logits, &reuse.logits) > 0.0);
}

/// `Policy::Query`'s first pass ends early: a query observer that breaks at layer 3 sees layers
/// 0-3 with the same queries as a pass through every layer, gets no logits, and leaves those
/// layers' KV as that pass does.
#[test]
fn a_query_observer_ends_the_pass_at_its_layer() {
    let l = llm();
    let tokens: Vec<u32> = chunk_tokens(&l.tokenizer, PASSAGES[0]).expect("tokenize");
    let positions: Vec<i32> = (0..tokens.len() as i32).collect();
    // A pass whose observer records every layer's queries and breaks after `last`.
    let pass = |last: usize| {
        let mut seen: Vec<(usize, Vec<f32>)> = Vec::new();
        let mut kv = l.model.new_cache(tokens.len());
        let logits = l
            .model
            .forward_queries(&tokens, &positions, &mut kv, Logits::Last, &mut |li, q| {
                seen.push((li, q.to_vec()));
                if li < last {
                    ControlFlow::Continue(())
                } else {
                    ControlFlow::Break(())
                }
            })
            .expect("forward_queries");
        (seen, kv, logits)
    };
    let (seen, whole_kv, logits) = pass(usize::MAX);
    assert_eq!(seen.len(), l.model.config().n_layer);
    assert!(!logits.is_empty());

    let (early, early_kv, logits) = pass(3);
    assert!(logits.is_empty(), "a pass that ends early has no logits");
    assert_eq!(early, seen[..4], "layers 0-3 and their queries");
    let (_, heads, _) = whole_kv.shape();
    for layer in 0..4 {
        for head in 0..heads {
            assert_eq!(
                early_kv.keys(layer, head, tokens.len()),
                whole_kv.keys(layer, head, tokens.len()),
                "keys, layer {layer} head {head}"
            );
            assert_eq!(
                early_kv.values(layer, head, tokens.len()),
                whole_kv.values(layer, head, tokens.len()),
                "values, layer {layer} head {head}"
            );
        }
    }
}

/// A chunk's stored keys, rotated to where the chunk sits in a prompt, equal the keys a plain
/// forward pass computes there, in every layer.
/// Chunked prefill: another sequence's decode steps run between the prompt's pieces, and
/// neither the prompt's logits nor the other sequence's are changed by it.
/// A [`Runner`] on the CPU that behaves as a GPU one does: at its first call it copies the
/// cache as it is then (the GPU's upload) and works on its own copy from then on.
struct CopyingRunner<'m> {
    model: &'m Model,
    own: Option<KvCache>,
    calls: usize,
}

impl CopyingRunner<'_> {
    fn own(&mut self, kv: &KvCache) -> &mut KvCache {
        self.calls += 1;
        self.own.get_or_insert_with(|| kv.clone())
    }
}

impl Runner for CopyingRunner<'_> {
    fn append(
        &mut self,
        kv: &KvCache,
        tokens: &[u32],
        positions: &[i32],
        logits: Logits,
    ) -> engram_model::Result<Vec<f32>> {
        let model = self.model;
        let own = self.own(kv);
        model.forward(tokens, positions, own, logits)
    }

    fn recompute(
        &mut self,
        kv: &KvCache,
        tokens: &[u32],
        positions: &[i32],
        overwrite: &[usize],
        logits: Logits,
    ) -> engram_model::Result<Vec<f32>> {
        let model = self.model;
        let own = self.own(kv);
        let n = tokens.len();
        let mut keep_all = |_: &[f32]| (0..n).collect::<Vec<usize>>();
        let blend = Blend {
            check_layer: 0,
            select: &mut keep_all,
        };
        Ok(model
            .forward_blend(tokens, positions, overwrite, own, blend, logits)?
            .0)
    }
}

/// The forward passes after placement on another device (a [`Runner`] that takes the placed
/// cache over at its first call, as `engramd`'s GPU runner does) give the CPU route's logits
/// and leave the whole prompt in the runner's cache; `full` and `deviation` never call it.
#[test]
fn a_runner_takes_over_the_placed_cache_and_gives_the_same_logits() {
    let l = llm();
    let store = dram_store(l);
    let p = prompt(l, "When was the Eiffel Tower completed?");
    for policy in [
        Policy::Boundary(4),
        Policy::Reuse,
        Policy::Query(0.05),
        Policy::Full,
        Policy::Deviation(0.1),
    ] {
        let plain = run(l, &store, &p, policy);
        let mut runner = CopyingRunner {
            model: &l.model,
            own: None,
            calls: 0,
        };
        let mut kv = l.model.new_cache(p.len() + 8);
        let got = fused_prefill_on(
            &l.model,
            &store,
            None,
            &p,
            policy,
            &mut kv,
            None,
            Some(&mut runner),
        )
        .expect("fused prefill on a runner");
        assert_eq!(argmax(&got.logits), argmax(&plain.logits), "{policy}");
        let d = max_diff(&got.logits, &plain.logits);
        assert!(d < TOL_SAME_LOGITS, "{policy}: logits differ by {d}");
        assert_eq!(got.next_position, plain.next_position, "{policy}");
        match policy {
            Policy::Full | Policy::Deviation(_) => {
                assert_eq!(runner.calls, 0, "{policy}");
                assert_eq!(
                    kv.len(),
                    p.len(),
                    "{policy}: the CPU cache holds the prompt"
                );
            }
            _ => {
                assert!(runner.calls >= 1, "{policy}");
                let own = runner.own.as_ref().expect("taken over");
                assert_eq!(own.len(), p.len(), "{policy}: the runner holds the prompt");
                assert!(
                    kv.len() < p.len(),
                    "{policy}: the CPU cache is left as placed"
                );
            }
        }
    }
}

#[test]
fn interleaved_prefill_gives_the_same_logits_and_runs_the_pauses() {
    let l = llm();
    let store = dram_store(l);
    let p = prompt(l, "Where does the Rhine rise?");
    let other: Vec<u32> = chunk_tokens(&l.tokenizer, PASSAGES[1]).expect("tokenize");
    for policy in [Policy::Full, Policy::Boundary(8)] {
        let plain = run(l, &store, &p, policy);

        // The other sequence decodes one token of `other` per pause.
        let mut other_kv = l.model.new_cache(other.len());
        let mut other_logits = Vec::new();
        let mut pauses = 0usize;
        let mut between = || {
            if pauses < other.len() {
                let pos = pauses as i32;
                other_logits.extend(
                    l.model
                        .forward(&other[pauses..=pauses], &[pos], &mut other_kv, Logits::Last)
                        .expect("other decode step"),
                );
            }
            pauses += 1;
        };
        let piece = 16;
        let in_pieces = |between: &mut dyn FnMut()| {
            let mut kv = l.model.new_cache(p.len() + 8);
            fused_prefill_interleaved(
                &l.model,
                &store,
                None,
                &p,
                policy,
                &mut kv,
                Some(Interleave { piece, between }),
            )
            .expect("prefill in pieces")
        };
        // The same pieces with nothing between them: the reference for what the pauses may
        // change, which is nothing.
        let pieces = in_pieces(&mut || {});
        let got = in_pieces(&mut between);
        let run_through = match policy {
            Policy::Full => p.len(),
            _ => p.prefix.len() + got.stats.recomputed_chunk_tokens,
        };
        assert!(
            pauses >= run_through / piece - 2,
            "{policy}: {pauses} pauses for {run_through} tokens in pieces of {piece}"
        );
        assert!(got.stats.interleaved_time > std::time::Duration::ZERO);
        // Another sequence's decode steps between the pieces change no bit of the prefill.
        assert!(
            got.logits == pieces.logits,
            "{policy}: the pauses changed the prefill's logits"
        );
        // Smaller pieces change only the order of floating-point sums (how the attention
        // splits its work): see MAX_KL_PIECES.
        let kl = kl_divergence(&plain.logits, &got.logits);
        assert!(kl < MAX_KL_PIECES, "{policy}: prompt KL {kl}");

        let n = pauses.min(other.len());
        let mut alone_kv = l.model.new_cache(other.len());
        let alone = l
            .model
            .prefill(
                &other[..n],
                &(0..n as i32).collect::<Vec<_>>(),
                &mut alone_kv,
                Logits::All,
            )
            .expect("other alone");
        let vocab = l.model.config().vocab_size;
        for (i, (a, b)) in other_logits
            .chunks(vocab)
            .zip(alone.chunks(vocab))
            .enumerate()
        {
            let kl = kl_divergence(b, a);
            assert!(
                kl < MAX_KL_SAME,
                "{policy}: other sequence, token {i}: KL {kl}"
            );
        }
    }
}

#[test]
fn stored_chunk_keys_placed_by_rope_equal_keys_computed_in_place() {
    let l = llm();
    let cfg = l.model.config();
    let frame = rag_frame(&l.tokenizer, l.template.as_ref()).expect("frame");
    let chunk = chunk_tokens(&l.tokenizer, PASSAGES[1]).expect("tokens");
    let stored = engram_fusion::precompute(&l.model, &frame, &chunk).expect("precompute");
    // In place: the frame then the chunk, computed by a plain forward pass.
    let all: Vec<u32> = frame.iter().chain(&chunk).copied().collect();
    let mut direct = l.model.new_cache(all.len());
    let positions: Vec<i32> = (0..all.len() as i32).collect();
    l.model
        .forward(&all, &positions, &mut direct, Logits::None)
        .expect("forward");
    // Placed: the stored pre-RoPE keys rotated to the same positions.
    let mut placed = l.model.new_cache(all.len());
    let chunk_pos: Vec<i32> = (frame.len() as i32..all.len() as i32).collect();
    placed
        .append_prerope(
            l.model.rope(),
            &chunk_pos,
            |ly, h| stored.k_head(ly, h),
            |ly, h| stored.v_head(ly, h),
            l.model.pool(),
        )
        .expect("place");
    let mut worst = 0.0f32;
    for layer in 0..cfg.n_layer {
        for h in 0..cfg.n_head_kv {
            for t in 0..chunk.len() {
                let a = placed.key(layer, h, t);
                let b = direct.key(layer, h, frame.len() + t);
                let scale = b.iter().fold(1.0f32, |m, x| m.max(x.abs()));
                worst = worst.max(max_diff(&a, &b) / scale);
            }
        }
    }
    eprintln!("worst relative key difference {worst:.2e}");
    // Two f16 roundings (stored, then placed) against one: a few units of 2^-11.
    assert!(
        worst < 4e-3,
        "placed keys differ from computed ones by {worst}"
    );
}

#[test]
fn corrupted_or_foreign_blobs_are_rejected_and_recomputed() {
    let l = llm();
    let store = dram_store(l);
    let p = prompt(l, "When was the Eiffel Tower completed?");
    let reference = run(l, &store, &p, Policy::Reuse);
    let refs: Vec<&[u32]> = p.chunks.iter().map(Vec::as_slice).collect();

    // Corrupt chunk 0's blob (one flipped byte) and store a blob of another model under chunk
    // 1's key.
    let key0 = store.key(refs[0]);
    let mut bad = store.store().get_many(&[key0])[0]
        .clone()
        .expect("stored")
        .0
        .to_vec();
    let mid = bad.len() / 2;
    bad[mid] ^= 0x40;
    store.store().put(&key0, &bad);
    let other = engram_kvstore::ModelFingerprint([7; 16]);
    let kv1 = store.precompute(&l.model, refs[1]).expect("precompute");
    store.store().put(
        &store.key(refs[1]),
        &engram_kvstore::encode(&kv1, &other, KvDtype::F16),
    );

    let (fetched, _) = store.fetch(&l.model, &refs).expect("fetch");
    assert_eq!(fetched[0].source, Source::Computed);
    assert_eq!(fetched[1].source, Source::Computed);
    assert!(matches!(fetched[2].source, Source::Tier(_)));
    assert_eq!(
        store
            .counters
            .rejected
            .load(std::sync::atomic::Ordering::Relaxed),
        2
    );
    // Counted by reason (a checksum for the flipped byte, a fingerprint for the other model)
    // and by the tier that served them.
    let counts = store.counters.snapshot();
    let by = |r: engram_fusion::Reject| {
        counts.rejected[engram_fusion::Reject::ALL
            .iter()
            .position(|&x| x == r)
            .unwrap()]
    };
    assert_eq!(by(engram_fusion::Reject::Checksum), 1);
    assert_eq!(by(engram_fusion::Reject::Fingerprint), 1);
    assert_eq!(counts.rejected_dram, 2);
    // The recomputed chunks were stored again and give the same answer as before.
    let again = run(l, &store, &p, Policy::Reuse);
    assert_eq!(again.stats.chunks_computed, 0);
    assert!(max_diff(&reference.logits, &again.logits) < 1e-3);
}

fn nvme_store(l: &Llm, dir: &Path, budget: u64) -> ChunkStore {
    let nvme = NvmeTier::open(
        dir,
        NvmeOptions {
            budget_bytes: budget,
            io: IoMode::Auto,
            direct: true,
            reserve_free_bytes: 0,
        },
    )
    .expect("nvme tier");
    ChunkStore::new(
        Arc::new(KvStore::new(None, Some(nvme))),
        &l.model,
        rag_frame(&l.tokenizer, l.template.as_ref()).expect("frame"),
        KvDtype::Int8,
    )
}

/// Issue 16.6: the fingerprint record next to the NVMe tier says "changed" only when stored KV
/// belongs to something else, so the daemon's first start after `engram ingest --kv` (which
/// records it too) schedules no re-precompute.
#[test]
fn the_chunk_kv_fingerprint_record_reports_real_changes_only() {
    let l = llm();
    let dir = temp_dir("kv-fingerprint");
    {
        let store = nvme_store(l, &dir, 1 << 30);
        assert!(
            !store.record_fingerprint().unwrap(),
            "an empty tier has nothing to redo"
        );
        assert!(!store.record_fingerprint().unwrap(), "recorded");
        let p = prompt(l, "Who designed the tower?");
        store
            .ensure(&l.model, &p.chunks[0])
            .expect("precompute stores a blob");
    }
    let record = dir.join(engram_fusion::FINGERPRINT_RECORD);
    {
        // The same model again (a daemon after the command line): no change.
        let store = nvme_store(l, &dir, 1 << 30);
        assert!(!store.record_fingerprint().unwrap());
        // Another model's record, or blobs with no record at all: a change, reported once.
        std::fs::write(&record, "00112233445566778899aabbccddeeff").unwrap();
        assert!(store.record_fingerprint().unwrap());
        assert!(!store.record_fingerprint().unwrap());
        std::fs::remove_file(&record).unwrap();
        assert!(
            store.record_fingerprint().unwrap(),
            "blobs of an unknown model"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_full_nvme_tier_degrades_to_recompute() {
    let l = llm();
    // A budget smaller than one chunk's KV: nothing can be stored.
    let dir = temp_dir("fusion-full-tier");
    let store = nvme_store(l, &dir, 64 << 10);
    let p = prompt(l, "Where does the Rhine rise?");
    let done = run(l, &store, &p, DEFAULT_POLICY);
    assert_eq!(done.stats.chunks_computed, 3);
    // Ingestion is told so, and the daemon counts it (`kv_failed`).
    assert_eq!(
        store.ensure(&l.model, &p.chunks[0]).expect("ensure"),
        Ensured::NotStored
    );
    assert_eq!(
        store
            .counters
            .put_failed
            .load(std::sync::atomic::Ordering::Relaxed),
        4
    );
    // The answer equals what a store with room gives.
    let roomy = nvme_store(l, &temp_dir("fusion-roomy-tier"), 1 << 30);
    for c in &p.chunks {
        assert_eq!(roomy.ensure(&l.model, c).expect("ensure"), Ensured::Stored);
        assert_eq!(roomy.ensure(&l.model, c).expect("ensure"), Ensured::Present);
    }
    let stored = run(l, &roomy, &p, DEFAULT_POLICY);
    assert_eq!(stored.stats.chunks_from_nvme, 3);
    assert!(max_diff(&done.logits, &stored.logits) < 1e-3);
}

#[test]
fn the_default_prompt_opens_with_the_frame_so_its_first_chunk_is_exact() {
    let l = llm();
    let store = dram_store(l);
    // One retrieved chunk (the console's usual case): its stored KV was computed right after
    // the frame, and the prompt's prefix is that frame, so reusing it is full prefill up to
    // rounding (keys are stored before RoPE in f16 and rotated again when placed): measured
    // KL 0.005, max logit difference 0.76, against KL 0.075 and 2.9 without the frame.
    let chunk = chunk_tokens(&l.tokenizer, PASSAGES[2]).expect("tokens");
    // No evidence sentence (`grounded-noev`, otherwise the default layout): a suffix that
    // repeats the chunk's sentence amplifies the placed keys' rounding (KL 0.0095 with it) and
    // this test is about the chunk.
    let p = engram_rag::rag_prompt_with(
        engram_fusion::Layout::named("grounded-noev").expect("layout"),
        &l.tokenizer,
        l.template.as_ref(),
        DEFAULT_SYSTEM,
        &PASSAGES[2..],
        "When was the Eiffel Tower completed?",
        None,
    )
    .expect("prompt");
    assert_eq!(p.chunks, std::slice::from_ref(&chunk));
    assert_eq!(p.prefix, store.frame(), "the prefix is not the frame");
    store.ensure(&l.model, &chunk).expect("precompute");
    let full = run(l, &store, &p, Policy::Full);
    for policy in [Policy::Reuse, DEFAULT_POLICY] {
        let fused = run(l, &store, &p, policy);
        assert_eq!(fused.stats.recomputed_chunk_tokens, 0, "{policy}");
        let kl = kl_divergence(&full.logits, &fused.logits);
        eprintln!("{policy}: KL vs full {kl:.5}");
        assert!(kl < MAX_KL_SAME, "{policy}: KL {kl}");
        assert_eq!(argmax(&full.logits), argmax(&fused.logits), "{policy}");
    }
    // Without the frame in the prompt the same chunk is approximate.
    let plain = engram_rag::rag_prompt_with(
        engram_fusion::Layout::named("grounded-plain").expect("layout"),
        &l.tokenizer,
        l.template.as_ref(),
        DEFAULT_SYSTEM,
        &PASSAGES[2..],
        "When was the Eiffel Tower completed?",
        None,
    )
    .expect("prompt");
    assert_ne!(plain.prefix, store.frame());
    let full = run(l, &store, &plain, Policy::Full);
    let reuse = run(l, &store, &plain, Policy::Reuse);
    let kl = kl_divergence(&full.logits, &reuse.logits);
    eprintln!("plain layout, reuse: KL vs full {kl:.5}");
    assert!(kl > MAX_KL_SAME, "KL {kl}");
}

#[test]
fn every_framed_layout_opens_with_its_own_frame() {
    let l = llm();
    let question = "When was the Eiffel Tower completed?";
    let default = rag_frame(&l.tokenizer, l.template.as_ref()).expect("frame");
    for layout in engram_fusion::LAYOUTS {
        if !layout.frame_in_prompt || layout.question_first {
            continue;
        }
        let p = engram_rag::rag_prompt_with(
            *layout,
            &l.tokenizer,
            l.template.as_ref(),
            DEFAULT_SYSTEM,
            &PASSAGES[2..],
            question,
            None,
        )
        .expect("prompt");
        let frame = engram_fusion::rag_frame_for(*layout, &l.tokenizer, l.template.as_ref())
            .expect("frame");
        assert_eq!(
            p.prefix, frame,
            "{}: the prefix is not its frame",
            layout.name
        );
        // A preamble is part of the exact prefix, never of the fresh tokens after the passages.
        if !layout.preamble.is_empty() {
            assert!(frame.len() > default.len(), "{}", layout.name);
            let suffix = l.tokenizer.decode(&p.suffix, false);
            assert!(!suffix.contains(layout.preamble.trim()), "{}", layout.name);
        }
    }
}

#[test]
fn the_evidence_span_spells_the_sentence_the_prompt_shows() {
    let l = llm();
    // The default layout shows the sentence after its label, before the instruction.
    let p = prompt(l, "Which structure was the tallest for four decades?");
    let shown = l.tokenizer.decode(&p.suffix[p.evidence.clone()], false);
    assert_eq!(
        shown.trim(),
        "At 330 metres it was the tallest man-made structure for four decades."
    );
    // Its numbers are what the copy bias favours outside a number: 330's first digit.
    let copy = CopyBias::from_prompt(&p, &l.tokenizer, 2.0).expect("bias");
    let three = l.tokenizer.encode("3", false).expect("tokens")[0];
    let mut logits = vec![0.0f32; l.model.config().vocab_size];
    assert!(copy.apply(&[], &mut logits) >= 1);
    assert_eq!(logits[three as usize], 2.0);
    // A chosen sentence is spelled as given; a layout without one has no span.
    let chosen = "The Eiffel Tower was completed in 1889 for the World's Fair in Paris.";
    let p = engram_rag::rag_prompt_with(
        engram_fusion::DEFAULT_LAYOUT,
        &l.tokenizer,
        l.template.as_ref(),
        DEFAULT_SYSTEM,
        &PASSAGES,
        "When was the Eiffel Tower completed?",
        Some(chosen),
    )
    .expect("prompt");
    assert_eq!(
        l.tokenizer
            .decode(&p.suffix[p.evidence.clone()], false)
            .trim(),
        chosen
    );
    let p = engram_rag::rag_prompt_with(
        engram_fusion::Layout::named("grounded-noev").expect("layout"),
        &l.tokenizer,
        l.template.as_ref(),
        DEFAULT_SYSTEM,
        &PASSAGES,
        "When was the Eiffel Tower completed?",
        None,
    )
    .expect("prompt");
    assert!(p.evidence.is_empty());
}

#[test]
fn prefix_cache_serves_exact_prefixes() {
    let l = llm();
    let store = dram_store(l);
    let cache = PrefixCache::new(64 << 20);
    let p = prompt(l, "Who wrote the first published program?");
    let mut kv = l.model.new_cache(p.len() + 4);
    let cold =
        fused_prefill(&l.model, &store, Some(&cache), &p, Policy::Full, &mut kv).expect("cold");
    assert_eq!(cold.stats.prefix_cached_tokens, 0);
    assert_eq!(cache.len(), 1);
    let warm =
        fused_prefill(&l.model, &store, Some(&cache), &p, Policy::Full, &mut kv).expect("warm");
    assert_eq!(warm.stats.prefix_cached_tokens, p.prefix.len());
    assert!(max_diff(&cold.logits, &warm.logits) < TOL_SAME_LOGITS);
    // A longer prefix sharing the first blocks reuses them.
    let mut longer = p.clone();
    longer
        .prefix
        .extend(chunk_tokens(&l.tokenizer, PASSAGES[0]).expect("tokens"));
    let hit = cache.lookup(&longer.prefix).expect("a partial hit");
    assert_eq!(hit.len, p.prefix.len());
    // So does one that shares only some of it, token-exactly.
    let cut = p.prefix.len() - 3;
    let mut diverging = p.prefix[..cut].to_vec();
    diverging.extend([1, 2, 3, 4]);
    if let Some(hit) = cache.lookup(&diverging) {
        assert_eq!(hit.len, cut);
    } else {
        assert!(cut < engram_fusion::BLOCK, "a shared block was not found");
    }
    let mut different = p.prefix.clone();
    different[0] = different[0].wrapping_add(1);
    assert!(cache.lookup(&different).is_none());
}

#[test]
fn fidelity_gate_passes_the_default_policy_and_reports_a_failure() {
    let l = llm();
    let frame = rag_frame(&l.tokenizer, l.template.as_ref()).expect("frame");
    let ok = FidelityGate::check(
        &l.model,
        &l.tokenizer,
        l.template.as_ref(),
        frame.clone(),
        DEFAULT_POLICY,
    )
    .expect("gate");
    eprintln!("gate: {ok:?}");
    assert!(ok.passed && ok.reason.is_none(), "{ok:?}");
    assert!(ok.mean_kl > 0.0 && ok.mean_kl <= ok.max_kl);
    // Limits no approximation meets: the gate fails and says why.
    let strict = engram_fusion::GateLimits {
        max_mean_kl: 0.0,
        min_agreement: 1.0,
    };
    let bad = FidelityGate::check_with(
        &l.model,
        &l.tokenizer,
        l.template.as_ref(),
        frame,
        Policy::Reuse,
        strict,
    )
    .expect("gate");
    assert!(!bad.passed, "{bad:?}");
    assert!(
        bad.reason.as_deref().unwrap_or("").contains("KL"),
        "{bad:?}"
    );
}

fn engram(data: &Path, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(engram_bin())
        .env("ENGRAM_MODELS_DIR", models_dir())
        .args(args)
        .arg("--data-dir")
        .arg(data)
        .output()
        .expect("running engram");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn cli_ingest_kv_then_ask_loads_stored_chunks() {
    let data = temp_dir("fusion-ask");
    let docs = data.join("docs");
    std::fs::create_dir_all(&docs).expect("docs folder");
    for (i, p) in PASSAGES.iter().enumerate() {
        std::fs::write(docs.join(format!("p{i}.txt")), p).expect("write");
    }
    let docs_arg = docs.to_string_lossy().into_owned();
    let (ok, out, err) = engram(
        &data,
        &[
            "ingest",
            &docs_arg,
            "--collection",
            "facts",
            "--kv",
            "--json",
        ],
    );
    assert!(ok, "ingest failed: {err}");
    let report: serde_json::Value = serde_json::from_str(&out).expect("JSON report");
    assert_eq!(report["kv"]["computed"], 3, "{report}");
    let (ok, out, err) = engram(
        &data,
        &[
            "ask",
            "Who wrote a program for the Analytical Engine?",
            "--collection",
            "facts",
            "--k",
            "3",
            "--max-tokens",
            "12",
            "--json",
        ],
    );
    assert!(ok, "ask failed: {err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON answer");
    assert_eq!(v["policy"], DEFAULT_POLICY.name());
    assert_eq!(v["timings"]["kv_chunks"]["nvme"], 3, "{v}");
    assert_eq!(v["timings"]["kv_chunks"]["computed"], 0, "{v}");
    assert!(v["citations"].as_array().expect("citations").len() == 3);
    assert!(v["citations"][0]["doc_name"].as_str().is_some());
    assert!(!v["answer"].as_str().expect("answer").is_empty(), "{v}");
    assert!(v["timings"]["first_token_ms"].as_f64().expect("ttft") > 0.0);

    // A model that fails the fidelity gate answers with full prefill and says why.
    let (ok, out, err) = engram(
        &data,
        &[
            "ask",
            "Who wrote a program for the Analytical Engine?",
            "--collection",
            "facts",
            "--max-tokens",
            "4",
            "--gate-max-kl",
            "0",
            "--json",
        ],
    );
    assert!(ok, "ask failed: {err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON answer");
    assert_eq!(v["policy"], "full", "{v}");
    assert!(
        v["fusion_disabled"].as_str().unwrap_or("").contains("KL"),
        "{v}"
    );
    assert_eq!(v["timings"]["kv_chunks"]["nvme"], 0, "{v}");

    // A question none of the passages is about is not answered from them (as engramd).
    let (ok, out, err) = engram(
        &data,
        &[
            "ask",
            "How do I reset my password for the payroll portal?",
            "--collection",
            "facts",
            "--json",
        ],
    );
    assert!(ok, "ask failed: {err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON answer");
    assert_eq!(v["answer"], engram_rag::no_answer("password"), "{v}");
    assert_eq!(v["citations"], serde_json::json!([]), "{v}");
}

#[test]
fn cli_eval_fusion_set_puts_the_gold_paragraph_among_distractors() {
    let dir = temp_dir("fusion-set");
    let out_file = dir.join("set.json");
    let out = std::process::Command::new(engram_bin())
        .env("ENGRAM_MODELS_DIR", models_dir())
        .args(["eval", "fusion-set", "--set", "xquad-en", "--qa-root"])
        .arg(crate::common::shared_dir().join("data/qa-eval"))
        .args(["--questions", "5", "--tokens", "1500", "--out"])
        .arg(&out_file)
        .output()
        .expect("running engram");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let set: Vec<serde_json::Value> =
        serde_json::from_slice(&std::fs::read(&out_file).expect("read")).expect("JSON");
    assert_eq!(set.len(), 5);
    let l = llm();
    for q in &set {
        let ctxs = q["ctxs"].as_array().expect("ctxs");
        assert!(ctxs.len() >= 2, "{q}");
        let gold = &ctxs[q["gold"].as_u64().expect("gold") as usize];
        // The gold paragraph holds an answer (XQuAD's answers are spans of it); no distractor
        // comes from its article.
        let text = gold["text"].as_str().expect("text");
        assert!(
            q["answers"]
                .as_array()
                .expect("answers")
                .iter()
                .any(|a| text.contains(a.as_str().expect("answer"))),
            "{q}"
        );
        let titles: Vec<&str> = ctxs.iter().map(|c| c["title"].as_str().unwrap()).collect();
        let gold_title = gold["title"].as_str().unwrap();
        assert_eq!(titles.iter().filter(|t| **t == gold_title).count(), 1);
        let tokens: usize = ctxs
            .iter()
            .map(|c| {
                let t = format!(
                    "{}\n{}",
                    c["title"].as_str().unwrap(),
                    c["text"].as_str().unwrap()
                );
                chunk_tokens(&l.tokenizer, &t).expect("tokens").len()
            })
            .sum();
        assert!((1500..=4000).contains(&tokens), "{tokens} passage tokens");
    }
}

#[test]
fn cli_eval_fusion_reports_every_policy() {
    let dir = temp_dir("fusion-eval");
    let data = dir.join("q.json");
    let ctxs: Vec<serde_json::Value> = PASSAGES
        .iter()
        .map(|p| serde_json::json!({"title": "", "text": p}))
        .collect();
    let qs = serde_json::json!([
        {"question": "Where does the Rhine rise?", "answers": ["Swiss Alps"], "ctxs": ctxs},
        {"question": "When was the Eiffel Tower completed?", "answers": ["1889"], "ctxs": ctxs},
    ]);
    std::fs::write(&data, qs.to_string()).expect("write");
    let out = std::process::Command::new(engram_bin())
        .env("ENGRAM_MODELS_DIR", models_dir())
        .args(["eval", "fusion", "--data"])
        .arg(&data)
        .args([
            "--policies",
            "reuse,boundary:4,deviation:1.0",
            "--tier",
            "nvme",
            "--nvme-dir",
        ])
        .arg(dir.join("kv"))
        .args(["--answer-tokens", "6", "--json"])
        .output()
        .expect("running engram");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let p = &v["policies"];
    for name in ["full", "full~", "reuse", "boundary:4", "deviation:1"] {
        for field in [
            "first_token_agreement",
            "answer_f1_vs_full",
            "kl_mean",
            "gold_f1",
            "recompute_fraction",
            "ttft_ms_median",
            "ttft_ratio_vs_full",
            "first_token_agreement_decisive",
            "decisive_questions",
        ] {
            assert!(p[name][field].is_number(), "{name}.{field} missing: {v}");
        }
    }
    assert_eq!(p["full"]["first_token_agreement_decisive"], 1.0);
    let margins = p["full"]["per_question"]["full_first_token_margin"]
        .as_array()
        .expect("full's margins");
    assert_eq!(
        margins.len() as u64,
        v["config"]["questions"].as_u64().unwrap()
    );
    assert!(margins.iter().all(|m| m.as_f64().unwrap() >= 0.0), "{v}");
    assert_eq!(p["full"]["kl_mean"], 0.0);
    assert_eq!(p["full"]["recompute_fraction"], 1.0);
    // Recomputing everything is full prefill again.
    assert!(p["deviation:1"]["kl_mean"].as_f64().unwrap() < 1e-3, "{v}");
    assert_eq!(p["deviation:1"]["first_token_agreement"], 1.0);
    assert!(p["reuse"]["recompute_fraction"].as_f64().unwrap() < 0.5);
    // The noise floor: full prefill with its chunk keys rounded once more is full prefill up
    // to rounding (a key rotated back the wrong way, or the suffix placed at other positions,
    // moves the logits by far more), and the report carries it apart.
    assert_eq!(p["full~"]["recompute_fraction"], 1.0);
    let floor_kl = p["full~"]["kl_mean"].as_f64().unwrap();
    assert!(floor_kl < 0.02, "full~ KL {floor_kl}: {v}");
    assert_eq!(v["noise_floor"]["row"], "full~", "{v}");
    assert_eq!(
        v["noise_floor"]["answer_f1_vs_full"],
        p["full~"]["answer_f1_vs_full"]
    );

    // The answers are recorded per question, so two runs can be compared: this run against
    // itself with one of full's answers changed.
    let full_q = &p["full"]["per_question"];
    assert_eq!(full_q["question"], serde_json::json!([0, 1]), "{v}");
    assert_eq!(full_q["answer"].as_array().map(Vec::len), Some(2), "{v}");
    let first = dir.join("first.json");
    std::fs::write(&first, &out.stdout).expect("write");
    let mut changed = v.clone();
    changed["policies"]["full"]["per_question"]["answer"][1] = "a different answer".into();
    let second = dir.join("second.json");
    std::fs::write(&second, changed.to_string()).expect("write");
    let diff = std::process::Command::new(engram_bin())
        .args(["eval", "fusion-diff"])
        .args([&first, &second])
        .arg("--json")
        .output()
        .expect("running engram");
    assert!(
        diff.status.success(),
        "{}",
        String::from_utf8_lossy(&diff.stderr)
    );
    let d: serde_json::Value = serde_json::from_slice(&diff.stdout).expect("JSON");
    assert_eq!(d["full"]["questions"], 2, "{d}");
    assert_eq!(d["full"]["first_token_agreement"], 1.0, "{d}");
    assert_eq!(d["full"]["answer_em"], 0.5, "{d}");
    assert_eq!(d["boundary:4"]["answer_em"], 1.0, "{d}");
}
