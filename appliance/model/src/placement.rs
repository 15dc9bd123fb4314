//! Which layers run on which GPU and which on the CPU: a pure planner over byte counts.
//!
//! A model larger than the cards runs as llama.cpp's `-ngl` does: the first layers on the GPUs
//! (a pipeline, each card a contiguous range, sized in proportion to its free memory), the rest
//! on the CPU, so every token crosses from GPU to host memory once. The KV cache of a GPU layer
//! lives on that layer's card; the output head joins the last card only when every layer is on
//! a GPU (otherwise the hidden state is already on the host and the head stays there too). The
//! token embedding is a row lookup per token and stays in host memory.
//!
//! Nothing here touches a device: the caller reports each card's free memory and gets back a
//! [`Placement`] it can print ([`Placement::describe`]), log as JSON, and load weights by.
//!
//! ```
//! use engram_model::placement::{Device, Placement, PlacementRequest};
//! let gib = 1u64 << 30;
//! let req = PlacementRequest::new(vec![gib / 4; 32], gib / 2, 128 << 10, 4096, 1);
//! let p = Placement::plan(&req, &[Device::new("cuda:0", 6 * gib)]);
//! assert!(p.n_gpu_layers() > 0 && p.n_gpu_layers() < 32);
//! println!("{}", p.describe());
//! ```

use std::ops::Range;

use serde::Serialize;

use crate::generate::PREFILL_CHUNK;
use crate::Model;

/// Share of a card's free memory the plan leaves unused: the allocator's fragmentation and
/// the kernels' workspaces (cuBLAS, attention) grow with the card.
pub const DEFAULT_MARGIN_FRACTION: f64 = 0.05;

/// Bytes of a card's free memory the plan leaves unused on top of the fraction: what a CUDA
/// context, its module images and a cuBLAS handle take once loaded (300 to 500 MiB measured on
/// recent drivers).
pub const DEFAULT_MARGIN_BYTES: u64 = 512 << 20;

/// A GPU and the memory it has free, as the driver reports it before loading.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Device {
    /// How the plan names it, e.g. `cuda:0`.
    pub name: String,
    pub free_bytes: u64,
}

impl Device {
    pub fn new(name: impl Into<String>, free_bytes: u64) -> Device {
        Device {
            name: name.into(),
            free_bytes,
        }
    }
}

/// The memory of each card the plan keeps back: `fraction` of its free memory plus `bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Margin {
    pub fraction: f64,
    pub bytes: u64,
}

impl Default for Margin {
    fn default() -> Margin {
        Margin {
            fraction: DEFAULT_MARGIN_FRACTION,
            bytes: DEFAULT_MARGIN_BYTES,
        }
    }
}

impl Margin {
    /// Bytes kept back on a card with `free` bytes free.
    pub fn reserve(&self, free: u64) -> u64 {
        ((free as f64 * self.fraction.max(0.0)) as u64).saturating_add(self.bytes)
    }
}

/// What has to be placed, in bytes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlacementRequest {
    /// Weight bytes of each block, in order (every `blk.N.*` tensor of block N).
    pub layer_bytes: Vec<u64>,
    /// The output head and its norm.
    pub output_bytes: u64,
    /// The token embedding (kept in host memory; counted for the report only).
    pub embedding_bytes: u64,
    /// Keys and values of one token in one layer.
    pub kv_bytes_per_token_layer: u64,
    /// Tokens of context each sequence may hold.
    pub context: u64,
    /// Sequences decoded at once, each with its own cache.
    pub sequences: u64,
    /// Activations and scratch buffers each card that runs layers needs besides weights and KV.
    pub scratch_bytes: u64,
    pub margin: Margin,
    /// Layers the user asked to put on GPUs (llama.cpp's `-ngl`): honoured when they fit,
    /// clamped to what fits otherwise; any value from the layer count up means the whole model,
    /// output head included. `None`: as many as fit.
    pub n_gpu_layers: Option<usize>,
    /// Why no layer may run on a GPU whatever fits (a mixture-of-experts model, whose routed
    /// experts only the CPU computes today); `None` for a model the GPU path runs.
    pub cpu_only: Option<String>,
}

