//! `fake-model`: serve the fake OpenAI- and Anthropic-compatible model on a
//! fixed address, for the README demo and the SDK tests. Scenarios work as in
//! the tests: `/s/<scenario>/v1`.

use std::net::SocketAddr;

use clap::Parser;
use fake_model::FakeModel;

/// An OpenAI- and Anthropic-compatible fake model server.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1:8081")]
    listen: SocketAddr,
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let args = Args::parse();
    let server = FakeModel::start_on(args.listen).await?;
    eprintln!("fake-model listening on http://{}", server.addr());
    tokio::signal::ctrl_c().await
}
