//! `/console/`: the machine, the hardware profile, the models, the KV tiers, traffic over
//! the last hour (SVG charts from the sampler's history) and ingestion in progress.

use askama::Template;
use axum::extract::{Query, State};
use axum::response::Response;
use axum::Extension;
use engram_kb::Stage;
use serde::Deserialize;

use crate::api::AppState;
use crate::console::chart;
use crate::console::i18n::Catalog;
use crate::console::sampler::{self, counter_of, Sample};
use crate::console::view::{bytes, datetime, html, Chrome, Failure, Viewer};

/// Documents in progress listed on the dashboard (the documents page has them all).
const IN_PROGRESS_SHOWN: usize = 20;

pub struct Disk {
    pub mount: String,
    pub total: String,
    pub used: String,
    pub percent: u64,
}

pub struct Tier {
    pub name: &'static str,
    pub budget: String,
    pub hits: u64,
    pub misses: u64,
    pub hit_rate: String,
    pub read: String,
}

pub struct InProgress {
    pub collection: String,
    pub name: String,
    pub id: u64,
    pub stage: &'static str,
    /// The stage's catalog key (`stage.parsing`, ...).
    pub stage_key: String,
    pub since: String,
}

pub struct Chart {
    pub title_key: &'static str,
    pub now: String,
    pub svg: String,
}

#[derive(Template)]
#[template(path = "dashboard.html", config = "../../web/askama.toml")]
pub struct DashboardPage {
    pub c: Chrome,
    pub cores: usize,
    pub gpus: usize,
    /// Whether this build has GPU support, and why no GPU is usable when none is (the
    /// driver's own words).
    pub cuda_compiled: bool,
    pub gpu_reason: String,
    /// Where generation runs: `cpu`, or the GPU and its placement.
    pub generation: String,
    /// Why it runs on the CPU, when it does and GPUs were found.
    pub generation_reason: String,
    pub cpu: String,
    pub memory_used: String,
    pub memory_total: String,
    pub memory_percent: u64,
    pub disks: Vec<Disk>,
    pub profile: String,
    pub profile_description: String,
    pub threads: usize,
    pub queue_capacity: usize,
    pub batch_size: usize,
    pub llm: String,
    pub context_length: usize,
    pub embedder: String,
    pub embed_dim: usize,
    pub policy: String,
    pub kv_dtype: String,
    pub tiers: Vec<Tier>,
    pub qps: String,
    pub ttft_p50: String,
    pub ttft_p95: String,
    pub tpot_p50: String,
    pub tpot_p95: String,
    pub queue_depth: i64,
    pub generated: u64,
    /// Generation jobs turned away because the queue was full (`engram_rejected_total`'s
    /// `queue_full`), not requests refused for other reasons.
    pub rejected: u64,
    /// Requests refused for a missing or wrong key, or too many of them
    /// (`unauthorized`, `auth_rate_limited`): no answer was dropped.
    pub auth_refused: u64,
    pub charts: Vec<Chart>,
    pub pending_documents: i64,
    pub pending_chunk_kv: i64,
    pub in_progress: Vec<InProgress>,
    pub sampled_at: String,
}

#[derive(Deserialize)]
pub struct FlashQuery {
    pub ok: Option<String>,
}

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "–".to_owned(), |s| format!("{:.0} ms", s * 1e3))
}

