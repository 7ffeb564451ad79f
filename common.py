"""Plumbing shared by the four scripts; nothing here knows a model or an algorithm. Copy it next to the script you
take. Its sections: 1. errors and flags; 2. processes (mp.spawn, torchrun, rendezvous); 3. devices; 4. files (atomic
writes, checkpoints, the result line); 5. data (downloaded once, checked against published md5 sums).
"""

import argparse
import ast
import contextlib
import ctypes
import dataclasses
import datetime
import functools
import gzip
import hashlib
import inspect
import io
import json
import logging
import math
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import typing
import urllib.request
import warnings
import zipfile
from pathlib import Path
from typing import Annotated

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import rpc

# ---------------------------------------------------------------------------------------------------------
# 1. Errors and flags
# ---------------------------------------------------------------------------------------------------------


class UsageError(Exception):
    """An error the user can fix (a bad flag, missing data, an unusable checkpoint): one line, exit status 2."""


def check(condition, message):
    if not condition:
        raise UsageError(message)


def brief(error):
    """An error's message as one line, cut at its first sentence: torch's run to several sentences and lines."""
    return " ".join(str(error).split()).split(". ")[0][:200] or type(error).__name__


def _number(cast, low, high, what):
    def parse(text):
        with contextlib.suppress(ValueError):
            if low <= (value := cast(text)) <= high:  # never nan
                return value
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return parse


