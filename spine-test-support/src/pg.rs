//! A fresh PostgreSQL database per test, on the server the test suites share (`scripts/services.sh`
//! starts one on 127.0.0.1:5432; `SPINE_TEST_PG_URL` names another), created and dropped with
//! `psql`: one copy for the ledger's store suite, its scale-out tests and the gateway's suites.
//! A database that cannot be made fails the test loudly (the suites run against PostgreSQL, they
//! do not skip), hence the panics.
#![allow(clippy::panic)]

use std::process::Command;

/// The server the tests create their databases on when `SPINE_TEST_PG_URL` is unset.
pub const DEFAULT_PG_URL: &str = "postgres://postgres@127.0.0.1:5432";

/// `SPINE_TEST_PG_URL`, else [`DEFAULT_PG_URL`].
pub fn pg_server_url() -> String {
    std::env::var("SPINE_TEST_PG_URL").unwrap_or_else(|_| DEFAULT_PG_URL.to_owned())
}

/// `base` with its database (the URL path) replaced by `name`, its query kept.
///
/// ```
/// # use spine_test_support::with_database;
/// assert_eq!(with_database("postgres://u:p@h/postgres?sslmode=disable", "x"), "postgres://u:p@h/x?sslmode=disable");
/// assert_eq!(with_database("postgres://postgres@127.0.0.1:5432", "x"), "postgres://postgres@127.0.0.1:5432/x");
/// ```
pub fn with_database(base: &str, name: &str) -> String {
    let (main, query) = match base.split_once('?') {
        Some((m, q)) => (m, Some(q)),
        None => (base, None),
    };
    let authority_start = main.find("://").map_or(0, |i| i + 3);
    let main = match main[authority_start..].find('/') {
        Some(i) => &main[..authority_start + i],
        None => main,
    };
    match query {
        Some(q) => format!("{main}/{name}?{q}"),
        None => format!("{main}/{name}"),
    }
}

/// 12 hex digits unique to this process and call (database names, Redis key prefixes).
pub fn random_hex() -> String {
    use std::hash::{BuildHasher as _, Hasher as _};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    format!("{:012x}", h.finish() & 0xffff_ffff_ffff)
}

fn psql(url: &str, sql: &str) -> Result<String, String> {
    let out = Command::new("psql")
        .args([url, "-v", "ON_ERROR_STOP=1", "-X", "-Atq", "-c", sql])
        .output()
        .map_err(|e| format!("psql: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// A fresh database `spine_test_<random>`, dropped (`WITH (FORCE)`) on drop, also while a
/// failing test unwinds.
#[derive(Debug)]
pub struct PgDb {
    admin_url: String,
    /// The database's name.
    pub name: String,
    /// Its URL (the server's, with this database).
    pub url: String,
}

impl PgDb {
    /// Creates the database.
    ///
    /// # Panics
    ///
    /// The server is unreachable or refuses `CREATE DATABASE`; the message says how to start
    /// one (the suites that use it run against PostgreSQL, they do not skip).
    pub fn create() -> Self {
        let server = pg_server_url();
        let admin_url = with_database(&server, "postgres");
        let name = format!("spine_test_{}", random_hex());
        if let Err(e) = psql(&admin_url, &format!("CREATE DATABASE \"{name}\"")) {
            panic!(
                "CREATE DATABASE at {server}: {e} (start PostgreSQL with scripts/services.sh, \
                 or point SPINE_TEST_PG_URL at a server where this user may CREATE DATABASE)"
            );
        }
        let url = with_database(&server, &name);
        Self {
            admin_url,
            name,
            url,
        }
    }

    /// One value (first row, first column) of `sql`, as text.
    ///
    /// # Panics
    ///
    /// `psql` failed.
    pub async fn query(&self, sql: &str) -> String {
        let out = tokio::process::Command::new("psql")
            .args([&self.url, "-v", "ON_ERROR_STOP=1", "-X", "-Atq", "-c", sql])
            .output()
            .await
            .unwrap_or_else(|e| panic!("psql: {e}"));
        assert!(
            out.status.success(),
            "psql {sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// As [`PgDb::query`], parsed as an integer.
    ///
    /// # Panics
    ///
    /// `psql` failed, or the value is not an integer.
    pub async fn query_i64(&self, sql: &str) -> i64 {
        let v = self.query(sql).await;
        v.parse().unwrap_or_else(|_| panic!("{sql} → {v:?}"))
    }
}

impl Drop for PgDb {
    fn drop(&mut self) {
        if let Err(e) = psql(
            &self.admin_url,
            &format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.name),
        ) {
            eprintln!("dropping database {}: {e}", self.name);
        }
    }
}
