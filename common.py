"""Plumbing shared by the four scripts; nothing here knows a model or an algorithm. Copy it next to the script you
take. Its sections, and the scripts that use each:

    1. Errors and flags: one-line errors, the command line from a dataclass, kinds of values    every script
    2. Processes: a thin layer over mp.spawn, torchrun's environment, rendezvous, groups       all but async_hpo
    3. Devices                                                                                 all but rpc_rl
    4. Files: atomic writes, verified checkpoints, figures, the result line                   every script
    5. Data: downloaded once, with checksums; Fashion-MNIST                                    all but rpc_rl
"""

import argparse
import ast
import contextlib
import ctypes
import dataclasses
import datetime
import errno
import functools
import gc
import gzip
import hashlib
import inspect
import io
import ipaddress
import json
import logging
import os
import re
import resource
import signal
import socket
import stat
import sys
import tempfile
import time
import typing
import urllib.request
import warnings
import zipfile
from pathlib import Path
from typing import Annotated

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# ---------------------------------------------------------------------------------------------------------
# 1. Errors and flags: one rule for each kind of value, checked as the command line is parsed
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


def _try(flag, path, action, what):
    """action() as the run will do it, where permission bits and os.access cannot tell (root, a read-only file
    system, a dangling link): an OSError is one line saying the run cannot do `what`."""
    try:
        action()
    except OSError as error:
        raise UsageError(f"{flag} {path}: cannot {what} ({error.strerror}); fix that or pass another path") from None
    return path


def input_file(flag, path):
    """A file the run reads: there, a regular file, readable."""
    found = _stat(flag, path)
    check(found, f"{flag} {path}: no such file")
    check(stat.S_ISREG(found.st_mode), f"{flag} {path}: not a regular file; pass a file")
    return _try(flag, path, lambda: open(path, "rb").close(), "be read")


def output_file(flag, path):
    """A file the run writes by renaming a new file over it: nothing yet or a regular file (never a device or a
    FIFO, which the rename would replace; a link must lead to one), in an existing folder the run can write in."""
    found, folder = _stat(flag, path), Path(path).parent
    check(found or not os.path.islink(path), f"{flag} {path}: a link to nothing; pass a file name")
    check(not found or stat.S_ISREG(found.st_mode), f"{flag} {path}: not a regular file; pass a file name")
    check(folder.is_dir(), f"{flag} {path}: folder {folder} does not exist")
    return _try(flag, path, lambda: tempfile.TemporaryFile(dir=folder).close(), f"write in {folder}")


def output_dir(flag, path):
    """A folder the run writes into, created with its parents if missing: the nearest folder up the path that
    exists must be one the run can write in."""
    folder = Path(os.path.abspath(_text(flag, path)))
    while not (found := _stat(flag, str(folder))):
        folder = folder.parent
    check(stat.S_ISDIR(found.st_mode), f"{flag} {path}: {folder} is not a folder; pass a folder")
    return _try(flag, path, lambda: tempfile.TemporaryFile(dir=folder).close(), f"write in {folder}")


def data_folder(flag, path):
    """A folder the data are read from, or downloaded into (fetch_dataset) when it is not there yet."""
    found = _stat(flag, path)
    if not found:
        return output_dir(flag, path)
    check(stat.S_ISDIR(found.st_mode), f"{flag} {path}: not a folder; pass the folder holding the data")
    return _try(flag, path, lambda: os.listdir(path), "be read")


