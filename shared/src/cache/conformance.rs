//! The conformance suite every [`CacheStore`](super::CacheStore) passes.