impl PlacementRequest {
    /// A request with no scratch reserve, the default margin and no `n_gpu_layers` override.
    pub fn new(
        layer_bytes: Vec<u64>,
        output_bytes: u64,
        kv_bytes_per_token_layer: u64,
        context: u64,
        sequences: u64,
    ) -> PlacementRequest {
        PlacementRequest {
            layer_bytes,
            output_bytes,
            embedding_bytes: 0,
            kv_bytes_per_token_layer,
            context,
            sequences,
            scratch_bytes: 0,
            margin: Margin::default(),
            n_gpu_layers: None,
            cpu_only: None,
        }
    }

    /// The request for a loaded model holding `context` tokens in each of `sequences` caches:
    /// per-block bytes summed over the file's `blk.N.*` tensors, the output head (the token
    /// embedding when the model ties them) and norm, f16 keys and values, and a scratch reserve
    /// of the forward pass's buffers for one [`PREFILL_CHUNK`]-token call.
    pub fn for_model(model: &Model, context: usize, sequences: usize) -> PlacementRequest {
        let cfg = model.config();
        let file = model.gguf();
        let mut layer_bytes = vec![0u64; cfg.n_layer];
        for t in file.tensors() {
            let block = t
                .name
                .strip_prefix("blk.")
                .and_then(|rest| rest.split_once('.'))
                .and_then(|(n, _)| n.parse::<usize>().ok());
            if let Some(slot) = block.and_then(|i| layer_bytes.get_mut(i)) {
                *slot += t.size;
            }
        }
        let size = |name: &str| file.tensor(name).map_or(0, |t| t.size);
        let embedding_bytes = size("token_embd.weight");
        let head = if file.has_tensor("output.weight") {
            size("output.weight")
        } else {
            embedding_bytes
        };
        // The cache stores keys and values as f16.
        let kv_bytes_per_token_layer = 2 * 2 * cfg.kv_width() as u64;
        // `Model::forward`'s buffers: x, h, proj (width d), q, attn (q width), k, v (kv width),
        // gate, up (n_ff), in f32, for one prefill call; plus one row of logits per sequence.
        let widths = 3 * cfg.n_embd + 2 * cfg.q_width() + 2 * cfg.kv_width() + 2 * cfg.n_ff;
        let scratch_bytes =
            4 * (PREFILL_CHUNK * widths) as u64 + 4 * (cfg.vocab_size * sequences) as u64;
        PlacementRequest {
            layer_bytes,
            output_bytes: head + size("output_norm.weight"),
            embedding_bytes,
            kv_bytes_per_token_layer,
            context: context as u64,
            sequences: sequences as u64,
            scratch_bytes,
            margin: Margin::default(),
            n_gpu_layers: None,
            cpu_only: cfg.moe.map(|m| {
                format!(
                    "a mixture-of-experts model ({} experts, {} per token): the GPU path runs dense \
                     blocks only, so every layer runs on the CPU",
                    m.n_expert, m.n_expert_used
                )
            }),
        }
    }

    /// KV bytes of one layer for the whole request (every token of every sequence).
    pub fn kv_bytes_per_layer(&self) -> u64 {
        self.kv_bytes_per_token_layer
            .saturating_mul(self.context)
            .saturating_mul(self.sequences)
    }
}

/// The layers one card runs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuShare {
    pub device: String,
    /// The card's position in the list given to [`Placement::plan`].
    pub device_index: usize,
    pub layers: Range<usize>,
    pub weight_bytes: u64,
    pub kv_bytes: u64,
    pub scratch_bytes: u64,
    /// Whether the output head runs here (then `weight_bytes` includes it).
    pub output_head: bool,
    /// The card's free memory less the margin and the scratch reserve.
    pub budget_bytes: u64,
}

/// Where every part of the model runs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Placement {
    pub n_layers: usize,
    /// Cards that run layers, in pipeline order; their ranges are consecutive from layer 0.
    pub gpus: Vec<GpuShare>,
    /// The layers left to the CPU (the tail of the model; empty when all are on GPUs).
    pub cpu_layers: Range<usize>,
    /// Host bytes of the CPU's layers, the token embedding and (unless on a GPU) the head.
    pub cpu_weight_bytes: u64,
    pub cpu_kv_bytes: u64,
    /// Why fewer layers than the model has, or than were asked for, run on GPUs; or why the
    /// head stays on the CPU although every layer is on a GPU.
    pub reason: Option<String>,
}

