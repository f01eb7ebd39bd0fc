//! Routing properties over generated configurations and requests (SPEC §4, §5):
//! a sensitive request never reaches an external backend, and every candidate in a
//! chain serves the request's capability, each backend at most once.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use flexway::config::{BackendId, Capability, TenantId, load_str};
use flexway::error::GatewayError;
use flexway::identity::Caller;
use flexway::routing::{RouteRequest, Router};
use proptest::prelude::*;

const CAPS: [&str; 3] = ["chat", "vision", "embeddings"];

#[derive(Debug, Clone)]
struct GenBackend {
    external: bool,
    caps: Vec<bool>,
    fallback: Vec<usize>,
}

#[derive(Debug, Clone)]
struct GenConfig {
    backends: Vec<GenBackend>,
    pool: Option<Vec<(usize, u32, u32)>>,
    default: usize,
    tenant_backend: Option<usize>,
    vision: Option<usize>,
    embeddings: Option<usize>,
    sensitive: Option<usize>,
    soft: Option<usize>,
}

fn backend() -> impl Strategy<Value = GenBackend> {
    (any::<bool>(), prop::collection::vec(any::<bool>(), 3), prop::collection::vec(0usize..6, 0..3))
        .prop_map(|(external, caps, fallback)| GenBackend { external, caps, fallback })
}

fn config() -> impl Strategy<Value = GenConfig> {
    (
        prop::collection::vec(backend(), 2..6),
        prop::option::of(prop::collection::vec((0usize..6, 1u32..4, 1u32..5), 1..4)),
        0usize..7,
        prop::option::of(0usize..7),
        prop::option::of(0usize..6),
        prop::option::of(0usize..6),
        prop::option::of(0usize..6),
        prop::option::of(0usize..6),
    )
        .prop_map(|(backends, pool, default, tenant_backend, vision, embeddings, sensitive, soft)| GenConfig {
            backends,
            pool,
            default,
            tenant_backend,
            vision,
            embeddings,
            sensitive,
            soft,
        })
}

fn name(g: &GenConfig, i: usize) -> String {
    if i >= g.backends.len() && g.pool.is_some() { "pool".to_owned() } else { format!("b{}", i % g.backends.len()) }
}

/// Renders a generated config as YAML; invalid combinations are dropped or fixed so the
/// result loads (the validator is tested elsewhere; here routing is under test).
fn yaml(g: &GenConfig) -> String {
    let n = g.backends.len();
    let caps_of = |b: &GenBackend| -> Vec<&str> {
        let caps: Vec<&str> = CAPS.iter().zip(&b.caps).filter(|(_, on)| **on).map(|(c, _)| *c).collect();
        if caps.is_empty() { vec!["chat"] } else { caps }
    };
    let mut out = String::from("version: 1\nstore: {kind: memory}\n");
    let tenant_backend = g.tenant_backend.map(|i| format!("\n    backend: {}", name(g, i))).unwrap_or_default();
    out.push_str(&format!("tenants:\n  t:\n    keys: [{{sha256: {}}}]{tenant_backend}\n", "a".repeat(64)));
    out.push_str(&format!("ai:\n  default_backend: {}\n", name(g, g.default)));
    let serves = |i: usize, cap: &str| caps_of(&g.backends[i % n]).contains(&cap);
    let mut overrides = Vec::new();
    if let Some(v) = g.vision.filter(|i| serves(*i, "vision")) {
        overrides.push(format!("vision: b{}", v % n));
    }
    if let Some(e) = g.embeddings.filter(|i| serves(*i, "embeddings")) {
        overrides.push(format!("embeddings: b{}", e % n));
    }
    if !overrides.is_empty() {
        out.push_str(&format!("  capabilities: {{{}}}\n", overrides.join(", ")));
    }
    if let Some(s) = g.sensitive.filter(|i| !g.backends[i % n].external) {
        out.push_str(&format!("  sensitive_backend: b{}\n", s % n));
    }
    if let Some(s) = g.soft {
        out.push_str(&format!("  budget: {{soft: {{threshold: 0.5, backend: b{}}}}}\n", s % n));
    }
    out.push_str("  backends:\n");
    for (i, b) in g.backends.iter().enumerate() {
        let fallback: BTreeSet<String> =
            b.fallback.iter().map(|f| f % n).filter(|f| *f != i).map(|f| format!("b{f}")).collect();
        out.push_str(&format!(
            "    b{i}:\n      url: http://127.0.0.1:9/v1\n      external: {}\n      capabilities: [{}]\n      fallback: [{}]\n",
            b.external,
            caps_of(b).join(", "),
            fallback.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    if let Some(members) = &g.pool {
        let mut seen = BTreeSet::new();
        out.push_str("    pool:\n      kind: pool\n      members:\n");
        for (m, priority, weight) in members {
            if seen.insert(m % n) {
                out.push_str(&format!("        - {{backend: b{}, priority: {priority}, weight: {weight}}}\n", m % n));
            }
        }
        out.push_str("      fallback: [b0]\n");
    }
    out
}

fn caller() -> Caller {
    Caller {
        tenant: TenantId::new("t"),
        agent: None,
        key_sha256: [0; 32],
        relay_peer: false,
        key_limits: Default::default(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn sensitive_calls_stay_internal_and_chains_respect_capability(
        g in config(),
        capability in prop::sample::select(vec![Capability::Chat, Capability::Vision, Capability::Embeddings]),
        sensitive in any::<bool>(),
        soft in any::<bool>(),
    ) {
        let text = yaml(&g);
        let env: HashMap<String, String> = HashMap::new();
        let loaded = match load_str(&text, &env) {
            Ok(loaded) => loaded,
            Err(e) => return Err(TestCaseError::fail(format!("generated config does not load: {e}\n{text}"))),
        };
        let config = Arc::new(loaded.config);
        let router = Router::new(config.clone()).unwrap();
        for _ in 0..4 {
            match router.route(&caller(), &RouteRequest { capability, sensitive, soft, affinity: None, prefix: None, criticality: Default::default(), residency: Default::default(), entry: None }) {
                Ok(route) => {
                    prop_assert!(!route.candidates.is_empty());
                    let mut seen = BTreeSet::new();
                    for candidate in &route.candidates {
                        let backend = &config.ai.backends[&candidate.backend];
                        prop_assert!(backend.capabilities.contains(&capability), "{} lacks {capability:?}\n{text}", candidate.backend);
                        prop_assert!(!sensitive || !backend.external, "sensitive call routed to external {}\n{text}", candidate.backend);
                        prop_assert!(seen.insert(candidate.backend.clone()), "{} twice in one chain", candidate.backend);
                        prop_assert!(candidate.backend != BackendId::new("pool"), "a pool is not an endpoint");
                    }
                }
                Err(GatewayError::SensitiveNoInternalBackend) => prop_assert!(sensitive),
                Err(GatewayError::CapabilityUnavailable { .. }) => {}
                Err(other) => prop_assert!(false, "unexpected routing error {other}"),
            }
        }
    }
}
