"""Plumbing shared by the four scripts: flags and the rules their values follow, launching, rendezvous, seeding,
devices, data, files and results.

Nothing here knows about a model or an algorithm; copy this file next to the script you take.
"""

import argparse
import ast
import contextlib
import dataclasses
import datetime
import functools
import gzip
import hashlib
import inspect
import io
import json
import multiprocessing.connection
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time
import traceback
import typing
import urllib.parse
import urllib.request
import warnings
import zipfile
from pathlib import Path
from typing import Annotated

import numpy as np
import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# ---------------------------------------------------------------------------------------------------------
# The command line: flags from a dataclass, and one rule for each kind of value
# ---------------------------------------------------------------------------------------------------------

class UsageError(Exception):
    """An error the user can fix (a bad flag value, missing data offline, no GPU): one line, exit status 2."""
    status = 2


class RunFailed(Exception):
    """A failure during the run that the user can act on (a full disk): one line saying what to do, exit status 1."""
    status = 1


def check(condition, message):
    """Raise UsageError(message) unless condition holds: one line per flag rule, read top to bottom."""
    if not condition:
        raise UsageError(message)


def _number(cast, low, high, what):
    """Numbers of type `cast` from low to high: so every one is finite, and every whole one fits torch's int64."""
    def parse(flag, text):
        try:
            value = cast(text)
        except ValueError:
            value = None
        check(value is not None and low <= value <= high, f"{flag} {text}: not {what}")
        return value
    return parse


def _text(flag, text):
    check(text != "", f"{flag} '': an empty value; pass one, or leave the flag out")
    return text


def _stat(flag, path):
    """os.stat(path), or None when nothing is there; any other refusal of the file system is one line."""
    try:
        return os.stat(_text(flag, path))
    except FileNotFoundError:
        return None
    except OSError as error:  # a name too long, a loop of links, a folder that cannot be searched, ...
        raise UsageError(f"{flag} {path}: {error.strerror}; pass another path") from None


def input_file(flag, path):
    """A file the run reads: there, a regular file, readable."""
    found = _stat(flag, path)
    check(found and stat.S_ISREG(found.st_mode), f"{flag} {path}: no such file" if not found else
          f"{flag} {path}: not a regular file; pass a file")
    check(os.access(path, os.R_OK), f"{flag} {path}: cannot be read; fix its permissions or pass another file")
    return path


def output_file(flag, path):
    """A file the run writes by renaming a new file over it: nothing yet or a regular file (never a device or a
    FIFO, which the rename would replace), in an existing folder the run may write in."""
    found, folder = _stat(flag, path), _stat(flag, str(Path(path).parent))
    check(not found or stat.S_ISREG(found.st_mode), f"{flag} {path}: not a regular file; pass a file name")
    check(folder and stat.S_ISDIR(folder.st_mode), f"{flag} {path}: folder {Path(path).parent} does not exist")
    check(os.access(Path(path).parent, os.W_OK | os.X_OK) and (not found or os.access(path, os.W_OK)),
          f"{flag} {path}: cannot be written; fix its permissions or pass another path")
    return path


FIGURE_FORMATS = (".png", ".pdf", ".svg")  # what save_figure writes


def figure_file(flag, path):
    check(Path(_text(flag, path)).suffix.lower() in FIGURE_FORMATS, f"{flag} {path}: name a .png, .pdf or .svg file")
    return output_file(flag, path)


def output_dir(flag, path):
    """A folder the run writes into, created with its parents if missing: the nearest folder up the path that
    exists must be one the run may write in."""
    folder = Path(os.path.abspath(_text(flag, path)))
    while not (found := _stat(flag, str(folder))):
        folder = folder.parent
    check(stat.S_ISDIR(found.st_mode), f"{flag} {path}: {folder} is not a folder; pass a folder")
    check(os.access(folder, os.W_OK | os.X_OK), f"{flag} {path}: cannot write in {folder}; pass another folder")
    return path


