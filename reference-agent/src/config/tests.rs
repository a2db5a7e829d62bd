#![allow(clippy::unwrap_used, clippy::expect_used)]
use clap::Parser as _;

use super::*;

#[derive(Debug, clap::Parser)]
struct Wrap {
    #[command(flatten)]
    run: RunArgs,
}

#[test]
fn flags_override_the_file() {
    let file: FileConfig = toml::from_str(
        r#"
            gateway = "wss://gw.example:19000/v1/tunnel"
            identity = "/var/lib/spine/node.key"
            engine = "llama.cpp"
            engine_url = "http://127.0.0.1:8080"
            max_concurrency = 8
            vram_mib = 24576
            model = "smollm2"
            "#,
    )
    .unwrap();
    let args = Wrap::try_parse_from([
        "x",
        "--engine-url",
        "http://127.0.0.1:9000",
        "--max-concurrency",
        "2",
    ])
    .unwrap()
    .run;
    let s = Settings::merge(args, file).unwrap();
    assert_eq!(s.gateway, "wss://gw.example:19000/v1/tunnel");
    assert_eq!(s.engine_url.to_string(), "http://127.0.0.1:9000/");
    assert_eq!(s.max_concurrency, 2);
    assert_eq!(s.vram_mib, Some(24576));
    assert_eq!(s.engine, EngineArg::LlamaCpp);
    assert_eq!(s.model.as_deref(), Some("smollm2"));
    assert!(!s.insecure_plaintext_tunnel);
}

#[test]
fn several_gateways_as_list_or_array() {
    let args = || {
        Wrap::try_parse_from([
            "x",
            "--identity",
            "k",
            "--engine-url",
            "http://127.0.0.1:8080",
        ])
        .unwrap()
        .run
    };
    for text in [
        r#"gateway = ["wss://a:1/v1/tunnel", "wss://b:2/v1/tunnel"]"#,
        r#"gateway = "wss://a:1/v1/tunnel, wss://b:2/v1/tunnel""#,
    ] {
        let file: FileConfig = toml::from_str(text).unwrap();
        let s = Settings::merge(args(), file).unwrap();
        assert_eq!(s.gateway, "wss://a:1/v1/tunnel");
        assert_eq!(s.gateways, ["wss://a:1/v1/tunnel", "wss://b:2/v1/tunnel"]);
    }
    // the single-URL form is one gateway
    let file: FileConfig = toml::from_str(r#"gateway = "wss://a:1/v1/tunnel""#).unwrap();
    assert_eq!(
        Settings::merge(args(), file).unwrap().gateways,
        ["wss://a:1/v1/tunnel"]
    );
    let file: FileConfig =
        toml::from_str(r#"gateway = "wss://a:1/v1/tunnel,ws://b:2/v1/tunnel""#).unwrap();
    assert!(matches!(
        Settings::merge(args(), file),
        Err(ConfigError::MixedGatewaySchemes)
    ));
}

#[test]
fn defaults_and_errors() {
    let args = Wrap::try_parse_from([
        "x",
        "--gateway",
        "ws://127.0.0.1:19000/v1/tunnel",
        "--identity",
        "k",
        "--engine-url",
        "http://127.0.0.1:8080",
        "--insecure-plaintext-tunnel",
        "--engine",
        "vllm",
    ])
    .unwrap()
    .run;
    let s = Settings::merge(args, FileConfig::default()).unwrap();
    assert_eq!(s.max_concurrency, 4);
    assert_eq!(s.vram_mib, None);
    assert_eq!(s.engine, EngineArg::Vllm);
    assert!(s.insecure_plaintext_tunnel);
    assert!(s.tls_config().unwrap().is_none());

    let err = Settings::merge(RunArgs::default(), FileConfig::default()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "missing setting gateway (flag --gateway, env SPINE_AGENT_GATEWAY, or config key gateway)"
    );
    let args = Wrap::try_parse_from([
        "x",
        "--gateway",
        "g",
        "--identity",
        "k",
        "--engine-url",
        "ftp://x",
    ])
    .unwrap()
    .run;
    assert!(matches!(
        Settings::merge(args, FileConfig::default()),
        Err(ConfigError::EngineUrl { .. })
    ));
    assert!(toml::from_str::<FileConfig>("gatway = \"typo\"").is_err());
    assert!(Wrap::try_parse_from(["x", "--engine", "tgi"]).is_err());
}
