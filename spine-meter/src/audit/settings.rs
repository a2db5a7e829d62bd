//! [`AuditSettings`]: an application's `[audit]` table (design brief §10; `docs/trust.md`),
//! checked into an [`AuditConfig`], and the auditor spawned for the models that name a
//! reference.

use serde::Deserialize;

use super::AuditConfig;

/// How nodes' models are audited, in an application's configuration terms (rates as shares
/// 0–1, `timeout_secs` in seconds). Deserializes from a table with these field names, every key
/// optional ([`Default`]: [`AuditConfig::default`]'s values, no challenges, challenges every
/// 600 s when an account is set); unknown keys are refused.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct AuditSettings {
    /// Share of a passing node's completed requests audited.
    pub rate_passing: f64,
    /// Share audited while a node's model is unverified (new nodes).
    pub rate_unverified: f64,
    /// Share audited while suspect.
    pub rate_suspect: f64,
    /// Bound of the probability that the test ever fails an honest node from a fresh start
    /// ([`SprtConfig::alpha`](super::SprtConfig::alpha)).
    pub alpha: f64,
    /// The test's floor, reaching it is `passing` ([`SprtConfig::beta`](super::SprtConfig::beta)).
    pub beta: f64,
    /// Most completion tokens scored per audit.
    pub max_tokens: usize,
    /// Audits scored at once.
    pub concurrency: usize,
    /// Longest one scoring may take before the audit is inconclusive, seconds.
    pub timeout_secs: u64,
    /// The account challenges are billed to (create it and credit it through the admin API);
    /// none: no challenges.
    pub challenge_account: Option<String>,
    /// A routable node whose audited model had no audit for this long gets a challenge, seconds.
    pub challenge_interval_secs: u64,
    /// Score the audited models on their nodes' own logprobs ([`super::node_logprobs`]): the
    /// gateway asks nodes for them (callers never see logprobs they did not ask for); each
    /// audited model then needs its `gguf` (the reference vocabulary). Default `true` when
    /// spine-meter has its `tokenizer` feature (the GGUF reader): measured in `docs/trust.md`,
    /// it fails the substitutes within a few hundred audited tokens where the text statistic
    /// did not on sampled traffic, and costs a node no measurable CPU. `false`: the delivered
    /// text is re-tokenized and scored ([`super::score`]).
    pub node_logprobs: bool,
}

/// One audited model, as the application configures it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditedModel<'a> {
    /// The model id.
    pub model: &'a str,
    /// The `http://` URL of a llama-server its operator trusts with the model's exact weights.
    pub reference_url: &'a str,
    /// The model's GGUF (the reference's vocabulary, read when `node_logprobs`).
    pub gguf: Option<&'a std::path::Path>,
    /// Audit on the nodes' own logprobs ([`super::node_logprobs`]).
    pub node_logprobs: bool,
}

impl Default for AuditSettings {
    fn default() -> Self {
        let d = AuditConfig::default();
        Self {
            rate_passing: d.rate_passing,
            rate_unverified: d.rate_unverified,
            rate_suspect: d.rate_suspect,
            alpha: d.sprt.alpha,
            beta: d.sprt.beta,
            max_tokens: d.max_tokens,
            concurrency: d.concurrency,
            timeout_secs: d.timeout.as_secs(),
            challenge_account: None,
            challenge_interval_secs: 600,
            node_logprobs: cfg!(feature = "tokenizer"),
        }
    }
}

/// Settings that make no test, or a reference that is no llama-server URL; the message names
/// the key (`audit.alpha`, `model '…': reference_url`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct AuditSettingsError(String);

impl AuditSettings {
    /// The challenge loop these settings ask for ([`Challenges`](super::Challenges)): billed to
    /// `challenge_account`, every `challenge_interval_secs` (at least 1 s), of the audited
    /// `models`, scored by `auditor`; `None` without a `challenge_account`.
    pub fn challenges(
        &self,
        auditor: &super::Auditor,
        models: Vec<spine_core::ModelId>,
    ) -> Option<super::Challenges> {
        let account = spine_core::AccountId::new(self.challenge_account.as_deref()?);
        let interval = std::time::Duration::from_secs(self.challenge_interval_secs.max(1));
        Some(super::Challenges::new(
            auditor.clone(),
            account,
            models,
            interval,
        ))
    }

