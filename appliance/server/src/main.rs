//! The `engramd` binary: `serve` (the default), `keys create|list|revoke`,
//! `users create|list|delete` (console accounts), `backup`, `restore`, `openapi`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use engram_server::{backup, Daemon, KeyStore, Overrides, Scope, ServerError};

/// This build's version: `ENGRAM_VERSION` at build time (the packaging sets it to the package's
/// version), else the workspace's. Read here, in the binary's crate, and stamped into the library
/// at start ([`engram_server::versions::stamp`]), so a build of another version recompiles this
/// file only.
const VERSION: &str = match option_env!("ENGRAM_VERSION") {
    Some(v) => v,
    None => env!("CARGO_PKG_VERSION"),
};

#[derive(Parser)]
#[command(name = "engramd", version = VERSION, about = "Engram's daemon")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(clap::Args, Clone)]
struct ServeArgs {
    /// Configuration file (TOML).
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// Data directory (overrides the file and ENGRAM_DATA_DIR).
    #[arg(long, global = true)]
    data_dir: Option<PathBuf>,
    /// Address to listen on, e.g. 127.0.0.1:8080 (overrides the file and ENGRAM_LISTEN); for
    /// `backup`, where the running daemon listens.
    #[arg(long, global = true)]
    listen: Option<String>,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the API (the default).
    Serve,
    /// Manage API keys.
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
    /// Manage admin console accounts.
    Users {
        #[command(subcommand)]
        command: engram_server::console::UsersCommand,
    },
    /// Print the OpenAPI document.
    Openapi,
    /// Back up the data directory to FILE (docs/formats/backup.md): with the daemon stopped
    /// directly, or through the running daemon with an admin key in ENGRAM_API_KEY.
    Backup {
        /// The archive to write (a .tar.zst; replaced only once complete and read back).
        #[arg(long)]
        to: PathBuf,
        /// Also carry the chunk KV tier's blobs (large; they can be recomputed).
        #[arg(long)]
        kv: bool,
    },
    /// Restore an archive into an empty (or new) data directory, after checking every file
    /// against its manifest.
    Restore {
        /// The archive `engramd backup` or `POST /api/v1/admin/backup` wrote.
        file: PathBuf,
    },
}

#[derive(Subcommand)]
enum KeysCommand {
    /// Create a key and print it (once: only its hash is stored).
    Create {
        /// Comma-separated: search, qa, ingest, admin.
        #[arg(long)]
        scopes: String,
        /// Comma-separated collections the key may use [default: all].
        #[arg(long)]
        collections: Option<String>,
        /// What the key is for, shown in `keys list` and the console (up to 64 characters).
        #[arg(long)]
        name: Option<String>,
    },
    /// List keys (ids and scopes, never secrets).
    List,
    /// Revoke a key by id.
    Revoke { id: String },
}

fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if std::env::var("ENGRAM_LOG_FORMAT").is_ok_and(|v| v == "json") {
        builder.json().init();
    } else {
        builder.init();
    }
}

fn main() -> Result<()> {
    engram_server::versions::stamp(VERSION);
    let mut command = Cli::command();
    // `--version` also says whether GPU support is compiled in and what it finds (a probe of the
    // driver, so only when asked; `-V` is the version alone).
    if std::env::args_os().any(|a| a == "--version") {
        let gpu = engram_server::gpu::GpuStatus::detect(engram_server::nvidia_device_files());
        // clap keeps `&'static str`s (its `string` feature aside): the one string, leaked once.
        let long: &'static str = format!("{VERSION}\n{}", gpu.summary()).leak();
        command = command.long_version(long);
    }
    let cli = Cli::from_arg_matches(&command.get_matches())?;
    let overrides = Overrides {
        listen: cli.serve.listen.clone(),
        data_dir: cli.serve.data_dir.clone(),
    };
    match cli.command.unwrap_or(Command::Serve) {
        Command::Openapi => {
            print!("{}", engram_server::openapi_json());
            Ok(())
        }
        Command::Backup { to, kv } => {
            let config = engram_server::load_config(cli.serve.config.as_deref(), &overrides)?;
            let manifest = match std::env::var("ENGRAM_API_KEY") {
                Ok(key) if !key.is_empty() => backup::write_file(&to, |f| {
                    backup::fetch_from_daemon(config.listen, &key, kv, f)
                })?,
                _ => {
                    let kv_dir = kv.then_some(config.kv_dir.as_path());
                    backup::write_file(&to, |f| {
                        let staged = backup::Staged::new(&config.data_dir)?;
                        backup::stage_closed(&config.data_dir, kv_dir, &staged).map_err(|e| {
                            ServerError::Backup {
                                reason: format!(
                                    "{e} (if engramd is running on {}, set ENGRAM_API_KEY to an \
                                     admin key to back up through it)",
                                    config.data_dir.display()
                                ),
                            }
                        })?;
                        backup::write_archive(&staged, kv, f).map(|_| ())
                    })?
                }
            };
            eprintln!(
                "backup written to {}: {} files, {} bytes before compression",
                to.display(),
                manifest.files.len(),
                manifest.total_bytes()
            );
            Ok(())
        }
        Command::Restore { file } => {
            let config = engram_server::load_config(cli.serve.config.as_deref(), &overrides)?;
            let f = std::fs::File::open(&file)
                .with_context(|| format!("opening {}", file.display()))?;
            let m = backup::restore(std::io::BufReader::new(f), &config.data_dir)?;
            eprintln!(
                "restored {} files ({} bytes) into {}: a backup by Engram {}{}",
                m.files.len(),
                m.total_bytes(),
                config.data_dir.display(),
                m.engram_version,
                if m.kv { ", chunk KV included" } else { "" }
            );
            Ok(())
        }
        Command::Users { command } => {
            let config = engram_server::load_config(cli.serve.config.as_deref(), &overrides)?;
            engram_server::console::run_users_command(&config.data_dir, command)?;
            Ok(())
        }
        Command::Keys { command } => {
            let config = engram_server::load_config(cli.serve.config.as_deref(), &overrides)?;
            let store = KeyStore::new(&config.data_dir);
            match command {
                KeysCommand::Create {
                    scopes,
                    collections,
                    name,
                } => {
                    let scopes = Scope::parse_list(&scopes)?;
                    let collections = collections.map(|c| {
                        c.split(',')
                            .map(str::trim)
                            .filter(|s| !s.is_empty())
                            .map(str::to_owned)
                            .collect()
                    });
                    let (rec, key) = store.create_named(name.as_deref(), scopes, collections)?;
                    eprintln!(
                        "created key {} in {}; it is shown once, store it now:",
                        rec.id,
                        store.path().display()
                    );
                    println!("{key}");
                }
                KeysCommand::List => {
                    let used = store.last_used();
                    let keys: Vec<_> = store
                        .list()?
                        .iter()
                        .map(|k| k.public_json(used.get(&k.id).copied()))
                        .collect();
                    println!("{}", serde_json::to_string_pretty(&keys)?);
                }
                KeysCommand::Revoke { id } => {
                    let rec = store.revoke(&id)?;
                    eprintln!("revoked key {}", rec.id);
                }
            }
            Ok(())
        }
        Command::Serve => {
            init_logging();
            let config = engram_server::load_config(cli.serve.config.as_deref(), &overrides)
                .context("loading the configuration")?;
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .context("starting the async runtime")?;
            rt.block_on(async {
                let daemon = Daemon::build(config).await?;
                daemon.serve(engram_server::shutdown_signal()).await
            })?;
            Ok(())
        }
    }
}
