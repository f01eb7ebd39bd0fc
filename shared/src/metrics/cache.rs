//! The response cache's metrics (SPEC §16 "What it tells"): lookups by outcome, answers
//! stored, store failures, the euros hits saved, and each tenant's entries. Labels are
//! config names (tenant, policy) and fixed words (outcome, operation), never a prompt,
//! a model string or a request id; the money is integer micro-euros, turned into
//! euros only when rendered.

use std::sync::atomic::Ordering;

use super::{Registry, label};
use crate::money::MicroEur;

/// The `outcome` values of `flexway_cache_lookups_total`: served from the cache, not
/// found, not looked up (`Cache-Control: no-cache`, a sensitive call under `sensitive:
/// bypass`), `cache: off` for the tenant or agent, and a store that failed (counted
/// and served as a miss).
pub const CACHE_OUTCOMES: [&str; 5] = ["hit", "miss", "bypass", "off", "error"];

/// The `operation` values of `flexway_cache_store_failures_total`: reading an entry,
/// writing one, and the semantic policy's embedding call.
pub const CACHE_FAILED_OPERATIONS: [&str; 3] = ["lookup", "store", "embed"];

/// One tenant's cache figures as this process counted them since it started (the
/// entries as last counted), as the console shows them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheTotals {
    pub tenant: String,
    /// Calls served from the cache.
    pub hits: u64,
    /// Calls looked up and not served: `miss`, and `error` (a failing store).
    pub misses: u64,
    /// Calls that did not look: `bypass` and `off`.
    pub skipped: u64,
    pub stores: u64,
    /// What the hits did not spend upstream.
    pub saved: MicroEur,
    /// `None` until the tenant's entries are counted.
    pub entries: Option<u64>,
}

impl Registry {
    /// A call's response cache lookup under `policy`, by `outcome`: one of
    /// [`CACHE_OUTCOMES`]. A failing store is `error` here and, with its operation,
    /// [`Registry::cache_store_failed`].
    pub fn cache_lookup(&self, tenant: &str, policy: &str, outcome: &'static str) {
        let labels = [label(Some(tenant)), label(Some(policy)), label(Some(outcome))];
        self.cache_lookups.with(&labels, u64::default, |n| *n = n.saturating_add(1));
    }

    /// A complete answer stored in the response cache under `policy`.
    pub fn cache_stored(&self, tenant: &str, policy: &str) {
        let labels = [label(Some(tenant)), label(Some(policy))];
        self.cache_stores.with(&labels, u64::default, |n| *n = n.saturating_add(1));
    }

    /// The cache store failed at `operation`: one of [`CACHE_FAILED_OPERATIONS`].
    pub fn cache_store_failed(&self, operation: &'static str) {
        self.cache_store_failures.with(&[label(Some(operation))], u64::default, |n| *n = n.saturating_add(1));
    }

    /// A hit saved `saved`: its audit record's `cost_saved_micro_eur`, the cost of the
    /// call that produced the entry it was served (SPEC §16).
    pub fn cache_saved(&self, tenant: &str, saved: MicroEur) {
        self.cache_saved.with(&[label(Some(tenant))], u64::default, |n| *n = n.saturating_add(saved.0));
    }

    /// The tenant's live entries, as counted now (set, not added).
    pub fn cache_entries(&self, tenant: &str, entries: u64) {
        self.cache_entries.with(&[label(Some(tenant))], u64::default, |n| *n = entries);
    }

