//! [`sql_console!`]: the console's statements as a store's
//! [`ConsoleStore`](crate::ledger::ConsoleStore) implementation.

/// Implements [`ConsoleStore`](crate::ledger::ConsoleStore) for a
/// [`Backend`](super::super::Backend) with the console's statements ([`super`]).
macro_rules! sql_console {
    ($store:ty) => {
        impl $crate::ledger::ConsoleStore for $store {
            fn create_console_user<'a>(
                &'a self,
                user: &'a $crate::ledger::ConsoleUser,
            ) -> $crate::ledger::LedgerFuture<'a, ()> {
                Box::pin($crate::ledger::sql::console::create_console_user(
                    self, user,
                ))
            }

            fn console_user_by_email<'a>(
                &'a self,
                email: &'a str,
            ) -> $crate::ledger::LedgerFuture<'a, Option<$crate::ledger::ConsoleUser>> {
                Box::pin($crate::ledger::sql::console::console_user_by_email(
                    self, email,
                ))
            }

            fn create_console_session<'a>(
                &'a self,
                token_hash: &'a str,
                user_id: &'a str,
                expires_at_ms: i64,
            ) -> $crate::ledger::LedgerFuture<'a, ()> {
                Box::pin($crate::ledger::sql::console::create_console_session(
                    self,
                    token_hash,
                    user_id,
                    expires_at_ms,
                ))
            }

            fn console_session<'a>(
                &'a self,
                token_hash: &'a str,
                now_ms: i64,
            ) -> $crate::ledger::LedgerFuture<'a, Option<$crate::ledger::ConsoleUser>> {
                Box::pin($crate::ledger::sql::console::console_session(
                    self, token_hash, now_ms,
                ))
            }

            fn revoke_console_session<'a>(
                &'a self,
                token_hash: &'a str,
            ) -> $crate::ledger::LedgerFuture<'a, ()> {
                Box::pin($crate::ledger::sql::console::revoke_console_session(
                    self, token_hash,
                ))
            }

            fn revoke_console_sessions<'a>(
                &'a self,
                user_id: &'a str,
            ) -> $crate::ledger::LedgerFuture<'a, u64> {
                Box::pin($crate::ledger::sql::console::revoke_console_sessions(
                    self, user_id,
                ))
            }

            fn create_console_link<'a>(
                &'a self,
                token_hash: &'a str,
                user_id: &'a str,
                expires_at_ms: i64,
            ) -> $crate::ledger::LedgerFuture<'a, ()> {
                Box::pin($crate::ledger::sql::console::create_console_link(
                    self,
                    token_hash,
                    user_id,
                    expires_at_ms,
                ))
            }

            fn redeem_console_link<'a>(
                &'a self,
                token_hash: &'a str,
                now_ms: i64,
            ) -> $crate::ledger::LedgerFuture<'a, Option<$crate::ledger::ConsoleUser>> {
                Box::pin($crate::ledger::sql::console::redeem_console_link(
                    self, token_hash, now_ms,
                ))
            }

            fn create_named_api_key<'a>(
                &'a self,
                account: &'a spine_core::AccountId,
                key_hash: &'a str,
                name: &'a str,
                key_hint: &'a str,
            ) -> $crate::ledger::LedgerFuture<'a, ()> {
                Box::pin($crate::ledger::sql::console::create_named_api_key(
                    self, account, key_hash, name, key_hint,
                ))
            }

            fn account_keys<'a>(
                &'a self,
                account: &'a spine_core::AccountId,
                after: Option<&'a $crate::ledger::PageCursor>,
                limit: u32,
            ) -> $crate::ledger::LedgerFuture<'a, $crate::ledger::Page<$crate::ledger::ApiKeyInfo>>
            {
                Box::pin($crate::ledger::sql::console::account_keys(
                    self, account, after, limit,
                ))
            }

            fn revoke_api_key<'a>(
                &'a self,
                account: &'a spine_core::AccountId,
                key_hash: &'a str,
            ) -> $crate::ledger::LedgerFuture<'a, bool> {
                Box::pin($crate::ledger::sql::console::revoke_api_key(
                    self, account, key_hash,
                ))
            }

            fn account_requests<'a>(
                &'a self,
                account: &'a spine_core::AccountId,
                filter: &'a $crate::ledger::RequestFilter,
                after: Option<&'a $crate::ledger::PageCursor>,
                limit: u32,
            ) -> $crate::ledger::LedgerFuture<
                'a,
                $crate::ledger::Page<$crate::ledger::RequestSummary>,
            > {
                Box::pin($crate::ledger::sql::console::account_requests(
                    self, account, filter, after, limit,
                ))
            }

            fn account_usage<'a>(
                &'a self,
                account: &'a spine_core::AccountId,
                since_ms: i64,
                until_ms: i64,
                limit: u32,
            ) -> $crate::ledger::LedgerFuture<'a, Vec<$crate::ledger::UsageDay>> {
                Box::pin($crate::ledger::sql::console::account_usage(
                    self, account, since_ms, until_ms, limit,
                ))
            }

            fn account_credits<'a>(
                &'a self,
                account: &'a spine_core::AccountId,
                after: Option<&'a $crate::ledger::PageCursor>,
                limit: u32,
            ) -> $crate::ledger::LedgerFuture<'a, $crate::ledger::Page<$crate::ledger::CreditEntry>>
            {
                Box::pin($crate::ledger::sql::console::account_credits(
                    self, account, after, limit,
                ))
            }

            fn operator_earnings<'a>(
                &'a self,
                operator: &'a spine_core::OperatorId,
                since_ms: i64,
                until_ms: i64,
                limit: u32,
            ) -> $crate::ledger::LedgerFuture<'a, Vec<$crate::ledger::EarningsDay>> {
                Box::pin($crate::ledger::sql::console::operator_earnings(
                    self, operator, since_ms, until_ms, limit,
                ))
            }

            fn operator_enrollments<'a>(
                &'a self,
                operator: &'a spine_core::OperatorId,
                after: Option<&'a $crate::ledger::PageCursor>,
                limit: u32,
            ) -> $crate::ledger::LedgerFuture<
                'a,
                $crate::ledger::Page<$crate::ledger::EnrollmentInfo>,
            > {
                Box::pin($crate::ledger::sql::console::operator_enrollments(
                    self, operator, after, limit,
                ))
            }

            fn revoke_enrollment<'a>(
                &'a self,
                operator: &'a spine_core::OperatorId,
                token_hash: &'a str,
            ) -> $crate::ledger::LedgerFuture<'a, bool> {
                Box::pin($crate::ledger::sql::console::revoke_enrollment(
                    self, operator, token_hash,
                ))
            }
            fn platform_days(
                &self,
                since_ms: i64,
                until_ms: i64,
                limit: u32,
            ) -> $crate::ledger::LedgerFuture<'_, Vec<$crate::ledger::PlatformDay>> {
                Box::pin($crate::ledger::sql::console::platform_days(
                    self, since_ms, until_ms, limit,
                ))
            }

            fn platform_operators(
                &self,
                since_ms: i64,
                until_ms: i64,
                limit: u32,
            ) -> $crate::ledger::LedgerFuture<'_, Vec<$crate::ledger::OperatorWindow>> {
                Box::pin($crate::ledger::sql::console::platform_operators(
                    self, since_ms, until_ms, limit,
                ))
            }

            fn platform_nodes<'a>(
                &'a self,
                after: Option<&'a $crate::ledger::PageCursor>,
                limit: u32,
            ) -> $crate::ledger::LedgerFuture<'a, $crate::ledger::Page<$crate::ledger::NodeInfo>>
            {
                Box::pin($crate::ledger::sql::console::platform_nodes(
                    self, after, limit,
                ))
            }

            fn platform_discrepancies<'a>(
                &'a self,
                after: Option<&'a $crate::ledger::PageCursor>,
                limit: u32,
            ) -> $crate::ledger::LedgerFuture<
                'a,
                $crate::ledger::Page<$crate::ledger::DiscrepancyRecord>,
            > {
                Box::pin($crate::ledger::sql::console::platform_discrepancies(
                    self, after, limit,
                ))
            }

            fn platform_held(
                &self,
            ) -> $crate::ledger::LedgerFuture<'_, $crate::ledger::HeldCredit> {
                Box::pin($crate::ledger::sql::console::platform_held(self))
            }
        }
    };
}
pub(in crate::ledger) use sql_console;
