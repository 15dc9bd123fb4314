//! Console accounts: admins create accounts (admin or read-only operator) and delete them
//! (not themselves, not the last admin); a deleted account's sessions end at once.

use askama::Template;
use axum::extract::{Form, Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Extension;
use serde::Deserialize;

use super::dashboard::FlashQuery;
use crate::api::AppState;
use crate::console::users::{Role, UserError, MIN_PASSWORD_CHARS};
use crate::console::view::{datetime, enc, html, html_status, see_other, Chrome, Failure, Viewer};

pub struct UserRow {
    pub name: String,
    pub delete_href: String,
    pub role_key: String,
    pub created: String,
    pub is_me: bool,
}

#[derive(Template)]
#[template(path = "users.html", config = "../../web/askama.toml")]
pub struct UsersPage {
    pub c: Chrome,
    pub users: Vec<UserRow>,
    pub min_password: usize,
    /// Why the create form was refused (from the catalog), shown on the form.
    pub error: Option<String>,
    /// What was typed into the refused form (never the password).
    pub name: String,
    pub role: String,
}

fn users_page(s: &AppState, v: &Viewer, flash: Option<&str>) -> Result<UsersPage, Failure> {
    let users = s
        .console
        .users
        .list()
        .map_err(|e| Failure::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .into_iter()
        .map(|u| UserRow {
            delete_href: format!("/console/users/{}/delete", enc(&u.name)),
            role_key: format!("role.{}", u.role.name()),
            created: datetime(u.created_ms),
            is_me: u.name == v.user,
            name: u.name,
        })
        .collect();
    Ok(UsersPage {
        c: v.chrome("users", "nav.users", "/console/users")
            .with_flash(flash),
        users,
        min_password: MIN_PASSWORD_CHARS,
        error: None,
        name: String::new(),
        role: "operator".into(),
    })
}

/// `GET /console/users`.
pub async fn page(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    Query(q): Query<FlashQuery>,
) -> Result<Response, Failure> {
    Ok(html(&users_page(&s, &v, q.ok.as_deref())?))
}

#[derive(Deserialize)]
pub struct CreateForm {
    #[serde(default)]
    name: String,
    #[serde(default)]
    role: String,
    #[serde(default)]
    password: String,
}

/// `POST /console/users` (admin).
pub async fn create(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    Form(f): Form<CreateForm>,
) -> Result<Response, Failure> {
    let console = s.console.clone();
    let name = f.name.trim().to_owned();
    let role = f.role.clone();
    let n = name.clone();
    let r = tokio::task::spawn_blocking(move || {
        let role = Role::parse(&f.role)?;
        console.users.create(&n, role, &f.password)
    })
    .await
    .map_err(|e| Failure::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    match r {
        Ok(u) => {
            s.console
                .audit
                .record_role(&v.user, "user_created", &u.name, u.role.name(), &v.ip);
            Ok(see_other("/console/users?ok=flash.user_created"))
        }
        Err(e) => {
            let mut page = users_page(&s, &v, None)?;
            let t = page.c.t;
            page.error = Some(match &e {
                UserError::Exists { name } => t.fmt("users.err_exists", name),
                UserError::Invalid { field: "name", .. } => t.get("users.err_name").to_owned(),
                UserError::Invalid { field: "role", .. } => t.get("users.err_role").to_owned(),
                UserError::Invalid {
                    field: "password", ..
                } => t.fmt("users.password_rule", MIN_PASSWORD_CHARS),
                _ => {
                    return Err(Failure::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        e.to_string(),
                    ))
                }
            });
            page.name = name;
            page.role = role;
            Ok(html_status(StatusCode::UNPROCESSABLE_ENTITY, &page))
        }
    }
}

/// `POST /console/users/{name}/delete` (admin).
pub async fn delete(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    Path(name): Path<String>,
) -> Result<Response, Failure> {
    if name == v.user {
        return Err(Failure::new(StatusCode::BAD_REQUEST, "users.not_yourself"));
    }
    match s.console.users.delete(&name) {
        Ok(u) => {
            s.console.sessions.remove_user(&u.name);
            s.console
                .audit
                .record(&v.user, "user_deleted", &u.name, &v.ip);
            Ok(see_other("/console/users?ok=flash.user_deleted"))
        }
        Err(UserError::NotFound { .. }) => Err(Failure::not_found()),
        Err(e) => Err(Failure::new(StatusCode::BAD_REQUEST, e.to_string())),
    }
}
