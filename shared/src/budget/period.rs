//! UTC calendar periods: the day and the month a budget counts in, and when they end.
//!
//! Civil dates from Unix time with Howard Hinnant's `civil_from_days`, so the core
//! needs no date crate for the three facts it uses.

/// Days since 1970-01-01 → (year, month 1..=12, day 1..=31).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// (year, month, day) → days since 1970-01-01.
pub(crate) fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let yoe = year.rem_euclid(400);
    let m = i64::from(month);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Period {
    Day,
    Month,
}

impl Period {
    pub fn as_str(self) -> &'static str {
        match self {
            Period::Day => "day",
            Period::Month => "month",
        }
    }

    /// The period's stamp at `now` (Unix seconds): `2026-11-29` or `2026-11`.
    pub fn stamp(self, now: u64) -> String {
        let (y, m, d) = civil_from_days((now / 86_400) as i64);
        match self {
            Period::Day => format!("{y:04}-{m:02}-{d:02}"),
            Period::Month => format!("{y:04}-{m:02}"),
        }
    }

    /// Unix seconds at which the period containing `now` ends.
    pub fn end(self, now: u64) -> u64 {
        let days = (now / 86_400) as i64;
        let next = match self {
            Period::Day => days + 1,
            Period::Month => {
                let (y, m, _) = civil_from_days(days);
                if m == 12 { days_from_civil(y + 1, 1, 1) } else { days_from_civil(y, m + 1, 1) }
            }
        };
        u64::try_from(next).unwrap_or(0) * 86_400
    }
}

/// RFC 3339 UTC with milliseconds: `2026-11-29T15:44:30.123Z`.
pub fn rfc3339_millis(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    let rem = secs % 86_400;
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z", rem / 3600, rem % 3600 / 60, rem % 60, unix_ms % 1000)
}

/// Milliseconds since the Unix epoch, now.
pub fn unix_now_millis() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Seconds since the Unix epoch, now.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    // 2026-11-29T15:44:30Z
    const NOW: u64 = 1_795_967_070;

    #[test]
    fn stamps_day_and_month_in_utc() {
        assert_eq!(Period::Day.stamp(NOW), "2026-11-29");
        assert_eq!(Period::Month.stamp(NOW), "2026-11");
        assert_eq!(Period::Day.stamp(0), "1970-01-01");
        // 2024-02-29T23:59:59Z, a leap day.
        assert_eq!(Period::Day.stamp(1_709_251_199), "2024-02-29");
    }

    #[test]
    fn periods_end_at_the_next_utc_midnight_and_first_of_month() {
        assert_eq!(Period::Day.end(NOW), (NOW / 86_400 + 1) * 86_400);
        assert_eq!(Period::Day.stamp(Period::Day.end(NOW)), "2026-11-30");
        assert_eq!(Period::Month.stamp(Period::Month.end(NOW)), "2026-12");
        assert_eq!(Period::Day.stamp(Period::Month.end(NOW)), "2026-12-01");
        // December rolls into January.
        let dec = Period::Month.end(NOW) + 5 * 86_400;
        assert_eq!(Period::Day.stamp(Period::Month.end(dec)), "2027-01-01");
    }

    #[test]
    fn formats_rfc3339_with_millis() {
        assert_eq!(rfc3339_millis(NOW * 1000 + 7), "2026-11-29T15:44:30.007Z");
        assert_eq!(rfc3339_millis(0), "1970-01-01T00:00:00.000Z");
    }

    #[test]
    fn civil_round_trips() {
        for days in [-1000, 0, 59, 60, 365, 10_957, 20_786, 100_000] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }
}
