#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout
)]
use std::collections::HashMap;
#[test]
fn scratch() {
    let env: HashMap<String, String> = HashMap::new();
    let demo = flexway::config::load_file(
        std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo.yaml")),
        &env,
    );
    match demo {
        Ok(l) => println!("demo OK warnings={:?}", l.warnings),
        Err(e) => println!("demo ERR {e}"),
    }
    let bad = r#"
version: 2
store: {kind: dynamodb, path: x}
audit: {sink: file, hash_salt: "hunter2"}
tenants:
  acme:
    keys:
      - sha256: abc
      - {sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08, agent: nobody}
    budgets: {eur_per_month: 0.1234567}
    backend: ocr
ai:
  default_backend: pool
  sensitive_backend: pool
  capabilities: {vision: small}
  vision: {allowed_origins: ["http://x.example.com", "https://y.example.com/path"]}
  budget: {soft: {threshold: 1.2, backend: ghost}, default_max_tokens: 8, min_completion_tokens: 16}
  backends:
    pool:
      kind: pool
      url: https://x
      members: [{backend: small, priority: 0}, {backend: pool}, {backend: ocr}]
      fallback: [pool, ghost]
    small:
      url: ftp://small
      auth: {type: header, secret: "sk-abc"}
      price: {input_per_mtok_eur: -1, output_per_mtok_eur: 0.5}
      circuit_breaker: {failure_ratio: 0.5, status: ["600"], interval: 10}
      timeout: 1x
    up:
      kind: relay
      url: grpc://up
      identity_headers: {tenant: "a b"}
    ocr:
      kind: grpc
      url: http://10.0.0.9:50051
      descriptor_set: /nonexistent.binpb
      models: [x]
"#;
    match flexway::config::load_str(bad, &env) {
        Ok(_) => println!("??"),
        Err(e) => println!("{e}"),
    }
    let shape = "version: 1\nai:\n  backends:\n    a: {kind: foo, url: 3, auth: {type: bearer, secret: 42}, circuit_breaker: {status: [true]}}\n    b: {price: {input_per_mtok_eur: abc}}\n  vision: {max_body_bytes: -4}\ntenants: {t: {keys: [{sha256: 1, relay_peer: yes}]}}\n";
    match flexway::config::load_str(shape, &env) {
        Ok(_) => println!("??"),
        Err(e) => println!("{e}"),
    }
}
