//! [`SqliteLedger`]'s own methods, the [`Store`] operations callable without the trait in
//! scope (as before the stores shared their SQL); each is its [`Store`] method.

use spine_core::{AccountId, ModelId, NodeId, OperatorId};

use super::SqliteLedger;
use crate::ledger::{
    AccountBalance, Enrollment, EntryTotals, HeldEarnings, KeyLimits, LedgerError, NodeRecord,
    Store,
};

impl SqliteLedger {
    /// [`Store::create_account`].
    ///
    /// # Errors
    ///
    /// As [`Store::create_account`].
    pub async fn create_account(&self, account: &AccountId) -> Result<(), LedgerError> {
        Store::create_account(self, account).await
    }

    /// [`Store::add_credits`].
    ///
    /// # Errors
    ///
    /// As [`Store::add_credits`].
    pub async fn add_credits(
        &self,
        account: &AccountId,
        amount_micros: u64,
        idempotency_key: &str,
    ) -> Result<bool, LedgerError> {
        Store::add_credits(self, account, amount_micros, idempotency_key).await
    }

    /// [`Store::create_api_key`].
    ///
    /// # Errors
    ///
    /// As [`Store::create_api_key`].
    pub async fn create_api_key(
        &self,
        account: &AccountId,
        key_hash: &str,
    ) -> Result<(), LedgerError> {
        Store::create_api_key(self, account, key_hash).await
    }

    /// [`Store::set_key_limits`].
    ///
    /// # Errors
    ///
    /// As [`Store::set_key_limits`].
    pub async fn set_key_limits(
        &self,
        key_hash: &str,
        limits: KeyLimits,
    ) -> Result<(), LedgerError> {
        Store::set_key_limits(self, key_hash, limits).await
    }

    /// [`Store::key_limits`].
    ///
    /// # Errors
    ///
    /// As [`Store::key_limits`].
    pub async fn key_limits(&self, key_hash: &str) -> Result<Option<KeyLimits>, LedgerError> {
        Store::key_limits(self, key_hash).await
    }

    /// [`Store::account_for_key_hash`].
    ///
    /// # Errors
    ///
    /// As [`Store::account_for_key_hash`].
    pub async fn account_for_key_hash(
        &self,
        key_hash: &str,
    ) -> Result<Option<AccountId>, LedgerError> {
        Store::account_for_key_hash(self, key_hash).await
    }

    /// [`Store::account`].
    ///
    /// # Errors
    ///
    /// As [`Store::account`].
    pub async fn account(&self, account: &AccountId) -> Result<AccountBalance, LedgerError> {
        Store::account(self, account).await
    }

    /// [`Store::create_operator`].
    ///
    /// # Errors
    ///
    /// As [`Store::create_operator`].
    pub async fn create_operator(&self, operator: &OperatorId) -> Result<(), LedgerError> {
        Store::create_operator(self, operator).await
    }

    /// [`Store::operator_earned_micros`].
    ///
    /// # Errors
    ///
    /// As [`Store::operator_earned_micros`].
    pub async fn operator_earned_micros(&self, operator: &OperatorId) -> Result<u64, LedgerError> {
        Store::operator_earned_micros(self, operator).await
    }

    /// [`Store::register_node`].
    ///
    /// # Errors
    ///
    /// As [`Store::register_node`].
    pub async fn register_node(
        &self,
        operator: &OperatorId,
        public_key_text: &str,
    ) -> Result<NodeId, LedgerError> {
        Store::register_node(self, operator, public_key_text).await
    }

    /// [`Store::create_enrollment`].
    ///
    /// # Errors
    ///
    /// As [`Store::create_enrollment`].
    pub async fn create_enrollment(
        &self,
        operator: &OperatorId,
        token_hash: &str,
        expires_at_ms: i64,
    ) -> Result<(), LedgerError> {
        Store::create_enrollment(self, operator, token_hash, expires_at_ms).await
    }

    /// [`Store::redeem_enrollment`].
    ///
    /// # Errors
    ///
    /// As [`Store::redeem_enrollment`].
    pub async fn redeem_enrollment(
        &self,
        token_hash: &str,
        public_key_text: &str,
        name: Option<&str>,
    ) -> Result<Enrollment, LedgerError> {
        Store::redeem_enrollment(self, token_hash, public_key_text, name).await
    }

    /// [`Store::operator_nodes`].
    ///
    /// # Errors
    ///
    /// As [`Store::operator_nodes`].
    pub async fn operator_nodes(
        &self,
        operator: &OperatorId,
    ) -> Result<Vec<NodeRecord>, LedgerError> {
        Store::operator_nodes(self, operator).await
    }

    /// [`Store::node_for_public_key`].
    ///
    /// # Errors
    ///
    /// As [`Store::node_for_public_key`].
    pub async fn node_for_public_key(
        &self,
        public_key_text: &str,
    ) -> Result<Option<NodeId>, LedgerError> {
        Store::node_for_public_key(self, public_key_text).await
    }

    /// [`Store::node_operator`].
    ///
    /// # Errors
    ///
    /// As [`Store::node_operator`].
    pub async fn node_operator(&self, node: &NodeId) -> Result<OperatorId, LedgerError> {
        Store::node_operator(self, node).await
    }

    /// [`Store::settle_stale_holds`]: every hold still active, settled `upstream_failed`
    /// ([`SweepKind::Restart`](crate::ledger::SweepKind::Restart)). Call it only when no
    /// request is in flight on this store: at start-up, before serving, single instance.
    ///
    /// # Errors
    ///
    /// As [`Store::settle_stale_holds`].
    pub async fn settle_stale_holds(&self) -> Result<u64, LedgerError> {
        Store::settle_stale_holds(self).await
    }

    /// [`Store::settle_holds_at_shutdown`]: as [`SqliteLedger::settle_stale_holds`], recorded
    /// as [`SweepKind::Shutdown`](crate::ledger::SweepKind::Shutdown).
    ///
    /// # Errors
    ///
    /// As [`Store::settle_stale_holds`].
    pub async fn settle_holds_at_shutdown(&self) -> Result<u64, LedgerError> {
        Store::settle_holds_at_shutdown(self).await
    }

    /// [`Store::entries_sum_micros`].
    ///
    /// # Errors
    ///
    /// As [`Store::entries_sum_micros`].
    pub async fn entries_sum_micros(&self) -> Result<i64, LedgerError> {
        Store::entries_sum_micros(self).await
    }

    /// [`Store::entry_totals`].
    ///
    /// # Errors
    ///
    /// As [`Store::entry_totals`].
    pub async fn entry_totals(&self) -> Result<EntryTotals, LedgerError> {
        Store::entry_totals(self).await
    }

    /// [`Store::resolve_held_earnings`].
    ///
    /// # Errors
    ///
    /// As [`Store::resolve_held_earnings`].
    pub async fn resolve_held_earnings(
        &self,
        node: &NodeId,
        model: &ModelId,
        pay: bool,
    ) -> Result<HeldEarnings, LedgerError> {
        Store::resolve_held_earnings(self, node, model, pay).await
    }
}
