//! UTC calendar periods: the day and the month a budget counts in, and when they end.
//!
//! Dates come from `jiff`, the crate's one calendar (the audit's timestamps and the
//! report's dates use it too), always in UTC: no time zone database is involved.

use jiff::civil::Date;
use jiff::tz::Offset;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Period {
    /// A rate's window (SPEC §14): `2026-12-06T09:01`.
    Minute,
    Day,
    Month,
}

impl Period {
    pub fn as_str(self) -> &'static str {
        match self {
            Period::Minute => "minute",
            Period::Day => "day",
            Period::Month => "month",
        }
    }

    /// The period's stamp at `now` (Unix seconds): `2026-11-29` or `2026-11`.
    ///
    /// A call stamps each of its budgets and its audit record: the two stamps of the
    /// day are kept per thread (a Unix day is 86,400 seconds, leap seconds aside), so
    /// the calendar is worked out once a day, not several times a call.
    pub fn stamp(self, now: u64) -> String {
        thread_local! {
            static STAMPS: std::cell::RefCell<(u64, String, String)> =
                const { std::cell::RefCell::new((u64::MAX, String::new(), String::new())) };
        }
        let day = now / 86_400;
        STAMPS.with_borrow_mut(|(cached_day, day_stamp, month_stamp)| {
            if *cached_day != day {
                let date = utc_date(now);
                *day_stamp = date.to_string();
                *month_stamp = format!("{:04}-{:02}", date.year(), date.month());
                *cached_day = day;
            }
            match self {
                Period::Minute => {
                    let minute = now % 86_400 / 60;
                    format!("{day_stamp}T{:02}:{:02}", minute / 60, minute % 60)
                }
                Period::Day => day_stamp.clone(),
                Period::Month => month_stamp.clone(),
            }
        })
    }

    /// Unix seconds at which the period containing `now` ends.
    pub fn end(self, now: u64) -> u64 {
        let date = utc_date(now);
        let last = match self {
            Period::Minute => return (now / 60 + 1).saturating_mul(60),
            Period::Day => date,
            Period::Month => date.last_of_month(),
        };
        last.tomorrow()
            .ok()
            .and_then(|next| Offset::UTC.to_timestamp(next.at(0, 0, 0, 0)).ok())
            .and_then(|end| u64::try_from(end.as_second()).ok())
            .unwrap_or(u64::MAX)
    }
}

/// The UTC date at `now` (Unix seconds); past year 9999, the last date there is.
fn utc_date(now: u64) -> Date {
    let instant = i64::try_from(now).ok().and_then(|s| jiff::Timestamp::from_second(s).ok());
    Offset::UTC.to_datetime(instant.unwrap_or(jiff::Timestamp::MAX)).date()
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
    fn the_days_stamps_kept_change_at_midnight_whichever_way_time_goes() {
        // 2026-11-30T23:59:59Z, then a second later, then back (clocks step back).
        let last = 1_796_083_199;
        let stamps = |now| (Period::Day.stamp(now), Period::Month.stamp(now));
        assert_eq!(stamps(last), ("2026-11-30".into(), "2026-11".into()));
        assert_eq!(stamps(last + 1), ("2026-12-01".into(), "2026-12".into()));
        assert_eq!(stamps(last), ("2026-11-30".into(), "2026-11".into()));
        assert_eq!(stamps(last - 86_399), ("2026-11-30".into(), "2026-11".into()), "the day's first second");
    }

    #[test]
    fn a_minute_is_stamped_in_its_day_and_ends_at_its_sixtieth_second() {
        assert_eq!(Period::Minute.stamp(NOW), "2026-11-29T15:44");
        assert_eq!(Period::Minute.end(NOW), NOW - 30 + 60);
        assert_eq!(Period::Minute.stamp(Period::Minute.end(NOW) - 1), "2026-11-29T15:44");
        assert_eq!(Period::Minute.stamp(Period::Minute.end(NOW)), "2026-11-29T15:45");
        assert_eq!(Period::Minute.stamp(1_796_083_199), "2026-11-30T23:59");
        assert_eq!(Period::Minute.stamp(0), "1970-01-01T00:00");
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
    fn months_end_on_their_own_length() {
        // 2024-02-10T12:00:00Z: a leap February ends after the 29th.
        let leap = 1_707_566_400;
        assert_eq!(Period::Month.stamp(leap), "2024-02");
        assert_eq!(Period::Month.end(leap), 1_709_251_200); // 2024-03-01T00:00:00Z
        // 2025-02-10T12:00:00Z: a common one after the 28th.
        assert_eq!(Period::Month.end(leap + 366 * 86_400), 1_740_787_200); // 2025-03-01T00:00:00Z
        // The last second of a period is still in it; the next is the next period.
        let end = Period::Month.end(NOW);
        assert_eq!(Period::Month.stamp(end - 1), "2026-11");
        assert_eq!(Period::Month.end(end - 1), end);
        assert_eq!(Period::Month.stamp(end), "2026-12");
        assert_eq!(Period::Day.end(0), 86_400);
    }
}
