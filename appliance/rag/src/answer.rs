//! What comes back from the model as an answer: where generation stops, and the text cleaned of
//! what a small model tends to put before the answer (a label, the question again).

use engram_model::StopMatcher;

use engram_fusion::is_chinese;

use crate::text::{is_english, FUNCTION_CHARS, STOP_WORDS};

/// Stop strings of a RAG answer: a blank line (the answer is one paragraph), or the model
/// starting another question or passage.
pub const ANSWER_STOPS: [&str; 4] = ["\n\n", "\nQuestion:", "\nPassages:", "\n问题："];

/// Cosine similarity (all-MiniLM-L6-v2) the best retrieved chunk must reach for an English
/// question to be answered from the chunks: below it nothing retrieved is about the question,
/// and a small model given unrelated passages invents an answer. Calibrated with `engram eval
/// qa --off-topic` (docs/bench/2026-11-26-qa.md): over 400 XQuAD-en questions against their
/// paragraphs and 400 SciFact claims against the same paragraphs, 0.3 refuses 2.8 % of the
/// answerable questions and 74 % of the off-topic ones (0.2: 0.5 % and 22 %; 0.35: 5.5 % and
/// 88 %).
pub const DENSE_FLOOR: f32 = 0.3;

/// Share of a Chinese question's character pairs the best retrieved chunk must contain for the
/// question to be answered from the chunks (see [`question_coverage`]); the English embedder
/// cannot judge Chinese, so this lexical floor stands in for [`DENSE_FLOOR`]. Calibrated with
/// `engram eval qa --off-topic` on XQuAD-zh and CMRC2018, each set's questions against its own
/// collection and the other set's as off-topic questions (docs/bench/2026-11-29-zh-floor.md).
pub const COVERAGE_FLOOR: f64 = 0.2;

/// Whether chunks are worth answering from. A question written mostly in ASCII letters is
/// judged by the best chunk's cosine similarity to it (`best_dense`) or, below
/// [`DENSE_FLOOR`], by the share of its content words one of `passages` repeats
/// ([`TERM_COVERAGE_FLOOR`]); a Chinese one by the largest share of its character pairs found
/// in one of `passages` ([`COVERAGE_FLOOR`]). Any other question, and an English one that was
/// not embedded, is answered. An English question refused here gets a second look at the
/// sentence level ([`sentences_to_embed`], [`relevant_sentence`]), which needs the embedder.
pub fn relevant<'a>(
    question: &str,
    best_dense: Option<f32>,
    passages: impl IntoIterator<Item = &'a str>,
) -> bool {
    if is_english(question) {
        best_dense.is_none_or(|d| d >= DENSE_FLOOR)
            || best_term_coverage(question, passages) >= TERM_COVERAGE_FLOOR
    } else if is_chinese(question) {
        best_coverage(question, passages) >= COVERAGE_FLOOR
    } else {
        true
    }
}

/// Cosine similarity (all-MiniLM-L6-v2) between an English question [`relevant`] refused and
/// one sentence of the retrieved chunks ([`sentences_to_embed`]) at which the question is
/// answered after all. A chunk of several topics embeds far from a question about one of its
/// sentences, and the question need not repeat the sentence's words: "Who do I call if I lose
/// my badge?" against the handbook's "A lost badge or laptop is reported to the IT helpdesk
/// ..." (cosine 0.49; its chunk's is under [`DENSE_FLOOR`], and "lose my badge" shares no pair
/// of content words with "lost badge"). Calibrated with `engram eval qa --off-topic`
/// (docs/bench/2026-12-03-lead-and-sentence.md): over 400 XQuAD-en questions and 400 SciFact
/// claims against the same paragraphs, 0.45 lets 1 more claim through (68.2 % refused instead
/// of 68.5 %) and refuses 2 answerable questions instead of 4 (0.4: 6 more claims and 1
/// question; 0.5: no claim and 3 questions); against MuSiQue's 150 questions, 2 more of them
/// are answered (44.7 % refused instead of 46.0 %; 0.4: 12 more).
pub const SENTENCE_FLOOR: f32 = 0.45;

/// Most sentences [`sentences_to_embed`] gives, the best-ranked chunks' first: it bounds the
/// embedder's work for a question about to be refused (about 10 ms a sentence on 2 cores).
pub const MAX_CHECKED_SENTENCES: usize = 48;

/// The sentences of `passages` (best-ranked first, at most [`MAX_CHECKED_SENTENCES`]) an
/// English question that [`relevant`] refused is judged by a second time: answered when one of
/// them reaches [`SENTENCE_FLOOR`] ([`relevant_sentence`]). Empty for a question in another
/// language, which the embedder cannot judge.
pub fn sentences_to_embed<'a>(
    question: &str,
    passages: impl IntoIterator<Item = &'a str>,
) -> Vec<&'a str> {
    if !is_english(question) {
        return Vec::new();
    }
    passages
        .into_iter()
        .flat_map(crate::text::sentences)
        .take(MAX_CHECKED_SENTENCES)
        .collect()
}

/// Whether the best cosine similarity between a question and one of its
/// [`sentences_to_embed`] reaches [`SENTENCE_FLOOR`].
pub fn relevant_sentence(best: Option<f32>) -> bool {
    best.is_some_and(|b| b >= SENTENCE_FLOOR)
}

/// Share of an English question's pairs of neighbouring content words (see
/// [`best_term_coverage`]) one retrieved chunk must repeat for the question to be answered even
/// though no chunk's cosine similarity reaches [`DENSE_FLOOR`]. A chunk that covers several
/// topics (a handbook's section on expenses and travel, 200 tokens) embeds far from a question
/// about one sentence of it ("Which class is train travel booked in?": cosine 0.16) while it
/// repeats the question's terms word for word. Calibrated with `engram eval qa --off-topic`
/// (docs/bench/2026-11-29-term-floor.md): no SciFact claim (400) or MuSiQue question (150) the
/// cosine refuses reaches 0.25 against the XQuAD-en paragraphs, so the off-topic questions
/// refused stay at 68.5 % and 46 % with the floor at 0.25; of 22 questions about the sample
/// handbook, 0 are refused instead of 5. It was 0.3 until a question of four pairs that
/// repeated one ("For trips longer than how many kilometres are flights allowed?") was refused
/// (docs/bench/2026-11-29-evidence.md).
pub const TERM_COVERAGE_FLOOR: f64 = 0.25;

/// The largest share, over `passages`, of `question`'s pairs of neighbouring content words
/// (lower-cased words, [`STOP_WORDS`] skipped, so "train travel booked" gives "train travel"
/// and "travel booked") that a passage also has as neighbouring content words; 0 when the
/// question has fewer than two content words (one word alone says too little about a topic).
pub fn best_term_coverage<'a>(question: &str, passages: impl IntoIterator<Item = &'a str>) -> f64 {
    best_share(&content_pairs(question), passages, content_pairs)
}

/// The largest share of `wanted` found in one of `passages`, each made into pairs by `have`
/// (0 when `wanted` or `passages` is empty).
fn best_share<'a>(
    wanted: &std::collections::HashSet<(String, String)>,
    passages: impl IntoIterator<Item = &'a str>,
    have: impl Fn(&str) -> std::collections::HashSet<(String, String)>,
) -> f64 {
    if wanted.is_empty() {
        return 0.0;
    }
    passages
        .into_iter()
        .map(|p| {
            let have = have(p);
            wanted.iter().filter(|w| have.contains(*w)).count() as f64 / wanted.len() as f64
        })
        .fold(0.0, f64::max)
}

/// The distinct pairs of neighbouring content words of `text`.
fn content_pairs(text: &str) -> std::collections::HashSet<(String, String)> {
    let mut words = units(text);
    words.retain(|u| !STOP_WORDS.contains(&u.as_str()));
    words
        .windows(2)
        .map(|w| (w[0].clone(), w[1].clone()))
        .collect()
}

/// The largest [`question_coverage`] of `question` over `passages` (0 when there are none).
pub fn best_coverage<'a>(question: &str, passages: impl IntoIterator<Item = &'a str>) -> f64 {
    let asked = units(question);
    // A question of one unit is looked for as that unit.
    let single = asked.len() == 1;
    let wanted = match asked.as_slice() {
        [only] => [(only.clone(), String::new())].into(),
        _ => pairs(&asked),
    };
    best_share(&wanted, passages, |p| {
        let found = units(p);
        if single {
            found.into_iter().map(|u| (u, String::new())).collect()
        } else {
            pairs(&found)
        }
    })
}

/// The share of `question`'s pairs of neighbouring units (Han characters or words, see
/// `dedup`'s units) that `passage` also has, pairs of two [`FUNCTION_CHARS`] left out: how
/// much of the question's wording a passage about it repeats. A question written from a
/// passage shares about half of its pairs with it; one about something else, a tenth to a
/// fifth with the closest passage of a collection.
pub fn question_coverage(question: &str, passage: &str) -> f64 {
    best_coverage(question, [passage])
}

/// The units of `text` (see `dedup`'s `for_each_unit`).
fn units(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    crate::text::for_each_unit(text, |u| out.push(u.to_owned()));
    out
}

/// Whether `text` ends in a letter or digit of a word (not a Han character): streamed, that
/// word may still grow.
fn ends_in_word(text: &str) -> bool {
    text.chars()
        .next_back()
        .is_some_and(|c| c.is_alphanumeric() && !crate::text::is_han(c))
}

/// The distinct pairs of neighbouring `units`, without pairs of two [`FUNCTION_CHARS`].
fn pairs(units: &[String]) -> std::collections::HashSet<(String, String)> {
    let function = |u: &str| u.chars().count() == 1 && FUNCTION_CHARS.contains(u);
    units
        .windows(2)
        .filter(|w| !(function(&w[0]) && function(&w[1])))
        .map(|w| (w[0].clone(), w[1].clone()))
        .collect()
}

/// The answer given when no retrieved passage is relevant enough to answer from.
pub fn no_answer(question: &str) -> &'static str {
    if is_chinese(question) {
        "我不知道：知识库中没有与这个问题相关的内容。"
    } else {
        "I don't know: nothing in the knowledge base is relevant to this question."
    }
}

/// The answer given when the model wrote none: only what [`OutputText`] takes off (the
/// question repeated, a label) before it ended. The default model does that often in Chinese
/// (CMRC2018: 23 answers in 100 came out empty). Made to go on instead (the end of generation
/// held back), it wrote "Explanation:" or "The answer is within 5 words" in 10 of those 12
/// cases (docs/bench/2026-11-28-qa-zh.md): saying so is the honest answer.
pub fn not_answered(question: &str) -> &'static str {
    if is_chinese(question) {
        "我不知道：找到的段落没有回答这个问题。"
    } else {
        "I don't know: the passages found do not answer this question."
    }
}

/// Words that ask: an answer of the question's own words that holds one is the question asked
/// back, not an answer (see `AnswerStart::echo`). English ones are whole words, Chinese ones
/// are found anywhere in the answer.
const QUESTION_WORDS: [&str; 20] = [
    "who", "whom", "whose", "what", "when", "where", "which", "why", "how", "什么", "哪", "谁",
    "几", "多少", "怎么", "怎样", "如何", "为何", "吗", "呢",
];

/// Labels a model may start its answer with (compared folded: case, spaces and punctuation
/// aside).
const LABELS: [&str; 10] = [
    "answer:",
    "most relevant sentence:",
    "最相关的句子：",
    "a:",
    "the answer is:",
    "the answer to the question is:",
    "答案：",
    "回答：",
    "question:",
    "问题：",
];

/// Lower case, letters and digits only: what two texts are compared by when deciding whether
/// one repeats the other or starts with a label.
fn folded(s: &str) -> String {
    s.chars()
        .filter(|c| c.is_alphanumeric())
        .flat_map(char::to_lowercase)
        .collect()
}