# The kinds of flag values, Annotated with their placeholder in --help and parse(flag, text), which returns the
# value or raises UsageError as the command line is parsed: `seed: Seed = 1` gives `--seed N` and its rule.
INT64, FLOAT_MAX = 2**63 - 1, sys.float_info.max
Positive = Annotated[int, "N", _number(int, 1, INT64, "a whole number, 1 or more")]
NonNegative = Annotated[int, "N", _number(int, 0, INT64, "a whole number, 0 or more")]
Seed = Annotated[int, "N", _number(int, 0, 2**32 - 1, "a seed from 0 to 2**32 - 1 (numpy's range)")]
PositiveFloat = Annotated[float, "X", _number(float, 5e-324, FLOAT_MAX, "a positive number")]
# torch's RPC keeps a timeout in 32-bit milliseconds (beyond: negative, every RPC fails) and takes under 1 ms as none
Seconds = Annotated[float, "SECONDS", _number(float, 0.001, 2_147_483, "a number of seconds from 0.001 to 2147483")]
InFile = Annotated[str, "FILE", input_file]
OutFile = Annotated[str, "FILE", output_file]
OutDir = Annotated[str, "DIR", output_dir]
DataDir = Annotated[str, "DIR", data_folder]
PLAIN = {int: Annotated[int, "N", _number(int, -INT64 - 1, INT64, "a whole number that fits in 64 bits")],
         float: Annotated[float, "X", _number(float, -FLOAT_MAX, FLOAT_MAX, "a finite number")],
         str: Annotated[str, "TEXT", _text]}
HELP_WIDTH = 120  # the width of the docstrings: --help wraps the flags' texts as wide as its description


def _fields_in_source(args_cls):
    """{field: its docstring} and {first field of a group: the group's title}: the string under each field, and
    the comment lines of the class body, each of which starts a group of flags in --help."""
    source = inspect.getsource(args_cls)
    body, lines = ast.parse(source).body[0].body, source.splitlines()
    docs, groups, previous = {}, {}, 0
    for node, following in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign):
            comments = [line.strip(" #") for line in lines[previous:node.lineno - 1] if line.strip()[:1] == "#"]
            if comments:
                groups[node.target.id] = comments[-1]
            if isinstance(following, ast.Expr) and isinstance(getattr(following.value, "value", None), str):
                docs[node.target.id] = " ".join(following.value.value.split())
            previous = node.lineno
    return docs, groups


def _escaped(text):
    """text as one line that shows what was typed: each character that is not printable (a newline in a path, a
    terminal's escape code) written as Python writes it in a string, \\n or \\x1b."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def first_sentence(error):
    """An error's message cut to its first sentence, at most 200 characters, for a one-line report: torch's run to
    several sentences and lines."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0].split(". ")[0][:200]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, where argparse prints the usage first
        self.exit(2, f"{self.prog}: error: {_escaped(message)} (see --help)\n")


def parse_args(args_cls, argv=None):
    """Parse the command line into args_cls, a dataclass with one field per flag.

    Each field's docstring is its --help, and each comment line in the class body starts a group of flags. A
    `bool` field gives --flag/--no-flag, `Literal[...]` its choices, `Optional[T]` a flag that is off (None)
    unless given. Every value passes its kind's rule as it is parsed: numbers are finite and fit int64, text is
    not empty, and the kinds above add theirs (a Seed within numpy's range, an OutFile in an existing folder).
    """
    parser = _Parser(description=sys.modules[args_cls.__module__].__doc__, formatter_class=(
        lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=HELP_WIDTH, max_help_position=30)))
    docs, groups = _fields_in_source(args_cls)
    hints = typing.get_type_hints(args_cls, include_extras=True)
    group = parser
    for field in dataclasses.fields(args_cls):
        hint, flag = hints[field.name], "--" + field.name.replace("_", "-")
        if typing.get_origin(hint) is typing.Union:  # Optional[T]
            hint = typing.get_args(hint)[0]
        if field.name in groups:
            group = parser.add_argument_group(groups[field.name])
        text = docs.get(field.name, "").replace("%", "%%")
        options = dict(default=field.default, help=text if field.default is None else text + " (default: %(default)s)")
        if hint is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **options)
        elif typing.get_origin(hint) is typing.Literal:
            group.add_argument(flag, choices=typing.get_args(hint), **options)
        else:
            _, metavar, parse = typing.get_args(PLAIN.get(hint, hint))
            group.add_argument(flag, type=functools.partial(parse, flag), metavar=metavar, **options)
    return args_cls(**vars(parser.parse_args(argv)))


