#![allow(clippy::unwrap_used, clippy::expect_used)]
use spine_test_support::{FakeEngine, FakeKind, LlamaServer};

use super::*;

/// The body of `GET /v1/models` as captured from llama-server
/// (/work/shared/fixtures/llama.cpp/d_v1_models.txt), with `--alias smollm2`.
const MODELS: &str = r#"{"models":[{"name":"smollm2","model":"smollm2","modified_at":"","size":"","digest":"","type":"model","description":"","tags":[""],"capabilities":["completion"],"parameters":"","details":{"parent_model":"","format":"gguf","family":"","families":[""],"parameter_size":"","quantization_level":""}}],"object":"list","data":[{"id":"smollm2","aliases":["smollm2"],"tags":[],"object":"model","created":1795965210,"owned_by":"llamacpp","meta":{"vocab_type":2,"n_vocab":49152,"n_ctx":8192,"n_ctx_train":8192,"n_embd":576,"n_params":134515008,"size":96576768,"ftype":"Q4_1"}}]}"#;

#[test]
fn parses_models_with_context() {
    assert_eq!(
        parse_models(MODELS.as_bytes()).unwrap(),
        vec![ModelDescriptor {
            id: ModelId::new("smollm2"),
            max_context_tokens: Some(8192),
            endpoints: None,
        }]
    );
    assert_eq!(
        parse_models(
            br#"{"object":"list","data":[{"id":"Qwen/Qwen2.5-1.5B","object":"model","owned_by":"vllm","max_model_len":32768}]}"#
        )
        .unwrap(),
        vec![ModelDescriptor {
            id: ModelId::new("Qwen/Qwen2.5-1.5B"),
            max_context_tokens: Some(32768),
            endpoints: None,
        }]
    );
    assert_eq!(
        parse_models(br#"{"object":"list","data":[{"id":"m","object":"model"}]}"#).unwrap(),
        vec![ModelDescriptor {
            id: ModelId::new("m"),
            max_context_tokens: None,
            endpoints: None,
        }]
    );
    assert!(parse_models(b"{}").is_err());
    assert!(parse_models(b"<html>").is_err());
}

#[test]
fn nvidia_smi_csv() {
    let overflowing = format!("{}\n{}\n", u64::MAX, 1);
    for (csv, want) in [
        ("24564\n", Some(24564)),
        ("24564\n24564\n", Some(49128)),
        ("memory.total [MiB]\n8192 MiB\n", Some(8192)),
        ("8192 MiB, x\r\n", Some(8192)),
        ("", None),
        ("0\n", None),
        (
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n",
            None,
        ),
        (overflowing.as_str(), None),
    ] {
        assert_eq!(parse_nvidia_smi_memory_total(csv), want, "{csv:?}");
    }
}

proptest::proptest! {
    /// The engine's answers are parsed without panicking whatever their bytes.
    #[test]
    fn engine_answer_parsers_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512), text in ".{0,256}") {
        let _ = parse_models(&bytes);
        let _ = parse_models(text.as_bytes());
        let _ = parse_nvidia_smi_memory_total(&text);
        let _ = ollama_num_ctx(&text);
    }
}

#[test]
fn ollama_parameters() {
    for (parameters, want) in [
        (
            "num_ctx                        4096\nstop \"<|im_end|>\"",
            Some(4096),
        ),
        ("stop \"x\"\nnum_ctx 2048", Some(2048)),
        ("temperature 0.7", None),
        ("num_ctx", None),
    ] {
        assert_eq!(ollama_num_ctx(parameters), want, "{parameters:?}");
    }
}

#[test]
fn join_keeps_the_base_prefix() {
    let base: Uri = "http://127.0.0.1:8080".parse().unwrap();
    assert_eq!(
        join(&base, "/v1/models").unwrap().to_string(),
        "http://127.0.0.1:8080/v1/models"
    );
    let base: Uri = "http://127.0.0.1:11434/ollama/".parse().unwrap();
    assert_eq!(
        join(&base, "/v1/models").unwrap().to_string(),
        "http://127.0.0.1:11434/ollama/v1/models"
    );
}

async fn check_adapter(
    engine: &dyn Engine,
    kind: EngineKind,
    health_path: &str,
    model: &str,
    ctx: Option<u64>,
    endpoints: Option<Endpoints>,
) {
    assert_eq!(engine.kind(), kind);
    assert_eq!(engine.health_path(), health_path);
    engine.health().await.unwrap();
    assert_eq!(
        engine.models().await.unwrap(),
        vec![ModelDescriptor {
            id: ModelId::new(model),
            max_context_tokens: ctx,
            endpoints,
        }]
    );
}

