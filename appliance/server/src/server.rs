//! Start-up and serving: configuration -> hardware profile -> knowledge base and engine
//! threads -> router on a bound listener -> graceful shutdown.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::api::{self, AppState, Limits};
use crate::auth::Authenticator;
use crate::config::Config;
use crate::engine::{EngineHandle, EngineOptions};
use crate::error::{Result, ServerError};
use crate::kbtask::{KbHandle, KbOptions};
use crate::metrics::Metrics;
use crate::profile::{self, Machine, Profile};
use crate::storage::Storage;
use engram_kvstore::{IoMode, NvmeOptions, NvmeTier};

/// A daemon with everything loaded and its listener bound, not yet serving.
pub struct Daemon {
    listener: tokio::net::TcpListener,
    tls: Option<crate::tls::Tls>,
    state: AppState,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Daemon {
    /// Picks the profile, opens the knowledge base, loads the engine and binds the address.
    pub async fn build(config: Config) -> Result<Daemon> {
        std::fs::create_dir_all(&config.data_dir)
            .map_err(|e| ServerError::io("creating", &config.data_dir, e))?;
        // A restore staged through the API or console replaces the data before anything opens.
        if let Some(from) = crate::backup::apply_staged_restore(&config.data_dir)? {
            tracing::warn!(
                backup_of = %from,
                "restored the staged backup: the data directory is now the archive's"
            );
        }
        // Staging folders of backups a crash interrupted (their links pin deleted files).
        crate::backup::remove_stale(&config.data_dir);
        // Before anything opens the data: a version that then refuses it is on record too.
        match crate::versions::record_start(&config.data_dir) {
            Ok(Some(e)) => tracing::info!(
                kind = %e.kind,
                version = %e.version,
                previous = ?e.previous,
                snapshot = ?e.snapshot,
                "version change recorded"
            ),
            Ok(None) => {}
            Err(e) => tracing::warn!("the version history was not updated: {e}"),
        }
        let profiles = Profile::load_all(config.profiles_dir.as_deref())?;
        let machine = Machine::detect(&config.data_dir);
        tracing::info!(
            cores = machine.cores,
            memory_mib = machine.memory_bytes >> 20,
            gpus = machine.gpus,
            disk_free_gib = machine.disk_free_bytes.map(|b| b >> 30),
            "machine detected"
        );
        let mut gpu = crate::gpu::GpuStatus::detect(machine.gpus);
        gpu.log();
        let chosen = profile::choose(&profiles, &machine, config.profile.as_deref())?;
        for r in &chosen.reasons {
            tracing::info!(profile = %chosen.profile.name, "{r}");
        }
        let p = &chosen.profile;
        let threads = config
            .threads
            .unwrap_or(p.threads)
            .min(machine.cores)
            .max(1);
        let queue_depth = config.queue_depth.unwrap_or(p.queue_depth);
        let max_batch = config.batch_size.unwrap_or(p.batch_size);
        let metrics = Arc::new(Metrics::new());
        // The disk first: on a full disk the ballast is given back so the catalog can open.
        let storage = Arc::new(Storage::open(
            &config.data_dir,
            config.storage_reserve_bytes,
        )?);
        tracing::info!(
            free_mib = storage.available() >> 20,
            reserve_mib = storage.reserve() >> 20,
            read_only = storage.read_only(),
            "data directory disk"
        );
        // The NVMe KV tier before the catalog: it keeps its own reserve (twice the catalog's
        // when it shares the disk) and evicts at open to restore it.
        let kv_nvme_gib = config.kv_nvme_gib.unwrap_or(p.kv_nvme_gib);
        let nvme = if kv_nvme_gib > 0 {
            std::fs::create_dir_all(&config.kv_dir)
                .map_err(|e| ServerError::io("creating", &config.kv_dir, e))?;
            let reserve = if crate::storage::same_file_system(&config.data_dir, &config.kv_dir) {
                2 * storage.reserve()
            } else {
                let space = engram_kvstore::disk_space(&config.kv_dir)
                    .map_err(|e| ServerError::io("statvfs", &config.kv_dir, e))?;
                crate::storage::default_reserve(space.total)
            };
            let tier = Arc::new(NvmeTier::open(
                &config.kv_dir,
                NvmeOptions {
                    budget_bytes: kv_nvme_gib << 30,
                    io: IoMode::Auto,
                    direct: true,
                    reserve_free_bytes: reserve,
                },
            )?);
            storage.set_kv_tier(tier.clone());
            Some(tier)
        } else {
            None
        };
        if !storage.writable() {
            tracing::error!(
                "starting read-only: {}",
                storage.reason().unwrap_or_default()
            );
        } else {
            storage.ensure_ballast();
        }
        let auth = Arc::new(Authenticator::new(
            &config.data_dir,
            Duration::from_secs(config.auth_cache_secs),
            config.auth_failures_per_minute,
        )?);
        if auth.key_count() == 0 {
            tracing::warn!(
                "no API keys yet: create one with `engramd keys create --data-dir {} --scopes admin`",
                config.data_dir.display()
            );
        }
        if !config.llm.is_file() {
            return Err(ServerError::config(
                "models.llm",
                format!(
                    "{} is not a file (set models.dir or ENGRAM_MODELS_DIR)",
                    config.llm.display()
                ),
            ));
        }
        // Chunks of indexed documents, from the knowledge base's durable chunk KV queue to the
        // engine, and the documents finished back.
        let (kv_tx, kv_rx) = tokio::sync::mpsc::channel(crate::kbtask::KV_WORK_QUEUE);
        let (kv_done_tx, kv_done_rx) = tokio::sync::mpsc::unbounded_channel();
        let (kb, kb_thread) = KbHandle::spawn(
            KbOptions {
                data_dir: config.data_dir.clone(),
                embedder: config.embedder.clone(),
                llm: config.llm.clone(),
                threads,
                max_upload_bytes: config.max_upload_bytes,
                storage: storage.clone(),
                kv: Some(crate::kbtask::KvLink {
                    work: kv_tx,
                    done: kv_done_rx,
                }),
                ocr: config.ocr.clone(),
            },
            metrics.clone(),
        )?;
        // Not open yet on a disk too full for the catalog: the knowledge-base thread said why
        // (ERROR) and tries again; the daemon serves what needs no knowledge base meanwhile.
        match kb.unavailable() {
            None => tracing::info!(embedder = %kb.embed_model, "knowledge base open"),
            Some(_) => tracing::warn!(
                embedder = %kb.embed_model,
                "serving without the knowledge base until it can open"
            ),
        }
        let (engine, engine_thread) = EngineHandle::spawn(
            EngineOptions {
                llm: config.llm.clone(),
                threads,
                kv_dir: config.kv_dir.clone(),
                kv_dram_mib: config.kv_dram_mib.unwrap_or(p.kv_dram_mib),
                nvme,
                kv_dtype: config.kv_dtype,
                prefix_cache_mib: config.prefix_cache_mib,
                policy: config.policy,
                gate_max_kl: config.gate_max_kl,
                copy_bias: config.copy_bias,
                check_start: config.check_start,
                rules_off: config.rules_off,
                queue_depth,
                max_batch,
                gpu: config.gpu_serving,
                kernel_cache: Some(config.data_dir.join("cache/cuda")),
            },
            metrics.clone(),
            kv_rx,
            kv_done_tx,
        )?;
        tracing::info!(model = %engine.info.model_id, threads, queue_depth, max_batch, "engine ready");
        gpu.set_serving(&engine.info.serving);
        let gpu = Arc::new(gpu);
        if engine.info.kv_model_changed {
            // Every indexed document's chunk KV again, in the background (the engine computes
            // it when no question waits); until then a question computes what it needs.
            match kb.call(|kb| kb.mark_kv_pending(None)).await {
                Ok(Ok(n)) => tracing::info!(documents = n, "chunk KV re-precompute scheduled"),
                Ok(Err(e)) => tracing::warn!("scheduling the chunk KV re-precompute: {e}"),
                Err(e) => tracing::warn!("scheduling the chunk KV re-precompute: {e:?}"),
            }
        }
        let console = Arc::new(crate::console::Console::open(
            &config,
            crate::console::Facts::new(&config, p, &machine, threads, queue_depth),
            metrics.clone(),
        )?);
        let tls = match &config.tls {
            crate::tls::TlsSetting::Off => {
                if !config.listen.ip().is_loopback() {
                    tracing::warn!(
                        listen = %config.listen,
                        "plain HTTP beyond loopback ([tls] mode = \"off\"): keys and passwords \
                         cross the network in clear unless a TLS proxy is in front"
                    );
                }
                None
            }
            crate::tls::TlsSetting::On(files) => {
                let t = crate::tls::load(files.as_ref(), &config.data_dir, config.listen)?;
                tracing::info!(
                    cert = %t.cert_path.display(),
                    self_signed = t.self_signed,
                    sha256_fingerprint = %t.fingerprint,
                    "TLS on"
                );
                Some(t)
            }
        };
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|e| ServerError::io("binding", config.listen.to_string(), e))?;
        let state = AppState {
            kb,
            engine,
            auth,
            metrics,
            ingest: Arc::new(tokio::sync::Semaphore::new(config.ingest_concurrency)),
            limits: Limits {
                max_upload_bytes: config.max_upload_bytes,
                max_tokens: config.max_tokens,
                max_top_k: config.max_top_k,
                max_query_bytes: config.max_query_bytes,
            },
            storage,
            profile: Arc::from(p.name.as_str()),
            console,
            data_dir: config.data_dir.clone(),
            kv_dir: (kv_nvme_gib > 0).then(|| config.kv_dir.clone()),
            token_vocab: token_vocab(&config.token_vocab),
            gpu,
            embedding_aliases: config.embedding_aliases.clone().into(),
        };
        Ok(Daemon {
            listener,
            tls,
            state,
            threads: vec![kb_thread, engine_thread],
        })
    }

