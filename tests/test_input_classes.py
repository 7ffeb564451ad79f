"""The input classes of issue 25's "Inputs nobody listed" that rules in common.py handle, one table per class, each case
run against the scripts as a user would meet it: output that breaks (`| head -1`, `> /dev/full`, a closed or read-only
stdout), sizes this machine cannot hold, the open-file limit, a small or full /dev/shm, environment variables that
torch's backends read set wrong, Ctrl-C, and paths the run cannot write (a read-only mount found before anything starts,
a disk that fills up mid-run), and values that would break the one line (a line break or a terminal's escape code in a
value). A table's rows give the script, its flags, the environment or setup, the exit status and what stderr says; every
row includes the issue's examples and at least one case nobody listed. Each run asserts the exact exit status, stderr
(empty, or one line without a traceback) and that nothing it started is left running: every process that carries the
run's marker in its environment has ended."""

import contextlib
import fcntl
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

import psutil
import pytest
import torch

import common
import multi_gpu
import rpc_rl
import rpc_rnn
from conftest import REPO, assert_all_ended, data_folder, kill_all, last_json, tree

# --- Running a case: the processes it starts, seen while it runs, and what is left of them afterwards ---

MARK = "INPUT_CLASSES_RUN"  # an environment variable set on every run, inherited by everything it starts
GRACE = 5  # s: the processes of a run end with it (mp.spawn joins them; they die with their parent); this long after
# the run ended, on a loaded machine, one still there was left behind


@dataclass
class Run:
    """A running or finished script: its stdout lines as they come, stderr, and every process seen under it."""
    proc: subprocess.Popen
    token: str
    lines: list = field(default_factory=list)
    stderr: str = ""
    seen: dict = field(default_factory=dict)  # pid -> psutil.Process
    commands: dict = field(default_factory=dict)  # pid -> its command line, as last seen
    threads: list = field(default_factory=list)  # reading its output, watching its processes

    @property
    def stdout(self):
        return "".join(self.lines)

    def workers(self):
        """The processes mp.spawn started (multiprocessing's spawn_main), seen so far."""
        return [self.seen[pid] for pid, command in list(self.commands.items()) if "spawn_main" in " ".join(command)]

    def wait_for(self, condition, timeout, what):
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None and not condition():
                raise AssertionError(f"the run ended (status {self.proc.returncode}) before {what}:\n"
                                     f"{self.stdout[-2000:]}\n{self.stderr[-3000:]}")
            assert time.monotonic() < deadline, f"no {what} within {timeout} s"
            time.sleep(0.05)


def python(script, *args):
    return [sys.executable, str(REPO / script), *map(str, args)]


def in_namespace(shell, command, after=None):
    """command as root of a user and mount namespace of its own, after the shell commands `shell` (mounts that
    nobody outside sees); with `after`, the shell commands run once command ended, and the status is command's."""
    if after:
        script = f'{shell} || exit 99; "$@"; status=$?; {after}; exit $status'
    else:
        script = f'{shell} || exit 99; exec "$@"'
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", *map(str, command)]


def start(command, env=None, stdout=subprocess.PIPE, preexec_fn=None, new_session=False):
    """Start command from the repo root, marked; threads read its output and note every process under it."""
    token = uuid.uuid4().hex
    proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, **(env or {}), MARK: token}, stdin=subprocess.DEVNULL,
                            stdout=stdout, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn,
                            start_new_session=new_session)
    run = Run(proc, token)

    def read_stdout():
        for line in proc.stdout:
            run.lines.append(line)

    def read_stderr():
        run.stderr = proc.stderr.read()

    def watch():
        while proc.poll() is None:
            try:
                children = psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                children = []
            for child in children:
                run.seen.setdefault(child.pid, child)
                with contextlib.suppress(psutil.Error):  # a process that has just ended (a zombie's is empty)
                    run.commands[child.pid] = child.cmdline() or run.commands.get(child.pid, [])
            time.sleep(0.05)

    run.threads = [threading.Thread(target=target, daemon=True) for target in
                   ([read_stdout] if proc.stdout else []) + [read_stderr, watch]]
    for thread in run.threads:
        thread.start()
    return run


def finish(run, timeout):
    """Wait for the run to end (killed, with all it started, after timeout seconds) and for its output."""
    try:
        run.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(run)
        raise
    finally:
        for thread in run.threads:
            thread.join(30)
    return run


