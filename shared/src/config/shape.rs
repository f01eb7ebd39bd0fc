//! The shape pass: the YAML tree read into the raw types in one walk, every entry of
//! the wrong shape reported with its path and left out.
//!
//! Serde stops at the first error; an operator wants them all. [`Node`] is a
//! deserializer over the tree that recovers where an entry ends. Derived structs and
//! the standard collections ask for keys and values by type (`next_key::<K>()`,
//! `next_value::<V>()`, `next_element::<T>()`), so a failed entry can be read again
//! from an absent value:
//!
//! - a key refused by its struct (a misspelt field) is reported and skipped;
//! - a struct field whose value has the wrong shape is reported and read as absent
//!   (every raw field is optional, so absent never invents a "missing field");
//! - an entry of a map (`tenants`, `backends`) of the wrong shape is reported and
//!   left out of the map;
//! - an item of a list of the wrong shape is reported, the other items are checked
//!   too, and the list as a whole is left out of its parent (removing one item would
//!   shift the indices the rules report).
//!
//! Each node is deserialized once, so the pass is linear in the tree (the old way
//! re-read the whole document after each error). Leaves and tagged nodes are read
//! by `serde_norway`'s own deserializer, so every message is the one it has always
//! given. At most `cap` errors are kept with their message; the others are counted.

use std::cell::RefCell;
use std::fmt;

use serde::de::{self, Deserialize, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_norway::{Mapping, Value};

use super::Diagnostic;

/// What the pass found wrong.
#[derive(Debug, Default)]
pub(super) struct ShapeErrors {
    /// The first errors in document order, with their path.
    pub listed: Vec<Diagnostic>,
    /// Errors found beyond `listed`.
    pub unlisted: usize,
    /// Path of every error (listed or not) that lost a value the rules would read:
    /// all but unknown keys.
    pub lost_values: Vec<String>,
}

/// Reads `doc` as a `T`, leaving out what has the wrong shape; `None` only when the
/// document as a whole cannot be a `T`.
pub(super) fn read<'de, T: Deserialize<'de>>(doc: &'de Value, cap: usize) -> (Option<T>, ShapeErrors) {
    let recorder = RefCell::new(Recorder { cap, errors: ShapeErrors::default() });
    let read = match T::deserialize(Node::at(doc, &Path::Root, &recorder)) {
        Ok(read) => Some(read),
        Err(failure) => {
            recorder.borrow_mut().record(&Path::Root, failure);
            None
        }
    };
    (read, recorder.into_inner().errors)
}

/// Where a node is: its parent, and its key or index there.
enum Path<'p> {
    Root,
    Key(&'p Path<'p>, &'p Value),
    Index(&'p Path<'p>, usize),
}

impl fmt::Display for Path<'_> {
    /// `ai.backends.ptu-west.auth`, `tenants.acme.keys[1]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Path::Root => Ok(()),
            Path::Key(parent, key) => {
                if !matches!(parent, Path::Root) {
                    write!(f, "{parent}.")?;
                }
                match key {
                    Value::String(s) => f.write_str(s),
                    Value::Number(n) => write!(f, "{n}"),
                    Value::Bool(b) => write!(f, "{b}"),
                    _ => f.write_str("?"),
                }
            }
            Path::Index(parent, index) => write!(f, "{parent}[{index}]"),
        }
    }
}

/// Why a node could not be read.
#[derive(Debug)]
enum Failure {
    /// What is wrong, not yet reported: the entry that holds the node reports it.
    Message(String),
    /// Already reported where it happened; the entry that holds the node is left out.
    Recorded,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Message(message) => f.write_str(message),
            Failure::Recorded => f.write_str("reported above"),
        }
    }
}

impl std::error::Error for Failure {}

impl de::Error for Failure {
    fn custom<T: fmt::Display>(message: T) -> Self {
        Failure::Message(message.to_string())
    }
}

impl From<serde_norway::Error> for Failure {
    fn from(error: serde_norway::Error) -> Self {
        Failure::Message(error.to_string())
    }
}

struct Recorder {
    cap: usize,
    errors: ShapeErrors,
}

impl Recorder {
    /// Reports `failure` at `path` unless it was reported where it happened.
    fn record(&mut self, path: &Path<'_>, failure: Failure) {
        let Failure::Message(message) = failure else {
            return;
        };
        let errors = &mut self.errors;
        // A field name is fixed by the schema: a misspelt one took nothing the
        // rules read (the same test as the old pass made on the message).
        if !message.starts_with("unknown field") {
            errors.lost_values.push(path.to_string());
        }
        if errors.listed.len() < self.cap {
            errors.listed.push(Diagnostic::new(path.to_string(), message));
        } else {
            errors.unlisted += 1;
        }
    }
}