# The kinds of flag values, each with its rule: `seed: Seed = 1` gives `--seed SEED`, refused unless 0 to 2**32 - 1
Positive = Annotated[int, _number(int, 1, math.inf, "a whole number, 1 or more")]
NonNegative = Annotated[int, _number(int, 0, math.inf, "a whole number, 0 or more")]
Seed = Annotated[int, _number(int, 0, 2**32 - 1, "a seed from 0 to 2**32 - 1 (numpy's range)")]
PositiveFloat = Annotated[float, _number(float, 5e-324, sys.float_info.max, "a positive number")]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, where argparse prints the usage first
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(args_cls, argv=None):
    """The command line as an args_cls, a dataclass with one field per flag (`batch_size` gives --batch-size). The
    string under each field is the flag's --help; a bool gives --flag/--no-flag, a Literal its choices, `T | None` a
    flag that is off unless given, and a kind above its rule."""
    parser = _Parser(description=sys.modules[args_cls.__module__].__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    body = ast.parse(inspect.getsource(args_cls)).body[0].body
    docs = {node.target.id: " ".join(doc.value.value.split()) for node, doc in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(doc, ast.Expr)}
    hints = typing.get_type_hints(args_cls, include_extras=True)
    for field in dataclasses.fields(args_cls):
        hint, options = hints[field.name], {"default": field.default, "help": docs[field.name].replace("%", "%%")}
        if type(None) in typing.get_args(hint):  # T | None
            hint = typing.get_args(hint)[0]
        if hint is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(hint) is typing.Literal:
            options["choices"] = typing.get_args(hint)
        else:  # a kind's rule, or int, float, str
            options["type"] = typing.get_args(hint)[1] if typing.get_origin(hint) is Annotated else hint
        action = parser.add_argument("--" + field.name.replace("_", "-"), **options)
        if field.default is not None and "%(default)" not in action.help:  # (BooleanOptionalAction may add it)
            action.help += " (default: %(default)s)"
    return args_cls(**vars(parser.parse_args(argv)))


def make_dir(flag, path):
    """An output folder, created now, before any work: one that cannot be created is a UsageError."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise UsageError(f"{flag} {path}: cannot create this folder ({error.strerror}); pass another") from None
    return path


def check_output_file(flag, path):
    """An output file, checked before any work: a folder of that name, or a folder for it that cannot be created, is a
    UsageError (else the run would train to its end, then fail to write)."""
    check(not os.path.isdir(path), f"{flag} {path}: is a folder; name a file")
    make_dir(flag, os.path.dirname(path) or ".")


def run_main(main):
    """Call main() and end as README's failure table says: a UsageError is one line and exit status 2; a spawned
    process killed by a signal is named in one line, exit status 1; one that exited with a status has said why itself
    (common.worker); Ctrl-C is exit status 130."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the run quietly, as command-line tools do
    prog = Path(sys.argv[0]).name
    try:
        return main()
    except UsageError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        sys.exit(2)
    except mp.ProcessRaisedException as error:  # before its worker ran: Ctrl-C as it started, or a bug
        if not error.msg.rstrip().endswith("KeyboardInterrupt"):
            print(error.msg.strip(), file=sys.stderr)
            sys.exit(1)
    except mp.ProcessExitedException as error:
        if error.signal_name:  # (a process that exited with a status has said why itself)
            print(f"{prog}: error: {error}; the other processes were stopped", file=sys.stderr)
        sys.exit(130 if error.signal_name == "SIGINT" else 1 if error.signal_name else error.exit_code)
    except KeyboardInterrupt:
        pass
    print(f"{prog}: interrupted; every process was stopped", file=sys.stderr)
    sys.exit(130)


# ---------------------------------------------------------------------------------------------------------
# 2. Processes: what mp.spawn does not do, torchrun's environment, rendezvous
# ---------------------------------------------------------------------------------------------------------

# What torch raises when a peer is gone or silent: a DistError (NCCL, the store), or a RuntimeError worded by gloo's
# transport ("[.../gloo/transport/tcp/pair.cc:545] Read error ...: Connection reset by peer", "Timed out waiting"),
# TensorPipe ("eof (this error originated at tensorpipe/transport/...)") or RPC's timeout
LOST_PEER = re.compile(r"gloo/transport/|this error originated at tensorpipe/|RPC ran for more than set timeout")


def lost_peer(error):
    return isinstance(error, dist.DistError) or type(error) is RuntimeError and bool(LOST_PEER.search(str(error)))


def die_with_parent():
    """Have the kernel kill this process (SIGKILL) when its parent dies, even inside a C++ call or stopped (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def worker(run_worker):
    """Decorator of a script's run_worker(rank, world_size, ...), which mp.spawn starts in every process (and main
    calls once under torchrun); when one process ends with an error, mp.spawn stops the others. This adds:
    - the process dies at once with its parent, and with Ctrl-C, even inside a C++ call (mp.spawn asks for a SIGINT
      at its parent's death, which Python acts on only between two bytecodes);
    - a peer that is gone, or silent past the timeout (lost_peer: torch's own errors for it), ends the process in one
      line, exit status 1. Spawned, it waits a second first: when the peer died, the launcher names it and stops this
      process meanwhile. Any other error ends it with its traceback, exit status 1;
    - the process leaves without the interpreter's teardown, which destroys torch's C++ objects (a gloo group that
      DDP still holds, RPC agents' threads) in no set order and can abort the process ("FATAL: exception not
      rethrown"), even after a run that succeeded."""
    @functools.wraps(run_worker)
    def run(rank, world_size, *args):
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        die_with_parent()
        warnings.filterwarnings("ignore", message="You are using a Backend")  # torch's RPC calls its deprecated API
        status, env = 0, torchrun_env()
        if env and env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] and env["MASTER_ADDR"] in ("localhost", "127.0.0.1"):
            listen_on_loopback()  # one machine: torchrun --standalone
        try:
            run_worker(rank, world_size, *args)
        except Exception as error:
            status = 1
            if lost_peer(error):
                time.sleep(0 if env else 1)
                print(f"process {rank} lost a peer ({brief(error)}); the run ends, or under torchrun restarts if "
                      f"--max-restarts allows", file=sys.stderr, flush=True)
            else:  # its traceback, here: mp.spawn's report would need the teardown
                print(f"process {rank} raised:\n{traceback.format_exc()}", file=sys.stderr, end="", flush=True)
        sys.stdout.flush()
        os._exit(status)
    return run


FINISHED = threading.Event()  # set by a process once its part of the run is done: see serve


def finished():
    return FINISHED.is_set()


def serve(peer, timeout):
    """Serve RPCs (in the RPC threads) until `peer` is done (FINISHED set in its process), asking it every half
    second: a peer that is stopped or hung, or whose machine froze, ends this process within the timeout, where
    rpc.shutdown would wait for it forever."""
    while not rpc.rpc_sync(peer, finished, timeout=timeout):
        time.sleep(0.5)


def listen_on_loopback():
    """Every socket that gloo, TensorPipe and NCCL open on the loopback interface (their variables, unless set)."""
    name = next(name for _, name in socket.if_nameindex() if name.startswith("lo"))
    for variable in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(variable, name)


@contextlib.contextmanager
def rendezvous():
    """Around mp.spawn on one machine: a private folder, removed afterwards, whose file the processes meet through
    (their init_method), so that two runs at once never collide and no port is fixed; every socket on loopback.
    SIGTERM (a job scheduler's stop, `timeout`) exits with status 143, as a shell reports it, through this block,
    which stops the processes."""
    listen_on_loopback()
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # not the peers' C++ warnings when a process dies
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # its "Terminating process" notes
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with tempfile.TemporaryDirectory(prefix="rendezvous-") as folder:
        try:
            yield f"file://{folder}/store"
        finally:  # (a process that mp.spawn started before it failed to start the next)
            for process in mp.active_children():
                process.kill()


def join(processes):
    """Wait for the processes of mp.spawn(..., join=False) as its join=True does, but when one fails, end the others
    at once: mp.spawn waits 30 s after its SIGTERM, which a stopped process (SIGSTOP) never acts on."""
    while not processes.join(grace_period=0):
        pass


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torchrun_env():
    """torchrun's variables (numbers as ints) when a launcher set any of them, else None. Some missing, or ranks
    beyond their sizes, are a UsageError: torch would wait for a process that never comes."""
    env = {name: os.environ.get(name, "") for name in TORCHRUN_VARIABLES}
    if not any(env[name] for name in TORCHRUN_VARIABLES[:4]):
        return None
    fix = f"start the script with torchrun, or set all of {', '.join(TORCHRUN_VARIABLES)}"
    check(all(env.values()), f"{', '.join(name for name, value in env.items() if not value)} not set; {fix}")
    numbers = {name: int(env[name]) if env[name].isdecimal() else -1 for name in TORCHRUN_VARIABLES[:4]}
    check(0 <= numbers["RANK"] < numbers["WORLD_SIZE"] and 0 <= numbers["LOCAL_RANK"] < numbers["LOCAL_WORLD_SIZE"]
          <= numbers["WORLD_SIZE"] and env["MASTER_PORT"].isdecimal(),
          f"{' '.join(f'{name}={env[name]}' for name in TORCHRUN_VARIABLES)}: want ranks below their sizes; {fix}")
    return {**env, **numbers}


def process_count(spawned):
    """The number of processes of this run: torchrun's WORLD_SIZE under torchrun, else `spawned`."""
    env = torchrun_env()
    return env["WORLD_SIZE"] if env else spawned


def local_rank(rank):
    """This process's index on its machine: torchrun's LOCAL_RANK, or a spawned run's rank (one machine)."""
    return int(os.environ.get("LOCAL_RANK", rank))


def usable_cpus():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def init_method(store, name):
    """The init_method of group `name` (a process group, RPC): a file of rendezvous()'s folder; or torchrun's env://,
    where under its agent (whose store outlives restarts) a round_store namespace."""
    if store != "env://":
        return f"{store}.{name}"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return store
    with contextlib.suppress(RuntimeError):  # registered by an earlier call in this process
        dist.register_rendezvous_handler("torchrun-round", _round_rendezvous)
    return f"torchrun-round://?name={name}"


def _round_rendezvous(url, timeout=datetime.timedelta(seconds=60), **kwargs):
    query = dict(pair.split("=") for pair in url.split("?")[1].split("&"))  # name, rank and world_size
    rank, world_size = int(query["rank"]), int(query["world_size"])
    yield round_store(query["name"], rank, world_size, timeout.total_seconds()), rank, world_size


def round_store(name, rank, world_size, timeout_s):
    """A namespace of torchrun's store that no earlier round of workers has written to.

    torchrun's agent hosts one TCPStore for the whole job, which the workers of every round use
    (TORCHELASTIC_USE_AGENT_STORE), and env:// puts no per-round prefix on the keys. After a restart the keys where
    gloo's ranks or TensorPipe published their addresses still hold the dead round's values, and a rank that reads
    one before its peer rewrote it connects to a closed port or hangs (without this, every restart test fails on
    torch 2.15). TORCHELASTIC_RESTART_COUNT cannot name the round: each machine's agent counts only its own restarts.
    So each rank posts a fresh challenge; rank 0 draws the round's token and answers every challenge it sees (a dead
    round's too, harmlessly) until all ranks have counted themselves in under the token, which prefixes the keys."""
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           timeout=datetime.timedelta(seconds=timeout_s))
    if rank != 0:
        challenge = os.urandom(16).hex()
        shared.set(f"{name}/challenge/{rank}", challenge)
        token = shared.get(f"{name}/answer/{challenge}").decode()  # waits for rank 0 of this round
        shared.add(f"{name}/{token}/joined", 1)
        return dist.PrefixStore(f"{name}/{token}/", shared)
    token, deadline = os.urandom(16).hex(), time.monotonic() + timeout_s
    challenges = [f"{name}/challenge/{peer}" for peer in range(1, world_size)]
    while (joined := shared.add(f"{name}/{token}/joined", 0)) < world_size - 1:
        if time.monotonic() > deadline:
            raise dist.DistStoreError(f"rendezvous timed out: {world_size - 1 - joined} process(es) did not join "
                                      f"within {timeout_s:g} s; check that every machine of the run started")
        shared.wait(challenges)  # this round's, or a dead round's
        answers = [f"{name}/answer/{challenge.decode()}" for challenge in shared.multi_get(challenges)]
        shared.multi_set(answers, [token] * len(answers))
        time.sleep(0.05)
    return dist.PrefixStore(f"{name}/{token}/", shared)


# ---------------------------------------------------------------------------------------------------------
# 3. Devices
# ---------------------------------------------------------------------------------------------------------

def pick_device(use_gpu, index):
    """GPU `index` of this machine (the accelerator torch finds: CUDA, ROCm, XPU), made the current device, when
    use_gpu; else the CPU."""
    if not use_gpu:
        return torch.device("cpu")
    torch.accelerator.set_device_index(index)
    return torch.device(torch.accelerator.current_accelerator().type, index)


def set_tf32(device, allowed):
    """On a CUDA device, let float32 matrix products and convolutions run in TF32 on Ampere and newer GPUs (relative
    error near 1e-3), or keep IEEE float32, as every comparison with another device needs."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = allowed


# ---------------------------------------------------------------------------------------------------------
# 4. Files: atomic writes, checkpoints, figures, the result line
# ---------------------------------------------------------------------------------------------------------

def atomic_write(path, data):
    """Write bytes so that readers see the old file or the whole new one, never a part: a temporary file in the same
    folder (created if missing), flushed to disk, then renamed over the old one. A write that fails (a full disk)
    leaves the old file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def save_figure(figure, path):
    """A matplotlib figure into path, in the format its suffix names (.png, .pdf, .svg), through atomic_write."""
    data = io.BytesIO()
    figure.tight_layout()
    figure.savefig(data, format=Path(path).suffix[1:].lower() or "png", dpi=100)
    atomic_write(path, data.getvalue())


def save_checkpoint(path, script, state):
    """torch.save of the dict `state` with the script's name, through atomic_write."""
    data = io.BytesIO()
    torch.save({**state, "script": script}, data)
    atomic_write(path, data.getvalue())


def load_checkpoint(path, script, flag, keys=()):
    """What save_checkpoint wrote for `script`. A file that is truncated or damaged (torch.save writes a zip with a
    CRC-32 of every record, which torch.load does not check and zipfile does), written by another program, or lacking
    one of `keys` is a UsageError."""
    try:
        damaged = zipfile.ZipFile(path).testzip()
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # not a zip, truncated, a type the safe loader refuses
        raise UsageError(f"{flag} {path}: not a readable checkpoint ({brief(error)}); pass one that {script}.py "
                         f"wrote") from None
    check(damaged is None, f"{flag} {path}: damaged ({damaged} fails its checksum); pass another checkpoint")
    check(isinstance(saved, dict) and saved.get("script") == script, f"{flag} {path}: not written by {script}.py; "
                                                                      f"pass one of its checkpoints")
    missing = [key for key in keys if key not in saved]
    check(not missing, f"{flag} {path}: lacks {', '.join(missing)} (another version of {script}.py wrote it)")
    return saved


def check_fits(target, state, flag, path):
    """target.load_state_dict(state), a module's or an optimizer's; a state that does not fit is a UsageError."""
    try:
        target.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError, TypeError) as error:
        raise UsageError(f"{flag} {path}: does not fit this model ({brief(error)}); pass a file written with the "
                         f"same model flags") from None
    return target


