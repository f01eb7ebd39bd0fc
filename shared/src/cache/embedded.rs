//! The embedded cache store: one local file, an index per partition.
