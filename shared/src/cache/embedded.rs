//! The embedded cache store (SPEC §16 `{kind: embedded, path}`): one local file, kept
//! whole in memory.
//!
//! In memory, each partition holds its entries in parallel arrays (exact hashes with a
//! map to their index, guards, times, sealed values, unit `f32` vectors and the 1-bit
//! sign codes of those vectors) behind one `RwLock`. An exact lookup is a map probe; a
//! semantic one scans the sign codes of the partition's live entries with the probe's
//! guard for the smallest Hamming distances (sign bits keep angles: the expected share
//! of differing bits is θ/π), keeps the [`candidates`] closest and re-ranks them by
//! their exact cosine. Measured at 100,000 entries of 256 dimensions, the scan finds
//! every entry above a 0.95 threshold (`benches/cache.rs`). A deletion is a swap-remove.
//!
//! The file is an append-only log of records (an entry put, an entry deleted, a
//! purge), each framed by its length and a CRC-32, replayed at [`EmbeddedCacheStore::open`].
//! A torn or corrupt tail is cut off (everything before it is kept) and reported with
//! a warning. Records are written by one thread (`flexway-cache`), in the order the
//! changes reached memory, so a lookup never waits on the disk and a store waits only
//! for memory; when the file's dead records outnumber its live entries, that thread
//! rewrites it from memory (a temporary file in the same directory, fsync, rename).
//! Expired entries are dropped from memory now and then and from the file at its next
//! rewrite or load, without a record.
//!
//! Invariants:
//! - the file holds what the store was given and nothing else: hashes, guards, times,
//!   tenant and policy names, vectors and the sealed bytes (never clear text);
//! - the file is locked (`flock`) for as long as the store is open, so a second
//!   process gets [`StoreError::Unavailable`] rather than a log two writers append to;
//! - the file reflects memory up to the records still queued: a killed process loses
//!   at most the last writes (a cache: misses, never a wrong answer).

use std::collections::{BTreeSet, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard, mpsc};
use std::thread::JoinHandle;

use async_trait::async_trait;

use super::{CacheStore, Entry, Found, Lookup, Sealed, Stats, StoreError, cosine};
use crate::budget::period::unix_now;

/// The file's first bytes.
const MAGIC: &[u8; 8] = b"FWCACHE1";
/// A record's frame: its body's length and CRC-32, little-endian.
const FRAME: usize = 8;
/// A record claiming more is corruption (an entry is far smaller).
const MAX_RECORD: usize = 256 << 20;
/// The file is rewritten only past this many records (and past twice its live entries).
const COMPACT_FLOOR: u64 = 4096;
/// How often expired entries are dropped from memory, in seconds.
const SWEEP_EVERY: u64 = 60;

const PUT: u8 = 1;
const DELETE: u8 = 2;
const PURGE: u8 = 3;

/// How many of the closest sign codes are re-ranked by their exact cosine in a
/// partition of `len` entries: 32, and one more per 4,096 entries.
pub fn candidates(len: usize) -> usize {
    32 + len / 4096
}

/// The local store: see the module's documentation.
pub struct EmbeddedCacheStore {
    index: Arc<RwLock<Index>>,
    /// Records to append, in the order their changes reached the index.
    log: Option<mpsc::Sender<Vec<u8>>>,
    writer: Option<JoinHandle<()>>,
}

/// [`EmbeddedCacheStore::open`].
pub fn open(path: &Path) -> Result<EmbeddedCacheStore, StoreError> {
    EmbeddedCacheStore::open(path)
}

impl EmbeddedCacheStore {
    /// Opens (or creates) the store kept in `path`, replaying its records; locks the
    /// file until the store is dropped.
    pub fn open(path: &Path) -> Result<EmbeddedCacheStore, StoreError> {
        let unavailable = |e: io::Error| StoreError::Unavailable(format!("{}: {e}", path.display()));
        let mut file = OpenOptions::new().read(true).append(true).create(true).open(path).map_err(unavailable)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(StoreError::Unavailable(format!(
                    "{} is in use by a running gateway (or another flexway process)",
                    path.display()
                )));
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(unavailable(e)),
        }
        let mut index = Index::default();
        let replayed = replay(&file, &mut index, path)?;
        if replayed.valid < replayed.len {
            tracing::warn!(
                path = %path.display(),
                kept_bytes = replayed.valid,
                cut_bytes = replayed.len - replayed.valid,
                "cache file: a torn or corrupt tail was cut off"
            );
            file.set_len(replayed.valid).map_err(unavailable)?;
        }
        if replayed.valid == 0 {
            file.write_all(MAGIC).map_err(unavailable)?;
        }
        index.sweep(unix_now());
        let index = Arc::new(RwLock::new(index));
        let mut writer =
            Writer { path: path.to_owned(), out: BufWriter::new(file), records: replayed.records, broken: false };
        if writer.due(&index) {
            writer.compact(&index).map_err(unavailable)?;
        }
        let (log, jobs) = mpsc::channel();
        let thread = {
            let index = index.clone();
            std::thread::Builder::new().name("flexway-cache".into()).spawn(move || writer.run(&jobs, &index))
        };
        let writer = thread.map_err(unavailable)?;
        Ok(EmbeddedCacheStore { index, log: Some(log), writer: Some(writer) })
    }

    fn read(&self) -> RwLockReadGuard<'_, Index> {
        self.index.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> RwLockWriteGuard<'_, Index> {
        self.index.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `records` for the file; called under the index's write lock, so the
    /// file sees changes in the order memory did.
    fn append(&self, records: Vec<Vec<u8>>) {
        if let Some(log) = &self.log {
            for record in records {
                // The writer thread ends only when `log` is dropped.
                let _ = log.send(record);
            }
        }
    }
}

