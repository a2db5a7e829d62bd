//! End-to-end tunnel tests: real sockets on 127.0.0.1, real TLS with rcgen certificates.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt as _, StreamExt as _};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt as _, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use spine_core::{BoxBody, ModelId, NodeDescriptor, NodeId};
use spine_transport::handshake::{AgentMessage, Hello};
use spine_transport::{
    client_config_with_ca, self_signed_cert, server_config_from_pem, NodeIdentity, NodeService,
    RefusalReason, StaticAuthenticator, TunnelClient, TunnelClientConfig, TunnelError,
    TunnelEvents, TunnelServer, TunnelServerConfig, Tunnels,
};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::Message;
use tower::ServiceExt as _;

mod common;
use common::{read_challenge, RawWs};

const WAIT: Duration = Duration::from_secs(10);

#[derive(Debug, PartialEq)]
enum Event {
    Ready(NodeId, NodeDescriptor),
    Gone(NodeId),
}

struct Recorder(
    mpsc::UnboundedSender<Event>,
    Arc<std::sync::atomic::AtomicUsize>,
);

impl TunnelEvents for Recorder {
    fn node_heartbeat(&self, _node: &NodeId) {
        self.1.fetch_add(1, Ordering::SeqCst);
    }
    fn node_ready(&self, node: &NodeId, descriptor: &NodeDescriptor) {
        let _ = self.0.send(Event::Ready(node.clone(), descriptor.clone()));
    }
    fn node_gone(&self, node: &NodeId) {
        let _ = self.0.send(Event::Gone(node.clone()));
    }
}

fn descriptor() -> NodeDescriptor {
    common::descriptor("test-agent")
}

/// The task serving a session: [`TunnelSession::serve`](spine_transport::TunnelSession::serve).
type ServeTask = JoinHandle<Result<(), TunnelError>>;

struct Gateway {
    port: u16,
    ca_pem: String,
    tunnels: Tunnels,
    events: mpsc::UnboundedReceiver<Event>,
    identity: NodeIdentity,
    node: NodeId,
    heartbeats: Arc<std::sync::atomic::AtomicUsize>,
}

impl Gateway {
    async fn start(config: TunnelServerConfig) -> Self {
        let (cert, key) = self_signed_cert(&["localhost".into(), "127.0.0.1".into()]).unwrap();
        let tls = server_config_from_pem(&cert, &key).unwrap();
        let identity = NodeIdentity::generate().unwrap();
        let node = NodeId::new("node_1");
        let auth = StaticAuthenticator::new().with_key(identity.public_key_text(), node.clone());
        let (tx, events) = mpsc::unbounded_channel();
        let heartbeats = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let server = TunnelServer::new(
            config,
            Arc::new(auth),
            Arc::new(Recorder(tx, heartbeats.clone())),
        );
        let tunnels = server.tunnels();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(server.serve(listener, Some(tls)));
        Self {
            port,
            ca_pem: cert,
            tunnels,
            events,
            identity,
            node,
            heartbeats,
        }
    }

    /// A gateway with `config`, and a healthy agent served as its registered node, ready.
    async fn serving(config: TunnelServerConfig) -> (Self, Agent, ServeTask) {
        let mut gw = Self::start(config).await;
        let agent = Agent::new(true);
        let serve = gw.serve_ready(&agent).await;
        (gw, agent, serve)
    }

    fn client(&self, identity: NodeIdentity) -> TunnelClient {
        self.client_at(self.port, identity, descriptor())
    }

    /// A client dialling `wss://localhost:{port}` (the gateway, or a relay in front of it) with
    /// the gateway's CA, as `identity` advertising `descriptor`.
    fn client_at(
        &self,
        port: u16,
        identity: NodeIdentity,
        descriptor: NodeDescriptor,
    ) -> TunnelClient {
        let mut config = TunnelClientConfig::new(
            format!("wss://localhost:{port}/v1/tunnel"),
            identity,
            descriptor,
        );
        config.tls = Some(client_config_with_ca(&self.ca_pem).unwrap());
        TunnelClient::new(config).unwrap()
    }

    /// Connects `client` and serves `agent` on the session, in a task.
    async fn serve_as(&self, client: TunnelClient, agent: &Agent) -> ServeTask {
        let session = client.connect().await.unwrap();
        tokio::spawn(session.serve(agent.service()))
    }

    /// [`Self::serve_as`], then waits for the node to be ready.
    async fn serve_ready_as(&mut self, client: TunnelClient, agent: &Agent) -> ServeTask {
        let serve = self.serve_as(client, agent).await;
        assert!(matches!(self.next_event().await, Event::Ready(..)));
        serve
    }

    /// [`Self::serve_as`] for the registered node dialling the gateway directly.
    async fn serve(&self, agent: &Agent) -> ServeTask {
        self.serve_as(self.client(self.identity.clone()), agent)
            .await
    }