def emit_result(script, **figures):
    """The run's last line: one JSON object that tests and benchmarks read. Strict JSON: a number that is not finite
    (the loss of a run that diverged) is null."""
    text = json.dumps({"script": script, **figures})
    print(json.dumps(json.loads(text, parse_constant=lambda constant: None)), flush=True)


# ---------------------------------------------------------------------------------------------------------
# 5. Data: downloaded once into a cache, checked against the published md5 sums
# ---------------------------------------------------------------------------------------------------------

def md5(data):
    return hashlib.md5(data).hexdigest()


def fetch_dataset(data_dir, subdir, files, mirrors, checksum=md5):
    """The folder holding every file of `files` ({name: md5 of checksum(its bytes)}), downloading the missing ones
    first, checked: data_dir or data_dir/subdir, or with data_dir None the per-user cache ($XDG_CACHE_HOME or
    ~/.cache)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "torch-distributed-patterns", subdir)
    candidates = [Path(data_dir), Path(data_dir, subdir)] if data_dir is not None else [cache]
    for folder in candidates:
        if all((folder / name).is_file() for name in files):
            return folder
    fix = f"put {', '.join(files)} in a folder and pass --data-dir FOLDER"
    for name in [name for name in files if not (candidates[0] / name).is_file()]:
        data = None
        for url in [mirror + name for mirror in mirrors]:
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=60) as response:
                data = response.read()
                break
        check(data is not None, f"cannot download {name} from {' or '.join(mirrors)}; {fix}")
        check(checksum(data) == files[name], f"downloaded {name} has the wrong checksum; {fix}")
        atomic_write(candidates[0] / name, data)
    return candidates[0]


FASHION_MNIST_MIRRORS = ["http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
                         "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/"]
# md5 of the decompressed IDX files, as published with the data set
FASHION_MNIST_FILES = {"train-images-idx3-ubyte.gz": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
                       "train-labels-idx1-ubyte.gz": "9018921c3c673c538a1fc5bad174d6f9",
                       "t10k-images-idx3-ubyte.gz": "8181f5470baa50b63fa0f6fddb340f0a",
                       "t10k-labels-idx1-ubyte.gz": "15d484375f8d13e6eb1aabb0c3f46965"}
FASHION_MNIST_TRAIN = 60_000  # images in the training split


def _gunzip_md5(data):
    try:
        return md5(gzip.decompress(data))
    except (OSError, EOFError):  # not gzip data
        return None


def fashion_mnist_dir(data_dir=None, mirrors=FASHION_MNIST_MIRRORS):
    """The folder with the four Fashion-MNIST .gz files, downloaded if need be, every file checked: call it once,
    before any process starts (load_fashion_mnist then reads them unchecked)."""
    folder = fetch_dataset(data_dir, "fashion-mnist", FASHION_MNIST_FILES, mirrors, _gunzip_md5)
    for name, digest in FASHION_MNIST_FILES.items():
        check(_gunzip_md5(Path(folder, name).read_bytes()) == digest, f"{Path(folder, name)} is corrupt (its md5 "
                                                                       f"differs); delete it to download it again")
    return folder


def load_fashion_mnist(folder):
    """(train images uint8 [60000, 28, 28], train labels int64, test images [10000, 28, 28], test labels)."""
    tensors = []
    for name in FASHION_MNIST_FILES:
        raw = gzip.decompress(Path(folder, name).read_bytes())
        dims = raw[3]  # the IDX header: magic number, then one big-endian 4-byte size per dimension
        shape = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims)]
        tensors.append(torch.frombuffer(bytearray(raw[4 + 4 * dims:]), dtype=torch.uint8).view(*shape))
    return tensors[0], tensors[1].long(), tensors[2], tensors[3].long()
