//! Hostile input: what a document may cost, checked before it is built.
//!
//! A configuration is operator input that CI may run on pull requests (SPEC §12), so
//! loading one must cost about what its size says. Three things could make it cost
//! far more, and each is refused here, with the reason, before any tree is built:
//!
//! - **Size.** Over [`MAX_BYTES`] the text is not parsed at all.
//! - **Nesting written cheaply.** The YAML scanner's work per token grows with the
//!   number of flow collections open (`[[[[…`: 200 KB of `[` cost it minutes), and
//!   the parser holds every event before anything reads them (`- - - - …`: 4 MiB of
//!   it took 850 MB). A lexical pass that knows just enough YAML (comments, quoted
//!   and block scalars, where a node may start) counts the open flow collections and
//!   the levels each line opens (`- `, `? `, `key: `) before the parser sees the
//!   text. Nesting by indentation needs more bytes per level than the size bound
//!   leaves room for; the walk below judges it.
//! - **Aliases and depth.** The parser's events are walked once by a visitor that
//!   builds nothing and counts every node, every byte of scalar text and every level
//!   *as the expanded document would hold them*: `serde_norway` replays an anchor's
//!   events at each alias, so an alias is weighed as the copy it stands for. The walk
//!   stops at the first node, byte or level past the limit, so it costs at most
//!   [`MAX_NODES`] steps whatever the aliases multiply to (a 10 KB "billion laughs"
//!   stands for 10^18 nodes), and whatever it accepts is exactly what the tree built
//!   next will hold.
//!
//! Invariant: the tree built after [`check`] answered `Ok` holds at most
//! [`MAX_NODES`] nodes, [`MAX_SCALAR_BYTES`] of text and [`MAX_DEPTH`] levels.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess, Visitor};

use super::Diagnostic;

/// Largest configuration file: SPEC §12's 4 MiB. The SPEC example is 4 KB; a
/// configuration with thousands of tenants is well under 1 MiB.
pub const MAX_BYTES: usize = 4 * 1024 * 1024;
/// Deepest nesting of collections. `flexway.yaml` itself nests 6 deep
/// (`ai.backends.X.circuit_breaker.status[0]`).
pub const MAX_DEPTH: usize = 64;
/// Most nodes (scalars and collections) in the document once aliases are expanded:
/// more than 4 MiB of configuration written out holds (about 300,000).
pub const MAX_NODES: usize = 1_000_000;
/// Most scalar text in the document once aliases are expanded: more than 4 MiB of
/// text can spell, escapes included.
pub const MAX_SCALAR_BYTES: usize = 16 * 1024 * 1024;
/// Longest mapping key. Keys are names (tenants, backends, models); a document path
/// repeats its keys in every message below them, so a long one would make the
/// diagnostics grow with the square of the document.
pub const MAX_KEY_BYTES: usize = 1024;

/// Refuses a document whose size, nesting or aliases exceed what a configuration
/// needs. `Ok` also when the text is not valid YAML: the parse that follows reports
/// that, walking the same events in the same order within the bounds checked here.
pub(super) fn check(text: &str) -> Result<(), Diagnostic> {
    check_size(text.len())?;
    let aliases = check_written_nesting(text)?;
    weigh(text, aliases)
}

pub(super) fn check_size(bytes: usize) -> Result<(), Diagnostic> {
    if bytes > MAX_BYTES {
        return Err(Diagnostic::new(
            "",
            format!(
                "the file is larger than 4 MiB ({MAX_BYTES} bytes), far more than a configuration needs: \
                 refused without reading it further"
            ),
        ));
    }
    Ok(())
}

fn too_deep(at: Option<usize>) -> Diagnostic {
    let line = at.map(|line| format!(" (line {line})")).unwrap_or_default();
    Diagnostic::new("", format!("nesting deeper than {MAX_DEPTH} levels{line}: a configuration needs a handful"))
}

// ----- nesting as written, before the parser ------------------------------------------------

