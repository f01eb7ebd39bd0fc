//! The operator's console (SPEC §9), end to end: the real binary, and real headless
//! browsers signing in and reading the page: Chromium over WebDriver (Debian's
//! `chromium` and `chromium-driver`) and Firefox over Marionette (`firefox-esr`),
//! which the test command installs.
#![cfg(test)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use flexway_testkit::browser::{Browser, Firefox};
use flexway_testkit::*;
use serde_json::Value;

const CONSOLE_KEY: &str = "sk-console-operator";

/// Tenants `acme` (KEY; 100,000 tokens a day, 5 € a month) and `globex` (OTHER_KEY),
/// served by `main` at `url`, and a console unless `console` is false.
fn console_config(url: &str, console: bool) -> String {
    let console =
        if console { format!("console:\n  keys:\n    - sha256: {}\n", sha(CONSOLE_KEY)) } else { String::new() };
    format!(
        "version: 1\nstore: {{kind: memory}}\naudit: {{sink: stdout}}\n{console}tenants:\n  acme:\n    keys:\n      \
         - sha256: {}\n    budgets: {{tokens_per_day: 100000, eur_per_month: 5}}\n  globex:\n    keys:\n      \
         - sha256: {}\nai:\n  default_backend: main\n  backends:\n    main:\n      url: \"{url}\"\n      \
         price: {{input_per_mtok_eur: 1000, output_per_mtok_eur: 2000}}\n",
        sha(KEY),
        sha(OTHER_KEY)
    )
}

#[tokio::test]
async fn the_console_is_not_found_unless_configured() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&console_config(&model.url(), false));
    for (method, path) in [("GET", "/console"), ("GET", "/console/data.json"), ("POST", "/console/session")] {
        let request = client().request(method.parse().unwrap(), format!("{}{path}", gw.url));
        let response = request.bearer_auth(CONSOLE_KEY).send().await.unwrap();
        assert_eq!(response.status(), 404, "{method} {path}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"]["code"], "not_found");
    }
}

#[tokio::test]
async fn a_script_reads_it_with_a_console_key_never_a_tenant_s() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&console_config(&model.url(), true));
    let data = |key: &str| client().get(format!("{}/console/data.json", gw.url)).bearer_auth(key).send();
    let refused = data(KEY).await.unwrap();
    assert_eq!(refused.status(), 401);
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_api_key");
    let unsigned = client().get(format!("{}/console/data.json", gw.url)).send().await.unwrap();
    assert_eq!(unsigned.status(), 401);

    assert_eq!(gw.chat(KEY, hello("m")).await.status(), 200);
    let overview: Value = data(CONSOLE_KEY).await.unwrap().json().await.unwrap();
    let acme = overview["scopes"].as_array().unwrap().iter().find(|s| s["tenant"] == "acme").unwrap();
    let eur = acme["budgets"].as_array().unwrap().iter().find(|b| b["budget"] == "eur_per_month").unwrap();
    assert!(eur["used"].as_u64().unwrap() > 0);
    assert_eq!(eur["limit"], 5_000_000);
    let main = overview["backends"].as_array().unwrap().iter().find(|b| b["backend"] == "main").unwrap();
    assert_eq!((main["calls"].as_u64(), main["breaker"].as_str()), (Some(1), Some("closed")));
    assert_eq!(overview["calls_per_minute"].as_array().unwrap().len(), 60);
    assert_eq!(overview["calls_per_minute"][59], 1, "this minute's call");
}