def data_folder(flag, path):
    """A folder the data are read from, or downloaded into (fetch_dataset) when it is not there yet."""
    found = _stat(flag, path)
    check(not found or stat.S_ISDIR(found.st_mode) and os.access(path, os.R_OK | os.X_OK),
          f"{flag} {path}: not a folder this run can read; pass the folder holding the data")
    return path if found else output_dir(flag, path)


# The kinds of flag values, Annotated with their placeholder in --help and parse(flag, text), which returns the
# value or raises UsageError as the command line is parsed: `seed: Seed = 1` gives `--seed N` and its rule.
INT64, FLOAT_MAX = 2**63 - 1, sys.float_info.max
Positive = Annotated[int, "N", _number(int, 1, INT64, "a whole number, 1 or more")]
NonNegative = Annotated[int, "N", _number(int, 0, INT64, "a whole number, 0 or more")]
Seed = Annotated[int, "N", _number(int, 0, 2**32 - 1, "a seed from 0 to 2**32 - 1 (numpy's range)")]
PositiveFloat = Annotated[float, "X", _number(float, 5e-324, FLOAT_MAX, "a positive number")]
Seconds = Annotated[float, "SECONDS", _number(float, 5e-324, FLOAT_MAX, "a positive number of seconds")]
InFile = Annotated[str, "FILE", input_file]
OutFile = Annotated[str, "FILE", output_file]
FigureFile = Annotated[str, "FILE", figure_file]
OutDir = Annotated[str, "DIR", output_dir]
DataDir = Annotated[str, "DIR", data_folder]
PLAIN = {int: Annotated[int, "N", _number(int, -INT64 - 1, INT64, "a whole number that fits in 64 bits")],
         float: Annotated[float, "X", _number(float, -FLOAT_MAX, FLOAT_MAX, "a finite number")],
         str: Annotated[str, "TEXT", _text]}


def _fields_in_source(args_cls):
    """{field: its docstring} and {first field of a group: the group's title}: the string under each field, and
    the comment lines of the class body, each of which starts a group of flags in --help."""
    source = inspect.getsource(args_cls)
    body, lines, docs, groups, start = ast.parse(source).body[0].body, source.splitlines(), {}, {}, 0
    for node, following in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign):
            comments = [line.strip(" #") for line in lines[start:node.lineno - 1] if line.strip().startswith("#")]
            groups.update({node.target.id: comments[-1]} if comments else {})
            if isinstance(following, ast.Expr) and isinstance(getattr(following.value, "value", None), str):
                docs[node.target.id] = " ".join(following.value.value.split())
            start = node.lineno
    return docs, groups


def parse_args(args_cls, argv=None):
    """Parse the command line into args_cls, a dataclass with one field per flag.

    Each field's docstring is its --help, and each comment line in the class body starts a group of flags. A
    `bool` field gives --flag/--no-flag, `Literal[...]` its choices, `Optional[T]` a flag that is off (None)
    unless given. Every value passes its kind's rule as it is parsed: numbers are finite and fit int64, text is
    not empty, and the kinds above add theirs (a Seed within numpy's range, an OutFile in an existing folder).
    """
    parser = argparse.ArgumentParser(description=sys.modules[args_cls.__module__].__doc__, formatter_class=(
        lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=HELP_WIDTH, max_help_position=30)))
    parser.error = lambda message: parser.exit(2, f"{parser.prog}: error: {message} (see --help)\n")
    (docs, groups), group = _fields_in_source(args_cls), parser
    hints = typing.get_type_hints(args_cls, include_extras=True)
    for field in dataclasses.fields(args_cls):
        hint, flag = hints[field.name], "--" + field.name.replace("_", "-")
        if typing.get_origin(hint) is typing.Union:  # Optional[T]
            hint = typing.get_args(hint)[0]
        group = parser.add_argument_group(groups[field.name]) if field.name in groups else group
        options = dict(default=field.default, help=docs.get(field.name, "").replace("%", "%%")
                       + ("" if field.default is None else " (default: %(default)s)"))
        if hint is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **options)
        elif typing.get_origin(hint) is typing.Literal:
            group.add_argument(flag, choices=typing.get_args(hint), **options)
        else:
            _, metavar, parse = typing.get_args(PLAIN.get(hint, hint))
            group.add_argument(flag, type=functools.partial(parse, flag), metavar=metavar, **options)
    return args_cls(**vars(parser.parse_args(argv)))


