//! The response cache on PostgreSQL with pgvector (SPEC §16, `{kind: postgres, url}`):
//! the fleet's store, and the serverless shape's in a VPC (Aurora PostgreSQL). One
//! table holds every tenant's entries; a row is a partition hash, an exact hash, a
//! guard, an optional embedding and the sealed entry. Clear text never reaches it.
//!
//! Invariants: every query is filtered by its partition in SQL, so no lookup returns
//! another partition's (or tenant's) entry. A store that fails is a miss: every
//! method answers [`StoreError::Unavailable`] on a connection error or when the server
//! does not answer in time, and a later call reconnects.
//!
//! Embeddings differ in dimension across policies, and an HNSW index needs one. The
//! column is an untyped `vector`, with one partial expression index per dimension
//! (`USING hnsw ((vector::vector(N)) vector_cosine_ops) WHERE vector_dims(vector) = N`),
//! made on the first store of that dimension; a lookup repeats the expression and the
//! predicate so that the planner can use it. The HNSW scan filters by partition after
//! the index, so each session sets `hnsw.iterative_scan = relaxed_order`: the scan goes
//! on until it finds rows of the partition instead of returning none. (A session
//! setting, not `SET LOCAL` in a transaction: the connection is shared by concurrent
//! calls, which pipeline their statements on it.)

use std::collections::{HashMap, HashSet};
use std::error::Error as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use flexway::cache::{CacheStore, Entry, Found, Lookup, Sealed, Stats, StoreError};
use pgvector::Vector;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use tokio::time::error::Elapsed;
use tokio_postgres::config::SslMode;
use tokio_postgres::{Client, Config, NoTls, Row, Statement};
use tokio_postgres_rustls::MakeRustlsConnect;

/// The most a connection (TCP, TLS, startup and the schema) takes before the store
/// counts as unavailable.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// The most a lookup, store, purge or stats call waits for the server; past it the
/// connection is dropped (a server that went silent) and the next call reconnects.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(3);
/// A purge (`flexway cache purge`, an operator's command) may delete a whole tenant.
const PURGE_TIMEOUT: Duration = Duration::from_secs(120);
/// After a failed connection, calls are misses at once for this long rather than each
/// waiting for a connection of its own.
const RETRY_AFTER: Duration = Duration::from_secs(1);
/// Semantic candidates read per lookup: `relaxed_order` may return the nearest rows
/// slightly out of order, so a few are read and the best is chosen here.
const CANDIDATES: usize = 4;
/// Expired rows deleted by each store, at most.
const SWEEP: usize = 64;
/// Eviction reads the tenant's newest `max_entries_per_tenant` index entries to find
/// its cut-off (a B-tree does not count): ~0.3 µs each, 30 ms at 100,000. Up to this
/// limit every store evicts; past it, one store in [`EVICT_EVERY`] does, so that a
/// tenant holds at most its limit plus the last few stores of each gateway.
const EVICT_ALWAYS_UP_TO: u64 = 1024;
const EVICT_EVERY: u64 = 16;
/// Entries evicted by one store, at most (each store adds one).
const EVICT: usize = 256;
/// The HNSW scan's candidate list (pgvector's default is 40).
const EF_SEARCH: usize = 100;
/// The advisory lock under which schema changes are made, so that gateways starting
/// together do not race on `CREATE ... IF NOT EXISTS`.
const SCHEMA_LOCK: i64 = 0x666c_6578_7761_7901;

const SCHEMA: &str = "
CREATE EXTENSION IF NOT EXISTS vector;
CREATE TABLE IF NOT EXISTS flexway_cache_entries (
  partition bytea NOT NULL,
  tenant text NOT NULL,
  policy text NOT NULL,
  exact bytea NOT NULL,
  guard bigint NOT NULL,
  vector vector NULL,
  sealed bytea NOT NULL,
  stored_at bigint NOT NULL,
  expires_at bigint NOT NULL,
  PRIMARY KEY (partition, exact));
CREATE INDEX IF NOT EXISTS flexway_cache_entries_tenant ON flexway_cache_entries (tenant, stored_at)
  INCLUDE (partition, exact);
CREATE INDEX IF NOT EXISTS flexway_cache_entries_expiry ON flexway_cache_entries (expires_at);";

