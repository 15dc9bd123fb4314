//! Tensors from `model.safetensors` by name, as f32, with shape checks and the `bert.` prefix.

use std::path::{Path, PathBuf};

use engram_kernels::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

use crate::error::{EmbedError, Result};

/// The weights file inside a model folder.
pub(crate) const WEIGHTS_FILE: &str = "model.safetensors";

/// A tensor that every BERT checkpoint has, used to detect the name prefix.
const PROBE: &str = "embeddings.word_embeddings.weight";

/// Name prefixes checkpoints use: bare `BertModel`, and `bert.` from task heads
/// (`BertForMaskedLM`, `BertForSequenceClassification`, ...).
const PREFIXES: [&str; 2] = ["", "bert."];

/// A parsed safetensors file that hands out tensors converted to f32.
pub(crate) struct TensorFile<'a> {
    st: SafeTensors<'a>,
    prefix: &'static str,
    path: PathBuf,
}

impl<'a> TensorFile<'a> {
    /// Parses the header of `bytes` (the contents of `path`) and detects the name prefix.
    pub fn parse(path: &Path, bytes: &'a [u8]) -> Result<TensorFile<'a>> {
        let st = SafeTensors::deserialize(bytes).map_err(|source| EmbedError::Safetensors {
            path: path.to_owned(),
            source,
        })?;
        let names = st.names();
        let prefix = PREFIXES
            .into_iter()
            .find(|p| names.iter().any(|n| **n == format!("{p}{PROBE}")))
            .ok_or_else(|| EmbedError::MissingTensor {
                path: path.to_owned(),
                name: PROBE.to_owned(),
            })?;
        Ok(TensorFile {
            st,
            prefix,
            path: path.to_owned(),
        })
    }

    /// Tensor `name` (without prefix), checked to have `shape`, as f32.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        self.get_any(&[name], shape)
    }

    /// The first of `names` that exists (aliases such as LayerNorm's `weight`/`gamma`); a
    /// missing tensor is reported under the first name.
    pub fn get_any(&self, names: &[&str], shape: &[usize]) -> Result<Vec<f32>> {
        let full = |n: &str| format!("{}{n}", self.prefix);
        let (name, view) = names
            .iter()
            .find_map(|n| self.st.tensor(&full(n)).ok().map(|v| (full(n), v)))
            .ok_or_else(|| EmbedError::MissingTensor {
                path: self.path.clone(),
                name: full(names[0]),
            })?;
        if view.shape() != shape {
            return Err(EmbedError::TensorShape {
                path: self.path.clone(),
                name,
                expected: shape.to_vec(),
                actual: view.shape().to_vec(),
            });
        }
        let data = view.data();
        let out = match view.dtype() {
            Dtype::F32 => data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::F16 => data
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::BF16 => data
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(EmbedError::TensorDtype {
                    path: self.path.clone(),
                    name,
                    dtype: other.to_string(),
                })
            }
        };
        Ok(out)
    }
}
