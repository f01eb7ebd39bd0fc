//! The journal (`<file>.journal`): what the batches since the last checkpoint wrote,
//! one JSON line a batch under the journal's epoch, written in place into a file
//! allocated ahead. A line sets values, so a replay of it twice changes nothing; the
//! journal ends at the first line that does not read, or is of another epoch.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{CHECKPOINT_BYTES, backend};
use crate::budget::ledger::StoredReservation;
use crate::budget::{CounterKey, Run, StoreError};
use crate::json;

/// What one batch wrote, as the journal keeps it: values, so that a replay sets them
/// again and a second replay changes nothing. In the order written: a later entry for
/// the same key wins.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(super) struct Effects {
    /// A counter set, or forgotten (`null`: a window or a run past its retention).
    #[serde(rename = "c", default, skip_serializing_if = "Vec::is_empty")]
    pub(super) counters: Vec<(CounterKey, Option<u64>)>,
    /// A reservation put, or removed (`null`).
    #[serde(rename = "r", default, skip_serializing_if = "Vec::is_empty")]
    pub(super) reservations: Vec<(String, Option<StoredReservation>)>,
    /// A run put, or forgotten (`null`).
    #[serde(rename = "u", default, skip_serializing_if = "Vec::is_empty")]
    pub(super) runs: Vec<(String, Option<Run>)>,
}

impl Effects {
    pub(super) fn is_empty(&self) -> bool {
        self.counters.is_empty() && self.reservations.is_empty() && self.runs.is_empty()
    }
}

/// The journal: what the batches since the last checkpoint wrote, one JSON line each,
/// written in place into a file allocated ahead ([`JOURNAL_BYTES`] of zeros), so that
/// a line's `fdatasync` flushes its data and no file size (on a virtio disk an
/// append's fdatasync took twice an overwrite's). Every line carries the journal's
/// epoch, which a checkpoint advances before the next line is written over the old
/// ones from the start, and commits to the file with what it holds: the journal is the
/// run of lines from the start in that epoch. What follows it (zeros, the lines of an
/// earlier epoch, a line cut short or damaged by a power loss) ends it, and an earlier
/// epoch at the start (the new epoch's first line not yet on disk) is no journal at
/// all: its lines are older than the file, and may lack the ones a failed fsync lost.
/// A file from before the epoch was committed with it takes the first line's epoch.
pub(super) struct Journal {
    pub(super) file: File,
    pub(super) path: PathBuf,
    pub(super) epoch: u64,
    /// Where the next line goes; the bytes of this epoch.
    pub(super) len: u64,
    /// Lines of this epoch (the epoch's marker line aside).
    pub(super) lines: usize,
    /// An fsync failed since the last checkpoint: the lines before it may be lost, and
    /// only a checkpoint makes the ledger durable.
    pub(super) failed: bool,
    /// A line was written since the last fsync or checkpoint (the epoch's marker aside).
    pub(super) unsynced: bool,
}

/// The journal file's size, allocated at open: twice the size that calls a checkpoint.
pub const JOURNAL_BYTES: u64 = 2 * CHECKPOINT_BYTES;

/// The journal is allocated a page a write (see `Journal::open`).
const PAGE: u64 = 4096;

/// A journal line: the batch's writes, under the journal's epoch.
#[derive(Serialize, Deserialize)]
struct Line<E> {
    #[serde(rename = "e", default)]
    epoch: u64,
    #[serde(flatten)]
    effects: E,
}