/// `answer` from where its answer starts: without leading labels ("Answer:") and the question
/// repeated (with or without a "Question:" label); trailing text as it is.
fn strip_lead<'a>(answer: &'a str, folded_question: &str) -> &'a str {
    let mut rest = answer.trim_start();
    loop {
        let before = rest.len();
        for l in LABELS {
            if let Some(end) = folded_prefix(rest, &folded(l)) {
                // A label is only a label when its colon follows.
                let tail = rest[end..].trim_start();
                if let Some(t) = tail.strip_prefix([':', '：']) {
                    rest = t.trim_start();
                }
            }
        }
        if !folded_question.is_empty() {
            if let Some(end) = folded_prefix(rest, folded_question) {
                rest = rest[end..].trim_start_matches(|c: char| {
                    c.is_whitespace() || matches!(c, '?' | '？' | ':' | '：' | '.' | '。')
                });
            }
        }
        if rest.len() == before {
            return rest;
        }
    }
}

/// When `text` starts with `folded` (compared folded), the byte length of that start.
fn folded_prefix(text: &str, folded: &str) -> Option<usize> {
    let mut seen = String::new();
    for (i, c) in text.char_indices() {
        if c.is_alphanumeric() {
            seen.extend(c.to_lowercase());
            if !folded.starts_with(&seen) {
                return None;
            }
            if seen.len() == folded.len() {
                return Some(i + c.len_utf8());
            }
        }
    }
    None
}

/// Bytes of an answer's start in which its first number is checked against the evidence
/// sentence ([`OutputText::or_sentence`]): about four English words or eight Chinese characters,
/// so "within 30 days" and "从上午10点" are checked as "30 days" and "10点" are.
const NUMBER_WINDOW: usize = 24;

/// How an answer's text starts, for the check of its first number against the evidence
/// sentence ([`OutputText::or_sentence`]).
#[derive(Debug, PartialEq)]
enum Lead {
    /// No ASCII digit starts a number in its first [`NUMBER_WINDOW`] bytes.
    Words,
    /// Its first number reaches the end of the text, so may still grow ("1", "10:", "1,5"), as
    /// [`first_run`] writes it.
    Open(String),
    /// Its first number, written out: its first run of digits ("10" of "10:00", "1500" of
    /// "1,500 euros").
    Number(String),
}

/// How `text` starts: its first number, when one starts in its first [`NUMBER_WINDOW`] bytes.
fn early_number(text: &str) -> Lead {
    let b = text.trim_start().as_bytes();
    let Some(start) = b.iter().take(NUMBER_WINDOW).position(u8::is_ascii_digit) else {
        return Lead::Words;
    };
    let b = &b[start..];
    let end = number_end(b);
    let run = first_run(&b[..end]);
    if end == b.len() || (end + 1 == b.len() && b",.:".contains(&b[end])) {
        Lead::Open(run)
    } else {
        Lead::Number(run)
    }
}

/// Where the number `b` starts with ends: digits, and separators between digits.
fn number_end(b: &[u8]) -> usize {
    let mut end = 0;
    while end < b.len() {
        let joins = b",.:".contains(&b[end]) && b.get(end + 1).is_some_and(u8::is_ascii_digit);
        if !(b[end].is_ascii_digit() || joins) {
            break;
        }
        end += 1;
    }
    end
}

/// Whether `text` starts with the word "yes" or "no" (any case); `None` while it is the start of
/// one of them and, without `whole`, may still become it or a longer word ("Nor...").
fn polar_start(text: &str, whole: bool) -> Option<bool> {
    let t = text.trim_start();
    let word: String = t
        .chars()
        .take_while(|c| c.is_alphabetic())
        .flat_map(char::to_lowercase)
        .collect();
    let growing = !whole && word.len() == t.len();
    if growing && !word.is_empty() && ["yes", "no"].iter().any(|w| w.starts_with(&word)) {
        return None;
    }
    Some(word == "yes" || word == "no")
}

/// The first run of digits of a number as written, thousands' commas left out ("1,500" is
/// "1500"; "10:00" and "3.5" are "10" and "3"): what two numbers are compared by.
fn first_run(number: &[u8]) -> String {
    number
        .iter()
        .filter(|b| **b != b',')
        .take_while(|b| b.is_ascii_digit())
        .map(|b| char::from(*b))
        .collect()
}

/// English and Chinese words for small numbers, and their digits. A Chinese one counts wherever
/// it stands ("每一项" states 1), so the check errs on the side of the model's answer.
const NUMBER_WORDS: [(&str, &str); 25] = [
    ("zero", "0"),
    ("one", "1"),
    ("two", "2"),
    ("three", "3"),
    ("four", "4"),
    ("five", "5"),
    ("six", "6"),
    ("seven", "7"),
    ("eight", "8"),
    ("nine", "9"),
    ("ten", "10"),
    ("eleven", "11"),
    ("twelve", "12"),
    ("零", "0"),
    ("一", "1"),
    ("两", "2"),
    ("二", "2"),
    ("三", "3"),
    ("四", "4"),
    ("五", "5"),
    ("六", "6"),
    ("七", "7"),
    ("八", "8"),
    ("九", "9"),
    ("十", "10"),
];

/// The numbers `sentence` states, as [`first_run`] writes them: those in digits, and the small
/// ones in words ("three days", "两周"; see [`NUMBER_WORDS`]).
fn stated_numbers(sentence: &str) -> std::collections::HashSet<String> {
    let b = sentence.as_bytes();
    let mut found = std::collections::HashSet::new();
    let mut i = 0;
    while i < b.len() {
        let starts = b[i].is_ascii_digit() && (i == 0 || !b[i - 1].is_ascii_digit());
        if starts {
            let end = i + number_end(&b[i..]);
            found.insert(first_run(&b[i..end]));
            i = end;
        } else {
            i += 1;
        }
    }
    let lower = sentence.to_lowercase();
    let words: std::collections::HashSet<&str> = lower
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .collect();
    for (word, digits) in NUMBER_WORDS {
        let said = if word.is_ascii() {
            words.contains(word)
        } else {
            sentence.contains(word)
        };
        if said {
            found.insert(digits.to_owned());
        }
    }
    found
}

/// A kind of value a question asks for, which its answer must hold when the evidence sentence
/// holds one ([`AnswerStart::unsupported`]): "What is the helpdesk's email address?" answered
/// "IT Helpdesk", or "笔记本电脑丢了要多久内报告？" answered "4357", is not an answer to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wanted {
    /// An email address: an "@" between letters or digits.
    Email,
    /// A length of time: a number and a unit of time ("one hour", "两周").
    Duration,
    /// A date: a month and a day or year ("31 March", "January 27, 1967", "3 月 31 日",
    /// "2024-03-31").
    Date,
    /// A number, in digits or in words ("25", "three", "二").
    Quantity,
}

/// English phrases that ask for a number. "When" is not one: an event answers it as often as a
/// date does ("after the war", "进入战国时代后").
const QUANTITY_PHRASES: [&str; 30] = [
    "how many",
    "how much",
    "how long",
    "how old",
    "how far",
    "how often",
    "how soon",
    "how early",
    "how late",
    "how big",
    "how large",
    "how high",
    "how tall",
    "how fast",
    "how deep",
    "how wide",
    "how heavy",
    "what percentage",
    "what percent",
    "what proportion",
    "what amount",
    "what number",
    "what year",
    "which year",
    "what time",
    "what age",
    "what date",
    "what decade",
    "what century",
    "how frequently",
];

/// Chinese words that ask for a number ("几" also, unless it is "几乎", almost).
const QUANTITY_WORDS_ZH: [&str; 9] = [
    "多少",
    "多久",
    "多长",
    "多大",
    "多远",
    "多高",
    "多重",
    "哪一年",
    "哪年",
];

/// Words for numbers that [`NUMBER_WORDS`] does not list, and month names ("may" aside, a verb
/// far more often): an answer with one of them holds a number for [`Wanted::Quantity`] (erring
/// on the side of the model's answer).
const MORE_NUMBER_WORDS: [&str; 43] = [
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
    "thirty",
    "forty",
    "fifty",
    "sixty",
    "seventy",
    "eighty",
    "ninety",
    "hundred",
    "thousand",
    "million",
    "billion",
    "trillion",
    "half",
    "dozen",
    "once",
    "twice",
    "first",
    "second",
    "third",
    "january",
    "february",
    "march",
    "april",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
    "daily",
    "weekly",
    "monthly",
    "yearly",
    "annually",
];

/// Chinese characters that write numbers (and "半", half).
const NUMBER_CHARS_ZH: &str = "〇零一二两三四五六七八九十百千万亿半";

/// English units of time, as a word starts ("hour" of "hours"), and Chinese ones.
const TIME_UNITS: [&str; 10] = [
    "second",
    "minute",
    "hour",
    "day",
    "week",
    "fortnight",
    "month",
    "year",
    "decade",
    "centur",
];
const TIME_UNITS_ZH: [&str; 11] = [
    "秒", "分钟", "小时", "钟头", "天", "日", "周", "星期", "礼拜", "月", "年",
];

/// The kinds of value `question` asks for, in the order they are checked: "until what date" a
/// date, or else a number; "how long", "how often" and "多久" a length of time, or else a
/// number ("How long is the Rhine?").
pub(crate) fn wanted(question: &str) -> Vec<Wanted> {
    let lower = question.to_lowercase();
    let mut kinds = Vec::new();
    if [
        "email",
        "e-mail",
        "mail address",
        "邮箱",
        "电子邮件",
        "邮件地址",
    ]
    .iter()
    .any(|w| lower.contains(w))
    {
        kinds.push(Wanted::Email);
    }
    if DATE_PHRASES.iter().any(|p| contains_words(&lower, p))
        || DATE_WORDS_ZH.iter().any(|w| lower.contains(w))
    {
        kinds.push(Wanted::Date);
    }
    if ["how long", "how often", "how frequently"]
        .iter()
        .any(|p| contains_words(&lower, p))
        || ["多久", "多长时间"].iter().any(|w| lower.contains(w))
    {
        kinds.push(Wanted::Duration);
    }
    let zh_few = lower
        .match_indices('几')
        .any(|(i, _)| !lower[i..].starts_with("几乎"));
    if QUANTITY_PHRASES.iter().any(|p| contains_words(&lower, p))
        || QUANTITY_WORDS_ZH.iter().any(|w| lower.contains(w))
        || zh_few
    {
        kinds.push(Wanted::Quantity);
    }
    kinds
}

/// English phrases that ask for a date ("what date" also asks for a number, should the evidence
/// sentence hold no date).
const DATE_PHRASES: [&str; 5] = [
    "what date",
    "which date",
    "until when",
    "by when",
    "what day of the month",
];

/// Chinese words that ask for a date.
const DATE_WORDS_ZH: [&str; 6] = ["哪天", "哪一天", "什么日期", "几月几日", "几月几号", "几号"];

/// English month names, "may" aside (a verb far more often).
const MONTHS: [&str; 11] = [
    "january",
    "february",
    "march",
    "april",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
];

/// Whether `text` names a date: a month's name next to a number, a Chinese month or day in
/// digits or numerals ("3 月", "三十一日", "5号"), or a date in digits ("2024-03-31", "31/3/2024").
fn holds_date(text: &str) -> bool {
    let lower = text.to_lowercase();
    let words: Vec<&str> = lower
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .collect();
    let month_by_number = words.iter().enumerate().any(|(i, w)| {
        MONTHS.contains(w)
            && [i.checked_sub(1), Some(i + 1)]
                .into_iter()
                .flatten()
                .filter_map(|j| words.get(j))
                .any(|n| n.chars().next().is_some_and(|c| c.is_ascii_digit()))
    });
    let zh = ["月", "日", "号"].iter().any(|mark| {
        text.match_indices(mark).any(|(i, _)| {
            text[..i]
                .trim_end()
                .chars()
                .next_back()
                .is_some_and(|c| c.is_ascii_digit() || NUMBER_CHARS_ZH.contains(c))
        })
    });
    let b = text.as_bytes();
    let digits = (0..b.len()).any(|i| {
        let run = |at: usize| {
            b[at.min(b.len())..]
                .iter()
                .take_while(|c| c.is_ascii_digit())
                .count()
        };
        let first = run(i);
        let starts = i == 0 || !b[i - 1].is_ascii_digit();
        if !starts || first == 0 || first > 4 {
            return false;
        }
        let sep = i + first;
        let Some(&s) = b.get(sep).filter(|c| b"-/.".contains(c)) else {
            return false;
        };
        let second = run(sep + 1);
        (1..=2).contains(&second)
            && b.get(sep + 1 + second) == Some(&s)
            && (1..=4).contains(&run(sep + 2 + second))
    });
    month_by_number || zh || digits
}

