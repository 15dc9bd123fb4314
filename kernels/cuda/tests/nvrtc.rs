//! The CUDA source compiles with NVRTC for every architecture the appliance supports. Needs
//! libnvrtc.so.13 (no GPU): `scripts/test.sh` installs NVIDIA's NVRTC wheel and points
//! `LD_LIBRARY_PATH` at it; set `ENGRAM_REQUIRE_NVRTC=1` to make its absence a failure.

use engram_kernels_cuda::{compile_ptx, CudaError};

#[test]
fn kernels_compile_for_every_supported_architecture() {
    // Ampere (A100, A10), Ada (L40S, L4), Hopper (H100, H200), Blackwell (B200).
    let archs = [
        "compute_80",
        "compute_86",
        "compute_89",
        "compute_90",
        "compute_100",
    ];
    // One thread per architecture: each compile takes about 15 s of one core, and NVRTC
    // compiles separate programs concurrently.
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = archs
            .iter()
            .map(|&arch| s.spawn(move || (arch, compile_ptx(arch))))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("an NVRTC compile thread panicked"))
            .collect()
    });
    for (arch, result) in results {
        match result {
            Ok(ptx) => {
                for kernel in ["gemv_q4_0", "gemv_q4_k", "gemv_q6_k", "attention", "rope"] {
                    assert!(
                        ptx.contains(&format!(".entry {kernel}")),
                        "{arch}: no {kernel} in the PTX"
                    );
                }
            }
            Err(CudaError::Unavailable(why)) => {
                assert!(
                    std::env::var_os("ENGRAM_REQUIRE_NVRTC").is_none(),
                    "ENGRAM_REQUIRE_NVRTC is set but {why}"
                );
                eprintln!("skipped: {why}");
                return;
            }
            Err(e) => panic!("{arch}: {e}"),
        }
    }
}
