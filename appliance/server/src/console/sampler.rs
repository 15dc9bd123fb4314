//! The dashboard's history: a task reads the metrics and the machine every
//! [`SAMPLE_EVERY`] into a ring of the last hour; the dashboard derives rates, percentiles
//! and chart series from it.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus::core::Collector;

use super::users::now_ms;
use crate::metrics::Metrics;

/// How often a sample is taken: fine enough for a one-hour chart (360 points), cheap
/// enough to be invisible (a few counters and one CPU reading).
pub const SAMPLE_EVERY: Duration = Duration::from_secs(10);
/// Samples kept: one hour.
pub const KEPT: usize = 360;

/// One reading.
#[derive(Clone, Debug, Default)]
pub struct Sample {
    pub at_ms: u64,
    /// HTTP requests so far (every route and status).
    pub requests: f64,
    /// Time-to-first-token histogram so far: (upper bound in seconds, cumulative count).
    pub ttft: Vec<(f64, u64)>,
    /// Time-per-output-token histogram so far, the same way.
    pub tpot: Vec<(f64, u64)>,
    pub queue_depth: i64,
    /// Whole-machine CPU use in percent.
    pub cpu_percent: f32,
    pub memory_used: u64,
}

/// The ring, shared between the sampling task and the pages.
#[derive(Default)]
pub struct History {
    samples: Mutex<VecDeque<Sample>>,
}

impl History {
    pub fn push(&self, s: Sample) {
        let mut q = self.samples.lock().expect("history lock");
        if q.len() == KEPT {
            q.pop_front();
        }
        q.push_back(s);
    }

    pub fn snapshot(&self) -> Vec<Sample> {
        self.samples
            .lock()
            .expect("history lock")
            .iter()
            .cloned()
            .collect()
    }
}

/// Sum of every series of a counter vector.
pub fn counter_total(c: &prometheus::IntCounterVec) -> f64 {
    c.collect()
        .iter()
        .flat_map(|f| f.get_metric())
        .map(|m| m.get_counter().get_value())
        .sum()
}

/// A counter vector's value for one label value.
pub fn counter_of(c: &prometheus::IntCounterVec, label: &str) -> u64 {
    c.with_label_values(&[label]).get()
}

/// A histogram's buckets, all label values merged: (upper bound, cumulative count).
pub fn buckets(h: &prometheus::HistogramVec) -> Vec<(f64, u64)> {
    let mut out: Vec<(f64, u64)> = Vec::new();
    for f in h.collect() {
        for metric in f.get_metric() {
            let h = metric.get_histogram();
            for (i, b) in h.get_bucket().iter().enumerate() {
                match out.get_mut(i) {
                    Some(o) => o.1 += b.cumulative_count(),
                    None => out.push((b.upper_bound(), b.cumulative_count())),
                }
            }
        }
    }
    out
}

/// The `q` quantile (0..1) of the observations between two cumulative histograms, by
/// linear interpolation inside the bucket (as Prometheus' `histogram_quantile`); `None`
/// when nothing was observed.
pub fn quantile(now: &[(f64, u64)], before: &[(f64, u64)], q: f64) -> Option<f64> {
    let delta: Vec<(f64, u64)> = now
        .iter()
        .enumerate()
        .map(|(i, &(ub, c))| (ub, c.saturating_sub(before.get(i).map_or(0, |b| b.1))))
        .collect();
    let total = delta.last()?.1;
    if total == 0 {
        return None;
    }
    let rank = q * total as f64;
    let mut lower = (0.0, 0u64);
    for &(ub, c) in &delta {
        if c as f64 >= rank {
            let span = (c - lower.1) as f64;
            let frac = if span > 0.0 {
                (rank - lower.1 as f64) / span
            } else {
                1.0
            };
            return Some(lower.0 + (ub - lower.0) * frac);
        }
        lower = (ub, c);
    }
    // Above the last finite bucket: report its bound.
    delta.last().map(|d| d.0)
}

/// Takes one sample now.
pub fn sample(m: &Metrics, sys: &mut sysinfo::System) -> Sample {
    sys.refresh_cpu_usage();
    sys.refresh_memory();
    Sample {
        at_ms: now_ms(),
        requests: counter_total(&m.requests),
        ttft: buckets(&m.ttft),
        tpot: buckets(&m.tpot),
        queue_depth: m.queue_depth.get(),
        cpu_percent: sys.global_cpu_usage(),
        memory_used: sys.used_memory(),
    }
}

/// Starts the sampling task on the current runtime. It holds only the metrics and the
/// history (never a knowledge-base or engine handle, so it does not delay shutdown).
pub fn spawn(metrics: Arc<Metrics>, history: Arc<History>) {
    tokio::spawn(async move {
        let mut sys = sysinfo::System::new();
        let mut tick = tokio::time::interval(SAMPLE_EVERY);
        loop {
            tick.tick().await;
            history.push(sample(&metrics, &mut sys));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_within_buckets() {
        let before = [(0.1, 0), (1.0, 0), (f64::INFINITY, 0)];
        let now = [(0.1, 50), (1.0, 100), (f64::INFINITY, 100)];
        assert!((quantile(&now, &before, 0.5).unwrap() - 0.1).abs() < 1e-9);
        let p75 = quantile(&now, &before, 0.75).unwrap();
        assert!((p75 - 0.55).abs() < 1e-9, "{p75}");
        assert_eq!(quantile(&before, &before, 0.5), None);
    }
}
