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

    /// Euros written as a decimal (`12`, `0.15`, `3.1234567`), read without a float:
    /// places past the sixth round half up to the micro-euro.
    pub fn parse_eur(text: &str) -> Result<MicroEur, String> {
        let invalid = || format!("{text:?} is not an amount of euros (digits, an optional `.` and decimals)");
        let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
        let digits = |part: &str| part.bytes().all(|b| b.is_ascii_digit());
        if (whole.is_empty() && fraction.is_empty()) || !digits(whole) || !digits(fraction) {
            return Err(invalid());
        }
        let whole: u64 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| invalid())? };
        let (kept, rest) = fraction.split_at(fraction.len().min(6));
        let micros: u64 = format!("{kept:0<6}").parse().map_err(|_| invalid())?;
        let round_up = u64::from(rest.as_bytes().first().is_some_and(|d| *d >= b'5'));
        whole
            .checked_mul(Self::PER_EUR)
            .and_then(|m| m.checked_add(micros + round_up))
            .map(MicroEur)
            .ok_or_else(|| format!("{text} euros is too large"))
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
    fn parses_decimal_euros_without_a_float() {
        assert_eq!(MicroEur::parse_eur("12"), Ok(MicroEur(12_000_000)));
        assert_eq!(MicroEur::parse_eur("0.15"), Ok(MicroEur(150_000)));
        assert_eq!(MicroEur::parse_eur(".5"), Ok(MicroEur(500_000)));
        assert_eq!(MicroEur::parse_eur("0.0000015"), Ok(MicroEur(2)), "half up");
        assert_eq!(MicroEur::parse_eur("0.0000014"), Ok(MicroEur(1)));
        for bad in ["", ".", "-1", "1e3", "1.2.3", "abc", "99999999999999999999"] {
            assert!(MicroEur::parse_eur(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn renders_six_decimal_places() {
        assert_eq!(MicroEur(1_500_020).to_eur_string(), "1.500020");
        assert_eq!(MicroEur(7).to_eur_string(), "0.000007");
    }
}