/// Counts the flow collections (`[`, `{`) open at each point of the text, plus the
/// block levels opened on the same line (`- - key: `), and refuses more than
/// [`MAX_DEPTH`]. Brackets and indicators inside comments, quoted scalars, block
/// scalars and plain scalars are text and are skipped. The scan errs towards
/// counting less (an unterminated quote hides the rest), never towards refusing a
/// valid document: a plain scalar's continuation line starting with `[` is the one
/// case it would count, and it would take 65 of them unclosed.
///
/// Answers whether the text seems to use aliases (`*name` where a node starts), for
/// the wording of the walk's refusal.
fn check_written_nesting(text: &str) -> Result<bool, Diagnostic> {
    let mut aliases = false;
    let mut depth = 0usize;
    // Inside a quoted scalar (which may span lines): its quote character.
    let mut quote: Option<u8> = None;
    // Inside a block scalar (`|`, `>`): the column of the node that owns it; its
    // content is every following line that is blank or indented further.
    let mut block_scalar: Option<isize> = None;

    for (index, line) in text.split('\n').enumerate() {
        let bytes = line.as_bytes();
        let indent = bytes.iter().take_while(|&&b| b == b' ').count();
        if let Some(owner) = block_scalar {
            let blank = bytes[indent..].iter().all(|&b| b == b' ' || b == b'\t' || b == b'\r');
            if blank || indent as isize > owner {
                continue;
            }
            block_scalar = None;
        }

        // In block context a node (and so a flow collection, a quote or a block
        // scalar) may start at the line's first character, after `- `, `? `, `: `,
        // `--- ` and after properties (`&anchor`, `!tag`); not inside a plain scalar.
        let mut node_start = true;
        // Block levels opened on this line.
        let mut levels = 0usize;
        // Column where the innermost block node of this line started (a key or `-`).
        let mut owner = indent as isize;
        let mut prev = b' ';
        let mut i = 0;
        if line.starts_with("---") && bytes.get(3).is_none_or(|b| b.is_ascii_whitespace()) {
            owner = -1;
            i = 3;
        }
        while i < bytes.len() {
            let b = bytes[i];
            let next = bytes.get(i + 1).copied();
            if let Some(q) = quote {
                match b {
                    b'\\' if q == b'"' => i += 1,
                    b'\'' if q == b'\'' && next == Some(b'\'') => i += 1,
                    _ if b == q => {
                        quote = None;
                        node_start = false;
                    }
                    _ => {}
                }
                prev = b;
                i += 1;
                continue;
            }
            let after_space = matches!(prev, b' ' | b'\t');
            let separated = next.is_none_or(|n| matches!(n, b' ' | b'\t' | b'\r'));
            if depth > 0 {
                // Flow context: brackets can only be indicators here.
                match b {
                    b'#' if after_space => break,
                    b'\'' | b'"' if matches!(prev, b' ' | b'\t' | b'[' | b'{' | b',' | b':') => quote = Some(b),
                    b'[' | b'{' => depth += 1,
                    b'*' if matches!(prev, b' ' | b'\t' | b'[' | b'{' | b',' | b':') => aliases = true,
                    b']' | b'}' => {
                        depth -= 1;
                        node_start = false;
                    }
                    _ => {}
                }
            } else {
                match b {
                    b'#' if after_space => break,
                    b' ' | b'\t' | b'\r' => {}
                    b':' if separated => {
                        node_start = true;
                        levels += 1;
                    }
                    b'-' | b'?' if node_start && separated => {
                        owner = i as isize;
                        levels += 1;
                    }
                    b'&' | b'!' if node_start => {
                        // A property: the node itself follows it.
                        while i + 1 < bytes.len() && !matches!(bytes[i + 1], b' ' | b'\t') {
                            i += 1;
                        }
                    }
                    b'[' | b'{' if node_start => {
                        depth = 1;
                        node_start = false;
                    }
                    b'|' | b'>' if node_start => {
                        block_scalar = Some(owner);
                        break;
                    }
                    b'\'' | b'"' if node_start => {
                        owner = i as isize;
                        quote = Some(b);
                    }
                    b'*' if node_start => {
                        aliases = true;
                        node_start = false;
                    }
                    _ => {
                        if node_start {
                            owner = i as isize;
                        }
                        node_start = false;
                    }
                }
            }
            if depth + levels > MAX_DEPTH {
                return Err(too_deep(Some(index + 1)));
            }
            prev = b;
            i += 1;
        }
    }
    Ok(aliases)
}

// ----- aliases and depth, on the parser's events ---------------------------------------

