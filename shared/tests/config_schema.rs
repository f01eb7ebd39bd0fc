//! The published JSON Schema (`config/flexway.schema.json`) is generated from the raw
//! config types; this test fails when the checked-in file drifts from them.
//! Regenerate with `FLEXWAY_BLESS=1 cargo test -p flexway --test config_schema`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

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
    let path = schema_path();
    let expected = generated();
    if std::env::var_os("FLEXWAY_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &expected).unwrap();
        return;
    }
    let actual = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        actual == expected,
        "{} is out of date with the config types in shared/src/config/raw.rs; \
         regenerate it with: FLEXWAY_BLESS=1 cargo test -p flexway --test config_schema",
        path.display()
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
