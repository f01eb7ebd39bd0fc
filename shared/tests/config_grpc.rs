//! `kind: grpc` backends at load (SPEC §10): the descriptor set is read with its
//! `(flexway.v1.operation).ai` options, and what cannot be served is refused with its
//! path. The sets are compiled here, at test time, by protox from small .proto files
//! importing the contract (`proto/flexway/v1/options.proto`).
#![cfg(test)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use flexway::config::{AiOperation, GrpcMetering, GrpcMethod, Secrets, load_str, load_str_with};
use flexway::money::MicroEur;

const SERVICE: &str = r#"
syntax = "proto3";
package ocr.v1;
import "flexway/v1/options.proto";
message Image { bytes data = 1; }
message Text { string text = 1; }
service Ocr {
  rpc Recognize(Image) returns (Text) {
    option (flexway.v1.operation) = {ai: {metering: PER_CALL, price_per_thousand_eur: "0.25", feature: "ocr"}};
  }
  rpc Stream(stream Image) returns (stream Text) {
    option (flexway.v1.operation) = {ai: {metering: PER_BYTE, price_per_thousand_eur: "0.001", feature: "scan"}};
  }
  rpc Health(Image) returns (Text);
}
"#;

/// `source` compiled as `ocr.proto` into a descriptor set file (with its imports, or
/// without), in its own directory.
fn compile(source: &str, include_imports: bool) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ocr.proto"), source).unwrap();
    let contract = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto");
    let mut compiler = protox::Compiler::new([dir.path().to_path_buf(), contract]).unwrap();
    compiler.include_imports(include_imports);
    compiler.open_files(["ocr.proto"]).unwrap();
    let path = dir.path().join("ocr.binpb");
    std::fs::write(&path, compiler.encode_file_descriptor_set()).unwrap();
    (dir, path)
}

fn config(backends: &str) -> String {
    format!(
        "version: 1\ntenants:\n  acme:\n    keys:\n      - sha256: {}\nai:\n  backends:\n{backends}",
        "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    )
}

fn ocr(set: &Path) -> String {
    format!("    ocr:\n      kind: grpc\n      url: http://10.0.0.9:50051\n      descriptor_set: {}\n", set.display())
}

fn env() -> HashMap<String, String> {
    HashMap::new()
}

/// The document's errors, as `path: message` lines.
fn errors(text: &str) -> Vec<String> {
    load_str(text, &env()).unwrap_err().errors.iter().map(ToString::to_string).collect()
}

#[test]
fn reads_services_and_metering_from_the_descriptor_set() {
    let (_dir, set) = compile(SERVICE, true);
    let loaded = load_str(&config(&ocr(&set)), &env()).unwrap_or_else(|e| panic!("{e}"));
    let warnings: Vec<_> = loaded.warnings.iter().filter(|w| w.path != "audit.hash_salt").collect();
    assert!(warnings.is_empty(), "{warnings:?}");
    let services = &loaded.config.ai.grpc[&flexway::config::BackendId::new("ocr")];
    let method = |name: &str| services.method("ocr.v1.Ocr", name).unwrap().clone();
    assert_eq!(
        method("Recognize"),
        GrpcMethod {
            client_streaming: false,
            server_streaming: false,
            operation: Some(AiOperation {
                metering: GrpcMetering::PerCall,
                price_per_thousand: MicroEur(250_000),
                feature: "ocr".into(),
                cache: None,
            }),
        }
    );
    let stream = method("Stream");
    assert!(stream.client_streaming && stream.server_streaming);
    let operation = stream.operation.unwrap();
    assert_eq!((operation.metering, operation.price_per_thousand.0), (GrpcMetering::PerByte, 1_000));
    assert_eq!(method("Health").operation, None, "no option: unmetered");
}

#[test]
fn reads_the_option_of_a_set_built_without_its_imports() {
    let (_dir, set) = compile(SERVICE, false);
    let loaded = load_str(&config(&ocr(&set)), &env()).unwrap_or_else(|e| panic!("{e}"));
    let services = &loaded.config.ai.grpc[&flexway::config::BackendId::new("ocr")];
    assert!(services.method("ocr.v1.Ocr", "Recognize").unwrap().operation.is_some());
}

#[test]
fn a_configuration_of_grpc_backends_only_needs_no_default_backend() {
    let (_dir, set) = compile(SERVICE, true);
    load_str(&config(&ocr(&set)), &env()).unwrap_or_else(|e| panic!("{e}"));
    // With an HTTP backend, the default backend is required again.
    let mixed = config(&format!("{}    main:\n      url: https://main.example.net/v1\n", ocr(&set)));
    let errors = errors(&mixed);
    assert!(errors.iter().any(|e| e.starts_with("ai.default_backend: required")), "{errors:?}");
}

#[test]
fn refuses_a_metered_method_with_a_malformed_price() {
    let (_dir, set) = compile(&SERVICE.replace("\"0.25\"", "\"0,25\""), true);
    let errors = errors(&config(&ocr(&set)));
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].starts_with("ai.backends.ocr.descriptor_set: "), "{errors:?}");
    assert!(errors[0].contains(&set.display().to_string()), "{errors:?}");
    assert!(
        errors[0].contains("/ocr.v1.Ocr/Recognize: (flexway.v1.operation).ai price_per_thousand_eur"),
        "{errors:?}"
    );
    assert!(errors[0].contains("`0,25` is not a decimal number of euros"), "{errors:?}");
}