#[tokio::test]
async fn a_browser_signs_in_and_reads_the_spend_the_ledger_holds() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&console_config(&model.url(), true));
    for _ in 0..3 {
        assert_eq!(gw.chat(KEY, hello("m")).await.status(), 200);
    }
    assert_eq!(gw.chat(OTHER_KEY, hello("m")).await.status(), 200);
    // What the audit (and `flexway report`) says acme spent.
    let records = gw.records_until::<Value>(4).await;
    let acme: Vec<&Value> = records.iter().filter(|r| r["tenant"] == "acme").collect();
    let cost: u64 = acme.iter().map(|r| r["cost_micro_eur"].as_u64().unwrap()).sum();
    let tokens: u64 =
        acme.iter().map(|r| r["prompt_tokens"].as_u64().unwrap() + r["completion_tokens"].as_u64().unwrap()).sum();
    assert!(cost > 0 && tokens > 0);

    let browser = Browser::start().await;
    browser.go(&format!("{}/console", gw.url)).await;
    assert!(browser.source().await.contains("Sign in"), "the sign-in form first");

    // A tenant's key does not open it.
    browser.type_into("#key", KEY).await;
    browser.click("#sign-in").await;
    let refused = browser.source_with("does not open the console").await;
    assert!(refused.contains("does not open the console") && !refused.contains("id=\"tenants\""), "{refused}");

    browser.type_into("#key", CONSOLE_KEY).await;
    browser.click("#sign-in").await;
    let page = browser.source_with("id=\"backends\"").await;
    assert!(page.contains("id=\"tenants\"") && page.contains("id=\"backends\""), "{page}");
    let used = |budget: &str| {
        let row = format!("data-tenant=\"acme\" data-agent=\"\" data-budget=\"{budget}\" data-used=\"");
        let at = page.find(&row).unwrap_or_else(|| panic!("no {budget} row for acme: {page}")) + row.len();
        page[at..].split('"').next().unwrap().parse::<u64>().unwrap()
    };
    assert_eq!(used("eur_per_month"), cost, "the month's spend is the ledger's, the audit's sum");
    assert_eq!(used("tokens_per_day"), tokens);
    assert!(page.contains("data-tenant=\"globex\""));
    assert!(page.contains("data-backend=\"main\" data-calls=\"4\""), "{page}");
    assert!(!page.contains(KEY) && !page.contains(CONSOLE_KEY) && !page.contains("hello there"), "no key, no prompt");
    // Nothing from another origin: no script at all, no remote style or image.
    assert!(!page.contains("<script") && !page.contains("src=\"http") && !page.contains("href=\"http"), "{page}");

    let cookies = browser.cookies().await;
    let session = cookies.iter().find(|c| c["name"] == "flexway_console").expect("a session cookie");
    assert_eq!(session["httpOnly"], true);
    assert_eq!(session["sameSite"], "Strict");
    let expiry = session["expiry"].as_u64().unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    assert!(expiry <= now + 8 * 3600 + 5, "at most 8 hours");

    if std::env::var_os("FLEXWAY_BLESS").is_some() {
        let shot = browser.screenshot().await;
        std::fs::write(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/console.png"), shot).unwrap();
    }

    let headers = client().get(format!("{}/console", gw.url)).bearer_auth(CONSOLE_KEY).send().await.unwrap();
    let csp = headers.headers()["content-security-policy"].to_str().unwrap();
    assert!(csp.starts_with("default-src 'none'"), "{csp}");
    browser.quit().await;
}

#[tokio::test]
async fn firefox_signs_in_and_reads_the_same_page() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&console_config(&model.url(), true));
    assert_eq!(gw.chat(KEY, hello("m")).await.status(), 200);
    let mut firefox = Firefox::start().await;
    firefox.go(&format!("{}/console", gw.url)).await;
    assert!(firefox.source_with("Sign in").await.contains("id=\"key\""));
    firefox.type_into("#key", KEY).await;
    firefox.click("#sign-in").await;
    assert!(firefox.source_with("does not open the console").await.contains("does not open the console"));
    firefox.type_into("#key", CONSOLE_KEY).await;
    firefox.click("#sign-in").await;
    let page = firefox.source_with("id=\"backends\"").await;
    assert!(page.contains("data-tenant=\"acme\" data-agent=\"\" data-budget=\"eur_per_month\""), "{page}");
    assert!(page.contains("data-backend=\"main\" data-calls=\"1\""), "{page}");
    let cookies = firefox.cookies().await;
    let session = cookies.iter().find(|c| c["name"] == "flexway_console").expect("a session cookie");
    assert_eq!((session["httpOnly"].as_bool(), session["sameSite"].as_str()), (Some(true), Some("Strict")));
    firefox.quit().await;
}