HELP_WIDTH = 120  # the width of the docstrings: --help wraps the flags' texts as wide as its description


def check_processes(flag, count, oversubscribe):
    """At most 4 processes per CPU of this machine unless --oversubscribe: a typo must not start thousands."""
    limit = 4 * usable_cpus()
    check(count <= limit or oversubscribe, f"{flag} {count}: more than {limit} processes, 4 per CPU of this "
                                           f"machine; pass a smaller number, or --oversubscribe to start them anyway")


def run_main(main):
    """Call main(); a UsageError or RunFailed becomes one line on stderr and its exit status, with no traceback."""
    try:
        main()
    except (UsageError, RunFailed) as error:
        print(f"{Path(sys.argv[0]).name}: error: {error}", file=sys.stderr, flush=True)
        sys.exit(error.status)


# ---------------------------------------------------------------------------------------------------------
# Launching and rendezvous
# ---------------------------------------------------------------------------------------------------------

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")


def torchrun_env():
    """torchrun's variables (numbers as ints) when a launcher set RANK, WORLD_SIZE, LOCAL_RANK or LOCAL_WORLD_SIZE,
    else None. Some of them missing, or values that do not fit together, are a UsageError here, before any work:
    torch would fail later with a long traceback, or wait for a process that never comes."""
    env = {name: os.environ.get(name, "") for name in TORCHRUN_VARIABLES}
    if not any(env[name] for name in TORCHRUN_VARIABLES[:4]):
        return None
    fix = f"start the script with torchrun, or set all of {', '.join(TORCHRUN_VARIABLES)}"
    check(all(env.values()), f"{', '.join(name for name, value in env.items() if not value)} not set; {fix}")
    numbers = [int(env[name]) if env[name].isdecimal() else -1 for name in TORCHRUN_VARIABLES[:5]]
    rank, world_size, local_rank, local_world_size, port = numbers
    check(0 <= rank < world_size < 2**31 and 0 <= local_rank < local_world_size <= world_size and 0 < port < 2**16,
          f"{' '.join(f'{name}={env[name]}' for name in TORCHRUN_VARIABLES[:5])}: want ranks below their sizes and "
          f"a port below 65536; {fix}")
    try:
        socket.getaddrinfo(env["MASTER_ADDR"], port)
    except (OSError, UnicodeError) as error:
        raise UsageError(f"MASTER_ADDR={env['MASTER_ADDR']}: {error}; give torchrun node 0's address") from None
    return {**env, **dict(zip(TORCHRUN_VARIABLES, numbers))}


def process_count(spawned):
    """The number of processes of this run: torchrun's WORLD_SIZE under torchrun, else `spawned`."""
    return (torchrun_env() or {"WORLD_SIZE": spawned})["WORLD_SIZE"]


@dataclasses.dataclass(frozen=True)
class DistInfo:
    """Where one process stands in the run; handed to every worker."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    init_method: str  # "file://..." for a single-node spawn, "env://" under torchrun

    def store_url(self, name):
        """A rendezvous address of its own for each thing that needs one (process group, RPC). Under a torchrun
        whose agent's store outlives restarts, one that keeps this round of workers apart (see round_store)."""
        if self.init_method != "env://":
            return f"{self.init_method}.{name}"
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return self.init_method
        with contextlib.suppress(RuntimeError):  # registered by an earlier call in this process
            dist.register_rendezvous_handler(ROUND_SCHEME, _round_rendezvous)
        return f"{ROUND_SCHEME}://?name={name}"