def check_processes(flag, count, oversubscribe):
    """At most 4 processes or threads per CPU here, unless --oversubscribe: a typo must not start thousands."""
    limit = 4 * usable_cpus()
    check(count <= limit or oversubscribe, f"{flag} {count}: more than {limit}, 4 per CPU of this machine; pass a "
                                           f"smaller number, or --oversubscribe to start them anyway")


def check_used(args, **unused):
    """A flag given a value other than its default that this run would not use is one line and exit 2, not a value
    dropped without a word: unused={flag name: when it is used ("with --generate"), where this run does not use it}."""
    defaults = {field.name: field.default for field in dataclasses.fields(args)}
    for name, when in unused.items():
        value, flag = getattr(args, name), "--" + name.replace("_", "-")
        given = (flag if value else f"--no-{flag[2:]}") if isinstance(value, bool) else f"{flag} {value}"
        check(value == defaults[name], f"{given}: used only {when}; drop it")


def check_memory(what, need, sizes):
    """What the run must hold at once (`need` bytes) against the memory this machine has free now: one line and exit 2
    naming `sizes`, the flags that set it, where an allocation would fail deep in the run or the kernel kill it."""
    free = psutil.virtual_memory().available
    check(need <= free, f"{what} need about {need / 2**30:.1f} GiB, and this machine has {free / 2**30:.1f} GiB free; "
                        f"pass a smaller {sizes}")


def one_line(error, sizes=None):
    """(the line, or "" for none, exit status) that ends a run on `error` as README's failure table says, or None for
    a bug, whose traceback shows. A UsageError or RunFailed says what to do; the output's reader gone (`| head`) ends
    the run quietly, status 141 as a SIGPIPE would; an output device that takes nothing more (full) says so; with
    `sizes` (the flags that set how much memory the run takes), an allocation that failed, here or in a spawned
    process (mp.spawn's message), says what did not fit and to pass smaller sizes."""
    prog = Path(sys.argv[0]).name
    text = error.msg if isinstance(error, mp.ProcessRaisedException) else f"{type(error).__name__}: {error}"
    allocation = re.search(r"(?:[Tt]ried to allocate|Unable to allocate) ([\d.]+) ?(\w+)", text)
    if isinstance(error, (UsageError, RunFailed)):
        return f"{prog}: error: {_escaped(str(error))}", error.status
    if isinstance(error, BrokenPipeError):
        return "", 141
    if isinstance(error, OSError) and error.filename is None and error.errno in (errno.ENOSPC, errno.EIO, errno.EBADF):
        return f"{prog}: error: cannot write the output ({error.strerror}); send it elsewhere", 1
    if sizes and (allocation or "MemoryError" in text):
        what = " ".join(allocation.groups()) if allocation else "an allocation"
        if allocation and allocation[2] == "bytes":
            what = f"{float(allocation[1]) / 2**30:.1f} GiB"
        return f"{prog}: error: out of memory: {what} did not fit; pass a smaller {sizes}", 1
    return (error.msg.strip(), 1) if isinstance(error, mp.ProcessRaisedException) else None


def run_main(main, sizes="size"):
    """Call main() and end as README's failure table says (one_line, with `sizes` naming the flags that set how much
    memory the run takes): a spawned process that raised is named with its traceback (mp.spawn's message), one killed
    by a signal in one line; one that exited with a status has said why itself; Ctrl-C is exit status 130."""
    prog = Path(sys.argv[0]).name
    if sys.stdout is None:  # started with its output closed (>&-): a file opened later would take its place
        print(f"{prog}: error: the output is closed; give the run somewhere to write it", file=sys.stderr)
        sys.exit(2)
    sys.stdout.reconfigure(errors="backslashreplace")  # characters the output's encoding lacks (PYTHONIOENCODING)
    gc.freeze()  # what is imported by now (torch's many objects) is no garbage: no collection walks it, even at exit
    try:
        return main()
    except mp.ProcessExitedException as error:
        message = f"{prog}: error: {error.msg}; the other processes were stopped" if error.signal_name else ""
        status = 1 if error.signal_name else error.exit_code
        status = 130 if error.signal_name == "SIGINT" else status
    except KeyboardInterrupt:
        message, status = "", 130
    except Exception as error:
        if one_line(error, sizes) is None:
            raise
        message, status = one_line(error, sizes)
    if status == 130:
        message = f"{prog}: interrupted; every process was stopped"
    try:
        sys.stdout.flush()
    except OSError:  # the output is what failed: Python would flush it again at exit, and complain
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    print(message, file=sys.stderr, end="\n" if message else "", flush=True)
    sys.exit(status)