/// The response cache in a PostgreSQL database with pgvector.
pub struct PostgresCacheStore {
    config: Config,
    /// `sslmode=require`: rustls; otherwise plain TCP.
    tls: Option<MakeRustlsConnect>,
    /// Lookups, on the request path, have a connection of their own: they never wait
    /// behind a store (its HNSW insert and eviction) on a connection's queue.
    reads: Link,
    /// Stores, purges and stats.
    writes: Link,
    /// The dimensions whose index this store has made (or found) already.
    indexed: Mutex<HashSet<usize>>,
    /// Stores made, for [`EVICT_EVERY`].
    stores: AtomicU64,
}

/// A connection, made on first use and made again after it fails.
#[derive(Default)]
struct Link {
    slot: Mutex<Slot>,
    /// Held while a connection is being made, so that concurrent calls wait for one
    /// connection instead of each making its own.
    connecting: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct Slot {
    session: Option<Arc<Session>>,
    /// Set by a failed connection: no new attempt before then.
    retry_at: Option<Instant>,
}

/// One connection and the statements prepared on it.
struct Session {
    client: Client,
    statements: Mutex<HashMap<Sql, Statement>>,
}

impl PostgresCacheStore {
    /// A store on `url` (`postgres://user:password@host:port/db?sslmode=require`, or
    /// libpq's `key=value` form) that connects on first use. TLS when the URL says
    /// `sslmode=require`: the server's certificate is checked against the Mozilla roots
    /// and, with `sslrootcert=<file>`, the PEM bundle in that file (Amazon RDS's CAs
    /// for Aurora). Fails only on a malformed URL or an unreadable `sslrootcert`.
    pub fn new(url: &str) -> Result<PostgresCacheStore, StoreError> {
        let (url, root_cert) = split_root_cert(url);
        let mut config: Config =
            url.parse().map_err(|e| StoreError::Unavailable(format!("the PostgreSQL URL: {}", describe(&e))))?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        let tls = match config.get_ssl_mode() {
            SslMode::Require => Some(tls(root_cert.as_deref())?),
            _ => None,
        };
        Ok(PostgresCacheStore {
            config,
            tls,
            reads: Link::default(),
            writes: Link::default(),
            indexed: Mutex::default(),
            stores: AtomicU64::new(0),
        })
    }

    /// [`new`](Self::new), connected (both connections), with its schema made
    /// (idempotently): fails when the server cannot be reached within
    /// [`CONNECT_TIMEOUT`].
    pub async fn connect(url: &str) -> Result<PostgresCacheStore, StoreError> {
        let store = PostgresCacheStore::new(url)?;
        store.session(&store.writes).await?;
        store.session(&store.reads).await?;
        Ok(store)
    }

    /// `link`'s live connection, or a new one.
    async fn session(&self, link: &Link) -> Result<Arc<Session>, StoreError> {
        if let Some(session) = link.live() {
            return Ok(session);
        }
        let _connecting = link.connecting.lock().await;
        if let Some(session) = link.live() {
            return Ok(session);
        }
        if link.lock_slot().retry_at.is_some_and(|at| Instant::now() < at) {
            return Err(StoreError::Unavailable("PostgreSQL: the last connection attempt failed".to_owned()));
        }
        let opened = match tokio::time::timeout(CONNECT_TIMEOUT, self.open()).await {
            Ok(opened) => opened,
            Err(_) => Err(StoreError::Unavailable(format!("PostgreSQL: no connection within {CONNECT_TIMEOUT:?}"))),
        };
        let mut slot = link.lock_slot();
        match opened {
            Ok(session) => {
                let session = Arc::new(session);
                *slot = Slot { session: Some(session.clone()), retry_at: None };
                Ok(session)
            }
            Err(e) => {
                slot.retry_at = Some(Instant::now() + RETRY_AFTER);
                Err(e)
            }
        }
    }

    /// A connection with the schema made and the session's HNSW settings.
    async fn open(&self) -> Result<Session, StoreError> {
        let unavailable = |e: tokio_postgres::Error| StoreError::Unavailable(format!("PostgreSQL: {}", describe(&e)));
        let client = match &self.tls {
            Some(tls) => {
                let (client, connection) = self.config.connect(tls.clone()).await.map_err(unavailable)?;
                tokio::spawn(connection);
                client
            }
            None => {
                let (client, connection) = self.config.connect(NoTls).await.map_err(unavailable)?;
                tokio::spawn(connection);
                client
            }
        };
        client
            .batch_execute(&format!(
                "BEGIN; SELECT pg_advisory_xact_lock({SCHEMA_LOCK}); {SCHEMA} COMMIT;
                 SET hnsw.iterative_scan = relaxed_order; SET hnsw.ef_search = {EF_SEARCH};"
            ))
            .await
            .map_err(unavailable)?;
        Ok(Session { client, statements: Mutex::default() })
    }

