//! A `kind: grpc` backend's descriptor set (a serialized FileDescriptorSet), read at
//! load: the services it serves, each method's shape, and the metering its
//! `(flexway.v1.operation).ai` option declares (SPEC §10).
//!
//! The set is read with prost-reflect, which keeps the options' extensions (decoded
//! with prost-types alone, the option would be dropped as an unknown field), against
//! the contract compiled at build time (`proto/flexway/v1/options.proto`, build.rs):
//! a set built without its imports still has its option read. Every refusal names
//! the service and method; the caller adds the path in the document.

use std::collections::BTreeMap;

use prost_reflect::{DescriptorPool, DynamicMessage, MethodDescriptor, Value};

use super::model::{AiOperation, GrpcMetering, GrpcMethod, GrpcServices};
use crate::money::MicroEur;

/// `options.proto` and its import, as protox compiled them (build.rs).
const CONTRACT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/flexway_options.binpb"));
const OPERATION_EXTENSION: &str = "flexway.v1.operation";

/// The services of the set, or every reason it cannot be used.
pub(super) fn services(set: &[u8]) -> Result<GrpcServices, Vec<String>> {
    let mut pool = DescriptorPool::new();
    pool.decode_file_descriptor_set(CONTRACT).map_err(|e| vec![format!("the built-in contract: {e}")])?;
    // Files of the set already in the pool (the contract, its import) are skipped.
    pool.decode_file_descriptor_set(set)
        .map_err(|e| vec![format!("not a usable serialized FileDescriptorSet: {e}")])?;
    let extension = pool
        .get_extension_by_name(OPERATION_EXTENSION)
        .ok_or_else(|| vec![format!("the contract does not declare {OPERATION_EXTENSION}")])?;
    let mut services = BTreeMap::new();
    let mut errors = Vec::new();
    for service in pool.services() {
        let mut methods = BTreeMap::new();
        for method in service.methods() {
            let operation = match operation(&method.options(), &extension) {
                Ok(operation) => operation,
                Err(reason) => {
                    errors.push(format!("{}: (flexway.v1.operation).ai {reason}", rpc_name(&method)));
                    None
                }
            };
            let shape = GrpcMethod {
                client_streaming: method.is_client_streaming(),
                server_streaming: method.is_server_streaming(),
                operation,
            };
            methods.insert(method.name().to_owned(), shape);
        }
        services.insert(service.full_name().to_owned(), methods);
    }
    if services.is_empty() {
        errors.push("declares no service: a grpc backend serves the services of its descriptor set".to_owned());
    }
    if errors.is_empty() { Ok(GrpcServices { services }) } else { Err(errors) }
}

fn rpc_name(method: &MethodDescriptor) -> String {
    format!("/{}/{}", method.parent_service().full_name(), method.name())
}

/// The method's `ai` operation, `None` when it has none (unmetered).
fn operation(
    options: &DynamicMessage,
    extension: &prost_reflect::ExtensionDescriptor,
) -> Result<Option<AiOperation>, String> {
    if !options.has_extension(extension) {
        return Ok(None);
    }
    let operation = options.get_extension(extension);
    let Some(ai) = operation.as_message().and_then(|m| m.get_field_by_name("ai").map(|v| v.into_owned())) else {
        return Ok(None);
    };
    let Value::Message(ai) = ai else { return Ok(None) };
    if ai.fields().next().is_none() {
        return Ok(None);
    }
    let metering = match ai.get_field_by_name("metering").and_then(|v| v.as_enum_number()) {
        Some(1) => GrpcMetering::PerCall,
        Some(2) => GrpcMetering::PerByte,
        _ => return Err("has no metering: PER_CALL or PER_BYTE".to_owned()),
    };
    let price = ai.get_field_by_name("price_per_thousand_eur");
    let price = price.as_deref().and_then(Value::as_str).unwrap_or_default();
    let price_per_thousand = decimal_eur(price).map_err(|why| format!("price_per_thousand_eur {why}"))?;
    let feature = ai.get_field_by_name("feature");
    let feature = feature.as_deref().and_then(Value::as_str).unwrap_or_default().trim().to_owned();
    if feature.is_empty() {
        return Err("has no feature name (a metrics dimension, e.g. \"ocr\")".to_owned());
    }
    Ok(Some(AiOperation { metering, price_per_thousand, feature, cache: None }))
}

/// A decimal string of euros (`"0.25"`) to micro-euros, exactly: digits, at most one
/// point, at most 6 decimal places.
pub(super) fn decimal_eur(text: &str) -> Result<MicroEur, String> {
    let malformed = || format!("`{text}` is not a decimal number of euros (e.g. \"0.25\")");
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() && fraction.is_empty() || !digits(whole) || !digits(fraction) || text.ends_with('.') {
        return Err(malformed());
    }
    if fraction.len() > 6 {
        return Err(format!("`{text}` has more than 6 decimal places (money is counted in micro-euros)"));
    }
    let whole: u64 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| malformed())? };
    let micros: u64 = format!("{fraction:0<6}").parse().map_err(|_| malformed())?;
    whole
        .checked_mul(MicroEur::PER_EUR)
        .and_then(|w| w.checked_add(micros))
        .map(MicroEur)
        .ok_or_else(|| format!("`{text}` euros is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prices_are_exact_micro_euros() {
        assert_eq!(decimal_eur("0.25"), Ok(MicroEur(250_000)));
        assert_eq!(decimal_eur("2"), Ok(MicroEur(2_000_000)));
        assert_eq!(decimal_eur(".5"), Ok(MicroEur(500_000)));
        assert_eq!(decimal_eur("0.000001"), Ok(MicroEur(1)));
        for bad in ["", ".", "1.", "-1", "1e3", "0,25", "abc", " 1", "1.2.3"] {
            assert!(decimal_eur(bad).unwrap_err().contains("not a decimal"), "{bad}");
        }
        assert!(decimal_eur("0.0000001").unwrap_err().contains("more than 6 decimal places"));
    }

    #[test]
    fn costs_round_up_to_the_micro_euro() {
        let op = |price| AiOperation {
            metering: GrpcMetering::PerByte,
            price_per_thousand: MicroEur(price),
            feature: "f".into(),
            cache: None,
        };
        // 0.5 €/thousand bytes = 500 µ€ a byte.
        assert_eq!(op(500_000).cost(7), MicroEur(3_500));
        // 0.001 €/thousand = 1 µ€ a unit; 0.0005 €/thousand: 1 unit costs 0.5 µ€ → 1.
        assert_eq!(op(1_000).cost(3), MicroEur(3));
        assert_eq!(op(500).cost(1), MicroEur(1));
        assert_eq!(op(500).cost(0), MicroEur(0));
    }

    #[test]
    fn refuses_bytes_that_are_no_descriptor_set() {
        let errors = services(b"\xff\xff\xff").unwrap_err();
        assert!(errors[0].contains("not a usable serialized FileDescriptorSet"), "{errors:?}");
    }

    #[test]
    fn a_set_without_services_is_refused() {
        // The contract alone declares no service.
        let errors = services(CONTRACT).unwrap_err();
        assert!(errors[0].contains("declares no service"), "{errors:?}");
    }
}
