//! The RAG prompt as segments: the chat template rendered around a marker and split there,
//! so the chunks' stored token ids sit between an exact prefix and the question.

use engram_tokenizer::{ChatTemplate, Message, Tokenizer};

use crate::fuse::FusedPrompt;

/// System prompt of question answering over passages.
pub const DEFAULT_SYSTEM: &str =
    "You are a helpful assistant. Answer the question using only the given passages.";

/// CacheBlend's MuSiQue instruction, shared by [`QUESTION_INSTRUCTION`] and
/// [`FIRST_INSTRUCTION`] (a macro, since `concat!` takes literals only).
macro_rules! short_answer_instruction {
    () => {
        "Answer the question directly based on the given passages. Do NOT repeat the question. The answer should be within 5 words."
    };
}

/// What follows the passages: CacheBlend's MuSiQue instruction, then the question.
pub const QUESTION_INSTRUCTION: &str = concat!(short_answer_instruction!(), "\nQuestion: ");

/// Where the chunks go in the rendered template (a string no user text contains).
const MARKER: &str = "\u{1}ENGRAM-CHUNKS\u{1}";

/// A chunk's text as it appears in the prompt (followed by a blank line); tokenize it once,
/// at ingestion, and store the ids with the chunk's KV.
pub fn chunk_text(text: &str) -> String {
    format!("{}\n\n", text.trim_end())
}

/// Token ids of a chunk as the prompt holds them.
pub fn chunk_tokens(tokenizer: &Tokenizer, text: &str) -> engram_tokenizer::Result<Vec<u32>> {
    tokenizer.encode(&chunk_text(text), false)
}

/// Neutral passages a chunk is precomputed after (see [`rag_frame`]): invented, encyclopedic
/// prose about nothing a user would ask about, in the lower-case style of the evaluation
/// passages; about 1,400 tokens together.
pub const FRAME_CONTEXT: [&str; 2] = [
    "the valley of the upper river lies between two ranges of low hills and has been farmed since the bronze age. its soils are deep and well drained, and the summers are long enough for wheat, barley and orchards of apples and pears. the river itself is slow and wide in its lower course, and for many centuries it carried grain, timber and wool to the market towns downstream. a canal built in the eighteenth century allowed larger boats to pass the rapids near the old mill, and a railway line followed about eighty years later. the population grew quickly while the railway was new, then fell again when many families moved to the industrial cities of the coast.
the largest settlement in the valley is a market town with a stone bridge of seven arches, a parish church with a tall spire and a town hall that now houses a small museum. the museum keeps tools, maps and photographs of the river trade, as well as the records of the local school, which was founded by a group of merchants in 1854. the town holds a fair every autumn, when farmers bring livestock and produce from the surrounding villages. visitors come for the walking paths along the river, the ruins of a medieval abbey on the northern bank and the views from the hills, where a line of beacons was once kept ready to warn of invasion.
the climate is temperate. winters are cool and wet, with occasional snow on the higher ground, and most of the rain falls between october and february. floods were common until a series of embankments and sluices was completed in the 1930s; the worst recorded flood, in 1891, reached the steps of the church and destroyed two of the wooden footbridges. since then the river has been monitored by a network of gauges, and the water authority publishes daily readings of its level and flow.
the valley's economy today depends on agriculture, tourism and a number of small manufacturing firms. a dairy cooperative founded after the second world war collects milk from more than a hundred farms, and a brewery in the market town uses barley grown within a few miles of its gates. several of the old warehouses by the river have been converted into offices and apartments, and the former railway station is now a library. the local council has tried to attract new businesses with improved roads and faster internet connections, while preserving the character of the historic centre.
scholars have studied the valley for its well preserved field systems, its dialect and its records of land ownership, which go back to the thirteenth century. a survey carried out in the 1950s mapped every hedge and boundary stone, and later studies used the survey to show how farms were merged and divided over time. the valley has also appeared in novels and paintings, most famously in a series of watercolours of the river at different seasons, which now hang in the national gallery. each year a festival of music and literature brings writers and performers to the town, and the proceeds support the museum and the upkeep of the abbey ruins.",
    "the observatory on the northern ridge was built in the early twentieth century by a society of amateur astronomers, who raised the money through subscriptions and public lectures. its first telescope, a refractor with a lens of about thirty centimetres, was made by a workshop in the capital and carried up the ridge on a cart pulled by horses. the dome was turned by hand until an electric motor was fitted in the 1950s. for several decades the observatory recorded the positions of comets and variable stars, and its notebooks are still consulted by historians of science.
the ridge is exposed to strong winds from the west, and the weather changes quickly. in winter the road to the summit is often closed by snow, and the staff who lived there kept a store of food and fuel for several weeks. a small weather station beside the dome has measured temperature, pressure, rainfall and wind speed every day since 1921, one of the longest unbroken records in the region. the readings show that the average temperature has risen slowly over the century, while the number of days with frost has fallen.
today the observatory belongs to a university, which uses it for teaching and for a programme of public evenings. students learn to align the old telescope, to take photographs through a modern camera attached to it and to reduce the images on a computer. visitors climb a spiral staircase to the dome, where a guide explains the instruments and, on clear nights, shows them the moon, the planets and a few bright clusters of stars. the university has also restored the library of the original society, which holds star atlases, catalogues and the correspondence of its founders.
the forest below the ridge is managed for timber and for wildlife. beech and oak grow on the lower slopes and spruce higher up, and the forestry service keeps a network of tracks that walkers and cyclists may use. deer, foxes, badgers and many kinds of birds live there, and a survey of bats found nine species roosting in old trees and in the cellars of a ruined hunting lodge. each spring volunteers count the nesting birds along fixed routes, and their results are published in a yearly report that compares them with earlier counts.
a narrow railway once carried timber from the forest to a sawmill in the village at the foot of the ridge. the line closed in the 1960s, but part of it has been reopened as a heritage railway, run by volunteers, with a steam engine and two restored carriages. the sawmill became a museum of rural crafts, where visitors can watch demonstrations of wood turning, basket making and the repair of wooden wheels. the village holds a market on the first saturday of each month, and its inn, which dates from the seventeenth century, still serves travellers on the road over the pass.",
];