impl Drop for EmbeddedCacheStore {
    /// Writes what is queued and closes the file (the lock goes with it).
    fn drop(&mut self) {
        drop(self.log.take());
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

#[async_trait]
impl CacheStore for EmbeddedCacheStore {
    async fn lookup(&self, lookup: &Lookup<'_>) -> Result<Option<Found>, StoreError> {
        Ok(self.read().partitions.get(&lookup.partition.id).and_then(|part| part.lookup(lookup)))
    }

    async fn store(&self, entry: Entry<'_>) -> Result<(), StoreError> {
        let vector = entry.probe.vector.as_deref();
        let record = put_record(&Row {
            partition: entry.partition.id,
            tenant: &entry.partition.tenant,
            policy: &entry.partition.policy,
            exact: entry.probe.exact,
            guard: entry.probe.guard,
            stored_at: entry.stored_at,
            expires_at: entry.expires_at,
            vector,
            sealed: &entry.sealed.0,
        });
        let mut index = self.write();
        index.sweep(unix_now());
        let partition = entry.partition;
        index.put(
            partition.id,
            &partition.tenant,
            &partition.policy,
            Item {
                exact: entry.probe.exact,
                guard: entry.probe.guard,
                stored_at: entry.stored_at,
                expires_at: entry.expires_at,
                sealed: entry.sealed,
                vector,
            },
        );
        let mut records = vec![record];
        for (id, exact) in index.evict(&partition.tenant, entry.max_entries_per_tenant) {
            records.push(delete_record(&id, &exact));
        }
        self.append(records);
        Ok(())
    }

    async fn purge(&self, tenant: &str, policy: Option<&str>) -> Result<u64, StoreError> {
        let mut index = self.write();
        let purged = index.purge(tenant, policy);
        self.append(vec![purge_record(tenant, policy)]);
        Ok(purged)
    }

    async fn stats(&self) -> Result<Vec<Stats>, StoreError> {
        Ok(self.read().stats(unix_now()))
    }
}

/// An entry to put in a partition.
struct Item<'a> {
    exact: [u8; 32],
    guard: u64,
    stored_at: u64,
    expires_at: u64,
    sealed: Sealed,
    vector: Option<&'a [f32]>,
}

/// An entry by age: `(stored_at, partition, exact)`.
type Age = (u64, [u8; 32], [u8; 32]);

#[derive(Default)]
struct Index {
    partitions: HashMap<[u8; 32], Part>,
    /// Each tenant's entries, oldest first.
    ages: HashMap<String, BTreeSet<Age>>,
    /// Entries in memory, expired ones not yet swept included.
    len: u64,
    /// When expired entries are next dropped, Unix seconds.
    next_sweep: u64,
}

impl Index {
    fn put(&mut self, id: [u8; 32], tenant: &str, policy: &str, item: Item<'_>) {
        let part = self.partitions.entry(id).or_insert_with(|| Part::new(tenant, policy));
        let ages = self.ages.entry(tenant.to_owned()).or_default();
        let (exact, stored_at) = (item.exact, item.stored_at);
        match part.insert(item) {
            Some(replaced) => {
                ages.remove(&(replaced, id, exact));
            }
            None => self.len += 1,
        }
        ages.insert((stored_at, id, exact));
    }

    fn remove(&mut self, id: &[u8; 32], exact: &[u8; 32]) -> bool {
        let Some(part) = self.partitions.get_mut(id) else { return false };
        let Some(stored_at) = part.remove(exact) else { return false };
        self.len -= 1;
        if let Some(ages) = self.ages.get_mut(&part.tenant) {
            ages.remove(&(stored_at, *id, *exact));
            if ages.is_empty() {
                self.ages.remove(&part.tenant);
            }
        }
        if part.exact.is_empty() {
            self.partitions.remove(id);
        }
        true
    }

    /// Drops `tenant`'s oldest entries past `max`; which they were.
    fn evict(&mut self, tenant: &str, max: u64) -> Vec<([u8; 32], [u8; 32])> {
        let mut evicted = Vec::new();
        while let Some(ages) = self.ages.get_mut(tenant)
            && ages.len() as u64 > max
            && let Some(&(_, id, exact)) = ages.first()
        {
            // `remove` drops it from `ages` too.
            if !self.remove(&id, &exact) {
                self.ages.get_mut(tenant).map(BTreeSet::pop_first);
            }
            evicted.push((id, exact));
        }
        evicted
    }

    fn purge(&mut self, tenant: &str, policy: Option<&str>) -> u64 {
        let doomed: Vec<[u8; 32]> = self
            .partitions
            .iter()
            .filter(|(_, part)| part.tenant == tenant && policy.is_none_or(|policy| part.policy == policy))
            .map(|(id, _)| *id)
            .collect();
        let mut purged = 0;
        for id in doomed {
            if let Some(part) = self.partitions.remove(&id) {
                purged += part.exact.len() as u64;
                if let Some(ages) = self.ages.get_mut(tenant) {
                    for (exact, stored_at) in part.exact.iter().zip(&part.stored_at) {
                        ages.remove(&(*stored_at, id, *exact));
                    }
                }
            }
        }
        if self.ages.get(tenant).is_some_and(BTreeSet::is_empty) {
            self.ages.remove(tenant);
        }
        self.len -= purged;
        purged
    }

