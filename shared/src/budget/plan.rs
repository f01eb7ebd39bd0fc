//! What a call reserves, and what it settles: the arithmetic of SPEC §6, pure.
//!
//! The prompt estimate is an upper bound: every token of a byte-level BPE vocabulary
//! covers at least one byte of text, so a prompt of N UTF-8 bytes is at most N tokens;
//! each message adds at most 4 framing tokens, the reply priming 3, each image is
//! reserved at 2,048 tokens. When the backend reports no usage (a stream without its
//! usage chunk), settlement uses a typical estimate instead (4 bytes a token), marked
//! `estimated`: a bound would overcharge by about four times.

use std::cell::RefCell;
use std::sync::Arc;

use crate::call::Usage;
use crate::config::{Agent, AgentId, Budgets, Config, Price, Rates, Tenant, TenantId};
use crate::identity::Caller;
use crate::money::MicroEur;

use super::run::Run;
use super::{CounterKey, Line, Period, Unit};

pub const TOKENS_PER_IMAGE: u64 = 2048;
const FRAMING_TOKENS_PER_MESSAGE: u64 = 4;
const REPLY_PRIMING_TOKENS: u64 = 3;

/// Upper bound of a prompt's tokens.
pub fn prompt_upper_bound(text_bytes: u64, messages: u64, images: u64) -> u64 {
    text_bytes + FRAMING_TOKENS_PER_MESSAGE * messages + REPLY_PRIMING_TOKENS + TOKENS_PER_IMAGE * images
}

/// Typical token count of relayed text, for usage the backend did not report.
pub fn typical_tokens(text_bytes: u64) -> u64 {
    text_bytes.div_ceil(4)
}

/// Typical token count of a prompt, for usage the backend did not report.
pub fn prompt_typical(text_bytes: u64, messages: u64, images: u64) -> u64 {
    typical_tokens(text_bytes)
        + FRAMING_TOKENS_PER_MESSAGE * messages
        + REPLY_PRIMING_TOKENS
        + TOKENS_PER_IMAGE * images
}

/// Cost of a usage at a price, rounded up to the micro-euro.
pub fn cost(usage: Usage, price: Price) -> MicroEur {
    let cached = usage.cached_tokens.min(usage.prompt_tokens);
    let written = usage.cache_write_tokens.min(usage.prompt_tokens - cached);
    let plain = usage.prompt_tokens - cached - written;
    let input = price.input_per_mtok;
    MicroEur::for_tokens(plain, input)
        .saturating_add(MicroEur::for_tokens(cached, price.cached_input_per_mtok.unwrap_or(input)))
        .saturating_add(MicroEur::for_tokens(written, price.cache_write_per_mtok.unwrap_or(input)))
        .saturating_add(MicroEur::for_tokens(usage.completion_tokens, price.output_per_mtok))
}

/// The highest input and output prices among backends that may serve a call: what a
/// reservation prices the call at, so never below what its settlement may charge: a
/// prompt token at the highest of a backend's input, cached-read and cache-write
/// prices (Anthropic's cache writes cost 1.25 times the input).
pub fn highest_price(prices: impl IntoIterator<Item = Price>) -> Price {
    prices.into_iter().fold(Price::default(), |acc, p| Price {
        input_per_mtok: [p.cached_input_per_mtok, p.cache_write_per_mtok]
            .into_iter()
            .flatten()
            .fold(acc.input_per_mtok.max(p.input_per_mtok), MicroEur::max),
        output_per_mtok: acc.output_per_mtok.max(p.output_per_mtok),
        ..Price::default()
    })
}

/// What a counter of a call's reservation is, which decides how its limit is planned
/// and what its refusal says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A tenant's or agent's budget over a UTC day or month (SPEC §6): the soft cap
    /// watches it, the allowance is clamped to what remains, a refusal is
    /// `budget_exceeded` until its period resets.
    Period,
    /// A per-minute window (SPEC §14): the allowance is clamped to its limit, never to
    /// what remains (a call waits a few seconds rather than being cut short), and a
    /// refusal is `rate_limit_exceeded` until the minute ends.
    Window(Rate),
    /// A run's budget (SPEC §15): clamped to what remains like a budget; a refusal is
    /// `budget_exceeded` that never resets.
    Run,
}

/// What a per-minute window counts (the call's vocabulary: errors name it too).
pub use crate::call::Rate;

/// One budget that applies to a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budget {
    /// For people: `tenant acme tokens_per_day`; a window's holder: `key 9f86d081…`.
    pub name: String,
    pub key: CounterKey,
    pub unit: Unit,
    pub limit: Option<u64>,
    /// Unix seconds when its period resets.
    pub resets_at: u64,
    pub kind: Kind,
}

impl Budget {
    fn amount(&self, usage: Usage, price: Price) -> u64 {
        match self.unit {
            Unit::Tokens => usage.total(),
            Unit::MicroEur => cost(usage, price).0,
            Unit::Requests => 1,
        }
    }

