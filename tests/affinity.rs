//! Session affinity for HTTP calls (`ai.affinity`, SPEC §2.3), end to end: the real
//! binary in front of a pool of three fake backends.
#![cfg(test)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};

use flexway_testkit::*;

/// A pool of `members` (name, url), equal weights, one priority; `affinity` is the
/// `ai.affinity` line or nothing.
fn pool_config(members: &[(&str, String)], affinity: &str) -> String {
    let mut ai =
        format!("  default_backend: pool\n{affinity}  backends:\n    pool:\n      kind: pool\n      members:\n");
    for (name, _) in members {
        ai.push_str(&format!("        - {{backend: {name}}}\n"));
    }
    for (name, url) in members {
        ai.push_str(&format!(
            "    {name}:\n      url: \"{url}\"\n      price: {{input_per_mtok_eur: 1.0, output_per_mtok_eur: 1.0}}\n"
        ));
    }
    config(&ai)
}

const AFFINITY: &str = "  affinity: {header: Flexway-Session}\n";

/// Which member served each of `calls` calls of session `session` (none: no header).
async fn served(gw: &Flexway, session: Option<&str>, calls: usize) -> Vec<String> {
    let mut backends = Vec::new();
    for _ in 0..calls {
        let mut request = gw.post("/v1/chat/completions", KEY, hello("m"));
        if let Some(session) = session {
            request = request.header("Flexway-Session", session);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 200);
        backends.push(response.headers()["flexway-backend"].to_str().unwrap().to_owned());
    }
    backends
}

#[tokio::test]
async fn a_session_sticks_to_one_member_and_sessions_spread_over_the_pool() {
    let fakes =
        [FakeModel::start().await.unwrap(), FakeModel::start().await.unwrap(), FakeModel::start().await.unwrap()];
    let members = [("a", fakes[0].url()), ("b", fakes[1].url()), ("c", fakes[2].url())];
    let gw = Flexway::start(&pool_config(&members, AFFINITY));
    let mut per_member: BTreeMap<String, usize> = BTreeMap::new();
    for n in 0..30 {
        let served = served(&gw, Some(&format!("session-{n}")), 4).await;
        let distinct: BTreeSet<&String> = served.iter().collect();
        assert_eq!(distinct.len(), 1, "session-{n} moved: {served:?}");
        *per_member.entry(served[0].clone()).or_default() += 1;
    }
    assert_eq!(per_member.len(), 3, "30 sessions spread over the three members: {per_member:?}");
    assert!(per_member.values().all(|n| *n >= 3), "{per_member:?}");

    // Calls without the header are spread as usual.
    let unpinned: BTreeSet<String> = served(&gw, None, 30).await.into_iter().collect();
    assert!(unpinned.len() > 1, "{unpinned:?}");
}

#[tokio::test]
async fn a_session_whose_member_is_down_falls_back_and_stays_on_its_next_member() {
    let fakes =
        [FakeModel::start().await.unwrap(), FakeModel::start().await.unwrap(), FakeModel::start().await.unwrap()];
    let down = fakes[0].scenario_url(&Scenario { status: Some(503), ..Default::default() });
    let members = [("a", down), ("b", fakes[1].url()), ("c", fakes[2].url())];
    let gw = Flexway::start(&pool_config(&members, AFFINITY));
    for n in 0..30 {
        let served = served(&gw, Some(&format!("session-{n}")), 3).await;
        let distinct: BTreeSet<&String> = served.iter().collect();
        assert_eq!(distinct.len(), 1, "session-{n} moved between healthy members: {served:?}");
        assert_ne!(served[0], "a", "the member that is down never serves");
    }
    assert!(fakes[0].request_count() > 0, "some sessions had the failing member first and fell back");
}

#[tokio::test]
async fn without_ai_affinity_the_session_header_changes_nothing() {
    let fakes =
        [FakeModel::start().await.unwrap(), FakeModel::start().await.unwrap(), FakeModel::start().await.unwrap()];
    let members = [("a", fakes[0].url()), ("b", fakes[1].url()), ("c", fakes[2].url())];
    let gw = Flexway::start(&pool_config(&members, ""));
    let served: BTreeSet<String> = served(&gw, Some("session-1"), 30).await.into_iter().collect();
    assert!(served.len() > 1, "off by default: {served:?}");
}

#[test]
fn the_affinity_key_is_checked_at_load() {
    let env: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    let members = [("a", "http://127.0.0.1:1/v1".to_owned())];
    for (affinity, expected) in [
        ("  affinity: {}\n", "ai.affinity.header"),
        ("  affinity: {header: \"bad header\"}\n", "ai.affinity.header"),
        ("  affinity: {header: Flexway-Session, hash: ring}\n", "hash"),
    ] {
        let error = flexway::config::load_str(&pool_config(&members, affinity), &env).map(|_| ()).unwrap_err();
        assert!(error.to_string().contains(expected), "{affinity}: {error}");
    }
    flexway::config::load_str(&pool_config(&members, AFFINITY), &env).unwrap();
}
