//! Conversation benchmark for a running `engramd` (not a test; see `bench/conversation.sh`):
//! the time to first token of each turn of a five-turn chat, with the history's KV reused from
//! the prefix cache against the same prompt prefilled in full.
//!
//! For each repetition, a conversation of `--turns` user questions (its system message tagged
//! with the repetition at its start, so no cache carries over between repetitions). At turn k:
//! 1. `reused`: the conversation so far with `max_tokens: 1`. Its latency is prefill plus one
//!    sampled token (the time to first token); `cached_tokens` says how much came from the cache.
//! 2. `full`: the same messages with the system message's tag changed, so nothing past the
//!    template's opening is cached: the whole prompt is prefilled.
//! 3. The turn itself (`--max-tokens`, greedy), whose answer joins the history (and whose KV the
//!    cache keeps for turn k + 1).
//!
//! Prints a table of medians per turn and a last line
//! `RATIO turn5_ttft_full_over_reused=X cached_fraction=Y`.
//!
//! ```sh
//! cargo run --release -p engram-server --example conversation -- --url http://127.0.0.1:8080 \
//!     --key "$KEY" [--reps 5 --turns 5 --max-tokens 64]
//! ```

use std::net::SocketAddr;
use std::time::Instant;

use serde_json::{json, Value};

#[path = "support/http.rs"]
mod http;
use http::{addr_of, post};

const SYSTEM: &str = "You are a patient travel assistant for a company's employees. Answer in a \
    few sentences, mention prices in euros, and suggest one practical tip per answer.";

const QUESTIONS: &[&str] = &[
    "I am travelling to Lisbon for a conference next month. What should I know?",
    "Which neighbourhood is best for a hotel near the conference centre?",
    "How do I get there from the airport?",
    "What should I eat while I am there?",
    "Can you summarise the plan for me?",
    "What should I pack?",
    "Anything to avoid?",
];

struct Args {
    addr: SocketAddr,
    key: String,
    reps: usize,
    turns: usize,
    max_tokens: usize,
}

fn args() -> Args {
    let mut a = Args {
        addr: "127.0.0.1:8080".parse().unwrap(),
        key: std::env::var("ENGRAM_KEY").unwrap_or_default(),
        reps: 5,
        turns: 5,
        max_tokens: 64,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--url" => a.addr = addr_of(&val()),
            "--key" => a.key = val(),
            "--reps" => a.reps = val().parse().unwrap(),
            "--turns" => a.turns = val().parse().unwrap(),
            "--max-tokens" => a.max_tokens = val().parse().unwrap(),
            _ => panic!("unknown flag {flag}; see the source's header"),
        }
    }
    assert!(
        a.turns <= QUESTIONS.len(),
        "at most {} turns",
        QUESTIONS.len()
    );
    a
}

/// One chat completion: (seconds, response).
fn chat(a: &Args, messages: &[Value], max_tokens: usize) -> (f64, Value) {
    let body = json!({"messages": messages, "max_tokens": max_tokens, "temperature": 0});
    let t = Instant::now();
    let (status, v) = post(a.addr, &a.key, "/v1/chat/completions", &body).expect("engramd answers");
    assert_eq!(status, 200, "{v}");
    (t.elapsed().as_secs_f64(), v)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let a = args();
    // Per turn: (reused s, full s, prompt tokens, cached tokens) per repetition.
    let mut turns: Vec<Vec<(f64, f64, u64, u64)>> = vec![Vec::new(); a.turns];
    for rep in 0..a.reps {
        // The tag comes first, so a differently tagged prompt shares no more than the
        // template's opening with this one.
        let system = |tag: &str| json!({"role": "system", "content": format!("({tag}) {SYSTEM}")});
        let mut messages = vec![system(&format!("conversation {rep}"))];
        for (k, q) in QUESTIONS.iter().take(a.turns).enumerate() {
            messages.push(json!({"role": "user", "content": q}));
            let (reused, v) = chat(&a, &messages, 1);
            let usage = &v["usage"];
            let mut fresh = messages.clone();
            fresh[0] = system(&format!("conversation {rep}, turn {k}, uncached"));
            let (full, _) = chat(&a, &fresh, 1);
            turns[k].push((
                reused,
                full,
                usage["prompt_tokens"].as_u64().unwrap_or(0),
                usage["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0),
            ));
            let (_, v) = chat(&a, &messages, a.max_tokens);
            let answer = v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or("")
                .to_owned();
            messages.push(json!({"role": "assistant", "content": answer}));
        }
    }
    println!("turn  prompt  cached  ttft_reused_ms  ttft_full_ms  full/reused");
    let mut last = (0.0, 0.0);
    for (k, runs) in turns.iter().enumerate() {
        let reused = median(runs.iter().map(|r| r.0).collect()) * 1e3;
        let full = median(runs.iter().map(|r| r.1).collect()) * 1e3;
        let prompt = median(runs.iter().map(|r| r.2 as f64).collect());
        let cached = median(runs.iter().map(|r| r.3 as f64).collect());
        println!(
            "{:>4}  {prompt:>6.0}  {cached:>6.0}  {reused:>14.1}  {full:>12.1}  {:>11.2}",
            k + 1,
            full / reused
        );
        last = (full / reused, cached / prompt.max(1.0));
    }
    println!(
        "RATIO turn{}_ttft_full_over_reused={:.2} cached_fraction={:.2}",
        a.turns, last.0, last.1
    );
}