    /// Whether the soft cap watches it: a tenant's or agent's budget.
    pub fn is_period(&self) -> bool {
        self.kind == Kind::Period
    }

    /// Whether it is a per-minute window.
    pub fn is_window(&self) -> bool {
        matches!(self.kind, Kind::Window(_))
    }
}

/// Everything a caller's call counts on: its budgets ([`budgets_for`]), its per-minute
/// windows ([`windows_for`]) and, in a run, the run's and its ancestors' counters. A
/// caller with no limits and no run gets its day's budgets as they are shared, its
/// tenant and agent looked up once: limits off costs nothing.
pub fn counters_for(config: &Config, caller: &Caller, run: Option<&Run>, now: u64) -> Arc<[Budget]> {
    let settings = Settings::of(config, caller);
    let budgets = settings.as_ref().map_or_else(|| Arc::from([]), |s| s.budgets(now));
    let limited = settings.filter(|s| s.limited(caller));
    if limited.is_none() && run.is_none() {
        return budgets;
    }
    // Six windows at most (three holders, two rates), and a run's three counters (its
    // ancestors' grow it).
    let mut all = Vec::with_capacity(budgets.len() + 9);
    all.extend(budgets.iter().cloned());
    if let Some(settings) = limited {
        settings.push_windows(&mut all, caller, now);
    }
    if let Some(run) = run {
        push_run(&mut all, caller.tenant.as_str(), run);
    }
    Arc::from(all)
}

/// A caller's per-minute windows (SPEC §14): its tenant's, its agent's and its key's
/// limits, in the minute that holds `now`. Empty, without an allocation, when none
/// applies.
pub fn windows_for(config: &Config, caller: &Caller, now: u64) -> Vec<Budget> {
    let mut out = Vec::new();
    if let Some(settings) = Settings::of(config, caller).filter(|s| s.limited(caller)) {
        settings.push_windows(&mut out, caller, now);
    }
    out
}

/// Whether any per-minute limit applies to `caller` (its tenant's, its agent's or its
/// key's): whether [`windows_for`] has any, without building them.
pub fn limited(config: &Config, caller: &Caller) -> bool {
    Settings::of(config, caller).is_some_and(|s| s.limited(caller))
}

/// A caller's settings, looked up once: its tenant's, and its agent's if declared.
struct Settings<'c> {
    tenant: (&'c TenantId, &'c Tenant),
    agent: Option<(&'c AgentId, &'c Agent)>,
}

