//! An f64 error function to about 1e-12 relative, the tests' reference for GELU (the encoder
//! itself uses the kernels' f32 GELU, `engram_kernels::gelu_bias_rows`).

use std::f64::consts::FRAC_2_SQRT_PI;

/// Below this |z| `erf` sums its power series (at most ~25 terms); above
/// it the continued fraction for erfc converges in [`ERFC_CF_TERMS`] terms.
const ERF_SERIES_LIMIT: f64 = 2.0;

/// The erf series stops once a term falls below this fraction of the sum: far below f32's
/// 6e-8 rounding (GELU's output is f32), and a third fewer terms than running to f64 rounding.
const ERF_SERIES_REL_TOL: f64 = 1e-12;

/// Depth of the erfc continued fraction: 60 terms reach f64 rounding for every z >= 2.
const ERFC_CF_TERMS: usize = 60;

/// `1 / (2n + 1)` for the erf series, so its loop multiplies instead of dividing.
const ODD_RECIPROCALS: [f64; 40] = {
    let mut t = [0.0; 40];
    let mut n = 0;
    while n < 40 {
        t[n] = 1.0 / (2 * n + 1) as f64;
        n += 1;
    }
    t
};

/// The error function, to about 1e-12 relative; the encoder needs only the halves
/// below, the tests' reference GELU uses this.
pub(crate) fn erf(x: f64) -> f64 {
    erf_abs(x.abs()).copysign(x)
}

/// erf(z) for z >= 0.
fn erf_abs(z: f64) -> f64 {
    if z < ERF_SERIES_LIMIT {
        erf_series(z)
    } else {
        1.0 - erfc_cf(z)
    }
}

/// erfc(z) = 1 - erf(z) for z >= 0, without cancellation for large z.
fn erfc_abs(z: f64) -> f64 {
    if z < ERF_SERIES_LIMIT {
        1.0 - erf_series(z)
    } else {
        erfc_cf(z)
    }
}

/// erf(z) = 2/sqrt(pi) exp(-z^2) sum_n (2z^2)^n z / (2n+1)!!, for 0 <= z < 2: every term is
/// positive, so there is no cancellation.
fn erf_series(z: f64) -> f64 {
    let z2 = z * z;
    let (mut term, mut sum) = (z, z);
    for r in &ODD_RECIPROCALS[1..] {
        term *= 2.0 * z2 * r;
        sum += term;
        if term < sum * ERF_SERIES_REL_TOL {
            break;
        }
    }
    FRAC_2_SQRT_PI * (-z2).exp() * sum
}

/// erfc(z) = exp(-z^2)/sqrt(pi) / (z + (1/2)/(z + 1/(z + (3/2)/(z + ...)))), for z >= 2.
fn erfc_cf(z: f64) -> f64 {
    let mut t = z;
    for k in (1..=ERFC_CF_TERMS).rev() {
        t = z + (k as f64 * 0.5) / t;
    }
    (-z * z).exp() * (FRAC_2_SQRT_PI * 0.5) / t
}

#[cfg(test)]
mod tests {
    use super::*;

    /// erf and erfc against values from Python's `math.erf` / `math.erfc` (correctly rounded
    /// to the digits shown).
    #[test]
    fn erf_matches_reference_values() {
        let cases = [
            (0.0, 0.0),
            (1e-3, 1.1283787909692365e-3),
            (0.1, 0.1124629160182849),
            (0.5, 0.5204998778130465),
            (1.0, 0.8427007929497149),
            (1.5, 0.9661051464753108),
            (1.999, 0.9953015566513705),
            (2.0, 0.9953222650189527),
            (2.5, 0.999593047982555),
            (3.0, 0.9999779095030014),
            (5.0, 0.9999999999984626),
        ];
        for (x, want) in cases {
            assert!(
                (erf(x) - want).abs() < 1e-12,
                "erf({x}) = {}, want {want}",
                erf(x)
            );
            assert!((erf(-x) + want).abs() < 1e-12, "erf(-{x})");
        }
        let tails = [
            (1.0, 0.15729920705028513),
            (2.0, 4.677734981047265e-3),
            (3.0, 2.2090496998585438e-5),
            (4.0, 1.541725790028002e-8),
            (6.0, 2.1519736712498916e-17),
        ];
        for (z, want) in tails {
            let got = erfc_abs(z);
            assert!(
                ((got - want) / want).abs() < 1e-10,
                "erfc({z}) = {got}, want {want}"
            );
        }
    }
}
