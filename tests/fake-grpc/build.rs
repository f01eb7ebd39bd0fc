//! ocr.proto → the FileDescriptorSet the gateway reads (`OUT_DIR/ocr.binpb`, its
//! custom options kept) and the tonic stubs of the fake server and its clients.

use std::path::PathBuf;

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let contract = manifest.join("../../proto");
    println!("cargo:rerun-if-changed={}", manifest.join("ocr.proto").display());
    println!("cargo:rerun-if-changed={}", contract.join("flexway/v1/options.proto").display());

    let mut compiler = protox::Compiler::new([manifest.clone(), contract])?;
    compiler.include_imports(true);
    compiler.open_files(["ocr.proto"])?;
    // Encoded by protox itself, so the method options keep their extension (a
    // `prost_types` round trip would drop it as an unknown field).
    let set = compiler.encode_file_descriptor_set();
    std::fs::write(out.join("ocr.binpb"), &set)?;
    let fds = prost_types::FileDescriptorSet::decode(set.as_slice())?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