impl<'c> Settings<'c> {
    fn of(config: &'c Config, caller: &Caller) -> Option<Settings<'c>> {
        let tenant = config.tenants.get_key_value(&caller.tenant)?;
        let agent = caller.agent.as_ref().and_then(|a| tenant.1.agents.get_key_value(a));
        Some(Settings { tenant, agent })
    }

    fn limited(&self, caller: &Caller) -> bool {
        !self.tenant.1.limits.is_none()
            || self.agent.is_some_and(|(_, a)| !a.limits.is_none())
            || !caller.key_limits.is_none()
    }

    fn budgets(&self, now: u64) -> Arc<[Budget]> {
        budgets_of(self.tenant, self.agent, now)
    }

    fn push_windows(&self, out: &mut Vec<Budget>, caller: &Caller, now: u64) {
        let (id, tenant) = self.tenant;
        let name = id.as_str();
        push_windows(out, name, None, &format!("tenant {name}"), tenant.limits, now);
        if let Some((agent, settings)) = self.agent {
            push_windows(out, name, Some(agent.as_str()), &format!("agent {name}/{agent}"), settings.limits, now);
        }
        if !caller.key_limits.is_none() {
            // Under the key alone, not the tenant: a relay peer's key asserts many
            // tenants, and its limit holds across them all.
            let label = key_label(&caller.key_sha256);
            push_windows(out, "~key", Some(&label), &format!("key {label}"), caller.key_limits, now);
        }
    }
}

/// A backend's provider quota (SPEC §14) as windows, counted under the tenant
/// `~backend`: empty when it has none.
pub fn quota_for(backend: &crate::config::Backend, now: u64) -> Vec<Budget> {
    let mut out = Vec::new();
    let name = format!("backend {}", backend.name);
    push_windows(&mut out, "~backend", Some(backend.name.as_str()), &name, backend.quota, now);
    out
}

/// The first 16 hex digits of a key's SHA-256: how a key is named in a window's
/// counter and in a refusal (a hash the config already shows, never the key).
pub fn key_label(sha256: &[u8; 32]) -> String {
    use std::fmt::Write as _;
    let mut label = String::with_capacity(16);
    for byte in &sha256[..8] {
        let _ = write!(label, "{byte:02x}");
    }
    label
}

fn push_windows(out: &mut Vec<Budget>, tenant: &str, holder: Option<&str>, name: &str, rates: Rates, now: u64) {
    let resets_at = Period::Minute.end(now);
    let kinds = [
        (Rate::Requests, Unit::Requests, rates.requests_per_minute),
        (Rate::Tokens, Unit::Tokens, rates.tokens_per_minute),
    ];
    for (rate, unit, limit) in kinds {
        let Some(limit) = limit else { continue };
        out.push(Budget {
            name: name.to_owned(),
            key: CounterKey::window(tenant, holder, unit, now),
            unit,
            limit: Some(limit),
            resets_at,
            kind: Kind::Window(rate),
        });
    }
}

/// A run's counters and each ancestor's: tokens and euros under their limits (counted
/// without one), and calls (counted, never refused): what a run spent is its own
/// calls' and its descendants'.
fn push_run(out: &mut Vec<Budget>, tenant: &str, run: &Run) {
    for link in run.chain() {
        let limits = [
            ("tokens", Unit::Tokens, link.budget.tokens),
            ("eur", Unit::MicroEur, link.budget.eur.map(|m| m.0)),
            ("calls", Unit::Requests, None),
        ];
        for (what, unit, limit) in limits {
            out.push(Budget {
                name: format!("run {} {what}", link.id),
                key: link.counter(tenant, unit),
                unit,
                limit,
                resets_at: link.expires_at,
                kind: Kind::Run,
            });
        }
    }
}

/// The tenant's three counters (always counted, limited where the config says), and
/// the agent's where the agent has budgets of its own.
///
/// The same for every call of one caller on one UTC day, so each thread builds them
/// once a day a caller and shares them after ([`Plans`]).
pub fn budgets_for(config: &Config, tenant: &TenantId, agent: Option<&str>, now: u64) -> Arc<[Budget]> {
    let Some(tenant) = config.tenants.get_key_value(tenant) else {
        return Arc::from([]);
    };
    budgets_of(tenant, agent.and_then(|name| tenant.1.agents.get_key_value(name)), now)
}

fn budgets_of(tenant: (&TenantId, &Tenant), agent: Option<(&AgentId, &Agent)>, now: u64) -> Arc<[Budget]> {
    let (tenant, t) = tenant;
    let agent = agent.filter(|(_, a)| a.budgets != Budgets::default()).map(|(name, a)| (name, &a.budgets));
    let scope = Scope { tenant, budgets: &t.budgets, agent };
    Plans::of(&scope, now / 86_400, || {
        let periods = Periods::at(now);
        let mut out = Vec::with_capacity(6);
        push_scope(&mut out, tenant.as_str(), None, &t.budgets, &periods);
        if let Some((name, budgets)) = agent {
            push_scope(&mut out, tenant.as_str(), Some(name.as_str()), budgets, &periods);
        }
        Arc::from(out)
    })
}

/// What a caller's budgets are made of: its names and limits (its day aside).
struct Scope<'c> {
    tenant: &'c TenantId,
    budgets: &'c Budgets,
    /// Its agent, when the agent has budgets of its own.
    agent: Option<(&'c AgentId, &'c Budgets)>,
}

/// A thread's budgets of the callers it served today, keyed by where the caller's
/// settings live in the config. An entry is used only while its scope is equal to the
/// caller's (a reloaded config may reuse an address for other settings), and all go
/// at midnight UTC; at most [`Plans::MOST`] are kept.
struct Plans {
    day: u64,
    scopes: foldhash::HashMap<(usize, usize), Kept>,
}

/// A [`Scope`] held, and its budgets.
struct Kept {
    tenant: TenantId,
    budgets: Budgets,
    agent: Option<(AgentId, Budgets)>,
    plan: Arc<[Budget]>,
}

impl Kept {
    fn is(&self, scope: &Scope<'_>) -> bool {
        self.tenant == *scope.tenant
            && self.budgets == *scope.budgets
            && self.agent.as_ref().map(|(n, b)| (n, b)) == scope.agent
    }
}

impl Plans {
    const MOST: usize = 4096;

    fn of(scope: &Scope<'_>, day: u64, build: impl FnOnce() -> Arc<[Budget]>) -> Arc<[Budget]> {
        thread_local! {
            static PLANS: RefCell<Plans> = RefCell::new(Plans { day: 0, scopes: Default::default() });
        }
        let at = (
            std::ptr::from_ref(scope.budgets) as usize,
            scope.agent.map_or(0, |(_, budgets)| std::ptr::from_ref(budgets) as usize),
        );
        PLANS.with_borrow_mut(|plans| {
            if plans.day != day || plans.scopes.len() >= Self::MOST {
                plans.day = day;
                plans.scopes.clear();
            }
            if let Some(kept) = plans.scopes.get(&at)
                && kept.is(scope)
            {
                return Arc::clone(&kept.plan);
            }
            let plan = build();
            let kept = Kept {
                tenant: scope.tenant.clone(),
                budgets: scope.budgets.clone(),
                agent: scope.agent.map(|(n, b)| (n.clone(), b.clone())),
                plan: Arc::clone(&plan),
            };
            plans.scopes.insert(at, kept);
            plan
        })
    }
}

