//! `matmul` against a naive loop of `vec_dot`, over random shapes, types, and thread counts:
//! bit-identical, since `vec_dot` is the 1 x 1 case of the same kernels.

use engram_kernels::{
    bf16, f16, matmul, quantize_activations, vec_dot, GgmlType, QMatrix, ThreadPool,
};
use proptest::prelude::*;

const SUPPORTED: [GgmlType; 11] = GgmlType::SUPPORTED;

/// Random bytes made into a valid matrix: f16 scale fields set to small positive values and
/// float elements kept finite.
fn make_weights(ty: GgmlType, rows: usize, cols: usize, seed: &[u8]) -> Vec<u8> {
    let len = rows * ty.row_bytes(cols).unwrap();
    let mut data: Vec<u8> = seed
        .iter()
        .cycle()
        .enumerate()
        .map(|(i, &b)| b.wrapping_add((i * 31) as u8))
        .take(len)
        .collect();
    let scale_offsets: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        _ => &[],
    };
    if scale_offsets.is_empty() {
        let elem = ty.type_size();
        for (i, c) in data.chunks_exact_mut(elem).enumerate() {
            let v = ((i * 7919) % 200) as f32 / 100.0 - 1.0;
            match ty {
                GgmlType::F32 => c.copy_from_slice(&v.to_le_bytes()),
                GgmlType::F16 => c.copy_from_slice(&f16::from_f32(v).to_le_bytes()),
                _ => c.copy_from_slice(&bf16::from_f32(v).to_le_bytes()),
            }
        }
    } else {
        for (i, block) in data.chunks_exact_mut(ty.type_size()).enumerate() {
            for &off in scale_offsets {
                let v = 0.001 + ((i + off) % 17) as f32 * 0.002;
                block[off..off + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
            }
        }
    }
    data
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn matmul_matches_vec_dot_loop(
        ty_idx in 0..SUPPORTED.len(),
        rows in 1usize..12,
        blocks in 1usize..3,
        n_tokens in 1usize..4,
        seed in prop::collection::vec(any::<u8>(), 1..64),
        xs in prop::collection::vec(-3.0f32..3.0, 3 * 512),
    ) {
        let ty = SUPPORTED[ty_idx];
        let cols = blocks * 256;
        let data = make_weights(ty, rows, cols, &seed);
        let w = QMatrix::new(ty, rows, cols, &data).unwrap();
        let x = &xs[..n_tokens * cols];

        let mut expected = vec![0f32; n_tokens * rows];
        let mut xq = Vec::new();
        for t in 0..n_tokens {
            quantize_activations(ty, &x[t * cols..(t + 1) * cols], &mut xq).unwrap();
            for r in 0..rows {
                expected[t * rows + r] = vec_dot(ty, w.row(r), &xq, cols).unwrap();
            }
        }
        for threads in [1, 3] {
            let pool = ThreadPool::new(threads).unwrap();
            let mut out = vec![f32::NAN; n_tokens * rows];
            matmul(&w, x, n_tokens, &mut out, &pool).unwrap();
            // Same kernel, same inputs: bit-identical whatever the split.
            prop_assert_eq!(&out, &expected, "{} threads={}", ty, threads);
        }
    }
}

/// A matrix big enough that `matmul` really spreads it over threads (the small ones above run
/// on one thread; the crate's unit tests force splits on small shapes).
#[test]
fn large_matmul_threads_match_single_thread() {
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q6K,
    ] {
        let (rows, cols, n_tokens) = (2048, 512, 3);
        let data = make_weights(ty, rows, cols, &[1, 2, 3, 250, 77]);
        let w = QMatrix::new(ty, rows, cols, &data).unwrap();
        let x: Vec<f32> = (0..n_tokens * cols)
            .map(|i| ((i * 13) % 29) as f32 / 7.0 - 2.0)
            .collect();
        let mut one = vec![0f32; n_tokens * rows];
        matmul(&w, &x, n_tokens, &mut one, &ThreadPool::new(1).unwrap()).unwrap();
        for threads in [2, 3] {
            let pool = ThreadPool::new(threads).unwrap();
            let mut many = vec![f32::NAN; n_tokens * rows];
            matmul(&w, &x, n_tokens, &mut many, &pool).unwrap();
            assert_eq!(one, many, "{ty} threads={threads}");
            let mut single = vec![f32::NAN; rows];
            matmul(&w, &x[cols..2 * cols], 1, &mut single, &pool).unwrap();
            assert_eq!(
                single,
                one[rows..2 * rows],
                "{ty} one token, threads={threads}"
            );
        }
    }
}
