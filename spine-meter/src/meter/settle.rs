//! The end hook's work: build the settlement and commit it on a spawned task, retrying.

use std::sync::Arc;
use std::time::Duration;

use spine_core::{
    AccountId, ModelId, NodeId, RequestId, RequestKind, StreamOutcome, Usage, UsageSource,
};

use super::{DiscrepancyReport, MeterEvents};
use crate::audit::{AuditSample, AuditTap, NodeLogprobs};
use crate::tokenizer::{CompletionCount, CompletionRule, GeneratedCount, GeneratedText};
use crate::{Ledger, Price, Settlement, TokenCounter};

/// Settlement tasks in flight (spawned when a response body ends); cheap to clone, shared.
///
/// A settlement the ledger refuses (e.g. PostgreSQL unreachable) is retried with backoff until it
/// commits; [`Settlements::pending_request_ids`] names those not committed yet, so a shutdown
/// that cannot wait for them can log them instead of dropping them silently.
///
/// It also bounds them: a request answered before its settlement commits is one a crash of
/// the gateway leaves unpaid (its hold is swept, nothing charged), so while
/// [`MeterConfig::max_unsettled_requests`](super::MeterConfig::max_unsettled_requests) requests
/// wait for their hold or their settlement, new requests wait before their hold, and an
/// account with a quarter of them is refused at once ([`Settlements::wait_for_room`]).
#[derive(Clone, Debug, Default)]
pub struct Settlements {
    tracker: tokio_util::task::TaskTracker,
    unsettled: Arc<std::sync::Mutex<Unsettled>>,
    /// One waiter woken at each commit.
    committed: Arc<tokio::sync::Notify>,
}

/// Requests whose ledger write is not committed yet.
#[derive(Debug, Default)]
struct Unsettled {
    /// Answered requests whose settlement is not committed yet, and their accounts.
    settlements: std::collections::BTreeMap<RequestId, AccountId>,
    /// Holds being placed (asked of the ledger, not answered yet).
    holds: usize,
    /// Both, per account (no entry at 0).
    per_account: std::collections::HashMap<AccountId, usize>,
}

impl Unsettled {
    fn total(&self) -> usize {
        self.settlements.len() + self.holds
    }

    fn add(&mut self, account: &AccountId) {
        *self.per_account.entry(account.clone()).or_default() += 1;
    }

    fn remove(&mut self, account: &AccountId) {
        if let Some(n) = self.per_account.get_mut(account) {
            *n -= 1;
            if *n == 0 {
                self.per_account.remove(account);
            }
        }
    }

    /// The gauge of [`Settlements::unsettled`].
    fn publish(&self) {
        #[cfg(feature = "metrics")]
        metrics::gauge!(crate::metrics::UNSETTLED_REQUESTS).set(self.total() as f64);
    }
}

/// One hold being placed, counted by [`Settlements::unsettled`] until dropped.
#[derive(Debug)]
pub(crate) struct HoldInFlight {
    settlements: Settlements,
    account: AccountId,
}

impl Drop for HoldInFlight {
    fn drop(&mut self) {
        let mut u = self.settlements.lock();
        u.holds -= 1;
        u.remove(&self.account);
        u.publish();
        drop(u);
        self.settlements.committed.notify_one();
    }
}

/// Why [`Settlements::wait_for_room`] gave no room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NoRoom {
    /// The account has its share of the bound: refused at once.
    AccountShare(usize),
    /// The bound stayed full for the whole wait.
    Full,
}

/// How long a request waits for room among the unsettled requests before it is refused
/// ([`MeterError::SettlementsBehind`](super::MeterError::SettlementsBehind), 503): 10 s.
pub const UNSETTLED_WAIT: Duration = Duration::from_secs(10);

/// One account's share of a bound of `max` unsettled requests: a quarter (at least 1), so that
/// one account cannot fill the bound and make every other account wait.
pub(crate) fn account_share(max: usize) -> usize {
    (max / 4).max(1)
}

