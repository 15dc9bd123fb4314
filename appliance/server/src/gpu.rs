//! The GPUs `engramd` finds at start, for `/readyz`, `/metrics`, the log and `engramd
//! --version`. With the `cuda` feature (the default, so the package's one binary serves every
//! box) the CUDA driver is probed (a missing library is a reason, never a crash); a build
//! without it only counts the NVIDIA device files. Whether generation then uses a GPU is the
//! engine's decision (`crate::decode`): `serving` says where it runs, `placement` where the
//! layers are and `serving_reason` why it stays on the CPU, so nobody mistakes a detected GPU
//! for one in use.

use serde::Serialize;

/// One GPU as probed.
#[derive(Debug, Clone, Serialize)]
pub struct GpuDevice {
    pub ordinal: usize,
    pub name: String,
    /// "9.0" for Hopper.
    pub compute_capability: String,
    pub total_bytes: u64,
    pub free_bytes: u64,
}

/// What the daemon knows of its GPUs.
#[derive(Debug, Clone, Serialize)]
pub struct GpuStatus {
    /// Whether this build has GPU support (the `cuda` feature: CUDA loaded at run time).
    pub cuda_compiled: bool,
    /// Whether the GPU path could run here (driver, NVRTC and cuBLAS present, a device found).
    pub available: bool,
    pub devices: Vec<GpuDevice>,
    /// The CUDA the GPU path runs on, when it can: "driver CUDA 12.2, NVRTC 11.8
    /// (libnvrtc.so.11.2)" (the NVRTC chosen is the newest whose output the driver loads).
    pub runtime: Option<String>,
    /// Why no GPU is available, when none is.
    pub reason: Option<String>,
    /// Where generation runs: `cpu`, or the GPU decode runs on (`cuda:0`).
    pub serving: String,
    /// Where the model's layers run, when generation uses a GPU.
    pub placement: Option<String>,
    /// Why generation runs on the CPU, when it does.
    pub serving_reason: Option<String>,
    /// `/dev/nvidiaN` files present (what the hardware profile counts).
    pub device_files: usize,
}

impl GpuStatus {
    /// Probes the GPUs (`device_files`: the NVIDIA device files the profile detection counted).
    pub fn detect(device_files: usize) -> GpuStatus {
        let (devices, reason) = probe(device_files);
        let runtime = if devices.is_empty() { None } else { runtime() };
        GpuStatus {
            cuda_compiled: cfg!(feature = "cuda"),
            available: !devices.is_empty(),
            devices,
            runtime,
            reason,
            serving: "cpu".into(),
            placement: None,
            serving_reason: None,
            device_files,
        }
    }

    /// Records where the engine serves from.
    pub fn set_serving(&mut self, s: &crate::decode::Serving) {
        self.serving = s.device.clone();
        self.placement = s.placement.clone();
        self.serving_reason = s.reason.clone();
    }

    /// One line for `engramd --version` and the log: whether GPU support is compiled in, and
    /// what was found.
    pub fn summary(&self) -> String {
        let support = if self.cuda_compiled {
            "GPU support: compiled in (CUDA, loaded at run time)"
        } else {
            "GPU support: not compiled in (a build without the `cuda` feature)"
        };
        let found = if self.available {
            let gpus: Vec<String> = self
                .devices
                .iter()
                .map(|d| {
                    format!(
                        "cuda:{} {} (compute {}, {} MiB)",
                        d.ordinal,
                        d.name,
                        d.compute_capability,
                        d.total_bytes >> 20
                    )
                })
                .collect();
            let runtime = self
                .runtime
                .as_deref()
                .map(|r| format!(" ({r})"))
                .unwrap_or_default();
            format!("{} found: {}{runtime}", gpus.len(), gpus.join(", "))
        } else {
            let reason = self.reason.as_deref().unwrap_or("unknown");
            // The probe's reasons open with what this line already says.
            let reason = reason
                .strip_prefix("no usable CUDA GPU: ")
                .unwrap_or(reason);
            format!("no GPU usable: {reason}")
        };
        format!("{support}; {found}")
    }

    /// The one log line at start.
    pub fn log(&self) {
        if self.available {
            for d in &self.devices {
                tracing::info!(
                    device = d.ordinal,
                    name = %d.name,
                    compute_capability = %d.compute_capability,
                    total_mib = d.total_bytes >> 20,
                    free_mib = d.free_bytes >> 20,
                    runtime = self.runtime.as_deref().unwrap_or("unknown"),
                    "GPU found"
                );
            }
        } else {
            tracing::info!(
                cuda_compiled = self.cuda_compiled,
                reason = self.reason.as_deref().unwrap_or("unknown"),
                "no GPU usable"
            );
        }
    }
}

#[cfg(feature = "cuda")]
fn probe(_device_files: usize) -> (Vec<GpuDevice>, Option<String>) {
    match engram_kernels_cuda::probe() {
        Ok(found) => (
            found
                .into_iter()
                .map(|d| GpuDevice {
                    ordinal: d.ordinal,
                    name: d.name,
                    compute_capability: format!(
                        "{}.{}",
                        d.compute_capability.0, d.compute_capability.1
                    ),
                    total_bytes: d.total_bytes,
                    free_bytes: d.free_bytes,
                })
                .collect(),
            None,
        ),
        Err(e) => (Vec::new(), Some(e.to_string())),
    }
}

#[cfg(feature = "cuda")]
fn runtime() -> Option<String> {
    engram_kernels_cuda::runtime().ok()
}

#[cfg(not(feature = "cuda"))]
fn runtime() -> Option<String> {
    None
}

#[cfg(not(feature = "cuda"))]
fn probe(device_files: usize) -> (Vec<GpuDevice>, Option<String>) {
    let reason = if device_files > 0 {
        format!(
            "{device_files} NVIDIA device files present, but this engramd was built without the \
             `cuda` feature"
        )
    } else {
        "no NVIDIA device, and this engramd was built without the `cuda` feature".into()
    };
    (Vec::new(), Some(reason))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The build machines have no GPU: the status says so with a reason and serving stays on
    /// the CPU; with a GPU, every device is listed.
    #[test]
    fn detection_lists_devices_or_gives_a_reason() {
        let s = GpuStatus::detect(0);
        assert_eq!(s.serving, "cpu");
        if s.available {
            assert!(!s.devices.is_empty() && s.reason.is_none());
        } else {
            assert!(s.devices.is_empty());
            assert!(!s.reason.as_deref().unwrap_or("").is_empty());
        }
        let json = serde_json::to_value(&s).unwrap();
        assert!(json["available"].is_boolean() && json["devices"].is_array());
        assert_eq!(json["cuda_compiled"], cfg!(feature = "cuda"));
        let line = s.summary();
        assert!(line.starts_with("GPU support: "), "{line}");
        if !s.available {
            let reason = s.reason.as_deref().unwrap();
            let said = reason
                .strip_prefix("no usable CUDA GPU: ")
                .unwrap_or(reason);
            assert!(line.ends_with(&format!("no GPU usable: {said}")), "{line}");
        }
    }
}