/// Whether `lower` has `phrase` between word boundaries.
fn contains_words(lower: &str, phrase: &str) -> bool {
    lower.match_indices(phrase).any(|(i, _)| {
        let before = lower[..i].chars().next_back();
        let after = lower[i + phrase.len()..].chars().next();
        !before.is_some_and(char::is_alphanumeric) && !after.is_some_and(char::is_alphanumeric)
    })
}

/// Whether `text` holds a value of `kind`.
pub(crate) fn holds(kind: Wanted, text: &str) -> bool {
    match kind {
        Wanted::Email => text.match_indices('@').any(|(i, _)| {
            text[..i]
                .chars()
                .next_back()
                .is_some_and(char::is_alphanumeric)
                && text[i + 1..]
                    .chars()
                    .next()
                    .is_some_and(char::is_alphanumeric)
        }),
        Wanted::Date => holds_date(text),
        Wanted::Duration => {
            let lower = text.to_lowercase();
            let unit = lower
                .split(|c: char| !c.is_alphanumeric())
                .any(|w| TIME_UNITS.iter().any(|u| w.starts_with(u)))
                || TIME_UNITS_ZH.iter().any(|u| text.contains(u));
            unit && holds(Wanted::Quantity, text)
        }
        Wanted::Quantity => {
            let lower = text.to_lowercase();
            text.chars()
                .any(|c| c.is_ascii_digit() || NUMBER_CHARS_ZH.contains(c))
                || lower.split(|c: char| !c.is_alphanumeric()).any(|w| {
                    NUMBER_WORDS.iter().any(|(n, _)| *n == w) || MORE_NUMBER_WORDS.contains(&w)
                })
        }
    }
}

/// What a "how many" question counts: its first two words after "how many" or "how much"
/// that are not [`STOP_WORDS`], stemmed ("How many of my last passwords ..." counts "last"
/// and "passwords"), and the Han character after "多少" or "几" ("多少欧元" counts "欧"); then,
/// for a question about money ([`asks_money`]) that does not ask for a length of time or a
/// date, the currencies. The number the evidence sentence gives one of them is the answer's
/// to state ([`counted_number`]).
fn counted_units(question: &str) -> Vec<String> {
    let lower = question.to_lowercase();
    let mut counted = Vec::new();
    for phrase in ["how many", "how much"] {
        for (at, _) in lower.match_indices(phrase) {
            let rest = &lower[at + phrase.len()..];
            if lower[..at].ends_with(char::is_alphanumeric)
                || rest.starts_with(char::is_alphanumeric)
            {
                continue;
            }
            counted.extend(
                rest.split(|c: char| !c.is_alphanumeric())
                    .filter(|w| !w.is_empty() && !STOP_WORDS.contains(w))
                    .take(2)
                    .map(crate::text::stem),
            );
        }
    }
    for asks in ["多少", "几"] {
        for (at, _) in question.match_indices(asks) {
            let next = question[at + asks.len()..].chars().next();
            // "几乎" is "almost"; a function character ("多少的") counts nothing, but "个", "年",
            // "月" and "日" are units.
            let unit = |c: char| {
                crate::text::is_han(c)
                    && c != '乎'
                    && (!FUNCTION_CHARS.contains(c) || "个年月日".contains(c))
            };
            if let Some(c) = next.filter(|&c| unit(c)) {
                counted.push(c.to_string());
            }
        }
    }
    // "报销要在购买后多久内提交？" is about money but asks for a length of time.
    let for_time = wanted(question)
        .iter()
        .any(|k| matches!(k, Wanted::Duration | Wanted::Date));
    if asks_money(&lower) && !for_time {
        counted.extend(CURRENCIES.iter().map(|c| crate::text::stem(c)));
        counted.extend(CURRENCY_SIGNS.iter().map(|c| c.to_string()));
        counted.extend(CURRENCIES_ZH.iter().map(|c| c.to_string()));
    }
    counted
}

/// Words that make a question one about money ("Above what amount is a receipt required?",
/// "多少钱以上的费用需要收据？"): the currencies then count as what it asks for
/// ([`counted_units`]), after its own words.
const MONEY_WORDS: [&str; 10] = [
    "amount",
    "cost",
    "costs",
    "price",
    "money",
    "pay",
    "paid",
    "spend",
    "spent",
    "reimbursed",
];
const MONEY_WORDS_ZH: [&str; 8] = ["钱", "金额", "费用", "价格", "价钱", "成本", "花费", "报销"];

/// Currencies in words (stemmed where used), as signs, and in Chinese (the character a number
/// comes right before: "25 欧元", "150 元", "3 美元").
const CURRENCIES: [&str; 8] = [
    "euros", "dollars", "pounds", "yuan", "yen", "francs", "rupees", "cents",
];
const CURRENCY_SIGNS: [char; 4] = ['$', '€', '£', '¥'];
const CURRENCIES_ZH: [char; 5] = ['欧', '美', '元', '镑', '块'];

/// Whether the lower-cased `question` asks about money ([`MONEY_WORDS`]).
fn asks_money(lower: &str) -> bool {
    MONEY_WORDS.iter().any(|w| contains_words(lower, w))
        || MONEY_WORDS_ZH.iter().any(|w| lower.contains(w))
}

/// The number `sentence` gives what a question counts ([`counted_units`], in order): the
/// number the first of them that follows a number in the sentence follows, within two words
/// ("the last five passwords" gives "passwords" 5, "1.7 million people" gives "people" 1), or
/// as a Han character, right after it ("25 欧元", "五次"); as [`first_run`] writes it. `None`
/// when none follows a number, or the first that does follows more than one: then which value
/// is asked for is not plain.
fn counted_number(sentence: &str, counted: &[String]) -> Option<String> {
    let words: Vec<&str> = sentence
        .split(|c: char| c.is_whitespace() || (c.is_ascii_punctuation() && !",.:".contains(c)))
        .map(|w| w.trim_matches(|c: char| !c.is_alphanumeric()))
        .filter(|w| !w.is_empty())
        .collect();
    let stems: Vec<String> = words
        .iter()
        .map(|w| crate::text::stem(&w.to_lowercase()))
        .collect();
    counted.iter().find_map(|unit| {
        let found = if unit.chars().all(crate::text::is_han) {
            numbers_before_han(sentence, unit)
        } else if let Some(sign) = unit.chars().next().filter(|c| CURRENCY_SIGNS.contains(c)) {
            numbers_by_sign(sentence, sign)
        } else {
            numbers_before_word(&words, &stems, unit)
        };
        let mut found = found.into_iter();
        match (found.next(), found.next()) {
            (None, _) => None,
            (Some(n), None) => Some(Some(n)),
            (Some(_), Some(_)) => Some(None),
        }
    })?
}

/// The numbers (digits, or small numbers in words) that `unit`, a stemmed word, follows within
/// two of `words` (whose stems are `stems`).
fn numbers_before_word(
    words: &[&str],
    stems: &[String],
    unit: &str,
) -> std::collections::HashSet<String> {
    let mut found = std::collections::HashSet::new();
    for (i, word) in words.iter().enumerate() {
        if !stems[i + 1..].iter().take(2).any(|s| s == unit) {
            continue;
        }
        let lower = word.to_lowercase();
        if word.starts_with(|c: char| c.is_ascii_digit()) {
            found.insert(first_run(word.as_bytes()));
        } else if let Some((_, digits)) = NUMBER_WORDS.iter().find(|(w, _)| *w == lower) {
            found.insert((*digits).to_owned());
        }
    }
    found
}

/// The numbers right after `sign` in `sentence`, or right before it ("$25", "€ 1,500", "25 €").
fn numbers_by_sign(sentence: &str, sign: char) -> std::collections::HashSet<String> {
    let mut found = std::collections::HashSet::new();
    for (at, _) in sentence.match_indices(sign) {
        let after = sentence[at + sign.len_utf8()..].trim_start().as_bytes();
        if after.first().is_some_and(u8::is_ascii_digit) {
            found.insert(first_run(&after[..number_end(after)]));
        } else if let Some(n) = number_ending(sentence[..at].trim_end()) {
            found.insert(n);
        }
    }
    found
}

/// The numbers right before `unit`, a Han character, in `sentence`: digits or one Chinese
/// numeral, with "万", "亿", "千" or "百" between them allowed ("3 万人" gives 人 3). A run of
/// numerals ("二十五") is not read.
fn numbers_before_han(sentence: &str, unit: &str) -> std::collections::HashSet<String> {
    let mut found = std::collections::HashSet::new();
    for (at, _) in sentence.match_indices(unit) {
        let before = sentence[..at]
            .trim_end()
            .trim_end_matches(['万', '亿', '千', '百']);
        let zh: String = before
            .chars()
            .rev()
            .take_while(|&c| NUMBER_CHARS_ZH.contains(c))
            .collect();
        if !zh.is_empty() {
            if let Some((_, digits)) = NUMBER_WORDS.iter().find(|(w, _)| *w == zh) {
                found.insert((*digits).to_owned());
            }
            continue;
        }
        if let Some(n) = number_ending(before) {
            found.insert(n);
        }
    }
    found
}

/// The number in digits `text` ends with, as [`first_run`] writes it ("... 1,500" is "1500").
fn number_ending(text: &str) -> Option<String> {
    let b = text.as_bytes();
    let start = b
        .iter()
        .rposition(|c| !(c.is_ascii_digit() || b",.:".contains(c)))
        .map_or(0, |p| p + 1);
    b.get(start)
        .is_some_and(u8::is_ascii_digit)
        .then(|| first_run(&b[start..]))
}

/// One in this many of an answer's own words (its first [`GROUNDING_WORDS`]) must be in the
/// retrieved passages for the answer to be the passages' ([`AnswerStart::grounded`]). An answer
/// with fewer came from the model, not from the passages: "The answer to this question is:" to
/// a Chinese question, "New Holland" where they say "Fort Caroline", "When core hours end is
/// not specified." (docs/bench/2026-12-05-grounding.md).
const GROUNDED_ONE_IN: usize = 2;

/// Own words of an answer (words its question does not have, see [`ground_units`]) that decide
/// whether it is grounded: its start is held back until it has that many, or is whole.
const GROUNDING_WORDS: usize = 4;

/// `text`'s units as an answer's words are looked up in the passages: words stemmed
/// ([`crate::text::stem`]: "replaced" is "replace"'s), small numbers in words as digits
/// ("five" and "五" are "5"), Han characters one by one; [`STOP_WORDS`] and
/// [`FUNCTION_CHARS`] left out. With `growing`, a word `text` ends in is left out too: it may
/// not be whole yet.
fn ground_units(text: &str, growing: bool) -> Vec<String> {
    let mut raw = units(text);
    if growing && ends_in_word(text) {
        raw.pop();
    }
    raw.into_iter()
        .filter(|u| {
            let function = u.chars().count() == 1 && FUNCTION_CHARS.contains(u.as_str());
            !(function || STOP_WORDS.contains(&u.as_str()))
        })
        .map(|u| match NUMBER_WORDS.iter().find(|(w, _)| *w == u) {
            Some((_, digits)) => (*digits).to_owned(),
            None if u.chars().any(crate::text::is_han) => u,
            None => crate::text::stem(&u),
        })
        .collect()
}