impl Settlements {
    fn lock(&self) -> std::sync::MutexGuard<'_, Unsettled> {
        self.unsettled.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Requests whose ledger write is not committed yet: answered requests whose settlement
    /// is not, and holds being placed (a request that passed [`Settlements::wait_for_room`]
    /// and waits for its hold is one the ledger is behind on too, and is answered once it has
    /// it). Requests between their hold and their answer are not counted: the bound is soft
    /// by the requests in flight at the nodes.
    pub fn unsettled(&self) -> usize {
        self.lock().total()
    }

    /// Room for one more hold of `account`: the hold counted until the guard is dropped.
    /// Refused at once ([`NoRoom::AccountShare`]) while the account has
    /// [`account_share`]`(max)`; otherwise waits while `max` or more requests are unsettled,
    /// at most `bound` ([`NoRoom::Full`]). `max` of `usize::MAX` is no bound.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: nothing is counted until it returns.
    pub(crate) async fn wait_for_room(
        &self,
        account: &AccountId,
        max: usize,
        bound: Duration,
    ) -> Result<HoldInFlight, NoRoom> {
        let share = account_share(max);
        let room = async {
            loop {
                let committed = self.committed.notified();
                tokio::pin!(committed);
                committed.as_mut().enable();
                {
                    let mut u = self.lock();
                    if u.per_account.get(account).copied().unwrap_or(0) >= share {
                        return Err(NoRoom::AccountShare(share));
                    }
                    if u.total() < max {
                        u.holds += 1;
                        u.add(account);
                        u.publish();
                        return Ok(HoldInFlight {
                            settlements: self.clone(),
                            account: account.clone(),
                        });
                    }
                }
                committed.await;
            }
        };
        tokio::time::timeout(bound, room)
            .await
            .unwrap_or(Err(NoRoom::Full))
    }

    /// Settlements not yet committed to the ledger.
    pub fn pending(&self) -> usize {
        self.tracker.len()
    }

    /// The request ids whose settlement is not committed yet, in id order.
    pub fn pending_request_ids(&self) -> Vec<spine_core::RequestId> {
        self.lock().settlements.keys().cloned().collect()
    }

    pub(crate) fn mark_pending(&self, request_id: &RequestId, account: &AccountId) {
        let mut u = self.lock();
        if u.settlements
            .insert(request_id.clone(), account.clone())
            .is_none()
        {
            u.add(account);
        }
        u.publish();
    }

    pub(crate) fn mark_committed(&self, request_id: &RequestId) {
        let mut u = self.lock();
        if let Some(account) = u.settlements.remove(request_id) {
            u.remove(&account);
        }
        u.publish();
        drop(u);
        // one settlement's room for one waiter (it re-checks; a waiter dropped after being
        // woken passes the wake-up on), not a wake-up of every waiter at every commit
        self.committed.notify_one();
    }

    /// Waits until every settlement spawned so far, and any spawned while waiting, is committed.
    /// Call when no new request can arrive (e.g. at shutdown).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future stops waiting; settlements carry on.
    pub async fn drain(&self) {
        self.tracker.close();
        self.tracker.wait().await;
    }

    pub(crate) fn spawn_on<F>(&self, task: F, runtime: &tokio::runtime::Handle)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.tracker.spawn_on(task, runtime);
    }
}

