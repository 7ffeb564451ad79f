"""Shared test plumbing: run a script as a subprocess with a timeout, read its final JSON line."""

import functools
import inspect
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


# Downloads through a proxy that is not there fail at once: "no network", on machines that have one too.
OFFLINE = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "no_proxy": "", "NO_PROXY": ""}
# Requests to a mirror on this machine must not go through a proxy that the environment names.
LOOPBACK_DIRECT = {"no_proxy": "127.0.0.1,localhost", "NO_PROXY": "127.0.0.1,localhost"}


def gpu_count():
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_problem(count):
    """Why this machine cannot run a test that needs `count` CUDA GPUs, or None: a torch built without CUDA is a
    different reason from too few GPUs (a GPU machine with a CPU build would otherwise skip them all as "0 found")."""
    import torch
    if torch.version.cuda is None and torch.version.hip is None:
        return f"torch {torch.__version__} has no CUDA (a CPU build)"
    if gpu_count() < count:
        return f"needs {count} CUDA GPU(s), {gpu_count()} found"
    return None


def needs_gpus(count):
    """Decorator for a test that needs `count` CUDA GPUs: marked `gpu` (`python -m pytest -m gpu` runs these
    alone), and skipped, with the reason (gpu_problem), on a machine with fewer."""
    def mark(test):
        problem = gpu_problem(count)
        return pytest.mark.gpu(pytest.mark.skipif(problem is not None, reason=str(problem))(test))
    return mark


def pytest_sessionstart(session):
    """The session's first line says what the gpu tests will see, -q or not: the torch build and its GPUs."""
    import torch
    names = [torch.cuda.get_device_name(index) for index in range(gpu_count())]
    session.config.pluginmanager.get_plugin("terminalreporter").write_line(
        f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}: {len(names)} GPU(s) {names}")


def first_visible_gpu():
    """CUDA_VISIBLE_DEVICES naming only the first GPU this process sees (an index, a UUID or a MIG name)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]


def flags(*recipes, **overrides):
    """Command-line flags from dicts of {flag_name: value} and keyword overrides: flags({"lr": 0.1}, epochs=2)
    -> ["--lr", "0.1", "--epochs", "2"]. None drops the flag; True gives --flag and False --no-flag."""
    merged = {}
    for recipe in (*recipes, overrides):
        merged.update(recipe)
    result = []
    for name, value in merged.items():
        if value is None:
            continue
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            result.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            result += [f"--{flag}", str(value)]
    return result


def data_root():
    """DATA_DIR (a folder holding fashion-mnist/ and wikitext-2/) if set; None lets the scripts download."""
    return Path(os.environ["DATA_DIR"]) if os.environ.get("DATA_DIR") else None


@functools.cache
def _find_data(name):
    import common
    import rpc_rnn
    find = {"fashion-mnist": common.fashion_mnist_dir, "wikitext-2": rpc_rnn.wikitext2_dir}[name]
    try:
        return find(data_root()), None
    except common.UsageError as error:
        return None, str(error)


def data_folder(name="fashion-mnist"):
    """The folder holding data set `name` (fashion-mnist or wikitext-2): under data_root(), or in the scripts'
    download cache, downloaded there on first use. Where neither has it and the download fails, every test that
    asks for it fails at once with the scripts' own one-line message (the download is tried once per session)."""
    folder, problem = _find_data(name)
    if problem:
        pytest.fail(f"no {name} data: {problem}", pytrace=False)
    return folder


@pytest.fixture(autouse=True, scope="session")
def temporary_files_under_pytest(tmp_path_factory):
    """TMPDIR for every process the tests start: pytest's temporary tree, which pytest prunes, instead of /tmp. What a
    killed or failed run cannot remove stays there: a rendezvous folder, mp.spawn's file of a process's traceback,
    torchrun's folders. A test may set TMPDIR again, to see what a run leaves."""
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))


@pytest.fixture
def data_dir_args():
    """['--data-dir', the folder holding Fashion-MNIST] for the scripts (see data_folder)."""
    return ["--data-dir", str(data_folder("fashion-mnist"))]


