//! The gRPC contract, `proto/flexway/v1/options.proto`, compiled (with its import,
//! `google/protobuf/descriptor.proto`) into `OUT_DIR/flexway_options.binpb`: the
//! descriptors every backend's descriptor set is read against, so that the
//! `(flexway.v1.operation)` option is known even in a set built without its imports.
//! protox is pure Rust: no build needs a system `protoc`.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let proto = manifest.join("../proto");
    println!("cargo:rerun-if-changed={}", proto.join("flexway/v1/options.proto").display());
    let mut compiler = protox::Compiler::new([proto])?;
    compiler.include_imports(true);
    compiler.open_files(["flexway/v1/options.proto"])?;
    std::fs::write(out.join("flexway_options.binpb"), compiler.encode_file_descriptor_set())?;
    Ok(())
}