    /// [`Self::serve_ready_as`] for the registered node dialling the gateway directly.
    async fn serve_ready(&mut self, agent: &Agent) -> ServeTask {
        let client = self.client(self.identity.clone());
        self.serve_ready_as(client, agent).await
    }

    /// `method path` with no body, sent to the node through the tunnels.
    async fn send(&self, method: &str, path: &str) -> Result<Response<BoxBody>, TunnelError> {
        self.tunnels
            .send(&self.node, empty_request(method, path))
            .await
    }

    /// Opens `GET /stream` on the node: `agent` answers it with the chunks sent on the returned
    /// sender, one by one.
    async fn open_stream(&self, agent: &Agent) -> (mpsc::Sender<Bytes>, Response<BoxBody>) {
        let (tx, rx) = mpsc::channel::<Bytes>(1);
        *agent.chunks.lock().unwrap() = Some(rx);
        let resp = self.send("GET", "/stream").await.unwrap();
        (tx, resp)
    }

    async fn next_event(&mut self) -> Event {
        tokio::time::timeout(WAIT, self.events.recv())
            .await
            .expect("event in time")
            .expect("events open")
    }

    /// The next event is the registered node's `node_ready`, with the descriptor it advertised.
    async fn expect_ready(&mut self) {
        let ready = Event::Ready(self.node.clone(), descriptor());
        assert_eq!(self.next_event().await, ready);
    }

    /// The next event is the registered node's `node_gone`.
    async fn expect_gone(&mut self) {
        let gone = Event::Gone(self.node.clone());
        assert_eq!(self.next_event().await, gone);
    }

    /// A raw TLS + WebSocket connection, for speaking the handshake by hand.
    async fn raw_ws(&self) -> RawWs {
        common::raw_ws(self.port, &self.ca_pem).await
    }

    async fn raw_tls(&self) -> tokio_rustls::client::TlsStream<TcpStream> {
        common::raw_tls(self.port, &self.ca_pem).await
    }
}

type Chunks = Arc<Mutex<Option<mpsc::Receiver<Bytes>>>>;

/// The agent's local service: `/health` (503 until `healthy`), `POST /echo`, `GET /stream`
/// (chunks from the test, one by one).
#[derive(Clone)]
struct Agent {
    healthy: Arc<AtomicBool>,
    chunks: Chunks,
}

impl Agent {
    fn new(healthy: bool) -> Self {
        Self {
            healthy: Arc::new(AtomicBool::new(healthy)),
            chunks: Arc::new(Mutex::new(None)),
        }
    }

    fn service(&self) -> impl NodeService {
        let agent = self.clone();
        tower::service_fn(move |req: Request<Incoming>| {
            let agent = agent.clone();
            async move { Ok::<_, Infallible>(agent.handle(req).await) }
        })
    }

    async fn handle(&self, req: Request<Incoming>) -> Response<BoxBody> {
        let full = |status: StatusCode, body: Bytes| {
            let mut r = Response::new(Full::new(body).map_err(|e| match e {}).boxed_unsync());
            *r.status_mut() = status;
            r
        };
        match (req.method().as_str(), req.uri().path()) {
            ("GET", "/health") => {
                if self.healthy.load(Ordering::SeqCst) {
                    full(StatusCode::OK, Bytes::from_static(br#"{"status":"ok"}"#))
                } else {
                    full(StatusCode::SERVICE_UNAVAILABLE, Bytes::new())
                }
            }
            ("POST", "/echo") => {
                let q = req.uri().query().unwrap_or("").to_owned();
                let body = req.into_body().collect().await.unwrap().to_bytes();
                let mut out = q.into_bytes();
                out.push(b'|');
                out.extend_from_slice(&body);
                full(StatusCode::OK, Bytes::from(out))
            }
            ("GET", "/stream") => {
                let rx = self.chunks.lock().unwrap().take().unwrap();
                let stream = futures_util::stream::unfold(rx, |mut rx| async move {
                    rx.recv()
                        .await
                        .map(|b| (Ok::<_, spine_core::BoxError>(Frame::data(b)), rx))
                });
                Response::new(StreamBody::new(stream).boxed_unsync())
            }
            _ => full(StatusCode::NOT_FOUND, Bytes::new()),
        }
    }
}

fn empty_request(method: &str, uri: &str) -> Request<BoxBody> {
    Request::builder()
        .method(method)
        .uri(uri)
        .body(
            Full::new(Bytes::new())
                .map_err(|e| match e {})
                .boxed_unsync(),
        )
        .unwrap()
}

async fn expect_close(ws: &mut RawWs) -> (u16, String) {
    loop {
        match tokio::time::timeout(WAIT, ws.next())
            .await
            .expect("close in time")
        {
            Some(Ok(Message::Close(Some(frame)))) => {
                return (u16::from(frame.code), frame.reason.as_str().to_owned())
            }
            Some(Ok(Message::Text(_) | Message::Ping(_) | Message::Pong(_))) => {}
            other => panic!("expected a close frame, got {other:?}"),
        }
    }
}

/// Sends `last` on the stream, ends it, and checks that `last` is all the body had left.
async fn finish_stream(tx: mpsc::Sender<Bytes>, resp: Response<BoxBody>, last: &'static [u8]) {
    tx.send(Bytes::from_static(last)).await.unwrap();
    drop(tx);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], last);
}