    /// The auditor's configuration: rates checked to lie in 0–1, `max_tokens` at least 2,
    /// `concurrency` and `timeout_secs` at least 1, the SPRT's error rates set.
    ///
    /// # Errors
    ///
    /// [`AuditSettingsError`] for a rate outside 0–1, or `alpha` / `beta` not above 0 and
    /// below 0.5.
    pub fn audit_config(&self) -> Result<AuditConfig, AuditSettingsError> {
        let mut c = AuditConfig::default();
        for (name, rate) in [
            ("rate_passing", self.rate_passing),
            ("rate_unverified", self.rate_unverified),
            ("rate_suspect", self.rate_suspect),
        ] {
            if !(0.0..=1.0).contains(&rate) {
                return Err(AuditSettingsError(format!(
                    "audit.{name} must be between 0 and 1 (got {rate})"
                )));
            }
        }
        c.rate_passing = self.rate_passing;
        c.rate_unverified = self.rate_unverified;
        c.rate_suspect = self.rate_suspect;
        c.max_tokens = self.max_tokens.max(2);
        c.concurrency = self.concurrency.max(1);
        c.timeout = std::time::Duration::from_secs(self.timeout_secs.max(1));
        c.sprt = c.sprt.with_error_rates(self.alpha, self.beta);
        if !c.sprt.is_valid() {
            return Err(AuditSettingsError(format!(
                "audit.alpha and audit.beta must each be above 0 and below 0.5 (got {} and {})",
                self.alpha, self.beta
            )));
        }
        Ok(c)
    }

    /// The auditor, when a model names a reference: each [`AuditedModel`] names the `http://`
    /// URL of a llama-server its operator trusts with the model's exact weights
    /// ([`LlamaCppReference`](super::LlamaCppReference)) and, for models audited on their
    /// nodes' logprobs, the GGUF its vocabulary is read from; verdicts move the node's earnings in
    /// and out of escrow in `store` ([`EscrowOnVerdict`](super::EscrowOnVerdict)). `None` when no
    /// model names one (the settings are then not checked).
    ///
    /// # Errors
    ///
    /// [`AuditSettingsError`] for a reference that is not an `http://` or `https://` URL, a
    /// node-logprob model without a readable GGUF vocabulary, or settings that make no test
    /// ([`audit_config`](Self::audit_config)).
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime, when it spawns the auditor.
    #[cfg(feature = "llama-reference")]
    pub fn spawn_auditor<'a>(
        &self,
        models: impl IntoIterator<Item = AuditedModel<'a>>,
        store: std::sync::Arc<dyn crate::Store>,
    ) -> Result<Option<super::Auditor>, AuditSettingsError> {
        use std::sync::Arc;
        let mut set = super::ReferenceSet::new();
        let mut any = false;
        let mut vocabularies = std::collections::HashMap::new();
        for m in models {
            let (model, url) = (m.model, m.reference_url);
            if m.node_logprobs {
                let vocabulary = vocabulary_of(model, m.gguf)?;
                tracing::info!(
                    model,
                    tokens = vocabulary.len(),
                    "auditing on nodes' own logprobs"
                );
                vocabularies.insert(spine_core::ModelId::new(model), Arc::new(vocabulary));
            }
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(AuditSettingsError(format!(
                    "model '{model}': reference_url must be an http:// URL of a llama-server (got {url})"
                )));
            }
            let reference = Arc::new(super::LlamaCppReference::new(url));
            set = set.with(spine_core::ModelId::new(model), reference);
            any = true;
        }
        if !any {
            return Ok(None);
        }
        let audit_config = self.audit_config()?;
        tracing::info!(
            ?audit_config,
            "auditing nodes' models against their references"
        );
        Ok(Some(super::Auditor::spawn_with_node_logprobs(
            audit_config,
            Arc::new(set),
            Arc::new(super::EscrowOnVerdict::new(store)),
            vocabularies,
        )))
    }
}

#[cfg(all(feature = "llama-reference", feature = "tokenizer"))]
fn vocabulary_of(
    model: &str,
    gguf: Option<&std::path::Path>,
) -> Result<super::TokenVocabulary, AuditSettingsError> {
    let Some(path) = gguf else {
        return Err(AuditSettingsError(format!(
            "model '{model}': audit.node_logprobs needs the model's gguf (its vocabulary)"
        )));
    };
    super::TokenVocabulary::from_gguf(path).map_err(|e| {
        AuditSettingsError(format!(
            "model '{model}': reading the vocabulary of {}: {e}",
            path.display()
        ))
    })
}

#[cfg(all(feature = "llama-reference", not(feature = "tokenizer")))]
fn vocabulary_of(
    model: &str,
    _gguf: Option<&std::path::Path>,
) -> Result<super::TokenVocabulary, AuditSettingsError> {
    Err(AuditSettingsError(format!(
        "model '{model}': audit.node_logprobs needs spine-meter's `tokenizer` feature (the gguf reader)"
    )))
}

#[cfg(test)]
mod tests;