/// Each period's stamp and end at one instant, computed once for every budget of a
/// caller.
struct Periods {
    day: (String, u64),
    month: (String, u64),
}

impl Periods {
    /// The periods at `now`: the same for every second of a UTC day (a Unix day is
    /// 86,400 seconds), so [`Plans`] keeps what is built of them for the day.
    fn at(now: u64) -> Periods {
        let of = |p: Period| (p.stamp(now), p.end(now));
        Periods { day: of(Period::Day), month: of(Period::Month) }
    }

    fn of(&self, period: Period) -> &(String, u64) {
        match period {
            // A budget is never per minute: windows are built apart (`push_windows`).
            Period::Day | Period::Minute => &self.day,
            Period::Month => &self.month,
        }
    }
}

fn push_scope(out: &mut Vec<Budget>, tenant: &str, agent: Option<&str>, budgets: &Budgets, periods: &Periods) {
    let who = match agent {
        Some(agent) => format!("agent {tenant}/{agent}"),
        None => format!("tenant {tenant}"),
    };
    let kinds = [
        ("tokens_per_day", Unit::Tokens, Period::Day, budgets.tokens_per_day),
        ("tokens_per_month", Unit::Tokens, Period::Month, budgets.tokens_per_month),
        ("eur_per_month", Unit::MicroEur, Period::Month, budgets.eur_per_month.map(|m| m.0)),
    ];
    for (kind, unit, period, limit) in kinds {
        let (stamp, end) = periods.of(period);
        out.push(Budget {
            name: [who.as_str(), " ", kind].concat(),
            key: CounterKey::stamped(tenant, agent, unit, period, stamp),
            unit,
            limit,
            resets_at: *end,
            kind: Kind::Period,
        });
    }
}

/// True when any limited budget (of a period: never a window or a run) has used
/// `threshold_ppm` of its limit or more.
pub fn is_soft(budgets: &[Budget], used: &[u64], threshold_ppm: u32) -> bool {
    budgets.iter().zip(used).any(|(b, used)| {
        b.is_period()
            && b.limit
                .is_some_and(|limit| u128::from(*used) * 1_000_000 >= u128::from(limit) * u128::from(threshold_ppm))
    })
}

/// Where a caller stands in its tightest window of each rate: what a client paces on
/// (`x-ratelimit-*`, SPEC §14).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pace {
    pub requests: Option<Gauge>,
    pub tokens: Option<Gauge>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gauge {
    pub limit: u64,
    /// Counting the call being answered.
    pub remaining: u64,
    /// Unix seconds when the window ends.
    pub resets_at: u64,
}

impl Pace {
    /// From the windows' counters `used` (in `budgets`' order): for each rate, the
    /// holder with the fewest remaining. `None` when no window applies.
    pub fn of<'b>(budgets: impl IntoIterator<Item = &'b Budget>, used: &[u64]) -> Option<Pace> {
        let mut pace = Pace::default();
        for (budget, used) in budgets.into_iter().zip(used) {
            let (Kind::Window(rate), Some(limit)) = (budget.kind, budget.limit) else { continue };
            let gauge = Gauge { limit, remaining: limit.saturating_sub(*used), resets_at: budget.resets_at };
            let slot = match rate {
                Rate::Requests => &mut pace.requests,
                Rate::Tokens => &mut pace.tokens,
            };
            if slot.is_none_or(|kept| gauge.remaining < kept.remaining) {
                *slot = Some(gauge);
            }
        }
        (pace != Pace::default()).then_some(pace)
    }
}

/// A call's reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub lines: Vec<Line>,
    /// The completion allowance of each choice: what is sent upstream as `max_tokens`.
    pub per_choice: u64,
    /// The completion allowance reserved: `per_choice` times the choices asked.
    pub completion_tokens: u64,
    pub clamped: bool,
}

/// What a call may complete: `per_choice` tokens for each of `choices` choices (`n`),
/// never clamped below `min_per_choice`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allowance {
    pub per_choice: u64,
    pub choices: u64,
    pub min_per_choice: u64,
}

impl Allowance {
    /// Nothing to complete (embeddings).
    pub const NONE: Allowance = Allowance { per_choice: 0, choices: 1, min_per_choice: 0 };
}