    /// The HNSW index of `dimension`'s rows, made if this store has not seen it yet.
    async fn index(&self, session: &Session, dimension: usize) -> Result<(), tokio_postgres::Error> {
        let known = |indexed: &HashSet<usize>| indexed.contains(&dimension);
        if known(&self.indexed.lock().unwrap_or_else(PoisonError::into_inner)) {
            return Ok(());
        }
        if let Some(create) = Dimension(dimension).index() {
            // One simple query: one transaction, which holds the lock to its end.
            session.client.batch_execute(&format!("SELECT pg_advisory_xact_lock({SCHEMA_LOCK}); {create}")).await?;
        }
        self.indexed.lock().unwrap_or_else(PoisonError::into_inner).insert(dimension);
        Ok(())
    }

    /// A call's outcome as the port answers it; a connection that timed out or closed
    /// is dropped, so that the next call reconnects.
    fn settle<T>(
        link: &Link,
        session: &Arc<Session>,
        outcome: Result<Result<T, tokio_postgres::Error>, Elapsed>,
    ) -> Result<T, StoreError> {
        let error = match outcome {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(e)) if !e.is_closed() && !session.client.is_closed() => {
                return Err(StoreError::Unavailable(format!("PostgreSQL: {}", describe(&e))));
            }
            Ok(Err(e)) => format!("PostgreSQL: {}", describe(&e)),
            Err(_) => "PostgreSQL: no answer in time".to_owned(),
        };
        let mut slot = link.lock_slot();
        if slot.session.as_ref().is_some_and(|current| Arc::ptr_eq(current, session)) {
            slot.session = None;
        }
        Err(StoreError::Unavailable(error))
    }
}

impl Link {
    fn live(&self) -> Option<Arc<Session>> {
        self.lock_slot().session.clone().filter(|session| !session.client.is_closed())
    }

    fn lock_slot(&self) -> std::sync::MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Session {
    /// `sql` prepared on this connection (once).
    async fn statement(&self, sql: Sql) -> Result<Statement, tokio_postgres::Error> {
        if let Some(statement) = self.statements.lock().unwrap_or_else(PoisonError::into_inner).get(&sql) {
            return Ok(statement.clone());
        }
        let statement = self.client.prepare(&sql.text()).await?;
        self.statements.lock().unwrap_or_else(PoisonError::into_inner).insert(sql, statement.clone());
        Ok(statement)
    }
}

#[async_trait]
impl CacheStore for PostgresCacheStore {
    async fn lookup(&self, lookup: &Lookup<'_>) -> Result<Option<Found>, StoreError> {
        let session = self.session(&self.reads).await?;
        let partition = &lookup.partition.id[..];
        let exact = &lookup.probe.exact[..];
        let (now, since) = (int(lookup.now), int(lookup.stored_since));
        let call = async {
            match lookup.probe.vector.as_deref().filter(|vector| !vector.is_empty()) {
                None => {
                    let statement = session.statement(Sql::Exact).await?;
                    session.client.query(&statement, &[&partition, &exact, &now, &since]).await
                }
                Some(vector) => {
                    let statement = session.statement(Sql::Similar(vector.len())).await?;
                    let probe = Vector::from(vector.to_vec());
                    let guard = guard(lookup.probe.guard);
                    session.client.query(&statement, &[&partition, &exact, &now, &since, &probe, &guard]).await
                }
            }
        };
        let rows = Self::settle(&self.reads, &session, tokio::time::timeout(CALL_TIMEOUT, call).await)?;
        best(&rows, lookup.threshold)
    }

