//! What the tests of the gateway function share: the workspace, `cargo lambda`, and
//! the child processes they start (the emulator and the function), killed on drop.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

pub fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn cargo_lambda() -> PathBuf {
    if let Ok(path) = std::env::var("CARGO_LAMBDA") {
        return PathBuf::from(path);
    }
    let venv = workspace().join(".venv/bin/cargo-lambda");
    if venv.exists() {
        return venv;
    }
    PathBuf::from("cargo-lambda")
}

/// A child process in its own process group, killed (group and all) on drop.
pub struct Process {
    child: Child,
    name: &'static str,
    pub logs: Arc<Mutex<Vec<String>>>,
}

impl Process {
    pub fn spawn(name: &'static str, mut command: Command) -> Process {
        use std::os::unix::process::CommandExt;
        command.process_group(0).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = command.spawn().unwrap_or_else(|e| panic!("cannot start {name} ({command:?}): {e}"));
        let logs = Arc::new(Mutex::new(Vec::new()));
        for pipe in [
            child.stdout.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
            child.stderr.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let logs = logs.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    logs.lock().unwrap().push(line);
                }
            });
        }
        Process { child, name, logs }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn logs(&self) -> String {
        format!("--- {} ---\n{}", self.name, self.logs.lock().unwrap().join("\n"))
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = Command::new("kill").arg("--").arg(format!("-{}", self.child.id())).status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}