/// The frame chunks are computed in by default: the RAG prompt's own prefix (chat template,
/// default system prompt, "Passages:") followed by [`FRAME_CONTEXT`]. A chunk then sees at
/// precompute time what it sees in a real prompt: the same attention sink at position 0, the
/// instructions, and about 1,400 tokens of other passages before it, over which its attention
/// spreads as it does in a prompt of many chunks. Without that context a chunk's tokens attend
/// only to the sink and to themselves, and their stored KV drifts far from what full prefill
/// computes (measured in `docs/bench/2026-11-21-fusion.md`: mean KL of `reuse` 0.25 with the
/// prefix alone, 0.02-0.03 with these passages; 700 tokens gave 0.03, 2,800 no better than
/// 1,400).
///
/// The default layout also opens every prompt's passages with the same neutral passages
/// ([`Layout::frame_in_prompt`]), so a prompt's prefix is this frame: the first chunk's stored
/// KV is then exact (up to rounding), and every later chunk finds at question time the context
/// it was computed after, followed by the chunks before it.
pub fn rag_frame(
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
) -> engram_tokenizer::Result<Vec<u32>> {
    rag_frame_for(DEFAULT_LAYOUT, tokenizer, template)
}

/// [`rag_frame`] for the prompts of `layout`: its prefix (with its [`Layout::preamble`]) and
/// the neutral passages, so that a layout's first chunk is exact as the default's is.
pub fn rag_frame_for(
    layout: Layout,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
) -> engram_tokenizer::Result<Vec<u32>> {
    let mut frame = prefix_frame_for(layout, tokenizer, template)?;
    extend_with_frame_context(tokenizer, &mut frame)?;
    Ok(frame)
}

/// The RAG prompt's prefix without the neutral passages: an alternative frame for comparison.
pub fn rag_prefix_frame(
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
) -> engram_tokenizer::Result<Vec<u32>> {
    prefix_frame_for(DEFAULT_LAYOUT, tokenizer, template)
}

/// `layout`'s prefix without the question or the neutral passages.
fn prefix_frame_for(
    layout: Layout,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
) -> engram_tokenizer::Result<Vec<u32>> {
    let layout = Layout {
        frame_in_prompt: false,
        question_first: false,
        ..layout
    };
    Ok(build_prompt(
        layout,
        tokenizer,
        template,
        DEFAULT_SYSTEM,
        &[] as &[&str],
        "",
        None,
    )?
    .prefix)
}

/// Appends [`FRAME_CONTEXT`]'s passages, tokenized as chunks are.
fn extend_with_frame_context(
    tokenizer: &Tokenizer,
    ids: &mut Vec<u32>,
) -> engram_tokenizer::Result<()> {
    for passage in FRAME_CONTEXT {
        ids.extend(chunk_tokens(tokenizer, passage)?);
    }
    Ok(())
}

