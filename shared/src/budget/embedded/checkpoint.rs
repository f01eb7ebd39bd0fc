//! The redb file: its tables, the ledger loaded from it at open, and the checkpoint
//! that commits to it what changed since the last one (one durable commit) and starts
//! a new journal epoch. A checkpoint that fails forgets nothing: the changes stay
//! marked, and the journal keeps growing until one succeeds.

use std::sync::RwLock;

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use super::backend;
use super::journal::Journal;
use super::state::{Ledger, is_live};
use super::writer::Writer;
use crate::budget::{CounterKey, StoreError};

const COUNTERS: TableDefinition<&str, u64> = TableDefinition::new("counters");
const RESERVATIONS: TableDefinition<&str, &[u8]> = TableDefinition::new("reservations");
/// Run id → JSON `Run`. Absent from files written before runs existed.
const RUNS: TableDefinition<&str, &[u8]> = TableDefinition::new("runs");
/// `journal_epoch`: the epoch of the journal that follows the file's content, written
/// by each checkpoint with it. Absent from files written before it existed.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const JOURNAL_EPOCH: &str = "journal_epoch";

impl Ledger {
    /// Everything the file holds (creating its tables on a new file).
    pub(super) fn load(db: &Database) -> Result<Ledger, StoreError> {
        let txn = db.begin_write().map_err(backend)?;
        txn.open_table(COUNTERS).map_err(backend)?;
        txn.open_table(RESERVATIONS).map_err(backend)?;
        txn.open_table(RUNS).map_err(backend)?;
        txn.open_table(META).map_err(backend)?;
        txn.commit().map_err(backend)?;
        let txn = db.begin_read().map_err(backend)?;
        let mut ledger = Ledger::default();
        for entry in txn.open_table(COUNTERS).map_err(backend)?.iter().map_err(backend)? {
            let (key, value) = entry.map_err(backend)?;
            ledger.counters.insert(CounterKey(key.value().into()), value.value());
        }
        for entry in txn.open_table(RESERVATIONS).map_err(backend)?.iter().map_err(backend)? {
            let (request_id, bytes) = entry.map_err(backend)?;
            let stored = serde_json::from_slice(bytes.value()).map_err(|e| e.to_string());
            ledger.in_file.insert(request_id.value().to_owned());
            ledger.live += usize::from(is_live(Some(&stored)));
            ledger.reservations.insert(request_id.value().to_owned(), stored);
        }
        for entry in txn.open_table(RUNS).map_err(backend)?.iter().map_err(backend)? {
            let (id, bytes) = entry.map_err(backend)?;
            let stored = serde_json::from_slice(bytes.value()).map_err(|e| e.to_string());
            ledger.runs.insert(id.value().to_owned(), stored);
        }
        Ok(ledger)
    }
}

pub(super) fn checkpoint_logged(ledger: &RwLock<Ledger>, writer: &mut Writer) {
    if writer.journal.is_empty() {
        return;
    }
    if let Err(e) = checkpoint_held(ledger, writer) {
        tracing::error!(error = %e, "ledger checkpoint failed; the journal is kept and replayed at the next open");
    }
}

/// A checkpoint, by the holder of the writer's lock.
pub(super) fn checkpoint_held(ledger: &RwLock<Ledger>, writer: &mut Writer) -> Result<(), StoreError> {
    let mut ledger = ledger.write().map_err(|_| backend("ledger lock poisoned"))?;
    checkpoint(&writer.db, &mut ledger, &mut writer.journal)
}

/// Writes what changed since the last checkpoint into the file (one durable commit),
/// then empties the journal. On error nothing is forgotten: the changes stay marked
/// and the journal keeps growing until a checkpoint succeeds.
pub(super) fn checkpoint(db: &Database, ledger: &mut Ledger, journal: &mut Journal) -> Result<(), StoreError> {
    let txn = db.begin_write().map_err(backend)?;
    {
        // The journal's next epoch, which `clear` below starts: only its lines follow
        // what this commit holds, whatever older lines the disk still has.
        txn.open_table(META).map_err(backend)?.insert(JOURNAL_EPOCH, journal.epoch + 1).map_err(backend)?;
        let mut counters = txn.open_table(COUNTERS).map_err(backend)?;
        for key in &ledger.changed_counters {
            match ledger.counters.get(key) {
                Some(value) => _ = counters.insert(key.as_str(), *value).map_err(backend)?,
                // Forgotten (a window or a run past its retention).
                None => _ = counters.remove(key.as_str()).map_err(backend)?,
            }
        }
        let mut runs = txn.open_table(RUNS).map_err(backend)?;
        for id in &ledger.changed_runs {
            match ledger.runs.get(id) {
                Some(Ok(run)) => {
                    let bytes = serde_json::to_vec(run).map_err(backend)?;
                    runs.insert(id.as_str(), bytes.as_slice()).map_err(backend)?;
                }
                Some(Err(_)) => {}
                None => _ = runs.remove(id.as_str()).map_err(backend)?,
            }
        }
        let mut reservations = txn.open_table(RESERVATIONS).map_err(backend)?;
        for request_id in &ledger.changed_reservations {
            match ledger.reservations.get(request_id) {
                Some(Ok(reservation)) => {
                    let bytes = serde_json::to_vec(reservation).map_err(backend)?;
                    reservations.insert(request_id.as_str(), bytes.as_slice()).map_err(backend)?;
                }
                // A record that did not decode is left as the file has it.
                Some(Err(_)) => {}
                // Most calls reserve and settle between two checkpoints: their
                // reservation never reached the file, and nothing is removed.
                None if !ledger.in_file.contains(request_id) => {}
                None => {
                    reservations.remove(request_id.as_str()).map_err(backend)?;
                }
            }
        }
    }
    txn.commit().map_err(backend)?;
    let changed = std::mem::take(&mut ledger.changed_reservations);
    for request_id in changed {
        if ledger.reservations.contains_key(&request_id) {
            ledger.in_file.insert(request_id);
        } else {
            ledger.in_file.remove(&request_id);
        }
    }
    ledger.changed_counters.clear();
    ledger.changed_runs.clear();
    journal.clear()
}

/// The epoch of the journal that follows the file's content (`None`: a file from before
/// it was kept, or that never had a checkpoint).
pub(super) fn journal_epoch(db: &Database) -> Result<Option<u64>, StoreError> {
    let txn = db.begin_read().map_err(backend)?;
    let meta = txn.open_table(META).map_err(backend)?;
    Ok(meta.get(JOURNAL_EPOCH).map_err(backend)?.map(|epoch| epoch.value()))
}
