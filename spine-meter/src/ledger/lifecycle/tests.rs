use super::*;

#[test]
fn database_url_names_sqlite_or_postgres() {
    let dir = Path::new("/d");
    assert_eq!(
        Database::from_url(None, dir),
        Ok(Database::Sqlite(PathBuf::from("/d/spine.db")))
    );
    assert_eq!(
        Database::from_url(Some("sqlite:///var/lib/spine/l.db"), dir),
        Ok(Database::Sqlite(PathBuf::from("/var/lib/spine/l.db")))
    );
    for url in ["postgres://u:p@db:5432/spine", "postgresql://db/spine"] {
        assert_eq!(
            Database::from_url(Some(url), dir),
            Ok(Database::Postgres(url.into()))
        );
    }
    let err = Database::from_url(Some("mysql://u:secret@db/spine"), dir)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("postgres://"), "{err}");
    assert!(!err.contains("secret"), "{err}");
    assert_eq!(
        format!(
            "{:?}",
            Database::Postgres("postgres://u:secret@db/x".into())
        ),
        "Postgres(..)"
    );
}
