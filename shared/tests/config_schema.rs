//! The published JSON Schema (`config/flexway.schema.json`) is generated from the raw
//! config types; this test fails when the checked-in file drifts from them.
//! Regenerate with `FLEXWAY_BLESS=1 cargo test -p flexway --test config_schema`.
#![cfg(test)]

use flexway_testkit::golden as support;

use std::path::PathBuf;

fn schema_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/flexway.schema.json")
}

fn generated() -> String {
    let mut text = serde_json::to_string_pretty(&flexway::config::json_schema()).unwrap();
    text.push('\n');
    text
}

#[test]
fn checked_in_schema_matches_the_raw_types() {
    support::matches_or_bless(
        &schema_path(),
        &generated(),
        "the config types in shared/src/config/raw.rs; regenerate it with: FLEXWAY_BLESS=1 cargo test -p \
         flexway --test config_schema",
    );
}

#[test]
fn schema_describes_the_top_level_keys() {
    let schema = flexway::config::json_schema();
    let properties = schema["properties"].as_object().unwrap();
    for key in ["version", "store", "audit", "tenants", "ai"] {
        assert!(properties.contains_key(key), "missing {key}");
    }
    assert_eq!(schema["required"], serde_json::json!(["version", "ai"]));
    assert_eq!(schema["additionalProperties"], serde_json::json!(false));
}
