//! Fixture tests: our kernels against the independent Python implementation in gguf-py.

use std::path::PathBuf;

use engram_kernels::{
    dequantize_row, quantize_activations, quantize_row, vec_dot, vec_dot_f32, GgmlType,
};
use serde::Deserialize;

/// One weight-type fixture: `n` elements of `type` and their expected dequantisation.
#[derive(Deserialize)]
struct WeightFixture {
    #[serde(rename = "type")]
    name: String,
    type_id: u32,
    n: usize,
    bytes: String,
    dequant: Vec<f64>,
    /// f64 dot of `dequant` with the unquantised activations `x[..n]`.
    fdot: f64,
    /// f64 dot of `dequant` with the dequantised vec-dot quantisation of `x[..n]`.
    qdot: f64,
    /// sum(|w_i * x_i|): the scale tolerances are measured against.
    abs_sum: f64,
}

/// The activation vector and its quantisations by the reference implementation.
#[derive(Deserialize)]
struct Activations {
    x: Vec<f64>,
    q8_0: String,
    q8_1: String,
    q8_k: String,
}

fn fixture_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(format!("{name}.json"))
}

fn load<T: for<'de> Deserialize<'de>>(name: &str) -> T {
    let path = fixture_path(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path:?}: {e}"))
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn activations() -> (Activations, Vec<f32>) {
    let a: Activations = load("activations");
    let x = a.x.iter().map(|&v| v as f32).collect();
    (a, x)
}

const SUPPORTED: [&str; 11] = [
    "f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_K", "q5_K", "q6_K",
];

fn weight(name: &str) -> (WeightFixture, GgmlType, Vec<u8>) {
    let f: WeightFixture = load(name);
    let ty = GgmlType::from_u32(f.type_id).expect("known type id");
    assert_eq!(ty.name(), f.name);
    assert_eq!(f.dequant.len(), f.n);
    let bytes = unhex(&f.bytes);
    (f, ty, bytes)
}

#[test]
fn dequantize_matches_reference_exactly() {
    for name in SUPPORTED {
        let (f, ty, bytes) = weight(name);
        let mut got = vec![f32::NAN; f.n];
        dequantize_row(ty, &bytes, &mut got).unwrap();
        for (i, (&g, &e)) in got.iter().zip(&f.dequant).enumerate() {
            // Both sides are exact f32 values: any difference is a layout or arithmetic bug.
            assert_eq!(g, e as f32, "{name}: element {i}: got {g}, expected {e}");
        }
    }
}

#[test]
fn quantize_q8_0_matches_reference_bytes() {
    let (a, x) = activations();
    let mut got = Vec::new();
    quantize_row(GgmlType::Q8_0, &x, &mut got).unwrap();
    assert_eq!(got, unhex(&a.q8_0));
    // Q4_0 and Q8_0 weights both take Q8_0 activations.
    quantize_activations(GgmlType::Q4_0, &x, &mut got).unwrap();
    assert_eq!(got, unhex(&a.q8_0));
}

#[test]
fn quantize_q8_1_matches_reference_bytes() {
    let (a, x) = activations();
    let mut got = Vec::new();
    quantize_activations(GgmlType::Q4_1, &x, &mut got).unwrap();
    assert_eq!(got, unhex(&a.q8_1));
}

#[test]
fn quantize_q8_k_matches_reference_bytes() {
    let (a, x) = activations();
    let mut got = Vec::new();
    quantize_activations(GgmlType::Q6K, &x, &mut got).unwrap();
    let want = unhex(&a.q8_k);
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            g,
            w,
            "q8_K byte {i} (block {}, offset {})",
            i / 292,
            i % 292
        );
    }
}

/// Tolerance of the quantised dot against the f64 dot of the dequantised operands, relative to
/// sum(|w_i x_i|). The integer kernels are exact up to f32 accumulation, except Q4_1's and
/// Q5_1's min term, which uses Q8_1's f16-rounded `s = d * sum(qs)` (relative error up to 2^-11).
fn qdot_tolerance(ty: GgmlType) -> f64 {
    match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 => 2e-3,
        _ => 1e-5,
    }
}

#[test]
fn vec_dot_matches_reference_dots() {
    let (_, x) = activations();
    for name in SUPPORTED {
        let (f, ty, bytes) = weight(name);
        let x = &x[..f.n];
        let mut xq = Vec::new();
        quantize_activations(ty, x, &mut xq).unwrap();
        let got = vec_dot(ty, &bytes, &xq, f.n).unwrap() as f64;

        let err_q = (got - f.qdot).abs() / f.abs_sum;
        assert!(
            err_q <= qdot_tolerance(ty),
            "{name}: vec_dot {got} vs reference quantised dot {} (rel err {err_q:e})",
            f.qdot
        );
        // Activation quantisation itself costs at most ~1% of sum(|w x|) for 8-bit types.
        let err_f = (got - f.fdot).abs() / f.abs_sum;
        assert!(
            err_f <= 1e-2,
            "{name}: vec_dot {got} vs f64 dot {} (rel err {err_f:e})",
            f.fdot
        );

        let reference = vec_dot_f32(ty, &bytes, x).unwrap() as f64;
        assert!(
            (reference - f.fdot).abs() / f.abs_sum <= 1e-6,
            "{name}: vec_dot_f32 {reference} vs {}",
            f.fdot
        );
    }
}