# ---------------------------------------------------------------------------------------------------------
# 2. Processes: what mp.spawn does not do, torchrun's environment, rendezvous, process groups and RPC
# ---------------------------------------------------------------------------------------------------------

def worker(run_worker):
    """Decorator of a script's run_worker(rank, world_size, ...), which mp.spawn starts in every process (and main
    calls once under torchrun). mp.spawn ends the run when a process raises or dies, terminates the others and hands
    the traceback to the parent (run_main prints it). This gives each process its share of the cores (torch's
    threads) and adds what mp.spawn does not do:
    - an error with a line of its own (one_line: bad input, a full disk or output device) ends it with that line
      and status, the output's reader gone ends it quietly; an RPC group is shut down in order first, so that its
      peers log no lost connection;
    - a process whose peer is gone or silent past the timeout says so in one line, exit status 1. Spawned, it
      waits a second first: when the peer died, the launcher names it and stops this process meanwhile;
    - Ctrl-C, ignored until here (see rendezvous), ends it at once and quietly, even in a C++ call: the launcher
      says it once;
    - the process dies at once with its parent (mp.spawn asks for SIGINT, which a process blocked in a C++
      collective does not act on until the collective times out);
    - a process that is done leaves without the interpreter's teardown, which destroys torch's C++ objects (a gloo
      group DDP still holds, RPC agents, CUDA contexts) in no set order and can abort a run that succeeded."""
    @functools.wraps(run_worker)
    def run(rank, world_size, *args):
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends it at once, in C++ too, without a traceback
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        torch.set_num_threads(max(1, usable_cpus() // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
        message, status = "", 0
        try:
            if env := torchrun_env():  # spawned, the launcher did this for every process (rendezvous)
                check_machine(world_size)
                if env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] and loopback(env["MASTER_ADDR"]):
                    listen_on_loopback()  # one machine: torchrun --standalone, or a MASTER_ADDR of localhost
            run_worker(rank, world_size, *args)
        except Exception as error:
            lost = isinstance(error, dist.DistError) or any(sign in str(error) for sign in LOST_PEER)
            if isinstance(error, RuntimeError) and lost:
                time.sleep(0 if torchrun_env() else 1)
                message, status = (f"process {rank} lost a peer ({first_sentence(error)}); the run ends, or under "
                                   f"torchrun restarts if --max-restarts allows"), 1
            elif one_line(error) is None:
                raise
            else:
                message, status = one_line(error)
            if isinstance(error, (UsageError, RunFailed)):  # an RPC group ends in order: its peers log no lost link
                with contextlib.suppress(Exception):
                    dist.rpc.shutdown()
        with contextlib.suppress(OSError):  # the output may be what failed
            print(message + "\n" if message else "", file=sys.stderr, end="", flush=True)  # one write: other
            sys.stdout.flush()  # processes may be writing too, unbuffered (PYTHONUNBUFFERED)
        os._exit(status)
    return run


LOST_PEER = ("peer", "tensorpipe", "imed out", "RPC ran for more than")  # in the messages of a lost or silent peer


def check_machine(world_size):
    """What the processes of a run need from this machine, checked before any starts: open files enough for
    TensorPipe's and gloo's connections (the soft limit raised to what they need, within the hard limit: TensorPipe
    aborts the process when it runs out, at about 100 + 64 per process), and the network interfaces that
    GLOO_SOCKET_IFNAME and TP_SOCKET_IFNAME name, where these are set."""
    need = 128 + 80 * world_size
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    check(hard == resource.RLIM_INFINITY or hard >= need, f"the open-file limit is {hard}, and {world_size} processes "
          f"need about {need}; raise it (ulimit -n {need}) or start fewer processes")
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    interfaces = sorted(name for _, name in socket.if_nameindex())
    for variable in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"):
        wrong = [name for name in os.environ.get(variable, "").split(",") if name and name not in interfaces]
        check(not wrong, f"{variable}={os.environ.get(variable)}: this machine has no network interface "
                         f"{', '.join(wrong)} (it has {', '.join(interfaces)}); unset it or name one of them")


def loopback(host):
    return ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0]).is_loopback


