//! `flexway validate` on the serverless shape: the platform limits that change a
//! guarantee are reported as warnings (ARCHITECTURE.md, "Deployment shapes"), and
//! only when the configuration uses that shape (a DynamoDB ledger or a CloudWatch
//! audit).
#![cfg(test)]

use std::collections::HashMap;
use std::path::PathBuf;

use flexway::config::{Diagnostic, load_str};

const KEY: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

/// A descriptor set the loader accepts: one unmetered service, compiled by protox.
fn descriptor_set() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("flexway-platform-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let source = "syntax = \"proto3\";\npackage ocr.v1;\nmessage M {}\nservice Ocr { rpc Read(M) returns (M); }\n";
    std::fs::write(dir.join("ocr.proto"), source).unwrap();
    let mut compiler = protox::Compiler::new([dir.clone()]).unwrap();
    compiler.open_files(["ocr.proto"]).unwrap();
    let path = dir.join("ocr.binpb");
    std::fs::write(&path, compiler.encode_file_descriptor_set()).unwrap();
    path
}

fn document(store: &str, audit: &str, vision: &str, grpc: bool) -> String {
    let grpc = if grpc {
        format!(
            "    ocr: {{kind: grpc, url: 'http://10.0.0.9:50051', descriptor_set: '{}', external: false}}\n",
            descriptor_set().display()
        )
    } else {
        String::new()
    };
    format!(
        r#"version: 1
store: {store}
audit: {audit}
tenants:
  acme:
    keys:
      - sha256: {KEY}
ai:
  default_backend: main
{vision}  backends:
    main:
      url: https://main.example.net/v1
      price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 2}}
{grpc}"#
    )
}

/// The warnings of a document that must load, less the one every document without
/// `audit.hash_salt` gets (config_validation.rs): it is not the platform's.
fn warnings(text: &str) -> Vec<Diagnostic> {
    match load_str(text, &HashMap::<String, String>::new()) {
        Ok(loaded) => loaded.warnings.into_iter().filter(|w| w.path != "audit.hash_salt").collect(),
        Err(error) => panic!("the document must load:\n{error}\n{text}"),
    }
}

fn at<'a>(warnings: &'a [Diagnostic], path: &str) -> Vec<&'a Diagnostic> {
    warnings.iter().filter(|w| w.path == path).collect()
}

const DYNAMODB: &str = "{kind: dynamodb, table: flexway-ledger}";
const CLOUDWATCH: &str = "{sink: cloudwatch, log_group: /flexway/audit}";
const MEMORY: &str = "{kind: memory}";
const STDOUT: &str = "{sink: stdout}";

#[test]
fn warns_that_lambda_caps_the_default_body_limit_at_6_mb() {
    let got = warnings(&document(DYNAMODB, CLOUDWATCH, "", false));
    let body = at(&got, "ai.vision.max_body_bytes");
    assert_eq!(body.len(), 1, "{got:?}");
    assert!(body[0].message.contains("25165824 bytes"), "{}", body[0].message);
    assert!(body[0].message.contains("effective body limit is 6 MB"), "{}", body[0].message);
}

#[test]
fn warns_about_a_declared_body_limit_above_6_mb_with_either_serverless_adapter() {
    let vision = "  vision: {max_body_bytes: 10000000}\n";
    for (store, audit) in [(DYNAMODB, STDOUT), (MEMORY, CLOUDWATCH)] {
        let got = warnings(&document(store, audit, vision, false));
        let body = at(&got, "ai.vision.max_body_bytes");
        assert_eq!(body.len(), 1, "{store} {audit}: {got:?}");
        assert!(body[0].message.contains("10000000 bytes"), "{}", body[0].message);
    }
}

#[test]
fn no_body_warning_when_the_limit_fits_in_a_lambda_request() {
    let vision = "  vision: {max_body_bytes: 6291456, max_image_bytes: 4194304}\n";
    let got = warnings(&document(DYNAMODB, CLOUDWATCH, vision, false));
    assert!(at(&got, "ai.vision.max_body_bytes").is_empty(), "{got:?}");
}

#[test]
fn warns_that_a_grpc_backend_gets_grpc_web_only_through_a_function_url() {
    let vision = "  vision: {max_body_bytes: 1000000, max_image_bytes: 500000}\n";
    let got = warnings(&document(DYNAMODB, CLOUDWATCH, vision, true));
    let grpc = at(&got, "ai.backends.ocr");
    assert_eq!(grpc.len(), 1, "{got:?}");
    assert!(grpc[0].message.contains("no native gRPC through a Lambda function URL"), "{}", grpc[0].message);
    assert!(grpc[0].message.contains("gRPC-Web only"), "{}", grpc[0].message);
    assert!(grpc[0].message.contains("client and bidirectional streaming"), "{}", grpc[0].message);
    assert_eq!(got.len(), 1, "nothing else to say: {got:?}");
}

#[test]
fn the_local_shape_gets_no_platform_warning() {
    let got = warnings(&document(MEMORY, STDOUT, "", true));
    assert!(got.is_empty(), "{got:?}");
}
