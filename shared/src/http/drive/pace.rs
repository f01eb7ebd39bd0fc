//! The headers a client paces on (SPEC §14): OpenAI's `x-ratelimit-*`, and on
//! `/v1/messages` Anthropic's `anthropic-ratelimit-*`, for the caller's tightest
//! window of each rate, on every answer of a call under a limit (its 429s included,
//! and the refusals that come before any reservation: [`standing`]).

use http::{HeaderMap, HeaderName, HeaderValue};

use crate::budget::period::unix_now;
use crate::budget::plan::{self, Gauge, Pace};
use crate::gateway::Gateway;
use crate::identity::Caller;

/// Where `caller` stands in its windows now, read without reserving: for a call
/// refused before admission read them (a run not found or ended, a request that could
/// never fit a window), whose answer paces like any other. `remaining` is what the
/// window holds, the refused call not counted in it. No read, and `None`, for a caller
/// under no limit; best effort, as after a reservation: a read that fails costs the
/// answer its headers.
pub(in crate::http) async fn standing(gateway: &Gateway, caller: &Caller) -> Option<Pace> {
    let windows = plan::windows_for(&gateway.config, caller, unix_now());
    if windows.is_empty() {
        return None;
    }
    let keys: Vec<_> = windows.iter().map(|w| w.key.clone()).collect();
    match gateway.budgets.used(&keys).await {
        Ok(used) => Pace::of(&windows, &used),
        Err(e) => {
            tracing::warn!("the windows could not be read for the pacing headers: {e}");
            None
        }
    }
}

/// Writes `pace`'s headers, if the call has one: inline, so that a call under no limit
/// pays a test and no call.
#[inline]
pub(in crate::http) fn write(headers: &mut HeaderMap, pace: Option<Pace>, anthropic: bool) {
    if let Some(pace) = pace {
        write_pace(headers, pace, anthropic);
    }
}

fn write_pace(headers: &mut HeaderMap, pace: Pace, anthropic: bool) {
    let now = unix_now();
    for (rate, gauge) in [("requests", pace.requests), ("tokens", pace.tokens)] {
        let Some(gauge) = gauge else { continue };
        for (name, value) in fields(rate, gauge, now, anthropic) {
            if let (Ok(name), Ok(value)) = (HeaderName::try_from(name), HeaderValue::try_from(value)) {
                headers.insert(name, value);
            }
        }
    }
}

/// One rate's three headers: OpenAI's reset is a duration (`12s`), Anthropic's an
/// RFC 3339 instant.
fn fields(rate: &str, gauge: Gauge, now: u64, anthropic: bool) -> [(String, String); 3] {
    if anthropic {
        let reset = i64::try_from(gauge.resets_at)
            .ok()
            .and_then(|s| jiff::Timestamp::from_second(s).ok())
            .map(|t| t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string())
            .unwrap_or_default();
        [
            (format!("anthropic-ratelimit-{rate}-limit"), gauge.limit.to_string()),
            (format!("anthropic-ratelimit-{rate}-remaining"), gauge.remaining.to_string()),
            (format!("anthropic-ratelimit-{rate}-reset"), reset),
        ]
    } else {
        [
            (format!("x-ratelimit-limit-{rate}"), gauge.limit.to_string()),
            (format!("x-ratelimit-remaining-{rate}"), gauge.remaining.to_string()),
            (format!("x-ratelimit-reset-{rate}"), format!("{}s", gauge.resets_at.saturating_sub(now))),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_resets_in_a_duration_and_anthropic_at_an_instant() {
        let gauge = Gauge { limit: 10, remaining: 3, resets_at: 1_796_547_720 };
        let pace = Pace { requests: Some(gauge), tokens: None };
        let mut openai = HeaderMap::new();
        write(&mut openai, Some(pace), false);
        assert_eq!(openai["x-ratelimit-limit-requests"], "10");
        assert_eq!(openai["x-ratelimit-remaining-requests"], "3");
        assert!(openai["x-ratelimit-reset-requests"].to_str().unwrap().ends_with('s'));
        assert!(!openai.contains_key("x-ratelimit-limit-tokens"));
        let mut anthropic = HeaderMap::new();
        write(&mut anthropic, Some(pace), true);
        assert_eq!(anthropic["anthropic-ratelimit-requests-remaining"], "3");
        assert_eq!(anthropic["anthropic-ratelimit-requests-reset"], "2026-12-06T09:02:00Z");
        assert!(!anthropic.contains_key("x-ratelimit-limit-requests"));
    }
}