    /// Whether the entries are due to be counted at `now` (Unix seconds): never counted,
    /// or counted `every` seconds ago or more. A `true` claims the count: callers at
    /// the same instant get `false`.
    pub fn cache_entries_due(&self, now: u64, every: u64) -> bool {
        let last = self.cache_counted_at.load(Ordering::Relaxed);
        let due = last == 0 || now >= last.saturating_add(every);
        due && self.cache_counted_at.compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed).is_ok()
    }

    /// Every tenant with a cache figure, by name.
    pub fn cache_totals(&self) -> Vec<CacheTotals> {
        let mut totals: Vec<CacheTotals> = Vec::new();
        let mut at = |tenant: &str| -> usize {
            match totals.iter().position(|t| t.tenant == tenant) {
                Some(index) => index,
                None => {
                    totals.push(CacheTotals { tenant: tenant.to_owned(), ..CacheTotals::default() });
                    totals.len() - 1
                }
            }
        };
        let mut figures: Vec<(usize, Figure)> = Vec::new();
        for (values, n) in self.cache_lookups.snapshot(|n| *n) {
            let outcome: fn(u64) -> Figure = match values.get(2).map(String::as_str) {
                Some("hit") => Figure::Hits,
                Some("bypass" | "off") => Figure::Skipped,
                _ => Figure::Misses,
            };
            figures.push((at(tenant(&values)), outcome(n)));
        }
        for (values, n) in self.cache_stores.snapshot(|n| *n) {
            figures.push((at(tenant(&values)), Figure::Stores(n)));
        }
        for (values, n) in self.cache_saved.snapshot(|n| *n) {
            figures.push((at(tenant(&values)), Figure::Saved(n)));
        }
        for (values, n) in self.cache_entries.snapshot(|n| *n) {
            figures.push((at(tenant(&values)), Figure::Entries(n)));
        }
        for (index, figure) in figures {
            let total = &mut totals[index];
            match figure {
                Figure::Hits(n) => total.hits = total.hits.saturating_add(n),
                Figure::Misses(n) => total.misses = total.misses.saturating_add(n),
                Figure::Skipped(n) => total.skipped = total.skipped.saturating_add(n),
                Figure::Stores(n) => total.stores = total.stores.saturating_add(n),
                Figure::Saved(n) => total.saved = total.saved.saturating_add(MicroEur(n)),
                Figure::Entries(n) => total.entries = Some(n),
            }
        }
        totals.sort_by(|a, b| a.tenant.cmp(&b.tenant));
        totals
    }
}

fn tenant(values: &[String]) -> &str {
    values.first().map_or(super::NONE, String::as_str)
}

enum Figure {
    Hits(u64),
    Misses(u64),
    Skipped(u64),
    Stores(u64),
    Saved(u64),
    Entries(u64),
}

#[cfg(test)]
mod tests {
    use super::super::tests::lines;
    use super::*;

    #[test]
    fn lookups_are_counted_by_tenant_policy_and_outcome() {
        let registry = Registry::new();
        for outcome in ["hit", "hit", "miss", "error", "bypass"] {
            registry.cache_lookup("acme", "faq", outcome);
        }
        registry.cache_lookup("acme", "docs", "off");
        registry.cache_lookup("globex", "faq", "miss");
        let text = registry.render_prometheus();
        assert_eq!(
            lines(&text, "flexway_cache_lookups_total{"),
            vec![
                r#"flexway_cache_lookups_total{tenant="acme",policy="docs",outcome="off"} 1"#,
                r#"flexway_cache_lookups_total{tenant="acme",policy="faq",outcome="bypass"} 1"#,
                r#"flexway_cache_lookups_total{tenant="acme",policy="faq",outcome="error"} 1"#,
                r#"flexway_cache_lookups_total{tenant="acme",policy="faq",outcome="hit"} 2"#,
                r#"flexway_cache_lookups_total{tenant="acme",policy="faq",outcome="miss"} 1"#,
                r#"flexway_cache_lookups_total{tenant="globex",policy="faq",outcome="miss"} 1"#,
            ]
        );
        assert!(text.contains("# TYPE flexway_cache_lookups_total counter\n"));
        let help = lines(&text, "# HELP flexway_cache_lookups_total ");
        assert_eq!(help.len(), 1);
        for outcome in CACHE_OUTCOMES {
            assert!(help[0].contains(&format!("{outcome} (")), "the HELP text documents {outcome}: {}", help[0]);
        }
    }