/// The error `body` fails with, within `within` (never data, never a hang).
async fn body_error(body: &mut BoxBody, within: Duration) -> spine_core::BoxError {
    tokio::time::timeout(within, body.frame())
        .await
        .expect("the body fails in time")
        .expect("a frame result")
        .expect_err("an error, not data")
}

fn hello_text(hello: Hello) -> Message {
    Message::text(serde_json::to_string(&AgentMessage::Hello(hello)).unwrap())
}

#[tokio::test]
async fn handshake_accepted_and_round_trip_with_streamed_body() {
    let mut gw = Gateway::start(TunnelServerConfig::default()).await;
    let agent = Agent::new(true);
    let client = gw.client(gw.identity.clone());
    let session = client.connect().await.unwrap();
    assert_eq!(session.node_id(), &gw.node);
    let serve = tokio::spawn(session.serve(agent.service()));

    gw.expect_ready().await;
    assert_eq!(
        gw.tunnels.connected(),
        vec![(gw.node.clone(), descriptor())]
    );

    // request body and query reach the agent; the response comes back, tagged with the node
    let mut req = Request::builder()
        .method("POST")
        .uri("http://gateway.internal/echo?x=1")
        .body(
            Full::new(Bytes::from_static(b"ping"))
                .map_err(|e| match e {})
                .boxed_unsync(),
        )
        .unwrap();
    req.extensions_mut().insert(gw.node.clone());
    let resp = gw.tunnels.service().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.extensions().get::<NodeId>(), Some(&gw.node));
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"x=1|ping");

    // a streamed body: each chunk arrives before the next one is even produced
    let (tx, resp) = gw.open_stream(&agent).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    spine_test_support::assert_streams_each(
        &tx,
        &mut body,
        &["data: one\n\n", "data: two\n\n", "data: [DONE]\n\n"],
        WAIT,
    )
    .await;
    drop(tx);
    let rest = tokio::time::timeout(WAIT, body.collect())
        .await
        .unwrap()
        .unwrap()
        .to_bytes();
    assert_eq!(rest, Bytes::new());

    serve.abort();
    gw.expect_gone().await;
}

#[tokio::test]
async fn unknown_key_is_refused() {
    let mut gw = Gateway::start(TunnelServerConfig::default()).await;
    let stranger = NodeIdentity::generate().unwrap();
    let err = gw.client(stranger).connect().await.unwrap_err();
    assert!(err.is_refused());
    assert_eq!(err.refusal(), Some(RefusalReason::UnknownKey));
    assert_eq!(err.to_string(), "tunnel handshake refused: unknown_key");
    assert!(gw.events.try_recv().is_err());
    assert!(gw.tunnels.connected().is_empty());
}

#[tokio::test]
async fn bad_signature_is_refused_with_code_4002() {
    let gw = Gateway::start(TunnelServerConfig::default()).await;
    let mut ws = gw.raw_ws().await;
    let challenge = read_challenge(&mut ws).await;
    assert_eq!(challenge.gateway_id, "spine-gateway");
    assert_eq!(challenge.protocol_version, 2);
    assert_eq!(challenge.nonce.len(), 64);
    // signed by another key, claiming the registered one
    let mut hello = Hello::sign(
        &NodeIdentity::generate().unwrap(),
        &challenge,
        "localhost",
        descriptor(),
    );
    hello.public_key = gw.identity.public_key_text();
    ws.send(hello_text(hello)).await.unwrap();
    assert_eq!(expect_close(&mut ws).await, (4002, "bad_signature".into()));
}

#[tokio::test]
async fn replayed_hello_is_refused() {
    let gw = Gateway::start(TunnelServerConfig::default()).await;
    let mut first = gw.raw_ws().await;
    let old_challenge = read_challenge(&mut first).await;
    let recorded = Hello::sign(&gw.identity, &old_challenge, "localhost", descriptor());
    drop(first);
    let mut ws = gw.raw_ws().await;
    let _fresh = read_challenge(&mut ws).await;
    ws.send(hello_text(recorded)).await.unwrap();
    assert_eq!(expect_close(&mut ws).await, (4002, "bad_signature".into()));
}

