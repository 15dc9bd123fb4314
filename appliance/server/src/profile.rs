//! Hardware profiles: the TOML files of `firmware-profiles/` parsed into checked [`Profile`]s,
//! the machine detected ([`Machine`]), the best-matching profile picked and fitted to it.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{Result, ServerError};

/// The profiles shipped with the daemon, compiled in so a bare binary can start; a
/// `profiles_dir` in the configuration replaces them.
pub const BUILTIN: [(&str, &str); 4] = [
    (
        "cpu-2core",
        include_str!("../../../firmware-profiles/cpu-2core.toml"),
    ),
    (
        "cpu-64core-512g",
        include_str!("../../../firmware-profiles/cpu-64core-512g.toml"),
    ),
    (
        "gpu-1x",
        include_str!("../../../firmware-profiles/gpu-1x.toml"),
    ),
    (
        "gpu-8x",
        include_str!("../../../firmware-profiles/gpu-8x.toml"),
    ),
];

/// Share of physical memory the DRAM KV tier may take: the rest holds the model weights, the
/// prefix cache, the knowledge base's caches and the OS page cache that the NVMe tier and the
/// mmap'ed GGUF rely on.
pub const MAX_DRAM_SHARE: f64 = 0.5;

/// One profile as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProfile {
    name: String,
    #[serde(default)]
    description: String,
    /// The description in Chinese, for the console in zh-CN.
    #[serde(default)]
    description_zh: String,
    #[serde(rename = "match")]
    matches: RawMatch,
    engine: RawEngine,
    kv: RawKvBudget,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMatch {
    min_cores: usize,
    min_memory_gib: u64,
    gpus: usize,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEngine {
    threads: usize,
    batch_size: usize,
    queue_depth: usize,
    gpu_count: usize,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKvBudget {
    dram_mib: u64,
    nvme_gib: u64,
}

/// A checked hardware profile.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Profile {
    pub name: String,
    pub description: String,
    /// `description` in Chinese (empty: none given).
    pub description_zh: String,
    pub min_cores: usize,
    pub min_memory_gib: u64,
    pub gpus: usize,
    pub threads: usize,
    pub batch_size: usize,
    pub queue_depth: usize,
    pub gpu_count: usize,
    pub kv_dram_mib: u64,
    pub kv_nvme_gib: u64,
}

impl Profile {
    /// Parses and checks one profile; `origin` names the file in errors.
    pub fn parse(origin: &str, text: &str) -> Result<Profile> {
        let bad = |reason: String| ServerError::Profile {
            reason: format!("{origin}: {reason}"),
        };
        let r: RawProfile = toml::from_str(text).map_err(|e| bad(e.message().to_owned()))?;
        for (key, v) in [
            ("engine.threads", r.engine.threads),
            ("engine.batch_size", r.engine.batch_size),
            ("engine.queue_depth", r.engine.queue_depth),
            ("match.min_cores", r.matches.min_cores),
        ] {
            if v == 0 {
                return Err(bad(format!("`{key}` must be at least 1")));
            }
        }
        if r.engine.gpu_count > r.matches.gpus {
            return Err(bad(format!(
                "`engine.gpu_count` {} exceeds `match.gpus` {}",
                r.engine.gpu_count, r.matches.gpus
            )));
        }
        Ok(Profile {
            name: r.name,
            description: r.description,
            description_zh: r.description_zh,
            min_cores: r.matches.min_cores,
            min_memory_gib: r.matches.min_memory_gib,
            gpus: r.matches.gpus,
            threads: r.engine.threads,
            batch_size: r.engine.batch_size,
            queue_depth: r.engine.queue_depth,
            gpu_count: r.engine.gpu_count,
            kv_dram_mib: r.kv.dram_mib,
            kv_nvme_gib: r.kv.nvme_gib,
        })
    }

    /// The built-in profiles, or every `*.toml` in `dir`.
    pub fn load_all(dir: Option<&Path>) -> Result<Vec<Profile>> {
        let Some(dir) = dir else {
            return BUILTIN
                .iter()
                .map(|(name, text)| Profile::parse(name, text))
                .collect();
        };
        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| ServerError::io("listing", dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "toml"))
            .collect();
        paths.sort();
        paths
            .iter()
            .map(|p| {
                let text =
                    std::fs::read_to_string(p).map_err(|e| ServerError::io("reading", p, e))?;
                Profile::parse(&p.display().to_string(), &text)
            })
            .collect()
    }
}

/// What the daemon runs on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Machine {
    pub cores: usize,
    pub memory_bytes: u64,
    pub gpus: usize,
    /// Free bytes on the disk holding the data directory, when known.
    pub disk_free_bytes: Option<u64>,
}

/// The NVIDIA GPUs' device files (`/dev/nvidia0`, `/dev/nvidia1`, ...): GPUs counted without a
/// CUDA call.
pub fn nvidia_device_files() -> usize {
    std::fs::read_dir("/dev")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| {
                    let n = e.file_name();
                    let n = n.to_string_lossy();
                    n.strip_prefix("nvidia").is_some_and(|rest| {
                        !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit())
                    })
                })
                .count()
        })
        .unwrap_or(0)
}