impl Journal {
    /// Opens (or creates and allocates) the journal and reads the lines of its epoch,
    /// `expected` if the file names one.
    pub(super) fn open(path: &Path, expected: Option<u64>) -> Result<(Journal, Vec<Effects>), StoreError> {
        let failed = |e: std::io::Error| backend(format!("ledger journal {}: {e}", path.display()));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .read(true)
            .open(path)
            .map_err(failed)?;
        let mut left = Vec::new();
        let mut epoch = expected;
        let mut reader = BufReader::new(&file);
        let mut text = String::new();
        let mut number = 0;
        loop {
            text.clear();
            match reader.read_line(&mut text) {
                Ok(0) => break,
                Ok(_) => {}
                // Zeros and an earlier epoch's bytes after the end need not be UTF-8.
                Err(e) if e.kind() == std::io::ErrorKind::InvalidData => break,
                Err(e) => return Err(failed(e)),
            }
            number += 1;
            let line: Option<Line<Effects>> = text.strip_suffix('\n').and_then(|t| serde_json::from_str(t).ok());
            // Zeros, a line cut short, or the rest of an earlier epoch's line: the end.
            let Some(line) = line else {
                tracing::debug!(journal = %path.display(), line = number, "ledger: the journal ends");
                break;
            };
            if epoch.is_some_and(|e| e != line.epoch) {
                if number == 1 {
                    tracing::info!(journal = %path.display(), epoch = line.epoch, ?expected, "ledger: the journal's lines are older than the file");
                }
                break;
            }
            epoch = Some(line.epoch);
            // An epoch's marker line writes nothing.
            if !line.effects.is_empty() {
                left.push(line.effects);
            }
        }
        let size = file.metadata().map_err(failed)?.len();
        if size < JOURNAL_BYTES {
            // Zeros written, not a hole: the blocks exist before the first line's fsync.
            // A page at a time: the page cache keeps a write's pages in folios the size
            // of the write, and every later line written into a large folio walks all of
            // its blocks (on ext4, one 8 MiB write made each line's
            // pwrite cost 15 µs of CPU instead of 6, and its fdatasync 73-80 instead of
            // 59-65).
            let page = [0; PAGE as usize];
            let mut at = size;
            while at < JOURNAL_BYTES {
                let end = ((at / PAGE + 1) * PAGE).min(JOURNAL_BYTES);
                std::os::unix::fs::FileExt::write_all_at(&file, &page[..(end - at) as usize], at).map_err(failed)?;
                at = end;
            }
            file.sync_all().map_err(failed)?;
        }
        let journal = Journal {
            file,
            path: path.to_owned(),
            epoch: epoch.unwrap_or(0),
            len: 0,
            lines: left.len(),
            failed: false,
            unsynced: false,
        };
        Ok((journal, left))
    }

    pub(super) fn is_empty(&self) -> bool {
        self.lines == 0
    }

    fn write_at(&mut self, bytes: &[u8]) -> Result<(), StoreError> {
        std::os::unix::fs::FileExt::write_all_at(&self.file, bytes, self.len)
            .map_err(|e| backend(format!("ledger journal {}: {e}", self.path.display())))?;
        self.len += bytes.len() as u64;
        Ok(())
    }

    /// One `pwrite(2)` for the batch; a batch that wrote nothing has nothing to journal.
    pub(super) fn write(&mut self, effects: &Effects) -> Result<(), StoreError> {
        if !effects.is_empty() {
            let mut line = Vec::with_capacity(512);
            encode(self.epoch, effects, &mut line)?;
            self.write_at(&line)?;
            self.lines += 1;
            self.unsynced = true;
        }
        Ok(())
    }

    /// `fdatasync` of the lines written so far, if there are any: a batch that wrote
    /// nothing still waits for the lines before it.
    pub(super) fn sync(&mut self) -> Result<(), StoreError> {
        if self.lines == 0 {
            return Ok(());
        }
        sync_data(&self.file, &self.path)?;
        self.unsynced = false;
        Ok(())
    }

    /// A second handle on the journal's file, whose `fdatasync` syncs the lines written
    /// through this one: the writer thread's, which syncs without holding the writer's
    /// lock (`sync: interval`).
    pub(super) fn sync_handle(&self) -> Result<File, StoreError> {
        self.file.try_clone().map_err(|e| backend(format!("ledger journal {}: {e}", self.path.display())))
    }

