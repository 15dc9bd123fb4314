//! Unit tests: round trips through the writer, and every kind of malformed file.

use super::*;

fn sample() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", Value::String("llama".into()))
        .metadata("u8", Value::U8(7))
        .metadata("i8", Value::I8(-7))
        .metadata("u16", Value::U16(65535))
        .metadata("i16", Value::I16(-300))
        .metadata("u32", Value::U32(4_000_000_000))
        .metadata("i32", Value::I32(-2))
        .metadata("f32", Value::F32(1.5))
        .metadata("bool", Value::Bool(true))
        .metadata("u64", Value::U64(u64::MAX))
        .metadata("i64", Value::I64(i64::MIN))
        .metadata("f64", Value::F64(-0.25))
        .metadata("strings", str_array(&["a", "bé", ""]))
        .metadata(
            "nested",
            Value::Array(
                ValueType::Array,
                vec![Value::Array(
                    ValueType::I32,
                    vec![Value::I32(1), Value::I32(2)],
                )],
            ),
        )
        .metadata("empty", Value::Array(ValueType::U8, vec![]));
    w.tensor_f32("a", &[4, 2], &[1., 2., 3., 4., 5., 6., 7., 8.]);
    w.tensor("b", &[32], GgmlType::Q8_0, vec![0u8; 34]);
    w
}