def listen_on_loopback():
    """Every socket that gloo, TensorPipe and NCCL open on the loopback interface (their variables, unless set)."""
    name = next(name for _, name in socket.if_nameindex() if name.startswith("lo"))
    for variable in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(variable, name)


@contextlib.contextmanager
def rendezvous(world_size):
    """Around mp.spawn on one machine, after check_machine: a private folder, removed afterwards, whose files the
    processes meet through (init_process_group and init_rpc each take one), so two runs at once never collide; every
    socket they open on loopback (listen_on_loopback); torch's C++ warnings off, unless
    set; and Ctrl-C ignored until join: the processes that mp.spawn starts meanwhile inherit that until their
    worker takes Ctrl-C back, since one interrupted while it starts (reading what mp.spawn sends it, importing torch)
    would print a traceback. SIGTERM (a job scheduler's stop, `timeout`) exits with status 143, as a shell reports that
    signal, without a line, but through this block: the processes are stopped and the folder is removed."""
    check_machine(world_size)
    listen_on_loopback()
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # not the peers' C++ warnings when a process dies
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # its "Terminating process" notes
    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
    terminate = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with tempfile.TemporaryDirectory(prefix="rendezvous-") as folder:
        try:
            yield f"file://{folder}/store"
        finally:  # a process that mp.spawn started before it failed to start the next
            for process in mp.active_children():
                process.kill()
            signal.signal(signal.SIGINT, interrupt)
            signal.signal(signal.SIGTERM, terminate)


def join(processes):
    """Wait for the processes of mp.spawn(..., join=False), as its join=True does, once they have all started: Ctrl-C,
    ignored while they started (rendezvous), interrupts the launcher again (run_main reports it, and rendezvous stops
    the processes that are still starting), as it ends each process that runs its worker. When one fails, the others
    end at once: a grace period of 0 instead of mp.spawn's 30 s, which only a stopped process (SIGSTOP, deaf to
    SIGTERM) would use, since the workers do not catch SIGTERM."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    while not processes.join(grace_period=0):
        pass


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
    number = {name: int(env[name]) if env[name].isdecimal() else -1 for name in TORCHRUN_VARIABLES[:5]}
    check(0 <= number["RANK"] < number["WORLD_SIZE"] < 2**31 and 0 <= number["LOCAL_RANK"]
          < number["LOCAL_WORLD_SIZE"] <= number["WORLD_SIZE"] and 0 < number["MASTER_PORT"] < 2**16,
          f"{' '.join(f'{name}={env[name]}' for name in number)}: want ranks below their sizes and a port below "
          f"65536; {fix}")
    try:
        socket.getaddrinfo(env["MASTER_ADDR"], number["MASTER_PORT"])
    except (OSError, UnicodeError) as error:
        raise UsageError(f"MASTER_ADDR={env['MASTER_ADDR']}: {error}; give torchrun node 0's address") from None
    return {**env, **number}


def process_count(spawned):
    """The number of processes of this run: torchrun's WORLD_SIZE under torchrun, else `spawned`."""
    env = torchrun_env()
    return env["WORLD_SIZE"] if env else spawned


def local_rank(rank):
    """This process's index on its machine: torchrun's LOCAL_RANK, or a spawned run's rank (one machine)."""
    return int(os.environ.get("LOCAL_RANK", rank))


