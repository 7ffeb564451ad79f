"""Shared test plumbing: run a script as a subprocess with a timeout, read its final JSON line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def data_root():
    """DATA_DIR if set, else ../shared/data beside the checkout; None lets the scripts download."""
    if os.environ.get("DATA_DIR"):
        return Path(os.environ["DATA_DIR"])
    shared = REPO.parent / "shared" / "data"
    return shared if shared.is_dir() else None


@pytest.fixture
def data_dir_args():
    """['--data-dir', root] for the scripts, or [] to let them use their download cache."""
    root = data_root()
    return ["--data-dir", str(root)] if root else []


def run_script(script, *args, timeout=120, env=None):
    """Run `python script args...` from the repo root; returns the CompletedProcess (text, captured)."""
    return subprocess.run([sys.executable, str(REPO / script), *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def last_json(stdout):
    """The last line of stdout that parses as a JSON object (the run's result)."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON result line in output:\n{stdout[-2000:]}")


def assert_usage_error(proc, *fragments):
    """Bad input: exit status 2, exactly one line on stderr, containing every fragment, no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