/// [`strip_lead`] for streamed text: holds the start of the answer back while it could still be
/// a label or the question repeated, then passes everything through.
#[derive(Debug)]
struct AnswerStart {
    question: String,
    /// The question's units (`dedup`'s words and Han characters): what a near echo is made of.
    units: std::collections::HashSet<String>,
    held: String,
    open: bool,
    /// What the answer is when nothing is left of it ([`not_answered`], or the evidence
    /// sentence: [`OutputText::or_sentence`]).
    none: String,
    /// Whether `none` is the evidence sentence, and whether the answer was it.
    sentence: bool,
    fell_back: bool,
    /// The numbers the evidence sentence and the question state ([`stated_numbers`]): an answer
    /// that repeats the question's number ("The Super Bowl 50 halftime show ...") is not
    /// unsupported for it.
    stated: std::collections::HashSet<String>,
    /// The numbers the question states.
    asked: std::collections::HashSet<String>,
    /// The kinds of value the question asks for ([`wanted`]), and the first of them the
    /// evidence sentence holds: an answer without such a value is not the passages'.
    asks: Vec<Wanted>,
    wanted: Option<Wanted>,
    /// What the question counts ([`counted_units`]), and the number the evidence sentence gives
    /// it ([`counted_number`]): an answer that does not state that number is not the passages'
    /// ("12" to "How many old passwords may not be reused?" where the sentence says "the last
    /// five passwords").
    counts: Vec<String>,
    counted: Option<String>,
    /// Whether the answer's start is checked against the evidence sentence
    /// ([`Self::unsupported`]): an answer that starts with a number it does not state, or with
    /// a bare yes or no, is not the passages' and the sentence takes its place.
    check: bool,
    /// Whether the answer was replaced for its start: generation ends there.
    replaced: bool,
    /// The rules on, and those that changed this answer.
    on: AnswerRules,
    fired: AnswerRules,
    /// The question's [`ground_units`], and those of the passages the answer is to come from
    /// (`None`: not given, no answer is judged by them; see [`Self::grounded`]).
    ground_question: std::collections::HashSet<String>,
    passages: Option<std::collections::HashSet<String>>,
}

impl AnswerStart {
    fn new(question: &str) -> AnswerStart {
        AnswerStart {
            question: folded(question),
            units: units(question).into_iter().collect(),
            held: String::new(),
            open: false,
            none: not_answered(question).to_owned(),
            sentence: false,
            fell_back: false,
            stated: std::collections::HashSet::new(),
            asked: stated_numbers(question),
            asks: wanted(question),
            wanted: None,
            counts: counted_units(question),
            counted: None,
            check: true,
            replaced: false,
            on: AnswerRules::all(),
            fired: AnswerRules::default(),
            ground_question: ground_units(question, false).into_iter().collect(),
            passages: None,
        }
    }

    /// Whether an answer that is `text` so far (all of it, with `whole`) comes from the
    /// passages: at least one in [`GROUNDED_ONE_IN`] of its first [`GROUNDING_WORDS`] own
    /// words (those the question does not have, [`ground_units`]) are in them. An answer
    /// without own words is not judged here (it may say that what the question asks is so).
    /// Decided as soon as no word still to come can change it: enough own words already
    /// found, or too many missed, however many of the [`GROUNDING_WORDS`] follow (a short
    /// answer's start goes out then, not when the answer ends); `None` until then.
    fn grounded(&self, text: &str, whole: bool) -> Option<bool> {
        let Some(passages) = &self.passages else {
            return Some(true);
        };
        let own: Vec<String> = ground_units(text, !whole)
            .into_iter()
            .filter(|u| !self.ground_question.contains(u))
            .take(GROUNDING_WORDS)
            .collect();
        let found = own.iter().filter(|u| passages.contains(*u)).count();
        let grounded = |found: usize, words: usize| found * GROUNDED_ONE_IN >= words;
        if whole || own.len() == GROUNDING_WORDS {
            return Some(grounded(found, own.len()));
        }
        // The answer ends with between `own.len()` and GROUNDING_WORDS own words, each still
        // to come found or not: the outcome is known when it is the same at both ends.
        let to_come = GROUNDING_WORDS - own.len();
        if grounded(found, GROUNDING_WORDS) {
            Some(true)
        } else if !grounded(found, own.len()) && !grounded(found + to_come, GROUNDING_WORDS) {
            Some(false)
        } else {
            None
        }
    }

    /// Whether an answer that is `text` so far (all of it, with `whole`) is not supported by the
    /// evidence sentence: it lacks the kind of value the question asks for and the sentence
    /// holds ([`Wanted`]: held back until the value comes, judged when the answer is whole), or
    /// the number the sentence gives what the question counts ([`counted_number`], likewise), or
    /// it starts with a number in its first [`NUMBER_WINDOW`] bytes that neither the sentence
    /// nor the question states, or with a bare "yes" or "no" (the default 135M model answers
    /// "No" to nearly every yes-or-no question, and the sentence is what such a question is
    /// answered by), or its own words are not the passages' ([`Self::grounded`]). `None` while
    /// that may still change.
    /// Returns the rule that finds it unsupported (`Some(None)`: none does).
    fn unsupported(&self, text: &str, whole: bool) -> Option<Option<AnswerRule>> {
        if !(self.sentence && self.check) {
            return Some(None);
        }
        let on = |r| self.on.contains(r);
        // The value the question asks for, which the sentence holds: until it comes the answer
        // is held back, and without it the whole answer is the sentence's to give.
        if on(AnswerRule::WantedValue) && self.wanted.is_some_and(|k| !holds(k, text)) {
            return whole.then_some(Some(AnswerRule::WantedValue));
        }
        // So is the number the sentence gives what the question counts.
        if on(AnswerRule::CountedNumber)
            && self
                .counted
                .as_ref()
                .is_some_and(|n| !stated_numbers(text).contains(n))
        {
            return whole.then_some(Some(AnswerRule::CountedNumber));
        }
        // An answer whose own words are not the passages' is the model's, not theirs.
        if on(AnswerRule::Ungrounded) && !self.grounded(text, whole)? {
            return Some(Some(AnswerRule::Ungrounded));
        }
        let stated = &self.stated;
        let number = on(AnswerRule::UnstatedNumber);
        let polar = |whole| {
            if on(AnswerRule::BarePolar) {
                polar_start(text, whole).map(|p| p.then_some(AnswerRule::BarePolar))
            } else {
                Some(None)
            }
        };
        let unstated = |u: bool| Some(u.then_some(AnswerRule::UnstatedNumber));
        match early_number(text) {
            // A number may still come, or a "yes" or "no" still grow.
            Lead::Words if number && !whole && text.trim_start().len() < NUMBER_WINDOW => {
                polar(whole).filter(Option::is_some)
            }
            Lead::Words => polar(whole),
            Lead::Open(_) | Lead::Number(_) if !number => Some(None),
            Lead::Open(_) if !whole => None,
            // Cut off by the token limit, it may have been becoming a number the sentence states.
            Lead::Open(n) => unstated(!stated.iter().any(|s| s.starts_with(&n))),
            Lead::Number(n) => unstated(!stated.contains(&n)),
        }
    }

    /// `text` from where its answer starts: labels and the question repeated taken off
    /// ([`strip_lead`]), and a near echo of the question before its question mark (the
    /// question asked back in other words, of its own words: "瑞尼尔山在美国哪个县？" for
    /// "瑞尼尔山在美国哪个县的境内？").
    fn cleaned<'a>(&self, text: &'a str) -> &'a str {
        if !self.on.contains(AnswerRule::Lead) {
            return text.trim_start();
        }
        let rest = strip_lead(text, &self.question);
        let Some(at) = rest.find(['?', '？']) else {
            return rest;
        };
        if !self.in_question(&rest[..at]) {
            return rest;
        }
        let mark = rest[at..].chars().next().map_or(1, char::len_utf8);
        strip_lead(&rest[at + mark..], &self.question)
    }

    /// Whether `text` has units and every one is the question's: while an answer is that, it
    /// may still turn out to be the question asked back.
    fn in_question(&self, text: &str) -> bool {
        self.in_question_so_far(text, false)
    }

    /// [`Self::in_question`], where with `partial` a word the text ends in may still be
    /// growing: it counts as the question's when one of the question's words starts with it
    /// ("3" of "32M").
    fn in_question_so_far(&self, text: &str, partial: bool) -> bool {
        let mut found = units(text);
        let growing = partial && ends_in_word(text);
        let last = if growing { found.pop() } else { None };
        let last_ok = last.is_none_or(|w| self.units.iter().any(|u| u.starts_with(&w)));
        (!found.is_empty() || growing) && last_ok && found.iter().all(|u| self.units.contains(u))
    }

    /// Whether a whole answer is the question asked back without its question mark: of the
    /// question's units only, at least four of them and half as many as the question has, and
    /// asking ([`QUESTION_WORDS`]: "硫醚通式是什么" for "硫醚的通式是什么？"). A short answer of
    /// the question's words ("Bush" to "Bush or Clinton?") is an answer, and so is one that
    /// states it ("The restored tapes were able to have color added to them." to "Were the
    /// restored tapes able to have color added to them?").
    fn echo(&self, answer: &str) -> bool {
        let found = units(answer);
        let n = found.len();
        let asks = found.iter().any(|u| QUESTION_WORDS.contains(&u.as_str()))
            || QUESTION_WORDS
                .iter()
                .any(|w| !w.is_ascii() && answer.contains(w));
        asks && self.in_question(answer) && n >= 4 && 2 * n >= self.units.len()
    }

    /// Adds a piece of the answer; returns what can go out now.
    fn push(&mut self, piece: &str) -> String {
        if self.open {
            return piece.to_owned();
        }
        self.held.push_str(piece);
        let rest = self.cleaned(&self.held);
        // Up to a stop string the answer is whole ("When core hours start.\n\nQuestion: ..."
        // is the question asked back): it is judged as `finish` judges one.
        let replace = match ANSWER_STOPS.iter().filter_map(|s| rest.find(s)).min() {
            Some(end) => self.no_answer(rest[..end].trim_end()),
            None => {
                let f = folded(rest);
                let undecided = f.is_empty()
                    || LABELS.iter().any(|l| folded(l).starts_with(&f))
                    || (!self.question.is_empty() && self.question.starts_with(&f))
                    || self.in_question_so_far(rest, true);
                if undecided {
                    return String::new();
                }
                let Some(unsupported) = self.unsupported(rest, false) else {
                    return String::new();
                };
                unsupported
            }
        };
        self.open = true;
        let out = if let Some(rule) = replace {
            self.fired.insert(rule);
            self.fell_back = self.sentence;
            self.replaced = true;
            self.none.clone()
        } else {
            if rest.len() < self.held.trim_start().len() {
                self.fired.insert(AnswerRule::Lead);
            }
            rest.to_owned()
        };
        self.held.clear();
        out
    }

    /// The end of the answer: what is still held, cleaned; [`not_answered`] when nothing has
    /// gone out and nothing is left, or only a label cut off (see [`cut_label`]).
    fn finish(&mut self) -> String {
        if self.open {
            return String::new();
        }
        self.open = true;
        let out = self.cleaned(&self.held).trim_end().to_owned();
        let stripped = out.len() < self.held.trim().len();
        self.held.clear();
        if let Some(rule) = self.no_answer(&out) {
            self.fired.insert(rule);
            self.fell_back = self.sentence;
            return self.none.clone();
        }
        if stripped {
            self.fired.insert(AnswerRule::Lead);
        }
        out
    }

    /// Whether a whole answer, cleaned, is none: empty, a label cut off ([`cut_label`]), the
    /// question asked back ([`Self::echo`]), or unsupported by the evidence sentence
    /// ([`Self::unsupported`]).
    /// Returns the rule that finds it none.
    fn no_answer(&self, answer: &str) -> Option<AnswerRule> {
        let f = folded(answer);
        let on = |r| self.on.contains(r);
        if f.is_empty() {
            on(AnswerRule::Empty).then_some(AnswerRule::Empty)
        } else if on(AnswerRule::CutLabel) && cut_label(&f) {
            Some(AnswerRule::CutLabel)
        } else if on(AnswerRule::Echo) && self.echo(answer) {
            Some(AnswerRule::Echo)
        } else {
            self.unsupported(answer, true).flatten()
        }
    }
}

/// Whether `folded_answer` is the start of a label and nothing else: at least half of a label
/// of four or more letters, cut off where generation stopped (the model repeated the evidence
/// label, "最相关的句子：最相关的", until the loop stop ended it). A short label's start ("a",
/// "ans") may be a real answer and is kept.
fn cut_label(folded_answer: &str) -> bool {
    let n = folded_answer.chars().count();
    LABELS.iter().map(|l| folded(l)).any(|l| {
        let len = l.chars().count();
        len >= 4 && 2 * n >= len && l.starts_with(folded_answer)
    })
}