def usable_cpus():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def init_process_group(store, rank, world_size, backend, timeout_s, device_id=None):
    """Join the default process group; every collective fails after timeout_s instead of hanging."""
    dist.init_process_group(backend, init_method=_address(store, "pg"), rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), device_id=device_id)


def init_rpc(store, name, rank, world_size, timeout_s, device_maps=None, devices=None):
    """Join the RPC group as `name`; an RPC whose peer is gone fails after timeout_s instead of hanging."""
    from torch.distributed import rpc
    # torch's own RPC set-up and shutdown call a deprecated process-group API; nothing for a user to act on.
    warnings.filterwarnings("ignore", message="You are using a Backend")
    options = rpc.TensorPipeRpcBackendOptions(init_method=_address(store, "rpc"), rpc_timeout=timeout_s,
                                              device_maps=device_maps, devices=devices)
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)


def _address(store, name):
    """A rendezvous address of its own for each group (process group, RPC): a file of rendezvous()'s folder, or
    torchrun's env://, which under an agent whose store outlives restarts is round_store's namespace."""
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

    torchrun's agent hosts one TCPStore for the whole job and the workers of every round use it
    (TORCHELASTIC_USE_AGENT_STORE=True; elastic/rendezvous/dynamic_rendezvous.py creates it in the first round
    only), while torch's env:// rendezvous puts no per-round prefix on the keys. After a restart (--max-restarts)
    the keys in which gloo's ranks, NCCL or TensorPipe published their addresses still hold the dead round's
    values, and a rank that reads one before its peer has rewritten it connects to a closed port or hangs.
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
    token, deadline = os.urandom(16).hex(), time.monotonic() + timeout_s
    challenges = [f"{name}/challenge/{peer}" for peer in range(1, world_size)]
    while (joined := shared.add(f"{name}/{token}/joined", 0)) < world_size - 1:
        if time.monotonic() > deadline:
            raise RunFailed(f"{world_size - 1 - joined} process(es) did not join within {timeout_s:g} s; check that "
                            f"every machine of the run started")
        shared.wait(challenges)  # this round's, or a dead round's
        answers = [f"{name}/answer/{challenge.decode()}" for challenge in shared.multi_get(challenges)]
        shared.multi_set(answers, [token] * len(answers))
        time.sleep(0.05)
    return dist.PrefixStore(f"{name}/{token}/", shared)


# ---------------------------------------------------------------------------------------------------------
# 3. Devices
# ---------------------------------------------------------------------------------------------------------

def pick_device(use_gpu, index):
    """GPU `index` of this machine, made this process's current device, when use_gpu, else the CPU: the accelerator
    that torch.accelerator finds (CUDA, ROCm, Intel's XPU, ...). A missing one is a UsageError."""
    if not use_gpu:
        return torch.device("cpu")
    count = torch.accelerator.device_count()
    check(0 <= index < count, f"no GPU {index} here ({count} found); run without the GPU flag")
    torch.accelerator.set_device_index(index)
    return torch.device(torch.accelerator.current_accelerator().type, index)