def assert_help_lists_every_flag(module, capsys):
    """`script.py --help` of a script module: exit status 0, the script's description, and every field of its Args as
    its flag (--field-name; a bool also --no-field-name) with the first words of the field's docstring and, where its
    default is not None, `(default: <value>)`, read with argparse's line breaks undone. Holds for flags added later.
    Returns the help text."""
    import ast
    import dataclasses
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert module.__doc__.splitlines()[0] in text
    body = ast.parse(inspect.getsource(module.Args)).body[0].body
    docs = {node.target.id: " ".join(doc.value.value.split()) for node, doc in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(doc, ast.Expr)}
    entries = {entry.split()[0].rstrip(","): " ".join(entry.split())
               for entry in re.findall(r"^  (--[a-z0-9-]+.*(?:\n {3,}\S.*)*)", text, flags=re.M)}
    for field in dataclasses.fields(module.Args):
        flag = "--" + field.name.replace("_", "-")
        assert flag in entries, f"{flag} (Args.{field.name}) is not in --help"
        assert " ".join(docs[field.name].split()[:4]) in entries[flag], entries[flag]
        if isinstance(field.default, bool):
            assert entries[flag].startswith(f"{flag}, --no-{flag[2:]} "), entries[flag]
        shown = re.findall(r"\(default: ([^)]*)\)", entries[flag])
        assert shown == ([] if field.default is None else [str(field.default)]), (flag, entries[flag])
    return text


def as_a_shells_job():
    """preexec_fn of a process that a test sends Ctrl-C (SIGINT to its process group): a group of its own, and SIGINT's
    default action, which Python turns into KeyboardInterrupt (a pytest started in the background, `pytest &`,
    hands its children SIGINT ignored, and Python then leaves it ignored)."""
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_script(script, *args, timeout=120, env=None):
    """Run `python script args...` from the repo root; returns the CompletedProcess (text, captured)."""
    return subprocess.run([sys.executable, str(REPO / script), *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def start_script(script, *args):
    """Start `python script args...` from the repo root without waiting; stdout and stderr are text pipes."""
    return subprocess.Popen([sys.executable, str(REPO / script), *map(str, args)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_line(proc, text, timeout=120):
    """Read proc's stdout up to the first line containing text and return it. A run that hangs silently is
    killed after timeout seconds (a bare readline would wait forever); one that ends first fails the test."""
    found = []

    def read():
        for line in proc.stdout:
            if text in line:
                found.append(line)
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        proc.kill()  # closes the pipe, which ends the reader
        reader.join(10)
        raise AssertionError(f"no line containing {text!r} within {timeout} s")
    assert found, f"the run ended without a line containing {text!r}:\n{proc.stderr.read()[-2000:]}"
    return found[0]


def spawned_workers(proc):
    """The worker processes mp.spawn started under proc, oldest first: in rank order."""
    def is_worker(child):  # spawn's workers run multiprocessing's spawn_main (its resource tracker is another child)
        try:
            return "spawn_main" in " ".join(child.cmdline())
        except psutil.Error:  # it ended between the listing and the look: a zombie or gone
            return False
    children = psutil.Process(proc.pid).children(recursive=True)
    return sorted(filter(is_worker, children), key=lambda child: (child.create_time(), child.pid))


def assert_all_ended(processes, timeout=10):
    """Every process in the list is gone (or a zombie) within timeout seconds: nothing is left behind."""
    def running(process):
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    alive = [process for process in processes if running(process)]
    deadline = time.monotonic() + timeout
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [process for process in alive if running(process)]
    assert not alive, f"left behind: {alive}"


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


# --- torchrun, ports, leftovers ---

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # `torchrun`, from this interpreter


def torchrun_command(*args):
    """`torchrun ARGS` as a command line (numbers and paths as strings)."""
    return [*TORCHRUN, *map(str, args)]


def free_port():
    """A TCP port on loopback that nothing listens on now (for torchrun's --master-port), drawn below the kernel's
    ephemeral range. A port the kernel handed out (bind to port 0) is free again once the probe closes, and until the
    run binds it, the kernel may hand it to any process that binds port 0 or connects: another test's TensorPipe,
    gloo or TCPStore, which then gets this run's traffic (a TensorPipe agent aborts on it, and the TCPStore client
    here fails or hangs). The kernel never hands out a port below the range."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the IANA range starts at 49152
        low = 49152
    for port in random.Random().sample(range(max(1024, low - 12000), low), 100):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:  # taken
                continue
            return port
    raise AssertionError(f"no free port below {low} in 100 tries")


def kill_all(*processes, pids=()):
    """SIGKILL the Popen objects, everything they started and the processes in `pids` (torchrun's workers outlive
    an agent that is killed outright), so that a failing test leaves nothing running."""
    doomed = [psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)]
    for proc in processes:
        if proc.poll() is None:
            try:
                doomed += psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        proc.kill()
    for process in doomed:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    for proc in processes:
        proc.wait(timeout=10)


def tree(folder):
    """Every path under folder with its size and modification time: what a run wrote there shows as a difference."""
    return {path: (path.lstat().st_size, path.lstat().st_mtime_ns) for path in Path(folder).rglob("*")}