impl Machine {
    /// Detects cores and memory (sysinfo, from `/proc/meminfo`, else the `sysinfo(2)` call),
    /// GPUs (`/dev/nvidia0`, `/dev/nvidia1`, ... device files; no CUDA call) and the free space
    /// under `data_dir`.
    pub fn detect(data_dir: &Path) -> Machine {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        let gpus = nvidia_device_files();
        // statvfs on the directory itself: exact for any mount (tmpfs, bind mounts), which a
        // mount-point match against the disk list is not.
        let disk_free_bytes = engram_kvstore::disk_space(data_dir)
            .map(|s| s.available)
            .ok();
        Machine {
            cores,
            memory_bytes: total_memory(),
            gpus,
            disk_free_bytes,
        }
    }
}

/// Total memory in bytes. `/proc/meminfo` first (what sysinfo reads); where a sandbox hides it
/// (systemd's `ProcSubset=pid`, some containers) it reads as 0, and the kernel's `sysinfo(2)`
/// answers instead.
fn total_memory() -> u64 {
    use sysinfo::{MemoryRefreshKind, RefreshKind, System};
    let sys = System::new_with_specifics(
        RefreshKind::nothing().with_memory(MemoryRefreshKind::nothing().with_ram()),
    );
    match sys.total_memory() {
        0 => {
            let info = rustix::system::sysinfo();
            info.totalram as u64 * u64::from(info.mem_unit.max(1))
        }
        n => n,
    }
}

/// Whether `memory_bytes` meets a profile's `min_memory_gib`. The kernel reports less than
/// the memory installed (its own code, reservations, a crash kernel: a 3 GiB VM shows about
/// 2.8 GiB, a 2 GiB one 1.9), so 7/8 of the figure counts as having it.
fn has_memory(memory_bytes: u64, min_gib: u64) -> bool {
    u128::from(memory_bytes) * 8 >= u128::from(min_gib) * u128::from(GIB) * 7
}

/// The profile chosen, fitted to the machine, with why.
#[derive(Clone, Debug)]
pub struct Chosen {
    pub profile: Profile,
    /// Why it was picked and what was adjusted, one line each, for the start-up log.
    pub reasons: Vec<String>,
}

const GIB: u64 = 1 << 30;