    async fn store(&self, entry: Entry<'_>) -> Result<(), StoreError> {
        let session = self.session(&self.writes).await?;
        let vector = entry.probe.vector.as_deref().filter(|vector| !vector.is_empty());
        let call = async {
            if let Some(vector) = vector {
                self.index(&session, vector.len()).await?;
            }
            let max = entry.max_entries_per_tenant;
            let evict =
                max <= EVICT_ALWAYS_UP_TO || self.stores.fetch_add(1, Ordering::Relaxed).is_multiple_of(EVICT_EVERY);
            let statement = session.statement(Sql::Store { evict }).await?;
            let keep_others = int(entry.max_entries_per_tenant.saturating_sub(1));
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 10] = [
                &&entry.partition.id[..],
                &entry.partition.tenant,
                &entry.partition.policy,
                &&entry.probe.exact[..],
                &guard(entry.probe.guard),
                &vector.map(|vector| Vector::from(vector.to_vec())),
                &entry.sealed.0,
                &int(entry.stored_at),
                &int(entry.expires_at),
                &keep_others,
            ];
            session.client.execute(&statement, &params).await
        };
        Self::settle(&self.writes, &session, tokio::time::timeout(CALL_TIMEOUT, call).await).map(drop)
    }

    async fn purge(&self, tenant: &str, policy: Option<&str>) -> Result<u64, StoreError> {
        let session = self.session(&self.writes).await?;
        let call = async {
            let statement = session.statement(Sql::Purge).await?;
            session.client.execute(&statement, &[&tenant, &policy]).await
        };
        Self::settle(&self.writes, &session, tokio::time::timeout(PURGE_TIMEOUT, call).await)
    }

    async fn stats(&self) -> Result<Vec<Stats>, StoreError> {
        let session = self.session(&self.writes).await?;
        let now = int(flexway::budget::period::unix_now());
        let call = async {
            let statement = session.statement(Sql::Stats).await?;
            session.client.query(&statement, &[&now]).await
        };
        let rows = Self::settle(&self.writes, &session, tokio::time::timeout(CALL_TIMEOUT, call).await)?;
        rows.iter()
            .map(|row| {
                Ok(Stats {
                    tenant: row.try_get(0).map_err(corrupt)?,
                    policy: row.try_get(1).map_err(corrupt)?,
                    entries: count(row.try_get(2).map_err(corrupt)?),
                    bytes: count(row.try_get(3).map_err(corrupt)?),
                })
            })
            .collect()
    }
}

/// The statements a session prepares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Sql {
    /// $1 partition, $2 exact, $3 now, $4 stored_since.
    Exact,
    /// [`Sql::Exact`]'s, then $5 the probe's vector (of this dimension), $6 its guard.
    Similar(usize),
    /// $1 partition, $2 tenant, $3 policy, $4 exact, $5 guard, $6 vector, $7 sealed,
    /// $8 stored_at, $9 expires_at, $10 how many other entries the tenant keeps
    /// (ignored without `evict`).
    Store { evict: bool },
    /// $1 tenant, $2 policy or NULL.
    Purge,
    /// $1 now.
    Stats,
}

/// A lookup's rows read as (sealed, whether it is the exact match, similarity,
/// stored_at, exact hash).
const ALIVE: &str = "partition = $1 AND expires_at > $3 AND stored_at >= $4";