/// A node of the tree, as a deserializer that recovers at its entries.
struct Node<'de, 'p> {
    value: &'de Value,
    path: &'p Path<'p>,
    recorder: &'p RefCell<Recorder>,
}

impl<'de, 'p> Node<'de, 'p> {
    fn at(value: &'de Value, path: &'p Path<'p>, recorder: &'p RefCell<Recorder>) -> Self {
        Node { value, path, recorder }
    }

    fn record(&self, path: &Path<'_>, failure: Failure) {
        self.recorder.borrow_mut().record(path, failure);
    }
}

/// The methods by which serde asks for a collection: a sequence is read for the
/// first six, a mapping for the first and the last two, as `serde_norway` reads
/// them. Asked for anything else, a collection is an error, which `serde_norway`
/// words (it never descends into the collection to say so).
const READS_SEQUENCE: [&str; 6] = [
    "deserialize_any",
    "deserialize_seq",
    "deserialize_tuple",
    "deserialize_tuple_struct",
    "deserialize_bytes",
    "deserialize_byte_buf",
];
const READS_MAPPING: [&str; 3] = ["deserialize_any", "deserialize_map", "deserialize_struct"];

/// Collections are walked here, entry by entry; everything else (scalars, null,
/// tagged nodes, a collection asked for as a scalar) goes to `serde_norway`'s
/// deserializer of the same node, which gives the messages operators know.
macro_rules! read_node {
    ($($method:ident($($arg:ident: $ty:ty),*)),* $(,)?) => {
        $(
            fn $method<V: Visitor<'de>>(self, $($arg: $ty,)* visitor: V) -> Result<V::Value, Failure> {
                let method = stringify!($method);
                match self.value {
                    Value::Sequence(items) if READS_SEQUENCE.contains(&method) => self.seq(items, visitor),
                    Value::Mapping(entries) if READS_MAPPING.contains(&method) => self.map(entries, visitor),
                    value => Ok(<&'de Value as Deserializer<'de>>::$method(value, $($arg,)* visitor)?),
                }
            }
        )*
    };
}

impl<'de> Node<'de, '_> {
    fn seq<V: Visitor<'de>>(self, items: &'de [Value], visitor: V) -> Result<V::Value, Failure> {
        let mut access = Items { items: items.iter().enumerate(), node: self, failed: false };
        let value = visitor.visit_seq(&mut access)?;
        if access.failed {
            return Err(Failure::Recorded);
        }
        match access.items.len() {
            0 => Ok(value),
            _ => Err(de::Error::invalid_length(items.len(), &"fewer elements in sequence")),
        }
    }

    fn map<V: Visitor<'de>>(self, entries: &'de Mapping, visitor: V) -> Result<V::Value, Failure> {
        let mut access = Entries { entries: entries.iter(), node: self, pending: None };
        let value = visitor.visit_map(&mut access)?;
        match access.entries.len() {
            0 => Ok(value),
            _ => Err(de::Error::invalid_length(entries.len(), &"fewer elements in map")),
        }
    }
}

impl<'de> Deserializer<'de> for Node<'de, '_> {
    type Error = Failure;