def usable_cpus():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pin_to_one_cpu(info):
    """Bind this process to one CPU of its own when this machine has one for each of its processes; returns the
    CPU, or None when there are too few to go round (then the OS scheduler places the processes).

    For RPC-bound runs: TensorPipe's shared-memory transport polls busily in a thread of every process, and
    unpinned, the pollers of all processes and their Python threads fight over the same cores.
    """
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
    if len(cpus) < info.local_world_size:
        return None
    os.sched_setaffinity(0, {cpus[info.local_rank]})
    return cpus[info.local_rank]


def die_with_parent(parent_pid):
    """Call first thing in a child process: if its parent (pid parent_pid) is killed outright (SIGKILL, OOM),
    the child is killed too instead of living on as an orphan (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        raise SystemExit("the process that started this one is gone")


def is_stopped(pid):
    """Whether the process is stopped (SIGSTOP, Ctrl-Z, a debugger); False when it is gone."""
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    return False


def _spawned_worker(local_rank, worker, world_size, init_method, launcher_pid, run_dir, args):
    die_with_parent(launcher_pid)
    torch.set_num_threads(max(1, usable_cpus() // world_size))
    try:
        worker(DistInfo(local_rank, world_size, local_rank, world_size, init_method), *args)
    except (UsageError, RunFailed) as error:  # its one line, said here; the launcher then adds nothing
        print(f"{Path(sys.argv[0]).name}: error: {error}", file=sys.stderr, flush=True)
        Path(run_dir, f"reported-{local_rank}").write_text(str(error.status))
        sys.exit(error.status)
    except KeyboardInterrupt:  # Ctrl-C reaches every process; the launcher reports it once
        sys.exit(130)
    except Exception:
        if _reported(run_dir) is None:  # else a peer failed first, and what this process hit next is noise
            print(f"process {local_rank} failed:\n{traceback.format_exc()}", file=sys.stderr, end="", flush=True)
            Path(run_dir, f"reported-{local_rank}").write_text("1")
        sys.exit(1)
    leave_at_once()


def leave_at_once():
    """End a worker process that has finished its work (its results written, its groups shut down) with status 0,
    without the interpreter's teardown. That teardown destroys torch's C++ objects in no set order (a gloo group
    that DistributedDataParallel still references, RPC agents, CUDA contexts), and it can abort a process
    ("terminate called without an active exception", SIGABRT) after a run that succeeded."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _reported(run_dir):
    """The exit status of a process that has reported its failure in one line, or None."""
    reports = sorted(Path(run_dir).glob("reported-*"))
    return int(reports[0].read_text() or 1) if reports else None


def _supervise(processes, stopped_after, run_dir):
    """Wait until every process has ended. The first one that fails, or that stays stopped (SIGSTOP, Ctrl-Z) for
    stopped_after seconds, ends the run: returns (message, exit status), or None when all succeeded. The message
    is empty when the process has said what went wrong itself."""
    running = {process.sentinel: rank for rank, process in enumerate(processes)}
    stopped_since = {}
    while running:
        ended = [running.pop(sentinel) for sentinel in multiprocessing.connection.wait(list(running), 0.5)]
        for rank in ended:
            processes[rank].join()
        # A process killed by a signal cannot say so itself, and its peers' errors are only the consequence.
        for rank in sorted(ended, key=lambda rank: processes[rank].exitcode >= 0):
            code = processes[rank].exitcode
            if code < 0:
                return f"process {rank} terminated with signal {signal.Signals(-code).name}", 1
            if code:
                reported = _reported(run_dir)
                return ("", reported) if reported else (f"process {rank} failed with exit status {code}", code)
        now = time.monotonic()
        for rank in running.values():
            since = stopped_since[rank] = stopped_since.get(rank, now) if is_stopped(processes[rank].pid) else now
            if now - since > stopped_after:
                return f"process {rank} (pid {processes[rank].pid}) has been stopped for {now - since:.0f} s", 1
    return None


