//! The trusted reference that scores audits: a trait, and a llama.cpp implementation.

use std::future::Future;
use std::pin::Pin;

use spine_core::ModelId;

use super::request::AuditPrompt;
use super::score::ScoredToken;
#[cfg(feature = "llama-reference")]
use super::score::TopToken;

/// What the reference is asked to score.
#[derive(Clone, Debug, PartialEq)]
pub struct ReferenceQuery {
    /// The model (a reference may serve several).
    pub model: ModelId,
    /// The request's prompt.
    pub prompt: AuditPrompt,
    /// The delivered completion text (choice 0), possibly cut at the capture cap.
    pub completion: String,
    /// Most positions to score (the first ones).
    pub max_tokens: usize,
}

/// Why a reference could not score (the audit is inconclusive; never the node's fault).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReferenceError {
    /// The reference could not be reached or did not answer in time.
    #[error("reference unavailable: {0}")]
    Unavailable(String),
    /// The reference answered something that is not a scoring.
    #[error("reference answered garbage: {0}")]
    Garbage(String),
    /// The reference does not serve the model.
    #[error("no reference for model '{0}'")]
    NoReference(ModelId),
}

/// A future returned by [`Reference::score`].
pub type ScoreFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<ScoredToken>, ReferenceError>> + Send + 'a>>;

/// What the reference is asked to teacher-force: the node's own tokens
/// ([`super::node_logprobs`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ForceQuery {
    /// The model.
    pub model: ModelId,
    /// The request's prompt.
    pub prompt: AuditPrompt,
    /// The node's tokens as reference ids (no control token), in order.
    pub tokens: Vec<ForcedToken>,
}

/// One token of a [`ForceQuery`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForcedToken {
    /// The reference's id of the token.
    pub id: u32,
    /// Its bytes are not whole UTF-8 (it splits a character): the pinned llama.cpp cannot
    /// force it through a token-id grammar, so it is fed as prompt; never scored.
    pub split: bool,
    /// Its logprob is wanted (`false`: context only, e.g. a token the node held back and
    /// listed no logprob for).
    pub scored: bool,
}

/// A future returned by [`Reference::force`]: per forced token, the reference's raw logprob of
/// it (`None` where not scored: split, not wanted, or not listed).
pub type ForceFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<Option<f64>>, ReferenceError>> + Send + 'a>>;

/// A trusted engine serving a model's exact weights (design brief §10).
///
/// `score` teacher-forces the completion through the model after the prompt and returns, for
/// each of the first `max_tokens` positions in order, the forced token's bytes and the model's
/// most probable tokens with their raw log-probabilities. The forced tokens must spell a prefix
/// of the completion ([`super::observations`] checks).
///
/// # Cancel safety
///
/// Dropping the future abandons the scoring; nothing is recorded.
pub trait Reference: Send + Sync + 'static {
    /// Scores `query` (see the trait docs).
    fn score<'a>(&'a self, query: &'a ReferenceQuery) -> ScoreFuture<'a>;

    /// Teacher-forces `query.tokens` after the prompt and returns, for each in order, the raw
    /// model's (temperature 1, before any sampler) natural log of its probability at its
    /// position (`None` for a split token, one not [`scored`](ForcedToken::scored), or one the
    /// reference did not list: one entry per token). The default answers [`ReferenceError::NoReference`] (a reference that cannot
    /// force ids: node-logprob audits of its models are inconclusive).
    fn force<'a>(&'a self, query: &'a ForceQuery) -> ForceFuture<'a> {
        Box::pin(std::future::ready(Err(ReferenceError::NoReference(
            query.model.clone(),
        ))))
    }
}

/// A reference `llama-server` (llama.cpp) serving the model's GGUF.
///
/// Per audit it makes three calls: `POST /apply-template` (chat prompts: the model's own
/// template), `POST /tokenize` of the completion (no special tokens, pieces parsed as text), and
/// `POST /completion` with the rendered prompt, a token-id grammar `root ::= <[t1]> <[t2]> …`
/// that forces the completion's tokens, `n_probs` and `post_sampling_probs: false`: each
/// position's `top_logprobs` are the raw model's (measured to agree to 4e-6 with one
/// `n_predict: 1` request per prefix). The end-of-generation token is never forced (llama.cpp
/// answers 500 when a grammar holds it), nor is a token that splits a UTF-8 character (the
/// grammar sampler then rejects every candidate: also a 500): such tokens are fed as prompt and
/// the runs of whole-character tokens between them forced one request each (at most
/// [`MAX_REQUESTS_PER_AUDIT`](Self::MAX_REQUESTS_PER_AUDIT)), with the prompt cache on.
/// [`Reference::force`] forces the node's own tokens through the same helper (`n_probs: 1`),
/// its [`split`](ForcedToken::split) tokens fed as prompt.
#[cfg(feature = "llama-reference")]
#[derive(Clone, Debug)]
pub struct LlamaCppReference {
    base: String,
    n_probs: u32,
    client: hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Full<bytes::Bytes>,
    >,
}

