//! Every load-time refusal of the configuration, one behaviour per test.
//!
//! Each test starts from a small valid document (`doc()`), changes one thing with
//! `.set(path, yaml)` / `.remove(path)`, and checks where the error is reported and
//! what it says.
#![cfg(test)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use flexway::config::{
    AgentId, AuditSinkConfig, Auth, BackendKind, BreakerTrigger, Capability, Criticality, Diagnostic, FailureMode,
    LedgerSync, Loaded, Metering, Pick, Saturation, SecretRef, Secrets, StoreConfig, UsageApiKind, load_str,
    load_str_with, parse_duration,
};
use flexway::money::MicroEur;
use serde_norway::Value;

const KEY_A: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
const KEY_B: &str = "60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752";

const BASE: &str = r#"
version: 1
tenants:
  acme:
    keys:
      - sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
    agents:
      bot: {}
ai:
  default_backend: main
  backends:
    main:
      url: https://main.example.net/v1
      price: {input_per_mtok_eur: 1, output_per_mtok_eur: 2}
    internal:
      url: http://10.0.0.5:8000/v1
      external: false
      price: {input_per_mtok_eur: 0.1, output_per_mtok_eur: 0.1}
"#;

/// A small valid configuration to tweak.
struct Doc(Value);

fn doc() -> Doc {
    Doc(serde_norway::from_str(BASE).unwrap())
}

fn yaml(text: &str) -> Value {
    serde_norway::from_str(text).unwrap()
}

impl Doc {
    /// Sets the value at a dotted path (`ai.backends.main.auth`), creating mappings.
    fn set(mut self, path: &str, value: &str) -> Doc {
        let (parents, last) = path.rsplit_once('.').map_or(("", path), |(p, l)| (p, l));
        let mut node = &mut self.0;
        for key in parents.split('.').filter(|k| !k.is_empty()) {
            let map = node.as_mapping_mut().unwrap_or_else(|| panic!("{key}: not a mapping"));
            if !map.contains_key(key) {
                map.insert(key.into(), Value::Mapping(Default::default()));
            }
            node = map.get_mut(key).unwrap();
        }
        node.as_mapping_mut().unwrap().insert(last.into(), yaml(value));
        self
    }

    fn remove(mut self, path: &str) -> Doc {
        let (parents, last) = path.rsplit_once('.').map_or(("", path), |(p, l)| (p, l));
        let mut node = &mut self.0;
        for key in parents.split('.').filter(|k| !k.is_empty()) {
            node = node.get_mut(key).unwrap();
        }
        node.as_mapping_mut().unwrap().remove(last).unwrap();
        self
    }

    fn text(&self) -> String {
        serde_norway::to_string(&self.0).unwrap()
    }

    fn load(&self) -> Result<Loaded, Vec<Diagnostic>> {
        load_str(&self.text(), &env()).map_err(|e| e.errors)
    }

    fn loads(&self) -> Loaded {
        self.load().unwrap_or_else(|errors| panic!("should load, got {errors:#?}"))
    }

    /// Loads with secret references checked for their form only (`flexway validate`).
    fn checks(&self) -> Loaded {
        load_str_with(&self.text(), &env(), Secrets::Check).unwrap_or_else(|e| panic!("should load, got {e}"))
    }

    fn errors(&self) -> Vec<Diagnostic> {
        match self.load() {
            Ok(_) => panic!("should be refused:\n{}", self.text()),
            Err(errors) => errors,
        }
    }

    /// Asserts the document is refused with exactly one error, at `path`, whose
    /// message contains `fragment`; answers the message.
    fn refused(&self, path: &str, fragment: &str) -> String {
        let errors = self.errors();
        assert_eq!(errors.len(), 1, "expected one error at {path}, got {errors:#?}");
        assert_error(&errors, path, fragment)
    }
}

fn assert_error(errors: &[Diagnostic], path: &str, fragment: &str) -> String {
    let found = errors.iter().find(|e| e.path == path).unwrap_or_else(|| panic!("no error at {path}: {errors:#?}"));
    assert!(found.message.contains(fragment), "{path}: `{}` lacks `{fragment}`", found.message);
    // One line of prose: a string literal broken across source lines without `\`
    // carries the next line's indentation into the message.
    assert!(!found.message.contains("  "), "{path}: a run of spaces in `{}`", found.message);
    found.message.clone()
}

fn env() -> HashMap<String, String> {
    HashMap::from([
        ("BACKEND_KEY".to_string(), "not-shown".to_string()),
        ("CA_PEM".to_string(), "-----BEGIN CERTIFICATE-----".to_string()),
        ("SALT".to_string(), "pepper".to_string()),
        ("EMPTY".to_string(), String::new()),
    ])
}

/// Warnings besides the one about an absent `audit.hash_salt`, which `BASE` lacks.
fn other_warnings(loaded: &Loaded) -> Vec<&Diagnostic> {
    loaded.warnings.iter().filter(|w| w.path != "audit.hash_salt").collect()
}

/// A file in the temp dir, unique to this test process.
fn temp_file(name: &str, contents: &[u8]) -> PathBuf {
    let path = std::env::temp_dir().join(format!("flexway-config-{}-{name}", std::process::id()));
    std::fs::write(&path, contents).unwrap();
    path
}

fn grpc_backend() -> &'static str {
    "{kind: grpc, url: 'http://10.0.0.9:50051', descriptor_set: /nonexistent/ocr.binpb, \
     external: false}"
}

// ----- the whole document ---------------------------------------------------------

#[test]
fn accepts_minimal_config_with_defaults() {
    let loaded = doc().loads();
    let config = &loaded.config;
    assert_eq!(config.store, StoreConfig::Embedded { path: "./flexway-ledger".into(), sync: LedgerSync::Interval });
    assert_eq!(config.audit.sink, AuditSinkConfig::Stdout);
    assert_eq!(config.audit.hash_salt, None);
    assert_eq!(config.ai.sensitive_header, "flexway-sensitive");
    assert_eq!(config.ai.budget.default_max_tokens, 4096);
    assert_eq!(config.ai.budget.min_completion_tokens, 16);
    assert!(config.ai.budget.soft.is_none());
    assert_eq!(config.ai.vision.max_image_bytes, 8_388_608);
    assert_eq!(config.ai.vision.max_body_bytes, 25_165_824);
    let main = &config.ai.backends["main"];
    assert!(matches!(main.kind, BackendKind::OpenAi(_)));
    assert!(main.external);
    assert_eq!(main.capabilities.iter().copied().collect::<Vec<_>>(), vec![Capability::Chat]);
    assert_eq!(main.timeout, Duration::from_secs(60));
    assert_eq!(main.circuit_breaker, Default::default());
    assert_eq!(main.kind.endpoint().unwrap().auth, Auth::None);
    assert_eq!(main.price.input_per_mtok, MicroEur(1_000_000));
    let key = &config.tenants["acme"].keys[0];
    assert_eq!(hex::encode(key.sha256), KEY_A);
    assert!(!key.relay_peer);
    // The one warning: identifiers in the audit are hashed without a salt.
    assert_eq!(loaded.warnings.len(), 1, "{:?}", loaded.warnings);
    assert_eq!(loaded.warnings[0].path, "audit.hash_salt");
}

#[test]
fn refuses_missing_version() {
    doc().remove("version").refused("version", "required");
}

#[test]
fn refuses_unsupported_version() {
    doc().set("version", "2").refused("version", "unsupported version 2");
}

#[test]
fn refuses_unknown_top_level_key_with_its_path() {
    doc().set("colour", "blue").refused("colour", "unknown field `colour`");
}

#[test]
fn refuses_unknown_nested_key_with_its_path() {
    // The misspelt key is also a missing one, and both are said.
    let errors = doc().set("ai.backends.main.auth", "{type: bearer, secrett: 'env:BACKEND_KEY'}").errors();
    assert_eq!(errors.len(), 2, "{errors:#?}");
    let message = assert_error(&errors, "ai.backends.main.auth.secrett", "unknown field `secrett`");
    assert!(message.contains("expected one of"), "{message}");
    assert_error(&errors, "ai.backends.main.auth.secret", "required");
}

#[test]
fn refuses_a_value_of_the_wrong_type_with_its_path() {
    doc()
        .set("ai.backends.main.external", "maybe")
        .refused("ai.backends.main.external", "invalid type: string \"maybe\", expected a boolean");
}

#[test]
fn reports_every_shape_error_at_once() {
    let errors = doc()
        .set("colour", "blue")
        .set("store", "{kind: floppy}")
        .set("tenants.acme.budgets", "{tokens_per_day: -5}")
        .set("ai.backends.main.auth", "{type: bearer, secrett: x}")
        .set("ai.backends.main.timeout", "[1]")
        .set("ai.backends.internal.capabilities", "[chat, telepathy]")
        .errors();
    assert_eq!(errors.len(), 6, "{errors:#?}");
    assert_error(&errors, "colour", "unknown field");
    assert_error(&errors, "store.kind", "unknown variant `floppy`");
    assert_error(&errors, "tenants.acme.budgets.tokens_per_day", "-5");
    assert_error(&errors, "ai.backends.main.auth.secrett", "unknown field");
    assert_error(&errors, "ai.backends.main.timeout", "expected a duration");
    assert_error(&errors, "ai.backends.internal.capabilities[1]", "unknown variant `telepathy`");
}

#[test]
fn reports_every_rule_error_at_once() {
    let errors = doc()
        .set("version", "3")
        .set("ai.default_backend", "nowhere")
        .set("ai.sensitive_backend", "main")
        .set("ai.backends.main.timeout", "10")
        .set("ai.backends.internal.fallback", "[internal]")
        .set("tenants.acme.backend", "ghost")
        .errors();
    assert_eq!(errors.len(), 6, "{errors:#?}");
    assert_error(&errors, "version", "unsupported");
    assert_error(&errors, "ai.default_backend", "not declared");
    assert_error(&errors, "ai.sensitive_backend", "external");
    assert_error(&errors, "ai.backends.main.timeout", "no unit");
    assert_error(&errors, "ai.backends.internal.fallback[0]", "itself");
    assert_error(&errors, "tenants.acme.backend", "not declared");
}