/// Whether `answer` has fallen into repeating itself: it ends with the same piece (up to 64
/// bytes) three or more times in a row, 12 bytes or more in all ("1.1.1.1.1.1.", "the value of
/// the value of the value of "). A small model does not come back from that; generation stops.
fn repeating(answer: &str) -> bool {
    let text = answer.trim_end();
    let b = text.as_bytes();
    (1..=64.min(b.len() / 2)).any(|unit| {
        let tail = &b[b.len() - unit..];
        let mut count = 1;
        while (count + 1) * unit <= b.len()
            && &b[b.len() - (count + 1) * unit..b.len() - count * unit] == tail
        {
            count += 1;
        }
        // The first time, the piece may lack the space that separates the later ones.
        let before = &b[..b.len() - count * unit];
        let first = tail.trim_ascii_start();
        if count == 2 && first.len() < unit && before.ends_with(first) {
            count += 1;
        }
        count >= 3 && count * unit >= 12
    })
}

/// The rules that change a RAG answer's text on its way out ([`OutputText`]). Each has a name
/// (in `timings.answer_rules` when it changed an answer, in `/metrics` as
/// `engram_answer_rule_total{rule}`, and in `[answers] rules_off`, which turns it off), a
/// one-line doc ([`Self::doc`]) and the models it was written for ([`Self::models`]). The
/// evidence-sentence rules act only where the prompt showed a sentence and
/// [`OutputText::check_start`] is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AnswerRule {
    /// A label or the question repeated before the answer is taken off.
    Lead,
    /// An empty answer is the evidence sentence, or says the passages do not answer.
    Empty,
    /// A label cut off where generation stopped is no answer.
    CutLabel,
    /// The question asked back is no answer.
    Echo,
    /// An answer without the kind of value the question asks for (a date, an amount, a
    /// duration...) where the evidence sentence holds one is the sentence.
    WantedValue,
    /// An answer without the number the evidence sentence gives what the question counts is
    /// the sentence.
    CountedNumber,
    /// An answer most of whose own words no passage has is the sentence.
    Ungrounded,
    /// An answer starting with a number neither the sentence nor the question states is the
    /// sentence.
    UnstatedNumber,
    /// An answer starting with a bare "yes" or "no" is the sentence.
    BarePolar,
    /// An answer that starts repeating itself ends there.
    Repeating,
}

impl AnswerRule {
    /// Every rule, in the order an answer meets them.
    pub const ALL: [AnswerRule; 10] = [
        AnswerRule::Lead,
        AnswerRule::Empty,
        AnswerRule::CutLabel,
        AnswerRule::Echo,
        AnswerRule::WantedValue,
        AnswerRule::CountedNumber,
        AnswerRule::Ungrounded,
        AnswerRule::UnstatedNumber,
        AnswerRule::BarePolar,
        AnswerRule::Repeating,
    ];

    /// The rule's name in timings, metrics and the configuration.
    pub fn name(self) -> &'static str {
        match self {
            AnswerRule::Lead => "lead",
            AnswerRule::Empty => "empty",
            AnswerRule::CutLabel => "cut_label",
            AnswerRule::Echo => "echo",
            AnswerRule::WantedValue => "wanted_value",
            AnswerRule::CountedNumber => "counted_number",
            AnswerRule::Ungrounded => "ungrounded",
            AnswerRule::UnstatedNumber => "unstated_number",
            AnswerRule::BarePolar => "bare_polar",
            AnswerRule::Repeating => "repeating",
        }
    }

    /// The rule named `name`.
    pub fn parse(name: &str) -> Option<AnswerRule> {
        AnswerRule::ALL.into_iter().find(|r| r.name() == name)
    }

    /// What the rule does, in one line.
    pub fn doc(self) -> &'static str {
        match self {
            AnswerRule::Lead => "a label (\"Answer:\") or the question repeated before the answer is taken off",
            AnswerRule::Empty => "an empty answer is the evidence sentence, or says the passages do not answer",
            AnswerRule::CutLabel => "a label cut off where generation stopped is no answer",
            AnswerRule::Echo => "the question asked back is no answer",
            AnswerRule::WantedValue => "an answer without the kind of value asked for, which the evidence sentence holds, is the sentence",
            AnswerRule::CountedNumber => "an answer without the number the evidence sentence gives what is counted is the sentence",
            AnswerRule::Ungrounded => "an answer whose own words are mostly not the passages' is the evidence sentence",
            AnswerRule::UnstatedNumber => "an answer starting with a number neither the evidence sentence nor the question states is the sentence",
            AnswerRule::BarePolar => "an answer starting with a bare yes or no is the evidence sentence",
            AnswerRule::Repeating => "an answer that starts repeating itself ends there",
        }
    }

    /// The models the rule was written for: `any`, or the habit of a model it answers.
    pub fn models(self) -> &'static str {
        match self {
            AnswerRule::Lead
            | AnswerRule::Empty
            | AnswerRule::CutLabel
            | AnswerRule::Echo
            | AnswerRule::Repeating => "any (the shape of a generated answer, not its content)",
            AnswerRule::WantedValue
            | AnswerRule::CountedNumber
            | AnswerRule::Ungrounded
            | AnswerRule::UnstatedNumber => {
                "any model that can answer off its passages; written against SmolLM2-135M's"
            }
            AnswerRule::BarePolar => {
                "small models that answer yes or no by habit (SmolLM2-135M answers \"No\" to \
                 nearly every yes-or-no question); a larger model's correct \"Yes, ...\" is \
                 replaced too: turn it off for one (`rules_off`)"
            }
        }
    }
}

/// A set of [`AnswerRule`]s.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AnswerRules(u16);

impl AnswerRules {
    /// Every rule.
    pub fn all() -> AnswerRules {
        AnswerRules((1 << AnswerRule::ALL.len()) - 1)
    }

    pub fn contains(self, rule: AnswerRule) -> bool {
        self.0 & (1 << rule as u16) != 0
    }

    pub fn insert(&mut self, rule: AnswerRule) {
        self.0 |= 1 << rule as u16;
    }

    pub fn remove(&mut self, rule: AnswerRule) {
        self.0 &= !(1 << rule as u16);
    }

    /// The rules named in `names`; an unknown name is refused with every rule's name
    /// (`[answers] rules_off`, `--rules-off`).
    pub fn from_names<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<AnswerRules, String> {
        let mut set = AnswerRules::default();
        for name in names {
            let Some(rule) = AnswerRule::parse(name) else {
                let all: Vec<&str> = AnswerRule::ALL.iter().map(|r| r.name()).collect();
                return Err(format!("`{name}` is no answer rule: {}", all.join(", ")));
            };
            set.insert(rule);
        }
        Ok(set)
    }

    /// The rules in the set, in [`AnswerRule::ALL`]'s order.
    pub fn iter(self) -> impl Iterator<Item = AnswerRule> {
        AnswerRule::ALL
            .into_iter()
            .filter(move |r| self.contains(*r))
    }

    /// Their names.
    pub fn names(self) -> Vec<&'static str> {
        self.iter().map(AnswerRule::name).collect()
    }
}

/// Generated text on its way out, as `engramd` sends it: cut at the first stop string and,
/// for a RAG answer, its start cleaned ([`AnswerStart`], before the stop strings, so a blank
/// line before the answer does not end it), [`ANSWER_STOPS`] added to the stop strings, and
/// ended once it repeats itself ([`repeating`]).
#[derive(Debug)]
pub struct OutputText {
    lead: Option<AnswerStart>,
    stop: StopMatcher,
    /// Whether [`AnswerRule::Repeating`] is on, and whether it ended the answer.
    repeat_stop: bool,
    repeated: bool,
}

impl OutputText {
    /// A RAG answer to `question`, also cut at `stops`.
    pub fn answer(question: &str, stops: &[String]) -> OutputText {
        let mut all = stops.to_vec();
        all.extend(ANSWER_STOPS.iter().map(|s| s.to_string()));
        OutputText {
            lead: Some(AnswerStart::new(question)),
            stop: StopMatcher::new(&all),
            repeat_stop: true,
            repeated: false,
        }
    }

    /// When the model writes no answer (see [`not_answered`]), the answer is `sentence` instead:
    /// the evidence sentence its prompt showed ([`engram_fusion::FusedPrompt::evidence_text`]), the
    /// passages' own words that best match the question, its first letter capitalised and a
    /// clause cut at ";" ended with a full stop. So is
    /// an answer whose first number, in its first [`NUMBER_WINDOW`] bytes, neither the sentence
    /// nor the question states, in digits or as a small number in words ("10 days" or "within
    /// 10 days" where it says "within one hour"), or that starts with a bare "yes" or "no" (see
    /// [`Self::check_start`]): the start is held back until those bytes and their number are
    /// whole, and the answer ends with the sentence. Nothing changes for an empty sentence or
    /// for other text than an answer.
    pub fn or_sentence(&mut self, sentence: &str) {
        // A sentence cut at a clause ("...; flights are ...") ends as a sentence.
        let sentence = sentence
            .trim()
            .trim_end_matches([';', '；', ',', '，', ':', '：'])
            .trim_end();
        let Some(lead) = self.lead.as_mut().filter(|_| !sentence.is_empty()) else {
            return;
        };
        let mut chars = sentence.chars();
        lead.none = chars
            .next()
            .map(|c| c.to_uppercase().chain(chars).collect())
            .unwrap_or_default();
        if !sentence.ends_with(['.', '!', '?', '。', '！', '？', '"', '”', ')', '）']) {
            lead.none
                .push(if is_chinese(sentence) { '。' } else { '.' });
        }
        lead.sentence = true;
        lead.stated = stated_numbers(sentence);
        lead.stated.extend(lead.asked.iter().cloned());
        lead.wanted = lead.asks.iter().copied().find(|&k| holds(k, sentence));
        lead.counted = counted_number(sentence, &lead.counts);
    }

