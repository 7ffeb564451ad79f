"""What every benchmark shares: running a script and reading its JSON line, the machine it ran on, the result file, and
the rendering of result files into the docs.

A benchmark starts with check_committed() and ends with write_result(name, tables, notes): results/NAME.json holds its
tables beside the command, torch version, machine, date and commit that produced them, and replaces the previous file
(history stays in git). Both refuse, in one line, code that differs from its commit and a command that names a path
outside the repository: a result is measured on a commit, by a command a reader can type in a clone. The data come
from DATA_DIR (a folder holding fashion-mnist/ and wikitext-2/) where it is set, else from the scripts' download
cache.
`python benchmarks/harness.py` writes every table into README.md and docs/*.md wherever a page holds its markers,

    <!-- result: NAME / TABLE TITLE -->
    <!-- end result -->

and tests/test_results.py fails when a page shows anything else between them than its result file holds. This file
also measures what README shows:

    python benchmarks/harness.py --quickstart          # README's quick start, as written: results/quickstart.json
    python benchmarks/harness.py --defaults            # how long each script's default run takes: results/defaults.json
    python benchmarks/harness.py --python 3.12 --python 3.13 --python "3.11 torch==2.11.0"
        # the quick start and the bad-input tests in a fresh venv of requirements.txt for each Python version (with
        # the pins given replacing the file's): results/python_versions.json
"""

import argparse
import datetime
import json
import os
import platform
import re
import statistics
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
    """The machine in words: its GPUs if torch sees any, else its CPU model and the cores this process may use; then
    its operating system."""
    import torch
    try:
        system = platform.freedesktop_os_release()["PRETTY_NAME"]
    except (OSError, KeyError):
        system = platform.platform(terse=True)
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, {system}"
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 platform.processor() or platform.machine())
    return f"{model}, {len(os.sched_getaffinity(0))} cores, {system}"


def git(*args):
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


OUTSIDE = re.compile(r"(?<![\w:/.-])(/|~/|\.\./)[^\s/]")  # an absolute path, or one that leaves the folder


def command():
    """This benchmark's command line as a reader types it in a clone, from the repository's root."""
    return "python " + " ".join([os.path.relpath(os.path.abspath(sys.argv[0]), REPO), *sys.argv[1:]])


def check_committed():
    """Exit in one line unless what is measured is a commit: Python files and requirements as HEAD holds them, and a
    command that names no path outside the repository."""
    changed = git("status", "--porcelain", "--", "*.py", "requirements.txt")
    if changed:
        sys.exit(f"{command()}: the code differs from commit {git('rev-parse', '--short', 'HEAD')} "
                 f"({', '.join(line.split()[-1] for line in changed.splitlines())}): commit first")
    if OUTSIDE.search(command()):
        sys.exit(f"{command()}: names a path outside the repository; give the data in DATA_DIR, interpreters by "
                 f"version")


def data_flags():
    """--data-dir for the scripts: DATA_DIR where it is set, else nothing (the scripts' download cache)."""
    return ["--data-dir", os.environ["DATA_DIR"]] if os.environ.get("DATA_DIR") else []


def spread(values, digits=4):
    """A timing's rounds as one table cell: the median, then the smallest and largest round, "4.67 (4.51–4.85)"."""
    values = sorted(values)
    low, middle, high = (f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:,.0f}"
                         for value in (values[0], statistics.median(values), values[-1]))
    return f"{middle} ({low}–{high})"


def write_result(name, tables, notes="", folder=None):
    """results/NAME.json (or folder/NAME.json): tables ({title: {"columns": [...], "rows": [[...], ...]}}), a note
    for the reader, and how they were measured: the command, torch, Python, machine, date and commit (checked, into
    results/: check_committed). Printed first, then written by common.atomic_write: a write that fails keeps the
    previous file, and the printed copy."""
    import torch
    sys.path.insert(0, str(REPO))
    import common
    if folder is None:  # a result of the project's (a test writes elsewhere)
        check_committed()
    result = {"name": name, "command": command(), "torch": torch.__version__, "python": platform.python_version(),
              "machine": machine(), "date": datetime.date.today().isoformat(), "commit": git("rev-parse", "--short",
                                                                                              "HEAD"),
              "notes": notes, "tables": tables}
    text = json.dumps(result, indent=1) + "\n"
    print(text, end="", flush=True)
    path = Path(folder or RESULTS, f"{name}.json")
    common.atomic_write(path, text.encode())
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