def launch(worker, world_size, *args, timeout=60.0):
    """Run worker(info: DistInfo, *args) on world_size processes (or this one, under torchrun).

    Spawned here, the processes are watched: a process that fails, or stays stopped (SIGSTOP) for timeout / 2
    seconds (before the backends' own timeouts fire in its peers and blame nobody in particular), ends the run:
    the others are killed, the stopped one included, and one line names the culprit. A UsageError or RunFailed in
    a process is its one line and exit status, as in the launcher. Under torchrun, torchrun watches the processes,
    and a process that lost a peer says so in one line before torchrun restarts the group or ends the run. A
    worker process that succeeds ends through leave_at_once.
    """
    env = torchrun_env()
    if env:
        torch.set_num_threads(max(1, usable_cpus() // env["LOCAL_WORLD_SIZE"]))
        info = DistInfo(env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], "env://")
        try:
            worker(info, *args)
        except RuntimeError as error:  # gloo's, TensorPipe's and NCCL's errors when a peer is gone
            if not (isinstance(error, dist.DistError) or any(sign in str(error) for sign in ("peer", "tensorpipe"))):
                raise
            reason = str(error).strip().splitlines()[0].split(". ")[0]  # gloo's names the peer's address
            sys.exit(f"process {info.rank} lost a peer ({reason}); torchrun restarts the group if --max-restarts "
                     f"allows, else ends the run")
        leave_at_once()
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    for variable in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # else the host's address
        os.environ.setdefault(variable, next((name for name in names if name.startswith("lo")), ""))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    context = mp.get_context("spawn")
    run_dir = tempfile.mkdtemp(prefix="rendezvous-")  # private: the rendezvous file and the processes' reports
    processes = [context.Process(target=_spawned_worker, name=f"rank {rank}", args=(
        rank, worker, world_size, f"file://{run_dir}/store", os.getpid(), run_dir, args))
        for rank in range(world_size)]
    try:
        for process in processes:
            process.start()
        failure = _supervise(processes, timeout / 2, run_dir)
    except KeyboardInterrupt:
        failure = "interrupted", 130
    finally:
        for process in processes:  # all at once: a peer that outlives the culprit would log its lost connection
            if process.is_alive():
                process.kill()  # SIGKILL: also ends a stopped process, which would never act on SIGTERM
        for process in processes:
            if process.pid is not None:
                process.join()
        shutil.rmtree(run_dir, ignore_errors=True)
    if failure:
        if failure[0]:
            print(f"error: {failure[0]}; the other processes were stopped", file=sys.stderr, flush=True)
        raise SystemExit(failure[1])


ROUND_SCHEME = "torchrun-round"


def round_store(name, rank, world_size, timeout_s):
    """A namespace of torchrun's store that no earlier round of workers has written to.

    torchrun's agent hosts one TCPStore for the whole job and the workers of every round use it
    (TORCHELASTIC_USE_AGENT_STORE=True; elastic/rendezvous/dynamic_rendezvous.py creates it in the first round
    only), while torch's env:// rendezvous puts no per-round prefix on the keys (rendezvous.py, _create_c10d_store,
    assumes a new store per restart). After a restart (--max-restarts) the keys in which gloo's ranks, NCCL or
    TensorPipe published their addresses still hold the dead round's values, and a rank that reads one before its
    peer has rewritten it connects to a closed port ("Connection refused" in gloo's connectFullMesh) or hangs.
    TORCHELASTIC_RESTART_COUNT cannot name the round: each machine's agent counts only its own restarts.

    So every key a rank waits for is named by a random value drawn in this round: each rank posts a fresh
    challenge; rank 0 draws the round's token and answers every challenge it sees (a dead round's too, harmlessly)
    until all ranks have counted themselves in under the token, and the group keeps its keys under the token.
    """
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           timeout=datetime.timedelta(seconds=timeout_s))
    if rank != 0:
        challenge = os.urandom(16).hex()
        shared.set(f"{name}/challenge/{rank}", challenge)
        token = shared.get(f"{name}/answer/{challenge}").decode()  # waits for rank 0 of this round
        shared.add(f"{name}/{token}/joined", 1)
        return dist.PrefixStore(f"{name}/{token}/", shared)
    token = os.urandom(16).hex()
    challenges = [f"{name}/challenge/{peer}" for peer in range(1, world_size)]
    if challenges:
        shared.wait(challenges)  # this round's, or a dead round's
    deadline = time.monotonic() + timeout_s
    while shared.add(f"{name}/{token}/joined", 0) < world_size - 1:
        answers = [f"{name}/answer/{challenge.decode()}" for challenge in shared.multi_get(challenges)]
        shared.multi_set(answers, [token] * len(answers))  # a dead round's challenge too, harmlessly
        if time.monotonic() > deadline:
            missing = world_size - 1 - shared.add(f"{name}/{token}/joined", 0)
            raise RunFailed(f"{missing} process(es) did not join within {timeout_s:g} s; check that every machine "
                            f"of the run started")
        time.sleep(0.05)
    return dist.PrefixStore(f"{name}/{token}/", shared)


