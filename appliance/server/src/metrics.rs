//! Prometheus metrics: requests and latency by route and status, time to first token, the
//! generation queue, KV tier hits and bytes, the ingestion queues. Listed with types and units in docs/engramd.md.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

/// Request latency buckets in seconds: 1 ms (health, auth cache hits) to 2 minutes (long
/// generations).
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
/// Time-to-first-token buckets in seconds: fused prefill of a small model takes tens of
/// milliseconds, a full prefill of a long prompt on a CPU several seconds. Steps of about 1.5x
/// (1-2-3-5-7.5 per decade), so a quantile read from them (the dashboard's p50 and p95) is off
/// by at most a third of the value, not the factor of two of doubling buckets.
const TTFT_BUCKETS: &[f64] = &[
    0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
    2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0,
];

/// Time-per-output-token buckets in seconds: one decode step, from a batch of one on a small
/// model (tens of milliseconds) to a large batch on a big model.
const TPOT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0,
];
/// Sequences per decode step.
const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0];

/// Every metric the daemon exports, in one registry.
pub struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub latency: HistogramVec,
    pub ttft: HistogramVec,
    /// Seconds per output token: the decode step that produced it (shared by the batch).
    pub tpot: HistogramVec,
    /// Sequences per decode step (continuous batching).
    pub batch_size: Histogram,
    pub queue_depth: IntGauge,
    pub rejected: IntCounterVec,
    pub kv_hits: IntCounterVec,
    pub kv_misses: IntCounterVec,
    /// Stored chunk KV found but not used, by reason (`checksum`, `version`, `fingerprint`,
    /// `layout`): disk rot and model changes show here, not as hits.
    pub kv_rejected: IntCounterVec,
    pub kv_bytes_read: IntCounterVec,
    pub generated_tokens: IntCounterVec,
    /// Answers whose text an answer rule changed, by rule (`engram_rag::AnswerRule`).
    pub answer_rules: IntCounterVec,
    /// Prompt prefix tokens whose KV came from the prefix cache (`hit`: a system prompt or an
    /// earlier turn of the conversation) or was computed (`miss`).
    pub prefix_tokens: IntCounterVec,
    /// Documents accepted and not yet done (`documents`), chunks waiting for their KV
    /// (`chunk_kv`).
    pub ingest_pending: IntGaugeVec,
    /// Ingestion outcomes: documents `done`, `failed`; chunk KV `kv_computed`, `kv_present`,
    /// `kv_failed` (not stored: computed when a question first needs it).
    pub ingested: IntCounterVec,
    /// Chunks through each ingestion stage: `chunked` and `embedded` (by the preparer),
    /// `indexed` (added to the indexes).
    pub ingest_chunks: IntCounterVec,
    /// Free bytes on the data directory's disk, and whether the daemon is read-only for lack
    /// of them.
    pub storage_available: IntGauge,
    /// GPUs usable by the GPU path, found at start.
    pub gpu_devices: IntGauge,
    pub gpu_memory_total: IntGaugeVec,
    pub storage_read_only: IntGauge,
}

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                "engram_http_requests_total",
                "HTTP requests by route and status",
            ),
            &["route", "status"],
        )
        .expect("valid metric");
        let latency = HistogramVec::new(
            HistogramOpts::new(
                "engram_http_request_duration_seconds",
                "HTTP request latency (until the response head; streams end later)",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["route", "status"],
        )
        .expect("valid metric");
        let ttft = HistogramVec::new(
            HistogramOpts::new(
                "engram_time_to_first_token_seconds",
                "From enqueueing a generation to its first token",
            )
            .buckets(TTFT_BUCKETS.to_vec()),
            &["kind"],
        )
        .expect("valid metric");
        let tpot = HistogramVec::new(
            HistogramOpts::new(
                "engram_time_per_output_token_seconds",
                "Decode step time per generated token (one step serves the whole batch)",
            )
            .buckets(TPOT_BUCKETS.to_vec()),
            &["kind"],
        )
        .expect("valid metric");
        let batch_size = Histogram::with_opts(
            HistogramOpts::new(
                "engram_decode_batch_size",
                "Sequences decoded together per step",
            )
            .buckets(BATCH_BUCKETS.to_vec()),
        )
        .expect("valid metric");
        let queue_depth = IntGauge::new(
            "engram_generation_queue_depth",
            "Generation jobs waiting for the engine",
        )
        .expect("valid metric");
        let rejected = IntCounterVec::new(
            Opts::new(
                "engram_rejected_total",
                "Requests refused at the API edge, by reason",
            ),
            &["reason"],
        )
        .expect("valid metric");
        let kv = |name: &str, help: &str| {
            IntCounterVec::new(Opts::new(name, help), &["tier"]).expect("valid metric")
        };
        let kv_hits = kv(
            "engram_kv_hits_total",
            "Chunk KV blobs found and used, by tier",
        );
        let kv_rejected = IntCounterVec::new(
            Opts::new(
                "engram_kv_rejected_total",
                "Chunk KV blobs found but rejected and recomputed, by reason",
            ),
            &["reason"],
        )
        .expect("valid metric");
        let kv_misses = kv(
            "engram_kv_misses_total",
            "Chunk KV blobs not found, by tier",
        );
        let kv_bytes_read = kv("engram_kv_read_bytes_total", "Chunk KV bytes read, by tier");
        let generated_tokens = IntCounterVec::new(
            Opts::new("engram_generated_tokens_total", "Tokens generated, by kind"),
            &["kind"],
        )
        .expect("valid metric");
        let answer_rules = IntCounterVec::new(
            Opts::new(
                "engram_answer_rule_total",
                "Answers whose text an answer rule changed, by rule",
            ),
            &["rule"],
        )
        .expect("valid metric");
        // Every rule from the start, at 0: a rule that never fires is seen not to.
        for rule in engram_rag::AnswerRule::ALL {
            answer_rules.with_label_values(&[rule.name()]);
        }
        let ingest_pending = IntGaugeVec::new(
            Opts::new(
                "engram_ingest_pending",
                "Work waiting in the ingestion queues: documents, chunk_kv",
            ),
            &["queue"],
        )
        .expect("valid metric");
        let ingested = IntCounterVec::new(
            Opts::new(
                "engram_ingested_total",
                "Ingestion outcomes: documents done or failed; chunk KV computed, present or failed",
            ),
            &["outcome"],
        )
        .expect("valid metric");
        let ingest_chunks = IntCounterVec::new(
            Opts::new(
                "engram_ingest_chunks_total",
                "Chunks through each ingestion stage: chunked, embedded, indexed",
            ),
            &["stage"],
        )
        .expect("valid metric");
        let storage_available = IntGauge::new(
            "engram_storage_available_bytes",
            "Free bytes on the disk of the data directory",
        )
        .expect("valid metric");
        let storage_read_only = IntGauge::new(
            "engram_storage_read_only",
            "1 while the data directory's disk is short of its reserve (uploads and ingestion paused)",
        )
        .expect("valid metric");
        let gpu_devices = IntGauge::new(
            "engram_gpu_devices",
            "GPUs the GPU path can use, found at start (0 without a driver or the cuda build)",
        )
        .expect("valid metric");
        let gpu_memory_total = IntGaugeVec::new(
            Opts::new(
                "engram_gpu_memory_total_bytes",
                "Memory of each GPU found at start",
            ),
            &["device"],
        )
        .expect("valid metric");
        let prefix_tokens = IntCounterVec::new(
            Opts::new(
                "engram_prefix_cache_tokens_total",
                "Prompt prefix tokens served from the prefix cache (hit) or computed (miss)",
            ),
            &["result"],
        )
        .expect("valid metric");
        for c in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(prefix_tokens.clone()),
            Box::new(storage_available.clone()),
            Box::new(storage_read_only.clone()),
            Box::new(gpu_devices.clone()),
            Box::new(gpu_memory_total.clone()),
            Box::new(ingest_chunks.clone()),
            Box::new(ingest_pending.clone()),
            Box::new(ingested.clone()),
            Box::new(latency.clone()),
            Box::new(ttft.clone()),
            Box::new(tpot.clone()),
            Box::new(batch_size.clone()),
            Box::new(queue_depth.clone()),
            Box::new(rejected.clone()),
            Box::new(kv_hits.clone()),
            Box::new(kv_misses.clone()),
            Box::new(kv_rejected.clone()),
            Box::new(kv_bytes_read.clone()),
            Box::new(generated_tokens.clone()),
            Box::new(answer_rules.clone()),
        ] {
            registry.register(c).expect("unique metric names");
        }
        Metrics {
            registry,
            requests,
            latency,
            ttft,
            tpot,
            batch_size,
            queue_depth,
            rejected,
            kv_hits,
            kv_misses,
            kv_rejected,
            kv_bytes_read,
            generated_tokens,
            answer_rules,
            prefix_tokens,
            ingest_pending,
            ingested,
            ingest_chunks,
            storage_available,
            storage_read_only,
            gpu_devices,
            gpu_memory_total,
        }
    }

    /// Folds a KV store and chunk store snapshot into the counters (both count cumulatively;
    /// `last` is the previous snapshot). A blob a tier served but the chunk store rejected is
    /// counted as rejected, not as a hit.
    pub fn record_kv(
        &self,
        now: &(engram_kvstore::StoreMetrics, engram_fusion::ChunkCounts),
        last: &(engram_kvstore::StoreMetrics, engram_fusion::ChunkCounts),
    ) {
        let (chunks, chunks_last) = (&now.1, &last.1);
        for (tier, n, l, rejected) in [
            (
                "dram",
                &now.0.dram,
                &last.0.dram,
                chunks.rejected_dram - chunks_last.rejected_dram,
            ),
            (
                "nvme",
                &now.0.nvme,
                &last.0.nvme,
                chunks.rejected_nvme - chunks_last.rejected_nvme,
            ),
        ] {
            let (Some(n), l) = (n, l) else { continue };
            let d = |f: fn(&engram_kvstore::TierMetrics) -> u64| {
                f(n).saturating_sub(l.as_ref().map_or(0, f))
            };
            self.kv_hits
                .with_label_values(&[tier])
                .inc_by(d(|m| m.hits).saturating_sub(rejected));
            self.kv_misses
                .with_label_values(&[tier])
                .inc_by(d(|m| m.misses));
            self.kv_bytes_read
                .with_label_values(&[tier])
                .inc_by(d(|m| m.bytes_read));
        }
        for (i, reason) in engram_fusion::Reject::ALL.iter().enumerate() {
            let d = chunks.rejected[i] - chunks_last.rejected[i];
            if d > 0 {
                self.kv_rejected
                    .with_label_values(&[reason.name()])
                    .inc_by(d);
            }
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding cannot fail");
        String::from_utf8(buf).expect("prometheus text is UTF-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
