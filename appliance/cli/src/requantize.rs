//! `engram requantize`: rewrites a GGUF model's weights in a fixed mix of storage types, so that
//! the golden tests run the engine on K-quant and Q5 weights made from the default model.
//!
//! Every tensor is dequantised (`engram_kernels::dequantize_row`) and quantised again
//! ([`crate::quantize`]) to the type its [`Mix`] gives it; the metadata (tokenizer, chat
//! template, hyper-parameters) is copied unchanged but for `general.file_type`, and the tensors
//! keep their order. The same input gives the same bytes whatever the thread count: each row is
//! quantised on its own and the rows are written in order.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use engram_gguf::{
    GgmlType, GgufFile, GgufWriter, TensorDecl, TensorInfo, Value, DEFAULT_ALIGNMENT,
};
use engram_kernels::dequantize_row;

use crate::quantize::{names, quantize_row};

#[derive(Args)]
pub struct RequantizeArgs {
    /// The GGUF model to read (any type the CPU engine runs).
    #[arg(long)]
    from: PathBuf,
    /// Which type each tensor gets.
    #[arg(long, value_enum)]
    mix: Mix,
    /// Where to write the new GGUF file.
    #[arg(long)]
    out: PathBuf,
    /// Threads quantising rows [default: all cores]; the bytes do not depend on it.
    #[arg(long)]
    threads: Option<usize>,
}

/// The storage mixes `requantize` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mix {
    /// Every K-quant and Q5 format the CPU engine runs: matrices whose rows are a multiple of
    /// 256 long cycle through Q4_K, Q5_K and Q6_K by layer; the other matrices alternate Q5_0
    /// and Q5_1 by layer, attention and FFN opposite; the token embedding and output head
    /// Q8_0; vectors (norms) F32.
    Kmix,
}

/// `general.file_type` of a `kmix` file: llama.cpp's `LLAMA_FTYPE_MOSTLY_Q5_K_M`, the nearest
/// of its named mixes (4- to 6-bit K-quants with 5-bit legacy blocks). llama.cpp and Engram only
/// print it; each tensor's own type is what is read.
const KMIX_FILE_TYPE: u32 = 17;

impl Mix {
    fn name(self) -> &'static str {
        match self {
            Mix::Kmix => "kmix",
        }
    }

    fn file_type(self) -> u32 {
        match self {
            Mix::Kmix => KMIX_FILE_TYPE,
        }
    }

    /// The type of tensor `name` with ggml dims `dims` (innermost first). A matrix whose rows
    /// are not whole 32-element blocks stays F32.
    fn tensor_type(self, name: &str, dims: &[u64]) -> GgmlType {
        let cols = dims.first().copied().unwrap_or(0);
        if dims.len() != 2 || !cols.is_multiple_of(32) {
            return GgmlType::F32;
        }
        if matches!(name, "token_embd.weight" | "output.weight") {
            return GgmlType::Q8_0;
        }
        let layer = layer_of(name).unwrap_or(0);
        if cols.is_multiple_of(256) {
            [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K][layer % 3]
        } else if (layer + usize::from(name.contains(".ffn_"))).is_multiple_of(2) {
            GgmlType::Q5_0
        } else {
            GgmlType::Q5_1
        }
    }
}

