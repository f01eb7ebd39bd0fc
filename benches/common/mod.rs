//! What the benchmarks share: the real `flexway serve` (release) in its own process.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// A running gateway process; killed and reaped on drop.
pub struct Gateway {
    child: Child,
    /// `http://127.0.0.1:PORT/v1`
    pub url: String,
    _dir: tempfile::TempDir,
}

impl Gateway {
    /// Writes `yaml` to a temp dir (relative paths in it land there) and starts the
    /// binary on a free port.
    pub fn start(yaml: &str) -> Gateway {
        Gateway::start_with_files(yaml, &[])
    }

    /// As [`Gateway::start`], with `files` (name, content) written beside the config
    /// first (a key file its config references).
    pub fn start_with_files(yaml: &str, files: &[(&str, &str)]) -> Gateway {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("flexway.yaml");
        std::fs::write(&config, yaml).unwrap();
        for (name, content) in files {
            std::fs::write(dir.path().join(name), content).unwrap();
        }
        // `BENCH_WRAP="valgrind --tool=massif"` runs the gateway under a profiler;
        // `BENCH_FLEXWAY_BIN=path` runs another build (an A/B against a commit before).
        let binary = std::env::var("BENCH_FLEXWAY_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_flexway").to_owned());
        let wrap = std::env::var("BENCH_WRAP").unwrap_or_default();
        let mut wrap = wrap.split_whitespace();
        let mut command = match wrap.next() {
            Some(tool) => {
                let mut command = Command::new(tool);
                command.args(wrap).arg(&binary);
                command
            }
            None => Command::new(&binary),
        };
        let mut child = command
            .args(["serve", "--config", config.to_str().unwrap(), "--listen", "127.0.0.1:0"])
            .current_dir(dir.path())
            .env("FLEXWAY_LOG", "warn")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let url = loop {
            let line = lines.next().unwrap().unwrap();
            if let Some(url) = line.strip_prefix("flexway listening on ") {
                break format!("{url}/v1");
            }
        };
        std::thread::spawn(move || lines.for_each(drop));
        Gateway { child, url, _dir: dir }
    }

    /// Peak resident memory of the gateway process (`VmHWM`), as /proc prints it.
    pub fn peak_memory(&self) -> String {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap_or_default();
        let line = status.lines().find(|l| l.starts_with("VmHWM")).unwrap_or("VmHWM: ?");
        line.split_whitespace().skip(1).collect::<Vec<_>>().join(" ")
    }

    /// CPU time the gateway process has used so far, user and system, in seconds.
    pub fn cpu_seconds(&self) -> f64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap_or_default();
        // Past the command's name, which may hold spaces: utime and stime are the 12th
        // and 13th fields after it, in clock ticks (100 a second on Linux).
        let after = stat.rsplit_once(") ").map_or("", |(_, rest)| rest);
        let ticks: u64 = after.split_whitespace().skip(11).take(2).filter_map(|t| t.parse::<u64>().ok()).sum();
        ticks as f64 / 100.0
    }

    /// Resident memory of the gateway process now (`VmRSS`), in KiB.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap_or_default();
        let line = status.lines().find(|l| l.starts_with("VmRSS")).unwrap_or("VmRSS: 0");
        line.split_whitespace().nth(1).and_then(|kib| kib.parse().ok()).unwrap_or(0)
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        // Under a profiler, SIGTERM: the gateway stops cleanly and the profiler writes.
        // The bench's own idle HTTP/2 connections cannot answer the gateway's closing
        // (this thread is here), so it is given ten seconds, then killed.
        if std::env::var_os("BENCH_WRAP").is_some() {
            let _ = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
            for _ in 0..100 {
                if matches!(self.child.try_wait(), Ok(Some(_))) {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[((p / 100.0) * (sorted.len() - 1) as f64).round() as usize]
}
