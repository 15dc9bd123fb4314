//! The CUDA source compiles with NVRTC for the architectures the appliance supports (the oldest
//! and the newest each NVRTC targets: the source has no per-architecture code), with each NVRTC
//! it may run with: NVIDIA's newest (its PyPI wheel, libnvrtc.so.13) and the CUDA 11.8
//! one the offline media carry for Debian 12's driver 535 (Debian's libnvrtc11.2). No GPU is
//! needed: `scripts/test.sh` fetches both (`scripts/fetch-nvrtc.sh`), puts them on
//! `LD_LIBRARY_PATH` and names them in `ENGRAM_NVRTC_LIBS` (colon-separated); set
//! `ENGRAM_REQUIRE_NVRTC=1` to make a missing one a failure.

use engram_kernels_cuda::{compile_ptx_with, CudaError, Nvrtc};

/// Ampere (A100, A10), Ada (L40S, L4), Hopper (H100, H200), Blackwell (B200).
const ARCHS: [(i32, i32); 5] = [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0)];

#[test]
fn kernels_compile_for_every_supported_architecture() {
    let required = std::env::var_os("ENGRAM_REQUIRE_NVRTC").is_some();
    let libs: Vec<String> = match std::env::var("ENGRAM_NVRTC_LIBS") {
        Ok(list) => list
            .split(':')
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect(),
        Err(_) => vec!["libnvrtc.so.13".into()],
    };
    for lib in &libs {
        let nvrtc = match Nvrtc::open(lib) {
            Ok(n) => n,
            Err(CudaError::Unavailable(why)) => {
                assert!(!required, "ENGRAM_REQUIRE_NVRTC is set but {why}");
                eprintln!("skipped: {why}");
                continue;
            }
            Err(e) => panic!("{lib}: {e}"),
        };
        // The architecture each GPU generation gets from this NVRTC: its own, or the newest
        // this NVRTC knows (Blackwell gets compute_90 from NVRTC 11.8); each compiled once.
        let mut archs: Vec<String> = ARCHS
            .iter()
            .map(|&(major, minor)| nvrtc.arch_for(major, minor).expect("an architecture"))
            .collect();
        archs.dedup();
        // The source has no per-architecture code: each NVRTC's oldest and newest target bound
        // what it is asked (CI time: 4 compiles of about 15 s of one core each instead of 7).
        assert!(
            !include_str!("../src/kernels.cu").contains("__CUDA_ARCH__"),
            "the source has per-architecture code: compile it for every architecture"
        );
        if archs.len() > 2 {
            archs = vec![archs[0].clone(), archs[archs.len() - 1].clone()];
        }
        // One thread per architecture: each compile takes about 15 s of one core, and NVRTC
        // compiles separate programs concurrently.
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = archs
                .iter()
                .map(|arch| {
                    let nvrtc = &nvrtc;
                    s.spawn(move || (arch, compile_ptx_with(nvrtc, arch)))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("an NVRTC compile thread panicked"))
                .collect()
        });
        for (arch, result) in results {
            let ptx = result.unwrap_or_else(|e| panic!("{}: {arch}: {e}", nvrtc.describe()));
            for kernel in ["gemv_q4_0", "gemv_q4_k", "gemv_q6_k", "attention", "rope"] {
                assert!(
                    ptx.contains(&format!(".entry {kernel}")),
                    "{}: {arch}: no {kernel} in the PTX",
                    nvrtc.describe()
                );
            }
            // The PTX's ISA version is the NVRTC's CUDA release's: what bounds the driver.
            let (major, _) = nvrtc.version();
            let isa = ptx
                .lines()
                .find_map(|l| l.strip_prefix(".version "))
                .expect("a .version line");
            eprintln!("{}: {arch}: PTX ISA {isa}", nvrtc.describe());
            if major == 11 {
                assert!(isa.starts_with("7."), "NVRTC 11 wrote PTX ISA {isa}");
            }
        }
    }
}

/// NVRTC 11.8 has no compute_100: a Blackwell GPU gets the newest it has, and an architecture
/// older than any it knows is refused with a clear error.
#[test]
fn an_older_nvrtc_compiles_for_its_newest_architecture() {
    let Ok(list) = std::env::var("ENGRAM_NVRTC_LIBS") else {
        return;
    };
    for lib in list.split(':').filter(|s| !s.is_empty()) {
        let Ok(nvrtc) = Nvrtc::open(lib) else {
            continue;
        };
        if nvrtc.version() != (11, 8) {
            continue;
        }
        assert_eq!(nvrtc.arch_for(10, 0).unwrap(), "compute_90");
        assert_eq!(nvrtc.arch_for(12, 0).unwrap(), "compute_90");
        assert_eq!(nvrtc.arch_for(9, 0).unwrap(), "compute_90");
        assert_eq!(nvrtc.arch_for(8, 6).unwrap(), "compute_86");
        let err = nvrtc.arch_for(2, 0).unwrap_err();
        assert!(
            err.to_string().contains("compute_20"),
            "{err}: names the architecture"
        );
    }
}

/// Of the NVRTCs on the library path, the newest whose PTX the driver loads: with NVIDIA's
/// 13.5 and Debian's 11.8 both there (as in CI), driver 535's CUDA 12.2 gets 11.8, so does a
/// CUDA 13.0 driver (13.5 writes PTX ISA 9.5, past 13.0's), a 13.5 driver gets 13.5, and a
/// driver older than both is refused with every candidate named.
#[test]
fn the_driver_bounds_the_nvrtc_chosen() {
    let Ok(list) = std::env::var("ENGRAM_NVRTC_LIBS") else {
        return;
    };
    let versions: Vec<(i32, i32)> = list
        .split(':')
        .filter_map(|l| Nvrtc::open(l).ok())
        .map(|n| n.version())
        .collect();
    if !(versions.contains(&(13, 5)) && versions.contains(&(11, 8))) {
        assert!(
            std::env::var_os("ENGRAM_REQUIRE_NVRTC").is_none(),
            "ENGRAM_REQUIRE_NVRTC is set but NVRTC 13.5 and 11.8 are not both in {list}"
        );
        return;
    }
    if std::env::var_os("ENGRAM_NVRTC").is_some() {
        return;
    }
    let chosen = |driver| Nvrtc::find(driver).map(|n| n.version());
    assert_eq!(chosen(None).unwrap(), (13, 5), "no driver: the newest");
    assert_eq!(chosen(Some(12020)).unwrap(), (11, 8), "driver 535");
    assert_eq!(chosen(Some(13000)).unwrap(), (11, 8), "CUDA 13.0");
    assert_eq!(chosen(Some(13050)).unwrap(), (13, 5), "CUDA 13.5");
    let err = chosen(Some(10020)).unwrap_err().to_string();
    assert!(
        err.contains("NVRTC 13.5") && err.contains("NVRTC 11.8") && err.contains("CUDA 10.2"),
        "{err}"
    );
}
