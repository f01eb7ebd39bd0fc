//! Flexway's core: everything the gateway does, with no Lambda, AWS or store technology
//! in it. The binaries (`flexway serve`, the Lambda functions) build adapters and call
//! [`http::app`]; tests drive the same router.

pub mod admission;
pub mod audit;
pub mod budget;
pub mod cache;
pub mod call;
pub mod config;
pub mod console;
pub mod error;
pub mod gateway;
pub mod http;
pub mod identity;
mod json;
pub mod mcp;
pub mod metering;
pub mod metrics;
pub mod money;
pub mod protocol;
pub mod realtime;
pub mod reconcile;
pub mod routing;
pub mod secret;
pub mod telemetry;
pub mod upstream;

pub use gateway::Gateway;
