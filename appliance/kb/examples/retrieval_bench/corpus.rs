//! The synthetic collection: deterministic chunk texts with real word frequencies, clustered
//! 384-dimensional unit vectors that share their topics with the texts, and queries aimed at
//! chunks that exist.
//!
//! Every chunk's text and vector are pure functions of the seed and its number (each with its
//! own random stream), so a collection of any size is written batch by batch without holding
//! it in memory, either index can be written without making the other's half, and a query's
//! target chunk is regenerated when the query is made.
//!
//! - Text: English words drawn from SciFact's corpus by their frequency there (a Zipf-like
//!   law, stop words included), a quarter of them from the chunk's topic's own words, so the
//!   postings of topic words are bursty as in real documents; 150 to 250 words per chunk. A
//!   few chunks are Chinese, built from the character pairs of the CMRC2018 corpus.
//! - Vectors: topics grouped under super-topics; a chunk's vector is its topic centre plus a
//!   point in the topic's own 12-dimensional subspace plus a little isotropic noise,
//!   normalised. So near neighbours are close along a few directions (as real embeddings are),
//!   topics of one super-topic are related (centre cosine about 0.6), unrelated chunks are
//!   near-orthogonal, and the graph has real work to do: neither uniform noise (every point
//!   equidistant) nor tight balls (any walk finds them).
//! - Queries: a target chunk; the query text is SciFact-length (3-39 words, mean 12) drawn from
//!   the target's words (a Chinese target: a run of 6 to 20 of its characters), the query
//!   vector the target's moved a little within its topic (cosine to it about 0.9).

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::Path;

/// Embedding width (all-MiniLM-L6-v2's).
pub const DIM: usize = 384;
/// Chunks per document: documents matter only for filters.
pub const CHUNKS_PER_DOC: u64 = 16;
/// Version of the generator; an index built by another version is not reused.
pub const GENERATOR_VERSION: u32 = 1;

/// One topic per this many chunks (1,000 topics at a million), at least [`MIN_TOPICS`].
const CHUNKS_PER_TOPIC: usize = 1000;
const MIN_TOPICS: usize = 8;
const SUPER_TOPICS: usize = 32;
/// Norm of a topic centre's offset from its super-topic's centre (before normalising): centres
/// of one super-topic meet at a cosine of about 1 / (1 + 0.8^2) = 0.6.
const TOPIC_SPREAD: f32 = 0.8;
/// Directions of a topic's own subspace, and the spread along each.
const SUBSPACE: usize = 12;
const SUBSPACE_SIGMA: f32 = 0.3;
/// Norm of the isotropic part of a chunk's offset from its topic centre.
const ISO_NOISE: f32 = 0.5;
/// A query's offset from its target: per subspace direction, and isotropic.
const QUERY_SUBSPACE_SIGMA: f32 = 0.12;
const QUERY_ISO_NOISE: f32 = 0.25;

/// Words per English chunk (256 LLM tokens is about 190 English words).
const MIN_WORDS: usize = 150;
const MAX_WORDS: usize = 250;
/// Character pairs per Chinese chunk (about 250 Han characters).
const MIN_PAIRS: usize = 100;
const MAX_PAIRS: usize = 150;
/// One chunk in this many is Chinese (and so is one query in this many).
const CHINESE_EVERY: u64 = 40;
/// Share of a chunk's words drawn from its topic's words.
const TOPIC_WORD_SHARE: f64 = 0.25;
/// Words per topic, taken from the middle of the frequency ranking (content words).
const TOPIC_WORDS: usize = 300;
const TOPIC_WORD_RANKS: std::ops::Range<usize> = 100..20_000;

