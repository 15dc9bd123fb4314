//! The admin console: server-rendered pages under `/console/` (askama templates from
//! `web/templates`, strings from `web/i18n`, one stylesheet and one small script from
//! `web/static`, all compiled into the binary), signed in with console accounts.
//!
//! - `users`, `session`, `audit`, `settings`: accounts, sessions and lockout, the audit log,
//!   the settings an admin may change at run time;
//! - `guard`: the session and CSRF check in front of every page but sign-in;
//! - `i18n`, `view`, `chart`: catalogs, page chrome and formatting, SVG charts;
//! - `sampler`, `querylog`: the dashboard's one-hour history, recent retrieval queries;
//! - `pages`: the handlers, one file per page;
//! - `cli`: `engramd users create|list|delete`.

pub(crate) mod audit;
mod chart;
mod cli;
mod guard;
mod i18n;
mod pages;
mod querylog;
mod sampler;
mod session;
pub(crate) mod settings;
pub(crate) mod users;
pub(crate) mod view;

use std::path::PathBuf;
use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::handler::Handler;
use axum::middleware;
use axum::routing::{get, post};
use axum::Router;

pub use cli::{run_users_command, UsersCommand};
pub use i18n::{Lang, EN_SOURCE, ZH_CN_SOURCE};
pub use querylog::QueryLog;
pub use users::{Role, User, UserError, UserStore, INITIAL_PASSWORD_FILE, USER_FILE};

use crate::api::AppState;
use crate::config::Config;
use crate::error::Result;
use crate::metrics::Metrics;
use crate::profile::{Machine, Profile};

/// Password verifications (argon2id, 19 MiB each) running at once; sign-ins beyond get 429.
const VERIFY_SLOTS: usize = 2;
/// Largest body of a public console route (the sign-in form is a few hundred bytes).
const PUBLIC_BODY_LIMIT: usize = 16 << 10;

/// Facts fixed at start, for the dashboard and the settings page.
pub struct Facts {
    pub profile: Profile,
    pub machine: Machine,
    pub threads: usize,
    pub queue_depth: usize,
    pub kv_dram_mib: u64,
    pub kv_nvme_gib: u64,
    pub prefix_cache_mib: u64,
    pub kv_dtype: String,
    pub policy: String,
    /// The configuration as loaded: (key, value).
    pub config: Vec<(&'static str, String)>,
}

impl Facts {
    /// The facts of a daemon started with `config` on `machine` under `profile`, with the
    /// engine's thread count and queue depth as decided at start.
    pub fn new(
        config: &Config,
        profile: &Profile,
        machine: &Machine,
        threads: usize,
        queue_depth: usize,
    ) -> Facts {
        let opt = |v: Option<String>| v.unwrap_or_else(|| "profile".into());
        let kv_dram_mib = config.kv_dram_mib.unwrap_or(profile.kv_dram_mib);
        let kv_nvme_gib = config.kv_nvme_gib.unwrap_or(profile.kv_nvme_gib);
        let config_rows = vec![
            ("listen", config.listen.to_string()),
            (
                "tls",
                match &config.tls {
                    crate::tls::TlsSetting::Off => "off".into(),
                    crate::tls::TlsSetting::On(None) => {
                        format!("on (self-signed, {}/tls/)", config.data_dir.display())
                    }
                    crate::tls::TlsSetting::On(Some((cert, _))) => {
                        format!("on ({})", cert.display())
                    }
                },
            ),
            ("data_dir", config.data_dir.display().to_string()),
            (
                "profile",
                config.profile.clone().unwrap_or_else(|| "auto".into()),
            ),
            ("models.llm", config.llm.display().to_string()),
            ("models.embedder", config.embedder.display().to_string()),
            ("models.threads", opt(config.threads.map(|t| t.to_string()))),
            ("kv.dir", config.kv_dir.display().to_string()),
            ("kv.dram_mib", kv_dram_mib.to_string()),
            ("kv.nvme_gib", kv_nvme_gib.to_string()),
            ("kv.dtype", config.kv_dtype.to_string()),
            ("kv.prefix_cache_mib", config.prefix_cache_mib.to_string()),
            ("fusion.policy", config.policy.to_string()),
            ("fusion.gate_max_kl", config.gate_max_kl.to_string()),
            ("answers.copy_bias", config.copy_bias.to_string()),
            (
                "limits.max_upload_bytes",
                config.max_upload_bytes.to_string(),
            ),
            ("limits.queue_depth", queue_depth.to_string()),
            ("limits.max_tokens", config.max_tokens.to_string()),
            ("limits.max_top_k", config.max_top_k.to_string()),
            (
                "limits.ingest_concurrency",
                config.ingest_concurrency.to_string(),
            ),
            (
                "auth.failures_per_minute",
                config.auth_failures_per_minute.to_string(),
            ),
            ("auth.cache_secs", config.auth_cache_secs.to_string()),
        ];
        Facts {
            profile: profile.clone(),
            machine: machine.clone(),
            threads,
            queue_depth,
            kv_dram_mib,
            kv_nvme_gib,
            prefix_cache_mib: config.prefix_cache_mib,
            kv_dtype: config.kv_dtype.to_string(),
            policy: config.policy.to_string(),
            config: config_rows,
        }
    }
}

/// The console's state (no knowledge-base or engine handle: those are in [`AppState`]).
pub struct Console {
    pub(crate) data_dir: PathBuf,
    pub(crate) users: UserStore,
    pub(crate) sessions: session::Sessions,
    pub(crate) lockout: session::Lockout,
    /// Permits for password verifications (sign-in is public: this bounds its cost).
    pub(crate) verify_slots: Arc<tokio::sync::Semaphore>,
    pub(crate) audit: audit::AuditLog,
    pub(crate) queries: QueryLog,
    pub(crate) settings: settings::SettingsStore,
    pub(crate) history: Arc<sampler::History>,
    pub(crate) facts: Facts,
}

impl Console {
    /// Opens the console's files under the data directory, creates the first admin when there
    /// is no account (password in `<data dir>/initial-admin-password`), and starts the
    /// dashboard's sampler on the current runtime.
    pub fn open(config: &Config, facts: Facts, metrics: Arc<Metrics>) -> Result<Console> {
        let data_dir = config.data_dir.clone();
        let users = UserStore::new(&data_dir);
        match users.ensure_initial_admin(&data_dir) {
            Ok(Some(file)) => tracing::warn!(
                "no console account yet: created `admin`; its password is in {} (read it once, \
                 then delete the file)",
                file.display()
            ),
            Ok(None) => {}
            Err(UserError::Store(e)) => return Err(e),
            Err(e) => tracing::error!("creating the first console admin: {e}"),
        }
        let history = Arc::new(sampler::History::default());
        sampler::spawn(metrics, history.clone());
        Ok(Console {
            users,
            sessions: Default::default(),
            lockout: Default::default(),
            verify_slots: Arc::new(tokio::sync::Semaphore::new(VERIFY_SLOTS)),
            audit: audit::AuditLog::new(&data_dir),
            queries: QueryLog::default(),
            settings: settings::SettingsStore::open(&data_dir)?,
            history,
            facts,
            data_dir,
        })
    }

