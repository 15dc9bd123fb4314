//! The daemon's configuration: one TOML file, then `ENGRAM_*` environment variables, then
//! command-line flags, parsed into [`RawConfig`] and validated into [`Config`].

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use engram_fusion::{Policy, DEFAULT_POLICY};
use engram_kvstore::KvDtype;
use serde::Deserialize;

use crate::error::{Result, ServerError};

/// Where the daemon listens unless told otherwise: loopback only, so a fresh install is not
/// reachable from the network before keys exist.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
/// The default LLM file inside the models folder (the one `engram` uses).
pub const DEFAULT_LLM: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The default embedding model folder inside the models folder.
pub const DEFAULT_EMBEDDER: &str = "all-MiniLM-L6-v2";
/// In the models folder: OpenAI's cl100k_base vocabulary (scripts/fetch-models.sh).
pub const DEFAULT_TOKEN_VOCAB: &str = "cl100k_base.tiktoken";
/// Largest upload (one multipart request or one JSON body): 64 MiB holds any office document
/// we parse while keeping a single request from filling memory.
pub const DEFAULT_MAX_UPLOAD_BYTES: usize = 64 << 20;
/// Most tokens one answer may generate; requests asking for more are refused.
pub const DEFAULT_MAX_TOKENS: usize = 1024;
/// Most chunks one search or question may retrieve (per collection).
pub const DEFAULT_MAX_TOP_K: usize = 50;
/// Ingestion requests running or waiting at once; more get 429 (the knowledge base has one
/// writer, so more parallelism would only queue).
pub const DEFAULT_INGEST_CONCURRENCY: usize = 4;
/// Longest search query or question: a question is a few sentences, the embedder reads 256
/// word pieces, and BM25's cost grows with every term, so a megabyte "query" only ties up the
/// knowledge base.
pub const DEFAULT_MAX_QUERY_BYTES: usize = 4096;
/// Failed authentication attempts allowed per client address per minute.
pub const DEFAULT_AUTH_FAILURES_PER_MINUTE: u32 = 10;
/// How long a successful key verification is remembered: argon2 costs tens of milliseconds
/// per check, a minute of reuse makes it once per client per minute. Revocation does not wait
/// for it: the cache is cleared whenever the key file changes.
pub const DEFAULT_AUTH_CACHE_SECS: u64 = 60;

/// The configuration file as written: every field optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub listen: Option<String>,
    pub data_dir: Option<PathBuf>,
    /// `auto` or a profile name.
    pub profile: Option<String>,
    pub profiles_dir: Option<PathBuf>,
    #[serde(default)]
    pub models: RawModels,
    #[serde(default)]
    pub kv: RawKv,
    #[serde(default)]
    pub fusion: RawFusion,
    #[serde(default)]
    pub answers: RawAnswers,
    #[serde(default)]
    pub limits: RawLimits,
    #[serde(default)]
    pub auth: RawAuth,
    #[serde(default)]
    pub tls: RawTls,
    #[serde(default)]
    pub storage: RawStorage,
    #[serde(default)]
    pub gpu: RawGpu,
    #[serde(default)]
    pub openai: RawOpenAi,
    #[serde(default)]
    pub ingest: RawIngest,
}

/// `[ingest]`: how uploaded documents are read.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawIngest {
    /// `auto` (the default): images and PDF pages without a text layer are read by Tesseract
    /// when it is installed (the package depends on it); `off`: they are refused, saying so.
    pub ocr: Option<String>,
    /// Tesseract's languages, `+`-joined; default `chi_sim+eng`.
    pub ocr_languages: Option<String>,
    /// Most seconds one page's OCR may take; default 120.
    pub ocr_page_timeout_secs: Option<u64>,
}

/// Most seconds one scanned page's OCR takes by default: a dense A4 page at 300 dpi reads in a
/// few seconds on one core, so this only stops a pathological one.
pub const DEFAULT_OCR_PAGE_TIMEOUT_SECS: u64 = 120;

