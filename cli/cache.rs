//! The response cache's store, as `serve` opens it, and `flexway cache purge|stats`
//! (SPEC §13, §16).

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use flexway::cache::{CacheStore, Failed};
use flexway::config::{CacheStoreConfig, Config, ProcessEnv, Secrets};

use crate::aws;

/// The store `ai.cache.store` names, opened (its schema or table checked). An error
/// names the store and why.
pub async fn open(config: &CacheStoreConfig) -> anyhow::Result<Arc<dyn CacheStore>> {
    Ok(match config {
        CacheStoreConfig::Embedded { path } => Arc::new(flexway::cache::embedded::EmbeddedCacheStore::open(path)?),
        CacheStoreConfig::Postgres { url } => {
            let url = aws::secret_source().resolve(url).await?;
            crate::postgres::cache_store(url.expose()).await?
        }
        CacheStoreConfig::DynamoDb { table } => aws::dynamodb_cache(table).await?,
    })
}

/// The store for `serve`: one that fails to open is logged and serves every call as a
/// miss until a restart (SPEC §16: the gateway starts anyway).
pub async fn for_serving(config: &Config) -> Option<Arc<dyn CacheStore>> {
    let store = &config.ai.cache.as_ref()?.store;
    Some(match open(store).await {
        Ok(store) => store,
        Err(e) => {
            tracing::error!("ai.cache.store: {e:#}; every call is a cache miss until a restart");
            Arc::new(Failed(format!("{e:#}")))
        }
    })
}

/// `flexway cache purge`: removes `tenant`'s entries (of `policy` only, if given).
pub fn purge(config: &Path, tenant: &str, policy: Option<&str>) -> ExitCode {
    run(config, |store| async move {
        let removed = store.purge(tenant, policy).await?;
        let of = policy.map_or_else(String::new, |p| format!(" (policy {p})"));
        println!("removed {removed} cached answer(s) of tenant {tenant}{of}");
        Ok(())
    })
}

/// `flexway cache stats`: entries and bytes per tenant and policy, as a table.
pub fn stats(config: &Path) -> ExitCode {
    run(config, |store| async move {
        let stats = store.stats().await?;
        println!("{:<24} {:<24} {:>10} {:>14}", "tenant", "policy", "entries", "bytes");
        for row in stats {
            println!("{:<24} {:<24} {:>10} {:>14}", row.tenant, row.policy, row.entries, row.bytes);
        }
        Ok(())
    })
}

fn run<F, Fut>(path: &Path, act: F) -> ExitCode
where
    F: FnOnce(Arc<dyn CacheStore>) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let done = async {
        let loaded = flexway::config::load_file_with(path, &ProcessEnv, Secrets::Check).map_err(|e| {
            anyhow::anyhow!("{}: {} error(s); `flexway validate` lists them", path.display(), e.count())
        })?;
        let Some(cache) = &loaded.config.ai.cache else {
            anyhow::bail!("{}: no ai.cache: nothing is cached", path.display());
        };
        act(open(&cache.store).await?).await
    };
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(done) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