impl Placement {
    /// Plans `req` over `devices` (in pipeline order).
    pub fn plan(req: &PlacementRequest, devices: &[Device]) -> Placement {
        let n = req.layer_bytes.len();
        let kv = req.kv_bytes_per_layer();
        let costs: Vec<u64> = req
            .layer_bytes
            .iter()
            .map(|&w| w.saturating_add(kv))
            .collect();
        let budgets: Vec<u64> = devices
            .iter()
            .map(|d| {
                d.free_bytes
                    .saturating_sub(req.margin.reserve(d.free_bytes))
                    .saturating_sub(req.scratch_bytes)
            })
            .collect();
        if let Some(why) = &req.cpu_only {
            return Placement::cpu_only(req, Some(why.clone()));
        }
        if devices.is_empty() {
            return Placement::cpu_only(req, Some("no GPU devices".into()));
        }
        if n == 0 {
            return Placement::cpu_only(req, None);
        }

        // Ordered bins filled greedily hold the longest prefix any contiguous split can.
        let fit = greedy(&costs, &budgets).iter().sum::<usize>();
        let mut with_head = costs.clone();
        with_head.push(req.output_bytes);
        let head_fits = fit == n && greedy(&with_head, &budgets).iter().sum::<usize>() == n + 1;
        let head_note = || {
            format!(
                "the output head ({}) does not fit next to the layers and runs on the CPU",
                gib(req.output_bytes)
            )
        };
        let too_small = || {
            let (best, d) = budgets
                .iter()
                .zip(devices)
                .max_by_key(|(b, _)| **b)
                .expect("at least one device");
            format!(
                "layer 0 needs {} (weights {}, KV {}) but the largest GPU budget is {} ({}: {} free, less a {} margin and {} scratch)",
                gib(costs[0]),
                gib(req.layer_bytes[0]),
                gib(kv),
                gib(*best),
                d.name,
                gib(d.free_bytes),
                gib(req.margin.reserve(d.free_bytes)),
                gib(req.scratch_bytes),
            )
        };
        let short = |asked: String| {
            format!(
                "{asked}, only {fit} of {n} layers fit in the GPUs' {} budget",
                gib(budgets.iter().sum())
            )
        };
        let (n_gpu, head, reason) = match req.n_gpu_layers {
            Some(0) => (0, false, Some("n_gpu_layers = 0: CPU only".to_owned())),
            Some(k) if k.min(n) <= fit => {
                let all = k >= n;
                let head = all && head_fits;
                let reason = (all && !head_fits).then(head_note);
                (k.min(n), head, reason)
            }
            Some(_) if fit == 0 => (0, false, Some(too_small())),
            Some(k) => (fit, false, Some(short(format!("asked for {k} GPU layers")))),
            None if fit == 0 => (0, false, Some(too_small())),
            None if fit < n => (fit, false, Some(short("not all layers fit".into()))),
            None => (n, head_fits, (!head_fits).then(head_note)),
        };
        if n_gpu == 0 {
            return Placement::cpu_only(req, reason);
        }

        let items = if head {
            &with_head[..n + 1]
        } else {
            &costs[..n_gpu]
        };
        let counts = proportional(items, &budgets)
            .filter(|c| fits(items, &budgets, c))
            .unwrap_or_else(|| greedy(items, &budgets));
        let mut gpus = Vec::new();
        let mut start = 0;
        for (i, &count) in counts.iter().enumerate() {
            if count == 0 {
                continue;
            }
            let end = start + count;
            let output_head = head && end == n + 1;
            let layers = start..end.min(n);
            let mut weight_bytes: u64 = req.layer_bytes[layers.clone()].iter().sum();
            if output_head {
                weight_bytes += req.output_bytes;
            }
            gpus.push(GpuShare {
                device: devices[i].name.clone(),
                device_index: i,
                kv_bytes: kv * layers.len() as u64,
                layers,
                weight_bytes,
                scratch_bytes: req.scratch_bytes,
                output_head,
                budget_bytes: budgets[i],
            });
            start = end;
        }
        let cpu_layers = n_gpu..n;
        let mut cpu_weight_bytes =
            req.layer_bytes[cpu_layers.clone()].iter().sum::<u64>() + req.embedding_bytes;
        if !head {
            cpu_weight_bytes += req.output_bytes;
        }
        Placement {
            n_layers: n,
            gpus,
            cpu_kv_bytes: kv * cpu_layers.len() as u64,
            cpu_layers,
            cpu_weight_bytes,
            reason,
        }
    }