#[test]
fn refuses_yaml_syntax_error_with_its_line() {
    let error = load_str("version: 1\nai: [oops\n", &env()).unwrap_err();
    assert_eq!(error.errors.len(), 1);
    assert_eq!(error.errors[0].path, "");
    assert!(error.errors[0].message.contains("line"), "{}", error.errors[0].message);
}

#[test]
fn refuses_duplicate_yaml_key() {
    let error = load_str("version: 1\nversion: 1\n", &env()).unwrap_err();
    assert!(error.errors[0].message.contains("duplicate"), "{error}");
}

#[test]
fn refuses_empty_document() {
    let error = load_str("# nothing\n", &env()).unwrap_err();
    assert!(error.errors[0].message.contains("empty"), "{error}");
}

#[test]
fn error_display_is_one_line_per_error() {
    let error = load_str(&doc().set("version", "2").set("ai.default_backend", "x").text(), &env()).unwrap_err();
    let rendered = error.to_string();
    assert_eq!(rendered.lines().count(), 2, "{rendered}");
    assert!(rendered.starts_with("version: unsupported version 2"), "{rendered}");
}

// ----- store and audit ------------------------------------------------------------

#[test]
fn accepts_each_store_kind() {
    let store = |yaml: &str| doc().set("store", yaml).loads().config.store;
    assert_eq!(store("{kind: memory}"), StoreConfig::Memory);
    assert_eq!(store("{kind: dynamodb, table: ledger}"), StoreConfig::DynamoDb { table: "ledger".into() });
    assert_eq!(
        store("{kind: embedded, path: /var/lib/fw}"),
        StoreConfig::Embedded { path: "/var/lib/fw".into(), sync: LedgerSync::Interval }
    );
}

#[test]
fn refuses_store_without_kind() {
    doc().set("store", "{path: ./x}").refused("store.kind", "required");
}

#[test]
fn refuses_embedded_store_without_path() {
    doc().set("store", "{kind: embedded}").refused("store.path", "required");
}

#[test]
fn refuses_dynamodb_store_without_table() {
    doc().set("store", "{kind: dynamodb}").refused("store.table", "required");
}

#[test]
fn refuses_store_key_of_another_kind() {
    doc().set("store", "{kind: memory, table: ledger}").refused("store.table", "does not apply to store kind memory");
}

#[test]
fn an_embedded_store_syncs_at_an_interval_unless_told_per_reservation() {
    let store = |yaml: &str| doc().set("store", yaml).loads().config.store;
    let embedded = |sync| StoreConfig::Embedded { path: "./l".into(), sync };
    assert_eq!(store("{kind: embedded, path: ./l}"), embedded(LedgerSync::Interval));
    assert_eq!(store("{kind: embedded, path: ./l, sync: interval}"), embedded(LedgerSync::Interval));
    assert_eq!(store("{kind: embedded, path: ./l, sync: reservation}"), embedded(LedgerSync::Reservation));
}

#[test]
fn refuses_store_sync_of_another_kind_or_unknown() {
    doc().set("store", "{kind: memory, sync: interval}").refused("store.sync", "does not apply to store kind memory");
    doc()
        .set("store", "{kind: dynamodb, table: ledger, sync: reservation}")
        .refused("store.sync", "does not apply to store kind dynamodb");
    doc().set("store", "{kind: embedded, path: ./l, sync: always}").refused("store.sync", "unknown variant `always`");
}

#[test]
fn accepts_each_audit_sink() {
    let sink = |yaml: &str| doc().set("audit", yaml).loads().config.audit.sink;
    assert_eq!(sink("{sink: file, path: ./a.jsonl}"), AuditSinkConfig::File { path: "./a.jsonl".into() });
    assert_eq!(
        sink("{sink: cloudwatch, log_group: /fw}"),
        AuditSinkConfig::CloudWatch { log_group: "/fw".into(), log_stream: None }
    );
    assert_eq!(sink("{hash_salt: 'env:SALT'}"), AuditSinkConfig::Stdout);
}

#[test]
fn refuses_file_audit_without_path() {
    doc().set("audit", "{sink: file}").refused("audit.path", "required");
}

#[test]
fn refuses_cloudwatch_audit_without_log_group() {
    doc().set("audit", "{sink: cloudwatch}").refused("audit.log_group", "required");
}

#[test]
fn refuses_audit_key_of_another_sink() {
    doc()
        .set("audit", "{sink: stdout, log_group: /fw}")
        .refused("audit.log_group", "does not apply to audit sink stdout");
}

#[test]
fn warns_that_audit_identifiers_are_unsalted_without_hash_salt() {
    for audit in ["{sink: file, path: ./a.jsonl}", "{sink: stdout}"] {
        let loaded = doc().set("audit", audit).loads();
        let salt: Vec<_> = loaded.warnings.iter().filter(|w| w.path == "audit.hash_salt").collect();
        assert_eq!(salt.len(), 1, "{audit}: {:?}", loaded.warnings);
        assert!(salt[0].message.contains("without a salt"), "{}", salt[0].message);
    }
    let salted = doc().set("audit", "{sink: stdout, hash_salt: 'env:SALT'}").loads();
    assert!(salted.warnings.is_empty(), "{:?}", salted.warnings);
}

#[test]
fn refuses_literal_hash_salt() {
    doc().set("audit", "{hash_salt: pepper-in-clear}").refused("audit.hash_salt", "secrets are references");
}

// ----- secret references ----------------------------------------------------------

#[test]
fn refuses_literal_secret_without_echoing_it() {
    let message = doc()
        .set("ai.backends.main.auth", "{type: bearer, secret: sk-live-TOPSECRET}")
        .refused("ai.backends.main.auth.secret", "secrets are references");
    assert!(!message.contains("TOPSECRET"), "{message}");
    assert!(message.contains("env:NAME"), "{message}");
}

#[test]
fn refuses_non_string_secret_without_echoing_it() {
    let message = doc()
        .set("ai.backends.main.auth", "{type: bearer, secret: 918273645}")
        .refused("ai.backends.main.auth.secret", "secret reference");
    assert!(!message.contains("918273645"), "{message}");
}

#[test]
fn refuses_url_with_credentials_without_echoing_them() {
    let message = doc()
        .set("ai.backends.main.url", "https://user:hunter2@main.example.net/v1")
        .refused("ai.backends.main.url", "credentials");
    assert!(!message.contains("hunter2"), "{message}");
}

#[test]
fn refuses_unset_environment_variable() {
    doc()
        .set("ai.backends.main.auth", "{type: bearer, secret: 'env:NOT_THERE'}")
        .refused("ai.backends.main.auth.secret", "environment variable NOT_THERE is not set");
}

#[test]
fn refuses_empty_environment_variable() {
    doc()
        .set("ai.backends.main.auth", "{type: bearer, secret: 'env:EMPTY'}")
        .refused("ai.backends.main.auth.secret", "EMPTY is empty");
}

#[test]
fn refuses_env_reference_without_a_name() {
    doc()
        .set("ai.backends.main.auth", "{type: bearer, secret: 'env:'}")
        .refused("ai.backends.main.auth.secret", "variable name");
}

#[test]
fn refuses_missing_secret_file() {
    doc()
        .set("ai.backends.main.auth", "{type: bearer, secret: 'file:/nonexistent/key'}")
        .refused("ai.backends.main.auth.secret", "/nonexistent/key cannot be read");
}

#[test]
fn accepts_readable_secret_file() {
    let file = temp_file("secret", b"s3cr3t\n");
    let loaded =
        doc().set("ai.backends.main.auth", &format!("{{type: bearer, secret: 'file:{}'}}", file.display())).loads();
    let auth = &loaded.config.ai.backends["main"].kind.endpoint().unwrap().auth;
    assert_eq!(auth, &Auth::Bearer { secret: SecretRef::File(file) });
}

const ARNS: [&str; 3] = [
    "arn:aws:secretsmanager:eu-west-1:123456789012:secret:ptu-AbCdEf",
    "arn:aws:ssm:eu-west-1:123456789012:parameter/flexway/ptu",
    "arn:aws-cn:ssm:cn-north-1:123456789012:parameter/x",
];

/// Loading makes no network call: an ARN is checked for its form, and the gateway's
/// secret source resolves it at start (as `flexway validate --resolve-secrets` does).
#[test]
fn takes_secrets_manager_and_ssm_arns_checked_for_form_only() {
    for arn in ARNS {
        for loaded in [
            doc().set("ai.backends.main.auth", &format!("{{type: bearer, secret: '{arn}'}}")).loads(),
            doc().set("ai.backends.main.auth", &format!("{{type: bearer, secret: '{arn}'}}")).checks(),
        ] {
            let auth = &loaded.config.ai.backends["main"].kind.endpoint().unwrap().auth;
            assert_eq!(auth, &Auth::Bearer { secret: SecretRef::AwsArn(arn.into()) });
            assert!(other_warnings(&loaded).is_empty(), "{:#?}", loaded.warnings);
        }
    }
}

#[test]
fn secret_references_are_listed_with_their_paths() {
    let loaded = doc()
        .set("ai.backends.main.auth", &format!("{{type: bearer, secret: '{}'}}", ARNS[0]))
        .set("ai.backends.main.tls", "{cert: 'env:BACKEND_KEY', key: 'env:BACKEND_KEY'}")
        .set("audit", "{sink: stdout, hash_salt: 'env:SALT'}")
        .loads();
    let listed: Vec<(String, String)> =
        loaded.config.secret_references().into_iter().map(|(path, r)| (path, r.to_string())).collect();
    for expected in [
        ("audit.hash_salt", "env:SALT"),
        ("ai.backends.main.auth.secret", ARNS[0]),
        ("ai.backends.main.tls.cert", "env:BACKEND_KEY"),
        ("ai.backends.main.tls.key", "env:BACKEND_KEY"),
    ] {
        assert!(listed.contains(&(expected.0.to_owned(), expected.1.to_owned())), "{expected:?} not in {listed:#?}");
    }
    let refreshed = loaded.config.ai.secret_references();
    assert!(refreshed.iter().all(|(path, _)| path != "audit.hash_salt"), "the salt is never refreshed");
}

