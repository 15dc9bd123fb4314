//! `engramd users create|list|delete`: console accounts from the command line (the first
//! admin at install time).

use std::io::BufRead;
use std::path::Path;

use super::users::{generate_password, Role, UserError, UserStore};
use super::view::datetime;

/// The `users` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum UsersCommand {
    /// Create a console account. Without --password-stdin a random password is generated and
    /// printed once.
    Create {
        #[arg(long)]
        name: String,
        /// admin (everything) or operator (read-only).
        #[arg(long, default_value = "admin")]
        role: String,
        /// Read the password from the first line of standard input.
        #[arg(long)]
        password_stdin: bool,
    },
    /// List accounts (names and roles, never hashes).
    List,
    /// Delete an account (not the last admin).
    Delete { name: String },
}

/// Runs one `users` command against `<data_dir>/users.json`.
pub fn run_users_command(data_dir: &Path, cmd: UsersCommand) -> Result<(), UserError> {
    let store = UserStore::new(data_dir);
    match cmd {
        UsersCommand::Create {
            name,
            role,
            password_stdin,
        } => {
            let role = Role::parse(&role)?;
            let (password, generated) = if password_stdin {
                let mut line = String::new();
                std::io::stdin()
                    .lock()
                    .read_line(&mut line)
                    .map_err(|e| crate::error::ServerError::io("reading", "stdin", e))?;
                (line.trim_end_matches(['\r', '\n']).to_owned(), false)
            } else {
                (generate_password(), true)
            };
            let user = store.create(&name, role, &password)?;
            eprintln!(
                "created {} `{}` in {}",
                user.role.name(),
                user.name,
                store.path().display()
            );
            if generated {
                eprintln!("its password is shown once, store it now:");
                println!("{password}");
            }
        }
        UsersCommand::List => {
            for u in store.list()? {
                println!("{}\t{}\t{}", u.name, u.role.name(), datetime(u.created_ms));
            }
        }
        UsersCommand::Delete { name } => {
            let u = store.delete(&name)?;
            eprintln!("deleted `{}`", u.name);
        }
    }
    Ok(())
}
