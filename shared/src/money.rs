//! Money as integers. The ledger never sees a float: a euro is 1,000,000 micro-euros.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct MicroEur(pub u64);

impl MicroEur {
    pub const PER_EUR: u64 = 1_000_000;

    /// Cost of `tokens` at `per_mtok` (micro-euros per million tokens), rounded up so
    /// that a reservation is never smaller than what it covers.
    pub fn for_tokens(tokens: u64, per_mtok: MicroEur) -> MicroEur {
        let micro = u128::from(tokens) * u128::from(per_mtok.0);
        let cost = micro.div_ceil(1_000_000);
        MicroEur(u64::try_from(cost).unwrap_or(u64::MAX))
    }

    /// Euros as a decimal string with six places (`"0.000150"`), for humans and JSON.
    pub fn to_eur_string(self) -> String {
        format!("{}.{:06}", self.0 / Self::PER_EUR, self.0 % Self::PER_EUR)
    }

    pub fn saturating_add(self, other: MicroEur) -> MicroEur {
        MicroEur(self.0.saturating_add(other.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cost_rounds_up_to_the_next_micro_euro() {
        // 0.15 €/Mtok = 150_000 µ€/Mtok; 7 tokens cost 1.05 µ€ → 2 µ€.
        assert_eq!(MicroEur::for_tokens(7, MicroEur(150_000)), MicroEur(2));
        assert_eq!(MicroEur::for_tokens(1_000_000, MicroEur(2_000_000)), MicroEur(2_000_000));
        assert_eq!(MicroEur::for_tokens(0, MicroEur(2_000_000)), MicroEur(0));
    }

    #[test]
    fn renders_six_decimal_places() {
        assert_eq!(MicroEur(1_500_020).to_eur_string(), "1.500020");
        assert_eq!(MicroEur(7).to_eur_string(), "0.000007");
    }
}