#[test]
fn round_trip_every_value_type() {
    let f = GgufFile::from_bytes(sample().to_bytes()).unwrap();
    let m = f.metadata();
    assert_eq!(f.version(), 3);
    assert_eq!(m.len(), 15);
    assert_eq!(m.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(m.get("u8"), Some(&Value::U8(7)));
    assert_eq!(m.get("i8"), Some(&Value::I8(-7)));
    assert_eq!(m.get("u16"), Some(&Value::U16(65535)));
    assert_eq!(m.get("i16"), Some(&Value::I16(-300)));
    assert_eq!(m.get_u64("u32").unwrap(), 4_000_000_000);
    assert_eq!(m.get("i32").unwrap().as_i64(), Some(-2));
    assert_eq!(m.get_f64("f32").unwrap(), 1.5);
    assert!(m.get_bool("bool").unwrap());
    assert_eq!(m.get_u64("u64").unwrap(), u64::MAX);
    assert_eq!(m.get("i64"), Some(&Value::I64(i64::MIN)));
    assert_eq!(m.get_f64("f64").unwrap(), -0.25);
    assert_eq!(m.get_str_array("strings").unwrap(), vec!["a", "bé", ""]);
    let nested = m.get_array("nested").unwrap();
    assert_eq!(nested[0].as_array().unwrap()[1], Value::I32(2));
    assert_eq!(m.get_array("empty").unwrap().len(), 0);

    let a = f.tensor("a").unwrap();
    assert_eq!(a.dims, vec![4, 2]);
    assert_eq!(a.size, 32);
    let data: Vec<f32> = f
        .tensor_data(a)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(data, vec![1., 2., 3., 4., 5., 6., 7., 8.]);
    let b = f.tensor("b").unwrap();
    assert_eq!((b.ty, b.size, b.offset % 32), (GgmlType::Q8_0, 34, 0));
    assert_eq!(f.tensor_data(b).len(), 34);
}

#[test]
fn typed_getters_name_the_key() {
    let f = GgufFile::from_bytes(sample().to_bytes()).unwrap();
    let err = f.metadata().get_str("u8").unwrap_err().to_string();
    assert!(err.contains("`u8`") && err.contains("string"), "{err}");
    let err = f.metadata().get_u64("nope").unwrap_err().to_string();
    assert!(err.contains("`nope`") && err.contains("missing"), "{err}");
    assert_eq!(f.metadata().opt("nope", Metadata::get_u64).unwrap(), None);
    assert!(f.metadata().opt("bool", Metadata::get_u64).is_err());
    assert!(matches!(
        f.tensor("zz"),
        Err(GgufError::MissingTensor { .. })
    ));
}

#[test]
fn version_2_is_read() {
    let mut bytes = sample().to_bytes();
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    assert_eq!(GgufFile::from_bytes(bytes).unwrap().version(), 2);
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let bytes = sample().to_bytes();
    for len in 0..bytes.len() {
        let r = GgufFile::from_bytes(bytes[..len].to_vec());
        // A cut inside the final padding after the last tensor still holds every tensor.
        let last_end = {
            let f = GgufFile::from_bytes(bytes.clone()).unwrap();
            let t = f.tensors().last().unwrap();
            (f.data_offset + t.offset + t.size) as usize
        };
        assert_eq!(r.is_ok(), len >= last_end, "prefix of {len} bytes");
    }
}

#[test]
fn corrupting_any_header_byte_never_panics() {
    let bytes = sample().to_bytes();
    let header_len = GgufFile::from_bytes(bytes.clone()).unwrap().data_offset as usize;
    for i in 0..header_len {
        for v in [0x00, 0xff, 0x7f, 0x80] {
            let mut b = bytes.clone();
            b[i] = v;
            let _ = GgufFile::from_bytes(b);
        }
    }
}

#[test]
fn bad_magic_and_version() {
    let mut bytes = sample().to_bytes();
    bytes[0] = b'X';
    assert!(matches!(
        GgufFile::from_bytes(bytes),
        Err(GgufError::BadMagic { .. })
    ));
    let mut bytes = sample().to_bytes();
    bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(matches!(
        GgufFile::from_bytes(bytes),
        Err(GgufError::UnsupportedVersion { version: 1 })
    ));
}

/// A file whose counts lie: the reader must refuse before allocating for them.
#[test]
fn lying_counts_are_refused() {
    let mut w = GgufWriter::new();
    w.metadata("big", Value::Array(ValueType::U64, vec![Value::U64(1)]));
    let mut bytes = w.to_bytes();
    // The array count sits after magic, version, two counts, the key and the two type ids.
    let at = 4 + 4 + 8 + 8 + (8 + 3) + 4 + 4;
    bytes[at..at + 8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    let err = GgufFile::from_bytes(bytes).unwrap_err().to_string();
    assert!(err.contains("array claims"), "{err}");

    let mut bytes = sample().to_bytes();
    bytes[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        GgufFile::from_bytes(bytes),
        Err(GgufError::Corrupted { .. })
    ));
}

#[test]
fn tensor_validation() {
    // Rows that are not a whole number of blocks.
    let mut w = GgufWriter::new();
    w.tensor("q", &[33], GgmlType::Q8_0, vec![0; 34]);
    let err = GgufFile::from_bytes(w.to_bytes()).unwrap_err().to_string();
    assert!(err.contains("block size"), "{err}");

    // Data running past the end.
    let mut w = GgufWriter::new();
    w.tensor("t", &[64], GgmlType::F32, vec![0; 100]);
    let err = GgufFile::from_bytes(w.to_bytes()).unwrap_err().to_string();
    assert!(err.contains("past the end"), "{err}");

    // Duplicate names.
    let mut w = GgufWriter::new();
    w.tensor_f32("t", &[1], &[0.]).tensor_f32("t", &[1], &[0.]);
    let err = GgufFile::from_bytes(w.to_bytes()).unwrap_err().to_string();
    assert!(err.contains("twice"), "{err}");

    // A non-power-of-two alignment.
    let mut w = GgufWriter::new();
    w.metadata("general.alignment", Value::U32(24));
    assert!(GgufFile::from_bytes(w.to_bytes()).is_err());
}

#[test]
fn custom_alignment_is_honoured() {
    let mut w = GgufWriter::new();
    w.metadata("general.alignment", Value::U32(64));
    w.tensor_f32("t", &[2], &[1., 2.]);
    // The writer aligns to 32; realign the data section to 64 by hand.
    let bytes = w.to_bytes();
    let f32_start = bytes.len() - 32;
    let header_end = f32_start;
    let aligned = header_end.div_ceil(64) * 64;
    let mut b = bytes[..header_end].to_vec();
    b.resize(aligned, 0);
    b.extend_from_slice(&bytes[f32_start..]);
    let f = GgufFile::from_bytes(b).unwrap();
    assert_eq!(f.alignment(), 64);
    let t = f.tensor("t").unwrap();
    assert_eq!(&f.tensor_data(t)[..8], &[0, 0, 128, 63, 0, 0, 0, 64]);
}

#[test]
fn missing_file_is_an_io_error() {
    let err = GgufFile::open("/nonexistent/model.gguf").err().unwrap();
    assert!(matches!(err, GgufError::Io { .. }));
    assert!(err.to_string().contains("/nonexistent/model.gguf"));
}

/// A scratch path under the system temp folder, unique to this process and `name`.
fn temp_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("engram-gguf-{}-{name}", std::process::id()))
}

