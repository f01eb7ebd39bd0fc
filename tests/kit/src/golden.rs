//! Checked-in files a generator writes (schemas, docs tables), and inputs built to
//! stress a parser.

use std::path::Path;

/// Checks a checked-in generated file against what its generator writes now; with
/// `FLEXWAY_BLESS=1` in the environment, writes it instead. `stale` says what the file
/// drifted from and how to regenerate it.
pub fn matches_or_bless(path: &Path, expected: &str, stale: &str) {
    if std::env::var_os("FLEXWAY_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(path, expected).unwrap();
        return;
    }
    let actual = std::fs::read_to_string(path).unwrap_or_default();
    assert!(actual == expected, "{} is out of date with {stale}", path.display());
}

/// A "billion laughs" of about `bytes`: `levels` anchors, each a list of aliases to
/// the one before, the first a list of `seed`s.
pub fn laughs(bytes: usize, levels: usize, seed: &str) -> String {
    let width = (bytes / levels / 4).max(2);
    let mut text = format!("version: 1\na0: &a0 [{}]\n", [seed; 4].join(", "));
    for level in 1..levels {
        text += &format!("a{level}: &a{level} [{}]\n", vec![format!("*a{}", level - 1); width].join(","));
    }
    text
}