    /// After a checkpoint: a new epoch, whose marker line (no writes) starts the file,
    /// so that the lines before it are no longer read.
    pub(super) fn clear(&mut self) -> Result<(), StoreError> {
        self.epoch += 1;
        self.len = 0;
        self.lines = 0;
        self.failed = false;
        self.unsynced = false;
        let mut marker = Vec::new();
        encode(self.epoch, &Effects::default(), &mut marker)?;
        self.write_at(&marker)
    }
}

/// `fdatasync` of the journal's file, through any handle on it.
pub(super) fn sync_data(file: &File, path: &Path) -> Result<(), StoreError> {
    file.sync_data().map_err(|e| backend(format!("ledger journal {} fsync: {e}", path.display())))
}

/// A journal line, `\n` included: the bytes `serde_json` makes of a [`Line`] (a test
/// holds them equal; `Journal::open` reads them with it), written by hand
/// ([`crate::json`]), but for runs (rare: serde_json's own bytes).
fn encode(epoch: u64, effects: &Effects, line: &mut Vec<u8>) -> Result<(), StoreError> {
    line.push(b'{');
    json::key!(line, "e");
    json::number(line, epoch);
    if !effects.counters.is_empty() {
        line.push(b',');
        json::key!(line, "c");
        line.push(b'[');
        for (i, (key, value)) in effects.counters.iter().enumerate() {
            if i > 0 {
                line.push(b',');
            }
            line.push(b'[');
            json::string(line, key.as_str());
            line.push(b',');
            match value {
                Some(value) => json::number(line, *value),
                None => line.extend_from_slice(b"null"),
            }
            line.push(b']');
        }
        line.push(b']');
    }
    if !effects.reservations.is_empty() {
        line.push(b',');
        json::key!(line, "r");
        line.push(b'[');
        for (i, (request_id, reservation)) in effects.reservations.iter().enumerate() {
            if i > 0 {
                line.push(b',');
            }
            line.push(b'[');
            json::string(line, request_id);
            line.push(b',');
            match reservation {
                None => line.extend_from_slice(b"null"),
                Some(reservation) => {
                    line.push(b'{');
                    json::key!(line, "lines");
                    amounts(line, &reservation.lines);
                    line.push(b',');
                    json::key!(line, "expires_at");
                    json::number(line, reservation.expires_at);
                    line.push(b',');
                    json::key!(line, "swept");
                    json::boolean(line, reservation.swept);
                    if let Some(intent) = &reservation.intent {
                        line.push(b',');
                        json::key!(line, "intent");
                        amounts(line, intent);
                    }
                    line.push(b'}');
                }
            }
            line.push(b']');
        }
        line.push(b']');
    }
    if !effects.runs.is_empty() {
        line.push(b',');
        json::key!(line, "u");
        serde_json::to_writer(&mut *line, &effects.runs).map_err(backend)?;
    }
    line.extend_from_slice(b"}\n");
    Ok(())
}

/// `[["key",amount],...]`
fn amounts(line: &mut Vec<u8>, amounts: &[(CounterKey, u64)]) {
    line.push(b'[');
    for (i, (key, amount)) in amounts.iter().enumerate() {
        if i > 0 {
            line.push(b',');
        }
        line.push(b'[');
        json::string(line, key.as_str());
        line.push(b',');
        json::number(line, *amount);
        line.push(b']');
    }
    line.push(b']');
}

#[cfg(test)]
mod tests {
    use super::super::tests::key;
    use super::*;
    use crate::budget::run::{RunBudget, RunRef};

