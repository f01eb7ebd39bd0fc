//! The fake MCP server, spoken to as a client does (plain JSON-RPC over HTTP): the
//! session revision (initialize, SSE answers), the stateless 2026-07-28 one, each tool,
//! the counters, the required token and forgetting sessions.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use fake_mcp::FakeMcp;
use serde_json::{Value, json};

/// The JSON-RPC answer to request `id` in a response's body: the body itself
/// (`application/json`) or the SSE event that carries it.
async fn answer(response: reqwest::Response) -> Value {
    let status = response.status();
    let text = response.text().await.unwrap();
    assert!(status.is_success(), "{status}: {text}");
    if let Ok(value) = serde_json::from_str::<Value>(&text) {
        return value;
    }
    text.lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .filter_map(|data| serde_json::from_str::<Value>(data.trim()).ok())
        .find(|message| message.get("id").is_some())
        .unwrap_or_else(|| panic!("no answer in {text}"))
}

struct Client {
    http: reqwest::Client,
    url: String,
    token: Option<String>,
    session: Option<String>,
}

impl Client {
    fn new(url: String, token: Option<&str>) -> Client {
        Client { http: reqwest::Client::new(), url, token: token.map(str::to_owned), session: None }
    }

    fn post(&self, body: &Value, version: &str) -> reqwest::RequestBuilder {
        let mut request = self
            .http
            .post(&self.url)
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", version)
            .json(body);
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        if let Some(session) = &self.session {
            request = request.header("mcp-session-id", session);
        }
        request
    }

    async fn initialize(&mut self) {
        self.session = None;
        let body = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "fake-mcp-test", "version": "1"}}});
        let response = self.post(&body, "2025-11-25").send().await.unwrap();
        let session = response.headers().get("mcp-session-id").map(|v| v.to_str().unwrap().to_owned());
        let init = answer(response).await;
        assert_eq!(init["result"]["protocolVersion"], "2025-11-25", "{init}");
        self.session = Some(session.expect("a session id"));
        let note = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        let accepted = self.post(&note, "2025-11-25").send().await.unwrap();
        assert_eq!(accepted.status(), 202);
    }

    async fn call(&self, name: &str, arguments: Value) -> Value {
        let body = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": name, "arguments": arguments}});
        answer(self.post(&body, "2025-11-25").send().await.unwrap()).await
    }
}

fn text_of(answer: &Value) -> &str {
    answer["result"]["content"][0]["text"].as_str().unwrap_or_else(|| panic!("no text in {answer}"))
}

#[tokio::test]
async fn every_tool_answers_as_documented_in_a_session() {
    let server = FakeMcp::start().await.unwrap();
    let mut client = Client::new(server.url(), None);
    client.initialize().await;
    assert_eq!(server.initializations(), 1);

    let list = answer(
        client.post(&json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}), "2025-11-25").send().await.unwrap(),
    )
    .await;
    let names: Vec<&str> =
        list["result"]["tools"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["echo", "add", "fail", "explode", "slow", "whoami"]);
    assert_eq!(list["result"]["tools"][1]["inputSchema"]["required"], json!(["a", "b"]));

    assert_eq!(text_of(&client.call("echo", json!({"text": "hi there"})).await), "hi there");
    assert_eq!(text_of(&client.call("add", json!({"a": 2, "b": 40})).await), "42");
    let failed = client.call("fail", json!({})).await;
    assert_eq!(failed["result"]["isError"], true, "{failed}");
    let exploded = client.call("explode", json!({})).await;
    assert_eq!(exploded["error"]["code"], -32603, "{exploded}");
    assert!(exploded.get("result").is_none());
    let started = std::time::Instant::now();
    assert_eq!(text_of(&client.call("slow", json!({"ms": 150})).await), "slept 150 ms");
    assert!(started.elapsed() >= std::time::Duration::from_millis(150));
    assert_eq!(text_of(&client.call("whoami", json!({})).await), "(none)");
    let unknown = client.call("nope", json!({})).await;
    assert_eq!(unknown["error"]["code"], -32602, "{unknown}");

    assert_eq!(server.calls("echo"), 1);
    assert_eq!(server.calls("add"), 1);
    assert_eq!(server.calls("explode"), 1);
    assert_eq!(server.calls("whoami"), 1);
    assert_eq!(server.calls("never"), 0);
}

#[tokio::test]
async fn a_forgotten_session_is_404_and_a_new_one_works() {
    let server = FakeMcp::start().await.unwrap();
    let mut client = Client::new(server.url(), None);
    client.initialize().await;
    assert_eq!(text_of(&client.call("echo", json!({"text": "a"})).await), "a");

    server.forget().await;
    let body = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "echo", "arguments": {"text": "b"}}});
    let gone = client.post(&body, "2025-11-25").send().await.unwrap();
    assert_eq!(gone.status(), 404);

    client.initialize().await;
    assert_eq!(text_of(&client.call("echo", json!({"text": "c"})).await), "c");
    assert_eq!(server.initializations(), 2);

    // The same over HTTP, on the server's own listener.
    let forget = format!("http://{}/forget", server.addr());
    assert_eq!(reqwest::Client::new().post(forget).send().await.unwrap().status(), 204);
    assert_eq!(client.post(&body, "2025-11-25").send().await.unwrap().status(), 404);
}

#[tokio::test]
async fn a_required_token_is_checked_and_whoami_tells_it() {
    let server = FakeMcp::start_requiring("upstream-secret").await.unwrap();
    let mut anonymous = Client::new(server.url(), None);
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}});
    assert_eq!(anonymous.post(&init, "2025-11-25").send().await.unwrap().status(), 401);
    anonymous.token = Some("wrong".into());
    assert_eq!(anonymous.post(&init, "2025-11-25").send().await.unwrap().status(), 401);

    let mut client = Client::new(server.url(), Some("upstream-secret"));
    client.initialize().await;
    assert_eq!(text_of(&client.call("whoami", json!({})).await), "Bearer upstream-secret");
}

#[tokio::test]
async fn the_stateless_revision_needs_no_session() {
    let server = FakeMcp::start().await.unwrap();
    let client = Client::new(server.url(), None);
    let meta = json!({"io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"},
        "io.modelcontextprotocol/clientCapabilities": {}});
    let discover = json!({"jsonrpc": "2.0", "id": 1, "method": "server/discover", "params": {"_meta": meta}});
    let response = client.post(&discover, "2026-07-28").header("mcp-method", "server/discover").send().await.unwrap();
    assert!(response.headers().get("mcp-session-id").is_none());
    let found = answer(response).await;
    assert!(found["result"]["supportedVersions"].as_array().unwrap().contains(&json!("2026-07-28")), "{found}");

    let call = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
        "params": {"name": "echo", "arguments": {"text": "stateless"}, "_meta": meta}});
    let response = client
        .post(&call, "2026-07-28")
        .header("mcp-method", "tools/call")
        .header("mcp-name", "echo")
        .send()
        .await
        .unwrap();
    assert_eq!(text_of(&answer(response).await), "stateless");
    assert_eq!(server.calls("echo"), 1);
    assert_eq!(server.initializations(), 0);
}
