//! `fake-mcp`: serve the fake MCP server on a fixed address (its endpoint `/mcp`), for
//! trying the gateway's `/mcp` by hand and for the benchmark's figures.

use std::net::SocketAddr;

use clap::Parser;
use fake_mcp::FakeMcp;

/// An MCP server (Streamable HTTP) with the tools echo, add, fail, explode, slow and whoami.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1:7001")]
    listen: SocketAddr,
    /// Answer 401 to a request without `Authorization: Bearer TOKEN`.
    #[arg(long)]
    token: Option<String>,
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let args = Args::parse();
    let server = FakeMcp::start_on(args.listen, args.token).await?;
    eprintln!("fake-mcp listening on {}", server.url());
    tokio::signal::ctrl_c().await
}