#[test]
fn secrets_refresh_defaults_to_five_minutes_and_takes_a_duration() {
    assert_eq!(doc().loads().config.secrets.refresh, Duration::from_secs(300));
    assert_eq!(doc().set("secrets", "{refresh: 1s}").loads().config.secrets.refresh, Duration::from_secs(1));
    doc().set("secrets", "{refresh: 0s}").refused("secrets.refresh", "longer than zero");
    doc().set("secrets", "{refresh: 10}").refused("secrets.refresh", "no unit");
    doc().set("secrets", "{every: 1m}").refused("secrets.every", "unknown");
}

#[test]
fn refuses_arn_of_another_service() {
    doc()
        .set("ai.backends.main.auth", "{type: bearer, secret: 'arn:aws:s3:::bucket/key'}")
        .refused("ai.backends.main.auth.secret", "Secrets Manager secret or an SSM parameter");
}

// ----- tenants --------------------------------------------------------------------

#[test]
fn refuses_key_hash_that_is_not_64_hex_digits() {
    doc()
        .set("tenants.acme.keys", "[{sha256: sk-flexway-plaintext-key}]")
        .refused("tenants.acme.keys[0].sha256", "64 hex digits");
    doc()
        .set("tenants.acme.keys", &format!("[{{sha256: {}}}]", "z".repeat(64)))
        .refused("tenants.acme.keys[0].sha256", "64 hex digits");
}

#[test]
fn accepts_upper_case_key_hash() {
    let loaded = doc().set("tenants.acme.keys", &format!("[{{sha256: {}}}]", KEY_A.to_uppercase())).loads();
    assert_eq!(hex::encode(loaded.config.tenants["acme"].keys[0].sha256), KEY_A);
}

#[test]
fn refuses_key_without_hash() {
    doc().set("tenants.acme.keys", "[{agent: bot}]").refused("tenants.acme.keys[0].sha256", "required");
}

#[test]
fn refuses_same_key_twice_in_the_config() {
    let message = doc()
        .set("tenants.other.keys", &format!("[{{sha256: {B}}}, {{sha256: {A}}}]", A = KEY_A, B = KEY_B))
        .refused("tenants.other.keys[1].sha256", "already declared");
    assert!(message.contains("tenants.acme.keys[0]"), "{message}");
}

#[test]
fn refuses_key_bound_to_undeclared_agent() {
    doc()
        .set("tenants.acme.keys", &format!("[{{sha256: {KEY_A}}}, {{sha256: {KEY_B}, agent: ghost}}]"))
        .refused("tenants.acme.keys[1].agent", "agent `ghost` is not declared");
}

#[test]
fn binds_key_to_declared_agent_and_relay_peer() {
    let loaded = doc()
        .set("tenants.acme.keys", &format!("[{{sha256: {KEY_A}, agent: bot}}, {{sha256: {KEY_B}, relay_peer: true}}]"))
        .loads();
    let keys = &loaded.config.tenants["acme"].keys;
    assert_eq!(keys[0].agent.as_ref().unwrap().as_str(), "bot");
    assert!(keys[1].relay_peer);
}

#[test]
fn refuses_negative_token_budget() {
    doc()
        .set("tenants.acme.budgets", "{tokens_per_day: -1}")
        .refused("tenants.acme.budgets.tokens_per_day", "expected u64");
}

#[test]
fn refuses_fractional_token_budget() {
    doc()
        .set("tenants.acme.budgets", "{tokens_per_month: 1.5}")
        .refused("tenants.acme.budgets.tokens_per_month", "expected u64");
}

#[test]
fn refuses_negative_euro_budget() {
    doc()
        .set("tenants.acme.agents.bot", "{budgets: {eur_per_month: -3}}")
        .refused("tenants.acme.agents.bot.budgets.eur_per_month", "must not be negative");
}

#[test]
fn refuses_euro_budget_finer_than_a_micro_euro() {
    doc()
        .set("tenants.acme.budgets", "{eur_per_month: 0.0000001}")
        .refused("tenants.acme.budgets.eur_per_month", "more than 6 decimal places");
}

#[test]
fn reads_euro_budget_as_micro_euros() {
    let loaded = doc().set("tenants.acme.budgets", "{eur_per_month: 12.345678}").loads();
    assert_eq!(loaded.config.tenants["acme"].budgets.eur_per_month, Some(MicroEur(12_345_678)));
}

#[test]
fn refuses_undeclared_tenant_backend() {
    doc()
        .set("tenants.acme.backend", "ghost")
        .refused("tenants.acme.backend", "backend `ghost` is not declared under ai.backends");
}

#[test]
fn refuses_undeclared_agent_backend() {
    doc().set("tenants.acme.agents.bot", "{backend: ghost}").refused("tenants.acme.agents.bot.backend", "not declared");
}

#[test]
fn warns_about_tenant_without_keys() {
    let loaded = doc().set("tenants.lonely", "{}").loads();
    assert!(
        loaded.warnings.iter().any(|w| w.path == "tenants.lonely" && w.message.contains("no keys")),
        "{:?}",
        loaded.warnings
    );
}

// ----- ai -------------------------------------------------------------------------

#[test]
fn refuses_missing_default_backend() {
    doc().remove("ai.default_backend").refused("ai.default_backend", "required");
}

#[test]
fn refuses_undeclared_default_backend() {
    doc().set("ai.default_backend", "ghost").refused("ai.default_backend", "not declared");
}

#[test]
fn refuses_vision_backend_without_vision() {
    doc()
        .set("ai.capabilities", "{vision: main}")
        .refused("ai.capabilities.vision", "does not serve vision (its capabilities: chat)");
}

#[test]
fn refuses_undeclared_embeddings_backend() {
    doc().set("ai.capabilities", "{embeddings: ghost}").refused("ai.capabilities.embeddings", "not declared");
}

#[test]
fn accepts_capability_backends_that_serve_them() {
    let loaded = doc()
        .set("ai.backends.main.capabilities", "[chat, vision]")
        .set("ai.backends.internal.capabilities", "[embeddings]")
        .set("ai.capabilities", "{vision: main, embeddings: internal}")
        .loads();
    assert_eq!(loaded.config.ai.capabilities.vision.unwrap().as_str(), "main");
}

#[test]
fn refuses_invalid_sensitive_header() {
    doc()
        .set("ai.sensitive_header", "'Flexway Sensitive'")
        .refused("ai.sensitive_header", "not a valid HTTP header name");
}

#[test]
fn stores_sensitive_header_lower_case() {
    let loaded = doc().set("ai.sensitive_header", "X-Private").loads();
    assert_eq!(loaded.config.ai.sensitive_header, "x-private");
}

#[test]
fn refuses_external_sensitive_backend() {
    doc().set("ai.sensitive_backend", "main").refused("ai.sensitive_backend", "sensitive_backend main is external");
}

#[test]
fn refuses_pool_with_an_external_member_as_sensitive_backend() {
    doc()
        .set("ai.backends.pool", "{kind: pool, members: [{backend: internal}, {backend: main}]}")
        .set("ai.sensitive_backend", "pool")
        .refused("ai.sensitive_backend", "sensitive_backend pool is external");
}

#[test]
fn accepts_internal_pool_as_sensitive_backend() {
    let loaded = doc()
        .set(
            "ai.backends.internal2",
            "{url: 'http://10.0.0.6/v1', external: false, \
             price: {input_per_mtok_eur: 0, output_per_mtok_eur: 0}}",
        )
        .set("ai.backends.pool", "{kind: pool, external: false, members: [{backend: internal}, {backend: internal2}]}")
        .set("ai.sensitive_backend", "pool")
        .loads();
    assert!(!loaded.config.ai.backends["pool"].external);
}

#[test]
fn refuses_soft_threshold_outside_zero_to_one() {
    for threshold in ["0", "1.5", "-0.2"] {
        doc()
            .set("ai.budget.soft", &format!("{{threshold: {threshold}, backend: internal}}"))
            .refused("ai.budget.soft.threshold", "greater than 0 and at most 1");
    }
}

#[test]
fn refuses_undeclared_soft_backend() {
    doc().set("ai.budget.soft", "{threshold: 0.8, backend: ghost}").refused("ai.budget.soft.backend", "not declared");
}

#[test]
fn refuses_soft_cap_without_backend() {
    doc().set("ai.budget.soft", "{threshold: 0.8}").refused("ai.budget.soft.backend", "required");
}

#[test]
fn reads_soft_threshold_in_ppm() {
    let loaded = doc().set("ai.budget.soft", "{threshold: 0.8, backend: internal}").loads();
    assert_eq!(loaded.config.ai.budget.soft.unwrap().threshold_ppm, 800_000);
}

#[test]
fn refuses_zero_default_max_tokens() {
    // min_completion_tokens (16 by default) then exceeds it too.
    let errors = doc().set("ai.budget.default_max_tokens", "0").errors();
    assert_error(&errors, "ai.budget.default_max_tokens", "greater than zero");
}

#[test]
fn refuses_min_completion_tokens_above_default_max_tokens() {
    doc()
        .set("ai.budget", "{default_max_tokens: 100, min_completion_tokens: 200}")
        .refused("ai.budget.min_completion_tokens", "more than default_max_tokens (100)");
}

#[test]
fn refuses_image_limit_above_body_limit() {
    doc()
        .set("ai.vision", "{max_image_bytes: 2000, max_body_bytes: 1000}")
        .refused("ai.vision.max_image_bytes", "more than max_body_bytes");
}

#[test]
fn refuses_http_image_origin() {
    doc()
        .set("ai.vision.allowed_origins", "['http://img.example.com']")
        .refused("ai.vision.allowed_origins[0]", "not https");
}

#[test]
fn refuses_image_origin_with_a_path() {
    doc()
        .set("ai.vision.allowed_origins", "['https://ok.example.com', 'https://img.example.com/cats']")
        .refused("ai.vision.allowed_origins[1]", "without path");
}

#[test]
fn normalises_image_origins() {
    let loaded =
        doc().set("ai.vision.allowed_origins", "['HTTPS://Img.Example.com/', 'https://cdn.example.com:8443']").loads();
    assert_eq!(
        loaded.config.ai.vision.allowed_origins,
        vec!["https://img.example.com".to_string(), "https://cdn.example.com:8443".to_string()]
    );
}

// ----- backends -------------------------------------------------------------------

#[test]
fn refuses_unknown_backend_kind() {
    doc().set("ai.backends.main.kind", "bedrock").refused("ai.backends.main.kind", "unknown variant `bedrock`");
}

