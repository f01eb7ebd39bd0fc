//! `flexway key new`: a fresh key, shown once, and the line that declares its hash.

use std::process::ExitCode;

use rand::RngCore;

pub fn new(tenant: &str, agent: Option<&str>) -> ExitCode {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    let key = format!("fw-{}", hex::encode(bytes));
    let sha = flexway::identity::key_sha256_hex(&key);
    let entry = match agent {
        Some(agent) => format!("- {{sha256: {sha}, agent: {agent}}}"),
        None => format!("- {{sha256: {sha}}}"),
    };
    println!("key: {key}");
    println!("(shown once: Flexway keeps only its SHA-256)");
    println!();
    println!("add under tenants.{tenant}.keys in flexway.yaml:");
    println!("      {entry}");
    ExitCode::SUCCESS
}
