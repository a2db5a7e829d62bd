//! Prices and money, in integer micro-units only (design brief §6).
//!
//! Formulas (all intermediates `u128`, no floating point):
//! - `cost_micros = ceil((prompt_tokens × input_micros_per_mtok + completion_tokens ×
//!   output_micros_per_mtok) / 1_000_000)` — rounded up so a request is never free by rounding;
//!   saturates at `u64::MAX`.
//! - `operator_credit_micros = floor(debit_micros × share_bps / 10_000)` and
//!   `fee_micros = debit_micros − operator_credit_micros` — the platform keeps the rounding
//!   remainder, and `operator_credit + fee == debit` exactly. `share_bps` above 10 000 counts as
//!   10 000.

use serde::{Deserialize, Serialize};
use spine_core::Usage;

/// Basis points in one whole (100 %).
pub const BPS_ONE: u16 = 10_000;

/// A model's price per million tokens, in micro-units of the account currency.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Price {
    /// Price of one million prompt tokens, micros.
    pub input_micros_per_mtok: u64,
    /// Price of one million completion tokens, micros.
    pub output_micros_per_mtok: u64,
}

impl Price {
    /// The cost of `usage`: `ceil((prompt × in + completion × out) / 1_000_000)`, saturating.
    pub fn cost_micros(&self, usage: &Usage) -> u64 {
        let total = (u128::from(usage.prompt_tokens) * u128::from(self.input_micros_per_mtok))
            .saturating_add(
                u128::from(usage.completion_tokens) * u128::from(self.output_micros_per_mtok),
            );
        u64::try_from(total.div_ceil(1_000_000)).unwrap_or(u64::MAX)
    }
}

/// How one debit is split between the node's operator and the platform.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Split {
    /// `floor(debit × share_bps / 10_000)`, micros.
    pub operator_credit_micros: u64,
    /// `debit − operator_credit`, micros.
    pub fee_micros: u64,
}

/// Splits `debit_micros` with the operator's share in basis points (clamped to 10 000).
pub fn split(debit_micros: u64, share_bps: u16) -> Split {
    let bps = u128::from(share_bps.min(BPS_ONE));
    let credit = u128::from(debit_micros) * bps / u128::from(BPS_ONE);
    // credit <= debit, so it fits in u64
    let operator_credit_micros = u64::try_from(credit).unwrap_or(debit_micros);
    Split {
        operator_credit_micros,
        fee_micros: debit_micros - operator_credit_micros,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cost_rounds_up_and_never_overflows() {
        let p = Price {
            input_micros_per_mtok: 150_000,
            output_micros_per_mtok: 600_000,
        };
        let u = Usage {
            prompt_tokens: 34,
            completion_tokens: 12,
        };
        // 34*150000 + 12*600000 = 12_300_000 -> 12.3 -> 13
        assert_eq!(p.cost_micros(&u), 13);
        assert_eq!(p.cost_micros(&Usage::default()), 0);
        let one = Usage {
            prompt_tokens: 1,
            completion_tokens: 0,
        };
        assert_eq!(p.cost_micros(&one), 1);
        let max = Price {
            input_micros_per_mtok: u64::MAX,
            output_micros_per_mtok: u64::MAX,
        };
        let big = Usage {
            prompt_tokens: u64::MAX,
            completion_tokens: u64::MAX,
        };
        assert_eq!(max.cost_micros(&big), u64::MAX);
    }

    #[test]
    fn split_floors_the_operator_and_sums_exactly() {
        assert_eq!(
            split(13, 7_000),
            Split {
                operator_credit_micros: 9,
                fee_micros: 4
            }
        );
        assert_eq!(split(u64::MAX, 10_000).fee_micros, 0);
        assert_eq!(split(100, 20_000).operator_credit_micros, 100);
        for d in [0u64, 1, 7, 999, 123_456_789] {
            for bps in [0u16, 1, 5_000, 9_999, 10_000] {
                let s = split(d, bps);
                assert_eq!(s.operator_credit_micros + s.fee_micros, d);
            }
        }
    }
}