#[test]
fn refuses_backend_without_url() {
    doc().remove("ai.backends.main.url").refused("ai.backends.main.url", "required for an openai backend");
}

#[test]
fn refuses_invalid_url() {
    doc().set("ai.backends.main.url", "'not a url'").refused("ai.backends.main.url", "not a URL");
    doc()
        .set("ai.backends.main.url", "'ftp://files.example.net'")
        .refused("ai.backends.main.url", "use http:// or https://");
}

#[test]
fn strips_trailing_slash_from_url() {
    let loaded = doc().set("ai.backends.main.url", "https://main.example.net/v1/").loads();
    let endpoint = loaded.config.ai.backends["main"].kind.endpoint().unwrap().clone();
    assert_eq!(endpoint.url, "https://main.example.net/v1");
}

#[test]
fn refuses_grpc_url_on_an_http_backend() {
    doc()
        .set("ai.backends.main.url", "grpc://10.0.0.9:50051")
        .refused("ai.backends.main.url", "a gRPC upstream must be declared kind: grpc");
}

#[test]
fn refuses_auth_without_type() {
    doc().set("ai.backends.main.auth", "{secret: 'env:BACKEND_KEY'}").refused("ai.backends.main.auth.type", "required");
}

#[test]
fn refuses_bearer_auth_without_secret() {
    doc()
        .set("ai.backends.main.auth", "{type: bearer}")
        .refused("ai.backends.main.auth.secret", "required (with auth type bearer)");
}

#[test]
fn refuses_header_auth_without_name() {
    doc()
        .set("ai.backends.main.auth", "{type: header, secret: 'env:BACKEND_KEY'}")
        .refused("ai.backends.main.auth.name", "required");
}

#[test]
fn refuses_header_auth_with_invalid_name() {
    doc()
        .set("ai.backends.main.auth", "{type: header, name: 'api key', secret: 'env:BACKEND_KEY'}")
        .refused("ai.backends.main.auth.name", "not a valid HTTP header name");
}

#[test]
fn refuses_auth_key_of_another_type() {
    doc()
        .set("ai.backends.main.auth", "{type: none, secret: 'env:BACKEND_KEY'}")
        .refused("ai.backends.main.auth.secret", "does not apply to auth type none");
    doc()
        .set("ai.backends.main.auth", "{type: bearer, secret: 'env:BACKEND_KEY', path: /tok}")
        .refused("ai.backends.main.auth.path", "belongs to type token_file");
}

#[test]
fn accepts_token_file_that_does_not_exist_yet() {
    let loaded = doc().set("ai.backends.main.auth", "{type: token_file, path: /var/run/secrets/nope/token}").loads();
    let auth = &loaded.config.ai.backends["main"].kind.endpoint().unwrap().auth;
    assert_eq!(auth, &Auth::TokenFile { path: "/var/run/secrets/nope/token".into() });
}

#[test]
fn refuses_tls_certificate_without_key() {
    let cert = temp_file("cert.pem", b"cert");
    doc()
        .set("ai.backends.main.tls", &format!("{{cert: 'file:{}'}}", cert.display()))
        .refused("ai.backends.main.tls.key", "required");
}

#[test]
fn refuses_tls_towards_a_plain_http_url() {
    let cert = temp_file("plain-cert.pem", b"cert");
    doc()
        .set("ai.backends.main.url", "http://10.0.0.7/v1")
        .set("ai.backends.main.tls", &format!("{{cert: 'file:{0}', key: 'file:{0}'}}", cert.display()))
        .refused("ai.backends.main.tls", "http://");
}

#[test]
fn refuses_tls_references_that_do_not_resolve() {
    let errors = doc().set("ai.backends.main.tls", "{cert: 'file:/nonexistent/c.pem', key: 'env:NOT_THERE'}").errors();
    assert_eq!(errors.len(), 2, "{errors:#?}");
    assert_error(&errors, "ai.backends.main.tls.cert", "cannot be read");
    assert_error(&errors, "ai.backends.main.tls.key", "NOT_THERE is not set");
}

#[test]
fn refuses_tls_values_that_are_not_references_without_echoing_them() {
    let errors = doc()
        .set("ai.backends.main.tls", "{cert: /etc/flexway/c.pem, key: '-----BEGIN PRIVATE KEY----- MIIEv'}")
        .errors();
    let cert = assert_error(&errors, "ai.backends.main.tls.cert", "file:PATH");
    let key = assert_error(&errors, "ai.backends.main.tls.key", "never values");
    assert!(!cert.contains("/etc/flexway") && !key.contains("MIIEv"), "{errors:#?}");
}

#[test]
fn accepts_tls_references_that_resolve() {
    let cert = temp_file("ok-cert.pem", b"cert");
    let key = temp_file("ok-key.pem", b"key");
    let loaded = doc()
        .set(
            "ai.backends.main.tls",
            &format!("{{cert: 'file:{}', key: 'file:{}', ca: 'env:CA_PEM'}}", cert.display(), key.display()),
        )
        .loads();
    let tls = loaded.config.ai.backends["main"].kind.endpoint().unwrap().tls.clone().unwrap();
    assert_eq!(
        (tls.cert, tls.key, tls.ca),
        (SecretRef::File(cert), SecretRef::File(key), Some(SecretRef::Env("CA_PEM".into())))
    );
}

#[test]
fn refuses_price_finer_than_a_micro_euro() {
    doc()
        .set("ai.backends.main.price", "{input_per_mtok_eur: 0.1234567, output_per_mtok_eur: 1}")
        .refused("ai.backends.main.price.input_per_mtok_eur", "more than 6 decimal places");
}

#[test]
fn refuses_negative_price() {
    doc()
        .set("ai.backends.main.price", "{input_per_mtok_eur: 1, output_per_mtok_eur: -2}")
        .refused("ai.backends.main.price.output_per_mtok_eur", "must not be negative");
}

#[test]
fn refuses_price_with_one_side_missing() {
    doc()
        .set("ai.backends.main.price", "{input_per_mtok_eur: 1}")
        .refused("ai.backends.main.price.output_per_mtok_eur", "required");
}

#[test]
fn warns_about_backend_without_price() {
    let loaded = doc().remove("ai.backends.main.price").loads();
    assert_eq!(loaded.config.ai.backends["main"].price, Default::default());
    assert!(
        loaded.warnings.iter().any(|w| w.path == "ai.backends.main" && w.message.contains("no price")),
        "{:?}",
        loaded.warnings
    );
}

#[test]
fn refuses_empty_capabilities() {
    doc().set("ai.backends.main.capabilities", "[]").refused("ai.backends.main.capabilities", "at least one");
}

#[test]
fn refuses_undeclared_fallback() {
    doc().set("ai.backends.main.fallback", "[internal, ghost]").refused("ai.backends.main.fallback[1]", "not declared");
}

#[test]
fn refuses_fallback_to_itself() {
    doc()
        .set("ai.backends.main.fallback", "[main]")
        .refused("ai.backends.main.fallback[0]", "cannot fall back to itself");
}

#[test]
fn refuses_duplicate_fallback() {
    doc()
        .set("ai.backends.main.fallback", "[internal, internal]")
        .refused("ai.backends.main.fallback[1]", "listed twice");
}

#[test]
fn refuses_bad_timeout() {
    doc().set("ai.backends.main.timeout", "'10'").refused("ai.backends.main.timeout", "no unit");
    doc().set("ai.backends.main.timeout", "0s").refused("ai.backends.main.timeout", "longer than zero");
}

#[test]
fn reads_circuit_breaker_with_ratio() {
    let loaded = doc()
        .set(
            "ai.backends.main.circuit_breaker",
            "{failure_ratio: 0.5, min_requests: 20, interval: 5m, trip: 45s, \
             status: [429, '500-504']}",
        )
        .loads();
    let breaker = &loaded.config.ai.backends["main"].circuit_breaker;
    assert_eq!(breaker.trigger, BreakerTrigger::Ratio { ratio_ppm: 500_000, min_requests: 20 });
    assert_eq!(breaker.interval, Duration::from_secs(300));
    assert_eq!(breaker.trip, Duration::from_secs(45));
    assert_eq!(breaker.status, vec![(429, 429), (500, 504)]);
    assert!(!breaker.accept_retry_after);
}

#[test]
fn refuses_failures_and_failure_ratio_together() {
    doc()
        .set("ai.backends.main.circuit_breaker", "{failures: 3, failure_ratio: 0.5, min_requests: 10}")
        .refused("ai.backends.main.circuit_breaker", "either `failures` or `failure_ratio`");
}

#[test]
fn refuses_failure_ratio_without_min_requests() {
    doc()
        .set("ai.backends.main.circuit_breaker", "{failure_ratio: 0.5}")
        .refused("ai.backends.main.circuit_breaker.min_requests", "required with `failure_ratio`");
}

#[test]
fn refuses_failure_ratio_out_of_range() {
    doc()
        .set("ai.backends.main.circuit_breaker", "{failure_ratio: 1.2, min_requests: 10}")
        .refused("ai.backends.main.circuit_breaker.failure_ratio", "at most 1");
}

#[test]
fn refuses_zero_failures() {
    doc()
        .set("ai.backends.main.circuit_breaker", "{failures: 0}")
        .refused("ai.backends.main.circuit_breaker.failures", "at least 1");
}

#[test]
fn refuses_bad_breaker_status() {
    let errors = doc().set("ai.backends.main.circuit_breaker", "{status: ['599-500', '700', 'five hundred']}").errors();
    assert_eq!(errors.len(), 3, "{errors:#?}");
    assert_error(&errors, "ai.backends.main.circuit_breaker.status[0]", "reversed");
    assert_error(&errors, "ai.backends.main.circuit_breaker.status[1]", "between 100 and 599");
    assert_error(&errors, "ai.backends.main.circuit_breaker.status[2]", "not a status");
}

// ----- pools ----------------------------------------------------------------------

