"""Plumbing shared by the four scripts: command line, launching, rendezvous, seeding, devices, data, results.

Nothing here knows about a model or an algorithm; copy this file next to the script you take.

Launching. `launch(worker, n, *args)` runs `worker(info, *args)` in n processes and returns when all of them
have finished. Started with `python script.py`, it spawns the n processes itself on this machine: they meet
through a file in a private temporary folder (no port to pick, so two runs cannot collide) and every socket
they open listens on the loopback interface only. Started by `torchrun`, which sets RANK, WORLD_SIZE and
LOCAL_RANK, it runs this process's worker directly and meets the others at MASTER_ADDR:MASTER_PORT, so the
same script runs on several nodes. If any process fails, the whole run ends with a non-zero exit status.
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
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import textwrap
import typing
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
    """An error the user can fix (a bad flag value, missing data offline, no GPU). Printed as one line."""


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

    `bool` fields get --flag/--no-flag, `Literal[...]` fields get choices, `Optional[T]` fields default to None.
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
            parser.add_argument(flag, type=kind, default=field.default, help=help_text)
    return args_cls(**vars(parser.parse_args(argv)))


def run_main(main):
    """Call main(); a UsageError becomes one line on stderr and exit status 2, with no traceback."""
    try:
        main()
    except UsageError as error:
        print(f"{Path(sys.argv[0]).name}: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


def check(condition, message):
    """Raise UsageError(message) unless condition holds: one line per flag rule, read top to bottom."""
    if not condition:
        raise UsageError(message)


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
        """A rendezvous address of its own for each thing that needs one (process group, RPC)."""
        return self.init_method if self.init_method == "env://" else f"{self.init_method}.{name}"


def launched_by_torchrun():
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def process_count(spawned):
    """The number of processes of this run: torchrun's WORLD_SIZE under torchrun, else `spawned`."""
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else spawned


def check_output_file(flag, path):
    """A file the run will write (a plot, a checkpoint) must have an existing folder: say so before training."""
    folder = Path(path).resolve().parent
    check(folder.is_dir(), f"{flag} {path}: folder {folder} does not exist; create it first")


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


def _spawned_worker(local_rank, worker, world_size, init_method, launcher_pid, args):
    die_with_parent(launcher_pid)
    torch.set_num_threads(max(1, usable_cpus() // world_size))
    info = DistInfo(local_rank, world_size, local_rank, world_size, init_method)
    worker(info, *args)


def launch(worker, world_size, *args):
    """Run worker(info: DistInfo, *args) on world_size processes (or this one, under torchrun)."""
    if launched_by_torchrun():
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, usable_cpus() // local_world_size))
        info = DistInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]),
                        local_world_size, "env://")
        worker(info, *args)
        return
    loopback = _loopback_interface()
    if loopback:  # gloo, NCCL's bootstrap and TensorPipe would otherwise listen on the host's public address
        for variable in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(variable, loopback)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    rendezvous_dir = tempfile.mkdtemp(prefix="rendezvous-")
    try:
        mp.spawn(_spawned_worker, args=(worker, world_size, f"file://{rendezvous_dir}/store", os.getpid(), args),
                 nprocs=world_size, join=True)
    except mp.ProcessRaisedException as error:
        # The child's traceback is part of the message; spawn has already terminated the other processes.
        print(error, file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except mp.ProcessExitedException as error:
        print(f"error: {error}; the other processes were stopped", file=sys.stderr, flush=True)
        raise SystemExit(error.exit_code if error.exit_code and error.exit_code > 0 else 1) from None
    finally:
        shutil.rmtree(rendezvous_dir, ignore_errors=True)


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
    """Write bytes so that readers see the old file or the whole new one, never a partial one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def save_atomic(obj, path):
    """torch.save through write_atomic: a crash mid-save leaves the previous file intact."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, buffer.getvalue())


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
        if (target / name).is_file():
            continue
        try:
            target.mkdir(parents=True, exist_ok=True)
            data = _download([mirror + name for mirror in mirrors])
        except OSError as error:
            raise UsageError(f"cannot download {name} ({error}); put {names} in a folder and pass "
                             f"--data-dir FOLDER") from None
        check(checksum(name, data) == expected,
              f"downloaded {name} has the wrong checksum; put {names} in a folder and pass --data-dir FOLDER")
        write_atomic(target / name, data)
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
    raw = gzip.decompress(Path(path).read_bytes())
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
