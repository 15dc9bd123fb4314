//! One answer pipeline (`engram-rag`) with the real embedder and indexes: grounding keeps the
//! hits about the question and refuses a question nothing answers, leaves out a passage that
//! repeats a better-ranked one and those in another language, and the evidence sentence it
//! chooses holds the fact asked for.

use engram_fusion::is_chinese;
use engram_kb::{ChunkConfig, KnowledgeBase, NewDocument, SearchHit, SearchRequest};

use crate::common;

const PUMPS: &str = "The pump station supplies the east district with drinking water.\n\n\
    Inspect the pumps every Monday and log the pressure and the flow rate. Replace the inlet \
    valve every twelve months; grease the outlet valve monthly.";
/// The same text under a night-shift heading: a near-duplicate of [`PUMPS`].
const PUMPS_COPY: &str = "Night shift copy.\n\n\
    The pump station supplies the east district with drinking water.\n\n\
    Inspect the pumps every Monday and log the pressure and the flow rate. Replace the inlet \
    valve every twelve months; grease the outlet valve monthly.";
const BAKERY: &str = "Our bakery opens at seven. Sourdough bread is baked fresh every \
    morning, and croissants come out of the oven at eight.";
const ZH_PUMPS: &str =
    "泵站为东区供应饮用水。每周一检查水泵，记录压力和流量。进水阀每十二个月更换一次。";
const ZH_TRAIN: &str = "高速铁路连接了北京和上海，全程大约四个半小时。列车每天早上六点发车。";

fn hits(kb: &KnowledgeBase, question: &str) -> Vec<SearchHit> {
    kb.search(&SearchRequest::new("ops", question))
        .expect("search runs")
        .hits
}

#[test]
fn grounding_keeps_what_answers_the_question_and_refuses_the_rest() {
    let dir = common::temp_dir("rag-ground");
    let mut kb = KnowledgeBase::open(&dir, crate::kb::models()).expect("the knowledge base opens");
    kb.ensure_collection("ops", ChunkConfig::default()).unwrap();
    let docs = [
        ("pumps.txt", PUMPS),
        ("pumps-night.txt", PUMPS_COPY),
        ("bakery.txt", BAKERY),
        ("pumps-zh.txt", ZH_PUMPS),
        ("train.txt", ZH_TRAIN),
    ];
    let docs: Vec<NewDocument> = docs.iter().map(|&(n, t)| NewDocument::new(n, t)).collect();
    kb.ingest("ops", docs, &mut |_| {}).expect("ingest runs");

    // Answered: the copy left out, no Chinese passage beside the English ones, and the
    // evidence sentence is the one that holds the interval.
    let q = "How often is the inlet valve replaced?";
    let retrieved = hits(&kb, q);
    let g = engram_rag::ground(kb.models(), q, retrieved.clone()).expect("grounding runs");
    let texts: Vec<&str> = g.hits.iter().map(|h| h.text.as_str()).collect();
    assert!(!g.refused(), "{retrieved:?}");
    assert_eq!(
        texts.iter().filter(|t| t.contains("inlet valve")).count(),
        1,
        "one of the two copies: {texts:?}"
    );
    assert!(texts.iter().all(|t| !is_chinese(t)), "{texts:?}");
    // The embedder's choice, or (one sentence near the best term score) the terms' choice,
    // which the prompt makes.
    let evidence = g
        .evidence
        .clone()
        .or_else(|| engram_rag::evidence(q, texts.iter().copied()))
        .unwrap_or_default();
    assert!(evidence.contains("twelve months"), "{evidence:?}");

    // Nothing here is about it: refused, with no hit left to cite.
    let q = "Who won the football world cup in 1998?";
    let g = engram_rag::ground(kb.models(), q, hits(&kb, q)).expect("grounding runs");
    assert!(g.refused(), "{:?}", g.hits);
    assert!(g.evidence.is_none());

    // A Chinese question keeps the Chinese passages only.
    let q = "高速铁路从北京到上海要多长时间？";
    let g = engram_rag::ground(kb.models(), q, hits(&kb, q)).expect("grounding runs");
    assert!(!g.refused());
    assert!(g.hits.iter().all(|h| is_chinese(&h.text)), "{:?}", g.hits);
    assert!(
        g.hits.iter().any(|h| h.text.contains("四个半小时")),
        "{:?}",
        g.hits
    );
}
