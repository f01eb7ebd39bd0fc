//! The OTLP messages Flexway sends (opentelemetry-proto, v1), as the
//! `opentelemetry-proto` crate generates them from the protocol's `.proto` files:
//! the messages only (no SDK pipeline, no gRPC client); they are posted as
//! `application/x-protobuf`. This module names what the exporter uses and makes
//! attributes from Rust values.

pub use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
pub use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
pub use opentelemetry_proto::tonic::common::v1::any_value::Value;
pub use opentelemetry_proto::tonic::common::v1::{AnyValue, ArrayValue, InstrumentationScope, KeyValue};
pub use opentelemetry_proto::tonic::metrics::v1::metric::Data;
pub use opentelemetry_proto::tonic::metrics::v1::{
    AggregationTemporality, Histogram, HistogramDataPoint, Metric, ResourceMetrics, ScopeMetrics,
};
pub use opentelemetry_proto::tonic::resource::v1::Resource;
pub use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
pub use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
pub use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span, SpanFlags, Status};

/// An attribute, from anything that reads as one of OTLP's values.
pub fn kv(key: &str, value: impl Attribute) -> KeyValue {
    KeyValue { key: key.to_owned(), value: Some(AnyValue { value: Some(value.otlp()) }), ..Default::default() }
}

/// A Rust value as an OTLP attribute's value.
pub trait Attribute {
    fn otlp(self) -> Value;
}

impl Attribute for &str {
    fn otlp(self) -> Value {
        Value::StringValue(self.to_owned())
    }
}

impl Attribute for String {
    fn otlp(self) -> Value {
        Value::StringValue(self)
    }
}

impl Attribute for u64 {
    fn otlp(self) -> Value {
        Value::IntValue(i64::try_from(self).unwrap_or(i64::MAX))
    }
}

impl Attribute for f64 {
    fn otlp(self) -> Value {
        Value::DoubleValue(self)
    }
}

impl Attribute for bool {
    fn otlp(self) -> Value {
        Value::BoolValue(self)
    }
}

impl Attribute for Vec<String> {
    fn otlp(self) -> Value {
        let values = self.into_iter().map(|s| AnyValue { value: Some(Value::StringValue(s)) }).collect();
        Value::ArrayValue(ArrayValue { values })
    }
}