def set_tf32(device, allowed):
    """On a CUDA device, let float32 matrix products and convolutions on Ampere and newer GPUs run in TF32 (relative
    error near 1e-3), or keep them in IEEE float32, as every comparison with another device needs; elsewhere, nothing.
    Through torch's allow_tf32 flags, which every getter reads back (torch 2.13's fp32_precision setters would make
    the allow_tf32 getters raise, in this script and in any library it calls)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = allowed


# ---------------------------------------------------------------------------------------------------------
# 4. Files: atomic writes, verified checkpoints, figures, the result line
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
        with contextlib.suppress(OSError, TypeError):  # TypeError: no temporary file was made
            os.unlink(tmp)
        where = f"pass another {flag}" if flag else "write elsewhere"
        raise RunFailed(f"cannot write {path} ({error.strerror or error}); free space on that disk, lift the "
                        f"file-size limit or {where}; {kept}") from None


def save_figure(figure, path, flag=None, kept="the previous file, if any, is intact"):
    """A matplotlib figure into path (.png, .pdf or .svg, by its suffix) through write_or_fail; closes it."""
    import matplotlib.pyplot as plt
    data = io.BytesIO()
    figure.tight_layout()
    figure.savefig(data, format=Path(path).suffix[1:].lower(), dpi=100)
    plt.close(figure)
    write_or_fail(path, data.getvalue(), flag, kept)


def checkpoint_file(folder, name, save=None):
    """The file `name` in `folder` (--checkpoint-dir) that the run writes its checkpoints to, checked before any work:
    nothing yet or a file the run may replace (output_file), and not the file --save writes, which would write over
    it."""
    path = os.path.join(folder, name)
    if os.path.isdir(folder):  # else output_dir has checked that the run can create it
        output_file("--checkpoint-dir", path)
    check(not save or os.path.realpath(save) != os.path.realpath(path),
          f"--save {save}: the checkpoint that --checkpoint-dir writes; pass another file")
    return path


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
        raise UsageError(f"{flag} {path}: not a readable checkpoint ({first_sentence(error)}); pass one written by "
                         f"{script}.py or delete it") from None
    check(damaged is None, f"{flag} {path}: damaged ({damaged} does not match its checksum); delete it or pass "
                           f"another checkpoint")
    origin = saved.get("script", "another program") if isinstance(saved, dict) else "another program"
    check(origin == script, f"{flag} {path}: written by {origin}, not by {script}.py; pass one of its checkpoints")
    missing = [key for key in keys if key not in saved]
    check(not missing, f"{flag} {path}: lacks {', '.join(missing)}; it was written by another version of "
                       f"{script}.py: pass a newer checkpoint")
    return saved


def check_fits(target, state, flag, path):
    """target.load_state_dict(state) (a module or an optimizer); weights that do not fit are a UsageError naming the
    first mismatch. Returns target."""
    try:
        target.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
        raise UsageError(f"{flag} {path}: does not fit this model ({lines[min(1, len(lines) - 1)][:200]}); pass a "
                         f"file written by this script with the same model flags") from None
    return target


def emit_result(script, **figures):
    """The run's last line: one JSON object that tests and benchmarks read. Strict JSON, which has no NaN or Infinity:
    a number that is not finite (the loss of a run that diverged) is null."""
    text = json.dumps({"script": script, **figures})
    print(json.dumps(json.loads(text, parse_constant=lambda constant: None)), flush=True)


# ---------------------------------------------------------------------------------------------------------
# 5. Data: download once into a cache, verify checksums
# ---------------------------------------------------------------------------------------------------------

def md5(data):
    return hashlib.md5(data).hexdigest()


def fetch_dataset(data_dir, subdir, files, mirrors, checksum=md5):
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
    for name in [name for name in files if not (candidates[0] / name).is_file()]:
        errors = []
        for url in [mirror + name for mirror in mirrors]:
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


FASHION_MNIST_MIRRORS = ["http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
                         "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/"]
# md5 of the decompressed IDX files, as published with the data set
FASHION_MNIST_FILES = {"train-images-idx3-ubyte.gz": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
                       "train-labels-idx1-ubyte.gz": "9018921c3c673c538a1fc5bad174d6f9",
                       "t10k-images-idx3-ubyte.gz": "8181f5470baa50b63fa0f6fddb340f0a",
                       "t10k-labels-idx1-ubyte.gz": "15d484375f8d13e6eb1aabb0c3f46965"}
FASHION_MNIST_TRAIN = 60_000  # images in the training split
FASHION_MNIST_TEST = 10_000  # images in the test split


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
        dims = raw[3]  # the IDX header: magic number, then one big-endian 4-byte size per dimension
        shape = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims)]
        tensors.append(torch.frombuffer(bytearray(raw[4 + 4 * dims:]), dtype=torch.uint8).view(*shape))
    return tensors[0], tensors[1].long(), tensors[2], tensors[3].long()