#[tokio::test]
async fn a_challenge_relayed_through_a_rogue_gateway_is_refused_with_code_4009() {
    let mut gw = Gateway::start(TunnelServerConfig::default()).await;
    // the rogue dials the real gateway, relays its challenge to an agent that dialled the rogue
    // and sends back the agent's hello: signed for the rogue's name, refused here
    let mut ws = gw.raw_ws().await;
    let challenge = read_challenge(&mut ws).await;
    let relayed = Hello::sign(&gw.identity, &challenge, "rogue.example", descriptor());
    ws.send(hello_text(relayed.clone())).await.unwrap();
    assert_eq!(expect_close(&mut ws).await, (4009, "wrong_gateway".into()));
    // nor can the rogue claim the real name for it: the signature covers the name
    let mut ws = gw.raw_ws().await;
    let challenge = read_challenge(&mut ws).await;
    let mut renamed = Hello::sign(&gw.identity, &challenge, "rogue.example", descriptor());
    renamed.gateway_name = "localhost".into();
    ws.send(hello_text(renamed)).await.unwrap();
    assert_eq!(expect_close(&mut ws).await, (4002, "bad_signature".into()));
    assert!(gw.events.try_recv().is_err());

    // an agent that dialled a name the gateway does not list is refused the same way
    let mut config = TunnelServerConfig::default();
    config.public_names = vec!["gw.example.com".into()];
    let gw = Gateway::start(config).await;
    let err = gw.client(gw.identity.clone()).connect().await.unwrap_err();
    assert_eq!(err.refusal(), Some(RefusalReason::WrongGateway));
    assert!(gw.tunnels.connected().is_empty());
}

#[tokio::test]
async fn stale_challenge_is_refused_with_code_4003() {
    let mut config = TunnelServerConfig::default();
    config.challenge_max_age = Duration::from_millis(100);
    let gw = Gateway::start(config).await;
    let mut ws = gw.raw_ws().await;
    let challenge = read_challenge(&mut ws).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    ws.send(hello_text(Hello::sign(
        &gw.identity,
        &challenge,
        "localhost",
        descriptor(),
    )))
    .await
    .unwrap();
    assert_eq!(
        expect_close(&mut ws).await,
        (4003, "stale_challenge".into())
    );
}

#[tokio::test]
async fn silent_agent_is_refused_with_handshake_timeout() {
    let mut config = TunnelServerConfig::default();
    config.handshake_timeout = Duration::from_millis(200);
    let gw = Gateway::start(config).await;
    let mut ws = gw.raw_ws().await;
    let _ = read_challenge(&mut ws).await;
    assert_eq!(
        expect_close(&mut ws).await,
        (4006, "handshake_timeout".into())
    );
}

#[tokio::test]
async fn malformed_and_future_hellos_are_refused() {
    let gw = Gateway::start(TunnelServerConfig::default()).await;

    let mut ws = gw.raw_ws().await;
    let _ = read_challenge(&mut ws).await;
    ws.send(Message::text("{\"type\":\"hello\"")).await.unwrap();
    assert_eq!(
        expect_close(&mut ws).await,
        (4005, "malformed_handshake".into())
    );

    let mut ws = gw.raw_ws().await;
    let challenge = read_challenge(&mut ws).await;
    let mut hello = Hello::sign(&gw.identity, &challenge, "localhost", descriptor());
    hello.protocol_version = 1;
    ws.send(hello_text(hello)).await.unwrap();
    assert_eq!(
        expect_close(&mut ws).await,
        (4004, "unsupported_protocol".into())
    );

    let mut ws = gw.raw_ws().await;
    let _ = read_challenge(&mut ws).await;
    ws.send(Message::binary(&b"\x00"[..])).await.unwrap();
    assert_eq!(
        expect_close(&mut ws).await,
        (4005, "malformed_handshake".into())
    );
}

#[tokio::test]
async fn second_session_for_a_live_node_is_refused() {
    let (gw, _agent, serve) = Gateway::serving(TunnelServerConfig::default()).await;

    let err = gw.client(gw.identity.clone()).connect().await.unwrap_err();
    assert_eq!(err.refusal(), Some(RefusalReason::DuplicateSession));

    // the first session is untouched
    let resp = gw.send("GET", "/health").await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    serve.abort();
}

#[tokio::test]
async fn node_ready_only_after_the_health_probe_passes() {
    let mut config = TunnelServerConfig::default();
    config.health_probe_interval = Duration::from_millis(50);
    let mut gw = Gateway::start(config).await;
    let agent = Agent::new(false);
    let serve = gw.serve(&agent).await;

    // accepted and probed, but unhealthy: not ready, not listed
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(gw.events.try_recv().is_err());
    assert!(gw.tunnels.connected().is_empty());
    assert!(gw.tunnels.contains(&gw.node));

    agent.healthy.store(true, Ordering::SeqCst);
    gw.expect_ready().await;
    assert_eq!(gw.tunnels.connected().len(), 1);
    serve.abort();
    gw.expect_gone().await;
}

