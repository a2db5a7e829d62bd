//! The request body, read within the layer's bounds before anything parses it
//! ([`read_request_body`]): a remembered refusal for lack of credit, the balance read before a
//! large body, the shared and per-account budgets of bytes being read.

use std::sync::Arc;

use http_body_util::BodyExt as _;
use spine_core::{AccountId, BoxBody};

use super::{MeterConfig, MeterError};

/// The request body of `account`, read within the layer's bounds before anything parses it:
///
/// 1. an account that could not pay a moment ago ([`RefusedCredit`](super::credit::RefusedCredit))
///    is refused at once: its body is read and dropped (up to the limit, so the caller sees the
///    402 rather than a broken pipe) — or, with
///    [`refuse_unread_bodies`](super::MeterConfig::refuse_unread_bodies) and a body that
///    declares [`PRECHECK_BODY_BYTES`] or more, dropped unread — the
///    answer held back by `refused_credit_delay` per started
///    [`REFUSED_BODY_BYTES_PER_DELAY`](super::REFUSED_BODY_BYTES_PER_DELAY) of body (read, or
///    declared when unread);
/// 2. with `refuse_unread_bodies`, a body that declares [`PRECHECK_BODY_BYTES`] or more has the
///    account's balance read before it is read (one that cannot pay is refused and remembered);
/// 3. the body is buffered up to `max_request_body_bytes` within the shared
///    `max_buffered_request_bytes` budget ([`collect_limited`]);
/// 4. a body of [`PRECHECK_BODY_BYTES`] or more whose balance was not read yet has it read
///    now: one that cannot pay the cheapest request is refused (and remembered) before its
///    prompt is parsed, templated or counted.
///
/// The metering service runs it on every request; [`MeterLayer::body_gate`](super::MeterLayer::body_gate)
/// hands it to a handler that must read a body itself before the layer (a translation such as
/// `/v1/responses`), so that work is bounded the same way.
///
/// # Errors
///
/// [`MeterError::InsufficientCredit`] (402), [`MeterError::BodyTooLarge`] (413),
/// [`MeterError::BodiesOverBudget`] (503), [`MeterError::Body`] when reading fails.
///
/// # Cancel safety
///
/// Dropping the future drops the body and the budget it held; nothing is recorded.
pub(crate) async fn read_request_body(
    config: &MeterConfig,
    account: &AccountId,
    body: BoxBody,
) -> Result<bytes::Bytes, MeterError> {
    read_request_body_and_balance(config, account, body)
        .await
        .map(|(bytes, _)| bytes)
}

/// [`read_request_body`], with the account's available balance when it was read (a body of
/// [`PRECHECK_BODY_BYTES`] or more): the prompt's count then stops once it costs more.
pub(super) async fn read_request_body_and_balance(
    config: &MeterConfig,
    account: &AccountId,
    body: BoxBody,
) -> Result<(bytes::Bytes, Option<u64>), MeterError> {
    if let Some(available_micros) = config
        .refused_credit
        .cannot_pay(account, config.min_request_cost_micros)
    {
        let declared = declared_bytes(&body, config.max_request_body_bytes);
        let body_bytes = if config.refuse_unread_bodies && declared >= PRECHECK_BODY_BYTES {
            // the server lingers on close: the caller reads the 402, its body is never copied
            // (a smaller one is read: the connection then stays open for the next request)
            declared
        } else {
            drain(body, config.max_request_body_bytes).await
        };
        config
            .refused_credit
            .hold_back(config.refused_credit_delay, body_bytes)
            .await;
        return Err(MeterError::InsufficientCredit {
            available_micros,
            needed_micros: config.min_request_cost_micros,
        });
    }
    let mut available = None;
    if config.refuse_unread_bodies
        && config.min_request_cost_micros > 0
        && declared_bytes(&body, config.max_request_body_bytes) >= PRECHECK_BODY_BYTES
    {
        available = precheck_balance(config, account).await?;
    }
    let bytes = collect_limited(
        body,
        config.max_request_body_bytes,
        &config.request_body_budget,
        config.max_buffered_request_bytes,
        Some(AccountShare {
            bytes: &config.account_body_bytes,
            account,
            limit: config.max_buffered_request_bytes_per_account,
        }),
    )
    .await?;
    if available.is_none()
        && bytes.len() >= PRECHECK_BODY_BYTES
        && config.min_request_cost_micros > 0
    {
        available = precheck_balance(config, account).await?;
    }
    Ok((bytes, available))
}

