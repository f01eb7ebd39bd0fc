//! What the infrastructure template must keep, read from `infra/template.yaml` as
//! YAML (CloudFormation's short tags, `!Ref` and `!If`, read as tagged values). The
//! template's syntax and its resources' schemas are checked by cfn-lint and `sam
//! validate` in `.ci/run`; these are the choices a lint cannot know are deliberate.
#![cfg(test)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_norway::Value;

fn template() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("infra/template.yaml");
    serde_norway::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// `!Tag value` as (tag, value).
fn tagged(value: &Value) -> Option<(String, &Value)> {
    match value {
        Value::Tagged(tagged) => Some((tagged.tag.to_string(), &tagged.value)),
        _ => None,
    }
}

#[test]
fn every_function_logs_as_text() {
    // A JSON log format wraps every line the function prints in an object of its own,
    // and its level filter drops lines without a level: the gateway's audit records,
    // printed for Lambda to deliver to the audit group, would be unreadable or gone.
    let template = template();
    let functions: Vec<(&Value, &Value)> = template["Resources"]
        .as_mapping()
        .unwrap()
        .iter()
        .filter(|(_, resource)| resource["Type"] == "AWS::Serverless::Function")
        .collect();
    assert_eq!(functions.len(), 2, "the gateway and the sweeper");
    for (name, function) in functions {
        assert_eq!(function["Properties"]["LoggingConfig"]["LogFormat"], "Text", "{name:?}");
    }
}

#[test]
fn the_sweepers_reserved_concurrency_is_a_parameter_an_account_with_a_low_quota_sets_to_none() {
    let template = template();
    let parameter = &template["Parameters"]["SweeperReservedConcurrency"];
    assert_eq!((parameter["Default"].as_u64(), parameter["MinValue"].as_u64()), (Some(1), Some(0)));
    let reserved = &template["Resources"]["SweeperFunction"]["Properties"]["ReservedConcurrentExecutions"];
    let (tag, arms) = tagged(reserved).expect("an !If on the parameter, not a number");
    assert_eq!(tag, "!If");
    assert_eq!(arms[0], "HasSweeperReservedConcurrency");
    assert_eq!(
        tagged(&arms[1]).map(|(tag, v)| (tag, v.clone())),
        Some(("!Ref".into(), "SweeperReservedConcurrency".into()))
    );
    assert_eq!(tagged(&arms[2]).map(|(tag, v)| (tag, v.clone())), Some(("!Ref".into(), "AWS::NoValue".into())));
    let condition = &template["Conditions"]["HasSweeperReservedConcurrency"];
    assert!(tagged(condition).is_some_and(|(tag, _)| tag == "!Not"), "{condition:?}");
}
