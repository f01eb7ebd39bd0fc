//! A headless Chromium for the console's test and benchmark: Debian's `chromium`
//! driven over the W3C WebDriver protocol (a few of its commands, spoken directly
//! with reqwest) through a `chromedriver` child process (`CHROMEDRIVER`, `CHROMIUM`
//! name other binaries).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// A headless Chromium driven over the W3C WebDriver protocol (a few of its
/// commands, spoken directly), through a `chromedriver` child process.
pub struct Browser {
    driver: Child,
    session: String,
    http: reqwest::Client,
}

impl Browser {
    pub async fn start() -> Browser {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let driver = Command::new(std::env::var("CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".into()))
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver (Debian's chromium-driver; scripts/test installs it)");
        let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
        let base = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(20);
        while http.get(format!("{base}/status")).send().await.is_err() {
            assert!(Instant::now() < deadline, "chromedriver did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let binary = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
        let capabilities = json!({"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {
            "binary": binary,
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1280,1100"]}}}});
        let created: Value =
            http.post(format!("{base}/session")).json(&capabilities).send().await.unwrap().json().await.unwrap();
        let session = created["value"]["sessionId"].as_str().unwrap_or_else(|| panic!("no session: {created}"));
        Browser { driver, session: format!("{base}/session/{session}"), http }
    }

    async fn command(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let request = self.http.request(method, format!("{}{path}", self.session));
        let request = match body {
            Some(body) => request.json(&body),
            None => request,
        };
        let answer: Value = request.send().await.unwrap().json().await.unwrap();
        assert!(answer["value"].get("error").is_none(), "WebDriver {path}: {answer}");
        answer["value"].clone()
    }

    pub async fn go(&self, url: &str) {
        self.command(reqwest::Method::POST, "/url", Some(json!({"url": url}))).await;
    }

    async fn element(&self, css: &str) -> String {
        let found =
            self.command(reqwest::Method::POST, "/element", Some(json!({"using": "css selector", "value": css})));
        let found = found.await;
        found.as_object().and_then(|o| o.values().next()).and_then(Value::as_str).unwrap().to_owned()
    }

    pub async fn type_into(&self, css: &str, text: &str) {
        let element = self.element(css).await;
        self.command(reqwest::Method::POST, &format!("/element/{element}/clear"), Some(json!({}))).await;
        self.command(reqwest::Method::POST, &format!("/element/{element}/value"), Some(json!({"text": text}))).await;
    }

    pub async fn click(&self, css: &str) {
        let element = self.element(css).await;
        self.command(reqwest::Method::POST, &format!("/element/{element}/click"), Some(json!({}))).await;
    }

    pub async fn source(&self) -> String {
        self.command(reqwest::Method::GET, "/source", None).await.as_str().unwrap().to_owned()
    }

    /// The page's source once it holds `text` (a click's navigation may still be
    /// under way when the click returns), within ten seconds.
    pub async fn source_with(&self, text: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let source = self.source().await;
            if source.contains(text) || Instant::now() > deadline {
                return source;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn cookies(&self) -> Vec<Value> {
        self.command(reqwest::Method::GET, "/cookie", None).await.as_array().unwrap().clone()
    }

    pub async fn screenshot(&self) -> Vec<u8> {
        use base64::Engine as _;
        let png = self.command(reqwest::Method::GET, "/screenshot", None).await;
        base64::engine::general_purpose::STANDARD.decode(png.as_str().unwrap()).unwrap()
    }

    /// Runs `script` in the page (WebDriver's, not the page's: its CSP does not
    /// apply) and returns its value.
    pub async fn run(&self, script: &str) -> Value {
        self.command(reqwest::Method::POST, "/execute/sync", Some(json!({"script": script, "args": []}))).await
    }

    pub async fn quit(mut self) {
        let _ = self.http.delete(&self.session).send().await;
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.driver.kill();
    }
}