def stop(run):
    """SIGKILL the run and everything it started: a failing test leaves nothing running."""
    kill_all(run.proc, pids=[process.pid for process in marked(run.token)])


def marked(token):
    """The live processes of this machine whose environment carries the run's marker."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(MARK) == token and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.Error:
            pass
    return found


def assert_nothing_left(run):
    """Every process seen under the run, and every process anywhere that carries its marker, has ended."""
    assert_all_ended(list(run.seen.values()), timeout=GRACE)
    deadline = time.monotonic() + GRACE
    while (left := marked(run.token)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"left running: {[(p.pid, p.cmdline()) for p in left]}"


def assert_says(run_or_text, status, script, *fragments, returncode=None):
    """Exit status `status`; stderr empty when no fragment is given, else exactly one line, from `script`, holding
    every fragment, with no traceback."""
    stderr = run_or_text if isinstance(run_or_text, str) else run_or_text.stderr
    returncode = run_or_text.proc.returncode if returncode is None else returncode
    assert returncode == status, (returncode, stderr[-3000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    if not fragments:
        assert stderr == "", stderr[-3000:]
        return
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{script}: "), stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def main_in_process(module, argv, env, monkeypatch, capsys):
    """(exit status, stdout, stderr) of `module.py argv` run by main() in this process, as its launcher runs it, with
    the environment variables `env` set and no process allowed to start (mp.spawn fails the test)."""
    for name in (*common.TORCHRUN_VARIABLES, "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
                 "TORCH_CPP_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)  # and restored afterwards, whatever main sets
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *argv])
    monkeypatch.setattr(torch.multiprocessing, "spawn", lambda *_, **__: pytest.fail("a process was started"))
    children = psutil.Process().children(recursive=True)
    with pytest.raises(SystemExit) as exited:
        common.run_main(lambda: module.main(argv))
    captured = capsys.readouterr()
    assert psutil.Process().children(recursive=True) == children
    return exited.value.code, captured.out, captured.err


@dataclass
class Case:
    """A row of a table: the script, its flags ({placeholders} for paths), how the case is set up (each class has
    its own kind of value), the exit status, fragments of the one line on stderr (none: stderr is empty), and
    environment variables."""
    script: str
    argv: list
    setup: object
    status: int
    says: tuple = ()
    env: dict = field(default_factory=dict)


# Cases that fail at this commit (common.py breaks the promise; see each reason): expected to fail until it is fixed.
# Delete an entry when the code keeps its promise (strict ones then fail as unexpectedly passing).
KNOWN_FAILURES = {}  # case name: pytest.mark.xfail(...), for a promise that does not hold yet


def cases(table):
    """The names of a table's cases for parametrize, with the marks of KNOWN_FAILURES."""
    return [pytest.param(name, marks=KNOWN_FAILURES.get(name, ())) for name in table]


# --- Data: Fashion-MNIST for multi_gpu and async_hpo, a small text of non-ASCII words for rpc_rnn ---