/// What the end hook needs to settle one request.
#[derive(Clone)]
pub(crate) struct SettleCtx {
    pub(crate) ledger: Arc<dyn Ledger>,
    pub(crate) events: Arc<dyn MeterEvents>,
    pub(crate) runtime: tokio::runtime::Handle,
    pub(crate) settlements: Settlements,
    /// Forgotten for the account once its settlement commits (its hold is released).
    pub(crate) refused_credit: super::credit::RefusedCredit,
    pub(crate) request_id: RequestId,
    pub(crate) account: AccountId,
    /// The caller's key as the edge named it ([`spine_core::RequestContext::key`]).
    pub(crate) key: Option<String>,
    /// When the request was admitted (the TTFT's start).
    pub(crate) started: tokio::time::Instant,
    /// Milliseconds from `started` to the first generated content delivered
    /// ([`SettleCtx::note_first_content`]).
    pub(crate) ttft_ms: Option<u64>,
    pub(crate) model: ModelId,
    pub(crate) node: Option<NodeId>,
    /// Whether the caller asked for log-probabilities: a node's that it did not ask for are
    /// removed from what it receives (text it would get outside the bill).
    pub(crate) caller_logprobs: bool,
    pub(crate) tokenizer: Arc<dyn TokenCounter>,
    pub(crate) price: Price,
    pub(crate) share_bps: u16,
    pub(crate) prompt_tokens: u64,
    /// With more than one prompt (`/v1/completions`): each prompt's tokens, in order. llama.cpp
    /// generates each (prompt, choice) as a task of its own and its `usage` is one task's alone
    /// (non-streamed: the first, prompt 0 / choice 0, whose answer gets the others' choices
    /// appended; streamed: every task's final chunk carries its own, the latest wins), so a
    /// claim matching one task's prompt and choice is not a discrepancy.
    pub(crate) prompt_tokens_each: Option<Arc<[u64]>>,
    /// Choices asked for per prompt (`n`); choice `i` answers prompt `i / n_per_prompt`.
    pub(crate) n_per_prompt: u32,
    /// Choices the caller asked for (`n`): choice indexes `>= n` are never billed.
    pub(crate) n: u32,
    /// Most completion tokens billed per choice: `max(1, min(max_tokens, context − prompt))`,
    /// the per-choice part of the hold.
    pub(crate) max_completion_tokens_per_choice: u64,
    /// The shortest prompt's tokens (the one with the most room for a completion).
    pub(crate) shortest_prompt_tokens: u64,
    /// The request's own `max_tokens` / `max_completion_tokens`, when it set one (the `length`
    /// rule applies only then).
    pub(crate) max_tokens: Option<u64>,
    /// How the request constrains sampling: with a constraint the delivered text's count is
    /// a lower bound only (see [`super::bill::billed_usage`]).
    pub(crate) sampling_constraint: super::constraint::SamplingConstraint,
    /// Most UTF-8 bytes an engine may generate for a choice and never send because of the
    /// request's `stop` strings: the longest one's bytes (0 without). A matched stop string is
    /// generated and counted but not delivered; a partial match is held back and, when
    /// generation ends on `length`, never sent ([`super::prompt::stop_hidden_bytes`]).
    pub(crate) stop_hidden_bytes: u64,
    pub(crate) tolerance_tokens: u64,
    pub(crate) tolerance_bps: u16,
    /// Choice 0's text captured for the audit tap, when one is configured.
    pub(crate) audit: Option<Box<AuditCapture>>,
}

/// Choice 0's delivered text, kept (up to the tap's cap) to offer for audit at a completed
/// settlement.
#[derive(Clone)]
pub(crate) struct AuditCapture {
    tap: Arc<dyn AuditTap>,
    kind: RequestKind,
    body: bytes::Bytes,
    text: String,
    max_bytes: usize,
    /// Choice 0 carried something other than plain text (reasoning, tool calls): not audited.
    plain: bool,
    /// The request carried [`AuditAlways`](crate::audit::AuditAlways).
    pub(crate) always: bool,
    /// Choice 0's logprobs, when the tap audits the model on its nodes' own logprobs.
    node_logprobs: Option<NodeLogprobs>,
}

impl AuditCapture {
    pub(crate) fn new(tap: Arc<dyn AuditTap>, kind: RequestKind, body: bytes::Bytes) -> Self {
        let max_bytes = tap.max_completion_bytes();
        Self {
            tap,
            kind,
            body,
            text: String::new(),
            max_bytes,
            plain: true,
            always: false,
            node_logprobs: None,
        }
    }

