//! Dot products of a weight row with a quantised activation row, and the ISA dispatcher.
//!
//! - `scalar`: the reference kernels, always compiled.
//! - `avx2` (x86_64): a `#[target_feature]` kernel for f16 (the one weight format without a
//!   tiled kernel but with a SIMD dot), used when the CPU has AVX2, FMA and F16C;
//! - the quantised formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) on AVX2 and AVX-512
//!   are the 1 x 1 case of the tiled kernels in `crate::gemm`, so a lone dot product and a
//!   matmul give the same bits.
//!
//! The choice is made once per process ([`Isa::detected`]) and cached; setting
//! `ENGRAM_KERNELS_ISA=scalar` forces the reference kernels, `=avx2` caps the ISA at AVX2 and
//! `=avx512bw` (on a VNNI CPU) uses the AVX-512 kernels without `vpdpbusd`. Property tests below check every
//! implementation available on the test machine against the scalar one.

#[cfg(target_arch = "x86_64")]
mod avx2;
mod scalar;

use std::sync::OnceLock;

use crate::dequant::dequantize_row;
use crate::dtype::GgmlType;
use crate::error::{KernelError, Result};

/// Environment variable that, set to `scalar`, makes the process use the scalar reference
/// kernels only (`avx2`: no AVX-512): for bisecting a numerical difference, and for running the
/// fixture tests against the reference on machines with SIMD.
pub(crate) const FORCE_SCALAR_ENV: &str = "ENGRAM_KERNELS_ISA";

/// A dot-product kernel over whole rows: `(weight_row, quantized_x) -> dot`. The two slices must
/// hold the same number of elements in the weight type and its vec-dot type (checked by callers).
pub(crate) type DotFn = fn(&[u8], &[u8]) -> f32;

/// An instruction set the kernels can be specialised for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isa {
    /// Portable Rust, left to the auto-vectoriser.
    Scalar,
    /// x86_64 AVX2 + FMA + F16C.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// x86_64 AVX-512 F/BW/VL without VNNI (Skylake-SP, Cascade Lake without DL Boost):
    /// `vpmaddubsw` + `vpmaddwd` where `Avx512` has `vpdpbusd`, plus everything `Avx2` needs.
    #[cfg(target_arch = "x86_64")]
    Avx512Bw,
    /// x86_64 AVX-512 F/BW/VL with VNNI (`vpdpbusd`), plus everything `Avx2` needs.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    /// The best instruction set of this CPU, detected on first use and cached.
    pub(crate) fn detected() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            let forced = std::env::var(FORCE_SCALAR_ENV).ok();
            let best = Isa::supported_here().pop().unwrap_or(Isa::Scalar);
            match forced.as_deref() {
                Some("scalar") => Isa::Scalar,
                #[cfg(target_arch = "x86_64")]
                Some("avx2") if best != Isa::Scalar => Isa::Avx2,
                #[cfg(target_arch = "x86_64")]
                Some("avx512bw") if best == Isa::Avx512 => Isa::Avx512Bw,
                _ => best,
            }
        })
    }

    /// Every instruction set this CPU can run, worst first (ignores `ENGRAM_KERNELS_ISA`).
    fn supported_here() -> Vec<Isa> {
        #[allow(unused_mut)]
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") && has!("f16c") {
                v.push(Isa::Avx2);
                if has!("avx512f") && has!("avx512bw") && has!("avx512vl") {
                    v.push(Isa::Avx512Bw);
                    if has!("avx512vnni") {
                        v.push(Isa::Avx512);
                    }
                }
            }
        }
        v
    }

    /// Every instruction set this CPU can run (for tests).
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Isa> {
        Isa::supported_here()
    }

    /// The ISA's short name, as `ENGRAM_KERNELS_ISA` spells it (`avx512` is the VNNI set).
    pub(crate) fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Bw => "avx512bw",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => "avx512-vnni",
        }
    }

    /// Whether this ISA has `vpdpbusd` (u8 x i8 dot products without saturation).
    pub(crate) fn has_vnni(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if self == Isa::Avx512 {
            return true;
        }
        false
    }

    /// The kernel for weights of type `ty` on this instruction set; `None` if unsupported.
    pub(crate) fn dot_fn(self, ty: GgmlType) -> Option<DotFn> {
        if let Some(f) = crate::gemm::dot_fn(self, ty) {
            return Some(f);
        }
        #[cfg(target_arch = "x86_64")]
        if self != Isa::Scalar {
            if let Some(f) = avx2::dot_fn(ty) {
                return Some(f);
            }
        }
        let f: DotFn = match ty {
            GgmlType::F32 => scalar::f32_f32,
            GgmlType::F16 => scalar::f16_f16,
            GgmlType::BF16 => scalar::bf16_bf16,
            GgmlType::Q4_0 => scalar::q4_0_q8_0,
            GgmlType::Q4_1 => scalar::q4_1_q8_1,
            GgmlType::Q5_0 => scalar::q5_0_q8_0,
            GgmlType::Q5_1 => scalar::q5_1_q8_1,
            GgmlType::Q8_0 => scalar::q8_0_q8_0,
            GgmlType::Q4K => scalar::q4_k_q8_k,
            GgmlType::Q5K => scalar::q5_k_q8_k,
            GgmlType::Q6K => scalar::q6_k_q8_k,
            _ => return None,
        };
        Some(f)
    }
}

