"""What every benchmark shares: running a script and reading its JSON line, the machine it ran on, the result file, and
the rendering of result files into the docs.

A benchmark ends with write_result(name, tables, notes): results/NAME.json holds its tables beside the command, torch
version, machine, date and commit that produced them, and replaces the previous file (history stays in git).
`python benchmarks/harness.py` writes every table into README.md and docs/*.md wherever a page holds its markers,

    <!-- result: NAME / TABLE TITLE -->
    <!-- end result -->

and tests/test_results.py fails when a page shows anything else between them than its result file holds. This file
also measures what README shows:

    python benchmarks/harness.py --quickstart          # README's quick start, as written: results/quickstart.json
    python benchmarks/harness.py --suite               # python -m pytest, timed: results/suite.json
    python benchmarks/harness.py --python PY [--python PY ...]   # the quick start and the bad-input tests with
                                                                 # other interpreters: results/python_versions.json
"""

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"(<!-- result: (?P<name>[\w-]+) / (?P<table>[^>]+?) -->\n)(?P<body>.*?)(<!-- end result -->)",
                    re.S)


def run_script(command, timeout, cwd=REPO, env=None):
    """Run `python COMMAND` and return (its JSON result line as a dict, wall seconds); a failure raises with the end
    of its stderr."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, *map(str, command)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command))} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith("{"))), seconds


def machine():
    """The machine in words: its GPUs if torch sees any, else its CPU model and the cores this process may use."""
    import torch
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 platform.processor() or platform.machine())
    return f"{model}, {len(os.sched_getaffinity(0))} cores"


def commit():
    """The commit of the code measured, with `+changes` when its Python files or requirements differ from it."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()
    changed = git("status", "--porcelain", "-uno", "--", "*.py", "requirements.txt")
    return git("rev-parse", "--short", "HEAD") + ("+changes" if changed else "")


def write_result(name, tables, notes="", folder=None):
    """results/NAME.json (or folder/NAME.json): tables ({title: {"columns": [...], "rows": [[...], ...]}}), a note
    for the reader, and how they were measured: the command as run, torch, Python, machine, date and commit. Written
    by common.atomic_write: a write that fails keeps the previous result."""
    import torch
    sys.path.insert(0, str(REPO))
    import common
    command = "python " + " ".join([os.path.relpath(os.path.abspath(sys.argv[0]), REPO), *sys.argv[1:]])
    result = {"name": name, "command": command, "torch": torch.__version__, "python": platform.python_version(),
              "machine": machine(), "date": datetime.date.today().isoformat(), "commit": commit(), "notes": notes,
              "tables": tables}
    path = Path(folder or RESULTS, f"{name}.json")
    common.atomic_write(path, (json.dumps(result, indent=1) + "\n").encode())
    print(f"wrote {path}", flush=True)
    return result


def cell(value):
    """A table cell: numbers to 4 significant digits (whole ones above 1,000), None as a dash."""
    if value is None:
        return "–"
    if isinstance(value, float) and abs(value) >= 1000 or isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,.0f}"
    return f"{value:.4g}" if isinstance(value, float) else str(value).replace("|", "\\|")  # (a column's border)


def table_markdown(name, title, first=True):
    """The markdown of one table of results/NAME.json, with the line that says how it was measured (after a page's
    first table of that file, a link back to it)."""
    result = json.loads((RESULTS / f"{name}.json").read_text())
    table = result["tables"][title]
    lines = ["| " + " | ".join(table["columns"]) + " |", "|" + " --- |" * len(table["columns"])]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in table["rows"]]
    source = (f"`{result['command']}`: torch {result['torch']}, Python {result['python']}, {result['machine']}, "
              f"{result['date']}, commit {result['commit']} ([results/{name}.json](../results/{name}.json))")
    if not first:
        return "\n".join(lines) + f"\n\nThe same run ([results/{name}.json](../results/{name}.json)).\n"
    return "\n".join(lines) + "\n\n" + source + (f". {result['notes']}" if result["notes"] else "") + "\n"


def rendered(page):
    """The text of a page with every marked table rendered from its result file (left as it is where the file does
    not exist yet: results/suite.json, say, before the first --suite)."""
    link = "results/" if page.parent == REPO else "../results/"
    seen = set()

    def render(match):
        if not (RESULTS / f"{match['name']}.json").exists():
            print(f"{page.relative_to(REPO)}: no results/{match['name']}.json yet", flush=True)
            return match[0]
        table = table_markdown(match["name"], match["table"], first=match["name"] not in seen)
        seen.add(match["name"])
        return match[1] + table.replace("](../results/", f"]({link}") + match[5]
    return MARKER.sub(render, page.read_text())


