"""The project's binaries, started on free ports for the SDK tests."""

import os
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
TARGET = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "debug"


def start(args, banner):
    """Starts `args` and returns (process, URL) once it prints `<banner> listening on URL`."""
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    for line in proc.stderr:
        match = re.search(banner + r" listening on (http://\S+)", line)
        if match:
            return proc, match.group(1)
    proc.kill()
    raise RuntimeError(f"{args[0]} did not start")