/// How the RAG prompt asks its question: compared by `engram eval qa --layouts`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub name: &'static str,
    /// The question also goes before the passages (read with the question in mind).
    pub question_first: bool,
    /// Before the passages (and the question, when it goes first): part of the exact prefix,
    /// so an instruction here costs no fresh tokens after the passages.
    pub preamble: &'static str,
    /// Between the passages and the question.
    pub instruction: &'static str,
    /// The start of the assistant's turn, part of the prompt (the answer follows it).
    pub seed: &'static str,
    /// [`Self::instruction`] and [`Self::seed`] for a question in Chinese.
    pub instruction_zh: &'static str,
    pub seed_zh: &'static str,
    /// The chunks go in reverse order, the best (first retrieved) next to the question.
    pub best_last: bool,
    /// The passages open with [`FRAME_CONTEXT`], the neutral passages every chunk's KV is
    /// computed after (APE's shared prefix): the prompt's prefix is then [`rag_frame`], so the
    /// first chunk's stored KV is exact (up to the f16 rounding of stored keys) and a later
    /// chunk's misses only the chunks before it.
    /// Measured with `engram eval fusion --layout grounded|grounded-plain`
    /// (docs/bench/2026-11-26-fusion-frame.md).
    pub frame_in_prompt: bool,
    /// Put before the evidence sentence (`engram-rag` chooses it), which goes between the
    /// passages and [`Self::instruction`]; empty: no evidence.
    pub evidence: &'static str,
    pub evidence_zh: &'static str,
    /// Longest evidence, in characters (`engram-rag` cuts the sentence to it).
    pub evidence_max_chars: usize,
}

/// [`QUESTION_INSTRUCTION`] for a question in Chinese.
pub const QUESTION_INSTRUCTION_ZH: &str =
    "根据上面的段落直接回答问题。不要重复问题。答案不超过十个字。\n问题：";

/// Layouts `engram eval qa` can compare; the first is the default. Measured on XQuAD-en (100
/// questions, full prefill, docs/bench/2026-11-26-qa.md): the seed "Answer:" keeps the model
/// from restating the question (F1 0.14 -> 0.18), the best chunk next to the question adds a
/// little (0.19); the question also before the passages, with an "I don't know" instruction,
/// made answers longer and worse (0.12-0.16). On XQuAD-zh the instruction in Chinese
/// (`grounded-zh`) is repeated back instead of followed, so Chinese questions get the English
/// one too. `grounded` opens the passages with the frame's neutral passages (see
/// [`Layout::frame_in_prompt`]); `grounded-plain` is the same without them, the default until
/// fusion was measured on held-out questions (docs/bench/2026-11-26-fusion-frame.md): on
/// XQuAD-en (150 questions, `boundary:4`) both answer about as well (F1 0.236 and 0.232).
/// `grounded` repeats the evidence sentence after the passages; `grounded-noev` is the same
/// without it, the default until docs/bench/2026-11-29-evidence.md (F1 +0.032 on XQuAD-en,
/// +0.054 on XQuAD-zh, +0.024 on CMRC2018), and `grounded-en-label` introduces it in English
/// for Chinese questions too (XQuAD-zh F1 0.165 against 0.169). `grounded-clause` cuts the
/// evidence to its best clauses within [`SHORT_EVIDENCE_CHARS`] and `grounded-short` also
/// shortens the instruction ([`SHORT_INSTRUCTION`]), for fewer fresh tokens after the passages:
/// on MuSiQue (40 questions) `grounded-short` recomputes 3.1 % of the prompt against 4.3 % at
/// the same fidelity, and on XQuAD-en (60) both answer a little worse than the default (F1
/// -0.028 and -0.015, neither significant; docs/bench/2026-12-02-fresh-tokens.md).
/// `grounded-first` moves the instruction before the passages ([`Layout::preamble`], part of the
/// exact prefix and of its frame, [`rag_frame_for`]), leaving only "Question: " and the question
/// after them: on MuSiQue (40 questions) it recomputes 3.3 % of the prompt against 4.3 % (19.8x
/// against 16.4x) at no better fidelity, and on XQuAD-en (60) it answers worse (F1 0.179 against
/// 0.240; with full prefill 0.200 against 0.242, -0.041 [-0.105, +0.013];
/// docs/bench/2026-12-02-instruction-first.md).
pub const LAYOUTS: &[Layout] = &[
    GROUNDED,
    Layout {
        name: "grounded-noev",
        evidence: "",
        evidence_zh: "",
        ..GROUNDED
    },
    Layout {
        name: "grounded-clause",
        evidence_max_chars: SHORT_EVIDENCE_CHARS,
        ..GROUNDED
    },
    Layout {
        name: "grounded-short",
        instruction: SHORT_INSTRUCTION,
        instruction_zh: SHORT_INSTRUCTION,
        evidence_max_chars: SHORT_EVIDENCE_CHARS,
        ..GROUNDED
    },
    Layout {
        name: "grounded-first",
        preamble: FIRST_INSTRUCTION,
        instruction: "Question: ",
        instruction_zh: "Question: ",
        ..GROUNDED
    },
    Layout {
        name: "grounded-en-label",
        evidence_zh: EVIDENCE,
        ..GROUNDED
    },
    Layout {
        name: "grounded-plain",
        frame_in_prompt: false,
        ..GROUNDED
    },
    Layout {
        name: "grounded-zh",
        instruction_zh: QUESTION_INSTRUCTION_ZH,
        seed_zh: "答案：",
        ..GROUNDED
    },
    Layout {
        name: "question-first",
        question_first: true,
        preamble: "",
        instruction: "Answer the question using only the passages above. Answer in a few words. If they do not contain the answer, say \"I don't know\".\nQuestion: ",
        seed: "Answer:",
        instruction_zh: "只根据上面的段落回答问题，用几个字回答。如果段落中没有答案，就说\"我不知道\"。\n问题：",
        seed_zh: "答案：",
        best_last: true,
        frame_in_prompt: true,
        evidence: "",
        evidence_zh: "",
        evidence_max_chars: MAX_EVIDENCE_CHARS,
    },
    Layout {
        name: "v1",
        question_first: false,
        preamble: "",
        instruction: QUESTION_INSTRUCTION,
        seed: "",
        instruction_zh: QUESTION_INSTRUCTION,
        seed_zh: "",
        best_last: false,
        frame_in_prompt: false,
        evidence: "",
        evidence_zh: "",
        evidence_max_chars: MAX_EVIDENCE_CHARS,
    },
];