# README's quick start, and what each command's JSON line reports that its row shows
QUICKSTART = {"multi_gpu.py --gpus 0 --procs 2 --limit-train 8192 --batch-size 32 --epochs 2": ["test_acc"],
              "rpc_rl.py --envs-per-observer 16": ["solved", "episodes"],
              "rpc_rl.py --tutorial --max-episodes 100": ["solved", "running_reward"],
              "rpc_rnn.py --epochs 1 --max-batches 200 --emsize 64 --nhid 64": ["test_ppl"],
              "rpc_rnn.py --check-gradients --dropout 0 --clip 0.05 --emsize 32 --nhid 32": ["max_param_diff"],
              "async_hpo.py --max-trials 6 --max-epochs 2 --limit-train 5000 --activation relu": [
                  "trials_completed", "best_validation_error"]}


def data_cache(folder):
    """A download cache ($XDG_CACHE_HOME) in folder that holds DATA_DIR's data as links, so that the commands run as
    written without downloading; without DATA_DIR, the scripts' own cache (they download what it lacks)."""
    if not os.environ.get("DATA_DIR"):
        return {}
    for name in ("fashion-mnist", "wikitext-2"):
        target = Path(folder, "torch-distributed-patterns", name)
        target.mkdir(parents=True)
        for path in Path(os.environ["DATA_DIR"], name).iterdir():
            (target / path.name).symlink_to(path)
    return {"XDG_CACHE_HOME": str(folder)}


def last_line(command, env=None, timeout=1800):
    """(exit status, the last line of stdout or else of stderr, the JSON line as a dict or None) of a command run from
    the repository."""
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()] or [proc.stderr.strip()]
    return proc.returncode, lines[-1][:110], json.loads(lines[-1]) if lines[-1].startswith("{") else None


def quickstart(python=sys.executable):
    """README's quick start, each command as written (async_hpo's search goes into runs/, which git ignores): its
    exit status and what its JSON line reports."""
    with tempfile.TemporaryDirectory() as folder:
        env = data_cache(folder)
        rows = []
        for command, keys in QUICKSTART.items():
            status, last, result = last_line([python, *command.split()], env)
            reports = ", ".join(f"{key} {cell(result[key])}" for key in keys) if result else f"`{last}`"
            rows.append([f"`python {command}`", status, reports])
            print(rows[-1], flush=True)
    return rows


def defaults(rounds=3):
    """How long each script's default run takes, from `rounds` interleaved runs: multi_gpu.py's seconds per epoch of
    2 epochs, times its 10; rpc_rnn.py's tokens/s over 100 batches, into its 40 epochs of WikiText-2's training text
    (validation and test left out). rpc_rl.py's default run is bench_rpc_rl.py's "default" variant."""
    sys.path.insert(0, str(REPO))
    import common
    import rpc_rnn
    fashion, wikitext = common.fashion_mnist_dir(os.environ.get("DATA_DIR")), rpc_rnn.wikitext2_dir(
        os.environ.get("DATA_DIR"))
    megabytes = {name: f"{sum(Path(folder, file).stat().st_size for file in files) / 1e6:.1f} MB ({name})" for name,
                 folder, files in (("Fashion-MNIST", fashion, common.FASHION_MNIST_FILES),
                                   ("WikiText-2", wikitext, rpc_rnn.WIKITEXT2_FILES))}
    corpus = rpc_rnn.Corpus(wikitext)
    epoch_tokens = len(corpus.train) // 20 * 20 - 20  # --batch-size 20: the targets of an epoch's windows
    measured = {"multi_gpu": [], "rpc_rnn": []}
    for _ in range(rounds):
        measured["multi_gpu"].append(run_script(["multi_gpu.py", "--epochs", 2, *data_flags()], 3600)[0]["s_per_epoch"])
        measured["rpc_rnn"].append(run_script(["rpc_rnn.py", "--epochs", 1, "--max-batches", 100, *data_flags()],
                                              3600)[0]["tokens_per_s"])
        print({name: values[-1] for name, values in measured.items()}, flush=True)
    epoch, tokens = (statistics.median(measured[name]) for name in measured)
    return [["`python multi_gpu.py`", "10 epochs, 2 CPU processes", megabytes["Fashion-MNIST"],
             f"{spread(measured['multi_gpu'])} s/epoch", f"{10 * epoch / 60:.0f} min, estimated (10 epochs)"],
            ["`python rpc_rl.py`", "until solved, 1 observer", "none", "–",
             "the default variant of [rpc_rl.md's table](docs/rpc_rl.md#results)"],
            ["`python rpc_rnn.py`", "40 epochs of WikiText-2", megabytes["WikiText-2"],
             f"{spread(measured['rpc_rnn'])} tokens/s", f"{40 * epoch_tokens / tokens / 3600:.0f} h, estimated "
                                                         f"(training only)"],
            ["`python async_hpo.py`", "random search, 2 workers", megabytes["Fashion-MNIST"], "–",
             "720 s and start-up: its budget"]]


