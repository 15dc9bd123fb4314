//! Malformed inputs: every public entry point returns an error instead of panicking.

use engram_kernels::{
    dequantize_row, embedding_row, matmul, quantize_activations, quantize_row, vec_dot,
    vec_dot_f32, GgmlType, KernelError, QMatrix, ThreadPool,
};

const SUPPORTED: [GgmlType; 11] = GgmlType::SUPPORTED;

#[test]
fn dequantize_every_wrong_length_errors() {
    for ty in SUPPORTED {
        let n = 256;
        let good = ty.row_bytes(n).unwrap();
        let mut out = vec![0f32; n];
        assert!(dequantize_row(ty, &vec![0; good], &mut out).is_ok(), "{ty}");
        for len in [0, 1, good - 1, good + 1, 2 * good] {
            let r = dequantize_row(ty, &vec![0; len], &mut out);
            assert!(
                matches!(r, Err(KernelError::LengthMismatch { .. })),
                "{ty} len {len}: {r:?}"
            );
        }
        if ty.block_size() > 1 {
            let r = dequantize_row(ty, &vec![0; good], &mut out[..n - 1]);
            assert!(
                matches!(r, Err(KernelError::NotBlockMultiple { .. })),
                "{ty}"
            );
        }
    }
}

#[test]
fn unsupported_types_error_everywhere() {
    for ty in GgmlType::ALL.into_iter().filter(|t| !t.is_supported()) {
        let n = 256;
        let bytes = vec![0u8; ty.row_bytes(n).unwrap()];
        let mut out = vec![0f32; n];
        let unsupported = |r: Result<(), KernelError>| {
            assert!(
                matches!(r, Err(KernelError::Unsupported { ty: t, .. }) if t == ty),
                "{ty}: {r:?}"
            )
        };
        unsupported(dequantize_row(ty, &bytes, &mut out));
        unsupported(quantize_activations(ty, &out, &mut Vec::new()));
        unsupported(vec_dot(ty, &bytes, &bytes, n).map(|_| ()));
        unsupported(vec_dot_f32(ty, &bytes, &out).map(|_| ()));
        unsupported(QMatrix::new(ty, 1, n, &bytes).map(|_| ()));
        unsupported(embedding_row(ty, &bytes, 0, n, &mut out));
    }
    // Q8_1 and Q8_K are activation formats: quantize_row writes them, nothing multiplies them.
    assert!(quantize_row(GgmlType::Q8K, &[0.0; 256], &mut Vec::new()).is_ok());
    assert!(quantize_row(GgmlType::Q4K, &[0.0; 256], &mut Vec::new()).is_err());
}

#[test]
fn vec_dot_wrong_lengths_error() {
    for ty in SUPPORTED {
        let n = 512;
        let w = vec![0u8; ty.row_bytes(n).unwrap()];
        let mut xq = Vec::new();
        quantize_activations(ty, &[0.5; 512], &mut xq).unwrap();
        assert!(vec_dot(ty, &w, &xq, n).is_ok());
        assert!(vec_dot(ty, &w[1..], &xq, n).is_err(), "{ty}");
        assert!(vec_dot(ty, &w, &xq[1..], n).is_err(), "{ty}");
        assert!(vec_dot(ty, &w, &xq, n - 256).is_err(), "{ty}");
        assert!(vec_dot(ty, &w, &xq, usize::MAX).is_err(), "{ty}");
        assert!(vec_dot_f32(ty, &w, &[0.0; 256]).is_err(), "{ty}");
    }
}

#[test]
fn qmatrix_and_matmul_wrong_shapes_error() {
    let ty = GgmlType::Q4_0;
    let data = vec![0u8; 3 * 18 * 2];
    assert!(QMatrix::new(ty, 3, 64, &data).is_ok());
    assert!(QMatrix::new(ty, 3, 64, &data[1..]).is_err());
    assert!(QMatrix::new(ty, 4, 64, &data).is_err());
    assert!(QMatrix::new(ty, 3, 48, &data).is_err());
    assert!(QMatrix::new(ty, usize::MAX, 64, &data).is_err());

    let w = QMatrix::new(ty, 3, 64, &data).unwrap();
    let pool = ThreadPool::new(2).unwrap();
    let mut out = vec![0f32; 6];
    assert!(matmul(&w, &[0.0; 128], 2, &mut out, &pool).is_ok());
    assert!(matmul(&w, &[0.0; 127], 2, &mut out, &pool).is_err());
    assert!(matmul(&w, &[0.0; 128], 2, &mut out[..5], &pool).is_err());
    assert!(matmul(&w, &[0.0; 128], usize::MAX, &mut out, &pool).is_err());
    // Public fields can be set inconsistently; matmul re-validates.
    let bad = QMatrix { rows: 4, ..w };
    assert!(matmul(&bad, &[0.0; 128], 2, &mut [0.0; 8], &pool).is_err());
    // Zero tokens, rows or columns are empty products, not errors.
    assert!(matmul(&w, &[], 0, &mut [], &pool).is_ok());
    let empty_rows = QMatrix::new(ty, 0, 64, &[]).unwrap();
    assert!(matmul(&empty_rows, &[0.0; 64], 1, &mut [], &pool).is_ok());
    let empty_cols = QMatrix::new(ty, 3, 0, &[]).unwrap();
    let mut out = [f32::NAN; 6];
    matmul(&empty_cols, &[], 2, &mut out, &pool).unwrap();
    assert_eq!(out, [0.0; 6]);
}

#[test]
fn embedding_row_bounds() {
    let ty = GgmlType::Q8_0;
    let mut table = Vec::new();
    let rows: Vec<f32> = (0..96).map(|i| i as f32).collect();
    quantize_row(ty, &rows, &mut table).unwrap();
    let mut out = vec![0f32; 32];
    embedding_row(ty, &table, 2, 32, &mut out).unwrap();
    assert!((out[31] - 95.0).abs() < 0.5 && (out[0] - 64.0).abs() < 0.5);
    assert!(matches!(
        embedding_row(ty, &table, 3, 32, &mut out),
        Err(KernelError::RowOutOfRange {
            row: 3,
            rows: 3,
            ..
        })
    ));
    assert!(embedding_row(ty, &table, 0, 31, &mut out).is_err());
    assert!(embedding_row(ty, &table, 0, 32, &mut out[..31]).is_err());
    assert!(embedding_row(ty, &table[..10], 0, 32, &mut out).is_err());
}