# A second or two an epoch, on 2 cores
MULTI_GPU = ["--gpus", 0, "--procs", 2, "--batch-size", 64, "--limit-train", 512, "--limit-test", 1000]
RNN = ["--emsize", 16, "--nhid", 16, "--batch-size", 4, "--bptt", 8]
NON_ASCII = ("café naïve Zürich 東京 Ελλάδα straße piñata façade "
             "smörgåsbord jalapeño crème brûlée Москва 日本語").split()


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """What the tables' flags name: {fashion} (Fashion-MNIST) and {text} (train/valid/test.txt of non-ASCII words
    only, 7,800 training words: 243 windows of RNN's batch)."""
    text = tmp_path_factory.mktemp("non-ascii-text")
    for name, lines in (("train", 600), ("valid", 20), ("test", 20)):
        words = [NON_ASCII[(7 * i + i // len(NON_ASCII)) % len(NON_ASCII)] for i in range(12 * lines)]
        (text / f"{name}.txt").write_text("".join(" ".join(words[i:i + 12]) + "\n" for i in range(0, len(words), 12)),
                                          encoding="utf-8")
    return {"fashion": data_folder("fashion-mnist"), "text": text}


def filled(argv, paths, tmp):
    """argv with its {placeholders} filled: the paths, {tmp} and, looked up only where a case names it (few do),
    {wikitext}."""
    found = {**paths, "tmp": tmp}
    if any("{wikitext}" in str(arg) for arg in argv):
        found["wikitext"] = data_folder("wikitext-2")
    return [str(arg).format(**found) for arg in argv]


@pytest.fixture(scope="module")
def trained(paths, tmp_path_factory):
    """One rpc_rnn training run on the non-ASCII text, with --save: in a mount namespace whose /dev/shm holds 16 MB
    (class 4's rpc_rnn row asserts on this run), and the model the --generate rows sample from."""
    folder = tmp_path_factory.mktemp("trained")
    command = python("rpc_rnn.py", *filled(SHM_RNN, paths, folder))
    run = finish(start(in_namespace(f"mount -t tmpfs -o size={16 * 2**20} tmpfs /dev/shm", command)), 180)
    assert run.proc.returncode == 0, run.stderr[-3000:]
    return {"run": run, "model": folder / "lm.pt"}


# --- 1. Output that breaks ---

CANNOT_WRITE = "cannot write the output ("
OUTPUT = {
    "multi_gpu | head -1": Case("multi_gpu.py", [*MULTI_GPU, "--epochs", 3, "--data-dir", "{fashion}"], "head", 141),
    "rpc_rl | head -1": Case("rpc_rl.py", ["--max-episodes", 200, "--log-interval", 1], "head", 141),
    "rpc_rnn training | head -1": Case("rpc_rnn.py", ["--data-dir", "{text}", *RNN, "--epochs", 1, "--max-batches", 150,
                                                      "--log-interval", 1], "head", 141),
    "rpc_rnn --generate | head -1": Case("rpc_rnn.py", ["--generate", 5000, "--load", "{model}"], "head", 141),
    "async_hpo | head -1": Case("async_hpo.py", ["--data-dir", "{fashion}", "--limit-train", 2000, "--activation",
                                                 "relu", "--max-epochs", 1, "--max-trials", 3, "--results-dir",
                                                 "{tmp}/results"], "head", 141),
    "rpc_rl > /dev/full": Case("rpc_rl.py", ["--max-episodes", 2, "--log-interval", 1], "full", 1,
                               ("rpc_rl.py: error: cannot write the output (No space left on device); send it "
                                "elsewhere",)),
    "rpc_rnn --generate > /dev/full": Case("rpc_rnn.py", ["--generate", 30, "--load", "{model}"], "full", 1,
                                           ("rpc_rnn.py: error: cannot write the output (No space left on device); "
                                            "send it elsewhere",)),
    # nobody listed: stdout closed (`>&-`), and opened for reading only (`1</dev/null`): no place to write either
    "rpc_rnn --generate >&- (new)": Case("rpc_rnn.py", ["--generate", 30, "--load", "{model}"], "closed", 2,
                                         ("the output is closed; give the run somewhere to write it",)),
    "rpc_rl 1</dev/null (new)": Case("rpc_rl.py", ["--max-episodes", 2, "--log-interval", 1], "read-only", 1,
                                     (CANNOT_WRITE, "send it elsewhere")),
}
FIRST_LINE = {"multi_gpu.py": "epoch 1 |", "rpc_rl.py": "episode 1 |", "rpc_rnn.py": "epoch 1 | batch 1/150 |",
              "async_hpo.py": "trial 0 started |"}


@pytest.mark.parametrize("name", cases(OUTPUT))
def test_output_that_breaks(name, paths, trained, tmp_path):
    """A reader that closes after one line (`| head -1`, through a pipe of one page, so that the run's later lines
    cannot all fit in it while head exits): status 141, nothing on stderr, as after a SIGPIPE. A device that takes
    nothing (`> /dev/full`), or a stdout the run cannot write: exit 1 and one line. Nothing left running."""
    case = OUTPUT[name]
    command = python(case.script, *filled(case.argv, {**paths, "model": trained["model"]}, tmp_path))
    head = preexec = None
    if case.setup == "head":
        read_end, write_end = os.pipe()
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
        head = subprocess.Popen(["head", "-1"], stdin=read_end, stdout=subprocess.PIPE, text=True)
        os.close(read_end)
        output = write_end
    elif case.setup == "full":
        output = open("/dev/full", "w")
    elif case.setup == "read-only":
        output = open(os.devnull)
    else:
        output, preexec = None, lambda: os.close(1)
    try:
        run = finish(start(command, stdout=output, preexec_fn=preexec), 300)
    finally:
        if case.setup == "head":
            os.close(output)
        elif output is not None:
            output.close()
    if head:
        first = head.communicate(timeout=30)[0]
        expected = FIRST_LINE[case.script] if "--generate" not in case.argv else None
        assert first.count("\n") == 1 and (first.startswith(expected) if expected else len(first.split()) == 20), first
    assert_says(run, case.status, case.script, *case.says)
    if case.script == "async_hpo.py":  # the trials it had started, with the tuner's 0.1 s between two
        assert any("--st_config_json_filename" in command for command in run.commands.values()), run.commands
    elif "--generate" not in case.argv:
        assert len(run.workers()) == 2
    assert_nothing_left(run)


# --- 2. Sizes this machine cannot hold ---

SIZES_RNN = "pass a smaller --emsize, --nhid, --bptt or --batch-size"
SIZES = {
    "rpc_rnn --emsize in the millions": Case("rpc_rnn.py", ["--data-dir", "{wikitext}", "--emsize", 5_000_000],
                                             "in-process", 2, ("the model and a window's logits need about",
                                                               SIZES_RNN)),
    "rpc_rnn --nhid in the millions": Case("rpc_rnn.py", ["--data-dir", "{text}", *RNN, "--nhid", 2_000_000],
                                           "in-process", 2, ("the model and a window's logits need about", SIZES_RNN)),
    "rpc_rnn --bptt longer than WikiText-2": Case("rpc_rnn.py", ["--data-dir", "{wikitext}", "--bptt", 10**7],
                                                  "in-process", 2, ("need about", SIZES_RNN)),
    "rpc_rl --envs-per-observer in the millions": Case(
        "rpc_rl.py", ["--envs-per-observer", 5_000_000], "in-process", 2,
        ("the episodes of 5000000 environments need about", "pass a smaller --envs-per-observer or --world-size")),
    # a batch of the whole training set, where a worker's address space holds 3 GiB (a smaller machine; the
    # launcher and an idle worker take about 0.8 and 1.6 GiB here, the batch's activations 2.4 GiB more)
    "multi_gpu --batch-size 60000 in 3 GiB": Case(
        "multi_gpu.py", ["--gpus", 0, "--procs", 2, "--batch-size", 60_000, "--epochs", 1, "--data-dir", "{fashion}"],
        3 * 2**30, 1, ("multi_gpu.py: error: out of memory: ", "did not fit; pass a smaller --batch-size or "
                                                                "--batch-per-device")),
    # nobody listed: --nlayers, the other size of the model
    "rpc_rnn --nlayers in the millions (new)": Case("rpc_rnn.py", ["--data-dir", "{text}", *RNN, "--nlayers", 10**8],
                                                    "in-process", 2, ("need about", SIZES_RNN)),
}
MODULES = {"multi_gpu.py": multi_gpu, "rpc_rl.py": rpc_rl, "rpc_rnn.py": rpc_rnn}


@pytest.mark.parametrize("name", cases(SIZES))
def test_sizes_this_machine_cannot_hold(name, paths, tmp_path, monkeypatch, capsys):
    """What must fit at once is checked before any process starts (main in this process, mp.spawn failing the test):
    one line naming the flags, exit 2. An allocation that fails inside a spawned worker (a lowered address-space
    limit): one line saying how much did not fit and the flags, exit 1, nothing left running."""
    case = SIZES[name]
    argv = filled(case.argv, paths, tmp_path)
    if case.setup == "in-process":
        status, out, err = main_in_process(MODULES[case.script], argv, {}, monkeypatch, capsys)
        assert_says(err, case.status, case.script, *case.says, returncode=status)
        assert out == ""
        return
    limit = case.setup
    run = finish(start(python(case.script, *argv),
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit))), 300)
    assert_says(run, case.status, case.script, *case.says)
    assert len(run.workers()) == 2, "the allocation did not fail in the spawned workers"
    did_not_fit = float(re.search(r"out of memory: ([\d.]+) GiB", run.stderr)[1])
    assert did_not_fit >= 1, run.stderr  # the batch's activations, not what a usual step of 64 images allocates
    assert_nothing_left(run)


# --- 3. Process limits: the open-file limit ---

LIMITS = {
    "multi_gpu, hard limit 64": Case("multi_gpu.py", [*MULTI_GPU, "--epochs", 1, "--data-dir", "{fashion}"], (64, 64),
                                     2, ("the open-file limit is 64, and 2 processes need about", "ulimit -n")),
    "rpc_rl, hard limit 64": Case("rpc_rl.py", ["--max-episodes", 2], (64, 64), 2,
                                  ("the open-file limit is 64, and 2 processes need about", "ulimit -n")),
    "rpc_rnn, hard limit 64": Case("rpc_rnn.py", ["--data-dir", "{text}", *RNN, "--epochs", 1, "--max-batches", 2],
                                   (64, 64), 2, ("the open-file limit is 64, and 2 processes need about", "ulimit -n")),
    # nobody listed: a limit that two processes fit in (2 need 288) and three do not
    "rpc_rl --world-size 3, hard limit 300 (new)": Case("rpc_rl.py", ["--world-size", 3, "--max-episodes", 2],
                                                        (300, 300), 2, ("the open-file limit is 300, and 3 processes",
                                                                        "start fewer processes")),
    "rpc_rl, soft limit 64 below a hard 4096": Case("rpc_rl.py", ["--max-episodes", 2, "--log-interval", 1],
                                                    (64, 4096), 0),
}


@pytest.mark.parametrize("name", cases(LIMITS))
def test_open_file_limit(name, paths, tmp_path):
    """A hard open-file limit below what the processes' connections need: one line, exit 2, before any process
    starts. A soft limit below a hard one that suffices is raised (the workers run with more than 64) and the run
    succeeds."""
    case = LIMITS[name]
    soft, hard = case.setup
    run = start(python(case.script, *filled(case.argv, paths, tmp_path)),
                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    limits = []
    if case.status == 0:
        run.wait_for(lambda: run.workers(), 120, "spawned worker")
        limits = [worker.rlimit(resource.RLIMIT_NOFILE) for worker in run.workers()]
    finish(run, 180)
    assert_says(run, case.status, case.script, *case.says)
    if case.status == 0:
        assert last_json(run.stdout)["episodes"] == 2
        assert limits and all(64 < worker_soft <= hard == worker_hard for worker_soft, worker_hard in limits), limits
    else:
        assert run.workers() == [] and run.stdout == ""
    assert_nothing_left(run)


# --- 4. The shared memory the launch uses ---

SHM_RNN = ["--data-dir", "{text}", *RNN, "--epochs", 1, "--max-batches", 3, "--save", "{tmp}/lm.pt"]
MB = 2**20
SHM = {
    "multi_gpu, /dev/shm of 16 MB": Case("multi_gpu.py", [*MULTI_GPU, "--epochs", 1, "--data-dir", "{fashion}"],
                                         f"mount -t tmpfs -o size={16 * MB} tmpfs /dev/shm", 0),
    "rpc_rnn, /dev/shm of 16 MB": Case("rpc_rnn.py", SHM_RNN, "the trained fixture's run", 0),
    # nobody listed: a /dev/shm that something else has filled
    "rpc_rl, /dev/shm of 16 MB, full (new)": Case(
        "rpc_rl.py", ["--max-episodes", 2], f"mount -t tmpfs -o size={16 * MB} tmpfs /dev/shm && "
                                            f"dd if=/dev/zero of=/dev/shm/filler bs={MB} count=17 2>/dev/null; "
                                            f"test $(df -k --output=avail /dev/shm | tail -1) -eq 0", 0),
}
RESULT = {"multi_gpu.py": ("epochs", 1), "rpc_rnn.py": ("batches", 3), "rpc_rl.py": ("episodes", 2)}


@pytest.mark.parametrize("name", cases(SHM))
def test_small_shared_memory(name, paths, trained, tmp_path):
    """The processes read their data themselves and mp.spawn sends them only paths, so a container's small /dev/shm
    (Docker's --shm-size; a tmpfs in a mount namespace here) is enough: the run succeeds, quietly."""
    case = SHM[name]
    if case.script == "rpc_rnn.py":
        run = trained["run"]
        assert common.load_checkpoint(trained["model"], "rpc_rnn", "--load", keys=("model", "vocab", "config"))
    else:
        command = python(case.script, *filled(case.argv, paths, tmp_path))
        run = finish(start(in_namespace(case.setup, command)), 180)
    assert_says(run, case.status, case.script)
    key, value = RESULT[case.script]
    assert last_json(run.stdout)[key] == value, run.stdout[-2000:]
    assert len(run.workers()) == 2
    assert_nothing_left(run)


# --- 5. Environment variables that torch's backends read, set wrong ---

NO_INTERFACE = "this machine has no network interface nope0"
ENVIRONMENT = {
    "multi_gpu, GLOO_SOCKET_IFNAME=nope0": Case("multi_gpu.py", [*MULTI_GPU, "--data-dir", "{fashion}"], "in-process",
                                                2, ("GLOO_SOCKET_IFNAME=nope0: " + NO_INTERFACE, "unset it"),
                                                {"GLOO_SOCKET_IFNAME": "nope0"}),
    "rpc_rl, TP_SOCKET_IFNAME=nope0": Case("rpc_rl.py", ["--max-episodes", 2], "in-process", 2,
                                           ("TP_SOCKET_IFNAME=nope0: " + NO_INTERFACE, "unset it"),
                                           {"TP_SOCKET_IFNAME": "nope0"}),
    "rpc_rnn, TP_SOCKET_IFNAME=nope0": Case("rpc_rnn.py", ["--data-dir", "{text}", *RNN], "in-process", 2,
                                            ("TP_SOCKET_IFNAME=nope0: " + NO_INTERFACE,),
                                            {"TP_SOCKET_IFNAME": "nope0"}),
    "rpc_rnn --generate of non-ASCII words, PYTHONIOENCODING=ascii": Case(
        "rpc_rnn.py", ["--generate", 40, "--load", "{model}"], "subprocess", 0, (), {"PYTHONIOENCODING": "ascii"}),
    # nobody listed: a list of interfaces with one wrong name; MASTER_ADDR and MASTER_PORT set alone (an unreachable
    # address, a port nothing listens on), which a spawned run, meeting through files, does not use
    "rpc_rl, GLOO_SOCKET_IFNAME=lo,nope0 (new)": Case("rpc_rl.py", ["--max-episodes", 2], "in-process", 2,
                                                      ("GLOO_SOCKET_IFNAME=lo,nope0: " + NO_INTERFACE + " (it has",),
                                                      {"GLOO_SOCKET_IFNAME": "lo,nope0"}),
    "rpc_rl, MASTER_ADDR and MASTER_PORT alone (new)": Case("rpc_rl.py", ["--max-episodes", 2], "subprocess", 0, (),
                                                            {"MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "9"}),
}


@pytest.mark.parametrize("name", cases(ENVIRONMENT))
def test_backend_environment_variables(name, paths, trained, tmp_path, monkeypatch, capsys):
    """GLOO_SOCKET_IFNAME or TP_SOCKET_IFNAME naming an interface this machine lacks: one line, exit 2, before any
    process starts. Words the output's encoding lacks are escaped (`\\xe9`), not a UnicodeEncodeError. Variables a
    spawned run does not read change nothing."""
    case = ENVIRONMENT[name]
    argv = filled(case.argv, {**paths, "model": trained["model"]}, tmp_path)
    if case.setup == "in-process":
        status, out, err = main_in_process(MODULES[case.script], argv, case.env, monkeypatch, capsys)
        assert_says(err, case.status, case.script, *case.says, returncode=status)
        assert out == ""
        return
    run = finish(start(python(case.script, *argv), env=case.env), 180)
    assert_says(run, case.status, case.script)
    assert_nothing_left(run)
    if "--generate" not in argv:
        assert last_json(run.stdout)["episodes"] == 2 and len(run.workers()) == 2
        return
    text = [line for line in run.stdout.splitlines() if not line.startswith("{")]
    assert all(line.isascii() for line in text) and "\\x" in "".join(text) and "\\u" in "".join(text), text
    words = " ".join(line.encode().decode("unicode_escape") for line in text).split()
    assert len(words) == 40 and set(words) <= set(NON_ASCII), words


# --- 6. Ctrl-C ---

RUNNING_RNN = ["--data-dir", "{text}", *RNN, "--epochs", 50, "--max-batches", 200, "--log-interval", 1]
INTERRUPTED = ": interrupted; every process was stopped"  # after the script's name: the whole of stderr
# setup: (who gets SIGINT: the process group or the launcher alone, the line of stdout after which; None: as soon as
# both of mp.spawn's processes show, while they start: they take seconds to import torch. Not at the first: the
# launcher, which ignores Ctrl-C until it has started them all (common.rendezvous), may be between the two)
CTRL_C = {
    "multi_gpu, running": Case("multi_gpu.py", [*MULTI_GPU, "--epochs", 20, "--data-dir", "{fashion}"],
                               ("group", "epoch 1 |"), 130, (INTERRUPTED,)),
    "rpc_rl, running": Case("rpc_rl.py", ["--max-episodes", 2000, "--log-interval", 1], ("group", "episode 1 |"), 130,
                            (INTERRUPTED,)),
    "rpc_rnn, running": Case("rpc_rnn.py", RUNNING_RNN, ("group", "epoch 1 | batch 1/"), 130, (INTERRUPTED,)),
    "rpc_rnn, while its processes start": Case("rpc_rnn.py", RUNNING_RNN, ("group", None), 130, (INTERRUPTED,)),
    # nobody listed: SIGINT to the launcher alone (`kill -INT`, `timeout -s INT`), not to its process group
    "rpc_rl, the launcher alone (new)": Case("rpc_rl.py", ["--max-episodes", 2000, "--log-interval", 1],
                                             ("launcher", "episode 1 |"), 130, (INTERRUPTED,)),
}


@pytest.mark.parametrize("name", cases(CTRL_C))
def test_ctrl_c(name, paths, tmp_path):
    """SIGINT to the run's process group, as Ctrl-C in a terminal sends it, while it trains, or while its processes
    start (as soon as mp.spawn's workers show): exactly the line `<script>: interrupted; every process was
    stopped` (no traceback, no RRef-leak warnings), exit 130, nothing left running."""
    case = CTRL_C[name]
    target, line = case.setup
    run = start(python(case.script, *filled(case.argv, paths, tmp_path)), new_session=True)
    try:
        if line:
            run.wait_for(lambda: any(text.startswith(line) for text in run.lines), 180, f"line {line!r}")
        else:
            run.wait_for(lambda: len(run.workers()) == 2, 120, "both spawned workers")
        if target == "group":
            os.killpg(run.proc.pid, signal.SIGINT)
        else:
            run.proc.send_signal(signal.SIGINT)
    except BaseException:
        stop(run)
        raise
    finish(run, 60)
    assert_says(run, case.status, case.script, *case.says)
    assert run.stderr == case.script + INTERRUPTED + "\n"
    assert len(run.workers()) == 2
    assert_nothing_left(run)


# --- 7. Paths the run cannot write ---

READ_ONLY = "mount --bind {ro} {ro} && mount -o remount,bind,ro {ro}"
PATHS = {
    "multi_gpu --checkpoint-dir on a read-only mount": Case(
        "multi_gpu.py", [*MULTI_GPU, "--data-dir", "{fashion}", "--checkpoint-dir", "{ro}/ck"], READ_ONLY, 2,
        ("--checkpoint-dir {ro}/ck: cannot write in {ro} (Read-only file system)",)),
    "rpc_rl --checkpoint-dir on a read-only mount": Case(
        "rpc_rl.py", ["--max-episodes", 2, "--checkpoint-dir", "{ro}/ck"], READ_ONLY, 2,
        ("--checkpoint-dir {ro}/ck: cannot write in {ro} (Read-only file system)",)),
    "rpc_rnn --checkpoint-dir on a read-only mount": Case(
        "rpc_rnn.py", ["--data-dir", "{text}", *RNN, "--checkpoint-dir", "{ro}"], READ_ONLY, 2,
        ("--checkpoint-dir {ro}: cannot write in {ro} (Read-only file system)",)),
    "rpc_rnn --save on a read-only mount": Case(
        "rpc_rnn.py", ["--data-dir", "{text}", *RNN, "--save", "{ro}/lm.pt"], READ_ONLY, 2,
        ("--save {ro}/lm.pt: cannot write in {ro} (Read-only file system)",)),
    # nobody listed: the other outputs, a figure and a results folder, on a read-only mount
    "multi_gpu --plot on a read-only mount (new)": Case(
        "multi_gpu.py", [*MULTI_GPU, "--data-dir", "{fashion}", "--plot", "{ro}/curve.png"], READ_ONLY, 2,
        ("--plot {ro}/curve.png: cannot write in {ro} (Read-only file system)",)),
    "async_hpo --results-dir on a read-only mount (new)": Case(
        "async_hpo.py", ["--data-dir", "{fashion}", "--max-trials", 1, "--results-dir", "{ro}/results"], READ_ONLY, 2,
        ("--results-dir {ro}/results: cannot write in {ro} (Read-only file system)",)),
}


@pytest.mark.parametrize("name", cases(PATHS))
def test_paths_the_run_cannot_write(name, paths, tmp_path):
    """An output path on a read-only file system (a read-only bind mount in a user and mount namespace, where the
    run is root: permission bits and os.access cannot tell) is refused before anything starts: one line, exit 2,
    nothing written, no process started."""
    case = PATHS[name]
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    (read_only / "kept.txt").write_text("there before")
    before = tree(read_only)
    argv = filled(case.argv, {**paths, "ro": read_only}, tmp_path)
    run = finish(start(in_namespace(case.setup.format(ro=read_only), python(case.script, *argv))), 120)
    assert_says(run, case.status, case.script, *(says.format(ro=read_only) for says in case.says))
    assert run.workers() == [] and run.stdout == ""
    assert tree(read_only) == before
    assert_nothing_left(run)


def test_a_disk_that_fills_up_keeps_the_previous_checkpoint(paths, tmp_path):
    """--checkpoint-dir on a tmpfs with room for one checkpoint (about 0.5 MB) but not for a second beside it, which
    the atomic write needs: epoch 2's checkpoint cannot be written. One line naming --checkpoint-dir, exit 1, nothing
    left running, and the folder holds epoch 1's checkpoint alone: the very bytes that were there after epoch 1
    (read then through the run's mount namespace), loadable."""
    folder, kept = tmp_path / "small-disk", tmp_path / "kept"
    folder.mkdir()
    kept.mkdir()
    command = python("multi_gpu.py", *filled([*MULTI_GPU, "--epochs", 3, "--data-dir", "{fashion}"], paths, tmp_path),
                     "--checkpoint-dir", folder)
    run = start(in_namespace(f"mount -t tmpfs -o size=800k tmpfs {folder}", command,
                             after=f"cp {folder}/multi_gpu.pt {kept}/; ls -A {folder} > {kept}/listing"))
    inside = f"/proc/{run.proc.pid}/root{folder}/multi_gpu.pt"  # the folder as the run's namespace sees it
    try:
        run.wait_for(lambda: os.path.exists(inside), 180, "checkpoint of epoch 1")
        after_epoch_1 = open(inside, "rb").read()  # written by renaming a whole file: never a partial one
    except BaseException:
        stop(run)
        raise
    finish(run, 180)
    assert_says(run, 1, "multi_gpu.py", f"cannot write {folder}/multi_gpu.pt (No space left on device)",
                "pass another --checkpoint-dir", "the previous file, if any, is intact")
    assert_nothing_left(run)
    assert run.stdout.count("epoch 2 |") == 1 and "epoch 3 |" not in run.stdout  # epoch 2 ran; its checkpoint failed
    assert (kept / "listing").read_text().split() == ["multi_gpu.pt"]  # no temporary file left
    assert (kept / "multi_gpu.pt").read_bytes() == after_epoch_1
    saved = common.load_checkpoint(kept / "multi_gpu.pt", "multi_gpu", "--resume", keys=("params", "history"))
    assert saved["epoch"] == 1 and len(saved["history"]) == 1
    assert not torch.equal(saved["params"], multi_gpu.init_params(0))


# --- 8. Values that would break the line: a line break or a terminal's escape code in a value ---

ESCAPES = {
    # nobody listed: a path holding a newline (a shell's $'...', a pasted value), as the flag's rule reports it
    "rpc_rl --save holding a newline (new)": Case(
        "rpc_rl.py", ["--save", "{tmp}/no\nsuch/policy.pt"], "in-process", 2,
        ("--save {tmp}/no\\nsuch/policy.pt: folder {tmp}/no\\nsuch does not",)),
    # nobody listed: a terminal's escape code (red text) in a number
    "multi_gpu --seed holding an escape code (new)": Case("multi_gpu.py", ["--seed", "1\x1b[31m"], "in-process", 2,
                                                         ("--seed 1\\x1b[31m: not a seed",)),
    # nobody listed: a Unicode line separator in an argument that argparse itself refuses
    "rpc_rnn, an unknown argument holding a line separator (new)": Case(
        "rpc_rnn.py", ["--data-dir", "{text}", "--emsize\u20288"], "in-process", 2,
        ("unrecognized arguments: --emsize\\u20288",)),
}


@pytest.mark.parametrize("name", cases(ESCAPES))
def test_values_that_would_break_the_line(name, paths, tmp_path, monkeypatch, capsys):
    """A value holding a line break or a terminal's escape code shows in the error as Python writes it in a string:
    the error stays one line, and shows what was typed (main in this process, mp.spawn failing the test)."""
    case = ESCAPES[name]
    argv = filled(case.argv, paths, tmp_path)
    status, out, err = main_in_process(MODULES[case.script], argv, {}, monkeypatch, capsys)
    assert_says(err, case.status, case.script, *(says.format(tmp=tmp_path) for says in case.says), returncode=status)
    assert out == "" and "\x1b" not in err and list(tmp_path.iterdir()) == []