    fn cpu_only(req: &PlacementRequest, reason: Option<String>) -> Placement {
        let n = req.layer_bytes.len();
        Placement {
            n_layers: n,
            gpus: Vec::new(),
            cpu_layers: 0..n,
            cpu_weight_bytes: req.layer_bytes.iter().sum::<u64>()
                + req.output_bytes
                + req.embedding_bytes,
            cpu_kv_bytes: req.kv_bytes_per_layer() * n as u64,
            reason,
        }
    }

    /// Layers on GPUs (the leading ones).
    pub fn n_gpu_layers(&self) -> usize {
        self.cpu_layers.start
    }

    /// The card running the output head, if any.
    pub fn output_device(&self) -> Option<&str> {
        self.gpus
            .iter()
            .find(|g| g.output_head)
            .map(|g| g.device.as_str())
    }

    /// One line for people: `layers 0-15 on cuda:0 (weights 3.6 GiB, KV 1.0 GiB), layers 16-31
    /// on CPU, output head on CPU; <reason>`.
    pub fn describe(&self) -> String {
        let span = |r: &Range<usize>| match r.len() {
            1 => format!("layer {}", r.start),
            _ => format!("layers {}-{}", r.start, r.end - 1),
        };
        let mut parts: Vec<String> = self
            .gpus
            .iter()
            .map(|g| {
                format!(
                    "{} on {} (weights {}, KV {})",
                    span(&g.layers),
                    g.device,
                    gib(g.weight_bytes),
                    gib(g.kv_bytes)
                )
            })
            .collect();
        if self.n_layers == 0 {
            parts.push("no layers".into());
        } else if self.gpus.is_empty() {
            parts.push(format!("all {} layers on CPU", self.n_layers));
        } else if !self.cpu_layers.is_empty() {
            parts.push(format!("{} on CPU", span(&self.cpu_layers)));
        }
        if !self.gpus.is_empty() {
            parts.push(format!(
                "output head on {}",
                self.output_device().unwrap_or("CPU")
            ));
        }
        let mut line = parts.join(", ");
        if let Some(r) = &self.reason {
            line.push_str("; ");
            line.push_str(r);
        }
        line
    }
}

/// Items per bin when each bin in turn takes items while they fit: the longest prefix of
/// `costs` that ordered, contiguous bins of `caps` can hold.
fn greedy(costs: &[u64], caps: &[u64]) -> Vec<usize> {
    let mut counts = vec![0; caps.len()];
    let mut next = 0;
    for (count, &cap) in counts.iter_mut().zip(caps) {
        let mut used = 0u64;
        while next < costs.len() && used + costs[next] <= cap {
            used += costs[next];
            next += 1;
            *count += 1;
        }
    }
    counts
}

