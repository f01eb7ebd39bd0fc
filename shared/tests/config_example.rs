//! The example of SPEC.md §12 (`config/flexway.yaml`) is a contract: it loads as is
//! once its environment references are set, and says which ones are missing if not.
#![cfg(test)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use flexway::config::{
    Auth, BackendKind, BreakerTrigger, Capability, ConfigError, LedgerSync, Loaded, Metering, PoolMember, SecretRef,
    StoreConfig, load_file,
};
use flexway::money::MicroEur;

const ENV_VARS: [&str; 4] = ["PTU_WEST_KEY", "PAYG_WEST_KEY", "PAYG_NORTH_KEY", "FLEXWAY_AUDIT_SALT"];

fn example_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/flexway.yaml")
}

fn env_with(vars: &[&str]) -> HashMap<String, String> {
    vars.iter().map(|v| (v.to_string(), format!("value-of-{v}"))).collect()
}

fn load_example() -> Loaded {
    load_file(&example_path(), &env_with(&ENV_VARS)).unwrap_or_else(|e| panic!("the SPEC example must load:\n{e}"))
}

#[test]
fn spec_example_loads_with_its_environment() {
    let loaded = load_example();
    let config = &loaded.config;
    assert_eq!(config.store, StoreConfig::Embedded { path: "./flexway-ledger".into(), sync: LedgerSync::Interval });
    assert_eq!(config.audit.hash_salt, Some(SecretRef::Env("FLEXWAY_AUDIT_SALT".into())));
    assert_eq!(config.ai.default_backend.as_str(), "chat-pool");
    assert_eq!(config.ai.sensitive_backend.as_ref().unwrap().as_str(), "internal-chat");
    assert_eq!(config.ai.sensitive_header, "flexway-sensitive");
    assert_eq!(config.ai.vision.allowed_origins, vec!["https://img.example.com".to_string()]);
    assert_eq!(config.ai.budget.soft.as_ref().unwrap().threshold_ppm, 800_000);
    assert_eq!(config.ai.backends.len(), 10);
}

#[test]
fn spec_example_pool_lists_its_members_in_order() {
    let config = load_example().config;
    let pool = &config.ai.backends["chat-pool"];
    let BackendKind::Pool { members, .. } = &pool.kind else { panic!("chat-pool is a pool") };
    let member =
        |name: &str, priority, weight| PoolMember { backend: flexway::config::BackendId::new(name), priority, weight };
    assert_eq!(members, &vec![member("ptu-west", 1, 1), member("payg-west", 2, 3), member("payg-north", 2, 1)]);
    assert_eq!(pool.fallback[0].as_str(), "internal-chat");
    // A pool without a declaration serves what its members serve; it is external
    // because it was not declared otherwise (and its members are).
    assert!(pool.capabilities.contains(&Capability::Vision));
    assert!(pool.external);
}

#[test]
fn spec_example_prices_are_micro_euros_per_mtok() {
    let config = load_example().config;
    let price = |name: &str| config.ai.backends[name].price;
    assert_eq!(price("ptu-west").input_per_mtok, MicroEur(2_000_000));
    assert_eq!(price("ptu-west").output_per_mtok, MicroEur(8_000_000));
    assert_eq!(price("small-chat").input_per_mtok, MicroEur(150_000));
    assert_eq!(price("embedder").input_per_mtok, MicroEur(20_000));
    assert_eq!(price("embedder").output_per_mtok, MicroEur(0));
    let acme = &config.tenants["acme"];
    assert_eq!(acme.budgets.eur_per_month, Some(MicroEur(500_000_000)));
    assert_eq!(acme.budgets.tokens_per_day, Some(2_000_000));
}

