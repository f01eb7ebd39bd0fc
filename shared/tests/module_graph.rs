//! The core crate's top-level modules import one another without a circle: the
//! vocabulary of a call sits at the bottom (`call`), the doors and the driver at the
//! top (`http`). A circle makes every module in it a dependency of every other, so a
//! change anywhere in it reaches all of them; this test names the circle found.
//!
//! It reads the source as text: a module's imports are the `crate::<module>` paths
//! (and `use crate::{a, b::c}` groups) in its files, comments and `#[cfg(test)]`
//! modules left out (a test may use anything).
#![cfg(test)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn source_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            source_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The text without comments and without what follows a `#[cfg(test)]` module (test
/// modules close their files here).
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod ") {
        Some(at) => &text[..at],
        None => text,
    };
    text.lines().map(|line| line.split("//").next().unwrap_or_default()).collect::<Vec<_>>().join("\n")
}

fn identifier(text: &str) -> &str {
    let end = text.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(text.len());
    &text[..end]
}

/// The top-level modules `text` names after `crate::`.
fn imports(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for (at, _) in text.match_indices("crate::") {
        let rest = &text[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // Each item of the group (commas inside nested groups skipped): its first
            // path segment.
            let mut depth = 0;
            let mut item_start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if item_start && !c.is_whitespace() => {
                        item_start = false;
                        let name = identifier(&group[i..]);
                        if !name.is_empty() {
                            found.insert(name.to_owned());
                        }
                    }
                    _ => {}
                }
            }
        } else {
            found.insert(identifier(rest).to_owned());
        }
    }
    found
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    source_files(&src, &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let relative = file.strip_prefix(&src).unwrap();
        let first = relative.components().next().unwrap().as_os_str().to_string_lossy().into_owned();
        let module = first.trim_end_matches(".rs").to_owned();
        if module == "lib" {
            continue;
        }
        let uses = imports(&code(&std::fs::read_to_string(file).unwrap()));
        graph.entry(module).or_default().extend(uses);
    }
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    for (module, uses) in &mut graph {
        uses.retain(|used| used != module && modules.contains(used));
    }
    graph
}

/// A circle through `from`, if there is one: the modules in order.
fn circle(graph: &BTreeMap<String, BTreeSet<String>>, from: &str) -> Option<Vec<String>> {
    fn walk(
        graph: &BTreeMap<String, BTreeSet<String>>,
        start: &str,
        at: &str,
        path: &mut Vec<String>,
        seen: &mut BTreeSet<String>,
    ) -> bool {
        for next in &graph[at] {
            if next == start {
                return true;
            }
            if seen.insert(next.clone()) {
                path.push(next.clone());
                if walk(graph, start, next, path, seen) {
                    return true;
                }
                path.pop();
            }
        }
        false
    }
    let mut path = vec![from.to_owned()];
    walk(graph, from, from, &mut path, &mut BTreeSet::new()).then_some(path)
}

#[test]
fn no_module_imports_itself_through_others() {
    let graph = graph();
    assert!(graph.len() > 10, "the crate's modules were not found: {graph:?}");
    for module in graph.keys() {
        if let Some(path) = circle(&graph, module) {
            panic!("import circle: {} -> {module}", path.join(" -> "));
        }
    }
}

#[test]
fn the_call_vocabulary_imports_nothing_of_the_crate() {
    assert_eq!(graph()["call"], BTreeSet::new());
}

#[test]
fn the_reader_finds_paths_and_groups_and_skips_comments_and_tests() {
    let text = "use crate::a::B;\nuse crate::{c, d::{E, x::F}, k};\n// crate::f\nfn g() { crate::h::i(); }\n\
                #[cfg(test)]\nmod tests { use crate::j; }";
    let found: Vec<String> = imports(&code(text)).into_iter().collect();
    assert_eq!(found, ["a", "c", "d", "h", "k"]);
    let graph = BTreeMap::from([
        ("a".to_owned(), BTreeSet::from(["b".to_owned()])),
        ("b".to_owned(), BTreeSet::from(["a".to_owned()])),
        ("c".to_owned(), BTreeSet::from(["a".to_owned()])),
    ]);
    assert_eq!(circle(&graph, "a"), Some(vec!["a".to_owned(), "b".to_owned()]));
    assert_eq!(circle(&graph, "c"), None);
}