/// Items per bin when bin `i` gets the items whose midpoints fall in its share of the total,
/// the shares proportional to `caps`; `None` when every cap is zero. May overfill a bin by
/// rounding: the caller checks with [`fits`].
fn proportional(costs: &[u64], caps: &[u64]) -> Option<Vec<usize>> {
    let total: u128 = costs.iter().map(|&c| u128::from(c)).sum();
    let cap_total: u128 = caps.iter().map(|&c| u128::from(c)).sum();
    if cap_total == 0 {
        return None;
    }
    // Twice each item's midpoint, compared with twice each bin's upper bound (integers only).
    let mut mid2 = Vec::with_capacity(costs.len());
    let mut before = 0u128;
    for &c in costs {
        mid2.push(2 * before + u128::from(c));
        before += u128::from(c);
    }
    let mut counts = Vec::with_capacity(caps.len());
    let (mut cum_cap, mut start) = (0u128, 0usize);
    for (i, &cap) in caps.iter().enumerate() {
        cum_cap += u128::from(cap);
        let end = if i + 1 == caps.len() {
            costs.len()
        } else {
            let bound2 = 2 * total * cum_cap / cap_total;
            start + mid2[start..].iter().take_while(|&&m| m <= bound2).count()
        };
        counts.push(end - start);
        start = end;
    }
    Some(counts)
}

/// Whether `counts` (items per bin, in order) keep every bin within its cap.
fn fits(costs: &[u64], caps: &[u64], counts: &[usize]) -> bool {
    let mut start = 0;
    counts.iter().zip(caps).all(|(&count, &cap)| {
        let used: u64 = costs[start..start + count].iter().sum();
        start += count;
        used <= cap
    })
}