def versions(python):
    code = "import platform, torch, numpy; print(platform.python_version(), torch.__version__, numpy.__version__)"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.split()


def fresh_venv(spec, folder):
    """A venv in folder for spec, "VERSION [PACKAGE==X ...]": `pythonVERSION -m venv`, then requirements.txt with the
    pins given in place of the file's. Returns its interpreter."""
    version, *pins = spec.split()
    subprocess.run([f"python{version}", "-m", "venv", folder], check=True)
    replaced = {pin.split("==")[0].lower() for pin in pins}
    lines = [line for line in (REPO / "requirements.txt").read_text().splitlines()
             if re.split(r"[=<> ;]", line.strip())[0].lower() not in replaced]
    Path(folder, "requirements.txt").write_text("\n".join([*lines, *pins]) + "\n")
    python = str(Path(folder, "bin", "python"))
    subprocess.run([python, "-m", "pip", "install", "--quiet", "-r", Path(folder, "requirements.txt")], check=True)
    return python


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quickstart", action="store_true", help="run README's quick start")
    parser.add_argument("--defaults", action="store_true", help="time each script's default run (3 rounds)")
    parser.add_argument("--python", action="append",
                        help='"VERSION [PACKAGE==X ...]": a fresh venv running the quick start and the bad-input tests')
    args = parser.parse_args()
    if args.quickstart or args.defaults or args.python:
        check_committed()
    if args.quickstart:
        write_result("quickstart", {"The quick start on two CPU cores": {
            "columns": ["command", "exit status", "its JSON line reports"], "rows": quickstart()}})
    if args.defaults:
        write_result("defaults", {"Default runs on two CPU cores": {
            "columns": ["command", "what it runs", "first download", "measured: median (smallest–largest) of 3",
                        "the default run"],
            "rows": defaults()}})
    if args.python:
        rows = []
        for spec in args.python:
            with tempfile.TemporaryDirectory() as folder:
                python = fresh_venv(spec, Path(folder, "venv"))
                python_version, torch_version, numpy_version = versions(python)
                status, last, _ = last_line([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                                             "bad_input or help_lists or bad_data or corrupt"])
                runs = quickstart(python)
            last = re.sub(r" in [\d.]+s( \(.*\))?$", "", last)  # pytest's time: a figure of its own
            rows.append([python_version, torch_version, numpy_version,
                         f"{sum(run[1] == 0 for run in runs)} of {len(runs)}",
                         f"`{last}`" if status == 0 else f"exit status {status}: `{last}`"])
        write_result("python_versions", {"Other interpreters and torch releases": {
            "columns": ["Python", "torch", "numpy", "quick-start commands that exit 0", "bad-input tests"],
            "rows": rows}}, "Each a fresh venv of requirements.txt (with the pins named in the command). The quick "
                            "start: README's commands; the bad-input tests: `python -m pytest -k \"bad_input or "
                            "help_lists or bad_data or corrupt\"`")
    if not (args.quickstart or args.defaults or args.python):
        for page in PAGES:
            if page.read_text() != (text := rendered(page)):
                page.write_text(text)
                print(f"rendered {page.relative_to(REPO)}")


if __name__ == "__main__":
    main()