impl Sql {
    fn text(self) -> String {
        match self {
            Sql::Exact => format!(
                "SELECT sealed, true, 1::float8, stored_at, exact FROM flexway_cache_entries WHERE {ALIVE} AND exact = $2"
            ),
            // The exact match, else (only then: the one-time filter skips the scan) the
            // nearest entries with the guard, in one round trip.
            Sql::Similar(dimension) => {
                let dimension = Dimension(dimension);
                let (column, probe, n) = (dimension.column(), dimension.probe("$5"), dimension.0);
                format!(
                    "WITH hit AS (SELECT sealed, stored_at, exact FROM flexway_cache_entries WHERE {ALIVE} AND exact = $2)
                     SELECT sealed, true, 1::float8, stored_at, exact FROM hit
                     UNION ALL
                     (SELECT sealed, false, 1 - ({column} <=> {probe}), stored_at, exact FROM flexway_cache_entries
                      WHERE NOT EXISTS (SELECT FROM hit) AND {ALIVE} AND guard = $6 AND vector_dims(vector) = {n}
                      ORDER BY {column} <=> {probe} LIMIT {CANDIDATES})"
                )
            }
            // The upsert, the eviction of the tenant's oldest past its limit and a bounded
            // sweep of expired rows, in one statement. Every part reads the table as it
            // was before the statement: the eviction keeps the newest `$10` entries other
            // than the one written (those stored in the same second as the newest evicted
            // go with it), and neither delete touches that one. The eviction's cut-off is
            // read from the tenant index alone (an index-only scan, `INCLUDE`), and its
            // delete reaches only the oldest rows, by the same index. Without `evict`,
            // the eviction's one-time filter is false and it reads nothing.
            Sql::Store { evict } => format!(
                "WITH written AS (
                   INSERT INTO flexway_cache_entries
                     (partition, tenant, policy, exact, guard, vector, sealed, stored_at, expires_at)
                   VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
                   ON CONFLICT (partition, exact) DO UPDATE SET tenant = excluded.tenant,
                     policy = excluded.policy, guard = excluded.guard, vector = excluded.vector,
                     sealed = excluded.sealed, stored_at = excluded.stored_at, expires_at = excluded.expires_at),
                 evicted AS (
                   DELETE FROM flexway_cache_entries WHERE {evict} AND ctid IN (
                     SELECT ctid FROM flexway_cache_entries
                     WHERE tenant = $2 AND (partition, exact) <> ($1, $4) AND stored_at <= (
                       SELECT stored_at FROM flexway_cache_entries
                       WHERE tenant = $2 AND (partition, exact) <> ($1, $4)
                       ORDER BY stored_at DESC OFFSET $10 LIMIT 1)
                     ORDER BY stored_at LIMIT {EVICT})),
                 swept AS (
                   DELETE FROM flexway_cache_entries WHERE ctid IN (
                     SELECT ctid FROM flexway_cache_entries
                     WHERE expires_at <= $8 AND (partition, exact) <> ($1, $4) LIMIT {SWEEP}))
                 SELECT 1"
            ),
            Sql::Purge => {
                "DELETE FROM flexway_cache_entries WHERE tenant = $1 AND ($2::text IS NULL OR policy = $2)".to_owned()
            }
            Sql::Stats => "SELECT tenant, policy, count(*), coalesce(sum(octet_length(sealed)), 0)::bigint
                 FROM flexway_cache_entries WHERE expires_at > $1 GROUP BY tenant, policy ORDER BY tenant, policy"
                .to_owned(),
        }
    }
}

/// Embeddings of one dimension, as their index and the lookups read them: pgvector's
/// HNSW indexes `vector` up to 2,000 dimensions and `halfvec` up to 4,000; larger
/// ones are compared without an index.
struct Dimension(usize);

impl Dimension {
    fn column(&self) -> String {
        match self.0 {
            ..=2000 => format!("(vector::vector({}))", self.0),
            2001..=4000 => format!("(vector::halfvec({}))", self.0),
            _ => "vector".to_owned(),
        }
    }

    fn probe(&self, parameter: &str) -> String {
        match self.0 {
            2001..=4000 => format!("{parameter}::vector::halfvec({})", self.0),
            _ => parameter.to_owned(),
        }
    }

    fn index(&self) -> Option<String> {
        let ops = match self.0 {
            ..=2000 => "vector_cosine_ops",
            2001..=4000 => "halfvec_cosine_ops",
            _ => return None,
        };
        Some(format!(
            "CREATE INDEX IF NOT EXISTS flexway_cache_entries_hnsw_{n} ON flexway_cache_entries
             USING hnsw ({column} {ops}) WHERE vector_dims(vector) = {n}",
            n = self.0,
            column = self.column(),
        ))
    }
}

/// The exact match among `rows`, else the most similar at or above `threshold`.
fn best(rows: &[Row], threshold: f32) -> Result<Option<Found>, StoreError> {
    let mut best: Option<Found> = None;
    for row in rows {
        let exact: bool = row.try_get(1).map_err(corrupt)?;
        let similarity = if exact { 1.0 } else { row.try_get::<_, f64>(2).map_err(corrupt)? as f32 };
        if !exact && (similarity < threshold || best.as_ref().is_some_and(|best| best.similarity >= similarity)) {
            continue;
        }
        let hash: &[u8] = row.try_get(4).map_err(corrupt)?;
        let found = Found {
            sealed: Sealed(row.try_get(0).map_err(corrupt)?),
            exact: hash
                .try_into()
                .map_err(|_| StoreError::Corrupt(format!("an exact hash of {} bytes", hash.len())))?,
            similarity,
            stored_at: count(row.try_get(3).map_err(corrupt)?),
        };
        if exact {
            return Ok(Some(found));
        }
        best = Some(found);
    }
    Ok(best)
}