#[test]
fn spec_example_backends_keep_their_settings() {
    let config = load_example().config;
    let ptu = &config.ai.backends["ptu-west"];
    let endpoint = ptu.kind.endpoint().unwrap();
    assert_eq!(endpoint.url, "https://ptu-west.example.net/v1");
    assert_eq!(endpoint.auth, Auth::Bearer { secret: SecretRef::Env("PTU_WEST_KEY".into()) });
    assert_eq!(endpoint.served_model("chat-default"), "gpt-4.1");
    assert_eq!(ptu.circuit_breaker.trigger, BreakerTrigger::Failures(3));
    assert_eq!(ptu.circuit_breaker.trip, Duration::from_secs(3600));
    assert!(ptu.circuit_breaker.accept_retry_after);

    let payg = config.ai.backends["payg-west"].kind.endpoint().unwrap();
    assert_eq!(payg.auth, Auth::Header { name: "api-key".into(), secret: SecretRef::Env("PAYG_WEST_KEY".into()) });

    let BackendKind::Relay { metering, identity_headers, endpoint } = &config.ai.backends["upstream-gw"].kind else {
        panic!("upstream-gw is a relay")
    };
    assert_eq!(*metering, Metering::Upstream);
    assert_eq!(identity_headers.tenant.as_deref(), Some("flexway-tenant"));
    assert_eq!(endpoint.auth, Auth::TokenFile { path: "/var/run/secrets/flexway/token".into() });

    assert!(!config.ai.backends["internal-chat"].external);
    assert!(matches!(config.ai.backends["ocr"].kind, BackendKind::Grpc { .. }));

    let acme = &config.tenants["acme"];
    assert_eq!(acme.keys.len(), 3);
    assert_eq!(acme.keys[1].agent.as_ref().unwrap().as_str(), "support-bot");
    assert!(acme.keys[2].relay_peer);
    assert_eq!(acme.agents["support-bot"].budgets.tokens_per_day, Some(100_000));
}

#[test]
fn spec_example_warnings_are_only_the_expected_ones() {
    let loaded = load_example();
    // The example's relay says `metering: upstream`: no double-count warning.
    assert!(!loaded.warnings.iter().any(|w| w.message.contains("metered locally")), "{:?}", loaded.warnings);
    // Tests run in shared/, where config/ocr.binpb is absent: the gRPC backend loads
    // with a warning instead of an error.
    if !Path::new("config/ocr.binpb").exists() {
        assert!(loaded.warnings.iter().any(|w| w.path == "ai.backends.ocr.descriptor_set"), "{:?}", loaded.warnings);
    }
}

#[test]
fn spec_example_relay_metered_locally_is_warned_about() {
    let text = std::fs::read_to_string(example_path()).unwrap();
    let text = text.replace("metering: upstream", "metering: local");
    let loaded = flexway::config::load_str(&text, &env_with(&ENV_VARS)).unwrap();
    let warning =
        loaded.warnings.iter().find(|w| w.message.contains("metered locally")).expect("a warning about the relay");
    assert_eq!(warning.path, "ai.backends.upstream-gw");
    assert!(warning.message.contains("relay upstream-gw is metered locally (metering: local)"));
    assert!(warning.message.contains("set metering: upstream"));
}

#[test]
fn spec_example_without_environment_lists_each_missing_variable() {
    let error: ConfigError = load_file(&example_path(), &HashMap::new()).unwrap_err();
    assert_eq!(error.file.as_deref(), Some(example_path().as_path()));
    let expected = [
        ("audit.hash_salt", "FLEXWAY_AUDIT_SALT"),
        ("ai.backends.ptu-west.auth.secret", "PTU_WEST_KEY"),
        ("ai.backends.payg-west.auth.secret", "PAYG_WEST_KEY"),
        ("ai.backends.payg-north.auth.secret", "PAYG_NORTH_KEY"),
    ];
    assert_eq!(error.errors.len(), expected.len(), "{error}");
    for (path, var) in expected {
        let found = error.errors.iter().find(|d| d.path == path).unwrap_or_else(|| {
            panic!("no error at {path}:\n{error}");
        });
        assert_eq!(found.message, format!("environment variable {var} is not set"));
    }
    let rendered = error.to_string();
    assert_eq!(rendered.lines().count(), expected.len());
    assert!(rendered.lines().all(|l| l.starts_with(&example_path().display().to_string())));
}

#[test]
fn spec_example_with_one_variable_missing_names_only_that_one() {
    let env = env_with(&["PTU_WEST_KEY", "PAYG_NORTH_KEY", "FLEXWAY_AUDIT_SALT"]);
    let error = load_file(&example_path(), &env).unwrap_err();
    assert_eq!(error.errors.len(), 1, "{error}");
    assert_eq!(error.errors[0].path, "ai.backends.payg-west.auth.secret");
    assert_eq!(error.errors[0].message, "environment variable PAYG_WEST_KEY is not set");
}

#[test]
fn unreadable_file_is_an_error_naming_the_file() {
    let missing = Path::new("/nonexistent/flexway.yaml");
    let error = load_file(missing, &HashMap::new()).unwrap_err();
    assert_eq!(error.file.as_deref(), Some(missing));
    assert_eq!(error.errors.len(), 1);
    assert!(error.to_string().starts_with("/nonexistent/flexway.yaml: cannot read the file"));
}