    /// Drops the entries expired by `now`, once every [`SWEEP_EVERY`] seconds.
    fn sweep(&mut self, now: u64) {
        if now < self.next_sweep {
            return;
        }
        self.next_sweep = now + SWEEP_EVERY;
        let expired: Vec<([u8; 32], [u8; 32])> = self
            .partitions
            .iter()
            .flat_map(|(id, part)| {
                part.expires_at.iter().zip(&part.exact).filter(|(at, _)| **at <= now).map(|(_, exact)| (*id, *exact))
            })
            .collect();
        for (id, exact) in expired {
            self.remove(&id, &exact);
        }
    }

    fn stats(&self, now: u64) -> Vec<Stats> {
        let mut by: HashMap<(&str, &str), (u64, u64)> = HashMap::new();
        for part in self.partitions.values() {
            let mut live = (0, 0);
            for (expires_at, sealed) in part.expires_at.iter().zip(&part.sealed) {
                if *expires_at > now {
                    live = (live.0 + 1, live.1 + sealed.0.len() as u64);
                }
            }
            if live.0 > 0 {
                let slot = by.entry((part.tenant.as_str(), part.policy.as_str())).or_default();
                *slot = (slot.0 + live.0, slot.1 + live.1);
            }
        }
        let mut stats: Vec<Stats> = by
            .into_iter()
            .map(|((tenant, policy), (entries, bytes))| Stats {
                tenant: tenant.to_owned(),
                policy: policy.to_owned(),
                entries,
                bytes,
            })
            .collect();
        stats.sort_by(|a, b| (&a.tenant, &a.policy).cmp(&(&b.tenant, &b.policy)));
        stats
    }
}

/// One partition's entries, in parallel arrays (entry `i` at index `i` of each; its
/// vector at `vectors[i * dim..]`, its code at `codes[i * words..]`).
struct Part {
    tenant: String,
    policy: String,
    /// The dimension of its vectors: the first one stored sets it (0: none yet). An
    /// entry stored with a vector of another dimension is kept for exact matches only.
    dim: usize,
    /// 64-bit words per sign code.
    words: usize,
    slots: HashMap<[u8; 32], usize>,
    exact: Vec<[u8; 32]>,
    /// The guard of each entry stored with a vector (`None`: stored without one, it
    /// is never a semantic candidate, and its vector and code are zeros).
    guards: Vec<Option<u64>>,
    stored_at: Vec<u64>,
    expires_at: Vec<u64>,
    sealed: Vec<Sealed>,
    vectors: Vec<f32>,
    codes: Vec<u64>,
}

impl Part {
    fn new(tenant: &str, policy: &str) -> Part {
        Part {
            tenant: tenant.to_owned(),
            policy: policy.to_owned(),
            dim: 0,
            words: 0,
            slots: HashMap::new(),
            exact: Vec::new(),
            guards: Vec::new(),
            stored_at: Vec::new(),
            expires_at: Vec::new(),
            sealed: Vec::new(),
            vectors: Vec::new(),
            codes: Vec::new(),
        }
    }

    fn alive(&self, i: usize, lookup: &Lookup<'_>) -> bool {
        self.expires_at[i] > lookup.now && self.stored_at[i] >= lookup.stored_since
    }

    fn found(&self, i: usize, similarity: f32) -> Found {
        Found { sealed: self.sealed[i].clone(), exact: self.exact[i], similarity, stored_at: self.stored_at[i] }
    }

    fn lookup(&self, lookup: &Lookup<'_>) -> Option<Found> {
        if let Some(&i) = self.slots.get(&lookup.probe.exact)
            && self.alive(i, lookup)
        {
            return Some(self.found(i, 1.0));
        }
        let q = lookup.probe.vector.as_deref().filter(|q| self.dim > 0 && q.len() == self.dim)?;
        let code = sign_code(q, self.words);
        let mut top = Closest::new(candidates(self.exact.len()));
        let want = Some(lookup.probe.guard);
        for (i, (c, guard)) in self.codes.chunks_exact(self.words).zip(&self.guards).enumerate() {
            if *guard != want {
                continue;
            }
            let distance = hamming(c, &code);
            if distance < top.worst() && self.alive(i, lookup) {
                top.push(distance, i);
            }
        }
        let (i, similarity) = top
            .indices()
            .map(|i| (i, cosine(q, &self.vectors[i * self.dim..(i + 1) * self.dim])))
            .max_by(|a, b| a.1.total_cmp(&b.1))?;
        (similarity >= lookup.threshold).then(|| self.found(i, similarity))
    }