QUICKSTART = ["multi_gpu.py --gpus 0 --procs 2 --limit-train 8192 --batch-size 32 --epochs 2",
              "rpc_rl.py --envs-per-observer 16", "rpc_rl.py --tutorial --max-episodes 100",
              "rpc_rnn.py --epochs 1 --max-batches 200 --emsize 64 --nhid 64",
              "rpc_rnn.py --check-gradients --dropout 0 --clip 0.05 --emsize 32 --nhid 32",
              "async_hpo.py --max-trials 6 --max-epochs 2 --limit-train 5000 --activation relu"]


def data_cache(folder):
    """A download cache ($XDG_CACHE_HOME) in folder that holds the data of DATA_DIR or ../shared/data as links, so that
    the commands run as written without downloading."""
    source = Path(os.environ.get("DATA_DIR") or REPO.parent / "shared" / "data")
    for name in ("fashion-mnist", "wikitext-2"):
        target = Path(folder, "torch-distributed-patterns", name)
        target.mkdir(parents=True)
        for path in (source / name).iterdir():
            (target / path.name).symlink_to(path)
    return {"XDG_CACHE_HOME": str(folder)}


def timed(command, env, timeout=1800):
    """(exit status, the last line before the JSON line, or the JSON line where it is the only one, wall seconds) of
    a command run from the repository."""
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("{")] or lines or [proc.stderr.strip()]
    return proc.returncode, lines[-1][:110], time.perf_counter() - started


def quickstart(python=sys.executable):
    """README's quick start, each command as written (async_hpo's search goes into runs/, which git ignores)."""
    with tempfile.TemporaryDirectory() as folder:
        env = data_cache(folder)
        rows = []
        for command in QUICKSTART:
            status, last, seconds = timed([python, *command.split()], env)
            rows.append([f"`python {command}`", status, f"`{last}`", round(seconds)])
            print(rows[-1], flush=True)
    return rows


def versions(python):
    code = "import platform, torch, numpy; print(platform.python_version(), torch.__version__, numpy.__version__)"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.split()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quickstart", action="store_true", help="run README's quick start")
    parser.add_argument("--suite", action="store_true", help="run the test suite, timed")
    parser.add_argument("--python", action="append", help="an interpreter to run the scripts and bad-input tests with")
    args = parser.parse_args()
    if args.quickstart:
        write_result("quickstart", {"The quick start on two CPU cores": {
            "columns": ["command", "exit status", "its last line before the JSON line", "seconds"],
            "rows": quickstart()}})
    if args.suite:
        status, last, seconds = timed([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], {}, 7200)
        write_result("suite", {"The test suite on two CPU cores": {
            "columns": ["command", "exit status", "its last line", "seconds"],
            "rows": [["`python -m pytest -q`", status, f"`{last}`", round(seconds)]]}})
    if args.python:
        rows = []
        for python in args.python:
            python_version, torch_version, numpy_version = versions(python)
            with tempfile.TemporaryDirectory() as folder:
                status, last, seconds = timed([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                                               "bad_input or help_lists or bad_data or corrupt"], data_cache(folder))
            runs = quickstart(python)
            rows.append([python_version, torch_version, numpy_version,
                         f"{sum(run[1] == 0 for run in runs)} of {len(runs)}, {sum(run[3] for run in runs)} s",
                         f"`{last}`" if status == 0 else f"exit status {status}: `{last}`"])
        write_result("python_versions", {"Other interpreters and torch releases": {
            "columns": ["Python", "torch", "numpy", "quick-start commands that exit 0", "bad-input tests"],
            "rows": rows}}, "Each interpreter a venv of requirements.txt (or with the torch named). The quick start: "
                            "README's commands; the bad-input tests: `python -m pytest -k \"bad_input or help_lists or "
                            "bad_data or corrupt\"`")
    if not (args.quickstart or args.suite or args.python):
        for page in PAGES:
            if page.read_text() != (text := rendered(page)):
                page.write_text(text)
                print(f"rendered {page.relative_to(REPO)}")


if __name__ == "__main__":
    main()
