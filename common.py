"""Plumbing shared by the four scripts: command line, launching, rendezvous, seeding, devices, data, results.

Nothing here knows about a model or an algorithm; copy this file next to the script you take.

Launching. `launch(worker, n, *args)` runs `worker(info, *args)` in n processes and returns when all of them
have finished. Started with `python script.py`, it spawns the n processes itself on this machine: they meet
through a file in a private temporary folder (no port to pick, so two runs cannot collide) and every socket
they open listens on the loopback interface only. Started by `torchrun`, which sets RANK, WORLD_SIZE and
LOCAL_RANK, it runs this process's worker directly (then ends the process) and meets the others at
MASTER_ADDR:MASTER_PORT, so the same script runs on several nodes. If any process fails, the whole run ends
with a non-zero exit status.
"""

import argparse
import ast
import dataclasses
import datetime
import gzip
import hashlib
import inspect
import io
import json
import math
import multiprocessing.connection
import os
import random
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import textwrap
import threading
import time
import traceback
import typing
import urllib.parse
import urllib.request
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------

class UsageError(Exception):
    """An error the user can fix (a bad flag value, missing data offline, no GPU): one line, exit status 2."""
    status = 2


class RunFailed(Exception):
    """A failure during the run that the user can act on (a full disk, a folder that became read-only): one line
    that says what to do, exit status 1."""
    status = 1


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _field_docs(cls):
    """The string literal under each field of a dataclass: `x: int = 1` followed by `\"\"\"help\"\"\"`."""
    docs = {}
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def parse_args(args_cls, argv=None):
    """Build an argparse parser from a dataclass (field docstrings become --help) and parse argv into it.

    `bool` fields get --flag/--no-flag, `Literal[...]` fields get choices, `Optional[T]` fields default to None,
    `float` fields refuse nan and inf.
    """
    module_doc = sys.modules[args_cls.__module__].__doc__ or ""
    parser = _OneLineParser(description=module_doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    docs = _field_docs(args_cls)
    hints = typing.get_type_hints(args_cls)
    for field in dataclasses.fields(args_cls):
        flag = "--" + field.name.replace("_", "-")
        kind = hints[field.name]
        if typing.get_origin(kind) is typing.Union:  # Optional[T]
            kind = next(t for t in typing.get_args(kind) if t is not type(None))
        help_text = docs.get(field.name, "") + " (default: %(default)s)"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default, help=help_text)
        elif typing.get_origin(kind) is typing.Literal:
            choices = typing.get_args(kind)
            parser.add_argument(flag, choices=choices, type=type(choices[0]), default=field.default, help=help_text)
        else:
            parser.add_argument(flag, type=_finite_float if kind is float else kind, default=field.default,
                                help=help_text)
    return args_cls(**vars(parser.parse_args(argv)))


def _finite_float(text):
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def run_main(main):
    """Call main(); a UsageError or RunFailed becomes one line on stderr and its exit status, with no traceback."""
    try:
        main()
    except (UsageError, RunFailed) as error:
        print(f"{Path(sys.argv[0]).name}: error: {error}", file=sys.stderr, flush=True)
        sys.exit(error.status)


def check(condition, message):
    """Raise UsageError(message) unless condition holds: one line per flag rule, read top to bottom."""
    if not condition:
        raise UsageError(message)


def check_input_file(flag, path):
    """A file the run will read must exist, be a regular file and be readable."""
    path = Path(path)
    check(path.exists(), f"{flag} {path}: no such file")
    check(path.is_file(), f"{flag} {path}: is a folder, not a file; pass a file")
    check(os.access(path, os.R_OK), f"{flag} {path}: cannot be read; fix its permissions or pass another file")


def check_output_file(flag, path):
    """A file the run will write (a plot, a checkpoint) needs a writable, existing folder and must not be a
    folder itself: said before any work starts, not after it."""
    path = Path(path)
    folder = path.resolve().parent
    check(not path.is_dir(), f"{flag} {path}: is a folder; pass a file name")
    check(folder.is_dir(), f"{flag} {path}: folder {folder} does not exist; create it first")
    check(os.access(folder, os.W_OK | os.X_OK), f"{flag} {path}: cannot write in {folder}; pass another path")
    check(not path.exists() or os.access(path, os.W_OK), f"{flag} {path}: cannot be overwritten; pass another path")