/// The kernel for weights of type `ty` on this CPU, or an `Unsupported` error naming `op`.
pub(crate) fn dot_fn(ty: GgmlType, op: &'static str) -> Result<DotFn> {
    Isa::detected()
        .dot_fn(ty)
        .ok_or(KernelError::Unsupported { ty, op })
}

/// Checks that `weight_row` and `quantized_x` each hold `n` elements (of `ty` and of its
/// vec-dot type).
fn check_row_lengths(ty: GgmlType, weight_row: &[u8], quantized_x: &[u8], n: usize) -> Result<()> {
    let vd = ty.checked_vec_dot_type("vec_dot")?;
    let w_bytes = ty.checked_row_bytes(n, "vec_dot n")?;
    let x_bytes = vd.checked_row_bytes(n, "vec_dot n")?;
    if weight_row.len() != w_bytes {
        return Err(KernelError::LengthMismatch {
            what: "vec_dot weight_row bytes",
            expected: w_bytes,
            actual: weight_row.len(),
        });
    }
    if quantized_x.len() != x_bytes {
        return Err(KernelError::LengthMismatch {
            what: "vec_dot quantized_x bytes",
            expected: x_bytes,
            actual: quantized_x.len(),
        });
    }
    Ok(())
}

/// Dot product of one weight row of type `ty` with an activation row already quantised by
/// [`quantize_activations`](crate::quantize_activations) for `ty`; both hold `n` elements.
///
/// This is the integer dot product ggml's CPU backend computes (`ggml_vec_dot_<ty>_<vec_dot_type>`),
/// so results match llama.cpp up to float summation order.
pub fn vec_dot(ty: GgmlType, weight_row: &[u8], quantized_x: &[u8], n: usize) -> Result<f32> {
    check_row_lengths(ty, weight_row, quantized_x, n)?;
    Ok(dot_fn(ty, "vec_dot")?(weight_row, quantized_x))
}