/// `GET /console/`.
pub async fn page(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    Query(q): Query<FlashQuery>,
) -> Result<Response, Failure> {
    let con = &s.console;
    let m = &s.metrics;
    let f = &con.facts;
    let mut hist = con.history.snapshot();
    let mut sys = sysinfo::System::new();
    // The headline numbers are read now (the ring may be up to 10 s old); CPU use needs two
    // readings apart, so it comes from the ring.
    let mut now = sampler::sample(m, &mut sys);
    if hist.len() < 2 {
        hist.push(now.clone());
    }
    let last = hist.last().cloned().unwrap_or_default();
    now.cpu_percent = last.cpu_percent;
    let memory_total = sys.total_memory();
    let disks = sysinfo::Disks::new_with_refreshed_list()
        .iter()
        .filter(|d| d.total_space() > 0)
        .map(|d| {
            let used = d.total_space().saturating_sub(d.available_space());
            Disk {
                mount: d.mount_point().display().to_string(),
                total: bytes(d.total_space()),
                used: bytes(used),
                percent: used * 100 / d.total_space(),
            }
        })
        .collect();
    let tiers = [("dram", f.kv_dram_mib << 20), ("nvme", f.kv_nvme_gib << 30)]
        .into_iter()
        .filter(|(name, _)| s.engine.info.kv_tiers.contains(name))
        .map(|(name, budget)| {
            let hits = counter_of(&m.kv_hits, name);
            let misses = counter_of(&m.kv_misses, name);
            Tier {
                name,
                budget: bytes(budget),
                hits,
                misses,
                hit_rate: rate(hits, misses),
                read: bytes(counter_of(&m.kv_bytes_read, name)),
            }
        })
        .chain(std::iter::once({
            // The prefix cache, counted in prompt tokens (system prompts, earlier turns).
            let hits = counter_of(&m.prefix_tokens, "hit");
            let misses = counter_of(&m.prefix_tokens, "miss");
            Tier {
                name: "prefix",
                budget: bytes(f.prefix_cache_mib << 20),
                hits,
                misses,
                hit_rate: rate(hits, misses),
                read: "–".into(),
            }
        }))
        .collect();
    // QPS over the last minute (6 samples back), TTFT and TPOT percentiles (the engine's
    // histograms: API and console traffic alike) over the hour kept.
    let first = hist.first().cloned().unwrap_or_default();
    let back = &hist[hist.len().saturating_sub(6)];
    let dt = (now.at_ms.saturating_sub(back.at_ms)) as f64 / 1e3;
    let qps = if dt > 0.0 {
        format!("{:.2}", (now.requests - back.requests) / dt)
    } else {
        "–".into()
    };
    let charts = charts(&hist, v.lang.catalog());
    // The documents in the pipeline, looked up only while the queue has any: a scan of every
    // document on each (live-refreshed) render would load the knowledge-base thread for
    // nothing on a large, idle appliance.
    let pending_documents = m.ingest_pending.with_label_values(&["documents"]).get();
    let in_progress = if pending_documents == 0 {
        Vec::new()
    } else {
        s.kb.call(|kb| -> engram_kb::Result<Vec<InProgress>> {
            let mut out = Vec::new();
            for c in kb.collections()? {
                for d in kb.documents(&c.name)? {
                    if !matches!(d.stage, Stage::Done | Stage::Failed) {
                        out.push(InProgress {
                            collection: c.name.clone(),
                            name: d.name.clone(),
                            id: d.id,
                            stage: d.stage.name(),
                            stage_key: format!("stage.{}", d.stage.name()),
                            since: d
                                .stages
                                .last()
                                .map_or_else(String::new, |t| datetime(t.at_ms)),
                        });
                    }
                }
            }
            Ok(out)
        })
        .await??
    };
    let page = DashboardPage {
        c: v.chrome("dashboard", "nav.dashboard", "/console/")
            .with_flash(q.ok.as_deref()),
        cores: f.machine.cores,
        gpus: f.machine.gpus,
        cuda_compiled: s.gpu.cuda_compiled,
        gpu_reason: s.gpu.reason.clone().unwrap_or_default(),
        generation: match &s.engine.info.serving.placement {
            Some(p) => format!("{}: {p}", s.engine.info.serving.device),
            None => s.engine.info.serving.device.to_uppercase(),
        },
        generation_reason: if f.machine.gpus > 0 {
            s.engine.info.serving.reason.clone().unwrap_or_default()
        } else {
            String::new()
        },
        cpu: format!("{:.0} %", last.cpu_percent),
        memory_used: bytes(now.memory_used),
        memory_total: bytes(memory_total),
        memory_percent: (now.memory_used * 100)
            .checked_div(memory_total)
            .unwrap_or(0),
        disks,
        profile: f.profile.name.clone(),
        profile_description: match v.lang {
            crate::console::i18n::Lang::ZhCn if !f.profile.description_zh.is_empty() => {
                f.profile.description_zh.clone()
            }
            _ => f.profile.description.clone(),
        },
        threads: f.threads,
        queue_capacity: f.queue_depth,
        batch_size: f.profile.batch_size,
        llm: s.engine.info.model_id.clone(),
        context_length: s.engine.info.context_length,
        embedder: s.kb.embed_model.to_string(),
        embed_dim: s.kb.embed_dim,
        policy: f.policy.clone(),
        kv_dtype: f.kv_dtype.clone(),
        tiers,
        qps,
        ttft_p50: ms(sampler::quantile(&now.ttft, &first.ttft, 0.5)),
        ttft_p95: ms(sampler::quantile(&now.ttft, &first.ttft, 0.95)),
        tpot_p50: ms(sampler::quantile(&now.tpot, &first.tpot, 0.5)),
        tpot_p95: ms(sampler::quantile(&now.tpot, &first.tpot, 0.95)),
        queue_depth: m.queue_depth.get(),
        generated: sampler::counter_total(&m.generated_tokens) as u64,
        rejected: sampler::counter_of(&m.rejected, "queue_full"),
        auth_refused: sampler::counter_of(&m.rejected, "unauthorized")
            + sampler::counter_of(&m.rejected, "auth_rate_limited"),
        charts,
        pending_documents,
        pending_chunk_kv: m.ingest_pending.with_label_values(&["chunk_kv"]).get(),
        in_progress: in_progress.into_iter().take(IN_PROGRESS_SHOWN).collect(),
        sampled_at: datetime(last.at_ms),
    };
    Ok(html(&page))
}

