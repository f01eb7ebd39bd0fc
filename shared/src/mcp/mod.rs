//! MCP (SPEC §17): the pieces `/mcp` is built of, with no HTTP server and no gateway
//! in them. Federated tool names ([`names`]), who may use which server and call which
//! tool ([`policy`]), the sealed session id that lets any process serve any session
//! ([`session`]), the JSON-RPC messages, headers and SSE framing of Streamable HTTP
//! ([`wire`]), and the client that sends one message to an upstream server
//! ([`upstream`]).

pub mod names;
pub mod policy;
pub mod session;
pub mod upstream;
pub mod wire;