/// The layer index of a `blk.N.` tensor.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// Writes the requantised model `a` describes.
pub fn requantize(a: RequantizeArgs) -> Result<()> {
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let started = Instant::now();
    let src = GgufFile::open(&a.from).with_context(|| format!("opening {}", a.from.display()))?;
    if src.alignment() != DEFAULT_ALIGNMENT {
        bail!(
            "{} aligns tensors to {} bytes; the writer only writes {DEFAULT_ALIGNMENT}",
            a.from.display(),
            src.alignment()
        );
    }
    let mut writer = GgufWriter::new();
    let mut typed = false;
    for (key, value) in src.metadata().iter() {
        if key == "general.file_type" {
            writer.metadata(key, Value::U32(a.mix.file_type()));
            typed = true;
        } else {
            writer.metadata(key, value.clone());
        }
    }
    if !typed {
        writer.metadata("general.file_type", Value::U32(a.mix.file_type()));
    }

    let plan: Vec<(&TensorInfo, GgmlType)> = src
        .tensors()
        .iter()
        .map(|t| (t, a.mix.tensor_type(&t.name, &t.dims)))
        .collect();
    if let Some((t, _)) = plan.iter().find(|(t, _)| !t.ty.is_supported()) {
        bail!(
            "{} is {}, which cannot be dequantised (readable: {})",
            t.name,
            t.ty,
            names(&GgmlType::SUPPORTED)
        );
    }
    let decls = plan
        .iter()
        .map(|(t, ty)| TensorDecl::new(t.name.clone(), &t.dims, *ty))
        .collect();
    let mut stream = writer
        .stream(&a.out, decls)
        .with_context(|| format!("creating {}", a.out.display()))?;
    let mut counts: Vec<(GgmlType, usize)> = Vec::new();
    for &(t, ty) in &plan {
        let data = requantize_tensor(src.tensor_data(t), t, ty, threads)
            .with_context(|| format!("requantising {}", t.name))?;
        stream
            .write_tensor(&data)
            .with_context(|| format!("writing {}", t.name))?;
        match counts.iter_mut().find(|(c, _)| *c == ty) {
            Some((_, n)) => *n += 1,
            None => counts.push((ty, 1)),
        }
    }
    let size = stream.finish()?;
    let counts: Vec<String> = counts.iter().map(|(t, n)| format!("{n} {t}")).collect();
    println!(
        "wrote {} ({}: {}; {:.1} MiB) in {:.1} s",
        a.out.display(),
        a.mix.name(),
        counts.join(", "),
        size as f64 / 1048576.0,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The bytes of tensor `t` (stored as `src`) in type `to`, its rows split over `threads`.
fn requantize_tensor(src: &[u8], t: &TensorInfo, to: GgmlType, threads: usize) -> Result<Vec<u8>> {
    let cols = t.dims.first().copied().unwrap_or(1) as usize;
    let rows = (t.n_elements() as usize).checked_div(cols).unwrap_or(0);
    let (Some(in_row), Some(out_row)) = (t.ty.row_bytes(cols), to.row_bytes(cols)) else {
        bail!("rows of {cols} are not whole blocks of {} and {to}", t.ty);
    };
    let mut out = vec![0u8; rows * out_row];
    let per_thread = rows.div_ceil(threads).max(1);
    std::thread::scope(|s| {
        let workers: Vec<_> = src
            .chunks(per_thread * in_row)
            .zip(out.chunks_mut(per_thread * out_row))
            .map(|(from, into)| {
                s.spawn(move || -> Result<()> {
                    let mut x = vec![0f32; cols];
                    for (a, b) in from
                        .chunks_exact(in_row)
                        .zip(into.chunks_exact_mut(out_row))
                    {
                        dequantize_row(t.ty, a, &mut x)?;
                        quantize_row(to, &x, b)?;
                    }
                    Ok(())
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().expect("a requantising thread panicked"))
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gen_model::{self, Dims};
    use engram_model::{Logits, Model};

    fn temp_path(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("engram-requantize-{}-{name}", std::process::id()))
    }

    #[test]
    fn kmix_types_by_row_length_and_layer() {
        let ty = |name: &str, dims: &[u64]| Mix::Kmix.tensor_type(name, dims);
        // SmolLM2-135M: ffn_down rows of 1536, every other matrix rows of 576.
        assert_eq!(ty("blk.0.ffn_down.weight", &[1536, 576]), GgmlType::Q4K);
        assert_eq!(ty("blk.1.ffn_down.weight", &[1536, 576]), GgmlType::Q5K);
        assert_eq!(ty("blk.29.ffn_down.weight", &[1536, 576]), GgmlType::Q6K);
        assert_eq!(ty("blk.0.attn_q.weight", &[576, 576]), GgmlType::Q5_0);
        assert_eq!(ty("blk.0.ffn_up.weight", &[576, 1536]), GgmlType::Q5_1);
        assert_eq!(ty("blk.7.attn_k.weight", &[576, 192]), GgmlType::Q5_1);
        assert_eq!(ty("blk.7.ffn_gate.weight", &[576, 1536]), GgmlType::Q5_0);
        assert_eq!(ty("token_embd.weight", &[576, 49152]), GgmlType::Q8_0);
        assert_eq!(ty("output.weight", &[576, 49152]), GgmlType::Q8_0);
        assert_eq!(ty("blk.3.attn_norm.weight", &[576]), GgmlType::F32);
        assert_eq!(ty("blk.3.attn_q.weight", &[100, 100]), GgmlType::F32);
    }

    /// A small random model with rows of 96 (Q5_0/Q5_1) and 256 (K-quants) over 3 layers:
    /// every type of the mix. Returns its path.
    fn source_model(name: &str) -> PathBuf {
        let d = Dims::dense(3, 96, 256, (3, 1), 320);
        let path = temp_path(name);
        let (plan, _) = gen_model::tensor_plan(&d, GgmlType::Q8_0);
        let meta = gen_model::metadata("src", &d, 256);
        gen_model::write(&meta, &plan, &path, 3, 2, d.embedding_std).unwrap();
        path
    }

    fn run(from: &std::path::Path, out: &std::path::Path, threads: usize) {
        requantize(RequantizeArgs {
            from: from.to_path_buf(),
            mix: Mix::Kmix,
            out: out.to_path_buf(),
            threads: Some(threads),
        })
        .unwrap();
    }

    fn logits(path: &std::path::Path) -> Vec<f32> {
        let model = Model::load(path, 2).unwrap();
        let mut kv = model.new_cache(8);
        model
            .forward(&[1, 17, 300, 5, 42], &[0, 1, 2, 3, 4], &mut kv, Logits::All)
            .unwrap()
    }

    /// The mix's every type is written, the metadata is the source's but for the file type,
    /// the bytes do not depend on the thread count, and the model computes what its source
    /// does, to the error of 5-bit weights.
    #[test]
    fn requantized_model_is_deterministic_and_close_to_its_source() {
        let src = source_model("src.gguf");
        let (one, four) = (temp_path("one.gguf"), temp_path("four.gguf"));
        run(&src, &one, 1);
        run(&src, &four, 4);
        let bytes = std::fs::read(&one).unwrap();
        assert!(
            bytes == std::fs::read(&four).unwrap(),
            "thread count changed the bytes"
        );

        let (a, b) = (GgufFile::open(&src).unwrap(), GgufFile::open(&one).unwrap());
        let meta = |f: &GgufFile| {
            f.metadata()
                .iter()
                .map(|(k, v)| (k.to_owned(), v.clone()))
                .collect::<Vec<_>>()
        };
        let (ma, mb) = (meta(&a), meta(&b));
        assert_eq!(ma.len() + 1, mb.len(), "general.file_type added");
        assert_eq!(ma[..], mb[..ma.len()]);
        assert_eq!(
            b.metadata().get("general.file_type"),
            Some(&Value::U32(KMIX_FILE_TYPE))
        );
        let mut types: Vec<GgmlType> = b.tensors().iter().map(|t| t.ty).collect();
        types.sort_by_key(|t| t.id());
        types.dedup();
        assert_eq!(
            types,
            [
                GgmlType::F32,
                GgmlType::Q5_0,
                GgmlType::Q5_1,
                GgmlType::Q8_0,
                GgmlType::Q4K,
                GgmlType::Q5K,
                GgmlType::Q6K
            ]
        );
        let names = |f: &GgufFile| {
            f.tensors()
                .iter()
                .map(|t| t.name.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&a), names(&b));

        let (la, lb) = (logits(&src), logits(&one));
        let rms = |v: &mut dyn Iterator<Item = f32>| {
            let (sum, n) = v.fold((0f32, 0usize), |(s, n), x| (s + x * x, n + 1));
            (sum / n as f32).sqrt()
        };
        let spread = rms(&mut la.iter().copied());
        let moved = rms(&mut la.iter().zip(&lb).map(|(x, y)| x - y));
        for p in [src, one, four] {
            std::fs::remove_file(p).unwrap();
        }
        eprintln!("logits move by {moved} RMS against an RMS of {spread}");
        assert!(
            moved < 0.1 * spread,
            "logits move by {moved} RMS against an RMS of {spread}"
        );
    }

    #[test]
    fn file_type_is_added_when_missing() {
        let mut w = GgufWriter::new();
        w.metadata("general.architecture", Value::String("llama".into()))
            .tensor_f32("blk.0.attn_norm.weight", &[4], &[1.0, 2.0, 3.0, 4.0]);
        let src = temp_path("bare.gguf");
        let out = temp_path("bare-out.gguf");
        w.write(&src).unwrap();
        run(&src, &out, 2);
        let f = GgufFile::open(&out).unwrap();
        assert_eq!(
            f.metadata().get("general.file_type"),
            Some(&Value::U32(KMIX_FILE_TYPE))
        );
        let (t, source) = (
            f.tensor("blk.0.attn_norm.weight").unwrap(),
            GgufFile::open(&src).unwrap(),
        );
        assert_eq!(t.ty, GgmlType::F32);
        assert_eq!(
            f.tensor_data(t),
            source.tensor_data(source.tensor(&t.name).unwrap())
        );
        std::fs::remove_file(src).unwrap();
        std::fs::remove_file(out).unwrap();
    }
}