/// Plans the reservation of `prompt` tokens plus the completion `allowance` at
/// `price`. When a budget cannot hold the allowance but still holds the prompt and
/// the minimum per choice, the allowance of each choice is clamped to fit; otherwise
/// the index of the budget that refuses is returned.
pub fn plan(budgets: &[Budget], used: &[u64], prompt: u64, allowance: Allowance, price: Price) -> Result<Plan, usize> {
    let choices = allowance.choices.max(1);
    let mut per_choice = allowance.per_choice;
    for (index, (budget, used)) in budgets.iter().zip(used).enumerate() {
        let Some(limit) = budget.limit else { continue };
        // A window bounds the allowance by its limit: what it has left now is the
        // store's condition to check, and a refusal there is a wait, not a clamp.
        let window = matches!(budget.kind, Kind::Window(_));
        let used = if window { 0 } else { *used };
        // A prompt larger than a whole window could never pass it, whatever is sent
        // for the completion (an embeddings call has none to clamp).
        if window && budget.unit == Unit::Tokens && prompt > limit {
            return Err(index);
        }
        let remaining = limit.saturating_sub(used);
        let fits = fitting_completion(budget.unit, remaining, prompt, price) / choices;
        if fits < per_choice {
            if fits < allowance.min_per_choice.min(allowance.per_choice) {
                return Err(index);
            }
            per_choice = fits;
        }
    }
    let completion = per_choice.saturating_mul(choices);
    let usage = Usage::new(prompt, completion);
    let lines =
        budgets.iter().map(|b| Line { key: b.key.clone(), amount: b.amount(usage, price), limit: b.limit }).collect();
    Ok(Plan { lines, per_choice, completion_tokens: completion, clamped: per_choice < allowance.per_choice })
}

/// The most completion tokens that fit in `remaining` after the prompt.
fn fitting_completion(unit: Unit, remaining: u64, prompt: u64, price: Price) -> u64 {
    match unit {
        Unit::Requests => u64::MAX,
        Unit::Tokens => remaining.saturating_sub(prompt),
        Unit::MicroEur => {
            let prompt_cost = MicroEur::for_tokens(prompt, price.input_per_mtok).0;
            let Some(left) = remaining.checked_sub(prompt_cost) else {
                return 0;
            };
            if price.output_per_mtok.0 == 0 {
                return u64::MAX;
            }
            let tokens = u128::from(left) * 1_000_000 / u128::from(price.output_per_mtok.0);
            u64::try_from(tokens).unwrap_or(u64::MAX)
        }
    }
}