    /// The bound address (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Serves until `shutdown` resolves, then stops accepting, lets in-flight requests finish,
    /// and waits for the engine and the knowledge base to stop (the knowledge base is flushed
    /// when its owner drops it).
    pub async fn serve(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<()> {
        let addr = self.local_addr();
        // Key uses are written every USE_FLUSH_INTERVAL off the async threads, and at the end.
        let auth = self.state.auth.clone();
        let flusher = tokio::spawn({
            let auth = auth.clone();
            async move {
                let mut every = tokio::time::interval(crate::auth::USE_FLUSH_INTERVAL);
                loop {
                    every.tick().await;
                    let a = auth.clone();
                    let _ = tokio::task::spawn_blocking(move || a.flush_uses()).await;
                }
            }
        });
        let app = api::router(self.state);
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        tracing::info!(%addr, scheme, "listening");
        crate::lifecycle::sd_notify("READY=1");
        let served = crate::http::serve(self.listener, app, self.tls, shutdown).await;
        flusher.abort();
        let _ = tokio::task::spawn_blocking(move || auth.flush_uses()).await;
        served.map_err(|e| ServerError::io("serving", addr.to_string(), e))?;
        let threads = self.threads;
        tokio::task::spawn_blocking(move || {
            for t in threads {
                let _ = t.join();
            }
        })
        .await
        .ok();
        tracing::info!("stopped");
        Ok(())
    }
}

/// The tiktoken vocabulary token-id embedding inputs are read with, when its file is there
/// (one log line either way; a damaged file is logged and left out rather than stopping the
/// daemon: only token-array inputs need it).
fn token_vocab(path: &std::path::Path) -> Option<Arc<engram_tokenizer::TiktokenVocab>> {
    if !path.exists() {
        tracing::info!(path = %path.display(), "no token vocabulary: token-id embedding inputs are refused");
        return None;
    }
    match engram_tokenizer::TiktokenVocab::load(path) {
        Ok(v) => {
            tracing::info!(path = %path.display(), tokens = v.len(), "token vocabulary for token-id embedding inputs");
            Some(Arc::new(v))
        }
        Err(e) => {
            tracing::warn!("{e}; token-id embedding inputs are refused");
            None
        }
    }
}