#[test]
fn streamed_file_equals_the_in_memory_one() {
    let q8: Vec<u8> = (0..34 * 3).map(|i| i as u8).collect();
    let f16: Vec<u8> = (0..2 * 5 * 3).map(|i| (i * 7) as u8).collect();
    let mut whole = sample();
    whole.tensor("late_q8", &[32, 3], GgmlType::Q8_0, q8.clone());
    whole.tensor("late_f16", &[5, 3], GgmlType::F16, f16.clone());

    let path = temp_path("stream.gguf");
    let mut s = sample()
        .stream(
            &path,
            vec![
                TensorDecl::new("late_q8", &[32, 3], GgmlType::Q8_0),
                TensorDecl::new("late_f16", &[5, 3], GgmlType::F16),
            ],
        )
        .unwrap();
    assert_eq!(s.next_name(), Some("late_q8"));
    s.write_tensor(&q8).unwrap();
    s.write_tensor(&f16).unwrap();
    assert_eq!(s.next_name(), None);
    let size = s.finish().unwrap();
    let bytes = std::fs::read(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(size, bytes.len() as u64);
    assert_eq!(bytes, whole.to_bytes());
    let f = GgufFile::from_bytes(bytes).unwrap();
    assert_eq!(f.tensor_data(f.tensor("late_f16").unwrap()), &f16[..]);
}

#[test]
fn stream_misuse_is_an_error() {
    let path = temp_path("misuse.gguf");
    let partial = temp_path("misuse.gguf.partial");
    let w = GgufWriter::new();

    let err = w
        .stream(&path, vec![TensorDecl::new("q", &[33], GgmlType::Q8_0)])
        .err()
        .unwrap();
    assert!(
        matches!(err, GgufError::NotBlockMultiple { row: 33, .. }),
        "{err}"
    );

    let decl = || vec![TensorDecl::new("t", &[4], GgmlType::F32)];
    let mut s = w.stream(&path, decl()).unwrap();
    let err = s.write_tensor(&[0; 12]).unwrap_err();
    assert!(
        matches!(
            err,
            GgufError::TensorBytes {
                found: 12,
                expected: 16,
                ..
            }
        ),
        "{err}"
    );
    s.write_tensor(&[0; 16]).unwrap();
    let err = s.write_tensor(&[0; 16]).unwrap_err();
    assert!(
        matches!(
            err,
            GgufError::TensorCount {
                declared: 1,
                written: 2
            }
        ),
        "{err}"
    );

    // Finishing early leaves only the partial file, never one under the wanted name.
    let s = w.stream(&path, decl()).unwrap();
    let err = s.finish().unwrap_err();
    assert!(
        matches!(
            err,
            GgufError::TensorCount {
                declared: 1,
                written: 0
            }
        ),
        "{err}"
    );
    assert!(!path.exists());
    std::fs::remove_file(&partial).unwrap();
}