/// The response cache's section: a hit's saving is the audit's `cost_saved_micro_eur`
/// (counted by this process), and the entries are the store's count.
#[tokio::test]
async fn the_console_shows_what_the_cache_saved_and_holds() {
    let model = FakeModel::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("cache.key");
    std::fs::write(&key, "0123456789abcdef0123456789abcdef").unwrap();
    let cache = format!(
        "  cache:\n    store: {{kind: embedded, path: \"{}\"}}\n    key: \"file:{}\"\n    policies:\n      \
         faq: {{mode: exact, ttl: 1h}}\n    models: {{faq-model: faq}}\n",
        dir.path().join("cache.db").display(),
        key.display()
    );
    let gw = Flexway::start(&(console_config(&model.url(), true) + &cache));
    let gw = &gw;
    let answered = |key: &'static str| async move {
        let response = gw.chat(key, hello("faq-model")).await;
        assert_eq!(response.status(), 200);
        response.headers()["flexway-cache"].to_str().unwrap().to_owned()
    };
    assert_eq!(answered(KEY).await, "stored");
    assert!(answered(KEY).await.starts_with("hit"));
    assert!(answered(KEY).await.starts_with("hit"));
    assert_eq!(answered(OTHER_KEY).await, "stored", "globex has entries of its own");
    // Each hit saved the cost of the call that stored its entry (SPEC §16).
    let records = gw.records_until::<Value>(4).await;
    let saved = 2 * records[0]["cost_micro_eur"].as_u64().unwrap();
    assert!(saved > 0);

    let overview: Value = client()
        .get(format!("{}/console/data.json", gw.url))
        .bearer_auth(CONSOLE_KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let rows = overview["cache"].as_array().unwrap();
    let acme = rows.iter().find(|r| r["tenant"] == "acme").unwrap();
    assert_eq!((acme["hits"].as_u64(), acme["misses"].as_u64(), acme["stores"].as_u64()), (Some(2), Some(1), Some(1)));
    assert_eq!(acme["saved_micro_eur"], saved, "the audit's savings");
    assert_eq!(acme["entries"], 1);
    let globex = rows.iter().find(|r| r["tenant"] == "globex").unwrap();
    assert_eq!((globex["saved_micro_eur"].as_u64(), globex["entries"].as_u64()), (Some(0), Some(1)));

    let page = client().get(format!("{}/console", gw.url)).bearer_auth(CONSOLE_KEY).send().await.unwrap();
    let page = page.text().await.unwrap();
    let row = format!("data-cache-tenant=\"acme\" data-saved=\"{saved}\" data-entries=\"1\"");
    assert!(page.contains(&row), "{page}");
    assert!(page.contains(&format!("{} €", flexway::money::MicroEur(saved).to_eur_string())), "{page}");
    assert!(!page.contains("hello there"), "no prompt");
    let metrics = client().get(format!("{}/metrics", gw.url)).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("flexway_cache_entries{tenant=\"acme\"} 1\n"), "set by the console's count: {metrics}");
    let audited: u64 = records.iter().filter_map(|r| r["cost_saved_micro_eur"].as_u64()).sum();
    assert_eq!(audited, saved, "the console's savings are the audit's");
}

/// The calls a per-minute limit refused (SPEC §14), per tenant, holder and kind: the
/// `flexway_rate_limited_total` this process counted.
#[tokio::test]
async fn the_console_shows_the_calls_a_per_minute_limit_refused() {
    let model = FakeModel::start().await.unwrap();
    let limited = console_config(&model.url(), true)
        .replace("eur_per_month: 5}", "eur_per_month: 5}\n    limits: {requests_per_minute: 1}");
    let gw = Flexway::start(&limited);
    // One call a minute: the second is refused (or the third, if a minute turned).
    let mut refused = 0;
    for _ in 0..3 {
        if gw.chat(KEY, hello("m")).await.status() == 429 {
            refused += 1;
            break;
        }
    }
    assert_eq!(refused, 1, "the limit refused a call");
    assert_eq!(gw.chat(OTHER_KEY, hello("m")).await.status(), 200, "globex has no limit");

    let overview: Value = client()
        .get(format!("{}/console/data.json", gw.url))
        .bearer_auth(CONSOLE_KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let rows = overview["rate_limited"].as_array().unwrap();
    assert_eq!(
        rows,
        &[serde_json::json!({"tenant": "acme", "holder": "tenant acme", "kind": "requests", "refused": 1})],
        "{overview}"
    );
    let page = client().get(format!("{}/console", gw.url)).bearer_auth(CONSOLE_KEY).send().await.unwrap();
    let page = page.text().await.unwrap();
    let row = "data-limited-tenant=\"acme\" data-holder=\"tenant acme\" data-kind=\"requests\" data-refused=\"1\"";
    assert!(page.contains(row), "{page}");
    let metrics = client().get(format!("{}/metrics", gw.url)).send().await.unwrap().text().await.unwrap();
    let counted = "flexway_rate_limited_total{tenant=\"acme\",holder=\"tenant acme\",kind=\"requests\"} 1\n";
    assert!(metrics.contains(counted), "the console's figure is the metric's: {metrics}");
}