#[test]
fn reads_pool_with_defaults_and_members_capabilities() {
    let loaded = doc()
        .set("ai.backends.internal.capabilities", "[chat, vision]")
        .set(
            "ai.backends.pool",
            "{kind: pool, members: [{backend: main}, {backend: internal, priority: 2, weight: 3}]}",
        )
        .set("ai.default_backend", "pool")
        .set("ai.capabilities", "{vision: pool}")
        .loads();
    let pool = &loaded.config.ai.backends["pool"];
    let BackendKind::Pool { members, .. } = &pool.kind else { panic!("a pool") };
    assert_eq!((members[0].priority, members[0].weight), (1, 1));
    assert_eq!((members[1].priority, members[1].weight), (2, 3));
    assert_eq!(pool.capabilities.iter().copied().collect::<Vec<_>>(), vec![Capability::Chat, Capability::Vision]);
    assert!(pool.external);
    assert!(other_warnings(&loaded).is_empty(), "{:?}", loaded.warnings);
}

#[test]
fn refuses_pool_without_members() {
    doc()
        .set("ai.backends.pool", "{kind: pool, members: []}")
        .refused("ai.backends.pool.members", "at least one member");
}

#[test]
fn refuses_endpoint_keys_on_a_pool() {
    let errors = doc()
        .set(
            "ai.backends.pool",
            "{kind: pool, members: [{backend: main}], url: 'https://x', auth: {type: none}, \
             tls: {}, models: [a], aliases: {a: b}, default_model: a, metering: upstream, \
             identity_headers: {}, descriptor_set: x.binpb}",
        )
        .errors();
    let keys =
        ["url", "auth", "tls", "models", "aliases", "default_model", "metering", "identity_headers", "descriptor_set"];
    assert_eq!(errors.len(), keys.len(), "{errors:#?}");
    for key in keys {
        assert_error(&errors, &format!("ai.backends.pool.{key}"), "does not apply to a pool backend");
    }
}

/// A pool of `main` and `internal` that picks by `pick` and `extra`, each member
/// reading its load.
fn picking_pool(pick: &str, extra: &str) -> Doc {
    doc()
        .set("ai.backends.main.load", "{metrics_url: 'http://10.0.0.4:8000/metrics', every: 250ms}")
        .set("ai.backends.internal.load", "{metrics_url: 'http://10.0.0.5:8000/metrics'}")
        .set(
            "ai.backends.pool",
            &format!("{{kind: pool, pick: {pick}, members: [{{backend: main}}, {{backend: internal}}]{extra}}}"),
        )
        .set("ai.default_backend", "pool")
}

#[test]
fn reads_inference_aware_picking() {
    let loaded =
        picking_pool("least_loaded", ", cache_affinity: {prefix_bytes: 2048}, saturation: {queue: 8, kv_cache: 0.9}")
            .set("tenants.acme.max_criticality", "standard")
            .set("tenants.acme.agents.bot.max_criticality", "sheddable")
            .loads();
    let ai = &loaded.config.ai;
    let BackendKind::Pool { picking, .. } = &ai.backends["pool"].kind else { panic!("a pool") };
    assert_eq!(picking.pick, Pick::LeastLoaded);
    assert_eq!(picking.prefix_bytes, Some(2048));
    assert_eq!(picking.saturation, Some(Saturation { queue: Some(8), kv_cache_ppm: Some(900_000) }));
    let main = ai.backends["main"].load.as_ref().unwrap();
    assert_eq!((main.metrics_url.as_str(), main.every), ("http://10.0.0.4:8000/metrics", Duration::from_millis(250)));
    assert_eq!(ai.backends["internal"].load.as_ref().unwrap().every, Duration::from_secs(1), "the default poll");
    let acme = &loaded.config.tenants["acme"];
    assert_eq!(acme.max_criticality, Criticality::Standard);
    assert_eq!(acme.agents.values().next().unwrap().max_criticality, Criticality::Sheddable);
    assert!(other_warnings(&loaded).is_empty(), "{:?}", loaded.warnings);

    let plain = picking_pool("latency", ", cache_affinity: {}").remove("ai.backends.main.load");
    let plain = plain.remove("ai.backends.internal.load").loads();
    let warnings = other_warnings(&plain);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert_eq!(warnings[0].path, "ai.backends.pool.cache_affinity");
    assert!(warnings[0].message.contains("declare `saturation`"), "{}", warnings[0].message);
    let BackendKind::Pool { picking, .. } = &plain.config.ai.backends["pool"].kind else { panic!("a pool") };
    assert_eq!((picking.pick, picking.prefix_bytes, picking.saturation), (Pick::Latency, Some(4096), None));
    assert_eq!(plain.config.tenants["acme"].max_criticality, Criticality::Critical, "no limit by default");
}

#[test]
fn refuses_picking_keys_outside_a_pool_and_load_on_a_pool() {
    let errors = doc()
        .set("ai.backends.main.pick", "least_loaded")
        .set("ai.backends.main.cache_affinity", "{}")
        .set("ai.backends.main.saturation", "{queue: 2}")
        .set("ai.backends.pool", "{kind: pool, members: [{backend: main}], load: {metrics_url: 'http://x/m'}}")
        .errors();
    assert_eq!(errors.len(), 4, "{errors:#?}");
    for key in ["pick", "cache_affinity", "saturation"] {
        assert_error(&errors, &format!("ai.backends.main.{key}"), "it belongs to kind pool");
    }
    assert_error(&errors, "ai.backends.pool.load", "does not apply to a pool backend");
}

#[test]
fn refuses_a_load_no_pool_reads() {
    let errors = picking_pool("weighted", "").errors();
    assert_eq!(errors.len(), 2, "{errors:#?}");
    for member in ["main", "internal"] {
        assert_error(&errors, &format!("ai.backends.{member}.load"), "no pool reads this load");
    }
    let latency = picking_pool("latency", "").remove("ai.backends.main.load");
    latency.refused("ai.backends.internal.load", "no pool reads this load");
}

#[test]
fn warns_about_a_member_ranked_without_its_load() {
    let loaded = picking_pool("weighted", ", saturation: {queue: 4}").remove("ai.backends.internal.load").loads();
    let warnings = other_warnings(&loaded);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert_eq!(warnings[0].path, "ai.backends.internal");
    assert!(warnings[0].message.contains("ranked by the gateway's own calls in flight"), "{}", warnings[0].message);
}

#[test]
fn refuses_bad_picking_values() {
    let errors =
        picking_pool("least_loaded", ", cache_affinity: {prefix_bytes: 0}, saturation: {queue: 0, kv_cache: 1.5}")
            .set("ai.backends.main.load.every", "10ms")
            .set("ai.backends.internal.load.metrics_url", "ftp://x/metrics")
            .errors();
    assert_eq!(errors.len(), 5, "{errors:#?}");
    assert_error(&errors, "ai.backends.pool.cache_affinity.prefix_bytes", "between 1 and 1048576");
    assert_error(&errors, "ai.backends.pool.saturation.queue", "at least 1");
    assert_error(&errors, "ai.backends.pool.saturation.kv_cache", "");
    assert_error(&errors, "ai.backends.main.load.every", "at least 100ms");
    assert_error(&errors, "ai.backends.internal.load.metrics_url", "not an http:// or https:// URL");
    picking_pool("least_loaded", ", saturation: {}").refused("ai.backends.pool.saturation", "declare `queue`");
    let errors = picking_pool("fastest", "").errors();
    assert_error(&errors, "ai.backends.pool.pick", "unknown variant `fastest`");
    doc().set("tenants.acme.max_criticality", "urgent").refused("tenants.acme.max_criticality", "");
}

#[test]
fn refuses_two_prefix_lengths() {
    picking_pool("least_loaded", ", cache_affinity: {prefix_bytes: 1024}")
        .set("ai.backends.other", "{kind: pool, members: [{backend: main}], cache_affinity: {prefix_bytes: 2048}}")
        .refused("ai.backends.pool.cache_affinity.prefix_bytes", "one prefix length");
}

#[test]
fn reads_jurisdictions_and_residency() {
    let loaded = doc()
        .set("ai.backends.main.jurisdiction", "EU")
        .set("ai.backends.internal.jurisdiction", "ch")
        .set("tenants.acme.residency", "[eu, CH]")
        .set("tenants.acme.agents.bot", "{backend: internal, residency: [ch]}")
        .loads();
    let ai = &loaded.config.ai;
    assert_eq!(ai.backends["main"].jurisdiction.as_deref(), Some("eu"), "compared in lower case");
    let acme = &loaded.config.tenants["acme"];
    let listed = |labels: &[&str]| Some(labels.iter().map(|l| l.to_string()).collect());
    assert_eq!(acme.residency, listed(&["ch", "eu"]));
    assert_eq!(acme.agents.values().next().unwrap().residency, listed(&["ch"]));
    // An agent is held to its tenant's limits too: both apply, read as one.
    let narrowed = doc()
        .set("ai.backends.internal.jurisdiction", "ch")
        .set("tenants.acme.residency", "[eu, ch]")
        .set("tenants.acme.max_criticality", "standard")
        .set("tenants.acme.agents.bot", "{backend: internal, residency: [ch, us], max_criticality: critical}")
        .set("tenants.acme.agents.helper", "{}")
        .loads();
    let agents = &narrowed.config.tenants["acme"].agents;
    let (bot, helper) = (&agents[&AgentId::new("bot")], &agents[&AgentId::new("helper")]);
    assert_eq!((bot.residency.clone(), bot.max_criticality), (listed(&["ch"]), Criticality::Standard));
    assert_eq!((helper.residency.clone(), helper.max_criticality), (listed(&["ch", "eu"]), Criticality::Standard));
    assert!(other_warnings(&loaded).is_empty(), "{:?}", loaded.warnings);
}

#[test]
fn refuses_bad_jurisdictions() {
    let errors = doc()
        .set("ai.backends.main.jurisdiction", "'eu west'")
        .set("ai.backends.pool", "{kind: pool, members: [{backend: internal}], jurisdiction: eu}")
        .set("tenants.acme.residency", "[]")
        .set("tenants.acme.agents.bot.residency", "[eu, 'a/b']")
        .errors();
    assert_eq!(errors.len(), 4, "{errors:#?}");
    assert_error(&errors, "ai.backends.main.jurisdiction", "not a jurisdiction");
    assert_error(&errors, "ai.backends.pool.jurisdiction", "does not apply to a pool backend");
    assert_error(&errors, "tenants.acme.residency", "at least one jurisdiction");
    assert_error(&errors, "tenants.acme.agents.bot.residency[1]", "not a jurisdiction");
}

