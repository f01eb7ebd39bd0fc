//! The audit's HMAC chain (`audit.chain_key`): each record says who wrote it, its
//! place in that writer's sequence, and a MAC over it and the record before, so that
//! `flexway report --verify` finds a line altered, forged, removed or moved.
//!
//! A record's `chain` is `{writer}:{seq}:{mac}`: `writer` is 16 hex digits drawn when
//! the process (or Lambda execution environment) starts, `seq` counts its records
//! from 0, and `mac` is the hex HMAC-SHA256, under the chain key, of the previous
//! record's MAC (32 zero bytes for seq 0), `{writer}:{seq}\n`, and the record's line
//! as written without its `chain` field, which is always the last one. Into a sink
//! that keeps order (a file, stdout, and so Lambda's log stream) one writer's records
//! are sealed and written under one lock, so its lines are in sequence order and the
//! verifier checks them in the order read; a sink whose writes may land out of order
//! (PutLogEvents from a fleet process) is not held one write at a time, and its
//! reader orders each writer's records by `seq` ([`position`]) before checking.
//!
//! What the chain cannot see: records after a writer's last one that reaches the
//! reader (a tail cut off looks like a writer that stopped), and a writer's whole
//! sequence removed. A record the sink failed to write leaves a gap that the
//! verifier reports: it is in the gateway's log under "audit record not written".

use std::collections::HashMap;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::{AuditError, AuditRecord, AuditSink};

type HmacSha256 = Hmac<Sha256>;

const FIELD: &str = r#","chain":""#;
const WRITER_LEN: usize = 16;

/// The chain key, ready to MAC (the key's block is hashed once).
#[derive(Clone)]
struct Key(HmacSha256);

impl Key {
    #[allow(clippy::expect_used)] // HMAC takes a key of any length: this cannot fail
    fn new(secret: &[u8]) -> Self {
        Key(HmacSha256::new_from_slice(secret).expect("HMAC accepts any key length"))
    }

    /// The MAC of record `seq` of `writer`, whose line without `chain` is `body`.
    fn mac(&self, previous: &[u8; 32], writer: &str, seq: u64, body: &[u8]) -> [u8; 32] {
        let mut mac = self.0.clone();
        mac.update(previous);
        mac.update(writer.as_bytes());
        mac.update(b":");
        mac.update(itoa::Buffer::new().format(seq).as_bytes());
        mac.update(b"\n");
        mac.update(body);
        mac.finalize().into_bytes().into()
    }
}

/// The last record sealed (or read) of a writer.
#[derive(Debug, Clone, Copy)]
struct Tip {
    seq: u64,
    mac: [u8; 32],
}

/// A sink that chains every record before handing it to `inner`.
pub struct ChainedAuditSink {
    inner: Arc<dyn AuditSink>,
    key: Key,
    writer: String,
    /// The next record's number and the last MAC; held across the inner write, so
    /// that lines reach the sink in the order they were sealed.
    tip: tokio::sync::Mutex<Option<Tip>>,
}

impl std::fmt::Debug for ChainedAuditSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChainedAuditSink").field("writer", &self.writer).finish_non_exhaustive()
    }
}

impl ChainedAuditSink {
    /// Chains records under `key`, as a new writer with a random name.
    pub fn new(inner: Arc<dyn AuditSink>, key: &[u8]) -> Self {
        let writer = hex::encode(rand::random::<[u8; WRITER_LEN / 2]>());
        ChainedAuditSink { inner, key: Key::new(key), writer, tip: tokio::sync::Mutex::new(None) }
    }

    pub fn writer(&self) -> &str {
        &self.writer
    }
}