def check_output_dir(flag, path):
    """A folder the run will write into (created if missing) must not be a file, and it, or the nearest folder
    above it that exists, must be writable."""
    path = Path(path).resolve()
    check(not path.exists() or path.is_dir(), f"{flag} {path}: is a file; pass a folder")
    existing = next(folder for folder in (path, *path.parents) if folder.exists())
    check(existing.is_dir(), f"{flag} {path}: {existing} is a file; pass another folder")
    check(os.access(existing, os.W_OK | os.X_OK), f"{flag} {path}: cannot write in {existing}; pass another folder")


# ---------------------------------------------------------------------------------------------------------
# Launching and rendezvous
# ---------------------------------------------------------------------------------------------------------

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
        try:
            dist.register_rendezvous_handler(ROUND_SCHEME, _round_rendezvous)
        except RuntimeError:  # registered by an earlier call in this process
            pass
        return f"{ROUND_SCHEME}://?name={name}"


def launched_by_torchrun():
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def process_count(spawned):
    """The number of processes of this run: torchrun's WORLD_SIZE under torchrun, else `spawned`."""
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else spawned


def usable_cpus():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pin_to_one_cpu(info):
    """Bind this process to one CPU of its own when this machine has one for each of its processes; returns the
    CPU, or None when there are too few to go round (then the OS scheduler places the processes).

    For RPC-bound runs: TensorPipe's shared-memory transport polls busily in a thread of every process, and
    unpinned, the pollers of all processes and their Python threads fight over the same cores.
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < info.local_world_size:
        return None
    cpu = cpus[info.local_rank]
    os.sched_setaffinity(0, {cpu})
    return cpu


def _loopback_interface():
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((name for name in names if name.startswith("lo")), None)


def die_with_parent(parent_pid):
    """Call first thing in a child process: if its parent (pid parent_pid) is killed outright (SIGKILL, OOM),
    the child is killed too instead of living on as an orphan (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        raise SystemExit("the process that started this one is gone")


HEARTBEAT_S = 1.0  # how often a spawned process tells the launcher it is alive
STARTUP_S = 60.0  # allowed before a process's first heartbeat (imports, under load)


def _heartbeat(beats, index, finished):
    """Stamp this process's slot in `beats` every HEARTBEAT_S seconds until `finished` is set. A process that is
    stopped (SIGSTOP) or frozen stops stamping, which is how the launcher tells it is silent."""
    beats[index] = time.monotonic()
    while not finished.wait(HEARTBEAT_S):
        beats[index] = time.monotonic()


def _spawned_worker(local_rank, worker, world_size, init_method, launcher_pid, beats, run_dir, args):
    die_with_parent(launcher_pid)
    finished = threading.Event()
    threading.Thread(target=_heartbeat, args=(beats, local_rank, finished), daemon=True).start()
    torch.set_num_threads(max(1, usable_cpus() // world_size))
    info = DistInfo(local_rank, world_size, local_rank, world_size, init_method)
    try:
        worker(info, *args)
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
    finally:
        finished.set()
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


def _supervise(processes, beats, silent_after, run_dir):
    """Wait until every process has ended. The first one that fails, or that sends no heartbeat for silent_after
    seconds (stopped, or frozen), ends the run: returns (message, exit status), or None when all succeeded.
    The message is empty when the process has said what went wrong itself."""
    running = {process.sentinel: rank for rank, process in enumerate(processes)}
    started = time.monotonic()
    while running:
        ended = [running.pop(sentinel) for sentinel in multiprocessing.connection.wait(list(running), HEARTBEAT_S)]
        for rank in ended:
            processes[rank].join()
        # A process killed by a signal cannot say so itself, and its peers' errors are only the consequence.
        for rank in ended:
            if processes[rank].exitcode < 0:
                return f"process {rank} terminated with signal {signal.Signals(-processes[rank].exitcode).name}", 1
        for rank in ended:
            code = processes[rank].exitcode
            if code:
                reported = _reported(run_dir)
                return ("", reported) if reported else (f"process {rank} failed with exit status {code}", code)
        now = time.monotonic()
        for rank in running.values():
            last = beats[rank]
            silent = now - max(last, started)
            limit = silent_after + (STARTUP_S if last < started else 0.0)
            # A stopped process is named at once; one that still runs but is silent may only be starved of CPU
            # by other work on the machine, so it gets three times as long.
            stopped = _process_state(processes[rank].pid) in ("T", "t")
            if silent > limit and (stopped or silent > 3 * limit):
                return (f"process {rank} (pid {processes[rank].pid}) sent no sign of life for {silent:.0f} s "
                        f"({'stopped' if stopped else 'hung'})"), 1
    return None


def _process_state(pid):
    """The state letter Linux reports for a process (R running, S sleeping, T stopped, ...), or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def launch(worker, world_size, *args, timeout=60.0):
    """Run worker(info: DistInfo, *args) on world_size processes (or this one, under torchrun).

    Spawned here, the processes are watched: a process that fails, or is stopped (SIGSTOP) and silent for
    timeout / 2 seconds (before the backends' own timeouts fire in its peers and blame nobody in particular), or is
    silent for 1.5 x timeout, ends the run: the others are killed, the silent one included, and one line names the
    culprit. A UsageError or RunFailed in a process is its one line and exit status, as in the launcher. Under
    torchrun, torchrun watches the processes. A worker process that succeeds ends through leave_at_once.
    """
    if launched_by_torchrun():
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, usable_cpus() // local_world_size))
        info = DistInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]),
                        local_world_size, "env://")
        worker(info, *args)
        leave_at_once()
    loopback = _loopback_interface()
    if loopback:  # gloo, NCCL's bootstrap and TensorPipe would otherwise listen on the host's public address
        for variable in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(variable, loopback)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    context = mp.get_context("spawn")
    beats = context.Array("d", world_size, lock=False)  # one heartbeat stamp per process, in shared memory
    run_dir = tempfile.mkdtemp(prefix="rendezvous-")  # private: the rendezvous file and the processes' reports
    init_method = f"file://{run_dir}/store"
    processes = [context.Process(target=_spawned_worker, name=f"rank {rank}",
                                 args=(rank, worker, world_size, init_method, os.getpid(), beats, run_dir, args))
                 for rank in range(world_size)]
    try:
        for process in processes:
            process.start()
        failure = _supervise(processes, beats, timeout / 2, run_dir)
    except KeyboardInterrupt:
        failure = "interrupted", 130
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()  # SIGKILL: also ends a stopped process, which would never act on SIGTERM
        for process in processes:
            if process.pid is not None:
                process.join()
        shutil.rmtree(run_dir, ignore_errors=True)
    if failure:
        message, status = failure
        if message:
            print(f"error: {message}; the other processes were stopped", file=sys.stderr, flush=True)
        raise SystemExit(status)


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
        challenge = secrets.token_hex(16)
        shared.set(f"{name}/challenge/{rank}", challenge)
        token = shared.get(f"{name}/answer/{challenge}").decode()  # waits for rank 0 of this round
        shared.add(f"{name}/{token}/joined", 1)
        return dist.PrefixStore(f"{name}/{token}/", shared)
    token = secrets.token_hex(16)
    challenges = [f"{name}/challenge/{peer}" for peer in range(1, world_size)]
    if challenges:
        shared.wait(challenges)  # this round's, or a dead round's
    answered, deadline = set(), time.monotonic() + timeout_s
    while shared.add(f"{name}/{token}/joined", 0) < world_size - 1:
        unanswered = [challenge for challenge in shared.multi_get(challenges) if challenge not in answered]
        if unanswered:
            shared.multi_set([f"{name}/answer/{challenge.decode()}" for challenge in unanswered],
                             [token] * len(unanswered))
            answered.update(unanswered)
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
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def cuda_device_count():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_process_count(spawned):
    """The number of processes of this run on this machine: torchrun's LOCAL_WORLD_SIZE, else `spawned`."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if launched_by_torchrun() else spawned


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
    """cuda:index when asked for and present, else the CPU; asking for a missing GPU is a UsageError."""
    if not use_cuda:
        return torch.device("cpu")
    check(index < cuda_device_count(),
          f"no CUDA device {index} on this machine ({cuda_device_count()} found); run without the GPU flag")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def set_tf32(allowed):
    """Let float32 matrix products and convolutions on Ampere and newer GPUs run in TF32 (about 3x faster, with
    a relative error near 1e-3), or keep them in IEEE float32, as every comparison with another device needs."""
    precision = "tf32" if allowed else "ieee"
    torch.backends.cuda.matmul.fp32_precision = precision
    torch.backends.cudnn.fp32_precision = precision


# ---------------------------------------------------------------------------------------------------------
# Data: download once into a cache, verify checksums, write atomically
# ---------------------------------------------------------------------------------------------------------

def cache_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torch-distributed-patterns"


def md5(data):
    return hashlib.md5(data).hexdigest()


def write_atomic(path, data):
    """Write bytes so that readers see the old file or the whole new one, never a partial one: a temporary file
    in the same folder, flushed to disk, then renamed over the old one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def save_atomic(obj, path, flag=None):
    """torch.save through write_or_fail."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_or_fail(path, buffer.getvalue(), flag)


def write_or_fail(path, data, flag=None, kept="the previous file, if any, is intact"):
    """write_atomic, creating the folder. A write that fails (disk full, a file-size limit, a folder that became
    read-only) keeps the previous file and raises RunFailed saying what to do (`flag` names the option that chose
    the path) and what is kept."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)
    except OSError as error:
        where = f"pass another {flag}" if flag else "write it elsewhere"
        raise RunFailed(f"cannot write {path} ({error.strerror or error}); free space on that disk, lift the "
                        f"file-size limit or {where}; {kept}") from None


def content_digest(value):
    """sha256 of a checkpoint's contents, in order: dict keys, tensors (dtype, shape and bytes), other values by
    repr. Stored in the checkpoint, it lets a load tell a damaged file from a good one (torch.load alone
    accepts a file whose tensor bytes were changed)."""
    digest = hashlib.sha256()

    def feed(item):
        if isinstance(item, torch.Tensor):
            tensor = item.detach().cpu().contiguous().reshape(-1)
            digest.update(f"tensor {tensor.dtype} {tuple(item.shape)}".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes())
        elif isinstance(item, dict):
            digest.update(f"dict {len(item)}".encode())
            for key, entry in item.items():
                feed(key)
                feed(entry)
        elif isinstance(item, (list, tuple)):
            digest.update(f"{type(item).__name__} {len(item)}".encode())
            for entry in item:
                feed(entry)
        else:
            digest.update(repr(item).encode())

    feed(value)
    return digest.hexdigest()


def save_checkpoint(path, script, state, flag=None):
    """Write `state` (a dict) as a checkpoint of `script`: torch.save of the dict plus the script's name and the
    content_digest of the state, atomically (see save_atomic). torch.load(path)["key"] still reads it."""
    save_atomic({**state, "script": script, "sha256": content_digest(state)}, path, flag)


def load_checkpoint(path, script, flag, keys=()):
    """The state that save_checkpoint wrote for `script`, verified: a file that is truncated, damaged, written
    by another script or lacking one of `keys` is a UsageError in one line, never a traceback."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated zip, garbage, a tensor type the safe loader refuses: the file is bad
        reason = str(error).strip().split(". ")[0].splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(f"{flag} {path}: not a readable checkpoint ({reason}); pass a checkpoint written by "
                         f"{script}.py or delete it") from None
    check(isinstance(saved, dict) and "sha256" in saved and "script" in saved,
          f"{flag} {path}: not a checkpoint written by {script}.py; pass one of its checkpoints")
    check(saved["script"] == script, f"{flag} {path}: a checkpoint of {saved['script']}.py, not of {script}.py; "
                                     f"pass one of {script}.py's checkpoints")
    state = {key: value for key, value in saved.items() if key not in ("script", "sha256")}
    check(content_digest(state) == saved["sha256"],
          f"{flag} {path}: damaged (its contents do not match the checksum saved with them); delete it or pass "
          f"another checkpoint")
    missing = [key for key in keys if key not in state]
    check(not missing, f"{flag} {path}: lacks {', '.join(missing)}; it was written by another version of "
                       f"{script}.py: pass a newer checkpoint")
    return state


def _download(urls, timeout_s=60.0):
    errors = []
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                return response.read()
        except OSError as error:
            errors.append(f"{url}: {getattr(error, 'reason', error)}")
    raise OSError("; ".join(errors))


def fetch_dataset(data_dir, subdir, files, mirrors, checksum):
    """The folder holding every name in `files`, downloading the missing ones first.

    files: {file name: expected md5}; checksum(name, raw bytes) -> md5 to compare (so .gz files can be
    checked on their decompressed content). data_dir (or data_dir/subdir) is used as it is when it holds
    the files; None means the per-user cache. Downloads go to data_dir, or the cache, atomically.
    """
    if data_dir is not None:
        data_dir = Path(data_dir)
        check(not data_dir.exists() or data_dir.is_dir(), f"--data-dir {data_dir} is not a folder; pass a folder")
        check(not data_dir.exists() or os.access(data_dir, os.R_OK | os.X_OK),
              f"--data-dir {data_dir} is not readable; fix its permissions or pass another folder")
        candidates = [data_dir, data_dir / subdir]
    else:
        candidates = [cache_dir() / subdir]
    for folder in candidates:
        if all((folder / name).is_file() for name in files):
            return folder
    target = candidates[0]
    names = ", ".join(files)
    for name, expected in files.items():
        check(not (target / name).is_dir(), f"{target / name} is a folder, not the data file; remove it or pass "
                                            f"another --data-dir")
        if (target / name).is_file():
            continue
        try:
            data = _download([mirror + name for mirror in mirrors])
        except OSError as error:
            raise UsageError(f"cannot download {name} ({error}); put {names} in a folder and pass "
                             f"--data-dir FOLDER") from None
        check(checksum(name, data) == expected,
              f"downloaded {name} has the wrong checksum; put {names} in a folder and pass --data-dir FOLDER")
        try:
            target.mkdir(parents=True, exist_ok=True)
            write_atomic(target / name, data)
        except OSError as error:
            raise UsageError(f"cannot write {target / name} ({error.strerror or error}); pass a --data-dir you "
                             f"can write to, with room for the data") from None
    return target


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


def _gunzip_md5(name, data):
    try:
        return md5(gzip.decompress(data))
    except (OSError, EOFError):
        return "not a gzip file"


def fashion_mnist_dir(data_dir=None, mirrors=FASHION_MNIST_MIRRORS):
    """Folder with the four Fashion-MNIST IDX .gz files; call once before launching (downloads if needed)."""
    return fetch_dataset(data_dir, "fashion-mnist", FASHION_MNIST_FILES, mirrors, _gunzip_md5)


def _read_idx(path, expected_md5):
    try:
        raw = gzip.decompress(Path(path).read_bytes())
    except (OSError, EOFError) as error:
        raise UsageError(f"{path} is unreadable or not gzip data ({error}); delete it to download it again, or "
                         f"pass another --data-dir") from None
    check(md5(raw) == expected_md5, f"{path} is corrupt (md5 mismatch); delete it to download it again")
    ndim = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return torch.frombuffer(bytearray(raw[4 + 4 * ndim:]), dtype=torch.uint8).view(*shape)


def load_fashion_mnist(folder):
    """(train images uint8 [60000, 28, 28], train labels int64, test images, test labels), checksums verified."""
    folder = Path(folder)
    tensors = {name.split("-idx")[0]: _read_idx(folder / name, digest) for name, digest in FASHION_MNIST_FILES.items()}
    return (tensors["train-images"], tensors["train-labels"].long(),
            tensors["t10k-images"], tensors["t10k-labels"].long())


WIKITEXT2_MIRRORS = ["https://raw.githubusercontent.com/pytorch/examples/main/word_language_model/data/wikitext-2/"]
WIKITEXT2_FILES = {
    "train.txt": "34a77ebe59551b3a3b3d8c0a2797c976",
    "valid.txt": "d756d22ab2310e7e60c094bea5c5a8eb",
    "test.txt": "781c9418ab9414bd09e4aad825aae752",
}


def wikitext2_dir(data_dir=None, mirrors=WIKITEXT2_MIRRORS):
    """Folder with train/valid/test.txt of WikiText-2. A --data-dir that already holds the three files is used
    as it is (any text in that format, unchecked); downloads are checked against the published md5s."""
    return fetch_dataset(data_dir, "wikitext-2", WIKITEXT2_FILES, mirrors, lambda name, data: md5(data))


# ---------------------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------------------

def emit_result(script, **figures):
    """The run's last line: one JSON object that tests and benchmarks read."""
    print(json.dumps({"script": script, **figures}), flush=True)
