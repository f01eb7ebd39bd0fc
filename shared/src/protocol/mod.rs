//! Wire formats: the OpenAI surface and the server-sent events it streams.

pub mod openai;
pub mod sse;
pub mod vision;