    /// The passages the answer is to come from: with the evidence sentence
    /// ([`Self::or_sentence`]) and the start check on, an answer most of whose first own words
    /// none of them has is the sentence ([`AnswerStart::grounded`]). The start is held back until
    /// it has [`GROUNDING_WORDS`] words the question does not have, or is whole.
    pub fn from_passages<'a>(&mut self, passages: impl IntoIterator<Item = &'a str>) {
        if let Some(lead) = self.lead.as_mut() {
            let mut found = std::collections::HashSet::new();
            for p in passages {
                found.extend(ground_units(p, false));
            }
            lead.passages = Some(found);
        }
    }

    /// Whether an answer's start (a number, a bare yes or no) is checked against the evidence
    /// sentence (on after [`Self::or_sentence`]; `engram eval qa --start-check` compares both).
    pub fn check_start(&mut self, on: bool) {
        if let Some(lead) = self.lead.as_mut() {
            lead.check = on;
        }
    }

    /// Turns the rules in `off` off for this answer (`[answers] rules_off`).
    pub fn rules_off(&mut self, off: AnswerRules) {
        if let Some(lead) = self.lead.as_mut() {
            for r in off.iter() {
                lead.on.remove(r);
            }
        }
        self.repeat_stop &= !off.contains(AnswerRule::Repeating);
    }

    /// The rules that changed this answer so far.
    pub fn rules_fired(&self) -> AnswerRules {
        let mut fired = self
            .lead
            .as_ref()
            .map_or_else(AnswerRules::default, |l| l.fired);
        if self.repeated {
            fired.insert(AnswerRule::Repeating);
        }
        fired
    }

    /// Whether the answer is the sentence of [`Self::or_sentence`]: the model wrote none, or
    /// started with what the sentence does not support.
    pub fn fell_back(&self) -> bool {
        self.lead.as_ref().is_some_and(|l| l.fell_back)
    }

    /// Other text (a chat, a completion): cut at `stops` only.
    pub fn plain(stops: &[String]) -> OutputText {
        OutputText {
            lead: None,
            stop: StopMatcher::new(stops),
            repeat_stop: false,
            repeated: false,
        }
    }

    /// Adds a piece of decoded text: what can go out now, and whether the text has ended (a
    /// stop string, or an answer repeating itself).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        let (out, hit) = match &mut self.lead {
            Some(lead) => {
                let out = lead.push(piece);
                if lead.replaced {
                    // The evidence sentence is the whole answer: nothing of it held back.
                    let (mut out, hit) = self.stop.push(&out);
                    if !hit {
                        out.push_str(&self.stop.flush());
                    }
                    return (out, true);
                }
                self.stop.push(&out)
            }
            None => self.stop.push(piece),
        };
        let looping = !hit && self.repeat_stop && repeating(self.stop.text());
        self.repeated |= looping;
        (out, hit || looping)
    }

    /// The end of generation: what is still held back, and whether a stop string turned up in
    /// it. Nothing after a stop string.
    pub fn finish(&mut self) -> (String, bool) {
        if self.stop.stopped() {
            return (String::new(), false);
        }
        let text = match &mut self.lead {
            Some(lead) => lead.finish(),
            None => String::new(),
        };
        let (mut out, hit) = self.stop.push(&text);
        if !hit {
            out.push_str(&self.stop.flush());
        }
        (out, hit)
    }

    /// All the text accepted so far (up to a stop string).
    pub fn text(&self) -> &str {
        self.stop.text()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `pieces` through `out` as engramd streams them: until one ends the answer, then the end
    /// of generation; the text that went out, and whether it is the evidence sentence.
    fn streamed(mut out: OutputText, pieces: &[&str]) -> (String, bool) {
        streamed_out(&mut out, pieces)
    }

    /// The answer without what comes before it: leading labels ("Answer:"), and the question
    /// repeated (with or without a "Question:" label). An answer that is nothing but the question
    /// becomes empty.
    fn clean_answer(answer: &str, question: &str) -> String {
        strip_lead(answer, &folded(question)).trim().to_owned()
    }

    #[test]
    fn labels_and_echoed_questions_go() {
        let q = "How many days of paid leave do employees get?";
        assert_eq!(clean_answer(" Answer: 25 days", q), "25 days");
        assert_eq!(
            clean_answer(
                "How many days of paid leave do employees get?\n\n25 days",
                q
            ),
            "25 days"
        );
        assert_eq!(
            clean_answer(
                "Question: how many days of paid leave do employees get? 25",
                q
            ),
            "25"
        );
        assert_eq!(clean_answer(q, q), "");
        // A start that only looks like the question stays.
        assert_eq!(clean_answer("How many? Ten.", q), "How many? Ten.");
        assert_eq!(clean_answer("答案：25天", "员工有几天带薪假？"), "25天");
        assert_eq!(
            clean_answer("员工有几天带薪假？25天", "员工有几天带薪假？"),
            "25天"
        );
        assert_eq!(
            clean_answer("The answer to the question is: Virgin Media", "What?"),
            "Virgin Media"
        );
        // Without its colon, a label's words are the answer.
        assert_eq!(clean_answer("A cat.", "What?"), "A cat.");
    }

    #[test]
    fn streamed_answers_are_cleaned_as_whole_ones() {
        let q = "How many days of paid leave do employees get?";
        for pieces in [
            &[
                "How",
                " many",
                " days of paid leave do employees get",
                "?",
                " 25",
                " days",
            ][..],
            &["Answer", ":", " 25", " days", " a", " year"][..],
            &["25", " days"][..],
            &["How", " many"][..],
            &["How", " much", " leave"][..],
        ] {
            let mut s = AnswerStart::new(q);
            let mut out: String = pieces.iter().map(|p| s.push(p)).collect();
            out.push_str(&s.finish());
            assert_eq!(out.trim(), clean_answer(&pieces.concat(), q), "{pieces:?}");
        }
    }

    #[test]
    fn an_answer_the_model_did_not_write_is_the_evidence_sentence() {
        let q = "When am I allowed to take a plane?";
        let sentence = " flights are allowed for trips of more than 600 kilometres.";
        let answer = |pieces: &[&str], sentence: &str| {
            let mut out = OutputText::answer(q, &[]);
            out.or_sentence(sentence);
            let mut text: String = pieces.iter().map(|p| out.push(p).0).collect();
            text.push_str(&out.finish().0);
            (text, out.fell_back())
        };
        let said = "Flights are allowed for trips of more than 600 kilometres.".to_owned();
        assert_eq!(
            answer(&[" When am I allowed", " to take a plane?"], sentence),
            (said.clone(), true)
        );
        assert_eq!(answer(&["Answer:"], sentence), (said, true));
        // What the model wrote stays its answer.
        assert_eq!(
            answer(&["Over 600 km."], sentence),
            ("Over 600 km.".into(), false)
        );
        // No sentence shown: not answered, as before.
        assert_eq!(answer(&[], " "), (not_answered(q).to_owned(), false));
        // Chinese is taken as it is.
        let mut out = OutputText::answer("生病了应该怎么办？", &[]);
        out.or_sentence("员工生病时应在上午 10 点前通知经理。");
        assert_eq!(out.finish().0, "员工生病时应在上午 10 点前通知经理。");
        // Other text than an answer has nothing to fall back to.
        let mut out = OutputText::plain(&[]);
        out.or_sentence(sentence);
        assert_eq!(out.finish().0, "");
        assert!(!out.fell_back());
    }

    #[test]
    fn an_answer_starting_with_a_number_the_sentence_does_not_state_is_the_sentence() {
        let q = "How quickly must I report a lost laptop?";
        let sentence = "A lost badge or laptop is reported to the IT helpdesk within one hour, at \
                        extension 4357 or helpdesk@northwind.example.";
        // (answer, whether each piece ended it, fell back)
        let answer = |question: &str, pieces: &[&str], sentence: &str, check: bool| {
            let mut out = OutputText::answer(question, &[]);
            out.or_sentence(sentence);
            out.check_start(check);
            let mut text = String::new();
            let mut ended = Vec::new();
            for p in pieces {
                let (piece, end) = out.push(p);
                text.push_str(&piece);
                ended.push(end);
                if end {
                    break;
                }
            }
            if !ended.last().copied().unwrap_or(false) {
                text.push_str(&out.finish().0);
            }
            assert_eq!(text, out.text());
            (text, ended, out.fell_back())
        };
        // Held back until the number is whole, then the sentence in its place, and the end.
        assert_eq!(
            answer(q, &["1", "0", " days", " after"], sentence, true),
            (sentence.to_owned(), vec![false, false, true], true)
        );
        // Unchecked, the model's answer stands.
        assert_eq!(
            answer(q, &["1", "0", " days"], sentence, false).0,
            "10 days"
        );
        // A number the sentence states, in digits or in words, is the model's answer.
        assert_eq!(
            answer(q, &["4", "3", "5", "7"], sentence, true),
            ("4357".into(), vec![false, false, false, false], false)
        );
        assert_eq!(
            answer(q, &["Answer: ", "1", " hour"], sentence, true).0,
            "1 hour"
        );
        // The first number of the answer's first few words is checked; one after them is not.
        assert_eq!(
            answer(q, &["Within", " 10", " days"], sentence, true),
            (sentence.to_owned(), vec![false, false, true], true)
        );
        assert_eq!(
            answer(q, &["Within", " one", " hour", "."], sentence, true),
            ("Within one hour.".into(), vec![false; 4], false)
        );
        assert_eq!(
            answer(
                q,
                &["Report it to the IT helpdesk", " within 10 days"],
                sentence,
                true
            )
            .0,
            "Report it to the IT helpdesk within 10 days"
        );
        // A number that ends the answer is checked there; cut off by the token limit, one the
        // sentence's numbers start with stands.
        assert_eq!(
            answer(q, &["1", "0"], sentence, true),
            (sentence.to_owned(), vec![false, false], true)
        );
        assert_eq!(answer(q, &["4", "3"], sentence, true).0, "43");
        // So is one the question states.
        assert_eq!(
            answer(
                "Who sang at Super Bowl 50?",
                &["The Super Bowl 50", " singer was Lady Gaga."],
                "Lady Gaga performed the national anthem.",
                true
            )
            .0,
            "The Super Bowl 50 singer was Lady Gaga."
        );
        let q = "未休完的年假可以结转几天？";
        let sentence = "未休完的年假最多可以结转 5 天到下一年，结转的天数在 3 月 31 日作废。";
        assert_eq!(answer(q, &["3", "0", " 天"], sentence, true).0, sentence);
        assert_eq!(answer(q, &["5", " 天"], sentence, true).0, "5 天");
        assert_eq!(
            answer(q, &["最多", "结转 30 天"], sentence, true).0,
            sentence
        );
        // An answer ended by a stop string is judged whole there, before what follows it.
        assert_eq!(
            answer(q, &["最多", "结转 5 天", "\n\n问题：30 天"], sentence, true),
            ("最多结转 5 天".into(), vec![false, false, true], false)
        );
        // No sentence shown: nothing to check against.
        let mut out = OutputText::answer(q, &[]);
        assert_eq!(out.push("30 天"), ("30 天".into(), false));
        // A bare yes or no is the sentence; a word that only starts like one is not.
        let q = "Can I take unused vacation days into the following year?";
        let sentence = "Up to 5 unused days can be carried over into the next year.";
        assert_eq!(
            answer(q, &["No", ",", " you cannot"], sentence, true),
            (sentence.to_owned(), vec![false, true], true)
        );
        assert_eq!(answer(q, &["Yes"], sentence, true).0, sentence);
        // A clause ends as a sentence.
        assert_eq!(
            answer(
                q,
                &["Yes"],
                "up to 5 unused days can be carried over;",
                true
            )
            .0,
            "Up to 5 unused days can be carried over."
        );
        assert_eq!(
            answer(
                "坐火车可以订几等座？",
                &["1", "0", "0"],
                "火车出行预订二等座；",
                true
            )
            .0,
            "火车出行预订二等座。"
        );
        assert_eq!(answer(q, &["No", "rthwind"], sentence, true).0, "Northwind");
        // The question asked back before a stop string is no answer: the sentence, and the end.
        let core = "Core hours are 10:00 to 15:00, when everyone is expected to be available;";
        assert_eq!(
            answer(
                "When do core hours start?",
                &["When core hours start.", "\n\nQuestion:"],
                core,
                true
            ),
            (
                "Core hours are 10:00 to 15:00, when everyone is expected to be available.".into(),
                vec![false, true],
                true
            )
        );
        assert_eq!(
            answer(q, &["Up to", " 5 days"], sentence, true).0,
            "Up to 5 days"
        );
        assert_eq!(
            answer(q, &["No", ",", " you cannot"], sentence, false).0,
            "No, you cannot"
        );
    }

    /// Each rule that changes an answer says so (`timings.answer_rules`), and a rule turned
    /// off changes nothing: the answer is then what the model wrote.
    #[test]
    fn answer_rules_are_named_counted_and_switched_off_one_by_one() {
        let q = "Can I take unused vacation days into the following year?";
        let sentence = "Up to 5 unused days can be carried over into the next year.";
        let run = |pieces: &[&str], off: &[AnswerRule]| {
            let mut out = OutputText::answer(q, &[]);
            out.or_sentence(sentence);
            let mut rules = AnswerRules::default();
            for &r in off {
                rules.insert(r);
            }
            out.rules_off(rules);
            let (text, _) = streamed_out(&mut out, pieces);
            (text, out.rules_fired().names())
        };
        // A bare "No" is the sentence, by `bare_polar`; with it off, the model's words stand.
        assert_eq!(
            run(&["No", ",", " you cannot"], &[]),
            (sentence.to_owned(), vec!["bare_polar"])
        );
        assert_eq!(
            run(&["No", ",", " you cannot"], &[AnswerRule::BarePolar]),
            ("No, you cannot".to_owned(), vec![])
        );
        // A number the sentence does not state, by `unstated_number`.
        assert_eq!(
            run(&["3", "0", " days"], &[]),
            (sentence.to_owned(), vec!["unstated_number"])
        );
        assert_eq!(
            run(&["3", "0", " days"], &[AnswerRule::UnstatedNumber]).0,
            "30 days"
        );
        // A label before the answer goes, by `lead`; off, it stays.
        assert_eq!(
            run(&["Answer:", " Up to 5 days"], &[]),
            ("Up to 5 days".to_owned(), vec!["lead"])
        );
        assert_eq!(
            run(&["Answer:", " Up to 5 days"], &[AnswerRule::Lead]).0,
            "Answer: Up to 5 days"
        );
        // Nothing written: the sentence, by `empty`.
        assert_eq!(run(&[], &[]), (sentence.to_owned(), vec!["empty"]));
        // An answer nothing changes names no rule.
        assert_eq!(
            run(&["Up to", " 5 days"], &[]),
            ("Up to 5 days".to_owned(), vec![])
        );
        // An answer repeating itself ends there, by `repeating`; off, it goes on.
        let looping = [
            "Up to 5 days.",
            " Up to 5 days.",
            " Up to 5 days.",
            " Up to 5 days.",
        ];
        let (text, fired) = run(&looping, &[]);
        assert!(fired.contains(&"repeating"), "{text:?} {fired:?}");
        let (all, fired) = run(&looping, &[AnswerRule::Repeating]);
        assert!(
            !fired.contains(&"repeating") && all.len() > text.len(),
            "{all:?}"
        );
        // Names parse back, and every rule says what it does and for which models.
        for r in AnswerRule::ALL {
            assert_eq!(AnswerRule::parse(r.name()), Some(r));
            assert!(!r.doc().is_empty() && !r.models().is_empty());
        }
        assert_eq!(AnswerRule::parse("polar"), None);
        assert_eq!(AnswerRules::all().iter().count(), AnswerRule::ALL.len());
    }

    /// [`streamed`] on an answer the caller keeps (to read its rules afterwards).
    fn streamed_out(out: &mut OutputText, pieces: &[&str]) -> (String, bool) {
        let mut text = String::new();
        for p in pieces {
            let (piece, end) = out.push(p);
            text.push_str(&piece);
            if end {
                return (text, out.fell_back());
            }
        }
        text.push_str(&out.finish().0);
        (text, out.fell_back())
    }

    #[test]
    fn an_answer_without_the_kind_of_value_asked_for_is_the_sentence() {
        use Wanted::*;
        assert_eq!(wanted("What is the helpdesk's email address?"), vec![Email]);
        assert_eq!(
            wanted("How long is the working week?"),
            vec![Duration, Quantity]
        );
        assert_eq!(
            wanted("笔记本电脑丢了要多久内报告？"),
            vec![Duration, Quantity]
        );
        assert_eq!(wanted("未休完的年假可以结转几天？"), vec![Quantity]);
        assert_eq!(wanted("What number do I dial?"), vec![Quantity]);
        // "When" asks for an event as often as a date; "几乎" is "almost"; "somehow" is a word.
        assert!(wanted("When did the war end?").is_empty());
        assert!(wanted("他几乎每天都来吗？").is_empty());
        assert!(wanted("Did it work somehow many times?").is_empty());
        assert!(holds(Email, "helpdesk@northwind.example"));
        assert!(!holds(Email, "the @ sign"));
        assert!(holds(Duration, "within one hour") && holds(Duration, "应在一小时内报告"));
        assert!(!holds(Duration, "4357") && !holds(Duration, "the helpdesk"));
        assert!(
            holds(Quantity, "twenty-five") && holds(Quantity, "three") && holds(Quantity, "三朝")
        );
        assert!(!holds(Quantity, "Employees may work remotely"));

        let sentence = "A lost badge or laptop is reported to the IT helpdesk within one hour, at \
                        extension 4357 or helpdesk@northwind.example.";
        let answer = |q: &str, pieces: &[&str], sentence: &str, check: bool| {
            let mut out = OutputText::answer(q, &[]);
            out.or_sentence(sentence);
            out.check_start(check);
            streamed(out, pieces)
        };
        let q = "What is the email address of the helpdesk?";
        // Held back until the address comes, then the model's answer.
        let mut out = OutputText::answer(q, &[]);
        out.or_sentence(sentence);
        assert_eq!(out.push("IT Helpdesk").0, "");
        assert_eq!(
            out.push(" at helpdesk@north").0,
            "IT Helpdesk at helpdesk@north"
        );
        // Without it, the sentence, at the end of generation or at a stop string.
        assert_eq!(
            answer(q, &["IT", " Helpdesk"], sentence, true),
            (sentence.to_owned(), true)
        );
        assert_eq!(
            answer(q, &["IT Helpdesk", "\n\nQuestion:"], sentence, true),
            (sentence.to_owned(), true)
        );
        // Unchecked, or with a sentence that holds no address, the model's answer stands.
        assert_eq!(
            answer(q, &["IT Helpdesk"], sentence, false).0,
            "IT Helpdesk"
        );
        assert_eq!(
            answer(
                q,
                &["IT Helpdesk"],
                "The IT helpdesk installs software.",
                true
            )
            .0,
            "IT Helpdesk"
        );
        // A length of time asked for: a number alone is not one.
        let zh = "工牌或笔记本电脑丢失后，应在一小时内报告 IT 服务台，分机号 4357。";
        assert_eq!(
            answer("笔记本电脑丢了要多久内报告？", &["4357"], zh, true).0,
            zh
        );
        assert_eq!(
            answer("笔记本电脑丢了要多久内报告？", &["一小时内"], zh, true).0,
            "一小时内"
        );
        // "How long" of a sentence without a unit of time asks for a number.
        assert_eq!(
            answer(
                "How long is the Rhine?",
                &["Very long."],
                "The Rhine is 1,230 km long.",
                true
            )
            .0,
            "The Rhine is 1,230 km long."
        );
        assert_eq!(
            answer(
                "How long is the Rhine?",
                &["1,230 km"],
                "The Rhine is 1,230 km long.",
                true
            )
            .0,
            "1,230 km"
        );
    }

    #[test]
    fn an_answer_without_the_number_of_what_is_counted_is_the_sentence() {
        assert_eq!(
            counted_units("How many of my last passwords can I not repeat?"),
            vec!["last".to_owned(), crate::text::stem("passwords")]
        );
        assert_eq!(counted_units("每一项超过多少欧元需要收据？"), vec!["欧"]);
        // A question about money also counts the currencies, after its own words.
        let money = counted_units("每一项费用超过多少欧元需要收据？");
        assert_eq!(money[0], "欧");
        assert!(money.contains(&"元".to_owned()) && money.contains(&"euro".to_owned()));
        assert_eq!(
            counted_units("报销要在购买后多久内提交？"),
            Vec::<String>::new()
        );
        assert_eq!(counted_units("未休完的年假可以结转几天？"), vec!["天"]);
        assert!(counted_units("他几乎每天都来吗？").is_empty());
        assert!(counted_units("Somehow many were lost?").is_empty());

        let passwords = "A new password must be at least 12 characters long and must not repeat \
                         any of the last five passwords.";
        let euros = "费用报销须在购买后 30 天内提交，每一项超过 25 欧元的费用都需要附上收据。";
        let counted = |q: &str, s: &str| counted_number(s, &counted_units(q));
        assert_eq!(
            counted("How many old passwords may not be reused?", passwords),
            Some("5".to_owned())
        );
        assert_eq!(
            counted("How many characters must a password have?", passwords),
            Some("12".to_owned())
        );
        assert_eq!(
            counted("每一项费用超过多少欧元需要收据？", euros),
            Some("25".to_owned())
        );
        assert_eq!(counted("几天内提交？", euros), Some("30".to_owned()));
        assert_eq!(
            counted("结转的年假最多几天？", "最多可以结转五天。"),
            Some("5".to_owned())
        );
        assert_eq!(
            counted(
                "How many people live there?",
                "About 1.7 million people live in the city."
            ),
            Some("1".to_owned())
        );
        // Two numbers of what is counted, or none: which one is asked for is not plain.
        assert_eq!(
            counted(
                "How many days?",
                "25 days a year, 5 unused days carried over."
            ),
            None
        );
        assert_eq!(counted("How many cars?", passwords), None);
        // A question about money counts the currencies, after its own words.
        let receipts = "Expense claims are submitted within 30 days of the purchase, with a \
                        receipt for every item above 25 euros.";
        assert_eq!(
            counted("Above what amount is a receipt required?", receipts),
            Some("25".to_owned())
        );
        assert_eq!(
            counted("多少钱以上的费用需要收据？", euros),
            Some("25".to_owned())
        );
        assert_eq!(
            counted(
                "How much does a night cost?",
                "The hotel costs $150 a night."
            ),
            Some("150".to_owned())
        );
        assert_eq!(
            counted("What did the hotel cost?", "It cost 1,500 € in 2010."),
            Some("1500".to_owned())
        );
        assert_eq!(counted("What did it cost?", "It was built in 1990."), None);

        let answer = |q: &str, pieces: &[&str], sentence: &str| {
            let mut out = OutputText::answer(q, &[]);
            out.or_sentence(sentence);
            streamed(out, pieces)
        };
        let q = "How many old passwords may not be reused?";
        assert_eq!(answer(q, &["12"], passwords), (passwords.to_owned(), true));
        assert_eq!(
            answer(q, &["The last ", "five", "."], passwords),
            ("The last five.".to_owned(), false)
        );
        assert_eq!(answer(q, &["5"], passwords), ("5".to_owned(), false));
        let q = "每一项费用超过多少欧元需要收据？";
        assert_eq!(
            answer(q, &["30 天内提交", "最多收据 150 欧元"], euros),
            (euros.to_owned(), true)
        );
        assert_eq!(
            answer(q, &["25 欧元"], euros),
            ("25 欧元".to_owned(), false)
        );
        // Held back until the number comes.
        let mut out = OutputText::answer(q, &[]);
        out.or_sentence(euros);
        assert_eq!(out.push("超过 ").0, "");
        assert_eq!(out.push("25 欧元").0, "超过 25 欧元");
    }

    #[test]
    fn a_question_for_a_date_wants_an_answer_that_names_one() {
        use Wanted::*;
        assert_eq!(
            wanted("Until what date can carried-over days be used?"),
            vec![Date, Quantity]
        );
        assert_eq!(
            wanted("Until when can carried-over days be used?"),
            vec![Date]
        );
        assert_eq!(wanted("结转的年假哪天作废？"), vec![Date]);
        assert_eq!(
            wanted("How often do passwords expire?"),
            vec![Duration, Quantity]
        );
        for date in [
            "31 March",
            "on March 31",
            "January 27, 1967",
            "3 月 31 日",
            "三月三十一日",
            "5号",
            "2024-03-31",
            "31/3/2024",
        ] {
            assert!(holds(Date, date), "{date}");
        }
        for other in [
            "in March",
            "every 180 days",
            "三个月",
            "4357",
            "1.5.",
            "10:00 to 15:00",
        ] {
            assert!(!holds(Date, other), "{other}");
        }
        let sentence = "Up to 5 unused days can be carried over into the next year; carried-over \
                        days expire on 31 March.";
        let q = "Until what date can carried-over days be used?";
        let answer = |pieces: &[&str]| {
            let mut out = OutputText::answer(q, &[]);
            out.or_sentence(sentence);
            streamed(out, pieces).0
        };
        assert_eq!(
            answer(&[
                "Up to 5 unused days",
                " can be carried over into the next year."
            ]),
            sentence
        );
        assert_eq!(answer(&["Until 31", " March."]), "Until 31 March.");
    }

    #[test]
    fn an_answer_whose_own_words_the_passages_lack_is_the_sentence() {
        let passages = [
            "In 1564 the French established Fort Caroline on the St. Johns River, the first \
             French colony in what is now the United States.",
            "The Spanish founded St. Augustine in 1565 and destroyed the colony.",
        ];
        let sentence = "In 1564 the French established Fort Caroline on the St. Johns River.";
        let answer = |q: &str, pieces: &[&str], check: bool| {
            let mut out = OutputText::answer(q, &[]);
            out.or_sentence(sentence);
            out.from_passages(passages);
            out.check_start(check);
            streamed(out, pieces)
        };
        let q = "What is the name of the French colony established in 1564?";
        assert_eq!(
            answer(q, &["New", " Holland"], true),
            (sentence.to_owned(), true)
        );
        assert_eq!(
            answer(q, &["Fort", " Caroline"], true),
            ("Fort Caroline".to_owned(), false)
        );
        // Words of other passages, and inflections, are the passages' too.
        assert_eq!(
            answer(q, &["The Spanish destroy", "ed it."], true).0,
            "The Spanish destroyed it."
        );
        assert_eq!(answer(q, &["New Holland"], false).0, "New Holland");
        // Held back until no own word still to come can change the outcome (two of the four
        // are the passages' here: "Fort" and "Caroline"), then streamed.
        let mut out = OutputText::answer(q, &[]);
        out.or_sentence(sentence);
        out.from_passages(passages);
        assert_eq!(out.push("It was Fort").0, "");
        assert_eq!(
            out.push(" Caroline on the").0,
            "It was Fort Caroline on the"
        );
        assert_eq!(out.push(" St. Johns River").0, " St. Johns River");
        // Three own words none of them has: the sentence, before a fourth can come.
        let mut out = OutputText::answer(q, &[]);
        out.or_sentence(sentence);
        out.from_passages(passages);
        assert_eq!(out.push("New Holland, Dutch").0, "");
        assert_eq!(out.push(" traders").0, sentence);
        // A Chinese question answered by an English formula.
        let zh = "1564年，法国人建立了卡罗琳堡。";
        let mut out = OutputText::answer("1564年法国人建立的殖民地叫什么？", &[]);
        out.or_sentence(zh);
        out.from_passages([zh]);
        assert_eq!(
            streamed(out, &["The answer to this question is:"]),
            (zh.to_owned(), true)
        );
        // An answer with no words of its own is not judged by the passages.
        let q = "Was Fort Caroline French?";
        assert_eq!(
            answer(q, &["Fort Caroline was French."], true).0,
            "Fort Caroline was French."
        );
    }

    #[test]
    fn numbers_are_compared_by_their_first_run_of_digits() {
        assert_eq!(early_number(" 10"), Lead::Open("10".into()));
        assert_eq!(early_number("10:"), Lead::Open("10".into()));
        assert_eq!(early_number("10:00 to 15:00"), Lead::Number("10".into()));
        assert_eq!(early_number("1,500 euros"), Lead::Number("1500".into()));
        assert_eq!(early_number("3.5 days"), Lead::Number("3".into()));
        assert_eq!(early_number("Twenty-five"), Lead::Words);
        let stated =
            stated_numbers("Core hours are 10:00 to 15:00; up to three days, 1,500 or 两周.");
        for n in ["10", "15", "3", "1500", "2"] {
            assert!(stated.contains(n), "{n} in {stated:?}");
        }
        assert!(!stated.contains("00"));
        // A number word is a whole word: "someone" states no 1.
        assert!(!stated_numbers("Someone calls.").contains("1"));
    }

    #[test]
    fn an_answer_that_is_only_the_question_says_it_is_not_answered() {
        let whole = |question: &str, pieces: &[&str]| {
            let mut out = OutputText::answer(question, &[]);
            let mut text = String::new();
            for p in pieces {
                let (piece, ended) = out.push(p);
                assert!(!ended, "{pieces:?}");
                text.push_str(&piece);
            }
            text.push_str(&out.finish().0);
            assert_eq!(text, out.text(), "{pieces:?}");
            text
        };
        let q = "朱皇后是谁的妻子？";
        for pieces in [
            &["朱皇后", "是谁的妻子？"][..],
            &["答案：", "朱皇后是谁的妻子"],
            // The evidence label repeated until the loop stop cut it.
            &["最相关的句子：", "最相关的句子：", "最相关的"],
            &[],
        ] {
            assert_eq!(whole(q, pieces), not_answered(q), "{pieces:?}");
        }
        assert_eq!(whole(q, &["朱皇后是谁的妻子？", "孙休"]), "孙休");
        let q = "Who founded the company?";
        assert_eq!(
            whole(q, &["Answer:", " Who founded the company?", "\n"]),
            "I don't know: the passages found do not answer this question."
        );
        assert_eq!(
            whole(q, &["Most relevant sentence:", " Most relevant"]),
            not_answered(q)
        );
        // The question asked back in other words, of its own: no answer either; what follows
        // it is the answer.
        let q = "瑞尼尔山在美国哪个县的境内？";
        assert_eq!(whole(q, &["瑞尼尔山", "在美国哪个县？"]), not_answered(q));
        assert_eq!(
            whole(q, &["瑞尼尔山在美国哪个县？", "\n", "皮尔斯县"]),
            "皮尔斯县"
        );
        assert_eq!(
            whole("硫醚的通式是什么？", &["硫醚通式是什么"]),
            not_answered("硫醚的通式是什么？")
        );
        // An answer that starts with the question's words goes out whole once it leaves them;
        // a short one made of them is an answer.
        let q = "Who did the Broncos beat in the divisional game?";
        assert_eq!(
            whole(q, &["The Broncos", " beat the", " Pittsburgh Steelers."]),
            "The Broncos beat the Pittsburgh Steelers."
        );
        assert_eq!(whole("Bush or Clinton?", &["Bush"]), "Bush");
        let q = "Were the restored tapes able to have color added to them?";
        let said = "The restored tapes were able to have color added to them.";
        assert_eq!(whole(q, &[said]), said);
        let q = "田泽湖车站是JR东日本所属的哪条地方交通线沿线的车站之一？";
        assert_eq!(
            whole(q, &["田泽湖车站JR东日本所属的地方交通线"]),
            "田泽湖车站JR东日本所属的地方交通线"
        );
        // A word still being written counts as the question's while one of its words starts
        // with it: "3" may become "32M".
        let q = "九龙巴士32M线来往于哪些地方？";
        assert_eq!(
            whole(q, &["3", "2", "M", "线来往于哪些地方？"]),
            not_answered(q)
        );
        assert_eq!(whole(q, &["3", "1", "号"]), "31号");
        assert_eq!(
            whole(
                "灵昭真君是什么地区的乡土神？",
                &["灵昭真君是广东地区的乡土神？"]
            ),
            "灵昭真君是广东地区的乡土神？"
        );
        // The start of a short label may be the answer.
        assert_eq!(whole("Which option?", &["A"]), "A");
        assert_eq!(whole(q, &["Most"]), "Most");
        // Other text (a chat, a completion) may be empty.
        let mut out = OutputText::plain(&[]);
        assert_eq!(out.finish(), (String::new(), false));
    }

    #[test]
    fn repetition_is_noticed() {
        assert!(repeating("1.1.1.1.1.1."));
        assert!(repeating(
            "the value of the value of the value of the value of"
        ));
        assert!(repeating("2013 年 2013 年 2013 年 "));
        assert!(!repeating("ha ha ha"));
        assert!(!repeating("25 days of paid leave per year."));
        assert!(!repeating("Robert Lane and Benjamin Vail"));
        assert!(!repeating(""));
    }

    #[test]
    fn english_questions_are_judged_by_the_score_chinese_ones_by_their_words() {
        let none: [&str; 0] = [];
        assert!(relevant("How long is the password?", Some(0.5), none));
        assert!(!relevant("How long is the password?", Some(0.05), none));
        assert!(relevant("How long is the password?", None, none));
        // A Chinese question is judged by the passages, whatever the English embedder said.
        let q = "新密码至少需要几个字符？";
        let about = "新密码至少需要 12 个字符，并且不能与最近五次使用过的密码相同。";
        let other = "费用报销须在购买后 30 天内提交，每一项超过 25 欧元的费用都需要附上收据。";
        assert!(relevant(q, Some(0.05), [other, about]));
        assert!(!relevant(q, Some(0.9), [other]));
        assert!(!relevant(q, None, none));
        // Neither English nor Chinese: answered.
        assert!(relevant(
            "Wie lang muss ein neues Passwort sein?",
            None,
            none
        ));
    }

    #[test]
    fn an_english_question_whose_terms_a_chunk_repeats_is_answered_below_the_cosine_floor() {
        let travel = "Expense claims are submitted within 30 days of the purchase, with a receipt \
                      for every item above 25 euros. Train travel is booked in second class; \
                      flights are allowed for trips of more than 600 kilometres.";
        let leave = "Every employee gets 25 days of paid leave per year.";
        let q = "Which class is train travel booked in?";
        // class, train, travel, booked: "train travel" and "travel booked" of three pairs.
        assert_eq!(best_term_coverage(q, [leave, travel]), 2.0 / 3.0);
        assert!(relevant(q, Some(0.16), [leave, travel]));
        assert!(!relevant(q, Some(0.16), [leave]));
        // trips distance, distance flights, flights allowed: one of three.
        let q = "For trips of what distance are flights allowed?";
        assert_eq!(best_term_coverage(q, [travel]), 1.0 / 3.0);
        assert!(relevant(q, Some(0.25), [travel]));
        // trips longer, longer kilometres, kilometres flights, flights allowed: one of four.
        let q = "For trips longer than how many kilometres are flights allowed?";
        assert_eq!(best_term_coverage(q, [travel]), 0.25);
        assert!(relevant(q, Some(0.26), [travel]));
        // Shared stop words and one shared term are not a topic.
        let off = "What is the capital of Australia?";
        assert_eq!(best_term_coverage(off, [leave, travel]), 0.0);
        assert!(!relevant(off, Some(0.1), [leave, travel]));
        assert_eq!(best_term_coverage("What is travel?", [travel]), 0.0);
        assert_eq!(best_term_coverage("Who is he?", [travel]), 0.0);
    }

    #[test]
    fn coverage_counts_the_question_wording_a_passage_repeats() {
        let q = "新密码至少需要几个字符？";
        let about = "新密码至少需要 12 个字符，并且不能与最近五次使用过的密码相同。";
        // 新密 密码 码至 至少 少需 需要 个字 字符 are all in it (要几 and 几个, pairs of two
        // function characters, are not counted); the other passage has none of them.
        assert_eq!(question_coverage(q, about), 1.0);
        let other = "费用报销须在购买后 30 天内提交，每一项超过 25 欧元的费用都需要附上收据。";
        assert_eq!(question_coverage(q, other), 1.0 / 8.0);
        // Pairs of two function characters say nothing about the topic.
        assert_eq!(question_coverage("是什么？", "这是什么"), 0.0);
        assert_eq!(best_coverage(q, []), 0.0);
        assert_eq!(question_coverage("？", about), 0.0);
        // Words count as units, case aside.
        assert_eq!(
            question_coverage("NFL", "黑豹队领先国家橄榄球联盟 (nfl)"),
            1.0
        );
    }

    #[test]
    fn chinese_questions_get_a_chinese_refusal() {
        assert!(no_answer("新密码至少需要几个字符？").starts_with("我不知道"));
        assert!(no_answer("How long is the password?").starts_with("I don't know"));
    }

    #[test]
    fn only_english_questions_get_a_second_look_at_sentences() {
        let hand = "Passwords are changed every 180 days. A lost badge or laptop is reported to \
                    the IT helpdesk within one hour.";
        let other = "Train travel is booked in second class.";
        let q = "Who do I call if I lose my badge?";
        // Refused by the first look: no cosine given over the floor, no content-word pair
        // repeated ("lose badge" against "lost badge").
        assert!(!relevant(q, Some(0.2), [hand, other]));
        // The sentences, best-ranked passage first.
        assert_eq!(
            sentences_to_embed(q, [hand, other]),
            [
                "Passwords are changed every 180 days.",
                "A lost badge or laptop is reported to the IT helpdesk within one hour.",
                "Train travel is booked in second class.",
            ]
        );
        // At most MAX_CHECKED_SENTENCES of them.
        let many = "One. ".repeat(2 * MAX_CHECKED_SENTENCES);
        assert_eq!(
            sentences_to_embed(q, [many.as_str()]).len(),
            MAX_CHECKED_SENTENCES
        );
        // Chinese questions are judged by their words alone.
        assert!(sentences_to_embed("丢失工牌后找谁？", [hand]).is_empty());
        assert!(relevant_sentence(Some(SENTENCE_FLOOR)));
        assert!(!relevant_sentence(Some(SENTENCE_FLOOR - 0.01)));
        assert!(!relevant_sentence(None));
    }
}