/// The URL without `sslrootcert` (libpq's CA bundle, which tokio-postgres does not
/// know and would refuse), and that file.
fn split_root_cert(url: &str) -> (String, Option<String>) {
    let mut root_cert = None;
    let mut take = |part: &str| match part.strip_prefix("sslrootcert=") {
        Some(value) => {
            root_cert = Some(percent_encoding::percent_decode_str(value).decode_utf8_lossy().into_owned());
            false
        }
        None => true,
    };
    let url = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        match url.split_once('?') {
            Some((base, query)) => {
                let query: Vec<&str> = query.split('&').filter(|part| take(part)).collect();
                if query.is_empty() { base.to_owned() } else { format!("{base}?{}", query.join("&")) }
            }
            None => url.to_owned(),
        }
    } else {
        url.split_whitespace().filter(|part| take(part)).collect::<Vec<_>>().join(" ")
    };
    (url, root_cert)
}

/// rustls on `ring`, trusting the Mozilla roots and the PEM certificates in `root_cert`.
fn tls(root_cert: Option<&str>) -> Result<MakeRustlsConnect, StoreError> {
    let error = |what: String| StoreError::Unavailable(format!("PostgreSQL TLS: {what}"));
    let mut roots = rustls::RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() };
    if let Some(path) = root_cert {
        let certs = CertificateDer::pem_file_iter(path)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .map_err(|e| error(format!("sslrootcert {path}: {e}")))?;
        if certs.is_empty() {
            return Err(error(format!("sslrootcert {path} holds no PEM certificate")));
        }
        for cert in certs {
            roots.add(cert).map_err(|e| error(format!("sslrootcert {path}: {e}")))?;
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| error(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(MakeRustlsConnect::new(config))
}

/// An error with its cause (tokio-postgres's own text names only the kind).
fn describe(e: &tokio_postgres::Error) -> String {
    match e.source() {
        Some(cause) => format!("{e}: {cause}"),
        None => e.to_string(),
    }
}

fn corrupt(e: tokio_postgres::Error) -> StoreError {
    StoreError::Corrupt(format!("PostgreSQL: {}", describe(&e)))
}

/// A guard as the `bigint` column keeps it (the same 64 bits).
fn guard(guard: u64) -> i64 {
    i64::from_ne_bytes(guard.to_ne_bytes())
}

/// Unix seconds as a `bigint`.
fn int(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

fn count(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sslrootcert_is_taken_out_of_either_form_of_url() {
        assert_eq!(
            split_root_cert("postgres://u:p@db:5432/c?sslmode=require&sslrootcert=%2Fetc%2Frds.pem&application_name=x"),
            ("postgres://u:p@db:5432/c?sslmode=require&application_name=x".to_owned(), Some("/etc/rds.pem".to_owned()))
        );
        assert_eq!(
            split_root_cert("postgresql://db/c?sslrootcert=/etc/rds.pem"),
            ("postgresql://db/c".to_owned(), Some("/etc/rds.pem".to_owned()))
        );
        assert_eq!(
            split_root_cert("host=db sslmode=require sslrootcert=/etc/rds.pem dbname=c"),
            ("host=db sslmode=require dbname=c".to_owned(), Some("/etc/rds.pem".to_owned()))
        );
        assert_eq!(split_root_cert("postgres://db/c"), ("postgres://db/c".to_owned(), None));
    }

    #[test]
    fn an_index_per_dimension_within_pgvectors_limits() {
        assert!(Dimension(256).index().unwrap().contains("((vector::vector(256)) vector_cosine_ops)"));
        assert!(Dimension(3072).index().unwrap().contains("((vector::halfvec(3072)) halfvec_cosine_ops)"));
        assert_eq!(Dimension(3072).probe("$5"), "$5::vector::halfvec(3072)");
        assert_eq!(Dimension(4001).index(), None);
    }

    #[test]
    fn a_guard_keeps_its_64_bits() {
        assert_eq!(guard(u64::MAX), -1);
        assert_eq!(u64::from_ne_bytes(guard(0x8000_0000_0000_0001).to_ne_bytes()), 0x8000_0000_0000_0001);
    }
}