    /// Puts `item`, in place of the entry of the same exact hash if any: that entry's
    /// `stored_at`.
    fn insert(&mut self, item: Item<'_>) -> Option<u64> {
        let vector = item.vector.filter(|v| !v.is_empty() && (self.dim == 0 || v.len() == self.dim));
        if let Some(v) = vector
            && self.dim == 0
        {
            self.dim = v.len();
            self.words = v.len().div_ceil(64);
            self.vectors.resize(self.exact.len() * self.dim, 0.0);
            self.codes.resize(self.exact.len() * self.words, 0);
        }
        let (i, replaced) = match self.slots.get(&item.exact) {
            Some(&i) => (i, Some(self.stored_at[i])),
            None => {
                let i = self.exact.len();
                self.slots.insert(item.exact, i);
                self.exact.push(item.exact);
                self.guards.push(None);
                self.stored_at.push(0);
                self.expires_at.push(0);
                self.sealed.push(Sealed(Vec::new()));
                self.vectors.resize((i + 1) * self.dim, 0.0);
                self.codes.resize((i + 1) * self.words, 0);
                (i, None)
            }
        };
        self.set(i, item, vector);
        replaced
    }

    fn set(&mut self, i: usize, item: Item<'_>, vector: Option<&[f32]>) {
        self.guards[i] = vector.map(|_| item.guard);
        self.stored_at[i] = item.stored_at;
        self.expires_at[i] = item.expires_at;
        self.sealed[i] = item.sealed;
        let (dim, words) = (self.dim, self.words);
        match vector {
            Some(v) => {
                self.vectors[i * dim..(i + 1) * dim].copy_from_slice(v);
                self.codes[i * words..(i + 1) * words].copy_from_slice(&sign_code(v, words));
            }
            None => {
                self.vectors[i * dim..(i + 1) * dim].fill(0.0);
                self.codes[i * words..(i + 1) * words].fill(0);
            }
        }
    }

    /// Removes the entry of `exact` (the last entry takes its place): its `stored_at`.
    fn remove(&mut self, exact: &[u8; 32]) -> Option<u64> {
        let i = self.slots.remove(exact)?;
        let last = self.exact.len() - 1;
        let stored_at = self.stored_at[i];
        self.exact.swap_remove(i);
        self.guards.swap_remove(i);
        self.stored_at.swap_remove(i);
        self.expires_at.swap_remove(i);
        self.sealed.swap_remove(i);
        let (dim, words) = (self.dim, self.words);
        if i != last {
            self.vectors.copy_within(last * dim..(last + 1) * dim, i * dim);
            self.codes.copy_within(last * words..(last + 1) * words, i * words);
            self.slots.insert(self.exact[i], i);
        }
        self.vectors.truncate(last * dim);
        self.codes.truncate(last * words);
        Some(stored_at)
    }
}

/// The sign bits of `v`, in `words` 64-bit words (the last one padded with zeros).
fn sign_code(v: &[f32], words: usize) -> Vec<u64> {
    let mut code = vec![0u64; words];
    for (word, chunk) in code.iter_mut().zip(v.chunks(64)) {
        *word = chunk.iter().enumerate().fold(0, |acc, (bit, x)| acc | (u64::from(*x > 0.0) << bit));
    }
    code
}

fn hamming(a: &[u64], b: &[u64]) -> u32 {
    a.iter().zip(b).map(|(a, b)| (a ^ b).count_ones()).sum()
}

/// The `k` smallest distances pushed so far, with their entries.
struct Closest {
    k: usize,
    kept: Vec<(u32, usize)>,
    /// The largest distance kept once `k` are (`u32::MAX` before).
    worst: u32,
}

impl Closest {
    fn new(k: usize) -> Closest {
        Closest { k, kept: Vec::with_capacity(k), worst: u32::MAX }
    }

    /// The distance a new entry must beat.
    fn worst(&self) -> u32 {
        self.worst
    }

    fn push(&mut self, distance: u32, i: usize) {
        if self.kept.len() < self.k {
            self.kept.push((distance, i));
            if self.kept.len() == self.k {
                self.worst = self.kept.iter().map(|(d, _)| *d).max().unwrap_or(u32::MAX);
            }
            return;
        }
        if let Some(slot) = self.kept.iter_mut().max_by_key(|(d, _)| *d) {
            *slot = (distance, i);
        }
        self.worst = self.kept.iter().map(|(d, _)| *d).max().unwrap_or(u32::MAX);
    }

    fn indices(&self) -> impl Iterator<Item = usize> + '_ {
        self.kept.iter().map(|(_, i)| *i)
    }
}

/// A put record's fields.
struct Row<'a> {
    partition: [u8; 32],
    tenant: &'a str,
    policy: &'a str,
    exact: [u8; 32],
    guard: u64,
    stored_at: u64,
    expires_at: u64,
    vector: Option<&'a [f32]>,
    sealed: &'a [u8],
}

/// A record: its frame (length and CRC-32 of the body) and its body.
fn framed(body: &[u8]) -> Vec<u8> {
    let mut record = Vec::with_capacity(FRAME + body.len());
    record.extend_from_slice(&(body.len() as u32).to_le_bytes());
    record.extend_from_slice(&crc32fast::hash(body).to_le_bytes());
    record.extend_from_slice(body);
    record
}

fn put_string(body: &mut Vec<u8>, s: &str) {
    body.extend_from_slice(&(s.len() as u32).to_le_bytes());
    body.extend_from_slice(s.as_bytes());
}