#[test]
fn refuses_a_metered_method_without_metering_or_feature() {
    let source = SERVICE.replace("metering: PER_CALL, ", "").replace(", feature: \"scan\"", "");
    let (_dir, set) = compile(&source, true);
    let errors = errors(&config(&ocr(&set)));
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(errors.iter().any(|e| e.contains("/ocr.v1.Ocr/Recognize: (flexway.v1.operation).ai has no metering")));
    assert!(errors.iter().any(|e| e.contains("/ocr.v1.Ocr/Stream: (flexway.v1.operation).ai has no feature name")));
}

#[test]
fn refuses_a_descriptor_set_that_declares_no_service() {
    let source = SERVICE[..SERVICE.find("service Ocr").unwrap()].to_owned();
    let (_dir, set) = compile(&source, true);
    let errors = errors(&config(&ocr(&set)));
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].contains("declares no service"), "{errors:?}");
}

#[test]
fn takes_tls_towards_a_grpc_upstream_and_refuses_a_client_certificate_over_cleartext() {
    let (_dir, set) = compile(SERVICE, true);
    let tls = "      tls: {cert: 'env:CERT', key: 'env:KEY', ca: 'env:CA'}\n";
    let over_tls = config(&format!("{}{tls}", ocr(&set).replace("http://10.0.0.9:50051", "grpcs://ocr.example.net")));
    let pem: HashMap<String, String> = ["CERT", "KEY", "CA"].map(|name| (name.to_owned(), "pem".to_owned())).into();
    let loaded = load_str(&over_tls, &pem).unwrap_or_else(|e| panic!("{e}"));
    match &loaded.config.ai.backends[&flexway::config::BackendId::new("ocr")].kind {
        flexway::config::BackendKind::Grpc { url, tls: Some(tls), .. } => {
            assert_eq!((url.as_str(), tls.ca.is_some()), ("https://ocr.example.net", true));
        }
        other => panic!("{other:?}"),
    }
    let errors: Vec<String> = load_str(&config(&format!("{}{tls}", ocr(&set))), &pem)
        .unwrap_err()
        .errors
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].starts_with("ai.backends.ocr.tls: a client certificate is presented over TLS only"),
        "{errors:?}"
    );
}

#[tokio::test]
async fn a_missing_descriptor_set_is_a_warning_at_load_and_stops_the_gateway() {
    let missing = Path::new("/nonexistent/ocr.binpb");
    for secrets in [Secrets::Check, Secrets::Resolve] {
        let loaded = load_str_with(&config(&ocr(missing)), &env(), secrets).unwrap_or_else(|e| panic!("{e}"));
        assert!(loaded.warnings.iter().any(|w| w.path == "ai.backends.ocr.descriptor_set"), "{:?}", loaded.warnings);
    }
    let loaded = load_str(&config(&ocr(missing)), &env()).unwrap();
    let adapters = flexway::gateway::Adapters {
        budgets: Arc::new(flexway::budget::MemoryBudgetStore::new()),
        audit: Arc::new(flexway::audit::sinks::MemoryAuditSink::new()),
        export: flexway::telemetry::Export::Batched,
        cache: None,
    };
    let secrets = Arc::new(flexway::secret::LocalSecrets { env: env() });
    let Err(error) = flexway::Gateway::new(loaded.config, secrets, adapters).await else {
        panic!("a gateway started without its descriptor set")
    };
    let error = error.to_string();
    assert!(error.starts_with("ai.backends.ocr.descriptor_set: /nonexistent/ocr.binpb does not exist"), "{error}");
}