/// The account's available balance ([`Ledger::available_micros`](crate::Ledger::available_micros)),
/// `None` when the store cannot tell. An account that cannot pay the cheapest request is
/// refused and remembered ([`RefusedCredit`](super::credit::RefusedCredit)).
async fn precheck_balance(
    config: &MeterConfig,
    account: &AccountId,
) -> Result<Option<u64>, MeterError> {
    let Ok(Some(available_micros)) = config.ledger.available_micros(account).await else {
        return Ok(None);
    };
    if available_micros < config.min_request_cost_micros {
        config.refused_credit.record(account, available_micros);
        return Err(MeterError::InsufficientCredit {
            available_micros,
            needed_micros: config.min_request_cost_micros,
        });
    }
    Ok(Some(available_micros))
}

/// The size `body` declares (its `Content-Length`, else the least it can be), at most `limit`.
fn declared_bytes(body: &BoxBody, limit: usize) -> usize {
    let hint = http_body::Body::size_hint(body);
    usize::try_from(hint.exact().unwrap_or(hint.lower()))
        .unwrap_or(usize::MAX)
        .min(limit)
}

/// Request bodies from this size on have the caller's balance read before their prompt is
/// counted ([`Ledger::available_micros`](crate::Ledger::available_micros)).
const PRECHECK_BODY_BYTES: usize = 64 * 1024;

/// Reads and drops a request body, up to `limit` bytes (an error or the limit ends it), and
/// returns how many bytes it read.
async fn drain(mut body: BoxBody, limit: usize) -> usize {
    let mut read = 0usize;
    while let Some(Ok(frame)) = body.frame().await {
        read = read.saturating_add(frame.data_ref().map_or(0, bytes::Buf::remaining));
        if read > limit {
            break;
        }
    }
    read
}

/// Buffers a request body up to `limit` bytes, each KiB of it taken from `budget` (the bytes
/// of every body being read at once, [`MeterConfig::max_buffered_request_bytes`]) until the
/// body is whole: a peer that sends most of a large body and withholds the rest holds at most
/// the budget across all connections, not `limit` on each. Past the budget:
/// [`MeterError::BodiesOverBudget`]. With `share`, the body's bytes also count against its
/// account's share ([`MeterConfig::max_buffered_request_bytes_per_account`], checked first):
/// past it, [`MeterError::AccountBodiesOverBudget`].
async fn collect_limited(
    mut body: BoxBody,
    limit: usize,
    budget: &Arc<tokio::sync::Semaphore>,
    budget_bytes: usize,
    share: Option<AccountShare<'_>>,
) -> Result<bytes::Bytes, MeterError> {
    let mut buf = bytes::BytesMut::new();
    let mut held: Option<tokio::sync::OwnedSemaphorePermit> = None;
    // what this body holds of its account's share, given back when it ends however it ends
    let mut share = share.map(|share| ShareGuard { share, held: 0 });
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(MeterError::Body)?;
        let Ok(data) = frame.into_data() else {
            continue; // trailers: not part of the JSON body
        };
        if buf.len().saturating_add(data.len()) > limit {
            return Err(MeterError::BodyTooLarge { limit_bytes: limit });
        }
        if let Some(guard) = share.as_mut() {
            let want = buf.len().saturating_add(data.len());
            let AccountShare {
                bytes,
                account,
                limit,
            } = guard.share;
            if !bytes.grow(account, &mut guard.held, want, limit) {
                return Err(MeterError::AccountBodiesOverBudget { limit_bytes: limit });
            }
        }
        // KiB taken so far cover `held_kib * 1024` bytes; take what the new bytes need
        let held_kib = held.as_ref().map_or(0, |p| p.num_permits());
        let need_kib = (buf.len() + data.len()).div_ceil(1024);
        if need_kib > held_kib {
            let more = u32::try_from(need_kib - held_kib).unwrap_or(u32::MAX);
            let permit = budget.clone().try_acquire_many_owned(more).map_err(|_| {
                MeterError::BodiesOverBudget {
                    limit_bytes: budget_bytes,
                }
            })?;
            match held.as_mut() {
                Some(h) => h.merge(permit),
                None => held = Some(permit),
            }
        }
        buf.extend_from_slice(&data);
    }
    Ok(buf.freeze())
}

/// One account's share of the request-body budget, for [`collect_limited`].
#[derive(Clone, Copy)]
struct AccountShare<'a> {
    bytes: &'a super::config::AccountBodyBytes,
    account: &'a AccountId,
    limit: usize,
}

/// Gives back what one body holds of its account's share when dropped.
struct ShareGuard<'a> {
    share: AccountShare<'a>,
    held: usize,
}

impl Drop for ShareGuard<'_> {
    fn drop(&mut self) {
        self.share.bytes.release(self.share.account, self.held);
    }
}

#[cfg(test)]
#[path = "tests_budget.rs"]
mod budget_tests;