def _round_rendezvous(url, timeout=datetime.timedelta(seconds=60), **kwargs):
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlparse(url).query))
    rank, world_size = int(query["rank"]), int(query["world_size"])
    yield round_store(query["name"], rank, world_size, timeout.total_seconds()), rank, world_size


def init_process_group(info, backend, timeout_s=60.0, device_id=None):
    """Join the default process group; every collective fails after timeout_s instead of hanging."""
    dist.init_process_group(backend, init_method=info.store_url("pg"), rank=info.rank, world_size=info.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), device_id=device_id)


def init_rpc(info, name, timeout_s=20.0, device_maps=None, devices=None):
    """Join the RPC group as `name`; an RPC whose peer is gone fails after timeout_s instead of hanging."""
    from torch.distributed import rpc
    # torch's own RPC set-up and shutdown call a deprecated process-group API; nothing for a user to act on.
    warnings.filterwarnings("ignore", message="You are using a Backend")
    options = rpc.TensorPipeRpcBackendOptions(init_method=info.store_url("rpc"), rpc_timeout=timeout_s,
                                              device_maps=device_maps, devices=devices)
    rpc.init_rpc(name, rank=info.rank, world_size=info.world_size, rpc_backend_options=options)


# ---------------------------------------------------------------------------------------------------------
# Seeding and devices
# ---------------------------------------------------------------------------------------------------------

def seed_everything(seed):
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def cuda_device_count():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_per_process_problem(local_processes):
    """Why the local processes cannot have a GPU each, or None when they can: either this machine shows a GPU
    for every local process (process i takes cuda:i), or a scheduler made one GPU visible to each process
    (CUDA_VISIBLE_DEVICES set, one device: every process takes cuda:0, each its own)."""
    count = cuda_device_count()
    if count >= local_processes or (count == 1 and os.environ.get("CUDA_VISIBLE_DEVICES")):
        return None
    return f"{local_processes} processes on this machine need a GPU each, and it shows {count}"


def local_gpu_index(local_rank):
    """This process's GPU under the rule of gpu_per_process_problem."""
    return local_rank if cuda_device_count() > local_rank else 0


def pick_device(use_cuda, index=0):
    """cuda:index (made current) when asked for, else the CPU; a missing GPU is a UsageError."""
    check(not use_cuda or index < cuda_device_count(), f"no CUDA device {index} here; run without the GPU flag")
    if use_cuda:
        torch.cuda.set_device(index)
    return torch.device("cuda", index) if use_cuda else torch.device("cpu")


def set_tf32(allowed):
    """Let float32 matrix products and convolutions on Ampere and newer GPUs run in TF32 (relative error near
    1e-3), or keep them in IEEE float32, as every comparison with another device needs."""
    torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.fp32_precision = "tf32" if allowed else "ieee"


# ---------------------------------------------------------------------------------------------------------
# Files: atomic writes, verified checkpoints, figures
# ---------------------------------------------------------------------------------------------------------