#[test]
fn warns_about_a_residency_bound_caller_without_a_compliant_default_chain() {
    let loaded = doc()
        .set("ai.backends.main.jurisdiction", "us")
        .set("ai.backends.main.fallback", "[internal]")
        .set("ai.backends.internal.jurisdiction", "eu")
        .set(
            "ai.backends.outside",
            "{url: 'https://x/v1', jurisdiction: us, price: {input_per_mtok_eur: 1, output_per_mtok_eur: 1}}",
        )
        .set("tenants.acme.residency", "[eu]")
        .set("tenants.acme.agents.bot", "{backend: outside}")
        .loads();
    let warnings = other_warnings(&loaded);
    assert_eq!(
        warnings.len(),
        1,
        "the tenant's chain reaches eu through a fallback; its agent's does not: {warnings:?}"
    );
    assert_eq!(warnings[0].path, "tenants.acme.agents.bot.residency");
    assert!(warnings[0].message.contains("residency_unavailable"), "{}", warnings[0].message);

    let nowhere = doc().set("tenants.acme.residency", "[eu]").loads();
    let warnings = other_warnings(&nowhere);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert_eq!(warnings[0].path, "tenants.acme.residency");
}

#[test]
fn refuses_undeclared_pool_member() {
    doc()
        .set("ai.backends.pool", "{kind: pool, members: [{backend: ghost}]}")
        .refused("ai.backends.pool.members[0].backend", "not declared");
}

#[test]
fn refuses_pool_as_its_own_member() {
    doc()
        .set("ai.backends.pool", "{kind: pool, members: [{backend: main}, {backend: pool}]}")
        .refused("ai.backends.pool.members[1].backend", "cannot be its own member");
}

#[test]
fn refuses_nested_pools() {
    doc()
        .set("ai.backends.inner", "{kind: pool, members: [{backend: main}]}")
        .set("ai.backends.outer", "{kind: pool, members: [{backend: inner}]}")
        .refused("ai.backends.outer.members[0].backend", "pools do not nest");
}

#[test]
fn refuses_grpc_pool_member() {
    doc()
        .set("ai.backends.ocr", grpc_backend())
        .set("ai.backends.pool", "{kind: pool, members: [{backend: ocr}]}")
        .refused("ai.backends.pool.members[0].backend", "kind grpc");
}

#[test]
fn refuses_duplicate_pool_member() {
    doc()
        .set("ai.backends.pool", "{kind: pool, members: [{backend: main}, {backend: main, priority: 2}]}")
        .refused("ai.backends.pool.members[1].backend", "already a member");
}

#[test]
fn refuses_zero_priority_and_weight() {
    let errors =
        doc().set("ai.backends.pool", "{kind: pool, members: [{backend: main, priority: 0, weight: 0}]}").errors();
    assert_eq!(errors.len(), 2, "{errors:#?}");
    assert_error(&errors, "ai.backends.pool.members[0].priority", "at least 1");
    assert_error(&errors, "ai.backends.pool.members[0].weight", "at least 1");
}

#[test]
fn refuses_internal_pool_with_an_external_member() {
    doc()
        .set("ai.backends.pool", "{kind: pool, external: false, members: [{backend: main}]}")
        .refused("ai.backends.pool.external", "member `main` is external");
}

#[test]
fn refuses_pool_declaring_a_capability_no_member_serves() {
    doc()
        .set("ai.backends.pool", "{kind: pool, capabilities: [embeddings], members: [{backend: main}]}")
        .refused("ai.backends.pool.capabilities", "no member of this pool serves embeddings");
}

// ----- relays ---------------------------------------------------------------------

#[test]
fn warns_about_relay_metered_locally() {
    let loaded = doc()
        .set(
            "ai.backends.up",
            "{kind: relay, url: 'https://up.example.net', \
             price: {input_per_mtok_eur: 1, output_per_mtok_eur: 1}}",
        )
        .loads();
    let BackendKind::Relay { metering, .. } = &loaded.config.ai.backends["up"].kind else { panic!("a relay") };
    assert_eq!(*metering, Metering::Local);
    let warning = loaded.warnings.iter().find(|w| w.path == "ai.backends.up").unwrap();
    assert_eq!(
        warning.message,
        "relay up is metered locally (metering: local): if the upstream Flexway meters too, \
         its calls are counted twice; set metering: upstream"
    );
}

#[test]
fn relay_identity_headers_default_to_the_names_a_receiving_flexway_reads() {
    let relay = |identity_headers: &str| {
        doc().set(
            "ai.backends.up",
            &format!(
                "{{kind: relay, url: 'https://up.example.net', metering: upstream, \
                 price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 1}}{identity_headers}}}"
            ),
        )
    };
    let loaded = relay("").loads();
    let BackendKind::Relay { identity_headers, .. } = &loaded.config.ai.backends["up"].kind else { panic!("a relay") };
    let expected = ["flexway-tenant", "flexway-agent", "flexway-sensitive"].map(|h| Some(h.to_owned()));
    assert_eq!([&identity_headers.tenant, &identity_headers.agent, &identity_headers.sensitive], expected.each_ref());
    assert!(loaded.warnings.iter().all(|w| !w.path.starts_with("ai.backends.up")), "{:?}", loaded.warnings);

    // Declared: only the names given are sent.
    let loaded = relay(", identity_headers: {tenant: Flexway-Tenant}").loads();
    let BackendKind::Relay { identity_headers, .. } = &loaded.config.ai.backends["up"].kind else { panic!("a relay") };
    assert_eq!(identity_headers.tenant.as_deref(), Some("flexway-tenant"));
    assert_eq!((&identity_headers.agent, &identity_headers.sensitive), (&None, &None));
    assert!(loaded.warnings.iter().all(|w| !w.path.starts_with("ai.backends.up")), "{:?}", loaded.warnings);
}

#[test]
fn refuses_to_send_a_header_the_gateway_writes_itself() {
    let errors = doc()
        .set(
            "ai.backends.up",
            "{kind: relay, url: 'http://up.example.net', metering: upstream, \
             identity_headers: {tenant: Content-Length, agent: Host, sensitive: X-Sensitive}}",
        )
        .set(
            "ai.backends.payg",
            "{url: 'https://payg.example.net/v1', auth: {type: header, name: Transfer-Encoding, secret: 'env:K'}}",
        )
        .errors();
    let got: Vec<(&str, &str)> = errors.iter().map(|e| (e.path.as_str(), e.message.as_str())).collect();
    for (path, name) in [
        ("ai.backends.up.identity_headers.tenant", "content-length"),
        ("ai.backends.up.identity_headers.agent", "host"),
        ("ai.backends.payg.auth.name", "transfer-encoding"),
    ] {
        let message = format!("`{name}` is written by the gateway itself: choose another header name");
        assert!(got.contains(&(path, message.as_str())), "{path}: {got:?}");
    }
    assert!(got.iter().all(|(path, _)| !path.ends_with("sensitive")), "{got:?}");
}

#[test]
fn warns_about_relay_identity_names_a_receiving_flexway_does_not_read() {
    let loaded = doc()
        .set(
            "ai.backends.up",
            "{kind: relay, url: 'https://up.example.net', metering: upstream, \
             price: {input_per_mtok_eur: 1, output_per_mtok_eur: 1}, \
             identity_headers: {tenant: X-Tenant, agent: Flexway-Agent, sensitive: X-Secret}}",
        )
        .loads();
    let warnings: Vec<_> = loaded.warnings.iter().filter(|w| w.path.starts_with("ai.backends.up")).collect();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert_eq!(warnings[0].path, "ai.backends.up.identity_headers.tenant");
    assert_eq!(
        warnings[0].message,
        "relay up sends the tenant under a name a receiving Flexway does not read (flexway-tenant)"
    );
}

#[test]
fn warns_about_a_relay_url_ending_in_v1() {
    let loaded =
        doc().set("ai.backends.up", "{kind: relay, url: 'https://up.example.net/v1/', metering: upstream}").loads();
    let warning = loaded.warnings.iter().find(|w| w.path == "ai.backends.up.url").unwrap();
    assert!(warning.message.contains("https://up.example.net/v1/v1/chat/completions"), "{}", warning.message);
}

#[test]
fn refuses_relay_keys_on_another_kind() {
    let errors = doc()
        .set("ai.backends.main.metering", "upstream")
        .set("ai.backends.main.identity_headers", "{tenant: X-Tenant}")
        .errors();
    assert_eq!(errors.len(), 2, "{errors:#?}");
    assert_error(&errors, "ai.backends.main.metering", "does not apply to an openai backend; it belongs to kind relay");
    assert_error(&errors, "ai.backends.main.identity_headers", "kind relay");
}

#[test]
fn refuses_invalid_identity_header() {
    doc()
        .set(
            "ai.backends.up",
            "{kind: relay, url: 'https://up.example.net', metering: upstream, \
             identity_headers: {tenant: 'Bad Header'}}",
        )
        .refused("ai.backends.up.identity_headers.tenant", "not a valid HTTP header name");
}

// ----- gRPC -----------------------------------------------------------------------

#[test]
fn warns_about_missing_descriptor_set() {
    let loaded = doc().set("ai.backends.ocr", grpc_backend()).loads();
    let warning = loaded.warnings.iter().find(|w| w.path == "ai.backends.ocr.descriptor_set").unwrap();
    assert!(warning.message.contains("will be refused until it does"), "{}", warning.message);
    let BackendKind::Grpc { url, .. } = &loaded.config.ai.backends["ocr"].kind else { panic!("grpc") };
    assert_eq!(url, "http://10.0.0.9:50051");
}

#[test]
fn refuses_empty_descriptor_set() {
    let empty = temp_file("empty.binpb", b"");
    doc()
        .set(
            "ai.backends.ocr",
            &format!("{{kind: grpc, url: 'http://10.0.0.9:50051', descriptor_set: '{}'}}", empty.display()),
        )
        .refused("ai.backends.ocr.descriptor_set", "is empty");
}

#[test]
fn refuses_a_descriptor_set_that_is_not_one() {
    let set = temp_file("garbage.binpb", b"\xff\xff\xff\xff");
    let message = doc()
        .set(
            "ai.backends.ocr",
            &format!("{{kind: grpc, url: 'grpc://ocr.example.net', descriptor_set: '{}'}}", set.display()),
        )
        .refused("ai.backends.ocr.descriptor_set", "not a usable serialized FileDescriptorSet");
    assert!(message.contains(&set.display().to_string()), "{message}");
}