/// Why the walk stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// More nodes; `true` when the text uses aliases.
    Nodes(bool),
    ScalarBytes(bool),
    Depth,
    KeyBytes,
}

impl Refusal {
    fn diagnostic(self) -> Diagnostic {
        let message = match self {
            Refusal::Nodes(true) => format!(
                "YAML aliases would expand the document to more than {MAX_NODES} nodes, far more than a \
                 configuration needs: refused before expanding it"
            ),
            Refusal::Nodes(false) => {
                format!("the document has more than {MAX_NODES} nodes, far more than a configuration needs")
            }
            Refusal::ScalarBytes(true) => format!(
                "YAML aliases would expand the document to more than {} MiB of text, far more than a \
                 configuration needs: refused before expanding it",
                MAX_SCALAR_BYTES / (1024 * 1024)
            ),
            Refusal::ScalarBytes(false) => format!(
                "the document has more than {} MiB of text, far more than a configuration needs",
                MAX_SCALAR_BYTES / (1024 * 1024)
            ),
            Refusal::Depth => return too_deep(None),
            Refusal::KeyBytes => format!(
                "a mapping key is longer than {MAX_KEY_BYTES} bytes: keys are names, and a configuration's \
                 names are short"
            ),
        };
        Diagnostic::new("", message)
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.diagnostic().message)
    }
}

/// What the walk has counted so far.
#[derive(Default)]
struct Tally {
    /// The text seems to use aliases: say so when refusing.
    aliases: bool,
    nodes: usize,
    scalar_bytes: usize,
    refusal: Option<Refusal>,
}

impl Tally {
    fn refuse<E: de::Error>(&mut self, refusal: Refusal) -> Result<(), E> {
        self.refusal = Some(refusal);
        Err(E::custom(refusal))
    }

    fn node<E: de::Error>(&mut self, scalar_bytes: usize) -> Result<(), E> {
        self.nodes += 1;
        self.scalar_bytes = self.scalar_bytes.saturating_add(scalar_bytes);
        if self.nodes > MAX_NODES {
            return self.refuse(Refusal::Nodes(self.aliases));
        }
        if self.scalar_bytes > MAX_SCALAR_BYTES {
            return self.refuse(Refusal::ScalarBytes(self.aliases));
        }
        Ok(())
    }
}

fn weigh(text: &str, aliases: bool) -> Result<(), Diagnostic> {
    let mut tally = Tally { aliases, ..Tally::default() };
    let walked =
        Weigh { tally: &mut tally, depth: 0, key: false }.deserialize(serde_norway::Deserializer::from_str(text));
    match (walked, tally.refusal) {
        (Ok(()), _) => Ok(()),
        (Err(_), Some(refusal)) => Err(refusal.diagnostic()),
        // serde_norway's own guard: more alias replays than 100 per event written.
        // Its error has no kind to match, only this text (a unit test pins it).
        (Err(error), None) if error.to_string().starts_with(SERDE_NORWAY_REPETITION_LIMIT) => {
            Err(Refusal::Nodes(true).diagnostic())
        }
        // Not YAML: the parse that follows says where and why.
        (Err(_), None) => Ok(()),
    }
}

const SERDE_NORWAY_REPETITION_LIMIT: &str = "repetition limit exceeded";

/// One node of the walk: `deserialize_any`, exactly as `serde_norway::Value` reads
/// the document, so that the walk and the tree built after it see the same events.
struct Weigh<'t> {
    tally: &'t mut Tally,
    /// Levels of collections around this node.
    depth: usize,
    /// This node is a mapping key.
    key: bool,
}

impl Weigh<'_> {
    fn child(&mut self, key: bool) -> Weigh<'_> {
        Weigh { tally: self.tally, depth: self.depth + 1, key }
    }

    fn scalar<E: de::Error>(self, bytes: usize) -> Result<(), E> {
        if self.key && bytes > MAX_KEY_BYTES {
            return self.tally.refuse(Refusal::KeyBytes);
        }
        self.tally.node(bytes)
    }

    fn collection<E: de::Error>(&mut self) -> Result<(), E> {
        if self.depth + 1 > MAX_DEPTH {
            return self.tally.refuse(Refusal::Depth);
        }
        self.tally.node(0)
    }
}