    read_node! {
        deserialize_any(),
        deserialize_bool(),
        deserialize_i8(),
        deserialize_i16(),
        deserialize_i32(),
        deserialize_i64(),
        deserialize_i128(),
        deserialize_u8(),
        deserialize_u16(),
        deserialize_u32(),
        deserialize_u64(),
        deserialize_u128(),
        deserialize_f32(),
        deserialize_f64(),
        deserialize_char(),
        deserialize_str(),
        deserialize_string(),
        deserialize_bytes(),
        deserialize_byte_buf(),
        deserialize_unit(),
        deserialize_seq(),
        deserialize_map(),
        deserialize_identifier(),
        deserialize_unit_struct(name: &'static str),
        deserialize_tuple(len: usize),
        deserialize_tuple_struct(name: &'static str, len: usize),
        deserialize_struct(name: &'static str, fields: &'static [&'static str]),
        deserialize_enum(name: &'static str, variants: &'static [&'static str]),
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Failure> {
        match self.value {
            Value::Null => visitor.visit_none(),
            _ => visitor.visit_some(self),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(self, _: &'static str, visitor: V) -> Result<V::Value, Failure> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Failure> {
        visitor.visit_unit()
    }
}

/// The items of a sequence. An item of the wrong shape is reported and skipped, the
/// others are still checked, and the sequence then fails as a whole.
struct Items<'de, 'p> {
    items: std::iter::Enumerate<std::slice::Iter<'de, Value>>,
    node: Node<'de, 'p>,
    failed: bool,
}

impl<'de> SeqAccess<'de> for Items<'de, '_> {
    type Error = Failure;

    fn next_element<T: Deserialize<'de>>(&mut self) -> Result<Option<T>, Failure> {
        for (index, item) in self.items.by_ref() {
            let path = Path::Index(self.node.path, index);
            match T::deserialize(Node::at(item, &path, self.node.recorder)) {
                Ok(value) => return Ok(Some(value)),
                Err(failure) => {
                    self.node.record(&path, failure);
                    self.failed = true;
                }
            }
        }
        Ok(None)
    }

    /// A seed is spent by one try: an item of the wrong shape ends the sequence.
    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>, Failure> {
        let Some((index, item)) = self.items.next() else {
            return Ok(None);
        };
        let path = Path::Index(self.node.path, index);
        seed.deserialize(Node::at(item, &path, self.node.recorder)).map(Some).map_err(|failure| {
            self.node.record(&path, failure);
            Failure::Recorded
        })
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.items.len())
    }
}

static NULL: Value = Value::Null;

/// The entries of a mapping: a struct's fields or a map's entries.
struct Entries<'de, 'p> {
    entries: serde_norway::mapping::Iter<'de>,
    node: Node<'de, 'p>,
    /// The entry whose key was read and whose value is next.
    pending: Option<(&'de Value, &'de Value)>,
}

impl<'de> Entries<'de, '_> {
    fn key<K>(&self, key: &'de Value, read: impl FnOnce(Node<'de, '_>) -> Result<K, Failure>) -> Result<K, Failure> {
        // Reported at the key's own path: `ai.backends.main.colour`.
        let path = Path::Key(self.node.path, key);
        read(Node::at(key, &path, self.node.recorder)).map_err(|failure| {
            self.node.record(&path, failure);
            Failure::Recorded
        })
    }
}

impl<'de> MapAccess<'de> for Entries<'de, '_> {
    type Error = Failure;

    fn next_key<K: Deserialize<'de>>(&mut self) -> Result<Option<K>, Failure> {
        while let Some((key, value)) = self.entries.next() {
            if let Ok(read) = self.key(key, |node| K::deserialize(node)) {
                self.pending = Some((key, value));
                return Ok(Some(read));
            }
        }
        Ok(None)
    }

    fn next_value<V: Deserialize<'de>>(&mut self) -> Result<V, Failure> {
        let (key, value) =
            self.pending.take().ok_or_else(|| <Failure as de::Error>::custom("a value without its key"))?;
        let path = Path::Key(self.node.path, key);
        match V::deserialize(Node::at(value, &path, self.node.recorder)) {
            Ok(read) => Ok(read),
            Err(failure) => {
                self.node.record(&path, failure);
                // Every raw field is optional: read as absent, the entry is left out.
                V::deserialize(Node::at(&NULL, &path, self.node.recorder)).map_err(|_| Failure::Recorded)
            }
        }
    }

    fn next_entry<K: Deserialize<'de>, V: Deserialize<'de>>(&mut self) -> Result<Option<(K, V)>, Failure> {
        while let Some((key, value)) = self.entries.next() {
            let Ok(read_key) = self.key(key, |node| K::deserialize(node)) else {
                continue;
            };
            let path = Path::Key(self.node.path, key);
            match V::deserialize(Node::at(value, &path, self.node.recorder)) {
                Ok(read_value) => return Ok(Some((read_key, read_value))),
                Err(failure) => self.node.record(&path, failure),
            }
        }
        Ok(None)
    }

    /// Seeds are spent by one try: an entry of the wrong shape fails the mapping.
    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, Failure> {
        let Some((key, value)) = self.entries.next() else {
            return Ok(None);
        };
        self.pending = Some((key, value));
        self.key(key, |node| seed.deserialize(node)).map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Failure> {
        let (key, value) =
            self.pending.take().ok_or_else(|| <Failure as de::Error>::custom("a value without its key"))?;
        let path = Path::Key(self.node.path, key);
        seed.deserialize(Node::at(value, &path, self.node.recorder)).map_err(|failure| {
            self.node.record(&path, failure);
            Failure::Recorded
        })
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.entries.len())
    }
}
