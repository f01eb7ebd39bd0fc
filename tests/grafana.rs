//! The Grafana dashboard the repository ships (`infra/grafana/flexway.json`) loads, and
//! every metric its queries name is one the gateway exports: read from a real
//! gateway's `/metrics` after a call through a pool that picks by load.
#![cfg(test)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;

use flexway_testkit::*;
use serde_json::Value;

fn dashboard() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/infra/grafana/flexway.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).expect("the dashboard is JSON")
}

/// The `flexway_*` metric names a PromQL expression reads, a histogram's series
/// (`_bucket`, `_sum`, `_count`) named by their family.
fn metrics_in(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = expr;
    while let Some(at) = rest.find("flexway_") {
        let name: String =
            rest[at..].chars().take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_').collect();
        rest = &rest[at + name.len()..];
        let family = ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).unwrap_or(&name);
        names.insert(family.to_owned());
    }
    names
}

#[test]
fn the_dashboard_is_an_importable_grafana_dashboard() {
    let dashboard = dashboard();
    assert_eq!(dashboard["uid"], "flexway");
    assert_eq!(dashboard["__inputs"][0]["pluginId"], "prometheus", "imported with the operator's Prometheus");
    let panels = dashboard["panels"].as_array().unwrap();
    let mut ids = BTreeSet::new();
    for panel in panels {
        assert!(ids.insert(panel["id"].as_u64().unwrap()), "panel ids are unique");
        assert!(panel["gridPos"]["w"].as_u64().unwrap() > 0, "{panel}");
        assert_eq!(panel["datasource"]["uid"], "${DS_PROMETHEUS}");
        let targets = panel["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{}", panel["title"]);
        for target in targets {
            assert!(!metrics_in(target["expr"].as_str().unwrap()).is_empty(), "{target}");
        }
    }
}

#[tokio::test]
async fn every_metric_the_dashboard_reads_is_one_the_gateway_exports() {
    let queried: BTreeSet<String> = dashboard()["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().clone())
        .flat_map(|t| metrics_in(t["expr"].as_str().unwrap()))
        .collect();
    // The console's panels: spend, calls, errors, breakers, the members' load, what
    // the response cache saved and holds, the calls per-minute limits refused, the
    // providers' quotas used.
    for wanted in [
        "flexway_inference_cost_eur_total",
        "flexway_inference_calls_total",
        "flexway_inference_errors_total",
        "flexway_breaker_state",
        "flexway_member_queue",
        "flexway_budget_remaining",
        "flexway_cache_lookups_total",
        "flexway_cache_saved_eur_total",
        "flexway_cache_entries",
        "flexway_rate_limited_total",
        "flexway_backend_quota_used_ratio",
    ] {
        assert!(queried.contains(wanted), "the dashboard shows {wanted}");
    }

    let model = FakeModel::start().await.unwrap();
    let ai = format!(
        "  default_backend: pool\n  backends:\n    pool:\n      kind: pool\n      pick: least_loaded\n      \
         saturation: {{queue: 4}}\n      members: [{{backend: main}}]\n    main:\n      url: \"{}\"\n      \
         load: {{metrics_url: \"{}\", every: 100ms}}\n      price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 1}}\n",
        model.url(),
        model.metrics_url()
    );
    let gw = Flexway::start(&acme_config("{tokens_per_day: 100}", &ai));
    assert_eq!(gw.chat(KEY, hello("m")).await.status(), 200);
    // Up to the cap: admission reads the ledger, and says what is left.
    let mut refused = false;
    for _ in 0..20 {
        refused = gw.chat(KEY, hello("m")).await.status() == 429;
        if refused {
            break;
        }
    }
    assert!(refused, "the cap is reached");
    let text = client().get(format!("{}/metrics", gw.url)).send().await.unwrap().text().await.unwrap();
    let exported: BTreeSet<&str> =
        text.lines().filter_map(|line| line.strip_prefix("# TYPE ")).filter_map(|l| l.split(' ').next()).collect();
    for metric in &queried {
        assert!(exported.contains(metric.as_str()), "{metric} is not exported:\n{text}");
    }
}