#[test]
fn refuses_grpc_backend_without_descriptor_set() {
    doc()
        .set("ai.backends.ocr", "{kind: grpc, url: 'http://10.0.0.9:50051'}")
        .refused("ai.backends.ocr.descriptor_set", "required for a grpc backend");
}

#[test]
fn refuses_grpc_backend_without_url() {
    doc()
        .set("ai.backends.ocr", "{kind: grpc, descriptor_set: /nonexistent/ocr.binpb}")
        .refused("ai.backends.ocr.url", "required for a grpc backend");
}

#[test]
fn refuses_descriptor_set_on_another_kind() {
    doc()
        .set("ai.backends.main.descriptor_set", "ocr.binpb")
        .refused("ai.backends.main.descriptor_set", "belongs to kind grpc");
}

#[test]
fn refuses_http_keys_on_a_grpc_backend() {
    let errors = doc()
        .set("ai.backends.ocr", grpc_backend())
        .set("ai.backends.ocr.models", "[ocr-v1]")
        .set("ai.backends.ocr.fallback", "[main]")
        .set("ai.backends.ocr.capabilities", "[chat]")
        .errors();
    assert_eq!(errors.len(), 3, "{errors:#?}");
    assert_error(&errors, "ai.backends.ocr.models", "does not apply to a grpc backend");
    assert_error(&errors, "ai.backends.ocr.fallback", "does not apply to a grpc backend");
    assert_error(&errors, "ai.backends.ocr.capabilities", "does not apply to a grpc backend");
}

#[test]
fn refuses_grpc_backend_wherever_http_routing_goes() {
    let cases = [
        ("ai.default_backend", "ocr", "ai.default_backend"),
        ("tenants.acme.backend", "ocr", "tenants.acme.backend"),
        ("tenants.acme.agents.bot", "{backend: ocr}", "tenants.acme.agents.bot.backend"),
        ("ai.capabilities", "{vision: ocr}", "ai.capabilities.vision"),
        ("ai.sensitive_backend", "ocr", "ai.sensitive_backend"),
        ("ai.budget.soft", "{threshold: 0.5, backend: ocr}", "ai.budget.soft.backend"),
        ("ai.backends.main.fallback", "[ocr]", "ai.backends.main.fallback[0]"),
    ];
    for (key, value, error_path) in cases {
        doc().set("ai.backends.ocr", grpc_backend()).set(key, value).refused(error_path, "backend `ocr` is kind grpc");
    }
}

// ----- durations ------------------------------------------------------------------

#[test]
fn parses_durations() {
    let cases: [(&str, Option<Duration>); 14] = [
        ("30s", Some(Duration::from_secs(30))),
        ("5m", Some(Duration::from_secs(300))),
        ("1h", Some(Duration::from_secs(3600))),
        ("500ms", Some(Duration::from_millis(500))),
        ("2d", Some(Duration::from_secs(172_800))),
        ("0s", Some(Duration::ZERO)),
        (" 60s ", Some(Duration::from_secs(60))),
        ("", None),
        ("10", None),
        ("-1s", None),
        ("1x", None),
        ("1.5s", None),
        ("s", None),
        ("1h30m", None),
    ];
    for (text, expected) in cases {
        assert_eq!(parse_duration(text).ok(), expected, "parse_duration({text:?})");
    }
}

// ----- shape and rule errors together ---------------------------------------------

#[test]
fn reports_shape_and_rule_errors_together() {
    let errors = doc()
        .set("ai.backends.main.colour", "red")
        .set("ai.backends.main.timeout", "10")
        .set("tenants.acme.backend", "ghost")
        .set("ai.default_backend", "missing")
        .errors();
    assert_eq!(errors.len(), 4, "{errors:#?}");
    assert_error(&errors, "ai.backends.main.timeout", "no unit");
    assert_error(&errors, "tenants.acme.backend", "not declared");
    assert_error(&errors, "ai.default_backend", "not declared");
    assert_error(&errors, "ai.backends.main.colour", "unknown field");
}

#[test]
fn does_not_guess_about_an_entry_that_did_not_parse() {
    // `url: 5` is dropped: no second error saying the url is missing. `capabilities`
    // is dropped: no error saying `main` does not serve vision, it may well.
    let errors = doc()
        .set("ai.backends.main.url", "5")
        .set("ai.backends.main.capabilities", "[chat, sight]")
        .set("ai.capabilities", "{vision: main}")
        .errors();
    assert_eq!(errors.len(), 2, "{errors:#?}");
    assert_error(&errors, "ai.backends.main.url", "expected a string");
    assert_error(&errors, "ai.backends.main.capabilities[1]", "unknown variant `sight`");
}

#[test]
fn does_not_call_undeclared_a_backend_that_did_not_parse() {
    let errors = doc().set("ai.backends.main", "just a string").errors();
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert_error(&errors, "ai.backends.main", "expected a backend (a mapping)");
}

#[test]
fn judges_no_pool_by_a_member_that_did_not_parse() {
    // `internal` lost its `external` to a bad value: the pool built on it is not
    // called external (nor the sensitive backend refused) on a guess.
    let errors = doc()
        .set("ai.backends.internal.external", "nope")
        .set("ai.backends.pool", "{kind: pool, external: false, members: [{backend: internal}]}")
        .set("ai.sensitive_backend", "pool")
        .errors();
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert_error(&errors, "ai.backends.internal.external", "expected a boolean");
}

#[test]
fn telemetry_exports_to_an_http_collector() {
    assert_eq!(doc().loads().config.telemetry, None);
    let loaded = doc().set("telemetry", "{otlp_endpoint: 'http://collector:4318/'}").loads();
    let telemetry = loaded.config.telemetry.unwrap();
    assert_eq!(telemetry.otlp_endpoint, "http://collector:4318");
    assert_eq!(telemetry.export_interval, Duration::from_secs(5));
    let quick = doc().set("telemetry", "{otlp_endpoint: 'https://otel.example.net', export_interval: 250ms}").loads();
    assert_eq!(quick.config.telemetry.unwrap().export_interval, Duration::from_millis(250));

    doc().set("telemetry", "{export_interval: 1s}").refused("telemetry.otlp_endpoint", "required");
    doc().set("telemetry", "{otlp_endpoint: 'grpc://collector:4317'}").refused("telemetry.otlp_endpoint", "http");
    doc().set("telemetry", "{otlp_endpoint: 'collector:4318'}").refused("telemetry.otlp_endpoint", "not a URL");
    doc()
        .set("telemetry", "{otlp_endpoint: 'http://c:4318', export_interval: 0s}")
        .refused("telemetry.export_interval", "longer than zero");
    doc()
        .set("telemetry", "{otlp_endpoint: 'http://c:4318', sampler: always}")
        .refused("telemetry.sampler", "unknown field");
}

#[test]
fn refuses_embeddings_on_an_anthropic_backend() {
    let anthropic = || doc().set("ai.backends.main.kind", "anthropic");
    anthropic().set("ai.backends.main.capabilities", "[chat, vision]").checks();
    anthropic()
        .set("ai.backends.main.capabilities", "[chat, embeddings]")
        .refused("ai.backends.main.capabilities", "the Messages API has no embeddings");
}

#[test]
fn forward_headers_are_kept_by_name_in_lower_case() {
    let loaded = doc().set("ai.backends.main.forward_headers", "[Anthropic-Beta, openai-beta, X-Team-Trace]").loads();
    let BackendKind::OpenAi(endpoint) = &loaded.config.ai.backends["main"].kind else { panic!("an openai backend") };
    assert_eq!(endpoint.forward_headers, ["anthropic-beta", "openai-beta", "x-team-trace"]);
    let loaded = doc().loads();
    let BackendKind::OpenAi(endpoint) = &loaded.config.ai.backends["main"].kind else { panic!("an openai backend") };
    assert!(endpoint.forward_headers.is_empty(), "nothing of the caller's is forwarded unless named");
}

#[test]
fn refuses_to_forward_a_credential_a_hop_header_or_the_gateways_own() {
    let errors = doc()
        .set(
            "ai.backends.main.forward_headers",
            "[Authorization, x-api-key, Cookie, Proxy-Authorization, Connection, Host, Content-Type, traceparent, \
             anthropic-version, Flexway-Tenant, Sec-WebSocket-Key, anthropic-beta, Anthropic-Beta, 'not a name']",
        )
        .set("ai.backends.internal.auth", "{type: header, name: X-Backend-Key, secret: 'env:BACKEND_KEY'}")
        .set("ai.backends.internal.forward_headers", "[x-backend-key]")
        .errors();
    let at = |i: usize| format!("ai.backends.main.forward_headers[{i}]");
    for i in 0..4 {
        assert_error(&errors, &at(i), "carries a credential");
    }
    for i in 4..9 {
        assert_error(&errors, &at(i), "written by the gateway itself");
    }
    assert_error(&errors, &at(9), "the gateway's own");
    assert_error(&errors, &at(10), "the gateway's own");
    assert_error(&errors, &at(12), "listed twice");
    assert!(errors.iter().any(|e| e.path == at(13)), "{errors:#?}");
    assert_error(&errors, "ai.backends.internal.forward_headers[0]", "carries a credential");
    assert_eq!(errors.len(), 14, "{errors:#?}");
}

#[test]
fn refuses_to_forward_the_headers_the_gateway_reads() {
    let errors = doc()
        .set("ai.sensitive_header", "X-Data-Class")
        .set("ai.affinity", "{header: X-Conversation}")
        .set("ai.backends.main.forward_headers", "[x-data-class, X-Conversation, x-fine]")
        .errors();
    assert_error(&errors, "ai.backends.main.forward_headers[0]", "read by the gateway itself");
    assert_error(&errors, "ai.backends.main.forward_headers[1]", "read by the gateway itself");
    assert_eq!(errors.len(), 2, "{errors:#?}");
}

#[test]
fn forward_headers_belong_to_http_backends_only() {
    doc()
        .set("ai.backends.pool", "{kind: pool, members: [{backend: main}], forward_headers: [anthropic-beta]}")
        .refused("ai.backends.pool.forward_headers", "does not apply to a pool backend");
}