    /// The recent-query log (the API's search handlers record into it).
    pub fn queries(&self) -> &QueryLog {
        &self.queries
    }
}

async fn not_found() -> view::Failure {
    view::Failure::not_found()
}

/// `admin_only(handler)`: the handler behind the role check.
macro_rules! admin_only {
    ($h:expr) => {
        $h.layer(middleware::from_fn(guard::admin_only))
    };
}

/// The console's routes (merged into the daemon's router outside the API's error-shape
/// layer: console errors are HTML pages).
pub fn router(state: AppState) -> Router<AppState> {
    use pages::*;
    let limit = state.limits.max_upload_bytes;
    let signed_in = Router::new()
        .route("/console/", get(dashboard::page))
        .route("/console/signout", post(signin::sign_out))
        .route("/console/kb", get(kb::list).post(admin_only!(kb::create)))
        .route("/console/kb/{name}", get(kb::show))
        .route(
            "/console/kb/{name}/delete",
            get(kb::confirm_delete).post(admin_only!(kb::delete)),
        )
        .route(
            "/console/kb/{name}/upload",
            post(admin_only!(documents::upload)),
        )
        .route("/console/kb/{name}/doc/{id}", get(documents::show))
        .route(
            "/console/kb/{name}/doc/{id}/{action}",
            post(admin_only!(documents::act)),
        )
        .route("/console/retrieval", get(retrieval::page))
        .route("/console/chat", get(chat::page).post(chat::answer))
        .route("/console/chat/stream", post(chat::stream))
        .route(
            "/console/keys",
            get(keys::page).post(admin_only!(keys::create)),
        )
        .route("/console/keys/{id}/revoke", post(admin_only!(keys::revoke)))
        .route(
            "/console/users",
            get(accounts::page).post(admin_only!(accounts::create)),
        )
        .route(
            "/console/users/{name}/delete",
            post(admin_only!(accounts::delete)),
        )
        .route(
            "/console/settings",
            get(settings::page).post(admin_only!(settings::save)),
        )
        .route("/console/backup", post(admin_only!(settings::backup)))
        .route(
            "/console/restore",
            post(admin_only!(settings::restore)).layer(DefaultBodyLimit::disable()),
        )
        .route("/console/audit", get(audit::page))
        // Any other console path: an HTML 404 in the viewer's language (not the API's JSON).
        .route("/console/{*rest}", get(not_found))
        .route_layer(middleware::from_fn_with_state(state.clone(), guard::guard))
        .layer(DefaultBodyLimit::max(limit));
    let public = Router::new()
        .route("/", get(signin::to_console))
        .route("/console", get(signin::to_console))
        .route("/console/signin", get(signin::page).post(signin::sign_in))
        .route("/console/lang/{tag}", get(signin::switch_lang))
        .route("/console/static/{file}", get(assets::serve))
        .layer(DefaultBodyLimit::max(PUBLIC_BODY_LIMIT));
    signed_in
        .merge(public)
        .layer(middleware::from_fn(guard::security_headers))
}
