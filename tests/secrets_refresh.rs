//! `secrets.refresh` in the serverless shape's router (`flexway::http::api`), which
//! starts a refresh when a request finds it due (no timer between invocations),
//! beside the request and never in its way. A `file:` reference stands in for an AWS one (tests/secrets_aws.rs
//! rotates those, on the emulator): the refresh is the same for every reference.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use flexway_testkit::*;

/// `file:` references, each resolution held while `gate` is closed (after the first).
struct Gated {
    local: flexway::secret::LocalSecrets<HashMap<String, String>>,
    gate: Arc<tokio::sync::Semaphore>,
    resolutions: std::sync::atomic::AtomicU32,
}

#[async_trait::async_trait]
impl flexway::secret::SecretSource for Gated {
    async fn resolve(
        &self,
        reference: &flexway::config::SecretRef,
    ) -> Result<flexway::secret::Secret, flexway::secret::SecretError> {
        if self.resolutions.fetch_add(1, std::sync::atomic::Ordering::SeqCst) > 0 {
            drop(self.gate.acquire().await);
        }
        self.local.resolve(reference).await
    }
}

/// The serverless router in-process, on a loopback port, with `yaml`.
async fn serverless(yaml: &str) -> String {
    serverless_with(yaml, Arc::new(Gated::open())).await
}

impl Gated {
    fn open() -> Gated {
        Gated {
            local: flexway::secret::LocalSecrets { env: HashMap::new() },
            gate: Arc::new(tokio::sync::Semaphore::new(1)),
            resolutions: std::sync::atomic::AtomicU32::new(0),
        }
    }
}

async fn serverless_with(yaml: &str, secrets: Arc<Gated>) -> String {
    let env: HashMap<String, String> = HashMap::new();
    let loaded = flexway::config::load_str(yaml, &env).unwrap_or_else(|e| panic!("{e}"));
    let (adapters, _) = memory_adapters();
    let gateway = Arc::new(flexway::Gateway::new(loaded.config, secrets, adapters).await.unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, flexway::http::api(gateway)).await });
    url
}

async fn chat(url: &str) -> u16 {
    let response = client().post(format!("{url}/v1/chat/completions")).bearer_auth(KEY).json(&hello("m"));
    response.send().await.unwrap().status().as_u16()
}

/// A key file holding `sk-one`, and a config whose one backend sends it (refreshed
/// every second).
fn keyed_backend(model: &FakeModel, dir: &std::path::Path) -> (std::path::PathBuf, String) {
    let key = dir.join("backend-key");
    std::fs::write(&key, "sk-one\n").unwrap();
    let yaml = one_backend(&model.url()).replace(
        "      url:",
        &format!("      auth: {{type: bearer, secret: \"file:{}\"}}\n      url:", key.display()),
    );
    (key, yaml.replace("ai:\n", "secrets: {refresh: 1s}\nai:\n"))
}

fn last_bearer(model: &FakeModel) -> Option<String> {
    model.requests().last().and_then(|r| r.header("authorization").map(str::to_owned))
}

#[tokio::test]
async fn the_serverless_router_refreshes_when_due_and_keeps_the_last_value_on_failure() {
    let model = FakeModel::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (key, yaml) = keyed_backend(&model, dir.path());
    let url = serverless(&yaml).await;

    assert_eq!(chat(&url).await, 200);
    assert_eq!(last_bearer(&model).as_deref(), Some("Bearer sk-one"));

    // Rotated: not due yet, the value in use stays; once due, the next request starts
    // the refresh beside it (with the value in use), and the calls after use the new
    // value.
    std::fs::write(&key, "sk-two\n").unwrap();
    assert_eq!(chat(&url).await, 200);
    assert_eq!(last_bearer(&model).as_deref(), Some("Bearer sk-one"));
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(chat(&url).await, 200);
    let refreshed =
        wait_for(|| async { chat(&url).await == 200 && last_bearer(&model).as_deref() == Some("Bearer sk-two") });
    assert!(refreshed.await, "the rotated key is in use after the refresh");

    // Gone at the next refresh: the last value resolved stays in use.
    std::fs::remove_file(&key).unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    for _ in 0..3 {
        assert_eq!(chat(&url).await, 200);
        assert_eq!(last_bearer(&model).as_deref(), Some("Bearer sk-two"));
    }
}

/// Up to 5 s for `done` to say yes, tried every 50 ms.
async fn wait_for<F, Fut>(done: F) -> bool
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..100 {
        if done().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// A secret store that hangs (its gate closed) never holds a call: the due request
/// and the next ones are answered with the value in use while the refresh waits.
#[tokio::test]
async fn a_refresh_that_hangs_holds_no_call() {
    let model = FakeModel::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (key, yaml) = keyed_backend(&model, dir.path());
    let secrets = Arc::new(Gated::open());
    let closed = secrets.gate.clone().acquire_owned().await.unwrap();
    let url = serverless_with(&yaml, secrets.clone()).await;
    std::fs::write(&key, "sk-two\n").unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    for _ in 0..3 {
        assert_eq!(chat(&url).await, 200, "answered while the refresh hangs");
        assert_eq!(last_bearer(&model).as_deref(), Some("Bearer sk-one"));
    }
    assert_eq!(secrets.resolutions.load(std::sync::atomic::Ordering::SeqCst), 2, "one refresh started, held");
    drop(closed);
    let refreshed =
        wait_for(|| async { chat(&url).await == 200 && last_bearer(&model).as_deref() == Some("Bearer sk-two") });
    assert!(refreshed.await, "the held refresh ends and its value is used");
}