/// SplitMix64: a small, fast generator whose stream depends only on its seed.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A stream for `(seed, stream, index)`: chunks, topics and queries each get their own.
    pub fn new(seed: u64, stream: u64, index: u64) -> Rng {
        let mut r = Rng(seed ^ stream.wrapping_mul(0xA24B_AED4_963E_E407));
        r.0 ^= index.wrapping_mul(0x9FB2_1C65_1E98_DF25);
        r.next_u64();
        r
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `lo..hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.unit() * (hi - lo) as f64) as usize
    }

    /// Standard normal (Box-Muller).
    pub fn gaussian(&mut self) -> f32 {
        let u1 = self.unit().max(f64::MIN_POSITIVE);
        let u2 = self.unit();
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }

    fn gaussian_vec(&mut self, n: usize, norm: f32) -> Vec<f32> {
        let sigma = norm / (n as f32).sqrt();
        (0..n).map(|_| self.gaussian() * sigma).collect()
    }
}

const STREAM_TEXT: u64 = 1;
const STREAM_TOPIC: u64 = 2;
const STREAM_QUERY: u64 = 3;
const STREAM_DOC: u64 = 4;
const STREAM_VECTOR: u64 = 5;

/// Words with their frequencies, sampled by inverse CDF.
struct Vocabulary {
    words: Vec<String>,
    cdf: Vec<f64>,
}

impl Vocabulary {
    /// From `(word, count)` pairs, most frequent first.
    fn new(mut counts: Vec<(String, u64)>) -> Vocabulary {
        counts.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let total: u64 = counts.iter().map(|c| c.1).sum();
        let mut acc = 0u64;
        let cdf = counts
            .iter()
            .map(|c| {
                acc += c.1;
                acc as f64 / total as f64
            })
            .collect();
        Vocabulary {
            words: counts.into_iter().map(|c| c.0).collect(),
            cdf,
        }
    }

    fn sample(&self, rng: &mut Rng) -> usize {
        let u = rng.unit();
        self.cdf
            .partition_point(|&c| c <= u)
            .min(self.words.len() - 1)
    }
}

/// The words and vectors of a synthetic collection of `chunks` chunks.
pub struct Corpus {
    pub chunks: u64,
    seed: u64,
    english: Vocabulary,
    chinese: Vocabulary,
    /// Per topic: word ranks (English and Chinese) favoured by its chunks.
    topic_words: Vec<(Vec<usize>, Vec<usize>)>,
    /// Per topic: unit centre, then `SUBSPACE` unit directions, `DIM` each.
    topic_frames: Vec<Vec<f32>>,
    /// Words per query, from SciFact's queries.
    query_lengths: Vec<usize>,
}

/// One generated query.
pub struct Query {
    pub text: String,
    pub vector: Vec<f32>,
    pub target: u64,
}

impl Corpus {
    /// Reads the word frequencies from `data` (the shared retrieval-eval folder: SciFact's and
    /// CMRC2018's `corpus.jsonl`, SciFact's `queries.jsonl`) and lays out the topics.
    pub fn new(data: &Path, chunks: u64, seed: u64) -> Result<Corpus, String> {
        let mut english: HashMap<String, u64> = HashMap::new();
        for_each_text(
            &data.join("scifact/corpus.jsonl"),
            &["title", "text"],
            |t| {
                for w in t.split(|c: char| !c.is_alphanumeric() && c != '-') {
                    let w = w.trim_matches('-');
                    if !w.is_empty() && w.is_ascii() {
                        *english.entry(w.to_lowercase()).or_default() += 1;
                    }
                }
            },
        )?;
        let mut chinese: HashMap<String, u64> = HashMap::new();
        for_each_text(&data.join("cmrc2018-zh/corpus.jsonl"), &["text"], |t| {
            let han: Vec<char> = t.chars().collect();
            for pair in han.windows(2) {
                if pair.iter().all(|&c| is_han(c)) {
                    *chinese.entry(pair.iter().collect()).or_default() += 1;
                }
            }
        })?;
        let mut query_lengths = Vec::new();
        for_each_text(&data.join("scifact/queries.jsonl"), &["text"], |t| {
            query_lengths.push(t.split_whitespace().count().max(1));
        })?;
        if english.len() < TOPIC_WORD_RANKS.end || chinese.len() < 1000 {
            return Err(format!(
                "{}: too few words ({} English, {} Chinese pairs) for the synthetic corpus",
                data.display(),
                english.len(),
                chinese.len()
            ));
        }
        let english = Vocabulary::new(english.into_iter().collect());
        let chinese = Vocabulary::new(chinese.into_iter().collect());

        let topics = (chunks as usize / CHUNKS_PER_TOPIC).max(MIN_TOPICS);
        let supers: Vec<Vec<f32>> = (0..SUPER_TOPICS)
            .map(|s| {
                let mut rng = Rng::new(seed, STREAM_TOPIC, (1 << 32) + s as u64);
                rng.gaussian_vec(DIM, 1.0)
            })
            .collect();
        let mut topic_words = Vec::with_capacity(topics);
        let mut topic_frames = Vec::with_capacity(topics);
        for t in 0..topics {
            let mut rng = Rng::new(seed, STREAM_TOPIC, t as u64);
            let mut frame = Vec::with_capacity((1 + SUBSPACE) * DIM);
            let offset = rng.gaussian_vec(DIM, TOPIC_SPREAD);
            let centre: Vec<f32> = supers[t % SUPER_TOPICS]
                .iter()
                .zip(&offset)
                .map(|(a, b)| a + b)
                .collect();
            frame.extend(normalised(centre));
            for _ in 0..SUBSPACE {
                frame.extend(normalised(rng.gaussian_vec(DIM, 1.0)));
            }
            topic_frames.push(frame);
            let en = (0..TOPIC_WORDS)
                .map(|_| rng.range(TOPIC_WORD_RANKS.start, TOPIC_WORD_RANKS.end))
                .collect();
            let zh_end = chinese.words.len().min(TOPIC_WORD_RANKS.end);
            let zh = (0..TOPIC_WORDS).map(|_| rng.range(50, zh_end)).collect();
            topic_words.push((en, zh));
        }
        Ok(Corpus {
            chunks,
            seed,
            english,
            chinese,
            topic_words,
            topic_frames,
            query_lengths,
        })
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    pub fn topics(&self) -> usize {
        self.topic_frames.len()
    }

    /// A document's topic: all its chunks share it.
    fn topic(&self, doc_id: u64) -> usize {
        Rng::new(self.seed, STREAM_DOC, doc_id).range(0, self.topics())
    }

    pub fn is_chinese(chunk_id: u64) -> bool {
        chunk_id % CHINESE_EVERY == CHINESE_EVERY - 1
    }

    /// The document of chunk `chunk_id`.
    pub fn doc(chunk_id: u64) -> u64 {
        chunk_id / CHUNKS_PER_DOC
    }

    /// The text of chunk `chunk_id` (0-based), the same for the same seed however often it is
    /// made.
    pub fn text(&self, chunk_id: u64) -> String {
        let topic = self.topic(Corpus::doc(chunk_id));
        let mut rng = Rng::new(self.seed, STREAM_TEXT, chunk_id);
        if Corpus::is_chinese(chunk_id) {
            self.chinese_text(&mut rng, topic)
        } else {
            self.english_text(&mut rng, topic)
        }
    }

    /// The unit vector of chunk `chunk_id`: its topic's centre + a point of the topic's
    /// subspace + isotropic noise, normalised.
    pub fn vector(&self, chunk_id: u64) -> Vec<f32> {
        let topic = self.topic(Corpus::doc(chunk_id));
        let mut rng = Rng::new(self.seed, STREAM_VECTOR, chunk_id);
        let frame = &self.topic_frames[topic];
        let mut v = frame[..DIM].to_vec();
        for d in 0..SUBSPACE {
            let g = rng.gaussian() * SUBSPACE_SIGMA;
            let dir = &frame[(1 + d) * DIM..(2 + d) * DIM];
            v.iter_mut().zip(dir).for_each(|(x, y)| *x += g * y);
        }
        let noise = rng.gaussian_vec(DIM, ISO_NOISE);
        v.iter_mut().zip(&noise).for_each(|(x, y)| *x += y);
        normalised(v)
    }

    fn english_text(&self, rng: &mut Rng, topic: usize) -> String {
        let words = rng.range(MIN_WORDS, MAX_WORDS + 1);
        let mut text = String::with_capacity(words * 8);
        let mut sentence = 0;
        for i in 0..words {
            let rank = if rng.unit() < TOPIC_WORD_SHARE {
                let own = &self.topic_words[topic].0;
                own[zipf_index(rng, own.len())]
            } else {
                self.english.sample(rng)
            };
            let word = &self.english.words[rank];
            if sentence == 0 {
                if i > 0 {
                    text.push_str(". ");
                }
                let mut cs = word.chars();
                if let Some(c) = cs.next() {
                    text.extend(c.to_uppercase());
                    text.push_str(cs.as_str());
                }
                sentence = rng.range(12, 28);
            } else {
                text.push(' ');
                text.push_str(word);
            }
            sentence -= 1;
        }
        text.push('.');
        text
    }

    fn chinese_text(&self, rng: &mut Rng, topic: usize) -> String {
        let pairs = rng.range(MIN_PAIRS, MAX_PAIRS + 1);
        let mut text = String::with_capacity(pairs * 7);
        for i in 0..pairs {
            let rank = if rng.unit() < TOPIC_WORD_SHARE {
                let own = &self.topic_words[topic].1;
                own[zipf_index(rng, own.len())]
            } else {
                self.chinese.sample(rng)
            };
            text.push_str(&self.chinese.words[rank]);
            if i + 1 < pairs && rng.unit() < 0.08 {
                text.push(if rng.unit() < 0.6 { '，' } else { '。' });
            }
        }
        text.push('。');
        text
    }

    /// Query `index` of stream `stream` (measured queries and warm-up queries use different
    /// streams): a target chunk, words from it, and a vector near it.
    pub fn query(&self, stream: u64, index: u64) -> Query {
        let mut rng = Rng::new(self.seed, STREAM_QUERY + (stream << 8), index);
        let target = rng.next_u64() % self.chunks;
        let target_text = self.text(target);
        let length = self.query_lengths[rng.range(0, self.query_lengths.len())];
        let text = if Corpus::is_chinese(target) {
            // A run of the target's characters, as a Chinese question quotes its answer's
            // words: two characters per English word, 6 to 20.
            let chars: Vec<char> = target_text.chars().filter(|&c| is_han(c)).collect();
            let len = (2 * length).clamp(6, 20).min(chars.len());
            let at = rng.range(0, chars.len() - len + 1);
            chars[at..at + len].iter().collect()
        } else {
            let words: Vec<&str> = target_text
                .split([' ', '.'])
                .filter(|w| !w.is_empty())
                .collect();
            (0..length)
                .map(|_| words[rng.range(0, words.len())].to_lowercase())
                .collect::<Vec<_>>()
                .join(" ")
        };
        let frame = &self.topic_frames[self.topic(Corpus::doc(target))];
        let mut v = self.vector(target);
        for d in 0..SUBSPACE {
            let g = rng.gaussian() * QUERY_SUBSPACE_SIGMA;
            let dir = &frame[(1 + d) * DIM..(2 + d) * DIM];
            v.iter_mut().zip(dir).for_each(|(x, y)| *x += g * y);
        }
        let noise = rng.gaussian_vec(DIM, QUERY_ISO_NOISE);
        v.iter_mut().zip(&noise).for_each(|(x, y)| *x += y);
        Query {
            text,
            vector: normalised(v),
            target,
        }
    }
}

/// An index in `0..n` by a Zipf law (exponent 1): a topic's first words are its commonest.
fn zipf_index(rng: &mut Rng, n: usize) -> usize {
    // Inverse CDF of the continuous 1/x law on [1, n + 1).
    let x = ((n as f64 + 1.0).ln() * rng.unit()).exp();
    (x as usize - 1).min(n - 1)
}

fn normalised(mut v: Vec<f32>) -> Vec<f32> {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.iter_mut().for_each(|x| *x /= norm);
    v
}

fn is_han(c: char) -> bool {
    matches!(c as u32, 0x3400..=0x4DBF | 0x4E00..=0x9FFF)
}

/// Calls `f` with the string fields `keys` of every line of a JSON-lines file.
fn for_each_text(path: &Path, keys: &[&str], mut f: impl FnMut(&str)) -> Result<(), String> {
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    for line in BufReader::new(file).lines() {
        let line = line.map_err(|e| format!("{}: {e}", path.display()))?;
        let v: serde_json::Value =
            serde_json::from_str(&line).map_err(|e| format!("{}: {e}", path.display()))?;
        for k in keys {
            if let Some(t) = v[*k].as_str() {
                f(t);
            }
        }
    }
    Ok(())
}

/// Real user questions for timing the query embedding: SciFact's queries, in file order.
pub fn real_queries(data: &Path) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for_each_text(&data.join("scifact/queries.jsonl"), &["text"], |t| {
        out.push(t.to_string())
    })?;
    Ok(out)
}