fn put_record(row: &Row<'_>) -> Vec<u8> {
    let vector = row.vector.unwrap_or(&[]);
    let mut body = Vec::with_capacity(128 + row.tenant.len() + row.policy.len() + 4 * vector.len() + row.sealed.len());
    body.push(PUT);
    body.extend_from_slice(&row.partition);
    put_string(&mut body, row.tenant);
    put_string(&mut body, row.policy);
    body.extend_from_slice(&row.exact);
    body.extend_from_slice(&row.guard.to_le_bytes());
    body.extend_from_slice(&row.stored_at.to_le_bytes());
    body.extend_from_slice(&row.expires_at.to_le_bytes());
    // A vector of length 0 is none.
    body.extend_from_slice(&(vector.len() as u32).to_le_bytes());
    for x in vector {
        body.extend_from_slice(&x.to_le_bytes());
    }
    body.extend_from_slice(&(row.sealed.len() as u32).to_le_bytes());
    body.extend_from_slice(row.sealed);
    framed(&body)
}

fn delete_record(partition: &[u8; 32], exact: &[u8; 32]) -> Vec<u8> {
    let mut body = Vec::with_capacity(65);
    body.push(DELETE);
    body.extend_from_slice(partition);
    body.extend_from_slice(exact);
    framed(&body)
}

fn purge_record(tenant: &str, policy: Option<&str>) -> Vec<u8> {
    let mut body = vec![PURGE];
    put_string(&mut body, tenant);
    body.push(u8::from(policy.is_some()));
    put_string(&mut body, policy.unwrap_or(""));
    framed(&body)
}

/// Reads a record body field by field; `None` past its end.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    fn u8(&mut self) -> Option<u8> {
        Some(self.array::<1>()?[0])
    }

    fn u32(&mut self) -> Option<usize> {
        Some(u32::from_le_bytes(self.array()?) as usize)
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.array()?))
    }

    fn string(&mut self) -> Option<&'a str> {
        let len = self.u32()?;
        std::str::from_utf8(self.take(len)?).ok()
    }
}

/// Applies one record body to `index`; `None` if it does not decode.
fn apply(body: &[u8], index: &mut Index) -> Option<()> {
    let mut fields = Fields(body);
    match fields.u8()? {
        PUT => {
            let partition = fields.array::<32>()?;
            let tenant = fields.string()?;
            let policy = fields.string()?;
            let exact = fields.array::<32>()?;
            let guard = fields.u64()?;
            let stored_at = fields.u64()?;
            let expires_at = fields.u64()?;
            let dim = fields.u32()?;
            let raw = fields.take(dim.checked_mul(4)?)?;
            let vector: Vec<f32> = raw.chunks_exact(4).map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]])).collect();
            let len = fields.u32()?;
            let sealed = Sealed(fields.take(len)?.to_vec());
            if !fields.0.is_empty() {
                return None;
            }
            let vector = (!vector.is_empty()).then_some(&vector[..]);
            index.put(partition, tenant, policy, Item { exact, guard, stored_at, expires_at, sealed, vector });
        }
        DELETE => {
            let partition = fields.array::<32>()?;
            let exact = fields.array::<32>()?;
            index.remove(&partition, &exact);
        }
        PURGE => {
            let tenant = fields.string()?;
            let scoped = fields.u8()? == 1;
            let policy = fields.string()?;
            index.purge(tenant, scoped.then_some(policy));
        }
        _ => return None,
    }
    fields.0.is_empty().then_some(())
}

/// What a replay found.
struct Replayed {
    /// Bytes of the file.
    len: u64,
    /// Bytes up to the end of the last good record (0: not even the magic).
    valid: u64,
    /// Good records.
    records: u64,
}

/// Replays `file` into `index`, up to its first torn or corrupt record.
fn replay(file: &File, index: &mut Index, path: &Path) -> Result<Replayed, StoreError> {
    let unavailable = |e: io::Error| StoreError::Unavailable(format!("{}: {e}", path.display()));
    let len = file.metadata().map_err(unavailable)?.len();
    let mut reader = BufReader::with_capacity(1 << 20, file);
    let mut magic = [0u8; 8];
    let got = read_full(&mut reader, &mut magic).map_err(unavailable)?;
    if got < magic.len() || &magic != MAGIC {
        if magic[..got] == MAGIC[..got] {
            // Empty, or a magic torn while being written.
            return Ok(Replayed { len, valid: 0, records: 0 });
        }
        return Err(StoreError::Corrupt(format!("{} is not a flexway cache file", path.display())));
    }
    let mut valid = magic.len() as u64;
    let mut records = 0;
    let mut body = Vec::new();
    loop {
        let mut frame = [0u8; FRAME];
        let got = read_full(&mut reader, &mut frame).map_err(unavailable)?;
        if got < FRAME {
            break;
        }
        let size = u32::from_le_bytes([frame[0], frame[1], frame[2], frame[3]]) as usize;
        let crc = u32::from_le_bytes([frame[4], frame[5], frame[6], frame[7]]);
        if size > MAX_RECORD {
            break;
        }
        body.resize(size, 0);
        if read_full(&mut reader, &mut body).map_err(unavailable)? < size || crc32fast::hash(&body) != crc {
            break;
        }
        if apply(&body, index).is_none() {
            break;
        }
        valid += (FRAME + size) as u64;
        records += 1;
    }
    Ok(Replayed { len, valid, records })
}