def write_or_fail(path, data, flag=None, kept="the previous file, if any, is intact"):
    """Write bytes so that readers see the old file or the whole new one, never a partial one: a temporary file
    in the same folder (created if missing), flushed to disk, then renamed over the old one. A write that fails
    (disk full, a file-size limit, a folder that became read-only) keeps the previous file and raises RunFailed
    saying what to do (`flag` names the option that chose the path) and what is kept."""
    path, tmp = Path(path), None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as error:
        with contextlib.suppress(OSError, TypeError):
            os.unlink(tmp)
        raise RunFailed(f"cannot write {path} ({error.strerror or error}); free space on that disk, lift the "
                        f"file-size limit or {f'pass another {flag}' if flag else 'write elsewhere'}; {kept}") from None


def save_figure(figure, path, flag=None, kept="the previous file, if any, is intact"):
    """A matplotlib figure into path (.png, .pdf or .svg, see FIGURE_FORMATS) through write_or_fail; closes it."""
    import matplotlib.pyplot as plt
    data = io.BytesIO()
    figure.tight_layout()
    figure.savefig(data, format=Path(path).suffix[1:].lower(), dpi=100)
    plt.close(figure)
    write_or_fail(path, data.getvalue(), flag, kept)


def save_checkpoint(path, script, state, flag=None):
    """torch.save of `state` (a dict) and the script's name, through write_or_fail: torch.load(path)["key"] reads
    it back."""
    buffer = io.BytesIO()
    torch.save({**state, "script": script}, buffer)
    write_or_fail(path, buffer.getvalue(), flag)


def load_checkpoint(path, script, flag, keys=()):
    """The state that save_checkpoint wrote for `script`, verified: a file that is truncated, damaged, written by
    another script or lacking one of `keys` is a UsageError in one line, never a traceback. torch.save writes a
    zip with a CRC-32 of every record, which torch.load does not check, and zipfile does."""
    try:
        damaged = zipfile.ZipFile(path).testzip()
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # not a zip, truncated, a type the safe loader refuses: the file is bad
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0].split(". ")[0][:200]
        raise UsageError(f"{flag} {path}: not a readable checkpoint ({reason}); pass one written by {script}.py "
                         f"or delete it") from None
    check(damaged is None, f"{flag} {path}: damaged ({damaged} does not match its checksum); delete it or pass "
                           f"another checkpoint")
    origin = saved.get("script", "another program") if isinstance(saved, dict) else "another program"
    check(origin == script, f"{flag} {path}: written by {origin}, not by {script}.py; pass one of its checkpoints")
    missing = [key for key in keys if key not in saved]
    check(not missing, f"{flag} {path}: lacks {', '.join(missing)}; it was written by another version of "
                       f"{script}.py: pass a newer checkpoint")
    return saved


def check_fits(target, state, flag, path):
    """target.load_state_dict(state) (a module or an optimizer), every tensor's shape checked too: weights or an
    optimizer state that do not fit are a UsageError naming the first mismatch. Returns target."""
    try:
        target.load_state_dict(state)
        for param, values in getattr(target, "state", {}).items():  # an optimizer's state, per parameter
            check(all(value.shape == param.shape for value in values.values() if torch.is_tensor(value)
                      and value.dim()), f"{flag} {path}: its optimizer state does not fit the parameters")
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
        raise UsageError(f"{flag} {path}: does not fit this model ({lines[min(1, len(lines) - 1)][:200]}); pass a "
                         f"file written by this script with the same model flags") from None
    return target


# ---------------------------------------------------------------------------------------------------------
# Data: download once into a cache, verify checksums
# ---------------------------------------------------------------------------------------------------------