#[cfg(feature = "llama-reference")]
impl LlamaCppReference {
    /// Most bytes of a reference answer read.
    pub const MAX_ANSWER_BYTES: usize = 16 << 20;

    /// A reference at `base_url` (`http://host:port`, plain HTTP: a reference runs beside the
    /// gateway), listing `n_probs` top tokens per position (default 40).
    pub fn new(base_url: impl Into<String>) -> Self {
        // llama-server closes a connection idle for 5 s (cpp-httplib's keep-alive timeout): a
        // pooled connection that old may be closing as an audit's request goes out, which would
        // make the audit inconclusive
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .pool_timer(hyper_util::rt::TokioTimer::new())
                .pool_idle_timeout(std::time::Duration::from_secs(2))
                .build_http();
        Self {
            base: base_url.into().trim_end_matches('/').to_owned(),
            n_probs: 40,
            client,
        }
    }

    /// Top tokens listed per position.
    pub fn n_probs(mut self, n: u32) -> Self {
        self.n_probs = n.max(2);
        self
    }

    async fn post(
        &self,
        path: &str,
        body: serde_json::Value,
    ) -> Result<serde_json::Value, ReferenceError> {
        use http_body_util::BodyExt;
        let body = bytes::Bytes::from(body.to_string());
        let mut resent = false;
        let resp = loop {
            let req = http::Request::post(format!("{}{path}", self.base))
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(http_body_util::Full::new(body.clone()))
                .map_err(|e| ReferenceError::Unavailable(e.to_string()))?;
            match self.client.request(req).await {
                Ok(resp) => break resp,
                // the connection closed under the request before any answer (the server closing
                // a keep-alive connection as it went out): scoring is idempotent, send it once more
                Err(e) if !resent && spine_core::closed_before_answer(&e) => resent = true,
                Err(e) => return Err(ReferenceError::Unavailable(format!("{path}: {e}"))),
            }
        };
        let status = resp.status();
        let body = http_body_util::Limited::new(resp.into_body(), Self::MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| ReferenceError::Unavailable(format!("{path}: {e}")))?
            .to_bytes();
        if !status.is_success() {
            let head = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
            return Err(ReferenceError::Unavailable(format!(
                "{path}: HTTP {status}: {head}"
            )));
        }
        serde_json::from_slice(&body).map_err(|e| ReferenceError::Garbage(format!("{path}: {e}")))
    }

    /// The prompt as the node's engine saw it: a chat request's messages through the model's
    /// template (`POST /apply-template`), a completions prompt as is.
    async fn render(&self, prompt: &AuditPrompt) -> Result<String, ReferenceError> {
        use serde_json::{json, Value};
        let garbage = |what: &str| ReferenceError::Garbage(what.to_owned());
        Ok(match prompt {
            AuditPrompt::Text(s) => s.clone(),
            AuditPrompt::Chat(messages) => {
                let messages: Value = serde_json::from_str(messages)
                    .map_err(|e| ReferenceError::Garbage(e.to_string()))?;
                let v = self
                    .post("/apply-template", json!({ "messages": messages }))
                    .await?;
                v.get("prompt")
                    .and_then(Value::as_str)
                    .ok_or_else(|| garbage("/apply-template: no prompt"))?
                    .to_owned()
            }
        })
    }