/// The four charts: requests per second, TTFT median per interval, queue depth, CPU.
fn charts(hist: &[Sample], t: &Catalog) -> Vec<Chart> {
    let pairs = || hist.windows(2).map(|w| (&w[0], &w[1]));
    let qps: Vec<(f64, Option<f64>)> = pairs()
        .map(|(a, b)| {
            let dt = (b.at_ms.saturating_sub(a.at_ms)) as f64 / 1e3;
            let rate = (dt > 0.0).then(|| (b.requests - a.requests) / dt);
            (b.at_ms as f64, rate)
        })
        .collect();
    // An interval in which no answer started has no TTFT: a gap, not a zero.
    let ttft: Vec<(f64, Option<f64>)> = pairs()
        .map(|(a, b)| {
            let p = sampler::quantile(&b.ttft, &a.ttft, 0.5).map(|s| s * 1e3);
            (b.at_ms as f64, p)
        })
        .collect();
    let queue: Vec<(f64, Option<f64>)> = hist
        .iter()
        .map(|s| (s.at_ms as f64, Some(s.queue_depth as f64)))
        .collect();
    let cpu: Vec<(f64, Option<f64>)> = hist
        .iter()
        .map(|s| (s.at_ms as f64, Some(f64::from(s.cpu_percent))))
        .collect();
    let last = |v: &[(f64, Option<f64>)], unit: &str| match v.last() {
        Some((_, Some(y))) => format!("{y:.1}{unit}"),
        _ => "–".into(),
    };
    vec![
        Chart {
            title_key: "dashboard.chart_qps",
            now: last(&qps, ""),
            svg: chart::line(&qps, 1.0, t.get("dashboard.chart_qps")),
        },
        Chart {
            title_key: "dashboard.chart_ttft",
            now: last(&ttft, " ms"),
            svg: chart::line(&ttft, 100.0, t.get("dashboard.chart_ttft")),
        },
        Chart {
            title_key: "dashboard.chart_queue",
            now: last(&queue, ""),
            svg: chart::line(&queue, 1.0, t.get("dashboard.chart_queue")),
        },
        Chart {
            title_key: "dashboard.chart_cpu",
            now: last(&cpu, " %"),
            svg: chart::line(&cpu, 100.0, t.get("dashboard.chart_cpu")),
        },
    ]
}

/// `hits` over all, as a percentage; a dash before the first.
fn rate(hits: u64, misses: u64) -> String {
    if hits + misses == 0 {
        "–".into()
    } else {
        format!("{:.1} %", hits as f64 * 100.0 / (hits + misses) as f64)
    }
}