/// Reads into `buf` until it is full or the input ends: how many bytes it read.
fn read_full(reader: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match reader.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// The file's one writer.
struct Writer {
    path: PathBuf,
    out: BufWriter<File>,
    /// Records in the file.
    records: u64,
    /// A write failed: the file is rewritten from memory before anything else.
    broken: bool,
}

impl Writer {
    fn run(mut self, records: &mpsc::Receiver<Vec<u8>>, index: &RwLock<Index>) {
        while let Ok(record) = records.recv() {
            let mut batch = vec![record];
            batch.extend(records.try_iter());
            if let Err(e) = self.write(batch) {
                tracing::warn!(path = %self.path.display(), error = %e, "cache file: a write failed; rewriting it");
                self.broken = true;
            }
            if self.due(index)
                && let Err(e) = self.compact(index)
            {
                tracing::warn!(path = %self.path.display(), error = %e, "cache file: its rewrite failed");
            }
        }
        if let Err(e) = self.out.flush().and_then(|()| self.out.get_ref().sync_data()) {
            tracing::warn!(path = %self.path.display(), error = %e, "cache file: its last writes failed");
        }
    }

    fn write(&mut self, batch: Vec<Vec<u8>>) -> io::Result<()> {
        if self.broken {
            return Ok(());
        }
        for record in batch {
            self.out.write_all(&record)?;
            self.records += 1;
        }
        self.out.flush()
    }

    /// Whether the file's dead records outnumber its live entries (or it is broken).
    fn due(&self, index: &RwLock<Index>) -> bool {
        let live = index.read().unwrap_or_else(PoisonError::into_inner).len;
        self.broken || (self.records > COMPACT_FLOOR && self.records - live.min(self.records) > live)
    }

    /// Rewrites the file from memory: a temporary file next to it, fsync, rename.
    ///
    /// Records queued while it runs are appended after it: they describe changes
    /// already in memory, which replay to the same state (a put sets an entry, a
    /// delete or purge removes it: applying the same records twice changes nothing).
    fn compact(&mut self, index: &RwLock<Index>) -> io::Result<()> {
        let mut name = self.path.file_name().unwrap_or_default().to_owned();
        name.push(".rewrite");
        let temporary = self.path.with_file_name(name);
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&temporary)?;
        // Locked before it takes the file's name, so the lock never lapses.
        file.try_lock().map_err(io::Error::other)?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(MAGIC)?;
        let ids: Vec<[u8; 32]> =
            index.read().unwrap_or_else(PoisonError::into_inner).partitions.keys().copied().collect();
        let mut records = 0;
        for id in ids {
            // One partition at a time, so stores wait for one partition's copy at most.
            let bytes = {
                let index = index.read().unwrap_or_else(PoisonError::into_inner);
                let Some(part) = index.partitions.get(&id) else { continue };
                let mut bytes = Vec::new();
                for i in 0..part.exact.len() {
                    let vector = part.guards[i].map(|_| &part.vectors[i * part.dim..(i + 1) * part.dim]);
                    bytes.extend_from_slice(&put_record(&Row {
                        partition: id,
                        tenant: &part.tenant,
                        policy: &part.policy,
                        exact: part.exact[i],
                        // An entry without a vector keeps no guard: it is never compared by it.
                        guard: part.guards[i].unwrap_or(0),
                        stored_at: part.stored_at[i],
                        expires_at: part.expires_at[i],
                        vector,
                        sealed: &part.sealed[i].0,
                    }));
                }
                records += part.exact.len() as u64;
                bytes
            };
            out.write_all(&bytes)?;
        }
        out.flush()?;
        out.get_ref().sync_all()?;
        std::fs::rename(&temporary, &self.path)?;
        if let Some(dir) = self.path.parent() {
            // The rename is durable once the directory is; a failure costs that only.
            let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
            let _ = File::open(dir).and_then(|dir| dir.sync_all());
        }
        let file = out.into_inner().map_err(io::IntoInnerError::into_error)?;
        self.out = BufWriter::new(file);
        self.records = records;
        self.broken = false;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Keys, Partition, Probe, conformance, unit};
    use super::*;

    fn partition(tenant: &str) -> Partition {
        Partition::new(tenant, None, "faq", "m", &[0; 32])
    }

    fn probe(exact: u8, vector: Option<Vec<f32>>) -> Probe {
        Probe { exact: [exact; 32], vector, guard: 0 }
    }

    fn vector(seed: usize) -> Vec<f32> {
        unit((0..100).map(|i| ((i * 7 + seed * 13) % 17) as f32 - 8.0).collect()).unwrap()
    }

    async fn put(store: &EmbeddedCacheStore, partition: &Partition, probe: &Probe, sealed: &[u8], expires_at: u64) {
        let entry = Entry {
            partition,
            probe,
            sealed: Sealed(sealed.to_vec()),
            stored_at: unix_now(),
            expires_at,
            max_entries_per_tenant: 1000,
        };
        store.store(entry).await.unwrap();
    }

    async fn get(store: &EmbeddedCacheStore, partition: &Partition, probe: &Probe, now: u64) -> Option<Vec<u8>> {
        let lookup = Lookup { partition, probe, threshold: 0.95, stored_since: 0, now };
        store.lookup(&lookup).await.unwrap().map(|found| found.sealed.0)
    }

    #[tokio::test]
    async fn it_passes_the_conformance_suite() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedCacheStore::open(&dir.path().join("cache")).unwrap();
        conformance::check(&store).await;
    }

    #[tokio::test]
    async fn a_reopened_store_keeps_its_entries_and_their_expiries() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache");
        let (acme, initech, umbrella) = (partition("acme"), partition("initech"), partition("umbrella"));
        let now = unix_now();
        {
            let store = EmbeddedCacheStore::open(&path).unwrap();
            put(&store, &acme, &probe(1, Some(vector(1))), b"one", now + 1000).await;
            put(&store, &acme, &probe(2, None), b"two", now + 5000).await;
            put(&store, &acme, &probe(3, None), b"three, replaced", now + 5000).await;
            put(&store, &acme, &probe(3, None), b"three", now + 5000).await;
            put(&store, &initech, &probe(1, None), b"purged", now + 5000).await;
            put(&store, &umbrella, &probe(1, None), b"evicted", now + 5000).await;
            let entry = Entry {
                partition: &umbrella,
                probe: &probe(2, None),
                sealed: Sealed(b"kept".to_vec()),
                stored_at: now + 1,
                expires_at: now + 5000,
                max_entries_per_tenant: 1,
            };
            store.store(entry).await.unwrap();
            assert_eq!(store.purge("initech", None).await.unwrap(), 1);
        }
        let store = EmbeddedCacheStore::open(&path).unwrap();
        assert_eq!(get(&store, &acme, &probe(1, None), now).await.as_deref(), Some(&b"one"[..]));
        assert_eq!(
            get(&store, &acme, &probe(9, Some(vector(1))), now).await.as_deref(),
            Some(&b"one"[..]),
            "its vector"
        );
        assert_eq!(get(&store, &acme, &probe(1, None), now + 1000).await, None, "its expiry");
        assert_eq!(get(&store, &acme, &probe(2, None), now + 1000).await.as_deref(), Some(&b"two"[..]));
        assert_eq!(get(&store, &acme, &probe(3, None), now).await.as_deref(), Some(&b"three"[..]), "the replacement");
        assert_eq!(get(&store, &initech, &probe(1, None), now).await, None, "the purge");
        assert_eq!(get(&store, &umbrella, &probe(1, None), now).await, None, "the eviction");
        assert_eq!(get(&store, &umbrella, &probe(2, None), now).await.as_deref(), Some(&b"kept"[..]));
        let stats = store.stats().await.unwrap();
        let expected = [("acme", 3, 11), ("umbrella", 1, 4)].map(|(tenant, entries, bytes)| Stats {
            tenant: tenant.into(),
            policy: "faq".into(),
            entries,
            bytes,
        });
        assert_eq!(stats, expected);
    }

    #[tokio::test]
    async fn a_second_process_is_told_the_file_is_in_use() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache");
        let store = EmbeddedCacheStore::open(&path).unwrap();
        // A lock is per open file, so a second open in this process stands for another process.
        match EmbeddedCacheStore::open(&path) {
            Err(StoreError::Unavailable(message)) => {
                assert!(message.contains("in use by a running gateway"), "{message}")
            }
            Err(e) => panic!("expected Unavailable, got {e}"),
            Ok(_) => panic!("a second open of a locked file succeeded"),
        }
        drop(store);
        EmbeddedCacheStore::open(&path).unwrap();
    }

    #[tokio::test]
    async fn a_torn_or_corrupt_tail_is_cut_off_and_the_rest_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache");
        let now = unix_now();
        let acme = partition("acme");
        {
            let store = EmbeddedCacheStore::open(&path).unwrap();
            for exact in 1..=3 {
                put(&store, &acme, &probe(exact, Some(vector(exact.into()))), &[exact; 100], now + 1000).await;
            }
        }
        let whole = std::fs::read(&path).unwrap();
        let last = whole.len()
            - put_record(&Row {
                partition: acme.id,
                tenant: "acme",
                policy: "faq",
                exact: [3; 32],
                guard: 0,
                stored_at: 0,
                expires_at: 0,
                vector: Some(&vector(3)),
                sealed: &[3; 100],
            })
            .len();
        // Torn: the last record is half written. Corrupt: one of its bytes flipped.
        let torn = whole[..whole.len() - 50].to_vec();
        let mut corrupt = whole.clone();
        corrupt[last + FRAME + 40] ^= 0x10;
        for (what, bytes) in [("torn", torn), ("corrupt", corrupt)] {
            std::fs::write(&path, &bytes).unwrap();
            {
                let store = EmbeddedCacheStore::open(&path).unwrap();
                assert_eq!(std::fs::metadata(&path).unwrap().len(), last as u64, "{what}: cut at the last good record");
                for exact in 1..=2 {
                    assert!(get(&store, &acme, &probe(exact, None), now).await.is_some(), "{what}: entry {exact} kept");
                }
                assert_eq!(get(&store, &acme, &probe(3, None), now).await, None, "{what}: the cut entry");
                put(&store, &acme, &probe(4, None), b"after", now + 1000).await;
            }
            let store = EmbeddedCacheStore::open(&path).unwrap();
            assert_eq!(get(&store, &acme, &probe(4, None), now).await.as_deref(), Some(&b"after"[..]), "{what}");
            assert!(get(&store, &acme, &probe(1, None), now).await.is_some(), "{what}");
        }
        // A torn magic is an empty file.
        std::fs::write(&path, &MAGIC[..3]).unwrap();
        let store = EmbeddedCacheStore::open(&path).unwrap();
        assert_eq!(store.stats().await.unwrap(), []);
    }

    #[test]
    fn a_file_that_is_not_a_cache_is_refused_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache");
        std::fs::write(&path, b"budgets: {}\n").unwrap();
        assert!(matches!(EmbeddedCacheStore::open(&path), Err(StoreError::Corrupt(_))));
        assert_eq!(std::fs::read(&path).unwrap(), b"budgets: {}\n");
    }

    #[tokio::test]
    async fn the_file_is_rewritten_once_dead_records_outnumber_live_ones() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache");
        let now = unix_now();
        let (acme, initech) = (partition("acme"), partition("initech"));
        let rounds = 3 * COMPACT_FLOOR as usize / 10;
        {
            let store = EmbeddedCacheStore::open(&path).unwrap();
            for round in 0..rounds {
                for exact in 0..10u8 {
                    let sealed = format!("{exact} at {round}");
                    put(&store, &acme, &probe(exact, Some(vector(exact.into()))), sealed.as_bytes(), now + 1000).await;
                }
            }
            put(&store, &initech, &probe(1, None), b"initech", now + 1000).await;
            put(&store, &initech, &probe(2, None), b"expired", now - 1).await;
        }
        let size = std::fs::metadata(&path).unwrap().len();
        let one = put_record(&Row {
            partition: acme.id,
            tenant: "acme",
            policy: "faq",
            exact: [0; 32],
            guard: 0,
            stored_at: 0,
            expires_at: 0,
            vector: Some(&vector(0)),
            sealed: b"0 at 000",
        })
        .len() as u64;
        assert!(size < one * COMPACT_FLOOR, "{size} bytes: rewritten (a record is {one} bytes, {rounds} rounds of 10)");
        let store = EmbeddedCacheStore::open(&path).unwrap();
        for exact in 0..10u8 {
            let last = format!("{exact} at {}", rounds - 1);
            assert_eq!(get(&store, &acme, &probe(exact, None), now).await, Some(last.into_bytes()));
            let near = get(&store, &acme, &probe(99, Some(vector(exact.into()))), now).await;
            assert!(near.is_some(), "entry {exact}'s vector survives the rewrite");
        }
        assert_eq!(get(&store, &initech, &probe(1, None), now).await.as_deref(), Some(&b"initech"[..]));
        let files: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(files, ["cache"], "no temporary file left behind");
    }

    #[tokio::test]
    async fn the_file_holds_only_sealed_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache");
        let keys = Keys::new(b"0123456789abcdef0123456789abcdef");
        let acme = partition("acme");
        let plain = b"The capital of Burkina Faso is Ouagadougou";
        let entry = probe(1, Some(vector(1)));
        let sealed = keys.seal(&acme, &entry, plain).unwrap();
        {
            let store = EmbeddedCacheStore::open(&path).unwrap();
            put(&store, &acme, &entry, &sealed.0, unix_now() + 1000).await;
        }
        let file = std::fs::read(&path).unwrap();
        assert!(file.windows(sealed.0.len()).any(|w| w == sealed.0), "the sealed bytes are kept");
        assert!(!file.windows(11).any(|w| w == b"Ouagadougou"), "no clear text at rest");
        let store = EmbeddedCacheStore::open(&path).unwrap();
        let found = get(&store, &acme, &probe(1, None), unix_now()).await.unwrap();
        assert_eq!(keys.open(&acme, &[1; 32], &Sealed(found)).as_deref(), Some(&plain[..]));
    }

    #[tokio::test]
    async fn the_scan_finds_the_best_with_the_whole_guard_at_any_dimension() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedCacheStore::open(&dir.path().join("cache")).unwrap();
        // Codes of 1, 4 and 6 words.
        for dim in [20, 256, 384] {
            let p = Partition::new("acme", None, "faq", &format!("m{dim}"), &[0; 32]);
            let axis = |k: usize, c: f32| {
                let mut v = vec![0.0; dim];
                v[0] = c;
                v[k] = (1.0 - c * c).sqrt();
                v
            };
            let now = unix_now();
            // Two guards that differ in their high half only.
            let (guard, twin) = (1u64 << 32, 1u64);
            for (exact, k, cosine, guard) in [(1, 1, 0.96, guard), (2, 2, 0.98, guard), (3, 3, 0.999, twin)] {
                let probe = Probe { exact: [exact; 32], vector: Some(axis(k, cosine)), guard };
                put(&store, &p, &probe, &[exact], now + 1000).await;
            }
            let probe = Probe { exact: [9; 32], vector: Some(axis(1, 1.0)), guard };
            let lookup = Lookup { partition: &p, probe: &probe, threshold: 0.95, stored_since: 0, now };
            let found = store.lookup(&lookup).await.unwrap().unwrap();
            assert_eq!((found.exact, found.sealed.0), ([2; 32], vec![2]), "dimension {dim}");
            assert!((found.similarity - 0.98).abs() < 1e-4, "dimension {dim}: {}", found.similarity);
        }
    }

    #[test]
    fn sign_codes_pad_the_last_word() {
        let v: Vec<f32> = (0..70).map(|i| if i % 2 == 0 { 1.0 } else { -1.0 }).collect();
        let code = sign_code(&v, 2);
        assert_eq!(code, [0x5555_5555_5555_5555, 0b01_0101]);
        assert_eq!(hamming(&code, &sign_code(&v.iter().map(|x| -x).collect::<Vec<_>>(), 2)), 70);
    }
}