#[tokio::test]
async fn node_gone_when_the_agent_drops_and_it_can_come_back() {
    let mut gw = Gateway::start(TunnelServerConfig::default()).await;
    let agent = Agent::new(true);
    let client = gw.client(gw.identity.clone());
    let serve = tokio::spawn({
        let client = client.clone();
        let service = agent.service();
        async move { client.connect_once(service).await }
    });
    assert!(matches!(gw.next_event().await, Event::Ready(..)));

    // a request in flight when the agent goes away fails as closed
    let (tx, resp) = gw.open_stream(&agent).await;
    let mut body = resp.into_body();
    serve.abort();
    let err = body_error(&mut body, WAIT).await;
    assert!(!err.to_string().is_empty());
    drop(tx);

    gw.expect_gone().await;
    assert!(gw.tunnels.connected().is_empty());
    let err = gw.send("GET", "/health").await.unwrap_err();
    assert!(err.is_unknown_node());

    // the node reconnects: a new session is accepted
    let session = client.connect().await.unwrap();
    let serve = tokio::spawn(session.serve(agent.service()));
    assert!(matches!(gw.next_event().await, Event::Ready(..)));
    serve.abort();
    gw.expect_gone().await;
}

#[tokio::test]
async fn tunnel_service_needs_a_known_target() {
    let gw = Gateway::start(TunnelServerConfig::default()).await;
    let err = gw
        .tunnels
        .service()
        .oneshot(empty_request("GET", "/health"))
        .await
        .unwrap_err();
    assert!(err.is_missing_target());

    let mut req = empty_request("GET", "/health");
    req.extensions_mut().insert(NodeId::new("nobody"));
    let err = gw.tunnels.service().oneshot(req).await.unwrap_err();
    assert!(err.is_unknown_node());
    assert_eq!(err.to_string(), "no live tunnel for node: nobody");
}