def fetch_dataset(data_dir, subdir, files, mirrors, checksum):
    """The folder holding every name in `files`, downloading the missing ones first.

    files: {file name: expected md5}; checksum(raw bytes) -> md5 to compare (so .gz files can be checked on
    their decompressed content). data_dir (a DataDir), or data_dir/subdir, is used as it is when it holds the
    files; None means the per-user cache ($XDG_CACHE_HOME or ~/.cache). Downloads go to data_dir, or the cache.
    """
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "torch-distributed-patterns", subdir)
    candidates = [Path(data_dir), Path(data_dir, subdir)] if data_dir is not None else [cache]
    for folder in candidates:
        if all((folder / name).is_file() for name in files):
            return folder
    fix = f"put {', '.join(files)} in a folder and pass --data-dir FOLDER"
    for name in (name for name in files if not (candidates[0] / name).is_file()):
        errors = []
        for url in (mirror + name for mirror in mirrors):
            try:
                with urllib.request.urlopen(url, timeout=60) as response:
                    data = response.read()
                break
            except OSError as error:
                errors.append(f"{url}: {getattr(error, 'reason', error)}")
        else:
            raise UsageError(f"cannot download {name} ({'; '.join(errors)}); {fix}")
        check(checksum(data) == files[name], f"downloaded {name} has the wrong checksum; {fix}")
        try:
            write_or_fail(candidates[0] / name, data)
        except RunFailed as error:
            raise UsageError(f"{error}; or pass a --data-dir you can write to") from None
    return candidates[0]


FASHION_MNIST_MIRRORS = [
    "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
]
# md5 of the decompressed IDX files, as published with the data set
FASHION_MNIST_FILES = {
    "train-images-idx3-ubyte.gz": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
    "train-labels-idx1-ubyte.gz": "9018921c3c673c538a1fc5bad174d6f9",
    "t10k-images-idx3-ubyte.gz": "8181f5470baa50b63fa0f6fddb340f0a",
    "t10k-labels-idx1-ubyte.gz": "15d484375f8d13e6eb1aabb0c3f46965",
}
FASHION_MNIST_TRAIN = 60_000  # images in the training split


def _gunzip(data, path="the download"):
    try:
        return gzip.decompress(data)
    except (OSError, EOFError) as error:
        raise UsageError(f"{path} is not gzip data ({error}); delete it to download it again") from None


def fashion_mnist_dir(data_dir=None, mirrors=FASHION_MNIST_MIRRORS):
    """Folder with the four Fashion-MNIST IDX .gz files; call once before launching (downloads if needed)."""
    return fetch_dataset(data_dir, "fashion-mnist", FASHION_MNIST_FILES, mirrors, lambda data: md5(_gunzip(data)))


def load_fashion_mnist(folder):
    """(train images uint8 [60000, 28, 28], train labels int64, test images, test labels), checksums verified."""
    tensors = []
    for name, digest in FASHION_MNIST_FILES.items():
        raw = _gunzip(Path(folder, name).read_bytes(), Path(folder, name))
        check(md5(raw) == digest, f"{Path(folder, name)} is corrupt (md5 mismatch); delete it to download it again")
        shape = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(raw[3])]  # the IDX header
        tensors.append(torch.frombuffer(bytearray(raw[4 + 4 * raw[3]:]), dtype=torch.uint8).view(*shape))
    return tensors[0], tensors[1].long(), tensors[2], tensors[3].long()


WIKITEXT2_MIRRORS = ["https://raw.githubusercontent.com/pytorch/examples/main/word_language_model/data/wikitext-2/"]
WIKITEXT2_FILES = {
    "train.txt": "34a77ebe59551b3a3b3d8c0a2797c976",
    "valid.txt": "d756d22ab2310e7e60c094bea5c5a8eb",
    "test.txt": "781c9418ab9414bd09e4aad825aae752",
}


def wikitext2_dir(data_dir=None, mirrors=WIKITEXT2_MIRRORS):
    """Folder with train/valid/test.txt of WikiText-2. A --data-dir that already holds the three files is used
    as it is (any text in that format, unchecked); downloads are checked against the published md5s."""
    return fetch_dataset(data_dir, "wikitext-2", WIKITEXT2_FILES, mirrors, md5)


def md5(data):
    return hashlib.md5(data).hexdigest()


def emit_result(script, **figures):
    """The run's last line: one JSON object that tests and benchmarks read."""
    print(json.dumps({"script": script, **figures}), flush=True)