    #[test]
    fn stores_failures_savings_and_entries_render_as_their_kinds() {
        let registry = Registry::new();
        registry.cache_stored("acme", "faq");
        registry.cache_stored("acme", "faq");
        registry.cache_store_failed("lookup");
        registry.cache_store_failed("embed");
        registry.cache_store_failed("embed");
        // Integer micro-euros accumulate exactly: 0.1 + 0.2 is 0.3 here.
        registry.cache_saved("acme", MicroEur(100_000));
        registry.cache_saved("acme", MicroEur(200_000));
        registry.cache_saved("globex", MicroEur(7));
        registry.cache_entries("acme", 40);
        registry.cache_entries("acme", 38);
        let text = registry.render_prometheus();
        assert_eq!(
            lines(&text, "flexway_cache_stores_total{"),
            vec![r#"flexway_cache_stores_total{tenant="acme",policy="faq"} 2"#]
        );
        assert_eq!(
            lines(&text, "flexway_cache_store_failures_total{"),
            vec![
                r#"flexway_cache_store_failures_total{operation="embed"} 2"#,
                r#"flexway_cache_store_failures_total{operation="lookup"} 1"#,
            ]
        );
        assert_eq!(
            lines(&text, "flexway_cache_saved_eur_total{"),
            vec![
                r#"flexway_cache_saved_eur_total{tenant="acme"} 0.300000"#,
                r#"flexway_cache_saved_eur_total{tenant="globex"} 0.000007"#,
            ]
        );
        assert_eq!(lines(&text, "flexway_cache_entries{"), vec![r#"flexway_cache_entries{tenant="acme"} 38"#]);
        for (name, kind) in [
            ("flexway_cache_stores_total", "counter"),
            ("flexway_cache_store_failures_total", "counter"),
            ("flexway_cache_saved_eur_total", "counter"),
            ("flexway_cache_entries", "gauge"),
        ] {
            assert!(text.contains(&format!("# TYPE {name} {kind}\n")), "{name}");
        }
    }

    #[test]
    fn the_families_are_declared_before_any_call() {
        let text = Registry::new().render_prometheus();
        for name in [
            "flexway_cache_lookups_total",
            "flexway_cache_stores_total",
            "flexway_cache_store_failures_total",
            "flexway_cache_saved_eur_total",
            "flexway_cache_entries",
        ] {
            assert_eq!(lines(&text, &format!("# TYPE {name} ")).len(), 1, "{name}");
            assert!(lines(&text, name).is_empty(), "{name} has no series yet");
        }
    }

    #[test]
    fn totals_per_tenant_for_the_console() {
        let registry = Registry::new();
        assert_eq!(registry.cache_totals(), []);
        for outcome in ["hit", "hit", "hit", "miss", "error", "bypass", "off"] {
            registry.cache_lookup("acme", "faq", outcome);
        }
        registry.cache_lookup("acme", "docs", "hit");
        registry.cache_stored("acme", "faq");
        registry.cache_saved("acme", MicroEur(1_250));
        registry.cache_saved("acme", MicroEur(750));
        registry.cache_entries("acme", 12);
        registry.cache_entries("globex", 3);
        registry.cache_store_failed("store");
        let acme = CacheTotals {
            tenant: "acme".into(),
            hits: 4,
            misses: 2,
            skipped: 2,
            stores: 1,
            saved: MicroEur(2_000),
            entries: Some(12),
        };
        let globex = CacheTotals { tenant: "globex".into(), entries: Some(3), ..CacheTotals::default() };
        assert_eq!(registry.cache_totals(), [acme, globex]);
    }

    #[test]
    fn entries_are_due_once_then_every_period() {
        let registry = Registry::new();
        assert!(registry.cache_entries_due(1_000, 60), "never counted");
        assert!(!registry.cache_entries_due(1_000, 60), "claimed");
        assert!(!registry.cache_entries_due(1_059, 60));
        assert!(registry.cache_entries_due(1_060, 60));
        assert!(!registry.cache_entries_due(1_061, 60));
    }

    #[test]
    fn an_empty_name_is_labelled_none() {
        let registry = Registry::new();
        registry.cache_lookup("", "", "miss");
        let text = registry.render_prometheus();
        let none = r#"flexway_cache_lookups_total{tenant="none",policy="none",outcome="miss"} 1"#;
        assert_eq!(lines(&text, "flexway_cache_lookups_total{"), vec![none]);
    }
}
