//! The knowledge base's one owner: a thread that holds the `KnowledgeBase` and runs the
//! commands (closures) sent to it over a channel, answering each on a oneshot.

use std::path::PathBuf;
use std::sync::Arc;

use engram_kb::{KnowledgeBase, Models};
use tokio::sync::{mpsc, oneshot};

use crate::error::{ApiError, Result, ServerError};

/// Commands waiting for the knowledge base before senders wait: searches are milliseconds,
/// ingestion is bounded separately, so this only absorbs bursts.
const COMMAND_QUEUE: usize = 256;

type Command = Box<dyn FnOnce(&mut KnowledgeBase) + Send>;

/// What the knowledge base needs to open.
#[derive(Clone, Debug)]
pub struct KbOptions {
    pub data_dir: PathBuf,
    pub embedder: PathBuf,
    pub llm: PathBuf,
    pub threads: usize,
    pub max_upload_bytes: usize,
}

/// A cheap, cloneable handle to the knowledge-base thread.
#[derive(Clone)]
pub struct KbHandle {
    tx: mpsc::Sender<Command>,
    /// Facts fixed at open, readable without a round trip.
    pub embed_model: Arc<str>,
    pub embed_dim: usize,
}

impl KbHandle {
    /// Starts the thread and opens the knowledge base there (with recovery); returns once it
    /// is open. The thread ends, dropping (and so flushing) the knowledge base, when every
    /// handle is gone.
    pub fn spawn(opts: KbOptions) -> Result<(KbHandle, std::thread::JoinHandle<()>)> {
        let (tx, mut rx) = mpsc::channel::<Command>(COMMAND_QUEUE);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let join = std::thread::Builder::new()
            .name("engram-kb".into())
            .spawn(move || {
                let mut kb = match open(&opts) {
                    Ok(kb) => {
                        let e = &kb.models().embedder;
                        let _ = ready_tx.send(Ok((Arc::<str>::from(e.model_id()), e.dim())));
                        kb
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                while let Some(cmd) = rx.blocking_recv() {
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cmd(&mut kb)));
                    if r.is_err() {
                        tracing::error!("a knowledge-base command panicked; the owner goes on");
                    }
                }
                tracing::info!("knowledge base closed");
            })
            .map_err(|e| ServerError::io("spawning", "engram-kb thread", e))?;
        let (embed_model, embed_dim) = ready_rx.recv().map_err(|_| ServerError::Profile {
            reason: "the knowledge-base thread died while opening".into(),
        })??;
        Ok((
            KbHandle {
                tx,
                embed_model,
                embed_dim,
            },
            join,
        ))
    }

    /// Runs `f` on the knowledge base and returns its result.
    pub async fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut KnowledgeBase) -> T + Send + 'static,
    ) -> std::result::Result<T, ApiError> {
        let (tx, rx) = oneshot::channel();
        let cmd: Command = Box::new(move |kb| {
            let _ = tx.send(f(kb));
        });
        self.tx.send(cmd).await.map_err(|_| ApiError::Unavailable {
            reason: "the knowledge base is shut down".into(),
        })?;
        rx.await
            .map_err(|_| ApiError::internal("the knowledge-base command failed"))
    }

    /// Whether the owner thread is still running.
    pub fn is_open(&self) -> bool {
        !self.tx.is_closed()
    }
}

fn open(opts: &KbOptions) -> Result<KnowledgeBase> {
    if !opts.embedder.join("model.safetensors").is_file() {
        return Err(ServerError::config(
            "models.embedder",
            format!("{} holds no model.safetensors", opts.embedder.display()),
        ));
    }
    let gguf = engram_gguf::GgufFile::open(&opts.llm)?;
    let tokens = engram_tokenizer::Tokenizer::from_gguf(gguf.metadata())?;
    let models = Models::load(&opts.embedder, opts.threads, Arc::new(tokens))?;
    let mut kb = KnowledgeBase::open(&opts.data_dir, models)?;
    kb.set_parse_limits(engram_parse::Limits {
        max_input_bytes: opts.max_upload_bytes as u64,
        ..engram_parse::Limits::default()
    });
    let r = kb.recovery();
    for (coll, index, why) in &r.rebuilt {
        tracing::warn!(collection = %coll, index, "recovery: rebuilt ({why})");
    }
    for (coll, index, n) in &r.caught_up {
        tracing::info!(collection = %coll, index, changes = n, "recovery: caught up");
    }
    if r.resumed > 0 {
        tracing::info!(
            documents = r.resumed,
            "recovery: finished interrupted documents"
        );
    }
    Ok(kb)
}