/// Picks the profile named, or else the most demanding one the machine meets (more GPUs, then
/// more cores, then more memory), then fits it: threads capped by cores, the DRAM budget by
/// [`MAX_DRAM_SHARE`] of memory, the NVMe budget by the free disk space.
pub fn choose(profiles: &[Profile], machine: &Machine, named: Option<&str>) -> Result<Chosen> {
    let mem_gib = format!("{:.1}", machine.memory_bytes as f64 / GIB as f64);
    let mut reasons = Vec::new();
    let fits = |p: &Profile| {
        machine.gpus >= p.gpus
            && machine.cores >= p.min_cores
            && has_memory(machine.memory_bytes, p.min_memory_gib)
    };
    let mut profile = match named {
        Some(name) => {
            let p =
                profiles
                    .iter()
                    .find(|p| p.name == name)
                    .ok_or_else(|| ServerError::Profile {
                        reason: format!(
                            "no profile named `{name}` (known: {})",
                            profiles
                                .iter()
                                .map(|p| p.name.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    })?;
            if machine.gpus < p.gpus {
                return Err(ServerError::Profile {
                    reason: format!(
                        "profile `{name}` needs {} GPUs, this machine has {}",
                        p.gpus, machine.gpus
                    ),
                });
            }
            reasons.push(format!("profile `{name}` named in the configuration"));
            if !fits(p) {
                reasons.push(format!(
                    "warning: the machine ({} cores, {mem_gib} GiB) is below the profile's minimum ({} cores, {} GiB)",
                    machine.cores, p.min_cores, p.min_memory_gib
                ));
            }
            p.clone()
        }
        None => {
            let best = profiles
                .iter()
                .filter(|p| fits(p))
                .max_by_key(|p| (p.gpus, p.min_cores, p.min_memory_gib))
                .ok_or_else(|| ServerError::Profile {
                    reason: format!(
                        "no profile fits this machine ({} cores, {mem_gib} GiB, {} GPUs)",
                        machine.cores, machine.gpus
                    ),
                })?;
            reasons.push(format!(
                "profile `{}` picked: machine has {} cores (>= {}), {mem_gib} GiB (>= {}), {} GPUs (>= {})",
                best.name, machine.cores, best.min_cores, best.min_memory_gib, machine.gpus, best.gpus
            ));
            best.clone()
        }
    };
    if profile.threads > machine.cores {
        reasons.push(format!(
            "threads capped from {} to the machine's {} cores",
            profile.threads, machine.cores
        ));
        profile.threads = machine.cores;
    }
    let dram_cap_mib = ((machine.memory_bytes as f64 * MAX_DRAM_SHARE) as u64) >> 20;
    if profile.kv_dram_mib > dram_cap_mib {
        reasons.push(format!(
            "KV DRAM budget capped from {} MiB to {dram_cap_mib} MiB ({:.0} % of memory)",
            profile.kv_dram_mib,
            MAX_DRAM_SHARE * 100.0
        ));
        profile.kv_dram_mib = dram_cap_mib;
    }
    if let Some(free) = machine.disk_free_bytes {
        let free_gib = free / GIB;
        if profile.kv_nvme_gib > free_gib {
            reasons.push(format!(
                "KV NVMe budget capped from {} GiB to the {free_gib} GiB free under the data directory",
                profile.kv_nvme_gib
            ));
            profile.kv_nvme_gib = free_gib;
        }
    }
    Ok(Chosen { profile, reasons })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine(cores: usize, mem_gib: u64, gpus: usize) -> Machine {
        Machine {
            cores,
            memory_bytes: mem_gib * GIB,
            gpus,
            disk_free_bytes: Some(100 * GIB),
        }
    }

    #[test]
    fn builtin_profiles_parse() {
        let all = Profile::load_all(None).unwrap();
        assert_eq!(all.len(), 4);
        for (p, (name, _)) in all.iter().zip(BUILTIN) {
            assert_eq!(p.name, name);
        }
    }

    #[test]
    fn picks_the_most_demanding_fit() {
        let all = Profile::load_all(None).unwrap();
        let pick = |m: Machine| choose(&all, &m, None).unwrap().profile.name;
        assert_eq!(pick(machine(2, 8, 0)), "cpu-2core");
        assert_eq!(pick(machine(64, 512, 0)), "cpu-64core-512g");
        assert_eq!(pick(machine(16, 128, 1)), "gpu-1x");
        assert_eq!(pick(machine(128, 2048, 8)), "gpu-8x");
        // Four GPUs: the 8-GPU profile does not fit, the 1-GPU one does.
        assert_eq!(pick(machine(128, 2048, 4)), "gpu-1x");
        // A GPU on a small host falls back to the CPU profile.
        assert_eq!(pick(machine(4, 16, 1)), "cpu-2core");
    }

    #[test]
    fn fits_budgets_to_the_machine() {
        let all = Profile::load_all(None).unwrap();
        let mut m = machine(2, 2, 0);
        m.disk_free_bytes = Some(4 * GIB);
        let c = choose(&all, &m, None).unwrap();
        assert_eq!(c.profile.kv_dram_mib, 512); // 50 % of 2 GiB is 1024 MiB: fits.
        assert_eq!(c.profile.kv_nvme_gib, 4);
        let c = choose(&all, &machine(1, 64, 0), Some("cpu-64core-512g")).unwrap();
        assert_eq!(c.profile.threads, 1);
        assert_eq!(c.profile.kv_dram_mib, 32 << 10);
        assert!(c.reasons.iter().any(|r| r.contains("threads capped")));
        assert!(c.reasons.iter().any(|r| r.starts_with("warning")));
    }

    #[test]
    fn small_boxes_count_the_memory_the_kernel_keeps() {
        let all = Profile::load_all(None).unwrap();
        let mib = |n: u64| n << 20;
        for reported in [mib(1950), mib(2880), mib(3900)] {
            let m = Machine {
                memory_bytes: reported,
                ..machine(2, 0, 0)
            };
            let c = choose(&all, &m, None).unwrap();
            assert_eq!(c.profile.name, "cpu-2core");
        }
        // 2.8 GiB is said as such, not as 2.
        let m = Machine {
            memory_bytes: mib(2880),
            ..machine(2, 0, 0)
        };
        let c = choose(&all, &m, None).unwrap();
        assert!(c.reasons[0].contains("2.8 GiB"), "{:?}", c.reasons);
        // Well below the smallest profile is still refused.
        let m = Machine {
            memory_bytes: mib(1500),
            ..machine(2, 0, 0)
        };
        assert!(choose(&all, &m, None).is_err());
    }

    #[test]
    fn memory_is_detected_without_proc_meminfo() {
        // What the fallback reads must agree with /proc/meminfo where both are visible.
        let info = rustix::system::sysinfo();
        let syscall = info.totalram as u64 * u64::from(info.mem_unit.max(1));
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
        let kib: u64 = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap();
        assert!(
            syscall.abs_diff(kib * 1024) < 1 << 20,
            "{syscall} vs {kib} KiB"
        );
        assert!(total_memory() > 0);
    }

    #[test]
    fn refuses_what_cannot_work() {
        let all = Profile::load_all(None).unwrap();
        assert!(choose(&all, &machine(8, 64, 0), Some("gpu-1x")).is_err());
        assert!(choose(&all, &machine(8, 64, 0), Some("nope")).is_err());
        assert!(choose(&all, &machine(1, 1, 0), None).is_err());
        let e = Profile::parse("x", "name='x'\n[match]\nmin_cores=1\nmin_memory_gib=1\ngpus=0\n[engine]\nthreads=0\nbatch_size=1\nqueue_depth=1\ngpu_count=0\n[kv]\ndram_mib=1\nnvme_gib=1\n").unwrap_err();
        assert!(e.to_string().contains("engine.threads"), "{e}");
    }
}
