"""What every benchmark shares: running a script and reading its JSON line, the machine it ran on, and the result file.

A benchmark ends with write_result(name, tables, ...): results/NAME.json holds its figures beside the command, torch
version, machine, date and commit that produced them, and `python benchmarks/render.py` writes every result's tables
into the docs pages between their markers (tests/test_results.py checks that the pages show what the files hold).
"""

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"


def run_script(command, timeout, cwd=REPO, env=None):
    """Run a command (a script and its flags) and return (its JSON result line as a dict, wall seconds); a failure
    raises with the end of its stderr."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, *map(str, command)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command))} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    line = next(line for line in reversed(proc.stdout.splitlines()) if line.startswith("{"))
    return json.loads(line), seconds


def machine():
    """The machine in words: its GPU if torch sees one, else its CPU model and the cores this process may use."""
    import torch
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                      if line.startswith("model name")), model)
    return f"{model}, {len(os.sched_getaffinity(0))} cores"


def commit():
    """The commit of the code measured, with `+changes` when the working tree differs from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True)
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "") if head.returncode == 0 else "unknown"


def write_result(name, tables, notes="", command=None):
    """results/NAME.json: tables ({title: {"columns": [...], "rows": [[...], ...]}}), a note for the reader, and how
    they were measured. Replaces the previous file: history stays in git."""
    import torch
    result = {"name": name, "command": command or "python " + " ".join([os.path.relpath(sys.argv[0], REPO),
                                                                           *sys.argv[1:]]),
              "torch": torch.__version__, "python": platform.python_version(), "machine": machine(),
              "date": datetime.date.today().isoformat(), "commit": commit(), "notes": notes, "tables": tables}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {RESULTS / f'{name}.json'}", flush=True)
    return result