// ----- inference pools ------------------------------------------------------------

/// An inference pool `epp`, the default backend, with `extra` keys.
fn inference_pool(extra: &str) -> Doc {
    doc()
        .set(
            "ai.backends.epp",
            &format!(
                "{{kind: inference_pool, endpoint_picker: {{url: 'http://epp.llm.svc:9002'}}, target: {{port: 8000}}, \
                 models: [llama], price: {{input_per_mtok_eur: 0.2, output_per_mtok_eur: 0.4}}{extra}}}"
            ),
        )
        .set("ai.default_backend", "epp")
}

#[test]
fn reads_an_inference_pool_with_defaults() {
    let loaded = inference_pool(", jurisdiction: EU, capabilities: [chat, embeddings]")
        .set("ai.backends.epp.auth", "{type: token_file, path: /var/run/secrets/token}")
        .loads();
    let pool = &loaded.config.ai.backends["epp"];
    let BackendKind::InferencePool { endpoint, picker, members } = &pool.kind else { panic!("an inference pool") };
    assert_eq!(endpoint.url, "/v1", "the default target path");
    assert_eq!(endpoint.models, ["llama"]);
    assert!(matches!(endpoint.auth, Auth::TokenFile { .. }));
    assert_eq!((picker.url.as_str(), picker.port), ("http://epp.llm.svc:9002", 8000));
    assert_eq!(picker.failure_mode, FailureMode::FailClose);
    assert!(members.is_empty());
    assert_eq!(pool.jurisdiction.as_deref(), Some("eu"));
    assert_eq!(pool.price.input_per_mtok, MicroEur(200_000));
    assert!(pool.capabilities.contains(&Capability::Embeddings));

    let open = inference_pool(", members: [{backend: internal}]")
        .set("ai.backends.epp.endpoint_picker", "{url: 'http://10.0.0.9:9002', failure_mode: fail_open}")
        .set("ai.backends.epp.target", "{port: 8000, path: /openai/v1/}")
        .loads();
    let BackendKind::InferencePool { endpoint, picker, members } = &open.config.ai.backends["epp"].kind else {
        panic!("an inference pool")
    };
    assert_eq!(endpoint.url, "/openai/v1");
    assert_eq!(picker.failure_mode, FailureMode::FailOpen);
    assert_eq!(members.len(), 1);
}

#[test]
fn refuses_an_inference_pool_without_its_picker_or_target() {
    let errors = doc().set("ai.backends.epp", "{kind: inference_pool}").errors();
    assert_error(&errors, "ai.backends.epp.endpoint_picker", "required");
    assert_error(&errors, "ai.backends.epp.target", "required");
    let https = inference_pool("").set("ai.backends.epp.endpoint_picker", "{url: 'https://epp:9002'}");
    https.refused("ai.backends.epp.endpoint_picker.url", "not an http://host:port address");
    let port = inference_pool("").set("ai.backends.epp.target", "{port: 70000}");
    port.refused("ai.backends.epp.target.port", "1 to 65535");
    let path = inference_pool("").set("ai.backends.epp.target", "{port: 8000, path: 'v1'}");
    path.refused("ai.backends.epp.target.path", "not an absolute path");
}

#[test]
fn refuses_what_an_inference_pool_would_not_use() {
    let errors = inference_pool(
        ", url: 'http://x/v1', tls: {cert: 'env:C', key: 'env:K'}, pick: least_loaded, capabilities: [realtime]",
    )
    .errors();
    for key in ["url", "tls", "pick"] {
        assert_error(&errors, &format!("ai.backends.epp.{key}"), "does not apply to an inference_pool backend");
    }
    assert_error(&errors, "ai.backends.epp.capabilities", "does not serve them");
    // Members serve only when the picker fails open.
    inference_pool(", members: [{backend: internal}]")
        .refused("ai.backends.epp.members", "with fail_close they would never serve");
    // Pools do not nest, either way.
    let nested = inference_pool("").set("ai.backends.pool", "{kind: pool, members: [{backend: epp}]}");
    nested.refused("ai.backends.pool.members[0].backend", "is itself an inference_pool backend");
    doc()
        .set("ai.backends.main.endpoint_picker", "{url: 'http://e:1'}")
        .refused("ai.backends.main.endpoint_picker", "it belongs to kind inference_pool");
}

#[test]
fn warns_about_an_inference_pool_failing_open_to_nothing() {
    let loaded = inference_pool("")
        .set("ai.backends.epp.endpoint_picker", "{url: 'http://epp:9002', failure_mode: fail_open}")
        .loads();
    let warnings = other_warnings(&loaded);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert_eq!(warnings[0].path, "ai.backends.epp.endpoint_picker.failure_mode");
}

// ----- the console ----------------------------------------------------------------

#[test]
fn reads_the_console_keys_and_refuses_a_tenant_s() {
    let loaded = doc().set("console", &format!("{{keys: [{{sha256: {KEY_B}}}]}}")).loads();
    let console = loaded.config.console.expect("a console");
    assert_eq!(console.keys.len(), 1);
    assert!(doc().loads().config.console.is_none(), "no console unless declared");

    doc()
        .set("console", &format!("{{keys: [{{sha256: {KEY_A}}}]}}"))
        .refused("console.keys[0].sha256", "a tenant's key never opens the console");
    doc().set("console", "{keys: []}").refused("console.keys", "at least one key");
    doc()
        .set("console", &format!("{{keys: [{{sha256: {KEY_B}}}, {{sha256: {KEY_B}}}]}}"))
        .refused("console.keys[1].sha256", "listed twice");
    doc().set("console", "{keys: [{sha256: nothex}]}").refused("console.keys[0].sha256", "");
}

#[test]
fn reads_cache_prices_defaulting_to_the_input_price() {
    let loaded = doc()
        .set(
            "ai.backends.main.price",
            "{input_per_mtok_eur: 3, output_per_mtok_eur: 15, cached_input_per_mtok_eur: 0.3, cache_write_per_mtok_eur: 3.75}",
        )
        .loads();
    let price = loaded.config.ai.backends["main"].price;
    assert_eq!(
        (price.cached_input_per_mtok, price.cache_write_per_mtok),
        (Some(MicroEur(300_000)), Some(MicroEur(3_750_000)))
    );
    assert_eq!(doc().loads().config.ai.backends["main"].price.cached_input_per_mtok, None);
    doc()
        .set(
            "ai.backends.main.price",
            "{input_per_mtok_eur: 3, output_per_mtok_eur: 15, cached_input_per_mtok_eur: -1}",
        )
        .refused("ai.backends.main.price.cached_input_per_mtok_eur", "");
}

#[test]
fn reads_a_usage_api_for_reconcile_and_keeps_its_key_from_the_gateway() {
    let loaded = doc().set("ai.backends.main.usage_api", "{kind: openai, secret: env:OPENAI_ADMIN_KEY}").loads();
    let api = loaded.config.ai.backends["main"].usage_api.clone().unwrap();
    assert_eq!((api.kind, api.url.as_str()), (UsageApiKind::Openai, "https://api.openai.com"));
    let references: Vec<String> = loaded.config.usage_api_references().into_iter().map(|(p, _)| p).collect();
    assert_eq!(references, ["ai.backends.main.usage_api.secret"]);
    assert!(
        !loaded.config.secret_references().iter().any(|(path, _)| path.contains("usage_api")),
        "the gateway never resolves an admin key"
    );
    let custom = doc()
        .set("ai.backends.main.usage_api", "{kind: anthropic, secret: env:K, url: \"http://127.0.0.1:9/\"}")
        .loads();
    assert_eq!(custom.config.ai.backends["main"].usage_api.as_ref().unwrap().url, "http://127.0.0.1:9");
    doc().set("ai.backends.main.usage_api", "{kind: openai}").refused("ai.backends.main.usage_api.secret", "required");
    doc()
        .set("ai.backends.main.usage_api", "{kind: azure, secret: env:K}")
        .refused("ai.backends.main.usage_api.kind", "unknown variant `azure`");
    doc()
        .set("ai.backends.main.usage_api", "{kind: openai, secret: env:K, url: ftp://x}")
        .refused("ai.backends.main.usage_api.url", "not an http");
    doc()
        .set("ai.backends.pool", "{kind: pool, members: [{backend: main}], usage_api: {kind: openai, secret: env:K}}")
        .refused("ai.backends.pool.usage_api", "");
}

#[test]
fn refuses_a_timeout_or_breaker_on_a_pool_whose_calls_go_to_its_members() {
    let errors = doc()
        .set(
            "ai.backends.pool",
            "{kind: pool, members: [{backend: main}], timeout: 1ms, circuit_breaker: {failures: 1, trip: 1h}}",
        )
        .errors();
    assert_eq!(errors.len(), 2, "{errors:#?}");
    for key in ["timeout", "circuit_breaker"] {
        assert_error(&errors, &format!("ai.backends.pool.{key}"), "does not apply to a pool backend");
    }
    // A member keeps its own.
    doc()
        .set("ai.backends.main.timeout", "5s")
        .set("ai.backends.pool", "{kind: pool, members: [{backend: main}]}")
        .loads();
}

#[test]
fn refuses_a_price_where_nothing_reads_it() {
    doc()
        .set(
            "ai.backends.pool",
            "{kind: pool, members: [{backend: main}], price: {input_per_mtok_eur: 1, output_per_mtok_eur: 1}}",
        )
        .refused("ai.backends.pool.price", "a pool has no price");
    doc()
        .set(
            "ai.backends.ocr",
            "{kind: grpc, url: 'http://10.0.0.9:50051', descriptor_set: x.binpb, \
             price: {input_per_mtok_eur: 1, output_per_mtok_eur: 1}}",
        )
        .refused("ai.backends.ocr.price", "a grpc backend has no price");
}

#[test]
fn refuses_cache_off_where_no_cache_is_declared() {
    let refused = doc().set("tenants.acme.cache", "off").errors();
    assert_error(&refused, "tenants.acme.cache", "there is no `ai.cache` section");
    let refused = doc().set("tenants.acme.agents", "{bot: {cache: off}}").errors();
    assert_error(&refused, "tenants.acme.agents.bot.cache", "there is no `ai.cache` section");
}