/// `[openai]`: the OpenAI-compatible endpoints.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawOpenAi {
    /// Model names `/v1/embeddings` answers with the served embedder, beside its own id, its
    /// plain name and `engram`: what OpenAI's clients send by default (LangChain's
    /// `OpenAIEmbeddings()` asks for `text-embedding-ada-002`). Default
    /// [`DEFAULT_EMBEDDING_ALIASES`]; `[]` turns them off. Listed in `/v1/models`.
    pub embedding_aliases: Option<Vec<String>>,
}

/// OpenAI's embedding models, which clients name by default: answered by the served embedder
/// (its own vectors, 384 wide for all-MiniLM-L6-v2, not OpenAI's).
pub const DEFAULT_EMBEDDING_ALIASES: [&str; 3] = [
    "text-embedding-ada-002",
    "text-embedding-3-small",
    "text-embedding-3-large",
];

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawGpu {
    /// `auto` (the default): decode on the first GPU when one is found and passes the start-up
    /// check; `off`: generation stays on the CPU.
    pub serving: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawStorage {
    /// Free space kept for the catalog and indexes (default: 5 % of the file system, 1 MiB to
    /// 1 GiB).
    pub reserve_mib: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawModels {
    pub dir: Option<PathBuf>,
    pub llm: Option<PathBuf>,
    pub embedder: Option<PathBuf>,
    /// The tiktoken vocabulary token-id embedding inputs are read with.
    pub token_vocab: Option<PathBuf>,
    pub threads: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawKv {
    pub dir: Option<PathBuf>,
    pub dram_mib: Option<u64>,
    pub nvme_gib: Option<u64>,
    pub dtype: Option<String>,
    pub prefix_cache_mib: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawFusion {
    pub policy: Option<String>,
    pub gate_max_kl: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAnswers {
    /// Logit bias of the passages' continuations of a number or a character a RAG answer is
    /// writing (`engram_rag::CopyBias`); 0 turns it off.
    pub copy_bias: Option<f32>,
    /// Whether a RAG answer that starts with what the evidence sentence does not support (a
    /// number it does not state, a bare yes or no) is the sentence instead
    /// (`engram_rag::OutputText::check_start`); on unless set false.
    pub check_start: Option<bool>,
    /// Answer rules turned off by name (`engram_rag::AnswerRule`; `engramd rules` lists
    /// them): e.g. `bare_polar` for a model that answers yes-or-no questions well.
    pub rules_off: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimits {
    pub max_upload_bytes: Option<usize>,
    pub queue_depth: Option<usize>,
    pub batch_size: Option<usize>,
    pub max_tokens: Option<usize>,
    pub max_top_k: Option<usize>,
    pub ingest_concurrency: Option<usize>,
    pub max_query_bytes: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAuth {
    pub failures_per_minute: Option<u32>,
    pub cache_secs: Option<u64>,
}

/// `[tls]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    /// `auto` (the default: TLS when listening beyond loopback), `on` or `off` (plain HTTP
    /// even beyond loopback: only behind a TLS-terminating proxy).
    pub mode: Option<String>,
    /// PEM certificate chain and private key; without them a self-signed pair is generated
    /// in `<data_dir>/tls/` at the first start.
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

/// Values given on the command line; they win over the file and the environment.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub listen: Option<String>,
    pub data_dir: Option<PathBuf>,
}

/// The validated configuration. Budgets left to the profile are `None` here.
#[derive(Clone, Debug)]
pub struct Config {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    /// `None`: pick the best-matching profile.
    pub profile: Option<String>,
    pub profiles_dir: Option<PathBuf>,
    pub llm: PathBuf,
    pub embedder: PathBuf,
    /// `cl100k_base.tiktoken`: the ids OpenAI's embedding clients send are read with it (token
    /// arrays are refused when it is absent).
    pub token_vocab: PathBuf,
    pub threads: Option<usize>,
    pub kv_dir: PathBuf,
    pub kv_dram_mib: Option<u64>,
    pub kv_nvme_gib: Option<u64>,
    pub kv_dtype: KvDtype,
    pub prefix_cache_mib: u64,
    pub policy: Policy,
    pub gate_max_kl: f64,
    /// See [`RawAnswers::copy_bias`].
    pub copy_bias: f32,
    /// See [`RawAnswers::check_start`].
    pub check_start: bool,
    /// See [`RawAnswers::rules_off`].
    pub rules_off: engram_rag::AnswerRules,
    pub max_upload_bytes: usize,
    pub queue_depth: Option<usize>,
    /// Sequences decoded together at most; `None`: the profile's.
    pub batch_size: Option<usize>,
    pub max_tokens: usize,
    pub max_top_k: usize,
    pub ingest_concurrency: usize,
    pub auth_failures_per_minute: u32,
    pub auth_cache_secs: u64,
    /// Longest search query or question, in bytes.
    pub max_query_bytes: usize,
    /// Free space kept for the catalog and indexes; `None`: `storage::default_reserve`.
    pub storage_reserve_bytes: Option<u64>,
    pub tls: crate::tls::TlsSetting,
    /// `[gpu] serving = "auto"`: decode on a GPU when one is usable.
    pub gpu_serving: bool,
    /// See [`RawOpenAi::embedding_aliases`].
    pub embedding_aliases: Vec<String>,
    /// `[ingest] ocr = "auto"`: Tesseract's languages and the page time bound; `None`: OCR off.
    pub ocr: Option<(String, std::time::Duration)>,
}

/// Prefix cache budget when the file says nothing: the system prompt and chat template of
/// a small model take well under a MiB, so 256 MiB keeps many chat histories.
pub const DEFAULT_PREFIX_CACHE_MIB: u64 = 256;

impl RawConfig {
    /// Reads and parses a TOML file.
    pub fn from_file(path: &Path) -> Result<RawConfig> {
        let text =
            std::fs::read_to_string(path).map_err(|e| ServerError::io("reading", path, e))?;
        RawConfig::parse(&text).map_err(|e| match e {
            ServerError::Config { key, reason } => ServerError::Config {
                key,
                reason: format!("{reason} (in {})", path.display()),
            },
            e => e,
        })
    }

    /// Parses TOML text.
    pub fn parse(text: &str) -> Result<RawConfig> {
        toml::from_str(text).map_err(|e| {
            let key = e
                .span()
                .map(|s| text[s].trim().to_owned())
                .unwrap_or_default();
            ServerError::config(key, e.message().to_owned())
        })
    }

    /// Applies `ENGRAM_LISTEN`, `ENGRAM_DATA_DIR`, `ENGRAM_MODELS_DIR`, `ENGRAM_THREADS` from
    /// `env` (a lookup, so tests need not touch the process environment).
    pub fn apply_env(&mut self, env: impl Fn(&str) -> Option<String>) -> Result<()> {
        if let Some(v) = env("ENGRAM_LISTEN") {
            self.listen = Some(v);
        }
        if let Some(v) = env("ENGRAM_DATA_DIR") {
            self.data_dir = Some(v.into());
        }
        if let Some(v) = env("ENGRAM_MODELS_DIR") {
            self.models.dir = Some(v.into());
        }
        if let Some(v) = env("ENGRAM_THREADS") {
            let n = v.trim().parse().map_err(|_| {
                ServerError::config("ENGRAM_THREADS", format!("`{v}` is not a whole number"))
            })?;
            self.models.threads = Some(n);
        }
        Ok(())
    }

    /// Applies command-line flags.
    pub fn apply_overrides(&mut self, o: &Overrides) {
        if let Some(l) = &o.listen {
            self.listen = Some(l.clone());
        }
        if let Some(d) = &o.data_dir {
            self.data_dir = Some(d.clone());
        }
    }

    /// Checks every value and fills in defaults.
    pub fn validate(self) -> Result<Config> {
        let listen_text = self.listen.as_deref().unwrap_or(DEFAULT_LISTEN);
        let listen: SocketAddr = listen_text.parse().map_err(|_| {
            ServerError::config(
                "listen",
                format!("`{listen_text}` is not an address:port like 127.0.0.1:8080"),
            )
        })?;
        let data_dir = self.data_dir.unwrap_or_else(|| PathBuf::from("data"));
        if data_dir.as_os_str().is_empty() {
            return Err(ServerError::config("data_dir", "must not be empty"));
        }
        let profile = match self.profile.as_deref().map(str::trim) {
            None | Some("auto") | Some("") => None,
            Some(name) => Some(name.to_owned()),
        };
        let models_dir = self.models.dir.unwrap_or_else(|| PathBuf::from("models"));
        let llm = self
            .models
            .llm
            .unwrap_or_else(|| models_dir.join(DEFAULT_LLM));
        let embedder = self
            .models
            .embedder
            .unwrap_or_else(|| models_dir.join(DEFAULT_EMBEDDER));
        let token_vocab = self
            .models
            .token_vocab
            .unwrap_or_else(|| models_dir.join(DEFAULT_TOKEN_VOCAB));
        if let Some(0) = self.models.threads {
            return Err(ServerError::config("models.threads", "must be at least 1"));
        }
        let kv_dtype = KvDtype::parse(self.kv.dtype.as_deref().unwrap_or("f16"))
            .map_err(|e| ServerError::config("kv.dtype", e.to_string()))?;
        let policy = match &self.fusion.policy {
            Some(p) => p.parse().map_err(|e: engram_fusion::FusionError| {
                ServerError::config("fusion.policy", e.to_string())
            })?,
            None => DEFAULT_POLICY,
        };
        let gate_max_kl = self
            .fusion
            .gate_max_kl
            .unwrap_or(engram_fusion::GATE_MAX_KL);
        if !(gate_max_kl.is_finite() && gate_max_kl > 0.0) {
            return Err(ServerError::config(
                "fusion.gate_max_kl",
                format!("{gate_max_kl} must be a positive number of nats"),
            ));
        }
        let copy_bias = self
            .answers
            .copy_bias
            .unwrap_or(engram_rag::DEFAULT_COPY_BIAS);
        engram_rag::check_copy_bias(copy_bias)
            .map_err(|e| ServerError::config("answers.copy_bias", e))?;
        let gpu_serving = match self.gpu.serving.as_deref() {
            None | Some("auto") => true,
            Some("off") => false,
            Some(other) => {
                return Err(ServerError::config(
                    "gpu.serving",
                    format!("`{other}` is neither \"auto\" nor \"off\""),
                ))
            }
        };
        let ocr = match self.ingest.ocr.as_deref() {
            None | Some("auto") => {
                let languages = self
                    .ingest
                    .ocr_languages
                    .clone()
                    .unwrap_or_else(|| engram_parse::DEFAULT_OCR_LANGUAGES.to_string());
                let valid = |l: &str| {
                    !l.is_empty() && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                };
                if !languages.split('+').all(valid) {
                    return Err(ServerError::config(
                        "ingest.ocr_languages",
                        format!("`{languages}` is not a +-joined list of Tesseract language names"),
                    ));
                }
                let secs = self
                    .ingest
                    .ocr_page_timeout_secs
                    .unwrap_or(DEFAULT_OCR_PAGE_TIMEOUT_SECS);
                if secs == 0 {
                    return Err(ServerError::config(
                        "ingest.ocr_page_timeout_secs",
                        "must be at least 1",
                    ));
                }
                Some((languages, std::time::Duration::from_secs(secs)))
            }
            Some("off") => None,
            Some(other) => {
                return Err(ServerError::config(
                    "ingest.ocr",
                    format!("`{other}` is neither \"auto\" nor \"off\""),
                ))
            }
        };
        let l = &self.limits;
        let positive = |key: &str, v: Option<usize>, default: usize| -> Result<usize> {
            match v {
                Some(0) => Err(ServerError::config(key, "must be at least 1")),
                Some(v) => Ok(v),
                None => Ok(default),
            }
        };
        let max_upload_bytes = positive(
            "limits.max_upload_bytes",
            l.max_upload_bytes,
            DEFAULT_MAX_UPLOAD_BYTES,
        )?;
        let max_tokens = positive("limits.max_tokens", l.max_tokens, DEFAULT_MAX_TOKENS)?;
        let max_top_k = positive("limits.max_top_k", l.max_top_k, DEFAULT_MAX_TOP_K)?;
        let max_query_bytes = positive(
            "limits.max_query_bytes",
            l.max_query_bytes,
            DEFAULT_MAX_QUERY_BYTES,
        )?;
        if max_query_bytes > engram_kb::MAX_QUERY_BYTES {
            return Err(ServerError::config(
                "limits.max_query_bytes",
                format!("must be at most {}", engram_kb::MAX_QUERY_BYTES),
            ));
        }
        if self.storage.reserve_mib == Some(0) {
            return Err(ServerError::config(
                "storage.reserve_mib",
                "must be at least 1",
            ));
        }
        let ingest_concurrency = positive(
            "limits.ingest_concurrency",
            l.ingest_concurrency,
            DEFAULT_INGEST_CONCURRENCY,
        )?;
        for (key, v) in [
            ("limits.queue_depth", l.queue_depth),
            ("limits.batch_size", l.batch_size),
        ] {
            if v == Some(0) {
                return Err(ServerError::config(key, "must be at least 1"));
            }
        }
        let auth_failures_per_minute = self
            .auth
            .failures_per_minute
            .unwrap_or(DEFAULT_AUTH_FAILURES_PER_MINUTE);
        if auth_failures_per_minute == 0 {
            return Err(ServerError::config(
                "auth.failures_per_minute",
                "must be at least 1",
            ));
        }
        let tls_files = match (self.tls.cert, self.tls.key) {
            (Some(c), Some(k)) => Some((c, k)),
            (None, None) => None,
            _ => {
                return Err(ServerError::config(
                    "tls.cert",
                    "give both `cert` and `key`, or neither (a self-signed pair)",
                ))
            }
        };
        let tls = match self.tls.mode.as_deref().unwrap_or("auto") {
            "auto" if listen.ip().is_loopback() => crate::tls::TlsSetting::Off,
            "auto" | "on" => crate::tls::TlsSetting::On(tls_files),
            "off" => crate::tls::TlsSetting::Off,
            other => {
                return Err(ServerError::config(
                    "tls.mode",
                    format!("`{other}`: expected auto, on or off"),
                ))
            }
        };
        let names = self.answers.rules_off.as_deref().unwrap_or_default();
        let rules_off = engram_rag::AnswerRules::from_names(names.iter().map(String::as_str))
            .map_err(|e| ServerError::config("answers.rules_off", e))?;
        let embedding_aliases = self
            .openai
            .embedding_aliases
            .unwrap_or_else(|| DEFAULT_EMBEDDING_ALIASES.map(str::to_owned).to_vec());
        for (i, a) in embedding_aliases.iter().enumerate() {
            if a.trim().is_empty() || a.trim() != a || a == "engram" {
                return Err(ServerError::config(
                    "openai.embedding_aliases",
                    format!(
                        "{a:?}: an alias is a model name without spaces around it, not `engram`"
                    ),
                ));
            }
            if embedding_aliases[..i].contains(a) {
                return Err(ServerError::config(
                    "openai.embedding_aliases",
                    format!("{a:?} is listed twice"),
                ));
            }
        }
        Ok(Config {
            tls,
            listen,
            kv_dir: self.kv.dir.unwrap_or_else(|| data_dir.join("kv")),
            data_dir,
            profile,
            profiles_dir: self.profiles_dir,
            llm,
            embedder,
            token_vocab,
            threads: self.models.threads,
            kv_dram_mib: self.kv.dram_mib,
            kv_nvme_gib: self.kv.nvme_gib,
            kv_dtype,
            prefix_cache_mib: self.kv.prefix_cache_mib.unwrap_or(DEFAULT_PREFIX_CACHE_MIB),
            policy,
            gate_max_kl,
            copy_bias,
            check_start: self.answers.check_start.unwrap_or(true),
            rules_off,
            max_upload_bytes,
            queue_depth: l.queue_depth,
            batch_size: l.batch_size,
            max_tokens,
            max_top_k,
            ingest_concurrency,
            auth_failures_per_minute,
            auth_cache_secs: self.auth.cache_secs.unwrap_or(DEFAULT_AUTH_CACHE_SECS),
            max_query_bytes,
            storage_reserve_bytes: self.storage.reserve_mib.map(|m| m << 20),
            gpu_serving,
            embedding_aliases,
            ocr,
        })
    }
}

/// File (optional), then environment, then flags, then validation.
pub fn load(file: Option<&Path>, overrides: &Overrides) -> Result<Config> {
    let mut raw = match file {
        Some(p) => RawConfig::from_file(p)?,
        None => RawConfig::default(),
    };
    raw.apply_env(|k| std::env::var(k).ok())?;
    raw.apply_overrides(overrides);
    raw.validate()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults() {
        let c = RawConfig::parse("").unwrap().validate().unwrap();
        assert_eq!(c.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(c.kv_dir, PathBuf::from("data/kv"));
        assert_eq!(c.policy, DEFAULT_POLICY);
        assert_eq!(c.copy_bias, engram_rag::DEFAULT_COPY_BIAS);
        assert!(c.check_start);
        assert!(c.llm.ends_with(DEFAULT_LLM));
    }

    #[test]
    fn gpu_serving_is_auto_off_or_refused_by_name() {
        let serving = |text: &str| RawConfig::parse(text).unwrap().validate();
        assert!(serving("").unwrap().gpu_serving);
        assert!(serving("[gpu]\nserving = \"auto\"\n").unwrap().gpu_serving);
        assert!(!serving("[gpu]\nserving = \"off\"\n").unwrap().gpu_serving);
        let e = serving("[gpu]\nserving = \"on\"\n").unwrap_err();
        assert!(e.to_string().contains("gpu.serving"), "{e}");
    }

    #[test]
    fn the_copy_bias_is_set_or_refused_by_name() {
        let c = RawConfig::parse("[answers]\ncopy_bias = 0\n")
            .unwrap()
            .validate()
            .unwrap();
        assert_eq!(c.copy_bias, 0.0);
        let c = RawConfig::parse("[answers]\ncheck_start = false\n")
            .unwrap()
            .validate()
            .unwrap();
        assert!(!c.check_start);
        let c = RawConfig::parse("[answers]\nrules_off = [\"bare_polar\", \"repeating\"]\n")
            .unwrap()
            .validate()
            .unwrap();
        assert_eq!(c.rules_off.names(), ["bare_polar", "repeating"]);
        let e = RawConfig::parse("[answers]\nrules_off = [\"polar\"]\n")
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("answers.rules_off"), "{e}");
        assert!(e.to_string().contains("bare_polar"), "{e}");
        let e = RawConfig::parse("[answers]\ncopy_bias = -1\n")
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("answers.copy_bias"), "{e}");
    }

    #[test]
    fn env_then_flags() {
        let mut raw =
            RawConfig::parse("listen = \"0.0.0.0:9000\"\n[models]\nthreads = 4\n").unwrap();
        raw.apply_env(|k| match k {
            "ENGRAM_THREADS" => Some("2".into()),
            "ENGRAM_DATA_DIR" => Some("/srv/e".into()),
            "ENGRAM_LISTEN" => Some("127.0.0.1:1".into()),
            _ => None,
        })
        .unwrap();
        raw.apply_overrides(&Overrides {
            listen: Some("127.0.0.1:2".into()),
            data_dir: None,
        });
        let c = raw.validate().unwrap();
        assert_eq!(c.threads, Some(2));
        assert_eq!(c.data_dir, PathBuf::from("/srv/e"));
        assert_eq!(c.listen.port(), 2);
    }

    #[test]
    fn errors_name_the_key() {
        let e = RawConfig::parse("[limits]\nmax_tokens = 0\n")
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("limits.max_tokens"), "{e}");
        let e = RawConfig::parse("[fusion]\npolicy = \"boundary:x\"\n")
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("fusion.policy"), "{e}");
        let e = RawConfig::parse("listen = \"nowhere\"")
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("`listen`"), "{e}");
        let e = RawConfig::parse("[kv]\nbogus = 1\n").unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
        let mut raw = RawConfig::default();
        let e = raw
            .apply_env(|k| (k == "ENGRAM_THREADS").then(|| "many".into()))
            .unwrap_err();
        assert!(e.to_string().contains("ENGRAM_THREADS"), "{e}");
    }
}