impl<'de> DeserializeSeed<'de> for Weigh<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Weigh<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML node")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        self.scalar(1)
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        self.scalar(8)
    }
    fn visit_i128<E: de::Error>(self, _: i128) -> Result<(), E> {
        self.scalar(16)
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        self.scalar(8)
    }
    fn visit_u128<E: de::Error>(self, _: u128) -> Result<(), E> {
        self.scalar(16)
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        self.scalar(8)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        self.scalar(v.len())
    }
    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<(), E> {
        self.scalar(v.len())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.scalar(0)
    }
    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        self.scalar(0)
    }
    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
    fn visit_newtype_struct<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        self.collection()?;
        while seq.next_element_seed(self.child(false))?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<(), A::Error> {
        self.collection()?;
        while map.next_key_seed(self.child(true))?.is_some() {
            map.next_value_seed(self.child(false))?;
        }
        Ok(())
    }

    /// A tagged node (`!tag value`): the tag, then the value, as `Value` reads it.
    fn visit_enum<A: EnumAccess<'de>>(mut self, data: A) -> Result<(), A::Error> {
        let (_, contents) = data.variant_seed(self.child(false))?;
        contents.newtype_variant_seed(self.child(false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(text: &str) -> bool {
        check_written_nesting(text).is_ok()
    }

    #[test]
    fn flow_nesting_counts_only_collections() {
        let deep = format!("a: {}{}\n", "[".repeat(65), "]".repeat(65));
        assert!(!flow(&deep));
        // `a: ` opens the first level.
        assert!(flow(&format!("a: {}{}\n", "[".repeat(63), "]".repeat(63))));
        assert!(!flow(&format!("a: {}{}\n", "[".repeat(64), "]".repeat(64))));
        // Closed collections on one line never add up.
        assert!(flow(&format!("a: [{}]\n", "{b: [c]}, ".repeat(1000))));
        // Brackets that are text.
        let many = "[".repeat(100);
        assert!(flow(&format!("a: x{many}\n")));
        assert!(flow(&format!("a: '{many}'\nb: \"{many}\\\"{many}\"\n")));
        assert!(flow(&format!("a: 1 # {many}\n")));
        assert!(flow(&format!("a: |\n  {many}\n  {many}\nb: >-\n\n   {many}\nc: []\n")));
        assert!(flow(&format!("- key: |\n    {many}\n  other: 1\n")));
        assert!(flow(&format!("a: ['it''s {many}', \"{many}\"]\n")));
    }

    #[test]
    fn flow_nesting_across_lines_and_after_block_scalars() {
        let open = "[\n".repeat(65);
        assert!(!flow(&format!("a: {open}")));
        // A block scalar ends where the indentation comes back.
        assert!(!flow(&format!("a: |\n  text\nb: {}\n", "[".repeat(65))));
        assert!(!flow(&format!("- a: |\n    text\n  b: {}\n", "[".repeat(65))));
        // Brackets open after properties and indicators.
        assert!(!flow(&format!("a: &x !!seq {}\n", "[".repeat(65))));
        assert!(!flow(&format!("- - ? {}\n", "{".repeat(62))));
    }

    #[test]
    fn block_levels_on_one_line_count() {
        assert!(!flow(&format!("a:\n{}x\n", "- ".repeat(65))));
        assert!(flow(&format!("a:\n{}x\n", "- ".repeat(62))));
        assert!(!flow(&format!("{}x\n", "- k: ".repeat(33))));
        // Indicators inside scalars are text.
        assert!(flow(&format!("a: '{}'\nb: x{}\n", "- ".repeat(100), " - ? k".repeat(100))));
    }

    #[test]
    fn serde_norway_still_names_its_repetition_limit_so() {
        // `weigh` recognises serde_norway's own alias guard by its text.
        let mut laughs = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n".to_owned();
        for i in 1..12 {
            laughs += &format!("a{i}: &a{i} [{}]\n", vec![format!("*a{}", i - 1); 10].join(","));
        }
        let error = serde_norway::from_str::<serde_norway::Value>(&laughs).unwrap_err();
        assert!(error.to_string().starts_with(SERDE_NORWAY_REPETITION_LIMIT), "{error}");
        assert!(check(&laughs).unwrap_err().message.contains("YAML aliases"));
    }
}