/// The default layout (see [`LAYOUTS`]).
const GROUNDED: Layout = Layout {
    name: "grounded",
    question_first: false,
    preamble: "",
    instruction: QUESTION_INSTRUCTION,
    seed: "Answer:",
    instruction_zh: QUESTION_INSTRUCTION,
    seed_zh: "Answer:",
    best_last: true,
    frame_in_prompt: true,
    evidence: EVIDENCE,
    evidence_zh: EVIDENCE_ZH,
    evidence_max_chars: MAX_EVIDENCE_CHARS,
};

/// `grounded-short`'s instruction: [`QUESTION_INSTRUCTION`] in 16 tokens rather than 27.
pub const SHORT_INSTRUCTION: &str =
    "Answer in at most 5 words. Do not repeat the question.\nQuestion: ";

/// `grounded-first`'s instruction, before the passages: [`QUESTION_INSTRUCTION`]'s words
/// without its "Question: ", which stays after the passages.
pub const FIRST_INSTRUCTION: &str = concat!(short_answer_instruction!(), "\n\n");

/// Longest evidence, in characters: a longer sentence is cut into its clauses first, and a
/// clause longer than this is cut at the limit.
pub const MAX_EVIDENCE_CHARS: usize = 400;

/// `grounded-clause`'s and `grounded-short`'s longest evidence: about 25 tokens of English.
pub const SHORT_EVIDENCE_CHARS: usize = 100;

/// What the evidence sentence is introduced by.
pub const EVIDENCE: &str = "Most relevant sentence: ";
pub const EVIDENCE_ZH: &str = "最相关的句子：";

/// The layout answers are asked with.
pub const DEFAULT_LAYOUT: Layout = LAYOUTS[0];

impl Layout {
    /// The layout called `name`.
    pub fn named(name: &str) -> Option<Layout> {
        LAYOUTS.iter().copied().find(|l| l.name == name)
    }
}

/// Whether `text` is mostly Chinese: Han characters make up at least a quarter of its letters.
pub fn is_chinese(text: &str) -> bool {
    han_share(text) >= 0.25
}

