//! Backends of kind `openai`: authentication modes, model selection, routing overrides.

use flexway_testkit::*;
use serde_json::{Value, json};

fn header<'a>(request: &'a fake_model::RecordedRequest, name: &str) -> Option<&'a str> {
    request.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
}

#[tokio::test]
async fn bearer_auth_sends_the_secret_from_an_env_reference() {
    let model = FakeModel::start().await.unwrap();
    let ai = format!(
        "  default_backend: main\n  backends:\n    main:\n      url: {}\n      auth: {{type: bearer, secret: \"env:MAIN_KEY\"}}\n",
        model.url()
    );
    let gw = Flexway::start_with_env(&config(&ai), &[("MAIN_KEY", "upstream-secret-1")]);
    assert_eq!(gw.chat(KEY, hello("m")).await.status(), 200);
    assert_eq!(header(&model.requests()[0], "authorization"), Some("Bearer upstream-secret-1"));
    assert!(!gw.logs().contains("upstream-secret-1"), "a secret reached the logs");
}

#[tokio::test]
async fn header_auth_sends_the_secret_from_a_file_reference_under_the_declared_name() {
    let model = FakeModel::start().await.unwrap();
    let secret_dir = tempfile::tempdir().unwrap();
    let secret_path = secret_dir.path().join("key");
    std::fs::write(&secret_path, "file-secret-2\n").unwrap();
    let ai = format!(
        "  default_backend: main\n  backends:\n    main:\n      url: {}\n      auth: {{type: header, name: api-key, secret: \"file:{}\"}}\n",
        model.url(),
        secret_path.display()
    );
    let gw = Flexway::start(&config(&ai));
    assert_eq!(gw.chat(KEY, hello("m")).await.status(), 200);
    let seen = &model.requests()[0];
    assert_eq!(header(seen, "api-key"), Some("file-secret-2"));
    assert_eq!(header(seen, "authorization"), None);
}

#[tokio::test]
async fn token_file_is_re_read_at_every_call() {
    let model = FakeModel::start().await.unwrap();
    let token_dir = tempfile::tempdir().unwrap();
    let token = token_dir.path().join("token");
    std::fs::write(&token, "token-one\n").unwrap();
    let ai = format!(
        "  default_backend: main\n  backends:\n    main:\n      url: {}\n      auth: {{type: token_file, path: {}}}\n",
        model.url(),
        token.display()
    );
    let gw = Flexway::start(&config(&ai));
    assert_eq!(gw.chat(KEY, hello("m")).await.status(), 200);
    std::fs::write(&token, "token-two").unwrap();
    assert_eq!(gw.chat(KEY, hello("m")).await.status(), 200);
    let seen = model.requests();
    assert_eq!(header(&seen[0], "authorization"), Some("Bearer token-one"));
    assert_eq!(header(&seen[1], "authorization"), Some("Bearer token-two"));
}

#[tokio::test]
async fn an_unreadable_token_file_fails_the_call_without_leaking_the_key() {
    let model = FakeModel::start().await.unwrap();
    let ai = format!(
        "  default_backend: main\n  backends:\n    main:\n      url: {}\n      auth: {{type: token_file, path: /nonexistent/token}}\n",
        model.url()
    );
    let gw = Flexway::start(&config(&ai));
    let response = gw.chat(KEY, hello("m")).await;
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()["flexway-error-cause"], "upstream_failed");
    assert_eq!(model.request_count(), 0);
}

#[tokio::test]
async fn model_selection_listed_alias_default_and_pass_through() {
    let model = FakeModel::start().await.unwrap();
    let ai = format!(
        "  default_backend: main\n  backends:\n    main:\n      url: {u}\n      models: [gpt-4.1, gpt-4.1-mini]\n      aliases: {{chat-default: gpt-4.1}}\n      default_model: gpt-4.1-mini\n    bare:\n      url: {u}\n",
        u = model.url()
    );
    let gw = Flexway::start(&config(&ai));
    for (asked, served) in [("gpt-4.1", "gpt-4.1"), ("chat-default", "gpt-4.1"), ("something-else", "gpt-4.1-mini")] {
        assert_eq!(gw.chat(KEY, hello(asked)).await.status(), 200);
        let last = model.requests().pop().unwrap();
        assert_eq!(last.body["model"], served, "asked {asked}");
    }
}