    async fn score_inner(&self, q: &ReferenceQuery) -> Result<Vec<ScoredToken>, ReferenceError> {
        use serde_json::{json, Value};
        let garbage = |what: &str| ReferenceError::Garbage(what.to_owned());
        let prompt = self.render(&q.prompt).await?;
        let v = self
            .post(
                "/tokenize",
                json!({
                    "content": q.completion,
                    "add_special": false,
                    "parse_special": false,
                    "with_pieces": true,
                }),
            )
            .await?;
        // (id, bytes, whole): a piece is a string, or its bytes when they are not valid UTF-8
        // alone (a token that splits a character)
        let pieces: Vec<(u64, Vec<u8>, bool)> = v
            .get("tokens")
            .and_then(Value::as_array)
            .ok_or_else(|| garbage("/tokenize: no tokens"))?
            .iter()
            .take(q.max_tokens)
            .map(|t| {
                let id = t
                    .get("id")
                    .and_then(Value::as_u64)
                    .ok_or_else(|| garbage("/tokenize: a token without id"))?;
                match t.get("piece") {
                    Some(Value::String(s)) => Ok((id, s.as_bytes().to_vec(), true)),
                    Some(Value::Array(_)) => Ok((id, bytes_of_array(t.get("piece"))?, false)),
                    _ => Err(garbage("/tokenize: a token without piece")),
                }
            })
            .collect::<Result<_, ReferenceError>>()?;
        let runs: Vec<(u64, bool)> = pieces.iter().map(|p| (p.0, !p.2)).collect();
        let listed = self.force_runs(&prompt, &runs, self.n_probs).await?;
        listed
            .into_iter()
            .zip(pieces)
            .map(|(p, (_, bytes, _))| {
                let top = match p {
                    None => Vec::new(),
                    Some(p) => p
                        .get("top_logprobs")
                        .and_then(Value::as_array)
                        .ok_or_else(|| garbage("/completion: no top_logprobs"))?
                        .iter()
                        .map(|t| {
                            Ok(TopToken {
                                bytes: bytes_of_array(t.get("bytes"))?,
                                logprob: t.get("logprob").and_then(Value::as_f64).ok_or_else(
                                    || garbage("/completion: a top token without logprob"),
                                )?,
                            })
                        })
                        .collect::<Result<Vec<_>, ReferenceError>>()?,
                };
                Ok(ScoredToken { bytes, top })
            })
            .collect()
    }

    /// Most `/completion` requests one audit makes (one per run of whole-character tokens).
    pub const MAX_REQUESTS_PER_AUDIT: usize = 64;

    /// Teacher-forces `tokens` (`(id, split)`) after the rendered `prompt`: each run of
    /// whole-character tokens is forced by one `/completion` request whose prompt carries every
    /// token before it (the prompt cache makes that a short prefill); split tokens are fed as
    /// prompt, never forced. The pinned llama.cpp's token-id grammar cannot force a token that
    /// splits a UTF-8 character (its grammar sampler rejects every candidate after one: HTTP
    /// 500), nor does it list a forced token after which the text ends inside a character.
    ///
    /// Returns, per token in order, the `completion_probabilities` entry listed for it (`None`:
    /// split or not listed); shorter than `tokens` when
    /// [`MAX_REQUESTS_PER_AUDIT`](Self::MAX_REQUESTS_PER_AUDIT) runs were forced before the end.
    ///
    /// # Errors
    ///
    /// [`ReferenceError`] when a request fails or lists positions that are not the forced
    /// tokens in order.
    async fn force_runs(
        &self,
        prompt: &str,
        tokens: &[(u64, bool)],
        n_probs: u32,
    ) -> Result<Vec<Option<serde_json::Value>>, ReferenceError> {
        use serde_json::{json, Value};
        let mut out = Vec::with_capacity(tokens.len());
        let mut start = 0;
        let mut requests = 0;
        while start < tokens.len() {
            if tokens[start].1 {
                out.push(None);
                start += 1;
                continue;
            }
            if requests == Self::MAX_REQUESTS_PER_AUDIT {
                break;
            }
            requests += 1;
            let end = start + tokens[start..].iter().take_while(|t| !t.1).count();
            let prompt_json = if start == 0 {
                json!(prompt)
            } else {
                let mut mixed = vec![json!(prompt)];
                mixed.extend(tokens[..start].iter().map(|t| json!(t.0)));
                Value::Array(mixed)
            };
            out.extend(
                self.force_run(prompt_json, &tokens[start..end], n_probs)
                    .await?,
            );
            start = end;
        }
        Ok(out)
    }

    /// One teacher-forcing request: `run` (whole-character tokens) after `prompt` (a string, or
    /// a string then token ids), a token-id grammar `root ::= <[t1]> <[t2]> …`, `n_probs`,
    /// `post_sampling_probs: false`, greedy, the prompt cache on. Returns each token's listed
    /// entry (`None`: not listed).
    async fn force_run(
        &self,
        prompt: serde_json::Value,
        run: &[(u64, bool)],
        n_probs: u32,
    ) -> Result<Vec<Option<serde_json::Value>>, ReferenceError> {
        use serde_json::{json, Value};
        let grammar = format!(
            "root ::= {}",
            run.iter()
                .map(|t| format!("<[{}]>", t.0))
                .collect::<Vec<_>>()
                .join(" ")
        );
        let mut v = self
            .post(
                "/completion",
                json!({
                    "prompt": prompt,
                    "grammar": grammar,
                    "n_predict": run.len(),
                    "n_probs": n_probs,
                    "post_sampling_probs": false,
                    "temperature": 0.0,
                    "stream": false,
                    "cache_prompt": true,
                }),
            )
            .await?;
        let Some(Value::Array(probs)) = v.get_mut("completion_probabilities").map(Value::take)
        else {
            return Err(ReferenceError::Garbage(
                "/completion: no completion_probabilities".into(),
            ));
        };
        // llama.cpp lists no probabilities for a token after which the text ends inside a
        // UTF-8 character (its `process_token` holds such a token back): the list is the forced
        // tokens minus those, in order
        let n_listed = probs.len();
        let mut listed = probs.into_iter().peekable();
        let out: Vec<Option<Value>> = run
            .iter()
            .map(|t| listed.next_if(|p| p.get("id").and_then(Value::as_u64) == Some(t.0)))
            .collect();
        if listed.next().is_some() {
            return Err(ReferenceError::Garbage(format!(
                "/completion: {n_listed} positions listed that are not the {} forced tokens in order",
                run.len()
            )));
        }
        Ok(out)
    }
}