    /// Captures choice 0's logprobs (at most `max_tokens` entries). Logprobs added for the
    /// audit are removed from the caller's answer as any it did not ask for
    /// ([`SettleCtx::caller_logprobs`]).
    pub(crate) fn capture_logprobs(&mut self, max_tokens: usize) {
        self.node_logprobs = Some(NodeLogprobs::new(max_tokens));
    }

    /// Appends choice `index`'s `logprobs` member, when captured (only choice 0 is kept).
    pub(crate) fn push_logprobs(&mut self, index: u64, logprobs: Option<&serde_json::Value>) {
        if index != 0 {
            return;
        }
        if let Some(c) = self.node_logprobs.as_mut() {
            c.push(logprobs);
        }
    }

    /// Appends a piece of choice `index`'s delivered text (only choice 0 is kept).
    pub(crate) fn push(&mut self, index: u64, generated: &GeneratedText) {
        if index != 0 || !self.plain {
            return;
        }
        let Some(content) = generated.plain_content() else {
            self.plain = false;
            return;
        };
        let room = self.max_bytes.saturating_sub(self.text.len());
        let mut take = content.len().min(room);
        while !content.is_char_boundary(take) {
            take -= 1;
        }
        self.text.push_str(&content[..take]);
    }
}

impl std::fmt::Debug for SettleCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SettleCtx")
            .field("request_id", &self.request_id)
            .field("account", &self.account)
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

/// What the per-choice billing noticed, for the discrepancy check.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct BillNotes {
    /// A requested choice finished with `length` and its text cannot be `max_tokens` tokens.
    pub(crate) length_unsupported: bool,
    /// Tokens the engine may count above the billed completion for parser-removed syntax
    /// (tool-call wrappers, thinking tags): [`GeneratedCount::wrapper_allowance_tokens`], summed.
    pub(crate) wrapper_allowance_tokens: u64,
    /// With more than one requested choice: the first choice's billed completion tokens.
    /// llama.cpp's `usage` for `n > 1` is the first choice's alone (measured; its server copies
    /// the first result's usage), so a claim matching it is not a discrepancy either.
    pub(crate) first_choice_completion_tokens: Option<u64>,
    /// With several prompts and a claim: the (prompt, billed completion) tokens of the one
    /// (prompt, choice) task nearest to the claim (see [`SettleCtx::prompt_tokens_each`]).
    pub(crate) nearest_task: Option<(u64, u64)>,
    /// Tokens a node may claim above the bill for `length` finishes whose text has the bytes
    /// to be `max_tokens` tokens (summed `cap − billed` of such choices): the bill follows the
    /// text, but a claim of `max_tokens` is then not a lie worth flagging.
    pub(crate) length_claim_allowance_tokens: u64,
}

fn beyond(claimed: u64, billed: u64, tokens: u64, bps: u16) -> bool {
    let rel = u64::try_from(u128::from(billed) * u128::from(bps) / 10_000).unwrap_or(u64::MAX);
    claimed.abs_diff(billed) > tokens.max(rel)
}