/// Han characters as a share of the letters and digits of `text` (0 when it has none).
pub fn han_share(text: &str) -> f64 {
    let (mut han, mut letters) = (0usize, 0usize);
    for c in text.chars().filter(|c| c.is_alphanumeric()) {
        letters += 1;
        if is_han(c) {
            han += 1;
        }
    }
    han as f64 / letters.max(1) as f64
}

/// Builds the fused prompt: `template` applied to a system message and a user message made of
/// the question (when the layout says so), "Passages:", the chunks of `passages` (retrieved, in
/// rank order; tokenized as at ingestion, [`chunk_tokens`], so their stored KV is found), the
/// evidence sentence `evidence` (chosen by the caller: `engram-rag` chooses it; shown when the
/// layout has a label for it), the instruction and the question, with the generation prompt and
/// the layout's seed. Without a template, a plain "Passages: ... Answer:" layout is used.
pub fn build_prompt<P: AsRef<str>>(
    layout: Layout,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    system: &str,
    passages: &[P],
    question: &str,
    evidence: Option<&str>,
) -> engram_tokenizer::Result<FusedPrompt> {
    let mut chunks = passages
        .iter()
        .map(|p| chunk_tokens(tokenizer, p.as_ref()))
        .collect::<engram_tokenizer::Result<Vec<_>>>()?;
    if layout.best_last {
        chunks.reverse();
    }
    let question = question.trim();
    let zh = is_chinese(question);
    let (instruction, seed, label) = if zh {
        (layout.instruction_zh, layout.seed_zh, layout.evidence_zh)
    } else {
        (layout.instruction, layout.seed, layout.evidence)
    };
    // Shown only where the layout has a label for it.
    let evidence = evidence.filter(|_| !label.is_empty());
    // Where the sentence lies in `after`, in bytes (it opens the suffix, after its label).
    let (evidence, shown, evidence_text) = match evidence.map(str::trim) {
        Some(e) if !e.is_empty() => (
            format!("{label}{e}\n\n"),
            label.len()..label.len() + e.len(),
            e.to_owned(),
        ),
        _ => (String::new(), 0..0, String::new()),
    };
    let before = match (layout.question_first, zh) {
        (false, _) => String::new(),
        (true, false) => format!("Question: {question}\n\n"),
        (true, true) => format!("问题：{question}\n\n"),
    };
    let preamble = layout.preamble;
    let user = format!("{preamble}{before}Passages:\n{MARKER}{evidence}{instruction}{question}");
    let rendered = match template {
        Some(t) => {
            let mut r = t.render(
                &[Message::new("system", system), Message::new("user", user)],
                true,
            )?;
            r.push_str(seed);
            r
        }
        None => format!("{system}\n\n{user}\nAnswer:"),
    };
    let (before, after) = rendered
        .split_once(MARKER)
        .unwrap_or((rendered.as_str(), ""));
    let mut prefix = tokenizer.encode_prompt(before)?;
    if layout.frame_in_prompt {
        extend_with_frame_context(tokenizer, &mut prefix)?;
    }
    let (suffix, ends) = tokenizer.encode_with_ends(after, true)?;
    let evidence = byte_span_tokens(ends.as_deref(), shown);
    Ok(FusedPrompt {
        prefix,
        chunks,
        suffix,
        evidence,
        evidence_text,
    })
}

/// The tokens whose bytes overlap `bytes` of a text, given where each of its tokens ends
/// ([`Tokenizer::encode_with_ends`]); empty when the ends are unknown.
fn byte_span_tokens(
    ends: Option<&[usize]>,
    bytes: std::ops::Range<usize>,
) -> std::ops::Range<usize> {
    let Some(ends) = ends.filter(|_| !bytes.is_empty()) else {
        return 0..0;
    };
    // Token i spans ends[i - 1]..ends[i]: it overlaps when it ends past the start and starts
    // before the end. A token of no bytes (SentencePiece's prefixed space) overlaps nothing.
    let first = ends.partition_point(|&e| e <= bytes.start);
    let end = ends.partition_point(|&e| e < bytes.end) + 1;
    let end = end.min(ends.len());
    if first >= end {
        return 0..0;
    }
    first..end
}

/// Whether `c` is a Han character (CJK unified ideographs, their extensions and compatibility
/// forms).
pub fn is_han(c: char) -> bool {
    matches!(c as u32, 0x3400..=0x4DBF | 0x4E00..=0x9FFF | 0xF900..=0xFAFF | 0x20000..=0x2FA1F)
}