#[cfg(feature = "llama-reference")]
impl LlamaCppReference {
    /// Forces the node's tokens ([`force_runs`](Self::force_runs), `n_probs: 1`): each listed
    /// position's `logprob` is the raw model's of the forced token. One entry per token.
    async fn force_ids(&self, q: &ForceQuery) -> Result<Vec<Option<f64>>, ReferenceError> {
        use serde_json::Value;
        if q.tokens.is_empty() {
            return Ok(Vec::new());
        }
        let prompt = self.render(&q.prompt).await?;
        let runs: Vec<(u64, bool)> = q
            .tokens
            .iter()
            .map(|t| (u64::from(t.id), t.split))
            .collect();
        let listed = self.force_runs(&prompt, &runs, 1).await?;
        let mut out: Vec<Option<f64>> = listed
            .iter()
            .zip(&q.tokens)
            .map(|(p, t)| {
                p.as_ref()
                    .filter(|_| t.scored)
                    .and_then(|p| p.get("logprob"))
                    .and_then(Value::as_f64)
            })
            .collect();
        out.resize(q.tokens.len(), None);
        Ok(out)
    }
}

/// Bytes from a JSON array of integers 0–255.
#[cfg(feature = "llama-reference")]
fn bytes_of_array(v: Option<&serde_json::Value>) -> Result<Vec<u8>, ReferenceError> {
    v.and_then(serde_json::Value::as_array)
        .ok_or_else(|| ReferenceError::Garbage("a token without bytes".into()))?
        .iter()
        .map(|b| {
            b.as_u64()
                .and_then(|b| u8::try_from(b).ok())
                .ok_or_else(|| ReferenceError::Garbage("a byte out of range".into()))
        })
        .collect()
}

#[cfg(feature = "llama-reference")]
impl Reference for LlamaCppReference {
    fn score<'a>(&'a self, query: &'a ReferenceQuery) -> ScoreFuture<'a> {
        Box::pin(self.score_inner(query))
    }

    fn force<'a>(&'a self, query: &'a ForceQuery) -> ForceFuture<'a> {
        Box::pin(self.force_ids(query))
    }
}

/// References by model: scores each query on its model's reference
/// ([`ReferenceError::NoReference`] for a model without one).
#[derive(Clone, Default)]
pub struct ReferenceSet {
    by_model: std::collections::HashMap<ModelId, std::sync::Arc<dyn Reference>>,
}

impl std::fmt::Debug for ReferenceSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReferenceSet")
            .field("models", &self.by_model.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl ReferenceSet {
    /// No references.
    pub fn new() -> Self {
        Self::default()
    }

    /// Scores `model`'s audits on `reference`.
    pub fn with(mut self, model: ModelId, reference: std::sync::Arc<dyn Reference>) -> Self {
        self.by_model.insert(model, reference);
        self
    }

    /// Whether `model` has a reference.
    pub fn covers(&self, model: &ModelId) -> bool {
        self.by_model.contains_key(model)
    }
}

impl Reference for ReferenceSet {
    fn score<'a>(&'a self, query: &'a ReferenceQuery) -> ScoreFuture<'a> {
        match self.by_model.get(&query.model) {
            Some(r) => r.score(query),
            None => Box::pin(std::future::ready(Err(ReferenceError::NoReference(
                query.model.clone(),
            )))),
        }
    }

    fn force<'a>(&'a self, query: &'a ForceQuery) -> ForceFuture<'a> {
        match self.by_model.get(&query.model) {
            Some(r) => r.force(query),
            None => Box::pin(std::future::ready(Err(ReferenceError::NoReference(
                query.model.clone(),
            )))),
        }
    }
}