#[async_trait::async_trait]
impl AuditSink for ChainedAuditSink {
    async fn write(&self, records: &[AuditRecord]) -> Result<(), AuditError> {
        let mut tip = self.tip.lock().await;
        let mut sealed = Vec::with_capacity(records.len());
        let mut body = Vec::with_capacity(768);
        for record in records {
            let mut record = record.clone();
            record.chain = None;
            body.clear();
            super::sinks::line(&record, &mut body);
            body.pop(); // the line's `\n`
            let (seq, previous) = tip.map_or((0, [0; 32]), |t| (t.seq + 1, t.mac));
            let mac = self.key.mac(&previous, &self.writer, seq, &body);
            record.chain = Some(format!("{}:{seq}:{}", self.writer, hex::encode(mac)));
            *tip = Some(Tip { seq, mac });
            sealed.push(record);
        }
        if !self.inner.ordered() {
            drop(tip);
        }
        // A failed write keeps its numbers: the gap tells the verifier a record is
        // missing, and the caller logs the record.
        self.inner.write(&sealed).await
    }

    fn ordered(&self) -> bool {
        self.inner.ordered()
    }

    /// For its tip's lock, whatever its sink.
    fn waits(&self) -> bool {
        true
    }
}

/// A chained line's writer and seq, to order a reader's lines by when they land out
/// of order; `None` for a line with no chain.
pub fn position(line: &str) -> Option<(&str, u64)> {
    split(line.trim_end_matches(['\n', '\r'])).map(|(_, writer, seq, _)| (writer, seq))
}

/// Where a chain breaks, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Break {
    pub at: String,
    pub why: String,
}

impl std::fmt::Display for Break {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.at, self.why)
    }
}

/// What verifying an audit found.
#[derive(Debug, Default)]
pub struct Verdict {
    /// Lines whose MAC held against the record before them.
    pub verified: u64,
    /// Writers seen.
    pub chains: usize,
    pub breaks: Vec<Break>,
}

/// Checks an audit's lines in the order read, writer by writer.
pub struct Verifier {
    key: Key,
    /// Whether the read began at the audit's start: then a writer whose first line is
    /// not its seq 0 lost its head. A read from a date on starts mid-chain.
    from_start: bool,
    tips: HashMap<String, Tip>,
    verdict: Verdict,
}

impl Verifier {
    pub fn new(key: &[u8], from_start: bool) -> Self {
        Verifier { key: Key::new(key), from_start, tips: HashMap::new(), verdict: Verdict::default() }
    }

    /// Takes the next line of the audit (a record's, as read: a trailing newline is
    /// ignored); `at` names it in a break.
    pub fn line(&mut self, at: impl FnOnce() -> String, line: &str) {
        let line = line.trim_end_matches(['\n', '\r']);
        let Some((body, writer, seq, mac)) = split(line) else {
            let why = "no chain: not written by a gateway chaining its audit (a forged line, or one written \
                       before audit.chain_key was set)";
            self.verdict.breaks.push(Break { at: at(), why: why.into() });
            return;
        };
        // At most one break a line: a line with no predecessor read cannot be checked.
        let (previous, mut why) = match self.tips.get(writer).copied() {
            None if seq == 0 => (Some([0; 32]), None),
            None => {
                let head = format!("chain {writer} starts at seq {seq}: the {seq} line(s) before it are missing");
                (None, self.from_start.then_some(head))
            }
            Some(tip) if seq == tip.seq + 1 => (Some(tip.mac), None),
            Some(tip) if seq > tip.seq + 1 => {
                let gap = format!(
                    "chain {writer}: seq {}..={} missing before this line (removed, or not written: see the \
                     gateway's log for \"audit record not written\")",
                    tip.seq + 1,
                    seq - 1
                );
                (None, Some(gap))
            }
            Some(tip) => {
                let why = format!("chain {writer}: seq {seq} after seq {}: a line moved or repeated", tip.seq);
                // The tip stays: the lines after it are checked against it.
                self.verdict.breaks.push(Break { at: at(), why });
                return;
            }
        };
        if let Some(previous) = previous {
            if self.key.mac(&previous, writer, seq, body.as_bytes()) == mac {
                self.verdict.verified += 1;
            } else {
                why = Some(format!(
                    "chain {writer}: seq {seq} does not match its MAC: the line was altered or forged (or the \
                     chain key is not the gateway's)"
                ));
            }
        }
        if let Some(why) = why {
            self.verdict.breaks.push(Break { at: at(), why });
        }
        // The line's own MAC is what the next one was sealed over: one altered line is
        // one break, not a cascade.
        self.tips.insert(writer.to_owned(), Tip { seq, mac });
    }

