//! An audit record's `ts`: when the call ended, to the millisecond.
//!
//! Held as an instant (what the gateway measured, what metrics read with
//! [`Timestamp::unix_millis`]), written as RFC 3339 in UTC with exactly three
//! decimals (`2026-11-29T15:44:30.123Z`), read back from any RFC 3339 timestamp.
//! Nothing formats a time and parses it again.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// An instant with millisecond precision (finer digits are dropped when read).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(jiff::Timestamp);

/// A `ts` that is not an RFC 3339 timestamp.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{value:?} is not an RFC 3339 timestamp: {reason}")]
pub struct TimestampError {
    value: String,
    reason: String,
}

impl Timestamp {
    /// 1970-01-01T00:00:00.000Z.
    pub const UNIX_EPOCH: Timestamp = Timestamp(jiff::Timestamp::UNIX_EPOCH);

    pub fn now() -> Self {
        Self::truncated(jiff::Timestamp::now())
    }

    /// `None` outside the years -9999 to 9999.
    pub fn from_unix_millis(millis: i64) -> Option<Self> {
        jiff::Timestamp::from_millisecond(millis).ok().map(Timestamp)
    }

    /// Milliseconds since the Unix epoch (negative before it).
    pub fn unix_millis(self) -> i64 {
        self.0.as_millisecond()
    }

    /// The instant, for date arithmetic in the crate (UTC dates in the report).
    pub(crate) fn instant(self) -> jiff::Timestamp {
        self.0
    }

    fn truncated(instant: jiff::Timestamp) -> Self {
        Self::from_unix_millis(instant.as_millisecond()).unwrap_or(Timestamp(instant))
    }
}

impl fmt::Display for Timestamp {
    /// `2026-11-29T15:44:30.123Z`: UTC, always three decimals.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.3}", self.0)
    }
}

impl FromStr for Timestamp {
    type Err = TimestampError;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        value
            .parse::<jiff::Timestamp>()
            .map(Self::truncated)
            .map_err(|e| TimestampError { value: value.to_owned(), reason: e.to_string() })
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = std::borrow::Cow::<'de, str>::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // 2026-11-29T15:44:30Z
    const NOW_MS: i64 = 1_795_967_070_000;

    fn millis(text: &str) -> Option<i64> {
        text.parse::<Timestamp>().ok().map(Timestamp::unix_millis)
    }

    #[test]
    fn writes_rfc3339_utc_with_three_decimals() {
        assert_eq!(Timestamp::from_unix_millis(NOW_MS + 7).unwrap().to_string(), "2026-11-29T15:44:30.007Z");
        assert_eq!(Timestamp::from_unix_millis(NOW_MS + 120).unwrap().to_string(), "2026-11-29T15:44:30.120Z");
        assert_eq!(Timestamp::UNIX_EPOCH.to_string(), "1970-01-01T00:00:00.000Z");
        // 2024-02-29T23:59:59.999Z, a leap day.
        assert_eq!(Timestamp::from_unix_millis(1_709_251_199_999).unwrap().to_string(), "2024-02-29T23:59:59.999Z");
        assert_eq!(Timestamp::from_unix_millis(i64::MAX), None);
    }

    #[test]
    fn reads_rfc3339_with_any_offset_and_precision() {
        assert_eq!(millis("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(millis("2025-03-01T10:00:00.250Z"), Some(1_740_823_200_250));
        assert_eq!(millis("2025-03-01T11:00:00.25+01:00"), Some(1_740_823_200_250));
        assert_eq!(millis("2025-03-01T09:30:00.250123-00:30"), Some(1_740_823_200_250));
        assert_eq!(millis("2024-02-29T00:00:00Z"), Some(1_709_164_800_000));
        assert_eq!(millis("1969-12-31T23:59:59Z"), Some(-1_000));
        for bad in [
            "",
            "yesterday",
            "2025-03-01",
            "2025-03-01T10:00:00",
            "2025-13-01T00:00:00Z",
            "2025-02-29T00:00:00Z",
            "2025-03-01T10:00:00.Z",
        ] {
            assert_eq!(millis(bad), None, "{bad}");
        }
    }

    #[test]
    fn what_is_written_reads_back_the_same() {
        let now = Timestamp::now();
        assert_eq!(now.to_string().parse::<Timestamp>().unwrap(), now);
        let json = serde_json::to_string(&now).unwrap();
        assert_eq!(json, format!("\"{now}\""));
        assert_eq!(serde_json::from_str::<Timestamp>(&json).unwrap(), now);
        // Finer digits are dropped, so a record read back equals the one written.
        assert_eq!("2025-03-01T10:00:00.250999Z".parse::<Timestamp>().unwrap().to_string(), "2025-03-01T10:00:00.250Z");
        assert!(serde_json::from_str::<Timestamp>("\"soon\"").unwrap_err().to_string().contains("\"soon\""));
    }
}
