//! `docs/cli.md` names every subcommand and long flag the real binary offers: the
//! help output of `flexway` and of each command is read, not a list kept here.
#![cfg(test)]

use std::process::Command;

fn help(args: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_flexway")).args(args).arg("--help").output().unwrap();
    assert!(output.status.success(), "flexway {args:?} --help failed");
    String::from_utf8(output.stdout).unwrap()
}

/// The names listed under `Commands:` in a help text (`help` aside).
fn commands(help: &str) -> Vec<String> {
    let Some(start) = help.find("Commands:") else { return Vec::new() };
    help[start..]
        .lines()
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_owned)
        .collect()
}

/// Every `--flag` in a help text.
fn long_flags(help: &str) -> Vec<String> {
    help.split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == ']' || c == '<' || c == '=')
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| w.trim_end_matches(|c: char| !c.is_ascii_alphanumeric()).to_owned())
        .collect()
}

#[test]
fn cli_doc_names_every_command_and_long_flag() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/cli.md")).unwrap();
    let mut pending = vec![Vec::<String>::new()];
    let mut seen = 0;
    while let Some(path) = pending.pop() {
        let args: Vec<&str> = path.iter().map(String::as_str).collect();
        let text = help(&args);
        for flag in long_flags(&text) {
            assert!(
                doc.contains(&format!("`{flag}")),
                "docs/cli.md does not document `{flag}` of `flexway {}`",
                args.join(" ")
            );
        }
        for command in commands(&text) {
            let mut sub = path.clone();
            sub.push(command);
            let full = format!("flexway {}", sub.join(" "));
            assert!(doc.contains(&format!("`{full}`")), "docs/cli.md has no section for `{full}`");
            pending.push(sub);
        }
        seen += 1;
    }
    // flexway, serve, validate, report, key, key new.
    assert!(seen >= 6, "only {seen} help texts read");
}