    pub fn finish(mut self) -> Verdict {
        self.verdict.chains = self.tips.len();
        self.verdict
    }
}

/// A line's body (without `chain`), writer, seq and MAC; `None` when it has no
/// well-formed `chain` as its last field.
fn split(line: &str) -> Option<(String, &str, u64, [u8; 32])> {
    let start = line.rfind(FIELD)?;
    let value = line[start + FIELD.len()..].strip_suffix("\"}")?;
    let mut parts = value.split(':');
    let (writer, seq, mac) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || writer.len() != WRITER_LEN || !writer.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let seq = seq.parse().ok().filter(|_| !seq.starts_with('+'))?;
    let mut bytes = [0; 32];
    hex::decode_to_slice(mac, &mut bytes).ok()?;
    Some((format!("{}}}", &line[..start]), writer, seq, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::sinks::MemoryAuditSink;
    use crate::config::Metering;

    const KEY: &[u8] = b"chain key of the tests";

    fn record() -> AuditRecord {
        crate::audit::sample::record("acme", Some("openai"), Metering::Local, 296)
    }

    /// `n` records chained by one writer, as the lines a file would hold.
    async fn chained_lines(n: usize) -> Vec<String> {
        let memory = Arc::new(MemoryAuditSink::new());
        let chained = ChainedAuditSink::new(memory.clone(), KEY);
        for i in 0..n {
            let mut record = record();
            record.request_id = format!("req-{i}");
            chained.write(&[record]).await.unwrap();
        }
        memory.records().iter().map(|r| serde_json::to_string(r).unwrap()).collect()
    }

    fn verify(lines: &[String], from_start: bool) -> Verdict {
        let mut verifier = Verifier::new(KEY, from_start);
        for (i, line) in lines.iter().enumerate() {
            verifier.line(|| format!("line {}", i + 1), line);
        }
        verifier.finish()
    }

    fn breaks(verdict: &Verdict) -> Vec<String> {
        verdict.breaks.iter().map(ToString::to_string).collect()
    }

    #[tokio::test]
    async fn a_chain_as_written_verifies_whole() {
        let lines = chained_lines(5).await;
        assert!(lines[0].ends_with("\"}") && lines[0].contains(r#","chain":""#), "{}", lines[0]);
        let verdict = verify(&lines, true);
        assert_eq!((verdict.verified, verdict.chains), (5, 1));
        assert!(verdict.breaks.is_empty(), "{:?}", verdict.breaks);
    }

    #[tokio::test]
    async fn an_altered_line_breaks_once_where_it_is() {
        let mut lines = chained_lines(4).await;
        lines[1] = lines[1].replace(r#""prompt_tokens":"#, r#""prompt_tokens":1"#);
        let verdict = verify(&lines, true);
        let breaks = breaks(&verdict);
        assert_eq!(breaks.len(), 1, "{breaks:?}");
        assert!(breaks[0].starts_with("line 2: ") && breaks[0].contains("seq 1 does not match its MAC"), "{breaks:?}");
        assert_eq!(verdict.verified, 3);
    }

    #[tokio::test]
    async fn a_removed_line_is_a_gap_and_a_removed_head_is_named() {
        let mut lines = chained_lines(4).await;
        lines.remove(2);
        let gap = breaks(&verify(&lines, true));
        assert_eq!(gap.len(), 1, "{gap:?}");
        assert!(gap[0].starts_with("line 3: ") && gap[0].contains("seq 2..=2 missing"), "{gap:?}");

        lines.remove(0);
        let breaks_from_start = breaks(&verify(&lines, true));
        assert!(breaks_from_start[0].contains("starts at seq 1: the 1 line(s) before it are missing"));
        // A read from a date on starts mid-chain: its first line is no break.
        assert_eq!(breaks(&verify(&lines, false)).len(), 1);
    }

    #[tokio::test]
    async fn swapped_lines_are_named_as_moved() {
        let mut lines = chained_lines(4).await;
        lines.swap(1, 2);
        let breaks = breaks(&verify(&lines, true));
        assert_eq!(breaks.len(), 2, "{breaks:?}");
        assert!(breaks[0].starts_with("line 2: ") && breaks[0].contains("seq 1..=1 missing"), "{breaks:?}");
        assert!(breaks[1].starts_with("line 3: ") && breaks[1].contains("seq 1 after seq 2"), "{breaks:?}");
    }

    #[tokio::test]
    async fn a_forged_line_and_a_wrong_key_do_not_verify() {
        let mut lines = chained_lines(2).await;
        // Without the key, a forger copies a chain field: it does not match.
        let mut forged = record();
        forged.tenant = "someone-else".into();
        let copied = lines[1].rsplit_once(r#","chain":"#).unwrap().1;
        let forged = serde_json::to_string(&forged).unwrap();
        lines.push(format!("{},\"chain\":{copied}", forged.strip_suffix('}').unwrap()));
        lines.push(forged);
        let breaks = breaks(&verify(&lines, true));
        assert_eq!(breaks.len(), 2, "{breaks:?}");
        assert!(breaks[0].contains("seq 1 after seq 1"), "{breaks:?}");
        assert!(breaks[1].starts_with("line 4: no chain"), "{breaks:?}");

        let mut other = Verifier::new(b"another key", true);
        for line in &lines[..2] {
            other.line(|| "l".into(), line);
        }
        assert_eq!(other.finish().breaks.len(), 2);
    }

    #[tokio::test]
    async fn writers_chain_apart_and_a_failed_write_leaves_a_gap() {
        struct Failing;
        #[async_trait::async_trait]
        impl AuditSink for Failing {
            async fn write(&self, _: &[AuditRecord]) -> Result<(), AuditError> {
                Err(AuditError::Sink("down".into()))
            }
        }
        let memory = Arc::new(MemoryAuditSink::new());
        let (a, b) = (ChainedAuditSink::new(memory.clone(), KEY), ChainedAuditSink::new(memory.clone(), KEY));
        assert_ne!(a.writer(), b.writer());
        a.write(&[record(), record()]).await.unwrap();
        b.write(&[record()]).await.unwrap();
        a.write(&[record()]).await.unwrap();
        let lines: Vec<String> = memory.records().iter().map(|r| serde_json::to_string(r).unwrap()).collect();
        let verdict = verify(&lines, true);
        assert_eq!((verdict.verified, verdict.chains, verdict.breaks.len()), (4, 2, 0));

        // The sink refuses a record: its number is spent, so the next one shows the gap.
        let memory = Arc::new(MemoryAuditSink::new());
        let chained = ChainedAuditSink::new(memory.clone(), KEY);
        chained.write(&[record()]).await.unwrap();
        let failing = ChainedAuditSink { inner: Arc::new(Failing), ..chained };
        assert!(failing.write(&[record()]).await.is_err());
        let chained = ChainedAuditSink { inner: memory.clone(), ..failing };
        chained.write(&[record()]).await.unwrap();
        let lines: Vec<String> = memory.records().iter().map(|r| serde_json::to_string(r).unwrap()).collect();
        let breaks = breaks(&verify(&lines, true));
        assert_eq!(breaks.len(), 1, "{breaks:?}");
        assert!(breaks[0].contains("seq 1..=1 missing"), "{breaks:?}");
    }
}