/// Reference dot product for tests: dequantises `weight_row` and dots it with the unquantised
/// `x` in f64. Slow; it allocates.
pub fn vec_dot_f32(ty: GgmlType, weight_row: &[u8], x: &[f32]) -> Result<f32> {
    let mut w = vec![0f32; x.len()];
    dequantize_row(ty, weight_row, &mut w)?;
    Ok(w.iter()
        .zip(x)
        .map(|(&a, &b)| a as f64 * b as f64)
        .sum::<f64>() as f32)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::quantize::quantize_activations;
    use proptest::prelude::*;

    /// A random but valid row of `ty` with `n` elements: random bytes, f16 scales forced sane.
    pub(crate) fn random_row(ty: GgmlType, n: usize, bytes: &[u8]) -> Vec<u8> {
        let len = ty.row_bytes(n).unwrap();
        let mut row: Vec<u8> = bytes.iter().cycle().take(len).copied().collect();
        let scale = |v: u8| half::f16::from_f32(0.001 + v as f32 * 1e-4).to_le_bytes();
        let set = |row: &mut [u8], off: usize| {
            let s = scale(row[off]);
            row[off..off + 2].copy_from_slice(&s);
        };
        let ts = ty.type_size();
        for b in (0..len).step_by(ts) {
            match ty {
                GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => set(&mut row, b),
                GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => {
                    set(&mut row, b);
                    set(&mut row, b + 2);
                }
                GgmlType::Q6K => set(&mut row, b + 208),
                GgmlType::F16 | GgmlType::BF16 | GgmlType::F32 => {}
                _ => unreachable!(),
            }
        }
        if ty == GgmlType::F32 {
            for (i, c) in row.chunks_exact_mut(4).enumerate() {
                c.copy_from_slice(&((i % 13) as f32 * 0.1 - 0.6).to_le_bytes());
            }
        }
        if ty == GgmlType::F16 || ty == GgmlType::BF16 {
            // Keep exponents small: clear the top exponent bits of each element.
            for c in row.chunks_exact_mut(2) {
                c[1] &= 0b1011_1111;
            }
        }
        row
    }

    const SUPPORTED: [GgmlType; 11] = GgmlType::SUPPORTED;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Every ISA available here agrees with the scalar reference.
        #[test]
        fn every_isa_matches_scalar(
            ty_idx in 0..SUPPORTED.len(),
            blocks in 1usize..5,
            bytes in prop::collection::vec(any::<u8>(), 64..512),
            x in prop::collection::vec(-4.0f32..4.0, 1024),
        ) {
            let ty = SUPPORTED[ty_idx];
            let n = blocks * 256;
            let w = random_row(ty, n, &bytes);
            let mut xq = Vec::new();
            quantize_activations(ty, &x[..n], &mut xq).unwrap();
            let reference = Isa::Scalar.dot_fn(ty).unwrap()(&w, &xq);
            // Implementations differ only in float summation order: allow a few ulps of
            // sum(|w_i x_i|).
            let mut wf = vec![0f32; n];
            dequantize_row(ty, &w, &mut wf).unwrap();
            let scale: f32 = wf.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
            let tol = 1e-6 * (1.0 + scale);
            for isa in Isa::available() {
                let got = isa.dot_fn(ty).unwrap()(&w, &xq);
                // Only the reference itself is bit-exact: the tiled kernels and the F16 one sum
                // floats in their own order.
                let exact = isa == Isa::Scalar;
                if exact {
                    prop_assert_eq!(got.to_bits(), reference.to_bits(),
                        "{} {:?}: {} vs scalar {}", ty, isa, got, reference);
                }
                prop_assert!((got - reference).abs() <= tol,
                    "{ty} {isa:?}: {got} vs scalar {reference}");
            }
        }
    }

    #[test]
    fn vec_dot_rejects_bad_lengths() {
        let w = vec![0u8; 18];
        let x = vec![0u8; 34];
        assert!(vec_dot(GgmlType::Q4_0, &w, &x, 32).is_ok());
        assert!(vec_dot(GgmlType::Q4_0, &w[..17], &x, 32).is_err());
        assert!(vec_dot(GgmlType::Q4_0, &w, &x[..33], 32).is_err());
        assert!(vec_dot(GgmlType::Q4_0, &w, &x, 31).is_err());
        assert!(vec_dot(GgmlType::Q2K, &[0; 84], &[0; 292], 256).is_err());
        assert!(vec_dot_f32(GgmlType::Q4_0, &w, &[0.0; 31]).is_err());
    }
}