impl SettleCtx {
    /// Records the time to the first generated content, once.
    pub(crate) fn note_first_content(&mut self) {
        if self.ttft_ms.is_none() {
            self.ttft_ms =
                Some(u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX));
        }
    }

    /// Caps each choice's completion by the routed node's context window for the model
    /// ([`spine_core::NodeSlot::context_tokens`]), as admission capped it by the catalog's:
    /// `max(1, min(L, context − shortest prompt))`. Only ever lowers the cap (the hold stays).
    pub(crate) fn limit_to_node_context(&mut self, context_tokens: u64) {
        if self.max_completion_tokens_per_choice == 0 {
            return; // embeddings
        }
        let room = context_tokens
            .saturating_sub(self.shortest_prompt_tokens)
            .max(1);
        self.max_completion_tokens_per_choice = self.max_completion_tokens_per_choice.min(room);
    }

    /// Whether choice `index` is one the caller asked for (`index < n`).
    pub(crate) fn is_requested_choice(&self, index: u64) -> bool {
        index < u64::from(self.n)
    }

    /// Completion tokens billed for one choice (module docs, "Billing";
    /// [`bill_counted_spelled`](crate::tokenizer::bill_counted_spelled), the `length` finish
    /// judged on the fewest tokens that spell the text): EOS and the `length` rule only when
    /// `completed`; never more than the per-choice cap.
    pub(crate) fn choice_completion_counted(
        &self,
        generated: &GeneratedCount,
        finish_reason: Option<&str>,
        completed: bool,
    ) -> CompletionCount {
        crate::tokenizer::bill_counted_spelled(
            generated.tokens(&*self.tokenizer),
            generated.fewest(&*self.tokenizer),
            // a `length` finish may have generated a held-back partial stop string as well
            generated.len_bytes().saturating_add(self.stop_hidden_bytes),
            finish_reason,
            CompletionRule {
                max_tokens: self.max_tokens,
                cap_tokens: self.max_completion_tokens_per_choice,
                completed,
            },
        )
    }

    /// Most completion tokens a choice may DELIVER before the node is cut off as over its cap:
    /// the per-choice cap plus `max(16, cap / 10)`, judged on the fewest tokens that spell the
    /// delivered text (an honest engine stops at `max_tokens`
    /// generated tokens, whose text may count a few more: `docs/metering.md`).
    pub(crate) fn delivery_limit_tokens(&self) -> u64 {
        let cap = self.max_completion_tokens_per_choice;
        cap.saturating_add((cap / 10).max(16))
    }

    /// Most UTF-8 bytes a choice may deliver: [`delivery_limit_tokens`](Self::delivery_limit_tokens)
    /// × the longest token (no text of more bytes can be that few tokens).
    pub(crate) fn delivery_limit_bytes(&self) -> u64 {
        self.delivery_limit_tokens()
            .saturating_mul(self.tokenizer.max_token_bytes())
            .saturating_add(crate::tokenizer::MAX_HELD_BACK_BYTES)
    }

    /// Settles on a spawned task (see [`SettleCtx::settle_checked`]) with no extra flags.
    pub(crate) fn settle(self, outcome: StreamOutcome, billed: Usage, claimed: Option<Usage>) {
        self.settle_checked(outcome, billed, claimed, BillNotes::default());
    }

    /// Settles a request that ended before any response body: the prompt as counted, no
    /// completion tokens, no node claim (what is paid depends on `outcome`).
    pub(crate) fn settle_prompt_only(self, outcome: StreamOutcome) {
        let billed = Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: 0,
        };
        self.settle(outcome, billed, None);
    }

    /// Settles on a spawned task. Retries with backoff (50 ms doubling, capped at 5 s) until the
    /// ledger accepts: settlement is idempotent by request id, so a retry never double-charges
    /// (a retry after a commit whose answer was lost returns the first result). Until it commits
    /// the request id is listed by [`Settlements::pending_request_ids`].
    ///
    /// A completed request is a discrepancy when the claim differs from the billed count beyond
    /// the tolerance (a claimed completion ABOVE the billed one may exceed it by
    /// `notes.wrapper_allowance_tokens` more: syntax the engine's parser removed), or when a
    /// `length` finish was not supported by its text.
    pub(crate) fn settle_checked(
        self,
        outcome: StreamOutcome,
        billed: Usage,
        claimed: Option<Usage>,
        notes: BillNotes,
    ) {
        let completed = outcome == StreamOutcome::Completed;
        let discrepancy = completed
            && (notes.length_unsupported
                || claimed.is_some_and(|c| {
                    let over = c
                        .completion_tokens
                        .saturating_sub(billed.completion_tokens)
                        .min(
                            notes
                                .wrapper_allowance_tokens
                                .saturating_add(notes.length_claim_allowance_tokens),
                        );
                    let completion_off = |billed_completion: u64| {
                        beyond(
                            c.completion_tokens - over,
                            billed_completion,
                            self.tolerance_tokens,
                            self.tolerance_bps,
                        )
                    };
                    let prompt_off = |billed_prompt: u64| {
                        beyond(
                            c.prompt_tokens,
                            billed_prompt,
                            self.tolerance_tokens,
                            self.tolerance_bps,
                        )
                    };
                    let first_choice_off = notes
                        .first_choice_completion_tokens
                        .is_none_or(completion_off);
                    // several prompts: llama.cpp's usage is one (prompt, choice) task's
                    let one_task_matches = notes.nearest_task.is_some_and(|(p, completion)| {
                        !prompt_off(p) && !completion_off(completion)
                    });
                    !one_task_matches
                        && (prompt_off(billed.prompt_tokens)
                            || (completion_off(billed.completion_tokens) && first_choice_off))
                }));
        if discrepancy {
            self.events.on_discrepancy(&DiscrepancyReport {
                request_id: self.request_id.clone(),
                node: self.node.clone(),
                model: self.model.clone(),
                billed,
                // a `length` finish the text cannot support, with no claim: the node still
                // claimed `max_tokens` by saying `length`
                claimed: claimed.unwrap_or(billed),
            });
        }
        // a suspect node's earnings wait in escrow for its verdict (design brief §10)
        let earnings_held = match (&self.audit, &self.node) {
            (Some(capture), Some(node)) => capture.tap.earnings_held(node, &self.model),
            _ => false,
        };
        if let (true, Some(capture), Some(node)) = (completed, self.audit, self.node.as_ref()) {
            if capture.plain && !capture.text.is_empty() {
                capture.tap.offer(AuditSample {
                    request_id: self.request_id.clone(),
                    node: node.clone(),
                    model: self.model.clone(),
                    kind: capture.kind,
                    request_body: capture.body,
                    completion: capture.text,
                    always: capture.always,
                    node_logprobs: capture.node_logprobs,
                });
            }
        }
        let settlement = Settlement {
            request_id: self.request_id,
            account: self.account,
            node: self.node,
            model: self.model,
            outcome,
            billed,
            claimed,
            usage_source: UsageSource::Independent,
            discrepancy,
            price: self.price,
            share_bps: self.share_bps,
            earnings_held,
            key: self.key,
            ttft_ms: self.ttft_ms,
        };
        let ledger = self.ledger;
        let events = self.events;
        let runtime = self.runtime;
        let refused_credit = self.refused_credit;
        let settlements = self.settlements.clone();
        settlements.mark_pending(&settlement.request_id, &settlement.account);
        self.settlements.spawn_on(
            async move {
                let mut backoff = Duration::from_millis(50);
                loop {
                    match ledger.settle(settlement.clone()).await {
                        Ok(result) => {
                            settlements.mark_committed(&settlement.request_id);
                            // the hold is released: a refusal remembered while it was held
                            // (its own holds left too little) no longer holds
                            refused_credit.forget(&settlement.account);
                            events.on_settled(&settlement, &result);
                            return;
                        }
                        Err(e) => {
                            tracing::error!(
                                request_id = %settlement.request_id,
                                error = %e,
                                unavailable = e.is_unavailable(),
                                ?settlement,
                                "settlement failed; retrying"
                            );
                            events.on_settle_error(&settlement, &e);
                            tokio::time::sleep(backoff).await;
                            backoff = (backoff * 2).min(Duration::from_secs(5));
                        }
                    }
                }
            },
            &runtime,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::beyond;

    #[test]
    fn tolerance_is_the_larger_of_absolute_and_relative() {
        assert!(!beyond(36, 34, 2, 200));
        assert!(beyond(37, 34, 2, 200));
        assert!(!beyond(1020, 1000, 2, 200));
        assert!(beyond(1021, 1000, 2, 200));
        assert!(beyond(0, 34, 2, 200));
    }
}
