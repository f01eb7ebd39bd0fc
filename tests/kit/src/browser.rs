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

/// A headless Firefox (Debian's `firefox-esr`, or `FIREFOX`) driven over Marionette,
/// its own remote protocol (length-prefixed JSON over TCP; geckodriver, which speaks
/// WebDriver over it, is not packaged by Debian): the commands the console's test
/// needs.
pub struct Firefox {
    child: Child,
    stream: tokio::io::BufReader<tokio::net::TcpStream>,
    next: u64,
    _profile: tempfile::TempDir,
}

impl Firefox {
    pub async fn start() -> Firefox {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let profile = tempfile::tempdir().unwrap();
        let prefs = format!(
            "user_pref(\"marionette.port\", {port});\nuser_pref(\"browser.shell.checkDefaultBrowser\", false);\n\
             user_pref(\"browser.startup.homepage_override.mstone\", \"ignore\");\n\
             user_pref(\"datareporting.policy.dataSubmissionEnabled\", false);\n\
             user_pref(\"toolkit.telemetry.reportingpolicy.firstRun\", false);\n\
             user_pref(\"app.update.disabledForTesting\", true);\n"
        );
        std::fs::write(profile.path().join("user.js"), prefs).unwrap();
        let child = Command::new(std::env::var("FIREFOX").unwrap_or_else(|_| "firefox-esr".into()))
            .args(["--headless", "--marionette", "--no-remote", "--profile"])
            .arg(profile.path())
            .env("MOZ_HEADLESS", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("firefox-esr (Debian's; scripts/test installs it)");
        let deadline = Instant::now() + Duration::from_secs(60);
        let tcp = loop {
            match tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
                Ok(tcp) => break tcp,
                Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(100)).await,
                Err(e) => panic!("Firefox's Marionette did not listen: {e}"),
            }
        };
        let mut firefox = Firefox { child, stream: tokio::io::BufReader::new(tcp), next: 0, _profile: profile };
        let hello = firefox.read().await;
        assert_eq!(hello["marionetteProtocol"], 3, "{hello}");
        firefox
            .command("WebDriver:NewSession", json!({"capabilities": {"alwaysMatch": {"acceptInsecureCerts": true}}}))
            .await;
        firefox
    }

    /// One message: `LENGTH:JSON`.
    async fn read(&mut self) -> Value {
        use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _};
        let mut length = Vec::new();
        self.stream.read_until(b':', &mut length).await.unwrap();
        let length: usize = std::str::from_utf8(&length[..length.len() - 1]).unwrap().trim().parse().unwrap();
        let mut body = vec![0; length];
        self.stream.read_exact(&mut body).await.unwrap();
        serde_json::from_slice(&body).unwrap()
    }

    async fn command(&mut self, name: &str, parameters: Value) -> Value {
        use tokio::io::AsyncWriteExt as _;
        self.next += 1;
        let message = json!([0, self.next, name, parameters]).to_string();
        let framed = format!("{}:{message}", message.len());
        self.stream.get_mut().write_all(framed.as_bytes()).await.unwrap();
        let answer = self.read().await;
        assert!(answer[2].is_null(), "Marionette {name}: {answer}");
        answer[3].clone()
    }

    pub async fn go(&mut self, url: &str) {
        self.command("WebDriver:Navigate", json!({"url": url})).await;
    }

    async fn element(&mut self, css: &str) -> String {
        let found = self.command("WebDriver:FindElement", json!({"using": "css selector", "value": css})).await;
        let found = found.get("value").cloned().unwrap_or(found);
        found.as_object().and_then(|o| o.values().next()).and_then(Value::as_str).unwrap().to_owned()
    }

    pub async fn type_into(&mut self, css: &str, text: &str) {
        let id = self.element(css).await;
        self.command("WebDriver:ElementClear", json!({"id": id})).await;
        self.command("WebDriver:ElementSendKeys", json!({"id": id, "text": text})).await;
    }

    pub async fn click(&mut self, css: &str) {
        let id = self.element(css).await;
        self.command("WebDriver:ElementClick", json!({"id": id})).await;
    }

    pub async fn source_with(&mut self, text: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let source = self.command("WebDriver:GetPageSource", json!({})).await;
            let source = source.get("value").unwrap_or(&source).as_str().unwrap_or_default().to_owned();
            if source.contains(text) || Instant::now() > deadline {
                return source;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn cookies(&mut self) -> Vec<Value> {
        let cookies = self.command("WebDriver:GetCookies", json!({})).await;
        cookies.get("value").unwrap_or(&cookies).as_array().cloned().unwrap_or_default()
    }

    pub async fn quit(mut self) {
        use tokio::io::AsyncWriteExt as _;
        let message = json!([0, self.next + 1, "Marionette:Quit", {}]).to_string();
        let _ = self.stream.get_mut().write_all(format!("{}:{message}", message.len()).as_bytes()).await;
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Firefox {
    fn drop(&mut self) {
        let _ = self.child.kill();
    }
}
