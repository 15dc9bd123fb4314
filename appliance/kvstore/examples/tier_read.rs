//! NVMe tier read throughput: io_uring vs plain `pread`, O_DIRECT vs buffered.
//!
//! ```text
//! cargo run --release -p engram-kvstore --example tier_read -- <dir> [blobs=40] [rounds=3]
//! ```
//!
//! Writes `blobs` chunk-KV blobs of a 256-token SmolLM2-135M chunk (30 layers x 3 KV heads x 64
//! dims x 256 tokens x K and V x f16 = 5.9 MB each) into an `NvmeTier` in `<dir>`, then reads them
//! all back in `get_many` batches of 10 (a prompt's worth of chunks) under each I/O mode, and
//! prints GB/s. Buffered reads are measured twice: "cold" after dropping the blobs' pages from
//! the page cache with `posix_fadvise(DONTNEED)` (no root needed), and "warm" straight after,
//! when they come from the page cache. O_DIRECT reads bypass the page cache either way. The
//! directory is left in place; delete it afterwards.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use engram_kvstore::{
    drop_cached_pages, encode, BlobKey, ChunkKv, IoMode, KvDtype, KvLayout, KvTier,
    ModelFingerprint, NvmeOptions, NvmeTier,
};
use half::f16;

/// Chunks per `get_many`: about what one prompt's retrieval fuses.
const BATCH: usize = 10;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(
        args.next()
            .ok_or("usage: tier_read <dir> [blobs=40] [rounds=3]")?,
    );
    let blobs: usize = args.next().map_or(Ok(40), |s| s.parse())?;
    let rounds: usize = args.next().map_or(Ok(3), |s| s.parse())?;

    let layout = KvLayout {
        n_layer: 30,
        n_head_kv: 3,
        head_dim: 64,
        n_tokens: 256,
    };
    let model = ModelFingerprint(*b"tier_read bench!");
    let n = layout.values_per_side();
    let k: Vec<f16> = (0..n)
        .map(|i| f16::from_f32((i % 997) as f32 / 97.0))
        .collect();
    let v: Vec<f16> = (0..n)
        .map(|i| f16::from_f32((i % 991) as f32 / -89.0))
        .collect();

    let budget = 1u64 << 40;
    let mut keys = Vec::with_capacity(blobs);
    let mut total_bytes = 0u64;
    {
        let tier = NvmeTier::open(
            &dir,
            NvmeOptions {
                budget_bytes: budget,
                io: IoMode::Plain,
                direct: false,
                reserve_free_bytes: 0,
            },
        )?;
        let start = Instant::now();
        for b in 0..blobs {
            let tokens: Vec<u32> = (0..256).map(|t| (b * 256 + t) as u32).collect();
            let kv = ChunkKv::new(layout, tokens, k.clone(), v.clone())?;
            let bytes = encode(&kv, &model, KvDtype::F16);
            let key = BlobKey::new(&model, KvDtype::F16, &kv.tokens);
            tier.put(&key, &bytes)?;
            total_bytes += bytes.len() as u64;
            keys.push(key);
        }
        let secs = start.elapsed().as_secs_f64();
        println!(
            "wrote {blobs} blobs of {:.2} MB in {secs:.2} s: {:.2} GB/s (encode + write + fsync + rename)",
            total_bytes as f64 / blobs as f64 / 1e6,
            total_bytes as f64 / secs / 1e9
        );
    }

    println!(
        "reads in batches of {BATCH}, best of {rounds} rounds \
         (*latency: batch start to blob in hand, log2-bucket upper bound, all rounds):"
    );
    println!(
        "{:<10} {:<9} {:<6} {:>8} {:>10} {:>10}",
        "io", "open", "cache", "GB/s", "p50 us*", "p99 us*"
    );
    for io in [IoMode::Plain, IoMode::Uring] {
        for direct in [false, true] {
            let caches: &[&str] = if direct {
                &["bypass"]
            } else {
                &["cold", "warm"]
            };
            for &cache in caches {
                // A fresh tier per row, so its latency histogram holds only this row's reads.
                let opts = NvmeOptions {
                    budget_bytes: budget,
                    io,
                    direct,
                    reserve_free_bytes: 0,
                };
                let tier = match NvmeTier::open(&dir, opts) {
                    Ok(t) => t,
                    Err(e) => {
                        println!("{io:?} skipped: {e}");
                        continue;
                    }
                };
                let mut best = Duration::MAX;
                for _ in 0..rounds {
                    if cache != "warm" {
                        for key in &keys {
                            drop_cached_pages(&tier.blob_path(key))?;
                        }
                    }
                    let start = Instant::now();
                    let mut read = 0u64;
                    for batch in keys.chunks(BATCH) {
                        for r in tier.get_many(batch) {
                            read += r?.ok_or("blob missing")?.len() as u64;
                        }
                    }
                    assert_eq!(read, total_bytes);
                    best = best.min(start.elapsed());
                }
                let m = tier.metrics();
                println!(
                    "{:<10} {:<9} {:<6} {:>8.2} {:>10} {:>10}",
                    tier.io_mode(),
                    if tier.direct_io() {
                        "O_DIRECT"
                    } else {
                        "buffered"
                    },
                    cache,
                    total_bytes as f64 / best.as_secs_f64() / 1e9,
                    m.read_latency_quantile_us(0.5),
                    m.read_latency_quantile_us(0.99),
                );
            }
        }
    }
    Ok(())
}