    /// The bytes a journal line is written as are those a replay reads, whatever binary
    /// wrote them: an empty list left out, a removed reservation or forgotten counter as
    /// `null`.
    #[test]
    fn a_journal_line_is_written_in_the_format_replay_reads() {
        let reservation = StoredReservation { lines: vec![(key("a"), 40)], expires_at: 9, swept: false, intent: None };
        let effects = Effects {
            counters: vec![(key("a"), Some(40)), (key("w"), None)],
            reservations: vec![("r1".into(), Some(reservation)), ("r0".into(), None)],
            runs: Vec::new(),
        };
        let written = |epoch: u64, effects: &Effects| {
            let mut line = Vec::new();
            encode(epoch, effects, &mut line).unwrap();
            String::from_utf8(line).unwrap()
        };
        let line = written(7, &effects);
        assert_eq!(
            line,
            "{\"e\":7,\"c\":[[\"batch/a\",40],[\"batch/w\",null]],\"r\":[[\"r1\",{\"lines\":[[\"batch/a\",40]],\"expires_at\":9,\"swept\":false}],[\"r0\",null]]}\n"
        );
        let read: super::Line<Effects> = serde_json::from_str(line.trim_end()).unwrap();
        assert_eq!(read.epoch, 7);
        assert_eq!(format!("{:?}", read.effects), format!("{effects:?}"));
        assert_eq!(written(8, &Effects::default()), "{\"e\":8}\n");

        // Whatever the effects, the same bytes as serde_json's: names that need escaping,
        // a swept reservation, an intent, large numbers, runs put and forgotten.
        let odd = CounterKey("t\"q\\/\u{1}/é/tokens/day/2026-12-02".into());
        let run = Run {
            this: RunRef { id: "run_1".into(), budget: RunBudget { tokens: Some(9), eur: None }, expires_at: 60 },
            tenant: "acme".into(),
            agent: Some("bot \"é\"".into()),
            label: None,
            ancestors: vec![RunRef { id: "run_0".into(), budget: RunBudget::default(), expires_at: 90 }],
            created_at: 1,
            ended_at: Some(5),
            children: vec!["run_2".into()],
        };
        let effects = Effects {
            counters: vec![(odd.clone(), Some(u64::MAX)), (key("b"), Some(0)), (key("c"), None)],
            runs: vec![("run_1".into(), Some(run)), ("run_0".into(), None)],
            reservations: vec![
                ("id \"x\"\n".into(), None),
                (
                    "r2".into(),
                    Some(StoredReservation {
                        lines: vec![(odd.clone(), 1), (key("b"), 2)],
                        expires_at: 1_764_000_000,
                        swept: true,
                        intent: Some(vec![(odd, 3)]),
                    }),
                ),
            ],
        };
        let serde = serde_json::to_string(&super::Line { epoch: u64::MAX, effects: &effects }).unwrap();
        let read: super::Line<Effects> = serde_json::from_str(&serde).unwrap();
        assert_eq!(format!("{:?}", read.effects), format!("{effects:?}"), "read back as written");
        assert_eq!(written(u64::MAX, &effects), serde + "\n");
    }

    /// A journal shorter than its size (new, or cut short) is allocated to it, the
    /// allocation starting where the file ends, whatever its length: its lines are
    /// read and kept, zeros follow.
    #[test]
    fn a_short_journal_is_allocated_to_its_size_with_its_lines_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.redb.journal");
        let mut lines = Vec::new();
        let effects = Effects { counters: vec![(key("a"), Some(40))], ..Effects::default() };
        encode(5, &effects, &mut lines).unwrap();
        for length in [0, lines.len(), lines.len() + 5000] {
            let mut content = lines.clone();
            content.resize(length.max(lines.len()), 0);
            content.truncate(length);
            std::fs::write(&path, &content).unwrap();
            let (journal, left) = Journal::open(&path, Some(5)).unwrap();
            assert_eq!(left.len(), usize::from(length > 0), "{length} bytes");
            assert_eq!(journal.lines, left.len());
            let file = std::fs::read(&path).unwrap();
            assert_eq!(file.len() as u64, JOURNAL_BYTES);
            assert_eq!(&file[..length], &content[..]);
            assert!(file[length..].iter().all(|b| *b == 0));
        }
    }
}