#[tokio::test]
async fn a_backend_without_models_passes_the_requested_name_through() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&one_backend(&model.url()));
    assert_eq!(gw.chat(KEY, hello("whatever-1")).await.status(), 200);
    assert_eq!(model.requests()[0].body["model"], "whatever-1");
}

fn routing_config(url: &str) -> String {
    format!(
        r#"version: 1
store: {{kind: memory}}
tenants:
  acme:
    keys:
      - sha256: {key}
      - {{sha256: {agent_key}, agent: bot}}
    backend: tenant-backend
    agents:
      bot: {{backend: agent-backend}}
      helper: {{}}
  globex:
    keys:
      - sha256: {other}
ai:
  default_backend: default-backend
  backends:
    default-backend: {{url: "{url}", models: [d-model]}}
    tenant-backend: {{url: "{url}", models: [t-model], aliases: {{t-alias: t-model}}}}
    agent-backend: {{url: "{url}", default_model: a-model}}
"#,
        key = sha(KEY),
        agent_key = sha(AGENT_KEY),
        other = sha(OTHER_KEY)
    )
}

#[tokio::test]
async fn routes_by_default_then_tenant_then_agent() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&routing_config(&model.url()));
    let backend = |r: &reqwest::Response| r.headers()["flexway-backend"].to_str().unwrap().to_owned();
    let other = gw.chat(OTHER_KEY, hello("m")).await;
    assert_eq!(backend(&other), "default-backend");
    let tenant = gw.chat(KEY, hello("m")).await;
    assert_eq!(backend(&tenant), "tenant-backend");
    let bound = gw.chat(AGENT_KEY, hello("m")).await;
    assert_eq!(backend(&bound), "agent-backend");
    let by_header =
        gw.post("/v1/chat/completions", KEY, hello("m")).header("Flexway-Agent", "bot").send().await.unwrap();
    assert_eq!(backend(&by_header), "agent-backend");
    // An agent without its own backend follows its tenant.
    let helper =
        gw.post("/v1/chat/completions", KEY, hello("m")).header("Flexway-Agent", "helper").send().await.unwrap();
    assert_eq!(backend(&helper), "tenant-backend");
}

#[tokio::test]
async fn the_requested_model_never_chooses_the_backend() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&routing_config(&model.url()));
    // d-model is only listed by default-backend; acme still goes to its own backend.
    let response = gw.chat(KEY, hello("d-model")).await;
    assert_eq!(response.headers()["flexway-backend"], "tenant-backend");
}

#[tokio::test]
async fn models_lists_the_names_the_caller_can_reach() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&routing_config(&model.url()));
    let list = |key: &'static str| {
        let url = format!("{}/v1/models", gw.url);
        async move {
            let body: Value = client().get(url).bearer_auth(key).send().await.unwrap().json().await.unwrap();
            assert_eq!(body["object"], "list");
            let mut ids: Vec<String> =
                body["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap().to_owned()).collect();
            ids.sort();
            ids
        }
    };
    assert_eq!(list(KEY).await, ["t-alias", "t-model"]);
    assert_eq!(list(OTHER_KEY).await, ["d-model"]);
    assert_eq!(list(AGENT_KEY).await, ["a-model"]);
}

#[tokio::test]
async fn a_pool_serves_from_its_best_priority_group() {
    let model = FakeModel::start().await.unwrap();
    let ai = format!(
        "  default_backend: pool\n  backends:\n    pool:\n      kind: pool\n      members:\n        - {{backend: first, priority: 1}}\n        - {{backend: second, priority: 2}}\n    first: {{url: \"{u}\"}}\n    second: {{url: \"{u}\"}}\n",
        u = model.url()
    );
    let gw = Flexway::start(&config(&ai));
    for _ in 0..5 {
        let response = gw.chat(KEY, hello("m")).await;
        assert_eq!(response.headers()["flexway-backend"], "first");
    }
    let _ = json!({});
}
