//! Durations as operators write them: a whole number and a unit, `500ms`, `30s`,
//! `5m`, `1h`, `2d`. A bare number is refused: `10` could mean seconds or
//! milliseconds, and guessing wrong trips breakers for hours.

use std::time::Duration;

const UNITS: &str = "ms, s, m, h or d";

/// Parses `500ms`, `30s`, `5m`, `1h`, `2d`. Refuses an empty string, a missing or
/// unknown unit, a sign, a fraction, and anything that overflows.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let text = s.trim();
    if text.is_empty() {
        return Err(format!("empty duration: write a whole number and a unit ({UNITS}), e.g. 30s"));
    }
    let unit_start = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(unit_start);
    if digits.is_empty() {
        return Err(format!("`{text}` is not a duration: write a whole number and a unit ({UNITS}), e.g. 30s"));
    }
    let millis_per_unit: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        "" => {
            return Err(format!("`{text}` has no unit: write e.g. {text}s ({UNITS})"));
        }
        _ => {
            return Err(format!("`{text}` has an unknown unit `{unit}`: use {UNITS}"));
        }
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(millis_per_unit))
        .map(Duration::from_millis)
        .ok_or_else(|| format!("`{text}` is too long a duration"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_each_unit() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2d"), Ok(Duration::from_secs(2 * 86_400)));
    }

    #[test]
    fn refuses_fractions_and_overflow() {
        assert!(parse_duration("1.5s").is_err());
        assert!(parse_duration("99999999999999999999s").is_err());
        assert!(parse_duration("18446744073709551615d").is_err());
    }
}
