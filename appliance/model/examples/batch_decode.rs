//! Decode throughput against batch size: each of `n` sequences holds `--context` tokens, then
//! `--steps` batched decode steps run over all of them ([`Model::forward_batch`]). Prints the
//! best step time over `--reps` alternating repetitions and the aggregate tokens/s for each
//! batch size, and the ratio to a batch of one, so the benefit of continuous batching is
//! measured in one run on one (shared, noisy) machine.
//!
//! ```sh
//! cargo run --release -p engram-model --example batch_decode -- models/SmolLM2-135M-Instruct.Q4_1.gguf \
//!     [--threads 2] [--context 512] [--steps 32] [--reps 5] [--batches 1,2,4,8,16]
//! ```

use std::time::Instant;

use engram_model::{KvCache, Logits, Model, Sequence};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or("usage: batch_decode MODEL.gguf [flags]")?;
    let (mut threads, mut context, mut steps, mut reps) = (2usize, 512usize, 32usize, 5usize);
    let mut batches = vec![1usize, 2, 4, 8, 16];
    while let Some(flag) = args.next() {
        let v = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--threads" => threads = v.parse()?,
            "--context" => context = v.parse()?,
            "--steps" => steps = v.parse()?,
            "--reps" => reps = v.parse()?,
            "--batches" => batches = v.split(',').map(str::parse).collect::<Result<_, _>>()?,
            _ => return Err(format!("unknown flag {flag}").into()),
        }
    }
    let model = Model::load(&path, threads)?;
    let vocab = model.config().vocab_size as u32;
    // One prefilled context, copied into every sequence's cache.
    let prompt: Vec<u32> = (0..context as u32)
        .map(|i| 100 + (i * 7919) % (vocab - 200))
        .collect();
    let positions: Vec<i32> = (0..context as i32).collect();
    let mut base = model.new_cache(context);
    let t = std::time::Instant::now();
    model.prefill(&prompt, &positions, &mut base, Logits::None)?;
    println!(
        "prefill of the context: {:.1} tok/s",
        context as f64 / t.elapsed().as_secs_f64()
    );

    println!("threads={threads} context={context} steps={steps} reps={reps} (best of reps, batch sizes alternating)");
    let mut best = vec![f64::INFINITY; batches.len()];
    for _ in 0..reps {
        for (bi, &n) in batches.iter().enumerate() {
            let mut caches: Vec<KvCache> = (0..n)
                .map(|_| {
                    let mut kv = model.new_cache(context + steps);
                    kv.append_from(&base, 0..context).map(|_| kv)
                })
                .collect::<Result<_, _>>()?;
            let start = Instant::now();
            for s in 0..steps {
                let tokens: Vec<[u32; 1]> = (0..n).map(|i| [(500 + i * 31 + s) as u32]).collect();
                let pos = [(context + s) as i32];
                let mut seqs: Vec<Sequence<'_>> = caches
                    .iter_mut()
                    .zip(&tokens)
                    .map(|(kv, t)| Sequence {
                        tokens: t,
                        positions: &pos,
                        kv,
                    })
                    .collect();
                model.forward_batch(&mut seqs, Logits::Last)?;
            }
            best[bi] = best[bi].min(start.elapsed().as_secs_f64() / steps as f64);
        }
    }
    println!("batch  step_ms  tok/s   vs_batch_1");
    let one = batches.iter().position(|&n| n == 1).map(|i| 1.0 / best[i]);
    for (&n, &step) in batches.iter().zip(&best) {
        let rate = n as f64 / step;
        let ratio = one.map_or_else(|| "-".into(), |o| format!("{:.2}x", rate / o));
        println!("{n:>5}  {:>7.1}  {rate:>6.1}  {ratio:>6}", step * 1e3);
    }
    Ok(())
}
