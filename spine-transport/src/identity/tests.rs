#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::*;

#[test]
fn public_key_text_round_trips() {
    let id = NodeIdentity::from_seed(&[7u8; 32]);
    let text = id.public_key_text();
    assert!(text.starts_with("ed25519:"));
    assert_eq!(text.len(), 51);
    assert_eq!(parse_public_key_text(&text).unwrap(), id.verifying_key());
    assert!(matches!(
        parse_public_key_text("ed25519:AAAA"),
        Err(IdentityError::MalformedPublicKey)
    ));
    assert!(matches!(
        parse_public_key_text(&text.replace("ed25519:", "rsa:")),
        Err(IdentityError::MalformedPublicKey)
    ));
}

#[test]
fn save_and_load_with_private_mode() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("node.key");
    let id = NodeIdentity::generate().unwrap();
    id.save(&path).unwrap();
    let loaded = NodeIdentity::load(&path).unwrap();
    assert_eq!(loaded.public_key_text(), id.public_key_text());
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    // never overwrites
    assert!(matches!(id.save(&path), Err(IdentityError::Io { .. })));
    std::fs::write(&path, "zz").unwrap();
    assert!(matches!(
        NodeIdentity::load(&path),
        Err(IdentityError::MalformedFile { .. })
    ));
}

#[test]
fn debug_hides_the_secret() {
    let id = NodeIdentity::from_seed(&[1u8; 32]);
    let dbg = format!("{id:?}");
    assert!(dbg.contains("ed25519:"));
    assert!(!dbg.contains(&hex::encode([1u8; 32])));
}