/// vLLM, SGLang and Ollama adapters (explicit and detected) against fakes that follow their
/// documented shapes.
#[tokio::test]
async fn adapters_and_detection_against_engine_fakes() {
    for (fake, arg, kind, health, model) in [
        (
            FakeKind::Vllm,
            EngineArg::Vllm,
            EngineKind::Vllm,
            "/health",
            "Qwen/Qwen2.5-0.5B-Instruct",
        ),
        (
            FakeKind::Sglang,
            EngineArg::Sglang,
            EngineKind::Sglang,
            "/health",
            "qwen/qwen2.5-0.5b-instruct",
        ),
        (
            FakeKind::Ollama,
            EngineArg::Ollama,
            EngineKind::Ollama,
            "/api/version",
            "smollm2:135m",
        ),
    ] {
        let engine = FakeEngine::start(fake, model, 4096).await.unwrap();
        let url: Uri = engine.url.parse().unwrap();
        let explicit = adapter(arg, url.clone(), engine_client()).unwrap();
        check_adapter(&*explicit, kind, health, model, Some(4096), None).await;
        assert_eq!(explicit.request_guard(), RequestGuard::default());
        let detected = detect(url, engine_client()).await.unwrap();
        check_adapter(&*detected, kind, health, model, Some(4096), None).await;
    }
    // Ollama: the context comes from /api/ps (the loaded model's window)
    let engine = FakeEngine::start(FakeKind::Ollama, "smollm2:135m", 2048)
        .await
        .unwrap();
    let ollama = adapter(
        EngineArg::Ollama,
        engine.url.parse().unwrap(),
        engine_client(),
    )
    .unwrap();
    assert_eq!(
        ollama.models().await.unwrap()[0].max_context_tokens,
        Some(2048)
    );
    assert!(engine
        .seen()
        .iter()
        .any(|r| r.method == "GET" && r.path == "/api/ps"));
}

#[tokio::test]
async fn nothing_listening_is_unreachable_and_a_stranger_is_undetected() {
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url: Uri = format!("http://{}", dead.local_addr().unwrap())
        .parse()
        .unwrap();
    drop(dead);
    assert!(matches!(
        detect(url.clone(), engine_client()).await,
        Err(EngineError::Unreachable(_))
    ));
    let llama = adapter(EngineArg::LlamaCpp, url, engine_client()).unwrap();
    assert!(matches!(
        llama.health().await,
        Err(EngineError::Unreachable(_))
    ));
    // an HTTP server that answers 404 to everything
    let stranger = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let stranger_url = format!("http://{}", stranger.local_addr().unwrap());
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        while let Ok((mut sock, _)) = stranger.accept().await {
            let mut buf = [0u8; 4096];
            let _ = sock.read(&mut buf).await;
            let _ = sock
                .write_all(
                    b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                )
                .await;
        }
    });
    let e = detect(stranger_url.parse().unwrap(), engine_client())
        .await
        .err()
        .unwrap();
    assert!(matches!(e, EngineError::Undetected { .. }), "{e}");
}

/// The llama.cpp adapter and auto-detection against the real `llama-server`.
#[tokio::test]
async fn llama_cpp_adapter_against_the_real_engine() {
    let engine = spine_test_support::Engine::discover().unwrap();
    let server = LlamaServer::start(&engine, 1).await.unwrap();
    let url: Uri = server.url.parse().unwrap();
    let explicit = adapter(EngineArg::LlamaCpp, url.clone(), engine_client()).unwrap();
    // LlamaServer runs with -c 4096 and one slot, without `--embeddings` (501 to the probe)
    let no_embeddings = Some(Endpoints {
        chat_completions: true,
        completions: true,
        embeddings: false,
    });
    assert!(explicit.request_guard().check_json_and_model);
    let detected = detect(url, engine_client()).await.unwrap();
    for adapter in [&*explicit, &*detected] {
        check_adapter(
            adapter,
            EngineKind::LlamaCpp,
            "/health",
            "smollm2",
            Some(4096),
            no_embeddings,
        )
        .await;
    }
    // with `--embeddings`: the probe's 200 says so
    let server = LlamaServer::start_with_args(&engine, 1, &["--embeddings", "--pooling", "mean"])
        .await
        .unwrap();
    let url: Uri = server.url.parse().unwrap();
    let with = adapter(EngineArg::LlamaCpp, url, engine_client()).unwrap();
    let models = with.models().await.unwrap();
    assert_eq!(
        models[0].endpoints,
        Some(Endpoints {
            chat_completions: true,
            completions: true,
            embeddings: true,
        })
    );
    assert_eq!(models[0].max_context_tokens, Some(4096));
}

#[test]
fn embeddings_probe_answers() {
    let status = |s: u16| EngineError::Status {
        path: "/v1/embeddings",
        status: StatusCode::from_u16(s).unwrap(),
    };
    assert_eq!(embeddings_answer(&Ok(Bytes::new())), Some(true));
    assert_eq!(embeddings_answer(&Err(status(501))), Some(false));
    // a fake or an older engine without the path, an engine error: unknown
    assert_eq!(embeddings_answer(&Err(status(404))), None);
    assert_eq!(embeddings_answer(&Err(status(500))), None);
}
