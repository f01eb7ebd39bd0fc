//! The response cache on PostgreSQL with pgvector (`ai.cache.store: {kind: postgres}`),
//! when built with the `postgres` feature.

use std::sync::Arc;

use flexway::cache::CacheStore;

#[cfg(feature = "postgres")]
pub async fn cache_store(url: &str) -> anyhow::Result<Arc<dyn CacheStore>> {
    Ok(Arc::new(flexway_postgres::PostgresCacheStore::connect(url).await?))
}

#[cfg(not(feature = "postgres"))]
pub async fn cache_store(_url: &str) -> anyhow::Result<Arc<dyn CacheStore>> {
    anyhow::bail!(
        "ai.cache.store: {{kind: postgres}}: this flexway was built without PostgreSQL; \
         build it with `cargo build --release --features postgres`"
    )
}