#[tokio::test]
async fn other_paths_are_404_and_plain_get_needs_upgrade() {
    let gw = Gateway::start(TunnelServerConfig::default()).await;
    for (request, status_line) in [
        (
            "GET /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
            "HTTP/1.1 404 Not Found",
        ),
        (
            "GET /v1/tunnel HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
            "HTTP/1.1 426 Upgrade Required",
        ),
    ] {
        let mut tls = gw.raw_tls().await;
        tls.write_all(request.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        let _ = tokio::time::timeout(WAIT, tls.read_to_end(&mut out)).await;
        let text = String::from_utf8_lossy(&out);
        assert!(text.starts_with(status_line), "{text}");
    }
}

#[tokio::test]
async fn plaintext_tunnel_works_when_explicitly_allowed() {
    let identity = NodeIdentity::generate().unwrap();
    let node = NodeId::new("plain");
    let auth = StaticAuthenticator::new().with_key(identity.public_key_text(), node.clone());
    let (tx, mut events) = mpsc::unbounded_channel();
    let server = TunnelServer::new(
        TunnelServerConfig::default(),
        Arc::new(auth),
        Arc::new(Recorder(tx, Arc::default())),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(server.serve(listener, None));

    let mut config = TunnelClientConfig::new(
        format!("ws://127.0.0.1:{port}/v1/tunnel"),
        identity,
        descriptor(),
    );
    config.allow_insecure_plaintext = true;
    let client = TunnelClient::new(config).unwrap();
    let agent = Agent::new(true);
    let run = tokio::spawn(client.run(agent.service()));
    let event = tokio::time::timeout(WAIT, events.recv()).await.unwrap();
    assert_eq!(event, Some(Event::Ready(node, descriptor())));
    run.abort();
}

/// A TCP relay in front of the gateway that can be frozen: once frozen it stops moving bytes
/// in both directions without closing anything, as a SIGSTOPped agent or a dead path does.
struct FreezableRelay {
    port: u16,
    frozen: Arc<AtomicBool>,
}

impl FreezableRelay {
    async fn start(gateway_port: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let frozen = Arc::new(AtomicBool::new(false));
        let flag = frozen.clone();
        tokio::spawn(async move {
            loop {
                let (down, _) = listener.accept().await.unwrap();
                let up = TcpStream::connect(("127.0.0.1", gateway_port))
                    .await
                    .unwrap();
                let (dr, dw) = down.into_split();
                let (ur, uw) = up.into_split();
                tokio::spawn(Self::pump(dr, uw, flag.clone()));
                tokio::spawn(Self::pump(ur, dw, flag.clone()));
            }
        });
        Self { port, frozen }
    }

    async fn pump(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        frozen: Arc<AtomicBool>,
    ) {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if frozen.load(Ordering::SeqCst) {
                // hold both sockets open, move nothing
                std::future::pending::<()>().await;
            }
            if to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    }

    fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }
}

impl Gateway {
    /// A gateway with `config`, a relay in front of it, and a healthy agent served through the
    /// relay as the registered node, ready.
    async fn serving_through_relay(
        config: TunnelServerConfig,
    ) -> (Self, Agent, FreezableRelay, ServeTask) {
        let mut gw = Self::start(config).await;
        let agent = Agent::new(true);
        let relay = FreezableRelay::start(gw.port).await;
        let relayed = gw.client_at(relay.port, gw.identity.clone(), descriptor());
        let serve = gw.serve_ready_as(relayed, &agent).await;
        (gw, agent, relay, serve)
    }
}

#[tokio::test]
async fn frozen_agent_is_detected_within_two_ping_intervals_and_in_flight_fails() {
    let ping = Duration::from_millis(1000);
    let mut config = TunnelServerConfig::default();
    config.keepalive_interval = ping;
    config.keepalive_timeout = Duration::from_millis(500);
    // keep the health loop quiet so only keepalive can notice
    config.health_check_interval = Duration::from_secs(600);
    let (mut gw, agent, relay, serve) = Gateway::serving_through_relay(config).await;

    let (_tx, resp) = gw.open_stream(&agent).await;
    let mut body = resp.into_body();

    relay.freeze();
    let frozen_at = tokio::time::Instant::now();
    // the in-flight body fails with an error (never hangs), and the node is gone
    let err = body_error(&mut body, WAIT).await;
    let failed_after = frozen_at.elapsed();
    gw.expect_gone().await;
    let gone_after = frozen_at.elapsed();
    assert!(
        gone_after <= 2 * ping + Duration::from_millis(300),
        "detected after {gone_after:?}, ping interval {ping:?}"
    );
    assert!(failed_after <= gone_after + Duration::from_millis(100));
    assert!(!err.to_string().is_empty());
    serve.abort();
}

#[tokio::test]
async fn dead_old_session_is_taken_over_by_the_reconnecting_node() {
    let mut config = TunnelServerConfig::default();
    config.takeover_probe_timeout = Duration::from_millis(500);
    config.health_probe_interval = Duration::from_millis(50);
    let (mut gw, agent, relay, old_serve) = Gateway::serving_through_relay(config).await;

    // a stream in flight on the old session
    let (_tx, resp) = gw.open_stream(&agent).await;
    let mut old_body = resp.into_body();

    // the old path dies silently; the agent reconnects directly before keepalive notices
    relay.freeze();
    let started = tokio::time::Instant::now();
    let new = gw.client(gw.identity.clone()).connect().await.unwrap();
    let accepted_after = started.elapsed();
    // the replaced session's stream fails at once, not at keepalive
    let err = body_error(&mut old_body, Duration::from_secs(1)).await;
    assert!(!err.to_string().is_empty());
    let new_serve = tokio::spawn(new.serve(agent.service()));
    gw.expect_gone().await;
    gw.expect_ready().await;
    let serving_after = started.elapsed();
    assert!(
        accepted_after >= Duration::from_millis(500),
        "{accepted_after:?}"
    );
    assert!(serving_after < Duration::from_secs(5), "{serving_after:?}");

    // one session, and it serves
    assert_eq!(gw.tunnels.len(), 1);
    let resp = gw.send("GET", "/health").await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    old_serve.abort();
    new_serve.abort();
}

#[tokio::test]
async fn failing_probes_take_the_node_out_of_routing_and_back() {
    let mut config = TunnelServerConfig::default();
    config.health_probe_interval = Duration::from_millis(50);
    config.health_check_interval = Duration::from_millis(100);
    config.health_failures_to_leave = 2;
    let (mut gw, agent, serve) = Gateway::serving(config).await;
    let status = gw.tunnels.status(&gw.node).unwrap();
    assert_eq!(status.state, spine_transport::TunnelState::Ready);
    assert_eq!(status.max_streams, 4);
    assert_eq!(status.streams_open, 0);
    assert_eq!(
        status
            .models
            .iter()
            .map(|m| (m.model.clone(), m.running))
            .collect::<Vec<_>>(),
        vec![(ModelId::new("smollm2"), true)]
    );

    agent.healthy.store(false, Ordering::SeqCst);
    gw.expect_gone().await;
    let status = gw.tunnels.status(&gw.node).unwrap();
    assert_eq!(status.state, spine_transport::TunnelState::Unhealthy);
    assert!(status.consecutive_probe_failures >= 2);
    assert!(!status.models[0].running);
    assert!(gw.tunnels.connected().is_empty());
    assert!(gw.tunnels.contains(&gw.node));

    agent.healthy.store(true, Ordering::SeqCst);
    gw.expect_ready().await;
    serve.abort();
    gw.expect_gone().await;
}

#[tokio::test]
async fn heartbeats_come_with_probes_at_most_once_a_second() {
    let mut config = TunnelServerConfig::default();
    config.health_probe_interval = Duration::from_millis(20);
    config.health_check_interval = Duration::from_millis(20);
    let (gw, _agent, serve) = Gateway::serving(config).await;
    // ~75 probes pass in 1.5 s; heartbeats are capped at one per second
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let beats = gw.heartbeats.load(Ordering::SeqCst);
    assert!((1..=2).contains(&beats), "{beats} heartbeats");
    serve.abort();
}

#[tokio::test]
async fn events_and_connected_carry_the_tunnels_clamped_stream_limit() {
    let mut config = TunnelServerConfig::default();
    config.max_streams_per_node = 2; // the node advertises 4
    let mut gw = Gateway::start(config).await;
    let agent = Agent::new(true);
    let serve = gw.serve(&agent).await;
    let Event::Ready(node, ready) = gw.next_event().await else {
        panic!("expected node_ready");
    };
    assert_eq!(node, gw.node);
    assert_eq!(ready.max_concurrency, 2);
    let connected = gw.tunnels.connected();
    assert_eq!(connected.len(), 1);
    assert_eq!(connected[0].1.max_concurrency, 2);
    assert_eq!(gw.tunnels.status(&gw.node).unwrap().max_streams, 2);
    serve.abort();
}

#[tokio::test]
async fn a_busy_node_still_answers_probes_and_stays_routable() {
    let mut config = TunnelServerConfig::default();
    config.health_probe_interval = Duration::from_millis(20);
    config.health_check_interval = Duration::from_millis(20);
    config.health_probe_timeout = Duration::from_millis(200);
    config.health_failures_to_leave = 2;
    let mut gw = Gateway::start(config).await;
    let agent = Agent::new(true);
    let one_stream = NodeDescriptor {
        max_concurrency: 1,
        ..descriptor()
    };
    let client = gw.client_at(gw.port, gw.identity.clone(), one_stream);
    let serve = gw.serve_ready_as(client, &agent).await;

    // the node's one request stream, held open
    let (tx, resp) = gw.open_stream(&agent).await;
    let status = gw.tunnels.status(&gw.node).unwrap();
    assert_eq!((status.streams_open, status.max_streams), (1, 1));
    let ok_before = status.last_probe_ok_unix_ms.unwrap();
    // the gateway still refuses a second request
    let err = gw.send("GET", "/health").await.unwrap_err();
    assert!(err.is_node_full(), "{err}");

    // many probe rounds (and probe timeouts) later, probes still pass: the node kept a stream
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let status = gw.tunnels.status(&gw.node).unwrap();
    assert_eq!(status.state, spine_transport::TunnelState::Ready);
    assert_eq!(status.consecutive_probe_failures, 0);
    assert!(status.last_probe_ok_unix_ms.unwrap() > ok_before);
    assert_eq!(gw.tunnels.connected().len(), 1);
    assert!(gw.events.try_recv().is_err(), "no node_gone while busy");

    finish_stream(tx, resp, b"x").await;
    serve.abort();
}

#[tokio::test]
async fn a_full_node_is_refused_before_any_byte_and_frees_its_stream() {
    let mut config = TunnelServerConfig::default();
    config.max_streams_per_node = 1;
    let (gw, agent, serve) = Gateway::serving(config).await;

    let (tx, resp) = gw.open_stream(&agent).await;
    assert_eq!(gw.tunnels.status(&gw.node).unwrap().streams_open, 1);
    let err = gw.send("GET", "/health").await.unwrap_err();
    assert!(err.is_node_full(), "{err}");

    finish_stream(tx, resp, b"x").await;
    assert_eq!(gw.tunnels.status(&gw.node).unwrap().streams_open, 0);
    let resp = gw.send("GET", "/health").await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    serve.abort();
}

#[tokio::test]
async fn graceful_shutdown_finishes_in_flight_then_closes() {
    let mut gw = Gateway::start(TunnelServerConfig::default()).await;
    let agent = Agent::new(true);
    let session = gw.client(gw.identity.clone()).connect().await.unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let serve = tokio::spawn(session.serve_until(agent.service(), async move {
        let _ = stop_rx.await;
    }));
    assert!(matches!(gw.next_event().await, Event::Ready(..)));

    let (tx, resp) = gw.open_stream(&agent).await;
    stop_tx.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // after GOAWAY no new stream is accepted
    let err = gw.send("GET", "/health").await.unwrap_err();
    assert!(!err.is_node_full(), "{err}");
    // the stream in flight still completes
    finish_stream(tx, resp, b"last").await;
    let res = tokio::time::timeout(WAIT, serve).await.unwrap().unwrap();
    assert!(res.is_ok(), "{res:?}");
    gw.expect_gone().await;
}

/// An engine that can hang (SIGSTOP, as the agent sees it): while `hung`, `/health` and new
/// requests get no answer at all; `/slow` sends one chunk and then nothing.
#[derive(Clone, Default)]
struct Hangable {
    hung: Arc<AtomicBool>,
}

impl Hangable {
    fn service(&self) -> impl NodeService {
        let hung = self.hung.clone();
        tower::service_fn(move |req: Request<Incoming>| {
            let hung = hung.clone();
            async move {
                if hung.load(Ordering::SeqCst) {
                    // no answer until the gateway gives up (the stream is reset)
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                }
                let body = match req.uri().path() {
                    "/slow" => {
                        let chunks = futures_util::stream::once(async {
                            Ok::<_, spine_core::BoxError>(Frame::data(Bytes::from_static(b"tok")))
                        })
                        .chain(futures_util::stream::pending());
                        StreamBody::new(chunks).boxed_unsync()
                    }
                    _ => Full::new(Bytes::from_static(b"ok"))
                        .map_err(|e| match e {})
                        .boxed_unsync(),
                };
                Ok::<_, Infallible>(Response::new(body))
            }
        })
    }
}

/// A node whose engine hangs while requests are in flight (nothing arrives on its streams and
/// its health probe times out) leaves routing after `stall_timeout + health_probe_interval +
/// health_probe_timeout`, not after the regular probes (every 10 s here) fail twice; its
/// requests that had received nothing fail at once as stalled (a router retries them
/// elsewhere), the stream that was already delivering is left to its idle bound, and the node
/// comes back when a probe passes.
#[tokio::test]
async fn a_hung_engine_with_requests_in_flight_leaves_routing_within_the_stall_bound() {
    let mut config = TunnelServerConfig::default();
    config.health_probe_interval = Duration::from_millis(50);
    config.health_check_interval = Duration::from_secs(10);
    config.health_probe_timeout = Duration::from_millis(300);
    config.stall_timeout = Duration::from_millis(300);
    let mut gw = Gateway::start(config).await;
    let engine = Hangable::default();
    let session = gw.client(gw.identity.clone()).connect().await.unwrap();
    let serve = tokio::spawn(session.serve(engine.service()));
    assert!(matches!(gw.next_event().await, Event::Ready(..)));

    // a stream that has delivered its first token
    let slow = gw.send("GET", "/slow").await.unwrap();
    let mut slow = slow.into_body();
    let first = slow.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(&first[..], b"tok");

    // the engine hangs; a new request waits for its head
    engine.hung.store(true, Ordering::SeqCst);
    let hung_at = tokio::time::Instant::now();
    let tunnels = gw.tunnels.clone();
    let node = gw.node.clone();
    let waiting = tokio::spawn(async move {
        let res = tunnels.send(&node, empty_request("POST", "/echo")).await;
        (res.map(|_| ()), tokio::time::Instant::now())
    });

    gw.expect_gone().await;
    let left_after = hung_at.elapsed();
    eprintln!("hung node left routing after {left_after:?}");
    // bound: 300 ms quiet + 50 ms tick + 300 ms probe = 650 ms; the regular probes alone would
    // take 10 s. Generous for a loaded machine, far under what the old rule took.
    assert!(left_after < Duration::from_secs(5), "{left_after:?}");
    let status = gw.tunnels.status(&gw.node).unwrap();
    assert_eq!(status.state, spine_transport::TunnelState::Unhealthy);
    assert!(gw.tunnels.connected().is_empty());

    // the waiting request failed at once, as stalled
    let (res, failed_at) = waiting.await.unwrap();
    let err = res.unwrap_err();
    assert!(err.is_stalled(), "{err}");
    assert!(!err.is_node_full() && !err.is_closed());
    assert!(failed_at.duration_since(hung_at) < Duration::from_secs(5));

    // the stream that already delivered is not cut by the stall (bytes reached the caller)
    assert!(
        tokio::time::timeout(Duration::from_millis(200), slow.frame())
            .await
            .is_err(),
        "the delivering stream was cut"
    );

    // the engine resumes: the next probe passes and the node is back
    engine.hung.store(false, Ordering::SeqCst);
    gw.expect_ready().await;
    drop(slow);
    serve.abort();
}

/// A node busy only with requests that send nothing until they are done (non-streamed), whose
/// engine still answers its health probe, stays routable: one signal is not a stall.
#[tokio::test]
async fn quiet_streams_with_a_passing_probe_are_not_a_stall() {
    let mut config = TunnelServerConfig::default();
    config.health_probe_interval = Duration::from_millis(50);
    config.health_check_interval = Duration::from_secs(10);
    config.health_probe_timeout = Duration::from_millis(300);
    config.stall_timeout = Duration::from_millis(100);
    let (mut gw, agent, serve) = Gateway::serving(config).await;
    let (tx, resp) = gw.open_stream(&agent).await;
    let ok_before = gw
        .tunnels
        .status(&gw.node)
        .unwrap()
        .last_probe_ok_unix_ms
        .unwrap();
    // ten stall periods with nothing on the stream: probed, passes, stays
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let status = gw.tunnels.status(&gw.node).unwrap();
    assert_eq!(status.state, spine_transport::TunnelState::Ready);
    assert_eq!(status.consecutive_probe_failures, 0);
    // the stall clock made it probe early (the regular check is 10 s away)
    assert!(status.last_probe_ok_unix_ms.unwrap() > ok_before);
    assert!(gw.events.try_recv().is_err(), "no node_gone");
    finish_stream(tx, resp, b"done").await;
    serve.abort();
}