/// The counters' real amounts for a settled usage at the serving backend's price.
pub fn actual(budgets: &[Budget], usage: Usage, price: Price) -> Vec<(CounterKey, u64)> {
    budgets.iter().map(|b| (b.key.clone(), b.amount(usage, price))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(unit: Unit, limit: Option<u64>) -> Budget {
        Budget { name: "b".into(), key: CounterKey("k".into()), unit, limit, resets_at: 0, kind: Kind::Period }
    }

    fn allow(per_choice: u64) -> Allowance {
        Allowance { per_choice, choices: 1, min_per_choice: 16 }
    }

    const PRICE: Price = Price {
        input_per_mtok: MicroEur(2_000_000),
        output_per_mtok: MicroEur(8_000_000),
        cached_input_per_mtok: None,
        cache_write_per_mtok: None,
    };

    #[test]
    fn cache_reads_and_writes_cost_their_own_prices_defaulting_to_the_input_price() {
        let usage = Usage { cached_tokens: 600_000, cache_write_tokens: 200_000, ..Usage::new(1_000_000, 100_000) };
        // 200k plain at 2 €, 600k cached at 0.2 €, 200k written at 2.5 €, 100k out at 8 €.
        let price = Price {
            cached_input_per_mtok: Some(MicroEur(200_000)),
            cache_write_per_mtok: Some(MicroEur(2_500_000)),
            ..PRICE
        };
        assert_eq!(cost(usage, price), MicroEur(400_000 + 120_000 + 500_000 + 800_000));
        assert_eq!(cost(usage, PRICE), cost(Usage::new(1_000_000, 100_000), PRICE), "by default, the input price");
        let odd = Usage { cached_tokens: 9, cache_write_tokens: 9, ..Usage::new(10, 0) };
        assert_eq!(
            cost(odd, price),
            MicroEur::for_tokens(9, MicroEur(200_000)).saturating_add(MicroEur::for_tokens(1, MicroEur(2_500_000))),
            "within the prompt"
        );
    }

    #[test]
    fn a_scopes_budgets_are_named_and_keyed_by_their_period() {
        let now = 1_764_590_400; // 2025-12-01T12:00:00Z
        let budgets = Budgets { tokens_per_day: Some(10), eur_per_month: Some(MicroEur(5)), ..Budgets::default() };
        let periods = Periods::at(now);
        let mut out = Vec::new();
        push_scope(&mut out, "acme", Some("bot"), &budgets, &periods);
        let seen: Vec<(&str, &str, Option<u64>, u64)> =
            out.iter().map(|b| (b.name.as_str(), b.key.as_str(), b.limit, b.resets_at)).collect();
        assert_eq!(
            seen,
            [
                ("agent acme/bot tokens_per_day", "acme/bot/tokens/day/2025-12-01", Some(10), 1_764_633_600),
                ("agent acme/bot tokens_per_month", "acme/bot/tokens/month/2025-12", None, 1_767_225_600),
                ("agent acme/bot eur_per_month", "acme/bot/eur/month/2025-12", Some(5), 1_767_225_600),
            ]
        );
        assert_eq!(
            CounterKey::new("acme", None, Unit::Tokens, Period::Day, now).as_str(),
            "acme/*/tokens/day/2025-12-01"
        );
    }

    #[test]
    fn the_periods_kept_for_a_day_are_that_days_and_the_next_day_gets_its_own() {
        let midnight = 1_764_633_600; // 2025-12-02T00:00:00Z
        let stamps = |now| {
            let periods = Periods::at(now);
            (periods.day.0.clone(), periods.month.0.clone(), periods.day.1)
        };
        assert_eq!(stamps(midnight - 86_400), ("2025-12-01".into(), "2025-12".into(), midnight));
        assert_eq!(stamps(midnight - 1), ("2025-12-01".into(), "2025-12".into(), midnight));
        assert_eq!(stamps(midnight), ("2025-12-02".into(), "2025-12".into(), midnight + 86_400));
        // Back to an earlier day (a clock set back): that day's.
        assert_eq!(stamps(midnight - 1).0, "2025-12-01");
        assert_eq!(stamps(0), ("1970-01-01".into(), "1970-01".into(), 86_400));
        // What is kept is what each period computes, at a month's, a leap day's and a
        // year's last second and first, and past the last date there is.
        for now in [1_764_547_199, 1_764_547_200, 1_709_251_199, 1_709_251_200, 1_798_761_599, 1_798_761_600]
            .into_iter()
            .chain([i64::MAX as u64, i64::MAX as u64 + 1, u64::MAX])
        {
            let periods = Periods::at(now);
            for (period, (stamp, end)) in [(Period::Day, &periods.day), (Period::Month, &periods.month)] {
                assert_eq!((stamp.clone(), *end), (period.stamp(now), period.end(now)), "{period:?} at {now}");
            }
        }
    }

    fn limits(yaml_tenant: &str) -> Config {
        let yaml = format!(
            "version: 1\ntenants:\n  acme: {yaml_tenant}\nai:\n  default_backend: b\n  backends:\n    \
             b: {{url: 'http://b/v1'}}\n"
        );
        crate::config::load_str(&yaml, &std::collections::HashMap::<String, String>::new()).unwrap().config
    }

    #[test]
    fn a_callers_budgets_are_built_once_a_day_and_follow_its_limits() {
        let now = 1_764_590_400; // 2025-12-01T12:00:00Z
        let acme = TenantId::new("acme");
        let config = limits("{budgets: {tokens_per_day: 10}, agents: {bot: {budgets: {tokens_per_day: 5}}, idle: {}}}");
        let first = budgets_for(&config, &acme, Some("bot"), now);
        let keys: Vec<(&str, Option<u64>)> = first.iter().map(|b| (b.key.as_str(), b.limit)).collect();
        assert_eq!(keys[0], ("acme/*/tokens/day/2025-12-01", Some(10)));
        assert_eq!(keys[3], ("acme/bot/tokens/day/2025-12-01", Some(5)));
        assert_eq!(keys.len(), 6);
        assert!(Arc::ptr_eq(&first, &budgets_for(&config, &acme, Some("bot"), now + 3_600)), "shared all day");
        // An agent without budgets of its own, or unknown, counts on its tenant's alone.
        let tenant = budgets_for(&config, &acme, None, now);
        assert_eq!(&*tenant, &first[..3]);
        assert_eq!(&*budgets_for(&config, &acme, Some("idle"), now), &*tenant);
        assert_eq!(&*budgets_for(&config, &acme, Some("nobody"), now), &*tenant);
        assert!(budgets_for(&config, &TenantId::new("globex"), None, now).is_empty());
        // The next day, its own keys.
        let next = budgets_for(&config, &acme, Some("bot"), now + 86_400);
        assert_eq!(next[0].key.as_str(), "acme/*/tokens/day/2025-12-02");
        // Another config (a reload) is held to its own limits, whatever was kept.
        for limit in [20, 30] {
            let reloaded = limits(&format!("{{budgets: {{tokens_per_day: {limit}}}}}"));
            assert_eq!(budgets_for(&reloaded, &acme, None, now)[0].limit, Some(limit));
        }
        assert_eq!(budgets_for(&config, &acme, None, now)[0].limit, Some(10));
    }

    #[test]
    fn windows_are_built_only_for_the_holders_that_have_limits() {
        let now = 1_764_590_430; // 2025-12-01T12:00:30Z
        let config =
            limits("{limits: {requests_per_minute: 10}, agents: {bot: {limits: {tokens_per_minute: 500}}, idle: {}}}");
        let caller = |agent: Option<&str>, key_limits: Rates| Caller {
            tenant: TenantId::new("acme"),
            agent: agent.map(AgentId::new),
            key_sha256: [0xab; 32],
            relay_peer: false,
            key_limits,
        };
        let seen = |windows: Vec<Budget>| -> Vec<(String, String, Option<u64>, u64)> {
            windows.into_iter().map(|b| (b.name, b.key.as_str().to_owned(), b.limit, b.resets_at)).collect()
        };
        let key = Rates { requests_per_minute: Some(3), tokens_per_minute: None };
        assert_eq!(
            seen(windows_for(&config, &caller(Some("bot"), key), now)),
            [
                ("tenant acme".into(), "acme/*/requests/minute/2025-12-01T12:00".into(), Some(10), now + 30),
                ("agent acme/bot".into(), "acme/bot/tokens/minute/2025-12-01T12:00".into(), Some(500), now + 30),
                (
                    "key abababababababab".into(),
                    "~key/abababababababab/requests/minute/2025-12-01T12:00".into(),
                    Some(3),
                    now + 30
                ),
            ]
        );
        // A relay peer's key calls for many tenants: its window is the key's alone.
        let two = crate::config::load_str(
            "version: 1\ntenants: {acme: {}, globex: {}}\nai: {default_backend: b, backends: {b: {url: 'http://b/v1'}}}\n",
            &std::collections::HashMap::<String, String>::new(),
        )
        .unwrap()
        .config;
        let peer = |tenant: &str| Caller { tenant: TenantId::new(tenant), relay_peer: true, ..caller(None, key) };
        let (acme, globex) =
            (seen(windows_for(&two, &peer("acme"), now)), seen(windows_for(&two, &peer("globex"), now)));
        assert_eq!(acme, globex, "one window for the key, whichever tenant it calls for");
        assert_eq!(acme.len(), 1);
        assert_eq!(windows_for(&config, &caller(Some("idle"), Rates::default()), now).len(), 1);
        let free = limits("{budgets: {tokens_per_day: 10}}");
        assert!(windows_for(&free, &caller(None, Rates::default()), now).is_empty(), "no limit, no window");
        let plain = counters_for(&free, &caller(None, Rates::default()), None, now);
        assert!(Arc::ptr_eq(&plain, &budgets_for(&free, &TenantId::new("acme"), None, now)), "shared as it is");
    }

    #[test]
    fn a_window_clamps_the_allowance_to_its_limit_never_to_what_remains() {
        let window = Budget { kind: Kind::Window(Rate::Tokens), ..budget(Unit::Tokens, Some(100)) };
        // 90 of 100 used: the store's condition will refuse, the plan does not clamp.
        let planned = plan(std::slice::from_ref(&window), &[90], 20, allow(400), PRICE).unwrap();
        assert_eq!(planned.per_choice, 80, "clamped to the window's 100, not to its 10 left");
        assert_eq!(plan(std::slice::from_ref(&window), &[0], 90, allow(400), PRICE), Err(0), "90 + 16 never fit 100");
        // Nothing to complete (embeddings): the prompt alone decides.
        assert_eq!(plan(std::slice::from_ref(&window), &[0], 101, Allowance::NONE, PRICE), Err(0));
        assert!(plan(&[window], &[99], 100, Allowance::NONE, PRICE).is_ok(), "the store decides what remains");
    }

    #[test]
    fn the_pace_is_the_tightest_holder_of_each_rate() {
        let window = |rate, limit| Budget {
            kind: Kind::Window(rate),
            resets_at: 60,
            ..budget(if rate == Rate::Tokens { Unit::Tokens } else { Unit::Requests }, Some(limit))
        };
        let budgets = [
            budget(Unit::Tokens, Some(5)),
            window(Rate::Requests, 10),
            window(Rate::Requests, 4),
            window(Rate::Tokens, 900),
        ];
        let pace = Pace::of(&budgets, &[5, 2, 3, 100]).unwrap();
        assert_eq!(pace.requests, Some(Gauge { limit: 4, remaining: 1, resets_at: 60 }), "1 left of 4 beats 8 of 10");
        assert_eq!(pace.tokens, Some(Gauge { limit: 900, remaining: 800, resets_at: 60 }));
        assert_eq!(Pace::of(&budgets[..1], &[0]), None, "a budget is no window");
    }

    #[test]
    fn windows_and_runs_expire_budgets_never() {
        let now = 1_764_590_430;
        assert_eq!(CounterKey::window("acme", None, Unit::Requests, now).expiry(), Some(now + 30));
        assert_eq!(CounterKey::run("acme", "run_1", Unit::Tokens, now).expiry(), Some(now));
        assert_eq!(
            CounterKey::run("acme", "run_1", Unit::Tokens, now).as_str(),
            "acme/~run_1/tokens/run/2025-12-01T12:00:30Z"
        );
        assert_eq!(CounterKey::new("acme", None, Unit::Tokens, Period::Day, now).expiry(), None);
    }

    #[test]
    fn prompt_bound_never_undercounts_bytes() {
        assert_eq!(prompt_upper_bound(100, 2, 1), 100 + 8 + 3 + 2048);
    }

    #[test]
    fn reserves_prompt_plus_allowance_in_tokens_and_euros() {
        let budgets = [budget(Unit::Tokens, Some(10_000)), budget(Unit::MicroEur, None)];
        let plan = plan(&budgets, &[0, 0], 100, allow(400), PRICE).unwrap();
        assert_eq!(plan.lines[0].amount, 500);
        // 100 × 2 µ€ + 400 × 8 µ€
        assert_eq!(plan.lines[1].amount, 200 + 3200);
        assert!(!plan.clamped);
    }

    #[test]
    fn clamps_the_allowance_to_what_remains() {
        let budgets = [budget(Unit::Tokens, Some(1000))];
        let plan = plan(&budgets, &[700], 100, allow(4096), PRICE).unwrap();
        assert_eq!(plan.completion_tokens, 200);
        assert!(plan.clamped);
        assert_eq!(plan.lines[0].amount, 300);
    }

    #[test]
    fn clamps_on_euros_too() {
        // 1000 µ€ left; prompt 100 tokens cost 200 µ€; 800 µ€ buy 100 output tokens.
        let budgets = [budget(Unit::MicroEur, Some(5000))];
        let plan = plan(&budgets, &[4000], 100, allow(4096), PRICE).unwrap();
        assert_eq!(plan.completion_tokens, 100);
        assert_eq!(plan.lines[0].amount, 1000);
    }

    #[test]
    fn refuses_when_not_even_the_minimum_completion_fits() {
        let budgets = [budget(Unit::Tokens, None), budget(Unit::Tokens, Some(1000))];
        assert_eq!(plan(&budgets, &[0, 890], 100, allow(4096), PRICE), Err(1));
        assert!(plan(&budgets, &[0, 884], 100, allow(4096), PRICE).is_ok());
    }

    #[test]
    fn n_choices_multiply_the_allowance_and_clamp_per_choice() {
        let budgets = [budget(Unit::Tokens, Some(10_000))];
        let four = Allowance { per_choice: 100, choices: 4, min_per_choice: 16 };
        let plan = plan(&budgets, &[0], 50, four, PRICE).unwrap();
        assert_eq!((plan.per_choice, plan.completion_tokens), (100, 400));
        assert_eq!(plan.lines[0].amount, 450);
        // 250 left after the prompt: 62 a choice, 248 reserved, never more than remains.
        let plan = super::plan(&budgets, &[9_700], 50, four, PRICE).unwrap();
        assert_eq!((plan.per_choice, plan.completion_tokens, plan.clamped), (62, 248, true));
        assert!(plan.lines[0].amount <= 300);
        // 60 left: 15 a choice is under the minimum of 16.
        assert_eq!(super::plan(&budgets, &[9_890], 50, four, PRICE), Err(0));
    }

    #[test]
    fn soft_at_the_threshold_of_any_budget() {
        let budgets = [budget(Unit::Tokens, Some(1000)), budget(Unit::Tokens, None)];
        assert!(!is_soft(&budgets, &[799, 1_000_000], 800_000));
        assert!(is_soft(&budgets, &[800, 0], 800_000));
    }

    #[test]
    fn highest_price_takes_each_side_separately() {
        let a = Price {
            input_per_mtok: MicroEur(3),
            output_per_mtok: MicroEur(1),
            cached_input_per_mtok: None,
            cache_write_per_mtok: None,
        };
        let b = Price {
            input_per_mtok: MicroEur(1),
            output_per_mtok: MicroEur(5),
            cached_input_per_mtok: None,
            cache_write_per_mtok: None,
        };
        assert_eq!(
            highest_price([a, b]),
            Price {
                input_per_mtok: MicroEur(3),
                output_per_mtok: MicroEur(5),
                cached_input_per_mtok: None,
                cache_write_per_mtok: None
            }
        );
        // A backend whose cache writes cost more than its input: a prompt is reserved
        // at the write price, so settlement never charges more than was reserved.
        let writes = Price { cached_input_per_mtok: Some(MicroEur(1)), cache_write_per_mtok: Some(MicroEur(4)), ..a };
        assert_eq!(highest_price([writes, b]).input_per_mtok, MicroEur(4));
        let usage = Usage { cache_write_tokens: 1_000_000, ..Usage::new(1_000_000, 0) };
        assert!(cost(usage, writes) <= cost(Usage::new(1_000_000, 0), highest_price([writes, b])));
    }
}