/// Bytes in GiB with one decimal, or MiB below 1 GiB.
fn gib(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.0} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    /// A request marked CPU-only (a mixture-of-experts model) plans no GPU layer, however
    /// large the cards, and says why.
    #[test]
    fn cpu_only_requests_stay_on_the_cpu_with_their_reason() {
        let mut r = request();
        r.cpu_only = Some("a mixture-of-experts model".into());
        let p = Placement::plan(&r, &[Device::new("cuda:0", 80 * GIB)]);
        assert_eq!(p.n_gpu_layers(), 0);
        assert_eq!(p.cpu_layers, 0..32);
        assert_eq!(p.reason.as_deref(), Some("a mixture-of-experts model"));
    }

    /// 32 layers of 200 MiB weights, 32 MiB of KV each (4096 tokens of 8 KiB), a 250 MiB head.
    fn request() -> PlacementRequest {
        let mut r = PlacementRequest::new(vec![200 * MIB; 32], 250 * MIB, 8 << 10, 4096, 1);
        r.embedding_bytes = 250 * MIB;
        r.scratch_bytes = 100 * MIB;
        r
    }

    /// Free memory whose budget (after the default margin and the scratch) is `budget`.
    fn free_for(budget: u64) -> u64 {
        ((budget + 100 * MIB + DEFAULT_MARGIN_BYTES) as f64 / (1.0 - DEFAULT_MARGIN_FRACTION))
            .ceil() as u64
    }

    fn ranges(p: &Placement) -> Vec<(String, Range<usize>)> {
        p.gpus
            .iter()
            .map(|g| (g.device.clone(), g.layers.clone()))
            .collect()
    }

    #[test]
    fn everything_fits_on_one_card() {
        let req = request();
        let p = Placement::plan(&req, &[Device::new("cuda:0", 24 * GIB)]);
        assert_eq!(ranges(&p), [("cuda:0".to_owned(), 0..32)]);
        assert_eq!(p.n_gpu_layers(), 32);
        assert!(p.cpu_layers.is_empty());
        assert_eq!(p.output_device(), Some("cuda:0"));
        assert_eq!(p.reason, None);
        let g = &p.gpus[0];
        assert_eq!(g.weight_bytes, 32 * 200 * MIB + 250 * MIB);
        assert_eq!(g.kv_bytes, 32 * 32 * MIB);
        assert_eq!(
            p.cpu_weight_bytes,
            250 * MIB,
            "only the embedding stays on the host"
        );
        assert_eq!(
            p.describe(),
            "layers 0-31 on cuda:0 (weights 6.5 GiB, KV 1.0 GiB), output head on cuda:0"
        );
    }

    #[test]
    fn half_the_layers_fit() {
        let req = request();
        // Room for 16 layers of 232 MiB and a little more, not 17.
        let p = Placement::plan(
            &req,
            &[Device::new("cuda:0", free_for(16 * 232 * MIB + MIB))],
        );
        assert_eq!(ranges(&p), [("cuda:0".to_owned(), 0..16)]);
        assert_eq!(p.cpu_layers, 16..32);
        assert_eq!(p.output_device(), None);
        assert_eq!(p.cpu_weight_bytes, 16 * 200 * MIB + 250 * MIB + 250 * MIB);
        assert_eq!(p.cpu_kv_bytes, 16 * 32 * MIB);
        let line = p.describe();
        assert!(
            line.starts_with(
                "layers 0-15 on cuda:0 (weights 3.1 GiB, KV 512 MiB), layers 16-31 on CPU, output head on CPU; "
            ),
            "{line}"
        );
        assert!(line.contains("only 16 of 32 layers fit"), "{line}");
    }

    #[test]
    fn nothing_fits() {
        let req = request();
        // Less than the margin and scratch alone.
        let p = Placement::plan(&req, &[Device::new("cuda:0", 600 * MIB)]);
        assert!(p.gpus.is_empty());
        assert_eq!(p.cpu_layers, 0..32);
        let reason = p.reason.as_deref().unwrap();
        assert!(reason.contains("layer 0 needs 232 MiB"), "{reason}");
        assert!(p.describe().starts_with("all 32 layers on CPU; "));
        assert_eq!(p.cpu_weight_bytes, 32 * 200 * MIB + 250 * MIB + 250 * MIB);
    }

    #[test]
    fn two_cards_split_in_proportion_to_free_memory() {
        let req = request();
        // 24 GiB and 8 GiB budgets: 3 to 1, far more than the model needs.
        let devices = [
            Device::new("cuda:0", free_for(24 * GIB)),
            Device::new("cuda:1", free_for(8 * GIB)),
        ];
        let p = Placement::plan(&req, &devices);
        // 33 items (32 layers and the head) cut at 3/4 of the total bytes.
        assert_eq!(
            ranges(&p),
            [("cuda:0".to_owned(), 0..25), ("cuda:1".to_owned(), 25..32)]
        );
        assert_eq!(p.output_device(), Some("cuda:1"));
        assert_eq!(p.gpus[1].device_index, 1);
        assert!(p.cpu_layers.is_empty());

        // Tight cards: 20 layers of room on the first, 12 and the head on the second.
        let devices = [
            Device::new("cuda:0", free_for(20 * 232 * MIB + MIB)),
            Device::new("cuda:1", free_for(12 * 232 * MIB + 250 * MIB + MIB)),
        ];
        let p = Placement::plan(&req, &devices);
        assert_eq!(p.n_gpu_layers(), 32);
        for g in &p.gpus {
            let used = g.weight_bytes + g.kv_bytes;
            assert!(
                used <= g.budget_bytes,
                "{}: {used} > {}",
                g.device,
                g.budget_bytes
            );
        }
        assert_eq!(p.output_device(), Some("cuda:1"));

        // A model larger than both cards: each holds what it can, the rest runs on the CPU.
        let devices = [
            Device::new("cuda:0", free_for(10 * 232 * MIB + MIB)),
            Device::new("cuda:1", free_for(5 * 232 * MIB + MIB)),
        ];
        let p = Placement::plan(&req, &devices);
        assert_eq!(
            ranges(&p),
            [("cuda:0".to_owned(), 0..10), ("cuda:1".to_owned(), 10..15)]
        );
        assert_eq!(p.cpu_layers, 15..32);
        assert!(p.describe().contains("layers 15-31 on CPU"));
    }

    /// The `gpu-8x` profile's node: eight cards split the pipeline in contiguous ranges by their
    /// free memory, every card within its budget, the head on the last, and a card with less
    /// free memory (another tenant's process on it) gets fewer layers.
    #[test]
    fn eight_cards_form_one_pipeline() {
        let req = request();
        // Equal cards, each with room for 5 layers: 33 items (32 layers, the head) over 8.
        let devices: Vec<Device> = (0..8)
            .map(|i| Device::new(format!("cuda:{i}"), free_for(5 * 232 * MIB)))
            .collect();
        let p = Placement::plan(&req, &devices);
        assert_eq!(p.n_gpu_layers(), 32);
        assert!(p.cpu_layers.is_empty());
        assert_eq!(p.output_device(), Some("cuda:7"));
        let mut next = 0;
        for g in &p.gpus {
            assert_eq!(g.layers.start, next, "{}: ranges are consecutive", g.device);
            next = g.layers.end;
            assert!(
                g.weight_bytes + g.kv_bytes <= g.budget_bytes,
                "{}",
                g.device
            );
            assert!(
                (3..=5).contains(&g.layers.len()),
                "{}: {:?}: equal cards share evenly",
                g.device,
                g.layers
            );
        }
        assert_eq!(p.gpus.len(), 8);
        assert_eq!(next, 32);

        // cuda:3 has a quarter of the others' memory free: it takes the fewest layers, and
        // the plan still places them all.
        let mut devices = devices;
        devices[3] = Device::new("cuda:3", free_for(232 * MIB + MIB));
        let p = Placement::plan(&req, &devices);
        assert_eq!(p.n_gpu_layers(), 32);
        let fewest = p.gpus.iter().min_by_key(|g| g.layers.len()).unwrap();
        assert_eq!(fewest.device, "cuda:3", "{}", p.describe());
        for g in &p.gpus {
            assert!(
                g.weight_bytes + g.kv_bytes <= g.budget_bytes,
                "{}",
                g.device
            );
        }

        // Eight small cards for a large model: together they hold what one plan can, and the
        // tail runs on the CPU.
        let devices: Vec<Device> = (0..8)
            .map(|i| Device::new(format!("cuda:{i}"), free_for(2 * 232 * MIB + MIB)))
            .collect();
        let p = Placement::plan(&req, &devices);
        assert_eq!(p.n_gpu_layers(), 16);
        assert_eq!(p.cpu_layers, 16..32);
        assert_eq!(p.gpus.len(), 8);
        assert!(p.gpus.iter().all(|g| g.layers.len() == 2));
    }

    #[test]
    fn n_gpu_layers_is_honoured_or_clamped() {
        let mut req = request();
        req.n_gpu_layers = Some(10);
        let card = [Device::new("cuda:0", 24 * GIB)];
        let p = Placement::plan(&req, &card);
        assert_eq!(ranges(&p), [("cuda:0".to_owned(), 0..10)]);
        assert_eq!(p.output_device(), None);
        assert_eq!(p.reason, None);

        // Any count from the layer count up is the whole model, head included.
        req.n_gpu_layers = Some(99);
        let p = Placement::plan(&req, &card);
        assert_eq!(p.n_gpu_layers(), 32);
        assert_eq!(p.output_device(), Some("cuda:0"));

        req.n_gpu_layers = Some(30);
        let small = [Device::new("cuda:0", free_for(16 * 232 * MIB + MIB))];
        let p = Placement::plan(&req, &small);
        assert_eq!(p.n_gpu_layers(), 16);
        let reason = p.reason.as_deref().unwrap();
        assert!(
            reason.contains("asked for 30 GPU layers, only 16 of 32 layers fit"),
            "{reason}"
        );

        req.n_gpu_layers = Some(0);
        let p = Placement::plan(&req, &card);
        assert!(p.gpus.is_empty());
        assert!(p.reason.as_deref().unwrap().contains("CPU only"));
    }

    #[test]
    fn an_overfilling_proportional_cut_falls_back_to_greedy() {
        // The middle item's midpoint lies in the first card's half, but both do not fit there.
        let (costs, caps) = ([30, 50, 30], [60, 60]);
        let cut = proportional(&costs, &caps).unwrap();
        assert_eq!(cut, [2, 1]);
        assert!(!fits(&costs, &caps, &cut));
        assert_eq!(greedy(&costs, &caps), [1, 1]);
        assert_eq!(proportional(&costs, &[0, 0]), None);
    }

    #[test]
    fn no_devices_means_cpu() {
        let p = Placement::plan(&request(), &[]);
        assert!(p.gpus.is_empty());
        assert_eq!(p.cpu_layers, 0..32);
        assert_eq!(p.cpu_kv_bytes, 32 * 32 * MIB);
        assert_eq!(p.describe(), "all 32 layers on CPU; no GPU devices");
    }

    #[test]
    fn head_that_does_not_fit_stays_on_the_cpu() {
        let req = request();
        // Every layer fits, the head does not.
        let p = Placement::plan(
            &req,
            &[Device::new("cuda:0", free_for(32 * 232 * MIB + MIB))],
        );
        assert_eq!(p.n_gpu_layers(), 32);
        assert_eq!(p.output_device(), None);
        assert!(p.reason.as_deref().unwrap().contains("output head"));
    }

    #[test]
    fn placement_serialises() {
        let p = Placement::plan(&request(), &[Device::new("cuda:0", 24 * GIB)]);
        let v = serde_json::to_value(&p).unwrap();
        assert_eq!(v["gpus"][0]["layers"]["end"], 32);
        assert_eq!(v["cpu_layers"]["start"], 32);
        assert_eq!(v["reason"], serde_json::Value::Null);
    }

    #[test]
    fn request_from_a_model() {
        use engram_gguf::{GgmlType, GgufFile, GgufWriter, Value};
        let (d, ff, vocab, layers) = (64u64, 128u64, 100u64, 3);
        let mut w = GgufWriter::new();
        w.metadata("general.architecture", Value::String("llama".into()))
            .metadata("llama.block_count", Value::U32(layers))
            .metadata("llama.embedding_length", Value::U32(d as u32))
            .metadata("llama.feed_forward_length", Value::U32(ff as u32))
            .metadata("llama.attention.head_count", Value::U32(4))
            .metadata("llama.attention.head_count_kv", Value::U32(2))
            .metadata("llama.vocab_size", Value::U32(vocab as u32));
        let q8 = |rows: u64, cols: u64| vec![0u8; (rows * cols / 32 * 34) as usize];
        w.tensor(
            "token_embd.weight",
            &[d, vocab],
            GgmlType::Q8_0,
            q8(vocab, d),
        );
        for i in 0..layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            w.tensor_f32(n("attn_norm.weight"), &[d], &vec![1.0; d as usize]);
            for (s, rows) in [
                ("attn_q", d),
                ("attn_k", 32),
                ("attn_v", 32),
                ("attn_output", d),
            ] {
                w.tensor(
                    n(&format!("{s}.weight")),
                    &[d, rows],
                    GgmlType::Q8_0,
                    q8(rows, d),
                );
            }
            w.tensor_f32(n("ffn_norm.weight"), &[d], &vec![1.0; d as usize]);
            w.tensor(n("ffn_gate.weight"), &[d, ff], GgmlType::Q8_0, q8(ff, d));
            w.tensor(n("ffn_up.weight"), &[d, ff], GgmlType::Q8_0, q8(ff, d));
            w.tensor(n("ffn_down.weight"), &[ff, d], GgmlType::Q8_0, q8(d, ff));
        }
        w.tensor_f32("output_norm.weight", &[d], &vec![1.0; d as usize]);
        let file = GgufFile::from_bytes(w.to_bytes()).unwrap();
        let model = Model::from_gguf(std::sync::Arc::new(file), 1).unwrap();

        let req = PlacementRequest::for_model(&model, 256, 2);
        let q8_bytes = |rows: u64, cols: u64| rows * cols / 32 * 34;
        let layer = 2 * 4 * d
            + q8_bytes(d, d) * 2
            + q8_bytes(32, d) * 2
            + q8_bytes(ff, d) * 2
            + q8_bytes(d, ff);
        assert_eq!(req.layer_bytes, vec![layer; layers as usize]);
        // Tied head: the embedding is the head.
        assert_eq!(req.embedding_bytes, q8_bytes(vocab, d));
        assert_eq!(req.output_bytes, q8_bytes(vocab, d) + 4 * d);
        // Two KV heads of 16, keys and values, f16.
        assert_eq!(req.kv_bytes_per_token_layer, 2 * 2 * 32);
        assert_eq!(req.kv_bytes_per_layer(), 128 * 256 * 2);
        assert!(req.scratch_bytes > 0);
        let total: u64 = model.gguf().tensors().iter().map(|t| t.size).sum();
        assert_eq!(
            req.layer_bytes.iter().sum::<u64>() + req.embedding_bytes + 4 * d,
            total
        );
    }
}
